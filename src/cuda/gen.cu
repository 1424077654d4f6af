/* Seeded random weights generated on the GPU: the values of
 * fm_moe_layer_random (formulas: src/io/model_random.c), written straight
 * into the engine's tiled layout, so that benchmarks of whole models need no
 * host copy of their weights. */
#include "cuda_internal.h"
extern "C" {
#include "io/io_internal.h"
}
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


static __device__ __forceinline__ uint64_t d_mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static __device__ __forceinline__ uint64_t d_rng_u64(uint64_t seed, uint64_t key, uint64_t i) {
    return d_mix64(d_mix64(seed ^ d_mix64(key)) + i);
}

/* One thread per (matrix, row, 16-element group): 8 code bytes and the
 * group's scale byte (NVFP4) or every other group's (MXFP4). A shard's
 * matrix is a window of the full one: its rows start row0 rows in, its
 * columns cg0 16-groups in, and the streams are indexed as in the full
 * matrix of Kf inputs. */
__global__ void fm_gen_kernel(fm_dmat m, const uint64_t *kcodes, const uint64_t *kscales, uint64_t seed, int K,
                              int mx, int bexp, int row0, int64_t cg0, int Kf) {
    int64_t g16 = K / 16, g16f = Kf / 16;
    int64_t total = (int64_t)m.n * m.rows * g16;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t b = i % g16, rr = i / g16;
        int r = (int)(rr % m.rows), n = (int)(rr / m.rows);
        const int64_t rf = (int64_t)row0 + r;
        uint64_t w = d_rng_u64(seed, kcodes[n], (uint64_t)(rf * g16f + cg0 + b));
        w = fm_fp4_enc_word((uint32_t)w) | (uint64_t)fm_fp4_enc_word((uint32_t)(w >> 32)) << 32;
        const int nseg = m.kp / FM_KSEG;
        *(uint64_t *)(m.packed + n * m.pstride + fm_tile_packed_off(r, b * 8, nseg)) = w;
        if (!mx) {
            uint64_t u = d_rng_u64(seed, kscales[n], (uint64_t)(rf * g16f + cg0 + b));
            m.scales[n * m.sstride + fm_tile_scale_off(r, b, nseg, 0)] = (uint8_t)(0x64u + (uint32_t)(u >> 32) % 12u);
        } else if ((b & 1) == 0) {
            int64_t g32f = Kf / 32, b32 = b / 2;
            uint64_t u = d_rng_u64(seed, kscales[n], (uint64_t)(rf * g32f + cg0 / 2 + b32));
            m.scales[n * m.sstride + fm_tile_scale_off(r, b32, nseg, 1)] =
                (uint8_t)(bexp + (int)((uint32_t)(u >> 32) % 3u) - 1);
        }
    }
}

/* first_e < 0: the shared expert; else experts first_e.. (a window of the
 * full matrix: row0, column c0, Kf inputs in all; scale2 and the MXFP4
 * base follow the full matrix, as its slice holds its values). */
