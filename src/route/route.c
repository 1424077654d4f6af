/*
 * Router math of every family, in FP32 as the models compute it.
 *
 *   noaux_tc (DeepSeek-V3/R1, Kimi-K2, GLM-4.5/5): s = sigmoid(logit);
 *     selection on s + e_score_correction_bias; with n_group > 1 a group's
 *     score is the sum of its two best biased scores, the topk_group best
 *     groups are kept and the experts of the other groups are masked with
 *     -inf (DeepSeek's reference code and the serving engines; HF
 *     transformers masks with 0.0, which differs only when every biased
 *     score left is negative: with -inf a dropped group can never win).
 *     Weights are the unbiased s, renormalized when norm_topk_prob
 *     (sum + 1e-20, as HF), times routed_scaling_factor.
 *   softmax (Qwen3-MoE, Mixtral): p = softmax(logits) over all experts;
 *     top-k on p; renormalized when norm_topk_prob (Mixtral configs set it).
 *   gpt-oss: top-k on logits + router bias; softmax over the k chosen.
 *   DeepSeek-V4: s = sqrt(softplus(logit)); selection on s + bias (groups
 *     as noaux_tc when n_group > 1); weights s renormalized, times the
 *     scaling factor. Layers below n_hash_layers that carry tid2eid take
 *     their experts from tid2eid[token_id] and weigh them the same way.
 *
 * Ties: the lower expert (or group) index wins, everywhere.
 * Output: each token's k ids in ascending order, weights permuted alike.
 */
#include "route/route.h"

#include <math.h>
#include <string.h>

#include "util/util.h"

int fm_route_is_hash_layer(const fm_model_desc *d, const fm_moe_layer *l) {
    return d->route == FM_ROUTE_DSV4 && l->tid2eid != NULL && l->layer < d->n_hash_layers;
}

static int uses_groups(const fm_model_desc *d) {
    return (d->route == FM_ROUTE_NOAUX_TC || d->route == FM_ROUTE_DSV4) && d->n_group > 1;
}

fm_status fm_route_check(const fm_model_desc *d, const fm_moe_layer *l) {
    if (!d || !l) return fm_error(FM_E_ARG, "routing: model description or layer is NULL");
    int E = l->n_experts, k = l->topk;
    if (E < 1 || k < 1 || k > E)
        return fm_error(FM_E_RANGE, "layer %d: top-k %d with %d experts", l->layer, k, E);
    if (d->n_experts != E || d->topk != k || d->hidden != l->hidden)
        return fm_error(FM_E_ARG,
                        "layer %d: layer (E=%d, k=%d, H=%d) does not match the model description "
                        "(E=%d, k=%d, H=%d)",
                        l->layer, E, k, l->hidden, d->n_experts, d->topk, d->hidden);
    if (l->hidden < 1) return fm_error(FM_E_RANGE, "layer %d: hidden size %d", l->layer, l->hidden);
    if (!l->router_w) return fm_error(FM_E_ARG, "layer %d: no router weight", l->layer);
    switch (d->route) {
    case FM_ROUTE_NOAUX_TC: case FM_ROUTE_SOFTMAX: case FM_ROUTE_GPTOSS: case FM_ROUTE_DSV4: break;
    default: return fm_error(FM_E_ARG, "layer %d: unknown routing kind %d", l->layer, (int)d->route);
    }
    if (uses_groups(d)) {
        if (E % d->n_group != 0)
            return fm_error(FM_E_RANGE, "n_group %d does not divide %d experts", d->n_group, E);
        if (d->topk_group < 1 || d->topk_group > d->n_group)
            return fm_error(FM_E_RANGE, "topk_group %d not in [1, n_group=%d]", d->topk_group, d->n_group);
        if ((int64_t)d->topk_group * (E / d->n_group) < k)
            return fm_error(FM_E_RANGE, "top-k %d exceeds the %d experts of %d kept groups", k,
                            d->topk_group * (E / d->n_group), d->topk_group);
    }
    if (fm_route_is_hash_layer(d, l) && l->tid2eid_rows < 1)
        return fm_error(FM_E_RANGE, "layer %d: tid2eid has no rows", l->layer);
    return FM_OK;
}

