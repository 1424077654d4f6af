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
 * docs/perf.md (CPU round 3) has the measurements and the variants that
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


static const float k_e2m1[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};

/* The last cols % 64 elements, natural order, sequential FP32. */
static float tail_dot(const fm_qmatrix *m, const uint8_t *p, const uint8_t *s, const float *lut, const float *x) {
    const int64_t c0 = m->cols & ~(int64_t)63;
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
    int64_t nch;  /* full 64-element chunks per row */
    int tail;     /* cols % 64 != 0                 */
} mat;

INL mat mat_of(const int FMT, const fm_qmatrix *m) {
    return (mat){m, lut_of(FMT), m->cols >> 6, (m->cols & 63) != 0};
}

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
        for (int i = 0; i < nr; i++) h[pos_avx2(t->h_fmt, t->ldh, r0 + i)] = hv[i];
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

const fm_cpu_kernels fm_cpu_kern_avx2 = {"avx2", gate_up, down, pos_avx2};
