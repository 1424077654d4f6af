/*
 * The split-K expert kernels (config path "splitk", sm_80 and later): the
 * latency-bound regime of a few tokens on narrow experts (a TP rank's I/R
 * slices), where one block per 16 weight rows leaves most SMs idle and the
 * few warps there cannot keep enough bytes in flight.
 *
 * Gate/up: a warp owns 16 rows of gate and up over one of C chunks of K
 * (the config's k_split), so a layer's gate/up is C times as many warps.
 * Each warp stores its partial sums; the last warp of a row group to finish
 * (a counter per row group, reset by that warp) adds the C partials in chunk
 * order, applies the activation and writes h. The shared expert's warps come
 * first in the grid and do not wait for the routing: their gate/up overlaps
 * the selection.
 *
 * Down: a block owns 16 output rows for every token and loops over all the
 * layer's experts (routed and shared), its 8 warps taking experts in turn;
 * the warps' sums are added in warp order and stored. No atomics anywhere:
 * the result does not depend on the order in which blocks run, and the
 * output needs no zeroing.
 *
 * The weight stream, decode and MMAs are the mma.sync kernels'
 * (expert_mma.cu, expert_common.cuh).
 */
#include "expert_common.cuh"
#include "schedule.h"

#define SK_WARPS FM_SPLITK_WARPS
/* gate/up segments whose loads a warp issues together */
#define SK_GU_SEGS 3
/* a gate/up warp's shared memory: a group's activations (16 bytes per lane,
 * four per segment) */
#define SK_GU_XBYTES (SK_GU_SEGS * 4 * 32 * 16)

/* One segment: decode rows g and g + 8 of each matrix and multiply them by
 * the 8 tokens of one tile. */
template <int NMAT, bool MX>
static __device__ __forceinline__ void sk_seg(float (&acc)[NMAT][4], const uint4 (&wa)[NMAT], const uint4 (&wb)[NMAT],
                                              const uint32_t (&ca)[NMAT], const uint32_t (&cb)[NMAT],
                                              const uint4 (&xb)[4]) {
#pragma unroll
    for (int m = 0; m < NMAT; m++) {
        uint32_t SA[2], SB[2];
        if (MX) {
            SA[0] = SA[1] = mx_scale_bits(ca[m] & 0xFF) * 0x10001u;
            SB[0] = SB[1] = mx_scale_bits(cb[m] & 0xFF) * 0x10001u;
        } else {
            nv_scale_pair(ca[m], SA[0], SA[1]);
            nv_scale_pair(cb[m], SB[0], SB[1]);
        }
#pragma unroll
        for (int d = 0; d < 4; d++) {
            const uint32_t wA = d == 0 ? wa[m].x : d == 1 ? wa[m].y : d == 2 ? wa[m].z : wa[m].w;
            const uint32_t wB = d == 0 ? wb[m].x : d == 1 ? wb[m].y : d == 2 ? wb[m].z : wb[m].w;
            uint32_t ra[4], rb[4];
            decode8(wA, SA[d >> 1], ra);
            decode8(wB, SB[d >> 1], rb);
            mma16816(acc[m], ra[0], rb[0], ra[1], rb[1], xb[d].x, xb[d].y);
            mma16816(acc[m], ra[2], rb[2], ra[3], rb[3], xb[d].z, xb[d].w);
        }
    }
}

