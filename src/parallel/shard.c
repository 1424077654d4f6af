/*
 * How a MoE layer is split over ranks: validation and the zero-copy views
 * each rank computes with.
 *
 * A TP slice over the intermediate dimension needs no copy: gate/up rows
 * [i0, i1) start i0 rows further, down columns [i0, i1) start i0/2 bytes
 * (i0/block scale bytes) further with the same row stride. i0 must fall on
 * a scale block, otherwise a block would straddle two ranks.
 */
#include "parallel/parallel_internal.h"
#include "util/util.h"
#include <stdio.h>
#include <string.h>

static int fmt_granule(fm_qformat f) {
    int b = fm_qformat_block(f);
    return b > 0 ? b : 1; /* BF16: any column split is fine */
}

fm_status fm_dist_check(const fm_model_desc *d, const fm_moe_layer *l, const fm_dist_opts *o) {
    if (!d || !l || !o) return fm_error(FM_E_ARG, "dist: model description, layer and options are required");
    const int R = o->ranks;
    if (R < 1 || R > FM_DIST_MAX_RANKS)
        return fm_error(FM_E_RANGE, "dist: %d ranks (allowed 1..%d)", R, FM_DIST_MAX_RANKS);
    if (o->mode != FM_DIST_TP && o->mode != FM_DIST_EP)
        return fm_error(FM_E_ARG, "dist: unknown parallel mode %d (tp or ep)", (int)o->mode);
    if (o->layout != FM_DIST_REPLICATED && o->layout != FM_DIST_TOKEN_SHARDED)
        return fm_error(FM_E_ARG, "dist: unknown token layout %d", (int)o->layout);
    if (o->compress != FM_COMPRESS_NONE && o->compress != FM_COMPRESS_FP8 && o->compress != FM_COMPRESS_NVFP4)
        return fm_error(FM_E_ARG, "dist: unknown compression %d", (int)o->compress);
    if (l->hidden != d->hidden || l->n_experts != d->n_experts || l->topk != d->topk || l->inter != d->moe_inter)
        return fm_error(FM_E_ARG,
                        "dist: layer (H=%d E=%d k=%d I=%d) does not match the model description (H=%d E=%d k=%d I=%d)",
                        l->hidden, l->n_experts, l->topk, l->inter, d->hidden, d->n_experts, d->topk, d->moe_inter);
    if (l->hidden < 1 || l->n_experts < 1 || l->topk < 1 || l->topk > l->n_experts || l->inter < 1)
        return fm_error(FM_E_RANGE, "dist: layer shape H=%d E=%d k=%d I=%d is out of range", l->hidden,
                        l->n_experts, l->topk, l->inter);
    if (o->compress != FM_COMPRESS_NONE && o->layout != FM_DIST_TOKEN_SHARDED)
        return fm_error(FM_E_ARG,
                        "dist: --comm-compress %s needs the token-sharded layout: with replicated tokens no "
                        "activations are sent",
                        fm_compress_name(o->compress));
    if (o->compress == FM_COMPRESS_NVFP4 && l->hidden % 16 != 0)
        return fm_error(FM_E_ARG, "dist: NVFP4 compression needs H a multiple of 16 (H=%d)", l->hidden);

    const int g = fmt_granule(l->fmt);
    if (o->mode == FM_DIST_TP) {
        if (l->inter % R != 0)
            return fm_error(FM_E_ARG, "TP over %d ranks: expert intermediate size I=%d is not divisible by %d", R,
                            l->inter, R);
        if ((l->inter / R) % g != 0)
            return fm_error(FM_E_ARG,
                            "TP over %d ranks: slice I/R=%d is not a multiple of the %s scale block (%d); a block "
                            "would straddle two ranks",
                            R, l->inter / R, fm_qformat_name(l->fmt), g);
        if (l->has_shared) {
            const int S = l->shared_inter, gs = fmt_granule(l->sh_gate.fmt);
            if (S % R != 0)
                return fm_error(FM_E_ARG, "TP over %d ranks: shared expert width %d is not divisible by %d", R, S, R);
            if ((S / R) % gs != 0)
                return fm_error(FM_E_ARG,
                                "TP over %d ranks: shared slice %d is not a multiple of the %s scale block (%d)", R,
                                S / R, fm_qformat_name(l->sh_gate.fmt), gs);
        }
    } else {
        if (l->n_experts % R != 0)
            return fm_error(FM_E_ARG, "EP over %d ranks: E=%d experts are not divisible by %d", R, l->n_experts, R);
    }
    return FM_OK;
}

