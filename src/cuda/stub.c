/* Without a CUDA build, the CUDA API answers FM_E_UNSUPPORTED with a reason. */
#ifndef FM_HAVE_CUDA
#include "fp4moe.h"
#include <stdio.h>

#define NOCUDA fm_error(FM_E_UNSUPPORTED, "fp4moe was built without CUDA (nvcc not found at configure time)")
int fm_cuda_available(char *why, size_t cap) {
    if (why && cap) snprintf(why, cap, "fp4moe was built without CUDA");
    return 0;
}
fm_status fm_cuda_engine_new(int device, fm_cuda_engine **out) { (void)device; *out = NULL; return NOCUDA; }
void fm_cuda_engine_free(fm_cuda_engine *e) { (void)e; }
const char *fm_cuda_engine_describe(const fm_cuda_engine *e) { (void)e; return "no CUDA"; }
fm_status fm_cuda_engine_key(const fm_cuda_engine *e, const fm_model_desc *d, fm_qformat fmt, struct fm_tune_key *key) {
    (void)e; (void)d; (void)fmt; (void)key; return NOCUDA;
}
fm_status fm_cuda_engine_set_config(fm_cuda_engine *e, const fm_kernel_config *cfg) {
    (void)e;
    (void)cfg;
    return fm_error(FM_E_UNSUPPORTED, "this build of fp4moe has no CUDA backend");
}
void fm_cuda_engine_set_phase_times(fm_cuda_engine *e, fm_phase_times *pt) { (void)e; (void)pt; }
void fm_cuda_engine_set_shared(fm_cuda_engine *e, int enabled) { (void)e; (void)enabled; }
void fm_cuda_engine_set_sustain(fm_cuda_engine *e, double ms) { (void)e; (void)ms; }
fm_status fm_cuda_engine_set_bench_act(fm_cuda_engine *e, fm_dtype xdt) {
    (void)e;
    (void)xdt;
    return fm_error(FM_E_UNSUPPORTED, "fp4moe was built without the CUDA backend");
}
fm_status fm_cuda_layer_upload(fm_cuda_engine *e, const fm_model_desc *d, const fm_moe_layer *l, fm_cuda_layer **out) {
    (void)e; (void)d; (void)l; *out = NULL; return NOCUDA;
}
fm_status fm_cuda_layer_random(fm_cuda_engine *e, const fm_model_desc *d, fm_qformat fmt, uint64_t seed, int layer, fm_cuda_layer **out) {
    (void)e; (void)d; (void)fmt; (void)seed; (void)layer; *out = NULL; return NOCUDA;
}
fm_status fm_cuda_layer_random_shard(fm_cuda_engine *e, const fm_model_desc *d, fm_qformat fmt, uint64_t seed,
                                     int layer, const fm_shard *sh, fm_cuda_layer **out) {
    (void)e; (void)d; (void)fmt; (void)seed; (void)layer; (void)sh; *out = NULL; return NOCUDA;
}
fm_status fm_cuda_bench_ep_rank(fm_cuda_engine *e, fm_cuda_layer *const *layers, int n_layers, int T,
                                const float *x, const int32_t *ids, const float *w, int t0, int n_chunk, int reps,
                                double *us_med, double *us_min, double *us_max) {
    (void)e; (void)layers; (void)n_layers; (void)T; (void)x; (void)ids; (void)w; (void)t0; (void)n_chunk;
    (void)reps; (void)us_med; (void)us_min; (void)us_max; return NOCUDA;
}
void fm_cuda_layer_free(fm_cuda_layer *l) { (void)l; }
fm_status fm_cuda_forward(fm_cuda_engine *e, const fm_model_desc *d, const fm_cuda_layer *l, const void *x, fm_dtype xdt,
                          int T, const int32_t *token_ids, fm_moe_out *o) {
    (void)e; (void)d; (void)l; (void)x; (void)xdt; (void)T; (void)token_ids; (void)o; return NOCUDA;
}
fm_status fm_cuda_bench(fm_cuda_engine *e, const fm_model_desc *d, fm_cuda_layer *const *layers, int n_layers, int T,
                        uint64_t seed, int reps, fm_cuda_bench_result *r) {
    (void)e; (void)d; (void)layers; (void)n_layers; (void)T; (void)seed; (void)reps; (void)r; return NOCUDA;
}
double fm_cuda_measure_bandwidth(fm_cuda_engine *e, size_t bytes) { (void)e; (void)bytes; return 0.0; }
double fm_cuda_sustained_read(fm_cuda_engine *e, size_t bytes, double seconds) {
    (void)e;
    (void)bytes;
    (void)seconds;
    fm_error(FM_E_UNSUPPORTED, "this build has no CUDA backend");
    return 0.0;
}
fm_status fm_cuda_engine_reserve(fm_cuda_engine *e, const fm_cuda_layer *l, int max_T) {
    (void)e; (void)l; (void)max_T; return NOCUDA;
}
fm_status fm_cuda_layer_call_config(fm_cuda_engine *e, const fm_cuda_layer *l, int T, fm_kernel_config *cfg,
                                    char *kernel, size_t kernel_cap, char *source, size_t source_cap) {
    (void)e; (void)l; (void)T; (void)cfg; (void)kernel; (void)kernel_cap; (void)source; (void)source_cap;
    return NOCUDA;
}
fm_status fm_cuda_moe(fm_cuda_engine *e, const fm_cuda_layer *l, const void *x, fm_dtype xdt, int T,
                      const int32_t *token_ids, float *out, int32_t *topk_ids, float *topk_weights, void *stream) {
    (void)e; (void)l; (void)x; (void)xdt; (void)T; (void)token_ids; (void)out; (void)topk_ids; (void)topk_weights;
    (void)stream;
    return NOCUDA;
}
fm_status fm_cuda_experts(fm_cuda_engine *e, const fm_cuda_layer *l, const void *x, fm_dtype xdt, int T,
                          const int32_t *topk_ids, const float *topk_weights, int include_shared, float *out,
                          void *stream) {
    (void)e; (void)l; (void)x; (void)xdt; (void)T; (void)topk_ids; (void)topk_weights; (void)include_shared;
    (void)out; (void)stream;
    return NOCUDA;
}
fm_status fm_cuda_layer_from_tensors(fm_cuda_engine *e, const fm_model_desc *d, int layer, const fm_layer_tensors *t,
                                     fm_cuda_layer **out) {
    (void)e; (void)d; (void)layer; (void)t; *out = NULL; return NOCUDA;
}
#endif
