/*
 * The row loops the AVX2 and AVX-512 kernels share (a template by
 * inclusion): tail, gate + up + activation in groups of eight rows, down
 * weighted into the output rows. The including file defines, before
 * including this:
 *   KR_CH_LOG2  log2 of its chunk (elements decoded per step: 6 on AVX2,
 *               7 on AVX-512);
 *   KR_POS      its layout function (fm_cpu_kernels.pos);
 * and after it rows_dot, declared below: dot[i][j] = row r + i of a . x_j
 * (without the per-tensor factor) for R = 1 or 2 rows in one loop, each
 * (row, token) following the same operations whatever R, so results do not
 * depend on which path ran. The last cols % KR_CH elements of a row are in
 * natural order (tail_dot).
 */
#ifndef FM_CPU_KERN_ROWS_H
#define FM_CPU_KERN_ROWS_H
#include <string.h>

#include "cpu/kern.h"
#include "cpu/kern_avx_act.h"

#define KR_CH (1 << KR_CH_LOG2)

static const float k_e2m1[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};

/* The last cols % KR_CH elements, natural order, sequential FP32. */
static float tail_dot(const fm_qmatrix *m, const uint8_t *p, const uint8_t *s, const float *lut, const float *x) {
    const int64_t c0 = m->cols & ~(int64_t)(KR_CH - 1);
    float sum = 0.0f;
    for (int64_t c = c0; c < m->cols; c++) {
        float w;
        if (m->fmt == FM_QF_BF16) {
            uint16_t h;
            memcpy(&h, p + 2 * c, 2);
            uint32_t u = (uint32_t)h << 16;
            memcpy(&w, &u, 4);
        } else {
            uint8_t b = p[c >> 1];
            int64_t blk = m->fmt == FM_QF_NVFP4 ? c >> 4 : c >> 5;
            w = k_e2m1[(c & 1) ? b >> 4 : b & 15] * lut[s[blk]];
        }
        sum += w * x[c];
    }
    return sum;
}

INL const float *lut_of(const int FMT) {
    return FMT == FM_QF_NVFP4 ? fm_cpu_lut_e4m3 : fm_cpu_lut_e8m0;
}

#define MAXT 4

/* Everything a row loop needs that does not change from row to row. */
typedef struct {
    const fm_qmatrix *m;
    const float *lut;
    int64_t nch;  /* full KR_CH-element chunks per row */
    int tail;     /* cols % KR_CH != 0                  */
} mat;

INL mat mat_of(const int FMT, const fm_qmatrix *m) {
    return (mat){m, lut_of(FMT), m->cols >> KR_CH_LOG2, (m->cols & (KR_CH - 1)) != 0};
}

INL void rows_dot(const int FMT, const int R, const int NT, const mat *a, int64_t r, const float *const *x,
                  float dot[2][MAXT]);

/* One row: dot[j] = row r of a . x_j. */
INL void row_dot(const int FMT, const int NT, const mat *a, int64_t r, const float *const *x, float *dot) {
    float d[2][MAXT];
    rows_dot(FMT, 1, NT, a, r, x, d);
    for (int j = 0; j < NT; j++) dot[j] = d[0][j];
}

/* ---- gate + up + activation */

/* Rows in groups of eight (the activation's vector), each row decoded once
 * per group of up to four tokens; the group's 16 rows of gate and up stay
 * in L1 while the token groups pass over them. */
