/*
 * Layers from engine-held tensors (fm_layer_tensors_check,
 * fm_moe_layer_from_tensors).
 *
 * The tensors are written here from seeded random layers of tiny presets
 * in the engines' layouts (ModelOpt NVFP4 with a shared expert: w13 = gate
 * rows then up rows; gpt-oss MXFP4: gate/up rows interleaved, biases), with
 * padded outer strides in several views, and freed before the new layer is
 * used. The new layer must give fm_cpu_forward output and ids bit-identical
 * to the original's, also for a TP rank's partition (t->inter = I/2). Every
 * validation problem has a case that checks the message names the tensor.
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
#endif

/* ---------------------------------------------------------- tensor maker */

typedef struct {
    fm_layer_tensors t;
    void *buf[40];
    int nbuf;
} built;

static void built_free(built *b) {
    for (int i = 0; i < b->nbuf; i++) free(b->buf[i]);
    memset(b, 0, sizeof *b);
}

/* A view of shape[nd] with every outer stride padded by pad[i] elements
 * (0: contiguous); the padding holds garbage. */
static uint8_t *mkview(built *b, fm_tensor *v, fm_dtype dt, int nd, const int64_t *shape, const int64_t *pad) {
    const size_t es = (size_t)(fm_dtype_bits(dt) / 8);
    memset(v, 0, sizeof *v);
    v->dtype = dt;
    v->ndim = nd;
    int64_t total = 1;
    if (nd > 0) {
        v->stride[nd - 1] = 1;
        for (int i = nd - 1; i >= 0; i--) {
            v->shape[i] = shape[i];
            if (i < nd - 1) v->stride[i] = v->stride[i + 1] * shape[i + 1] + (pad ? pad[i] : 0);
        }
        total = v->stride[0] * shape[0];
    }
    uint8_t *p = malloc((size_t)total * es);
    assert_non_null(p);
    for (size_t i = 0; i < (size_t)total * es; i++) p[i] = (uint8_t)(0xA5 ^ i);
    b->buf[b->nbuf++] = p;
    v->data = p;
    return p;
}

/* Pointer to element idx of a view. */
static uint8_t *at(const fm_tensor *v, const int64_t *idx) {
    int64_t off = 0;
    for (int i = 0; i < v->ndim; i++) off += idx[i] * v->stride[i];
    return (uint8_t *)v->data + off * (fm_dtype_bits(v->dtype) / 8);
}

static void put_f32(const fm_tensor *v, const int64_t *idx, float f) {
    if (v->dtype == FM_DT_BF16) {
        uint16_t h = fm_f32_to_bf16(f);
        memcpy(at(v, idx), &h, 2);
    } else {
        memcpy(at(v, idx), &f, 4);
    }
}

/* Row r of a matrix (packed or scales) into the view's row at idx. */
static void put_row(const fm_tensor *v, const int64_t *idx, const fm_qmatrix *q, int64_t r, int scales) {
    const int blk = fm_qformat_block(q->fmt);
    if (scales) memcpy(at(v, idx), q->scales + r * q->scale_stride, (size_t)(q->cols / blk));
    else memcpy(at(v, idx), q->packed + r * q->row_stride, (size_t)(q->cols / 2));
}

typedef struct {
    int scale_u8; /* block scales as U8 instead of F8_E4M3 / F8_E8M0 */
    int s2_1d;    /* w13_weight_scale_2 [E] instead of [E, 2]        */
} mk_opts;

static void router_views(built *b, const fm_model_desc *d, const fm_moe_layer *l, fm_dtype wdt) {
    const int64_t E = l->n_experts, H = l->hidden;
    int64_t s[2] = {E, H}, pad[2] = {4, 0};
    mkview(b, &b->t.router_w, wdt, 2, s, pad);
    for (int64_t e = 0; e < E; e++)
        for (int64_t h = 0; h < H; h++) put_f32(&b->t.router_w, (int64_t[]){e, h}, l->router_w[e * H + h]);
    if (l->score_bias) {
        mkview(b, &b->t.score_bias, FM_DT_F32, 1, (int64_t[]){E}, NULL);
        for (int64_t e = 0; e < E; e++) put_f32(&b->t.score_bias, (int64_t[]){e}, l->score_bias[e]);
    }
    if (l->router_bias) {
        mkview(b, &b->t.router_bias, FM_DT_BF16, 1, (int64_t[]){E}, NULL);
        for (int64_t e = 0; e < E; e++) put_f32(&b->t.router_bias, (int64_t[]){e}, l->router_bias[e]);
    }
    (void)d;
}

