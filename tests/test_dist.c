/*
 * Sharding and combine logic of src/parallel against the unsharded layer.
 *
 * The engine here is a private float64 double of an MoE engine (softmax
 * top-k routing, experts dequantized with fm_qmatrix_dequant_row_f64), so
 * this file checks the views (pointer/stride arithmetic of the TP slices,
 * biases, EP views of a rank's experts), the dispatch/combine and the
 * collectives on their own. test_dist_engine.c repeats the equality with the real CPU
 * engine and routers.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fm_test.h"
#include "parallel/parallel_internal.h"
#include "util/util.h"

/* ------------------------------------------------------- the test engine */

static void dbl_route(const fm_moe_layer *l, const float *x, int T, int32_t *ids, float *w) {
    const int E = l->n_experts, k = l->topk, H = l->hidden;
    double *p = malloc(sizeof(double) * (size_t)E);
    for (int t = 0; t < T; t++) {
        double mx = -INFINITY, sum = 0;
        for (int e = 0; e < E; e++) {
            double a = 0;
            for (int h = 0; h < H; h++) a += (double)l->router_w[(size_t)e * H + h] * x[(size_t)t * H + h];
            p[e] = a;
            if (a > mx) mx = a;
        }
        for (int e = 0; e < E; e++) sum += (p[e] = exp(p[e] - mx));
        int32_t *id = ids + (size_t)t * k;
        float *wt = w + (size_t)t * k;
        double sel = 0;
        for (int j = 0; j < k; j++) { /* top-k, ties to the lower index */
            int best = -1;
            for (int e = 0; e < E; e++) {
                int used = 0;
                for (int q = 0; q < j; q++) used |= id[q] == e;
                if (!used && (best < 0 || p[e] > p[best])) best = e;
            }
            id[j] = best;
            sel += p[best] / sum;
        }
        for (int a = 0; a < k; a++) /* ascending ids */
            for (int b = a + 1; b < k; b++)
                if (id[b] < id[a]) {
                    int32_t ti = id[a];
                    id[a] = id[b];
                    id[b] = ti;
                }
        for (int j = 0; j < k; j++) wt[j] = (float)(p[id[j]] / sum / sel);
    }
    free(p);
}

static double act(const fm_model_desc *d, double g, double u) {
    if (d->act == FM_ACT_GPTOSS) {
        const double lim = d->swiglu_limit > 0 ? d->swiglu_limit : 7.0, al = d->swiglu_alpha > 0 ? d->swiglu_alpha : 1.702;
        if (g > lim) g = lim;
        if (u > lim) u = lim;
        if (u < -lim) u = -lim;
        return g / (1.0 + exp(-al * g)) * (u + 1.0);
    }
    if (d->swiglu_limit > 0) { /* DeepSeek-V4 clamped SiLU */
        const double lim = d->swiglu_limit;
        if (g > lim) g = lim;
        if (u > lim) u = lim;
        if (u < -lim) u = -lim;
    }
    return g / (1.0 + exp(-g)) * u;
}

/* y[t] += w[t] * expert(x[t]) in double for the n tokens rows[], each
 * weight row dequantized once. */
static void dbl_expert(const fm_model_desc *d, const fm_qmatrix *G, const fm_qmatrix *U, const fm_qmatrix *D,
                       const float *x, int n, const int *rows, const double *w, double *y) {
    const int64_t I = G->rows, H = G->cols;
    double *row = malloc(sizeof(double) * (size_t)(H > I ? H : I));
    double *g = malloc(sizeof(double) * (size_t)n), *hh = malloc(sizeof(double) * (size_t)n * I);
    for (int64_t i = 0; i < I; i++) {
        fm_qmatrix_dequant_row_f64(G, i, row);
        for (int q = 0; q < n; q++) {
            double a = 0;
            for (int64_t c = 0; c < H; c++) a += row[c] * x[(size_t)rows[q] * H + c];
            g[q] = a + (G->bias ? G->bias[i] : 0.0);
        }
        fm_qmatrix_dequant_row_f64(U, i, row);
        for (int q = 0; q < n; q++) {
            double a = 0;
            for (int64_t c = 0; c < H; c++) a += row[c] * x[(size_t)rows[q] * H + c];
            hh[(size_t)q * I + i] = act(d, g[q], a + (U->bias ? U->bias[i] : 0.0));
        }
    }
    for (int64_t o = 0; o < D->rows; o++) {
        fm_qmatrix_dequant_row_f64(D, o, row);
        for (int q = 0; q < n; q++) {
            double a = 0;
            for (int64_t i = 0; i < I; i++) a += row[i] * hh[(size_t)q * I + i];
            if (D->bias) a += D->bias[o];
            y[(size_t)rows[q] * H + o] += w[q] * a;
        }
    }
    free(row);
    free(g);
    free(hh);
}

/* y += the routed experts (ids, w: [T, k]; ids < 0 are skipped) and, with
 * shared, the shared expert, all in double. */
