/*
 * Streaming reads of a device buffer: the kernels of the engine's bandwidth
 * probe (fm_cuda_stream_read in bwprobe.cu) and of the tool that compares it
 * with other read patterns (dev/tools/cuda_bwprobe.cu), so that the tool
 * times exactly the code the probe runs. Every kernel XORs all the 32-bit
 * words it read into *acc_out (atomicXor), which a caller can check against
 * the buffer's XOR: a kernel that skipped bytes cannot pass unnoticed.
 */
#ifndef FM_STREAM_READ_CUH
#define FM_STREAM_READ_CUH

#include <cuda_runtime.h>
#include <stdint.h>

/* 16 bytes through the non-coherent path, no L1 allocation, no L2 fetch-size
 * hint (the probe's load) */
static __device__ __forceinline__ uint4 fm_ld_nc(const void *p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}
/* the same with .L2::256B (an earlier probe's load; slower on the H200) */
static __device__ __forceinline__ uint4 fm_ld_nc_256(const void *p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}
static __device__ __forceinline__ uint32_t fm_xor4(uint4 a) { return a.x ^ a.y ^ a.z ^ a.w; }

/* n 16-byte words read grid-stride, U loads per thread in flight; PF: with
 * the .L2::256B hint. The probe runs <4, false> with 8 blocks of 512 threads
 * per SM. */
template <int U, bool PF>
__global__ void fm_gs_read_kernel(const uint4 *p, size_t n, unsigned *acc_out) {
    uint32_t acc = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + (U - 1) * stride < n; i += U * stride) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) v[u] = PF ? fm_ld_nc_256(p + i + u * stride) : fm_ld_nc(p + i + u * stride);
#pragma unroll
        for (int u = 0; u < U; u++) acc ^= fm_xor4(v[u]);
    }
    for (; i < n; i += stride) acc ^= fm_xor4(fm_ld_nc(p + i));
    atomicXor(acc_out, acc);
}

/* The bytes (a multiple of FM_BULK_CH) by TMA bulk copies (sm_90): block b
 * streams chunks b, b + gridDim.x, ... through a ring of NS stages of
 * shared memory (NS * FM_BULK_CH dynamic bytes; thread 0 issues, an mbarrier
 * per stage), every thread XORs what landed. Elsewhere the body is empty
 * and *acc_out keeps 0. */
#define FM_BULK_CH (32 * 1024)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
static __device__ __forceinline__ void fm_bulk_issue(uint32_t s_dst, const uint8_t *src, uint32_t s_bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(s_bar), "r"(FM_BULK_CH) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(s_dst),
                 "l"(src), "r"(FM_BULK_CH), "r"(s_bar)
                 : "memory");
}
#endif
template <int NS>
__global__ void __launch_bounds__(256) fm_bulk_read_kernel(const uint8_t *p, size_t bytes, unsigned *acc_out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) uint8_t ring[];
    __shared__ __align__(8) uint64_t bar[NS];
    const size_t nch = bytes / FM_BULK_CH, first = blockIdx.x;
    const size_t mine = first < nch ? (nch - 1 - first) / gridDim.x + 1 : 0;
    const uint32_t s_ring = (uint32_t)__cvta_generic_to_shared(ring);
    const uint32_t s_bar = (uint32_t)__cvta_generic_to_shared(bar);
    if (threadIdx.x == 0) {
        for (int s = 0; s < NS; s++) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(s_bar + 8 * s));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (size_t j = 0; j < (size_t)NS && j < mine; j++)
            fm_bulk_issue(s_ring + (uint32_t)j * FM_BULK_CH, p + (first + j * gridDim.x) * FM_BULK_CH,
                          s_bar + 8 * (uint32_t)j);
    }
    __syncthreads();
    uint32_t acc = 0;
    for (size_t j = 0; j < mine; j++) {
        const uint32_t s = (uint32_t)(j % NS), parity = (uint32_t)((j / NS) & 1);
        uint32_t done = 0;
        while (!done)
            asm volatile("{ .reg .pred P; mbarrier.try_wait.parity.shared::cta.b64 P, [%1], %2; selp.u32 %0, 1, 0, P; }"
                         : "=r"(done)
                         : "r"(s_bar + 8 * s), "r"(parity)
                         : "memory");
        const uint4 *q = (const uint4 *)(ring + s * FM_BULK_CH);
        for (int i = threadIdx.x; i < FM_BULK_CH / 16; i += blockDim.x) acc ^= fm_xor4(q[i]);
        __syncthreads(); /* stage s is read by every thread before it is refilled */
        if (threadIdx.x == 0 && j + NS < mine)
            fm_bulk_issue(s_ring + s * FM_BULK_CH, p + (first + (j + NS) * gridDim.x) * FM_BULK_CH, s_bar + 8 * s);
    }
    atomicXor(acc_out, acc);
#else
    (void)p;
    (void)bytes;
    (void)acc_out;
#endif
}

#endif
