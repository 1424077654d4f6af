/* Text, CSV, JSON and HTML renderings of a trace summary and of a diff. */
#include "trace/trace_analyze_internal.h"

#include <jansson.h>
#include <math.h>
#include <string.h>

/* ------------------------------------------------------------------ names */

/* A short readable form of a kernel name for tables: Itanium-mangled names
 * (_ZN5flash3fooI...) become "flash::foo<...>" (identifiers only, no full
 * demangling); long names are cut with "...". CSV and JSON keep the raw
 * name. */
static void short_name(const char *in, char *out, size_t cap) {
    size_t o = 0;
    out[0] = 0;
    if (in[0] == '_' && in[1] == 'Z') {
        const char *p = in + 2;
        int nested = 0;
        if (*p == 'L') p++;
        if (*p == 'N') {
            nested = 1;
            p++;
            while (*p == 'K' || *p == 'V' || *p == 'r') p++;
        }
        int parts = 0, ok = 1;
        while (ok && *p >= '0' && *p <= '9') {
            char *end;
            long len = strtol(p, &end, 10);
            if (len <= 0 || (size_t)len > strlen(end)) {
                ok = 0;
                break;
            }
            if (parts && o + 2 < cap) out[o++] = ':', out[o++] = ':';
            for (long i = 0; i < len && o + 1 < cap; i++) out[o++] = end[i];
            parts++;
            p = end + len;
            if (!nested) break;
        }
        if (ok && parts) {
            if (*p == 'I' && o + 6 < cap) memcpy(out + o, "<...>", 5), o += 5;
            out[o] = 0;
            in = out;
            if (strlen(out) < cap - 1) return;
        }
        o = 0;
    }
    size_t n = strlen(in);
    if (n + 1 <= cap) {
        if (in != out) memcpy(out, in, n + 1);
        return;
    }
    memmove(out, in, cap - 4);
    memcpy(out + cap - 4, "...", 4);
}

/* Category display order: built-ins (other last), user categories before "other". */
static size_t cat_order(const fm_trace *t, size_t *ord) {
    size_t n = 0;
    for (size_t c = 0; c < FM_CAT_OTHER; c++) ord[n++] = c;
    for (size_t c = FM_CAT_BUILTIN_COUNT; c < t->rules->ncats; c++) ord[n++] = c;
    ord[n++] = FM_CAT_OTHER;
    return n;
}

static double unit_total_ms(const fm_trace *t, const fm_tr_unit *u) {
    double s = 0;
    for (size_t c = 0; c < t->rules->ncats; c++) s += u->cat_ms[4 * c];
    return s;
}

/* ------------------------------------------------------------------- text */

