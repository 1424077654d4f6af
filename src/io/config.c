/*
 * Model description from a Hugging Face config.json (+ hf_quant_config.json).
 *
 * Each family spells its MoE keys differently; the tables below map the real
 * key names onto fm_model_desc. What the config says about the layer pattern
 * is folded into first_dense / moe_layer_freq; patterns that cannot be
 * expressed that way (a non-prefix mlp_only_layers list) are refused by name
 * rather than approximated.
 */
#include "io/io_internal.h"
#include "util/util.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#define CFG_MAX_BYTES (16u << 20) /* real config.json files are a few KB */

/* ------------------------------------------------------------ JSON getters */

typedef struct {
    const char *src; /* "config.json" or "hf_quant_config.json" for messages */
} cfg_ctx;

/* Reads an integer key. Absent: *out = dflt (or error if required). */
static fm_status get_int(const cfg_ctx *cx, json_t *o, const char *key, int required, int dflt, int *out) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) {
        if (required) return fm_error(FM_E_NOTFOUND, "%s: missing key \"%s\"", cx->src, key);
        *out = dflt;
        return FM_OK;
    }
    double d;
    if (json_is_integer(v)) d = (double)json_integer_value(v);
    else if (json_is_real(v) && json_real_value(v) == floor(json_real_value(v))) d = json_real_value(v);
    else return fm_error(FM_E_FORMAT, "%s: key \"%s\" must be an integer", cx->src, key);
    if (d < 0 || d > 1e9) return fm_error(FM_E_RANGE, "%s: key \"%s\" = %.0f is out of range [0, 1e9]", cx->src, key, d);
    *out = (int)d;
    return FM_OK;
}

static fm_status get_float(const cfg_ctx *cx, json_t *o, const char *key, float dflt, float *out) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) { *out = dflt; return FM_OK; }
    if (!json_is_number(v)) return fm_error(FM_E_FORMAT, "%s: key \"%s\" must be a number", cx->src, key);
    double d = json_number_value(v);
    if (!isfinite(d) || fabs(d) > 1e30) return fm_error(FM_E_RANGE, "%s: key \"%s\" is not a finite float", cx->src, key);
    *out = (float)d;
    return FM_OK;
}

static fm_status get_bool(const cfg_ctx *cx, json_t *o, const char *key, int dflt, int *out) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) { *out = dflt; return FM_OK; }
    if (json_is_boolean(v)) { *out = json_is_true(v); return FM_OK; }
    if (json_is_integer(v) && (json_integer_value(v) == 0 || json_integer_value(v) == 1)) {
        *out = (int)json_integer_value(v);
        return FM_OK;
    }
    return fm_error(FM_E_FORMAT, "%s: key \"%s\" must be true or false", cx->src, key);
}

/* NULL if absent; error if present but not a string. */
static fm_status get_str(const cfg_ctx *cx, json_t *o, const char *key, const char **out) {
    json_t *v = json_object_get(o, key);
    *out = NULL;
    if (!v || json_is_null(v)) return FM_OK;
    if (!json_is_string(v)) return fm_error(FM_E_FORMAT, "%s: key \"%s\" must be a string", cx->src, key);
    *out = json_string_value(v);
    return FM_OK;
}

#define TRY(x) do { fm_status s_ = (x); if (s_ != FM_OK) return s_; } while (0)

/* ----------------------------------------------------------- family keys */

typedef enum { FAM_DEEPSEEK, FAM_QWEN3, FAM_MIXTRAL, FAM_GPTOSS } fam_keys;

static const struct {
    const char *model_type;
    const char *family;
    fam_keys keys;
} k_families[] = {
    {"deepseek_v3", "deepseek_v3", FAM_DEEPSEEK},
    {"deepseek_v32", "deepseek_v3", FAM_DEEPSEEK}, /* V3.2 keeps V3's MoE keys */
    {"kimi_k2", "kimi_k2", FAM_DEEPSEEK},
    {"glm4_moe", "glm4_moe", FAM_DEEPSEEK},
    {"glm_moe_dsa", "glm5", FAM_DEEPSEEK},
    {"deepseek_v4", "deepseek_v4", FAM_DEEPSEEK},
    {"qwen3_moe", "qwen3_moe", FAM_QWEN3},
    {"mixtral", "mixtral", FAM_MIXTRAL},
    {"gpt_oss", "gpt_oss", FAM_GPTOSS},
};

/* A dense-prefix pattern given as a list (GLM-5 mlp_layer_types, Qwen3
 * mlp_only_layers) becomes first_dense; anything else is refused. */
