/*
 * fp4moe — decode-time Mixture-of-Experts with 4-bit float experts.
 *
 * One public header. Every name carries the prefix fm_ / FM_. Every function
 * that can fail returns an fm_status; fm_last_error() then holds a message
 * that names the problem (thread-local, valid until the next failing call on
 * the same thread).
 *
 * Modules (one folder each under src/):
 *   util     errors, RNG, clocks, thread pool, small helpers
 *   formats  E2M1, E4M3, E8M0, BF16, F16 and NVFP4 / MXFP4 (de)quantization
 *   io       safetensors, sharded checkpoints, config.json, expert binding, gen
 *   route    router math for every family (FP32)
 *   cpu      float64 reference and the fast CPU engine
 *   cuda     the CUDA backend (optional; built when nvcc is found)
 *   tune     kernel configs, tuned-config files, explain
 *   prof     phases, telemetry (NVML), roofline model, Chrome trace, HTML report
 *   trace    analysis of other engines' PyTorch-profiler traces
 *   parallel tensor- / expert-parallel sharding (CPU simulation and NCCL)
 *   run      driving a device: forward a file, bench over batch sizes
 */
#ifndef FP4MOE_H
#define FP4MOE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FM_VERSION "0.1.0"

struct fm_tune_key; /* defined in the tuning section */

/* ------------------------------------------------------------------ errors */

typedef enum {
    FM_OK = 0,
    FM_E_ARG,         /* bad argument from the caller                     */
    FM_E_IO,          /* open / read / write / mmap failed                */
    FM_E_FORMAT,      /* malformed file or value (safetensors, JSON, ...) */
    FM_E_RANGE,       /* value out of range (k > E, sizes, overflow)      */
    FM_E_NOMEM,       /* allocation failed                                */
    FM_E_NOTFOUND,    /* missing tensor / file / key                      */
    FM_E_UNSUPPORTED, /* not built in or not supported on this device     */
    FM_E_CUDA,        /* a CUDA call failed                               */
    FM_E_NUMERIC      /* non-finite input or result                       */
} fm_status;

