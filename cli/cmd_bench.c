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

static void bench_usage(FILE *f) {
    fprintf(f,
            "usage: fp4moe bench [--model DIR | --preset NAME] [--format nvfp4|mxfp4|bf16]\n"
            "                    [--batch 1,4,16,64,256] [--layers N] [--device cpu|cuda] [--json FILE]\n"
            "                    [--threads N] [--isa auto|scalar|avx2|avx512] [--time-ms MS] [--seed S]\n"
            "                    [--bw-mib MIB] [--sustain-ms MS] [--act f32|bf16|f16]\n"
            "                    [--shard tp:R[/r] | ep:R/r]\n\n"
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
            "server's case; on an H200 1000 ms is enough, docs/perf.md).\n"
            "--act feeds the GPU benchmark activations of that type (default f32); an engine passes\n"
            "bf16, for which the router logits take one cuBLAS GEMM where the tiled shape runs and\n"
            "cuBLAS loads, else one BF16 term instead of three (one GPU's layer or a TP shard).\n\npresets:");
    for (size_t i = 0; i < fm_preset_count(); i++) fprintf(f, " %s", fm_preset_name(i));
    fprintf(f, "\n");
}

/* Progress on stderr: on a terminal one line rewritten in place; in a log
 * a line once an operation has run for a second, then every 5 s. */
typedef struct {
    uint64_t start, last;
    int shown, busy;
} progress_state;

static void progress(void *ctx, const char *what, double frac) {
    progress_state *p = ctx;
    uint64_t now = fm_now_ns();
    int tty = isatty(2);
    if (!p->busy) {
        p->busy = 1;
        p->start = now;
        p->last = 0;
    }
    if (frac >= 1.0) { /* the operation's end */
        if (p->shown && tty) fprintf(stderr, "\r\033[K");
        p->shown = p->busy = 0;
        return;
    }
    if (!tty && (now - p->start < 1000000000ull || now - p->last < 5000000000ull)) return;
    p->last = now;
    p->shown = 1;
    if (tty) fprintf(stderr, "\r\033[Kfp4moe bench: %s %3.0f%%", what, frac * 100.0);
    else fprintf(stderr, "fp4moe bench: %s %.0f%%\n", what, frac * 100.0);
    fflush(stderr);
}

