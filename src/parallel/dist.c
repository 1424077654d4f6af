/*
 * The sharded MoE layer: per-rank views, the per-rank computation and the
 * combine, written once over fm_comm so that the simulated ranks of CI and
 * the NCCL ranks run the same code.
 *
 * TP (every rank computes a slice of every expert):
 *   replicated:     forward(slice, all T) -> all-reduce
 *   token-sharded:  encode own chunk -> all-gather -> decode -> forward(slice,
 *                   all T) -> reduce-scatter (each rank gets its chunk)
 * EP (every rank computes the pairs of its experts):
 *   replicated:     route all T -> own pairs + shared on own chunk -> all-reduce
 *   token-sharded:  route own chunk -> dispatch records (token, slots,
 *                   weights, encoded row) to expert owners (all-to-all) ->
 *                   own pairs -> outputs back (all-to-all) -> add + shared
 *
 * Routing is replicated: each rank runs the full router (over all E) on the
 * tokens it holds, so every rank agrees on which pairs exist. A rank computes
 * its pairs in one pre-routed experts call per step on a view of its experts
 * (fm_dist_ep_view; under TP token-sharded, the slice itself), with the
 * global ids mapped to the view's and the others -1.
 */
#include "parallel/parallel_internal.h"
#include "util/util.h"
#include <math.h>
#include <stdio.h>
#include <string.h>

/* -------------------------------------------------------------- lifetime */

void fm_dist_free(fm_dist *ds) {
    if (!ds) return;
    if (ds->rs) {
        for (int i = 0; i < ds->nloc; i++) {
            rank_state *r = &ds->rs[i];
            if (ds->ex.release) {
                if (r->htp) ds->ex.release(ds->ex.ctx, i, r->htp);
                if (r->hep) ds->ex.release(ds->ex.ctx, i, r->hep);
                if (r->hsh) ds->ex.release(ds->ex.ctx, i, r->hsh);
            }
            free(r->arrays);
        }
    }
    if (ds->hfull && ds->ex.release) ds->ex.release(ds->ex.ctx, 0, ds->hfull);
    if (ds->ex.destroy) ds->ex.destroy(ds->ex.ctx);
    free(ds->rs);
    free(ds->zero_router);
    free(ds);
}

const char *fm_dist_describe(const fm_dist *ds) { return ds ? ds->desc : "(none)"; }

static void *alloc_array(size_t n, size_t sz, const char *what);

static fm_status prepare(fm_dist *ds, int i, const fm_model_desc *d, const fm_moe_layer *v, void **h) {
    *h = NULL;
    if (!ds->ex.prepare) return FM_OK;
    return ds->ex.prepare(ds->ex.ctx, i, d, v, h);
}

fm_status fm_dist_new_exec(const fm_model_desc *d, const fm_moe_layer *l, const fm_dist_opts *o, fm_comm *c,
                           fm_dist_exec exec, fm_dist **out) {
    *out = NULL;
    fm_dist *ds = fm_calloc(1, sizeof *ds);
    if (!ds) {
        if (exec.destroy) exec.destroy(exec.ctx);
        return FM_E_NOMEM;
    }
    ds->ex = exec;
    fm_status s = fm_dist_check(d, l, o);
    if (s) goto fail;
    if (!c) {
        s = fm_error(FM_E_ARG, "dist: no communicator");
        goto fail;
    }
    if (fm_comm_size(c) != o->ranks) {
        s = fm_error(FM_E_ARG, "dist: the communicator has %d ranks but --%s asks for %d", fm_comm_size(c),
                     fm_dist_mode_name(o->mode), o->ranks);
        goto fail;
    }
    if (!exec.forward || !exec.route || !exec.experts) {
        s = fm_error(FM_E_ARG, "dist: engine '%s' lacks forward, route or experts", exec.name ? exec.name : "?");
        goto fail;
    }
    ds->d = d;
    ds->l = l;
    ds->o = *o;
    ds->c = c;
    ds->R = o->ranks;
    ds->nloc = fm_comm_local_count(c);
    ds->rs = fm_calloc((size_t)ds->nloc, sizeof *ds->rs);
    const int ne = o->mode == FM_DIST_EP ? l->n_experts / ds->R : 1;
    ds->zero_router = alloc_array((size_t)ne * (size_t)l->hidden, sizeof(float), "view router");
    if (!ds->rs || !ds->zero_router) {
        s = FM_E_NOMEM;
        goto fail;
    }
    for (int i = 0; i < ds->nloc; i++) {
        rank_state *r = &ds->rs[i];
        r->rank = fm_comm_local_rank(c, i);
        if (o->mode == FM_DIST_TP) {
            /* replicated: one normal forward of the slice (routing inside
             * the engine); token-sharded: the token owners route, and the
             * slice's experts run on the gathered routing */
            if ((s = fm_dist_tp_view(d, l, r->rank, ds->R, &r->dtp, &r->ltp, &r->arrays))) goto fail;
            if ((s = prepare(ds, i, &r->dtp, &r->ltp, &r->htp))) goto fail;
            continue;
        }
        r->ne = ne;
        r->e0 = r->rank * ne;
        fm_dist_ep_view(d, l, r->e0, ne, ds->zero_router, &r->dep, &r->lep);
        if ((s = prepare(ds, i, &r->dep, &r->lep, &r->hep))) goto fail;
        if (l->has_shared) {
            fm_dist_expert_view(d, l, -1, ds->zero_router, &ds->dsh, &r->lsh);
            if ((s = prepare(ds, i, &ds->dsh, &r->lsh, &r->hsh))) goto fail;
        }
    }
    snprintf(ds->desc, sizeof ds->desc, "%s%d, %s tokens%s%s, %s, engine %s", fm_dist_mode_name(o->mode), o->ranks,
             fm_dist_layout_name(o->layout), o->compress ? ", activations sent as " : "",
             o->compress ? fm_compress_name(o->compress) : "", fm_comm_describe(c), exec.name ? exec.name : "?");
    *out = ds;
    return FM_OK;
fail:
    fm_dist_free(ds);
    return s;
}

