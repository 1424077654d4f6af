/* `fp4moe profile`'s measurement: every batch size, a few decode steps each
 * (a step runs every MoE layer of the model once), phase times from the
 * engine, telemetry in the background, and the numbers the model needs
 * (bandwidth, compute peak, active experts, tile fill). */
#include "prof/prof_internal.h"
#include "io/io_internal.h"
#include "parallel/parallel_internal.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define MAX_BATCH_TOKENS 65536
#define DEFAULT_CPU_PROBE (256u << 20)
#define DEFAULT_GPU_PROBE ((size_t)4096 << 20)

void fm_prof_opts_default(fm_prof_opts *o) {
    memset(o, 0, sizeof *o);
    o->fmt = FM_QF_NONE;
    o->device = FM_DEV_CPU;
    o->steps = 3;
    o->warmup = 1;
    o->seed = 1;
    o->period_ms = 20;
    o->read_power_s = 2.5;
}

/* --------------------------------------------------- compute peak (CPU) */

#if defined(__x86_64__) && defined(__GNUC__)
/* Eight independent FMA chains: enough to cover the FMA latency on two
 * ports, so the loop runs at the core's FMA throughput. */
__attribute__((target("avx512f"))) static float fma_avx512(long iters) {
    __m512 a[8], m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
    for (int j = 0; j < 8; j++) a[j] = _mm512_set1_ps((float)j);
    for (long i = 0; i < iters; i++)
        for (int j = 0; j < 8; j++) a[j] = _mm512_fmadd_ps(a[j], m, c);
    float s = 0;
    for (int j = 0; j < 8; j++) s += _mm512_reduce_add_ps(a[j]);
    return s;
}
__attribute__((target("avx2,fma"))) static float fma_avx2(long iters) {
    __m256 a[8], m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
    for (int j = 0; j < 8; j++) a[j] = _mm256_set1_ps((float)j);
    for (long i = 0; i < iters; i++)
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(a[j], m, c);
    float out[8], s = 0;
    for (int j = 0; j < 8; j++) {
        _mm256_storeu_ps(out, a[j]);
        for (int q = 0; q < 8; q++) s += out[q];
    }
    return s;
}
#endif

static float fma_scalar(long iters) {
    float a[8], m = 0.999999f, c = 1e-7f;
    for (int j = 0; j < 8; j++) a[j] = (float)j;
    for (long i = 0; i < iters; i++)
        for (int j = 0; j < 8; j++) a[j] = a[j] * m + c;
    return a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7];
}

typedef struct {
    int lanes; /* floats per vector, 0 = scalar */
    long iters;
    volatile float sink;
} peak_job;

static void *peak_thread(void *arg) {
    peak_job *j = arg;
#if defined(__x86_64__) && defined(__GNUC__)
    if (j->lanes == 16) { j->sink = fma_avx512(j->iters); return NULL; }
    if (j->lanes == 8) { j->sink = fma_avx2(j->iters); return NULL; }
#endif
    j->sink = fma_scalar(j->iters);
    return NULL;
}

double fm_prof_cpu_peak_flops(int n_threads, char *note, size_t cap) {
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    if (n_threads <= 0) n_threads = ncpu > 0 ? (int)ncpu : 1;
    if (n_threads > 256) n_threads = 256;
    int lanes = 1;
    const char *isa = "scalar";
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) { lanes = 16; isa = "AVX-512"; }
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) { lanes = 8; isa = "AVX2"; }
#endif
    /* Scalar code is not fused here (-ffp-contract=off under -std=c11): a
     * multiply and an add, still 2 FLOPs per element. */
    long iters = lanes >= 8 ? 4000000 : 2000000;
    peak_job jobs[256];
    pthread_t th[256];
    uint64_t t0 = fm_now_ns();
    int started = 0;
    for (int i = 0; i < n_threads; i++) {
        jobs[i].lanes = lanes == 1 ? 0 : lanes;
        jobs[i].iters = iters;
        if (pthread_create(&th[i], NULL, peak_thread, &jobs[i]) != 0) break;
        started++;
    }
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    double s = (double)(fm_now_ns() - t0) * 1e-9;
    double flops = (double)started * iters * 8.0 * lanes * 2.0;
    if (note && cap)
        snprintf(note, cap, "measured: %s FP32 %s, %d thread%s", isa, lanes > 1 ? "FMA" : "multiply-add", started,
                 started == 1 ? "" : "s");
    return s > 0 ? flops / s : 0;
}

/* ------------------------------------------------------------ helpers */

static double now_s(uint64_t t0) { return (double)(fm_now_ns() - t0) * 1e-9; }
static double us_since(uint64_t t0, uint64_t t) { return (double)(int64_t)(t - t0) * 1e-3; }

static void add_span(fm_profile *p, uint64_t t0, uint64_t a, uint64_t b, int pid, int tid, int bi, int kind, int phase,
                     const char *name) {
    fm_prof_span s;
    memset(&s, 0, sizeof s);
    s.t_us = us_since(t0, a);
    s.dur_us = b > a ? (double)(b - a) * 1e-3 : 0;
    s.pid = pid;
    s.tid = tid;
    s.batch_index = bi;
    s.kind = kind;
    s.phase = phase;
    s.step = -1;
    snprintf(s.name, sizeof s.name, "%s", name);
    fm_profile_add_span(p, &s);
}

/* Bytes-per-second of a GPU's BF16 dense tensor cores, for the roofline's
 * compute roof (vendor datasheets; 0 when the GPU is not in the table). */
static double gpu_peak(const char *desc, char *note, size_t cap) {
    static const struct { const char *name; double tflops; } k[] = {
        {"H200", 989.0}, {"H100", 989.0}, {"H800", 989.0}, {"H20", 148.0}, {"B200", 2250.0},
        {"A100", 312.0}, {"A800", 312.0}, {"L40S", 362.0}, {"RTX PRO 6000", 500.0},
    };
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++)
        if (desc && strstr(desc, k[i].name)) {
            snprintf(note, cap, "%s BF16 dense tensor-core peak from the datasheet", k[i].name);
            return k[i].tflops * 1e12;
        }
    snprintf(note, cap, "GPU not in the peak table; pass --peak-gflops");
    return 0;
}

static int count_distinct(const int32_t *ids, int n, int E, uint8_t *seen) {
    memset(seen, 0, (size_t)E);
    int c = 0;
    for (int i = 0; i < n; i++)
        if (ids[i] >= 0 && ids[i] < E && !seen[ids[i]]) {
            seen[ids[i]] = 1;
            c++;
        }
    return c;
}

