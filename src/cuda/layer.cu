/* The CUDA engine's layers: device matrices in the tiled layout
 * (cuda_internal.h), uploaded from host layers or repacked on the device
 * from engine-held tensors, and their router tensors. */
#include "cuda_internal.h"
#include "cfg_cache.h"
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
    if (!s) s = dmat_alloc(&l->down, l->E, l->H, l->I, fmt, FM_SCHED_DOWN_ROWS, with_bias);
    if (!s && l->has_shared) {
        s = dmat_alloc(&l->sgate, 1, l->SI, l->H, fmt, FM_KSEG, 0);
        if (!s) s = dmat_alloc(&l->sup, 1, l->SI, l->H, fmt, FM_KSEG, 0);
        if (!s) s = dmat_alloc(&l->sdown, 1, l->H, l->SI, fmt, FM_SCHED_DOWN_ROWS, 0);
    }
    if (s) { fm_cuda_layer_free(l); return s; }
    l->Hp = l->gate.kp;
    l->Ip = l->down.kp;
    l->SIp = l->has_shared ? l->sdown.kp : 0;
    int64_t per = (int64_t)l->H * l->I;
    l->expert_bytes = 3 * (per / 2 + per / blk);
    int64_t sper = (int64_t)l->H * l->SI;
    l->shared_bytes = 3 * (sper / 2 + sper / blk);
    /* the zeroed stacks, before a kernel on the engine's stream fills them */
    if ((s = fm_cuda_settle("zeroing the layer's weights"))) { fm_cuda_layer_free(l); return s; }
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
    if (!s) s = fm_cuda_settle("uploading the layer");
    if (s) { fm_cuda_layer_free(c); return s; }
    *out = c;
    return FM_OK;
}

/* ---- layers from engine-held tensors in device memory */

/* A small device view (the per-tensor scales) copied into contiguous host
 * memory: trailing dimensions that are contiguous are merged, the last two
 * remaining are one strided 2D copy each, the dimensions before them a
 * loop. */
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

/* One stack of FP4 matrices as an engine holds it: the packed byte j of row
 * r of matrix e at p + e*pe + (r*rstep + roff)*pr + (j / jb)*pb + j % jb
 * (jb: the contiguous run, a whole row or gpt-oss' 16-byte blocks), its
 * block scale b at s + e*se + (r*rstep + roff)*sr + b. */
typedef struct {
    const uint8_t *p, *s;
    int64_t pe, pr, pb, se, sr;
    int jb, rstep, roff;
} src_fp4;

/* A stack of vectors (biases) of dtype dt (BF16 or F32): element r of
 * vector e at v + (e*ve + (r*rstep + roff)*vr) elements. */
typedef struct {
    const void *v;
    int dt;
    int64_t ve, vr;
    int rstep, roff;
} src_vec;

/* fm_nv_canon_block on the 8 bytes of a block: a negative scale's sign goes
 * to the nibbles, a zero scale zeroes them. */
static __device__ uint8_t nv_canon(uint8_t sc, uint64_t *w) {
    if ((sc & 0x7F) == 0) {
        *w = 0;
        return 0;
    }
    if (sc & 0x80) {
        sc &= 0x7F;
        if (sc != 0x7F) *w ^= 0x8888888888888888ull;
    }
    return sc;
}

/* The MXFP4 scale range of the GPU decode (upload_matrix's check). */
#define MX_SCALE_MAX 135

/* Every 8-byte piece (16 values) of n matrices of R rows and K columns into
 * the tiled layout, as upload_matrix lays it out. Out-of-range MXFP4
 * scales: the smallest (matrix order, row, block) key into *bad. */
