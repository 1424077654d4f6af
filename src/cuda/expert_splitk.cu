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
 * One token with a shared expert as wide as the routed ones (sm_90): both
 * in one launch instead (fm_fused1_kernel below), whose blocks copy down's
 * weights while gate/up's stream, so that down no longer starts only as
 * gate/up's blocks leave the SMs.
 *
 * The weight stream, decode and MMAs are the mma.sync kernels'
 * (expert_mma.cu, expert_common.cuh).
 */
#include "expert_common.cuh"
#include "schedule.h"
#include "route_pick.cuh"

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

/* n (<= MAXC) chunks' partial pairs (a at q, b at q + boff; chunk c at
 * q + c * cstride), every one loaded before the first add (one L2 round
 * trip), then added in chunk order: the same bits on every run */
template <int MAXC>
static __device__ __forceinline__ void sum_chunks(const float *q, int cstride, int boff, int n, float &a, float &b) {
    float va[MAXC], vb[MAXC];
#pragma unroll
    for (int c = 0; c < MAXC; c++) {
        const float *r = q + min(c, n - 1) * cstride;
        va[c] = __ldcg(r);
        vb[c] = __ldcg(r + boff);
    }
    a = b = 0.0f;
#pragma unroll
    for (int c = 0; c < MAXC; c++)
        if (c < n) {
            a += va[c];
            b += vb[c];
        }
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
        float a, b;
        sum_chunks<FM_SPLITK_MAX_C>(part + ((int64_t)pos * 2) * rstride + row, P * 2 * rstride, rstride, C, a, b);
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

/*
 * One token, gate/up and down in one launch, one block per SM. Block
 * (slot s, slice j) of k x G (G: the experts' row groups of 16 gate/up
 * rows) owns, of the routed expert in slot s, row group j of gate and up
 * over the whole K and down's row groups of slice j; and of the shared
 * expert, K chunk s of row group j and sub-slice s of down's slice j, which
 * it computes while the routing is still running. As soon as it knows its
 * expert it has the copy engine bring all of those weights into shared
 * memory (TMA bulk copies, sm_90 and later: a warp's K range of gate and
 * up in three pieces, each with its barrier, so that the warp multiplies
 * what has landed while the rest streams in; down's slice in one), so that
 * down's bytes stream with gate/up's instead of after them. Gate/up's sums are
 * added in warp order (the shared expert's K chunks by the last block of
 * the row group to arrive, in chunk order) and h goes to global memory with
 * a counter per expert; once an expert's G blocks have counted in (and the
 * shared expert's), each block multiplies its down rows by the whole h and
 * adds them, weighted, into the output with atomics (the order of those
 * adds varies from run to run, as on the wgmma and mma.sync paths). Blocks wait
 * on each other, so the whole grid must be resident (the launch checks; the
 * next grid is let in only once every block has passed its waits). Counters
 * in sk_cnt, zero between calls (the grid's last block resets the
 * per-expert ones): hcnt[k], shrg[G], shh, G unused, done. Partials in
 * sk_part: [k + 1][H] unused, then the shared expert's gate/up chunks
 * [k][G][32].
 */
/* the most routed experts per token the fused kernel takes */
#define FU_MAXK FM_FUSED1_MAXK
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FU_BODY 1
/* gate/up copies per warp in this many pieces */
#define FU_NCH 3
static __device__ __forceinline__ void fu_red_release(unsigned *q, unsigned v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(q), "r"(v) : "memory");
}
static __device__ __forceinline__ unsigned fu_atom_acq_rel(unsigned *q, unsigned v) {
    unsigned o;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(o) : "l"(q), "r"(v) : "memory");
    return o;
}
static __device__ __forceinline__ unsigned fu_ld_acquire(const unsigned *q) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(q) : "memory");
    return v;
}
static __device__ __forceinline__ void fu_bar_init(uint32_t bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar));
}
/* bytes a barrier's phase waits for, without arriving; then one arrival */
static __device__ __forceinline__ void fu_expect(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
static __device__ __forceinline__ void fu_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
static __device__ __forceinline__ void fu_bulk_x(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
static __device__ __forceinline__ void fu_bulk(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar, uint64_t pol) {
    if (bytes)
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(dst),
                     "l"(src), "r"(bytes), "r"(bar), "l"(pol)
                     : "memory");
}
static __device__ __forceinline__ void fu_bar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done = 0;
    while (!done)
        asm volatile("{ .reg .pred P; mbarrier.try_wait.parity.shared::cta.b64 P, [%1], %2; selp.u32 %0, 1, 0, P; }"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
}
/* segments [s0, s1) of row group rg of gate and up into their places (one
 * thread issues; bytes counted on bar) */
template <bool MX>
static __device__ __forceinline__ void fu_cp_gu(uint32_t sm, const fm_fused1_layout &L, const fm_dmat &dA, const fm_dmat &dB,
                                                int e, int rg, int nseg, int s0, int s1, uint32_t bar, uint64_t pol) {
    const int spr = MX ? 4 : 8, n = s1 - s0;
    const int64_t tile = (int64_t)rg * nseg + s0;
    fu_expect(bar, (uint32_t)(n * 2 * (1024 + 16 * spr)));
    fu_bulk(sm + L.gw + s0 * 1024, dA.packed + (int64_t)e * dA.pstride + tile * 1024, n * 1024, bar, pol);
    fu_bulk(sm + L.uw + s0 * 1024, dB.packed + (int64_t)e * dB.pstride + tile * 1024, n * 1024, bar, pol);
    fu_bulk(sm + L.gs + s0 * 16 * spr, dA.scales + (int64_t)e * dA.sstride + tile * 16 * spr, n * 16 * spr, bar, pol);
    fu_bulk(sm + L.us + s0 * 16 * spr, dB.scales + (int64_t)e * dB.sstride + tile * 16 * spr, n * 16 * spr, bar, pol);
}
/* down's row groups [r0, r1) (weights, then scales) to dst */
template <bool MX>
static __device__ __forceinline__ void fu_cp_dn(uint32_t dst, const fm_dmat &dD, int e, int r0, int r1, int nseg_d,
                                                uint32_t bar, uint64_t pol) {
    const int spr = MX ? 4 : 8, n = (r1 - r0) * nseg_d;
    fu_expect(bar, (uint32_t)(n * (1024 + 16 * spr)));
    fu_bulk(dst, dD.packed + (int64_t)e * dD.pstride + (int64_t)r0 * nseg_d * 1024, n * 1024, bar, pol);
    fu_bulk(dst + n * 1024, dD.scales + (int64_t)e * dD.sstride + (int64_t)r0 * nseg_d * 16 * spr, n * 16 * spr, bar,
            pol);
}

/* a lane's share of a 16-row tile in shared memory: its weights w (two
 * 512-byte halves) and its scales sc */
template <bool MX>
static __device__ __forceinline__ void fu_tile(const unsigned char *w, const unsigned char *sc, int lane, uint4 &w0, uint4 &w1,
                                               uint32_t &c0, uint32_t &c1) {
    const int g = lane >> 2, t = lane & 3, spr = MX ? 4 : 8;
    w0 = *(const uint4 *)(w + lane * 16);
    w1 = *(const uint4 *)(w + 512 + lane * 16);
    const unsigned char *sp = sc + g * spr + (MX ? t : 2 * t);
    c0 = MX ? (uint32_t)sp[0] : (uint32_t)*(const uint16_t *)sp;
    c1 = MX ? (uint32_t)sp[8 * spr] : (uint32_t)*(const uint16_t *)(sp + 8 * spr);
}
/* the token's column of segment S of the activations v in shared memory
 * (lanes of row 0; the other columns zero) */
static __device__ __forceinline__ void fu_col(const unsigned char *v, int S, int lane, uint4 (&xb)[4]) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int d = 0; d < 4; d++)
        xb[d] = g == 0 ? *(const uint4 *)(v + (S * FM_KSEG + t * 32 + d * 8) * 2) : make_uint4(0, 0, 0, 0);
}
/* a warp's gate/up sums over segments [s0, s1) in shared memory, x the
 * token's row in shared memory */