static fm_qmatrix slice_rows(const fm_qmatrix *m, int64_t r0, int64_t n) {
    fm_qmatrix v = *m;
    v.rows = n;
    v.packed = m->packed + r0 * m->row_stride;
    if (m->scales) v.scales = m->scales + r0 * m->scale_stride;
    if (m->bias) v.bias = m->bias + r0;
    return v;
}

static fm_qmatrix slice_cols(const fm_qmatrix *m, int64_t c0, int64_t n, int keep_bias) {
    fm_qmatrix v = *m;
    v.cols = n;
    if (m->fmt == FM_QF_BF16) {
        v.packed = m->packed + c0 * 2;
    } else {
        v.packed = m->packed + c0 / 2;
        if (m->scales) v.scales = m->scales + c0 / fm_qformat_block(m->fmt);
    }
    /* The down bias is added once per expert output; ranks sum their
     * partial outputs, so only rank 0 keeps it. */
    if (!keep_bias) v.bias = NULL;
    return v;
}

fm_status fm_dist_tp_view(const fm_model_desc *d, const fm_moe_layer *l, int r, int R, fm_model_desc *dv,
                          fm_moe_layer *lv, fm_qmatrix **arrays) {
    *arrays = NULL;
    const int E = l->n_experts;
    const int64_t n = l->inter / R, i0 = (int64_t)r * n;
    fm_qmatrix *a = fm_calloc((size_t)3 * (size_t)E, sizeof *a);
    if (!a) return FM_E_NOMEM;
    *dv = *d;
    dv->moe_inter = (int)n;
    *lv = *l;
    lv->owned_ = NULL;
    lv->inter = (int)n;
    lv->gate = a;
    lv->up = a + E;
    lv->down = a + 2 * E;
    for (int e = 0; e < E; e++) {
        lv->gate[e] = slice_rows(&l->gate[e], i0, n);
        lv->up[e] = slice_rows(&l->up[e], i0, n);
        lv->down[e] = slice_cols(&l->down[e], i0, n, r == 0);
    }
    if (l->has_shared) {
        const int64_t sn = l->shared_inter / R, s0 = (int64_t)r * sn;
        dv->shared_inter = (int)sn;
        lv->shared_inter = (int)sn;
        lv->sh_gate = slice_rows(&l->sh_gate, s0, sn);
        lv->sh_up = slice_rows(&l->sh_up, s0, sn);
        lv->sh_down = slice_cols(&l->sh_down, s0, sn, r == 0);
    }
    *arrays = a;
    return FM_OK;
}

/* ne experts (gate/up/down: the layer's own matrices) of width inter under
 * softmax routing over them alone, top-k min(k, ne), no shared expert. */
static void plain_view(const fm_model_desc *d, const fm_moe_layer *l, int ne, int moe_inter, int inter,
                       fm_qformat fmt, const fm_qmatrix *gate, const fm_qmatrix *up, const fm_qmatrix *down,
                       const float *zero_router, fm_model_desc *dv, fm_moe_layer *lv) {
    const int k = l->topk < ne ? l->topk : ne;
    *dv = *d;
    dv->n_experts = ne;
    dv->topk = k;
    dv->moe_inter = moe_inter;
    dv->n_shared = 0;
    dv->shared_inter = 0;
    dv->n_group = 1;
    dv->topk_group = 1;
    dv->norm_topk_prob = 1;
    dv->routed_scaling_factor = 1.0f;
    dv->route = FM_ROUTE_SOFTMAX;
    dv->n_hash_layers = 0;

    memset(lv, 0, sizeof *lv);
    lv->layer = l->layer;
    lv->hidden = l->hidden;
    lv->inter = inter;
    lv->n_experts = ne;
    lv->topk = k;
    lv->fmt = fmt;
    /* The view only reads these matrices; the struct's pointers are
     * non-const because owners of real layers write through them. */
    lv->gate = (fm_qmatrix *)gate;
    lv->up = (fm_qmatrix *)up;
    lv->down = (fm_qmatrix *)down;
    lv->router_w = zero_router;
}