static fm_status check_opts(const fm_prof_opts *o) {
    if (!!o->model_dir == !!o->preset) return fm_error(FM_E_ARG, "profile: give exactly one of --model DIR or --preset NAME");
    if (o->n_batch < 1 || o->n_batch > FM_PROF_MAX_BATCH)
        return fm_error(FM_E_RANGE, "profile: %d batch sizes (1 to %d)", o->n_batch, FM_PROF_MAX_BATCH);
    for (int i = 0; i < o->n_batch; i++)
        if (o->batches[i] < 1 || o->batches[i] > MAX_BATCH_TOKENS)
            return fm_error(FM_E_RANGE, "profile: batch %d outside [1, %d]", o->batches[i], MAX_BATCH_TOKENS);
    if (o->steps < 1 || o->steps > 100000) return fm_error(FM_E_RANGE, "profile: %d steps (1 to 100000)", o->steps);
    if (o->warmup < 0 || o->warmup > 1000) return fm_error(FM_E_RANGE, "profile: %d warm-up steps (0 to 1000)", o->warmup);
    if (o->layers < 0 || o->step_layers < 0 || o->threads < 0 || o->tile_n < 0)
        return fm_error(FM_E_RANGE, "profile: negative layer, thread or tile count");
    if (!(o->bandwidth_Bps >= 0) || !(o->peak_flops >= 0)) return fm_error(FM_E_RANGE, "profile: bad bandwidth or peak");
    if (o->period_ms < 1 || o->period_ms > 60000) return fm_error(FM_E_RANGE, "profile: telemetry period %d ms", o->period_ms);
    if (!(o->read_power_s == 0 || (o->read_power_s >= FM_PROF_READ_SETTLE_S + 0.5 && o->read_power_s <= 60)))
        return fm_error(FM_E_RANGE, "profile: a sustained read of %g s (0, or %.1f to 60)", o->read_power_s,
                        FM_PROF_READ_SETTLE_S + 0.5);
    if (o->device != FM_DEV_CPU && o->device != FM_DEV_CUDA) return fm_error(FM_E_ARG, "profile: unknown device");
    return FM_OK;
}

/* What both device paths share: the model, its layers' indices, the
 * profile being filled. */
typedef struct {
    const fm_prof_opts *o;
    fm_model_desc d;      /* the layer profiled: a shard's shape            */
    fm_model_desc full;   /* the whole model                                */
    const fm_shard *shard;
    fm_ckpt *ckpt;
    fm_profile *p;
    uint64_t t0;
    int *moe_idx; /* MoE layer indices of the model */
    int n_moe;
    int nvml;     /* the telemetry reads the GPU's power */
} run_ctx;

static void progress(const run_ctx *c, const char *fmt, const char *a, int b) {
    if (!c->o->progress) return;
    fprintf(c->o->progress, "profile: ");
    fprintf(c->o->progress, fmt, a, b);
    fprintf(c->o->progress, "\n");
    fflush(c->o->progress);
}

/* Checkpoints from `gen` or partial downloads hold a few layers: a layer is
 * present when some tensor is named "...layers.<idx>.". Deciding this from
 * the names (not from a failed bind) keeps a broken shard's error visible. */
static int layer_present(fm_ckpt *ck, int idx) {
    char pat[48];
    snprintf(pat, sizeof pat, "layers.%d.", idx);
    for (size_t i = 0; i < fm_ckpt_count(ck); i++) {
        const char *n = fm_ckpt_name_at(ck, i);
        for (const char *q = n ? strstr(n, pat) : NULL; q; q = strstr(q + 1, pat))
            if (q == n || q[-1] == '.') return 1;
    }
    return 0;
}

/* Binds or generates up to `want` distinct MoE layers (host memory). */
static fm_status host_layers(run_ctx *c, int want, fm_moe_layer ***out, int *n_out) {
    fm_moe_layer **ls = fm_calloc((size_t)want, sizeof *ls);
    if (!ls) return FM_E_NOMEM;
    int n = 0;
    fm_status st = FM_OK;
    for (int i = 0; i < c->n_moe && n < want; i++) {
        if (c->ckpt) {
            if (!layer_present(c->ckpt, c->moe_idx[i])) continue;
            fm_qformat q = c->o->fmt == FM_QF_NVFP4 || c->o->fmt == FM_QF_MXFP4 ? c->o->fmt : FM_QF_NONE;
            st = fm_moe_layer_bind(c->ckpt, &c->full, c->moe_idx[i], q, &ls[n]);
        } else {
            st = fm_moe_layer_random(&c->full, c->p->fmt, c->o->seed, c->moe_idx[i], &ls[n]);
        }
        if (st == FM_OK && c->shard && c->shard->mode == FM_DIST_TP) { /* the rank's slices own the full layer */
            fm_moe_layer *full = ls[n];
            st = fm_shard_tp_layer(&c->full, &full, c->shard, NULL, &ls[n]);
            if (st != FM_OK) fm_moe_layer_free(full);
        }
        if (st != FM_OK) break;
        n++;
    }
    if (st == FM_OK && n == 0)
        st = fm_error(FM_E_NOTFOUND, "%s: no MoE layer of the model is in the checkpoint", c->o->model_dir);
    if (st != FM_OK) {
        for (int i = 0; i < n; i++) fm_moe_layer_free(ls[i]);
        free(ls);
        return st;
    }
    *out = ls;
    *n_out = n;
    return FM_OK;
}

/* Random activations and token ids of one step (seeded, so runs repeat). */
static void fill_inputs(const run_ctx *c, int B, int step, float *x, int32_t *tok) {
    uint64_t key = fm_hash_str("profile.x") + (uint64_t)B * 1000003u + (uint64_t)step;
    for (int64_t i = 0; i < (int64_t)B * c->d.hidden; i++) x[i] = fm_rng_normal(c->o->seed, key, (uint64_t)i);
    int vocab = c->d.vocab_size > 0 ? c->d.vocab_size : 1;
    for (int t = 0; t < B; t++) tok[t] = (int32_t)(fm_rng_u64(c->o->seed, key ^ 0x5a5a5a5au, (uint64_t)t) % (uint64_t)vocab);
}

/* One step's inputs and outputs for up to B tokens (host memory). */
typedef struct {
    float *x, *out, *w;
    int32_t *ids, *tok;
} step_io;

static void io_free(step_io *s) {
    free(s->x);
    free(s->out);
    free(s->w);
    free(s->ids);
    free(s->tok);
    memset(s, 0, sizeof *s);
}

