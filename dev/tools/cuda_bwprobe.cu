/*
 * cuda_bwprobe: is the engine's bandwidth probe the fastest way to stream a
 * large buffer out of the device's memory? Every "% of the bandwidth" and
 * "x floor" figure is against the probe's number, so a probe that reads
 * slower than the memory allows would flatter them. This tool times the
 * probe's kernels (src/cuda/stream_read.cuh, the same code the engine runs:
 * grid-stride, four 16-byte ld.global.nc per thread in flight, 8 blocks of
 * 512 threads per SM; and TMA bulk copies) beside other ways of reading the
 * same buffer, and prints each one's best rate.
 *
 *   gs4       the probe's grid-stride kernel
 *   gs8       the same with eight loads in flight per thread
 *   gs4_1w    the probe's loop with one wave of blocks (4 x 512 per SM)
 *   gs4_pf    the probe's loop with the L2::256B prefetch hint on each load
 *   chunk     each block reads one contiguous range, 8 loads in flight
 *   bulk      TMA bulk copies (cp.async.bulk, sm_90) of 32 KB into a ring
 *             of shared memory, one block per SM, 4 or 6 in flight
 *   frontsF   the buffer in F regions, each read grid-stride by 1/F of the
 *             blocks: how the rate falls with the number of read fronts
 *   warpS     every warp its own region, 1 KB per step, S steps in flight
 *             (the expert kernels' weight streams, without the compute)
 *
 * Every kernel folds what it reads into an XOR that is checked against the
 * host's XOR of the buffer, so a kernel that skipped bytes would fail.
 *
 *   cuda_bwprobe [--mib N] [--reps N]       (defaults 4096 MiB, 10)
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stream_read.cuh"

#define TOOL "cuda_bwprobe"
#include "cuda_check.cuh"

/* one contiguous range per block, 8 loads per thread in flight */
__global__ void chunk_kernel(const uint4 *p, size_t n, unsigned *acc_out) {
    uint32_t acc = 0;
    const size_t per = (n + gridDim.x - 1) / gridDim.x;
    const size_t b0 = (size_t)blockIdx.x * per, b1 = b0 + per < n ? b0 + per : n;
    size_t i = b0 + threadIdx.x;
    const size_t bs = blockDim.x;
    for (; i + 7 * bs < b1; i += 8 * bs) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) v[u] = fm_ld_nc(p + i + u * bs);
#pragma unroll
        for (int u = 0; u < 8; u++) acc ^= fm_xor4(v[u]);
    }
    for (; i < b1; i += bs) acc ^= fm_xor4(fm_ld_nc(p + i));
    atomicXor(acc_out, acc);
}

/* F fronts: the buffer in F equal regions, region f read grid-stride by the
 * blocks b with b % F == f (four loads in flight); F = 1 is gs4, F = the
 * grid is one contiguous range per block */
__global__ void fronts_kernel(const uint4 *p, size_t n, unsigned *acc_out, int F) {
    uint32_t acc = 0;
    const size_t per = n / F, nb = gridDim.x / F;
    const uint4 *q = p + (size_t)(blockIdx.x % F) * per;
    const size_t stride = nb * blockDim.x;
    size_t i = (size_t)(blockIdx.x / F) * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < per; i += 4 * stride) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) v[u] = fm_ld_nc(q + i + u * stride);
#pragma unroll
        for (int u = 0; u < 4; u++) acc ^= fm_xor4(v[u]);
    }
    for (; i < per; i += stride) acc ^= fm_xor4(fm_ld_nc(q + i));
    atomicXor(acc_out, acc);
}

/* every warp its own contiguous region, read 1 KB per step as the expert
 * kernels read a weight tile (two 512-byte loads), STEPS steps in flight */
