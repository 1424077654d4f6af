/*
 * AVX-512 (F/BW/VL/DQ) kernels (this file alone is compiled with those
 * flags; the engine calls it only when the processor has them).
 *
 * FP4 decode, one 16-weight unit per vector: the unit's 8 bytes give 8 low
 * and 8 high nibbles, which in the split-16 activation layout (kern.h) are
 * already in order; widened to 16 indices they select twice the E2M1 value
 * from a 16-entry float table (vpermps), then one multiply applies the
 * block scale (x 0.5, from a table). Accumulation structure as in the AVX2
 * kernels: one accumulator per (row, token), groups of rows/tokens so that
 * eight FMA chains run side by side.
 */
#include <immintrin.h>
#include <string.h>

#include "cpu/kern.h"

#define INL static inline __attribute__((always_inline))

INL float hsum(__m512 v) {
    /* Fixed tree: halves, then the AVX2-style reduction of 8 lanes. */
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

INL __m512 fp4_unit(__m128i nib16, __m512 tab, __m512 s) {
    return _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(nib16), tab), s);
}

INL __m512 bf16_unit(const uint8_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Units u and u+1 (32 weights): w[q] pairs with x[16(u+q)]. */
INL void dec2(const int FMT, const uint8_t *p, const uint8_t *s, const float *lut, int64_t u,
              __m512 w[2]) {
    if (FMT == FM_QF_BF16) {
        w[0] = bf16_unit(p + 32 * u);
        w[1] = bf16_unit(p + 32 * u + 32);
        return;
    }
    const __m512 tab = _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, -0.0f, -1, -2, -3, -4, -6, -8, -12);
    const __m128i m = _mm_set1_epi8(0x0F);
    __m128i v = _mm_loadu_si128((const __m128i *)(p + 8 * u));
    __m128i lo = _mm_and_si128(v, m), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
    __m512 s0, s1;
    if (FMT == FM_QF_NVFP4) {
        s0 = _mm512_set1_ps(lut[s[u]]);
        s1 = _mm512_set1_ps(lut[s[u + 1]]);
    } else { /* MXFP4: one scale per 32 elements, u is even */
        s0 = s1 = _mm512_set1_ps(lut[s[u >> 1]]);
    }
    w[0] = fp4_unit(_mm_unpacklo_epi64(lo, hi), tab, s0);
    w[1] = fp4_unit(_mm_unpackhi_epi64(lo, hi), tab, s1);
}

/* One unit (16 weights). */
INL void dec1(const int FMT, const uint8_t *p, const uint8_t *s, const float *lut, int64_t u,
              __m512 w[1]) {
    if (FMT == FM_QF_BF16) {
        w[0] = bf16_unit(p + 32 * u);
        return;
    }
    const __m512 tab = _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, -0.0f, -1, -2, -3, -4, -6, -8, -12);
    const __m128i m = _mm_set1_epi8(0x0F);
    __m128i v = _mm_loadl_epi64((const __m128i *)(p + 8 * u));
    __m128i lo = _mm_and_si128(v, m), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
    __m512 s0 = _mm512_set1_ps(lut[s[FMT == FM_QF_NVFP4 ? u : u >> 1]]);
    w[0] = fp4_unit(_mm_unpacklo_epi64(lo, hi), tab, s0);
}

INL const float *lut_of(const int FMT) {
    return FMT == FM_QF_NVFP4 ? fm_cpu_lut_e4m3_half : fm_cpu_lut_e8m0_half;
}

/* acc[i][j] += row (r+i) of m . x_j, over the whole row. */
#define MAXR 8
#define MAXT 4
INL void rows_dot(const int FMT, const int R, const int NT, const fm_qmatrix *m, int64_t r,
                  const float *const *x, __m512 acc[MAXR][MAXT]) {
    const float *lut = lut_of(FMT);
    const int64_t nu = m->cols / 16;
    const uint8_t *p[MAXR], *s[MAXR];
    for (int i = 0; i < R; i++) {
        p[i] = m->packed + (r + i) * m->row_stride;
        s[i] = FMT == FM_QF_BF16 ? NULL : m->scales + (r + i) * m->scale_stride;
    }
    int64_t u = 0;
    for (; u + 2 <= nu; u += 2)
        for (int i = 0; i < R; i++) {
            __m512 w[2];
            dec2(FMT, p[i], s[i], lut, u, w);
            for (int j = 0; j < NT; j++)
                for (int q = 0; q < 2; q++)
                    acc[i][j] = _mm512_fmadd_ps(w[q], _mm512_loadu_ps(x[j] + 16 * u + 16 * q), acc[i][j]);
        }
    if (u < nu)
        for (int i = 0; i < R; i++) {
            __m512 w[1];
            dec1(FMT, p[i], s[i], lut, u, w);
            for (int j = 0; j < NT; j++)
                acc[i][j] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(x[j] + 16 * u), acc[i][j]);
        }
}

