/* The CUDA layers' table of kernel configs by batch (src/cuda/cfg_cache.h),
 * which the calls on caller-owned device memory read instead of looking the
 * tuned config up per call: checked on the host against the config lookup
 * itself (fm_tune_choose over a temporary tuned file, and the built-in
 * defaults) for every batch, with the lookups counted. The table must give
 * each batch exactly the lookup's answer, fill with a few lookups per
 * distinct answer, and make none afterwards: a table that looks up per call
 * fails the counts, and one that reads files fails once the file is gone. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cfg_cache.h"
#include "fm_test.h"
#include "tune/tune_internal.h"
#include "util/util.h"

typedef struct {
    fm_kernel_config cfg;
    int tuned, bucket;
    char source[512];
} entry;

typedef struct {
    fm_tune_key key;
    long calls;
} ctx;

/* The lookup the engine's table makes per batch: the tuned file's bucket or
 * the built-in default, and where it came from. */
static void lookup(const fm_tune_key *key, int T, entry *out) {
    fm_tune_choice ch;
    assert_int_equal(fm_tune_choose(key, T, &ch), FM_OK);
    out->cfg = ch.cfg;
    out->tuned = ch.tuned;
    out->bucket = ch.bucket;
    memcpy(out->source, ch.source, sizeof out->source);
}

static void resolve(void *p, int T, void *e) {
    ctx *c = p;
    c->calls++;
    lookup(&c->key, T, e);
}

static fm_tune_key h200_key(int E, int k) {
    fm_tune_key key;
    memset(&key, 0, sizeof key);
    snprintf(key.gpu_name, sizeof key.gpu_name, "NVIDIA H200");
    key.sm_count = 132;
    key.cuda_version = 13000;
    key.driver_version = 13000;
    key.fmt = FM_QF_NVFP4;
    key.E = E;
    key.H = 4096;
    key.I = 2048;
    key.k = k;
    return key;
}

/* Fills a table of cap batches, then checks every batch against a fresh
 * lookup; returns the lookups the fill made. */
static long fill_and_check(fm_cfg_cache *c, ctx *x, int cap) {
    assert_int_equal(fm_cfg_cache_fill(c, cap, sizeof(entry), 0, resolve, x), FM_OK);
    const long made = x->calls;
    assert_int_equal(c->resolves, made);
    for (int T = 1; T <= cap; T++) {
        const entry *got = fm_cfg_cache_get(c, T);
        assert_non_null(got);
        entry want;
        memset(&want, 0, sizeof want);
        lookup(&x->key, T, &want);
        if (memcmp(got, &want, sizeof want))
            fail_msg("batch %d: the table has bucket %d rows_per_block %d from %s, the lookup bucket %d "
                     "rows_per_block %d from %s", T, got->bucket, got->cfg.rows_per_block, got->source, want.bucket,
                     want.cfg.rows_per_block, want.source);
    }
    assert_null(fm_cfg_cache_get(c, 0));
    assert_null(fm_cfg_cache_get(c, cap + 1));
    assert_int_equal(x->calls, made); /* reading the table looked nothing up */
    return made;
}

static void write_tuned(const char *dir, const fm_tune_key *key, const int *batches, int n) {
    fm_tune_file f;
    memset(&f, 0, sizeof f);
    f.key = *key;
    for (int i = 0; i < n; i++) {
        fm_tune_bucket b;
        memset(&b, 0, sizeof b);
        b.batch = batches[i];
        b.cfg = fm_kernel_config_default_mma(key, batches[i]);
        b.cfg.rows_per_block = 16 * (i + 1); /* tells the buckets apart */
        b.cfg.k_split = 1;
        b.cfg.warps = i + 1 <= 8 ? i + 1 : 8;
        b.us = b.us_min = b.us_max = 10.0 * batches[i];
        b.default_us = b.default_us_min = b.default_us_max = 11.0 * batches[i];
        b.replaced_default = 1;
        snprintf(b.date, sizeof b.date, "2026-11-29T10:00:00Z");
        snprintf(b.version, sizeof b.version, "0.1.0");
        assert_int_equal(fm_tune_file_put(&f, &b), FM_OK);
    }
    char *text = fm_tune_file_to_json(&f);
    assert_non_null(text);
    char name[256], path[1024];
    assert_int_equal(fm_tune_key_filename(key, name, sizeof name), FM_OK);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    assert_int_equal(fm_write_file_atomic(path, text, strlen(text)), FM_OK);
    free(text);
}

