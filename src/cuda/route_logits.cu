/*
 * Router logits on the GPU, the first routing launch of a layer: FP32
 * partial sums over K slices, by a grid wide enough to keep the router's
 * bytes in flight at every batch size (a GEMV shape for few tokens, a tiled
 * tensor-core shape for many). Both shapes also zero the tokens' output
 * rows and write the tokens' activations in the layout the expert kernels
 * read (BF16, scaled by 2^7, K permuted; see expert_mma.cu), one expert tile
 * per K slice. The pre-routed path runs that prep alone (fm_prep_kernel),
 * and so does the tiled shape with BF16 activations where the engine has
 * cuBLAS, whose GEMM then computes the logits (blas.cu).
 */
#include "route_common.cuh"
#include <math.h>

/* Router rows: four FP32 weights at L2's evict-first priority. */
static __device__ __forceinline__ float4 ld_router4(const float *q, uint64_t pol) {
    float4 r;
    asm("ld.global.nc.L2::cache_hint.v4.f32 {%0,%1,%2,%3}, [%4], %5;"
        : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w)
        : "l"(q), "l"(pol));
    return r;
}

/* Four BF16 router weights, as ld_router4 reads four FP32 ones. */
static __device__ __forceinline__ uint2 ld_router_bf4(const uint16_t *q, uint64_t pol) {
    uint2 r;
    asm("ld.global.nc.L2::cache_hint.v2.u32 {%0,%1}, [%2], %3;" : "=r"(r.x), "=r"(r.y) : "l"(q), "l"(pol));
    return r;
}

/* Sums of N values across a warp, N a power of two <= 32, in five
 * steps: each step halves the values a lane keeps (transposed butterfly), so
 * N sums cost N - 1 + 5 - log2(N) shuffles instead of 5 N. Afterwards lane l
 * holds the total of value (l >> (5 - log2 N)) in v[0]. */
