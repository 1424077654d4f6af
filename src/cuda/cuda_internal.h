/* Internal interface of the CUDA backend: the device-side layouts and
 * parameters the kernels (route_*.cu, expert_*.cu, layer.cu) share with the
 * host code (engine.cu), and the engine's and layers' state. */
#ifndef FM_CUDA_INTERNAL_H
#define FM_CUDA_INTERNAL_H
#include "fp4moe.h"
#include "cuda_env.h"
#include "fp4_bits.h" /* FM_HD, the NVFP4 scale bits */
#include "cfg_cache.h"
#include <cuda_runtime.h>
#include <stdint.h>

/* Checks a CUDA call; on failure records FM_E_CUDA with the call, file:line
 * and CUDA's message, and returns it from the enclosing function. */
#define FM_CU(call)                                                                  \
    do {                                                                             \
        cudaError_t fm_cu_err_ = (call);                                             \
        if (fm_cu_err_ != cudaSuccess)                                               \
            return fm_error(FM_E_CUDA, "%s failed at %s:%d: %s", #call, __FILE__,    \
                            __LINE__, cudaGetErrorString(fm_cu_err_));              \
    } while (0)
/* After a kernel launch: launch errors (bad configuration, no image for this
 * GPU) surface through cudaGetLastError. */
#define FM_CU_LAUNCH(what)                                                           \
    do {                                                                             \
        cudaError_t fm_le_ = cudaGetLastError();                                     \
        if (fm_le_ != cudaSuccess)                                                   \
            return fm_error(FM_E_CUDA, "launch of %s failed at %s:%d: %s", what,      \
                            __FILE__, __LINE__, cudaGetErrorString(fm_le_));        \
    } while (0)

/*
 * K (the input dimension) is padded to a multiple of FM_KSEG = 128 values;
 * padded weights are zero nibbles with zero scales. The rows of gate/up are
 * padded to a multiple of FM_KSEG too, so that the intermediate activation h
 * (the K of down) is written in full; down rows are padded to 16 (one MMA
 * tile): schedule.h, which `fp4moe explain` shares.
 *
 * On the GPU a matrix is stored in tiles of 16 rows x 128 K, the piece one
 * warp decodes per step, each tile contiguous and the tiles of a 16-row
 * group consecutive along K. So a warp streams one contiguous region (16
 * rows x K/2 bytes) from start to end, and each of its 16-byte loads is
 * part of a fully used 512-byte piece.
 *   packed tile (1024 bytes): half h (rows 8h .. 8h+7 of the group), lane
 *     l = 4g + t holds bytes [16t, 16t + 16) of the row's 64-byte piece:
 *     offset 512h + 16l.  Each 32-bit word holds the checkpoint's 8 nibbles
 *     of 8 consecutive k, bit-permuted by fm_fp4_enc_word (below).
 *   scale tile: spr = 8 (NVFP4) or 4 (MXFP4) scale bytes per row and tile,
 *     row r16 of the group at r16 * spr.
 */
#include "schedule.h"
#define FM_KSEG FM_SCHED_KSEG

/* Byte offset of byte b of row r's packed data in the tiled layout. */
static FM_HD inline int64_t fm_tile_packed_off(int64_t r, int64_t b, int nseg) {
    int64_t rg = r / 16, r16 = r % 16, s = b / 64, t = (b % 64) / 16;
    return (rg * nseg + s) * 1024 + (r16 / 8) * 512 + ((r16 % 8) * 4 + t) * 16 + b % 16;
}
/* Byte offset of block scale blk of row r. */
static FM_HD inline int64_t fm_tile_scale_off(int64_t r, int64_t blk, int nseg, int mx) {
    int spr = mx ? 4 : 8;
    return ((r / 16) * nseg + blk / spr) * (16 * spr) + (r % 16) * spr + blk % spr;
}

typedef struct {
    uint8_t *packed;   /* [n][rows_p * kp/2], tiled                          */
    uint8_t *scales;   /* [n][rows_p * kp/block], tiled                      */
    float *scale2;     /* [n] per-tensor scale (1 for MXFP4)                 */
    float *bias;       /* [n][rows_p] or NULL                                */
    int64_t pstride;   /* bytes between matrices in packed                   */
    int64_t sstride;   /* bytes between matrices in scales                   */
    int rows, rows_p, kp, n;
} fm_dmat;

