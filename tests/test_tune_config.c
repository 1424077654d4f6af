/* Tuned config files: parsing and validation of good and malformed files,
 * key matching, nearest-bucket selection, the candidate grid, and
 * robustness of the parser on random and mutated input. */
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
#include "tune/tune_internal.h"
#include "util/util.h"

/* A valid file, written out by hand (not by the writer under test). */
static const char *k_good =
    "{\n"
    "  \"fp4moe_tune_config\": 1,\n"
    "  \"key\": {\"gpu\": \"NVIDIA H200\", \"sm_count\": 132, \"cuda_version\": 13000,\n"
    "          \"driver_version\": 13010, \"format\": \"nvfp4\", \"E\": 256, \"H\": 4096, \"I\": 2048, \"k\": 6},\n"
    "  \"buckets\": [\n"
    "    {\"batch\": 16, \"params\": {\"path\": \"large\", \"rows_per_block\": 64, \"k_split\": 1, \"warps\": 4,\n"
    "       \"stages\": 1, \"tile_n\": 16, \"switch_tpe\": 1.5},\n"
    "     \"us\": 240.5, \"us_min\": 239.0, \"us_max\": 242.0, \"default_us\": 260.25,\n"
    "     \"replaced_default\": true, \"date\": \"2026-11-29T10:00:00Z\", \"fp4moe_version\": \"0.1.0\"},\n"
    "    {\"batch\": 1, \"params\": {\"path\": \"small\", \"rows_per_block\": 16, \"k_split\": 8, \"warps\": 8,\n"
    "       \"stages\": 1, \"tile_n\": 8, \"switch_tpe\": 2},\n"
    "     \"us\": 21, \"default_us\": 21, \"date\": \"2026-11-29T10:00:00Z\", \"fp4moe_version\": \"0.1.0\",\n"
    "     \"unknown_future_field\": [1, 2, 3]}\n"
    "  ]\n"
    "}\n";

static char *mutate(const char *from, const char *to);

static void test_parse_good(void **st) {
    (void)st;
    fm_tune_file f;
    assert_int_equal(fm_tune_file_parse(k_good, strlen(k_good), "good.json", &f), FM_OK);
    assert_string_equal(f.key.gpu_name, "NVIDIA H200");
    assert_int_equal(f.key.sm_count, 132);
    assert_int_equal(f.key.cuda_version, 13000);
    assert_int_equal(f.key.driver_version, 13010);
    assert_int_equal(f.key.fmt, FM_QF_NVFP4);
    assert_int_equal(f.key.E, 256);
    assert_int_equal(f.key.H, 4096);
    assert_int_equal(f.key.I, 2048);
    assert_int_equal(f.key.k, 6);
    assert_int_equal(f.n, 2);
    /* Sorted by batch although the file lists 16 first. */
    assert_int_equal(f.b[0].batch, 1);
    assert_int_equal(f.b[1].batch, 16);
    const fm_tune_bucket *b = &f.b[1];
    assert_int_equal(b->cfg.path, FM_PATH_LARGE);
    assert_int_equal(b->cfg.rows_per_block, 64);
    assert_int_equal(b->cfg.k_split, 1);
    assert_int_equal(b->cfg.warps, 4);
    assert_int_equal(b->cfg.stages, 1);
    assert_int_equal(b->cfg.tile_n, 16);
    assert_true(b->cfg.switch_tpe == 1.5f);
    assert_true(b->us == 240.5 && b->us_min == 239.0 && b->us_max == 242.0);
    assert_true(b->default_us == 260.25);
    /* Absent spread: min = max = median. */
    assert_true(b->default_us_min == 260.25 && b->default_us_max == 260.25);
    assert_int_equal(b->replaced_default, 1);
    assert_string_equal(b->date, "2026-11-29T10:00:00Z");
    assert_string_equal(b->version, "0.1.0");
    assert_int_equal(f.b[0].cfg.path, FM_PATH_SMALL);
    assert_int_equal(f.b[0].replaced_default, 0);
    assert_true(f.b[0].cfg.switch_tpe == 2.0f); /* an integer where a number is expected */
    /* the third path's token */
    char *w = mutate("\"path\": \"large\"", "\"path\": \"wgmma\"");
    fm_tune_file fw;
    assert_int_equal(fm_tune_file_parse(w, strlen(w), "wgmma.json", &fw), FM_OK);
    assert_int_equal(fw.b[1].cfg.path, FM_PATH_WGMMA);
    assert_string_equal(fm_tune_path_token(FM_PATH_WGMMA), "wgmma");
    free(w);
}

