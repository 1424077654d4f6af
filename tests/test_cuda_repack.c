/*
 * The CUDA engine's layers from engine tensors in device memory
 * (fm_cuda_layer_from_tensors: repacked on the GPU) against the host path
 * (fm_moe_layer_from_tensors, the checkpoint loader's copy, then
 * fm_cuda_layer_upload's repack on the host): the device layouts must be
 * byte-identical, for ModelOpt NVFP4 (w13_weight_scale_2 [E, 2] and [E],
 * F8_E4M3 and U8 scales, with and without the shared expert) and gpt-oss
 * MXFP4 (biases in BF16 and F32), on padded strides, on odd shapes (E = 3,
 * 5, 7; H and I at the format's block; H not a multiple of 128), with
 * every NVFP4 scale byte (negative, zero, NaN) and a router in BF16, in F32
 * exact in BF16 and in F32 that is not. Value problems get the host path's
 * error. Also: the calls on caller-owned memory look no kernel config up
 * (the layer's table, filled at fm_cuda_engine_reserve), in a CUDA graph
 * too. Skipped (exit 77) without a GPU.
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

#include "fp4moe.h"
#include "util/util.h"
#ifdef FM_HAVE_CUDA
#include <cuda_runtime.h>
#include "cuda/cfg_cache.h"
#endif

#ifdef FM_HAVE_CUDA
static fm_cuda_engine *g_eng;

#define NVIEWS 24 /* the fm_tensor views of fm_layer_tensors */

typedef struct {
    fm_layer_tensors t;  /* host views */
    fm_layer_tensors dt; /* the same on the device */
    void *host[NVIEWS], *dev[NVIEWS];
} views;

static fm_tensor *view_i(fm_layer_tensors *t, int i) { return &t->w13_weight + i; }

static uint64_t g_draw;
static uint32_t rnd(void) { return (uint32_t)fm_rng_u64(7, 99, g_draw++); }

/* A host view with outer strides padded by pad[i] elements, random bytes. */
static uint8_t *mk(views *v, fm_tensor *t, fm_dtype dt, int nd, const int64_t *shape, const int64_t *pad) {
    const size_t es = (size_t)(fm_dtype_bits(dt) / 8);
    memset(t, 0, sizeof *t);
    t->dtype = dt;
    t->ndim = nd;
    int64_t total = 1;
    if (nd > 0) {
        t->stride[nd - 1] = 1;
        for (int i = nd - 1; i >= 0; i--) {
            t->shape[i] = shape[i];
            if (i < nd - 1) t->stride[i] = t->stride[i + 1] * shape[i + 1] + (pad ? pad[i] : 0);
        }
        total = t->stride[0] * shape[0];
    }
    uint8_t *p = malloc((size_t)total * es);
    assert_non_null(p);
    for (size_t i = 0; i < (size_t)total * es; i++) p[i] = (uint8_t)rnd();
    t->data = p;
    int idx = (int)(t - &v->t.w13_weight);
    v->host[idx] = p;
    return p;
}

static size_t span_of(const fm_tensor *t) {
    size_t n = (size_t)(fm_dtype_bits(t->dtype) / 8);
    return t->ndim > 0 ? n * (size_t)(t->stride[0] * t->shape[0]) : n;
}

/* Every element of a float view (F32 / BF16) set to a random value in
 * [lo, hi); exact_bf16: F32 values that are exact in BF16. */
static void fill_f(fm_tensor *t, float lo, float hi, int exact_bf16) {
    const int64_t n = (int64_t)(span_of(t) / (size_t)(fm_dtype_bits(t->dtype) / 8));
    for (int64_t i = 0; i < n; i++) {
        float f = lo + (hi - lo) * (float)(rnd() % 1000000) / 1e6f;
        if (t->dtype == FM_DT_BF16) ((uint16_t *)t->data)[i] = fm_f32_to_bf16(f);
        else ((float *)t->data)[i] = exact_bf16 ? fm_bf16_to_f32(fm_f32_to_bf16(f)) : f;
    }
}

/* MXFP4 scales within the decode's range (and the E8M0 NaN). */
static void mx_scales(fm_tensor *t) {
    uint8_t *p = (uint8_t *)t->data;
    for (size_t i = 0; i < span_of(t); i++) p[i] = rnd() % 61 == 0 ? 0xFF : (uint8_t)(100 + rnd() % 36);
}

