/* Built-in kernel configs of the CUDA backend. Compiled in every build (no
 * CUDA needed) so that `explain` and the tuner can show what a GPU run would
 * pick on any machine. */
#include "fp4moe.h"
#include "cuda_env.h"
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

const char *fm_kernel_path_name(fm_kernel_path p) {
    switch (p) {
    case FM_PATH_SMALL: return "small";
    case FM_PATH_LARGE: return "large";
    case FM_PATH_WGMMA: return "wgmma";
    case FM_PATH_SPLITK: return "splitk";
    }
    return "unknown";
}

/*
 * Both paths stream every active expert's FP4 bytes once and run BF16
 * mma.sync tiles with the expert's weight rows in M (16 rows per warp) and
 * the expert's tokens in N (tile_n tokens per pass), so no tile row is spent
 * on padding. They differ in how a thread block splits the work:
 *
 * - small: one block = 16 weight rows; its warps split K (k_split = warps)
 *   and reduce through shared memory. With 1-2 tokens per expert the layer
 *   has only experts x rows/16 row groups; splitting K multiplies the loads
 *   in flight, which is what streaming needs.
 * - large: one block = 16 * warps rows, every warp walks the whole K for its
 *   own 16 rows (k_split = 1). The warps of a block read the same token
 *   activations at the same time, so those come from L1, and there are
 *   enough (expert, row block) items to fill the GPU without splitting K.
 *
 * The switch is on expected tokens per expert, T*k/E (switch_tpe). tile_n
 * covers the typical count of tokens per expert; experts with more tokens
 * take several passes over the same weight rows (cache hits). stages is 1:
 * the register double buffer of the weights is the one pipeline.
 *
 * - wgmma (sm_90): the large path's work split with Hopper warpgroup MMAs. A
 *   block is one warpgroup (4 warps, 64 rows, k_split 1); each warp decodes
 *   its 16 rows as above, and one wgmma.m64nNk16 per 16-wide K step
 *   multiplies the block's 64 rows by up to tile_n (8, 16 or 32) tokens whose
 *   activations the block stages once in shared memory, the weights two
 *   segments ahead through a shared-memory ring. It pays from FM_WGMMA_TPE
 *   tokens per expert; at B = 1 its 64-row blocks without a K split leave
 *   the GPU half empty (docs/perf.md).
 */
fm_kernel_config fm_kernel_config_default_mma(const struct fm_tune_key *key, int T) {
    /* Winners of the variant sweep on an H200: splitting K pays only while
     * almost every expert holds one token; 4-warp blocks beat 8-warp ones;
     * 16-token tiles pay from about 8 tokens per expert. */
    fm_kernel_config c;
    double tpe = 1.0;
    if (key && key->E > 0 && key->k > 0 && T > 0) tpe = (double)T * key->k / key->E;
    c.switch_tpe = 0.1f;
    c.stages = 1;
    c.warps = 4;
    c.tile_n = 8;
    if (tpe < c.switch_tpe) {
        c.path = FM_PATH_SMALL;
        c.k_split = 4;
        c.rows_per_block = 16;
    } else {
        c.path = FM_PATH_LARGE;
        c.k_split = 1;
        c.rows_per_block = 64;
        if (tpe >= 8.0) c.tile_n = 16;
    }
    return c;
}

fm_kernel_config fm_kernel_config_default(const struct fm_tune_key *key, int T) {
    fm_kernel_config c = fm_kernel_config_default_mma(key, T);
    double tpe = 1.0;
    if (key && key->E > 0 && key->k > 0 && T > 0) tpe = (double)T * key->k / key->E;
    if (tpe >= FM_WGMMA_TPE) {
        c.path = FM_PATH_WGMMA;
        c.warps = 4;
        c.k_split = 1;
        c.rows_per_block = 64;
        c.tile_n = tpe >= 10.0 ? 32 : 16;
    }
    if (key && key->I > 0 && key->I <= FM_SPLITK_DEFAULT_I && T <= FM_SPLITK_DEFAULT_T && key->H > 0) {
        /* K chunks of three 128-wide segments (the loads a splitk warp
         * issues together), at most 16 */
        const int nseg = (key->H + 127) / 128, ch = (nseg + 2) / 3;
        c.path = FM_PATH_SPLITK;
        c.warps = 8;
        c.rows_per_block = 16;
        c.k_split = ch < 1 ? 1 : ch > 16 ? 16 : ch;
        c.tile_n = T > 8 ? 16 : 8;
    }
    return c;
}

/* The CUDA engine's debugging switches (docs/tuning.md) and the values each
 * takes. */
static const struct {
    const char *name, *vals;
} k_cuda_env[] = {
    {"FP4MOE_CUDA_PDL", "0|1"},
    {"FP4MOE_CUDA_SH_FORK", "0|1"},
    {"FP4MOE_CUDA_BLAS", "0|1"},
};

/* v is one of the '|'-separated words of vals. */
static int env_value_ok(const char *v, const char *vals) {
    size_t n = strlen(v);
    for (const char *p = vals; *p;) {
        const char *q = strchr(p, '|');
        size_t len = q ? (size_t)(q - p) : strlen(p);
        if (len == n && !strncmp(p, v, n)) return 1;
        p += len + (q != NULL);
    }
    return 0;
}

int fm_cuda_env_is(const char *name, const char *word) {
    const char *v = getenv(name);
    return v && !strcmp(v, word);
}

fm_status fm_cuda_env_check(void) {
    extern char **environ;
    static const char pre[] = "FP4MOE_CUDA_";
    for (char **e = environ; e && *e; e++) {
        if (strncmp(*e, pre, sizeof pre - 1)) continue;
        const char *eq = strchr(*e, '=');
        size_t nl = eq ? (size_t)(eq - *e) : strlen(*e);
        const char *v = eq ? eq + 1 : "";
        size_t i = 0, n = sizeof k_cuda_env / sizeof k_cuda_env[0];
        while (i < n && !(strlen(k_cuda_env[i].name) == nl && !strncmp(k_cuda_env[i].name, *e, nl))) i++;
        if (i == n) {
            char known[256] = "";
            for (size_t j = 0; j < n; j++) {
                size_t l = strlen(known);
                snprintf(known + l, sizeof known - l, "%s%s", j ? ", " : "", k_cuda_env[j].name);
            }
            return fm_error(FM_E_ARG, "unknown environment variable %.*s (the CUDA switches are %s)", (int)nl, *e,
                            known);
        }
        if (*v && !env_value_ok(v, k_cuda_env[i].vals))
            return fm_error(FM_E_ARG, "environment variable %s='%s': expected %s", k_cuda_env[i].name, v,
                            k_cuda_env[i].vals);
    }
    return FM_OK;
}
