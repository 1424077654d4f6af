/* Flags of `forward --tp/--ep` and `bench --tp/--ep`; the work is in
 * src/parallel. */
#include "dist_opts.h"
#include "cli.h"

#include <stdio.h>
#include <string.h>

const char *fm_cli_dist_usage(void) {
    return "  --tp N                 tensor parallel over N ranks (I split N ways)\n"
           "  --ep N                 expert parallel over N ranks (E/N experts each)\n"
           "  --dist-layout L        replicated (default: every rank holds all tokens,\n"
           "                         outputs all-reduced) or token-sharded (rank r holds\n"
           "                         token chunk r: all-gather/dispatch + reduce-scatter)\n"
           "  --comm-compress C      none|fp8|nvfp4: activations as sent (token-sharded)\n"
           "  --gpus N               --device cuda: one process drives GPUs 0..N-1 (NCCL)\n"
           "  --mpi                  --device cuda: one process per GPU, NCCL id over MPI\n"
           "  With --device cpu the N ranks are simulated in this process.\n";
}

int fm_cli_dist_parse(const char *cmd, int argc, char **argv, int *i, fm_cli_dist *o) {
    const char *a = argv[*i];
    long v;
    if (!strcmp(a, "--tp") || !strcmp(a, "--ep") || !strcmp(a, "--gpus")) {
        if (*i + 1 >= argc) {
            fprintf(stderr, "fp4moe %s: error: %s needs a value\n", cmd, a);
            return -1;
        }
        if (fm_cli_parse_int(cmd, a, argv[*i + 1], 1, FM_DIST_MAX_RANKS, &v)) return -1;
        if (!strcmp(a, "--tp")) o->tp = (int)v;
        else if (!strcmp(a, "--ep")) o->ep = (int)v;
        else o->gpus = (int)v;
        *i += 1;
        return 1;
    }
    if (!strcmp(a, "--dist-layout") || !strcmp(a, "--comm-compress")) {
        if (*i + 1 >= argc) {
            fprintf(stderr, "fp4moe %s: error: %s needs a value\n", cmd, a);
            return -1;
        }
        const char *val = argv[*i + 1];
        if (!strcmp(a, "--dist-layout")) {
            if (fm_dist_layout_from_name(val, &o->layout)) {
                fprintf(stderr, "fp4moe %s: error: --dist-layout expects replicated or token-sharded, got '%s'\n",
                        cmd, val);
                return -1;
            }
            o->layout_set = 1;
        } else if (fm_compress_from_name(val, &o->compress)) {
            fprintf(stderr, "fp4moe %s: error: --comm-compress expects none, fp8 or nvfp4, got '%s'\n", cmd, val);
            return -1;
        }
        *i += 1;
        return 1;
    }
    if (!strcmp(a, "--mpi")) {
        o->mpi = 1;
        return 1;
    }
    return 0;
}

int fm_cli_dist_active(const fm_cli_dist *o) { return o->tp > 0 || o->ep > 0; }

int fm_cli_dist_validate(const char *cmd, const fm_cli_dist *o, fm_device dev) {
    const char *bad = NULL;
    if (o->tp && o->ep) bad = "--tp and --ep together (TP x EP is not supported); choose one";
    else if (!fm_cli_dist_active(o) && (o->gpus || o->mpi || o->layout_set || o->compress))
        bad = "--gpus, --mpi, --dist-layout and --comm-compress need --tp N or --ep N";
    else if (dev != FM_DEV_CUDA && (o->gpus || o->mpi))
        bad = "--gpus and --mpi need --device cuda (with --device cpu the ranks are simulated)";
    else if (o->gpus && o->mpi) bad = "--gpus (one process) and --mpi (one process per GPU) exclude each other";
    else if (o->gpus && o->gpus != (o->tp ? o->tp : o->ep)) bad = "--gpus must equal the --tp / --ep rank count";
    else if (o->compress && o->layout != FM_DIST_TOKEN_SHARDED)
        bad = "--comm-compress needs --dist-layout token-sharded (replicated tokens send no activations)";
    if (bad) {
        fprintf(stderr, "fp4moe %s: error: %s\n", cmd, bad);
        return -1;
    }
    return 0;
}

fm_dist_opts fm_cli_dist_lib_opts(const fm_cli_dist *o) {
    return (fm_dist_opts){.mode = o->tp ? FM_DIST_TP : FM_DIST_EP,
                          .ranks = o->tp ? o->tp : o->ep,
                          .layout = o->layout,
                          .compress = o->compress};
}

const char *fm_cli_shard_usage(void) {
    return "  --shard tp:R[/r]       run on this one device what rank r (default 0) of an R-way\n"
           "                         tensor-parallel split computes: the I/R slice of every expert\n"
           "                         (and of the shared expert), the full router\n"
           "  --shard ep:R/r         rank r of R-way expert parallelism: experts r*E/R..(r+1)*E/R-1\n"
           "                         on the pairs the full routing sends them (pre-routed call),\n"
           "                         the shared expert on the rank's token chunk\n";
}

int fm_cli_shard_parse(const char *cmd, int argc, char **argv, int *i, fm_shard *sh) {
    if (strcmp(argv[*i], "--shard")) return 0;
    if (*i + 1 >= argc) {
        fprintf(stderr, "fp4moe %s: error: --shard needs a value (tp:R, tp:R/r or ep:R/r)\n", cmd);
        return -1;
    }
    fm_status s = fm_shard_parse(argv[*i + 1], sh);
    if (s) {
        fprintf(stderr, "fp4moe %s: error: %s\n", cmd, fm_last_error());
        return -1;
    }
    *i += 1;
    return 1;
}

int fm_cli_shard_validate(const char *cmd, const fm_shard *sh, const fm_cli_dist *o) {
    if (sh->mode && o && fm_cli_dist_active(o)) {
        fprintf(stderr,
                "fp4moe %s: error: --shard (one rank on one device) and --tp / --ep (all ranks over several "
                "devices) exclude each other\n",
                cmd);
        return -1;
    }
    return 0;
}

int fm_cli_shard_check(const char *cmd, const fm_shard *sh, const char *preset, const char *model, fm_qformat fmt) {
    if (!sh->mode) return 0;
    fm_model_desc d, v;
    fm_status s = model ? fm_model_desc_load(model, &d) : fm_preset_desc(preset, fmt, &d);
    if (!s) s = fm_shard_desc(&d, fmt, sh, &v);
    if (s) {
        fprintf(stderr, "fp4moe %s: error: %s\n", cmd, fm_last_error());
        return -1;
    }
    return 0;
}
