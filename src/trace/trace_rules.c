/*
 * Kernel name -> category: an ordered rule table (first match wins).
 *
 * Patterns are POSIX extended regexes matched case-insensitively against
 * the raw name. They name identifiers only (no "::", no anchors except for
 * Kineto's "Memcpy"/"Memset" activity names), so a mangled name such as
 * _ZN5flash...flash_fwd_splitkv_mla_kernel... matches the same rule as its
 * demangled form: the identifiers appear verbatim in the mangling.
 *
 * Order matters: specific MoE and attention kernels come before the broad
 * GEMM rules ("cutlass", "gemm"), which would otherwise swallow
 * FlashAttention-3 (a CUTLASS kernel) or a grouped MoE GEMM.
 */
#include "trace/trace_internal.h"

#include <jansson.h>
#include <pthread.h>
#include <string.h>

static const char *const k_cat_names[FM_CAT_BUILTIN_COUNT] = {
    "attention", "moe_gemm", "comm", "moe_quant", "moe_routing", "moe_act", "gemm", "memory", "glue", "other",
};

static const struct {
    int cat;
    const char *re;
} k_rules[] = {
    /* Kineto names memory activities "Memcpy DtoD (Device -> Device)", "Memset (Device)" */
    {FM_CAT_MEMORY, "^(Memcpy|Memset)|fillBuffer|copyBuffer|__amd_rocclr"},
    /* communication: NCCL/RCCL, custom all-reduce (vLLM/SGLang/TRT-LLM/FlashInfer), DeepEP */
    {FM_CAT_COMM, "nccl|rccl|msccl|cross_device_reduce|all_?reduce|allgather|all_gather|reduce_?scatter|"
                  "all_?to_?all|one_?shot_?(all|ar)|two_?shot_?(all|ar)|custom_?ar|lamport|deep_?ep|"
                  "mnnvl|twoshot|oneshot"},
    /* MoE routing, sorting, permutation and the k-way sum; fp4moe's own router
     * (logits, top-k, grouping); PyTorch's top-k, sort and histogram kernels,
     * which in a decode step sort tokens by expert (transformers' grouped_mm
     * experts) and pick the routers' top-k */
    {FM_CAT_MOE_ROUTING, "fm_route|fm_preroute|fm_prep_kernel|fm_logits|gathertopk|radixfindkthvalues|computeblockwise|"
                         "bitonicsort|radixsort|mergesort|sortkeyvalue|segmentedsort|kernelhistogram|"
                         "topk_?gating|moe_fused_gate|grouped_topk|biased_grouped|moe_align|count_and_sort|"
                         "moe_sum|noaux_?tc|routing_?(main|indices|deepseek|renormalize|kernel)|routingmain|"
                         "expand_?input_?rows|finalize_?moe|moe_?(un)?permute|compute_problem_sizes|"
                         "compute_expert_offsets|compute_arg_sorts|ep_scatter|ep_gather|shuffle_rows|"
                         "prepare_moe|moe_token_sort|topk_?softmax|sort_expert|expert_?map|moe_?route|computestrides"},
    /* activation quantization feeding the FP8/FP4 MoE GEMMs */
    {FM_CAT_MOE_QUANT, "per_token_group_quant|per_token_quant|per_tensor_quant|scaled_fp[48]_quant|"
                       "cvt_fp16_to_fp4|cvt_.*fp4|fp4_quant|fp8_quant|quant_fp8|mxfp[48]_quant|"
                       "quantize_?(fp4|fp8|mx|nvfp4)|nvfp4_quant|dynamic_.*quant|silu_and_mul_.*quant"},
    /* the gated activation between the two expert GEMMs */
    {FM_CAT_MOE_ACT, "act_and_mul|silu_and_mul|gelu_and_mul|silu_mul|swiglu|gelu_tanh_and_mul|doactivation|"
                     "activation_kernel"},
    /* MoE expert GEMMs: fp4moe's expert kernels (routed and shared, the splitk path's and its one-token
     * launch's too), PyTorch's
     * grouped_mm (CUTLASS GroupProblemShape, prepare_grouped_gemm_data, the
     * cuBLAS grouped arguments) */
    {FM_CAT_MOE_GEMM, "fm_expert|fm_shared_expert|fm_splitk|fm_fused1|cublas_grouped|"
                      "fused_moe|moe_gemm|moegemm|moe_mm|moe_wna16|marlin|groupproblemshape|grouped_?gemm|"
                      "gemmgrouped|group_?mm|bmm_e2m1|bmm_e4m3|bmm_mxe|_moe_|cutlass_moe|trtllm.*moe|"
                      "moe.*gemm|deep_?gemm.*(group|masked|contiguous)|m_grouped"},
    /* norms and rotary embeddings, before attention: FlashInfer names all its
     * kernels flashinfer::... (norm, rope, sampling as well as attention) */
    {FM_CAT_GLUE, "rmsnorm|rms_norm|layernorm|layer_norm|rotary|rope_|_rope|ropekernel"},
    /* attention (before the generic CUTLASS / GEMM rules); "flash" but not "flashinfer" */
    {FM_CAT_ATTENTION, "flash([^i]|$)|fmha|mla_decode|mla_kernel|flashmla|batchmla|batchdecode|batchprefill|"
                       "singledecode|singleprefill|paged_?attention|attention|attn|_fwd_kernel|decode_att|"
                       "fwd_grouped_kernel|merge_?state|mqa_logits|xqa|kernel_mha|mha_|reshape_and_cache|"
                       "kv_?cache|kv_indices|set_kv_buffer|store_kv|sparse_mla|lightning_indexer|indexer|"
                       /* cuDNN's SDPA kernels; transformers' StaticCache writes K/V with index_copy_ */
                       "sdpa|index_copy"},
    /* dense GEMM: cuBLAS (nvjet, xmma, sm80_/sm90_ ...), CUTLASS, DeepGEMM, rocBLAS/Tensile, Triton */
    {FM_CAT_GEMM, "gemm|nvjet|cublas|cutlass|xmma|s16816|s1688|h16816|h1688|i8816|splitkreduce|"
                  "cijk_|gemv|matmul|_mm_kernel|bmm|dot_kernel|wgmma|hgmma|sgemm|hgemm|deep_?gemm"},
    /* elementwise glue, norms, rotary, copies, reductions, sampling, inductor kernels */
    {FM_CAT_GLUE, "elementwise|rmsnorm|rms_norm|layernorm|layer_norm|norm_kernel|rotary|rope|catarray|"
                  "copy|fill|reduce_kernel|reduce|softmax|index|gather|scatter|triton_(poi|red|per)|"
                  "embedding|arange|cumsum|radixsort|sort|scan|argmax|topk|sampling|cast|convert|"
                  "transpose|permute|nchwtonhwc|nhwctonchw|bn_|batch_norm|where|masked|clamp|"
                  "add|mul|div|exp|neg|pow|sigmoid|tanh|relu|gelu|silu|unrolled|vectorized|"
                  "distribution|random|philox|compute_|prepare_"},
};