/* ---------------------------------------------------------------- helpers */

static fm_status exec_forward(fm_dist *ds, int i, void *h, const fm_model_desc *d, const fm_moe_layer *v,
                              const void *x, fm_dtype xdt, int T, const int32_t *tid, float *out, int32_t *ids,
                              float *w) {
    fm_moe_out oo = {.out = out, .topk_ids = ids, .topk_weights = w};
    return ds->ex.forward(ds->ex.ctx, i, h, d, v, x, xdt, T, tid, &oo);
}

/* Converts rows [t0, t0+n) of x to F32. */
static fm_status rows_f32(const void *x, fm_dtype xdt, int H, int64_t t0, int64_t n, float *dst) {
    for (int64_t t = 0; t < n; t++) {
        fm_status s = fm_dist_row_f32(x, xdt, H, t0 + t, dst + t * H);
        if (s) return s;
    }
    return FM_OK;
}

static void *alloc_array(size_t n, size_t sz, const char *what) {
    uint64_t b;
    if (!fm_mul_ok(n, sz, &b) || b > SIZE_MAX) {
        fm_error(FM_E_RANGE, "dist: %s: %zu x %zu bytes overflows", what, n, sz);
        return NULL;
    }
    return fm_calloc(n ? n : 1, sz);
}

/*
 * The routed pairs of one rank over n token rows, in one experts call on
 * the prepared view v (experts [e0, e0 + v->n_experts) of the layer): each
 * slot (row, s) whose expert ids[row*k+s] lies in the view's block goes to
 * the engine as the view's id, packed into the view's top-k, and rows
 * without such a slot stay out of the call. acc[row] += the result. shared:
 * the view's shared expert on every row as well (TP's slice). Returns pair
 * and active-expert counts.
 */
static fm_status ep_compute(fm_dist *ds, int i, void *h, const fm_model_desc *dv, const fm_moe_layer *v, int e0,
                            const float *x, int n, const int32_t *ids, const float *w, int shared, float *acc,
                            int64_t *pairs, int *active) {
    const int k = ds->l->topk, H = ds->l->hidden, E = ds->l->n_experts;
    const int ne = v->n_experts, kv = v->topk;
    shared = shared && v->has_shared;
    fm_status s = FM_OK;
    *pairs = 0;
    *active = 0;
    unsigned char *seen = alloc_array((size_t)ne, 1, "expert mask");
    int *row = alloc_array((size_t)n, sizeof(int), "row list");
    int32_t *lid = alloc_array((size_t)n * (size_t)kv, sizeof(int32_t), "local ids");
    float *lw = alloc_array((size_t)n * (size_t)kv, sizeof(float), "local weights");
    float *xb = NULL, *yb = NULL;
    if (!seen || !row || !lid || !lw) {
        s = FM_E_NOMEM;
        goto done;
    }
    int m = 0;
    for (int t = 0; t < n; t++) {
        int32_t *li = lid + (size_t)m * kv;
        float *lwt = lw + (size_t)m * kv;
        int c = 0;
        for (int j = 0; j < k; j++) {
            const int e = ids[(size_t)t * k + j];
            if (e < -1 || e >= E) {
                s = fm_error(FM_E_RANGE, "dist: routing gave expert id %d for token row %d (E=%d)", e, t, E);
                goto done;
            }
            if (e < e0 || e >= e0 + ne) continue;
            if (c == kv) { /* only repeated ids put more than min(k, ne) slots on one rank */
                s = fm_error(FM_E_RANGE, "dist: token row %d has more than %d slots on experts [%d, %d)", t, kv, e0,
                             e0 + ne);
                goto done;
            }
            li[c] = e - e0;
            lwt[c++] = w[(size_t)t * k + j];
            if (!seen[e - e0]) {
                seen[e - e0] = 1;
                (*active)++;
            }
        }
        *pairs += c;
        if (!c && !shared) continue;
        for (; c < kv; c++) {
            li[c] = -1;
            lwt[c] = 0.0f;
        }
        row[m++] = t;
    }
    if (!m) goto done;
    const float *xin = x;
    if (m < n) { /* only the rows with work */
        if (!(xb = alloc_array((size_t)m * (size_t)H, sizeof(float), "expert batch"))) {
            s = FM_E_NOMEM;
            goto done;
        }
        for (int q = 0; q < m; q++) memcpy(xb + (size_t)q * H, x + (size_t)row[q] * H, (size_t)H * sizeof(float));
        xin = xb;
    }
    if (!(yb = alloc_array((size_t)m * (size_t)H, sizeof(float), "expert outputs"))) {
        s = FM_E_NOMEM;
        goto done;
    }
    if ((s = ds->ex.experts(ds->ex.ctx, i, h, dv, v, xin, m, lid, lw, shared, yb))) goto done;
    for (int q = 0; q < m; q++) {
        float *dst = acc + (size_t)row[q] * H;
        const float *y = yb + (size_t)q * H;
        for (int c = 0; c < H; c++) dst[c] += y[c];
    }
done:
    free(seen);
    free(row);
    free(lid);
    free(lw);
    free(xb);
    free(yb);
    return s;
}

