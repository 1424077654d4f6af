/* Internal interface of the CUDA backend: device-side layouts shared by the
 * kernels (route.cu, expert.cu, gen.cu) and the host code (engine.cu). */
#ifndef FM_CUDA_INTERNAL_H
#define FM_CUDA_INTERNAL_H
#include "fp4moe.h"
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
 * K (the input dimension) is padded to a multiple of FM_KSEG = 128 values so
 * that every warp step reads whole 64-byte row pieces with 16-byte loads;
 * padded weights are zero nibbles with zero scales. The rows of gate/up are
 * padded to a multiple of FM_KSEG too, so that the intermediate activation h
 * (the K of down) is written in full; down rows are padded to 16 (one MMA
 * tile). Packed and scale bytes otherwise keep the checkpoint's layout:
 * packed[row][k/2] (low nibble = even k), scales[row][k/block].
 */
#define FM_KSEG 128

typedef struct {
    uint8_t *packed;   /* [n][rows_p][kp/2]                                  */
    uint8_t *scales;   /* [n][rows_p][kp/block]                              */
    float *scale2;     /* [n] per-tensor scale (1 for MXFP4)                 */
    float *bias;       /* [n][rows_p] or NULL                                */
    int64_t pstride;   /* bytes between matrices in packed                   */
    int64_t sstride;   /* bytes between matrices in scales                   */
    int rows, rows_p, kp, n;
} fm_dmat;

/* Routing parameters of one layer, by value into the routing kernel. */
typedef struct {
    int route;              /* fm_route_kind                                 */
    int E, k, H, Hp, T;
    int n_group, topk_group, norm_topk;
    float scaling;
    int hash;               /* 1: ids from tid2eid[token_id]                 */
    const float *router_w;  /* [E][H]                                        */
    const float *router_bias, *score_bias;
    const int32_t *tid2eid; /* [tid_rows][k]                                 */
    int64_t tid_rows;
    const void *x;          /* [T][H] input (xdt) or NULL when x_f32 given   */
    int xdt;                /* fm_dtype of x                                 */
    const int32_t *token_ids;
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
    unsigned *done;         /* [1] block counter, reset by the last block    */
    int *stat_active;       /* where to record n_active (bench) or NULL      */
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
    const int *n_active, *act_e, *act_off, *act_cnt, *sorted_tok;
    const float *sorted_w;
    const uint16_t *x_prep;       /* [T][Hp]                                 */
    uint16_t *h;                  /* [T*k + T][hstride]                      */
    int hstride;
    float *out;                   /* [T][H]                                  */
} fm_expert_params;

typedef struct {
    int nt;      /* 8-token MMA tiles per pass (1, 2, 4)                     */
    int warps;   /* warps per block                                          */
    int ksplit;  /* warps splitting K                                        */
    int pdl;     /* programmatic dependent launch (sm_90)                    */
} fm_launch_cfg;

#ifdef __cplusplus
extern "C" {
#endif
fm_status fm_cuda_launch_route(const fm_route_params *p, size_t smem, int pdl, cudaStream_t s);
size_t fm_cuda_route_smem(int H, int E);
fm_status fm_cuda_route_prepare(size_t smem);
fm_status fm_cuda_launch_gateup(const fm_expert_params *p, const fm_launch_cfg *c, cudaStream_t s);
fm_status fm_cuda_launch_down(const fm_expert_params *p, const fm_launch_cfg *c, cudaStream_t s);
const char *fm_cuda_kernel_names(const fm_launch_cfg *c, int mx, char *buf, size_t cap);
/* Streaming-read kernel for the bandwidth measurement; returns seconds. */
fm_status fm_cuda_stream_read(const void *buf, size_t bytes, cudaStream_t s, int reps, double *best_s);
#ifdef __cplusplus
}
#endif
#endif