/* Replaces the first occurrence of `from` in k_good by `to`. */
static char *mutate(const char *from, const char *to) {
    const char *p = strstr(k_good, from);
    assert_non_null(p);
    size_t n = strlen(k_good) - strlen(from) + strlen(to) + 1;
    char *s = malloc(n);
    assert_non_null(s);
    snprintf(s, n, "%.*s%s%s", (int)(p - k_good), k_good, to, p + strlen(from));
    return s;
}

static void test_parse_malformed(void **st) {
    (void)st;
    struct {
        const char *from, *to, *expect; /* expect: substring of the message */
    } cases[] = {
        {"\"batch\": 16", "\"batch\": \"16\"", "buckets[0].batch: must be an integer"},
        {"\"batch\": 16", "\"batch\": 0", "buckets[0].batch: 0 is outside"},
        {"\"batch\": 16", "\"batch\": 1", "buckets[1].batch: 1 appears twice"},
        {"\"batch\": 16", "\"batch\": 16.5", "buckets[0].batch: must be an integer"},
        {"\"batch\": 16, ", "", "buckets[0].batch: missing"},
        {"\"warps\": 4", "\"warps\": -4", "buckets[0].params.warps: -4 is outside"},
        {"\"warps\": 4", "\"warps\": 4.0", "buckets[0].params.warps: must be an integer"},
        {"\"warps\": 4,", "", "buckets[0].params.warps: missing"},
        {"\"k_split\": 1", "\"k_split\": 0", "buckets[0].params.k_split: 0 is outside"},
        {"\"rows_per_block\": 64", "\"rows_per_block\": 100000000000", "rows_per_block: 100000000000 is outside"},
        {"\"tile_n\": 16", "\"tile_n\": null", "buckets[0].params.tile_n: must be an integer"},
        {"\"stages\": 1", "\"stages\": 99", "buckets[0].params.stages: 99 is outside [1, 1]"},
        {"\"switch_tpe\": 1.5", "\"switch_tpe\": -1", "switch_tpe: -1 is outside"},
        {"\"switch_tpe\": 1.5", "\"switch_tpe\": \"1.5\"", "switch_tpe: must be a number"},
        {"\"path\": \"large\"", "\"path\": \"medium\"", "unknown path 'medium'"},
        {"\"path\": \"large\", \"rows_per_block\": 64", "\"path\": \"wgmma\", \"rows_per_block\": 32",
         "buckets[0].params.path: the wgmma path takes k_split 1 and rows_per_block 64, warps 4, tile_n 8|16|32 or "
         "128, 8, 16|32; not rows_per_block 32, k_split 1, warps 4, tile_n 16"},
        {"\"path\": \"large\"", "\"path\": 1", "buckets[0].params.path: must be a string"},
        {"\"params\": {\"path\": \"large\"", "\"params\": [], \"x\": {\"path\": \"large\"", "params: must be an object"},
        {"\"us\": 240.5", "\"us\": -3", "buckets[0].us: -3 is outside"},
        {"\"us\": 240.5", "\"us\": 250", "buckets[0].us: not within [us_min, us_max]"},
        {"\"default_us\": 260.25", "\"default_us\": true", "buckets[0].default_us: must be a number"},
        {"\"date\": \"2026-11-29T10:00:00Z\"", "\"date\": 20261129", "buckets[0].date: must be a string"},
        {"\"date\": \"2026-11-29T10:00:00Z\"", "\"date\": \"\"", "buckets[0].date: is empty"},
        {", \"fp4moe_version\": \"0.1.0\"}", "}", "buckets[0].fp4moe_version: missing"},
        {"\"replaced_default\": true", "\"replaced_default\": 1", "replaced_default: must be true or false"},
        {"\"fp4moe_tune_config\": 1", "\"fp4moe_tune_config\": 2", "version 2 is not supported"},
        {"\"fp4moe_tune_config\": 1,", "", "fp4moe_tune_config: missing"},
        {"\"gpu\": \"NVIDIA H200\"", "\"gpu\": 200", "key.gpu: must be a string"},
        {"\"gpu\": \"NVIDIA H200\", ", "", "key.gpu: missing"},
        {"\"sm_count\": 132", "\"sm_count\": -132", "key.sm_count: -132 is outside"},
        {"\"format\": \"nvfp4\"", "\"format\": \"fp3\"", "key.format: unknown format 'fp3'"},
        {"\"k\": 6", "\"k\": 300", "key.k: 300 is larger than E = 256"},
        {"\"E\": 256, ", "", "key.E: missing"},
        {"\"key\": {", "\"key\": 5, \"x\": {", "key: must be an object"},
        {"\"buckets\": [", "\"buckets\": {\"a\": [", "not valid JSON"},
        {"\"buckets\": [", "\"buckets\": 7, \"y\": [", "buckets: must be an array"},
        {"\"E\": 256", "\"E\": 256, \"E\": 255", "not valid JSON"}, /* duplicate key: no last-one-wins */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *s = mutate(cases[i].from, cases[i].to);
        fm_tune_file f;
        fm_status st2 = fm_tune_file_parse(s, strlen(s), "bad.json", &f);
        if (st2 != FM_E_FORMAT || !strstr(fm_last_error(), cases[i].expect) || !strstr(fm_last_error(), "bad.json"))
            fail_msg("case %zu (%s -> %s): status %d, message '%s', expected '%s'", i, cases[i].from, cases[i].to,
                     (int)st2, fm_last_error(), cases[i].expect);
        assert_int_equal(f.n, 0); /* nothing half-parsed is left behind */
        free(s);
    }
    const char *whole[][2] = {
        {"", "not valid JSON"},
        {"[]", "top level must be a JSON object"},
        {"{\"fp4moe_tune_config\": 1, \"key\": {\"gpu\": \"g\", \"sm_count\": 1, \"cuda_version\": 0, "
         "\"driver_version\": 0, \"format\": \"nvfp4\", \"E\": 8, \"H\": 64, \"I\": 32, \"k\": 2}, \"buckets\": []}",
         "buckets: is empty"},
        {"{\"fp4moe_tune_config\": 1}", "key: missing"},
        {"null", "not valid JSON"},
        {"{\"a\": \"\\u0000\"}", "not valid JSON"},
    };
    for (size_t i = 0; i < sizeof whole / sizeof whole[0]; i++) {
        fm_tune_file f;
        assert_int_equal(fm_tune_file_parse(whole[i][0], strlen(whole[i][0]), "w.json", &f), FM_E_FORMAT);
        if (!strstr(fm_last_error(), whole[i][1])) fail_msg("whole %zu: '%s'", i, fm_last_error());
    }
    /* More buckets than allowed. */
    size_t cap = 200000;
    char *big = malloc(cap);
    assert_non_null(big);
    int n = snprintf(big, cap, "{\"fp4moe_tune_config\": 1, \"key\": {\"gpu\": \"g\", \"sm_count\": 1, \"cuda_version\": 0, "
                               "\"driver_version\": 0, \"format\": \"nvfp4\", \"E\": 8, \"H\": 64, \"I\": 32, \"k\": 2}, \"buckets\": [");
    for (int i = 1; i <= FM_TUNE_MAX_BUCKETS + 1; i++)
        n += snprintf(big + n, cap - (size_t)n,
                      "%s{\"batch\": %d, \"params\": {\"path\": \"small\", \"rows_per_block\": 1, \"k_split\": 1, \"warps\": 1,"
                      " \"stages\": 1, \"tile_n\": 1, \"switch_tpe\": 1}, \"us\": 1, \"default_us\": 1, \"date\": \"d\","
                      " \"fp4moe_version\": \"v\"}",
                      i > 1 ? "," : "", i);
    snprintf(big + n, cap - (size_t)n, "]}");
    fm_tune_file f;
    assert_int_equal(fm_tune_file_parse(big, strlen(big), "big.json", &f), FM_E_FORMAT);
    assert_non_null(strstr(fm_last_error(), "more than 64"));
    free(big);
}

