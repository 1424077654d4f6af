/*
 * AVX2 + FMA kernels (this file alone is compiled with -mavx2 -mfma -mf16c;
 * the engine calls it only when the processor has them).
 *
 * Decode is the bottleneck at small batch (each weight is used by one or
 * two tokens), so it is built from the cheapest operations available:
 *   - 32 packed bytes (64 weights) are split into low and high nibbles;
 *   - two byte shuffles per nibble vector look up the high and low bytes of
 *     each code's exact BF16 value (E2M1 values are exact in BF16);
 *   - byte unpacks pair them into 16-bit BF16 words, and a shift / a mask
 *     turn each pair of words of a 32-bit lane into two floats.
 * No int->float conversion and no widening shuffles: 10 shuffles and 11
 * other operations per 64 weights. The weights come out in a fixed order
 * inside each 64-element chunk; the activations are permuted once per call
 * into that order ("chunk-64" layout, fm_cpu_kern_avx2.pos), the last
 * cols % 64 elements stay in natural order and are done in scalar code.
 *
 * Block scales are not applied per weight: the products of one chunk are
 * summed per scale group (a vector lane only ever holds elements of one
 * block) and the sum is multiplied by the lanes' scales once, which saves a
 * multiply per 8 weights and per token.
 *
 * Each (row, token) pair owns one accumulator and follows one fixed
 * sequence of operations whatever the number of tokens processed together
 * (groups of up to four per decode of a row; more tokens decode the row
 * again from L1, which measured faster than decoding once into a buffer
 * and reading it back), so a token's result does not depend on the rest
 * of the batch. Down at one or two tokens runs two rows per loop (the same
 * sequence per row, half the loop restarts); the activation runs on eight
 * rows at a time.
 *
 * On Zen 3 the loop is bound by the FP pipes: per 64 weights and token 10
 * FMA/mul (FP0/FP1) next to 13 shuffles/shifts and 2 inserts (FP1/FP2);
 * docs/perf.md (CPU) has the measurements and the variants that
 * moved work between those pipes without removing it.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "cpu/kern.h"
#include "cpu/kern_avx_act.h"

/* ---- layout */
/* Element order inside a 64-element chunk, as decode_half produces it:
 * FP4: half hf of the chunk gives F0 F1 (from unpack W_hf of the low
 * nibbles) and F2 F3 (W_{2+hf}, high nibbles), stored at x[16 hf ..] and
 * x[32 + 16 hf ..]; BF16: loads hf and 2 + hf of 16 values each. */

static int64_t pos_avx2(fm_qformat f, int64_t cols, int64_t c) {
    const int64_t base = c & ~(int64_t)63;
    if (base + 64 > cols) return c; /* tail: natural order */
    const int e = (int)(c & 63);
    int v, lane;
    if (f == FM_QF_BF16) { /* 16 BF16 per 32-byte load q; lane d holds elements 2d, 2d+1 */
        int q = e >> 4, d = (e & 15) >> 1, part = e & 1;
        v = 2 * q + part;
        lane = d;
    } else {
        int odd = e & 1, j = e >> 1;              /* packed byte 0..31      */
        int half = j >> 4, jj = j & 15;           /* 128-bit lane, byte      */
        int w = (odd << 1) | (jj >> 3);           /* which unpack: W0..W3    */
        int k = jj & 7, d = k >> 1, part = k & 1; /* 32-bit lane, word       */
        v = 2 * w + part;
        lane = half * 4 + d;
    }
    return base + 8 * v + lane;
}

/* ---- decode of one 64-weight chunk, in two halves of 32 weights
 * (half 0: F0 F1 F4 F5, blocks 0|2 of NVFP4; half 1: F2 F3 F6 F7, blocks
 * 1|3), so that few registers are live at a time. */

typedef struct {
    __m256 F[4];
    __m256 S; /* the lanes' block scales (NVFP4, MXFP4) */
} half;

INL __m256 two_scales(const float *lut, uint8_t a, uint8_t b) {
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(&lut[a])), _mm_broadcast_ss(&lut[b]), 1);
}

/* Nibble codes of the chunk looked up as BF16 high / low bytes. */
typedef struct {
    __m256i hl, ll, hh, lh;
} nib;

INL void decode_nib(const uint8_t *p, int64_t ch, nib *o) {
    const __m256i m = _mm256_set1_epi8(0x0F);
    /* high / low byte of the BF16 encoding of each E2M1 code */
    const __m256i th = _mm256_setr_epi8(0, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, (char)0x80, (char)0xBF, (char)0xBF,
                                        (char)0xBF, (char)0xC0, (char)0xC0, (char)0xC0, (char)0xC0, 0, 0x3F, 0x3F, 0x3F,
                                        0x40, 0x40, 0x40, 0x40, (char)0x80, (char)0xBF, (char)0xBF, (char)0xBF, (char)0xC0,
                                        (char)0xC0, (char)0xC0, (char)0xC0);
    const __m256i tl = _mm256_setr_epi8(0, 0, (char)0x80, (char)0xC0, 0, 0x40, (char)0x80, (char)0xC0, 0, 0, (char)0x80,
                                        (char)0xC0, 0, 0x40, (char)0x80, (char)0xC0, 0, 0, (char)0x80, (char)0xC0, 0, 0x40,
                                        (char)0x80, (char)0xC0, 0, 0, (char)0x80, (char)0xC0, 0, 0x40, (char)0x80,
                                        (char)0xC0);
    __m256i v = _mm256_loadu_si256((const __m256i *)(p + 32 * ch));
    __m256i lo = _mm256_and_si256(v, m), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
    o->hl = _mm256_shuffle_epi8(th, lo);
    o->ll = _mm256_shuffle_epi8(tl, lo);
    o->hh = _mm256_shuffle_epi8(th, hi);
    o->lh = _mm256_shuffle_epi8(tl, hi);
}

