/* The CUDA engine's layers: device matrices in the tiled layout
 * (cuda_internal.h), uploaded from host layers or repacked on the device
 * from engine-held tensors, and their router tensors. */
#include "cuda_internal.h"
extern "C" {
#include "io/io_internal.h"
}
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

/* ------------------------------------------------------------- layers */

static fm_status dmat_alloc(fm_dmat *m, int n, int rows, int K, fm_qformat fmt, int rows_mult, int with_bias) {
    memset(m, 0, sizeof *m);
    if (n == 0) return FM_OK;
    int blk = fmt == FM_QF_MXFP4 ? 32 : 16;
    m->n = n;
    m->rows = rows;
    m->rows_p = (int)round_up(rows, rows_mult);
    m->kp = (int)round_up(K, FM_KSEG);
    m->pstride = (int64_t)m->rows_p * (m->kp / 2);
    m->sstride = (int64_t)m->rows_p * (m->kp / blk);
    size_t pb = (size_t)m->pstride * n, sb = (size_t)m->sstride * n;
    size_t freeb = 0, totalb = 0;
    FM_CU(cudaMemGetInfo(&freeb, &totalb));
    if (pb + sb + (64u << 20) > freeb)
        return fm_error(FM_E_NOMEM, "GPU memory: %d matrices of %d x %d need %.2f GB, %.2f GB free of %.2f GB", n,
                        rows, K, (double)(pb + sb) / 1e9, (double)freeb / 1e9, (double)totalb / 1e9);
    FM_CU(cudaMalloc(&m->packed, pb));
    FM_CU(cudaMalloc(&m->scales, sb));
    FM_CU(cudaMalloc(&m->scale2, sizeof(float) * (size_t)n));
    FM_CU(cudaMemset(m->packed, 0, pb));
    FM_CU(cudaMemset(m->scales, 0, sb));
    if (with_bias) {
        FM_CU(cudaMalloc(&m->bias, sizeof(float) * (size_t)n * m->rows_p));
        FM_CU(cudaMemset(m->bias, 0, sizeof(float) * (size_t)n * m->rows_p));
    }
    return FM_OK;
}

static void dmat_free(fm_dmat *m) {
    if (m->packed) cudaFree(m->packed);
    if (m->scales) cudaFree(m->scales);
    if (m->scale2) cudaFree(m->scale2);
    if (m->bias) cudaFree(m->bias);
    memset(m, 0, sizeof *m);
}

void fm_cuda_layer_free(fm_cuda_layer *l) {
    if (!l) return;
    cudaSetDevice(l->eng->device);
    dmat_free(&l->gate); dmat_free(&l->up); dmat_free(&l->down);
    dmat_free(&l->sgate); dmat_free(&l->sup); dmat_free(&l->sdown);
    if (l->router_w) cudaFree(l->router_w);
    if (l->router_wb) cudaFree(l->router_wb);
    if (l->router_bias) cudaFree(l->router_bias);
    if (l->score_bias) cudaFree(l->score_bias);
    if (l->tid2eid) cudaFree(l->tid2eid);
    fm_cfg_cache_free(&l->cc);
    free(l);
}

