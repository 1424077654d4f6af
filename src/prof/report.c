/* The HTML report: one self-contained file (inline CSS and SVG, no script,
 * no network), readable in any browser and printable. Figures carry
 * data-* attributes so a test can find them in the DOM. */
#include "prof/prof_internal.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* Numbers as the text output prints them, so the report and the terminal
 * agree digit for digit. */
static void ms_cell(fm_sb *sb, const fm_profile *p, int row, double ns) {
    char buf[48];
    fm_prof_fmt_ms(buf, sizeof buf, p, row, ns);
    fm_sb_puts(sb, buf);
}

static void eng(char *buf, size_t cap, double v, const char *unit) {
    static const char *pre[] = {"", "k", "M", "G", "T", "P"};
    int i = 0;
    while (fabs(v) >= 1000 && i < 5) {
        v /= 1000;
        i++;
    }
    snprintf(buf, cap, "%g %s%s", round(v * 10) / 10, pre[i], unit);
}

/* ---------------------------------------------------------- roofline */

static double lx(double v, double lo, double hi, double x0, double w) {
    return x0 + w * (log10(v) - log10(lo)) / (log10(hi) - log10(lo));
}
static double ly(double v, double lo, double hi, double y0, double h) {
    return y0 + h - h * (log10(v) - log10(lo)) / (log10(hi) - log10(lo));
}