template <int N>
static __device__ __forceinline__ float warp_sum_transposed(float *v) {
    const int lane = threadIdx.x & 31;
    int o = 16;
#pragma unroll
    for (int n = N; n > 1; n >>= 1, o >>= 1) {
        const bool upper = (lane & o) != 0;
#pragma unroll
        for (int j = 0; j < n / 2; j++) {
            float send = upper ? v[j] : v[j + n / 2];
            float keep = upper ? v[j + n / 2] : v[j];
            v[j] = keep + __shfl_xor_sync(0xffffffffu, send, o);
        }
    }
    for (; o; o >>= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
    return v[0];
}

/*
 * Router logits, FP32, as partial sums over K slices: part[s][t][e] =
 * sum over the s-th K slice of x[t][k] * W[e][k]; the selection kernel adds
 * the slices in order (s = 0, 1, ...) and the router bias. Two shapes:
 *
 * few tokens (T <= LG_SMALL_T): a GEMV over a grid of (16-expert block x
 *   512-K slice x 8-token tile); the token tile's x slice sits in shared
 *   memory, a warp owns 2 router rows and issues all 8 of its 16-byte row
 *   loads before the first FMA, so the whole 4 MB router of DeepSeek-V4 is
 *   in flight at once over ~128 blocks instead of a chain of dependent loads.
 * many tokens: 64 tokens x 64 experts per block on tensor cores
 *   (fm_logits_bf16_kernel, fm_logits_mma_kernel), K split so that the grid
 *   fills the SMs about two blocks deep.
 */
#define LG_SMALL_T FM_LG_SMALL_T
#define LG_KC 512          /* K slice of the GEMV shape                      */
#define LG_TT 8            /* tokens per GEMV block                          */
#define LG_EW 2            /* router rows per warp (GEMV)                    */
#define LG_TILE FM_LG_TILE /* tokens and experts per SGEMM block             */

/* The shape decision is route_shape.c's, which `fp4moe explain` shares. */
#define LG_GEMV_MAX FM_LG_GEMV_MAX

__global__ void __launch_bounds__(RT_THREADS) fm_logits_gemv_kernel(fm_route_params p) {
    const uint64_t rpol = l2_evict_first();
    __shared__ __align__(16) float xs[LG_TT][LG_KC];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int e0 = (blockIdx.x * RT_WARPS + warp) * LG_EW, k0 = blockIdx.y * LG_KC, t0 = blockIdx.z * LG_TT;
    const int H = p.H, E = p.E, T = p.T;
    /* the router rows are written by no kernel of the stream that triggers
     * its dependents early, so they are read before waiting on the previous
     * layer (their latency hides under its tail) */
    /* the BF16 copy where every router weight is exact in BF16: the same
     * products from half the bytes */
    float4 w[LG_EW][LG_KC / 128];
    if (p.router_wb) {
        uint2 wb[LG_EW][LG_KC / 128];
#pragma unroll
        for (int a = 0; a < LG_EW; a++)
#pragma unroll
            for (int it = 0; it < LG_KC / 128; it++) {
                int k = k0 + it * 128 + lane * 4;
                wb[a][it] = e0 + a < E && k < H ? ld_router_bf4(p.router_wb + (size_t)(e0 + a) * H + k, rpol)
                                                : make_uint2(0, 0);
            }
#pragma unroll
        for (int a = 0; a < LG_EW; a++)
#pragma unroll
            for (int it = 0; it < LG_KC / 128; it++)
                w[a][it] = make_float4(__uint_as_float(wb[a][it].x << 16), __uint_as_float(wb[a][it].x & 0xFFFF0000u),
                                       __uint_as_float(wb[a][it].y << 16), __uint_as_float(wb[a][it].y & 0xFFFF0000u));
    } else {
#pragma unroll
        for (int a = 0; a < LG_EW; a++)
#pragma unroll
            for (int it = 0; it < LG_KC / 128; it++) {
                int k = k0 + it * 128 + lane * 4;
                w[a][it] = e0 + a < E && k < H ? ld_router4(p.router_w + (size_t)(e0 + a) * H + k, rpol)
                                               : make_float4(0, 0, 0, 0);
            }
    }
    {
        /* ptxas schedules griddepcontrol.wait above plain loads; a branch on
         * their values (never taken: finite weights) keeps the wait after
         * them, so that the rows' latency hides under the previous grid */
        float dep = 0.0f;
#pragma unroll
        for (int a = 0; a < LG_EW; a++)
#pragma unroll
            for (int it = 0; it < LG_KC / 128; it++) dep += w[a][it].x;
        if (__float_as_uint(dep) == 0x7FBADBADu) p.logits[0] = dep;
    }
    pdl_wait();
    pdl_launch_dependents();
    for (int i = threadIdx.x; i < LG_TT * (LG_KC / 4); i += RT_THREADS) {
        int b = i / (LG_KC / 4), c = (i % (LG_KC / 4)) * 4;
        int t = t0 + b, k = k0 + c;
        float4 v = t < T && k < H ? load_x4(p.x, p.xdt, (size_t)t * H + k) : make_float4(0, 0, 0, 0);
        *(float4 *)&xs[b][c] = v;
    }
    __syncthreads();
    /* the first expert block of each (slice, token tile) also writes the
     * tokens' copy for the experts and zeroes their output, so that the
     * one-warp-per-token selection has no per-token streaming left */
    if (blockIdx.x == 0) {
        for (int i = threadIdx.x; i < LG_TT * (LG_KC / 8); i += RT_THREADS) {
            int b = i / (LG_KC / 8), c = (i % (LG_KC / 8)) * 8;
            int t = t0 + b, k = k0 + c;
            if (t >= T) continue;
            if (k < p.Hp) {
                const int perm[8] = {0, 4, 1, 5, 2, 6, 3, 7};
                *(uint4 *)&p.x_prep[(size_t)t * p.Hp + k] = prep8(&xs[b][c], perm);
            }
            if (k < H) *(float4 *)&p.out[(size_t)t * H + k] = make_float4(0, 0, 0, 0);
            if (k + 4 < H) *(float4 *)&p.out[(size_t)t * H + k + 4] = make_float4(0, 0, 0, 0);
        }
    }
    float acc[LG_EW * LG_TT];
#pragma unroll
    for (int i = 0; i < LG_EW * LG_TT; i++) acc[i] = 0.0f;
#pragma unroll
    for (int it = 0; it < LG_KC / 128; it++)
#pragma unroll
        for (int b = 0; b < LG_TT; b++) {
            float4 xv = *(const float4 *)&xs[b][it * 128 + lane * 4];
#pragma unroll
            for (int a = 0; a < LG_EW; a++)
                acc[a * LG_TT + b] += w[a][it].x * xv.x + w[a][it].y * xv.y + w[a][it].z * xv.z + w[a][it].w * xv.w;
        }
    float v = warp_sum_transposed<LG_EW * LG_TT>(acc);
    const int idx = lane >> 1, a = idx / LG_TT, b = idx % LG_TT;
    if ((lane & 1) == 0 && e0 + a < E && t0 + b < T)
        p.logits[((size_t)blockIdx.y * T + t0 + b) * lg_stride(E) + e0 + a] = v;
}

/* The expert tiles of each (token tile, K slice) of the SGEMM shapes also
 * write the tokens' copy for the experts and zero their output, as the GEMV
 * shape does, so that the selection warps stream nothing per token (one
 * warp copying a 4096-wide row was a chain of 16 dependent loads); the last
 * slice also writes the zero padding up to Hp. The work is spread over the
 * gridDim.y expert tiles (the first tile alone would hold its blocks, a
 * chain of dependent loads per thread, long after the others) and each thread loads two 8-element groups before it stores. */
/* Groups g = first, first + stride, ... of the ntok x ng 8-element groups of
 * tokens t0 .. t0 + ntok - 1 and K columns kbeg .. kbeg + 8 ng - 1: each
 * written to x_prep (the experts' BF16 order) and zeroed in the output,
 * two groups' loads in flight per thread. */
static __device__ void prep_groups(const fm_route_params &p, int t0, int ntok, int kbeg, int ng, int first,
                                   int stride) {
    const int H = p.H, n = ntok * ng;
    const int perm[8] = {0, 4, 1, 5, 2, 6, 3, 7};
    for (int i0 = first; i0 < n; i0 += 2 * stride) {
        float4 v[2][2];
        size_t base[2];
        int kk[2];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int i = i0 + u * stride;
            const int t = t0 + i / ng;
            kk[u] = kbeg + (i % ng) * 8;
            base[u] = (size_t)t * H + kk[u];
            const bool ok = i < n;
            v[u][0] = ok && kk[u] < H ? load_x4(p.x, p.xdt, base[u]) : make_float4(0, 0, 0, 0);
            v[u][1] = ok && kk[u] + 4 < H ? load_x4(p.x, p.xdt, base[u] + 4) : make_float4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int i = i0 + u * stride;
            if (i >= n) break;
            const int t = t0 + i / ng;
            const float xv[8] = {v[u][0].x, v[u][0].y, v[u][0].z, v[u][0].w,
                                 v[u][1].x, v[u][1].y, v[u][1].z, v[u][1].w};
            *(uint4 *)&p.x_prep[(size_t)t * p.Hp + kk[u]] = prep8(xv, perm);
            if (kk[u] < H) *(float4 *)&p.out[base[u]] = make_float4(0, 0, 0, 0);
            if (kk[u] + 4 < H) *(float4 *)&p.out[base[u] + 4] = make_float4(0, 0, 0, 0);
        }
    }
}

