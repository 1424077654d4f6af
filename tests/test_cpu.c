/*
 * The fast CPU engine: every kernel flavour against the float64 reference
 * (every routing family and expert format, F32/BF16/F16 inputs, relative
 * error <= 1e-5, identical top-k), batch/permutation/thread-count
 * invariance (bitwise), bad inputs, phase times, bench accounting.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tools/cpu_check.h"

static void check_isa(fm_cpu_isa isa) {
    fm_cpu_engine *e = NULL;
    fm_status st = fm_cpu_engine_new(isa, 2, &e);
    if (st == FM_E_UNSUPPORTED) {
        printf("SKIPPED: %s\n", fm_last_error());
        skip();
    }
    assert_int_equal(st, FM_OK);
    double worst = 0;
    int fails = cpu_check_all(e, &worst, 0, 1);
    printf("%s: worst relative error %.3g\n", fm_cpu_engine_describe(e), worst);
    fm_cpu_engine_free(e);
    assert_int_equal(fails, 0);
    assert_true(worst <= CPU_CHECK_TOL);
}

static void test_scalar_vs_ref(void **s) { (void)s; check_isa(FM_CPU_SCALAR); }
static void test_avx2_vs_ref(void **s) { (void)s; check_isa(FM_CPU_AVX2); }
static void test_avx512_vs_ref(void **s) { (void)s; check_isa(FM_CPU_AVX512); }

typedef struct {
    fm_model_desc d;
    fm_moe_layer *l;
} tl;

static void tl_make(tl *t, const char *preset, fm_qformat f, int layer) {
    assert_int_equal(fm_preset_desc(preset, f, &t->d), FM_OK);
    assert_int_equal(fm_moe_layer_random(&t->d, f, 77, layer, &t->l), FM_OK);
}

/* One token at a time, a permuted batch and another thread count give
 * bit-identical rows: a token's result never depends on the rest. */
static void test_batch_permutation_threads(void **s) {
    (void)s;
    enum { T = 13 };
    static const char *presets[] = {"tiny-deepseek", "tiny-gptoss"};
    for (int p = 0; p < 2; p++) {
        tl t;
        tl_make(&t, presets[p], FM_QF_NONE, 1);
        const int64_t H = t.d.hidden;
        const int k = t.d.topk;
        float *x = cpu_check_input(T, H, FM_DT_F32, 5), *xp = malloc(sizeof(float) * T * H);
        float *o = malloc(sizeof(float) * T * H), *op = malloc(sizeof(float) * T * H), *o1 = malloc(sizeof(float) * H);
        int32_t ids[T * 8], idp[T * 8];
        int perm[T];
        for (int i = 0; i < T; i++) perm[i] = (5 * i + 2) % T;
        for (int i = 0; i < T; i++) memcpy(xp + i * H, x + perm[i] * H, sizeof(float) * H);
        fm_cpu_engine *e = NULL, *e3 = NULL;
        assert_int_equal(fm_cpu_engine_new(FM_CPU_AUTO, 2, &e), FM_OK);
        assert_int_equal(fm_cpu_engine_new(FM_CPU_AUTO, 3, &e3), FM_OK);
        fm_moe_out mo = {o, ids, NULL}, mp = {op, idp, NULL}, m1 = {o1, NULL, NULL};
        assert_int_equal(fm_cpu_forward(e, &t.d, t.l, x, FM_DT_F32, T, NULL, &mo), FM_OK);
        assert_int_equal(fm_cpu_forward(e3, &t.d, t.l, xp, FM_DT_F32, T, NULL, &mp), FM_OK);
        for (int i = 0; i < T; i++) {
            assert_memory_equal(op + i * H, o + perm[i] * H, sizeof(float) * H);
            assert_memory_equal(idp + i * k, ids + perm[i] * k, sizeof(int32_t) * k);
            assert_int_equal(fm_cpu_forward(e, &t.d, t.l, x + i * H, FM_DT_F32, 1, NULL, &m1), FM_OK);
            assert_memory_equal(o1, o + i * H, sizeof(float) * H);
        }
        fm_cpu_engine_free(e);
        fm_cpu_engine_free(e3);
        fm_moe_layer_free(t.l);
        free(x); free(xp); free(o); free(op); free(o1);
    }
}

