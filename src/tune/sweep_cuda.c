/* The CUDA measuring backend of the tuning sweep.
 *
 * Timing uses fm_cuda_bench (layers back to back in one CUDA graph, median
 * with min/max over replays) on enough distinct layers that their active
 * experts do not fit in L2, since a config that only wins when weights are
 * cached would lose in a real decode step. Those layers are generated on the
 * GPU.
 *
 * Correctness compares the GPU output of each would-be winner with the
 * float64 reference. Generating a full host copy of a DeepSeek-sized layer
 * (6+ GB) and its reference would cost more than the sweep, so the check
 * runs on a layer of the same family, H, I, k and format with fewer experts
 * (at most 16): the expert kernels, whose parameters are being tuned, see
 * the same matrix shapes, and several tokens share each expert, which
 * exercises the multi-token tiles. The reference is computed once and
 * reused for every candidate and bucket; the forced config decides the
 * kernel path whatever the batch. Compiled in every build: without CUDA the
 * fm_cuda_* calls answer FM_E_UNSUPPORTED and so does fm_tune_cuda_new. */
#include "tune/tune_internal.h"
#include "util/util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Tokens checked against the reference. With k of at most 16 experts each,
 * they share experts, so multi-token tiles run. The float64 reference is
 * single-threaded and takes seconds per token for DeepSeek-sized experts,
 * which is why there are only two. */
#define CHECK_T 2
/* Experts of the check layer. */
#define CHECK_E_MAX 16
/* Replays per measurement (fm_cuda_bench reports median, min, max). */
#define BENCH_REPS 20
/* Distinct layers: the graph should stream at least this many bytes at
 * batch 1 (several times any L2), within a device-memory cap. */
#define MIN_STREAM_BYTES (512ll << 20)
#define MAX_LAYER_BYTES_TOTAL (48ll << 30)

struct fm_tune_cuda {
    fm_cuda_engine *e;
    fm_model_desc d;       /* the model, for timing            */
    fm_model_desc dc;      /* the check layer's description    */
    fm_qformat fmt;
    fm_tune_key key;
    uint64_t seed;
    int n_layers;
    fm_cuda_layer **layers;
    fm_moe_layer *host;    /* the check layer, on the host     */
    fm_cuda_layer *check;  /* ... and on the GPU               */
    uint16_t *x;           /* [CHECK_T, H] BF16                */
    float *ref;            /* [CHECK_T, H]                     */
    int32_t *ids;          /* [CHECK_T, k]                     */
    char describe[640];
};

/* The model with at most CHECK_E_MAX experts, groups adjusted so routing
 * stays valid (group-limited routing is kept when it still fits). */
static fm_status check_desc(const fm_model_desc *d, fm_model_desc *dc) {
    *dc = *d;
    int E = d->n_experts < CHECK_E_MAX ? d->n_experts : CHECK_E_MAX;
    if (E < 2 * d->topk && d->n_experts >= 2 * d->topk) E = 2 * d->topk;
    if (E > d->n_experts) E = d->n_experts;
    dc->n_experts = E;
    int per = dc->n_group > 0 && E % dc->n_group == 0 ? E / dc->n_group : 0;
    if (dc->n_group > 1 && (per < 2 || dc->topk > dc->topk_group * per)) dc->n_group = dc->topk_group = 1;
    if (dc->n_group < 1) dc->n_group = dc->topk_group = 1;
    return fm_model_desc_validate(dc);
}

static int moe_layer_at_or_after(const fm_model_desc *d, int from) {
    int nl = d->n_layers > 0 ? d->n_layers : from + 1;
    for (int L = from; L < nl; L++)
        if (L >= d->n_hash_layers && fm_model_is_moe_layer(d, L)) return L;
    return -1;
}