static __device__ void tile_prep(const fm_route_params &p, int t0, int kbeg, int kend) {
    const int pend = blockIdx.z == gridDim.z - 1 ? p.Hp : kend;
    /* kbeg, kend (not last) and Hp are multiples of 8 */
    prep_groups(p, t0, min(LG_TILE, p.T - t0), kbeg, (pend - kbeg) / 8, threadIdx.x + blockIdx.y * RT_THREADS,
                RT_THREADS * gridDim.y);
}

/* A block of the SGEMM shapes: its token tile t0, expert tile e0 and K
 * slice [kbeg, kend); waits on the previous grid, lets the next launch, and
 * does its share of the tokens' prep. */
static __device__ __forceinline__ void tile_start(const fm_route_params &p, int kc, int &t0, int &e0, int &kbeg,
                                                  int &kend) {
    t0 = blockIdx.x * LG_TILE;
    e0 = blockIdx.y * LG_TILE;
    kbeg = blockIdx.z * kc;
    kend = min(p.H, kbeg + kc);
    pdl_wait();
    pdl_launch_dependents();
    tile_prep(p, t0, kbeg, kend);
}

/* The tokens' prep alone (the pre-routed path, which computes no logits):
 * x_prep and the zeroed output of every token. One 8-element group per
 * thread and round, two groups' loads in flight. */
