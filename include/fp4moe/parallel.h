/* tensor / expert parallel; included by fp4moe.h (users include fp4moe.h). */
#ifndef FP4MOE_PARALLEL_H
#define FP4MOE_PARALLEL_H

#ifndef FP4MOE_H
#error "include fp4moe.h, not fp4moe/parallel.h"
#endif

/* ---------------------------------------------------- tensor / expert parallel (src/parallel) */
/* @section dist begin */
/*
 * Tensor parallel (TP): rank r holds rows [r*I/R, (r+1)*I/R) of every
 * expert's gate/up and the same columns of down (zero-copy views); the
 * partial outputs are summed. Expert parallel (EP): rank r holds experts
 * [r*E/R, (r+1)*E/R); routing runs over all E on every rank and each rank
 * computes only the (token, expert) pairs it owns. Shared experts: TP-sliced
 * under TP; under EP replicated and computed data-parallel (each rank for its
 * own token chunk). The same sharding and combine code runs over a simulated
 * in-process communicator (CI) and over NCCL. See docs/parallel.md.
 */
#define FM_DIST_MAX_RANKS 256

typedef enum { FM_DIST_TP = 1, FM_DIST_EP = 2 } fm_dist_mode;
typedef enum {
    FM_DIST_REPLICATED = 0,   /* every rank holds all T tokens (TP attention);
                                 outputs are all-reduced                     */
    FM_DIST_TOKEN_SHARDED = 1 /* rank r holds token chunk r (DP attention):
                                 TP all-gathers the inputs and reduce-scatters
                                 the outputs; EP dispatches tokens to expert
                                 owners (all-to-all) and combines back       */
} fm_dist_layout;
/* Activations as sent in the all-gather / dispatch. */
typedef enum {
    FM_COMPRESS_NONE = 0, /* F32                                             */
    FM_COMPRESS_FP8,      /* E4M3 + one FP32 scale per token                 */
    FM_COMPRESS_NVFP4     /* E2M1, E4M3 scale per 16, FP32 scale per token   */
} fm_compress;
const char *fm_dist_mode_name(fm_dist_mode m);       /* "tp", "ep"          */
const char *fm_dist_layout_name(fm_dist_layout l);   /* "replicated", "token-sharded" */
const char *fm_compress_name(fm_compress c);         /* "none", "fp8", "nvfp4" */
/* Return 0 and set *out, or -1 for an unknown name. */
int fm_dist_layout_from_name(const char *s, fm_dist_layout *out);
int fm_compress_from_name(const char *s, fm_compress *out);

typedef struct fm_dist_opts { /* tagged: other sections may forward-declare it */
    fm_dist_mode mode;
    int ranks;             /* R, 1..FM_DIST_MAX_RANKS                         */
    fm_dist_layout layout;
    fm_compress compress;  /* needs FM_DIST_TOKEN_SHARDED (else nothing is sent) */
} fm_dist_opts;

/* Checks that a layer can be split so: I (and the shared width) divisible by
 * R into multiples of the format block (TP), E divisible by R (EP), H a
 * multiple of 16 for NVFP4 compression. The message names the numbers. */
fm_status fm_dist_check(const fm_model_desc *d, const fm_moe_layer *l,
                        const fm_dist_opts *o);

/* A communicator over R ranks. A process drives one or more "local" ranks;
 * every collective takes one host buffer per local rank (arrays indexed by
 * local rank) and returns when all of them are done. */
typedef struct fm_comm fm_comm;
/* R simulated ranks in this process (memory copies; CI and --device cpu). */
fm_status fm_comm_sim_new(int n_ranks, fm_comm **out);
/* One process driving GPUs 0..n-1 through NCCL (ncclCommInitAll). NCCL is
 * loaded at run time: $FM_NCCL_LIB, else libnccl.so.2 on the loader path. */
fm_status fm_comm_nccl_new(int n_gpus, fm_comm **out);
/* One process per GPU across hosts: MPI_COMM_WORLD ranks, the NCCL unique id
 * broadcast over MPI. Built only with -DFM_MPI=ON (else FM_E_UNSUPPORTED). */
