/* fp4moe bench: time the MoE layer against this machine's measured memory
 * bandwidth (parsing and printing; the measurements live in libfp4moe). */
#include "cli.h"
#include "dist_opts.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "util/util.h"

int fm_cli_parse_isa(const char *cmd, const char *s, fm_cpu_isa *out);

#define MAX_BATCH 32
#define MAX_LAYERS 64

static void bench_usage(FILE *f) {
    fprintf(f,
            "usage: fp4moe bench [--model DIR | --preset NAME] [--format nvfp4|mxfp4|bf16]\n"
            "                    [--batch 1,4,16,64,256] [--layers N] [--device cpu|cuda] [--json FILE]\n"
            "                    [--threads N] [--isa auto|scalar|avx2|avx512] [--time-ms MS] [--seed S]\n"
            "                    [--bw-mib MIB] [--sustain-ms MS]\n\n"
            "Measures this machine's memory bandwidth (streaming read, all threads), then for each\n"
            "batch size times one MoE layer: us per layer, tokens/s, active experts, bytes of weights\n"
            "read (active routed experts + shared expert + router), achieved GB/s and %% of the\n"
            "measured bandwidth, and the kernel that ran. N distinct layers are cycled so caches do\n"
            "not flatter the figure (default: enough to read well past the last-level cache).\n"
            "--preset builds seeded random weights in memory (default preset qwen3-30b-a3b);\n"
            "--model reads the MoE layers present in a checkpoint. --time-ms is the minimum timing\n"
            "per batch size (default 1000). --bw-mib is the probe's buffer (default 1024 MiB on the\n"
            "CPU, 4096 MiB on a GPU, where a smaller read spends a larger share in the launch).\n"
            "On a GPU each batch size is the median of 50 replays of one CUDA graph of the N layers,\n"
            "after three warm-up replays: a burst, before the GPU's power management lowers its\n"
            "clocks. --sustain-ms first replays the graph for MS milliseconds, so that the timed\n"
            "replays run at the clocks the power limit allows under sustained load (a decode\n"
            "server's case; on an H200 1000 ms is enough, docs/perf.md).\n\npresets:");
    for (size_t i = 0; i < fm_preset_count(); i++) fprintf(f, " %s", fm_preset_name(i));
    fprintf(f, "\n");
}

/* Progress on stderr, shown only once an operation has run for a second. */
static uint64_t g_prog_start, g_prog_last;
static int g_prog_shown;
static void progress_begin(void) {
    g_prog_start = fm_now_ns();
    g_prog_last = 0;
}
static void progress(void *ctx, const char *what, double frac) {
    uint64_t now = fm_now_ns();
    if (now - g_prog_start < 1000000000ull) return;
    int tty = isatty(2);
    if (!tty && now - g_prog_last < 5000000000ull) return;
    g_prog_last = now;
    g_prog_shown = 1;
    if (tty) fprintf(stderr, "\r\033[K%s: %s %3.0f%%", (const char *)ctx, what, frac * 100.0);
    else fprintf(stderr, "%s: %s %.0f%%\n", (const char *)ctx, what, frac * 100.0);
    fflush(stderr);
}
static void progress_done(void) {
    if (g_prog_shown && isatty(2)) fprintf(stderr, "\r\033[K");
    g_prog_shown = 0;
}

typedef struct {
    int T;
    double us, us_min, us_max, tps, active, gbps;
    int64_t bytes;
    char kernel[640];
    char provenance[1344]; /* the kernel line (640), the config's path (512) and ~170 of text */
    char decision[2048]; /* the tuning decision at the start of the run */
} row;

