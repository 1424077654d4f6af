/* fp4moe profile: parsing and printing; the work is fm_profile_run. */
#include "cli.h"
#include "dist_opts.h"

#include <errno.h>
#include <libgen.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *k_cmd = "profile";

static void help(FILE *f) {
    fprintf(f,
            "usage: fp4moe profile (--model DIR | --preset NAME) [--batch 32,80] [--device cpu|cuda]\n"
            "                      [--trace FILE] [--report FILE.html] [--json FILE] [options]\n\n"
            "Where a decode step's time goes: time per phase (routing, sort, gate/up, activation, down,\n"
            "combine, shared, other) at each batch size, the delta between batch sizes with each phase's\n"
            "share of the marginal cost, telemetry (NVML on a GPU, host CPU from /proc/stat), and a\n"
            "performance model: active experts, bytes that must be read, the floor at the measured\n"
            "bandwidth, %% of it, tile-row fill, and a verdict per batch size. A step runs every MoE\n"
            "layer of the model once.\n\n"
            "options:\n"
            "  --model DIR          checkpoint directory (config.json + safetensors)\n"
            "  --preset NAME        built-in model shape with seeded random weights\n"
            "  --batch LIST         batch sizes, comma-separated (default 32,80; at most %d)\n"
            "  --device cpu|cuda    engine (default cpu)\n"
            "  --format F           nvfp4 | mxfp4 | bf16 (presets; BF16 checkpoints are quantized to F)\n"
            "  --shard tp:R[/r]     one TP rank's share: the I/R slices of every expert (and of the\n"
            "                       shared expert), the full router; bytes and floor are the rank's\n"
            "  --shard ep:R/r       one EP rank's share: experts r*E/R..(r+1)*E/R-1 on the pairs the\n"
            "                       full routing (on the host) sends them, pre-routed, then the shared\n"
            "                       expert on the rank's token chunk; bytes and floor are the rank's,\n"
            "                       with every rank's load and the most loaded rank per batch size\n"
            "  --steps N            measured steps per batch size (default 3)\n"
            "  --warmup N           warm-up steps per batch size (default 1)\n"
            "  --layers N           distinct layers held in memory and cycled (default 2)\n"
            "  --step-layers N      MoE layers per step (default: all of the model's)\n"
            "  --threads N          CPU engine threads (default: all cores)\n"
            "  --seed S             weights and activations seed (default 1)\n"
            "  --tile-n N           model a tiled kernel with N-token tiles (GPU default: the kernel config)\n"
            "  --bandwidth GBPS     use this memory bandwidth instead of measuring it\n"
            "  --bw-mib N           bandwidth probe buffer in MiB (default 256 CPU, 4096 GPU)\n"
            "  --peak-gflops X      compute roof for the roofline (default: measured on the CPU,\n"
            "                       datasheet table on the GPU)\n"
            "  --period-ms N        telemetry sampling period (default 20)\n"
            "  --read-power-s S     GPU: keep the bandwidth probe's read up for S seconds while NVML\n"
            "                       samples, the power baseline the verdict compares with (default 2.5;\n"
            "                       0: skip; at least 1.5 otherwise, as NVML's power is a 1 s average)\n"
            "  --cuda-device N      GPU index (default 0)\n"
            "  --json FILE          everything as JSON\n"
            "  --trace FILE         Chrome trace JSON (Perfetto, chrome://tracing)\n"
            "  --report FILE.html   self-contained HTML report (roofline, bars, deltas, telemetry)\n"
            "  --quiet              no progress lines on stderr\n",
            FM_PROF_MAX_BATCH);
}

static int parse_double(const char *opt, const char *s, double lo, double hi, double *out) {
    char *end = NULL;
    errno = 0;
    double v = s ? strtod(s, &end) : 0;
    if (!s || !*s || *end || errno || !isfinite(v) || v < lo || v > hi) {
        fprintf(stderr, "fp4moe %s: error: %s expects a number in [%g, %g], got '%s'\n", k_cmd, opt, lo, hi,
                s ? s : "");
        return -1;
    }
    *out = v;
    return 0;
}

/* Fails early, before a long run, when an output file could not be
 * written (the file itself is still written atomically at the end). */
static int check_out_path(const char *opt, const char *path) {
    if (!path) return 0;
    if (!*path) {
        fprintf(stderr, "fp4moe %s: error: %s needs a file name\n", k_cmd, opt);
        return -1;
    }
    char *copy = strdup(path);
    if (!copy) return -1;
    const char *dir = dirname(copy);
    int ok = access(dir, W_OK | X_OK) == 0;
    if (!ok)
        fprintf(stderr, "fp4moe %s: error: %s %s: directory '%s' is not writable: %s\n", k_cmd, opt, path, dir,
                strerror(errno));
    free(copy);
    return ok ? 0 : -1;
}