fm_status fm_comm_nccl_new_mpi(fm_comm **out);
void fm_comm_free(fm_comm *c);
int fm_comm_size(const fm_comm *c);                /* R                      */
int fm_comm_local_count(const fm_comm *c);         /* ranks in this process  */
int fm_comm_local_rank(const fm_comm *c, int i);   /* global rank of local i */
int fm_comm_device(const fm_comm *c, int i);       /* GPU of local i, -1 CPU */
const char *fm_comm_describe(const fm_comm *c);

/* buf[i]: count floats, summed over all ranks in place. */
fm_status fm_comm_all_reduce_sum(fm_comm *c, float *const *buf, size_t count);
/* send[i]: R*count floats; recv[i] gets the sum of block (rank of i). */
fm_status fm_comm_reduce_scatter_sum(fm_comm *c, const float *const *send,
                                     float *const *recv, size_t count);
/* send[i]: bytes; recv[i]: R*bytes, block r from rank r. */
fm_status fm_comm_all_gather(fm_comm *c, const void *const *send,
                             void *const *recv, size_t bytes);
/* Variable all-to-all. send_bytes[i][p] bytes go from local i to rank p,
 * packed in p order in send[i]; recv_bytes[i][p] bytes arrive from rank p,
 * packed in p order in recv[i] (the caller learns them first, e.g. by an
 * all-to-all of counts). */
fm_status fm_comm_all_to_allv(fm_comm *c, const void *const *send,
                              const size_t *const *send_bytes,
                              void *const *recv,
                              const size_t *const *recv_bytes);

typedef struct {
    double ns;       /* wall time inside collectives                          */
    int64_t bytes;   /* payload bytes handed to collectives by local rank 0   */
    int64_t calls;
} fm_comm_stats;
void fm_comm_get_stats(const fm_comm *c, fm_comm_stats *s);
void fm_comm_reset_stats(fm_comm *c);

/* A sharded MoE layer bound to a communicator and an engine. The model
 * description and the layer are borrowed and must outlive it. */
typedef struct fm_dist fm_dist;
/* Ranks computed by the CPU engine (sequentially, one after another). */
fm_status fm_dist_new_cpu(const fm_model_desc *d, const fm_moe_layer *l,
                          const fm_dist_opts *o, fm_comm *c, fm_cpu_engine *e,
                          fm_dist **out);
/* Ranks computed by the CUDA engine on each local rank's GPU. */
fm_status fm_dist_new_cuda(const fm_model_desc *d, const fm_moe_layer *l,
                           const fm_dist_opts *o, fm_comm *c, fm_dist **out);
void fm_dist_free(fm_dist *ds);
const char *fm_dist_describe(const fm_dist *ds);

typedef struct {
    int ranks;
    int64_t pairs[FM_DIST_MAX_RANKS];  /* (token, routed expert) pairs computed */
    int active[FM_DIST_MAX_RANKS];     /* routed experts with >= 1 token        */
    double load_imbalance;             /* max pairs / mean pairs (1 = even)     */
    double compute_ns[FM_DIST_MAX_RANKS]; /* local ranks only (0 elsewhere)     */
    double comm_ns;                    /* time inside collectives               */
    int64_t comm_bytes;                /* payload bytes sent by one rank        */
    int64_t act_bytes;                 /* of which activations (all-gather or
                                          dispatch) sent by local rank 0        */
} fm_dist_stats;

/*
 * One MoE block over the sharded layer. x [T, H] (F32/BF16/F16) holds all T
 * tokens; under FM_DIST_TOKEN_SHARDED rank r reads only its chunk (tokens
 * [r*C, (r+1)*C), C = ceil(T/R)). o->out gets the rows of the tokens that
 * the local ranks own (all rows when every rank is local or the layout is
 * replicated). topk ids/weights (may be NULL) equal the unsharded layer's;
 * they are filled for every token, except under EP token-sharded where
 * only the local ranks' chunks are known. st may be NULL.
 */
fm_status fm_dist_forward(fm_dist *ds, const void *x, fm_dtype xdt, int T,
                          const int32_t *token_ids, fm_moe_out *o,
                          fm_dist_stats *st);

