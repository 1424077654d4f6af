/* The tuning sweep's selection rules, with a scripted measuring backend in
 * place of the GPU: a candidate must pass the reference check to win, must
 * be measurably faster than the default (separated measurements, a minimum
 * gain) on two separate measurements, and the resulting file is written
 * atomically, merged with earlier buckets and found by fm_tune_choose. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fm_test.h"
#include "tune/tune_internal.h"
#include "util/util.h"

/* What the fake GPU does for candidate i (index in fm_tune_candidates). */
typedef struct {
    double med, spread;  /* min = med - spread/2, max = med + spread/2    */
    double lo, hi;       /* either > 0: min = med - lo, max = med + hi     */
    double remeasure;    /* >0: the second and later benches return this */
    double err;          /* relative error against the reference          */
    int ids_differ;
    int bench_fails;
} script;

typedef struct {
    fm_tune_key key;
    script s[FM_TUNE_GRID_MAX];
    int n_bench[FM_TUNE_GRID_MAX], n_check[FM_TUNE_GRID_MAX];
    int bad_spread; /* the default reports min > median */
} fake;

static int index_of(fake *f, const fm_kernel_config *c, int T) {
    fm_kernel_config v[FM_TUNE_GRID_MAX];
    int n = fm_tune_candidates(&f->key, T, v, FM_TUNE_GRID_MAX);
    for (int i = 0; i < n; i++)
        if (!memcmp(&v[i], c, sizeof *c)) return i;
    fail_msg("the sweep measured a config that is not a candidate");
    return -1;
}

static fm_status fake_bench(void *ctx, const fm_kernel_config *c, int T, double *med, double *mn, double *mx) {
    fake *f = ctx;
    int i = index_of(f, c, T);
    const script *s = &f->s[i];
    f->n_bench[i]++;
    if (s->bench_fails) return fm_error(FM_E_ARG, "config not supported for this shape");
    double m = s->remeasure > 0 && f->n_bench[i] > 1 ? s->remeasure : s->med;
    *med = m;
    *mn = m - s->spread / 2;
    *mx = m + s->spread / 2;
    if (s->lo > 0 || s->hi > 0) {
        *mn = m - s->lo;
        *mx = m + s->hi;
    }
    if (i == 0 && f->bad_spread) *mn = m + 1;
    return FM_OK;
}

static fm_status fake_check(void *ctx, const fm_kernel_config *c, int T, double *err, int *ids) {
    fake *f = ctx;
    int i = index_of(f, c, T);
    f->n_check[i]++;
    *err = f->s[i].err;
    *ids = !f->s[i].ids_differ;
    return FM_OK;
}

typedef struct {
    char root[128];
    fake f;
    fm_tune_backend be;
    fm_tune_opts o;
} ctx_t;

static int setup(void **state) {
    ctx_t *c = calloc(1, sizeof *c);
    if (!c) return -1;
    if (fm_test_mkdtemp(c->root, sizeof c->root, "tune_sweep")) return -1;
    fm_tune_key *k = &c->f.key;
    snprintf(k->gpu_name, sizeof k->gpu_name, "Fake GPU");
    k->sm_count = 10;
    k->cuda_version = 13000;
    k->driver_version = 13000;
    k->fmt = FM_QF_NVFP4;
    k->E = 256;
    k->H = 4096;
    k->I = 2048;
    k->k = 6;
    /* Everything is slower than the default and exact unless a test says. */
    for (int i = 0; i < FM_TUNE_GRID_MAX; i++) c->f.s[i] = (script){.med = 150 + i, .spread = 1, .err = 1e-4};
    c->f.s[0] = (script){.med = 100, .spread = 1, .err = 1e-4};
    c->be = (fm_tune_backend){.ctx = &c->f, .bench = fake_bench, .check = fake_check};
    c->o = (fm_tune_opts){.budget_s = 60, .tolerance = 5e-3, .min_gain = 0.01};
    setenv("FP4MOE_CONFIG_DIR", c->root, 1);
    setenv("FP4MOE_SHIPPED_CONFIGS", "/nonexistent", 1);
    setenv("XDG_CACHE_HOME", "/nonexistent", 1);
    fm_tune_cache_clear();
    *state = c;
    return 0;
}

static int teardown(void **state) {
    ctx_t *c = *state;
    fm_test_rm_tree(c->root);
    free(c);
    fm_tune_cache_clear();
    return 0;
}