/* ModelOpt NVFP4 views of l (and its shared expert). */
static void make_modelopt(built *b, const fm_model_desc *d, const fm_moe_layer *l, mk_opts o) {
    memset(b, 0, sizeof *b);
    const int64_t E = l->n_experts, H = l->hidden, I = l->inter;
    const fm_dtype sdt = o.scale_u8 ? FM_DT_U8 : FM_DT_F8_E4M3;
    fm_layer_tensors *t = &b->t;
    t->layout = FM_TL_MODELOPT_NVFP4;
    t->inter = (int)I;
    mkview(b, &t->w13_weight, FM_DT_U8, 3, (int64_t[]){E, 2 * I, H / 2}, (int64_t[]){64, 8, 0});
    mkview(b, &t->w13_weight_scale, sdt, 3, (int64_t[]){E, 2 * I, H / 16}, NULL);
    if (o.s2_1d) mkview(b, &t->w13_weight_scale_2, FM_DT_F32, 1, (int64_t[]){E}, NULL);
    else mkview(b, &t->w13_weight_scale_2, FM_DT_F32, 2, (int64_t[]){E, 2}, (int64_t[]){1, 0});
    mkview(b, &t->w2_weight, FM_DT_U8, 3, (int64_t[]){E, H, I / 2}, (int64_t[]){0, 4, 0});
    mkview(b, &t->w2_weight_scale, sdt, 3, (int64_t[]){E, H, I / 16}, (int64_t[]){16, 0, 0});
    mkview(b, &t->w2_weight_scale_2, FM_DT_F32, 1, (int64_t[]){E}, NULL);
    for (int64_t e = 0; e < E; e++) {
        for (int64_t r = 0; r < 2 * I; r++) {
            const fm_qmatrix *q = r < I ? &l->gate[e] : &l->up[e];
            put_row(&t->w13_weight, (int64_t[]){e, r, 0}, q, r % I, 0);
            put_row(&t->w13_weight_scale, (int64_t[]){e, r, 0}, q, r % I, 1);
        }
        for (int64_t r = 0; r < H; r++) {
            put_row(&t->w2_weight, (int64_t[]){e, r, 0}, &l->down[e], r, 0);
            put_row(&t->w2_weight_scale, (int64_t[]){e, r, 0}, &l->down[e], r, 1);
        }
        if (o.s2_1d) {
            put_f32(&t->w13_weight_scale_2, (int64_t[]){e}, l->gate[e].scale2);
        } else {
            put_f32(&t->w13_weight_scale_2, (int64_t[]){e, 0}, l->gate[e].scale2);
            put_f32(&t->w13_weight_scale_2, (int64_t[]){e, 1}, l->up[e].scale2);
        }
        put_f32(&t->w2_weight_scale_2, (int64_t[]){e}, l->down[e].scale2);
    }
    if (l->has_shared) {
        const int64_t S = l->shared_inter;
        const fm_qmatrix *q[3] = {&l->sh_gate, &l->sh_up, &l->sh_down};
        fm_tensor *pk[3] = {&t->shared_gate, &t->shared_up, &t->shared_down};
        fm_tensor *sc[3] = {&t->shared_gate_scale, &t->shared_up_scale, &t->shared_down_scale};
        fm_tensor *s2[3] = {&t->shared_gate_scale_2, &t->shared_up_scale_2, &t->shared_down_scale_2};
        for (int m = 0; m < 3; m++) {
            const int64_t R = m == 2 ? H : S, K = m == 2 ? S : H;
            mkview(b, pk[m], FM_DT_U8, 2, (int64_t[]){R, K / 2}, (int64_t[]){m == 0 ? 8 : 0, 0});
            mkview(b, sc[m], sdt, 2, (int64_t[]){R, K / 16}, (int64_t[]){m == 2 ? 3 : 0, 0});
            mkview(b, s2[m], FM_DT_F32, m == 1 ? 1 : 0, (int64_t[]){1}, NULL); /* [] and [1] */
            for (int64_t r = 0; r < R; r++) {
                put_row(pk[m], (int64_t[]){r, 0}, q[m], r, 0);
                put_row(sc[m], (int64_t[]){r, 0}, q[m], r, 1);
            }
            put_f32(s2[m], (int64_t[]){0}, q[m]->scale2);
        }
    }
    router_views(b, d, l, FM_DT_BF16);
}

