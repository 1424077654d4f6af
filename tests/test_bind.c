/* Binding: gen -> bind equals fm_moe_layer_random bit for bit for every tiny
 * preset and format; BF16 quantized on load; every tensor problem is named. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fm_test.h"
#include "io/io_internal.h"
#include "util/util.h"

/* A fresh path (not created) under a fresh temp dir (parent: 64 bytes). */
static void tmp_out(char *parent, char *out, size_t cap) {
    fm_test_tmpdir(parent, 64, "test_bind");
    snprintf(out, cap, "%s/ckpt", parent);
}

static void same_matrix(const fm_qmatrix *a, const fm_qmatrix *b, const char *what) {
    if (a->fmt != b->fmt || a->rows != b->rows || a->cols != b->cols) fail_msg("%s: shape/format differ", what);
    if (a->scale2 != b->scale2) fail_msg("%s: scale2 %g vs %g", what, (double)a->scale2, (double)b->scale2);
    int64_t rowb = a->fmt == FM_QF_BF16 ? 2 * a->cols : a->cols / 2;
    int blk = a->fmt == FM_QF_NVFP4 ? 16 : 32;
    for (int64_t r = 0; r < a->rows; r++) {
        if (memcmp(a->packed + r * a->row_stride, b->packed + r * b->row_stride, (size_t)rowb))
            fail_msg("%s: row %lld packed bytes differ", what, (long long)r);
        if (a->fmt != FM_QF_BF16 &&
            memcmp(a->scales + r * a->scale_stride, b->scales + r * b->scale_stride, (size_t)(a->cols / blk)))
            fail_msg("%s: row %lld scales differ", what, (long long)r);
        if ((a->bias == NULL) != (b->bias == NULL)) fail_msg("%s: bias present in only one", what);
        if (a->bias && a->bias[r] != b->bias[r]) fail_msg("%s: bias %lld differs", what, (long long)r);
    }
}

static void same_floats(const float *a, const float *b, int64_t n, const char *what) {
    if ((a == NULL) != (b == NULL)) fail_msg("%s: present in only one", what);
    for (int64_t i = 0; a && i < n; i++)
        if (a[i] != b[i]) fail_msg("%s[%lld]: %g vs %g", what, (long long)i, (double)a[i], (double)b[i]);
}

static void same_layer(const fm_moe_layer *a, const fm_moe_layer *b) {
    char w[64];
    assert_int_equal(a->n_experts, b->n_experts);
    assert_int_equal(a->fmt, b->fmt);
    for (int e = 0; e < a->n_experts; e++) {
        snprintf(w, sizeof w, "expert %d gate", e);
        same_matrix(&a->gate[e], &b->gate[e], w);
        snprintf(w, sizeof w, "expert %d up", e);
        same_matrix(&a->up[e], &b->up[e], w);
        snprintf(w, sizeof w, "expert %d down", e);
        same_matrix(&a->down[e], &b->down[e], w);
    }
    assert_int_equal(a->has_shared, b->has_shared);
    if (a->has_shared) {
        same_matrix(&a->sh_gate, &b->sh_gate, "shared gate");
        same_matrix(&a->sh_up, &b->sh_up, "shared up");
        same_matrix(&a->sh_down, &b->sh_down, "shared down");
    }
    same_floats(a->router_w, b->router_w, (int64_t)a->n_experts * a->hidden, "router_w");
    same_floats(a->router_bias, b->router_bias, a->n_experts, "router_bias");
    same_floats(a->score_bias, b->score_bias, a->n_experts, "score_bias");
    assert_int_equal(a->tid2eid_rows, b->tid2eid_rows);
    if ((a->tid2eid == NULL) != (b->tid2eid == NULL)) fail_msg("tid2eid present in only one");
    if (a->tid2eid) assert_memory_equal(a->tid2eid, b->tid2eid, sizeof(int32_t) * (size_t)(a->tid2eid_rows * a->topk));
}

