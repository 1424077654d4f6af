/*
 * The engines behind the sharded layer: each rank runs the normal forward of
 * its view layer through the CPU engine or the CUDA engine, unchanged.
 */
#include "dist/dist.h"
#include "util/util.h"
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
static fm_status cuda_bench(void *ctx, int local, void *h, const fm_model_desc *d, int T, uint64_t seed, int reps,
                            double *us) {
    cuda_ctx *c = ctx;
    fm_cuda_layer *layers[1] = {h};
    fm_cuda_bench_result r;
    fm_status s = fm_cuda_bench(c->eng[local], d, layers, 1, T, seed, reps, &r);
    if (!s) *us = r.us_per_layer;
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