template <int STEPS>
__global__ void warpown_kernel(const uint4 *p, size_t n, unsigned *acc_out) {
    uint32_t acc = 0;
    const size_t warps = (size_t)gridDim.x * (blockDim.x / 32);
    const size_t w = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const size_t per = n / warps; /* uint4 per warp, a multiple of 64 (1 KB) here */
    const uint4 *q = p + w * per;
    const int lane = threadIdx.x & 31;
    size_t i = 0;
    for (; i + 64 * STEPS <= per; i += 64 * STEPS) {
        uint4 v[2 * STEPS];
#pragma unroll
        for (int u = 0; u < STEPS; u++) {
            v[2 * u] = fm_ld_nc(q + i + 64 * u + lane);
            v[2 * u + 1] = fm_ld_nc(q + i + 64 * u + 32 + lane);
        }
#pragma unroll
        for (int u = 0; u < 2 * STEPS; u++) acc ^= fm_xor4(v[u]);
    }
    for (; i < per; i += 32) acc ^= fm_xor4(fm_ld_nc(q + i + lane));
    atomicXor(acc_out, acc);
}

/* The reads compared: kind, blocks per SM, threads per block, and the
 * fronts (F) of the fronts kernel. */
enum { GS4, GS8, GS4PF, CHUNK, BULK4, BULK6, FRONTS, WARP2, WARP4 };
struct variant {
    const char *name;
    int kind, per_sm, threads, F;
};
static const variant k_variants[] = {
    {"gs4", GS4, 8, 512, 0},           {"gs8", GS8, 8, 512, 0},          {"gs4_1w", GS4, 4, 512, 0},
    {"gs4_pf", GS4PF, 8, 512, 0},      {"chunk", CHUNK, 4, 512, 0},      {"chunk8", CHUNK, 8, 256, 0},
    {"bulk4", BULK4, 1, 256, 0},       {"bulk6", BULK6, 1, 256, 0},      {"fronts1", FRONTS, 8, 512, 1},
    {"fronts2", FRONTS, 8, 512, 2},    {"fronts4", FRONTS, 8, 512, 4},   {"fronts8", FRONTS, 8, 512, 8},
    {"fronts16", FRONTS, 8, 512, 16},  {"fronts32", FRONTS, 8, 512, 32}, {"fronts66", FRONTS, 8, 512, 66},
    {"fronts132", FRONTS, 8, 512, 132}, {"fronts264", FRONTS, 8, 512, 264}, {"fronts528", FRONTS, 8, 512, 528},
    {"fronts1056", FRONTS, 8, 512, 1056}, {"warp2", WARP2, 4, 128, 0},  {"warp4", WARP4, 4, 128, 0},
};

static void launch(const variant &v, int blocks, const uint8_t *buf, size_t bytes, unsigned *acc) {
    const uint4 *q = (const uint4 *)buf;
    const size_t n = bytes / 16;
    switch (v.kind) {
    case GS4: fm_gs_read_kernel<4, false><<<blocks, v.threads>>>(q, n, acc); break;
    case GS8: fm_gs_read_kernel<8, false><<<blocks, v.threads>>>(q, n, acc); break;
    case GS4PF: fm_gs_read_kernel<4, true><<<blocks, v.threads>>>(q, n, acc); break;
    case CHUNK: chunk_kernel<<<blocks, v.threads>>>(q, n, acc); break;
    case BULK4: fm_bulk_read_kernel<4><<<blocks, v.threads, 4 * FM_BULK_CH>>>(buf, bytes, acc); break;
    case BULK6: fm_bulk_read_kernel<6><<<blocks, v.threads, 6 * FM_BULK_CH>>>(buf, bytes, acc); break;
    case FRONTS: fronts_kernel<<<blocks, v.threads>>>(q, n, acc, v.F); break;
    case WARP2: warpown_kernel<2><<<blocks, v.threads>>>(q, n, acc); break;
    default: warpown_kernel<4><<<blocks, v.threads>>>(q, n, acc); break;
    }
}