/* acc[n, H] += shared expert of x[n, H] (weight 1). */
static fm_status shared_compute(fm_dist *ds, int i, const float *x, int n, float *acc) {
    rank_state *r = &ds->rs[i];
    if (!ds->l->has_shared || n <= 0) return FM_OK;
    const int H = ds->l->hidden;
    float *y = alloc_array((size_t)n * (size_t)H, sizeof(float), "shared expert output");
    if (!y) return FM_E_NOMEM;
    fm_status s = exec_forward(ds, i, r->hsh, &ds->dsh, &r->lsh, x, FM_DT_F32, n, NULL, y, NULL, NULL);
    if (!s)
        for (size_t q = 0; q < (size_t)n * H; q++) acc[q] += y[q];
    free(y);
    return s;
}

static void chunk_of(int rank, int T, int R, int *t0, int *n) {
    const int C = (T + R - 1) / R;
    int a = rank * C, b = a + C;
    if (a > T) a = T;
    if (b > T) b = T;
    *t0 = a;
    *n = b - a;
}

/* Gathers every rank's (pairs, active) so that every process can report
 * the load of all ranks, local or not. */
static fm_status gather_load(fm_dist *ds, const int64_t *pairs_loc, const int *active_loc, fm_dist_stats *st) {
    const int nl = ds->nloc, R = ds->R;
    int64_t *snd = fm_calloc((size_t)nl * 2, sizeof(int64_t));
    int64_t *rcv = fm_calloc((size_t)nl * 2 * R, sizeof(int64_t));
    const void **sp = fm_calloc((size_t)nl, sizeof(void *));
    void **rp = fm_calloc((size_t)nl, sizeof(void *));
    fm_status s = FM_E_NOMEM;
    if (snd && rcv && sp && rp) {
        for (int i = 0; i < nl; i++) {
            snd[2 * i] = pairs_loc[i];
            snd[2 * i + 1] = active_loc[i];
            sp[i] = snd + 2 * i;
            rp[i] = rcv + (size_t)2 * R * i;
        }
        s = fm_comm_all_gather(ds->c, sp, rp, 2 * sizeof(int64_t));
        if (!s)
            for (int p = 0; p < R; p++) {
                st->pairs[p] = rcv[2 * p];
                st->active[p] = (int)rcv[2 * p + 1];
            }
    }
    free(snd);
    free(rcv);
    free(sp);
    free(rp);
    return s;
}

static void finish_load(fm_dist_stats *st, int R) {
    int64_t sum = 0, mx = 0;
    for (int p = 0; p < R; p++) {
        sum += st->pairs[p];
        if (st->pairs[p] > mx) mx = st->pairs[p];
    }
    st->load_imbalance = sum ? (double)mx * R / (double)sum : 1.0;
}

static int count_active(const int32_t *ids, int64_t nslots, int E) {
    unsigned char *seen = calloc((size_t)E, 1);
    int a = 0;
    if (!seen) return -1;
    for (int64_t q = 0; q < nslots; q++)
        if (ids[q] >= 0 && ids[q] < E && !seen[ids[q]]) {
            seen[ids[q]] = 1;
            a++;
        }
    free(seen);
    return a;
}

/* Per-local-rank buffers of one forward call, freed together. */
typedef struct {
    int n;
    void **p;
} bufset;

static void *bs_alloc(bufset *b, int slot, size_t n, size_t sz, const char *what) {
    b->p[slot] = alloc_array(n, sz, what);
    return b->p[slot];
}
static fm_status bs_init(bufset *b, int n) {
    b->n = n;
    b->p = fm_calloc((size_t)n, sizeof(void *));
    return b->p ? FM_OK : FM_E_NOMEM;
}
static void bs_free(bufset *b) {
    if (b->p)
        for (int i = 0; i < b->n; i++) free(b->p[i]);
    free(b->p);
    b->p = NULL;
}

/* -------------------------------------------------------------------- TP */