/* One sweep of one bucket (no file path wanted); it must succeed. */
static void sweep1(ctx_t *c, int T, fm_tune_bucket_result *r) {
    const int b[] = {T};
    assert_int_equal(fm_tune_sweep(&c->f.key, &c->be, b, 1, &c->o, c->root, NULL, 0, r), FM_OK);
}

static fm_kernel_config cand(ctx_t *c, int T, int i) {
    fm_kernel_config v[FM_TUNE_GRID_MAX];
    int n = fm_tune_candidates(&c->f.key, T, v, FM_TUNE_GRID_MAX);
    assert_true(i < n);
    return v[i];
}

static void read_back(ctx_t *c, fm_tune_file *f) {
    char name[256], path[512], msg[512];
    fm_tune_key_filename(&c->f.key, name, sizeof name);
    snprintf(path, sizeof path, "%s/%s", c->root, name);
    assert_int_equal(fm_tune_load_cached(path, f, msg, sizeof msg), 1);
}

static void test_winner_must_pass_check(void **state) {
    ctx_t *c = *state;
    c->f.s[1] = (script){.med = 80, .spread = 1, .err = 2e-2};             /* fastest, wrong */
    c->f.s[2] = (script){.med = 85, .spread = 1, .err = 1e-4, .ids_differ = 1}; /* wrong routing */
    c->f.s[3] = (script){.med = 95, .spread = 1, .err = 1e-3};             /* the winner */
    c->f.s[4] = (script){.med = 96, .spread = 1, .err = 1e-3};
    const int T[] = {16};
    fm_tune_bucket_result r;
    char path[512];
    assert_int_equal(fm_tune_sweep(&c->f.key, &c->be, T, 1, &c->o, c->root, path, sizeof path, &r), FM_OK);
    assert_int_equal(r.replaced_default, 1);
    fm_kernel_config w = cand(c, 16, 3);
    assert_memory_equal(&r.cfg, &w, sizeof w);
    assert_true(r.us == 95 && r.default_us == 100);
    assert_true(r.n_rejected >= 2);
    assert_true(c->f.n_check[0] >= 1); /* the default is checked too */
    assert_true(c->f.n_check[1] == 1 && c->f.n_check[2] == 1 && c->f.n_check[3] == 1);
    assert_int_equal(c->f.n_check[4], 0); /* slower than the lead: never needs a check */
    assert_int_equal(c->f.n_bench[3], 2);  /* measured again before it may win */

    fm_tune_file f;
    read_back(c, &f);
    assert_int_equal(f.n, 1);
    assert_int_equal(f.b[0].batch, 16);
    assert_memory_equal(&f.b[0].cfg, &w, sizeof w);
    fm_kernel_config def = cand(c, 16, 0);
    assert_int_equal(f.b[0].has_default_cfg, 1);
    assert_memory_equal(&f.b[0].default_cfg, &def, sizeof def);
    assert_string_equal(f.b[0].version, FM_VERSION);
    assert_int_equal((int)strlen(f.b[0].date), 20);
    assert_string_equal(f.key.gpu_name, "Fake GPU");
    assert_non_null(strstr(path, "Fake_GPU-10sm-nvfp4-E256-H4096-I2048-k6.json"));

    /* And the lookup uses it. */
    fm_tune_choice ch;
    assert_int_equal(fm_tune_choose(&c->f.key, 16, &ch), FM_OK);
    assert_int_equal(ch.tuned, 1);
    assert_memory_equal(&ch.cfg, &w, sizeof w);
}

static void test_within_spread_keeps_default(void **state) {
    ctx_t *c = *state;
    c->f.s[0] = (script){.med = 100, .spread = 10, .err = 1e-4};
    c->f.s[1] = (script){.med = 97, .spread = 1, .err = 1e-4}; /* inside the default's [95, 105] */
    fm_tune_bucket_result r;
    sweep1(c, 4, &r);
    assert_int_equal(r.replaced_default, 0);
    fm_kernel_config def = cand(c, 4, 0);
    assert_memory_equal(&r.cfg, &def, sizeof def);
    assert_true(r.us == 100 && r.default_us == 100);
}

/* Separated measurements win even where the default's slowest replay is far
 * out (the H200 figures that the spread rule rejected, docs/perf.md); a
 * candidate whose own slow replays reach the default's median does not. */
