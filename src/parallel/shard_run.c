/*
 * One rank's share computed on one device: the per-rank load of a routing
 * and the rank's output through the CPU engine (bench, profile, tests).
 * The views are the sharded layer's own (shard.c), so that a rank here
 * computes what it computes in src/parallel's split.
 */
#include "io/io_internal.h"
#include "parallel/parallel_internal.h"
#include "util/util.h"
#include <stdio.h>
#include <string.h>

/* Bytes of a [rows x cols] matrix in fmt with its block scales. */
static int64_t mat_bytes(fm_qformat fmt, int64_t rows, int64_t cols) {
    if (fmt == FM_QF_BF16) return rows * cols * 2;
    const int b = fm_qformat_block(fmt);
    return rows * cols / 2 + (b > 0 ? rows * cols / b : 0);
}

/* The rank the step waits for: most bytes, then most pairs, then the
 * lowest index. */
static int max_rank_of(const fm_shard_load *l) {
    int m = 0;
    for (int p = 1; p < l->ranks && p < FM_DIST_MAX_RANKS; p++)
        if (l->bytes[p] > l->bytes[m] || (l->bytes[p] == l->bytes[m] && l->pairs[p] > l->pairs[m])) m = p;
    return m;
}

fm_status fm_shard_load_of(const fm_model_desc *full, fm_qformat fmt, const fm_shard *sh, const int32_t *ids, int T,
                           fm_shard_load *out) {
    if (!full || !sh || !out || (T > 0 && !ids)) return fm_error(FM_E_ARG, "fm_shard_load_of: NULL argument");
    if (fmt == FM_QF_NONE) fmt = full->expert_format;
    fm_model_desc v;
    fm_status s = fm_shard_desc(full, fmt, sh, &v);
    if (s) return s;
    memset(out, 0, sizeof *out);
    const int R = sh->ranks, E = full->n_experts, k = full->topk, H = full->hidden;
    out->ranks = R;
    out->router_bytes = (int64_t)E * H * 4;
    unsigned char *hit = fm_calloc((size_t)E, 1);
    if (!hit) return FM_E_NOMEM;
    int64_t pairs_all = 0;
    for (int64_t i = 0; i < (int64_t)T * k; i++) {
        const int e = ids[i];
        if (e < 0 || e >= E) continue;
        pairs_all++;
        hit[e] = 1;
        if (sh->mode == FM_DIST_EP) out->pairs[e / v.n_experts]++;
    }
    const int has_sh = full->n_shared > 0 && full->shared_inter > 0;
    if (sh->mode == FM_DIST_TP) {
        int act = 0;
        for (int e = 0; e < E; e++) act += hit[e];
        const int64_t eb = 3 * mat_bytes(fmt, v.moe_inter, H);
        const int64_t sb = has_sh ? 3 * mat_bytes(fmt, v.shared_inter, H) : 0;
        for (int p = 0; p < R; p++) { /* every rank computes every pair's slice */
            out->pairs[p] = pairs_all;
            out->active[p] = act;
            out->bytes[p] = act * eb + sb;
        }
    } else {
        const int64_t eb = 3 * mat_bytes(fmt, full->moe_inter, H);
        const int64_t sb = has_sh ? 3 * mat_bytes(fmt, full->shared_inter, H) : 0;
        for (int e = 0; e < E; e++) out->active[e / v.n_experts] += hit[e];
        for (int p = 0; p < R; p++) {
            fm_shard sp = {FM_DIST_EP, R, p};
            int t0, n;
            fm_shard_token_chunk(&sp, T, &t0, &n);
            out->bytes[p] = out->active[p] * eb + (n > 0 ? sb : 0);
        }
    }
    free(hit);
    out->max_rank = max_rank_of(out);
    return FM_OK;
}

void fm_shard_load_add(fm_shard_load *sum, const fm_shard_load *ld) {
    if (!sum || !ld) return;
    if (sum->ranks == 0) sum->ranks = ld->ranks;
    sum->router_bytes = ld->router_bytes;
    for (int p = 0; p < ld->ranks && p < FM_DIST_MAX_RANKS; p++) {
        sum->pairs[p] += ld->pairs[p];
        sum->active[p] += ld->active[p];
        sum->bytes[p] += ld->bytes[p];
    }
    sum->max_rank = max_rank_of(sum);
}