static fm_status parse_mlp_layer_types(const cfg_ctx *cx, json_t *arr, int n_layers, int *first_dense) {
    if (!json_is_array(arr)) return fm_error(FM_E_FORMAT, "%s: key \"mlp_layer_types\" must be a list", cx->src);
    size_t n = json_array_size(arr);
    if ((int64_t)n != n_layers)
        return fm_error(FM_E_RANGE, "%s: \"mlp_layer_types\" has %zu entries, num_hidden_layers is %d", cx->src, n, n_layers);
    int dense = 0, seen_sparse = 0;
    for (size_t i = 0; i < n; i++) {
        const char *s = json_string_value(json_array_get(arr, i));
        if (!s) return fm_error(FM_E_FORMAT, "%s: \"mlp_layer_types\"[%zu] is not a string", cx->src, i);
        if (!strcmp(s, "dense")) {
            if (seen_sparse)
                return fm_error(FM_E_UNSUPPORTED, "%s: \"mlp_layer_types\"[%zu] is dense after a sparse layer (only a dense prefix is supported)", cx->src, i);
            dense++;
        } else if (!strcmp(s, "sparse") || !strcmp(s, "moe")) {
            seen_sparse = 1;
        } else {
            return fm_error(FM_E_FORMAT, "%s: \"mlp_layer_types\"[%zu] = \"%s\" (expected dense or sparse)", cx->src, i, s);
        }
    }
    *first_dense = dense;
    return FM_OK;
}

static fm_status parse_mlp_only_layers(const cfg_ctx *cx, json_t *arr, int *first_dense) {
    if (!arr || json_is_null(arr)) return FM_OK;
    if (!json_is_array(arr)) return fm_error(FM_E_FORMAT, "%s: key \"mlp_only_layers\" must be a list", cx->src);
    size_t n = json_array_size(arr);
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(arr, i);
        if (!json_is_integer(v) || json_integer_value(v) != (json_int_t)i)
            return fm_error(FM_E_UNSUPPORTED, "%s: \"mlp_only_layers\" must be a prefix 0,1,2,... (entry %zu differs)", cx->src, i);
    }
    *first_dense = (int)n;
    return FM_OK;
}

/* ------------------------------------------------------------ quantization */

/* ModelOpt: {"producer":{"name":"modelopt"},"quantization":{"quant_algo":..}}
 * or config.json quantization_config {"quant_method":"modelopt","quant_algo":..}. */
static fm_status apply_modelopt_algo(const char *src, const char *algo, json_t *q, fm_model_desc *d) {
    cfg_ctx cx = {src};
    if (!algo) algo = "NVFP4";
    int gs = 0;
    if (!strcmp(algo, "NVFP4")) {
        d->expert_format = FM_QF_NVFP4;
        TRY(get_int(&cx, q, "group_size", 0, 16, &gs));
        if (gs != 16) return fm_error(FM_E_UNSUPPORTED, "%s: NVFP4 with group_size %d (only 16 exists)", src, gs);
    } else if (!strcmp(algo, "MXFP4")) {
        d->expert_format = FM_QF_MXFP4;
        TRY(get_int(&cx, q, "group_size", 0, 32, &gs));
        if (gs != 32) return fm_error(FM_E_UNSUPPORTED, "%s: MXFP4 with group_size %d (only 32 exists)", src, gs);
    } else {
        return fm_error(FM_E_UNSUPPORTED, "%s: quant_algo \"%s\" is not supported for experts (NVFP4, MXFP4)", src, algo);
    }
    d->group_size = gs;
    snprintf(d->layout, sizeof d->layout, "modelopt");
    return FM_OK;
}

