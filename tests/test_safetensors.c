/*
 * safetensors reader and writer: every malformed file of tests/data/bad
 * fails with its documented status and message (through fm_st_open,
 * fm_st_open_header and fm_st_parse alike); the valid references read back
 * with the right names, shapes, offsets, bytes and metadata; the writer
 * round-trips and leaves no file behind on any error.
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


/* ---------------------------------------------------------------- bad files */

static const struct {
    const char *file;
    fm_status st;
    const char *msg;
} k_bad[] = {
    {"truncated", FM_E_FORMAT, "too small for the 8-byte header length"},
    {"header_past_eof", FM_E_FORMAT, "runs past the end of the file"},
    {"header_too_large", FM_E_RANGE, "exceeds the limit of 100000000 bytes"},
    {"empty_header", FM_E_FORMAT, "does not start with '{'"},
    {"not_brace", FM_E_FORMAT, "does not start with '{'"},
    {"bad_utf8", FM_E_FORMAT, "not valid UTF-8 (byte offset 11)"},
    {"overlong_utf8", FM_E_FORMAT, "not valid UTF-8"},
    {"lone_surrogate", FM_E_FORMAT, "invalid header JSON"},
    {"invalid_json", FM_E_FORMAT, "invalid header JSON"},
    {"nul_in_header", FM_E_FORMAT, "invalid header JSON"},
    {"duplicate_name", FM_E_FORMAT, "duplicate"},
    {"entry_not_object", FM_E_FORMAT, "tensor 'a': entry is not a JSON object"},
    {"missing_offsets", FM_E_FORMAT, "tensor 'a': missing data_offsets"},
    {"offsets_three", FM_E_FORMAT, "data_offsets is not [begin, end]"},
    {"end_before_begin", FM_E_FORMAT, "tensor 'b': data_offsets [8, 4] end before begin"},
    {"overlap", FM_E_FORMAT, "tensor 'b': data_offsets [4, 12] overlap"},
    {"gap", FM_E_FORMAT, "tensor 'b': data_offsets [8, 12] leave a gap"},
    {"not_from_zero", FM_E_FORMAT, "tensor 'a': data_offsets [4, 8] leave a gap"},
    {"size_mismatch", FM_E_FORMAT, "hold 4 bytes, but F32 shape needs 8"},
    {"shape_overflow", FM_E_RANGE, "shape product overflows"},
    {"shape_overflow_zero", FM_E_RANGE, "shape product overflows"},
    {"bytes_overflow", FM_E_RANGE, "shape product overflows"},
    {"negative_shape", FM_E_FORMAT, "shape[0] is not a non-negative integer"},
    {"float_shape", FM_E_FORMAT, "shape[0] is not a non-negative integer"},
    {"negative_offset", FM_E_FORMAT, "data_offsets are not non-negative integers"},
    {"too_many_dims", FM_E_UNSUPPORTED, "9 dimensions, at most 8"},
    {"unknown_dtype", FM_E_UNSUPPORTED, "unknown dtype 'F33'"},
    {"dtype_not_string", FM_E_FORMAT, "dtype is not a string"},
    {"f4_odd", FM_E_FORMAT, "do not fill whole bytes"},
    {"data_not_at_end", FM_E_FORMAT, "data must end exactly at the end of the file"},
    {"data_short", FM_E_FORMAT, "tensors cover 8 data bytes but the file holds 4"},
    {"metadata_not_string", FM_E_FORMAT, "__metadata__ key 'k': value is not a string"},
    {"metadata_not_object", FM_E_FORMAT, "__metadata__ is not an object"},
};

static void expect_msg(const char *file, const char *want) {
    if (!strstr(fm_last_error(), want))
        fail_msg("%s: message \"%s\" lacks \"%s\"", file, fm_last_error(), want);
}

