/* Choosing a config: lookup order across $FP4MOE_CONFIG_DIR, the user cache
 * and the shipped configs (temporary directories through the environment),
 * the copies of configs/ built into the library,
 * malformed and mismatched files ignored with a warning, the in-memory cache
 * seeing edits, provenance lines and JSON, thread safety, and `explain`. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <dirent.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "fm_test.h"
#include "tune/builtin_internal.h"
#include "tune/tune_internal.h"
#include "util/util.h"

typedef struct {
    char root[256];
    char a[300], b_home[300], b[340], c[300]; /* env dir, XDG home, its configs, shipped */
} dirs;

static int setup(void **state) {
    dirs *d = calloc(1, sizeof *d);
    if (!d) return -1;
    if (fm_test_mkdtemp(d->root, sizeof d->root, "tune_choose")) return -1;
    snprintf(d->a, sizeof d->a, "%s/env", d->root);
    snprintf(d->b_home, sizeof d->b_home, "%s/xdg", d->root);
    snprintf(d->b, sizeof d->b, "%s/fp4moe/configs", d->b_home);
    snprintf(d->c, sizeof d->c, "%s/shipped", d->root);
    if (fm_tune_mkdirs(d->a) || fm_tune_mkdirs(d->b) || fm_tune_mkdirs(d->c)) return -1;
    setenv("FP4MOE_CONFIG_DIR", d->a, 1);
    setenv("XDG_CACHE_HOME", d->b_home, 1);
    setenv("FP4MOE_SHIPPED_CONFIGS", d->c, 1);
    fm_tune_cache_clear();
    *state = d;
    return 0;
}

static int teardown(void **state) {
    dirs *d = *state;
    fm_test_rm_tree(d->root);
    free(d);
    fm_tune_cache_clear();
    return 0;
}

/* Writes a config file for key into dir with the given buckets; each bucket
 * gets rows_per_block = marker so tests can tell files apart. */
static void write_cfg(const char *dir, const fm_tune_key *k, const int *batches, int n, int marker, int sm_in_file) {
    char name[256], path[600], body[8192];
    fm_tune_key fk = *k;
    assert_int_equal(fm_tune_key_filename(k, name, sizeof name), FM_OK);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int w = snprintf(body, sizeof body,
                     "{\"fp4moe_tune_config\": 1, \"key\": {\"gpu\": \"%s\", \"sm_count\": %d, \"cuda_version\": %d, "
                     "\"driver_version\": %d, \"format\": \"nvfp4\", \"E\": %d, \"H\": %d, \"I\": %d, \"k\": %d},\n"
                     " \"buckets\": [",
                     fk.gpu_name, sm_in_file, fk.cuda_version, fk.driver_version, fk.E, fk.H, fk.I, fk.k);
    for (int i = 0; i < n; i++)
        w += snprintf(body + w, sizeof body - (size_t)w,
                      "%s{\"batch\": %d, \"params\": {\"path\": \"%s\", \"rows_per_block\": %d, \"k_split\": 2, "
                      "\"warps\": 4, \"stages\": 1, \"tile_n\": 16, \"switch_tpe\": 3}, \"us\": %d, \"default_us\": %d, "
                      "\"replaced_default\": true, \"date\": \"2026-11-29T10:00:00Z\", \"fp4moe_version\": \"0.1.0\"}",
                      i ? ",\n  " : "", batches[i], batches[i] >= 64 ? "large" : "small", marker, 10 * batches[i],
                      11 * batches[i]);
    snprintf(body + w, sizeof body - (size_t)w, "]}\n");
    assert_int_equal(fm_write_file_atomic(path, body, strlen(body)), FM_OK);
}

static void write_raw(const char *dir, const fm_tune_key *k, const char *text) {
    char name[256], path[600];
    assert_int_equal(fm_tune_key_filename(k, name, sizeof name), FM_OK);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    assert_int_equal(fm_write_file_atomic(path, text, strlen(text)), FM_OK);
}

static void rm_cfg(const char *dir, const fm_tune_key *k) {
    char name[256], path[600];
    fm_tune_key_filename(k, name, sizeof name);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    unlink(path);
}

static void test_default_when_nothing(void **state) {
    dirs *d = *state;
    (void)d;
    fm_tune_key k = fm_test_key_h200();
    fm_tune_choice c;
    assert_int_equal(fm_tune_choose(&k, 16, &c), FM_OK);
    assert_int_equal(c.tuned, 0);
    fm_kernel_config def = fm_kernel_config_default(&k, 16);
    assert_memory_equal(&c.cfg, &def, sizeof def);
    assert_string_equal(c.source, "built-in default");
    assert_non_null(strstr(c.reason, "no tuned config for NVIDIA H200 (132 SMs) nvfp4 E=256 H=4096 I=2048 k=6; using defaults; "
                                     "run: fp4moe tune --preset deepseek-v4-flash --batch 16"));
    /* The lookup trail names every directory. */
    assert_non_null(strstr(c.reason, d->a));
    assert_non_null(strstr(c.reason, d->b));
    assert_non_null(strstr(c.reason, d->c));
    /* $FP4MOE_SHIPPED_CONFIGS names the whole shipped set: the built-in
     * copy of this shape's file is not used. */
    assert_non_null(strstr(c.reason, "4. built-in copies: not searched ($FP4MOE_SHIPPED_CONFIGS"));
    assert_string_equal(c.warnings, "");
    char line[1024];
    fm_tune_provenance_line(&k, 16, &c, line, sizeof line);
    assert_true(!strncmp(line, "WARNING: no tuned config for NVIDIA H200 (132 SMs) nvfp4 E=256 H=4096 I=2048 k=6; using defaults; "
                               "run: fp4moe tune --preset deepseek-v4-flash --batch 16", 140));
    assert_null(strchr(line, '\n'));
    /* Bad arguments are errors, not defaults. */
    assert_int_equal(fm_tune_choose(&k, 0, &c), FM_E_ARG);
    fm_tune_key bad = k;
    bad.k = 300;
    assert_int_equal(fm_tune_choose(&bad, 1, &c), FM_E_ARG);
}

/* No file for the shape: the nearest tuned shape of the same GPU, SM count
 * and format lends its choice, at the batch of equal tokens per expert;
 * nothing near enough, or nothing of this GPU, keeps the default and says
 * which case it is. */