static void dbl_moe(const fm_model_desc *d, const fm_moe_layer *l, const float *x, int T, const int32_t *ids,
                    const float *w, int shared, double *y) {
    const int k = l->topk, E = l->n_experts;
    double *wq = malloc(sizeof(double) * (size_t)T);
    int *rows = malloc(sizeof(int) * (size_t)T);
    for (int e = 0; e < E; e++) {
        int n = 0;
        for (int t = 0; t < T; t++)
            for (int j = 0; j < k; j++)
                if (ids[(size_t)t * k + j] == e) {
                    rows[n] = t;
                    wq[n++] = w[(size_t)t * k + j];
                }
        if (n) dbl_expert(d, &l->gate[e], &l->up[e], &l->down[e], x, n, rows, wq, y);
    }
    if (shared && l->has_shared) {
        for (int t = 0; t < T; t++) {
            rows[t] = t;
            wq[t] = 1.0;
        }
        dbl_expert(d, &l->sh_gate, &l->sh_up, &l->sh_down, x, T, rows, wq, y);
    }
    free(wq);
    free(rows);
}

static int g_forward_calls;

static fm_status dbl_forward(void *ctx, int local, void *h, const fm_model_desc *d, const fm_moe_layer *l,
                             const void *xv, fm_dtype xdt, int T, const int32_t *tid, fm_moe_out *o) {
    (void)ctx;
    (void)local;
    (void)h;
    (void)tid;
    if (xdt != FM_DT_F32) return fm_error(FM_E_ARG, "test engine: F32 only");
    g_forward_calls++;
    const float *x = xv;
    const int H = l->hidden, k = l->topk;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)T * k);
    float *w = malloc(sizeof(float) * (size_t)T * k);
    double *y = calloc((size_t)T * H, sizeof(double));
    dbl_route(l, x, T, ids, w);
    dbl_moe(d, l, x, T, ids, w, 1, y);
    for (size_t q = 0; q < (size_t)T * H; q++) o->out[q] = (float)y[q];
    if (o->topk_ids) memcpy(o->topk_ids, ids, sizeof(int32_t) * (size_t)T * k);
    if (o->topk_weights) memcpy(o->topk_weights, w, sizeof(float) * (size_t)T * k);
    free(ids);
    free(w);
    free(y);
    return FM_OK;
}

static fm_status dbl_route_op(void *ctx, int local, const fm_model_desc *d, const fm_moe_layer *l, const float *x,
                              int T, const int32_t *tid, int32_t *ids, float *w) {
    (void)ctx;
    (void)local;
    (void)d;
    (void)tid;
    dbl_route(l, x, T, ids, w);
    return FM_OK;
}

/* Pre-routed experts in double; counts calls per local rank. */
static int g_experts_calls[FM_DIST_MAX_RANKS];

static fm_status dbl_experts(void *ctx, int local, void *h, const fm_model_desc *d, const fm_moe_layer *l,
                             const float *x, int T, const int32_t *ids, const float *w, int shared, float *out) {
    (void)ctx;
    (void)h;
    g_experts_calls[local]++;
    const int H = l->hidden, k = l->topk, E = l->n_experts;
    if (T < 1) return fm_error(FM_E_ARG, "test engine: T=%d", T);
    for (int q = 0; q < T * k; q++)
        if (ids[q] < -1 || ids[q] >= E) return fm_error(FM_E_RANGE, "test engine: id %d of %d experts", ids[q], E);
    double *y = calloc((size_t)T * H, sizeof(double));
    dbl_moe(d, l, x, T, ids, w, shared, y);
    for (size_t q = 0; q < (size_t)T * H; q++) out[q] = (float)y[q];
    free(y);
    return FM_OK;
}

static fm_dist_exec dbl_exec(void) {
    return (fm_dist_exec){
        .name = "float64 test engine", .forward = dbl_forward, .route = dbl_route_op, .experts = dbl_experts};
}

/* ------------------------------------------------------------- helpers */

typedef struct {
    fm_model_desc d;
    fm_moe_layer *l;
} model;

static int load(const char *preset, fm_qformat fmt, model *m) {
    if (fm_preset_desc(preset, fmt, &m->d) != FM_OK) {
        print_message("preset %s: %s\n", preset, fm_last_error());
        return -1;
    }
    int layer = m->d.first_dense;
    if (layer < m->d.n_hash_layers) layer = m->d.n_hash_layers; /* the test router does not hash */
    if (fm_moe_layer_random(&m->d, fmt, 1234, layer, &m->l) != FM_OK) {
        print_message("random layer %s/%s: %s\n", preset, fm_qformat_name(fmt), fm_last_error());
        return -1;
    }
    return 0;
}

static const char *k_presets[] = {"tiny-deepseek", "tiny-deepseek-v4", "tiny-qwen3", "tiny-mixtral", "tiny-gptoss"};

