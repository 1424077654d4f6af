/*
 * The CUDA engine: device setup, the kernel config of each call, the
 * workspace, one MoE block per call (host buffers, or caller-owned device
 * memory on the caller's stream) and the multi-layer CUDA-graph benchmark.
 * One layer is four launches and no host synchronization:
 *   route_logits.cu  router logits + the tokens' prep (or the prep alone),
 *   route_select.cu  selection + grouping by expert (or the caller's ids),
 *   expert_*.cu      gate/up + activation, then down + routing weight +
 *                    combine (atomics into out), routed and shared experts;
 * the shared expert on a branch of its own beside the routed chain.
 * Layers live in layer.cu and gen.cu, the bandwidth probe in bwprobe.cu.
 */
#include "cuda_internal.h"
#include "schedule.h"
extern "C" {
#include "cpu/cpu_internal.h"
#include "util/util.h"
}
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    e->bench_xdt = FM_DT_F32;
    fm_sched_read(&e->sched, prop.major);
    snprintf(e->desc, sizeof e->desc, "%s, %d SMs, sm_%d%d, CUDA %d.%d, driver %d.%d, %.0f GB", e->name, e->sm_count,
             e->cc_major, e->cc_minor, e->rt_ver / 1000, (e->rt_ver % 1000) / 10, e->drv_ver / 1000,
             (e->drv_ver % 1000) / 10, (double)prop.totalGlobalMem / 1e9);
    e->wgmma = prop.major == 9 && fm_cuda_wgmma_built();
    cudaError_t err = cudaStreamCreateWithFlags(&e->stream, cudaStreamNonBlocking);
    if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&e->side, cudaStreamNonBlocking);
    if (err == cudaSuccess) err = cudaEventCreateWithFlags(&e->fork_ev, cudaEventDisableTiming);
    if (err == cudaSuccess) err = cudaEventCreateWithFlags(&e->join_ev, cudaEventDisableTiming);
    if (err != cudaSuccess) {
        fm_cuda_engine_free(e);
        return fm_error(FM_E_CUDA, "creating the engine's streams and events failed: %s", cudaGetErrorString(err));
    }
    if (fm_cuda_env_is("FP4MOE_CUDA_BLAS", "0")) snprintf(e->blas_note, sizeof e->blas_note, "cuBLAS off (FP4MOE_CUDA_BLAS=0)");
    else fm_cuda_blas_new(&e->blas, &e->blas_ws, e->blas_note, sizeof e->blas_note);
    {
        size_t n = strlen(e->desc);
        snprintf(e->desc + n, sizeof e->desc - n, ", %s", e->blas_note);
    }
    *out = e;
    return FM_OK;
}

fm_status fm_cuda_settle(const char *what) {
    cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) return fm_error(FM_E_CUDA, "%s: %s", what, cudaGetErrorString(err));
    return FM_OK;
}

static void ws_free(fm_cuda_engine *e) {
    void *ptrs[] = {e->x_raw, e->tok_ids, e->x_prep, e->out, e->ids, e->wts, e->logits, e->n_active, e->act_e, e->act_off,
                    e->act_cnt, e->sorted_tok, e->sorted_w, e->done, e->h, e->stats, e->gu_done, e->sk_part, e->sk_cnt};
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
        if (ptrs[i]) cudaFree(ptrs[i]);
    e->x_raw = NULL; e->tok_ids = NULL; e->x_prep = NULL; e->out = NULL; e->ids = NULL; e->wts = NULL; e->logits = NULL;
    e->n_active = NULL; e->act_e = NULL; e->act_off = NULL; e->act_cnt = NULL; e->sorted_tok = NULL;
    e->sorted_w = NULL; e->done = NULL; e->h = NULL; e->stats = NULL; e->gu_done = NULL;
    e->sk_part = NULL; e->sk_cnt = NULL; e->sk_part_n = e->sk_cnt_n = 0;
    e->ws_T = 0;
}