static void roofline(fm_sb *sb, const fm_profile *p) {
    const double W = 640, H = 400, X0 = 70, Y0 = 20, PW = 540, PH = 320;
    double ai_lo = INFINITY, ai_hi = 0, f_lo = INFINITY, f_hi = 0;
    for (int i = 0; i < p->n_batch; i++) {
        const fm_prof_batch *b = &p->b[i];
        if (b->bytes_per_step <= 0 || b->achieved_flops <= 0) continue;
        double ai = b->flops_per_step / b->bytes_per_step;
        ai_lo = fmin(ai_lo, ai);
        ai_hi = fmax(ai_hi, ai);
        f_lo = fmin(f_lo, b->achieved_flops);
        f_hi = fmax(f_hi, fmax(b->achieved_flops, p->bandwidth_Bps * ai));
    }
    fm_sb_puts(sb, "<svg id=\"roofline\" xmlns=\"http://www.w3.org/2000/svg\" width=\"640\" height=\"400\" "
                   "viewBox=\"0 0 640 400\" role=\"img\" aria-label=\"roofline\">\n");
    fm_sb_printf(sb, "<rect x=\"0\" y=\"0\" width=\"%.0f\" height=\"%.0f\" fill=\"#fff\"/>\n", W, H);
    if (!(ai_hi > 0) || !(p->bandwidth_Bps > 0)) {
        fm_sb_puts(sb, "<text x=\"20\" y=\"40\">no data for a roofline (bandwidth or timings missing)</text></svg>\n");
        return;
    }
    double ridge = p->peak_flops > 0 ? p->peak_flops / p->bandwidth_Bps : 0;
    /* Decades that show the points, the ridge and a stretch of the memory
     * roof's slope on its left. */
    double left = ridge > 0 ? fmin(ai_lo, ridge) : ai_lo, right = ridge > 0 ? fmax(ai_hi, ridge) : ai_hi;
    double xlo = pow(10, floor(log10(left / 10))), xhi = pow(10, ceil(log10(right * 2)));
    if (ridge > 0) f_hi = fmax(f_hi, p->peak_flops);
    f_lo = fmin(f_lo, p->bandwidth_Bps * xlo);
    double ylo = pow(10, floor(log10(f_lo))), yhi = pow(10, ceil(log10(f_hi * 1.5)));
    if (yhi <= ylo) yhi = ylo * 10;
    fm_sb_printf(sb, "<rect x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"%.0f\" fill=\"#fafafa\" stroke=\"#888\"/>\n", X0,
                 Y0, PW, PH);
    for (double d = xlo; d <= xhi * 1.0001; d *= 10) {
        double x = lx(d, xlo, xhi, X0, PW);
        fm_sb_printf(sb, "<line x1=\"%.1f\" y1=\"%.0f\" x2=\"%.1f\" y2=\"%.0f\" stroke=\"#ddd\"/>", x, Y0, x, Y0 + PH);
        fm_sb_printf(sb, "<text x=\"%.1f\" y=\"%.0f\" font-size=\"11\" text-anchor=\"middle\">%g</text>\n", x,
                     Y0 + PH + 14, d);
    }
    for (double d = ylo; d <= yhi * 1.0001; d *= 10) {
        double y = ly(d, ylo, yhi, Y0, PH);
        char lab[32];
        eng(lab, sizeof lab, d, "FLOP/s");
        fm_sb_printf(sb, "<line x1=\"%.0f\" y1=\"%.1f\" x2=\"%.0f\" y2=\"%.1f\" stroke=\"#ddd\"/>", X0, y, X0 + PW, y);
        fm_sb_printf(sb, "<text x=\"%.0f\" y=\"%.1f\" font-size=\"10\" text-anchor=\"end\">%s</text>\n", X0 - 4, y + 3,
                     lab);
    }
    fm_sb_printf(sb, "<text x=\"%.0f\" y=\"%.0f\" font-size=\"12\" text-anchor=\"middle\">arithmetic intensity "
                     "(FLOP per byte of weights read)</text>\n",
                 X0 + PW / 2, H - 10);
    /* The memory roof: y = bandwidth * x, clipped by the compute roof. */
    double xa = xlo, xb = ridge > 0 ? fmin(ridge, xhi) : xhi;
    double ya = p->bandwidth_Bps * xa, yb = p->bandwidth_Bps * xb;
    if (ya < ylo) {
        xa = ylo / p->bandwidth_Bps;
        ya = ylo;
    }
    fm_sb_printf(sb,
                 "<line class=\"roof-bw\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#1f4e99\" "
                 "stroke-width=\"2.5\"/>\n",
                 lx(xa, xlo, xhi, X0, PW), ly(ya, ylo, yhi, Y0, PH), lx(xb, xlo, xhi, X0, PW), ly(yb, ylo, yhi, Y0, PH));
    char bwl[48];
    eng(bwl, sizeof bwl, p->bandwidth_Bps, "B/s");
    /* the label runs along the slope, a fifth of the way up, clear of the
     * points (which sit under the roof) */
    double x1 = lx(xa, xlo, xhi, X0, PW), y1 = ly(ya, ylo, yhi, Y0, PH);
    double x2 = lx(xb, xlo, xhi, X0, PW), y2 = ly(yb, ylo, yhi, Y0, PH);
    double tx = x1 + 0.2 * (x2 - x1), ty = y1 + 0.2 * (y2 - y1);
    double ang = atan2(y2 - y1, x2 - x1) * 180.0 / 3.14159265358979;
    fm_sb_printf(sb,
                 "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\" fill=\"#1f4e99\" transform=\"rotate(%.1f %.1f "
                 "%.1f)\">memory roof %s</text>\n",
                 tx, ty - 5, ang, tx, ty - 5, bwl);
    if (ridge > 0 && ridge < xhi) {
        char pk[48];
        eng(pk, sizeof pk, p->peak_flops, "FLOP/s");
        double y = ly(p->peak_flops, ylo, yhi, Y0, PH);
        fm_sb_printf(sb,
                     "<line class=\"roof-compute\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#a11\" "
                     "stroke-width=\"2.5\"/>\n",
                     lx(ridge, xlo, xhi, X0, PW), y, X0 + PW, y);
        fm_sb_printf(sb, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\" fill=\"#a11\" text-anchor=\"end\">compute "
                         "roof %s</text>\n",
                     X0 + PW - 4, y - 5, pk);
    }
    for (int i = 0; i < p->n_batch; i++) {
        const fm_prof_batch *b = &p->b[i];
        if (b->bytes_per_step <= 0 || b->achieved_flops <= 0) continue;
        double ai = b->flops_per_step / b->bytes_per_step;
        double x = lx(ai, xlo, xhi, X0, PW), y = ly(b->achieved_flops, ylo, yhi, Y0, PH);
        /* labels stagger downwards with a leader line, so that batch sizes
         * close on the chart stay readable */
        double ty = y + 18 + 15 * i;
        fm_sb_printf(sb,
                     "<circle class=\"point\" data-batch=\"%d\" cx=\"%.1f\" cy=\"%.1f\" r=\"5\" fill=\"#e15759\" "
                     "stroke=\"#000\"/><line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#999\"/>"
                     "<text x=\"%.1f\" y=\"%.1f\" font-size=\"12\">B=%d: %.1f %% of floor</text>\n",
                     b->batch, x, y, x, y + 5, x + 12, ty - 4, x + 14, ty, b->batch, b->pct_of_floor);
    }
    fm_sb_puts(sb, "</svg>\n");
}