const char *fm_status_name(fm_status s);
/* Message of the last failure on this thread ("" if none). */
const char *fm_last_error(void);
/* Records a failure message (printf-style) and returns s. */
fm_status fm_error(fm_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void fm_clear_error(void);

/* ----------------------------------------------------------------- dtypes */

typedef enum {
    FM_DT_INVALID = 0,
    FM_DT_BOOL,
    FM_DT_U8,
    FM_DT_I8,
    FM_DT_F8_E5M2,
    FM_DT_F8_E4M3,
    FM_DT_F8_E8M0,
    FM_DT_I16,
    FM_DT_U16,
    FM_DT_F16,
    FM_DT_BF16,
    FM_DT_I32,
    FM_DT_U32,
    FM_DT_F32,
    FM_DT_F64,
    FM_DT_I64,
    FM_DT_U64,
    FM_DT_F4, /* E2M1, two per byte; shape counts elements */
    FM_DT_COUNT_
} fm_dtype;

const char *fm_dtype_name(fm_dtype dt);     /* "F32", as safetensors spells it */
fm_dtype fm_dtype_from_name(const char *s); /* FM_DT_INVALID if unknown       */
/* Size in bits of one element (4 for F4). */
int fm_dtype_bits(fm_dtype dt);

/* ---------------------------------------------------------------- formats */

float fm_e2m1_to_f32(uint8_t code);     /* low 4 bits used                */
uint8_t fm_f32_to_e2m1(float x);        /* RNE, saturates at +-6, NaN->+6, -0->+0 (ModelOpt) */
float fm_e4m3_to_f32(uint8_t code);     /* float8_e4m3fn                  */
uint8_t fm_f32_to_e4m3(float x);        /* RNE, saturates at +-448 (inf too), NaN->0x7F|sign */
float fm_e8m0_to_f32(uint8_t code);     /* 2^(e-127), 0xFF -> NaN         */
uint8_t fm_f32_to_e8m0_floor(float x);  /* largest 2^e <= x (x > 0)       */
float fm_bf16_to_f32(uint16_t h);
uint16_t fm_f32_to_bf16(float x);       /* RNE, NaN stays NaN             */
float fm_f16_to_f32(uint16_t h);
uint16_t fm_f32_to_f16(float x);        /* RNE, overflow -> inf           */

/* Quantized formats of expert weights. */
typedef enum {
    FM_QF_NONE = 0,
    FM_QF_NVFP4, /* E2M1 + E4M3 scale per 16 along K + FP32 per-tensor scale */
    FM_QF_MXFP4, /* E2M1 + E8M0 scale per 32 along K                         */
    FM_QF_BF16   /* unquantized BF16 weights                                 */
} fm_qformat;

const char *fm_qformat_name(fm_qformat f); /* "nvfp4", "mxfp4", "bf16" */
fm_qformat fm_qformat_from_name(const char *s);
int fm_qformat_block(fm_qformat f); /* 16, 32, 0 */

/*
 * A quantized [rows, cols] matrix (rows = output features, cols = input
 * features, the K dimension). Element (r, c):
 *   packed[r*row_stride + c/2]  low nibble = even c, high nibble = odd c
 *   scales[r*scale_stride + c/block]
 *   value = E2M1(nibble) * scale(s) * scale2      (scale2 = 1 for MXFP4)
 * For FM_QF_BF16, packed holds rows*row_stride bytes of BF16 and scales is
 * NULL. bias (F32, [rows]) is optional (gpt-oss). Pointers are borrowed: the
 * owner (a checkpoint mapping or an fm_moe_layer) keeps them alive.
 */
typedef struct {
    fm_qformat fmt;
    int64_t rows, cols;
    const uint8_t *packed;
    int64_t row_stride;   /* bytes between rows of packed      */
    const uint8_t *scales;
    int64_t scale_stride; /* bytes between rows of scales      */
    float scale2;         /* NVFP4 per-tensor FP32 scale       */
    const float *bias;    /* optional, [rows]                  */
} fm_qmatrix;

/* ModelOpt NVFP4: scale2 = amax/(6*448); block scale = block_amax/(6*scale2)
 * clamped to [2^-9, 448], E4M3 RNE; all-zero block -> scale 1.0.
 * packed: rows*cols/2 bytes, scales: rows*cols/16 bytes. cols % 16 == 0. */
fm_status fm_quantize_nvfp4(const float *w, int64_t rows, int64_t cols,
                            uint8_t *packed, uint8_t *scales, float *scale2);
/* OCP MXFP4: scale = 2^(floor(log2(block_amax)) - 2). cols % 32 == 0. */
fm_status fm_quantize_mxfp4(const float *w, int64_t rows, int64_t cols,
                            uint8_t *packed, uint8_t *scales);
/* Dequantizes one row into out[cols] (float / double). */
void fm_qmatrix_dequant_row(const fm_qmatrix *m, int64_t row, float *out);
void fm_qmatrix_dequant_row_f64(const fm_qmatrix *m, int64_t row, double *out);
/* Bytes a kernel must read for the whole matrix (packed + scales). */
int64_t fm_qmatrix_bytes(const fm_qmatrix *m);

/* ------------------------------------------------------------ safetensors */

#define FM_MAX_DIMS 8

typedef struct {
    const char *name;
    fm_dtype dtype;
    int ndim;
    int64_t shape[FM_MAX_DIMS];
    uint64_t begin, end; /* offsets in the data buffer                */
    const void *data;    /* into the mapping (NULL for header-only)   */
} fm_st_tensor;

typedef struct fm_st_file fm_st_file;

/* Maps and validates a file with the official reader's rules. */
fm_status fm_st_open(const char *path, fm_st_file **out);
/* Reads only the header (no mapping of the data). data pointers are NULL. */
fm_status fm_st_open_header(const char *path, fm_st_file **out);
/* Parses a header from memory: buf = the whole file (or its first bytes),
 * file_size = the full size of the file. Used by the fuzzer and tests.
 * When buf holds the whole file, data pointers point into buf; else NULL.
 * Errors: FM_E_FORMAT malformed, FM_E_RANGE header > 100 MB or shape
 * product overflow, FM_E_UNSUPPORTED unknown dtype or ndim > FM_MAX_DIMS. */
fm_status fm_st_parse(const uint8_t *buf, size_t buf_len, uint64_t file_size,
                      fm_st_file **out);
void fm_st_close(fm_st_file *f);
size_t fm_st_count(const fm_st_file *f);
const fm_st_tensor *fm_st_at(const fm_st_file *f, size_t i); /* sorted by offset */
const fm_st_tensor *fm_st_find(const fm_st_file *f, const char *name);
const char *fm_st_metadata(const fm_st_file *f, const char *key);
size_t fm_st_metadata_count(const fm_st_file *f);
const char *fm_st_path(const fm_st_file *f);

/* Streaming writer: declare every tensor first, then write their bytes in
 * declaration order. The file appears (atomic rename) only at finish; abort
 * or any error leaves no file behind. */
typedef struct fm_st_writer fm_st_writer;
fm_status fm_st_writer_new(const char *path, fm_st_writer **out);
fm_status fm_st_writer_meta(fm_st_writer *w, const char *key, const char *val);
fm_status fm_st_writer_declare(fm_st_writer *w, const char *name, fm_dtype dt,
                               int ndim, const int64_t *shape);
fm_status fm_st_writer_write(fm_st_writer *w, const void *data, size_t n);
fm_status fm_st_writer_finish(fm_st_writer *w); /* frees w */
void fm_st_writer_abort(fm_st_writer *w);       /* frees w */

/* A checkpoint directory: model.safetensors.index.json + shards, or a single
 * model.safetensors. Shards are opened on first use. */
typedef struct fm_ckpt fm_ckpt;
fm_status fm_ckpt_open(const char *dir, fm_ckpt **out);
void fm_ckpt_close(fm_ckpt *c);
/* NULL (with fm_last_error set) when absent or when its shard is bad. */
const fm_st_tensor *fm_ckpt_find(fm_ckpt *c, const char *name);
const char *fm_ckpt_dir(const fm_ckpt *c);
/* Names of all tensors (from the index or the single file). */
size_t fm_ckpt_count(const fm_ckpt *c);
const char *fm_ckpt_name_at(const fm_ckpt *c, size_t i);

/* ------------------------------------------------------- model description */

typedef enum {
    FM_ROUTE_NOAUX_TC = 1, /* DeepSeek-V3/R1, Kimi-K2, GLM-4.5/5            */
    FM_ROUTE_SOFTMAX,      /* Qwen3-MoE, Mixtral                            */
    FM_ROUTE_GPTOSS,       /* top-k on biased logits, softmax over the k    */
    FM_ROUTE_DSV4          /* sqrt(softplus), bias top-k, hash layers       */
} fm_route_kind;

typedef enum {
    FM_ACT_SILU = 1,    /* silu(gate) * up                                   */
    FM_ACT_GPTOSS       /* clamp; gate*sigmoid(alpha*gate)*(up+1)            */
} fm_act_kind;

typedef struct {
    char family[32];     /* deepseek_v3 kimi_k2 glm4_moe glm5 deepseek_v4
                            qwen3_moe mixtral gpt_oss                         */
    char model_type[64]; /* config.json model_type as read                  */
    int hidden;          /* H                                               */
    int moe_inter;       /* I, per routed expert                            */
    int n_experts;       /* E                                               */
    int topk;            /* k                                               */
    int n_shared;        /* shared experts (0 if none)                      */
    int shared_inter;    /* intermediate size of the fused shared expert    */
    int n_layers;
    int first_dense;     /* first_k_dense_replace (layers < it are dense)   */
    int moe_layer_freq;  /* every n-th layer is MoE (1 = all)               */
    int n_group, topk_group;
    int norm_topk_prob;  /* renormalize the top-k weights                   */
    float routed_scaling_factor;
    fm_route_kind route;
    fm_act_kind act;
    float swiglu_alpha, swiglu_limit;
    int n_hash_layers;   /* DeepSeek-V4: first layers route by token id     */
    int vocab_size;
    fm_qformat expert_format; /* from hf_quant_config / quantization_config */
    int group_size;
    char layout[32];     /* modelopt | gptoss | dsv4 | bf16                 */
} fm_model_desc;

/* Reads DIR/config.json (+ DIR/hf_quant_config.json when present). */
fm_status fm_model_desc_load(const char *dir, fm_model_desc *out);
/* Same from strings (quant_json may be NULL). Fuzzed. */
fm_status fm_model_desc_parse(const char *config_json, size_t config_len,
                              const char *quant_json, size_t quant_len,
                              fm_model_desc *out);
fm_status fm_model_desc_validate(const fm_model_desc *d);
int fm_model_is_moe_layer(const fm_model_desc *d, int layer);
/* NVFP4/MXFP4/BF16 bytes of one routed expert (3 matrices, with scales). */
int64_t fm_model_expert_bytes(const fm_model_desc *d, fm_qformat f);

/* Built-in presets named after real models, and tiny ones for tests. */
size_t fm_preset_count(void);
const char *fm_preset_name(size_t i);
fm_status fm_preset_desc(const char *name, fm_qformat fmt, fm_model_desc *out);

/* @section io begin */
/* config.json (and hf_quant_config.json for the modelopt layout, else NULL)
 * of a description, with the family's real key names. Free with free(). */
fm_status fm_model_desc_to_json(const fm_model_desc *d, char **config_json, char **quant_json);

/*
 * Seeded random weights: the exact formulas are documented in
 * src/io/model_random.c so that any generator (CPU, GPU) reproduces them.
 * Stream key of one logical tensor part: expert -1 is the fused shared
 * expert, -2 the router; what is e.g. "gate.codes", "down.scales".
 */
uint64_t fm_gen_key(int layer, int expert, const char *what);
/* Per-tensor constants of the formulas for a matrix with K inputs. */
float fm_gen_nvfp4_scale2(int64_t K);
int fm_gen_mxfp4_base_exp(int64_t K);
/* Fills rows [r0, r0+nr) of a routed / shared matrix (rows x K) of layer
 * `layer`, expert e (-1 shared), m = 0 gate, 1 up, 2 down, in format fmt:
 * packed (nr*K/2 bytes, or nr*K*2 for BF16) and scales (nr*K/block bytes,
 * NULL for BF16; either may be NULL to skip it). Used by
 * fm_moe_layer_random and gen. */
void fm_gen_matrix_rows(uint64_t seed, int layer, int e, int m, fm_qformat fmt, int64_t K, int64_t r0, int64_t nr,
                        uint8_t *packed, uint8_t *scales);

typedef struct {
    int n_moe_layers;     /* MoE layers to write, from the first one (>= 1)  */
    uint64_t seed;
    uint64_t shard_bytes; /* maximum bytes per shard; 0: 2 GB                */
    int progress;         /* progress lines on stderr (about once a second)  */
} fm_gen_opts;
/* Writes a checkpoint of d (config.json, hf_quant_config.json for modelopt,
 * model-0000i-of-0000N.safetensors shards, model.safetensors.index.json)
 * into out_dir, which must not exist. Everything is written into a sibling
 * temporary directory that is renamed at the end: a failure leaves nothing.
 * num_hidden_layers keeps the real model's count; only the chosen MoE layers
 * hold tensors (fm_inspect lists them). Memory use is independent of size. */
fm_status fm_gen_checkpoint(const fm_model_desc *d, const fm_gen_opts *o, const char *out_dir);

/* Describes a checkpoint directory (family, MoE layers present, experts,
 * formats, bytes, routing) and checks every tensor of every present MoE
 * layer. Writes text or JSON to out. *n_problems counts what is wrong; the
 * status is FM_OK whenever the report could be written (problems included). */
fm_status fm_inspect(const char *dir, int as_json, FILE *out, int *n_problems);
/* @section io end */

/* ---------------------------------------------------------- one MoE layer */

/*
 * The weights of one MoE layer, bound to a checkpoint (zero-copy where the
 * layout allows) or built in memory. Routed expert e: gate[e], up[e] are
 * [I, H], down[e] is [H, I]. The shared experts (if any) are fused into one
 * expert of width shared_inter. Router: router_w [E, H] F32.
 */
typedef struct fm_moe_layer {
    int layer;                 /* layer index in the model                  */
    int hidden, inter, n_experts, topk;
    fm_qformat fmt;
    fm_qmatrix *gate, *up, *down;     /* arrays of n_experts               */
    int has_shared;
    int shared_inter;
    fm_qmatrix sh_gate, sh_up, sh_down;
    const float *router_w;            /* [E, H]                            */
    const float *router_bias;         /* gpt-oss logit bias [E] or NULL    */
    const float *score_bias;          /* e_score_correction_bias [E]/NULL  */
    const int32_t *tid2eid;           /* [vocab, k] hash routing or NULL   */
    int64_t tid2eid_rows;
    void *owned_;                     /* allocations freed with the layer  */
} fm_moe_layer;

/* Binds layer L of a checkpoint. quantize_bf16: BF16 experts are quantized
 * to this format on load (FM_QF_NONE keeps BF16). */
fm_status fm_moe_layer_bind(fm_ckpt *c, const fm_model_desc *d, int layer,
                            fm_qformat quantize_bf16, fm_moe_layer **out);
/* Seeded random weights in memory, the same values `fp4moe gen` writes. */
fm_status fm_moe_layer_random(const fm_model_desc *d, fm_qformat fmt,
                              uint64_t seed, int layer, fm_moe_layer **out);
void fm_moe_layer_free(fm_moe_layer *l);
/* Bytes of all routed experts' weights (packed + scales), and of one. */
int64_t fm_moe_layer_expert_bytes(const fm_moe_layer *l);

/* ---------------------------------------------------------------- routing */

/*
 * Router in FP32 for T tokens x[T, H] (F32). Writes ids[T, k] and
 * weights[T, k], each row sorted by ascending expert id. Ties between equal
 * scores go to the lower expert index. token_ids (may be NULL) feed hash
 * routing for DeepSeek-V4's first layers.
 */
fm_status fm_route(const fm_model_desc *d, const fm_moe_layer *l,
                   const float *x, int T, const int32_t *token_ids,
                   int32_t *ids, float *weights);

/* ------------------------------------------------ phases (all engines) */

/* Phases of one MoE block call. Engines that fuse phases report the fused
 * time under the first phase and leave the others at zero (the phase
 * table says "fused"). */
typedef enum {
    FM_PH_ROUTE = 0, /* router GEMV + top-k                                */
    FM_PH_SORT,      /* token -> expert grouping                           */
    FM_PH_GATEUP,    /* gate/up GEMMs (+ activation where fused)           */
    FM_PH_ACT,       /* activation when run separately                     */
    FM_PH_DOWN,      /* down GEMM (+ weight + combine where fused)         */
    FM_PH_COMBINE,   /* k-way combine when run separately                  */
    FM_PH_SHARED,    /* shared experts                                     */
    FM_PH_OTHER,     /* conversions, copies, anything else                 */
    FM_PH_COUNT
} fm_phase;
const char *fm_phase_name(fm_phase p); /* "routing", "sort", "gate_up", ... */

typedef struct {
    double ns[FM_PH_COUNT]; /* accumulated nanoseconds per phase          */
    int64_t calls;          /* forward calls accumulated                  */
    unsigned fused_mask;    /* bit p set: phase p is fused into another   */
} fm_phase_times;

/* ------------------------------------------- kernel configs (all engines) */

/* The parameters of a GPU MoE kernel variant, in one structure, so that
 * tuning, provenance lines and `explain` all speak of the same fields. */
/* WGMMA: the large path's work with Hopper warpgroup MMAs (sm_90; elsewhere
 * the engine runs the mma.sync default, fm_kernel_config_default_mma, and
 * says so in the config source). */
typedef enum { FM_PATH_SMALL = 0, FM_PATH_LARGE = 1, FM_PATH_WGMMA = 2 } fm_kernel_path;
/* Tokens per expert (B * k / E) from which the built-in default takes the
 * wgmma path. */
#define FM_WGMMA_TPE 0.04
typedef struct {
    fm_kernel_path path;      /* chosen path for this batch bucket        */
    int rows_per_block;       /* weight rows per thread block (small)     */
    int k_split;              /* split of K across warps / blocks         */
    int warps;                /* warps per block                          */
    int stages;               /* pipeline depth (large path)              */
    int tile_n;               /* tokens per MMA tile (large path)         */
    float switch_tpe;         /* tokens per expert at which LARGE starts  */
} fm_kernel_config;

/* ---------------------------------------------------------------- engine */

typedef enum { FM_DEV_CPU = 0, FM_DEV_CUDA = 1 } fm_device;

/* CPU kernel flavour: AUTO picks the best the processor supports. */
typedef enum {
    FM_CPU_AUTO = 0,
    FM_CPU_SCALAR,
    FM_CPU_AVX2,
    FM_CPU_AVX512
} fm_cpu_isa;
const char *fm_cpu_isa_name(fm_cpu_isa i);
fm_cpu_isa fm_cpu_isa_detect(void); /* best supported by this CPU */

/* Output of one MoE block call. */
typedef struct {
    float *out;          /* [T, H] F32 (routed + shared)                    */
    int32_t *topk_ids;   /* [T, k] may be NULL                              */
    float *topk_weights; /* [T, k] may be NULL                              */
} fm_moe_out;

/* Float64 reference: dequantize, compute in double, round to float at the
 * end. x is F32/BF16/F16. Routing uses fm_route (FP32, as the models do). */
fm_status fm_moe_forward_ref(const fm_model_desc *d, const fm_moe_layer *l,
                             const void *x, fm_dtype xdt, int T,
                             const int32_t *token_ids, fm_moe_out *o);

typedef struct fm_cpu_engine fm_cpu_engine;
fm_status fm_cpu_engine_new(fm_cpu_isa isa, int n_threads, fm_cpu_engine **out);
void fm_cpu_engine_free(fm_cpu_engine *e);
const char *fm_cpu_engine_describe(const fm_cpu_engine *e); /* kernel/backend */
/* Accumulate phase times of later fm_cpu_forward calls into pt (NULL stops). */
void fm_cpu_engine_set_phase_times(fm_cpu_engine *e, fm_phase_times *pt);
fm_status fm_cpu_forward(fm_cpu_engine *e, const fm_model_desc *d,
                         const fm_moe_layer *l, const void *x, fm_dtype xdt,
                         int T, const int32_t *token_ids, fm_moe_out *o);

/* Streaming-read bandwidth of host memory (bytes/s), measured now. */
double fm_cpu_measure_bandwidth(size_t bytes, int n_threads);

/* Progress of a long operation: frac in [0, 1]. */
typedef void (*fm_progress_fn)(void *ctx, const char *what, double frac);

typedef struct {
    int T;                    /* batch (tokens)                                */
    int reps;                 /* passes over the layers that were timed        */
    double us_per_layer;      /* median over passes of the per-layer mean      */
    double us_min, us_max;    /* fastest / slowest pass, per layer             */
    double tokens_per_s;      /* T / us_per_layer                              */
    double active_experts;    /* routed experts used, mean over layers         */
    int64_t bytes_per_layer;  /* weights read (mean): active routed experts +
                                 shared expert + router matrix                 */
    double gbps;              /* bytes_per_layer / us_per_layer, 1e9 bytes/s   */
    char kernel[160];         /* fm_cpu_engine_describe                        */
} fm_cpu_bench_result;

/* Times fm_cpu_forward at batch T, cycling the n_layers layers (distinct
 * weights, so caches do not flatter the figure) for at least min_seconds
 * and 3 passes. Activations are seeded normal values, routed by each
 * layer's own router (DeepSeek-V4 hash layers get seeded token ids). */
fm_status fm_cpu_bench(fm_cpu_engine *e, const fm_model_desc *d, fm_moe_layer *const *layers,
                       int n_layers, int T, uint64_t seed, double min_seconds, fm_progress_fn progress,
                       void *progress_ctx, fm_cpu_bench_result *r);
/* Layers to cycle so that one pass at batch 1 reads well beyond the last-
 * level cache, bounded by half of physical memory (at least 1). */
int fm_cpu_bench_default_layers(const fm_model_desc *d, fm_qformat fmt);

/* ------------------------------------------- pre-routed experts (all engines) */

/*
 * The experts of a layer on tokens the caller has already routed, as vLLM's
 * and SGLang's MoE layers and expert parallelism call them:
 *   out[t] = sum_j topk_weights[t][j] * expert_{topk_ids[t][j]}(x[t])
 *            (+ the shared expert, unweighted, when include_shared)
 * topk_ids / topk_weights are [T][topk] (topk = the layer's k); an id < 0
 * contributes nothing (an expert another rank holds). The CPU engine
 * rejects ids >= E with FM_E_RANGE; the CUDA engine cannot check without a
 * host synchronization and skips them. x is F32/BF16/F16 [T][H], out F32.
 * CPU: T >= 1; every weight must be finite (FM_E_NUMERIC, naming token and
 * slot); the router is not used (router_w may be NULL); include_shared
 * adds nothing to a layer without a shared expert.
 */
fm_status fm_cpu_experts(fm_cpu_engine *e, const fm_model_desc *d, const fm_moe_layer *l,
                         const void *x, fm_dtype xdt, int T, const int32_t *topk_ids,
                         const float *topk_weights, int include_shared, float *out);

/* ------------------------------------------ layers from engine-held tensors */

/* A strided view of a tensor another framework owns (torch, NumPy): host
 * memory for the CPU engine, device memory for the CUDA one. Strides are in
 * elements; the innermost one must be 1. data NULL: the tensor is absent. */
typedef struct {
    const void *data;
    fm_dtype dtype;
    int ndim;
    int64_t shape[FM_MAX_DIMS];
    int64_t stride[FM_MAX_DIMS];
} fm_tensor;

typedef enum {
    FM_TL_MODELOPT_NVFP4 = 1, /* vLLM / SGLang ModelOpt NVFP4 MoE layer       */
    FM_TL_GPTOSS_MXFP4        /* gpt-oss checkpoint MXFP4 experts              */
} fm_tensor_layout;

/*
 * One MoE layer as the engines hold it. I is the intermediate size of the
 * partition (a TP rank's share); the model description gives H, E and k.
 *   ModelOpt NVFP4: w13_weight U8 [E, 2I, H/2] (gate rows, then up rows;
 *     low nibble = even element), w13_weight_scale F8_E4M3 [E, 2I, H/16],
 *     w13_weight_scale_2 F32 [E] or [E, 2], w2_weight U8 [E, H, I/2],
 *     w2_weight_scale F8_E4M3 [E, H, I/16], w2_weight_scale_2 F32 [E].
 *   gpt-oss MXFP4 (the checkpoint's names): gate_up_blocks U8
 *     [E, 2I, H/32, 16] (rows interleaved: gate, up, gate, ...),
 *     gate_up_scales U8 (E8M0) [E, 2I, H/32], gate_up_bias BF16/F32 [E, 2I],
 *     down_blocks U8 [E, H, I/32, 16], down_scales [E, H, I/32],
 *     down_bias [E, H].
 * The router (router_w F32/BF16 [E, H]; router_bias [E] for gpt-oss;
 * score_bias [E] for noaux_tc) is optional: without it only the
 * pre-routed call runs. The fused shared expert (shared_gate / shared_up
 * [SI, H/2], shared_down [H, SI/2], with *_scale and *_scale_2 in the
 * routed experts' format) is optional too.
 */
typedef struct {
    fm_tensor_layout layout;
    int inter;  /* I of this partition */
    fm_tensor w13_weight, w13_weight_scale, w13_weight_scale_2;
    fm_tensor w2_weight, w2_weight_scale, w2_weight_scale_2;
    fm_tensor gate_up_blocks, gate_up_scales, gate_up_bias;
    fm_tensor down_blocks, down_scales, down_bias;
    fm_tensor router_w, router_bias, score_bias;
    fm_tensor shared_gate, shared_gate_scale, shared_gate_scale_2;
    fm_tensor shared_up, shared_up_scale, shared_up_scale_2;
    fm_tensor shared_down, shared_down_scale, shared_down_scale_2;
} fm_layer_tensors;

/* Checks every tensor's presence, dtype, shape and strides against d and
 * t->inter, with the checkpoint loader's messages (naming the tensor).
 * Looks at no data. */
fm_status fm_layer_tensors_check(const fm_model_desc *d, const fm_layer_tensors *t);
/* A layer in host memory from host tensors (copied; the views may go away
 * afterwards), for the CPU engine and fm_cuda_layer_upload. layer is the
 * layer's index in the model (hash routing, messages). The layer's inter
 * is t->inter and its shared width shared_gate's rows; without router_w it
 * has no router (the pre-routed call only). weight_scale_2 values must be
 * positive and finite. */
fm_status fm_moe_layer_from_tensors(const fm_model_desc *d, int layer, const fm_layer_tensors *t,
                                    fm_moe_layer **out);

/* Monotonic clock in nanoseconds. */
uint64_t fm_now_ns(void);

/* ---------------------------------------------------- CUDA backend (src/cuda) */
/* @section cuda begin */
/* Without a CUDA build every function here returns FM_E_UNSUPPORTED. */
typedef struct fm_cuda_engine fm_cuda_engine;
typedef struct fm_cuda_layer fm_cuda_layer;

/* 1 when built with CUDA and a usable GPU is present; else 0 and why. */
int fm_cuda_available(char *why, size_t cap);
fm_status fm_cuda_engine_new(int device, fm_cuda_engine **out);
void fm_cuda_engine_free(fm_cuda_engine *e);
/* "NVIDIA H200, 132 SMs, sm_90, CUDA 13.0, driver 580.x" */
const char *fm_cuda_engine_describe(const fm_cuda_engine *e);
/* Fills the tuning key of this GPU for a model shape. */
fm_status fm_cuda_engine_key(const fm_cuda_engine *e, const fm_model_desc *d,
                             fm_qformat fmt, struct fm_tune_key *key);
/* Forces a kernel config (tuning); NULL returns to the tuned/default one.
 * A config a tuned-config file could not hold (a field out of range, a
 * wgmma config of another block shape) is refused with FM_E_ARG, naming the
 * field, and the engine keeps what it had. */
fm_status fm_cuda_engine_set_config(fm_cuda_engine *e, const fm_kernel_config *cfg);
/* Accumulates per-phase times (CUDA events between phases) when set. */
void fm_cuda_engine_set_phase_times(fm_cuda_engine *e, fm_phase_times *pt);
/* Runs the shared expert (default 1). Benchmarks against peers that compute
 * only the routed experts turn it off so both sides do the same work. */
void fm_cuda_engine_set_shared(fm_cuda_engine *e, int enabled);
/* Benchmarks (fm_cuda_bench) first replay the graph for ms milliseconds
 * (0, the default: three warm-up replays only), so that the timed replays
 * run at the clocks the GPU's power limit allows under sustained load, not
 * in the burst before its power management lowers them. ms in (0, 600000];
 * any other value turns it off. */
void fm_cuda_engine_set_sustain(fm_cuda_engine *e, double ms);

fm_status fm_cuda_layer_upload(fm_cuda_engine *e, const fm_model_desc *d,
                               const fm_moe_layer *l, fm_cuda_layer **out);
/* Seeded random weights generated on the GPU: the same values as
 * fm_moe_layer_random (same seed, layer, format). */
fm_status fm_cuda_layer_random(fm_cuda_engine *e, const fm_model_desc *d,
                               fm_qformat fmt, uint64_t seed, int layer,
                               fm_cuda_layer **out);
void fm_cuda_layer_free(fm_cuda_layer *l);

/* One MoE block on the GPU, host buffers in and out (forward, tests). */
fm_status fm_cuda_forward(fm_cuda_engine *e, const fm_model_desc *d,
                          const fm_cuda_layer *l, const void *x, fm_dtype xdt,
                          int T, const int32_t *token_ids, fm_moe_out *o);

typedef struct {
    double us_per_layer;      /* median over replays                       */
    double us_min, us_max;    /* spread over replays                       */
    double active_experts;    /* mean over layers                          */
    int64_t bytes_per_layer;  /* weight bytes that must be read (mean)     */
    char kernel[640];         /* kernel(s) that ran: the longest line, with
                               * every A/B switch that adds to it, is ~580 */
    fm_kernel_config cfg;     /* with which parameters                     */
    char config_source[512];  /* tuned file path or "built-in default"     */
    double route_us;          /* routing launches alone, same graph shape  */
    double logits_us;         /* router logits kernel alone, likewise      */
} fm_cuda_bench_result;
/* n_layers layers back to back in one CUDA graph at batch T, random
 * activations from seed, uniform random routing by the real routers. */
fm_status fm_cuda_bench(fm_cuda_engine *e, const fm_model_desc *d,
                        fm_cuda_layer *const *layers, int n_layers, int T,
                        uint64_t seed, int reps, fm_cuda_bench_result *r);
/* Streaming-read bandwidth of device memory (bytes/s), measured now. */
double fm_cuda_measure_bandwidth(fm_cuda_engine *e, size_t bytes);
/* The same read kept up for `seconds` (the probe's grid-stride kernel back
 * to back): its mean rate in bytes/s, 0 on failure (fm_last_error says
 * why). What the device draws while it only streams memory (`profile`). */
double fm_cuda_sustained_read(fm_cuda_engine *e, size_t bytes, double seconds);

/* ---- calls on caller-owned device memory (engines, CUDA graphs)
 * Device pointers in and out, the caller's stream (a cudaStream_t; NULL is
 * the legacy default stream), no host synchronization and no allocation:
 * capturable in a CUDA graph. The engine's workspace must be reserved first
 * for the largest T (fm_cuda_engine_reserve); a larger T fails with
 * FM_E_RANGE. One call at a time per engine: calls share its workspace. */
fm_status fm_cuda_engine_reserve(fm_cuda_engine *e, const fm_cuda_layer *l, int max_T);
/* Routing included: out [T][H] F32; topk_ids / topk_weights [T][k] (may be
 * NULL); token_ids [T] for hash-routed layers (else NULL). */
fm_status fm_cuda_moe(fm_cuda_engine *e, const fm_cuda_layer *l, const void *x, fm_dtype xdt, int T,
                      const int32_t *token_ids, float *out, int32_t *topk_ids, float *topk_weights,
                      void *stream);
/* Pre-routed (see fm_cpu_experts): topk_ids I32 / topk_weights F32 [T][k]
 * on the device; ids outside [0, E) contribute nothing. */
fm_status fm_cuda_experts(fm_cuda_engine *e, const fm_cuda_layer *l, const void *x, fm_dtype xdt, int T,
                          const int32_t *topk_ids, const float *topk_weights, int include_shared,
                          float *out, void *stream);
/* A layer from tensors in device memory (fm_layer_tensors), repacked on the
 * device into the engine's layout; the views may go away afterwards. */
fm_status fm_cuda_layer_from_tensors(fm_cuda_engine *e, const fm_model_desc *d, int layer,
                                     const fm_layer_tensors *t, fm_cuda_layer **out);

/* The built-in default config for a shape and batch (owned by src/cuda,
 * compiled without CUDA too, so `explain` works anywhere). */
fm_kernel_config fm_kernel_config_default(const struct fm_tune_key *key, int T);
/* The same without the wgmma path (the mma.sync small / large switch): what
 * runs where the wgmma path cannot. */
fm_kernel_config fm_kernel_config_default_mma(const struct fm_tune_key *key, int T);
/* Checks the FP4MOE_CUDA_* experiment switches in the environment: an
 * unknown name or a value the switch does not take is an error naming it
 * (fm_cuda_engine_new fails with it). */
fm_status fm_cuda_env_check(void);
const char *fm_kernel_path_name(fm_kernel_path p);
/* @section cuda end */

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
} fm_tune_choice;