static void test_roundtrip(void **st) {
    (void)st;
    fm_tune_file f, g;
    assert_int_equal(fm_tune_file_parse(k_good, strlen(k_good), "good.json", &f), FM_OK);
    char *s = fm_tune_file_to_json(&f);
    assert_non_null(s);
    assert_int_equal(fm_tune_file_parse(s, strlen(s), "again.json", &g), FM_OK);
    assert_memory_equal(&f.key, &g.key, sizeof f.key);
    assert_int_equal(g.n, f.n);
    for (int i = 0; i < f.n; i++) {
        assert_int_equal(g.b[i].batch, f.b[i].batch);
        assert_memory_equal(&g.b[i].cfg, &f.b[i].cfg, sizeof f.b[i].cfg);
        assert_true(fabs(g.b[i].us - f.b[i].us) < 0.006);
        assert_true(fabs(g.b[i].default_us - f.b[i].default_us) < 0.006);
        assert_string_equal(g.b[i].date, f.b[i].date);
    }
    free(s);
}

static void test_key_match(void **st) {
    (void)st;
    fm_tune_key a = fm_test_key_h200(), b;
    char note[256];
    assert_int_equal(fm_tune_key_match(&a, &a, note, sizeof note), FM_TUNE_MATCH);
    assert_string_equal(note, "");
    b = a; snprintf(b.gpu_name, sizeof b.gpu_name, "NVIDIA H100 80GB HBM3");
    assert_int_equal(fm_tune_key_match(&a, &b, note, sizeof note), FM_TUNE_MISMATCH_SHAPE);
    assert_non_null(strstr(note, "NVIDIA H200"));
    b = a; b.fmt = FM_QF_MXFP4;
    assert_int_equal(fm_tune_key_match(&a, &b, note, sizeof note), FM_TUNE_MISMATCH_SHAPE);
    b = a; b.E = 255;
    assert_int_equal(fm_tune_key_match(&a, &b, note, sizeof note), FM_TUNE_MISMATCH_SHAPE);
    b = a; b.H = 7168;
    assert_int_equal(fm_tune_key_match(&a, &b, note, sizeof note), FM_TUNE_MISMATCH_SHAPE);
    b = a; b.I = 1024;
    assert_int_equal(fm_tune_key_match(&a, &b, note, sizeof note), FM_TUNE_MISMATCH_SHAPE);
    b = a; b.k = 8;
    assert_int_equal(fm_tune_key_match(&a, &b, note, sizeof note), FM_TUNE_MISMATCH_SHAPE);
    b = a; b.sm_count = 114;
    assert_int_equal(fm_tune_key_match(&a, &b, note, sizeof note), FM_TUNE_MISMATCH_SM);
    assert_non_null(strstr(note, "132"));
    assert_non_null(strstr(note, "114"));
    /* Versions differ: used, with a note. */
    b = a; b.cuda_version = 12080; b.driver_version = 12090;
    assert_int_equal(fm_tune_key_match(&a, &b, note, sizeof note), FM_TUNE_MATCH);
    assert_non_null(strstr(note, "CUDA runtime 13000, running 12080"));
    assert_non_null(strstr(note, "driver 13010, running 12090"));
    /* Unknown versions (explain --gpu) are no difference. */
    b = a; b.cuda_version = 0; b.driver_version = 0;
    assert_int_equal(fm_tune_key_match(&a, &b, note, sizeof note), FM_TUNE_MATCH);
    assert_string_equal(note, "");
}

