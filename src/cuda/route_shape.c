/* The router logits' shape decision (route_shape.h). */
#include "route_shape.h"
#include "cuda_env.h"

#define LG_KMIN 128  /* narrowest K slice of the tiled shape */
#define LG_MAXKS 32  /* most K slices (the selection sums them) */

/* FP4MOE_CUDA_LOGITS_KS=8|16 (v48, for comparisons). Read once, like the
 * engine's other switches (these functions run at every routing launch). */
static int lg_maxks(void) {
    static int v = -1;
    if (v < 0)
        v = fm_cuda_env_is("FP4MOE_CUDA_LOGITS_KS", "8")    ? 8
            : fm_cuda_env_is("FP4MOE_CUDA_LOGITS_KS", "16") ? 16
                                                             : LG_MAXKS;
    return v;
}

/* FP4MOE_CUDA_GEMV_T=32|64|128 as that number, 0 when unset. Read once. */
static int gemv_limit(void) {
    static int v = -1;
    if (v < 0)
        v = fm_cuda_env_is("FP4MOE_CUDA_GEMV_T", "32")    ? 32
            : fm_cuda_env_is("FP4MOE_CUDA_GEMV_T", "64")  ? 64
            : fm_cuda_env_is("FP4MOE_CUDA_GEMV_T", "128") ? 128
                                                           : 0;
    return v;
}

void fm_route_tile_split(int T, int H, int E, int sms, int depth, int step, int *ks, int *kc) {
    long tiles = (long)((T + FM_LG_TILE - 1) / FM_LG_TILE) * ((E + FM_LG_TILE - 1) / FM_LG_TILE);
    long want = ((long)depth * (sms > 0 ? sms : 132) + tiles - 1) / tiles;
    long maxks = (H + LG_KMIN - 1) / LG_KMIN;
    if (maxks > lg_maxks()) maxks = lg_maxks();
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
    if (gemv_limit()) return T <= gemv_limit();
    if (T <= FM_LG_SMALL_T) return 1;
    if (T > FM_LG_GEMV_MAX) return 0;
    return 3 * fm_route_tile_blocks(T, H, E, sms) < (sms > 0 ? sms : 132);
}
