/*
 * `fp4moe inspect`: what a checkpoint directory holds and everything wrong
 * with it. Every present MoE layer goes through the same checks as binding
 * (fm_io_layer_bind in collecting mode), so inspect and bind never disagree.
 */
#include "io/io_internal.h"
#include "util/util.h"

#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LISTED_PROBLEMS 200

typedef struct {
    json_t *problems; /* array of strings */
    int n;
    int layer;        /* prefix for messages of a layer, -1 none */
} collector;

static void add_problem(collector *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void add_problem(collector *c, const char *fmt, ...) {
    char msg[1200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (c->n++ < MAX_LISTED_PROBLEMS) json_array_append_new(c->problems, json_string(msg));
}

static void on_problem(void *ud, const char *msg) {
    collector *c = ud;
    add_problem(c, "layer %d: %s", c->layer, msg);
}

/* Layer index of a tensor name ("model.layers.N." or "layers.N."), or -1. */
static long layer_of(const char *name) {
    const char *p = strstr(name, "layers.");
    if (!p || (p != name && p[-1] != '.')) return -1;
    p += 7;
    if (*p < '0' || *p > '9') return -1;
    char *end;
    long v = strtol(p, &end, 10);
    if (*end != '.' || v > 1000000) return -1;
    return v;
}

/* "412.3 KB", "6.34 GB": decimal units, as bandwidth figures use. */
static const char *human(char *buf, size_t cap, double b) {
    const char *u[] = {"B", "KB", "MB", "GB", "TB"};
    int i = 0;
    while (b >= 1000 && i < 4) { b /= 1000; i++; }
    snprintf(buf, cap, i ? "%.2f %s" : "%.0f %s", b, u[i]);
    return buf;
}

static const char *route_name(const fm_model_desc *d) {
    switch (d->route) {
    case FM_ROUTE_NOAUX_TC: return "noaux_tc (sigmoid, bias-corrected grouped top-k)";
    case FM_ROUTE_SOFTMAX: return "softmax top-k";
    case FM_ROUTE_GPTOSS: return "gpt-oss (top-k on biased logits, softmax over k)";
    case FM_ROUTE_DSV4: return "deepseek-v4 (sqrt-softplus, bias-corrected top-k, hash layers)";
    }
    return "?";
}

static void json_set_desc(json_t *o, const fm_model_desc *d) {
    json_object_set_new(o, "family", json_string(d->family));
    json_object_set_new(o, "model_type", json_string(d->model_type));
    json_object_set_new(o, "layout", json_string(d->layout));
    json_object_set_new(o, "expert_format", json_string(fm_io_qformat_str(d->expert_format)));
    json_object_set_new(o, "group_size", json_integer(d->group_size));
    json_object_set_new(o, "hidden", json_integer(d->hidden));
    json_object_set_new(o, "moe_inter", json_integer(d->moe_inter));
    json_object_set_new(o, "n_experts", json_integer(d->n_experts));
    json_object_set_new(o, "topk", json_integer(d->topk));
    json_object_set_new(o, "n_shared", json_integer(d->n_shared));
    json_object_set_new(o, "shared_inter", json_integer(d->shared_inter));
    json_object_set_new(o, "n_layers", json_integer(d->n_layers));
    json_object_set_new(o, "first_dense", json_integer(d->first_dense));
    json_object_set_new(o, "moe_layer_freq", json_integer(d->moe_layer_freq));
    json_t *r = json_object();
    json_object_set_new(r, "kind", json_string(route_name(d)));
    json_object_set_new(r, "n_group", json_integer(d->n_group));
    json_object_set_new(r, "topk_group", json_integer(d->topk_group));
    json_object_set_new(r, "norm_topk_prob", json_boolean(d->norm_topk_prob));
    json_object_set_new(r, "routed_scaling_factor", json_real(d->routed_scaling_factor));
    json_object_set_new(r, "n_hash_layers", json_integer(d->n_hash_layers));
    json_object_set_new(o, "routing", r);
    json_t *a = json_object();
    json_object_set_new(a, "kind", json_string(d->act == FM_ACT_GPTOSS ? "gptoss" : "silu"));
    json_object_set_new(a, "swiglu_alpha", json_real(d->swiglu_alpha));
    json_object_set_new(a, "swiglu_limit", json_real(d->swiglu_limit));
    json_object_set_new(o, "activation", a);
}

fm_status fm_inspect(const char *dir, int as_json, FILE *out, int *n_problems) {
    if (!dir || !out) return fm_error(FM_E_ARG, "fm_inspect: NULL argument");
    json_t *root = json_object();
    collector col = {json_array(), 0, -1};
    json_object_set_new(root, "dir", json_string(dir));
    fm_model_desc d;
    int have_desc = fm_model_desc_load(dir, &d) == FM_OK;
    if (!have_desc) add_problem(&col, "config: %s", fm_last_error());
    fm_ckpt *c = NULL;
    if (fm_ckpt_open(dir, &c) != FM_OK) {
        add_problem(&col, "checkpoint: %s", fm_last_error());
        c = NULL;
    }
    json_t *layers_present = json_array(), *dense_present = json_array();
    int64_t routed_present = 0, shared_present = 0;
    json_t *sample = NULL;
    if (c) {
        size_t nt = fm_ckpt_count(c);
        json_object_set_new(root, "n_tensors", json_integer((json_int_t)nt));
        int maxl = have_desc ? d.n_layers : 0;
        unsigned char *seen = calloc((size_t)maxl + 1, 1);
        for (size_t i = 0; i < nt && seen; i++) {
            const char *nm = fm_ckpt_name_at(c, i);
            long L = nm ? layer_of(nm) : -1;
            if (L < 0 || !have_desc) continue;
            if (L >= maxl) {
                if (seen[maxl] == 0) add_problem(&col, "tensor '%s' belongs to layer %ld, beyond num_hidden_layers %d", nm, L, maxl);
                seen[maxl] = 1;
                continue;
            }
            seen[L] = 1;
        }
        for (int L = 0; L < maxl && seen; L++) {
            if (!seen[L]) continue;
            if (!fm_model_is_moe_layer(&d, L)) { json_array_append_new(dense_present, json_integer(L)); continue; }
            json_array_append_new(layers_present, json_integer(L));
            col.layer = L;
            fm_moe_layer *l = NULL;
            int before = col.n;
            if (fm_io_layer_bind(c, &d, L, FM_QF_NONE, on_problem, &col, &l) != FM_OK) {
                if (col.n == before) add_problem(&col, "layer %d: %s", L, fm_last_error());
                continue;
            }
            routed_present += fm_moe_layer_expert_bytes(l);
            if (l->has_shared)
                shared_present += fm_qmatrix_bytes(&l->sh_gate) + fm_qmatrix_bytes(&l->sh_up) + fm_qmatrix_bytes(&l->sh_down);
            /* Dequantized values: finite, and a sample for cross-checks. */
            int64_t K = l->gate[0].cols;
            float *row = malloc(sizeof(float) * (size_t)K);
            for (int e = 0; row && e < l->n_experts; e++) {
                const fm_qmatrix *ms[3] = {&l->gate[e], &l->up[e], &l->down[e]};
                for (int m = 0; m < 3; m++) {
                    float *r2 = ms[m]->cols == K ? row : malloc(sizeof(float) * (size_t)ms[m]->cols);
                    if (!r2) continue;
                    fm_qmatrix_dequant_row(ms[m], 0, r2);
                    for (int64_t j = 0; j < ms[m]->cols; j++)
                        if (!isfinite(r2[j])) {
                            add_problem(&col, "layer %d: expert %d matrix %d row 0 column %lld dequantizes to %g", L, e, m, (long long)j, (double)r2[j]);
                            break;
                        }
                    if (r2 != row) free(r2);
                }
            }
            if (row && !sample) {
                sample = json_object();
                json_object_set_new(sample, "layer", json_integer(L));
                json_object_set_new(sample, "expert", json_integer(0));
                json_object_set_new(sample, "matrix", json_string("gate"));
                json_object_set_new(sample, "row", json_integer(1));
                fm_qmatrix_dequant_row(&l->gate[0], 1 < l->gate[0].rows ? 1 : 0, row);
                json_t *v = json_array();
                for (int64_t j = 0; j < K && j < 64; j++) json_array_append_new(v, json_real(row[j]));
                json_object_set_new(sample, "values", v);
            }
            free(row);
            fm_moe_layer_free(l);
        }
        free(seen);
        col.layer = -1;
        if (have_desc && json_array_size(layers_present) == 0) add_problem(&col, "no MoE layer has tensors in this checkpoint");
    }
    int n_moe = 0;
    if (have_desc) {
        for (int L = 0; L < d.n_layers; L++) n_moe += fm_model_is_moe_layer(&d, L);
        json_set_desc(root, &d);
        json_object_set_new(root, "n_moe_layers", json_integer(n_moe));
        json_t *b = json_object();
        int64_t pe = fm_model_expert_bytes(&d, d.expert_format);
        json_object_set_new(b, "per_expert", json_integer(pe));
        json_object_set_new(b, "routed_per_layer", json_integer(pe * d.n_experts));
        json_object_set_new(b, "routed_present", json_integer(routed_present));
        json_object_set_new(b, "shared_present", json_integer(shared_present));
        json_object_set_new(b, "routed_all_moe_layers", json_integer(pe * d.n_experts * n_moe));
        json_object_set_new(root, "bytes", b);
    }
    json_object_set_new(root, "moe_layers_present", layers_present);
    json_object_set_new(root, "dense_layers_present", dense_present);
    if (sample) json_object_set_new(root, "sample", sample);
    json_object_set_new(root, "n_problems", json_integer(col.n));
    json_object_set_new(root, "problems", col.problems);

    if (as_json) {
        char *s = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(9));
        if (s) fprintf(out, "%s\n", s);
        free(s);
    } else {
        fprintf(out, "checkpoint   %s\n", dir);
        if (have_desc) {
            fprintf(out, "family       %s (model_type %s), layout %s, experts %s", d.family, d.model_type, d.layout,
                    fm_io_qformat_str(d.expert_format));
            if (d.group_size) fprintf(out, " (block %d)", d.group_size);
            fprintf(out, "\nshape        hidden %d, expert inter %d, %d routed experts, top-%d", d.hidden, d.moe_inter, d.n_experts, d.topk);
            if (d.n_shared) fprintf(out, ", %d shared (inter %d)", d.n_shared, d.shared_inter);
            fprintf(out, "\nrouting      %s; n_group %d, topk_group %d, renormalize %s, scaling %g", route_name(&d), d.n_group,
                    d.topk_group, d.norm_topk_prob ? "yes" : "no", (double)d.routed_scaling_factor);
            if (d.n_hash_layers) fprintf(out, ", hash layers 0..%d", d.n_hash_layers - 1);
            fprintf(out, "\nactivation   %s", d.act == FM_ACT_GPTOSS ? "gpt-oss clamped swiglu" : "silu(gate)*up");
            if (d.swiglu_limit > 0) fprintf(out, ", limit %g", (double)d.swiglu_limit);
            if (d.act == FM_ACT_GPTOSS) fprintf(out, ", alpha %g", (double)d.swiglu_alpha);
            fprintf(out, "\nlayers       %d (%d MoE, first %d dense)\n", d.n_layers, n_moe, d.first_dense);
            int64_t pe = fm_model_expert_bytes(&d, d.expert_format);
            char b1[32], b2[32], b3[32];
            fprintf(out, "bytes        %s per expert, %s routed per MoE layer, %s routed in all %d MoE layers\n",
                    human(b1, sizeof b1, (double)pe), human(b2, sizeof b2, (double)pe * d.n_experts),
                    human(b3, sizeof b3, (double)pe * d.n_experts * n_moe), n_moe);
        }
        fprintf(out, "present      MoE layers [");
        for (size_t i = 0; i < json_array_size(layers_present); i++)
            fprintf(out, "%s%lld", i ? ", " : "", (long long)json_integer_value(json_array_get(layers_present, i)));
        fprintf(out, "]");
        if (json_array_size(dense_present)) fprintf(out, ", %zu dense layer(s)", json_array_size(dense_present));
        char b4[32], b5[32];
        fprintf(out, "; routed %s, shared %s\n", human(b4, sizeof b4, (double)routed_present),
                human(b5, sizeof b5, (double)shared_present));
        fprintf(out, "problems     %d\n", col.n);
        for (size_t i = 0; i < json_array_size(col.problems); i++)
            fprintf(out, "  - %s\n", json_string_value(json_array_get(col.problems, i)));
        if (col.n > MAX_LISTED_PROBLEMS) fprintf(out, "  ... %d more\n", col.n - MAX_LISTED_PROBLEMS);
    }
    if (n_problems) *n_problems = col.n;
    json_decref(root);
    if (c) fm_ckpt_close(c);
    return FM_OK;
}
