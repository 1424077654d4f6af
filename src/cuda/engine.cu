/*
 * The CUDA engine: device setup, weights on the GPU (uploaded or generated
 * there), one MoE block per call (forward) and the multi-layer CUDA-graph
 * benchmark. One layer is three kernels and no host synchronization:
 *   route.cu   routing + grouping by expert (last block),
 *   expert.cu  gate/up + activation (routed and shared experts),
 *   expert.cu  down + routing weight + combine (atomics into out).
 */
#include "cuda_internal.h"
#include "schedule.h"
extern "C" {
#include "cpu/cpu_internal.h"
#include "io/io_internal.h"
#include "util/util.h"
}
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct fm_cuda_engine {
    int device;
    char name[256];
    int sm_count, cc_major, cc_minor, rt_ver, drv_ver;
    int smem_optin; /* shared memory per block, opt-in (bytes) */
    char desc[320];
    cudaStream_t stream;
    cudaStream_t side;          /* the shared expert's branch (sh_fork) */
    cudaEvent_t fork_ev, join_ev;
    int forced;
    fm_kernel_config cfg;
    fm_phase_times *pt;
    int shared_enabled;
    fm_sched sched;  /* the layer schedule's switches (schedule.c, shared with `fp4moe explain`) */
    int sh_prefetch; /* shared expert prefetched into L2 during routing */
    int sh_early;    /* shared expert's gate/up not waiting on routing (v27) */
    int sh_fork_early; /* that branch forked before the logits where a prep kernel can run first (v38) */
    double sustain_ms; /* benchmarks: replays before the timed ones (fm_cuda_engine_set_sustain) */
    int prio;        /* stream priorities: 0 none, 1 routed chain above the shared branch, 2 the reverse (v38) */
    int sh_ks;       /* FP4MOE_CUDA_SH_KS: the shared expert's K split on its branch, 0 the rule (v51) */
    int sel_warps;   /* FP4MOE_CUDA_SEL_WARPS: tokens per selection block, 4 or 8 (v52) */
    int l2first;     /* weights read with an L2 evict-first policy */
    int fp4_enc;  /* weights of new layers stored for the v6 decode        */
    int wgmma;    /* the wgmma kernels can run: sm_90 and built for sm_90a */
    /* workspace, sized for the largest call so far */
    int ws_T, ws_H, ws_Hp, ws_E, ws_k, ws_hstride;
    void *x_raw;
    int32_t *tok_ids;
    uint16_t *x_prep;
    float *out;
    int32_t *ids;
    float *wts;
    float *logits;
    int *n_active, *act_e, *act_off, *act_cnt, *sorted_tok;
    float *sorted_w;
    unsigned *done;
    unsigned *gu_done; /* [E] gate/up warps done per expert (v42's handoff) */
    uint16_t *h;
    int *stats;
    int stats_n;
    size_t route_smem_ok;
};

struct fm_cuda_layer {
    fm_cuda_engine *eng;
    fm_model_desc d;
    int layer;
    fm_qformat fmt;
    int H, I, E, k, SI, has_shared;
    int Hp, Ip, SIp;
    fm_dmat gate, up, down, sgate, sup, sdown;
    float *router_w, *router_bias, *score_bias;
    uint16_t *router_wb; /* the router as BF16 when every weight is exact in BF16 (v45), else NULL */
    int32_t *tid2eid;
    int64_t tid_rows;
    int hash;
    int64_t expert_bytes, shared_bytes;
};

static int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

/* ------------------------------------------------------------- device */

int fm_cuda_available(char *why, size_t cap) {
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        if (why && cap) snprintf(why, cap, "cudaGetDeviceCount: %s", cudaGetErrorString(err));
        cudaGetLastError();
        return 0;
    }
    if (n == 0) {
        if (why && cap) snprintf(why, cap, "no CUDA device found");
        return 0;
    }
    if (why && cap) snprintf(why, cap, "%d CUDA device(s)", n);
    return 1;
}

fm_status fm_cuda_engine_new(int device, fm_cuda_engine **out) {
    if (!out) return fm_error(FM_E_ARG, "fm_cuda_engine_new: NULL output");
    *out = NULL;
    char why[256];
    if (!fm_cuda_available(why, sizeof why)) return fm_error(FM_E_UNSUPPORTED, "no usable CUDA GPU: %s", why);
    fm_status es = fm_cuda_env_check();
    if (es) return es;
    int n = 0;
    FM_CU(cudaGetDeviceCount(&n));
    if (device < 0 || device >= n) return fm_error(FM_E_ARG, "CUDA device %d does not exist (%d present)", device, n);
    FM_CU(cudaSetDevice(device));
    cudaDeviceProp prop;
    FM_CU(cudaGetDeviceProperties(&prop, device));
    if (prop.major < 8)
        return fm_error(FM_E_UNSUPPORTED, "%s is sm_%d%d; the CUDA backend needs sm_80 or newer (BF16 mma.sync)",
                        prop.name, prop.major, prop.minor);
    fm_cuda_engine *e = (fm_cuda_engine *)calloc(1, sizeof *e);
    if (!e) return fm_error(FM_E_NOMEM, "out of memory");
    e->device = device;
    snprintf(e->name, sizeof e->name, "%s", prop.name);
    e->sm_count = prop.multiProcessorCount;
    e->smem_optin = (int)prop.sharedMemPerBlockOptin;
    e->cc_major = prop.major;
    e->cc_minor = prop.minor;
    cudaRuntimeGetVersion(&e->rt_ver);
    cudaDriverGetVersion(&e->drv_ver);
    e->shared_enabled = 1;
    /* PDL, the shared expert's branch and pass width, the handoff, the early
     * weight loads, the selection's spread and launch trigger */
    fm_sched_read(&e->sched, prop.major);
    /* FP4MOE_CUDA_FP4_DECODE=v5: checkpoint nibble order and the v5 decode
     * (kept to measure the two against each other) */
    /* FP4MOE_CUDA_SH_PREFETCH=1: the shared expert's weights are prefetched
     * into L2 while routing runs (needs PDL) */
    e->sh_prefetch = fm_cuda_env_is("FP4MOE_CUDA_SH_PREFETCH", "1");
    /* FP4MOE_CUDA_SH_EARLY=1: the shared expert's gate/up runs during the
     * selection (needs PDL; v27) */
    e->sh_early = fm_cuda_env_is("FP4MOE_CUDA_SH_EARLY", "1");
    /* FP4MOE_CUDA_SEL_WARPS=8: the selection kernel's blocks take 8 tokens
     * (one warp each) instead of 4, so that up to 8 tokens are selected and
     * grouped by one block (v52: level) */
    e->sel_warps = fm_cuda_env_is("FP4MOE_CUDA_SEL_WARPS", "8") ? 8 : 4;
    /* FP4MOE_CUDA_SH_KS=1|2|4|8: the shared expert's launches on its branch
     * split K over that many CTAs (v51: refuted, an A/B switch; gate/up's
     * split halves until its cluster's partial sums fit the rings) */
    {
        const char *kv = getenv("FP4MOE_CUDA_SH_KS");
        e->sh_ks = kv && *kv ? atoi(kv) : 0;
    }
    /* FP4MOE_CUDA_SH_FORK_EARLY=1: above 32 tokens the tokens' prep runs as
     * a kernel of its own and the shared expert's branch forks after it,
     * beside the logits too (v38) */
    e->sh_fork_early = fm_cuda_env_is("FP4MOE_CUDA_SH_FORK_EARLY", "1");
    /* FP4MOE_CUDA_PRIO=1: the routing and routed experts' stream at the
     * device's greatest priority and the shared expert's branch at its least,
     * so that pending blocks of the critical chain are placed first; 2 the
     * reverse; 0 both at the default (v38). Graphs keep the captured
     * priorities (cudaGraphInstantiateFlagUseNodePriority). */
    {
        const char *pv = getenv("FP4MOE_CUDA_PRIO");
        e->prio = pv && *pv ? atoi(pv) : 0;
    }
    /* Weights and router rows are read with an L2 evict-first policy
     * (docs/perf.md, v18); FP4MOE_CUDA_L2HINT=0 reads them at the default
     * priority, for comparisons */
    e->l2first = !fm_cuda_env_is("FP4MOE_CUDA_L2HINT", "0");
    e->fp4_enc = 1;
    if (fm_cuda_env_is("FP4MOE_CUDA_FP4_DECODE", "v5")) e->fp4_enc = 0;
    snprintf(e->desc, sizeof e->desc, "%s, %d SMs, sm_%d%d, CUDA %d.%d, driver %d.%d, %.0f GB", e->name, e->sm_count,
             e->cc_major, e->cc_minor, e->rt_ver / 1000, (e->rt_ver % 1000) / 10, e->drv_ver / 1000,
             (e->drv_ver % 1000) / 10, (double)prop.totalGlobalMem / 1e9);
    e->wgmma = prop.major == 9 && fm_cuda_wgmma_built();
    int least = 0, greatest = 0;
    cudaError_t err = cudaDeviceGetStreamPriorityRange(&least, &greatest);
    const int p_main = e->prio == 1 ? greatest : e->prio == 2 ? least : 0;
    const int p_side = e->prio == 1 ? least : e->prio == 2 ? greatest : 0;
    if (err == cudaSuccess) err = cudaStreamCreateWithPriority(&e->stream, cudaStreamNonBlocking, p_main);
    if (err == cudaSuccess) err = cudaStreamCreateWithPriority(&e->side, cudaStreamNonBlocking, p_side);
    if (err == cudaSuccess) err = cudaEventCreateWithFlags(&e->fork_ev, cudaEventDisableTiming);
    if (err == cudaSuccess) err = cudaEventCreateWithFlags(&e->join_ev, cudaEventDisableTiming);
    if (err != cudaSuccess) {
        fm_cuda_engine_free(e);
        return fm_error(FM_E_CUDA, "creating the engine's streams and events failed: %s", cudaGetErrorString(err));
    }
    *out = e;
    return FM_OK;
}