static void round_trip(const char *preset, fm_qformat f) {
    fm_model_desc d, back;
    if (fm_preset_desc(preset, f, &d) != FM_OK) fail_msg("%s: %s", preset, fm_last_error());
    char parent[64], out[128];
    tmp_out(parent, out, sizeof out);
    int n_moe = 0;
    for (int l = 0; l < d.n_layers; l++) n_moe += fm_model_is_moe_layer(&d, l);
    fm_gen_opts o = {n_moe < 3 ? n_moe : 3, 1234, 0, 0};
    if (fm_gen_checkpoint(&d, &o, out) != FM_OK) fail_msg("gen %s: %s", preset, fm_last_error());
    if (fm_model_desc_load(out, &back) != FM_OK) fail_msg("load %s: %s", preset, fm_last_error());
    assert_memory_equal(&d, &back, sizeof d);
    fm_ckpt *c;
    if (fm_ckpt_open(out, &c) != FM_OK) fail_msg("open %s: %s", out, fm_last_error());
    int written = 0;
    for (int l = 0; l < d.n_layers && written < o.n_moe_layers; l++) {
        if (!fm_model_is_moe_layer(&d, l)) {
            fm_moe_layer *x = NULL;
            assert_int_equal(fm_moe_layer_bind(c, &d, l, FM_QF_NONE, &x), FM_E_ARG);
            continue;
        }
        written++;
        fm_moe_layer *a = NULL, *b = NULL;
        if (fm_moe_layer_bind(c, &d, l, FM_QF_NONE, &a) != FM_OK) fail_msg("bind %s layer %d: %s", preset, l, fm_last_error());
        assert_int_equal(fm_moe_layer_random(&d, f, 1234, l, &b), FM_OK);
        same_layer(a, b);
        assert_int_equal(fm_moe_layer_expert_bytes(a), fm_model_expert_bytes(&d, f) * d.n_experts);
        if (fm_io_is_hash_layer(&d, l)) assert_non_null(a->tid2eid);
        fm_moe_layer_free(a);
        fm_moe_layer_free(b);
        /* a different seed gives different weights */
        assert_int_equal(fm_moe_layer_random(&d, f, 1235, l, &b), FM_OK);
        assert_int_equal(fm_moe_layer_bind(c, &d, l, FM_QF_NONE, &a), FM_OK);
        assert_true(memcmp(a->gate[0].packed, b->gate[0].packed, 16) != 0);
        fm_moe_layer_free(a);
        fm_moe_layer_free(b);
    }
    fm_ckpt_close(c);
    fm_test_rm_tree(out);
    rmdir(parent);
}

static void test_round_trip_all(void **st) {
    (void)st;
    const char *tiny[] = {"tiny-deepseek", "tiny-deepseek-v4", "tiny-qwen3", "tiny-mixtral", "tiny-gptoss"};
    const fm_qformat fmts[] = {FM_QF_NVFP4, FM_QF_MXFP4, FM_QF_BF16};
    for (size_t i = 0; i < sizeof tiny / sizeof tiny[0]; i++)
        for (size_t f = 0; f < 3; f++) round_trip(tiny[i], fmts[f]);
}

/* Dequantized random weights: finite, std ~ 1/sqrt(K) (the formula's aim). */
static void test_random_weights_sane(void **st) {
    (void)st;
    const fm_qformat fmts[] = {FM_QF_NVFP4, FM_QF_MXFP4, FM_QF_BF16};
    for (int f = 0; f < 3; f++) {
        fm_model_desc d;
        assert_int_equal(fm_preset_desc("tiny-deepseek", fmts[f], &d), FM_OK);
        fm_moe_layer *l;
        assert_int_equal(fm_moe_layer_random(&d, fmts[f], 7, 1, &l), FM_OK);
        for (int m = 0; m < 2; m++) {
            double s = 0, s2 = 0;
            int64_t n = 0;
            for (int e = 0; e < d.n_experts; e++) {
                const fm_qmatrix *q = m == 0 ? &l->gate[e] : &l->down[e];
                double row[256];
                for (int64_t r = 0; r < q->rows; r++) {
                    fm_qmatrix_dequant_row_f64(q, r, row);
                    for (int64_t c = 0; c < q->cols; c++) {
                        assert_true(isfinite(row[c]));
                        s += row[c];
                        s2 += row[c] * row[c];
                        n++;
                    }
                }
            }
            double K = m == 0 ? d.hidden : d.moe_inter;
            double sd = sqrt(s2 / n - (s / n) * (s / n)) * sqrt(K);
            if (sd < 0.7 || sd > 1.45) fail_msg("%s m=%d: std*sqrt(K) = %g", fm_io_qformat_str(fmts[f]), m, sd);
            assert_true(fabs(s / n) * sqrt(K) < 0.1);
        }
        double rs = 0;
        for (int64_t i = 0; i < (int64_t)d.n_experts * d.hidden; i++) rs += l->router_w[i] * (double)l->router_w[i];
        double rsd = sqrt(rs / ((double)d.n_experts * d.hidden)) * sqrt((double)d.hidden);
        assert_true(rsd > 0.8 && rsd < 1.2);
        for (int e = 0; e < d.n_experts; e++) assert_true(fabsf(l->score_bias[e]) <= 0.05f);
        fm_moe_layer_free(l);
    }
}