/*
 * Storage of a 32-bit word of 8 nibbles n0..n7 (checkpoint order, low
 * nibble first), so that the kernel decodes the BF16x2 pairs (n0,n4),
 * (n1,n5), (n2,n6), (n3,n7), each E2M1 * 2^-126 (sign at bit 15, exponent and
 * mantissa at bits 6..8 of each half; mask M = 0x81C081C0), with 8 integer
 * instructions per word instead of 13:
 *   pair 0 = w & M, pair 1 = rotr(w, 3) & M, pair 2 = rotr(w, 6) & M,
 *   pair 3 = ((w & 0x001B001B) * 0x4108) & M.
 * A bit permutation: pairs 0..2 sit at the mask rotated by 0, 3, 6 bits, and
 * pair 3 fills the 8 bits left over (0, 1, 3, 4 of each half), placed so that
 * the three shifted copies of the multiply (3, 8, 14) neither overlap nor
 * carry. No layout places all four pairs with one shift + mask each (the
 * translates of the mask cannot tile 32 bits), hence the multiply.
 */
static FM_HD inline uint32_t fm_fp4_pair_bits(uint32_t w) { /* (n0, n4) at the BF16 bits */
    return ((w & 0x000F000Fu) * 0x1040u) & 0x81C081C0u;
}
static FM_HD inline uint32_t fm_fp4_enc_word(uint32_t w) {
    uint32_t p0 = fm_fp4_pair_bits(w), p1 = fm_fp4_pair_bits(w >> 4), p2 = fm_fp4_pair_bits(w >> 8),
             p3 = fm_fp4_pair_bits(w >> 12);
    return p0 | (p1 << 3 | p1 >> 29) | (p2 << 6 | p2 >> 26) | ((p3 & 0x00C000C0u) >> 3) | ((p3 & 0x01000100u) >> 8) |
           ((p3 & 0x80008000u) >> 14);
}

/* Routing parameters of one layer, by value into the routing kernel. */
typedef struct {
    int route;              /* fm_route_kind                                 */
    int E, k, H, Hp, T;
    int n_group, topk_group, norm_topk;
    float scaling;
    int hash;               /* 1: ids from tid2eid[token_id]                 */
    const float *router_w;  /* [E][H]                                        */
    const uint16_t *router_wb; /* [E][H] the same in BF16 when exact, or NULL */
    const float *router_bias, *score_bias;
    const int32_t *tid2eid; /* [tid_rows][k]                                 */
    int64_t tid_rows;
    const void *x;          /* [T][H] input, of type xdt                     */
    int xdt;                /* fm_dtype of x                                 */
    const int32_t *token_ids;
    float *logits;          /* [kslices][T][E] partial logits (workspace)    */
    int kslices;            /* K slices of the logits (set at launch)        */
    int sms;                /* SMs of the device (sizes the logits grid)     */
    /* outputs */
    int32_t *ids;           /* [T][k]                                        */
    float *wts;             /* [T][k]                                        */
    uint16_t *x_prep;       /* [T][Hp] BF16, x * 2^7, K-permuted             */
    float *out;             /* [T][H] zeroed here                            */
    /* sort outputs (last block) */
    int *n_active;          /* [1]                                           */
    int *act_e, *act_off, *act_cnt; /* [E]                                   */
    int *sorted_tok;        /* [T*k]                                         */
    float *sorted_w;        /* [T*k]                                         */
    unsigned *done;         /* [FM_ROUTE_COUNTERS] block counters, each reset
                             * by the block it elects, then [E] the grid-wide
                             * grouping's counts per expert (zero between
                             * layers)                                       */
    int *stat_active;       /* where to record n_active (bench) or NULL      */
    int early_trigger;      /* 2: the selection lets the expert kernels launch
                             * right after its wait on the logits (the shared
                             * expert on its own branch), 0: after selecting */
    unsigned *gu_done;      /* [E] gate/up warps done per expert, zeroed by
                             * the selection kernel, or NULL                 */
    const int32_t *pre_ids; /* pre-routed: [T][k] ids (< 0 or >= E: none)    */
    const float *pre_wts;   /* and weights; the logits are not computed      */
    void *blas;             /* the engine's cuBLAS handle, or NULL (blas.cu) */
} fm_route_params;