static fm_status io_alloc(step_io *s, const fm_model_desc *d, int B) {
    const size_t H = (size_t)d->hidden, k = (size_t)d->topk;
    s->x = fm_malloc((size_t)B * H * sizeof *s->x);
    s->out = fm_malloc((size_t)B * H * sizeof *s->out);
    s->w = fm_malloc((size_t)B * k * sizeof *s->w);
    s->ids = fm_malloc((size_t)B * k * sizeof *s->ids);
    s->tok = fm_malloc((size_t)B * sizeof *s->tok);
    if (s->x && s->out && s->w && s->ids && s->tok) return FM_OK;
    io_free(s);
    return FM_E_NOMEM;
}

/* Distinct layers in memory: --layers, else up to two of the model's. */
static int layers_wanted(const run_ctx *c) { return c->o->layers > 0 ? c->o->layers : (c->n_moe < 2 ? c->n_moe : 2); }

static int is_ep(const run_ctx *c) { return c->shard && c->shard->mode == FM_DIST_EP; }

/* An EP rank's inputs of one step: the full routing of x by every distinct
 * layer's router (ids / w [n][B][k], k the full model's), the rank's view
 * of it for each of the step's layers (lids / lw [layers_per_step][B][kl])
 * and the load each distinct layer's routing puts on every rank. */
typedef struct {
    int32_t *ids, *lids;
    float *w, *lw;
    fm_shard_load *load;
} ep_route;

static void ep_route_free(ep_route *r) {
    free(r->ids);
    free(r->lids);
    free(r->w);
    free(r->lw);
    free(r->load);
    memset(r, 0, sizeof *r);
}

/* For up to B tokens, n distinct layers, L layers a step (lids: 0 for none). */
static fm_status ep_route_alloc(ep_route *r, const run_ctx *c, int B, int n, int L) {
    const size_t k = (size_t)c->full.topk, kl = (size_t)c->d.topk;
    memset(r, 0, sizeof *r);
    r->ids = fm_malloc((size_t)n * B * k * sizeof *r->ids);
    r->w = fm_malloc((size_t)n * B * k * sizeof *r->w);
    r->load = fm_calloc((size_t)n, sizeof *r->load);
    if (L > 0) {
        r->lids = fm_malloc((size_t)L * B * kl * sizeof *r->lids);
        r->lw = fm_malloc((size_t)L * B * kl * sizeof *r->lw);
    }
    if (r->ids && r->w && r->load && (L == 0 || (r->lids && r->lw))) return FM_OK;
    ep_route_free(r);
    return FM_E_NOMEM;
}

/* Routes x [B, H] by the full routers of layers[0..n) on the host (as the
 * sharded layer does before the rank's pre-routed call) and counts the
 * loads; with lids, maps each of the step's L layers to the rank's view. */
static fm_status ep_route_step(ep_route *r, const run_ctx *c, fm_moe_layer *const *layers, int n, int L,
                               const float *x, const int32_t *tok, int B) {
    const size_t k = (size_t)c->full.topk, kl = (size_t)c->d.topk;
    for (int i = 0; i < n; i++) {
        int32_t *ids = r->ids + (size_t)i * B * k;
        float *w = r->w + (size_t)i * B * k;
        fm_status st = fm_route(&c->full, layers[i], x, B, tok, ids, w);
        if (st == FM_OK) st = fm_shard_load_of(&c->full, c->p->fmt, c->shard, ids, B, &r->load[i]);
        if (st != FM_OK) return st;
    }
    for (int l = 0; r->lids && l < L; l++)
        fm_shard_local_ids(c->shard, c->full.n_experts, (int)k, B, r->ids + (size_t)(l % n) * B * k,
                           r->w + (size_t)(l % n) * B * k, (int)kl, r->lids + (size_t)l * B * kl,
                           r->lw + (size_t)l * B * kl);
    return FM_OK;
}

/* The loads of a measured step's layers into the batch's sums. */
static void ep_add_load(fm_prof_batch *b, const ep_route *r, int n, int L) {
    for (int l = 0; l < L; l++) {
        fm_shard_load_add(&b->load, &r->load[l % n]);
        b->load_calls++;
    }
}

/* ------------------------------------------------------ the devices */

/* What differs between the devices; run_device is the path they share:
 * engine and layers, bandwidth, compute peak, the time source, then the
 * batches, each inside its window on the run's timeline. */
typedef struct {
    size_t probe_bytes;    /* the bandwidth probe's default buffer          */
    const char *probe_what;/* how bandwidth_note names the probe             */
    /* The engine and the layers: device_desc, layers_distinct, fmt. *dev is
     * set even on failure (close frees what there is). */
    fm_status (*open)(run_ctx *c, void **dev);
    /* The streaming read of `bytes`, in bytes/s. */
    fm_status (*bandwidth)(void *dev, const run_ctx *c, size_t bytes, double *Bps);
    /* Compute peak (FLOP/s; 0: unknown) and where it comes from. */
    double (*peak)(const run_ctx *c, char *note, size_t cap);
    /* The time source, and what the batches need. */
    fm_status (*prepare)(void *dev, run_ctx *c);
    /* Measures batch bi into b (index p->n_batch): steps, step times, phase
     * rows, active experts and their spans. win[0] is the window's start
     * (the device may move it); the device sets win[1], its end. name: the
     * batch's span ("batch B" unless the device says more). */
    fm_status (*batch)(void *dev, run_ctx *c, int bi, fm_prof_batch *b, uint64_t win[2], char *name, size_t cap);
    fm_status (*finish)(void *dev, run_ctx *c); /* after the batches */
    void (*close)(void *dev);
} dev_ops;

