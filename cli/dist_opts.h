/* Tensor- / expert-parallel flags shared by `forward` and `bench`. */
#ifndef FM_CLI_DIST_OPTS_H
#define FM_CLI_DIST_OPTS_H
#include "fp4moe.h"
#include <stdio.h>

typedef struct {
    int tp, ep;             /* --tp N / --ep N (0: off)                        */
    int gpus;               /* --gpus N: one process drives N GPUs (NCCL)      */
    int mpi;                /* --mpi: one process per GPU (NCCL over MPI)      */
    fm_dist_layout layout;  /* --dist-layout replicated|token-sharded          */
    fm_compress compress;   /* --comm-compress none|fp8|nvfp4                  */
    int layout_set;
} fm_cli_dist;

/* Help lines for the flags below (for a command's --help). */
const char *fm_cli_dist_usage(void);
/* If argv[*i] is one of the flags, consumes it and its value (advancing
 * *i) and returns 1; returns 0 if it is not one; -1 on a bad value (the
 * message is printed). */
int fm_cli_dist_parse(const char *cmd, int argc, char **argv, int *i, fm_cli_dist *o);
/* 1 when --tp or --ep was given. After parsing, checks the combination
 * (not both, --gpus/--mpi only with --device cuda); -1 with a message. */
int fm_cli_dist_active(const fm_cli_dist *o);
int fm_cli_dist_validate(const char *cmd, const fm_cli_dist *o, fm_device dev);

/* The library's options for the parsed flags (for fm_dist_run). */
fm_dist_opts fm_cli_dist_lib_opts(const fm_cli_dist *o);

/* One MoE block over the sharded layer (forward). cpu: the engine of
 * --device cpu (ignored for cuda). One line of load/communication figures
 * goes to info (may be NULL). */
fm_status fm_cli_dist_forward(const fm_cli_dist *o, fm_device dev, fm_cpu_engine *cpu, const fm_model_desc *d,
                              const fm_moe_layer *l, const void *x, fm_dtype xdt, int T, const int32_t *token_ids,
                              fm_moe_out *out, FILE *info);
/* bench: per batch size, per-rank and total time, communication time and
 * scaling efficiency against the unsharded layer, printed as a table on
 * out; optional JSON lines array in json (may be NULL). */
fm_status fm_cli_dist_bench(const fm_cli_dist *o, fm_device dev, fm_cpu_engine *cpu, const fm_model_desc *d,
                            const fm_moe_layer *l, const int *batches, int n_batches, int reps, uint64_t seed,
                            FILE *out);
#endif