static fm_status parse_quant(json_t *cfg, json_t *hfq, fm_model_desc *d) {
    cfg_ctx cx = {"config.json"};
    /* hf_quant_config.json wins: it is what ModelOpt exporters write first. */
    if (hfq) {
        cfg_ctx qx = {"hf_quant_config.json"};
        json_t *q = json_object_get(hfq, "quantization");
        if (!json_is_object(q)) return fm_error(FM_E_FORMAT, "hf_quant_config.json: missing object \"quantization\"");
        const char *algo;
        TRY(get_str(&qx, q, "quant_algo", &algo));
        if (!algo) return fm_error(FM_E_NOTFOUND, "hf_quant_config.json: missing key \"quantization.quant_algo\"");
        return apply_modelopt_algo("hf_quant_config.json", algo, q, d);
    }
    json_t *qc = json_object_get(cfg, "quantization_config");
    if (qc && !json_is_null(qc)) {
        if (!json_is_object(qc)) return fm_error(FM_E_FORMAT, "config.json: \"quantization_config\" must be an object");
        const char *method;
        TRY(get_str(&cx, qc, "quant_method", &method));
        if (!method) return fm_error(FM_E_NOTFOUND, "config.json: missing key \"quantization_config.quant_method\"");
        if (!strcmp(method, "modelopt")) {
            const char *algo;
            TRY(get_str(&cx, qc, "quant_algo", &algo));
            return apply_modelopt_algo("config.json quantization_config", algo, qc, d);
        }
        if (!strcmp(method, "mxfp4")) {
            if (strcmp(d->family, "gpt_oss") != 0)
                return fm_error(FM_E_UNSUPPORTED, "config.json: quant_method \"mxfp4\" (gpt-oss fused layout) for model_type \"%s\"", d->model_type);
            d->expert_format = FM_QF_MXFP4;
            d->group_size = 32;
            snprintf(d->layout, sizeof d->layout, "gptoss");
            return FM_OK;
        }
        /* DeepSeek-V4's own checkpoints: FP8 dense weights, MXFP4 experts. */
        if (!strcmp(d->family, "deepseek_v4") && !strcmp(method, "fp8")) {
            d->expert_format = FM_QF_MXFP4;
            d->group_size = 32;
            snprintf(d->layout, sizeof d->layout, "dsv4");
            return FM_OK;
        }
        return fm_error(FM_E_UNSUPPORTED, "config.json: quant_method \"%s\" is not supported for %s experts", method, d->model_type);
    }
    d->expert_format = FM_QF_BF16;
    d->group_size = 0;
    snprintf(d->layout, sizeof d->layout, "bf16");
    return FM_OK;
}

/* ------------------------------------------------------------------ parse */