__global__ void __launch_bounds__(RT_THREADS) fm_prep_kernel(fm_route_params p) {
    pdl_wait();
    pdl_launch_dependents();
    prep_groups(p, 0, p.T, 0, p.Hp / 8, blockIdx.x * RT_THREADS + threadIdx.x, gridDim.x * RT_THREADS);
}

/*
 * The tiled shape on tensor cores (sm_80 and later) for routers that are not
 * exact in BF16: 64 x 64 tiles, the products by mma.sync m16n8k8 TF32 in three terms, x_hi w_hi + x_hi w_lo +
 * x_lo w_hi, where v_hi = TF32(v) and v_lo = TF32(v - v_hi): each product
 * is FP32's to ~2^-21 relative (the x_lo w_lo term, ~2^-22, is left out),
 * accumulated in FP32 — the router's math stays FP32 (the CPU reference's
 * top-k ids), at the tensor cores' rate instead of the FMA pipe's. Eight
 * warps, each 16 tokens x 32 experts (four n-tiles); the tiles go through
 * shared memory 64 K at a time (each thread's next 8 loads in flight during
 * a stage's MMAs), row stride 68 floats, so the fragment reads (row 4g + t)
 * hit 32 different banks.
 */
#define LGM_KS 64
#define LGM_LD (LGM_KS + 4)
static __device__ __forceinline__ void tf32_split(float v, uint32_t &hi, uint32_t &lo) {
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(hi) : "f"(v));
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lo) : "f"(v - __uint_as_float(hi)));
}
static __device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}


/* The tensor-core logits kernels' loader: a thread's four 4-wide pieces of
 * one 64-K stage from K kb (rows lr and lr + 32 of each tile, K at lc and
 * lc + 32): the tokens' activations as FP32, the router rows as FP32 or
 * BF16, zeros past the tile's tokens, experts and K slice. */
static __device__ __forceinline__ void tile_w4(const fm_route_params &p, int e, int k, int kend, uint64_t pol,
                                               float4 &w) {
    w = e < p.E && k < kend ? ld_router4(p.router_w + (size_t)e * p.H + k, pol) : make_float4(0, 0, 0, 0);
}
static __device__ __forceinline__ void tile_w4(const fm_route_params &p, int e, int k, int kend, uint64_t pol,
                                               uint2 &w) {
    w = e < p.E && k < kend ? ld_router_bf4(p.router_wb + (size_t)e * p.H + k, pol) : make_uint2(0, 0);
}
template <typename WV>
static __device__ __forceinline__ void tile_stage_load(const fm_route_params &p, int t0, int e0, int lr, int lc, int kb,
                                                       int kend, uint64_t pol, float4 (&xr)[4], WV (&wr)[4]) {
#pragma unroll
    for (int h = 0; h < 4; h++) {
        const int r = lr + 32 * (h & 1), k = kb + lc + 32 * (h >> 1);
        xr[h] = t0 + r < p.T && k < kend ? load_x4(p.x, p.xdt, (size_t)(t0 + r) * p.H + k) : make_float4(0, 0, 0, 0);
        tile_w4(p, e0 + r, k, kend, pol, wr[h]);
    }
}

/* The tensor-core logits kernels' epilogue: warp (wm, wn)'s m16n8
 * accumulators (tokens wm * 16 .., experts wn * 32 ..) into K slice
 * blockIdx.z's partial logits. */
static __device__ __forceinline__ void tile_store(const fm_route_params &p, const float (&acc)[4][4], int t0, int e0,
                                                  int wm, int wn, int g, int q) {
    const size_t ld = (size_t)lg_stride(p.E);
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        const int t = t0 + wm * 16 + g + 8 * hr;
        if (t >= p.T) continue;
        float *dst = p.logits + ((size_t)blockIdx.z * p.T + t) * ld;
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            const int e = e0 + wn * 32 + nt * 8 + 2 * q;
            if (e < p.E) dst[e] = acc[nt][2 * hr];
            if (e + 1 < p.E) dst[e + 1] = acc[nt][2 * hr + 1];
        }
    }
}