static void test_nearest_shape(void **state) {
    dirs *d = *state;
    const fm_tune_key k = fm_test_key_h200(); /* E256 H4096 I2048 k6 */
    const int bs[] = {1, 4, 16, 64};
    assert_true(fabs(fm_tune_shape_distance(256, 4096, 2048, 6, 256, 4096, 2048, 6)) < 1e-12);
    assert_true(fabs(fm_tune_shape_distance(256, 4096, 2048, 6, 256, 2048, 2048, 6) - 4) < 1e-12);
    assert_true(fabs(fm_tune_shape_distance(256, 4096, 2048, 6, 256, 4096, 1024, 6) - 2) < 1e-12);
    assert_true(fabs(fm_tune_shape_distance(256, 4096, 2048, 6, 128, 4096, 2048, 6) - 1) < 1e-12);
    fm_tune_key a = k, b = k, c = k, far = k, other_gpu = k, other_sm = k;
    a.I = 1024;                 /* distance 2 */
    b.E = 128; b.k = 8;         /* distance 1 + log2(8/6) = 1.415 */
    c.H = 2048;                 /* distance 4 */
    far.H = 512;                /* distance 12 */
    snprintf(other_gpu.gpu_name, sizeof other_gpu.gpu_name, "NVIDIA H100 80GB HBM3");
    other_sm.sm_count = 114;
    /* only files of another GPU and of another SM count: nothing to borrow */
    write_cfg(d->a, &other_gpu, bs, 4, 90, other_gpu.sm_count);
    write_cfg(d->a, &other_sm, bs, 4, 91, other_sm.sm_count);
    fm_tune_cache_clear();
    fm_tune_choice ch;
    char line[1024];
    assert_int_equal(fm_tune_choose(&k, 16, &ch), FM_OK);
    assert_int_equal(ch.tuned, 0);
    assert_int_equal(ch.nearest, 0);
    assert_int_equal(ch.no_gpu_files, 1);
    assert_string_equal(ch.source, "built-in default");
    fm_tune_provenance_line(&k, 16, &ch, line, sizeof line);
    assert_non_null(strstr(line, "no tuned config file of this GPU and format at all"));

    write_cfg(d->c, &a, bs, 4, 11, a.sm_count);
    write_cfg(d->b, &b, bs, 4, 22, b.sm_count);
    write_cfg(d->a, &c, bs, 4, 33, c.sm_count);
    fm_tune_cache_clear();
    assert_int_equal(fm_tune_choose(&k, 16, &ch), FM_OK);
    assert_int_equal(ch.tuned, 0);
    assert_int_equal(ch.nearest, 1);
    assert_int_equal(ch.cfg.rows_per_block, 22);
    assert_int_equal(ch.nearest_E, 128);
    assert_int_equal(ch.nearest_k, 8);
    /* 16 tokens x 6 / 256 = 0.375 per expert here: 6 tokens at E=128, k=8 */
    assert_int_equal(ch.nearest_batch, 6);
    assert_int_equal(ch.bucket, 4);
    assert_true(fabs(ch.nearest_distance - (1 + log2(8.0 / 6.0))) < 1e-9);
    char nb[256];
    assert_int_equal(fm_tune_key_filename(&b, nb, sizeof nb), FM_OK);
    assert_non_null(strstr(ch.source, d->b));
    assert_non_null(strstr(ch.source, nb));
    fm_tune_provenance_line(&k, 16, &ch, line, sizeof line);
    assert_ptr_equal(strstr(line, "WARNING: no tuned config for NVIDIA H200 (132 SMs) nvfp4 E=256 H=4096 I=2048 k=6; "
                                  "borrowing the nearest tuned shape's choice: E=128 H=4096 I=2048 k=8"),
                     line);
    assert_non_null(strstr(line, nb));
    char *js = fm_tune_choice_to_json(&k, 16, &ch);
    assert_non_null(js);
    assert_non_null(strstr(js, "\"nearest\":{\"E\":128"));
    free(js);
    /* the explanation says where the choice came from */
    fm_model_desc md;
    assert_int_equal(fm_preset_desc("deepseek-v4-flash", FM_QF_NVFP4, &md), FM_OK);
    const int eb[] = {16};
    fm_explain_opts eo = {.desc = &md, .model_label = "--preset deepseek-v4-flash", .fmt = FM_QF_NVFP4,
                          .batches = eb, .n_batches = 1, .gpu = "NVIDIA H200"};
    char *text = NULL;
    assert_int_equal(fm_explain(&eo, &text), FM_OK);
    assert_non_null(strstr(text, "borrowed from the nearest tuned shape"));
    assert_non_null(strstr(text, nb));
    free(text);

    /* without it the next nearest; equal distances go to the earlier directory */
    rm_cfg(d->b, &b);
    fm_tune_cache_clear();
    assert_int_equal(fm_tune_choose(&k, 16, &ch), FM_OK);
    assert_int_equal(ch.nearest, 1);
    assert_int_equal(ch.cfg.rows_per_block, 11);
    fm_tune_key a2 = k;
    a2.I = 4096; /* distance 2 as well, in $FP4MOE_CONFIG_DIR (searched first) */
    write_cfg(d->a, &a2, bs, 4, 44, a2.sm_count);
    fm_tune_cache_clear();
    assert_int_equal(fm_tune_choose(&k, 16, &ch), FM_OK);
    assert_int_equal(ch.cfg.rows_per_block, 44);
    /* a malformed nearest file is passed over for the next one */
    write_raw(d->a, &a2, "{ not json");
    fm_tune_cache_clear();
    assert_int_equal(fm_tune_choose(&k, 16, &ch), FM_OK);
    assert_int_equal(ch.cfg.rows_per_block, 11);

    /* too far: the default, and the line says which shape was too far */
    rm_cfg(d->a, &a2);
    rm_cfg(d->c, &a);
    rm_cfg(d->a, &c);
    write_cfg(d->a, &far, bs, 4, 55, far.sm_count);
    fm_tune_cache_clear();
    assert_int_equal(fm_tune_choose(&k, 16, &ch), FM_OK);
    assert_int_equal(ch.nearest, 0);
    assert_int_equal(ch.nearest_too_far, 1);
    assert_int_equal(ch.no_gpu_files, 0);
    fm_kernel_config def = fm_kernel_config_default(&k, 16);
    assert_memory_equal(&ch.cfg, &def, sizeof def);
    fm_tune_provenance_line(&k, 16, &ch, line, sizeof line);
    assert_non_null(strstr(line, "E=256 H=512 I=2048 k=6, is too far to borrow from: distance 12.00 > 8"));

    /* a file of the very shape wins over any neighbour */
    write_cfg(d->c, &k, bs, 4, 66, k.sm_count);
    fm_tune_cache_clear();
    assert_int_equal(fm_tune_choose(&k, 16, &ch), FM_OK);
    assert_int_equal(ch.tuned, 1);
    assert_int_equal(ch.nearest, 0);
    assert_int_equal(ch.cfg.rows_per_block, 66);
}

