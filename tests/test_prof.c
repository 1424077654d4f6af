/* Profiling module: the performance model against hand-worked and
 * brute-force references, verdict thresholds, delta table, kernel-name
 * categories, telemetry summaries, and the JSON / trace / HTML renderings of
 * a synthetic profile (parsed back, not string-compared). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fm_test.h"
#include "fp4moe.h"
#include "prof/prof_internal.h" /* fm_prof_fmt_read */

static void test_expected_active(void **st) {
    (void)st;
    /* 8 * (1 - (6/8)^2) = 8 * 0.4375 */
    assert_true(fabs(fm_prof_expected_active(8, 2, 2) - 3.5) < 1e-12);
    assert_true(fabs(fm_prof_expected_active(256, 6, 1) - 6.0) < 1e-9);
    /* Independent: the miss probability multiplied out token by token. */
    double miss = 1.0;
    for (int t = 0; t < 80; t++) miss *= 250.0 / 256.0;
    assert_true(fabs(fm_prof_expected_active(256, 6, 80) - 256.0 * (1 - miss)) < 1e-9);
    assert_true(fabs(fm_prof_expected_active(256, 6, 80) - 218.0) < 1.0); /* REFERENCE.md: ~218 */
    assert_true(fm_prof_expected_active(8, 8, 3) == 8.0);
    assert_true(fm_prof_expected_active(0, 2, 3) == 0.0);
    assert_true(fm_prof_expected_active(8, 2, 0) == 0.0);
}

static void test_tile_fill(void **st) {
    (void)st;
    int32_t tpe[4] = {1, 0, 3, 17};
    /* rows: 16 + 16 + 32 = 64 for 21 tokens */
    assert_true(fabs(fm_prof_tile_fill(tpe, 4, 16) - 21.0 / 64.0) < 1e-12);
    assert_true(fabs(fm_prof_tile_fill(tpe, 4, 1) - 1.0) < 1e-12);
    assert_true(fm_prof_tile_fill(tpe, 4, 0) == -1.0);
    int32_t none[3] = {0, 0, 0};
    assert_true(fm_prof_tile_fill(none, 3, 8) == -1.0);
    /* The CONTEXT.md case: 128-token tiles, ~1 token per expert. */
    int32_t one[4] = {1, 1, 2, 1};
    assert_true(fm_prof_tile_fill(one, 4, 128) < 0.02);
}

/* E[tokens] / E[rows] by enumerating every routing of B tokens, each token
 * choosing one of the C(E, k) expert sets with equal probability. */
static double brute_fill(int E, int k, int B, int tile) {
    int sets[64][8], ns = 0;
    for (int m = 0; m < (1 << E); m++) {
        if (__builtin_popcount((unsigned)m) != k) continue;
        int q = 0;
        for (int e = 0; e < E; e++)
            if (m >> e & 1) sets[ns][q++] = e;
        ns++;
    }
    long total = 1;
    for (int t = 0; t < B; t++) total *= ns;
    double rows = 0;
    for (long a = 0; a < total; a++) {
        int cnt[8] = {0};
        long r = a;
        for (int t = 0; t < B; t++) {
            int s = (int)(r % ns);
            r /= ns;
            for (int q = 0; q < k; q++) cnt[sets[s][q]]++;
        }
        for (int e = 0; e < E; e++) rows += ((cnt[e] + tile - 1) / tile) * tile;
    }
    rows /= (double)total;
    return (double)B * k / rows;
}

static void test_tile_fill_expected(void **st) {
    (void)st;
    assert_true(fabs(fm_prof_tile_fill_expected(3, 1, 4, 2) - brute_fill(3, 1, 4, 2)) < 1e-9);
    assert_true(fabs(fm_prof_tile_fill_expected(4, 2, 5, 3) - brute_fill(4, 2, 5, 3)) < 1e-9);
    assert_true(fabs(fm_prof_tile_fill_expected(5, 2, 3, 1) - 1.0) < 1e-9);
    /* Large B stays finite (the pmf is summed in log space). */
    double f = fm_prof_tile_fill_expected(256, 8, 4096, 128);
    assert_true(f > 0.5 && f <= 1.0);
    /* DeepSeek-V4-Flash at B=32 with 128-row tiles: under 2 % of rows used. */
    assert_true(fm_prof_tile_fill_expected(256, 6, 32, 128) < 0.02);
    assert_true(fm_prof_tile_fill_expected(8, 2, 4, 0) == -1.0);
}

static void test_kernel_phase(void **st) {
    (void)st;
    assert_int_equal(fm_prof_kernel_phase("fm_route_noaux_tc_kernel"), FM_PH_ROUTE);
    assert_int_equal(fm_prof_kernel_phase("_Z15fm_topk_softmaxPKfi"), FM_PH_ROUTE);
    assert_int_equal(fm_prof_kernel_phase("fm_sort_tokens"), FM_PH_SORT);
    /* the one-token launch of gate/up and down, by its mangled name */
    assert_int_equal(fm_prof_kernel_phase("_Z16fm_fused1_kernelILb0EEv16fm_expert_params16fm_fused1_layout"),
                     FM_PH_GATEUP);
    assert_int_equal(fm_prof_kernel_phase("fm_gate_up_small<4>"), FM_PH_GATEUP);
    assert_int_equal(fm_prof_kernel_phase("moe_GateUp_mma"), FM_PH_GATEUP);
    assert_int_equal(fm_prof_kernel_phase("void fm_splitk_gu_kernel<false>(int)"), FM_PH_GATEUP);
    assert_int_equal(fm_prof_kernel_phase("void fm_splitk_down_kernel<1, 2, false>(int)"), FM_PH_DOWN);
    assert_int_equal(fm_prof_kernel_phase("void fm_fused1_kernel<true>(fm_expert_params, fm_fused1_layout)"),
                     FM_PH_GATEUP);
    assert_int_equal(fm_prof_kernel_phase("fm_act_silu"), FM_PH_ACT);
    assert_int_equal(fm_prof_kernel_phase("fm_down_small"), FM_PH_DOWN);
    assert_int_equal(fm_prof_kernel_phase("fm_combine_k"), FM_PH_COMBINE);
    assert_int_equal(fm_prof_kernel_phase("fm_shared_gate_up"), FM_PH_SHARED);
    /* "act" inside another word is not the activation */
    assert_int_equal(fm_prof_kernel_phase("compact_buffers"), FM_PH_OTHER);
    assert_int_equal(fm_prof_kernel_phase("memset_zero"), FM_PH_OTHER);
    assert_int_equal(fm_prof_kernel_phase(NULL), FM_PH_OTHER);
}

static void test_matrix_bytes(void **st) {
    (void)st;
    /* REFERENCE.md: DeepSeek-V4-Flash NVFP4 expert = 14,155,776 B for the
     * packed values and block scales, plus three FP32 tensor scales. */
    double e = 2 * fm_prof_matrix_bytes(FM_QF_NVFP4, 2048, 4096) + fm_prof_matrix_bytes(FM_QF_NVFP4, 4096, 2048);
    assert_true(e == 14155776.0 + 12.0);
    assert_true(fm_prof_matrix_bytes(FM_QF_MXFP4, 64, 32) == 64 * 16 + 64);
    assert_true(fm_prof_matrix_bytes(FM_QF_BF16, 3, 5) == 30);
}

static void test_throttle_str(void **st) {
    (void)st;
    char b[128];
    fm_telemetry_throttle_str(0, b, sizeof b);
    assert_string_equal(b, "none");
    fm_telemetry_throttle_str(0x4 | 0x40, b, sizeof b);
    assert_string_equal(b, "sw_power_cap,hw_thermal");
    fm_telemetry_throttle_str(0x10000, b, sizeof b);
    assert_string_equal(b, "0x10000");
    fm_telemetry_throttle_str(0x4, b, 5); /* truncation stays terminated */
    assert_true(strlen(b) < 5);
}