static void text_unit(const fm_trace *t, const fm_tr_unit *u, FILE *o, int top) {
    size_t ord[300];
    size_t no = cat_order(t, ord);
    fprintf(o, "== %s: %d file%s, %.1f MB parsed in %.2f s", u->label, u->nfiles, u->nfiles == 1 ? "" : "s",
            (double)u->bytes / 1e6, u->parse_s);
    if (u->parse_s > 0) fprintf(o, " (%.0f MB/s)", (double)u->bytes / 1e6 / u->parse_s);
    fprintf(o, "\nsteps: %s\n", u->method);
    const fm_trace_step_info *si = &u->info;
    if (u->nsteps > 0) {
        fprintf(o, "per step (mean over %d): wall %.3f ms (sd %.3f), GPU busy %.3f ms (%.1f%%), idle %.3f ms", u->nsteps,
                si->wall_ms, u->wall_sd, si->busy_ms, si->wall_ms > 0 ? 100.0 * si->busy_ms / si->wall_ms : 0.0,
                si->idle_ms);
        if (si->gap_ms > 0) fprintf(o, ", gap to next step %.3f ms", si->gap_ms);
        fprintf(o, "\ncommunication: %.3f ms/step, %.3f ms overlapped with compute (%.1f%%), %.3f ms exposed\n",
                si->comm_ms, si->overlap_ms, si->comm_ms > 0 ? 100.0 * si->overlap_ms / si->comm_ms : 0.0,
                si->comm_ms - si->overlap_ms);
    }
    if (u->outside_events)
        fprintf(o, "outside steps: %lld GPU events, %.3f ms (in the kernel totals, not in the per-step figures)\n",
                (long long)u->outside_events, u->outside_ns / 1e6);
    double tot = unit_total_ms(t, u);
    fprintf(o, "\n%-14s %9s %8s %8s %8s %6s %9s %9s %9s %9s %9s %9s %s\n", "category", "ms/step", "sd", "min", "max",
            "share", "n/step", "mean_us", "p50_us", "p90_us", "p99_us", "max_us", "tail");
    for (size_t i = 0; i < no; i++) {
        size_t c = ord[i];
        const fm_tr_gstat *g = &u->cats[c];
        if (!g->count) continue;
        const double *m = &u->cat_ms[4 * c];
        fprintf(o, "%-14s %9.3f %8.3f %8.3f %8.3f %5.1f%% %9.1f %9.2f %9.2f %9.2f %9.2f %9.2f %s\n", t->rules->cats[c],
                m[0], m[1], m[2], m[3], tot > 0 ? 100.0 * m[0] / tot : 0.0,
                u->nsteps ? (double)g->in_count / u->nsteps : 0.0, g->mean_ns / 1e3, g->p50_ns / 1e3, g->p90_ns / 1e3,
                g->p99_ns / 1e3, g->max_ns / 1e3, g->heavy ? "HEAVY" : "");
    }
    fprintf(o, "%-14s %9.3f\n", "total", tot);
    size_t nk = u->nkern < (size_t)top ? u->nkern : (size_t)top;
    fprintf(o, "\ntop %zu of %zu kernels by total time (whole trace: count, total; per step: inside steps)\n", nk, u->nkern);
    fprintf(o, "%9s %9s %8s %9s %9s %9s %9s %9s %5s %-12s %s\n", "total_ms", "ms/step", "n/step", "mean_us", "p50_us",
            "p90_us", "p99_us", "max_us", "tail", "category", "name");
    char nm[88];
    for (size_t i = 0; i < nk; i++) {
        const fm_trace_kernel *k = &u->kern[i];
        short_name(k->name, nm, sizeof nm);
        fprintf(o, "%9.3f %9.3f %8.2f %9.2f %9.2f %9.2f %9.2f %9.2f %5s %-12s %s\n", k->total_us / 1e3, k->ms_per_step,
                k->per_step, k->mean_us, k->p50_us, k->p90_us, k->p99_us, k->max_us, k->heavy_tail ? "HEAVY" : "",
                k->category, nm);
    }
    /* uncategorized: always listed so that users can extend the rules */
    size_t nu = 0;
    for (size_t i = 0; i < u->nkern; i++)
        if (u->kern[i].category == t->rules->cats[FM_CAT_OTHER]) nu++;
    if (nu) {
        fprintf(o, "\nuncategorized kernels (\"other\"): %zu names; the top ones by time (extend with --rules FILE):\n", nu);
        size_t shown = 0;
        for (size_t i = 0; i < u->nkern && shown < 10; i++) {
            const fm_trace_kernel *k = &u->kern[i];
            if (k->category != t->rules->cats[FM_CAT_OTHER]) continue;
            short_name(k->name, nm, sizeof nm);
            fprintf(o, "%9.3f ms %8lld calls  %s\n", k->total_us / 1e3, (long long)k->count, nm);
            shown++;
        }
    }
    for (int i = 0; i < u->nnotes; i++) fprintf(o, "note: %s\n", u->notes[i]);
    fprintf(o, "\n");
}

/* -------------------------------------------------------------------- CSV */

static void csv_str(FILE *o, const char *s) {
    if (!strpbrk(s, ",\"\n\r")) {
        fputs(s, o);
        return;
    }
    fputc('"', o);
    for (; *s; s++) {
        if (*s == '"') fputc('"', o);
        fputc(*s, o);
    }
    fputc('"', o);
}

static void csv_summary(const fm_tr_unit *u, FILE *o) {
    fprintf(o, "name,category,count,total_us,mean_us,p50_us,p90_us,p99_us,max_us\n");
    for (size_t i = 0; i < u->nkern; i++) {
        const fm_trace_kernel *k = &u->kern[i];
        csv_str(o, k->name);
        fputc(',', o);
        csv_str(o, k->category);
        fprintf(o, ",%lld,%.3f,%.3f,%.3f,%.3f,%.3f,%.3f\n", (long long)k->count, k->total_us, k->mean_us, k->p50_us,
                k->p90_us, k->p99_us, k->max_us);
    }
}