static void test_lookup_order(void **state) {
    dirs *d = *state;
    fm_tune_key k = fm_test_key_h200();
    const int bs[] = {1, 4, 16, 64};
    fm_tune_choice c;
    write_cfg(d->c, &k, bs, 4, 3, k.sm_count); /* shipped */
    assert_int_equal(fm_tune_choose(&k, 16, &c), FM_OK);
    assert_int_equal(c.tuned, 1);
    assert_int_equal(c.cfg.rows_per_block, 3);
    assert_non_null(strstr(c.source, d->c));
    write_cfg(d->b, &k, bs, 4, 2, k.sm_count); /* user cache beats shipped */
    assert_int_equal(fm_tune_choose(&k, 16, &c), FM_OK);
    assert_int_equal(c.cfg.rows_per_block, 2);
    assert_non_null(strstr(c.source, d->b));
    write_cfg(d->a, &k, bs, 4, 1, k.sm_count); /* $FP4MOE_CONFIG_DIR beats both */
    assert_int_equal(fm_tune_choose(&k, 16, &c), FM_OK);
    assert_int_equal(c.cfg.rows_per_block, 1);
    assert_non_null(strstr(c.source, d->a));
    assert_string_equal(c.warnings, "");
    /* The chosen bucket's figures and the provenance line. */
    assert_int_equal(c.bucket, 16);
    assert_true(c.tuned_us == 160 && c.default_us == 176);
    assert_string_equal(c.date, "2026-11-29T10:00:00Z");
    char line[1024];
    fm_tune_provenance_line(&k, 20, &c, line, sizeof line);
    assert_true(!strncmp(line, "provenance: backend=cuda ", 25));
    assert_non_null(strstr(line, "kernel=small"));
    assert_non_null(strstr(line, "params={rows_per_block=1,k_split=2,warps=4,stages=1,tile_n=16,switch_tpe=3}"));
    assert_non_null(strstr(line, "config="));
    assert_non_null(strstr(line, d->a));
    assert_non_null(strstr(line, "bucket=16"));
    /* Nearest bucket through the file: 40 -> 64 (64/40 = 1.6 > 40/16 = 2.5? no: 1.6 < 2.5). */
    assert_int_equal(fm_tune_choose(&k, 40, &c), FM_OK);
    assert_int_equal(c.bucket, 64);
    assert_int_equal(c.cfg.path, FM_PATH_LARGE);
    assert_int_equal(fm_tune_choose(&k, 2, &c), FM_OK);
    assert_int_equal(c.bucket, 1); /* 2/1 = 4/2: tie, the smaller */
    assert_int_equal(fm_tune_choose(&k, 3, &c), FM_OK);
    assert_int_equal(c.bucket, 4);

    /* A malformed file in the first directory: warned about, skipped. */
    write_raw(d->a, &k, "{\"fp4moe_tune_config\": 1, \"key\": {");
    assert_int_equal(fm_tune_choose(&k, 16, &c), FM_OK);
    assert_int_equal(c.cfg.rows_per_block, 2);
    assert_non_null(strstr(c.warnings, d->a));
    assert_non_null(strstr(c.warnings, "ignored: not valid JSON"));
    /* A file for another SM count under this key's name: ignored too. */
    write_cfg(d->a, &k, bs, 4, 1, 114);
    assert_int_equal(fm_tune_choose(&k, 16, &c), FM_OK);
    assert_int_equal(c.cfg.rows_per_block, 2);
    assert_non_null(strstr(c.warnings, "tuned on 114 SMs, this GPU has 132"));
    /* A file for another shape under this key's name (a renamed copy). */
    fm_tune_key other = k;
    other.E = 128;
    char name[256], path[700], text[4096];
    write_cfg(d->root, &other, bs, 4, 9, other.sm_count);
    fm_tune_key_filename(&other, name, sizeof name);
    snprintf(path, sizeof path, "%s/%s", d->root, name);
    char *buf = NULL;
    size_t len = 0;
    assert_int_equal(fm_read_file(path, 1 << 20, &buf, &len), FM_OK);
    snprintf(text, sizeof text, "%s", buf);
    free(buf);
    write_raw(d->b, &k, text);
    assert_int_equal(fm_tune_choose(&k, 16, &c), FM_OK);
    assert_int_equal(c.cfg.rows_per_block, 3); /* falls through to shipped */
    assert_non_null(strstr(c.warnings, "E=128"));
    /* Versions differ: used, with a note in the reason. */
    rm_cfg(d->a, &k);
    rm_cfg(d->b, &k);
    fm_tune_key k2 = k;
    k2.cuda_version = 12080;
    assert_int_equal(fm_tune_choose(&k2, 16, &c), FM_OK);
    assert_int_equal(c.tuned, 1);
    assert_non_null(strstr(c.reason, "tuned with CUDA runtime 13000, running 12080"));
    /* Nothing left: default again. */
    rm_cfg(d->c, &k);
    assert_int_equal(fm_tune_choose(&k, 16, &c), FM_OK);
    assert_int_equal(c.tuned, 0);
}

static void test_unset_dirs(void **state) {
    dirs *d = *state;
    fm_tune_key k = fm_test_key_h200();
    const int bs[] = {8};
    write_cfg(d->c, &k, bs, 1, 5, k.sm_count);
    unsetenv("FP4MOE_CONFIG_DIR");
    char home[400];
    snprintf(home, sizeof home, "%s/home", d->root);
    unsetenv("XDG_CACHE_HOME");
    setenv("HOME", home, 1);
    fm_tune_choice c;
    assert_int_equal(fm_tune_choose(&k, 8, &c), FM_OK);
    assert_int_equal(c.cfg.rows_per_block, 5);
    assert_non_null(strstr(c.reason, "$FP4MOE_CONFIG_DIR: not set"));
    assert_non_null(strstr(c.reason, "/home/.cache/fp4moe/configs: no such file"));
    const char *labels[FM_TUNE_NDIRS];
    char paths[FM_TUNE_NDIRS][1024];
    assert_int_equal(fm_tune_search_dirs(labels, paths), 4);
    assert_string_equal(paths[0], "");
    assert_true(!strncmp(paths[1], home, strlen(home)));
    assert_string_equal(paths[2], d->c);
    assert_string_equal(labels[FM_TUNE_DIR_BUILTIN], "built-in copies");
    assert_string_equal(paths[FM_TUNE_DIR_BUILTIN], "");
    /* Without it, a binary of the build tree reads the repo's configs/. */
    unsetenv("FP4MOE_SHIPPED_CONFIGS");
    fm_tune_search_dirs(labels, paths);
    assert_string_equal(paths[2], FM_SOURCE_DIR "/configs");
    setenv("FP4MOE_CONFIG_DIR", d->a, 1);
    setenv("XDG_CACHE_HOME", d->b_home, 1);
    setenv("FP4MOE_SHIPPED_CONFIGS", d->c, 1);
}

