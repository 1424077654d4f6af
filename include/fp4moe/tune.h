/* tuning, tuned-config files, explain; included by fp4moe.h (users include fp4moe.h). */
#ifndef FP4MOE_TUNE_H
#define FP4MOE_TUNE_H

#ifndef FP4MOE_H
#error "include fp4moe.h, not fp4moe/tune.h"
#endif

/* ---------------------------------------------------- tuning and provenance (src/tune) */
/* @section tune begin */
/* The key of one tuned config file. */
typedef struct fm_tune_key {
    char gpu_name[128];
    int sm_count;
    int cuda_version;   /* e.g. 13000 */
    int driver_version; /* e.g. 13000 (cudaDriverGetVersion) */
    fm_qformat fmt;
    int E, H, I, k;
} fm_tune_key;

typedef struct {
    fm_kernel_config cfg;
    int tuned;            /* 1: from a tuned file; 0: built-in default    */
    int bucket;           /* batch bucket used (tuned)                    */
    char source[512];     /* file path, "built-in copy of configs/<file>", or "built-in default" */
    char reason[2048];    /* why: tokens/expert, thresholds, lookup trail */
    /* Of the chosen bucket, as `fp4moe tune` measured it (tuned only). */
    double tuned_us, default_us;
    char date[32];        /* when it was tuned (ISO 8601, UTC)            */
    char version[32];     /* fp4moe version that tuned it                 */
    /* Files that were found but ignored (malformed, other SM count, ...),
     * one per line; "" if none. Callers print these on stderr. */
    char warnings[2048];
    /* 1: no config file names this GPU, for any shape (untuned only): its
     * defaults were set on other GPUs (the provenance line says so). */
    int never_measured;
    /* No file for this shape, tuned = 0: nearest = 1 when the choice is
     * borrowed from the nearest tuned shape of the same GPU and format
     * (fm_tune_shape_distance; source is that file): its shape, the
     * distance and its batch of equal tokens per expert. nearest = 0 and
     * tuned = 0: the built-in default; no_gpu_files says no tuned file of
     * this GPU and format exists at all. */
    int nearest;
    int nearest_E, nearest_H, nearest_I, nearest_k, nearest_batch;
    double nearest_distance;
    int no_gpu_files;
    int nearest_too_far; /* the nearest shape (nearest_*) is farther than
                            FM_TUNE_NEAREST_MAX: the built-in default ran */
} fm_tune_choice;
/* Beyond this distance a shape's choice is not borrowed (H 2x off, I 2x
 * off and E 4x off make 8). */
#define FM_TUNE_NEAREST_MAX 8.0

/* Distance between two shapes, for borrowing a tuned config:
 *   4*|log2(H/H')| + 2*|log2(I/I')| + |log2(E/E')| + |log2(k/k')|
 * (0: the same shape). H and I are the K dimensions of the expert GEMVs,
 * which the kernel parameters follow most; E and k mostly move the tokens
 * per expert, which the borrowed batch is matched on. */
double fm_tune_shape_distance(int E, int H, int I, int k, int E2, int H2, int I2, int k2);

/* Lookup (fm_tune_search_dirs): $FP4MOE_CONFIG_DIR, the user cache, the
 * shipped configs, then the copies of them built into the library; nearest
 * batch bucket. Never fails for a missing file: returns the default with
 * tuned = 0 and a reason saying so. Thread-safe; parsed files are cached in
 * memory (revalidated by size and mtime). */
fm_status fm_tune_choose(const fm_tune_key *key, int T, fm_tune_choice *out);
/* Where a choice came from, in one line: the file and its bucket when tuned
 * or borrowed from the nearest tuned shape ("<path> (bucket N)"), else
 * "built-in default". Two batches get the same line only from the same
 * bucket of the same file, which the CUDA layers' per-batch table relies on
 * (a file may hold equal configs in buckets that are not adjacent). */
void fm_tune_choice_source(const fm_tune_choice *ch, char *buf, size_t cap);

/* Fills the shape fields of a key (E, H, I, k, fmt) from a model; the GPU
 * fields are left as they are. */
fm_status fm_tune_key_set_shape(fm_tune_key *key, const fm_model_desc *d, fm_qformat fmt);
/* "NVIDIA_H200-132sm-nvfp4-E256-H4096-I2048-k6.json": characters of the GPU
 * name outside [A-Za-z0-9.] become '_'. */
