/* The layer schedule's switches and decisions (src/cuda/schedule.c): plain
 * C, so that the CUDA engine and `fp4moe explain` (which plans for a GPU
 * that need not be present) decide the same way. */
#ifndef FM_SCHEDULE_H
#define FM_SCHEDULE_H
#ifdef __cplusplus
extern "C" {
#endif

#define FM_HANDOFF_MAX_T 32 /* the routed down takes over per expert up to this many tokens (v42) */

/* The FP4MOE_CUDA_* switches of the layer schedule (docs/perf.md). */
typedef struct {
    int pdl;        /* programmatic dependent launch (sm_90 and later) */
    int sh_fork;    /* the shared expert's launches on a stream of their own (v28) */
    int sh_wide;    /* its wgmma passes wider than the routed experts' (v35) */
    int sh_tokens;  /* FP4MOE_CUDA_SH_TOKENS: 32, 64, or 0 for the default (v46) */
    int handoff;    /* down per expert: 0 never, 1 up to FM_HANDOFF_MAX_T tokens, 2 always (v42) */
    int pre_wait;   /* early weight loads before griddepcontrol.wait (v28) */
    int warp_group; /* one-block selections of T * k <= 32 pairs group them in one warp (v10) */
    int sel_spread; /* up to this many tokens, their selection over the whole block (v50) */
    int sel_early;  /* launch trigger of the expert kernels: 0 after selecting, 1 before the
                     * selection's wait, 2 after it, -1 the default (v50b) */
} fm_sched;

/* The switches as set in the environment, for a device of compute
 * capability major cc_major. */
void fm_sched_read(fm_sched *s, int cc_major);
/* 8-token tiles per pass of the shared expert's own launches (on its
 * stream), from the routed launches' nt and warps on the wgmma path. */
int fm_sched_shared_nt(const fm_sched *s, int wgmma, int nt, int warps, int T);
/* 1 when the routed down takes over per expert at T tokens (v42). */
int fm_sched_handoff(const fm_sched *s, int wgmma, int T);
/* Where the selection kernel lets the expert kernels launch (v50b): 0 after
 * selecting, 1 before its wait on the logits, 2 right after that wait;
 * fork: the shared expert runs on its own stream. */
int fm_sched_trigger(const fm_sched *s, int fork);
/* 1 when T tokens' selection sums and scores spread over the selection
 * block (v50): elementwise scoring families (noaux_tc, DeepSeek-V4) and one
 * block that groups the pairs in one warp (T * k <= 32). */
int fm_sched_sel_spread(const fm_sched *s, int elementwise, int T, int k);

#ifdef __cplusplus
}
#endif
#endif