__global__ void __launch_bounds__(RT_THREADS) fm_logits_mma_kernel(fm_route_params p, int kc) {
    const uint64_t rpol = l2_evict_first();
    __shared__ __align__(16) float xs[LG_TILE][LGM_LD];
    __shared__ __align__(16) float ws[LG_TILE][LGM_LD];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, q = lane & 3;
    const int wm = warp & 3, wn = warp >> 2; /* tokens wm*16.., experts wn*32.. */
    int t0, e0, kbeg, kend;
    tile_start(p, kc, t0, e0, kbeg, kend);
    /* loader: rows lr and lr + 32 of each tile, 4 K values at lc and lc + 32 */
    const int lr = tid >> 3, lc = (tid & 7) * 4;
    float acc[4][4] = {};
    float4 xr[4], wr[4];
    tile_stage_load(p, t0, e0, lr, lc, kbeg, kend, rpol, xr, wr);
    for (int kb = kbeg; kb < kend; kb += LGM_KS) {
#pragma unroll
        for (int h = 0; h < 4; h++) {
            *(float4 *)&xs[lr + 32 * (h & 1)][lc + 32 * (h >> 1)] = xr[h];
            *(float4 *)&ws[lr + 32 * (h & 1)][lc + 32 * (h >> 1)] = wr[h];
        }
        __syncthreads();
        /* the next stage's loads fly during this stage's MMAs */
        tile_stage_load(p, t0, e0, lr, lc, kb + LGM_KS, kend, rpol, xr, wr);
#pragma unroll
        for (int k8 = 0; k8 < LGM_KS; k8 += 8) {
            uint32_t ah[4], al[4];
            const float *xa = &xs[wm * 16 + g][k8 + q];
            tf32_split(xa[0], ah[0], al[0]);
            tf32_split(xa[8 * LGM_LD], ah[1], al[1]);
            tf32_split(xa[4], ah[2], al[2]);
            tf32_split(xa[8 * LGM_LD + 4], ah[3], al[3]);
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                const float *wb = &ws[wn * 32 + nt * 8 + g][k8 + q];
                uint32_t bh0, bl0, bh1, bl1;
                tf32_split(wb[0], bh0, bl0);
                tf32_split(wb[4], bh1, bl1);
                mma_tf32(acc[nt], al, bh0, bh1);
                mma_tf32(acc[nt], ah, bl0, bl1);
                mma_tf32(acc[nt], ah, bh0, bh1);
            }
        }
        __syncthreads();
    }
    tile_store(p, acc, t0, e0, wm, wn, g, q);
}

/*
 * The tiled shape on BF16 tensor cores where the router is exact in
 * BF16 (p.router_wb; checkpoints store routers in BF16): each activation is
 * split into NT BF16 terms whose sum is exactly its value (one for BF16
 * input, two for F16, three for F32: 8 significant bits each), every
 * product of a term and a router weight is exact in FP32, and mma.sync
 * m16n8k16 BF16 accumulates them in FP32 — the FP32 router math of the
 * TF32 kernel, with NT BF16 MMAs per 16 K instead of six TF32 ones and
 * half the router bytes. Same tiles, warps, K slices and outputs as
 * fm_logits_mma_kernel; shared rows of 72 BF16 (144 bytes), so that the
 * fragment reads (row g, word q) hit 32 different banks.
 */
#define LGB_LD (LGM_KS + 8)
static __device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/* v's NT BF16 terms, largest first, packed in pairs: t[j] holds term j of
 * (v.x, v.y) and (v.z, v.w). Each term is v minus the terms before it,
 * rounded to BF16; the remainders are exact in FP32. */
template <int NT>
static __device__ __forceinline__ void bf16_terms(float4 v, uint2 (&t)[NT]) {
    float r[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < NT; j++) {
        uint32_t h[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            __nv_bfloat16 b = __float2bfloat16_rn(r[i]);
            h[i] = *(uint16_t *)&b;
            r[i] -= __bfloat162float(b);
        }
        t[j] = make_uint2(h[0] | h[1] << 16, h[2] | h[3] << 16);
    }
}

