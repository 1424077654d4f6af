/* The performance model beside the measurement: expected vs observed active
 * experts, tokens per expert, bytes that must be read, the floor at the
 * measured bandwidth, tile-row fill, and a verdict per batch size.
 *
 * Verdict thresholds (docs/profiling.md):
 *   above 110 % of the floor                  -> bandwidth-bound (caches)
 *   mean power >= 90 % of the limit, a power throttle reason seen, below
 *      90 % of the floor                      -> power-bound
 *   >= 70 % of the floor                      -> bandwidth-bound
 *   >= 50 % of the peak FLOP/s (when known)   -> compute-bound
 *   >= 50 % of the step outside the weight-streaming phases (routing, sort,
 *      activation/combine run apart, unattributed gaps/launches)
 *                                             -> latency/launch-bound
 *   utilization >= 80 % (GPU SM, else host CPU) -> busy but not bandwidth-bound
 *   otherwise                                 -> under-used
 * The last two name routing's share of the step when it is >= 10 %: the
 * experts' weights cannot be read before it.
 * 70 % rather than 90 %: streaming kernels that reach 70-85 % of a measured
 * read bandwidth are at the practical ceiling of a real GEMV-like kernel
 * (calm: ~86 %), so below 70 % there is a gap worth explaining. */
#include "prof/prof_internal.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define VERDICT_BW_PCT 70.0
#define VERDICT_COMPUTE_FRAC 0.5
#define VERDICT_LATENCY_SHARE 0.5
#define VERDICT_BUSY_UTIL 80.0
#define FASTER_THAN_FLOOR_PCT 110.0
#define POOR_TILE_FILL 0.25
#define VERDICT_ROUTE_SHARE 0.1 /* routing's share of the step named in a verdict */
#define CONTENDED_GAP 40.0 /* host CPU % minus this process's CPU %          */
#define VERDICT_POWER_FRAC 0.9   /* mean power over the mean power limit         */
#define VERDICT_POWER_BW_PCT 90.0 /* at or above this % of floor: bandwidth-bound */
#define THROTTLE_POWER (FM_THROTTLE_SW_POWER_CAP | FM_THROTTLE_HW_POWER_BRAKE)

const char *fm_time_source_name(fm_time_source s) {
    switch (s) {
    case FM_TSRC_HOST: return "host clock";
    case FM_TSRC_EVENTS: return "CUDA events";
    case FM_TSRC_CUPTI: return "CUPTI";
    }
    return "unknown";
}

const char *fm_verdict_name(fm_verdict v) {
    switch (v) {
    case FM_VERDICT_BANDWIDTH: return "bandwidth-bound";
    case FM_VERDICT_COMPUTE: return "compute-bound";
    case FM_VERDICT_LATENCY: return "latency/launch-bound";
    case FM_VERDICT_BUSY: return "busy but not bandwidth-bound";
    case FM_VERDICT_UNDERUSED: return "under-used";
    case FM_VERDICT_POWER: return "power-bound";
    }
    return "unknown";
}

const char *fm_prof_row_name(int row) {
    if (row >= 0 && row < FM_PH_COUNT) return fm_phase_name((fm_phase)row);
    if (row == FM_PROF_ROW_UNATTR) return "unattributed";
    if (row == FM_PROF_ROW_TOTAL) return "total";
    return "invalid";
}

/* Case-insensitive substring. */
static int has(const char *s, const char *needle) {
    size_t n = strlen(needle);
    for (; *s; s++) {
        size_t i = 0;
        while (i < n && s[i] && (s[i] | 0x20) == (needle[i] | 0x20)) i++;
        if (i == n) return 1;
    }
    return 0;
}

/* "act" is short enough to hide inside other words (compact, extract), so
 * it counts only at the start of the name or after a separator. */
static int has_act(const char *s) {
    for (const char *p = s; *p; p++) {
        if ((p == s || p[-1] == '_' || p[-1] == ':' || (p[-1] >= '0' && p[-1] <= '9')) &&
            (p[0] | 0x20) == 'a' && (p[1] | 0x20) == 'c' && (p[2] | 0x20) == 't')
            return 1;
    }
    return 0;
}

