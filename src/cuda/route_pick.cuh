/* The one-token selection's pieces that the one-token expert launch
 * (expert_splitk.cu) shares with the selection kernel (route_select.cu):
 * the family's scores over a block, the group limit and the top-k on one
 * warp, exactly as fm_route does. */
#ifndef FM_ROUTE_PICK_CUH
#define FM_ROUTE_PICK_CUH
#include "route_common.cuh"
#include <math.h>

#define SEL_RC 4   /* 128-expert chunks of top-k keys a selection lane holds in registers (E <= 512) */
#define SEL_RB 2   /* 128-expert chunks of biases a selection lane holds in registers */

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


/* An unsigned key that orders scores as floats do (-0 as +0), above 0 for
 * every score; NaN gets 1, below -inf. */
static __device__ __forceinline__ unsigned score_key(float f) {
    if (f != f) return 1u;
    const unsigned b = __float_as_uint(f + 0.0f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

/* Per-warp shared memory of the selection kernel: lg, sel, wsc [E] floats
 * and taken [E] bytes, rounded to 16 bytes. */
static __host__ __device__ __forceinline__ size_t sel_warp_bytes(int E) { return FM_SEL_WARP_BYTES(E); }

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

/* The rest of token t's selection, on one warp, from the scores in ws
 * (select_scores or select_scores_block): the group limit, the top-k, the
 * weights, and the writes. */
template <int RK>
static __device__ void select_pick(const fm_route_params &p, int t, unsigned char *ws, int *chosen, float *chosen_w,
                                   bool write = true, int *order = nullptr, float *order_w = nullptr) {
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
                /* the keys in registers: per round each lane's best over
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
                    if (order && lane == 0) {
                        /* each pick as found, then how many (spun on by other warps) */
                        ((volatile int *)order)[j] = (int)w;
                        __threadfence_block();
                        ((volatile int *)order)[RT_MAXK] = j + 1;
                    }
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
                    if (order && lane == 0) {
                        ((volatile int *)order)[j] = (int)w;
                        __threadfence_block();
                        ((volatile int *)order)[RT_MAXK] = j + 1;
                    }
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
        if (mine && order_w) order_w[lane] = w;
        if (mine) {
            if (write) {
                p.ids[(size_t)t * k + rank] = myid;
                p.wts[(size_t)t * k + rank] = w;
            }
            if (chosen_w) {
                chosen[rank] = myid;
                chosen_w[rank] = w;
            }
        }
        __syncwarp();
}

/* Families whose scores are elementwise (no reduction over the experts):
 * the one-token selection can spread them over the block. */
template <int RK> struct sel_elementwise { static constexpr bool value = RK == FM_ROUTE_NOAUX_TC || RK == FM_ROUTE_DSV4; };

/*
 * The slice sums and scores of token t by n threads (i: this
 * thread's index among them), two experts per thread and round: at T = 1
 * the block's threads (the one-warp
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

/* One token's grouping, as the expert kernels read it, from its k distinct
 * ids in ascending order and their weights (lane j < k of one warp): pair j
 * is active expert j, with the one token, at place j. */
static __device__ __forceinline__ void group_one_token(const fm_route_params &p, const int *ids, const float *w) {
    const int lane = threadIdx.x & 31;
    if (lane < p.k) {
        p.sorted_tok[lane] = 0;
        p.sorted_w[lane] = w[lane];
        p.act_e[lane] = ids[lane];
        p.act_off[lane] = lane;
        p.act_cnt[lane] = 1;
    }
    if (lane == 0) {
        *p.n_active = p.k;
        if (p.stat_active) *p.stat_active = p.k;
    }
}

#endif