static fm_telem_sample sample(double t, double sm, double cpu, uint64_t thr) {
    fm_telem_sample s;
    s.t_s = t;
    for (int m = 0; m < FM_TM_COUNT; m++) s.v[m] = NAN;
    s.v[FM_TM_SM_UTIL] = sm;
    s.v[FM_TM_CPU_UTIL] = cpu;
    s.throttle = thr;
    return s;
}

static void test_summarize(void **st) {
    (void)st;
    fm_telem_sample s[5] = {sample(0.0, 10, 50, 0), sample(1.0, 20, NAN, 0x1), sample(2.0, 40, 70, 0x4),
                            sample(3.0, NAN, 90, 0x8), sample(9.0, 100, 100, 0x40)};
    fm_telem_summary t;
    fm_telemetry_summarize(s, 5, 1.0, 3.0, &t);
    assert_int_equal(t.n, 3);
    assert_true(fabs(t.mean[FM_TM_SM_UTIL] - 30.0) < 1e-12);
    assert_true(t.max[FM_TM_SM_UTIL] == 40.0);
    assert_true(fabs(t.mean[FM_TM_CPU_UTIL] - 80.0) < 1e-12);
    assert_true(isnan(t.mean[FM_TM_POWER_W]) && isnan(t.max[FM_TM_POWER_W]));
    assert_true(t.throttle_any == (0x4 | 0x8)); /* idle bit excluded */
    fm_telemetry_summarize(s, 5, 20.0, 30.0, &t);
    assert_int_equal(t.n, 0);
    assert_true(isnan(t.mean[FM_TM_SM_UTIL]));
}

/* A synthetic DeepSeek-V4-Flash-shaped profile with hand-chosen timings. */
static fm_profile *synthetic(void) {
    fm_profile *p = fm_profile_new();
    assert_non_null(p);
    snprintf(p->model, sizeof p->model, "synthetic <dsv4>");
    snprintf(p->family, sizeof p->family, "deepseek_v4");
    p->fmt = FM_QF_NVFP4;
    p->E = 256, p->k = 6, p->H = 4096, p->I = 2048;
    p->layers_per_step = 1;
    p->model_moe_layers = 43;
    p->layers_distinct = 1;
    p->bandwidth_Bps = 4.6e12;
    p->peak_flops = 989e12;
    p->fused_mask = 1u << FM_PH_ACT;
    snprintf(p->device_desc, sizeof p->device_desc, "test device");
    snprintf(p->time_note, sizeof p->time_note, "hand-made");
    snprintf(p->telem_note, sizeof p->telem_note, "hand-made");
    snprintf(p->bandwidth_note, sizeof p->bandwidth_note, "given");
    p->n_batch = 2;
    p->b[0].batch = 1;
    p->b[1].batch = 80;
    return p;
}

/* Bytes of one layer: active experts, no shared expert, FP32 router. */
static double layer_bytes(double active) { return active * (14155776.0 + 12.0) + 256.0 * 4096.0 * 4.0; }

static void test_finish_and_verdicts(void **st) {
    (void)st;
    fm_profile *p = synthetic();
    p->tile_n = 128;
    /* batch 1: 91 % of floor, weight streaming dominates */
    double floor1 = 1e9 * layer_bytes(6) / 4.6e12;
    p->b[0].active_observed = 6;
    p->b[0].step_ns = floor1 / 0.91;
    p->b[0].row_ns[FM_PH_ROUTE] = 0.05 * p->b[0].step_ns;
    p->b[0].row_ns[FM_PH_GATEUP] = 0.6 * p->b[0].step_ns;
    p->b[0].row_ns[FM_PH_DOWN] = 0.3 * p->b[0].step_ns;
    p->b[0].t_begin_s = 0, p->b[0].t_end_s = 1;
    /* batch 80: 40 % of floor at 97 % SM utilization */
    double floor80 = 1e9 * layer_bytes(218) / 4.6e12;
    p->b[1].active_observed = 218;
    p->b[1].step_ns = floor80 / 0.40;
    p->b[1].row_ns[FM_PH_GATEUP] = 0.55 * p->b[1].step_ns;
    p->b[1].row_ns[FM_PH_DOWN] = 0.35 * p->b[1].step_ns;
    p->b[1].t_begin_s = 2, p->b[1].t_end_s = 3;
    p->samples = calloc(3, sizeof *p->samples);
    p->samples[0] = sample(0.5, 50, 10, 0);
    p->samples[1] = sample(2.2, 96, 10, 0);
    p->samples[2] = sample(2.8, 98, 10, 0);
    p->n_samples = 3;
    assert_int_equal(fm_profile_finish(p), FM_OK);

    fm_prof_batch *a = &p->b[0], *b = &p->b[1];
    assert_true(fabs(a->bytes_per_step - layer_bytes(6)) < 1e-3);
    assert_true(fabs(a->floor_ns - floor1) < 1e-6);
    assert_true(fabs(a->pct_of_floor - 91.0) < 1e-9);
    assert_int_equal(a->verdict, FM_VERDICT_BANDWIDTH);
    assert_string_equal(a->verdict_text, "bandwidth-bound at 91 % of floor");
    assert_true(fabs(a->tokens_per_expert - 1.0) < 1e-12);
    assert_true(fabs(a->row_ns[FM_PROF_ROW_TOTAL] - a->step_ns) < 1e-9);
    assert_true(fabs(a->row_ns[FM_PROF_ROW_UNATTR] - 0.05 * a->step_ns) < 1e-6);
    assert_true(fabs(a->tile_fill - 1.0 / 128.0) < 1e-9); /* one token per expert */
    /* route-then-read bound: the routing phase + the six experts at the bandwidth */
    assert_true(fabs(a->bound_ns - (0.05 * a->step_ns + 1e9 * 6 * 14155788.0 / 4.6e12)) < 1e-6);
    assert_true(b->bound_ns == 0); /* no routing time measured */
    assert_int_equal(a->tile_fill_is_expected, 1);

    assert_int_equal(b->telem.n, 2);
    assert_true(fabs(b->telem.mean[FM_TM_SM_UTIL] - 97.0) < 1e-12);
    assert_int_equal(b->verdict, FM_VERDICT_BUSY);
    assert_non_null(strstr(b->verdict_text, "busy but not bandwidth-bound: 40 % of floor at 97 % SM utilization"));
    assert_non_null(strstr(b->verdict_text, "tiles of 128"));
    assert_null(strstr(b->verdict_text, "routing"));
    assert_true(fabs(b->tokens_per_expert - 480.0 / 218.0) < 1e-12);
    /* FLOPs: 2 * 3 * H * I * k per token plus the router GEMV */
    double fl = 80.0 * (2.0 * 3 * 4096 * 2048 * 6 + 2.0 * 4096 * 256);
    assert_true(fabs(b->flops_per_step - fl) < 1.0);

    /* Routing at 20 % of the step is named, before the tiles. */
    p->b[1].row_ns[FM_PH_ROUTE] = 0.2 * p->b[1].step_ns;
    p->b[1].row_ns[FM_PH_GATEUP] = 0.45 * p->b[1].step_ns;
    assert_int_equal(fm_profile_finish(p), FM_OK);
    assert_int_equal(b->verdict, FM_VERDICT_BUSY);
    assert_non_null(strstr(b->verdict_text, "97 % SM utilization; routing is 20 % of the step, before the experts' "
                                            "weights can be read; tiles of 128"));
    p->b[1].row_ns[FM_PH_ROUTE] = 0;
    p->b[1].row_ns[FM_PH_GATEUP] = 0.55 * p->b[1].step_ns;

    /* Latency-bound: routing and gaps dominate. */
    memset(&p->b[0].row_ns, 0, sizeof p->b[0].row_ns);
    p->b[0].step_ns = floor1 / 0.30;
    p->b[0].row_ns[FM_PH_ROUTE] = 0.5 * p->b[0].step_ns;
    p->b[0].row_ns[FM_PH_GATEUP] = 0.2 * p->b[0].step_ns;
    assert_int_equal(fm_profile_finish(p), FM_OK);
    assert_int_equal(p->b[0].verdict, FM_VERDICT_LATENCY);
    assert_non_null(strstr(p->b[0].verdict_text, "80 % of the step is outside"));

    /* Compute-bound when the FLOP rate nears a (small) peak. */
    p->peak_flops = p->b[1].flops_per_step / (p->b[1].step_ns * 1e-9) / 0.6;
    assert_int_equal(fm_profile_finish(p), FM_OK);
    assert_int_equal(p->b[1].verdict, FM_VERDICT_COMPUTE);

    /* No utilization known, streaming dominates, below the floor: under-used. */
    p->peak_flops = 0;
    free(p->samples);
    p->samples = NULL;
    p->n_samples = 0;
    assert_int_equal(fm_profile_finish(p), FM_OK);
    assert_int_equal(p->b[1].verdict, FM_VERDICT_UNDERUSED);
    assert_non_null(strstr(p->b[1].verdict_text, "no utilization samples"));

    /* Faster than the floor: caches. */
    p->b[1].step_ns = floor80 / 1.5;
    assert_int_equal(fm_profile_finish(p), FM_OK);
    assert_int_equal(p->b[1].verdict, FM_VERDICT_BANDWIDTH);
    assert_non_null(strstr(p->b[1].verdict_text, "caches"));

    /* A per-batch tile size (GPU large path) wins over the profile's. */
    p->b[0].tile_n = 16;
    assert_int_equal(fm_profile_finish(p), FM_OK);
    assert_int_equal(p->b[0].tile_n, 16);
    assert_int_equal(p->b[1].tile_n, 128);
    assert_true(fabs(p->b[0].tile_fill - fm_prof_tile_fill_expected(256, 6, 1, 16)) < 1e-12);

    /* Bad shapes are refused with a message. */
    p->k = 300;
    assert_int_equal(fm_profile_finish(p), FM_E_ARG);
    assert_non_null(strstr(fm_last_error(), "k=300"));
    fm_profile_free(p);
}