/* Lookup (fm_tune_search_dirs): $FP4MOE_CONFIG_DIR, the user cache, the
 * shipped configs, then the copies of them built into the library; nearest
 * batch bucket. Never fails for a missing file: returns the default with
 * tuned = 0 and a reason saying so. Thread-safe; parsed files are cached in
 * memory (revalidated by size and mtime). */
fm_status fm_tune_choose(const fm_tune_key *key, int T, fm_tune_choice *out);

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

/* ---------------------------------------------------- tensor / expert parallel (src/parallel) */
/* @section dist begin */
/*
 * Tensor parallel (TP): rank r holds rows [r*I/R, (r+1)*I/R) of every
 * expert's gate/up and the same columns of down (zero-copy views); the
 * partial outputs are summed. Expert parallel (EP): rank r holds experts
 * [r*E/R, (r+1)*E/R); routing runs over all E on every rank and each rank
 * computes only the (token, expert) pairs it owns. Shared experts: TP-sliced
 * under TP; under EP replicated and computed data-parallel (each rank for its
 * own token chunk). The same sharding and combine code runs over a simulated
 * in-process communicator (CI) and over NCCL. See docs/parallel.md.
 */
#define FM_DIST_MAX_RANKS 256

typedef enum { FM_DIST_TP = 1, FM_DIST_EP = 2 } fm_dist_mode;
typedef enum {
    FM_DIST_REPLICATED = 0,   /* every rank holds all T tokens (TP attention);
                                 outputs are all-reduced                     */
    FM_DIST_TOKEN_SHARDED = 1 /* rank r holds token chunk r (DP attention):
                                 TP all-gathers the inputs and reduce-scatters
                                 the outputs; EP dispatches tokens to expert
                                 owners (all-to-all) and combines back       */
} fm_dist_layout;
/* Activations as sent in the all-gather / dispatch. */
typedef enum {
    FM_COMPRESS_NONE = 0, /* F32                                             */
    FM_COMPRESS_FP8,      /* E4M3 + one FP32 scale per token                 */
    FM_COMPRESS_NVFP4     /* E2M1, E4M3 scale per 16, FP32 scale per token   */
} fm_compress;
const char *fm_dist_mode_name(fm_dist_mode m);       /* "tp", "ep"          */
const char *fm_dist_layout_name(fm_dist_layout l);   /* "replicated", "token-sharded" */
const char *fm_compress_name(fm_compress c);         /* "none", "fp8", "nvfp4" */
/* Return 0 and set *out, or -1 for an unknown name. */
int fm_dist_layout_from_name(const char *s, fm_dist_layout *out);
int fm_compress_from_name(const char *s, fm_compress *out);

