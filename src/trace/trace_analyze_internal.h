/* Internal: the analysis result shared by trace_analyze.c and trace_output.c. */
#ifndef FM_TRACE_ANALYZE_INTERNAL_H
#define FM_TRACE_ANALYZE_INTERNAL_H
#include "trace/trace_internal.h"

#include <stdarg.h>

typedef struct {
    int64_t count, in_count;
    double total_ns, in_ns;
    double mean_ns, p50_ns, p90_ns, p99_ns, max_ns;
    int heavy;
} fm_tr_gstat;

typedef struct {
    int64_t ws, we;  /* GPU window (ns)                        */
    int64_t num;     /* ProfilerStep N, or SGLang batch size   */
    double wall, busy, comm, overlap; /* ns                    */
    int64_t n_events;
    int rank;
} fm_tr_step;

#define FM_TR_MAX_NOTES 8

typedef struct {
    char *label;
    char **files;
    int nfiles;
    uint64_t bytes;
    double parse_s;
    int nstreams;
    char method[512];
    int whole_trace;
    int nsteps;
    fm_tr_step *steps;
    double *step_cat_ns;     /* [nsteps][ncats]                        */
    int64_t outside_events;
    double outside_ns;
    int64_t unmatched;
    fm_trace_kernel *kern;   /* by total time                          */
    uint32_t *kern_g;        /* global name index of each kern[]       */
    size_t nkern;
    fm_tr_gstat *cats;       /* per category                           */
    double *cat_ms;          /* per category: mean, sd, min, max ms/step */
    double wall_sd;
    fm_trace_step_info info;
    char notes[FM_TR_MAX_NOTES][256];
    int nnotes;
} fm_tr_unit;

struct fm_trace {
    fm_trace_options opts;
    char *marker;
    fm_tr_rules *rules;
    fm_tr_strtab names; /* all GPU activity names          */
    int *name_cat;      /* category of each name           */
    uint8_t *name_marker;
    fm_tr_unit *ranks;
    int nranks;
    fm_tr_unit all;     /* every rank together             */
};

fm_status fm_tr_rules_load(const char *path, fm_tr_rules **out);
void fm_tr_rules_free(fm_tr_rules *r);
int fm_tr_rules_match(const fm_tr_rules *r, const char *name, int is_mem);
const char *fm_tr_builtin_cat_name(int cat);
const fm_tr_unit *fm_tr_unit_of(const fm_trace *t, int rank);

#endif