static int write_json(const char *path, const fm_bench_report *r) {
    const fm_model_desc *d = &r->desc;
    json_t *root = json_object(), *arr = json_array();
    json_object_set_new(root, "version", json_string(FM_VERSION));
    json_object_set_new(root, "source", json_string(r->source));
    json_object_set_new(root, "family", json_string(d->family));
    json_object_set_new(root, "format", json_string(fm_qformat_name(r->fmt)));
    json_object_set_new(root, "hidden", json_integer(d->hidden));
    json_object_set_new(root, "moe_inter", json_integer(d->moe_inter));
    json_object_set_new(root, "n_experts", json_integer(d->n_experts));
    json_object_set_new(root, "topk", json_integer(d->topk));
    json_object_set_new(root, "n_shared", json_integer(d->n_shared));
    json_object_set_new(root, "layers_cycled", json_integer(r->layers));
    if (r->shard.mode) {
        json_t *sj = json_object();
        json_object_set_new(sj, "mode", json_string(fm_dist_mode_name(r->shard.mode)));
        json_object_set_new(sj, "ranks", json_integer(r->shard.ranks));
        json_object_set_new(sj, "rank", json_integer(r->shard.rank));
        json_object_set_new(sj, "describe", json_string(r->shard_desc));
        json_object_set_new(sj, "full_moe_inter", json_integer(r->full_desc.moe_inter));
        json_object_set_new(sj, "full_n_experts", json_integer(r->full_desc.n_experts));
        json_object_set_new(root, "shard", sj);
    }
    json_object_set_new(root, "bandwidth_gbps", json_real(r->bandwidth_Bps * 1e-9));
    json_object_set_new(root, "bandwidth_probe", json_string(r->bandwidth_probe));
    json_object_set_new(root, "sustain_ms", json_integer((json_int_t)r->sustain_ms));
    if (r->device == FM_DEV_CUDA) json_object_set_new(root, "activations", json_string(fm_dtype_name(r->act)));
    for (int i = 0; i < r->n_rows; i++) {
        const fm_bench_row *w = &r->rows[i];
        json_t *j = json_object();
        json_object_set_new(j, "batch", json_integer(w->T));
        json_object_set_new(j, "us_per_layer", json_real(w->us_per_layer));
        json_object_set_new(j, "us_min", json_real(w->us_min));
        json_object_set_new(j, "us_max", json_real(w->us_max));
        json_object_set_new(j, "tokens_per_s", json_real(w->tokens_per_s));
        json_object_set_new(j, "active_experts", json_real(w->active_experts));
        json_object_set_new(j, "bytes_per_layer", json_integer(w->bytes_per_layer));
        json_object_set_new(j, "gbps", json_real(w->gbps));
        json_object_set_new(j, "pct_bandwidth", json_real(w->pct_bandwidth));
        json_object_set_new(j, "kernel", json_string(w->kernel));
        if (w->provenance[0]) json_object_set_new(j, "provenance", json_string(w->provenance));
        if (w->decision[0]) json_object_set_new(j, "decision", json_string(w->decision));
        if (r->shard.mode)
            json_object_set_new(j, "shard_floor_us", json_real((double)w->bytes_per_layer / r->bandwidth_Bps * 1e6));
        if (r->shard.mode == FM_DIST_EP) {
            const fm_shard_load *ld = &r->shard_load[i];
            const double n = r->layers;
            json_t *lj = json_object(), *pa = json_array(), *ac = json_array(), *by = json_array();
            for (int p = 0; p < ld->ranks; p++) {
                json_array_append_new(pa, json_real(ld->pairs[p] / n));
                json_array_append_new(ac, json_real(ld->active[p] / n));
                json_array_append_new(by, json_real(ld->bytes[p] / n));
            }
            json_object_set_new(lj, "pairs", pa);
            json_object_set_new(lj, "active", ac);
            json_object_set_new(lj, "bytes", by);
            json_object_set_new(lj, "max_rank", json_integer(ld->max_rank));
            json_object_set_new(lj, "max_rank_floor_us", json_real(ld->bytes[ld->max_rank] / n / r->bandwidth_Bps * 1e6));
            if (r->shard_max_us[i] >= 0) json_object_set_new(lj, "max_rank_us", json_real(r->shard_max_us[i]));
            json_object_set_new(j, "shard_load", lj);
        }
        json_array_append_new(arr, j);
    }
    json_object_set_new(root, "results", arr);
    char *s = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(6));
    json_decref(root);
    if (!s) return fm_cli_fail("bench", fm_error(FM_E_NOMEM, "cannot encode the JSON report"));
    fm_status st = fm_write_file_atomic(path, s, strlen(s));
    free(s);
    return st ? fm_cli_fail("bench", st) : 0;
}

/* The sharded layer: per batch size, per-rank and total time,
 * communication and scaling against the unsharded layer. */
static void print_sharded(const fm_bench_report *r, int row) {
    if (row < 0) {
        printf("dist: %s\n", r->dist_desc);
        if (r->device == FM_DEV_CPU)
            printf("dist: simulated ranks run one after another; total = slowest rank + collectives "
                   "(no overlap); communication here is memory copies, not a network\n");
        return;
    }
    const fm_dist_bench_result *d = &r->dist_rows[row];
    if (row == 0)
        printf("dist: times: %s\n%6s %12s %12s %12s %12s %8s %6s %9s  %s\n", d->method, "batch", "total_us",
               "slowest_us", "comm_us", "single_us", "speedup", "eff", "imbalance", "per-rank compute us");
    double slow = 0;
    for (int p = 0; p < d->ranks; p++)
        if (d->us_rank[p] > slow) slow = d->us_rank[p];
    printf("%6d %12.1f %12.1f %12.1f %12.1f %8.2f %5.0f%% %9.3f ", d->T, d->us_total, slow, d->us_comm, d->us_single,
           d->speedup, 100 * d->efficiency, d->load_imbalance);
    for (int p = 0; p < d->ranks; p++) printf(" %.1f", d->us_rank[p]);
    printf("\n");
}