/* ------------------------------------------------------ stacked bars */

static void stacked_bars(fm_sb *sb, const fm_profile *p) {
    const double X0 = 70, Y0 = 20, PH = 300, BW = 56, GAP = 40;
    double max_ms = 0;
    for (int i = 0; i < p->n_batch; i++) max_ms = fmax(max_ms, p->b[i].step_ns * 1e-6);
    int W = (int)(X0 + p->n_batch * (BW + GAP) + 190);
    if (W < 420) W = 420;
    fm_sb_printf(sb,
                 "<svg id=\"bars\" xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"370\" viewBox=\"0 0 %d "
                 "370\" role=\"img\" aria-label=\"time per phase\">\n<rect x=\"0\" y=\"0\" width=\"%d\" "
                 "height=\"370\" fill=\"#fff\"/>\n",
                 W, W, W);
    if (!(max_ms > 0)) {
        fm_sb_puts(sb, "<text x=\"20\" y=\"40\">no timings</text></svg>\n");
        return;
    }
    for (int t = 0; t <= 4; t++) {
        double v = max_ms * t / 4, y = Y0 + PH - PH * t / 4.0;
        fm_sb_printf(sb,
                     "<line x1=\"%.0f\" y1=\"%.1f\" x2=\"%.0f\" y2=\"%.1f\" stroke=\"#ddd\"/><text x=\"%.0f\" "
                     "y=\"%.1f\" font-size=\"10\" text-anchor=\"end\">%.3g ms</text>\n",
                     X0, y, X0 + p->n_batch * (BW + GAP), y, X0 - 4, y + 3, v);
    }
    for (int i = 0; i < p->n_batch; i++) {
        const fm_prof_batch *b = &p->b[i];
        double x = X0 + GAP / 2 + i * (BW + GAP), y = Y0 + PH;
        for (int r = 0; r < FM_PROF_ROW_TOTAL; r++) {
            double h = PH * (b->row_ns[r] * 1e-6) / max_ms;
            if (!(h > 0)) continue;
            y -= h;
            fm_sb_printf(sb,
                         "<rect class=\"seg\" data-batch=\"%d\" data-row=\"%s\" x=\"%.1f\" y=\"%.2f\" width=\"%.0f\" "
                         "height=\"%.2f\" fill=\"%s\"><title>batch %d %s: %.3f ms</title></rect>\n",
                         b->batch, fm_prof_row_name(r), x, y, BW, h, fm_prof_row_color(r), b->batch,
                         fm_prof_row_name(r), b->row_ns[r] * 1e-6);
        }
        fm_sb_printf(sb, "<text x=\"%.1f\" y=\"%.0f\" font-size=\"12\" text-anchor=\"middle\">B=%d</text>\n", x + BW / 2,
                     Y0 + PH + 16, b->batch);
        fm_sb_printf(sb, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\" text-anchor=\"middle\">%.3f ms</text>\n",
                     x + BW / 2, y - 4, b->step_ns * 1e-6);
    }
    double lx0 = X0 + p->n_batch * (BW + GAP) + 20;
    for (int r = 0; r < FM_PROF_ROW_TOTAL; r++) {
        double y = Y0 + 10 + r * 20;
        fm_sb_printf(sb,
                     "<rect x=\"%.0f\" y=\"%.0f\" width=\"14\" height=\"14\" fill=\"%s\"/><text x=\"%.0f\" y=\"%.0f\" "
                     "font-size=\"12\">%s%s</text>\n",
                     lx0, y, fm_prof_row_color(r), lx0 + 20, y + 11, fm_prof_row_name(r),
                     r < FM_PH_COUNT && (p->fused_mask >> r & 1u) ? " (fused)" : "");
    }
    fm_sb_puts(sb, "</svg>\n");
}