int64_t fm_shard_local_ids(const fm_shard *sh, int E, int k, int T, const int32_t *ids, const float *w, int kl,
                           int32_t *lids, float *lw) {
    const int ne = E / sh->ranks, e0 = sh->rank * ne;
    int64_t pairs = 0;
    for (int t = 0; t < T; t++) {
        int j = 0;
        for (int q = 0; q < k; q++) {
            const int e = ids[(size_t)t * k + q];
            if (e < e0 || e >= e0 + ne || j >= kl) continue;
            lids[(size_t)t * kl + j] = e - e0;
            lw[(size_t)t * kl + j] = w[(size_t)t * k + q];
            j++;
            pairs++;
        }
        for (; j < kl; j++) {
            lids[(size_t)t * kl + j] = -1;
            lw[(size_t)t * kl + j] = 0.0f;
        }
    }
    return pairs;
}

void fm_shard_ep_view(const fm_model_desc *d, const fm_moe_layer *l, const fm_shard *sh, const float *zero_router,
                      fm_model_desc *dv, fm_moe_layer *lv) {
    const int ne = l->n_experts / sh->ranks;
    fm_dist_ep_view(d, l, sh->rank * ne, ne, zero_router, dv, lv);
    dv->n_shared = d->n_shared;
    dv->shared_inter = d->shared_inter;
    lv->has_shared = l->has_shared;
    lv->shared_inter = l->shared_inter;
    lv->sh_gate = l->sh_gate;
    lv->sh_up = l->sh_up;
    lv->sh_down = l->sh_down;
}

void fm_shard_ep_work_free(fm_shard_ep_work *w) {
    if (!w) return;
    free(w->zero_router);
    free(w->lids);
    free(w->lw);
    free(w->none);
    free(w->w0);
    free(w->y);
    memset(w, 0, sizeof *w);
}

fm_status fm_shard_ep_work_init(fm_shard_ep_work *w, const fm_model_desc *d, const fm_shard *sh, int T) {
    memset(w, 0, sizeof *w);
    if (!d || !sh || sh->mode != FM_DIST_EP || sh->ranks < 1 || d->n_experts % sh->ranks || T < 1)
        return fm_error(FM_E_ARG, "fm_shard_ep_work_init: bad argument");
    const int H = d->hidden, ne = d->n_experts / sh->ranks, kl = d->topk < ne ? d->topk : ne;
    const int C = (T + sh->ranks - 1) / sh->ranks;
    w->T = T;
    w->kl = kl;
    w->zero_router = fm_calloc((size_t)ne * H, sizeof(float));
    w->lids = fm_calloc((size_t)T * kl, sizeof(int32_t));
    w->lw = fm_calloc((size_t)T * kl, sizeof(float));
    w->none = fm_malloc((size_t)C * kl * sizeof(int32_t));
    w->w0 = fm_calloc((size_t)C * kl, sizeof(float));
    w->y = fm_calloc((size_t)C * H, sizeof(float));
    if (!w->zero_router || !w->lids || !w->lw || !w->none || !w->w0 || !w->y) {
        fm_shard_ep_work_free(w);
        return FM_E_NOMEM;
    }
    for (size_t i = 0; i < (size_t)C * kl; i++) w->none[i] = -1; /* no routed expert: the shared call */
    return FM_OK;
}

fm_status fm_shard_ep_run_cpu(fm_cpu_engine *e, const fm_model_desc *d, const fm_moe_layer *l, const fm_shard *sh,
                              const float *x, int T, const int32_t *lids, const float *lw, fm_shard_ep_work *w,
                              float *out) {
    if (!w || T > w->T) return fm_error(FM_E_ARG, "fm_shard_ep_run_cpu: work buffers for %d tokens, not %d", w ? w->T : 0, T);
    const int H = l->hidden;
    fm_model_desc dv;
    fm_moe_layer lv;
    fm_shard_ep_view(d, l, sh, w->zero_router, &dv, &lv);
    fm_status s = fm_cpu_experts(e, &dv, &lv, x, FM_DT_F32, T, lids, lw, 0, out);
    int t0, n;
    fm_shard_token_chunk(sh, T, &t0, &n);
    if (s || !l->has_shared || n == 0) return s;
    /* replicated, data-parallel: the shared expert on the rank's own chunk */
    if ((s = fm_cpu_experts(e, &dv, &lv, x + (size_t)t0 * H, FM_DT_F32, n, w->none, w->w0, 1, w->y))) return s;
    for (size_t i = 0; i < (size_t)n * H; i++) out[(size_t)t0 * H + i] += w->y[i];
    return FM_OK;
}

