/* The NVFP4 block scales' bits in the CUDA backend (src/cuda/fp4_bits.h),
 * checked on the host against the format library: the kernels' scale
 * conversion and the form the upload stores a block in. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <string.h>
#include <cmocka.h>

#include "fp4moe.h"
#include "cuda/fp4_bits.h"

/* The F16 pair the hardware conversion makes of two E4M3 bytes (lo, hi),
 * from the format library's values (exact: every E4M3 value is an F16
 * normal); a NaN code gives the F16 NaN nan16. */
static uint32_t f16_pair(unsigned lo, unsigned hi, uint16_t nan16) {
    const uint16_t a = (lo & 0x7F) == 0x7F ? nan16 : fm_f32_to_f16(fm_e4m3_to_f32((uint8_t)lo));
    const uint16_t b = (hi & 0x7F) == 0x7F ? nan16 : fm_f32_to_f16(fm_e4m3_to_f32((uint8_t)hi));
    return (uint32_t)a | (uint32_t)b << 16;
}

/* What one half of fm_nv_scale_bf16x2 must hold for code c: the scale times
 * 2^112 exactly, a NaN for the NaN code, 2^97 for zero (the upload gives a
 * zero scale zero nibbles). */
static void check_half(unsigned c, uint16_t bits) {
    const float got = fm_bf16_to_f32(bits);
    if (c == 0x7F) {
        assert_true(isnan(got));
    } else if (c == 0) {
        assert_true(got == ldexpf(1.0f, 97));
    } else {
        const float want = ldexpf(fm_e4m3_to_f32((uint8_t)c), 112);
        if (got != want) fail_msg("code 0x%02x: %g, want %g", c, (double)got, (double)want);
    }
}

/* Every pair of sign-free codes: each half is its own code's scale, whatever
 * the other half holds (no carry or borrow crosses them). */
static void test_scale_pairs(void **state) {
    (void)state;
    for (unsigned lo = 0; lo < 0x80; lo++)
        for (unsigned hi = 0; hi < 0x80; hi++) {
            const uint32_t y = fm_nv_scale_bf16x2(f16_pair(lo, hi, 0x7E00));
            check_half(lo, (uint16_t)y);
            check_half(hi, (uint16_t)(y >> 16));
        }
}

/* A NaN whose F16 mantissa has low bits set stays a NaN in its half (in the
 * high half its low bits reach the low half, which is then not checked: the
 * same weight row's output is NaN either way); in the low half it leaves the
 * high half alone. */
static void test_scale_nan_bits(void **state) {
    (void)state;
    for (unsigned c = 0; c < 0x80; c++) {
        const uint32_t y = fm_nv_scale_bf16x2(f16_pair(0x7F, c, 0x7FFF));
        assert_true(isnan(fm_bf16_to_f32((uint16_t)y)));
        check_half(c, (uint16_t)(y >> 16));
        assert_true(isnan(fm_bf16_to_f32((uint16_t)(fm_nv_scale_bf16x2(f16_pair(c, 0x7F, 0x7FFF)) >> 16))));
    }
}

/* The canonical block has the same 16 values, as the format library's
 * dequantizer reads them, for every scale code (NaN stays NaN) and no sign
 * bit in its scale; a zero scale leaves zero nibbles. Nibbles from a fixed
 * pseudo-random stream. */
static void dequant_block(uint8_t sc, const uint8_t *packed, float *out) {
    const fm_qmatrix q = {.fmt = FM_QF_NVFP4, .rows = 1, .cols = 16, .packed = packed, .row_stride = 8,
                          .scales = &sc, .scale_stride = 1, .scale2 = 1.0f};
    fm_qmatrix_dequant_row(&q, 0, out);
}
static void test_canon_block(void **state) {
    (void)state;
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (int round = 0; round < 8; round++)
        for (unsigned sc = 0; sc < 0x100; sc++) {
            uint8_t packed[8], canon[8];
            for (int i = 0; i < 8; i++) {
                x = x * 6364136223846793005ull + 1442695040888963407ull;
                packed[i] = (uint8_t)(x >> 56);
            }
            memcpy(canon, packed, 8);
            const uint8_t cs = fm_nv_canon_block((uint8_t)sc, canon);
            assert_true((cs & 0x80) == 0);
            float v0[16], v1[16];
            dequant_block((uint8_t)sc, packed, v0);
            dequant_block(cs, canon, v1);
            for (int i = 0; i < 16; i++) {
                if (isnan(v0[i])) {
                    assert_true(isnan(v1[i]));
                } else if (v0[i] != v1[i]) {
                    fail_msg("scale 0x%02x value %d: %g, canonical %g", sc, i, (double)v0[i], (double)v1[i]);
                }
            }
            if ((sc & 0x7F) == 0)
                for (int i = 0; i < 8; i++) assert_int_equal(canon[i], 0);
        }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scale_pairs),
        cmocka_unit_test(test_scale_nan_bits),
        cmocka_unit_test(test_canon_block),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