/* Power-bound: the GPU held at its power limit below 90 % of the floor (the
 * H200's B = 16 - 512 case: 665 - 692 W of 700, sw_power_cap, SM clock
 * 1600 - 1700 MHz); near the limit without a power reason, a power reason
 * well below the limit, or at 90 % of the floor and above, it is not. */
/* A step of step_ns that is 95 % weight streaming (gate/up 60 %, down 35 %). */
static void streaming_step(fm_prof_batch *b, double step_ns) {
    memset(b->row_ns, 0, sizeof b->row_ns);
    b->step_ns = step_ns;
    b->row_ns[FM_PH_GATEUP] = 0.6 * step_ns;
    b->row_ns[FM_PH_DOWN] = 0.35 * step_ns;
}

static void test_power_verdict(void **st) {
    (void)st;
    fm_profile *p = synthetic();
    p->n_batch = 1;
    p->tile_n = 8;
    p->b[0].active_observed = 218;
    const double floor80 = 1e9 * layer_bytes(218) / 4.6e12;
    streaming_step(&p->b[0], floor80 / 0.78);
    p->b[0].t_end_s = 1;
    p->samples = calloc(2, sizeof *p->samples);
    p->n_samples = 2;
    const double w[2] = {660, 670}, mhz[2] = {1650, 1740};
    for (int i = 0; i < 2; i++) {
        p->samples[i] = sample(0.3 + 0.4 * i, 99, 10, i ? 0x4 : 0);
        p->samples[i].v[FM_TM_POWER_W] = w[i];
        p->samples[i].v[FM_TM_POWER_LIMIT_W] = 700;
        p->samples[i].v[FM_TM_SM_MHZ] = mhz[i];
    }
    assert_int_equal(fm_profile_finish(p), FM_OK);
    assert_int_equal(p->b[0].verdict, FM_VERDICT_POWER);
    assert_string_equal(fm_verdict_name(p->b[0].verdict), "power-bound");
    assert_string_equal(p->b[0].verdict_text, "power-bound: 95 % of the 700 W limit (sw_power_cap), SM clock 1695 MHz "
                                              "mean (1740 max); 78 % of floor; tiles of 8 carry tokens in only "
                                              "12.5 % of their rows");
    /* with a compute peak the FLOP share is said too */
    p->peak_flops = p->b[0].flops_per_step / (p->b[0].step_ns * 1e-9) / 0.2;
    assert_int_equal(fm_profile_finish(p), FM_OK);
    assert_non_null(strstr(p->b[0].verdict_text, "; 78 % of floor, 20 % of peak FLOP/s"));
    p->peak_flops = 0;
    /* a hardware power brake counts too; other reasons do not */
    p->samples[1].throttle = 0x80;
    assert_int_equal(fm_profile_finish(p), FM_OK);
    assert_non_null(strstr(p->b[0].verdict_text, "(hw_power_brake)"));
    p->samples[1].throttle = 0x20 | 0x1;
    assert_int_equal(fm_profile_finish(p), FM_OK);
    assert_int_equal(p->b[0].verdict, FM_VERDICT_BANDWIDTH);
    assert_string_equal(p->b[0].verdict_text, "bandwidth-bound at 78 % of floor");
    /* a power reason at 60 % of the limit: not held by power */
    p->samples[1].throttle = 0x4;
    p->samples[0].v[FM_TM_POWER_W] = p->samples[1].v[FM_TM_POWER_W] = 420;
    assert_int_equal(fm_profile_finish(p), FM_OK);
    assert_int_equal(p->b[0].verdict, FM_VERDICT_BANDWIDTH);
    /* at the limit but at 92 % of the floor: the memory sets the pace */
    p->samples[0].v[FM_TM_POWER_W] = p->samples[1].v[FM_TM_POWER_W] = 690;
    streaming_step(&p->b[0], floor80 / 0.92);
    assert_int_equal(fm_profile_finish(p), FM_OK);
    assert_int_equal(p->b[0].verdict, FM_VERDICT_BANDWIDTH);
    /* below 70 % of the floor at the limit: power-bound, not "busy" */
    streaming_step(&p->b[0], floor80 / 0.55);
    assert_int_equal(fm_profile_finish(p), FM_OK);
    assert_int_equal(p->b[0].verdict, FM_VERDICT_POWER);
    assert_non_null(strstr(p->b[0].verdict_text, "99 % of the 700 W limit"));
    /* no power limit known: no power verdict */
    p->samples[0].v[FM_TM_POWER_LIMIT_W] = p->samples[1].v[FM_TM_POWER_LIMIT_W] = NAN;
    assert_int_equal(fm_profile_finish(p), FM_OK);
    assert_int_equal(p->b[0].verdict, FM_VERDICT_BUSY);
    fm_profile_free(p);
}

/* The power baseline (profile's sustained streaming read): its window is
 * read from one second after its start (NVML's power is a one-second
 * average), the power-bound verdict sets the layer against it, every
 * rendering says it, and a profile without it says why. */
