/*
 * The expert kernels: gate/up (+ activation) and down (+ routing weight and
 * k-way combine), FP4 weights decoded in registers into BF16 tensor-core
 * operands.
 *
 * Work: one thread block per (active expert, block of weight rows); blocks
 * reserved for experts that turned out inactive exit at once (the grid is
 * sized without a host sync). The shared expert, which every token uses,
 * has one block per (block of rows, chunk of 8 * NT tokens), first in the
 * grid. A warp owns 16 weight rows (the M of
 * mma.m16n8k16) over a range of K and the expert's tokens in N, 8 per MMA
 * tile, NT tiles per pass. Warps of a block either split K (small path,
 * reduced through shared memory) or own different rows (large path).
 *
 * Weights: each thread reads, per 128-wide K segment, 16 bytes (32 values)
 * of row g and of row g + 8 (g = lane / 4, t = lane % 4 picks the 32-value
 * piece), so a warp reads 64 contiguous bytes of 16 rows. The MMA's K order
 * is a permutation of the real K order, chosen so that the nibbles a thread
 * holds map to its A fragment with few instructions; the activations are
 * stored permuted the same way (route.cu, the h store below), so each B
 * fragment is one aligned 8-byte piece.
 *
 * Decoding: a nibble n placed at bits 0..3 becomes BF16 bits
 * (n << 6 | n << 12) & 0x81C0 (sign to bit 15, the 2 exponent bits and the
 * mantissa bit to the bottom of the exponent field / top of the mantissa),
 * i.e. E2M1(n) * 2^-126 (codes +-0.5 land on BF16 subnormals, which BF16
 * arithmetic keeps). The words are stored bit-permuted at upload
 * (fm_fp4_enc_word) so that these placements cost 8 integer instructions per
 * 8 weights (v6) instead of 13 (v5, still built for
 * FP4MOE_CUDA_FP4_DECODE=v5). One BF16x2 multiply by the block scale *
 * 2^112 (NVFP4, v57) or * 2^119 (MXFP4) gives E2M1 * scale * 2^-14 or 2^-7,
 * exact in BF16; the activations carry a compensating 2^7, and the
 * per-tensor NVFP4 scale times the 2^7 left over is applied to the FP32
 * accumulator.
 */
#include "cuda_internal.h"
#include "stream_read.cuh"
#include <string.h>
#include <stdlib.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdio.h>
#include <cooperative_groups.h>

static __device__ __forceinline__ void pdl_wait(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* gpu-scope acquire load (v42's per-expert handoff, the wgmma kernels) */
static __device__ __forceinline__ unsigned ld_acquire_u32(const unsigned *q) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(q) : "memory");
    return v;
}
#endif
static __device__ __forceinline__ void pdl_launch_dependents(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* Bulk prefetch of [p, p + bytes) into L2 (sm_90; p and bytes multiples
 * of 16). */
static __device__ __forceinline__ void prefetch_l2(const void *p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#else
    (void)p;
    (void)bytes;
#endif
}

/* FM_L2_256B=1 (a build-time knob for A/B builds): the weight loads and
 * copies also ask L2 to fetch whole 256-byte pieces (.L2::256B), as before
 * v39. 0 (the default from v39) leaves the fetch size to L2: the hint made a
 * pure streaming read 5 - 8 % slower on the H200 (dev/tools/cuda_bwprobe)
 * and the expert kernels no faster (docs/perf.md, v39). */
#ifndef FM_L2_256B
#define FM_L2_256B 0
#endif
#if FM_L2_256B
#define FM_L2PF ".L2::256B"
#else
#define FM_L2PF ""
#endif

/* The L2 policy of the weight streams (fm_expert_params.l2first): evict
 * first, so that the bytes read once per layer do not push out what is
 * read again soon (the tokens' activations, h, the routing arrays, the
 * code of the next kernels), or the default priority. */
static __device__ __forceinline__ uint64_t l2_policy(int first) {
    uint64_t pol;
    if (first) asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    else asm("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}
static __device__ __forceinline__ uint4 ld_stream_pol(const void *p, uint64_t pol) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint" FM_L2PF ".v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p), "l"(pol));
    return r;
}
static __device__ __forceinline__ uint32_t ld_u16_pol(const void *p, uint64_t pol) {
    unsigned short r;
    asm("ld.global.nc.L2::cache_hint.u16 %0, [%1], %2;" : "=h"(r) : "l"(p), "l"(pol));
    return r;
}
static __device__ __forceinline__ uint32_t ld_u8_pol(const void *p, uint64_t pol) {
    unsigned short r;
    asm("ld.global.nc.L2::cache_hint.u8 %0, [%1], %2;" : "=h"(r) : "l"(p), "l"(pol));
    return r & 0xFFu;
}

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
 * sm_89 and later (v57): the hardware's E4M3x2 -> F16x2 conversion, then
 * a shift and an or (fm_nv_scale_bf16x2, fp4_bits.h); s0 and s1 are the
 * halves broadcast, which ptxas folds into the decode's multiplies as
 * operand selectors (HMUL2.BF16_V2 ... R.H0_H0): 3 instructions for two
 * scales, where widening to FP32, multiplying and packing took 7 (v23).
 * Before sm_89 (v12): each E4M3 magnitude shifted left by 4 is a BF16 of
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

/* Four BF16x2 registers from one word of 8 nibbles n0..n7:
 * r[0] = (n0, n4), r[1] = (n1, n5), r[2] = (n2, n6), r[3] = (n3, n7).
 * ENC: the word is stored as fm_fp4_enc_word (cuda_internal.h), 8 integer
 * instructions (2 SHF, 5 LOP3, 1 IMAD) instead of 13 (1 SHF, 8 LOP3, 4 IMAD). */
template <bool ENC>
static __device__ __forceinline__ void decode8(uint32_t w, uint32_t s2, uint32_t r[4]) {
    const uint32_t M = 0x81C081C0u;
    if (ENC) {
        r[0] = bf2_mul(w & M, s2);
        r[1] = bf2_mul(__funnelshift_r(w, w, 3) & M, s2);
        r[2] = bf2_mul(__funnelshift_r(w, w, 6) & M, s2);
        r[3] = bf2_mul(((w & 0x001B001Bu) * 0x4108u) & M, s2);
    } else {
        uint32_t w2 = w >> 8;
        r[0] = bf2_mul(((w & 0x000F000Fu) * 0x1040u) & M, s2);
        r[1] = bf2_mul(((w & 0x00F000F0u) * 0x104u) & M, s2);
        r[2] = bf2_mul(((w2 & 0x000F000Fu) * 0x1040u) & M, s2);
        r[3] = bf2_mul(((w2 & 0x00F000F0u) * 0x104u) & M, s2);
    }
}

static __device__ __forceinline__ void mma16816(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* Where element r of a K group of 8 is stored (inverse of route.cu's perm). */
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
 * read them before its griddepcontrol.wait (p.pre_wait), when only L2 is
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

/* One 128-wide K segment: decode the thread's weights of rows g and g + 8
 * (both matrices) and run the MMAs against every token tile. */
template <int NT, int NMAT, bool MX, bool ENC>
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
            decode8<ENC>(wA, SA[d >> 1], ra);
            decode8<ENC>(wB, SB[d >> 1], rbv);
#pragma unroll
            for (int n = 0; n < NT; n++) {
                mma16816(acc[m][n], ra[0], rbv[0], ra[1], rbv[1], xb[n][d].x, xb[n][d].y);
                mma16816(acc[m][n], ra[2], rbv[2], ra[3], rbv[3], xb[n][d].z, xb[n][d].w);
            }
        }
    }
}

/* The same for the register pipeline, with the activations read from
 * global memory (L1) one 32-wide K step at a time, both matrices per step:
 * NT x 4 registers of activations live instead of NT x 16, which is what
 * keeps the 16-token tile within 128 registers (two 4-warp blocks per SM). */
template <int NT, int NMAT, bool MX, bool ENC>
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
            decode8<ENC>(wA, SA[m][d >> 1], ra);
            decode8<ENC>(wB, SB[m][d >> 1], rbv);
#pragma unroll
            for (int n = 0; n < NT; n++) {
                mma16816(acc[m][n], ra[0], rbv[0], ra[1], rbv[1], x[n].x, x[n].y);
                mma16816(acc[m][n], ra[2], rbv[2], ra[3], rbv[3], x[n].z, x[n].w);
            }
        }
    }
}

