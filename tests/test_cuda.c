/* CUDA backend against the float64 CPU reference (skipped without a GPU). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "fp4moe.h"
#ifdef FM_HAVE_CUDA
#include <cuda_runtime.h>
#endif
#include "io/io_internal.h"
#include "fm_test.h"
#include "util/util.h"

static fm_cuda_engine *g_eng;
#define RT_TEST_MAXK 32 /* the CUDA routing's largest top-k */
static char g_why[256];

static int need_gpu(void) {
    if (g_eng) return 1;
    printf("SKIPPED: no CUDA GPU (%s)\n", g_why);
    return 0;
}
#define NEED_GPU()                 \
    do {                           \
        if (!need_gpu()) skip();   \
    } while (0)

static int setup(void **state) {
    (void)state;
    if (!fm_cuda_available(g_why, sizeof g_why)) return 0;
    if (fm_cuda_engine_new(0, &g_eng) != FM_OK) {
        snprintf(g_why, sizeof g_why, "%s", fm_last_error());
        g_eng = NULL;
    } else {
        printf("# %s\n", fm_cuda_engine_describe(g_eng));
    }
    return 0;
}
static int teardown(void **state) {
    (void)state;
    fm_cuda_engine_free(g_eng);
    g_eng = NULL;
    return 0;
}

/* Two runs of one call whose output rows are sums added with atomics (the
 * one-token launch): the same values to rounding, every element within
 * 1e-5 of the largest magnitude (a NaN or a stale sum fails). */
static void assert_runs_close(const float *a, const float *b, size_t n, const char *what) {
    double mx = 0, md = 0;
    for (size_t i = 0; i < n; i++) {
        if (fabs(a[i]) > mx) mx = fabs(a[i]);
        const double dd = fabs((double)a[i] - b[i]);
        if (!(dd <= md)) md = dd;
    }
    if (!(mx > 0) || !(md <= 1e-5 * mx)) fail_msg("%s: two runs differ by %.3e of %.3e", what, md, mx);
}

/* Random BF16 activations (N(0,1)) and their FP32 values. */
static void make_x(uint64_t seed, int T, int H, uint16_t *xb, float *xf) {
    for (int64_t i = 0; i < (int64_t)T * H; i++) {
        xb[i] = fm_f32_to_bf16(fm_rng_normal(seed, 77, (uint64_t)i));
        xf[i] = fm_bf16_to_f32(xb[i]);
    }
}

typedef struct {
    double rel;       /* ||gpu - ref|| / ||ref||                          */
    int id_mismatch;  /* top-k ids that differ from fm_route              */
    double wt_err;    /* max relative difference of the routing weights   */
    int nonfinite;    /* outputs not finite (poison left or NaN produced) */
} cmp_result;

/* Runs engine e's forward on a poisoned output and the reference, compares. */
static void run_compare_eng(fm_cuda_engine *e, const fm_model_desc *d, const fm_moe_layer *hl, fm_cuda_layer *cl,
                            int T, const void *x, fm_dtype xdt, const int32_t *tok, cmp_result *r) {
    int H = d->hidden, k = d->topk;
    float *out = malloc(sizeof(float) * (size_t)T * H), *ref = malloc(sizeof(float) * (size_t)T * H);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)T * k), *rids = malloc(sizeof(int32_t) * (size_t)T * k);
    float *w = malloc(sizeof(float) * (size_t)T * k), *rw = malloc(sizeof(float) * (size_t)T * k);
    assert_non_null(out); assert_non_null(ref); assert_non_null(ids); assert_non_null(rids);
    assert_non_null(w); assert_non_null(rw);
    for (int64_t i = 0; i < (int64_t)T * H; i++) out[i] = NAN;
    for (int64_t i = 0; i < (int64_t)T * k; i++) { ids[i] = -1; w[i] = NAN; }
    fm_moe_out o = {out, ids, w};
    fm_status s = fm_cuda_forward(e, d, cl, x, xdt, T, tok, &o);
    if (s) fail_msg("fm_cuda_forward: %s", fm_last_error());
    fm_moe_out ro = {ref, rids, rw};
    s = fm_moe_forward_ref(d, hl, x, xdt, T, tok, &ro);
    if (s) fail_msg("fm_moe_forward_ref: %s", fm_last_error());
    double num = 0, den = 0;
    r->nonfinite = 0;
    for (int64_t i = 0; i < (int64_t)T * H; i++) {
        if (!isfinite(out[i])) { r->nonfinite++; continue; }
        double dd = (double)out[i] - ref[i];
        num += dd * dd;
        den += (double)ref[i] * ref[i];
    }
    r->rel = den > 0 ? sqrt(num / den) : sqrt(num);
    r->id_mismatch = 0;
    r->wt_err = 0;
    for (int64_t i = 0; i < (int64_t)T * k; i++) {
        if (ids[i] != rids[i]) r->id_mismatch++;
        double e = fabs((double)w[i] - rw[i]) / (fabs((double)rw[i]) + 1e-30);
        if (!(e <= r->wt_err)) r->wt_err = e;
    }
    free(out); free(ref); free(ids); free(rids); free(w); free(rw);
}

static void run_compare_dt(const fm_model_desc *d, const fm_moe_layer *hl, fm_cuda_layer *cl, int T,
                           const void *x, fm_dtype xdt, const int32_t *tok, cmp_result *r) {
    run_compare_eng(g_eng, d, hl, cl, T, x, xdt, tok, r);
}

static void run_compare(const fm_model_desc *d, const fm_moe_layer *hl, fm_cuda_layer *cl, int T,
                        const uint16_t *xb, const int32_t *tok, cmp_result *r) {
    run_compare_dt(d, hl, cl, T, xb, FM_DT_BF16, tok, r);
}

/* The checks of every comparison with the reference, after a line naming the
 * case (printf format and arguments) with its figures: no non-finite
 * output, identical top-k ids, the routing weights to 1e-4 (check_weights),
 * relative error at most 5e-3. */
static void check_ref(const cmp_result *r, int check_weights, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("# ");
    vprintf(fmt, ap);
    va_end(ap);
    printf(" rel %.2e ids %d weights %.1e\n", r->rel, r->id_mismatch, r->wt_err);
    assert_int_equal(r->nonfinite, 0);
    assert_int_equal(r->id_mismatch, 0);
    if (check_weights) assert_true(r->wt_err < 1e-4);
    assert_true(r->rel <= 5e-3);
}

/* run_compare on T tokens of make_x(x_seed) activations (tok: the token ids
 * or NULL), then check_ref with the weights checked, the case named by the
 * printf format and arguments. */
static void compare_x(const fm_model_desc *d, const fm_moe_layer *hl, fm_cuda_layer *cl, int T, uint64_t x_seed,
                      const int32_t *tok, const char *fmt, ...) {
    const int H = d->hidden;
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)T * H);
    float *xf = malloc(sizeof(float) * (size_t)T * H);
    assert_non_null(xb); assert_non_null(xf);
    make_x(x_seed, T, H, xb, xf);
    cmp_result r;
    run_compare(d, hl, cl, T, xb, tok, &r);
    char label[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(label, sizeof label, fmt, ap);
    va_end(ap);
    check_ref(&r, 1, "%s", label);
    free(xb); free(xf);
}

static int first_moe_layer(const fm_model_desc *d, int want_hash) {
    for (int L = 0; L < d->n_layers; L++) {
        if (!fm_model_is_moe_layer(d, L)) continue;
        int hash = d->route == FM_ROUTE_DSV4 && L < d->n_hash_layers;
        if (hash == want_hash) return L;
    }
    return -1;
}

static const char *k_tiny[] = {"tiny-deepseek", "tiny-deepseek-v4", "tiny-qwen3", "tiny-mixtral", "tiny-gptoss"};

/* Every tiny preset (every routing family), both formats, B = 1, 7, 20, 32,
 * 33, 130 (not multiples of the tiles; many experts get no token at B = 1
 * and 7; 20 and 32 select in 3 and 4 token tiles of the fused logits kernel,
 * 33 is the first of the separate selection kernel). */
static void test_vs_reference(void **state) {
    (void)state;
    NEED_GPU();
    const int Ts[] = {1, 7, 20, 32, 33, 130};
    const fm_qformat fmts[] = {FM_QF_NVFP4, FM_QF_MXFP4};
    for (size_t pi = 0; pi < sizeof k_tiny / sizeof k_tiny[0]; pi++)
        for (int fi = 0; fi < 2; fi++)
            for (int hash = 0; hash < 2; hash++) {
                fm_model_desc d;
                assert_int_equal(fm_preset_desc(k_tiny[pi], fmts[fi], &d), FM_OK);
                int L = first_moe_layer(&d, hash);
                if (L < 0) continue;
                uint64_t seed = 1000 + pi * 10 + fi * 2 + hash;
                fm_moe_layer *hl;
                if (fm_moe_layer_random(&d, fmts[fi], seed, L, &hl)) fail_msg("random layer: %s", fm_last_error());
                fm_cuda_layer *cl;
                if (fm_cuda_layer_upload(g_eng, &d, hl, &cl)) fail_msg("upload: %s", fm_last_error());
                for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
                    int T = Ts[ti], H = d.hidden;
                    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)T * H);
                    float *xf = malloc(sizeof(float) * (size_t)T * H);
                    int32_t *tok = malloc(sizeof(int32_t) * (size_t)T);
                    assert_non_null(xb); assert_non_null(xf); assert_non_null(tok);
                    make_x(seed * 31 + T, T, H, xb, xf);
                    fm_test_token_ids(tok, T, seed, 5, d.vocab_size);
                    cmp_result r;
                    run_compare(&d, hl, cl, T, xb, tok, &r);
                    check_ref(&r, 1, "%-16s %s layer %d T=%3d", k_tiny[pi], fm_qformat_name(fmts[fi]), L, T);
                    free(xb); free(xf); free(tok);
                }
                fm_cuda_layer_free(cl);
                fm_moe_layer_free(hl);
            }
}


/* One tiny preset's layer against the float64 reference with F32, F16 and
 * BF16 activations (F32 values drawn at full precision) at each T of Ts;
 * nudge: every third router weight moved one FP32 ulp first, so that the
 * router is not exact in BF16. */
static void compare_dtypes(const char *preset, uint64_t layer_seed, uint64_t x_seed, const int *Ts, int nT, int nudge,
                           const char *what) {
    fm_model_desc d;
    assert_int_equal(fm_preset_desc(preset, FM_QF_NVFP4, &d), FM_OK);
    const int L = first_moe_layer(&d, 0), H = d.hidden, E = d.n_experts;
    assert_true(L >= 0);
    fm_moe_layer *hl;
    if (fm_moe_layer_random(&d, FM_QF_NVFP4, layer_seed, L, &hl)) fail_msg("random layer: %s", fm_last_error());
    if (nudge) {
        float *rw = (float *)hl->router_w;
        for (int64_t i = 0; i < (int64_t)E * H; i += 3) rw[i] = nextafterf(rw[i], INFINITY);
    }
    fm_cuda_layer *cl;
    if (fm_cuda_layer_upload(g_eng, &d, hl, &cl)) fail_msg("upload: %s", fm_last_error());
    for (int ti = 0; ti < nT; ti++) {
        const int T = Ts[ti];
        float *xf = malloc(sizeof(float) * (size_t)T * H);
        uint16_t *xh = malloc(sizeof(uint16_t) * (size_t)T * H), *xb = malloc(sizeof(uint16_t) * (size_t)T * H);
        assert_non_null(xf); assert_non_null(xh); assert_non_null(xb);
        for (int64_t i = 0; i < (int64_t)T * H; i++) {
            xf[i] = fm_rng_normal(x_seed + T, 3, (uint64_t)i);
            xh[i] = fm_f32_to_f16(xf[i]);
            xb[i] = fm_f32_to_bf16(xf[i]);
        }
        const void *xs[3] = {xf, xh, xb};
        const fm_dtype dts[3] = {FM_DT_F32, FM_DT_F16, FM_DT_BF16};
        for (int di = 0; di < 3; di++) {
            cmp_result r;
            run_compare_dt(&d, hl, cl, T, xs[di], dts[di], NULL, &r);
            check_ref(&r, 1, "%-16s %s%s input T=%3d", preset, what, fm_dtype_name(dts[di]), T);
        }
        free(xf); free(xh); free(xb);
    }
    fm_cuda_layer_free(cl);
    fm_moe_layer_free(hl);
}

/* Activations given as F32 and F16, not only BF16: the router reads them at
 * full precision (the GEMV shape at T = 7, the tensor-core logits at 130,
 * whose lower terms are only non-zero for values that are not BF16) and the
 * experts read them rounded to BF16. */
static void test_input_dtypes(void **state) {
    (void)state;
    NEED_GPU();
    const int Ts[] = {7, 130};
    compare_dtypes("tiny-deepseek", 77, 500, Ts, 2, 0, "");
    compare_dtypes("tiny-qwen3", 78, 507, Ts, 2, 0, "");
}

/* A router that is not exact in BF16 (every third weight moved one FP32 ulp)
 * takes the TF32 logits instead of the BF16 ones where the SGEMM shape runs
 * (these small shapes at T = 130, the GEMV shape at T = 33); against
 * the float64 reference, with F32, F16 and BF16 activations. */