/* A 16-byte copy of activations into shared memory, zeros where !valid. */
static __device__ __forceinline__ void sk_cp_x(uint32_t dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

static __device__ __forceinline__ uint4 sk_ld_x(const uint16_t *src, int s, int d) {
    return src ? __ldcg((const uint4 *)(src + s * FM_KSEG) + d) : make_uint4(0, 0, 0, 0);
}

/*
 * Gate/up. Work units, one per warp: the shared expert's (row group, chunk)
 * first, then (active-expert slot, row group, chunk). Partials:
 * part[((chunk * P + pos) * 2 + m) * rstride + row], P = T * k + T pairs
 * (the shared expert's pairs after the routed ones, as in h). Counters:
 * cnt[row group] for the shared expert, then cnt[nrg_s + slot * nrg + rg].
 */
template <bool MX>
__global__ void __launch_bounds__(32 * SK_WARPS, FM_SPLITK_PER_SM) fm_splitk_gu_kernel(fm_expert_params p, int C) {
    const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int nrg = p.gate.n ? p.gate.rows_p / 16 : 0, nrg_s = p.sgate.n ? p.sgate.rows_p / 16 : 0;
    int u = (int)blockIdx.x * SK_WARPS + wi;
    const int sh_units = nrg_s * C;
    const bool shared = u < sh_units;
    int slot = 0, rg, c;
    if (shared) {
        rg = u / C;
        c = u % C;
    } else {
        u -= sh_units;
        slot = u / (nrg * C);
        rg = (u / C) % nrg;
        c = u % C;
        if (slot >= p.max_active) return;
        pdl_wait();
    }
    pdl_launch_dependents();
    int e = 0, pos0 = p.T * p.k, cnt = p.T;
    if (!shared) {
        if (slot >= __ldcg(p.n_active)) return;
        e = __ldcg(p.act_e + slot);
        pos0 = __ldcg(p.act_off + slot);
        cnt = __ldcg(p.act_cnt + slot);
    }
    const fm_dmat &dA = shared ? p.sgate : p.gate;
    const fm_dmat &dB = shared ? p.sup : p.up;
    const int nseg = dA.kp / FM_KSEG, rows_p = dA.rows_p;
    const int s_begin = c * nseg / C, s_end = (c + 1) * nseg / C;
    const int r0 = rg * 16;
    const uint8_t *pa[2], *pb[2], *sa[2], *sb[2], *st[2];
    fm_tile_ptrs<2, MX>(dA, dB, e, (int64_t)rg * nseg, lane, pa, pb, sa, sb, st);
    const uint64_t wpol = l2_evict_first();
    const int P = p.T * p.k + p.T;
    const int rstride = p.sk_rstride;
    float *part = p.sk_part;
    extern __shared__ __align__(16) unsigned char sk_smem[];
    unsigned char *xsp = sk_smem + (size_t)wi * SK_GU_XBYTES;
    const uint32_t xs = (uint32_t)__cvta_generic_to_shared(xsp);

    for (int pass0 = 0; pass0 < cnt; pass0 += 8) {
        float acc[2][4];
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[m][i] = 0.0f;
        const uint16_t *src = NULL;
        const int idx = pass0 + g;
        if (idx < cnt) src = p.x_prep + (int64_t)(shared ? idx : __ldcg(p.sorted_tok + pos0 + idx)) * p.Hp + t * 32;
        /* a warp's segments in groups of SK_GU_SEGS, each group's weight
         * loads and activation copies issued at once: one DRAM round trip
         * per group instead of one per segment (a warp has few segments,
         * and few warps share an SM at this size); the activations go to
         * the warp's shared memory, which keeps the weights in registers */
        for (int sg = s_begin; sg < s_end; sg += SK_GU_SEGS) {
            uint4 wa[SK_GU_SEGS][2], wb[SK_GU_SEGS][2];
            uint32_t ca[SK_GU_SEGS][2], cb[SK_GU_SEGS][2];
#pragma unroll
            for (int j = 0; j < SK_GU_SEGS; j++) {
                const int sj = min(sg + j, s_end - 1);
                fm_load_seg<2, MX, false>(pa, pb, sa, sb, sj, wpol, wa[j], wb[j], ca[j], cb[j]);
#pragma unroll
                for (int d = 0; d < 4; d++)
                    sk_cp_x(xs + ((j * 4 + d) * 32 + lane) * 16, src ? src + sj * FM_KSEG + d * 8 : p.x_prep, src != NULL);
            }
            cp_async_commit();
            cp_async_wait<0>();
            __syncwarp();
#pragma unroll
            for (int j = 0; j < SK_GU_SEGS; j++) {
                if (sg + j >= s_end) break;
                uint4 xb[4];
#pragma unroll
                for (int d = 0; d < 4; d++) xb[d] = *(const uint4 *)(xsp + ((j * 4 + d) * 32 + lane) * 16);
                sk_seg<2, MX>(acc, wa[j], wb[j], ca[j], cb[j], xb);
            }
            __syncwarp();
        }
        /* C fragment: rows g, g + 8; tokens 2t, 2t + 1 of the tile */
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int row = r0 + g + (i >= 2 ? 8 : 0), id = pass0 + 2 * t + (i & 1);
            if (id < cnt) {
                float *q = part + ((int64_t)(c * P + pos0 + id) * 2) * rstride + row;
                __stcg(q, acc[0][i]);
                __stcg(q + rstride, acc[1][i]);
            }
        }
    }
    /* the last warp of the row group to finish adds the chunks in order */
    __threadfence();
    unsigned *ctr = p.sk_cnt + (shared ? rg : nrg_s + slot * nrg + rg);
    unsigned old = 0;
    if (lane == 0) old = atomicAdd(ctr, 1u);
    old = __shfl_sync(0xffffffffu, old, 0);
    if (old != (unsigned)C - 1) return;
    __threadfence();
    const float s2A = fm_nv_s2<MX>(dA.scale2[e]), s2B = fm_nv_s2<MX>(dB.scale2[e]);
    for (int i = lane; i < 16 * cnt; i += 32) {
        const int row = r0 + (i & 15), id = i >> 4, pos = pos0 + id;
        /* every chunk's partials loaded before the first add: one L2
         * round trip, then the sums in chunk order */
        float va[FM_SPLITK_MAX_C], vb[FM_SPLITK_MAX_C];
#pragma unroll
        for (int cc = 0; cc < FM_SPLITK_MAX_C; cc++) {
            const float *q = part + ((int64_t)(min(cc, C - 1) * P + pos) * 2) * rstride + row;
            va[cc] = __ldcg(q);
            vb[cc] = __ldcg(q + rstride);
        }
        float a = 0.0f, b = 0.0f;
#pragma unroll
        for (int cc = 0; cc < FM_SPLITK_MAX_C; cc++)
            if (cc < C) {
                a += va[cc];
                b += vb[cc];
            }
        float hv = 0.0f;
        if (row < dA.rows) {
            const float y = a * s2A + (dA.bias ? dA.bias[(int64_t)e * rows_p + row] : 0.0f);
            const float v = b * s2B + (dB.bias ? dB.bias[(int64_t)e * rows_p + row] : 0.0f);
            hv = act_fn(p.act, y, v, p.alpha, p.limit);
        }
        __nv_bfloat16 hb = __float2bfloat16_rn(hv * 128.0f);
        p.h[(int64_t)pos * p.hstride + kperm_pos(row)] = *(uint16_t *)&hb;
    }
    if (lane == 0) atomicExch(ctr, 0u);
}