int fm_cmd_profile(int argc, char **argv) {
    fm_prof_opts o;
    fm_prof_opts_default(&o);
    const char *json = NULL, *trace = NULL, *report = NULL, *batch = "32,80";
    int quiet = 0;
    fm_shard shard = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            help(stdout);
            return 0;
        }
        if (!strcmp(a, "--quiet")) {
            quiet = 1;
            continue;
        }
        int sr = fm_cli_shard_parse(k_cmd, argc, argv, &i, &shard);
        if (sr < 0) return 2;
        if (sr) continue;
        if (strncmp(a, "--", 2) != 0) {
            fprintf(stderr, "fp4moe %s: error: unexpected argument '%s' (see --help)\n", k_cmd, a);
            return 2;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "fp4moe %s: error: %s needs a value\n", k_cmd, a);
            return 2;
        }
        const char *v = argv[++i];
        long n = 0;
        double d = 0;
        if (!strcmp(a, "--model")) o.model_dir = v;
        else if (!strcmp(a, "--preset")) o.preset = v;
        else if (!strcmp(a, "--batch")) batch = v;
        else if (!strcmp(a, "--json")) json = v;
        else if (!strcmp(a, "--trace")) trace = v;
        else if (!strcmp(a, "--report")) report = v;
        else if (!strcmp(a, "--device")) {
            if (!strcmp(v, "cpu")) o.device = FM_DEV_CPU;
            else if (!strcmp(v, "cuda")) o.device = FM_DEV_CUDA;
            else {
                fprintf(stderr, "fp4moe %s: error: --device expects cpu or cuda, got '%s'\n", k_cmd, v);
                return 2;
            }
        } else if (!strcmp(a, "--format")) {
            o.fmt = fm_qformat_from_name(v);
            if (o.fmt != FM_QF_NVFP4 && o.fmt != FM_QF_MXFP4 && o.fmt != FM_QF_BF16) {
                fprintf(stderr, "fp4moe %s: error: --format expects nvfp4, mxfp4 or bf16, got '%s'\n", k_cmd, v);
                return 2;
            }
        } else if (!strcmp(a, "--steps")) {
            if (fm_cli_parse_int(k_cmd, a, v, 1, 100000, &n)) return 2;
            o.steps = (int)n;
        } else if (!strcmp(a, "--warmup")) {
            if (fm_cli_parse_int(k_cmd, a, v, 0, 1000, &n)) return 2;
            o.warmup = (int)n;
        } else if (!strcmp(a, "--layers")) {
            if (fm_cli_parse_int(k_cmd, a, v, 1, 1024, &n)) return 2;
            o.layers = (int)n;
        } else if (!strcmp(a, "--step-layers")) {
            if (fm_cli_parse_int(k_cmd, a, v, 1, 4096, &n)) return 2;
            o.step_layers = (int)n;
        } else if (!strcmp(a, "--threads")) {
            if (fm_cli_parse_int(k_cmd, a, v, 1, 1024, &n)) return 2;
            o.threads = (int)n;
        } else if (!strcmp(a, "--seed")) {
            if (fm_cli_parse_int(k_cmd, a, v, 0, 2147483647L, &n)) return 2;
            o.seed = (uint64_t)n;
        } else if (!strcmp(a, "--tile-n")) {
            if (fm_cli_parse_int(k_cmd, a, v, 1, 4096, &n)) return 2;
            o.tile_n = (int)n;
        } else if (!strcmp(a, "--bw-mib")) {
            if (fm_cli_parse_int(k_cmd, a, v, 1, 1 << 20, &n)) return 2;
            o.bw_probe_bytes = (size_t)n << 20;
        } else if (!strcmp(a, "--period-ms")) {
            if (fm_cli_parse_int(k_cmd, a, v, 1, 60000, &n)) return 2;
            o.period_ms = (int)n;
        } else if (!strcmp(a, "--cuda-device")) {
            if (fm_cli_parse_int(k_cmd, a, v, 0, 1023, &n)) return 2;
            o.cuda_device = (int)n;
        } else if (!strcmp(a, "--bandwidth")) {
            if (parse_double(a, v, 1e-6, 1e6, &d)) return 2;
            o.bandwidth_Bps = d * 1e9;
        } else if (!strcmp(a, "--read-power-s")) {
            if (parse_double(a, v, 0, 60, &d)) return 2;
            if (d > 0 && d < FM_PROF_READ_SETTLE_S + 0.5) {
                fprintf(stderr, "fp4moe %s: error: --read-power-s is 0 or at least %.1f (NVML's power reading is a "
                                "one-second average), got '%s'\n",
                        k_cmd, FM_PROF_READ_SETTLE_S + 0.5, v);
                return 2;
            }
            o.read_power_s = d;
        } else if (!strcmp(a, "--peak-gflops")) {
            if (parse_double(a, v, 1e-6, 1e9, &d)) return 2;
            o.peak_flops = d * 1e9;
        } else {
            fprintf(stderr, "fp4moe %s: error: unknown option '%s' (see --help)\n", k_cmd, a);
            return 2;
        }
    }
    if (!o.model_dir == !o.preset) {
        fprintf(stderr, "fp4moe %s: error: give exactly one of --model DIR or --preset NAME\n", k_cmd);
        return 2;
    }
    if (fm_cli_shard_check(k_cmd, &shard, o.preset, o.model_dir, o.fmt)) return 2;
    o.shard = shard.mode ? &shard : NULL;
    o.n_batch = fm_cli_parse_int_list(k_cmd, batch, o.batches, FM_PROF_MAX_BATCH);
    if (o.n_batch < 0) return 2;
    if (check_out_path("--json", json) || check_out_path("--trace", trace) || check_out_path("--report", report))
        return 2;
    o.progress = quiet ? NULL : stderr;

    fm_profile *p = NULL;
    fm_status st = fm_profile_run(&o, &p);
    if (st != FM_OK) return fm_cli_fail(k_cmd, st);
    fm_profile_print(p, stdout);
    st = fm_profile_write(p, json, trace, report);
    fm_profile_free(p);
    if (st != FM_OK) return fm_cli_fail(k_cmd, st);
    return 0;
}
