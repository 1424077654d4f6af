/*
 * Fast CPU engine vs the float64 reference on seeded random layers of every
 * tiny preset (one per routing family) in every expert format. Shared by
 * tests/test_cpu.c and tests/tools/cpu_isa_check.c (header-only, static).
 *
 * Relative error of a token: max |fast - ref| / max |ref| over its H
 * outputs (a per-element ratio would be meaningless next to outputs that
 * are almost zero). The expert ids must match exactly.
 */
#ifndef FM_TESTS_CPU_CHECK_H
#define FM_TESTS_CPU_CHECK_H
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fp4moe.h"
#include "util/util.h"

static const char *const cpu_check_presets[] = {"tiny-deepseek", "tiny-deepseek-v4", "tiny-qwen3", "tiny-mixtral",
                                                "tiny-gptoss"};
static const fm_qformat cpu_check_formats[] = {FM_QF_NVFP4, FM_QF_MXFP4, FM_QF_BF16};
#define CPU_CHECK_TOL 1e-5

/* Seeded activations in dtype dt (values exactly representable in it). */
static void *cpu_check_input(int T, int64_t H, fm_dtype dt, uint64_t seed) {
    size_t n = (size_t)T * (size_t)H;
    void *p = malloc(n * 4 + 4);
    if (!p) return NULL;
    for (size_t i = 0; i < n; i++) {
        float v = fm_rng_normal(seed, 0x1A7E, i);
        if (dt == FM_DT_F32) ((float *)p)[i] = v;
        else if (dt == FM_DT_BF16) ((uint16_t *)p)[i] = fm_f32_to_bf16(v);
        else ((uint16_t *)p)[i] = fm_f32_to_f16(v);
    }
    return p;
}

/* Worst relative error over tokens (see above). */
static double cpu_check_rel(const float *a, const float *ref, int T, int64_t H) {
    double worst = 0;
    for (int t = 0; t < T; t++) {
        double md = 0, mr = 0;
        for (int64_t c = 0; c < H; c++) {
            double d = fabs((double)a[t * H + c] - (double)ref[t * H + c]);
            md = d > md ? d : md;
            mr = fabs((double)ref[t * H + c]) > mr ? fabs((double)ref[t * H + c]) : mr;
        }
        double r = md / (mr > 1e-30 ? mr : 1e-30);
        worst = r > worst ? r : worst;
    }
    return worst;
}

/* One case. wide: the preset's hidden size and expert widths replaced by
 * 416 and 288 (3 and 2 full 128-element chunks of the AVX-512 kernels and
 * a 32-element tail; 6 and 4 chunks of the AVX2 ones and a tail), so that
 * every kernel runs its vector loop several times per row. Returns 0 when
 * within tolerance with identical ids, 1 on a mismatch, -1 when something
 * failed to run; msg says which. */
static int cpu_check_case(fm_cpu_engine *eng, const char *preset, fm_qformat fmt, int layer, int T, fm_dtype xdt,
                          uint64_t seed, int wide, double *rel_out, char *msg, size_t cap) {
    fm_model_desc d;
    fm_moe_layer *l = NULL;
    int rc = -1;
    void *x = NULL;
    float *of = NULL, *orf = NULL, *wf = NULL, *wr = NULL;
    int32_t *idf = NULL, *idr = NULL, *tok = NULL;
    fm_status st = fm_preset_desc(preset, fmt, &d);
    if (!st && wide) {
        d.hidden = 416;
        d.shared_inter = d.shared_inter > 0 ? 288 : 0;
        d.moe_inter = 288;
    }
    if (!st) {
        if (layer < 0) layer = d.n_layers + layer;
        st = fm_moe_layer_random(&d, fmt, seed, layer, &l);
    }
    if (st) {
        snprintf(msg, cap, "%s/%s layer %d: setup failed: %s", preset, fm_qformat_name(fmt), layer, fm_last_error());
        return -1;
    }
    const int64_t H = d.hidden;
    const int k = d.topk;
    x = cpu_check_input(T, H, xdt, seed + 1);
    of = malloc(sizeof(float) * (size_t)(T * H));
    orf = malloc(sizeof(float) * (size_t)(T * H));
    wf = malloc(sizeof(float) * (size_t)(T * k));
    wr = malloc(sizeof(float) * (size_t)(T * k));
    idf = malloc(sizeof(int32_t) * (size_t)(T * k));
    idr = malloc(sizeof(int32_t) * (size_t)(T * k));
    tok = malloc(sizeof(int32_t) * (size_t)T);
    if (!x || !of || !orf || !wf || !wr || !idf || !idr || !tok) {
        snprintf(msg, cap, "out of memory");
        goto done;
    }
    for (int t = 0; t < T; t++) tok[t] = (int32_t)(fm_rng_u64(seed, 0x7070, (uint64_t)t) % (uint64_t)d.vocab_size);
    fm_moe_out oref = {orf, idr, wr}, ofast = {of, idf, wf};
    st = fm_moe_forward_ref(&d, l, x, xdt, T, tok, &oref);
    if (!st) st = fm_cpu_forward(eng, &d, l, x, xdt, T, tok, &ofast);
    if (st) {
        snprintf(msg, cap, "%s%s/%s layer %d T=%d: %s", preset, wide ? " (wide)" : "", fm_qformat_name(fmt), layer, T,
                 fm_last_error());
        goto done;
    }
    rc = 0;
    if (memcmp(idf, idr, sizeof(int32_t) * (size_t)(T * k)) != 0 ||
        memcmp(wf, wr, sizeof(float) * (size_t)(T * k)) != 0) {
        snprintf(msg, cap, "%s%s/%s layer %d T=%d: top-k ids/weights differ from the reference", preset,
                 wide ? " (wide)" : "", fm_qformat_name(fmt), layer, T);
        rc = 1;
    }
    double rel = cpu_check_rel(of, orf, T, H);
    if (rel_out) *rel_out = rel;
    if (!(rel <= CPU_CHECK_TOL) && rc == 0) {
        snprintf(msg, cap, "%s%s/%s layer %d T=%d %s: relative error %.3g > %.0e", preset, wide ? " (wide)" : "",
                 fm_qformat_name(fmt), layer, T, fm_dtype_name(xdt), rel, CPU_CHECK_TOL);
        rc = 1;
    }
done:
    fm_moe_layer_free(l);
    free(x); free(of); free(orf); free(wf); free(wr); free(idf); free(idr); free(tok);
    return rc;
}

