/* The CUDA measuring backend of the tuning sweep.
 *
 * Timing uses fm_cuda_bench (layers back to back in one CUDA graph, median
 * with min/max over replays) on enough distinct layers that their active
 * experts do not fit in L2, since a config that only wins when weights are
 * cached would lose in a real decode step. Correctness compares the GPU
 * output of each would-be winner with the float64 reference on a few tokens;
 * the reference is computed once per checked batch and reused for every
 * candidate. Compiled in every build: without CUDA the fm_cuda_* calls
 * answer FM_E_UNSUPPORTED and so does fm_tune_cuda_new. */
#include "tune/tune_internal.h"
#include "util/util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Tokens checked against the reference: enough to cover several experts
 * per token and a partial tile, few enough that the float64 reference of a
 * DeepSeek-sized layer stays at seconds. */
#define CHECK_T_MAX 4
/* Replays per measurement (fm_cuda_bench reports median, min, max). */
#define BENCH_REPS 20
/* Distinct layers: the graph should stream at least this many bytes at
 * batch 1 (several times any L2), within a device-memory cap. */
#define MIN_STREAM_BYTES (512ll << 20)
#define MAX_LAYER_BYTES_TOTAL (48ll << 30)

typedef struct {
    int T;
    uint16_t *x;     /* [T, H] BF16 */
    float *ref;      /* [T, H]      */
    int32_t *ids;    /* [T, k]      */
} ref_case;

struct fm_tune_cuda {
    fm_cuda_engine *e;
    fm_model_desc d;
    fm_qformat fmt;
    fm_tune_key key;
    uint64_t seed;
    int n_layers;
    fm_cuda_layer **layers; /* layers[0] is the upload of host */
    fm_moe_layer *host;
    ref_case refs[CHECK_T_MAX + 1];
    char describe[512];
};

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

    /* Layer 0 is built on the host and uploaded, so the reference and the
     * GPU see the very same weights; the others are generated on the GPU. */
    if ((s = fm_moe_layer_random(d, fmt, seed, L0, &t->host))) goto fail;
    if ((s = fm_cuda_layer_upload(t->e, d, t->host, &t->layers[0]))) goto fail;
    t->n_layers = 1;
    int L = L0, round = 0;
    while (t->n_layers < n_layers) {
        int nx = moe_layer_at_or_after(d, L + 1);
        if (nx < 0) { round++; nx = L0; } /* out of layers: same indices, next seed */
        L = nx;
        if ((s = fm_cuda_layer_random(t->e, d, fmt, seed + (uint64_t)round, L, &t->layers[t->n_layers]))) goto fail;
        t->n_layers++;
    }
    snprintf(t->describe, sizeof t->describe, "%s; %d layers of %s weights (%.1f MB per expert)",
             fm_cuda_engine_describe(t->e), t->n_layers, fm_qformat_name(fmt), (double)eb / 1e6);
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
    fm_moe_layer_free(t->host);
    for (int i = 0; i <= CHECK_T_MAX; i++) {
        free(t->refs[i].x);
        free(t->refs[i].ref);
        free(t->refs[i].ids);
    }
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
    fm_cuda_engine_set_config(t->e, cfg);
    fm_status s = fm_cuda_bench(t->e, &t->d, t->layers, t->n_layers, T, t->seed, BENCH_REPS, &r);
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

static fm_status ref_for(fm_tune_cuda *t, int T, ref_case **out) {
    ref_case *rc = &t->refs[T];
    *out = rc;
    if (rc->ref) return FM_OK;
    int64_t H = t->d.hidden, k = t->d.topk;
    rc->x = fm_malloc((size_t)(T * H) * sizeof *rc->x);
    rc->ref = fm_malloc((size_t)(T * H) * sizeof *rc->ref);
    rc->ids = fm_malloc((size_t)(T * k) * sizeof *rc->ids);
    float *w = fm_malloc((size_t)(T * k) * sizeof *w);
    if (!rc->x || !rc->ref || !rc->ids || !w) { free(w); return FM_E_NOMEM; }
    for (int64_t i = 0; i < T * H; i++)
        rc->x[i] = fm_f32_to_bf16(fm_rng_normal(t->seed, fm_hash_str("tune.check.x"), (uint64_t)(T * 1000003ll) + (uint64_t)i));
    fm_moe_out o = {.out = rc->ref, .topk_ids = rc->ids, .topk_weights = w};
    fm_status s = fm_moe_forward_ref(&t->d, t->host, rc->x, FM_DT_BF16, T, NULL, &o);
    free(w);
    if (s) { free(rc->ref); rc->ref = NULL; }
    return s;
}

static fm_status cuda_check(void *ctx, const fm_kernel_config *cfg, int T, double *rel_err, int *ids_equal) {
    fm_tune_cuda *t = ctx;
    int Tc = T < CHECK_T_MAX ? T : CHECK_T_MAX;
    ref_case *rc;
    fm_status s = ref_for(t, Tc, &rc);
    if (s) return s;
    int64_t H = t->d.hidden, k = t->d.topk;
    float *y = fm_malloc((size_t)(Tc * H) * sizeof *y), *w = fm_malloc((size_t)(Tc * k) * sizeof *w);
    int32_t *ids = fm_malloc((size_t)(Tc * k) * sizeof *ids);
    if (!y || !w || !ids) { free(y); free(w); free(ids); return FM_E_NOMEM; }
    /* Poisoned, so an output the kernel never wrote shows up as NaN. */
    for (int64_t i = 0; i < Tc * H; i++) y[i] = NAN;
    fm_moe_out o = {.out = y, .topk_ids = ids, .topk_weights = w};
    fm_cuda_engine_set_config(t->e, cfg);
    s = fm_cuda_forward(t->e, &t->d, t->layers[0], rc->x, FM_DT_BF16, Tc, NULL, &o);
    if (s == FM_OK) {
        double num = 0, den = 0;
        for (int64_t i = 0; i < Tc * H; i++) {
            double dlt = (double)y[i] - (double)rc->ref[i];
            num += dlt * dlt;
            den += (double)rc->ref[i] * rc->ref[i];
        }
        *rel_err = isfinite(num) ? sqrt(num / (den > 0 ? den : 1e-300)) : INFINITY;
        *ids_equal = memcmp(ids, rc->ids, (size_t)(Tc * k) * sizeof *ids) == 0;
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
