/*
 * The engines behind the sharded layer: each rank runs the normal forward of
 * its view layer through the CPU engine or the CUDA engine, unchanged.
 */
#include "parallel/parallel_internal.h"
#include "util/util.h"
#include <math.h>
#include <stdio.h>

/* ------------------------------------------------------------------- CPU */

static fm_status cpu_forward(void *ctx, int local, void *h, const fm_model_desc *d, const fm_moe_layer *v,
                             const void *x, fm_dtype xdt, int T, const int32_t *tid, fm_moe_out *o) {
    (void)local;
    (void)h;
    return fm_cpu_forward(ctx, d, v, x, xdt, T, tid, o);
}

static fm_status cpu_route(void *ctx, int local, const fm_model_desc *d, const fm_moe_layer *l, const float *x, int T,
                           const int32_t *tid, int32_t *ids, float *w) {
    (void)ctx;
    (void)local;
    return fm_route(d, l, x, T, tid, ids, w);
}

fm_status fm_dist_exec_cpu(fm_cpu_engine *e, fm_dist_exec *out) {
    if (!e) return fm_error(FM_E_ARG, "dist: no CPU engine");
    *out = (fm_dist_exec){.name = fm_cpu_engine_describe(e), .ctx = e, .forward = cpu_forward, .route = cpu_route};
    return FM_OK;
}

fm_status fm_dist_new_cpu(const fm_model_desc *d, const fm_moe_layer *l, const fm_dist_opts *o, fm_comm *c,
                          fm_cpu_engine *e, fm_dist **out) {
    fm_dist_exec ex = {0};
    *out = NULL;
    fm_status s = fm_dist_exec_cpu(e, &ex);
    if (s) return s;
    return fm_dist_new_exec(d, l, o, c, ex, out);
}

/* ------------------------------------------------------------------ CUDA */

/* One CUDA engine per local rank, on that rank's GPU. Views are uploaded
 * once (prepare). The engine API takes host buffers, so each rank's
 * forward stages through host memory; routing for the EP dispatch plan runs
 * on the host with fm_route (the GPU router matches it by contract). */
typedef struct {
    int n;
    fm_cuda_engine **eng;
    char name[192];
} cuda_ctx;

static fm_status cuda_prepare(void *ctx, int local, const fm_model_desc *d, const fm_moe_layer *v, void **h) {
    cuda_ctx *c = ctx;
    fm_cuda_layer *cl = NULL;
    fm_status s = fm_cuda_layer_upload(c->eng[local], d, v, &cl);
    *h = cl;
    return s;
}
static void cuda_release(void *ctx, int local, void *h) {
    (void)ctx;
    (void)local;
    fm_cuda_layer_free(h);
}
static fm_status cuda_forward(void *ctx, int local, void *h, const fm_model_desc *d, const fm_moe_layer *v,
                              const void *x, fm_dtype xdt, int T, const int32_t *tid, fm_moe_out *o) {
    cuda_ctx *c = ctx;
    (void)v;
    return fm_cuda_forward(c->eng[local], d, h, x, xdt, T, tid, o);
}
/* The weights a TP slice reads in one decode step can fit in L2 (GLM-5 at
 * TP8, B=1: 8 experts x 1.7 MB / 8 = ~1.8 MB; L2 is 50-60 MB), and
 * replaying one copy would time the cache. Extra copies of the view at other
 * addresses, cycled by the engine's benchmark, make the active bytes of the
 * cycle exceed L2 several times, bounded by the memory the copies take. */
#define BENCH_MIN_ACTIVE_BYTES (256.0 * 1048576.0)
#define BENCH_MAX_COPY_BYTES (16.0 * 1073741824.0)
#define BENCH_MAX_COPIES 16

static fm_status cuda_bench(void *ctx, int local, void *h, const fm_model_desc *d, const fm_moe_layer *view, int T,
                            uint64_t seed, int reps, double *us) {
    cuda_ctx *c = ctx;
    fm_cuda_layer *layers[BENCH_MAX_COPIES] = {h};
    const double b = (double)fm_moe_layer_expert_bytes(view), E = view->n_experts, k = view->topk;
    const double active = E > 0 ? E * (1.0 - pow(1.0 - k / E, T)) : 0; /* expected, uniform routing */
    const double step_bytes = E > 0 ? b * active / E : 0;
    int n = step_bytes > 0 ? (int)ceil(BENCH_MIN_ACTIVE_BYTES / step_bytes) : 1;
    if (n > BENCH_MAX_COPIES) n = BENCH_MAX_COPIES;
    if (b > 0 && n * b > BENCH_MAX_COPY_BYTES) n = (int)(BENCH_MAX_COPY_BYTES / b);
    if (n < 1) n = 1;
    fm_status s = FM_OK;
    int have = 1;
    for (; have < n && !s; have++) s = fm_cuda_layer_upload(c->eng[local], d, view, &layers[have]);
    if (s) have--; /* the failed slot holds nothing */
    fm_cuda_bench_result r;
    if (!s) s = fm_cuda_bench(c->eng[local], d, layers, have, T, seed, reps, &r);
    if (!s) *us = r.us_per_layer;
    for (int i = 1; i < have; i++) fm_cuda_layer_free(layers[i]);
    return s;
}
static void cuda_destroy(void *ctx) {
    cuda_ctx *c = ctx;
    if (!c) return;
    for (int i = 0; i < c->n; i++) fm_cuda_engine_free(c->eng[i]);
    free(c->eng);
    free(c);
}

fm_status fm_dist_exec_cuda(const fm_comm *comm, fm_dist_exec *out) {
    const int n = fm_comm_local_count(comm);
    if (n < 1) return fm_error(FM_E_ARG, "dist: no communicator for the CUDA engines");
    cuda_ctx *c = fm_calloc(1, sizeof *c);
    if (!c) return FM_E_NOMEM;
    c->eng = fm_calloc((size_t)n, sizeof *c->eng);
    if (!c->eng) {
        free(c);
        return FM_E_NOMEM;
    }
    c->n = n;
    for (int i = 0; i < n; i++) {
        int dev = fm_comm_device(comm, i);
        if (dev < 0) dev = i;
        fm_status s = fm_cuda_engine_new(dev, &c->eng[i]);
        if (s) {
            fm_error(s, "dist: CUDA engine for rank %d on GPU %d: %s", fm_comm_local_rank(comm, i), dev,
                     fm_last_error());
            cuda_destroy(c);
            return s;
        }
    }
    snprintf(c->name, sizeof c->name, "cuda: %s", fm_cuda_engine_describe(c->eng[0]));
    *out = (fm_dist_exec){.name = c->name,
                          .ctx = c,
                          .prepare = cuda_prepare,
                          .release = cuda_release,
                          .forward = cuda_forward,
                          .route = cpu_route,
                          .destroy = cuda_destroy,
                          .bench = cuda_bench};
    return FM_OK;
}

fm_status fm_dist_new_cuda(const fm_model_desc *d, const fm_moe_layer *l, const fm_dist_opts *o, fm_comm *c,
                           fm_dist **out) {
    fm_dist_exec ex = {0};
    *out = NULL;
    fm_status s = fm_dist_check(d, l, o);
    if (!s) s = fm_dist_exec_cuda(c, &ex);
    if (s) return s;
    return fm_dist_new_exec(d, l, o, c, ex, out);
}