static void to_device(views *v) {
    v->dt = v->t;
    for (int i = 0; i < NVIEWS; i++) {
        fm_tensor *h = view_i(&v->t, i), *d = view_i(&v->dt, i);
        if (!h->data) continue;
        assert_int_equal(cudaMalloc(&v->dev[i], span_of(h)), cudaSuccess);
        assert_int_equal(cudaMemcpy(v->dev[i], h->data, span_of(h), cudaMemcpyHostToDevice), cudaSuccess);
        d->data = v->dev[i];
    }
}

static void views_free(views *v) {
    for (int i = 0; i < NVIEWS; i++) {
        free(v->host[i]);
        if (v->dev[i]) cudaFree(v->dev[i]);
    }
    memset(v, 0, sizeof *v);
}

typedef struct {
    int s2_1d;       /* w13_weight_scale_2 [E] instead of [E, 2]      */
    int scale_u8;    /* block scales as U8                            */
    int shared;      /* the fused shared expert                       */
    int inter;       /* the partition's I (0: the model's)            */
    fm_dtype router; /* F32 or BF16, FM_DT_INVALID: none              */
    int exact_bf16;  /* an F32 router exact in BF16                   */
} opts;

static void make_modelopt(views *v, const fm_model_desc *d, opts o) {
    memset(v, 0, sizeof *v);
    const int64_t E = d->n_experts, H = d->hidden, I = o.inter ? o.inter : d->moe_inter;
    const fm_dtype sdt = o.scale_u8 ? FM_DT_U8 : FM_DT_F8_E4M3;
    fm_layer_tensors *t = &v->t;
    t->layout = FM_TL_MODELOPT_NVFP4;
    t->inter = (int)I;
    mk(v, &t->w13_weight, FM_DT_U8, 3, (int64_t[]){E, 2 * I, H / 2}, (int64_t[]){64, 8, 0});
    mk(v, &t->w13_weight_scale, sdt, 3, (int64_t[]){E, 2 * I, H / 16}, (int64_t[]){0, 3, 0});
    if (o.s2_1d) mk(v, &t->w13_weight_scale_2, FM_DT_F32, 1, (int64_t[]){E}, NULL);
    else mk(v, &t->w13_weight_scale_2, FM_DT_F32, 2, (int64_t[]){E, 2}, (int64_t[]){1, 0});
    fill_f(&t->w13_weight_scale_2, 0.001f, 2.0f, 0);
    mk(v, &t->w2_weight, FM_DT_U8, 3, (int64_t[]){E, H, I / 2}, (int64_t[]){0, 4, 0});
    mk(v, &t->w2_weight_scale, sdt, 3, (int64_t[]){E, H, I / 16}, (int64_t[]){16, 0, 0});
    mk(v, &t->w2_weight_scale_2, FM_DT_F32, 1, (int64_t[]){E}, NULL);
    fill_f(&t->w2_weight_scale_2, 0.001f, 2.0f, 0);
    if (o.shared) {
        const int64_t S = I;
        fm_tensor *pk[3] = {&t->shared_gate, &t->shared_up, &t->shared_down};
        fm_tensor *sc[3] = {&t->shared_gate_scale, &t->shared_up_scale, &t->shared_down_scale};
        fm_tensor *s2[3] = {&t->shared_gate_scale_2, &t->shared_up_scale_2, &t->shared_down_scale_2};
        for (int m = 0; m < 3; m++) {
            const int64_t R = m == 2 ? H : S, K = m == 2 ? S : H;
            mk(v, pk[m], FM_DT_U8, 2, (int64_t[]){R, K / 2}, (int64_t[]){m == 0 ? 8 : 0, 0});
            mk(v, sc[m], sdt, 2, (int64_t[]){R, K / 16}, (int64_t[]){m == 2 ? 3 : 0, 0});
            mk(v, s2[m], FM_DT_F32, m == 1 ? 1 : 0, (int64_t[]){1}, NULL);
            fill_f(s2[m], 0.01f, 1.0f, 0);
        }
    }
    if (o.router != FM_DT_INVALID) {
        mk(v, &t->router_w, o.router, 2, (int64_t[]){E, H}, (int64_t[]){4, 0});
        fill_f(&t->router_w, -1.0f, 1.0f, o.exact_bf16);
        if (d->route == FM_ROUTE_NOAUX_TC) {
            mk(v, &t->score_bias, FM_DT_BF16, 1, (int64_t[]){E}, NULL);
            fill_f(&t->score_bias, -0.1f, 0.1f, 0);
        }
    }
}

