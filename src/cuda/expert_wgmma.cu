/*
 * The wgmma expert kernels (sm_90a): the mma.sync kernels' work split and
 * weight stream (expert_mma.cu), with the tensor-core work done by warpgroup
 * MMAs. A block is one or two warpgroups (4 warps, 64 weight rows each);
 * each warp decodes its 16 rows exactly as the mma.sync kernel does (the
 * register fragment of A in wgmma.m64nNk16 is, per warp, that of
 * mma.m16n8k16), and one wgmma.m64nNk16 per 16-wide K step multiplies the
 * warpgroup's 64 rows by all of its N = 8 .. 64 tokens at once, with the
 * tokens' activations read by the tensor cores from shared memory. So the
 * activations are read from global memory once per block instead of once
 * per warp, and no token tile is decoded twice.
 *
 * Shared memory: a ring of segments (128 K each) of activations and, per
 * warp, of its weight tiles and scales (cp.async, two segments ahead: as
 * many bytes in flight per warp as the register double buffer of the
 * mma.sync kernel holds, and no registers spent on them). Within a
 * segment, K step j (16 values) is a K-major, unswizzled wgmma operand:
 * 8-token x 8-value core matrices of 128 bytes, the two K halves 128 bytes
 * apart (leading byte offset) and consecutive 8-token groups 256 bytes apart
 * (stride byte offset); steps are wg_step_bytes apart (16 bytes of padding,
 * so that the staging stores below hit 32 distinct banks). The activations
 * in global memory are in the mma.sync order (x_prep, the h the gate/up
 * epilogue writes): the 8-value group d of thread t's 32-value piece holds
 * the K pairs (2t, 2t + 1) and (2t + 8, 2t + 9) of steps 2d and 2d + 1, so
 * each 16-byte load is stored as four 4-byte words.
 */
#include "expert_common.cuh"
#include <cooperative_groups.h>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FM_HAVE_WGMMA 1
#endif
static constexpr FM_HD int wg_step_bytes(int n8) { return n8 * 256 + 16; }
static constexpr FM_HD int wg_stage_bytes(int n8) { return 8 * wg_step_bytes(n8); }
/* Segments copied ahead: two, for more blocks per SM than three allow (one
 * or three measured slower; docs/history). */
static constexpr FM_HD int wg_la(bool) { return 2; }
/* One segment of one warp's weight ring: per matrix 1024 bytes of weights
 * and 128 of scales (64 used by MXFP4). */
static constexpr FM_HD int wg_wstage_bytes(int nmat) { return nmat * 1152; }
/* Down's blocks also keep the pass's token rows and routing weights (64
 * ints and 64 floats) after the weight rings, for the epilogue. wgs: the
 * block's warpgroups (1, or 2 sharing one activation stage). */
static constexpr FM_HD int wg_smem_bytes(int nmat, int nmax, bool down, int wgs) {
    return (wg_la(!down) + 1) * (wg_stage_bytes(nmax) + 4 * wgs * wg_wstage_bytes(nmat)) + (down ? 512 : 0);
}