/* Token record of the TP all-gather: k x int32 expert, k x F32 weight
 * (routed by the token's owner, on its full-precision activations), then the
 * encoded row. */
static size_t tp_rec_bytes(int k, size_t rowb) { return (sizeof(int32_t) + sizeof(float)) * (size_t)k + rowb; }

static fm_status tp_forward(fm_dist *ds, const void *x, fm_dtype xdt, int T, const int32_t *tid, fm_moe_out *o,
                            fm_dist_stats *st, int32_t *ids0, float *w0) {
    const int nl = ds->nloc, R = ds->R, H = ds->l->hidden, k = ds->l->topk;
    const int sharded = ds->o.layout == FM_DIST_TOKEN_SHARDED;
    const int C = (T + R - 1) / R, Tp = sharded ? C * R : T;
    const size_t rowb = fm_codec_row_bytes(ds->o.compress, H), rb = tp_rec_bytes(k, rowb);
    fm_status s = FM_OK;
    bufset part = {0}, snd = {0}, rcv = {0}, fin = {0};
    float *xc = NULL, *xg = NULL, *wg = NULL;
    int32_t *ig = NULL;
    int64_t pairs_dummy;
    int active_dummy;
    if ((s = bs_init(&part, nl)) || (s = bs_init(&snd, nl)) || (s = bs_init(&rcv, nl)) || (s = bs_init(&fin, nl)))
        goto done;
    for (int i = 0; i < nl; i++)
        if (!bs_alloc(&part, i, (size_t)Tp * H, sizeof(float), "partial output")) {
            s = FM_E_NOMEM;
            goto done;
        }

    if (!sharded) {
        for (int i = 0; i < nl; i++) {
            rank_state *r = &ds->rs[i];
            uint64_t t_start = fm_now_ns();
            s = exec_forward(ds, i, r->htp, &r->dtp, &r->ltp, x, xdt, T, tid, part.p[i], i == 0 ? ids0 : NULL,
                             i == 0 ? w0 : NULL);
            if (s) goto done;
            st->compute_ns[r->rank] += (double)(fm_now_ns() - t_start);
        }
        if ((s = fm_comm_all_reduce_sum(ds->c, (float *const *)part.p, (size_t)T * H))) goto done;
        memcpy(o->out, part.p[0], (size_t)T * H * sizeof(float));
    } else {
        xc = alloc_array((size_t)C * H, sizeof(float), "token chunk");
        xg = alloc_array((size_t)T * H, sizeof(float), "gathered tokens");
        ig = alloc_array((size_t)T * k, sizeof(int32_t), "gathered ids");
        wg = alloc_array((size_t)T * k, sizeof(float), "gathered weights");
        if (!xc || !xg || !ig || !wg) {
            s = FM_E_NOMEM;
            goto done;
        }
        /* 1. Owners route their chunk and encode (routing, row) records. */
        for (int i = 0; i < nl; i++) {
            const int rank = ds->rs[i].rank;
            uint64_t t_start = fm_now_ns();
            int t0, n;
            chunk_of(rank, T, R, &t0, &n);
            uint8_t *m = bs_alloc(&snd, i, (size_t)C, rb, "all-gather send");
            if (!m || !bs_alloc(&rcv, i, (size_t)C * R, rb, "all-gather recv")) {
                s = FM_E_NOMEM;
                goto done;
            }
            if ((s = rows_f32(x, xdt, H, t0, n, xc))) goto done;
            int32_t *ids = ids0 + (size_t)t0 * k;
            float *w = w0 + (size_t)t0 * k;
            if (n && (s = ds->ex.route(ds->ex.ctx, i, ds->d, ds->l, xc, n, tid ? tid + t0 : NULL, ids, w))) goto done;
            for (int t = 0; t < n; t++) {
                uint8_t *rec = m + (size_t)t * rb;
                memcpy(rec, ids + (size_t)t * k, sizeof(int32_t) * (size_t)k);
                memcpy(rec + sizeof(int32_t) * (size_t)k, w + (size_t)t * k, sizeof(float) * (size_t)k);
                s = fm_codec_encode_row(ds->o.compress, xc + (size_t)t * H, H, rec + rb - rowb);
                if (s) {
                    fm_error(s, "dist: token %d: %s", t0 + t, fm_last_error());
                    goto done;
                }
            }
            st->compute_ns[rank] += (double)(fm_now_ns() - t_start);
        }
        st->act_bytes = (int64_t)C * (int64_t)rb;
        /* 2. Everyone gets every token (rows past T are padding). */
        if ((s = fm_comm_all_gather(ds->c, (const void *const *)snd.p, rcv.p, (size_t)C * rb))) goto done;
        /* 3. Each rank: every pair on its slice, then the shared slice. */
        for (int i = 0; i < nl; i++) {
            rank_state *r = &ds->rs[i];
            uint64_t t_start = fm_now_ns();
            for (int t = 0; t < T; t++) {
                const uint8_t *rec = (const uint8_t *)rcv.p[i] + (size_t)t * rb;
                memcpy(ig + (size_t)t * k, rec, sizeof(int32_t) * (size_t)k);
                memcpy(wg + (size_t)t * k, rec + sizeof(int32_t) * (size_t)k, sizeof(float) * (size_t)k);
                fm_codec_decode_row(ds->o.compress, rec + rb - rowb, H, xg + (size_t)t * H);
            }
            if (i == 0) { /* the routing of tokens of non-local owners */
                memcpy(ids0, ig, sizeof(int32_t) * (size_t)T * k);
                memcpy(w0, wg, sizeof(float) * (size_t)T * k);
            }
            if ((s = ep_compute(ds, i, r->htp, &r->dtp, &r->ltp, 0, xg, T, ig, wg, 1, part.p[i], &pairs_dummy,
                                &active_dummy)))
                goto done;
            st->compute_ns[r->rank] += (double)(fm_now_ns() - t_start);
        }
        /* 4. Sum the slices; each rank keeps its own chunk. */
        for (int i = 0; i < nl; i++)
            if (!bs_alloc(&fin, i, (size_t)C * H, sizeof(float), "reduce-scatter recv")) {
                s = FM_E_NOMEM;
                goto done;
            }
        if ((s = fm_comm_reduce_scatter_sum(ds->c, (const float *const *)part.p, (float *const *)fin.p, (size_t)C * H)))
            goto done;
        for (int i = 0; i < nl; i++) {
            int t0, n;
            chunk_of(ds->rs[i].rank, T, R, &t0, &n);
            memcpy(o->out + (size_t)t0 * H, fin.p[i], (size_t)n * H * sizeof(float));
        }
    }
    for (int p = 0; p < R; p++) st->pairs[p] = (int64_t)T * k;
    int a = count_active(ids0, (int64_t)T * k, ds->l->n_experts);
    for (int p = 0; p < R; p++) st->active[p] = a;
    finish_load(st, R);
done:
    bs_free(&part);
    bs_free(&snd);
    bs_free(&rcv);
    bs_free(&fin);
    free(xc);
    free(xg);
    free(ig);
    free(wg);
    return s;
}