template <bool MX>
static __device__ __forceinline__ void fu_gu(float (&acc)[2][4], const unsigned char *sm, const fm_fused1_layout &L, int s0,
                                             int s1, int lane) {
    const int spr = MX ? 4 : 8;
    for (int S = s0; S < s1; S++) {
        uint4 wa[2], wb[2], xb[4];
        uint32_t ca[2], cb[2];
#pragma unroll
        for (int m = 0; m < 2; m++)
            fu_tile<MX>(sm + (m ? L.uw : L.gw) + S * 1024, sm + (m ? L.us : L.gs) + S * 16 * spr, lane, wa[m], wb[m], ca[m],
                        cb[m]);
        fu_col(sm + L.x, S, lane, xb);
        sk_seg<2, MX>(acc, wa, wb, ca, cb, xb);
    }
}
/* one down row group (16 rows, K of nseg_d segments) from shared memory
 * times the h row in shared memory: the token's column (rows g, g + 8) */
template <bool MX>
static __device__ __forceinline__ void fu_dn(float (&acc)[1][4], const unsigned char *wbase, const unsigned char *sbase,
                                             const unsigned char *hs, int nseg_d, int lane) {
    const int spr = MX ? 4 : 8;
#pragma unroll
    for (int s = 0; s < SK_DN_SEGS; s++) {
        if (s >= nseg_d) break;
        uint4 w0[1], w1[1], xb[4];
        uint32_t c0[1], c1[1];
        fu_tile<MX>(wbase + s * 1024, sbase + s * 16 * spr, lane, w0[0], w1[0], c0[0], c1[0]);
        fu_col(hs, s, lane, xb);
        sk_seg<1, MX>(acc, w0, w1, c0, c1, xb);
    }
}
/* the 8 warps' sums of a row group added in warp order: thread r < 16
 * gets row r's gate and up sums */