static void test_router_not_bf16(void **state) {
    (void)state;
    NEED_GPU();
    const int Ts[] = {33, 130};
    compare_dtypes("tiny-deepseek-v4", 313, 900, Ts, 2, 1, "router not BF16, ");
    compare_dtypes("tiny-qwen3", 314, 907, Ts, 2, 1, "router not BF16, ");
}

/* The debugging switches: the shared expert inside the routed launches
 * instead of on its own stream, no programmatic dependent launch, each alone
 * and both, and the router logits without cuBLAS (fp4moe's BF16 mma.sync
 * kernel at T = 130, the kernel that runs where cuBLAS cannot be loaded),
 * against the float64 reference on presets with a shared expert (engines
 * made under each setting; the switches are read when an engine is
 * created). */
static void test_launch_switches(void **state) {
    (void)state;
    NEED_GPU();
    const char *presets[] = {"tiny-deepseek", "tiny-deepseek-v4"};
    enum { NSW = 3 };
    static const char *names[NSW] = {"FP4MOE_CUDA_SH_FORK", "FP4MOE_CUDA_PDL", "FP4MOE_CUDA_BLAS"};
    const char *sets[][NSW] = {{"0", "", ""}, {"", "0", ""}, {"0", "0", ""}, {"1", "1", "1"}, {"", "", "0"}};
    const int Ts[] = {1, 7, 130};
    fm_cuda_engine *saved = g_eng;
    for (size_t si = 0; si < sizeof sets / sizeof sets[0]; si++) {
        for (int v = 0; v < NSW; v++) setenv(names[v], sets[si][v], 1);
        fm_cuda_engine *e = NULL;
        fm_status es = fm_cuda_engine_new(0, &e);
        for (int v = 0; v < NSW; v++) unsetenv(names[v]);
        if (es) fail_msg("engine: %s", fm_last_error());
        printf("# engine: %s\n", fm_cuda_engine_describe(e));
        if (!strcmp(sets[si][2], "0") && !strstr(fm_cuda_engine_describe(e), "cuBLAS off (FP4MOE_CUDA_BLAS=0)"))
            fail_msg("FP4MOE_CUDA_BLAS=0 and the engine says: %s", fm_cuda_engine_describe(e));
        g_eng = e;
        for (size_t pi = 0; pi < 2; pi++) {
            fm_model_desc d;
            assert_int_equal(fm_preset_desc(presets[pi], FM_QF_NVFP4, &d), FM_OK);
            assert_true(d.n_shared > 0);
            const int L = first_moe_layer(&d, 0);
            assert_true(L >= 0);
            fm_moe_layer *hl;
            if (fm_moe_layer_random(&d, FM_QF_NVFP4, 91 + pi, L, &hl)) fail_msg("random layer: %s", fm_last_error());
            fm_cuda_layer *cl;
            if (fm_cuda_layer_upload(e, &d, hl, &cl)) fail_msg("upload: %s", fm_last_error());
            for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
                const int T = Ts[ti], H = d.hidden;
                uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)T * H);
                float *xf = malloc(sizeof(float) * (size_t)T * H);
                assert_non_null(xb); assert_non_null(xf);
                make_x(300 + pi * 7 + T, T, H, xb, xf);
                cmp_result r;
                run_compare(&d, hl, cl, T, xb, NULL, &r);
                check_ref(&r, 1, "SH_FORK=%s PDL=%s BLAS=%s %-16s T=%3d", sets[si][0], sets[si][1], sets[si][2],
                          presets[pi], T);
                free(xb); free(xf);
            }
            fm_cuda_layer_free(cl);
            fm_moe_layer_free(hl);
        }
        g_eng = saved;
        fm_cuda_engine_free(e);
    }
}

/* All tokens identical: the same k experts get every token (T = 130 needs
 * several passes of every tile width), all other experts get none. */
static void test_all_on_one_expert(void **state) {
    (void)state;
    NEED_GPU();
    const char *presets[] = {"tiny-qwen3", "tiny-gptoss", "tiny-deepseek"};
    for (int pi = 0; pi < 3; pi++) {
        fm_model_desc d;
        assert_int_equal(fm_preset_desc(presets[pi], FM_QF_NONE, &d), FM_OK);
        int L = first_moe_layer(&d, 0), T = 130, H = d.hidden;
        fm_moe_layer *hl;
        fm_cuda_layer *cl;
        assert_int_equal(fm_moe_layer_random(&d, d.expert_format, 99, L, &hl), FM_OK);
        if (fm_cuda_layer_upload(g_eng, &d, hl, &cl)) fail_msg("upload: %s", fm_last_error());
        uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)T * H);
        float *xf = malloc(sizeof(float) * (size_t)T * H);
        assert_non_null(xb); assert_non_null(xf);
        make_x(4242, 1, H, xb, xf);
        for (int t = 1; t < T; t++) memcpy(xb + (size_t)t * H, xb, sizeof(uint16_t) * (size_t)H);
        cmp_result r;
        run_compare(&d, hl, cl, T, xb, NULL, &r);
        check_ref(&r, 0, "%-16s identical tokens T=%d", presets[pi], T);
        free(xb); free(xf);
        fm_cuda_layer_free(cl);
        fm_moe_layer_free(hl);
    }
}

/* A hash-routing table (checkpoint data) that names an expert twice for a
 * token is refused at upload with the row, as the reference refuses it at
 * routing time; the same table with distinct rows uploads. */
static void test_hash_duplicate_ids(void **state) {
    (void)state;
    NEED_GPU();
    fm_model_desc d;
    assert_int_equal(fm_preset_desc("tiny-deepseek-v4", FM_QF_NVFP4, &d), FM_OK);
    int L = first_moe_layer(&d, 1), k = d.topk;
    assert_true(L >= 0);
    assert_true(k >= 2);
    fm_moe_layer *hl;
    fm_cuda_layer *cl = NULL;
    assert_int_equal(fm_moe_layer_random(&d, FM_QF_NVFP4, 515, L, &hl), FM_OK);
    int32_t *tab = (int32_t *)hl->tid2eid;
    const int64_t row = hl->tid2eid_rows / 2;
    const int32_t keep = tab[row * k + 1];
    tab[row * k + 1] = tab[row * k];
    assert_int_equal(fm_cuda_layer_upload(g_eng, &d, hl, &cl), FM_E_FORMAT);
    assert_null(cl);
    char want[64];
    snprintf(want, sizeof want, "tid2eid[%lld] names expert %d twice", (long long)row, tab[row * k]);
    printf("# %s\n", fm_last_error());
    assert_non_null(strstr(fm_last_error(), want));
    tab[row * k + 1] = keep;
    if (fm_cuda_layer_upload(g_eng, &d, hl, &cl)) fail_msg("upload: %s", fm_last_error());
    fm_cuda_layer_free(cl);
    fm_moe_layer_free(hl);
}

/* Layer L of d with seeded random weights (layer_seed), on the GPU and in
 * the reference, at each batch T of Ts: seeded BF16 activations (x_seed +
 * T) and token ids (tok_seed), everything check_ref checks, weights
 * included. name: the preset, for the case's line. */
static void compare_batches(const fm_model_desc *d, const char *name, int L, uint64_t layer_seed, const int *Ts, int nT,
                            uint64_t x_seed, uint64_t tok_seed) {
    fm_moe_layer *hl;
    fm_cuda_layer *cl;
    if (fm_moe_layer_random(d, d->expert_format, layer_seed, L, &hl)) fail_msg("random layer: %s", fm_last_error());
    if (fm_cuda_layer_upload(g_eng, d, hl, &cl)) fail_msg("upload: %s", fm_last_error());
    for (int ti = 0; ti < nT; ti++) {
        const int T = Ts[ti];
        int32_t *tok = malloc(sizeof(int32_t) * (size_t)T);
        assert_non_null(tok);
        fm_test_token_ids(tok, T, tok_seed, 5, d->vocab_size);
        compare_x(d, hl, cl, T, x_seed + T, tok, "%-16s E=%d k=%d layer %d T=%d (%d pairs)", name, d->n_experts, d->topk,
                  L, T, T * d->topk);
        free(tok);
    }
    fm_cuda_layer_free(cl);
    fm_moe_layer_free(hl);
}

/* Routing at k = 8 with batches of 4 - 8 (32 - 64 (token, expert) pairs:
 * one selection block grouping in one warp at T * k <= 32, two blocks and
 * the block-wide grouping above): the tiny presets' k raised to 8, so that
 * their 16 experts take most of several tokens; DeepSeek-V4's hash layer too
 * (its table may name an expert twice for a token). */
static void test_grouping_k8(void **state) {
    (void)state;
    NEED_GPU();
    const char *presets[] = {"tiny-deepseek-v4", "tiny-qwen3", "tiny-deepseek"};
    const int Ts[] = {5, 8, 4}; /* 40, 64 and 32 pairs */
    for (int pi = 0; pi < 3; pi++)
        for (int hash = 0; hash < 2; hash++) {
            fm_model_desc d;
            assert_int_equal(fm_preset_desc(presets[pi], FM_QF_NONE, &d), FM_OK);
            d.topk = 8;
            if (d.n_group > 0 && d.topk_group > 0 && d.topk_group * (d.n_experts / d.n_group) < d.topk)
                d.topk_group = d.n_group; /* the kept groups must hold k experts */
            int L = first_moe_layer(&d, hash);
            if (L >= 0) compare_batches(&d, presets[pi], L, 640 + pi * 2 + hash, Ts, 3, 77, 99);
        }
}

/* Routing of few tokens over many experts: every routing family with E =
 * 300 (three partial 128-expert chunks per selection lane, four groups of 75
 * for the group limit) and E = 512 (the four chunks a lane keeps in
 * registers), T = 1, 3, 5 and 8 (one and two selection blocks), the preset's
 * k and k = 9 (72 pairs at T = 8: the grouping by both selection blocks) against the
 * float64 reference; DeepSeek-V4's hash layer too. */
static void test_route_many_experts(void **state) {
    (void)state;
    NEED_GPU();
    const char *presets[] = {"tiny-deepseek", "tiny-qwen3", "tiny-gptoss", "tiny-deepseek-v4"};
    const int Es[] = {300, 512}, Ts[] = {1, 3, 5, 8};
    for (int pi = 0; pi < 4; pi++)
        for (int ei = 0; ei < 2; ei++)
            for (int ki = 0; ki < 2; ki++)
                for (int hash = 0; hash < 2; hash++) {
                    fm_model_desc d;
                    assert_int_equal(fm_preset_desc(presets[pi], FM_QF_NONE, &d), FM_OK);
                    d.n_experts = Es[ei];
                    if (ki) d.topk = 9;
                    int L = first_moe_layer(&d, hash);
                    if (L >= 0)
                        compare_batches(&d, presets[pi], L, 700 + pi * 8 + ei * 4 + ki * 2 + hash, Ts, 4, 31 + ei, 98);
                }
}

/* Tied scores: the router's rows (and its biases) repeated in pairs, so that
 * experts 2m and 2m + 1 always tie; a tie goes to the lower expert, as in
 * the float64 reference (identical ids and weights). Every routing family,
 * the preset's E and E = 300 / 512 (a selection lane's keys in one, three or
 * four chunks of 128 experts), T = 1 (the block-wide scores), 3 and 8 (a
 * warp per token, one block or two). */
static void test_route_ties(void **state) {
    (void)state;
    NEED_GPU();
    const char *presets[] = {"tiny-deepseek", "tiny-qwen3", "tiny-gptoss", "tiny-deepseek-v4"};
    const int Es[] = {0, 300, 512}, Ts[] = {1, 3, 8};
    for (int pi = 0; pi < 4; pi++)
        for (int ei = 0; ei < 3; ei++) {
            fm_model_desc d;
            assert_int_equal(fm_preset_desc(presets[pi], FM_QF_NONE, &d), FM_OK);
            if (Es[ei]) d.n_experts = Es[ei];
            const int L = first_moe_layer(&d, 0), H = d.hidden, E = d.n_experts;
            assert_true(L >= 0);
            fm_moe_layer *hl;
            fm_cuda_layer *cl;
            if (fm_moe_layer_random(&d, d.expert_format, 1500 + pi * 3 + ei, L, &hl))
                fail_msg("random layer: %s", fm_last_error());
            float *rw = (float *)hl->router_w;
            for (int e = 1; e < E; e += 2) {
                memcpy(rw + (size_t)e * H, rw + (size_t)(e - 1) * H, sizeof(float) * (size_t)H);
                if (hl->router_bias) ((float *)hl->router_bias)[e] = hl->router_bias[e - 1];
                if (hl->score_bias) ((float *)hl->score_bias)[e] = hl->score_bias[e - 1];
            }
            if (fm_cuda_layer_upload(g_eng, &d, hl, &cl)) fail_msg("upload: %s", fm_last_error());
            for (int ti = 0; ti < 3; ti++)
                compare_x(&d, hl, cl, Ts[ti], 1600 + Ts[ti], NULL, "%-16s tied pairs E=%d T=%d", presets[pi], E, Ts[ti]);
            fm_cuda_layer_free(cl);
            fm_moe_layer_free(hl);
        }
}

