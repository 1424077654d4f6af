/*
 * TP and EP through the real CPU engine and routers (the path of
 * `forward --device cpu --tp N / --ep N`): on tiny presets of every routing
 * family the sharded layer equals the unsharded one, and the float64
 * reference; compressed activations stay within the bounds of
 * docs/parallel.md.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fm_test.h"
#include "parallel/parallel_internal.h"
#include "util/util.h"

static fm_cpu_engine *g_eng;

typedef struct {
    const char *preset;
    fm_qformat fmt;
    int layer; /* -1: first MoE layer that is not hash-routed */
} layer_case;

/* Every family; DeepSeek-V4 once on a hash layer (token ids) and once on a
 * scored one; gpt-oss has expert biases (the down bias stays on TP rank 0). */
static const layer_case k_cases[] = {
    {"tiny-deepseek", FM_QF_NVFP4, -1},    {"tiny-deepseek", FM_QF_MXFP4, -1},
    {"tiny-deepseek-v4", FM_QF_MXFP4, 0},  {"tiny-deepseek-v4", FM_QF_NVFP4, -1},
    {"tiny-qwen3", FM_QF_NVFP4, -1},       {"tiny-qwen3", FM_QF_BF16, -1},
    {"tiny-mixtral", FM_QF_NVFP4, -1},     {"tiny-gptoss", FM_QF_MXFP4, -1},
    {"tiny-gptoss", FM_QF_NVFP4, -1},
};

typedef struct {
    fm_model_desc d;
    fm_moe_layer *l;
    int T;
    float *x, *ref, *rw;
    int32_t *rid, *tid;
} setup;

static void setup_case(const layer_case *c, int T, setup *s) {
    memset(s, 0, sizeof *s);
    assert_int_equal(fm_preset_desc(c->preset, c->fmt, &s->d), FM_OK);
    int layer = c->layer;
    if (layer < 0) {
        layer = s->d.first_dense > s->d.n_hash_layers ? s->d.first_dense : s->d.n_hash_layers;
        while (!fm_model_is_moe_layer(&s->d, layer)) layer++;
    }
    fm_status st = fm_moe_layer_random(&s->d, c->fmt, 4321, layer, &s->l);
    if (st) print_message("%s: %s\n", c->preset, fm_last_error());
    assert_int_equal(st, FM_OK);
    const int H = s->l->hidden, k = s->l->topk;
    s->T = T;
    s->x = fm_test_normal_new((size_t)T * H, 11, 12);
    if (s->l->tid2eid) {
        s->tid = malloc(sizeof(int32_t) * (size_t)T);
        for (int t = 0; t < T; t++) s->tid[t] = (int32_t)((t * 37 + 5) % s->l->tid2eid_rows);
    }
    s->ref = malloc(sizeof(float) * (size_t)T * H);
    s->rid = malloc(sizeof(int32_t) * (size_t)T * k);
    s->rw = malloc(sizeof(float) * (size_t)T * k);
    fm_moe_out o = {.out = s->ref, .topk_ids = s->rid, .topk_weights = s->rw};
    st = fm_cpu_forward(g_eng, &s->d, s->l, s->x, FM_DT_F32, T, s->tid, &o);
    if (st) print_message("%s: %s\n", c->preset, fm_last_error());
    assert_int_equal(st, FM_OK);
}

static void free_setup(setup *s) {
    fm_moe_layer_free(s->l);
    free(s->x);
    free(s->ref);
    free(s->rid);
    free(s->rw);
    free(s->tid);
}

static int expect_refusal(const fm_moe_layer *l, fm_dist_mode mode, int R) {
    const int g = fm_qformat_block(l->fmt) > 0 ? fm_qformat_block(l->fmt) : 1;
    if (mode == FM_DIST_EP) return l->n_experts % R != 0;
    return l->inter % R || (l->inter / R) % g ||
           (l->has_shared && (l->shared_inter % R || (l->shared_inter / R) % g));
}