static fm_status run_device(run_ctx *c, const dev_ops *ops) {
    const fm_prof_opts *o = c->o;
    fm_profile *p = c->p;
    void *dev = NULL;
    fm_status st = ops->open(c, &dev);
    if (st == FM_OK && o->bandwidth_Bps > 0) {
        p->bandwidth_Bps = o->bandwidth_Bps;
        snprintf(p->bandwidth_note, sizeof p->bandwidth_note, "given with --bandwidth");
    } else if (st == FM_OK) {
        size_t bytes = o->bw_probe_bytes ? o->bw_probe_bytes : ops->probe_bytes;
        progress(c, "measuring memory bandwidth%s (%d MiB)", "", (int)(bytes >> 20));
        st = ops->bandwidth(dev, c, bytes, &p->bandwidth_Bps);
        snprintf(p->bandwidth_note, sizeof p->bandwidth_note, "measured now: %s of %zu MiB", ops->probe_what, bytes >> 20);
    }
    if (st == FM_OK && o->peak_flops > 0) {
        p->peak_flops = o->peak_flops;
        snprintf(p->peak_note, sizeof p->peak_note, "given with --peak-gflops");
    } else if (st == FM_OK) {
        p->peak_flops = ops->peak(c, p->peak_note, sizeof p->peak_note);
    }
    p->tile_n = o->tile_n; /* --tile-n models every batch with one tile size */
    if (st == FM_OK) st = ops->prepare(dev, c);
    for (int bi = 0; bi < o->n_batch && st == FM_OK; bi++) {
        fm_prof_batch *b = &p->b[p->n_batch];
        memset(b, 0, sizeof *b);
        b->batch = o->batches[bi];
        progress(c, "batch %s%d", "", b->batch);
        char name[64];
        snprintf(name, sizeof name, "batch %d", b->batch);
        uint64_t win[2] = {fm_now_ns(), 0};
        st = ops->batch(dev, c, bi, b, win, name, sizeof name);
        if (st != FM_OK) break;
        b->t_begin_s = (double)(win[0] - c->t0) * 1e-9;
        b->t_end_s = (double)(win[1] - c->t0) * 1e-9;
        add_span(p, c->t0, win[0], win[1], 1, 1, p->n_batch, 0, -1, name);
        p->n_batch++;
    }
    if (st == FM_OK && ops->finish) st = ops->finish(dev, c);
    ops->close(dev);
    return st;
}

/* ------------------------------------------------------------- CPU */

typedef struct {
    fm_cpu_engine *e;
    fm_moe_layer **ls;
    int nl;
    step_io io;       /* for the largest batch */
    int32_t *tpe;     /* tokens per expert */
    uint8_t *seen;
    fm_phase_times pt;
    ep_route er;      /* an EP rank: the full routing of a step */
    fm_shard_ep_work wk;
} cpu_dev;

static fm_status cpu_open(run_ctx *c, void **out) {
    fm_profile *p = c->p;
    cpu_dev *v = fm_calloc(1, sizeof *v);
    *out = v;
    if (!v) return FM_E_NOMEM;
    fm_status st = fm_cpu_engine_new(FM_CPU_AUTO, c->o->threads, &v->e);
    if (st != FM_OK) return st;
    snprintf(p->device_desc, sizeof p->device_desc, "%s", fm_cpu_engine_describe(v->e));
    int want = layers_wanted(c);
    progress(c, "building %s layers (%d)", c->ckpt ? "checkpoint" : "random", want);
    st = host_layers(c, want, &v->ls, &v->nl);
    if (st != FM_OK) return st;
    p->layers_distinct = v->nl;
    p->fmt = v->ls[0]->fmt;
    return FM_OK;
}

static fm_status cpu_bandwidth(void *dev, const run_ctx *c, size_t bytes, double *Bps) {
    (void)dev;
    *Bps = fm_cpu_measure_bandwidth(bytes, c->o->threads);
    return *Bps > 0 ? FM_OK : fm_error(FM_E_NUMERIC, "profile: the bandwidth probe returned %g B/s", *Bps);
}

static double cpu_peak(const run_ctx *c, char *note, size_t cap) {
    return fm_prof_cpu_peak_flops(c->o->threads, note, cap);
}

static fm_status cpu_prepare(void *dev, run_ctx *c) {
    cpu_dev *v = dev;
    fm_profile *p = c->p;
    p->time_source = FM_TSRC_HOST;
    snprintf(p->time_note, sizeof p->time_note,
             "phase timers inside the CPU engine; trace phase spans are laid out in pipeline order inside each "
             "layer call with their measured durations");
    int maxB = 0;
    for (int i = 0; i < c->o->n_batch; i++) maxB = c->o->batches[i] > maxB ? c->o->batches[i] : maxB;
    const int E = c->d.n_experts;
    v->tpe = fm_malloc((size_t)E * sizeof *v->tpe);
    v->seen = fm_malloc((size_t)E);
    if (!v->tpe || !v->seen || io_alloc(&v->io, &c->d, maxB) != FM_OK) return FM_E_NOMEM;
    if (is_ep(c)) {
        fm_status st = ep_route_alloc(&v->er, c, maxB, v->nl, 0);
        if (st == FM_OK) st = fm_shard_ep_work_init(&v->wk, &c->full, c->shard, maxB);
        if (st != FM_OK) return st;
    }
    memset(&v->pt, 0, sizeof v->pt);
    fm_cpu_engine_set_phase_times(v->e, &v->pt);
    return FM_OK;
}

/* One layer call of a step: its span, its phases laid out in pipeline
 * order, and (measured steps) the phase rows, active experts and tiles. */
static fm_status cpu_layer(cpu_dev *v, run_ctx *c, fm_prof_batch *b, int dl, int measured, double acc[3]) {
    fm_profile *p = c->p;
    const fm_moe_layer *L = v->ls[dl];
    const int B = b->batch, E = c->d.n_experts, tile_n = c->o->tile_n;
    const int32_t *ids = v->io.ids;
    int n_ids = B * c->d.topk;
    fm_phase_times before = v->pt;
    uint64_t l0 = fm_now_ns();
    fm_status st;
    if (is_ep(c)) {
        const size_t kf = (size_t)c->full.topk, at = (size_t)dl * B * kf;
        fm_shard_local_ids(c->shard, c->full.n_experts, (int)kf, B, v->er.ids + at, v->er.w + at, v->wk.kl,
                           v->wk.lids, v->wk.lw);
        /* the rank's routing phase: its pairs picked out of the full routing */
        v->pt.ns[FM_PH_ROUTE] += (double)(fm_now_ns() - l0);
        st = fm_shard_ep_run_cpu(v->e, &c->full, L, c->shard, v->io.x, B, v->wk.lids, v->wk.lw, &v->wk, v->io.out);
        ids = v->wk.lids;
        n_ids = B * v->wk.kl;
    } else {
        fm_moe_out mo = {v->io.out, v->io.ids, v->io.w};
        st = fm_cpu_forward(v->e, &c->d, L, v->io.x, FM_DT_F32, B, v->io.tok, &mo);
    }
    uint64_t l1 = fm_now_ns();
    if (st != FM_OK) return st;
    char nm[64];
    snprintf(nm, sizeof nm, "layer %d", L->layer);
    add_span(p, c->t0, l0, l1, 1, 1, p->n_batch, 2, -1, nm);
    uint64_t t = l0;
    for (int ph = 0; ph < FM_PH_COUNT; ph++) {
        double d = v->pt.ns[ph] - before.ns[ph];
        if (d <= 0) continue;
        if (measured) b->row_ns[ph] += d;
        add_span(p, c->t0, t, t + (uint64_t)d, 1, 1, p->n_batch, 3, ph, fm_phase_name((fm_phase)ph));
        t += (uint64_t)d;
    }
    if (!measured) return FM_OK;
    acc[0] += count_distinct(ids, n_ids, E, v->seen);
    if (tile_n > 0) {
        memset(v->tpe, 0, (size_t)E * sizeof *v->tpe);
        for (int i = 0; i < n_ids; i++)
            if (ids[i] >= 0 && ids[i] < E) v->tpe[ids[i]]++;
        for (int q = 0; q < E; q++)
            if (v->tpe[q] > 0) {
                acc[1] += v->tpe[q];
                acc[2] += (double)((v->tpe[q] + tile_n - 1) / tile_n) * tile_n;
            }
    }
    return FM_OK;
}