static void test_read_baseline(void **st) {
    (void)st;
    fm_profile *p = synthetic();
    p->device = FM_DEV_CUDA;
    p->n_batch = 1;
    p->tile_n = 0;
    p->b[0].active_observed = 218;
    const double floor80 = 1e9 * layer_bytes(218) / 4.6e12;
    streaming_step(&p->b[0], floor80 / 0.76);
    p->b[0].t_begin_s = 6, p->b[0].t_end_s = 7;
    p->read_s = 3.0, p->read_Bps = 4.55e12, p->read_t_begin_s = 2.0, p->read_t_end_s = 5.0;
    p->samples = calloc(5, sizeof *p->samples);
    p->n_samples = 5;
    /* t, W, SM MHz, throttle: the read's ramp (2.3 s, left out), its settled
     * part (3.5, 4.5 s), the layer (6.3, 6.8 s) */
    const double t[5] = {2.3, 3.5, 4.5, 6.3, 6.8}, w[5] = {300, 696, 698, 694, 696}, mhz[5] = {1980, 1970, 1970, 1650, 1690};
    for (int i = 0; i < 5; i++) {
        p->samples[i] = sample(t[i], 99, 10, i ? 0x4 : 0);
        p->samples[i].v[FM_TM_POWER_W] = w[i];
        p->samples[i].v[FM_TM_POWER_LIMIT_W] = 700;
        p->samples[i].v[FM_TM_SM_MHZ] = mhz[i];
    }
    assert_int_equal(fm_profile_finish(p), FM_OK);
    assert_int_equal(p->read_telem.n, 2);
    assert_true(fabs(p->read_telem.mean[FM_TM_POWER_W] - 697.0) < 1e-9);
    assert_int_equal(p->b[0].verdict, FM_VERDICT_POWER);
    assert_string_equal(p->b[0].verdict_text,
                        "power-bound: 99 % of the 700 W limit (sw_power_cap), SM clock 1670 MHz mean (1690 max); a "
                        "streaming read alone drew 100 % of it at 4.55 TB/s; 76 % of floor");
    char buf[256];
    fm_prof_fmt_read(buf, sizeof buf, p);
    assert_string_equal(buf, "4.55 TB/s for 3.0 s: 697 W mean (100 % of the 700 W limit), SM clock 1970 MHz, "
                             "throttle sw_power_cap");
    char *js = NULL, *html = NULL;
    assert_int_equal(fm_profile_json(p, &js), FM_OK);
    json_error_t err;
    json_t *root = json_loads(js, 0, &err);
    assert_non_null(root);
    json_t *rd = json_object_get(root, "read_power");
    assert_true(json_is_object(rd));
    assert_true(fabs(json_real_value(json_object_get(rd, "Bps")) - 4.55e12) < 1);
    json_t *tm = json_object_get(json_object_get(rd, "telemetry"), "mean");
    assert_true(fabs(json_real_value(json_object_get(tm, "power_w")) - 697.0) < 1e-9);
    json_decref(root);
    free(js);
    assert_int_equal(fm_profile_report_html(p, &html), FM_OK);
    assert_non_null(strstr(html, "<span id=\"read-power\">4.55 TB/s for 3.0 s: 697 W mean"));
    free(html);

    /* no baseline (no NVML, or --read-power-s 0): the verdict is as before,
     * and the renderings say why there is none */
    p->read_s = 0;
    assert_int_equal(fm_profile_finish(p), FM_OK);
    assert_int_equal(p->read_telem.n, 0);
    assert_null(strstr(p->b[0].verdict_text, "streaming read"));
    /* a GPU batch of 1.5 s or more is read from 1 s after its start, like
     * the baseline: the sample at 6.3 s (still NVML's average of the time
     * before) drops out of a 6 - 7.9 s window, the one at 7.5 s stays */
    p->b[0].t_end_s = 7.9;
    p->samples[4].t_s = 7.5;
    p->samples[3].v[FM_TM_POWER_W] = 300;
    p->samples[3].throttle = 0;
    assert_int_equal(fm_profile_finish(p), FM_OK);
    assert_int_equal(p->b[0].telem.n, 1);
    assert_true(fabs(p->b[0].telem.mean[FM_TM_POWER_W] - 696.0) < 1e-9);
    assert_int_equal(p->b[0].verdict, FM_VERDICT_POWER);
    /* on the CPU every window is read whole */
    p->device = FM_DEV_CPU;
    assert_int_equal(fm_profile_finish(p), FM_OK);
    assert_int_equal(p->b[0].telem.n, 2);
    p->device = FM_DEV_CUDA;
    p->b[0].t_end_s = 7.0;
    p->samples[4].t_s = 6.8;
    p->samples[3].v[FM_TM_POWER_W] = 694;
    p->samples[3].throttle = 0x4;
    fm_prof_fmt_read(buf, sizeof buf, p);
    assert_string_equal(buf, "not measured (no NVML power readings, or --read-power-s 0)");
    assert_int_equal(fm_profile_json(p, &js), FM_OK);
    root = json_loads(js, 0, &err);
    assert_non_null(root);
    assert_true(json_is_null(json_object_get(root, "read_power")));
    json_decref(root);
    free(js);
    p->device = FM_DEV_CPU;
    fm_prof_fmt_read(buf, sizeof buf, p);
    assert_string_equal(buf, "not measured (GPU only)");
    fm_profile_free(p);

    /* the options: 0, or 1.5 to 60 seconds; anything else is refused before
     * the run starts, naming the value */
    const double bad[] = {-1.0, 1.0, 60.5, NAN};
    for (int i = 0; i < 4; i++) {
        fm_prof_opts o;
        fm_prof_opts_default(&o);
        o.preset = "tiny-qwen3";
        o.batches[0] = 2;
        o.n_batch = 1;
        o.read_power_s = bad[i];
        fm_profile *q = NULL;
        assert_int_equal(fm_profile_run(&o, &q), FM_E_RANGE);
        assert_null(q);
        assert_non_null(strstr(fm_last_error(), "sustained read of"));
    }
}

/* An EP rank of the DeepSeek-V4-Flash shape (EP8 rank 3: 32 experts of
 * I 2048, k 6, one shared expert of 2048): the model counts the rank's
 * share of the routing, hand-worked from the load. */