/* Runs one configuration; returns 0 ok, 1 refused as expected. */
static int run_case(const model *m, fm_dist_mode mode, int R, fm_dist_layout lay, fm_compress cz, int T,
                    const float *ref, const int32_t *ref_ids, const float *x, double tol, fm_dist_stats *st_out) {
    const int H = m->l->hidden, k = m->l->topk;
    fm_dist_opts o = {.mode = mode, .ranks = R, .layout = lay, .compress = cz};
    const int g = fm_qformat_block(m->l->fmt) > 0 ? fm_qformat_block(m->l->fmt) : 1;
    int expect_refusal = 0;
    if (mode == FM_DIST_TP)
        expect_refusal = m->l->inter % R || (m->l->inter / R) % g ||
                         (m->l->has_shared && (m->l->shared_inter % R || (m->l->shared_inter / R) % g));
    else
        expect_refusal = m->l->n_experts % R != 0;
    fm_comm *c = NULL;
    assert_int_equal(fm_comm_sim_new(R, &c), FM_OK);
    fm_dist *ds = NULL;
    fm_status s = fm_dist_new_exec(&m->d, m->l, &o, c, dbl_exec(), &ds);
    if (expect_refusal) {
        if (s != FM_E_ARG) print_message("expected a refusal for %s%d I=%d E=%d\n", fm_dist_mode_name(mode), R, m->l->inter, m->l->n_experts);
        assert_int_equal(s, FM_E_ARG);
        assert_non_null(strstr(fm_last_error(), mode == FM_DIST_TP ? "TP over" : "EP over"));
        fm_comm_free(c);
        return 1;
    }
    if (s) print_message("%s\n", fm_last_error());
    assert_int_equal(s, FM_OK);
    float *out = malloc(sizeof(float) * (size_t)T * H);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)T * k);
    float *w = malloc(sizeof(float) * (size_t)T * k);
    for (size_t i = 0; i < (size_t)T * H; i++) out[i] = NAN; /* every row must be written */
    fm_moe_out mo = {.out = out, .topk_ids = ids, .topk_weights = w};
    fm_dist_stats st;
    s = fm_dist_forward(ds, x, FM_DT_F32, T, NULL, &mo, &st);
    if (s) print_message("%s\n", fm_last_error());
    assert_int_equal(s, FM_OK);
    double e = fm_test_rel_err(out, ref, (size_t)T * H);
    if (getenv("FM_DIST_VERBOSE") || !(e <= tol))
        print_message("%s %s%d %s %s T=%d: rel err %.3g (bound %.3g)\n", m->d.family, fm_dist_mode_name(mode), R,
                      fm_dist_layout_name(lay), fm_compress_name(cz), T, e, tol);
    assert_true(e <= tol);
    if (cz == FM_COMPRESS_NONE) assert_memory_equal(ids, ref_ids, sizeof(int32_t) * (size_t)T * k);
    /* load figures: pairs add up to T*k (EP) and the imbalance is max/mean */
    int64_t sum = 0, mx = 0;
    for (int p = 0; p < R; p++) {
        sum += st.pairs[p];
        if (st.pairs[p] > mx) mx = st.pairs[p];
    }
    if (mode == FM_DIST_EP) {
        assert_int_equal(sum, (int64_t)T * k);
        int64_t cnt[FM_DIST_MAX_RANKS] = {0};
        for (int q = 0; q < T * k; q++) cnt[ids[q] / (m->l->n_experts / R)]++;
        for (int p = 0; p < R; p++) assert_int_equal(cnt[p], st.pairs[p]);
        assert_true(fabs(st.load_imbalance - (double)mx * R / (double)sum) < 1e-12);
    } else {
        assert_true(st.load_imbalance == 1.0);
    }
    if (st_out) *st_out = st;
    free(out);
    free(ids);
    free(w);
    fm_dist_free(ds);
    fm_comm_free(c);
    return 0;
}

/* --------------------------------------------------------------- tests */

static void unsharded(const model *m, const float *x, int T, float *ref, int32_t *ids, float *w) {
    fm_moe_out o = {.out = ref, .topk_ids = ids, .topk_weights = w};
    assert_int_equal(dbl_forward(NULL, 0, NULL, &m->d, m->l, x, FM_DT_F32, T, NULL, &o), FM_OK);
}