void fm_cuda_engine_free(fm_cuda_engine *e) {
    if (!e) return;
    cudaSetDevice(e->device);
    ws_free(e);
    fm_cuda_blas_free(e->blas, e->blas_ws);
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
    e->cfg_gen++;
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
fm_status fm_cuda_engine_set_bench_act(fm_cuda_engine *e, fm_dtype xdt) {
    if (!e) return fm_error(FM_E_ARG, "fm_cuda_engine_set_bench_act: NULL engine");
    if (xdt != FM_DT_F32 && xdt != FM_DT_BF16 && xdt != FM_DT_F16)
        return fm_error(FM_E_ARG, "benchmark activations must be F32, BF16 or F16, not %s", fm_dtype_name(xdt));
    e->bench_xdt = xdt;
    return FM_OK;
}

static void fill_expert_params(fm_cuda_engine *e, const fm_cuda_layer *l, int T, int shared, float *out,
                               fm_expert_params *p);

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
            fm_tune_choice_source(&ch, src, cap);
        } else {
            *cfg = fm_kernel_config_default(&key, T);
            snprintf(src, cap, "built-in default (tuning lookup failed: %s)", fm_last_error());
        }
    }
    memset(lc, 0, sizeof *lc);
    lc->pdl = e->sched.pdl;
    if (cfg->path == FM_PATH_SPLITK) {
        const char *why = T > FM_SPLITK_MAX_TOKENS ? "takes at most 16 tokens"
                          : l->Ip > FM_SPLITK_MAX_I ? "takes experts of I up to 512"
                          : l->has_shared && l->SIp != l->Ip ? "needs the shared expert as wide as the routed ones"
                                                             : NULL;
        if (!why) {
            lc->splitk = 1;
            lc->ksplit = cfg->k_split;
            lc->nt = T > 8 ? 2 : 1;
            lc->warps = 8;
            cfg->tile_n = 8 * lc->nt;
            /* one token: gate/up and down in one launch where it fits */
            fm_expert_params ep;
            fill_expert_params(e, l, T, e->shared_enabled, NULL, &ep);
            ep.sms = e->sm_count;
            ep.smem_optin = e->smem_optin;
            lc->fused = fm_cuda_fused1_fits(&ep, 10 * e->cc_major + e->cc_minor);
            return;
        }
        size_t n = strlen(src);
        snprintf(src + n, cap > n ? cap - n : 0, " (splitk path %s: the built-in mma.sync default used)", why);
        *cfg = fm_kernel_config_default_mma(&key, T);
    }
    if (cfg->path == FM_PATH_WGMMA) {
        /* one block shape; passes of 8, 16 or 32 tokens; needs sm_90a code.
         * Elsewhere the mma.sync default runs, and says so. The shape was
         * checked where the config came in (the config file's parser,
         * fm_cuda_engine_set_config, the defaults). */
        const char *why = e->cc_major != 9 ? "needs sm_90" : !e->wgmma ? "is not in this build (no sm_90a code)" : NULL;
        if (!why) {
            lc->nt = cfg->tile_n / 8;
            lc->warps = cfg->warps;
            lc->ksplit = 1;
            lc->wgmma_path = 1;
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
    cfg->stages = 1; /* the register double buffer */
    lc->nt = nt;
    lc->warps = w;
    lc->ksplit = ks;
}

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
    FM_CU(cudaMalloc(&e->done, (FM_ROUTE_COUNTERS + (size_t)E) * sizeof(unsigned)));
    FM_CU(cudaMemset(e->done, 0, (FM_ROUTE_COUNTERS + (size_t)E) * sizeof(unsigned)));
    FM_CU(cudaMalloc(&e->gu_done, (size_t)E * sizeof(unsigned)));
    FM_CU(cudaMemset(e->gu_done, 0, (size_t)E * sizeof(unsigned)));
    FM_CU(cudaMalloc(&e->h, (Tk + T) * hstride * sizeof(uint16_t)));
    FM_CU(cudaMemset(e->h, 0, (Tk + T) * hstride * sizeof(uint16_t)));
    FM_CU(cudaMalloc(&e->stats, (size_t)(nstats > 0 ? nstats : 1) * sizeof(int)));
    e->ws_T = T; e->ws_H = H; e->ws_Hp = Hp; e->ws_E = E; e->ws_k = k; e->ws_hstride = hstride;
    e->stats_n = nstats > 0 ? nstats : 1;
    return fm_cuda_settle("zeroing the engine's workspace");
}

/* The splitk path's workspace for T tokens of layer l in C chunks: grown
 * outside a stream capture only (a capture must find it reserved). */