static void test_filename(void **st) {
    (void)st;
    fm_tune_key k = fm_test_key_h200();
    char buf[256];
    assert_int_equal(fm_tune_key_filename(&k, buf, sizeof buf), FM_OK);
    assert_string_equal(buf, "NVIDIA_H200-132sm-nvfp4-E256-H4096-I2048-k6.json");
    snprintf(k.gpu_name, sizeof k.gpu_name, "NVIDIA RTX PRO 6000 Blackwell/../x");
    k.fmt = FM_QF_MXFP4;
    k.sm_count = 188;
    assert_int_equal(fm_tune_key_filename(&k, buf, sizeof buf), FM_OK);
    /* No path separators survive: a GPU name cannot point outside the dir. */
    assert_string_equal(buf, "NVIDIA_RTX_PRO_6000_Blackwell_.._x-188sm-mxfp4-E256-H4096-I2048-k6.json");
    assert_int_equal(fm_tune_key_filename(&k, buf, 10), FM_E_ARG);
}

static void test_nearest_bucket(void **st) {
    (void)st;
    const int b[] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512};
    const int nb = 10;
    /* Hand-worked on a log scale: distance max(T/b, b/T). */
    assert_int_equal(b[fm_tune_nearest_bucket(b, nb, 1)], 1);
    assert_int_equal(b[fm_tune_nearest_bucket(b, nb, 3)], 4);   /* 3/2 = 1.5 > 4/3 */
    assert_int_equal(b[fm_tune_nearest_bucket(b, nb, 5)], 4);   /* 5/4 = 1.25 < 8/5 */
    assert_int_equal(b[fm_tune_nearest_bucket(b, nb, 6)], 8);   /* 6/4 = 1.5 > 8/6 */
    assert_int_equal(b[fm_tune_nearest_bucket(b, nb, 45)], 32); /* 45/32 = 1.406 < 64/45 = 1.422 */
    assert_int_equal(b[fm_tune_nearest_bucket(b, nb, 46)], 64); /* 46/32 = 1.4375 > 64/46 = 1.391 */
    assert_int_equal(b[fm_tune_nearest_bucket(b, nb, 100000)], 512);
    /* Exact ties go to the smaller bucket, wherever it is listed. */
    const int t1[] = {2, 8};
    assert_int_equal(t1[fm_tune_nearest_bucket(t1, 2, 4)], 2);
    const int t2[] = {8, 2};
    assert_int_equal(t2[fm_tune_nearest_bucket(t2, 2, 4)], 2);
    const int t3[] = {16, 4};
    assert_int_equal(t3[fm_tune_nearest_bucket(t3, 2, 8)], 4);
    const int one[] = {64};
    assert_int_equal(fm_tune_nearest_bucket(one, 1, 3), 0);
}

