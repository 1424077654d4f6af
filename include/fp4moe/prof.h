/* profiling, telemetry, reports; included by fp4moe.h (users include fp4moe.h). */
#ifndef FP4MOE_PROF_H
#define FP4MOE_PROF_H

#ifndef FP4MOE_H
#error "include fp4moe.h, not fp4moe/prof.h"
#endif

/* ---------------------------------------------------- profiling and telemetry (src/prof) */
/* @section prof begin */
/*
 * `fp4moe profile`: where a decode step's time goes, per phase and batch size,
 * beside telemetry and a performance model (the bandwidth floor). A step is
 * every MoE layer of the model once. See docs/profiling.md.
 */

/* Where the per-phase times came from. */
typedef enum {
    FM_TSRC_HOST = 0, /* host clock around each phase (CPU engine)          */
    FM_TSRC_EVENTS,   /* CUDA events between phases                         */
    FM_TSRC_CUPTI     /* CUPTI activity records, kernel by kernel (graphs too) */
} fm_time_source;
const char *fm_time_source_name(fm_time_source s); /* "host clock", ... */

/* Phase of one of fp4moe's GPU kernels, from its (possibly mangled) name:
 * shared, route, sort, gate_up/gateup, down, combine, act; else FM_PH_OTHER. */
fm_phase fm_prof_kernel_phase(const char *kernel_name);

/* Distinct experts hit by B tokens under uniform top-k routing:
 * E * (1 - (1 - k/E)^B). */
double fm_prof_expected_active(int E, int k, int B);
/* Fraction of tile rows that carry a token when each expert's tokens are
 * padded to a multiple of tile_n (experts without tokens run no tile).
 * -1 when tile_n <= 0 or no expert has a token. */
double fm_prof_tile_fill(const int32_t *tokens_per_expert, int E, int tile_n);
/* The same expected under uniform routing (each expert's count binomial
 * (B, k/E)): E[tokens] / E[padded rows]. -1 when tile_n <= 0. */
double fm_prof_tile_fill_expected(int E, int k, int B, int tile_n);
/* Bytes of a [rows, cols] matrix in a format (packed + block scales). */
double fm_prof_matrix_bytes(fm_qformat f, int64_t rows, int64_t cols);

/* ---- telemetry: a background sampler (NVML for a GPU, /proc/stat always) */
typedef enum {
    FM_TM_SM_UTIL = 0, /* NVML GPU utilization %                           */
    FM_TM_MEM_UTIL,    /* NVML memory-controller utilization %             */
    FM_TM_POWER_W,
    FM_TM_POWER_LIMIT_W,
    FM_TM_SM_MHZ,
    FM_TM_MEM_MHZ,
    FM_TM_TEMP_C,
    FM_TM_CPU_UTIL,    /* host CPU utilization %, all cores (/proc/stat)   */
    FM_TM_PROC_UTIL,   /* this process's share of all cores %, which stays
                          meaningful on a machine shared with other work */
    FM_TM_COUNT
} fm_telem_metric;
const char *fm_telem_metric_name(fm_telem_metric m); /* "sm_util_pct", ... */

/* NVML clocks-event (throttle) reason bits that the profile's verdict
 * reads: the GPU lowered its clocks to stay within its power limit. */
#define FM_THROTTLE_SW_POWER_CAP 0x4ull
#define FM_THROTTLE_HW_POWER_BRAKE 0x80ull
typedef struct {
    double t_s;             /* seconds since the run's t0                   */
    double v[FM_TM_COUNT];  /* NaN where not available                      */
    uint64_t throttle;      /* NVML clocks-event (throttle) reason bits     */
} fm_telem_sample;

typedef struct {
    int n;                  /* samples in the window                        */
    double mean[FM_TM_COUNT], max[FM_TM_COUNT]; /* NaN where none           */
    uint64_t throttle_any;  /* OR of the reasons seen (idle bit excluded)   */
} fm_telem_summary;