static void make_gptoss(views *v, const fm_model_desc *d, opts o) {
    memset(v, 0, sizeof *v);
    const int64_t E = d->n_experts, H = d->hidden, I = o.inter ? o.inter : d->moe_inter;
    fm_layer_tensors *t = &v->t;
    t->layout = FM_TL_GPTOSS_MXFP4;
    t->inter = (int)I;
    mk(v, &t->gate_up_blocks, FM_DT_U8, 4, (int64_t[]){E, 2 * I, H / 32, 16}, (int64_t[]){32, 16, 8, 0});
    mk(v, &t->gate_up_scales, o.scale_u8 ? FM_DT_U8 : FM_DT_F8_E8M0, 3, (int64_t[]){E, 2 * I, H / 32}, NULL);
    mx_scales(&t->gate_up_scales);
    mk(v, &t->gate_up_bias, FM_DT_BF16, 2, (int64_t[]){E, 2 * I}, (int64_t[]){2, 0});
    fill_f(&t->gate_up_bias, -1.0f, 1.0f, 0);
    mk(v, &t->down_blocks, FM_DT_U8, 4, (int64_t[]){E, H, I / 32, 16}, NULL);
    mk(v, &t->down_scales, o.scale_u8 ? FM_DT_U8 : FM_DT_F8_E8M0, 3, (int64_t[]){E, H, I / 32}, (int64_t[]){0, 1, 0});
    mx_scales(&t->down_scales);
    mk(v, &t->down_bias, FM_DT_F32, 2, (int64_t[]){E, H}, (int64_t[]){3, 0});
    fill_f(&t->down_bias, -1.0f, 1.0f, 0);
    if (o.router != FM_DT_INVALID) {
        mk(v, &t->router_w, o.router, 2, (int64_t[]){E, H}, NULL);
        fill_f(&t->router_w, -1.0f, 1.0f, o.exact_bf16);
        mk(v, &t->router_bias, FM_DT_F32, 1, (int64_t[]){E}, NULL);
        fill_f(&t->router_bias, -0.5f, 0.5f, 0);
    }
}

static int first_moe(const fm_model_desc *d) {
    int L = 0;
    while (!fm_model_is_moe_layer(d, L)) L++;
    return L < d->n_hash_layers ? d->n_hash_layers : L;
}

/* The host path as it stood: the loader's host copy, a zero router when
 * there is none, fm_cuda_layer_upload. */
static fm_status host_path(const fm_model_desc *d, int L, const fm_layer_tensors *t, fm_cuda_layer **out) {
    fm_moe_layer *hl = NULL;
    fm_status s = fm_moe_layer_from_tensors(d, L, t, &hl);
    if (s) return s;
    float *zero = NULL;
    fm_model_desc dd = *d;
    dd.moe_inter = hl->inter;
    if (!hl->router_w) {
        zero = calloc((size_t)hl->n_experts * hl->hidden, sizeof(float));
        assert_non_null(zero);
        hl->router_w = zero;
        dd.n_hash_layers = 0;
    }
    s = fm_cuda_layer_upload(g_eng, &dd, hl, out);
    if (zero) hl->router_w = NULL;
    free(zero);
    fm_moe_layer_free(hl);
    return s;
}

static void same_bytes(const char *what, const fm_model_desc *d, views *v) {
    to_device(v);
    const int L = first_moe(d);
    fm_cuda_layer *ref = NULL, *dev = NULL;
    fm_status s = host_path(d, L, &v->t, &ref);
    if (s) fail_msg("%s: host path: %s", what, fm_last_error());
    s = fm_cuda_layer_from_tensors(g_eng, d, L, &v->dt, &dev);
    if (s) fail_msg("%s: device repack: %s", what, fm_last_error());
    char why[512] = "";
    if (fm_cuda_layer_bytes_differ(ref, dev, 0, why, sizeof why)) fail_msg("%s: the layouts differ: %s", what, why);
    print_message("# %s: byte-identical\n", what);
    fm_cuda_layer_free(ref);
    fm_cuda_layer_free(dev);
}

static fm_model_desc preset(const char *name, fm_qformat f) {
    fm_model_desc d;
    assert_int_equal(fm_preset_desc(name, f, &d), FM_OK);
    return d;
}

