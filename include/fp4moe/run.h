/* forward a file, bench; included by fp4moe.h (users include fp4moe.h). */
#ifndef FP4MOE_RUN_H
#define FP4MOE_RUN_H

#ifndef FP4MOE_H
#error "include fp4moe.h, not fp4moe/run.h"
#endif

/* ---------------------------------------------------- driving a device (src/run) */
/* @section run begin */
/* `fp4moe forward`: layer `layer` of the checkpoint in model_dir applied to
 * tensor hidden_states [T, H] (F32/BF16/F16) of input (plus I32 token_ids
 * [T] when present; required by hash-routed layers). Writes output with
 * hidden_states [T, H] F32 (routed + shared), topk_ids I32 [T, k] ascending
 * per row, topk_weights F32 [T, k] in the same order; the file appears only
 * when everything succeeded. info (may be NULL) gets a one-line summary. */
typedef struct {
    const char *model_dir, *input, *output;
    int layer;
    fm_device device;
    fm_cpu_isa isa;  /* CPU only */
    int n_threads;   /* CPU only; <= 0: all */
    const fm_dist_opts *dist; /* non-NULL: sharded run (src/parallel)          */
    int dist_mpi;             /* one GPU per MPI process                   */
} fm_forward_file_opts;
fm_status fm_forward_file(const fm_forward_file_opts *o, char *info, size_t cap);

/*
 * `fp4moe bench`: this machine's memory bandwidth (a streaming read), then
 * per batch size one MoE layer timed by the device's benchmark
 * (fm_cpu_bench / fm_cuda_bench) over `layers` distinct layers, so caches
 * do not flatter the figure. With dist, the sharded layer instead
 * (fm_dist_bench over the model's first MoE layer).
 */
#define FM_BENCH_MAX_BATCH 32
#define FM_BENCH_MAX_LAYERS 64

typedef struct {
    int T;                    /* batch (tokens)                                */
    double us_per_layer;      /* median                                        */
    double us_min, us_max;
    double tokens_per_s;
    double active_experts;    /* routed experts used, mean over layers         */
    int64_t bytes_per_layer;  /* weights read (mean)                           */
    double gbps;              /* bytes_per_layer / us_per_layer, 1e9 bytes/s   */
    double pct_bandwidth;     /* of the measured memory bandwidth              */
    char kernel[640];         /* the kernel(s) that ran                        */
    char provenance[1344];    /* GPU: the kernel, its parameters and the
                               * config's source as they ran; "" on the CPU   */
    char decision[2048];      /* the provenance line decided before the run    */
} fm_bench_row;

typedef struct fm_bench_report {
    fm_model_desc desc;
    fm_qformat fmt;           /* the experts' format that ran                  */
    char source[1100];        /* "preset NAME" or "model DIR"                  */
    fm_device device;
    char device_desc[640];    /* the GPU, or the CPU engine's kernel           */
    double sustain_ms;        /* GPU: sustained replays before the timed ones  */
    fm_dtype act;             /* GPU: the activations' type that was fed       */
    int layers_wanted;        /* distinct layers asked for (or the default)   */
    int layers;               /* cycled: fewer when a checkpoint holds fewer   */
    double bandwidth_Bps;
    char bandwidth_probe[128];/* what was read, in words                       */
    int n_batches;            /* batch sizes asked for: rows[i].T and .decision */
    int n_rows;               /* batch sizes measured so far                   */
    fm_bench_row rows[FM_BENCH_MAX_BATCH];
    /* one rank's share (opts.shard): desc above is the rank's shape       */
    fm_shard shard;           /* mode 0: none                                  */
    fm_model_desc full_desc;  /* the whole model                               */
    char shard_desc[192];     /* fm_shard_describe                             */
    /* EP: per batch size the load of every rank under the measured routing,
     * summed over the layers cycled (divide by layers for one layer), and
     * the most loaded rank's us per layer (its own timing; -1 when it is
     * this rank) */
    fm_shard_load shard_load[FM_BENCH_MAX_BATCH];
    double shard_max_us[FM_BENCH_MAX_BATCH];
    /* sharded runs only */
    char dist_desc[512];      /* fm_dist_describe                              */
    fm_dist_bench_result dist_rows[FM_BENCH_MAX_BATCH];
} fm_bench_report;

typedef struct {
    const char *model_dir;    /* the MoE layers present in a checkpoint, or    */
    const char *preset;       /* seeded random weights of a preset             */
    fm_qformat fmt;           /* presets: FM_QF_NONE is the preset's own       */
    fm_device device;
    const int *batches;
    int n_batches;            /* 1..FM_BENCH_MAX_BATCH                         */
    int layers;               /* 0: fm_cpu_bench_default_layers (at most
                                 FM_BENCH_MAX_LAYERS)                          */
    fm_cpu_isa isa;           /* CPU only                                      */
    int threads;              /* CPU only; <= 0: all                           */
    double min_seconds;       /* CPU: minimum timing per batch size            */
    size_t bw_probe_bytes;    /* 0: 1024 MiB on the CPU, 4096 MiB on a GPU     */
    double sustain_ms;        /* GPU: fm_cuda_engine_set_sustain (0: a burst)  */
    fm_dtype act;             /* GPU: the activations' type, FM_DT_F32 (also
                                 FM_DT_INVALID, 0), FM_DT_BF16 or FM_DT_F16
                                 (fm_cuda_engine_set_bench_act); not with
                                 dist or an EP shard                           */
    uint64_t seed;
    const fm_dist_opts *dist; /* non-NULL: the sharded layer                   */
    int dist_mpi;             /* one GPU per MPI process                       */
    /* non-NULL with a mode: one rank's share on this one device (fm_shard);
     * excludes dist */
    const fm_shard *shard;
    /* Progress of each long operation (may be NULL); every operation ends
     * with a call at frac 1. */
    fm_progress_fn progress;
    void *progress_ctx;
    /* Called (may be NULL) once the set-up is done, with row -1 (everything
     * but the rows is filled), then after each batch size with its row:
     * for printing as the run goes. */
    void (*on_row)(void *ctx, const fm_bench_report *r, int row);
    void *row_ctx;
} fm_bench_opts;

/* Runs the benchmark into *r. Checks every option first (FM_E_ARG /
 * FM_E_RANGE naming it). */
fm_status fm_bench_run(const fm_bench_opts *o, fm_bench_report *r);
/* @section run end */

#endif /* FP4MOE_RUN_H */
