/*
 * fm_comm over NCCL: one process driving N GPUs (ncclCommInitAll), or one
 * process per GPU across hosts with the unique id broadcast over MPI.
 *
 * NCCL is loaded at run time (dlopen) rather than linked: libnccl is a
 * 200+ MB library that a CPU-only user never needs, Python environments ship
 * their own copy (nvidia-nccl-cu13), and a missing library then becomes a
 * clear error instead of a binary that does not start. $FM_NCCL_LIB names
 * the file; else libnccl.so.2 / libnccl.so are found on the loader path.
 *
 * The collectives take host buffers (the sharding code is shared with the
 * simulation): each call copies to the rank's device, runs the NCCL
 * collective on the rank's stream inside one group, and copies back.
 *
 * NVLink SHARP (NVLS) is turned off unless NCCL_NVLS_ENABLE is already set:
 * decode-sized all-reduces gain little from it, and on shared multi-GPU hosts
 * a multicast object left behind by a crashed process can take the GPUs out
 * of service.
 */
#include "parallel/parallel_internal.h"
#include "util/util.h"
#include <stdio.h>
#include <string.h>

#if defined(FM_HAVE_CUDA) && defined(__has_include)
#if __has_include(<nccl.h>)
#define FM_NCCL_BUILD 1
#endif
#endif

#ifdef FM_NCCL_BUILD
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>
#include <stdlib.h>
#ifdef FM_HAVE_MPI
#include <mpi.h>
#endif

