/* The layer schedule's decisions (schedule.h). */
#include "schedule.h"
#include "cuda_env.h"

#include <stdlib.h>

void fm_sched_read(fm_sched *s, int cc_major) {
    /* FP4MOE_CUDA_PDL=0: no programmatic dependent launch */
    const char *pv = getenv("FP4MOE_CUDA_PDL");
    s->pdl = cc_major >= 9 && !(pv && *pv && atoi(pv) == 0);
    /* The shared expert's two launches go on a second stream forked after
     * the logits kernel and joined at the layer's end, so that they run
     * beside the selection and the routed experts (v28);
     * FP4MOE_CUDA_SH_FORK=0 keeps them in the routed launches */
    s->sh_fork = !fm_cuda_env_is("FP4MOE_CUDA_SH_FORK", "0");
    /* The shared expert's launches on that branch take passes of 32 tokens
     * when the config's wgmma passes are narrower and the batch needs more
     * than one of them: every token meets the shared expert, so each pass is
     * a re-decode of its weights (v35); FP4MOE_CUDA_SH_WIDE=0 keeps the
     * config's width */
    s->sh_wide = !fm_cuda_env_is("FP4MOE_CUDA_SH_WIDE", "0");
    /* Above 64 tokens those passes are 64 tokens wide (v46: half the
     * re-decodes again); FP4MOE_CUDA_SH_TOKENS=64 from 33 tokens, =32 never
     * (0: the default) */
    s->sh_tokens = fm_cuda_env_is("FP4MOE_CUDA_SH_TOKENS", "64")   ? 64
                   : fm_cuda_env_is("FP4MOE_CUDA_SH_TOKENS", "32") ? 32
                                                                   : 0;
    /* On the forked layout with the wgmma kernels, the routed down's blocks
     * start on an expert as soon as its gate/up warps have written h, not
     * when the whole gate/up grid has (v42): by default up to 32 tokens,
     * where the gate/up grid is a few waves and its tail weighs (H200:
     * -3 to -6 % at B = 2 - 16, level from 64); FP4MOE_CUDA_HANDOFF=0 never,
     * =1 at every batch size */
    s->handoff = fm_cuda_env_is("FP4MOE_CUDA_HANDOFF", "0") ? 0 : fm_cuda_env_is("FP4MOE_CUDA_HANDOFF", "1") ? 2 : 1;
    /* Down's blocks and the shared expert's issue their first two segments'
     * weight loads before griddepcontrol.wait (v28); FP4MOE_CUDA_PRE_WAIT=0
     * has every block wait first */
    s->pre_wait = !fm_cuda_env_is("FP4MOE_CUDA_PRE_WAIT", "0");
    /* FP4MOE_CUDA_ROUTE_WARPGROUP=0 keeps the block-wide grouping at T * k
     * <= 32 (for comparisons) */
    s->warp_group = !fm_cuda_env_is("FP4MOE_CUDA_ROUTE_WARPGROUP", "0");
    /* One token's selection (T = 1, elementwise scoring families) spreads
     * its slice sums and scores over the selection block's four warps, and
     * one warp picks the top-k from them (v50; H200, B = 1: DeepSeek-V4-Flash
     * -2 to -4 %, GLM-5 -1 %); FP4MOE_CUDA_SEL_SPREAD=0 keeps the whole
     * selection on one warp, =2 spreads two tokens over two warps each too
     * (level at B = 2) */
    s->sel_spread = fm_cuda_env_is("FP4MOE_CUDA_SEL_SPREAD", "0") ? 0 : fm_cuda_env_is("FP4MOE_CUDA_SEL_SPREAD", "2") ? 2 : 1;
    /* Where the shared expert runs on its own branch, the selection kernel
     * lets the expert kernels launch right after its wait on the logits,
     * before it selects, so that the routed blocks take their places on the
     * SMs before the shared expert's (v50b; H200: GLM-5 -1 to -3 % at B = 4 -
     * 256, DeepSeek-V4-Flash level); elsewhere after selecting, as before
     * (Qwen3-30B-A3B and gpt-oss-120b 0 to +1 % with the early point).
     * FP4MOE_CUDA_SEL_EARLY=0 after the selection, =1 before the wait (+6 %
     * at B = 1 - 2), =2 right after it, on every layout; -1: unset */
    s->sel_early = fm_cuda_env_is("FP4MOE_CUDA_SEL_EARLY", "1")   ? 1
                   : fm_cuda_env_is("FP4MOE_CUDA_SEL_EARLY", "0") ? 0
                   : fm_cuda_env_is("FP4MOE_CUDA_SEL_EARLY", "2") ? 2
                                                                  : -1;
}

int fm_sched_shared_nt(const fm_sched *s, int wgmma, int nt, int warps, int T) {
    if (!s->sh_wide || !wgmma) return nt;
    /* v46: 64-token passes (one warpgroup per block) above 64 tokens by
     * default (H200: -1 to -2 % at B = 128 and 512, level at 48 - 64 and
     * 256), above 32 with FP4MOE_CUDA_SH_TOKENS=64, never with =32 */
    if (s->sh_tokens != 32 && T > (s->sh_tokens == 64 ? 32 : 64) && warps == 4) return 8;
    return nt < 4 && T > 8 * nt ? 4 : nt;
}

int fm_sched_handoff(const fm_sched *s, int wgmma, int T) {
    return (s->handoff == 2 || (s->handoff == 1 && T <= FM_HANDOFF_MAX_T)) && wgmma && s->pdl && s->pre_wait;
}

int fm_sched_trigger(const fm_sched *s, int fork) { return s->sel_early >= 0 ? s->sel_early : fork ? 2 : 0; }

int fm_sched_sel_spread(const fm_sched *s, int elementwise, int T, int k) {
    return s->warp_group && elementwise && T <= s->sel_spread && T * k <= 32;
}