static __global__ void repack_fp4_kernel(src_fp4 src, uint8_t *dp, uint8_t *ds, int64_t pstride, int64_t sstride,
                                         int n, int R, int K, int nseg, int mx, uint64_t key_e, int key_m,
                                         unsigned long long *bad) {
    const int64_t pieces = (int64_t)K / 16, total = (int64_t)n * R * pieces;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t q = i % pieces, r = (i / pieces) % R, e = i / (pieces * R);
        const int64_t sr = r * src.rstep + src.roff, j = q * 8;
        const uint8_t *pp = src.p + e * src.pe + sr * src.pr + (j / src.jb) * src.pb + j % src.jb;
        uint64_t w = 0;
        for (int b = 0; b < 8; b++) w |= (uint64_t)pp[b] << (8 * b);
        const int64_t blk = mx ? q / 2 : q;
        uint8_t sc = src.s[e * src.se + sr * src.sr + blk];
        if (mx) {
            if (sc > MX_SCALE_MAX && sc != 0xFF)
                atomicMin(bad, (unsigned long long)(((key_e + (uint64_t)e) * 3 + (uint64_t)key_m) << 40 |
                                                    (uint64_t)r << 20 | (uint64_t)blk));
        } else {
            sc = nv_canon(sc, &w);
        }
        const uint32_t lo = fm_fp4_enc_word((uint32_t)w), hi = fm_fp4_enc_word((uint32_t)(w >> 32));
        *(uint2 *)(dp + e * pstride + fm_tile_packed_off(r, j, nseg)) = make_uint2(lo, hi);
        if (!mx || q % 2 == 0) ds[e * sstride + fm_tile_scale_off(r, blk, nseg, mx)] = sc;
    }
}

/* n vectors of R values to F32 at dst + e*dstride. */
static __global__ void vec_f32_kernel(src_vec src, float *dst, int64_t dstride, int n, int R) {
    const int64_t total = (int64_t)n * R;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i % R, e = i / R;
        const int64_t at = e * src.ve + (r * src.rstep + src.roff) * src.vr;
        float f;
        if (src.dt == FM_DT_BF16) f = __uint_as_float((uint32_t)((const uint16_t *)src.v)[at] << 16);
        else f = ((const float *)src.v)[at];
        dst[e * dstride + r] = f;
    }
}

/* The router [E][H] (rows of stride rs elements) to F32, and to BF16 with
 * *inexact set when a weight is not exact in BF16 (fm_cuda_layer_router). */
static __global__ void router_kernel(const void *w, int dt, int64_t rs, int E, int H, float *f32, uint16_t *bf16,
                                     int *inexact) {
    const int64_t total = (int64_t)E * H;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t at = (i / H) * rs + i % H;
        uint32_t b = dt == FM_DT_BF16 ? (uint32_t)((const uint16_t *)w)[at] << 16 : __float_as_uint(((const float *)w)[at]);
        f32[i] = __uint_as_float(b);
        bf16[i] = (uint16_t)(b >> 16);
        if (b & 0xFFFFu) *inexact = 1;
    }
}

static unsigned grid_for(int64_t total) {
    const int64_t g = (total + 255) / 256;
    return (unsigned)(g < 1 ? 1 : g > 65535 ? 65535 : g);
}

/* Where a repack stands: the device flags it reads back at the end. */
typedef struct {
    unsigned long long *bad; /* smallest out-of-range MXFP4 scale key */
    int *inexact;            /* the router is not exact in BF16         */
} repack_flags;

static fm_status repack_fp4(fm_dmat *m, const src_fp4 *src, int K, fm_qformat fmt, uint64_t key_e, int key_m,
                            const repack_flags *fl) {
    const int nseg = m->kp / FM_KSEG;
    const int64_t total = (int64_t)m->n * m->rows * (K / 16);
    repack_fp4_kernel<<<grid_for(total), 256, 0, cudaStreamLegacy>>>(*src, m->packed, m->scales, m->pstride,
                                                                      m->sstride, m->n, m->rows, K, nseg,
                                                                      fmt == FM_QF_MXFP4, key_e, key_m, fl->bad);
    FM_CU_LAUNCH("the FP4 weights' repack");
    return FM_OK;
}

static fm_status repack_vec(float *dst, int64_t dstride, int n, int R, const src_vec *src) {
    vec_f32_kernel<<<grid_for((int64_t)n * R), 256, 0, cudaStreamLegacy>>>(*src, dst, dstride, n, R);
    FM_CU_LAUNCH("the F32 conversion of a bias");
    return FM_OK;
}

/* The view must be device memory of the engine's GPU (or managed memory). */
static fm_status device_view(const fm_tensor *v, const char *name, int device) {
    cudaPointerAttributes pa;
    if (cudaPointerGetAttributes(&pa, v->data) != cudaSuccess ||
        (pa.type != cudaMemoryTypeDevice && pa.type != cudaMemoryTypeManaged)) {
        cudaGetLastError();
        return fm_error(FM_E_ARG, "tensor '%s' is not in device memory (the CUDA engine reads engine tensors on the GPU)",
                        name);
    }
    if (pa.type == cudaMemoryTypeDevice && pa.device != device)
        return fm_error(FM_E_ARG, "tensor '%s' is on GPU %d, the engine on GPU %d", name, pa.device, device);
    return FM_OK;
}