fm_status fm_tune_key_filename(const fm_tune_key *key, char *buf, size_t cap);
/* Human form: "NVIDIA H200 (132 SMs) nvfp4 E=256 H=4096 I=2048 k=6". */
void fm_tune_key_describe(const fm_tune_key *key, char *buf, size_t cap);

/* Places searched, in order: label and path ("" when not set).
 *   0 "$FP4MOE_CONFIG_DIR"
 *   1 "user cache"       (fm_tune_user_cache_dir)
 *   2 "shipped"          $FP4MOE_SHIPPED_CONFIGS, else <module dir>/../share/
 *                        fp4moe/configs of an install (module: the shared
 *                        library, or the executable the library is linked
 *                        into), else the source tree's configs/ for a binary
 *                        of the build tree
 *   3 "built-in copies"  (path ""): configs/ as compiled into the library;
 *                        a choice from here has the source "built-in copy of
 *                        configs/<file>"; skipped while $FP4MOE_SHIPPED_CONFIGS
 *                        is set, as that names the whole shipped set
 * Returns the count (FM_TUNE_NDIRS). */
#define FM_TUNE_NDIRS 4
#define FM_TUNE_DIR_BUILTIN 3
int fm_tune_search_dirs(const char *labels[FM_TUNE_NDIRS], char paths[FM_TUNE_NDIRS][1024]);
/* The real path of the module holding the library code (the shared library,
 * or the executable it is linked into); "" if unknown. */
const char *fm_tune_module_path(void);
/* The user cache directory ($XDG_CACHE_HOME/fp4moe/configs or
 * ~/.cache/fp4moe/configs); the default output of `fp4moe tune`. */
fm_status fm_tune_user_cache_dir(char *buf, size_t cap);
/* Forgets every cached parsed file (tests; after writing files). */
void fm_tune_cache_clear(void);

/* Nearest bucket to T among buckets[n] (n >= 1), on a log scale: the
 * distance of bucket b is max(T/b, b/T); equal distances go to the smaller
 * bucket. Returns the index. */
int fm_tune_nearest_bucket(const int *buckets, int n, int T);
/* Expected active experts at batch T under uniform routing,
 * E*(1-(1-k/E)^T), and tokens per active expert, T*k/active. */
double fm_tune_expected_active(int E, int k, int T);
double fm_tune_tokens_per_expert(int E, int k, int T);

/* The candidate configs `fp4moe tune` sweeps for a shape and batch: the
 * default first, then a grid around it ordered by distance from the
 * default. Returns how many were written to out (at most max). */
int fm_tune_candidates(const fm_tune_key *key, int T, fm_kernel_config *out, int max);
/* "path=small rows_per_block=4 k_split=1 warps=8 stages=2 tile_n=8
 * switch_tpe=8" */
void fm_kernel_config_format(const fm_kernel_config *c, char *buf, size_t cap);

/* One provenance line for a layer shape (no newline):
 *   provenance: backend=cuda kernel=<path> params={...} config=<file> bucket=<B>
 * or, without a tuned file,
 *   WARNING: no tuned config for <key>; using defaults; run: fp4moe tune ...
 * The tune hint names a preset when one has this shape. */
void fm_tune_provenance_line(const fm_tune_key *key, int T, const fm_tune_choice *c,
                             char *buf, size_t cap);
/* The same as a JSON object (malloc'd string; NULL when out of memory). */
char *fm_tune_choice_to_json(const fm_tune_key *key, int T, const fm_tune_choice *c);
/* A preset with this shape (E, H, I, k), or NULL. */
const char *fm_tune_preset_for_key(const fm_tune_key *key);

/* Known GPUs, for `explain --gpu NAME` without one present. Figures are
 * vendor datasheet values (planning only; `bench` measures the real one). */
typedef struct {
    const char *name;       /* as CUDA reports it: "NVIDIA H200"           */
    const char *aliases;    /* comma-separated short names: "H200,H200 SXM" */
    int sm_count;
    double bandwidth_gbs;   /* datasheet memory bandwidth, GB/s            */
    double l2_mb;           /* L2 cache, MB                                */
    int cc;                 /* compute capability, e.g. 90                 */
    int fp4_tensor_cores;   /* 1 on Blackwell                              */
    double memory_gb;       /* device memory, GB                           */
    int power_w;            /* board power (TDP / TGP), W                  */
} fm_gpu_info;
size_t fm_gpu_count(void);
const fm_gpu_info *fm_gpu_at(size_t i);
/* Case-insensitive match on the name or an alias; NULL if unknown. */
const fm_gpu_info *fm_gpu_lookup(const char *name);

