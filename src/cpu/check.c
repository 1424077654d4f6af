/* Validation and input conversion shared by the reference and the fast
 * engine: a layer is checked once per call, before any kernel reads it. */
#include <math.h>
#include <string.h>

#include "cpu/cpu_internal.h"
#include "route/route.h"
#include "util/util.h"

static fm_status check_mat(const fm_qmatrix *m, int layer, const char *expert, const char *what,
                           int64_t rows, int64_t cols, fm_qformat f) {
    if (m->fmt != f)
        return fm_error(FM_E_FORMAT, "layer %d, %s %s: format %s, the layer's is %s", layer, expert, what,
                        fm_qformat_name(m->fmt), fm_qformat_name(f));
    if (m->rows != rows || m->cols != cols)
        return fm_error(FM_E_FORMAT, "layer %d, %s %s: shape [%lld, %lld], expected [%lld, %lld]", layer,
                        expert, what, (long long)m->rows, (long long)m->cols, (long long)rows,
                        (long long)cols);
    if (!m->packed)
        return fm_error(FM_E_ARG, "layer %d, %s %s: no weight data", layer, expert, what);
    if (f == FM_QF_BF16) {
        if (m->row_stride < 2 * cols)
            return fm_error(FM_E_FORMAT, "layer %d, %s %s: row stride %lld bytes < %lld", layer, expert,
                            what, (long long)m->row_stride, (long long)(2 * cols));
        return FM_OK;
    }
    int blk = fm_qformat_block(f);
    if (!m->scales)
        return fm_error(FM_E_ARG, "layer %d, %s %s: no block scales", layer, expert, what);
    if (m->row_stride < cols / 2 || m->scale_stride < cols / blk)
        return fm_error(FM_E_FORMAT, "layer %d, %s %s: strides %lld/%lld bytes too small for %lld columns",
                        layer, expert, what, (long long)m->row_stride, (long long)m->scale_stride,
                        (long long)cols);
    if (f == FM_QF_NVFP4 && !isfinite(m->scale2))
        return fm_error(FM_E_NUMERIC, "layer %d, %s %s: weight_scale_2 is %g", layer, expert, what,
                        (double)m->scale2);
    return FM_OK;
}

static fm_status check_expert(const fm_moe_layer *l, const char *name, const fm_qmatrix *g,
                              const fm_qmatrix *u, const fm_qmatrix *dn, int64_t inter) {
    const int64_t H = l->hidden;
    fm_status st = check_mat(g, l->layer, name, "gate_proj", inter, H, l->fmt);
    if (!st) st = check_mat(u, l->layer, name, "up_proj", inter, H, l->fmt);
    if (!st) st = check_mat(dn, l->layer, name, "down_proj", H, inter, l->fmt);
    return st;
}

fm_status fm_cpu_check_layer(const fm_model_desc *d, const fm_moe_layer *l) {
    fm_status st = fm_route_check(d, l);
    return st ? st : fm_cpu_check_experts(d, l);
}