#ifdef FM_HAVE_WGMMA
static __device__ __forceinline__ void wg_fence(void) { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
static __device__ __forceinline__ void wg_commit(void) { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
static __device__ __forceinline__ void wg_wait(void) {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
static __device__ __forceinline__ void fence_proxy_async(void) {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
/* The B operand's descriptor, K-major, no swizzle: leading byte offset 128
 * (the second 8 K values), stride byte offset 256 (the next 8 tokens). Its
 * low word is ((saddr mod 2^18) >> 4) | LBO << 16 for a 16-byte aligned
 * shared address, its high word the SBO. The address field has 14 bits
 * below the LBO's, so the descriptor of saddr + off (off a multiple of 16,
 * the sum still below 2^18) has the low word lo + (off >> 4): one add per
 * MMA instead of a mask, shift and or per descriptor. */
static __device__ __forceinline__ uint32_t wg_desc_lo(uint32_t saddr) {
    /* the mask matters: in a cluster launch the CTA's shared addresses carry
     * bits above the 18 the descriptor holds */
    return ((saddr & 0x3FFFFu) >> 4) | ((128u >> 4) << 16);
}
static __device__ __forceinline__ uint64_t wg_desc_of(uint32_t lo) {
    uint64_t d;
    asm("mov.b64 %0, {%1, %2};" : "=l"(d) : "r"(lo), "r"(256u >> 4));
    return d;
}
template <int N8>
struct wg_mma;
template <>
struct wg_mma<1> {
    static __device__ __forceinline__ void run(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint64_t b) {
        asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, 1, 1, 1, 0;"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));
    }
};
template <>
struct wg_mma<2> {
    static __device__ __forceinline__ void run(float (&d)[8], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint64_t b) {
        asm volatile("wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, "
                     "{%8,%9,%10,%11}, %12, 1, 1, 1, 0;"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));
    }
};
template <>
struct wg_mma<3> {
    static __device__ __forceinline__ void run(float (&d)[12], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint64_t b) {
        asm volatile("wgmma.mma_async.sync.aligned.m64n24k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11}, "
                     "{%12,%13,%14,%15}, %16, 1, 1, 1, 0;"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                       "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));
    }
};
template <>
struct wg_mma<4> {
    static __device__ __forceinline__ void run(float (&d)[16], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint64_t b) {
        asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
                     "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, 1, 1, 1, 0;"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                       "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
                       "+f"(d[15])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));
    }
};
/* m64n64k16 (the shared expert's 64-token passes) */
template <>
struct wg_mma<8> {
    static __device__ __forceinline__ void run(float (&d)[32], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint64_t b) {
        asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                     "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,"
                     "%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, 1, 1, 1, 0;"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                       "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
                       "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
                       "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
                       "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));
    }
};

#endif

/* What one pass of a wgmma block needs (set up by the kernel, used by the
 * pass body instantiated for the pass's token count). */
struct fm_wg_pass {
    const uint8_t *pa[2], *pb[2], *sa[2], *sb[2];
    const uint8_t *st[2];  /* the scale tile of the warp's rows at segment 0 */
    uint32_t wring_off;    /* byte offset of the weight rings                */
    const uint16_t *src_base;
    int64_t src_stride;
    int nseg, pass0, rowA, rowB;
    int ksplit; /* gate/up: CTAs of the cluster that split K (1: none)     */
    int nch;    /* down: row chunks of the block, one after the other      */
    uint32_t ctiles; /* weight tiles from one row chunk to the next         */
    bool wv;
    bool wv2; /* D2: the second 64 rows exist (else they are not written) */
    bool pre; /* the first LA segments' weights were copied before the wait */
    fm_epi o;
};

#ifdef FM_HAVE_WGMMA
/* Down's epilogue in 16-byte reductions: within each group of four lanes
 * that hold rows 4j .. 4j + 3 of the same token columns, a transpose over
 * two shuffle steps gives each lane four consecutive rows of one (row half,
 * token) combination, added with one red.global.add.v4.f32 instead of four
 * scalar atomics (a quarter of the L2 reduction requests). Rows and H are
 * multiples of 4, so the four rows are all valid or all past the end.
 * Only in kernels of passes up to 16 tokens: in the wider ones the
 * transpose's registers spill. */
static __device__ __forceinline__ void red_add_v4(float *a, float x, float y, float z, float v) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(a), "f"(x), "f"(y), "f"(z), "f"(v) : "memory");
}
template <int N8, int NMAT, bool D2>
static __device__ __forceinline__ void wg_down_emit4(const fm_expert_params &p, const fm_wg_pass &w,
                                                     float (&acc)[NMAT][4 * N8], const int *ep_tok,
                                                     const float *ep_w, int lane, int dr) {
    const int t = lane & 3, c = (lane >> 2) & 3;
    const int rbase = w.rowA + dr - c; /* the group's first row (rowA = r0 + g) */
#pragma unroll
    for (int m = 0; m < (D2 ? 2 : 1); m++) {
        if (m == 1 && !w.wv2) break;
        const float *acm = acc[D2 ? m : 0];
        const int roff = m * 64;
#pragma unroll
        for (int n = 0; n < N8; n++) {
            float v[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int j = n * 8 + 2 * t + (i & 1);
                v[i] = acm[n * 4 + i] * w.o.s2A;
                if (w.o.biasA) {
                    const int row = (i < 2 ? w.rowA : w.rowB) + dr + roff;
                    if (row < w.o.rows) v[i] += w.o.biasA[(int64_t)w.o.e * w.o.rows_p + row];
                }
                v[i] *= ep_w[j];
            }
            /* v[i] of lane c becomes v[c] of lane i (lanes 4 apart, then 8) */
#pragma unroll
            for (int o = 0; o < 2; o++) {
                const float snd = (c & 1) ? v[2 * o] : v[2 * o + 1];
                const float r = __shfl_xor_sync(0xffffffffu, snd, 4);
                if (c & 1) v[2 * o] = r;
                else v[2 * o + 1] = r;
            }
#pragma unroll
            for (int o = 0; o < 2; o++) {
                const float snd = (c & 2) ? v[o] : v[2 + o];
                const float r = __shfl_xor_sync(0xffffffffu, snd, 8);
                if (c & 2) v[o] = r;
                else v[2 + o] = r;
            }
            /* this lane now holds rows rbase .. + 3 (+ 8 for c >= 2) of token column 2t + (c & 1) */
            const int j = n * 8 + 2 * t + (c & 1), row = rbase + (c >> 1) * 8 + roff;
            if (w.pass0 + j < w.o.cnt && row < w.o.rows)
                red_add_v4(p.out + (int64_t)ep_tok[j] * p.H + row, v[0], v[1], v[2], v[3]);
        }
    }
}