/* gpt-oss MXFP4 checkpoint views of l. */
static void make_gptoss(built *b, const fm_model_desc *d, const fm_moe_layer *l, mk_opts o) {
    memset(b, 0, sizeof *b);
    const int64_t E = l->n_experts, H = l->hidden, I = l->inter;
    fm_layer_tensors *t = &b->t;
    t->layout = FM_TL_GPTOSS_MXFP4;
    t->inter = (int)I;
    mkview(b, &t->gate_up_blocks, FM_DT_U8, 4, (int64_t[]){E, 2 * I, H / 32, 16}, (int64_t[]){32, 16, 0, 0});
    mkview(b, &t->gate_up_scales, o.scale_u8 ? FM_DT_U8 : FM_DT_F8_E8M0, 3, (int64_t[]){E, 2 * I, H / 32}, NULL);
    mkview(b, &t->gate_up_bias, FM_DT_BF16, 2, (int64_t[]){E, 2 * I}, (int64_t[]){2, 0});
    mkview(b, &t->down_blocks, FM_DT_U8, 4, (int64_t[]){E, H, I / 32, 16}, NULL);
    mkview(b, &t->down_scales, o.scale_u8 ? FM_DT_U8 : FM_DT_F8_E8M0, 3, (int64_t[]){E, H, I / 32},
           (int64_t[]){0, 1, 0});
    mkview(b, &t->down_bias, FM_DT_F32, 2, (int64_t[]){E, H}, (int64_t[]){3, 0});
    for (int64_t e = 0; e < E; e++) {
        for (int64_t r = 0; r < 2 * I; r++) { /* even rows gate, odd rows up */
            const fm_qmatrix *q = r % 2 ? &l->up[e] : &l->gate[e];
            put_row(&t->gate_up_blocks, (int64_t[]){e, r, 0, 0}, q, r / 2, 0);
            put_row(&t->gate_up_scales, (int64_t[]){e, r, 0}, q, r / 2, 1);
            put_f32(&t->gate_up_bias, (int64_t[]){e, r}, q->bias[r / 2]);
        }
        for (int64_t r = 0; r < H; r++) {
            put_row(&t->down_blocks, (int64_t[]){e, r, 0, 0}, &l->down[e], r, 0);
            put_row(&t->down_scales, (int64_t[]){e, r, 0}, &l->down[e], r, 1);
            put_f32(&t->down_bias, (int64_t[]){e, r}, l->down[e].bias[r]);
        }
    }
    router_views(b, d, l, FM_DT_F32);
}

/* ------------------------------------------------------------ equality */

typedef struct {
    fm_model_desc d;
    fm_moe_layer *l;
    int layer;
} model;

static void load(const char *preset, fm_qformat f, int inter_div, model *m) {
    assert_int_equal(fm_preset_desc(preset, f, &m->d), FM_OK);
    m->d.moe_inter /= inter_div; /* a TP rank's partition */
    m->d.shared_inter /= inter_div;
    for (m->layer = 0; !fm_model_is_moe_layer(&m->d, m->layer); m->layer++) {}
    if (m->layer < m->d.n_hash_layers) m->layer = m->d.n_hash_layers;
    assert_int_equal(fm_moe_layer_random(&m->d, f, 4242, m->layer, &m->l), FM_OK);
}

/* fm_cpu_forward of a and b on the same tokens: identical bits. */
static void same_forward(const fm_model_desc *da, const fm_moe_layer *a, const fm_model_desc *db,
                         const fm_moe_layer *b) {
    enum { T = 9 };
    const int64_t H = da->hidden;
    const int k = da->topk;
    float *x = malloc(sizeof(float) * T * H), *oa = malloc(sizeof(float) * T * H), *ob = malloc(sizeof(float) * T * H);
    int32_t *ia = malloc(sizeof(int32_t) * T * k), *ib = malloc(sizeof(int32_t) * T * k);
    for (int64_t i = 0; i < T * H; i++) x[i] = fm_rng_normal(17, 18, (uint64_t)i);
    fm_cpu_engine *e = NULL;
    assert_int_equal(fm_cpu_engine_new(FM_CPU_AUTO, 2, &e), FM_OK);
    fm_moe_out ma = {oa, ia, NULL}, mb = {ob, ib, NULL};
    assert_int_equal(fm_cpu_forward(e, da, a, x, FM_DT_F32, T, NULL, &ma), FM_OK);
    fm_status s = fm_cpu_forward(e, db, b, x, FM_DT_F32, T, NULL, &mb);
    if (s) print_message("%s\n", fm_last_error());
    assert_int_equal(s, FM_OK);
    assert_memory_equal(ia, ib, sizeof(int32_t) * T * k);
    assert_memory_equal(oa, ob, sizeof(float) * T * H);
    fm_cpu_engine_free(e);
    free(x); free(oa); free(ob); free(ia); free(ib);
}

static void roundtrip(const char *preset, fm_qformat f, int inter_div, mk_opts o) {
    model m;
    load(preset, f, inter_div, &m);
    if (!o.s2_1d && f == FM_QF_NVFP4) /* gate and up with their own scale_2 */
        for (int e = 1; e < m.l->n_experts; e += 2) m.l->up[e].scale2 *= 1.5f;
    built b;
    if (f == FM_QF_NVFP4) make_modelopt(&b, &m.d, m.l, o);
    else make_gptoss(&b, &m.d, m.l, o);
    fm_model_desc full;
    assert_int_equal(fm_preset_desc(preset, f, &full), FM_OK); /* d->moe_inter is the model's, t->inter the partition's */
    assert_int_equal(fm_layer_tensors_check(&full, &b.t), FM_OK);
    fm_moe_layer *l2 = NULL;
    fm_status s = fm_moe_layer_from_tensors(&full, m.layer, &b.t, &l2);
    if (s) print_message("%s\n", fm_last_error());
    assert_int_equal(s, FM_OK);
    built_free(&b); /* the views may go away */
    assert_int_equal(l2->inter, m.l->inter);
    assert_int_equal(l2->has_shared, m.l->has_shared);
    assert_int_equal(l2->shared_inter, m.l->has_shared ? m.l->shared_inter : 0);
    same_forward(&m.d, m.l, &full, l2);
    fm_moe_layer_free(l2);
    fm_moe_layer_free(m.l);
}


