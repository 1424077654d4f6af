/*
 * The mma.sync expert kernels (sm_80 and later): gate/up (+ activation) and
 * down (+ routing weight and k-way combine), FP4 weights decoded in
 * registers into BF16 tensor-core operands (expert_common.cuh).
 *
 * Work: one thread block per (active expert, block of weight rows); blocks
 * reserved for experts that turned out inactive exit at once (the grid is
 * sized without a host sync). The shared expert, which every token uses,
 * has one block per (block of rows, chunk of 8 * NT tokens), first in the
 * grid. A warp owns 16 weight rows (the M of mma.m16n8k16) over a range of
 * K and the expert's tokens in N, 8 per MMA tile, NT tiles per pass. Warps
 * of a block either split K (small path, reduced through shared memory) or
 * own different rows (large path).
 *
 * Weights: each thread reads, per 128-wide K segment, 16 bytes (32 values)
 * of row g and of row g + 8 (g = lane / 4, t = lane % 4 picks the 32-value
 * piece), so a warp reads 64 contiguous bytes of 16 rows. The MMA's K order
 * is a permutation of the real K order, chosen so that the nibbles a thread
 * holds map to its A fragment with few instructions; the activations are
 * stored permuted the same way (route_logits.cu, the h store of fm_emit), so
 * each B fragment is one aligned 8-byte piece.
 */
#include "expert_common.cuh"

/* One 128-wide K segment: decode the thread's weights of rows g and g + 8
 * (both matrices) and run the MMAs against every token tile. */
template <int NT, int NMAT, bool MX>
static __device__ __forceinline__ void seg_compute(float (&acc)[NMAT][NT][4], const uint4 (&wa)[NMAT],
                                                   const uint4 (&wb)[NMAT], const uint32_t (&ca)[NMAT],
                                                   const uint32_t (&cb)[NMAT], const uint4 (&xb)[NT][4]) {
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
            uint32_t wA = d == 0 ? wa[m].x : d == 1 ? wa[m].y : d == 2 ? wa[m].z : wa[m].w;
            uint32_t wB = d == 0 ? wb[m].x : d == 1 ? wb[m].y : d == 2 ? wb[m].z : wb[m].w;
            uint32_t ra[4], rbv[4];
            decode8(wA, SA[d >> 1], ra);
            decode8(wB, SB[d >> 1], rbv);
#pragma unroll
            for (int n = 0; n < NT; n++) {
                mma16816(acc[m][n], ra[0], rbv[0], ra[1], rbv[1], xb[n][d].x, xb[n][d].y);
                mma16816(acc[m][n], ra[2], rbv[2], ra[3], rbv[3], xb[n][d].z, xb[n][d].w);
            }
        }
    }
}

/* The same with the activations read from global memory (L1) one 32-wide K
 * step at a time, both matrices per step: NT x 4 registers of activations
 * live instead of NT x 16, which keeps the 16-token gate/up tile within 128
 * registers (two 4-warp blocks per SM). */
template <int NT, int NMAT, bool MX>
static __device__ __forceinline__ void seg_compute_g(float (&acc)[NMAT][NT][4], const uint4 (&wa)[NMAT],
                                                     const uint4 (&wb)[NMAT], const uint32_t (&ca)[NMAT],
                                                     const uint32_t (&cb)[NMAT], const uint16_t *const (&src)[NT],
                                                     int s) {
    uint32_t SA[NMAT][2], SB[NMAT][2];
#pragma unroll
    for (int m = 0; m < NMAT; m++) {
        if (MX) {
            SA[m][0] = SA[m][1] = mx_scale_bits(ca[m] & 0xFF) * 0x10001u;
            SB[m][0] = SB[m][1] = mx_scale_bits(cb[m] & 0xFF) * 0x10001u;
        } else {
            nv_scale_pair(ca[m], SA[m][0], SA[m][1]);
            nv_scale_pair(cb[m], SB[m][0], SB[m][1]);
        }
    }
#pragma unroll
    for (int d = 0; d < 4; d++) {
        uint4 x[NT];
#pragma unroll
        for (int n = 0; n < NT; n++)
            x[n] = src[n] ? __ldg((const uint4 *)(src[n] + s * FM_KSEG) + d) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int m = 0; m < NMAT; m++) {
            uint32_t wA = d == 0 ? wa[m].x : d == 1 ? wa[m].y : d == 2 ? wa[m].z : wa[m].w;
            uint32_t wB = d == 0 ? wb[m].x : d == 1 ? wb[m].y : d == 2 ? wb[m].z : wb[m].w;
            uint32_t ra[4], rbv[4];
            decode8(wA, SA[m][d >> 1], ra);
            decode8(wB, SB[m][d >> 1], rbv);
#pragma unroll
            for (int n = 0; n < NT; n++) {
                mma16816(acc[m][n], ra[0], rbv[0], ra[1], rbv[1], x[n].x, x[n].y);
                mma16816(acc[m][n], ra[2], rbv[2], ra[3], rbv[3], x[n].z, x[n].w);
            }
        }
    }
}

