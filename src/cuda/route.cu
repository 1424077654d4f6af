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

__global__ void __launch_bounds__(RT_THREADS) fm_route_kernel(fm_route_params p) {
    extern __shared__ float rt_smem[];
    const int E = p.E, H = p.H, k = p.k;
    float *xs = rt_smem;          /* [H]  */
    float *lg = xs + H;           /* [E]  logits               */
    float *sel = lg + E;          /* [E]  selection score      */
    float *wsc = sel + E;         /* [E]  weight score         */
    unsigned char *taken = (unsigned char *)(wsc + E); /* [E] */
    __shared__ int chosen[RT_MAXK];
    __shared__ float red[RT_WARPS];
    __shared__ int warp_tot[RT_WARPS];
    __shared__ unsigned is_last;

    const int t = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    pdl_wait();

    /* activations: FP32 copy for the router, BF16 copy for the experts */
    for (int i = tid; i < H; i += RT_THREADS) xs[i] = load_x(p.x, p.xdt, (size_t)t * H + i);
    for (int i = tid; i < H; i += RT_THREADS) p.out[(size_t)t * H + i] = 0.0f;
    __syncthreads();
    /* stored position m of a group of 8 holds element perm[m] (expert.cu) */
    for (int i = tid; i < p.Hp; i += RT_THREADS) {
        const int perm[8] = {0, 4, 1, 5, 2, 6, 3, 7};
        int src = (i & ~7) + perm[i & 7];
        float v = src < H ? xs[src] * 128.0f : 0.0f;
        __nv_bfloat16 b = __float2bfloat16_rn(v);
        p.x_prep[(size_t)t * p.Hp + i] = *(uint16_t *)&b;
    }

    /* logits: one warp per expert row, lanes stride over H */
    for (int e = warp; e < E; e += RT_WARPS) {
        const float *w = p.router_w + (size_t)e * H;
        float acc = 0.0f;
        if ((H & 3) == 0) {
            for (int i = lane * 4; i < H; i += 128) {
                float4 a = *(const float4 *)(w + i);
                acc += a.x * xs[i] + a.y * xs[i + 1] + a.z * xs[i + 2] + a.w * xs[i + 3];
            }
        } else {
            for (int i = lane; i < H; i += 32) acc += w[i] * xs[i];
        }
        for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) lg[e] = acc + (p.router_bias ? p.router_bias[e] : 0.0f);
    }
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

    int *cnt = (int *)rt_smem;  /* [E] (reuses xs) */
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
    size_t a = (size_t)H * 4 + (size_t)E * 13 + 16;
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
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    cfg.gridDim = dim3((unsigned)p->T);
    cfg.blockDim = dim3(RT_THREADS);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    FM_CU(cudaLaunchKernelEx(&cfg, fm_route_kernel, *p));
    FM_CU_LAUNCH("fm_route_kernel");
    return FM_OK;
}
