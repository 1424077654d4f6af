/*
 * Pieces shared by the AVX2 and AVX-512 kernels (both files are compiled
 * with at least AVX2 + FMA): the 8-lane horizontal sum and the activation
 * on vectors of eight rows.
 */
#ifndef FM_CPU_KERN_AVX_ACT_H
#define FM_CPU_KERN_AVX_ACT_H
#include <immintrin.h>
#include <math.h>

#include "cpu/kern.h"

#define INL static inline __attribute__((always_inline))

INL float hsum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* ---- activation, eight rows at a time
 *
 * A libm expf call per (row, token) cost 7 % of the gate/up time at
 * H = 2048 (the call also spills the decode constants), so the activation
 * runs on vectors of eight rows. Lanes are independent: a row's value does
 * not depend on which rows share its vector. */

/* e^x, Cephes' single-precision polynomial (about 1 ulp) with the range of
 * expf: +inf above 88.7228, and below -87.34 the clamped e^-87.34 or 0,
 * either of which vanishes next to the 1 it is added to below. NaN passes
 * through (min and max return their second operand when either is NaN). */
INL __m256 exp8(__m256 x0) {
    __m256 x = _mm256_min_ps(_mm256_set1_ps(88.72283905206835f), _mm256_max_ps(_mm256_set1_ps(-87.3365447504f), x0));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    /* n is in [-126, 128]: y * 2^(n-1) * 2, 2^(n-1) built in the exponent
     * field (n = -126 gives 0) */
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(126)), 23);
    y = _mm256_mul_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), _mm256_set1_ps(2.0f));
    const __m256 over = _mm256_cmp_ps(x0, _mm256_set1_ps(88.72283905206835f), _CMP_GT_OQ);
    return _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), over);
}

/* fm_cpu_act on eight lanes, the same formulas in the same order. */
INL __m256 act8(fm_act_kind act, __m256 g, __m256 u, float alpha, float limit) {
    const __m256 one = _mm256_set1_ps(1.0f);
    if (act == FM_ACT_GPTOSS || limit > 0.0f) {
        const __m256 lim = _mm256_set1_ps(limit);
        g = _mm256_min_ps(lim, g);
        u = _mm256_max_ps(_mm256_set1_ps(-limit), _mm256_min_ps(lim, u));
    }
    if (act == FM_ACT_GPTOSS) {
        __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(-alpha), g));
        return _mm256_mul_ps(_mm256_mul_ps(g, _mm256_div_ps(one, _mm256_add_ps(one, e))), _mm256_add_ps(u, one));
    }
    __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u);
}

#endif