/* -------------------------------------------------------------------- EP */

static fm_status ep_replicated(fm_dist *ds, const void *x, fm_dtype xdt, int T, const int32_t *tid, fm_moe_out *o,
                               fm_dist_stats *st, int32_t *ids0, float *w0) {
    const int nl = ds->nloc, R = ds->R, H = ds->l->hidden, k = ds->l->topk;
    fm_status s = FM_OK;
    bufset part = {0};
    int64_t *pairs = fm_calloc((size_t)nl, sizeof(int64_t));
    int *active = fm_calloc((size_t)nl, sizeof(int));
    float *xf = alloc_array((size_t)T * H, sizeof(float), "tokens");
    int32_t *ids = alloc_array((size_t)T * k, sizeof(int32_t), "routing ids");
    float *w = alloc_array((size_t)T * k, sizeof(float), "routing weights");
    if (!pairs || !active || !xf || !ids || !w || (s = bs_init(&part, nl))) {
        if (!s) s = FM_E_NOMEM;
        goto done;
    }
    if ((s = rows_f32(x, xdt, H, 0, T, xf))) goto done;
    for (int i = 0; i < nl; i++) {
        rank_state *r = &ds->rs[i];
        uint64_t t_start = fm_now_ns();
        float *acc = bs_alloc(&part, i, (size_t)T * H, sizeof(float), "partial output");
        if (!acc) {
            s = FM_E_NOMEM;
            goto done;
        }
        /* Every rank routes all T tokens (replicated routing). */
        if ((s = ds->ex.route(ds->ex.ctx, i, ds->d, ds->l, xf, T, tid, ids, w))) goto done;
        if (i == 0) {
            memcpy(ids0, ids, (size_t)T * k * sizeof(int32_t));
            memcpy(w0, w, (size_t)T * k * sizeof(float));
        }
        if ((s = ep_compute(ds, i, r->hep, &r->dep, &r->lep, r->e0, xf, T, ids, w, 0, acc, &pairs[i], &active[i])))
            goto done;
        int t0, n;
        chunk_of(r->rank, T, R, &t0, &n);
        if ((s = shared_compute(ds, i, xf + (size_t)t0 * H, n, acc + (size_t)t0 * H))) goto done;
        st->compute_ns[r->rank] += (double)(fm_now_ns() - t_start);
    }
    if ((s = fm_comm_all_reduce_sum(ds->c, (float *const *)part.p, (size_t)T * H))) goto done;
    memcpy(o->out, part.p[0], (size_t)T * H * sizeof(float));
    if ((s = gather_load(ds, pairs, active, st))) goto done;
    finish_load(st, R);
done:
    bs_free(&part);
    free(pairs);
    free(active);
    free(xf);
    free(ids);
    free(w);
    return s;
}

/* Dispatch record: int32 token, k x int32 local expert (-1: not this
 * rank's), k x F32 weight, then the encoded activation row. */
