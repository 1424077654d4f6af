/*
 * Routing and token -> expert grouping on the GPU: two launches per layer.
 *
 * 1. Router logits in FP32 as partial sums over K slices, by a grid wide
 *    enough to keep the router's bytes in flight at every batch size (a GEMV
 *    shape for few tokens, a register-tiled SGEMM for many).
 *    Both shapes also zero the tokens' output rows and write the tokens'
 *    activations in the layout the expert kernels read (BF16, scaled by
 *    2^7, K permuted; see expert.cu), one expert tile per K slice.
 * 2. One warp per token adds the slices, computes the family's scores, the
 *    group limit and the top-k exactly as fm_route does (ties go to the lower
 *    expert index, ids sorted ascending); the kernel is a template on the
 *    routing family, so that it holds one family's code. The last block to
 *    finish (a counter in global memory) groups the T*k (token, slot) pairs
 *    by expert: counts, prefix sums, the list of active experts, the scatter.
 *    When one block selects every token and T*k <= 32 (batch <= 4), one warp
 *    groups the pairs in registers instead, and so does the last block's
 *    first warp up to 64 pairs (a bitonic sort over the warp, v64). With FP4MOE_CUDA_ROUTE_FUSE=1 the
 *    selection of up to 32 tokens runs in the tail of the GEMV logits kernel
 *    (one launch; measured no faster, so off by default).
 * Nothing here waits on the host, so a whole step can be one CUDA graph.
 */
#include "cuda_internal.h"
#include "route_shape.h"
#include <string.h>
#include <stdlib.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>

#define RT_THREADS 256
#define RT_WARPS (RT_THREADS / 32)
#define RT_MAXK 32
#define RS_WARPS_MAX 8 /* tokens per selection block: 4, or 8 (FP4MOE_CUDA_SEL_WARPS) */
#define SEL_RC 4   /* 128-expert chunks of top-k keys a selection lane holds in registers (E <= 512) */
#define SEL_RB 2   /* 128-expert chunks of biases a selection lane holds in registers */
#define RS_THREADS_MAX (RS_WARPS_MAX * 32)
#define GB 8      /* pairs per thread and round in the grouping */

static __device__ __forceinline__ void pdl_wait(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
static __device__ __forceinline__ void prefetch_l2_line(const void *q) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(q));
}
/* The router rows are read once per layer: with p.l2first, at L2's
 * evict-first priority (as the expert weights, expert.cu), under a policy
 * each thread creates once (router_policy). */
static __device__ __forceinline__ uint64_t router_policy(void) {
    uint64_t pol;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}
static __device__ __forceinline__ float4 ld_router4(const float *q, int first, uint64_t pol) {
    float4 r;
    if (first)
        asm("ld.global.nc.L2::cache_hint.v4.f32 {%0,%1,%2,%3}, [%4], %5;"
            : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w)
            : "l"(q), "l"(pol));
    else
        r = __ldg((const float4 *)q);
    return r;
}
static __device__ __forceinline__ void pdl_launch_dependents(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* Block-wide exclusive scan of one int per thread; returns the total. */
static __device__ int block_exscan(int v, int *excl, int *warp_tot) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int inc = v;
    for (int o = 1; o < 32; o <<= 1) {
        int n = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += n;
    }
    if (lane == 31) warp_tot[w] = inc;
    __syncthreads();
    int base = 0, total = 0;
    for (int i = 0; i < (int)(blockDim.x >> 5); i++) {
        if (i < w) base += warp_tot[i];
        total += warp_tot[i];
    }
    *excl = base + inc - v;
    __syncthreads();
    return total;
}

/* Warp arg-max over sel[0..n) skipping taken[]: larger value wins, ties go to
 * the lower index; NaN never wins; when nothing is left but NaN the lowest
 * free index is returned. */
static __device__ int warp_argmax(const float *sel, const unsigned char *taken, int n) {
    int lane = threadIdx.x & 31;
    float best = -INFINITY;
    int bi = 0x7fffffff, firstfree = 0x7fffffff;
    for (int e = lane; e < n; e += 32) {
        if (taken[e]) continue;
        if (e < firstfree) firstfree = e;
        float v = sel[e];
        if (v > best || (v == best && e < bi)) { best = v; bi = e; }
    }
    for (int o = 16; o; o >>= 1) {
        float ob = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        int of = __shfl_xor_sync(0xffffffffu, firstfree, o);
        if (oi != 0x7fffffff && (bi == 0x7fffffff || ob > best || (ob == best && oi < bi))) { best = ob; bi = oi; }
        if (of < firstfree) firstfree = of;
    }
    return bi != 0x7fffffff ? bi : firstfree;
}


/* Row stride of the partial logits and of the selection's per-expert
 * arrays: E rounded up to 4, so that a lane moves 4 experts at a time. */
static __host__ __device__ __forceinline__ int lg_stride(int E) { return (E + 3) & ~3; }

/* An unsigned key that orders scores as floats do (-0 as +0), above 0 for
 * every score; NaN gets 1, below -inf. */
