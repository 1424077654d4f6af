/*
 * What the two expert kernel families (expert_mma.cu, expert_wgmma.cu)
 * share: the FP4 decode into BF16 tensor-core operands, the work items of a
 * grid, a warp's pointers into its weight tiles, and the epilogues.
 *
 * Decoding: a nibble n placed at bits 0..3 becomes BF16 bits
 * (n << 6 | n << 12) & 0x81C0 (sign to bit 15, the 2 exponent bits and the
 * mantissa bit to the bottom of the exponent field / top of the mantissa),
 * i.e. E2M1(n) * 2^-126 (codes +-0.5 land on BF16 subnormals, which BF16
 * arithmetic keeps). The words are stored bit-permuted at upload
 * (fm_fp4_enc_word) so that these placements cost 8 integer instructions per
 * 8 weights. One BF16x2 multiply by the block scale * 2^112 (NVFP4) or
 * * 2^119 (MXFP4) gives E2M1 * scale * 2^-14 or 2^-7, exact in BF16; the
 * activations carry a compensating 2^7, and the per-tensor NVFP4 scale times
 * the 2^7 left over is applied to the FP32 accumulator.
 */
#ifndef FM_EXPERT_COMMON_CUH
#define FM_EXPERT_COMMON_CUH
#include "cuda_internal.h"
#include "device_util.cuh"
#include <cuda_bf16.h>

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 890
static __device__ __forceinline__ uint32_t bf_mul2(uint32_t a, uint32_t b) {
    __nv_bfloat162 x = *(__nv_bfloat162 *)&a, y = *(__nv_bfloat162 *)&b;
    __nv_bfloat162 r = __hmul2(x, y);
    return *(uint32_t *)&r;
}
#endif

/* Both block scales of a 16-bit scale load (bytes b0, b1) as BF16x2
 * registers (b0 * 2^112, b0 * 2^112) and (b1 * 2^112, b1 * 2^112): times a
 * decoded E2M1 * 2^-126, E2M1 * scale * 2^-14, exact in BF16 (at most 6
 * significant bits, at least 2^-24); the NVFP4 epilogues multiply the
 * per-tensor scale by the 2^7 that the activations' 2^7 leaves to make up
 * (fm_nv_s2). The upload stores the scales canonical (fm_nv_canon_block,
 * fp4_bits.h): no sign bit, and a zero scale only over zero nibbles.
 * sm_89 and later: the hardware's E4M3x2 -> F16x2 conversion, then
 * a shift and an or (fm_nv_scale_bf16x2, fp4_bits.h); s0 and s1 are the
 * halves broadcast, which ptxas folds into the decode's multiplies as
 * operand selectors (HMUL2.BF16_V2 ... R.H0_H0): 3 instructions for two
 * scales, where widening to FP32, multiplying and packing takes 7.
 * Before sm_89: each E4M3 magnitude shifted left by 4 is a BF16 of
 * value E4M3 * 2^-120 (E4M3 subnormals land on BF16 subnormals, exact),
 * two exact power-of-two products make it * 2^112, and a magnitude of 0x7F
 * (NaN) becomes a BF16 NaN first: 14 instructions. */
static __device__ __forceinline__ void nv_scale_pair(uint32_t c, uint32_t &s0, uint32_t &s1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    uint32_t h;
    asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, lo;\n\t}" : "=r"(h) : "r"(c));
    const uint32_t y = fm_nv_scale_bf16x2(h); /* (b0 * 2^112, b1 * 2^112) */
    const __nv_bfloat162 yb = *(const __nv_bfloat162 *)&y;
    const __nv_bfloat162 l2 = __low2bfloat162(yb), h2 = __high2bfloat162(yb);
    s0 = *(const uint32_t *)&l2;
    s1 = *(const uint32_t *)&h2;
#else
    const uint32_t p = __byte_perm(c, 0u, 0x4140u); /* b0 in half 0, b1 in half 1 */
    uint32_t bf = ((p << 4) & 0x07F007F0u) | ((p << 8) & 0x80008000u);
    const uint32_t nan = (((p & 0x007F007Fu) + 0x00010001u) & 0x00800080u) * 0xFFu; /* 0x7F80 per NaN half */
    bf = bf_mul2(bf_mul2(bf | nan, 0x7B807B80u), 0x77807780u); /* * 2^120, * 2^112 */
    s0 = __byte_perm(bf, 0u, 0x1010u);
    s1 = __byte_perm(bf, 0u, 0x3232u);
#endif
}

/* The per-tensor scale the epilogue applies: NVFP4's times 2^7 (see
 * nv_scale_pair), MXFP4's (1) as it is (mx_scale_bits keeps 2^119). */
template <bool MX>
static __device__ __forceinline__ float fm_nv_s2(float s2) {
    return MX ? s2 : s2 * 128.0f;
}

