/*
 * fm_cpu_experts, the experts of a layer on tokens the caller has routed:
 *   - against the float64 reference (fm_moe_forward_ref) with the ids and
 *     weights its routing gave, on every tiny preset and format, within the
 *     CPU tests' tolerance, and bitwise equal to fm_cpu_forward (routing +
 *     the same experts path);
 *   - ids < 0 drop exactly their terms: a float64 sum written here from the
 *     dequantized weights, with and without the shared expert;
 *   - bad ids, non-finite weights, T < 1, NULL arguments, phase times.
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

typedef struct {
    fm_model_desc d;
    fm_moe_layer *l;
} tl;

static void tl_make(tl *t, const char *preset, fm_qformat f, int layer) {
    assert_int_equal(fm_preset_desc(preset, f, &t->d), FM_OK);
    if (layer < 0)
        for (layer = 0; !fm_model_is_moe_layer(&t->d, layer); layer++) {}
    assert_int_equal(fm_moe_layer_random(&t->d, f, 91, layer, &t->l), FM_OK);
}

static fm_cpu_engine *engine(void) {
    fm_cpu_engine *e = NULL;
    assert_int_equal(fm_cpu_engine_new(FM_CPU_AUTO, 2, &e), FM_OK);
    return e;
}

/* The reference's routing, then the experts on it: equal to the reference
 * within tolerance and to fm_cpu_forward bit for bit. */
static void test_against_reference(void **state) {
    (void)state;
    fm_cpu_engine *e = engine();
    int cases = 0;
    for (size_t p = 0; p < sizeof cpu_check_presets / sizeof *cpu_check_presets; p++)
        for (size_t f = 0; f < sizeof cpu_check_formats / sizeof *cpu_check_formats; f++) {
            tl t;
            tl_make(&t, cpu_check_presets[p], cpu_check_formats[f], -1);
            const int64_t H = t.d.hidden;
            const int k = t.d.topk;
            static const int Ts[] = {1, 7};
            for (int ti = 0; ti < 2; ti++) {
                const int T = Ts[ti];
                const fm_dtype dt = (p + f + ti) % 2 ? FM_DT_BF16 : FM_DT_F32;
                void *x = cpu_check_input(T, H, dt, 40 + p + f);
                float *ref = malloc(sizeof(float) * T * H), *out = malloc(sizeof(float) * T * H);
                float *fwd = malloc(sizeof(float) * T * H), *w = malloc(sizeof(float) * T * k);
                int32_t *ids = malloc(sizeof(int32_t) * T * k), *tok = malloc(sizeof(int32_t) * T);
                for (int i = 0; i < T; i++) tok[i] = (int32_t)(fm_rng_u64(5, 6, (uint64_t)i) % (uint64_t)t.d.vocab_size);
                fm_moe_out ro = {ref, ids, w}, fo = {fwd, NULL, NULL};
                assert_int_equal(fm_moe_forward_ref(&t.d, t.l, x, dt, T, tok, &ro), FM_OK);
                fm_status st = fm_cpu_experts(e, &t.d, t.l, x, dt, T, ids, w, 1, out);
                if (st) print_message("%s\n", fm_last_error());
                assert_int_equal(st, FM_OK);
                const double rel = cpu_check_rel(out, ref, T, H);
                if (!(rel <= CPU_CHECK_TOL))
                    print_message("%s/%s T=%d: relative error %.3g\n", cpu_check_presets[p],
                                  fm_qformat_name(cpu_check_formats[f]), T, rel);
                assert_true(rel <= CPU_CHECK_TOL);
                assert_int_equal(fm_cpu_forward(e, &t.d, t.l, x, dt, T, tok, &fo), FM_OK);
                assert_memory_equal(out, fwd, sizeof(float) * T * H);
                cases++;
                free(x); free(ref); free(out); free(fwd); free(w); free(ids); free(tok);
            }
            fm_moe_layer_free(t.l);
        }
    assert_int_equal(cases, 30);
    fm_cpu_engine_free(e);
}

/* ------------------------------------------- the float64 sum of this test */

static double act64(const fm_model_desc *d, double g, double u) {
    const double lim = d->swiglu_limit;
    if (d->act == FM_ACT_GPTOSS) {
        g = g > lim ? lim : g;
        u = u > lim ? lim : u < -lim ? -lim : u;
        return g / (1.0 + exp(-(double)d->swiglu_alpha * g)) * (u + 1.0);
    }
    if (lim > 0) {
        g = g > lim ? lim : g;
        u = u > lim ? lim : u < -lim ? -lim : u;
    }
    return g / (1.0 + exp(-g)) * u;
}

