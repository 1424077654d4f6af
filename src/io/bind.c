/*
 * Checkpoint layouts of one MoE layer and binding them to an fm_moe_layer.
 *
 * Layouts (d->layout):
 *   modelopt  per expert, HF names: model.layers.L.mlp.experts.e.{gate,up,down}_proj
 *             (Mixtral: block_sparse_moe.experts.e.{w1,w3,w2}); NVFP4: .weight U8
 *             [out, in/2], .weight_scale F8_E4M3 [out, in/16], .weight_scale_2 F32 [],
 *             .input_scale F32 [] (optional); MXFP4: .weight U8 [out, in/2],
 *             .weight_scale F8_E8M0 [out, in/32]. Shared experts: mlp.shared_experts.*.
 *   bf16      the same names, .weight BF16 [out, in].
 *   gptoss    fused per layer: mlp.experts.gate_up_proj_blocks U8 [E, 2I, H/32, 16],
 *             gate_up_proj_scales U8 [E, 2I, H/32], gate_up_proj_bias BF16 [E, 2I]
 *             (rows interleaved: even = gate, odd = up), down_proj_{blocks,scales,bias}.
 *   dsv4      DeepSeek-V4 names: layers.L.ffn.experts.e.{w1,w3,w2}.weight I8
 *             [out, in/2] + .scale F8_E8M0 [out, in/32]; shared_experts the same
 *             (DeepSeek's own files store the shared expert in FP8; gen writes it
 *             in MXFP4 like the routed ones).
 * Routers: mlp.gate.weight BF16 [E, H] (+ e_score_correction_bias F32 [E] for
 * noaux_tc; DeepSeek-V4 scored layers: gate.bias, hash layers: gate.tid2eid
 * I64 [vocab, k]); gpt-oss: mlp.router.weight BF16 [E, H] + mlp.router.bias
 * BF16 [E]; per-expert gpt-oss checkpoints add .bias BF16 [out] per matrix.
 *
 * Binding is zero-copy for the expert matrices (the fused gpt-oss tensors
 * through row strides); routers, biases and tables are converted to F32 /
 * int32 copies owned by the layer.
 */
#include "io/io_internal.h"
#include "util/util.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* ------------------------------------------------------------------ plan */

typedef struct {
    fm_io_tspec *v;
    size_t n, cap;
    fm_status err;
} plan_buf;

static fm_io_tspec *add(plan_buf *p, fm_io_trole role, int e, int m, int64_t R, int64_t K, fm_dtype dt, int ndim,
                      const int64_t *shape, const char *fmt, ...) __attribute__((format(printf, 10, 11)));
static fm_io_tspec *add(plan_buf *p, fm_io_trole role, int e, int m, int64_t R, int64_t K, fm_dtype dt, int ndim,
                      const int64_t *shape, const char *fmt, ...) {
    if (p->err != FM_OK) return NULL;
    if (p->n == p->cap) {
        size_t nc = p->cap ? p->cap * 2 : 256;
        fm_io_tspec *nv = realloc(p->v, nc * sizeof *nv);
        if (!nv) { p->err = fm_error(FM_E_NOMEM, "out of memory planning tensors"); return NULL; }
        p->v = nv;
        p->cap = nc;
    }
    fm_io_tspec *t = &p->v[p->n++];
    memset(t, 0, sizeof *t);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->name, sizeof t->name, fmt, ap);
    va_end(ap);
    t->role = role;
    t->e = e;
    t->m = m;
    t->R = R;
    t->K = K;
    t->dt = dt;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
    return t;
}

