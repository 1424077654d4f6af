/* The candidate configs `fp4moe tune` sweeps.
 *
 * A neighbourhood of the built-in default rather than a fixed product of
 * values: the kernels couple their parameters (e.g. a block's rows follow
 * its warps), and the default already encodes those couplings, so the grid
 * is built relative to it and follows whatever the defaults become.
 *
 * For each path: the path's own default (the built-in config at the batch,
 * or for the other path the built-in config at the nearest batch where that
 * path is the default), every parameter halved or doubled on its own, the
 * pipeline one deeper, and warps moved together with k_split and with
 * rows_per_block. The batch's own path comes first, so a short time budget
 * still covers the neighbourhood that most often wins; the other path is
 * always a candidate, which makes the small/large switch point tuned per
 * bucket. Kernels reject configs they cannot run for a shape and the sweep
 * skips those, so the grid need not know every divisibility rule. */
#include "tune/tune_internal.h"

#include <string.h>

static int same(const fm_kernel_config *a, const fm_kernel_config *b) {
    return a->path == b->path && a->rows_per_block == b->rows_per_block && a->k_split == b->k_split &&
           a->warps == b->warps && a->stages == b->stages && a->tile_n == b->tile_n && a->switch_tpe == b->switch_tpe;
}

static void add(fm_kernel_config *v, int *n, const fm_kernel_config *c) {
    char why[128];
    if (*n >= FM_TUNE_GRID_MAX || fm_tune_config_invalid(c, why, sizeof why)) return;
    for (int i = 0; i < *n; i++)
        if (same(&v[i], c)) return;
    v[(*n)++] = *c;
}

/* Halves (f < 0) or doubles (f > 0) an integer parameter. */
static int scale(int x, int f) { return f > 0 ? x * 2 : x / 2; }

static void neighbourhood(fm_kernel_config *v, int *n, const fm_kernel_config *base) {
    add(v, n, base);
    for (int f = -1; f <= 1; f += 2) {
        fm_kernel_config x;
        x = *base; x.rows_per_block = scale(base->rows_per_block, f); add(v, n, &x);
        x = *base; x.warps = scale(base->warps, f); add(v, n, &x);
        x = *base; x.k_split = scale(base->k_split, f); add(v, n, &x);
        x = *base; x.tile_n = scale(base->tile_n, f); add(v, n, &x);
        x = *base; x.warps = scale(base->warps, f); x.k_split = scale(base->k_split, f); add(v, n, &x);
        x = *base; x.warps = scale(base->warps, f); x.rows_per_block = scale(base->rows_per_block, f); add(v, n, &x);
    }
    fm_kernel_config x = *base;
    x.stages = base->stages + 1;
    add(v, n, &x);
}

int fm_tune_candidates(const fm_tune_key *key, int T, fm_kernel_config *out, int max) {
    if (!key || !out || max <= 0 || T < 1) return 0;
    fm_kernel_config v[FM_TUNE_GRID_MAX];
    int n = 0;
    fm_kernel_config def = fm_kernel_config_default(key, T);
    char why[128];
    if (fm_tune_config_invalid(&def, why, sizeof why)) return 0; /* a broken default: nothing to sweep around */
    neighbourhood(v, &n, &def);

    /* The other path's own default: the built-in config at the nearest
     * batch (by factors of two, either way) that picks that path. */
    int other = 0;
    for (int step = 1; step <= 20 && !other; step++) {
        int64_t up = (int64_t)T << step, down = T >> step;
        fm_kernel_config o;
        if (up <= 1000000 && (o = fm_kernel_config_default(key, (int)up)).path != def.path) other = 1;
        else if (down >= 1 && (o = fm_kernel_config_default(key, (int)down)).path != def.path) other = 1;
        if (other) neighbourhood(v, &n, &o);
    }
    if (!other) { /* the defaults never switch: try the other path as is */
        fm_kernel_config o = def;
        o.path = def.path == FM_PATH_SMALL ? FM_PATH_LARGE : FM_PATH_SMALL;
        neighbourhood(v, &n, &o);
    }
    if (n > max) n = max;
    memcpy(out, v, (size_t)n * sizeof v[0]);
    return n;
}