static void test_sharded_equals_unsharded(void **state) {
    (void)state;
    /* NVFP4 at two batch sizes; MXFP4 (32-blocks) and BF16 at one */
    const fm_qformat fmts[] = {FM_QF_NVFP4, FM_QF_MXFP4, FM_QF_BF16};
    int ran = 0, refused = 0, biased = 0;
    for (size_t pi = 0; pi < sizeof k_presets / sizeof *k_presets; pi++)
        for (size_t fi = 0; fi < 3; fi++) {
            model m;
            if (load(k_presets[pi], fmts[fi], &m)) fail();
            biased |= m.l->down[0].bias != NULL;
            const int H = m.l->hidden, k = m.l->topk;
            const int Ts[2] = {fi == 0 ? 1 : 5, 13}, nT = fi == 0 ? 2 : 1;
            for (int ti = 0; ti < nT; ti++) {
                const int T = Ts[ti];
                float *x = fm_test_normal_new((size_t)T * H, 7 + T, 99), *ref = malloc(sizeof(float) * (size_t)T * H);
                int32_t *rid = malloc(sizeof(int32_t) * (size_t)T * k);
                float *rw = malloc(sizeof(float) * (size_t)T * k);
                unsharded(&m, x, T, ref, rid, rw);
                for (int lay = 0; lay < 2; lay++) {
                    for (int R = 1; R <= 4; R *= 2) {
                        int r = run_case(&m, FM_DIST_TP, R, (fm_dist_layout)lay, FM_COMPRESS_NONE, T, ref, rid, x, 1e-5, NULL);
                        ran += !r;
                        refused += r;
                    }
                    for (int R = 1; R <= 8; R *= 2) {
                        int r = run_case(&m, FM_DIST_EP, R, (fm_dist_layout)lay, FM_COMPRESS_NONE, T, ref, rid, x, 1e-5, NULL);
                        ran += !r;
                        refused += r;
                    }
                }
                free(x);
                free(ref);
                free(rid);
                free(rw);
            }
            fm_moe_layer_free(m.l);
        }
    print_message("sharded runs equal to the unsharded layer: %d; refused as expected: %d\n", ran, refused);
    assert_true(ran > 150);
    assert_true(refused > 0); /* MXFP4 TP4 of I=64: a 16-wide slice of 32-blocks */
    assert_true(biased);      /* gpt-oss biases went through the TP slices      */
}

static void test_tp_view_is_zero_copy(void **state) {
    (void)state;
    model m;
    if (load("tiny-deepseek", FM_QF_NVFP4, &m)) fail();
    fm_model_desc dv;
    fm_moe_layer lv;
    fm_qmatrix *arr;
    const int R = 4, r = 2, n = m.l->inter / R;
    assert_int_equal(fm_dist_tp_view(&m.d, m.l, r, R, &dv, &lv, &arr), FM_OK);
    assert_int_equal(dv.moe_inter, n);
    assert_int_equal(lv.inter, n);
    const fm_qmatrix *g = &m.l->gate[3], *dn = &m.l->down[3];
    assert_ptr_equal(lv.gate[3].packed, g->packed + (int64_t)r * n * g->row_stride);
    assert_ptr_equal(lv.gate[3].scales, g->scales + (int64_t)r * n * g->scale_stride);
    assert_int_equal(lv.gate[3].row_stride, g->row_stride);
    assert_ptr_equal(lv.down[3].packed, dn->packed + r * n / 2);
    assert_ptr_equal(lv.down[3].scales, dn->scales + r * n / 16);
    assert_int_equal(lv.down[3].cols, n);
    assert_int_equal(lv.down[3].rows, m.l->hidden);
    assert_ptr_equal(lv.router_w, m.l->router_w);
    /* element (o, c) of the slice is element (o, r*n + c) of the layer */
    float *a = malloc(sizeof(float) * (size_t)m.l->inter), *b = malloc(sizeof(float) * (size_t)n);
    fm_qmatrix_dequant_row(dn, 5, a);
    fm_qmatrix_dequant_row(&lv.down[3], 5, b);
    assert_memory_equal(a + r * n, b, sizeof(float) * (size_t)n);
    free(a);
    free(b);
    free(arr);
    fm_moe_layer_free(m.l);
}

static void test_uneven_splits_rejected(void **state) {
    (void)state;
    model m;
    if (load("tiny-mixtral", FM_QF_NVFP4, &m)) fail(); /* I=96, E=8 */
    fm_dist_opts o = {.mode = FM_DIST_TP, .ranks = 5};
    assert_int_equal(fm_dist_check(&m.d, m.l, &o), FM_E_ARG);
    assert_non_null(strstr(fm_last_error(), "I=96 is not divisible by 5"));
    o.ranks = 4; /* 96/4 = 24, not a multiple of 16 */
    assert_int_equal(fm_dist_check(&m.d, m.l, &o), FM_E_ARG);
    assert_non_null(strstr(fm_last_error(), "not a multiple of the nvfp4 scale block (16)"));
    o.ranks = 2;
    assert_int_equal(fm_dist_check(&m.d, m.l, &o), FM_OK);
    o.mode = FM_DIST_EP;
    o.ranks = 3;
    assert_int_equal(fm_dist_check(&m.d, m.l, &o), FM_E_ARG);
    assert_non_null(strstr(fm_last_error(), "E=8 experts are not divisible by 3"));
    o.ranks = 0;
    assert_int_equal(fm_dist_check(&m.d, m.l, &o), FM_E_RANGE);
    o.ranks = FM_DIST_MAX_RANKS + 1;
    assert_int_equal(fm_dist_check(&m.d, m.l, &o), FM_E_RANGE);
    o.ranks = 2;
    o.compress = FM_COMPRESS_FP8; /* replicated tokens: nothing would be compressed */
    assert_int_equal(fm_dist_check(&m.d, m.l, &o), FM_E_ARG);
    assert_non_null(strstr(fm_last_error(), "token-sharded"));
    o.layout = FM_DIST_TOKEN_SHARDED;
    assert_int_equal(fm_dist_check(&m.d, m.l, &o), FM_OK);
    /* communicator and options must agree */
    fm_comm *c;
    fm_dist *ds;
    assert_int_equal(fm_comm_sim_new(4, &c), FM_OK);
    assert_int_equal(fm_dist_new_exec(&m.d, m.l, &o, c, dbl_exec(), &ds), FM_E_ARG);
    assert_null(ds);
    assert_non_null(strstr(fm_last_error(), "4 ranks"));
    fm_comm_free(c);
    fm_moe_layer_free(m.l);
}

