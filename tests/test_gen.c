/* gen: the documented formulas recomputed independently, sharding and the
 * index, determinism, and failures that leave nothing behind. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fm_test.h"
#include "io/io_internal.h"
#include "util/util.h"

/* The formulas of model_random.c, written again from the comment. */
static void test_formulas_by_hand(void **st) {
    (void)st;
    const uint64_t seed = 99;
    const int64_t K = 128, R = 4;
    uint8_t packed[4 * 64], scales[4 * 8];
    fm_gen_matrix_rows(seed, 3, 5, 1, FM_QF_NVFP4, K, 2, R, packed, scales);
    uint64_t kc = fm_hash_str("L3.E5.up.codes"), ks = fm_hash_str("L3.E5.up.scales");
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < K; c++) {
            uint64_t w = fm_rng_u64(seed, kc, (uint64_t)((r + 2) * (K / 16) + c / 16));
            unsigned want = (unsigned)(w >> (4 * (c % 16))) & 0xF;
            unsigned byte = packed[r * (K / 2) + c / 2];
            unsigned got = (c % 2) ? byte >> 4 : byte & 0xF;
            assert_int_equal(got, want);
        }
    for (int64_t r = 0; r < R; r++)
        for (int64_t b = 0; b < K / 16; b++) {
            uint64_t u = fm_rng_u64(seed, ks, (uint64_t)((r + 2) * (K / 16) + b));
            assert_int_equal(scales[r * 8 + b], 0x64 + (uint32_t)(u >> 32) % 12);
            float v = fm_e4m3_to_f32(scales[r * 8 + b]);
            assert_true(v >= 48.0f && v <= 120.0f);
        }
    assert_true(fm_gen_nvfp4_scale2(K) == (float)(1.0 / (242.0 * sqrt(128.0))));
    /* MXFP4 scales around the base exponent; K = 128: 1/(3.87*sqrt(128)) = 0.0228 -> 2^-5 */
    assert_int_equal(fm_gen_mxfp4_base_exp(128), 122);
    uint8_t mxs[4 * 4];
    fm_gen_matrix_rows(seed, 0, -1, 2, FM_QF_MXFP4, K, 0, R, NULL, mxs);
    uint64_t km = fm_hash_str("L0.shared.down.scales");
    for (int i = 0; i < 16; i++) {
        uint64_t u = fm_rng_u64(seed, km, (uint64_t)i);
        assert_int_equal(mxs[i], 122 + (int)((uint32_t)(u >> 32) % 3) - 1);
    }
    /* BF16 values */
    uint8_t bf[2 * 128];
    fm_gen_matrix_rows(seed, 1, 0, 0, FM_QF_BF16, K, 1, 1, bf, NULL);
    uint64_t kv = fm_hash_str("L1.E0.gate.values");
    for (int c = 0; c < K; c++) {
        float want = fm_rng_normal(seed, kv, (uint64_t)(K + c)) * (float)(1.0 / sqrt(128.0));
        uint16_t h = (uint16_t)(bf[2 * c] | bf[2 * c + 1] << 8);
        assert_true(h == fm_f32_to_bf16(want));
    }
    assert_true(fm_gen_key(2, -2, "weight") == fm_hash_str("L2.router.weight"));
    assert_true(fm_gen_key(2, 7, "gate.codes") == fm_hash_str("L2.E7.gate.codes"));
    /* tid2eid rows: k distinct experts in range, varied across tokens */
    int32_t row[8];
    int hist[16] = {0};
    for (int t = 0; t < 2000; t++) {
        fm_io_gen_tid2eid_row(seed, 0, 16, 6, t, row);
        for (int j = 0; j < 6; j++) {
            assert_true(row[j] >= 0 && row[j] < 16);
            for (int q = 0; q < j; q++) assert_true(row[q] != row[j]);
            hist[row[j]]++;
        }
    }
    for (int e = 0; e < 16; e++) assert_true(hist[e] > 500 && hist[e] < 1000); /* mean 750 */
}