template <int NT>
__global__ void __launch_bounds__(RT_THREADS) fm_logits_bf16_kernel(fm_route_params p, int kc) {
    const uint64_t rpol = l2_evict_first();
    __shared__ __align__(16) uint16_t xs[NT][LG_TILE][LGB_LD];
    __shared__ __align__(16) uint16_t ws[LG_TILE][LGB_LD];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, q = lane & 3;
    const int wm = warp & 3, wn = warp >> 2; /* tokens wm*16.., experts wn*32.. */
    int t0, e0, kbeg, kend;
    tile_start(p, kc, t0, e0, kbeg, kend);
    /* loader: rows lr and lr + 32 of each tile, 4 K values at lc and lc + 32 */
    const int lr = tid >> 3, lc = (tid & 7) * 4;
    float acc[4][4] = {};
    float4 xr[4];
    uint2 wr[4];
    tile_stage_load(p, t0, e0, lr, lc, kbeg, kend, rpol, xr, wr);
    for (int kb = kbeg; kb < kend; kb += LGM_KS) {
#pragma unroll
        for (int h = 0; h < 4; h++) {
            const int r = lr + 32 * (h & 1), c = lc + 32 * (h >> 1);
            uint2 t[NT];
            bf16_terms<NT>(xr[h], t);
#pragma unroll
            for (int j = 0; j < NT; j++) *(uint2 *)&xs[j][r][c] = t[j];
            *(uint2 *)&ws[r][c] = wr[h];
        }
        __syncthreads();
        /* the next stage's loads fly during this stage's MMAs */
        tile_stage_load(p, t0, e0, lr, lc, kb + LGM_KS, kend, rpol, xr, wr);
#pragma unroll
        for (int k16 = 0; k16 < LGM_KS; k16 += 16) {
            uint32_t a[NT][4];
#pragma unroll
            for (int j = 0; j < NT; j++) {
                a[j][0] = *(const uint32_t *)&xs[j][wm * 16 + g][k16 + 2 * q];
                a[j][1] = *(const uint32_t *)&xs[j][wm * 16 + g + 8][k16 + 2 * q];
                a[j][2] = *(const uint32_t *)&xs[j][wm * 16 + g][k16 + 8 + 2 * q];
                a[j][3] = *(const uint32_t *)&xs[j][wm * 16 + g + 8][k16 + 8 + 2 * q];
            }
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                const uint16_t *wb = &ws[wn * 32 + nt * 8 + g][k16 + 2 * q];
                const uint32_t b0 = *(const uint32_t *)wb, b1 = *(const uint32_t *)(wb + 8);
                /* the smallest terms first */
#pragma unroll
                for (int j = NT - 1; j >= 0; j--) mma_bf16(acc[nt], a[j], b0, b1);
            }
        }
        __syncthreads();
    }
    tile_store(p, acc, t0, e0, wm, wn, g, q);
}

extern "C" int fm_cuda_route_logit_stride(int E) { return lg_stride(E); }

extern "C" size_t fm_cuda_route_logit_floats(int T, int H, int E, int sms) {
    /* GEMV shape: ceil(H / LG_KC) slices of at most LG_GEMV_MAX tokens;
     * tiled shape: slices x tiles <= 4 sms + tiles - 1, each 64 x 64; and
     * never less than one slice. Every term grows with T, H, E and sms. */
    size_t tiles = (size_t)((T + LG_TILE - 1) / LG_TILE) * ((E + LG_TILE - 1) / LG_TILE);
    size_t a = (size_t)((H + LG_KC - 1) / LG_KC) * LG_GEMV_MAX * lg_stride(E);
    size_t b = (4 * (size_t)(sms > 0 ? sms : 132) + tiles) * LG_TILE * LG_TILE; /* lg_stride(E) <= tiles' experts */
    size_t c = (size_t)T * lg_stride(E);
    size_t m = a > b ? a : b;
    return m > c ? m : c;
}