/* A desc of another shape (validated). */
static fm_model_desc reshape(fm_model_desc d, int E, int k, int H, int I, int shared) {
    d.n_experts = E;
    d.topk = k;
    d.hidden = H;
    d.moe_inter = I;
    d.n_shared = shared;
    d.shared_inter = shared * I;
    d.n_group = 1;
    d.topk_group = 1;
    assert_int_equal(fm_model_desc_validate(&d), FM_OK);
    return d;
}

static int setup(void **state) {
    (void)state;
    char why[256];
    if (!fm_cuda_available(why, sizeof why) || fm_cuda_engine_new(0, &g_eng) != FM_OK) {
        printf("SKIPPED: no CUDA GPU (%s)\n", g_eng ? "" : why);
        g_eng = NULL;
    }
    return 0;
}

static int teardown(void **state) {
    (void)state;
    fm_cuda_engine_free(g_eng);
    return 0;
}

#define NEED_GPU() \
    do {           \
        if (!g_eng) skip(); \
    } while (0)

static void test_nvfp4_same_bytes(void **state) {
    (void)state;
    NEED_GPU();
    const fm_model_desc ds = preset("tiny-deepseek", FM_QF_NVFP4); /* E 16, H 128, I 64, shared */
    views v;
    make_modelopt(&v, &ds, (opts){0, 0, 1, 0, FM_DT_BF16, 0});
    same_bytes("tiny-deepseek, scale_2 [E, 2], shared, BF16 router", &ds, &v);
    views_free(&v);
    make_modelopt(&v, &ds, (opts){1, 1, 1, 32, FM_DT_F32, 1});
    same_bytes("tiny-deepseek, scale_2 [E], U8 scales, I/2, F32 router exact in BF16", &ds, &v);
    views_free(&v);
    make_modelopt(&v, &ds, (opts){0, 0, 0, 0, FM_DT_F32, 0});
    same_bytes("tiny-deepseek, no shared expert, F32 router", &ds, &v);
    views_free(&v);
    const fm_model_desc q = reshape(preset("tiny-qwen3", FM_QF_NVFP4), 5, 2, 16, 16, 0);
    make_modelopt(&v, &q, (opts){1, 0, 0, 0, FM_DT_BF16, 0});
    same_bytes("E 5, H 16, I 16 (the NVFP4 block), scale_2 [E]", &q, &v);
    views_free(&v);
    make_modelopt(&v, &q, (opts){0, 1, 0, 0, FM_DT_F32, 0});
    same_bytes("E 5, H 16, I 16, scale_2 [E, 2]", &q, &v);
    views_free(&v);
    const fm_model_desc o = reshape(ds, 7, 3, 144, 48, 1);
    make_modelopt(&v, &o, (opts){0, 0, 1, 0, FM_DT_BF16, 0});
    same_bytes("E 7, H 144, I 48, shared 48", &o, &v);
    views_free(&v);
    /* without a router: the experts the same (the router is zero) */
    make_modelopt(&v, &o, (opts){1, 0, 1, 0, FM_DT_INVALID, 0});
    same_bytes("E 7, no router", &o, &v);
    views_free(&v);
}

static void test_mxfp4_same_bytes(void **state) {
    (void)state;
    NEED_GPU();
    const fm_model_desc g = preset("tiny-gptoss", FM_QF_MXFP4); /* E 8, H 128, I 64 */
    views v;
    make_gptoss(&v, &g, (opts){0, 0, 0, 0, FM_DT_BF16, 0});
    same_bytes("tiny-gptoss, BF16 router", &g, &v);
    views_free(&v);
    make_gptoss(&v, &g, (opts){0, 1, 0, 32, FM_DT_F32, 0});
    same_bytes("tiny-gptoss, U8 scales, I/2, F32 router", &g, &v);
    views_free(&v);
    const fm_model_desc o = reshape(g, 3, 2, 32, 32, 0);
    make_gptoss(&v, &o, (opts){0, 0, 0, 0, FM_DT_F32, 1});
    same_bytes("E 3, H 32, I 32 (the MXFP4 block)", &o, &v);
    views_free(&v);
    const fm_model_desc p = reshape(g, 5, 2, 160, 96, 0);
    make_gptoss(&v, &p, (opts){0, 0, 0, 0, FM_DT_INVALID, 0});
    same_bytes("E 5, H 160, I 96, no router", &p, &v);
    views_free(&v);
}

