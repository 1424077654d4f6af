/* Portable C kernels: the fallback on processors without AVX2, and the
 * plain statement of what the SIMD kernels compute. */
#include <string.h>

#include "cpu/kern.h"

/* E2M1 code -> twice its value (exact small integers). */
static const float k_q2[16] = {0, 1, 2, 3, 4, 6, 8, 12, -0.0f, -1, -2, -3, -4, -6, -8, -12};

/* Decodes row r of m into w[cols], in the activation layout of m's format,
 * without the per-tensor factor. */
static void decode_row(const fm_qmatrix *m, int64_t r, float *w) {
    const uint8_t *p = m->packed + r * m->row_stride;
    if (m->fmt == FM_QF_BF16) {
        for (int64_t c = 0; c < m->cols; c++) {
            uint16_t b;
            memcpy(&b, p + 2 * c, 2);
            uint32_t u = (uint32_t)b << 16;
            memcpy(&w[c], &u, 4);
        }
        return;
    }
    const uint8_t *s = m->scales + r * m->scale_stride;
    const float *lut = m->fmt == FM_QF_NVFP4 ? fm_cpu_lut_e4m3_half : fm_cpu_lut_e8m0_half;
    const int shift = m->fmt == FM_QF_NVFP4 ? 0 : 1; /* 16-units per scale: 1 or 2 */
    for (int64_t u = 0; u < m->cols / 16; u++) {
        float sc = lut[s[u >> shift]];
        for (int j = 0; j < 8; j++) {
            uint8_t b = p[8 * u + j];
            w[16 * u + j] = k_q2[b & 15] * sc;
            w[16 * u + 8 + j] = k_q2[b >> 4] * sc;
        }
    }
}

/* Eight lanes, each summing the positions congruent to it modulo 8, then
 * a fixed reduction tree. */
static float dot8(const float *w, const float *x, int64_t n) {
    float a[8] = {0};
    for (int64_t c = 0; c < n; c += 8)
        for (int j = 0; j < 8; j++) a[j] += w[c + j] * x[c + j];
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

static void gate_up(const fm_gu_task *t) {
    const int64_t H = t->gate->cols;
    float *wg = t->wbuf, *wu = wg + H;
    const float sg = fm_cpu_row_scale(t->gate), su = fm_cpu_row_scale(t->up);
    for (int64_t r = t->r0; r < t->r1; r++) {
        decode_row(t->gate, r, wg);
        decode_row(t->up, r, wu);
        const float bg = t->gate->bias ? t->gate->bias[r] : 0.0f;
        const float bu = t->up->bias ? t->up->bias[r] : 0.0f;
        const int64_t pos = fm_cpu_layout_pos(t->h_fmt, r);
        for (int i = 0; i < t->n; i++) {
            float g = dot8(wg, t->x[i], H) * sg + bg;
            float u = dot8(wu, t->x[i], H) * su + bu;
            t->h[i * t->ldh + pos] = fm_cpu_act(t->act, g, u, t->alpha, t->limit);
        }
    }
}

static void down(const fm_down_task *t) {
    const int64_t I = t->down->cols;
    float *w = t->wbuf;
    const float sd = fm_cpu_row_scale(t->down);
    for (int64_t r = t->r0; r < t->r1; r++) {
        decode_row(t->down, r, w);
        const float b = t->down->bias ? t->down->bias[r] : 0.0f;
        for (int i = 0; i < t->n; i++) {
            float y = dot8(w, t->h + i * t->ldh, I) * sd + b;
            t->out[i][r] += (t->w ? t->w[i] : 1.0f) * y;
        }
    }
}

static int64_t pos_split16(fm_qformat f, int64_t cols, int64_t c) {
    (void)cols;
    return fm_cpu_layout_pos(f, c);
}

const fm_cpu_kernels fm_cpu_kern_scalar = {"scalar", gate_up, down, pos_split16};