static void test_bad_forward_inputs(void **state) {
    (void)state;
    model m;
    if (load("tiny-qwen3", FM_QF_NVFP4, &m)) fail();
    fm_dist_opts o = {.mode = FM_DIST_EP, .ranks = 2, .layout = FM_DIST_TOKEN_SHARDED, .compress = FM_COMPRESS_FP8};
    fm_comm *c;
    fm_dist *ds;
    assert_int_equal(fm_comm_sim_new(2, &c), FM_OK);
    assert_int_equal(fm_dist_new_exec(&m.d, m.l, &o, c, dbl_exec(), &ds), FM_OK);
    const int T = 3, H = m.l->hidden;
    float *x = fm_test_normal_new((size_t)T * H, 1, 99), *out = malloc(sizeof(float) * (size_t)T * H);
    fm_moe_out mo = {.out = out};
    assert_int_equal(fm_dist_forward(ds, x, FM_DT_F32, 0, NULL, &mo, NULL), FM_E_RANGE);
    assert_int_equal(fm_dist_forward(ds, x, FM_DT_I32, T, NULL, &mo, NULL), FM_E_ARG);
    x[H + 7] = NAN; /* token 1 lives on rank 0 (chunks of 2) */
    assert_int_equal(fm_dist_forward(ds, x, FM_DT_F32, T, NULL, &mo, NULL), FM_E_NUMERIC);
    assert_non_null(strstr(fm_last_error(), "token 1"));
    free(x);
    free(out);
    fm_dist_free(ds);
    fm_comm_free(c);
    fm_moe_layer_free(m.l);
}

/* Compressed activations: bounded error, fewer bytes. The bounds are those
 * of docs/parallel.md. */
static void test_compression_cost(void **state) {
    (void)state;
    const int T = 16;
    for (size_t pi = 0; pi < sizeof k_presets / sizeof *k_presets; pi++) {
        model m;
        if (load(k_presets[pi], FM_QF_NVFP4, &m)) fail();
        const int H = m.l->hidden, k = m.l->topk;
        float *x = fm_test_normal_new((size_t)T * H, 77, 99), *ref = malloc(sizeof(float) * (size_t)T * H);
        int32_t *rid = malloc(sizeof(int32_t) * (size_t)T * k);
        float *rw = malloc(sizeof(float) * (size_t)T * k);
        unsharded(&m, x, T, ref, rid, rw);
        for (int mode = FM_DIST_TP; mode <= FM_DIST_EP; mode++) {
            fm_dist_stats s0, s1, s2;
            run_case(&m, (fm_dist_mode)mode, 2, FM_DIST_TOKEN_SHARDED, FM_COMPRESS_NONE, T, ref, rid, x, 1e-5, &s0);
            run_case(&m, (fm_dist_mode)mode, 2, FM_DIST_TOKEN_SHARDED, FM_COMPRESS_FP8, T, ref, rid, x, 0.06, &s1);
            run_case(&m, (fm_dist_mode)mode, 2, FM_DIST_TOKEN_SHARDED, FM_COMPRESS_NVFP4, T, ref, rid, x, 0.25, &s2);
            assert_true(s1.comm_bytes < s0.comm_bytes);
            assert_true(s2.comm_bytes < s1.comm_bytes);
        }
        free(x);
        free(ref);
        free(rid);
        free(rw);
        fm_moe_layer_free(m.l);
    }
}