static void ws_free(fm_cuda_engine *e) {
    void *ptrs[] = {e->x_raw, e->tok_ids, e->x_prep, e->out, e->ids, e->wts, e->logits, e->n_active, e->act_e, e->act_off,
                    e->act_cnt, e->sorted_tok, e->sorted_w, e->done, e->h, e->stats, e->gu_done};
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
        if (ptrs[i]) cudaFree(ptrs[i]);
    e->x_raw = NULL; e->tok_ids = NULL; e->x_prep = NULL; e->out = NULL; e->ids = NULL; e->wts = NULL; e->logits = NULL;
    e->n_active = NULL; e->act_e = NULL; e->act_off = NULL; e->act_cnt = NULL; e->sorted_tok = NULL;
    e->sorted_w = NULL; e->done = NULL; e->h = NULL; e->stats = NULL; e->gu_done = NULL;
    e->ws_T = 0;
}

void fm_cuda_engine_free(fm_cuda_engine *e) {
    if (!e) return;
    cudaSetDevice(e->device);
    ws_free(e);
    if (e->join_ev) cudaEventDestroy(e->join_ev);
    if (e->fork_ev) cudaEventDestroy(e->fork_ev);
    if (e->side) cudaStreamDestroy(e->side);
    if (e->stream) cudaStreamDestroy(e->stream);
    free(e);
}

const char *fm_cuda_engine_describe(const fm_cuda_engine *e) { return e ? e->desc : "no CUDA engine"; }

fm_status fm_cuda_engine_key(const fm_cuda_engine *e, const fm_model_desc *d, fm_qformat fmt,
                             struct fm_tune_key *key) {
    if (!e || !d || !key) return fm_error(FM_E_ARG, "fm_cuda_engine_key: NULL argument");
    memset(key, 0, sizeof *key);
    snprintf(key->gpu_name, sizeof key->gpu_name, "%.127s", e->name);
    key->sm_count = e->sm_count;
    key->cuda_version = e->rt_ver;
    key->driver_version = e->drv_ver;
    key->fmt = fmt;
    key->E = d->n_experts;
    key->H = d->hidden;
    key->I = d->moe_inter;
    key->k = d->topk;
    return FM_OK;
}

fm_status fm_cuda_engine_set_config(fm_cuda_engine *e, const fm_kernel_config *cfg) {
    if (!e) return fm_error(FM_E_ARG, "fm_cuda_engine_set_config: no engine");
    char why[192];
    if (cfg && fm_tune_config_invalid(cfg, why, sizeof why))
        return fm_error(FM_E_ARG, "kernel config refused: %s", why);
    e->forced = cfg != NULL;
    if (cfg) e->cfg = *cfg;
    return FM_OK;
}
void fm_cuda_engine_set_phase_times(fm_cuda_engine *e, fm_phase_times *pt) {
    if (e) e->pt = pt;
}
void fm_cuda_engine_set_shared(fm_cuda_engine *e, int enabled) {
    if (e) e->shared_enabled = enabled != 0;
}
void fm_cuda_engine_set_sustain(fm_cuda_engine *e, double ms) {
    if (e) e->sustain_ms = ms > 0 && ms <= 600000 ? ms : 0;
}

/* Kernel config for (layer shape, T): forced, tuned, or the default; made
 * safe for the launcher (a tuned file is outside input). */