void fm_dist_expert_view(const fm_model_desc *d, const fm_moe_layer *l, int e, const float *zero_router,
                         fm_model_desc *dv, fm_moe_layer *lv) {
    if (e < 0)
        plain_view(d, l, 1, l->shared_inter, l->shared_inter, l->sh_gate.fmt, &l->sh_gate, &l->sh_up, &l->sh_down,
                   zero_router, dv, lv);
    else
        plain_view(d, l, 1, d->moe_inter, l->inter, l->gate[e].fmt, &l->gate[e], &l->up[e], &l->down[e],
                   zero_router, dv, lv);
}

void fm_dist_ep_view(const fm_model_desc *d, const fm_moe_layer *l, int e0, int ne, const float *zero_router,
                     fm_model_desc *dv, fm_moe_layer *lv) {
    plain_view(d, l, ne, d->moe_inter, l->inter, l->fmt, l->gate + e0, l->up + e0, l->down + e0, zero_router, dv,
               lv);
}

/* ------------------------------------------------ one rank on one device */

fm_status fm_shard_parse(const char *s, fm_shard *out) {
    if (!s || !out) return fm_error(FM_E_ARG, "--shard: NULL argument");
    memset(out, 0, sizeof *out);
    fm_dist_mode m;
    if (!strncmp(s, "tp:", 3)) m = FM_DIST_TP;
    else if (!strncmp(s, "ep:", 3)) m = FM_DIST_EP;
    else
        return fm_error(FM_E_ARG, "--shard '%s': expected tp:R, tp:R/r or ep:R/r (R ranks, rank r)", s);
    const char *p = s + 3;
    long R = 0, r = -1;
    int nd = 0;
    for (; *p >= '0' && *p <= '9' && nd < 6; p++, nd++) R = R * 10 + (*p - '0');
    if (nd == 0 || nd >= 6)
        return fm_error(FM_E_ARG, "--shard '%s': the rank count R after '%.3s' must be a number", s, s);
    if (*p == '/') {
        p++;
        nd = 0;
        r = 0;
        for (; *p >= '0' && *p <= '9' && nd < 6; p++, nd++) r = r * 10 + (*p - '0');
        if (nd == 0 || nd >= 6) return fm_error(FM_E_ARG, "--shard '%s': the rank r after '/' must be a number", s);
    }
    if (*p) return fm_error(FM_E_ARG, "--shard '%s': unexpected '%s' (expected tp:R, tp:R/r or ep:R/r)", s, p);
    if (R < 1 || R > FM_DIST_MAX_RANKS)
        return fm_error(FM_E_RANGE, "--shard '%s': %ld ranks (allowed 1..%d)", s, R, FM_DIST_MAX_RANKS);
    if (r < 0) {
        if (m == FM_DIST_EP)
            return fm_error(FM_E_ARG, "--shard '%s': EP ranks differ, give the rank: ep:%ld/r with r in 0..%ld", s,
                            R, R - 1);
        r = 0; /* every TP rank has the same shape */
    }
    if (r >= R) return fm_error(FM_E_RANGE, "--shard '%s': rank %ld is not below the rank count %ld", s, r, R);
    out->mode = m;
    out->ranks = (int)R;
    out->rank = (int)r;
    return FM_OK;
}