static void plan_matrix(plan_buf *p, const fm_model_desc *d, const char *base, int e, int m, int64_t R, int64_t K) {
    fm_qformat f = d->expert_format;
    int dsv4 = !strcmp(d->layout, "dsv4");
    if (f == FM_QF_BF16) {
        int64_t s[2] = {R, K};
        add(p, FM_T_PACKED, e, m, R, K, FM_DT_BF16, 2, s, "%s.weight", base);
    } else {
        int64_t s[2] = {R, K / 2};
        add(p, FM_T_PACKED, e, m, R, K, dsv4 ? FM_DT_I8 : FM_DT_U8, 2, s, "%s.weight", base);
        int blk = f == FM_QF_NVFP4 ? 16 : 32;
        int64_t ss[2] = {R, K / blk};
        add(p, FM_T_SCALES, e, m, R, K, f == FM_QF_NVFP4 ? FM_DT_F8_E4M3 : FM_DT_F8_E8M0, 2, ss, "%s.%s", base,
            dsv4 ? "scale" : "weight_scale");
        if (f == FM_QF_NVFP4) {
            add(p, FM_T_SCALE2, e, m, R, K, FM_DT_F32, 0, NULL, "%s.weight_scale_2", base);
            fm_io_tspec *t = add(p, FM_T_INSCALE, e, m, R, K, FM_DT_F32, 0, NULL, "%s.input_scale", base);
            if (t) t->optional = 1;
        }
    }
    if (fm_io_has_expert_bias(d) && e >= 0) {
        int64_t s[1] = {R};
        add(p, FM_T_EBIAS, e, m, R, K, FM_DT_BF16, 1, s, "%s.bias", base);
    }
}

fm_status fm_io_layer_plan(const fm_model_desc *d, int layer, fm_io_tspec **out, size_t *n) {
    *out = NULL;
    *n = 0;
    plan_buf p = {0};
    int64_t H = d->hidden, I = d->moe_inter, E = d->n_experts, S = d->shared_inter;
    char pre[96];
    if (!strcmp(d->layout, "dsv4")) snprintf(pre, sizeof pre, "layers.%d.ffn", layer);
    else if (!strcmp(d->family, "mixtral")) snprintf(pre, sizeof pre, "model.layers.%d.block_sparse_moe", layer);
    else snprintf(pre, sizeof pre, "model.layers.%d.mlp", layer);
    int64_t rs[2] = {E, H};
    int64_t e1[1] = {E};
    if (!strcmp(d->family, "gpt_oss")) {
        add(&p, FM_T_ROUTER_W, -2, 0, E, H, FM_DT_BF16, 2, rs, "%s.router.weight", pre);
        add(&p, FM_T_ROUTER_BIAS, -2, 0, E, 0, FM_DT_BF16, 1, e1, "%s.router.bias", pre);
    } else {
        add(&p, FM_T_ROUTER_W, -2, 0, E, H, FM_DT_BF16, 2, rs, "%s.gate.weight", pre);
        if (fm_io_has_score_bias(d, layer))
            add(&p, FM_T_SCORE_BIAS, -2, 0, E, 0, FM_DT_F32, 1, e1, "%s.gate.%s", pre,
                !strcmp(d->layout, "dsv4") ? "bias" : "e_score_correction_bias");
        if (fm_io_is_hash_layer(d, layer)) {
            int64_t ts[2] = {d->vocab_size, d->topk};
            add(&p, FM_T_TID2EID, -2, 0, d->vocab_size, d->topk, FM_DT_I64, 2, ts, "%s.gate.tid2eid", pre);
        }
    }
    if (!strcmp(d->layout, "gptoss")) {
        int64_t gb[4] = {E, 2 * I, H / 32, 16}, gs[3] = {E, 2 * I, H / 32}, gbi[2] = {E, 2 * I};
        int64_t db[4] = {E, H, I / 32, 16}, ds[3] = {E, H, I / 32}, dbi[2] = {E, H};
        add(&p, FM_T_FUSED_PACKED, -3, 0, 2 * I, H, FM_DT_U8, 4, gb, "%s.experts.gate_up_proj_blocks", pre);
        add(&p, FM_T_FUSED_SCALES, -3, 0, 2 * I, H, FM_DT_U8, 3, gs, "%s.experts.gate_up_proj_scales", pre);
        add(&p, FM_T_FUSED_BIAS, -3, 0, 2 * I, H, FM_DT_BF16, 2, gbi, "%s.experts.gate_up_proj_bias", pre);
        add(&p, FM_T_FUSED_PACKED, -3, 2, H, I, FM_DT_U8, 4, db, "%s.experts.down_proj_blocks", pre);
        add(&p, FM_T_FUSED_SCALES, -3, 2, H, I, FM_DT_U8, 3, ds, "%s.experts.down_proj_scales", pre);
        add(&p, FM_T_FUSED_BIAS, -3, 2, H, I, FM_DT_BF16, 2, dbi, "%s.experts.down_proj_bias", pre);
    } else {
        static const char *const hf[3] = {"gate_proj", "up_proj", "down_proj"};
        static const char *const mx[3] = {"w1", "w3", "w2"};
        const char *const *nm = (!strcmp(d->family, "mixtral") || !strcmp(d->layout, "dsv4")) ? mx : hf;
        char base[160];
        for (int e = 0; e < E; e++)
            for (int m = 0; m < 3; m++) {
                snprintf(base, sizeof base, "%s.experts.%d.%s", pre, e, nm[m]);
                plan_matrix(&p, d, base, e, m, m == 2 ? H : I, m == 2 ? I : H);
            }
    }
    if (d->n_shared > 0) {
        static const char *const hf[3] = {"gate_proj", "up_proj", "down_proj"};
        static const char *const w[3] = {"w1", "w3", "w2"};
        const char *const *nm = !strcmp(d->layout, "dsv4") ? w : hf;
        char base[160];
        for (int m = 0; m < 3; m++) {
            snprintf(base, sizeof base, "%s.shared_experts.%s", pre, nm[m]);
            plan_matrix(&p, d, base, -1, m, m == 2 ? H : S, m == 2 ? S : H);
        }
    }
    if (p.err != FM_OK) { free(p.v); return p.err; }
    *out = p.v;
    *n = p.n;
    return FM_OK;
}