/* ------------------------------------------------------ telemetry */

static void telemetry_chart(fm_sb *sb, const fm_profile *p, fm_telem_metric m) {
    const char *title = fm_prof_metric_title(m);
    if (!title) return;
    double vmax = 0, tmax = p->duration_s > 0 ? p->duration_s : 0;
    int n = 0;
    for (size_t i = 0; i < p->n_samples; i++) {
        double v = p->samples[i].v[m];
        if (isnan(v)) continue;
        n++;
        vmax = fmax(vmax, v);
        tmax = fmax(tmax, p->samples[i].t_s);
    }
    if (!n) return;
    if (m == FM_TM_SM_UTIL || m == FM_TM_MEM_UTIL || m == FM_TM_CPU_UTIL || m == FM_TM_PROC_UTIL) vmax = 100;
    if (m == FM_TM_POWER_W)
        for (size_t i = 0; i < p->n_samples; i++)
            if (!isnan(p->samples[i].v[FM_TM_POWER_LIMIT_W])) vmax = fmax(vmax, p->samples[i].v[FM_TM_POWER_LIMIT_W]);
    if (!(vmax > 0)) vmax = 1;
    if (!(tmax > 0)) tmax = 1;
    const double X0 = 60, Y0 = 22, PW = 560, PH = 90;
    fm_sb_printf(sb,
                 "<svg class=\"telemetry\" data-metric=\"%s\" xmlns=\"http://www.w3.org/2000/svg\" width=\"640\" "
                 "height=\"140\" viewBox=\"0 0 640 140\" role=\"img\" aria-label=\"%s\">\n<rect x=\"0\" y=\"0\" "
                 "width=\"640\" height=\"140\" fill=\"#fff\"/>\n",
                 fm_telem_metric_name(m), title);
    for (int i = 0; i < p->n_batch; i++) {
        const fm_prof_batch *b = &p->b[i];
        double xa = X0 + PW * b->t_begin_s / tmax, xb = X0 + PW * b->t_end_s / tmax;
        fm_sb_printf(sb,
                     "<rect x=\"%.1f\" y=\"%.0f\" width=\"%.1f\" height=\"%.0f\" fill=\"%s\" opacity=\"0.25\"/><text "
                     "x=\"%.1f\" y=\"%.0f\" font-size=\"10\">B=%d</text>\n",
                     xa, Y0, fmax(xb - xa, 1.0), PH, i % 2 ? "#9ecae1" : "#c6dbef", xa + 2, Y0 + 10, b->batch);
    }
    fm_sb_printf(sb, "<rect x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"%.0f\" fill=\"none\" stroke=\"#888\"/>\n", X0,
                 Y0, PW, PH);
    fm_sb_printf(sb,
                 "<text x=\"%.0f\" y=\"14\" font-size=\"12\">%s</text><text x=\"%.0f\" y=\"%.0f\" font-size=\"10\" "
                 "text-anchor=\"end\">%.4g</text><text x=\"%.0f\" y=\"%.0f\" font-size=\"10\" "
                 "text-anchor=\"end\">0</text><text x=\"%.0f\" y=\"%.0f\" font-size=\"10\" text-anchor=\"end\">%.3g "
                 "s</text>\n",
                 X0, title, X0 - 4, Y0 + 8, vmax, X0 - 4, Y0 + PH, X0 + PW, Y0 + PH + 14, tmax);
    fm_sb_puts(sb, "<polyline fill=\"none\" stroke=\"#d62728\" stroke-width=\"1.5\" points=\"");
    for (size_t i = 0; i < p->n_samples; i++) {
        double v = p->samples[i].v[m];
        if (isnan(v)) continue;
        fm_sb_printf(sb, "%.1f,%.1f ", X0 + PW * p->samples[i].t_s / tmax, Y0 + PH - PH * fmin(v, vmax) / vmax);
    }
    fm_sb_puts(sb, "\"/>\n</svg>\n");
}

