/* one MoE layer, routing, the CPU engines; included by fp4moe.h (users include fp4moe.h). */
#ifndef FP4MOE_ENGINE_H
#define FP4MOE_ENGINE_H

#ifndef FP4MOE_H
#error "include fp4moe.h, not fp4moe/engine.h"
#endif

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
/* SPLITK: few tokens on experts of I <= 512 (a TP rank's slices): gate/up
 * split into k_split chunks of K over separate warps, down a block per 16
 * output rows over every expert (any sm_80 and later). */
typedef enum { FM_PATH_SMALL = 0, FM_PATH_LARGE = 1, FM_PATH_WGMMA = 2, FM_PATH_SPLITK = 3 } fm_kernel_path;
/* The splitk path runs up to FM_SPLITK_MAX_TOKENS tokens on experts of I up
 * to FM_SPLITK_DEFAULT_I; the built-in default takes it up to
 * FM_SPLITK_DEFAULT_T tokens (the tuner tries it up to the maximum). */
#define FM_SPLITK_MAX_TOKENS 16
#define FM_SPLITK_DEFAULT_T 1
#define FM_SPLITK_DEFAULT_I 512
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

#endif /* FP4MOE_ENGINE_H */