typedef struct fm_dist_opts { /* tagged: other sections may forward-declare it */
    fm_dist_mode mode;
    int ranks;             /* R, 1..FM_DIST_MAX_RANKS                         */
    fm_dist_layout layout;
    fm_compress compress;  /* needs FM_DIST_TOKEN_SHARDED (else nothing is sent) */
} fm_dist_opts;

/* Checks that a layer can be split so: I (and the shared width) divisible by
 * R into multiples of the format block (TP), E divisible by R (EP), H a
 * multiple of 16 for NVFP4 compression. The message names the numbers. */
fm_status fm_dist_check(const fm_model_desc *d, const fm_moe_layer *l,
                        const fm_dist_opts *o);

/* A communicator over R ranks. A process drives one or more "local" ranks;
 * every collective takes one host buffer per local rank (arrays indexed by
 * local rank) and returns when all of them are done. */
typedef struct fm_comm fm_comm;
/* R simulated ranks in this process (memory copies; CI and --device cpu). */
fm_status fm_comm_sim_new(int n_ranks, fm_comm **out);
/* One process driving GPUs 0..n-1 through NCCL (ncclCommInitAll). NCCL is
 * loaded at run time: $FM_NCCL_LIB, else libnccl.so.2 on the loader path. */
fm_status fm_comm_nccl_new(int n_gpus, fm_comm **out);
/* One process per GPU across hosts: MPI_COMM_WORLD ranks, the NCCL unique id
 * broadcast over MPI. Built only with -DFM_MPI=ON (else FM_E_UNSUPPORTED). */