#ifdef FM_HAVE_CUDA
/* The same views copied to the device (same strides, padding included):
 * fm_cuda_layer_from_tensors gives the layer that fm_cuda_layer_upload of
 * the original makes (the same outputs up to the order of the combine's
 * atomic additions), and without a router only the pre-routed call runs. */
static void cuda_roundtrip(const char *preset, fm_qformat f, int inter_div, mk_opts o, fm_cuda_engine *e) {
    model m;
    load(preset, f, inter_div, &m);
    built b;
    if (f == FM_QF_NVFP4) make_modelopt(&b, &m.d, m.l, o);
    else make_gptoss(&b, &m.d, m.l, o);
    fm_model_desc full;
    assert_int_equal(fm_preset_desc(preset, f, &full), FM_OK);
    fm_layer_tensors dt = b.t;
    fm_tensor *v = &dt.w13_weight;
    void *dev[40] = {NULL};
    const int nv = (int)((offsetof(fm_layer_tensors, shared_down_scale_2) - offsetof(fm_layer_tensors, w13_weight)) /
                         sizeof(fm_tensor)) + 1;
    for (int i = 0; i < nv; i++) {
        if (!v[i].data) continue;
        size_t span = (size_t)(fm_dtype_bits(v[i].dtype) / 8);
        if (v[i].ndim > 0) span *= (size_t)(v[i].stride[0] * v[i].shape[0]);
        assert_int_equal(cudaMalloc(&dev[i], span), cudaSuccess);
        assert_int_equal(cudaMemcpy(dev[i], v[i].data, span, cudaMemcpyHostToDevice), cudaSuccess);
        v[i].data = dev[i];
    }
    fm_cuda_layer *cl = NULL, *ref = NULL;
    fm_status s = fm_cuda_layer_from_tensors(e, &full, m.layer, &dt, &cl);
    if (s) print_message("%s\n", fm_last_error());
    assert_int_equal(s, FM_OK);
    /* without the router (and its biases): a layer for the pre-routed call */
    fm_layer_tensors nr = dt;
    memset(&nr.router_w, 0, sizeof nr.router_w);
    memset(&nr.router_bias, 0, sizeof nr.router_bias);
    memset(&nr.score_bias, 0, sizeof nr.score_bias);
    fm_cuda_layer *pre = NULL;
    s = fm_cuda_layer_from_tensors(e, &full, m.layer, &nr, &pre);
    if (s) print_message("%s\n", fm_last_error());
    assert_int_equal(s, FM_OK);
    for (int i = 0; i < nv; i++) cudaFree(dev[i]); /* the views may go away */
    fm_model_desc pd = m.d;
    assert_int_equal(fm_cuda_layer_upload(e, &pd, m.l, &ref), FM_OK);
    enum { T = 9 };
    const int64_t H = m.d.hidden;
    float *x = malloc(sizeof(float) * T * H), *oa = malloc(sizeof(float) * T * H), *ob = malloc(sizeof(float) * T * H);
    int32_t *ia = malloc(sizeof(int32_t) * T * m.d.topk), *ib = malloc(sizeof(int32_t) * T * m.d.topk);
    for (int64_t i = 0; i < T * H; i++) x[i] = fm_rng_normal(17, 19, (uint64_t)i);
    fm_moe_out ma = {oa, ia, NULL}, mb = {ob, ib, NULL};
    assert_int_equal(fm_cuda_forward(e, &pd, ref, x, FM_DT_F32, T, NULL, &ma), FM_OK);
    s = fm_cuda_forward(e, &pd, cl, x, FM_DT_F32, T, NULL, &mb);
    if (s) print_message("%s\n", fm_last_error());
    assert_int_equal(s, FM_OK);
    assert_memory_equal(ia, ib, sizeof(int32_t) * T * m.d.topk);
    double num = 0, den = 0;
    for (int64_t i = 0; i < T * H; i++) {
        num += ((double)oa[i] - ob[i]) * ((double)oa[i] - ob[i]);
        den += (double)oa[i] * oa[i];
    }
    print_message("# %s %s I/%d: device tensors vs upload, rel %.2e\n", preset, fm_qformat_name(f), inter_div,
                  sqrt(num / den));
    assert_true(num <= 1e-12 * den);
    fm_cuda_layer_free(cl);
    fm_cuda_layer_free(ref);
    /* the layer without a router refuses the routing call, naming why */
    assert_int_equal(fm_cuda_forward(e, &pd, pre, x, FM_DT_F32, T, NULL, &mb), FM_E_ARG);
    assert_non_null(strstr(fm_last_error(), "without a router"));
    fm_cuda_layer_free(pre);
    /* host memory where device memory belongs: refused, naming the tensor */
    s = fm_cuda_layer_from_tensors(e, &full, m.layer, &b.t, &cl);
    assert_int_equal(s, FM_E_ARG);
    assert_non_null(strstr(fm_last_error(), "w13_weight") || strstr(fm_last_error(), "gate_up_blocks"));
    assert_non_null(strstr(fm_last_error(), "device memory"));
    built_free(&b);
    free(x); free(oa); free(ob); free(ia); free(ib);
    fm_moe_layer_free(m.l);
}
#endif

