/* The router logits' shape decision (route_shape.h). */
#include "route_shape.h"

#define LG_KMIN 128  /* narrowest K slice of the tiled shape */
#define LG_MAXKS 32  /* most K slices (the selection sums them) */

void fm_route_tile_split(int T, int H, int E, int sms, int depth, int step, int *ks, int *kc) {
    long tiles = (long)((T + FM_LG_TILE - 1) / FM_LG_TILE) * ((E + FM_LG_TILE - 1) / FM_LG_TILE);
    long want = ((long)depth * (sms > 0 ? sms : 132) + tiles - 1) / tiles;
    long maxks = (H + LG_KMIN - 1) / LG_KMIN;
    if (maxks > LG_MAXKS) maxks = LG_MAXKS;
    if (want > maxks) want = maxks;
    if (want < 1) want = 1;
    long c = (H + want - 1) / want;
    c = (c + step - 1) / step * step;
    *kc = (int)c;
    *ks = (int)((H + c - 1) / c);
}

long fm_route_tile_blocks(int T, int H, int E, int sms) {
    int ks, kc;
    /* the tensor-core kernels: about two blocks per SM, K in stages of 64 */
    fm_route_tile_split(T, H, E, sms, 2, 64, &ks, &kc);
    return (long)((T + FM_LG_TILE - 1) / FM_LG_TILE) * ((E + FM_LG_TILE - 1) / FM_LG_TILE) * ks;
}

int fm_route_logits_gemv(int T, int H, int E, int sms) {
    if (T <= FM_LG_SMALL_T) return 1;
    if (T > FM_LG_GEMV_MAX) return 0;
    return 3 * fm_route_tile_blocks(T, H, E, sms) < (sms > 0 ? sms : 132);
}
