/* The tuning sweep: for each batch bucket, measure the default, then the
 * candidates around it within a time budget, check a would-be winner's
 * output against the float64 reference, and keep the default unless a
 * candidate is measurably faster (measurably_faster). The measuring backend
 * is a pair of callbacks, so this logic is tested without a GPU. */
#include "tune/tune_internal.h"
#include "util/util.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static void logf_(const fm_tune_opts *o, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static void logf_(const fm_tune_opts *o, const char *fmt, ...) {
    if (!o->log) return;
    char line[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    o->log(o->log_ctx, line);
}

typedef struct {
    double med, min, max;
} meas;

static fm_status bench(const fm_tune_backend *be, const fm_kernel_config *c, int T, meas *m) {
    m->med = m->min = m->max = 0;
    fm_status s = be->bench(be->ctx, c, T, &m->med, &m->min, &m->max);
    if (s) return s;
    if (!isfinite(m->med) || m->med <= 0 || !isfinite(m->min) || !isfinite(m->max) || m->min > m->med ||
        m->med > m->max)
        return fm_error(FM_E_NUMERIC, "benchmark returned an inconsistent time (median %g, min %g, max %g us)", m->med,
                        m->min, m->max);
    return FM_OK;
}

/* A candidate replaces the default only when it is measurably faster: the
 * two measurements must be separated (the candidate's median below the
 * default's fastest replay, and its slowest replay below the default's
 * median) and the gain must reach a minimum share of the default's median,
 * so noise cannot crown a winner. The spread (max - min) is not the test:
 * GPU replays have a slow tail, and one slow replay of the default would
 * veto a real gain (docs/perf.md). */
static int measurably_faster(const meas *c, const meas *d, double min_gain) {
    return c->med < d->min && c->max < d->med && d->med - c->med > min_gain * d->med;
}

/* 1: passes; 0: fails (why written). Errors of the check itself fail. */
static int check_ok(const fm_tune_backend *be, const fm_kernel_config *c, int T, double tol, char *why, size_t cap) {
    double err = INFINITY;
    int ids = 0;
    fm_status s = be->check(be->ctx, c, T, &err, &ids);
    if (s) { snprintf(why, cap, "check failed: %s", fm_last_error()); return 0; }
    if (!ids) { snprintf(why, cap, "top-k ids differ from the reference"); return 0; }
    if (!(err <= tol)) { snprintf(why, cap, "relative error %.3g > %.3g", err, tol); return 0; }
    snprintf(why, cap, "relative error %.3g", err);
    return 1;
}