int main(int argc, char **argv) {
    size_t mib = 4096;
    int reps = 10;
    for (int i = 1; i < argc; i++) {
        char *end = NULL;
        long v = i + 1 < argc ? strtol(argv[i + 1], &end, 10) : 0;
        const int okv = i + 1 < argc && end && *end == 0 && v > 0;
        if (!strcmp(argv[i], "--mib") && okv && v >= 64 && v <= (1 << 20)) mib = (size_t)v, i++;
        else if (!strcmp(argv[i], "--reps") && okv && v <= 1000) reps = (int)v, i++;
        else {
            fprintf(stderr, "cuda_bwprobe: bad argument '%s' (flags: --mib 64.., --reps 1..1000)\n", argv[i]);
            return 2;
        }
    }
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        fprintf(stderr, "cuda_bwprobe: no CUDA device\n");
        return 77;
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int sms = prop.multiProcessorCount;
    const size_t bytes = mib << 20;
    uint8_t *buf;
    unsigned *acc;
    CK(cudaMalloc(&buf, bytes));
    CK(cudaMalloc(&acc, sizeof(unsigned)));
    /* a pattern whose XOR the host knows: word i = hash(i) */
    uint32_t *h = (uint32_t *)malloc(64u << 20);
    if (!h) { fprintf(stderr, "cuda_bwprobe: out of host memory\n"); return 1; }
    uint32_t want = 0;
    for (size_t off = 0; off < bytes; off += 64u << 20) {
        const size_t words = (64u << 20) / 4;
        for (size_t w = 0; w < words; w++) {
            uint32_t x = (uint32_t)((off / 4 + w) * 2654435761u) ^ 0x5bd1e995u;
            h[w] = x;
            want ^= x;
        }
        CK(cudaMemcpy(buf + off, h, 64u << 20, cudaMemcpyHostToDevice));
    }
    free(h);
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    const int have_bulk = prop.major >= 9;
    if (have_bulk) {
        CK(cudaFuncSetAttribute(fm_bulk_read_kernel<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * FM_BULK_CH));
        CK(cudaFuncSetAttribute(fm_bulk_read_kernel<6>, cudaFuncAttributeMaxDynamicSharedMemorySize, 6 * FM_BULK_CH));
    }
    printf("cuda_bwprobe: %s, %d SMs, %zu MiB read %d times per kernel (best of the timed reads)\n", prop.name, sms, mib,
           reps);
    printf("%-10s %8s %8s %10s %8s %s\n", "kernel", "blocks", "threads", "GB/s", "vs gs4", "xor");
    double base = 0;
    for (const variant &v : k_variants) {
        const int blocks = sms * v.per_sm;
        if ((v.kind == BULK4 || v.kind == BULK6) && !have_bulk) continue;
        if (v.kind == FRONTS && blocks % v.F) continue;
        double best = 1e30;
        unsigned got = 0;
        for (int r = 0; r <= reps; r++) {
            CK(cudaMemset(acc, 0, sizeof(unsigned)));
            CK(cudaEventRecord(a));
            launch(v, blocks, buf, bytes, acc);
            CK(cudaGetLastError());
            CK(cudaEventRecord(b));
            CK(cudaEventSynchronize(b));
            float ms = 0;
            CK(cudaEventElapsedTime(&ms, a, b));
            CK(cudaMemcpy(&got, acc, sizeof got, cudaMemcpyDeviceToHost));
            if (r > 0 && ms < best) best = ms;
        }
        /* the fronts' and per-warp regions leave a tail unread where they do
         * not divide the buffer ("part": the rate stands, the XOR cannot);
         * every other read must give the buffer's XOR */
        const bool partial = v.kind == FRONTS || v.kind == WARP2 || v.kind == WARP4;
        if (got != want && !partial) {
            fprintf(stderr, "cuda_bwprobe: %s read the wrong bytes (xor %08x, expected %08x)\n", v.name, got, want);
            return 1;
        }
        const double gbs = (double)bytes / (best * 1e-3) / 1e9;
        if (base == 0) base = gbs;
        printf("%-10s %8d %8d %10.1f %8.3f %s\n", v.name, blocks, v.threads, gbs, gbs / base,
               got == want ? "ok" : "part");
    }
    cudaFree(buf);
    cudaFree(acc);
    return 0;
}