static void test_other_sm_file_named(void **state) {
    dirs *d = *state;
    fm_tune_key k = fm_test_key_h200(), k114 = k;
    k114.sm_count = 114;
    const int bs[] = {1};
    write_cfg(d->a, &k114, bs, 1, 7, 114); /* a valid file, for a 114-SM part */
    fm_tune_choice c;
    assert_int_equal(fm_tune_choose(&k, 1, &c), FM_OK);
    assert_int_equal(c.tuned, 0);
    assert_non_null(strstr(c.warnings, "NVIDIA_H200-114sm-nvfp4-E256-H4096-I2048-k6.json: ignored: tuned for another SM count"));
    /* And the 114-SM GPU uses it. */
    assert_int_equal(fm_tune_choose(&k114, 1, &c), FM_OK);
    assert_int_equal(c.tuned, 1);
    assert_int_equal(c.cfg.rows_per_block, 7);
    rm_cfg(d->a, &k114);
}

static void test_cache_sees_edits(void **state) {
    dirs *d = *state;
    fm_tune_key k = fm_test_key_h200();
    const int bs[] = {4};
    fm_tune_choice c;
    for (int m = 1; m <= 5; m++) {
        write_cfg(d->a, &k, bs, 1, m, k.sm_count); /* same size each time */
        assert_int_equal(fm_tune_choose(&k, 4, &c), FM_OK);
        assert_int_equal(c.cfg.rows_per_block, m);
    }
    write_raw(d->a, &k, "garbage");
    assert_int_equal(fm_tune_choose(&k, 4, &c), FM_OK);
    assert_int_equal(c.tuned, 0);
    assert_non_null(strstr(c.warnings, "not valid JSON"));
    rm_cfg(d->a, &k);
}

static void test_json(void **state) {
    dirs *d = *state;
    fm_tune_key k = fm_test_key_h200();
    fm_tune_choice c;
    assert_int_equal(fm_tune_choose(&k, 2, &c), FM_OK);
    char *s = fm_tune_choice_to_json(&k, 2, &c);
    assert_non_null(s);
    json_error_t e;
    json_t *o = json_loads(s, 0, &e);
    assert_non_null(o);
    assert_string_equal(json_string_value(json_object_get(o, "backend")), "cuda");
    assert_true(json_is_false(json_object_get(o, "tuned")));
    assert_non_null(strstr(json_string_value(json_object_get(o, "warning")), "no tuned config for"));
    assert_int_equal(json_integer_value(json_object_get(json_object_get(o, "key"), "E")), 256);
    assert_string_equal(json_string_value(json_object_get(o, "config")), "built-in default");
    assert_true(json_is_object(json_object_get(o, "params")));
    json_decref(o);
    free(s);

    const int bs[] = {2};
    write_cfg(d->a, &k, bs, 1, 4, k.sm_count);
    assert_int_equal(fm_tune_choose(&k, 2, &c), FM_OK);
    s = fm_tune_choice_to_json(&k, 2, &c);
    o = json_loads(s, 0, &e);
    assert_non_null(o);
    assert_true(json_is_true(json_object_get(o, "tuned")));
    assert_true(json_is_null(json_object_get(o, "warning")));
    assert_int_equal(json_integer_value(json_object_get(o, "bucket")), 2);
    assert_int_equal(json_integer_value(json_object_get(json_object_get(o, "params"), "rows_per_block")), 4);
    assert_non_null(strstr(json_string_value(json_object_get(o, "config")), d->a));
    assert_non_null(strstr(json_string_value(json_object_get(o, "provenance")), "provenance: backend=cuda"));
    json_decref(o);
    free(s);
    rm_cfg(d->a, &k);
}

/* Sets a path's times an hour (plus `sec`) into the past, so the answers
 * built on it count as settled and are reused. */
static void age(const char *path, int sec) {
    struct timespec ts[2];
    clock_gettime(CLOCK_REALTIME, &ts[0]);
    ts[0].tv_sec -= 3600 + sec;
    ts[1] = ts[0];
    assert_int_equal(utimensat(AT_FDCWD, path, ts, 0), 0);
}

static void cfg_path(const char *dir, const fm_tune_key *k, char *path, size_t cap) {
    char name[256];
    fm_tune_key_filename(k, name, sizeof name);
    snprintf(path, cap, "%s/%s", dir, name);
}

/* Remembered answers: reused while nothing they depend on changed, and
 * recomputed when a file is replaced, removed or added next to them. */
static void test_memo(void **state) {
    dirs *d = *state;
    fm_tune_key k = fm_test_key_h200();
    const int bs[] = {4};
    char pb[700], pa[700];
    cfg_path(d->b, &k, pb, sizeof pb);
    cfg_path(d->a, &k, pa, sizeof pa);
    write_cfg(d->b, &k, bs, 1, 3, k.sm_count);
    age(pb, 0);
    age(d->a, 0);
    age(d->b, 0);
    age(d->c, 0);
    fm_tune_choice c1, c2;
    assert_int_equal(fm_tune_choose(&k, 4, &c1), FM_OK);
    assert_int_equal(c1.cfg.rows_per_block, 3);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(fm_tune_choose(&k, 4, &c2), FM_OK);
        assert_memory_equal(&c1, &c2, sizeof c1);
    }
    /* Same size, other content, also old: the inode or time differs. */
    write_cfg(d->b, &k, bs, 1, 5, k.sm_count);
    age(pb, 7);
    assert_int_equal(fm_tune_choose(&k, 4, &c2), FM_OK);
    assert_int_equal(c2.cfg.rows_per_block, 5);
    /* A file appears in an earlier directory. */
    write_cfg(d->a, &k, bs, 1, 6, k.sm_count);
    age(pa, 0);
    age(d->a, 0);
    assert_int_equal(fm_tune_choose(&k, 4, &c2), FM_OK);
    assert_int_equal(c2.cfg.rows_per_block, 6);
    unlink(pa);
    age(d->a, 9);
    assert_int_equal(fm_tune_choose(&k, 4, &c2), FM_OK);
    assert_int_equal(c2.cfg.rows_per_block, 5);
    /* Removed: the default; then a file for another SM count shows up in
     * the directory listing, and the remembered default must say so. */
    unlink(pb);
    age(d->b, 11);
    assert_int_equal(fm_tune_choose(&k, 4, &c2), FM_OK);
    assert_int_equal(c2.tuned, 0);
    assert_string_equal(c2.warnings, "");
    assert_int_equal(fm_tune_choose(&k, 4, &c2), FM_OK);
    assert_int_equal(c2.tuned, 0);
    fm_tune_key k114 = k;
    k114.sm_count = 114;
    write_cfg(d->c, &k114, bs, 1, 7, 114);
    age(d->c, 13);
    assert_int_equal(fm_tune_choose(&k, 4, &c2), FM_OK);
    assert_int_equal(c2.tuned, 0);
    assert_non_null(strstr(c2.warnings, "114sm"));
    /* Another environment is another answer. */
    setenv("FP4MOE_CONFIG_DIR", d->c, 1);
    assert_int_equal(fm_tune_choose(&k114, 4, &c2), FM_OK);
    assert_int_equal(c2.tuned, 1);
    assert_non_null(strstr(c2.source, d->c));
    setenv("FP4MOE_CONFIG_DIR", d->a, 1);
}

