/*
 * Scalar formats and NVFP4 / MXFP4 block quantization, checked against
 * references computed here from first principles: decoded values from
 * sign/exponent/mantissa fields with ldexp, encodings by brute-force search
 * for the nearest representable value (ties to the even code) over the
 * decoded tables.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <float.h>
#include <math.h>
#include <string.h>

#include "util/util.h"

/* ---------------------------------------------------------------- helpers */

static float bits_to_f32(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }
static uint32_t f32_to_bits(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }

/* Value of a sign/exponent/mantissa code with the given field widths and
 * bias, without special values (the caller handles NaN / inf codes). */
static double fields_value(unsigned code, int ebits, int mbits, int bias) {
    unsigned m = code & ((1u << mbits) - 1);
    unsigned e = (code >> mbits) & ((1u << ebits) - 1);
    int sign = (code >> (ebits + mbits)) & 1;
    double v = e == 0 ? ldexp((double)m, 1 - bias - mbits)
                      : ldexp(1.0 + ldexp((double)m, -mbits), (int)e - bias);
    return sign ? -v : v;
}

/* Nearest of the increasing positive table v[0..n-1] (index = code) to a >= 0,
 * ties to the even index. a beyond v[n-1] returns n-1 (caller saturates). */
static unsigned nearest_even(const double *v, unsigned n, double a) {
    if (a >= v[n - 1]) return n - 1;
    unsigned lo = 0, hi = n - 1; /* v[lo] <= a < v[hi] */
    while (hi - lo > 1) {
        unsigned mid = (lo + hi) / 2;
        if (v[mid] <= a) lo = mid;
        else hi = mid;
    }
    double dl = a - v[lo], dh = v[hi] - a;
    if (dl < dh) return lo;
    if (dh < dl) return hi;
    return (lo % 2 == 0) ? lo : hi;
}

static double e2m1_tab[8], e4m3_tab[0x7F], f16_tab[0x7C00], bf16_tab[0x7F80];

static int setup_tables(void **st) {
    (void)st;
    for (unsigned c = 0; c < 8; c++) e2m1_tab[c] = fields_value(c, 2, 1, 1);
    for (unsigned c = 0; c < 0x7F; c++) e4m3_tab[c] = fields_value(c, 4, 3, 7);
    for (unsigned c = 0; c < 0x7C00; c++) f16_tab[c] = fields_value(c, 5, 10, 15);
    for (unsigned c = 0; c < 0x7F80; c++) bf16_tab[c] = fields_value(c, 8, 7, 127);
    return 0;
}

static uint8_t ref_e2m1(float x) {
    if (isnan(x)) return 7;
    unsigned c = nearest_even(e2m1_tab, 8, fabs((double)x));
    return (uint8_t)((x < 0 ? 8 : 0) | c);
}
static uint8_t ref_e4m3(float x) {
    unsigned s = signbit(x) ? 0x80 : 0;
    if (isnan(x)) return (uint8_t)(s | 0x7F);
    return (uint8_t)(s | nearest_even(e4m3_tab, 0x7F, fabs((double)x)));
}
static uint16_t ref_f16(float x) {
    unsigned s = signbit(x) ? 0x8000 : 0;
    double a = fabs((double)x);
    if (a >= 65520.0) return (uint16_t)(s | 0x7C00);
    return (uint16_t)(s | nearest_even(f16_tab, 0x7C00, a));
}
static uint16_t ref_bf16(float x) {
    unsigned s = signbit(x) ? 0x8000 : 0;
    double a = fabs((double)x);
    if (a >= ldexp(2.0 - ldexp(1.0, -8), 127)) return (uint16_t)(s | 0x7F80);
    return (uint16_t)(s | nearest_even(bf16_tab, 0x7F80, a));
}

/* Random floats of every magnitude, plus values near format boundaries. */
static float rand_float(uint64_t i) {
    uint64_t r = fm_rng_u64(1234, 99, i);
    switch (r % 4) {
    case 0: return bits_to_f32((uint32_t)(r >> 32)); /* any bit pattern */
    case 1: return (float)ldexp(fm_rng_uniform(1, 2, i), (int)(r >> 40) % 40 - 30);
    case 2: return fm_rng_uniform(5, 6, i) * 500.0f;
    default: return fm_rng_uniform(7, 8, i) * 7.0f;
    }
}