static void test_cuda_from_tensors(void **state) {
    (void)state;
    char why[256];
#ifdef FM_HAVE_CUDA
    fm_cuda_engine *e = NULL;
    if (fm_cuda_available(why, sizeof why) && fm_cuda_engine_new(0, &e) == FM_OK) {
        cuda_roundtrip("tiny-deepseek", FM_QF_NVFP4, 1, (mk_opts){0, 0}, e);
        cuda_roundtrip("tiny-deepseek", FM_QF_NVFP4, 2, (mk_opts){1, 1}, e);
        cuda_roundtrip("tiny-gptoss", FM_QF_MXFP4, 1, (mk_opts){0, 0}, e);
        fm_cuda_engine_free(e);
        return;
    }
#else
    snprintf(why, sizeof why, "built without CUDA");
#endif
    printf("SKIPPED: no CUDA GPU (%s)\n", why);
    skip();
}

static void test_modelopt_roundtrip(void **state) {
    (void)state;
    roundtrip("tiny-deepseek", FM_QF_NVFP4, 1, (mk_opts){0, 0});
    roundtrip("tiny-deepseek", FM_QF_NVFP4, 2, (mk_opts){0, 0});
    roundtrip("tiny-deepseek", FM_QF_NVFP4, 1, (mk_opts){1, 1}); /* U8 scales, scale_2 [E] */
    roundtrip("tiny-qwen3", FM_QF_NVFP4, 1, (mk_opts){0, 0});    /* no shared expert, softmax */
}

static void test_gptoss_roundtrip(void **state) {
    (void)state;
    roundtrip("tiny-gptoss", FM_QF_MXFP4, 1, (mk_opts){0, 0});
    roundtrip("tiny-gptoss", FM_QF_MXFP4, 2, (mk_opts){1, 0});
}

/* Without a router the layer runs only the pre-routed experts. */
static void test_without_router(void **state) {
    (void)state;
    model m;
    load("tiny-deepseek", FM_QF_NVFP4, 1, &m);
    built b;
    make_modelopt(&b, &m.d, m.l, (mk_opts){0, 0});
    b.t.router_w.data = NULL;
    b.t.score_bias.data = NULL;
    fm_moe_layer *l2 = NULL;
    assert_int_equal(fm_moe_layer_from_tensors(&m.d, m.layer, &b.t, &l2), FM_OK);
    built_free(&b);
    assert_null(l2->router_w);
    enum { T = 4 };
    const int64_t H = m.d.hidden;
    const int k = m.d.topk;
    float x[T * 128], oa[T * 128], ob[T * 128], w[T * 8];
    int32_t ids[T * 8];
    for (int64_t i = 0; i < T * H; i++) x[i] = fm_rng_normal(3, 4, (uint64_t)i);
    assert_int_equal(fm_route(&m.d, m.l, x, T, NULL, ids, w), FM_OK);
    ids[1] = -1;
    fm_cpu_engine *e = NULL;
    assert_int_equal(fm_cpu_engine_new(FM_CPU_AUTO, 1, &e), FM_OK);
    assert_int_equal(fm_cpu_experts(e, &m.d, m.l, x, FM_DT_F32, T, ids, w, 1, oa), FM_OK);
    assert_int_equal(fm_cpu_experts(e, &m.d, l2, x, FM_DT_F32, T, ids, w, 1, ob), FM_OK);
    assert_memory_equal(oa, ob, sizeof(float) * T * H);
    fm_moe_out mo = {ob, NULL, NULL};
    assert_int_equal(fm_cpu_forward(e, &m.d, l2, x, FM_DT_F32, T, NULL, &mo), FM_E_ARG);
    (void)k;
    fm_cpu_engine_free(e);
    fm_moe_layer_free(l2);
    fm_moe_layer_free(m.l);
}

/* ------------------------------------------------------------ problems */

/* Both entry points refuse t with status want and a message holding a
 * (and b when given); from_tensors leaves *out NULL. */