/* The per-tensor scales of one matrix stack into m->scale2. */
static fm_status put_scale2(fm_dmat *m, const float *v) {
    FM_CU(cudaMemcpy(m->scale2, v, sizeof(float) * (size_t)m->n, cudaMemcpyHostToDevice));
    return FM_OK;
}

static src_fp4 fp4_of(const fm_tensor *p, const fm_tensor *s, int rstep, int roff) {
    src_fp4 f;
    memset(&f, 0, sizeof f);
    f.p = (const uint8_t *)p->data;
    f.s = (const uint8_t *)s->data;
    const int nd = p->ndim, stacked = nd == 3 || nd == 4; /* [E, R, ...] or a single [R, K/2] */
    f.pe = stacked ? p->stride[0] : 0;
    f.pr = p->stride[stacked ? 1 : 0];
    if (nd == 4) { /* gpt-oss blocks [E, R, K/32, 16] */
        f.pb = p->stride[2];
        f.jb = 16;
    } else {
        f.pb = 0;
        f.jb = (int)p->shape[nd - 1];
    }
    f.se = stacked ? s->stride[0] : 0;
    f.sr = s->stride[stacked ? 1 : 0];
    f.rstep = rstep;
    f.roff = roff;
    return f;
}

static src_vec vec_of(const fm_tensor *v, int rstep, int roff) {
    src_vec x;
    x.v = v->data;
    x.dt = v->dtype;
    x.ve = v->stride[0];
    x.vr = v->stride[1];
    x.rstep = rstep;
    x.roff = roff;
    return x;
}

/* The repack itself: the layer's matrices, biases and router from the
 * views, on the legacy stream (ordered after the engine tensors' writers
 * on blocking streams, as a cudaMemcpy is), then one synchronization to
 * read the flags. */
static fm_status repack_layer(fm_cuda_layer *c, const fm_io_tensors_info *in, const fm_layer_tensors *t,
                              const float *s2v, const repack_flags *fl) {
    const int E = c->E, I = c->I;
    const fm_qformat f = c->fmt;
    const uint64_t Ek = (uint64_t)E; /* the shared expert's matrices come after every expert's */
    fm_status s = FM_OK;
    if (in->fmt == FM_QF_NVFP4) {
        src_fp4 g = fp4_of(&t->w13_weight, &t->w13_weight_scale, 1, 0);
        src_fp4 u = fp4_of(&t->w13_weight, &t->w13_weight_scale, 1, I);
        src_fp4 d = fp4_of(&t->w2_weight, &t->w2_weight_scale, 1, 0);
        if (!s) s = repack_fp4(&c->gate, &g, c->H, f, 0, 0, fl);
        if (!s) s = repack_fp4(&c->up, &u, c->H, f, 0, 1, fl);
        if (!s) s = repack_fp4(&c->down, &d, I, f, 0, 2, fl);
        if (!s) s = put_scale2(&c->gate, s2v);
        if (!s) s = put_scale2(&c->up, s2v + E);
        if (!s) s = put_scale2(&c->down, s2v + 2 * E);
    } else {
        src_fp4 g = fp4_of(&t->gate_up_blocks, &t->gate_up_scales, 2, 0);
        src_fp4 u = fp4_of(&t->gate_up_blocks, &t->gate_up_scales, 2, 1);
        src_fp4 d = fp4_of(&t->down_blocks, &t->down_scales, 1, 0);
        if (!s) s = repack_fp4(&c->gate, &g, c->H, f, 0, 0, fl);
        if (!s) s = repack_fp4(&c->up, &u, c->H, f, 0, 1, fl);
        if (!s) s = repack_fp4(&c->down, &d, I, f, 0, 2, fl);
        for (int m = 0; m < 3 && !s; m++) s = put_scale2(m == 0 ? &c->gate : m == 1 ? &c->up : &c->down, s2v);
        src_vec gb = vec_of(&t->gate_up_bias, 2, 0), ub = vec_of(&t->gate_up_bias, 2, 1), db = vec_of(&t->down_bias, 1, 0);
        if (!s) s = repack_vec(c->gate.bias, c->gate.rows_p, E, I, &gb);
        if (!s) s = repack_vec(c->up.bias, c->up.rows_p, E, I, &ub);
        if (!s) s = repack_vec(c->down.bias, c->down.rows_p, E, c->H, &db);
    }
    if (!s && c->has_shared) {
        const fm_tensor *v[3][2] = {{&t->shared_gate, &t->shared_gate_scale},
                                    {&t->shared_up, &t->shared_up_scale},
                                    {&t->shared_down, &t->shared_down_scale}};
        fm_dmat *dm[3] = {&c->sgate, &c->sup, &c->sdown};
        for (int m = 0; m < 3 && !s; m++) {
            src_fp4 x = fp4_of(v[m][0], v[m][1], 1, 0);
            s = repack_fp4(dm[m], &x, m == 2 ? c->SI : c->H, f, Ek, m, fl);
            if (!s) s = put_scale2(dm[m], s2v + 3 * E + m);
        }
    }
    /* the router: F32, and BF16 while every weight is exact in it */
    const size_t nw = (size_t)E * c->H;
    if (!s) {
        cudaError_t err = cudaMalloc(&c->router_w, nw * sizeof(float));
        if (err == cudaSuccess) err = cudaMalloc(&c->router_wb, nw * sizeof(uint16_t));
        if (err == cudaSuccess && !in->has_router) { /* a zero router: the layer runs pre-routed only */
            err = cudaMemset(c->router_w, 0, nw * sizeof(float));
            if (err == cudaSuccess) err = cudaMemset(c->router_wb, 0, nw * sizeof(uint16_t));
        }
        if (err != cudaSuccess) s = fm_error(FM_E_CUDA, "router on the GPU: %s", cudaGetErrorString(err));
    }
    if (!s && in->has_router) {
        router_kernel<<<grid_for((int64_t)nw), 256, 0, cudaStreamLegacy>>>(t->router_w.data, t->router_w.dtype,
                                                                            t->router_w.stride[0], E, c->H,
                                                                            c->router_w, c->router_wb, fl->inexact);
        cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) s = fm_error(FM_E_CUDA, "launch of the router's conversion: %s", cudaGetErrorString(err));
        const fm_tensor *bv[2] = {&t->router_bias, &t->score_bias};
        float **bd[2] = {&c->router_bias, &c->score_bias};
        for (int i = 0; i < 2 && !s; i++) {
            if (!bv[i]->data) continue;
            if ((err = cudaMalloc(bd[i], (size_t)E * sizeof(float))) != cudaSuccess) {
                s = fm_error(FM_E_CUDA, "router bias on the GPU: %s", cudaGetErrorString(err));
                break;
            }
            src_vec x = {bv[i]->data, bv[i]->dtype, 0, bv[i]->stride[0], 1, 0};
            s = repack_vec(*bd[i], 0, 1, E, &x);
        }
    }
    return s;
}