static size_t rec_bytes(int k, size_t rowb) { return sizeof(int32_t) * (size_t)(1 + k) + sizeof(float) * (size_t)k + rowb; }

static int owner_of(int e, int ne) { return e / ne; }

static fm_status ep_sharded(fm_dist *ds, const void *x, fm_dtype xdt, int T, const int32_t *tid, fm_moe_out *o,
                            fm_dist_stats *st, int32_t *ids_all, float *w_all) {
    const int nl = ds->nloc, R = ds->R, H = ds->l->hidden, k = ds->l->topk;
    const int ne = ds->l->n_experts / R;
    const size_t rowb = fm_codec_row_bytes(ds->o.compress, H), rb = rec_bytes(k, rowb);
    fm_status s = FM_OK;
    bufset xc = {0}, cs = {0}, cr = {0}, snd = {0}, rcv = {0}, acc = {0}, back = {0}, ssz = {0}, rsz = {0},
           bssz = {0}, brsz = {0}, xr = {0}, idr = {0}, wr = {0};
    bufset *all[] = {&xc, &cs, &cr, &snd, &rcv, &acc, &back, &ssz, &rsz, &bssz, &brsz, &xr, &idr, &wr};
    int64_t *pairs = fm_calloc((size_t)nl, sizeof(int64_t));
    int *active = fm_calloc((size_t)nl, sizeof(int));
    unsigned char *hit = alloc_array((size_t)R, 1, "owner mask");
    if (!pairs || !active || !hit) {
        s = FM_E_NOMEM;
        goto done;
    }
    for (size_t q = 0; q < sizeof all / sizeof all[0]; q++)
        if ((s = bs_init(all[q], nl))) goto done;

    /* 1. Route own chunk; count the tokens bound for each owner rank. */
    for (int i = 0; i < nl; i++) {
        const int rank = ds->rs[i].rank;
        uint64_t t_start = fm_now_ns();
        int t0, n;
        chunk_of(rank, T, R, &t0, &n);
        float *xf = bs_alloc(&xc, i, (size_t)n * H, sizeof(float), "token chunk");
        int64_t *cnt = bs_alloc(&cs, i, (size_t)R, sizeof(int64_t), "dispatch counts");
        if (!xf || !cnt || !bs_alloc(&cr, i, (size_t)R, sizeof(int64_t), "dispatch counts")) {
            s = FM_E_NOMEM;
            goto done;
        }
        if ((s = rows_f32(x, xdt, H, t0, n, xf))) goto done;
        int32_t *ids = ids_all + (size_t)t0 * k;
        float *w = w_all + (size_t)t0 * k;
        if (n && (s = ds->ex.route(ds->ex.ctx, i, ds->d, ds->l, xf, n, tid ? tid + t0 : NULL, ids, w))) goto done;
        for (int t = 0; t < n; t++) {
            memset(hit, 0, (size_t)R);
            for (int j = 0; j < k; j++) {
                const int e = ids[(size_t)t * k + j];
                if (e < 0 || e >= ds->l->n_experts) {
                    s = fm_error(FM_E_RANGE, "dist: routing gave expert id %d for token %d (E=%d)", e, t0 + t,
                                 ds->l->n_experts);
                    goto done;
                }
                hit[owner_of(e, ne)] = 1;
            }
            for (int p = 0; p < R; p++) cnt[p] += hit[p];
        }
        st->compute_ns[rank] += (double)(fm_now_ns() - t_start);
    }
    /* 2. Exchange the counts (fixed size), so receivers can size buffers. */
    for (int i = 0; i < nl; i++) {
        size_t *a = bs_alloc(&ssz, i, (size_t)R, sizeof(size_t), "sizes");
        size_t *b = bs_alloc(&rsz, i, (size_t)R, sizeof(size_t), "sizes");
        if (!a || !b) {
            s = FM_E_NOMEM;
            goto done;
        }
        for (int p = 0; p < R; p++) a[p] = b[p] = sizeof(int64_t);
    }
    if ((s = fm_comm_all_to_allv(ds->c, (const void *const *)cs.p, (const size_t *const *)ssz.p, cr.p,
                                 (const size_t *const *)rsz.p)))
        goto done;

    /* 3. Build and send the dispatch records, grouped by owner rank. */
    for (int i = 0; i < nl; i++) {
        const int rank = ds->rs[i].rank;
        uint64_t t_start = fm_now_ns();
        int t0, n;
        chunk_of(rank, T, R, &t0, &n);
        const int64_t *cnt = cs.p[i], *rc = cr.p[i];
        size_t *ss = ssz.p[i], *rs = rsz.p[i];
        int64_t ns = 0, nr = 0;
        for (int p = 0; p < R; p++) {
            if (rc[p] < 0 || rc[p] > (int64_t)T) {
                s = fm_error(FM_E_RANGE, "dist: rank %d announced %lld tokens (T=%d)", p, (long long)rc[p], T);
                goto done;
            }
            ns += cnt[p];
            nr += rc[p];
            ss[p] = (size_t)cnt[p] * rb;
            rs[p] = (size_t)rc[p] * rb;
        }
        uint8_t *m = bs_alloc(&snd, i, (size_t)ns, rb, "dispatch send");
        if (!m || !bs_alloc(&rcv, i, (size_t)nr, rb, "dispatch recv")) {
            s = FM_E_NOMEM;
            goto done;
        }
        const int32_t *ids = ids_all + (size_t)t0 * k;
        const float *w = w_all + (size_t)t0 * k;
        const float *xf = xc.p[i];
        size_t at = 0;
        for (int p = 0; p < R; p++)
            for (int t = 0; t < n; t++) {
                int mine = 0;
                for (int j = 0; j < k; j++) mine |= owner_of(ids[(size_t)t * k + j], ne) == p;
                if (!mine) continue;
                uint8_t *rec = m + at * rb;
                int32_t tok = t0 + t;
                memcpy(rec, &tok, sizeof tok);
                for (int j = 0; j < k; j++) {
                    const int e = ids[(size_t)t * k + j];
                    int32_t le = owner_of(e, ne) == p ? e - p * ne : -1;
                    float wj = le >= 0 ? w[(size_t)t * k + j] : 0.0f;
                    memcpy(rec + sizeof(int32_t) * (size_t)(1 + j), &le, sizeof le);
                    memcpy(rec + sizeof(int32_t) * (size_t)(1 + k) + sizeof(float) * (size_t)j, &wj, sizeof wj);
                }
                s = fm_codec_encode_row(ds->o.compress, xf + (size_t)t * H, H, rec + rb - rowb);
                if (s) {
                    fm_error(s, "dist: token %d: %s", tok, fm_last_error());
                    goto done;
                }
                at++;
            }
        st->compute_ns[rank] += (double)(fm_now_ns() - t_start);
    }
    for (int p = 0; p < R; p++) st->act_bytes += (int64_t)((size_t *)ssz.p[0])[p];
    if ((s = fm_comm_all_to_allv(ds->c, (const void *const *)snd.p, (const size_t *const *)ssz.p, rcv.p,
                                 (const size_t *const *)rsz.p)))
        goto done;

    /* 4. Owners compute their pairs; outputs go back in record order. */
    for (int i = 0; i < nl; i++) {
        rank_state *r = &ds->rs[i];
        uint64_t t_start = fm_now_ns();
        const int64_t *rc = cr.p[i];
        int64_t nr = 0;
        for (int p = 0; p < R; p++) nr += rc[p];
        float *xi = bs_alloc(&xr, i, (size_t)nr * H, sizeof(float), "received tokens");
        int32_t *gi = bs_alloc(&idr, i, (size_t)nr * k, sizeof(int32_t), "received ids");
        float *wi = bs_alloc(&wr, i, (size_t)nr * k, sizeof(float), "received weights");
        float *ai = bs_alloc(&acc, i, (size_t)nr * H, sizeof(float), "expert outputs");
        if (!xi || !gi || !wi || !ai) {
            s = FM_E_NOMEM;
            goto done;
        }
        const uint8_t *m = rcv.p[i];
        for (int64_t q = 0; q < nr; q++) {
            const uint8_t *rec = m + (size_t)q * rb;
            int32_t tok;
            memcpy(&tok, rec, sizeof tok);
            if (tok < 0 || tok >= T) {
                s = fm_error(FM_E_RANGE, "dist: dispatch record %lld names token %d (T=%d)", (long long)q, tok, T);
                goto done;
            }
            for (int j = 0; j < k; j++) {
                int32_t le;
                memcpy(&le, rec + sizeof(int32_t) * (size_t)(1 + j), sizeof le);
                if (le < -1 || le >= ne) {
                    s = fm_error(FM_E_RANGE, "dist: dispatch record %lld names local expert %d (%d per rank)",
                                 (long long)q, le, ne);
                    goto done;
                }
                gi[(size_t)q * k + j] = le >= 0 ? r->e0 + le : -1;
                memcpy(&wi[(size_t)q * k + j], rec + sizeof(int32_t) * (size_t)(1 + k) + sizeof(float) * (size_t)j,
                       sizeof(float));
            }
            fm_codec_decode_row(ds->o.compress, rec + rb - rowb, H, xi + (size_t)q * H);
        }
        if ((s = ep_compute(ds, i, r->hep, &r->dep, &r->lep, r->e0, xi, (int)nr, gi, wi, 0, ai, &pairs[i],
                            &active[i])))
            goto done;
        st->compute_ns[r->rank] += (double)(fm_now_ns() - t_start);
    }
    for (int i = 0; i < nl; i++) {
        size_t *a = bs_alloc(&bssz, i, (size_t)R, sizeof(size_t), "sizes");
        size_t *b = bs_alloc(&brsz, i, (size_t)R, sizeof(size_t), "sizes");
        if (!a || !b) {
            s = FM_E_NOMEM;
            goto done;
        }
        const int64_t *cnt = cs.p[i], *rc = cr.p[i];
        for (int p = 0; p < R; p++) {
            a[p] = (size_t)rc[p] * H * sizeof(float);  /* results go back to the senders */
            b[p] = (size_t)cnt[p] * H * sizeof(float); /* our tokens' results come back */
        }
        int64_t ns = 0;
        for (int p = 0; p < R; p++) ns += cnt[p];
        if (!bs_alloc(&back, i, (size_t)ns * H, sizeof(float), "combine recv")) {
            s = FM_E_NOMEM;
            goto done;
        }
    }
    if ((s = fm_comm_all_to_allv(ds->c, (const void *const *)acc.p, (const size_t *const *)bssz.p, back.p,
                                 (const size_t *const *)brsz.p)))
        goto done;

    /* 5. Each token owner adds what came back, then its shared expert. */
    for (int i = 0; i < nl; i++) {
        rank_state *r = &ds->rs[i];
        uint64_t t_start = fm_now_ns();
        int t0, n;
        chunk_of(r->rank, T, R, &t0, &n);
        float *out = o->out + (size_t)t0 * H;
        memset(out, 0, (size_t)n * H * sizeof(float));
        const int32_t *ids = ids_all + (size_t)t0 * k;
        const float *b = back.p[i];
        size_t at = 0;
        for (int p = 0; p < R; p++)
            for (int t = 0; t < n; t++) {
                int mine = 0;
                for (int j = 0; j < k; j++) mine |= owner_of(ids[(size_t)t * k + j], ne) == p;
                if (!mine) continue;
                const float *y = b + at * H;
                for (int h = 0; h < H; h++) out[(size_t)t * H + h] += y[h];
                at++;
            }
        if ((s = shared_compute(ds, i, xc.p[i], n, out))) goto done;
        st->compute_ns[r->rank] += (double)(fm_now_ns() - t_start);
    }
    if ((s = gather_load(ds, pairs, active, st))) goto done;
    finish_load(st, R);
done:
    for (size_t q = 0; q < sizeof all / sizeof all[0]; q++) bs_free(all[q]);
    free(pairs);
    free(active);
    free(hit);
    return s;
}

