/* One EP rank's step timed on the GPU: the pre-routed experts call on the
 * pairs the full routing sends to the rank's experts, then its shared
 * expert on its token chunk, for every layer, in one CUDA graph replayed
 * as fm_cuda_bench does. Only the public device calls run here. */
#include "cuda_internal.h"
#include <stdlib.h>
#include <string.h>

static int cmp_dbl(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

#define CK(call)                                                                                        \
    do {                                                                                                \
        cudaError_t err_ = (call);                                                                      \
        if (err_ != cudaSuccess && !s) s = fm_error(FM_E_CUDA, "EP rank timing: %s: %s", #call,         \
                                                    cudaGetErrorString(err_));                          \
    } while (0)

fm_status fm_cuda_bench_ep_rank(fm_cuda_engine *e, fm_cuda_layer *const *layers, int n_layers, int T,
                                const float *x, const int32_t *ids, const float *w, int t0, int n_chunk, int reps,
                                double *us_med, double *us_min, double *us_max) {
    if (!e || !layers || n_layers < 1 || T < 1 || !x || !ids || !w || reps < 1 || t0 < 0 || n_chunk < 0 ||
        t0 + n_chunk > T)
        return fm_error(FM_E_ARG, "fm_cuda_bench_ep_rank: bad argument");
    FM_CU(cudaSetDevice(e->device));
    const int H = layers[0]->H, k = layers[0]->k;
    for (int i = 0; i < n_layers; i++)
        if (!layers[i] || layers[i]->H != H || layers[i]->k != k)
            return fm_error(FM_E_ARG, "fm_cuda_bench_ep_rank: layers of different shapes");
    fm_status s = fm_cuda_engine_reserve(e, layers[0], T);
    if (s) return s;
    const int shared = n_chunk > 0 && layers[0]->has_shared;
    const size_t xb = (size_t)T * H * sizeof(float), kb = (size_t)T * k * sizeof(float);
    float *dx = NULL, *dout = NULL, *dsh = NULL, *dw = NULL, *dw0 = NULL;
    int32_t *dids = NULL, *dnone = NULL;
    cudaStream_t st = NULL;
    cudaGraph_t g = NULL;
    cudaGraphExec_t ge = NULL;
    cudaEvent_t *ev = (cudaEvent_t *)calloc((size_t)reps + 1, sizeof(cudaEvent_t));
    double *t = (double *)calloc((size_t)reps, sizeof(double));
    int nev = 0;
    if (!ev || !t) s = fm_error(FM_E_NOMEM, "out of memory");
    CK(cudaMalloc(&dx, xb));
    CK(cudaMalloc(&dout, xb));
    CK(cudaMalloc(&dsh, xb));
    CK(cudaMalloc(&dids, kb * n_layers));
    CK(cudaMalloc(&dw, kb * n_layers));
    CK(cudaMalloc(&dnone, kb));
    CK(cudaMalloc(&dw0, kb));
    if (!s) {
        CK(cudaMemcpy(dx, x, xb, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dids, ids, kb * n_layers, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dw, w, kb * n_layers, cudaMemcpyHostToDevice));
        CK(cudaMemset(dnone, 0xFF, kb)); /* -1: no routed expert (the shared call) */
        CK(cudaMemset(dw0, 0, kb));
        if (!s) s = fm_cuda_settle("the EP rank benchmark's inputs");
        CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    }
    if (!s) {
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        fm_status cs = FM_OK;
        for (int i = 0; i < n_layers && !cs; i++) {
            cs = fm_cuda_experts(e, layers[i], dx, FM_DT_F32, T, dids + (size_t)i * T * k, dw + (size_t)i * T * k, 0,
                                 dout, st);
            if (!cs && shared)
                cs = fm_cuda_experts(e, layers[i], dx + (size_t)t0 * H, FM_DT_F32, n_chunk, dnone, dw0, 1,
                                     dsh + (size_t)t0 * H, st);
        }
        cudaError_t err = cudaStreamEndCapture(st, &g);
        if (cs) s = cs;
        else if (err != cudaSuccess) s = fm_error(FM_E_CUDA, "EP rank graph: %s", cudaGetErrorString(err));
        if (!s) CK(cudaGraphInstantiateWithFlags(&ge, g, 0));
    }
    for (; !s && nev < reps + 1; nev++) CK(cudaEventCreate(&ev[nev]));
    for (int i = 0; !s && i < 3; i++) CK(cudaGraphLaunch(ge, st));
    if (!s) CK(cudaStreamSynchronize(st));
    if (!s) {
        CK(cudaEventRecord(ev[0], st));
        for (int i = 0; i < reps && !s; i++) {
            CK(cudaGraphLaunch(ge, st));
            CK(cudaEventRecord(ev[i + 1], st));
        }
        CK(cudaStreamSynchronize(st));
    }
    if (!s) {
        for (int i = 0; i < reps; i++) {
            float ms = 0;
            cudaEventElapsedTime(&ms, ev[i], ev[i + 1]);
            t[i] = ms * 1e3 / n_layers;
        }
        qsort(t, (size_t)reps, sizeof(double), cmp_dbl);
        *us_med = t[reps / 2];
        *us_min = t[0];
        *us_max = t[reps - 1];
    }
    for (int i = 0; i < nev; i++) cudaEventDestroy(ev[i]);
    if (ge) cudaGraphExecDestroy(ge);
    if (g) cudaGraphDestroy(g);
    if (st) cudaStreamDestroy(st);
    cudaFree(dx); cudaFree(dout); cudaFree(dsh); cudaFree(dids); cudaFree(dw); cudaFree(dnone); cudaFree(dw0);
    free(ev);
    free(t);
    return s;
}