/* Many threads choose while another replaces the file (atomically): every
 * answer is one of the two files, never a torn or failed read. */
typedef struct {
    fm_tune_key k;
    int bad;
} thr_arg;

static void *chooser(void *p) {
    thr_arg *a = p;
    for (int i = 0; i < 300; i++) {
        fm_tune_choice c;
        if (fm_tune_choose(&a->k, 1 + i % 64, &c) != FM_OK || !c.tuned ||
            (c.cfg.rows_per_block != 1 && c.cfg.rows_per_block != 2))
            a->bad++;
    }
    return NULL;
}

static void test_threads(void **state) {
    dirs *d = *state;
    fm_tune_key k = fm_test_key_h200();
    const int bs[] = {1, 8, 64};
    write_cfg(d->a, &k, bs, 3, 1, k.sm_count);
    pthread_t th[4];
    thr_arg args[4];
    for (int i = 0; i < 4; i++) {
        args[i].k = k;
        args[i].bad = 0;
        assert_int_equal(pthread_create(&th[i], NULL, chooser, &args[i]), 0);
    }
    for (int i = 0; i < 100; i++) write_cfg(d->a, &k, bs, 3, 1 + i % 2, k.sm_count);
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(args[i].bad, 0);
    }
    rm_cfg(d->a, &k);
}

/* explain's text (not JSON) for preset in NVFP4 on gpu, with base's other
 * options (shard, batches); d receives the preset's description */
static char *explain_preset(const fm_explain_opts *base, const char *preset, const char *gpu, fm_model_desc *d) {
    assert_int_equal(fm_preset_desc(preset, FM_QF_NVFP4, d), FM_OK);
    fm_explain_opts o = *base;
    o.json = 0;
    o.desc = d;
    o.model_label = preset;
    o.gpu = gpu;
    char *text = NULL;
    assert_int_equal(fm_explain(&o, &text), FM_OK);
    return text;
}

/* The selection's spread (schedule.c): two tokens each over half of the
 * block's warps, three tokens a warp each; the family that is not
 * elementwise never spreads. */
static void test_explain_spread(void **state) {
    (void)state;
    const int bs[] = {2, 3};
    const char *presets[] = {"deepseek-v4-flash", "qwen3-30b-a3b"};
    for (int i = 0; i < 2; i++) {
        fm_model_desc md;
        assert_int_equal(fm_preset_desc(presets[i], FM_QF_NVFP4, &md), FM_OK);
        fm_explain_opts o = {.desc = &md, .model_label = presets[i], .fmt = FM_QF_NVFP4, .batches = bs,
                             .n_batches = 2, .gpu = "NVIDIA H200"};
        char *text = NULL;
        assert_int_equal(fm_explain(&o, &text), FM_OK);
        const char *half = strstr(text, "selection: each token's sums and scores over its half of the selection "
                                        "block's warps, one warp's top-k each");
        const char *warp = strstr(text, "selection: one warp per token");
        if (i == 0) {
            assert_non_null(half);
            assert_null(strstr(half + 8, "selection: each token's"));
            assert_non_null(warp);
            assert_true(warp > half); /* B = 3 after B = 2 */
        } else {
            assert_null(half);
            assert_non_null(warp);
        }
        free(text);
    }
}

/* The wgmma gate/up's quarters and thirds (schedule.c) on the H200's 132
 * SMs: the TP8 ranks at B = 2 (16 or 12 experts x 4 row blocks) and
 * DeepSeek-V4-Flash's at B = 4 (96 blocks) in quarters; GLM-5's at B = 4
 * (128 blocks: 512 quartered, more than 3 per SM) in thirds; B = 8 and the
 * whole DeepSeek-V4-Flash layer (32 row blocks an expert) neither. */
static void test_explain_quarters(void **state) {
    (void)state;
    fm_shard tp8 = {.mode = FM_DIST_TP, .ranks = 8, .rank = 0};
    const int bs[] = {2, 4, 8};
    const char *presets[] = {"glm-5", "deepseek-v4-flash", "deepseek-v4-flash"};
    for (int i = 0; i < 3; i++) {
        fm_model_desc md;
        assert_int_equal(fm_preset_desc(presets[i], FM_QF_NVFP4, &md), FM_OK);
        fm_explain_opts o = {.desc = &md, .model_label = presets[i], .fmt = FM_QF_NVFP4, .batches = bs,
                             .n_batches = 3, .gpu = "NVIDIA H200", .shard = i < 2 ? &tp8 : NULL};
        char *text = NULL;
        assert_int_equal(fm_explain(&o, &text), FM_OK);
        const char *b4 = strstr(text, "batch 4"), *b8 = strstr(text, "batch 8");
        assert_non_null(b4);
        assert_non_null(b8);
        if (i == 0) {
            const char *q = strstr(text, "gate/up blocks: K in quarters, a cluster of 4 per row block (64 blocks x 4 "
                                         "on 132 SMs: at most 3 per SM");
            assert_non_null(q);
            assert_true(q < b4);
            assert_null(strstr(b4, "K in quarters"));
            const char *t = strstr(text, "gate/up blocks: K in thirds, a cluster of 3 per row block (128 blocks x 3 "
                                         "on 132 SMs: quarters would put more than 3 on an SM");
            assert_non_null(t);
            assert_true(t > b4 && t < b8);
            assert_null(strstr(b8, "K in thirds"));
            /* the JSON's split per batch: 4, 3, none */
            fm_explain_opts oj = o;
            oj.json = 1;
            char *js = NULL;
            assert_int_equal(fm_explain(&oj, &js), FM_OK);
            json_error_t e;
            json_t *j = json_loads(js, 0, &e);
            assert_non_null(j);
            const json_int_t want[] = {4, 3, 0};
            for (int bi = 0; bi < 3; bi++) {
                json_t *ks = json_object_get(
                    json_object_get(json_array_get(json_object_get(j, "batches"), (size_t)bi), "schedule"),
                    "gateup_k_split");
                assert_int_equal(ks ? json_integer_value(ks) : 0, want[bi]);
            }
            json_decref(j);
            free(js);
        } else if (i == 1) {
            const char *q2 = strstr(text, "(48 blocks x 4 on 132 SMs"), *q4 = strstr(text, "(96 blocks x 4 on 132 SMs");
            assert_non_null(q2);
            assert_non_null(q4);
            assert_true(q2 < b4 && q4 > b4 && q4 < b8);
            assert_null(strstr(b8, "K in quarters"));
            assert_null(strstr(text, "K in thirds"));
        } else {
            assert_null(strstr(text, "K in quarters"));
            assert_null(strstr(text, "K in thirds"));
        }
        free(text);
    }
}