/* ctx: the checkpoint directory, or NULL for a preset. */
static void print_row(void *ctx, const fm_bench_report *r, int row) {
    const char *model = ctx;
    if (r->dist_desc[0]) {
        print_sharded(r, row);
        return;
    }
    const fm_model_desc *d = &r->desc;
    if (row < 0) {
        printf("fp4moe bench: %s (%s, %s), H=%d I=%d E=%d k=%d shared=%d\n", r->source, d->family,
               fm_qformat_name(r->fmt), d->hidden, d->moe_inter, d->n_experts, d->topk, d->n_shared);
        if (r->shard.mode) printf("shard: %s; floor and %%bw count this rank's bytes only\n", r->shard_desc);
        if (r->device == FM_DEV_CUDA) {
            printf("device: %s\n", r->device_desc);
            if (r->act != FM_DT_F32 && r->act != FM_DT_INVALID) printf("activations: %s\n", fm_dtype_name(r->act));
            if (r->sustain_ms > 0)
                printf("timing: median of 50 graph replays per batch size, after %.0f ms of sustained replays\n",
                       r->sustain_ms);
            else
                printf("timing: median of 50 graph replays per batch size, after 3 warm-up replays (a burst; "
                       "--sustain-ms times at sustained clocks)\n");
        }
        printf("memory bandwidth: %.2f GB/s (%s)\n", r->bandwidth_Bps * 1e-9, r->bandwidth_probe);
        if (r->layers < r->layers_wanted)
            printf("note: only %d MoE layer%s in %s; caches may flatter the figures\n", r->layers,
                   r->layers == 1 ? "" : "s", model);
        printf("layers cycled: %d\n", r->layers);
        if (r->device == FM_DEV_CPU) printf("kernel: %s\n", r->device_desc);
        for (int b = 0; b < r->n_batches; b++) printf("%s\n", r->rows[b].decision);
        printf("\n%6s %11s %21s %11s %8s %10s %8s %7s\n", "batch", "us/layer", "(min .. max)", "tokens/s", "active",
               "MB/layer", "GB/s", "%bw");
        return;
    }
    const fm_bench_row *w = &r->rows[row];
    char mm[32];
    snprintf(mm, sizeof mm, "(%.1f .. %.1f)", w->us_min, w->us_max);
    printf("%6d %11.1f %21s %11.0f %8.1f %10.2f %8.2f %6.1f%%\n", w->T, w->us_per_layer, mm, w->tokens_per_s,
           w->active_experts, (double)w->bytes_per_layer / 1e6, w->gbps, w->pct_bandwidth);
    if (w->provenance[0]) printf("       %s\n", w->provenance);
    if (r->shard.mode) {
        const double bw = r->bandwidth_Bps;
        printf("       shard floor: %.1f us (this rank's %.2f MB at the measured bandwidth)\n",
               (double)w->bytes_per_layer / bw * 1e6, (double)w->bytes_per_layer / 1e6);
    }
    if (r->shard.mode == FM_DIST_EP) {
        const fm_shard_load *ld = &r->shard_load[row];
        const double n = r->layers, bw = r->bandwidth_Bps;
        const int m = ld->max_rank;
        printf("       ranks (pairs/active/MB per layer):");
        for (int p = 0; p < ld->ranks; p++)
            printf(" %d:%.1f/%.1f/%.2f", p, ld->pairs[p] / n, ld->active[p] / n, ld->bytes[p] / n / 1e6);
        printf("\n       most loaded: rank %d%s, %.1f pairs, %.1f active, %.2f MB, floor %.1f us", m,
               m == r->shard.rank ? " (this one)" : "", ld->pairs[m] / n, ld->active[m] / n, ld->bytes[m] / n / 1e6,
               ld->bytes[m] / n / bw * 1e6);
        if (r->shard_max_us[row] >= 0) printf(", timed %.1f us (the step waits for it)", r->shard_max_us[row]);
        printf("\n");
    }
    fflush(stdout);
}