/* BF16 experts quantized on load: the quantizer's values, close to BF16. */
static void test_quantize_on_load(void **st) {
    (void)st;
    fm_model_desc d;
    assert_int_equal(fm_preset_desc("tiny-qwen3", FM_QF_BF16, &d), FM_OK);
    char parent[64], out[128];
    tmp_out(parent, out, sizeof out);
    fm_gen_opts o = {1, 5, 0, 0};
    assert_int_equal(fm_gen_checkpoint(&d, &o, out), FM_OK);
    fm_ckpt *c;
    assert_int_equal(fm_ckpt_open(out, &c), FM_OK);
    const fm_qformat qf[2] = {FM_QF_NVFP4, FM_QF_MXFP4};
    for (int f = 0; f < 2; f++) {
        fm_moe_layer *q, *ref;
        assert_int_equal(fm_moe_layer_bind(c, &d, 0, qf[f], &q), FM_OK);
        assert_int_equal(fm_moe_layer_random(&d, FM_QF_BF16, 5, 0, &ref), FM_OK);
        assert_int_equal(q->fmt, qf[f]);
        assert_int_equal(q->down[3].fmt, qf[f]);
        double err = 0, tot = 0;
        float a[128], b[128];
        for (int64_t r = 0; r < q->down[3].rows; r++) {
            fm_qmatrix_dequant_row(&q->down[3], r, a);
            fm_qmatrix_dequant_row(&ref->down[3], r, b);
            for (int64_t j = 0; j < q->down[3].cols; j++) {
                err += (a[j] - b[j]) * (double)(a[j] - b[j]);
                tot += b[j] * (double)b[j];
            }
        }
        /* 4-bit quantization of Gaussian weights: relative RMS error ~ 0.1-0.2 */
        assert_true(sqrt(err / tot) < 0.25);
        assert_true(sqrt(err / tot) > 0.01);
        fm_moe_layer_free(q);
        fm_moe_layer_free(ref);
    }
    fm_ckpt_close(c);
    fm_test_rm_tree(out);
    rmdir(parent);
}

/* Rewrites the single shard of dir with one tensor changed. mode: 's' shape,
 * 'd' dtype, 'x' dropped, 'v' first int64 set to 999 (tid2eid). */
static void rewrite(const char *dir, const char *victim, char mode) {
    char src[256], dst[256];
    snprintf(src, sizeof src, "%s/model-00001-of-00001.safetensors", dir);
    snprintf(dst, sizeof dst, "%s/new.safetensors", dir);
    fm_st_file *f;
    assert_int_equal(fm_st_open(src, &f), FM_OK);
    fm_st_writer *w;
    assert_int_equal(fm_st_writer_new(dst, &w), FM_OK);
    int found = 0;
    for (size_t i = 0; i < fm_st_count(f); i++) {
        const fm_st_tensor *t = fm_st_at(f, i);
        int hit = !strcmp(t->name, victim);
        found |= hit;
        if (hit && mode == 'x') continue;
        int64_t sh[FM_MAX_DIMS];
        memcpy(sh, t->shape, sizeof sh);
        fm_dtype dt = t->dtype;
        if (hit && mode == 's') { sh[0] /= 2; sh[1] *= 2; }
        if (hit && mode == 'd') dt = FM_DT_I8 == dt ? FM_DT_U16 : (fm_dtype_bits(dt) == 8 ? FM_DT_BOOL : FM_DT_F16);
        if (hit && mode == 'd' && fm_dtype_bits(t->dtype) == 32) { dt = FM_DT_I32; }
        assert_int_equal(fm_st_writer_declare(w, t->name, dt, t->ndim, sh), FM_OK);
    }
    assert_true(found);
    for (size_t i = 0; i < fm_st_count(f); i++) {
        const fm_st_tensor *t = fm_st_at(f, i);
        int hit = !strcmp(t->name, victim);
        if (hit && mode == 'x') continue;
        if (hit && mode == 'v') {
            uint8_t *cp = malloc(t->end - t->begin);
            memcpy(cp, t->data, t->end - t->begin);
            int64_t bad = 999;
            memcpy(cp, &bad, 8);
            assert_int_equal(fm_st_writer_write(w, cp, t->end - t->begin), FM_OK);
            free(cp);
            continue;
        }
        assert_int_equal(fm_st_writer_write(w, t->data, t->end - t->begin), FM_OK);
    }
    assert_int_equal(fm_st_writer_finish(w), FM_OK);
    fm_st_close(f);
    assert_int_equal(rename(dst, src), 0);
}