fm_phase fm_prof_kernel_phase(const char *name) {
    if (!name) return FM_PH_OTHER;
    /* Order matters: a shared-expert gate/up kernel is "shared". */
    if (has(name, "shared")) return FM_PH_SHARED;
    if (has(name, "route") || has(name, "routing") || has(name, "topk")) return FM_PH_ROUTE;
    if (has(name, "sort")) return FM_PH_SORT;
    /* the splitk path's gate/up kernel is fm_splitk_gu_kernel; its one-token
     * launch, fm_fused1_kernel, holds down too (the engine marks down fused) */
    if (has(name, "gate_up") || has(name, "gateup") || has(name, "splitk_gu") || has(name, "fused1"))
        return FM_PH_GATEUP;
    if (has(name, "down")) return FM_PH_DOWN;
    if (has(name, "combine")) return FM_PH_COMBINE;
    if (has_act(name)) return FM_PH_ACT;
    return FM_PH_OTHER;
}

double fm_prof_expected_active(int E, int k, int B) {
    if (E <= 0 || k <= 0 || B <= 0) return 0.0;
    if (k >= E) return (double)E;
    return (double)E * (1.0 - pow(1.0 - (double)k / (double)E, (double)B));
}

double fm_prof_tile_fill(const int32_t *tpe, int E, int tile_n) {
    if (tile_n <= 0 || !tpe || E <= 0) return -1.0;
    double tokens = 0, rows = 0;
    for (int e = 0; e < E; e++) {
        if (tpe[e] <= 0) continue;
        tokens += tpe[e];
        rows += ceil((double)tpe[e] / tile_n) * tile_n;
    }
    return rows > 0 ? tokens / rows : -1.0;
}

double fm_prof_tile_fill_expected(int E, int k, int B, int tile_n) {
    if (tile_n <= 0 || E <= 0 || k <= 0 || B <= 0) return -1.0;
    double p = k >= E ? 1.0 : (double)k / E;
    /* E[ceil(X / t)] for X ~ Binomial(B, p), summed in log space so that
     * B in the thousands does not underflow the pmf. */
    double e_tiles = 0.0;
    double lp = log(p), lq = p < 1.0 ? log1p(-p) : -INFINITY;
    for (int x = 1; x <= B; x++) {
        double lpmf = lgamma(B + 1.0) - lgamma(x + 1.0) - lgamma(B - x + 1.0) + x * lp;
        if (B - x > 0) lpmf += (B - x) * lq;
        double pmf = exp(lpmf);
        e_tiles += pmf * ceil((double)x / tile_n);
    }
    double rows = E * e_tiles * tile_n;
    return rows > 0 ? (double)B * (k >= E ? E : k) / rows : -1.0;
}

double fm_prof_matrix_bytes(fm_qformat f, int64_t rows, int64_t cols) {
    double n = (double)rows * (double)cols;
    switch (f) {
    case FM_QF_NVFP4: return n / 2 + n / 16 + 4; /* + FP32 per-tensor scale */
    case FM_QF_MXFP4: return n / 2 + n / 32;
    case FM_QF_BF16: return n * 2;
    default: return 0;
    }
}

void fm_prof_delta(const fm_prof_batch *a, const fm_prof_batch *b, double delta_ns[FM_PROF_ROWS],
                   double share_pct[FM_PROF_ROWS]) {
    double total = b->row_ns[FM_PROF_ROW_TOTAL] - a->row_ns[FM_PROF_ROW_TOTAL];
    for (int r = 0; r < FM_PROF_ROWS; r++) {
        delta_ns[r] = b->row_ns[r] - a->row_ns[r];
        share_pct[r] = total != 0.0 ? 100.0 * delta_ns[r] / total : NAN;
    }
}

/* Bytes of one routed expert (gate, up, down). */
static double expert_bytes(const fm_profile *p) {
    return 2 * fm_prof_matrix_bytes(p->fmt, p->I, p->H) + fm_prof_matrix_bytes(p->fmt, p->H, p->I);
}