static void test_bad_files(void **st) {
    (void)st;
    for (size_t i = 0; i < sizeof k_bad / sizeof k_bad[0]; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/bad/%s.safetensors", fm_test_data_dir(), k_bad[i].file);
        fm_st_file *f = (fm_st_file *)1;
        fm_status s = fm_st_open(path, &f);
        if (s != k_bad[i].st)
            fail_msg("%s: fm_st_open gave %s (%s), expected %s", k_bad[i].file, fm_status_name(s),
                     fm_last_error(), fm_status_name(k_bad[i].st));
        assert_null(f);
        expect_msg(k_bad[i].file, k_bad[i].msg);
        expect_msg(k_bad[i].file, path); /* names the file */

        f = (fm_st_file *)1;
        s = fm_st_open_header(path, &f);
        if (s != k_bad[i].st)
            fail_msg("%s: fm_st_open_header gave %s (%s)", k_bad[i].file, fm_status_name(s),
                     fm_last_error());
        assert_null(f);
        expect_msg(k_bad[i].file, k_bad[i].msg);

        size_t len;
        char *buf = fm_test_read(path, &len);
        s = fm_st_parse((const uint8_t *)buf, len, len, &f);
        if (s != k_bad[i].st)
            fail_msg("%s: fm_st_parse gave %s (%s)", k_bad[i].file, fm_status_name(s),
                     fm_last_error());
        expect_msg(k_bad[i].file, k_bad[i].msg);
        free(buf);
    }
}

static void test_missing_file(void **st) {
    (void)st;
    fm_st_file *f;
    assert_int_equal(fm_st_open("/nonexistent/x.safetensors", &f), FM_E_IO);
    assert_non_null(strstr(fm_last_error(), "/nonexistent/x.safetensors"));
    assert_int_equal(fm_st_open_header("/nonexistent/x.safetensors", &f), FM_E_IO);
    assert_int_equal(fm_st_open(fm_test_data_dir(), &f), FM_E_IO); /* a directory */
}

/* --------------------------------------------------------------- good files */

static void check_small(const fm_st_file *f, int with_data) {
    assert_int_equal(fm_st_count(f), 4);
    static const char *order[] = {"w", "empty", "s", "q"};
    static const uint64_t begins[] = {0, 16, 16, 24}, ends[] = {16, 16, 24, 27};
    for (size_t i = 0; i < 4; i++) {
        const fm_st_tensor *t = fm_st_at(f, i);
        assert_string_equal(t->name, order[i]);
        assert_true(t->begin == begins[i] && t->end == ends[i]);
        assert_ptr_equal(fm_st_find(f, order[i]), t);
        if (!with_data) assert_null(t->data);
    }
    assert_null(fm_st_at(f, 4));
    const fm_st_tensor *w = fm_st_find(f, "w"), *e = fm_st_find(f, "empty"),
                       *s = fm_st_find(f, "s"), *q = fm_st_find(f, "q");
    assert_int_equal(w->dtype, FM_DT_F32);
    assert_int_equal(w->ndim, 2);
    assert_true(w->shape[0] == 2 && w->shape[1] == 2);
    assert_int_equal(e->dtype, FM_DT_BF16);
    assert_true(e->ndim == 2 && e->shape[0] == 3 && e->shape[1] == 0);
    assert_int_equal(s->dtype, FM_DT_I64);
    assert_int_equal(s->ndim, 0);
    assert_int_equal(q->dtype, FM_DT_F4);
    assert_true(q->ndim == 2 && q->shape[0] == 2 && q->shape[1] == 3);
    if (with_data) {
        float wv[4];
        memcpy(wv, w->data, 16);
        assert_true(wv[0] == 1.0f && wv[1] == -2.0f && wv[2] == 0.5f && wv[3] == 3.0f);
        int64_t sv;
        memcpy(&sv, s->data, 8);
        assert_true(sv == -7);
        const uint8_t *qb = q->data;
        assert_true(qb[0] == 0x21 && qb[1] == 0x43 && qb[2] == 0x65);
    }
    assert_null(fm_st_find(f, "nope"));
    assert_null(fm_st_find(f, ""));
    assert_int_equal(fm_st_metadata_count(f), 2);
    assert_string_equal(fm_st_metadata(f, "format"), "pt");
    assert_string_equal(fm_st_metadata(f, "note"), "h\xc3\xa9");
    assert_null(fm_st_metadata(f, "missing"));
}