INL void gu_rows8(const fm_gu_task *t, const int FMT, const int NT, const mat *g, const mat *u, int64_t r0, int nr,
                  int i0) {
    float dg[MAXT][8], du[MAXT][8];
    memset(dg, 0, sizeof dg);
    memset(du, 0, sizeof du);
    for (int i = 0; i < nr; i++) {
        float a[MAXT], b[MAXT];
        /* One row after the other: gate and up interleaved in one loop
         * measured 4 % faster from L2 but 8 % slower from memory (two
         * streams alternating every 32 bytes). */
        row_dot(FMT, NT, g, r0 + i, t->x + i0, a);
        row_dot(FMT, NT, u, r0 + i, t->x + i0, b);
        for (int j = 0; j < NT; j++) {
            dg[j][i] = a[j];
            du[j][i] = b[j];
        }
    }
    float bg[8] = {0}, bu[8] = {0};
    for (int i = 0; i < nr; i++) {
        if (t->gate->bias) bg[i] = t->gate->bias[r0 + i];
        if (t->up->bias) bu[i] = t->up->bias[r0 + i];
    }
    const __m256 sg = _mm256_set1_ps(fm_cpu_row_scale(t->gate)), su = _mm256_set1_ps(fm_cpu_row_scale(t->up));
    for (int j = 0; j < NT; j++) {
        __m256 gv = _mm256_fmadd_ps(_mm256_loadu_ps(dg[j]), sg, _mm256_loadu_ps(bg));
        __m256 uv = _mm256_fmadd_ps(_mm256_loadu_ps(du[j]), su, _mm256_loadu_ps(bu));
        float hv[8];
        _mm256_storeu_ps(hv, act8(t->act, gv, uv, t->alpha, t->limit));
        float *h = t->h + (i0 + j) * t->ldh;
        for (int i = 0; i < nr; i++) h[KR_POS(t->h_fmt, t->ldh, r0 + i)] = hv[i];
    }
}

INL void gu_fmt(const fm_gu_task *t, const int FMT) {
    const mat g = mat_of(FMT, t->gate), u = mat_of(FMT, t->up);
    for (int64_t r = t->r0; r < t->r1; r += 8) {
        const int nr = t->r1 - r < 8 ? (int)(t->r1 - r) : 8;
        for (int i0 = 0; i0 < t->n; i0 += MAXT) switch (t->n - i0 < MAXT ? t->n - i0 : MAXT) {
            case 4: gu_rows8(t, FMT, 4, &g, &u, r, nr, i0); break;
            case 3: gu_rows8(t, FMT, 3, &g, &u, r, nr, i0); break;
            case 2: gu_rows8(t, FMT, 2, &g, &u, r, nr, i0); break;
            default: gu_rows8(t, FMT, 1, &g, &u, r, nr, i0); break;
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

/* ---- down, weighted, accumulated into the output rows */

INL void down_store(const fm_down_task *t, int64_t r, int i0, int NT, const float *y, float sd) {
    const float b = t->down->bias ? t->down->bias[r] : 0.0f;
    for (int j = 0; j < NT; j++) t->out[i0 + j][r] += (t->w ? t->w[i0 + j] : 1.0f) * (y[j] * sd + b);
}

INL void down_group(const fm_down_task *t, const int FMT, const int NT, const mat *d, int64_t r, int i0, float sd) {
    const float *x[MAXT];
    for (int j = 0; j < NT; j++) x[j] = t->h + (i0 + j) * t->ldh;
    float y[MAXT];
    row_dot(FMT, NT, d, r, x, y);
    down_store(t, r, i0, NT, y, sd);
}

INL void down_fmt(const fm_down_task *t, const int FMT) {
    const mat d = mat_of(FMT, t->down);
    const float sd = fm_cpu_row_scale(t->down);
    int64_t r = t->r0;
    if (t->n <= 2) { /* rows in pairs (rows_dot with R = 2): +12 % at 1 token from L2,
                      * +4 % from memory at 1 and 2 tokens */
        const float *x[MAXT];
        for (int j = 0; j < t->n; j++) x[j] = t->h + j * t->ldh;
        for (; r + 1 < t->r1; r += 2) {
            float y[2][MAXT];
            if (t->n == 1) rows_dot(FMT, 2, 1, &d, r, x, y);
            else rows_dot(FMT, 2, 2, &d, r, x, y);
            down_store(t, r, 0, t->n, y[0], sd);
            down_store(t, r + 1, 0, t->n, y[1], sd);
        }
    }
    for (; r < t->r1; r++)
        for (int i0 = 0; i0 < t->n; i0 += MAXT) switch (t->n - i0 < MAXT ? t->n - i0 : MAXT) {
            case 4: down_group(t, FMT, 4, &d, r, i0, sd); break;
            case 3: down_group(t, FMT, 3, &d, r, i0, sd); break;
            case 2: down_group(t, FMT, 2, &d, r, i0, sd); break;
            default: down_group(t, FMT, 1, &d, r, i0, sd); break;
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

#endif