int fm_cmd_bench(int argc, char **argv) {
    const char *model = NULL, *preset = NULL, *json = NULL, *fmt_s = NULL;
    int batches[FM_BENCH_MAX_BATCH] = {1, 4, 16, 64, 256}, n_batch = 5;
    int n_layers = 0, threads = 0, cuda = 0;
    long time_ms = 1000, bw_mib = 0, seed = 1, sustain_ms = -1;
    fm_dtype act = FM_DT_INVALID;
    fm_cpu_isa isa = FM_CPU_AUTO;
    fm_cli_dist dist = {0};
    fm_shard shard = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        long n;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            bench_usage(stdout);
            fputs(fm_cli_shard_usage(), stdout);
            fputs(fm_cli_dist_usage(), stdout);
            return 0;
        }
        int dr = fm_cli_dist_parse("bench", argc, argv, &i, &dist);
        if (dr < 0) return 2;
        if (dr) continue;
        if ((dr = fm_cli_shard_parse("bench", argc, argv, &i, &shard)) < 0) return 2;
        if (dr) continue;
        if (!v) { fprintf(stderr, "fp4moe bench: error: %s needs a value\n", a); return 2; }
        if (!strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--preset")) preset = v;
        else if (!strcmp(a, "--format")) fmt_s = v;
        else if (!strcmp(a, "--json")) json = v;
        else if (!strcmp(a, "--batch")) {
            if ((n_batch = fm_cli_parse_int_list("bench", v, batches, FM_BENCH_MAX_BATCH)) < 0) return 2;
        } else if (!strcmp(a, "--layers")) {
            if (fm_cli_parse_int("bench", a, v, 1, FM_BENCH_MAX_LAYERS, &n)) return 2;
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
        } else if (!strcmp(a, "--act")) {
            if (!strcmp(v, "f32")) act = FM_DT_F32;
            else if (!strcmp(v, "bf16")) act = FM_DT_BF16;
            else if (!strcmp(v, "f16")) act = FM_DT_F16;
            else { fprintf(stderr, "fp4moe bench: error: --act '%s' (expected f32, bf16 or f16)\n", v); return 2; }
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
    if (act != FM_DT_INVALID && !cuda) {
        fprintf(stderr, "fp4moe bench: error: --act applies to --device cuda (the CPU path feeds f32)\n");
        return 2;
    }
    if ((act == FM_DT_BF16 || act == FM_DT_F16) && (fm_cli_dist_active(&dist) || shard.mode == FM_DIST_EP)) {
        fprintf(stderr, "fp4moe bench: error: %s activations apply to one GPU's layer or a TP shard (--tp / --ep and "
                        "an EP shard feed F32)\n", fm_dtype_name(act));
        return 2;
    }
    if (sustain_ms > 0 && fm_cli_dist_active(&dist)) {
        fprintf(stderr, "fp4moe bench: error: --sustain-ms times one GPU's graph; it does not apply with --tp / --ep\n");
        return 2;
    }
    if (model && preset) { fprintf(stderr, "fp4moe bench: error: give --model or --preset, not both\n"); return 2; }
    if (model && fmt_s) { fprintf(stderr, "fp4moe bench: error: --format applies to --preset only\n"); return 2; }
    if (!model && !preset) preset = "qwen3-30b-a3b";
    fm_qformat fmt;
    if (fm_cli_parse_format("bench", fmt_s, &fmt)) return 2;

    if (fm_cli_dist_validate("bench", &dist, cuda ? FM_DEV_CUDA : FM_DEV_CPU)) return 2;
    if (fm_cli_shard_validate("bench", &shard, &dist)) return 2;
    if (fm_cli_shard_check("bench", &shard, preset, model, fmt)) return 2;
    fm_dist_opts dop = fm_cli_dist_lib_opts(&dist);
    progress_state ps = {0};
    fm_bench_opts o = {.model_dir = model, .preset = preset, .fmt = fmt, .device = cuda ? FM_DEV_CUDA : FM_DEV_CPU,
                       .batches = batches, .n_batches = n_batch, .layers = n_layers, .isa = isa, .threads = threads,
                       .min_seconds = time_ms * 1e-3, .bw_probe_bytes = (size_t)bw_mib << 20,
                       .sustain_ms = (double)sustain_ms, .act = act, .seed = (uint64_t)seed,
                       .dist = fm_cli_dist_active(&dist) ? &dop : NULL, .dist_mpi = dist.mpi,
                       .shard = shard.mode ? &shard : NULL,
                       .progress = progress, .progress_ctx = &ps, .on_row = print_row, .row_ctx = (void *)model};
    fm_bench_report *r = calloc(1, sizeof *r);
    if (!r) return fm_cli_fail("bench", fm_error(FM_E_NOMEM, "out of memory"));
    fm_status st = fm_bench_run(&o, r);
    int rc = st ? fm_cli_fail("bench", st) : 0;
    /* A sharded run has its table only; the JSON report is the single device's. */
    if (!rc && json && !o.dist) {
        rc = write_json(json, r);
        if (!rc) printf("\nwrote %s\n", json);
    }
    free(r);
    return rc;
}