/* Runs one sharded forward; returns rel err vs s->ref, or -1 if refused. */
static double run(const setup *s, fm_dist_mode mode, int R, fm_dist_layout lay, fm_compress cz, fm_dist_stats *st) {
    const int H = s->l->hidden, k = s->l->topk, T = s->T;
    fm_dist_opts o = {.mode = mode, .ranks = R, .layout = lay, .compress = cz};
    fm_comm *c;
    fm_dist *ds;
    assert_int_equal(fm_comm_sim_new(R, &c), FM_OK);
    fm_status rc = fm_dist_new_cpu(&s->d, s->l, &o, c, g_eng, &ds);
    if (expect_refusal(s->l, mode, R)) {
        assert_int_equal(rc, FM_E_ARG);
        fm_comm_free(c);
        return -1;
    }
    if (rc) print_message("%s\n", fm_last_error());
    assert_int_equal(rc, FM_OK);
    float *out = malloc(sizeof(float) * (size_t)T * H);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)T * k);
    float *w = malloc(sizeof(float) * (size_t)T * k);
    for (size_t i = 0; i < (size_t)T * H; i++) out[i] = NAN;
    fm_moe_out mo = {.out = out, .topk_ids = ids, .topk_weights = w};
    rc = fm_dist_forward(ds, s->x, FM_DT_F32, T, s->tid, &mo, st);
    if (rc) print_message("%s%d %s: %s\n", fm_dist_mode_name(mode), R, fm_dist_layout_name(lay), fm_last_error());
    assert_int_equal(rc, FM_OK);
    /* routing is replicated and exact: same ids and weights as unsharded */
    assert_memory_equal(ids, s->rid, sizeof(int32_t) * (size_t)T * k);
    assert_memory_equal(w, s->rw, sizeof(float) * (size_t)T * k);
    double e = fm_test_rel_err(out, s->ref, (size_t)T * H);
    free(out);
    free(ids);
    free(w);
    fm_dist_free(ds);
    fm_comm_free(c);
    return e;
}

static void test_engine_sharded_equals_unsharded(void **state) {
    (void)state;
    int ran = 0, refused = 0;
    double worst = 0;
    for (size_t ci = 0; ci < sizeof k_cases / sizeof *k_cases; ci++) {
        for (int T = 1; T <= 7; T += 6) {
            setup s;
            setup_case(&k_cases[ci], T, &s);
            for (int lay = 0; lay < 2; lay++) {
                for (int R = 1; R <= 8; R *= 2) {
                    for (int mode = FM_DIST_TP; mode <= FM_DIST_EP; mode++) {
                        if (mode == FM_DIST_TP && R > 4) continue;
                        double e = run(&s, (fm_dist_mode)mode, R, (fm_dist_layout)lay, FM_COMPRESS_NONE, NULL);
                        if (e < 0) {
                            refused++;
                            continue;
                        }
                        ran++;
                        if (e > worst) worst = e;
                        if (!(e <= 1e-5))
                            print_message("%s %s %s%d %s T=%d: rel err %.3g\n", k_cases[ci].preset,
                                          fm_qformat_name(k_cases[ci].fmt), fm_dist_mode_name((fm_dist_mode)mode), R,
                                          fm_dist_layout_name((fm_dist_layout)lay), T, e);
                        assert_true(e <= 1e-5);
                    }
                }
            }
            free_setup(&s);
        }
    }
    print_message("CPU engine: %d sharded runs equal the unsharded layer (worst rel err %.2g), %d refused as expected\n",
                  ran, worst, refused);
    assert_true(ran >= 150);
}

/* The sharded layer against the float64 reference directly. */
static void test_engine_against_reference(void **state) {
    (void)state;
    for (size_t ci = 0; ci < sizeof k_cases / sizeof *k_cases; ci++) {
        setup s;
        setup_case(&k_cases[ci], 5, &s);
        const int H = s.l->hidden;
        float *ref64 = malloc(sizeof(float) * (size_t)5 * H);
        fm_moe_out o = {.out = ref64};
        assert_int_equal(fm_moe_forward_ref(&s.d, s.l, s.x, FM_DT_F32, 5, s.tid, &o), FM_OK);
        memcpy(s.ref, ref64, sizeof(float) * (size_t)5 * H); /* compare against the reference now */
        assert_true(run(&s, FM_DIST_EP, 2, FM_DIST_TOKEN_SHARDED, FM_COMPRESS_NONE, NULL) <= 1e-5);
        assert_true(run(&s, FM_DIST_TP, 2, FM_DIST_REPLICATED, FM_COMPRESS_NONE, NULL) <= 1e-5);
        free(ref64);
        free_setup(&s);
    }
}

