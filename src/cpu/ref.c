/*
 * The float64 reference the tests hold the fast engines to: every weight is
 * dequantized in double (fm_qmatrix_dequant_row_f64), every product, sum and
 * activation is computed in double, and the output is rounded to float once
 * at the end. Routing is fm_route (FP32, as the models compute it), so the
 * reference and the engines choose the same experts. Written for clarity,
 * not speed: each expert's rows are dequantized once per call and applied
 * to the tokens routed to it.
 */
#include <math.h>
#include <string.h>

#include "cpu/cpu_internal.h"
#include "util/util.h"

static double act_f64(fm_act_kind act, double g, double u, double alpha, double limit) {
    if (act == FM_ACT_GPTOSS) {
        if (g > limit) g = limit;
        if (u > limit) u = limit;
        else if (u < -limit) u = -limit;
        return g / (1.0 + exp(-alpha * g)) * (u + 1.0);
    }
    if (limit > 0.0) { /* DeepSeek-V4: clamped SiLU-gated (swiglu_limit) */
        if (g > limit) g = limit;
        if (u > limit) u = limit;
        else if (u < -limit) u = -limit;
    }
    return g / (1.0 + exp(-g)) * u;
}

/* acc[t] += w[t] * down(act(gate x_t, up x_t)) for the n tokens listed. */
static fm_status expert_f64(const fm_model_desc *d, const fm_qmatrix *g, const fm_qmatrix *u,
                            const fm_qmatrix *dn, const double *x, int64_t H, const int *toks,
                            const double *w, int n, double *acc) {
    const int64_t I = g->rows;
    double *row = fm_malloc(sizeof(double) * (size_t)(H > I ? H : I));
    double *hg = fm_malloc(sizeof(double) * (size_t)(n * I));
    double *hu = fm_malloc(sizeof(double) * (size_t)(n * I));
    if (!row || !hg || !hu) { free(row); free(hg); free(hu); return FM_E_NOMEM; }
    for (int pass = 0; pass < 2; pass++) {
        const fm_qmatrix *m = pass ? u : g;
        double *hh = pass ? hu : hg;
        for (int64_t r = 0; r < I; r++) {
            fm_qmatrix_dequant_row_f64(m, r, row);
            double b = m->bias ? (double)m->bias[r] : 0.0;
            for (int i = 0; i < n; i++) {
                const double *xt = x + (int64_t)toks[i] * H;
                double s = 0.0;
                for (int64_t c = 0; c < H; c++) s += row[c] * xt[c];
                hh[(int64_t)i * I + r] = s + b;
            }
        }
    }
    for (int64_t q = 0; q < n * I; q++)
        hg[q] = act_f64(d->act, hg[q], hu[q], (double)d->swiglu_alpha, (double)d->swiglu_limit);
    for (int64_t r = 0; r < H; r++) {
        fm_qmatrix_dequant_row_f64(dn, r, row);
        double b = dn->bias ? (double)dn->bias[r] : 0.0;
        for (int i = 0; i < n; i++) {
            const double *ht = hg + (int64_t)i * I;
            double s = 0.0;
            for (int64_t c = 0; c < I; c++) s += row[c] * ht[c];
            acc[(int64_t)toks[i] * H + r] += w[i] * (s + b);
        }
    }
    free(row);
    free(hg);
    free(hu);
    return FM_OK;
}

fm_status fm_moe_forward_ref(const fm_model_desc *d, const fm_moe_layer *l, const void *x, fm_dtype xdt,
                             int T, const int32_t *token_ids, fm_moe_out *o) {
    if (!o || !o->out) return fm_error(FM_E_ARG, "fm_moe_forward_ref: output is NULL");
    if (T < 0) return fm_error(FM_E_ARG, "fm_moe_forward_ref: negative token count %d", T);
    fm_status st = fm_cpu_check_layer(d, l);
    if (st) return st;
    if (T == 0) return FM_OK;
    if (!x) return fm_error(FM_E_ARG, "fm_moe_forward_ref: input is NULL");
    const int64_t H = l->hidden;
    const int k = l->topk, E = l->n_experts;
    const int64_t TH = (int64_t)T * H;
    float *xf = fm_malloc(sizeof(float) * (size_t)TH);
    double *xd = fm_malloc(sizeof(double) * (size_t)TH);
    double *acc = fm_calloc((size_t)TH, sizeof(double));
    int32_t *ids = fm_malloc(sizeof(int32_t) * (size_t)T * (size_t)k);
    float *wt = fm_malloc(sizeof(float) * (size_t)T * (size_t)k);
    int *toks = fm_malloc(sizeof(int) * (size_t)T);
    double *tw = fm_malloc(sizeof(double) * (size_t)T);
    if (!xf || !xd || !acc || !ids || !wt || !toks || !tw) { st = FM_E_NOMEM; goto done; }
    st = fm_cpu_load_x(x, xdt, T, H, xf);
    if (st) goto done;
    for (int64_t i = 0; i < TH; i++) xd[i] = xf[i];
    st = fm_route(d, l, xf, T, token_ids, ids, wt);
    if (st) goto done;
    /* Routed experts in ascending order, then the shared expert. */
    for (int e = 0; e < E && !st; e++) {
        int n = 0;
        for (int t = 0; t < T; t++)
            for (int q = 0; q < k; q++)
                if (ids[(int64_t)t * k + q] == e) { toks[n] = t; tw[n] = wt[(int64_t)t * k + q]; n++; }
        if (n) st = expert_f64(d, &l->gate[e], &l->up[e], &l->down[e], xd, H, toks, tw, n, acc);
    }
    if (!st && l->has_shared) {
        for (int t = 0; t < T; t++) { toks[t] = t; tw[t] = 1.0; }
        st = expert_f64(d, &l->sh_gate, &l->sh_up, &l->sh_down, xd, H, toks, tw, T, acc);
    }
    if (st) goto done;
    for (int64_t i = 0; i < TH; i++) o->out[i] = (float)acc[i];
    if ((st = fm_check_out_finite(l->layer, "reference output", o->out, T, H))) goto done;
    if (o->topk_ids) memcpy(o->topk_ids, ids, sizeof(int32_t) * (size_t)T * (size_t)k);
    if (o->topk_weights) memcpy(o->topk_weights, wt, sizeof(float) * (size_t)T * (size_t)k);
done:
    free(xf);
    free(xd);
    free(acc);
    free(ids);
    free(wt);
    free(toks);
    free(tw);
    return st;
}