/* Segment S's weights and scales into this warp's ring stage (cp.async, not
 * committed). */
template <int NMAT, bool MX, int NSTG>
static __device__ __forceinline__ void wg_wcopy(const fm_wg_pass &w, uint32_t wr_s, int lane, int q, uint32_t S,
                                                uint64_t wpol) {
    constexpr int WST = wg_wstage_bytes(NMAT), SPR = MX ? 4 : 8;
#pragma unroll
    for (int m = 0; m < NMAT; m++) {
        const uint32_t d_ = wr_s + (q % NSTG) * WST + m * 1152;
        /* unsigned 32-bit offsets: one IMAD.WIDE.U32 per address, where a
         * signed 64-bit product takes three to four */
        const uint8_t *q_ = w.pa[m] + S * 1024u;
        cp_async16_pol(d_ + lane * 16, q_, wpol);
        cp_async16_pol(d_ + 512 + lane * 16, q_ + 512, wpol);
        if (lane < SPR)
            cp_async16_pol(d_ + 1024 + lane * 16, w.st[m] + (S * (16u * SPR) + (uint32_t)lane * 16u), wpol);
    }
}
#endif


/* A pass's staging of the tokens' activations by cp.async, 4 bytes at a
 * time (the reorder above): item it = (token n = it / 16, 16-byte piece
 * u = it % 16); a token past the pass is zero-filled: it copies nothing
 * (source size 0) from row 0 of the source, whose address runs along the
 * segments like the others', so that the copies need no select. */
template <int N8, bool GU, int WGS>
struct wg_xstage {
    static constexpr int STEP = wg_step_bytes(N8), NTH = 128 * WGS, NITEMS = 128 * N8;
    static constexpr int NIT = (NITEMS + NTH - 1) / NTH; /* staging items per thread */
    const uint8_t *src[NIT];
    uint32_t off[NIT];
    bool in[NIT]; /* the item exists (with WGS = 2 some threads have fewer) */
    bool v[NIT];  /* its token is in the pass                                */

    __device__ __forceinline__ wg_xstage(const fm_expert_params &p, const fm_wg_pass &w, int tid) {
#pragma unroll
        for (int k = 0; k < NIT; k++) {
            const int it = tid + k * NTH, n = it >> 4, u = it & 15, ut = u >> 2, ud = u & 3;
            const int idx = w.pass0 + n;
            in[k] = NITEMS % NTH == 0 || it < NITEMS;
            v[k] = idx < w.o.cnt;
            src[k] = (const uint8_t *)w.src_base;
            off[k] = (uint32_t)(2 * ud * STEP + (n >> 3) * 256 + (n & 7) * 16 + 4 * ut);
            if (v[k]) {
                const int pos = w.o.pos0 + idx;
                const int64_t row = GU ? (w.o.shared ? idx : p.sorted_tok[pos]) : pos;
                src[k] = (const uint8_t *)(w.src_base + row * w.src_stride + u * 8);
            }
        }
    }
#ifdef FM_HAVE_WGMMA
    /* segment S's activations into stage st (not committed) */
    __device__ __forceinline__ void copy(uint32_t st, int S) const {
#pragma unroll
        for (int k = 0; k < NIT; k++) {
            if (!in[k]) continue;
            const uint8_t *q = src[k] + (uint32_t)S * (uint32_t)(FM_KSEG * 2);
            cp_async_small<4>(st + off[k], q, v[k]);
            cp_async_small<4>(st + off[k] + 128, q + 4, v[k]);
            cp_async_small<4>(st + off[k] + STEP, q + 8, v[k]);
            cp_async_small<4>(st + off[k] + STEP + 128, q + 12, v[k]);
        }
    }
#endif
};

#ifdef FM_HAVE_WGMMA
/* One segment's MMAs of a warp: its weights and scales from the ring stage
 * wp, decoded per 32-wide K step into A fragments, against the stage's
 * activations at st_addr. A group per K step, retired before the next
 * step's decode: one step of A fragments live, for the registers of four
 * gate/up and six down blocks per SM. */