static void test_expected_active(void **st) {
    (void)st;
    /* B = 1: exactly k experts; many tokens: all E. */
    assert_true(fabs(fm_tune_expected_active(256, 6, 1) - 6.0) < 1e-9);
    assert_true(fabs(fm_tune_expected_active(256, 6, 100000) - 256.0) < 1e-9);
    /* REFERENCE.md: DeepSeek-V4-Flash, about 218 active at B = 80. */
    assert_true(fabs(fm_tune_expected_active(256, 6, 80) - 218.0) < 0.5);
    /* Hand-worked: E=4, k=2, B=2: 4*(1-(1/2)^2) = 3; tokens per expert 2*2/3. */
    assert_true(fabs(fm_tune_expected_active(4, 2, 2) - 3.0) < 1e-12);
    assert_true(fabs(fm_tune_tokens_per_expert(4, 2, 2) - 4.0 / 3.0) < 1e-12);
    assert_true(fm_tune_expected_active(0, 2, 2) == 0.0);
}

static void test_candidates(void **st) {
    (void)st;
    fm_tune_key keys[2] = {fm_test_key_h200(), fm_test_key_h200()};
    keys[1].I = 2880; /* gpt-oss-120b: 128-row wgmma blocks would stream rows they do not use */
    keys[1].H = 2880;
    const int Ts[] = {1, 4, 16, 64, 512};
    for (int ki = 0; ki < 2; ki++)
        for (size_t t = 0; t < sizeof Ts / sizeof Ts[0]; t++) {
            const fm_tune_key k = keys[ki];
            fm_kernel_config c[FM_TUNE_GRID_MAX];
            int n = fm_tune_candidates(&k, Ts[t], c, FM_TUNE_GRID_MAX);
            fm_kernel_config def = fm_kernel_config_default(&k, Ts[t]);
            assert_true(n >= 2);
            assert_memory_equal(&c[0], &def, sizeof def); /* the default first */
            int paths[3] = {0, 0, 0}, wg2 = 0;
            for (int i = 0; i < n; i++) {
                char why[128];
                assert_int_equal(fm_tune_config_invalid(&c[i], why, sizeof why), 0);
                assert_true(c[i].path >= FM_PATH_SMALL && c[i].path <= FM_PATH_WGMMA);
                paths[c[i].path]++;
                if (c[i].path == FM_PATH_WGMMA) { /* two block shapes */
                    assert_int_equal(c[i].k_split, 1);
                    if (c[i].warps == 4)
                        assert_true(c[i].rows_per_block == 64 &&
                                    (c[i].tile_n == 8 || c[i].tile_n == 16 || c[i].tile_n == 32));
                    else
                        assert_true(c[i].warps == 8 && c[i].rows_per_block == 128 &&
                                    (c[i].tile_n == 16 || c[i].tile_n == 32));
                    wg2 += c[i].warps == 8;
                }
                for (int j = 0; j < i; j++) assert_memory_not_equal(&c[i], &c[j], sizeof c[i]);
            }
            /* every path is always a candidate, the wgmma one with its three
             * pass sizes, and two more with two warpgroups where the rows fill
             * their blocks */
            assert_true(paths[0] > 0 && paths[1] > 0 && paths[2] == (ki == 0 ? 5 : 3));
            assert_int_equal(wg2, ki == 0 ? 2 : 0);
            fm_kernel_config few[3];
            assert_int_equal(fm_tune_candidates(&k, Ts[t], few, 3), 3);
            assert_memory_equal(few, c, 3 * sizeof c[0]);
        }
    fm_kernel_config c[4];
    assert_int_equal(fm_tune_candidates(&keys[0], 0, c, 4), 0);
    assert_int_equal(fm_tune_candidates(&keys[0], 1, c, 0), 0);
}