static void test_good_files(void **st) {
    (void)st;
    char path[4096];
    snprintf(path, sizeof path, "%s/st/small.safetensors", fm_test_data_dir());
    fm_st_file *f;
    assert_int_equal(fm_st_open(path, &f), FM_OK);
    check_small(f, 1);
    assert_string_equal(fm_st_path(f), path);
    fm_st_close(f);
    assert_int_equal(fm_st_open_header(path, &f), FM_OK);
    check_small(f, 0);
    fm_st_close(f);

    /* From memory: the whole file gives data pointers, a prefix does not. */
    size_t len;
    char *buf = fm_test_read(path, &len);
    assert_int_equal(fm_st_parse((const uint8_t *)buf, len, len, &f), FM_OK);
    check_small(f, 1);
    assert_ptr_equal(fm_st_find(f, "q")->data, buf + len - 3);
    fm_st_close(f);
    uint64_t n;
    memcpy(&n, buf, 8);
    assert_int_equal(fm_st_parse((const uint8_t *)buf, 8 + n, len, &f), FM_OK);
    check_small(f, 0);
    fm_st_close(f);
    assert_int_equal(fm_st_parse((const uint8_t *)buf, 20, len, &f), FM_E_ARG);
    /* The same header claiming a longer file: data must end at file end. */
    assert_int_equal(fm_st_parse((const uint8_t *)buf, len, len + 1, &f), FM_E_FORMAT);
    free(buf);

    snprintf(path, sizeof path, "%s/st/empty.safetensors", fm_test_data_dir());
    assert_int_equal(fm_st_open(path, &f), FM_OK);
    assert_int_equal(fm_st_count(f), 0);
    assert_int_equal(fm_st_metadata_count(f), 0);
    assert_null(fm_st_find(f, "x"));
    fm_st_close(f);
    fm_st_close(NULL);
}

/* A zero dimension before any overflow gives 0 elements: valid. */
static void test_zero_dim_no_overflow(void **st) {
    (void)st;
    const char *h = "{\"z\":{\"dtype\":\"F64\",\"shape\":[0,4611686018427387904],"
                    "\"data_offsets\":[0,0]}}";
    uint8_t buf[256];
    uint64_t n = strlen(h);
    memcpy(buf, &n, 8);
    memcpy(buf + 8, h, n);
    fm_st_file *f;
    assert_int_equal(fm_st_parse(buf, 8 + n, 8 + n, &f), FM_OK);
    assert_true(fm_st_find(f, "z")->shape[1] == 4611686018427387904LL);
    fm_st_close(f);
    /* Trailing space padding after the JSON object is allowed. */
    memcpy(buf + 8 + n, "    ", 4);
    n += 4;
    memcpy(buf, &n, 8);
    assert_int_equal(fm_st_parse(buf, 8 + n, 8 + n, &f), FM_OK);
    fm_st_close(f);
}

/* ----------------------------------------------------------------- writer */

static char g_dir[64];

static int make_dir(void **st) {
    (void)st;
    return fm_test_mkdtemp(g_dir, sizeof g_dir, "st_test");
}

static int remove_dir(void **st) {
    (void)st;
    fm_test_clear_dir(g_dir);
    return rmdir(g_dir);
}

