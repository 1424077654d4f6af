/*
 * Seeded random MoE weights: the formulas shared by fm_moe_layer_random (in
 * memory), `fp4moe gen` (on disk) and any GPU generator.
 *
 * Every value is a pure function of (seed, stream key, index) through
 * fm_rng_u64 / fm_rng_uniform / fm_rng_normal (src/util/util.h), so tensors
 * can be produced in any order and in chunks.
 *
 * Stream keys: key = fm_hash_str(S) (FNV-1a of the string S), where
 *   S = "L<layer>.E<e>.<what>"      routed expert e
 *       "L<layer>.shared.<what>"    the fused shared expert
 *       "L<layer>.router.<what>"    router tensors
 * and <what> is "<m>.codes", "<m>.scales", "<m>.values", "<m>.bias" with
 * <m> in gate | up | down, or "weight", "score_bias", "bias", "tid2eid".
 * Keys name logical tensors, not file names, so every checkpoint layout of
 * the same model holds the same numbers.
 *
 * Logical matrix [R, K] (R outputs, K inputs; gate/up: R = I, K = H; down:
 * R = H, K = I; shared: I_shared instead of I):
 *
 * NVFP4 / MXFP4 codes: element (r, c) is nibble (c % 16) of the 64-bit word
 *   w = fm_rng_u64(seed, key("<m>.codes"), r*(K/16) + c/16),
 *   i.e. the packed bytes of each 16-element group are w in little-endian
 *   order (byte j = (w >> 8j) & 0xFF: low nibble element 2j, high 2j+1).
 *   All 16 E2M1 codes are equally likely (RMS of the decoded value 2.926).
 * NVFP4 block scale (r, b), b = c/16, E4M3 code:
 *   0x64 + ((uint32_t)(u >> 32) % 12), u = fm_rng_u64(seed, key("<m>.scales"), r*(K/16) + b)
 *   (values 48 ... 120, RMS 82.7); weight_scale_2 = fm_gen_nvfp4_scale2(K)
 *   = (float)(1 / (242 * sqrt(K))), so the weights have std ~ 1/sqrt(K).
 *   input_scale (unused by W4A16) = 1/672.
 * MXFP4 block scale (r, b), b = c/32, E8M0 code:
 *   base + ((uint32_t)(u >> 32) % 3) - 1, u = fm_rng_u64(seed, key("<m>.scales"), r*(K/32) + b),
 *   base = fm_gen_mxfp4_base_exp(K) = 127 + floor(log2(1 / (3.87 * sqrt(K))) + 0.5).
 * BF16 element (r, c): bf16_rne(fm_rng_normal(seed, key("<m>.values"), r*K + c) * inv),
 *   inv = (float)(1 / sqrt(K)).
 * Router weight [E, H] BF16: bf16_rne(fm_rng_normal(seed, key("weight"), e*H + h) * (float)(1/sqrt(H))).
 * Correction bias [E] F32 (noaux_tc, DeepSeek-V4 scored layers):
 *   0.05f * fm_rng_uniform(seed, key("score_bias"), e).
 * gpt-oss router bias [E] BF16: bf16_rne(0.1f * fm_rng_uniform(seed, key("bias"), e)).
 * gpt-oss expert bias, row r of matrix m: bf16_rne(0.02f * fm_rng_uniform(seed, key("<m>.bias"), r)).
 * tid2eid row t (k distinct experts of E): a partial Fisher-Yates shuffle of
 *   p = [0, 1, ..., E-1]: for j in 0..k-1: u = fm_rng_u64(seed, key("tid2eid"), t*k + j),
 *   swap p[j] and p[j + u % (E - j)]; the row is p[0..k-1].
 */
#include "io/io_internal.h"
#include "util/util.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

uint64_t fm_gen_key(int layer, int expert, const char *what) {
    char s[160];
    if (expert >= 0) snprintf(s, sizeof s, "L%d.E%d.%s", layer, expert, what);
    else if (expert == -1) snprintf(s, sizeof s, "L%d.shared.%s", layer, what);
    else snprintf(s, sizeof s, "L%d.router.%s", layer, what);
    return fm_hash_str(s);
}