static void expect_bind_error(const char *preset, fm_qformat f, int layer, const char *victim, char mode, fm_status want,
                              const char *needle) {
    fm_model_desc d;
    assert_int_equal(fm_preset_desc(preset, f, &d), FM_OK);
    char parent[64], out[128], name[200];
    tmp_out(parent, out, sizeof out);
    fm_gen_opts o = {1, 3, 0, 0};
    assert_int_equal(fm_gen_checkpoint(&d, &o, out), FM_OK);
    snprintf(name, sizeof name, victim, layer);
    rewrite(out, name, mode);
    fm_ckpt *c;
    assert_int_equal(fm_ckpt_open(out, &c), FM_OK);
    fm_moe_layer *l = NULL;
    fm_status s = fm_moe_layer_bind(c, &d, layer, FM_QF_NONE, &l);
    if (s != want || !strstr(fm_last_error(), name) || !strstr(fm_last_error(), needle))
        fail_msg("%s/%c: got %s '%s', wanted %s naming '%s' and '%s'", name, mode, fm_status_name(s), fm_last_error(),
                 fm_status_name(want), name, needle);
    assert_null(l);
    fm_ckpt_close(c);
    fm_test_rm_tree(out);
    rmdir(parent);
}

static void test_bind_errors(void **st) {
    (void)st;
    expect_bind_error("tiny-deepseek", FM_QF_NVFP4, 1, "model.layers.%d.mlp.experts.5.up_proj.weight", 's', FM_E_FORMAT,
                      "has shape [32, 128], expected [64, 64]");
    expect_bind_error("tiny-deepseek", FM_QF_NVFP4, 1, "model.layers.%d.mlp.experts.5.up_proj.weight_scale", 'd',
                      FM_E_FORMAT, "has dtype BOOL, expected F8_E4M3");
    expect_bind_error("tiny-deepseek", FM_QF_NVFP4, 1, "model.layers.%d.mlp.experts.2.down_proj.weight_scale_2", 'x',
                      FM_E_NOTFOUND, "missing tensor");
    expect_bind_error("tiny-deepseek", FM_QF_NVFP4, 1, "model.layers.%d.mlp.gate.e_score_correction_bias", 'd',
                      FM_E_FORMAT, "expected F32");
    expect_bind_error("tiny-deepseek", FM_QF_NVFP4, 1, "model.layers.%d.mlp.shared_experts.down_proj.weight", 'x',
                      FM_E_NOTFOUND, "missing tensor");
    expect_bind_error("tiny-gptoss", FM_QF_MXFP4, 0, "model.layers.%d.mlp.experts.gate_up_proj_blocks", 's', FM_E_FORMAT,
                      "expected [8, 128, 4, 16]");
    expect_bind_error("tiny-mixtral", FM_QF_NVFP4, 0, "model.layers.%d.block_sparse_moe.experts.7.w2.weight", 'x',
                      FM_E_NOTFOUND, "missing tensor");
    expect_bind_error("tiny-deepseek-v4", FM_QF_MXFP4, 0, "layers.%d.ffn.gate.tid2eid", 'v', FM_E_RANGE,
                      "holds expert 999, outside [0, 16)");
    expect_bind_error("tiny-deepseek-v4", FM_QF_MXFP4, 0, "layers.%d.ffn.experts.3.w1.scale", 'd', FM_E_FORMAT,
                      "expected F8_E8M0");
}

/* Bad arguments: no checkpoint, a dense layer. */
static void test_bind_bad_args(void **st) {
    (void)st;
    fm_model_desc d;
    assert_int_equal(fm_preset_desc("tiny-qwen3", FM_QF_NVFP4, &d), FM_OK);
    fm_moe_layer *l;
    assert_int_equal(fm_moe_layer_bind(NULL, &d, 0, FM_QF_NONE, &l), FM_E_ARG);
    assert_int_equal(fm_moe_layer_random(&d, FM_QF_NVFP4, 1, 5, &l), FM_E_ARG);
    assert_non_null(strstr(fm_last_error(), "layer 5"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip_all),   cmocka_unit_test(test_random_weights_sane),
        cmocka_unit_test(test_quantize_on_load), cmocka_unit_test(test_bind_errors),
        cmocka_unit_test(test_bind_bad_args),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
