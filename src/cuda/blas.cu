/*
 * cuBLAS for the router logits where they are a real GEMM (BF16 activations
 * on the BF16 router, past the GEMV's token limit): cuBLAS's kernels beat
 * fp4moe's tiled mma.sync logits there (docs/perf.md). The library is
 * loaded at run time, not linked, so that libfp4moe keeps no dependency
 * beyond the CUDA driver: the CPU engine, and a GPU engine on a machine
 * without cuBLAS, work as before, and the kernel line says which logits
 * kernel ran (the mma.sync one where cuBLAS could not be loaded, with the
 * reason in the engine's description).
 */
#include "cuda_internal.h"
#include <cublas_v2.h>
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#define FM_STR2(x) #x
#define FM_STR(x) FM_STR2(x)
/* the soname of the cuBLAS these headers describe (its ABI) */
#define FM_CUBLAS_SONAME "libcublas.so." FM_STR(CUBLAS_VER_MAJOR)

typedef cublasStatus_t (*blas_create_fn)(cublasHandle_t *);
typedef cublasStatus_t (*blas_destroy_fn)(cublasHandle_t);
typedef cublasStatus_t (*blas_stream_fn)(cublasHandle_t, cudaStream_t);
typedef cublasStatus_t (*blas_ws_fn)(cublasHandle_t, void *, size_t);
typedef cublasStatus_t (*blas_prop_fn)(libraryPropertyType, int *);
typedef cublasStatus_t (*blas_gemm_fn)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                                       const void *, const void *, cudaDataType, int, const void *, cudaDataType, int,
                                       const void *, void *, cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);

typedef struct {
    int ok;
    char why[200]; /* the version loaded, or why none was */
    blas_create_fn create;
    blas_destroy_fn destroy;
    blas_stream_fn stream;
    blas_ws_fn workspace;
    blas_gemm_fn gemm;
} blas_lib;

static blas_lib blas_open(void) {
    blas_lib b;
    memset(&b, 0, sizeof b);
    void *h = dlopen(FM_CUBLAS_SONAME, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        snprintf(b.why, sizeof b.why, "cuBLAS not loaded (%s)", e ? e : FM_CUBLAS_SONAME " not found");
        return b;
    }
    b.create = (blas_create_fn)dlsym(h, "cublasCreate_v2");
    b.destroy = (blas_destroy_fn)dlsym(h, "cublasDestroy_v2");
    b.stream = (blas_stream_fn)dlsym(h, "cublasSetStream_v2");
    b.workspace = (blas_ws_fn)dlsym(h, "cublasSetWorkspace_v2");
    b.gemm = (blas_gemm_fn)dlsym(h, "cublasGemmEx");
    blas_prop_fn prop = (blas_prop_fn)dlsym(h, "cublasGetProperty");
    if (!b.create || !b.destroy || !b.stream || !b.workspace || !b.gemm || !prop) {
        snprintf(b.why, sizeof b.why, "cuBLAS not loaded (%s lacks a function fp4moe calls)", FM_CUBLAS_SONAME);
        dlclose(h);
        return b;
    }
    int v[3] = {0, 0, 0};
    prop(MAJOR_VERSION, &v[0]);
    prop(MINOR_VERSION, &v[1]);
    prop(PATCH_LEVEL, &v[2]);
    snprintf(b.why, sizeof b.why, "cuBLAS %d.%d.%d", v[0], v[1], v[2]);
    b.ok = 1; /* the library stays loaded for the process's life */
    return b;
}

/* loaded once per process (a thread-safe static) */
static const blas_lib &blas(void) {
    static const blas_lib b = blas_open();
    return b;
}

/* The workspace cuBLAS gets, so that its calls allocate nothing (CUDA-graph
 * capture needs that); 4 MiB covers its kernels for these shapes. */
#define FM_BLAS_WS ((size_t)4 << 20)

extern "C" void fm_cuda_blas_new(void **handle, void **ws, char *note, size_t cap) {
    *handle = NULL;
    *ws = NULL;
    const blas_lib &b = blas();
    if (!b.ok) {
        snprintf(note, cap, "%s", b.why);
        return;
    }
    cublasHandle_t h = NULL;
    cublasStatus_t st = b.create(&h);
    if (st != CUBLAS_STATUS_SUCCESS) {
        snprintf(note, cap, "cuBLAS handle not created (status %d)", (int)st);
        return;
    }
    cudaError_t err = cudaMalloc(ws, FM_BLAS_WS);
    if (err != cudaSuccess || b.workspace(h, *ws, FM_BLAS_WS) != CUBLAS_STATUS_SUCCESS) {
        snprintf(note, cap, "cuBLAS workspace not set (%s)",
                 err != cudaSuccess ? cudaGetErrorString(err) : "cublasSetWorkspace failed");
        if (err != cudaSuccess) cudaGetLastError();
        else cudaFree(*ws);
        *ws = NULL;
        b.destroy(h);
        return;
    }
    *handle = h;
    snprintf(note, cap, "%s", b.why);
}

extern "C" void fm_cuda_blas_free(void *handle, void *ws) {
    if (handle) blas().destroy((cublasHandle_t)handle);
    if (ws) cudaFree(ws);
}

extern "C" fm_status fm_cuda_blas_logits(void *handle, const fm_route_params *p, cudaStream_t s) {
    const blas_lib &b = blas();
    cublasHandle_t h = (cublasHandle_t)handle;
    const float one = 1.0f, zero = 0.0f;
    /* logits[t][e] = sum_h router[e][h] x[t][h]: column-major E x T, the
     * router as the transposed operand; BF16 products are exact in FP32 */
    cublasStatus_t st = b.stream(h, s);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = b.gemm(h, CUBLAS_OP_T, CUBLAS_OP_N, p->E, p->T, p->H, &one, p->router_wb, CUDA_R_16BF, p->H, p->x,
                    CUDA_R_16BF, p->H, &zero, p->logits, CUDA_R_32F, fm_cuda_route_logit_stride(p->E), CUBLAS_COMPUTE_32F,
                    CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS)
        return fm_error(FM_E_CUDA, "the router logits by cuBLAS failed (status %d; T %d, E %d, H %d)", (int)st, p->T,
                        p->E, p->H);
    return FM_OK;
}