static void test_finish_ep_rank(void **st) {
    (void)st;
    fm_profile *p = synthetic();
    p->E = 32, p->full_E = 256, p->full_k = 6;
    p->n_shared = 1, p->shared_inter = 2048;
    p->shard = (fm_shard){FM_DIST_EP, 8, 3};
    p->layers_per_step = 2;
    p->tile_n = 8;
    const double eb = 14155776.0; /* 3 * (2048 * 4096 / 2 + 2048 * 4096 / 16) */
    /* batch 1: one token, on rank 0's chunk: rank 3 reads 0.5 experts a layer
     * (one of two layer calls routed a pair to it) and no shared expert */
    fm_prof_batch *a = &p->b[0], *b = &p->b[1];
    a->load_calls = 2;
    a->load.ranks = 8;
    a->load.pairs[3] = 1, a->load.active[3] = 1, a->load.bytes[3] = (int64_t)eb;
    a->load.pairs[0] = 11, a->load.active[0] = 11, a->load.bytes[0] = (int64_t)(11 * eb + 2 * eb);
    a->step_ns = 20000;
    a->row_ns[FM_PH_ROUTE] = 1000;
    /* batch 80: chunks of 10 tokens, rank 3's holds 10 */
    b->load_calls = 2;
    b->load.ranks = 8;
    b->load.max_rank = 3;
    b->load.pairs[3] = 130, b->load.active[3] = 50, b->load.bytes[3] = (int64_t)(50 * eb + 2 * eb);
    b->step_ns = 1e6;
    assert_int_equal(fm_profile_finish(p), FM_OK);
    assert_true(fabs(a->bytes_per_step - eb) < 1e-6); /* 0.5 experts a layer, two layers */
    assert_true(fabs(a->active_observed - 0.5) < 1e-12);
    assert_true(fabs(a->tokens_per_expert - 1.0) < 1e-12);
    assert_true(fabs(a->active_expected - 6.0 / 8.0) < 1e-12); /* 6 of 256 experts hit, 32 of them the rank's */
    assert_true(fabs(a->flops_per_step - 2 * 6.0 * 4096 * 2048 * 0.5) < 1.0);
    assert_true(fabs(a->floor_ns - 1e9 * eb / 4.6e12) < 1e-6);
    assert_true(fabs(a->bound_ns - (1000 + 1e9 * 0.5 * (eb + 12.0) * 2 / 4.6e12)) < 1e-6);
    assert_true(fabs(b->bytes_per_step - 52 * eb) < 1e-3);
    assert_true(fabs(b->active_observed - 25) < 1e-12);
    assert_true(fabs(b->tokens_per_expert - 65.0 / 25.0) < 1e-12);
    assert_true(fabs(b->flops_per_step - 2 * (6.0 * 4096 * 2048 * 65 + 6.0 * 4096 * 2048 * 10)) < 1e3);
    /* tiles fill as any expert's of the full routing (Binomial(80, 6/256)) */
    assert_true(fabs(b->tile_fill - fm_prof_tile_fill_expected(256, 6, 80, 8)) < 1e-12);
    char *js = NULL;
    assert_int_equal(fm_profile_json(p, &js), FM_OK);
    json_error_t err;
    json_t *root = json_loads(js, 0, &err);
    assert_non_null(root);
    json_t *sh = json_object_get(root, "shard");
    assert_string_equal(json_string_value(json_object_get(sh, "mode")), "ep");
    assert_int_equal(json_integer_value(json_object_get(sh, "rank")), 3);
    json_t *ld = json_object_get(json_array_get(json_object_get(root, "batches"), 1), "shard_load");
    assert_true(fabs(json_real_value(json_array_get(json_object_get(ld, "bytes"), 3)) - 26 * eb) < 1e-3);
    assert_true(fabs(json_real_value(json_array_get(json_object_get(ld, "pairs"), 3)) - 65) < 1e-12);
    assert_int_equal(json_integer_value(json_object_get(ld, "max_rank")), 3);
    json_decref(root);
    free(js);
    /* an EP rank's batch without the routing's load is refused */
    b->load_calls = 0;
    assert_int_equal(fm_profile_finish(p), FM_E_ARG);
    assert_non_null(strstr(fm_last_error(), "without the routing's load"));
    fm_profile_free(p);
}

/* `profile --shard ep:4/1` on the CPU against an independent count: the
 * first MoE layer of tiny-deepseek routes the profile's seeded activations
 * (fm_route), each pair counted on the rank that owns its expert. */
static void test_profile_ep_rank_cpu(void **st) {
    (void)st;
    fm_prof_opts o;
    fm_prof_opts_default(&o);
    fm_shard sh = {FM_DIST_EP, 4, 1};
    o.preset = "tiny-deepseek";
    o.shard = &sh;
    o.batches[0] = 2, o.batches[1] = 16;
    o.n_batch = 2;
    o.steps = 1, o.warmup = 0, o.layers = 1, o.step_layers = 1, o.threads = 1;
    o.bandwidth_Bps = 1e10, o.peak_flops = 1e11;
    fm_profile *p = NULL;
    assert_int_equal(fm_profile_run(&o, &p), FM_OK);
    fm_model_desc d;
    assert_int_equal(fm_preset_desc("tiny-deepseek", FM_QF_NONE, &d), FM_OK);
    int layer = 0;
    while (!fm_model_is_moe_layer(&d, layer)) layer++;
    fm_moe_layer *l = NULL;
    assert_int_equal(fm_moe_layer_random(&d, p->fmt, o.seed, layer, &l), FM_OK);
    const int H = d.hidden, k = d.topk, E = d.n_experts;
    const double eb = 3.0 * (d.moe_inter * H / 2 + d.moe_inter * H / 16),
                 sb = 3.0 * (d.shared_inter * H / 2 + d.shared_inter * H / 16);
    assert_int_equal(p->E, E / 4);
    for (int i = 0; i < 2; i++) {
        const int B = o.batches[i];
        float *x = malloc((size_t)B * H * sizeof *x), *w = malloc((size_t)B * k * sizeof *w);
        int32_t *tok = malloc((size_t)B * sizeof *tok), *ids = malloc((size_t)B * k * sizeof *ids);
        const uint64_t key = fm_hash_str("profile.x") + (uint64_t)B * 1000003u; /* step 0 */
        for (int64_t j = 0; j < (int64_t)B * H; j++) x[j] = fm_rng_normal(o.seed, key, (uint64_t)j);
        for (int t = 0; t < B; t++)
            tok[t] = (int32_t)(fm_rng_u64(o.seed, key ^ 0x5a5a5a5au, (uint64_t)t) % (uint64_t)d.vocab_size);
        assert_int_equal(fm_route(&d, l, x, B, tok, ids, w), FM_OK);
        int64_t pairs[4] = {0, 0, 0, 0};
        int hit[64] = {0}, act[4] = {0, 0, 0, 0};
        for (int j = 0; j < B * k; j++) {
            pairs[ids[j] / (E / 4)]++;
            if (!hit[ids[j]]++) act[ids[j] / (E / 4)]++;
        }
        const fm_prof_batch *b = &p->b[i];
        assert_int_equal(b->load_calls, 1);
        for (int r = 0; r < 4; r++) {
            const int chunk = (B + 3) / 4, has_tokens = r * chunk < B;
            assert_int_equal(b->load.pairs[r], pairs[r]);
            assert_int_equal(b->load.active[r], act[r]);
            assert_true(fabs((double)b->load.bytes[r] - (act[r] * eb + (has_tokens ? sb : 0))) < 0.5);
        }
        assert_true(fabs(b->bytes_per_step - (act[1] * eb + sb)) < 0.5);
        assert_true(fabs(b->active_observed - act[1]) < 1e-12);
        assert_true(b->row_ns[FM_PH_GATEUP] > 0 && b->row_ns[FM_PH_DOWN] > 0);
        free(x), free(w), free(tok), free(ids);
    }
    fm_moe_layer_free(l);
    fm_profile_free(p);
    /* E = 16 does not split over 3 ranks; rank 4 of 4 is none */
    fm_shard bad[2] = {{FM_DIST_EP, 3, 0}, {FM_DIST_EP, 4, 4}};
    const char *why[2] = {"E=16 experts are not divisible by 3", "is not a shard"};
    for (int i = 0; i < 2; i++) {
        o.shard = &bad[i];
        assert_int_equal(fm_profile_run(&o, &p), FM_E_ARG);
        assert_null(p);
        assert_non_null(strstr(fm_last_error(), why[i]));
    }
}

static void test_contended_note(void **st) {
    (void)st;
    fm_profile *p = synthetic();
    p->n_batch = 1;
    p->b[0].active_observed = 6;
    p->b[0].step_ns = 1e9 * layer_bytes(6) / 4.6e12 / 0.5;
    p->b[0].row_ns[FM_PH_GATEUP] = 0.9 * p->b[0].step_ns;
    p->b[0].t_end_s = 1;
    p->samples = calloc(2, sizeof *p->samples);
    p->n_samples = 2;
    for (int i = 0; i < 2; i++) {
        p->samples[i] = sample(0.5, NAN, 100, 0);
        p->samples[i].v[FM_TM_PROC_UTIL] = 30;
    }
    assert_int_equal(fm_profile_finish(p), FM_OK);
    assert_int_equal(p->b[0].verdict, FM_VERDICT_UNDERUSED);
    assert_string_equal(p->b[0].verdict_text, "under-used: 50 % of floor at 30 % CPU utilization by this process "
                                              "(other processes kept the host at 100 % CPU: timings are contended)");
    p->samples[0].v[FM_TM_PROC_UTIL] = p->samples[1].v[FM_TM_PROC_UTIL] = 90;
    assert_int_equal(fm_profile_finish(p), FM_OK);
    assert_int_equal(p->b[0].verdict, FM_VERDICT_BUSY);
    assert_null(strstr(p->b[0].verdict_text, "contended"));
    fm_profile_free(p);
}

