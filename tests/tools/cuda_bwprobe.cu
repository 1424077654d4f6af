/*
 * cuda_bwprobe: is the engine's bandwidth probe the fastest way to stream a
 * large buffer out of the device's memory? Every "% of the bandwidth" and
 * "x floor" figure is against the probe's number, so a probe that reads
 * slower than the memory allows would flatter them. This tool times the
 * probe's kernel (fm_stream_read_kernel: grid-stride, four 16-byte
 * ld.global.nc per thread in flight, 8 blocks of 512 threads per SM) beside
 * other ways of reading the same buffer, and prints each one's best rate.
 *
 *   gs4       the probe's kernel (a copy: this tool links no library)
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

#define CK(x)                                                                                          \
    do {                                                                                               \
        cudaError_t e_ = (x);                                                                          \
        if (e_ != cudaSuccess) {                                                                       \
            fprintf(stderr, "cuda_bwprobe: %s: %s (line %d)\n", #x, cudaGetErrorString(e_), __LINE__); \
            exit(1);                                                                                   \
        }                                                                                              \
    } while (0)

/* the engine's ld_stream: ld.global.nc, no L1 allocation */
static __device__ __forceinline__ uint4 ld_nc(const uint4 *p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}
static __device__ __forceinline__ uint4 ld_nc_pf(const uint4 *p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}
static __device__ __forceinline__ uint32_t x4(uint4 a) { return a.x ^ a.y ^ a.z ^ a.w; }

/* grid-stride, U loads per thread in flight */
template <int U, bool PF>
__global__ void gs_kernel(const uint4 *p, size_t n, unsigned *acc_out) {
    uint32_t acc = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + (U - 1) * stride < n; i += U * stride) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) v[u] = PF ? ld_nc_pf(p + i + u * stride) : ld_nc(p + i + u * stride);
#pragma unroll
        for (int u = 0; u < U; u++) acc ^= x4(v[u]);
    }
    for (; i < n; i += stride) acc ^= x4(ld_nc(p + i));
    atomicXor(acc_out, acc);
}

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
        for (int u = 0; u < 8; u++) v[u] = ld_nc(p + i + u * bs);
#pragma unroll
        for (int u = 0; u < 8; u++) acc ^= x4(v[u]);
    }
    for (; i < b1; i += bs) acc ^= x4(ld_nc(p + i));
    atomicXor(acc_out, acc);
}

/* TMA bulk copies of CH bytes into a ring of NS stages; thread 0 issues,
 * every thread XORs each landed stage (so the bytes are used) */
#define CH (32 * 1024)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
static __device__ __forceinline__ void bulk_issue(uint32_t s_dst, const uint8_t *src, uint32_t s_bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(s_bar), "r"(CH) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(s_dst),
                 "l"(src), "r"(CH), "r"(s_bar)
                 : "memory");
}
#endif
template <int NS>
__global__ void __launch_bounds__(256) bulk_kernel(const uint8_t *p, size_t bytes, unsigned *acc_out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) uint8_t ring[];
    __shared__ __align__(8) uint64_t bar[NS];
    const size_t nch = bytes / CH;
    const uint32_t s_ring = (uint32_t)__cvta_generic_to_shared(ring);
    const uint32_t s_bar = (uint32_t)__cvta_generic_to_shared(bar);
    if (threadIdx.x == 0) {
        for (int s = 0; s < NS; s++) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(s_bar + 8 * s));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    /* chunks c = blockIdx.x + j * gridDim.x, j = 0, 1, ...: the j-th goes to stage j % NS */
    const size_t first = blockIdx.x;
    const size_t mine = first < nch ? (nch - 1 - first) / gridDim.x + 1 : 0;
    if (threadIdx.x == 0)
        for (size_t j = 0; j < (size_t)NS && j < mine; j++)
            bulk_issue(s_ring + (uint32_t)(j % NS) * CH, p + (first + j * gridDim.x) * CH, s_bar + 8 * (uint32_t)(j % NS));
    uint32_t acc = 0;
    for (size_t j = 0; j < mine; j++) {
        const int s = (int)(j % NS);
        const uint32_t parity = (uint32_t)((j / NS) & 1);
        uint32_t done = 0;
        while (!done)
            asm volatile("{ .reg .pred P; mbarrier.try_wait.parity.shared::cta.b64 P, [%1], %2; selp.u32 %0, 1, 0, P; }"
                         : "=r"(done)
                         : "r"(s_bar + 8 * s), "r"(parity)
                         : "memory");
        const uint4 *q = (const uint4 *)(ring + s * CH);
        for (int i = threadIdx.x; i < CH / 16; i += blockDim.x) acc ^= x4(q[i]);
        __syncthreads(); /* every thread is done with stage s before it is refilled */
        if (threadIdx.x == 0 && j + NS < mine)
            bulk_issue(s_ring + (uint32_t)s * CH, p + (first + (j + NS) * gridDim.x) * CH, s_bar + 8 * (uint32_t)s);
    }
    atomicXor(acc_out, acc);
#else
    (void)p;
    (void)bytes;
    (void)acc_out;
#endif
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
        for (int u = 0; u < 4; u++) v[u] = ld_nc(q + i + u * stride);
#pragma unroll
        for (int u = 0; u < 4; u++) acc ^= x4(v[u]);
    }
    for (; i < per; i += stride) acc ^= x4(ld_nc(q + i));
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
            v[2 * u] = ld_nc(q + i + 64 * u + lane);
            v[2 * u + 1] = ld_nc(q + i + 64 * u + 32 + lane);
        }