fm_status fm_comm_nccl_new_mpi(fm_comm **out);
void fm_comm_free(fm_comm *c);
int fm_comm_size(const fm_comm *c);                /* R                      */
int fm_comm_local_count(const fm_comm *c);         /* ranks in this process  */
int fm_comm_local_rank(const fm_comm *c, int i);   /* global rank of local i */
int fm_comm_device(const fm_comm *c, int i);       /* GPU of local i, -1 CPU */
const char *fm_comm_describe(const fm_comm *c);

/* buf[i]: count floats, summed over all ranks in place. */
fm_status fm_comm_all_reduce_sum(fm_comm *c, float *const *buf, size_t count);
/* send[i]: R*count floats; recv[i] gets the sum of block (rank of i). */
fm_status fm_comm_reduce_scatter_sum(fm_comm *c, const float *const *send,
                                     float *const *recv, size_t count);
/* send[i]: bytes; recv[i]: R*bytes, block r from rank r. */
fm_status fm_comm_all_gather(fm_comm *c, const void *const *send,
                             void *const *recv, size_t bytes);
/* Variable all-to-all. send_bytes[i][p] bytes go from local i to rank p,
 * packed in p order in send[i]; recv_bytes[i][p] bytes arrive from rank p,
 * packed in p order in recv[i] (the caller learns them first, e.g. by an
 * all-to-all of counts). */