/* The built-in table is compiled once per process (regcomp of these
 * alternations costs far more than parsing a small trace); regexec on a
 * compiled pattern is thread-safe. */
static regex_t g_builtin[sizeof k_rules / sizeof k_rules[0]];
static int g_builtin_rc[sizeof k_rules / sizeof k_rules[0]];
static pthread_once_t g_builtin_once = PTHREAD_ONCE_INIT;

static void compile_builtin(void) {
    for (size_t i = 0; i < sizeof k_rules / sizeof k_rules[0]; i++)
        g_builtin_rc[i] = regcomp(&g_builtin[i], k_rules[i].re, REG_EXTENDED | REG_ICASE | REG_NOSUB);
}

const char *fm_tr_builtin_cat_name(int cat) {
    return cat >= 0 && cat < FM_CAT_BUILTIN_COUNT ? k_cat_names[cat] : "other";
}

void fm_tr_rules_free(fm_tr_rules *r) {
    if (!r) return;
    for (size_t i = 0; i < r->n; i++) {
        regfree(&r->rules[i].re);
        free(r->rules[i].pattern);
    }
    free(r->rules);
    for (size_t i = 0; i < r->ncats; i++) free(r->cats[i]);
    free(r->cats);
    free(r);
}

static int cat_index(fm_tr_rules *r, const char *name, int add) {
    for (size_t i = 0; i < r->ncats; i++)
        if (strcmp(r->cats[i], name) == 0) return (int)i;
    if (!add) return -1;
    char **nc = realloc(r->cats, (r->ncats + 1) * sizeof *nc);
    if (!nc) return -1;
    r->cats = nc;
    r->cats[r->ncats] = fm_strdup(name);
    if (!r->cats[r->ncats]) return -1;
    return (int)r->ncats++;
}

static fm_status add_rule(fm_tr_rules *r, const char *pattern, int cat, int user, const char *where) {
    fm_tr_rule *nr = realloc(r->rules, (r->n + 1) * sizeof *nr);
    if (!nr) return fm_error(FM_E_NOMEM, "out of memory");
    r->rules = nr;
    fm_tr_rule *x = &r->rules[r->n];
    memset(x, 0, sizeof *x);
    int rc = regcomp(&x->re, pattern, REG_EXTENDED | REG_ICASE | REG_NOSUB);
    if (rc != 0) {
        char msg[256];
        regerror(rc, &x->re, msg, sizeof msg);
        return fm_error(FM_E_FORMAT, "%s: invalid regex '%s': %s", where, pattern, msg);
    }
    x->pattern = fm_strdup(pattern);
    if (!x->pattern) {
        regfree(&x->re);
        return FM_E_NOMEM;
    }
    x->cat = cat;
    x->user = user;
    r->n++;
    return FM_OK;
}