static int write_json(const char *path, const char *source, const fm_model_desc *d, fm_qformat fmt, int n_layers,
                      double bw, const char *bw_what, long sustain_ms, const row *rows, int n) {
    json_t *root = json_object(), *arr = json_array();
    json_object_set_new(root, "version", json_string(FM_VERSION));
    json_object_set_new(root, "source", json_string(source));
    json_object_set_new(root, "family", json_string(d->family));
    json_object_set_new(root, "format", json_string(fm_qformat_name(fmt)));
    json_object_set_new(root, "hidden", json_integer(d->hidden));
    json_object_set_new(root, "moe_inter", json_integer(d->moe_inter));
    json_object_set_new(root, "n_experts", json_integer(d->n_experts));
    json_object_set_new(root, "topk", json_integer(d->topk));
    json_object_set_new(root, "n_shared", json_integer(d->n_shared));
    json_object_set_new(root, "layers_cycled", json_integer(n_layers));
    json_object_set_new(root, "bandwidth_gbps", json_real(bw * 1e-9));
    json_object_set_new(root, "bandwidth_probe", json_string(bw_what));
    json_object_set_new(root, "sustain_ms", json_integer(sustain_ms));
    for (int i = 0; i < n; i++) {
        json_t *r = json_object();
        json_object_set_new(r, "batch", json_integer(rows[i].T));
        json_object_set_new(r, "us_per_layer", json_real(rows[i].us));
        json_object_set_new(r, "us_min", json_real(rows[i].us_min));
        json_object_set_new(r, "us_max", json_real(rows[i].us_max));
        json_object_set_new(r, "tokens_per_s", json_real(rows[i].tps));
        json_object_set_new(r, "active_experts", json_real(rows[i].active));
        json_object_set_new(r, "bytes_per_layer", json_integer(rows[i].bytes));
        json_object_set_new(r, "gbps", json_real(rows[i].gbps));
        json_object_set_new(r, "pct_bandwidth", json_real(bw > 0 ? 100.0 * rows[i].gbps * 1e9 / bw : 0.0));
        json_object_set_new(r, "kernel", json_string(rows[i].kernel));
        if (rows[i].provenance[0]) json_object_set_new(r, "provenance", json_string(rows[i].provenance));
        if (rows[i].decision[0]) json_object_set_new(r, "decision", json_string(rows[i].decision));
        json_array_append_new(arr, r);
    }
    json_object_set_new(root, "results", arr);
    char *s = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(6));
    json_decref(root);
    if (!s) return fm_cli_fail("bench", fm_error(FM_E_NOMEM, "cannot encode the JSON report"));
    fm_status st = fm_write_file_atomic(path, s, strlen(s));
    free(s);
    return st ? fm_cli_fail("bench", st) : 0;
}

/* The i-th MoE layer of the model (wrapping), for presets. */
static int nth_moe_layer(const fm_model_desc *d, int i) {
    int n_moe = 0;
    for (int l = 0; l < d->n_layers; l++) n_moe += fm_model_is_moe_layer(d, l);
    if (n_moe == 0) return -1;
    int want = i % n_moe;
    for (int l = 0; l < d->n_layers; l++)
        if (fm_model_is_moe_layer(d, l) && want-- == 0) return l;
    return -1;
}