static void refused(const fm_model_desc *d, int layer, const fm_layer_tensors *t, fm_status want, const char *a,
                    const char *b) {
    fm_status s = fm_layer_tensors_check(d, t);
    const char *msg = fm_last_error();
    if (s != want || !strstr(msg, a) || (b && !strstr(msg, b)))
        print_message("check: status %s, message: %s (wanted %s, '%s')\n", fm_status_name(s), msg,
                      fm_status_name(want), a);
    assert_int_equal(s, want);
    assert_non_null(strstr(msg, a));
    if (b) assert_non_null(strstr(msg, b));
    fm_moe_layer *l = (fm_moe_layer *)(uintptr_t)1;
    s = fm_moe_layer_from_tensors(d, layer, t, &l);
    msg = fm_last_error();
    if (s != want || !strstr(msg, a)) print_message("from_tensors: status %s, message: %s\n", fm_status_name(s), msg);
    assert_int_equal(s, want);
    assert_non_null(strstr(msg, a));
    assert_null(l);
}

static void test_modelopt_problems(void **state) {
    (void)state;
    model m;
    load("tiny-deepseek", FM_QF_NVFP4, 1, &m); /* H 128, I 64, E 16, shared 64 */
    built b;
    make_modelopt(&b, &m.d, m.l, (mk_opts){0, 0});
    const fm_model_desc *d = &m.d;
    const int L = m.layer;
    fm_layer_tensors t = b.t;
    assert_int_equal(fm_layer_tensors_check(d, &t), FM_OK);

    t.w13_weight_scale.dtype = FM_DT_BF16;
    refused(d, L, &t, FM_E_FORMAT, "tensor 'w13_weight_scale' has dtype BF16, expected F8_E4M3 (or U8)", NULL);
    t = b.t;
    t.w13_weight.shape[2] = 32;
    refused(d, L, &t, FM_E_FORMAT, "tensor 'w13_weight' has shape [16, 128, 32], expected [E=16, 2I=128, H/2=64]",
            NULL);
    t = b.t;
    t.w2_weight.ndim = 2;
    refused(d, L, &t, FM_E_FORMAT, "tensor 'w2_weight' has 2 dimensions [16, 128]", "expected [E=16, H=128, I/2=32]");
    t = b.t;
    t.w2_weight.ndim = 9;
    refused(d, L, &t, FM_E_FORMAT, "tensor 'w2_weight' has ndim 9", NULL);
    t = b.t;
    t.w2_weight_scale.stride[2] = 2;
    refused(d, L, &t, FM_E_FORMAT, "tensor 'w2_weight_scale' has innermost stride 2, expected 1", NULL);
    t = b.t;
    t.w2_weight.data = NULL;
    refused(d, L, &t, FM_E_NOTFOUND, "missing tensor 'w2_weight'", NULL);
    t = b.t;
    t.w13_weight_scale_2.data = NULL;
    refused(d, L, &t, FM_E_NOTFOUND, "missing tensor 'w13_weight_scale_2'", NULL);
    t = b.t;
    t.w13_weight_scale_2.shape[1] = 3;
    refused(d, L, &t, FM_E_FORMAT, "tensor 'w13_weight_scale_2' has shape [16, 3], expected [E=16] or [E=16, 2]",
            NULL);
    t = b.t;
    t.inter = 40;
    refused(d, L, &t, FM_E_RANGE, "inter = 40 is not a positive multiple of the nvfp4 block (16)", "'w2_weight_scale'");
    t.inter = 0;
    refused(d, L, &t, FM_E_RANGE, "inter = 0", "'w2_weight_scale'");
    t = b.t;
    t.w13_weight.stride[0] = -5;
    refused(d, L, &t, FM_E_FORMAT, "tensor 'w13_weight' has stride -5 in dimension 0", NULL);
    t = b.t;
    t.w13_weight.stride[0] = INT64_MAX / 4;
    refused(d, L, &t, FM_E_RANGE, "tensor 'w13_weight': shape [16, 128, 64] with strides", "addressed");
    t = b.t;
    t.gate_up_blocks = t.w13_weight;
    refused(d, L, &t, FM_E_ARG, "tensor 'gate_up_blocks' is not part of the ModelOpt NVFP4 layout", NULL);
    /* the shared expert: all of it or none */
    t = b.t;
    t.shared_up.data = NULL;
    refused(d, L, &t, FM_E_NOTFOUND, "missing tensor 'shared_up'", NULL);
    t = b.t;
    t.shared_down_scale.dtype = FM_DT_F32;
    refused(d, L, &t, FM_E_FORMAT, "tensor 'shared_down_scale' has dtype F32", NULL);
    t = b.t;
    t.shared_gate.shape[0] = 40;
    refused(d, L, &t, FM_E_RANGE, "tensor 'shared_gate' has 40 rows (SI)", NULL);
    t = b.t;
    t.shared_gate.ndim = 1;
    refused(d, L, &t, FM_E_FORMAT, "tensor 'shared_gate' has 1 dimensions", NULL);
    t = b.t;
    t.shared_up.shape[1] = 16;
    refused(d, L, &t, FM_E_FORMAT, "tensor 'shared_up' has shape [64, 16], expected [SI=64, H/2=64]", NULL);
    t = b.t;
    t.shared_gate_scale_2.ndim = 2;
    t.shared_gate_scale_2.shape[0] = t.shared_gate_scale_2.shape[1] = 1;
    refused(d, L, &t, FM_E_FORMAT, "tensor 'shared_gate_scale_2' has 2 dimensions [1, 1], expected [] or [1]", NULL);
    fm_model_desc dn = *d;
    dn.n_shared = 0;
    dn.shared_inter = 0;
    refused(&dn, L, &b.t, FM_E_ARG, "tensor 'shared_gate' is given but the model has no shared experts", NULL);
    /* the router */
    t = b.t;
    t.router_w.dtype = FM_DT_F16;
    refused(d, L, &t, FM_E_FORMAT, "tensor 'router_w' has dtype F16, expected F32 (or BF16)", NULL);
    t = b.t;
    t.router_w.shape[1] = 64;
    refused(d, L, &t, FM_E_FORMAT, "tensor 'router_w' has shape [16, 64], expected [E=16, H=128]", NULL);
    t = b.t;
    t.score_bias.data = NULL;
    refused(d, L, &t, FM_E_NOTFOUND, "missing tensor 'score_bias'", NULL);
    t = b.t;
    t.router_bias = t.score_bias;
    refused(d, L, &t, FM_E_ARG, "tensor 'router_bias' is not used by this model's routing", NULL);
    t = b.t;
    t.router_w.data = NULL;
    refused(d, L, &t, FM_E_ARG, "tensor 'score_bias' is given without 'router_w'", NULL);
    /* the first problem, and the count */
    t = b.t;
    t.w13_weight.dtype = FM_DT_F32;
    t.w2_weight.data = NULL;
    refused(d, L, &t, FM_E_FORMAT, "tensor 'w13_weight' has dtype F32", "(and more problems)");
    /* layout, format and arguments */
    t = b.t;
    t.layout = (fm_tensor_layout)7;
    refused(d, L, &t, FM_E_ARG, "unknown layout 7", NULL);
    fm_model_desc dm;
    assert_int_equal(fm_preset_desc("tiny-deepseek", FM_QF_MXFP4, &dm), FM_OK);
    refused(&dm, L, &b.t, FM_E_ARG, "the ModelOpt NVFP4 layout holds nvfp4 experts", "mxfp4");
    fm_moe_layer *l = NULL;
    assert_int_equal(fm_layer_tensors_check(NULL, &b.t), FM_E_ARG);
    assert_int_equal(fm_layer_tensors_check(d, NULL), FM_E_ARG);
    assert_int_equal(fm_moe_layer_from_tensors(d, L, &b.t, NULL), FM_E_ARG);
    assert_int_equal(fm_moe_layer_from_tensors(d, 0, &b.t, &l), FM_E_ARG); /* layer 0 is dense */
    assert_non_null(strstr(fm_last_error(), "not a MoE layer"));
    assert_null(l);

    /* Values are looked at when copying: weight_scale_2 must be a positive
     * finite scale, gate's and up's alike. */
    float *s13 = (float *)b.t.w13_weight_scale_2.data, *s2 = (float *)b.t.w2_weight_scale_2.data;
    float keep = s13[3 * b.t.w13_weight_scale_2.stride[0] + 1];
    s13[3 * b.t.w13_weight_scale_2.stride[0] + 1] = 0.0f;
    assert_int_equal(fm_layer_tensors_check(d, &b.t), FM_OK);
    assert_int_equal(fm_moe_layer_from_tensors(d, L, &b.t, &l), FM_E_NUMERIC);
    assert_non_null(strstr(fm_last_error(), "tensor 'w13_weight_scale_2' [3, 1] = 0 is not a positive finite scale"));
    assert_null(l);
    s13[3 * b.t.w13_weight_scale_2.stride[0] + 1] = keep;
    s2[5] = NAN;
    assert_int_equal(fm_moe_layer_from_tensors(d, L, &b.t, &l), FM_E_NUMERIC);
    assert_non_null(strstr(fm_last_error(), "tensor 'w2_weight_scale_2' [5] = nan"));
    s2[5] = 1.0f;
    *(float *)b.t.shared_down_scale_2.data = -1.0f;
    assert_int_equal(fm_moe_layer_from_tensors(d, L, &b.t, &l), FM_E_NUMERIC);
    assert_non_null(strstr(fm_last_error(), "tensor 'shared_down_scale_2' = -1"));
    assert_null(l);

    built_free(&b);
    fm_moe_layer_free(m.l);
}