static uint64_t mat_key(int layer, int e, int m, const char *part) {
    static const char *const names[3] = {"gate", "up", "down"};
    char w[32];
    snprintf(w, sizeof w, "%s.%s", names[m < 0 || m > 2 ? 0 : m], part);
    return fm_gen_key(layer, e, w);
}

float fm_gen_nvfp4_scale2(int64_t K) { return (float)(1.0 / (242.0 * sqrt((double)(K > 0 ? K : 1)))); }

int fm_gen_mxfp4_base_exp(int64_t K) {
    return 127 + (int)floor(log2(1.0 / (3.87 * sqrt((double)(K > 0 ? K : 1)))) + 0.5);
}

void fm_gen_matrix_rows(uint64_t seed, int layer, int e, int m, fm_qformat fmt, int64_t K, int64_t r0, int64_t nr,
                        uint8_t *packed, uint8_t *scales) {
    if (fmt == FM_QF_BF16) {
        uint64_t kv = mat_key(layer, e, m, "values");
        float inv = (float)(1.0 / sqrt((double)K));
        for (int64_t r = 0; r < nr; r++)
            for (int64_t c = 0; c < K; c++) {
                uint16_t h = fm_f32_to_bf16(fm_rng_normal(seed, kv, (uint64_t)((r0 + r) * K + c)) * inv);
                uint8_t *p = packed + 2 * (r * K + c);
                p[0] = (uint8_t)h;
                p[1] = (uint8_t)(h >> 8);
            }
        return;
    }
    uint64_t kc = mat_key(layer, e, m, "codes"), ks = mat_key(layer, e, m, "scales");
    int64_t g16 = K / 16;
    for (int64_t r = 0; packed && r < nr; r++) {
        uint8_t *row = packed + r * (K / 2);
        uint64_t base = (uint64_t)((r0 + r) * g16);
        for (int64_t b = 0; b < g16; b++) {
            uint64_t w = fm_rng_u64(seed, kc, base + (uint64_t)b);
            for (int j = 0; j < 8; j++) row[8 * b + j] = (uint8_t)(w >> (8 * j));
        }
    }
    if (!scales) return;
    if (fmt == FM_QF_NVFP4) {
        for (int64_t r = 0; r < nr; r++)
            for (int64_t b = 0; b < g16; b++) {
                uint64_t u = fm_rng_u64(seed, ks, (uint64_t)((r0 + r) * g16 + b));
                scales[r * g16 + b] = (uint8_t)(0x64u + (uint32_t)(u >> 32) % 12u);
            }
    } else {
        int64_t g32 = K / 32;
        int bexp = fm_gen_mxfp4_base_exp(K);
        for (int64_t r = 0; r < nr; r++)
            for (int64_t b = 0; b < g32; b++) {
                uint64_t u = fm_rng_u64(seed, ks, (uint64_t)((r0 + r) * g32 + b));
                scales[r * g32 + b] = (uint8_t)(bexp + (int)((uint32_t)(u >> 32) % 3u) - 1);
            }
    }
}

uint16_t fm_io_gen_router_w(uint64_t seed, int layer, int H, int64_t i) {
    static _Thread_local int cl = -1;
    static _Thread_local uint64_t ck;
    if (cl != layer) { ck = fm_gen_key(layer, -2, "weight"); cl = layer; }
    return fm_f32_to_bf16(fm_rng_normal(seed, ck, (uint64_t)i) * (float)(1.0 / sqrt((double)H)));
}
float fm_io_gen_score_bias(uint64_t seed, int layer, int e) {
    return 0.05f * fm_rng_uniform(seed, fm_gen_key(layer, -2, "score_bias"), (uint64_t)e);
}
uint16_t fm_io_gen_router_bias(uint64_t seed, int layer, int e) {
    return fm_f32_to_bf16(0.1f * fm_rng_uniform(seed, fm_gen_key(layer, -2, "bias"), (uint64_t)e));
}
uint16_t fm_io_gen_expert_bias(uint64_t seed, int layer, int e, int m, int64_t r) {
    return fm_f32_to_bf16(0.02f * fm_rng_uniform(seed, mat_key(layer, e, m, "bias"), (uint64_t)r));
}
void fm_io_gen_tid2eid_row(uint64_t seed, int layer, int E, int k, int64_t t, int32_t *row) {
    uint64_t key = fm_gen_key(layer, -2, "tid2eid");
    /* Sparse Fisher-Yates: only the k touched positions differ from identity. */
    int32_t pos[64], val[64];
    int n = 0;
#define GET(i, out)                                                                                        \
    do {                                                                                                   \
        int32_t v_ = (i);                                                                                  \
        for (int q_ = 0; q_ < n; q_++) if (pos[q_] == (i)) { v_ = val[q_]; break; }                        \
        out = v_;                                                                                          \
    } while (0)
#define PUT(i, v)                                                                                          \
    do {                                                                                                   \
        int f_ = 0;                                                                                        \
        for (int q_ = 0; q_ < n; q_++) if (pos[q_] == (i)) { val[q_] = (v); f_ = 1; break; }               \
        if (!f_) { pos[n] = (i); val[n] = (v); n++; }                                                      \
    } while (0)
    for (int j = 0; j < k && j < 32; j++) {
        uint64_t u = fm_rng_u64(seed, key, (uint64_t)(t * k + j));
        int32_t s = (int32_t)(j + (int64_t)(u % (uint64_t)(E - j)));
        int32_t a, b;
        GET(j, a);
        GET(s, b);
        PUT(j, b);
        PUT(s, a);
        row[j] = b;
    }
#undef GET
#undef PUT
}

