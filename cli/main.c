#include "cli.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const struct {
    const char *name;
    fm_cmd_fn fn;
    const char *help;
} k_cmds[] = {
    {"gen", fm_cmd_gen, "write a seeded random checkpoint for a preset"},
    {"inspect", fm_cmd_inspect, "describe a checkpoint and every problem found"},
    {"forward", fm_cmd_forward, "run one MoE layer on hidden states from a file"},
    {"bench", fm_cmd_bench, "time the MoE layer against the measured bandwidth"},
    {"tune", fm_cmd_tune, "sweep kernel configs on this GPU and write config files"},
    {"explain", fm_cmd_explain, "print which kernel and config would run, and why"},
    {"profile", fm_cmd_profile, "phases, telemetry, roofline, Chrome trace, HTML report"},
    {"trace", fm_cmd_trace, "summarize / diff other engines' PyTorch-profiler traces"},
};

static void usage(FILE *f) {
    fprintf(f, "fp4moe %s — decode-time MoE with 4-bit float experts\n\nusage: fp4moe <command> [options]\n\ncommands:\n", FM_VERSION);
    for (size_t i = 0; i < sizeof k_cmds / sizeof k_cmds[0]; i++)
        fprintf(f, "  %-8s %s\n", k_cmds[i].name, k_cmds[i].help);
    fprintf(f, "\n'fp4moe <command> --help' describes a command's options.\n");
}

int main(int argc, char **argv) {
    if (argc < 2) { usage(stderr); return 2; }
    const char *c = argv[1];
    if (!strcmp(c, "help") || !strcmp(c, "--help") || !strcmp(c, "-h")) { usage(stdout); return 0; }
    if (!strcmp(c, "version") || !strcmp(c, "--version")) { printf("fp4moe %s\n", FM_VERSION); return 0; }
    for (size_t i = 0; i < sizeof k_cmds / sizeof k_cmds[0]; i++)
        if (!strcmp(c, k_cmds[i].name)) return k_cmds[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "fp4moe: unknown command '%s'\n\n", c);
    usage(stderr);
    return 2;
}

int fm_cli_fail(const char *cmd, fm_status s) {
    const char *m = fm_last_error();
    fprintf(stderr, "fp4moe %s: error: %s%s%s\n", cmd, fm_status_name(s), m[0] ? ": " : "", m);
    return 1;
}

int fm_cli_parse_int(const char *cmd, const char *opt, const char *s, long lo, long hi, long *out) {
    char *end = NULL;
    errno = 0;
    long v = s ? strtol(s, &end, 10) : 0;
    if (!s || !*s || *end || errno || v < lo || v > hi) {
        fprintf(stderr, "fp4moe %s: error: %s expects an integer in [%ld, %ld], got '%s'\n", cmd, opt, lo, hi, s ? s : "");
        return -1;
    }
    *out = v;
    return 0;
}

int fm_cli_parse_format(const char *cmd, const char *s, fm_qformat *out) {
    *out = s ? fm_qformat_from_name(s) : FM_QF_NONE;
    if (!s || *out == FM_QF_NVFP4 || *out == FM_QF_MXFP4 || *out == FM_QF_BF16) return 0;
    fprintf(stderr, "fp4moe %s: error: --format '%s' (expected nvfp4, mxfp4 or bf16)\n", cmd, s);
    return -1;
}

int fm_cli_parse_int_list(const char *cmd, const char *s, int *vals, int max) {
    int n = 0;
    const char *p = s;
    if (!s || !*s) { fprintf(stderr, "fp4moe %s: error: empty list\n", cmd); return -1; }
    while (*p) {
        char *end = NULL;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v <= 0 || v > 1000000 || (*end && *end != ',')) {
            fprintf(stderr, "fp4moe %s: error: bad list '%s' (positive integers separated by commas)\n", cmd, s);
            return -1;
        }
        if (n == max) { fprintf(stderr, "fp4moe %s: error: list '%s' has more than %d entries\n", cmd, s, max); return -1; }
        vals[n++] = (int)v;
        p = *end ? end + 1 : end;
        if (*end == ',' && !*p) { fprintf(stderr, "fp4moe %s: error: bad list '%s'\n", cmd, s); return -1; }
    }
    return n;
}