static void test_tuned_file(void **state) {
    (void)state;
    char root[256];
    assert_int_equal(fm_test_mkdtemp(root, sizeof root, "cfg_cache"), 0);
    setenv("FP4MOE_CONFIG_DIR", root, 1);
    setenv("XDG_CACHE_HOME", root, 1);
    setenv("FP4MOE_SHIPPED_CONFIGS", root, 1);
    fm_tune_cache_clear();
    ctx x = {h200_key(256, 8), 0};
    static const int buckets[] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512};
    write_tuned(root, &x.key, buckets, (int)(sizeof buckets / sizeof buckets[0]));
    fm_cfg_cache c;
    memset(&c, 0, sizeof c);
    const int cap = 4096;
    const long made = fill_and_check(&c, &x, cap);
    print_message("# tuned file, %d batches: %ld lookups, %d distinct configs\n", cap, made, c.n);
    assert_int_equal(c.n, 10);
    assert_true(made <= 10 * 2 * 13); /* per distinct answer: about log2(cap) */
    const entry *e1 = fm_cfg_cache_get(&c, 1), *e700 = fm_cfg_cache_get(&c, 700);
    assert_true(e1->tuned && e1->bucket == 1 && strstr(e1->source, root));
    assert_true(e700->tuned && e700->bucket == 512);
    /* The table holds its answers: with the file gone, the lookup now says
     * "built-in default" but the table still has the tuned configs. */
    char name[256], path[1024];
    assert_int_equal(fm_tune_key_filename(&x.key, name, sizeof name), FM_OK);
    snprintf(path, sizeof path, "%s/%s", root, name);
    assert_int_equal(remove(path), 0);
    fm_tune_cache_clear();
    entry now;
    lookup(&x.key, 3, &now);
    assert_false(now.tuned);
    for (long i = 0; i < 100000; i++) {
        const entry *g = fm_cfg_cache_get(&c, (int)(i % cap) + 1);
        assert_true(g->tuned);
    }
    assert_int_equal(x.calls, made);
    assert_int_equal(c.resolves, made);
    fm_cfg_cache_free(&c);
    fm_test_rm_tree(root);
    fm_tune_cache_clear();
}

/* What the engine's table holds per batch: the config and the one-line
 * source of fm_tune_choice_source. */
typedef struct {
    fm_kernel_config cfg;
    char source[640];
} engine_entry;

static void engine_lookup(const fm_tune_key *key, int T, engine_entry *out) {
    fm_tune_choice ch;
    assert_int_equal(fm_tune_choose(key, T, &ch), FM_OK);
    out->cfg = ch.cfg;
    fm_tune_choice_source(&ch, out->source, sizeof out->source);
}

static void engine_resolve(void *p, int T, void *e) {
    ctx *c = p;
    c->calls++;
    engine_lookup(&c->key, T, e);
}

/* A tuned file whose buckets repeat a config out of order (1 and 4 the same,
 * 2 and 8 the same, as tuned files do: DeepSeek-V4-Flash's 8-token passes at
 * B = 2, 3 only): the table, filled from the engine's entries, still gives
 * every batch its own bucket's choice. */
static void test_repeated_configs(void **state) {
    (void)state;
    char root[256];
    assert_int_equal(fm_test_mkdtemp(root, sizeof root, "cfg_cache_rep"), 0);
    setenv("FP4MOE_CONFIG_DIR", root, 1);
    setenv("XDG_CACHE_HOME", root, 1);
    setenv("FP4MOE_SHIPPED_CONFIGS", root, 1);
    fm_tune_cache_clear();
    ctx x = {h200_key(256, 6), 0};
    fm_tune_file f;
    memset(&f, 0, sizeof f);
    f.key = x.key;
    static const int batches[] = {1, 2, 4, 8, 16};
    for (int i = 0; i < 5; i++) {
        fm_tune_bucket b;
        memset(&b, 0, sizeof b);
        b.batch = batches[i];
        b.cfg = fm_kernel_config_default_mma(&x.key, 1);
        b.cfg.k_split = 1;
        b.cfg.warps = 4;
        b.cfg.rows_per_block = 64;
        b.cfg.tile_n = i == 4 ? 32 : i % 2 ? 8 : 16; /* 16, 8, 16, 8, 32 */
        b.us = b.us_min = b.us_max = 10.0 * batches[i];
        b.default_us = b.default_us_min = b.default_us_max = 11.0 * batches[i];
        b.replaced_default = 1;
        snprintf(b.date, sizeof b.date, "2026-12-02T10:00:00Z");
        snprintf(b.version, sizeof b.version, "0.1.0");
        assert_int_equal(fm_tune_file_put(&f, &b), FM_OK);
    }
    char *text = fm_tune_file_to_json(&f);
    assert_non_null(text);
    char name[256], path[1024];
    assert_int_equal(fm_tune_key_filename(&x.key, name, sizeof name), FM_OK);
    snprintf(path, sizeof path, "%s/%s", root, name);
    assert_int_equal(fm_write_file_atomic(path, text, strlen(text)), FM_OK);
    free(text);
    fm_cfg_cache c;
    memset(&c, 0, sizeof c);
    const int cap = 64;
    assert_int_equal(fm_cfg_cache_fill(&c, cap, sizeof(engine_entry), 0, engine_resolve, &x), FM_OK);
    for (int T = 1; T <= cap; T++) {
        engine_entry want;
        memset(&want, 0, sizeof want);
        engine_lookup(&x.key, T, &want);
        const engine_entry *got = fm_cfg_cache_get(&c, T);
        assert_non_null(got);
        if (memcmp(got, &want, sizeof want))
            fail_msg("batch %d: the table has tile_n %d (%s), the lookup tile_n %d (%s)", T, got->cfg.tile_n,
                     got->source, want.cfg.tile_n, want.source);
    }
    assert_int_equal(((const engine_entry *)fm_cfg_cache_get(&c, 2))->cfg.tile_n, 8);
    assert_int_equal(((const engine_entry *)fm_cfg_cache_get(&c, 4))->cfg.tile_n, 16);
    assert_non_null(strstr(((const engine_entry *)fm_cfg_cache_get(&c, 3))->source, "(bucket 4)"));
    fm_cfg_cache_free(&c);
    fm_test_rm_tree(root);
    fm_tune_cache_clear();
}

