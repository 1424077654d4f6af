/*
 * From parsed files to the analysis: ranks, steps, per-step times, and
 * per-kernel / per-category statistics.
 *
 * Steps. A step is a window on the GPU timeline; every GPU activity belongs
 * to at most one step:
 *  - GPU-side annotations (gpu_user_annotation "ProfilerStep#N" or
 *    "step[DECODE bs=N]") are used as they are when the trace has at least
 *    as many as CPU-side ones;
 *  - otherwise the CPU-side annotation spans are mapped to the GPU through
 *    correlation ids: a kernel belongs to the step whose CPU span contains
 *    the runtime call (cudaLaunchKernel, cudaGraphLaunch, ...) that carries
 *    the kernel's correlation id. The GPU work of a step lags its CPU span,
 *    so containment of the kernel's own timestamp would be wrong;
 *  - a marker regex: each kernel whose name matches starts a step that ends
 *    where the next marker starts (the work after the last marker is not a
 *    complete step and stays outside, unless there is only one marker);
 *  - nothing found: one step covering the whole trace (the output says so).
 *
 * Percentiles are exact: the durations of every GPU activity are kept
 * (8 bytes each) and sorted per kernel name; p-th percentile by linear
 * interpolation between closest ranks (numpy's default).
 */
#include "trace/trace_internal.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "trace/trace_analyze_internal.h"

/* ------------------------------------------------------------- statistics */

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static double pct(const int64_t *a, size_t n, double p) {
    if (n == 0) return 0;
    double pos = p / 100.0 * (double)(n - 1);
    size_t lo = (size_t)pos;
    if (lo >= n - 1) return (double)a[n - 1];
    double fr = pos - (double)lo;
    return (double)a[lo] + ((double)a[lo + 1] - (double)a[lo]) * fr;
}

/* Per-key statistics of n (key, duration, in-step) samples. */
static fm_status group_stats(const uint32_t *keys, const int64_t *dur, const uint8_t *instep, size_t n, size_t nkeys,
                             fm_tr_gstat *out) {
    memset(out, 0, nkeys * sizeof *out);
    size_t *off = fm_calloc(nkeys + 1, sizeof *off);
    int64_t *tmp = fm_malloc((n ? n : 1) * sizeof *tmp);
    if (!off || !tmp) {
        free(off);
        free(tmp);
        return FM_E_NOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        fm_tr_gstat *g = &out[keys[i]];
        g->count++;
        g->total_ns += (double)dur[i];
        if (instep[i]) {
            g->in_count++;
            g->in_ns += (double)dur[i];
        }
        off[keys[i] + 1]++;
    }
    for (size_t k = 0; k < nkeys; k++) off[k + 1] += off[k];
    size_t *pos = fm_malloc((nkeys ? nkeys : 1) * sizeof *pos);
    if (!pos) {
        free(off);
        free(tmp);
        return FM_E_NOMEM;
    }
    memcpy(pos, off, nkeys * sizeof *pos);
    for (size_t i = 0; i < n; i++) tmp[pos[keys[i]]++] = dur[i];
    for (size_t k = 0; k < nkeys; k++) {
        size_t m = off[k + 1] - off[k];
        if (!m) continue;
        int64_t *a = tmp + off[k];
        qsort(a, m, sizeof *a, cmp_i64);
        fm_tr_gstat *g = &out[k];
        g->mean_ns = g->total_ns / (double)m;
        g->p50_ns = pct(a, m, 50);
        g->p90_ns = pct(a, m, 90);
        g->p99_ns = pct(a, m, 99);
        g->max_ns = (double)a[m - 1];
        g->heavy = m >= 5 && g->mean_ns >= 2.0 * g->p50_ns && g->mean_ns > 0;
    }
    free(pos);
    free(off);
    free(tmp);
    return FM_OK;
}

/* ------------------------------------------------------------ rank events */

typedef struct {
    int64_t ts, dur, corr;
    uint32_t gk;     /* global name index            */
    uint32_t stream; /* rank-local stream index      */
    int32_t file;    /* index among the rank's files */
    int32_t step;
} rev;

static int cmp_rev_ts(const void *a, const void *b) {
    const rev *x = a, *y = b;
    if (x->ts != y->ts) return (x->ts > y->ts) - (x->ts < y->ts);
    return (x->dur < y->dur) - (x->dur > y->dur);
}

static int cmp_span(const void *a, const void *b) {
    const fm_tr_span *x = a, *y = b;
    return (x->ts > y->ts) - (x->ts < y->ts);
}

static int cmp_launch_corr(const void *a, const void *b) {
    const fm_tr_launch *x = a, *y = b;
    return (x->corr > y->corr) - (x->corr < y->corr);
}

/* Index of the latest-starting window containing t (windows sorted by
 * start; reach[i] = the latest end among windows 0..i, so that a window
 * nested in an earlier one does not hide it), or -1. */
