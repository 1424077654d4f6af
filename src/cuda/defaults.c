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
 * take several passes over the same weight rows (cache hits). stages 1 is
 * a register double buffer of the weights, stages >= 2 a cp.async ring in
 * shared memory (weights, scales and activations).
 *
 * - wgmma (sm_90): the large path's work split with Hopper warpgroup MMAs. A
 *   block is one warpgroup (4 warps, 64 rows, k_split 1); each warp decodes
 *   its 16 rows as above, and one wgmma.m64nNk16 per 16-wide K step
 *   multiplies the block's 64 rows by up to tile_n (8, 16 or 32) tokens whose
 *   activations the block stages once in shared memory, the weights two
 *   segments ahead through a shared-memory ring. It pays from FM_WGMMA_TPE
 *   tokens per expert (H200, DeepSeek-V4-Flash, B * k / E: 0.047 at B = 2,
 *   6 % faster than the mma.sync paths; 9 - 11 % at B = 4 - 16; 1.5 to 12
 *   tokens 7 - 22 %; 11 % slower at B = 1, where its 64-row blocks without
 *   a K split leave the GPU half empty; docs/perf.md, v14 - v15).
 */
fm_kernel_config fm_kernel_config_default_mma(const struct fm_tune_key *key, int T) {
    /* Winners of the variant sweep on an H200 (docs/perf.md, GPU v2):
     * splitting K pays only while almost every expert holds one token;
     * 4-warp blocks beat 8-warp ones; the register double buffer beat the
     * cp.async ring (stages 3) at every batch; 16-token tiles pay from
     * about 8 tokens per expert. */
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
    return c;
}

/* The FP4MOE_CUDA_* switches (docs/perf.md, "Switches for A/B runs") and the
 * values each takes; "WxK" is FP4MOE_CUDA_DOWN's block shape. */
static const struct {
    const char *name, *vals;
} k_cuda_env[] = {
    {"FP4MOE_CUDA_PDL", "0|1"},
    {"FP4MOE_CUDA_FP4_DECODE", "v5|v6"},
    {"FP4MOE_CUDA_ROUTE_FUSE", "0|1"},
    {"FP4MOE_CUDA_ROUTE_WARPGROUP", "0|1"},
    {"FP4MOE_CUDA_SEL_SPREAD", "0|1|2"},
    {"FP4MOE_CUDA_SEL_EARLY", "0|1|2"},
    {"FP4MOE_CUDA_SH_KS", "1|2|4|8"},
    {"FP4MOE_CUDA_SEL_WARPS", "4|8"},
    {"FP4MOE_CUDA_LOGITS", "simt|mma|bf16"},
    {"FP4MOE_CUDA_SH_PREFETCH", "0|1"},
    {"FP4MOE_CUDA_SH_EARLY", "0|1"},
    {"FP4MOE_CUDA_SH_FORK", "0|1"},
    {"FP4MOE_CUDA_SH_FORK_EARLY", "0|1"},
    {"FP4MOE_CUDA_PRIO", "0|1|2"},
    {"FP4MOE_CUDA_GEMV_T", "32|64|128"},
    {"FP4MOE_CUDA_HANDOFF", "0|1"},
    {"FP4MOE_CUDA_SH_WIDE", "0|1"},
    {"FP4MOE_CUDA_SH_TOKENS", "32|64"},
    {"FP4MOE_CUDA_WG_DOWN_TOKENS", "8|16|32"},
    {"FP4MOE_CUDA_WG_GROUPS", "1|2|gu|dn"},
    {"FP4MOE_CUDA_LOGITS_KS", "8|16|32"},
    {"FP4MOE_CUDA_PRE_WAIT", "0|1"},
    {"FP4MOE_CUDA_L2HINT", "0|1"},
    {"FP4MOE_CUDA_WG_DOWN2", "0|1"},
    {"FP4MOE_CUDA_WG_DOWN_KS", "1|2|4"},
    {"FP4MOE_CUDA_WG_GU_KS", "1|2|4"},
    {"FP4MOE_CUDA_STAGES", "1|2|3|4|5|6|7|8"},
    {"FP4MOE_CUDA_XG", "0|1|2|3"},
    {"FP4MOE_CUDA_DOWN", "nosplit|WxK"},
    {"FP4MOE_CUDA_WG", "0|1|2|3"},
    {"FP4MOE_CUDA_WG_TOKENS", "8|16|32"},
};

/* v is one of the '|'-separated words of vals ("WxK": W warps 1..8 split
 * into K groups, K dividing W). */
static int env_value_ok(const char *v, const char *vals) {
    size_t n = strlen(v);
    for (const char *p = vals; *p;) {
        const char *q = strchr(p, '|');
        size_t len = q ? (size_t)(q - p) : strlen(p);
        if (len == 3 && !strncmp(p, "WxK", 3)) {
            int w = 0, k = 0;
            char tail = 0;
            if (sscanf(v, "%dx%d%c", &w, &k, &tail) == 2 && w >= 1 && w <= 8 && k >= 1 && w % k == 0) return 1;
        } else if (len == n && !strncmp(p, v, n)) {
            return 1;
        }
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
            char known[2048] = ""; /* every name: 32 switches take ~700 characters */
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