static void test_codec_rows(void **state) {
    (void)state;
    const int H = 256;
    float x[256], y[256];
    uint8_t buf[2048];
    for (int h = 0; h < H; h++) x[h] = fm_rng_normal(5, 6, (uint64_t)h) * (h % 7 == 0 ? 30.0f : 1.0f);
    x[3] = 0.0f;
    x[4] = -1e-30f;
    assert_int_equal(fm_codec_row_bytes(FM_COMPRESS_NONE, H), 4 * H);
    assert_int_equal(fm_codec_row_bytes(FM_COMPRESS_FP8, H), 4 + H);
    assert_int_equal(fm_codec_row_bytes(FM_COMPRESS_NVFP4, H), 4 + H / 2 + H / 16);
    assert_int_equal(fm_codec_row_bytes(FM_COMPRESS_NVFP4, 40), 0);
    assert_int_equal(fm_codec_encode_row(FM_COMPRESS_NONE, x, H, buf), FM_OK);
    fm_codec_decode_row(FM_COMPRESS_NONE, buf, H, y);
    assert_memory_equal(x, y, sizeof x);
    /* FP8: 3 mantissa bits -> relative error <= 2^-4 for normals; below the
     * smallest normal (2^-6 * scale) the absolute step is 2^-9 * scale. */
    float amax = 0;
    for (int h = 0; h < H; h++) amax = fmaxf(amax, fabsf(x[h]));
    assert_int_equal(fm_codec_encode_row(FM_COMPRESS_FP8, x, H, buf), FM_OK);
    fm_codec_decode_row(FM_COMPRESS_FP8, buf, H, y);
    const double sc = amax / 448.0;
    for (int h = 0; h < H; h++) assert_true(fabs((double)x[h] - y[h]) <= fabs(x[h]) / 16.0 + sc * 0x1p-10 + 1e-30);
    assert_true(y[3] == 0.0f);
    /* NVFP4: within a 16-block, error <= a quarter of the block max (E2M1
     * steps of up to 2 at the top of the [0, 6] range, plus scale rounding) */
    assert_int_equal(fm_codec_encode_row(FM_COMPRESS_NVFP4, x, H, buf), FM_OK);
    fm_codec_decode_row(FM_COMPRESS_NVFP4, buf, H, y);
    for (int b = 0; b < H / 16; b++) {
        float bm = 0;
        for (int i = 0; i < 16; i++) bm = fmaxf(bm, fabsf(x[b * 16 + i]));
        for (int i = 0; i < 16; i++) assert_true(fabs((double)x[b * 16 + i] - y[b * 16 + i]) <= 0.25 * bm + 1e-30);
    }
    /* an all-zero or denormal-scale row decodes to zeros, not NaN */
    float z[256] = {0};
    z[9] = 1e-40f;
    assert_int_equal(fm_codec_encode_row(FM_COMPRESS_NVFP4, z, H, buf), FM_OK);
    fm_codec_decode_row(FM_COMPRESS_NVFP4, buf, H, y);
    for (int h = 0; h < H; h++) assert_true(y[h] == 0.0f);
    assert_int_equal(fm_codec_encode_row(FM_COMPRESS_FP8, z, H, buf), FM_OK);
    fm_codec_decode_row(FM_COMPRESS_FP8, buf, H, y);
    for (int h = 0; h < H; h++) assert_true(isfinite(y[h]) && fabsf(y[h] - z[h]) <= 1e-40f);
    x[17] = INFINITY;
    assert_int_equal(fm_codec_encode_row(FM_COMPRESS_FP8, x, H, buf), FM_E_NUMERIC);
    assert_non_null(strstr(fm_last_error(), "column 17"));
}