fm_status fm_cuda_layer_from_tensors(fm_cuda_engine *e, const fm_model_desc *d, int layer, const fm_layer_tensors *t,
                                     fm_cuda_layer **out) {
    if (!e || !d || !t || !out) return fm_error(FM_E_ARG, "fm_cuda_layer_from_tensors: NULL argument");
    *out = NULL;
    /* the checkpoint loader's checks, from the descriptors alone */
    fm_io_tensors_info in;
    fm_status s = fm_io_tensors_info_get(d, layer, t, &in);
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
    const fm_tensor *tv = &t->w13_weight;
    for (int i = 0; i < NV; i++)
        if (tv[i].data && (s = device_view(&tv[i], names[i], e->device))) return s;
    const int64_t E = in.E;
    /* the per-tensor scales (a few floats each) are read and checked on the
     * host, as the loader does: gate [E], up [E], down [E], shared [3] */
    float *s2v = (float *)malloc(sizeof(float) * (size_t)(3 * E + 3));
    if (!s2v) return fm_error(FM_E_NOMEM, "out of memory");
    for (int64_t i = 0; i < 3 * E + 3; i++) s2v[i] = 1.0f;
    if (in.fmt == FM_QF_NVFP4) {
        void *s13 = NULL, *s2 = NULL, *sh[3] = {NULL, NULL, NULL};
        const fm_tensor *shv[3] = {&t->shared_gate_scale_2, &t->shared_up_scale_2, &t->shared_down_scale_2};
        s = view_to_host(&t->w13_weight_scale_2, "w13_weight_scale_2", &s13);
        if (!s) s = view_to_host(&t->w2_weight_scale_2, "w2_weight_scale_2", &s2);
        float raw[3] = {1.0f, 1.0f, 1.0f};
        for (int m = 0; m < 3 && !s && in.has_shared; m++) {
            s = view_to_host(shv[m], m == 0 ? "shared_gate_scale_2" : m == 1 ? "shared_up_scale_2" : "shared_down_scale_2",
                             &sh[m]);
            if (!s) raw[m] = *(const float *)sh[m];
        }
        if (!s) s = fm_io_tensors_scale2(d, layer, t, (const float *)s13, (const float *)s2, raw, s2v, s2v + E,
                                         s2v + 2 * E, s2v + 3 * E);
        free(s13);
        free(s2);
        for (int m = 0; m < 3; m++) free(sh[m]);
        if (s) { free(s2v); return s; }
    }
    fm_model_desc dd = *d;
    dd.moe_inter = (int)in.I;
    if (!in.has_router) dd.n_hash_layers = 0; /* no routing at all, by token id neither */
    if (!in.has_shared) dd.n_shared = 0;
    else dd.shared_inter = (int)in.SI;
    fm_cuda_layer *c = NULL;
    s = fm_cuda_layer_shell(e, &dd, in.fmt, layer, in.fmt == FM_QF_MXFP4, &c);
    repack_flags fl = {NULL, NULL};
    unsigned long long bad = ~0ull;
    int inexact = 0;
    if (!s) {
        cudaError_t err = cudaMalloc(&fl.bad, sizeof bad);
        if (err == cudaSuccess) err = cudaMalloc(&fl.inexact, sizeof inexact);
        if (err == cudaSuccess) err = cudaMemcpy(fl.bad, &bad, sizeof bad, cudaMemcpyHostToDevice);
        if (err == cudaSuccess) err = cudaMemcpy(fl.inexact, &inexact, sizeof inexact, cudaMemcpyHostToDevice);
        if (err != cudaSuccess) s = fm_error(FM_E_CUDA, "repack flags: %s", cudaGetErrorString(err));
    }
    if (!s) s = repack_layer(c, &in, t, s2v, &fl);
    free(s2v);
    if (!s) {
        cudaError_t err = cudaStreamSynchronize(cudaStreamLegacy);
        if (err == cudaSuccess) err = cudaMemcpy(&bad, fl.bad, sizeof bad, cudaMemcpyDeviceToHost);
        if (err == cudaSuccess) err = cudaMemcpy(&inexact, fl.inexact, sizeof inexact, cudaMemcpyDeviceToHost);
        if (err != cudaSuccess)
            s = fm_error(FM_E_CUDA, "repacking layer %d on the GPU failed: %s", layer, cudaGetErrorString(err));
    }
    if (!s && bad != ~0ull) {
        /* the first scale beyond the decode's range, in upload_matrix's order and words */
        const uint64_t em = bad >> 40, r = (bad >> 20) & 0xFFFFF, b = bad & 0xFFFFF;
        const int64_t x = (int64_t)(em / 3);
        const int m = (int)(em % 3), sh = x >= E;
        static const char *const what[2][3] = {{"gate", "up", "down"}, {"shared gate", "shared up", "shared down"}};
        const fm_tensor *sv = sh ? (m == 0 ? &t->shared_gate_scale : m == 1 ? &t->shared_up_scale : &t->shared_down_scale)
                                 : (m == 2 ? &t->down_scales : &t->gate_up_scales);
        const int64_t row = sh || m == 2 ? (int64_t)r : 2 * (int64_t)r + m;
        const int64_t off = (sh ? 0 : x * sv->stride[0]) + row * sv->stride[sh ? 0 : 1] + (int64_t)b;
        uint8_t v = 0;
        cudaMemcpy(&v, (const uint8_t *)sv->data + off, 1, cudaMemcpyDeviceToHost);
        s = fm_error(FM_E_RANGE,
                     "expert %d %s: MXFP4 scale 2^%d at row %lld block %lld is beyond the GPU kernel's range (2^8)",
                     sh ? -1 : (int)x, what[sh][m], v - 127, (long long)r, (long long)b);
    }
    if (fl.bad) cudaFree(fl.bad);
    if (fl.inexact) cudaFree(fl.inexact);
    if (!s && inexact) { /* not exact in BF16: the FP32 router alone */
        cudaFree(c->router_wb);
        c->router_wb = NULL;
    }
    if (!s) {
        c->hash = 0; /* fm_layer_tensors carries no tid2eid */
        c->no_router = !in.has_router;
    }
    if (s) {
        fm_cuda_layer_free(c);
        return s;
    }
    *out = c;
    return FM_OK;
}

