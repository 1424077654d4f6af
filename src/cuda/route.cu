/*
 * Routing and token -> expert grouping on the GPU, one launch per layer.
 *
 * One block per token computes the router logits in FP32, the family's
 * scores, the group limit and the top-k exactly as fm_route does (ties go to
 * the lower expert index, ids sorted ascending), zeroes the token's output
 * row and writes the token's activations in the layout the expert kernels
 * read (BF16, scaled by 2^7, K permuted; see expert.cu). The last block to
 * finish (a counter in global memory) groups the T*k (token, slot) pairs by
 * expert: counts, prefix sums, the list of active experts and the scatter.
 * Nothing here waits on the host, so a whole step can be one CUDA graph.
 */
#include "cuda_internal.h"
#include <string.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>

#define RT_THREADS 256
#define RT_WARPS (RT_THREADS / 32)
#define RT_MAXK 32

static __device__ __forceinline__ void pdl_wait(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
static __device__ __forceinline__ void pdl_launch_dependents(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

static __device__ __forceinline__ float load_x(const void *x, int xdt, size_t i) {
    if (xdt == FM_DT_BF16) return __uint_as_float((unsigned)((const uint16_t *)x)[i] << 16);
    if (xdt == FM_DT_F16) return __half2float(((const __half *)x)[i]);
    return ((const float *)x)[i];
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
    for (int i = 0; i < RT_WARPS; i++) {
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


/* Router logits, FP32: logits[t][e] = x[t] . W[e] (+ router bias[e]). A warp
 * owns EW experts and a tile of TT tokens, so each router row is read once
 * per token tile (from L2) and the tokens' activations come from L1. */
template <int EW, int TT>
__global__ void __launch_bounds__(RT_THREADS) fm_logits_kernel(fm_route_params p) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int e0 = (blockIdx.x * RT_WARPS + warp) * EW, t0 = blockIdx.y * TT;
    pdl_wait();
    pdl_launch_dependents();
    if (e0 >= p.E) return;
    const int H = p.H;
    float acc[EW][TT];
#pragma unroll
    for (int a = 0; a < EW; a++)
#pragma unroll
        for (int b = 0; b < TT; b++) acc[a][b] = 0.0f;
    for (int i = lane * 4; i < H; i += 128) {
        float4 w[EW];
#pragma unroll
        for (int a = 0; a < EW; a++)
            w[a] = e0 + a < p.E ? __ldg((const float4 *)(p.router_w + (size_t)(e0 + a) * H + i)) : make_float4(0, 0, 0, 0);
#pragma unroll
        for (int b = 0; b < TT; b++) {
            if (t0 + b >= p.T) break;
            size_t o = (size_t)(t0 + b) * H + i;
            float x0, x1, x2, x3;
            if (p.xdt == FM_DT_F32) {
                float4 v = __ldg((const float4 *)((const float *)p.x + o));
                x0 = v.x; x1 = v.y; x2 = v.z; x3 = v.w;
            } else {
                uint2 v = __ldg((const uint2 *)((const uint16_t *)p.x + o));
                if (p.xdt == FM_DT_BF16) {
                    x0 = __uint_as_float(v.x << 16); x1 = __uint_as_float(v.x & 0xFFFF0000u);
                    x2 = __uint_as_float(v.y << 16); x3 = __uint_as_float(v.y & 0xFFFF0000u);
                } else {
                    __half2 h0 = *(__half2 *)&v.x, h1 = *(__half2 *)&v.y;
                    x0 = __low2float(h0); x1 = __high2float(h0); x2 = __low2float(h1); x3 = __high2float(h1);
                }
            }
#pragma unroll
            for (int a = 0; a < EW; a++) acc[a][b] += w[a].x * x0 + w[a].y * x1 + w[a].z * x2 + w[a].w * x3;
        }
    }
#pragma unroll
    for (int a = 0; a < EW; a++)
#pragma unroll
        for (int b = 0; b < TT; b++) {
            float v = acc[a][b];
            for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0 && e0 + a < p.E && t0 + b < p.T)
                p.logits[(size_t)(t0 + b) * p.E + e0 + a] = v + (p.router_bias ? p.router_bias[e0 + a] : 0.0f);
        }
}

__global__ void __launch_bounds__(RT_THREADS) fm_route_kernel(fm_route_params p) {
    extern __shared__ float rt_smem[];
    const int E = p.E, H = p.H, k = p.k;
    float *lg = rt_smem;          /* [E]  logits               */
    float *sel = lg + E;          /* [E]  selection score      */
    float *wsc = sel + E;         /* [E]  weight score         */
    unsigned char *taken = (unsigned char *)(wsc + E); /* [E] */
    __shared__ int chosen[RT_MAXK];
    __shared__ float red[RT_WARPS];
    __shared__ int warp_tot[RT_WARPS];
    __shared__ unsigned is_last;

    const int t = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    pdl_wait();

    /* the experts' copy of the activations: BF16 * 2^7, stored position m
     * of a group of 8 holds element perm[m] (expert.cu) */
    for (int i = tid; i < H; i += RT_THREADS) p.out[(size_t)t * H + i] = 0.0f;
    for (int i = tid; i < p.Hp; i += RT_THREADS) {
        const int perm[8] = {0, 4, 1, 5, 2, 6, 3, 7};
        int src = (i & ~7) + perm[i & 7];
        float v = src < H ? load_x(p.x, p.xdt, (size_t)t * H + src) * 128.0f : 0.0f;
        __nv_bfloat16 b = __float2bfloat16_rn(v);
        p.x_prep[(size_t)t * p.Hp + i] = *(uint16_t *)&b;
    }
    for (int e = tid; e < E; e += RT_THREADS) lg[e] = p.logits[(size_t)t * E + e];
    __syncthreads();

    /* family scores */
    if (p.route == FM_ROUTE_SOFTMAX) {
        float m = -INFINITY;
        for (int e = tid; e < E; e += RT_THREADS) m = fmaxf(m, lg[e]);
        for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (lane == 0) red[warp] = m;
        __syncthreads();
        m = red[0];
        for (int i = 1; i < RT_WARPS; i++) m = fmaxf(m, red[i]);
        __syncthreads();
        float s = 0.0f;
        for (int e = tid; e < E; e += RT_THREADS) { float v = expf(lg[e] - m); wsc[e] = v; s += v; }
        for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) red[warp] = s;
        __syncthreads();
        s = 0.0f;
        for (int i = 0; i < RT_WARPS; i++) s += red[i];
        for (int e = tid; e < E; e += RT_THREADS) { wsc[e] = wsc[e] / s; sel[e] = wsc[e]; }
    } else if (p.route == FM_ROUTE_GPTOSS) {
        for (int e = tid; e < E; e += RT_THREADS) {
            float v = lg[e];
            sel[e] = v; wsc[e] = v;
        }
    } else {
        for (int e = tid; e < E; e += RT_THREADS) {
            float l = lg[e], s;
            if (p.route == FM_ROUTE_DSV4) {
                float sp = l > 20.0f ? l : log1pf(expf(l));
                s = sqrtf(sp);
            } else {
                s = 1.0f / (1.0f + expf(-l));
            }
            wsc[e] = s;
            sel[e] = s + (p.score_bias ? p.score_bias[e] : 0.0f);
        }
    }
    for (int e = tid; e < E; e += RT_THREADS) taken[e] = 0;
    __syncthreads();

    /* group limit (DeepSeek-V3 family): keep the topk_group groups with the
     * largest sum of their two best biased scores */
    if ((p.route == FM_ROUTE_NOAUX_TC || p.route == FM_ROUTE_DSV4) && p.n_group > 1 && p.topk_group > 0 &&
        p.topk_group < p.n_group) {
        int gs = E / p.n_group;
        float *gscore = lg; /* logits are no longer needed */
        __syncthreads();
        for (int g = tid; g < p.n_group; g += RT_THREADS) {
            float b1 = -INFINITY, b2 = -INFINITY;
            for (int e = g * gs; e < (g + 1) * gs; e++) {
                float v = sel[e];
                if (v > b1) { b2 = b1; b1 = v; } else if (v > b2) b2 = v;
            }
            gscore[g] = gs >= 2 ? b1 + b2 : b1;
        }
        __syncthreads();
        if (warp == 0) {
            for (int j = 0; j < p.topk_group; j++) {
                int g = warp_argmax(gscore, taken, p.n_group);
                if (lane == 0) taken[g] = 1;
                __syncwarp();
            }
        }
        __syncthreads();
        for (int e = tid; e < E; e += RT_THREADS)
            if (!taken[e / gs]) sel[e] = -INFINITY;
        __syncthreads();
        for (int g = tid; g < p.n_group; g += RT_THREADS) taken[g] = 0;
        __syncthreads();
    }

    if (warp == 0) {
        if (p.hash) {
            int tok = p.token_ids[t];
            if (lane < k) chosen[lane] = p.tid2eid[(size_t)tok * k + lane];
        } else {
            for (int j = 0; j < k; j++) {
                int e = warp_argmax(sel, taken, E);
                if (lane == 0) { taken[e] = 1; chosen[j] = e; }
                __syncwarp();
            }
        }
        __syncwarp();
        if (lane == 0) {
            float w[RT_MAXK];
            int id[RT_MAXK];
            for (int j = 0; j < k; j++) id[j] = chosen[j];
            /* ascending expert ids */
            for (int a = 1; a < k; a++) {
                int v = id[a], b = a - 1;
                while (b >= 0 && id[b] > v) { id[b + 1] = id[b]; b--; }
                id[b + 1] = v;
            }
            if (p.route == FM_ROUTE_GPTOSS) {
                float m = -INFINITY, s = 0.0f;
                for (int j = 0; j < k; j++) m = fmaxf(m, wsc[id[j]]);
                for (int j = 0; j < k; j++) { w[j] = expf(wsc[id[j]] - m); s += w[j]; }
                for (int j = 0; j < k; j++) w[j] /= s;
            } else {
                /* as fm_route: softmax renormalizes when norm_topk_prob;
                 * noaux_tc when norm_topk_prob and DeepSeek-V4 always, with
                 * 1e-20 added to the sum, then the scaling factor */
                float s = 0.0f;
                for (int j = 0; j < k; j++) { w[j] = wsc[id[j]]; s += w[j]; }
                if (p.route == FM_ROUTE_SOFTMAX) {
                    if (p.norm_topk)
                        for (int j = 0; j < k; j++) w[j] /= s;
                } else {
                    if (p.norm_topk || p.route == FM_ROUTE_DSV4) {
                        s += 1e-20f;
                        for (int j = 0; j < k; j++) w[j] /= s;
                    }
                    for (int j = 0; j < k; j++) w[j] *= p.scaling;
                }
            }
            for (int j = 0; j < k; j++) {
                p.ids[(size_t)t * k + j] = id[j];
                p.wts[(size_t)t * k + j] = w[j];
            }
        }
    }
    pdl_launch_dependents();

    /* the last block groups the pairs by expert */
    __threadfence();
    __syncthreads();
    if (tid == 0) is_last = (atomicAdd(p.done, 1u) == (unsigned)(p.T - 1));
    __syncthreads();
    if (!is_last) return;
    __threadfence();

    int *cnt = (int *)rt_smem;  /* [E] (reuses the score arrays) */
    int *off = cnt + E;         /* [E] */
    int *cur = off + E;         /* [E] */
    const int n = p.T * k;
    for (int e = tid; e < E; e += RT_THREADS) { cnt[e] = 0; cur[e] = 0; }
    __syncthreads();
    for (int i = tid; i < n; i += RT_THREADS) atomicAdd(&cnt[__ldcg(&p.ids[i])], 1);
    __syncthreads();
    /* each thread owns a run of up to 4 consecutive experts */
    const int per = (E + RT_THREADS - 1) / RT_THREADS;
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
    for (int i = tid; i < n; i += RT_THREADS) {
        int e = __ldcg(&p.ids[i]);
        int pos = off[e] + atomicAdd(&cur[e], 1);
        p.sorted_tok[pos] = i / k;
        p.sorted_w[pos] = __ldcg(&p.wts[i]);
    }
    if (tid == 0) {
        *p.n_active = n_act;
        if (p.stat_active) *p.stat_active = n_act;
        *p.done = 0;
    }
}

extern "C" size_t fm_cuda_route_smem(int H, int E) {
    (void)H;
    size_t a = (size_t)E * 13 + 16;
    size_t b = (size_t)E * 12;
    return a > b ? a : b;
}

extern "C" fm_status fm_cuda_route_prepare(size_t smem) {
    if (smem > 48 * 1024)
        FM_CU(cudaFuncSetAttribute(fm_route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    return FM_OK;
}

extern "C" fm_status fm_cuda_launch_route(const fm_route_params *p, size_t smem, int pdl, cudaStream_t s) {
    if (p->k > RT_MAXK) return fm_error(FM_E_UNSUPPORTED, "CUDA routing supports top-k up to %d, not %d", RT_MAXK, p->k);
    if (p->H % 4) return fm_error(FM_E_UNSUPPORTED, "CUDA routing needs the hidden size %d to be a multiple of 4", p->H);
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.blockDim = dim3(RT_THREADS);
    cfg.stream = s;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    /* few tokens: one expert per warp (more blocks); many: two experts and
     * 16 tokens per warp (fewer passes over the router weights) */
    if (p->T <= 8) {
        cfg.gridDim = dim3((unsigned)((p->E + RT_WARPS - 1) / RT_WARPS), (unsigned)((p->T + 7) / 8));
        FM_CU(cudaLaunchKernelEx(&cfg, fm_logits_kernel<1, 8>, *p));
    } else {
        cfg.gridDim = dim3((unsigned)((p->E + 2 * RT_WARPS - 1) / (2 * RT_WARPS)), (unsigned)((p->T + 15) / 16));
        FM_CU(cudaLaunchKernelEx(&cfg, fm_logits_kernel<2, 16>, *p));
    }
    FM_CU_LAUNCH("fm_logits_kernel");
    cfg.gridDim = dim3((unsigned)p->T);
    cfg.dynamicSmemBytes = smem;
    FM_CU(cudaLaunchKernelEx(&cfg, fm_route_kernel, *p));
    FM_CU_LAUNCH("fm_route_kernel");
    return FM_OK;
}