static void choose_cfg(fm_cuda_engine *e, const fm_cuda_layer *l, int T, fm_kernel_config *cfg, fm_launch_cfg *lc,
                       char *src, size_t cap) {
    fm_tune_key key;
    fm_cuda_engine_key(e, &l->d, l->fmt, &key);
    if (e->forced) {
        *cfg = e->cfg;
        snprintf(src, cap, "set by caller (fm_cuda_engine_set_config)");
    } else {
        fm_tune_choice ch;
        memset(&ch, 0, sizeof ch);
        if (fm_tune_choose(&key, T, &ch) == FM_OK) {
            *cfg = ch.cfg;
            snprintf(src, cap, "%s", ch.source[0] ? ch.source : "built-in default");
        } else {
            *cfg = fm_kernel_config_default(&key, T);
            snprintf(src, cap, "built-in default (tuning lookup failed: %s)", fm_last_error());
        }
    }
    if (cfg->path == FM_PATH_WGMMA) {
        /* one block shape; passes of 8, 16 or 32 tokens. Needs sm_90 and the
         * v6 word order; elsewhere the mma.sync default runs, and says so. */
        const char *why = e->cc_major != 9 ? "needs sm_90"
                          : !e->wgmma      ? "is not in this build (no sm_90a code)"
                          : !l->gate.enc   ? "needs the v6 FP4 word order"
                                           : NULL;
        if (!why) {
            /* the shape was checked where the config came in (the config
             * file's parser, fm_cuda_engine_set_config, the defaults).
             * FP4MOE_CUDA_WG_GROUPS=1|2 sets the warpgroups per block (64 or
             * 128 rows per block, v43) whatever the config's, for A/B runs;
             * passes of 8 tokens have one. */
            const char *gv = getenv("FP4MOE_CUDA_WG_GROUPS");
            if (gv && (!strcmp(gv, "1") || !strcmp(gv, "2") || !strcmp(gv, "gu") || !strcmp(gv, "dn")) &&
                cfg->tile_n >= 16) {
                cfg->warps = strcmp(gv, "1") ? 8 : 4;
                cfg->rows_per_block = 16 * cfg->warps;
                size_t n = strlen(src);
                snprintf(src + n, cap > n ? cap - n : 0, " (rows_per_block %d from FP4MOE_CUDA_WG_GROUPS)",
                         cfg->rows_per_block);
            }
            lc->nt = cfg->tile_n / 8;
            lc->warps = cfg->warps;
            lc->ksplit = 1;
            lc->pdl = e->sched.pdl;
            lc->pipe = FM_PIPE_WGMMA;
            lc->wgmma = 1;
            return;
        }
        size_t n = strlen(src);
        snprintf(src + n, cap > n ? cap - n : 0, " (wgmma path %s: the built-in mma.sync default used)", why);
        *cfg = fm_kernel_config_default_mma(&key, T);
    }
    int nt = cfg->tile_n <= 8 ? 1 : cfg->tile_n <= 16 ? 2 : 4;
    int w = cfg->warps, ks = cfg->k_split;
    if (w < 1 || w > 8 || ks < 1 || w % ks) {
        fm_kernel_config d = fm_kernel_config_default(&key, T);
        size_t n = strlen(src);
        snprintf(src + n, cap > n ? cap - n : 0, " (warps %d / k_split %d unusable: built-in default used)", w, ks);
        *cfg = d;
        nt = d.tile_n <= 8 ? 1 : d.tile_n <= 16 ? 2 : 4;
        w = d.warps;
        ks = d.k_split;
    }
    cfg->tile_n = nt * 8;
    cfg->rows_per_block = 16 * (w / ks);
    lc->nt = nt;
    lc->warps = w;
    lc->ksplit = ks;
    lc->pdl = e->sched.pdl;
    lc->wgmma = e->wgmma;
    /* FP4MOE_CUDA_STAGES=N overrides the config's stages (A/B runs). */
    const char *env = getenv("FP4MOE_CUDA_STAGES");
    if (env && *env) {
        char *end = NULL;
        long v = strtol(env, &end, 10);
        if (!*end && v >= 1 && v <= 8) {
            cfg->stages = (int)v;
            size_t n = strlen(src);
            snprintf(src + n, cap > n ? cap - n : 0, " (stages %ld from FP4MOE_CUDA_STAGES)", v);
        }
    }
    /* stages: 1 = register double buffer, >= 2 = cp.async ring */
    lc->pipe = cfg->stages >= 2 ? FM_PIPE_CP_ASYNC : FM_PIPE_REGS2;
    cfg->stages = lc->pipe == FM_PIPE_CP_ASYNC ? FM_CP_STAGES : 1;
}

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
    free(l);
}

static fm_status layer_shell(fm_cuda_engine *e, const fm_model_desc *d, fm_qformat fmt, int layer, int with_bias,
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
    l->gate.enc = l->up.enc = l->down.enc = l->sgate.enc = l->sup.enc = l->sdown.enc = e->fp4_enc;
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
 * exactly (v45). */
static fm_status upload_router(fm_cuda_layer *l, const float *w, const float *rbias, const float *sbias,
                               const int32_t *tid, int64_t tid_rows) {
    size_t nw = (size_t)l->E * l->H;
    FM_CU(cudaMalloc(&l->router_w, nw * sizeof(float)));
    FM_CU(cudaMemcpy(l->router_w, w, nw * sizeof(float), cudaMemcpyHostToDevice));
    /* a BF16 copy for the v45 logits where every weight is exact in BF16:
     * converted in the pass that checks, dropped at the first weight that
     * is not */
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
    if (m->enc) /* pstride is a multiple of 64 bytes (kp is of 128 values) */
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
    fm_status s = layer_shell(e, &dd, l->fmt, l->layer, with_bias, &c);
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
    if (!s) s = upload_router(c, l->router_w, l->router_bias, l->score_bias, l->tid2eid, l->tid2eid_rows);
    if (s) { fm_cuda_layer_free(c); return s; }
    *out = c;
    return FM_OK;
}

/* ---- seeded random weights generated on the GPU (formulas: src/io/model_random.c) */

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
 * group's scale byte (NVFP4) or every other group's (MXFP4). */
__global__ void fm_gen_kernel(fm_dmat m, const uint64_t *kcodes, const uint64_t *kscales, uint64_t seed, int K,
                              int mx, int bexp) {
    int64_t g16 = K / 16;
    int64_t total = (int64_t)m.n * m.rows * g16;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t b = i % g16, rr = i / g16;
        int r = (int)(rr % m.rows), n = (int)(rr / m.rows);
        uint64_t w = d_rng_u64(seed, kcodes[n], (uint64_t)r * g16 + b);
        if (m.enc) w = fm_fp4_enc_word((uint32_t)w) | (uint64_t)fm_fp4_enc_word((uint32_t)(w >> 32)) << 32;
        const int nseg = m.kp / FM_KSEG;
        *(uint64_t *)(m.packed + n * m.pstride + fm_tile_packed_off(r, b * 8, nseg)) = w;
        if (!mx) {
            uint64_t u = d_rng_u64(seed, kscales[n], (uint64_t)r * g16 + b);
            m.scales[n * m.sstride + fm_tile_scale_off(r, b, nseg, 0)] = (uint8_t)(0x64u + (uint32_t)(u >> 32) % 12u);
        } else if ((b & 1) == 0) {
            int64_t g32 = K / 32, b32 = b / 2;
            uint64_t u = d_rng_u64(seed, kscales[n], (uint64_t)r * g32 + b32);
            m.scales[n * m.sstride + fm_tile_scale_off(r, b32, nseg, 1)] =
                (uint8_t)(bexp + (int)((uint32_t)(u >> 32) % 3u) - 1);
        }
    }
}