static fm_status cpu_batch(void *dev, run_ctx *c, int bi, fm_prof_batch *b, uint64_t win[2], char *name, size_t cap) {
    (void)bi;
    (void)name;
    (void)cap;
    cpu_dev *v = dev;
    const fm_prof_opts *o = c->o;
    fm_profile *p = c->p;
    const int B = b->batch;
    double *step_ns = fm_calloc((size_t)o->steps, sizeof *step_ns);
    if (!step_ns) return FM_E_NOMEM;
    double acc[3] = {0, 0, 0}; /* active experts, tokens in tiles, tile rows */
    long layer_calls = 0;
    fm_status st = FM_OK;
    for (int s = 0; s < o->warmup + o->steps && st == FM_OK; s++) {
        int measured = s >= o->warmup;
        fill_inputs(c, B, s, v->io.x, v->io.tok);
        if (is_ep(c) && (st = ep_route_step(&v->er, c, v->ls, v->nl, 0, v->io.x, v->io.tok, B)) != FM_OK) break;
        uint64_t s0 = fm_now_ns();
        for (int l = 0; l < p->layers_per_step && st == FM_OK; l++) {
            st = cpu_layer(v, c, b, l % v->nl, measured, acc);
            layer_calls += measured;
        }
        if (st != FM_OK) break;
        uint64_t s1 = fm_now_ns();
        if (measured && is_ep(c)) ep_add_load(b, &v->er, v->nl, p->layers_per_step);
        char nm[64];
        snprintf(nm, sizeof nm, "%s B=%d", measured ? "step" : "warm-up step", B);
        add_span(p, c->t0, s0, s1, 1, 1, p->n_batch, 1, -1, nm);
        if (measured) step_ns[s - o->warmup] = (double)(s1 - s0);
        if (o->progress && (s1 - s0) > 1000000000ull)
            fprintf(o->progress, "profile: batch %d %s %d: %.0f ms\n", B, measured ? "step" : "warm-up step",
                    measured ? s - o->warmup + 1 : s + 1, (double)(s1 - s0) * 1e-6);
    }
    win[1] = fm_now_ns();
    if (st == FM_OK) {
        b->steps = o->steps;
        double sum = 0;
        b->step_ns_min = INFINITY;
        for (int s = 0; s < o->steps; s++) {
            sum += step_ns[s];
            b->step_ns_min = fmin(b->step_ns_min, step_ns[s]);
            b->step_ns_max = fmax(b->step_ns_max, step_ns[s]);
        }
        b->step_ns = sum / o->steps;
        for (int ph = 0; ph < FM_PH_COUNT; ph++) b->row_ns[ph] /= o->steps;
        b->active_observed = layer_calls ? acc[0] / layer_calls : 0;
        b->tile_fill_observed = acc[2] > 0 ? acc[1] / acc[2] : -1;
    }
    free(step_ns);
    return st;
}

static fm_status cpu_finish(void *dev, run_ctx *c) {
    cpu_dev *v = dev;
    c->p->fused_mask = v->pt.fused_mask;
    return FM_OK;
}

static void cpu_close(void *dev) {
    cpu_dev *v = dev;
    if (!v) return;
    io_free(&v->io);
    ep_route_free(&v->er);
    fm_shard_ep_work_free(&v->wk);
    free(v->tpe);
    free(v->seen);
    for (int i = 0; i < v->nl; i++) fm_moe_layer_free(v->ls[i]);
    free(v->ls);
    fm_cpu_engine_free(v->e);
    free(v);
}

static const dev_ops k_cpu = {.probe_bytes = DEFAULT_CPU_PROBE, .probe_what = "streaming read", .open = cpu_open,
                              .bandwidth = cpu_bandwidth, .peak = cpu_peak, .prepare = cpu_prepare,
                              .batch = cpu_batch, .finish = cpu_finish, .close = cpu_close};

/* ------------------------------------------------------------- CUDA */

/* Kernel records of one batch (those that started inside its window) to
 * per-step phase times, kernel spans per stream and one span per step. */
static int cupti_breakdown(run_ctx *c, fm_prof_batch *b, int bi, const fm_kernel_rec *recs, size_t n, uint64_t ta,
                           uint64_t tz) {
    fm_profile *p = c->p;
    fm_kernel_rec *r = fm_malloc((n ? n : 1) * sizeof *r);
    int *step_of = fm_malloc((n ? n : 1) * sizeof *step_of);
    if (!r || !step_of) {
        free(r);
        free(step_of);
        return 0;
    }
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (recs[i].start_ns >= ta && recs[i].start_ns <= tz) r[m++] = recs[i];
    int steps = fm_prof_kernel_steps(r, m, p->layers_per_step, step_of, b->row_ns);
    for (size_t i = 0; i < m; i++) {
        size_t before = p->n_spans;
        add_span(p, c->t0, r[i].start_ns, r[i].end_ns, 2, (int)r[i].stream, bi, 4, r[i].phase, r[i].name);
        if (p->n_spans > before) p->spans[before].step = step_of[i];
    }
    for (int s = 0; s < steps; s++) {
        uint64_t s0 = UINT64_MAX, s1 = 0;
        for (size_t i = 0; i < m; i++)
            if (step_of[i] == s) {
                if (r[i].start_ns < s0) s0 = r[i].start_ns;
                if (r[i].end_ns > s1) s1 = r[i].end_ns;
            }
        char nm[64];
        snprintf(nm, sizeof nm, "step B=%d (GPU)", b->batch);
        if (s1 > s0) add_span(p, c->t0, s0, s1, 2, 0, bi, 1, -1, nm);
    }
    free(r);
    free(step_of);
    return steps;
}