#pragma unroll
        for (int u = 0; u < 2 * STEPS; u++) acc ^= x4(v[u]);
    }
    for (; i < per; i += 32) acc ^= x4(ld_nc(q + i + lane));
    atomicXor(acc_out, acc);
}

typedef void (*kfn)(const uint4 *, size_t, unsigned *);

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
    const size_t n = bytes / 16;
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
    printf("cuda_bwprobe: %s, %d SMs, %zu MiB read %d times per kernel (best of the timed reads)\n", prop.name, sms, mib,
           reps);
    printf("%-8s %8s %8s %10s %8s %s\n", "kernel", "blocks", "threads", "GB/s", "vs gs4", "xor");
    double base = 0;
    const int bulk_smem4 = 4 * CH, bulk_smem6 = 6 * CH;
    const int have_bulk = prop.major >= 9;
    if (have_bulk) {
        CK(cudaFuncSetAttribute(bulk_kernel<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, bulk_smem4));
        CK(cudaFuncSetAttribute(bulk_kernel<6>, cudaFuncAttributeMaxDynamicSharedMemorySize, bulk_smem6));
    }
    for (int v = 0; v < 8; v++) {
        const char *name;
        int blocks, threads, smem = 0;
        kfn f = NULL;
        switch (v) {
        case 0: name = "gs4"; f = gs_kernel<4, false>; blocks = sms * 8; threads = 512; break;
        case 1: name = "gs8"; f = gs_kernel<8, false>; blocks = sms * 8; threads = 512; break;
        case 2: name = "gs4_1w"; f = gs_kernel<4, false>; blocks = sms * 4; threads = 512; break;
        case 3: name = "gs4_pf"; f = gs_kernel<4, true>; blocks = sms * 8; threads = 512; break;
        case 4: name = "chunk"; f = chunk_kernel; blocks = sms * 4; threads = 512; break;
        case 5: name = "chunk8"; f = chunk_kernel; blocks = sms * 8; threads = 256; break;
        case 6: name = "bulk4"; blocks = sms * 1; threads = 256; smem = bulk_smem4; break;
        default: name = "bulk6"; blocks = sms * 1; threads = 256; smem = bulk_smem6; break;
        }
        if (v >= 6 && !have_bulk) continue;
        double best = 1e30;
        unsigned got = 0;
        for (int r = 0; r <= reps; r++) {
            CK(cudaMemset(acc, 0, sizeof(unsigned)));
            CK(cudaEventRecord(a));
            if (f) f<<<blocks, threads>>>((const uint4 *)buf, n, acc);
            else if (v == 6) bulk_kernel<4><<<blocks, threads, smem>>>(buf, bytes, acc);
            else bulk_kernel<6><<<blocks, threads, smem>>>(buf, bytes, acc);
            CK(cudaGetLastError());
            CK(cudaEventRecord(b));
            CK(cudaEventSynchronize(b));
            float ms = 0;
            CK(cudaEventElapsedTime(&ms, a, b));
            CK(cudaMemcpy(&got, acc, sizeof got, cudaMemcpyDeviceToHost));
            if (got != want) {
                fprintf(stderr, "cuda_bwprobe: %s read the wrong bytes (xor %08x, expected %08x)\n", name, got, want);
                return 1;
            }
            if (r > 0 && ms < best) best = ms;
        }
        const double gbs = (double)bytes / (best * 1e-3) / 1e9;
        if (v == 0) base = gbs;
        printf("%-8s %8d %8d %10.1f %8.3f ok\n", name, blocks, threads, gbs, gbs / base);
    }
    /* how the rate falls with the number of independent read fronts */
    const int fr[] = {1, 2, 4, 8, 16, 32, 66, 132, 264, 528, 1056};
    for (int v = 0; v < (int)(sizeof fr / sizeof fr[0]) + 2; v++) {
        const int nf = (int)(sizeof fr / sizeof fr[0]);
        const int F = v < nf ? fr[v] : 0;
        const int blocks = v < nf ? sms * 8 : sms * 4, threads = v < nf ? 512 : 128;
        if (F && (size_t)(sms * 8) % F) continue;
        double best = 1e30;
        unsigned got = 0;
        for (int r = 0; r <= reps; r++) {
            CK(cudaMemset(acc, 0, sizeof(unsigned)));
            CK(cudaEventRecord(a));
            if (F) fronts_kernel<<<blocks, threads>>>((const uint4 *)buf, n, acc, F);
            else if (v == nf) warpown_kernel<2><<<blocks, threads>>>((const uint4 *)buf, n, acc);
            else warpown_kernel<4><<<blocks, threads>>>((const uint4 *)buf, n, acc);
            CK(cudaGetLastError());
            CK(cudaEventRecord(b));
            CK(cudaEventSynchronize(b));
            float ms = 0;
            CK(cudaEventElapsedTime(&ms, a, b));
            CK(cudaMemcpy(&got, acc, sizeof got, cudaMemcpyDeviceToHost));
            if (r > 0 && ms < best) best = ms;
        }
        const double gbs = (double)bytes / (best * 1e-3) / 1e9;
        char name[32];
        if (F) snprintf(name, sizeof name, "fronts%d", F);
        else snprintf(name, sizeof name, "warp%d", v == nf ? 2 : 4);
        /* per-front and per-warp regions leave a tail unread when n does
         * not divide: the XOR is then not the buffer's; the rate stands */
        printf("%-8s %8d %8d %10.1f %8.3f %s\n", name, blocks, threads, gbs, gbs / base, got == want ? "ok" : "part");
    }
    cudaFree(buf);
    cudaFree(acc);
    return 0;
}