static fm_status parse_obj(json_t *root, json_t *hfq, fm_model_desc *d) {
    cfg_ctx cx = {"config.json"};
    memset(d, 0, sizeof *d);
    if (!json_is_object(root)) return fm_error(FM_E_FORMAT, "config.json: top level is not an object");
    /* Multimodal wrappers nest the language model. */
    json_t *tc = json_object_get(root, "text_config");
    json_t *o = (json_is_object(tc) && !json_object_get(root, "hidden_size")) ? tc : root;

    const char *mt;
    TRY(get_str(&cx, o, "model_type", &mt));
    if (!mt && o != root) TRY(get_str(&cx, root, "model_type", &mt));
    if (!mt) return fm_error(FM_E_NOTFOUND, "config.json: missing key \"model_type\"");
    size_t fi = 0, nf = sizeof k_families / sizeof k_families[0];
    for (; fi < nf; fi++)
        if (!strcmp(k_families[fi].model_type, mt)) break;
    if (fi == nf)
        return fm_error(FM_E_UNSUPPORTED, "config.json: model_type \"%s\" is not a supported MoE family "
                        "(deepseek_v3, kimi_k2, glm4_moe, glm_moe_dsa, deepseek_v4, qwen3_moe, mixtral, gpt_oss)", mt);
    snprintf(d->model_type, sizeof d->model_type, "%s", mt);
    snprintf(d->family, sizeof d->family, "%s", k_families[fi].family);

    TRY(get_int(&cx, o, "hidden_size", 1, 0, &d->hidden));
    TRY(get_int(&cx, o, "num_hidden_layers", 1, 0, &d->n_layers));
    TRY(get_int(&cx, o, "num_experts_per_tok", k_families[fi].keys != FAM_GPTOSS, 0, &d->topk));
    TRY(get_int(&cx, o, "vocab_size", 0, 0, &d->vocab_size));
    d->moe_layer_freq = 1;
    d->n_group = d->topk_group = 1;
    d->routed_scaling_factor = 1.0f;
    d->act = FM_ACT_SILU;

    switch (k_families[fi].keys) {
    case FAM_DEEPSEEK: {
        TRY(get_int(&cx, o, "moe_intermediate_size", 1, 0, &d->moe_inter));
        TRY(get_int(&cx, o, "n_routed_experts", 1, 0, &d->n_experts));
        TRY(get_int(&cx, o, "n_shared_experts", 0, 0, &d->n_shared));
        TRY(get_int(&cx, o, "first_k_dense_replace", 0, 0, &d->first_dense));
        TRY(get_int(&cx, o, "moe_layer_freq", 0, 1, &d->moe_layer_freq));
        TRY(get_int(&cx, o, "n_group", 0, 1, &d->n_group));
        TRY(get_int(&cx, o, "topk_group", 0, 1, &d->topk_group));
        TRY(get_bool(&cx, o, "norm_topk_prob", 1, &d->norm_topk_prob));
        TRY(get_float(&cx, o, "routed_scaling_factor", 1.0f, &d->routed_scaling_factor));
        json_t *mlt = json_object_get(o, "mlp_layer_types");
        if (mlt && !json_is_null(mlt)) TRY(parse_mlp_layer_types(&cx, mlt, d->n_layers, &d->first_dense));
        const char *scoring, *method;
        TRY(get_str(&cx, o, "scoring_func", &scoring));
        TRY(get_str(&cx, o, "topk_method", &method));
        if (!strcmp(d->family, "deepseek_v4")) {
            if (scoring && strcmp(scoring, "sqrtsoftplus") != 0)
                return fm_error(FM_E_UNSUPPORTED, "config.json: scoring_func \"%s\" for deepseek_v4 (expected sqrtsoftplus)", scoring);
            d->route = FM_ROUTE_DSV4;
            TRY(get_int(&cx, o, "num_hash_layers", 0, 0, &d->n_hash_layers));
            TRY(get_float(&cx, o, "swiglu_limit", 0.0f, &d->swiglu_limit));
        } else {
            if (scoring && strcmp(scoring, "sigmoid") != 0)
                return fm_error(FM_E_UNSUPPORTED, "config.json: scoring_func \"%s\" (only sigmoid with noaux_tc is supported for %s)", scoring, mt);
            if (method && strcmp(method, "noaux_tc") != 0)
                return fm_error(FM_E_UNSUPPORTED, "config.json: topk_method \"%s\" (only noaux_tc is supported for %s)", method, mt);
            d->route = FM_ROUTE_NOAUX_TC;
        }
        break;
    }
    case FAM_QWEN3: {
        TRY(get_int(&cx, o, "moe_intermediate_size", 1, 0, &d->moe_inter));
        TRY(get_int(&cx, o, "num_experts", 1, 0, &d->n_experts));
        TRY(get_int(&cx, o, "decoder_sparse_step", 0, 1, &d->moe_layer_freq));
        TRY(get_bool(&cx, o, "norm_topk_prob", 0, &d->norm_topk_prob));
        TRY(parse_mlp_only_layers(&cx, json_object_get(o, "mlp_only_layers"), &d->first_dense));
        d->route = FM_ROUTE_SOFTMAX;
        break;
    }
    case FAM_MIXTRAL:
        TRY(get_int(&cx, o, "intermediate_size", 1, 0, &d->moe_inter));
        TRY(get_int(&cx, o, "num_local_experts", 1, 0, &d->n_experts));
        d->norm_topk_prob = 1; /* Mixtral always renormalizes its top-2 */
        d->route = FM_ROUTE_SOFTMAX;
        break;
    case FAM_GPTOSS:
        TRY(get_int(&cx, o, "intermediate_size", 1, 0, &d->moe_inter));
        TRY(get_int(&cx, o, "num_local_experts", 1, 0, &d->n_experts));
        if (!json_object_get(o, "num_experts_per_tok"))
            TRY(get_int(&cx, o, "experts_per_token", 1, 0, &d->topk));
        TRY(get_float(&cx, o, "swiglu_limit", 7.0f, &d->swiglu_limit));
        d->swiglu_alpha = 1.702f; /* fixed in the model code, not in config */
        d->norm_topk_prob = 1;    /* softmax over the selected k */
        d->route = FM_ROUTE_GPTOSS;
        d->act = FM_ACT_GPTOSS;
        break;
    }
    uint64_t si;
    if (!fm_mul_ok((uint64_t)d->moe_inter, (uint64_t)d->n_shared, &si) || si > 1000000000u)
        return fm_error(FM_E_RANGE, "config.json: shared expert width %d x %d overflows", d->moe_inter, d->n_shared);
    d->shared_inter = (int)si;
    return parse_quant(root, hfq, d);
}