typedef struct {
    fm_cuda_engine *e;
    fm_cuda_layer **cl;   /* the distinct layers */
    fm_cuda_layer **step; /* a step's layers, cycling cl */
    int nl;
    fm_cupti *cu;
    /* an EP rank: the full routers (host), the views' zero router, the
     * inputs of a batch and their full routing */
    fm_moe_layer **router;
    int nr;
    float *zero, *ep_x;
    int32_t *ep_tok;
    ep_route er;
    /* token rows an expert's count is padded to, per batch: tile_n on the
     * large path (every pass runs all its 8-token tiles), 8 on the wgmma
     * path (a pass's N is its count rounded up to 8) */
    int tiles[FM_PROF_MAX_BATCH];
} cuda_dev;

/* The tuned config (or the default) of each batch: the provenance lines
 * and the tile sizes the model pads to. */
static fm_status cuda_configs(cuda_dev *v, run_ctx *c) {
    const fm_prof_opts *o = c->o;
    fm_profile *p = c->p;
    fm_tune_key key;
    memset(&key, 0, sizeof key);
    fm_status st = fm_cuda_engine_key(v->e, &c->d, p->fmt, &key);
    if (st != FM_OK) return st;
    size_t plen = 0;
    for (int bi = 0; bi < o->n_batch; bi++) {
        fm_tune_choice ch;
        if (fm_tune_choose(&key, o->batches[bi], &ch) != FM_OK) continue;
        char line[1024];
        fm_tune_provenance_line(&key, o->batches[bi], &ch, line, sizeof line);
        int wr = snprintf(p->provenance + plen, sizeof p->provenance - plen, "%s%s", plen ? "\n" : "", line);
        if (wr > 0 && (size_t)wr < sizeof p->provenance - plen) plen += (size_t)wr;
        if (ch.cfg.path == FM_PATH_LARGE) v->tiles[bi] = ch.cfg.tile_n;
        else if (ch.cfg.path == FM_PATH_WGMMA) v->tiles[bi] = 8;
    }
    if (o->progress && p->provenance[0]) fprintf(o->progress, "%s\n", p->provenance);
    return FM_OK;
}

static fm_status cuda_open(run_ctx *c, void **out) {
    const fm_prof_opts *o = c->o;
    fm_profile *p = c->p;
    cuda_dev *v = fm_calloc(1, sizeof *v);
    *out = v;
    if (!v) return FM_E_NOMEM;
    char why[256] = "";
    if (!fm_cuda_available(why, sizeof why))
        return fm_error(FM_E_UNSUPPORTED, "profile --device cuda: no usable CUDA GPU: %s", why);
    fm_status st = fm_cuda_engine_new(o->cuda_device, &v->e);
    if (st != FM_OK) return st;
    snprintf(p->device_desc, sizeof p->device_desc, "%s", fm_cuda_engine_describe(v->e));
    int want = layers_wanted(c);
    v->cl = fm_calloc((size_t)want, sizeof *v->cl);
    v->step = fm_calloc((size_t)p->layers_per_step, sizeof *v->step);
    if (!v->cl || !v->step) return FM_E_NOMEM;
    const int ep = is_ep(c);
    if (ep && !(v->zero = fm_calloc((size_t)c->d.n_experts * c->d.hidden, sizeof(float)))) return FM_E_NOMEM;
    if (c->ckpt) {
        fm_moe_layer **hl = NULL;
        int hn = 0;
        st = host_layers(c, want, &hl, &hn);
        for (int i = 0; st == FM_OK && i < hn; i++) {
            fm_model_desc dv = c->d;
            fm_moe_layer lv = *hl[i];
            if (ep) fm_shard_ep_view(&c->full, hl[i], c->shard, v->zero, &dv, &lv); /* the rank's experts */
            st = fm_cuda_layer_upload(v->e, &dv, &lv, &v->cl[i]);
            if (st == FM_OK) v->nl++;
        }
        if (hn) p->fmt = hl[0]->fmt;
        if (ep) { /* the full layers route on the host */
            v->router = hl;
            v->nr = hn;
        } else {
            for (int i = 0; i < hn; i++) fm_moe_layer_free(hl[i]);
            free(hl);
        }
    } else {
        if (ep && !(v->router = fm_calloc((size_t)want, sizeof *v->router))) return FM_E_NOMEM;
        for (int i = 0; st == FM_OK && i < want && i < c->n_moe; i++) {
            st = c->shard ? fm_cuda_layer_random_shard(v->e, &c->full, p->fmt, o->seed, c->moe_idx[i], c->shard, &v->cl[i])
                          : fm_cuda_layer_random(v->e, &c->d, p->fmt, o->seed, c->moe_idx[i], &v->cl[i]);
            if (st == FM_OK) v->nl++;
            if (st == FM_OK && ep) st = fm_io_router_random(&c->full, p->fmt, o->seed, c->moe_idx[i], &v->router[v->nr]);
            if (st == FM_OK && ep) v->nr++;
        }
    }
    if (st != FM_OK) return st;
    p->layers_distinct = v->nl;
    for (int l = 0; l < p->layers_per_step; l++) v->step[l] = v->cl[l % v->nl];
    return cuda_configs(v, c);
}

static fm_status cuda_bandwidth(void *dev, const run_ctx *c, size_t bytes, double *Bps) {
    (void)c;
    cuda_dev *v = dev;
    *Bps = fm_cuda_measure_bandwidth(v->e, bytes);
    return *Bps > 0 ? FM_OK : fm_error(FM_E_CUDA, "profile: the GPU bandwidth probe failed: %s", fm_last_error());
}

static double cuda_peak(const run_ctx *c, char *note, size_t cap) { return gpu_peak(c->p->device_desc, note, cap); }

static fm_status cuda_prepare(void *dev, run_ctx *c) {
    cuda_dev *v = dev;
    fm_profile *p = c->p;
    if (is_ep(c)) {
        int maxB = 0;
        for (int i = 0; i < c->o->n_batch; i++) maxB = c->o->batches[i] > maxB ? c->o->batches[i] : maxB;
        v->ep_x = fm_malloc((size_t)maxB * c->d.hidden * sizeof *v->ep_x);
        v->ep_tok = fm_malloc((size_t)maxB * sizeof *v->ep_tok);
        if (!v->ep_x || !v->ep_tok) return FM_E_NOMEM;
        fm_status st = ep_route_alloc(&v->er, c, maxB, v->nl, p->layers_per_step);
        if (st != FM_OK) return st;
    }
    if (fm_cupti_start(&v->cu) == FM_OK) {
        p->time_source = FM_TSRC_CUPTI;
        snprintf(p->time_note, sizeof p->time_note,
                 "CUPTI concurrent-kernel activity records: each kernel inside the CUDA graph, per stream; "
                 "overlapping kernels (programmatic dependent launch) count once, under the earlier one");
    } else {
        p->time_source = FM_TSRC_EVENTS;
        snprintf(p->time_note, sizeof p->time_note,
                 "phases: CUDA events between the phases of one step of un-graphed forward calls; step: graph "
                 "replays (CUPTI unavailable: %.100s)",
                 fm_last_error());
    }
    return FM_OK;
}