static fm_status sk_ensure(fm_cuda_engine *e, const fm_cuda_layer *l, int T, int C, cudaStream_t st) {
    /* the kernels index the partials by the workspace's h stride */
    const int hs = e->ws_hstride;
    const size_t pairs = (size_t)T * l->k + T;
    size_t part = (size_t)C * pairs * 2 * hs;
    const int ta = T * l->k < l->E ? T * l->k : l->E;
    size_t cnt = (size_t)(l->has_shared ? l->SIp / 16 : 0) + (size_t)ta * (l->Ip / 16);
    /* the one-token fused kernel: a row of H per expert (unused since its
     * output goes out by atomics) and the shared expert's gate/up chunks; a
     * counter per slot, two per row group (one unused), two */
    const size_t G = (size_t)(l->Ip / 16);
    if (part < (size_t)(ta + 1) * l->H + (size_t)ta * G * 32) part = (size_t)(ta + 1) * l->H + (size_t)ta * G * 32;
    if (cnt < (size_t)ta + 2 * G + 2) cnt = (size_t)ta + 2 * G + 2;
    if (e->sk_part_n >= part && e->sk_cnt_n >= cnt) return FM_OK;
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    FM_CU(cudaStreamIsCapturing(st, &cs));
    if (cs != cudaStreamCaptureStatusNone)
        return fm_error(FM_E_RANGE, "the splitk path's workspace for %d tokens was not reserved before the stream "
                                    "capture (fm_cuda_engine_reserve)", T);
    FM_CU(cudaDeviceSynchronize());
    const size_t np = part > e->sk_part_n ? part : e->sk_part_n, nc = cnt > e->sk_cnt_n ? cnt : e->sk_cnt_n;
    if (e->sk_part) cudaFree(e->sk_part);
    if (e->sk_cnt) cudaFree(e->sk_cnt);
    e->sk_part = NULL; e->sk_cnt = NULL; e->sk_part_n = e->sk_cnt_n = 0;
    FM_CU(cudaMalloc(&e->sk_part, np * sizeof(float)));
    FM_CU(cudaMalloc(&e->sk_cnt, nc * sizeof(unsigned)));
    FM_CU(cudaMemset(e->sk_cnt, 0, nc * sizeof(unsigned)));
    e->sk_part_n = np;
    e->sk_cnt_n = nc;
    return fm_cuda_settle("zeroing the splitk path's counters");
}

static void fill_expert_params(fm_cuda_engine *e, const fm_cuda_layer *l, int T, int shared, float *out,
                               fm_expert_params *p) {
    memset(p, 0, sizeof *p);
    p->gate = l->gate; p->up = l->up; p->down = l->down;
    if (l->has_shared && shared) { p->sgate = l->sgate; p->sup = l->sup; p->sdown = l->sdown; }
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
    p->out = out;
    p->sk_part = e->sk_part;
    p->sk_cnt = e->sk_cnt;
    p->sk_rstride = e->ws_hstride;
}

static float route_scaling(const fm_model_desc *d) {
    if (d->route == FM_ROUTE_NOAUX_TC || d->route == FM_ROUTE_DSV4)
        return d->routed_scaling_factor > 0 ? d->routed_scaling_factor : 1.0f;
    return 1.0f;
}

/* The shared expert's pass width on its own branch (schedule.c). */
static int shared_nt(const fm_cuda_engine *e, const fm_launch_cfg *lc, int T) {
    return fm_sched_shared_nt(&e->sched, lc->wgmma_path, lc->nt, lc->warps, T);
}

/* Whether the routed down takes over per expert at T tokens. */
static int handoff_on(const fm_cuda_engine *e, const fm_launch_cfg *lc, int T) {
    return fm_sched_handoff(&e->sched, lc->wgmma_path && lc->pdl, T);
}

/* What one layer call reads and writes, all in device memory. */
typedef struct {
    const void *x;        /* [T][H] of xdt                                    */
    int xdt;
    const int32_t *tok;   /* [T] token ids (hash routing) or NULL             */
    const int32_t *pre_ids; /* pre-routed [T][k] ids, or NULL: route here     */
    const float *pre_wts;
    float *out;           /* [T][H]                                           */
    int32_t *ids;         /* [T][k] the chosen ids (the grouping reads them)  */
    float *wts;
    int *stat;            /* n_active (bench) or NULL                         */
    int shared;           /* run the shared expert                            */
} layer_io;

/* The one-token launch's top-k on a kernel line: inside it, or the
 * selection kernel before it and why, as run_layer decides for a call with
 * the shared expert (and the token ids, where the layer is hash-routed). */
