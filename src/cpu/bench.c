/*
 * The CPU benchmark and the memory-bandwidth probe it is measured against.
 *
 * Decode MoE is a weight-streaming problem, so the figure that matters is
 * bytes of weights read per layer / time, next to what this machine's
 * memory can stream. The probe reads a buffer much larger than the caches
 * with every thread and keeps the best of several passes; the benchmark
 * cycles several layers with distinct weights so that a layer's experts are
 * not still cached from the previous call.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cpu/cpu_internal.h"
#include "route/route.h"
#include "util/util.h"

typedef struct {
    uint8_t *buf;
    size_t slice;
    int fill;
    uint64_t sink[64];
} probe;

static void probe_job(void *arg, int tid) {
    probe *p = arg;
    uint8_t *b = p->buf + (size_t)tid * p->slice;
    if (p->fill) {
        memset(b, 0x5A + tid, p->slice);
        return;
    }
    const uint64_t *q = (const uint64_t *)b;
    const size_t n = p->slice / 8;
    uint64_t s[8] = {0};
    for (size_t i = 0; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) s[j] += q[i + j];
    p->sink[tid & 63] = s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
}

double fm_cpu_measure_bandwidth(size_t bytes, int n_threads) {
    fm_pool *pool = NULL;
    if (fm_pool_new(n_threads, &pool)) return 0.0;
    const int n = fm_pool_size(pool);
    probe p = {0};
    p.slice = bytes / (size_t)n / 4096 * 4096;
    if (p.slice < 4096) p.slice = 4096;
    p.buf = fm_aligned_alloc(4096, p.slice * (size_t)n);
    if (!p.buf) { fm_pool_free(pool); return 0.0; }
    p.fill = 1;
    fm_pool_run(pool, probe_job, &p); /* each thread touches its own pages */
    p.fill = 0;
    double best = 0.0;
    for (int pass = 0; pass < 5; pass++) {
        uint64_t t0 = fm_now_ns();
        fm_pool_run(pool, probe_job, &p);
        double s = (double)(fm_now_ns() - t0) * 1e-9;
        double bw = s > 0 ? (double)(p.slice * (size_t)n) / s : 0.0;
        if (bw > best) best = bw;
    }
    free(p.buf);
    fm_pool_free(pool);
    if (best <= 0.0) fm_error(FM_E_RANGE, "bandwidth probe measured no time");
    return best;
}

/* Last-level cache of this CPU: sysfs first (sysconf reports the host's
 * whole L3 on some virtual machines), else sysconf, else 32 MiB. */
static int64_t llc_bytes(void) {
    FILE *f = fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r");
    if (f) {
        long long v = 0;
        char unit = 0;
        int n = fscanf(f, "%lld%c", &v, &unit);
        fclose(f);
        if (n >= 1 && v > 0) return unit == 'M' ? v << 20 : unit == 'K' ? v << 10 : v;
    }
    long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    return l3 > 0 ? l3 : 32ll << 20;
}