int fm_cmd_bench(int argc, char **argv) {
    const char *model = NULL, *preset = NULL, *json = NULL, *fmt_s = NULL;
    int batches[MAX_BATCH] = {1, 4, 16, 64, 256}, n_batch = 5;
    int n_layers = 0, threads = 0, cuda = 0;
    long time_ms = 1000, bw_mib = 0, seed = 1, sustain_ms = -1;
    fm_cpu_isa isa = FM_CPU_AUTO;
    fm_cli_dist dist = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        long n;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { bench_usage(stdout); fputs(fm_cli_dist_usage(), stdout); return 0; }
        int dr = fm_cli_dist_parse("bench", argc, argv, &i, &dist);
        if (dr < 0) return 2;
        if (dr) continue;
        if (!v) { fprintf(stderr, "fp4moe bench: error: %s needs a value\n", a); return 2; }
        if (!strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--preset")) preset = v;
        else if (!strcmp(a, "--format")) fmt_s = v;
        else if (!strcmp(a, "--json")) json = v;
        else if (!strcmp(a, "--batch")) {
            if ((n_batch = fm_cli_parse_int_list("bench", v, batches, MAX_BATCH)) < 0) return 2;
        } else if (!strcmp(a, "--layers")) {
            if (fm_cli_parse_int("bench", a, v, 1, MAX_LAYERS, &n)) return 2;
            n_layers = (int)n;
        } else if (!strcmp(a, "--threads")) {
            if (fm_cli_parse_int("bench", a, v, 1, 1024, &n)) return 2;
            threads = (int)n;
        } else if (!strcmp(a, "--isa")) {
            if (fm_cli_parse_isa("bench", v, &isa)) return 2;
        } else if (!strcmp(a, "--time-ms")) {
            if (fm_cli_parse_int("bench", a, v, 0, 3600000, &time_ms)) return 2;
        } else if (!strcmp(a, "--sustain-ms")) {
            if (fm_cli_parse_int("bench", a, v, 0, 600000, &sustain_ms)) return 2;
        } else if (!strcmp(a, "--bw-mib")) {
            if (fm_cli_parse_int("bench", a, v, 1, 1 << 20, &bw_mib)) return 2;
        } else if (!strcmp(a, "--seed")) {
            if (fm_cli_parse_int("bench", a, v, 0, 0x7FFFFFFFFFFFFFFFL, &seed)) return 2;
        } else if (!strcmp(a, "--device")) {
            if (!strcmp(v, "cpu")) cuda = 0;
            else if (!strcmp(v, "cuda")) cuda = 1;
            else { fprintf(stderr, "fp4moe bench: error: --device '%s' (expected cpu or cuda)\n", v); return 2; }
        } else {
            fprintf(stderr, "fp4moe bench: error: unknown option '%s'\n\n", a);
            bench_usage(stderr);
            return 2;
        }
        i++;
    }
    if (sustain_ms >= 0 && !cuda) {
        fprintf(stderr, "fp4moe bench: error: --sustain-ms applies to --device cuda (the CPU path times for --time-ms)\n");
        return 2;
    }
    if (sustain_ms < 0) sustain_ms = 0;
    if (model && preset) { fprintf(stderr, "fp4moe bench: error: give --model or --preset, not both\n"); return 2; }
    if (model && fmt_s) { fprintf(stderr, "fp4moe bench: error: --format applies to --preset only\n"); return 2; }
    if (!model && !preset) preset = "qwen3-30b-a3b";
    fm_qformat fmt = FM_QF_NONE;
    if (fmt_s) {
        fmt = fm_qformat_from_name(fmt_s);
        if (fmt != FM_QF_NVFP4 && fmt != FM_QF_MXFP4 && fmt != FM_QF_BF16) {
            fprintf(stderr, "fp4moe bench: error: --format '%s' (expected nvfp4, mxfp4 or bf16)\n", fmt_s);
            return 2;
        }
    }

    fm_model_desc d;
    fm_status st = model ? fm_model_desc_load(model, &d) : fm_preset_desc(preset, fmt, &d);
    if (st) return fm_cli_fail("bench", st);
    if (fmt == FM_QF_NONE) fmt = d.expert_format;
    if (!n_layers) n_layers = fm_cpu_bench_default_layers(&d, fmt);
    if (n_layers > MAX_LAYERS) n_layers = MAX_LAYERS;
    if (sustain_ms > 0 && fm_cli_dist_active(&dist)) {
        fprintf(stderr, "fp4moe bench: error: --sustain-ms times one GPU's graph; it does not apply with --tp / --ep\n");
        return 2;
    }
    if (fm_cli_dist_validate("bench", &dist, cuda ? FM_DEV_CUDA : FM_DEV_CPU)) return 2;
    if (fm_cli_dist_active(&dist)) {
        fm_moe_layer *L = NULL;
        fm_cpu_engine *dce = NULL;
        fm_ckpt *dck = NULL;
        int first = nth_moe_layer(&d, 0);
        if (model) { st = fm_ckpt_open(model, &dck); if (!st) st = fm_moe_layer_bind(dck, &d, first, FM_QF_NONE, &L); }
        else st = fm_moe_layer_random(&d, fmt, (uint64_t)seed, first, &L);
        if (!st && !cuda) st = fm_cpu_engine_new(isa, threads, &dce);
        if (!st) st = fm_cli_dist_bench(&dist, cuda ? FM_DEV_CUDA : FM_DEV_CPU, dce, &d, L, batches, n_batch, 5, (uint64_t)seed, stdout);
        fm_moe_layer_free(L);
        fm_cpu_engine_free(dce);
        fm_ckpt_close(dck);
        return st ? fm_cli_fail("bench", st) : 0;
    }
    char source[1100];
    snprintf(source, sizeof source, "%s %s", model ? "model" : "preset", model ? model : preset);
    printf("fp4moe bench: %s (%s, %s), H=%d I=%d E=%d k=%d shared=%d\n", source, d.family, fm_qformat_name(fmt),
           d.hidden, d.moe_inter, d.n_experts, d.topk, d.n_shared);

    int rc = 1;
    fm_cpu_engine *ce = NULL;
    fm_cuda_engine *ge = NULL;
    fm_moe_layer *hl[MAX_LAYERS] = {0};
    fm_cuda_layer *gl[MAX_LAYERS] = {0};
    fm_ckpt *ck = NULL;
    row rows[MAX_BATCH];
    double bw = 0;
    char bw_what[128];

    if (cuda) {
        if ((st = fm_cuda_engine_new(0, &ge))) { rc = fm_cli_fail("bench", st); goto done; }
        printf("device: %s\n", fm_cuda_engine_describe(ge));
        fm_cuda_engine_set_sustain(ge, (double)sustain_ms);
        if (sustain_ms > 0)
            printf("timing: median of 50 graph replays per batch size, after %ld ms of sustained replays\n", sustain_ms);
        else
            printf("timing: median of 50 graph replays per batch size, after 3 warm-up replays (a burst; "
                   "--sustain-ms times at sustained clocks)\n");
    } else {
        if ((st = fm_cpu_engine_new(isa, threads, &ce))) { rc = fm_cli_fail("bench", st); goto done; }
    }

    /* Bandwidth first, while memory is not yet filled with layers. */
    if (isatty(2)) fprintf(stderr, "fp4moe bench: measuring memory bandwidth...");
    g_prog_shown = 1;
    if (bw_mib == 0) bw_mib = cuda ? 4096 : 1024;
    if (cuda) {
        bw = fm_cuda_measure_bandwidth(ge, (size_t)bw_mib << 20);
        snprintf(bw_what, sizeof bw_what, "streaming read of %ld MiB of device memory", bw_mib);
    } else {
        bw = fm_cpu_measure_bandwidth((size_t)bw_mib << 20, threads);
        if (threads > 0) snprintf(bw_what, sizeof bw_what, "streaming read of %ld MiB, %d threads", bw_mib, threads);
        else snprintf(bw_what, sizeof bw_what, "streaming read of %ld MiB, all CPU threads", bw_mib);
    }
    progress_done();
    if (bw <= 0) { rc = fm_cli_fail("bench", fm_error(FM_E_RANGE, "bandwidth probe failed: %s", fm_last_error())); goto done; }
    printf("memory bandwidth: %.2f GB/s (%s)\n", bw * 1e-9, bw_what);

    /* Layers: seeded random (preset) or the MoE layers present (model). */
    int have = 0;
    progress_begin();
    if (model && (st = fm_ckpt_open(model, &ck))) { rc = fm_cli_fail("bench", st); goto done; }
    for (int li = 0, layer = 0; have < n_layers; li++) {
        char what[64];
        snprintf(what, sizeof what, "building layer %d/%d", have + 1, n_layers);
        progress("fp4moe bench", what, (double)have / n_layers);
        if (model) {
            while (layer < d.n_layers && !fm_model_is_moe_layer(&d, layer)) layer++;
            if (layer >= d.n_layers) break;
            st = fm_moe_layer_bind(ck, &d, layer, FM_QF_NONE, &hl[have]);
            if (st == FM_E_NOTFOUND && have > 0) { st = FM_OK; layer++; continue; } /* layer not in this checkpoint */
            if (!st && cuda) st = fm_cuda_layer_upload(ge, &d, hl[have], &gl[have]);
            layer++;
        } else {
            int layer_i = nth_moe_layer(&d, li);
            st = cuda ? fm_cuda_layer_random(ge, &d, fmt, (uint64_t)seed, layer_i, &gl[have])
                      : fm_moe_layer_random(&d, fmt, (uint64_t)seed, layer_i, &hl[have]);
        }
        if (st) { progress_done(); rc = fm_cli_fail("bench", st); goto done; }
        have++;
    }
    progress_done();
    if (have == 0) { rc = fm_cli_fail("bench", fm_error(FM_E_NOTFOUND, "%s holds no MoE layer", model)); goto done; }
    if (have < n_layers) printf("note: only %d MoE layer%s in %s; caches may flatter the figures\n", have,
                                have == 1 ? "" : "s", model);
    n_layers = have;
    printf("layers cycled: %d\n", n_layers);
    if (ce) printf("kernel: %s\n", fm_cpu_engine_describe(ce));
    /* Provenance first: which kernel and config each batch will use, and
     * from which tuned file -- or a loud WARNING when none matches. */
    memset(rows, 0, sizeof(row) * (size_t)n_batch);
    for (int b = 0; b < n_batch; b++) {
        if (cuda) {
            fm_tune_key key;
            fm_tune_choice ch;
            st = fm_cuda_engine_key(ge, &d, fmt, &key);
            if (!st) st = fm_tune_choose(&key, batches[b], &ch);
            if (st) { rc = fm_cli_fail("bench", st); goto done; }
            fm_tune_provenance_line(&key, batches[b], &ch, rows[b].decision, sizeof rows[b].decision);
        } else {
            snprintf(rows[b].decision, sizeof rows[b].decision,
                     "provenance: backend=cpu batch=%d kernel=%s (ISA chosen at run time; the CPU path has no tuned configs)",
                     batches[b], fm_cpu_engine_describe(ce));
        }
        printf("%s\n", rows[b].decision);
    }

    printf("\n%6s %11s %21s %11s %8s %10s %8s %7s\n", "batch", "us/layer", "(min .. max)", "tokens/s", "active",
           "MB/layer", "GB/s", "%bw");
    for (int b = 0; b < n_batch; b++) {
        row *r = &rows[b];
        char decision[sizeof r->decision];
        memcpy(decision, r->decision, sizeof decision);
        memset(r, 0, sizeof *r);
        char label[64];
        snprintf(label, sizeof label, "fp4moe bench: batch %d", batches[b]);
        if (cuda) {
            fm_cuda_bench_result cr;
            progress_begin();
            progress(label, "timing", 0.0);
            st = fm_cuda_bench(ge, &d, gl, n_layers, batches[b], (uint64_t)seed, 50, &cr);
            progress_done();
            if (st) { rc = fm_cli_fail("bench", st); goto done; }
            *r = (row){batches[b], cr.us_per_layer, cr.us_min, cr.us_max, batches[b] / (cr.us_per_layer * 1e-6),
                       cr.active_experts, (double)cr.bytes_per_layer / (cr.us_per_layer * 1e-6) * 1e-9,
                       cr.bytes_per_layer, "", "", ""};
            snprintf(r->kernel, sizeof r->kernel, "%s", cr.kernel);
            snprintf(r->provenance, sizeof r->provenance,
                     "kernel %s, path %s, rows_per_block %d, k_split %d, warps %d, stages %d, tile_n %d, "
                     "switch_tpe %.2f; config from %s",
                     cr.kernel, fm_kernel_path_name(cr.cfg.path), cr.cfg.rows_per_block, cr.cfg.k_split, cr.cfg.warps,
                     cr.cfg.stages, cr.cfg.tile_n, (double)cr.cfg.switch_tpe, cr.config_source);
        } else {
            fm_cpu_bench_result cr;
            progress_begin();
            st = fm_cpu_bench(ce, &d, hl, n_layers, batches[b], (uint64_t)seed, time_ms * 1e-3, progress, label, &cr);
            progress_done();
            if (st) { rc = fm_cli_fail("bench", st); goto done; }
            *r = (row){batches[b], cr.us_per_layer, cr.us_min, cr.us_max, cr.tokens_per_s, cr.active_experts, cr.gbps,
                       cr.bytes_per_layer, "", "", ""};
            snprintf(r->kernel, sizeof r->kernel, "%s", cr.kernel);
        }
        memcpy(r->decision, decision, sizeof decision);
        char mm[32];
        snprintf(mm, sizeof mm, "(%.1f .. %.1f)", r->us_min, r->us_max);
        printf("%6d %11.1f %21s %11.0f %8.1f %10.2f %8.2f %6.1f%%\n", r->T, r->us, mm, r->tps, r->active,
               (double)r->bytes / 1e6, r->gbps, 100.0 * r->gbps * 1e9 / bw);
        if (r->provenance[0]) printf("       %s\n", r->provenance);
        fflush(stdout);
    }
    rc = 0;
    if (json) {
        rc = write_json(json, source, &d, fmt, n_layers, bw, bw_what, sustain_ms, rows, n_batch);
        if (!rc) printf("\nwrote %s\n", json);
    }
done:
    for (int i = 0; i < MAX_LAYERS; i++) {
        if (gl[i]) fm_cuda_layer_free(gl[i]);
        fm_moe_layer_free(hl[i]);
    }
    fm_ckpt_close(ck);
    fm_cpu_engine_free(ce);
    if (ge) fm_cuda_engine_free(ge);
    return rc;
}