/* ----------------------------------------------------------- tables */

static void delta_table(fm_sb *sb, const fm_profile *p, int ia, int ib) {
    const fm_prof_batch *a = &p->b[ia], *b = &p->b[ib];
    double d[FM_PROF_ROWS], sh[FM_PROF_ROWS];
    fm_prof_delta(a, b, d, sh);
    fm_sb_printf(sb,
                 "<table class=\"delta\" data-from=\"%d\" data-to=\"%d\"><caption>batch %d &rarr; %d: ms per step and "
                 "each phase's share of the marginal cost</caption>\n<tr><th>phase</th><th>bs %d "
                 "(ms/step)</th><th>bs %d (ms/step)</th><th>delta</th><th>share</th></tr>\n",
                 a->batch, b->batch, a->batch, b->batch, a->batch, b->batch);
    for (int r = 0; r < FM_PROF_ROWS; r++) {
        const char *rn = fm_prof_row_name(r);
        fm_sb_printf(sb, "<tr%s><td><span class=\"sw\" style=\"background:%s\"></span>%s</td><td>",
                     r == FM_PROF_ROW_TOTAL ? " class=\"total\"" : "", fm_prof_row_color(r), rn);
        ms_cell(sb, p, r, a->row_ns[r]);
        fm_sb_puts(sb, "</td><td>");
        ms_cell(sb, p, r, b->row_ns[r]);
        fm_sb_printf(sb, "</td><td data-row=\"%s\" data-col=\"delta\">%+.3f</td><td data-row=\"%s\" data-col=\"share\">",
                     rn, d[r] * 1e-6, rn);
        if (isnan(sh[r]))
            fm_sb_puts(sb, "n/a");
        else
            fm_sb_printf(sb, "%.1f %%", sh[r]);
        fm_sb_puts(sb, "</td></tr>\n");
    }
    fm_sb_puts(sb, "</table>\n");
}

static void phase_table(fm_sb *sb, const fm_profile *p) {
    fm_sb_puts(sb, "<table class=\"phases\"><tr><th>phase</th>");
    for (int i = 0; i < p->n_batch; i++) fm_sb_printf(sb, "<th>bs %d (ms/step)</th><th>share</th>", p->b[i].batch);
    fm_sb_puts(sb, "</tr>\n");
    for (int r = 0; r < FM_PROF_ROWS; r++) {
        fm_sb_printf(sb, "<tr%s><td><span class=\"sw\" style=\"background:%s\"></span>%s</td>",
                     r == FM_PROF_ROW_TOTAL ? " class=\"total\"" : "", fm_prof_row_color(r), fm_prof_row_name(r));
        for (int i = 0; i < p->n_batch; i++) {
            const fm_prof_batch *b = &p->b[i];
            fm_sb_printf(sb, "<td class=\"ms\" data-batch=\"%d\" data-row=\"%s\">", b->batch, fm_prof_row_name(r));
            ms_cell(sb, p, r, b->row_ns[r]);
            fm_sb_printf(sb, "</td><td>%.1f %%</td>", b->step_ns > 0 ? 100 * b->row_ns[r] / b->step_ns : 0.0);
        }
        fm_sb_puts(sb, "</tr>\n");
    }
    fm_sb_puts(sb, "</table>\n");
}