/* The selection of one token spreads its sums and scores over the block;
 * from two tokens on one warp selects each. Token 0 alone and token 0 of a
 * batch get the same ids and weights bit for bit, and both calls match the
 * float64 reference: the elementwise families (DeepSeek-V3 noaux_tc with its
 * group limit, DeepSeek-V4 with its hash layer), odd and even expert counts
 * (a thread's last pair half outside the experts), 2 - 8 tokens (one block
 * or two; grouping in one warp or block-wide). */
static void test_sel_spread(void **state) {
    (void)state;
    NEED_GPU();
    const char *presets[] = {"tiny-deepseek", "tiny-deepseek-v4"};
    const int Es[] = {0, 257, 300};
    enum { TMAX = 8 };
    const int Ts[] = {2, 5, 8};
    for (int pi = 0; pi < 2; pi++)
        for (int ei = 0; ei < 3; ei++)
            for (int hash = 0; hash < 2; hash++) {
                fm_model_desc d;
                assert_int_equal(fm_preset_desc(presets[pi], FM_QF_NVFP4, &d), FM_OK);
                if (Es[ei]) {
                    d.n_experts = Es[ei];
                    if (d.n_group > 1 && d.n_experts % d.n_group) d.n_group = 1, d.topk_group = 1;
                }
                const int L = first_moe_layer(&d, hash);
                if (L < 0) continue;
                fm_moe_layer *hl;
                if (fm_moe_layer_random(&d, FM_QF_NVFP4, 950 + pi * 8 + ei * 2 + hash, L, &hl))
                    fail_msg("random layer: %s", fm_last_error());
                fm_cuda_layer *cl;
                if (fm_cuda_layer_upload(g_eng, &d, hl, &cl)) fail_msg("upload: %s", fm_last_error());
                const int H = d.hidden, k = d.topk;
                assert_true(H <= 4096 && k <= RT_TEST_MAXK);
                for (int ti = 0; ti < 3; ti++) {
                    const int T = Ts[ti];
                    uint16_t *xb = malloc(sizeof(uint16_t) * TMAX * 4096);
                    float *xf = malloc(sizeof(float) * TMAX * 4096);
                    float *out = malloc(sizeof(float) * TMAX * 4096);
                    assert_non_null(xb); assert_non_null(xf); assert_non_null(out);
                    make_x(960 + 10 * T, T, H, xb, xf);
                    int32_t tok[TMAX];
                    for (int t = 0; t < T; t++) tok[t] = (int32_t)((t * 3 + 1) % (d.vocab_size > 0 ? d.vocab_size : 1));
                    int32_t ids[2][TMAX * RT_TEST_MAXK];
                    float wts[2][TMAX * RT_TEST_MAXK];
                    for (int v = 0; v < 2; v++) {
                        const int Tv = v ? 1 : T;
                        cmp_result r;
                        run_compare(&d, hl, cl, Tv, xb, tok, &r);
                        check_ref(&r, 1, "%-16s E=%d layer %d T=%d", presets[pi], d.n_experts, L, Tv);
                        fm_moe_out o = {out, ids[v], wts[v]};
                        if (fm_cuda_forward(g_eng, &d, cl, xb, FM_DT_BF16, Tv, tok, &o))
                            fail_msg("fm_cuda_forward: %s", fm_last_error());
                    }
                    assert_memory_equal(ids[0], ids[1], sizeof(int32_t) * (size_t)k);
                    assert_memory_equal(wts[0], wts[1], sizeof(float) * (size_t)k);
                    free(out); free(xb); free(xf);
                }
                fm_cuda_layer_free(cl);
                fm_moe_layer_free(hl);
            }
}

/* Non-finite values: an input that is not finite is refused naming token and
 * feature; a NaN block scale (E4M3 0x7F, E8M0 0xFF), in an even or an odd
 * block, reaches the output through the GPU's scale decode and fails the
 * call, as the reference fails it. */
static void test_nonfinite(void **state) {
    (void)state;
    NEED_GPU();
    const fm_qformat fmts[] = {FM_QF_NVFP4, FM_QF_MXFP4};
    for (int fi = 0; fi < 2; fi++) {
        fm_model_desc d;
        assert_int_equal(fm_preset_desc("tiny-deepseek", fmts[fi], &d), FM_OK);
        int L = first_moe_layer(&d, 0), H = d.hidden, k = d.topk, T = 3;
        fm_moe_layer *hl;
        fm_cuda_layer *cl;
        assert_int_equal(fm_moe_layer_random(&d, fmts[fi], 616 + fi, L, &hl), FM_OK);
        uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)T * H);
        float *xf = malloc(sizeof(float) * (size_t)T * H), *out = malloc(sizeof(float) * (size_t)T * H);
        int32_t *ids = malloc(sizeof(int32_t) * (size_t)T * k);
        float *w = malloc(sizeof(float) * (size_t)T * k);
        assert_non_null(xb); assert_non_null(xf); assert_non_null(out); assert_non_null(ids); assert_non_null(w);
        make_x(61, T, H, xb, xf);
        fm_moe_out o = {out, ids, w};

        if (fm_cuda_layer_upload(g_eng, &d, hl, &cl)) fail_msg("upload: %s", fm_last_error());
        const uint16_t keep = xb[2 * H + 5];
        xb[2 * H + 5] = 0x7FC0; /* BF16 NaN */
        assert_int_equal(fm_cuda_forward(g_eng, &d, cl, xb, FM_DT_BF16, T, NULL, &o), FM_E_NUMERIC);
        assert_non_null(strstr(fm_last_error(), "input token 2, feature 5"));
        xb[2 * H + 5] = keep;
        assert_int_equal(fm_cuda_forward(g_eng, &d, cl, xb, FM_DT_BF16, T, NULL, &o), FM_OK);
        fm_cuda_layer_free(cl);

        /* the first, then the second block scale of gate row 0 of every
         * routed expert (the two halves of the kernels' scale pairs) */
        for (int blk = 0; blk < 2; blk++) {
            for (int e = 0; e < d.n_experts; e++) {
                uint8_t *sc = (uint8_t *)hl->gate[e].scales;
                sc[blk] = fmts[fi] == FM_QF_NVFP4 ? 0x7F : 0xFF;
                if (blk == 1) sc[0] = sc[2];
            }
            if (fm_cuda_layer_upload(g_eng, &d, hl, &cl)) fail_msg("upload: %s", fm_last_error());
            assert_int_equal(fm_cuda_forward(g_eng, &d, cl, xb, FM_DT_BF16, T, NULL, &o), FM_E_NUMERIC);
            printf("# %s NaN scale in block %d: %s\n", fm_qformat_name(fmts[fi]), blk, fm_last_error());
            assert_non_null(strstr(fm_last_error(), "output token"));
            fm_moe_out ro = {out, ids, w};
            assert_int_equal(fm_moe_forward_ref(&d, hl, xb, FM_DT_BF16, T, NULL, &ro), FM_E_NUMERIC);
            fm_cuda_layer_free(cl);
        }
        fm_moe_layer_free(hl);
        free(xb); free(xf); free(out); free(ids); free(w);
    }
}

/* NVFP4 block scales the GPU stores otherwise than the checkpoint: negative scales (their sign moves to the
 * nibbles), zero and negative-zero scales over nonzero nibbles (the block
 * is zero). Every matrix of the layer, routed and shared, gets each kind in
 * a fixed pattern of its blocks; the output must match the reference. */
static void set_scale_kinds(fm_qmatrix *q) {
    uint8_t *sc = (uint8_t *)q->scales;
    for (int64_t r = 0; r < q->rows; r++)
        for (int64_t b = 0; b < q->cols / 16; b++) {
            uint8_t *v = sc + r * q->scale_stride + b;
            const int64_t i = r * 131 + b;
            if (i % 5 == 1) *v |= 0x80;
            else if (i % 7 == 3) *v = 0x00;
            else if (i % 11 == 4) *v = 0x80;
        }
}
static void test_scale_signs(void **state) {
    (void)state;
    NEED_GPU();
    fm_model_desc d;
    assert_int_equal(fm_preset_desc("tiny-deepseek", FM_QF_NVFP4, &d), FM_OK);
    const int L = first_moe_layer(&d, 0), Ts[] = {1, 33, 130};
    fm_moe_layer *hl;
    assert_int_equal(fm_moe_layer_random(&d, FM_QF_NVFP4, 717, L, &hl), FM_OK);
    for (int e = 0; e < hl->n_experts; e++) {
        set_scale_kinds(&hl->gate[e]);
        set_scale_kinds(&hl->up[e]);
        set_scale_kinds(&hl->down[e]);
    }
    assert_true(hl->has_shared);
    set_scale_kinds(&hl->sh_gate);
    set_scale_kinds(&hl->sh_up);
    set_scale_kinds(&hl->sh_down);
    fm_cuda_layer *cl;
    if (fm_cuda_layer_upload(g_eng, &d, hl, &cl)) fail_msg("upload: %s", fm_last_error());
    /* the wgmma kernels (sm_90; elsewhere the engine runs another path and
     * the case still compares) and the small-batch mma.sync kernels */
    const fm_kernel_config cfgs[] = {{FM_PATH_WGMMA, 64, 1, 4, 1, 16, 1.5f}, {FM_PATH_SMALL, 16, 8, 8, 1, 8, 1.5f}};
    for (int c = 0; c < 2; c++) {
        if (fm_cuda_engine_set_config(g_eng, &cfgs[c])) fail_msg("set config: %s", fm_last_error());
        for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++)
            compare_x(&d, hl, cl, Ts[ti], 7170 + Ts[ti], NULL, "signed and zero scales, %s config, T=%3d",
                      fm_kernel_path_name(cfgs[c].path), Ts[ti]);
    }
    fm_cuda_engine_set_config(g_eng, NULL);
    fm_cuda_layer_free(cl);
    fm_moe_layer_free(hl);
}

/* Every kernel shape the tuner may choose computes the same function. */
static void test_forced_configs(void **state) {
    (void)state;
    NEED_GPU();
    const fm_kernel_config cfgs[] = {
        {FM_PATH_SMALL, 16, 8, 8, 1, 8, 1.5f},  {FM_PATH_SMALL, 16, 4, 4, 1, 16, 1.5f},
        {FM_PATH_LARGE, 64, 1, 4, 1, 8, 1.5f},  {FM_PATH_LARGE, 64, 1, 4, 1, 16, 1.5f},
        {FM_PATH_LARGE, 128, 1, 8, 1, 32, 1.5f}, {FM_PATH_LARGE, 32, 2, 4, 1, 32, 1.5f},
        {FM_PATH_SMALL, 32, 2, 4, 1, 16, 1.5f},
        /* the wgmma path (sm_90; elsewhere the large path runs instead):
         * passes of 8, 16 and 32 tokens, at T = 200 so that experts take
         * several passes and every token count 1 .. 32 per pass occurs */
        {FM_PATH_WGMMA, 64, 1, 4, 1, 8, 1.5f}, {FM_PATH_WGMMA, 64, 1, 4, 1, 16, 1.5f},
        {FM_PATH_WGMMA, 64, 1, 4, 1, 32, 1.5f},
        /* two warpgroups per block; the tiny shapes' rows fill only
         * part of a block, so the idle warpgroup's path runs too */
        {FM_PATH_WGMMA, 128, 1, 8, 1, 16, 1.5f}, {FM_PATH_WGMMA, 128, 1, 8, 1, 32, 1.5f},
    };
    const char *presets[] = {"tiny-mixtral", "tiny-deepseek-v4"};
    const size_t ncfg = sizeof cfgs / sizeof cfgs[0];
    /* the wgmma configs also at T = 20, where down takes over per expert
     * from gate/up blocks of one or two warpgroups */
    for (int pi = 0; pi < 2; pi++)
        for (size_t ci = 0; ci < ncfg + 5; ci++) {
            const size_t c = ci < ncfg ? ci : ncfg - 5 + (ci - ncfg);
            fm_model_desc d;
            assert_int_equal(fm_preset_desc(presets[pi], FM_QF_NONE, &d), FM_OK);
            int L = first_moe_layer(&d, 0), T = cfgs[c].path == FM_PATH_WGMMA ? (ci < ncfg ? 200 : 20) : 45,
                H = d.hidden;
            fm_moe_layer *hl;
            fm_cuda_layer *cl;
            assert_int_equal(fm_moe_layer_random(&d, d.expert_format, 7 + c, L, &hl), FM_OK);
            if (fm_cuda_layer_upload(g_eng, &d, hl, &cl)) fail_msg("upload: %s", fm_last_error());
            uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)T * H);
            float *xf = malloc(sizeof(float) * (size_t)T * H);
            assert_non_null(xb); assert_non_null(xf);
            make_x(c + 1, T, H, xb, xf);
            fm_cuda_engine_set_config(g_eng, &cfgs[c]);
            cmp_result r;
            run_compare(&d, hl, cl, T, xb, NULL, &r);
            fm_cuda_engine_set_config(g_eng, NULL);
            check_ref(&r, 0, "%-16s cfg %zu (%s, warps %d, k_split %d, tile_n %d, stages %d) T=%d", presets[pi], c,
                      fm_kernel_path_name(cfgs[c].path), cfgs[c].warps, cfgs[c].k_split, cfgs[c].tile_n, cfgs[c].stages,
                      T);
            free(xb); free(xf);
            fm_cuda_layer_free(cl);
            fm_moe_layer_free(hl);
        }
}