static void test_delta(void **st) {
    (void)st;
    fm_prof_batch a, b;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    a.row_ns[FM_PH_GATEUP] = 10, b.row_ns[FM_PH_GATEUP] = 13;
    a.row_ns[FM_PH_ROUTE] = 4, b.row_ns[FM_PH_ROUTE] = 3;
    a.row_ns[FM_PROF_ROW_UNATTR] = 1, b.row_ns[FM_PROF_ROW_UNATTR] = 3;
    a.row_ns[FM_PROF_ROW_TOTAL] = 15, b.row_ns[FM_PROF_ROW_TOTAL] = 19;
    double d[FM_PROF_ROWS], s[FM_PROF_ROWS];
    fm_prof_delta(&a, &b, d, s);
    assert_true(d[FM_PH_GATEUP] == 3 && d[FM_PH_ROUTE] == -1 && d[FM_PROF_ROW_TOTAL] == 4);
    assert_true(fabs(s[FM_PH_GATEUP] - 75.0) < 1e-12);
    assert_true(fabs(s[FM_PH_ROUTE] + 25.0) < 1e-12);
    assert_true(fabs(s[FM_PROF_ROW_UNATTR] - 50.0) < 1e-12);
    assert_true(fabs(s[FM_PROF_ROW_TOTAL] - 100.0) < 1e-12);
    double sum = 0;
    for (int r = 0; r < FM_PROF_ROW_TOTAL; r++) sum += s[r];
    assert_true(fabs(sum - 100.0) < 1e-9);
    b = a;
    fm_prof_delta(&a, &b, d, s);
    assert_true(isnan(s[FM_PH_GATEUP]));
    assert_string_equal(fm_prof_row_name(FM_PROF_ROW_UNATTR), "unattributed");
    assert_string_equal(fm_prof_row_name(FM_PROF_ROW_TOTAL), "total");
    assert_string_equal(fm_prof_row_name(FM_PH_GATEUP), "gate_up");
}

static fm_profile *rendered(void) {
    fm_profile *p = synthetic();
    for (int i = 0; i < 2; i++) {
        p->b[i].active_observed = i ? 218 : 6;
        p->b[i].step_ns = i ? 2.0e6 : 1.0e6;
        p->b[i].step_ns_min = p->b[i].step_ns * 0.9;
        p->b[i].step_ns_max = p->b[i].step_ns * 1.1;
        p->b[i].steps = 3;
        p->b[i].row_ns[FM_PH_ROUTE] = 0.1e6;
        p->b[i].row_ns[FM_PH_GATEUP] = i ? 1.2e6 : 0.5e6;
        p->b[i].row_ns[FM_PH_DOWN] = i ? 0.5e6 : 0.3e6;
        p->b[i].t_begin_s = i;
        p->b[i].t_end_s = i + 0.9;
        fm_prof_span s;
        memset(&s, 0, sizeof s);
        s.t_us = i * 1e6, s.dur_us = 1000, s.pid = 1, s.tid = 1, s.batch_index = i, s.kind = 1, s.phase = -1;
        snprintf(s.name, sizeof s.name, "step \"B\"");
        fm_profile_add_span(p, &s);
        s.kind = 4, s.pid = 2, s.tid = 7, s.phase = FM_PH_GATEUP, s.step = 0;
        snprintf(s.name, sizeof s.name, "fm_gate_up_small");
        fm_profile_add_span(p, &s);
        s.step = -1; /* a kernel outside the measured steps: not in the tables */
        snprintf(s.name, sizeof s.name, "fm_gen_kernel");
        fm_profile_add_span(p, &s);
    }
    p->samples = calloc(4, sizeof *p->samples);
    for (int i = 0; i < 4; i++) p->samples[i] = sample(0.5 * i, 90, i ? 30 : NAN, 0);
    p->n_samples = 4;
    assert_int_equal(fm_profile_finish(p), FM_OK);
    return p;
}

static void test_json(void **st) {
    (void)st;
    fm_profile *p = rendered();
    char *s = NULL;
    assert_int_equal(fm_profile_json(p, &s), FM_OK);
    json_error_t err;
    json_t *j = json_loads(s, 0, &err);
    assert_non_null(j);
    json_t *bs = json_object_get(j, "batches");
    assert_int_equal(json_array_size(bs), 2);
    json_t *b1 = json_array_get(bs, 1);
    assert_int_equal(json_integer_value(json_object_get(b1, "batch")), 80);
    json_t *ph = json_object_get(b1, "phases_ms");
    assert_true(fabs(json_real_value(json_object_get(ph, "gate_up")) - 1.2) < 1e-12);
    assert_true(fabs(json_real_value(json_object_get(ph, "total")) - 2.0) < 1e-12);
    assert_true(fabs(json_real_value(json_object_get(ph, "unattributed")) - 0.2) < 1e-9);
    /* metrics never sampled are null, not NaN (which is not JSON) */
    json_t *mean = json_object_get(json_object_get(b1, "telemetry"), "mean");
    assert_true(json_is_null(json_object_get(mean, "power_w")));
    assert_true(fabs(json_real_value(json_object_get(mean, "sm_util_pct")) - 90.0) < 1e-12);
    json_t *d = json_array_get(json_object_get(j, "deltas"), 0);
    json_t *row = json_object_get(json_object_get(d, "rows"), "gate_up");
    assert_true(fabs(json_real_value(json_object_get(row, "delta_ms")) - 0.7) < 1e-9);
    assert_true(fabs(json_real_value(json_object_get(row, "share_pct")) - 70.0) < 1e-9);
    assert_string_equal(json_string_value(json_array_get(json_object_get(j, "fused_phases"), 0)), "activation");
    json_decref(j);
    free(s);
    fm_profile_free(p);
}

static void test_trace(void **st) {
    (void)st;
    fm_profile *p = rendered();
    char *s = NULL;
    assert_int_equal(fm_profile_trace_json(p, &s), FM_OK);
    json_error_t err;
    json_t *j = json_loads(s, 0, &err);
    assert_non_null(j);
    json_t *ev = json_object_get(j, "traceEvents");
    size_t nx = 0, nc = 0, nm = 0, i;
    json_t *e;
    json_array_foreach(ev, i, e) {
        const char *ph = json_string_value(json_object_get(e, "ph"));
        assert_non_null(ph);
        assert_true(json_is_integer(json_object_get(e, "pid")));
        if (!strcmp(ph, "X")) {
            nx++;
            assert_true(json_is_number(json_object_get(e, "ts")) && json_is_number(json_object_get(e, "dur")));
        } else if (!strcmp(ph, "C")) {
            nc++;
            assert_true(json_is_number(json_object_get(json_object_get(e, "args"), "value")));
        } else if (!strcmp(ph, "M")) {
            nm++;
        }
    }
    assert_int_equal(nx, 6);
    assert_int_equal(nc, 4 + 3); /* SM util in 4 samples, CPU util in 3 */
    assert_true(nm >= 5);        /* host, its thread, telemetry, GPU, stream 7 */
    assert_non_null(strstr(s, "\"stream 7\""));
    assert_non_null(strstr(s, "step \\\"B\\\""));
    json_decref(j);
    free(s);
    fm_profile_free(p);
}