/* Down's K (the experts' I, padded to 128) in segments: 1 .. SK_DN_SEGS. */
#define SK_DN_SEGS 4

/* One expert's down weights for a warp's 16 rows, every segment. */
template <int NSEG>
struct sk_dn_w {
    uint4 wa[NSEG][1], wb[NSEG][1];
    uint32_t ca[NSEG][1], cb[NSEG][1];
};

template <int NSEG, bool MX, bool PRE>
static __device__ __forceinline__ void sk_dn_load(const fm_dmat &dA, int e, int rg, int lane, uint64_t pol,
                                                  sk_dn_w<NSEG> &w) {
    const uint8_t *pa[1], *pb[1], *sa[1], *sb[1], *st[1];
    fm_tile_ptrs<1, MX>(dA, dA, e, (int64_t)rg * NSEG, lane, pa, pb, sa, sb, st);
#pragma unroll
    for (int s = 0; s < NSEG; s++) fm_load_seg<1, MX, PRE>(pa, pb, sa, sb, s, pol, w.wa[s], w.wb[s], w.ca[s], w.cb[s]);
}

/*
 * Down. Block b owns output rows 16b .. 16b + 15 for the T <= 8 * NT
 * tokens. Experts j = 0 .. n_active - 1 (routed) and j = n_active (the
 * shared expert) go to warp j % 8, each warp loading its next expert's
 * weights while it multiplies the current one's; for each, the B operand
 * column of token n is that token's h row for the expert (or zero), and
 * the sums are added times the token's routing weight.
 */