static __device__ __forceinline__ void fu_reduce(float (&red)[SK_WARPS][2][16], const float (&acc)[2][4], float &a,
                                                 float &b) {
    const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    if (t == 0) {
        red[wi][0][g] = acc[0][0];
        red[wi][0][g + 8] = acc[0][2];
        red[wi][1][g] = acc[1][0];
        red[wi][1][g + 8] = acc[1][2];
    }
    __syncthreads();
    a = b = 0.0f;
    if (threadIdx.x < 16)
        for (int w = 0; w < SK_WARPS; w++) {
            a += red[w][0][threadIdx.x];
            b += red[w][1][threadIdx.x];
        }
}
template <bool MX>
static __device__ __forceinline__ uint16_t fu_h(const fm_expert_params &p, const fm_dmat &dA, const fm_dmat &dB, int e,
                                                int row, float a, float b) {
    float hv = 0.0f;
    if (row < dA.rows) {
        const float y = a * fm_nv_s2<MX>(dA.scale2[e]) + (dA.bias ? dA.bias[(int64_t)e * dA.rows_p + row] : 0.0f);
        const float v = b * fm_nv_s2<MX>(dB.scale2[e]) + (dB.bias ? dB.bias[(int64_t)e * dB.rows_p + row] : 0.0f);
        hv = act_fn(p.act, y, v, p.alpha, p.limit);
    }
    __nv_bfloat16 hb = __float2bfloat16_rn(hv * 128.0f);
    return *(uint16_t *)&hb;
}

#endif

/* RK: 0 where the selection kernel grouped the routing (act_e ...); an
 * elementwise routing family where every block selects the token's top-k
 * itself from the logits' K slices (rp) as soon as the logits grid is done,
 * and makes the token's activations from rp.x before that */
