/* Which shape the router logits take (src/cuda/route_shape.c): plain C, so
 * that the CUDA routing launch and `fp4moe explain` (which plans for a GPU
 * that need not be present) decide the same way. */
#ifndef FM_ROUTE_SHAPE_H
#define FM_ROUTE_SHAPE_H
#ifdef __cplusplus
extern "C" {
#endif

#define FM_LG_SMALL_T 32   /* the GEMV shape always takes up to this many tokens */
#define FM_LG_GEMV_MAX 128 /* and never more than this many                      */
#define FM_LG_TILE 64      /* tokens and experts per block of the tiled shape    */

/* K slices of the tiled shape: enough that its grid is about `depth` blocks
 * per SM, each slice a multiple of `step` and at least 128 wide, at most 32
 * slices. *ks slices of *kc. */
void fm_route_tile_split(int T, int H, int E, int sms, int depth, int step, int *ks, int *kc);
/* Blocks of the tiled shape's grid at T tokens (its tensor-core kernels). */
long fm_route_tile_blocks(int T, int H, int E, int sms);
/* 1 when the logits of T tokens take the GEMV shape: up to FM_LG_SMALL_T
 * tokens always, up to FM_LG_GEMV_MAX where the tiled grid would have fewer
 * blocks than a third of the SMs (the GEMV's blocks then outnumber the
 * tiles'). */
int fm_route_logits_gemv(int T, int H, int E, int sms);
/* Shared memory of one token's selection over E experts (route_pick.cuh):
 * the logits, the selection and weight scores (E floats each, E rounded up
 * to 4) and E group flags, rounded up to 16 bytes. */
#define FM_SEL_WARP_BYTES(E) (((size_t)(((E) + 3) & ~3) * 13 + 15) & ~(size_t)15)

#ifdef __cplusplus
}
#endif
#endif