/* ------------------------------------------------------------------- JSON */

static json_t *jnum(double v) { return json_real(isfinite(v) ? v : 0.0); }

static json_t *json_unit(const fm_trace *t, const fm_tr_unit *u) {
    json_t *j = json_object();
    json_object_set_new(j, "label", json_string(u->label));
    json_t *fl = json_array();
    for (int i = 0; i < u->nfiles; i++) json_array_append_new(fl, json_string(u->files[i]));
    json_object_set_new(j, "files", fl);
    json_object_set_new(j, "bytes", json_integer((json_int_t)u->bytes));
    json_object_set_new(j, "parse_s", jnum(u->parse_s));
    json_t *st = json_object();
    json_object_set_new(st, "count", json_integer(u->nsteps));
    json_object_set_new(st, "method", json_string(u->method));
    json_object_set_new(st, "whole_trace", json_boolean(u->whole_trace));
    json_object_set_new(st, "wall_ms", jnum(u->info.wall_ms));
    json_object_set_new(st, "wall_sd_ms", jnum(u->wall_sd));
    json_object_set_new(st, "busy_ms", jnum(u->info.busy_ms));
    json_object_set_new(st, "idle_ms", jnum(u->info.idle_ms));
    json_object_set_new(st, "gap_ms", jnum(u->info.gap_ms));
    json_object_set_new(st, "comm_ms", jnum(u->info.comm_ms));
    json_object_set_new(st, "comm_overlap_ms", jnum(u->info.overlap_ms));
    json_object_set_new(st, "outside_events", json_integer(u->outside_events));
    json_object_set_new(st, "outside_ms", jnum(u->outside_ns / 1e6));
    json_t *per = json_array();
    for (int s = 0; s < u->nsteps && s < 100000; s++) {
        const fm_tr_step *x = &u->steps[s];
        json_t *e = json_object();
        json_object_set_new(e, "num", json_integer(x->num));
        json_object_set_new(e, "rank", json_integer(x->rank));
        json_object_set_new(e, "wall_ms", jnum(x->wall / 1e6));
        json_object_set_new(e, "busy_ms", jnum(x->busy / 1e6));
        json_object_set_new(e, "comm_ms", jnum(x->comm / 1e6));
        json_object_set_new(e, "comm_overlap_ms", jnum(x->overlap / 1e6));
        json_object_set_new(e, "events", json_integer(x->n_events));
        json_t *cm = json_object();
        for (size_t c = 0; c < t->rules->ncats; c++) {
            double v = u->step_cat_ns[(size_t)s * t->rules->ncats + c];
            if (v > 0) json_object_set_new(cm, t->rules->cats[c], jnum(v / 1e6));
        }
        json_object_set_new(e, "category_ms", cm);
        json_array_append_new(per, e);
    }
    json_object_set_new(st, "steps", per);
    json_object_set_new(j, "steps", st);
    json_t *cats = json_array();
    size_t ord[300];
    size_t no = cat_order(t, ord);
    for (size_t i = 0; i < no; i++) {
        size_t c = ord[i];
        const fm_tr_gstat *g = &u->cats[c];
        json_t *e = json_object();
        json_object_set_new(e, "category", json_string(t->rules->cats[c]));
        json_object_set_new(e, "ms_per_step", jnum(u->cat_ms[4 * c]));
        json_object_set_new(e, "sd_ms", jnum(u->cat_ms[4 * c + 1]));
        json_object_set_new(e, "min_ms", jnum(u->cat_ms[4 * c + 2]));
        json_object_set_new(e, "max_ms", jnum(u->cat_ms[4 * c + 3]));
        json_object_set_new(e, "count", json_integer(g->count));
        json_object_set_new(e, "per_step", jnum(u->nsteps ? (double)g->in_count / u->nsteps : 0));
        json_object_set_new(e, "total_us", jnum(g->total_ns / 1e3));
        json_object_set_new(e, "mean_us", jnum(g->mean_ns / 1e3));
        json_object_set_new(e, "p50_us", jnum(g->p50_ns / 1e3));
        json_object_set_new(e, "p90_us", jnum(g->p90_ns / 1e3));
        json_object_set_new(e, "p99_us", jnum(g->p99_ns / 1e3));
        json_object_set_new(e, "max_us", jnum(g->max_ns / 1e3));
        json_object_set_new(e, "heavy_tail", json_boolean(g->heavy));
        json_array_append_new(cats, e);
    }
    json_object_set_new(j, "categories", cats);
    json_object_set_new(j, "total_ms_per_step", jnum(unit_total_ms(t, u)));
    json_t *ks = json_array();
    for (size_t i = 0; i < u->nkern; i++) {
        const fm_trace_kernel *k = &u->kern[i];
        json_t *e = json_object();
        json_object_set_new(e, "name", json_string(k->name));
        json_object_set_new(e, "category", json_string(k->category));
        json_object_set_new(e, "count", json_integer(k->count));
        json_object_set_new(e, "total_us", jnum(k->total_us));
        json_object_set_new(e, "mean_us", jnum(k->mean_us));
        json_object_set_new(e, "p50_us", jnum(k->p50_us));
        json_object_set_new(e, "p90_us", jnum(k->p90_us));
        json_object_set_new(e, "p99_us", jnum(k->p99_us));
        json_object_set_new(e, "max_us", jnum(k->max_us));
        json_object_set_new(e, "per_step", jnum(k->per_step));
        json_object_set_new(e, "ms_per_step", jnum(k->ms_per_step));
        json_object_set_new(e, "heavy_tail", json_boolean(k->heavy_tail));
        json_array_append_new(ks, e);
    }
    json_object_set_new(j, "kernels", ks);
    json_t *notes = json_array();
    for (int i = 0; i < u->nnotes; i++) json_array_append_new(notes, json_string(u->notes[i]));
    json_object_set_new(j, "notes", notes);
    return j;
}