static void test_writer_roundtrip(void **st) {
    (void)st;
    fm_test_clear_dir(g_dir);
    char path[256];
    snprintf(path, sizeof path, "%s/rt.safetensors", g_dir);
    uint8_t blob[1000];
    for (int i = 0; i < 1000; i++) blob[i] = (uint8_t)(i * 37 + 11);
    struct { const char *name; fm_dtype dt; int nd; int64_t sh[3]; size_t bytes; } T[] = {
        {"a.weight", FM_DT_U8, 2, {3, 5}, 15},
        {"empty", FM_DT_F32, 2, {0, 7}, 0},
        {"scalar", FM_DT_F32, 0, {0}, 4},
        {"b", FM_DT_BF16, 3, {2, 3, 4}, 48},
        {"q4", FM_DT_F4, 1, {10}, 5},
        {"scale", FM_DT_F8_E4M3, 1, {9}, 9},
        {"last_empty", FM_DT_I64, 1, {0}, 0},
    };
    size_t nt = sizeof T / sizeof T[0], total = 0;
    fm_st_writer *w;
    assert_int_equal(fm_st_writer_new(path, &w), FM_OK);
    assert_int_equal(fm_st_writer_meta(w, "format", "pt"), FM_OK);
    assert_int_equal(fm_st_writer_meta(w, "quote\"key", "line\nbreak"), FM_OK);
    for (size_t i = 0; i < nt; i++) {
        assert_int_equal(fm_st_writer_declare(w, T[i].name, T[i].dt, T[i].nd, T[i].sh), FM_OK);
        total += T[i].bytes;
    }
    /* Chunks that straddle tensor boundaries. */
    for (size_t off = 0; off < total;) {
        size_t n = off % 2 ? 7 : 3;
        if (n > total - off) n = total - off;
        assert_int_equal(fm_st_writer_write(w, blob + off, n), FM_OK);
        off += n;
    }
    assert_int_equal(fm_test_count_entries(g_dir), 1); /* only the temp file so far */
    assert_int_equal(fm_st_writer_finish(w), FM_OK);
    assert_int_equal(fm_test_count_entries(g_dir), 1);

    fm_st_file *f;
    assert_int_equal(fm_st_open(path, &f), FM_OK);
    assert_int_equal(fm_st_count(f), nt);
    size_t off = 0;
    for (size_t i = 0; i < nt; i++) {
        const fm_st_tensor *t = fm_st_find(f, T[i].name);
        assert_non_null(t);
        assert_int_equal(t->dtype, T[i].dt);
        assert_int_equal(t->ndim, T[i].nd);
        for (int d = 0; d < T[i].nd; d++) assert_true(t->shape[d] == T[i].sh[d]);
        assert_true(t->begin == off && t->end == off + T[i].bytes);
        if (T[i].bytes) assert_memory_equal(t->data, blob + off, T[i].bytes);
        off += T[i].bytes;
    }
    assert_string_equal(fm_st_metadata(f, "quote\"key"), "line\nbreak");
    fm_st_close(f);
    /* The header is space-padded so the data starts 8-byte aligned. */
    size_t len;
    char *buf = fm_test_read(path, &len);
    uint64_t n;
    memcpy(&n, buf, 8);
    assert_int_equal(n % 8, 0);
    assert_int_equal(len, 8 + n + total);
    free(buf);

    /* No tensors at all is a valid file too. */
    assert_int_equal(fm_st_writer_new(path, &w), FM_OK);
    assert_int_equal(fm_st_writer_finish(w), FM_OK);
    assert_int_equal(fm_st_open(path, &f), FM_OK);
    assert_int_equal(fm_st_count(f), 0);
    fm_st_close(f);
}

static void write_old(const char *path) {
    assert_int_equal(fm_write_file_atomic(path, "old", 3), FM_OK);
}
static void expect_old(const char *path) {
    size_t len;
    char *b = fm_test_read(path, &len);
    assert_int_equal(len, 3);
    assert_memory_equal(b, "old", 3);
    free(b);
    assert_int_equal(fm_test_count_entries(g_dir), 1); /* no temp file left */
}

