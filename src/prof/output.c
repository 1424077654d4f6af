/* A profile's renderings: text tables, JSON, Chrome trace JSON, and the
 * atomic writing of the output files. */
#include "prof/prof_internal.h"

#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Enough spans for a long run; beyond it the trace says how many it lost
 * rather than growing without bound. */
#define MAX_SPANS 2000000

/* ------------------------------------------------------------ fm_sb */

void fm_sb_printf(fm_sb *sb, const char *fmt, ...) {
    if (sb->failed) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        size_t room = sb->cap - sb->len;
        int n = vsnprintf(sb->buf ? sb->buf + sb->len : NULL, sb->buf ? room : 0, fmt, ap);
        va_end(ap);
        if (n < 0) {
            sb->failed = 1;
            return;
        }
        if (sb->buf && (size_t)n < room) {
            sb->len += (size_t)n;
            return;
        }
        size_t need = sb->len + (size_t)n + 1, nc = sb->cap ? sb->cap : 4096;
        while (nc < need) nc *= 2;
        char *nb = realloc(sb->buf, nc);
        if (!nb) {
            sb->failed = 1;
            return;
        }
        sb->buf = nb;
        sb->cap = nc;
    }
}

void fm_sb_puts(fm_sb *sb, const char *s) { fm_sb_printf(sb, "%s", s); }

void fm_sb_escape(fm_sb *sb, const char *s) {
    for (; s && *s; s++) {
        switch (*s) {
        case '&': fm_sb_puts(sb, "&amp;"); break;
        case '<': fm_sb_puts(sb, "&lt;"); break;
        case '>': fm_sb_puts(sb, "&gt;"); break;
        case '"': fm_sb_puts(sb, "&quot;"); break;
        case '\'': fm_sb_puts(sb, "&#39;"); break;
        default: fm_sb_printf(sb, "%c", *s);
        }
    }
}

fm_status fm_sb_finish(fm_sb *sb, char **out) {
    if (sb->failed || !sb->buf) {
        fm_sb_free(sb);
        return fm_error(FM_E_NOMEM, "out of memory rendering the profile");
    }
    *out = sb->buf;
    sb->buf = NULL;
    sb->len = sb->cap = 0;
    return FM_OK;
}

void fm_sb_free(fm_sb *sb) {
    free(sb->buf);
    sb->buf = NULL;
    sb->len = sb->cap = 0;
}

/* ------------------------------------------------------- the profile */

fm_profile *fm_profile_new(void) {
    fm_profile *p = fm_calloc(1, sizeof *p);
    return p;
}

void fm_profile_free(fm_profile *p) {
    if (!p) return;
    free(p->spans);
    free(p->samples);
    free(p);
}

void fm_profile_add_span(fm_profile *p, const fm_prof_span *s) {
    if (p->n_spans == p->cap_spans) {
        size_t nc = p->cap_spans ? 2 * p->cap_spans : 1024;
        fm_prof_span *ns = nc <= MAX_SPANS ? realloc(p->spans, nc * sizeof *ns) : NULL;
        if (!ns) {
            p->spans_dropped++;
            return;
        }
        p->spans = ns;
        p->cap_spans = nc;
    }
    p->spans[p->n_spans++] = *s;
}

const char *fm_prof_row_color(int row) {
    static const char *const c[FM_PROF_ROWS] = {
        "#4e79a7", /* routing */
        "#f28e2b", /* sort */
        "#e15759", /* gate_up */
        "#76b7b2", /* activation */
        "#59a14f", /* down */
        "#edc948", /* combine */
        "#b07aa1", /* shared */
        "#9c755f", /* other */
        "#bab0ac", /* unattributed */
        "#333333", /* total */
    };
    return row >= 0 && row < FM_PROF_ROWS ? c[row] : "#000000";
}

/* ------------------------------------------------------------ text */

static int cmp_kernel_row(const void *a, const void *b) {
    const fm_prof_kernel_row *x = a, *y = b;
    return x->us < y->us ? 1 : x->us > y->us ? -1 : 0;
}