typedef struct {
    int T, ranks, reps;
    double us_total;      /* per layer: slowest rank's compute + comm (median) */
    double us_rank[FM_DIST_MAX_RANKS]; /* compute per local rank (median)   */
    double us_comm;       /* median time inside collectives                    */
    double us_single;     /* the unsharded layer on one device (median)        */
    double speedup;       /* us_single / us_total                              */
    double efficiency;    /* speedup / ranks                                   */
    double load_imbalance;/* mean over the timed steps                         */
    int64_t comm_bytes;   /* per step                                          */
    char transport[160];
    char method[160];     /* how the times were taken                          */
} fm_dist_bench_result;
/* Opens the transport for dev (simulated ranks for FM_DEV_CPU; NCCL over
 * o->ranks GPUs of this process, or one GPU per MPI process when mpi is set,
 * for FM_DEV_CUDA) and the sharded layer on it (cpu: the engine of
 * FM_DEV_CPU). Free with fm_dist_free, then fm_comm_free. */
fm_status fm_dist_open(const fm_dist_opts *o, fm_device dev, int mpi, fm_cpu_engine *cpu, const fm_model_desc *d,
                       const fm_moe_layer *l, fm_comm **comm, fm_dist **out);
/* fm_dist_open + fm_dist_forward + free: one sharded MoE block, e.g. in
 * place of fm_cpu_forward / fm_cuda_forward in `forward`. */
fm_status fm_dist_run(const fm_dist_opts *o, fm_device dev, int mpi, fm_cpu_engine *cpu, const fm_model_desc *d,
                      const fm_moe_layer *l, const void *x, fm_dtype xdt, int T, const int32_t *token_ids,
                      fm_moe_out *out, fm_dist_stats *st);

/* One rank's share of the layer, run on one device (`--shard`): what rank
 * `rank` of a `ranks`-way split computes. TP: the I/R slice of every expert
 * (and of the shared expert) with the full router. EP: experts
 * [rank*E/R, (rank+1)*E/R) on the pairs the full routing sends to them
 * (pre-routed call), the shared expert on the rank's token chunk (as the
 * sharded layer places it: replicated, data-parallel). */
typedef struct fm_shard { /* tagged: tune.h's explain options point to it */
    fm_dist_mode mode;  /* 0: no shard                                      */
    int ranks, rank;
} fm_shard;
/* "tp:R", "tp:R/r" (r defaults to 0) or "ep:R/r" (r required); 0 <= r < R
 * <= FM_DIST_MAX_RANKS. FM_E_ARG naming the problem. */
fm_status fm_shard_parse(const char *s, fm_shard *out);
/* Checks that the model splits so (fm_dist_check's rules: R divides I into
 * multiples of fmt's block, and the shared width, for TP; R divides E for
 * EP) and writes the rank's shape into *out: TP moe_inter I/R and
 * shared_inter SI/R; EP n_experts E/R, topk min(k, E/R), the whole shared
 * expert (replicated; the rank runs it on its token chunk only), routing
 * fields of a plain softmax (the rank is pre-routed by the full router).
 * fmt FM_QF_NONE: the model's own. */
fm_status fm_shard_desc(const fm_model_desc *d, fm_qformat fmt, const fm_shard *sh, fm_model_desc *out);
/* "tp 8 rank 0 (I 256 of 2048)" / "ep 8 rank 3 (experts 96..127 of 256)". */
void fm_shard_describe(const fm_shard *sh, const fm_model_desc *full, char *buf, size_t cap);
/* EP: tokens [t0, t0+n) of the rank's chunk of T (C = ceil(T/R)), the
 * tokens whose shared expert the rank computes. */
void fm_shard_token_chunk(const fm_shard *sh, int T, int *t0, int *n);

/* TP: the slice of rank sh of the whole layer *full (d its description)
 * as a layer of its own, freed by fm_moe_layer_free; it takes *full over
 * (zero-copy: the matrices are full's; *full is NULL afterwards). dv (may
 * be NULL) receives the slice's description. */
fm_status fm_shard_tp_layer(const fm_model_desc *d, fm_moe_layer **full, const fm_shard *sh, fm_model_desc *dv,
                            fm_moe_layer **out);
