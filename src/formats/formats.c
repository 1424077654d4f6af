/*
 * Scalar number formats (E2M1, E4M3, E8M0, BF16, F16) and the NVFP4 / MXFP4
 * block formats of expert weights.
 *
 * Conventions chosen here (and checked by tests/test_formats.c and
 * tests/py_formats_ml_dtypes.py):
 *   E2M1 encode   follows ModelOpt's _cast_fp4 bit for bit: RNE with ties to
 *                 the even code, saturation at +-6, sign bit = (x < 0), so
 *                 -0.0 encodes to +0 (code 0) and NaN to +6 (code 7).
 *   E4M3 encode   RNE; finite values beyond 448 and +-inf saturate to +-448,
 *                 which is what ModelOpt's clamp-then-cast produces; NaN
 *                 encodes to 0x7F (0xFF when its sign bit is set).
 *   E8M0 floor    largest 2^e <= x, clamped to [2^-127, 2^127]; x <= 0 gives
 *                 code 0, NaN gives 0xFF.
 *   BF16 / F16    RNE; NaN stays NaN (quietened, sign kept); F16 overflow
 *                 (|x| >= 65520) gives inf, tiny values become subnormals.
 */
#include "util/util.h"

#include <math.h>
#include <string.h>
#include <strings.h>