void fm_route_logits(const fm_moe_layer *l, const float *x, int e0, int e1, float *logits) {
    const int64_t H = l->hidden;
    for (int e = e0; e < e1; e++) {
        const float *w = l->router_w + (int64_t)e * H;
        float s[8] = {0};
        int64_t i = 0;
        for (; i + 8 <= H; i += 8)
            for (int j = 0; j < 8; j++) s[j] += x[i + j] * w[i + j];
        float r = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
        for (; i < H; i++) r += x[i] * w[i];
        logits[e - e0] = r;
    }
}

size_t fm_route_scratch_floats(int n_experts) { return (size_t)(n_experts > 0 ? n_experts : 1) * 5; }

/* Index of the best not-taken score; the lower index wins ties. */
static int argmax_free(const float *s, const float *taken, int n) {
    int best = -1;
    for (int e = 0; e < n; e++) {
        if (taken[e] != 0.0f) continue;
        if (best < 0 || s[e] > s[best]) best = e;
    }
    return best;
}

/* Masks the experts of all but the topk_group best groups with -inf. */
static void mask_groups(const fm_model_desc *d, int E, float *sel, float *gscore, float *gtaken) {
    int G = d->n_group, gs = E / G;
    for (int g = 0; g < G; g++) {
        const float *v = sel + (int64_t)g * gs;
        if (gs == 1) { gscore[g] = v[0]; continue; }
        int a = 0;
        for (int i = 1; i < gs; i++) if (v[i] > v[a]) a = i;
        int b = -1;
        for (int i = 0; i < gs; i++) if (i != a && (b < 0 || v[i] > v[b])) b = i;
        gscore[g] = v[a] + v[b];
    }
    for (int g = 0; g < G; g++) gtaken[g] = 0.0f;
    for (int i = 0; i < d->topk_group; i++) {
        int g = argmax_free(gscore, gtaken, G);
        gtaken[g] = 1.0f;
    }
    for (int g = 0; g < G; g++)
        if (gtaken[g] == 0.0f)
            for (int i = 0; i < gs; i++) sel[(int64_t)g * gs + i] = -INFINITY;
}

static void sort_pairs(int32_t *ids, float *w, int k) {
    for (int i = 1; i < k; i++) {
        int32_t id = ids[i];
        float wi = w[i];
        int j = i - 1;
        while (j >= 0 && ids[j] > id) { ids[j + 1] = ids[j]; w[j + 1] = w[j]; j--; }
        ids[j + 1] = id;
        w[j + 1] = wi;
    }
}

static float scaling(const fm_model_desc *d) {
    return d->routed_scaling_factor > 0.0f ? d->routed_scaling_factor : 1.0f;
}

/* sqrt(softplus(x)); softplus as PyTorch (linear above 20). */
static float sqrt_softplus(float x) { return sqrtf(x > 20.0f ? x : log1pf(expf(x))); }