fm_status fm_comm_all_to_allv(fm_comm *c, const void *const *send,
                              const size_t *const *send_bytes,
                              void *const *recv,
                              const size_t *const *recv_bytes);

typedef struct {
    double ns;       /* wall time inside collectives                          */
    int64_t bytes;   /* payload bytes handed to collectives by local rank 0   */
    int64_t calls;
} fm_comm_stats;
void fm_comm_get_stats(const fm_comm *c, fm_comm_stats *s);
void fm_comm_reset_stats(fm_comm *c);

/* A sharded MoE layer bound to a communicator and an engine. The model
 * description and the layer are borrowed and must outlive it. */
typedef struct fm_dist fm_dist;
/* Ranks computed by the CPU engine (sequentially, one after another). */
fm_status fm_dist_new_cpu(const fm_model_desc *d, const fm_moe_layer *l,
                          const fm_dist_opts *o, fm_comm *c, fm_cpu_engine *e,
                          fm_dist **out);
/* Ranks computed by the CUDA engine on each local rank's GPU. */
fm_status fm_dist_new_cuda(const fm_model_desc *d, const fm_moe_layer *l,
                           const fm_dist_opts *o, fm_comm *c, fm_dist **out);
void fm_dist_free(fm_dist *ds);
const char *fm_dist_describe(const fm_dist *ds);