/* Without CUPTI: one step's layers through fm_cuda_forward (not in a
 * graph), with CUDA events between phases, scaled to one step. */
static fm_status events_step(cuda_dev *v, run_ctx *c, fm_prof_batch *b) {
    const fm_profile *p = c->p;
    const int B = b->batch;
    step_io io;
    memset(&io, 0, sizeof io);
    fm_status st = io_alloc(&io, &c->d, B);
    if (st == FM_OK) fill_inputs(c, B, 0, io.x, io.tok);
    fm_phase_times pt;
    memset(&pt, 0, sizeof pt);
    fm_cuda_engine_set_phase_times(v->e, &pt);
    for (int l = 0; st == FM_OK && l < p->layers_per_step; l++) {
        fm_moe_out mo = {io.out, io.ids, io.w};
        st = fm_cuda_forward(v->e, &c->d, v->step[l], io.x, FM_DT_F32, B, io.tok, &mo);
    }
    fm_cuda_engine_set_phase_times(v->e, NULL);
    io_free(&io);
    if (st != FM_OK) return st;
    /* calls counts layer executions: scale to one step */
    for (int q = 0; q < FM_PH_COUNT && pt.calls > 0; q++)
        b->row_ns[q] = pt.ns[q] / (double)pt.calls * p->layers_per_step;
    c->p->fused_mask = pt.fused_mask;
    return FM_OK;
}

/* An EP rank's batch: seeded inputs, their full routing on the host, the
 * load it puts on every rank (one step's layers) and the rank's pairs. */
static fm_status ep_prepare(cuda_dev *v, run_ctx *c, fm_prof_batch *b) {
    const int B = b->batch, L = c->p->layers_per_step;
    fill_inputs(c, B, 0, v->ep_x, v->ep_tok);
    fm_status st = ep_route_step(&v->er, c, v->router, v->nr, L, v->ep_x, v->ep_tok, B);
    if (st == FM_OK) ep_add_load(b, &v->er, v->nr, L);
    return st;
}

/* reps replays of a step's graph: the whole layers (fm_cuda_bench) or an
 * EP rank's pre-routed experts and shared expert (the bench's EP call). */
static fm_status step_bench(cuda_dev *v, run_ctx *c, int B, int reps, fm_cuda_bench_result *r) {
    const int L = c->p->layers_per_step;
    if (!is_ep(c)) return fm_cuda_bench(v->e, &c->d, v->step, L, B, c->o->seed, reps, r);
    memset(r, 0, sizeof *r);
    int t0, nc;
    fm_shard_token_chunk(c->shard, B, &t0, &nc);
    snprintf(r->kernel, sizeof r->kernel, "pre-routed experts");
    return fm_cuda_bench_ep_rank(v->e, v->step, L, B, v->ep_x, v->er.lids, v->er.lw, t0, nc, reps, &r->us_per_layer,
                                 &r->us_min, &r->us_max);
}

static fm_status cuda_batch(void *dev, run_ctx *c, int bi, fm_prof_batch *b, uint64_t win[2], char *name, size_t cap) {
    cuda_dev *v = dev;
    const fm_prof_opts *o = c->o;
    fm_profile *p = c->p;
    const int B = b->batch;
    if (o->tile_n == 0) b->tile_n = v->tiles[bi];
    fm_status st = is_ep(c) ? ep_prepare(v, c, b) : FM_OK;
    if (st != FM_OK) return st;
    win[0] = fm_now_ns(); /* the routing on the host is not the GPU's */
    if (v->cu) fm_cupti_clear(v->cu);
    fm_cuda_bench_result r;
    memset(&r, 0, sizeof r);
    st = step_bench(v, c, B, o->steps, &r);
    win[1] = fm_now_ns();
    int reps = o->steps;
    /* NVML averages utilization and power over its own window (up to
     * ~1 s): a batch measured for less than that reads the idle time
     * around it. Repeat the replays until the batch lasts at least a
     * second; where NVML reads the power, 2.2 s, so that the part from
     * 1 s on (fm_profile_finish) holds none of the batch before. */
    const double want_s = c->nvml ? 2.2 : 1.2;
    if (st == FM_OK && (double)(win[1] - win[0]) < 1e9 * (want_s - 0.2)) {
        double per = (double)(win[1] - win[0]) / reps;
        long want = per > 0 ? (long)(want_s * 1e9 / per) + 1 : reps;
        if (want > 2000) want = 2000;
        if (want > reps) {
            reps = (int)want;
            if (v->cu) fm_cupti_clear(v->cu);
            win[0] = fm_now_ns();
            st = step_bench(v, c, B, reps, &r);
            win[1] = fm_now_ns();
        }
    }
    if (st != FM_OK) return st;
    b->steps = reps;
    b->step_ns = r.us_per_layer * 1e3 * p->layers_per_step;
    b->step_ns_min = r.us_min * 1e3 * p->layers_per_step;
    b->step_ns_max = r.us_max * 1e3 * p->layers_per_step;
    b->active_observed = r.active_experts;
    snprintf(name, cap, "batch %d (%.40s)", B, r.kernel);
    if (!v->cu && is_ep(c)) {
        /* the pre-routed call has no phase events: the step total stays */
        size_t l = strlen(p->time_note);
        if (!strstr(p->time_note, "EP rank"))
            snprintf(p->time_note + l, sizeof p->time_note - l, "; an EP rank's phases need CUPTI");
        return FM_OK;
    }
    if (!v->cu) return events_step(v, c, b);
    if ((st = fm_cupti_flush(v->cu)) != FM_OK) return st;
    const fm_kernel_rec *rec = NULL;
    size_t n = fm_cupti_records(v->cu, &rec);
    if (cupti_breakdown(c, b, p->n_batch, rec, n, win[0], win[1]) == 0) {
        /* the step total stays; its phases are unknown */
        size_t l = strlen(p->time_note);
        snprintf(p->time_note + l, sizeof p->time_note - l, "; no kernel records for batch %d", B);
    }
    return FM_OK;
}