fm_status fm_route_select(const fm_model_desc *d, const fm_moe_layer *l, int t,
                          const float *logits, const int32_t *token_id, int32_t *ids,
                          float *weights, float *scratch) {
    const int E = l->n_experts, k = l->topk;
    float *score = scratch, *sel = scratch + E, *taken = scratch + 2 * (int64_t)E;
    for (int e = 0; e < E; e++) {
        float z = logits[e] + (l->router_bias ? l->router_bias[e] : 0.0f);
        if (!isfinite(z))
            return fm_error(FM_E_NUMERIC, "layer %d, token %d: router logit of expert %d is %g", l->layer,
                            t, e, (double)z);
        score[e] = z;
    }

    if (d->route == FM_ROUTE_NOAUX_TC)
        for (int e = 0; e < E; e++) score[e] = 1.0f / (1.0f + expf(-score[e]));
    else if (d->route == FM_ROUTE_DSV4)
        for (int e = 0; e < E; e++) score[e] = sqrt_softplus(score[e]);

    if (fm_route_is_hash_layer(d, l)) {
        if (!token_id)
            return fm_error(FM_E_ARG,
                            "layer %d routes by token id (tid2eid, first %d layers): token ids are "
                            "required",
                            l->layer, d->n_hash_layers);
        int32_t tok = *token_id;
        if (tok < 0 || tok >= l->tid2eid_rows)
            return fm_error(FM_E_RANGE, "token %d: token id %d outside tid2eid's %lld rows", t, tok,
                            (long long)l->tid2eid_rows);
        const int32_t *row = l->tid2eid + (int64_t)tok * k;
        for (int j = 0; j < k; j++) {
            int32_t e = row[j];
            if (e < 0 || e >= E)
                return fm_error(FM_E_FORMAT, "tid2eid[%d][%d] = %d is not an expert index (E=%d)", tok,
                                j, e, E);
            for (int i = 0; i < j; i++)
                if (ids[i] == e)
                    return fm_error(FM_E_FORMAT, "tid2eid[%d] names expert %d twice", tok, e);
            ids[j] = e;
        }
    } else {
        for (int e = 0; e < E; e++) taken[e] = 0.0f;
        switch (d->route) {
        case FM_ROUTE_SOFTMAX: {
            float m = score[0];
            for (int e = 1; e < E; e++) m = score[e] > m ? score[e] : m;
            float sum = 0.0f;
            for (int e = 0; e < E; e++) { score[e] = expf(score[e] - m); sum += score[e]; }
            for (int e = 0; e < E; e++) { score[e] /= sum; sel[e] = score[e]; }
            break;
        }
        case FM_ROUTE_GPTOSS:
            for (int e = 0; e < E; e++) sel[e] = score[e];
            break;
        case FM_ROUTE_NOAUX_TC:
        case FM_ROUTE_DSV4:
            for (int e = 0; e < E; e++) sel[e] = score[e] + (l->score_bias ? l->score_bias[e] : 0.0f);
            if (uses_groups(d)) mask_groups(d, E, sel, scratch + 3 * (int64_t)E, scratch + 4 * (int64_t)E);
            break;
        }
        for (int j = 0; j < k; j++) {
            int e = argmax_free(sel, taken, E);
            taken[e] = 1.0f;
            ids[j] = e;
        }
    }

    for (int j = 0; j < k; j++) weights[j] = score[ids[j]];
    sort_pairs(ids, weights, k);

    switch (d->route) {
    case FM_ROUTE_GPTOSS: {
        float m = weights[0];
        for (int j = 1; j < k; j++) m = weights[j] > m ? weights[j] : m;
        float sum = 0.0f;
        for (int j = 0; j < k; j++) { weights[j] = expf(weights[j] - m); sum += weights[j]; }
        for (int j = 0; j < k; j++) weights[j] /= sum;
        break;
    }
    case FM_ROUTE_SOFTMAX:
        if (d->norm_topk_prob) {
            float sum = 0.0f;
            for (int j = 0; j < k; j++) sum += weights[j];
            for (int j = 0; j < k; j++) weights[j] /= sum;
        }
        break;
    case FM_ROUTE_NOAUX_TC:
    case FM_ROUTE_DSV4: {
        /* DeepSeek-V4 always renormalizes its sqrt-softplus weights. */
        if (d->norm_topk_prob || d->route == FM_ROUTE_DSV4) {
            float sum = 0.0f;
            for (int j = 0; j < k; j++) sum += weights[j];
            sum += 1e-20f;
            for (int j = 0; j < k; j++) weights[j] /= sum;
        }
        float f = scaling(d);
        for (int j = 0; j < k; j++) weights[j] *= f;
        break;
    }
    }
    return FM_OK;
}

fm_status fm_route(const fm_model_desc *d, const fm_moe_layer *l, const float *x, int T,
                   const int32_t *token_ids, int32_t *ids, float *weights) {
    fm_status st = fm_route_check(d, l);
    if (st) return st;
    if (T < 0) return fm_error(FM_E_ARG, "routing: negative token count %d", T);
    if (T == 0) return FM_OK;
    if (!x || !ids || !weights) return fm_error(FM_E_ARG, "routing: NULL buffer");
    const int E = l->n_experts, k = l->topk;
    float *logits = fm_malloc(sizeof(float) * ((size_t)E + fm_route_scratch_floats(E)));
    if (!logits) return FM_E_NOMEM;
    for (int t = 0; t < T && st == FM_OK; t++) {
        fm_route_logits(l, x + (int64_t)t * l->hidden, 0, E, logits);
        st = fm_route_select(d, l, t, logits, token_ids ? token_ids + t : NULL, ids + (int64_t)t * k,
                             weights + (int64_t)t * k, logits + E);
    }
    free(logits);
    return st;
}