static void append_topk(fm_cuda_engine *e, const fm_cuda_layer *l, int T, const fm_launch_cfg *lc, char *buf, size_t cap) {
    if (!lc->splitk || !lc->fused || !e->shared_enabled) return;
    fm_expert_params ep;
    fill_expert_params(e, l, T, 1, NULL, &ep);
    const char *why = fm_sched_fused1_selects(l->d.route, l->hash, l->E);
    const size_t n = strlen(buf);
    if (n >= cap) return;
    if (!why) snprintf(buf + n, cap - n, "; top-k: inside the one-token launch (no selection kernel)");
    else snprintf(buf + n, cap - n, "; top-k: the selection kernel before the one-token launch (%s)", why);
}

/* The launches of one layer on stream st. ev (phase timing, host calls
 * only): events between the routing and the two expert launches, on one
 * stream. */
static fm_status run_layer(fm_cuda_engine *e, const fm_cuda_layer *l, int T, const layer_io *io, const fm_launch_cfg *lc,
                           cudaEvent_t *ev, int parts, cudaStream_t st) {
    fm_route_params rp;
    memset(&rp, 0, sizeof rp);
    rp.route = l->d.route;
    rp.E = l->E; rp.k = l->k; rp.H = l->H; rp.Hp = l->Hp; rp.T = T;
    rp.n_group = l->d.n_group; rp.topk_group = l->d.topk_group;
    rp.norm_topk = l->d.norm_topk_prob;
    rp.scaling = route_scaling(&l->d);
    rp.hash = l->hash && io->tok != NULL;
    rp.router_w = l->router_w; rp.router_wb = l->router_wb; rp.router_bias = l->router_bias; rp.score_bias = l->score_bias;
    rp.tid2eid = l->tid2eid; rp.tid_rows = l->tid_rows;
    rp.x = io->x; rp.xdt = io->xdt; rp.token_ids = io->tok;
    rp.pre_ids = io->pre_ids; rp.pre_wts = io->pre_wts;
    rp.logits = e->logits;
    rp.sms = e->sm_count;
    rp.blas = e->blas;
    rp.ids = io->ids; rp.wts = io->wts; rp.x_prep = e->x_prep; rp.out = io->out;
    rp.n_active = e->n_active; rp.act_e = e->act_e; rp.act_off = e->act_off; rp.act_cnt = e->act_cnt;
    rp.sorted_tok = e->sorted_tok; rp.sorted_w = e->sorted_w; rp.done = e->done; rp.stat_active = io->stat;
    const size_t smem = fm_cuda_route_smem(l->H, l->E);
    if (smem > e->route_smem_ok) {
        fm_status s = fm_cuda_route_prepare(smem);
        if (s) return s;
        e->route_smem_ok = smem;
    }
    fm_expert_params ep;
    fm_status s0;
    fill_expert_params(e, l, T, io->shared, io->out, &ep);
    ep.sms = e->sm_count;
    ep.smem_optin = e->smem_optin;
    /* the shared expert on its own branch: forked once the first launch
     * has written the tokens' prep and zeroed the output, joined after the
     * routed down (phase timing keeps one stream) */
    if (lc->splitk) {
        /* one stream: the shared expert's gate/up warps run beside the
         * selection inside the first launch */
        if ((parts & FM_ROUTE_PART_EXPERTS) && (s0 = sk_ensure(e, l, T, lc->ksplit, st))) return s0;
        ep.sk_part = e->sk_part;
        ep.sk_cnt = e->sk_cnt;
        rp.early_trigger = lc->pdl ? 2 : 0;
        /* one token in one launch that also selects its top-k: the logits
         * kernel, then that launch (no selection kernel between) */
        const int fused = lc->fused && ep.sgate.n;
        const int sel = fused && !ev && parts == FM_ROUTE_PARTS_ALL && fm_cuda_fused1_selects(&ep, &rp);
        if (ev) FM_CU(cudaEventRecord(ev[0], st));
        if ((s0 = fm_cuda_launch_route(&rp, smem, lc->pdl, sel ? FM_ROUTE_PART_LOGITS : parts, st))) return s0;
        if (!(parts & FM_ROUTE_PART_EXPERTS)) return FM_OK;
        if (ev) FM_CU(cudaEventRecord(ev[1], st));
        if ((s0 = fm_cuda_launch_splitk(&ep, lc->ksplit, lc->nt, fused, sel ? &rp : NULL, lc->pdl, st))) return s0;
        if (ev) {
            FM_CU(cudaEventRecord(ev[2], st));
            FM_CU(cudaEventRecord(ev[3], st));
        }
        return FM_OK;
    }
    const int fork = e->sched.sh_fork && ep.sgate.n > 0 && !ev && (parts & FM_ROUTE_PART_EXPERTS) &&
                     (parts & FM_ROUTE_PART_LOGITS) && (parts & FM_ROUTE_PART_SELECT);
    rp.early_trigger = lc->pdl ? fm_sched_trigger(&e->sched, fork) : 0;
    /* the selection zeroes the experts' gate/up counters that the routed
     * down's blocks wait on; not with the phase timing's events between
     * the launches */
    rp.gu_done = handoff_on(e, lc, T) && !ev ? e->gu_done : NULL;
    fm_status s;
    if (ev) FM_CU(cudaEventRecord(ev[0], st));
    if (fork) {
        if ((s = fm_cuda_launch_route(&rp, smem, lc->pdl, FM_ROUTE_PART_LOGITS, st))) return s;
        FM_CU(cudaEventRecord(e->fork_ev, st));
        /* the selection is captured before the branch, so that a graph does
         * not queue it behind the shared expert's launches */
        if ((s = fm_cuda_launch_route(&rp, smem, lc->pdl, FM_ROUTE_PART_SELECT, st))) return s;
        FM_CU(cudaStreamWaitEvent(e->side, e->fork_ev, 0));
        fm_expert_params sp = ep;
        sp.max_active = 0; /* the shared expert's items only */
        sp.gu_done = NULL;
        fm_launch_cfg slc = *lc;
        slc.nt = shared_nt(e, lc, T);
        fm_launch_cfg sdc = slc;
        slc.pdl = 0; /* its first launch waits on an event, not on a kernel */
        if ((s = fm_cuda_launch_gateup(&sp, &slc, e->side))) return s;
        if ((s = fm_cuda_launch_down(&sp, &sdc, e->side))) return s;
        FM_CU(cudaEventRecord(e->join_ev, e->side));
        ep.sgate.n = ep.sup.n = ep.sdown.n = 0; /* the routed experts only */
        ep.gu_done = rp.gu_done;
        if ((s = fm_cuda_launch_gateup(&ep, lc, st))) return s;
        if ((s = fm_cuda_launch_down(&ep, lc, st))) return s;
        FM_CU(cudaStreamWaitEvent(st, e->join_ev, 0));
        return FM_OK;
    }
    if ((s = fm_cuda_launch_route(&rp, smem, lc->pdl, parts, st))) return s;
    if (!(parts & FM_ROUTE_PART_EXPERTS)) return FM_OK;
    ep.gu_done = rp.gu_done;
    if (ev) FM_CU(cudaEventRecord(ev[1], st));
    if ((s = fm_cuda_launch_gateup(&ep, lc, st))) return s;
    if (ev) FM_CU(cudaEventRecord(ev[2], st));
    if ((s = fm_cuda_launch_down(&ep, lc, st))) return s;
    if (ev) FM_CU(cudaEventRecord(ev[3], st));
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
    if (l->no_router)
        return fm_error(FM_E_ARG, "fm_cuda_forward: layer %d was made without a router: only the pre-routed call "
                                  "(fm_cuda_experts) runs it", l->layer);
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
    const layer_io io = {e->x_raw, xdt, l->hash ? e->tok_ids : NULL, NULL, NULL, e->out, e->ids, e->wts, e->stats,
                         e->shared_enabled};
    s = run_layer(e, l, T, &io, &lc, e->pt ? ev : NULL, FM_ROUTE_PARTS_ALL, e->stream);
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
        /* the one-token launch: down inside gate/up's launch */
        if (lc.splitk && lc.fused && e->shared_enabled) e->pt->fused_mask |= 1u << FM_PH_DOWN;
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
        for (int i = 0; i < n_layers && !cs; i++) {
            const layer_io io = {e->x_raw,  e->bench_xdt, layers[i]->hash ? e->tok_ids : NULL, NULL, NULL, e->out,
                                 e->ids,    e->wts,    e->stats + i, e->shared_enabled};
            cs = run_layer(e, layers[i], T, &io, lc, NULL, parts, e->stream);
        }
        err = cudaStreamEndCapture(e->stream, &graph);
        if (cs) { if (graph) cudaGraphDestroy(graph); return cs; }
        if (err == cudaSuccess)
            err = cudaGraphInstantiateWithFlags(&exec, graph, 0);
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
    {
        fm_kernel_config c0;
        fm_launch_cfg l0;
        char src0[512];
        for (int i = 0; i < n_layers && !s; i++) {
            choose_cfg(e, layers[i], T, &c0, &l0, src0, sizeof src0);
            if (l0.splitk) s = sk_ensure(e, layers[i], T, l0.ksplit, e->stream);
        }
        if (s) return s;
    }
    /* activations ~ N(0, 1) and token ids, both from the seed */
    float *hx = (float *)malloc(sizeof(float) * (size_t)T * H);
    int32_t *ht = (int32_t *)malloc(sizeof(int32_t) * (size_t)T);
    if (!hx || !ht) { free(hx); free(ht); return fm_error(FM_E_NOMEM, "out of memory"); }
    uint64_t kx = fm_hash_str("bench.x"), kt = fm_hash_str("bench.token_ids");
    for (int64_t i = 0; i < (int64_t)T * H; i++) hx[i] = fm_rng_normal(seed, kx, (uint64_t)i);
    for (int t = 0; t < T; t++) ht[t] = vocab > 0 ? (int32_t)(fm_rng_u64(seed, kt, (uint64_t)t) % (uint64_t)vocab) : 0;
    /* in the benchmark's type, the same values rounded (x_raw holds T x H floats) */
    cudaError_t err;
    if (e->bench_xdt != FM_DT_F32) {
        uint16_t *h16 = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)T * H);
        if (!h16) { free(hx); free(ht); return fm_error(FM_E_NOMEM, "out of memory"); }
        for (int64_t i = 0; i < (int64_t)T * H; i++)
            h16[i] = e->bench_xdt == FM_DT_BF16 ? fm_f32_to_bf16(hx[i]) : fm_f32_to_f16(hx[i]);
        err = cudaMemcpy(e->x_raw, h16, sizeof(uint16_t) * (size_t)T * H, cudaMemcpyHostToDevice);
        free(h16);
    } else {
        err = cudaMemcpy(e->x_raw, hx, sizeof(float) * (size_t)T * H, cudaMemcpyHostToDevice);
    }
    if (err == cudaSuccess) err = cudaMemcpy(e->tok_ids, ht, sizeof(int32_t) * (size_t)T, cudaMemcpyHostToDevice);
    free(hx);
    free(ht);
    if (err != cudaSuccess) return fm_error(FM_E_CUDA, "cudaMemcpy: %s", cudaGetErrorString(err));
    if ((s = fm_cuda_settle("uploading the benchmark's activations"))) return s;

    fm_kernel_config cfg;
    fm_launch_cfg lc;
    choose_cfg(e, layers[0], T, &cfg, &lc, r->config_source, sizeof r->config_source);
    r->cfg = cfg;
    fm_cuda_kernel_names(&lc, layers[0]->fmt == FM_QF_MXFP4, r->kernel, sizeof r->kernel);
    if (e->shared_enabled && e->sched.sh_fork && layers[0]->SIp > 0 && !lc.splitk) {
        size_t n = strlen(r->kernel);
        snprintf(r->kernel + n, sizeof r->kernel - n, "; shared expert on its own stream, %d tokens per pass",
                 8 * shared_nt(e, &lc, T));
    }
    if (handoff_on(e, &lc, T)) {
        size_t n = strlen(r->kernel);
        snprintf(r->kernel + n, sizeof r->kernel - n, "; down starts per expert as its gate/up ends");
    }
    if (lc.wgmma_path && !lc.splitk) {
        /* the routed down launch as run_layer makes it */
        fm_expert_params ep;
        fill_expert_params(e, layers[0], T, e->shared_enabled, NULL, &ep);
        ep.sms = e->sm_count;
        ep.smem_optin = e->smem_optin;
        if (e->sched.sh_fork && ep.sgate.n > 0) ep.sgate.n = ep.sup.n = ep.sdown.n = 0;
        const int ch = fm_cuda_down_chunks(&ep, &lc), ks = fm_cuda_gateup_ksplit(&ep, &lc);
        size_t n = strlen(r->kernel);
        if (ks > 1) n += (size_t)snprintf(r->kernel + n, sizeof r->kernel - n, "; routed gate/up K over %d blocks", ks);
        if (ch > 1 && n < sizeof r->kernel)
            snprintf(r->kernel + n, sizeof r->kernel - n, "; routed down blocks of %d row chunks", ch);
    }
    {
        size_t n = strlen(r->kernel);
        snprintf(r->kernel + n, sizeof r->kernel - n, "; router logits: %s",
                 fm_cuda_route_logits_name(T, layers[0]->H, layers[0]->E, e->sm_count, layers[0]->router_wb != NULL,
                                           e->bench_xdt, e->blas != NULL));
    }
    append_topk(e, layers[0], T, &lc, r->kernel, sizeof r->kernel);

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