typedef struct {
    int ranks;
    int64_t pairs[FM_DIST_MAX_RANKS];  /* (token, routed expert) pairs computed */
    int active[FM_DIST_MAX_RANKS];     /* routed experts with >= 1 token        */
    double load_imbalance;             /* max pairs / mean pairs (1 = even)     */
    double compute_ns[FM_DIST_MAX_RANKS]; /* local ranks only (0 elsewhere)     */
    double comm_ns;                    /* time inside collectives               */
    int64_t comm_bytes;                /* payload bytes sent by one rank        */
    int64_t act_bytes;                 /* of which activations (all-gather or
                                          dispatch) sent by local rank 0        */
} fm_dist_stats;

/*
 * One MoE block over the sharded layer. x [T, H] (F32/BF16/F16) holds all T
 * tokens; under FM_DIST_TOKEN_SHARDED rank r reads only its chunk (tokens
 * [r*C, (r+1)*C), C = ceil(T/R)). o->out gets the rows of the tokens that
 * the local ranks own (all rows when every rank is local or the layout is
 * replicated). topk ids/weights (may be NULL) equal the unsharded layer's;
 * they are filled for every token, except under EP token-sharded where
 * only the local ranks' chunks are known. st may be NULL.
 */
fm_status fm_dist_forward(fm_dist *ds, const void *x, fm_dtype xdt, int T,
                          const int32_t *token_ids, fm_moe_out *o,
                          fm_dist_stats *st);