static __device__ __forceinline__ unsigned score_key(float f) {
    if (f != f) return 1u;
    const unsigned b = __float_as_uint(f + 0.0f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
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
 * position m holding element perm[m] (expert.cu's K order). */
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
 * many tokens: a register-tiled SGEMM, 64 tokens x 64 experts per block,
 *   4 x 4 outputs per thread from k-major shared tiles (2 LDS.128 per 16
 *   FMA), K split so that the grid fills the SMs about four blocks deep.
 */
#define LG_SMALL_T FM_LG_SMALL_T
#define LG_KC 512          /* K slice of the GEMV shape                      */
#define LG_TT 8            /* tokens per GEMV block                          */
#define LG_EW 2            /* router rows per warp (GEMV)                    */
#define LG_TILE FM_LG_TILE /* tokens and experts per SGEMM block             */
#define LG_KSTEP 16        /* K per shared-memory stage (SGEMM)              */

static __host__ __device__ size_t sel_warp_bytes(int E);
template <int RK>
static __device__ void select_token(const fm_route_params &p, int t, unsigned char *ws, int *chosen,
                                    float *chosen_w = NULL);
static __device__ void select_token_rt(const fm_route_params &p, int t, unsigned char *ws, int *chosen);
static __device__ void group_pairs(const fm_route_params &p, unsigned char *smem, int *warp_tot, unsigned *done);

/* Block counters of the fused GEMV shape (p.fuse): done[1 + z] counts the
 * finished blocks of token tile z, done[FM_DONE_TILES] the selected tiles;
 * done[0] is the selection kernel's. */
#define FM_DONE_TILES (1 + LG_SMALL_T / LG_TT)
static_assert(FM_DONE_TILES < FM_ROUTE_COUNTERS, "routing block counters");

/* The shape decision is route_shape.c's, which `fp4moe explain` shares. */
#define LG_GEMV_MAX FM_LG_GEMV_MAX

__global__ void __launch_bounds__(RT_THREADS) fm_logits_gemv_kernel(fm_route_params p) {
    const uint64_t rpol = router_policy();
    __shared__ __align__(16) float xs[LG_TT][LG_KC];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int e0 = (blockIdx.x * RT_WARPS + warp) * LG_EW, k0 = blockIdx.y * LG_KC, t0 = blockIdx.z * LG_TT;
    const int H = p.H, E = p.E, T = p.T;
    /* the router rows are written by no kernel of the stream that triggers
     * its dependents early, so they are read before waiting on the previous
     * layer (their latency hides under its tail) */
    float4 w[LG_EW][LG_KC / 128];
#pragma unroll
    for (int a = 0; a < LG_EW; a++)
#pragma unroll
        for (int it = 0; it < LG_KC / 128; it++) {
            int k = k0 + it * 128 + lane * 4;
            w[a][it] = e0 + a < E && k < H ? ld_router4(p.router_w + (size_t)(e0 + a) * H + k, p.l2first, rpol)
                                           : make_float4(0, 0, 0, 0);
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
    if (!p.fuse) return;

    /* Fused selection (few tokens): the last block of a token tile to finish
     * its partial logits selects the tile's tokens (one warp each), and the
     * last tile to be selected groups the pairs, so that routing is one
     * launch and one grid-completion wait instead of two. */
    extern __shared__ __align__(16) unsigned char rs_smem[];
    __shared__ int chosen[RT_WARPS][RT_MAXK];
    __shared__ int warp_tot[RT_WARPS];
    __shared__ unsigned is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(&p.done[1 + blockIdx.z], 1u) == gridDim.x * gridDim.y - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    if (t0 + warp < T) select_token_rt(p, t0 + warp, rs_smem + (size_t)warp * sel_warp_bytes(E), chosen[warp]);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        p.done[1 + blockIdx.z] = 0;
        is_last = gridDim.z == 1 || atomicAdd(&p.done[FM_DONE_TILES], 1u) == gridDim.z - 1;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    group_pairs(p, rs_smem, warp_tot, &p.done[FM_DONE_TILES]);
}

/* The expert tiles of each (token tile, K slice) of the SGEMM shapes also
 * write the tokens' copy for the experts and zero their output, as the GEMV
 * shape does, so that the selection warps stream nothing per token (one
 * warp copying a 4096-wide row was a chain of 16 dependent loads); the last
 * slice also writes the zero padding up to Hp. The work is spread over the
 * gridDim.y expert tiles (v24: the first tile alone did it before, a chain
 * of dependent loads per thread that held those blocks long after the
 * others) and each thread loads two 8-element groups before it stores. */
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
    if (!p.skip_prep) tile_prep(p, t0, kbeg, kend);
}

/* The tokens' prep alone (FM_ROUTE_PART_PREP): x_prep and the zeroed output
 * of every token, so that the shared expert, which needs nothing else, can
 * start before the logits. One 8-element group per thread and round, two
 * groups' loads in flight. */
__global__ void __launch_bounds__(RT_THREADS) fm_prep_kernel(fm_route_params p) {
    pdl_wait();
    pdl_launch_dependents();
    prep_groups(p, 0, p.T, 0, p.Hp / 8, blockIdx.x * RT_THREADS + threadIdx.x, gridDim.x * RT_THREADS);
}

__global__ void __launch_bounds__(RT_THREADS) fm_logits_tile_kernel(fm_route_params p, int kc) {
    const uint64_t rpol = router_policy();
    __shared__ __align__(16) float xs[LG_KSTEP][LG_TILE + 4];
    __shared__ __align__(16) float ws[LG_KSTEP][LG_TILE + 4];
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int H = p.H, E = p.E, T = p.T;
    int t0, e0, kbeg, kend;
    tile_start(p, kc, t0, e0, kbeg, kend);
    /* loader: row r of the tile, 4 K values at c */
    const int lr = tid >> 2, lc = (tid & 3) * 4;
    const bool xok = t0 + lr < T, wok = e0 + lr < E;
    float acc[4][4] = {};
    float4 xr = make_float4(0, 0, 0, 0), wr = make_float4(0, 0, 0, 0);
    if (kbeg + lc < kend) {
        if (xok) xr = load_x4(p.x, p.xdt, (size_t)(t0 + lr) * H + kbeg + lc);
        if (wok) wr = ld_router4(p.router_w + (size_t)(e0 + lr) * H + kbeg + lc, p.l2first, rpol);
    }
    for (int kb = kbeg; kb < kend; kb += LG_KSTEP) {
        xs[lc][lr] = xr.x; xs[lc + 1][lr] = xr.y; xs[lc + 2][lr] = xr.z; xs[lc + 3][lr] = xr.w;
        ws[lc][lr] = wr.x; ws[lc + 1][lr] = wr.y; ws[lc + 2][lr] = wr.z; ws[lc + 3][lr] = wr.w;
        __syncthreads();
        /* next stage's loads fly during this stage's FMAs */
        const int kn = kb + LG_KSTEP + lc;
        xr = make_float4(0, 0, 0, 0);
        wr = make_float4(0, 0, 0, 0);
        if (kn < kend) {
            if (xok) xr = load_x4(p.x, p.xdt, (size_t)(t0 + lr) * H + kn);
            if (wok) wr = ld_router4(p.router_w + (size_t)(e0 + lr) * H + kn, p.l2first, rpol);
        }
#pragma unroll
        for (int kk = 0; kk < LG_KSTEP; kk++) {
            float4 xv = *(const float4 *)&xs[kk][ty * 4];
            float4 wv = *(const float4 *)&ws[kk][tx * 4];
            float xa[4] = {xv.x, xv.y, xv.z, xv.w}, wa[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(xa[i], wa[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int t = t0 + ty * 4 + i;
        if (t >= T) continue;
        float *dst = p.logits + ((size_t)blockIdx.z * T + t) * lg_stride(E);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int e = e0 + tx * 4 + j;
            if (e < E) dst[e] = acc[i][j];
        }
    }
}

/*
 * The SGEMM shape on tensor cores (sm_80 and later, the default; v24): the
 * same 64 x 64 tiles, K slices and outputs as fm_logits_tile_kernel, the
 * products by mma.sync m16n8k8 TF32 in three terms, x_hi w_hi + x_hi w_lo +
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

/* Four BF16 router weights (v45), as ld_router4 reads four FP32 ones. */
static __device__ __forceinline__ uint2 ld_router_bf4(const uint16_t *q, int first, uint64_t pol) {
    uint2 r;
    if (first)
        asm("ld.global.nc.L2::cache_hint.v2.u32 {%0,%1}, [%2], %3;" : "=r"(r.x), "=r"(r.y) : "l"(q), "l"(pol));
    else
        r = __ldg((const uint2 *)q);
    return r;
}

/* The tensor-core logits kernels' loader: a thread's four 4-wide pieces of
 * one 64-K stage from K kb (rows lr and lr + 32 of each tile, K at lc and
 * lc + 32): the tokens' activations as FP32, the router rows as FP32 or
 * (v45) BF16, zeros past the tile's tokens, experts and K slice. */
static __device__ __forceinline__ void tile_w4(const fm_route_params &p, int e, int k, int kend, uint64_t pol,
                                               float4 &w) {
    w = e < p.E && k < kend ? ld_router4(p.router_w + (size_t)e * p.H + k, p.l2first, pol) : make_float4(0, 0, 0, 0);
}
static __device__ __forceinline__ void tile_w4(const fm_route_params &p, int e, int k, int kend, uint64_t pol,
                                               uint2 &w) {
    w = e < p.E && k < kend ? ld_router_bf4(p.router_wb + (size_t)e * p.H + k, p.l2first, pol) : make_uint2(0, 0);
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
    const uint64_t rpol = router_policy();
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
 * v45: the SGEMM shape on BF16 tensor cores where the router is exact in
 * BF16 (p.router_wb; checkpoints store routers in BF16): each activation is
 * split into NT BF16 terms whose sum is exactly its value (one for BF16
 * input, two for F16, three for F32: 8 significant bits each), every
 * product of a term and a router weight is exact in FP32, and mma.sync
 * m16n8k16 BF16 accumulates them in FP32 — the FP32 router math of the
 * kernels above, with NT BF16 MMAs per 16 K instead of six TF32 ones and
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
    const uint64_t rpol = router_policy();
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



/* Per-warp shared memory of the selection kernel: lg, sel, wsc [E] floats
 * and taken [E] bytes, rounded to 16 bytes. */
static __host__ __device__ size_t sel_warp_bytes(int E) { return ((size_t)lg_stride(E) * 13 + 15) & ~(size_t)15; }

/* v[e .. e + 3], the values past E as 0 (the selection's bias quads) */
static __device__ __forceinline__ float4 ld_quad(const float *v, int e, int E) {
    float4 r = make_float4(v[e], 0.0f, 0.0f, 0.0f);
    if (e + 1 < E) r.y = v[e + 1];
    if (e + 2 < E) r.z = v[e + 2];
    if (e + 3 < E) r.w = v[e + 3];
    return r;
}

/* The bias quad of experts e .. e + 3 (e = 128 c + 4 lane): from the
 * registers rb where the lane holds chunk c (the first SEL_RB chunks),
 * else from v. */
static __device__ __forceinline__ float4 bias_quad(const float4 (&rb)[SEL_RB], const float *v, int e, int E) {
    const int c = e >> 7;
    float4 b = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int q = 0; q < SEL_RB; q++)
        if (q == c) b = rb[q];
    if (c >= SEL_RB) b = ld_quad(v, e, E);
    return b;
}

/*
 * Selection and grouping: one warp per token (4 or 8 tokens per block).
 * The warp adds the K slices of its token's logits in slice order, applies
 * the family's scores, the group limit and the top-k exactly as fm_route
 * (ties to the lower expert index, ids ascending) and writes its ids and
 * weights (the logits kernel already wrote the token's activations in the
 * experts' layout and zeroed its output row). The last block to finish (a counter in global memory) groups the T*k pairs by
 * expert: counts (shared atomics), scans, active list, scatter.
 */
/* Selection of token t by one warp (lane j < k writes the j-th id and
 * weight in ascending id order);
 * ws: the warp's sel_warp_bytes(E) of shared memory, chosen: [RT_MAXK].
 * chosen_w (or NULL): [RT_MAXK]; then chosen and chosen_w end up holding the
 * token's ids (ascending) and weights as written to ids / wts.
 * RK: the routing family (fm_route_kind), a template parameter so that each
 * kernel holds only its family's code. The selection runs on one warp: at
 * decode sizes its time is that warp's chain of dependent loads and
 * reductions (docs/perf.md, v29; instruction fetch was ruled out, v29b). */
template <int RK>
static __device__ void select_scores(const fm_route_params &p, int t, unsigned char *ws) {
    const int E = p.E, Ep = lg_stride(E);
    const int lane = threadIdx.x & 31;
    const int T = p.T;
    /* A lane owns experts 128 c + 4 lane .. + 3 (chunks c of 128): every
     * step below moves four experts with one 16-byte access, and the loops
     * are short. */
    float *lg = (float *)ws;  /* [Ep] logits          */
    float *sel = lg + Ep;     /* [Ep] selection score, then the top-k keys */
    float *wsc = sel + Ep;    /* [Ep] weight score, then [Ep] bytes of group flags (select_pick) */
        /* The biases of the lane's first SEL_RB chunks into registers first,
         * then the K slices in order, every slice of two chunks loaded before
         * the first add: one round trip to L2 per 8 slices instead of one per
         * load (v29: the dependent loads were 3 of the 7 us at B = 1) */
        const int nch = (E + 127) / 128;
        float4 sbias[SEL_RB], rbias[SEL_RB];
#pragma unroll
        for (int c = 0; c < SEL_RB; c++) {
            const int e = 128 * c + 4 * lane;
            sbias[c] = rbias[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (c < nch && e < E) {
                if (p.score_bias) sbias[c] = ld_quad(p.score_bias, e, E);
                if (p.router_bias) rbias[c] = ld_quad(p.router_bias, e, E);
            }
        }
#pragma unroll 1
        for (int c0 = 0; c0 < E; c0 += 256) {
            const int ea = c0 + 4 * lane, eb = ea + 128;
            float4 va = make_float4(0.0f, 0.0f, 0.0f, 0.0f), vb = va;
#pragma unroll 1
            for (int s0 = 0; s0 < p.kslices; s0 += 8) {
                float4 xa[8], xb[8];
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const bool in = s0 + j < p.kslices;
                    const size_t row = ((size_t)(s0 + j) * T + t) * Ep;
                    xa[j] = in && ea < E ? __ldcg((const float4 *)(p.logits + row + ea)) : make_float4(0, 0, 0, 0);
                    xb[j] = in && eb < E ? __ldcg((const float4 *)(p.logits + row + eb)) : make_float4(0, 0, 0, 0);
                }
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    if (s0 + j < p.kslices) {
                        va.x += xa[j].x; va.y += xa[j].y; va.z += xa[j].z; va.w += xa[j].w;
                        vb.x += xb[j].x; vb.y += xb[j].y; vb.z += xb[j].z; vb.w += xb[j].w;
                    }
                }
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int e = h ? eb : ea;
                float4 v = h ? vb : va;
                if (e < E) {
                    if (p.router_bias) {
                        const float4 b = bias_quad(rbias, p.router_bias, e, E);
                        v.x += b.x; v.y += b.y; v.z += b.z; v.w += b.w;
                    }
                    *(float4 *)&lg[e] = v;
                }
            }
        }
        __syncwarp();

        /* family scores (experts E .. Ep - 1 get scores too, never chosen) */
        if (RK == FM_ROUTE_SOFTMAX) {
            float m = -INFINITY;
            for (int e = 4 * lane; e < E; e += 128) {
                const float4 l = *(const float4 *)&lg[e];
                m = fmaxf(m, fmaxf(fmaxf(l.x, e + 1 < E ? l.y : -INFINITY),
                                   fmaxf(e + 2 < E ? l.z : -INFINITY, e + 3 < E ? l.w : -INFINITY)));
            }
            for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
            float sum = 0.0f;
            for (int e = 4 * lane; e < E; e += 128) {
                const float4 l = *(const float4 *)&lg[e];
                float4 x;
                x.x = expf(l.x - m);
                x.y = e + 1 < E ? expf(l.y - m) : 0.0f;
                x.z = e + 2 < E ? expf(l.z - m) : 0.0f;
                x.w = e + 3 < E ? expf(l.w - m) : 0.0f;
                sum += x.x + x.y + x.z + x.w;
                *(float4 *)&wsc[e] = x;
            }
            for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            for (int e = 4 * lane; e < E; e += 128) {
                float4 x = *(const float4 *)&wsc[e];
                x.x /= sum; x.y /= sum; x.z /= sum; x.w /= sum;
                *(float4 *)&wsc[e] = x;
                *(float4 *)&sel[e] = x;
            }
        } else if (RK == FM_ROUTE_GPTOSS) {
            for (int e = 4 * lane; e < E; e += 128) {
                const float4 l = *(const float4 *)&lg[e];
                *(float4 *)&sel[e] = l;
                *(float4 *)&wsc[e] = l;
            }
        } else {
            /* the chunks' expf / log1pf chains side by side */
#pragma unroll 4
            for (int e = 4 * lane; e < E; e += 128) {
                const float4 l = *(const float4 *)&lg[e];
                float4 sc;
                if (RK == FM_ROUTE_DSV4) {
                    sc.x = sqrtf(l.x > 20.0f ? l.x : log1pf(expf(l.x)));
                    sc.y = sqrtf(l.y > 20.0f ? l.y : log1pf(expf(l.y)));
                    sc.z = sqrtf(l.z > 20.0f ? l.z : log1pf(expf(l.z)));
                    sc.w = sqrtf(l.w > 20.0f ? l.w : log1pf(expf(l.w)));
                } else {
                    sc.x = 1.0f / (1.0f + expf(-l.x));
                    sc.y = 1.0f / (1.0f + expf(-l.y));
                    sc.z = 1.0f / (1.0f + expf(-l.z));
                    sc.w = 1.0f / (1.0f + expf(-l.w));
                }
                *(float4 *)&wsc[e] = sc;
                if (p.score_bias) {
                    const float4 b = bias_quad(sbias, p.score_bias, e, E);
                    sc.x += b.x; sc.y += b.y; sc.z += b.z; sc.w += b.w;
                }
                *(float4 *)&sel[e] = sc;
            }
        }
        __syncwarp();
}

/* The rest of token t's selection, on one warp, from the scores in ws
 * (select_scores or select_scores_block): the group limit, the top-k, the
 * weights, and the writes. */
template <int RK>
static __device__ void select_pick(const fm_route_params &p, int t, unsigned char *ws, int *chosen, float *chosen_w) {
    const int E = p.E, k = p.k, Ep = lg_stride(E);
    const int lane = threadIdx.x & 31;
    const int nch = (E + 127) / 128;
    float *lg = (float *)ws;
    float *sel = lg + Ep;
    float *wsc = sel + Ep;
    unsigned char *taken = (unsigned char *)(wsc + Ep);

        /* group limit (DeepSeek-V3 family): keep the topk_group groups with
         * the largest sum of their two best biased scores */
        if ((RK == FM_ROUTE_NOAUX_TC || RK == FM_ROUTE_DSV4) && p.n_group > 1 && p.topk_group > 0 &&
            p.topk_group < p.n_group) {
            for (int g = lane; g < p.n_group; g += 32) taken[g] = 0;
            int gs = E / p.n_group;
            float *gscore = lg; /* logits are no longer needed */
            for (int g = lane; g < p.n_group; g += 32) {
                float b1 = -INFINITY, b2 = -INFINITY;
                for (int e = g * gs; e < (g + 1) * gs; e++) {
                    float v = sel[e];
                    if (v > b1) { b2 = b1; b1 = v; } else if (v > b2) b2 = v;
                }
                gscore[g] = gs >= 2 ? b1 + b2 : b1;
            }
            __syncwarp();
            for (int j = 0; j < p.topk_group; j++) {
                int g = warp_argmax(gscore, taken, p.n_group);
                if (lane == 0) taken[g] = 1;
                __syncwarp();
            }
            for (int e = lane; e < E; e += 32)
                if (!taken[e / gs]) sel[e] = -INFINITY;
            __syncwarp();
        }

        if (p.hash) {
            int tok = p.token_ids[t];
            if (lane < k) chosen[lane] = p.tid2eid[(size_t)tok * k + lane];
        } else {
            /* top-k on order-preserving integer keys (sel becomes the keys):
             * per round each lane's best, then the warp's largest key and,
             * among equal keys, the lowest expert (two warp reductions); the
             * chosen key becomes 0, below every expert's. NaN scores rank
             * below -inf (chosen last, lowest index first), -0 equals +0. */
            if (nch <= SEL_RC) {
                /* the keys in registers (v29): per round each lane's best over
                 * its experts in ascending order, then the two reductions;
                 * no shared-memory round trip per round */
                unsigned kq[SEL_RC][4];
#pragma unroll
                for (int c = 0; c < SEL_RC; c++) {
                    const int e = 128 * c + 4 * lane;
                    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    if (c < nch && e < E) v = *(const float4 *)&sel[e];
                    kq[c][0] = c < nch && e < E ? score_key(v.x) : 0u;
                    kq[c][1] = c < nch && e + 1 < E ? score_key(v.y) : 0u;
                    kq[c][2] = c < nch && e + 2 < E ? score_key(v.z) : 0u;
                    kq[c][3] = c < nch && e + 3 < E ? score_key(v.w) : 0u;
                }
#pragma unroll 1
                for (int j = 0; j < k; j++) {
                    unsigned best = 0u, be = 0xffffffffu;
#pragma unroll
                    for (int c = 0; c < SEL_RC; c++)
#pragma unroll
                        for (int i = 0; i < 4; i++)
                            if (kq[c][i] > best) { best = kq[c][i]; be = 128 * c + 4 * lane + i; }
                    const unsigned m = __reduce_max_sync(0xffffffffu, best);
                    const unsigned w = __reduce_min_sync(0xffffffffu, best == m ? be : 0xffffffffu);
#pragma unroll
                    for (int c = 0; c < SEL_RC; c++)
#pragma unroll
                        for (int i = 0; i < 4; i++)
                            if ((unsigned)(128 * c + 4 * lane + i) == w) kq[c][i] = 0u;
                    if (lane == 0) chosen[j] = (int)w;
                }
            } else {
                unsigned *key = (unsigned *)sel;
                for (int e = 4 * lane; e < E; e += 128) {
                    const float4 v = *(const float4 *)&sel[e];
                    uint4 q;
                    q.x = score_key(v.x);
                    q.y = e + 1 < E ? score_key(v.y) : 0u;
                    q.z = e + 2 < E ? score_key(v.z) : 0u;
                    q.w = e + 3 < E ? score_key(v.w) : 0u;
                    *(uint4 *)&key[e] = q;
                }
                __syncwarp();
#pragma unroll 1
                for (int j = 0; j < k; j++) {
                    unsigned best = 0u, be = 0xffffffffu;
                    for (int e = 4 * lane; e < E; e += 128) {
                        const uint4 q = *(const uint4 *)&key[e];
                        if (q.x > best) { best = q.x; be = e; }
                        if (q.y > best) { best = q.y; be = e + 1; }
                        if (q.z > best) { best = q.z; be = e + 2; }
                        if (q.w > best) { best = q.w; be = e + 3; }
                    }
                    const unsigned m = __reduce_max_sync(0xffffffffu, best);
                    const unsigned w = __reduce_min_sync(0xffffffffu, best == m ? be : 0xffffffffu);
                    if (lane == ((w & 127u) >> 2)) key[w] = 0u;
                    if (lane == 0) chosen[j] = (int)w;
                    __syncwarp();
                }
            }
        }
        __syncwarp();
        /* lane j < k holds the j-th choice; its place among the ids
         * ascending (ties, possible only with hash routing, by choice
         * order), then the family's weights as fm_route computes them */
        const bool mine = lane < k;
        const int myid = mine ? chosen[lane] : 0x7fffffff;
        int rank = 0;
#pragma unroll 1
        for (int j = 0; j < k; j++) {
            int o = __shfl_sync(0xffffffffu, myid, j);
            rank += o < myid || (o == myid && j < lane);
        }
        float v = mine ? wsc[myid] : 0.0f, w;
        if (RK == FM_ROUTE_GPTOSS) {
            float m = mine ? v : -INFINITY;
            for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
            float ex = mine ? expf(v - m) : 0.0f, sum = ex;
            for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            w = ex / sum;
        } else {
            /* as fm_route: softmax renormalizes when norm_topk_prob;
             * noaux_tc when norm_topk_prob and DeepSeek-V4 always, with
             * 1e-20 added to the sum, then the scaling factor */
            float sum = v;
            for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            w = v;
            if (RK == FM_ROUTE_SOFTMAX) {
                if (p.norm_topk) w = v / sum;
            } else {
                if (p.norm_topk || RK == FM_ROUTE_DSV4) w = v / (sum + 1e-20f);
                w *= p.scaling;
            }
        }
        __syncwarp();
        if (mine) {
            p.ids[(size_t)t * k + rank] = myid;
            p.wts[(size_t)t * k + rank] = w;
            if (chosen_w) {
                chosen[rank] = myid;
                chosen_w[rank] = w;
            }
        }
        __syncwarp();
}

template <int RK>
static __device__ void select_token(const fm_route_params &p, int t, unsigned char *ws, int *chosen, float *chosen_w) {
    select_scores<RK>(p, t, ws);
    select_pick<RK>(p, t, ws, chosen, chosen_w);
}

/* Families whose scores are elementwise (no reduction over the experts):
 * the one-token selection can spread them over the block (v50). */
template <int RK> struct sel_elementwise { static constexpr bool value = RK == FM_ROUTE_NOAUX_TC || RK == FM_ROUTE_DSV4; };

/*
 * v50: the slice sums and scores of token t by n threads (i: this
 * thread's index among them), two experts per thread and round: at T = 1
 * the block's threads, at T = 2 half of them each (the one-warp
 * selection works through 4 E / 128 experts per lane in series: at
 * DeepSeek-V4-Flash's 256 experts, 8). The same sums in the same order and
 * the same expressions as select_scores, so the scores are bit-identical;
 * the caller synchronizes the block, then one warp runs select_pick. Each
 * thread's bias loads are issued with its slices' loads.
 */
template <int RK>
static __device__ void select_scores_block(const fm_route_params &p, int t, unsigned char *ws, int i, int n) {
    const int E = p.E, Ep = lg_stride(E), T = p.T;
    float *sel = (float *)ws + Ep;
    float *wsc = sel + Ep;
    for (int e = 2 * i; e < E; e += 2 * n) {
        const bool two = e + 1 < E;
        /* the biases first: their loads and the slices' are in flight together */
        float rb[2] = {0.0f, 0.0f}, sb[2] = {0.0f, 0.0f};
#pragma unroll
        for (int h = 0; h < 2; h++)
            if (!h || two) {
                if (p.router_bias) rb[h] = p.router_bias[e + h];
                if (p.score_bias) sb[h] = p.score_bias[e + h];
            }
        float2 v = make_float2(0.0f, 0.0f);
#pragma unroll 1
        for (int s0 = 0; s0 < p.kslices; s0 += 16) {
            float2 x[16];
#pragma unroll
            for (int j = 0; j < 16; j++) {
                const size_t row = ((size_t)(s0 + j) * T + t) * Ep;
                x[j] = s0 + j < p.kslices ? (two ? __ldcg((const float2 *)(p.logits + row + e))
                                                 : make_float2(__ldcg(p.logits + row + e), 0.0f))
                                          : make_float2(0.0f, 0.0f);
            }
#pragma unroll
            for (int j = 0; j < 16; j++)
                if (s0 + j < p.kslices) { v.x += x[j].x; v.y += x[j].y; }
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            if (h && !two) break;
            float l = h ? v.y : v.x;
            if (p.router_bias) l += rb[h];
            float sc;
            if (RK == FM_ROUTE_DSV4) sc = sqrtf(l > 20.0f ? l : log1pf(expf(l)));
            else sc = 1.0f / (1.0f + expf(-l));
            wsc[e + h] = sc;
            if (p.score_bias) sc += sb[h];
            sel[e + h] = sc;
        }
    }
}

static __device__ void select_token_rt(const fm_route_params &p, int t, unsigned char *ws, int *chosen) {
    switch (p.route) {
    case FM_ROUTE_SOFTMAX: select_token<FM_ROUTE_SOFTMAX>(p, t, ws, chosen); break;
    case FM_ROUTE_GPTOSS: select_token<FM_ROUTE_GPTOSS>(p, t, ws, chosen); break;
    case FM_ROUTE_DSV4: select_token<FM_ROUTE_DSV4>(p, t, ws, chosen); break;
    default: select_token<FM_ROUTE_NOAUX_TC>(p, t, ws, chosen); break;
    }
}

/* Groups the T*k pairs by expert (one block, after every token's
 * selection): counts (shared atomics), scans, active list, scatter; then
 * resets the block counter that elected this block. smem: 12 E bytes. */
static __device__ void group_pairs(const fm_route_params &p, unsigned char *smem, int *warp_tot, unsigned *done) {
    const int E = p.E, k = p.k, T = p.T;
    const int tid = threadIdx.x, nth = blockDim.x;
    int *cnt = (int *)smem;  /* [E] (reuses the score arrays) */
    int *off = cnt + E;         /* [E] */
    int *cur = off + E;         /* [E] */
    const int n = T * k;
    for (int e = tid; e < E; e += nth) { cnt[e] = 0; cur[e] = 0; }
    __syncthreads();
    /* GB pairs per thread per round: their loads are issued together, so a
     * round costs one L2 latency (one block does this for the whole grid) */
    for (int i0 = 0; i0 < n; i0 += nth * GB) {
        int ev[GB];
#pragma unroll
        for (int j = 0; j < GB; j++) {
            int i = i0 + j * nth + tid;
            ev[j] = i < n ? __ldcg(&p.ids[i]) : -1;
        }
#pragma unroll
        for (int j = 0; j < GB; j++)
            if (ev[j] >= 0) atomicAdd(&cnt[ev[j]], 1);
    }
    __syncthreads();
    /* each thread owns a run of consecutive experts */
    const int per = (E + nth - 1) / nth;
    int e0 = tid * per, e1 = min(E, e0 + per);
    int mysum = 0, myact = 0;
    for (int e = e0; e < e1; e++) { mysum += cnt[e]; myact += cnt[e] > 0; }
    int base, abase;
    block_exscan(mysum, &base, warp_tot);
    int n_act = block_exscan(myact, &abase, warp_tot);
    for (int e = e0; e < e1; e++) {
        off[e] = base;
        if (cnt[e] > 0) {
            p.act_e[abase] = e;
            p.act_off[abase] = base;
            p.act_cnt[abase] = cnt[e];
            abase++;
        }
        base += cnt[e];
    }
    __syncthreads();
    for (int i0 = 0; i0 < n; i0 += nth * GB) {
        int ev[GB];
        float wv[GB];
#pragma unroll
        for (int j = 0; j < GB; j++) {
            int i = i0 + j * nth + tid;
            ev[j] = i < n ? __ldcg(&p.ids[i]) : -1;
            wv[j] = i < n ? __ldcg(&p.wts[i]) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < GB; j++)
            if (ev[j] >= 0) {
                int i = i0 + j * nth + tid;
                int pos = off[ev[j]] + atomicAdd(&cur[ev[j]], 1);
                p.sorted_tok[pos] = i / k;
                p.sorted_w[pos] = wv[j];
            }
    }
    if (tid == 0) {
        *p.n_active = n_act;
        if (p.stat_active) *p.stat_active = n_act;
        *done = 0;
    }
}

/*
 * Grouping by one warp in registers (v64), for up to 32 Q pairs: pair i =
 * (token i / k, slot i % k) is lane i % 32's q = i / 32. Each pair gets the
 * key expert << 11 | token << 5 | slot (tokens < 64, slots < 32: unique), a
 * bitonic sort over the warp puts the pairs in expert-major order with the
 * tokens of an expert ascending (position = the pair's place), and the
 * experts' runs, their offsets and counts come from ballots of the run
 * starts: log2(32 Q) (log2(32 Q) + 1) / 2 compare-exchange steps instead of
 * the 2 n shuffles per lane of counting smaller keys one by one (v10: 1.3
 * - 1.5 µs at 24 pairs; the block-wide grouping of 48 pairs, 4 µs). Same
 * outputs as group_pairs, with the tokens of an expert in ascending order.
 */
template <int Q>
static __device__ void group_pairs_sorted(const fm_route_params &p, const int (&idv)[Q], const float (&wv)[Q]) {
    const int k = p.k, n = p.T * p.k, lane = threadIdx.x & 31;
    unsigned key[Q];
    float w[Q];
#pragma unroll
    for (int q = 0; q < Q; q++) {
        const int i = lane + 32 * q;
        key[q] = i < n ? (unsigned)idv[q] << 11 | (unsigned)(i / k) << 5 | (unsigned)(i % k) : 0xffffffffu;
        w[q] = i < n ? wv[q] : 0.0f;
    }
    /* bitonic sort of the 32 Q keys, ascending by position q * 32 + lane */
#pragma unroll
    for (int size = 2; size <= 32 * Q; size <<= 1) {
#pragma unroll
        for (int j = size >> 1; j > 0; j >>= 1) {
            if (j == 32) {
                /* Q = 2, size 64: one ascending block, the partner the same
                 * lane's other register, register 0 the lower position */
                if (key[0] > key[Q - 1]) {
                    const unsigned tk = key[0];
                    key[0] = key[Q - 1];
                    key[Q - 1] = tk;
                    const float tw = w[0];
                    w[0] = w[Q - 1];
                    w[Q - 1] = tw;
                }
                continue;
            }
#pragma unroll
            for (int q = 0; q < Q; q++) {
                /* ascending where bit `size` of the position is 0; the
                 * lower position of a pair keeps the smaller key there */
                const bool up = ((q * 32 + lane) & size) == 0, lo = (lane & j) == 0;
                const unsigned ok = __shfl_xor_sync(0xffffffffu, key[q], j);
                const float ow = __shfl_xor_sync(0xffffffffu, w[q], j);
                if (up == lo ? ok < key[q] : ok > key[q]) {
                    key[q] = ok;
                    w[q] = ow;
                }
            }
        }
    }
    /* runs of one expert: a run starts where the expert differs from the
     * position before */
    unsigned first[Q];
    int nact = 0;
#pragma unroll
    for (int q = 0; q < Q; q++) {
        const int pos = q * 32 + lane;
        unsigned prev = __shfl_up_sync(0xffffffffu, key[q], 1);
        /* lane 0's predecessor is lane 31 of the register before */
        const unsigned wrap = __shfl_sync(0xffffffffu, key[q > 0 ? q - 1 : 0], 31);
        if (lane == 0) prev = q > 0 ? wrap : 0xffffffffu;
        const bool start = pos < n && (pos == 0 || (prev >> 11) != (key[q] >> 11));
        first[q] = __ballot_sync(0xffffffffu, start);
        nact += __popc(first[q]);
    }
#pragma unroll
    for (int q = 0; q < Q; q++) {
        const int pos = q * 32 + lane;
        if (pos >= n) continue;
        const int tok = (int)(key[q] >> 5 & 63u);
        p.sorted_tok[pos] = tok;
        p.sorted_w[pos] = w[q];
        if (!(first[q] >> lane & 1u)) continue;
        /* this run's index: the starts before it; its count: up to the next
         * start or n */
        int aidx = __popc(first[q] & ((1u << lane) - 1u));
        for (int r = 0; r < q; r++) aidx += __popc(first[r]);
        int next = n;
        const unsigned above = lane == 31 ? 0u : first[q] & ~((2u << lane) - 1u);
        if (above) next = q * 32 + __ffs(above) - 1;
        else
            for (int r = q + 1; r < Q; r++)
                if (first[r]) {
                    next = r * 32 + __ffs(first[r]) - 1;
                    break;
                }
        p.act_e[aidx] = (int)(key[q] >> 11);
        p.act_off[aidx] = pos;
        p.act_cnt[aidx] = next - pos;
    }
    if (lane == 0) {
        *p.n_active = nact;
        if (p.stat_active) *p.stat_active = nact;
    }
}

/* The same for up to 12 pairs (v10): a pair's place is the number of pairs
 * with a smaller (expert, token) key, counted one pair at a time, 3 n
 * shuffles per lane, fewer than the sort's 30 where n is this small (one or
 * two tokens). */
static __device__ void group_pairs_count(const fm_route_params &p, int id, float w) {
    const int k = p.k, n = p.T * p.k, lane = threadIdx.x & 31;
    const bool have = lane < n;
    const int tok = have ? lane / k : 0;
    /* (expert, token) as one 32-bit key; keys can repeat (a hash-routing
     * table may name an expert twice for a token): equal keys are ordered by
     * lane, so every pair gets its own place */
    const unsigned key = (unsigned)id * 64u + (unsigned)tok;
    int rank = 0, cnt = 0, before_in_e = 0;
#pragma unroll 4
    for (int j = 0; j < n; j++) {
        unsigned kj = __shfl_sync(0xffffffffu, key, j);
        int idj = __shfl_sync(0xffffffffu, id, j);
        const bool before = kj < key || (kj == key && j < lane);
        rank += before;
        cnt += idj == id;
        before_in_e += idj == id && before;
    }
    const bool first = have && before_in_e == 0;
    const unsigned firsts = __ballot_sync(0xffffffffu, first);
    int aidx = 0;
#pragma unroll 4
    for (int j = 0; j < n; j++) {
        int idj = __shfl_sync(0xffffffffu, id, j);
        aidx += ((firsts >> j) & 1u) && idj < id;
    }
    if (have) {
        p.sorted_tok[rank] = tok;
        p.sorted_w[rank] = w;
        if (first) {
            p.act_e[aidx] = id;
            p.act_off[aidx] = rank;
            p.act_cnt[aidx] = cnt;
        }
    }
    if (lane == 0) {
        *p.n_active = __popc(firsts);
        if (p.stat_active) *p.stat_active = __popc(firsts);
    }
}

/* One block selected every token (T * k <= 32): its first warp groups the
 * pairs from the block's picks. */
static __device__ void group_pairs_warp(const fm_route_params &p, int chosen[][RT_MAXK], float chosen_w[][RT_MAXK]) {
    const int k = p.k, n = p.T * p.k, lane = threadIdx.x & 31;
    const bool have = lane < n;
    const int idv[1] = {have ? chosen[lane / k][lane % k] : 0x7fffffff};
    const float wv[1] = {have ? chosen_w[lane / k][lane % k] : 0.0f};
    if (n <= 12) group_pairs_count(p, idv[0], wv[0]);
    else group_pairs_sorted<1>(p, idv, wv);
}

/* The last block of several, T * k <= 64 (v64): its first warp reads every
 * pair the blocks wrote (one L2 round trip), groups them in registers and
 * resets the block counter, instead of the block-wide counts and scans. */
static __device__ void group_pairs_last_warp(const fm_route_params &p, unsigned *done) {
    const int n = p.T * p.k, lane = threadIdx.x & 31;
    int idv[2];
    float wv[2];
#pragma unroll
    for (int q = 0; q < 2; q++) {
        const int i = lane + 32 * q;
        idv[q] = i < n ? __ldcg(&p.ids[i]) : 0;
        wv[q] = i < n ? __ldcg(&p.wts[i]) : 0.0f;
    }
    group_pairs_sorted<2>(p, idv, wv);
    if (lane == 0) *done = 0;
}

template <int RK>
__global__ void __launch_bounds__(RS_THREADS_MAX) fm_route_kernel(fm_route_params p) {
    extern __shared__ __align__(16) unsigned char rs_smem[];
    const int E = p.E, T = p.T;
    const int tid = threadIdx.x, warp = tid >> 5;
    const int wpb = blockDim.x >> 5, nth = blockDim.x; /* tokens and threads per block */
    const int t = blockIdx.x * wpb + warp;
    __shared__ int chosen[RS_WARPS_MAX][RT_MAXK];
    __shared__ float chosen_w[RS_WARPS_MAX][RT_MAXK];
    __shared__ int warp_tot[RT_WARPS];
    __shared__ unsigned is_last;
    /* the biases are written by no kernel: ask L2 for them before waiting */
    for (int e = tid * 32; e < E; e += nth * 32) {
        if (p.score_bias) prefetch_l2_line(p.score_bias + e);
        if (p.router_bias) prefetch_l2_line(p.router_bias + e);
    }
    /* the expert kernels may start now: they only prefetch weights before
     * their own wait on this grid */
    if (p.early_trigger == 1) pdl_launch_dependents();
    const bool small = p.warp_group && gridDim.x == 1 && T * p.k <= 32;
    pdl_wait();
    if (p.early_trigger == 2) pdl_launch_dependents();
    /* the experts' gate/up completion counters (v42) start from zero: the
     * previous layer's down, their last reader, finished before the logits
     * kernel this grid waited on */
    if (p.gu_done)
        for (int e = blockIdx.x * nth + tid; e < E; e += gridDim.x * nth) p.gu_done[e] = 0;
    if (sel_elementwise<RK>::value && small && T <= p.sel_spread) {
        /* v50: one or two tokens, their sums and scores over the whole block
         * (wpb / T warps per token), then the first warp of each token's
         * picks its top-k into chosen[t]. Where the shared expert has its
         * own branch the expert kernels may launch from the wait above on
         * (v50b); launched only after this selection, Kimi-K2's B = 1
         * measured +6 us */
        const int wpt = wpb / T, tt = warp / wpt;
        unsigned char *ws = rs_smem + (size_t)tt * sel_warp_bytes(E);
        select_scores_block<RK>(p, tt, ws, tid - tt * wpt * 32, wpt * 32);
        __syncthreads();
        if (warp == tt * wpt) select_pick<RK>(p, tt, ws, chosen[tt], chosen_w[tt]);
    } else if (t < T) {
        select_token<RK>(p, t, rs_smem + (size_t)warp * sel_warp_bytes(E), chosen[warp], small ? chosen_w[warp] : NULL);
    }
    pdl_launch_dependents();
    if (small) {
        __syncthreads();
        if (warp == 0) group_pairs_warp(p, chosen, chosen_w);
        return;
    }

    /* the last block groups the pairs by expert */
    __threadfence();
    __syncthreads();
    /* one block: it is the last (no counter round trip) */
    if (tid == 0) is_last = gridDim.x == 1 || atomicAdd(p.done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    if (p.warp_group && T * p.k <= 64) {
        if (warp == 0) group_pairs_last_warp(p, p.done);
        return;
    }
    group_pairs(p, rs_smem, warp_tot, p.done);
}

typedef void (*fm_route_kfn)(fm_route_params);
static fm_route_kfn route_kernel_for(int route) {
    switch (route) {
    case FM_ROUTE_SOFTMAX: return fm_route_kernel<FM_ROUTE_SOFTMAX>;
    case FM_ROUTE_GPTOSS: return fm_route_kernel<FM_ROUTE_GPTOSS>;
    case FM_ROUTE_DSV4: return fm_route_kernel<FM_ROUTE_DSV4>;
    default: return fm_route_kernel<FM_ROUTE_NOAUX_TC>;
    }
}

extern "C" size_t fm_cuda_route_smem(int H, int E) {
    (void)H;
    size_t a = RT_WARPS * sel_warp_bytes(E); /* the fused GEMV shape selects 8 tokens per block */
    size_t b = (size_t)E * 12;
    return a > b ? a : b;
}

extern "C" size_t fm_cuda_route_logit_floats(int T, int H, int E, int sms) {
    /* GEMV shape: ceil(H / LG_KC) slices of at most LG_GEMV_MAX tokens;
     * SGEMM shape: slices x tiles <= 4 sms + tiles - 1, each 64 x 64; and
     * never less than one slice. Every term grows with T, H, E and sms. */
    size_t tiles = (size_t)((T + LG_TILE - 1) / LG_TILE) * ((E + LG_TILE - 1) / LG_TILE);
    size_t a = (size_t)((H + LG_KC - 1) / LG_KC) * LG_GEMV_MAX * lg_stride(E);
    size_t b = (4 * (size_t)(sms > 0 ? sms : 132) + tiles) * LG_TILE * LG_TILE; /* lg_stride(E) <= tiles' experts */
    size_t c = (size_t)T * lg_stride(E);
    size_t m = a > b ? a : b;
    return m > c ? m : c;
}

extern "C" int fm_cuda_route_sep_prep(int T, int H, int E, int sms) { return !fm_route_logits_gemv(T, H, E, sms); }

extern "C" fm_status fm_cuda_route_prepare(size_t smem) {
    if (smem > 48 * 1024)
        for (int rk = FM_ROUTE_NOAUX_TC; rk <= FM_ROUTE_DSV4; rk++)
            FM_CU(cudaFuncSetAttribute(route_kernel_for(rk), cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    /* the GEMV shape has 16 KB of static shared memory besides */
    if (smem + sizeof(float) * LG_TT * LG_KC > 48 * 1024)
        FM_CU(cudaFuncSetAttribute(fm_logits_gemv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    return FM_OK;
}

/* The logits kernel above LG_SMALL_T tokens: BF16 tensor cores where the
 * router is exact in BF16 (v45, the default), else three TF32 terms on
 * tensor cores (v24), or the FP32 FMA SGEMM (before v24);
 * FP4MOE_CUDA_LOGITS=mma keeps the TF32 kernel, =simt the SGEMM, for
 * comparisons. Read once: 0 simt, 1 TF32, 2 BF16 where it applies. */
static int route_logits_kind(void) {
    static const int v = fm_cuda_env_is("FP4MOE_CUDA_LOGITS", "simt") ? 0 : fm_cuda_env_is("FP4MOE_CUDA_LOGITS", "mma") ? 1 : 2;
    return v;
}
static int route_logits_mma(void) { return route_logits_kind() > 0; }

/* Name of the logits kernel the launch below takes at T tokens. */
extern "C" const char *fm_cuda_route_logits_name(int T, int H, int E, int sms, int bf16_router, int xdt) {
    if (fm_route_logits_gemv(T, H, E, sms)) return "GEMV, FP32 FMA";
    const int k = route_logits_kind();
    if (k == 2 && bf16_router)
        return xdt == FM_DT_BF16 ? "BF16 mma.sync, one term (exact products, FP32 sums)"
               : xdt == FM_DT_F16 ? "BF16 mma.sync, two terms of x (exact products, FP32 sums)"
                                  : "BF16 mma.sync, three terms of x (exact products, FP32 sums)";
    return k ? "three TF32 terms on mma.sync (FP32 accuracy)" : "SGEMM, FP32 FMA";
}

/* FP4MOE_CUDA_ROUTE_FUSE=0 keeps the separate selection kernel at few
 * tokens (the v7 routing), for comparisons. */
static int route_fuse_enabled(void) {
    /* Off by default: on the H200 the fused path measured no faster than
     * two launches (B = 1: 66.5 vs 63.6 us in one call, within the
     * call-to-call spread); FP4MOE_CUDA_ROUTE_FUSE=1 turns it on. */
    static const int v = fm_cuda_env_is("FP4MOE_CUDA_ROUTE_FUSE", "1");
    return v;
}

extern "C" fm_status fm_cuda_launch_route(fm_route_params *p, size_t smem, int pdl, int parts, cudaStream_t s) {
    if (p->k > RT_MAXK) return fm_error(FM_E_UNSUPPORTED, "CUDA routing supports top-k up to %d, not %d", RT_MAXK, p->k);
    if (p->H % 4) return fm_error(FM_E_UNSUPPORTED, "CUDA routing needs the hidden size %d to be a multiple of 4", p->H);
    if (p->Hp % 8) return fm_error(FM_E_UNSUPPORTED, "CUDA routing needs the padded hidden size %d to be a multiple of 8", p->Hp);
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.blockDim = dim3(RT_THREADS);
    cfg.stream = s;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    if (parts & FM_ROUTE_PART_PREP) {
        if (fm_route_logits_gemv(p->T, p->H, p->E, p->sms))
            return fm_error(FM_E_ARG, "the routing prep kernel is for the SGEMM logits shape, not the GEMV one "
                                      "that T = %d takes here", p->T);
        const int64_t groups = (int64_t)p->T * (p->Hp / 8);
        int64_t blocks = (groups + 2 * RT_THREADS - 1) / (2 * RT_THREADS);
        const int64_t cap = 4 * (int64_t)(p->sms > 0 ? p->sms : 132);
        if (blocks > cap) blocks = cap;
        cfg.gridDim = dim3((unsigned)blocks);
        FM_CU(cudaLaunchKernelEx(&cfg, fm_prep_kernel, *p));
        FM_CU_LAUNCH("fm_prep_kernel");
        p->skip_prep = 1;
    }
    int ks, kc = 0;
    const int gemv = fm_route_logits_gemv(p->T, p->H, p->E, p->sms);
    if (gemv) {
        ks = (p->H + LG_KC - 1) / LG_KC;
        cfg.gridDim = dim3((unsigned)((p->E + RT_WARPS * LG_EW - 1) / (RT_WARPS * LG_EW)), (unsigned)ks,
                           (unsigned)((p->T + LG_TT - 1) / LG_TT));
    } else {
        const int mma = route_logits_mma();
        fm_route_tile_split(p->T, p->H, p->E, p->sms, mma ? 2 : 4, mma ? LGM_KS : LG_KSTEP, &ks, &kc);
        cfg.gridDim = dim3((unsigned)((p->T + LG_TILE - 1) / LG_TILE), (unsigned)((p->E + LG_TILE - 1) / LG_TILE),
                           (unsigned)ks);
    }
    p->kslices = ks;
    p->fuse = p->T <= LG_SMALL_T && (parts & FM_ROUTE_PART_LOGITS) && (parts & FM_ROUTE_PART_SELECT) &&
              route_fuse_enabled();
    if (parts & FM_ROUTE_PART_LOGITS) {
        if (gemv) {
            cfg.dynamicSmemBytes = p->fuse ? smem : 0;
            FM_CU(cudaLaunchKernelEx(&cfg, fm_logits_gemv_kernel, *p));
            FM_CU_LAUNCH("fm_logits_gemv_kernel");
            if (p->fuse) return FM_OK;
        } else if (route_logits_kind() == 2 && p->router_wb) {
            if (p->xdt == FM_DT_BF16) FM_CU(cudaLaunchKernelEx(&cfg, fm_logits_bf16_kernel<1>, *p, kc));
            else if (p->xdt == FM_DT_F16) FM_CU(cudaLaunchKernelEx(&cfg, fm_logits_bf16_kernel<2>, *p, kc));
            else FM_CU(cudaLaunchKernelEx(&cfg, fm_logits_bf16_kernel<3>, *p, kc));
            FM_CU_LAUNCH("fm_logits_bf16_kernel");
        } else if (route_logits_mma()) {
            FM_CU(cudaLaunchKernelEx(&cfg, fm_logits_mma_kernel, *p, kc));
            FM_CU_LAUNCH("fm_logits_mma_kernel");
        } else {
            FM_CU(cudaLaunchKernelEx(&cfg, fm_logits_tile_kernel, *p, kc));
            FM_CU_LAUNCH("fm_logits_tile_kernel");
        }
    }
    if (!(parts & FM_ROUTE_PART_SELECT)) return FM_OK;
    const int wpb = p->sel_warps == 8 ? 8 : 4;
    cfg.blockDim = dim3(32 * wpb);
    cfg.gridDim = dim3((unsigned)((p->T + wpb - 1) / wpb));
    cfg.dynamicSmemBytes = smem;
    FM_CU(cudaLaunchKernelEx(&cfg, route_kernel_for(p->route), *p));
    FM_CU_LAUNCH("fm_route_kernel");
    return FM_OK;
}