fm_status fm_model_desc_parse(const char *config_json, size_t config_len, const char *quant_json, size_t quant_len,
                              fm_model_desc *out) {
    if (!config_json || !out) return fm_error(FM_E_ARG, "fm_model_desc_parse: NULL argument");
    json_error_t je;
    json_t *root = json_loadb(config_json, config_len, JSON_REJECT_DUPLICATES, &je);
    if (!root) return fm_error(FM_E_FORMAT, "config.json: invalid JSON at line %d column %d: %s", je.line, je.column, je.text);
    json_t *hfq = NULL;
    if (quant_json) {
        hfq = json_loadb(quant_json, quant_len, JSON_REJECT_DUPLICATES, &je);
        if (!hfq) {
            json_decref(root);
            return fm_error(FM_E_FORMAT, "hf_quant_config.json: invalid JSON at line %d column %d: %s", je.line, je.column, je.text);
        }
        if (!json_is_object(hfq)) {
            json_decref(root);
            json_decref(hfq);
            return fm_error(FM_E_FORMAT, "hf_quant_config.json: top level is not an object");
        }
    }
    fm_model_desc d;
    fm_status s = parse_obj(root, hfq, &d);
    json_decref(root);
    if (hfq) json_decref(hfq);
    if (s != FM_OK) return s;
    *out = d;
    return FM_OK;
}

fm_status fm_model_desc_load(const char *dir, fm_model_desc *out) {
    char path[4096];
    char *cfg = NULL, *q = NULL;
    size_t cl = 0, ql = 0;
    TRY(fm_path_join(path, sizeof path, dir, "config.json"));
    fm_status s = fm_read_file(path, CFG_MAX_BYTES, &cfg, &cl);
    if (s != FM_OK) return s;
    TRY(fm_path_join(path, sizeof path, dir, "hf_quant_config.json"));
    FILE *f = fopen(path, "rb");
    if (f) {
        fclose(f);
        s = fm_read_file(path, CFG_MAX_BYTES, &q, &ql);
        if (s != FM_OK) { free(cfg); return s; }
    }
    s = fm_model_desc_parse(cfg, cl, q, ql, out);
    if (s != FM_OK) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", fm_last_error());
        fm_error(s, "%s: %s", dir, msg);
    } else {
        s = fm_model_desc_validate(out);
        if (s != FM_OK) {
            char msg[1024];
            snprintf(msg, sizeof msg, "%s", fm_last_error());
            fm_error(s, "%s: %s", dir, msg);
        }
    }
    free(cfg);
    free(q);
    return s;
}

/* --------------------------------------------------------------- validate */

