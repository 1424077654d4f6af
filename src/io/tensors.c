/*
 * MoE layers from tensors an inference engine holds (torch / NumPy views
 * passed through fm_layer_tensors): the check of every view against the
 * model description, and a host copy as an fm_moe_layer.
 *
 * Layouts (fp4moe.h): the ModelOpt NVFP4 layer of vLLM / SGLang (w13 =
 * gate rows then up rows, one FP32 scale_2 per expert, or one per gate and
 * up) and the gpt-oss MXFP4 checkpoint tensors (gate/up rows interleaved,
 * E8M0 scales, biases). I is the partition's (t->inter), so a TP rank's
 * share loads like a whole layer.
 *
 * The check reads only shapes, dtypes and strides; messages follow the
 * checkpoint loader's (src/io/bind.c): they name the tensor, and checking
 * goes on after a problem so the first one is reported with "(and more
 * problems)". The copy gathers every strided view into contiguous memory
 * the layer owns, then wires the matrices as bind.c does for the
 * checkpoint layouts (the gpt-oss wiring is the same code).
 */
#include "io/io_internal.h"
#include "util/util.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#define MAX_WIDTH (1 << 20) /* I and the shared width, as fm_model_desc_validate bounds them */

/* Every view of fm_layer_tensors by name, to find those a layout does not use. */
#define F(x) {#x, offsetof(fm_layer_tensors, x)}
static const struct {
    const char *name;
    size_t off;
} k_fields[] = {
    F(w13_weight),          F(w13_weight_scale),    F(w13_weight_scale_2), F(w2_weight),
    F(w2_weight_scale),     F(w2_weight_scale_2),   F(gate_up_blocks),     F(gate_up_scales),
    F(gate_up_bias),        F(down_blocks),         F(down_scales),        F(down_bias),
    F(router_w),            F(router_bias),         F(score_bias),         F(shared_gate),
    F(shared_gate_scale),   F(shared_gate_scale_2), F(shared_up),          F(shared_up_scale),
    F(shared_up_scale_2),   F(shared_down),         F(shared_down_scale),  F(shared_down_scale_2),
};
#undef F
#define N_FIELDS (sizeof k_fields / sizeof k_fields[0])

static const fm_tensor *field(const fm_layer_tensors *t, size_t i) {
    return (const fm_tensor *)((const char *)t + k_fields[i].off);
}

static int present(const fm_tensor *v) { return v->data != NULL; }

/* What one view must be: accepted dtypes (the first is named in messages)
 * and one or two accepted shapes, each dimension with its symbol. */
typedef struct {
    const char *name;
    const fm_tensor *v;
    int required;
    fm_dtype dt[3];
    int nalt;
    int ndim[2];
    int64_t dim[2][4];
    const char *sym[2][4];
    int skip_shape; /* a width it depends on is already reported as wrong */
} tspec;

typedef struct {
    fm_tensor_layout layout;
    fm_qformat fmt;
    int blk;
    int64_t E, H, I, SI;
    int has_shared, has_router;
    fm_io_problems p;
    unsigned char used[N_FIELDS];
} tcheck;

static const char *layout_name(fm_tensor_layout l) {
    return l == FM_TL_MODELOPT_NVFP4 ? "ModelOpt NVFP4" : l == FM_TL_GPTOSS_MXFP4 ? "gpt-oss MXFP4" : "unknown";
}

static void mark_used(tcheck *c, const fm_layer_tensors *t, const fm_tensor *v) {
    for (size_t i = 0; i < N_FIELDS; i++)
        if (field(t, i) == v) c->used[i] = 1;
}

static void expected_str(const tspec *s, char *buf, size_t cap) {
    size_t n = 0;
    buf[0] = 0;
    for (int a = 0; a < s->nalt && n < cap; a++) {
        n += (size_t)snprintf(buf + n, cap - n, "%s[", a ? " or " : "");
        for (int i = 0; i < s->ndim[a] && n < cap; i++) {
            if (strspn(s->sym[a][i], "0123456789") == strlen(s->sym[a][i])) /* a fixed size needs no symbol */
                n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? ", " : "", (long long)s->dim[a][i]);
            else
                n += (size_t)snprintf(buf + n, cap - n, "%s%s=%lld", i ? ", " : "", s->sym[a][i], (long long)s->dim[a][i]);
        }
        if (n < cap) n += (size_t)snprintf(buf + n, cap - n, "]");
    }
}