static void test_shards_and_index(void **st) {
    (void)st;
    char parent[64];
    fm_test_tmpdir(parent, sizeof parent, "test_gen");
    char out[128], out2[128], path[256];
    snprintf(out, sizeof out, "%s/a", parent);
    snprintf(out2, sizeof out2, "%s/b", parent);
    fm_model_desc d;
    assert_int_equal(fm_preset_desc("tiny-deepseek", FM_QF_NVFP4, &d), FM_OK);
    fm_gen_opts o = {3, 11, 100000, 0};
    assert_int_equal(fm_gen_checkpoint(&d, &o, out), FM_OK);
    /* 3 layers x ~236 KB in shards of <= 100 KB (a tensor never splits) */
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", out);
    json_error_t je;
    json_t *idx = json_load_file(path, 0, &je);
    assert_non_null(idx);
    json_int_t total = json_integer_value(json_object_get(json_object_get(idx, "metadata"), "total_size"));
    json_t *wm = json_object_get(idx, "weight_map");
    const char *name;
    json_t *v;
    int64_t sum = 0, max_shard = 0;
    int n_shards = fm_test_count_entries(out) - 3; /* config, hf_quant_config, index */
    assert_true(n_shards >= 7);
    char want_last[64];
    snprintf(want_last, sizeof want_last, "model-%05d-of-%05d.safetensors", n_shards, n_shards);
    snprintf(path, sizeof path, "%s/%s", out, want_last);
    assert_int_equal(access(path, R_OK), 0);
    fm_ckpt *c;
    assert_int_equal(fm_ckpt_open(out, &c), FM_OK);
    json_object_foreach(wm, name, v) {
        const fm_st_tensor *t = fm_ckpt_find(c, name);
        assert_non_null(t);
        sum += (int64_t)(t->end - t->begin);
    }
    for (int s = 1; s <= n_shards; s++) {
        snprintf(path, sizeof path, "%s/model-%05d-of-%05d.safetensors", out, s, n_shards);
        fm_st_file *f;
        assert_int_equal(fm_st_open_header(path, &f), FM_OK);
        int64_t bytes = 0;
        for (size_t i = 0; i < fm_st_count(f); i++) bytes += (int64_t)(fm_st_at(f, i)->end - fm_st_at(f, i)->begin);
        if (bytes > max_shard) max_shard = bytes;
        fm_st_close(f);
    }
    assert_true(max_shard <= 100000);
    assert_int_equal(sum, total);
    /* present layers 1, 2, 3 (layer 0 is dense) */
    assert_non_null(fm_ckpt_find(c, "model.layers.3.mlp.experts.15.down_proj.weight"));
    assert_null(fm_ckpt_find(c, "model.layers.0.mlp.gate.weight"));
    fm_ckpt_close(c);
    json_decref(idx);

    /* deterministic: the same seed writes the same bytes */
    o.shard_bytes = 0;
    o.n_moe_layers = 1;
    fm_test_rm_tree(out);
    assert_int_equal(fm_gen_checkpoint(&d, &o, out), FM_OK);
    assert_int_equal(fm_gen_checkpoint(&d, &o, out2), FM_OK);
    char *a, *b;
    size_t na, nb;
    snprintf(path, sizeof path, "%s/model-00001-of-00001.safetensors", out);
    assert_int_equal(fm_read_file(path, 1 << 24, &a, &na), FM_OK);
    snprintf(path, sizeof path, "%s/model-00001-of-00001.safetensors", out2);
    assert_int_equal(fm_read_file(path, 1 << 24, &b, &nb), FM_OK);
    assert_int_equal(na, nb);
    assert_memory_equal(a, b, na);
    free(a);
    free(b);
    fm_test_rm_tree(out2);

    /* refuses to overwrite; the existing checkpoint is untouched */
    fm_status s = fm_gen_checkpoint(&d, &o, out);
    assert_int_equal(s, FM_E_IO);
    assert_non_null(strstr(fm_last_error(), "already exists"));
    assert_int_equal(fm_test_count_entries(out), 4);
    /* too many layers: error, and nothing left in the parent */
    o.n_moe_layers = 4;
    s = fm_gen_checkpoint(&d, &o, out2);
    assert_int_equal(s, FM_E_RANGE);
    assert_non_null(strstr(fm_last_error(), "3 MoE layers"));
    /* an unwritable destination fails cleanly too */
    o.n_moe_layers = 1;
    s = fm_gen_checkpoint(&d, &o, "/nonexistent-dir/x/ckpt");
    assert_int_equal(s, FM_E_IO);
    fm_test_rm_tree(out);
    assert_int_equal(fm_test_count_entries(parent), 0);
    rmdir(parent);
}

/* inspect on a good and a damaged checkpoint. */
static void test_inspect(void **st) {
    (void)st;
    char parent[64];
    fm_test_tmpdir(parent, sizeof parent, "test_gen");
    char out[128], path[256];
    snprintf(out, sizeof out, "%s/a", parent);
    fm_model_desc d;
    assert_int_equal(fm_preset_desc("tiny-gptoss", FM_QF_MXFP4, &d), FM_OK);
    fm_gen_opts o = {2, 1, 0, 0};
    assert_int_equal(fm_gen_checkpoint(&d, &o, out), FM_OK);
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    int n = -1;
    assert_int_equal(fm_inspect(out, 1, f, &n), FM_OK);
    fclose(f);
    assert_int_equal(n, 0);
    json_error_t je;
    json_t *j = json_loads(buf, 0, &je);
    assert_non_null(j);
    assert_string_equal(json_string_value(json_object_get(j, "family")), "gpt_oss");
    assert_string_equal(json_string_value(json_object_get(j, "layout")), "gptoss");
    assert_int_equal(json_array_size(json_object_get(j, "moe_layers_present")), 2);
    json_int_t pe = json_integer_value(json_object_get(json_object_get(j, "bytes"), "per_expert"));
    assert_int_equal(pe, 3 * 128 * 64 / 2 + 3 * 128 * 64 / 32);
    json_decref(j);
    free(buf);
    /* a missing shard and a broken config are both reported */
    snprintf(path, sizeof path, "%s/model-00001-of-00001.safetensors", out);
    assert_int_equal(unlink(path), 0);
    f = open_memstream(&buf, &len);
    assert_int_equal(fm_inspect(out, 0, f, &n), FM_OK);
    fclose(f);
    assert_true(n >= 1);
    assert_non_null(strstr(buf, "model-00001-of-00001.safetensors"));
    free(buf);
    snprintf(path, sizeof path, "%s/config.json", out);
    assert_int_equal(fm_write_file_atomic(path, "{\"model_type\":\"mixtral\"}", 24), FM_OK);
    f = open_memstream(&buf, &len);
    assert_int_equal(fm_inspect(out, 0, f, &n), FM_OK);
    fclose(f);
    assert_true(n >= 1);
    assert_non_null(strstr(buf, "hidden_size"));
    free(buf);
    fm_test_rm_tree(out);
    rmdir(parent);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_formulas_by_hand),
        cmocka_unit_test(test_shards_and_index),
        cmocka_unit_test(test_inspect),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
