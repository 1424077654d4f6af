/* The layer schedule's decisions (schedule.h). */
#include "schedule.h"
#include "cuda_env.h"
#include "route_shape.h"
#include "fp4moe.h"
#include <math.h>
#include <string.h>

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
    return elementwise && T <= 2 && T * k <= 32;
}

double fm_sched_wave_fill(double blocks, double slots) {
    if (blocks <= 0 || slots <= 0) return 0.0;
    const double w = blocks / slots;
    return w / ceil(w);
}

/* the blocks of the experts that uniform routing of T tokens to k of E
 * activates (at most max_active), rows_p / rpb each, and sh_blocks */
static double expected_blocks(long long sh_blocks, int rows_p, int rpb, int E, int k, int T, int max_active) {
    const double kk = k < E ? k : E;
    double act = E * (1.0 - pow(1.0 - kk / E, T));
    if (act > max_active) act = max_active;
    return ceil(act) * ((rows_p + rpb - 1) / rpb) + (double)sh_blocks;
}

long long fm_sched_wg_items(int max_active, int rows_p, int srows_p, int rpb, int T, int chunk, int *sh_chunks,
                            long long *sh_blocks) {
    const int nrb = rpb > 0 ? (rows_p + rpb - 1) / rpb : 0, nrb_s = rpb > 0 && srows_p > 0 ? (srows_p + rpb - 1) / rpb : 0;
    *sh_chunks = nrb_s > 0 && chunk > 0 ? (T + chunk - 1) / chunk : 0;
    *sh_blocks = (long long)nrb_s * *sh_chunks;
    return (long long)(max_active > 0 ? max_active : 0) * nrb + *sh_blocks;
}

int fm_sched_wg_ksplit(int gu, long long blocks, long long sh_blocks, int rows_p, int rpb, int nseg, int E, int k,
                       int T, int max_active, int sms, int per_sm) {
    if (sms <= 0) sms = 132;
    if (nseg < (gu ? FM_WG_KS_MIN_SEG_GU : FM_WG_KS_MIN_SEG_DOWN) || blocks <= 0) return 1;
    /* gate/up in quarters of 8 segments or more where the quartered grid
     * keeps at most 3 blocks per SM: each block's warps decode their
     * segments one after another, a chain that a grid of about one block
     * per SM does not hide; at 4 per SM the clusters of 4 lose it again */
    if (gu && nseg >= 32 && 4 * blocks <= 3LL * sms) return 4;
    /* thirds where quarters would exceed 3 blocks per SM and thirds do not */
    if (gu && nseg >= 24 && blocks <= sms) return 3;
    if (blocks < 5LL * sms) return 2;
    /* equal blocks that stream the same bytes end in waves, and a last wave
     * of few blocks keeps few bytes in flight */
    if (per_sm <= 0 || E <= 0 || k <= 0 || T <= 0 || rpb <= 0) return 1;
    const double eb = expected_blocks(sh_blocks, rows_p, rpb, E, k, T, max_active), slots = (double)per_sm * sms;
    return fm_sched_wave_fill(2 * eb, slots) >= fm_sched_wave_fill(eb, slots) + 0.15 ? 2 : 1;
}

int fm_sched_wg_down_chunks_max(int rows_p, int rpb, int nseg) {
    if (nseg <= 0 || rpb <= 0 || rows_p % rpb) return 1;
    const int cap = FM_WG_DOWN_CHUNK_SEGS / nseg;
    return cap < 1 ? 1 : cap > FM_WG_DOWN_CHUNKS_MAX ? FM_WG_DOWN_CHUNKS_MAX : cap;
}

int fm_sched_wg_down_chunks(long long sh_blocks, int rows_p, int rpb, int nseg, int E, int k, int T, int max_active,
                            int sms, int per_sm) {
    if (sms <= 0) sms = 132;
    const int cap = fm_sched_wg_down_chunks_max(rows_p, rpb, nseg);
    if (per_sm <= 0 || E <= 0 || k <= 0 || T <= 0) return 1;
    /* each doubling halves the grid: double while the grid keeps half a
     * wave of resident blocks or more (a block of several chunks holds its
     * slot's loads in flight for as long as a wave of single chunks would) */
    const double waves = expected_blocks(sh_blocks, rows_p, rpb, E, k, T, max_active) / ((double)per_sm * sms);
    int ch = 1;
    while (2 * ch <= cap && waves >= ch) ch *= 2;
    return ch;
}