typedef struct fm_telemetry fm_telemetry;
/* Starts sampling every period_ms (one sample at once, one at stop). For
 * FM_DEV_CUDA, NVML is loaded at run time (libnvidia-ml.so.1, or the path in
 * $FP4MOE_NVML_LIB); when absent the sampler still runs (CPU only) and the
 * note says why: absence is not an error. t0_ns: fm_now_ns() origin. */
fm_status fm_telemetry_start(fm_device dev, int device_index, int period_ms,
                             uint64_t t0_ns, fm_telemetry **out);
void fm_telemetry_stop(fm_telemetry *t); /* joins the thread (idempotent)   */
void fm_telemetry_free(fm_telemetry *t); /* stops first                     */
const char *fm_telemetry_note(const fm_telemetry *t);
int fm_telemetry_has_nvml(const fm_telemetry *t);
/* Samples so far (valid until the next call on t; call after stop). */
size_t fm_telemetry_samples(const fm_telemetry *t, const fm_telem_sample **out);
/* Mean / max of the samples with t_s in [t_begin, t_end]; NaN skipped. */
void fm_telemetry_summarize(const fm_telem_sample *s, size_t n, double t_begin,
                            double t_end, fm_telem_summary *out);
/* "sw_power_cap,hw_slowdown" ("none" for 0). */
void fm_telemetry_throttle_str(uint64_t bits, char *buf, size_t cap);

/* ---- CUPTI kernel records (CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL); kernels
 * inside CUDA graphs arrive one by one. Without FM_HAVE_CUPTI: unsupported. */
typedef struct {
    char name[128];
    uint64_t start_ns, end_ns; /* on the fm_now_ns() clock                  */
    uint32_t device, stream, correlation, graph_id;
    uint32_t dyn_smem;         /* dynamic shared memory of the launch, bytes */
    fm_phase phase;            /* fm_prof_kernel_phase(name)                */
} fm_kernel_rec;
/* The CUDA backend's launches of the shared expert on its own stream ask
 * for this many bytes of dynamic shared memory beyond what they use (every
 * launch's own need is a multiple of 16): dyn_smem % 16 == 8 marks them. */
#define FM_CUDA_SHARED_SMEM_MARK 8
typedef struct fm_cupti fm_cupti;
fm_status fm_cupti_start(fm_cupti **out); /* one collector at a time       */
fm_status fm_cupti_flush(fm_cupti *c);    /* records so far become visible */
size_t fm_cupti_records(const fm_cupti *c, const fm_kernel_rec **out);
void fm_cupti_clear(fm_cupti *c);         /* drops the records read so far */
uint64_t fm_cupti_dropped(const fm_cupti *c);
void fm_cupti_stop(fm_cupti *c);          /* disables and frees            */
/* Per-step phase times from the kernel records of one batch. Kernels of one
 * cudaGraphLaunch share its correlation id: groups of the most common size
 * (> 1) are the steps. Without graphs, routing kernels count the layers
 * (one per layer; layers_per_step per step). Kernels named "...expert..."
 * that the name rules leave in FM_PH_OTHER are shared when their dyn_smem
 * carries FM_CUDA_SHARED_SMEM_MARK, else gate/up when first after a routing
 * kernel on their stream, down when second. Each nanosecond of a device
 * counts once: under the kernel that started first among those not in the
 * shared phase, and for the shared phase's kernels only where no other
 * kernel of the device ran, so the phases add up to at most the steps' busy
 * time. Sorts r by (stream, start) and updates r[i].phase; step_of[i] (may
 * be NULL) gets the step index of record i, or -1. Fills ns_per_step (mean
 * over steps); returns the number of steps (0 when none were found). */
int fm_prof_kernel_steps(fm_kernel_rec *r, size_t n, int layers_per_step, int *step_of,
                         double ns_per_step[FM_PH_COUNT]);

/* ---- the profile */
#define FM_PROF_MAX_BATCH 16
/* NVML's power reading is a one-second average (H100/H200): a window's
 * power is read from this many seconds after its start (the read baseline) */
#define FM_PROF_READ_SETTLE_S 1.0
/* Rows of the phase tables: the phases, then unattributed time, then total. */
#define FM_PROF_ROW_UNATTR FM_PH_COUNT
#define FM_PROF_ROW_TOTAL (FM_PH_COUNT + 1)
#define FM_PROF_ROWS (FM_PH_COUNT + 2)