/* ---- the tests' byte comparison */

static int dev_differ(const void *a, const void *b, size_t n, const char *what, char *why, size_t cap) {
    if (!a != !b) {
        snprintf(why, cap, "%s: present in one layer only", what);
        return -1;
    }
    if (!a || !n) return 0;
    uint8_t *ha = (uint8_t *)malloc(n), *hb = (uint8_t *)malloc(n);
    int r = 0;
    if (!ha || !hb || cudaMemcpy(ha, a, n, cudaMemcpyDeviceToHost) != cudaSuccess ||
        cudaMemcpy(hb, b, n, cudaMemcpyDeviceToHost) != cudaSuccess) {
        snprintf(why, cap, "%s: cannot read it back", what);
        r = -1;
    } else {
        for (size_t i = 0; i < n; i++)
            if (ha[i] != hb[i]) {
                snprintf(why, cap, "%s: byte %zu of %zu is 0x%02x, 0x%02x in the other", what, i, n, ha[i], hb[i]);
                r = -1;
                break;
            }
    }
    free(ha);
    free(hb);
    return r;
}

static int dmat_differ(const fm_dmat *a, const fm_dmat *b, const char *name, char *why, size_t cap) {
    if (a->n != b->n || a->rows != b->rows || a->rows_p != b->rows_p || a->kp != b->kp || a->pstride != b->pstride ||
        a->sstride != b->sstride) {
        snprintf(why, cap, "%s: %d x %d (%d padded, K %d) vs %d x %d (%d, K %d)", name, a->n, a->rows, a->rows_p, a->kp,
                 b->n, b->rows, b->rows_p, b->kp);
        return -1;
    }
    char w[64];
    snprintf(w, sizeof w, "%s packed", name);
    if (dev_differ(a->packed, b->packed, (size_t)a->pstride * a->n, w, why, cap)) return -1;
    snprintf(w, sizeof w, "%s scales", name);
    if (dev_differ(a->scales, b->scales, (size_t)a->sstride * a->n, w, why, cap)) return -1;
    snprintf(w, sizeof w, "%s scale_2", name);
    if (dev_differ(a->scale2, b->scale2, sizeof(float) * (size_t)a->n, w, why, cap)) return -1;
    snprintf(w, sizeof w, "%s bias", name);
    return dev_differ(a->bias, b->bias, sizeof(float) * (size_t)a->n * a->rows_p, w, why, cap);
}