static fm_status gen_dmat(fm_cuda_engine *e, fm_dmat *m, uint64_t seed, int layer, int first_e, int mi, int K,
                         fm_qformat fmt, int row0, int c0, int Kf) {
    static const char *const names[3] = {"gate", "up", "down"};
    uint64_t *hk = (uint64_t *)malloc(sizeof(uint64_t) * 2 * (size_t)m->n);
    if (!hk) return fm_error(FM_E_NOMEM, "out of memory");
    char w[32];
    for (int i = 0; i < m->n; i++) {
        int ex = first_e < 0 ? -1 : first_e + i;
        snprintf(w, sizeof w, "%s.codes", names[mi]);
        hk[i] = fm_gen_key(layer, ex, w);
        snprintf(w, sizeof w, "%s.scales", names[mi]);
        hk[m->n + i] = fm_gen_key(layer, ex, w);
    }
    uint64_t *dk = NULL;
    fm_status s = FM_OK;
    cudaError_t err = cudaMalloc(&dk, sizeof(uint64_t) * 2 * (size_t)m->n);
    if (err == cudaSuccess)
        err = cudaMemcpy(dk, hk, sizeof(uint64_t) * 2 * (size_t)m->n, cudaMemcpyHostToDevice);
    free(hk);
    if (err != cudaSuccess) {
        if (dk) cudaFree(dk);
        return fm_error(FM_E_CUDA, "weight generation setup: %s", cudaGetErrorString(err));
    }
    int mx = fmt == FM_QF_MXFP4;
    fm_gen_kernel<<<e->sm_count * 16, 256, 0, e->stream>>>(*m, dk, dk + m->n, seed, K, mx,
                                                           mx ? fm_gen_mxfp4_base_exp(Kf) : 0, row0,
                                                           (int64_t)(c0 / 16), Kf);
    err = cudaGetLastError();
    if (err == cudaSuccess) err = cudaStreamSynchronize(e->stream);
    cudaFree(dk);
    if (err != cudaSuccess) return fm_error(FM_E_CUDA, "weight generation kernel: %s", cudaGetErrorString(err));
    float s2 = fmt == FM_QF_NVFP4 ? fm_gen_nvfp4_scale2(Kf) : 1.0f;
    float *hs = (float *)malloc(sizeof(float) * (size_t)m->n);
    if (!hs) return fm_error(FM_E_NOMEM, "out of memory");
    for (int i = 0; i < m->n; i++) hs[i] = s2;
    err = cudaMemcpy(m->scale2, hs, sizeof(float) * (size_t)m->n, cudaMemcpyHostToDevice);
    free(hs);
    if (err != cudaSuccess) return fm_error(FM_E_CUDA, "cudaMemcpy scale2: %s", cudaGetErrorString(err));
    return s;
}

/* The whole layer (sh NULL) or one rank's share of it (fm_shard_desc's
 * shape, the full layer's values). */