/* ------------------------------------------- calls on caller-owned memory */

/* What a call on caller-owned memory launches with at one batch size: an
 * entry of the layer's table (cfg_cache.h), resolved by choose_cfg. */
typedef struct {
    fm_kernel_config cfg;
    fm_launch_cfg lc;
    char src[512];
} call_cfg;

typedef struct {
    fm_cuda_engine *e;
    const fm_cuda_layer *l;
} call_ctx;

static void resolve_call_cfg(void *ctx, int T, void *entry) {
    const call_ctx *c = (const call_ctx *)ctx;
    call_cfg *cc = (call_cfg *)entry;
    choose_cfg(c->e, c->l, T, &cc->cfg, &cc->lc, cc->src, sizeof cc->src);
}

/* The table of batches 1 .. cap for the engine's current config. */
static fm_status fill_call_cfgs(fm_cuda_engine *e, const fm_cuda_layer *l, int cap) {
    call_ctx ctx = {e, l};
    return fm_cfg_cache_fill(&l->cc, cap, sizeof(call_cfg), e->cfg_gen, resolve_call_cfg, &ctx);
}

/* The launch config of a call at T tokens: the layer's table, filled by
 * fm_cuda_engine_reserve (or here, once, for a layer that was not reserved
 * with, or after fm_cuda_engine_set_config). */
