/* Model descriptions: every family's sample config.json, bad configs (one
 * specific error each), presets and the config writer round trip. */
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

/* A file of tests/data/configs. */
static char *slurp(const char *name) {
    char rel[512], path[4096];
    snprintf(rel, sizeof rel, "configs/%s", name);
    return fm_test_read(fm_test_data_path(path, sizeof path, rel), NULL);
}

static void parse_sample(const char *cfg, const char *quant, fm_model_desc *d) {
    char *c = slurp(cfg), *q = quant ? slurp(quant) : NULL;
    fm_status s = fm_model_desc_parse(c, strlen(c), q, q ? strlen(q) : 0, d);
    if (s != FM_OK) fail_msg("%s: %s", cfg, fm_last_error());
    if (fm_model_desc_validate(d) != FM_OK) fail_msg("%s: %s", cfg, fm_last_error());
    free(c);
    free(q);
}

static void test_deepseek_v3(void **st) {
    (void)st;
    fm_model_desc d;
    parse_sample("deepseek_v3.json", "deepseek_v3_hf_quant_config.json", &d);
    assert_string_equal(d.family, "deepseek_v3");
    assert_int_equal(d.hidden, 7168);
    assert_int_equal(d.moe_inter, 2048);
    assert_int_equal(d.n_experts, 256);
    assert_int_equal(d.topk, 8);
    assert_int_equal(d.n_shared, 1);
    assert_int_equal(d.shared_inter, 2048);
    assert_int_equal(d.n_layers, 61);
    assert_int_equal(d.first_dense, 3);
    assert_int_equal(d.n_group, 8);
    assert_int_equal(d.topk_group, 4);
    assert_int_equal(d.norm_topk_prob, 1);
    assert_true(d.routed_scaling_factor == 2.5f);
    assert_int_equal(d.route, FM_ROUTE_NOAUX_TC);
    assert_int_equal(d.act, FM_ACT_SILU);
    assert_int_equal(d.expert_format, FM_QF_NVFP4);
    assert_int_equal(d.group_size, 16);
    assert_string_equal(d.layout, "modelopt");
    assert_int_equal(d.vocab_size, 129280);
    assert_false(fm_model_is_moe_layer(&d, 2));
    assert_true(fm_model_is_moe_layer(&d, 3));
    assert_true(fm_model_is_moe_layer(&d, 60));
    assert_false(fm_model_is_moe_layer(&d, 61));
    assert_false(fm_model_is_moe_layer(&d, -1));
    /* 3*H*I/2 + 3*H*I/16 by hand: H*I = 14680064 */
    assert_int_equal(fm_model_expert_bytes(&d, FM_QF_NVFP4), 22020096 + 2752512);
    assert_int_equal(fm_model_expert_bytes(&d, FM_QF_MXFP4), 22020096 + 1376256);
    assert_int_equal(fm_model_expert_bytes(&d, FM_QF_BF16), 88080384);
    /* the same config without any quantization file: BF16 experts */
    parse_sample("deepseek_v3.json", NULL, &d);
    assert_int_equal(d.expert_format, FM_QF_BF16);
    assert_string_equal(d.layout, "bf16");
}

static void test_kimi_glm(void **st) {
    (void)st;
    fm_model_desc d;
    parse_sample("kimi_k2.json", NULL, &d); /* quantization_config inside config.json */
    assert_string_equal(d.family, "kimi_k2");
    assert_int_equal(d.n_experts, 384);
    assert_int_equal(d.first_dense, 1);
    assert_true(fabsf(d.routed_scaling_factor - 2.827f) == 0);
    assert_int_equal(d.expert_format, FM_QF_NVFP4);
    assert_string_equal(d.layout, "modelopt");
    parse_sample("glm5.json", "glm5_hf_quant_config.json", &d);
    assert_string_equal(d.family, "glm5");
    assert_string_equal(d.model_type, "glm_moe_dsa");
    assert_int_equal(d.hidden, 6144);
    assert_int_equal(d.n_experts, 256);
    assert_int_equal(d.n_layers, 78);
    assert_int_equal(d.first_dense, 3); /* from mlp_layer_types */
    assert_int_equal(d.route, FM_ROUTE_NOAUX_TC);
    assert_false(fm_model_is_moe_layer(&d, 2));
    assert_true(fm_model_is_moe_layer(&d, 3));
    parse_sample("glm4_moe.json", NULL, &d);
    assert_string_equal(d.family, "glm4_moe");
    assert_int_equal(d.hidden, 5120);
    assert_int_equal(d.moe_inter, 1536);
    assert_int_equal(d.n_experts, 160);
    assert_int_equal(d.n_layers, 92);
    assert_int_equal(d.first_dense, 3);
    assert_int_equal(d.shared_inter, 1536);
}