/* Expert kernels' parameters. */
typedef struct {
    fm_dmat gate, up, down;       /* routed experts                          */
    fm_dmat sgate, sup, sdown;    /* shared expert (n = 1) or n = 0          */
    int mx;                       /* MXFP4 (block 32, E8M0) else NVFP4        */
    int T, k, H, Hp;
    int act;                      /* fm_act_kind                             */
    float alpha, limit;
    int max_active;               /* grid rows reserved for routed experts   */
    /* The shared expert's work items come first in the grid: (row block,
     * token chunk), chunks of one row block adjacent so that they read the
     * same weights close together in time (from L2 after the first). Set by
     * the launch: tokens per chunk (one pass of the kernel's tile), chunks
     * per row block, and the number of shared items. */
    int sh_chunk, sh_chunks, sh_blocks;
    int sms;                      /* SMs of the device (sizes the down's K split) */
    int smem_optin;               /* the device's shared memory per block, opt-in */
    const int *n_active, *act_e, *act_off, *act_cnt, *sorted_tok;
    const float *sorted_w;
    const uint16_t *x_prep;       /* [T][Hp]                                 */
    uint16_t *h;                  /* [T*k + T][hstride]                      */
    int hstride;
    float *out;                   /* [T][H]                                  */
    /* The per-expert handoff (routed wgmma launches, few tokens): each
     * gate/up warp adds one to gu_done[e] once its h rows of expert e are
     * written, and down's blocks start on expert e when all of e's gate/up
     * warps have, instead of waiting for the whole gate/up grid (they still
     * wait for it before they exit). NULL: off. */
    unsigned *gu_done;
    /* The splitk path (expert_splitk.cu): gate/up's partial sums per K
     * chunk ([chunk][pair][2][sk_rstride] floats) and the row groups'
     * arrival counters (zero between calls: the last arrival resets). */
    float *sk_part;
    unsigned *sk_cnt;
    int sk_rstride;
} fm_expert_params;

typedef struct {
    int nt;         /* 8-token MMA tiles per pass (1, 2, 4; wgmma 8 too)      */
    int warps;      /* warps per block                                       */
    int ksplit;     /* warps splitting K (mma.sync)                          */
    int pdl;        /* programmatic dependent launch (sm_90)                 */
    int wgmma_path; /* the wgmma kernels (config path "wgmma", sm_90a)       */
    int splitk;     /* the split-K kernels (config path "splitk"); ksplit is
                     * then the number of K chunks of gate/up               */
    int fused;      /* splitk at one token: gate/up and down in one launch   */
} fm_launch_cfg;

/* An expert kernel: parameters, warps per block, K split. */
typedef void (*fm_expert_kfn)(fm_expert_params, int, int);

/* Block counters the routing kernels need (engine allocates, zeroed). */
#define FM_ROUTE_COUNTERS 8

#define FM_ROUTE_PART_LOGITS 1
#define FM_ROUTE_PART_SELECT 2
#define FM_ROUTE_PART_EXPERTS 4
#define FM_ROUTE_PARTS_ALL 7