/* A wider layer (H 1024: one thread takes down items of 128 rows, three
 * threads items of 32; I 208: a scalar tail after three 64-element chunks),
 * 21 tokens on 16 experts so experts see odd and even token counts (pairs
 * plus a single per decode): against the float64 reference, and bit for
 * bit across thread counts and against each token alone. */
static void test_wide_layer_items(void **s) {
    (void)s;
    enum { T = 21 };
    static const fm_qformat fmts[] = {FM_QF_NVFP4, FM_QF_MXFP4, FM_QF_BF16};
    for (int fi = 0; fi < 3; fi++) {
        tl t;
        assert_int_equal(fm_preset_desc("tiny-qwen3", fmts[fi], &t.d), FM_OK);
        t.d.hidden = 1024;
        t.d.moe_inter = fmts[fi] == FM_QF_MXFP4 ? 224 : 208; /* whole MXFP4 blocks of 32 */
        assert_int_equal(fm_moe_layer_random(&t.d, fmts[fi], 31, 0, &t.l), FM_OK);
        const int64_t H = t.d.hidden;
        float *x = cpu_check_input(T, H, FM_DT_F32, 8);
        float *o1 = malloc(sizeof(float) * T * H), *o3 = malloc(sizeof(float) * T * H);
        float *oref = malloc(sizeof(float) * T * H), *one = malloc(sizeof(float) * H);
        fm_cpu_engine *e1 = NULL, *e3 = NULL;
        assert_int_equal(fm_cpu_engine_new(FM_CPU_AUTO, 1, &e1), FM_OK);
        assert_int_equal(fm_cpu_engine_new(FM_CPU_AUTO, 3, &e3), FM_OK);
        fm_moe_out m1 = {o1, NULL, NULL}, m3 = {o3, NULL, NULL}, mr = {oref, NULL, NULL}, mo = {one, NULL, NULL};
        assert_int_equal(fm_cpu_forward(e1, &t.d, t.l, x, FM_DT_F32, T, NULL, &m1), FM_OK);
        assert_int_equal(fm_cpu_forward(e3, &t.d, t.l, x, FM_DT_F32, T, NULL, &m3), FM_OK);
        assert_int_equal(fm_moe_forward_ref(&t.d, t.l, x, FM_DT_F32, T, NULL, &mr), FM_OK);
        assert_memory_equal(o1, o3, sizeof(float) * T * H);
        double rel = cpu_check_rel(o1, oref, T, H);
        printf("%s: H %lld: relative error %.3g vs float64\n", fm_qformat_name(fmts[fi]), (long long)H, rel);
        assert_true(rel <= CPU_CHECK_TOL);
        for (int i = 0; i < T; i += 5) {
            assert_int_equal(fm_cpu_forward(e3, &t.d, t.l, x + i * H, FM_DT_F32, 1, NULL, &mo), FM_OK);
            assert_memory_equal(one, o1 + i * H, sizeof(float) * H);
        }
        fm_cpu_engine_free(e1);
        fm_cpu_engine_free(e3);
        fm_moe_layer_free(t.l);
        free(x); free(o1); free(o3); free(oref); free(one);
    }
}

/* Activations far outside the usual range (inputs scaled up to 300x, so
 * gate values reach the region where e^-g overflows and the clamps of
 * gpt-oss and DeepSeek-V4 bite) against the float64 reference, for every
 * kernel flavour this CPU has: the vectorized activation of the AVX2
 * kernels must follow expf's range (inf, then g / inf = -0). */