static fm_status gen_dmat(fm_cuda_engine *e, fm_dmat *m, uint64_t seed, int layer, int first_e, int mi, int K,
                          fm_qformat fmt) {
    static const char *const names[3] = {"gate", "up", "down"};
    uint64_t *hk = (uint64_t *)malloc(sizeof(uint64_t) * 2 * (size_t)m->n);
    if (!hk) return fm_error(FM_E_NOMEM, "out of memory");
    char w[32];
    for (int i = 0; i < m->n; i++) {
        int ex = first_e < 0 ? -1 : i;
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
                                                           mx ? fm_gen_mxfp4_base_exp(K) : 0);
    err = cudaGetLastError();
    if (err == cudaSuccess) err = cudaStreamSynchronize(e->stream);
    cudaFree(dk);
    if (err != cudaSuccess) return fm_error(FM_E_CUDA, "weight generation kernel: %s", cudaGetErrorString(err));
    float s2 = fmt == FM_QF_NVFP4 ? fm_gen_nvfp4_scale2(K) : 1.0f;
    float *hs = (float *)malloc(sizeof(float) * (size_t)m->n);
    if (!hs) return fm_error(FM_E_NOMEM, "out of memory");
    for (int i = 0; i < m->n; i++) hs[i] = s2;
    err = cudaMemcpy(m->scale2, hs, sizeof(float) * (size_t)m->n, cudaMemcpyHostToDevice);
    free(hs);
    if (err != cudaSuccess) return fm_error(FM_E_CUDA, "cudaMemcpy scale2: %s", cudaGetErrorString(err));
    return s;
}

fm_status fm_cuda_layer_random(fm_cuda_engine *e, const fm_model_desc *d, fm_qformat fmt, uint64_t seed, int layer,
                               fm_cuda_layer **out) {
    if (!e || !d || !out) return fm_error(FM_E_ARG, "fm_cuda_layer_random: NULL argument");
    *out = NULL;
    FM_CU(cudaSetDevice(e->device));
    fm_status s = fm_model_desc_validate(d);
    if (s) return s;
    if (fmt == FM_QF_NONE) fmt = d->expert_format;
    if (!fm_model_is_moe_layer(d, layer))
        return fm_error(FM_E_ARG, "layer %d is not a MoE layer of this %s model", layer, d->family);
    int with_bias = fm_io_has_expert_bias(d);
    fm_cuda_layer *l;
    s = layer_shell(e, d, fmt, layer, with_bias, &l);
    if (s) return s;
    s = gen_dmat(e, &l->gate, seed, layer, 0, 0, l->H, fmt);
    if (!s) s = gen_dmat(e, &l->up, seed, layer, 0, 1, l->H, fmt);
    if (!s) s = gen_dmat(e, &l->down, seed, layer, 0, 2, l->I, fmt);
    if (!s && l->has_shared) {
        s = gen_dmat(e, &l->sgate, seed, layer, -1, 0, l->H, fmt);
        if (!s) s = gen_dmat(e, &l->sup, seed, layer, -1, 1, l->H, fmt);
        if (!s) s = gen_dmat(e, &l->sdown, seed, layer, -1, 2, l->SI, fmt);
    }
    /* small tensors on the host with the shared formulas */
    float *rw = NULL, *rb = NULL, *sb = NULL;
    int32_t *tid = NULL;
    int64_t V = 0;
    if (!s) {
        rw = (float *)malloc(sizeof(float) * (size_t)l->E * l->H);
        if (!rw) s = fm_error(FM_E_NOMEM, "out of memory");
        for (int64_t i = 0; !s && i < (int64_t)l->E * l->H; i++)
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
                    hb[(size_t)x * ms[mi]->rows_p + r] = fm_bf16_to_f32(fm_io_gen_expert_bias(seed, layer, x, mi, r));
            cudaError_t err = cudaMemcpy(ms[mi]->bias, hb, nb * sizeof(float), cudaMemcpyHostToDevice);
            free(hb);
            if (err != cudaSuccess) s = fm_error(FM_E_CUDA, "cudaMemcpy bias: %s", cudaGetErrorString(err));
        }
    }
    if (!s) s = upload_router(l, rw, rb, sb, tid, V);
    free(rw);
    free(rb);
    free(sb);
    free(tid);
    if (s) { fm_cuda_layer_free(l); return s; }
    *out = l;
    return FM_OK;
}

/* ------------------------------------------------------------- running */

static fm_status ws_ensure(fm_cuda_engine *e, int T, int H, int Hp, int E, int k, int hstride, int nstats) {
    if (e->ws_T >= T && e->ws_H >= H && e->ws_Hp >= Hp && e->ws_E >= E && e->ws_k >= k && e->ws_hstride >= hstride &&
        e->stats_n >= nstats)
        return FM_OK;
    FM_CU(cudaStreamSynchronize(e->stream));
    T = T > e->ws_T ? T : e->ws_T;
    H = H > e->ws_H ? H : e->ws_H;
    Hp = Hp > e->ws_Hp ? Hp : e->ws_Hp;
    E = E > e->ws_E ? E : e->ws_E;
    k = k > e->ws_k ? k : e->ws_k;
    hstride = hstride > e->ws_hstride ? hstride : e->ws_hstride;
    nstats = nstats > e->stats_n ? nstats : e->stats_n;
    ws_free(e);
    size_t Tk = (size_t)T * k;
    FM_CU(cudaMalloc(&e->x_raw, (size_t)T * H * sizeof(float)));
    FM_CU(cudaMalloc(&e->tok_ids, (size_t)T * sizeof(int32_t)));
    FM_CU(cudaMalloc(&e->x_prep, (size_t)T * Hp * sizeof(uint16_t)));
    FM_CU(cudaMalloc(&e->out, (size_t)T * H * sizeof(float)));
    FM_CU(cudaMalloc(&e->ids, Tk * sizeof(int32_t)));
    FM_CU(cudaMalloc(&e->wts, Tk * sizeof(float)));
    FM_CU(cudaMalloc(&e->logits, fm_cuda_route_logit_floats(T, H, E, e->sm_count) * sizeof(float)));
    FM_CU(cudaMalloc(&e->n_active, sizeof(int)));
    FM_CU(cudaMalloc(&e->act_e, (size_t)E * sizeof(int)));
    FM_CU(cudaMalloc(&e->act_off, (size_t)E * sizeof(int)));
    FM_CU(cudaMalloc(&e->act_cnt, (size_t)E * sizeof(int)));
    FM_CU(cudaMalloc(&e->sorted_tok, Tk * sizeof(int)));
    FM_CU(cudaMalloc(&e->sorted_w, Tk * sizeof(float)));
    FM_CU(cudaMalloc(&e->done, FM_ROUTE_COUNTERS * sizeof(unsigned)));
    FM_CU(cudaMemset(e->done, 0, FM_ROUTE_COUNTERS * sizeof(unsigned)));
    FM_CU(cudaMalloc(&e->gu_done, (size_t)E * sizeof(unsigned)));
    FM_CU(cudaMemset(e->gu_done, 0, (size_t)E * sizeof(unsigned)));
    FM_CU(cudaMalloc(&e->h, (Tk + T) * hstride * sizeof(uint16_t)));
    FM_CU(cudaMemset(e->h, 0, (Tk + T) * hstride * sizeof(uint16_t)));
    FM_CU(cudaMalloc(&e->stats, (size_t)(nstats > 0 ? nstats : 1) * sizeof(int)));
    e->ws_T = T; e->ws_H = H; e->ws_Hp = Hp; e->ws_E = E; e->ws_k = k; e->ws_hstride = hstride;
    e->stats_n = nstats > 0 ? nstats : 1;
    return FM_OK;
}

