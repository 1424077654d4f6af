/*
 * Routing against hand-worked cases of every family (group masking, bias
 * used for selection only, ties, renormalization, scaling, hash layers) and
 * properties on random routers (permuting tokens permutes the result; a
 * batch routes as its tokens one by one).
 *
 * The hand cases use H = 2 and x = [1, 0], so a token's logits are the
 * first column of the router matrix; expected weights are recomputed here in
 * double from the formulas.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fm_test.h"
#include "util/util.h"

typedef struct {
    fm_model_desc d;
    fm_moe_layer l;
    float w[64 * 2];
} hand;

static void hand_init(hand *h, fm_route_kind kind, int E, int k, const double *logits) {
    memset(h, 0, sizeof *h);
    h->d.hidden = 2;
    h->d.n_experts = E;
    h->d.topk = k;
    h->d.route = kind;
    h->d.n_group = 1;
    h->d.topk_group = 1;
    h->d.routed_scaling_factor = 1.0f;
    h->d.act = FM_ACT_SILU;
    for (int e = 0; e < E; e++) {
        h->w[2 * e] = (float)logits[e];
        h->w[2 * e + 1] = 123.0f; /* multiplied by x[1] = 0 */
    }
    h->l.hidden = 2;
    h->l.n_experts = E;
    h->l.topk = k;
    h->l.router_w = h->w;
}

static const float x10[2] = {1.0f, 0.0f};

static double sig(double z) { return 1.0 / (1.0 + exp(-z)); }
static double ssp(double z) { return sqrt(log1p(exp(z))); }

static void route1(hand *h, const int32_t *tok, int32_t *ids, float *w) {
    fm_status st = fm_route(&h->d, &h->l, x10, 1, tok, ids, w);
    if (st) fprintf(stderr, "fm_route: %s\n", fm_last_error());
    assert_int_equal(st, FM_OK);
}

static void test_noaux_groups_bias_ties(void **s) {
    (void)s;
    /* Groups of 2: {0,1} {2,3} {4,5} {6,7}. Biased scores:
     *   0: .881  1: .269 | 2: .818  3: .599 | 4: .953-2  5: .047 | 6: .731  7: .731
     * group scores (top-2 sums) 1.150 | 1.416 | -1.000 | 1.462 -> keep {6,7} and {2,3}.
     * Expert 0 beats 6 but its group is dropped; expert 4 has the best raw
     * score but the bias (selection only) removes it; 6 and 7 tie -> 6. */
    const double lg[8] = {2.0, -1.0, 1.5, 0.4, 3.0, -3.0, 1.0, 1.0};
    float bias[8] = {0, 0, 0, 0, -2.0f, 0, 0, 0};
    hand h;
    hand_init(&h, FM_ROUTE_NOAUX_TC, 8, 2, lg);
    h.d.n_group = 4;
    h.d.topk_group = 2;
    h.d.norm_topk_prob = 1;
    h.d.routed_scaling_factor = 2.5f;
    h.l.score_bias = bias;
    int32_t ids[2];
    float w[2];
    route1(&h, NULL, ids, w);
    assert_int_equal(ids[0], 2);
    assert_int_equal(ids[1], 6);
    double s2 = sig(1.5), s6 = sig(1.0);
    assert_float_equal(w[0], 2.5 * s2 / (s2 + s6), 1e-6);
    assert_float_equal(w[1], 2.5 * s6 / (s2 + s6), 1e-6);

    /* Without renormalization: the unbiased sigmoid times the factor. */
    h.d.norm_topk_prob = 0;
    route1(&h, NULL, ids, w);
    assert_float_equal(w[0], 2.5 * s2, 1e-6);
    assert_float_equal(w[1], 2.5 * s6, 1e-6);

    /* Without groups expert 0 is back and 4 still loses to the bias. */
    h.d.n_group = 1;
    h.d.topk_group = 1;
    route1(&h, NULL, ids, w);
    assert_int_equal(ids[0], 0);
    assert_int_equal(ids[1], 2);
}

static void test_noaux_dropped_groups_are_minus_inf(void **s) {
    (void)s;
    /* Every kept score is negative after the bias. DeepSeek's -inf masking
     * keeps the choice inside the kept group; HF's 0.0 masking would pick
     * experts 2 and 3 of the dropped group. fp4moe follows DeepSeek. */
    const double lg[4] = {0, 0, 0, 0};
    float bias[4] = {-1.0f, -1.0f, -3.0f, -3.0f};
    hand h;
    hand_init(&h, FM_ROUTE_NOAUX_TC, 4, 2, lg);
    h.d.n_group = 2;
    h.d.topk_group = 1;
    h.d.norm_topk_prob = 1;
    h.l.score_bias = bias;
    int32_t ids[2];
    float w[2];
    route1(&h, NULL, ids, w);
    assert_int_equal(ids[0], 0);
    assert_int_equal(ids[1], 1);
    assert_float_equal(w[0], 0.5, 1e-6);
    assert_float_equal(w[1], 0.5, 1e-6);
}