/* ------------------------------------------------------------------ E2M1 */

static void test_e2m1_decode_all(void **st) {
    (void)st;
    for (unsigned c = 0; c < 16; c++) {
        double want = fields_value(c, 2, 1, 1);
        assert_true((double)fm_e2m1_to_f32((uint8_t)c) == want);
        assert_true(fm_e2m1_to_f32((uint8_t)(c | 0xF0)) == fm_e2m1_to_f32((uint8_t)c));
    }
    const float spec[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
    for (int c = 0; c < 8; c++) assert_true(fm_e2m1_to_f32((uint8_t)c) == spec[c]);
}

static void test_e2m1_encode(void **st) {
    (void)st;
    for (unsigned c = 0; c < 16; c++) {
        float v = fm_e2m1_to_f32((uint8_t)c);
        uint8_t want = (c == 8) ? 0 : (uint8_t)c; /* -0 encodes as +0 (x < 0 is false) */
        assert_int_equal(fm_f32_to_e2m1(v), want);
    }
    /* Midpoints go to the even code; one ulp off they go to the neighbour. */
    for (int c = 0; c < 7; c++) {
        float lo = (float)e2m1_tab[c], hi = (float)e2m1_tab[c + 1], mid = (lo + hi) / 2;
        int even = (c % 2 == 0) ? c : c + 1;
        assert_int_equal(fm_f32_to_e2m1(mid), even);
        assert_int_equal(fm_f32_to_e2m1(-mid), 8 | even);
        assert_int_equal(fm_f32_to_e2m1(nextafterf(mid, 0)), c);
        assert_int_equal(fm_f32_to_e2m1(nextafterf(mid, 10)), c + 1);
    }
    assert_int_equal(fm_f32_to_e2m1(0.25f), 0);
    assert_int_equal(fm_f32_to_e2m1(0.75f), 2);
    assert_int_equal(fm_f32_to_e2m1(2.5f), 4);
    assert_int_equal(fm_f32_to_e2m1(5.0f), 6);
    assert_int_equal(fm_f32_to_e2m1(100.0f), 7);
    assert_int_equal(fm_f32_to_e2m1(-INFINITY), 15);
    assert_int_equal(fm_f32_to_e2m1(INFINITY), 7);
    assert_int_equal(fm_f32_to_e2m1(NAN), 7);
    assert_int_equal(fm_f32_to_e2m1(-0.1f), 8);
    assert_int_equal(fm_f32_to_e2m1(-0.0f), 0);
    for (uint64_t i = 0; i < 200000; i++) {
        float x = rand_float(i);
        assert_int_equal(fm_f32_to_e2m1(x), ref_e2m1(x));
    }
}

/* ------------------------------------------------------------------ E4M3 */

static void test_e4m3_decode_all(void **st) {
    (void)st;
    for (unsigned c = 0; c < 256; c++) {
        float v = fm_e4m3_to_f32((uint8_t)c);
        if ((c & 0x7F) == 0x7F) {
            assert_true(isnan(v));
            continue;
        }
        assert_true((double)v == fields_value(c, 4, 3, 7));
        assert_int_equal(signbit(v) != 0, c >> 7);
    }
    assert_true(fm_e4m3_to_f32(0x7E) == 448.0f);
    assert_true(fm_e4m3_to_f32(0x01) == 0x1p-9f);
    assert_true(fm_e4m3_to_f32(0x08) == 0x1p-6f);
    assert_true(fm_e4m3_to_f32(0x38) == 1.0f);
}

static void test_e4m3_encode(void **st) {
    (void)st;
    for (unsigned c = 0; c < 256; c++) {
        if ((c & 0x7F) == 0x7F) continue;
        assert_int_equal(fm_f32_to_e4m3(fm_e4m3_to_f32((uint8_t)c)), c);
    }
    for (unsigned c = 0; c < 0x7E; c++) {
        float lo = (float)e4m3_tab[c], hi = (float)e4m3_tab[c + 1], mid = (lo + hi) / 2;
        unsigned even = (c % 2 == 0) ? c : c + 1;
        assert_int_equal(fm_f32_to_e4m3(mid), even);
        assert_int_equal(fm_f32_to_e4m3(-mid), 0x80 | even);
        assert_int_equal(fm_f32_to_e4m3(nextafterf(mid, 0)), c);
        assert_int_equal(fm_f32_to_e4m3(nextafterf(mid, 1000)), c + 1);
    }
    /* Saturation (ModelOpt clamps to 448 before the cast). */
    assert_int_equal(fm_f32_to_e4m3(449.0f), 0x7E);
    assert_int_equal(fm_f32_to_e4m3(464.0f), 0x7E);
    assert_int_equal(fm_f32_to_e4m3(1e30f), 0x7E);
    assert_int_equal(fm_f32_to_e4m3(-1e30f), 0xFE);
    assert_int_equal(fm_f32_to_e4m3(INFINITY), 0x7E);
    assert_int_equal(fm_f32_to_e4m3(-INFINITY), 0xFE);
    assert_int_equal(fm_f32_to_e4m3(NAN), 0x7F);
    assert_int_equal(fm_f32_to_e4m3(-NAN), 0xFF);
    assert_int_equal(fm_f32_to_e4m3(0x1p-11f), 0x00); /* below half the smallest subnormal */
    assert_int_equal(fm_f32_to_e4m3(0x1p-10f), 0x00); /* tie: to even (zero) */
    assert_int_equal(fm_f32_to_e4m3(0x3p-11f), 0x01); /* 0.75 * 2^-9: nearest is 2^-9 */
    assert_int_equal(fm_f32_to_e4m3(0x3p-10f), 0x02); /* 1.5 * 2^-9: tie, to even */
    assert_int_equal(fm_f32_to_e4m3(-0.0f), 0x80);
    for (uint64_t i = 0; i < 200000; i++) {
        float x = rand_float(i);
        assert_int_equal(fm_f32_to_e4m3(x), ref_e4m3(x));
    }
}

/* ------------------------------------------------------------------ E8M0 */

static void test_e8m0(void **st) {
    (void)st;
    for (int c = 0; c < 255; c++) {
        float v = fm_e8m0_to_f32((uint8_t)c);
        assert_true((double)v == ldexp(1.0, c - 127));
        assert_int_equal(fm_f32_to_e8m0_floor(v), c);
        if (c < 254) assert_int_equal(fm_f32_to_e8m0_floor(nextafterf(2.0f * v, 0)), c);
        if (c > 0) assert_int_equal(fm_f32_to_e8m0_floor(nextafterf(v, 0)), c - 1);
        assert_int_equal(fm_f32_to_e8m0_floor(v * 1.5f), c);
    }
    assert_true(isnan(fm_e8m0_to_f32(0xFF)));
    assert_int_equal(fm_f32_to_e8m0_floor(NAN), 0xFF);
    assert_int_equal(fm_f32_to_e8m0_floor(0.0f), 0);
    assert_int_equal(fm_f32_to_e8m0_floor(-3.0f), 0);
    assert_int_equal(fm_f32_to_e8m0_floor(1e-45f), 0);
    assert_int_equal(fm_f32_to_e8m0_floor(INFINITY), 0xFE);
    assert_int_equal(fm_f32_to_e8m0_floor(FLT_MAX), 0xFE);
    assert_int_equal(fm_f32_to_e8m0_floor(6.0f), 129);
}

/* ------------------------------------------------------------ BF16 / F16 */

static void test_bf16_all_codes(void **st) {
    (void)st;
    for (uint32_t c = 0; c < 65536; c++) {
        float v = fm_bf16_to_f32((uint16_t)c);
        unsigned mag = c & 0x7FFF;
        if (mag > 0x7F80) {
            assert_true(isnan(v));
            assert_true(isnan(fm_bf16_to_f32(fm_f32_to_bf16(v))));
            continue;
        }
        if (mag == 0x7F80) assert_true(isinf(v) && (signbit(v) != 0) == (c >> 15));
        else assert_true((double)v == fields_value(c, 8, 7, 127));
        assert_int_equal(fm_f32_to_bf16(v), c);
    }
}

static void test_f16_all_codes(void **st) {
    (void)st;
    for (uint32_t c = 0; c < 65536; c++) {
        float v = fm_f16_to_f32((uint16_t)c);
        unsigned mag = c & 0x7FFF;
        if (mag > 0x7C00) {
            assert_true(isnan(v));
            uint16_t back = fm_f32_to_f16(v);
            assert_true((back & 0x7FFF) > 0x7C00);
            continue;
        }
        if (mag == 0x7C00) assert_true(isinf(v) && (signbit(v) != 0) == (c >> 15));
        else assert_true((double)v == fields_value(c, 5, 10, 15));
        assert_int_equal(fm_f32_to_f16(v), c);
    }
}

static void test_rne_f32_to_16(void **st) {
    (void)st;
    /* BF16 keeps 7 mantissa bits: ulp(1) = 2^-7. */
    assert_int_equal(fm_f32_to_bf16(1.0f + 0x1p-8f), 0x3F80);               /* tie, even down */
    assert_int_equal(fm_f32_to_bf16(1.0f + 0x1p-7f + 0x1p-8f), 0x3F82);     /* tie, even up   */
    assert_int_equal(fm_f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3F81);    /* above tie      */
    assert_int_equal(fm_f32_to_bf16(FLT_MAX), 0x7F80);                      /* rounds to inf  */
    assert_int_equal(fm_f32_to_bf16(-0.0f), 0x8000);
    assert_int_equal(fm_f32_to_bf16(bits_to_f32(0x00000001)), 0x0000);      /* tiny to zero   */
    uint16_t qn = fm_f32_to_bf16(bits_to_f32(0x7F800001)); /* signalling NaN, payload in low bits */
    assert_true((qn & 0x7FFF) > 0x7F80);
    /* F16: 10 mantissa bits, max 65504, subnormals down to 2^-24. */
    assert_int_equal(fm_f32_to_f16(1.0f + 0x1p-11f), 0x3C00);
    assert_int_equal(fm_f32_to_f16(1.0f + 0x3p-11f), 0x3C02);
    assert_int_equal(fm_f32_to_f16(65504.0f), 0x7BFF);
    assert_int_equal(fm_f32_to_f16(65519.996f), 0x7BFF);
    assert_int_equal(fm_f32_to_f16(65520.0f), 0x7C00);
    assert_int_equal(fm_f32_to_f16(-1e10f), 0xFC00);
    assert_int_equal(fm_f32_to_f16(0x1p-24f), 0x0001);
    assert_int_equal(fm_f32_to_f16(0x1p-25f), 0x0000);                      /* tie to even 0  */
    assert_int_equal(fm_f32_to_f16(0x3p-26f), 0x0001);                      /* 0.75 ulp       */
    assert_int_equal(fm_f32_to_f16(0x3p-25f), 0x0002);                      /* 1.5 ulp: tie, even */
    assert_int_equal(fm_f32_to_f16(0x1p-14f - 0x1p-25f), 0x0400);           /* rounds to min normal */
    for (uint64_t i = 0; i < 300000; i++) {
        float x = rand_float(i);
        if (isnan(x)) {
            assert_true((fm_f32_to_f16(x) & 0x7FFF) > 0x7C00);
            assert_true((fm_f32_to_bf16(x) & 0x7FFF) > 0x7F80);
            continue;
        }
        assert_int_equal(fm_f32_to_f16(x), ref_f16(x));
        assert_int_equal(fm_f32_to_bf16(x), ref_bf16(x));
    }
    (void)f32_to_bits;
}

/* ---------------------------------------------------------------- qformat */

static void test_qformat_names(void **st) {
    (void)st;
    assert_string_equal(fm_qformat_name(FM_QF_NVFP4), "nvfp4");
    assert_string_equal(fm_qformat_name(FM_QF_MXFP4), "mxfp4");
    assert_string_equal(fm_qformat_name(FM_QF_BF16), "bf16");
    assert_int_equal(fm_qformat_from_name("nvfp4"), FM_QF_NVFP4);
    assert_int_equal(fm_qformat_from_name("MXFP4"), FM_QF_MXFP4);
    assert_int_equal(fm_qformat_from_name("bf16"), FM_QF_BF16);
    assert_int_equal(fm_qformat_from_name("fp8"), FM_QF_NONE);
    assert_int_equal(fm_qformat_from_name(NULL), FM_QF_NONE);
    assert_int_equal(fm_qformat_block(FM_QF_NVFP4), 16);
    assert_int_equal(fm_qformat_block(FM_QF_MXFP4), 32);
    assert_int_equal(fm_qformat_block(FM_QF_BF16), 0);
}

/* ----------------------------------------------------------- quantization */

static uint8_t nib(const uint8_t *p, int64_t i) {
    return (i & 1) ? (uint8_t)(p[i / 2] >> 4) : (uint8_t)(p[i / 2] & 15);
}

static void test_nvfp4_hand_worked(void **st) {
    (void)st;
    /* amax 2688 makes scale2 = 2688 / (6 * 448) = 1 exactly. */
    float w[80] = {0};
    w[0] = 2688.0f; w[1] = 1344.0f; w[2] = -672.0f; w[3] = 100.0f; /* block 0: scale 448 */
    w[16] = 6.0f; w[17] = 0.25f; w[18] = 0.75f; w[19] = -5.0f;    /* block 1: scale 1   */
    w[32] = 0.001f; w[33] = -0.0005f;                               /* block 2: 2^-9 clamp */
    w[48] = 6.375f; w[49] = 1.0f;          /* block 3: 6.375/6 = 1.0625, E4M3 tie -> 1.0 */
    uint8_t packed[40], scales[5];
    float s2 = -1;
    assert_int_equal(fm_quantize_nvfp4(w, 1, 80, packed, scales, &s2), FM_OK);
    assert_true(s2 == 1.0f);
    assert_int_equal(scales[0], 0x7E);
    assert_int_equal(scales[1], 0x38);
    assert_int_equal(scales[2], 0x01);
    assert_int_equal(scales[3], 0x38);
    assert_int_equal(scales[4], 0x38); /* all-zero block */
    const uint8_t want[80] = {[0] = 7, [1] = 5, [2] = 0xB, [3] = 0 /* 100/448 = 0.22 */,
                              [16] = 7, [17] = 0, [18] = 2, [19] = 0xE,
                              [32] = 1 /* 0.512 */, [33] = 9 /* -0.256 -> -0.5 */,
                              [48] = 7 /* 6.375 saturates */, [49] = 2};
    for (int i = 0; i < 80; i++) assert_int_equal(nib(packed, i), want[i]);
    fm_qmatrix m = {FM_QF_NVFP4, 1, 80, packed, 40, scales, 5, s2, NULL};
    float out[80];
    double out64[80];
    fm_qmatrix_dequant_row(&m, 0, out);
    fm_qmatrix_dequant_row_f64(&m, 0, out64);
    assert_true(out[0] == 2688.0f && out[1] == 1344.0f && out[2] == -672.0f && out[3] == 0.0f);
    assert_true(out[19] == -4.0f && out[32] == 0x1p-10f && out[48] == 6.0f);
    for (int i = 0; i < 80; i++) assert_true((double)out[i] == out64[i]);

    /* All-zero matrix: scale2 = 1, block scales 1.0, zero codes. */
    float z[32] = {0};
    assert_int_equal(fm_quantize_nvfp4(z, 2, 16, packed, scales, &s2), FM_OK);
    assert_true(s2 == 1.0f && scales[0] == 0x38 && scales[1] == 0x38);
    for (int i = 0; i < 16; i++) assert_int_equal(packed[i], 0);
    /* A general scale2: amax 1 -> scale2 = 1/2688 (float division). */
    float u[16] = {1.0f, 0.5f};
    assert_int_equal(fm_quantize_nvfp4(u, 1, 16, packed, scales, &s2), FM_OK);
    assert_true(s2 == 1.0f / 2688.0f);
    assert_int_equal(scales[0], 0x7E);
    assert_int_equal(nib(packed, 0), 7);
    assert_int_equal(nib(packed, 1), 5);
}

static void test_nvfp4_bad_input(void **st) {
    (void)st;
    float w[32] = {0};
    uint8_t p[16], s[2];
    float s2;
    assert_int_equal(fm_quantize_nvfp4(w, 1, 24, p, s, &s2), FM_E_ARG);
    assert_int_equal(fm_quantize_nvfp4(w, 1, 0, p, s, &s2), FM_E_ARG);
    w[5] = NAN;
    assert_int_equal(fm_quantize_nvfp4(w, 1, 32, p, s, &s2), FM_E_NUMERIC);
    assert_non_null(strstr(fm_last_error(), "non-finite"));
    w[5] = INFINITY;
    assert_int_equal(fm_quantize_nvfp4(w, 1, 32, p, s, &s2), FM_E_NUMERIC);
    w[5] = 1e-40f;
    assert_int_equal(fm_quantize_nvfp4(w, 1, 32, p, s, &s2), FM_E_RANGE);
    assert_int_equal(fm_quantize_mxfp4(w, 1, 16, p, s), FM_E_ARG);
    w[5] = NAN;
    assert_int_equal(fm_quantize_mxfp4(w, 1, 32, p, s), FM_E_NUMERIC);
}

static void test_mxfp4_hand_worked(void **st) {
    (void)st;
    float w[128] = {0};
    w[0] = 6.0f; w[1] = 5.0f; w[2] = -0.25f; w[3] = 0.75f;  /* amax 6: 2^(2-2) = 1        */
    w[32] = 7.9f; w[33] = -7.0f;                             /* amax 7.9: scale 1, saturate */
    w[64] = 8.0f; w[65] = 5.0f; w[66] = 1.0f;                /* amax 8: scale 2             */
    /* block 3 (96..127) all zero: smallest scale, code 0 */
    uint8_t packed[64], scales[4];
    assert_int_equal(fm_quantize_mxfp4(w, 1, 128, packed, scales), FM_OK);
    assert_int_equal(scales[0], 127);
    assert_int_equal(scales[1], 127);
    assert_int_equal(scales[2], 128);
    assert_int_equal(scales[3], 0);
    const uint8_t want[128] = {[0] = 7, [1] = 6, [2] = 8 /* -0.25 -> -0 */, [3] = 2,
                               [32] = 7, [33] = 15, [64] = 6, [65] = 4 /* 2.5 -> 2 */,
                               [66] = 1};
    for (int i = 0; i < 128; i++) assert_int_equal(nib(packed, i), want[i]);
    fm_qmatrix m = {FM_QF_MXFP4, 1, 128, packed, 64, scales, 4, 0.0f /* unused */, NULL};
    float out[128];
    fm_qmatrix_dequant_row(&m, 0, out);
    assert_true(out[0] == 6.0f && out[1] == 4.0f && out[32] == 6.0f && out[33] == -6.0f);
    assert_true(out[64] == 8.0f && out[65] == 4.0f && out[66] == 1.0f && out[100] == 0.0f);
    /* Tiny blocks: amax 1 -> 2^-2; scale codes clamp at 0 below 2^-125. */
    float t[32] = {1.0f, 0.1f};
    assert_int_equal(fm_quantize_mxfp4(t, 1, 32, packed, scales), FM_OK);
    assert_int_equal(scales[0], 125);
    assert_int_equal(nib(packed, 0), 6);
    assert_int_equal(nib(packed, 1), 1);
    t[0] = 1e-39f; t[1] = 0;
    assert_int_equal(fm_quantize_mxfp4(t, 1, 32, packed, scales), FM_OK);
    assert_int_equal(scales[0], 0);
    assert_int_equal(nib(packed, 0), 0); /* 1e-39 * 2^127 = 0.17 */
}

/* Random matrices: every scale and code equals the independent reference,
 * and the dequantized error is within the format's bound. */
static void test_nvfp4_random(void **st) {
    (void)st;
    enum { R = 13, C = 96 };
    static float w[R * C];
    uint8_t packed[R * C / 2], scales[R * C / 16];
    for (int trial = 0; trial < 4; trial++) {
        float amp = trial == 3 ? 1e-3f : (float)(trial + 1) * 0.7f;
        for (int i = 0; i < R * C; i++) {
            w[i] = fm_rng_normal(42 + (uint64_t)trial, 1, (uint64_t)i) * amp;
            if (i % 97 == 0) w[i] *= 50.0f; /* outliers */
            if (i / 16 == 7) w[i] = 0.0f;   /* an all-zero block */
        }
        float s2;
        assert_int_equal(fm_quantize_nvfp4(w, R, C, packed, scales, &s2), FM_OK);
        double amax = 0;
        for (int i = 0; i < R * C; i++) amax = fmax(amax, fabs((double)w[i]));
        assert_true(s2 == (float)amax / 2688.0f);
        fm_qmatrix m = {FM_QF_NVFP4, R, C, packed, C / 2, scales, C / 16, s2, NULL};
        double sq_err = 0, sq = 0;
        for (int r = 0; r < R; r++) {
            double out[C];
            fm_qmatrix_dequant_row_f64(&m, r, out);
            for (int b = 0; b < C / 16; b++) {
                const float *blk = w + r * C + b * 16;
                float bamax = 0;
                for (int i = 0; i < 16; i++) bamax = fmaxf(bamax, fabsf(blk[i]));
                float s = bamax / (6.0f * s2);
                if (s == 0) s = 1.0f;
                if (s < 0x1p-9f) s = 0x1p-9f;
                uint8_t sc = ref_e4m3(fminf(s, 448.0f));
                assert_int_equal(scales[r * (C / 16) + b], sc);
                float d = (float)e4m3_tab[sc] * s2;
                for (int i = 0; i < 16; i++) {
                    int64_t idx = (int64_t)r * C + b * 16 + i;
                    assert_int_equal(nib(packed, idx), ref_e2m1(blk[i] / d));
                    double err = fabs(out[b * 16 + i] - (double)blk[i]);
                    /* Half the widest gap (4..6), or the clip of a block whose
                     * maximum exceeds 6 after the E4M3 rounding of its scale. */
                    double allowed = fmax((double)d, fabs((double)blk[i]) - 6.0 * d);
                    assert_true(err <= allowed * (1 + 1e-6));
                    sq_err += err * err;
                    sq += (double)blk[i] * blk[i];
                }
            }
        }
        assert_true(sqrt(sq_err / sq) < 0.15);
    }
}

static void test_mxfp4_random(void **st) {
    (void)st;
    enum { R = 9, C = 128 };
    static float w[R * C];
    uint8_t packed[R * C / 2], scales[R * C / 32];
    for (int i = 0; i < R * C; i++)
        w[i] = fm_rng_normal(3, 4, (uint64_t)i) * (float)ldexp(1.0, i / 128 * 3 - 12);
    assert_int_equal(fm_quantize_mxfp4(w, R, C, packed, scales), FM_OK);
    fm_qmatrix m = {FM_QF_MXFP4, R, C, packed, C / 2, scales, C / 32, 1.0f, NULL};
    for (int r = 0; r < R; r++) {
        float out[C];
        fm_qmatrix_dequant_row(&m, r, out);
        for (int b = 0; b < C / 32; b++) {
            const float *blk = w + r * C + b * 32;
            double bamax = 0;
            for (int i = 0; i < 32; i++) bamax = fmax(bamax, fabs((double)blk[i]));
            int e = (int)floor(log2(bamax)) - 2;
            assert_int_equal(scales[r * 4 + b], e + 127);
            for (int i = 0; i < 32; i++) {
                float scaled = (float)ldexp((double)blk[i], -e);
                assert_int_equal(nib(packed, (int64_t)r * C + b * 32 + i), ref_e2m1(scaled));
                /* Worst case: the gap 4..6 (half 1) or saturation of [6, 8). */
                assert_true(fabs((double)out[b * 32 + i] - blk[i]) <= 2.0 * ldexp(1.0, e));
            }
        }
    }
}

static void test_dequant_strides_and_bf16(void **st) {
    (void)st;
    enum { R = 3, C = 32 };
    float w[R * C];
    for (int i = 0; i < R * C; i++) w[i] = fm_rng_uniform(9, 9, (uint64_t)i);
    uint8_t packed[R * C / 2], scales[R * C / 16];
    float s2;
    assert_int_equal(fm_quantize_nvfp4(w, R, C, packed, scales, &s2), FM_OK);
    /* The same matrix with padded rows. */
    uint8_t ppad[R * 40], spad[R * 5];
    memset(ppad, 0xEE, sizeof ppad);
    memset(spad, 0xEE, sizeof spad);
    for (int r = 0; r < R; r++) {
        memcpy(ppad + r * 40, packed + r * 16, 16);
        memcpy(spad + r * 5, scales + r * 2, 2);
    }
    fm_qmatrix a = {FM_QF_NVFP4, R, C, packed, 16, scales, 2, s2, NULL};
    fm_qmatrix b = {FM_QF_NVFP4, R, C, ppad, 40, spad, 5, s2, NULL};
    for (int r = 0; r < R; r++) {
        float oa[C], ob[C];
        fm_qmatrix_dequant_row(&a, r, oa);
        fm_qmatrix_dequant_row(&b, r, ob);
        assert_memory_equal(oa, ob, sizeof oa);
    }
    assert_int_equal(fm_qmatrix_bytes(&a), R * (C / 2 + C / 16));
    assert_int_equal(fm_qmatrix_bytes(&b), R * (C / 2 + C / 16)); /* padding is not read */

    /* BF16 rows with a stride of 70 bytes. */
    uint8_t bf[R * 70];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            uint16_t h = fm_f32_to_bf16(w[r * C + c]);
            memcpy(bf + r * 70 + 2 * c, &h, 2);
        }
    fm_qmatrix m = {FM_QF_BF16, R, C, bf, 70, NULL, 0, 0.0f, NULL};
    for (int r = 0; r < R; r++) {
        float o[C];
        double o64[C];
        fm_qmatrix_dequant_row(&m, r, o);
        fm_qmatrix_dequant_row_f64(&m, r, o64);
        for (int c = 0; c < C; c++) {
            assert_true(fabsf(o[c] - w[r * C + c]) <= fabsf(w[r * C + c]) * 0x1p-8f);
            assert_true((double)o[c] == o64[c]);
        }
    }
    assert_int_equal(fm_qmatrix_bytes(&m), R * C * 2);
    fm_qmatrix mx = {FM_QF_MXFP4, 4, 64, bf, 32, bf, 2, 1.0f, NULL};
    assert_int_equal(fm_qmatrix_bytes(&mx), 4 * (32 + 2));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_e2m1_decode_all),
        cmocka_unit_test(test_e2m1_encode),
        cmocka_unit_test(test_e4m3_decode_all),
        cmocka_unit_test(test_e4m3_encode),
        cmocka_unit_test(test_e8m0),
        cmocka_unit_test(test_bf16_all_codes),
        cmocka_unit_test(test_f16_all_codes),
        cmocka_unit_test(test_rne_f32_to_16),
        cmocka_unit_test(test_qformat_names),
        cmocka_unit_test(test_nvfp4_hand_worked),
        cmocka_unit_test(test_nvfp4_bad_input),
        cmocka_unit_test(test_mxfp4_hand_worked),
        cmocka_unit_test(test_nvfp4_random),
        cmocka_unit_test(test_mxfp4_random),
        cmocka_unit_test(test_dequant_strides_and_bf16),
    };
    return cmocka_run_group_tests(tests, setup_tables, NULL);
}
