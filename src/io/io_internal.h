/* Private declarations shared by the model-description, binding and gen
 * files of src/io (not public API). */
#ifndef FM_IO_INTERNAL_H
#define FM_IO_INTERNAL_H
#include "fp4moe.h"

/* "nvfp4" / "mxfp4" / "bf16" without depending on the formats module. */
static inline const char *fm_io_qformat_str(fm_qformat f) {
    return f == FM_QF_NVFP4 ? "nvfp4" : f == FM_QF_MXFP4 ? "mxfp4" : f == FM_QF_BF16 ? "bf16" : "none";
}



/* Problems found while checking tensors: checking goes on after one, the
 * first message is kept for the error, and every one goes to report when
 * it is set (fm_inspect lists them all). */
typedef void (*fm_io_problem_fn)(void *ud, const char *msg);
typedef struct {
    fm_io_problem_fn report;
    void *ud;
    int n;
    fm_status first;
    char first_msg[1024];
} fm_io_problems;
void fm_io_problem(fm_io_problems *p, fm_status s, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* "[a, b, c]" */
void fm_io_shape_str(char *buf, size_t cap, int ndim, const int64_t *shape);

/* Element i of a BF16 or F32 array as float (any alignment). */
float fm_io_load_f(const void *data, fm_dtype dt, int64_t i);
/* n floats from element off of a BF16 / F32 array, every stride-th, into
 * memory the layer owns. NULL + message on failure. */
float *fm_io_f32_copy(fm_moe_layer *l, const void *data, fm_dtype dt, int64_t n, int64_t off, int64_t stride);
/* gpt-oss fused experts on a contiguous tensor: m = 0 wires every expert's
 * gate and up to the even and odd rows of [E, R = 2I, K/32 x 16] blocks
 * (scales: the [E, R, K/32] E8M0 scales), m = 2 its down to [E, R = H, .].
 * Zero-copy: data must outlive the layer. */
void fm_io_wire_gptoss(fm_moe_layer *l, int m, int scales, const uint8_t *data, int64_t R, int64_t K);
/* Their biases, BF16 / F32 [E, R] (m = 0: rows interleaved like the
 * weights), as F32 copies owned by the layer. */
fm_status fm_io_wire_gptoss_bias(fm_moe_layer *l, int m, const void *data, fm_dtype dt, int64_t R);

/* Allocation owned by a layer (freed by fm_moe_layer_free). NULL + message on failure. */
fm_moe_layer *fm_io_layer_new(const fm_model_desc *d, int layer, fm_qformat fmt);
void *fm_io_layer_alloc(fm_moe_layer *l, size_t n);

/* Random values of the non-matrix tensors (formulas in model_random.c). */
uint16_t fm_io_gen_router_w(uint64_t seed, int layer, int H, int64_t i); /* BF16 [E,H] */
float fm_io_gen_score_bias(uint64_t seed, int layer, int e);            /* F32  [E]   */
uint16_t fm_io_gen_router_bias(uint64_t seed, int layer, int e);        /* BF16 [E]   */
uint16_t fm_io_gen_expert_bias(uint64_t seed, int layer, int e, int m, int64_t r); /* BF16 */
/* One row of tid2eid: k distinct experts of E for token t. */
void fm_io_gen_tid2eid_row(uint64_t seed, int layer, int E, int k, int64_t t, int32_t *row);
/* Does layer L of d route by token id / carry a correction bias / biases? */
int fm_io_is_hash_layer(const fm_model_desc *d, int layer);
int fm_io_has_score_bias(const fm_model_desc *d, int layer);
int fm_io_has_expert_bias(const fm_model_desc *d);
/* A layer holding only fm_moe_layer_random's router tensors (the experts'
 * matrices empty): the full routing of a shard whose experts live elsewhere. */
/* dst takes over what src owns (src is freed, its matrices stay valid):
 * a view layer that outlives the layer it views. On failure src is kept. */
fm_status fm_io_layer_adopt(fm_moe_layer *dst, fm_moe_layer *src);
fm_status fm_io_router_random(const fm_model_desc *d, fm_qformat fmt, uint64_t seed, int layer, fm_moe_layer **out);
/* The tensors of one MoE layer in a checkpoint layout: one list drives gen
 * (what to write), bind (what to check and wire) and inspect. */
typedef enum {
    FM_T_PACKED,       /* per-matrix E2M1 codes (U8 / I8) or BF16 weight      */
    FM_T_SCALES,       /* per-matrix block scales                             */
    FM_T_SCALE2,       /* NVFP4 weight_scale_2 F32 []                         */
    FM_T_INSCALE,      /* NVFP4 input_scale F32 [] (optional)                 */
    FM_T_EBIAS,        /* per-matrix bias BF16 [rows] (gpt-oss)               */
    FM_T_ROUTER_W,     /* router weight [E, H]                                */
    FM_T_SCORE_BIAS,   /* e_score_correction_bias / DeepSeek-V4 gate.bias [E] */
    FM_T_ROUTER_BIAS,  /* gpt-oss router logit bias [E]                       */
    FM_T_TID2EID,      /* hash routing table [vocab, k]                       */
    FM_T_FUSED_PACKED, /* gpt-oss *_blocks [E, R, K/32, 16] (m = 0 gate_up, 2 down) */
    FM_T_FUSED_SCALES, /* gpt-oss *_scales [E, R, K/32]                       */
    FM_T_FUSED_BIAS    /* gpt-oss *_bias BF16 [E, R]                          */
} fm_io_trole;

typedef struct {
    char name[160];
    fm_dtype dt;
    int ndim;
    int64_t shape[4];
    fm_io_trole role;
    int e, m;      /* expert (-1 shared), matrix 0 gate 1 up 2 down     */
    int64_t R, K;  /* logical matrix of the role (rows, inputs)         */
    int optional;
} fm_io_tspec;

/* Tensors of layer `layer` (a MoE layer of d) in d's layout; *out is
 * malloc'd (free()). Names sorted as they are written. */
fm_status fm_io_layer_plan(const fm_model_desc *d, int layer, fm_io_tspec **out, size_t *n);
/* Byte size of a tensor of the plan. */
uint64_t fm_io_tspec_bytes(const fm_io_tspec *t);

/* Binds layer L; with report != NULL every problem is passed to it (and
 * checking goes on) instead of stopping at the first. */
fm_status fm_io_layer_bind(fm_ckpt *c, const fm_model_desc *d, int layer, fm_qformat quantize_bf16,
                         fm_io_problem_fn report, void *ud, fm_moe_layer **out);

/* What fm_moe_layer_from_tensors checks of engine tensors, for the CUDA
 * engine's repack on the device (src/io/tensors.c): the views' shapes,
 * dtypes and strides (no data read), with the same messages. */
typedef struct {
    fm_qformat fmt;
    int blk;
    int64_t E, H, I, SI; /* SI: the shared expert's width, 0 without one */
    int has_shared, has_router;
} fm_io_tensors_info;
fm_status fm_io_tensors_info_get(const fm_model_desc *d, int layer, const fm_layer_tensors *t,
                                 fm_io_tensors_info *out);
/* The NVFP4 per-tensor scales from host copies of the *_scale_2 views
 * (s13: E or 2E floats as w13_weight_scale_2's shape says; s2: E; sh_raw:
 * the shared expert's three, when it has one), checked positive and finite
 * with the loader's messages: gate / up / down [E] and sh[3]. */
fm_status fm_io_tensors_scale2(const fm_model_desc *d, int layer, const fm_layer_tensors *t, const float *s13,
                               const float *s2, const float *sh_raw, float *gate, float *up, float *down, float *sh);

#endif
