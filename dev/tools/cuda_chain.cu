/*
 * cuda_chain: how short a one-token MoE layer of a TP8 rank can be when its
 * reads form the chain that routing imposes, with no arithmetic at all. A
 * rank's B = 1 layer reads a few MB of router, then its top-k experts' gate/up
 * (whose addresses the router decides), then their down (which needs all of
 * h). This tool reads exactly those bytes, per layer, in the orders a design
 * can choose, each step's addresses computed from the XOR of everything the
 * step before read (so nothing can be read early that a real layer could not
 * read early), and prints µs per layer against the floor (the experts' bytes
 * over the bandwidth measured in the same run, as fp4moe's benchmark counts
 * it):
 *
 *   read     one launch reads the layer's bytes with no dependency (the
 *            floor as a short read realises it)
 *   launch3  three launches per layer (router | routed gate/up | routed
 *            down, the shared expert with the routed), programmatic
 *            dependent launch between them, the router's bytes read before
 *            the wait on the previous layer
 *   chain    one launch per layer, grid barriers between the steps, the
 *            shared expert with the routed steps
 *   early    chain with the shared expert's bytes read in the router's step
 *   early+pdl early, and the router's and the shared expert's bytes read
 *            before the wait on the previous layer (only the token's row
 *            after it): the shortest chain a one-launch design has
 *   launch3+flag launch3 with the waits inside the layer (gate/up's on
 *            the router step, down's on gate/up; griddepcontrol.wait: that
 *            grid complete and its memory flushed) replaced by a spin on a
 *            counter that each block of the step before adds to with release
 *            order once its writes are done: what those launch boundaries
 *            cost beyond the data they wait for (the wait on the previous
 *            layer stays griddepcontrol.wait: in a model the kernel before
 *            a MoE layer is not this library's, and signals nothing)
 *
 * Layers run back to back in one CUDA graph, each on its own buffers (no L2
 * reuse between layers); the median of the graph's replays is kept.
 *
 * One block of 512 threads per SM, 8 loads of 16 bytes in flight per thread
 * (64 KB per SM); --blocks-per-sm 2 doubles the bytes in flight, to see
 * whether the reads' parallelism, not the chain, sets a time.
 *
 * --batch B reads the experts B tokens route to: E (1 - (1 - k / E)^B) of
 * them, the expected count of distinct experts under uniform routing (the
 * benchmark's random routers come close to it), in place of the k of one
 * token; the floor counts them likewise.
 *
 *   cuda_chain [--preset glm-5|deepseek-v4-flash|kimi-k2|all] [--batch 1..512] [--layers 1..64]
 *              [--reps 1..1000] [--blocks-per-sm 1..2]
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <vector>

#define TOOL "cuda_chain"
#include "cuda_check.cuh"
#include "device_util.cuh"
#include "stream_read.cuh"

#define CH_THREADS 512
#define CH_U 8
/* routed regions hold this many alternatives, so that a step's addresses
 * depend on what the step before read */
#define CH_ALT 4

struct ch_layer {
    const uint4 *router, *sgu, *sdn, *rgu, *rdn; /* rgu, rdn: CH_ALT alternatives each */
    size_t n_router, n_sgu, n_sdn, n_rgu, n_rdn; /* 16-byte words */
    unsigned *cnt;                               /* 2 barrier counters, zero at the graph's start */
    unsigned *part;                              /* 2 x gridDim.x partial XORs */
    unsigned *out;
    unsigned *fin;                               /* 2 counters of blocks done: router, gate/up step */
};

/* launch3+flag's wait: every block of the step before has added to *q (it
 * runs with the same grid) */
static __device__ __forceinline__ void ch_wait_fin(const unsigned *q) {
    if (threadIdx.x == 0)
        for (;;) {
            unsigned v;
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(q) : "memory");
            if (v >= gridDim.x) break;
            __nanosleep(20);
        }
    __syncthreads();
}
/* the block's writes done (the caller's barrier before): its count in, with
 * release order */
static __device__ __forceinline__ void ch_signal_fin(unsigned *q) {
    if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(q) : "memory");
}

/* the block's share [b * n / G, (b + 1) * n / G) of n words, CH_U loads per
 * thread in flight */
static __device__ __forceinline__ uint32_t ch_read(const uint4 *p, size_t n) {
    const size_t G = gridDim.x, b = blockIdx.x, lo = b * n / G, hi = (b + 1) * n / G;
    uint32_t acc = 0;
    size_t i = lo + threadIdx.x;
    for (; i + (CH_U - 1) * CH_THREADS < hi; i += CH_U * CH_THREADS) {
        uint4 v[CH_U];
#pragma unroll
        for (int u = 0; u < CH_U; u++) v[u] = fm_ld_nc(p + i + u * CH_THREADS);
#pragma unroll
        for (int u = 0; u < CH_U; u++) acc ^= fm_xor4(v[u]);
    }
    for (; i < hi; i += CH_THREADS) acc ^= fm_xor4(fm_ld_nc(p + i));
    return acc;
}
/* every block's XOR in, every block gets all of them back: the grid
 * barrier a step that needs the whole previous step (top-k, h) waits on */