template <int N8, int NMAT, bool MX>
static __device__ __forceinline__ void wg_segment(float (&acc)[NMAT][4 * N8], const uint8_t *wp, uint32_t st_addr,
                                                  int lane) {
    constexpr int STEP = wg_step_bytes(N8);
    const int g = lane >> 2, t = lane & 3;
    uint4 wa[NMAT], wb[NMAT];
    uint32_t SA[NMAT][2], SB[NMAT][2];
#pragma unroll
    for (int m = 0; m < NMAT; m++) {
        wa[m] = *(const uint4 *)(wp + m * 1152 + lane * 16);
        wb[m] = *(const uint4 *)(wp + m * 1152 + 512 + lane * 16);
        if (MX) {
            SA[m][0] = SA[m][1] = mx_scale_bits(wp[m * 1152 + 1024 + g * 4 + t] & 0xFF) * 0x10001u;
            SB[m][0] = SB[m][1] = mx_scale_bits(wp[m * 1152 + 1024 + (g + 8) * 4 + t] & 0xFF) * 0x10001u;
        } else {
            nv_scale_pair(*(const uint16_t *)(wp + m * 1152 + 1024 + g * 8 + 2 * t), SA[m][0], SA[m][1]);
            nv_scale_pair(*(const uint16_t *)(wp + m * 1152 + 1024 + (g + 8) * 8 + 2 * t), SB[m][0], SB[m][1]);
        }
    }
    const uint32_t dlo = wg_desc_lo(st_addr);
#pragma unroll
    for (int d = 0; d < 4; d++) {
        uint32_t ra[NMAT][4], rb[NMAT][4];
#pragma unroll
        for (int m = 0; m < NMAT; m++) {
            const uint32_t wA = d == 0 ? wa[m].x : d == 1 ? wa[m].y : d == 2 ? wa[m].z : wa[m].w;
            const uint32_t wB = d == 0 ? wb[m].x : d == 1 ? wb[m].y : d == 2 ? wb[m].z : wb[m].w;
            decode8(wA, SA[m][d >> 1], ra[m]);
            decode8(wB, SB[m][d >> 1], rb[m]);
        }
        wg_fence();
#pragma unroll
        for (int m = 0; m < NMAT; m++) {
            wg_mma<N8>::run(acc[m], ra[m][0], rb[m][0], ra[m][1], rb[m][1],
                            wg_desc_of(dlo + (uint32_t)((2 * d) * STEP >> 4)));
            wg_mma<N8>::run(acc[m], ra[m][2], rb[m][2], ra[m][3], rb[m][3],
                            wg_desc_of(dlo + (uint32_t)((2 * d + 1) * STEP >> 4)));
        }
        wg_commit();
        if (d < 3) wg_wait<0>();
    }
    wg_wait<0>();
}

/* Gate/up split over K by a cluster of ksplit CTAs: the others' partial
 * sums go into CTA 0's shared memory (its rings, idle once every CTA is past
 * its loop), CTA 0 adds them in rank order (deterministic). Returns false in
 * the other CTAs, which have no epilogue. */
template <int N8, int NMAT>
static __device__ __forceinline__ bool wg_cluster_reduce(float (&acc)[NMAT][4 * N8], uint8_t *smem, int ksplit,
                                                         int tid) {
    namespace cg = cooperative_groups;
    cg::cluster_group cl = cg::this_cluster();
    constexpr int NA = NMAT * 4 * N8;
    const unsigned rank = cl.block_rank();
    float *red = (float *)smem;
    cl.sync();
    if (rank > 0) {
        float *dst = cl.map_shared_rank(red, 0) + (size_t)(rank - 1) * NA * 128;
#pragma unroll
        for (int m = 0; m < NMAT; m++)
#pragma unroll
            for (int i = 0; i < 4 * N8; i++) dst[(m * 4 * N8 + i) * 128 + tid] = acc[m][i];
    }
    cl.sync();
    if (rank > 0) return false;
    for (int r = 1; r < ksplit; r++)
#pragma unroll
        for (int m = 0; m < NMAT; m++)
#pragma unroll
            for (int i = 0; i < 4 * N8; i++) acc[m][i] += red[((r - 1) * NA + m * 4 * N8 + i) * 128 + tid];
    return true;
}
#endif

/*
 * One pass: up to 8 * N8 tokens of the block's expert through its rows,
 * over the whole K.
 * D2: down with NMAT = 2, the two "matrices" being rows r .. r + 63 and
 * r + 64 .. r + 127 of the down matrix (a 128-row block: as many weight
 * bytes per segment and per barrier as gate/up).
 * WGS = 2: each warpgroup runs its own rows (its own weight rings,
 * accumulators and wgmmas) against the one stage of activations both read,
 * which the block's 256 threads copy; so the activations cross from L2 once
 * per 128 (gate/up) or 256 (down) rows instead of once per 64 or 128.
 */
