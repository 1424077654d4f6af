/* Internal structures of the trace analyzer (src/trace). Not public API. */
#ifndef FM_TRACE_INTERNAL_H
#define FM_TRACE_INTERNAL_H
#include "fp4moe.h"
#include "util/util.h"

#include <regex.h>
#include <stdbool.h>
#include <stdint.h>

/* Times are kept as integer nanoseconds: Kineto writes microseconds with
 * three decimals, so ns are exact, and timestamps near 1.7e15 us would lose
 * their fraction in a double. */

/* One GPU activity (kernel, memcpy, memset) of one file. */
typedef struct {
    int64_t ts, dur;  /* ns                                              */
    int64_t corr;     /* args.correlation, -1 when absent                */
    uint32_t name;    /* index into the owning name table                */
    uint32_t stream;  /* index into the owning stream table              */
} fm_tr_gpu;

/* A CUDA runtime / driver call with a correlation id (kernel launches). */
typedef struct {
    int64_t ts;
    int64_t corr;
} fm_tr_launch;

typedef enum { FM_TR_SPAN_PROFILER = 0, FM_TR_SPAN_SGLANG = 1 } fm_tr_span_kind;

/* A step annotation: ProfilerStep#N or SGLang step[DECODE bs=N]. */
typedef struct {
    int64_t ts, dur;
    int64_t num;      /* N of ProfilerStep#N, or bs of step[DECODE bs=N]  */
    int64_t ext;      /* args."External id", -1 when absent              */
    uint8_t kind;     /* fm_tr_span_kind                                 */
    uint8_t gpu;      /* 1: gpu_user_annotation (GPU timeline)           */
} fm_tr_span;

/* Interned strings: open addressing, insertion order kept. */
typedef struct {
    char **str;
    uint32_t *len;
    size_t n, cap;
    uint32_t *slots; /* index + 1, 0 = empty */
    uint64_t *hashes;
    size_t nslots;
} fm_tr_strtab;

fm_status fm_tr_strtab_init(fm_tr_strtab *t);
void fm_tr_strtab_free(fm_tr_strtab *t);
/* Returns the index of s (inserted if new), or -1 on allocation failure. */
int64_t fm_tr_strtab_intern(fm_tr_strtab *t, const char *s, size_t len);
uint64_t fm_tr_hash(const void *p, size_t n);

/* Everything one trace file contributes. */
typedef struct {
    char *path;
    uint64_t bytes;       /* uncompressed bytes parsed                  */
    int compressed;
    double parse_s;
    int rank_hint;        /* -TP-r in the file name, else -1            */
    int dist_rank;        /* distributedInfo.rank, else -1              */
    fm_tr_strtab names;   /* GPU activity names                         */
    uint8_t *name_is_mem; /* per name: came from gpu_memcpy/gpu_memset  */
    size_t name_is_mem_cap;
    int64_t *streams;     /* pairs (pid id, tid id) per stream index    */
    size_t nstreams, streams_cap;
    fm_tr_gpu *gpu;
    size_t ngpu, gpu_cap;
    fm_tr_launch *launch;
    size_t nlaunch, launch_cap;
    fm_tr_span *span;
    size_t nspan, span_cap;
    int64_t n_events;     /* traceEvents entries seen                   */
    int64_t n_unmatched;  /* B without E, E without B                   */
    int64_t n_span_merged; /* per-stream GPU spans folded into their step's */
} fm_tr_file;

/* Parses one trace from a byte source. read() fills dst with up to cap
 * bytes, sets *got (0 = end of input) and returns FM_OK or an error. */
typedef fm_status (*fm_tr_read_fn)(void *ctx, uint8_t *dst, size_t cap, size_t *got);
fm_status fm_tr_parse(fm_tr_read_fn rd, void *ctx, const char *label, fm_tr_file *out);
fm_status fm_tr_parse_path(const char *path, fm_tr_file *out);
fm_status fm_tr_parse_mem(const void *buf, size_t len, const char *label, fm_tr_file *out);
void fm_tr_file_free(fm_tr_file *f);

