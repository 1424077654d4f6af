/*
 * AVX2 + FMA kernels (this file alone is compiled with -mavx2 -mfma -mf16c;
 * the engine calls it only when the processor has them).
 *
 * FP4 decode, 32 weights per 16-byte load: split the nibbles, map each code
 * to twice its E2M1 value as an int8 with one byte shuffle, widen to int32,
 * convert to float and multiply by the block scale (x 0.5, from a table).
 * The activations are in the split-16 layout (kern.h), so the decoded
 * vectors line up with contiguous activation loads.
 *
 * Each (row, token) pair owns one accumulator vector; several rows and/or
 * tokens are processed together so that eight independent FMA chains hide
 * the FMA latency, and each weight row is decoded once per group of up to
 * four (gate/up) or eight (down) tokens.
 */
#include <immintrin.h>
#include <string.h>

#include "cpu/kern.h"

#define INL static inline __attribute__((always_inline))

INL float hsum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

INL __m256 widen(__m128i q8, __m256 s) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), s);
}

/* Units u and u+1 (32 weights) of a row: w[0..3] pair with x[16u + 8q]. */
INL void dec2(const int FMT, const uint8_t *p, const uint8_t *s, const float *lut, int64_t u,
              __m256 w[4]) {
    if (FMT == FM_QF_BF16) {
        for (int q = 0; q < 4; q++) {
            __m128i h = _mm_loadu_si128((const __m128i *)(p + 32 * u + 16 * q));
            w[q] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        }
        return;
    }
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m128i tab = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    __m128i v = _mm_loadu_si128((const __m128i *)(p + 8 * u));
    __m128i ql = _mm_shuffle_epi8(tab, _mm_and_si128(v, m));
    __m128i qh = _mm_shuffle_epi8(tab, _mm_and_si128(_mm_srli_epi16(v, 4), m));
    __m256 s0, s1;
    if (FMT == FM_QF_NVFP4) {
        s0 = _mm256_broadcast_ss(&lut[s[u]]);
        s1 = _mm256_broadcast_ss(&lut[s[u + 1]]);
    } else { /* MXFP4: one scale per 32 elements, u is even */
        s0 = s1 = _mm256_broadcast_ss(&lut[s[u >> 1]]);
    }
    w[0] = widen(ql, s0);
    w[1] = widen(qh, s0);
    w[2] = widen(_mm_unpackhi_epi64(ql, ql), s1);
    w[3] = widen(_mm_unpackhi_epi64(qh, qh), s1);
}

/* One unit (16 weights): w[0..1] pair with x[16u + 8q]. */
INL void dec1(const int FMT, const uint8_t *p, const uint8_t *s, const float *lut, int64_t u,
              __m256 w[2]) {
    if (FMT == FM_QF_BF16) {
        for (int q = 0; q < 2; q++) {
            __m128i h = _mm_loadu_si128((const __m128i *)(p + 32 * u + 16 * q));
            w[q] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        }
        return;
    }
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m128i tab = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    __m128i v = _mm_loadl_epi64((const __m128i *)(p + 8 * u));
    __m128i ql = _mm_shuffle_epi8(tab, _mm_and_si128(v, m));
    __m128i qh = _mm_shuffle_epi8(tab, _mm_and_si128(_mm_srli_epi16(v, 4), m));
    __m256 s0 = _mm256_broadcast_ss(&lut[s[FMT == FM_QF_NVFP4 ? u : u >> 1]]);
    w[0] = widen(ql, s0);
    w[1] = widen(qh, s0);
}

INL const float *lut_of(const int FMT) {
    return FMT == FM_QF_NVFP4 ? fm_cpu_lut_e4m3_half : fm_cpu_lut_e8m0_half;
}

/* acc[i][j] += row (r+i) of m . x_j, over the whole row. */
#define MAXR 8
#define MAXT 4
INL void rows_dot(const int FMT, const int R, const int NT, const fm_qmatrix *m, int64_t r,
                  const float *const *x, __m256 acc[MAXR][MAXT]) {
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
            __m256 w[4];
            dec2(FMT, p[i], s[i], lut, u, w);
            for (int j = 0; j < NT; j++)
                for (int q = 0; q < 4; q++)
                    acc[i][j] = _mm256_fmadd_ps(w[q], _mm256_loadu_ps(x[j] + 16 * u + 8 * q), acc[i][j]);
        }
    if (u < nu)
        for (int i = 0; i < R; i++) {
            __m256 w[2];
            dec1(FMT, p[i], s[i], lut, u, w);
            for (int j = 0; j < NT; j++)
                for (int q = 0; q < 2; q++)
                    acc[i][j] = _mm256_fmadd_ps(w[q], _mm256_loadu_ps(x[j] + 16 * u + 8 * q), acc[i][j]);
        }
}

INL void gu_group(const fm_gu_task *t, const int FMT, const int R, const int NT, int64_t r, int i0) {
    __m256 ag[MAXR][MAXT], au[MAXR][MAXT];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < NT; j++) ag[i][j] = au[i][j] = _mm256_setzero_ps();
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
    __m256 acc[MAXR][MAXT];
    const float *x[MAXT];
    for (int j = 0; j < NT; j++) x[j] = t->h + (i0 + j) * t->ldh;
    for (int i = 0; i < R; i++)
        for (int j = 0; j < NT; j++) acc[i][j] = _mm256_setzero_ps();
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

const fm_cpu_kernels fm_cpu_kern_avx2 = {"avx2", gate_up, down};