static int find_window(const int64_t *ws, const int64_t *we, const int64_t *reach, int n, int64_t t) {
    int lo = 0, hi = n - 1, best = -1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (ws[mid] <= t) {
            best = mid;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    /* zero-length window exactly at t */
    if (best >= 0 && ws[best] == t && we[best] == t) return best;
    for (int j = best; j >= 0 && reach[j] > t; j--)
        if (t < we[j]) return j;
    return -1;
}

static void add_note(fm_tr_unit *u, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void add_note(fm_tr_unit *u, const char *fmt, ...) {
    if (u->nnotes >= FM_TR_MAX_NOTES) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(u->notes[u->nnotes++], sizeof u->notes[0], fmt, ap);
    va_end(ap);
}

static double union_len(const int64_t (*iv)[2], size_t n, int64_t (*out)[2], size_t *nout) {
    /* iv sorted by start */
    double tot = 0;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (k && iv[i][0] <= out[k - 1][1]) {
            if (iv[i][1] > out[k - 1][1]) out[k - 1][1] = iv[i][1];
        } else {
            out[k][0] = iv[i][0];
            out[k][1] = iv[i][1];
            k++;
        }
    }
    for (size_t i = 0; i < k; i++) tot += (double)(out[i][1] - out[i][0]);
    *nout = k;
    return tot;
}

static double intersect_len(const int64_t (*a)[2], size_t na, const int64_t (*b)[2], size_t nb) {
    size_t i = 0, j = 0;
    double tot = 0;
    while (i < na && j < nb) {
        int64_t lo = a[i][0] > b[j][0] ? a[i][0] : b[j][0];
        int64_t hi = a[i][1] < b[j][1] ? a[i][1] : b[j][1];
        if (hi > lo) tot += (double)(hi - lo);
        if (a[i][1] < b[j][1]) i++;
        else j++;
    }
    return tot;
}

/* Fills steps of u from events ev (sorted by ts, step set). */
static fm_status step_metrics(fm_tr_unit *u, rev *ev, size_t n, const int *name_cat, int ncats) {
    int ns = u->nsteps;
    /* bucket events by step, keeping ts order */
    size_t *off = fm_calloc((size_t)ns + 1, sizeof *off);
    if (!off) return FM_E_NOMEM;
    for (size_t i = 0; i < n; i++)
        if (ev[i].step >= 0) off[ev[i].step + 1]++;
    for (int s = 0; s < ns; s++) off[s + 1] += off[s];
    size_t nin = off[ns];
    size_t *idx = fm_malloc((nin ? nin : 1) * sizeof *idx);
    size_t *pos = fm_malloc(((size_t)ns + 1) * sizeof *pos);
    int64_t(*iv)[2] = fm_malloc((nin ? nin : 1) * sizeof *iv);
    int64_t(*ua)[2] = fm_malloc((nin ? nin : 1) * sizeof *ua);
    int64_t(*ub)[2] = fm_malloc((nin ? nin : 1) * sizeof *ub);
    int64_t(*ia)[2] = fm_malloc((nin ? nin : 1) * sizeof *ia);
    int64_t(*ib)[2] = fm_malloc((nin ? nin : 1) * sizeof *ib);
    u->step_cat_ns = fm_calloc((size_t)ns * (size_t)ncats + 1, sizeof *u->step_cat_ns);
    if (!idx || !pos || !iv || !ua || !ub || !ia || !ib || !u->step_cat_ns) {
        free(off), free(idx), free(pos), free(iv), free(ua), free(ub), free(ia), free(ib);
        return FM_E_NOMEM;
    }
    memcpy(pos, off, ((size_t)ns + 1) * sizeof *pos);
    for (size_t i = 0; i < n; i++)
        if (ev[i].step >= 0) idx[pos[ev[i].step]++] = i;
    for (int s = 0; s < ns; s++) {
        fm_tr_step *st = &u->steps[s];
        size_t a = off[s], b = off[s + 1];
        size_t na = 0, nb = 0;
        for (size_t k = a; k < b; k++) {
            const rev *e = &ev[idx[k]];
            int cat = name_cat[e->gk];
            u->step_cat_ns[(size_t)s * ncats + cat] += (double)e->dur;
            iv[k - a][0] = e->ts;
            iv[k - a][1] = e->ts + e->dur;
            if (cat == FM_CAT_COMM) {
                ia[na][0] = e->ts;
                ia[na][1] = e->ts + e->dur;
                na++;
            } else {
                ib[nb][0] = e->ts;
                ib[nb][1] = e->ts + e->dur;
                nb++;
            }
            if (e->ts + e->dur > st->we) st->we = e->ts + e->dur;
            if (e->ts < st->ws) st->ws = e->ts;
        }
        size_t nu, nua, nub;
        st->busy = union_len((const int64_t(*)[2])iv, b - a, ua, &nu);
        st->comm = union_len((const int64_t(*)[2])ia, na, ua, &nua);
        union_len((const int64_t(*)[2])ib, nb, ub, &nub);
        st->overlap = intersect_len((const int64_t(*)[2])ua, nua, (const int64_t(*)[2])ub, nub);
        st->wall = (double)(st->we - st->ws);
        if (st->wall < st->busy) st->wall = st->busy;
        st->n_events = (int64_t)(b - a);
    }
    free(off), free(idx), free(pos), free(iv), free(ua), free(ub), free(ia), free(ib);
    return FM_OK;
}

static fm_status alloc_steps(fm_tr_unit *u, int n) {
    u->nsteps = n;
    u->steps = fm_calloc((size_t)n + 1, sizeof *u->steps);
    return u->steps ? FM_OK : FM_E_NOMEM;
}

/* Chooses the steps of one rank and assigns its events to them. */
static fm_status assign_steps(fm_trace *t, fm_tr_unit *u, fm_tr_file **files, int nf, rev *ev, size_t n) {
    for (size_t i = 0; i < n; i++) ev[i].step = -1;
    if (n == 0) {
        snprintf(u->method, sizeof u->method, "no GPU activity in the trace");
        return alloc_steps(u, 0);
    }
    fm_trace_steps mode = t->opts.steps;
    int kind = -1;
    size_t nprof = 0, nsgl = 0;
    for (int f = 0; f < nf; f++)
        for (size_t i = 0; i < files[f]->nspan; i++) {
            if (files[f]->span[i].kind == FM_TR_SPAN_PROFILER) nprof++;
            else nsgl++;
        }
    if (mode == FM_TRACE_STEPS_PROFILER) kind = FM_TR_SPAN_PROFILER;
    else if (mode == FM_TRACE_STEPS_SGLANG) kind = FM_TR_SPAN_SGLANG;
    else if (mode == FM_TRACE_STEPS_AUTO) kind = nprof ? FM_TR_SPAN_PROFILER : nsgl ? FM_TR_SPAN_SGLANG : -1;

    if (mode == FM_TRACE_STEPS_MARKER) {
        int64_t *ms = fm_malloc(n * sizeof *ms);
        if (!ms) return FM_E_NOMEM;
        int m = 0;
        for (size_t i = 0; i < n; i++)
            if (t->name_marker[ev[i].gk] && m < INT32_MAX - 1) ms[m++] = ev[i].ts;
        if (m == 0) {
            free(ms);
            return fm_error(FM_E_NOTFOUND, "%s: no kernel matches the marker regex '%s'", u->label, t->opts.marker);
        }
        int nsteps = m == 1 ? 1 : m - 1;
        fm_status s = alloc_steps(u, nsteps);
        if (s != FM_OK) {
            free(ms);
            return s;
        }
        int64_t end = 0;
        for (size_t i = 0; i < n; i++)
            if (ev[i].ts + ev[i].dur > end) end = ev[i].ts + ev[i].dur;
        int k = 0;
        for (size_t i = 0; i < n; i++) {
            while (k + 1 < m && ev[i].ts >= ms[k + 1]) k++;
            if (ev[i].ts < ms[0]) continue;
            if (m > 1 && k >= nsteps) continue; /* after the last marker */
            ev[i].step = k;
        }
        for (int s2 = 0; s2 < nsteps; s2++) {
            u->steps[s2].ws = ms[s2];
            u->steps[s2].we = m == 1 ? end : ms[s2 + 1];
            u->steps[s2].num = s2;
        }
        free(ms);
        snprintf(u->method, sizeof u->method, "%d steps between consecutive kernels matching the marker /%s/%s", nsteps,
                 t->opts.marker, m == 1 ? " (one marker: the step runs to the end of the trace)" : "");
        return FM_OK;
    }

    size_t ncpu = 0, ngpu = 0;
    for (int f = 0; f < nf; f++)
        for (size_t i = 0; i < files[f]->nspan; i++)
            if ((int)files[f]->span[i].kind == kind) {
                if (files[f]->span[i].gpu) ngpu++;
                else ncpu++;
            }
    const char *what = kind == FM_TR_SPAN_PROFILER ? "ProfilerStep#N" : "step[DECODE bs=N]";
    if (kind < 0 || (ncpu == 0 && ngpu == 0)) {
        if (mode != FM_TRACE_STEPS_AUTO)
            return fm_error(FM_E_NOTFOUND, "%s: no %s annotations in the trace (try --steps auto or marker:REGEX)",
                            u->label, what);
        fm_status s = alloc_steps(u, 1);
        if (s != FM_OK) return s;
        u->steps[0].ws = INT64_MAX;
        u->steps[0].we = INT64_MIN;
        for (size_t i = 0; i < n; i++) ev[i].step = 0;
        u->whole_trace = 1;
        snprintf(u->method, sizeof u->method,
                 "no step annotations found (ProfilerStep#N, step[DECODE bs=N]): one step covers the whole trace");
        return FM_OK;
    }
    /* collect the spans of the chosen kind */
    fm_tr_span *sp = fm_malloc((ncpu + ngpu + 1) * sizeof *sp);
    if (!sp) return FM_E_NOMEM;
    int use_gpu = ngpu > 0 && ngpu >= ncpu;
    size_t m = 0;
    for (int f = 0; f < nf; f++)
        for (size_t i = 0; i < files[f]->nspan; i++)
            if ((int)files[f]->span[i].kind == kind && (int)files[f]->span[i].gpu == use_gpu) sp[m++] = files[f]->span[i];
    qsort(sp, m, sizeof *sp, cmp_span);
    int64_t *ws = fm_malloc((m + 1) * sizeof *ws), *we = fm_malloc((m + 1) * sizeof *we);
    int64_t *reach = fm_malloc((m + 1) * sizeof *reach);
    if (!ws || !we || !reach) {
        free(sp), free(ws), free(we), free(reach);
        return FM_E_NOMEM;
    }
    for (size_t i = 0; i < m; i++) {
        ws[i] = sp[i].ts;
        we[i] = sp[i].ts + sp[i].dur;
        reach[i] = i && reach[i - 1] > we[i] ? reach[i - 1] : we[i];
    }
    int32_t *cpu_step = NULL; /* per event: CPU window of its launch */
    size_t nlaunch = 0;
    for (int f = 0; f < nf; f++) nlaunch += files[f]->nlaunch;
    int by_corr = !use_gpu && nlaunch > 0;
    fm_status s = FM_OK;
    if (by_corr) {
        /* correlation id -> launch time, per file */
        for (int f = 0; f < nf; f++)
            qsort(files[f]->launch, files[f]->nlaunch, sizeof *files[f]->launch, cmp_launch_corr);
        int64_t unmatched = 0;
        for (size_t i = 0; i < n; i++) {
            rev *e = &ev[i];
            if (e->corr < 0) {
                unmatched++;
                continue;
            }
            fm_tr_file *fl = files[e->file];
            size_t lo = 0, hi = fl->nlaunch;
            while (lo < hi) {
                size_t mid = (lo + hi) / 2;
                if (fl->launch[mid].corr < e->corr) lo = mid + 1;
                else hi = mid;
            }
            if (lo >= fl->nlaunch || fl->launch[lo].corr != e->corr) {
                unmatched++;
                continue;
            }
            e->step = find_window(ws, we, reach, (int)m, fl->launch[lo].ts);
        }
        if (unmatched)
            add_note(u, "%lld GPU events have no launch with their correlation id in the trace: left outside steps",
                     (long long)unmatched);
    } else {
        for (size_t i = 0; i < n; i++) ev[i].step = find_window(ws, we, reach, (int)m, ev[i].ts);
    }
    /* steps that received no GPU work are dropped */
    int *remap = fm_malloc((m + 1) * sizeof *remap);
    int64_t *cnt = fm_calloc(m + 1, sizeof *cnt);
    if (!remap || !cnt) {
        s = FM_E_NOMEM;
        goto out;
    }
    for (size_t i = 0; i < n; i++)
        if (ev[i].step >= 0) cnt[ev[i].step]++;
    int kept = 0;
    for (size_t i = 0; i < m; i++) remap[i] = cnt[i] ? kept++ : -1;
    if ((size_t)kept < m) add_note(u, "%zu of %zu %s spans have no GPU work and are not counted as steps", m - (size_t)kept, m, what);
    s = alloc_steps(u, kept);
    if (s != FM_OK) goto out;
    for (size_t i = 0; i < m; i++)
        if (remap[i] >= 0) {
            fm_tr_step *st = &u->steps[remap[i]];
            st->num = sp[i].num;
            if (by_corr) {
                st->ws = INT64_MAX;
                st->we = INT64_MIN;
            } else {
                st->ws = ws[i];
                st->we = we[i];
            }
        }
    for (size_t i = 0; i < n; i++)
        if (ev[i].step >= 0) ev[i].step = remap[ev[i].step];
    if (use_gpu) {
        int64_t merged = 0;
        for (int f = 0; f < nf; f++) merged += files[f]->n_span_merged;
        if (merged)
            add_note(u, "%lld more GPU spans of the same annotations (one per stream that ran a step's work) "
                        "folded into their steps", (long long)merged);
        snprintf(u->method, sizeof u->method, "%d %s spans on the GPU timeline (gpu_user_annotation)", kept, what);
    }
    else if (by_corr)
        snprintf(u->method, sizeof u->method,
                 "%d %s CPU spans; kernels attributed through the correlation id of their launch", kept, what);
    else
        snprintf(u->method, sizeof u->method,
                 "%d %s CPU spans used as GPU windows (no launch events to correlate: GPU lag not corrected)", kept, what);
out:
    free(cpu_step);
    free(remap);
    free(cnt);
    free(sp);
    free(ws);
    free(we);
    free(reach);
    return s;
}

/* Statistics of a unit from its samples and steps. */
static fm_status finalize_unit(fm_trace *t, fm_tr_unit *u, const uint32_t *gk, const int64_t *dur, const uint8_t *instep,
                               size_t n) {
    size_t nk = t->names.n, nc = t->rules->ncats;
    fm_tr_gstat *gs = fm_calloc(nk + 1, sizeof *gs);
    uint32_t *ck = fm_malloc((n ? n : 1) * sizeof *ck);
    u->cats = fm_calloc(nc, sizeof *u->cats);
    u->cat_ms = fm_calloc(nc, 4 * sizeof *u->cat_ms);
    if (!gs || !ck || !u->cats || !u->cat_ms) {
        free(gs);
        free(ck);
        return FM_E_NOMEM;
    }
    fm_status s = group_stats(gk, dur, instep, n, nk, gs);
    for (size_t i = 0; s == FM_OK && i < n; i++) ck[i] = (uint32_t)t->name_cat[gk[i]];
    if (s == FM_OK) s = group_stats(ck, dur, instep, n, nc, u->cats);
    free(ck);
    if (s != FM_OK) {
        free(gs);
        return s;
    }
    double ns = u->nsteps > 0 ? (double)u->nsteps : 1.0;
    size_t m = 0;
    for (size_t k = 0; k < nk; k++)
        if (gs[k].count) m++;
    u->kern = fm_calloc(m + 1, sizeof *u->kern);
    u->kern_g = fm_calloc(m + 1, sizeof *u->kern_g);
    if (!u->kern || !u->kern_g) {
        free(gs);
        return FM_E_NOMEM;
    }
    for (size_t k = 0, j = 0; k < nk; k++) {
        if (!gs[k].count) continue;
        fm_trace_kernel *K = &u->kern[j];
        fm_tr_gstat *g = &gs[k];
        K->name = t->names.str[k];
        K->category = t->rules->cats[t->name_cat[k]];
        K->count = g->count;
        K->total_us = g->total_ns / 1e3;
        K->mean_us = g->mean_ns / 1e3;
        K->p50_us = g->p50_ns / 1e3;
        K->p90_us = g->p90_ns / 1e3;
        K->p99_us = g->p99_ns / 1e3;
        K->max_us = g->max_ns / 1e3;
        K->per_step = u->nsteps ? (double)g->in_count / ns : 0;
        K->ms_per_step = u->nsteps ? g->in_ns / ns / 1e6 : 0;
        K->heavy_tail = g->heavy;
        u->kern_g[j] = (uint32_t)k;
        j++;
    }
    u->nkern = m;
    free(gs);
    /* sort by total time, then name */
    for (size_t i = 1; i < m; i++) {
        fm_trace_kernel x = u->kern[i];
        uint32_t xg = u->kern_g[i];
        size_t j = i;
        while (j > 0 && (u->kern[j - 1].total_us < x.total_us ||
                         (u->kern[j - 1].total_us == x.total_us && strcmp(u->kern[j - 1].name, x.name) > 0))) {
            u->kern[j] = u->kern[j - 1];
            u->kern_g[j] = u->kern_g[j - 1];
            j--;
        }
        u->kern[j] = x;
        u->kern_g[j] = xg;
    }
    /* per category: mean, sd, min, max of ms per step */
    for (size_t c = 0; c < nc; c++) {
        double sum = 0, sq = 0, mn = INFINITY, mx = -INFINITY;
        for (int s2 = 0; s2 < u->nsteps; s2++) {
            double v = u->step_cat_ns[(size_t)s2 * nc + c] / 1e6;
            sum += v;
            sq += v * v;
            if (v < mn) mn = v;
            if (v > mx) mx = v;
        }
        double mean = u->nsteps ? sum / u->nsteps : 0;
        double var = u->nsteps > 1 ? (sq - sum * mean) / (u->nsteps - 1) : 0;
        u->cat_ms[4 * c + 0] = mean;
        u->cat_ms[4 * c + 1] = var > 0 ? sqrt(var) : 0;
        u->cat_ms[4 * c + 2] = u->nsteps ? mn : 0;
        u->cat_ms[4 * c + 3] = u->nsteps ? mx : 0;
    }
    /* step means */
    double w = 0, b = 0, cm = 0, ov = 0, gap = 0;
    int ngap = 0;
    for (int s2 = 0; s2 < u->nsteps; s2++) {
        w += u->steps[s2].wall;
        b += u->steps[s2].busy;
        cm += u->steps[s2].comm;
        ov += u->steps[s2].overlap;
        if (s2 + 1 < u->nsteps && u->steps[s2 + 1].rank == u->steps[s2].rank && u->steps[s2 + 1].ws >= u->steps[s2].we) {
            gap += (double)(u->steps[s2 + 1].ws - u->steps[s2].we);
            ngap++;
        }
    }
    u->info.n_steps = u->nsteps;
    u->info.method = u->method;
    u->info.wall_ms = u->nsteps ? w / u->nsteps / 1e6 : 0;
    u->info.busy_ms = u->nsteps ? b / u->nsteps / 1e6 : 0;
    u->info.idle_ms = u->info.wall_ms - u->info.busy_ms;
    u->info.comm_ms = u->nsteps ? cm / u->nsteps / 1e6 : 0;
    u->info.overlap_ms = u->nsteps ? ov / u->nsteps / 1e6 : 0;
    u->info.gap_ms = ngap ? gap / ngap / 1e6 : 0;
    /* spread of the per-step wall / busy */
    double sw = 0;
    for (int s2 = 0; s2 < u->nsteps; s2++) {
        double d = u->steps[s2].wall / 1e6 - u->info.wall_ms;
        sw += d * d;
    }
    u->wall_sd = u->nsteps > 1 ? sqrt(sw / (u->nsteps - 1)) : 0;
    return FM_OK;
}

/* ---------------------------------------------------------------- driver */

typedef struct {
    const char *const *paths;
    const void *mem;
    size_t mem_len;
    int n;
    fm_tr_file *files;
    fm_status *st;
    char (*err)[1024];
    int next;
    pthread_mutex_t mu;
} parse_job;

static void *parse_worker(void *arg) {
    parse_job *j = arg;
    for (;;) {
        pthread_mutex_lock(&j->mu);
        int i = j->next++;
        pthread_mutex_unlock(&j->mu);
        if (i >= j->n) break;
        if (j->mem) j->st[i] = fm_tr_parse_mem(j->mem, j->mem_len, j->paths[i], &j->files[i]);
        else j->st[i] = fm_tr_parse_path(j->paths[i], &j->files[i]);
        if (j->st[i] != FM_OK) snprintf(j->err[i], sizeof j->err[i], "%s", fm_last_error());
    }
    return NULL;
}

void fm_trace_free(fm_trace *t) {
    if (!t) return;
    for (int r = 0; r <= t->nranks; r++) {
        fm_tr_unit *u = r < t->nranks ? &t->ranks[r] : &t->all;
        if (r < t->nranks && !t->ranks) break;
        free(u->label);
        for (int i = 0; u->files && i < u->nfiles; i++) free(u->files[i]);
        free(u->files);
        free(u->steps);
        free(u->step_cat_ns);
        free(u->kern);
        free(u->kern_g);
        free(u->cats);
        free(u->cat_ms);
    }
    free(t->ranks);
    fm_tr_strtab_free(&t->names);
    free(t->name_cat);
    free(t->name_marker);
    fm_tr_rules_free(t->rules);
    free(t->marker);
    free(t);
}

static fm_status build(fm_trace *t, fm_tr_file *files, int nf) {
    fm_status s = FM_OK;
    /* global names */
    uint32_t **gmap = fm_calloc((size_t)nf, sizeof *gmap);
    if (!gmap) return FM_E_NOMEM;
    for (int f = 0; f < nf && s == FM_OK; f++) {
        gmap[f] = fm_malloc((files[f].names.n + 1) * sizeof **gmap);
        if (!gmap[f]) {
            s = FM_E_NOMEM;
            break;
        }
        for (size_t i = 0; i < files[f].names.n; i++) {
            int64_t g = fm_tr_strtab_intern(&t->names, files[f].names.str[i], files[f].names.len[i]);
            if (g < 0) {
                s = FM_E_NOMEM;
                break;
            }
            gmap[f][i] = (uint32_t)g;
        }
    }
    if (s == FM_OK) {
        t->name_cat = fm_calloc(t->names.n + 1, sizeof *t->name_cat);
        t->name_marker = fm_calloc(t->names.n + 1, 1);
        if (!t->name_cat || !t->name_marker) s = FM_E_NOMEM;
    }
    if (s == FM_OK) {
        uint8_t *is_mem = fm_calloc(t->names.n + 1, 1);
        if (!is_mem) s = FM_E_NOMEM;
        for (int f = 0; s == FM_OK && f < nf; f++)
            for (size_t i = 0; i < files[f].names.n; i++)
                if (files[f].name_is_mem && i < files[f].name_is_mem_cap && files[f].name_is_mem[i]) is_mem[gmap[f][i]] = 1;
        regex_t mre;
        int have_mre = 0;
        if (s == FM_OK && t->opts.steps == FM_TRACE_STEPS_MARKER) {
            int rc = regcomp(&mre, t->opts.marker, REG_EXTENDED | REG_NOSUB);
            if (rc != 0) {
                char msg[256];
                regerror(rc, &mre, msg, sizeof msg);
                s = fm_error(FM_E_ARG, "invalid marker regex '%s': %s", t->opts.marker, msg);
            } else {
                have_mre = 1;
            }
        }
        for (size_t k = 0; s == FM_OK && k < t->names.n; k++) {
            t->name_cat[k] = fm_tr_rules_match(t->rules, t->names.str[k], is_mem[k]);
            if (have_mre) t->name_marker[k] = regexec(&mre, t->names.str[k], 0, NULL, 0) == 0;
        }
        if (have_mre) regfree(&mre);
        free(is_mem);
    }
    /* ranks: files with the same -TP-r share a rank; others are one each */
    int *rank_of = fm_malloc(((size_t)nf + 1) * sizeof *rank_of);
    if (!rank_of) s = FM_E_NOMEM;
    if (s == FM_OK) {
        t->ranks = fm_calloc((size_t)nf + 1, sizeof *t->ranks);
        if (!t->ranks) s = FM_E_NOMEM;
    }
    for (int f = 0; s == FM_OK && f < nf; f++) {
        rank_of[f] = -1;
        if (files[f].rank_hint >= 0)
            for (int g = 0; g < f; g++)
                if (files[g].rank_hint == files[f].rank_hint) rank_of[f] = rank_of[g];
        if (rank_of[f] < 0) {
            fm_tr_unit *u = &t->ranks[t->nranks];
            char lab[256];
            if (files[f].rank_hint >= 0) snprintf(lab, sizeof lab, "rank %d", files[f].rank_hint);
            else if (files[f].dist_rank >= 0 && nf > 1) snprintf(lab, sizeof lab, "rank %d", files[f].dist_rank);
            else {
                const char *b = strrchr(files[f].path, '/');
                snprintf(lab, sizeof lab, "%s", b ? b + 1 : files[f].path);
            }
            u->label = fm_strdup(lab);
            if (!u->label) s = FM_E_NOMEM;
            rank_of[f] = t->nranks++;
        }
    }
    size_t ntot = 0;
    for (int f = 0; f < nf; f++) ntot += files[f].ngpu;
    uint32_t *agk = fm_malloc((ntot + 1) * sizeof *agk);
    int64_t *adur = fm_malloc((ntot + 1) * sizeof *adur);
    uint8_t *ain = fm_malloc(ntot + 1);
    fm_tr_step *asteps = NULL;
    size_t an = 0, ansteps = 0;
    if (!agk || !adur || !ain) s = FM_E_NOMEM;
    for (int r = 0; s == FM_OK && r < t->nranks; r++) {
        fm_tr_unit *u = &t->ranks[r];
        fm_tr_file *rf[nf];
        int nrf = 0;
        size_t n = 0, nstreams = 0;
        u->files = fm_calloc((size_t)nf, sizeof *u->files);
        if (!u->files) {
            s = FM_E_NOMEM;
            break;
        }
        for (int f = 0; f < nf; f++)
            if (rank_of[f] == r) {
                rf[nrf++] = &files[f];
                n += files[f].ngpu;
                u->files[u->nfiles] = fm_strdup(files[f].path);
                if (!u->files[u->nfiles]) s = FM_E_NOMEM;
                u->nfiles++;
                u->bytes += files[f].bytes;
                u->parse_s += files[f].parse_s;
                u->unmatched += files[f].n_unmatched;
            }
        if (s != FM_OK) break;
        rev *ev = fm_malloc((n + 1) * sizeof *ev);
        if (!ev) {
            s = FM_E_NOMEM;
            break;
        }
        size_t k = 0;
        for (int i = 0; i < nrf; i++) {
            int fi = (int)(rf[i] - files);
            for (size_t j = 0; j < rf[i]->ngpu; j++) {
                fm_tr_gpu *g = &rf[i]->gpu[j];
                ev[k].ts = g->ts;
                ev[k].dur = g->dur;
                ev[k].corr = g->corr;
                ev[k].gk = gmap[fi][g->name];
                ev[k].stream = (uint32_t)(nstreams + g->stream);
                ev[k].file = i;
                k++;
            }
            nstreams += rf[i]->nstreams;
            /* devices: distinct pids among streams */
            int64_t devs[8];
            int nd = 0;
            for (size_t q = 0; q < rf[i]->nstreams; q++) {
                int seen = 0;
                for (int d = 0; d < nd; d++) seen |= devs[d] == rf[i]->streams[2 * q];
                if (!seen && nd < 8) devs[nd++] = rf[i]->streams[2 * q];
            }
            if (nd > 1)
                add_note(u, "%s holds activity of %d GPU devices: they are analysed together as one rank", rf[i]->path,
                         nd);
        }
        u->nstreams = (int)nstreams;
        qsort(ev, n, sizeof *ev, cmp_rev_ts);
        s = assign_steps(t, u, rf, nrf, ev, n);
        if (s == FM_OK) s = step_metrics(u, ev, n, t->name_cat, (int)t->rules->ncats);
        if (s == FM_OK) {
            size_t base = an;
            for (size_t i = 0; i < n; i++) {
                agk[an] = ev[i].gk;
                adur[an] = ev[i].dur;
                ain[an] = ev[i].step >= 0;
                if (ev[i].step < 0) {
                    u->outside_events++;
                    u->outside_ns += (double)ev[i].dur;
                }
                an++;
            }
            u->info.outside_events = u->outside_events;
            for (int q = 0; q < u->nsteps; q++) u->steps[q].rank = r;
            s = finalize_unit(t, u, agk + base, adur + base, ain + base, n);
            if (u->unmatched) add_note(u, "%lld B/E events without a partner were ignored", (long long)u->unmatched);
        }
        free(ev);
        if (s == FM_OK) {
            fm_tr_step *ns = realloc(asteps, (ansteps + (size_t)u->nsteps + 1) * sizeof *ns);
            if (!ns) s = FM_E_NOMEM;
            else {
                asteps = ns;
                memcpy(asteps + ansteps, u->steps, (size_t)u->nsteps * sizeof *ns);
                ansteps += (size_t)u->nsteps;
            }
        }
    }
    /* all ranks together: every rank-step is one sample */
    if (s == FM_OK) {
        fm_tr_unit *u = &t->all;
        u->label = fm_strdup(t->nranks > 1 ? "all ranks" : t->ranks[0].label);
        u->nsteps = (int)ansteps;
        u->steps = asteps;
        asteps = NULL;
        size_t nc = t->rules->ncats;
        u->step_cat_ns = fm_calloc(ansteps * nc + 1, sizeof *u->step_cat_ns);
        if (!u->label || !u->step_cat_ns) s = FM_E_NOMEM;
        size_t q = 0;
        for (int r = 0; s == FM_OK && r < t->nranks; r++) {
            fm_tr_unit *ru = &t->ranks[r];
            memcpy(u->step_cat_ns + q * nc, ru->step_cat_ns, (size_t)ru->nsteps * nc * sizeof *u->step_cat_ns);
            q += (size_t)ru->nsteps;
            u->bytes += ru->bytes;
            u->parse_s += ru->parse_s;
            u->outside_events += ru->outside_events;
            u->outside_ns += ru->outside_ns;
            for (int i = 0; i < ru->nfiles && s == FM_OK; i++) {
                char **nf2 = realloc(u->files, ((size_t)u->nfiles + 1) * sizeof *nf2);
                if (!nf2) {
                    s = FM_E_NOMEM;
                    break;
                }
                u->files = nf2;
                u->files[u->nfiles] = fm_strdup(ru->files[i]);
                if (!u->files[u->nfiles]) s = FM_E_NOMEM;
                else u->nfiles++;
            }
            u->nstreams += ru->nstreams;
        }
        if (s == FM_OK) s = finalize_unit(t, u, agk, adur, ain, an);
        u->info.outside_events = u->outside_events;
        if (t->nranks == 1) snprintf(u->method, sizeof u->method, "%s", t->ranks[0].method);
        else snprintf(u->method, sizeof u->method, "%d ranks, %d rank-steps", t->nranks, u->nsteps);
    }
    free(asteps);
    free(agk);
    free(adur);
    free(ain);
    free(rank_of);
    for (int f = 0; f < nf; f++) free(gmap[f]);
    free(gmap);
    return s;
}

static fm_status trace_new(const fm_trace_options *o, fm_trace **out) {
    *out = NULL;
    fm_trace *t = fm_calloc(1, sizeof *t);
    if (!t) return FM_E_NOMEM;
    if (o) t->opts = *o;
    if (t->opts.top <= 0) t->opts.top = 25;
    if (t->opts.steps == FM_TRACE_STEPS_MARKER) {
        if (!t->opts.marker || !*t->opts.marker) {
            free(t);
            return fm_error(FM_E_ARG, "marker steps need a regex");
        }
        t->marker = fm_strdup(t->opts.marker);
        if (!t->marker) {
            free(t);
            return FM_E_NOMEM;
        }
        t->opts.marker = t->marker;
    } else {
        t->opts.marker = NULL;
    }
    t->opts.rules_path = NULL; /* not kept: the rules are compiled below */
    fm_status s = fm_tr_strtab_init(&t->names);
    if (s == FM_OK) s = fm_tr_rules_load(o ? o->rules_path : NULL, &t->rules);
    if (s != FM_OK) {
        fm_trace_free(t);
        return s;
    }
    *out = t;
    return FM_OK;
}

static fm_status open_common(const char *const *paths, int n, const void *mem, size_t len, const fm_trace_options *o,
                             fm_trace **out) {
    *out = NULL;
    if (n <= 0) return fm_error(FM_E_ARG, "no trace files given");
    if (n > 4096) return fm_error(FM_E_ARG, "too many trace files (%d, at most 4096)", n);
    fm_trace *t;
    fm_status s = trace_new(o, &t);
    if (s != FM_OK) return s;
    fm_tr_file *files = fm_calloc((size_t)n, sizeof *files);
    fm_status *st = fm_calloc((size_t)n, sizeof *st);
    char(*err)[1024] = fm_calloc((size_t)n, sizeof *err);
    if (!files || !st || !err) {
        free(files), free(st), free(err);
        fm_trace_free(t);
        return FM_E_NOMEM;
    }
    parse_job j = {paths, mem, len, n, files, st, err, 0, PTHREAD_MUTEX_INITIALIZER};
    int jobs = o && o->jobs > 0 ? o->jobs : (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (jobs < 1) jobs = 1;
    if (jobs > n) jobs = n;
    if (jobs > 64) jobs = 64;
    pthread_t th[64];
    int started = 0;
    for (int i = 1; i < jobs; i++)
        if (pthread_create(&th[started], NULL, parse_worker, &j) == 0) started++;
    parse_worker(&j);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    s = FM_OK;
    for (int i = 0; i < n; i++)
        if (st[i] != FM_OK) {
            s = fm_error(st[i], "%s", err[i]);
            break;
        }
    if (s == FM_OK) s = build(t, files, n);
    for (int i = 0; i < n; i++) fm_tr_file_free(&files[i]);
    free(files), free(st), free(err);
    if (s != FM_OK) {
        fm_trace_free(t);
        return s;
    }
    *out = t;
    return FM_OK;
}

fm_status fm_trace_open(const char *const *paths, int n, const fm_trace_options *o, fm_trace **out) {
    return open_common(paths, n, NULL, 0, o, out);
}

fm_status fm_trace_open_mem(const void *buf, size_t len, const fm_trace_options *o, fm_trace **out) {
    const char *label[1] = {"<memory>"};
    return open_common(label, 1, buf ? buf : "", buf ? len : 0, o, out);
}

/* ---------------------------------------------------------------- queries */

const char *fm_trace_categorize(const fm_trace *t, const char *name) {
    return t->rules->cats[fm_tr_rules_match(t->rules, name, 0)];
}

int fm_trace_rank_count(const fm_trace *t) { return t->nranks; }

const fm_tr_unit *fm_tr_unit_of(const fm_trace *t, int rank) {
    if (rank < 0 || rank >= t->nranks) return &t->all;
    return &t->ranks[rank];
}

const char *fm_trace_rank_label(const fm_trace *t, int rank) { return fm_tr_unit_of(t, rank)->label; }

size_t fm_trace_kernels(const fm_trace *t, int rank, const fm_trace_kernel **out) {
    const fm_tr_unit *u = fm_tr_unit_of(t, rank);
    *out = u->kern;
    return u->nkern;
}

fm_status fm_trace_step_summary(const fm_trace *t, int rank, fm_trace_step_info *out) {
    if (rank >= t->nranks) return fm_error(FM_E_RANGE, "rank %d out of range (%d ranks)", rank, t->nranks);
    *out = fm_tr_unit_of(t, rank)->info;
    return FM_OK;
}

double fm_trace_category_ms(const fm_trace *t, int rank, const char *category) {
    const fm_tr_unit *u = fm_tr_unit_of(t, rank);
    for (size_t c = 0; c < t->rules->ncats; c++)
        if (strcmp(t->rules->cats[c], category) == 0) return u->cat_ms[4 * c];
    return 0;
}