/* The simulated collectives on hand-worked values. */
static void test_sim_collectives(void **state) {
    (void)state;
    enum { R = 3 };
    fm_comm *c;
    assert_int_equal(fm_comm_sim_new(R, &c), FM_OK);
    assert_int_equal(fm_comm_size(c), R);
    assert_int_equal(fm_comm_local_count(c), R);
    assert_int_equal(fm_comm_local_rank(c, 2), 2);
    assert_int_equal(fm_comm_device(c, 0), -1);
    /* all-reduce: rank r holds {r, 10r} -> {3, 30} everywhere */
    float a[R][2];
    float *ap[R];
    for (int r = 0; r < R; r++) {
        a[r][0] = (float)r;
        a[r][1] = 10.0f * r;
        ap[r] = a[r];
    }
    assert_int_equal(fm_comm_all_reduce_sum(c, ap, 2), FM_OK);
    for (int r = 0; r < R; r++) {
        assert_true(a[r][0] == 3.0f);
        assert_true(a[r][1] == 30.0f);
    }
    /* reduce-scatter: send[r][j] = 100r + j, 2 per block -> rank q gets
     * sum_r (100r + 2q + i) = 300 + 3(2q + i) */
    float s[R][2 * R], rv[R][2];
    const float *sp[R];
    float *rp[R];
    for (int r = 0; r < R; r++) {
        for (int j = 0; j < 2 * R; j++) s[r][j] = 100.0f * r + j;
        sp[r] = s[r];
        rp[r] = rv[r];
    }
    assert_int_equal(fm_comm_reduce_scatter_sum(c, sp, rp, 2), FM_OK);
    for (int q = 0; q < R; q++)
        for (int i = 0; i < 2; i++) assert_true(rv[q][i] == 300.0f + 3.0f * (2 * q + i));
    /* all-gather of 1 byte each */
    uint8_t gs[R], gr[R][R];
    const void *gsp[R];
    void *grp[R];
    for (int r = 0; r < R; r++) {
        gs[r] = (uint8_t)(40 + r);
        gsp[r] = &gs[r];
        grp[r] = gr[r];
    }
    assert_int_equal(fm_comm_all_gather(c, gsp, grp, 1), FM_OK);
    for (int r = 0; r < R; r++)
        for (int q = 0; q < R; q++) assert_int_equal(gr[r][q], 40 + q);
    /* all-to-allv: rank r sends r+1 bytes of value 10r+p to rank p */
    uint8_t ts[R][16], tr[R][16];
    size_t sb[R][R], rb[R][R];
    const void *tsp[R];
    void *trp[R];
    const size_t *sbp[R], *rbp[R];
    for (int r = 0; r < R; r++) {
        int at = 0;
        for (int p = 0; p < R; p++) {
            sb[r][p] = (size_t)r + 1;
            rb[r][p] = (size_t)p + 1;
            for (int b = 0; b <= r; b++) ts[r][at++] = (uint8_t)(10 * r + p);
        }
        tsp[r] = ts[r];
        trp[r] = tr[r];
        sbp[r] = sb[r];
        rbp[r] = rb[r];
    }
    assert_int_equal(fm_comm_all_to_allv(c, tsp, sbp, trp, rbp), FM_OK);
    for (int p = 0; p < R; p++) {
        int at = 0;
        for (int r = 0; r < R; r++)
            for (int b = 0; b <= r; b++) assert_int_equal(tr[p][at++], 10 * r + p);
    }
    fm_comm_stats cs;
    fm_comm_get_stats(c, &cs);
    assert_int_equal(cs.calls, 4);
    /* a receiver expecting another size is an error, not a silent overrun */
    rb[1][2] = 1;
    assert_int_equal(fm_comm_all_to_allv(c, tsp, sbp, trp, rbp), FM_E_ARG);
    assert_non_null(strstr(fm_last_error(), "rank 2 sends 3 bytes to rank 1"));
    assert_int_equal(fm_comm_all_reduce_sum(c, NULL, 2), FM_E_ARG);
    fm_comm_reset_stats(c);
    fm_comm_get_stats(c, &cs);
    assert_int_equal(cs.calls, 0);
    fm_comm_free(c);
    fm_comm *bad;
    assert_int_equal(fm_comm_sim_new(0, &bad), FM_E_RANGE);
    assert_null(bad);
}

static void test_names(void **state) {
    (void)state;
    fm_dist_layout l;
    fm_compress z;
    assert_int_equal(fm_dist_layout_from_name("token-sharded", &l), 0);
    assert_int_equal(l, FM_DIST_TOKEN_SHARDED);
    assert_string_equal(fm_dist_layout_name(l), "token-sharded");
    assert_int_equal(fm_dist_layout_from_name("diagonal", &l), -1);
    assert_int_equal(fm_compress_from_name("nvfp4", &z), 0);
    assert_string_equal(fm_compress_name(z), "nvfp4");
    assert_int_equal(fm_compress_from_name("fp6", &z), -1);
    assert_string_equal(fm_dist_mode_name(FM_DIST_EP), "ep");
}

/* EP computes a rank's pairs in one experts call per step (each expert's
 * weights are read once); forward runs only the shared expert, on the
 * ranks whose token chunk is not empty. TP token-sharded: one experts call
 * per rank (shared slice included), no forward. */
static void count_calls(const char *preset, fm_dist_mode mode, int lay, int R, int T) {
    model m;
    if (load(preset, FM_QF_NVFP4, &m)) fail();
    const int H = m.l->hidden, k = m.l->topk;
    float *x = fm_test_normal_new((size_t)T * H, 3, 99), *out = malloc(sizeof(float) * (size_t)T * H);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)T * k);
    fm_moe_out mo = {.out = out, .topk_ids = ids};
    fm_dist_opts o = {.mode = mode, .ranks = R, .layout = (fm_dist_layout)lay};
    fm_comm *c;
    fm_dist *ds;
    assert_int_equal(fm_comm_sim_new(R, &c), FM_OK);
    assert_int_equal(fm_dist_new_exec(&m.d, m.l, &o, c, dbl_exec(), &ds), FM_OK);
    for (int step = 1; step <= 2; step++) {
        g_forward_calls = 0;
        memset(g_experts_calls, 0, sizeof g_experts_calls);
        fm_dist_stats st;
        assert_int_equal(fm_dist_forward(ds, x, FM_DT_F32, T, NULL, &mo, &st), FM_OK);
        int chunks = 0;
        for (int p = 0; p < R; p++) chunks += p * ((T + R - 1) / R) < T;
        for (int p = 0; p < R; p++) {
            if (mode == FM_DIST_EP) assert_true(st.pairs[p] > 0); /* this seed loads every rank */
            assert_int_equal(g_experts_calls[p], 1);
        }
        assert_int_equal(g_forward_calls, mode == FM_DIST_EP && m.l->has_shared ? chunks : 0);
        if (mode == FM_DIST_EP) {
            unsigned char seen[64] = {0};
            int active = 0, sum_active = 0;
            for (int q = 0; q < T * k; q++) active += !seen[ids[q]]++;
            for (int p = 0; p < R; p++) sum_active += st.active[p];
            assert_int_equal(sum_active, active);
        }
    }
    fm_dist_free(ds);
    fm_comm_free(c);
    free(x);
    free(out);
    free(ids);
    fm_moe_layer_free(m.l);
}