static void test_html(void **st) {
    (void)st;
    fm_profile *p = rendered();
    char *s = NULL;
    assert_int_equal(fm_profile_report_html(p, &s), FM_OK);
    assert_non_null(strstr(s, "<svg id=\"roofline\""));
    assert_non_null(strstr(s, "<svg id=\"bars\""));
    assert_non_null(strstr(s, "class=\"delta\" data-from=\"1\" data-to=\"80\""));
    assert_non_null(strstr(s, "data-metric=\"sm_util_pct\""));
    assert_non_null(strstr(s, "synthetic &lt;dsv4&gt;")); /* escaped */
    assert_non_null(strstr(s, "data-batch=\"80\" data-row=\"gate_up\">1.200<"));
    assert_non_null(strstr(s, "<table class=\"kernels\" data-batch=\"80\">"));
    assert_non_null(strstr(s, "<td>fm_gate_up_small</td><td>gate_up</td><td>1.0</td><td>1000.00</td>"));
    assert_null(strstr(s, "<td>fm_gen_kernel</td>"));
    /* self-contained: no scripts, no external resources */
    assert_null(strstr(s, "<script"));
    assert_null(strstr(s, "src="));
    assert_null(strstr(s, "href="));
    assert_null(strstr(s, "@import"));
    free(s);
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    assert_non_null(f);
    fm_profile_print(p, f);
    fclose(f);
    assert_non_null(strstr(buf, "kernels (per step, mean over 1 graph replays)"));
    assert_non_null(strstr(buf, "| gate_up | 0.500 | 1.200 | +0.700 | 70.0 % |"));
    assert_non_null(strstr(buf, "activation         fused"));
    assert_null(strstr(buf, "fm_gen_kernel"));
    free(buf);
    fm_profile_free(p);
}

static void test_write_atomic(void **st) {
    (void)st;
    fm_profile *p = rendered();
    char dir[64];
    fm_test_tmpdir(dir, sizeof dir, "prof");
    char good[256], bad[256];
    snprintf(good, sizeof good, "%s/p.json", dir);
    snprintf(bad, sizeof bad, "%s/missing/t.json", dir);
    assert_int_equal(fm_profile_write(p, good, NULL, NULL), FM_OK);
    struct stat sb;
    assert_int_equal(stat(good, &sb), 0);
    unlink(good);
    /* the trace cannot be written: the error names it */
    assert_int_equal(fm_profile_write(p, NULL, bad, NULL), FM_E_IO);
    assert_non_null(strstr(fm_last_error(), "missing/t.json"));
    assert_int_not_equal(stat(bad, &sb), 0);
    rmdir(dir);
    fm_profile_free(p);
}

static void test_telemetry_cpu(void **st) {
    (void)st;
    fm_telemetry *t = NULL;
    assert_int_equal(fm_telemetry_start(FM_DEV_CPU, 0, 5, fm_now_ns(), &t), FM_OK);
    volatile double x = 0;
    for (int i = 0; i < 1000000; i++) x += i;
    fm_telemetry_stop(t);
    fm_telemetry_stop(t); /* idempotent */
    const fm_telem_sample *s = NULL;
    size_t n = fm_telemetry_samples(t, &s);
    assert_true(n >= 2); /* one at start, one at stop */
    for (size_t i = 0; i < n; i++) {
        assert_true(isnan(s[i].v[FM_TM_SM_UTIL]));
        double c = s[i].v[FM_TM_CPU_UTIL], o = s[i].v[FM_TM_PROC_UTIL];
        assert_true(isnan(c) || (c >= 0 && c <= 100));
        assert_true(isnan(o) || (o >= 0 && o <= 100));
        if (i) assert_true(s[i].t_s >= s[i - 1].t_s);
    }
    assert_non_null(strstr(fm_telemetry_note(t), "/proc/stat"));
    assert_int_equal(fm_telemetry_has_nvml(t), 0);
    fm_telemetry_free(t);
    assert_int_equal(fm_telemetry_start(FM_DEV_CPU, 0, 0, 0, &t), FM_E_RANGE);
    assert_null(t);
}

static void test_telemetry_nvml_absent(void **st) {
    (void)st;
    setenv("FP4MOE_NVML_LIB", "/nonexistent/libnvidia-ml.so.1", 1);
    fm_telemetry *t = NULL;
    assert_int_equal(fm_telemetry_start(FM_DEV_CUDA, 0, 50, fm_now_ns(), &t), FM_OK);
    fm_telemetry_stop(t);
    assert_int_equal(fm_telemetry_has_nvml(t), 0);
    assert_non_null(strstr(fm_telemetry_note(t), "NVML unavailable"));
    fm_telemetry_free(t);
    unsetenv("FP4MOE_NVML_LIB");
}

static fm_kernel_rec krec(const char *name, uint64_t start, uint64_t dur, uint32_t corr) {
    fm_kernel_rec r;
    memset(&r, 0, sizeof r);
    snprintf(r.name, sizeof r.name, "%s", name);
    r.start_ns = start;
    r.end_ns = start + dur;
    r.stream = 7;
    r.correlation = corr;
    r.phase = fm_prof_kernel_phase(name);
    return r;
}

/* 3 graph replays of a 2-layer step (route, expert gate/up, expert down per
 * layer) plus a lone kernel outside the graph, in scrambled order. */
static void test_kernel_steps_graph(void **st) {
    (void)st;
    fm_kernel_rec r[32];
    size_t n = 0;
    uint64_t t = 1000;
    for (uint32_t rep = 0; rep < 3; rep++)
        for (int l = 0; l < 2; l++) {
            r[n++] = krec("fm_route_kernel", t, 100, 10 + rep), t += 150;
            r[n++] = krec("void fm_expert_kernel<1, 2, false>(fm_expert_params, int, int)", t, 1000, 10 + rep), t += 1100;
            r[n++] = krec("void fm_expert_kernel<1, 1, false>(fm_expert_params, int, int)", t, 500, 10 + rep), t += 600;
        }
    r[n++] = krec("fm_gen_kernel", 10, 50000, 5);
    for (size_t i = 0; i < n; i += 2) { /* scramble */
        size_t j = (i * 7 + 3) % n;
        fm_kernel_rec x = r[i];
        r[i] = r[j];
        r[j] = x;
    }
    int step_of[32];
    double ns[FM_PH_COUNT];
    assert_int_equal(fm_prof_kernel_steps(r, n, 2, step_of, ns), 3);
    assert_true(ns[FM_PH_ROUTE] == 200 && ns[FM_PH_GATEUP] == 2000 && ns[FM_PH_DOWN] == 1000);
    assert_true(ns[FM_PH_OTHER] == 0);
    int lone = 0;
    for (size_t i = 0; i < n; i++) {
        if (i) assert_true(r[i].start_ns >= r[i - 1].start_ns); /* one stream: sorted by start */
        if (!strcmp(r[i].name, "fm_gen_kernel")) {
            assert_int_equal(step_of[i], -1);
            assert_int_equal(r[i].phase, FM_PH_OTHER);
            lone++;
        } else {
            assert_int_equal(step_of[i], (int)r[i].correlation - 10);
        }
    }
    assert_int_equal(lone, 1);
}

/* Without graphs every kernel has its own correlation id: routing kernels
 * count layers; a trailing partial step is left out. */
static void test_kernel_steps_no_graph(void **st) {
    (void)st;
    fm_kernel_rec r[32];
    size_t n = 0;
    uint64_t t = 0;
    uint32_t corr = 1;
    for (int l = 0; l < 5; l++) {
        r[n++] = krec("fm_route_kernel", t, 100, corr++), t += 200;
        r[n++] = krec("fm_gate_up_small", t, 300 + l, corr++), t += 400;
        r[n++] = krec("fm_down_small", t, 200, corr++), t += 300;
    }
    int step_of[32];
    double ns[FM_PH_COUNT];
    assert_int_equal(fm_prof_kernel_steps(r, n, 2, step_of, ns), 2);
    assert_true(ns[FM_PH_ROUTE] == 200 && ns[FM_PH_DOWN] == 400);
    assert_true(ns[FM_PH_GATEUP] == (300 + 301 + 302 + 303) / 2.0);
    assert_int_equal(step_of[0], 0);
    assert_int_equal(step_of[3 * 2], 1);
    assert_int_equal(step_of[3 * 4], -1);
    assert_int_equal(fm_prof_kernel_steps(r, 0, 2, step_of, ns), 0);
}