static fm_status ep_forward(fm_cpu_engine *e, const fm_model_desc *d, const fm_moe_layer *l, const fm_shard *sh,
                            const float *xf, int T, const int32_t *tid, float *out, int32_t *ids, float *w) {
    fm_status s = fm_route(d, l, xf, T, tid, ids, w);
    if (s) return s;
    fm_shard_ep_work wk;
    if ((s = fm_shard_ep_work_init(&wk, d, sh, T))) return s;
    fm_shard_local_ids(sh, l->n_experts, l->topk, T, ids, w, wk.kl, wk.lids, wk.lw);
    s = fm_shard_ep_run_cpu(e, d, l, sh, xf, T, wk.lids, wk.lw, &wk, out);
    fm_shard_ep_work_free(&wk);
    return s;
}

fm_status fm_shard_forward_cpu(fm_cpu_engine *e, const fm_model_desc *d, const fm_moe_layer *l, const fm_shard *sh,
                               const void *x, fm_dtype xdt, int T, const int32_t *token_ids, float *out,
                               int32_t *ids, float *weights, fm_shard_load *load) {
    if (!e || !d || !l || !sh || !x || !out || T < 1) return fm_error(FM_E_ARG, "fm_shard_forward_cpu: bad argument");
    fm_model_desc v;
    fm_status s = fm_shard_desc(d, l->fmt, sh, &v);
    if (s) return s;
    const int H = l->hidden, k = l->topk;
    int32_t *id = ids ? ids : fm_calloc((size_t)T * k, sizeof(int32_t));
    float *w = weights ? weights : fm_calloc((size_t)T * k, sizeof(float));
    float *xf = fm_calloc((size_t)T * H, sizeof(float));
    if (!id || !w || !xf) {
        s = FM_E_NOMEM;
        goto done;
    }
    for (int t = 0; t < T && !s; t++) s = fm_dist_row_f32(x, xdt, H, t, xf + (size_t)t * H);
    if (s) goto done;
    if (sh->mode == FM_DIST_TP) {
        fm_model_desc dv;
        fm_moe_layer lv;
        fm_qmatrix *arrays = NULL;
        if ((s = fm_dist_tp_view(d, l, sh->rank, sh->ranks, &dv, &lv, &arrays))) goto done;
        fm_moe_out o = {out, id, w};
        s = fm_cpu_forward(e, &dv, &lv, xf, FM_DT_F32, T, token_ids, &o);
        free(arrays);
    } else {
        s = ep_forward(e, d, l, sh, xf, T, token_ids, out, id, w);
    }
    if (!s && load) s = fm_shard_load_of(d, l->fmt, sh, id, T, load);
done:
    if (id != ids) free(id);
    if (w != weights) free(w);
    free(xf);
    return s;
}

fm_status fm_shard_tp_layer(const fm_model_desc *d, fm_moe_layer **full, const fm_shard *sh, fm_model_desc *dv,
                            fm_moe_layer **out) {
    if (!d || !full || !*full || !sh || !out || sh->mode != FM_DIST_TP)
        return fm_error(FM_E_ARG, "fm_shard_tp_layer: bad argument");
    *out = NULL;
    fm_model_desc v;
    fm_status s = fm_shard_desc(d, (*full)->fmt, sh, &v);
    if (s) return s;
    fm_moe_layer *l = fm_io_layer_new(&v, (*full)->layer, (*full)->fmt), lv;
    if (!l) return FM_E_NOMEM;
    fm_qmatrix *arrays = NULL;
    fm_model_desc dd;
    if ((s = fm_dist_tp_view(d, *full, sh->rank, sh->ranks, &dd, &lv, &arrays))) {
        fm_moe_layer_free(l);
        return s;
    }
    const int E = lv.n_experts;
    memcpy(l->gate, lv.gate, sizeof(fm_qmatrix) * (size_t)E);
    memcpy(l->up, lv.up, sizeof(fm_qmatrix) * (size_t)E);
    memcpy(l->down, lv.down, sizeof(fm_qmatrix) * (size_t)E);
    free(arrays);
    void *owned = l->owned_;
    fm_qmatrix *g = l->gate, *u = l->up, *dn = l->down;
    *l = lv;
    l->owned_ = owned;
    l->gate = g;
    l->up = u;
    l->down = dn;
    if ((s = fm_io_layer_adopt(l, *full))) {
        fm_moe_layer_free(l);
        return s;
    }
    *full = NULL;
    if (dv) *dv = dd;
    *out = l;
    return FM_OK;
}