static void kernel_tables(fm_sb *sb, const fm_profile *p) {
    for (int i = 0; i < p->n_batch; i++) {
        fm_prof_kernel_row kr[32];
        int steps = 0, nk = fm_prof_kernel_rows(p, i, kr, 32, &steps);
        if (nk <= 0) continue;
        fm_sb_printf(sb,
                     "<table class=\"kernels\" data-batch=\"%d\"><caption>batch %d: kernels per step (mean over %d "
                     "graph replays)</caption>\n<tr><th>kernel</th><th>phase</th><th>launches</th><th>&micro;s</th></tr>\n",
                     p->b[i].batch, p->b[i].batch, steps);
        for (int j = 0; j < nk; j++) {
            fm_sb_puts(sb, "<tr><td>");
            fm_sb_escape(sb, kr[j].name);
            fm_sb_printf(sb, "</td><td>%s</td><td>%.1f</td><td>%.2f</td></tr>\n",
                         kr[j].phase >= 0 ? fm_phase_name((fm_phase)kr[j].phase) : "-", kr[j].launches, kr[j].us);
        }
        fm_sb_puts(sb, "</table>\n");
    }
}

static void model_table(fm_sb *sb, const fm_profile *p) {
    fm_sb_puts(sb, "<table class=\"model\"><tr><th>batch</th><th>active experts expected</th><th>observed</th>"
                   "<th>tokens / expert</th><th>MB read / step</th><th>floor ms</th><th>route+read ms</th><th>measured ms</th>"
                   "<th>% of floor</th><th>GB/s</th><th>GFLOP/s</th><th>tile rows used</th><th>tok/s</th></tr>\n");
    for (int i = 0; i < p->n_batch; i++) {
        const fm_prof_batch *b = &p->b[i];
        int B = b->batch;
        char bound[32] = "-";
        if (b->bound_ns > 0) snprintf(bound, sizeof bound, "%.3f", b->bound_ns * 1e-6);
        fm_sb_printf(sb,
                     "<tr><td>%d</td><td data-batch=\"%d\" data-col=\"active_expected\">%.1f</td><td data-batch=\"%d\" "
                     "data-col=\"active_observed\">%.1f</td><td data-batch=\"%d\" "
                     "data-col=\"tokens_per_expert\">%.2f</td><td data-batch=\"%d\" data-col=\"mb\">%.2f</td><td "
                     "data-batch=\"%d\" data-col=\"floor_ms\">%.3f</td><td data-batch=\"%d\" "
                     "data-col=\"bound_ms\">%s</td><td data-batch=\"%d\" "
                     "data-col=\"step_ms\">%.3f</td><td data-batch=\"%d\" data-col=\"pct_of_floor\">%.1f</td><td>%.2f</td>"
                     "<td>%.2f</td><td data-batch=\"%d\" data-col=\"tile_fill\">",
                     B, B, b->active_expected, B, b->active_observed, B, b->tokens_per_expert, B,
                     b->bytes_per_step / 1e6, B, b->floor_ns * 1e-6, B, bound, B, b->step_ns * 1e-6, B, b->pct_of_floor,
                     b->achieved_Bps / 1e9, b->achieved_flops / 1e9, B);
        char tile[64];
        fm_prof_fmt_tile(tile, sizeof tile, b);
        fm_sb_puts(sb, tile);
        fm_sb_printf(sb, "</td><td>%.0f</td></tr>\n", b->tokens_per_s);
    }
    fm_sb_puts(sb, "</table>\n");
}

/* An EP rank's profile: every rank's load per batch (one column per
 * batch size), the most loaded rank in bold: the step waits for it. */
static void ep_load_table(fm_sb *sb, const fm_profile *p) {
    int R = 0;
    for (int i = 0; i < p->n_batch; i++) R = p->b[i].load.ranks > R ? p->b[i].load.ranks : R;
    fm_sb_puts(sb, "<table class=\"ep-load\"><tr><th>rank: pairs / active / MB per layer</th>");
    for (int i = 0; i < p->n_batch; i++) fm_sb_printf(sb, "<th>bs %d</th>", p->b[i].batch);
    fm_sb_puts(sb, "</tr>\n");
    for (int r = 0; r < R; r++) {
        fm_sb_printf(sb, "<tr><td>%d%s</td>", r, r == p->shard.rank ? " (this rank)" : "");
        for (int i = 0; i < p->n_batch; i++) {
            const fm_prof_batch *b = &p->b[i];
            const double n = b->load_calls > 0 ? b->load_calls : 1;
            const int m = r == b->load.max_rank;
            fm_sb_printf(sb, "<td data-batch=\"%d\" data-rank=\"%d\">%s%.1f / %.1f / %.2f%s</td>", b->batch, r,
                         m ? "<b>" : "", b->load.pairs[r] / n, b->load.active[r] / n, b->load.bytes[r] / n / 1e6,
                         m ? "</b>" : "");
        }
        fm_sb_puts(sb, "</tr>\n");
    }
    fm_sb_puts(sb, "</table>\n");
}