/* `fp4moe explain`: the full decision for a model shape at each batch. */
typedef struct {
    const fm_model_desc *desc;
    const char *model_label;  /* "--preset deepseek-v4-flash" or "--model DIR" */
    fm_qformat fmt;
    const int *batches;
    int n_batches;
    const char *gpu;          /* --gpu NAME, or NULL: the present GPU, else CPU */
    int json;                 /* 1: one JSON document instead of text          */
    char *warnings;           /* optional: receives the ignored-file lines     */
    size_t warnings_cap;
    /* optional: one rank's share of desc (fm_shard, parallel.h): the shape,
     * key and bytes are the rank's */
    const struct fm_shard *shard;
} fm_explain_opts;

/* One directory of the config lookup, as fm_tune_choose saw it. */
typedef struct {
    const char *label;   /* "$FP4MOE_CONFIG_DIR", "user cache", "shipped"      */
    char dir[1024];      /* "" when not set                                   */
    char status[640];    /* "not set", "no such file", "found", "ignored: ..." */
} fm_tune_lookup;

/* The decision for one batch size. */
typedef struct {
    int batch;
    double active_experts;         /* expected: E*(1-(1-k/E)^B)               */
    double tokens_per_expert;      /* B*k / active_experts                     */
    double shared_bytes;           /* the shared expert's, read every step     */
    double bytes;                  /* weights to stream per layer              */
    double floor_us;               /* bytes at the datasheet bandwidth; 0: none */
    /* GPU targets only: */
    double mean_tokens_per_expert; /* B*k/E, what the paths switch on          */
    fm_kernel_config default_cfg;  /* the built-in default                     */
    fm_tune_choice choice;         /* what would run, from where, and why      */
    fm_tune_lookup lookup[FM_TUNE_NDIRS];
    char provenance[1024];         /* fm_tune_provenance_line                  */
    int logits_gemv;               /* the router logits: a GEMV, else tiled    */
    long logits_tiled_blocks;      /* blocks of the tiled grid ...             */
    int logits_sms;                /* ... on this many SMs                     */
    const char *logits_why;
    /* the layer's schedule (has_schedule): */
    int shared_fork;               /* the shared expert on a second stream     */
    int shared_tokens;             /* tokens per pass of the shared expert     */
    int down_per_expert;           /* down starts per expert as its gate/up ends */
    int selection_spread;          /* one token's selection over the block     */
    const char *shared_how;        /* "none", "own stream", "in the routed launches" */
    const char *expert_launch;     /* where the expert kernels are launched    */
    /* the splitk path's grids (0: not the splitk path): */
    long long splitk_gu_blocks;    /* gate/up blocks, FM_SPLITK_PER_SM per SM  */
    int splitk_down_blocks;        /* down blocks ...                          */
    int splitk_down_per_sm;        /* ... and how many run per SM              */
    /* the splitk path at one token (T = 1 on the splitk path): gate/up and
     * down in one launch of fused_blocks blocks, one per SM, fused_smem
     * bytes of dynamic shared memory each (with the top-k's scratch where
     * it selects); 0 blocks where it does not run, and fused_why says why */
    long long fused_blocks;
    int fused_smem;
    const char *fused_why;
    int down_chunks_max;           /* wgmma down: most row chunks per block    */
    /* that one-token launch also selects the token's top-k itself, with no
     * selection kernel between the logits and it (1), or not, and
     * fused_sel_why says why (a hash-routed layer always runs the selection
     * kernel) */
    int fused_selects;
    const char *fused_sel_why;
    /* wgmma gate/up: K in quarters or thirds, a cluster of 4 or 3 blocks
     * per row block (4 or 3; else 0), as the engine's rule decides it where
     * it does not depend on the occupancy; gateup_blocks: the grid before
     * the split */
    int gateup_k_split;
    long long gateup_blocks;
} fm_explain_batch;