static void test_config_ranges(void **st) {
    (void)st;
    fm_tune_key k = fm_test_key_h200();
    fm_kernel_config c = fm_kernel_config_default(&k, 1);
    char why[128];
    assert_int_equal(fm_tune_config_invalid(&c, why, sizeof why), 0);
    fm_kernel_config x = c; x.path = (fm_kernel_path)7;
    assert_int_equal(fm_tune_config_invalid(&x, why, sizeof why), 1);
    x = c; x.warps = 0;
    assert_int_equal(fm_tune_config_invalid(&x, why, sizeof why), 1);
    assert_non_null(strstr(why, "warps"));
    x = c; x.switch_tpe = NAN;
    assert_int_equal(fm_tune_config_invalid(&x, why, sizeof why), 1);
    /* the wgmma path: its block shape, passes of 8, 16 or 32 tokens */
    fm_kernel_config w = fm_kernel_config_default(&k, 512);
    assert_int_equal(w.path, FM_PATH_WGMMA);
    assert_int_equal(fm_tune_config_invalid(&w, why, sizeof why), 0);
    x = w; x.tile_n = 8;
    assert_int_equal(fm_tune_config_invalid(&x, why, sizeof why), 0);
    x = w; x.tile_n = 24;
    assert_int_equal(fm_tune_config_invalid(&x, why, sizeof why), 1);
    assert_non_null(strstr(why, "wgmma path takes"));
    /* two warpgroups: 128 rows, 8 warps, passes of 16 or 32 only */
    x = w; x.warps = 8; x.rows_per_block = 128;
    assert_int_equal(fm_tune_config_invalid(&x, why, sizeof why), 0);
    x.tile_n = 16;
    assert_int_equal(fm_tune_config_invalid(&x, why, sizeof why), 0);
    x.tile_n = 8;
    assert_int_equal(fm_tune_config_invalid(&x, why, sizeof why), 1);
    x = w; x.warps = 8; x.rows_per_block = 64;
    assert_int_equal(fm_tune_config_invalid(&x, why, sizeof why), 1);
    x = w; x.warps = 4; x.rows_per_block = 128;
    assert_int_equal(fm_tune_config_invalid(&x, why, sizeof why), 1);
    /* the splitk path: the default for one token on a TP8 rank's narrow
     * experts (GLM-5: I 256, H 6144: 48 segments of K in 16 chunks of 3), not
     * at two tokens nor on whole experts; 16 rows, 8 warps, 1 .. 16 chunks,
     * passes of 8 or 16 tokens */
    fm_tune_key tp = k;
    tp.E = 256; tp.H = 6144; tp.I = 256; tp.k = 8;
    fm_kernel_config s1 = fm_kernel_config_default(&tp, 1);
    assert_int_equal(s1.path, FM_PATH_SPLITK);
    assert_int_equal(s1.k_split, 16);
    assert_int_equal(fm_tune_config_invalid(&s1, why, sizeof why), 0);
    assert_int_not_equal(fm_kernel_config_default(&tp, 2).path, FM_PATH_SPLITK);
    assert_int_not_equal(fm_kernel_config_default(&k, 1).path, FM_PATH_SPLITK);
    assert_int_equal(fm_tune_path_from_token("splitk"), FM_PATH_SPLITK);
    assert_string_equal(fm_tune_path_token(FM_PATH_SPLITK), "splitk");
    x = s1; x.k_split = 17;
    assert_int_equal(fm_tune_config_invalid(&x, why, sizeof why), 1);
    assert_non_null(strstr(why, "splitk path takes"));
    x = s1; x.warps = 4;
    assert_int_equal(fm_tune_config_invalid(&x, why, sizeof why), 1);
    x = s1; x.tile_n = 32;
    assert_int_equal(fm_tune_config_invalid(&x, why, sizeof why), 1);
    x = s1; x.tile_n = 16; x.k_split = 1;
    assert_int_equal(fm_tune_config_invalid(&x, why, sizeof why), 0);
    /* the tuner tries it up to 16 tokens, with at most as many chunks as K
     * has segments (tiny H: 640 = 5 segments) */
    for (int T = 1; T <= 32; T *= 2) {
        fm_kernel_config c[FM_TUNE_GRID_MAX];
        int n = fm_tune_candidates(&tp, T, c, FM_TUNE_GRID_MAX), nsk = 0;
        for (int i = 0; i < n; i++) nsk += c[i].path == FM_PATH_SPLITK;
        assert_int_equal(nsk, T <= FM_SPLITK_MAX_TOKENS ? 6 : 0);
    }
    fm_tune_key small = tp;
    small.H = 640;
    fm_kernel_config c5[FM_TUNE_GRID_MAX];
    int n5 = fm_tune_candidates(&small, 4, c5, FM_TUNE_GRID_MAX);
    for (int i = 0; i < n5; i++)
        if (c5[i].path == FM_PATH_SPLITK) assert_true(c5[i].k_split <= 5);
}