template <bool MX, int RK>
__global__ void __launch_bounds__(32 * SK_WARPS, 1) fm_fused1_kernel(fm_expert_params p, fm_fused1_layout L,
                                                                      fm_route_params rp) {
#ifdef FU_BODY
    extern __shared__ __align__(128) unsigned char fu_smem[];
    __shared__ float red[SK_WARPS][2][16];
    __shared__ int flag;
    __shared__ __align__(8) uint64_t bars[SK_WARPS * FU_NCH + 2];
    /* the picks in the order the top-k finds them, [RT_MAXK]: how many */
    __shared__ int pk_ord[RT_MAXK + 1];
    __shared__ float pk_ow[RT_MAXK];
    const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5, tid = threadIdx.x;
    const int G = p.gate.rows_p / 16, KS = p.max_active;
    const int s = (int)blockIdx.x / G, j = (int)blockIdx.x % G;
    const int nseg = p.gate.kp / FM_KSEG, nrg_d = p.down.rows_p / 16, nseg_d = p.down.kp / FM_KSEG;
    const uint32_t sm = (uint32_t)__cvta_generic_to_shared(fu_smem), bar0 = (uint32_t)__cvta_generic_to_shared(bars);
    /* barriers: warp w's FU_NCH pieces of gate/up copies, then down's, then
     * the shared expert's phase */
    const uint32_t bar_w = bar0 + 8 * FU_NCH * wi, bar_dn = bar0 + 8 * FU_NCH * SK_WARPS, bar_sh = bar_dn + 8;
    const uint64_t wpol = l2_evict_first();
    unsigned *hcnt = p.sk_cnt + s, *shrg = p.sk_cnt + KS + j, *shh = p.sk_cnt + KS + G,
             *done = shh + 1 + G;
    const int d0 = j * nrg_d / G, d1 = (j + 1) * nrg_d / G;
    const int q0 = d0 + s * (d1 - d0) / KS, q1 = d0 + (s + 1) * (d1 - d0) / KS;
    const int c0 = s * nseg / KS, c1 = (s + 1) * nseg / KS;
    const int w0 = wi * nseg / SK_WARPS, w1 = (wi + 1) * nseg / SK_WARPS;
    if (tid == 0) {
        pk_ord[RT_MAXK] = 0;
        for (int i = 0; i < SK_WARPS * FU_NCH + 2; i++) fu_bar_init(bar0 + 8 * i);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        /* the shared expert, before the routing is known: the token's x,
         * K chunk s of row group j of gate and up, the down sub-slice */
        if (!RK) {
            fu_expect(bar_sh, (uint32_t)(p.Hp * 2));
            fu_bulk_x(sm + L.x, p.x_prep, (uint32_t)(p.Hp * 2), bar_sh);
        }
        fu_cp_gu<MX>(sm, L, p.sgate, p.sup, 0, j, nseg, c0, c1, bar_sh, wpol);
        fu_cp_dn<MX>(sm + L.sdn, p.sdown, 0, q0, q1, nseg_d, bar_sh, wpol);
        fu_arrive(bar_sh);
    }
    if (RK) {
        /* the token's activations as the logits kernel writes x_prep: the
         * previous layer wrote x before the logits grid passed its wait */
        const int perm[8] = {0, 4, 1, 5, 2, 6, 3, 7};
        for (int c = tid * 8; c < p.Hp; c += 8 * 32 * SK_WARPS) {
            const float4 v0 = c < rp.H ? load_x4(rp.x, rp.xdt, c) : make_float4(0, 0, 0, 0);
            const float4 v1 = c + 4 < rp.H ? load_x4(rp.x, rp.xdt, c + 4) : make_float4(0, 0, 0, 0);
            const float xv[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
            *(uint4 *)(fu_smem + L.x + c * 2) = prep8(xv, perm);
        }
    }
    __syncthreads();
    fu_bar_wait(bar_sh, 0);
    {
        float acc[2][4] = {};
        for (int S = c0 + wi; S < c1; S += SK_WARPS) fu_gu<MX>(acc, fu_smem, L, S, S + 1, lane);
        float a, b;
        fu_reduce(red, acc, a, b);
        float *part = p.sk_part + (int64_t)(KS + 1) * p.H;
        if (tid < 16) {
            __stcg(part + ((int64_t)s * G + j) * 32 + tid, a);
            __stcg(part + ((int64_t)s * G + j) * 32 + 16 + tid, b);
        }
        __syncthreads();
        if (tid == 0) flag = fu_atom_acq_rel(shrg, 1u) == (unsigned)KS - 1;
        __syncthreads();
        if (flag) {
            /* the last chunk of row group j: the chunks in order, h */
            if (tid < 16) {
                float sa, sb;
                sum_chunks<FU_MAXK>(part + j * 32 + tid, G * 32, 16, KS, sa, sb);
                const int row = j * 16 + tid;
                p.h[(int64_t)p.T * p.k * p.hstride + kperm_pos(row)] = fu_h<MX>(p, p.sgate, p.sup, 0, row, sa, sb);
            }
            __syncthreads();
            if (tid == 0) {
                atomicExch(shrg, 0u);
                fu_red_release(shh, 1u);
            }
        }
    }
    /* the gate/up region is read; the copy engine refills it below */
    __syncthreads();
    /* the routed expert of slot s */
    pdl_wait();
    __shared__ int pk_e[RT_MAXK];
    __shared__ float pk_w[RT_MAXK];
    int n_act, e;
    if (RK) {
        /* the token's top-k in the scratch past the layout; slot s takes
         * the s-th pick as soon as warp 0 finds it (the weights once its
         * pick is done), so the first slots' copies start k - 1 rounds
         * before the last's */
        unsigned char *ws = fu_smem + L.total;
        select_scores_block<RK>(rp, 0, ws, tid, 32 * SK_WARPS);
        __syncthreads();
        if (wi == 0) select_pick<RK>(rp, 0, ws, pk_e, pk_w, blockIdx.x == 0, pk_ord, pk_ow);
        else
            while (((volatile int *)pk_ord)[RT_MAXK] <= s) __nanosleep(20); /* leave warp 0 the issue slots */
        n_act = rp.k;
        e = ((volatile int *)pk_ord)[s];
    } else {
        n_act = __ldcg(p.n_active);
        e = __ldcg(p.act_e + s);
    }
    e = min(max(e, 0), p.gate.n - 1);
    const bool routed = s < n_act;
    if (routed && lane == 0) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        /* warp 0 still picks where the block selects: warp 1 issues its
         * copies and down's */
        const int nw = !RK ? 1 : wi == 0 ? 0 : wi == 1 ? 2 : 1;
        for (int q = 0; q < nw; q++) {
            const int ww = RK && wi == 1 ? q : wi;
            const int a0 = ww * nseg / SK_WARPS, a1 = (ww + 1) * nseg / SK_WARPS;
            for (int c = 0; c < FU_NCH; c++) {
                fu_cp_gu<MX>(sm, L, p.gate, p.up, e, j, nseg, a0 + c * (a1 - a0) / FU_NCH, a0 + (c + 1) * (a1 - a0) / FU_NCH,
                             bar0 + 8 * FU_NCH * ww + 8 * c, wpol);
                fu_arrive(bar0 + 8 * FU_NCH * ww + 8 * c);
            }
        }
        if (wi == (RK ? 1 : 0)) {
            fu_cp_dn<MX>(sm + L.dn, p.down, e, d0, d1, nseg_d, bar_dn, wpol);
            fu_arrive(bar_dn);
        }
    }
    /* the grouping the selection kernel would have written (warp 0 of
     * block 0 holds the ascending picks) */
    if (RK && blockIdx.x == 0 && wi == 0) group_one_token(rp, pk_e, pk_w);
    int pos0 = 0;
    float wsum = 0.0f;
    if (routed && RK) {
        pos0 = s; /* its weight once warp 0 is done (below) */
    } else if (routed) {
        pos0 = __ldcg(p.act_off + s);
        const int cnt = __ldcg(p.act_cnt + s);
        for (int q = 0; q < cnt; q++) wsum += __ldcg(p.sorted_w + pos0 + q);
    }
    if (routed) {
        float acc[2][4] = {};
        for (int c = 0; c < FU_NCH; c++) {
            fu_bar_wait(bar_w + 8 * c, 0);
            fu_gu<MX>(acc, fu_smem, L, w0 + c * (w1 - w0) / FU_NCH, w0 + (c + 1) * (w1 - w0) / FU_NCH, lane);
        }
        float a, b;
        fu_reduce(red, acc, a, b);
        if (tid < 16) {
            const int row = j * 16 + tid;
            p.h[(int64_t)pos0 * p.hstride + kperm_pos(row)] = fu_h<MX>(p, p.gate, p.up, e, row, a, b);
        }
        __syncthreads();
    }
    if (tid == 0) {
        if (routed) {
            fu_red_release(hcnt, 1u);
            while (fu_ld_acquire(hcnt) < (unsigned)G) __nanosleep(32);
        }
        while (fu_ld_acquire(shh) < (unsigned)G) __nanosleep(32);
    }
    __syncthreads();
    if (RK && routed) wsum = pk_ow[s];
    /* every block of the grid is resident or done: the next grid may start */
    pdl_launch_dependents();
    /* both h rows into shared memory */
    unsigned char *hsr = fu_smem + L.h, *hss = hsr + nseg_d * FM_KSEG * 2;
    for (int i = tid; i < nseg_d * FM_KSEG / 8; i += 32 * SK_WARPS) {
        if (routed) *(uint4 *)(hsr + i * 16) = __ldcg((const uint4 *)(p.h + (int64_t)pos0 * p.hstride) + i);
        *(uint4 *)(hss + i * 16) = __ldcg((const uint4 *)(p.h + (int64_t)p.T * p.k * p.hstride) + i);
    }
    if (routed) fu_bar_wait(bar_dn, 0);
    __syncthreads();
    /* down: the routed slice's row groups, then the shared sub-slice's,
     * added into the output (zeroed by the logits kernel) in whatever order
     * the blocks finish: no per-slice counter, no reload of every expert's
     * rows by the slice's last block */
    const int nr = routed ? d1 - d0 : 0, ntask = nr + (q1 - q0), spr = MX ? 4 : 8;
    const float s2r = fm_nv_s2<MX>(p.down.scale2[e]), s2s = fm_nv_s2<MX>(p.sdown.scale2[0]);
    for (int i = wi; i < ntask; i += SK_WARPS) {
        const bool sh = i >= nr;
        const int r = sh ? q0 + (i - nr) : d0 + i, li = sh ? i - nr : i, nn = (sh ? q1 - q0 : d1 - d0) * nseg_d;
        const unsigned char *base = fu_smem + (sh ? L.sdn : L.dn);
        float acc1[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
        fu_dn<MX>(acc1, base + (size_t)li * nseg_d * 1024, base + (size_t)nn * 1024 + (size_t)li * nseg_d * 16 * spr,
                  sh ? hss : hsr, nseg_d, lane);
        if ((lane & 3) == 0) {
            const fm_dmat &dD = sh ? p.sdown : p.down;
            const int ee = sh ? 0 : e;
#pragma unroll
            for (int ii = 0; ii < 4; ii += 2) {
                const int row = r * 16 + (lane >> 2) + (ii ? 8 : 0);
                if (row < p.H) {
                    const float bias = dD.bias && row < dD.rows ? dD.bias[(int64_t)ee * dD.rows_p + row] : 0.0f;
                    atomicAdd(p.out + row, (sh ? 1.0f : wsum) * (acc1[0][ii] * (sh ? s2s : s2r) + bias));
                }
            }
        }
    }
    /* the grid's last block resets the per-expert counters: every block
     * has passed its waits */
    if (tid == 0 && atomicAdd(done, 1u) == gridDim.x - 1) {
        for (int i = 0; i < KS; i++) p.sk_cnt[i] = 0;
        *shh = 0;
        *done = 0;
    }
#else
    (void)p;
    (void)L;
#endif
}

typedef void (*fu_kfn)(fm_expert_params, fm_fused1_layout, fm_route_params);
/* the one-token launch for the format and, where it selects the top-k
 * itself, the routing family (0: it reads the selection kernel's grouping) */
static fu_kfn fu_kernel_for(int mx, int rk) {
    switch (rk) {
    case FM_ROUTE_NOAUX_TC:
        return mx ? fm_fused1_kernel<true, FM_ROUTE_NOAUX_TC> : fm_fused1_kernel<false, FM_ROUTE_NOAUX_TC>;
    case FM_ROUTE_DSV4: return mx ? fm_fused1_kernel<true, FM_ROUTE_DSV4> : fm_fused1_kernel<false, FM_ROUTE_DSV4>;
    default: return mx ? fm_fused1_kernel<true, 0> : fm_fused1_kernel<false, 0>;
    }
}

extern "C" int fm_cuda_fused1_selects(const fm_expert_params *p, const fm_route_params *rp) {
    return !rp->pre_ids && rp->T == 1 && rp->k <= FM_FUSED1_MAXK &&
           !fm_sched_fused1_selects(rp->route, rp->hash, rp->E);
}

/* Whether the one-token launch takes this call (a device of compute
 * capability cc_major): the checks of fm_fused1_kernel's shape, its
 * shared memory, and every block resident at once. */
extern "C" int fm_cuda_fused1_fits(const fm_expert_params *p, int cc) {
    static_assert(SK_DN_SEGS == 4, "the rule takes down's K up to 4 segments (I <= 512)");
    fm_fused1_shape sh;
    sh.T = p->T;
    sh.k_active = p->max_active;
    sh.Hp = p->Hp;
    sh.gate_rows_p = p->gate.n ? p->gate.rows_p : 0;
    sh.gate_kp = p->gate.kp;
    sh.down_rows_p = p->down.rows_p;
    sh.down_kp = p->down.kp;
    sh.sgate_rows_p = p->sgate.n ? p->sgate.rows_p : 0;
    sh.sgate_kp = p->sgate.kp;
    sh.sdown_rows_p = p->sdown.rows_p;
    sh.sdown_kp = p->sdown.kp;
    sh.mx = p->mx;
    sh.E = p->gate.n;
    fm_fused1_layout L;
    if (fm_sched_fused1_why(&sh, cc, p->smem_optin, p->sms, &L)) return 0;
    const int G = p->gate.rows_p / 16;
    /* every build of it resident (those that select hold a little more
     * static shared memory and registers), whichever a call takes */
    static const int rks[] = {0, FM_ROUTE_NOAUX_TC, FM_ROUTE_DSV4};
    for (int i = 0; i < 3; i++) {
        fu_kfn k = fu_kernel_for(p->mx, rks[i]);
        const int smem = L.total + (rks[i] ? (int)FM_FUSED1_SEL_BYTES(p->gate.n) : 0);
        int per = 0;
        if (cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess ||
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, k, 32 * SK_WARPS, smem) != cudaSuccess) {
            (void)cudaGetLastError();
            return 0;
        }
        if ((long long)per * p->sms < (long long)p->max_active * G) return 0;
    }
    return 1;
}

