/*
 * GPU benchmark table of the CUDA backend (used by dev/gpu/run.sh):
 * measures the device's streaming-read bandwidth in the same run, then for
 * each batch size times `layers` distinct random layers back to back in one
 * CUDA graph and prints µs per layer, GB/s, % of the measured bandwidth and
 * the ratio to the floor (the time to read the routed active experts'
 * bytes at that bandwidth). One JSON object per line goes to --json.
 *
 *   cuda_bench --preset deepseek-v4-flash [--format nvfp4|mxfp4]
 *              [--batch 1,2,4] [--layers 8] [--reps 30] [--no-shared]
 *              [--config WARPS,KSPLIT,TILE_N] [--variants] [--json FILE]
 */
#include "fp4moe.h"
#include "util/util.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int parse_list(const char *s, int *v, int max) {
    int n = 0;
    while (*s && n < max) {
        char *end;
        long x = strtol(s, &end, 10);
        if (end == s || x <= 0 || x > 65536) return -1;
        v[n++] = (int)x;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return -1;
    }
    return n;
}

int main(int argc, char **argv) {
    const char *preset = "deepseek-v4-flash", *fmtname = "nvfp4", *json = NULL;
    int batches[64] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512}, nb = 10, layers = 8, reps = 30, shared = 1;
    int variants = 0, forced = 0;
    fm_kernel_config fc;
    memset(&fc, 0, sizeof fc);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--preset") && v) preset = argv[++i];
        else if (!strcmp(a, "--format") && v) fmtname = argv[++i];
        else if (!strcmp(a, "--batch") && v) { nb = parse_list(argv[++i], batches, 64); if (nb <= 0) { fprintf(stderr, "cuda_bench: bad --batch\n"); return 2; } }
        else if (!strcmp(a, "--layers") && v) layers = atoi(argv[++i]);
        else if (!strcmp(a, "--reps") && v) reps = atoi(argv[++i]);
        else if (!strcmp(a, "--json") && v) json = argv[++i];
        else if (!strcmp(a, "--no-shared")) shared = 0;
        else if (!strcmp(a, "--variants")) variants = 1;
        else if (!strcmp(a, "--config") && v) {
            int c[3];
            if (parse_list(argv[++i], c, 3) != 3) { fprintf(stderr, "cuda_bench: --config WARPS,KSPLIT,TILE_N\n"); return 2; }
            forced = 1;
            fc.warps = c[0]; fc.k_split = c[1]; fc.tile_n = c[2];
            fc.path = c[1] > 1 ? FM_PATH_SMALL : FM_PATH_LARGE;
            fc.rows_per_block = 16 * (c[1] ? c[0] / c[1] : 1);
            fc.stages = 1;
            fc.switch_tpe = 0;
        } else { fprintf(stderr, "cuda_bench: unknown argument %s\n", a); return 2; }
    }
    if (layers < 1 || layers > 64 || reps < 1) { fprintf(stderr, "cuda_bench: bad --layers/--reps\n"); return 2; }
    fm_qformat fmt = fm_qformat_from_name(fmtname);
    fm_model_desc d;
    if (fm_preset_desc(preset, fmt, &d)) { fprintf(stderr, "cuda_bench: %s\n", fm_last_error()); return 1; }
    fm_cuda_engine *e;
    if (fm_cuda_engine_new(0, &e)) { fprintf(stderr, "cuda_bench: %s\n", fm_last_error()); return 1; }
    fm_cuda_engine_set_shared(e, shared);
    double bw = fm_cuda_measure_bandwidth(e, (size_t)4 << 30);
    printf("# %s\n# streaming read %.3f TB/s (4 GiB, 16-byte loads, best of 10)\n", fm_cuda_engine_describe(e), bw / 1e12);
    fm_cuda_layer **ls = calloc((size_t)layers, sizeof *ls);
    int L0 = 0;
    while (L0 < d.n_layers && !fm_model_is_moe_layer(&d, L0)) L0++;
    for (int i = 0; i < layers; i++)
        if (fm_cuda_layer_random(e, &d, fmt, 1, L0 + i, &ls[i])) { fprintf(stderr, "cuda_bench: layer %d: %s\n", L0 + i, fm_last_error()); return 1; }
    FILE *jf = json ? fopen(json, "a") : NULL;
    int64_t ebytes = fm_model_expert_bytes(&d, fmt);
    printf("# %s %s, %d layers from layer %d, shared expert %s; floor = routed active experts x %lld B / bandwidth\n",
           preset, fmtname, layers, L0, shared && d.n_shared ? "on" : "off", (long long)ebytes);
    printf("%5s %8s %9s %9s %8s %7s %7s %7s  %s\n", "B", "active", "floor_us", "us", "GB/s", "%bw", "xfloor", "spread", "config");
    /* {path, rows_per_block, k_split, warps, stages (1 registers, 3 cp.async), tile_n} */
    const fm_kernel_config vars[] = {
        {FM_PATH_SMALL, 16, 4, 4, 1, 8, 0},  {FM_PATH_LARGE, 64, 1, 4, 1, 8, 0},   {FM_PATH_LARGE, 64, 1, 4, 1, 16, 0},
        {FM_PATH_SMALL, 16, 8, 8, 3, 8, 0},  {FM_PATH_SMALL, 16, 4, 4, 3, 8, 0},   {FM_PATH_LARGE, 64, 1, 4, 3, 8, 0},
        {FM_PATH_LARGE, 128, 1, 8, 3, 8, 0}, {FM_PATH_LARGE, 64, 1, 4, 3, 16, 0},  {FM_PATH_LARGE, 128, 1, 8, 3, 16, 0},
        {FM_PATH_SMALL, 32, 2, 4, 3, 8, 0},  {FM_PATH_SMALL, 32, 2, 4, 3, 16, 0},  {FM_PATH_LARGE, 64, 1, 4, 3, 32, 0},
    };
    int nv = variants ? (int)(sizeof vars / sizeof vars[0]) : 1;
    double best_us[64];
    fm_cuda_bench_result best[64];
    for (int bi = 0; bi < nb; bi++) {
        best_us[bi] = 1e30;
        for (int vi = 0; vi < nv; vi++) {
            if (variants) fm_cuda_engine_set_config(e, &vars[vi]);
            else fm_cuda_engine_set_config(e, forced ? &fc : NULL);
            fm_cuda_bench_result r;
            if (fm_cuda_bench(e, &d, ls, layers, batches[bi], 7, reps, &r)) { fprintf(stderr, "cuda_bench: B=%d: %s\n", batches[bi], fm_last_error()); return 1; }
            double floor_us = r.active_experts * (double)ebytes / bw * 1e6;
            if (r.us_per_layer < best_us[bi]) { best_us[bi] = r.us_per_layer; best[bi] = r; }
            double gbs = r.bytes_per_layer / (r.us_per_layer * 1e-6) / 1e9;
            printf("%5d %8.1f %9.1f %9.1f %8.0f %6.1f%% %7.2f %7.1f  w%d/ks%d/n%d/%s %s\n", batches[bi],
                   r.active_experts, floor_us, r.us_per_layer, gbs, 100.0 * gbs * 1e9 / bw, r.us_per_layer / floor_us,
                   r.us_max - r.us_min, r.cfg.warps, r.cfg.k_split, r.cfg.tile_n, r.cfg.stages > 1 ? "cp" : "rg",
                   variants ? "" : r.config_source);
            if (!variants) {
                printf("      routing alone in a graph: %.1f us (logits kernel %.1f us, selection + grouping %.1f us)\n",
                       r.route_us, r.logits_us, r.route_us - r.logits_us);
                /* per-kernel split of one layer (events around each launch, no graph);
                 * activations N(0, 1) and independent per token, as in the timed
                 * graph, so that the tokens spread over as many experts (a
                 * periodic pattern sent the tokens of a batch to a few experts) */
                int T = batches[bi], H = d.hidden;
                float *x = malloc(sizeof(float) * (size_t)T * H), *out = malloc(sizeof(float) * (size_t)T * H);
                int32_t *tok = malloc(sizeof(int32_t) * (size_t)T);
                for (int64_t i = 0; i < (int64_t)T * H; i++) x[i] = fm_rng_normal(77, 5, (uint64_t)i);
                for (int t = 0; t < T; t++) tok[t] = t * 13;
                fm_phase_times pt;
                memset(&pt, 0, sizeof pt);
                fm_moe_out o = {out, NULL, NULL};
                fm_cuda_forward(e, &d, ls[layers - 1], x, FM_DT_F32, T, tok, &o);
                fm_cuda_engine_set_phase_times(e, &pt);
                for (int it = 0; it < 5; it++) fm_cuda_forward(e, &d, ls[layers - 1], x, FM_DT_F32, T, tok, &o);
                fm_cuda_engine_set_phase_times(e, NULL);
                if (pt.calls)
                    printf("      phases (layer %d alone, no graph): routing %.1f us, gate_up %.1f us, down %.1f us\n",
                           L0 + layers - 1, pt.ns[FM_PH_ROUTE] / pt.calls / 1e3, pt.ns[FM_PH_GATEUP] / pt.calls / 1e3,
                           pt.ns[FM_PH_DOWN] / pt.calls / 1e3);
                free(x); free(out); free(tok);
            }
            fflush(stdout);
            if (jf)
                fprintf(jf, "{\"preset\":\"%s\",\"format\":\"%s\",\"B\":%d,\"layers\":%d,\"shared\":%d,\"active\":%.2f,"
                            "\"bytes\":%lld,\"us\":%.2f,\"us_min\":%.2f,\"us_max\":%.2f,\"bw\":%.4g,\"floor_us\":%.2f,"
                            "\"warps\":%d,\"k_split\":%d,\"tile_n\":%d,\"stages\":%d,\"kernel\":\"%s\",\"source\":\"%s\","
                            "\"route_us\":%.2f,\"logits_us\":%.2f}\n",
                        preset, fmtname, batches[bi], layers, shared, r.active_experts, (long long)r.bytes_per_layer,
                        r.us_per_layer, r.us_min, r.us_max, bw, floor_us, r.cfg.warps, r.cfg.k_split, r.cfg.tile_n,
                        r.cfg.stages, r.kernel, r.config_source, r.route_us, r.logits_us);
        }
    }
    if (variants) {
        printf("# best variant per batch (%s %s, %d layers, shared expert %s)\n", preset, fmtname, layers,
               shared && d.n_shared ? "on" : "off");
        printf("%5s %8s %9s %9s %8s %7s %7s  %s\n", "B", "active", "floor_us", "us", "GB/s", "%bw", "xfloor", "config");
        for (int bi = 0; bi < nb; bi++) {
            const fm_cuda_bench_result *r = &best[bi];
            double floor_us = r->active_experts * (double)ebytes / bw * 1e6;
            double gbs = r->bytes_per_layer / (r->us_per_layer * 1e-6) / 1e9;
            printf("%5d %8.1f %9.1f %9.1f %8.0f %6.1f%% %7.2f  w%d/ks%d/n%d/%s\n", batches[bi], r->active_experts,
                   floor_us, r->us_per_layer, gbs, 100.0 * gbs * 1e9 / bw, r->us_per_layer / floor_us, r->cfg.warps,
                   r->cfg.k_split, r->cfg.tile_n, r->cfg.stages > 1 ? "cp" : "rg");
        }
    }
    if (jf) fclose(jf);
    for (int i = 0; i < layers; i++) fm_cuda_layer_free(ls[i]);
    free(ls);
    fm_cuda_engine_free(e);
    return 0;
}