static void test_deepseek_v4(void **st) {
    (void)st;
    fm_model_desc d;
    parse_sample("deepseek_v4.json", NULL, &d);
    assert_string_equal(d.family, "deepseek_v4");
    assert_int_equal(d.route, FM_ROUTE_DSV4);
    assert_int_equal(d.hidden, 4096);
    assert_int_equal(d.moe_inter, 2048);
    assert_int_equal(d.n_experts, 256);
    assert_int_equal(d.topk, 6);
    assert_int_equal(d.n_layers, 43);
    assert_int_equal(d.n_hash_layers, 3);
    assert_int_equal(d.first_dense, 0);
    assert_true(d.swiglu_limit == 10.0f);
    assert_true(d.routed_scaling_factor == 1.5f);
    assert_int_equal(d.vocab_size, 129280);
    assert_int_equal(d.expert_format, FM_QF_MXFP4);
    assert_string_equal(d.layout, "dsv4");
    assert_true(fm_model_is_moe_layer(&d, 0)); /* hash layers are MoE layers */
}

static void test_qwen_mixtral_gptoss(void **st) {
    (void)st;
    fm_model_desc d;
    parse_sample("qwen3_moe.json", "qwen3_moe_hf_quant_config.json", &d);
    assert_string_equal(d.family, "qwen3_moe");
    assert_int_equal(d.hidden, 2048);
    assert_int_equal(d.moe_inter, 768);
    assert_int_equal(d.n_experts, 128);
    assert_int_equal(d.topk, 8);
    assert_int_equal(d.n_shared, 0);
    assert_int_equal(d.route, FM_ROUTE_SOFTMAX);
    assert_int_equal(d.norm_topk_prob, 1);
    assert_int_equal(d.expert_format, FM_QF_NVFP4);
    assert_true(fm_model_is_moe_layer(&d, 0));
    parse_sample("mixtral.json", NULL, &d);
    assert_string_equal(d.family, "mixtral");
    assert_int_equal(d.moe_inter, 14336);
    assert_int_equal(d.n_experts, 8);
    assert_int_equal(d.topk, 2);
    assert_int_equal(d.norm_topk_prob, 1);
    assert_int_equal(d.expert_format, FM_QF_BF16);
    parse_sample("gpt_oss.json", NULL, &d);
    assert_string_equal(d.family, "gpt_oss");
    assert_int_equal(d.route, FM_ROUTE_GPTOSS);
    assert_int_equal(d.act, FM_ACT_GPTOSS);
    assert_true(d.swiglu_alpha == 1.702f);
    assert_true(d.swiglu_limit == 7.0f);
    assert_int_equal(d.hidden, 2880);
    assert_int_equal(d.moe_inter, 2880);
    assert_int_equal(d.n_experts, 128);
    assert_int_equal(d.topk, 4);
    assert_int_equal(d.expert_format, FM_QF_MXFP4);
    assert_string_equal(d.layout, "gptoss");
}

/* A small valid DeepSeek-style config with one key replaced / added. */
static fm_status parse_with(const char *extra, const char *quant, fm_model_desc *d) {
    char buf[4096];
    snprintf(buf, sizeof buf,
             "{%s\"model_type\":\"deepseek_v3\",\"hidden_size\":128,\"moe_intermediate_size\":64,"
             "\"n_routed_experts\":16,\"num_experts_per_tok\":4,\"n_shared_experts\":1,\"num_hidden_layers\":4,"
             "\"first_k_dense_replace\":1,\"n_group\":4,\"topk_group\":2,\"routed_scaling_factor\":2.5}",
             extra);
    fm_status s = fm_model_desc_parse(buf, strlen(buf), quant, quant ? strlen(quant) : 0, d);
    if (s == FM_OK) s = fm_model_desc_validate(d);
    return s;
}