/* What each rank of the split does in one step of a routing: (token,
 * routed expert) pairs, routed experts with >= 1 token, and the weight bytes
 * it reads (its active experts -- TP: their slices -- plus the shared
 * expert as placed: TP its slice, EP whole on ranks with a non-empty token
 * chunk). The router ([E, H] F32 on the CPU path, read by every rank:
 * routing is replicated) is not in bytes; router_bytes says how much it is.
 * max_rank: the most loaded rank (most bytes, then most pairs, then the
 * lowest index), the one the step waits for. */
typedef struct {
    int ranks, max_rank;
    int64_t pairs[FM_DIST_MAX_RANKS];
    int active[FM_DIST_MAX_RANKS];
    int64_t bytes[FM_DIST_MAX_RANKS];
    int64_t router_bytes;
} fm_shard_load;
/* ids [T][k] of the full routing (k = full->topk; ids < 0 ignored). */
fm_status fm_shard_load_of(const fm_model_desc *full, fm_qformat fmt, const fm_shard *sh, const int32_t *ids, int T,
                           fm_shard_load *out);
/* Adds ld's pairs, active experts and bytes to sum (zeroed before the
 * first; the loads of several layers or steps) and sets sum's max_rank by
 * the same rule over the sums. */
void fm_shard_load_add(fm_shard_load *sum, const fm_shard_load *ld);
/* Rank sh's output of the whole layer l (d its description) through the
 * CPU engine: its partial sum, so that the R ranks' outputs add up to the
 * layer's. TP: fm_cpu_forward of the slice (fm_dist_tp_view). EP: the full
 * routing (fm_route), then fm_cpu_experts on the rank's experts with the
 * pairs they own, plus the shared expert on the rank's token chunk. out
 * F32 [T, H]; ids / weights [T][k] (may be NULL) receive the full routing;
 * load (may be NULL) that routing's fm_shard_load_of. */
fm_status fm_shard_forward_cpu(fm_cpu_engine *e, const fm_model_desc *d, const fm_moe_layer *l, const fm_shard *sh,
                               const void *x, fm_dtype xdt, int T, const int32_t *token_ids, float *out,
                               int32_t *ids, float *weights, fm_shard_load *load);
/* EP: ids [T][k] of the full routing (and weights) to the rank's view of
 * kl = min(k, E/R) slots: its experts' ids made local (id - r*E/R), packed
 * to the front of each row, the rest -1 with weight 0. Returns the pairs. */
int64_t fm_shard_local_ids(const fm_shard *sh, int E, int k, int T, const int32_t *ids, const float *w,
                           int kl, int32_t *lids, float *lw);

/* The rank's share of fm_cuda_layer_random's layer (d is the full model),
 * generated on the GPU with the full layer's values: TP the slice with the
 * full router; EP the rank's experts without a router (fm_cuda_experts
 * runs it, with ids local to the rank). */
fm_status fm_cuda_layer_random_shard(fm_cuda_engine *e, const fm_model_desc *d, fm_qformat fmt, uint64_t seed,
                                     int layer, const fm_shard *sh, fm_cuda_layer **out);

/* An EP rank's step on the GPU, timed: per layer the pre-routed experts
 * call (fm_cuda_experts) on x [T, H] F32 with ids / w [n_layers][T][k]
 * local to the rank (fm_shard_local_ids), then the shared expert alone on
 * tokens [t0, t0+n_chunk), in one CUDA graph; median, min and max us per
 * layer over reps replays after three warm-up replays. Host buffers in. */
fm_status fm_cuda_bench_ep_rank(fm_cuda_engine *e, fm_cuda_layer *const *layers, int n_layers, int T,
                                const float *x, const int32_t *ids, const float *w, int t0, int n_chunk, int reps,
                                double *us_med, double *us_min, double *us_max);

/* reps steps at batch T with seeded random activations. */
fm_status fm_dist_bench(fm_dist *ds, int T, uint64_t seed, int reps,
                        fm_dist_bench_result *r);
/* @section dist end */

#endif /* FP4MOE_PARALLEL_H */