/* ---- streaming JSON reader (trace_json.c), driven by the event parser (trace_events.c) */
#define FM_TR_MAX_DEPTH 512

typedef struct {
    fm_tr_read_fn rd;
    void *ctx;
    const char *label;
    uint8_t *buf;
    size_t cap, pos, end;
    uint64_t base; /* stream offset of buf[0] */
    int eof;
    fm_status st;  /* first error */
    int depth;
    uint8_t stack[FM_TR_MAX_DEPTH]; /* container kinds while skipping */
    /* scratch for unescaped strings */
    char *sb;
    size_t sb_len, sb_cap;
} fm_tr_jr;

/* Records the first error, "label: byte N: what"; returns it. */
fm_status fm_tr_jr_fail(fm_tr_jr *r, size_t at, const char *what);
/* Skips whitespace, refilling; next byte (not consumed), -1 at end, -2 on error. */
int fm_tr_jr_ws_slow(fm_tr_jr *r);
/* Stream offset of buf[i], for error messages. */
static inline uint64_t fm_tr_jr_off(const fm_tr_jr *r, size_t i) { return r->base + i; }

/* Most tokens follow zero or one byte of whitespace: test those inline. */
static inline int fm_tr_jr_ws(fm_tr_jr *r) {
    size_t p = r->pos;
    if (p + 1 < r->end) {
        uint8_t c = r->buf[p];
        if (c > ' ') return c;
        if (c == ' ' && r->buf[p + 1] > ' ') {
            r->pos = p + 1;
            return r->buf[p + 1];
        }
    }
    return fm_tr_jr_ws_slow(r);
}

/* The string at r->pos ('"'), unescaped; *s / *n valid until the next read. 0 or -1. */
int fm_tr_jr_string(fm_tr_jr *r, const char **s, size_t *n);
/* The number at r->pos; *s / *n view its text. 0 or -1. */
int fm_tr_jr_number(fm_tr_jr *r, const char **s, size_t *n);
/* Reports the byte at r->pos as the start of an invalid value. */
void fm_tr_jr_unexpected(fm_tr_jr *r);
/* Whitespace, then the ':' after an object key. 0 or -1. */
int fm_tr_jr_colon(fm_tr_jr *r, const char *eof_msg);
/* After a member / element: 1 and *ch = next token after ',', 0 after close, -1 on error. */
int fm_tr_jr_next(fm_tr_jr *r, int *ch, int close, const char *eof_msg, const char *what);
/* Validates and skips one JSON value of any kind. 0 or -1. */
int fm_tr_jr_skip(fm_tr_jr *r);
/* Decimal microseconds to integer ns; integer text to int64. 0, or -1 if out of range / not a number. */
int fm_tr_us_text_to_ns(const char *s, size_t n, int64_t *out);
int fm_tr_text_to_i64(const char *s, size_t n, int64_t *out);
/* fm_tr_parse with a first buffer of cap_hint bytes (0: the default chunk). */
fm_status fm_tr_parse_sized(fm_tr_read_fn rd, void *ctx, const char *label, size_t cap_hint, fm_tr_file *f);

/* ---- categories */
enum {
    FM_CAT_ATTENTION = 0,
    FM_CAT_MOE_GEMM,
    FM_CAT_COMM,
    FM_CAT_MOE_QUANT,
    FM_CAT_MOE_ROUTING,
    FM_CAT_MOE_ACT,
    FM_CAT_GEMM,
    FM_CAT_MEMORY,
    FM_CAT_GLUE,
    FM_CAT_OTHER,
    FM_CAT_BUILTIN_COUNT
};

typedef struct {
    regex_t re;
    int cat;
    char *pattern;
    int user; /* from the rules file */
} fm_tr_rule;

typedef struct fm_tr_rules {
    fm_tr_rule *rules;
    size_t n;
    char **cats; /* category names; the first FM_CAT_BUILTIN_COUNT are built in */
    size_t ncats;
} fm_tr_rules;

#endif