fm_status fm_tune_cuda_new(const fm_model_desc *d, fm_qformat fmt, int n_layers, uint64_t seed, fm_tune_cuda **out) {
    *out = NULL;
    char why[256] = "";
    if (!fm_cuda_available(why, sizeof why)) return fm_error(FM_E_UNSUPPORTED, "no CUDA GPU: %s", why);
    fm_tune_cuda *t = fm_calloc(1, sizeof *t);
    if (!t) return FM_E_NOMEM;
    t->d = *d;
    t->fmt = fmt;
    t->seed = seed;
    fm_status s = fm_cuda_engine_new(0, &t->e);
    if (s) goto fail;
    if ((s = fm_cuda_engine_key(t->e, d, fmt, &t->key))) goto fail;

    int L0 = moe_layer_at_or_after(d, 0);
    if (L0 < 0) { s = fm_error(FM_E_ARG, "model has no routed MoE layer to tune on"); goto fail; }
    int64_t eb = fm_model_expert_bytes(d, fmt);
    if (eb <= 0) { s = fm_error(FM_E_ARG, "cannot size an expert of this model in %s", fm_qformat_name(fmt)); goto fail; }
    if (n_layers <= 0) {
        int64_t per_step = eb * d->topk, layer = eb * d->n_experts;
        int64_t n = (MIN_STREAM_BYTES + per_step - 1) / per_step;
        if (n < 4) n = 4;
        if (n > 16) n = 16;
        if (n * layer > MAX_LAYER_BYTES_TOTAL) n = MAX_LAYER_BYTES_TOTAL / layer;
        if (n < 2) n = 2;
        n_layers = (int)n;
    }
    t->layers = fm_calloc((size_t)n_layers, sizeof *t->layers);
    if (!t->layers) { s = FM_E_NOMEM; goto fail; }
    int L = L0, round = 0;
    while (t->n_layers < n_layers) {
        s = fm_cuda_layer_random(t->e, d, fmt, seed + (uint64_t)round, L, &t->layers[t->n_layers]);
        if (s == FM_E_NOMEM && t->n_layers >= 2) { s = FM_OK; break; } /* as many as fit */
        if (s) goto fail;
        t->n_layers++;
        int nx = moe_layer_at_or_after(d, L + 1);
        if (nx < 0) { round++; nx = L0; } /* out of layers: same indices, next seed */
        L = nx;
    }

    /* The check layer and its reference, once. */
    if ((s = check_desc(d, &t->dc))) goto fail;
    if ((s = fm_moe_layer_random(&t->dc, fmt, seed, L0, &t->host))) goto fail;
    if ((s = fm_cuda_layer_upload(t->e, &t->dc, t->host, &t->check))) goto fail;
    int64_t H = d->hidden, k = d->topk;
    t->x = fm_malloc((size_t)(CHECK_T * H) * sizeof *t->x);
    t->ref = fm_malloc((size_t)(CHECK_T * H) * sizeof *t->ref);
    t->ids = fm_malloc((size_t)(CHECK_T * k) * sizeof *t->ids);
    float *w = fm_malloc((size_t)(CHECK_T * k) * sizeof *w);
    if (!t->x || !t->ref || !t->ids || !w) { free(w); s = FM_E_NOMEM; goto fail; }
    for (int64_t i = 0; i < CHECK_T * H; i++)
        t->x[i] = fm_f32_to_bf16(fm_rng_normal(seed, fm_hash_str("tune.check.x"), (uint64_t)i));
    fm_moe_out o = {.out = t->ref, .topk_ids = t->ids, .topk_weights = w};
    s = fm_moe_forward_ref(&t->dc, t->host, t->x, FM_DT_BF16, CHECK_T, NULL, &o);
    free(w);
    if (s) goto fail;
    snprintf(t->describe, sizeof t->describe,
             "%s; timing %d layers of %s weights (%.1f MB per expert); checking %d tokens on a %d-expert layer of the "
             "same shape against the float64 reference",
             fm_cuda_engine_describe(t->e), t->n_layers, fm_qformat_name(fmt), (double)eb / 1e6, CHECK_T,
             t->dc.n_experts);
    *out = t;
    return FM_OK;
fail:
    {
        char m[1024];
        snprintf(m, sizeof m, "%s", fm_last_error());
        fm_tune_cuda_free(t);
        return fm_error(s, "%s", m);
    }
}