fm_status fm_cuda_layer_shell(fm_cuda_engine *e, const fm_model_desc *d, fm_qformat fmt, int layer, int with_bias,
                             fm_cuda_layer **out) {
    *out = NULL;
    if (fmt != FM_QF_NVFP4 && fmt != FM_QF_MXFP4)
        return fm_error(FM_E_UNSUPPORTED, "the CUDA backend runs NVFP4 and MXFP4 experts, not %s",
                        fm_qformat_name(fmt));
    if (d->hidden <= 0 || d->moe_inter <= 0 || d->n_experts <= 0 || d->topk <= 0 || d->topk > d->n_experts)
        return fm_error(FM_E_ARG, "bad model shape: hidden %d, inter %d, experts %d, top-k %d", d->hidden,
                        d->moe_inter, d->n_experts, d->topk);
    if (d->n_experts > 1024 || d->topk > 32)
        return fm_error(FM_E_UNSUPPORTED, "the CUDA routing kernel supports up to 1024 experts and top-32 (got %d, %d)",
                        d->n_experts, d->topk);
    int blk = fmt == FM_QF_MXFP4 ? 32 : 16;
    if (d->hidden % blk || d->moe_inter % blk || (d->n_shared > 0 && d->shared_inter % blk))
        return fm_error(FM_E_ARG, "hidden %d / inter %d / shared inter %d are not multiples of the %s block %d",
                        d->hidden, d->moe_inter, d->shared_inter, fm_qformat_name(fmt), blk);
    fm_cuda_layer *l = (fm_cuda_layer *)calloc(1, sizeof *l);
    if (!l) return fm_error(FM_E_NOMEM, "out of memory");
    l->eng = e;
    l->d = *d;
    l->layer = layer;
    l->fmt = fmt;
    l->H = d->hidden;
    l->I = d->moe_inter;
    l->E = d->n_experts;
    l->k = d->topk;
    l->has_shared = d->n_shared > 0 && d->shared_inter > 0;
    l->SI = l->has_shared ? d->shared_inter : 0;
    fm_status s = dmat_alloc(&l->gate, l->E, l->I, l->H, fmt, FM_KSEG, with_bias);
    if (!s) s = dmat_alloc(&l->up, l->E, l->I, l->H, fmt, FM_KSEG, with_bias);
    if (!s) s = dmat_alloc(&l->down, l->E, l->H, l->I, fmt, 16, with_bias);
    if (!s && l->has_shared) {
        s = dmat_alloc(&l->sgate, 1, l->SI, l->H, fmt, FM_KSEG, 0);
        if (!s) s = dmat_alloc(&l->sup, 1, l->SI, l->H, fmt, FM_KSEG, 0);
        if (!s) s = dmat_alloc(&l->sdown, 1, l->H, l->SI, fmt, 16, 0);
    }
    if (s) { fm_cuda_layer_free(l); return s; }
    l->Hp = l->gate.kp;
    l->Ip = l->down.kp;
    l->SIp = l->has_shared ? l->sdown.kp : 0;
    int64_t per = (int64_t)l->H * l->I;
    l->expert_bytes = 3 * (per / 2 + per / blk);
    int64_t sper = (int64_t)l->H * l->SI;
    l->shared_bytes = 3 * (sper / 2 + sper / blk);
    *out = l;
    return FM_OK;
}

/* Router tensors: FP32 on the GPU (the routing math is FP32, as in fm_route);
 * when every weight is exact in BF16 (checkpoints store routers in BF16),
 * also a BF16 copy, which the tensor-core logits above 32 tokens multiply
 * exactly. */
fm_status fm_cuda_layer_router(fm_cuda_layer *l, const float *w, const float *rbias, const float *sbias,
                               const int32_t *tid, int64_t tid_rows) {
    size_t nw = (size_t)l->E * l->H;
    FM_CU(cudaMalloc(&l->router_w, nw * sizeof(float)));
    FM_CU(cudaMemcpy(l->router_w, w, nw * sizeof(float), cudaMemcpyHostToDevice));
    /* the BF16 copy, converted in the pass that checks, dropped at the
     * first weight that is not exact */
    uint16_t *wb = (uint16_t *)malloc(nw * sizeof(uint16_t));
    if (!wb) return fm_error(FM_E_NOMEM, "out of memory (BF16 router, %zu weights)", nw);
    int exact = 1;
    for (size_t i = 0; i < nw && exact; i++) {
        uint32_t b;
        memcpy(&b, &w[i], sizeof b);
        exact = (b & 0xFFFFu) == 0;
        wb[i] = (uint16_t)(b >> 16);
    }
    cudaError_t err = cudaSuccess;
    if (exact) {
        err = cudaMalloc(&l->router_wb, nw * sizeof(uint16_t));
        if (err == cudaSuccess) err = cudaMemcpy(l->router_wb, wb, nw * sizeof(uint16_t), cudaMemcpyHostToDevice);
    }
    free(wb);
    if (err != cudaSuccess) return fm_error(FM_E_CUDA, "BF16 router upload: %s", cudaGetErrorString(err));
    if (rbias) {
        FM_CU(cudaMalloc(&l->router_bias, (size_t)l->E * sizeof(float)));
        FM_CU(cudaMemcpy(l->router_bias, rbias, (size_t)l->E * sizeof(float), cudaMemcpyHostToDevice));
    }
    if (sbias) {
        FM_CU(cudaMalloc(&l->score_bias, (size_t)l->E * sizeof(float)));
        FM_CU(cudaMemcpy(l->score_bias, sbias, (size_t)l->E * sizeof(float), cudaMemcpyHostToDevice));
    }
    l->hash = l->d.route == FM_ROUTE_DSV4 && l->layer < l->d.n_hash_layers && tid != NULL;
    if (tid) {
        for (int64_t i = 0; i < tid_rows * l->k; i++) {
            if (tid[i] < 0 || tid[i] >= l->E)
                return fm_error(FM_E_FORMAT, "layer %d tid2eid[%lld][%lld] = %d is not an expert id (E = %d)",
                                l->layer, (long long)(i / l->k), (long long)(i % l->k), tid[i], l->E);
            /* as fm_route: a row names k distinct experts (checked here
             * once, for every row, since the GPU reads the rows itself) */
            for (int64_t j = i - i % l->k; j < i; j++)
                if (tid[j] == tid[i])
                    return fm_error(FM_E_FORMAT, "layer %d tid2eid[%lld] names expert %d twice", l->layer,
                                    (long long)(i / l->k), tid[i]);
        }
        size_t nb = (size_t)tid_rows * l->k * sizeof(int32_t);
        FM_CU(cudaMalloc(&l->tid2eid, nb));
        FM_CU(cudaMemcpy(l->tid2eid, tid, nb, cudaMemcpyHostToDevice));
        l->tid_rows = tid_rows;
    }
    return FM_OK;
}