static void fill_expert_params(fm_cuda_engine *e, const fm_cuda_layer *l, int T, fm_expert_params *p) {
    memset(p, 0, sizeof *p);
    p->gate = l->gate; p->up = l->up; p->down = l->down;
    if (l->has_shared && e->shared_enabled) { p->sgate = l->sgate; p->sup = l->sup; p->sdown = l->sdown; }
    p->mx = l->fmt == FM_QF_MXFP4;
    p->T = T;
    p->k = l->k;
    p->H = l->H;
    p->Hp = l->Hp;
    p->act = l->d.act == FM_ACT_GPTOSS ? FM_ACT_GPTOSS : FM_ACT_SILU;
    p->alpha = l->d.swiglu_alpha > 0 ? l->d.swiglu_alpha : 1.702f;
    /* gpt-oss always clamps (7 when the config omits it); SiLU-gated
     * models clamp only when they set swiglu_limit (DeepSeek-V4) */
    if (p->act == FM_ACT_GPTOSS) p->limit = l->d.swiglu_limit > 0 ? l->d.swiglu_limit : 7.0f;
    else p->limit = l->d.swiglu_limit > 0 ? l->d.swiglu_limit : 0.0f;
    int ta = T * l->k;
    p->max_active = ta < l->E ? ta : l->E;
    p->n_active = e->n_active; p->act_e = e->act_e; p->act_off = e->act_off; p->act_cnt = e->act_cnt;
    p->sorted_tok = e->sorted_tok; p->sorted_w = e->sorted_w;
    p->x_prep = e->x_prep;
    p->h = e->h;
    p->hstride = e->ws_hstride;
    p->out = e->out;
}

static float route_scaling(const fm_model_desc *d) {
    if (d->route == FM_ROUTE_NOAUX_TC || d->route == FM_ROUTE_DSV4)
        return d->routed_scaling_factor > 0 ? d->routed_scaling_factor : 1.0f;
    return 1.0f;
}

/* The shared expert's pass width on its own branch (v35, v46; schedule.c). */
static int shared_nt(const fm_cuda_engine *e, const fm_launch_cfg *lc, int T) {
    return fm_sched_shared_nt(&e->sched, lc->pipe == FM_PIPE_WGMMA, lc->nt, lc->warps, T);
}

/* Whether the routed down takes over per expert at T tokens (v42). */
static int handoff_on(const fm_cuda_engine *e, const fm_launch_cfg *lc, int T) {
    return fm_sched_handoff(&e->sched, lc->pipe == FM_PIPE_WGMMA && lc->pdl, T);
}

/* The three launches of one layer on e->stream; x_dev is [T][H] of xdt. */
static fm_status run_layer(fm_cuda_engine *e, const fm_cuda_layer *l, int T, const void *x_dev, int xdt,
                           const int32_t *tok_dev, int *stat, const fm_launch_cfg *lc, cudaEvent_t *ev, int parts) {
    fm_route_params rp;
    memset(&rp, 0, sizeof rp);
    rp.route = l->d.route;
    rp.E = l->E; rp.k = l->k; rp.H = l->H; rp.Hp = l->Hp; rp.T = T;
    rp.n_group = l->d.n_group; rp.topk_group = l->d.topk_group;
    rp.norm_topk = l->d.norm_topk_prob;
    rp.scaling = route_scaling(&l->d);
    rp.hash = l->hash && tok_dev != NULL;
    rp.router_w = l->router_w; rp.router_wb = l->router_wb; rp.router_bias = l->router_bias; rp.score_bias = l->score_bias;
    rp.tid2eid = l->tid2eid; rp.tid_rows = l->tid_rows;
    rp.x = x_dev; rp.xdt = xdt; rp.token_ids = tok_dev;
    rp.logits = e->logits;
    rp.sms = e->sm_count;
    rp.ids = e->ids; rp.wts = e->wts; rp.x_prep = e->x_prep; rp.out = e->out;
    rp.n_active = e->n_active; rp.act_e = e->act_e; rp.act_off = e->act_off; rp.act_cnt = e->act_cnt;
    rp.sorted_tok = e->sorted_tok; rp.sorted_w = e->sorted_w; rp.done = e->done; rp.stat_active = stat;
    size_t smem = fm_cuda_route_smem(l->H, l->E);
    if (smem > e->route_smem_ok) {
        fm_status s = fm_cuda_route_prepare(smem);
        if (s) return s;
        e->route_smem_ok = smem;
    }
    fm_expert_params ep;
    fill_expert_params(e, l, T, &ep);
    /* the shared expert on its own branch: forked once the logits kernel
     * has written the tokens' prep and zeroed the output, joined after the
     * routed down (phase timing keeps one stream) */
    const int fork = e->sched.sh_fork && ep.sgate.n > 0 && !ev && (parts & FM_ROUTE_PART_EXPERTS) &&
                     (parts & FM_ROUTE_PART_LOGITS) && (parts & FM_ROUTE_PART_SELECT);
    ep.sh_prefetch = e->sh_prefetch && lc->pdl && ep.sgate.n > 0 && !ev && !fork;
    ep.sh_early = e->sh_early && lc->pdl && ep.sgate.n > 0 && !ev && !fork;
    {
        const int se = fm_sched_trigger(&e->sched, fork);
        rp.early_trigger = ep.sh_prefetch || ep.sh_early || se == 1 ? 1 : se == 2 ? 2 : 0;
    }
    rp.warp_group = e->sched.warp_group;
    rp.sel_spread = e->sched.sel_spread;
    rp.sel_warps = e->sel_warps;
    ep.l2first = rp.l2first = e->l2first;
    ep.pre_wait = e->sched.pre_wait;
    ep.sms = e->sm_count;
    ep.smem_optin = e->smem_optin;
    fm_status s;
    if (ev) FM_CU(cudaEventRecord(ev[0], e->stream));
    if (fork) {
        /* v42: the selection zeroes the experts' gate/up counters that the
         * routed down's blocks wait on */
        rp.gu_done = handoff_on(e, lc, T) ? e->gu_done : NULL;
        if (e->sh_fork_early && fm_cuda_route_sep_prep(T, l->H, l->E, e->sm_count)) {
            /* the prep alone, the fork, then the logits without the prep */
            if ((s = fm_cuda_launch_route(&rp, smem, lc->pdl, FM_ROUTE_PART_PREP, e->stream))) return s;
            FM_CU(cudaEventRecord(e->fork_ev, e->stream));
            if ((s = fm_cuda_launch_route(&rp, smem, lc->pdl, FM_ROUTE_PART_LOGITS, e->stream))) return s;
        } else {
            if ((s = fm_cuda_launch_route(&rp, smem, lc->pdl, FM_ROUTE_PART_LOGITS, e->stream))) return s;
            FM_CU(cudaEventRecord(e->fork_ev, e->stream));
        }
        /* the selection is captured before the branch, so that a graph does
         * not queue it behind the shared expert's launches */
        if ((s = fm_cuda_launch_route(&rp, smem, lc->pdl, FM_ROUTE_PART_SELECT, e->stream))) return s;
        FM_CU(cudaStreamWaitEvent(e->side, e->fork_ev, 0));
        fm_expert_params sp = ep;
        sp.max_active = 0; /* the shared expert's items only */
        sp.ks_force = e->sh_ks;
        fm_launch_cfg slc = *lc;
        slc.nt = shared_nt(e, lc, T);
        fm_launch_cfg sdc = slc;
        slc.pdl = 0; /* its first launch waits on an event, not on a kernel */
        if ((s = fm_cuda_launch_gateup(&sp, &slc, e->side))) return s;
        if ((s = fm_cuda_launch_down(&sp, &sdc, e->side))) return s;
        FM_CU(cudaEventRecord(e->join_ev, e->side));
        ep.sgate.n = ep.sup.n = ep.sdown.n = 0; /* the routed experts only */
        ep.gu_done = rp.gu_done;
        if ((s = fm_cuda_launch_gateup(&ep, lc, e->stream))) return s;
        if ((s = fm_cuda_launch_down(&ep, lc, e->stream))) return s;
        FM_CU(cudaStreamWaitEvent(e->stream, e->join_ev, 0));
        return FM_OK;
    }
    /* v42 here too (no shared expert, or its blocks inside the routed
     * launches, which keep waiting for the whole grids); not with the phase
     * timing's events between the launches */
    rp.gu_done = handoff_on(e, lc, T) && !ev ? e->gu_done : NULL;
    if ((s = fm_cuda_launch_route(&rp, smem, lc->pdl, parts, e->stream))) return s;
    if (!(parts & FM_ROUTE_PART_EXPERTS)) return FM_OK;
    /* fused routing writes the tokens' prep in the grid the experts wait on,
     * and has no selection kernel to zero the handoff's counters */
    if (rp.fuse) ep.sh_early = 0;
    ep.gu_done = rp.fuse ? NULL : rp.gu_done;
    if (ev) FM_CU(cudaEventRecord(ev[1], e->stream));
    if ((s = fm_cuda_launch_gateup(&ep, lc, e->stream))) return s;
    if (ev) FM_CU(cudaEventRecord(ev[2], e->stream));
    if ((s = fm_cuda_launch_down(&ep, lc, e->stream))) return s;
    if (ev) FM_CU(cudaEventRecord(ev[3], e->stream));
    return FM_OK;
}

