/* Private to src/tune: the tuned config file, its parser and writer. */
#ifndef FM_TUNE_INTERNAL_H
#define FM_TUNE_INTERNAL_H
#include "fp4moe.h"

/* A config file holds at most this many batch buckets; more is malformed. */
#define FM_TUNE_MAX_BUCKETS 64
/* Config files are small; anything larger is refused unread. */
#define FM_TUNE_MAX_FILE_BYTES (1u << 20)
/* Upper bound on fm_tune_candidates' grid. */
#define FM_TUNE_GRID_MAX 64
/* The "fp4moe_tune_config" value this code writes and accepts. */
#define FM_TUNE_FILE_VERSION 1

typedef struct {
    int batch;
    fm_kernel_config cfg;                 /* the winner (maybe the default) */
    double us, us_min, us_max;
    fm_kernel_config default_cfg;
    int has_default_cfg;
    double default_us, default_us_min, default_us_max;
    int replaced_default;
    char date[32];
    char version[32];
} fm_tune_bucket;

typedef struct {
    fm_tune_key key;
    int n;                                /* buckets, sorted by batch       */
    fm_tune_bucket b[FM_TUNE_MAX_BUCKETS];
} fm_tune_file;

/* Parses and validates one config file's text. `what` names the file in
 * messages. FM_E_FORMAT with a message naming the field on any problem. */
fm_status fm_tune_file_parse(const char *text, size_t len, const char *what, fm_tune_file *out);
/* A kernel config as the JSON object config files use for "params". The
 * return type is json_t * (jansson); void * keeps jansson out of this header. */
void *fm_tune_params_json(const fm_kernel_config *c);
/* Serializes (malloc'd, pretty-printed, trailing newline); NULL on OOM. */
char *fm_tune_file_to_json(const fm_tune_file *f);
/* Inserts or replaces the bucket of the same batch, keeping order. */
fm_status fm_tune_file_put(fm_tune_file *f, const fm_tune_bucket *b);

typedef enum {
    FM_TUNE_MATCH = 0,     /* usable (note may say versions differ)          */
    FM_TUNE_MISMATCH_SHAPE,/* another GPU name or shape: not this key's file */
    FM_TUNE_MISMATCH_SM    /* same GPU name and shape, other SM count        */
} fm_tune_match;
/* Compares a file's key with the wanted one. note: why not, or the
 * version differences of a usable file ("" if none). */
fm_tune_match fm_tune_key_match(const fm_tune_key *file_key, const fm_tune_key *want,
                                char *note, size_t cap);

/* Validates a kernel config's ranges; 0 if fine, else writes why. */
int fm_tune_config_invalid(const fm_kernel_config *c, char *why, size_t cap);
/* "small" / "large" as config files spell the path; -1 if unknown. */
const char *fm_tune_path_token(fm_kernel_path p);
int fm_tune_path_from_token(const char *s);

/* Loads a config file through the in-memory cache. 1: parsed and valid
 * (copied to out); 0: missing (errno-like ENOENT); -1: unreadable or
 * malformed, msg says why. */
int fm_tune_load_cached(const char *path, fm_tune_file *out, char *msg, size_t cap);

/* One directory of the lookup (the public fm_tune_lookup). */
typedef fm_tune_lookup fm_tune_trail;
/* fm_tune_choose, also reporting each directory's outcome (trail may be
 * NULL). */
fm_status fm_tune_choose_trail(const fm_tune_key *key, int T, fm_tune_choice *out, fm_tune_trail trail[FM_TUNE_NDIRS]);

/* 1 when a config file for the key's GPU (any shape, any SM count) is in
 * one of the lookup directories dirs ("": not set) or among the shipped
 * ones the build saw; 0: fp4moe's kernels were never measured on it. */
int fm_tune_gpu_measured(const fm_tune_key *key, char dirs[FM_TUNE_NDIRS][1024]);

/* mkdir -p. */
fm_status fm_tune_mkdirs(const char *dir);
/* Current UTC time as "2026-11-29T10:00:00Z". */
void fm_tune_now_iso(char *buf, size_t cap);

/* Appends printf-style text to buf (bounded; truncates silently). */
void fm_tune_appendf(char *buf, size_t cap, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
#endif
