/*
 * Built-in model descriptions: the real models' MoE shapes (REFERENCE.md,
 * checked against their config.json files) and tiny ones, one per routing
 * family, small enough for tests.
 */
#include "io/io_internal.h"
#include "util/util.h"

#include <stdio.h>
#include <string.h>

typedef struct {
    const char *name;
    const char *model_type;
    const char *family;
    int hidden, inter, experts, topk, shared, layers, first_dense, n_group, topk_group, norm;
    float scaling;
    fm_route_kind route;
    int hash_layers, vocab;
    float swiglu_limit;
    fm_qformat native; /* format when the caller asks for none */
} preset;

static const preset k_presets[] = {
    /* name                 model_type     family         H     I      E    k  sh  L  dense grp tkg norm scale */
    {"deepseek-v3", "deepseek_v3", "deepseek_v3", 7168, 2048, 256, 8, 1, 61, 3, 8, 4, 1, 2.5f, FM_ROUTE_NOAUX_TC, 0, 129280, 0, FM_QF_NVFP4},
    {"kimi-k2", "kimi_k2", "kimi_k2", 7168, 2048, 384, 8, 1, 61, 1, 1, 1, 1, 2.827f, FM_ROUTE_NOAUX_TC, 0, 163840, 0, FM_QF_NVFP4},
    {"glm-5", "glm_moe_dsa", "glm5", 6144, 2048, 256, 8, 1, 78, 3, 1, 1, 1, 2.5f, FM_ROUTE_NOAUX_TC, 0, 154880, 0, FM_QF_NVFP4},
    {"glm-4.5", "glm4_moe", "glm4_moe", 5120, 1536, 160, 8, 1, 92, 3, 1, 1, 1, 2.5f, FM_ROUTE_NOAUX_TC, 0, 151552, 0, FM_QF_NVFP4},
    {"deepseek-v4-flash", "deepseek_v4", "deepseek_v4", 4096, 2048, 256, 6, 1, 43, 0, 1, 1, 1, 1.5f, FM_ROUTE_DSV4, 3, 129280, 10.0f, FM_QF_NVFP4},
    {"qwen3-30b-a3b", "qwen3_moe", "qwen3_moe", 2048, 768, 128, 8, 0, 48, 0, 1, 1, 1, 1.0f, FM_ROUTE_SOFTMAX, 0, 151936, 0, FM_QF_NVFP4},
    {"qwen3-235b-a22b", "qwen3_moe", "qwen3_moe", 4096, 1536, 128, 8, 0, 94, 0, 1, 1, 1, 1.0f, FM_ROUTE_SOFTMAX, 0, 151936, 0, FM_QF_NVFP4},
    {"gpt-oss-120b", "gpt_oss", "gpt_oss", 2880, 2880, 128, 4, 0, 36, 0, 1, 1, 1, 1.0f, FM_ROUTE_GPTOSS, 0, 201088, 7.0f, FM_QF_MXFP4},
    {"mixtral-8x7b", "mixtral", "mixtral", 4096, 14336, 8, 2, 0, 32, 0, 1, 1, 1, 1.0f, FM_ROUTE_SOFTMAX, 0, 32000, 0, FM_QF_NVFP4},
    /* tiny ones: every routing family, dense prefixes, groups, hash layers */
    {"tiny-deepseek", "deepseek_v3", "deepseek_v3", 128, 64, 16, 4, 1, 4, 1, 4, 2, 1, 2.5f, FM_ROUTE_NOAUX_TC, 0, 1024, 0, FM_QF_NVFP4},
    {"tiny-deepseek-v4", "deepseek_v4", "deepseek_v4", 128, 64, 16, 4, 1, 4, 0, 1, 1, 1, 1.5f, FM_ROUTE_DSV4, 2, 512, 10.0f, FM_QF_MXFP4},
    {"tiny-qwen3", "qwen3_moe", "qwen3_moe", 128, 64, 16, 4, 0, 2, 0, 1, 1, 1, 1.0f, FM_ROUTE_SOFTMAX, 0, 1024, 0, FM_QF_NVFP4},
    {"tiny-mixtral", "mixtral", "mixtral", 128, 96, 8, 2, 0, 2, 0, 1, 1, 1, 1.0f, FM_ROUTE_SOFTMAX, 0, 1024, 0, FM_QF_NVFP4},
    {"tiny-gptoss", "gpt_oss", "gpt_oss", 128, 64, 8, 2, 0, 2, 0, 1, 1, 1, 1.0f, FM_ROUTE_GPTOSS, 0, 1024, 7.0f, FM_QF_MXFP4},
};