/* Copies one host matrix into slot i of a device stack, padding rows and K. */
static fm_status upload_matrix(fm_dmat *m, int i, const fm_qmatrix *q, int64_t K, fm_qformat fmt, const char *what,
                               int e, uint8_t *stage, uint8_t *sstage) {
    int blk = fmt == FM_QF_MXFP4 ? 32 : 16;
    if (q->fmt != fmt)
        return fm_error(FM_E_ARG, "expert %d %s is %s, the layer is %s", e, what, fm_qformat_name(q->fmt),
                        fm_qformat_name(fmt));
    if (q->rows != m->rows || q->cols != K || !q->packed || !q->scales || q->row_stride < q->cols / 2 ||
        q->scale_stride < q->cols / blk)
        return fm_error(FM_E_ARG, "expert %d %s: %lld x %lld matrix does not match the layer (%d x %lld)", e, what,
                        (long long)q->rows, (long long)q->cols, m->rows, (long long)K);
    int64_t kb = q->cols / 2, ks = q->cols / blk;
    const int nseg = m->kp / FM_KSEG, mx = fmt == FM_QF_MXFP4;
    memset(stage, 0, (size_t)m->pstride);
    memset(sstage, 0, (size_t)m->sstride);
    for (int64_t r = 0; r < q->rows; r++) {
        const uint8_t *prow = q->packed + r * q->row_stride;
        for (int64_t b = 0; b < kb; b += 8) /* 8-byte pieces never straddle a 16-byte lane chunk */
            memcpy(stage + fm_tile_packed_off(r, b, nseg), prow + b, (size_t)(kb - b < 8 ? kb - b : 8));
        const uint8_t *srow = q->scales + r * q->scale_stride;
        for (int64_t b = 0; b < ks; b++) {
            if (mx && srow[b] > 135 && srow[b] != 0xFF)
                return fm_error(FM_E_RANGE,
                                "expert %d %s: MXFP4 scale 2^%d at row %lld block %lld is beyond the GPU "
                                "kernel's range (2^8)",
                                e, what, srow[b] - 127, (long long)r, (long long)b);
            sstage[fm_tile_scale_off(r, b, nseg, mx)] =
                mx ? srow[b] : fm_nv_canon_block(srow[b], stage + fm_tile_packed_off(r, b * 8, nseg));
        }
    }
    /* pstride is a multiple of 64 bytes (kp is of 128 values) */
    for (int64_t o = 0; o < m->pstride; o += 4) {
        uint32_t w;
        memcpy(&w, stage + o, 4);
        w = fm_fp4_enc_word(w);
        memcpy(stage + o, &w, 4);
    }
    FM_CU(cudaMemcpy(m->packed + (size_t)i * m->pstride, stage, (size_t)m->pstride, cudaMemcpyHostToDevice));
    FM_CU(cudaMemcpy(m->scales + (size_t)i * m->sstride, sstage, (size_t)m->sstride, cudaMemcpyHostToDevice));
    float s2 = q->fmt == FM_QF_NVFP4 ? q->scale2 : 1.0f;
    FM_CU(cudaMemcpy(m->scale2 + i, &s2, sizeof s2, cudaMemcpyHostToDevice));
    if (m->bias && q->bias)
        FM_CU(cudaMemcpy(m->bias + (size_t)i * m->rows_p, q->bias, sizeof(float) * (size_t)q->rows,
                         cudaMemcpyHostToDevice));
    return FM_OK;
}