int fm_prof_kernel_rows(const fm_profile *p, int bi, fm_prof_kernel_row *rows, int cap, int *steps) {
    int n = 0, max_step = -1;
    for (size_t i = 0; i < p->n_spans; i++) {
        const fm_prof_span *s = &p->spans[i];
        if (s->kind != 4 || s->batch_index != bi || s->step < 0) continue;
        if (s->step > max_step) max_step = s->step;
        int j = 0;
        /* by name and phase: one template runs the routed experts and, on
         * its own stream, the shared expert */
        while (j < n && (rows[j].phase != s->phase || strcmp(rows[j].name, s->name))) j++;
        if (j == n) {
            if (n == cap) continue;
            rows[n++] = (fm_prof_kernel_row){s->name, s->phase, 0, 0};
        }
        rows[j].launches += 1;
        rows[j].us += s->dur_us;
    }
    int st = max_step + 1;
    for (int j = 0; j < n && st > 0; j++) {
        rows[j].launches /= st;
        rows[j].us /= st;
    }
    qsort(rows, (size_t)n, sizeof *rows, cmp_kernel_row);
    if (steps) *steps = st;
    return n;
}

void fm_prof_fmt_tile(char *buf, size_t cap, const fm_prof_batch *b) {
    if (b->tile_fill < 0)
        snprintf(buf, cap, "n/a (not tiled)");
    else
        snprintf(buf, cap, "%.1f %% of %d%s", 100 * b->tile_fill, b->tile_n, b->tile_fill_is_expected ? " (expected)" : "");
}

const char *fm_prof_metric_title(fm_telem_metric m) {
    switch (m) {
    case FM_TM_SM_UTIL: return "SM utilization %";
    case FM_TM_MEM_UTIL: return "memory-controller utilization %";
    case FM_TM_POWER_W: return "power W";
    case FM_TM_SM_MHZ: return "SM clock MHz";
    case FM_TM_MEM_MHZ: return "memory clock MHz";
    case FM_TM_TEMP_C: return "temperature C";
    case FM_TM_CPU_UTIL: return "host CPU utilization %";
    case FM_TM_PROC_UTIL: return "fp4moe CPU utilization %";
    default: return NULL;
    }
}

void fm_prof_fmt_ms(char *buf, size_t cap, const fm_profile *p, int row, double ns) {
    if (row < FM_PH_COUNT && (p->fused_mask >> row & 1u) && ns == 0.0)
        snprintf(buf, cap, "fused");
    else
        snprintf(buf, cap, "%.3f", ns * 1e-6);
}

static void print_delta(const fm_profile *p, int ia, int ib, FILE *f) {
    const fm_prof_batch *a = &p->b[ia], *b = &p->b[ib];
    double d[FM_PROF_ROWS], sh[FM_PROF_ROWS];
    fm_prof_delta(a, b, d, sh);
    fprintf(f, "\ndelta between batch %d and %d (ms per step; share of the marginal cost):\n", a->batch, b->batch);
    fprintf(f, "| phase | bs %d (ms/step) | bs %d (ms/step) | delta | share |\n|---|---|---|---|---|\n", a->batch,
            b->batch);
    for (int r = 0; r < FM_PROF_ROWS; r++) {
        char x[32], y[32], s[32];
        fm_prof_fmt_ms(x, sizeof x, p, r, a->row_ns[r]);
        fm_prof_fmt_ms(y, sizeof y, p, r, b->row_ns[r]);
        if (isnan(sh[r]))
            snprintf(s, sizeof s, "n/a");
        else
            snprintf(s, sizeof s, "%.1f %%", sh[r]);
        fprintf(f, "| %s | %s | %s | %+.3f | %s |\n", fm_prof_row_name(r), x, y, d[r] * 1e-6, s);
    }
}

static void fmt_metric(char *buf, size_t cap, double mean, double max, const char *unit) {
    if (isnan(mean))
        snprintf(buf, cap, "-");
    else
        snprintf(buf, cap, "%.0f/%.0f%s", mean, max, unit);
}

void fm_prof_fmt_read(char *buf, size_t cap, const fm_profile *p) {
    const fm_telem_summary *t = &p->read_telem;
    const double w = t->mean[FM_TM_POWER_W], lim = t->mean[FM_TM_POWER_LIMIT_W], mhz = t->mean[FM_TM_SM_MHZ];
    if (!(p->read_s > 0)) {
        snprintf(buf, cap, "not measured (%s)",
                 p->device != FM_DEV_CUDA ? "GPU only" : "no NVML power readings, or --read-power-s 0");
        return;
    }
    int n = snprintf(buf, cap, "%.2f TB/s for %.1f s", p->read_Bps / 1e12, p->read_s);
    if (n < 0 || (size_t)n >= cap) return;
    if (isnan(w)) {
        snprintf(buf + n, cap - n, ": no power readings in its settled part");
        return;
    }
    char thr[128];
    fm_telemetry_throttle_str(t->throttle_any, thr, sizeof thr);
    int m = snprintf(buf + n, cap - n, ": %.0f W mean", w);
    if (m < 0 || (size_t)m >= cap - n) return;
    n += m;
    if (!isnan(lim) && lim > 0) {
        m = snprintf(buf + n, cap - n, " (%.0f %% of the %.0f W limit)", 100.0 * w / lim, lim);
        if (m < 0 || (size_t)m >= cap - n) return;
        n += m;
    }
    if (!isnan(mhz)) {
        m = snprintf(buf + n, cap - n, ", SM clock %.0f MHz", mhz);
        if (m < 0 || (size_t)m >= cap - n) return;
        n += m;
    }
    snprintf(buf + n, cap - n, ", throttle %s", thr);
}