/* The splitk path (few tokens, narrow experts) on every tiny preset and both
 * formats, widened so that gate/up's K spans several segments and I is not a
 * multiple of 128: against the float64 reference at 1 .. 16 tokens with K in
 * 1, 3 and 16 chunks (more chunks than segments leaves some empty), and twice
 * on the same input, which must give the same bits (no atomics), except
 * where the one-token launch runs: it adds its experts' down rows with
 * atomics, so the same values to rounding (and its counters back at zero
 * for the second call). A hidden
 * size of 8192 as well (fewer cases): down's 512 blocks of 16 rows take
 * more than two per SM, where it runs three per SM. */
static void test_splitk(void **state) {
    (void)state;
    NEED_GPU();
    const int chunks[] = {1, 3, 16}, Ts[] = {1, 5, 9, 16};
    const fm_qformat fmts[] = {FM_QF_NVFP4, FM_QF_MXFP4};
    for (size_t pi = 0; pi < sizeof k_tiny / sizeof k_tiny[0] + 2; pi++)
        for (int fi = 0; fi < 2; fi++) {
            const int wide = pi >= sizeof k_tiny / sizeof k_tiny[0];
            const char *preset = wide ? k_tiny[pi - sizeof k_tiny / sizeof k_tiny[0]] : k_tiny[pi];
            fm_model_desc d;
            assert_int_equal(fm_preset_desc(preset, fmts[fi], &d), FM_OK);
            d.hidden = wide ? 8192 : 640;
            d.moe_inter = 192;
            if (d.n_shared) d.shared_inter = 192 * d.n_shared;
            if (fm_model_desc_validate(&d)) fail_msg("widened %s: %s", preset, fm_last_error());
            const int L = first_moe_layer(&d, 0), H = d.hidden;
            fm_moe_layer *hl;
            fm_cuda_layer *cl;
            assert_int_equal(fm_moe_layer_random(&d, d.expert_format, 900 + pi * 2 + fi, L, &hl), FM_OK);
            if (fm_cuda_layer_upload(g_eng, &d, hl, &cl)) fail_msg("upload: %s", fm_last_error());
            for (size_t ci = wide ? 2 : 0; ci < sizeof chunks / sizeof chunks[0]; ci++)
                for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
                    const int T = Ts[ti];
                    if (wide && T > 8) continue;
                    const fm_kernel_config cfg = {FM_PATH_SPLITK, 16, chunks[ci], 8, 1, T > 8 ? 16 : 8, 0.1f};
                    if (fm_cuda_engine_set_config(g_eng, &cfg)) fail_msg("set config: %s", fm_last_error());
                    /* one token with a shared expert as wide as the routed
                     * ones takes the one-launch kernel on sm_90 (at H 640:
                     * 16 x k blocks of under 60 KB; H 8192 needs more
                     * shared memory than a block has) */
                    char kern[1024];
                    if (fm_cuda_layer_call_config(g_eng, cl, T, NULL, kern, sizeof kern, NULL, 0))
                        fail_msg("call config: %s", fm_last_error());
                    const int one = T == 1 && !wide && d.n_shared == 1 && 16 * d.topk <= 132 &&
                                    strstr(fm_cuda_engine_describe(g_eng), "sm_90") != NULL;
                    if (!strstr(kern, one ? "fm_fused1_kernel" : "fm_splitk_gu_kernel"))
                        fail_msg("%s T=%d: kernel %s", preset, T, kern);
                    /* that launch selects the top-k itself in the families
                     * scored expert by expert (layer L is not hash-routed) */
                    const int sel = d.route == FM_ROUTE_NOAUX_TC || d.route == FM_ROUTE_DSV4;
                    if (one && !strstr(kern, sel ? "top-k: inside the one-token launch (no selection kernel)"
                                                 : "top-k: the selection kernel before the one-token launch"))
                        fail_msg("%s T=%d: kernel %s", preset, T, kern);
                    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)T * H);
                    float *xf = malloc(sizeof(float) * (size_t)T * H);
                    float *o1 = malloc(sizeof(float) * (size_t)T * H), *o2 = malloc(sizeof(float) * (size_t)T * H);
                    assert_non_null(xb); assert_non_null(xf); assert_non_null(o1); assert_non_null(o2);
                    make_x(31 * T + ci, T, H, xb, xf);
                    cmp_result r;
                    run_compare(&d, hl, cl, T, xb, NULL, &r);
                    fm_moe_out a = {o1, NULL, NULL}, b = {o2, NULL, NULL};
                    if (fm_cuda_forward(g_eng, &d, cl, xb, FM_DT_BF16, T, NULL, &a) ||
                        fm_cuda_forward(g_eng, &d, cl, xb, FM_DT_BF16, T, NULL, &b))
                        fail_msg("fm_cuda_forward: %s", fm_last_error());
                    fm_cuda_engine_set_config(g_eng, NULL);
                    check_ref(&r, 1, "%-16s %s H=%d splitk C=%2d T=%2d", preset, fm_qformat_name(fmts[fi]), H,
                              chunks[ci], T);
                    if (one)
                        assert_runs_close(o1, o2, (size_t)T * H, "one-token launch, second run");
                    else
                        assert_memory_equal(o1, o2, sizeof(float) * (size_t)T * H);
                    free(xb); free(xf); free(o1); free(o2);
                }
            fm_cuda_layer_free(cl);
            fm_moe_layer_free(hl);
        }
}

/* Layer L of d with seeded random weights, on the host (*hl) and on the
 * GPU (*cl). */
static void layer_both(const fm_model_desc *d, uint64_t seed, int L, fm_moe_layer **hl, fm_cuda_layer **cl) {
    if (fm_moe_layer_random(d, d->expert_format, seed, L, hl)) fail_msg("random layer: %s", fm_last_error());
    if (fm_cuda_layer_upload(g_eng, d, *hl, cl)) fail_msg("upload: %s", fm_last_error());
}

/* preset in format fmt widened to a TP rank's kind of shape: E experts of
 * top-k k, hidden H, intermediate I (the shared expert's too, where it has
 * one) */
static void widened(const char *preset, fm_qformat fmt, int E, int k, int H, int I, fm_model_desc *d) {
    assert_int_equal(fm_preset_desc(preset, fmt, d), FM_OK);
    d->n_experts = E;
    d->topk = k;
    d->hidden = H;
    d->moe_inter = I;
    if (d->n_shared > 0) d->shared_inter = I * d->n_shared;
    if (fm_model_desc_validate(d)) fail_msg("widened %s: %s", preset, fm_last_error());
}

/* The layer (d, hl on the host, cl on the GPU) under the forced config cfg
 * at T tokens of make_x(x_seed) activations: the comparison with the
 * reference (*r) and the bench's result (*br, its kernel line). */
static void forced_run(const fm_model_desc *d, const fm_moe_layer *hl, fm_cuda_layer *cl, const fm_kernel_config *cfg,
                       int T, uint64_t x_seed, cmp_result *r, fm_cuda_bench_result *br) {
    const int H = d->hidden;
    if (fm_cuda_engine_set_config(g_eng, cfg)) fail_msg("set config: %s", fm_last_error());
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)T * H);
    float *xf = malloc(sizeof(float) * (size_t)T * H);
    assert_non_null(xb); assert_non_null(xf);
    make_x(x_seed, T, H, xb, xf);
    run_compare(d, hl, cl, T, xb, NULL, r);
    if (fm_cuda_bench(g_eng, d, &cl, 1, T, 5, 2, br)) fail_msg("fm_cuda_bench: %s", fm_last_error());
    fm_cuda_engine_set_config(g_eng, NULL);
    free(xb); free(xf);
}

/* Down in blocks of several row chunks (a short K and many blocks: a TP
 * rank's shape): E 256, k 8, H 1920 (15 chunks of 128 rows, so that the last
 * block of an expert holds fewer), I 256 (two K segments), both formats, the
 * wgmma path at passes of 8, 16 and 32 tokens, T = 64 and 150 (experts in
 * several passes), against the float64 reference. The bench's kernel line
 * says that the chunked blocks ran. */
static void test_down_chunks(void **state) {
    (void)state;
    NEED_GPU();
    const fm_qformat fmts[] = {FM_QF_NVFP4, FM_QF_MXFP4};
    const int tiles[] = {8, 16, 32}, Ts[] = {64, 150};
    for (int fi = 0; fi < 2; fi++) {
        fm_model_desc d;
        widened("tiny-qwen3", fmts[fi], 256, 8, 1920, 256, &d);
        const int L = first_moe_layer(&d, 0), H = d.hidden;
        fm_moe_layer *hl;
        fm_cuda_layer *cl;
        layer_both(&d, 1300 + fi, L, &hl, &cl);
        for (size_t ti = 0; ti < sizeof tiles / sizeof tiles[0]; ti++)
            for (size_t bi = 0; bi < sizeof Ts / sizeof Ts[0]; bi++) {
                const int T = Ts[bi];
                const fm_kernel_config cfg = {FM_PATH_WGMMA, 64, 1, 4, 1, tiles[ti], 1.5f};
                cmp_result r;
                fm_cuda_bench_result br;
                forced_run(&d, hl, cl, &cfg, T, 77 * T + (int)ti, &r, &br);
                check_ref(&r, 1, "%s E=256 H=%d I=256 tile_n %d T=%d (%s)", fm_qformat_name(fmts[fi]), H, tiles[ti], T,
                          strstr(br.kernel, "row chunks") ? "down in row chunks" : "no chunks");
                if (strstr(br.kernel, "fm_expert_wg_kernel")) assert_non_null(strstr(br.kernel, "row chunks"));
            }
        fm_cuda_layer_free(cl);
        fm_moe_layer_free(hl);
    }
}

/* The wgmma gate/up's K split over a cluster at a TP rank's shape (K of
 * 6144 or 7168: 48 or 56 segments, GLM-5's and Kimi-K2's; I 256): a few
 * tokens over 32 experts keep the grid under a block per SM, where the rule
 * splits K; the kernel line names the split, and the layer matches the
 * reference with the split as it runs. On 132 SMs T = 2 takes quarters (64
 * blocks) and T = 4 thirds (128 blocks; 56 segments do not divide by 3). */
static void test_gateup_ksplit(void **state) {
    (void)state;
    NEED_GPU();
    if (!strstr(fm_cuda_engine_describe(g_eng), "sm_90")) {
        printf("# SKIPPED: the wgmma path needs sm_90\n");
        return;
    }
    const int sms132 = strstr(fm_cuda_engine_describe(g_eng), ", 132 SMs,") != NULL;
    const fm_qformat fmts[] = {FM_QF_NVFP4, FM_QF_MXFP4};
    const int Ts[] = {2, 4, 8}, Hs[] = {6144, 7168};
    for (int fi = 0; fi < 4; fi++) {
        fm_model_desc d;
        widened("tiny-deepseek", fmts[fi % 2], 32, 8, Hs[fi / 2], 256, &d);
        const int L = first_moe_layer(&d, 0), H = d.hidden;
        fm_moe_layer *hl;
        fm_cuda_layer *cl;
        layer_both(&d, 1400 + fi, L, &hl, &cl);
        int split_seen = 0;
        for (size_t bi = 0; bi < sizeof Ts / sizeof Ts[0]; bi++) {
            const int T = Ts[bi];
            const fm_kernel_config cfg = {FM_PATH_WGMMA, 64, 1, 4, 1, 16, 0.1f};
            cmp_result r;
            fm_cuda_bench_result br;
            forced_run(&d, hl, cl, &cfg, T, 91 * T + fi, &r, &br);
            const char *ks = strstr(br.kernel, "routed gate/up K over ");
            int n = 1;
            if (ks) n = atoi(ks + strlen("routed gate/up K over "));
            split_seen |= n > 1;
            check_ref(&r, 1, "%s E=32 k=8 H=%d I=256 T=%d (gate/up K over %d blocks)", fm_qformat_name(fmts[fi % 2]), H,
                      T, n);
            assert_non_null(strstr(br.kernel, "fm_expert_wg_kernel"));
            assert_true(n >= 1 && n <= 8); /* a cluster of at most 8 */
            if (sms132 && T <= 4) assert_int_equal(n, T == 2 ? 4 : 3);
        }
        /* the rule splits K at these grids (it would not at one long K chunk per SM) */
        assert_true(split_seen);
        fm_cuda_layer_free(cl);
        fm_moe_layer_free(hl);
    }
}

/* 1 when engine e has loaded cuBLAS: its description names the version. */
static int engine_has_blas(const fm_cuda_engine *e) {
    const char *b = strstr(fm_cuda_engine_describe(e), ", cuBLAS ");
    return b && b[9] >= '0' && b[9] <= '9';
}

/* The logits line where the tiled shape runs with activations of type xdt:
 * cuBLAS for BF16 where the engine has it, else the BF16 mma.sync kernel
 * with the terms that type takes (one, two, three). */
static void check_logits_line(const fm_cuda_engine *e, fm_dtype xdt, const char *kernel) {
    const char *want = xdt == FM_DT_BF16 ? (engine_has_blas(e) ? "router logits: cuBLAS BF16 GEMM" : "BF16 mma.sync, one term")
                       : xdt == FM_DT_F16 ? "BF16 mma.sync, two terms"
                                          : "BF16 mma.sync, three terms";
    if (!strstr(kernel, want)) fail_msg("%s activations: the kernel line does not say '%s': %s", fm_dtype_name(xdt), want, kernel);
}

