/* fp4moe gen: write a seeded random checkpoint for a preset. */
#include "cli.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void gen_usage(FILE *f) {
    fprintf(f,
            "usage: fp4moe gen --preset NAME --out DIR [--layers N] [--format nvfp4|mxfp4|bf16]\n"
            "                  [--seed S] [--shard-size BYTES] [--quiet]\n\n"
            "Writes config.json (the family's real keys), hf_quant_config.json (ModelOpt\n"
            "layouts), model-0000i-of-0000N.safetensors shards and model.safetensors.index.json\n"
            "with seeded random expert weights: the same values as the in-memory random layer.\n"
            "--layers N writes the first N MoE layers (default 1); config.json keeps the real\n"
            "layer count and `fp4moe inspect` lists the layers present. DIR must not exist.\n"
            "--shard-size accepts a K/M/G suffix (default 2G).\n\npresets:");
    for (size_t i = 0; i < fm_preset_count(); i++) fprintf(f, " %s", fm_preset_name(i));
    fprintf(f, "\n");
}

static int parse_size(const char *s, unsigned long long *out) {
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s) return -1;
    unsigned long long mul = 1;
    if (*end == 'K' || *end == 'k') mul = 1000ull, end++;
    else if (*end == 'M' || *end == 'm') mul = 1000000ull, end++;
    else if (*end == 'G' || *end == 'g') mul = 1000000000ull, end++;
    if (*end || v == 0 || v > (1ull << 50) / mul) return -1;
    *out = v * mul;
    return 0;
}

int fm_cmd_gen(int argc, char **argv) {
    const char *preset = NULL, *out = NULL, *fmt_s = NULL;
    fm_gen_opts o = {1, 0, 0, 1};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        long n;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { gen_usage(stdout); return 0; }
        if (!strcmp(a, "--quiet")) { o.progress = 0; continue; }
        if (!v) { fprintf(stderr, "fp4moe gen: error: %s needs a value\n", a); return 2; }
        if (!strcmp(a, "--preset")) preset = v;
        else if (!strcmp(a, "--out")) out = v;
        else if (!strcmp(a, "--format")) fmt_s = v;
        else if (!strcmp(a, "--layers")) {
            if (fm_cli_parse_int("gen", a, v, 1, 100000, &n)) return 2;
            o.n_moe_layers = (int)n;
        } else if (!strcmp(a, "--seed")) {
            if (fm_cli_parse_int("gen", a, v, 0, 0x7FFFFFFFFFFFFFFFL, &n)) return 2;
            o.seed = (uint64_t)n;
        } else if (!strcmp(a, "--shard-size")) {
            unsigned long long b;
            if (parse_size(v, &b)) { fprintf(stderr, "fp4moe gen: error: bad --shard-size '%s'\n", v); return 2; }
            o.shard_bytes = b;
        } else {
            fprintf(stderr, "fp4moe gen: error: unknown option '%s'\n\n", a);
            gen_usage(stderr);
            return 2;
        }
        i++;
    }
    if (!preset || !out) {
        fprintf(stderr, "fp4moe gen: error: --preset and --out are required\n\n");
        gen_usage(stderr);
        return 2;
    }
    fm_qformat f;
    if (fm_cli_parse_format("gen", fmt_s, &f)) return 2;
    fm_model_desc d;
    fm_status s = fm_preset_desc(preset, f, &d);
    if (s != FM_OK) return fm_cli_fail("gen", s);
    s = fm_gen_checkpoint(&d, &o, out);
    if (s != FM_OK) return fm_cli_fail("gen", s);
    return 0;
}