INL void gu_group(const fm_gu_task *t, const int FMT, const int R, const int NT, int64_t r, int i0) {
    __m512 ag[MAXR][MAXT], au[MAXR][MAXT];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < NT; j++) ag[i][j] = au[i][j] = _mm512_setzero_ps();
    rows_dot(FMT, R, NT, t->gate, r, t->x + i0, ag);
    rows_dot(FMT, R, NT, t->up, r, t->x + i0, au);
    const float sg = fm_cpu_row_scale(t->gate), su = fm_cpu_row_scale(t->up);
    for (int i = 0; i < R; i++) {
        const float bg = t->gate->bias ? t->gate->bias[r + i] : 0.0f;
        const float bu = t->up->bias ? t->up->bias[r + i] : 0.0f;
        const int64_t pos = fm_cpu_layout_pos(t->h_fmt, r + i);
        for (int j = 0; j < NT; j++) {
            float g = hsum(ag[i][j]) * sg + bg;
            float u = hsum(au[i][j]) * su + bu;
            t->h[(i0 + j) * t->ldh + pos] = fm_cpu_act(t->act, g, u, t->alpha, t->limit);
        }
    }
}

INL void gu_fmt(const fm_gu_task *t, const int FMT) {
    int64_t r = t->r0;
    if (t->n == 1) {
        for (; r + 4 <= t->r1; r += 4) gu_group(t, FMT, 4, 1, r, 0);
    } else if (t->n == 2) {
        for (; r + 2 <= t->r1; r += 2) gu_group(t, FMT, 2, 2, r, 0);
    }
    for (; r < t->r1; r++) {
        int i0 = 0;
        for (; i0 + 4 <= t->n; i0 += 4) gu_group(t, FMT, 1, 4, r, i0);
        switch (t->n - i0) {
        case 3: gu_group(t, FMT, 1, 3, r, i0); break;
        case 2: gu_group(t, FMT, 1, 2, r, i0); break;
        case 1: gu_group(t, FMT, 1, 1, r, i0); break;
        default: break;
        }
    }
}

static void gate_up(const fm_gu_task *t) {
    switch (t->gate->fmt) {
    case FM_QF_NVFP4: gu_fmt(t, FM_QF_NVFP4); break;
    case FM_QF_MXFP4: gu_fmt(t, FM_QF_MXFP4); break;
    case FM_QF_BF16: gu_fmt(t, FM_QF_BF16); break;
    default: break;
    }
}

INL void down_group(const fm_down_task *t, const int FMT, const int R, const int NT, int64_t r, int i0) {
    __m512 acc[MAXR][MAXT];
    const float *x[MAXT];
    for (int j = 0; j < NT; j++) x[j] = t->h + (i0 + j) * t->ldh;
    for (int i = 0; i < R; i++)
        for (int j = 0; j < NT; j++) acc[i][j] = _mm512_setzero_ps();
    rows_dot(FMT, R, NT, t->down, r, x, acc);
    const float sd = fm_cpu_row_scale(t->down);
    for (int i = 0; i < R; i++) {
        const float b = t->down->bias ? t->down->bias[r + i] : 0.0f;
        for (int j = 0; j < NT; j++) {
            float y = hsum(acc[i][j]) * sd + b;
            t->out[i0 + j][r + i] += (t->w ? t->w[i0 + j] : 1.0f) * y;
        }
    }
}

INL void down_fmt(const fm_down_task *t, const int FMT) {
    int64_t r = t->r0;
    if (t->n == 1) {
        for (; r + 8 <= t->r1; r += 8) down_group(t, FMT, 8, 1, r, 0);
    } else if (t->n == 2) {
        for (; r + 4 <= t->r1; r += 4) down_group(t, FMT, 4, 2, r, 0);
    } else {
        for (; r + 2 <= t->r1; r += 2) {
            int i0 = 0;
            for (; i0 + 4 <= t->n; i0 += 4) down_group(t, FMT, 2, 4, r, i0);
            switch (t->n - i0) {
            case 3: down_group(t, FMT, 2, 3, r, i0); break;
            case 2: down_group(t, FMT, 2, 2, r, i0); break;
            case 1: down_group(t, FMT, 2, 1, r, i0); break;
            default: break;
            }
        }
    }
    for (; r < t->r1; r++) {
        int i0 = 0;
        for (; i0 + 4 <= t->n; i0 += 4) down_group(t, FMT, 1, 4, r, i0);
        switch (t->n - i0) {
        case 3: down_group(t, FMT, 1, 3, r, i0); break;
        case 2: down_group(t, FMT, 1, 2, r, i0); break;
        case 1: down_group(t, FMT, 1, 1, r, i0); break;
        default: break;
        }
    }
}

static void down(const fm_down_task *t) {
    switch (t->down->fmt) {
    case FM_QF_NVFP4: down_fmt(t, FM_QF_NVFP4); break;
    case FM_QF_MXFP4: down_fmt(t, FM_QF_MXFP4); break;
    case FM_QF_BF16: down_fmt(t, FM_QF_BF16); break;
    default: break;
    }
}

static int64_t pos_split16(fm_qformat f, int64_t cols, int64_t c) {
    (void)cols;
    return fm_cpu_layout_pos(f, c);
}

const fm_cpu_kernels fm_cpu_kern_avx512 = {"avx512", gate_up, down, pos_split16};