static void test_explain(void **state) {
    dirs *d = *state;
    fm_model_desc md;
    assert_int_equal(fm_preset_desc("deepseek-v4-flash", FM_QF_NVFP4, &md), FM_OK);
    const int bs[] = {1, 64};
    fm_explain_opts o = {.desc = &md, .model_label = "--preset deepseek-v4-flash", .fmt = FM_QF_NVFP4,
                         .batches = bs, .n_batches = 2, .gpu = "NVIDIA H200"};
    char *text = NULL;
    assert_int_equal(fm_explain(&o, &text), FM_OK);
    assert_non_null(strstr(text, "NVIDIA H200: 132 SMs"));
    assert_non_null(strstr(text, "6.0 of 256")); /* B = 1: exactly k active */
    /* the router logits' shape (route_shape.c): DeepSeek-V4-Flash at B = 64
     * has 4 expert tiles x 32 K slices = 128 blocks on 132 SMs, the tiled
     * shape; at B = 1 the GEMV */
    assert_non_null(strstr(text, "router logits    GEMV shape (up to 32 tokens"));
    assert_non_null(strstr(text, "router logits    tiled shape (the tiled grid fills a third of the SMs or more; "
                                 "the tiled grid: 128 blocks on 132 SMs)"));
    /* the tiled shape's kernels for BF16 activations: said at B = 64 only */
    const char *blas = strstr(text, "tiled: BF16 activations on a router exact in BF16 take one cuBLAS GEMM");
    assert_non_null(blas);
    assert_null(strstr(blas + 8, "tiled: BF16 activations"));
    /* the layer's schedule (schedule.c): B = 1's built-in small path (8-token
     * tiles) on the shared expert's branch, its one token's selection
     * spread; B = 64's wgmma path with 32-token shared passes, no handoff
     * above 32 tokens */
    assert_non_null(strstr(text, "schedule         shared expert: its own launches on a second stream, beside the "
                                 "selection and the routed gate/up, 8-token passes"));
    assert_non_null(strstr(text, "routed gate/up, 32-token passes"));
    assert_non_null(strstr(text, "selection: the token's sums and scores over the selection block's warps"));
    assert_non_null(strstr(text, "selection: one warp per token"));
    assert_null(strstr(text, "down: starts per expert"));
    assert_non_null(strstr(text, "expert kernels launched right after the selection's wait on the logits"));
    assert_non_null(strstr(text, "chosen           built-in default"));
    assert_non_null(strstr(text, "WARNING: no tuned config for NVIDIA H200"));
    assert_null(strstr(text, "chosen           tuned"));
    free(text);

    fm_tune_key k = fm_test_key_h200();
    const int fb[] = {1, 64};
    write_cfg(d->b, &k, fb, 2, 6, k.sm_count);
    assert_int_equal(fm_explain(&o, &text), FM_OK);
    assert_non_null(strstr(text, "chosen           tuned, bucket 1"));
    assert_non_null(strstr(text, "chosen           tuned, bucket 64"));
    assert_non_null(strstr(text, d->b));
    assert_null(strstr(text, "WARNING"));
    free(text);

    o.json = 1;
    assert_int_equal(fm_explain(&o, &text), FM_OK);
    json_error_t e;
    json_t *j = json_loads(text, 0, &e);
    assert_non_null(j);
    json_t *b0 = json_array_get(json_object_get(j, "batches"), 0);
    assert_int_equal(json_integer_value(json_object_get(b0, "batch")), 1);
    assert_string_equal(json_string_value(json_object_get(json_object_get(b0, "router_logits"), "shape")), "gemv");
    assert_true(json_is_true(json_object_get(json_object_get(b0, "choice"), "tuned")));
    assert_string_equal(json_string_value(json_object_get(json_object_get(j, "target"), "name")), "NVIDIA H200");
    json_decref(j);
    free(text);
    rm_cfg(d->b, &k);

    /* the splitk grids of GLM-5's TP8 rank at B = 1 (the built-in splitk
     * default there): 288 gate/up blocks on 264 slots, 384 down blocks at
     * three per SM */
    fm_model_desc gd;
    assert_int_equal(fm_preset_desc("glm-5", FM_QF_NVFP4, &gd), FM_OK);
    fm_shard tp8 = {.mode = FM_DIST_TP, .ranks = 8, .rank = 0};
    const int b1[] = {1};
    fm_explain_opts go = {.desc = &gd, .model_label = "--preset glm-5", .fmt = FM_QF_NVFP4, .batches = b1,
                          .n_batches = 1, .gpu = "NVIDIA H200", .shard = &tp8};
    assert_int_equal(fm_explain(&go, &text), FM_OK);
    assert_non_null(strstr(text, "splitk grids: gate/up 288 blocks, 2 per SM (1.09 waves); down 384 blocks, 3 per SM "
                                 "(0.97 waves)"));
    /* one token there: 8 x 16 blocks of 186,112 bytes each (test_schedule)
     * and the top-k's 3,328 past them */
    assert_non_null(strstr(text, "one token: gate/up and down in one launch instead, 128 blocks (one per SM), 185.0 KB "
                                 "of shared memory each"));
    assert_non_null(strstr(text, "one token's top-k: inside that launch, no selection kernel\n"));
    assert_non_null(strstr(text, "one warp's top-k (in the one-token launch instead, below)\n"));
    assert_non_null(strstr(text, "expert kernels launched right after the logits' wait on the previous layer (the "
                                 "one-token launch"));
    free(text);
    go.json = 1;
    assert_int_equal(fm_explain(&go, &text), FM_OK);
    j = json_loads(text, 0, &e);
    assert_non_null(j);
    json_t *g = json_object_get(json_object_get(json_array_get(json_object_get(j, "batches"), 0), "schedule"),
                                "splitk_grids");
    assert_int_equal(json_integer_value(json_object_get(g, "gateup_blocks")), 288);
    assert_int_equal(json_integer_value(json_object_get(g, "down_per_sm")), 3);
    g = json_object_get(json_object_get(json_array_get(json_object_get(j, "batches"), 0), "schedule"),
                        "one_token_launch");
    assert_int_equal(json_integer_value(json_object_get(g, "blocks")), 128);
    assert_int_equal(json_integer_value(json_object_get(g, "shared_memory_bytes")), 186112 + 3328); /* + the top-k's scratch */
    assert_true(json_is_true(json_object_get(g, "selects_topk")));
    assert_null(json_object_get(g, "selection_kernel_why"));
    json_decref(j);
    free(text);
    /* Kimi-K2's TP8 rank on an RTX PRO 6000 (sm_120, 99 KB per block): not one launch */
    fm_model_desc kd;
    text = explain_preset(&go, "kimi-k2", "NVIDIA RTX PRO 6000", &kd);
    assert_non_null(strstr(text, "one token: the two launches above (not one launch: its shared memory per block is "
                                 "more than the GPU's)"));
    assert_null(strstr(text, "one token's top-k"));
    free(text);
    /* DeepSeek-V4-Flash's TP8 rank: its hash-routed first layers keep the
     * selection kernel */
    fm_model_desc vd;
    text = explain_preset(&go, "deepseek-v4-flash", "NVIDIA H200", &vd);
    assert_true(vd.n_hash_layers > 0);
    assert_non_null(strstr(text, "one token's top-k: inside that launch, no selection kernel (the hash-routed layers "
                                 "keep it)"));
    assert_non_null(strstr(text, "(in the one-token launch instead, below; the hash-routed layers keep the selection "
                                 "kernel)"));
    free(text);
    /* at B = 16 the wgmma path: down's K of 2 segments allows blocks of up
     * to 4 row chunks; the whole layer's K of 16 segments none */
    const int b16[] = {16};
    go.batches = b16;
    go.json = 0;
    assert_int_equal(fm_explain(&go, &text), FM_OK);
    assert_non_null(strstr(text, "down blocks: up to 4 row chunks each"));
    free(text);
    go.json = 1;
    assert_int_equal(fm_explain(&go, &text), FM_OK);
    j = json_loads(text, 0, &e);
    assert_non_null(j);
    assert_int_equal(json_integer_value(json_object_get(
                         json_object_get(json_array_get(json_object_get(j, "batches"), 0), "schedule"), "down_chunks_max")),
                     4);
    json_decref(j);
    free(text);
    go.shard = NULL;
    go.json = 0;
    assert_int_equal(fm_explain(&go, &text), FM_OK);
    assert_null(strstr(text, "row chunks"));
    free(text);

    o.json = 0;
    o.gpu = "Voodoo 2";
    assert_int_equal(fm_explain(&o, &text), FM_E_NOTFOUND);
    assert_non_null(strstr(fm_last_error(), "unknown GPU 'Voodoo 2'"));
    assert_non_null(strstr(fm_last_error(), "NVIDIA H200"));
    assert_null(text);

    /* No --gpu: the present GPU, else the CPU path. */
    o.gpu = NULL;
    char why[256];
    assert_int_equal(fm_explain(&o, &text), FM_OK);
    if (!fm_cuda_available(why, sizeof why)) {
        assert_non_null(strstr(text, "no CUDA GPU present"));
        assert_non_null(strstr(text, fm_cpu_isa_name(fm_cpu_isa_detect())));
    }
    free(text);
}