fm_status fm_model_desc_validate(const fm_model_desc *d) {
    if (!d) return fm_error(FM_E_ARG, "fm_model_desc_validate: NULL");
    const int lim = 1 << 20;
#define POS(field, name)                                                                                   \
    if (d->field <= 0 || d->field > lim)                                                                     \
        return fm_error(FM_E_RANGE, "%s = %d must be in [1, %d]", name, d->field, lim);
    POS(hidden, "hidden_size")
    POS(moe_inter, "moe_intermediate_size")
    POS(n_experts, "number of routed experts")
    POS(topk, "num_experts_per_tok")
    POS(n_layers, "num_hidden_layers")
#undef POS
    if (d->n_experts > 65536) return fm_error(FM_E_RANGE, "number of routed experts %d is more than 65536", d->n_experts);
    if (d->topk > d->n_experts)
        return fm_error(FM_E_RANGE, "num_experts_per_tok k=%d is greater than the number of experts E=%d", d->topk, d->n_experts);
    if (d->n_shared < 0 || d->n_shared > 64) return fm_error(FM_E_RANGE, "n_shared_experts = %d must be in [0, 64]", d->n_shared);
    if (d->shared_inter != d->moe_inter * d->n_shared)
        return fm_error(FM_E_RANGE, "shared expert width %d is not moe_intermediate_size %d x n_shared_experts %d",
                        d->shared_inter, d->moe_inter, d->n_shared);
    if (d->first_dense < 0 || d->first_dense >= d->n_layers)
        return fm_error(FM_E_RANGE, "first_k_dense_replace = %d leaves no MoE layer among %d layers", d->first_dense, d->n_layers);
    if (d->moe_layer_freq < 1 || d->moe_layer_freq > d->n_layers)
        return fm_error(FM_E_RANGE, "moe_layer_freq / decoder_sparse_step = %d must be in [1, %d]", d->moe_layer_freq, d->n_layers);
    if (d->n_group < 1 || d->n_group > d->n_experts)
        return fm_error(FM_E_RANGE, "n_group = %d must be in [1, E=%d]", d->n_group, d->n_experts);
    if (d->n_experts % d->n_group)
        return fm_error(FM_E_RANGE, "n_group = %d does not divide the number of experts E=%d", d->n_group, d->n_experts);
    if (d->topk_group < 1 || d->topk_group > d->n_group)
        return fm_error(FM_E_RANGE, "topk_group = %d must be in [1, n_group=%d]", d->topk_group, d->n_group);
    if (d->route == FM_ROUTE_NOAUX_TC && d->n_group > 1) {
        int per = d->n_experts / d->n_group;
        if (per < 2) return fm_error(FM_E_RANGE, "n_group = %d leaves %d expert per group (group score sums the top 2)", d->n_group, per);
        if (d->topk > d->topk_group * per)
            return fm_error(FM_E_RANGE, "k=%d experts cannot come from topk_group=%d groups of %d experts", d->topk, d->topk_group, per);
    }
    if (!isfinite(d->routed_scaling_factor) || d->routed_scaling_factor <= 0)
        return fm_error(FM_E_RANGE, "routed_scaling_factor = %g must be finite and positive", (double)d->routed_scaling_factor);
    if (d->route < FM_ROUTE_NOAUX_TC || d->route > FM_ROUTE_DSV4) return fm_error(FM_E_RANGE, "unknown routing kind %d", (int)d->route);
    if (d->act != FM_ACT_SILU && d->act != FM_ACT_GPTOSS) return fm_error(FM_E_RANGE, "unknown activation kind %d", (int)d->act);
    if (d->act == FM_ACT_GPTOSS && !(d->swiglu_limit > 0 && d->swiglu_alpha > 0))
        return fm_error(FM_E_RANGE, "gpt-oss activation needs swiglu_limit > 0 and alpha > 0 (got %g, %g)",
                        (double)d->swiglu_limit, (double)d->swiglu_alpha);
    if (!isfinite(d->swiglu_limit) || d->swiglu_limit < 0) return fm_error(FM_E_RANGE, "swiglu_limit = %g", (double)d->swiglu_limit);
    if (d->n_hash_layers < 0 || d->n_hash_layers > d->n_layers)
        return fm_error(FM_E_RANGE, "num_hash_layers = %d must be in [0, num_hidden_layers=%d]", d->n_hash_layers, d->n_layers);
    if (d->n_hash_layers > 0 && d->route != FM_ROUTE_DSV4)
        return fm_error(FM_E_RANGE, "num_hash_layers = %d but routing is not DeepSeek-V4", d->n_hash_layers);
    if (d->n_hash_layers > 0 && (d->vocab_size <= 0 || d->vocab_size > (1 << 24)))
        return fm_error(FM_E_RANGE, "hash routing needs vocab_size in [1, 2^24] (got %d)", d->vocab_size);
    if (d->n_hash_layers > 0 && d->topk > 32)
        return fm_error(FM_E_RANGE, "hash routing with num_experts_per_tok %d > 32", d->topk);
    if (d->vocab_size < 0) return fm_error(FM_E_RANGE, "vocab_size = %d", d->vocab_size);
    int blk;
    switch (d->expert_format) {
    case FM_QF_NVFP4: blk = 16; break;
    case FM_QF_MXFP4: blk = 32; break;
    case FM_QF_BF16: blk = 2; break; /* keeps rows of whole 32-bit words */
    default: return fm_error(FM_E_RANGE, "expert format %d is not nvfp4, mxfp4 or bf16", (int)d->expert_format);
    }
    const char *fn = fm_io_qformat_str(d->expert_format);
    if (d->hidden % blk)
        return fm_error(FM_E_RANGE, "hidden_size %d is not a multiple of the %s block (%d)", d->hidden, fn, blk);
    if (d->moe_inter % blk)
        return fm_error(FM_E_RANGE, "moe_intermediate_size %d is not a multiple of the %s block (%d)", d->moe_inter, fn, blk);
    if (d->expert_format != FM_QF_BF16 && d->group_size != blk)
        return fm_error(FM_E_RANGE, "group_size %d does not match the %s block %d", d->group_size, fn, blk);
    const char *lay = d->layout;
    if (strcmp(lay, "modelopt") && strcmp(lay, "gptoss") && strcmp(lay, "dsv4") && strcmp(lay, "bf16"))
        return fm_error(FM_E_RANGE, "checkpoint layout \"%s\" is not modelopt, gptoss, dsv4 or bf16", lay);
    if (!strcmp(lay, "modelopt") && d->expert_format == FM_QF_BF16)
        return fm_error(FM_E_RANGE, "layout modelopt with bf16 experts (use layout bf16)");
    if (!strcmp(lay, "bf16") && d->expert_format != FM_QF_BF16)
        return fm_error(FM_E_RANGE, "layout bf16 with %s experts", fn);
    if ((!strcmp(lay, "gptoss") || !strcmp(lay, "dsv4")) && d->expert_format != FM_QF_MXFP4)
        return fm_error(FM_E_RANGE, "layout %s stores MXFP4 experts, not %s", lay, fn);
    if (!strcmp(lay, "gptoss") && strcmp(d->family, "gpt_oss"))
        return fm_error(FM_E_RANGE, "layout gptoss is only defined for gpt_oss (family %s)", d->family);
    if (!strcmp(lay, "dsv4") && strcmp(d->family, "deepseek_v4"))
        return fm_error(FM_E_RANGE, "layout dsv4 is only defined for deepseek_v4 (family %s)", d->family);
    int any = 0;
    for (int l = 0; l < d->n_layers && !any; l++) any = fm_model_is_moe_layer(d, l);
    if (!any) return fm_error(FM_E_RANGE, "no layer of %d is a MoE layer (first_k_dense_replace %d, frequency %d)",
                              d->n_layers, d->first_dense, d->moe_layer_freq);
    return FM_OK;
}