size_t fm_preset_count(void) { return sizeof k_presets / sizeof k_presets[0]; }

const char *fm_preset_name(size_t i) { return i < fm_preset_count() ? k_presets[i].name : NULL; }

fm_status fm_preset_desc(const char *name, fm_qformat fmt, fm_model_desc *out) {
    if (!name || !out) return fm_error(FM_E_ARG, "fm_preset_desc: NULL argument");
    const preset *p = NULL;
    for (size_t i = 0; i < fm_preset_count(); i++)
        if (!strcmp(k_presets[i].name, name)) p = &k_presets[i];
    if (!p) {
        char list[1024] = "";
        size_t n = 0;
        for (size_t i = 0; i < fm_preset_count() && n < sizeof list; i++)
            n += (size_t)snprintf(list + n, sizeof list - n, "%s%s", i ? ", " : "", k_presets[i].name);
        return fm_error(FM_E_NOTFOUND, "unknown preset \"%s\" (known: %s)", name, list);
    }
    if (fmt == FM_QF_NONE) fmt = p->native;
    if (fmt != FM_QF_NVFP4 && fmt != FM_QF_MXFP4 && fmt != FM_QF_BF16)
        return fm_error(FM_E_ARG, "preset %s: format %d is not nvfp4, mxfp4 or bf16", name, (int)fmt);
    fm_model_desc d;
    memset(&d, 0, sizeof d);
    snprintf(d.family, sizeof d.family, "%s", p->family);
    snprintf(d.model_type, sizeof d.model_type, "%s", p->model_type);
    d.hidden = p->hidden;
    d.moe_inter = p->inter;
    d.n_experts = p->experts;
    d.topk = p->topk;
    d.n_shared = p->shared;
    d.shared_inter = p->inter * p->shared;
    d.n_layers = p->layers;
    d.first_dense = p->first_dense;
    d.moe_layer_freq = 1;
    d.n_group = p->n_group;
    d.topk_group = p->topk_group;
    d.norm_topk_prob = p->norm;
    d.routed_scaling_factor = p->scaling;
    d.route = p->route;
    d.act = p->route == FM_ROUTE_GPTOSS ? FM_ACT_GPTOSS : FM_ACT_SILU;
    d.swiglu_alpha = p->route == FM_ROUTE_GPTOSS ? 1.702f : 0.0f;
    d.swiglu_limit = p->swiglu_limit;
    d.n_hash_layers = p->hash_layers;
    d.vocab_size = p->vocab;
    d.expert_format = fmt;
    d.group_size = fmt == FM_QF_NVFP4 ? 16 : fmt == FM_QF_MXFP4 ? 32 : 0;
    const char *lay = "modelopt";
    if (fmt == FM_QF_BF16) lay = "bf16";
    else if (fmt == FM_QF_MXFP4 && !strcmp(p->family, "gpt_oss")) lay = "gptoss";
    else if (fmt == FM_QF_MXFP4 && !strcmp(p->family, "deepseek_v4")) lay = "dsv4";
    snprintf(d.layout, sizeof d.layout, "%s", lay);
    fm_status s = fm_model_desc_validate(&d);
    if (s != FM_OK) return s;
    *out = d;
    return FM_OK;
}
