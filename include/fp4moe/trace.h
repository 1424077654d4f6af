/* PyTorch-profiler trace analysis; included by fp4moe.h (users include fp4moe.h). */
#ifndef FP4MOE_TRACE_H
#define FP4MOE_TRACE_H

#ifndef FP4MOE_H
#error "include fp4moe.h, not fp4moe/trace.h"
#endif

/* ---------------------------------------------------- trace analysis (src/trace) */
/* @section trace begin */
/*
 * Streaming analysis of Kineto (PyTorch-profiler) Chrome-trace JSON, plain
 * or gzip, one file per rank (SGLang "...-TP-{r}..." files are grouped by
 * rank). GPU activities are the events with ph "X" and cat "kernel",
 * "gpu_memcpy" or "gpu_memset" (case-insensitive). See docs/trace.md.
 */
typedef enum {
    FM_TRACE_STEPS_AUTO = 0, /* ProfilerStep#N, else SGLang step[DECODE bs=N], else one step */
    FM_TRACE_STEPS_PROFILER,
    FM_TRACE_STEPS_SGLANG,
    FM_TRACE_STEPS_MARKER    /* each kernel matching the marker regex starts a step */
} fm_trace_steps;

typedef enum { FM_TRACE_TEXT = 0, FM_TRACE_CSV, FM_TRACE_JSON, FM_TRACE_HTML } fm_trace_format;

typedef struct {
    fm_trace_steps steps;
    const char *marker;     /* POSIX extended regex for FM_TRACE_STEPS_MARKER */
    const char *rules_path; /* JSON [{"regex": ..., "category": ...}] or NULL */
    int jobs;               /* files parsed in parallel; 0 = one per core    */
    int top;                /* kernels listed in text / HTML; 0 = 25         */
} fm_trace_options;

typedef struct fm_trace fm_trace;

/* Parses and analyzes n files. Fails (no partial result) on any malformed
 * input; the message names the file and the byte offset. */
fm_status fm_trace_open(const char *const *paths, int n, const fm_trace_options *o, fm_trace **out);
/* The same on one in-memory JSON document (tests, fuzzing). */
fm_status fm_trace_open_mem(const void *buf, size_t len, const fm_trace_options *o, fm_trace **out);
void fm_trace_free(fm_trace *t);

fm_status fm_trace_write_summary(const fm_trace *t, fm_trace_format f, FILE *out);
/* Per-category ms/step of a and b, their delta and each one's share of the
 * total delta, and the per-kernel deltas that explain it. */
fm_status fm_trace_write_diff(const fm_trace *a, const fm_trace *b, fm_trace_format f, FILE *out);

/* Category of a kernel name under t's rules ("attention", "moe_gemm", ...). */
const char *fm_trace_categorize(const fm_trace *t, const char *kernel_name);

typedef struct {
    const char *name;
    const char *category;
    int64_t count;          /* over the whole trace                         */
    double total_us;        /* over the whole trace                         */
    double mean_us, p50_us, p90_us, p99_us, max_us; /* percentiles: linear interpolation */
    double per_step;        /* events inside steps / number of steps        */
    double ms_per_step;     /* time inside steps / number of steps          */
    int heavy_tail;         /* mean >= 2 x median over >= 5 events          */
} fm_trace_kernel;

typedef struct {
    int n_steps;
    const char *method;     /* how steps were found, in words               */
    double wall_ms, busy_ms, idle_ms;       /* means over steps             */
    double comm_ms, overlap_ms;             /* union of communication time, and the part overlapped by compute */
    double gap_ms;          /* mean GPU gap between consecutive steps       */
    int64_t outside_events; /* GPU events outside every step                */
} fm_trace_step_info;

/* rank in [0, fm_trace_rank_count) or -1 for all ranks combined. */
int fm_trace_rank_count(const fm_trace *t);
const char *fm_trace_rank_label(const fm_trace *t, int rank);
size_t fm_trace_kernels(const fm_trace *t, int rank, const fm_trace_kernel **out); /* by total time */
fm_status fm_trace_step_summary(const fm_trace *t, int rank, fm_trace_step_info *out);
/* Mean ms per step of a category (0 when absent). */
double fm_trace_category_ms(const fm_trace *t, int rank, const char *category);
/* @section trace end */

#endif /* FP4MOE_TRACE_H */