typedef struct {
    void *lib;
    ncclResult_t (*GetVersion)(int *);
    ncclResult_t (*GetUniqueId)(ncclUniqueId *);
    ncclResult_t (*CommInitAll)(ncclComm_t *, int, const int *);
    ncclResult_t (*CommInitRank)(ncclComm_t *, int, ncclUniqueId, int);
    ncclResult_t (*CommDestroy)(ncclComm_t);
    const char *(*GetErrorString)(ncclResult_t);
    ncclResult_t (*GroupStart)(void);
    ncclResult_t (*GroupEnd)(void);
    ncclResult_t (*AllReduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
    ncclResult_t (*ReduceScatter)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                                  cudaStream_t);
    ncclResult_t (*AllGather)(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
    ncclResult_t (*Send)(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*Recv)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
} nccl_api;

typedef struct {
    nccl_api api;
    int n;
    ncclComm_t *comm;
    cudaStream_t *stream;
    void **dsend, **drecv; /* device staging buffers per local rank */
    size_t *cap_send, *cap_recv;
} nccl_state;

#define CUDA_TRY(call)                                                                                               \
    do {                                                                                                             \
        cudaError_t e_ = (call);                                                                                     \
        if (e_ != cudaSuccess)                                                                                       \
            return fm_error(FM_E_CUDA, "%s failed (%s:%d): %s", #call, __FILE__, __LINE__, cudaGetErrorString(e_));  \
    } while (0)
#define NCCL_TRY(st, call)                                                                                           \
    do {                                                                                                             \
        ncclResult_t r_ = (call);                                                                                    \
        if (r_ != ncclSuccess)                                                                                       \
            return fm_error(FM_E_CUDA, "NCCL %s failed (%s:%d): %s", #call, __FILE__, __LINE__,                      \
                            (st)->api.GetErrorString ? (st)->api.GetErrorString(r_) : "?");                          \
    } while (0)

static fm_status load_nccl(nccl_api *a) {
    memset(a, 0, sizeof *a);
    const char *env = getenv("FM_NCCL_LIB");
    const char *names[] = {env, "libnccl.so.2", "libnccl.so"};
    char tried[512] = "";
    for (size_t i = 0; i < 3 && !a->lib; i++) {
        if (!names[i] || !names[i][0]) continue;
        a->lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (!a->lib) {
            size_t L = strlen(tried);
            snprintf(tried + L, sizeof tried - L, "%s%s", L ? ", " : "", names[i]);
        }
    }
    if (!a->lib)
        return fm_error(FM_E_UNSUPPORTED,
                        "NCCL not found (tried %s); set FM_NCCL_LIB to libnccl.so.2 (e.g. from the nvidia-nccl "
                        "Python package)",
                        tried);
#define SYM(field, name)                                                                                             \
    do {                                                                                                             \
        *(void **)&a->field = dlsym(a->lib, name);                                                                   \
        if (!a->field) {                                                                                             \
            dlclose(a->lib);                                                                                         \
            a->lib = NULL;                                                                                           \
            return fm_error(FM_E_UNSUPPORTED, "NCCL library lacks %s", name);                                        \
        }                                                                                                            \
    } while (0)
    SYM(GetVersion, "ncclGetVersion");
    SYM(GetUniqueId, "ncclGetUniqueId");
    SYM(CommInitAll, "ncclCommInitAll");
    SYM(CommInitRank, "ncclCommInitRank");
    SYM(CommDestroy, "ncclCommDestroy");
    SYM(GetErrorString, "ncclGetErrorString");
    SYM(GroupStart, "ncclGroupStart");
    SYM(GroupEnd, "ncclGroupEnd");
    SYM(AllReduce, "ncclAllReduce");
    SYM(ReduceScatter, "ncclReduceScatter");
    SYM(AllGather, "ncclAllGather");
    SYM(Send, "ncclSend");
    SYM(Recv, "ncclRecv");
#undef SYM
    return FM_OK;
}

static fm_status grow(void **p, size_t *cap, size_t need) {
    if (need <= *cap) return FM_OK;
    if (*p) cudaFree(*p);
    *p = NULL;
    *cap = 0;
    CUDA_TRY(cudaMalloc(p, need));
    *cap = need;
    return FM_OK;
}

static fm_status stage(fm_comm *c, size_t send_bytes, size_t recv_bytes) {
    nccl_state *st = c->impl;
    for (int i = 0; i < st->n; i++) {
        CUDA_TRY(cudaSetDevice(c->device[i]));
        fm_status s = grow(&st->dsend[i], &st->cap_send[i], send_bytes ? send_bytes : 1);
        if (!s) s = grow(&st->drecv[i], &st->cap_recv[i], recv_bytes ? recv_bytes : 1);
        if (s) return s;
    }
    return FM_OK;
}

static fm_status h2d(fm_comm *c, const void *const *src, size_t bytes) {
    nccl_state *st = c->impl;
    for (int i = 0; i < st->n; i++) {
        CUDA_TRY(cudaSetDevice(c->device[i]));
        if (bytes) CUDA_TRY(cudaMemcpyAsync(st->dsend[i], src[i], bytes, cudaMemcpyHostToDevice, st->stream[i]));
    }
    return FM_OK;
}

static fm_status d2h(fm_comm *c, void *const *dst, int from_recv, size_t bytes) {
    nccl_state *st = c->impl;
    for (int i = 0; i < st->n; i++) {
        CUDA_TRY(cudaSetDevice(c->device[i]));
        if (bytes)
            CUDA_TRY(cudaMemcpyAsync(dst[i], from_recv ? st->drecv[i] : st->dsend[i], bytes, cudaMemcpyDeviceToHost,
                                     st->stream[i]));
        CUDA_TRY(cudaStreamSynchronize(st->stream[i]));
    }
    return FM_OK;
}

static fm_status nccl_all_reduce(fm_comm *c, float *const *buf, size_t count) {
    nccl_state *st = c->impl;
    const size_t b = count * sizeof(float);
    fm_status s = stage(c, b, 0);
    if (!s) s = h2d(c, (const void *const *)buf, b);
    if (s) return s;
    NCCL_TRY(st, st->api.GroupStart());
    for (int i = 0; i < st->n; i++)
        NCCL_TRY(st, st->api.AllReduce(st->dsend[i], st->dsend[i], count, ncclFloat32, ncclSum, st->comm[i],
                                       st->stream[i]));
    NCCL_TRY(st, st->api.GroupEnd());
    return d2h(c, (void *const *)buf, 0, b);
}

static fm_status nccl_reduce_scatter(fm_comm *c, const float *const *send, float *const *recv, size_t count) {
    nccl_state *st = c->impl;
    const size_t b = count * sizeof(float);
    fm_status s = stage(c, b * (size_t)c->size, b);
    if (!s) s = h2d(c, (const void *const *)send, b * (size_t)c->size);
    if (s) return s;
    NCCL_TRY(st, st->api.GroupStart());
    for (int i = 0; i < st->n; i++)
        NCCL_TRY(st, st->api.ReduceScatter(st->dsend[i], st->drecv[i], count, ncclFloat32, ncclSum, st->comm[i],
                                           st->stream[i]));
    NCCL_TRY(st, st->api.GroupEnd());
    return d2h(c, (void *const *)recv, 1, b);
}

static fm_status nccl_all_gather(fm_comm *c, const void *const *send, void *const *recv, size_t bytes) {
    nccl_state *st = c->impl;
    fm_status s = stage(c, bytes, bytes * (size_t)c->size);
    if (!s) s = h2d(c, send, bytes);
    if (s) return s;
    NCCL_TRY(st, st->api.GroupStart());
    for (int i = 0; i < st->n; i++)
        NCCL_TRY(st, st->api.AllGather(st->dsend[i], st->drecv[i], bytes, ncclUint8, st->comm[i], st->stream[i]));
    NCCL_TRY(st, st->api.GroupEnd());
    return d2h(c, recv, 1, bytes * (size_t)c->size);
}

static fm_status nccl_all_to_allv(fm_comm *c, const void *const *send, const size_t *const *send_bytes,
                                  void *const *recv, const size_t *const *recv_bytes) {
    nccl_state *st = c->impl;
    const int R = c->size;
    size_t smax = 0, rmax = 0;
    for (int i = 0; i < st->n; i++) {
        size_t a = 0, b = 0;
        for (int p = 0; p < R; p++) {
            a += send_bytes[i][p];
            b += recv_bytes[i][p];
        }
        if (a > smax) smax = a;
        if (b > rmax) rmax = b;
    }
    fm_status s = stage(c, smax, rmax);
    if (s) return s;
    for (int i = 0; i < st->n; i++) {
        size_t a = 0;
        for (int p = 0; p < R; p++) a += send_bytes[i][p];
        CUDA_TRY(cudaSetDevice(c->device[i]));
        if (a) CUDA_TRY(cudaMemcpyAsync(st->dsend[i], send[i], a, cudaMemcpyHostToDevice, st->stream[i]));
    }
    /* Point-to-point pairs inside one group form the all-to-all (NCCL's
     * documented recipe); zero-byte pairs are skipped on both sides. */
    NCCL_TRY(st, st->api.GroupStart());
    for (int i = 0; i < st->n; i++) {
        size_t so = 0, ro = 0;
        for (int p = 0; p < R; p++) {
            if (send_bytes[i][p])
                NCCL_TRY(st, st->api.Send((const uint8_t *)st->dsend[i] + so, send_bytes[i][p], ncclUint8, p,
                                          st->comm[i], st->stream[i]));
            if (recv_bytes[i][p])
                NCCL_TRY(st, st->api.Recv((uint8_t *)st->drecv[i] + ro, recv_bytes[i][p], ncclUint8, p, st->comm[i],
                                          st->stream[i]));
            so += send_bytes[i][p];
            ro += recv_bytes[i][p];
        }
    }
    NCCL_TRY(st, st->api.GroupEnd());
    for (int i = 0; i < st->n; i++) {
        size_t b = 0;
        for (int p = 0; p < R; p++) b += recv_bytes[i][p];
        CUDA_TRY(cudaSetDevice(c->device[i]));
        if (b) CUDA_TRY(cudaMemcpyAsync(recv[i], st->drecv[i], b, cudaMemcpyDeviceToHost, st->stream[i]));
        CUDA_TRY(cudaStreamSynchronize(st->stream[i]));
    }
    return FM_OK;
}

static fm_status nccl_time_all_reduce(fm_comm *c, size_t count, int reps, double *us) {
    nccl_state *st = c->impl;
    fm_status s = stage(c, count * sizeof(float), 0);
    if (s) return s;
    for (int i = 0; i < st->n; i++) {
        CUDA_TRY(cudaSetDevice(c->device[i]));
        CUDA_TRY(cudaMemsetAsync(st->dsend[i], 0, count * sizeof(float), st->stream[i]));
    }
    double *t = fm_calloc((size_t)reps + 1, sizeof(double));
    if (!t) return FM_E_NOMEM;
    for (int it = -1; it < reps; it++) { /* it = -1: warm-up (connections) */
        uint64_t t0 = fm_now_ns();
        ncclResult_t r = st->api.GroupStart();
        for (int i = 0; i < st->n && r == ncclSuccess; i++)
            r = st->api.AllReduce(st->dsend[i], st->dsend[i], count, ncclFloat32, ncclSum, st->comm[i], st->stream[i]);
        if (r == ncclSuccess) r = st->api.GroupEnd();
        if (r != ncclSuccess) {
            free(t);
            return fm_error(FM_E_CUDA, "NCCL all-reduce of %zu floats: %s", count, st->api.GetErrorString(r));
        }
        for (int i = 0; i < st->n; i++) {
            cudaError_t e = cudaStreamSynchronize(st->stream[i]);
            if (e != cudaSuccess) {
                free(t);
                return fm_error(FM_E_CUDA, "cudaStreamSynchronize: %s", cudaGetErrorString(e));
            }
        }
        if (it >= 0) t[it] = (double)(fm_now_ns() - t0) / 1e3;
    }
    *us = fm_dist_median(t, reps);
    free(t);
    return FM_OK;
}

static void nccl_destroy(fm_comm *c) {
    nccl_state *st = c->impl;
    if (!st) return;
    for (int i = 0; i < st->n; i++) {
        if (c->device[i] >= 0) cudaSetDevice(c->device[i]);
        if (st->dsend && st->dsend[i]) cudaFree(st->dsend[i]);
        if (st->drecv && st->drecv[i]) cudaFree(st->drecv[i]);
        if (st->stream && st->stream[i]) cudaStreamDestroy(st->stream[i]);
        if (st->comm && st->comm[i] && st->api.CommDestroy) st->api.CommDestroy(st->comm[i]);
    }
    free(st->comm);
    free(st->stream);
    free(st->dsend);
    free(st->drecv);
    free(st->cap_send);
    free(st->cap_recv);
    /* the library stays loaded: NCCL keeps background threads and
     * atexit handlers that must not outlive their code */
    free(st);
    c->impl = NULL;
}

static const fm_comm_ops nccl_ops = {
    .name = "nccl",
    .all_reduce_sum = nccl_all_reduce,
    .reduce_scatter_sum = nccl_reduce_scatter,
    .all_gather = nccl_all_gather,
    .all_to_allv = nccl_all_to_allv,
    .destroy = nccl_destroy,
    .time_all_reduce = nccl_time_all_reduce,
};

static fm_status state_new(int n, nccl_state **out) {
    nccl_state *st = fm_calloc(1, sizeof *st);
    if (!st) return FM_E_NOMEM;
    st->n = n;
    st->comm = fm_calloc((size_t)n, sizeof *st->comm);
    st->stream = fm_calloc((size_t)n, sizeof *st->stream);
    st->dsend = fm_calloc((size_t)n, sizeof *st->dsend);
    st->drecv = fm_calloc((size_t)n, sizeof *st->drecv);
    st->cap_send = fm_calloc((size_t)n, sizeof *st->cap_send);
    st->cap_recv = fm_calloc((size_t)n, sizeof *st->cap_recv);
    *out = st;
    if (!st->comm || !st->stream || !st->dsend || !st->drecv || !st->cap_send || !st->cap_recv) return FM_E_NOMEM;
    return FM_OK;
}

static fm_status make_streams(fm_comm *c) {
    nccl_state *st = c->impl;
    for (int i = 0; i < st->n; i++) {
        CUDA_TRY(cudaSetDevice(c->device[i]));
        CUDA_TRY(cudaStreamCreateWithFlags(&st->stream[i], cudaStreamNonBlocking));
    }
    return FM_OK;
}

static fm_status init_all(fm_comm *c, const int *devs) {
    nccl_state *st = c->impl;
    NCCL_TRY(st, st->api.CommInitAll(st->comm, st->n, devs));
    return FM_OK;
}

fm_status fm_comm_nccl_new(int n_gpus, fm_comm **out) {
    *out = NULL;
    if (n_gpus < 1 || n_gpus > FM_DIST_MAX_RANKS)
        return fm_error(FM_E_RANGE, "--gpus %d (allowed 1..%d)", n_gpus, FM_DIST_MAX_RANKS);
    int ndev = 0;
    cudaError_t ce = cudaGetDeviceCount(&ndev);
    if (ce != cudaSuccess) return fm_error(FM_E_CUDA, "no CUDA GPU: %s", cudaGetErrorString(ce));
    if (ndev < n_gpus) return fm_error(FM_E_RANGE, "--gpus %d but only %d GPU%s visible", n_gpus, ndev, ndev == 1 ? "" : "s");
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    fm_comm *c;
    fm_status s = fm_comm_alloc(&nccl_ops, n_gpus, 0, n_gpus, &c);
    if (s) return s;
    nccl_state *st = NULL;
    s = state_new(n_gpus, &st);
    c->impl = st;
    if (!s) s = load_nccl(&st->api);
    int *devs = fm_calloc((size_t)n_gpus, sizeof(int));
    if (!s && !devs) s = FM_E_NOMEM;
    if (!s) {
        for (int i = 0; i < n_gpus; i++) c->device[i] = devs[i] = i;
        s = init_all(c, devs);
    }
    free(devs);
    if (!s) s = make_streams(c);
    if (s) {
        fm_comm_free(c);
        return s;
    }
    int v = 0;
    st->api.GetVersion(&v);
    snprintf(c->desc, sizeof c->desc, "NCCL %d.%d.%d, %d GPU%s driven by one process", v / 10000, v / 100 % 100,
             v % 100, n_gpus, n_gpus == 1 ? "" : "s");
    *out = c;
    return FM_OK;
}

#ifdef FM_HAVE_MPI
static fm_status mpi_init_rank(fm_comm *c, int rank, int size) {
    nccl_state *st = c->impl;
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (rank == 0) NCCL_TRY(st, st->api.GetUniqueId(&id));
    if (MPI_Bcast(&id, (int)sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD) != MPI_SUCCESS)
        return fm_error(FM_E_IO, "MPI_Bcast of the NCCL unique id failed");
    NCCL_TRY(st, st->api.CommInitRank(&st->comm[0], size, id, rank));
    return FM_OK;
}

fm_status fm_comm_nccl_new_mpi(fm_comm **out) {
    *out = NULL;
    int inited = 0, rank = 0, size = 0, local = 0, ndev = 0;
    MPI_Initialized(&inited);
    if (!inited && MPI_Init(NULL, NULL) != MPI_SUCCESS) return fm_error(FM_E_IO, "MPI_Init failed");
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    /* GPU = rank among the processes of this host */
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &local);
    MPI_Comm_free(&node);
    cudaError_t ce = cudaGetDeviceCount(&ndev);
    if (ce != cudaSuccess || ndev < 1)
        return fm_error(FM_E_CUDA, "rank %d: no CUDA GPU: %s", rank, cudaGetErrorString(ce));
    if (local >= ndev)
        return fm_error(FM_E_RANGE, "rank %d is process %d on its host, which has only %d GPU%s", rank, local, ndev,
                        ndev == 1 ? "" : "s");
    CUDA_TRY(cudaSetDevice(local));
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    fm_comm *c;
    fm_status s = fm_comm_alloc(&nccl_ops, size, rank, 1, &c);
    if (s) return s;
    nccl_state *st = NULL;
    s = state_new(1, &st);
    c->impl = st;
    c->device[0] = local;
    if (!s) s = load_nccl(&st->api);
    if (!s) s = mpi_init_rank(c, rank, size);
    if (!s) s = make_streams(c);
    if (s) {
        fm_comm_free(c);
        return s;
    }
    int v = 0;
    st->api.GetVersion(&v);
    snprintf(c->desc, sizeof c->desc, "NCCL %d.%d.%d over MPI, rank %d of %d on GPU %d", v / 10000, v / 100 % 100,
             v % 100, rank, size, local);
    *out = c;
    return FM_OK;
}
#else
fm_status fm_comm_nccl_new_mpi(fm_comm **out) {
    *out = NULL;
    return fm_error(FM_E_UNSUPPORTED, "fp4moe was built without MPI (configure with -DFM_MPI=ON; needs OpenMPI)");
}
#endif

#else /* no CUDA or no nccl.h at build time */

fm_status fm_comm_nccl_new(int n_gpus, fm_comm **out) {
    (void)n_gpus;
    *out = NULL;
#ifdef FM_HAVE_CUDA
    return fm_error(FM_E_UNSUPPORTED, "fp4moe was built without nccl.h (NCCL headers not found)");
#else
    return fm_error(FM_E_UNSUPPORTED, "NCCL needs a CUDA build of fp4moe (nvcc not found at configure time)");
#endif
}
fm_status fm_comm_nccl_new_mpi(fm_comm **out) {
    *out = NULL;
    return fm_error(FM_E_UNSUPPORTED, "NCCL over MPI needs a CUDA build of fp4moe configured with -DFM_MPI=ON");
}
#endif