uint64_t fm_io_tspec_bytes(const fm_io_tspec *t) {
    uint64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= (uint64_t)t->shape[i];
    return n * (uint64_t)(fm_dtype_bits(t->dt) / 8);
}

/* ------------------------------------------------------------------ bind */

void fm_io_problem(fm_io_problems *k, fm_status s, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (k->n++ == 0) {
        k->first = s;
        snprintf(k->first_msg, sizeof k->first_msg, "%s", msg);
    }
    if (k->report) k->report(k->ud, msg);
}

typedef struct {
    fm_ckpt *c;
    fm_io_problems p;
} checker;

static int dt_ok(const fm_io_tspec *t, fm_dtype got) {
    if (got == t->dt) return 1;
    switch (t->role) {
    case FM_T_PACKED: return t->dt != FM_DT_BF16 && (got == FM_DT_U8 || got == FM_DT_I8);
    case FM_T_SCALES: return t->dt == FM_DT_F8_E8M0 && got == FM_DT_U8;
    case FM_T_ROUTER_W:
    case FM_T_SCORE_BIAS:
    case FM_T_ROUTER_BIAS:
    case FM_T_EBIAS:
    case FM_T_FUSED_BIAS: return got == FM_DT_BF16 || got == FM_DT_F32;
    case FM_T_TID2EID: return got == FM_DT_I32 || got == FM_DT_I64;
    case FM_T_FUSED_SCALES: return got == FM_DT_F8_E8M0;
    default: return 0;
    }
}

void fm_io_shape_str(char *buf, size_t cap, int ndim, const int64_t *s) {
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < ndim && n < cap; i++) n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? ", " : "", (long long)s[i]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