template <int NT, int NSEG, bool MX, int MINB>
__global__ void __launch_bounds__(32 * SK_WARPS, MINB) fm_splitk_down_kernel(fm_expert_params p) {
    __shared__ float red[SK_WARPS][NT * 4][32];
    __shared__ int colpos[SK_WARPS][8 * NT];
    __shared__ float colw[SK_WARPS][8 * NT];
    const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int rg = (int)blockIdx.x, r0 = rg * 16;
    const uint64_t wpol = l2_evict_first();
    /* the routing is final: gate/up's routed blocks waited for it before
     * letting this grid launch (read through L2, as in fm_get_item) */
    const int n_act = p.down.n ? __ldcg(p.n_active) : 0;
    const int J = n_act + (p.sdown.n ? 1 : 0);
    float tot[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) tot[n][i] = 0.0f;
    sk_dn_w<NSEG> cur, nxt;
    int j = wi;
    int e = j < J ? (j == n_act ? 0 : __ldcg(p.act_e + j)) : 0;
    if (j < J) sk_dn_load<NSEG, MX, true>(j == n_act ? p.sdown : p.down, e, rg, lane, wpol, cur);
    bool waited = false;
    for (; j < J; j += SK_WARPS) {
        const bool shared = j == n_act;
        const fm_dmat &dA = shared ? p.sdown : p.down;
        const int jn = j + SK_WARPS;
        const int en = jn < J ? (jn == n_act ? 0 : __ldcg(p.act_e + jn)) : 0;
        if (jn < J) sk_dn_load<NSEG, MX, false>(jn == n_act ? p.sdown : p.down, en, rg, lane, wpol, nxt);
        /* the token columns: h row and weight of each token for this
         * expert (hash routing may pick an expert twice for a token: the
         * weights add, the h rows are equal) */
        if (lane < 8 * NT) {
            int pos = -1;
            float w = 0.0f;
            if (lane < p.T) {
                if (shared) {
                    pos = p.T * p.k + lane;
                    w = 1.0f;
                } else {
                    const int off = __ldcg(p.act_off + j), cnt = __ldcg(p.act_cnt + j);
                    for (int q = 0; q < cnt; q++)
                        if (__ldcg(p.sorted_tok + off + q) == lane) {
                            pos = off + q;
                            w += __ldcg(p.sorted_w + off + q);
                        }
                }
            }
            colpos[wi][lane] = pos;
            colw[wi][lane] = w;
        }
        __syncwarp();
        if (!waited) {
            pdl_wait(); /* h is gate/up's */
            pdl_launch_dependents();
            waited = true;
        }
        float acc[NT][1][4];
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[n][0][i] = 0.0f;
#pragma unroll
        for (int n = 0; n < NT; n++) {
            const int cp = colpos[wi][8 * n + g];
            const uint16_t *src = cp >= 0 ? p.h + (int64_t)cp * p.hstride + t * 32 : NULL;
            uint4 xb[NSEG][4];
#pragma unroll
            for (int s = 0; s < NSEG; s++)
#pragma unroll
                for (int d = 0; d < 4; d++) xb[s][d] = sk_ld_x(src, s, d);
#pragma unroll
            for (int s = 0; s < NSEG; s++) sk_seg<1, MX>(acc[n], cur.wa[s], cur.wb[s], cur.ca[s], cur.cb[s], xb[s]);
        }
        const float s2 = fm_nv_s2<MX>(dA.scale2[e]);
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int row = r0 + g + (i >= 2 ? 8 : 0), col = 8 * n + 2 * t + (i & 1);
                const float w = colw[wi][col];
                const float bias = dA.bias && row < dA.rows ? dA.bias[(int64_t)e * dA.rows_p + row] : 0.0f;
                tot[n][i] += w * (acc[n][0][i] * s2 + bias);
            }
        __syncwarp();
        cur = nxt;
        e = en;
    }
    if (!waited) {
        pdl_wait();
        pdl_launch_dependents();
    }
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) red[wi][n * 4 + i][lane] = tot[n][i];
    __syncthreads();
    if (wi != 0) return;
    /* the warps' sums in warp order: the same bits whatever order the
     * blocks and warps ran in */
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float v = 0.0f;
            for (int w = 0; w < SK_WARPS; w++) v += red[w][n * 4 + i][lane];
            const int row = r0 + g + (i >= 2 ? 8 : 0), tok = 8 * n + 2 * t + (i & 1);
            if (row < p.H && tok < p.T) p.out[(int64_t)tok * p.H + row] = v;
        }
}

typedef void (*sk_dn_kfn)(fm_expert_params);
/* three: blocks of three per SM (at most 80 registers: one token tile,
 * K <= 256, where that needs no spills) */
