/*
 * Checkpoint directories: a sharded checkpoint written with the
 * safetensors writer, a single-file one, and the failure cases (missing
 * shard, path traversal in weight_map, tensor absent from its shard, bad
 * index files, a corrupt shard that is only reported when used).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fm_test.h"
#include "util/util.h"

static char g_dir[64];

static int setup(void **st) {
    (void)st;
    return fm_test_mkdtemp(g_dir, sizeof g_dir, "ckpt_test");
}
static int teardown(void **st) {
    (void)st;
    fm_test_clear_dir(g_dir);
    return rmdir(g_dir);
}

static void put_bin(const char *name, const void *data, size_t len) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s", g_dir, name);
    assert_int_equal(fm_write_file_atomic(p, data, len), FM_OK);
}
static void put(const char *name, const char *text) { put_bin(name, text, strlen(text)); }

/* A shard holding F32 tensors [4] named names[i] with values base+i*10+j. */
static void shard(const char *file, const char *const *names, int n, float base) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s", g_dir, file);
    fm_st_writer *w;
    assert_int_equal(fm_st_writer_new(p, &w), FM_OK);
    int64_t sh[1] = {4};
    for (int i = 0; i < n; i++)
        assert_int_equal(fm_st_writer_declare(w, names[i], FM_DT_F32, 1, sh), FM_OK);
    for (int i = 0; i < n; i++) {
        float v[4];
        for (int j = 0; j < 4; j++) v[j] = base + (float)(i * 10 + j);
        assert_int_equal(fm_st_writer_write(w, v, sizeof v), FM_OK);
    }
    assert_int_equal(fm_st_writer_finish(w), FM_OK);
}

static float first_value(const fm_st_tensor *t) {
    float v;
    memcpy(&v, t->data, 4);
    return v;
}

static const char *const k_s1[] = {"layers.0.w", "layers.0.b"};
static const char *const k_s2[] = {"layers.1.w"};
static const char *const k_s3[] = {"layers.2.w"};

static void write_sharded(void) {
    fm_test_clear_dir(g_dir);
    shard("model-00001-of-00003.safetensors", k_s1, 2, 100);
    shard("model-00002-of-00003.safetensors", k_s2, 1, 200);
    shard("model-00003-of-00003.safetensors", k_s3, 1, 300);
}

static const char *k_index =
    "{\"metadata\": {\"total_size\": 64}, \"weight_map\": {"
    "\"layers.0.w\": \"model-00001-of-00003.safetensors\","
    "\"layers.0.b\": \"model-00001-of-00003.safetensors\","
    "\"layers.1.w\": \"model-00002-of-00003.safetensors\","
    "\"layers.2.w\": \"model-00003-of-00003.safetensors\"}}";

static void test_sharded(void **st) {
    (void)st;
    write_sharded();
    put("model.safetensors.index.json", k_index);
    fm_ckpt *c;
    assert_int_equal(fm_ckpt_open(g_dir, &c), FM_OK);
    assert_string_equal(fm_ckpt_dir(c), g_dir);
    assert_int_equal(fm_ckpt_count(c), 4);
    /* Names come back sorted. */
    assert_string_equal(fm_ckpt_name_at(c, 0), "layers.0.b");
    assert_string_equal(fm_ckpt_name_at(c, 3), "layers.2.w");
    assert_null(fm_ckpt_name_at(c, 4));
    const fm_st_tensor *t = fm_ckpt_find(c, "layers.1.w");
    assert_non_null(t);
    assert_true(first_value(t) == 200.0f);
    t = fm_ckpt_find(c, "layers.0.b");
    assert_true(first_value(t) == 110.0f);
    assert_int_equal(t->shape[0], 4);
    assert_ptr_equal(fm_ckpt_find(c, "layers.0.b"), t); /* shard kept open */
    assert_true(first_value(fm_ckpt_find(c, "layers.2.w")) == 300.0f);
    fm_clear_error();
    assert_null(fm_ckpt_find(c, "layers.9.w"));
    assert_non_null(strstr(fm_last_error(), "no tensor 'layers.9.w'"));
    fm_ckpt_close(c);
}

static void test_lazy_shards(void **st) {
    (void)st;
    write_sharded();
    put("model.safetensors.index.json", k_index);
    /* Corrupt shard 3 (data does not end at file end): opening succeeds,
     * tensors of other shards work, only its own tensor fails. */
    put_bin("model-00003-of-00003.safetensors", "\x02\0\0\0\0\0\0\0{}xx", 12);
    fm_ckpt *c;
    assert_int_equal(fm_ckpt_open(g_dir, &c), FM_OK);
    assert_non_null(fm_ckpt_find(c, "layers.0.w"));
    assert_null(fm_ckpt_find(c, "layers.2.w"));
    assert_non_null(strstr(fm_last_error(), "model-00003-of-00003.safetensors"));
    assert_non_null(strstr(fm_last_error(), "tensor 'layers.2.w'"));
    assert_non_null(strstr(fm_last_error(), "data must end exactly"));
    assert_non_null(fm_ckpt_find(c, "layers.1.w"));
    fm_ckpt_close(c);
}