static fm_status check_tokens(const fm_cuda_layer *l, int T, const int32_t *token_ids) {
    if (!l->hash) return FM_OK;
    if (!token_ids)
        return fm_error(FM_E_ARG, "layer %d of %s routes by token id (hash layer): token ids are required", l->layer,
                        l->d.family);
    for (int t = 0; t < T; t++)
        if (token_ids[t] < 0 || token_ids[t] >= l->tid_rows)
            return fm_error(FM_E_RANGE, "token id %d at position %d is outside the vocabulary (0..%lld)", token_ids[t],
                            t, (long long)l->tid_rows - 1);
    return FM_OK;
}

fm_status fm_cuda_forward(fm_cuda_engine *e, const fm_model_desc *d, const fm_cuda_layer *l, const void *x,
                          fm_dtype xdt, int T, const int32_t *token_ids, fm_moe_out *o) {
    if (!e || !d || !l || !x || !o || !o->out) return fm_error(FM_E_ARG, "fm_cuda_forward: NULL argument");
    if (T <= 0) return fm_error(FM_E_ARG, "fm_cuda_forward: T = %d tokens", T);
    if (xdt != FM_DT_F32 && xdt != FM_DT_BF16 && xdt != FM_DT_F16)
        return fm_error(FM_E_ARG, "fm_cuda_forward: activations must be F32, BF16 or F16, not %s", fm_dtype_name(xdt));
    if (d->hidden != l->H || d->n_experts != l->E || d->topk != l->k)
        return fm_error(FM_E_ARG, "model description does not match the uploaded layer");
    fm_status s = check_tokens(l, T, token_ids);
    if (!s) s = fm_check_x_finite(x, xdt, T, l->H); /* as the CPU engine */
    if (s) return s;
    FM_CU(cudaSetDevice(e->device));
    int hstride = l->Ip > l->SIp ? l->Ip : l->SIp;
    if ((s = ws_ensure(e, T, l->H, l->Hp, l->E, l->k, hstride, 1))) return s;
    size_t xb = (size_t)T * l->H * (xdt == FM_DT_F32 ? 4 : 2);
    FM_CU(cudaMemcpyAsync(e->x_raw, x, xb, cudaMemcpyHostToDevice, e->stream));
    if (l->hash) FM_CU(cudaMemcpyAsync(e->tok_ids, token_ids, (size_t)T * 4, cudaMemcpyHostToDevice, e->stream));
    fm_kernel_config cfg;
    fm_launch_cfg lc;
    char src[512];
    choose_cfg(e, l, T, &cfg, &lc, src, sizeof src);
    cudaEvent_t ev[4];
    int nev = 0;
    if (e->pt) {
        for (nev = 0; nev < 4; nev++)
            if (cudaEventCreate(&ev[nev]) != cudaSuccess) break;
        if (nev < 4) {
            for (int i = 0; i < nev; i++) cudaEventDestroy(ev[i]);
            return fm_error(FM_E_CUDA, "cudaEventCreate failed");
        }
    }
    s = run_layer(e, l, T, e->x_raw, xdt, l->hash ? e->tok_ids : NULL, e->stats, &lc, e->pt ? ev : NULL,
                  FM_ROUTE_PARTS_ALL);
    if (!s) {
        cudaError_t err = cudaMemcpyAsync(o->out, e->out, (size_t)T * l->H * 4, cudaMemcpyDeviceToHost, e->stream);
        if (err == cudaSuccess && o->topk_ids)
            err = cudaMemcpyAsync(o->topk_ids, e->ids, (size_t)T * l->k * 4, cudaMemcpyDeviceToHost, e->stream);
        if (err == cudaSuccess && o->topk_weights)
            err = cudaMemcpyAsync(o->topk_weights, e->wts, (size_t)T * l->k * 4, cudaMemcpyDeviceToHost, e->stream);
        if (err == cudaSuccess) err = cudaStreamSynchronize(e->stream);
        if (err != cudaSuccess) s = fm_error(FM_E_CUDA, "CUDA forward of layer %d failed: %s", l->layer, cudaGetErrorString(err));
    }
    /* as the CPU engine: a non-finite output (weights or scales that are
     * not finite) fails the call instead of being handed on */
    if (!s) s = fm_check_out_finite(l->layer, "output", o->out, T, l->H);
    if (!s && e->pt) {
        float ms[3] = {0, 0, 0};
        for (int i = 0; i < 3; i++) cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]);
        e->pt->ns[FM_PH_ROUTE] += ms[0] * 1e6;
        e->pt->ns[FM_PH_GATEUP] += ms[1] * 1e6;
        e->pt->ns[FM_PH_DOWN] += ms[2] * 1e6;
        e->pt->calls++;
        e->pt->fused_mask |= (1u << FM_PH_SORT) | (1u << FM_PH_ACT) | (1u << FM_PH_COMBINE) | (1u << FM_PH_SHARED);
    }
    if (nev)
        for (int i = 0; i < 4; i++) cudaEventDestroy(ev[i]);
    return s;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* One CUDA graph of the given launches (FM_ROUTE_PART_*) of every layer at
 * batch T, replayed reps times after a warm-up: median, min and max µs per
 * layer. Turns PDL off in *lc when the graph cannot hold it. */
