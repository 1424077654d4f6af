/* Device helpers the CUDA backend's kernels share: programmatic dependent
 * launch, the L2 policy of once-read streams, cache-hinted loads and
 * cp.async copies. */
#ifndef FM_DEVICE_UTIL_CUH
#define FM_DEVICE_UTIL_CUH
#include <cuda_runtime.h>
#include <stdint.h>

/* Waits for the grid this one depends on (PDL; a no-op before sm_90). */
static __device__ __forceinline__ void pdl_wait(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
/* Lets the next grid of the stream launch (its blocks still wait above). */
static __device__ __forceinline__ void pdl_launch_dependents(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* gpu-scope acquire load (the per-expert handoff to down) */
static __device__ __forceinline__ unsigned ld_acquire_u32(const unsigned *q) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(q) : "memory");
    return v;
}
#endif
static __device__ __forceinline__ void prefetch_l2_line(const void *q) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(q));
}

/* Bytes read once per layer (expert weights, router rows) are read at L2's
 * evict-first priority, so that they do not push out what is read again
 * soon (the tokens' activations, h, the routing arrays). */
static __device__ __forceinline__ uint64_t l2_evict_first(void) {
    uint64_t pol;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}
static __device__ __forceinline__ uint4 ld_stream_pol(const void *p, uint64_t pol) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p), "l"(pol));
    return r;
}
static __device__ __forceinline__ uint32_t ld_u16_pol(const void *p, uint64_t pol) {
    unsigned short r;
    asm("ld.global.nc.L2::cache_hint.u16 %0, [%1], %2;" : "=h"(r) : "l"(p), "l"(pol));
    return r;
}
static __device__ __forceinline__ uint32_t ld_u8_pol(const void *p, uint64_t pol) {
    unsigned short r;
    asm("ld.global.nc.L2::cache_hint.u8 %0, [%1], %2;" : "=h"(r) : "l"(p), "l"(pol));
    return r & 0xFFu;
}

/* The same loads as asm volatile, for loads that must be issued before a
 * griddepcontrol.wait (a plain asm load may be moved after it, losing the
 * overlap with the previous grid's tail, or hoisted out of its guard). */
static __device__ __forceinline__ uint4 ld_stream_pol_v(const void *p, uint64_t pol) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p), "l"(pol));
    return r;
}
static __device__ __forceinline__ uint32_t ld_u16_pol_v(const void *p, uint64_t pol) {
    unsigned short r;
    asm volatile("ld.global.nc.L2::cache_hint.u16 %0, [%1], %2;" : "=h"(r) : "l"(p), "l"(pol));
    return r;
}
static __device__ __forceinline__ uint32_t ld_u8_pol_v(const void *p, uint64_t pol) {
    unsigned short r;
    asm volatile("ld.global.nc.L2::cache_hint.u8 %0, [%1], %2;" : "=h"(r) : "l"(p), "l"(pol));
    return r & 0xFFu;
}

static __device__ __forceinline__ void cp_async16_pol(uint32_t dst, const void *src, uint64_t pol) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, 16, %2;" ::"r"(dst), "l"(src), "l"(pol)
                 : "memory");
}
/* B bytes (4 or 8); src aligned to that; zero-filled when !valid */
template <int B>
static __device__ __forceinline__ void cp_async_small(uint32_t dst, const void *src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(dst), "l"(src), "n"(B), "r"(valid ? B : 0)
                 : "memory");
}
static __device__ __forceinline__ void cp_async_commit(void) { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
static __device__ __forceinline__ void cp_async_wait(void) {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
#endif