/* The accuracy cost of sending activations in FP8 / NVFP4, and the bytes it
 * saves. Bounds (docs/parallel.md): FP8 <= 0.06, NVFP4 <= 0.25 relative
 * (L2) error of the layer output; measured figures are printed. */
static void test_engine_compression_cost(void **state) {
    (void)state;
    const int T = 32;
    print_message("%-18s %-6s %-4s %10s %10s %12s\n", "preset", "weights", "mode", "fp8 err", "nvfp4 err",
                  "activation bytes f32/fp8/nvfp4");
    for (size_t ci = 0; ci < sizeof k_cases / sizeof *k_cases; ci++) {
        if (k_cases[ci].fmt == FM_QF_BF16) continue;
        setup s;
        setup_case(&k_cases[ci], T, &s);
        for (int mode = FM_DIST_TP; mode <= FM_DIST_EP; mode++) {
            fm_dist_stats s0, s1, s2;
            double e0 = run(&s, (fm_dist_mode)mode, 2, FM_DIST_TOKEN_SHARDED, FM_COMPRESS_NONE, &s0);
            double e1 = run(&s, (fm_dist_mode)mode, 2, FM_DIST_TOKEN_SHARDED, FM_COMPRESS_FP8, &s1);
            double e2 = run(&s, (fm_dist_mode)mode, 2, FM_DIST_TOKEN_SHARDED, FM_COMPRESS_NVFP4, &s2);
            print_message("%-18s %-6s %-4s %10.4f %10.4f %6lld/%lld/%lld\n", k_cases[ci].preset,
                          fm_qformat_name(k_cases[ci].fmt), fm_dist_mode_name((fm_dist_mode)mode), e1, e2,
                          (long long)s0.act_bytes, (long long)s1.act_bytes, (long long)s2.act_bytes);
            assert_true(e0 >= 0 && e0 <= 1e-5);
            assert_true(e1 > 0 && e1 <= 0.06);
            assert_true(e2 > e1 && e2 <= 0.25);
            assert_true(s2.act_bytes < s1.act_bytes && s1.act_bytes < s0.act_bytes);
            assert_true(s2.comm_bytes < s1.comm_bytes && s1.comm_bytes < s0.comm_bytes);
        }
        free_setup(&s);
    }
}

/* BF16 activations in: sharded equals unsharded on the same input. */
static void test_engine_bf16_input(void **state) {
    (void)state;
    setup s;
    setup_case(&k_cases[0], 6, &s);
    const int H = s.l->hidden, T = 6;
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)T * H);
    for (size_t i = 0; i < (size_t)T * H; i++) xb[i] = fm_f32_to_bf16(s.x[i]);
    fm_moe_out o = {.out = s.ref, .topk_ids = s.rid, .topk_weights = s.rw};
    assert_int_equal(fm_cpu_forward(g_eng, &s.d, s.l, xb, FM_DT_BF16, T, NULL, &o), FM_OK);
    for (int lay = 0; lay < 2; lay++) {
        fm_dist_opts op = {.mode = FM_DIST_EP, .ranks = 4, .layout = (fm_dist_layout)lay};
        fm_comm *c;
        fm_dist *ds;
        assert_int_equal(fm_comm_sim_new(4, &c), FM_OK);
        assert_int_equal(fm_dist_new_cpu(&s.d, s.l, &op, c, g_eng, &ds), FM_OK);
        float *out = malloc(sizeof(float) * (size_t)T * H);
        fm_moe_out mo = {.out = out};
        assert_int_equal(fm_dist_forward(ds, xb, FM_DT_BF16, T, NULL, &mo, NULL), FM_OK);
        assert_true(fm_test_rel_err(out, s.ref, (size_t)T * H) <= 1e-5);
        free(out);
        fm_dist_free(ds);
        fm_comm_free(c);
    }
    free(xb);
    free_setup(&s);
}