static const call_cfg *call_config(fm_cuda_engine *e, const fm_cuda_layer *l, int T, fm_status *s) {
    *s = FM_OK;
    if (l->cc.cap < T || l->cc.gen != e->cfg_gen) {
        int cap = e->ws_T > T ? e->ws_T : T;
        if (l->cc.cap > cap) cap = l->cc.cap;
        if ((*s = fill_call_cfgs(e, l, cap))) return NULL;
    }
    return (const call_cfg *)fm_cfg_cache_get(&l->cc, T);
}

long fm_cuda_layer_config_lookups(const fm_cuda_layer *l) { return l ? l->cc.resolves : 0; }

fm_status fm_cuda_layer_call_config(fm_cuda_engine *e, const fm_cuda_layer *l, int T, fm_kernel_config *cfg,
                                    char *kernel, size_t kernel_cap, char *source, size_t source_cap) {
    if (!e || !l) return fm_error(FM_E_ARG, "fm_cuda_layer_call_config: NULL argument");
    if (l->eng != e) return fm_error(FM_E_ARG, "fm_cuda_layer_call_config: the layer belongs to another engine");
    if (T < 1 || T > (1 << 20)) return fm_error(FM_E_RANGE, "fm_cuda_layer_call_config: %d tokens", T);
    call_cfg one;
    const call_cfg *c = NULL;
    if (T <= (l->cc.cap > e->ws_T ? l->cc.cap : e->ws_T)) {
        fm_status s;
        if (!(c = call_config(e, l, T, &s))) return s;
    } else { /* beyond what a call can take: resolved alone, the table untouched */
        memset(&one, 0, sizeof one);
        choose_cfg(e, l, T, &one.cfg, &one.lc, one.src, sizeof one.src);
        c = &one;
    }
    if (cfg) *cfg = c->cfg;
    if (kernel && kernel_cap) {
        fm_cuda_kernel_names(&c->lc, l->fmt == FM_QF_MXFP4, kernel, kernel_cap);
        append_topk(e, l, T, &c->lc, kernel, kernel_cap);
    }
    if (source && source_cap) snprintf(source, source_cap, "%s", c->src);
    return FM_OK;
}