fm_status fm_tune_sweep(const fm_tune_key *key, const fm_tune_backend *be, const int *buckets, int n,
                        const fm_tune_opts *opts, const char *out_dir, char *written_path, size_t cap,
                        fm_tune_bucket_result *res) {
    if (!key || !be || !be->bench || !be->check || !buckets || n < 1 || !out_dir)
        return fm_error(FM_E_ARG, "fm_tune_sweep: missing argument");
    if (n > FM_TUNE_MAX_BUCKETS) return fm_error(FM_E_RANGE, "at most %d batch buckets per sweep", FM_TUNE_MAX_BUCKETS);
    for (int i = 0; i < n; i++) {
        if (buckets[i] < 1 || buckets[i] > 1000000) return fm_error(FM_E_RANGE, "batch bucket %d is out of range", buckets[i]);
        for (int j = 0; j < i; j++)
            if (buckets[j] == buckets[i]) return fm_error(FM_E_ARG, "batch bucket %d is listed twice", buckets[i]);
    }
    fm_tune_opts o = {.budget_s = 30, .tolerance = 5e-3, .min_gain = 0.01, .max_candidates = 0};
    if (opts) o = *opts;
    if (!(o.budget_s >= 0)) o.budget_s = 30;
    if (!(o.tolerance > 0)) o.tolerance = 5e-3;
    if (!(o.min_gain >= 0)) o.min_gain = 0.01;

    char name[512], path[4096];
    fm_status s = fm_tune_key_filename(key, name, sizeof name);
    if (s) return s;
    if ((s = fm_path_join(path, sizeof path, out_dir, name))) return s;
    if ((s = fm_tune_mkdirs(out_dir))) return s;

    /* Merge into an existing file of the same key, so buckets can be tuned
     * in several runs; anything else at that path is replaced. */
    fm_tune_file *f = fm_calloc(1, sizeof *f);
    if (!f) return FM_E_NOMEM;
    {
        char msg[512], note[256];
        int r = fm_tune_load_cached(path, f, msg, sizeof msg);
        if (r > 0 && fm_tune_key_match(&f->key, key, note, sizeof note) == FM_TUNE_MATCH) {
            logf_(&o, "merging into %s (%d buckets there)", path, f->n);
        } else {
            if (r < 0) logf_(&o, "replacing %s: %s", path, msg);
            else if (r > 0) logf_(&o, "replacing %s: %s", path, note);
            memset(f, 0, sizeof *f);
        }
        f->key = *key; /* versions of this run */
    }

    fm_kernel_config cands[FM_TUNE_GRID_MAX];
    uint64_t t_start = fm_now_ns();
    for (int bi = 0; bi < n; bi++) {
        int T = buckets[bi];
        double elapsed = (double)(fm_now_ns() - t_start) * 1e-9;
        double share = (o.budget_s - elapsed) / (double)(n - bi);
        uint64_t deadline = fm_now_ns() + (uint64_t)(fmax(share, 0.0) * 1e9);
        int nc = fm_tune_candidates(key, T, cands, FM_TUNE_GRID_MAX);
        if (nc < 1) { s = fm_error(FM_E_ARG, "no valid default kernel config for batch %d", T); goto out; }
        const fm_kernel_config *def = &cands[0];
        char why[256], cs[200];

        if (!check_ok(be, def, T, o.tolerance, why, sizeof why)) {
            fm_kernel_config_format(def, cs, sizeof cs);
            s = fm_error(FM_E_NUMERIC, "batch %d: the default config (%s) fails the reference check: %s; not writing a config",
                         T, cs, why);
            goto out;
        }
        meas md, mbest = {0, 0, 0};
        if ((s = bench(be, def, T, &md))) {
            char e[512];
            snprintf(e, sizeof e, "%s", fm_last_error());
            s = fm_error(s, "batch %d: benchmark of the default config failed: %s", T, e);
            goto out;
        }
        logf_(&o, "batch %d: default %.2f us [%.2f, %.2f]; %d candidates, %.1f s", T, md.med, md.min, md.max, nc - 1,
              fmax(share, 0.0));
        int best = -1, tried = 0, rejected = 0;
        int limit = o.max_candidates > 0 && o.max_candidates + 1 < nc ? o.max_candidates + 1 : nc;
        for (int ci = 1; ci < limit; ci++) {
            if (fm_now_ns() >= deadline) {
                logf_(&o, "batch %d: budget spent after %d of %d candidates", T, ci - 1, nc - 1);
                break;
            }
            meas m;
            fm_kernel_config_format(&cands[ci], cs, sizeof cs);
            if (bench(be, &cands[ci], T, &m) != FM_OK) {
                rejected++;
                logf_(&o, "batch %d: skip %s: %s", T, cs, fm_last_error());
                continue;
            }
            tried++;
            /* Only a config that would take the lead is checked: checking
             * costs a reference comparison, and losers cannot win anyway. */
            if (m.med < md.med && (best < 0 || m.med < mbest.med)) {
                if (!check_ok(be, &cands[ci], T, o.tolerance, why, sizeof why)) {
                    rejected++;
                    logf_(&o, "batch %d: reject %s (%.2f us): %s", T, cs, m.med, why);
                    continue;
                }
                best = ci;
                mbest = m;
                logf_(&o, "batch %d: lead %s %.2f us [%.2f, %.2f], %s", T, cs, m.med, m.min, m.max, why);
            }
        }

        fm_tune_bucket b;
        memset(&b, 0, sizeof b);
        b.batch = T;
        b.default_cfg = *def;
        b.has_default_cfg = 1;
        b.cfg = *def;
        if (best >= 0 && measurably_faster(&mbest, &md, o.min_gain)) {
            /* Confirm with fresh measurements of both: the best of many noisy
             * medians is biased low (winner's curse). */
            meas c2, d2;
            if (bench(be, &cands[best], T, &c2) == FM_OK && bench(be, def, T, &d2) == FM_OK &&
                measurably_faster(&c2, &d2, o.min_gain)) {
                b.cfg = cands[best];
                b.replaced_default = 1;
                md = d2;
                mbest = c2;
            } else {
                logf_(&o, "batch %d: the lead did not hold on re-measurement; keeping the default", T);
                best = -1;
            }
        } else if (best >= 0) {
            logf_(&o, "batch %d: best candidate %.2f us is not measurably faster than the default %.2f us", T,
                  mbest.med, md.med);
            best = -1;
        }
        const meas *mw = b.replaced_default ? &mbest : &md;
        b.us = mw->med;
        b.us_min = mw->min;
        b.us_max = mw->max;
        b.default_us = md.med;
        b.default_us_min = md.min;
        b.default_us_max = md.max;
        fm_tune_now_iso(b.date, sizeof b.date);
        snprintf(b.version, sizeof b.version, "%s", FM_VERSION);
        if ((s = fm_tune_file_put(f, &b))) goto out;
        if (res) {
            fm_tune_bucket_result *r = &res[bi];
            memset(r, 0, sizeof *r);
            r->batch = T;
            r->cfg = b.cfg;
            r->default_cfg = *def;
            r->us = b.us;
            r->us_min = b.us_min;
            r->us_max = b.us_max;
            r->default_us = b.default_us;
            r->default_us_min = b.default_us_min;
            r->default_us_max = b.default_us_max;
            r->replaced_default = b.replaced_default;
            r->n_tried = tried;
            r->n_rejected = rejected;
        }
        fm_kernel_config_format(&b.cfg, cs, sizeof cs);
        logf_(&o, "batch %d: %s %s %.2f us (default %.2f us)", T, b.replaced_default ? "tuned" : "default", cs, b.us,
              b.default_us);
    }

    char *text = fm_tune_file_to_json(f);
    if (!text) { s = FM_E_NOMEM; goto out; }
    s = fm_write_file_atomic(path, text, strlen(text));
    free(text);
    if (s == FM_OK && written_path && cap) snprintf(written_path, cap, "%s", path);
out:
    free(f);
    return s;
}