static const fm_st_tensor *check_tensor(checker *k, const fm_io_tspec *t) {
    const fm_st_tensor *st = fm_ckpt_find(k->c, t->name);
    if (!st) {
        if (!t->optional) fm_io_problem(&k->p, FM_E_NOTFOUND, "missing tensor '%s': %s", t->name, fm_last_error());
        return NULL;
    }
    int bad = 0;
    if (!dt_ok(t, st->dtype)) {
        fm_io_problem(&k->p, FM_E_FORMAT, "tensor '%s' has dtype %s, expected %s", t->name, fm_dtype_name(st->dtype), fm_dtype_name(t->dt));
        bad = 1;
    }
    int same = st->ndim == t->ndim;
    for (int i = 0; same && i < t->ndim; i++) same = st->shape[i] == t->shape[i];
    if (!same) {
        char a[128], b[128];
        fm_io_shape_str(a, sizeof a, st->ndim, st->shape);
        fm_io_shape_str(b, sizeof b, t->ndim, t->shape);
        fm_io_problem(&k->p, FM_E_FORMAT, "tensor '%s' has shape %s, expected %s", t->name, a, b);
        bad = 1;
    }
    if (!bad && !st->data) {
        fm_io_problem(&k->p, FM_E_IO, "tensor '%s' has no data mapping", t->name);
        bad = 1;
    }
    return bad ? NULL : st;
}

float fm_io_load_f(const void *data, fm_dtype dt, int64_t i) {
    const uint8_t *p = data;
    if (dt == FM_DT_BF16) return fm_bf16_to_f32((uint16_t)(p[2 * i] | (p[2 * i + 1] << 8)));
    float f;
    memcpy(&f, p + 4 * i, 4);
    return f;
}

float *fm_io_f32_copy(fm_moe_layer *l, const void *data, fm_dtype dt, int64_t n, int64_t off, int64_t stride) {
    float *v = fm_io_layer_alloc(l, sizeof(float) * (size_t)n);
    if (v)
        for (int64_t i = 0; i < n; i++) v[i] = fm_io_load_f(data, dt, off + i * stride);
    return v;
}

static float *to_f32(fm_moe_layer *l, const fm_st_tensor *st, int64_t n, int64_t off, int64_t stride) {
    return fm_io_f32_copy(l, st->data, st->dtype, n, off, stride);
}

static fm_qmatrix *mat_of(fm_moe_layer *l, int e, int m) {
    if (e == -1) return m == 0 ? &l->sh_gate : m == 1 ? &l->sh_up : &l->sh_down;
    return m == 0 ? &l->gate[e] : m == 1 ? &l->up[e] : &l->down[e];
}

/* Quantizes a bound BF16 matrix into owned NVFP4 / MXFP4 buffers. */
static fm_status quantize_matrix(fm_moe_layer *l, fm_qmatrix *q, fm_qformat f) {
    int64_t R = q->rows, K = q->cols;
    int blk = f == FM_QF_NVFP4 ? 16 : 32;
    float *w = fm_malloc(sizeof(float) * (size_t)(R * K));
    uint8_t *packed = fm_io_layer_alloc(l, (size_t)(R * K / 2));
    uint8_t *scales = fm_io_layer_alloc(l, (size_t)(R * K / blk));
    if (!w || !packed || !scales) { free(w); return FM_E_NOMEM; }
    for (int64_t r = 0; r < R; r++) fm_qmatrix_dequant_row(q, r, w + r * K);
    float s2 = 1.0f;
    fm_status s = f == FM_QF_NVFP4 ? fm_quantize_nvfp4(w, R, K, packed, scales, &s2) : fm_quantize_mxfp4(w, R, K, packed, scales);
    free(w);
    if (s != FM_OK) return s;
    q->fmt = f;
    q->packed = packed;
    q->row_stride = K / 2;
    q->scales = scales;
    q->scale_stride = K / blk;
    q->scale2 = s2;
    return FM_OK;
}