static fm_status json_out(json_t *root, FILE *o) {
    if (!root) return fm_error(FM_E_NOMEM, "out of memory building JSON");
    int rc = json_dumpf(root, o, JSON_INDENT(1) | JSON_REAL_PRECISION(10));
    json_decref(root);
    fputc('\n', o);
    return rc == 0 ? FM_OK : fm_error(FM_E_IO, "writing JSON failed");
}

/* ------------------------------------------------------------------- HTML */

static void html_esc(FILE *o, const char *s) {
    for (; *s; s++) {
        switch (*s) {
        case '<': fputs("&lt;", o); break;
        case '>': fputs("&gt;", o); break;
        case '&': fputs("&amp;", o); break;
        case '"': fputs("&quot;", o); break;
        default: fputc(*s, o);
        }
    }
}

static const char *k_colors[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948",
                                 "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"};

static void html_head(FILE *o, const char *title) {
    fprintf(o, "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>");
    html_esc(o, title);
    fprintf(o, "</title>\n<style>body{font-family:sans-serif;margin:2em;max-width:1200px}"
               "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:2px 6px;"
               "font-size:13px}td.n{text-align:right;font-family:monospace}th{background:#eee}"
               ".heavy{color:#c00;font-weight:bold}.nm{font-family:monospace;font-size:12px}</style></head><body>\n<h1>");
    html_esc(o, title);
    fprintf(o, "</h1>\n");
}