typedef enum {
    FM_VERDICT_BANDWIDTH = 0, /* >= 70 % of the floor                       */
    FM_VERDICT_COMPUTE,       /* >= 50 % of peak FLOP/s                     */
    FM_VERDICT_LATENCY,       /* >= 50 % of the step outside weight streaming */
    FM_VERDICT_BUSY,          /* utilization >= 80 %, below 70 % of floor   */
    FM_VERDICT_UNDERUSED,     /* none of the above                          */
    FM_VERDICT_POWER          /* mean power >= 90 % of the limit with a power
                               * throttle reason, below 90 % of the floor   */
} fm_verdict;
const char *fm_verdict_name(fm_verdict v); /* "bandwidth-bound", ...        */

typedef struct {
    int batch;
    int steps;                /* measured steps (after warm-up)             */
    /* measurement, per step (all MoE layers once) */
    double step_ns, step_ns_min, step_ns_max;
    double row_ns[FM_PROF_ROWS]; /* phases, unattributed, total (= step_ns) */
    double active_observed;   /* distinct experts per layer (mean)          */
    double tile_fill_observed;/* 0 or less: not measured                    */
    double t_begin_s, t_end_s;/* window on the run's timeline               */
    fm_telem_summary telem;
    /* model (fm_profile_finish) */
    double active_expected;
    double tokens_per_expert; /* B*k / active experts                        */
    int tile_n;               /* tile rows of this batch's kernel (GPU large
                                 path); 0: the profile's tile_n; 0 there too:
                                 not a tiled kernel                          */
    double tile_fill;         /* fraction of tile rows with a token; -1 n/a */
    int tile_fill_is_expected;/* 1: expected from uniform routing           */
    double bytes_per_step;    /* weights that must be read                  */
    double flops_per_step;
    double floor_ns;          /* bytes / bandwidth                          */
    double pct_of_floor;      /* 100 * floor / measured                     */
    /* the routing phase (measured) + the routed experts' bytes / bandwidth:
     * the fastest a step can be that routes, then reads the experts it
     * chose (the shared expert and the router read beside the routing);
     * 0 when no routing time was measured */
    double bound_ns;
    double achieved_Bps, achieved_flops, tokens_per_s;
    double stream_share;      /* share of the step in gate_up/act/down/shared */
    fm_verdict verdict;
    char verdict_text[320];
    /* an EP rank (fm_profile.shard): every rank's load under the full
     * routing, summed over the measured layer calls (load_calls of them);
     * the model counts the rank's bytes from it */
    fm_shard_load load;
    int load_calls;
} fm_prof_batch;

typedef struct {
    double t_us, dur_us;      /* on the run's timeline                      */
    int pid, tid;             /* pid 1 host (tid 1), pid 2 GPU (tid stream) */
    int batch_index;
    int kind;                 /* 0 batch, 1 step, 2 layer, 3 phase, 4 kernel */
    int phase;                /* fm_phase for phases and kernels, else -1  */
    int step;                 /* kernels: measured step index, -1 outside  */
    char name[96];
} fm_prof_span;

typedef struct {
    /* what ran */
    char model[256];          /* preset name or checkpoint directory        */
    char family[32];
    fm_qformat fmt;
    fm_device device;
    char device_desc[256];
    char provenance[1024];    /* tuning provenance line(s), GPU              */
    int E, k, H, I, n_shared, shared_inter, group_size;
    /* one rank's share (mode 0: the whole layer): E, k, I and shared_inter
     * above are the rank's; full_E, full_k those of the full routing */
    fm_shard shard;
    int full_E, full_k;
    int layers_per_step;      /* MoE layers in a step                        */
    int model_moe_layers;     /* MoE layers of the model                    */
    int layers_distinct;      /* distinct layers in memory, cycled          */
    int warmup;
    /* sources */
    fm_time_source time_source;
    char time_note[256];
    char telem_note[256];
    double bandwidth_Bps;
    char bandwidth_note[160];
    double peak_flops;        /* 0: unknown                                 */
    char peak_note[160];
    /* the streaming read alone, kept up while the telemetry samples (GPU
     * with NVML; read_s 0: not run): its rate, its window on the run's
     * timeline, and what the device drew once NVML's one-second power
     * average had settled (fm_profile_finish) */
    double read_s, read_Bps, read_t_begin_s, read_t_end_s;
    fm_telem_summary read_telem;
    unsigned fused_mask;      /* phases fused into another                  */
    int tile_n;               /* tiles modelled (0: none)                   */
    /* results */
    int n_batch;
    fm_prof_batch b[FM_PROF_MAX_BATCH];
    fm_prof_span *spans;      /* malloc'd                                   */
    size_t n_spans, cap_spans;
    size_t spans_dropped;
    fm_telem_sample *samples; /* malloc'd                                   */
    size_t n_samples;
    double duration_s;
} fm_profile;

