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

/* --shard tp:R[/r] | ep:R/r (bench, profile, explain, tune): consumes it as
 * fm_cli_dist_parse does; -1 on a bad value (the message names the flag). */
int fm_cli_shard_parse(const char *cmd, int argc, char **argv, int *i, fm_shard *sh);
/* Help lines for --shard. */
const char *fm_cli_shard_usage(void);
/* --shard with --tp / --ep: -1 with a message. */
int fm_cli_shard_validate(const char *cmd, const fm_shard *sh, const fm_cli_dist *o);

/* The model splits so (fm_shard_desc): loads the preset's / checkpoint's
 * description; -1 with a message. Nothing to check without a shard. */
int fm_cli_shard_check(const char *cmd, const fm_shard *sh, const char *preset, const char *model, fm_qformat fmt);

/* The library's options for the parsed flags (fm_forward_file, fm_bench_run). */
fm_dist_opts fm_cli_dist_lib_opts(const fm_cli_dist *o);
#endif