/* A problem in the values: both paths refuse with the same error. */
static void same_error(const char *what, const fm_model_desc *d, views *v, fm_status want) {
    to_device(v);
    const int L = first_moe(d);
    fm_cuda_layer *ref = NULL, *dev = (fm_cuda_layer *)(uintptr_t)1;
    fm_status s = host_path(d, L, &v->t, &ref);
    char host[1024];
    snprintf(host, sizeof host, "%s", fm_last_error());
    assert_int_equal(s, want);
    s = fm_cuda_layer_from_tensors(g_eng, d, L, &v->dt, &dev);
    if (s != want || strcmp(host, fm_last_error()))
        fail_msg("%s: host path: %s; device repack (%s): %s", what, host, fm_status_name(s), fm_last_error());
    assert_null(dev);
    print_message("# %s: %s\n", what, host);
}

static void test_value_errors(void **state) {
    (void)state;
    NEED_GPU();
    const fm_model_desc ds = preset("tiny-deepseek", FM_QF_NVFP4);
    views v;
    make_modelopt(&v, &ds, (opts){0, 0, 1, 0, FM_DT_BF16, 0});
    ((float *)v.t.w13_weight_scale_2.data)[3 * v.t.w13_weight_scale_2.stride[0] + 1] = 0.0f;
    ((float *)v.t.w2_weight_scale_2.data)[5] = NAN;
    same_error("scale_2 zero and NaN", &ds, &v, FM_E_NUMERIC);
    views_free(&v);
    make_modelopt(&v, &ds, (opts){0, 0, 1, 0, FM_DT_BF16, 0});
    *(float *)v.t.shared_down_scale_2.data = -1.0f;
    same_error("shared scale_2 negative", &ds, &v, FM_E_NUMERIC);
    views_free(&v);
    const fm_model_desc g = preset("tiny-gptoss", FM_QF_MXFP4);
    make_gptoss(&v, &g, (opts){0, 0, 0, 0, FM_DT_BF16, 0});
    /* expert 2's up row 5 block 1 and expert 4's down: the first is named */
    ((uint8_t *)v.t.gate_up_scales.data)[2 * v.t.gate_up_scales.stride[0] + (2 * 5 + 1) * v.t.gate_up_scales.stride[1] + 1] = 140;
    ((uint8_t *)v.t.down_scales.data)[4 * v.t.down_scales.stride[0]] = 200;
    same_error("MXFP4 scale beyond the decode's range", &g, &v, FM_E_RANGE);
    views_free(&v);
    /* host memory where device memory belongs */
    make_gptoss(&v, &g, (opts){0, 0, 0, 0, FM_DT_BF16, 0});
    fm_cuda_layer *dev = NULL;
    assert_int_equal(fm_cuda_layer_from_tensors(g_eng, &g, first_moe(&g), &v.t, &dev), FM_E_ARG);
    assert_non_null(strstr(fm_last_error(), "tensor 'gate_up_blocks' is not in device memory"));
    views_free(&v);
}

/* The calls on caller-owned memory read the layer's config table, filled at
 * fm_cuda_engine_reserve: many calls at many batch sizes, eager and in a
 * CUDA graph, make no lookup; a forced config refills the table once. */