template <int N8, int NMAT, bool MX, bool D2, int WGS, bool V4>
static __device__ __forceinline__ void wg_pass_body(const fm_expert_params &p, const fm_wg_pass &w, uint8_t *smem) {
    constexpr bool GU = NMAT == 2 && !D2; /* gate/up, else down */
#ifdef FM_HAVE_WGMMA
    constexpr int STAGE = wg_stage_bytes(N8);
    /* LA segments copied ahead (activations, weights, scales); the stage
     * refilled at segment s last held segment s - 1, whose MMAs every warp
     * retired before the barrier of segment s */
    constexpr int LA = wg_la(GU), NSTG = LA + 1, WST = wg_wstage_bytes(NMAT);
    const int tid = threadIdx.x, lane = tid & 31, t = lane & 3, wi = tid >> 5;
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(smem);
    /* this warp's ring of weight tiles (1024 bytes) and their scales */
    const uint32_t wr_s = sbase + w.wring_off + wi * (NSTG * WST);
    const uint8_t *wr_g = smem + w.wring_off + wi * (NSTG * WST);
    const wg_xstage<N8, GU, WGS> xs(p, w, tid);
    const uint64_t wpol = l2_evict_first();
    /* the weights first: their addresses need no load, so the first
     * segments' weight copies leave before the token rows have arrived */
    const int nch = GU ? 1 : w.nch, nq = nch * w.nseg;
    /* segment q (the block's q-th, stage q % NSTG): K segment S of row chunk c */
    auto copy_seg = [&](int q, int c, int S, bool weights) {
        if (!GU)
            while (S >= w.nseg) {
                S -= w.nseg;
                c++;
            }
        if (q < nq) {
            if (weights) wg_wcopy<NMAT, MX, NSTG>(w, wr_s, lane, q, (uint32_t)c * w.ctiles + (uint32_t)S, wpol);
            xs.copy(sbase + (q % NSTG) * STAGE, S);
        }
        cp_async_commit();
    };
    /* down: the pass's token rows and routing weights, read now so that
     * the epilogue's atomics wait on no global load (visible to every warp
     * after the first segment's barrier) */
    int *ep_tok = (int *)(smem + w.wring_off + 4 * WGS * NSTG * WST);
    float *ep_w = (float *)(ep_tok + 64);
    if (!GU && tid < 8 * N8) {
        const int idx = w.pass0 + tid;
        int tk = 0;
        float wt = 0.0f;
        if (idx < w.o.cnt) {
            const int pos = w.o.pos0 + idx;
            tk = w.o.shared ? idx : p.sorted_tok[pos];
            wt = w.o.shared ? 1.0f : p.sorted_w[pos];
        }
        ep_tok[tid] = tk;
        ep_w[tid] = wt;
    }
    float acc[NMAT][4 * N8];
#pragma unroll
    for (int m = 0; m < NMAT; m++)
#pragma unroll
        for (int i = 0; i < 4 * N8; i++) acc[m][i] = 0.0f;
    /* down's output of the row chunk dr rows past the block's first */
    auto down_out = [&](int dr) {
        if (!w.wv) return;
        if (V4 && !((w.o.rows | p.H) & 3)) {
            wg_down_emit4<N8, NMAT, D2>(p, w, acc, ep_tok, ep_w, lane, dr);
            return;
        }
#pragma unroll
        for (int n = 0; n < N8; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int j = n * 8 + 2 * t + (i & 1), row = (i < 2 ? w.rowA : w.rowB) + dr;
                fm_emit_down(p, w.o, row, w.pass0 + j, ep_tok[j], ep_w[j], acc[0][n * 4 + i]);
                if (D2 && w.wv2)
                    fm_emit_down(p, w.o, row + 64, w.pass0 + j, ep_tok[j], ep_w[j], acc[NMAT - 1][n * 4 + i]);
            }
    };

    /* w.pre: the weights of segments 0 .. LA - 1 are in flight already, in
     * a group of their own committed before these */
#pragma unroll
    for (int j = 0; j < LA; j++) copy_seg(j, 0, j, !w.pre);
    /* down walks its row chunks as one stream of segments: the next chunk's
     * copies are in flight while this one's MMAs end and its output goes */
    int q = 0;
#pragma unroll 1
    for (int c = 0; c < nch; c++) {
#pragma unroll 1
        for (int s = 0; s < w.nseg; s++, q++) {
            /* this thread's pieces of segment q have landed; after the
             * barrier everyone's have, and every warp is past the wait that
             * retired the MMAs that last read the stage refilled next */
            cp_async_wait<LA - 1>();
            fence_proxy_async();
            __syncthreads();
            copy_seg(q + LA, c, s + LA, true);
            wg_segment<N8, NMAT, MX>(acc, wr_g + (q % NSTG) * WST, sbase + (q % NSTG) * STAGE, lane);
        }
        if (!GU) {
            down_out(c * (D2 ? 128 : 64) * WGS);
#pragma unroll
            for (int m = 0; m < NMAT; m++)
#pragma unroll
                for (int i = 0; i < 4 * N8; i++) acc[m][i] = 0.0f;
        }
    }
    wg_wait<0>();
    cp_async_wait<0>();
    if (GU && WGS == 1 && w.ksplit > 1 && !wg_cluster_reduce<N8, NMAT>(acc, smem, w.ksplit, tid)) return;
    if constexpr (GU) {
        if (!w.wv) return;
#pragma unroll
        for (int n = 0; n < N8; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int j = n * 8 + 2 * t + (i & 1);
                fm_emit<NMAT>(p, w.o, i < 2 ? w.rowA : w.rowB, w.pass0 + j, acc[0][n * 4 + i],
                              acc[NMAT - 1][n * 4 + i]);
            }
    }
#else
    (void)p;
    (void)w;
    (void)smem;
#endif
}