static void test_engine_bench_runs(void **state) {
    (void)state;
    setup s;
    setup_case(&k_cases[4], 1, &s);
    fm_dist_opts op = {.mode = FM_DIST_TP, .ranks = 2};
    fm_comm *c;
    fm_dist *ds;
    assert_int_equal(fm_comm_sim_new(2, &c), FM_OK);
    assert_int_equal(fm_dist_new_cpu(&s.d, s.l, &op, c, g_eng, &ds), FM_OK);
    fm_dist_bench_result r;
    assert_int_equal(fm_dist_bench(ds, 4, 1, 3, &r), FM_OK);
    assert_int_equal(r.ranks, 2);
    assert_true(r.us_rank[0] > 0 && r.us_rank[1] > 0 && r.us_single > 0);
    assert_true(r.us_total >= r.us_rank[0] && r.us_total >= r.us_rank[1]);
    assert_true(fabs(r.efficiency - r.speedup / 2) < 1e-12);
    assert_true(r.comm_bytes == (int64_t)4 * s.l->hidden * (int64_t)sizeof(float));
    assert_int_equal(fm_dist_bench(ds, 0, 1, 3, &r), FM_E_RANGE);
    fm_dist_free(ds);
    fm_comm_free(c);
    free_setup(&s);
}

/* fm_dist_run: the one call `forward` makes; device/transport choices. */
static void test_engine_run_entry(void **state) {
    (void)state;
    setup s;
    setup_case(&k_cases[6], 5, &s); /* mixtral, E=8 */
    const int H = s.l->hidden, T = 5;
    float *out = malloc(sizeof(float) * (size_t)T * H);
    fm_moe_out mo = {.out = out};
    fm_dist_opts o = {.mode = FM_DIST_EP, .ranks = 8, .layout = FM_DIST_TOKEN_SHARDED};
    fm_dist_stats st;
    assert_int_equal(fm_dist_run(&o, FM_DEV_CPU, 0, g_eng, &s.d, s.l, s.x, FM_DT_F32, T, NULL, &mo, &st), FM_OK);
    assert_true(fm_test_rel_err(out, s.ref, (size_t)T * H) <= 1e-5);
    assert_int_equal(st.ranks, 8);
    /* MPI ranks are GPU processes; the simulation has none */
    assert_int_equal(fm_dist_run(&o, FM_DEV_CPU, 1, g_eng, &s.d, s.l, s.x, FM_DT_F32, T, NULL, &mo, NULL), FM_E_ARG);
    assert_int_equal(fm_dist_run(&o, FM_DEV_CPU, 0, NULL, &s.d, s.l, s.x, FM_DT_F32, T, NULL, &mo, NULL), FM_E_ARG);
    o.ranks = 3; /* refused before any transport is opened */
    assert_int_equal(fm_dist_run(&o, FM_DEV_CUDA, 0, NULL, &s.d, s.l, s.x, FM_DT_F32, T, NULL, &mo, NULL), FM_E_ARG);
    assert_non_null(strstr(fm_last_error(), "E=8 experts are not divisible by 3"));
#ifndef FM_HAVE_CUDA
    o.ranks = 2;
    assert_int_equal(fm_dist_run(&o, FM_DEV_CUDA, 0, NULL, &s.d, s.l, s.x, FM_DT_F32, T, NULL, &mo, NULL),
                     FM_E_UNSUPPORTED);
    assert_non_null(strstr(fm_last_error(), "CUDA"));
#endif
    free(out);
    free_setup(&s);
}

static int grp_setup(void **state) {
    (void)state;
    return fm_cpu_engine_new(FM_CPU_AUTO, 1, &g_eng) == FM_OK ? 0 : -1;
}
static int grp_teardown(void **state) {
    (void)state;
    fm_cpu_engine_free(g_eng);
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_engine_sharded_equals_unsharded),
        cmocka_unit_test(test_engine_against_reference),
        cmocka_unit_test(test_engine_compression_cost),
        cmocka_unit_test(test_engine_bf16_input),
        cmocka_unit_test(test_engine_bench_runs),
        cmocka_unit_test(test_engine_run_entry),
    };
    return cmocka_run_group_tests(tests, grp_setup, grp_teardown);
}