static void test_separation(void **state) {
    ctx_t *c = *state;
    c->f.s[0] = (script){.med = 68.25, .lo = 0.78, .hi = 1.25, .err = 1e-4};
    c->f.s[1] = (script){.med = 66.73, .lo = 0.38, .hi = 0.47, .err = 1e-4};
    fm_tune_bucket_result r;
    sweep1(c, 2, &r);
    assert_int_equal(r.replaced_default, 1);
    fm_kernel_config w = cand(c, 2, 1);
    assert_memory_equal(&r.cfg, &w, sizeof w);
    assert_true(r.us == 66.73 && r.default_us == 68.25);
    /* the same median with a slow tail past the default's median */
    c->f.s[1].hi = 1.6;
    sweep1(c, 2, &r);
    assert_int_equal(r.replaced_default, 0);
    /* a median inside the default's range */
    c->f.s[1] = (script){.med = 67.6, .lo = 0.1, .hi = 0.1, .err = 1e-4};
    sweep1(c, 2, &r);
    assert_int_equal(r.replaced_default, 0);
}

static void test_min_gain(void **state) {
    ctx_t *c = *state;
    c->f.s[0] = (script){.med = 100, .spread = 0.1, .err = 1e-4};
    c->f.s[1] = (script){.med = 99.5, .spread = 0.1, .err = 1e-4}; /* separated, below 1 % */
    fm_tune_bucket_result r;
    sweep1(c, 1, &r);
    assert_int_equal(r.replaced_default, 0);
    c->o.min_gain = 0.001;
    sweep1(c, 1, &r);
    assert_int_equal(r.replaced_default, 1);
}

static void test_winners_curse(void **state) {
    ctx_t *c = *state;
    c->f.s[2] = (script){.med = 90, .spread = 1, .err = 1e-4, .remeasure = 100.5};
    fm_tune_bucket_result r;
    sweep1(c, 64, &r);
    assert_int_equal(r.replaced_default, 0);
    assert_int_equal(c->f.n_bench[2], 2);
}

static void test_bench_failure_skipped(void **state) {
    ctx_t *c = *state;
    c->f.s[1].bench_fails = 1;
    c->f.s[2] = (script){.med = 50, .spread = 1, .err = 1e-4};
    fm_tune_bucket_result r;
    sweep1(c, 8, &r);
    assert_int_equal(r.replaced_default, 1);
    assert_true(r.us == 50);
    assert_true(r.n_rejected >= 1);
}

static void test_default_must_pass(void **state) {
    ctx_t *c = *state;
    c->f.s[0].err = 1.0;
    const int T[] = {1, 2};
    assert_int_equal(fm_tune_sweep(&c->f.key, &c->be, T, 2, &c->o, c->root, NULL, 0, NULL), FM_E_NUMERIC);
    assert_non_null(strstr(fm_last_error(), "the default config"));
    fm_tune_file f;
    char name[256], path[512], msg[256];
    fm_tune_key_filename(&c->f.key, name, sizeof name);
    snprintf(path, sizeof path, "%s/%s", c->root, name);
    assert_int_equal(fm_tune_load_cached(path, &f, msg, sizeof msg), 0); /* no file written */
    c->f.s[0].err = 1e-4;
    c->f.bad_spread = 1;
    assert_int_equal(fm_tune_sweep(&c->f.key, &c->be, T, 2, &c->o, c->root, NULL, 0, NULL), FM_E_NUMERIC);
    assert_int_equal(fm_tune_load_cached(path, &f, msg, sizeof msg), 0);
}

static void test_budget_zero(void **state) {
    ctx_t *c = *state;
    c->f.s[1] = (script){.med = 10, .spread = 1, .err = 1e-4}; /* would win, but is never reached */
    c->o.budget_s = 0;
    const int T[] = {1, 2, 4};
    fm_tune_bucket_result r[3];
    assert_int_equal(fm_tune_sweep(&c->f.key, &c->be, T, 3, &c->o, c->root, NULL, 0, r), FM_OK);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(r[i].replaced_default, 0);
        assert_int_equal(r[i].n_tried, 0);
    }
    assert_int_equal(c->f.n_bench[1], 0);
}

static void test_max_candidates(void **state) {
    ctx_t *c = *state;
    c->f.s[3] = (script){.med = 10, .spread = 1, .err = 1e-4};
    c->o.max_candidates = 2; /* candidates 1 and 2 only */
    fm_tune_bucket_result r;
    sweep1(c, 1, &r);
    assert_int_equal(r.n_tried, 2);
    assert_int_equal(r.replaced_default, 0);
}