/* The benchmark's activations in F32, BF16 or F16 (fm_cuda_engine_set_bench_act):
 * each times, and the router logits' line names the kernel that type takes
 * where the tiled shape runs (T = 200): cuBLAS for BF16 where the engine
 * loaded it, else the BF16 mma.sync kernel's terms (one, two, three); any
 * other type is refused and leaves the setting as it was. */
static void test_bench_act(void **state) {
    (void)state;
    NEED_GPU();
    fm_model_desc d;
    assert_int_equal(fm_preset_desc("tiny-qwen3", FM_QF_NVFP4, &d), FM_OK);
    const int L = first_moe_layer(&d, 0);
    fm_moe_layer *hl;
    fm_cuda_layer *cl;
    assert_int_equal(fm_moe_layer_random(&d, d.expert_format, 1400, L, &hl), FM_OK);
    if (fm_cuda_layer_upload(g_eng, &d, hl, &cl)) fail_msg("upload: %s", fm_last_error());
    const fm_dtype dts[] = {FM_DT_BF16, FM_DT_F16, FM_DT_F32};
    printf("# engine: %s\n", fm_cuda_engine_describe(g_eng));
    for (int i = 0; i < 3; i++)
        for (int T = 64; T <= 200; T += 136) {
            assert_int_equal(fm_cuda_engine_set_bench_act(g_eng, dts[i]), FM_OK);
            fm_cuda_bench_result br;
            if (fm_cuda_bench(g_eng, &d, &cl, 1, T, 5, 2, &br))
                fail_msg("fm_cuda_bench %s: %s", fm_dtype_name(dts[i]), fm_last_error());
            assert_true(br.us_per_layer > 0);
            /* above 128 tokens the logits are always tiled, and a random
             * layer's router is exact in BF16 */
            if (T == 200) check_logits_line(g_eng, dts[i], br.kernel);
        }
    /* refused: the BF16 set before stays */
    assert_int_equal(fm_cuda_engine_set_bench_act(g_eng, FM_DT_BF16), FM_OK);
    assert_int_equal(fm_cuda_engine_set_bench_act(g_eng, FM_DT_I8), FM_E_ARG);
    assert_int_equal(fm_cuda_engine_set_bench_act(NULL, FM_DT_F32), FM_E_ARG);
    {
        fm_cuda_bench_result br;
        if (fm_cuda_bench(g_eng, &d, &cl, 1, 200, 5, 2, &br)) fail_msg("fm_cuda_bench: %s", fm_last_error());
        check_logits_line(g_eng, FM_DT_BF16, br.kernel); /* a refused type changed nothing */
    }
    assert_int_equal(fm_cuda_engine_set_bench_act(g_eng, FM_DT_F32), FM_OK); /* the other tests' default */
    fm_cuda_layer_free(cl);
    fm_moe_layer_free(hl);
}

/* Weights generated on the GPU are the weights of fm_moe_layer_random: the
 * two layers give the same outputs (up to FP32 atomics order). */
static void test_layer_random_same(void **state) {
    (void)state;
    NEED_GPU();
    for (size_t pi = 0; pi < sizeof k_tiny / sizeof k_tiny[0]; pi++)
        for (int fi = 0; fi < 2; fi++) {
            fm_qformat f = fi ? FM_QF_MXFP4 : FM_QF_NVFP4;
            fm_model_desc d;
            assert_int_equal(fm_preset_desc(k_tiny[pi], f, &d), FM_OK);
            int L = first_moe_layer(&d, 0), T = 33, H = d.hidden;
            fm_moe_layer *hl;
            fm_cuda_layer *a, *b;
            assert_int_equal(fm_moe_layer_random(&d, f, 5150, L, &hl), FM_OK);
            if (fm_cuda_layer_upload(g_eng, &d, hl, &a)) fail_msg("upload: %s", fm_last_error());
            if (fm_cuda_layer_random(g_eng, &d, f, 5150, L, &b)) fail_msg("gpu random: %s", fm_last_error());
            uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)T * H);
            float *xf = malloc(sizeof(float) * (size_t)T * H);
            float *oa = malloc(sizeof(float) * (size_t)T * H), *ob = malloc(sizeof(float) * (size_t)T * H);
            assert_non_null(xb); assert_non_null(xf); assert_non_null(oa); assert_non_null(ob);
            make_x(3, T, H, xb, xf);
            fm_moe_out o1 = {oa, NULL, NULL}, o2 = {ob, NULL, NULL};
            assert_int_equal(fm_cuda_forward(g_eng, &d, a, xb, FM_DT_BF16, T, NULL, &o1), FM_OK);
            assert_int_equal(fm_cuda_forward(g_eng, &d, b, xb, FM_DT_BF16, T, NULL, &o2), FM_OK);
            double mx = 0, md = 0;
            for (int64_t i = 0; i < (int64_t)T * H; i++) {
                if (fabs(oa[i]) > mx) mx = fabs(oa[i]);
                double dd = fabs((double)oa[i] - ob[i]);
                if (!(dd <= md)) md = dd;
            }
            printf("# %-16s %s GPU-generated vs uploaded: max diff %.2e of %.2e\n", k_tiny[pi], fm_qformat_name(f), md, mx);
            assert_true(mx > 0);
            assert_true(md <= 1e-5 * mx);
            free(xb); free(xf); free(oa); free(ob);
            fm_cuda_layer_free(a);
            fm_cuda_layer_free(b);
            fm_moe_layer_free(hl);
        }
}

static void test_bad_inputs(void **state) {
    (void)state;
    NEED_GPU();
    fm_model_desc d;
    assert_int_equal(fm_preset_desc("tiny-deepseek-v4", FM_QF_NONE, &d), FM_OK);
    int L = first_moe_layer(&d, 1);
    assert_true(L >= 0);
    fm_moe_layer *hl;
    fm_cuda_layer *cl;
    assert_int_equal(fm_moe_layer_random(&d, d.expert_format, 1, L, &hl), FM_OK);
    assert_int_equal(fm_cuda_layer_upload(g_eng, &d, hl, &cl), FM_OK);
    int T = 4, H = d.hidden;
    uint16_t *xb = calloc((size_t)T * H, 2);
    float *out = malloc(sizeof(float) * (size_t)T * H);
    assert_non_null(xb); assert_non_null(out);
    fm_moe_out o = {out, NULL, NULL};
    /* hash layer without token ids, or with one outside the vocabulary */
    assert_int_equal(fm_cuda_forward(g_eng, &d, cl, xb, FM_DT_BF16, T, NULL, &o), FM_E_ARG);
    assert_non_null(strstr(fm_last_error(), "token id"));
    int32_t tok[4] = {0, 1, d.vocab_size, 2};
    assert_int_equal(fm_cuda_forward(g_eng, &d, cl, xb, FM_DT_BF16, T, tok, &o), FM_E_RANGE);
    assert_int_equal(fm_cuda_forward(g_eng, &d, cl, xb, FM_DT_BF16, 0, tok, &o), FM_E_ARG);
    assert_int_equal(fm_cuda_forward(g_eng, &d, cl, xb, FM_DT_I32, T, tok, &o), FM_E_ARG);
    fm_cuda_layer_free(cl);
    fm_moe_layer_free(hl);
    /* BF16 experts are not run by the GPU kernels */
    assert_int_equal(fm_preset_desc("tiny-qwen3", FM_QF_BF16, &d), FM_OK);
    assert_int_equal(fm_moe_layer_random(&d, FM_QF_BF16, 1, 0, &hl), FM_OK);
    assert_int_equal(fm_cuda_layer_upload(g_eng, &d, hl, &cl), FM_E_UNSUPPORTED);
    fm_moe_layer_free(hl);
    free(xb);
    free(out);
}

static void test_bench_runs(void **state) {
    (void)state;
    NEED_GPU();
    fm_model_desc d;
    assert_int_equal(fm_preset_desc("tiny-deepseek-v4", FM_QF_NONE, &d), FM_OK);
    fm_cuda_layer *ls[3];
    for (int i = 0; i < 3; i++)
        if (fm_cuda_layer_random(g_eng, &d, d.expert_format, 11, i, &ls[i])) fail_msg("%s", fm_last_error());
    fm_cuda_bench_result r;
    if (fm_cuda_bench(g_eng, &d, ls, 3, 5, 1, 5, &r)) fail_msg("bench: %s", fm_last_error());
    assert_true(r.us_per_layer > 0);
    assert_true(r.us_min <= r.us_per_layer && r.us_per_layer <= r.us_max);
    assert_true(r.active_experts >= d.topk && r.active_experts <= d.n_experts);
    assert_true(r.bytes_per_layer > 0);
    assert_true(r.kernel[0] && r.config_source[0]);
    assert_non_null(strstr(r.kernel, "router logits: GEMV"));
    /* the wgmma path runs where it can and says so where it cannot */
    const fm_kernel_config wg = {FM_PATH_WGMMA, 64, 1, 4, 1, 32, 1.5f};
    /* a wgmma config of another block shape is refused, naming the shape,
     * and the engine keeps its own choice */
    const fm_kernel_config wg_bad = {FM_PATH_WGMMA, 32, 1, 4, 1, 32, 1.5f};
    assert_int_equal(fm_cuda_engine_set_config(g_eng, &wg_bad), FM_E_ARG);
    assert_non_null(strstr(fm_last_error(), "rows_per_block 64"));
    assert_int_equal(fm_cuda_engine_set_config(g_eng, &wg), FM_OK);
    fm_status st = fm_cuda_bench(g_eng, &d, ls, 3, 40, 1, 3, &r);
    fm_cuda_engine_set_config(g_eng, NULL);
    if (st) fail_msg("bench (wgmma): %s", fm_last_error());
    printf("# wgmma config: kernel %s; source %s\n", r.kernel, r.config_source);
    /* 40 tokens of this small shape: its SGEMM logits grid would be two
     * blocks, so the GEMV shape runs */
    assert_non_null(strstr(r.kernel, "router logits: GEMV"));
    /* above 128 tokens the SGEMM shape; the bench's F32 activations against
     * the generated BF16 router: BF16 MMAs with three terms of x */
    if (fm_cuda_bench(g_eng, &d, ls, 3, 130, 1, 3, &r)) fail_msg("bench (130 tokens): %s", fm_last_error());
    assert_non_null(strstr(r.kernel, "router logits: BF16 mma.sync, three terms of x"));
    if (strstr(fm_cuda_engine_describe(g_eng), "sm_90")) {
        assert_non_null(strstr(r.kernel, "fm_expert_wg_kernel"));
        assert_int_equal(r.cfg.path, FM_PATH_WGMMA);
        /* two warpgroups per block, named in the kernel line */
        const fm_kernel_config wg2 = {FM_PATH_WGMMA, 128, 1, 8, 1, 32, 1.5f};
        assert_int_equal(fm_cuda_engine_set_config(g_eng, &wg2), FM_OK);
        st = fm_cuda_bench(g_eng, &d, ls, 3, 40, 1, 3, &r);
        fm_cuda_engine_set_config(g_eng, NULL);
        if (st) fail_msg("bench (wgmma, 128 rows): %s", fm_last_error());
        printf("# wgmma 128-row config: kernel %s\n", r.kernel);
        assert_non_null(strstr(r.kernel, "two warpgroups per block"));
        assert_int_equal(r.cfg.rows_per_block, 128);
    } else {
        assert_non_null(strstr(r.config_source, "wgmma path needs sm_90"));
        assert_true(r.cfg.path != FM_PATH_WGMMA);
    }
    /* sustained load first (fm_cuda_engine_set_sustain): the call lasts at
     * least that long and times the same work; 0 turns it off again */
    fm_cuda_engine_set_sustain(g_eng, 300);
    const uint64_t t0 = fm_now_ns();
    st = fm_cuda_bench(g_eng, &d, ls, 3, 5, 1, 5, &r);
    const double wall_ms = (double)(fm_now_ns() - t0) * 1e-6;
    fm_cuda_engine_set_sustain(g_eng, 0);
    if (st) fail_msg("bench (sustained): %s", fm_last_error());
    printf("# sustained 300 ms: %.1f us per layer, the call %.0f ms\n", r.us_per_layer, wall_ms);
    assert_true(wall_ms >= 270.0); /* the replay estimate may run 10 % short */
    assert_true(r.us_per_layer > 0 && r.us_min <= r.us_per_layer && r.us_per_layer <= r.us_max);
    const uint64_t t1 = fm_now_ns();
    if (fm_cuda_bench(g_eng, &d, ls, 3, 5, 1, 5, &r)) fail_msg("bench: %s", fm_last_error());
    printf("# burst: the call %.0f ms\n", (double)(fm_now_ns() - t1) * 1e-6);
    for (int i = 0; i < 3; i++) fm_cuda_layer_free(ls[i]);
}