static fm_status cuda_finish(void *dev, run_ctx *c) {
    cuda_dev *v = dev;
    const fm_prof_opts *o = c->o;
    fm_profile *p = c->p;
    if (v->cu && fm_cupti_dropped(v->cu)) {
        size_t l = strlen(p->time_note);
        snprintf(p->time_note + l, sizeof p->time_note - l, "; %llu records dropped",
                 (unsigned long long)fm_cupti_dropped(v->cu));
    }
    /* the power baseline: the bandwidth probe's read kept up while NVML
     * samples, so that the verdict can set the layer's power against what
     * reading alone draws (fm_profile_finish). After the batches, so that
     * NVML's one-second power average carries none of it into a batch's
     * window (its own window is read from 1 s after its start). */
    if (o->read_power_s <= 0 || !c->nvml) return FM_OK;
    fm_cupti_stop(v->cu); /* its records are read; the probe's kernels need none */
    v->cu = NULL;
    size_t bytes = o->bw_probe_bytes ? o->bw_probe_bytes : DEFAULT_GPU_PROBE;
    progress(c, "streaming read for %s%d s beside the power readings", "", (int)(o->read_power_s + 0.5));
    p->read_t_begin_s = now_s(c->t0);
    p->read_Bps = fm_cuda_sustained_read(v->e, bytes, o->read_power_s);
    p->read_t_end_s = now_s(c->t0);
    if (!(p->read_Bps > 0)) return fm_error(FM_E_CUDA, "profile: the sustained streaming read failed: %s", fm_last_error());
    p->read_s = p->read_t_end_s - p->read_t_begin_s;
    return FM_OK;
}

static void cuda_close(void *dev) {
    cuda_dev *v = dev;
    if (!v) return;
    fm_cupti_stop(v->cu);
    for (int i = 0; i < v->nl; i++) fm_cuda_layer_free(v->cl[i]);
    for (int i = 0; i < v->nr; i++) fm_moe_layer_free(v->router[i]);
    free(v->router);
    free(v->zero);
    free(v->ep_x);
    free(v->ep_tok);
    ep_route_free(&v->er);
    free(v->cl);
    free(v->step);
    if (v->e) fm_cuda_engine_free(v->e);
    free(v);
}

static const dev_ops k_cuda = {.probe_bytes = DEFAULT_GPU_PROBE, .probe_what = "device streaming read",
                               .open = cuda_open, .bandwidth = cuda_bandwidth, .peak = cuda_peak,
                               .prepare = cuda_prepare, .batch = cuda_batch, .finish = cuda_finish,
                               .close = cuda_close};

/* ------------------------------------------------------------- entry */

fm_status fm_profile_run(const fm_prof_opts *o, fm_profile **out) {
    if (!o || !out) return fm_error(FM_E_ARG, "profile: NULL argument");
    *out = NULL;
    fm_status st = check_opts(o);
    if (st != FM_OK) return st;
    run_ctx c;
    memset(&c, 0, sizeof c);
    c.o = o;
    fm_telemetry *tm = NULL;
    fm_profile *p = fm_profile_new();
    if (!p) return FM_E_NOMEM;
    c.p = p;
    if (o->preset) {
        st = fm_preset_desc(o->preset, o->fmt, &c.d);
        snprintf(p->model, sizeof p->model, "%s", o->preset);
    } else {
        st = fm_model_desc_load(o->model_dir, &c.d);
        if (st == FM_OK) st = fm_ckpt_open(o->model_dir, &c.ckpt);
        snprintf(p->model, sizeof p->model, "%s", o->model_dir);
    }
    if (st != FM_OK) goto fail;
    c.full = c.d;
    if (o->shard && o->shard->mode) {
        c.shard = o->shard;
        p->shard = *o->shard;
        p->full_E = c.full.n_experts;
        p->full_k = c.full.topk;
        fm_qformat f = o->fmt != FM_QF_NONE ? o->fmt : c.full.expert_format;
        if ((st = fm_shard_desc(&c.full, f, c.shard, &c.d)) != FM_OK) goto fail;
        char sd[192];
        fm_shard_describe(c.shard, &c.full, sd, sizeof sd);
        size_t n = strlen(p->model);
        snprintf(p->model + n, sizeof p->model - n, ", shard %s", sd);
    }
    p->fmt = o->preset ? c.d.expert_format : (o->fmt != FM_QF_NONE ? o->fmt : c.d.expert_format);
    snprintf(p->family, sizeof p->family, "%s", c.d.family);
    p->device = o->device;
    p->E = c.d.n_experts;
    p->k = c.d.topk;
    p->H = c.d.hidden;
    p->I = c.d.moe_inter;
    p->n_shared = c.d.n_shared;
    p->shared_inter = c.d.n_shared > 0 ? c.d.shared_inter : 0;
    p->group_size = c.d.group_size;
    p->warmup = o->warmup;
    c.moe_idx = fm_calloc((size_t)(c.d.n_layers > 0 ? c.d.n_layers : 1), sizeof *c.moe_idx);
    if (!c.moe_idx) { st = FM_E_NOMEM; goto fail; }
    for (int l = 0; l < c.d.n_layers; l++)
        if (fm_model_is_moe_layer(&c.d, l)) c.moe_idx[c.n_moe++] = l;
    if (c.n_moe == 0) {
        st = fm_error(FM_E_RANGE, "%s: the model has no MoE layer", p->model);
        goto fail;
    }
    p->model_moe_layers = c.n_moe;
    p->layers_per_step = o->step_layers > 0 ? o->step_layers : c.n_moe;

    c.t0 = fm_now_ns();
    st = fm_telemetry_start(o->device, o->cuda_device, o->period_ms, c.t0, &tm);
    if (st != FM_OK) goto fail;
    c.nvml = fm_telemetry_has_nvml(tm);
    snprintf(p->telem_note, sizeof p->telem_note, "%s", fm_telemetry_note(tm));
    st = run_device(&c, o->device == FM_DEV_CUDA ? &k_cuda : &k_cpu);
    fm_telemetry_stop(tm);
    if (st != FM_OK) goto fail;
    p->duration_s = now_s(c.t0);
    const fm_telem_sample *s = NULL;
    size_t ns = fm_telemetry_samples(tm, &s);
    if (ns) {
        p->samples = fm_malloc(ns * sizeof *s);
        if (!p->samples) { st = FM_E_NOMEM; goto fail; }
        memcpy(p->samples, s, ns * sizeof *s);
        p->n_samples = ns;
    }
    st = fm_profile_finish(p);
    if (st != FM_OK) goto fail;
    fm_telemetry_free(tm);
    fm_ckpt_close(c.ckpt);
    free(c.moe_idx);
    *out = p;
    return FM_OK;
fail:
    fm_telemetry_free(tm);
    fm_ckpt_close(c.ckpt);
    free(c.moe_idx);
    fm_profile_free(p);
    return st;
}