static void test_calls_look_nothing_up(void **state) {
    (void)state;
    NEED_GPU();
    const fm_model_desc ds = preset("tiny-deepseek", FM_QF_NVFP4);
    fm_cuda_layer *l = NULL;
    assert_int_equal(fm_cuda_layer_random(g_eng, &ds, FM_QF_NVFP4, 5, first_moe(&ds), &l), FM_OK);
    enum { MAXT = 64 };
    assert_int_equal(fm_cuda_layer_config_lookups(l), 0);
    assert_int_equal(fm_cuda_engine_reserve(g_eng, l, MAXT), FM_OK);
    const long filled = fm_cuda_layer_config_lookups(l);
    print_message("# reserve of %d tokens: %ld config lookups\n", MAXT, filled);
    assert_true(filled >= 1 && filled < MAXT);
    const int H = ds.hidden, k = ds.topk;
    float *x, *out, *w;
    int32_t *ids;
    assert_int_equal(cudaMalloc((void **)&x, sizeof(float) * MAXT * H), cudaSuccess);
    assert_int_equal(cudaMalloc((void **)&out, sizeof(float) * MAXT * H), cudaSuccess);
    assert_int_equal(cudaMalloc((void **)&w, sizeof(float) * MAXT * k), cudaSuccess);
    assert_int_equal(cudaMalloc((void **)&ids, sizeof(int32_t) * MAXT * k), cudaSuccess);
    cudaStream_t st;
    assert_int_equal(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
    assert_int_equal(cudaMemsetAsync(x, 0, sizeof(float) * MAXT * H, st), cudaSuccess);
    for (int i = 0; i < 300; i++) {
        const int T = 1 + (i * 37) % MAXT;
        assert_int_equal(fm_cuda_moe(g_eng, l, x, FM_DT_F32, T, NULL, out, ids, w, st), FM_OK);
        assert_int_equal(fm_cuda_experts(g_eng, l, x, FM_DT_F32, T, ids, w, 1, out, st), FM_OK);
    }
    assert_int_equal(cudaStreamSynchronize(st), cudaSuccess);
    assert_int_equal(fm_cuda_layer_config_lookups(l), filled);
    /* in a graph */
    cudaGraph_t g;
    cudaGraphExec_t ge;
    assert_int_equal(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    for (int T = 1; T <= MAXT; T *= 2) assert_int_equal(fm_cuda_moe(g_eng, l, x, FM_DT_F32, T, NULL, out, ids, w, st), FM_OK);
    assert_int_equal(cudaStreamEndCapture(st, &g), cudaSuccess);
    assert_int_equal(cudaGraphInstantiateWithFlags(&ge, g, 0), cudaSuccess);
    assert_int_equal(cudaGraphLaunch(ge, st), cudaSuccess);
    assert_int_equal(cudaStreamSynchronize(st), cudaSuccess);
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    assert_int_equal(fm_cuda_layer_config_lookups(l), filled);
    /* what the calls run, from the table */
    fm_kernel_config cfg;
    char kern[640], src[512];
    assert_int_equal(fm_cuda_layer_call_config(g_eng, l, 16, &cfg, kern, sizeof kern, src, sizeof src), FM_OK);
    print_message("# at 16 tokens: %s; config from %s\n", kern, src);
    assert_true(kern[0] && src[0]);
    assert_int_equal(fm_cuda_layer_config_lookups(l), filled);
    /* a forced config: the next call refills the table, once */
    fm_kernel_config forced = fm_kernel_config_default_mma(&(fm_tune_key){.E = ds.n_experts, .k = k, .H = H,
                                                                           .I = ds.moe_inter, .fmt = FM_QF_NVFP4}, 4);
    assert_int_equal(fm_cuda_engine_set_config(g_eng, &forced), FM_OK);
    assert_int_equal(fm_cuda_experts(g_eng, l, x, FM_DT_F32, 3, ids, w, 1, out, st), FM_OK);
    const long refilled = fm_cuda_layer_config_lookups(l);
    assert_true(refilled > filled);
    assert_int_equal(fm_cuda_layer_call_config(g_eng, l, 3, NULL, NULL, 0, src, sizeof src), FM_OK);
    assert_non_null(strstr(src, "set by caller"));
    for (int T = 1; T <= MAXT; T++) assert_int_equal(fm_cuda_experts(g_eng, l, x, FM_DT_F32, T, ids, w, 1, out, st), FM_OK);
    assert_int_equal(fm_cuda_layer_config_lookups(l), refilled);
    assert_int_equal(fm_cuda_engine_set_config(g_eng, NULL), FM_OK);
    assert_int_equal(cudaStreamSynchronize(st), cudaSuccess);
    cudaStreamDestroy(st);
    cudaFree(x); cudaFree(out); cudaFree(w); cudaFree(ids);
    fm_cuda_layer_free(l);
}
#endif

int main(void) {
#ifdef FM_HAVE_CUDA
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_nvfp4_same_bytes),
        cmocka_unit_test(test_mxfp4_same_bytes),
        cmocka_unit_test(test_value_errors),
        cmocka_unit_test(test_calls_look_nothing_up),
    };
    const int r = cmocka_run_group_tests(tests, setup, teardown);
    char why[256];
    /* without a GPU every test skipped itself: ctest lists the program as skipped */
    return r ? r : fm_cuda_available(why, sizeof why) ? 0 : 77;
#else
    printf("SKIPPED: built without CUDA\n");
    return 77;
#endif
}