/* Bytes and FLOPs of one layer at batch B with `active` routed experts. */
static void layer_cost(const fm_profile *p, int B, double active, double *bytes, double *flops) {
    double expert = expert_bytes(p);
    double shared = 0;
    if (p->n_shared > 0 && p->shared_inter > 0)
        shared = 2 * fm_prof_matrix_bytes(p->fmt, p->shared_inter, p->H) + fm_prof_matrix_bytes(p->fmt, p->H, p->shared_inter);
    double router = (double)p->E * p->H * 4.0; /* FP32 router weights */
    *bytes = active * expert + shared + router;
    double per_tok = 2.0 * 3.0 * p->H * p->I * p->k + 2.0 * p->H * p->E;
    if (p->n_shared > 0) per_tok += 2.0 * 3.0 * p->H * p->shared_inter;
    *flops = per_tok * B;
}

static int is_streaming_row(int r) {
    return r == FM_PH_GATEUP || r == FM_PH_DOWN || r == FM_PH_SHARED;
}

static void set_text(char *buf, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void set_text(char *buf, size_t cap, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, cap, fmt, ap);
    va_end(ap);
}

static void write_verdict(const fm_profile *p, fm_prof_batch *b) {
    char extra[200] = "";
    double util = NAN;
    const char *util_name = "";
    if (!isnan(b->telem.mean[FM_TM_SM_UTIL])) {
        util = b->telem.mean[FM_TM_SM_UTIL];
        util_name = "SM utilization";
    } else if (!isnan(b->telem.mean[FM_TM_PROC_UTIL])) {
        util = b->telem.mean[FM_TM_PROC_UTIL];
        util_name = "CPU utilization by this process";
    } else if (!isnan(b->telem.mean[FM_TM_CPU_UTIL])) {
        util = b->telem.mean[FM_TM_CPU_UTIL];
        util_name = "CPU utilization";
    }
    double pct = b->pct_of_floor;
    double compute_frac = p->peak_flops > 0 ? b->achieved_flops / p->peak_flops : 0;
    size_t cap = sizeof b->verdict_text;

    if (b->tile_fill >= 0 && b->tile_fill < POOR_TILE_FILL)
        set_text(extra, sizeof extra, "; tiles of %d carry tokens in only %.1f %% of their rows", b->tile_n,
                 100.0 * b->tile_fill);
    /* below the floor without a power cap: routing in series with the reads
     * is the first thing to name (the experts are not known before it) */
    char route[96] = "";
    const double route_share = b->step_ns > 0 ? b->row_ns[FM_PH_ROUTE] / b->step_ns : 0;
    if (route_share >= VERDICT_ROUTE_SHARE)
        set_text(route, sizeof route, "; routing is %.0f %% of the step, before the experts' weights can be read",
                 100.0 * route_share);

    /* the GPU held at its power limit: its clocks, not the memory, set the
     * pace of whatever is issue-bound (an FP4 decode is) */
    const double pw = b->telem.mean[FM_TM_POWER_W], lim = b->telem.mean[FM_TM_POWER_LIMIT_W];
    const uint64_t pthr = b->telem.throttle_any & THROTTLE_POWER;
    const int capped = !isnan(pw) && !isnan(lim) && lim > 0 && pw >= VERDICT_POWER_FRAC * lim && pthr;

    if (pct < VERDICT_POWER_BW_PCT && capped) {
        b->verdict = FM_VERDICT_POWER;
        char why[64], clk[64] = "";
        fm_telemetry_throttle_str(pthr, why, sizeof why);
        if (!isnan(b->telem.mean[FM_TM_SM_MHZ]))
            set_text(clk, sizeof clk, ", SM clock %.0f MHz mean (%.0f max)", b->telem.mean[FM_TM_SM_MHZ],
                     b->telem.max[FM_TM_SM_MHZ]);
        char fl[48] = "", rd[96] = "";
        if (compute_frac >= 0.005) set_text(fl, sizeof fl, ", %.0f %% of peak FLOP/s", 100.0 * compute_frac);
        /* the power baseline: what reading alone at the probe's rate drew */
        const double rw = p->read_telem.mean[FM_TM_POWER_W];
        if (p->read_s > 0 && !isnan(rw))
            set_text(rd, sizeof rd, "; a streaming read alone drew %.0f %% of it at %.2f TB/s", 100.0 * rw / lim,
                     p->read_Bps / 1e12);
        set_text(b->verdict_text, cap, "power-bound: %.0f %% of the %.0f W limit (%s)%s%s; %.0f %% of floor%s%s",
                 100.0 * pw / lim, lim, why, clk, rd, pct, fl, extra);
    } else if (pct >= VERDICT_BW_PCT) {
        b->verdict = FM_VERDICT_BANDWIDTH;
        if (pct > FASTER_THAN_FLOOR_PCT)
            set_text(b->verdict_text, cap,
                     "bandwidth-bound at %.0f %% of floor: faster than memory allows, so caches serve "
                     "part of the %.1f MB of weights per step",
                     pct, b->bytes_per_step / 1e6);
        else
            set_text(b->verdict_text, cap, "bandwidth-bound at %.0f %% of floor", pct);
    } else if (compute_frac >= VERDICT_COMPUTE_FRAC) {
        b->verdict = FM_VERDICT_COMPUTE;
        set_text(b->verdict_text, cap, "compute-bound: %.0f %% of peak FLOP/s, %.0f %% of floor", 100 * compute_frac, pct);
    } else if (1.0 - b->stream_share >= VERDICT_LATENCY_SHARE) {
        b->verdict = FM_VERDICT_LATENCY;
        set_text(b->verdict_text, cap,
                 "latency/launch-bound: %.0f %% of the step is outside the weight-streaming phases "
                 "(routing, sorting, launches, gaps); %.0f %% of floor%s",
                 100.0 * (1.0 - b->stream_share), pct, extra);
    } else if (!isnan(util) && util >= VERDICT_BUSY_UTIL) {
        b->verdict = FM_VERDICT_BUSY;
        set_text(b->verdict_text, cap, "busy but not bandwidth-bound: %.0f %% of floor at %.0f %% %s%s%s", pct, util,
                 util_name, route, extra);
    } else {
        b->verdict = FM_VERDICT_UNDERUSED;
        if (!isnan(util))
            set_text(b->verdict_text, cap, "under-used: %.0f %% of floor at %.0f %% %s%s%s", pct, util, util_name, route,
                     extra);
        else
            set_text(b->verdict_text, cap, "under-used: %.0f %% of floor (no utilization samples)%s%s", pct, route,
                     extra);
    }
}