fm_status fm_cuda_layer_upload(fm_cuda_engine *e, const fm_model_desc *d, const fm_moe_layer *l,
                               fm_cuda_layer **out) {
    if (!e || !d || !l || !out) return fm_error(FM_E_ARG, "fm_cuda_layer_upload: NULL argument");
    *out = NULL;
    FM_CU(cudaSetDevice(e->device));
    if (l->hidden != d->hidden || l->inter != d->moe_inter || l->n_experts != d->n_experts || l->topk != d->topk)
        return fm_error(FM_E_ARG, "layer %d shape (H %d, I %d, E %d, k %d) differs from the model description", l->layer,
                        l->hidden, l->inter, l->n_experts, l->topk);
    if (!l->router_w) return fm_error(FM_E_ARG, "layer %d has no router weights", l->layer);
    if (d->route == FM_ROUTE_DSV4 && l->layer < d->n_hash_layers && !l->tid2eid)
        return fm_error(FM_E_ARG, "layer %d routes by token id but has no tid2eid table", l->layer);
    int with_bias = l->gate[0].bias != NULL;
    fm_model_desc dd = *d;
    if (!l->has_shared) dd.n_shared = 0;
    else dd.shared_inter = l->shared_inter;
    fm_cuda_layer *c;
    fm_status s = fm_cuda_layer_shell(e, &dd, l->fmt, l->layer, with_bias, &c);
    if (s) return s;
    size_t maxp = (size_t)c->gate.pstride, maxs = (size_t)c->gate.sstride;
    const fm_dmat *all[] = {&c->down, &c->sgate, &c->sup, &c->sdown};
    for (int i = 0; i < 4; i++) {
        if ((size_t)all[i]->pstride > maxp) maxp = (size_t)all[i]->pstride;
        if ((size_t)all[i]->sstride > maxs) maxs = (size_t)all[i]->sstride;
    }
    uint8_t *stage = (uint8_t *)malloc(maxp), *sstage = (uint8_t *)malloc(maxs);
    if (!stage || !sstage) s = fm_error(FM_E_NOMEM, "out of memory (staging %zu bytes)", maxp);
    for (int x = 0; x < l->n_experts && !s; x++) {
        s = upload_matrix(&c->gate, x, &l->gate[x], c->H, c->fmt, "gate", x, stage, sstage);
        if (!s) s = upload_matrix(&c->up, x, &l->up[x], c->H, c->fmt, "up", x, stage, sstage);
        if (!s) s = upload_matrix(&c->down, x, &l->down[x], c->I, c->fmt, "down", x, stage, sstage);
    }
    if (!s && c->has_shared) {
        s = upload_matrix(&c->sgate, 0, &l->sh_gate, c->H, c->fmt, "shared gate", -1, stage, sstage);
        if (!s) s = upload_matrix(&c->sup, 0, &l->sh_up, c->H, c->fmt, "shared up", -1, stage, sstage);
        if (!s) s = upload_matrix(&c->sdown, 0, &l->sh_down, c->SI, c->fmt, "shared down", -1, stage, sstage);
    }
    free(stage);
    free(sstage);
    if (!s) s = fm_cuda_layer_router(c, l->router_w, l->router_bias, l->score_bias, l->tid2eid, l->tid2eid_rows);
    if (s) { fm_cuda_layer_free(c); return s; }
    *out = c;
    return FM_OK;
}

/* ---- layers from engine-held tensors in device memory */

/* A device view copied into contiguous host memory: trailing dimensions that
 * are contiguous are merged, the last two remaining are one strided 2D copy
 * each, the dimensions before them a loop (E copies at most for these
 * layouts). */