static fm_status graph_time(fm_cuda_engine *e, fm_cuda_layer *const *layers, int n_layers, int T, fm_launch_cfg *lc,
                            int parts, int reps, double *med, double *mn, double *mx) {
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    cudaError_t err;
    for (int attempt = 0; attempt < 2; attempt++) {
        FM_CU(cudaStreamBeginCapture(e->stream, cudaStreamCaptureModeThreadLocal));
        fm_status cs = FM_OK;
        for (int i = 0; i < n_layers && !cs; i++)
            cs = run_layer(e, layers[i], T, e->x_raw, FM_DT_F32, layers[i]->hash ? e->tok_ids : NULL, e->stats + i,
                           lc, NULL, parts);
        err = cudaStreamEndCapture(e->stream, &graph);
        if (cs) { if (graph) cudaGraphDestroy(graph); return cs; }
        if (err == cudaSuccess)
            err = cudaGraphInstantiateWithFlags(&exec, graph, e->prio ? cudaGraphInstantiateFlagUseNodePriority : 0);
        if (err == cudaSuccess) break;
        if (graph) cudaGraphDestroy(graph);
        graph = NULL;
        cudaGetLastError();
        if (!lc->pdl || attempt == 1) return fm_error(FM_E_CUDA, "CUDA graph of %d layers: %s", n_layers, cudaGetErrorString(err));
        lc->pdl = 0; /* retry without programmatic dependent launch */
    }
    fm_status s = FM_OK;
    double *times = (double *)malloc(sizeof(double) * (size_t)reps);
    cudaEvent_t *ev = (cudaEvent_t *)malloc(sizeof(cudaEvent_t) * (size_t)(reps + 1));
    int nev = 0;
    if (!times || !ev) s = fm_error(FM_E_NOMEM, "out of memory");
    for (; !s && nev < reps + 1; nev++)
        if ((err = cudaEventCreate(&ev[nev])) != cudaSuccess) s = fm_error(FM_E_CUDA, "cudaEventCreate: %s", cudaGetErrorString(err));
    for (int w = 0; !s && w < 3; w++)
        if ((err = cudaGraphLaunch(exec, e->stream)) != cudaSuccess) s = fm_error(FM_E_CUDA, "cudaGraphLaunch: %s", cudaGetErrorString(err));
    if (!s && (err = cudaStreamSynchronize(e->stream)) != cudaSuccess)
        s = fm_error(FM_E_CUDA, "benchmark warm-up failed: %s", cudaGetErrorString(err));
    if (!s && e->sustain_ms > 0 && parts == FM_ROUTE_PARTS_ALL) {
        /* sustained load first (fm_cuda_engine_set_sustain): replays for
         * sustain_ms, the timed ones queued right behind them, so that the
         * GPU reaches the clocks its power limit allows under this work */
        /* one replay's time from 10 back to back (the first one's launch
         * latency shared out), then as many as fill sustain_ms */
        float ten = 0;
        cudaEventRecord(ev[0], e->stream);
        for (int i = 0; !s && i < 10; i++)
            if ((err = cudaGraphLaunch(exec, e->stream)) != cudaSuccess)
                s = fm_error(FM_E_CUDA, "cudaGraphLaunch: %s", cudaGetErrorString(err));
        cudaEventRecord(ev[1], e->stream);
        if (!s && (err = cudaEventSynchronize(ev[1])) != cudaSuccess)
            s = fm_error(FM_E_CUDA, "benchmark replay failed: %s", cudaGetErrorString(err));
        if (!s) cudaEventElapsedTime(&ten, ev[0], ev[1]);
        const double n = ten > 0 ? ceil(e->sustain_ms / (ten / 10.0)) - 10 : 1;
        for (long i = 0; !s && i < (long)(n < 1e6 ? n : 1e6); i++)
            if ((err = cudaGraphLaunch(exec, e->stream)) != cudaSuccess)
                s = fm_error(FM_E_CUDA, "cudaGraphLaunch: %s", cudaGetErrorString(err));
    }
    if (!s) {
        cudaEventRecord(ev[0], e->stream);
        for (int i = 0; i < reps && !s; i++) {
            if ((err = cudaGraphLaunch(exec, e->stream)) != cudaSuccess) s = fm_error(FM_E_CUDA, "cudaGraphLaunch: %s", cudaGetErrorString(err));
            cudaEventRecord(ev[i + 1], e->stream);
        }
        if (!s && (err = cudaStreamSynchronize(e->stream)) != cudaSuccess)
            s = fm_error(FM_E_CUDA, "benchmark replay failed: %s", cudaGetErrorString(err));
    }
    if (!s) {
        for (int i = 0; i < reps; i++) {
            float ms = 0;
            cudaEventElapsedTime(&ms, ev[i], ev[i + 1]);
            times[i] = ms * 1e3 / n_layers;
        }
        qsort(times, (size_t)reps, sizeof(double), cmp_double);
        *med = times[reps / 2];
        *mn = times[0];
        *mx = times[reps - 1];
    }
    for (int i = 0; i < nev; i++) cudaEventDestroy(ev[i]);
    free(ev);
    free(times);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    return s;
}