#ifdef __cplusplus
extern "C" {
#endif
/* src/tune: nonzero (and the reason in why) for a config no tuned-config
 * file could hold. */
int fm_tune_config_invalid(const fm_kernel_config *c, char *why, size_t cap);
/* parts: FM_ROUTE_PART_* (the benchmark times the logits kernel alone). */
fm_status fm_cuda_launch_route(fm_route_params *p, size_t smem, int pdl, int parts, cudaStream_t s);
/* The two routing launches (route_logits.cu, route_select.cu). */
fm_status fm_cuda_launch_logits(fm_route_params *p, int pdl, cudaStream_t s);
fm_status fm_cuda_launch_select(const fm_route_params *p, size_t smem, int pdl, cudaStream_t s);
/* The pre-routed path's two launches: the tokens' prep, then their ids and
 * weights grouped by expert. */
fm_status fm_cuda_launch_prep(const fm_route_params *p, int pdl, cudaStream_t s);
fm_status fm_cuda_launch_preroute(const fm_route_params *p, size_t smem, int pdl, cudaStream_t s);
size_t fm_cuda_route_smem(int H, int E);
/* The router logits kernel the routing launch takes at T tokens, in words
 * (bf16_router: the layer has the exact BF16 router; xdt: fm_dtype of x;
 * blas: the engine has cuBLAS). */
const char *fm_cuda_route_logits_name(int T, int H, int E, int sms, int bf16_router, int xdt, int blas);
/* cuBLAS, loaded at run time (blas.cu): a handle with its own workspace, or
 * NULLs and the reason in note; the logits as one GEMM (BF16 x, BF16 router). */
void fm_cuda_blas_new(void **handle, void **ws, char *note, size_t cap);
void fm_cuda_blas_free(void *handle, void *ws);
fm_status fm_cuda_blas_logits(void *handle, const fm_route_params *p, cudaStream_t s);
/* Floats of the partial-logits workspace for up to T tokens (monotone). */
size_t fm_cuda_route_logit_floats(int T, int H, int E, int sms);
/* Row stride (floats) of the partial logits of E experts. */
int fm_cuda_route_logit_stride(int E);
fm_status fm_cuda_route_prepare(size_t smem);
fm_status fm_cuda_launch_gateup(const fm_expert_params *p, const fm_launch_cfg *c, cudaStream_t s);
fm_status fm_cuda_launch_down(const fm_expert_params *p, const fm_launch_cfg *c, cudaStream_t s);
/* Row chunks per block of that down launch on the wgmma path
 * (fm_sched_wg_down_chunks; 1 elsewhere). */
int fm_cuda_down_chunks(const fm_expert_params *p, const fm_launch_cfg *c);
/* Blocks (one cluster) over which that gate/up launch splits K on the wgmma
 * path (fm_sched_wg_ksplit; 1 elsewhere). */
int fm_cuda_gateup_ksplit(const fm_expert_params *p, const fm_launch_cfg *c);
/* The splitk path's two launches (gate/up in C K chunks, then down), routed
 * and shared experts together, at most 16 tokens (nt 1 or 2); fused: its
 * one-token launch instead (where fm_cuda_fused1_fits), which selects the
 * token's top-k itself where rp is given (the logits kernel launched
 * alone before it; fm_cuda_fused1_selects), else reads the selection
 * kernel's grouping. */
fm_status fm_cuda_launch_splitk(const fm_expert_params *p, int C, int nt, int fused, const fm_route_params *rp,
                                int pdl, cudaStream_t s);
/* 1 where the one-token launch can select the token's top-k itself: an
 * elementwise routing family without a hash table (its scratch, past the
 * launch's layout, is counted where fm_cuda_fused1_fits decides). */
int fm_cuda_fused1_selects(const fm_expert_params *p, const fm_route_params *rp);
/* 1 where the splitk path's one-token launch (gate/up and down in one grid,
 * a block per SM) takes the call p describes on a device of compute
 * capability cc (major * 10 + minor): the rule fm_sched_fused1_why, then
 * every block resident at once at the occupancy the device reports */
int fm_cuda_fused1_fits(const fm_expert_params *p, int cc);
/* Largest K of down (the experts' I, padded) the splitk path takes. */
#define FM_SPLITK_MAX_I 512
#define FM_SPLITK_MAX_C 16
const char *fm_cuda_kernel_names(const fm_launch_cfg *c, int mx, char *buf, size_t cap);
/* The expert kernels (expert_mma.cu, expert_wgmma.cu). kind: 1 gate/up,
 * 2 down in 128-row blocks; NULL for a shape that is not built. */
fm_expert_kfn fm_expert_mma_kernel(int nmat, int nt, int mx);
/* 1 when that launch reads its activations per K step */
int fm_expert_mma_xg(int nmat, int nt);
fm_expert_kfn fm_expert_wg_kernel_for(int kind, int mx, int nmax, int wgs);
size_t fm_expert_wg_smem(int nmat, int nmax, int down, int wgs);
/* 1 when this build's code for the current device has the wgmma kernels
 * (sm_90a); the first call runs a one-thread probe (engine creation, never
 * inside a stream capture), later calls return its answer. */
int fm_cuda_wgmma_built(void);
/* Streaming-read kernel for the bandwidth measurement; returns seconds. */
fm_status fm_cuda_stream_read(const void *buf, size_t bytes, cudaStream_t s, int reps, double *best_s);
fm_status fm_cuda_stream_read_for(const void *buf, size_t bytes, cudaStream_t s, double seconds, double *rate_Bps);
#ifdef __cplusplus
}
#endif