static __device__ __forceinline__ uint32_t ch_barrier(uint32_t acc, unsigned *cnt, unsigned *part) {
    __shared__ unsigned s_acc;
    if (threadIdx.x == 0) s_acc = 0;
    __syncthreads();
    atomicXor(&s_acc, acc);
    __syncthreads();
    if (threadIdx.x == 0) {
        __stcg(part + blockIdx.x, s_acc);
        __threadfence();
        atomicAdd(cnt, 1u);
        while (*(volatile unsigned *)cnt < gridDim.x) __nanosleep(20);
        __threadfence();
        s_acc = 0;
    }
    __syncthreads();
    for (unsigned i = threadIdx.x; i < gridDim.x; i += CH_THREADS) atomicXor(&s_acc, __ldcg(part + i));
    __syncthreads();
    return s_acc;
}

enum { M_READ, M_LAUNCH3, M_CHAIN, M_EARLY, M_EARLY_PDL, M_LAUNCH3_FLAG, M_COUNT };
static const char *const mode_name[M_COUNT] = {"read", "launch3", "chain", "early", "early+pdl", "launch3+flag"};

template <int MODE>
__global__ void __launch_bounds__(CH_THREADS, 2) ch_layer_kernel(ch_layer L) {
    uint32_t acc = 0;
    if (MODE == M_EARLY_PDL) {
        /* weights that do not depend on the previous layer: read before the wait */
        acc = ch_read(L.router, L.n_router) ^ ch_read(L.sgu, L.n_sgu) ^ ch_read(L.sdn, L.n_sdn);
        pdl_launch_dependents();
        pdl_wait();
    } else {
        pdl_wait();
        acc = ch_read(L.router, L.n_router);
        if (MODE == M_EARLY) acc ^= ch_read(L.sgu, L.n_sgu) ^ ch_read(L.sdn, L.n_sdn);
    }
    if (MODE == M_READ) {
        acc ^= ch_read(L.sgu, L.n_sgu) ^ ch_read(L.sdn, L.n_sdn) ^ ch_read(L.rgu, L.n_rgu) ^ ch_read(L.rdn, L.n_rdn);
        if (threadIdx.x == 0) atomicXor(L.out, acc);
        return;
    }
    /* the top-k: needs every block's router share */
    const uint32_t v1 = ch_barrier(acc, L.cnt, L.part);
    acc = ch_read(L.rgu + (v1 % CH_ALT) * L.n_rgu, L.n_rgu);
    if (MODE == M_CHAIN) acc ^= ch_read(L.sgu, L.n_sgu);
    /* down: needs all of h */
    const uint32_t v2 = ch_barrier(acc, L.cnt + 1, L.part + gridDim.x);
    acc = ch_read(L.rdn + (v2 % CH_ALT) * L.n_rdn, L.n_rdn);
    if (MODE == M_CHAIN) acc ^= ch_read(L.sdn, L.n_sdn);
    if (MODE != M_EARLY_PDL) pdl_launch_dependents();
    if (threadIdx.x == 0) atomicXor(L.out, acc);
}

/* launch3's three launches: STEP 0 the router (read before the wait), 1 the
 * routed and shared gate/up, 2 the routed and shared down; each step's
 * addresses from the previous step's XORs. FLAG: the waits on counters. */
template <int STEP, bool FLAG>
__global__ void __launch_bounds__(CH_THREADS, 2) ch_step_kernel(ch_layer L) {
    __shared__ unsigned s_acc;
    if (threadIdx.x == 0) s_acc = 0;
    uint32_t acc = 0;
    if (STEP == 0) acc = ch_read(L.router, L.n_router);
    pdl_launch_dependents();
    if (!FLAG || STEP == 0) pdl_wait();
    else ch_wait_fin(L.fin + STEP - 1);
    __syncthreads();
    if (STEP > 0) {
        const unsigned *prev = L.part + (STEP > 0 ? STEP - 1 : 0) * gridDim.x;
        for (unsigned i = threadIdx.x; i < gridDim.x; i += CH_THREADS) atomicXor(&s_acc, __ldcg(prev + i));
        __syncthreads();
        const uint32_t v = s_acc;
        acc = STEP == 1 ? ch_read(L.rgu + (v % CH_ALT) * L.n_rgu, L.n_rgu) ^ ch_read(L.sgu, L.n_sgu)
                        : ch_read(L.rdn + (v % CH_ALT) * L.n_rdn, L.n_rdn) ^ ch_read(L.sdn, L.n_sdn);
        __syncthreads();
        if (threadIdx.x == 0) s_acc = 0;
        __syncthreads();
    }
    atomicXor(&s_acc, acc);
    __syncthreads();
    if (threadIdx.x == 0) {
        if (STEP < 2) __stcg(L.part + STEP * gridDim.x + blockIdx.x, s_acc);
        else atomicXor(L.out, s_acc);
    }
    if (FLAG && STEP < 2) {
        __syncthreads();
        ch_signal_fin(L.fin + STEP);
    }
}