template <int NT, bool MX>
static sk_dn_kfn sk_dn_for(int nseg, bool three) {
    switch (nseg) {
    case 1: return fm_splitk_down_kernel<NT, 1, MX, 2>;
    case 2:
        if constexpr (NT == 1)
            if (three) return fm_splitk_down_kernel<NT, 2, MX, 3>;
        return fm_splitk_down_kernel<NT, 2, MX, 2>;
    case 3: return fm_splitk_down_kernel<NT, 3, MX, 2>;
    case 4: return fm_splitk_down_kernel<NT, 4, MX, 2>;
    }
    return NULL;
}

extern "C" fm_status fm_cuda_launch_splitk(const fm_expert_params *p, int C, int nt, int pdl, cudaStream_t s) {
    if (C < 1 || C > FM_SPLITK_MAX_C) return fm_error(FM_E_ARG, "splitk path: %d K chunks (1 .. %d)", C, FM_SPLITK_MAX_C);
    if (p->T > 8 * nt || (nt != 1 && nt != 2))
        return fm_error(FM_E_ARG, "splitk path: %d tokens with tile_n %d (at most 16 tokens)", p->T, 8 * nt);
    const fm_dmat &dn = p->down.n ? p->down : p->sdown;
    static_assert(SK_DN_SEGS * FM_KSEG == FM_SPLITK_MAX_I, "the down K the host allows");
    if (dn.kp > SK_DN_SEGS * FM_KSEG || (p->sdown.n && p->sdown.kp > SK_DN_SEGS * FM_KSEG))
        return fm_error(FM_E_UNSUPPORTED, "splitk path: experts of I up to %d (this layer's down has K %d)",
                        SK_DN_SEGS * FM_KSEG, dn.kp);
    if (p->down.n && p->sdown.n && p->sdown.kp != p->down.kp)
        return fm_error(FM_E_UNSUPPORTED, "splitk path: the shared expert's I (K %d) differs from the routed experts' "
                                          "(K %d)", p->sdown.kp, p->down.kp);
    const int nrg_s = p->sgate.n ? p->sgate.rows_p / 16 : 0;
    /* The shared expert's units must fill whole blocks: a block of them lets
     * down launch without waiting for the routing, which down then reads
     * before its own wait; a block holding routed units too would do so
     * before those waited. Gate/up rows are padded to 128 (8 row groups). */
    if ((nrg_s * C) % SK_WARPS)
        return fm_error(FM_E_UNSUPPORTED, "splitk path: the shared expert's %d row groups x %d chunks do not fill "
                                          "blocks of %d warps", nrg_s, C, SK_WARPS);
    const int nseg = dn.kp / FM_KSEG;
    const bool three = fm_sched_splitk_down_per_sm(dn.rows_p, nt, nseg, p->sms) == 3;
    sk_dn_kfn fn = nt == 1 ? (p->mx ? sk_dn_for<1, true>(nseg, three) : sk_dn_for<1, false>(nseg, three))
                           : (p->mx ? sk_dn_for<2, true>(nseg, three) : sk_dn_for<2, false>(nseg, three));
    if (!fn) return fm_error(FM_E_UNSUPPORTED, "splitk path: down K of %d segments", nseg);
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.blockDim = dim3(32 * SK_WARPS);
    cfg.stream = s;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    const long long gu_blocks =
        fm_sched_splitk_gu_blocks(p->gate.n ? p->gate.rows_p : 0, p->sgate.n ? p->sgate.rows_p : 0, p->max_active, C);
    if (gu_blocks > 0x7fffffff) return fm_error(FM_E_RANGE, "splitk gate/up grid of %lld blocks is too large", gu_blocks);
    if (gu_blocks > 0) {
        cfg.gridDim = dim3((unsigned)gu_blocks);
        const size_t smem = (size_t)SK_WARPS * SK_GU_XBYTES;
        cfg.dynamicSmemBytes = smem;
        void (*gu)(fm_expert_params, int) = p->mx ? fm_splitk_gu_kernel<true> : fm_splitk_gu_kernel<false>;
        FM_CU(cudaFuncSetAttribute(gu, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        FM_CU(cudaLaunchKernelEx(&cfg, gu, *p, C));
        cfg.dynamicSmemBytes = 0;
        FM_CU_LAUNCH("fm_splitk_gu_kernel");
    }
    cfg.gridDim = dim3((unsigned)(dn.rows_p / 16));
    FM_CU(cudaLaunchKernelEx(&cfg, fn, *p));
    FM_CU_LAUNCH("fm_splitk_down_kernel");
    return FM_OK;
}
