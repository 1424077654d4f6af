/* The layer schedule's decisions (src/cuda/schedule.c): plain C, so that the
 * CUDA engine and `fp4moe explain` (which plans for a GPU that need not be
 * present) decide the same way. */
#ifndef FM_SCHEDULE_H
#define FM_SCHEDULE_H
#include "route_shape.h"
#ifdef __cplusplus
extern "C" {
#endif

/* How the engine pads a layer's matrices (layer.cu), which the grids below
 * count: K and gate/up's rows to FM_SCHED_KSEG (so that h, down's K, is
 * written in full), down's rows to FM_SCHED_DOWN_ROWS (one MMA tile). */
#define FM_SCHED_KSEG 128
#define FM_SCHED_DOWN_ROWS 16
static inline int fm_sched_pad(int n, int mult) { return (n + mult - 1) / mult * mult; }

/* The routed down takes over per expert up to this many tokens: beyond it
 * the gate/up grid is many waves and its tail no longer weighs. */
#define FM_HANDOFF_MAX_T 32

/* The two debugging switches of the CUDA engine (docs/tuning.md). */
typedef struct {
    int pdl;     /* programmatic dependent launch (sm_90 and later; FP4MOE_CUDA_PDL=0: off) */
    int sh_fork; /* the shared expert's launches on a stream of their own (FP4MOE_CUDA_SH_FORK=0: off) */
} fm_sched;

/* The switches as set in the environment, for a device of compute
 * capability major cc_major. */
void fm_sched_read(fm_sched *s, int cc_major);
/* 8-token tiles per pass of the shared expert's own launches (on its
 * stream), from the routed launches' nt and warps on the wgmma path. */
int fm_sched_shared_nt(const fm_sched *s, int wgmma, int nt, int warps, int T);
/* 1 when the routed down takes over per expert at T tokens. */
int fm_sched_handoff(const fm_sched *s, int wgmma, int T);
/* Where the selection kernel lets the expert kernels launch: 0 after
 * selecting, 2 right after its wait on the logits (fork: the shared expert
 * runs on its own stream, so the routed blocks must take the SMs first). */
int fm_sched_trigger(const fm_sched *s, int fork);
/* 1 when each token's selection sums and scores spread over its share of
 * the selection block's warps: elementwise scoring families (noaux_tc,
 * DeepSeek-V4), T <= 2. */
int fm_sched_sel_spread(const fm_sched *s, int elementwise, int T, int k);

/* The work items of one wgmma launch: max_active x the row blocks of rows_p
 * rows (rpb each), plus the shared expert's (srows_p rows, 0: none in this
 * launch) row blocks x *sh_chunks chunks of `chunk` tokens of T
 * (*sh_blocks of them). The engine's grid and `explain` count them alike. */
long long fm_sched_wg_items(int max_active, int rows_p, int srows_p, int rpb, int T, int chunk, int *sh_chunks,
                            long long *sh_blocks);
/* The wgmma kernels' K split: 4, 3 or 2 (each (row block, pass) item becomes
 * that many blocks over a part of K each) or 1. Gate/up splits in 4 where
 * each quarter keeps 8 segments or more and 4 x blocks <= 3 x sms (a TP
 * rank's grid at B = 2 - 4), else in 3 where each third keeps 8 segments
 * or more and blocks <= sms. Else each half keeps at least
 * FM_WG_KS_MIN_SEG_GU / 2 segments of K (gate/up, which also pays its
 * cluster's reduction) or FM_WG_KS_MIN_SEG_DOWN / 2 (down); then the grid
 * splits where it is under 5 blocks per SM (about one wave of 4 resident
 * blocks and a short tail), or where splitting raises the fill of its last
 * wave of resident blocks (per_sm x sms slots; per_sm <= 0: unknown, no such
 * split) by 0.15 or more. The fill counts the blocks of the experts that
 * uniform routing of T tokens to k of E would activate (an inactive expert's
 * blocks exit at once; at most max_active), rows_p / rpb row blocks each,
 * plus the shared expert's sh_blocks. blocks: the grid without the split. */
#define FM_WG_KS_MIN_SEG_GU 20
#define FM_WG_KS_MIN_SEG_DOWN 16
int fm_sched_wg_ksplit(int gu, long long blocks, long long sh_blocks, int rows_p, int rpb, int nseg, int E, int k,
                       int T, int max_active, int sms, int per_sm);
/* Down's row chunks per wgmma block: 1, or a power of two up to
 * FM_WG_DOWN_CHUNKS_MAX, at most FM_WG_DOWN_CHUNK_SEGS / nseg, and no more
 * than keep the grid of the expected blocks (as the K split counts them,
 * rows_p / rpb per active expert, plus sh_blocks) at half a wave of
 * per_sm x sms resident blocks or more. A block walks its chunks' segments as one
 * stream, so where K is a few segments (a TP rank's down) the next chunk's
 * weights load while a chunk's MMAs end and its output goes out. rows_p
 * must be whole chunks (else 1). */
#define FM_WG_DOWN_CHUNK_SEGS 8
#define FM_WG_DOWN_CHUNKS_MAX 8
/* the most chunks that rule gives for these rows and K, whatever the grid */
int fm_sched_wg_down_chunks_max(int rows_p, int rpb, int nseg);
int fm_sched_wg_down_chunks(long long sh_blocks, int rows_p, int rpb, int nseg, int E, int k, int T, int max_active,
                            int sms, int per_sm);
/* blocks / slots over its ceiling: how full the last of the waves is */
double fm_sched_wave_fill(double blocks, double slots);

/* The splitk path's grids (expert_splitk.cu). Gate/up: blocks of
 * FM_SPLITK_WARPS warps, a warp per (row group of 16, K chunk): the shared
 * expert's sgate_rows_p / 16 x C units (whole blocks), then max_active x
 * gate_rows_p / 16 x C; FM_SPLITK_PER_SM blocks per SM. Down: one block per
 * 16 of down_rows_p output rows, 3 per SM (a build bounded to 80 registers)
 * where 2 per SM would take more than one wave, at one token tile (nt 1)
 * and down's K in at most 2 segments, else 2. */
#define FM_SPLITK_WARPS 8
#define FM_SPLITK_PER_SM 2
long long fm_sched_splitk_gu_blocks(int gate_rows_p, int sgate_rows_p, int max_active, int C);
int fm_sched_splitk_down_per_sm(int down_rows_p, int nt, int nseg, int sms);

/* The splitk path at one token where the shared expert is as wide as the
 * routed ones (expert_splitk.cu, fm_fused1_kernel): gate/up and down in one
 * launch of k x G blocks (G = gate_rows_p / 16), one per SM, each holding
 * its weights in shared memory. Byte offsets in a block's dynamic shared
 * memory: the token's x (Hp BF16), gate's and up's weights (nseg x 1024
 * each) and scales (nseg x 16 x 8 bytes, MXFP4 16 x 4), down's slice of
 * ceil(down_rows_p / 16 / G) row groups (weights, then scales), the shared
 * expert's down sub-slice (a k-th of that, rounded up), two h rows (down's
 * K in BF16); total, the bytes. */
typedef struct {
    int x, gw, uw, gs, us, dn, sdn, h, total;
} fm_fused1_layout;
/* 0, or -1 where a size is out of range (the layout is then zero) */
int fm_sched_fused1_layout(int Hp, int gate_rows_p, int gate_kp, int down_rows_p, int down_kp, int k, int mx,
                           fm_fused1_layout *L);
/* the most routed experts per token it takes */
#define FM_FUSED1_MAXK 16
/* A call's shape as that kernel sees it: tokens, routed slots (max_active),
 * x's padded width, the routed matrices' padded rows and K (gate's stand
 * for up's), the shared expert's (0 where there is none), MXFP4 or not, the
 * experts (E: the top-k's scratch, past the layout, in the builds that
 * select it). */
typedef struct {
    int T, k_active, Hp;
    int gate_rows_p, gate_kp, down_rows_p, down_kp;
    int sgate_rows_p, sgate_kp, sdown_rows_p, sdown_kp;
    int mx, E;
} fm_fused1_shape;
/* The top-k's scratch of the builds that select it, past the layout: one
 * token's selection over E experts (route_shape.h), rounded up to 128. */
#define FM_FUSED1_SEL_BYTES(E) ((FM_SEL_WARP_BYTES(E) + 127) & ~(size_t)127)
/* NULL where the one-token launch takes the call on a GPU of compute
 * capability cc (major * 10 + minor), smem_optin bytes of shared memory per
 * block and sms SMs (each 0: unknown, not checked), before the occupancy the
 * device reports (the engine checks it too); else why not. The shared memory
 * counted is the layout's and the top-k's scratch, since the engine takes
 * the launch only where every build of it is resident. *L: its layout (zero
 * where the shape is out of its range). The engine and `explain` share it. */
const char *fm_sched_fused1_why(const fm_fused1_shape *s, int cc, int smem_optin, int sms, fm_fused1_layout *L);
/* NULL where that launch, taking the call (fm_sched_fused1_why, whose
 * shared memory counts the top-k's scratch), also selects the token's top-k
 * itself from the logits' K slices, so that no selection kernel runs between
 * the logits and it: route an elementwise family (fm_route_kind), not a
 * hash-routed layer, E experts; else why the selection kernel runs before
 * it. */
const char *fm_sched_fused1_selects(int route, int hash, int E);

#ifdef __cplusplus
}
#endif
#endif
