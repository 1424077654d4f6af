/* fp4moe tune: sweep kernel configs on this GPU and write config files. */
#include "cli.h"
#include "dist_opts.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_BATCHES 64

static void tune_usage(FILE *f) {
    fprintf(f,
            "usage: fp4moe tune (--model DIR | --preset NAME | --all-presets) [--batch LIST]\n"
            "                   [--format LIST] [--out DIR] [--budget-s S] [--layers N] [--seed S]\n"
            "                   [--shard tp:R[/r] | ep:R/r]\n"
            "       fp4moe tune --summary DIR\n\n"
            "For each batch bucket (default 1,2,4,8,16,32,64,128,256,512), times the built-in\n"
            "default and candidate kernel configs on this GPU under CUDA-graph replay, checks a\n"
            "would-be winner's output against the float64 reference, and keeps the default\n"
            "unless a candidate is measurably faster (its median below the default's fastest\n"
            "replay, its slowest replay below the default's median, twice). Writes one JSON file\n"
            "per GPU and shape into --out (default: the user cache), atomically, merging with\n"
            "buckets already there. Ship files by writing them into the repo's configs/:\n"
            "  fp4moe tune --all-presets --out configs/ --budget-s 30\n\n"
            "--format LIST   nvfp4, mxfp4 (comma-separated; default: each model's own format)\n"
            "--budget-s S    sweep time per model and format (default 30)\n"
            "--layers N      distinct layers in the timed graph (default: enough to defeat L2)\n"
            "--tolerance X   max relative error of a candidate vs the reference (default 5e-3)\n"
            "--all-presets   every preset except the tiny test ones\n"
            "--shard S       tune one rank's shape (tp:R[/r]: I/R; ep:R/r: E/R experts, the\n"
            "                model's k): the file is keyed by it, and bench / profile with the\n"
            "                same --shard find it (docs/tuning.md)\n"
            "--summary DIR   print a Markdown table of the config files in DIR (gain over the\n"
            "                defaults per bucket; for docs/perf.md); needs no GPU\n");
}

static void log_line(void *ctx, const char *line) {
    fprintf(stderr, "fp4moe tune: %s: %s\n", (const char *)ctx, line);
}

static int parse_formats(const char *s, fm_qformat *out, int max) {
    int n = 0;
    char buf[128];
    if (strlen(s) >= sizeof buf) return -1;
    strcpy(buf, s);
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        fm_qformat f = fm_qformat_from_name(t);
        if ((f != FM_QF_NVFP4 && f != FM_QF_MXFP4 && f != FM_QF_BF16) || n == max) return -1;
        out[n++] = f;
    }
    return n ? n : -1;
}

static int tune_one(const fm_model_desc *d, const char *label, fm_qformat fmt, const int *batches, int nb,
                    const char *out_dir, double budget, double tol, int layers, uint64_t seed) {
    uint64_t t0 = fm_now_ns();
    char tag[1500]; /* the model's label (a path, up to 1200, and a shard) and the format */
    snprintf(tag, sizeof tag, "%s %s", label, fm_qformat_name(fmt));
    fprintf(stderr, "fp4moe tune: %s: preparing %s layers of random weights and the reference...\n", tag,
            layers > 0 ? "the" : "enough");
    fm_tune_cuda *t = NULL;
    fm_status s = fm_tune_cuda_new(d, fmt, layers, seed, &t);
    if (s) return fm_cli_fail("tune", s);
    const fm_tune_key *key = fm_tune_cuda_key(t);
    char kd[320];
    fm_tune_key_describe(key, kd, sizeof kd);
    printf("tune %s: %s\n  key: %s (CUDA %d, driver %d)\n", tag, fm_tune_cuda_describe(t), kd, key->cuda_version,
           key->driver_version);
    fflush(stdout);
    fm_tune_backend be = fm_tune_cuda_backend(t);
    fm_tune_opts o = {.budget_s = budget, .tolerance = tol, .min_gain = 0.01, .log = log_line, .log_ctx = tag};
    fm_tune_bucket_result res[MAX_BATCHES];
    char path[4096] = "";
    s = fm_tune_sweep(key, &be, batches, nb, &o, out_dir, path, sizeof path, res);
    fm_tune_cuda_free(t);
    if (s) return fm_cli_fail("tune", s);
    printf("  %6s  %12s  %12s  %7s  %s\n", "batch", "default us", "chosen us", "gain", "chosen parameters");
    for (int i = 0; i < nb; i++) {
        char cs[256];
        fm_kernel_config_format(&res[i].cfg, cs, sizeof cs);
        printf("  %6d  %12.2f  %12.2f  %6.1f%%  %s%s\n", res[i].batch, res[i].default_us, res[i].us,
               res[i].replaced_default ? 100.0 * (res[i].default_us - res[i].us) / res[i].default_us : 0.0, cs,
               res[i].replaced_default ? "" : " (default kept)");
    }
    printf("  wrote %s (%.0f s)\n", path, (double)(fm_now_ns() - t0) * 1e-9);
    fflush(stdout);
    return 0;
}