/* Blocks per SM the compiler must fit: 4 where passes are 16 or 32 tokens
 * (as shared memory allows); 6 for gate/up's passes of 8 tokens (NMAX 1, 80
 * registers) and 5 for down's (96: its walk over row chunks spills at 80);
 * the shared expert's 64-token passes (NMAX 8) two, so that their 64
 * accumulators per thread fit. Two warpgroups per block keep the registers
 * per thread. */
static constexpr int fm_wg_min_blocks(int nmat, int nmax, bool d2) {
    return nmax > 4 ? 2 : nmat == 2 && nmax > 1 ? 4 : d2 ? 5 : 6;
}

/* The block's work item, its rows and K share, set up once for its passes;
 * false when the block has nothing to do. */
template <int NMAT, bool MX, int NMAX, bool D2, int WGS>
static __device__ __forceinline__ bool wg_setup(const fm_expert_params &p, const fm_item &it, int KS, int LCH,
                                                fm_wg_pass &w) {
    constexpr bool GU = NMAT == 2 && !D2;
    constexpr int RWG = D2 ? 128 : 64; /* rows of one warpgroup */
    constexpr int RPB = RWG * WGS;
    const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5, g = lane >> 2;
    const int e = it.e;
    const fm_dmat &dA = GU ? (it.shared ? p.sgate : p.gate) : (it.shared ? p.sdown : p.down);
    const fm_dmat &dB = GU ? (it.shared ? p.sup : p.up) : dA;
    w.o = {dA.bias, dB.bias, fm_nv_s2<MX>(dA.scale2[e]), GU ? fm_nv_s2<MX>(dB.scale2[e]) : 0.0f, dA.rows, dA.rows_p, e,
           it.pos0, it.cnt, it.shared};
    /* down: 2^LCH row chunks of RPB rows per block, those that start inside
     * the padded rows (the host chunks only rows_p that are whole chunks, so
     * a chunk after the first has every warp's rows) */
    const int r0 = (it.rb << LCH) * RPB + (wi >> 2) * RWG + (wi & 3) * 16;
    w.nch = min(1 << LCH, (dA.rows_p + RPB - 1) / RPB - (it.rb << LCH));
    w.rowA = r0 + g;
    w.rowB = r0 + g + 8;
    const int nseg = dA.kp / FM_KSEG;
    w.ctiles = (uint32_t)(RPB / 16 * nseg);
    /* a K split (KS > 1): this block's share of the segments. Down adds its
     * partial sums into the output with the epilogue's atomics like every
     * other expert's; a slice without segments (K below KS segments) has
     * nothing to do, and the bias goes in once, by the slice that starts at
     * segment 0. Gate/up's KS blocks are one cluster that adds the partial
     * sums in CTA 0 before the activation (wg_cluster_reduce); every CTA
     * takes part, segments or not. */
    const int ks = (int)blockIdx.x % KS;
    const int s0 = ks * nseg / KS, s1 = (ks + 1) * nseg / KS;
    w.nseg = s1 - s0;
    w.ksplit = GU ? KS : 1;
    if (!GU && w.nseg == 0) return false;
    if (!GU && s0 > 0) w.o.biasA = NULL;
    /* every warp of the warpgroup takes part in every wgmma: a warp whose 16
     * rows lie past the padded rows streams row group 0 and writes nothing */
    w.wv = r0 < dA.rows_p;
    const int64_t tile0 = (int64_t)((w.wv ? r0 : 0) / 16) * nseg + s0;
    fm_tile_ptrs<NMAT, MX>(dA, dB, e, tile0, lane, w.pa, w.pb, w.sa, w.sb, w.st);
    w.wv2 = D2 && r0 + 64 < dA.rows_p;
    if (D2 && w.wv2) {
        /* the second "matrix": the same down matrix 4 row groups on (past
         * the padded rows the first half is streamed again, unwritten) */
        const int64_t ow = (int64_t)4 * nseg * 1024, os = (int64_t)4 * nseg * 16 * (MX ? 4 : 8);
        w.pa[1] += ow;
        w.pb[1] += ow;
        w.sa[1] += os;
        w.sb[1] += os;
        w.st[1] += os;
    }
    w.wring_off = (uint32_t)((wg_la(GU) + 1) * wg_stage_bytes(NMAX));
    w.pre = false;
    w.src_base = (GU ? p.x_prep : p.h) + (int64_t)s0 * FM_KSEG;
    w.src_stride = GU ? p.Hp : p.hstride;
    return true;
}

