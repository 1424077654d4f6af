/* The layer schedule's decisions (schedule.h). */
#include "schedule.h"
#include "cuda_env.h"

void fm_sched_read(fm_sched *s, int cc_major) {
    s->pdl = cc_major >= 9 && !fm_cuda_env_is("FP4MOE_CUDA_PDL", "0");
    /* forked after the logits kernel and joined at the layer's end, the
     * shared expert runs beside the selection and the routed experts */
    s->sh_fork = !fm_cuda_env_is("FP4MOE_CUDA_SH_FORK", "0");
}

int fm_sched_shared_nt(const fm_sched *s, int wgmma, int nt, int warps, int T) {
    (void)s;
    if (!wgmma) return nt;
    /* every token meets the shared expert, so each pass re-decodes its
     * weights: passes of 64 tokens above 64, of 32 when narrower ones would
     * take more than one */
    if (T > 64 && warps == 4) return 8;
    return nt < 4 && T > 8 * nt ? 4 : nt;
}

int fm_sched_handoff(const fm_sched *s, int wgmma, int T) { return T <= FM_HANDOFF_MAX_T && wgmma && s->pdl; }

int fm_sched_trigger(const fm_sched *s, int fork) {
    (void)s;
    return fork ? 2 : 0;
}

int fm_sched_sel_spread(const fm_sched *s, int elementwise, int T, int k) {
    (void)s;
    return elementwise && T <= 1 && T * k <= 32;
}