/* y[H] += w * down(act(gate x, up x)) for one token, from dequantized rows. */
static void expert64(const fm_model_desc *d, const fm_qmatrix *G, const fm_qmatrix *U, const fm_qmatrix *D,
                     const float *x, double w, double *y) {
    const int64_t I = G->rows, H = G->cols;
    double *row = malloc(sizeof(double) * (size_t)(H > I ? H : I)), *h = malloc(sizeof(double) * (size_t)I);
    for (int64_t i = 0; i < I; i++) {
        double g = G->bias ? G->bias[i] : 0.0, u = U->bias ? U->bias[i] : 0.0;
        fm_qmatrix_dequant_row_f64(G, i, row);
        for (int64_t c = 0; c < H; c++) g += row[c] * x[c];
        fm_qmatrix_dequant_row_f64(U, i, row);
        for (int64_t c = 0; c < H; c++) u += row[c] * x[c];
        h[i] = act64(d, g, u);
    }
    for (int64_t o = 0; o < H; o++) {
        double a = D->bias ? D->bias[o] : 0.0;
        fm_qmatrix_dequant_row_f64(D, o, row);
        for (int64_t i = 0; i < I; i++) a += row[i] * h[i];
        y[o] += w * a;
    }
    free(row);
    free(h);
}

/* Slots with negative ids (-1 and others) are left out of the sum and
 * nothing else changes; a token with no slot left gets only the shared
 * expert (or exact zeros). */
static void test_negative_ids_drop_terms(void **state) {
    (void)state;
    static const struct {
        const char *preset;
        fm_qformat f;
    } cases[] = {{"tiny-deepseek", FM_QF_NVFP4}, {"tiny-gptoss", FM_QF_MXFP4}, {"tiny-qwen3", FM_QF_BF16}};
    fm_cpu_engine *e = engine();
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
        tl t;
        tl_make(&t, cases[ci].preset, cases[ci].f, -1);
        enum { T = 6 };
        const int64_t H = t.d.hidden;
        const int k = t.d.topk;
        float *x = cpu_check_input(T, H, FM_DT_F32, 8 + ci), *out = malloc(sizeof(float) * T * H);
        float *w = malloc(sizeof(float) * T * k), *want = malloc(sizeof(float) * T * H);
        int32_t *ids = malloc(sizeof(int32_t) * T * k);
        double *acc = malloc(sizeof(double) * H);
        assert_int_equal(fm_route(&t.d, t.l, x, T, NULL, ids, w), FM_OK);
        for (int q = 0; q < T * k; q++)
            if (q % 3 == 1 || q / k == 2) ids[q] = q % 2 ? -1 : -7; /* token 2 loses every slot */
        for (int shared = 0; shared < 2; shared++) {
            for (int tt = 0; tt < T; tt++) {
                memset(acc, 0, sizeof(double) * H);
                for (int j = 0; j < k; j++) {
                    const int id = ids[tt * k + j];
                    if (id >= 0)
                        expert64(&t.d, &t.l->gate[id], &t.l->up[id], &t.l->down[id], x + tt * H, w[tt * k + j], acc);
                }
                if (shared && t.l->has_shared) expert64(&t.d, &t.l->sh_gate, &t.l->sh_up, &t.l->sh_down, x + tt * H, 1.0, acc);
                for (int64_t c = 0; c < H; c++) want[tt * H + c] = (float)acc[c];
            }
            assert_int_equal(fm_cpu_experts(e, &t.d, t.l, x, FM_DT_F32, T, ids, w, shared, out), FM_OK);
            const double rel = cpu_check_rel(out, want, T, H);
            if (!(rel <= CPU_CHECK_TOL)) print_message("%s shared=%d: relative error %.3g\n", cases[ci].preset, shared, rel);
            assert_true(rel <= CPU_CHECK_TOL);
            if (!(shared && t.l->has_shared))
                for (int64_t c = 0; c < H; c++) assert_true(out[2 * H + c] == 0.0f);
        }
        free(x); free(out); free(w); free(want); free(ids); free(acc);
        fm_moe_layer_free(t.l);
    }
    fm_cpu_engine_free(e);
}