int fm_io_is_hash_layer(const fm_model_desc *d, int layer) { return d->route == FM_ROUTE_DSV4 && layer < d->n_hash_layers; }
int fm_io_has_score_bias(const fm_model_desc *d, int layer) {
    return d->route == FM_ROUTE_NOAUX_TC || (d->route == FM_ROUTE_DSV4 && !fm_io_is_hash_layer(d, layer));
}
int fm_io_has_expert_bias(const fm_model_desc *d) { return d->route == FM_ROUTE_GPTOSS; }

/* ------------------------------------------------------------ layer memory */

typedef struct {
    void **p;
    size_t n, cap;
} owned_list;

fm_moe_layer *fm_io_layer_new(const fm_model_desc *d, int layer, fm_qformat fmt) {
    fm_moe_layer *l = fm_calloc(1, sizeof *l);
    owned_list *o = fm_calloc(1, sizeof *o);
    if (!l || !o) { free(l); free(o); return NULL; }
    l->owned_ = o;
    l->layer = layer;
    l->hidden = d->hidden;
    l->inter = d->moe_inter;
    l->n_experts = d->n_experts;
    l->topk = d->topk;
    l->fmt = fmt;
    l->has_shared = d->n_shared > 0;
    l->shared_inter = d->shared_inter;
    l->gate = fm_io_layer_alloc(l, sizeof(fm_qmatrix) * (size_t)d->n_experts);
    l->up = fm_io_layer_alloc(l, sizeof(fm_qmatrix) * (size_t)d->n_experts);
    l->down = fm_io_layer_alloc(l, sizeof(fm_qmatrix) * (size_t)d->n_experts);
    if (!l->gate || !l->up || !l->down) { fm_moe_layer_free(l); return NULL; }
    memset(l->gate, 0, sizeof(fm_qmatrix) * (size_t)d->n_experts);
    memset(l->up, 0, sizeof(fm_qmatrix) * (size_t)d->n_experts);
    memset(l->down, 0, sizeof(fm_qmatrix) * (size_t)d->n_experts);
    return l;
}

void *fm_io_layer_alloc(fm_moe_layer *l, size_t n) {
    owned_list *o = l->owned_;
    if (o->n == o->cap) {
        size_t nc = o->cap ? 2 * o->cap : 64;
        void **np = realloc(o->p, nc * sizeof *np);
        if (!np) { fm_error(FM_E_NOMEM, "out of memory"); return NULL; }
        o->p = np;
        o->cap = nc;
    }
    void *p = fm_aligned_alloc(64, n);
    if (!p) return NULL;
    o->p[o->n++] = p;
    return p;
}

fm_status fm_io_layer_adopt(fm_moe_layer *dst, fm_moe_layer *src) {
    owned_list *d = dst->owned_, *o = src->owned_;
    for (size_t i = 0; o && i < o->n; i++) {
        if (d->n == d->cap) {
            size_t nc = d->cap ? 2 * d->cap : 64;
            void **np = realloc(d->p, nc * sizeof *np);
            if (!np) return fm_error(FM_E_NOMEM, "out of memory");
            d->p = np;
            d->cap = nc;
        }
        d->p[d->n++] = o->p[i];
        o->p[i] = NULL;
    }
    if (o) {
        free(o->p);
        free(o);
    }
    free(src);
    return FM_OK;
}

