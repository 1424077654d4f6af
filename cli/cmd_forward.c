/* fp4moe forward: one MoE layer on hidden states from a file. */
#include "cli.h"
#include "dist_opts.h"

#include <stdio.h>
#include <string.h>

static void forward_usage(FILE *f) {
    fprintf(f,
            "usage: fp4moe forward --model DIR --layer L --input IN.safetensors --output OUT.safetensors\n"
            "                      [--device cpu|cuda] [--isa auto|scalar|avx2|avx512] [--threads N]\n\n"
            "Runs the MoE block of layer L (routed experts + shared experts) on tensor\n"
            "hidden_states [T, H] (F32, BF16 or F16) of IN. Layers routed by token id\n"
            "(DeepSeek-V4's first layers) also need an I32 tensor token_ids [T].\n"
            "OUT gets hidden_states [T, H] F32, topk_ids I32 [T, k] (ascending per row) and\n"
            "topk_weights F32 [T, k] in the same order. Nothing is written on error.\n");
}

int fm_cli_parse_isa(const char *cmd, const char *s, fm_cpu_isa *out) {
    static const fm_cpu_isa all[] = {FM_CPU_AUTO, FM_CPU_SCALAR, FM_CPU_AVX2, FM_CPU_AVX512};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        if (!strcmp(s, fm_cpu_isa_name(all[i]))) { *out = all[i]; return 0; }
    fprintf(stderr, "fp4moe %s: error: --isa '%s' (expected auto, scalar, avx2 or avx512)\n", cmd, s);
    return -1;
}

int fm_cmd_forward(int argc, char **argv) {
    fm_forward_file_opts o = {0};
    o.layer = -1;
    o.device = FM_DEV_CPU;
    o.isa = FM_CPU_AUTO;
    fm_cli_dist dist = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        long n;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { forward_usage(stdout); fputs(fm_cli_dist_usage(), stdout); return 0; }
        int dr = fm_cli_dist_parse("forward", argc, argv, &i, &dist);
        if (dr < 0) return 2;
        if (dr) continue;
        if (!v) { fprintf(stderr, "fp4moe forward: error: %s needs a value\n", a); return 2; }
        if (!strcmp(a, "--model")) o.model_dir = v;
        else if (!strcmp(a, "--input")) o.input = v;
        else if (!strcmp(a, "--output")) o.output = v;
        else if (!strcmp(a, "--layer")) {
            if (fm_cli_parse_int("forward", a, v, 0, 100000, &n)) return 2;
            o.layer = (int)n;
        } else if (!strcmp(a, "--threads")) {
            if (fm_cli_parse_int("forward", a, v, 1, 1024, &n)) return 2;
            o.n_threads = (int)n;
        } else if (!strcmp(a, "--isa")) {
            if (fm_cli_parse_isa("forward", v, &o.isa)) return 2;
        } else if (!strcmp(a, "--device")) {
            if (!strcmp(v, "cpu")) o.device = FM_DEV_CPU;
            else if (!strcmp(v, "cuda")) o.device = FM_DEV_CUDA;
            else { fprintf(stderr, "fp4moe forward: error: --device '%s' (expected cpu or cuda)\n", v); return 2; }
        } else {
            fprintf(stderr, "fp4moe forward: error: unknown option '%s'\n\n", a);
            forward_usage(stderr);
            return 2;
        }
        i++;
    }
    if (!o.model_dir || !o.input || !o.output || o.layer < 0) {
        fprintf(stderr, "fp4moe forward: error: --model, --layer, --input and --output are required\n\n");
        forward_usage(stderr);
        return 2;
    }
    if (fm_cli_dist_validate("forward", &dist, o.device)) return 2;
    fm_dist_opts dop = fm_cli_dist_lib_opts(&dist);
    if (fm_cli_dist_active(&dist)) { o.dist = &dop; o.dist_mpi = dist.mpi; }
    char info[4096];
    fm_status s = fm_forward_file(&o, info, sizeof info);
    if (s != FM_OK) return fm_cli_fail("forward", s);
    printf("%s\n", info);
    return 0;
}