struct shape {
    const char *name;
    int E, H, k, I; /* a TP8 rank: I is the rank's slice */
};
static const shape shapes[] = {
    {"glm-5", 256, 6144, 8, 256},
    {"deepseek-v4-flash", 256, 4096, 6, 256},
    {"kimi-k2", 384, 7168, 8, 256},
};

static void usage_error(const char *arg) {
    fprintf(stderr,
            "%s: bad argument '%s' (usage: %s [--preset glm-5|deepseek-v4-flash|kimi-k2|all] [--batch 1..512] "
            "[--layers 1..64] [--reps 1..1000] [--blocks-per-sm 1..2])\n",
            TOOL, arg, TOOL);
    exit(2);
}

/* NVFP4 bytes of a rows x cols matrix: half a byte per weight, one FP8 scale per 16 */
static size_t fp4_bytes(size_t rows, size_t cols) { return rows * cols / 2 + rows * cols / 16; }
static size_t words(size_t bytes) { return (bytes + 15) / 16; }

static void launch(cudaStream_t st, void (*f)(ch_layer), int grid, const ch_layer &L, bool pdl) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(CH_THREADS);
    cfg.stream = st;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, f, L));
}

int main(int argc, char **argv) {
    int layers = 8, reps = 20, only = -1, bps = 1, batch = 1;
    for (int i = 1; i < argc; i++) {
        if (tool_int_opt(argc, argv, &i, "--batch", 1, 512, &batch, usage_error) ||
            tool_int_opt(argc, argv, &i, "--layers", 1, 64, &layers, usage_error) ||
            tool_int_opt(argc, argv, &i, "--reps", 1, 1000, &reps, usage_error) ||
            tool_int_opt(argc, argv, &i, "--blocks-per-sm", 1, 2, &bps, usage_error))
            continue;
        if (!strcmp(argv[i], "--preset")) {
            if (i + 1 >= argc) usage_error("--preset");
            only = -2;
            if (!strcmp(argv[i + 1], "all")) only = -1;
            for (int s = 0; s < 3; s++)
                if (!strcmp(argv[i + 1], shapes[s].name)) only = s;
            if (only == -2) usage_error("--preset");
            i++;
        } else {
            usage_error(argv[i]);
        }
    }
    int sms = 0;
    cudaDeviceProp prop;
    tool_device(&sms, &prop);
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));

    /* the bandwidth, as the engine's probe measures it (its kernel, 2 GiB, best of 5) */
    double bw = 0.0;
    {
        const size_t n = ((size_t)2 << 30) / 16;
        uint4 *buf = NULL;
        unsigned *acc = NULL;
        CK(cudaMalloc(&buf, n * 16));
        CK(cudaMalloc(&acc, sizeof(unsigned)));
        CK(cudaMemset(buf, 0x5a, n * 16));
        for (int r = 0; r < 6; r++) {
            CK(cudaEventRecord(e0, st));
            fm_gs_read_kernel<4, false><<<8 * sms, 512, 0, st>>>(buf, n, acc);
            CK(cudaEventRecord(e1, st));
            CK(cudaEventSynchronize(e1));
            float ms = 0;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            if (r > 0) bw = std::max(bw, n * 16.0 / (ms * 1e-3));
        }
        CK(cudaFree(buf));
        CK(cudaFree(acc));
    }
    printf("%s: %s, %d SMs, bandwidth %.2f TB/s; B = %d of a TP8 rank (I 256), %d layers in one CUDA graph, median of "
           "%d replays, %d block(s) per SM; µs per layer (x floor)\n",
           TOOL, prop.name, sms, bw / 1e12, batch, layers, reps, bps);
    printf("%-18s %7s %7s %7s %7s", "shape", "experts", "MB", "router", "floor");
    for (int m = 0; m < M_COUNT; m++) printf(" %15s", mode_name[m]);
    printf("\n");

    const int grid = bps * sms;
    for (int s = 0; s < 3; s++) {
        if (only >= 0 && only != s) continue;
        const shape &S = shapes[s];
        const size_t b_router = (size_t)S.E * S.H * 2, b_sgu = 2 * fp4_bytes(S.I, S.H), b_sdn = fp4_bytes(S.H, S.I);
        /* the routed experts B tokens touch, expected under uniform routing */
        const int n_exp = std::max(S.k, (int)std::lround(S.E * (1.0 - std::pow(1.0 - (double)S.k / S.E, batch))));
        const size_t b_rgu = n_exp * b_sgu, b_rdn = n_exp * b_sdn, b_exp = b_sgu + b_sdn + b_rgu + b_rdn;
        const size_t per_layer = words(b_router) + words(b_sgu) + words(b_sdn) + CH_ALT * (words(b_rgu) + words(b_rdn));
        uint4 *mem = NULL;
        unsigned *ctl = NULL;
        const size_t per_ctl = 5 + 2 * (size_t)grid;
        const size_t nctl = (size_t)layers * per_ctl;
        CK(cudaMalloc(&mem, per_layer * layers * 16));
        CK(cudaMemset(mem, 0x5a, per_layer * layers * 16));
        CK(cudaMalloc(&ctl, nctl * sizeof(unsigned)));
        std::vector<ch_layer> L(layers);
        for (int l = 0; l < layers; l++) {
            uint4 *p = mem + (size_t)l * per_layer;
            ch_layer &c = L[l];
            c.router = p, c.n_router = words(b_router), p += c.n_router;
            c.sgu = p, c.n_sgu = words(b_sgu), p += c.n_sgu;
            c.sdn = p, c.n_sdn = words(b_sdn), p += c.n_sdn;
            c.rgu = p, c.n_rgu = words(b_rgu), p += CH_ALT * c.n_rgu;
            c.rdn = p, c.n_rdn = words(b_rdn);
            unsigned *q = ctl + (size_t)l * per_ctl;
            c.cnt = q, c.out = q + 2, c.fin = q + 3, c.part = q + 5;
        }
        const double floor_us = b_exp / bw * 1e6;
        printf("%-18s %7d %7.1f %7.1f %7.2f", S.name, n_exp, b_exp / 1e6, b_router / 1e6, floor_us);
        for (int m = 0; m < M_COUNT; m++) {
            cudaGraph_t g;
            cudaGraphExec_t ge;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
            CK(cudaMemsetAsync(ctl, 0, nctl * sizeof(unsigned), st));
            for (int l = 0; l < layers; l++) {
                /* the first launch after the memset must see it: no PDL there */
                const bool pdl = l > 0;
                switch (m) {
                case M_READ: launch(st, ch_layer_kernel<M_READ>, grid, L[l], pdl); break;
                case M_CHAIN: launch(st, ch_layer_kernel<M_CHAIN>, grid, L[l], pdl); break;
                case M_EARLY: launch(st, ch_layer_kernel<M_EARLY>, grid, L[l], pdl); break;
                case M_EARLY_PDL: launch(st, ch_layer_kernel<M_EARLY_PDL>, grid, L[l], pdl); break;
                case M_LAUNCH3:
                    launch(st, ch_step_kernel<0, false>, grid, L[l], pdl);
                    launch(st, ch_step_kernel<1, false>, grid, L[l], true);
                    launch(st, ch_step_kernel<2, false>, grid, L[l], true);
                    break;
                case M_LAUNCH3_FLAG:
                    launch(st, ch_step_kernel<0, true>, grid, L[l], pdl);
                    launch(st, ch_step_kernel<1, true>, grid, L[l], true);
                    launch(st, ch_step_kernel<2, true>, grid, L[l], true);
                    break;
                }
            }
            CK(cudaStreamEndCapture(st, &g));
            CK(cudaGraphInstantiate(&ge, g, 0));
            for (int w = 0; w < 3; w++) CK(cudaGraphLaunch(ge, st));
            std::vector<float> t;
            for (int r = 0; r < reps; r++) {
                CK(cudaEventRecord(e0, st));
                CK(cudaGraphLaunch(ge, st));
                CK(cudaEventRecord(e1, st));
                CK(cudaEventSynchronize(e1));
                float ms = 0;
                CK(cudaEventElapsedTime(&ms, e0, e1));
                t.push_back(ms);
            }
            std::sort(t.begin(), t.end());
            const double us = t[t.size() / 2] * 1e3 / layers;
            printf(" %7.2f (%5.2f)", us, us / floor_us);
            CK(cudaGraphExecDestroy(ge));
            CK(cudaGraphDestroy(g));
        }
        printf("\n");
        CK(cudaFree(mem));
        CK(cudaFree(ctl));
    }
    CK(cudaStreamDestroy(st));
    return 0;
}