/* --------------------------------------------------------------- forward */

fm_status fm_dist_forward(fm_dist *ds, const void *x, fm_dtype xdt, int T, const int32_t *token_ids, fm_moe_out *o,
                          fm_dist_stats *st_out) {
    if (!ds || !x || !o || !o->out) return fm_error(FM_E_ARG, "dist forward: layer, input and output are required");
    if (T < 1) return fm_error(FM_E_RANGE, "dist forward: T=%d tokens (need >= 1)", T);
    if (xdt != FM_DT_F32 && xdt != FM_DT_BF16 && xdt != FM_DT_F16)
        return fm_error(FM_E_ARG, "dist forward: activations must be F32, BF16 or F16, not %s", fm_dtype_name(xdt));
    uint64_t tk;
    if (!fm_mul_ok((uint64_t)T, (uint64_t)ds->l->hidden * sizeof(float), &tk) || tk > SIZE_MAX / 4)
        return fm_error(FM_E_RANGE, "dist forward: T=%d x H=%d is too large", T, ds->l->hidden);
    fm_dist_stats st;
    memset(&st, 0, sizeof st);
    st.ranks = ds->R;
    fm_comm_stats c0, c1;
    fm_comm_get_stats(ds->c, &c0);

    const int k = ds->l->topk;
    int32_t *ids = o->topk_ids;
    float *w = o->topk_weights;
    int32_t *ids_tmp = NULL;
    float *w_tmp = NULL;
    if (!ids) ids = ids_tmp = alloc_array((size_t)T * k, sizeof(int32_t), "routing ids");
    if (!w) w = w_tmp = alloc_array((size_t)T * k, sizeof(float), "routing weights");
    fm_status s = (!ids || !w) ? FM_E_NOMEM : FM_OK;
    if (!s) {
        if (ds->o.mode == FM_DIST_TP) s = tp_forward(ds, x, xdt, T, token_ids, o, &st, ids, w);
        else if (ds->o.layout == FM_DIST_REPLICATED) s = ep_replicated(ds, x, xdt, T, token_ids, o, &st, ids, w);
        else s = ep_sharded(ds, x, xdt, T, token_ids, o, &st, ids, w);
    }
    if (!s) {
        fm_comm_get_stats(ds->c, &c1);
        st.comm_ns = c1.ns - c0.ns;
        st.comm_bytes = c1.bytes - c0.bytes;
        if (st_out) *st_out = st;
    }
    free(ids_tmp);
    free(w_tmp);
    return s;
}

fm_status fm_dist_forward_single(fm_dist *ds, const void *x, fm_dtype xdt, int T, const int32_t *token_ids,
                                 fm_moe_out *o) {
    if (!ds->hfull_ready) {
        fm_status s = prepare(ds, 0, ds->d, ds->l, &ds->hfull);
        if (s) return s;
        ds->hfull_ready = 1;
    }
    return exec_forward(ds, 0, ds->hfull, ds->d, ds->l, x, xdt, T, token_ids, o->out, o->topk_ids, o->topk_weights);
}