/* Block = one or two warpgroups, 64 rows each (D2: down, 128 rows as two
 * "matrices" of 64, see wg_pass_body); work items as in fm_expert_kernel
 * (the launch sizes the grid with passes of 8 * NMAX tokens). Needs sm_90a:
 * elsewhere the body is empty and the host never launches it
 * (fm_cuda_wgmma_built). */
template <int NMAT, bool MX, int NMAX, bool D2, int WGS>
__global__ void __launch_bounds__(128 * WGS, fm_wg_min_blocks(NMAT, NMAX, D2) / WGS)
    fm_expert_wg_kernel(fm_expert_params p, int W, int KS) {
#ifdef FM_HAVE_WGMMA
    extern __shared__ __align__(128) uint8_t wg_smem[];
    const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5;
    constexpr bool GU = NMAT == 2 && !D2;
    constexpr int RPB = (D2 ? 128 : 64) * WGS;
    /* W: log2 of down's row chunks per block (gate/up: 0) */
    const int LCH = GU ? 0 : W;
    const int nrb = (((GU ? p.gate.rows_p : p.down.rows_p) + RPB - 1) / RPB + (1 << LCH) - 1) >> LCH;
    /* down's blocks and the shared expert's copy their first segments'
     * weights before the wait: their weights need no earlier grid */
    const bool pre = !GU || (int)blockIdx.x / KS < p.sh_blocks;
    if (!pre) {
        pdl_wait();
        pdl_launch_dependents();
    }

    fm_item it;
    if (!fm_get_item(p, nrb, it, (int)blockIdx.x / KS)) return;
    fm_wg_pass w;
    if (!wg_setup<NMAT, MX, NMAX, D2, WGS>(p, it, KS, LCH, w)) return;
    constexpr int LA = wg_la(GU);
    if (pre) {
        if (w.nseg > 0) {
            const uint32_t wr_s = (uint32_t)__cvta_generic_to_shared(wg_smem) + w.wring_off +
                                  wi * ((LA + 1) * wg_wstage_bytes(NMAT));
            const uint64_t wpol = l2_evict_first();
#pragma unroll
            for (int j = 0; j < LA; j++)
                if (j < (GU ? 1 : w.nch) * w.nseg)
                    wg_wcopy<NMAT, MX, LA + 1>(w, wr_s, lane, j,
                                               j < w.nseg ? (uint32_t)j : w.ctiles * (uint32_t)(j / w.nseg) +
                                                                              (uint32_t)(j % w.nseg),
                                               wpol);
            cp_async_commit();
            w.pre = true;
        }
        if (!GU && p.gu_done && !it.shared) {
            /* wait for this expert's gate/up warps only (one per 16 rows of
             * every 64-row gate/up block), not for the grid */
            const unsigned want = 4u * (unsigned)((p.gate.rows_p + 63) / 64);
            if (threadIdx.x == 0)
                while (ld_acquire_u32(p.gu_done + it.e) < want) __nanosleep(64);
            __syncthreads();
        } else {
            pdl_wait();
        }
        pdl_launch_dependents();
    }
    for (int pass0 = it.pbeg; pass0 < it.pend; pass0 += 8 * NMAX) {
        w.pass0 = pass0;
        const int n8 = (min(8 * NMAX, it.pend - pass0) + 7) >> 3;
        if (NMAX == 1 || n8 == 1) wg_pass_body<1, NMAT, MX, D2, WGS, NMAX <= 2>(p, w, wg_smem);
        else if (n8 == 2 || NMAX == 2) wg_pass_body<2, NMAT, MX, D2, WGS, NMAX <= 2>(p, w, wg_smem);
        else if (n8 == 3) wg_pass_body<NMAX == 2 ? 2 : 3, NMAT, MX, D2, WGS, NMAX <= 2>(p, w, wg_smem);
        else if (n8 == 4 || NMAX == 4) wg_pass_body<NMAX == 2 ? 2 : 4, NMAT, MX, D2, WGS, NMAX <= 2>(p, w, wg_smem);
        else wg_pass_body<NMAX == 8 ? 8 : 4, NMAT, MX, D2, WGS, NMAX <= 2>(p, w, wg_smem);
        w.pre = false;
        __syncthreads(); /* the next pass restages the ring */
    }
    if (GU && p.gu_done && !it.shared && (int)blockIdx.x % KS == 0 && it.rb * RPB + (wi >> 2) * (D2 ? 128 : 64) < w.o.rows_p) {
        /* this warp's h rows of expert e are written (KS > 1: CTA 0 of the
         * cluster wrote the epilogue); counted by the warps of every
         * warpgroup that starts inside the rows (4 per 64 rows, as down
         * expects, whatever the block's warpgroups) */
        __threadfence();
        __syncwarp();
        if (lane == 0) atomicAdd(p.gu_done + it.e, 1u);
    }
    /* a handed-off down block exits only after the whole gate/up grid has
     * (so that this grid's end still implies gate/up's) */
    if (!GU && p.gu_done && !it.shared) pdl_wait();
#else
    (void)p;
    (void)W;
    (void)KS;
#endif
}