static inline uint32_t f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}
static inline float bits_f32(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* ------------------------------------------------------------------ E2M1 */

static const float k_e2m1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                 -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

float fm_e2m1_to_f32(uint8_t code) { return k_e2m1[code & 0xF]; }

uint8_t fm_f32_to_e2m1(float x) {
    /* Midpoints between neighbouring magnitudes. A value equal to a midpoint
     * goes to the neighbour with the even code: down at 0.25, 1.25, 2.5, 5;
     * up at 0.75, 1.75, 3.5. */
    static const float bounds[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    uint8_t sign = x < 0.0f ? 8 : 0;
    float a = fabsf(x);
    if (isnan(a)) return 7;
    uint8_t code = 0;
    for (int i = 0; i < 7; i++) code += a > bounds[i];
    if (a == 0.75f || a == 1.75f || a == 3.5f) code++;
    return (uint8_t)(sign | code);
}

/* ------------------------------------------------------------------ E4M3 */

/* Bit construction rather than ldexp: dequantization calls this per block. */
float fm_e4m3_to_f32(uint8_t code) {
    uint32_t sign = (uint32_t)(code & 0x80) << 24, e = (code >> 3) & 0xFu, m = code & 7u;
    if (e == 0xF && m == 7) return bits_f32(sign | 0x7FC00000u);
    if (e == 0) { /* subnormal: m * 2^-9, exact in float */
        float v = (float)m * 0x1p-9f;
        return sign ? -v : v;
    }
    return bits_f32(sign | ((e + 120u) << 23) | (m << 20));
}

uint8_t fm_f32_to_e4m3(float x) {
    uint8_t sign = (f32_bits(x) >> 31) ? 0x80 : 0;
    if (isnan(x)) return (uint8_t)(sign | 0x7F);
    double a = fabs((double)x);
    if (a >= 448.0) return (uint8_t)(sign | 0x7E);
    if (a < 0.015625) { /* below 2^-6: subnormal grid of 2^-9 (q = 8 is 2^-6) */
        double q = rint(a * 512.0);
        return (uint8_t)(sign | (uint8_t)q);
    }
    int e;
    double m = frexp(a, &e); /* a = m * 2^e, m in [0.5, 1) */
    e -= 1;                  /* a = (2m) * 2^e, 2m in [1, 2) */
    double q = rint((2.0 * m - 1.0) * 8.0);
    if (q == 8.0) { q = 0.0; e += 1; }
    return (uint8_t)(sign | (uint8_t)((e + 7) << 3) | (uint8_t)q);
}

/* ------------------------------------------------------------------ E8M0 */

float fm_e8m0_to_f32(uint8_t code) {
    if (code == 0xFF) return bits_f32(0x7FC00000u);
    if (code == 0) return bits_f32(0x00400000u); /* 2^-127 is an f32 subnormal */
    return bits_f32((uint32_t)code << 23);
}

uint8_t fm_f32_to_e8m0_floor(float x) {
    if (isnan(x)) return 0xFF;
    if (!(x > 0.0f)) return 0;
    if (isinf(x)) return 0xFE;
    int e;
    frexpf(x, &e); /* x = m * 2^e, m in [0.5, 1): floor(log2 x) = e - 1 */
    int code = e - 1 + 127;
    if (code < 0) code = 0;
    if (code > 254) code = 254;
    return (uint8_t)code;
}

/* ------------------------------------------------------------ BF16 / F16 */

float fm_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t fm_f32_to_bf16(float x) {
    uint32_t u = f32_bits(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float fm_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1F) return bits_f32(sign | 0x7F800000u | (m << 13));
    if (e == 0) {
        float v = ldexpf((float)m, -24);
        return (h & 0x8000u) ? -v : v;
    }
    return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

uint16_t fm_f32_to_f16(float x) {
    uint32_t u = f32_bits(x);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
    /* 65520 is the midpoint between 65504 (odd mantissa) and 2^16: ties go up. */
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);
    if (a >= 0x38800000u) { /* normal in F16: >= 2^-14 */
        uint32_t r = a - (112u << 23);
        r += 0xFFFu + ((r >> 13) & 1u);
        return (uint16_t)(sign | (r >> 13));
    }
    /* Subnormal grid of 2^-24; q = 1024 rounds up into the smallest normal. */
    double q = rint((double)bits_f32(a) * 16777216.0);
    return (uint16_t)(sign | (uint16_t)q);
}

/* --------------------------------------------------------------- qformat */

const char *fm_qformat_name(fm_qformat f) {
    switch (f) {
    case FM_QF_NVFP4: return "nvfp4";
    case FM_QF_MXFP4: return "mxfp4";
    case FM_QF_BF16: return "bf16";
    case FM_QF_NONE: return "none";
    }
    return "invalid";
}

fm_qformat fm_qformat_from_name(const char *s) {
    if (!s) return FM_QF_NONE;
    if (strcasecmp(s, "nvfp4") == 0) return FM_QF_NVFP4;
    if (strcasecmp(s, "mxfp4") == 0) return FM_QF_MXFP4;
    if (strcasecmp(s, "bf16") == 0) return FM_QF_BF16;
    return FM_QF_NONE;
}

int fm_qformat_block(fm_qformat f) {
    switch (f) {
    case FM_QF_NVFP4: return 16;
    case FM_QF_MXFP4: return 32;
    default: return 0;
    }
}

/* ---------------------------------------------------------- quantization */

static fm_status check_quant_args(const char *what, const float *w, int64_t rows, int64_t cols,
                                  int block, const uint8_t *packed, const uint8_t *scales) {
    if (!w || !packed || !scales) return fm_error(FM_E_ARG, "%s: NULL buffer", what);
    if (rows < 0 || cols <= 0 || cols % block != 0)
        return fm_error(FM_E_ARG, "%s: shape [%lld, %lld]: cols must be a positive multiple of %d",
                        what, (long long)rows, (long long)cols, block);
    uint64_t n;
    if (!fm_mul_ok((uint64_t)rows, (uint64_t)cols, &n) || n > (uint64_t)INT64_MAX / 4)
        return fm_error(FM_E_RANGE, "%s: shape [%lld, %lld] too large", what, (long long)rows,
                        (long long)cols);
    return FM_OK;
}

/* Largest |w| of a row segment; -1 when a value is not finite. */
static float seg_amax(const float *w, int64_t n) {
    float m = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        float a = fabsf(w[i]);
        if (!isfinite(a)) return -1.0f;
        if (a > m) m = a;
    }
    return m;
}

static void pack_pair(uint8_t *packed, int64_t idx, uint8_t code) {
    if (idx & 1) packed[idx >> 1] = (uint8_t)((packed[idx >> 1] & 0x0F) | (code << 4));
    else packed[idx >> 1] = (uint8_t)((packed[idx >> 1] & 0xF0) | code);
}

fm_status fm_quantize_nvfp4(const float *w, int64_t rows, int64_t cols, uint8_t *packed,
                            uint8_t *scales, float *scale2) {
    fm_status st = check_quant_args("nvfp4 quantize", w, rows, cols, 16, packed, scales);
    if (st != FM_OK) return st;
    if (!scale2) return fm_error(FM_E_ARG, "nvfp4 quantize: NULL scale2");
    int64_t n = rows * cols;
    float amax = seg_amax(w, n);
    if (amax < 0.0f)
        return fm_error(FM_E_NUMERIC, "nvfp4 quantize: non-finite weight in [%lld, %lld] matrix",
                        (long long)rows, (long long)cols);
    /* ModelOpt divides by scale2 without a guard; an all-zero matrix would
     * give 0/0. Here it gets scale2 = 1 and every block scale 1.0. A matrix
     * so small that scale2 leaves the normal float range cannot be
     * represented faithfully and is refused. */
    float s2 = amax / (6.0f * 448.0f);
    if (amax == 0.0f) s2 = 1.0f;
    else if (!(s2 >= 0x1p-126f))
        return fm_error(FM_E_RANGE, "nvfp4 quantize: amax %g too small for an FP32 tensor scale",
                        (double)amax);
    *scale2 = s2;
    const float denom = 6.0f * s2;
    int64_t nb = cols / 16;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *blk = w + r * cols + b * 16;
            float bamax = seg_amax(blk, 16);
            float s = bamax / denom;
            /* The clamp keeps the E4M3 scale out of zero (a zero scale would
             * turn every element into 0/0); inside [2^-9, 448] it changes
             * nothing, so ordinary blocks match ModelOpt exactly. */
            if (s == 0.0f) s = 1.0f;
            else if (s < 0x1p-9f) s = 0x1p-9f;
            else if (s > 448.0f) s = 448.0f;
            uint8_t sc = fm_f32_to_e4m3(s);
            scales[r * nb + b] = sc;
            float d = fm_e4m3_to_f32(sc) * s2;
            for (int i = 0; i < 16; i++)
                pack_pair(packed, r * cols + b * 16 + i, fm_f32_to_e2m1(blk[i] / d));
        }
    }
    return FM_OK;
}