/* Every EP rank's load per batch and the one the step waits for. */
static void print_ep_load(const fm_profile *p, FILE *f) {
    fprintf(f, "\nEP ranks (pairs / active experts / MB per layer under the full routing; the step waits for the most "
               "loaded rank):\n");
    for (int i = 0; i < p->n_batch; i++) {
        const fm_prof_batch *b = &p->b[i];
        const fm_shard_load *ld = &b->load;
        const double n = b->load_calls > 0 ? b->load_calls : 1, L = p->layers_per_step;
        const double bw = p->bandwidth_Bps > 0 ? p->bandwidth_Bps : NAN;
        const int m = ld->max_rank;
        fprintf(f, "  batch %d:", b->batch);
        for (int r = 0; r < ld->ranks; r++)
            fprintf(f, " %d:%.1f/%.1f/%.2f", r, ld->pairs[r] / n, ld->active[r] / n, ld->bytes[r] / n / 1e6);
        fprintf(f, "\n    most loaded: rank %d%s, floor %.3f ms/step (this rank's %.3f ms)\n", m,
                m == p->shard.rank ? " (this one)" : "", 1e3 * ld->bytes[m] / n * L / bw,
                1e3 * ld->bytes[p->shard.rank] / n * L / bw);
    }
}

void fm_profile_print(const fm_profile *p, FILE *f) {
    fprintf(f, "model: %s (%s), %s, E=%d k=%d H=%d I=%d", p->model, p->family, fm_qformat_name(p->fmt), p->E, p->k,
            p->H, p->I);
    if (p->n_shared > 0) fprintf(f, ", shared expert I=%d", p->shared_inter);
    fprintf(f, "\ndevice: %s: %s\n", p->device == FM_DEV_CUDA ? "cuda" : "cpu", p->device_desc);
    if (p->provenance[0]) fprintf(f, "%s\n", p->provenance);
    fprintf(f, "times from: %s (%s)\n", fm_time_source_name(p->time_source), p->time_note);
    fprintf(f, "telemetry: %s\n", p->telem_note);
    fprintf(f, "bandwidth: %.2f GB/s (%s)\n", p->bandwidth_Bps / 1e9, p->bandwidth_note);
    if (p->device == FM_DEV_CUDA) {
        char rd[256];
        fm_prof_fmt_read(rd, sizeof rd, p);
        fprintf(f, "streaming read alone: %s\n", rd);
    }
    if (p->peak_flops > 0)
        fprintf(f, "compute peak: %.1f GFLOP/s (%s)\n", p->peak_flops / 1e9, p->peak_note);
    else
        fprintf(f, "compute peak: unknown (%s)\n", p->peak_note);
    fprintf(f, "step: %d MoE layer%s (the model has %d), %d distinct layer%s in memory, cycled; %d warm-up step%s\n",
            p->layers_per_step, p->layers_per_step == 1 ? "" : "s", p->model_moe_layers, p->layers_distinct,
            p->layers_distinct == 1 ? "" : "s", p->warmup, p->warmup == 1 ? "" : "s");

    for (int i = 0; i < p->n_batch; i++) {
        const fm_prof_batch *b = &p->b[i];
        fprintf(f, "\nbatch %d: %.3f ms/step (min %.3f, max %.3f over %d steps), %.0f tok/s\n", b->batch,
                b->step_ns * 1e-6, b->step_ns_min * 1e-6, b->step_ns_max * 1e-6, b->steps, b->tokens_per_s);
        fprintf(f, "  %-13s %10s %8s\n", "phase", "ms/step", "share");
        for (int r = 0; r < FM_PROF_ROWS; r++) {
            char x[32];
            fm_prof_fmt_ms(x, sizeof x, p, r, b->row_ns[r]);
            double share = b->step_ns > 0 ? 100.0 * b->row_ns[r] / b->step_ns : 0;
            fprintf(f, "  %-13s %10s %7.1f%%\n", fm_prof_row_name(r), x, share);
        }
        fm_prof_kernel_row kr[32];
        int steps = 0, nk = fm_prof_kernel_rows(p, i, kr, 32, &steps);
        if (nk > 0) {
            fprintf(f, "  kernels (per step, mean over %d graph replays):\n  %-60s %-10s %9s %11s\n", steps, "name",
                    "phase", "launches", "us/step");
            for (int j = 0; j < nk; j++)
                fprintf(f, "  %-60.60s %-10s %9.1f %11.2f\n", kr[j].name,
                        kr[j].phase >= 0 ? fm_phase_name((fm_phase)kr[j].phase) : "-", kr[j].launches, kr[j].us);
        }
    }
    for (int i = 0; i + 1 < p->n_batch; i++) print_delta(p, i, i + 1, f);

    fprintf(f, "\nperformance model (per step; floor = bytes that must be read / %.2f GB/s):\n", p->bandwidth_Bps / 1e9);
    fprintf(f, "| batch | active experts exp/obs | tokens/expert | MB read | floor ms | route+read ms | measured ms | "
               "%% of floor | GB/s | GFLOP/s | tile rows used |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < p->n_batch; i++) {
        const fm_prof_batch *b = &p->b[i];
        char tile[64];
        fm_prof_fmt_tile(tile, sizeof tile, b);
        char bound[32] = "-";
        if (b->bound_ns > 0) snprintf(bound, sizeof bound, "%.3f", b->bound_ns * 1e-6);
        fprintf(f, "| %d | %.1f / %.1f | %.2f | %.2f | %.3f | %s | %.3f | %.1f | %.2f | %.2f | %s |\n", b->batch,
                b->active_expected, b->active_observed, b->tokens_per_expert, b->bytes_per_step / 1e6,
                b->floor_ns * 1e-6, bound, b->step_ns * 1e-6, b->pct_of_floor, b->achieved_Bps / 1e9,
                b->achieved_flops / 1e9, tile);
    }
    if (p->shard.mode == FM_DIST_EP) print_ep_load(p, f);
    fprintf(f, "\ntelemetry per batch (mean/max) beside the throughput:\n");
    int gpu = 0;
    for (int i = 0; i < p->n_batch; i++)
        if (!isnan(p->b[i].telem.mean[FM_TM_SM_UTIL]) || !isnan(p->b[i].telem.mean[FM_TM_POWER_W])) gpu = 1;
    if (gpu)
        fprintf(f, "| batch | tok/s | samples | SM %% | mem %% | power W | of limit | SM MHz | mem MHz | temp C | "
                   "host CPU %% | throttle |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    else
        fprintf(f, "| batch | tok/s | samples | host CPU %% | fp4moe CPU %% |\n|---|---|---|---|---|\n");
    for (int i = 0; i < p->n_batch; i++) {
        const fm_telem_summary *t = &p->b[i].telem;
        char cpu[32], own[32];
        fmt_metric(cpu, sizeof cpu, t->mean[FM_TM_CPU_UTIL], t->max[FM_TM_CPU_UTIL], "");
        fmt_metric(own, sizeof own, t->mean[FM_TM_PROC_UTIL], t->max[FM_TM_PROC_UTIL], "");
        if (!gpu) {
            fprintf(f, "| %d | %.0f | %d | %s | %s |\n", p->b[i].batch, p->b[i].tokens_per_s, t->n, cpu, own);
            continue;
        }
        char sm[32], mem[32], pw[32], lim[32], smc[32], mc[32], tc[32], thr[128];
        fmt_metric(sm, sizeof sm, t->mean[FM_TM_SM_UTIL], t->max[FM_TM_SM_UTIL], "");
        fmt_metric(mem, sizeof mem, t->mean[FM_TM_MEM_UTIL], t->max[FM_TM_MEM_UTIL], "");
        fmt_metric(pw, sizeof pw, t->mean[FM_TM_POWER_W], t->max[FM_TM_POWER_W], "");
        if (!isnan(t->mean[FM_TM_POWER_W]) && t->mean[FM_TM_POWER_LIMIT_W] > 0)
            snprintf(lim, sizeof lim, "%.0f %% of %.0f W", 100 * t->mean[FM_TM_POWER_W] / t->mean[FM_TM_POWER_LIMIT_W],
                     t->mean[FM_TM_POWER_LIMIT_W]);
        else
            snprintf(lim, sizeof lim, "-");
        fmt_metric(smc, sizeof smc, t->mean[FM_TM_SM_MHZ], t->max[FM_TM_SM_MHZ], "");
        fmt_metric(mc, sizeof mc, t->mean[FM_TM_MEM_MHZ], t->max[FM_TM_MEM_MHZ], "");
        fmt_metric(tc, sizeof tc, t->mean[FM_TM_TEMP_C], t->max[FM_TM_TEMP_C], "");
        fm_telemetry_throttle_str(t->throttle_any, thr, sizeof thr);
        fprintf(f, "| %d | %.0f | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", p->b[i].batch,
                p->b[i].tokens_per_s, t->n, sm, mem, pw, lim,
                smc, mc, tc, cpu, thr);
    }
    fprintf(f, "\nverdict:\n");
    for (int i = 0; i < p->n_batch; i++) fprintf(f, "  batch %d: %s\n", p->b[i].batch, p->b[i].verdict_text);
    if (p->spans_dropped) fprintf(f, "note: %zu timeline spans dropped (trace too long)\n", p->spans_dropped);
}

/* ------------------------------------------------------------ JSON */

/* jansson refuses NaN and infinities: those become null. */
static json_t *jnum(double v) { return isfinite(v) ? json_real(v) : json_null(); }

static json_t *summary_json(const fm_telem_summary *t) {
    json_t *o = json_object(), *mean = json_object(), *max = json_object();
    for (int m = 0; m < FM_TM_COUNT; m++) {
        json_object_set_new(mean, fm_telem_metric_name((fm_telem_metric)m), jnum(t->mean[m]));
        json_object_set_new(max, fm_telem_metric_name((fm_telem_metric)m), jnum(t->max[m]));
    }
    char thr[256];
    fm_telemetry_throttle_str(t->throttle_any, thr, sizeof thr);
    json_object_set_new(o, "samples", json_integer(t->n));
    json_object_set_new(o, "mean", mean);
    json_object_set_new(o, "max", max);
    json_object_set_new(o, "throttle", json_string(thr));
    return o;
}

static json_t *rows_json(const double ns[FM_PROF_ROWS]) {
    json_t *o = json_object();
    for (int r = 0; r < FM_PROF_ROWS; r++) json_object_set_new(o, fm_prof_row_name(r), jnum(ns[r] * 1e-6));
    return o;
}

/* An EP rank's batch: every rank's pairs, active experts and bytes per
 * layer (means over the measured layer calls) and the most loaded rank. */
static json_t *load_json(const fm_profile *p, const fm_prof_batch *b) {
    const fm_shard_load *ld = &b->load;
    const double n = b->load_calls > 0 ? b->load_calls : 1;
    json_t *o = json_object(), *pa = json_array(), *ac = json_array(), *by = json_array();
    for (int r = 0; r < ld->ranks; r++) {
        json_array_append_new(pa, jnum(ld->pairs[r] / n));
        json_array_append_new(ac, jnum(ld->active[r] / n));
        json_array_append_new(by, jnum(ld->bytes[r] / n));
    }
    json_object_set_new(o, "layer_calls", json_integer(b->load_calls));
    json_object_set_new(o, "pairs", pa);
    json_object_set_new(o, "active", ac);
    json_object_set_new(o, "bytes", by);
    json_object_set_new(o, "max_rank", json_integer(ld->max_rank));
    json_object_set_new(o, "max_rank_floor_ms",
                        p->bandwidth_Bps > 0 ? jnum(1e3 * ld->bytes[ld->max_rank] / n * p->layers_per_step /
                                                    p->bandwidth_Bps)
                                             : json_null());
    return o;
}

static fm_status dump(json_t *root, char **out, const char *what) {
    if (!root) return fm_error(FM_E_NOMEM, "out of memory building the %s", what);
    char *s = json_dumps(root, JSON_INDENT(1) | JSON_PRESERVE_ORDER);
    json_decref(root);
    if (!s) return fm_error(FM_E_NOMEM, "out of memory rendering the %s", what);
    /* json_dumps allocates with jansson's allocator (malloc by default). */
    *out = s;
    return FM_OK;
}

fm_status fm_profile_json(const fm_profile *p, char **out) {
    *out = NULL;
    json_t *root = json_object();
    json_object_set_new(root, "tool", json_string("fp4moe profile"));
    json_object_set_new(root, "version", json_string(FM_VERSION));
    json_object_set_new(root, "model", json_string(p->model));
    json_object_set_new(root, "family", json_string(p->family));
    json_object_set_new(root, "format", json_string(fm_qformat_name(p->fmt)));
    json_t *shape = json_object();
    json_object_set_new(shape, "E", json_integer(p->E));
    json_object_set_new(shape, "k", json_integer(p->k));
    json_object_set_new(shape, "H", json_integer(p->H));
    json_object_set_new(shape, "I", json_integer(p->I));
    json_object_set_new(shape, "n_shared", json_integer(p->n_shared));
    json_object_set_new(shape, "shared_inter", json_integer(p->shared_inter));
    json_object_set_new(root, "shape", shape);
    if (p->shard.mode) {
        json_t *sj = json_object();
        json_object_set_new(sj, "mode", json_string(fm_dist_mode_name(p->shard.mode)));
        json_object_set_new(sj, "ranks", json_integer(p->shard.ranks));
        json_object_set_new(sj, "rank", json_integer(p->shard.rank));
        json_object_set_new(sj, "full_E", json_integer(p->full_E));
        json_object_set_new(sj, "full_k", json_integer(p->full_k));
        json_object_set_new(root, "shard", sj);
    } else {
        json_object_set_new(root, "shard", json_null());
    }
    json_object_set_new(root, "device", json_string(p->device == FM_DEV_CUDA ? "cuda" : "cpu"));
    json_object_set_new(root, "device_desc", json_string(p->device_desc));
    json_object_set_new(root, "provenance", json_string(p->provenance));
    json_object_set_new(root, "layers_per_step", json_integer(p->layers_per_step));
    json_object_set_new(root, "model_moe_layers", json_integer(p->model_moe_layers));
    json_object_set_new(root, "layers_distinct", json_integer(p->layers_distinct));
    json_object_set_new(root, "warmup_steps", json_integer(p->warmup));
    json_object_set_new(root, "time_source", json_string(fm_time_source_name(p->time_source)));
    json_object_set_new(root, "time_note", json_string(p->time_note));
    json_object_set_new(root, "telemetry_note", json_string(p->telem_note));
    json_object_set_new(root, "bandwidth_Bps", jnum(p->bandwidth_Bps));
    json_object_set_new(root, "bandwidth_note", json_string(p->bandwidth_note));
    json_object_set_new(root, "peak_flops", jnum(p->peak_flops));
    json_object_set_new(root, "peak_note", json_string(p->peak_note));
    if (p->read_s > 0) {
        json_t *rd = json_object();
        json_object_set_new(rd, "seconds", jnum(p->read_s));
        json_object_set_new(rd, "Bps", jnum(p->read_Bps));
        json_object_set_new(rd, "window_s", json_pack("[ff]", p->read_t_begin_s, p->read_t_end_s));
        json_object_set_new(rd, "settle_s", jnum(FM_PROF_READ_SETTLE_S));
        json_object_set_new(rd, "telemetry", summary_json(&p->read_telem));
        json_object_set_new(root, "read_power", rd);
    } else {
        json_object_set_new(root, "read_power", json_null());
    }
    json_object_set_new(root, "tile_n", json_integer(p->tile_n));
    json_t *fused = json_array();
    for (int r = 0; r < FM_PH_COUNT; r++)
        if (p->fused_mask >> r & 1u) json_array_append_new(fused, json_string(fm_phase_name((fm_phase)r)));
    json_object_set_new(root, "fused_phases", fused);

    json_t *batches = json_array();
    for (int i = 0; i < p->n_batch; i++) {
        const fm_prof_batch *b = &p->b[i];
        json_t *o = json_object(), *m = json_object();
        json_object_set_new(o, "batch", json_integer(b->batch));
        json_object_set_new(o, "steps", json_integer(b->steps));
        json_object_set_new(o, "step_ms", jnum(b->step_ns * 1e-6));
        json_object_set_new(o, "step_ms_min", jnum(b->step_ns_min * 1e-6));
        json_object_set_new(o, "step_ms_max", jnum(b->step_ns_max * 1e-6));
        json_object_set_new(o, "phases_ms", rows_json(b->row_ns));
        json_object_set_new(m, "active_expected", jnum(b->active_expected));
        json_object_set_new(m, "active_observed", jnum(b->active_observed));
        json_object_set_new(m, "tokens_per_expert", jnum(b->tokens_per_expert));
        json_object_set_new(m, "bytes_per_step", jnum(b->bytes_per_step));
        json_object_set_new(m, "flops_per_step", jnum(b->flops_per_step));
        json_object_set_new(m, "floor_ms", jnum(b->floor_ns * 1e-6));
        json_object_set_new(m, "pct_of_floor", jnum(b->pct_of_floor));
        json_object_set_new(m, "route_read_bound_ms", b->bound_ns > 0 ? jnum(b->bound_ns * 1e-6) : json_null());
        json_object_set_new(m, "achieved_GBps", jnum(b->achieved_Bps / 1e9));
        json_object_set_new(m, "achieved_GFLOPs", jnum(b->achieved_flops / 1e9));
        json_object_set_new(m, "tokens_per_s", jnum(b->tokens_per_s));
        json_object_set_new(m, "tile_n", json_integer(b->tile_n));
        json_object_set_new(m, "tile_fill", b->tile_fill >= 0 ? jnum(b->tile_fill) : json_null());
        json_object_set_new(m, "tile_fill_is_expected", json_boolean(b->tile_fill_is_expected));
        json_object_set_new(m, "stream_share", jnum(b->stream_share));
        json_object_set_new(o, "model", m);
        if (p->shard.mode == FM_DIST_EP) json_object_set_new(o, "shard_load", load_json(p, b));
        json_object_set_new(o, "verdict", json_string(fm_verdict_name(b->verdict)));
        json_object_set_new(o, "verdict_text", json_string(b->verdict_text));
        json_object_set_new(o, "telemetry", summary_json(&b->telem));
        json_object_set_new(o, "window_s", json_pack("[ff]", b->t_begin_s, b->t_end_s));
        json_array_append_new(batches, o);
    }
    json_object_set_new(root, "batches", batches);

    json_t *deltas = json_array();
    for (int i = 0; i + 1 < p->n_batch; i++) {
        double d[FM_PROF_ROWS], sh[FM_PROF_ROWS];
        fm_prof_delta(&p->b[i], &p->b[i + 1], d, sh);
        json_t *o = json_object(), *rows = json_object();
        json_object_set_new(o, "from", json_integer(p->b[i].batch));
        json_object_set_new(o, "to", json_integer(p->b[i + 1].batch));
        for (int r = 0; r < FM_PROF_ROWS; r++) {
            json_t *row = json_object();
            json_object_set_new(row, "from_ms", jnum(p->b[i].row_ns[r] * 1e-6));
            json_object_set_new(row, "to_ms", jnum(p->b[i + 1].row_ns[r] * 1e-6));
            json_object_set_new(row, "delta_ms", jnum(d[r] * 1e-6));
            json_object_set_new(row, "share_pct", jnum(sh[r]));
            json_object_set_new(rows, fm_prof_row_name(r), row);
        }
        json_object_set_new(o, "rows", rows);
        json_array_append_new(deltas, o);
    }
    json_object_set_new(root, "deltas", deltas);
    json_object_set_new(root, "telemetry_samples", json_integer((json_int_t)p->n_samples));
    json_object_set_new(root, "spans", json_integer((json_int_t)p->n_spans));
    json_object_set_new(root, "spans_dropped", json_integer((json_int_t)p->spans_dropped));
    json_object_set_new(root, "duration_s", jnum(p->duration_s));
    return dump(root, out, "profile JSON");
}

/* ----------------------------------------------------- Chrome trace */

static const char *const k_span_cat[] = {"batch", "step", "layer", "phase", "kernel"};

static json_t *meta_event(const char *what, int pid, int tid, const char *name) {
    json_t *e = json_object();
    json_object_set_new(e, "name", json_string(what));
    json_object_set_new(e, "ph", json_string("M"));
    json_object_set_new(e, "pid", json_integer(pid));
    json_object_set_new(e, "tid", json_integer(tid));
    json_object_set_new(e, "args", json_pack("{ss}", "name", name));
    return e;
}

fm_status fm_profile_trace_json(const fm_profile *p, char **out) {
    *out = NULL;
    json_t *root = json_object(), *ev = json_array();
    json_array_append_new(ev, meta_event("process_name", 1, 0, "fp4moe host"));
    json_array_append_new(ev, meta_event("thread_name", 1, 1,
                                         p->device == FM_DEV_CUDA ? "steps (host)" : "CPU engine: steps, layers, phases"));
    json_array_append_new(ev, meta_event("process_name", 3, 0, "telemetry"));
    int gpu_pid = 0;
    /* GPU stream lanes are named once each. */
    uint32_t named[64];
    int n_named = 0;
    for (size_t i = 0; i < p->n_spans; i++) {
        const fm_prof_span *s = &p->spans[i];
        if (s->pid == 2 && !gpu_pid) {
            json_array_append_new(ev, meta_event("process_name", 2, 0, "GPU"));
            gpu_pid = 1;
        }
        if (s->pid == 2) {
            int seen = 0;
            for (int j = 0; j < n_named; j++) seen |= named[j] == (uint32_t)s->tid;
            if (!seen && n_named < 64) {
                char nm[48];
                snprintf(nm, sizeof nm, "stream %d", s->tid);
                json_array_append_new(ev, meta_event("thread_name", 2, s->tid, nm));
                named[n_named++] = (uint32_t)s->tid;
            }
        }
        json_t *e = json_object();
        json_object_set_new(e, "name", json_string(s->name));
        json_object_set_new(e, "cat", json_string(s->kind >= 0 && s->kind <= 4 ? k_span_cat[s->kind] : "other"));
        json_object_set_new(e, "ph", json_string("X"));
        json_object_set_new(e, "pid", json_integer(s->pid));
        json_object_set_new(e, "tid", json_integer(s->tid));
        json_object_set_new(e, "ts", jnum(s->t_us));
        json_object_set_new(e, "dur", jnum(s->dur_us));
        json_t *args = json_object();
        if (s->batch_index >= 0 && s->batch_index < p->n_batch)
            json_object_set_new(args, "batch", json_integer(p->b[s->batch_index].batch));
        if (s->phase >= 0 && s->phase < FM_PH_COUNT)
            json_object_set_new(args, "phase", json_string(fm_phase_name((fm_phase)s->phase)));
        if (s->kind == 4 && s->step >= 0) json_object_set_new(args, "step", json_integer(s->step));
        json_object_set_new(e, "args", args);
        if (json_array_append_new(ev, e) != 0) {
            json_decref(root);
            json_decref(ev);
            return fm_error(FM_E_NOMEM, "out of memory building the trace");
        }
    }
    for (size_t i = 0; i < p->n_samples; i++) {
        const fm_telem_sample *s = &p->samples[i];
        /* one counter track per metric that was sampled */
        for (int m = 0; m < FM_TM_COUNT; m++) {
            const char *track = fm_prof_metric_title((fm_telem_metric)m);
            double v = s->v[m];
            if (!track || isnan(v)) continue;
            json_t *e = json_object();
            json_object_set_new(e, "name", json_string(track));
            json_object_set_new(e, "ph", json_string("C"));
            json_object_set_new(e, "pid", json_integer(3));
            json_object_set_new(e, "tid", json_integer(0));
            json_object_set_new(e, "ts", jnum(s->t_s * 1e6));
            json_object_set_new(e, "args", json_pack("{so}", "value", jnum(v)));
            json_array_append_new(ev, e);
        }
    }
    json_object_set_new(root, "traceEvents", ev);
    json_object_set_new(root, "displayTimeUnit", json_string("ms"));
    json_t *meta = json_object();
    json_object_set_new(meta, "tool", json_string("fp4moe profile " FM_VERSION));
    json_object_set_new(meta, "model", json_string(p->model));
    json_object_set_new(meta, "device", json_string(p->device_desc));
    json_object_set_new(meta, "time_source", json_string(fm_time_source_name(p->time_source)));
    json_object_set_new(meta, "time_note", json_string(p->time_note));
    json_object_set_new(meta, "spans_dropped", json_integer((json_int_t)p->spans_dropped));
    json_object_set_new(root, "otherData", meta);
    return dump(root, out, "Chrome trace");
}

/* ------------------------------------------------------------ files */

fm_status fm_profile_write(const fm_profile *p, const char *json_path, const char *trace_path, const char *html_path) {
    const char *paths[3] = {json_path, trace_path, html_path};
    char *text[3] = {NULL, NULL, NULL};
    fm_status st = FM_OK;
    /* Render everything first, so a failure leaves no file at all. */
    if (json_path) st = fm_profile_json(p, &text[0]);
    if (st == FM_OK && trace_path) st = fm_profile_trace_json(p, &text[1]);
    if (st == FM_OK && html_path) st = fm_profile_report_html(p, &text[2]);
    for (int i = 0; st == FM_OK && i < 3; i++)
        if (paths[i]) st = fm_write_file_atomic(paths[i], text[i], strlen(text[i]));
    for (int i = 0; i < 3; i++) free(text[i]);
    return st;
}