typedef struct {
    const char *model_dir;    /* --model DIR, or                            */
    const char *preset;       /* --preset NAME                              */
    fm_qformat fmt;           /* experts' format (presets; BF16 ckpts)      */
    fm_device device;
    int cuda_device;
    int batches[FM_PROF_MAX_BATCH];
    int n_batch;
    int steps, warmup;        /* measured and warm-up steps per batch       */
    int layers;               /* distinct layers in memory (0: min(2, L))   */
    int step_layers;          /* MoE layers per step (0: the model's)       */
    int threads;              /* CPU engine threads (0: all)                */
    uint64_t seed;
    int tile_n;               /* model tiles of this many tokens (0: from
                                 the GPU kernel config; none on the CPU)    */
    double bandwidth_Bps;     /* 0: measure                                 */
    size_t bw_probe_bytes;    /* buffer of the bandwidth probe              */
    double peak_flops;        /* 0: measure (CPU) / known table (GPU)       */
    int period_ms;            /* telemetry period                           */
    double read_power_s;      /* seconds of the sustained streaming read for
                                 the power baseline (GPU with NVML; 0: none) */
    FILE *progress;           /* progress lines (NULL: none)                */
    const fm_shard *shard;    /* one rank's share (parallel.h): TP its
                                 slices, EP its experts pre-routed by the
                                 full routing; NULL: the whole layer        */
} fm_prof_opts;

void fm_prof_opts_default(fm_prof_opts *o);
/* Runs every batch size and fills a profile (fm_profile_finish included). */
fm_status fm_profile_run(const fm_prof_opts *o, fm_profile **out);
fm_profile *fm_profile_new(void);
void fm_profile_free(fm_profile *p);
/* Appends a span (bounded; extra spans are counted in spans_dropped). */
void fm_profile_add_span(fm_profile *p, const fm_prof_span *s);
/* Computes the model, verdicts and telemetry summaries from the
 * measurements (b[i].batch, steps, row_ns, step_ns, active_observed, ...). */
fm_status fm_profile_finish(fm_profile *p);
/* Delta between two batches per row: delta_ns = b - a and each row's share
 * of the marginal cost (100 * delta / total delta; NaN when total is 0). */
void fm_prof_delta(const fm_prof_batch *a, const fm_prof_batch *b,
                   double delta_ns[FM_PROF_ROWS], double share_pct[FM_PROF_ROWS]);
/* Row label: phase name, "unattributed", "total". */
const char *fm_prof_row_name(int row);

void fm_profile_print(const fm_profile *p, FILE *f);
/* Renderings (malloc'd NUL-terminated strings). */
fm_status fm_profile_json(const fm_profile *p, char **out);
fm_status fm_profile_trace_json(const fm_profile *p, char **out);
fm_status fm_profile_report_html(const fm_profile *p, char **out);
/* Renders every requested file first, then writes each atomically; NULL
 * paths are skipped. On error no requested file is left half-written. */
fm_status fm_profile_write(const fm_profile *p, const char *json_path,
                           const char *trace_path, const char *html_path);
/* Measured FP32 FMA throughput of this CPU (FLOP/s), n_threads threads. */
double fm_prof_cpu_peak_flops(int n_threads, char *note, size_t cap);
/* @section prof end */

#endif /* FP4MOE_PROF_H */