/* A matrix of layer L generated with the shared formulas (fm_gen_matrix_rows). */
static void gen_qm(fm_qmatrix *q, uint64_t seed, int L, int e, int m, int64_t R, int64_t K) {
    memset(q, 0, sizeof *q);
    q->fmt = FM_QF_NVFP4;
    q->rows = R;
    q->cols = K;
    q->row_stride = K / 2;
    q->scale_stride = K / 16;
    q->packed = malloc((size_t)(R * K / 2));
    q->scales = malloc((size_t)(R * K / 16));
    assert_non_null(q->packed);
    assert_non_null(q->scales);
    fm_gen_matrix_rows(seed, L, e, m, FM_QF_NVFP4, K, 0, R, (uint8_t *)q->packed, (uint8_t *)q->scales);
    q->scale2 = fm_gen_nvfp4_scale2(K);
}

/* DeepSeek-V4-Flash shape (H 4096, I 2048, 256 experts, top-6, shared
 * expert), weights generated on the GPU, at B = 1 and B = 64; the float64
 * reference runs on the first tokens with only the experts they use
 * generated on the host (all other experts share one placeholder matrix). */
static void test_dsv4_flash_shape(void **state) {
    (void)state;
    NEED_GPU();
    fm_model_desc d;
    assert_int_equal(fm_preset_desc("deepseek-v4-flash", FM_QF_NVFP4, &d), FM_OK);
    const int L = 3, H = d.hidden, I = d.moe_inter, E = d.n_experts, k = d.topk, NREF = 3;
    const uint64_t seed = 2024;
    fm_cuda_layer *cl;
    if (fm_cuda_layer_random(g_eng, &d, FM_QF_NVFP4, seed, L, &cl)) fail_msg("gpu random: %s", fm_last_error());
    fm_moe_layer hl;
    memset(&hl, 0, sizeof hl);
    hl.layer = L; hl.hidden = H; hl.inter = I; hl.n_experts = E; hl.topk = k; hl.fmt = FM_QF_NVFP4;
    hl.has_shared = 1; hl.shared_inter = d.shared_inter;
    float *rw = malloc(sizeof(float) * (size_t)E * H), *sb = malloc(sizeof(float) * (size_t)E);
    assert_non_null(rw); assert_non_null(sb);
    for (int64_t i = 0; i < (int64_t)E * H; i++) rw[i] = fm_bf16_to_f32(fm_io_gen_router_w(seed, L, H, i));
    for (int x = 0; x < E; x++) sb[x] = fm_io_gen_score_bias(seed, L, x);
    hl.router_w = rw;
    hl.score_bias = sb;
    hl.gate = calloc((size_t)E, sizeof(fm_qmatrix));
    hl.up = calloc((size_t)E, sizeof(fm_qmatrix));
    hl.down = calloc((size_t)E, sizeof(fm_qmatrix));
    assert_non_null(hl.gate); assert_non_null(hl.up); assert_non_null(hl.down);
    const int T = 64;
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)T * H);
    float *xf = malloc(sizeof(float) * (size_t)T * H);
    assert_non_null(xb); assert_non_null(xf);
    make_x(99, T, H, xb, xf);
    /* the last token repeats token 1, so that the last token chunk of the
     * shared expert (and the last rows the routing writes) are checked
     * against token 1's reference */
    memcpy(xb + (size_t)(T - 1) * H, xb + (size_t)H, sizeof(uint16_t) * (size_t)H);
    memcpy(xf + (size_t)(T - 1) * H, xf + (size_t)H, sizeof(float) * (size_t)H);
    int32_t ids[NREF * 8];
    float w[NREF * 8];
    assert_int_equal(fm_route(&d, &hl, xf, NREF, NULL, ids, w), FM_OK);
    fm_qmatrix ph_gu, ph_dn; /* placeholders for the experts no reference token uses */
    gen_qm(&ph_gu, seed, L, 0, 0, I, H);
    gen_qm(&ph_dn, seed, L, 0, 2, H, I);
    for (int x = 0; x < E; x++) { hl.gate[x] = ph_gu; hl.up[x] = ph_gu; hl.down[x] = ph_dn; }
    unsigned char used[256] = {0};
    for (int i = 0; i < NREF * k; i++) used[ids[i]] = 1;
    for (int x = 0; x < E; x++)
        if (used[x]) {
            gen_qm(&hl.gate[x], seed, L, x, 0, I, H);
            gen_qm(&hl.up[x], seed, L, x, 1, I, H);
            gen_qm(&hl.down[x], seed, L, x, 2, H, I);
        }
    gen_qm(&hl.sh_gate, seed, L, -1, 0, d.shared_inter, H);
    gen_qm(&hl.sh_up, seed, L, -1, 1, d.shared_inter, H);
    gen_qm(&hl.sh_down, seed, L, -1, 2, H, d.shared_inter);
    float *ref = malloc(sizeof(float) * (size_t)NREF * H), *out = malloc(sizeof(float) * (size_t)T * H);
    assert_non_null(ref); assert_non_null(out);
    fm_moe_out ro = {ref, NULL, NULL};
    if (fm_moe_forward_ref(&d, &hl, xb, FM_DT_BF16, NREF, NULL, &ro)) fail_msg("reference: %s", fm_last_error());
    /* B = 64 twice: the configured kernels, then two warpgroups per block
     *, whose blocks this shape's rows fill */
    const int Bs[3] = {1, T, T};
    const fm_kernel_config wg2 = {FM_PATH_WGMMA, 128, 1, 8, 1, 16, 1.5f};
    for (int bi = 0; bi < 3; bi++) {
        int B = Bs[bi], nref = B < NREF ? B : NREF;
        int32_t gid[64 * 8];
        for (int64_t i = 0; i < (int64_t)B * H; i++) out[i] = NAN;
        fm_moe_out o = {out, gid, NULL};
        if (bi == 2) assert_int_equal(fm_cuda_engine_set_config(g_eng, &wg2), FM_OK);
        fm_status fs = fm_cuda_forward(g_eng, &d, cl, xb, FM_DT_BF16, B, NULL, &o);
        if (bi == 2) fm_cuda_engine_set_config(g_eng, NULL);
        if (fs) fail_msg("forward: %s", fm_last_error());
        int nonfinite = 0;
        for (int64_t i = 0; i < (int64_t)B * H; i++) nonfinite += !isfinite(out[i]);
        double num = 0, den = 0;
        for (int64_t i = 0; i < (int64_t)nref * H; i++) {
            double dd = (double)out[i] - ref[i];
            num += dd * dd;
            den += (double)ref[i] * ref[i];
        }
        int mism = 0;
        for (int i = 0; i < nref * k; i++) mism += gid[i] != ids[i];
        if (B == T) {
            for (int64_t i = 0; i < H; i++) {
                double dd = (double)out[(size_t)(T - 1) * H + i] - ref[(size_t)H + i];
                num += dd * dd;
                den += (double)ref[(size_t)H + i] * ref[(size_t)H + i];
            }
            for (int i = 0; i < k; i++) mism += gid[(T - 1) * k + i] != ids[k + i];
        }
        printf("# deepseek-v4-flash layer %d B=%d%s: rel %.2e on %d tokens, id mismatches %d\n", L, B,
               bi == 2 ? " (rows_per_block 128)" : "", sqrt(num / den), nref + (B == T), mism);
        assert_int_equal(nonfinite, 0);
        assert_int_equal(mism, 0);
        assert_true(sqrt(num / den) <= 5e-3);
    }
    free((void *)ph_gu.packed); free((void *)ph_gu.scales); free((void *)ph_dn.packed); free((void *)ph_dn.scales);
    for (int x = 0; x < E; x++)
        if (used[x]) {
            free((void *)hl.gate[x].packed); free((void *)hl.gate[x].scales);
            free((void *)hl.up[x].packed); free((void *)hl.up[x].scales);
            free((void *)hl.down[x].packed); free((void *)hl.down[x].scales);
        }
    free((void *)hl.sh_gate.packed); free((void *)hl.sh_gate.scales);
    free((void *)hl.sh_up.packed); free((void *)hl.sh_up.scales);
    free((void *)hl.sh_down.packed); free((void *)hl.sh_down.scales);
    free(hl.gate); free(hl.up); free(hl.down);
    free(rw); free(sb); free(xb); free(xf); free(ref); free(out);
    fm_cuda_layer_free(cl);
}

/* DeepSeek-V4's clamped SiLU (swiglu_limit > 0): activations large enough
 * that gate/up pass the limit, GPU against the float64 reference with the
 * clamp; the same layer without the limit (GPU and reference) differs
 * clearly, so the comparison sees the clamp. Both formats, B = 1 and 33. */
static void test_dsv4_clamp(void **state) {
    (void)state;
    NEED_GPU();
    const fm_qformat fmts[] = {FM_QF_NVFP4, FM_QF_MXFP4};
    const int Ts[] = {1, 33};
    for (int fi = 0; fi < 2; fi++) {
        fm_model_desc d;
        assert_int_equal(fm_preset_desc("tiny-deepseek-v4", fmts[fi], &d), FM_OK);
        assert_true(d.swiglu_limit > 0);
        int L = first_moe_layer(&d, 0);
        assert_true(L >= 0);
        fm_model_desc u = d;
        u.swiglu_limit = 0.0f;
        fm_moe_layer *hl;
        if (fm_moe_layer_random(&d, fmts[fi], 4242 + fi, L, &hl)) fail_msg("random layer: %s", fm_last_error());
        fm_cuda_layer *cl, *cu;
        if (fm_cuda_layer_upload(g_eng, &d, hl, &cl)) fail_msg("upload: %s", fm_last_error());
        if (fm_cuda_layer_upload(g_eng, &u, hl, &cu)) fail_msg("upload: %s", fm_last_error());
        for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
            int T = Ts[ti], H = d.hidden;
            uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)T * H);
            float *xf = malloc(sizeof(float) * (size_t)T * H);
            float *oc = malloc(sizeof(float) * (size_t)T * H), *ou = malloc(sizeof(float) * (size_t)T * H);
            int32_t *tok = malloc(sizeof(int32_t) * (size_t)T);
            assert_non_null(xb); assert_non_null(xf); assert_non_null(oc); assert_non_null(ou);
            assert_non_null(tok);
            make_x(777 + T, T, H, xb, xf);
            /* x 64 (exact in BF16) pushes the pre-activations past the limit */
            for (int64_t i = 0; i < (int64_t)T * H; i++) xb[i] = fm_f32_to_bf16(fm_bf16_to_f32(xb[i]) * 64.0f);
            for (int t = 0; t < T; t++) tok[t] = t;
            cmp_result r, ru;
            run_compare(&d, hl, cl, T, xb, tok, &r);
            run_compare(&u, hl, cu, T, xb, tok, &ru);
            printf("# tiny-deepseek-v4 %s clamp %g T=%2d rel %.2e (unclamped rel %.2e)\n", fm_qformat_name(fmts[fi]),
                   (double)d.swiglu_limit, T, r.rel, ru.rel);
            assert_int_equal(r.nonfinite, 0);
            assert_int_equal(r.id_mismatch, 0);
            assert_true(r.rel <= 5e-3);
            assert_int_equal(ru.nonfinite, 0);
            assert_true(ru.rel <= 5e-3);
            /* clamped and unclamped references differ well beyond the tolerance */
            fm_moe_out oo = {oc, NULL, NULL}, uo = {ou, NULL, NULL};
            if (fm_moe_forward_ref(&d, hl, xb, FM_DT_BF16, T, tok, &oo)) fail_msg("ref: %s", fm_last_error());
            if (fm_moe_forward_ref(&u, hl, xb, FM_DT_BF16, T, tok, &uo)) fail_msg("ref: %s", fm_last_error());
            double num = 0, den = 0;
            for (int64_t i = 0; i < (int64_t)T * H; i++) {
                double dd = (double)oc[i] - ou[i];
                num += dd * dd;
                den += (double)oc[i] * oc[i];
            }
            printf("#   clamped vs unclamped reference: rel %.2e\n", sqrt(num / (den > 0 ? den : 1)));
            assert_true(sqrt(num / (den > 0 ? den : 1)) > 1e-2);
            free(xb); free(xf); free(oc); free(ou); free(tok);
        }
        fm_cuda_layer_free(cl);
        fm_cuda_layer_free(cu);
        fm_moe_layer_free(hl);
    }
}