static int layer_hstride(const fm_cuda_layer *l) { return l->Ip > l->SIp ? l->Ip : l->SIp; }

fm_status fm_cuda_engine_reserve(fm_cuda_engine *e, const fm_cuda_layer *l, int max_T) {
    if (!e || !l) return fm_error(FM_E_ARG, "fm_cuda_engine_reserve: NULL argument");
    if (l->eng != e) return fm_error(FM_E_ARG, "fm_cuda_engine_reserve: the layer belongs to another engine");
    if (max_T <= 0 || max_T > (1 << 20))
        return fm_error(FM_E_RANGE, "fm_cuda_engine_reserve: %d tokens (1 .. %d)", max_T, 1 << 20);
    FM_CU(cudaSetDevice(e->device));
    fm_status s = ws_ensure(e, max_T, l->H, l->Hp, l->E, l->k, layer_hstride(l), 1);
    /* the splitk path's buffers for its largest call, where it can run */
    if (!s && l->Ip <= FM_SPLITK_MAX_I && (!l->has_shared || l->SIp == l->Ip))
        s = sk_ensure(e, l, max_T < FM_SPLITK_MAX_TOKENS ? max_T : FM_SPLITK_MAX_TOKENS, FM_SPLITK_MAX_C, e->stream);
    /* the configs of every batch up to max_T, looked up now rather than per call */
    if (!s && (l->cc.cap < max_T || l->cc.gen != e->cfg_gen)) s = fill_call_cfgs(e, l, max_T);
    return s;
}