fm_status fm_profile_finish(fm_profile *p) {
    if (!p) return fm_error(FM_E_ARG, "profile: NULL profile");
    if (p->n_batch < 0 || p->n_batch > FM_PROF_MAX_BATCH)
        return fm_error(FM_E_RANGE, "profile: %d batch sizes (at most %d)", p->n_batch, FM_PROF_MAX_BATCH);
    if (p->E <= 0 || p->k <= 0 || p->k > p->E || p->H <= 0 || p->I <= 0)
        return fm_error(FM_E_ARG, "profile: bad shape E=%d k=%d H=%d I=%d", p->E, p->k, p->H, p->I);
    if (p->layers_per_step <= 0) return fm_error(FM_E_ARG, "profile: %d layers per step", p->layers_per_step);
    /* the streaming read alone: from one second after its start, as NVML's
     * power reading is a one-second average on these GPUs */
    memset(&p->read_telem, 0, sizeof p->read_telem);
    if (p->read_s > 0)
        fm_telemetry_summarize(p->samples, p->n_samples, p->read_t_begin_s + FM_PROF_READ_SETTLE_S, p->read_t_end_s,
                               &p->read_telem);
    else
        fm_telemetry_summarize(NULL, 0, 0, 0, &p->read_telem);
    for (int i = 0; i < p->n_batch; i++) {
        fm_prof_batch *b = &p->b[i];
        if (b->batch <= 0) return fm_error(FM_E_ARG, "profile: batch %d at index %d", b->batch, i);
        /* on a GPU, NVML's readings are one-second averages: a batch long
         * enough is read from 1 s after its start (the run makes GPU batches
         * last 2.2 s where NVML reads the power) */
        double tb = b->t_begin_s;
        if (p->device == FM_DEV_CUDA && b->t_end_s - b->t_begin_s >= FM_PROF_READ_SETTLE_S + 0.5)
            tb += FM_PROF_READ_SETTLE_S;
        fm_telemetry_summarize(p->samples, p->n_samples, tb, b->t_end_s, &b->telem);
        b->row_ns[FM_PROF_ROW_TOTAL] = b->step_ns;
        double attributed = 0, streaming = 0;
        for (int r = 0; r < FM_PH_COUNT; r++) {
            attributed += b->row_ns[r];
            if (is_streaming_row(r)) streaming += b->row_ns[r];
        }
        /* The phases add up to at most the busy time (CUPTI: each
         * nanosecond of a device once), so this is the time outside any
         * kernel; never negative. */
        b->row_ns[FM_PROF_ROW_UNATTR] = b->step_ns > attributed ? b->step_ns - attributed : 0.0;
        b->stream_share = b->step_ns > 0 ? streaming / b->step_ns : 0.0;
        if (b->stream_share > 1.0) b->stream_share = 1.0;

        const int ep = p->shard.mode == FM_DIST_EP;
        if (ep && (b->load_calls < 1 || p->shard.rank < 0 || p->shard.rank >= b->load.ranks ||
                   p->full_E < p->E || p->full_k < 1))
            return fm_error(FM_E_ARG, "profile: EP rank %d of batch %d without the routing's load", p->shard.rank,
                            b->batch);
        double active, bytes, flops;
        if (ep) { /* the rank's share of the full routing: its pairs, experts and bytes */
            const int r = p->shard.rank;
            const double calls = b->load_calls;
            b->active_expected = fm_prof_expected_active(p->full_E, p->full_k, b->batch) * p->E / p->full_E;
            active = b->load.active[r] / calls;
            b->active_observed = active;
            b->tokens_per_expert = active > 0 ? b->load.pairs[r] / calls / active : 0;
            int t0, chunk;
            fm_shard_token_chunk(&p->shard, b->batch, &t0, &chunk);
            bytes = b->load.bytes[r] / calls;
            flops = 6.0 * p->H * p->I * (b->load.pairs[r] / calls) +
                    (p->n_shared > 0 ? 6.0 * p->H * p->shared_inter * chunk : 0);
        } else {
            b->active_expected = fm_prof_expected_active(p->E, p->k, b->batch);
            active = b->active_observed > 0 ? b->active_observed : b->active_expected;
            b->tokens_per_expert = active > 0 ? (double)b->batch * p->k / active : 0;
            layer_cost(p, b->batch, active, &bytes, &flops);
        }
        b->bytes_per_step = bytes * p->layers_per_step;
        b->flops_per_step = flops * p->layers_per_step;
        b->floor_ns = p->bandwidth_Bps > 0 ? 1e9 * b->bytes_per_step / p->bandwidth_Bps : 0;
        b->pct_of_floor = b->step_ns > 0 ? 100.0 * b->floor_ns / b->step_ns : 0;
        b->bound_ns = b->row_ns[FM_PH_ROUTE] > 0 && p->bandwidth_Bps > 0
                          ? b->row_ns[FM_PH_ROUTE] +
                                1e9 * active * expert_bytes(p) * p->layers_per_step / p->bandwidth_Bps
                          : 0;
        b->achieved_Bps = b->step_ns > 0 ? b->bytes_per_step / (b->step_ns * 1e-9) : 0;
        b->achieved_flops = b->step_ns > 0 ? b->flops_per_step / (b->step_ns * 1e-9) : 0;
        b->tokens_per_s = b->step_ns > 0 ? b->batch / (b->step_ns * 1e-9) : 0;
        if (b->tile_n <= 0) b->tile_n = p->tile_n;
        if (b->tile_n <= 0) {
            b->tile_fill = -1;
            b->tile_fill_is_expected = 0;
        } else if (b->tile_fill_observed > 0) {
            b->tile_fill = b->tile_fill_observed;
            b->tile_fill_is_expected = 0;
        } else {
            /* an EP rank's experts fill as any of the full routing's */
            b->tile_fill = ep ? fm_prof_tile_fill_expected(p->full_E, p->full_k, b->batch, b->tile_n)
                              : fm_prof_tile_fill_expected(p->E, p->k, b->batch, b->tile_n);
            b->tile_fill_is_expected = 1;
        }
        write_verdict(p, b);
        /* Other work on the machine skews every figure above: say so. */
        double host = b->telem.mean[FM_TM_CPU_UTIL], own = b->telem.mean[FM_TM_PROC_UTIL];
        if (!isnan(host) && !isnan(own) && host - own >= CONTENDED_GAP) {
            size_t len = strlen(b->verdict_text);
            set_text(b->verdict_text + len, sizeof b->verdict_text - len,
                     " (other processes kept the host at %.0f %% CPU: timings are contended)", host);
        }
    }
    return FM_OK;
}
