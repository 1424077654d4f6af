/* What the routing kernels (route_logits.cu, route_select.cu) share: the
 * block shapes, the partial logits' row stride and the tokens' activations
 * as FP32 and in the experts' BF16 layout. */
#ifndef FM_ROUTE_COMMON_CUH
#define FM_ROUTE_COMMON_CUH
#include "cuda_internal.h"
#include "device_util.cuh"
#include "route_shape.h"
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define RT_THREADS 256
#define RT_WARPS (RT_THREADS / 32)
#define RT_MAXK 32

/* Row stride of the partial logits and of the selection's per-expert
 * arrays: E rounded up to 4, so that a lane moves 4 experts at a time. */
static __host__ __device__ __forceinline__ int lg_stride(int E) { return (E + 3) & ~3; }

/* Four activations x[t][k..k+3] as FP32 (k a multiple of 4, H % 4 == 0). */
static __device__ __forceinline__ float4 load_x4(const void *x, int xdt, size_t o) {
    if (xdt == FM_DT_F32) return __ldg((const float4 *)((const float *)x + o));
    uint2 v = __ldg((const uint2 *)((const uint16_t *)x + o));
    if (xdt == FM_DT_BF16)
        return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xFFFF0000u), __uint_as_float(v.y << 16),
                           __uint_as_float(v.y & 0xFFFF0000u));
    __half2 h0 = *(__half2 *)&v.x, h1 = *(__half2 *)&v.y;
    return make_float4(__low2float(h0), __high2float(h0), __low2float(h1), __high2float(h1));
}

/* Eight activations as the experts read them: BF16 of x * 2^7, stored
 * position m holding element perm[m] (the expert kernels' K order). */
static __device__ __forceinline__ uint4 prep8(const float *xv, const int *perm) {
    uint16_t o[8];
#pragma unroll
    for (int m = 0; m < 8; m++) {
        __nv_bfloat16 b = __float2bfloat16_rn(xv[perm[m]] * 128.0f);
        o[m] = *(uint16_t *)&b;
    }
    uint4 pk;
    pk.x = o[0] | (unsigned)o[1] << 16; pk.y = o[2] | (unsigned)o[3] << 16;
    pk.z = o[4] | (unsigned)o[5] << 16; pk.w = o[6] | (unsigned)o[7] << 16;
    return pk;
}

#endif