void fm_moe_layer_free(fm_moe_layer *l) {
    if (!l) return;
    owned_list *o = l->owned_;
    if (o) {
        for (size_t i = 0; i < o->n; i++) free(o->p[i]);
        free(o->p);
        free(o);
    }
    free(l);
}

static int64_t qm_bytes(const fm_qmatrix *m) {
    int64_t n = m->rows * m->cols;
    switch (m->fmt) {
    case FM_QF_NVFP4: return n / 2 + n / 16;
    case FM_QF_MXFP4: return n / 2 + n / 32;
    case FM_QF_BF16: return n * 2;
    default: return 0;
    }
}

int64_t fm_moe_layer_expert_bytes(const fm_moe_layer *l) {
    if (!l) return 0;
    int64_t s = 0;
    for (int e = 0; e < l->n_experts; e++) s += qm_bytes(&l->gate[e]) + qm_bytes(&l->up[e]) + qm_bytes(&l->down[e]);
    return s;
}

/* ------------------------------------------------------------ random layer */

static fm_status random_matrix(fm_moe_layer *l, uint64_t seed, int e, int m, int64_t R, int64_t K, int with_bias,
                               fm_qmatrix *q) {
    fm_qformat f = l->fmt;
    int blk = f == FM_QF_NVFP4 ? 16 : f == FM_QF_MXFP4 ? 32 : 0;
    uint64_t pb, sb = 0;
    if (!fm_mul_ok((uint64_t)R, (uint64_t)(f == FM_QF_BF16 ? K * 2 : K / 2), &pb))
        return fm_error(FM_E_RANGE, "matrix %lld x %lld overflows", (long long)R, (long long)K);
    uint8_t *packed = fm_io_layer_alloc(l, (size_t)pb);
    if (!packed) return FM_E_NOMEM;
    uint8_t *scales = NULL;
    if (blk) {
        sb = (uint64_t)R * (uint64_t)(K / blk);
        scales = fm_io_layer_alloc(l, (size_t)sb);
        if (!scales) return FM_E_NOMEM;
    }
    fm_gen_matrix_rows(seed, l->layer, e, m, f, K, 0, R, packed, scales);
    memset(q, 0, sizeof *q);
    q->fmt = f;
    q->rows = R;
    q->cols = K;
    q->packed = packed;
    q->row_stride = f == FM_QF_BF16 ? K * 2 : K / 2;
    q->scales = scales;
    q->scale_stride = blk ? K / blk : 0;
    q->scale2 = f == FM_QF_NVFP4 ? fm_gen_nvfp4_scale2(K) : 1.0f;
    if (with_bias) {
        float *b = fm_io_layer_alloc(l, sizeof(float) * (size_t)R);
        if (!b) return FM_E_NOMEM;
        for (int64_t r = 0; r < R; r++) b[r] = fm_bf16_to_f32(fm_io_gen_expert_bias(seed, l->layer, e, m, r));
        q->bias = b;
    }
    return FM_OK;
}

