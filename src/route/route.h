/* Router pieces shared by fm_route and the CPU engine, which runs the logit
 * GEMV in parallel and then the per-token selection (internal API). */
#ifndef FM_ROUTE_H
#define FM_ROUTE_H
#include "fp4moe.h"

/* Checks that the description and the layer agree and that the routing
 * parameters are usable (k <= E, groups divide E, ...). */
fm_status fm_route_check(const fm_model_desc *d, const fm_moe_layer *l);

/* Logits of experts [e0, e1) for one token: x[H] . router_w[e]. FP32 with
 * eight fixed partial sums, so the result does not depend on how the caller
 * splits tokens or experts across threads. */
void fm_route_logits(const fm_moe_layer *l, const float *x, int e0, int e1, float *logits);

/* Floats of scratch fm_route_select needs for E experts. */
size_t fm_route_scratch_floats(int n_experts);

/* Selection and weights for token t from its logits[E]. token_id may be
 * NULL unless the layer routes by token id. Writes ids[k] ascending and
 * weights[k] in the same order. */
fm_status fm_route_select(const fm_model_desc *d, const fm_moe_layer *l, int t,
                          const float *logits, const int32_t *token_id, int32_t *ids,
                          float *weights, float *scratch);

/* 1 when this layer routes by token id (DeepSeek-V4 hash layers). */
int fm_route_is_hash_layer(const fm_model_desc *d, const fm_moe_layer *l);

#endif