void fm_io_wire_gptoss(fm_moe_layer *l, int m, int scales, const uint8_t *data, int64_t R, int64_t K) {
    const int64_t rowb = scales ? K / 32 : K / 2;
    for (int e = 0; e < l->n_experts; e++) {
        const uint8_t *base = data + (size_t)e * (size_t)(R * rowb);
        /* gate = even rows, up = odd rows of the fused [2I, .] block */
        for (int mm = m == 0 ? 0 : 2; mm < (m == 0 ? 2 : 3); mm++) {
            fm_qmatrix *g = mat_of(l, e, mm);
            const int64_t off = m == 0 ? mm * rowb : 0, step = m == 0 ? 2 * rowb : rowb;
            g->fmt = FM_QF_MXFP4;
            g->rows = m == 0 ? R / 2 : R;
            g->cols = K;
            g->scale2 = 1.0f;
            if (scales) { g->scales = base + off; g->scale_stride = step; }
            else { g->packed = base + off; g->row_stride = step; }
        }
    }
}

fm_status fm_io_wire_gptoss_bias(fm_moe_layer *l, int m, const void *data, fm_dtype dt, int64_t R) {
    for (int e = 0; e < l->n_experts; e++) {
        if (m == 0) {
            const int64_t I = R / 2;
            float *gb = fm_io_f32_copy(l, data, dt, I, e * R, 2), *ub = fm_io_f32_copy(l, data, dt, I, e * R + 1, 2);
            if (!gb || !ub) return FM_E_NOMEM;
            l->gate[e].bias = gb;
            l->up[e].bias = ub;
        } else {
            float *db = fm_io_f32_copy(l, data, dt, R, e * R, 1);
            if (!db) return FM_E_NOMEM;
            l->down[e].bias = db;
        }
    }
    return FM_OK;
}