static fm_status view_to_host(const fm_tensor *v, const char *name, void **out) {
    *out = NULL;
    const int eb = fm_dtype_bits(v->dtype) / 8;
    if (eb <= 0) return fm_error(FM_E_FORMAT, "tensor '%s': dtype %s", name, fm_dtype_name(v->dtype));
    cudaPointerAttributes pa;
    if (cudaPointerGetAttributes(&pa, v->data) != cudaSuccess ||
        (pa.type != cudaMemoryTypeDevice && pa.type != cudaMemoryTypeManaged)) {
        cudaGetLastError();
        return fm_error(FM_E_ARG, "tensor '%s' is not in device memory (the CUDA engine reads engine tensors on the GPU)",
                        name);
    }
    int nd = v->ndim;
    int64_t shp[FM_MAX_DIMS] = {1}, str[FM_MAX_DIMS] = {1}, n = 1;
    for (int i = 0; i < nd; i++) {
        shp[i] = v->shape[i];
        str[i] = v->stride[i];
        n *= shp[i];
    }
    void *h = malloc(n > 0 ? (size_t)n * eb : 1);
    if (!h) return fm_error(FM_E_NOMEM, "tensor '%s': out of memory (%lld bytes)", name, (long long)n * eb);
    *out = h;
    if (n == 0) return FM_OK;
    if (nd == 0) {
        shp[0] = 1;
        str[0] = 1;
        nd = 1;
    }
    /* merge trailing contiguous dimensions */
    while (nd >= 2 && str[nd - 2] == shp[nd - 1] * str[nd - 1]) {
        shp[nd - 2] *= shp[nd - 1];
        str[nd - 2] = str[nd - 1];
        nd--;
    }
    const int64_t width = shp[nd - 1] * eb;
    const int64_t rows = nd >= 2 ? shp[nd - 2] : 1;
    const int64_t pitch = (nd >= 2 ? str[nd - 2] : shp[nd - 1]) * eb;
    int64_t outer = 1;
    for (int i = 0; i < nd - 2; i++) outer *= shp[i];
    for (int64_t o = 0; o < outer; o++) {
        int64_t off = 0, rem = o;
        for (int i = nd - 3; i >= 0; i--) {
            off += (rem % shp[i]) * str[i];
            rem /= shp[i];
        }
        cudaError_t err = cudaMemcpy2D((uint8_t *)h + o * rows * width, (size_t)width,
                                       (const uint8_t *)v->data + off * eb, (size_t)pitch, (size_t)width, (size_t)rows,
                                       cudaMemcpyDeviceToHost);
        if (err != cudaSuccess)
            return fm_error(FM_E_CUDA, "tensor '%s': reading it from the device failed: %s (is it device memory?)", name,
                            cudaGetErrorString(err));
    }
    return FM_OK;
}

fm_status fm_cuda_layer_from_tensors(fm_cuda_engine *e, const fm_model_desc *d, int layer, const fm_layer_tensors *t,
                                     fm_cuda_layer **out) {
    if (!e || !d || !t || !out) return fm_error(FM_E_ARG, "fm_cuda_layer_from_tensors: NULL argument");
    *out = NULL;
    fm_status s = fm_layer_tensors_check(d, t);
    if (s) return s;
    FM_CU(cudaSetDevice(e->device));
    /* every fm_tensor of the struct, in declaration order */
    static const char *const names[] = {
        "w13_weight",  "w13_weight_scale",   "w13_weight_scale_2",  "w2_weight",         "w2_weight_scale",
        "w2_weight_scale_2", "gate_up_blocks", "gate_up_scales",   "gate_up_bias",      "down_blocks",
        "down_scales", "down_bias",          "router_w",            "router_bias",       "score_bias",
        "shared_gate", "shared_gate_scale",  "shared_gate_scale_2", "shared_up",         "shared_up_scale",
        "shared_up_scale_2", "shared_down",  "shared_down_scale",   "shared_down_scale_2"};
    enum { NV = sizeof names / sizeof names[0] };
    static_assert(offsetof(fm_layer_tensors, shared_down_scale_2) - offsetof(fm_layer_tensors, w13_weight) ==
                      (NV - 1) * sizeof(fm_tensor),
                  "fm_layer_tensors: the list of views");
    fm_layer_tensors h = *t;
    fm_tensor *hv = &h.w13_weight;
    void *bufs[NV] = {NULL};
    for (int i = 0; i < NV && !s; i++) {
        if (!hv[i].data) continue;
        s = view_to_host(&hv[i], names[i], &bufs[i]);
        if (s) break;
        hv[i].data = bufs[i];
        int64_t st = 1;
        for (int j = hv[i].ndim - 1; j >= 0; j--) {
            hv[i].stride[j] = st;
            st *= hv[i].shape[j];
        }
    }
    fm_moe_layer *hl = NULL;
    if (!s) s = fm_moe_layer_from_tensors(d, layer, &h, &hl);
    for (int i = 0; i < NV; i++) free(bufs[i]);
    if (s) return s;
    /* a layer for the pre-routed call alone: a zero router, and the layer
     * says it cannot route */
    float *zero = NULL;
    const int no_router = hl->router_w == NULL;
    if (no_router) {
        zero = (float *)calloc((size_t)hl->n_experts * hl->hidden, sizeof(float));
        if (!zero) {
            fm_moe_layer_free(hl);
            return fm_error(FM_E_NOMEM, "out of memory (router)");
        }
        hl->router_w = zero;
    }
    fm_model_desc dd = *d;
    dd.moe_inter = hl->inter;
    if (no_router) dd.n_hash_layers = 0; /* no routing at all, by token id neither */
    s = fm_cuda_layer_upload(e, &dd, hl, out);
    if (no_router) hl->router_w = NULL;
    free(zero);
    fm_moe_layer_free(hl);
    if (!s) (*out)->no_router = no_router;
    return s;
}