int fm_model_is_moe_layer(const fm_model_desc *d, int layer) {
    if (!d || layer < 0 || layer >= d->n_layers || layer < d->first_dense) return 0;
    int f = d->moe_layer_freq > 0 ? d->moe_layer_freq : 1;
    /* Qwen counts decoder_sparse_step from 1 ((L+1) % step), DeepSeek's
     * moe_layer_freq from 0 (L % freq); both are 1 in every released model. */
    if (!strcmp(d->family, "qwen3_moe")) return (layer + 1) % f == 0;
    return layer % f == 0;
}

int64_t fm_model_expert_bytes(const fm_model_desc *d, fm_qformat f) {
    if (!d || d->hidden <= 0 || d->moe_inter <= 0) return 0;
    int64_t hi = (int64_t)d->hidden * d->moe_inter;
    switch (f) {
    case FM_QF_NVFP4: return 3 * (hi / 2 + hi / 16);
    case FM_QF_MXFP4: return 3 * (hi / 2 + hi / 32);
    case FM_QF_BF16: return 3 * hi * 2;
    default: return 0;
    }
}

/* ------------------------------------------------------------ config writer */

static void set_int(json_t *o, const char *k, int v) { json_object_set_new(o, k, json_integer(v)); }
static void set_real(json_t *o, const char *k, double v) { json_object_set_new(o, k, json_real(v)); }
static void set_str(json_t *o, const char *k, const char *v) { json_object_set_new(o, k, json_string(v)); }

static const char *arch_of(const char *family) {
    if (!strcmp(family, "deepseek_v3")) return "DeepseekV3ForCausalLM";
    if (!strcmp(family, "kimi_k2")) return "DeepseekV3ForCausalLM";
    if (!strcmp(family, "glm4_moe")) return "Glm4MoeForCausalLM";
    if (!strcmp(family, "glm5")) return "GlmMoeDsaForCausalLM";
    if (!strcmp(family, "deepseek_v4")) return "DeepseekV4ForCausalLM";
    if (!strcmp(family, "qwen3_moe")) return "Qwen3MoeForCausalLM";
    if (!strcmp(family, "mixtral")) return "MixtralForCausalLM";
    return "GptOssForCausalLM";
}