static void telem_table(fm_sb *sb, const fm_profile *p) {
    /* One row per metric this run sampled (a CPU run has no GPU rows), one
     * column per batch size: narrow enough for any number of metrics. */
    fm_sb_puts(sb, "<table class=\"telem\"><tr><th>mean / max</th>");
    for (int i = 0; i < p->n_batch; i++) fm_sb_printf(sb, "<th>bs %d</th>", p->b[i].batch);
    fm_sb_puts(sb, "</tr>\n<tr><td>tokens/s</td>");
    for (int i = 0; i < p->n_batch; i++) fm_sb_printf(sb, "<td>%.0f</td>", p->b[i].tokens_per_s);
    fm_sb_puts(sb, "</tr>\n<tr><td>samples</td>");
    for (int i = 0; i < p->n_batch; i++) fm_sb_printf(sb, "<td>%d</td>", p->b[i].telem.n);
    fm_sb_puts(sb, "</tr>\n");
    for (int m = 0; m < FM_TM_COUNT; m++) {
        int used = 0;
        for (int i = 0; i < p->n_batch; i++) used |= !isnan(p->b[i].telem.mean[m]);
        if (!used) continue;
        const char *title = fm_prof_metric_title((fm_telem_metric)m);
        fm_sb_printf(sb, "<tr><td>%s</td>", title ? title : fm_telem_metric_name((fm_telem_metric)m));
        for (int i = 0; i < p->n_batch; i++) {
            const fm_telem_summary *t = &p->b[i].telem;
            if (isnan(t->mean[m]))
                fm_sb_puts(sb, "<td>-</td>");
            else
                fm_sb_printf(sb, "<td data-batch=\"%d\" data-metric=\"%s\">%.1f / %.1f</td>", p->b[i].batch,
                             fm_telem_metric_name((fm_telem_metric)m), t->mean[m], t->max[m]);
        }
        fm_sb_puts(sb, "</tr>\n");
    }
    fm_sb_puts(sb, "<tr><td>throttle reasons</td>");
    for (int i = 0; i < p->n_batch; i++) {
        char thr[256];
        fm_telemetry_throttle_str(p->b[i].telem.throttle_any, thr, sizeof thr);
        fm_sb_printf(sb, "<td>%s</td>", thr);
    }
    fm_sb_puts(sb, "</tr>\n</table>\n");
}