static void test_softmax_qwen_mixtral(void **s) {
    (void)s;
    /* Experts 1, 3, 4 tie at the top: the two lower indices win. */
    const double lg[5] = {1.0, 3.0, 2.0, 3.0, 3.0};
    hand h;
    hand_init(&h, FM_ROUTE_SOFTMAX, 5, 2, lg);
    int32_t ids[2];
    float w[2];
    route1(&h, NULL, ids, w);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], 3);
    double z = exp(1.0) + 3 * exp(3.0) + exp(2.0);
    assert_float_equal(w[0], exp(3.0) / z, 1e-7); /* Qwen3 without norm_topk_prob */
    assert_float_equal(w[1], exp(3.0) / z, 1e-7);
    h.d.norm_topk_prob = 1; /* Mixtral, Qwen3 with norm_topk_prob */
    route1(&h, NULL, ids, w);
    assert_float_equal(w[0], 0.5, 1e-7);
    assert_float_equal(w[1], 0.5, 1e-7);

    /* Unequal: top-2 of softmax, renormalized. */
    const double lg2[4] = {0.1, -0.5, 0.7, 0.3};
    hand_init(&h, FM_ROUTE_SOFTMAX, 4, 2, lg2);
    h.d.norm_topk_prob = 1;
    route1(&h, NULL, ids, w);
    assert_int_equal(ids[0], 2);
    assert_int_equal(ids[1], 3);
    assert_float_equal(w[0], exp(0.7) / (exp(0.7) + exp(0.3)), 1e-7);
}

static void test_gptoss(void **s) {
    (void)s;
    /* logits + bias = [0.5, 1.0, -1.0, 1.6]: top-2 {3, 1}, softmax over the two. */
    const double lg[4] = {0.5, 2.0, -1.0, 1.0};
    float rb[4] = {0, -1.0f, 0, 0.6f};
    hand h;
    hand_init(&h, FM_ROUTE_GPTOSS, 4, 2, lg);
    h.l.router_bias = rb;
    int32_t ids[2];
    float w[2];
    route1(&h, NULL, ids, w);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], 3);
    assert_float_equal(w[0], 1.0 / (1.0 + exp(0.6)), 1e-7);
    assert_float_equal(w[1], exp(0.6) / (1.0 + exp(0.6)), 1e-7);
}

static void test_dsv4_and_hash(void **s) {
    (void)s;
    /* s = sqrt(softplus(l)) = [.560, .987, 1.458, .893]; + bias -> [.560, 1.487, .458, .893]. */
    const double lg[4] = {-1.0, 0.5, 2.0, 0.2};
    float bias[4] = {0, 0.5f, -1.0f, 0};
    int32_t t2e[3 * 2] = {3, 0, 2, 1, 0, 2};
    hand h;
    hand_init(&h, FM_ROUTE_DSV4, 4, 2, lg);
    h.d.routed_scaling_factor = 1.5f;
    h.d.n_hash_layers = 1;
    h.l.layer = 1; /* not a hash layer */
    h.l.score_bias = bias;
    h.l.tid2eid = t2e;
    h.l.tid2eid_rows = 3;
    int32_t ids[2];
    float w[2];
    route1(&h, NULL, ids, w);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], 3);
    double a = ssp(0.5), b = ssp(0.2);
    assert_float_equal(w[0], 1.5 * a / (a + b), 1e-6);
    assert_float_equal(w[1], 1.5 * b / (a + b), 1e-6);

    /* Layer 0 routes by token id: tid2eid[1] = {2, 1}, weighed by s. */
    h.l.layer = 0;
    int32_t tok = 1;
    route1(&h, &tok, ids, w);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], 2);
    double c = ssp(2.0);
    assert_float_equal(w[0], 1.5 * a / (a + c), 1e-6);
    assert_float_equal(w[1], 1.5 * c / (a + c), 1e-6);

    /* Token ids missing, out of range; a bad tid2eid row. */
    assert_int_equal(fm_route(&h.d, &h.l, x10, 1, NULL, ids, w), FM_E_ARG);
    assert_non_null(strstr(fm_last_error(), "token id"));
    tok = 3;
    assert_int_equal(fm_route(&h.d, &h.l, x10, 1, &tok, ids, w), FM_E_RANGE);
    t2e[0] = 0;
    tok = 0;
    assert_int_equal(fm_route(&h.d, &h.l, x10, 1, &tok, ids, w), FM_E_FORMAT);
    assert_non_null(strstr(fm_last_error(), "twice"));
    t2e[0] = 7;
    assert_int_equal(fm_route(&h.d, &h.l, x10, 1, &tok, ids, w), FM_E_FORMAT);
}