static fm_status fm_cuda_launch_fused1(const fm_expert_params *p, const fm_route_params *rp, int pdl, cudaStream_t s) {
    fm_fused1_layout L;
    if (p->T != 1 || !p->gate.n || !p->sgate.n ||
        fm_sched_fused1_layout(p->Hp, p->gate.rows_p, p->gate.kp, p->down.rows_p, p->down.kp, p->max_active, p->mx, &L))
        return fm_error(FM_E_UNSUPPORTED, "splitk path: the one-token launch takes one token with a shared expert "
                                          "(%d tokens, %s)", p->T, p->sgate.n ? "shared expert" : "no shared expert");
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.blockDim = dim3(32 * SK_WARPS);
    cfg.gridDim = dim3((unsigned)(p->max_active * (p->gate.rows_p / 16)));
    cfg.dynamicSmemBytes = L.total;
    cfg.stream = s;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    fm_route_params r0;
    memset(&r0, 0, sizeof r0);
    fu_kfn k = fu_kernel_for(p->mx, rp ? rp->route : 0);
    /* the selection's scratch past the layout */
    cfg.dynamicSmemBytes = L.total + (rp ? FM_FUSED1_SEL_BYTES(rp->E) : 0);
    FM_CU(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)cfg.dynamicSmemBytes));
    FM_CU(cudaLaunchKernelEx(&cfg, k, *p, L, rp ? *rp : r0));
    FM_CU_LAUNCH("fm_fused1_kernel");
    return FM_OK;
}

extern "C" fm_status fm_cuda_launch_splitk(const fm_expert_params *p, int C, int nt, int fused,
                                           const fm_route_params *rp, int pdl, cudaStream_t s) {
    if (fused) return fm_cuda_launch_fused1(p, rp, pdl, s);
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