static void test_bad_inputs(void **state) {
    (void)state;
    fm_cpu_engine *e = engine();
    tl t;
    tl_make(&t, "tiny-deepseek", FM_QF_NVFP4, -1);
    enum { T = 3 };
    const int64_t H = t.d.hidden;
    const int k = t.d.topk, E = t.d.n_experts;
    float *x = cpu_check_input(T, H, FM_DT_F32, 3), *out = malloc(sizeof(float) * T * H);
    float *w = malloc(sizeof(float) * T * k), *out2 = malloc(sizeof(float) * T * H);
    int32_t *ids = malloc(sizeof(int32_t) * T * k);
    assert_int_equal(fm_route(&t.d, t.l, x, T, NULL, ids, w), FM_OK);
    assert_int_equal(fm_cpu_experts(e, &t.d, t.l, x, FM_DT_F32, T, ids, w, 1, out), FM_OK);

    int32_t keep = ids[1 * k + 2];
    ids[1 * k + 2] = E;
    assert_int_equal(fm_cpu_experts(e, &t.d, t.l, x, FM_DT_F32, T, ids, w, 1, out), FM_E_RANGE);
    assert_non_null(strstr(fm_last_error(), "token 1, slot 2"));
    assert_non_null(strstr(fm_last_error(), "expert id 16"));
    ids[1 * k + 2] = keep;

    const float nonfinite[2] = {NAN, INFINITY};
    for (int i = 0; i < 2; i++) {
        float kw = w[1];
        w[1] = nonfinite[i];
        assert_int_equal(fm_cpu_experts(e, &t.d, t.l, x, FM_DT_F32, T, ids, w, 1, out), FM_E_NUMERIC);
        assert_non_null(strstr(fm_last_error(), "token 0, slot 1"));
        w[1] = kw;
    }
    assert_int_equal(fm_cpu_experts(e, &t.d, t.l, x, FM_DT_F32, 0, ids, w, 1, out), FM_E_RANGE);
    assert_non_null(strstr(fm_last_error(), "T=0"));
    assert_int_equal(fm_cpu_experts(e, &t.d, t.l, x, FM_DT_F32, -2, ids, w, 1, out), FM_E_RANGE);
    assert_int_equal(fm_cpu_experts(NULL, &t.d, t.l, x, FM_DT_F32, T, ids, w, 1, out), FM_E_ARG);
    assert_int_equal(fm_cpu_experts(e, &t.d, t.l, x, FM_DT_F32, T, ids, w, 1, NULL), FM_E_ARG);
    assert_int_equal(fm_cpu_experts(e, &t.d, t.l, NULL, FM_DT_F32, T, ids, w, 1, out), FM_E_ARG);
    assert_int_equal(fm_cpu_experts(e, &t.d, t.l, x, FM_DT_F32, T, NULL, w, 1, out), FM_E_ARG);
    assert_int_equal(fm_cpu_experts(e, &t.d, t.l, x, FM_DT_F32, T, ids, NULL, 1, out), FM_E_ARG);
    assert_int_equal(fm_cpu_experts(e, NULL, t.l, x, FM_DT_F32, T, ids, w, 1, out), FM_E_ARG);
    assert_int_equal(fm_cpu_experts(e, &t.d, NULL, x, FM_DT_F32, T, ids, w, 1, out), FM_E_ARG);
    assert_int_equal(fm_cpu_experts(e, &t.d, t.l, x, FM_DT_I32, T, ids, w, 1, out), FM_E_ARG);
    fm_model_desc d2 = t.d;
    d2.topk = k + 1;
    assert_int_equal(fm_cpu_experts(e, &d2, t.l, x, FM_DT_F32, T, ids, w, 1, out), FM_E_ARG);
    assert_non_null(strstr(fm_last_error(), "does not match the model description"));
    x[H + 5] = NAN;
    assert_int_equal(fm_cpu_experts(e, &t.d, t.l, x, FM_DT_F32, T, ids, w, 1, out), FM_E_NUMERIC);
    assert_non_null(strstr(fm_last_error(), "token 1, feature 5"));
    x[H + 5] = 0.5f;

    /* The router is not needed: a layer without one runs the experts (and
     * only them). */
    assert_int_equal(fm_cpu_experts(e, &t.d, t.l, x, FM_DT_F32, T, ids, w, 1, out), FM_OK);
    fm_moe_layer nr = *t.l;
    nr.router_w = NULL;
    assert_int_equal(fm_cpu_experts(e, &t.d, &nr, x, FM_DT_F32, T, ids, w, 1, out2), FM_OK);
    assert_memory_equal(out, out2, sizeof(float) * T * H);
    fm_moe_out mo = {out2, NULL, NULL};
    assert_int_equal(fm_cpu_forward(e, &t.d, &nr, x, FM_DT_F32, T, NULL, &mo), FM_E_ARG);
    assert_non_null(strstr(fm_last_error(), "no router weight"));

    /* Phase times: one call, no routing time. */
    fm_phase_times pt;
    memset(&pt, 0, sizeof pt);
    fm_cpu_engine_set_phase_times(e, &pt);
    assert_int_equal(fm_cpu_experts(e, &t.d, t.l, x, FM_DT_F32, T, ids, w, 0, out), FM_OK);
    fm_cpu_engine_set_phase_times(e, NULL);
    assert_int_equal(pt.calls, 1);
    assert_true(pt.ns[FM_PH_ROUTE] == 0.0);

    free(x); free(out); free(out2); free(w); free(ids);
    fm_moe_layer_free(t.l);
    fm_cpu_engine_free(e);
}

int main(void) {
    (void)cpu_check_all; /* the header's full sweep is test_cpu's */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_against_reference),
        cmocka_unit_test(test_negative_ids_drop_terms),
        cmocka_unit_test(test_bad_inputs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