static void test_activation_extremes(void **s) {
    (void)s;
    static const char *presets[] = {"tiny-qwen3", "tiny-gptoss", "tiny-deepseek-v4"};
    static const fm_cpu_isa isas[] = {FM_CPU_SCALAR, FM_CPU_AVX2, FM_CPU_AVX512};
    static const float gains[] = {30.0f, 300.0f};
    enum { T = 5 };
    for (size_t ii = 0; ii < sizeof isas / sizeof *isas; ii++) {
        fm_cpu_engine *e = NULL;
        if (fm_cpu_engine_new(isas[ii], 2, &e) == FM_E_UNSUPPORTED) continue;
        assert_non_null(e);
        for (int p = 0; p < 3; p++) {
            tl t;
            fm_model_desc d;
            assert_int_equal(fm_preset_desc(presets[p], FM_QF_NVFP4, &d), FM_OK);
            tl_make(&t, presets[p], FM_QF_NVFP4, d.n_layers - 1);
            const int64_t H = t.d.hidden;
            int32_t tok[T];
            for (int i = 0; i < T; i++) tok[i] = 3 * i + 1;
            float *x = cpu_check_input(T, H, FM_DT_F32, 21), *o = malloc(sizeof(float) * T * H),
                  *oref = malloc(sizeof(float) * T * H);
            for (size_t gi = 0; gi < sizeof gains / sizeof *gains; gi++) {
                for (int64_t i = 0; i < T * H; i++) x[i] *= gi ? gains[gi] / gains[gi - 1] : gains[0];
                fm_moe_out mo = {o, NULL, NULL}, mr = {oref, NULL, NULL};
                assert_int_equal(fm_cpu_forward(e, &t.d, t.l, x, FM_DT_F32, T, tok, &mo), FM_OK);
                assert_int_equal(fm_moe_forward_ref(&t.d, t.l, x, FM_DT_F32, T, tok, &mr), FM_OK);
                double rel = cpu_check_rel(o, oref, T, H);
                printf("%s %s x%g: relative error %.3g\n", fm_cpu_isa_name(isas[ii]), presets[p],
                       (double)gains[gi], rel);
                assert_true(rel <= CPU_CHECK_TOL);
            }
            fm_moe_layer_free(t.l);
            free(x); free(o); free(oref);
        }
        fm_cpu_engine_free(e);
    }
}

/* A NaN block scale (E4M3 0x7F) in every expert's gate rows reaches the
 * output through the activation of every kernel flavour (the vectorized
 * one included), and the call fails naming the output, as the reference
 * does. */
static void test_nan_scale(void **s) {
    (void)s;
    static const fm_cpu_isa isas[] = {FM_CPU_SCALAR, FM_CPU_AVX2, FM_CPU_AVX512};
    static const char *presets[] = {"tiny-qwen3", "tiny-gptoss"};
    for (int p = 0; p < 2; p++) {
        tl t;
        tl_make(&t, presets[p], FM_QF_NVFP4, 0);
        for (int e = 0; e < t.l->n_experts; e++) {
            fm_qmatrix *g = &t.l->gate[e];
            for (int64_t r = 0; r < g->rows; r++) ((uint8_t *)g->scales)[r * g->scale_stride] = 0x7F;
        }
        const int64_t H = t.d.hidden;
        float *x = cpu_check_input(2, H, FM_DT_F32, 4), *o = malloc(sizeof(float) * 2 * H);
        fm_moe_out mo = {o, NULL, NULL};
        assert_int_equal(fm_moe_forward_ref(&t.d, t.l, x, FM_DT_F32, 2, NULL, &mo), FM_E_NUMERIC);
        for (size_t ii = 0; ii < sizeof isas / sizeof *isas; ii++) {
            fm_cpu_engine *e = NULL;
            if (fm_cpu_engine_new(isas[ii], 2, &e) == FM_E_UNSUPPORTED) continue;
            assert_int_equal(fm_cpu_forward(e, &t.d, t.l, x, FM_DT_F32, 2, NULL, &mo), FM_E_NUMERIC);
            assert_non_null(strstr(fm_last_error(), "output token"));
            fm_cpu_engine_free(e);
        }
        fm_moe_layer_free(t.l);
        free(x);
        free(o);
    }
}