fm_status fm_profile_report_html(const fm_profile *p, char **out) {
    *out = NULL;
    fm_sb sb = {0};
    fm_sb_puts(&sb, "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n<title>fp4moe profile: ");
    fm_sb_escape(&sb, p->model);
    fm_sb_puts(&sb,
               "</title>\n<style>\nbody{font-family:sans-serif;margin:24px;color:#222;max-width:1100px}\n"
               "h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ccc}\n"
               "table{border-collapse:collapse;margin:8px 0;font-size:13px}\n"
               "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}td:first-child,th:first-child{text-align:"
               "left}\ntr.total td{font-weight:bold}caption{text-align:left;font-weight:bold;padding:4px 0}\n"
               ".sw{display:inline-block;width:10px;height:10px;margin-right:6px}\n"
               ".meta{font-size:13px;line-height:1.5}.verdict li{margin:4px 0}\n</style></head><body>\n");
    fm_sb_puts(&sb, "<h1>fp4moe profile: ");
    fm_sb_escape(&sb, p->model);
    fm_sb_puts(&sb, "</h1>\n<div class=\"meta\">");
    char line[512];
    snprintf(line, sizeof line, "%s, %s, E=%d k=%d H=%d I=%d%s", p->family, fm_qformat_name(p->fmt), p->E, p->k, p->H,
             p->I, p->n_shared > 0 ? ", shared expert" : "");
    fm_sb_escape(&sb, line);
    fm_sb_puts(&sb, "<br>device: ");
    fm_sb_escape(&sb, p->device_desc);
    if (p->provenance[0]) {
        fm_sb_puts(&sb, "<br>");
        fm_sb_escape(&sb, p->provenance);
    }
    fm_sb_printf(&sb, "<br>times from: <b id=\"time-source\">%s</b> (", fm_time_source_name(p->time_source));
    fm_sb_escape(&sb, p->time_note);
    fm_sb_puts(&sb, ")<br>telemetry: ");
    fm_sb_escape(&sb, p->telem_note);
    fm_sb_printf(&sb, "<br>bandwidth: <span id=\"bandwidth\">%.2f</span> GB/s (", p->bandwidth_Bps / 1e9);
    fm_sb_escape(&sb, p->bandwidth_note);
    if (p->device == FM_DEV_CUDA) {
        char rd[256];
        fm_prof_fmt_read(rd, sizeof rd, p);
        fm_sb_puts(&sb, ")<br>streaming read alone: <span id=\"read-power\">");
        fm_sb_escape(&sb, rd);
        fm_sb_puts(&sb, "</span><br>compute peak: ");
    } else {
        fm_sb_puts(&sb, ")<br>compute peak: ");
    }
    if (p->peak_flops > 0) fm_sb_printf(&sb, "%.1f GFLOP/s (", p->peak_flops / 1e9);
    else fm_sb_puts(&sb, "unknown (");
    fm_sb_escape(&sb, p->peak_note);
    fm_sb_printf(&sb, ")<br>a step is %d MoE layer%s (the model has %d); %d distinct layer%s in memory</div>\n",
                 p->layers_per_step, p->layers_per_step == 1 ? "" : "s", p->model_moe_layers, p->layers_distinct,
                 p->layers_distinct == 1 ? "" : "s");

    fm_sb_puts(&sb, "<h2>Verdict</h2>\n<ul class=\"verdict\">\n");
    for (int i = 0; i < p->n_batch; i++) {
        fm_sb_printf(&sb, "<li id=\"verdict-%d\" data-verdict=\"%s\"><b>batch %d:</b> ", p->b[i].batch,
                     fm_verdict_name(p->b[i].verdict), p->b[i].batch);
        fm_sb_escape(&sb, p->b[i].verdict_text);
        fm_sb_puts(&sb, "</li>\n");
    }
    fm_sb_puts(&sb, "</ul>\n<h2>Roofline</h2>\n");
    roofline(&sb, p);
    fm_sb_puts(&sb, "<h2>Time per phase (ms per step)</h2>\n");
    stacked_bars(&sb, p);
    phase_table(&sb, p);
    kernel_tables(&sb, p);
    if (p->n_batch >= 2) {
        fm_sb_puts(&sb, "<h2>What grows with batch size</h2>\n");
        for (int i = 0; i + 1 < p->n_batch; i++) delta_table(&sb, p, i, i + 1);
    }
    fm_sb_puts(&sb, "<h2>Performance model</h2>\n");
    model_table(&sb, p);
    if (p->shard.mode == FM_DIST_EP) {
        fm_sb_puts(&sb, "<h2>EP ranks' load (the most loaded in bold: the step waits for it)</h2>\n");
        ep_load_table(&sb, p);
    }
    fm_sb_puts(&sb, "<h2>Telemetry</h2>\n");
    telem_table(&sb, p);
    for (int m = 0; m < FM_TM_COUNT; m++) telemetry_chart(&sb, p, (fm_telem_metric)m);
    if (!p->n_samples) fm_sb_puts(&sb, "<p>no telemetry samples</p>\n");
    fm_sb_puts(&sb, "</body></html>\n");
    return fm_sb_finish(&sb, out);
}