int fm_cpu_bench_default_layers(const fm_model_desc *d, fm_qformat fmt) {
    int64_t eb = fm_model_expert_bytes(d, fmt);
    if (eb <= 0 || d->moe_inter <= 0) return 1;
    int64_t shared = d->n_shared > 0 ? eb / d->moe_inter * d->shared_inter : 0;
    int64_t router = (int64_t)d->n_experts * d->hidden * 4;
    int64_t active = (int64_t)d->topk * eb + shared + router;
    int64_t layer = (int64_t)d->n_experts * eb + shared + router;
    int64_t llc = llc_bytes();
    int64_t n = (3 * llc + active - 1) / active;
    if (n < 2) n = 2;
    if (n > 16) n = 16;
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    if (pages > 0 && psz > 0) {
        int64_t half = (int64_t)pages * psz / 2;
        while (n > 1 && n * layer > half) n--;
    }
    return (int)n;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

fm_status fm_cpu_bench(fm_cpu_engine *e, const fm_model_desc *d, fm_moe_layer *const *layers, int n_layers,
                       int T, uint64_t seed, double min_seconds, fm_progress_fn progress, void *progress_ctx,
                       fm_cpu_bench_result *r) {
    if (!e || !d || !layers || !r || n_layers < 1 || T < 1)
        return fm_error(FM_E_ARG, "fm_cpu_bench: bad arguments (%d layers, batch %d)", n_layers, T);
    memset(r, 0, sizeof *r);
    const int64_t H = d->hidden;
    const int k = d->topk;
    enum { MAX_PASSES = 100000 };
    uint64_t n_x, n_o;
    if (!fm_mul_ok((uint64_t)T, (uint64_t)H, &n_x) || !fm_mul_ok((uint64_t)T, (uint64_t)k, &n_o))
        return fm_error(FM_E_RANGE, "batch %d too large", T);
    float *x = fm_malloc(sizeof(float) * n_x), *out = fm_malloc(sizeof(float) * n_x);
    int32_t *ids = fm_malloc(sizeof(int32_t) * n_o), *tok = fm_malloc(sizeof(int32_t) * (size_t)T);
    double *pass_us = fm_malloc(sizeof(double) * MAX_PASSES);
    fm_status st = FM_OK;
    if (!x || !out || !ids || !tok || !pass_us) { st = FM_E_NOMEM; goto done; }
    for (uint64_t i = 0; i < n_x; i++) x[i] = fm_rng_normal(seed, 0xB3C4, i);
    for (int t = 0; t < T; t++) tok[t] = (int32_t)(fm_rng_u64(seed, 0x70C1D5, (uint64_t)t) >> 33);

    /* Warm-up pass: routes every layer once and accounts the bytes. */
    fm_moe_out o = {out, ids, NULL};
    double active = 0, bytes = 0;
    for (int li = 0; li < n_layers; li++) {
        const fm_moe_layer *l = layers[li];
        const int32_t *tids = NULL;
        if (fm_route_is_hash_layer(d, l)) {
            for (int t = 0; t < T; t++) tok[t] = (int32_t)((uint64_t)(uint32_t)tok[t] % (uint64_t)l->tid2eid_rows);
            tids = tok;
        }
        st = fm_cpu_forward(e, d, l, x, FM_DT_F32, T, tids, &o);
        if (st) goto done;
        int na = 0;
        bytes += (double)fm_cpu_bytes_read(l, ids, T, &na);
        active += na;
    }
    r->active_experts = active / n_layers;
    r->bytes_per_layer = (int64_t)llround(bytes / n_layers);

    int passes = 0;
    uint64_t t_begin = fm_now_ns();
    double last_report = 0;
    for (;;) {
        uint64_t t0 = fm_now_ns();
        for (int li = 0; li < n_layers && !st; li++) {
            const fm_moe_layer *l = layers[li];
            st = fm_cpu_forward(e, d, l, x, FM_DT_F32, T, fm_route_is_hash_layer(d, l) ? tok : NULL, &o);
        }
        if (st) goto done;
        uint64_t t1 = fm_now_ns();
        pass_us[passes++] = (double)(t1 - t0) * 1e-3 / n_layers;
        double el = (double)(t1 - t_begin) * 1e-9;
        if (progress && el - last_report >= 0.5) {
            progress(progress_ctx, "timing", min_seconds > 0 ? fmin(1.0, el / min_seconds) : 1.0);
            last_report = el;
        }
        if ((el >= min_seconds && passes >= 3) || passes == MAX_PASSES) break;
    }
    qsort(pass_us, (size_t)passes, sizeof(double), cmp_double);
    r->T = T;
    r->reps = passes;
    r->us_min = pass_us[0];
    r->us_max = pass_us[passes - 1];
    r->us_per_layer = passes % 2 ? pass_us[passes / 2] : 0.5 * (pass_us[passes / 2 - 1] + pass_us[passes / 2]);
    r->tokens_per_s = T / (r->us_per_layer * 1e-6);
    r->gbps = (double)r->bytes_per_layer / (r->us_per_layer * 1e-6) * 1e-9;
    snprintf(r->kernel, sizeof r->kernel, "%s", fm_cpu_engine_describe(e));
done:
    free(x);
    free(out);
    free(ids);
    free(tok);
    free(pass_us);
    return st;
}
