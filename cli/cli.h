/* The CLI: parsing and printing only; everything real is in libfp4moe. */
#ifndef FM_CLI_H
#define FM_CLI_H
#include "fp4moe.h"

/* One subcommand: argv[0] is the subcommand's name. Returns the exit code. */
typedef int (*fm_cmd_fn)(int argc, char **argv);

int fm_cmd_gen(int argc, char **argv);
int fm_cmd_inspect(int argc, char **argv);
int fm_cmd_forward(int argc, char **argv);
int fm_cmd_bench(int argc, char **argv);
int fm_cmd_tune(int argc, char **argv);
int fm_cmd_explain(int argc, char **argv);
int fm_cmd_profile(int argc, char **argv);
int fm_cmd_trace(int argc, char **argv);

/* Prints "fp4moe <cmd>: <message>" plus fm_last_error() to stderr; returns 1. */
int fm_cli_fail(const char *cmd, fm_status s);
/* Parses "1,4,16" into vals (max n); returns count or -1 (message printed). */
int fm_cli_parse_int_list(const char *cmd, const char *s, int *vals, int max);
/* Parses a decimal integer in [lo, hi]; -1 on error (message printed). */
int fm_cli_parse_int(const char *cmd, const char *opt, const char *s, long lo, long hi, long *out);
/* Parses --format nvfp4|mxfp4|bf16 (s NULL: FM_QF_NONE); -1 on error
 * (message printed). */
int fm_cli_parse_format(const char *cmd, const char *s, fm_qformat *out);
/* Parses --isa auto|scalar|avx2|avx512; -1 on error (message printed). */
int fm_cli_parse_isa(const char *cmd, const char *s, fm_cpu_isa *out);

#endif