/* The router tensors of a layer (weights, biases, hash table) into l. */
static fm_status random_router(fm_moe_layer *l, const fm_model_desc *d, uint64_t seed, int layer) {
    fm_status s = FM_OK;
    int64_t H = d->hidden, E = d->n_experts;
    float *rw = s == FM_OK ? fm_io_layer_alloc(l, sizeof(float) * (size_t)(E * H)) : NULL;
    if (s == FM_OK && !rw) s = FM_E_NOMEM;
    if (s == FM_OK) {
        for (int64_t i = 0; i < E * H; i++) rw[i] = fm_bf16_to_f32(fm_io_gen_router_w(seed, layer, (int)H, i));
        l->router_w = rw;
    }
    if (s == FM_OK && fm_io_has_score_bias(d, layer)) {
        float *b = fm_io_layer_alloc(l, sizeof(float) * (size_t)E);
        if (!b) s = FM_E_NOMEM;
        else {
            for (int e = 0; e < E; e++) b[e] = fm_io_gen_score_bias(seed, layer, e);
            l->score_bias = b;
        }
    }
    if (s == FM_OK && d->route == FM_ROUTE_GPTOSS) {
        float *b = fm_io_layer_alloc(l, sizeof(float) * (size_t)E);
        if (!b) s = FM_E_NOMEM;
        else {
            for (int e = 0; e < E; e++) b[e] = fm_bf16_to_f32(fm_io_gen_router_bias(seed, layer, e));
            l->router_bias = b;
        }
    }
    if (s == FM_OK && fm_io_is_hash_layer(d, layer)) {
        int64_t V = d->vocab_size, k = d->topk;
        if (k > 32) s = fm_error(FM_E_RANGE, "hash routing with k=%lld > 32", (long long)k);
        int32_t *t = s == FM_OK ? fm_io_layer_alloc(l, sizeof(int32_t) * (size_t)(V * k)) : NULL;
        if (s == FM_OK && !t) s = FM_E_NOMEM;
        if (s == FM_OK) {
            for (int64_t v = 0; v < V; v++) fm_io_gen_tid2eid_row(seed, layer, (int)E, (int)k, v, t + v * k);
            l->tid2eid = t;
            l->tid2eid_rows = V;
        }
    }
    return s;
}

fm_status fm_io_router_random(const fm_model_desc *d, fm_qformat fmt, uint64_t seed, int layer, fm_moe_layer **out) {
    *out = NULL;
    fm_moe_layer *l = fm_io_layer_new(d, layer, fmt);
    if (!l) return FM_E_NOMEM;
    fm_status s = random_router(l, d, seed, layer);
    if (s != FM_OK) { fm_moe_layer_free(l); return s; }
    *out = l;
    return FM_OK;
}

fm_status fm_moe_layer_random(const fm_model_desc *d, fm_qformat fmt, uint64_t seed, int layer, fm_moe_layer **out) {
    if (!d || !out) return fm_error(FM_E_ARG, "fm_moe_layer_random: NULL argument");
    *out = NULL;
    fm_status s = fm_model_desc_validate(d);
    if (s != FM_OK) return s;
    if (fmt == FM_QF_NONE) fmt = d->expert_format;
    if (fmt != FM_QF_NVFP4 && fmt != FM_QF_MXFP4 && fmt != FM_QF_BF16)
        return fm_error(FM_E_ARG, "fm_moe_layer_random: format %d is not nvfp4, mxfp4 or bf16", (int)fmt);
    if (!fm_model_is_moe_layer(d, layer))
        return fm_error(FM_E_ARG, "layer %d is not a MoE layer of this %s model (%d layers, first %d dense)", layer,
                        d->family, d->n_layers, d->first_dense);
    int blk = fmt == FM_QF_NVFP4 ? 16 : fmt == FM_QF_MXFP4 ? 32 : 2;
    if (d->hidden % blk || d->moe_inter % blk)
        return fm_error(FM_E_RANGE, "hidden %d / intermediate %d are not multiples of the %s block %d", d->hidden,
                        d->moe_inter, fm_io_qformat_str(fmt), blk);
    fm_moe_layer *l = fm_io_layer_new(d, layer, fmt);
    if (!l) return FM_E_NOMEM;
    int64_t H = d->hidden, I = d->moe_inter, E = d->n_experts;
    int bias = fm_io_has_expert_bias(d);
    for (int e = 0; e < E && s == FM_OK; e++) {
        s = random_matrix(l, seed, e, 0, I, H, bias, &l->gate[e]);
        if (s == FM_OK) s = random_matrix(l, seed, e, 1, I, H, bias, &l->up[e]);
        if (s == FM_OK) s = random_matrix(l, seed, e, 2, H, I, bias, &l->down[e]);
    }
    if (s == FM_OK && l->has_shared) {
        int64_t S = d->shared_inter;
        s = random_matrix(l, seed, -1, 0, S, H, 0, &l->sh_gate);
        if (s == FM_OK) s = random_matrix(l, seed, -1, 1, S, H, 0, &l->sh_up);
        if (s == FM_OK) s = random_matrix(l, seed, -1, 2, H, S, 0, &l->sh_down);
    }
    if (s == FM_OK) s = random_router(l, d, seed, layer);
    if (s != FM_OK) { fm_moe_layer_free(l); return s; }
    *out = l;
    return FM_OK;
}