fm_status fm_cpu_check_experts(const fm_model_desc *d, const fm_moe_layer *l) {
    if (!d || !l) return fm_error(FM_E_ARG, "experts: model description or layer is NULL");
    if (l->n_experts < 1 || l->topk < 1 || l->hidden < 1)
        return fm_error(FM_E_RANGE, "layer %d: %d experts, top-k %d, hidden %d", l->layer, l->n_experts, l->topk,
                        l->hidden);
    if (d->n_experts != l->n_experts || d->topk != l->topk || d->hidden != l->hidden)
        return fm_error(FM_E_ARG,
                        "layer %d: layer (E=%d, k=%d, H=%d) does not match the model description "
                        "(E=%d, k=%d, H=%d)",
                        l->layer, l->n_experts, l->topk, l->hidden, d->n_experts, d->topk, d->hidden);
    fm_status st;
    if (l->fmt != FM_QF_NVFP4 && l->fmt != FM_QF_MXFP4 && l->fmt != FM_QF_BF16)
        return fm_error(FM_E_UNSUPPORTED, "layer %d: expert format %s is not supported", l->layer,
                        fm_qformat_name(l->fmt));
    if (d->act != FM_ACT_SILU && d->act != FM_ACT_GPTOSS)
        return fm_error(FM_E_ARG, "unknown activation kind %d", (int)d->act);
    /* The kernels work on 16-element units (and MXFP4's 32-blocks). */
    const int64_t unit = l->fmt == FM_QF_MXFP4 ? 32 : 16;
    if (l->hidden % unit || l->inter < 1 || l->inter % unit)
        return fm_error(FM_E_UNSUPPORTED, "layer %d: hidden %d and intermediate %d must be multiples of %lld",
                        l->layer, l->hidden, l->inter, (long long)unit);
    if (!l->gate || !l->up || !l->down)
        return fm_error(FM_E_ARG, "layer %d: expert matrices missing", l->layer);
    for (int e = 0; e < l->n_experts; e++) {
        char name[32];
        snprintf(name, sizeof name, "expert %d", e);
        st = check_expert(l, name, &l->gate[e], &l->up[e], &l->down[e], l->inter);
        if (st) return st;
    }
    if (l->has_shared) {
        if (l->shared_inter < 1 || l->shared_inter % unit)
            return fm_error(FM_E_UNSUPPORTED, "layer %d: shared intermediate %d must be a multiple of %lld",
                            l->layer, l->shared_inter, (long long)unit);
        st = check_expert(l, "shared expert", &l->sh_gate, &l->sh_up, &l->sh_down, l->shared_inter);
        if (st) return st;
    }
    return FM_OK;
}

fm_status fm_cpu_load_x(const void *x, fm_dtype xdt, int T, int64_t H, float *out) {
    const uint8_t *p = x;
    const int64_t n = (int64_t)T * H;
    switch (xdt) {
    case FM_DT_F32: memcpy(out, p, sizeof(float) * (size_t)n); break;
    case FM_DT_BF16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            out[i] = fm_bf16_to_f32(h);
        }
        break;
    case FM_DT_F16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            out[i] = fm_f16_to_f32(h);
        }
        break;
    default:
        return fm_error(FM_E_ARG, "activations must be F32, BF16 or F16, not %s", fm_dtype_name(xdt));
    }
    return fm_check_x_finite(out, FM_DT_F32, T, H);
}

fm_status fm_check_x_finite(const void *x, fm_dtype xdt, int T, int64_t H) {
    const uint8_t *p = x;
    for (int64_t i = 0; i < (int64_t)T * H; i++) {
        float v;
        if (xdt == FM_DT_F32) {
            memcpy(&v, p + 4 * i, 4);
        } else {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            v = xdt == FM_DT_BF16 ? fm_bf16_to_f32(h) : fm_f16_to_f32(h);
        }
        if (!isfinite(v))
            return fm_error(FM_E_NUMERIC, "input token %lld, feature %lld is %g", (long long)(i / H),
                            (long long)(i % H), (double)v);
    }
    return FM_OK;
}

fm_status fm_check_out_finite(int layer, const char *what, const float *out, int T, int64_t H) {
    for (int64_t i = 0; i < (int64_t)T * H; i++)
        if (!isfinite(out[i]))
            return fm_error(FM_E_NUMERIC, "layer %d: %s token %lld, feature %lld is %g (weights or scales not finite?)",
                            layer, what, (long long)(i / H), (long long)(i % H), (double)out[i]);
    return FM_OK;
}

int64_t fm_cpu_bytes_read(const fm_moe_layer *l, const int32_t *ids, int T, int *n_active) {
    int64_t bytes = (int64_t)l->n_experts * l->hidden * (int64_t)sizeof(float); /* router */
    int active = 0;
    for (int e = 0; e < l->n_experts; e++) {
        int used = 0;
        for (int64_t i = 0; i < (int64_t)T * l->topk && !used; i++) used = ids[i] == e;
        if (!used) continue;
        active++;
        bytes += fm_qmatrix_bytes(&l->gate[e]) + fm_qmatrix_bytes(&l->up[e]) + fm_qmatrix_bytes(&l->down[e]);
    }
    if (l->has_shared)
        bytes += fm_qmatrix_bytes(&l->sh_gate) + fm_qmatrix_bytes(&l->sh_up) + fm_qmatrix_bytes(&l->sh_down);
    if (n_active) *n_active = active;
    return bytes;
}
