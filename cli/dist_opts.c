/* Flags and printing for `forward --tp/--ep` and `bench --tp/--ep`; the work
 * is in src/parallel. */
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

fm_status fm_cli_dist_forward(const fm_cli_dist *o, fm_device dev, fm_cpu_engine *cpu, const fm_model_desc *d,
                              const fm_moe_layer *l, const void *x, fm_dtype xdt, int T, const int32_t *token_ids,
                              fm_moe_out *out, FILE *info) {
    fm_comm *c;
    fm_dist *ds;
    const fm_dist_opts op = fm_cli_dist_lib_opts(o);
    fm_status s = fm_dist_open(&op, dev, o->mpi, cpu, d, l, &c, &ds);
    if (s) return s;
    fm_dist_stats st;
    s = fm_dist_forward(ds, x, xdt, T, token_ids, out, &st);
    if (!s && info) {
        fprintf(info, "dist: %s\n", fm_dist_describe(ds));
        fprintf(info, "dist: load imbalance %.3f (max/mean (token, expert) pairs per rank); pairs per rank:",
                st.load_imbalance);
        for (int p = 0; p < st.ranks; p++) fprintf(info, " %lld", (long long)st.pairs[p]);
        fprintf(info, "\ndist: communication %.1f us, %lld bytes per rank (%lld of them activations)\n",
                st.comm_ns / 1e3, (long long)st.comm_bytes, (long long)st.act_bytes);
    }
    fm_dist_free(ds);
    fm_comm_free(c);
    return s;
}

fm_status fm_cli_dist_bench(const fm_cli_dist *o, fm_device dev, fm_cpu_engine *cpu, const fm_model_desc *d,
                            const fm_moe_layer *l, const int *batches, int n_batches, int reps, uint64_t seed,
                            FILE *out) {
    fm_comm *c;
    fm_dist *ds;
    const fm_dist_opts op = fm_cli_dist_lib_opts(o);
    fm_status s = fm_dist_open(&op, dev, o->mpi, cpu, d, l, &c, &ds);
    if (s) return s;
    fprintf(out, "dist: %s\n", fm_dist_describe(ds));
    if (dev == FM_DEV_CPU)
        fprintf(out, "dist: simulated ranks run one after another; total = slowest rank + collectives "
                     "(no overlap); communication here is memory copies, not a network\n");
    for (int b = 0; b < n_batches && !s; b++) {
        fm_dist_bench_result r;
        s = fm_dist_bench(ds, batches[b], seed, reps, &r);
        if (s) break;
        if (b == 0)
            fprintf(out, "dist: times: %s\n%6s %12s %12s %12s %12s %8s %6s %9s  %s\n", r.method, "batch", "total_us",
                    "slowest_us", "comm_us", "single_us", "speedup", "eff", "imbalance", "per-rank compute us");
        double slow = 0;
        for (int p = 0; p < r.ranks; p++)
            if (r.us_rank[p] > slow) slow = r.us_rank[p];
        fprintf(out, "%6d %12.1f %12.1f %12.1f %12.1f %8.2f %5.0f%% %9.3f ", r.T, r.us_total, slow, r.us_comm,
                r.us_single, r.speedup, 100 * r.efficiency, r.load_imbalance);
        for (int p = 0; p < r.ranks; p++) fprintf(out, " %.1f", r.us_rank[p]);
        fprintf(out, "\n");
    }
    fm_dist_free(ds);
    fm_comm_free(c);
    return s;
}