/* BF16 bits of an E8M0 scale 2^(e-127) times 2^119; the host rejects
 * exponents above 135 (they would overflow). */
static __device__ __forceinline__ uint32_t mx_scale_bits(uint32_t e) {
    return e == 0xFFu ? 0x7FC0u : (e + 119u) << 7;
}

static __device__ __forceinline__ uint32_t bf2_mul(uint32_t a, uint32_t s) {
    __nv_bfloat162 x = *(__nv_bfloat162 *)&a, y = *(__nv_bfloat162 *)&s;
    __nv_bfloat162 r = __hmul2(x, y);
    return *(uint32_t *)&r;
}

/* Four BF16x2 registers from one word of 8 nibbles n0..n7, stored as
 * fm_fp4_enc_word (cuda_internal.h): r[0] = (n0, n4), r[1] = (n1, n5),
 * r[2] = (n2, n6), r[3] = (n3, n7), in 8 integer instructions. */
static __device__ __forceinline__ void decode8(uint32_t w, uint32_t s2, uint32_t r[4]) {
    const uint32_t M = 0x81C081C0u;
    r[0] = bf2_mul(w & M, s2);
    r[1] = bf2_mul(__funnelshift_r(w, w, 3) & M, s2);
    r[2] = bf2_mul(__funnelshift_r(w, w, 6) & M, s2);
    r[3] = bf2_mul(((w & 0x001B001Bu) * 0x4108u) & M, s2);
}