/* No tuned file: the built-in defaults, whose choice moves with the tokens
 * per expert (several thresholds), for a few shapes. */
static void test_defaults(void **state) {
    (void)state;
    char root[256];
    assert_int_equal(fm_test_mkdtemp(root, sizeof root, "cfg_cache_def"), 0);
    setenv("FP4MOE_CONFIG_DIR", root, 1);
    setenv("XDG_CACHE_HOME", root, 1);
    setenv("FP4MOE_SHIPPED_CONFIGS", root, 1);
    fm_tune_cache_clear();
    static const int shapes[][2] = {{256, 8}, {384, 8}, {128, 8}, {8, 2}, {5, 3}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        ctx x = {h200_key(shapes[i][0], shapes[i][1]), 0};
        fm_cfg_cache c;
        memset(&c, 0, sizeof c);
        const long made = fill_and_check(&c, &x, 2048);
        print_message("# defaults E=%d k=%d: %ld lookups, %d distinct configs\n", shapes[i][0], shapes[i][1], made, c.n);
        assert_true(c.n >= 1);
        assert_true(made <= (long)c.n * 2 * 12 + 2);
        /* a refill (another max_T) keeps the count going */
        assert_int_equal(fm_cfg_cache_fill(&c, 100, sizeof(entry), 1, resolve, &x), FM_OK);
        assert_int_equal(c.resolves, x.calls);
        assert_true(c.gen == 1 && c.cap == 100);
        fm_cfg_cache_free(&c);
    }
    fm_test_rm_tree(root);
    fm_tune_cache_clear();
}

static void dummy(void *p, int T, void *e) {
    (void)p;
    *(int *)e = T > 3;
}

static void test_args(void **state) {
    (void)state;
    fm_cfg_cache c;
    memset(&c, 0, sizeof c);
    assert_int_equal(fm_cfg_cache_fill(&c, 0, 4, 0, dummy, NULL), FM_E_ARG);
    assert_int_equal(fm_cfg_cache_fill(NULL, 4, 4, 0, dummy, NULL), FM_E_ARG);
    assert_int_equal(fm_cfg_cache_fill(&c, 4, 4, 0, NULL, NULL), FM_E_ARG);
    assert_null(fm_cfg_cache_get(&c, 1));
    assert_null(fm_cfg_cache_get(NULL, 1));
    assert_int_equal(fm_cfg_cache_fill(&c, 1, sizeof(int), 0, dummy, NULL), FM_OK); /* one batch */
    assert_int_equal(*(const int *)fm_cfg_cache_get(&c, 1), 0);
    assert_int_equal(c.resolves, 1);
    assert_int_equal(fm_cfg_cache_fill(&c, 7, sizeof(int), 0, dummy, NULL), FM_OK);
    for (int T = 1; T <= 7; T++) assert_int_equal(*(const int *)fm_cfg_cache_get(&c, T), T > 3);
    fm_cfg_cache_free(&c);
    fm_cfg_cache_free(&c); /* twice is fine */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tuned_file),
        cmocka_unit_test(test_repeated_configs),
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_args),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
