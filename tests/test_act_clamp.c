/* DeepSeek-V4's clamped SiLU (swiglu_limit): the fast CPU engine and the
 * float64 reference both clamp, and the clamp changes the result when the
 * gate/up pre-activations exceed the limit. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>

#include "fm_test.h"
#include "fp4moe.h"

static void run(const fm_model_desc *d, const fm_moe_layer *l, const float *x, int T, float *out_fast, float *out_ref) {
    fm_cpu_engine *e = NULL;
    assert_int_equal(fm_cpu_engine_new(FM_CPU_AUTO, 1, &e), FM_OK);
    int32_t tok[8];
    for (int t = 0; t < T; t++) tok[t] = t;
    fm_moe_out of = {out_fast, NULL, NULL}, orf = {out_ref, NULL, NULL};
    assert_int_equal(fm_cpu_forward(e, d, l, x, FM_DT_F32, T, tok, &of), FM_OK);
    assert_int_equal(fm_moe_forward_ref(d, l, x, FM_DT_F32, T, tok, &orf), FM_OK);
    fm_cpu_engine_free(e);
}

static void test_dsv4_clamp(void **st) {
    (void)st;
    fm_model_desc d;
    assert_int_equal(fm_preset_desc("tiny-deepseek-v4", FM_QF_NVFP4, &d), FM_OK);
    assert_true(d.swiglu_limit > 0);
    /* A layer past the hash layers, so routing is by score. */
    int layer = d.n_hash_layers > d.first_dense ? d.n_hash_layers : d.first_dense;
    fm_moe_layer *l = NULL;
    assert_int_equal(fm_moe_layer_random(&d, FM_QF_NVFP4, 7, layer, &l), FM_OK);
    const int T = 4, H = d.hidden;
    float *x = malloc(sizeof(float) * T * H), *a = malloc(sizeof(float) * T * H), *b = malloc(sizeof(float) * T * H),
          *c = malloc(sizeof(float) * T * H), *r2 = malloc(sizeof(float) * T * H);
    /* Large activations push gate/up well past the limit. */
    for (int i = 0; i < T * H; i++) x[i] = 60.0f * (float)((i * 7919 % 1000) / 500.0 - 1.0);
    run(&d, l, x, T, a, b);
    assert_true(fm_test_rel_err(a, b, (size_t)T * H) < 1e-5);
    fm_model_desc u = d;
    u.swiglu_limit = 0.0f; /* unclamped */
    run(&u, l, x, T, c, r2);
    assert_true(fm_test_rel_err(c, r2, (size_t)T * H) < 1e-5);
    /* The clamp is active: clamped and unclamped results differ clearly. */
    assert_true(fm_test_rel_err(b, r2, (size_t)T * H) > 1e-2);
    free(x); free(a); free(b); free(c); free(r2);
    fm_moe_layer_free(l);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_dsv4_clamp)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