static void test_writer_errors(void **st) {
    (void)st;
    fm_test_clear_dir(g_dir);
    char path[256];
    snprintf(path, sizeof path, "%s/e.safetensors", g_dir);
    write_old(path);
    int64_t sh[2] = {2, 2};
    uint8_t data[64] = {0};
    fm_st_writer *w;

    /* More bytes than declared. */
    assert_int_equal(fm_st_writer_new(path, &w), FM_OK);
    assert_int_equal(fm_st_writer_declare(w, "a", FM_DT_F32, 2, sh), FM_OK);
    assert_int_equal(fm_st_writer_write(w, data, 17), FM_E_RANGE);
    assert_non_null(strstr(fm_last_error(), "past the 16 declared"));
    assert_int_equal(fm_st_writer_write(w, data, 1), FM_E_ARG); /* stays failed */
    assert_int_equal(fm_st_writer_finish(w), FM_E_ARG);
    expect_old(path);

    /* Fewer bytes than declared: finish names the tensor. */
    assert_int_equal(fm_st_writer_new(path, &w), FM_OK);
    assert_int_equal(fm_st_writer_declare(w, "a", FM_DT_F32, 2, sh), FM_OK);
    assert_int_equal(fm_st_writer_declare(w, "b", FM_DT_F32, 2, sh), FM_OK);
    assert_int_equal(fm_st_writer_write(w, data, 20), FM_OK);
    assert_int_equal(fm_st_writer_finish(w), FM_E_ARG);
    assert_non_null(strstr(fm_last_error(), "tensor 'b': 4 of 16 bytes written"));
    expect_old(path);

    /* Abort. */
    assert_int_equal(fm_st_writer_new(path, &w), FM_OK);
    assert_int_equal(fm_st_writer_declare(w, "a", FM_DT_F32, 2, sh), FM_OK);
    assert_int_equal(fm_st_writer_write(w, data, 16), FM_OK);
    fm_st_writer_abort(w);
    expect_old(path);
    fm_st_writer_abort(NULL);

    /* Duplicate names. */
    assert_int_equal(fm_st_writer_new(path, &w), FM_OK);
    assert_int_equal(fm_st_writer_declare(w, "a", FM_DT_F32, 2, sh), FM_OK);
    assert_int_equal(fm_st_writer_declare(w, "b", FM_DT_F32, 2, sh), FM_OK);
    assert_int_equal(fm_st_writer_declare(w, "a", FM_DT_F32, 2, sh), FM_OK);
    assert_int_equal(fm_st_writer_write(w, data, 4), FM_E_ARG);
    assert_non_null(strstr(fm_last_error(), "'a' declared twice"));
    fm_st_writer_abort(w);
    expect_old(path);

    /* Declaration after data, bad dtype, odd F4, negative shape, bad names,
     * duplicate metadata. */
    assert_int_equal(fm_st_writer_new(path, &w), FM_OK);
    assert_int_equal(fm_st_writer_declare(w, "a", FM_DT_F32, 2, sh), FM_OK);
    assert_int_equal(fm_st_writer_write(w, data, 4), FM_OK);
    assert_int_equal(fm_st_writer_declare(w, "late", FM_DT_F32, 2, sh), FM_E_ARG);
    assert_int_equal(fm_st_writer_finish(w), FM_E_ARG);
    expect_old(path);

    int64_t three = 3, neg = -1;
    struct { const char *name; fm_dtype dt; int nd; const int64_t *sh; fm_status want; } B[] = {
        {"x", FM_DT_INVALID, 1, &three, FM_E_ARG},
        {"x", FM_DT_F4, 1, &three, FM_E_RANGE},
        {"x", FM_DT_F32, 1, &neg, FM_E_RANGE},
        {"x", FM_DT_F32, 9, sh, FM_E_ARG},
        {"__metadata__", FM_DT_F32, 1, &three, FM_E_ARG},
        {"bad\xff", FM_DT_F32, 1, &three, FM_E_ARG},
    };
    for (size_t i = 0; i < sizeof B / sizeof B[0]; i++) {
        assert_int_equal(fm_st_writer_new(path, &w), FM_OK);
        assert_int_equal(fm_st_writer_declare(w, B[i].name, B[i].dt, B[i].nd, B[i].sh), B[i].want);
        assert_int_equal(fm_st_writer_finish(w), FM_E_ARG);
        expect_old(path);
    }
    assert_int_equal(fm_st_writer_new(path, &w), FM_OK);
    assert_int_equal(fm_st_writer_meta(w, "k", "1"), FM_OK);
    assert_int_equal(fm_st_writer_meta(w, "k", "2"), FM_E_ARG);
    fm_st_writer_abort(w);
    expect_old(path);

    /* A directory that does not exist. */
    assert_int_equal(fm_st_writer_new("/nonexistent/dir/x.safetensors", &w), FM_E_IO);
    assert_non_null(strstr(fm_last_error(), "/nonexistent/dir/x.safetensors"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_files),
        cmocka_unit_test(test_missing_file),
        cmocka_unit_test(test_good_files),
        cmocka_unit_test(test_zero_dim_no_overflow),
        cmocka_unit_test(test_writer_roundtrip),
        cmocka_unit_test(test_writer_errors),
    };
    return cmocka_run_group_tests(tests, make_dir, remove_dir);
}