static void test_bad_inputs(void **s) {
    (void)s;
    tl t;
    tl_make(&t, "tiny-deepseek-v4", FM_QF_NVFP4, 0); /* a hash layer */
    const int64_t H = t.d.hidden;
    float *x = cpu_check_input(3, H, FM_DT_F32, 9), *o = malloc(sizeof(float) * 3 * H);
    int32_t tok[3] = {1, 2, 3};
    fm_moe_out mo = {o, NULL, NULL};
    fm_cpu_engine *e = NULL;
    assert_int_equal(fm_cpu_engine_new(FM_CPU_AUTO, 2, &e), FM_OK);
    assert_int_equal(fm_cpu_forward(e, &t.d, t.l, x, FM_DT_F32, 3, tok, &mo), FM_OK);

    assert_int_equal(fm_cpu_forward(e, &t.d, t.l, x, FM_DT_F32, 3, NULL, &mo), FM_E_ARG);
    assert_non_null(strstr(fm_last_error(), "token id"));
    assert_int_equal(fm_moe_forward_ref(&t.d, t.l, x, FM_DT_F32, 3, NULL, &mo), FM_E_ARG);

    x[2 * H + 5] = NAN;
    assert_int_equal(fm_cpu_forward(e, &t.d, t.l, x, FM_DT_F32, 3, tok, &mo), FM_E_NUMERIC);
    assert_non_null(strstr(fm_last_error(), "token 2, feature 5"));
    assert_int_equal(fm_moe_forward_ref(&t.d, t.l, x, FM_DT_F32, 3, tok, &mo), FM_E_NUMERIC);
    x[2 * H + 5] = INFINITY;
    assert_int_equal(fm_cpu_forward(e, &t.d, t.l, x, FM_DT_F32, 3, tok, &mo), FM_E_NUMERIC);
    x[2 * H + 5] = 0.0f;

    assert_int_equal(fm_cpu_forward(e, &t.d, t.l, x, FM_DT_I32, 3, tok, &mo), FM_E_ARG);
    assert_non_null(strstr(fm_last_error(), "F32, BF16 or F16"));
    assert_int_equal(fm_cpu_forward(e, &t.d, t.l, x, FM_DT_F32, -1, tok, &mo), FM_E_ARG);
    fm_moe_out bad = {NULL, NULL, NULL};
    assert_int_equal(fm_cpu_forward(e, &t.d, t.l, x, FM_DT_F32, 3, tok, &bad), FM_E_ARG);

    fm_model_desc d2 = t.d;
    d2.hidden *= 2;
    assert_int_equal(fm_cpu_forward(e, &d2, t.l, x, FM_DT_F32, 3, tok, &mo), FM_E_ARG);

    /* A matrix that does not match the layer is named. */
    t.l->up[3].cols -= 16;
    assert_int_equal(fm_cpu_forward(e, &t.d, t.l, x, FM_DT_F32, 3, tok, &mo), FM_E_FORMAT);
    assert_non_null(strstr(fm_last_error(), "expert 3 up_proj"));
    t.l->up[3].cols += 16;
    t.l->down[1].fmt = FM_QF_MXFP4;
    assert_int_equal(fm_moe_forward_ref(&t.d, t.l, x, FM_DT_F32, 3, tok, &mo), FM_E_FORMAT);
    assert_non_null(strstr(fm_last_error(), "expert 1 down_proj"));
    t.l->down[1].fmt = FM_QF_NVFP4;
    assert_int_equal(fm_cpu_forward(e, &t.d, t.l, x, FM_DT_F32, 3, tok, &mo), FM_OK);

    fm_cpu_engine *bad_e = NULL;
    assert_int_equal(fm_cpu_engine_new((fm_cpu_isa)99, 1, &bad_e), FM_E_ARG);
    assert_null(bad_e);
    fm_cpu_engine_free(e);
    fm_moe_layer_free(t.l);
    free(x);
    free(o);
}

static void test_phase_times(void **s) {
    (void)s;
    tl t;
    tl_make(&t, "tiny-qwen3", FM_QF_NVFP4, 1);
    float *x = cpu_check_input(4, t.d.hidden, FM_DT_F32, 3), *o = malloc(sizeof(float) * 4 * t.d.hidden);
    fm_moe_out mo = {o, NULL, NULL};
    fm_cpu_engine *e = NULL;
    assert_int_equal(fm_cpu_engine_new(FM_CPU_AUTO, 2, &e), FM_OK);
    fm_phase_times pt;
    memset(&pt, 0, sizeof pt);
    fm_cpu_engine_set_phase_times(e, &pt);
    for (int i = 0; i < 2; i++) assert_int_equal(fm_cpu_forward(e, &t.d, t.l, x, FM_DT_F32, 4, NULL, &mo), FM_OK);
    assert_int_equal(pt.calls, 2);
    assert_true(pt.ns[FM_PH_GATEUP] > 0 && pt.ns[FM_PH_DOWN] > 0 && pt.ns[FM_PH_ROUTE] > 0);
    assert_true(pt.fused_mask & (1u << FM_PH_ACT));
    assert_true(pt.fused_mask & (1u << FM_PH_COMBINE));
    fm_cpu_engine_set_phase_times(e, NULL);
    assert_int_equal(fm_cpu_forward(e, &t.d, t.l, x, FM_DT_F32, 4, NULL, &mo), FM_OK);
    assert_int_equal(pt.calls, 2);
    fm_cpu_engine_free(e);
    fm_moe_layer_free(t.l);
    free(x);
    free(o);
}