/* Renders through a memory stream (text or JSON). */
static char *render(const fm_explanation *x, int json) {
    char *buf = NULL;
    size_t len = 0;
    FILE *m = open_memstream(&buf, &len);
    assert_non_null(m);
    assert_int_equal(json ? fm_explain_render_json(x, m) : fm_explain_render_text(x, m), FM_OK);
    assert_int_equal(fclose(m), 0);
    return buf;
}

/* The decision as a structure, and fm_explain as its rendering. */
static void test_explain_decide(void **state) {
    dirs *d = *state;
    fm_model_desc md;
    assert_int_equal(fm_preset_desc("deepseek-v4-flash", FM_QF_NVFP4, &md), FM_OK);
    fm_tune_key k = fm_test_key_h200();
    const int fb[] = {1, 64};
    write_cfg(d->b, &k, fb, 2, 6, k.sm_count); /* tuned: the user cache */
    char name[256], bad[600];
    assert_int_equal(fm_tune_key_filename(&k, name, sizeof name), FM_OK);
    snprintf(bad, sizeof bad, "%s/%s", d->a, name);
    FILE *f = fopen(bad, "w"); /* ignored: $FP4MOE_CONFIG_DIR holds a malformed one */
    assert_non_null(f);
    fputs("{not json", f);
    fclose(f);

    const int bs[] = {1, 3, 64};
    fm_explain_opts o = {.desc = &md, .model_label = "--preset deepseek-v4-flash", .fmt = FM_QF_NVFP4,
                         .batches = bs, .n_batches = 3, .gpu = "H200"};
    fm_explanation *x = NULL;
    assert_int_equal(fm_explain_decide(&o, &x), FM_OK);
    assert_true(x->gpu);
    assert_non_null(x->gpu_info);
    assert_string_equal(x->key.gpu_name, "NVIDIA H200");
    assert_string_equal(x->config_file, name);
    assert_string_equal(x->model, "--preset deepseek-v4-flash");
    /* NVFP4: three I x H matrices, each I*H/2 bytes of codes + I*H/16 of scales */
    const double eb = 3.0 * (2048.0 * 4096 / 2 + 2048.0 * 4096 / 16);
    assert_true(x->expert_bytes == (int64_t)eb);
    assert_int_equal(x->n_batches, 3);
    for (int i = 0; i < 3; i++) {
        const fm_explain_batch *e = &x->batches[i];
        const int T = bs[i];
        assert_int_equal(e->batch, T);
        const double act = 256.0 * (1.0 - pow(1.0 - 6.0 / 256.0, T));
        assert_true(fabs(e->active_experts - act) <= 1e-9 * act);
        assert_true(fabs(e->tokens_per_expert - T * 6.0 / act) <= 1e-9 * e->tokens_per_expert);
        assert_true(fabs(e->shared_bytes - eb * md.shared_inter / md.moe_inter) <= 1e-6);
        assert_true(fabs(e->bytes - (act * eb + e->shared_bytes)) <= 1e-6 * e->bytes);
        assert_true(fabs(e->floor_us - e->bytes / (x->gpu_info->bandwidth_gbs * 1e9) * 1e6) <= 1e-9 * e->floor_us);
        fm_kernel_config def = fm_kernel_config_default(&x->key, T);
        assert_memory_equal(&e->default_cfg, &def, sizeof def);
        /* buckets 1 and 64; B = 3 is nearer to 1 on a log scale */
        assert_true(e->choice.tuned);
        assert_int_equal(e->choice.bucket, T == 64 ? 64 : 1);
        assert_int_equal(e->choice.cfg.rows_per_block, 6);
        assert_non_null(strstr(e->choice.source, d->b));
        assert_non_null(strstr(e->lookup[0].status, "ignored"));
        assert_string_equal(e->lookup[1].status, "found");
        assert_non_null(strstr(e->provenance, "provenance: backend=cuda"));
        assert_non_null(e->logits_why);
        assert_non_null(e->expert_launch);
    }
    assert_int_equal(x->batches[0].logits_gemv, 1);
    assert_int_equal(x->batches[2].logits_gemv, 0);
    /* the ignored file is named once for the three batches */
    const char *w = strstr(x->warnings, bad);
    assert_non_null(w);
    assert_null(strstr(w + 1, bad));

    /* fm_explain = decide + render, warnings included */
    char warnings[4096];
    o.warnings = warnings;
    o.warnings_cap = sizeof warnings;
    for (int json = 0; json < 2; json++) {
        o.json = json;
        char *direct = NULL, *mine = render(x, json);
        assert_int_equal(fm_explain(&o, &direct), FM_OK);
        assert_string_equal(direct, mine);
        assert_string_equal(warnings, x->warnings);
        free(direct);
        free(mine);
    }
    fm_explanation_free(x);

    /* the CPU path: no GPU fields, the engine named in each batch */
    o.gpu = NULL;
    char why[256];
    if (!fm_cuda_available(why, sizeof why)) {
        assert_int_equal(fm_explain_decide(&o, &x), FM_OK);
        assert_false(x->gpu);
        assert_true(x->no_gpu_why[0] != 0);
        assert_true(x->batches[0].floor_us == 0);
        assert_false(x->batches[0].choice.tuned);
        char *t = render(x, 0);
        assert_non_null(strstr(t, "No kernel parameters to tune"));
        free(t);
        fm_explanation_free(x);
    }
    const int zero[] = {0};
    o.batches = zero;
    o.n_batches = 1;
    assert_int_equal(fm_explain_decide(&o, &x), FM_E_RANGE);
    assert_null(x);
    assert_int_equal(fm_explain_decide(NULL, &x), FM_E_ARG);
    remove(bad);
    rm_cfg(d->b, &k);
}