static void test_gptoss_problems(void **state) {
    (void)state;
    model m;
    load("tiny-gptoss", FM_QF_MXFP4, 1, &m); /* H 128, I 64, E 8 */
    built b;
    make_gptoss(&b, &m.d, m.l, (mk_opts){0, 0});
    const fm_model_desc *d = &m.d;
    const int L = m.layer;
    fm_layer_tensors t = b.t;
    assert_int_equal(fm_layer_tensors_check(d, &t), FM_OK);
    t.gate_up_blocks.ndim = 3;
    refused(d, L, &t, FM_E_FORMAT, "tensor 'gate_up_blocks' has 3 dimensions [8, 128, 4]",
            "expected [E=8, 2I=128, H/32=4, 16]");
    t = b.t;
    t.down_blocks.shape[3] = 8;
    refused(d, L, &t, FM_E_FORMAT, "tensor 'down_blocks' has shape [8, 128, 2, 8], expected [E=8, H=128, I/32=2, 16]",
            NULL);
    t = b.t;
    t.gate_up_scales.dtype = FM_DT_F8_E4M3;
    refused(d, L, &t, FM_E_FORMAT, "tensor 'gate_up_scales' has dtype F8_E4M3, expected U8 (or F8_E8M0)", NULL);
    t = b.t;
    t.gate_up_bias.data = NULL;
    refused(d, L, &t, FM_E_NOTFOUND, "missing tensor 'gate_up_bias'", NULL);
    t = b.t;
    t.down_bias.stride[1] = 3;
    refused(d, L, &t, FM_E_FORMAT, "tensor 'down_bias' has innermost stride 3", NULL);
    t = b.t;
    t.gate_up_blocks.stride[3] = 0;
    refused(d, L, &t, FM_E_FORMAT, "tensor 'gate_up_blocks' has innermost stride 0", NULL);
    t = b.t;
    t.inter = 48;
    refused(d, L, &t, FM_E_RANGE, "inter = 48 is not a positive multiple of the mxfp4 block (32)", "'down_scales'");
    t = b.t;
    t.router_bias.data = NULL;
    refused(d, L, &t, FM_E_NOTFOUND, "missing tensor 'router_bias'", NULL);
    t = b.t;
    t.w13_weight = t.gate_up_blocks;
    refused(d, L, &t, FM_E_ARG, "tensor 'w13_weight' is not part of the gpt-oss MXFP4 layout", NULL);
    t = b.t;
    t.shared_gate_scale_2 = t.router_bias;
    refused(d, L, &t, FM_E_ARG, "tensor 'shared_gate_scale_2' is not part of the gpt-oss MXFP4 layout", NULL);
    /* gpt-oss experts need biases, which the ModelOpt layout lacks */
    fm_model_desc dn;
    assert_int_equal(fm_preset_desc("tiny-gptoss", FM_QF_NVFP4, &dn), FM_OK);
    t = b.t;
    t.layout = FM_TL_MODELOPT_NVFP4;
    refused(&dn, L, &t, FM_E_UNSUPPORTED, "no expert biases", "gpt_oss");
    built_free(&b);
    fm_moe_layer_free(m.l);
}