fm_status fm_quantize_mxfp4(const float *w, int64_t rows, int64_t cols, uint8_t *packed,
                            uint8_t *scales) {
    fm_status st = check_quant_args("mxfp4 quantize", w, rows, cols, 32, packed, scales);
    if (st != FM_OK) return st;
    int64_t nb = cols / 32;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *blk = w + r * cols + b * 32;
            float bamax = seg_amax(blk, 32);
            if (bamax < 0.0f)
                return fm_error(FM_E_NUMERIC, "mxfp4 quantize: non-finite weight in row %lld",
                                (long long)r);
            /* OCP MX: X = 2^(floor(log2(amax)) - emax_elem), emax_elem = 2 for
             * E2M1, so the block maximum lands in [4, 8) and values above 6
             * saturate. An all-zero block gets the smallest scale 2^-127. */
            int code = 0;
            if (bamax > 0.0f) {
                int e;
                frexpf(bamax, &e);
                code = (e - 1) - 2 + 127;
                if (code < 0) code = 0;
                if (code > 254) code = 254;
            }
            scales[r * nb + b] = (uint8_t)code;
            for (int i = 0; i < 32; i++) {
                double v = ldexp((double)blk[i], 127 - code); /* exact in double */
                pack_pair(packed, r * cols + b * 32 + i, fm_f32_to_e2m1((float)v));
            }
        }
    }
    return FM_OK;
}

/* ------------------------------------------------------------ dequantize */

static inline uint8_t nibble_at(const uint8_t *row, int64_t c) {
    uint8_t byte = row[c >> 1];
    return (c & 1) ? (uint8_t)(byte >> 4) : (uint8_t)(byte & 0x0F);
}

/* The block scale is decoded once per block. For MXFP4 and BF16 scale2 is
 * not used (the struct may leave it 0). An unknown format gives NaN. */
void fm_qmatrix_dequant_row(const fm_qmatrix *m, int64_t row, float *out) {
    const uint8_t *p = m->packed + row * m->row_stride;
    if (m->fmt == FM_QF_BF16) {
        for (int64_t c = 0; c < m->cols; c++) {
            uint16_t h;
            memcpy(&h, p + 2 * c, 2);
            out[c] = fm_bf16_to_f32(h);
        }
        return;
    }
    int blk = fm_qformat_block(m->fmt);
    if (!blk) {
        for (int64_t c = 0; c < m->cols; c++) out[c] = NAN;
        return;
    }
    const uint8_t *s = m->scales + row * m->scale_stride;
    for (int64_t c0 = 0; c0 < m->cols; c0 += blk) {
        /* ModelOpt's dequantize: E2M1 * (float(scale) * scale2), in float. */
        float bs = m->fmt == FM_QF_NVFP4 ? fm_e4m3_to_f32(s[c0 / blk]) * m->scale2
                                         : fm_e8m0_to_f32(s[c0 / blk]);
        int64_t end = c0 + blk < m->cols ? c0 + blk : m->cols;
        for (int64_t c = c0; c < end; c++) out[c] = fm_e2m1_to_f32(nibble_at(p, c)) * bs;
    }
}

void fm_qmatrix_dequant_row_f64(const fm_qmatrix *m, int64_t row, double *out) {
    const uint8_t *p = m->packed + row * m->row_stride;
    if (m->fmt == FM_QF_BF16) {
        for (int64_t c = 0; c < m->cols; c++) {
            uint16_t h;
            memcpy(&h, p + 2 * c, 2);
            out[c] = (double)fm_bf16_to_f32(h);
        }
        return;
    }
    int blk = fm_qformat_block(m->fmt);
    if (!blk) {
        for (int64_t c = 0; c < m->cols; c++) out[c] = NAN;
        return;
    }
    const uint8_t *s = m->scales + row * m->scale_stride;
    for (int64_t c0 = 0; c0 < m->cols; c0 += blk) {
        double bs = m->fmt == FM_QF_NVFP4
                        ? (double)fm_e4m3_to_f32(s[c0 / blk]) * (double)m->scale2
                        : (double)fm_e8m0_to_f32(s[c0 / blk]);
        int64_t end = c0 + blk < m->cols ? c0 + blk : m->cols;
        for (int64_t c = c0; c < end; c++) out[c] = (double)fm_e2m1_to_f32(nibble_at(p, c)) * bs;
    }
}

int64_t fm_qmatrix_bytes(const fm_qmatrix *m) {
    if (!m || m->rows <= 0 || m->cols <= 0) return 0;
    int64_t per_row;
    if (m->fmt == FM_QF_BF16) per_row = 2 * m->cols;
    else {
        int blk = fm_qformat_block(m->fmt);
        if (!blk) return 0;
        per_row = (m->cols + 1) / 2 + (m->cols + blk - 1) / blk;
    }
    return m->rows * per_row;
}