static char g_argv0[4096];

/* The copies compiled into the library are the repo's configs/, byte for
 * byte, one per file; the module found is this test program; and a build
 * tree binary without $FP4MOE_SHIPPED_CONFIGS uses the repo's file. */
static void test_builtin_copies(void **state) {
    (void)state;
    DIR *dd = opendir(FM_SOURCE_DIR "/configs");
    assert_non_null(dd);
    size_t n_json = 0;
    struct dirent *de;
    while ((de = readdir(dd)) != NULL) {
        size_t l = strlen(de->d_name);
        if (l <= 5 || strcmp(de->d_name + l - 5, ".json") != 0) continue;
        n_json++;
        size_t i = 0;
        while (i < fm_builtin_config_count && strcmp(fm_builtin_configs[i].name, de->d_name) != 0) i++;
        if (fm_builtin_config_count == 0) continue;
        assert_true(i < fm_builtin_config_count);
        char path[1200], *text = NULL;
        size_t len = 0;
        snprintf(path, sizeof path, "%s/configs/%s", FM_SOURCE_DIR, de->d_name);
        assert_int_equal(fm_read_file(path, 1u << 20, &text, &len), FM_OK);
        assert_int_equal(len, fm_builtin_configs[i].len);
        assert_memory_equal(text, fm_builtin_configs[i].text, len);
        assert_int_equal(fm_builtin_configs[i].text[len], 0);
        free(text);
    }
    closedir(dd);
    assert_true(n_json > 0);
#ifdef FM_EMBED_CONFIGS
    assert_int_equal(fm_builtin_config_count, n_json);
#else
    assert_int_equal(fm_builtin_config_count, 0); /* -DFM_EMBED_CONFIGS=OFF */
#endif

    char self[4096];
    assert_non_null(realpath(g_argv0, self));
    assert_string_equal(fm_tune_module_path(), self);

    unsetenv("FP4MOE_SHIPPED_CONFIGS");
    fm_tune_key k = fm_test_key_h200();
    char name[256];
    assert_int_equal(fm_tune_key_filename(&k, name, sizeof name), FM_OK);
    char want[1200];
    snprintf(want, sizeof want, "%s/configs/%s", FM_SOURCE_DIR, name);
    struct stat st;
    if (stat(want, &st) == 0) {
        fm_tune_choice c;
        assert_int_equal(fm_tune_choose(&k, 4, &c), FM_OK);
        assert_int_equal(c.tuned, 1);
        assert_string_equal(c.source, want);
    }
}

int main(int argc, char **argv) {
    (void)argc;
    snprintf(g_argv0, sizeof g_argv0, "%s", argv[0]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_default_when_nothing, setup, teardown),
        cmocka_unit_test_setup_teardown(test_nearest_shape, setup, teardown),
        cmocka_unit_test_setup_teardown(test_lookup_order, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unset_dirs, setup, teardown),
        cmocka_unit_test_setup_teardown(test_other_sm_file_named, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cache_sees_edits, setup, teardown),
        cmocka_unit_test_setup_teardown(test_json, setup, teardown),
        cmocka_unit_test_setup_teardown(test_memo, setup, teardown),
        cmocka_unit_test_setup_teardown(test_threads, setup, teardown),
        cmocka_unit_test_setup_teardown(test_explain, setup, teardown),
        cmocka_unit_test_setup_teardown(test_explain_spread, setup, teardown),
        cmocka_unit_test_setup_teardown(test_explain_quarters, setup, teardown),
        cmocka_unit_test_setup_teardown(test_explain_decide, setup, teardown),
        cmocka_unit_test_setup_teardown(test_builtin_copies, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