/* Every preset x format x {first MoE layer, last layer, first MoE layer in
 * the wide shape} x a few batch sizes (fewer when quick) and input dtypes on
 * one engine. Returns the number of failures; prints each; *worst gets the
 * largest relative error seen. */
static int cpu_check_all(fm_cpu_engine *eng, double *worst, int verbose, int quick) {
    static const int Ts_all[] = {1, 2, 3, 5, 9, 17}, Ts_quick[] = {1, 3, 17};
    const int *Ts = quick ? Ts_quick : Ts_all;
    const size_t nT = quick ? 3 : 6;
    static const fm_dtype dts[] = {FM_DT_F32, FM_DT_BF16, FM_DT_F16};
    int fails = 0, n = 0;
    *worst = 0;
    for (size_t p = 0; p < sizeof cpu_check_presets / sizeof *cpu_check_presets; p++)
        for (size_t f = 0; f < sizeof cpu_check_formats / sizeof *cpu_check_formats; f++) {
            fm_model_desc d;
            if (fm_preset_desc(cpu_check_presets[p], cpu_check_formats[f], &d)) {
                printf("FAIL %s: %s\n", cpu_check_presets[p], fm_last_error());
                fails++;
                continue;
            }
            int layers[2] = {0, d.n_layers - 1};
            while (!fm_model_is_moe_layer(&d, layers[0])) layers[0]++;
            /* the preset's shape on both layers, then the wide shape on the
             * first MoE layer */
            for (int li = 0; li < 3; li++)
                for (size_t ti = 0; ti < nT; ti++) {
                    const int wide = li == 2;
                    if (quick && !wide && (li == 0) != (ti != 2)) continue; /* first layer: T 1, 3; last: T 17 */
                    if (quick && wide && ti != 0) continue;                 /* wide: T 1 */
                    char msg[512] = "";
                    double rel = 0;
                    fm_dtype dt = dts[(p + f + ti + wide) % 3];
                    int rc = cpu_check_case(eng, cpu_check_presets[p], cpu_check_formats[f], layers[wide ? 0 : li],
                                            Ts[ti], dt, 1000 + 17 * p + 5 * f + ti + 101 * wide, wide, &rel, msg,
                                            sizeof msg);
                    n++;
                    if (rel > *worst) *worst = rel;
                    if (rc) {
                        printf("FAIL %s\n", msg);
                        fails++;
                    } else if (verbose) {
                        printf("ok   %-16s %-5s layer %d%s T=%-2d %-4s rel %.2e\n", cpu_check_presets[p],
                               fm_qformat_name(cpu_check_formats[f]), layers[wide ? 0 : li], wide ? " (wide)" : "",
                               Ts[ti], fm_dtype_name(dt), rel);
                    }
                }
        }
    if (verbose) printf("%d cases, %d failures, worst relative error %.3g\n", n, fails, *worst);
    return fails;
}

#endif