/* kind: 1 gate/up, 2 down in 128-row blocks (D2). Two
 * warpgroups per block are built for gate/up and D2 with passes of 16 or 32
 * tokens (the config file accepts nothing else); 64-token passes (nmax 8)
 * for gate/up and D2 with one warpgroup, for the shared expert's own
 * launches; NULL otherwise. */
#define FM_WG3(NMAT, MX, D2) \
    {fm_expert_wg_kernel<NMAT, MX, 1, D2, 1>, fm_expert_wg_kernel<NMAT, MX, 2, D2, 1>, \
     fm_expert_wg_kernel<NMAT, MX, 4, D2, 1>}
#define FM_WG3X2(NMAT, MX, D2) {NULL, fm_expert_wg_kernel<NMAT, MX, 2, D2, 2>, fm_expert_wg_kernel<NMAT, MX, 4, D2, 2>}
extern "C" fm_expert_kfn fm_expert_wg_kernel_for(int kind, int mx, int nmax, int wgs) {
    static const fm_expert_kfn k[3][2][3] = {{{NULL, NULL, NULL}, {NULL, NULL, NULL}},
                                             {FM_WG3(2, false, false), FM_WG3(2, true, false)},
                                             {FM_WG3(2, false, true), FM_WG3(2, true, true)}};
    static const fm_expert_kfn k2[3][2][3] = {{{NULL, NULL, NULL}, {NULL, NULL, NULL}},
                                              {FM_WG3X2(2, false, false), FM_WG3X2(2, true, false)},
                                              {FM_WG3X2(2, false, true), FM_WG3X2(2, true, true)}};
    static const fm_expert_kfn k8[3][2] = {
        {NULL, NULL},
        {fm_expert_wg_kernel<2, false, 8, false, 1>, fm_expert_wg_kernel<2, true, 8, false, 1>},
        {fm_expert_wg_kernel<2, false, 8, true, 1>, fm_expert_wg_kernel<2, true, 8, true, 1>}};
    if (nmax == 8) return wgs == 1 ? k8[kind][mx ? 1 : 0] : NULL;
    return (wgs == 2 ? k2 : k)[kind][mx ? 1 : 0][nmax > 2 ? 2 : nmax - 1];
}
#undef FM_WG3
#undef FM_WG3X2

extern "C" size_t fm_expert_wg_smem(int nmat, int nmax, int down, int wgs) {
    return (size_t)wg_smem_bytes(nmat, nmax, down != 0, wgs);
}

/* Whether this build holds the wgmma kernels' code for the current device
 * (sm_90a): a one-thread probe compiled under the same condition as their
 * bodies. Cached after the first call (made when an engine is created,
 * outside any capture): one build, one kind of device per process. */
__global__ void fm_wg_probe_kernel(int *out) {
#ifdef FM_HAVE_WGMMA
    *out = 1;
#else
    *out = 0;
#endif
}
extern "C" int fm_cuda_wgmma_built(void) {
    static int v = -1;
    if (v >= 0) return v;
    int *d = NULL, h = 0;
    if (cudaMalloc(&d, sizeof(int)) != cudaSuccess) {
        cudaGetLastError();
        return v = 0;
    }
    fm_wg_probe_kernel<<<1, 1>>>(d);
    if (cudaMemcpy(&h, d, sizeof(int), cudaMemcpyDeviceToHost) != cudaSuccess) h = 0;
    cudaFree(d);
    cudaGetLastError();
    return v = h;
}