static __device__ __forceinline__ void mma16816(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* Where element r of a K group of 8 is stored (inverse of the K order prep8 writes, route_common.cuh). */
static __device__ __forceinline__ int kperm_pos(int r) {
    const int inv = 0x75316420; /* nibble j = stored position of element j */
    return (r & ~7) | ((inv >> (4 * (r & 7))) & 7);
}

/* limit > 0 clamps gate and up first: always for gpt-oss, and for
 * SiLU-gated models that set swiglu_limit (DeepSeek-V4). Written like the
 * CPU engine's fm_cpu_act so that NaN passes through the clamps. */
static __device__ __forceinline__ float act_fn(int act, float g, float u, float alpha, float limit) {
    if (limit > 0.0f) {
        if (g > limit) g = limit;
        if (u > limit) u = limit;
        else if (u < -limit) u = -limit;
    }
    if (act == FM_ACT_GPTOSS) return g / (1.0f + __expf(-alpha * g)) * (u + 1.0f);
    return g / (1.0f + __expf(-g)) * u;
}


/* One work item of an expert kernel's grid: the shared expert's (row
 * block, token chunk) items come first, then (active expert, row block);
 * false for a block reserved for an expert that turned out inactive. */
struct fm_item {
    int e, pos0, cnt, rb, pbeg, pend;
    bool shared;
};
/* The routing results are read through L2 (ld.global.cg): a down block may
 * read them before its griddepcontrol.wait, when only L2 is
 * sure to hold this layer's values (an SM's L1 may keep an earlier layer's
 * lines). */
static __device__ __forceinline__ bool fm_get_item(const fm_expert_params &p, int nrb, fm_item &it, int b) {
    if (b < p.sh_blocks) {
        /* shared expert: every token, split into chunks so that its rows
         * are spread over many blocks instead of one long serial loop */
        it.rb = b / p.sh_chunks;
        it.pbeg = (b % p.sh_chunks) * p.sh_chunk;
        it.e = 0;
        it.pos0 = p.T * p.k;
        it.cnt = p.T;
        it.pend = min(it.cnt, it.pbeg + p.sh_chunk);
        it.shared = true;
        return true;
    }
    b -= p.sh_blocks;
    const int a = b / nrb;
    it.rb = b % nrb;
    if (a >= __ldcg(p.n_active)) return false;
    it.e = __ldcg(p.act_e + a);
    it.pos0 = __ldcg(p.act_off + a);
    it.cnt = __ldcg(p.act_cnt + a);
    it.pbeg = 0;
    it.pend = it.cnt;
    it.shared = false;
    return true;
}

/* A warp's pointers into its 16-row tiles at segment 0: weights of rows g
 * and g + 8 (pa, pb), their scales (sa, sb), and the scale tile (st). */
template <int NMAT, bool MX>
static __device__ __forceinline__ void fm_tile_ptrs(const fm_dmat &dA, const fm_dmat &dB, int e, int64_t tile0, int lane,
                                                    const uint8_t **pa, const uint8_t **pb, const uint8_t **sa,
                                                    const uint8_t **sb, const uint8_t **st) {
    const int g = lane >> 2, t = lane & 3, spr = MX ? 4 : 8;
#pragma unroll
    for (int m = 0; m < NMAT; m++) {
        const uint8_t *base = (m == 0 ? dA.packed : dB.packed) + (int64_t)e * (m == 0 ? dA.pstride : dB.pstride);
        const uint8_t *sbase = (m == 0 ? dA.scales : dB.scales) + (int64_t)e * (m == 0 ? dA.sstride : dB.sstride);
        pa[m] = base + tile0 * 1024 + lane * 16;
        pb[m] = pa[m] + 512;
        st[m] = sbase + tile0 * 16 * spr;
        sa[m] = st[m] + g * spr + (MX ? t : 2 * t);
        sb[m] = sa[m] + 8 * spr;
    }
}

/* The weights and scales of segment S of a warp's rows g and g + 8; PRE:
 * loads issued before the grid's wait (volatile, so that they stay there). */
template <int NMAT, bool MX, bool PRE>
static __device__ __forceinline__ void fm_load_seg(const uint8_t *const (&pa)[NMAT], const uint8_t *const (&pb)[NMAT],
                                                const uint8_t *const (&sa)[NMAT], const uint8_t *const (&sb)[NMAT],
                                                int S, uint64_t pol, uint4 (&wa)[NMAT], uint4 (&wb)[NMAT],
                                                uint32_t (&ca)[NMAT], uint32_t (&cb)[NMAT]) {
#pragma unroll
    for (int m = 0; m < NMAT; m++) {
        wa[m] = PRE ? ld_stream_pol_v(pa[m] + (int64_t)S * 1024, pol) : ld_stream_pol(pa[m] + (int64_t)S * 1024, pol);
        wb[m] = PRE ? ld_stream_pol_v(pb[m] + (int64_t)S * 1024, pol) : ld_stream_pol(pb[m] + (int64_t)S * 1024, pol);
        if (MX) {
            ca[m] = PRE ? ld_u8_pol_v(sa[m] + (int64_t)S * 64, pol) : ld_u8_pol(sa[m] + (int64_t)S * 64, pol);
            cb[m] = PRE ? ld_u8_pol_v(sb[m] + (int64_t)S * 64, pol) : ld_u8_pol(sb[m] + (int64_t)S * 64, pol);
        } else {
            ca[m] = PRE ? ld_u16_pol_v(sa[m] + (int64_t)S * 128, pol) : ld_u16_pol(sa[m] + (int64_t)S * 128, pol);
            cb[m] = PRE ? ld_u16_pol_v(sb[m] + (int64_t)S * 128, pol) : ld_u16_pol(sb[m] + (int64_t)S * 128, pol);
        }
    }
}

/* What the epilogue needs of a work item and its matrices. */
struct fm_epi {
    const float *biasA, *biasB;
    float s2A, s2B;
    int rows, rows_p, e, pos0, cnt;
    bool shared;
};
/* Down's output with the token row and routing weight given (the wgmma
 * down reads them from shared memory; fm_emit from the grouping). */
static __device__ __forceinline__ void fm_emit_down(const fm_expert_params &p, const fm_epi &o, int row, int idx,
                                                    int tok, float wgt, float a) {
    if (idx >= o.cnt || row >= o.rows) return;
    const float biasA = o.biasA ? o.biasA[(int64_t)o.e * o.rows_p + row] : 0.0f;
    atomicAdd(&p.out[(int64_t)tok * p.H + row], (a * o.s2A + biasA) * wgt);
}
/* One output of a warp: row `row` for the item's token idx, from the FP32
 * sums a (gate or down) and b (up). Gate/up applies the activation and
 * writes h as BF16 * 2^7 in down's K order; down adds the routing-weighted
 * result into the output (the k-way combine and the shared expert). */
template <int NMAT>
static __device__ __forceinline__ void fm_emit(const fm_expert_params &p, const fm_epi &o, int row, int idx, float a,
                                               float b) {
    if (idx >= o.cnt) return;
    const int pos = o.pos0 + idx;
    if (NMAT != 2) {
        if (row < o.rows)
            fm_emit_down(p, o, row, idx, o.shared ? idx : p.sorted_tok[pos], o.shared ? 1.0f : p.sorted_w[pos], a);
        return;
    }
    const float biasA = (o.biasA && row < o.rows) ? o.biasA[(int64_t)o.e * o.rows_p + row] : 0.0f;
    const float y = a * o.s2A + biasA;
    const float biasB = (o.biasB && row < o.rows) ? o.biasB[(int64_t)o.e * o.rows_p + row] : 0.0f;
    const float u = b * o.s2B + biasB;
    const float hv = row < o.rows ? act_fn(p.act, y, u, p.alpha, p.limit) : 0.0f;
    __nv_bfloat16 hb = __float2bfloat16_rn(hv * 128.0f);
    p.h[(int64_t)pos * p.hstride + kperm_pos(row)] = *(uint16_t *)&hb;
}

#endif
