/* The candidate configs `fp4moe tune` sweeps.
 *
 * The grid is the parameter space the CUDA kernels actually honour
 * (src/cuda/engine.cu, choose_cfg): a block of `warps` warps (1..8) split
 * into `k_split` groups along K (k_split divides warps), 16 weight rows per
 * group, so rows_per_block = 16 * warps / k_split is derived, not free; and
 * tile_n tokens per MMA pass, one of 8, 16, 32. Anything else would be
 * normalized by the launcher into a config already in the grid, costing a
 * measurement for nothing. The path follows from the split (k_split > 1:
 * the small, K-split path; 1: the large path), so both paths are candidates
 * at every batch and the switch point is tuned per bucket. tile_n stays
 * within a factor of two of the default's, which is sized from the tokens
 * per expert; stages and switch_tpe are kept from the default. The wgmma
 * path has one block shape (a warpgroup of 64 rows) and passes of 8, 16 or
 * 32 tokens: three candidates at every batch.
 *
 * Candidates are ordered by distance from the default (in factors of two
 * per parameter), so a short time budget still covers the neighbourhood
 * that most often wins. When the kernels' rules change, this is the one
 * place to follow them. */
#include "tune/tune_internal.h"

#include <stdlib.h>
#include <string.h>

static int ilog2(int x) {
    int l = 0;
    while (x > 1) { x >>= 1; l++; }
    return l;
}

static int distance(const fm_kernel_config *a, const fm_kernel_config *d) {
    return abs(ilog2(a->warps) - ilog2(d->warps)) + abs(ilog2(a->k_split) - ilog2(d->k_split)) +
           abs(ilog2(a->tile_n) - ilog2(d->tile_n)) + (a->path != d->path);
}

static int same(const fm_kernel_config *a, const fm_kernel_config *b) {
    return a->path == b->path && a->rows_per_block == b->rows_per_block && a->k_split == b->k_split &&
           a->warps == b->warps && a->stages == b->stages && a->tile_n == b->tile_n && a->switch_tpe == b->switch_tpe;
}

int fm_tune_candidates(const fm_tune_key *key, int T, fm_kernel_config *out, int max) {
    if (!key || !out || max <= 0 || T < 1) return 0;
    static const int warps[] = {1, 2, 4, 8}, tile_n[] = {8, 16, 32};
    fm_kernel_config v[FM_TUNE_GRID_MAX];
    int n = 0;
    fm_kernel_config def = fm_kernel_config_default(key, T);
    char why[128];
    if (fm_tune_config_invalid(&def, why, sizeof why)) return 0; /* a broken default: nothing to sweep around */
    v[n++] = def;
    for (size_t a = 0; a < sizeof warps / sizeof warps[0]; a++)
        for (int ks = 1; ks <= warps[a]; ks *= 2)
            for (size_t c = 0; c < sizeof tile_n / sizeof tile_n[0]; c++) {
                /* tile_n follows the tokens per expert, which the default
                 * already sized: only its neighbours are worth a look. */
                if (tile_n[c] > 2 * def.tile_n || 2 * tile_n[c] < def.tile_n) continue;
                fm_kernel_config x = def;
                x.warps = warps[a];
                x.k_split = ks;
                x.rows_per_block = 16 * warps[a] / ks;
                x.tile_n = tile_n[c];
                x.path = ks > 1 ? FM_PATH_SMALL : FM_PATH_LARGE;
                int dup = 0;
                for (int i = 0; i < n && !dup; i++) dup = same(&v[i], &x);
                if (!dup && n < FM_TUNE_GRID_MAX && !fm_tune_config_invalid(&x, why, sizeof why)) v[n++] = x;
            }
    /* the wgmma path: a warpgroup of 64 rows, passes of 8, 16 or 32 tokens
     * (8: a kernel built for six blocks per SM); and two warpgroups of 64
     * rows sharing the activations (rows_per_block 128) with passes of
     * 16 or 32, where the experts' rows fill such blocks (gate/up 128 rows,
     * down 256: otherwise part of a block streams rows it does not use) */
    const int two_ok = key->I > 0 && key->I % 128 == 0 && key->H > 0 && key->H % 256 == 0;
    for (int wg = 1; wg <= 2; wg++)
        for (int tn = wg == 2 ? 16 : 8; tn <= 32; tn *= 2) {
            if (wg == 2 && !two_ok) break;
            fm_kernel_config x = def;
            x.path = FM_PATH_WGMMA;
            x.warps = 4 * wg;
            x.k_split = 1;
            x.rows_per_block = 64 * wg;
            x.tile_n = tn;
            int dup = 0;
            for (int i = 0; i < n && !dup; i++) dup = same(&v[i], &x);
            if (!dup && n < FM_TUNE_GRID_MAX) v[n++] = x;
        }
    /* the splitk path where it runs (few tokens, experts of I <= 512):
     * gate/up's K in 2 .. 16 chunks */
    if (key->I > 0 && key->I <= FM_SPLITK_DEFAULT_I && T <= FM_SPLITK_MAX_TOKENS) {
        const int nseg = (key->H + 127) / 128;
        static const int chunks[] = {2, 4, 6, 8, 12, 16};
        for (size_t a = 0; a < sizeof chunks / sizeof chunks[0]; a++) {
            if (chunks[a] > nseg) break;
            fm_kernel_config x = def;
            x.path = FM_PATH_SPLITK;
            x.warps = 8;
            x.rows_per_block = 16;
            x.k_split = chunks[a];
            x.tile_n = T > 8 ? 16 : 8;
            int dup = 0;
            for (int i = 0; i < n && !dup; i++) dup = same(&v[i], &x);
            if (!dup && n < FM_TUNE_GRID_MAX && !fm_tune_config_invalid(&x, why, sizeof why)) v[n++] = x;
        }
    }
    /* Stable insertion sort by distance from the default (index 0 stays). */
    for (int i = 2; i < n; i++) {
        fm_kernel_config x = v[i];
        int dx = distance(&x, &def), j = i - 1;
        while (j >= 1 && distance(&v[j], &def) > dx) { v[j + 1] = v[j]; j--; }
        v[j + 1] = x;
    }
    if (n > max) n = max;
    memcpy(out, v, (size_t)n * sizeof v[0]);
    return n;
}