int fm_cmd_tune(int argc, char **argv) {
    const char *model = NULL, *preset = NULL, *out = NULL, *fmt_s = NULL, *summary = NULL;
    const char *batch_s = "1,2,4,8,16,32,64,128,256,512";
    int all = 0, layers = 0;
    double budget = 30, tol = 5e-3;
    uint64_t seed = 1;
    fm_shard shard = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        long n;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { tune_usage(stdout); return 0; }
        if (!strcmp(a, "--all-presets")) { all = 1; continue; }
        int sr = fm_cli_shard_parse("tune", argc, argv, &i, &shard);
        if (sr < 0) return 2;
        if (sr) continue;
        if (!v) { fprintf(stderr, "fp4moe tune: error: %s needs a value\n", a); return 2; }
        if (!strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--preset")) preset = v;
        else if (!strcmp(a, "--out")) out = v;
        else if (!strcmp(a, "--format")) fmt_s = v;
        else if (!strcmp(a, "--batch")) batch_s = v;
        else if (!strcmp(a, "--summary")) summary = v;
        else if (!strcmp(a, "--tolerance")) {
            char *end = NULL;
            tol = strtod(v, &end);
            if (!*v || *end || !(tol > 0 && tol < 1)) {
                fprintf(stderr, "fp4moe tune: error: --tolerance expects a number in (0, 1), got '%s'\n", v);
                return 2;
            }
        }
        else if (!strcmp(a, "--budget-s")) {
            if (fm_cli_parse_int("tune", a, v, 0, 86400, &n)) return 2;
            budget = (double)n;
        } else if (!strcmp(a, "--layers")) {
            if (fm_cli_parse_int("tune", a, v, 1, 256, &n)) return 2;
            layers = (int)n;
        } else if (!strcmp(a, "--seed")) {
            if (fm_cli_parse_int("tune", a, v, 0, 0x7FFFFFFFFFFFFFFFL, &n)) return 2;
            seed = (uint64_t)n;
        } else {
            fprintf(stderr, "fp4moe tune: error: unknown option '%s'\n\n", a);
            tune_usage(stderr);
            return 2;
        }
        i++;
    }
    if (summary) {
        if (model || preset || all) {
            fprintf(stderr, "fp4moe tune: error: --summary does not tune; give it alone\n");
            return 2;
        }
        char *md = NULL;
        fm_status s = fm_tune_summarize(summary, &md);
        if (s) return fm_cli_fail("tune", s);
        fputs(md, stdout);
        free(md);
        return fflush(stdout) == 0 ? 0 : 1;
    }
    if ((!!model + !!preset + all) != 1) {
        fprintf(stderr, "fp4moe tune: error: give exactly one of --model DIR, --preset NAME or --all-presets\n\n");
        tune_usage(stderr);
        return 2;
    }
    if (shard.mode && all) {
        fprintf(stderr, "fp4moe tune: error: --shard tunes one model's rank: give --model DIR or --preset NAME, "
                        "not --all-presets\n");
        return 2;
    }
    fm_qformat fmt0 = FM_QF_NONE;
    if (shard.mode && fmt_s && parse_formats(fmt_s, &fmt0, 1) < 0) fmt0 = FM_QF_NONE;
    if (fm_cli_shard_check("tune", &shard, preset, model, fmt0)) return 2;
    int batches[MAX_BATCHES];
    int nb = fm_cli_parse_int_list("tune", batch_s, batches, MAX_BATCHES);
    if (nb < 0) return 2;
    fm_qformat fmts[4];
    int nf = 0;
    if (fmt_s && (nf = parse_formats(fmt_s, fmts, 4)) < 0) {
        fprintf(stderr, "fp4moe tune: error: --format '%s' (expected a list of nvfp4, mxfp4, bf16)\n", fmt_s);
        return 2;
    }
    char outbuf[1024];
    if (!out) {
        fm_status s = fm_tune_user_cache_dir(outbuf, sizeof outbuf);
        if (s) return fm_cli_fail("tune", s);
        out = outbuf;
    }
    /* Fail before any preparation when there is nothing to tune on. */
    char why[256] = "";
    if (!fm_cuda_available(why, sizeof why))
        return fm_cli_fail("tune", fm_error(FM_E_UNSUPPORTED, "no CUDA GPU: %s; tuning measures kernels on the GPU it "
                                                              "tunes for (use `fp4moe explain --gpu NAME` to plan without one)", why));

    int rc = 0;
    size_t np = all ? fm_preset_count() : 1;
    for (size_t pi = 0; pi < np; pi++) {
        const char *name = all ? fm_preset_name(pi) : preset;
        if (all && !strncmp(name, "tiny-", 5)) continue;
        fm_model_desc d;
        fm_status s = model ? fm_model_desc_load(model, &d) : fm_preset_desc(name, FM_QF_NONE, &d);
        if (s) { rc = fm_cli_fail("tune", s); continue; }
        char label[1200];
        snprintf(label, sizeof label, "%s", model ? model : name);
        fm_qformat own = d.expert_format != FM_QF_NONE ? d.expert_format : FM_QF_NVFP4;
        int n = nf ? nf : 1;
        for (int fi = 0; fi < n; fi++) {
            fm_qformat f = nf ? fmts[fi] : own;
            if (!model && f != d.expert_format && (s = fm_preset_desc(name, f, &d))) { rc = fm_cli_fail("tune", s); continue; }
            fm_model_desc ds = d;
            char sl[1400];
            if (shard.mode) { /* the rank's shape: its config file is keyed by it */
                if ((s = fm_shard_desc(&d, f, &shard, &ds))) { rc = fm_cli_fail("tune", s); continue; }
                char sd[192];
                fm_shard_describe(&shard, &d, sd, sizeof sd);
                snprintf(sl, sizeof sl, "%s, shard %s", label, sd);
            }
            if (tune_one(&ds, shard.mode ? sl : label, f, batches, nb, out, budget, tol, layers, seed)) rc = 1;
        }
    }
    return rc;
}