long long fm_sched_splitk_gu_blocks(int gate_rows_p, int sgate_rows_p, int max_active, int C) {
    if (C < 1 || max_active < 0 || gate_rows_p < 0 || sgate_rows_p < 0) return 0;
    const long long units = ((long long)(sgate_rows_p / 16) + (long long)max_active * (gate_rows_p / 16)) * C;
    return (units + FM_SPLITK_WARPS - 1) / FM_SPLITK_WARPS;
}

int fm_sched_splitk_down_per_sm(int down_rows_p, int nt, int nseg, int sms) {
    if (sms <= 0) sms = 132;
    /* a second wave's blocks start only when the first's have finished */
    return nt == 1 && nseg <= 2 && down_rows_p / 16 > 2LL * sms ? 3 : 2;
}

const char *fm_sched_fused1_why(const fm_fused1_shape *s, int cc, int smem_optin, int sms, fm_fused1_layout *L) {
    memset(L, 0, sizeof *L);
    if (s->T != 1) return "takes one token";
    if (!s->sgate_rows_p) return "no shared expert";
    if (s->sgate_rows_p != s->gate_rows_p || s->sgate_kp != s->gate_kp || s->sdown_rows_p != s->down_rows_p ||
        s->sdown_kp != s->down_kp)
        return "the shared expert is not as wide as the routed ones";
    if (cc && cc < 90) return "needs sm_90 or later";
    if (s->down_kp > 4 * FM_SCHED_KSEG) return "takes experts of I up to 512";
    if (s->down_rows_p / 16 < s->gate_rows_p / 16) return "down has fewer row groups than gate/up";
    if (fm_sched_fused1_layout(s->Hp, s->gate_rows_p, s->gate_kp, s->down_rows_p, s->down_kp, s->k_active, s->mx, L))
        return "the shape is out of its range";
    if (smem_optin && L->total + (s->E > 0 ? (long long)FM_FUSED1_SEL_BYTES(s->E) : 0) > smem_optin)
        return "its shared memory per block is more than the GPU's";
    if (sms && (long long)s->k_active * (s->gate_rows_p / 16) > sms) return "its blocks are more than the SMs";
    return NULL;
}

const char *fm_sched_fused1_selects(int route, int hash, int E) {
    if (route != FM_ROUTE_NOAUX_TC && route != FM_ROUTE_DSV4)
        return "the routing family's scores are not expert by expert (softmax or gpt-oss)";
    if (hash) return "a hash-routed layer";
    if (E < 1) return "no experts";
    return NULL;
}

int fm_sched_fused1_layout(int Hp, int gate_rows_p, int gate_kp, int down_rows_p, int down_kp, int k, int mx,
                           fm_fused1_layout *L) {
    memset(L, 0, sizeof *L);
    if (Hp <= 0 || Hp % FM_SCHED_KSEG || gate_rows_p < 16 || gate_rows_p % 16 || gate_kp <= 0 ||
        gate_kp % FM_SCHED_KSEG || down_rows_p < 16 || down_rows_p % 16 || down_kp <= 0 || down_kp % FM_SCHED_KSEG ||
        k < 1 || k > FM_FUSED1_MAXK || Hp > (1 << 16) || gate_kp > (1 << 16) || down_rows_p > (1 << 16) ||
        down_kp > (1 << 12))
        return -1;
    const long long spr = mx ? 4 : 8, G = gate_rows_p / 16, nseg = gate_kp / FM_SCHED_KSEG;
    const long long nseg_d = down_kp / FM_SCHED_KSEG, per = (down_rows_p / 16 + G - 1) / G;
    const long long rgb = nseg_d * (1024 + 16 * spr);
    long long o = fm_sched_pad(Hp * 2, 128);
    L->gw = (int)o;
    L->uw = (int)(o += nseg * 1024);
    L->gs = (int)(o += nseg * 1024);
    L->us = (int)(o += nseg * 16 * spr);
    o += nseg * 16 * spr;
    L->dn = (int)(o = (o + 127) / 128 * 128);
    L->sdn = (int)(o += per * rgb);
    o += (per + k - 1) / k * rgb;
    L->h = (int)(o = (o + 127) / 128 * 128);
    L->total = (int)(o + 2 * nseg_d * FM_SCHED_KSEG * 2);
    return 0;
}