static void test_missing_shard(void **st) {
    (void)st;
    write_sharded();
    put("model.safetensors.index.json", k_index);
    char p[512];
    snprintf(p, sizeof p, "%s/model-00002-of-00003.safetensors", g_dir);
    unlink(p);
    fm_ckpt *c = (fm_ckpt *)1;
    assert_int_equal(fm_ckpt_open(g_dir, &c), FM_E_NOTFOUND);
    assert_null(c);
    assert_non_null(strstr(fm_last_error(), "shard 'model-00002-of-00003.safetensors'"));
    assert_non_null(strstr(fm_last_error(), "tensor 'layers.1.w'"));
}

static void test_bad_index(void **st) {
    (void)st;
    write_sharded();
    static const struct { const char *json; fm_status st; const char *msg; } B[] = {
        {"{\"weight_map\": {\"a\": \"../model-00001-of-00003.safetensors\"}}", FM_E_FORMAT,
         "plain file name"},
        {"{\"weight_map\": {\"a\": \"/etc/passwd\"}}", FM_E_FORMAT, "plain file name"},
        {"{\"weight_map\": {\"a\": \"sub/x.safetensors\"}}", FM_E_FORMAT, "plain file name"},
        {"{\"weight_map\": {\"a\": \"..\"}}", FM_E_FORMAT, "plain file name"},
        {"{\"weight_map\": {\"a\": \"\"}}", FM_E_FORMAT, "plain file name"},
        {"{\"weight_map\": {\"a\": 3}}", FM_E_FORMAT, "weight_map['a'] is not a file name"},
        {"{\"metadata\": {}}", FM_E_FORMAT, "no \"weight_map\" object"},
        {"[1, 2]", FM_E_FORMAT, "no \"weight_map\" object"},
        {"{\"weight_map\": {", FM_E_FORMAT, "invalid JSON"},
        {"{\"weight_map\": {\"a\": \"x\", \"a\": \"y\"}}", FM_E_FORMAT, "duplicate"},
    };
    for (size_t i = 0; i < sizeof B / sizeof B[0]; i++) {
        put("model.safetensors.index.json", B[i].json);
        fm_ckpt *c = (fm_ckpt *)1;
        fm_status s = fm_ckpt_open(g_dir, &c);
        if (s != B[i].st || !strstr(fm_last_error(), B[i].msg))
            fail_msg("index %s: got %s: %s", B[i].json, fm_status_name(s), fm_last_error());
        assert_null(c);
    }
}

static void test_absent_from_shard(void **st) {
    (void)st;
    write_sharded();
    put("model.safetensors.index.json",
        "{\"weight_map\": {\"layers.0.w\": \"model-00001-of-00003.safetensors\","
        "\"layers.7.w\": \"model-00002-of-00003.safetensors\"}}");
    fm_ckpt *c;
    assert_int_equal(fm_ckpt_open(g_dir, &c), FM_OK);
    assert_int_equal(fm_ckpt_count(c), 2);
    assert_null(fm_ckpt_find(c, "layers.7.w"));
    assert_non_null(strstr(fm_last_error(), "tensor 'layers.7.w'"));
    assert_non_null(strstr(fm_last_error(), "absent"));
    assert_non_null(fm_ckpt_find(c, "layers.0.w"));
    fm_ckpt_close(c);
}

static void test_single_file(void **st) {
    (void)st;
    fm_test_clear_dir(g_dir);
    shard("model.safetensors", k_s1, 2, 5);
    fm_ckpt *c;
    assert_int_equal(fm_ckpt_open(g_dir, &c), FM_OK);
    assert_int_equal(fm_ckpt_count(c), 2);
    assert_string_equal(fm_ckpt_name_at(c, 0), "layers.0.b");
    assert_true(first_value(fm_ckpt_find(c, "layers.0.w")) == 5.0f);
    assert_null(fm_ckpt_find(c, "nope"));
    fm_ckpt_close(c);
    fm_ckpt_close(NULL);

    /* Neither file, and not a directory. */
    fm_test_clear_dir(g_dir);
    assert_int_equal(fm_ckpt_open(g_dir, &c), FM_E_NOTFOUND);
    assert_non_null(strstr(fm_last_error(), "model.safetensors.index.json"));
    assert_int_equal(fm_ckpt_open("/nonexistent/ckpt", &c), FM_E_NOTFOUND);
    /* A bad single file reports the file's own error. */
    put_bin("model.safetensors", "\x02\0\0\0\0\0\0\0[]", 10);
    assert_int_equal(fm_ckpt_open(g_dir, &c), FM_E_FORMAT);
    assert_non_null(strstr(fm_last_error(), "model.safetensors"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sharded),
        cmocka_unit_test(test_lazy_shards),
        cmocka_unit_test(test_missing_shard),
        cmocka_unit_test(test_bad_index),
        cmocka_unit_test(test_absent_from_shard),
        cmocka_unit_test(test_single_file),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