/* Name of the logits kernel the launch below takes at T tokens. */
extern "C" const char *fm_cuda_route_logits_name(int T, int H, int E, int sms, int bf16_router, int xdt, int blas) {
    if (fm_route_logits_gemv(T, H, E, sms)) return bf16_router ? "GEMV, FP32 FMA on the BF16 router (exact)" : "GEMV, FP32 FMA";
    if (bf16_router)
        return xdt == FM_DT_BF16 ? (blas ? "cuBLAS BF16 GEMM (exact products, FP32 sums)"
                                         : "BF16 mma.sync, one term (exact products, FP32 sums; no cuBLAS)")
               : xdt == FM_DT_F16 ? "BF16 mma.sync, two terms of x (exact products, FP32 sums)"
                                  : "BF16 mma.sync, three terms of x (exact products, FP32 sums)";
    return "three TF32 terms on mma.sync (FP32 accuracy)";
}

static cudaLaunchConfig_t route_cfg(cudaStream_t s, int pdl, cudaLaunchAttribute *attr) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.blockDim = dim3(RT_THREADS);
    cfg.stream = s;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    return cfg;
}

/* The logits (sets p->kslices): the GEMV shape up to its token limit, else
 * cuBLAS for BF16 activations on the exact BF16 router, else the BF16
 * tensor-core tiles where the router is exact in BF16, else TF32. */
extern "C" fm_status fm_cuda_launch_logits(fm_route_params *p, int pdl, cudaStream_t s) {
    cudaLaunchAttribute attr[1];
    cudaLaunchConfig_t cfg = route_cfg(s, pdl, attr);
    if (fm_route_logits_gemv(p->T, p->H, p->E, p->sms)) {
        const int ks = (p->H + LG_KC - 1) / LG_KC;
        p->kslices = ks;
        cfg.gridDim = dim3((unsigned)((p->E + RT_WARPS * LG_EW - 1) / (RT_WARPS * LG_EW)), (unsigned)ks,
                           (unsigned)((p->T + LG_TT - 1) / LG_TT));
        FM_CU(cudaLaunchKernelEx(&cfg, fm_logits_gemv_kernel, *p));
        FM_CU_LAUNCH("fm_logits_gemv_kernel");
        return FM_OK;
    }
    if (p->blas && p->router_wb && p->xdt == FM_DT_BF16) {
        /* one product, one slice; the tokens' prep (x_prep, the zeroed
         * output) is then a launch of its own */
        fm_status st = fm_cuda_launch_prep(p, pdl, s);
        if (st) return st;
        p->kslices = 1;
        return fm_cuda_blas_logits(p->blas, p, s);
    }
    int ks, kc;
    fm_route_tile_split(p->T, p->H, p->E, p->sms, 2, LGM_KS, &ks, &kc);
    p->kslices = ks;
    cfg.gridDim = dim3((unsigned)((p->T + LG_TILE - 1) / LG_TILE), (unsigned)((p->E + LG_TILE - 1) / LG_TILE),
                       (unsigned)ks);
    if (p->router_wb) {
        if (p->xdt == FM_DT_BF16) FM_CU(cudaLaunchKernelEx(&cfg, fm_logits_bf16_kernel<1>, *p, kc));
        else if (p->xdt == FM_DT_F16) FM_CU(cudaLaunchKernelEx(&cfg, fm_logits_bf16_kernel<2>, *p, kc));
        else FM_CU(cudaLaunchKernelEx(&cfg, fm_logits_bf16_kernel<3>, *p, kc));
        FM_CU_LAUNCH("fm_logits_bf16_kernel");
    } else {
        FM_CU(cudaLaunchKernelEx(&cfg, fm_logits_mma_kernel, *p, kc));
        FM_CU_LAUNCH("fm_logits_mma_kernel");
    }
    return FM_OK;
}

/* The tokens' prep alone (the pre-routed path). */
extern "C" fm_status fm_cuda_launch_prep(const fm_route_params *p, int pdl, cudaStream_t s) {
    cudaLaunchAttribute attr[1];
    cudaLaunchConfig_t cfg = route_cfg(s, pdl, attr);
    const int64_t groups = (int64_t)p->T * (p->Hp / 8);
    int64_t blocks = (groups + 2 * RT_THREADS - 1) / (2 * RT_THREADS);
    const int64_t cap = 4 * (int64_t)(p->sms > 0 ? p->sms : 132);
    if (blocks > cap) blocks = cap;
    cfg.gridDim = dim3((unsigned)blocks);
    FM_CU(cudaLaunchKernelEx(&cfg, fm_prep_kernel, *p));
    FM_CU_LAUNCH("fm_prep_kernel");
    return FM_OK;
}