void fm_tune_cuda_free(fm_tune_cuda *t) {
    if (!t) return;
    for (int i = 0; i < t->n_layers; i++) fm_cuda_layer_free(t->layers[i]);
    free(t->layers);
    fm_cuda_layer_free(t->check);
    fm_moe_layer_free(t->host);
    free(t->x);
    free(t->ref);
    free(t->ids);
    if (t->e) {
        fm_cuda_engine_set_config(t->e, NULL);
        fm_cuda_engine_free(t->e);
    }
    free(t);
}

const fm_tune_key *fm_tune_cuda_key(const fm_tune_cuda *t) { return &t->key; }
const char *fm_tune_cuda_describe(const fm_tune_cuda *t) { return t->describe; }

static fm_status cuda_bench(void *ctx, const fm_kernel_config *cfg, int T, double *med, double *mn, double *mx) {
    fm_tune_cuda *t = ctx;
    fm_cuda_bench_result r;
    memset(&r, 0, sizeof r);
    fm_status s = fm_cuda_engine_set_config(t->e, cfg);
    if (s) return s;
    s = fm_cuda_bench(t->e, &t->d, t->layers, t->n_layers, T, t->seed, BENCH_REPS, &r);
    if (s) return s;
    /* The launcher normalizes configs it cannot run as given; such a
     * candidate measured something else and must not be recorded as it. */
    if (r.cfg.warps != cfg->warps || r.cfg.k_split != cfg->k_split || r.cfg.tile_n != cfg->tile_n ||
        r.cfg.rows_per_block != cfg->rows_per_block) {
        char want[200], got[200];
        fm_kernel_config_format(cfg, want, sizeof want);
        fm_kernel_config_format(&r.cfg, got, sizeof got);
        return fm_error(FM_E_ARG, "the kernel ran %s as %s", want, got);
    }
    *med = r.us_per_layer;
    *mn = r.us_min;
    *mx = r.us_max;
    return FM_OK;
}

static fm_status cuda_check(void *ctx, const fm_kernel_config *cfg, int T, double *rel_err, int *ids_equal) {
    fm_tune_cuda *t = ctx;
    (void)T; /* the forced config decides the path; see the top of the file */
    int64_t H = t->d.hidden, k = t->d.topk;
    float *y = fm_malloc((size_t)(CHECK_T * H) * sizeof *y), *w = fm_malloc((size_t)(CHECK_T * k) * sizeof *w);
    int32_t *ids = fm_malloc((size_t)(CHECK_T * k) * sizeof *ids);
    if (!y || !w || !ids) { free(y); free(w); free(ids); return FM_E_NOMEM; }
    /* Poisoned, so an output the kernel never wrote shows up as NaN. */
    for (int64_t i = 0; i < CHECK_T * H; i++) y[i] = NAN;
    fm_moe_out o = {.out = y, .topk_ids = ids, .topk_weights = w};
    fm_status s = fm_cuda_engine_set_config(t->e, cfg);
    if (s) { free(y); free(w); free(ids); return s; }
    s = fm_cuda_forward(t->e, &t->dc, t->check, t->x, FM_DT_BF16, CHECK_T, NULL, &o);
    if (s == FM_OK) {
        double num = 0, den = 0;
        for (int64_t i = 0; i < CHECK_T * H; i++) {
            double dlt = (double)y[i] - (double)t->ref[i];
            num += dlt * dlt;
            den += (double)t->ref[i] * t->ref[i];
        }
        *rel_err = isfinite(num) ? sqrt(num / (den > 0 ? den : 1e-300)) : INFINITY;
        *ids_equal = memcmp(ids, t->ids, (size_t)(CHECK_T * k) * sizeof *ids) == 0;
    }
    free(y);
    free(w);
    free(ids);
    return s;
}

fm_tune_backend fm_tune_cuda_backend(fm_tune_cuda *t) {
    fm_tune_backend b = {.ctx = t, .bench = cuda_bench, .check = cuda_check};
    return b;
}