INL void split_words(__m256i w, __m256 *a, __m256 *b) {
    *a = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    *b = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xFFFF0000u)));
}

INL void decode_half(const int FMT, const uint8_t *p, const uint8_t *s, const float *lut, int64_t ch, const nib *n,
                     int hf, half *o) {
    if (FMT == FM_QF_BF16) {
        /* half 0: loads 0 and 2 (F0 F1 F4 F5), half 1: loads 1 and 3 */
        __m256i w0 = _mm256_loadu_si256((const __m256i *)(p + 128 * ch + 32 * hf));
        __m256i w1 = _mm256_loadu_si256((const __m256i *)(p + 128 * ch + 64 + 32 * hf));
        split_words(w0, &o->F[0], &o->F[1]);
        split_words(w1, &o->F[2], &o->F[3]);
        return;
    }
    __m256i wa = hf ? _mm256_unpackhi_epi8(n->ll, n->hl) : _mm256_unpacklo_epi8(n->ll, n->hl);
    __m256i wb = hf ? _mm256_unpackhi_epi8(n->lh, n->hh) : _mm256_unpacklo_epi8(n->lh, n->hh);
    split_words(wa, &o->F[0], &o->F[1]);
    split_words(wb, &o->F[2], &o->F[3]);
    if (FMT == FM_QF_NVFP4) {
        const uint8_t *b = s + 4 * ch;
        o->S = two_scales(lut, b[hf], b[2 + hf]);
    } else {
        const uint8_t *b = s + 2 * ch;
        o->S = two_scales(lut, b[0], b[1]);
    }
}

/* acc += half . x, x: the chunk's 64 activations in layout order. */
INL __m256 half_dot(const int FMT, const half *h, const float *x, int hf, __m256 acc) {
    const float *xa = x + 16 * hf, *xb = x + 32 + 16 * hf;
    if (FMT == FM_QF_BF16) {
        acc = _mm256_fmadd_ps(h->F[0], _mm256_loadu_ps(xa), acc);
        acc = _mm256_fmadd_ps(h->F[1], _mm256_loadu_ps(xa + 8), acc);
        acc = _mm256_fmadd_ps(h->F[2], _mm256_loadu_ps(xb), acc);
        return _mm256_fmadd_ps(h->F[3], _mm256_loadu_ps(xb + 8), acc);
    }
    __m256 t = _mm256_mul_ps(h->F[0], _mm256_loadu_ps(xa));
    t = _mm256_fmadd_ps(h->F[1], _mm256_loadu_ps(xa + 8), t);
    t = _mm256_fmadd_ps(h->F[2], _mm256_loadu_ps(xb), t);
    t = _mm256_fmadd_ps(h->F[3], _mm256_loadu_ps(xb + 8), t);
    return _mm256_fmadd_ps(t, h->S, acc);
}

/* ---- the row loops (kern_rows.h) on 64-element chunks */
#define KR_CH_LOG2 6
#define KR_POS pos_avx2
#include "cpu/kern_rows.h"

/* dot[i][j] = row r + i of a . x_j (without the per-tensor factor), for
 * R = 1 or 2 rows in one loop. Each (row, token) follows the same operations
 * whatever R (so results do not depend on which path ran); with R = 2 the
 * loop's exit and restart, which cost about two chunks' time per row on rows
 * of 12 chunks (down at I = 768), happen half as often. */
INL void rows_dot(const int FMT, const int R, const int NT, const mat *a, int64_t r, const float *const *x,
                  float dot[2][MAXT]) {
    const uint8_t *p[2], *s[2];
    __m256 acc[2][MAXT];
    for (int i = 0; i < R; i++) {
        p[i] = a->m->packed + (r + i) * a->m->row_stride;
        s[i] = FMT == FM_QF_BF16 ? NULL : a->m->scales + (r + i) * a->m->scale_stride;
        for (int j = 0; j < NT; j++) acc[i][j] = _mm256_setzero_ps();
    }
    for (int64_t ch = 0; ch < a->nch; ch++)
        for (int i = 0; i < R; i++) {
            nib n;
            if (FMT != FM_QF_BF16) decode_nib(p[i], ch, &n);
            for (int hf = 0; hf < 2; hf++) {
                half h;
                decode_half(FMT, p[i], s[i], a->lut, ch, &n, hf, &h);
                for (int j = 0; j < NT; j++) acc[i][j] = half_dot(FMT, &h, x[j] + 64 * ch, hf, acc[i][j]);
            }
        }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < NT; j++)
            dot[i][j] = hsum(acc[i][j]) + (a->tail ? tail_dot(a->m, p[i], s[i], a->lut, x[j]) : 0.0f);
}

const fm_cpu_kernels fm_cpu_kern_avx2 = {"avx2", gate_up, down, pos_avx2};
