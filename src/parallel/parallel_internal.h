/* Internals of the tensor- / expert-parallel module (not public API). */
#ifndef FM_PARALLEL_INTERNAL_H
#define FM_PARALLEL_INTERNAL_H
#include "fp4moe.h"

/* ------------------------------------------------------------ transport */

/* One transport behind fm_comm. Every op receives arrays indexed by local
 * rank; the generic layer (comm.c) validates arguments and keeps stats. */
typedef struct fm_comm_ops {
    const char *name;
    fm_status (*all_reduce_sum)(fm_comm *c, float *const *buf, size_t count);
    fm_status (*reduce_scatter_sum)(fm_comm *c, const float *const *send, float *const *recv, size_t count);
    fm_status (*all_gather)(fm_comm *c, const void *const *send, void *const *recv, size_t bytes);
    fm_status (*all_to_allv)(fm_comm *c, const void *const *send, const size_t *const *send_bytes,
                             void *const *recv, const size_t *const *recv_bytes);
    void (*destroy)(fm_comm *c);
    /* Optional: median time of an all-reduce of count floats on buffers that
     * stay on the device (no host staging), for bench. */
    fm_status (*time_all_reduce)(fm_comm *c, size_t count, int reps, double *us);
} fm_comm_ops;

struct fm_comm {
    const fm_comm_ops *ops;
    int size;           /* R                                    */
    int n_local;        /* ranks driven by this process         */
    int *local_rank;    /* [n_local] global ranks               */
    int *device;        /* [n_local] GPU, -1 for CPU            */
    fm_comm_stats stats;
    char desc[160];
    void *impl;         /* transport state                      */
};

/* Allocates the common part with local ranks first..first+n_local-1. */
fm_status fm_comm_alloc(const fm_comm_ops *ops, int size, int first, int n_local, fm_comm **out);

/* --------------------------------------------------------------- engine */

/* What the sharding code needs from an engine: the normal forward of a
 * (view) layer, its pre-routed experts, routing alone, and a way to
 * prepare (upload) a view once. The CPU and CUDA engines provide it
 * (exec.c); tests plug their own. */
typedef struct fm_dist_exec {
    const char *name;
    void *ctx;
    /* Called once per view layer and local rank; *handle goes to forward. */
    fm_status (*prepare)(void *ctx, int local, const fm_model_desc *d, const fm_moe_layer *view, void **handle);
    void (*release)(void *ctx, int local, void *handle);
    fm_status (*forward)(void *ctx, int local, void *handle, const fm_model_desc *d, const fm_moe_layer *view,
                         const void *x, fm_dtype xdt, int T, const int32_t *token_ids, fm_moe_out *o);
    fm_status (*route)(void *ctx, int local, const fm_model_desc *d, const fm_moe_layer *l, const float *x, int T,
                       const int32_t *token_ids, int32_t *ids, float *weights);
    /* The view's experts on routed tokens (fm_cpu_experts): x F32 [T, H],
     * ids / weights [T, view->topk] with ids local to the view (in [0,
     * view->n_experts), -1: none), the view's shared expert on every token
     * when include_shared; writes out F32 [T, H]. T >= 1. */
    fm_status (*experts)(void *ctx, int local, void *handle, const fm_model_desc *d, const fm_moe_layer *view,
                         const float *x, int T, const int32_t *ids, const float *weights, int include_shared,
                         float *out);
    void (*destroy)(void *ctx);
    /* Optional: device time of one prepared view at batch T (median over
     * reps, e.g. CUDA-graph replay), for bench. view is the layer handle was
     * prepared from (to place more copies so caches do not flatter). */
    fm_status (*bench)(void *ctx, int local, void *handle, const fm_model_desc *d, const fm_moe_layer *view, int T,
                       uint64_t seed, int reps, double *us);
} fm_dist_exec;

/* A rank's views and their prepared engine handles. */
typedef struct {
    int rank;
    /* TP: the slice (forward when tokens are replicated, experts when the
     * token owners route) */
    fm_model_desc dtp;
    fm_moe_layer ltp;
    fm_qmatrix *arrays;
    void *htp;
    /* EP: the rank's experts as one layer (experts), the shared expert as
     * a one-expert view (forward on the rank's own tokens) */
    int e0, ne;
    fm_model_desc dep;
    fm_moe_layer lep;
    void *hep;
    fm_moe_layer lsh;
    void *hsh;
} rank_state;

struct fm_dist {
    const fm_model_desc *d;
    const fm_moe_layer *l;
    fm_dist_opts o;
    fm_comm *c;
    fm_dist_exec ex;
    int R, nloc;
    rank_state *rs;
    float *zero_router;
    fm_model_desc dsh; /* desc of the shared expert's view */
    void *hfull;
    int hfull_ready;
    char desc[320];
};