/* Categories of a user rules file: a JSON array of {"regex", "category"}
 * objects, tried in order before the built-in table. */
fm_status fm_tr_rules_load(const char *path, fm_tr_rules **out) {
    *out = NULL;
    fm_tr_rules *r = fm_calloc(1, sizeof *r);
    if (!r) return FM_E_NOMEM;
    for (int i = 0; i < FM_CAT_BUILTIN_COUNT; i++)
        if (cat_index(r, k_cat_names[i], 1) != i) {
            fm_tr_rules_free(r);
            return fm_error(FM_E_NOMEM, "out of memory");
        }
    fm_status s = FM_OK;
    if (path) {
        json_error_t je;
        json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
        if (!root) {
            s = fm_error(FM_E_FORMAT, "%s: line %d, byte %d: %s", path, je.line, je.position, je.text);
            goto done;
        }
        if (!json_is_array(root)) {
            json_decref(root);
            s = fm_error(FM_E_FORMAT, "%s: a rules file is a JSON array of {\"regex\": ..., \"category\": ...} objects",
                         path);
            goto done;
        }
        size_t i;
        json_t *it;
        json_array_foreach(root, i, it) {
            char where[4200];
            snprintf(where, sizeof where, "%s: rule %zu", path, i);
            json_t *re = json_object_get(it, "regex"), *cat = json_object_get(it, "category");
            if (!json_is_object(it) || !json_is_string(re) || !json_is_string(cat)) {
                s = fm_error(FM_E_FORMAT, "%s: needs string \"regex\" and \"category\" members", where);
                break;
            }
            const char *k;
            json_t *v;
            json_object_foreach(it, k, v) {
                if (strcmp(k, "regex") && strcmp(k, "category")) {
                    s = fm_error(FM_E_FORMAT, "%s: unknown key \"%s\" (expected \"regex\" and \"category\")", where, k);
                    break;
                }
            }
            if (s != FM_OK) break;
            const char *cn = json_string_value(cat);
            size_t cl = strlen(cn);
            int ok = cl > 0 && cl <= 48;
            for (size_t j = 0; ok && j < cl; j++) {
                unsigned char ch = (unsigned char)cn[j];
                ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' ||
                     ch == '-' || ch == '.';
            }
            if (!ok) {
                s = fm_error(FM_E_FORMAT, "%s: category '%s' must be 1-48 characters of [A-Za-z0-9_.-]", where, cn);
                break;
            }
            if (strcmp(cn, "total") == 0) {
                s = fm_error(FM_E_FORMAT, "%s: 'total' is reserved and cannot be a category", where);
                break;
            }
            int ci = cat_index(r, cn, 1);
            if (ci < 0) {
                s = fm_error(FM_E_NOMEM, "out of memory");
                break;
            }
            if (ci >= 256) {
                s = fm_error(FM_E_RANGE, "%s: more than 256 categories", where);
                break;
            }
            s = add_rule(r, json_string_value(re), ci, 1, where);
            if (s != FM_OK) break;
        }
        json_decref(root);
        if (s != FM_OK) goto done;
    }
    pthread_once(&g_builtin_once, compile_builtin);
    for (size_t i = 0; i < sizeof k_rules / sizeof k_rules[0]; i++)
        if (g_builtin_rc[i] != 0) {
            s = fm_error(FM_E_UNSUPPORTED, "built-in rule %zu does not compile with this libc's regcomp", i);
            goto done;
        }
done:
    if (s != FM_OK) {
        fm_tr_rules_free(r);
        return s;
    }
    *out = r;
    return FM_OK;
}

int fm_tr_rules_match(const fm_tr_rules *r, const char *name, int is_mem) {
    for (size_t i = 0; i < r->n; i++)
        if (regexec(&r->rules[i].re, name, 0, NULL, 0) == 0) return r->rules[i].cat;
    /* a Kineto memcpy/memset activity is memory unless a user rule says otherwise */
    if (is_mem) return FM_CAT_MEMORY;
    for (size_t i = 0; i < sizeof k_rules / sizeof k_rules[0]; i++)
        if (regexec(&g_builtin[i], name, 0, NULL, 0) == 0) return k_rules[i].cat;
    return FM_CAT_OTHER;
}