#ifdef FM_HAVE_CUDA
static double rel_diff(const float *a, const float *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}
#define CU_OK(call)                                                          \
    do {                                                                     \
        cudaError_t err_ = (call);                                           \
        if (err_ != cudaSuccess) fail_msg("%s: %s", #call, cudaGetErrorString(err_)); \
    } while (0)

/* Two pre-routed calls that must agree: ids_a then ids_b with the same
 * weights w (both uploaded to dids / dw first), the outputs NaN-poisoned
 * before; their relative difference. */
static double experts_pair(fm_cuda_engine *e, fm_cuda_layer *cl, const float *dx, int T, int k, int shared,
                           int32_t *dids, float *dw, const int32_t *ids_a, const int32_t *ids_b, const float *w,
                           float *dout, float *dout2, float *a, float *b, size_t n, cudaStream_t st) {
    float *outs[2] = {dout, dout2};
    const int32_t *idsv[2] = {ids_a, ids_b};
    CU_OK(cudaMemcpyAsync(dw, w, sizeof(float) * T * k, cudaMemcpyHostToDevice, st));
    for (int i = 0; i < 2; i++) {
        CU_OK(cudaMemcpyAsync(dids, idsv[i], sizeof(int32_t) * T * k, cudaMemcpyHostToDevice, st));
        CU_OK(cudaMemsetAsync(outs[i], 0xFF, sizeof(float) * n, st));
        if (fm_cuda_experts(e, cl, dx, FM_DT_F32, T, dids, dw, shared, outs[i], st))
            fail_msg("experts: %s", fm_last_error());
    }
    CU_OK(cudaStreamSynchronize(st));
    CU_OK(cudaMemcpy(a, dout, sizeof(float) * n, cudaMemcpyDeviceToHost));
    CU_OK(cudaMemcpy(b, dout2, sizeof(float) * n, cudaMemcpyDeviceToHost));
    return rel_diff(a, b, n);
}
#endif

/* One token on the splitk path at a shared expert as wide as the routed
 * ones (tiny-deepseek-v4 widened as test_splitk does): on a layer routed by
 * scores the one-launch kernel selects the top-k itself, on a hash-routed
 * layer the selection kernel runs before it; each kernel line says which,
 * fm_cuda_forward matches the float64 reference, and fm_cuda_moe on device
 * memory, captured in a CUDA graph and replayed twice, gives fm_cuda_forward's
 * ids and weights bit for bit and its output to rounding (the launch adds
 * the experts' down rows with atomics). */
static void test_fused1_select(void **state) {
    (void)state;
    NEED_GPU();
#ifdef FM_HAVE_CUDA
    if (!strstr(fm_cuda_engine_describe(g_eng), "sm_90")) {
        printf("# SKIPPED: the one-launch kernel needs sm_90\n");
        return;
    }
    fm_model_desc d;
    assert_int_equal(fm_preset_desc("tiny-deepseek-v4", FM_QF_NVFP4, &d), FM_OK);
    d.hidden = 640;
    d.moe_inter = 192;
    d.shared_inter = 192 * d.n_shared;
    if (fm_model_desc_validate(&d)) fail_msg("widened: %s", fm_last_error());
    const int H = d.hidden, k = d.topk;
    const fm_kernel_config cfg = {FM_PATH_SPLITK, 16, 1, 8, 1, 8, 0.1f};
    for (int hash = 0; hash < 2; hash++) {
        const int L = first_moe_layer(&d, hash);
        assert_true(L >= 0);
        fm_moe_layer *hl;
        fm_cuda_layer *cl;
        assert_int_equal(fm_moe_layer_random(&d, FM_QF_NVFP4, 77 + hash, L, &hl), FM_OK);
        if (fm_cuda_layer_upload(g_eng, &d, hl, &cl)) fail_msg("upload: %s", fm_last_error());
        if (fm_cuda_engine_set_config(g_eng, &cfg)) fail_msg("set config: %s", fm_last_error());
        char kern[1024];
        if (fm_cuda_layer_call_config(g_eng, cl, 1, NULL, kern, sizeof kern, NULL, 0))
            fail_msg("call config: %s", fm_last_error());
        printf("# layer %d: %s\n", L, kern);
        assert_non_null(strstr(kern, "fm_fused1_kernel"));
        assert_non_null(strstr(kern, hash ? "top-k: the selection kernel before the one-token launch (a hash-routed "
                                            "layer)"
                                          : "top-k: inside the one-token launch (no selection kernel)"));
        float *dx, *dout, *dw, *out = malloc(sizeof(float) * H), *got = malloc(sizeof(float) * H);
        float w[RT_TEST_MAXK], gw[RT_TEST_MAXK];
        int32_t *dids, *dtok, ids[RT_TEST_MAXK], gids[RT_TEST_MAXK];
        uint16_t *xb = malloc(sizeof(uint16_t) * H);
        float *xf = malloc(sizeof(float) * H);
        assert_non_null(out); assert_non_null(got); assert_non_null(xb); assert_non_null(xf);
        CU_OK(cudaMalloc((void **)&dx, sizeof(uint16_t) * H));
        CU_OK(cudaMalloc((void **)&dout, sizeof(float) * H));
        CU_OK(cudaMalloc((void **)&dw, sizeof(float) * k));
        CU_OK(cudaMalloc((void **)&dids, sizeof(int32_t) * k));
        CU_OK(cudaMalloc((void **)&dtok, sizeof(int32_t)));
        cudaStream_t st;
        CU_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        assert_int_equal(fm_cuda_engine_reserve(g_eng, cl, 1), FM_OK);
        for (int rep = 0; rep < 3; rep++) {
            int32_t tok[1];
            fm_test_token_ids(tok, 1, 900 + rep, 5, d.vocab_size);
            compare_x(&d, hl, cl, 1, 60 + rep, tok, "tiny-deepseek-v4 layer %d (hash %d) T=1 token %d", L, hash, tok[0]);
            make_x(60 + rep, 1, H, xb, xf);
            fm_moe_out o = {out, ids, w};
            if (fm_cuda_forward(g_eng, &d, cl, xb, FM_DT_BF16, 1, tok, &o)) fail_msg("forward: %s", fm_last_error());
            CU_OK(cudaMemcpyAsync(dx, xb, sizeof(uint16_t) * H, cudaMemcpyHostToDevice, st));
            CU_OK(cudaMemcpyAsync(dtok, tok, sizeof(int32_t), cudaMemcpyHostToDevice, st));
            cudaGraph_t g;
            cudaGraphExec_t ge;
            CU_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
            fm_status cs = fm_cuda_moe(g_eng, cl, dx, FM_DT_BF16, 1, hash ? dtok : NULL, dout, dids, dw, st);
            CU_OK(cudaStreamEndCapture(st, &g));
            if (cs) fail_msg("captured moe: %s", fm_last_error());
            CU_OK(cudaGraphInstantiate(&ge, g, 0));
            for (int r = 0; r < 2; r++) {
                CU_OK(cudaMemsetAsync(dout, 0xFF, sizeof(float) * H, st));
                CU_OK(cudaMemsetAsync(dids, 0xFF, sizeof(int32_t) * k, st));
                CU_OK(cudaGraphLaunch(ge, st));
                CU_OK(cudaStreamSynchronize(st));
                CU_OK(cudaMemcpy(got, dout, sizeof(float) * H, cudaMemcpyDeviceToHost));
                CU_OK(cudaMemcpy(gids, dids, sizeof(int32_t) * k, cudaMemcpyDeviceToHost));
                CU_OK(cudaMemcpy(gw, dw, sizeof(float) * k, cudaMemcpyDeviceToHost));
                assert_runs_close(out, got, (size_t)H, "captured one-token launch");
                assert_memory_equal(gids, ids, sizeof(int32_t) * k);
                assert_memory_equal(gw, w, sizeof(float) * k);
            }
            cudaGraphExecDestroy(ge);
            cudaGraphDestroy(g);
        }
        if (fm_cuda_engine_set_config(g_eng, NULL)) fail_msg("reset config: %s", fm_last_error());
        cudaStreamDestroy(st);
        cudaFree(dx); cudaFree(dout); cudaFree(dw); cudaFree(dids); cudaFree(dtok);
        free(out); free(got); free(xb); free(xf);
        fm_cuda_layer_free(cl);
        fm_moe_layer_free(hl);
    }
#endif
}

/* A rank's share generated on the GPU (fm_cuda_layer_random_shard) computes
 * what the CPU engine computes for that rank of the full host layer
 * (fm_shard_forward_cpu): TP through the normal forward (full router), EP
 * through the pre-routed call on the rank's pairs of the full routing plus
 * the shared expert on its token chunk. */
static void test_shard_layers(void **state) {
    (void)state;
    NEED_GPU();
#ifdef FM_HAVE_CUDA
    const char *presets[] = {"tiny-deepseek", "tiny-gptoss", "tiny-qwen3"};
    const fm_shard shards[] = {{FM_DIST_TP, 2, 1}, {FM_DIST_TP, 4, 0}, {FM_DIST_EP, 4, 1}, {FM_DIST_EP, 2, 0}};
    fm_cpu_engine *ce;
    assert_int_equal(fm_cpu_engine_new(FM_CPU_AUTO, 0, &ce), FM_OK);
    for (int pi = 0; pi < 3; pi++)
        for (size_t si = 0; si < sizeof shards / sizeof shards[0]; si++) {
            const fm_shard *sh = &shards[si];
            fm_model_desc d, v;
            assert_int_equal(fm_preset_desc(presets[pi], FM_QF_NONE, &d), FM_OK);
            if (fm_shard_desc(&d, FM_QF_NONE, sh, &v) != FM_OK) continue; /* e.g. an MXFP4 slice below a block */
            const int L = first_moe_layer(&d, 0), H = d.hidden, k = d.topk, T = 9;
            fm_moe_layer *hl;
            fm_cuda_layer *cl;
            assert_int_equal(fm_moe_layer_random(&d, d.expert_format, 777, L, &hl), FM_OK);
            if (fm_cuda_layer_random_shard(g_eng, &d, d.expert_format, 777, L, sh, &cl))
                fail_msg("shard layer: %s", fm_last_error());
            float *x = fm_test_normal_new((size_t)T * H, 9, 1);
            float *ref = calloc((size_t)T * H, sizeof(float)), *got = calloc((size_t)T * H, sizeof(float));
            int32_t *ids = calloc((size_t)T * k, sizeof(int32_t));
            float *w = calloc((size_t)T * k, sizeof(float));
            if (fm_shard_forward_cpu(ce, &d, hl, sh, x, FM_DT_F32, T, NULL, ref, ids, w, NULL))
                fail_msg("cpu shard: %s", fm_last_error());
            if (sh->mode == FM_DIST_TP) {
                fm_moe_out o = {got, NULL, NULL};
                if (fm_cuda_forward(g_eng, &v, cl, x, FM_DT_F32, T, NULL, &o)) fail_msg("forward: %s", fm_last_error());
            } else {
                const int kl = v.topk;
                int32_t *lids = calloc((size_t)T * kl, sizeof(int32_t)), *none = malloc(sizeof(int32_t) * T * kl);
                float *lw = calloc((size_t)T * kl, sizeof(float)), *sh_out = calloc((size_t)T * H, sizeof(float));
                for (int i = 0; i < T * kl; i++) none[i] = -1;
                fm_shard_local_ids(sh, d.n_experts, k, T, ids, w, kl, lids, lw);
                int t0, nc;
                fm_shard_token_chunk(sh, T, &t0, &nc);
                float *dx, *dout;
                int32_t *di, *dn;
                float *dw;
                CU_OK(cudaMalloc((void **)&dx, sizeof(float) * T * H));
                CU_OK(cudaMalloc((void **)&dout, sizeof(float) * T * H));
                CU_OK(cudaMalloc((void **)&di, sizeof(int32_t) * T * kl));
                CU_OK(cudaMalloc((void **)&dn, sizeof(int32_t) * T * kl));
                CU_OK(cudaMalloc((void **)&dw, sizeof(float) * T * kl));
                CU_OK(cudaMemcpy(dx, x, sizeof(float) * T * H, cudaMemcpyHostToDevice));
                CU_OK(cudaMemcpy(di, lids, sizeof(int32_t) * T * kl, cudaMemcpyHostToDevice));
                CU_OK(cudaMemcpy(dn, none, sizeof(int32_t) * T * kl, cudaMemcpyHostToDevice));
                CU_OK(cudaMemcpy(dw, lw, sizeof(float) * T * kl, cudaMemcpyHostToDevice));
                assert_int_equal(fm_cuda_engine_reserve(g_eng, cl, T), FM_OK);
                assert_int_equal(fm_cuda_experts(g_eng, cl, dx, FM_DT_F32, T, di, dw, 0, dout, NULL), FM_OK);
                CU_OK(cudaMemcpy(got, dout, sizeof(float) * T * H, cudaMemcpyDeviceToHost));
                if (nc > 0 && d.n_shared > 0) {
                    assert_int_equal(fm_cuda_experts(g_eng, cl, dx + (size_t)t0 * H, FM_DT_F32, nc, dn, dw, 1, dout, NULL),
                                     FM_OK);
                    CU_OK(cudaMemcpy(sh_out, dout, sizeof(float) * nc * H, cudaMemcpyDeviceToHost));
                    for (int i = 0; i < nc * H; i++) got[(size_t)t0 * H + i] += sh_out[i];
                }
                cudaFree(dx); cudaFree(dout); cudaFree(di); cudaFree(dn); cudaFree(dw);
                free(lids); free(none); free(lw); free(sh_out);
            }
            double err = fm_test_rel_err(got, ref, (size_t)T * H);
            printf("# %-14s %s %d rank %d: GPU shard vs CPU rank, rel. error %.2e\n", presets[pi],
                   fm_dist_mode_name(sh->mode), sh->ranks, sh->rank, err);
            /* the CUDA engine takes BF16 activations where the CPU engine keeps FP32: the 5e-3 bound of
             * every GPU-against-reference check here */
            if (!(err <= 5e-3)) fail_msg("%s: GPU shard differs from the CPU rank (%.3g)", presets[pi], err);
            free(x); free(ref); free(got); free(ids); free(w);
            fm_cuda_layer_free(cl);
            fm_moe_layer_free(hl);
        }
    fm_cpu_engine_free(ce);
#endif
}

/* Calls on caller-owned device memory and a caller's stream: fm_cuda_moe
 * against fm_cuda_forward and the float64 reference; fm_cuda_experts with
 * the ids and weights routing chose (the same function), with slots dropped
 * by an id of -1 or one past the experts (the same as a zero weight), without
 * the shared expert; both captured in a CUDA graph and replayed; and the
 * refusals (no reserved workspace, T above it, misaligned buffers). */
static void test_device_calls(void **state) {
    (void)state;
    NEED_GPU();
#ifdef FM_HAVE_CUDA
    const char *presets[] = {"tiny-deepseek", "tiny-qwen3", "tiny-gptoss"};
    const int Ts[] = {1, 6, 70};
    for (int pi = 0; pi < 3; pi++) {
        fm_model_desc d;
        assert_int_equal(fm_preset_desc(presets[pi], FM_QF_NONE, &d), FM_OK);
        const int L = first_moe_layer(&d, 0), H = d.hidden, k = d.topk;
        fm_moe_layer *hl;
        fm_cuda_layer *cl;
        assert_int_equal(fm_moe_layer_random(&d, d.expert_format, 4040 + pi, L, &hl), FM_OK);
        fm_cuda_engine *e = NULL;
        if (fm_cuda_engine_new(0, &e)) fail_msg("engine: %s", fm_last_error());
        if (fm_cuda_layer_upload(e, &d, hl, &cl)) fail_msg("upload: %s", fm_last_error());
        const int TM = 70;
        float *dx, *dout, *dout2, *dw;
        int32_t *dids;
        CU_OK(cudaMalloc((void **)&dx, sizeof(float) * TM * H + 16));
        CU_OK(cudaMalloc((void **)&dout, sizeof(float) * TM * H));
        CU_OK(cudaMalloc((void **)&dout2, sizeof(float) * TM * H));
        CU_OK(cudaMalloc((void **)&dids, sizeof(int32_t) * TM * k));
        CU_OK(cudaMalloc((void **)&dw, sizeof(float) * TM * k));
        cudaStream_t st;
        CU_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        /* without a reservation the device calls refuse */
        assert_int_equal(fm_cuda_moe(e, cl, dx, FM_DT_F32, 1, NULL, dout, NULL, NULL, st), FM_E_RANGE);
        assert_non_null(strstr(fm_last_error(), "fm_cuda_engine_reserve"));
        assert_int_equal(fm_cuda_engine_reserve(e, cl, 64), FM_OK);
        assert_int_equal(fm_cuda_moe(e, cl, dx, FM_DT_F32, 65, NULL, dout, NULL, NULL, st), FM_E_RANGE);
        assert_int_equal(fm_cuda_moe(e, cl, (char *)dx + 4, FM_DT_F32, 1, NULL, dout, NULL, NULL, st), FM_E_ARG);
        assert_int_equal(fm_cuda_experts(e, cl, dx, FM_DT_I32, 1, dids, dw, 1, dout, st), FM_E_ARG);
        assert_int_equal(fm_cuda_engine_reserve(e, cl, TM), FM_OK);
        for (int ti = 0; ti < 3; ti++) {
            const int T = Ts[ti];
            const size_t n = (size_t)T * H;
            float *xf = malloc(sizeof(float) * n), *ref = malloc(sizeof(float) * n), *a = malloc(sizeof(float) * n),
                  *b = malloc(sizeof(float) * n), *w = malloc(sizeof(float) * T * k), *w0 = malloc(sizeof(float) * T * k);
            int32_t *ids = malloc(sizeof(int32_t) * T * k), *ids0 = malloc(sizeof(int32_t) * T * k);
            uint16_t *xb = malloc(sizeof(uint16_t) * n);
            assert_non_null(xf); assert_non_null(ref); assert_non_null(a); assert_non_null(b);
            assert_non_null(w); assert_non_null(ids); assert_non_null(xb); assert_non_null(w0); assert_non_null(ids0);
            make_x(4100 + T, T, H, xb, xf);
            fm_moe_out ro = {ref, ids, w};
            if (fm_cuda_forward(e, &d, cl, xf, FM_DT_F32, T, NULL, &ro)) fail_msg("forward: %s", fm_last_error());
            /* on the caller's stream, as a caller must: the library orders nothing else */
            CU_OK(cudaMemcpyAsync(dx, xf, sizeof(float) * n, cudaMemcpyHostToDevice, st));
            CU_OK(cudaMemsetAsync(dout, 0xFF, sizeof(float) * n, st)); /* NaN poison */
            if (fm_cuda_moe(e, cl, dx, FM_DT_F32, T, NULL, dout, dids, dw, st)) fail_msg("moe: %s", fm_last_error());
            CU_OK(cudaStreamSynchronize(st));
            CU_OK(cudaMemcpy(a, dout, sizeof(float) * n, cudaMemcpyDeviceToHost));
            CU_OK(cudaMemcpy(ids0, dids, sizeof(int32_t) * T * k, cudaMemcpyDeviceToHost));
            CU_OK(cudaMemcpy(w0, dw, sizeof(float) * T * k, cudaMemcpyDeviceToHost));
            double r1 = rel_diff(a, ref, n);
            printf("# %-13s T=%2d moe vs forward %.2e\n", presets[pi], T, r1);
            assert_true(r1 <= 1e-5);
            assert_memory_equal(ids0, ids, sizeof(int32_t) * T * k);
            assert_memory_equal(w0, w, sizeof(float) * T * k);
            cmp_result cr;
            run_compare_dt(&d, hl, cl, T, xf, FM_DT_F32, NULL, &cr);
            check_ref(&cr, 1, "%-13s T=%2d forward vs float64", presets[pi], T);
            /* pre-routed with routing's own choice: the same function */
            if (fm_cuda_experts(e, cl, dx, FM_DT_F32, T, dids, dw, 1, dout2, st)) fail_msg("experts: %s", fm_last_error());
            CU_OK(cudaStreamSynchronize(st));
            CU_OK(cudaMemcpy(b, dout2, sizeof(float) * n, cudaMemcpyDeviceToHost));
            double r2 = rel_diff(b, ref, n);
            printf("# %-13s T=%2d experts vs forward %.2e\n", presets[pi], T, r2);
            assert_true(r2 <= 1e-5);
            /* slot 0 of every token dropped by -1, slot 1 by E: the same as
             * zero weights there; the shared expert left out */
            for (int t = 0; t < T; t++) {
                ids0[t * k] = -1;
                if (k > 1) ids0[t * k + 1] = d.n_experts;
                w0[t * k] = 0;
                if (k > 1) w0[t * k + 1] = 0;
            }
            double r3 = experts_pair(e, cl, dx, T, k, 0, dids, dw, ids0, ids, w0, dout, dout2, a, b, n, st);
            printf("# %-13s T=%2d dropped slots vs zero weights %.2e\n", presets[pi], T, r3);
            assert_true(r3 <= 1e-6);
            /* every slot dropped, the shared expert kept (no routed expert
             * active: at one token, the one-launch kernel's shared-only
             * case), against every weight zero */
            for (int i = 0; i < T * k; i++) {
                ids0[i] = -1;
                w0[i] = 0;
            }
            double r5 = experts_pair(e, cl, dx, T, k, 1, dids, dw, ids0, ids, w0, dout, dout2, a, b, n, st);
            printf("# %-13s T=%2d no routed expert vs zero weights, shared kept %.2e\n", presets[pi], T, r5);
            assert_true(r5 <= 1e-6);
            /* captured in a graph on the caller's stream, replayed twice */
            cudaGraph_t g;
            cudaGraphExec_t ge;
            CU_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
            fm_status cs = fm_cuda_moe(e, cl, dx, FM_DT_F32, T, NULL, dout, NULL, NULL, st);
            CU_OK(cudaStreamEndCapture(st, &g));
            if (cs) fail_msg("captured moe: %s", fm_last_error());
            CU_OK(cudaGraphInstantiate(&ge, g, 0));
            for (int rep = 0; rep < 2; rep++) {
                CU_OK(cudaMemsetAsync(dout, 0xFF, sizeof(float) * n, st));
                CU_OK(cudaGraphLaunch(ge, st));
                CU_OK(cudaStreamSynchronize(st));
                CU_OK(cudaMemcpy(a, dout, sizeof(float) * n, cudaMemcpyDeviceToHost));
                double r4 = rel_diff(a, ref, n);
                printf("# %-13s T=%2d graph replay %d vs forward %.2e\n", presets[pi], T, rep, r4);
                assert_true(r4 <= 1e-5);
            }
            cudaGraphExecDestroy(ge);
            cudaGraphDestroy(g);
            free(xf); free(ref); free(a); free(b); free(w); free(w0); free(ids); free(ids0); free(xb);
        }
        cudaStreamDestroy(st);
        cudaFree(dx); cudaFree(dout); cudaFree(dout2); cudaFree(dids); cudaFree(dw);
        fm_cuda_layer_free(cl);
        fm_cuda_engine_free(e);
        fm_moe_layer_free(hl);
    }
#endif
}

/* Setup behind other work on the legacy default stream (a framework's or
 * another library's copies and kernels): a fresh engine, and layers
 * generated on the GPU and uploaded from the host while 15 - 20 ms of copies
 * are queued there, compute what the float64 reference computes. The
 * engine's streams are non-blocking and do not wait for that stream, so its
 * setup (zeroed weight stacks and workspace, pageable copies) must. */
static void test_setup_behind_legacy_work(void **state) {
    (void)state;
    NEED_GPU();
#ifdef FM_HAVE_CUDA
    const size_t n = (size_t)256 << 20;
    void *a = NULL, *b = NULL;
    CU_OK(cudaMalloc(&a, n));
    CU_OK(cudaMalloc(&b, n));
    CU_OK(cudaMemset(a, 0x3C, n));
    CU_OK(cudaDeviceSynchronize());
    const struct { const char *preset; fm_qformat f; } cases[] = {
        {"tiny-deepseek", FM_QF_NVFP4}, {"tiny-qwen3", FM_QF_MXFP4}, {"tiny-gptoss", FM_QF_MXFP4}};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
        for (int gen = 0; gen < 2; gen++) {
            fm_model_desc d;
            assert_int_equal(fm_preset_desc(cases[ci].preset, cases[ci].f, &d), FM_OK);
            const int L = first_moe_layer(&d, 0), T = 7;
            const uint64_t seed = 7100 + ci;
            fm_moe_layer *hl;
            if (fm_moe_layer_random(&d, cases[ci].f, seed, L, &hl)) fail_msg("random layer: %s", fm_last_error());
            for (int i = 0; i < 128; i++) CU_OK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, 0));
            fm_cuda_engine *e;
            if (fm_cuda_engine_new(0, &e)) fail_msg("engine: %s", fm_last_error());
            fm_cuda_layer *cl;
            fm_status s = gen ? fm_cuda_layer_random(e, &d, cases[ci].f, seed, L, &cl)
                              : fm_cuda_layer_upload(e, &d, hl, &cl);
            if (s) fail_msg("layer: %s", fm_last_error());
            /* the first forward grows the fresh engine's workspace behind more */
            for (int i = 0; i < 128; i++) CU_OK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, 0));
            uint16_t *xb = malloc(sizeof(uint16_t) * T * d.hidden);
            float *xf = malloc(sizeof(float) * T * d.hidden);
            assert_non_null(xb); assert_non_null(xf);
            make_x(seed, T, d.hidden, xb, xf);
            cmp_result r;
            run_compare_eng(e, &d, hl, cl, T, xb, FM_DT_BF16, NULL, &r);
            check_ref(&r, 1, "%-16s %s %s behind legacy-stream copies T=%d", cases[ci].preset,
                      fm_qformat_name(cases[ci].f), gen ? "generated" : "uploaded", T);
            free(xb); free(xf);
            fm_cuda_layer_free(cl);
            fm_cuda_engine_free(e);
            fm_moe_layer_free(hl);
        }
    CU_OK(cudaDeviceSynchronize());
    cudaFree(a);
    cudaFree(b);
