/*
 * AVX-512 (F/BW/VL/DQ) kernels (this file alone is compiled with those
 * flags; the engine calls it only when the processor has them).
 *
 * The AVX2 kernels' decode (kern_avx2.c) on 512-bit vectors: 64 packed bytes
 * (128 weights) are split into low and high nibbles; byte shuffles (within
 * each 128-bit lane, as on AVX2) look up the high and low bytes of each
 * code's exact BF16 value; byte unpacks pair them into BF16 words, and a
 * shift / a mask turn each pair of words of a 32-bit lane into two floats.
 * 8 shuffles and 11 other operations per 128 weights, against 16 and 22 on
 * AVX2. The weights come out in a fixed order inside each 128-element chunk;
 * the activations are permuted once per call into that order ("chunk-128"
 * layout, pos_avx512), the last cols % 128 elements stay in natural order
 * and are done in scalar code.
 *
 * The weight stream is prefetched 4 KB ahead in software (PF_DIST): on a
 * Xeon one core's demand misses and its hardware prefetcher left the loop
 * waiting on memory at 1 - 16 tokens.
 *
 * A 128-bit lane of a decoded vector only ever holds elements of one block
 * (NVFP4: lane L of half hf holds block 2 L + hf of the chunk; MXFP4: block
 * L), so the products of a half are summed first and multiplied by the
 * lanes' scales once (gathered from the scale table, spread by a permute).
 *
 * Each (row, token) pair owns one accumulator and one fixed sequence of
 * operations whatever the number of tokens processed together (groups of up
 * to four per decode of a row), so a token's result does not depend on the
 * rest of the batch; down at one or two tokens runs two rows per loop; the
 * activation runs on eight rows at a time (kern_avx_act.h).
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "cpu/kern.h"
#include "cpu/kern_avx_act.h"

/* ---- layout: position of element c of a cols-long row */
static int64_t pos_avx512(fm_qformat f, int64_t cols, int64_t c) {
    const int64_t base = c & ~(int64_t)127;
    if (base + 128 > cols) return c; /* tail: natural order */
    const int e = (int)(c & 127);
    int v, lane;
    if (f == FM_QF_BF16) { /* 32 BF16 per 64-byte load q; lane d holds elements 2d, 2d+1 */
        const int q = e >> 5, d = (e & 31) >> 1, part = e & 1;
        v = 2 * q + part;
        lane = d;
    } else {
        /* 128-bit lane L: bytes 16 L .. 16 L + 15 = elements 32 L ..; half hf
         * its bytes 8 hf ..; in a half, 32-bit lane d holds bytes 2d, 2d + 1:
         * F0 / F1 their low nibbles, F2 / F3 their high ones */
        const int L = e >> 5, rem = e & 31, hf = rem >> 4, r2 = rem & 15, d = r2 >> 2, q = r2 & 3;
        const int fi = (q & 1) * 2 + (q >> 1);
        v = 4 * hf + fi;
        lane = 4 * L + d;
    }
    return base + 16 * v + lane;
}

/* ---- decode of one 128-weight chunk in two halves of 64 */

typedef struct {
    __m512 F[4];
    __m512 S; /* the lanes' block scales (NVFP4, MXFP4) */
} half;

typedef struct {
    __m512i hl, ll, hh, lh;
    __m512 S0, S1; /* scales of half 0 and half 1 */
} nib;

INL void decode_nib(const int FMT, const uint8_t *p, const uint8_t *s, const float *lut, int64_t ch, nib *o) {
    const __m512i m = _mm512_set1_epi8(0x0F);
    /* high / low byte of the BF16 encoding of each E2M1 code, per 128-bit lane */
    const __m512i th = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, (char)0x80,
                                                            (char)0xBF, (char)0xBF, (char)0xBF, (char)0xC0,
                                                            (char)0xC0, (char)0xC0, (char)0xC0));
    const __m512i tl = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, (char)0x80, (char)0xC0, 0, 0x40, (char)0x80,
                                                            (char)0xC0, 0, 0, (char)0x80, (char)0xC0, 0, 0x40,
                                                            (char)0x80, (char)0xC0));
    __m512i v = _mm512_loadu_si512((const void *)(p + 64 * ch));
    __m512i lo = _mm512_and_si512(v, m), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
    o->hl = _mm512_shuffle_epi8(th, lo);
    o->ll = _mm512_shuffle_epi8(tl, lo);
    o->hh = _mm512_shuffle_epi8(th, hi);
    o->lh = _mm512_shuffle_epi8(tl, hi);
    if (FMT == FM_QF_NVFP4) {
        /* blocks 0 .. 7 of the chunk; half hf, lane L: block 2 L + hf */
        const __m256 sc = _mm256_i32gather_ps(lut, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(s + 8 * ch))), 4);
        const __m512 s8 = _mm512_castps256_ps512(sc);
        o->S0 = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6), s8);
        o->S1 = _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7), s8);
    } else {
        /* MXFP4: blocks 0 .. 3 of the chunk; lane L: block L */
        uint32_t b4;
        memcpy(&b4, s + 4 * ch, 4);
        const __m128 sc = _mm_i32gather_ps(lut, _mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)b4)), 4);
        o->S0 = o->S1 = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                              _mm512_castps128_ps512(sc));
    }
}