typedef struct {
    int T, ranks, reps;
    double us_total;      /* per layer: slowest rank's compute + comm (median) */
    double us_rank[FM_DIST_MAX_RANKS]; /* compute per local rank (median)   */
    double us_comm;       /* median time inside collectives                    */
    double us_single;     /* the unsharded layer on one device (median)        */
    double speedup;       /* us_single / us_total                              */
    double efficiency;    /* speedup / ranks                                   */
    double load_imbalance;/* mean over the timed steps                         */
    int64_t comm_bytes;   /* per step                                          */
    char transport[160];
    char method[160];     /* how the times were taken                          */
} fm_dist_bench_result;
/* Opens the transport for dev (simulated ranks for FM_DEV_CPU; NCCL over
 * o->ranks GPUs of this process, or one GPU per MPI process when mpi is set,
 * for FM_DEV_CUDA) and the sharded layer on it (cpu: the engine of
 * FM_DEV_CPU). Free with fm_dist_free, then fm_comm_free. */
fm_status fm_dist_open(const fm_dist_opts *o, fm_device dev, int mpi, fm_cpu_engine *cpu, const fm_model_desc *d,
                       const fm_moe_layer *l, fm_comm **comm, fm_dist **out);
/* fm_dist_open + fm_dist_forward + free: one sharded MoE block, e.g. in
 * place of fm_cpu_forward / fm_cuda_forward in `forward`. */
fm_status fm_dist_run(const fm_dist_opts *o, fm_device dev, int mpi, fm_cpu_engine *cpu, const fm_model_desc *d,
                      const fm_moe_layer *l, const void *x, fm_dtype xdt, int T, const int32_t *token_ids,
                      fm_moe_out *out, fm_dist_stats *st);

/* reps steps at batch T with seeded random activations. */
fm_status fm_dist_bench(fm_dist *ds, int T, uint64_t seed, int reps,
                        fm_dist_bench_result *r);
/* @section dist end */

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
    int layers_wanted;        /* distinct layers asked for (or the default)   */
    int layers;               /* cycled: fewer when a checkpoint holds fewer   */
    double bandwidth_Bps;
    char bandwidth_probe[128];/* what was read, in words                       */
    int n_batches;            /* batch sizes asked for: rows[i].T and .decision */
    int n_rows;               /* batch sizes measured so far                   */
    fm_bench_row rows[FM_BENCH_MAX_BATCH];
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
    uint64_t seed;
    const fm_dist_opts *dist; /* non-NULL: the sharded layer                   */
    int dist_mpi;             /* one GPU per MPI process                       */
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

#ifdef __cplusplus
}
#endif
#endif /* FP4MOE_H */