/* What every call on caller-owned memory checks on the host: no data is
 * read, so the check costs no synchronization. */
static fm_status device_call_check(const fm_cuda_engine *e, const fm_cuda_layer *l, const void *x, fm_dtype xdt,
                                   int T, const float *out, const char *what) {
    if (!e || !l || !x || !out) return fm_error(FM_E_ARG, "%s: NULL argument", what);
    if (l->eng != e) return fm_error(FM_E_ARG, "%s: the layer belongs to another engine", what);
    if (T <= 0) return fm_error(FM_E_ARG, "%s: T = %d tokens", what, T);
    if (xdt != FM_DT_F32 && xdt != FM_DT_BF16 && xdt != FM_DT_F16)
        return fm_error(FM_E_ARG, "%s: activations must be F32, BF16 or F16, not %s", what, fm_dtype_name(xdt));
    /* the kernels read x and zero out with 16-byte accesses */
    if ((uintptr_t)x % 16 || (uintptr_t)out % 16)
        return fm_error(FM_E_ARG, "%s: x and out must be 16-byte aligned", what);
    if (e->ws_T < T || e->ws_H < l->H || e->ws_Hp < l->Hp || e->ws_E < l->E || e->ws_k < l->k ||
        e->ws_hstride < layer_hstride(l))
        return fm_error(FM_E_RANGE,
                        "%s: %d tokens of this layer need a reserved workspace (fm_cuda_engine_reserve; %d tokens "
                        "reserved)",
                        what, T, e->ws_T);
    return FM_OK;
}

fm_status fm_cuda_moe(fm_cuda_engine *e, const fm_cuda_layer *l, const void *x, fm_dtype xdt, int T,
                      const int32_t *token_ids, float *out, int32_t *topk_ids, float *topk_weights, void *stream) {
    fm_status s = device_call_check(e, l, x, xdt, T, out, "fm_cuda_moe");
    if (s) return s;
    if (l->hash && !token_ids)
        return fm_error(FM_E_ARG, "fm_cuda_moe: layer %d of %s routes by token id (hash layer): token ids are required",
                        l->layer, l->d.family);
    if (l->no_router)
        return fm_error(FM_E_ARG, "fm_cuda_moe: layer %d was made without a router: only the pre-routed call "
                                  "(fm_cuda_experts) runs it", l->layer);
    if ((topk_ids == NULL) != (topk_weights == NULL))
        return fm_error(FM_E_ARG, "fm_cuda_moe: topk_ids and topk_weights go together (both or neither)");
    const call_cfg *cc = call_config(e, l, T, &s);
    if (!cc) return s;
    FM_CU(cudaSetDevice(e->device));
    const layer_io io = {x,       xdt, l->hash ? token_ids : NULL, NULL, NULL, out, topk_ids ? topk_ids : e->ids,
                         topk_ids ? topk_weights : e->wts, NULL, e->shared_enabled};
    return run_layer(e, l, T, &io, &cc->lc, NULL, FM_ROUTE_PARTS_ALL, (cudaStream_t)stream);
}

fm_status fm_cuda_experts(fm_cuda_engine *e, const fm_cuda_layer *l, const void *x, fm_dtype xdt, int T,
                          const int32_t *topk_ids, const float *topk_weights, int include_shared, float *out,
                          void *stream) {
    fm_status s = device_call_check(e, l, x, xdt, T, out, "fm_cuda_experts");
    if (s) return s;
    if (!topk_ids || !topk_weights) return fm_error(FM_E_ARG, "fm_cuda_experts: NULL topk_ids or topk_weights");
    const call_cfg *cc = call_config(e, l, T, &s);
    if (!cc) return s;
    FM_CU(cudaSetDevice(e->device));
    const layer_io io = {x, xdt, NULL, topk_ids, topk_weights, out, e->ids, e->wts, NULL, include_shared != 0};
    return run_layer(e, l, T, &io, &cc->lc, NULL, FM_ROUTE_PARTS_ALL, (cudaStream_t)stream);
}