INL void split_words(__m512i w, __m512 *a, __m512 *b) {
    *a = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    *b = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)));
}

INL void decode_half(const int FMT, const uint8_t *p, int64_t ch, const nib *n, int hf, half *o) {
    if (FMT == FM_QF_BF16) {
        /* half 0: loads 0 and 2 (v = 0, 1, 4, 5), half 1: loads 1 and 3 */
        __m512i w0 = _mm512_loadu_si512((const void *)(p + 256 * ch + 64 * hf));
        __m512i w1 = _mm512_loadu_si512((const void *)(p + 256 * ch + 128 + 64 * hf));
        split_words(w0, &o->F[0], &o->F[1]);
        split_words(w1, &o->F[2], &o->F[3]);
        return;
    }
    __m512i wa = hf ? _mm512_unpackhi_epi8(n->ll, n->hl) : _mm512_unpacklo_epi8(n->ll, n->hl);
    __m512i wb = hf ? _mm512_unpackhi_epi8(n->lh, n->hh) : _mm512_unpacklo_epi8(n->lh, n->hh);
    split_words(wa, &o->F[0], &o->F[1]);
    split_words(wb, &o->F[2], &o->F[3]);
    o->S = hf ? n->S1 : n->S0;
}

/* acc += half . x, x: the chunk's 128 activations in layout order. */
INL __m512 half_dot(const int FMT, const half *h, const float *x, int hf, __m512 acc) {
    if (FMT == FM_QF_BF16) {
        const float *xa = x + 32 * hf, *xb = x + 64 + 32 * hf;
        acc = _mm512_fmadd_ps(h->F[0], _mm512_loadu_ps(xa), acc);
        acc = _mm512_fmadd_ps(h->F[1], _mm512_loadu_ps(xa + 16), acc);
        acc = _mm512_fmadd_ps(h->F[2], _mm512_loadu_ps(xb), acc);
        return _mm512_fmadd_ps(h->F[3], _mm512_loadu_ps(xb + 16), acc);
    }
    const float *xa = x + 64 * hf;
    __m512 t = _mm512_mul_ps(h->F[0], _mm512_loadu_ps(xa));
    t = _mm512_fmadd_ps(h->F[1], _mm512_loadu_ps(xa + 16), t);
    t = _mm512_fmadd_ps(h->F[2], _mm512_loadu_ps(xa + 32), t);
    t = _mm512_fmadd_ps(h->F[3], _mm512_loadu_ps(xa + 48), t);
    return _mm512_fmadd_ps(t, h->S, acc);
}

INL float hsum16(__m512 v) {
    /* fixed tree: the halves, then the 8-lane sum */
    return hsum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

/* ---- the row loops (kern_rows.h) on 128-element chunks */
#define KR_CH_LOG2 7
#define KR_POS pos_avx512
#include "cpu/kern_rows.h"

/* Software prefetch distance of the weight stream (bytes ahead of the chunk
 * being decoded): on the GPU host's Xeon 4 KB was the best of 1, 4 and
 * 8 KB at batches 1 and 16 (docs/perf.md, CPU); the AVX2 kernels have none
 * (no gain on Zen 3).
 * A prefetch never faults, so reading past a matrix's end is harmless. */
#define PF_DIST 4096

/* kern_rows.h's rows_dot on 128-element chunks */
INL void rows_dot(const int FMT, const int R, const int NT, const mat *a, int64_t r, const float *const *x,
                  float dot[2][MAXT]) {
    const uint8_t *p[2], *s[2];
    __m512 acc[2][MAXT];
    for (int i = 0; i < R; i++) {
        p[i] = a->m->packed + (r + i) * a->m->row_stride;
        s[i] = FMT == FM_QF_BF16 ? NULL : a->m->scales + (r + i) * a->m->scale_stride;
        for (int j = 0; j < NT; j++) acc[i][j] = _mm512_setzero_ps();
    }
    for (int64_t ch = 0; ch < a->nch; ch++)
        for (int i = 0; i < R; i++) {
            nib n;
            if (FMT != FM_QF_BF16) {
                _mm_prefetch((const char *)((uintptr_t)(p[i] + 64 * ch) + PF_DIST), _MM_HINT_T0);
                decode_nib(FMT, p[i], s[i], a->lut, ch, &n);
            }
            for (int hf = 0; hf < 2; hf++) {
                half h;
                decode_half(FMT, p[i], ch, &n, hf, &h);
                for (int j = 0; j < NT; j++) acc[i][j] = half_dot(FMT, &h, x[j] + 128 * ch, hf, acc[i][j]);
            }
        }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < NT; j++)
            dot[i][j] = hsum16(acc[i][j]) + (a->tail ? tail_dot(a->m, p[i], s[i], a->lut, x[j]) : 0.0f);
}

const fm_cpu_kernels fm_cpu_kern_avx512 = {"avx512", gate_up, down, pos_avx512};