/* K split across warps: the partial tiles summed in shared memory into the
 * first warp of each row group. */
template <int NT, int NMAT>
static __device__ __forceinline__ void reduce_k(float (&acc)[NMAT][NT][4], float *smem, int wi, int ks, int KS,
                                                int lane) {
    float *red = smem + (size_t)wi * (NMAT * NT * 4 * 32);
#pragma unroll
    for (int m = 0; m < NMAT; m++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) red[((m * NT + n) * 4 + i) * 32 + lane] = acc[m][n][i];
    __syncthreads();
    if (ks == 0) {
        for (int o = 1; o < KS; o++) {
            const float *r2 = smem + (size_t)(wi + o) * (NMAT * NT * 4 * 32);
#pragma unroll
            for (int m = 0; m < NMAT; m++)
#pragma unroll
                for (int n = 0; n < NT; n++)
#pragma unroll
                    for (int i = 0; i < 4; i++) acc[m][n][i] += r2[((m * NT + n) * 4 + i) * 32 + lane];
        }
    }
    __syncthreads();
}

/* Blocks of 256 threads per SM the compiler must fit (so registers per
 * thread <= 65536 / (256 * it)): 8-token tiles at 2 (128 registers), the
 * 8-token down at 4 (64 registers, no spills: at B = 1 its blocks fit one
 * wave); with the activations read per K step (XG) the 16-token tiles at 2
 * too and the 8-token down at 3. */
static constexpr int fm_min_blocks(int nt, int nmat, bool xg) {
    return !xg && nt == 1 && nmat == 1 ? 4
           : xg                      ? (nt == 1 && nmat == 1 ? 3 : nt <= 2 ? 2 : 1)
           : nt == 1                 ? 2
                                     : 1;
}

/*
 * NMAT = 2: gate and up of the same rows (the activation is applied in
 * registers, h goes to global as BF16 * 2^7, K-permuted for down).
 * NMAT = 1: down; the result times the routing weight is added into out.
 * Weights and scales of the next segment are loaded before the current one
 * is decoded, so every warp keeps two segments of loads in flight.
 */