/* Overlapping kernels of one stream (programmatic dependent launch): each
 * nanosecond counts once, under the kernel that ran first. */
static void test_kernel_steps_overlap(void **st) {
    (void)st;
    fm_kernel_rec r[8];
    size_t n = 0;
    /* one step: route [0,100), gate_up [80,500) overlaps route by 20,
     * down [450,900) overlaps gate_up by 50 */
    r[n++] = krec("fm_route_kernel", 0, 100, 1);
    r[n++] = krec("fm_gate_up_small", 80, 420, 2);
    r[n++] = krec("fm_down_small", 450, 450, 3);
    int step_of[8];
    double ns[FM_PH_COUNT];
    assert_int_equal(fm_prof_kernel_steps(r, n, 1, step_of, ns), 1);
    assert_true(ns[FM_PH_ROUTE] == 100);
    assert_true(ns[FM_PH_GATEUP] == 400); /* 500 - 100 */
    assert_true(ns[FM_PH_DOWN] == 400);   /* 900 - 500 */
    double sum = 0;
    for (int q = 0; q < FM_PH_COUNT; q++) sum += ns[q];
    assert_true(sum == 900); /* the union of the three intervals */
}

/* The CUDA backend's forked layout: routing and the routed experts on one
 * stream, the shared expert's two launches (the same kernels, marked by
 * FM_CUDA_SHARED_SMEM_MARK bytes of dynamic shared memory) beside them; in
 * a graph CUPTI may report them on the routing stream or on another. They
 * are "shared", not gate/up, down and other, do not disturb the order that
 * names the routed gate/up and down, and count only where no other kernel of
 * their device runs, so the phases add up to the union of the busy time. */
static fm_kernel_rec smem_rec(fm_kernel_rec r, uint32_t dyn, uint32_t stream) {
    r.dyn_smem = dyn;
    r.stream = stream;
    return r;
}

static void test_kernel_steps_forked_shared(void **st) {
    (void)st;
    const char *ek = "void fm_expert_wg_kernel<2, false, 2, false, 1>(fm_expert_params, int, int)";
    const uint32_t need = 40320, mark = need + FM_CUDA_SHARED_SMEM_MARK;
    fm_kernel_rec r[16];
    size_t n = 0;
    for (uint64_t t = 0; t < 2000; t += 1000) {
        const uint32_t side = t ? 7 : 9; /* layer 2's branch on the routing stream */
        r[n++] = krec("fm_logits_gemv_kernel(fm_route_params)", t, 50, 1);
        r[n++] = smem_rec(krec("fm_route_kernel<4>(fm_route_params)", t + 50, 50, 1), 27264 + 8, 7);
        r[n++] = smem_rec(krec(ek, t + 100, 500, 1), need, 7);
        r[n++] = smem_rec(krec(ek, t + 600, 300, 1), need, 7);
        /* the shared expert: gate/up wholly beside the selection and the
         * routed gate/up; its down 50 ns beside the routed down, 100 after */
        r[n++] = smem_rec(krec(ek, t + 60, 240, 1), mark, side);
        r[n++] = smem_rec(krec(ek, t + 850, 150, 1), mark, side);
    }
    /* another device: nothing of device 0 hides its kernel */
    r[n] = smem_rec(krec(ek, 100, 100, 1), mark, 11), r[n++].device = 1;
    int step_of[16];
    double ns[FM_PH_COUNT];
    assert_int_equal(fm_prof_kernel_steps(r, n, 2, step_of, ns), 1);
    assert_true(ns[FM_PH_ROUTE] == 200);
    assert_true(ns[FM_PH_GATEUP] == 1000);
    assert_true(ns[FM_PH_DOWN] == 600);
    assert_true(ns[FM_PH_SHARED] == 2 * 100 + 100);
    assert_true(ns[FM_PH_OTHER] == 0);
    int shared = 0;
    for (size_t i = 0; i < n; i++) {
        assert_int_equal(step_of[i], 0);
        if (r[i].dyn_smem == mark) {
            assert_int_equal(r[i].phase, FM_PH_SHARED);
            shared++;
        } else {
            assert_int_not_equal(r[i].phase, FM_PH_SHARED);
        }
    }
    assert_int_equal(shared, 5);

    /* the kernel table keeps the shared expert's launches apart */
    fm_profile *p = fm_profile_new();
    assert_non_null(p);
    for (size_t i = 0; i < n; i++) {
        fm_prof_span sp;
        memset(&sp, 0, sizeof sp);
        sp.t_us = r[i].start_ns * 1e-3, sp.dur_us = (r[i].end_ns - r[i].start_ns) * 1e-3;
        sp.pid = 2, sp.tid = (int)r[i].stream, sp.kind = 4, sp.phase = r[i].phase, sp.step = step_of[i];
        snprintf(sp.name, sizeof sp.name, "%.95s", r[i].name);
        fm_profile_add_span(p, &sp);
    }
    fm_prof_kernel_row kr[8];
    int steps = 0, nk = fm_prof_kernel_rows(p, 0, kr, 8, &steps);
    assert_int_equal(steps, 1);
    assert_int_equal(nk, 5); /* logits, selection, gate/up, down, the shared expert's */
    int seen = 0;
    for (int j = 0; j < nk; j++)
        if (kr[j].phase == FM_PH_SHARED) {
            assert_true(kr[j].launches == 5);
            assert_true(fabs(kr[j].us - (2 * 0.240 + 2 * 0.150 + 0.100)) < 1e-9);
            seen++;
        } else if (kr[j].phase == FM_PH_GATEUP) {
            assert_true(kr[j].launches == 2);
            seen++;
        }
    assert_int_equal(seen, 2);
    fm_profile_free(p);
}

static void test_cupti_without_build(void **st) {
    (void)st;
#ifdef FM_HAVE_CUPTI
    printf("SKIPPED: built with CUPTI (the GPU test covers it)\n");
    skip();
#else
    fm_cupti *c = (fm_cupti *)1;
    assert_int_equal(fm_cupti_start(&c), FM_E_UNSUPPORTED);
    assert_null(c);
    assert_int_equal(fm_cupti_records(NULL, NULL), 0);
#endif
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_expected_active),    cmocka_unit_test(test_tile_fill),
        cmocka_unit_test(test_tile_fill_expected), cmocka_unit_test(test_kernel_phase),
        cmocka_unit_test(test_matrix_bytes),       cmocka_unit_test(test_throttle_str),
        cmocka_unit_test(test_summarize),          cmocka_unit_test(test_finish_and_verdicts), cmocka_unit_test(test_power_verdict),
        cmocka_unit_test(test_read_baseline),
        cmocka_unit_test(test_delta),              cmocka_unit_test(test_json),
        cmocka_unit_test(test_trace),              cmocka_unit_test(test_html),
        cmocka_unit_test(test_write_atomic),       cmocka_unit_test(test_telemetry_cpu),
        cmocka_unit_test(test_telemetry_nvml_absent), cmocka_unit_test(test_cupti_without_build),
        cmocka_unit_test(test_kernel_steps_graph), cmocka_unit_test(test_kernel_steps_no_graph),
        cmocka_unit_test(test_kernel_steps_overlap), cmocka_unit_test(test_kernel_steps_forked_shared),
        cmocka_unit_test(test_contended_note),
        cmocka_unit_test(test_finish_ep_rank),     cmocka_unit_test(test_profile_ep_rank_cpu),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