/* Horizontal bars: one group per category, one bar per series. */
static void svg_bars(FILE *o, const char *const *labels, const double *vals, int nrows, int nser,
                     const char *const *sernames) {
    double mx = 0;
    for (int i = 0; i < nrows * nser; i++)
        if (vals[i] > mx) mx = vals[i];
    if (mx <= 0) mx = 1;
    int bh = 14, gap = 8, left = 130, width = 520;
    int h = nrows * (nser * bh + gap) + 30;
    fprintf(o, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" font-size=\"12\">\n",
            left + width + 110, h);
    for (int r = 0; r < nrows; r++) {
        int y0 = r * (nser * bh + gap) + 20;
        fprintf(o, "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">", left - 6, y0 + nser * bh / 2 + 4);
        html_esc(o, labels[r]);
        fprintf(o, "</text>\n");
        for (int s = 0; s < nser; s++) {
            double v = vals[r * nser + s];
            double w = v / mx * width;
            fprintf(o, "<rect x=\"%d\" y=\"%d\" width=\"%.1f\" height=\"%d\" fill=\"%s\"/>", left, y0 + s * bh, w, bh - 2,
                    k_colors[s % 10]);
            fprintf(o, "<text x=\"%.1f\" y=\"%d\">%.3f</text>\n", left + w + 4, y0 + s * bh + bh - 4, v);
        }
    }
    for (int s = 0; s < nser && sernames; s++) {
        fprintf(o, "<rect x=\"%d\" y=\"2\" width=\"10\" height=\"10\" fill=\"%s\"/><text x=\"%d\" y=\"11\">", left + s * 200,
                k_colors[s % 10], left + s * 200 + 14);
        html_esc(o, sernames[s]);
        fprintf(o, "</text>\n");
    }
    fprintf(o, "</svg>\n");
}

static void html_unit(const fm_trace *t, const fm_tr_unit *u, FILE *o, int top) {
    size_t ord[300];
    size_t no = cat_order(t, ord);
    fprintf(o, "<h2>");
    html_esc(o, u->label);
    fprintf(o, "</h2>\n<p>steps: ");
    html_esc(o, u->method);
    fprintf(o, "<br>per step: wall %.3f ms, GPU busy %.3f ms, idle %.3f ms; communication %.3f ms, %.3f ms overlapped "
               "with compute</p>\n",
            u->info.wall_ms, u->info.busy_ms, u->info.idle_ms, u->info.comm_ms, u->info.overlap_ms);
    const char *labels[300];
    double vals[300];
    int nr = 0;
    for (size_t i = 0; i < no; i++)
        if (u->cats[ord[i]].count) {
            labels[nr] = t->rules->cats[ord[i]];
            vals[nr] = u->cat_ms[4 * ord[i]];
            nr++;
        }
    fprintf(o, "<h3>ms per step by category</h3>\n");
    svg_bars(o, labels, vals, nr, 1, NULL);
    fprintf(o, "<table><tr><th>category</th><th>ms/step</th><th>sd</th><th>n/step</th><th>mean us</th><th>p50 us</th>"
               "<th>p90 us</th><th>p99 us</th><th>max us</th></tr>\n");
    for (size_t i = 0; i < no; i++) {
        size_t c = ord[i];
        const fm_tr_gstat *g = &u->cats[c];
        if (!g->count) continue;
        fprintf(o, "<tr><td>%s</td><td class=n>%.3f</td><td class=n>%.3f</td><td class=n>%.1f</td><td class=n%s>%.2f</td>"
                   "<td class=n>%.2f</td><td class=n>%.2f</td><td class=n>%.2f</td><td class=n>%.2f</td></tr>\n",
                t->rules->cats[c], u->cat_ms[4 * c], u->cat_ms[4 * c + 1],
                u->nsteps ? (double)g->in_count / u->nsteps : 0.0, g->heavy ? " heavy" : "", g->mean_ns / 1e3,
                g->p50_ns / 1e3, g->p90_ns / 1e3, g->p99_ns / 1e3, g->max_ns / 1e3);
    }
    fprintf(o, "</table>\n<h3>top kernels</h3>\n<table><tr><th>total ms</th><th>ms/step</th><th>n/step</th><th>mean us</th>"
               "<th>p50 us</th><th>p99 us</th><th>max us</th><th>category</th><th>name</th></tr>\n");
    for (size_t i = 0; i < u->nkern && i < (size_t)top; i++) {
        const fm_trace_kernel *k = &u->kern[i];
        fprintf(o, "<tr><td class=n>%.3f</td><td class=n>%.3f</td><td class=n>%.2f</td><td class=\"n%s\">%.2f</td>"
                   "<td class=n>%.2f</td><td class=n>%.2f</td><td class=n>%.2f</td><td>%s</td><td class=nm>",
                k->total_us / 1e3, k->ms_per_step, k->per_step, k->heavy_tail ? " heavy" : "", k->mean_us, k->p50_us,
                k->p99_us, k->max_us, k->category);
        html_esc(o, k->name);
        fprintf(o, "</td></tr>\n");
    }
    fprintf(o, "</table>\n");
    int head = 0;
    for (size_t i = 0, shown = 0; i < u->nkern && shown < 10; i++) {
        const fm_trace_kernel *k = &u->kern[i];
        if (k->category != t->rules->cats[FM_CAT_OTHER]) continue;
        if (!head) {
            fprintf(o, "<h3>uncategorized kernels (extend with --rules FILE)</h3>\n<table><tr><th>total ms</th>"
                       "<th>count</th><th>name</th></tr>\n");
            head = 1;
        }
        fprintf(o, "<tr><td class=n>%.3f</td><td class=n>%lld</td><td class=nm>", k->total_us / 1e3, (long long)k->count);
        html_esc(o, k->name);
        fprintf(o, "</td></tr>\n");
        shown++;
    }
    if (head) fprintf(o, "</table>\n");
    for (int i = 0; i < u->nnotes; i++) {
        fprintf(o, "<p>note: ");
        html_esc(o, u->notes[i]);
        fprintf(o, "</p>\n");
    }
}

/* ---------------------------------------------------------------- summary */

fm_status fm_trace_write_summary(const fm_trace *t, fm_trace_format f, FILE *o) {
    int top = t->opts.top;
    switch (f) {
    case FM_TRACE_TEXT:
        fprintf(o, "fp4moe trace summary: %d file%s, %d rank%s\n\n", t->all.nfiles, t->all.nfiles == 1 ? "" : "s",
                t->nranks, t->nranks == 1 ? "" : "s");
        for (int r = 0; r < t->nranks; r++) text_unit(t, &t->ranks[r], o, top);
        if (t->nranks > 1) text_unit(t, &t->all, o, top);
        break;
    case FM_TRACE_CSV: csv_summary(&t->all, o); break;
    case FM_TRACE_JSON: {
        json_t *root = json_object();
        json_object_set_new(root, "tool", json_string("fp4moe trace summary"));
        json_object_set_new(root, "version", json_string(FM_VERSION));
        json_t *ranks = json_array();
        for (int r = 0; r < t->nranks; r++) json_array_append_new(ranks, json_unit(t, &t->ranks[r]));
        json_object_set_new(root, "ranks", ranks);
        json_object_set_new(root, "combined", json_unit(t, &t->all));
        return json_out(root, o);
    }
    case FM_TRACE_HTML:
        html_head(o, "fp4moe trace summary");
        for (int r = 0; r < t->nranks; r++) html_unit(t, &t->ranks[r], o, top);
        if (t->nranks > 1) html_unit(t, &t->all, o, top);
        fprintf(o, "</body></html>\n");
        break;
    default: return fm_error(FM_E_ARG, "unknown output format %d", (int)f);
    }
    return ferror(o) ? fm_error(FM_E_IO, "writing the summary failed") : FM_OK;
}

/* ------------------------------------------------------------------- diff */

typedef struct {
    const char *name;
    const char *cat;
    double a_ms, b_ms, a_n, b_n;
} kdelta;

static int cmp_kdelta(const void *x, const void *y) {
    const kdelta *a = x, *b = y;
    double da = fabs(a->b_ms - a->a_ms), db = fabs(b->b_ms - b->a_ms);
    if (da != db) return da < db ? 1 : -1;
    return strcmp(a->name, b->name);
}

fm_status fm_trace_write_diff(const fm_trace *A, const fm_trace *B, fm_trace_format f, FILE *o) {
    const fm_tr_unit *ua = &A->all, *ub = &B->all;
    /* categories: the union, in display order of A then B's extra ones */
    const char *cats[600];
    double av[600], bv[600];
    size_t nc = 0;
    size_t ord[300];
    size_t no = cat_order(A, ord);
    for (size_t i = 0; i < no; i++) cats[nc++] = A->rules->cats[ord[i]];
    no = cat_order(B, ord);
    for (size_t i = 0; i < no; i++) {
        int seen = 0;
        for (size_t j = 0; j < nc; j++) seen |= strcmp(cats[j], B->rules->cats[ord[i]]) == 0;
        if (!seen) cats[nc++] = B->rules->cats[ord[i]];
    }
    double ta = 0, tb = 0;
    for (size_t i = 0; i < nc; i++) {
        av[i] = fm_trace_category_ms(A, -1, cats[i]);
        bv[i] = fm_trace_category_ms(B, -1, cats[i]);
        ta += av[i];
        tb += bv[i];
    }
    double td = tb - ta;
    /* per kernel, matched by name */
    fm_tr_strtab tab;
    if (fm_tr_strtab_init(&tab) != FM_OK) return FM_E_NOMEM;
    kdelta *kd = fm_calloc(ua->nkern + ub->nkern + 1, sizeof *kd);
    if (!kd) {
        fm_tr_strtab_free(&tab);
        return FM_E_NOMEM;
    }
    size_t nk = 0;
    fm_status st = FM_OK;
    for (int side = 0; side < 2 && st == FM_OK; side++) {
        const fm_tr_unit *u = side ? ub : ua;
        for (size_t i = 0; i < u->nkern; i++) {
            const fm_trace_kernel *k = &u->kern[i];
            int64_t id = fm_tr_strtab_intern(&tab, k->name, strlen(k->name));
            if (id < 0) {
                st = FM_E_NOMEM;
                break;
            }
            if ((size_t)id == nk) {
                kd[nk].name = k->name;
                kd[nk].cat = k->category;
                nk++;
            }
            if (side) {
                kd[id].b_ms = k->ms_per_step;
                kd[id].b_n = k->per_step;
            } else {
                kd[id].a_ms = k->ms_per_step;
                kd[id].a_n = k->per_step;
            }
        }
    }
    fm_tr_strtab_free(&tab);
    if (st != FM_OK) {
        free(kd);
        return st;
    }
    qsort(kd, nk, sizeof *kd, cmp_kdelta);
    size_t top = (size_t)A->opts.top;
    char nm[88];
    switch (f) {
    case FM_TRACE_CSV:
        fprintf(o, "category,a_ms_per_step,b_ms_per_step,delta_ms,share_of_delta\n");
        for (size_t i = 0; i < nc; i++) {
            csv_str(o, cats[i]);
            double d = bv[i] - av[i];
            if (fabs(td) > 1e-12) fprintf(o, ",%.4f,%.4f,%.4f,%.4f\n", av[i], bv[i], d, d / td);
            else fprintf(o, ",%.4f,%.4f,%.4f,nan\n", av[i], bv[i], d);
        }
        fprintf(o, "total,%.4f,%.4f,%.4f,%s\n", ta, tb, td, fabs(td) > 1e-12 ? "1.0000" : "nan");
        break;
    case FM_TRACE_TEXT:
        fprintf(o, "fp4moe trace diff\nA: %s, %s\nB: %s, %s\n\n", ua->label, ua->method, ub->label, ub->method);
        fprintf(o, "%-14s %12s %12s %10s %8s\n", "category", "A (ms/step)", "B (ms/step)", "delta", "share");
        for (size_t i = 0; i < nc; i++) {
            if (av[i] == 0 && bv[i] == 0) continue;
            double d = bv[i] - av[i];
            fprintf(o, "%-14s %12.3f %12.3f %+10.3f ", cats[i], av[i], bv[i], d);
            if (fabs(td) > 1e-12) fprintf(o, "%7.1f%%\n", 100.0 * d / td);
            else fprintf(o, "%8s\n", "-");
        }
        fprintf(o, "%-14s %12.3f %12.3f %+10.3f\n", "total", ta, tb, td);
        fprintf(o, "\nkernels that explain the delta (top %zu by |delta| of ms/step):\n", top < nk ? top : nk);
        fprintf(o, "%10s %10s %10s %8s %8s %-12s %s\n", "delta_ms", "A_ms", "B_ms", "A_n", "B_n", "category", "name");
        for (size_t i = 0; i < nk && i < top; i++) {
            short_name(kd[i].name, nm, sizeof nm);
            fprintf(o, "%+10.3f %10.3f %10.3f %8.2f %8.2f %-12s %s\n", kd[i].b_ms - kd[i].a_ms, kd[i].a_ms, kd[i].b_ms,
                    kd[i].a_n, kd[i].b_n, kd[i].cat, nm);
        }
        break;
    case FM_TRACE_JSON: {
        json_t *root = json_object();
        json_object_set_new(root, "tool", json_string("fp4moe trace diff"));
        json_object_set_new(root, "a", json_unit(A, ua));
        json_object_set_new(root, "b", json_unit(B, ub));
        json_t *cs = json_array();
        for (size_t i = 0; i < nc; i++) {
            json_t *e = json_object();
            json_object_set_new(e, "category", json_string(cats[i]));
            json_object_set_new(e, "a_ms_per_step", jnum(av[i]));
            json_object_set_new(e, "b_ms_per_step", jnum(bv[i]));
            json_object_set_new(e, "delta_ms", jnum(bv[i] - av[i]));
            json_object_set_new(e, "share_of_delta", fabs(td) > 1e-12 ? jnum((bv[i] - av[i]) / td) : json_null());
            json_array_append_new(cs, e);
        }
        json_object_set_new(root, "categories", cs);
        json_t *tt = json_object();
        json_object_set_new(tt, "a_ms_per_step", jnum(ta));
        json_object_set_new(tt, "b_ms_per_step", jnum(tb));
        json_object_set_new(tt, "delta_ms", jnum(td));
        json_object_set_new(root, "total", tt);
        json_t *ks = json_array();
        for (size_t i = 0; i < nk; i++) {
            json_t *e = json_object();
            json_object_set_new(e, "name", json_string(kd[i].name));
            json_object_set_new(e, "category", json_string(kd[i].cat));
            json_object_set_new(e, "a_ms_per_step", jnum(kd[i].a_ms));
            json_object_set_new(e, "b_ms_per_step", jnum(kd[i].b_ms));
            json_object_set_new(e, "delta_ms", jnum(kd[i].b_ms - kd[i].a_ms));
            json_object_set_new(e, "a_per_step", jnum(kd[i].a_n));
            json_object_set_new(e, "b_per_step", jnum(kd[i].b_n));
            json_array_append_new(ks, e);
        }
        json_object_set_new(root, "kernels", ks);
        free(kd);
        return json_out(root, o);
    }
    case FM_TRACE_HTML: {
        html_head(o, "fp4moe trace diff");
        fprintf(o, "<p>A: ");
        html_esc(o, ua->label);
        fprintf(o, " (");
        html_esc(o, ua->method);
        fprintf(o, ")<br>B: ");
        html_esc(o, ub->label);
        fprintf(o, " (");
        html_esc(o, ub->method);
        fprintf(o, ")</p>\n");
        const char *labels[600];
        double vals[1200];
        int nr = 0;
        for (size_t i = 0; i < nc; i++) {
            if (av[i] == 0 && bv[i] == 0) continue;
            labels[nr] = cats[i];
            vals[2 * nr] = av[i];
            vals[2 * nr + 1] = bv[i];
            nr++;
        }
        const char *sn[2] = {"A", "B"};
        svg_bars(o, labels, vals, nr, 2, sn);
        fprintf(o, "<table><tr><th>category</th><th>A ms/step</th><th>B ms/step</th><th>delta</th><th>share</th></tr>\n");
        for (size_t i = 0; i < nc; i++) {
            if (av[i] == 0 && bv[i] == 0) continue;
            fprintf(o, "<tr><td>%s</td><td class=n>%.3f</td><td class=n>%.3f</td><td class=n>%+.3f</td><td class=n>",
                    cats[i], av[i], bv[i], bv[i] - av[i]);
            if (fabs(td) > 1e-12) fprintf(o, "%.1f%%", 100.0 * (bv[i] - av[i]) / td);
            fprintf(o, "</td></tr>\n");
        }
        fprintf(o, "<tr><th>total</th><td class=n>%.3f</td><td class=n>%.3f</td><td class=n>%+.3f</td><td></td></tr>"
                   "</table>\n<h3>kernels that explain the delta</h3>\n<table><tr><th>delta ms</th><th>A ms</th>"
                   "<th>B ms</th><th>category</th><th>name</th></tr>\n",
                ta, tb, td);
        for (size_t i = 0; i < nk && i < top; i++) {
            fprintf(o, "<tr><td class=n>%+.3f</td><td class=n>%.3f</td><td class=n>%.3f</td><td>%s</td><td class=nm>",
                    kd[i].b_ms - kd[i].a_ms, kd[i].a_ms, kd[i].b_ms, kd[i].cat);
            html_esc(o, kd[i].name);
            fprintf(o, "</td></tr>\n");
        }
        fprintf(o, "</table></body></html>\n");
        break;
    }
    default:
        free(kd);
        return fm_error(FM_E_ARG, "unknown output format %d", (int)f);
    }
    free(kd);
    return ferror(o) ? fm_error(FM_E_IO, "writing the diff failed") : FM_OK;
}