static void dtypes_str(const tspec *s, char *buf, size_t cap) {
    size_t n = (size_t)snprintf(buf, cap, "%s", fm_dtype_name(s->dt[0]));
    for (int i = 1; i < 3 && s->dt[i] != FM_DT_INVALID && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%s", i == 1 ? " (or " : ", ", fm_dtype_name(s->dt[i]));
    if (s->dt[1] != FM_DT_INVALID && n < cap) snprintf(buf + n, cap - n, ")");
}

/* Checks one view; 1 when it is present and usable. */
static int check_view(tcheck *c, const tspec *s) {
    const fm_tensor *v = s->v;
    if (!present(v)) {
        if (s->required)
            fm_io_problem(&c->p, FM_E_NOTFOUND, "missing tensor '%s' (its data pointer is NULL)", s->name);
        return 0;
    }
    if (v->ndim < 0 || v->ndim > FM_MAX_DIMS) {
        fm_io_problem(&c->p, FM_E_FORMAT, "tensor '%s' has ndim %d (at most %d)", s->name, v->ndim, FM_MAX_DIMS);
        return 0;
    }
    int ok = 1;
    int dt_ok = 0;
    for (int i = 0; i < 3 && s->dt[i] != FM_DT_INVALID; i++) dt_ok |= v->dtype == s->dt[i];
    if (!dt_ok) {
        char want[96];
        dtypes_str(s, want, sizeof want);
        const char *got = fm_dtype_name(v->dtype);
        fm_io_problem(&c->p, FM_E_FORMAT, "tensor '%s' has dtype %s, expected %s", s->name, got ? got : "?", want);
        ok = 0;
    }
    char got[160], want[200];
    fm_io_shape_str(got, sizeof got, v->ndim, v->shape);
    if (!s->skip_shape) {
        int match = 0;
        for (int a = 0; a < s->nalt && !match; a++) {
            match = v->ndim == s->ndim[a];
            for (int i = 0; match && i < s->ndim[a]; i++) match = v->shape[i] == s->dim[a][i];
        }
        if (!match) {
            expected_str(s, want, sizeof want);
            if (v->ndim != s->ndim[0] && (s->nalt < 2 || v->ndim != s->ndim[1]))
                fm_io_problem(&c->p, FM_E_FORMAT, "tensor '%s' has %d dimensions %s, expected %s", s->name, v->ndim,
                              got, want);
            else
                fm_io_problem(&c->p, FM_E_FORMAT, "tensor '%s' has shape %s, expected %s", s->name, got, want);
            return 0;
        }
    }
    /* Strides: element steps, the innermost 1 (a dimension of one element
     * has no step to speak of), the others any non-negative value; the
     * furthest byte must be addressable. */
    const int nd = v->ndim;
    for (int i = 0; i < nd; i++) {
        if (v->shape[i] < 0) {
            fm_io_problem(&c->p, FM_E_FORMAT, "tensor '%s' has shape %s with a negative size", s->name, got);
            return 0;
        }
        if (v->stride[i] < 0) {
            fm_io_problem(&c->p, FM_E_FORMAT, "tensor '%s' has stride %lld in dimension %d (strides must be >= 0)",
                          s->name, (long long)v->stride[i], i);
            return 0;
        }
    }
    if (nd > 0 && v->shape[nd - 1] > 1 && v->stride[nd - 1] != 1) {
        fm_io_problem(&c->p, FM_E_FORMAT, "tensor '%s' has innermost stride %lld, expected 1 (rows must be contiguous)",
                      s->name, (long long)v->stride[nd - 1]);
        return 0;
    }
    uint64_t last = 0, esz = dt_ok ? (uint64_t)(fm_dtype_bits(v->dtype) / 8) : 1, span;
    int empty = 0;
    for (int i = 0; i < nd; i++) {
        uint64_t d;
        if (v->shape[i] == 0) empty = 1;
        if (v->shape[i] == 0) continue;
        if (!fm_mul_ok((uint64_t)(v->shape[i] - 1), (uint64_t)v->stride[i], &d) || !fm_add_ok(last, d, &last)) {
            last = UINT64_MAX;
            break;
        }
    }
    if (!empty && (last == UINT64_MAX || !fm_add_ok(last, 1, &span) || !fm_mul_ok(span, esz, &span) ||
                   span > (uint64_t)INT64_MAX || span > (uint64_t)SIZE_MAX)) {
        char st[160];
        fm_io_shape_str(st, sizeof st, nd, v->stride);
        fm_io_problem(&c->p, FM_E_RANGE, "tensor '%s': shape %s with strides %s spans more bytes than can be addressed",
                      s->name, got, st);
        return 0;
    }
    return ok;
}

/* tspec builders: dims as (symbol, size) pairs. */
static tspec spec(const char *name, const fm_tensor *v, int required, fm_dtype a, fm_dtype b, fm_dtype c) {
    tspec s;
    memset(&s, 0, sizeof s);
    s.name = name;
    s.v = v;
    s.required = required;
    s.dt[0] = a;
    s.dt[1] = b;
    s.dt[2] = c;
    s.nalt = 1;
    return s;
}
static void shape(tspec *s, int alt, int nd, const char *const *sym, const int64_t *dim) {
    s->ndim[alt] = nd;
    for (int i = 0; i < nd; i++) {
        s->sym[alt][i] = sym[i];
        s->dim[alt][i] = dim[i];
    }
    if (alt + 1 > s->nalt) s->nalt = alt + 1;
}
#define SHAPE(s, alt, ...)                                                                                 \
    do {                                                                                                   \
        const char *const sym_[] = {__VA_ARGS__};                                                          \
        shape((s), (alt), (int)(sizeof sym_ / sizeof sym_[0]), sym_, dims_);                               \
    } while (0)

static void run(tcheck *c, const fm_layer_tensors *t, tspec *s) {
    mark_used(c, t, s->v);
    check_view(c, s);
}

/* The routed experts' views of a layout. */
static void check_routed(tcheck *c, const fm_layer_tensors *t, int bad_i) {
    const int64_t E = c->E, H = c->H, I = c->I;
    const fm_dtype U8 = FM_DT_U8, I8 = FM_DT_I8, NO = FM_DT_INVALID;
    tspec s;
    if (c->layout == FM_TL_MODELOPT_NVFP4) {
        s = spec("w13_weight", &t->w13_weight, 1, U8, I8, NO);
        { int64_t dims_[] = {E, 2 * I, H / 2}; SHAPE(&s, 0, "E", "2I", "H/2"); }
        s.skip_shape = bad_i;
        run(c, t, &s);
        s = spec("w13_weight_scale", &t->w13_weight_scale, 1, FM_DT_F8_E4M3, U8, NO);
        { int64_t dims_[] = {E, 2 * I, H / 16}; SHAPE(&s, 0, "E", "2I", "H/16"); }
        s.skip_shape = bad_i;
        run(c, t, &s);
        s = spec("w13_weight_scale_2", &t->w13_weight_scale_2, 1, FM_DT_F32, NO, NO);
        { int64_t dims_[] = {E, 2}; SHAPE(&s, 0, "E"); SHAPE(&s, 1, "E", "2"); }
        run(c, t, &s);
        s = spec("w2_weight", &t->w2_weight, 1, U8, I8, NO);
        { int64_t dims_[] = {E, H, I / 2}; SHAPE(&s, 0, "E", "H", "I/2"); }
        s.skip_shape = bad_i;
        run(c, t, &s);
        s = spec("w2_weight_scale", &t->w2_weight_scale, 1, FM_DT_F8_E4M3, U8, NO);
        { int64_t dims_[] = {E, H, I / 16}; SHAPE(&s, 0, "E", "H", "I/16"); }
        s.skip_shape = bad_i;
        run(c, t, &s);
        s = spec("w2_weight_scale_2", &t->w2_weight_scale_2, 1, FM_DT_F32, NO, NO);
        { int64_t dims_[] = {E}; SHAPE(&s, 0, "E"); }
        run(c, t, &s);
    } else {
        s = spec("gate_up_blocks", &t->gate_up_blocks, 1, U8, I8, NO);
        { int64_t dims_[] = {E, 2 * I, H / 32, 16}; SHAPE(&s, 0, "E", "2I", "H/32", "16"); }
        s.skip_shape = bad_i;
        run(c, t, &s);
        s = spec("gate_up_scales", &t->gate_up_scales, 1, U8, FM_DT_F8_E8M0, NO);
        { int64_t dims_[] = {E, 2 * I, H / 32}; SHAPE(&s, 0, "E", "2I", "H/32"); }
        s.skip_shape = bad_i;
        run(c, t, &s);
        s = spec("gate_up_bias", &t->gate_up_bias, 1, FM_DT_BF16, FM_DT_F32, NO);
        { int64_t dims_[] = {E, 2 * I}; SHAPE(&s, 0, "E", "2I"); }
        s.skip_shape = bad_i;
        run(c, t, &s);
        s = spec("down_blocks", &t->down_blocks, 1, U8, I8, NO);
        { int64_t dims_[] = {E, H, I / 32, 16}; SHAPE(&s, 0, "E", "H", "I/32", "16"); }
        s.skip_shape = bad_i;
        run(c, t, &s);
        s = spec("down_scales", &t->down_scales, 1, U8, FM_DT_F8_E8M0, NO);
        { int64_t dims_[] = {E, H, I / 32}; SHAPE(&s, 0, "E", "H", "I/32"); }
        s.skip_shape = bad_i;
        run(c, t, &s);
        s = spec("down_bias", &t->down_bias, 1, FM_DT_BF16, FM_DT_F32, NO);
        { int64_t dims_[] = {E, H}; SHAPE(&s, 0, "E", "H"); }
        run(c, t, &s);
    }
}

/* The fused shared expert: all of its views or none. */
static void check_shared(tcheck *c, const fm_model_desc *d, const fm_layer_tensors *t) {
    const fm_tensor *all[9] = {&t->shared_gate, &t->shared_gate_scale, &t->shared_gate_scale_2,
                               &t->shared_up,   &t->shared_up_scale,   &t->shared_up_scale_2,
                               &t->shared_down, &t->shared_down_scale, &t->shared_down_scale_2};
    static const char *const names[3] = {"shared_gate", "shared_up", "shared_down"};
    const int nv = c->fmt == FM_QF_NVFP4;
    for (int i = 0; i < 9; i++)
        c->has_shared |= present(all[i]) && (nv || i % 3 != 2); /* MXFP4 has no scale_2: reported as unused */
    if (!c->has_shared) return;
    if (d->n_shared <= 0) {
        for (int i = 0; i < 9; i++)
            if (present(all[i])) {
                fm_io_problem(&c->p, FM_E_ARG, "tensor '%s%s' is given but the model has no shared experts "
                              "(n_shared_experts = 0)", names[i / 3], i % 3 == 1 ? "_scale" : i % 3 == 2 ? "_scale_2" : "");
                break;
            }
        c->has_shared = 0;
        return;
    }
    /* The width comes from the tensors: a TP rank holds a slice of it. */
    const fm_tensor *g = &t->shared_gate;
    int bad_si = 1;
    if (present(g) && g->ndim != 2) {
        char got[160];
        fm_io_shape_str(got, sizeof got, g->ndim < 0 || g->ndim > FM_MAX_DIMS ? 0 : g->ndim, g->shape);
        fm_io_problem(&c->p, FM_E_FORMAT, "tensor 'shared_gate' has %d dimensions %s, expected [SI, H/2=%lld]",
                      g->ndim, got, (long long)(c->H / 2));
    } else if (present(g)) {
        c->SI = g->shape[0];
        if (c->SI < 1 || c->SI > MAX_WIDTH || c->SI % c->blk)
            fm_io_problem(&c->p, FM_E_RANGE, "tensor 'shared_gate' has %lld rows (SI), not a positive multiple of the "
                          "%s block (%d)", (long long)c->SI, fm_io_qformat_str(c->fmt), c->blk);
        else
            bad_si = 0;
    }
    const int64_t H = c->H, SI = c->SI, blk = c->blk;
    const fm_dtype U8 = FM_DT_U8, NO = FM_DT_INVALID;
    const fm_dtype sdt = nv ? FM_DT_F8_E4M3 : U8, sdt2 = nv ? U8 : FM_DT_F8_E8M0;
    char nm[3][3][32];
    for (int m = 0; m < 3; m++) {
        const int64_t R = m == 2 ? H : SI, K = m == 2 ? SI : H;
        snprintf(nm[m][0], sizeof nm[m][0], "%s", names[m]);
        snprintf(nm[m][1], sizeof nm[m][1], "%s_scale", names[m]);
        snprintf(nm[m][2], sizeof nm[m][2], "%s_scale_2", names[m]);
        tspec s = spec(nm[m][0], all[3 * m], 1, U8, FM_DT_I8, NO);
        int64_t dims_[] = {R, K / 2};
        if (m == 2) SHAPE(&s, 0, "H", "SI/2");
        else SHAPE(&s, 0, "SI", "H/2");
        s.skip_shape = bad_si; /* already reported */
        run(c, t, &s);
        s = spec(nm[m][1], all[3 * m + 1], 1, sdt, sdt2, NO);
        dims_[1] = K / blk;
        if (m == 2) SHAPE(&s, 0, "H", nv ? "SI/16" : "SI/32");
        else SHAPE(&s, 0, "SI", nv ? "H/16" : "H/32");
        s.skip_shape = bad_si;
        run(c, t, &s);
        if (nv) {
            s = spec(nm[m][2], all[3 * m + 2], 1, FM_DT_F32, NO, NO);
            dims_[0] = 1;
            s.nalt = 2;
            s.ndim[0] = 0;
            SHAPE(&s, 1, "1");
            run(c, t, &s);
        }
    }
}

static void check_router(tcheck *c, const fm_model_desc *d, int layer, const fm_layer_tensors *t) {
    const int64_t E = c->E, H = c->H;
    const fm_dtype NO = FM_DT_INVALID;
    c->has_router = present(&t->router_w);
    const int need_rbias = d->route == FM_ROUTE_GPTOSS;
    const int hash = layer >= 0 && fm_io_is_hash_layer(d, layer);
    const int allow_sbias = d->route == FM_ROUTE_NOAUX_TC || d->route == FM_ROUTE_DSV4;
    const int need_sbias = d->route == FM_ROUTE_NOAUX_TC || (d->route == FM_ROUTE_DSV4 && layer >= 0 && !hash);
    mark_used(c, t, &t->router_w);
    mark_used(c, t, &t->router_bias);
    mark_used(c, t, &t->score_bias);
    if (!c->has_router) {
        const char *b = present(&t->router_bias) ? "router_bias" : present(&t->score_bias) ? "score_bias" : NULL;
        if (b) fm_io_problem(&c->p, FM_E_ARG, "tensor '%s' is given without 'router_w'", b);
        return;
    }
    if (hash) {
        fm_io_problem(&c->p, FM_E_UNSUPPORTED, "tensor 'router_w': layer %d routes by token id (tid2eid), which "
                      "fm_layer_tensors does not carry; leave router_w out and call the pre-routed experts", layer);
        return;
    }
    tspec s = spec("router_w", &t->router_w, 1, FM_DT_F32, FM_DT_BF16, NO);
    { int64_t dims_[] = {E, H}; SHAPE(&s, 0, "E", "H"); }
    check_view(c, &s);
    if (!need_rbias && present(&t->router_bias))
        fm_io_problem(&c->p, FM_E_ARG, "tensor 'router_bias' is not used by this model's routing (only gpt-oss adds a "
                      "bias to the logits)");
    else if (need_rbias) {
        s = spec("router_bias", &t->router_bias, 1, FM_DT_F32, FM_DT_BF16, NO);
        { int64_t dims_[] = {E}; SHAPE(&s, 0, "E"); }
        check_view(c, &s);
    }
    if (!allow_sbias && present(&t->score_bias))
        fm_io_problem(&c->p, FM_E_ARG, "tensor 'score_bias' is not used by this model's routing (only noaux_tc and "
                      "DeepSeek-V4 scored layers have a correction bias)");
    else if (allow_sbias) {
        s = spec("score_bias", &t->score_bias, need_sbias, FM_DT_F32, FM_DT_BF16, NO);
        { int64_t dims_[] = {E}; SHAPE(&s, 0, "E"); }
        check_view(c, &s);
    }
}

/* layer < 0: not known (fm_layer_tensors_check), so layer-dependent
 * routing rules are not applied. Fills c; FM_OK or the first problem. */
static fm_status check_all(const fm_model_desc *d, int layer, const fm_layer_tensors *t, tcheck *c) {
    memset(c, 0, sizeof *c);
    fm_status s = fm_model_desc_validate(d);
    if (s) return s;
    c->layout = t->layout;
    if (t->layout == FM_TL_MODELOPT_NVFP4) c->fmt = FM_QF_NVFP4;
    else if (t->layout == FM_TL_GPTOSS_MXFP4) c->fmt = FM_QF_MXFP4;
    else return fm_error(FM_E_ARG, "layer tensors: unknown layout %d (ModelOpt NVFP4 = %d, gpt-oss MXFP4 = %d)",
                         (int)t->layout, (int)FM_TL_MODELOPT_NVFP4, (int)FM_TL_GPTOSS_MXFP4);
    if (d->expert_format != c->fmt)
        return fm_error(FM_E_ARG, "layer tensors: the %s layout holds %s experts but the model description's are %s",
                        layout_name(t->layout), fm_io_qformat_str(c->fmt), fm_io_qformat_str(d->expert_format));
    if (c->fmt == FM_QF_NVFP4 && fm_io_has_expert_bias(d))
        return fm_error(FM_E_UNSUPPORTED, "layer tensors: the %s layout has no expert biases, which %s experts need",
                        layout_name(t->layout), d->family);
    c->blk = fm_qformat_block(c->fmt);
    c->E = d->n_experts;
    c->H = d->hidden;
    c->I = t->inter;
    const int mx = c->fmt == FM_QF_MXFP4;
    int bad_i = 0;
    if (c->H % c->blk)
        fm_io_problem(&c->p, FM_E_RANGE, "hidden %lld is not a multiple of the %s block (%d) that tensor '%s' needs",
                      (long long)c->H, fm_io_qformat_str(c->fmt), c->blk, mx ? "gate_up_scales" : "w13_weight_scale");
    if (c->I < 1 || c->I > MAX_WIDTH || c->I % c->blk) {
        fm_io_problem(&c->p, FM_E_RANGE, "inter = %lld is not a positive multiple of the %s block (%d) that tensor "
                      "'%s' [E, H, I/%d] needs", (long long)c->I, fm_io_qformat_str(c->fmt), c->blk,
                      mx ? "down_scales" : "w2_weight_scale", c->blk);
        bad_i = 1;
    }
    check_routed(c, t, bad_i);
    check_shared(c, d, t);
    check_router(c, d, layer, t);
    for (size_t i = 0; i < N_FIELDS; i++)
        if (!c->used[i] && present(field(t, i)))
            fm_io_problem(&c->p, FM_E_ARG, "tensor '%s' is not part of the %s layout", k_fields[i].name,
                          layout_name(t->layout));
    return FM_OK;
}

static fm_status report(const tcheck *c, const char *prefix) {
    return fm_error(c->p.first, "%s%s%s", prefix, c->p.first_msg, c->p.n > 1 ? " (and more problems)" : "");
}

fm_status fm_layer_tensors_check(const fm_model_desc *d, const fm_layer_tensors *t) {
    if (!d || !t) return fm_error(FM_E_ARG, "fm_layer_tensors_check: NULL argument");
    tcheck c;
    fm_status s = check_all(d, -1, t, &c);
    if (s) return s;
    return c.p.n ? report(&c, "layer tensors: ") : FM_OK;
}

/* ------------------------------------------------------------------ copy */

static size_t elem_bytes(const fm_tensor *v) { return (size_t)(fm_dtype_bits(v->dtype) / 8); }

static size_t view_bytes(const fm_tensor *v) {
    size_t n = elem_bytes(v);
    for (int i = 0; i < v->ndim; i++) n *= (size_t)v->shape[i];
    return n;
}

/* The view's elements in row-major order into dst (rows are contiguous). */
static void gather(const fm_tensor *v, uint8_t *dst) {
    const size_t es = elem_bytes(v);
    const int nd = v->ndim;
    if (nd == 0) {
        memcpy(dst, v->data, es);
        return;
    }
    const size_t row = (size_t)v->shape[nd - 1] * es;
    int64_t idx[FM_MAX_DIMS] = {0}, nrows = 1;
    for (int i = 0; i < nd - 1; i++) nrows *= v->shape[i];
    for (int64_t r = 0; r < nrows; r++) {
        int64_t off = 0;
        for (int i = 0; i < nd - 1; i++) off += idx[i] * v->stride[i];
        memcpy(dst + (size_t)r * row, (const uint8_t *)v->data + (size_t)off * es, row);
        for (int i = nd - 2; i >= 0; i--) {
            if (++idx[i] < v->shape[i]) break;
            idx[i] = 0;
        }
    }
}

/* A contiguous copy the layer owns. */
static uint8_t *owned_copy(fm_moe_layer *l, const fm_tensor *v) {
    uint8_t *p = fm_io_layer_alloc(l, view_bytes(v) ? view_bytes(v) : 1);
    if (p) gather(v, p);
    return p;
}

/* n floats (BF16 / F32 view) as an F32 copy the layer owns. */
static float *f32_copy(fm_moe_layer *l, const fm_tensor *v, int64_t n) {
    uint8_t *tmp = fm_malloc(view_bytes(v) ? view_bytes(v) : 1);
    if (!tmp) return NULL;
    gather(v, tmp);
    float *f = fm_io_f32_copy(l, tmp, v->dtype, n, 0, 1);
    free(tmp);
    return f;
}

/* A weight_scale_2 value: positive and finite, as the loader demands. */
static float scale2_at(tcheck *c, const float *s2, int64_t i, const char *name, int64_t e, int col) {
    const float v = s2[i];
    if (!(isfinite(v) && v > 0)) {
        if (col >= 0)
            fm_io_problem(&c->p, FM_E_NUMERIC, "tensor '%s' [%lld, %d] = %g is not a positive finite scale", name,
                          (long long)e, col, (double)v);
        else if (e >= 0)
            fm_io_problem(&c->p, FM_E_NUMERIC, "tensor '%s' [%lld] = %g is not a positive finite scale", name,
                          (long long)e, (double)v);
        else
            fm_io_problem(&c->p, FM_E_NUMERIC, "tensor '%s' = %g is not a positive finite scale", name, (double)v);
    }
    return v;
}

/* The NVFP4 per-tensor scales, checked in the loader's order (per expert
 * gate, up, down; then the shared expert's): s13 [E] or [E][2] (both),
 * s2 [E], sh_raw[3] (when has_shared) into gate / up / down [E], sh[3]. */
static void scale2_values(tcheck *c, const float *s13, int both, const float *s2, const float *sh_raw, float *gate,
                          float *up, float *down, float *sh) {
    for (int64_t e = 0; e < c->E; e++) {
        gate[e] = scale2_at(c, s13, both ? 2 * e : e, "w13_weight_scale_2", e, both ? 0 : -1);
        up[e] = both ? scale2_at(c, s13, 2 * e + 1, "w13_weight_scale_2", e, 1) : gate[e];
        down[e] = scale2_at(c, s2, e, "w2_weight_scale_2", e, -1);
    }
    static const char *const name[3] = {"shared_gate_scale_2", "shared_up_scale_2", "shared_down_scale_2"};
    for (int m = 0; m < 3 && c->has_shared; m++) sh[m] = scale2_at(c, sh_raw, m, name[m], -1, -1);
}

static fm_qmatrix nv_mat(int64_t R, int64_t K, const uint8_t *packed, const uint8_t *scales, int blk, float s2,
                         fm_qformat f) {
    fm_qmatrix q;
    memset(&q, 0, sizeof q);
    q.fmt = f;
    q.rows = R;
    q.cols = K;
    q.packed = packed;
    q.row_stride = K / 2;
    q.scales = scales;
    q.scale_stride = K / blk;
    q.scale2 = s2;
    return q;
}

static fm_status build(tcheck *c, const fm_layer_tensors *t, fm_moe_layer *l) {
    const int64_t E = c->E, H = c->H, I = c->I, blk = c->blk;
    float *sg = NULL, *su = NULL, *sd = NULL, ssh[3] = {1.0f, 1.0f, 1.0f};
    if (c->fmt == FM_QF_NVFP4) {
        float *s13 = f32_copy(l, &t->w13_weight_scale_2, t->w13_weight_scale_2.ndim == 2 ? 2 * E : E);
        float *s2 = f32_copy(l, &t->w2_weight_scale_2, E);
        sg = fm_io_layer_alloc(l, sizeof(float) * (size_t)E);
        su = fm_io_layer_alloc(l, sizeof(float) * (size_t)E);
        sd = fm_io_layer_alloc(l, sizeof(float) * (size_t)E);
        if (!s13 || !s2 || !sg || !su || !sd) return FM_E_NOMEM;
        float raw[3] = {1.0f, 1.0f, 1.0f};
        const fm_tensor *sh2[3] = {&t->shared_gate_scale_2, &t->shared_up_scale_2, &t->shared_down_scale_2};
        for (int m = 0; m < 3 && c->has_shared; m++) gather(sh2[m], (uint8_t *)&raw[m]);
        scale2_values(c, s13, t->w13_weight_scale_2.ndim == 2, s2, raw, sg, su, sd, ssh);
    }
    if (c->layout == FM_TL_MODELOPT_NVFP4) {
        uint8_t *w13 = owned_copy(l, &t->w13_weight), *w13s = owned_copy(l, &t->w13_weight_scale);
        uint8_t *w2 = owned_copy(l, &t->w2_weight), *w2s = owned_copy(l, &t->w2_weight_scale);
        if (!w13 || !w13s || !w2 || !w2s) return FM_E_NOMEM;
        for (int64_t e = 0; e < E; e++) {
            const uint8_t *p = w13 + e * 2 * I * (H / 2), *sc = w13s + e * 2 * I * (H / blk);
            l->gate[e] = nv_mat(I, H, p, sc, (int)blk, sg[e], c->fmt);
            l->up[e] = nv_mat(I, H, p + I * (H / 2), sc + I * (H / blk), (int)blk, su[e], c->fmt);
            l->down[e] = nv_mat(H, I, w2 + e * H * (I / 2), w2s + e * H * (I / blk), (int)blk, sd[e], c->fmt);
        }
    } else {
        uint8_t *gub = owned_copy(l, &t->gate_up_blocks), *gus = owned_copy(l, &t->gate_up_scales);
        uint8_t *db = owned_copy(l, &t->down_blocks), *ds = owned_copy(l, &t->down_scales);
        if (!gub || !gus || !db || !ds) return FM_E_NOMEM;
        fm_io_wire_gptoss(l, 0, 0, gub, 2 * I, H);
        fm_io_wire_gptoss(l, 0, 1, gus, 2 * I, H);
        fm_io_wire_gptoss(l, 2, 0, db, H, I);
        fm_io_wire_gptoss(l, 2, 1, ds, H, I);
        const fm_tensor *bias[2] = {&t->gate_up_bias, &t->down_bias};
        for (int m = 0; m < 2; m++) {
            uint8_t *tmp = fm_malloc(view_bytes(bias[m]));
            if (!tmp) return FM_E_NOMEM;
            gather(bias[m], tmp);
            fm_status s = fm_io_wire_gptoss_bias(l, m ? 2 : 0, tmp, bias[m]->dtype, m ? H : 2 * I);
            free(tmp);
            if (s) return s;
        }
    }
    if (c->has_shared) {
        const fm_tensor *v[3][3] = {{&t->shared_gate, &t->shared_gate_scale, &t->shared_gate_scale_2},
                                    {&t->shared_up, &t->shared_up_scale, &t->shared_up_scale_2},
                                    {&t->shared_down, &t->shared_down_scale, &t->shared_down_scale_2}};
        fm_qmatrix *q[3] = {&l->sh_gate, &l->sh_up, &l->sh_down};
        for (int m = 0; m < 3; m++) {
            uint8_t *p = owned_copy(l, v[m][0]), *sc = owned_copy(l, v[m][1]);
            if (!p || !sc) return FM_E_NOMEM;
            *q[m] = nv_mat(m == 2 ? H : c->SI, m == 2 ? c->SI : H, p, sc, (int)blk, ssh[m], c->fmt);
        }
    }
    if (c->has_router) {
        if (!(l->router_w = f32_copy(l, &t->router_w, E * H))) return FM_E_NOMEM;
        if (present(&t->router_bias) && !(l->router_bias = f32_copy(l, &t->router_bias, E))) return FM_E_NOMEM;
        if (present(&t->score_bias) && !(l->score_bias = f32_copy(l, &t->score_bias, E))) return FM_E_NOMEM;
    }
    return FM_OK;
}

fm_status fm_moe_layer_from_tensors(const fm_model_desc *d, int layer, const fm_layer_tensors *t, fm_moe_layer **out) {
    if (!d || !t || !out) return fm_error(FM_E_ARG, "fm_moe_layer_from_tensors: NULL argument");
    *out = NULL;
    tcheck c;
    fm_status s = check_all(d, layer, t, &c);
    if (s) return s;
    if (!fm_model_is_moe_layer(d, layer))
        return fm_error(FM_E_ARG, "layer %d is not a MoE layer of this %s model (%d layers, first %d dense)", layer,
                        d->family, d->n_layers, d->first_dense);
    char prefix[48];
    snprintf(prefix, sizeof prefix, "layer %d tensors: ", layer);
    if (c.p.n) return report(&c, prefix);
    fm_moe_layer *l = fm_io_layer_new(d, layer, c.fmt);
    if (!l) return FM_E_NOMEM;
    l->inter = (int)c.I;
    l->has_shared = c.has_shared;
    l->shared_inter = c.has_shared ? (int)c.SI : 0;
    s = build(&c, t, l);
    if (!s && c.p.n) s = report(&c, prefix);
    if (s) {
        fm_moe_layer_free(l);
        return s;
    }
    *out = l;
    return FM_OK;
}

/* ----------------------------------------------- device-side repacks */

static fm_status check_layer(const fm_model_desc *d, int layer, const fm_layer_tensors *t, tcheck *c, char *prefix,
                             size_t cap) {
    fm_status s = check_all(d, layer, t, c);
    if (s) return s;
    if (!fm_model_is_moe_layer(d, layer))
        return fm_error(FM_E_ARG, "layer %d is not a MoE layer of this %s model (%d layers, first %d dense)", layer,
                        d->family, d->n_layers, d->first_dense);
    snprintf(prefix, cap, "layer %d tensors: ", layer);
    return c->p.n ? report(c, prefix) : FM_OK;
}

fm_status fm_io_tensors_info_get(const fm_model_desc *d, int layer, const fm_layer_tensors *t, fm_io_tensors_info *out) {
    if (!d || !t || !out) return fm_error(FM_E_ARG, "fm_io_tensors_info_get: NULL argument");
    memset(out, 0, sizeof *out);
    tcheck c;
    char prefix[48];
    fm_status s = check_layer(d, layer, t, &c, prefix, sizeof prefix);
    if (s) return s;
    out->fmt = c.fmt;
    out->blk = c.blk;
    out->E = c.E;
    out->H = c.H;
    out->I = c.I;
    out->SI = c.has_shared ? c.SI : 0;
    out->has_shared = c.has_shared;
    out->has_router = c.has_router;
    return FM_OK;
}

fm_status fm_io_tensors_scale2(const fm_model_desc *d, int layer, const fm_layer_tensors *t, const float *s13,
                               const float *s2, const float *sh_raw, float *gate, float *up, float *down, float *sh) {
    tcheck c;
    char prefix[48];
    fm_status s = check_layer(d, layer, t, &c, prefix, sizeof prefix);
    if (s) return s;
    if (c.fmt != FM_QF_NVFP4) return fm_error(FM_E_ARG, "fm_io_tensors_scale2: not an NVFP4 layout");
    scale2_values(&c, s13, t->w13_weight_scale_2.ndim == 2, s2, sh_raw, gate, up, down, sh);
    return c.p.n ? report(&c, prefix) : FM_OK;
}
