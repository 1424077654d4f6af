/* Private declarations shared by the model-description, binding and gen
 * files of src/io (not public API). */
#ifndef FM_IO_MODEL_INT_H
#define FM_IO_MODEL_INT_H
#include "fp4moe.h"

/* "nvfp4" / "mxfp4" / "bf16" without depending on the formats module. */
static inline const char *fm__qformat_str(fm_qformat f) {
    return f == FM_QF_NVFP4 ? "nvfp4" : f == FM_QF_MXFP4 ? "mxfp4" : f == FM_QF_BF16 ? "bf16" : "none";
}



/* Allocation owned by a layer (freed by fm_moe_layer_free). NULL + message on failure. */
fm_moe_layer *fm__layer_new(const fm_model_desc *d, int layer, fm_qformat fmt);
void *fm__layer_alloc(fm_moe_layer *l, size_t n);

/* Random values of the non-matrix tensors (formulas in model_random.c). */
uint16_t fm__gen_router_w(uint64_t seed, int layer, int H, int64_t i); /* BF16 [E,H] */
float fm__gen_score_bias(uint64_t seed, int layer, int e);            /* F32  [E]   */
uint16_t fm__gen_router_bias(uint64_t seed, int layer, int e);        /* BF16 [E]   */
uint16_t fm__gen_expert_bias(uint64_t seed, int layer, int e, int m, int64_t r); /* BF16 */
/* One row of tid2eid: k distinct experts of E for token t. */
void fm__gen_tid2eid_row(uint64_t seed, int layer, int E, int k, int64_t t, int32_t *row);
/* Does layer L of d route by token id / carry a correction bias / biases? */
int fm__is_hash_layer(const fm_model_desc *d, int layer);
int fm__has_score_bias(const fm_model_desc *d, int layer);
int fm__has_expert_bias(const fm_model_desc *d);
/* The BF16 conversion the generator uses (RNE), kept here so the random layer
 * and the files agree without depending on the formats module. */
static inline uint16_t fm__f32_to_bf16(float x) {
    union { float f; uint32_t u; } v = {x};
    if ((v.u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((v.u >> 16) | 0x40);
    uint32_t r = 0x7FFFu + ((v.u >> 16) & 1u);
    return (uint16_t)((v.u + r) >> 16);
}
static inline float fm__bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}
#endif