static __device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global" FM_L2PF " [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
static __device__ __forceinline__ void cp_async16_pol(uint32_t dst, const void *src, uint64_t pol) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint" FM_L2PF " [%0], [%1], 16, 16, %2;" ::"r"(dst), "l"(src),
                 "l"(pol)
                 : "memory");
}
template <int B>
static __device__ __forceinline__ void cp_async_small_pol(uint32_t dst, const void *src, uint64_t pol) {
    asm volatile("cp.async.ca.shared.global.L2::cache_hint [%0], [%1], %2, %2, %3;" ::"r"(dst), "l"(src), "n"(B),
                 "l"(pol)
                 : "memory");
}
/* 8 bytes (NVFP4 scales of 4 threads) or 4 (MXFP4); src aligned to that */
template <int B>
static __device__ __forceinline__ void cp_async_small(uint32_t dst, const void *src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(dst), "l"(src), "n"(B), "r"(valid ? B : 0)
                 : "memory");
}
static __device__ __forceinline__ void cp_async_commit(void) { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
static __device__ __forceinline__ void cp_async_wait(void) {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

/* Bytes of one pipeline stage of one warp: weights (rows g and g + 8 of
 * each matrix, 16 bytes per thread), their scales (8 bytes per row), the
 * token tiles' activations (64 bytes per thread and tile). */
template <int NT, int NMAT>
struct fm_stage {
    static constexpr int W = 0, S = NMAT * 1024, X = S + NMAT * 128, BYTES = X + NT * 2048;
};

/* Blocks of 256 threads per SM the compiler must fit (so registers per
 * thread <= 65536 / (256 * it)): the register pipeline with 8-token tiles
 * and the cp.async ring at 2 (128 registers); FM_ST_REGS_XG also at 16-token
 * tiles, and its 8-token down at 3 (80 registers, no spills); the register
 * pipeline's 8-token down at 4 (64 registers instead of 91, no spills: at
 * B = 1 its blocks fit one wave, docs/perf.md, v21). */
static constexpr int fm_min_blocks(int nt, int nmat, int st) {
    return st == 0 && nt == 1 && nmat == 1 ? 4
           : st == FM_ST_REGS_XG          ? (nt == 1 && nmat == 1 ? 3 : nt <= 2 ? 2 : 1)
           : (nt == 1 || st > 0)          ? 2
                                          : 1;
}

/*
 * NMAT = 2: gate and up of the same rows (the activation is applied in
 * registers, h goes to global as BF16 * 2^7, K-permuted for down).
 * NMAT = 1: down; the result times the routing weight is added into out.
 */
template <int NT, int NMAT, bool MX, int ST, bool ENC>
__global__ void __launch_bounds__(256, fm_min_blocks(NT, NMAT, ST)) fm_expert_kernel(fm_expert_params p, int W, int KS) {
    extern __shared__ float ex_smem[];
    const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int rgroups = W / KS, rg = wi / KS, ks = wi % KS;
    const int rpb = 16 * rgroups;

    const int nrb = ((NMAT == 2 ? p.gate.rows_p : p.down.rows_p) + rpb - 1) / rpb;

    /* The shared expert needs no routing result: the first chunk's block of
     * each row block asks L2 for its rows (weights and scales) before the
     * wait, so they arrive while routing runs. */
    if (p.sh_prefetch && blockIdx.x < p.sh_blocks && threadIdx.x == 0 && blockIdx.x % p.sh_chunks == 0) {
        const int r0b = (blockIdx.x / p.sh_chunks) * rpb;
#pragma unroll
        for (int m = 0; m < NMAT; m++) {
            const fm_dmat &d = NMAT == 2 ? (m == 0 ? p.sgate : p.sup) : p.sdown;
            const int nrg = min(rgroups, (d.rows_p - r0b) / 16), ns = d.kp / FM_KSEG, spr_ = MX ? 4 : 8;
            if (nrg > 0) {
                prefetch_l2(d.packed + (int64_t)(r0b / 16) * ns * 1024, (uint32_t)nrg * ns * 1024);
                prefetch_l2(d.scales + (int64_t)(r0b / 16) * ns * 16 * spr_, (uint32_t)nrg * ns * 16 * spr_);
            }
        }
    }
    /* the shared expert's gate/up reads no routing result (p.sh_early) */
    const bool no_wait = NMAT == 2 && p.sh_early && (int)blockIdx.x < p.sh_blocks;
    /* p.pre_wait: down's blocks and the shared expert's issue their first
     * weight loads before the wait (the register pipeline below) */
    bool waited = !(p.pre_wait && (NMAT == 1 || (int)blockIdx.x < p.sh_blocks));
    if (waited) {
        if (!no_wait) pdl_wait();
        pdl_launch_dependents();
    }
#define FM_WAIT_ONCE()                       \
    do {                                     \
        if (!waited) {                       \
            if (!no_wait) pdl_wait();        \
            pdl_launch_dependents();         \
            waited = true;                   \
        }                                    \
    } while (0)

    fm_item it;
    if (!fm_get_item(p, nrb, it, (int)blockIdx.x)) return;
    const int e = it.e, pos0 = it.pos0, cnt = it.cnt, pbeg = it.pbeg, pend = it.pend;
    const bool shared = it.shared;
    /* field by field, so that the parameter structs stay in constant space */
    const fm_dmat &dA = NMAT == 2 ? (shared ? p.sgate : p.gate) : (shared ? p.sdown : p.down);
    const fm_dmat &dB = NMAT == 2 ? (shared ? p.sup : p.up) : dA;
    const int rows_p = dA.rows_p, kp = dA.kp;
    const int r0 = (it.rb * rgroups + rg) * 16;
    const int rowA = r0 + g, rowB = r0 + g + 8;
    const int nseg = kp / FM_KSEG;
    /* Rows rows .. rows_p - 1 are zero in memory (weights and scales), so the
     * loads need no per-row predicate: only a warp whose 16 rows lie wholly
     * past rows_p (the grid's last row block) has nothing to load. */
    const bool wv = r0 < rows_p;
    const int s_begin = wv ? ks * nseg / KS : 0, s_end = wv ? (ks + 1) * nseg / KS : 0;
    const int spr = MX ? 4 : 8;          /* scale bytes per row and tile */
    const int64_t tile0 = (int64_t)(r0 / 16) * nseg;

    const uint8_t *pa[NMAT], *pb[NMAT], *sa[NMAT], *sb[NMAT], *st[NMAT];
    fm_tile_ptrs<NMAT, MX>(dA, dB, e, tile0, lane, pa, pb, sa, sb, st);
    const uint16_t *src_base = NMAT == 2 ? p.x_prep : p.h;
    const int64_t src_stride = NMAT == 2 ? p.Hp : p.hstride;
    const uint64_t wpol = l2_policy(p.l2first);

    for (int pass0 = pbeg; pass0 < pend; pass0 += 8 * NT) {
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

        if (ST < FM_CP_STAGES) {
        /* registers: weights and scales of the next segment are loaded
         * before the current one is decoded, so every warp keeps two
         * segments of loads in flight */
        uint4 wa[NMAT], wb[NMAT], na[NMAT], nb[NMAT];
        uint32_t ca[NMAT], cb[NMAT], nca[NMAT], ncb[NMAT];
#define FM_LOAD_SEG(S, WA, WB, CA, CB)                                                                    \
    _Pragma("unroll") for (int m = 0; m < NMAT; m++) {                                                    \
        WA[m] = ld_stream_pol(pa[m] + (int64_t)(S) * 1024, wpol);                                         \
        WB[m] = ld_stream_pol(pb[m] + (int64_t)(S) * 1024, wpol);                                         \
        if (MX) {                                                                                          \
            CA[m] = ld_u8_pol(sa[m] + (int64_t)(S) * 64, wpol);                                            \
            CB[m] = ld_u8_pol(sb[m] + (int64_t)(S) * 64, wpol);                                            \
        } else {                                                                                           \
            CA[m] = ld_u16_pol(sa[m] + (int64_t)(S) * 128, wpol);                                          \
            CB[m] = ld_u16_pol(sb[m] + (int64_t)(S) * 128, wpol);                                          \
        }                                                                                                  \
    }
        if (s_begin < s_end) { FM_LOAD_SEG(s_begin, wa, wb, ca, cb) }
        /* before the wait (p.pre_wait): the second segment too */
        const int s_pre = waited ? s_begin : s_begin + 1;
        if (!waited && s_begin + 1 < s_end) { FM_LOAD_SEG(s_begin + 1, na, nb, nca, ncb) }
        FM_WAIT_ONCE();
        constexpr int seg_unroll = ST == FM_ST_REGS_XG ? 1 : 2;
#pragma unroll seg_unroll
        for (int s = s_begin; s < s_end; s++) {
            /* after the last segment na.. are not used */
            if (s + 1 < s_end && s >= s_pre) { FM_LOAD_SEG(s + 1, na, nb, nca, ncb) }
            if (ST == FM_ST_REGS_XG) {
                seg_compute_g<NT, NMAT, MX, ENC>(acc, wa, wb, ca, cb, src, s);
            } else {
                uint4 xb[NT][4];
#pragma unroll
                for (int n = 0; n < NT; n++)
#pragma unroll
                    for (int d = 0; d < 4; d++)
                        xb[n][d] = src[n] ? __ldg((const uint4 *)(src[n] + s * FM_KSEG) + d) : make_uint4(0, 0, 0, 0);
                seg_compute<NT, NMAT, MX, ENC>(acc, wa, wb, ca, cb, xb);
            }
#pragma unroll
            for (int m = 0; m < NMAT; m++) { wa[m] = na[m]; wb[m] = nb[m]; ca[m] = nca[m]; cb[m] = ncb[m]; }
        }
#undef FM_LOAD_SEG
        } else {
        /* cp.async ring of ST stages per warp in shared memory: ST - 1
         * segments (weights, scales, activations) in flight per warp
         * without holding registers for them */
        /* ST itself in the ring's instantiations; a stand-in in the others,
         * which never take this branch (keeps "% 0" out of their code) */
        FM_WAIT_ONCE();
        constexpr int RS = ST >= FM_CP_STAGES ? ST : FM_CP_STAGES;
        typedef fm_stage<NT, NMAT> SG;
        uint8_t *ring = (uint8_t *)ex_smem + (KS > 1 ? (size_t)W * NMAT * NT * 4 * 32 * sizeof(float) : 0) +
                        (size_t)wi * RS * SG::BYTES;
        const uint32_t ring_s = (uint32_t)__cvta_generic_to_shared(ring);
        const int ns = s_end - s_begin;
        const int sbytes = 16 * spr; /* scale bytes per tile */
        const uint8_t *safe = dA.packed; /* any valid address for zero-size copies */
        const uint8_t *sca[NMAT], *scb[NMAT];
#pragma unroll
        for (int m = 0; m < NMAT; m++) { sca[m] = sa[m] - (MX ? t : 2 * t); scb[m] = sb[m] - (MX ? t : 2 * t); }
#define FM_ISSUE(J)                                                                                        \
    do {                                                                                                   \
        if ((J) < ns) {                                                                                    \
            const int s_ = s_begin + (J);                                                                  \
            const uint32_t st_ = ring_s + ((J) % RS) * SG::BYTES;                                          \
            _Pragma("unroll") for (int m = 0; m < NMAT; m++) {                                             \
                cp_async16_pol(st_ + SG::W + m * 1024 + lane * 16, pa[m] + (int64_t)s_ * 1024, wpol);     \
                cp_async16_pol(st_ + SG::W + m * 1024 + 512 + lane * 16, pb[m] + (int64_t)s_ * 1024, wpol); \
                if (t == 0) {                                                                              \
                    cp_async_small_pol<MX ? 4 : 8>(st_ + SG::S + m * 128 + g * 8, sca[m] + (int64_t)s_ * sbytes, wpol); \
                    cp_async_small_pol<MX ? 4 : 8>(st_ + SG::S + m * 128 + (g + 8) * 8, scb[m] + (int64_t)s_ * sbytes, wpol); \
                }                                                                                          \
            }                                                                                              \
            _Pragma("unroll") for (int n = 0; n < NT; n++)                                                 \
                _Pragma("unroll") for (int d = 0; d < 4; d++)                                              \
                    cp_async16(st_ + SG::X + n * 2048 + d * 512 + lane * 16,                               \
                               src[n] ? (const void *)((const uint4 *)(src[n] + s_ * FM_KSEG) + d) : (const void *)safe, \
                               src[n] != NULL);                                                            \
        }                                                                                                  \
        cp_async_commit();                                                                                 \
    } while (0)
#pragma unroll
        for (int j = 0; j < RS - 1; j++) FM_ISSUE(j);
        for (int j = 0; j < ns; j++) {
            FM_ISSUE(j + RS - 1);
            cp_async_wait<RS - 1>();
            __syncwarp();
            const uint8_t *stg = ring + (j % RS) * SG::BYTES;
            uint4 wa[NMAT], wb[NMAT], xb[NT][4];
            uint32_t ca[NMAT], cb[NMAT];
#pragma unroll
            for (int m = 0; m < NMAT; m++) {
                wa[m] = *(const uint4 *)(stg + SG::W + m * 1024 + lane * 16);
                wb[m] = *(const uint4 *)(stg + SG::W + m * 1024 + 512 + lane * 16);
                if (MX) {
                    ca[m] = stg[SG::S + m * 128 + g * 8 + t];
                    cb[m] = stg[SG::S + m * 128 + (g + 8) * 8 + t];
                } else {
                    ca[m] = *(const uint16_t *)(stg + SG::S + m * 128 + g * 8 + 2 * t);
                    cb[m] = *(const uint16_t *)(stg + SG::S + m * 128 + (g + 8) * 8 + 2 * t);
                }
            }
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int d = 0; d < 4; d++) xb[n][d] = *(const uint4 *)(stg + SG::X + n * 2048 + d * 512 + lane * 16);
            __syncwarp();
            seg_compute<NT, NMAT, MX, ENC>(acc, wa, wb, ca, cb, xb);
        }
#undef FM_ISSUE
        cp_async_wait<0>();
        __syncwarp();
        }

        /* K split across warps: sum the partial tiles in shared memory */
        if (KS > 1) {
            float *red = ex_smem + (size_t)wi * (NMAT * NT * 4 * 32);
#pragma unroll
            for (int m = 0; m < NMAT; m++)
#pragma unroll
                for (int n = 0; n < NT; n++)
#pragma unroll
                    for (int i = 0; i < 4; i++) red[((m * NT + n) * 4 + i) * 32 + lane] = acc[m][n][i];
            __syncthreads();
            if (ks == 0) {
                for (int o = 1; o < KS; o++) {
                    const float *r2 = ex_smem + (size_t)(wi + o) * (NMAT * NT * 4 * 32);
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

        if (ks == 0 && r0 < rows_p) {
            /* made here, not before the loop, so that none of it holds a
             * register through the K loop */
            const fm_epi o = {dA.bias, dB.bias, fm_nv_s2<MX>(dA.scale2[e]),
                              NMAT == 2 ? fm_nv_s2<MX>(dB.scale2[e]) : 0.0f, dA.rows, rows_p, e, pos0, cnt, shared};
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int i = 0; i < 4; i++)
                    fm_emit<NMAT>(p, o, i < 2 ? rowA : rowB, pass0 + n * 8 + 2 * t + (i & 1), acc[0][n][i],
                                  acc[NMAT - 1][n][i]);
        }
    }
#undef FM_WAIT_ONCE
}

/* ------------------------------------------------ wgmma path (sm_90a) */

/*
 * The same work split and weight stream as above, with the tensor-core work
 * done by warpgroup MMAs: a block is one warpgroup (4 warps, 64 weight
 * rows); each warp decodes its 16 rows exactly as the mma.sync kernel does
 * (the register fragment of A in wgmma.m64nNk16 is, per warp, that of
 * mma.m16n8k16), and one wgmma.m64nNk16 per 16-wide K step multiplies the
 * block's 64 rows by all of its N = 8 .. 32 tokens at once, with the tokens'
 * activations read by the tensor cores from shared memory. So the
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
 * in global memory are in the mma.sync order (route.cu's x_prep, the h the
 * gate/up epilogue writes): the 8-value group d of thread t's 32-value piece
 * holds the K pairs (2t, 2t + 1) and (2t + 8, 2t + 9) of steps 2d and 2d + 1,
 * so each 16-byte load is stored as four 4-byte words.
 */
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FM_HAVE_WGMMA 1
#endif
static constexpr FM_HD int wg_step_bytes(int n8) { return n8 * 256 + 16; }
static constexpr FM_HD int wg_stage_bytes(int n8) { return 8 * wg_step_bytes(n8); }
/* Segments copied ahead, for gate/up and for down (v16: two, for more
 * blocks per SM than three allowed; v19 / v30: three or more measured
 * slower; v33: one measured slower at B = 2 - 16, 4 - 17 %). Build-time
 * knobs for such A/B builds (-DFM_WG_LA_GU=1 ...), not run-time switches. */
#ifndef FM_WG_LA_GU
#define FM_WG_LA_GU 2
#endif
#ifndef FM_WG_LA_DN
#define FM_WG_LA_DN 2
#endif
static constexpr FM_HD int wg_la(bool gu) { return gu ? FM_WG_LA_GU : FM_WG_LA_DN; }
/* FM_WG_DB = n > 0: passes of at least 8 n tokens keep two K steps of A
 * fragments (v47); 0: one. */
#ifndef FM_WG_DB
#define FM_WG_DB 0
#endif
/* One segment of one warp's weight ring: per matrix 1024 bytes of weights
 * and 128 of scales (64 used by MXFP4). */
static constexpr FM_HD int wg_wstage_bytes(int nmat) { return nmat * 1152; }
/* Down's blocks also keep the pass's token rows and routing weights (64
 * ints and 64 floats) after the weight rings, for the epilogue. wgs: the
 * block's warpgroups (1, or 2 sharing one activation stage, v43). */
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
 * MMA instead of a mask, shift and or per descriptor (v40). */
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
/* m64n64k16 (v46: the shared expert's 64-token passes) */
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
    bool wv;
    bool wv2; /* D2: the second 64 rows exist (else they are not written) */
    bool pre; /* the first LA segments' weights were copied before the wait */
    fm_epi o;
};

#ifdef FM_HAVE_WGMMA
/* Segment S's weights and scales into this warp's ring stage (cp.async, not
 * committed). */
template <int NMAT, bool MX, int NSTG>
static __device__ __forceinline__ void wg_wcopy(const fm_wg_pass &w, uint32_t wr_s, int lane, int S, uint64_t wpol) {
    constexpr int WST = wg_wstage_bytes(NMAT), SPR = MX ? 4 : 8;
#pragma unroll
    for (int m = 0; m < NMAT; m++) {
        const uint32_t d_ = wr_s + (S % NSTG) * WST + m * 1152;
        /* unsigned 32-bit offsets: one IMAD.WIDE.U32 per address, where a
         * signed 64-bit product took three to four (v53) */
        const uint8_t *q_ = w.pa[m] + (uint32_t)S * 1024u;
        cp_async16_pol(d_ + lane * 16, q_, wpol);
        cp_async16_pol(d_ + 512 + lane * 16, q_ + 512, wpol);
        if (lane < SPR)
            cp_async16_pol(d_ + 1024 + lane * 16, w.st[m] + ((uint32_t)S * (16u * SPR) + (uint32_t)lane * 16u), wpol);
    }
}
#endif

/* One pass: up to 8 * N8 tokens of the block's expert through its 64 rows,
 * over the whole K. */
/* D2: down with NMAT = 2, the two "matrices" being rows r .. r + 63 and
 * r + 64 .. r + 127 of the down matrix (a 128-row block: as many weight
 * bytes per segment and per barrier as gate/up). */
/* WGS: warpgroups per block (v43): with 2, each warpgroup runs its own rows
 * (its own weight rings, accumulators and wgmmas) against the one stage of
 * activations both read, which the block's 256 threads copy; so the
 * activations cross from L2 once per 128 (gate/up) or 256 (down) rows
 * instead of once per 64 or 128. */
template <int N8, int NMAT, bool MX, bool D2, int WGS>
static __device__ __forceinline__ void wg_pass_body(const fm_expert_params &p, const fm_wg_pass &w, uint8_t *smem) {
    constexpr bool GU = NMAT == 2 && !D2; /* gate/up, else down */
#ifdef FM_HAVE_WGMMA
    constexpr int STEP = wg_step_bytes(N8), STAGE = wg_stage_bytes(N8);
    constexpr int NTH = 128 * WGS;                   /* threads of the block      */
    constexpr int NITEMS = 128 * N8;                 /* 16-byte pieces per stage  */
    constexpr int NIT = (NITEMS + NTH - 1) / NTH;    /* staging items per thread  */
    /* LA segments copied ahead (activations, weights, scales); the stage
     * refilled at segment s last held segment s - 1, whose MMAs every warp
     * retired before the barrier of segment s */
    constexpr int LA = wg_la(GU), NSTG = LA + 1, WST = wg_wstage_bytes(NMAT);
    const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3, wi = tid >> 5;
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(smem);
    /* this warp's ring of weight tiles (1024 bytes) and their scales */
    const uint32_t wr_s = sbase + w.wring_off + wi * (NSTG * WST);
    const uint8_t *wr_g = smem + w.wring_off + wi * (NSTG * WST);

    /* staging by cp.async, 4 bytes at a time (the reorder above): item
     * it = (token n = it / 16, 16-byte piece u = it % 16); a token past the
     * pass is zero-filled: it copies nothing (source size 0) from row 0 of
     * the source, whose address runs along the segments like the others',
     * so that the copies need no select (v53) */
    const uint8_t *xsrc[NIT];
    uint32_t xoff[NIT];
    bool xin[NIT]; /* the item exists (with WGS = 2 some threads have fewer) */
    bool xv[NIT];  /* its token is in the pass                                */
#pragma unroll
    for (int k = 0; k < NIT; k++) {
        const int it = tid + k * NTH, n = it >> 4, u = it & 15, ut = u >> 2, ud = u & 3;
        const int idx = w.pass0 + n;
        xin[k] = NITEMS % NTH == 0 || it < NITEMS;
        xv[k] = idx < w.o.cnt;
        xsrc[k] = (const uint8_t *)w.src_base;
        xoff[k] = (uint32_t)(2 * ud * STEP + (n >> 3) * 256 + (n & 7) * 16 + 4 * ut);
        if (xv[k]) {
            const int pos = w.o.pos0 + idx;
            const int64_t row = GU ? (w.o.shared ? idx : p.sorted_tok[pos]) : pos;
            xsrc[k] = (const uint8_t *)(w.src_base + row * w.src_stride + u * 8);
        }
    }
    const uint64_t wpol = l2_policy(p.l2first);
    /* the weights first: their addresses need no load, so the first
     * segments' weight copies leave before the token rows have arrived */
#define FM_WG_XCOPY(S, WEIGHTS)                                                                            \
    do {                                                                                                   \
        if ((S) < w.nseg) {                                                                                \
            const uint32_t st_ = sbase + ((S) % NSTG) * STAGE;                                             \
            if (WEIGHTS) wg_wcopy<NMAT, MX, NSTG>(w, wr_s, lane, (S), wpol);                                     \
            _Pragma("unroll") for (int k = 0; k < NIT; k++) {                                              \
                if (!xin[k]) continue;                                                                     \
                const uint8_t *q_ = xsrc[k] + (uint32_t)(S) * (uint32_t)(FM_KSEG * 2);                     \
                const bool v_ = xv[k];                                                                     \
                cp_async_small<4>(st_ + xoff[k], q_, v_);                                                  \
                cp_async_small<4>(st_ + xoff[k] + 128, q_ + 4, v_);                                        \
                cp_async_small<4>(st_ + xoff[k] + STEP, q_ + 8, v_);                                       \
                cp_async_small<4>(st_ + xoff[k] + STEP + 128, q_ + 12, v_);                                \
            }                                                                                              \
        }                                                                                                  \
        cp_async_commit();                                                                                 \
    } while (0)
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

    uint4 wa[NMAT], wb[NMAT];
    uint32_t ca[NMAT], cb[NMAT];
    const int nseg = w.nseg;
    /* w.pre: the weights of segments 0 .. LA - 1 are in flight already, in
     * a group of their own committed before these */
#pragma unroll
    for (int j = 0; j < LA; j++) FM_WG_XCOPY(j, !w.pre);
#pragma unroll 1
    for (int s = 0; s < nseg; s++) {
        /* this thread's pieces of segment s have landed; after the barrier
         * everyone's have, and every warp is past the wait that retired the
         * MMAs that last read the stage refilled next */
        cp_async_wait<LA - 1>();
        fence_proxy_async();
        __syncthreads();
        FM_WG_XCOPY(s + LA, true);
        {
            const uint8_t *wp = wr_g + (s % NSTG) * WST;
#pragma unroll
            for (int m = 0; m < NMAT; m++) {
                wa[m] = *(const uint4 *)(wp + m * 1152 + lane * 16);
                wb[m] = *(const uint4 *)(wp + m * 1152 + 512 + lane * 16);
                if (MX) {
                    ca[m] = wp[m * 1152 + 1024 + g * 4 + t];
                    cb[m] = wp[m * 1152 + 1024 + (g + 8) * 4 + t];
                } else {
                    ca[m] = *(const uint16_t *)(wp + m * 1152 + 1024 + g * 8 + 2 * t);
                    cb[m] = *(const uint16_t *)(wp + m * 1152 + 1024 + (g + 8) * 8 + 2 * t);
                }
            }
        }
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
        const uint32_t st_addr = sbase + (s % NSTG) * STAGE;
        const uint32_t dlo = wg_desc_lo(st_addr);
        /* FM_WG_DB (v47, a build-time knob for A/B builds): two steps of A
         * fragments, so that a step's decode runs while the previous step's
         * MMAs do (wait for all but the last group) */
        constexpr int NB = FM_WG_DB && N8 >= FM_WG_DB ? 2 : 1;
        uint32_t ra[NB][NMAT][4], rb[NB][NMAT][4];
#pragma unroll
        for (int d = 0; d < 4; d++) {
            const int bf = NB == 2 ? (d & 1) : 0;
#pragma unroll
            for (int m = 0; m < NMAT; m++) {
                const uint32_t wA = d == 0 ? wa[m].x : d == 1 ? wa[m].y : d == 2 ? wa[m].z : wa[m].w;
                const uint32_t wB = d == 0 ? wb[m].x : d == 1 ? wb[m].y : d == 2 ? wb[m].z : wb[m].w;
                decode8<true>(wA, SA[m][d >> 1], ra[bf][m]);
                decode8<true>(wB, SB[m][d >> 1], rb[bf][m]);
            }
            wg_fence();
#pragma unroll
            for (int m = 0; m < NMAT; m++) {
                wg_mma<N8>::run(acc[m], ra[bf][m][0], rb[bf][m][0], ra[bf][m][1], rb[bf][m][1],
                                wg_desc_of(dlo + (uint32_t)((2 * d) * STEP >> 4)));
                wg_mma<N8>::run(acc[m], ra[bf][m][2], rb[bf][m][2], ra[bf][m][3], rb[bf][m][3],
                                wg_desc_of(dlo + (uint32_t)((2 * d + 1) * STEP >> 4)));
            }
            /* a group per 32-wide K step, retired before the next step's
             * decode: one step of A fragments live, for the registers of
             * four gate/up and six down blocks per SM (v16); with NB = 2 the
             * step before it */
            wg_commit();
            if (d < 3) {
                if (NB == 2) wg_wait<1>();
                else wg_wait<0>();
            }
        }
        wg_wait<0>();
    }
    wg_wait<0>();
    cp_async_wait<0>();
#undef FM_WG_XCOPY
    if (GU && WGS == 1 && w.ksplit > 1) {
        /* gate/up split over K by a cluster of w.ksplit CTAs (v26): the
         * others' partial sums go into CTA 0's shared memory (its rings, idle
         * once every CTA is past its loop), CTA 0 adds them in rank order
         * (deterministic) and runs the epilogue */
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
        if (rank > 0) return;
        for (int r = 1; r < w.ksplit; r++)
#pragma unroll
            for (int m = 0; m < NMAT; m++)
#pragma unroll
                for (int i = 0; i < 4 * N8; i++) acc[m][i] += red[((r - 1) * NA + m * 4 * N8 + i) * 128 + tid];
    }
    if (!w.wv) return;
#pragma unroll
    for (int n = 0; n < N8; n++)
#pragma unroll
        for (int i = 0; i < 4; i++)
        {
            const int j = n * 8 + 2 * t + (i & 1);
            if (GU) {
                fm_emit<NMAT>(p, w.o, i < 2 ? w.rowA : w.rowB, w.pass0 + j, acc[0][n * 4 + i], acc[NMAT - 1][n * 4 + i]);
            } else {
                fm_emit_down(p, w.o, i < 2 ? w.rowA : w.rowB, w.pass0 + j, ep_tok[j], ep_w[j], acc[0][n * 4 + i]);
                if (D2 && w.wv2)
                    fm_emit_down(p, w.o, (i < 2 ? w.rowA : w.rowB) + 64, w.pass0 + j, ep_tok[j], ep_w[j],
                                 acc[NMAT - 1][n * 4 + i]);
            }
        }
    (void)g;
#else
    (void)p;
    (void)w;
    (void)smem;
#endif
}

/* Block = one warpgroup, 64 rows (D2: down, 128 rows as two "matrices" of
 * 64, see wg_pass_body); work items as in fm_expert_kernel (the launch sizes
 * the grid with passes of 8 * NMAX tokens). Needs sm_90a: elsewhere the
 * body is empty and the host never launches it (fm_cuda_wgmma_built). */
/* NMAX: most 8-token groups per pass (1, 2 or 4). One K step of MMAs in
 * flight and two segments copied ahead, for 4 gate/up and 6 down blocks per
 * SM where shared memory allows; with passes of 8 tokens (NMAX 1, v32:
 * config tile_n 8) 80 registers, so that the 128-row down and gate/up fit
 * 6 blocks per SM too (the grids of batches 2 - 8 in one wave instead of
 * ~1.4; H200: GLM-5 B = 1 -4 %, Qwen3-30B-A3B B = 8 -5 %, elsewhere level
 * or slower, so the tuner decides per bucket; docs/perf.md). */
/* WGS = 2 (v43): two warpgroups per block (rows_per_block 128 in the
 * config), the same registers per thread and warps per SM. */
/* NMAX 8 (the shared expert's 64-token passes, v46): two blocks per SM (its
 * shared memory allows no more), so the 64 accumulators per thread fit. */
static constexpr int fm_wg_min_blocks(int nmat, int nmax) { return nmax > 4 ? 2 : nmat == 2 && nmax > 1 ? 4 : 6; }
template <int NMAT, bool MX, int NMAX, bool D2, int WGS>
__global__ void __launch_bounds__(128 * WGS, fm_wg_min_blocks(NMAT, NMAX) / WGS)
    fm_expert_wg_kernel(fm_expert_params p, int W, int KS) {
#ifdef FM_HAVE_WGMMA
    extern __shared__ __align__(128) uint8_t wg_smem[];
    const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5, g = lane >> 2;
    (void)W;
    constexpr bool GU = NMAT == 2 && !D2;
    constexpr int RWG = D2 ? 128 : 64; /* rows of one warpgroup */
    constexpr int RPB = RWG * WGS;
    const int nrb = ((GU ? p.gate.rows_p : p.down.rows_p) + RPB - 1) / RPB;
    /* the shared expert's gate/up reads no routing result (p.sh_early) */
    const bool no_wait = GU && p.sh_early && (int)blockIdx.x / KS < p.sh_blocks;
    /* p.pre_wait: down's blocks and the shared expert's copy their first
     * segments' weights before the wait (below) */
    const bool pre = p.pre_wait && (!GU || (int)blockIdx.x / KS < p.sh_blocks);
    if (!pre) {
        if (!no_wait) pdl_wait();
        pdl_launch_dependents();
    }

    fm_item it;
    if (!fm_get_item(p, nrb, it, (int)blockIdx.x / KS)) return;
    const int e = it.e;
    const fm_dmat &dA = GU ? (it.shared ? p.sgate : p.gate) : (it.shared ? p.sdown : p.down);
    const fm_dmat &dB = GU ? (it.shared ? p.sup : p.up) : dA;
    fm_wg_pass w;
    w.o = {dA.bias, dB.bias, fm_nv_s2<MX>(dA.scale2[e]), GU ? fm_nv_s2<MX>(dB.scale2[e]) : 0.0f, dA.rows, dA.rows_p, e,
           it.pos0, it.cnt, it.shared};
    const int r0 = it.rb * RPB + (wi >> 2) * RWG + (wi & 3) * 16;
    w.rowA = r0 + g;
    w.rowB = r0 + g + 8;
    const int nseg = dA.kp / FM_KSEG;
    /* a K split (KS > 1): this block's share of the segments. Down (v25)
     * adds its partial sums into the output with the epilogue's atomics like
     * every other expert's; a slice without segments (K below KS segments)
     * has nothing to do, and the bias goes in once, by the first slice that
     * has segments (the one that starts at segment 0). Gate/up (v26): the KS
     * blocks are one cluster that adds the partial sums in CTA 0 before the
     * activation (wg_pass_body); every CTA takes part, segments or not. */
    const int ks = (int)blockIdx.x % KS;
    const int s0 = ks * nseg / KS, s1 = (ks + 1) * nseg / KS;
    w.nseg = s1 - s0;
    w.ksplit = GU ? KS : 1;
    if (!GU && w.nseg == 0) return;
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
    constexpr int LA = wg_la(GU);
    w.wring_off = (uint32_t)((LA + 1) * wg_stage_bytes(NMAX));
    w.pre = false;
    if (pre) {
        if (w.nseg > 0) {
            const uint32_t wr_s = (uint32_t)__cvta_generic_to_shared(wg_smem) + w.wring_off +
                                  wi * ((LA + 1) * wg_wstage_bytes(NMAT));
            const uint64_t wpol = l2_policy(p.l2first);
#pragma unroll
            for (int j = 0; j < LA; j++)
                if (j < w.nseg) wg_wcopy<NMAT, MX, LA + 1>(w, wr_s, lane, j, wpol);
            cp_async_commit();
            w.pre = true;
        }
        if (!GU && p.gu_done && !it.shared) {
            /* v42: wait for this expert's gate/up warps only (one per 16
             * rows of every 64-row gate/up block), not for the grid */
            const unsigned want = 4u * (unsigned)((p.gate.rows_p + 63) / 64);
            if (threadIdx.x == 0)
                while (ld_acquire_u32(p.gu_done + e) < want) __nanosleep(64);
            __syncthreads();
        } else if (!no_wait) {
            pdl_wait();
        }
        pdl_launch_dependents();
    }
    w.src_base = (GU ? p.x_prep : p.h) + (int64_t)s0 * FM_KSEG;
    w.src_stride = GU ? p.Hp : p.hstride;
    for (int pass0 = it.pbeg; pass0 < it.pend; pass0 += 8 * NMAX) {
        w.pass0 = pass0;
        const int n8 = (min(8 * NMAX, it.pend - pass0) + 7) >> 3;
        if (NMAX == 1 || n8 == 1) wg_pass_body<1, NMAT, MX, D2, WGS>(p, w, wg_smem);
        else if (n8 == 2 || NMAX == 2) wg_pass_body<2, NMAT, MX, D2, WGS>(p, w, wg_smem);
        else if (n8 == 3) wg_pass_body<NMAX == 2 ? 2 : 3, NMAT, MX, D2, WGS>(p, w, wg_smem);
        else if (n8 == 4 || NMAX == 4) wg_pass_body<NMAX == 2 ? 2 : 4, NMAT, MX, D2, WGS>(p, w, wg_smem);
        else wg_pass_body<NMAX == 8 ? 8 : 4, NMAT, MX, D2, WGS>(p, w, wg_smem);
        w.pre = false;
        __syncthreads(); /* the next pass restages the ring */
    }
    if (GU && p.gu_done && !it.shared && ks == 0 && it.rb * RPB + (wi >> 2) * RWG < dA.rows_p) {
        /* v42: this warp's h rows of expert e are written (KS > 1: CTA 0
         * of the cluster wrote the epilogue); counted by the warps of every
         * warpgroup that starts inside the rows (4 per 64 rows, as down
         * expects, whatever the block's warpgroups) */
        __threadfence();
        __syncwarp();
        if (lane == 0) atomicAdd(p.gu_done + e, 1u);
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

static int nt_index(int nt) { return nt == 1 ? 0 : nt == 2 ? 1 : 2; }

typedef void (*fm_kfn)(fm_expert_params, int, int);
#define FM_K4(NMAT, MX, ST, ENC)                                                                  \
    {fm_expert_kernel<1, NMAT, MX, ST, ENC>, fm_expert_kernel<2, NMAT, MX, ST, ENC>,             \
     fm_expert_kernel<4, NMAT, MX, ST, ENC>}
#define FM_K8(NMAT, MX, ENC) \
    {FM_K4(NMAT, MX, 0, ENC), FM_K4(NMAT, MX, FM_CP_STAGES, ENC), FM_K4(NMAT, MX, FM_ST_REGS_XG, ENC)}
/* pipe: FM_PIPE_* (the kernel's ST: 0, FM_CP_STAGES, FM_ST_REGS_XG) */
static fm_kfn pick(int nmat, int nt, int mx, int pipe, int enc) {
    static const fm_kfn k[2][2][2][3][3] = {
        {{FM_K8(1, false, false), FM_K8(1, true, false)}, {FM_K8(2, false, false), FM_K8(2, true, false)}},
        {{FM_K8(1, false, true), FM_K8(1, true, true)}, {FM_K8(2, false, true), FM_K8(2, true, true)}}};
    return k[enc ? 1 : 0][nmat == 2][mx ? 1 : 0][pipe][nt_index(nt)];
}
static size_t ring_bytes(int nmat, int nt) {
    return (size_t)FM_CP_STAGES * (nmat * 1024 + nmat * 128 + nt * 2048);
}

/* Which register-pipeline launches read the activations per K step
 * (FM_PIPE_REGS_XG): gate/up with 16-token tiles, where it brings the
 * kernel from 180 to 128 registers (8 -> 16 warps per SM; H200, B = 512:
 * -9 % per layer). Elsewhere it measured level or 1-5 % slower (docs/perf.md,
 * v10). FP4MOE_CUDA_XG overrides for comparisons: 0 never, 1 down, 2 gate/up,
 * 3 both, at every tile size. */
static int xg_env(void) {
    static int v = -2;
    if (v == -2) {
        const char *env = getenv("FP4MOE_CUDA_XG");
        v = env && *env ? atoi(env) & 3 : -1;
    }
    return v;
}
static int use_xg(int nmat, int nt) {
    int v = xg_env();
    if (v >= 0) return (v & (nmat == 2 ? 2 : 1)) != 0;
    return nmat == 2 && nt == 2;
}

/* The wgmma kernels: FP4MOE_CUDA_WG = 1 down, 2 gate/up, 3 both (an
 * experiment switch while the path is measured; sm_90 with the v6 word
 * order only, see wg_applies); FP4MOE_CUDA_WG_TOKENS = 8 or 16 makes a pass
 * 8 or 16 tokens instead of 32. Read once. */
/* 8-token groups per pass (the wgmma kernels' NMAX) of a pass width read
 * from an FP4MOE_CUDA_* switch (8, 16 or 32 tokens; dflt when unset). */
static int wg_nmax_env(const char *name, int dflt) {
    const char *env = getenv(name);
    const int t = env && *env ? atoi(env) : 0;
    return t == 8 ? 1 : t == 16 ? 2 : t == 32 ? 4 : dflt;
}
static int wg_env(int *nmax) {
    static int v = -1, nm = 4;
    if (v < 0) {
        const char *env = getenv("FP4MOE_CUDA_WG");
        v = env && *env ? atoi(env) & 3 : 0;
        nm = wg_nmax_env("FP4MOE_CUDA_WG_TOKENS", 4);
    }
    if (nmax) *nmax = nm;
    return v;
}
/* wgmma: the engine's answer (CC 9.0 and a build with sm_90a code). */
static int wg_applies(int nmat, int enc, int wgmma) { return (wg_env(NULL) & (nmat == 2 ? 2 : 1)) && enc && wgmma; }

/* kind: 0 down (64 rows), 1 gate/up, 2 down in 128-row blocks (D2); wgs 2
 * (two warpgroups per block, v43) is built for gate/up and D2 with passes of
 * 16 or 32 tokens (the config file accepts nothing else); NULL otherwise. */
#define FM_WG3(NMAT, MX, D2) \
    {fm_expert_wg_kernel<NMAT, MX, 1, D2, 1>, fm_expert_wg_kernel<NMAT, MX, 2, D2, 1>, \
     fm_expert_wg_kernel<NMAT, MX, 4, D2, 1>}
#define FM_WG3X2(NMAT, MX, D2) {NULL, fm_expert_wg_kernel<NMAT, MX, 2, D2, 2>, fm_expert_wg_kernel<NMAT, MX, 4, D2, 2>}
/* nmax 8 (64-token passes, v46) is built for gate/up and D2 with one
 * warpgroup, for the shared expert's own launches. */
static fm_kfn pick_wg(int kind, int mx, int nmax, int wgs) {
    static const fm_kfn k[3][2][3] = {{FM_WG3(1, false, false), FM_WG3(1, true, false)},
                                      {FM_WG3(2, false, false), FM_WG3(2, true, false)},
                                      {FM_WG3(2, false, true), FM_WG3(2, true, true)}};
    static const fm_kfn k2[3][2][3] = {{{NULL, NULL, NULL}, {NULL, NULL, NULL}},
                                       {FM_WG3X2(2, false, false), FM_WG3X2(2, true, false)},
                                       {FM_WG3X2(2, false, true), FM_WG3X2(2, true, true)}};
    static const fm_kfn k8[3][2] = {{NULL, NULL},
                                    {fm_expert_wg_kernel<2, false, 8, false, 1>, fm_expert_wg_kernel<2, true, 8, false, 1>},
                                    {fm_expert_wg_kernel<2, false, 8, true, 1>, fm_expert_wg_kernel<2, true, 8, true, 1>}};
    if (nmax == 8) return wgs == 1 ? k8[kind][mx ? 1 : 0] : NULL;
    return (wgs == 2 ? k2 : k)[kind][mx ? 1 : 0][nmax > 2 ? 2 : nmax - 1];
}
#undef FM_WG3
#undef FM_WG3X2

/* The wgmma down in 128-row blocks (D2: down's segments then carry gate/up's
 * bytes per barrier and per copy group; H200, DeepSeek-V4-Flash: down −12 to
 * −14 % under Nsight Compute, the layer −3 to −5 % at B = 4 – 512,
 * docs/perf.md, v22). FP4MOE_CUDA_WG_DOWN2=0 keeps 64-row blocks (A/B).
 * Read once. */
static int wg_down2(void) {
    static const int v = !fm_cuda_env_is("FP4MOE_CUDA_WG_DOWN2", "0");
    return v;
}

/* The wgmma kernels' K split: each (row block, pass) item becomes KS
 * blocks over a share of K each (down, v25: adding into the output like the
 * others; gate/up, v26: a cluster of KS CTAs that adds the partial sums in
 * CTA 0 before the activation). KS = 2 where the launch's grid is under 5
 * blocks per SM (about one wave of 4 resident blocks and a short tail) and
 * each half keeps at least 8 segments of K (down) or 10 (gate/up, which
 * also pays the cluster's reduction): the blocks then fill the SMs more
 * evenly (H200, full layer: DeepSeek-V4-Flash B = 2 / 3 -6 % / -4 %,
 * gpt-oss-120b B = 3 / 4 -3 % / -5 %; forced elsewhere: DeepSeek-V4-Flash
 * B = 4 - 8 +2 to +4 %, Qwen3-30B-A3B B = 3 / 4 with its gate/up's 16
 * segments split +3 % / +9 %; docs/perf.md). FP4MOE_CUDA_WG_DOWN_KS /
 * FP4MOE_CUDA_WG_GU_KS = 1|2|4 force it (A/B). Read once; blocks is the
 * grid without the split, nseg the segments of K. */
static int wg_ks(int gu, int64_t blocks, int sms, int nseg) {
    static int v[2] = {-1, -1};
    if (v[gu] < 0) {
        const char *env = getenv(gu ? "FP4MOE_CUDA_WG_GU_KS" : "FP4MOE_CUDA_WG_DOWN_KS");
        v[gu] = env && *env ? atoi(env) : 0;
        if (v[gu] != 1 && v[gu] != 2 && v[gu] != 4) v[gu] = 0;
    }
    if (v[gu]) return v[gu];
    return nseg >= (gu ? 20 : 16) && blocks > 0 && blocks < 5L * (sms > 0 ? sms : 132) ? 2 : 1;
}

/* The work items of one expert launch: max_active x row blocks, and the
 * shared expert's (row block, chunk) items (*sh_blocks of them, *sh_chunks
 * chunks per row block). */
static int64_t grid_items(const fm_expert_params *p, int nmat, int rpb, int chunk, int64_t *sh_blocks,
                          int *sh_chunks) {
    const fm_dmat *m = nmat == 2 ? &p->gate : &p->down;
    const fm_dmat *sm = nmat == 2 ? &p->sgate : &p->sdown;
    const int nrb = (m->rows_p + rpb - 1) / rpb;
    const int nrb_s = sm->n ? (sm->rows_p + rpb - 1) / rpb : 0;
    *sh_chunks = nrb_s > 0 ? (p->T + chunk - 1) / chunk : 0;
    *sh_blocks = (int64_t)nrb_s * *sh_chunks;
    return (int64_t)p->max_active * nrb + *sh_blocks;
}

/* One expert launch (both kernel families): the shared expert's (row block,
 * token chunk) items first, then max_active x row blocks; rpb rows per
 * block, chunks of `chunk` tokens (one kernel pass: a chunk costs the same
 * decode work as a pass of one long loop, but the chunks run in parallel
 * and re-read the weights from L2); bdup blocks per item (a K split), in
 * clusters of `cluster` blocks. */
static fm_status launch_grid(const fm_expert_params *p, int nmat, fm_kfn fn, int rpb, int chunk, int threads,
                             size_t smem, int pdl, int W, int KS, int bdup, int cluster, cudaStream_t s,
                             const char *what) {
    fm_expert_params q = *p;
    int64_t sh_blocks;
    q.sh_chunk = chunk;
    const int64_t blocks = grid_items(p, nmat, rpb, chunk, &sh_blocks, &q.sh_chunks) * bdup;
    if (blocks <= 0) return FM_OK;
    if (blocks > 0x7fffffff) return fm_error(FM_E_RANGE, "CUDA grid of %lld blocks is too large", (long long)blocks);
    q.sh_blocks = (int)sh_blocks;
    /* The shared expert's launches on its own stream ask for
     * FM_CUDA_SHARED_SMEM_MARK bytes of dynamic shared memory more than they
     * use: CUPTI reports each launch's dynamic shared memory, and a profile
     * (src/prof/kernels.c) tells them by it from the routed experts' launches
     * of the same kernel. (Kernels of their own under another name, v66,
     * cost 3 % at B = 1: two copies of the code in the instruction caches.)
     * The function's limit is raised for the mark on every launch, so that no
     * later launch lowers it below a captured one's. */
    if (smem % 16)
        return fm_error(FM_E_RANGE, "%s: %zu bytes of shared memory, not a multiple of 16", what, smem);
    const size_t limit =
        smem + FM_CUDA_SHARED_SMEM_MARK <= (size_t)p->smem_optin ? smem + FM_CUDA_SHARED_SMEM_MARK : smem;
    const size_t dsm = p->max_active == 0 && p->sgate.n > 0 ? limit : smem;
    if (limit > 48 * 1024) {
        cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)limit);
        if (err != cudaSuccess) {
            cudaGetLastError();
            return fm_error(FM_E_CUDA, "cudaFuncSetAttribute(%zu bytes of shared memory, %s): %s", limit, what,
                            cudaGetErrorString(err));
        }
    }
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[2];
    cfg.gridDim = dim3((unsigned)blocks);
    cfg.blockDim = dim3((unsigned)threads);
    cfg.dynamicSmemBytes = dsm;
    cfg.stream = s;
    unsigned na = 0;
    if (pdl) {
        attr[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[na].val.programmaticStreamSerializationAllowed = 1;
        na++;
    }
    if (cluster > 1) {
        attr[na].id = cudaLaunchAttributeClusterDimension;
        attr[na].val.clusterDim.x = (unsigned)cluster;
        attr[na].val.clusterDim.y = 1;
        attr[na].val.clusterDim.z = 1;
        na++;
    }
    cfg.attrs = attr;
    cfg.numAttrs = na;
    FM_CU(cudaLaunchKernelEx(&cfg, fn, q, W, KS));
    FM_CU_LAUNCH(what);
    return FM_OK;
}

/* wgs: warpgroups per block (1, or 2 from the config's 128 rows per block,
 * v43; the 64-row down of FP4MOE_CUDA_WG_DOWN2=0 and passes of 8 tokens have
 * one). Two warpgroups never split K. */
static fm_status launch_wg(const fm_expert_params *p, int nmat, int pdl, int nmax, int wgs, cudaStream_t s) {
    const int d2 = nmat == 1 && wg_down2();
    const int kind = nmat == 2 ? 1 : d2 ? 2 : 0;
    if (kind == 0 || nmax < 2) wgs = 1;
    if (nmax == 8 && (kind == 0 || wgs != 1)) nmax = 4; /* built for gate/up and D2 with one warpgroup */
    const int rpb = (d2 ? 128 : 64) * wgs, chunk = 8 * nmax;
    const size_t smem = (size_t)wg_smem_bytes(kind ? 2 : 1, nmax, nmat == 1, wgs);
    int64_t sh_blocks;
    int sh_chunks;
    int ks = wgs > 1         ? 1
             : p->ks_force > 0 ? p->ks_force
                               : wg_ks(nmat == 2, grid_items(p, nmat, rpb, chunk, &sh_blocks, &sh_chunks), p->sms,
                             (int)((nmat == 2 ? p->gate.kp : p->down.kp) / FM_KSEG));
    /* gate/up's cluster reduction reuses CTA 0's rings for the others' sums */
    while (nmat == 2 && ks > 1 && (size_t)(ks - 1) * 2 * 4 * nmax * 128 * sizeof(float) > smem) ks /= 2;
    return launch_grid(p, nmat, pick_wg(kind, p->mx, nmax, wgs), rpb, chunk, 128 * wgs, smem, pdl, 4 * wgs, ks, ks,
                       nmat == 2 ? ks : 1, s,
                       nmat == 2 ? "fm_expert_wg_kernel (gate/up)" : "fm_expert_wg_kernel (down)");
}

/* FP4MOE_CUDA_WG_DOWN_TOKENS = 8 | 16 | 32: the wgmma down's passes at that
 * width whatever the config's (an A/B switch, v36). Read once; 0: unset. */
static int wg_down_nmax(void) {
    static const int v = wg_nmax_env("FP4MOE_CUDA_WG_DOWN_TOKENS", 0);
    return v;
}

/* Which launches of a two-warpgroup config (warps 8) run two warpgroups per
 * block: FP4MOE_CUDA_WG_GROUPS=gu gate/up only, =dn down only (v48, for
 * comparisons); otherwise both. Read once. */
static int wg_groups_in(int nmat) {
    static const int gu = fm_cuda_env_is("FP4MOE_CUDA_WG_GROUPS", "gu"), dn = fm_cuda_env_is("FP4MOE_CUDA_WG_GROUPS", "dn");
    return nmat == 2 ? !dn : !gu;
}

static fm_status launch(const fm_expert_params *p, const fm_launch_cfg *c, int nmat, cudaStream_t s) {
    if (c->pipe == FM_PIPE_WGMMA)
        return launch_wg(p, nmat, c->pdl,
                         nmat == 1 && wg_down_nmax() ? wg_down_nmax() : c->nt > 4 ? 8 : c->nt > 2 ? 4 : c->nt,
                         c->warps == 8 && wg_groups_in(nmat) ? 2 : 1, s);
    if (wg_applies(nmat, (nmat == 2 ? &p->gate : &p->down)->enc, c->wgmma)) {
        int nmax = 4;
        wg_env(&nmax);
        return launch_wg(p, nmat, c->pdl, nmax, 1, s);
    }
    if ((c->nt != 1 && c->nt != 2 && c->nt != 4) || c->warps < 1 || c->warps > 8 || c->ksplit < 1 ||
        c->warps % c->ksplit)
        return fm_error(FM_E_ARG, "invalid CUDA kernel config: tile_n %d, warps %d, k_split %d", c->nt * 8, c->warps,
                        c->ksplit);
    size_t smem = c->ksplit > 1 ? (size_t)c->warps * nmat * c->nt * 4 * 32 * sizeof(float) : 0;
    if (c->pipe == FM_PIPE_CP_ASYNC) smem += (size_t)c->warps * ring_bytes(nmat, c->nt);
    if (smem > 48 * 1024 && smem > (size_t)p->smem_optin)
        return fm_error(FM_E_ARG,
                        "kernel config (warps %d, k_split %d, tile_n %d, cp.async) needs %zu bytes of shared "
                        "memory per block; this GPU allows %d",
                        c->warps, c->ksplit, c->nt * 8, smem, p->smem_optin);
    int pipe = c->pipe;
    if (pipe == FM_PIPE_REGS2 && use_xg(nmat, c->nt)) pipe = FM_PIPE_REGS_XG;
    const fm_dmat *m = nmat == 2 ? &p->gate : &p->down;
    return launch_grid(p, nmat, pick(nmat, c->nt, p->mx, pipe, m->enc), 16 * (c->warps / c->ksplit), 8 * c->nt,
                       32 * c->warps, smem, c->pdl, c->warps, c->ksplit, 1, 1, s,
                       nmat == 2 ? "fm_expert_kernel (gate/up)" : "fm_expert_kernel (down)");
}

extern "C" fm_status fm_cuda_launch_gateup(const fm_expert_params *p, const fm_launch_cfg *c, cudaStream_t s) {
    return launch(p, c, 2, s);
}
/* FP4MOE_CUDA_DOWN=WARPSxKSPLIT gives the down launch another block shape,
 * "nosplit" the config's rows per block without a K split (experiments; the
 * config's shape applies to both launches). Read once. Returns 1 and the
 * shape in *d when it applies to c. */
static int down_override(const fm_launch_cfg *c, fm_launch_cfg *d) {
    static int mode = -1, ew = 0, eks = 0; /* 0 none, 1 WxK, 2 nosplit */
    if (mode < 0) {
        const char *env = getenv("FP4MOE_CUDA_DOWN");
        mode = 0;
        if (env && !strcmp(env, "nosplit")) mode = 2;
        else if (env && sscanf(env, "%dx%d", &ew, &eks) == 2) mode = 1;
    }
    int w = mode == 2 ? c->warps / c->ksplit : ew, ks = mode == 2 ? 1 : eks;
    if (mode == 0 || w < 1 || w > 8 || ks < 1 || w % ks) return 0;
    *d = *c;
    d->warps = w;
    d->ksplit = ks;
    return 1;
}

extern "C" fm_status fm_cuda_launch_down(const fm_expert_params *p, const fm_launch_cfg *c, cudaStream_t s) {
    fm_launch_cfg d;
    return launch(p, down_override(c, &d) ? &d : c, 1, s);
}

static const char *pipe_name(int pipe) {
    return pipe == FM_PIPE_CP_ASYNC ? "cp.async x3" : pipe == FM_PIPE_REGS_XG ? "regs x2, x per K step" : "regs x2";
}
extern "C" const char *fm_cuda_kernel_names(const fm_launch_cfg *c, int mx, char *buf, size_t cap) {
    if (c->pipe == FM_PIPE_WGMMA) {
        if (c->warps == 8 && c->nt > 1)
            snprintf(buf, cap,
                     "fm_expert_wg_kernel<%s> gate_up+down (wgmma.m64nNk16 bf16, A in registers, B in shared memory; "
                     "two warpgroups per block sharing one activation stage: %d-row gate/up and %d-row down blocks, "
                     "%s; up to %d tokens per pass)",
                     mx ? "mxfp4" : "nvfp4", wg_groups_in(2) ? 128 : 64,
                     (wg_down2() ? 128 : 64) * (wg_groups_in(1) && wg_down2() ? 2 : 1),
                     wg_groups_in(1) && wg_groups_in(2) ? "no K split" : "K split in 2 for the one-warpgroup launch "
                                                                         "where its grid is under 5 blocks per SM",
                     c->nt > 2 ? 32 : 8 * c->nt);
        else
            snprintf(buf, cap,
                     "fm_expert_wg_kernel<%s> gate_up+down (wgmma.m64nNk16 bf16, A in registers, B in shared memory; "
                     "64-row gate/up and %d-row down blocks, K split in 2 where a grid is under 5 blocks per SM; "
                     "up to %d tokens per pass)",
                     mx ? "mxfp4" : "nvfp4", wg_down2() ? 128 : 64, c->nt > 2 ? 32 : 8 * c->nt);
        if (wg_down_nmax()) {
            size_t n = strlen(buf);
            snprintf(buf + n, cap > n ? cap - n : 0, "; down %d tokens per pass (FP4MOE_CUDA_WG_DOWN_TOKENS)",
                     8 * wg_down_nmax());
        }
        return buf;
    }
    int gu = c->pipe, dn = c->pipe;
    if (c->pipe == FM_PIPE_REGS2) {
        if (use_xg(2, c->nt)) gu = FM_PIPE_REGS_XG;
        if (use_xg(1, c->nt)) dn = FM_PIPE_REGS_XG;
    }
    if (gu == dn)
        snprintf(buf, cap, "fm_expert_kernel<nt%d,%s,%s> gate_up+down (mma.m16n8k16 bf16, %d warps, k_split %d)",
                 c->nt, mx ? "mxfp4" : "nvfp4", pipe_name(gu), c->warps, c->ksplit);
    else
        snprintf(buf, cap,
                 "fm_expert_kernel<nt%d,%s> gate_up (%s) + down (%s) (mma.m16n8k16 bf16, %d warps, k_split %d)", c->nt,
                 mx ? "mxfp4" : "nvfp4", pipe_name(gu), pipe_name(dn), c->warps, c->ksplit);
    if (wg_env(NULL) && c->wgmma) {
        int nmax = 4, v = wg_env(&nmax);
        size_t n = strlen(buf);
        snprintf(buf + n, cap > n ? cap - n : 0, "; %s%s%s: fm_expert_wg_kernel (wgmma.m64nNk16 bf16, 64 rows, 8-%d "
                 "tokens per pass; FP4MOE_CUDA_WG, v6 word order only)",
                 v & 2 ? "gate_up" : "", v == 3 ? "+" : "", v & 1 ? "down" : "", 8 * nmax);
    }
    fm_launch_cfg d;
    if (down_override(c, &d)) {
        size_t n = strlen(buf);
        snprintf(buf + n, cap > n ? cap - n : 0, "; down %d warps, k_split %d (FP4MOE_CUDA_DOWN)", d.warps, d.ksplit);
    }
    return buf;
}

__global__ void fm_wg_probe_kernel(int *out) {
#ifdef FM_HAVE_WGMMA
    *out = 1;
#else
    *out = 0;
#endif
}
/* Cached after the first call (made when an engine is created, outside any
 * capture): one build, one kind of device per process. */
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

/* ------------------------------------------------ bandwidth measurement */

/* The probe's kernels (stream_read.cuh, shared with dev/tools/cuda_bwprobe):
 * the grid-stride loads without an L2 fetch-size hint (the hint measured
 * 5 - 8 % slower on an H200) and, on sm_90, TMA bulk copies through a ring
 * of four 32 KB stages, which read 0.7 - 1.0 % faster there; the probe takes
 * the faster of the two. */
#define FM_BULK_NS 4

__global__ void fm_fill_hash_kernel(uint32_t *p, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = (uint32_t)(i * 2654435761u) ^ 0x5bd1e995u;
}

/* What both reads of the probe's buffer start with: the device's SM count,
 * buf (the caller's scratch) filled with a hash of the word index, and n_acc
 * words for the reads' XORs. */
static fm_status stream_prep(const void *buf, size_t bytes, cudaStream_t s, int n_acc, int *sms, unsigned **acc) {
    int dev;
    FM_CU(cudaGetDevice(&dev));
    FM_CU(cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev));
    fm_fill_hash_kernel<<<*sms * 4, 256, 0, s>>>((uint32_t *)buf, bytes / 4);
    FM_CU_LAUNCH("fm_fill_hash_kernel");
    FM_CU(cudaMalloc(acc, n_acc * sizeof(unsigned)));
    return FM_OK;
}

/* Fills buf with a hash of the word index, then the best seconds of reps
 * timed reads of it (after one untimed) by the grid-stride loads and, where
 * the build has the sm_90a code, by the TMA bulk copies; a bulk read counts
 * only if its XOR of the bytes equals the loads'. */
extern "C" fm_status fm_cuda_stream_read(const void *buf, size_t bytes, cudaStream_t s, int reps, double *best_s) {
    const int bulk = fm_cuda_wgmma_built() && bytes % FM_BULK_CH == 0;
    if (bulk)
        FM_CU(cudaFuncSetAttribute(fm_bulk_read_kernel<FM_BULK_NS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   FM_BULK_NS * FM_BULK_CH));
    int sms;
    unsigned *acc;
    fm_status ps = stream_prep(buf, bytes, s, 2, &sms, &acc);
    if (ps != FM_OK) return ps;
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    double best[2] = {1e30, 1e30};
    unsigned x[2] = {0, 0};
    fm_status st = FM_OK;
    for (int kind = 0; kind < 1 + bulk && st == FM_OK; kind++) {
        for (int r = 0; r < reps + 1 && st == FM_OK; r++) {
            cudaError_t err = cudaMemsetAsync(acc + kind, 0, sizeof(unsigned), s);
            cudaEventRecord(a, s);
            if (kind == 0) fm_gs_read_kernel<4, false><<<sms * 8, 512, 0, s>>>((const uint4 *)buf, bytes / 16, acc);
            else
                fm_bulk_read_kernel<FM_BULK_NS>
                    <<<sms, 256, FM_BULK_NS * FM_BULK_CH, s>>>((const uint8_t *)buf, bytes, acc + 1);
            cudaEventRecord(b, s);
            if (err == cudaSuccess) err = cudaGetLastError();
            if (err == cudaSuccess) err = cudaEventSynchronize(b);
            if (err != cudaSuccess) {
                st = fm_error(FM_E_CUDA, "bandwidth kernel failed: %s", cudaGetErrorString(err));
                break;
            }
            float ms = 0;
            cudaEventElapsedTime(&ms, a, b);
            if (r > 0 && ms * 1e-3 < best[kind]) best[kind] = ms * 1e-3;
        }
    }
    if (st == FM_OK && cudaMemcpy(x, acc, sizeof x, cudaMemcpyDeviceToHost) != cudaSuccess)
        st = fm_error(FM_E_CUDA, "bandwidth check: %s", cudaGetErrorString(cudaGetLastError()));
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    cudaFree(acc);
    /* an empty bulk kernel (no sm_90 code) leaves 0; should the buffer's
     * XOR itself be 0, the bulk read is simply not counted */
    *best_s = bulk && x[1] == x[0] && x[0] != 0 && best[1] < best[0] ? best[1] : best[0];
    return st;
}

/* The probe's grid-stride read of buf kept up for `seconds` of host time:
 * batches of reads back to back (one event wait per batch, so the device
 * never idles between reads of a batch), the mean rate over all of them.
 * What the device draws while it only reads memory (`profile`'s power
 * baseline). */
extern "C" fm_status fm_cuda_stream_read_for(const void *buf, size_t bytes, cudaStream_t s, double seconds,
                                             double *rate_Bps) {
    *rate_Bps = 0;
    int sms;
    unsigned *acc;
    fm_status ps = stream_prep(buf, bytes, s, 1, &sms, &acc);
    if (ps != FM_OK) return ps;
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    fm_status st = FM_OK;
    double gpu_s = 0, n_reads = 0;
    const uint64_t t0 = fm_now_ns();
    /* about 20 ms of reads per batch at an H200's 4.5 TB/s */
    const double want = 9e10 / (double)bytes;
    const int per = want < 1 ? 1 : want > 256 ? 256 : (int)want;
    while (st == FM_OK && (double)(fm_now_ns() - t0) * 1e-9 < seconds) {
        cudaEventRecord(a, s);
        for (int r = 0; r < per; r++)
            fm_gs_read_kernel<4, false><<<sms * 8, 512, 0, s>>>((const uint4 *)buf, bytes / 16, acc);
        cudaEventRecord(b, s);
        cudaError_t err = cudaGetLastError();
        if (err == cudaSuccess) err = cudaEventSynchronize(b);
        if (err != cudaSuccess) {
            st = fm_error(FM_E_CUDA, "sustained read failed: %s", cudaGetErrorString(err));
            break;
        }
        float ms = 0;
        cudaEventElapsedTime(&ms, a, b);
        gpu_s += ms * 1e-3;
        n_reads += per;
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    cudaFree(acc);
    if (st == FM_OK && gpu_s > 0) *rate_Bps = n_reads * (double)bytes / gpu_s;
    return st;
}