/* ---------------------------------------------- engine and layer state */
#ifdef __cplusplus
struct fm_cuda_engine {
    int device;
    char name[256];
    int sm_count, cc_major, cc_minor, rt_ver, drv_ver;
    int smem_optin; /* shared memory per block, opt-in (bytes) */
    char desc[320];
    cudaStream_t stream;
    cudaStream_t side;          /* the shared expert's branch (sh_fork) */
    cudaEvent_t fork_ev, join_ev;
    int forced;
    fm_kernel_config cfg;
    uint64_t cfg_gen;  /* bumped by fm_cuda_engine_set_config: the layers' config tables refill */
    fm_phase_times *pt;
    int shared_enabled;
    fm_sched sched;    /* the debugging switches (schedule.c, shared with `fp4moe explain`) */
    double sustain_ms; /* benchmarks: replays before the timed ones (fm_cuda_engine_set_sustain) */
    fm_dtype bench_xdt; /* benchmarks: the activations' type (fm_cuda_engine_set_bench_act) */
    int wgmma;         /* the wgmma kernels can run: sm_90 and built for sm_90a */
    void *blas, *blas_ws; /* cuBLAS handle for the router logits and its workspace, or NULL */
    char blas_note[200];  /* the cuBLAS loaded, or why none is used */
    /* workspace, sized for the largest call so far; calls on caller-owned
     * memory never grow it (fm_cuda_engine_reserve) */
    int ws_T, ws_H, ws_Hp, ws_E, ws_k, ws_hstride;
    void *x_raw;
    int32_t *tok_ids;
    uint16_t *x_prep;
    float *out;
    int32_t *ids;
    float *wts;
    float *logits;
    int *n_active, *act_e, *act_off, *act_cnt, *sorted_tok;
    float *sorted_w;
    unsigned *done;
    unsigned *gu_done; /* [E] gate/up warps done per expert (the handoff) */
    float *sk_part;    /* the splitk path's partial sums and counters     */
    unsigned *sk_cnt;
    size_t sk_part_n, sk_cnt_n;
    uint16_t *h;
    int *stats;
    int stats_n;
    size_t route_smem_ok;
};

struct fm_cuda_layer {
    fm_cuda_engine *eng;
    fm_model_desc d;
    int layer;
    fm_qformat fmt;
    int H, I, E, k, SI, has_shared;
    int Hp, Ip, SIp;
    fm_dmat gate, up, down, sgate, sup, sdown;
    float *router_w, *router_bias, *score_bias;
    uint16_t *router_wb; /* the router as BF16 when every weight is exact in BF16, else NULL */
    int32_t *tid2eid;
    int64_t tid_rows;
    int hash;
    int no_router; /* made from tensors without a router: only fm_cuda_experts runs */
    int64_t expert_bytes, shared_bytes;
    /* kernel configs of the calls on caller-owned memory by batch (engine.cu);
     * a cache that calls on a const layer fill, hence mutable */
    mutable fm_cfg_cache cc;
};

/* engine.cu: waits for the setup writes on the legacy default stream
 * (cudaMemset, and cudaMemcpy from pageable memory, whose DMA can outlive
 * the call), which the engine's non-blocking streams do not wait for. */
fm_status fm_cuda_settle(const char *what);
/* layer.cu: a layer's device matrices, allocated and zeroed (weights come
 * after), and its router tensors from the host. */
fm_status fm_cuda_layer_shell(fm_cuda_engine *e, const fm_model_desc *d, fm_qformat fmt, int layer, int with_bias,
                              fm_cuda_layer **out);
fm_status fm_cuda_layer_router(fm_cuda_layer *l, const float *w, const float *rbias, const float *sbias,
                               const int32_t *tid, int64_t tid_rows);
#endif
#endif