fm_status fm_cuda_bench(fm_cuda_engine *e, const fm_model_desc *d, fm_cuda_layer *const *layers, int n_layers, int T,
                        uint64_t seed, int reps, fm_cuda_bench_result *r) {
    if (!e || !d || !layers || !r || n_layers <= 0) return fm_error(FM_E_ARG, "fm_cuda_bench: bad argument");
    if (T <= 0) return fm_error(FM_E_ARG, "fm_cuda_bench: T = %d tokens", T);
    if (reps <= 0) reps = 20;
    memset(r, 0, sizeof *r);
    FM_CU(cudaSetDevice(e->device));
    int H = layers[0]->H, Hp = 0, E = 0, k = 0, hs = 0;
    int64_t vocab = 0;
    for (int i = 0; i < n_layers; i++) {
        const fm_cuda_layer *l = layers[i];
        if (!l || l->H != H) return fm_error(FM_E_ARG, "fm_cuda_bench: layers of different hidden sizes");
        if (l->Hp > Hp) Hp = l->Hp;
        if (l->E > E) E = l->E;
        if (l->k > k) k = l->k;
        int h = l->Ip > l->SIp ? l->Ip : l->SIp;
        if (h > hs) hs = h;
        if (l->hash && (vocab == 0 || l->tid_rows < vocab)) vocab = l->tid_rows;
    }
    fm_status s = ws_ensure(e, T, H, Hp, E, k, hs, n_layers);
    if (s) return s;
    /* activations ~ N(0, 1) and token ids, both from the seed */
    float *hx = (float *)malloc(sizeof(float) * (size_t)T * H);
    int32_t *ht = (int32_t *)malloc(sizeof(int32_t) * (size_t)T);
    if (!hx || !ht) { free(hx); free(ht); return fm_error(FM_E_NOMEM, "out of memory"); }
    uint64_t kx = fm_hash_str("bench.x"), kt = fm_hash_str("bench.token_ids");
    for (int64_t i = 0; i < (int64_t)T * H; i++) hx[i] = fm_rng_normal(seed, kx, (uint64_t)i);
    for (int t = 0; t < T; t++) ht[t] = vocab > 0 ? (int32_t)(fm_rng_u64(seed, kt, (uint64_t)t) % (uint64_t)vocab) : 0;
    cudaError_t err = cudaMemcpy(e->x_raw, hx, sizeof(float) * (size_t)T * H, cudaMemcpyHostToDevice);
    if (err == cudaSuccess) err = cudaMemcpy(e->tok_ids, ht, sizeof(int32_t) * (size_t)T, cudaMemcpyHostToDevice);
    free(hx);
    free(ht);
    if (err != cudaSuccess) return fm_error(FM_E_CUDA, "cudaMemcpy: %s", cudaGetErrorString(err));

    fm_kernel_config cfg;
    fm_launch_cfg lc;
    choose_cfg(e, layers[0], T, &cfg, &lc, r->config_source, sizeof r->config_source);
    r->cfg = cfg;
    fm_cuda_kernel_names(&lc, layers[0]->fmt == FM_QF_MXFP4, r->kernel, sizeof r->kernel);
    if (e->shared_enabled && e->sched.sh_fork && layers[0]->SIp > 0) {
        size_t n = strlen(r->kernel);
        snprintf(r->kernel + n, sizeof r->kernel - n, "; shared expert on its own stream, %d tokens per pass",
                 8 * shared_nt(e, &lc, T));
    }
    if (handoff_on(e, &lc, T)) {
        size_t n = strlen(r->kernel);
        snprintf(r->kernel + n, sizeof r->kernel - n, "; down starts per expert as its gate/up ends");
    }
    {
        size_t n = strlen(r->kernel);
        snprintf(r->kernel + n, sizeof r->kernel - n, "; router logits: %s",
                 fm_cuda_route_logits_name(T, layers[0]->H, layers[0]->E, e->sm_count, layers[0]->router_wb != NULL,
                                           FM_DT_F32));
    }

    const int pdl0 = lc.pdl;
    s = graph_time(e, layers, n_layers, T, &lc, FM_ROUTE_PARTS_ALL, reps, &r->us_per_layer, &r->us_min, &r->us_max);
    if (!s && pdl0 && !lc.pdl) {
        char k[sizeof r->kernel];
        snprintf(k, sizeof k, "%s", r->kernel);
        static const char pre[] = "PDL OFF (the graph refused it); ";
        /* the longest kernel line (~580) fits beside the prefix */
        snprintf(r->kernel, sizeof r->kernel, "%s%.*s", pre, (int)(sizeof r->kernel - sizeof pre), k);
    }
    if (!s) {
        int *act = (int *)malloc(sizeof(int) * (size_t)n_layers);
        if (!act) s = fm_error(FM_E_NOMEM, "out of memory");
        else if ((err = cudaMemcpy(act, e->stats, sizeof(int) * (size_t)n_layers, cudaMemcpyDeviceToHost)) != cudaSuccess)
            s = fm_error(FM_E_CUDA, "cudaMemcpy stats: %s", cudaGetErrorString(err));
        if (!s) {
            double sa = 0, sb = 0;
            for (int i = 0; i < n_layers; i++) {
                sa += act[i];
                sb += (double)act[i] * layers[i]->expert_bytes + (e->shared_enabled ? layers[i]->shared_bytes : 0);
            }
            r->active_experts = sa / n_layers;
            r->bytes_per_layer = (int64_t)(sb / n_layers);
        }
        free(act);
    }
    /* the routing launches alone (logits + selection + grouping) and the
     * logits kernel alone, in graphs of the same shape */
    double mn, mx;
    if (!s) s = graph_time(e, layers, n_layers, T, &lc, FM_ROUTE_PART_LOGITS | FM_ROUTE_PART_SELECT, reps, &r->route_us, &mn, &mx);
    if (!s) s = graph_time(e, layers, n_layers, T, &lc, FM_ROUTE_PART_LOGITS, reps, &r->logits_us, &mn, &mx);
    return s;
}

/* The probe's buffer on e's device: at least 64 MiB, whole 32 KB chunks for
 * the bulk-copy read; NULL with the error set when it cannot be had. */
static void *probe_buffer(fm_cuda_engine *e, size_t *bytes) {
    if (cudaSetDevice(e->device) != cudaSuccess) {
        fm_error(FM_E_CUDA, "bandwidth probe: %s", cudaGetErrorString(cudaGetLastError()));
        return NULL;
    }
    if (*bytes < (64u << 20)) *bytes = 64u << 20;
    *bytes &= ~(size_t)32767;
    void *buf = NULL;
    if (cudaMalloc(&buf, *bytes) != cudaSuccess) {
        cudaGetLastError();
        fm_error(FM_E_NOMEM, "bandwidth probe: no %zu MiB of device memory", *bytes >> 20);
        return NULL;
    }
    return buf;
}

double fm_cuda_measure_bandwidth(fm_cuda_engine *e, size_t bytes) {
    if (!e) return 0.0;
    void *buf = probe_buffer(e, &bytes);
    if (!buf) return 0.0;
    double best = 0;
    fm_status s = fm_cuda_stream_read(buf, bytes, e->stream, 10, &best);
    cudaFree(buf);
    return s == FM_OK && best > 0 ? (double)bytes / best : 0.0;
}

double fm_cuda_sustained_read(fm_cuda_engine *e, size_t bytes, double seconds) {
    if (!e) return fm_error(FM_E_ARG, "sustained read: NULL engine"), 0.0;
    if (!(seconds > 0 && seconds <= 600)) return fm_error(FM_E_RANGE, "sustained read: %g s", seconds), 0.0;
    void *buf = probe_buffer(e, &bytes);
    if (!buf) return 0.0;
    double rate = 0;
    fm_status s = fm_cuda_stream_read_for(buf, bytes, e->stream, seconds, &rate);
    cudaFree(buf);
    return s == FM_OK ? rate : 0.0;
}