/* Every prefix of a valid file fails cleanly (truncated downloads or
 * disk-full writes), and random bytes or random byte flips never crash and
 * never yield a file whose values are out of range. */
static void test_fuzzish(void **st) {
    (void)st;
    size_t n = strlen(k_good);
    size_t last = (size_t)(strrchr(k_good, '}') - k_good) + 1;
    for (size_t len = 0; len < n; len++) {
        fm_tune_file f;
        fm_status s = fm_tune_file_parse(k_good, len, "prefix.json", &f);
        if (len < last) assert_int_equal(s, FM_E_FORMAT);
        else assert_int_equal(s, FM_OK); /* only the final newline is missing */
    }
    char *buf = malloc(n + 1);
    assert_non_null(buf);
    int ok = 0;
    for (uint64_t it = 0; it < 20000; it++) {
        memcpy(buf, k_good, n + 1);
        int flips = 1 + (int)(fm_rng_u64(99, 1, it) % 4);
        for (int j = 0; j < flips; j++) {
            uint64_t r = fm_rng_u64(99, 2, it * 8 + (uint64_t)j);
            buf[r % n] = (char)(r >> 32);
        }
        size_t len = (fm_rng_u64(99, 3, it) % 8 == 0) ? fm_rng_u64(99, 4, it) % (n + 1) : n;
        fm_tune_file f;
        fm_status s = fm_tune_file_parse(buf, len, "fuzz.json", &f);
        assert_true(s == FM_OK || s == FM_E_FORMAT);
        if (s == FM_OK) {
            ok++;
            assert_true(f.n >= 1 && f.n <= FM_TUNE_MAX_BUCKETS);
            for (int i = 0; i < f.n; i++) {
                char why[128];
                assert_int_equal(fm_tune_config_invalid(&f.b[i].cfg, why, sizeof why), 0);
                assert_true(f.b[i].batch >= 1);
                assert_true(isfinite(f.b[i].us) && f.b[i].us > 0);
            }
        } else {
            assert_true(strlen(fm_last_error()) > 0);
        }
    }
    /* Pure random bytes. */
    for (uint64_t it = 0; it < 2000; it++) {
        size_t len = fm_rng_u64(7, 1, it) % 300;
        for (size_t j = 0; j < len; j++) buf[j % n] = (char)fm_rng_u64(7, 2, it * 512 + j);
        fm_tune_file f;
        assert_int_equal(fm_tune_file_parse(buf, len < n ? len : n, "rand.json", &f), FM_E_FORMAT);
    }
    free(buf);
    (void)ok;
}