static void test_one_experts_call_per_rank(void **state) {
    (void)state;
    for (int lay = 0; lay < 2; lay++) {
        count_calls("tiny-qwen3", FM_DIST_EP, lay, 4, 9);    /* no shared expert            */
        count_calls("tiny-deepseek", FM_DIST_EP, lay, 4, 9); /* shared: chunks 3, 3, 3 and 0 */
        count_calls("tiny-qwen3", FM_DIST_EP, lay, 8, 16);   /* 2 experts per rank < k = 4  */
    }
    count_calls("tiny-deepseek", FM_DIST_TP, FM_DIST_TOKEN_SHARDED, 2, 5);
}

/* bench's device path (an engine that times itself, TP with replicated
 * tokens): per-rank figures are the engine's, the total is the slowest rank
 * plus the all-reduce, speedup and efficiency follow from them. */
static fm_status fake_prepare(void *ctx, int local, const fm_model_desc *d, const fm_moe_layer *v, void **h) {
    (void)ctx;
    (void)local;
    (void)d;
    *h = (void *)(intptr_t)(v->inter + 1); /* remembers the width it was given */
    return FM_OK;
}
static fm_status fake_bench(void *ctx, int local, void *h, const fm_model_desc *d, const fm_moe_layer *v, int T,
                            uint64_t seed, int reps, double *us) {
    assert_int_equal(v->inter + 1, (int)(intptr_t)h); /* the view the handle came from */
    (void)ctx;
    (void)seed;
    (void)reps;
    (void)d;
    *us = (double)((intptr_t)h - 1) * T + 10.0 * local; /* width x T, rank 1 slower */
    return FM_OK;
}

static void test_bench_device_path(void **state) {
    (void)state;
    model m;
    if (load("tiny-qwen3", FM_QF_NVFP4, &m)) fail(); /* I=64 */
    fm_dist_exec ex = dbl_exec();
    ex.prepare = fake_prepare;
    ex.bench = fake_bench;
    fm_dist_opts o = {.mode = FM_DIST_TP, .ranks = 2};
    fm_comm *c;
    fm_dist *ds;
    assert_int_equal(fm_comm_sim_new(2, &c), FM_OK);
    assert_int_equal(fm_dist_new_exec(&m.d, m.l, &o, c, ex, &ds), FM_OK);
    fm_dist_bench_result r;
    assert_int_equal(fm_dist_bench(ds, 4, 1, 5, &r), FM_OK);
    assert_true(r.us_rank[0] == 32.0 * 4);        /* slice of 32 rows */
    assert_true(r.us_rank[1] == 32.0 * 4 + 10.0);
    assert_true(r.us_single == 64.0 * 4);         /* the whole layer  */
    assert_true(r.us_comm >= 0 && r.us_total == r.us_rank[1] + r.us_comm);
    assert_true(r.speedup == r.us_single / r.us_total && r.efficiency == r.speedup / 2);
    assert_int_equal(r.comm_bytes, 4 * m.l->hidden * (int64_t)sizeof(float));
    assert_non_null(strstr(r.method, "device"));
    fm_dist_free(ds);
    /* EP has no device path: ranks are timed through forward */
    o.mode = FM_DIST_EP;
    assert_int_equal(fm_dist_new_exec(&m.d, m.l, &o, c, dbl_exec(), &ds), FM_OK);
    assert_int_equal(fm_dist_bench(ds, 3, 1, 2, &r), FM_OK);
    assert_true(r.us_rank[0] > 0 && r.us_rank[1] > 0 && r.us_single > 0);
    assert_true(r.load_imbalance >= 1.0);
    assert_null(strstr(r.method, "device"));
    fm_dist_free(ds);
    fm_comm_free(c);
    fm_moe_layer_free(m.l);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names),
        cmocka_unit_test(test_sim_collectives),
        cmocka_unit_test(test_codec_rows),
        cmocka_unit_test(test_tp_view_is_zero_copy),
        cmocka_unit_test(test_uneven_splits_rejected),
        cmocka_unit_test(test_bad_forward_inputs),
        cmocka_unit_test(test_one_experts_call_per_rank),
        cmocka_unit_test(test_sharded_equals_unsharded),
        cmocka_unit_test(test_compression_cost),
        cmocka_unit_test(test_bench_device_path),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