#endif
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_vs_reference),     cmocka_unit_test(test_all_on_one_expert),
        cmocka_unit_test(test_hash_duplicate_ids), cmocka_unit_test(test_nonfinite),
        cmocka_unit_test(test_scale_signs),
        cmocka_unit_test(test_forced_configs),   cmocka_unit_test(test_layer_random_same),
        cmocka_unit_test(test_bad_inputs),       cmocka_unit_test(test_bench_runs),
        cmocka_unit_test(test_dsv4_flash_shape), cmocka_unit_test(test_dsv4_clamp),
        cmocka_unit_test(test_input_dtypes),     cmocka_unit_test(test_launch_switches),
        cmocka_unit_test(test_grouping_k8),      cmocka_unit_test(test_route_many_experts),
        cmocka_unit_test(test_router_not_bf16),  cmocka_unit_test(test_sel_spread), cmocka_unit_test(test_route_ties),
        cmocka_unit_test(test_device_calls),     cmocka_unit_test(test_splitk), cmocka_unit_test(test_fused1_select), cmocka_unit_test(test_down_chunks),
        cmocka_unit_test(test_gateup_ksplit), cmocka_unit_test(test_bench_act),
        cmocka_unit_test(test_shard_layers),     cmocka_unit_test(test_setup_behind_legacy_work),
    };
    int rc = cmocka_run_group_tests(tests, setup, teardown);
    /* without a usable GPU every test above skipped itself: exit 77 so that
     * ctest lists the program as skipped, not passed */
    char why[256];
    if (rc == 0 && !fm_cuda_available(why, sizeof why)) return 77;
    return rc;
}