static void test_bad_configs(void **s) {
    (void)s;
    const double lg[8] = {0};
    hand h;
    int32_t ids[8];
    float w[8];
    hand_init(&h, FM_ROUTE_SOFTMAX, 8, 9, lg);
    h.d.topk = 9;
    assert_int_equal(fm_route(&h.d, &h.l, x10, 1, NULL, ids, w), FM_E_RANGE);
    hand_init(&h, FM_ROUTE_NOAUX_TC, 8, 2, lg);
    h.d.n_group = 3;
    assert_int_equal(fm_route(&h.d, &h.l, x10, 1, NULL, ids, w), FM_E_RANGE);
    h.d.n_group = 4;
    h.d.topk_group = 5;
    assert_int_equal(fm_route(&h.d, &h.l, x10, 1, NULL, ids, w), FM_E_RANGE);
    h.d.topk_group = 1;
    h.d.topk = h.l.topk = 3; /* 3 > 1 kept group of 2 */
    assert_int_equal(fm_route(&h.d, &h.l, x10, 1, NULL, ids, w), FM_E_RANGE);
    hand_init(&h, FM_ROUTE_SOFTMAX, 8, 2, lg);
    h.d.hidden = 4; /* description and layer disagree */
    assert_int_equal(fm_route(&h.d, &h.l, x10, 1, NULL, ids, w), FM_E_ARG);
    hand_init(&h, FM_ROUTE_SOFTMAX, 8, 2, lg);
    h.w[4] = NAN;
    assert_int_equal(fm_route(&h.d, &h.l, x10, 1, NULL, ids, w), FM_E_NUMERIC);
    assert_non_null(strstr(fm_last_error(), "expert 2"));
}

/* Properties on random routers of every tiny preset. */
static void test_properties_random(void **s) {
    (void)s;
    static const char *presets[] = {"tiny-deepseek", "tiny-deepseek-v4", "tiny-qwen3", "tiny-mixtral", "tiny-gptoss"};
    enum { T = 11 };
    for (size_t p = 0; p < sizeof presets / sizeof *presets; p++) {
        fm_model_desc d;
        assert_int_equal(fm_preset_desc(presets[p], FM_QF_NONE, &d), FM_OK);
        for (int layer = 0; layer < d.n_layers; layer++) {
            if (!fm_model_is_moe_layer(&d, layer)) continue;
            fm_moe_layer *l = NULL;
            assert_int_equal(fm_moe_layer_random(&d, FM_QF_NONE, 42, layer, &l), FM_OK);
            const int H = d.hidden, k = d.topk;
            float *x = malloc(sizeof(float) * T * H), *xp = malloc(sizeof(float) * T * H);
            int32_t tok[T], tokp[T], ids[T * 8], idp[T * 8], id1[8];
            float w[T * 8], wp[T * 8], w1[8];
            int perm[T];
            fm_test_normal(x, (size_t)T * H, 7, (uint64_t)p);
            fm_test_token_ids(tok, T, 9, 1, d.vocab_size);
            for (int t = 0; t < T; t++) perm[t] = (t * 7 + 3) % T; /* a permutation since gcd(7, 11) = 1 */
            for (int t = 0; t < T; t++) {
                memcpy(xp + t * H, x + perm[t] * H, sizeof(float) * H);
                tokp[t] = tok[perm[t]];
            }
            assert_int_equal(fm_route(&d, l, x, T, tok, ids, w), FM_OK);
            assert_int_equal(fm_route(&d, l, xp, T, tokp, idp, wp), FM_OK);
            for (int t = 0; t < T; t++) {
                assert_memory_equal(idp + t * k, ids + perm[t] * k, sizeof(int32_t) * k);
                assert_memory_equal(wp + t * k, w + perm[t] * k, sizeof(float) * k);
                assert_int_equal(fm_route(&d, l, x + t * H, 1, tok + t, id1, w1), FM_OK);
                assert_memory_equal(id1, ids + t * k, sizeof(int32_t) * k);
                assert_memory_equal(w1, w + t * k, sizeof(float) * k);
                for (int j = 0; j < k; j++) {
                    assert_true(ids[t * k + j] >= 0 && ids[t * k + j] < d.n_experts);
                    if (j) assert_true(ids[t * k + j - 1] < ids[t * k + j]);
                    assert_true(w[t * k + j] > 0.0f);
                }
            }
            free(x);
            free(xp);
            fm_moe_layer_free(l);
        }
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_noaux_groups_bias_ties),
        cmocka_unit_test(test_noaux_dropped_groups_are_minus_inf),
        cmocka_unit_test(test_softmax_qwen_mixtral),
        cmocka_unit_test(test_gptoss),
        cmocka_unit_test(test_dsv4_and_hash),
        cmocka_unit_test(test_bad_configs),
        cmocka_unit_test(test_properties_random),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