int fm_cuda_layer_bytes_differ(const fm_cuda_layer *a, const fm_cuda_layer *b, int experts_only, char *why,
                               size_t cap) {
    if (a->fmt != b->fmt || a->H != b->H || a->I != b->I || a->E != b->E || a->k != b->k || a->SI != b->SI ||
        a->has_shared != b->has_shared || a->Hp != b->Hp || a->Ip != b->Ip || a->SIp != b->SIp ||
        a->expert_bytes != b->expert_bytes || a->shared_bytes != b->shared_bytes) {
        snprintf(why, cap, "shapes: H %d I %d E %d k %d SI %d vs H %d I %d E %d k %d SI %d", a->H, a->I, a->E, a->k,
                 a->SI, b->H, b->I, b->E, b->k, b->SI);
        return -1;
    }
    const fm_dmat *ma[6] = {&a->gate, &a->up, &a->down, &a->sgate, &a->sup, &a->sdown};
    const fm_dmat *mb[6] = {&b->gate, &b->up, &b->down, &b->sgate, &b->sup, &b->sdown};
    static const char *const nm[6] = {"gate", "up", "down", "shared gate", "shared up", "shared down"};
    for (int i = 0; i < 6; i++)
        if (dmat_differ(ma[i], mb[i], nm[i], why, cap)) return -1;
    if (experts_only) return 0;
    if (a->hash != b->hash || a->tid_rows != b->tid_rows) {
        snprintf(why, cap, "hash routing differs");
        return -1;
    }
    const size_t nw = (size_t)a->E * a->H;
    if (dev_differ(a->router_w, b->router_w, nw * sizeof(float), "router", why, cap) ||
        dev_differ(a->router_wb, b->router_wb, nw * sizeof(uint16_t), "BF16 router", why, cap) ||
        dev_differ(a->router_bias, b->router_bias, (size_t)a->E * sizeof(float), "router bias", why, cap) ||
        dev_differ(a->score_bias, b->score_bias, (size_t)a->E * sizeof(float), "score bias", why, cap))
        return -1;
    return 0;
}