/* DeepSeek-V4: hash layers route by token id, which the tensors cannot
 * carry; scored layers need their correction bias once the layer is known. */
static void test_dsv4_routing(void **state) {
    (void)state;
    fm_model_desc d;
    assert_int_equal(fm_preset_desc("tiny-deepseek-v4", FM_QF_NVFP4, &d), FM_OK); /* hash layers 0, 1 */
    fm_moe_layer *l = NULL;
    assert_int_equal(fm_moe_layer_random(&d, FM_QF_NVFP4, 8, 2, &l), FM_OK);
    built b;
    make_modelopt(&b, &d, l, (mk_opts){0, 0});
    assert_non_null(b.t.score_bias.data);
    fm_moe_layer *l2 = NULL;
    assert_int_equal(fm_moe_layer_from_tensors(&d, 0, &b.t, &l2), FM_E_UNSUPPORTED);
    assert_non_null(strstr(fm_last_error(), "tensor 'router_w': layer 0 routes by token id"));
    assert_null(l2);
    fm_layer_tensors t = b.t;
    t.score_bias.data = NULL;
    assert_int_equal(fm_layer_tensors_check(&d, &t), FM_OK); /* without a layer: hash or scored */
    assert_int_equal(fm_moe_layer_from_tensors(&d, 2, &t, &l2), FM_E_NOTFOUND);
    assert_non_null(strstr(fm_last_error(), "layer 2 tensors: missing tensor 'score_bias'"));
    t.router_w.data = NULL;
    assert_int_equal(fm_moe_layer_from_tensors(&d, 0, &t, &l2), FM_OK); /* experts only */
    fm_moe_layer_free(l2);
    assert_int_equal(fm_moe_layer_from_tensors(&d, 2, &b.t, &l2), FM_OK);
    built_free(&b);
    same_forward(&d, l, &d, l2);
    fm_moe_layer_free(l2);
    fm_moe_layer_free(l);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_modelopt_roundtrip),
        cmocka_unit_test(test_cuda_from_tensors), cmocka_unit_test(test_gptoss_roundtrip),
        cmocka_unit_test(test_without_router),     cmocka_unit_test(test_modelopt_problems),
        cmocka_unit_test(test_gptoss_problems),    cmocka_unit_test(test_dsv4_routing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