fm_status fm_shard_desc(const fm_model_desc *d, fm_qformat fmt, const fm_shard *sh, fm_model_desc *out) {
    if (!d || !sh || !out) return fm_error(FM_E_ARG, "fm_shard_desc: NULL argument");
    const int R = sh->ranks;
    if ((sh->mode != FM_DIST_TP && sh->mode != FM_DIST_EP) || R < 1 || R > FM_DIST_MAX_RANKS || sh->rank < 0 ||
        sh->rank >= R)
        return fm_error(FM_E_ARG, "--shard: mode %d, rank %d of %d is not a shard", (int)sh->mode, sh->rank, R);
    if (fmt == FM_QF_NONE) fmt = d->expert_format;
    fm_model_desc v = *d;
    if (sh->mode == FM_DIST_TP) {
        const int g = fmt_granule(fmt);
        if (d->moe_inter % R != 0)
            return fm_error(FM_E_ARG, "--shard tp:%d: expert intermediate size I=%d is not divisible by %d", R,
                            d->moe_inter, R);
        if ((d->moe_inter / R) % g != 0)
            return fm_error(FM_E_ARG,
                            "--shard tp:%d: slice I/R=%d is not a multiple of the %s scale block (%d); a block "
                            "would straddle two ranks",
                            R, d->moe_inter / R, fm_qformat_name(fmt), g);
        if (d->n_shared > 0 && d->shared_inter > 0) {
            if (d->shared_inter % R != 0 || (d->shared_inter / R) % g != 0)
                return fm_error(FM_E_ARG,
                                "--shard tp:%d: shared expert width %d does not split into %d multiples of the %s "
                                "scale block (%d)",
                                R, d->shared_inter, R, fm_qformat_name(fmt), g);
            v.shared_inter = d->shared_inter / R;
        }
        v.moe_inter = d->moe_inter / R;
    } else {
        if (d->n_experts % R != 0)
            return fm_error(FM_E_ARG, "--shard ep:%d/%d: E=%d experts are not divisible by %d", R, sh->rank,
                            d->n_experts, R);
        const int ne = d->n_experts / R;
        v.n_experts = ne;
        v.topk = d->topk < ne ? d->topk : ne;
        /* the rank runs pre-routed: the full router picks; these only keep
         * the description valid */
        v.n_group = 1;
        v.topk_group = 1;
        v.route = d->route == FM_ROUTE_GPTOSS ? FM_ROUTE_GPTOSS : FM_ROUTE_SOFTMAX;
        v.n_hash_layers = 0;
    }
    *out = v;
    return FM_OK;
}

void fm_shard_describe(const fm_shard *sh, const fm_model_desc *full, char *buf, size_t cap) {
    if (!cap) return;
    if (!sh || !full || (sh->mode != FM_DIST_TP && sh->mode != FM_DIST_EP) || sh->ranks < 1) {
        snprintf(buf, cap, "none");
        return;
    }
    const int R = sh->ranks, r = sh->rank;
    if (sh->mode == FM_DIST_TP) {
        if (full->n_shared > 0 && full->shared_inter > 0)
            snprintf(buf, cap, "tp %d rank %d (I %d of %d, shared %d of %d)", R, r, full->moe_inter / R,
                     full->moe_inter, full->shared_inter / R, full->shared_inter);
        else
            snprintf(buf, cap, "tp %d rank %d (I %d of %d)", R, r, full->moe_inter / R, full->moe_inter);
    } else {
        const int ne = full->n_experts / R;
        snprintf(buf, cap, "ep %d rank %d (experts %d..%d of %d%s)", R, r, r * ne, (r + 1) * ne - 1, full->n_experts,
                 full->n_shared > 0 && full->shared_inter > 0 ? "; shared expert on the rank's token chunk" : "");
    }
}

void fm_shard_token_chunk(const fm_shard *sh, int T, int *t0, int *n) {
    const int R = sh && sh->ranks > 0 ? sh->ranks : 1, rank = sh ? sh->rank : 0;
    const int C = (T + R - 1) / R;
    int a = rank * C, b = a + C;
    if (a > T) a = T;
    if (b > T) b = T;
    *t0 = a;
    *n = b - a;
}