static void test_gpu_table(void **st) {
    (void)st;
    const fm_gpu_info *g = fm_gpu_lookup("NVIDIA H200");
    assert_non_null(g);
    assert_int_equal(g->sm_count, 132);
    assert_ptr_equal(fm_gpu_lookup("h200"), g);
    assert_ptr_equal(fm_gpu_lookup("  H200 "), g);
    assert_ptr_equal(fm_gpu_lookup("nvidia h200"), g);
    assert_int_equal(fm_gpu_lookup("H100 PCIe")->sm_count, 114);
    assert_int_equal(fm_gpu_lookup("H100")->sm_count, 132);
    assert_int_equal(fm_gpu_lookup("A100")->sm_count, 108);
    assert_int_equal(fm_gpu_lookup("L40S")->sm_count, 142);
    assert_int_equal(fm_gpu_lookup("RTX 4090")->sm_count, 128);
    assert_int_equal(fm_gpu_lookup("RTX PRO 6000")->sm_count, 188);
    assert_int_equal(fm_gpu_lookup("B200")->sm_count, 148);
    assert_int_equal(fm_gpu_lookup("B200")->cc, 100);
    assert_int_equal(fm_gpu_lookup("RTX 5090")->sm_count, 170);
    assert_int_equal(fm_gpu_lookup("RTX 5090")->cc, 120);
    /* the three RTX PRO 6000 boards are three CUDA names (three config keys) */
    const fm_gpu_info *ws = fm_gpu_lookup("NVIDIA RTX PRO 6000 Blackwell Workstation Edition");
    const fm_gpu_info *se = fm_gpu_lookup("NVIDIA RTX PRO 6000 Blackwell Server Edition");
    const fm_gpu_info *mq = fm_gpu_lookup("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition");
    assert_non_null(ws);
    assert_non_null(se);
    assert_non_null(mq);
    assert_true(ws != se && se != mq && ws != mq);
    assert_ptr_equal(fm_gpu_lookup("RTX PRO 6000"), ws);
    assert_ptr_equal(fm_gpu_lookup("RTX PRO 6000 Server"), se);
    assert_true(se->bandwidth_gbs < ws->bandwidth_gbs && mq->power_w < ws->power_w);
    assert_null(fm_gpu_lookup("H2000"));
    assert_null(fm_gpu_lookup(""));
    assert_null(fm_gpu_lookup(NULL));
    for (size_t i = 0; i < fm_gpu_count(); i++) {
        const fm_gpu_info *x = fm_gpu_at(i);
        assert_ptr_equal(fm_gpu_lookup(x->name), x);
        assert_true(x->bandwidth_gbs > 0 && x->l2_mb > 0 && x->sm_count > 0);
        assert_true(x->memory_gb > 0 && x->power_w > 0 && x->cc >= 80);
        /* Blackwell (sm_100 and later) and only it has FP4 tensor cores */
        assert_int_equal(x->fp4_tensor_cores, x->cc >= 100);
    }
    assert_null(fm_gpu_at(fm_gpu_count()));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_good),     cmocka_unit_test(test_parse_malformed),
        cmocka_unit_test(test_roundtrip),      cmocka_unit_test(test_key_match),
        cmocka_unit_test(test_filename),       cmocka_unit_test(test_nearest_bucket),
        cmocka_unit_test(test_expected_active), cmocka_unit_test(test_candidates),
        cmocka_unit_test(test_config_ranges),  cmocka_unit_test(test_fuzzish),
        cmocka_unit_test(test_gpu_table),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