static void expect(fm_status got, fm_status want, const char *needle) {
    if (got != want || !strstr(fm_last_error(), needle))
        fail_msg("got %s '%s', wanted %s containing '%s'", fm_status_name(got), fm_last_error(), fm_status_name(want), needle);
}

static void test_bad_configs(void **st) {
    (void)st;
    fm_model_desc d;
    /* duplicate keys: the later one would win silently in a lax parser */
    expect(parse_with("\"num_experts_per_tok\":17,", NULL, &d), FM_E_FORMAT, "invalid JSON");
    assert_int_equal(parse_with("", NULL, &d), FM_OK);
    const char *q = "{\"producer\":{\"name\":\"modelopt\"},\"quantization\":{\"quant_algo\":\"NVFP4\",\"group_size\":16}}";
    assert_int_equal(parse_with("", q, &d), FM_OK);
    assert_int_equal(d.expert_format, FM_QF_NVFP4);

    const char *tpl = "{\"model_type\":\"deepseek_v3\",\"hidden_size\":%s,\"moe_intermediate_size\":%s,"
                      "\"n_routed_experts\":%s,\"num_experts_per_tok\":%s,\"num_hidden_layers\":%s,"
                      "\"first_k_dense_replace\":%s,\"n_group\":%s,\"topk_group\":%s}";
    struct {
        const char *v[8];
        const char *quant;
        fm_status want;
        const char *needle;
    } cases[] = {
        {{"128", "64", "8", "9", "4", "0", "1", "1"}, NULL, FM_E_RANGE, "k=9 is greater than the number of experts E=8"},
        {{"0", "64", "8", "2", "4", "0", "1", "1"}, NULL, FM_E_RANGE, "hidden_size = 0"},
        {{"128", "0", "8", "2", "4", "0", "1", "1"}, NULL, FM_E_RANGE, "moe_intermediate_size = 0"},
        {{"-128", "64", "8", "2", "4", "0", "1", "1"}, NULL, FM_E_RANGE, "\"hidden_size\" = -128 is out of range"},
        {{"128", "64", "8", "2", "4", "0", "3", "1"}, NULL, FM_E_RANGE, "n_group = 3 does not divide"},
        {{"128", "64", "8", "2", "4", "0", "4", "5"}, NULL, FM_E_RANGE, "topk_group = 5 must be in [1, n_group=4]"},
        {{"128", "64", "16", "8", "4", "0", "4", "1"}, NULL, FM_E_RANGE, "k=8 experts cannot come from topk_group=1"},
        {{"120", "64", "8", "2", "4", "0", "1", "1"}, q, FM_E_RANGE, "hidden_size 120 is not a multiple of the nvfp4 block (16)"},
        {{"128", "40", "8", "2", "4", "0", "1", "1"}, q, FM_E_RANGE, "moe_intermediate_size 40 is not a multiple"},
        {{"128", "64", "8", "2", "4", "4", "1", "1"}, NULL, FM_E_RANGE, "first_k_dense_replace = 4 leaves no MoE layer"},
        {{"\"128\"", "64", "8", "2", "4", "0", "1", "1"}, NULL, FM_E_FORMAT, "\"hidden_size\" must be an integer"},
        {{"128.5", "64", "8", "2", "4", "0", "1", "1"}, NULL, FM_E_FORMAT, "\"hidden_size\" must be an integer"},
        {{"128", "64", "8", "2", "0", "0", "1", "1"}, NULL, FM_E_RANGE, "num_hidden_layers = 0"},
        {{"128", "64", "8", "2", "4", "0", "1", "1"}, "{\"quantization\":{\"quant_algo\":\"FP8\"}}", FM_E_UNSUPPORTED, "quant_algo \"FP8\""},
        {{"128", "64", "8", "2", "4", "0", "1", "1"}, "{\"quantization\":{\"quant_algo\":\"NVFP4\",\"group_size\":32}}", FM_E_UNSUPPORTED, "group_size 32"},
        {{"128", "64", "8", "2", "4", "0", "1", "1"}, "{\"producer\":{}}", FM_E_FORMAT, "missing object \"quantization\""},
        {{"128", "64", "8", "2", "4", "0", "1", "1"}, "[1,2]", FM_E_FORMAT, "hf_quant_config.json: top level"},
        {{"128", "64", "8", "2", "4", "0", "1", "1"}, "{\"quantization\":", FM_E_FORMAT, "hf_quant_config.json: invalid JSON"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char buf[2048];
        snprintf(buf, sizeof buf, tpl, cases[i].v[0], cases[i].v[1], cases[i].v[2], cases[i].v[3], cases[i].v[4],
                 cases[i].v[5], cases[i].v[6], cases[i].v[7]);
        const char *qq = cases[i].quant;
        fm_status s = fm_model_desc_parse(buf, strlen(buf), qq, qq ? strlen(qq) : 0, &d);
        if (s == FM_OK) s = fm_model_desc_validate(&d);
        expect(s, cases[i].want, cases[i].needle);
    }
    /* whole-document problems */
    struct {
        const char *cfg;
        fm_status want;
        const char *needle;
    } docs[] = {
        {"{\"hidden_size\":128}", FM_E_NOTFOUND, "missing key \"model_type\""},
        {"{\"model_type\":\"llama\",\"hidden_size\":128}", FM_E_UNSUPPORTED, "model_type \"llama\""},
        {"{\"model_type\":\"qwen3_moe\",\"hidden_size\":128,\"num_hidden_layers\":2,\"num_experts_per_tok\":2}", FM_E_NOTFOUND, "\"moe_intermediate_size\""},
        {"{\"model_type\":", FM_E_FORMAT, "invalid JSON"},
        {"[]", FM_E_FORMAT, "top level is not an object"},
        {"{\"model_type\":\"deepseek_v3\",\"model_type\":\"mixtral\"}", FM_E_FORMAT, "invalid JSON"},
        {"{\"model_type\":\"qwen3_moe\",\"hidden_size\":128,\"num_hidden_layers\":4,\"num_experts_per_tok\":2,"
         "\"moe_intermediate_size\":64,\"num_experts\":8,\"mlp_only_layers\":[2]}", FM_E_UNSUPPORTED, "mlp_only_layers"},
        {"{\"model_type\":\"glm_moe_dsa\",\"hidden_size\":128,\"num_hidden_layers\":3,\"num_experts_per_tok\":2,"
         "\"moe_intermediate_size\":64,\"n_routed_experts\":8,\"mlp_layer_types\":[\"dense\",\"sparse\"]}", FM_E_RANGE, "has 2 entries"},
        {"{\"model_type\":\"glm_moe_dsa\",\"hidden_size\":128,\"num_hidden_layers\":2,\"num_experts_per_tok\":2,"
         "\"moe_intermediate_size\":64,\"n_routed_experts\":8,\"mlp_layer_types\":[\"sparse\",\"dense\"]}", FM_E_UNSUPPORTED, "dense after a sparse"},
        {"{\"model_type\":\"deepseek_v3\",\"hidden_size\":128,\"num_hidden_layers\":2,\"num_experts_per_tok\":2,"
         "\"moe_intermediate_size\":64,\"n_routed_experts\":8,\"scoring_func\":\"softmax\"}", FM_E_UNSUPPORTED, "scoring_func \"softmax\""},
        {"{\"model_type\":\"deepseek_v3\",\"hidden_size\":128,\"num_hidden_layers\":2,\"num_experts_per_tok\":2,"
         "\"moe_intermediate_size\":64,\"n_routed_experts\":8,\"norm_topk_prob\":\"yes\"}", FM_E_FORMAT, "\"norm_topk_prob\" must be true or false"},
        {"{\"model_type\":\"deepseek_v3\",\"hidden_size\":128,\"num_hidden_layers\":2,\"num_experts_per_tok\":2,"
         "\"moe_intermediate_size\":64,\"n_routed_experts\":8,\"quantization_config\":{\"quant_method\":\"mxfp4\"}}", FM_E_UNSUPPORTED, "quant_method \"mxfp4\""},
        {"{\"model_type\":\"deepseek_v3\",\"hidden_size\":128,\"num_hidden_layers\":2,\"num_experts_per_tok\":2,"
         "\"moe_intermediate_size\":64,\"n_routed_experts\":8,\"quantization_config\":{\"quant_method\":\"awq\"}}", FM_E_UNSUPPORTED, "quant_method \"awq\""},
        {"{\"model_type\":\"deepseek_v4\",\"hidden_size\":128,\"num_hidden_layers\":2,\"num_experts_per_tok\":2,"
         "\"moe_intermediate_size\":64,\"n_routed_experts\":8,\"num_hash_layers\":1}", FM_E_RANGE, "hash routing needs vocab_size"},
        {"{\"model_type\":\"deepseek_v4\",\"hidden_size\":128,\"num_hidden_layers\":2,\"num_experts_per_tok\":2,"
         "\"moe_intermediate_size\":64,\"n_routed_experts\":8,\"routed_scaling_factor\":1e300}", FM_E_RANGE, "routed_scaling_factor"},
        {"{\"model_type\":\"gpt_oss\",\"hidden_size\":128,\"num_hidden_layers\":2,\"intermediate_size\":64,"
         "\"num_local_experts\":8}", FM_E_NOTFOUND, "experts_per_token"},
    };
    for (size_t i = 0; i < sizeof docs / sizeof docs[0]; i++) {
        fm_status s = fm_model_desc_parse(docs[i].cfg, strlen(docs[i].cfg), NULL, 0, &d);
        if (s == FM_OK) s = fm_model_desc_validate(&d);
        expect(s, docs[i].want, docs[i].needle);
    }
}

static void test_layer_patterns(void **st) {
    (void)st;
    fm_model_desc d;
    const char *q = "{\"model_type\":\"qwen3_moe\",\"hidden_size\":128,\"num_hidden_layers\":6,\"num_experts_per_tok\":2,"
                    "\"moe_intermediate_size\":64,\"num_experts\":8,\"decoder_sparse_step\":2,\"mlp_only_layers\":[0,1,2]}";
    assert_int_equal(fm_model_desc_parse(q, strlen(q), NULL, 0, &d), FM_OK);
    assert_int_equal(fm_model_desc_validate(&d), FM_OK);
    /* Qwen: (L+1) % step == 0 and not in mlp_only_layers */
    int want[6] = {0, 0, 0, 1, 0, 1};
    for (int l = 0; l < 6; l++) assert_int_equal(fm_model_is_moe_layer(&d, l), want[l]);
    const char *ds = "{\"model_type\":\"deepseek_v3\",\"hidden_size\":128,\"num_hidden_layers\":6,\"num_experts_per_tok\":2,"
                     "\"moe_intermediate_size\":64,\"n_routed_experts\":8,\"moe_layer_freq\":2,\"first_k_dense_replace\":1}";
    assert_int_equal(fm_model_desc_parse(ds, strlen(ds), NULL, 0, &d), FM_OK);
    /* DeepSeek: L >= first_k_dense_replace and L % freq == 0 */
    int want2[6] = {0, 0, 1, 0, 1, 0};
    for (int l = 0; l < 6; l++) assert_int_equal(fm_model_is_moe_layer(&d, l), want2[l]);
}

static void test_load_dir(void **st) {
    (void)st;
    char dir[64];
    fm_test_tmpdir(dir, sizeof dir, "test_config");
    fm_model_desc d;
    fm_status s = fm_model_desc_load(dir, &d);
    expect(s, FM_E_IO, "config.json");
    char path[4200];
    char *c = slurp("qwen3_moe.json"), *q = slurp("qwen3_moe_hf_quant_config.json");
    snprintf(path, sizeof path, "%s/config.json", dir);
    assert_int_equal(fm_write_file_atomic(path, c, strlen(c)), FM_OK);
    assert_int_equal(fm_model_desc_load(dir, &d), FM_OK);
    assert_int_equal(d.expert_format, FM_QF_BF16);
    snprintf(path, sizeof path, "%s/hf_quant_config.json", dir);
    assert_int_equal(fm_write_file_atomic(path, q, strlen(q)), FM_OK);
    assert_int_equal(fm_model_desc_load(dir, &d), FM_OK);
    assert_int_equal(d.expert_format, FM_QF_NVFP4);
    assert_int_equal(fm_write_file_atomic(path, "{", 1), FM_OK);
    expect(fm_model_desc_load(dir, &d), FM_E_FORMAT, "hf_quant_config.json: invalid JSON");
    assert_non_null(strstr(fm_last_error(), dir));
    unlink(path);
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    rmdir(dir);
    free(c);
    free(q);
}

static void test_presets_round_trip(void **st) {
    (void)st;
    assert_true(fm_preset_count() >= 14);
    const char *must[] = {"deepseek-v3", "kimi-k2", "glm-5", "glm-4.5", "deepseek-v4-flash", "qwen3-30b-a3b",
                          "qwen3-235b-a22b", "gpt-oss-120b",
                          "mixtral-8x7b", "tiny-deepseek", "tiny-deepseek-v4", "tiny-qwen3", "tiny-mixtral", "tiny-gptoss"};
    fm_model_desc d, back;
    for (size_t i = 0; i < sizeof must / sizeof must[0]; i++) assert_int_equal(fm_preset_desc(must[i], FM_QF_NONE, &d), FM_OK);
    expect(fm_preset_desc("deepseek-v9", FM_QF_NONE, &d), FM_E_NOTFOUND, "unknown preset \"deepseek-v9\"");
    /* REFERENCE.md shapes */
    assert_int_equal(fm_preset_desc("deepseek-v4-flash", FM_QF_NVFP4, &d), FM_OK);
    assert_int_equal(d.hidden, 4096);
    assert_int_equal(d.moe_inter, 2048);
    assert_int_equal(d.n_experts, 256);
    assert_int_equal(d.topk, 6);
    assert_int_equal(d.n_layers, 43);
    assert_int_equal(fm_model_expert_bytes(&d, FM_QF_NVFP4), 3LL * 4096 * 2048 / 2 + 3LL * 4096 * 2048 / 16);
    /* Qwen3-235B-A22B's config.json: hidden_size 4096, moe_intermediate_size
     * 1536, num_experts 128, num_experts_per_tok 8, 94 layers, all MoE,
     * norm_topk_prob, no shared expert, vocab 151936 */
    assert_int_equal(fm_preset_desc("qwen3-235b-a22b", FM_QF_NONE, &d), FM_OK);
    assert_int_equal(d.hidden, 4096);
    assert_int_equal(d.moe_inter, 1536);
    assert_int_equal(d.n_experts, 128);
    assert_int_equal(d.topk, 8);
    assert_int_equal(d.n_layers, 94);
    assert_int_equal(d.first_dense, 0);
    assert_int_equal(d.n_shared, 0);
    assert_int_equal(d.norm_topk_prob, 1);
    assert_int_equal(d.route, FM_ROUTE_SOFTMAX);
    assert_int_equal(d.vocab_size, 151936);
    assert_int_equal(d.expert_format, FM_QF_NVFP4);
    assert_int_equal(fm_preset_desc("kimi-k2", FM_QF_NONE, &d), FM_OK);
    assert_int_equal(d.n_experts, 384);
    assert_int_equal(fm_preset_desc("gpt-oss-120b", FM_QF_NONE, &d), FM_OK);
    assert_string_equal(d.layout, "gptoss");
    for (size_t i = 0; i < fm_preset_count(); i++) {
        const fm_qformat fmts[3] = {FM_QF_NVFP4, FM_QF_MXFP4, FM_QF_BF16};
        for (int f = 0; f < 3; f++) {
            const char *name = fm_preset_name(i);
            if (fm_preset_desc(name, fmts[f], &d) != FM_OK) fail_msg("%s: %s", name, fm_last_error());
            char *cfg = NULL, *q = NULL;
            assert_int_equal(fm_model_desc_to_json(&d, &cfg, &q), FM_OK);
            if (fm_model_desc_parse(cfg, strlen(cfg), q, q ? strlen(q) : 0, &back) != FM_OK)
                fail_msg("%s/%d: %s", name, f, fm_last_error());
            if (memcmp(&d, &back, sizeof d) != 0) fail_msg("%s (%s): config.json does not round-trip", name, fm_io_qformat_str(fmts[f]));
            free(cfg);
            free(q);
        }
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_deepseek_v3),      cmocka_unit_test(test_kimi_glm),
        cmocka_unit_test(test_deepseek_v4),      cmocka_unit_test(test_qwen_mixtral_gptoss),
        cmocka_unit_test(test_bad_configs),      cmocka_unit_test(test_layer_patterns),
        cmocka_unit_test(test_load_dir),         cmocka_unit_test(test_presets_round_trip),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