template <int NT, int NMAT, bool MX, bool XG>
__global__ void __launch_bounds__(256, fm_min_blocks(NT, NMAT, XG)) fm_expert_kernel(fm_expert_params p, int W, int KS) {
    extern __shared__ float ex_smem[];
    const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int rgroups = W / KS, rg = wi / KS, ks = wi % KS;
    const int rpb = 16 * rgroups;
    const int nrb = ((NMAT == 2 ? p.gate.rows_p : p.down.rows_p) + rpb - 1) / rpb;

    /* down's blocks and the shared expert's issue their first two segments'
     * weight loads before the wait: their weights need no earlier grid */
    bool waited = !(NMAT == 1 || (int)blockIdx.x < p.sh_blocks);
    if (waited) {
        pdl_wait();
        pdl_launch_dependents();
    }

    fm_item it;
    if (!fm_get_item(p, nrb, it, (int)blockIdx.x)) return;
    const int e = it.e, pos0 = it.pos0, cnt = it.cnt;
    const bool shared = it.shared;
    /* field by field, so that the parameter structs stay in constant space */
    const fm_dmat &dA = NMAT == 2 ? (shared ? p.sgate : p.gate) : (shared ? p.sdown : p.down);
    const fm_dmat &dB = NMAT == 2 ? (shared ? p.sup : p.up) : dA;
    const int rows_p = dA.rows_p, kp = dA.kp;
    const int r0 = (it.rb * rgroups + rg) * 16;
    const int nseg = kp / FM_KSEG;
    /* Rows rows .. rows_p - 1 are zero in memory (weights and scales), so the
     * loads need no per-row predicate: only a warp whose 16 rows lie wholly
     * past rows_p (the grid's last row block) has nothing to load. */
    const bool wv = r0 < rows_p;
    const int s_begin = wv ? ks * nseg / KS : 0, s_end = wv ? (ks + 1) * nseg / KS : 0;
    const int64_t tile0 = (int64_t)((wv ? r0 : 0) / 16) * nseg; /* a warp past the rows points at row group 0 */

    const uint8_t *pa[NMAT], *pb[NMAT], *sa[NMAT], *sb[NMAT], *st[NMAT];
    fm_tile_ptrs<NMAT, MX>(dA, dB, e, tile0, lane, pa, pb, sa, sb, st);
    const uint16_t *src_base = NMAT == 2 ? p.x_prep : p.h;
    const int64_t src_stride = NMAT == 2 ? p.Hp : p.hstride;
    const uint64_t wpol = l2_evict_first();

    for (int pass0 = it.pbeg; pass0 < it.pend; pass0 += 8 * NT) {
        float acc[NMAT][NT][4];
#pragma unroll
        for (int m = 0; m < NMAT; m++)
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int i = 0; i < 4; i++) acc[m][n][i] = 0.0f;

        const uint16_t *src[NT];
#pragma unroll
        for (int n = 0; n < NT; n++) {
            int idx = pass0 + n * 8 + g;
            src[n] = NULL;
            if (idx < cnt) {
                int pos = pos0 + idx;
                int64_t row = NMAT == 2 ? (shared ? idx : p.sorted_tok[pos]) : pos;
                src[n] = src_base + row * src_stride + t * 32;
            }
        }

        uint4 wa[NMAT], wb[NMAT], na[NMAT], nb[NMAT];
        uint32_t ca[NMAT], cb[NMAT], nca[NMAT], ncb[NMAT];
        /* segment indices are clamped into the warp's range: the compiler
         * may hoist a plain load out of its guard */
        const int s_last = s_end > s_begin ? s_end - 1 : s_begin;
        const int s_pre = waited ? s_begin : s_begin + 1;
        if (waited) {
            if (s_begin < s_end) fm_load_seg<NMAT, MX, false>(pa, pb, sa, sb, s_begin, wpol, wa, wb, ca, cb);
        } else {
            if (s_begin < s_end) fm_load_seg<NMAT, MX, true>(pa, pb, sa, sb, s_begin, wpol, wa, wb, ca, cb);
            if (s_begin + 1 < s_end)
                fm_load_seg<NMAT, MX, true>(pa, pb, sa, sb, s_begin + 1, wpol, na, nb, nca, ncb);
        }
        if (!waited) {
            pdl_wait();
            pdl_launch_dependents();
            waited = true;
        }
        constexpr int seg_unroll = XG ? 1 : 2;
#pragma unroll seg_unroll
        for (int s = s_begin; s < s_end; s++) {
            /* after the last segment na.. are not used */
            if (s + 1 < s_end && s >= s_pre)
                fm_load_seg<NMAT, MX, false>(pa, pb, sa, sb, min(s + 1, s_last), wpol, na, nb, nca, ncb);
            if (XG) {
                seg_compute_g<NT, NMAT, MX>(acc, wa, wb, ca, cb, src, s);
            } else {
                uint4 xb[NT][4];
#pragma unroll
                for (int n = 0; n < NT; n++)
#pragma unroll
                    for (int d = 0; d < 4; d++)
                        xb[n][d] = src[n] ? __ldg((const uint4 *)(src[n] + s * FM_KSEG) + d) : make_uint4(0, 0, 0, 0);
                seg_compute<NT, NMAT, MX>(acc, wa, wb, ca, cb, xb);
            }
#pragma unroll
            for (int m = 0; m < NMAT; m++) { wa[m] = na[m]; wb[m] = nb[m]; ca[m] = nca[m]; cb[m] = ncb[m]; }
        }

        if (KS > 1) reduce_k<NT, NMAT>(acc, ex_smem, wi, ks, KS, lane);

        if (ks == 0 && r0 < rows_p) {
            /* made here, not before the loop, so that none of it holds a
             * register through the K loop */
            const fm_epi o = {dA.bias, dB.bias, fm_nv_s2<MX>(dA.scale2[e]),
                              NMAT == 2 ? fm_nv_s2<MX>(dB.scale2[e]) : 0.0f, dA.rows, rows_p, e, pos0, cnt, shared};
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int i = 0; i < 4; i++)
                    fm_emit<NMAT>(p, o, i < 2 ? r0 + g : r0 + g + 8, pass0 + n * 8 + 2 * t + (i & 1),
                                  acc[0][n][i], acc[NMAT - 1][n][i]);
        }
    }
}

/* Gate/up with 16-token tiles reads its activations per K step (XG): that
 * brings it from 180 to 128 registers (8 -> 16 warps per SM); every other
 * shape holds its segment's activations in registers. */
#define FM_K3(NMAT, MX) \
    {fm_expert_kernel<1, NMAT, MX, false>, fm_expert_kernel<2, NMAT, MX, NMAT == 2>, fm_expert_kernel<4, NMAT, MX, false>}
extern "C" fm_expert_kfn fm_expert_mma_kernel(int nmat, int nt, int mx) {
    static const fm_expert_kfn k[2][2][3] = {{FM_K3(1, false), FM_K3(1, true)}, {FM_K3(2, false), FM_K3(2, true)}};
    return k[nmat == 2][mx ? 1 : 0][nt == 1 ? 0 : nt == 2 ? 1 : 2];
}
extern "C" int fm_expert_mma_xg(int nmat, int nt) { return nmat == 2 && nt == 2; }
#undef FM_K3