/* Bytes per layer = active experts x the per-expert size io computes
 * (fm_model_expert_bytes) + shared expert + router, and the counts are
 * within what routing allows. */
static void test_bench_accounting(void **s) {
    (void)s;
    static const char *presets[] = {"tiny-qwen3", "tiny-deepseek"};
    for (int p = 0; p < 2; p++) {
        fm_model_desc d;
        assert_int_equal(fm_preset_desc(presets[p], FM_QF_NVFP4, &d), FM_OK);
        fm_moe_layer *ls[2] = {NULL, NULL};
        for (int i = 0; i < 2; i++)
            assert_int_equal(fm_moe_layer_random(&d, FM_QF_NVFP4, 3, d.n_layers - 1 - i, &ls[i]), FM_OK);
        fm_cpu_engine *e = NULL;
        assert_int_equal(fm_cpu_engine_new(FM_CPU_AUTO, 2, &e), FM_OK);
        fm_cpu_bench_result r;
        const int T = 3;
        assert_int_equal(fm_cpu_bench(e, &d, ls, 2, T, 11, 0.0, NULL, NULL, &r), FM_OK);
        const double eb = (double)fm_model_expert_bytes(&d, FM_QF_NVFP4);
        const double shared = d.n_shared ? eb / d.moe_inter * d.shared_inter : 0;
        const double router = (double)d.n_experts * d.hidden * 4;
        assert_int_equal(r.T, T);
        assert_true(r.reps >= 3);
        assert_true(r.active_experts >= d.topk && r.active_experts <= T * d.topk);
        assert_true(fabs((double)r.bytes_per_layer - (r.active_experts * eb + shared + router)) <= 1.0);
        assert_true(r.us_min > 0 && r.us_min <= r.us_per_layer && r.us_per_layer <= r.us_max);
        assert_true(fabs(r.tokens_per_s - T / (r.us_per_layer * 1e-6)) <= 1e-6 * r.tokens_per_s);
        assert_true(strstr(r.kernel, "cpu/") != NULL);
        assert_int_equal(fm_cpu_bench(e, &d, ls, 0, T, 11, 0.0, NULL, NULL, &r), FM_E_ARG);
        fm_cpu_engine_free(e);
        for (int i = 0; i < 2; i++) fm_moe_layer_free(ls[i]);
    }
    fm_model_desc big;
    assert_int_equal(fm_preset_desc("qwen3-30b-a3b", FM_QF_NVFP4, &big), FM_OK);
    int n = fm_cpu_bench_default_layers(&big, FM_QF_NVFP4);
    assert_true(n >= 1 && n <= 16);
}

static void test_bandwidth_probe(void **s) {
    (void)s;
    double bw = fm_cpu_measure_bandwidth(4u << 20, 2);
    assert_true(bw > 1e6 && isfinite(bw));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scalar_vs_ref),
        cmocka_unit_test(test_avx2_vs_ref),
        cmocka_unit_test(test_avx512_vs_ref),
        cmocka_unit_test(test_batch_permutation_threads),
        cmocka_unit_test(test_wide_layer_items),
        cmocka_unit_test(test_activation_extremes),
        cmocka_unit_test(test_nan_scale),
        cmocka_unit_test(test_bad_inputs),
        cmocka_unit_test(test_phase_times),
        cmocka_unit_test(test_bench_accounting),
        cmocka_unit_test(test_bandwidth_probe),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
