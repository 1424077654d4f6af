/*
 * The engines behind the sharded layer: each rank runs the normal forward or
 * the pre-routed experts of its view layer through the CPU engine or the
 * CUDA engine, unchanged.
 */
#include "parallel/parallel_internal.h"
#include "util/util.h"
#include <math.h>
#include <stdio.h>
#include <string.h>
#ifdef FM_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

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

static fm_status cpu_experts(void *ctx, int local, void *h, const fm_model_desc *d, const fm_moe_layer *v,
                             const float *x, int T, const int32_t *ids, const float *w, int shared, float *out) {
    (void)local;
    (void)h;
    return fm_cpu_experts(ctx, d, v, x, FM_DT_F32, T, ids, w, shared, out);
}

fm_status fm_dist_exec_cpu(fm_cpu_engine *e, fm_dist_exec *out) {
    if (!e) return fm_error(FM_E_ARG, "dist: no CPU engine");
    *out = (fm_dist_exec){.name = fm_cpu_engine_describe(e),
                          .ctx = e,
                          .forward = cpu_forward,
                          .route = cpu_route,
                          .experts = cpu_experts};
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
 * once (prepare). fm_cuda_forward takes host buffers, so a rank's forward
 * stages through host memory; the experts call runs on device buffers the
 * prepared view keeps (grown with T) on the rank's stream. Routing for the
 * EP dispatch plan runs on the host with fm_route (the GPU router matches it
 * by contract). */
typedef struct {
    int n;
    fm_cuda_engine **eng;
    int *dev;      /* [n] GPU of each local rank  */
    void **stream; /* [n] cudaStream_t, NULL when not created */
    char name[192];
} cuda_ctx;

/* A prepared view: the uploaded layer and the experts call's device
 * buffers for up to cap tokens (the engine's workspace reserved for as
 * many). */
typedef struct {
    fm_cuda_layer *l;
    int cap, k;
    void *x, *ids, *w, *out;
} cuda_view;

static void cuda_view_buffers_free(cuda_view *v) {
#ifdef FM_HAVE_CUDA
    cudaFree(v->x);
    cudaFree(v->ids);
    cudaFree(v->w);
    cudaFree(v->out);
#endif
    v->x = v->ids = v->w = v->out = NULL;
    v->cap = 0;
}

static fm_status cuda_prepare(void *ctx, int local, const fm_model_desc *d, const fm_moe_layer *v, void **h) {
    cuda_ctx *c = ctx;
    *h = NULL;
    cuda_view *cv = fm_calloc(1, sizeof *cv);
    if (!cv) return FM_E_NOMEM;
    cv->k = v->topk;
    fm_status s = fm_cuda_layer_upload(c->eng[local], d, v, &cv->l);
    if (s) {
        free(cv);
        return s;
    }
    *h = cv;
    return FM_OK;
}
static void cuda_release(void *ctx, int local, void *h) {
    cuda_ctx *c = ctx;
    cuda_view *cv = h;
    if (!cv) return;
#ifdef FM_HAVE_CUDA
    cudaSetDevice(c->dev[local]);
#else
    (void)c;
    (void)local;
#endif
    cuda_view_buffers_free(cv);
    fm_cuda_layer_free(cv->l);
    free(cv);
}
static fm_status cuda_forward(void *ctx, int local, void *h, const fm_model_desc *d, const fm_moe_layer *v,
                              const void *x, fm_dtype xdt, int T, const int32_t *tid, fm_moe_out *o) {
    cuda_ctx *c = ctx;
    (void)v;
    return fm_cuda_forward(c->eng[local], d, ((cuda_view *)h)->l, x, xdt, T, tid, o);
}

#ifdef FM_HAVE_CUDA
#define CU(call, what)                                                                                     \
    do {                                                                                                   \
        cudaError_t err_ = (call);                                                                         \
        if (err_ != cudaSuccess)                                                                           \
            return fm_error(FM_E_CUDA, "dist: rank %d experts: %s: %s", local, what, cudaGetErrorString(err_)); \
    } while (0)

/* Device buffers for T tokens, and the engine's workspace for as many:
 * grown (doubling) only when T exceeds what the view holds. */
static fm_status cuda_view_grow(cuda_ctx *c, int local, cuda_view *cv, int H, int T) {
    if (T <= cv->cap) return FM_OK;
    int cap = cv->cap > 0 ? cv->cap : 1;
    while (cap < T) cap = cap > (1 << 23) ? T : 2 * cap;
    cuda_view_buffers_free(cv);
    const size_t xb = (size_t)cap * (size_t)H * sizeof(float), kb = (size_t)cap * (size_t)cv->k * sizeof(float);
    CU(cudaMalloc(&cv->x, xb), "device buffer");
    CU(cudaMalloc(&cv->out, xb), "device buffer");
    CU(cudaMalloc(&cv->ids, kb), "device buffer");
    CU(cudaMalloc(&cv->w, kb), "device buffer");
    fm_status s = fm_cuda_engine_reserve(c->eng[local], cv->l, cap);
    if (s) return s;
    cv->cap = cap;
    return FM_OK;
}
#endif

static fm_status cuda_experts(void *ctx, int local, void *h, const fm_model_desc *d, const fm_moe_layer *v,
                              const float *x, int T, const int32_t *ids, const float *w, int shared, float *out) {
    cuda_ctx *c = ctx;
    cuda_view *cv = h;
    (void)d;
    if (!cv || T < 1 || v->topk != cv->k)
        return fm_error(FM_E_ARG, "dist: rank %d experts: no prepared view, T=%d or top-k %d (view %d)", local, T,
                        v->topk, cv ? cv->k : -1);
#ifdef FM_HAVE_CUDA
    const int H = v->hidden;
    const size_t xb = (size_t)T * (size_t)H * sizeof(float), kb = (size_t)T * (size_t)cv->k * sizeof(float);
    cudaStream_t st = (cudaStream_t)c->stream[local];
    CU(cudaSetDevice(c->dev[local]), "cudaSetDevice");
    fm_status s = cuda_view_grow(c, local, cv, H, T);
    if (s) return s;
    CU(cudaMemcpyAsync(cv->x, x, xb, cudaMemcpyHostToDevice, st), "activations to the device");
    CU(cudaMemcpyAsync(cv->ids, ids, kb, cudaMemcpyHostToDevice, st), "ids to the device");
    CU(cudaMemcpyAsync(cv->w, w, kb, cudaMemcpyHostToDevice, st), "weights to the device");
    s = fm_cuda_experts(c->eng[local], cv->l, cv->x, FM_DT_F32, T, cv->ids, cv->w, shared, cv->out, st);
    if (s) {
        cudaStreamSynchronize(st); /* the copies above read host memory the caller may free */
        return s;
    }
    CU(cudaMemcpyAsync(out, cv->out, xb, cudaMemcpyDeviceToHost, st), "output to the host");
    CU(cudaStreamSynchronize(st), "stream");
    return FM_OK;
#else
    (void)c;
    (void)x;
    (void)ids;
    (void)w;
    (void)shared;
    (void)out;
    return fm_error(FM_E_UNSUPPORTED, "this build has no CUDA backend");
#endif
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
    fm_cuda_layer *layers[BENCH_MAX_COPIES] = {((cuda_view *)h)->l};
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
    for (int i = 0; i < c->n; i++) {
#ifdef FM_HAVE_CUDA
        if (c->stream && c->stream[i]) {
            cudaSetDevice(c->dev[i]);
            cudaStreamDestroy((cudaStream_t)c->stream[i]);
        }
#endif
        if (c->eng) fm_cuda_engine_free(c->eng[i]);
    }
    free(c->eng);
    free(c->dev);
    free(c->stream);
    free(c);
}

fm_status fm_dist_exec_cuda(const fm_comm *comm, fm_dist_exec *out) {
    const int n = fm_comm_local_count(comm);
    if (n < 1) return fm_error(FM_E_ARG, "dist: no communicator for the CUDA engines");
    cuda_ctx *c = fm_calloc(1, sizeof *c);
    if (!c) return FM_E_NOMEM;
    c->n = n;
    c->eng = fm_calloc((size_t)n, sizeof *c->eng);
    c->dev = fm_calloc((size_t)n, sizeof *c->dev);
    c->stream = fm_calloc((size_t)n, sizeof *c->stream);
    if (!c->eng || !c->dev || !c->stream) {
        cuda_destroy(c);
        return FM_E_NOMEM;
    }
    for (int i = 0; i < n; i++) {
        int dev = fm_comm_device(comm, i);
        if (dev < 0) dev = i;
        c->dev[i] = dev;
        fm_status s = fm_cuda_engine_new(dev, &c->eng[i]);
#ifdef FM_HAVE_CUDA
        if (!s) {
            cudaStream_t st = NULL;
            cudaError_t err = cudaSetDevice(dev);
            if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
            if (err != cudaSuccess) s = fm_error(FM_E_CUDA, "stream: %s", cudaGetErrorString(err));
            c->stream[i] = st;
        }
#endif
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
                          .experts = cuda_experts,
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