static void test_merge_and_replace(void **state) {
    ctx_t *c = *state;
    char name[256], path[512];
    fm_tune_key_filename(&c->f.key, name, sizeof name);
    snprintf(path, sizeof path, "%s/%s", c->root, name);
    assert_int_equal(fm_write_file_atomic(path, "not json", 8), FM_OK); /* replaced */
    const int T1[] = {1, 16}, T2[] = {4, 16};
    assert_int_equal(fm_tune_sweep(&c->f.key, &c->be, T1, 2, &c->o, c->root, NULL, 0, NULL), FM_OK);
    c->f.s[0].med = 90; /* a later run with other figures */
    assert_int_equal(fm_tune_sweep(&c->f.key, &c->be, T2, 2, &c->o, c->root, NULL, 0, NULL), FM_OK);
    fm_tune_file f;
    read_back(c, &f);
    assert_int_equal(f.n, 3);
    assert_int_equal(f.b[0].batch, 1);
    assert_int_equal(f.b[1].batch, 4);
    assert_int_equal(f.b[2].batch, 16);
    assert_true(f.b[0].default_us == 100); /* kept from the first run */
    assert_true(f.b[2].default_us == 90);  /* replaced by the second */
    /* Another SM count in the file at this path: replaced, not merged. */
    fm_tune_key k2 = c->f.key;
    k2.sm_count = 11;
    fm_tune_file g = f;
    g.key = k2;
    char *s = fm_tune_file_to_json(&g);
    assert_non_null(s);
    assert_int_equal(fm_write_file_atomic(path, s, strlen(s)), FM_OK);
    free(s);
    const int T3[] = {2};
    assert_int_equal(fm_tune_sweep(&c->f.key, &c->be, T3, 1, &c->o, c->root, NULL, 0, NULL), FM_OK);
    read_back(c, &f);
    assert_int_equal(f.n, 1);
    assert_int_equal(f.key.sm_count, 10);
}

static void test_bad_args(void **state) {
    ctx_t *c = *state;
    const int dup[] = {4, 4}, zero[] = {0};
    assert_int_equal(fm_tune_sweep(&c->f.key, &c->be, dup, 2, &c->o, c->root, NULL, 0, NULL), FM_E_ARG);
    assert_int_equal(fm_tune_sweep(&c->f.key, &c->be, zero, 1, &c->o, c->root, NULL, 0, NULL), FM_E_RANGE);
    assert_int_equal(fm_tune_sweep(&c->f.key, &c->be, dup, 0, &c->o, c->root, NULL, 0, NULL), FM_E_ARG);
    char bad[200];
    snprintf(bad, sizeof bad, "%s/file", c->root);
    assert_int_equal(fm_write_file_atomic(bad, "x", 1), FM_OK);
    snprintf(bad, sizeof bad, "%s/file/sub", c->root);
    const int T[] = {1};
    assert_int_equal(fm_tune_sweep(&c->f.key, &c->be, T, 1, &c->o, bad, NULL, 0, NULL), FM_E_IO);
}

/* Without a GPU, the CUDA backend says so clearly. */
static void test_cuda_backend_without_gpu(void **state) {
    (void)state;
    char why[256];
    if (fm_cuda_available(why, sizeof why)) skip();
    fm_model_desc d;
    assert_int_equal(fm_preset_desc("tiny-qwen3", FM_QF_NVFP4, &d), FM_OK);
    fm_tune_cuda *t = (fm_tune_cuda *)1;
    assert_int_equal(fm_tune_cuda_new(&d, FM_QF_NVFP4, 2, 1, &t), FM_E_UNSUPPORTED);
    assert_null(t);
    assert_non_null(strstr(fm_last_error(), "no CUDA GPU"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_winner_must_pass_check, setup, teardown),
        cmocka_unit_test_setup_teardown(test_within_spread_keeps_default, setup, teardown),
        cmocka_unit_test_setup_teardown(test_separation, setup, teardown),
        cmocka_unit_test_setup_teardown(test_min_gain, setup, teardown),
        cmocka_unit_test_setup_teardown(test_winners_curse, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bench_failure_skipped, setup, teardown),
        cmocka_unit_test_setup_teardown(test_default_must_pass, setup, teardown),
        cmocka_unit_test_setup_teardown(test_budget_zero, setup, teardown),
        cmocka_unit_test_setup_teardown(test_max_candidates, setup, teardown),
        cmocka_unit_test_setup_teardown(test_merge_and_replace, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_args, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cuda_backend_without_gpu, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
