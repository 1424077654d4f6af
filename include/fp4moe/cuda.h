/* the CUDA backend; included by fp4moe.h (users include fp4moe.h). */
#ifndef FP4MOE_CUDA_H
#define FP4MOE_CUDA_H

#ifndef FP4MOE_H
#error "include fp4moe.h, not fp4moe/cuda.h"
#endif

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
/* The activations' type the benchmarks (fm_cuda_bench) feed: FM_DT_F32
 * (the default), FM_DT_BF16 or FM_DT_F16, the same values rounded to the
 * type, as an engine passes its hidden states. The router logits of BF16 or
 * F16 activations take one or two BF16 terms where FP32 takes three.
 * FM_E_ARG for any other type. */
fm_status fm_cuda_engine_set_bench_act(fm_cuda_engine *e, fm_dtype xdt);

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
 * FM_E_RANGE. One call at a time per engine: calls share its workspace.
 * The calls order themselves after earlier work on `stream` only: inputs
 * written on another stream (a cudaMemset or cudaMemcpy on the legacy
 * stream, when `stream` is non-blocking) need an event or a synchronization
 * first. Layer creation and fm_cuda_engine_reserve return with their own
 * device writes complete. */
fm_status fm_cuda_engine_reserve(fm_cuda_engine *e, const fm_cuda_layer *l, int max_T);
/* The kernel config those calls run at T tokens: cfg, the kernels' names and
 * where the config came from (the tuned file, "built-in default", or "set
 * by caller"). Each layer keeps a table of them by batch, looked up once for
 * every T up to max_T by fm_cuda_engine_reserve (or by the layer's first
 * call, or the first after fm_cuda_engine_set_config), so a call makes no
 * config lookup, file access or allocation; a tuned-config file edited
 * later takes effect for layers made or reserved afterwards. Any of cfg,
 * kernel, source may be NULL. */
fm_status fm_cuda_layer_call_config(fm_cuda_engine *e, const fm_cuda_layer *l, int T, fm_kernel_config *cfg,
                                    char *kernel, size_t kernel_cap, char *source, size_t source_cap);
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

#endif /* FP4MOE_CUDA_H */
