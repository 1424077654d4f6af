/* fp4moe inspect: describe a checkpoint and every problem found. */
#include "cli.h"

#include <stdio.h>
#include <string.h>

static void inspect_usage(FILE *f) {
    fprintf(f,
            "usage: fp4moe inspect DIR [--json]\n\n"
            "Reads DIR/config.json (+ hf_quant_config.json) and the checkpoint's shards and\n"
            "prints the family, MoE layers present, experts, formats, bytes per expert and in\n"
            "total, routing, and every problem found (missing or mis-shaped tensors, wrong\n"
            "dtypes, missing shards, config values out of range). Exit status 1 when there\n"
            "are problems.\n");
}

int fm_cmd_inspect(int argc, char **argv) {
    const char *dir = NULL;
    int as_json = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { inspect_usage(stdout); return 0; }
        if (!strcmp(argv[i], "--json")) as_json = 1;
        else if (argv[i][0] == '-') {
            fprintf(stderr, "fp4moe inspect: error: unknown option '%s'\n\n", argv[i]);
            inspect_usage(stderr);
            return 2;
        } else if (dir) {
            fprintf(stderr, "fp4moe inspect: error: more than one directory given\n");
            return 2;
        } else dir = argv[i];
    }
    if (!dir) {
        fprintf(stderr, "fp4moe inspect: error: no checkpoint directory given\n\n");
        inspect_usage(stderr);
        return 2;
    }
    int n = 0;
    fm_status s = fm_inspect(dir, as_json, stdout, &n);
    if (s != FM_OK) return fm_cli_fail("inspect", s);
    if (n) fprintf(stderr, "fp4moe inspect: %d problem(s) found in %s\n", n, dir);
    return n ? 1 : 0;
}