fm_status fm_io_layer_bind(fm_ckpt *c, const fm_model_desc *d, int layer, fm_qformat quantize_bf16, fm_io_problem_fn report,
                         void *ud, fm_moe_layer **out) {
    *out = NULL;
    fm_status s = fm_model_desc_validate(d);
    if (s != FM_OK) return s;
    if (!fm_model_is_moe_layer(d, layer))
        return fm_error(FM_E_ARG, "layer %d is not a MoE layer of this %s model (%d layers, first %d dense)", layer,
                        d->family, d->n_layers, d->first_dense);
    fm_io_tspec *plan;
    size_t np;
    s = fm_io_layer_plan(d, layer, &plan, &np);
    if (s != FM_OK) return s;
    fm_moe_layer *l = fm_io_layer_new(d, layer, d->expert_format);
    if (!l) { free(plan); return FM_E_NOMEM; }
    checker k = {c, {report, ud, 0, FM_OK, ""}};
    int64_t H = d->hidden, E = d->n_experts;
    fm_qformat f = d->expert_format;
    int blk = f == FM_QF_NVFP4 ? 16 : f == FM_QF_MXFP4 ? 32 : 0;
    for (size_t i = 0; i < np; i++) {
        const fm_io_tspec *t = &plan[i];
        const fm_st_tensor *st = check_tensor(&k, t);
        if (!st) continue;
        if (k.p.n) continue; /* keep checking; wire only a clean layer */
        const uint8_t *data = st->data;
        fm_qmatrix *q;
        switch (t->role) {
        case FM_T_PACKED:
            q = mat_of(l, t->e, t->m);
            q->fmt = f;
            q->rows = t->R;
            q->cols = t->K;
            q->packed = data;
            q->row_stride = f == FM_QF_BF16 ? 2 * t->K : t->K / 2;
            if (q->scale2 == 0) q->scale2 = 1.0f;
            break;
        case FM_T_SCALES:
            q = mat_of(l, t->e, t->m);
            q->scales = data;
            q->scale_stride = t->K / blk;
            break;
        case FM_T_SCALE2: {
            float v;
            memcpy(&v, data, 4);
            if (!isfinite(v) || v <= 0) fm_io_problem(&k.p, FM_E_NUMERIC, "tensor '%s' = %g is not a positive finite scale", t->name, (double)v);
            mat_of(l, t->e, t->m)->scale2 = v;
            break;
        }
        case FM_T_INSCALE: break;
        case FM_T_EBIAS: {
            float *b = to_f32(l, st, t->R, 0, 1);
            if (!b) { s = FM_E_NOMEM; goto done; }
            mat_of(l, t->e, t->m)->bias = b;
            break;
        }
        case FM_T_ROUTER_W:
            if (!(l->router_w = to_f32(l, st, E * H, 0, 1))) { s = FM_E_NOMEM; goto done; }
            break;
        case FM_T_SCORE_BIAS:
            if (!(l->score_bias = to_f32(l, st, E, 0, 1))) { s = FM_E_NOMEM; goto done; }
            break;
        case FM_T_ROUTER_BIAS:
            if (!(l->router_bias = to_f32(l, st, E, 0, 1))) { s = FM_E_NOMEM; goto done; }
            break;
        case FM_T_TID2EID: {
            int64_t V = t->shape[0], kk = t->shape[1];
            int32_t *tb = fm_io_layer_alloc(l, sizeof(int32_t) * (size_t)(V * kk));
            if (!tb) { s = FM_E_NOMEM; goto done; }
            for (int64_t j = 0; j < V * kk; j++) {
                int64_t v;
                if (st->dtype == FM_DT_I64) memcpy(&v, data + 8 * j, 8);
                else { int32_t v32; memcpy(&v32, data + 4 * j, 4); v = v32; }
                if (v < 0 || v >= E) {
                    fm_io_problem(&k.p, FM_E_RANGE, "tensor '%s' row %lld holds expert %lld, outside [0, %lld)", t->name,
                            (long long)(j / kk), (long long)v, (long long)E);
                    break;
                }
                tb[j] = (int32_t)v;
            }
            l->tid2eid = tb;
            l->tid2eid_rows = V;
            break;
        }
        case FM_T_FUSED_PACKED:
        case FM_T_FUSED_SCALES: fm_io_wire_gptoss(l, t->m, t->role == FM_T_FUSED_SCALES, data, t->R, t->K); break;
        case FM_T_FUSED_BIAS:
            if ((s = fm_io_wire_gptoss_bias(l, t->m, st->data, st->dtype, t->R))) goto done;
            break;
        }
    }
    if (k.p.n) {
        s = fm_error(k.p.first, "%s layer %d: %s%s", fm_ckpt_dir(c), layer, k.p.first_msg,
                     k.p.n > 1 ? " (and more problems)" : "");
        goto done;
    }
    if (f == FM_QF_BF16 && (quantize_bf16 == FM_QF_NVFP4 || quantize_bf16 == FM_QF_MXFP4)) {
        for (int e = 0; e < E && s == FM_OK; e++)
            for (int m = 0; m < 3 && s == FM_OK; m++) s = quantize_matrix(l, mat_of(l, e, m), quantize_bf16);
        for (int m = 0; m < 3 && s == FM_OK && l->has_shared; m++) s = quantize_matrix(l, mat_of(l, -1, m), quantize_bf16);
        if (s != FM_OK) goto done;
        l->fmt = quantize_bf16;
    }
done:
    free(plan);
    if (s != FM_OK) { fm_moe_layer_free(l); return s; }
    *out = l;
    return FM_OK;
}

fm_status fm_moe_layer_bind(fm_ckpt *c, const fm_model_desc *d, int layer, fm_qformat quantize_bf16, fm_moe_layer **out) {
    if (!c || !d || !out) return fm_error(FM_E_ARG, "fm_moe_layer_bind: NULL argument");
    return fm_io_layer_bind(c, d, layer, quantize_bf16, NULL, NULL, out);
}