fm_status fm_model_desc_to_json(const fm_model_desc *d, char **config_json, char **quant_json) {
    *config_json = NULL;
    if (quant_json) *quant_json = NULL;
    TRY(fm_model_desc_validate(d));
    json_t *o = json_object();
    json_t *arch = json_array();
    json_array_append_new(arch, json_string(arch_of(d->family)));
    json_object_set_new(o, "architectures", arch);
    set_str(o, "model_type", d->model_type[0] ? d->model_type : d->family);
    set_int(o, "hidden_size", d->hidden);
    set_int(o, "num_hidden_layers", d->n_layers);
    set_int(o, "num_experts_per_tok", d->topk);
    if (d->vocab_size > 0) set_int(o, "vocab_size", d->vocab_size);
    set_str(o, "hidden_act", "silu");
    set_str(o, "torch_dtype", "bfloat16");
    if (!strcmp(d->family, "qwen3_moe")) {
        set_int(o, "moe_intermediate_size", d->moe_inter);
        set_int(o, "num_experts", d->n_experts);
        set_int(o, "decoder_sparse_step", d->moe_layer_freq);
        json_t *mol = json_array();
        for (int i = 0; i < d->first_dense; i++) json_array_append_new(mol, json_integer(i));
        json_object_set_new(o, "mlp_only_layers", mol);
        json_object_set_new(o, "norm_topk_prob", json_boolean(d->norm_topk_prob));
    } else if (!strcmp(d->family, "mixtral")) {
        set_int(o, "intermediate_size", d->moe_inter);
        set_int(o, "num_local_experts", d->n_experts);
    } else if (!strcmp(d->family, "gpt_oss")) {
        set_int(o, "intermediate_size", d->moe_inter);
        set_int(o, "num_local_experts", d->n_experts);
        set_int(o, "experts_per_token", d->topk);
        set_real(o, "swiglu_limit", d->swiglu_limit);
    } else {
        set_int(o, "moe_intermediate_size", d->moe_inter);
        set_int(o, "n_routed_experts", d->n_experts);
        set_int(o, "n_shared_experts", d->n_shared);
        set_int(o, "moe_layer_freq", d->moe_layer_freq);
        set_int(o, "n_group", d->n_group);
        set_int(o, "topk_group", d->topk_group);
        json_object_set_new(o, "norm_topk_prob", json_boolean(d->norm_topk_prob));
        set_real(o, "routed_scaling_factor", d->routed_scaling_factor);
        set_str(o, "topk_method", "noaux_tc");
        if (!strcmp(d->family, "glm5")) {
            json_t *t = json_array();
            for (int i = 0; i < d->n_layers; i++) json_array_append_new(t, json_string(i < d->first_dense ? "dense" : "sparse"));
            json_object_set_new(o, "mlp_layer_types", t);
        } else {
            set_int(o, "first_k_dense_replace", d->first_dense);
        }
        if (!strcmp(d->family, "deepseek_v4")) {
            set_str(o, "scoring_func", "sqrtsoftplus");
            set_int(o, "num_hash_layers", d->n_hash_layers);
            set_real(o, "swiglu_limit", d->swiglu_limit);
        } else {
            set_str(o, "scoring_func", "sigmoid");
        }
    }
    json_t *hq = NULL;
    if (!strcmp(d->layout, "modelopt")) {
        const char *algo = d->expert_format == FM_QF_NVFP4 ? "NVFP4" : "MXFP4";
        hq = json_object();
        json_t *prod = json_object();
        set_str(prod, "name", "modelopt");
        set_str(prod, "version", "fp4moe-gen");
        json_object_set_new(hq, "producer", prod);
        json_t *q = json_object();
        set_str(q, "quant_algo", algo);
        set_int(q, "group_size", d->group_size);
        json_t *ex = json_array();
        json_array_append_new(ex, json_string("lm_head"));
        json_array_append_new(ex, json_string("*.mlp.gate"));
        json_array_append_new(ex, json_string("*.mlp.router"));
        json_object_set_new(q, "exclude_modules", ex);
        json_object_set_new(hq, "quantization", q);
        json_t *qc = json_object();
        set_str(qc, "quant_method", "modelopt");
        set_str(qc, "quant_algo", algo);
        set_int(qc, "group_size", d->group_size);
        json_object_set_new(qc, "ignore", json_deep_copy(ex));
        json_object_set_new(o, "quantization_config", qc);
    } else if (!strcmp(d->layout, "gptoss")) {
        json_t *qc = json_object();
        set_str(qc, "quant_method", "mxfp4");
        json_t *nc = json_array();
        json_array_append_new(nc, json_string("model.layers.*.self_attn"));
        json_array_append_new(nc, json_string("model.layers.*.mlp.router"));
        json_array_append_new(nc, json_string("model.embed_tokens"));
        json_array_append_new(nc, json_string("lm_head"));
        json_object_set_new(qc, "modules_to_not_convert", nc);
        json_object_set_new(o, "quantization_config", qc);
    } else if (!strcmp(d->layout, "dsv4")) {
        json_t *qc = json_object();
        set_str(qc, "quant_method", "fp8");
        set_str(qc, "fmt", "e4m3");
        set_str(qc, "scale_fmt", "ue8m0");
        json_t *bs = json_array();
        json_array_append_new(bs, json_integer(128));
        json_array_append_new(bs, json_integer(128));
        json_object_set_new(qc, "weight_block_size", bs);
        json_object_set_new(o, "quantization_config", qc);
    }
    *config_json = json_dumps(o, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(o);
    if (hq && quant_json) *quant_json = json_dumps(hq, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    if (hq) json_decref(hq);
    if (!*config_json || (hq && quant_json && !*quant_json)) {
        free(*config_json);
        *config_json = NULL;
        if (quant_json) { free(*quant_json); *quant_json = NULL; }
        return fm_error(FM_E_NOMEM, "out of memory writing config.json");
    }
    return FM_OK;
}