typedef struct {
    fm_model_desc desc;
    char model[1280];              /* model_label, or the family               */
    fm_qformat fmt;
    int64_t expert_bytes;          /* one routed expert, scales included       */
    int gpu;                       /* 1: a GPU target; 0: the CPU path         */
    const fm_gpu_info *gpu_info;   /* datasheet figures (NULL: unknown GPU)    */
    fm_tune_key key;               /* the target's key (GPU fields: GPUs only) */
    char origin[64];               /* GPU: "present" or from --gpu             */
    char describe[512];            /* the target in words                      */
    char no_gpu_why[256];          /* CPU: why no GPU is used                  */
    char config_file[512];         /* the key's config file name               */
    int has_schedule;              /* the compute capability is known          */
    char warnings[4096];           /* ignored config files, one a line, each once */
    int shard_mode, shard_ranks, shard_rank; /* the shard (mode 0: none)   */
    char shard_desc[192];          /* fm_shard_describe                        */
    fm_model_desc full_desc;       /* the whole model (desc is the rank's)     */
    int n_batches;
    fm_explain_batch *batches;
} fm_explanation;

/* The decision, without rendering (the json field is not read). Never runs
 * a kernel. Unknown --gpu names fail with FM_E_NOTFOUND listing known
 * ones. Free with fm_explanation_free. */
fm_status fm_explain_decide(const fm_explain_opts *o, fm_explanation **out);
void fm_explanation_free(fm_explanation *x);
/* The explanation as text, or as one JSON document (a trailing newline). */
fm_status fm_explain_render_text(const fm_explanation *x, FILE *out);
fm_status fm_explain_render_json(const fm_explanation *x, FILE *out);
/* fm_explain_decide + render (text, or JSON with o->json) into *out
 * (malloc'd, NUL-terminated); o->warnings receives the warnings. */
fm_status fm_explain(const fm_explain_opts *o, char **out);

/* `fp4moe tune`: a sweep over candidate configs per batch bucket. The
 * measuring backend is pluggable so the selection logic is testable
 * without a GPU; fm_tune_cuda_* below is the real one. */
typedef struct {
    void *ctx;
    /* Median, min and max µs per layer of cfg at batch T. */
    fm_status (*bench)(void *ctx, const fm_kernel_config *cfg, int T,
                       double *us_med, double *us_min, double *us_max);
    /* Output of cfg on a few tokens against the float64 reference: relative
     * error (L2 norm) and whether the top-k ids are identical. */
    fm_status (*check)(void *ctx, const fm_kernel_config *cfg, int T,
                       double *rel_err, int *ids_equal);
} fm_tune_backend;

typedef struct {
    double budget_s;    /* sweep time per key (default 30)                  */
    double tolerance;   /* max relative error vs reference (default 5e-3)   */
    double min_gain;    /* a winner must also beat the default median by
                           this fraction (default 0.01)                     */
    int max_candidates; /* per bucket (default: all)                        */
    /* Progress lines (no newline); may be NULL. */
    void (*log)(void *log_ctx, const char *line);
    void *log_ctx;
} fm_tune_opts;

typedef struct {
    int batch;
    fm_kernel_config cfg, default_cfg;
    double us, us_min, us_max;                 /* of cfg                   */
    double default_us, default_us_min, default_us_max;
    int replaced_default;                      /* cfg != default_cfg       */
    int n_tried, n_rejected;                   /* candidates               */
} fm_tune_bucket_result;

/* Sweeps buckets[n] for key and writes (merges into) the config file of
 * key in out_dir, atomically. res (may be NULL) receives n results. */
fm_status fm_tune_sweep(const fm_tune_key *key, const fm_tune_backend *be,
                        const int *buckets, int n, const fm_tune_opts *o,
                        const char *out_dir, char *written_path, size_t cap,
                        fm_tune_bucket_result *res);

/* The CUDA measuring backend for one model shape: uploads n_layers layers
 * of seeded random weights (0: enough to defeat the L2), computes the float64
 * reference once per checked batch. FM_E_UNSUPPORTED without a GPU. */
typedef struct fm_tune_cuda fm_tune_cuda;
fm_status fm_tune_cuda_new(const fm_model_desc *d, fm_qformat fmt, int n_layers,
                           uint64_t seed, fm_tune_cuda **out);
void fm_tune_cuda_free(fm_tune_cuda *t);
const fm_tune_key *fm_tune_cuda_key(const fm_tune_cuda *t);
const char *fm_tune_cuda_describe(const fm_tune_cuda *t);
fm_tune_backend fm_tune_cuda_backend(fm_tune_cuda *t);

/* A Markdown summary of every config file in dir (per shape and bucket: the
 * default's and the chosen µs, the gain, the parameters), for docs/perf.md.
 * Files that do not parse are listed as ignored. *out is malloc'd. */
fm_status fm_tune_summarize(const char *dir, char **out);
/* @section tune end */

#endif /* FP4MOE_TUNE_H */