/* Takes ownership of exec (its destroy runs in fm_dist_free, also on failure). */
fm_status fm_dist_new_exec(const fm_model_desc *d, const fm_moe_layer *l, const fm_dist_opts *o, fm_comm *c,
                           fm_dist_exec exec, fm_dist **out);
/* Runs the unsharded layer through the same engine (bench baseline). */
fm_status fm_dist_forward_single(fm_dist *ds, const void *x, fm_dtype xdt, int T, const int32_t *token_ids,
                                 fm_moe_out *o);

fm_status fm_dist_exec_cpu(fm_cpu_engine *e, fm_dist_exec *out);
fm_status fm_dist_exec_cuda(const fm_comm *c, fm_dist_exec *out);

/* ---------------------------------------------------------------- views */

/* The TP slice of rank r of R: desc with moe_inter/shared_inter divided,
 * layer whose expert matrices are zero-copy views. gate/up/down arrays are
 * allocated into *arrays (free() it). The down bias stays only on rank 0,
 * since the partial outputs are summed. */
fm_status fm_dist_tp_view(const fm_model_desc *d, const fm_moe_layer *l, int r, int R, fm_model_desc *dv,
                          fm_moe_layer *lv, fm_qmatrix **arrays);
/* Experts [e0, e0+ne) of a layer as a layer of ne experts (zero-copy: the
 * matrices are the layer's), top-k min(k, ne) so that it is a valid layer
 * for every engine; no shared expert. It is meant for the experts call:
 * zero_router (ne*H zero floats, outliving the view) only satisfies
 * engines that want a router at upload. */
void fm_dist_ep_view(const fm_model_desc *d, const fm_moe_layer *l, int e0, int ne, const float *zero_router,
                     fm_model_desc *dv, fm_moe_layer *lv);
/* A one-expert layer of expert e (or the shared expert when e < 0): routing
 * sends every token to it with weight exactly 1 (softmax over one expert),
 * so the engine's normal forward computes exactly that expert. zero_router
 * must hold H zero floats and outlive the view. */
void fm_dist_expert_view(const fm_model_desc *d, const fm_moe_layer *l, int e, const float *zero_router,
                         fm_model_desc *dv, fm_moe_layer *lv);

/* EP: rank sh's experts of l (d its description) as one layer, with the
 * whole shared expert (the rank runs it on its token chunk). zero_router:
 * (E/R)*H zero floats that outlive the view. */
void fm_shard_ep_view(const fm_model_desc *d, const fm_moe_layer *l, const fm_shard *sh, const float *zero_router,
                      fm_model_desc *dv, fm_moe_layer *lv);
/* What an EP rank's CPU call needs for up to T tokens besides its layer:
 * the view's zero router, local ids / weights [T][kl], and for the shared
 * expert on the rank's chunk (C = ceil(T/R) tokens) ids of no routed expert
 * [C][kl] and its output rows [C][H]. */
typedef struct {
    int T, kl;
    float *zero_router;
    int32_t *lids;
    float *lw;
    int32_t *none;
    float *w0, *y;
} fm_shard_ep_work;
fm_status fm_shard_ep_work_init(fm_shard_ep_work *w, const fm_model_desc *d, const fm_shard *sh, int T);
void fm_shard_ep_work_free(fm_shard_ep_work *w);
/* EP rank sh's share of layer l already routed: fm_cpu_experts on its
 * experts with the pairs lids / lw [T][kl] (fm_shard_local_ids), then the
 * shared expert on its token chunk, added into those rows of out [T, H]. */
fm_status fm_shard_ep_run_cpu(fm_cpu_engine *e, const fm_model_desc *d, const fm_moe_layer *l, const fm_shard *sh,
                              const float *x, int T, const int32_t *lids, const float *lw, fm_shard_ep_work *w,
                              float *out);

/* ---------------------------------------------------------- compression */

/* Bytes of one encoded token row of H values. 0 if H is unsuitable. */
size_t fm_codec_row_bytes(fm_compress c, int H);
/* Encodes one row (H floats) into dst (fm_codec_row_bytes bytes). */
fm_status fm_codec_encode_row(fm_compress c, const float *x, int H, uint8_t *dst);
void fm_codec_decode_row(fm_compress c, const uint8_t *src, int H, float *x);

/* Median of v[n] (sorts v). */
double fm_dist_median(double *v, int n);

/* Row of x as F32 (x is F32 / BF16 / F16). */
fm_status fm_dist_row_f32(const void *x, fm_dtype xdt, int H, int64_t t, float *out);

#endif