static fm_status layer_random(fm_cuda_engine *e, const fm_model_desc *full, fm_qformat fmt, uint64_t seed, int layer,
                              const fm_shard *sh, fm_cuda_layer **out) {
    if (!e || !full || !out) return fm_error(FM_E_ARG, "fm_cuda_layer_random: NULL argument");
    *out = NULL;
    FM_CU(cudaSetDevice(e->device));
    fm_status s = fm_model_desc_validate(full);
    if (s) return s;
    if (fmt == FM_QF_NONE) fmt = full->expert_format;
    if (!fm_model_is_moe_layer(full, layer))
        return fm_error(FM_E_ARG, "layer %d is not a MoE layer of this %s model", layer, full->family);
    fm_model_desc dv = *full;
    if (sh && (s = fm_shard_desc(full, fmt, sh, &dv))) return s;
    const fm_model_desc *d = &dv;
    const int tp = sh && sh->mode == FM_DIST_TP, ep = sh && sh->mode == FM_DIST_EP;
    const int e0 = ep ? sh->rank * d->n_experts : 0;       /* first expert of the rank   */
    const int i0 = tp ? sh->rank * d->moe_inter : 0;       /* first row / column of I    */
    const int s0 = tp ? sh->rank * d->shared_inter : 0;    /* same of the shared width   */
    int with_bias = fm_io_has_expert_bias(d);
    fm_cuda_layer *l;
    s = fm_cuda_layer_shell(e, d, fmt, layer, with_bias, &l);
    if (s) return s;
    s = gen_dmat(e, &l->gate, seed, layer, e0, 0, l->H, fmt, i0, 0, l->H);
    if (!s) s = gen_dmat(e, &l->up, seed, layer, e0, 1, l->H, fmt, i0, 0, l->H);
    if (!s) s = gen_dmat(e, &l->down, seed, layer, e0, 2, l->I, fmt, 0, i0, full->moe_inter);
    if (!s && l->has_shared) {
        s = gen_dmat(e, &l->sgate, seed, layer, -1, 0, l->H, fmt, s0, 0, l->H);
        if (!s) s = gen_dmat(e, &l->sup, seed, layer, -1, 1, l->H, fmt, s0, 0, l->H);
        if (!s) s = gen_dmat(e, &l->sdown, seed, layer, -1, 2, l->SI, fmt, 0, s0, full->shared_inter);
    }
    /* small tensors on the host with the shared formulas */
    float *rw = NULL, *rb = NULL, *sb = NULL;
    int32_t *tid = NULL;
    int64_t V = 0;
    if (!s) {
        /* an EP rank runs pre-routed: a zero router, and the layer says
         * it cannot route (the full router is the caller's) */
        rw = (float *)calloc((size_t)l->E * l->H, sizeof(float));
        if (!rw) s = fm_error(FM_E_NOMEM, "out of memory");
        for (int64_t i = 0; !s && !ep && i < (int64_t)l->E * l->H; i++)
            rw[i] = fm_bf16_to_f32(fm_io_gen_router_w(seed, layer, l->H, i));
    }
    if (!s && fm_io_has_score_bias(d, layer)) {
        sb = (float *)malloc(sizeof(float) * (size_t)l->E);
        if (!sb) s = fm_error(FM_E_NOMEM, "out of memory");
        for (int x = 0; !s && x < l->E; x++) sb[x] = fm_io_gen_score_bias(seed, layer, x);
    }
    if (!s && d->route == FM_ROUTE_GPTOSS) {
        rb = (float *)malloc(sizeof(float) * (size_t)l->E);
        if (!rb) s = fm_error(FM_E_NOMEM, "out of memory");
        for (int x = 0; !s && x < l->E; x++) rb[x] = fm_bf16_to_f32(fm_io_gen_router_bias(seed, layer, x));
    }
    if (!s && fm_io_is_hash_layer(d, layer)) {
        V = d->vocab_size;
        tid = (int32_t *)malloc(sizeof(int32_t) * (size_t)V * l->k);
        if (!tid) s = fm_error(FM_E_NOMEM, "out of memory");
        for (int64_t v = 0; !s && v < V; v++) fm_io_gen_tid2eid_row(seed, layer, l->E, l->k, v, tid + v * l->k);
    }
    if (!s && with_bias) {
        fm_dmat *ms[3] = {&l->gate, &l->up, &l->down};
        for (int mi = 0; mi < 3 && !s; mi++) {
            size_t nb = (size_t)ms[mi]->n * ms[mi]->rows_p;
            float *hb = (float *)calloc(nb, sizeof(float));
            if (!hb) { s = fm_error(FM_E_NOMEM, "out of memory"); break; }
            for (int x = 0; x < ms[mi]->n; x++)
                for (int r = 0; r < ms[mi]->rows; r++)
                    /* TP: gate/up rows of the slice; down's bias on rank 0
                     * only, as the ranks' partial outputs are summed */
                    hb[(size_t)x * ms[mi]->rows_p + r] =
                        mi == 2 && tp && sh->rank > 0
                            ? 0.0f
                            : fm_bf16_to_f32(fm_io_gen_expert_bias(seed, layer, e0 + x, mi, mi == 2 ? r : i0 + r));
            cudaError_t err = cudaMemcpy(ms[mi]->bias, hb, nb * sizeof(float), cudaMemcpyHostToDevice);
            free(hb);
            if (err != cudaSuccess) s = fm_error(FM_E_CUDA, "cudaMemcpy bias: %s", cudaGetErrorString(err));
        }
    }
    if (!s) s = fm_cuda_layer_router(l, rw, rb, sb, tid, V);
    free(rw);
    free(rb);
    free(sb);
    free(tid);
    if (!s) s = fm_cuda_settle("generating the layer");
    if (s) { fm_cuda_layer_free(l); return s; }
    l->no_router = ep;
    *out = l;
    return FM_OK;
}

fm_status fm_cuda_layer_random(fm_cuda_engine *e, const fm_model_desc *d, fm_qformat fmt, uint64_t seed, int layer,
                               fm_cuda_layer **out) {
    return layer_random(e, d, fmt, seed, layer, NULL, out);
}

fm_status fm_cuda_layer_random_shard(fm_cuda_engine *e, const fm_model_desc *d, fm_qformat fmt, uint64_t seed,
                                     int layer, const fm_shard *sh, fm_cuda_layer **out) {
    if (!sh || (sh->mode != FM_DIST_TP && sh->mode != FM_DIST_EP))
        return fm_error(FM_E_ARG, "fm_cuda_layer_random_shard: no shard given");
    return layer_random(e, d, fmt, seed, layer, sh, out);
}

