/* The expert launches of a layer (gate/up, down) for both kernel families:
 * the grid of work items, the block shape and K split, the launch
 * attributes (PDL, clusters), and the kernels' names for provenance. */
#include "cuda_internal.h"
#include <pthread.h>
#include <stdio.h>
#include <string.h>

/* Resident blocks per SM of one kernel at its block shape and shared memory,
 * from the occupancy API once per (device, kernel, shape): the answer never
 * changes, and the query (with the shared-memory attribute it needs) is a
 * driver call that would otherwise come with every launch outside a graph.
 * 0 where the API fails. */
static int blocks_per_sm(fm_expert_kfn fn, int threads, size_t smem, int smem_optin) {
    struct occ {
        int device, threads, per_sm;
        fm_expert_kfn fn;
        size_t smem;
    };
    static occ cache[64];
    static int n;
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    pthread_mutex_lock(&mu);
    for (int i = 0; i < n; i++)
        if (cache[i].fn == fn && cache[i].device == device && cache[i].threads == threads && cache[i].smem == smem) {
            const int r = cache[i].per_sm;
            pthread_mutex_unlock(&mu);
            return r;
        }
    /* the occupancy counts only the dynamic shared memory the function allows */
    const size_t limit = smem + FM_CUDA_SHARED_SMEM_MARK <= (size_t)smem_optin ? smem + FM_CUDA_SHARED_SMEM_MARK : smem;
    int per_sm = 0;
    if (limit > 48 * 1024) cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)limit);
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, threads, smem) != cudaSuccess) {
        cudaGetLastError();
        per_sm = 0;
    } else if (n < (int)(sizeof cache / sizeof cache[0])) {
        cache[n++] = occ{device, threads, per_sm, fn, smem};
    }
    pthread_mutex_unlock(&mu);
    return per_sm;
}

/* The wgmma kernels' K split (fm_sched_wg_ksplit): the resident blocks per
 * SM it weighs are asked only where the grid is large enough for them to
 * matter. blocks is the grid without the split. */
static int wg_ks(const fm_expert_params *p, int gu, int64_t blocks, int64_t sh_blocks, int rpb, int nseg,
                 fm_expert_kfn fn, int threads, size_t smem) {
    const int sms = p->sms > 0 ? p->sms : 132;
    const fm_dmat *m = gu ? &p->gate : &p->down;
    const int per_sm = fn && nseg >= (gu ? FM_WG_KS_MIN_SEG_GU : FM_WG_KS_MIN_SEG_DOWN) && blocks >= 5L * sms
                           ? blocks_per_sm(fn, threads, smem, p->smem_optin)
                           : 0;
    return fm_sched_wg_ksplit(gu, blocks, sh_blocks, m->rows_p, rpb, nseg, m->n, p->k, p->T, p->max_active, sms,
                              per_sm);
}

/* The work items of one expert launch: max_active x row blocks, and the
 * shared expert's (row block, chunk) items (*sh_blocks of them, *sh_chunks
 * chunks per row block). */
static int64_t grid_items(const fm_expert_params *p, int nmat, int rpb, int chunk, int64_t *sh_blocks,
                          int *sh_chunks) {
    const fm_dmat *m = nmat == 2 ? &p->gate : &p->down;
    const fm_dmat *sm = nmat == 2 ? &p->sgate : &p->sdown;
    long long shb;
    const long long items = fm_sched_wg_items(p->max_active, m->rows_p, sm->n ? sm->rows_p : 0, rpb, p->T, chunk,
                                              sh_chunks, &shb);
    *sh_blocks = shb;
    return items;
}

/* One expert launch (both kernel families): the shared expert's (row block,
 * token chunk) items first, then max_active x row blocks; rpb rows per
 * block, chunks of `chunk` tokens (one kernel pass: a chunk costs the same
 * decode work as a pass of one long loop, but the chunks run in parallel
 * and re-read the weights from L2); bdup blocks per item (a K split), in
 * clusters of `cluster` blocks. */
static fm_status launch_grid(const fm_expert_params *p, int nmat, fm_expert_kfn fn, int rpb, int chunk, int threads,
                             size_t smem, int pdl, int W, int KS, int bdup, int cluster, cudaStream_t s,
                             const char *what) {
    if (!fn) return fm_error(FM_E_UNSUPPORTED, "%s: no kernel of this shape is built", what);
    fm_expert_params q = *p;
    int64_t sh_blocks;
    q.sh_chunk = chunk;
    const int64_t blocks = grid_items(p, nmat, rpb, chunk, &sh_blocks, &q.sh_chunks) * bdup;
    if (blocks <= 0) return FM_OK;
    if (blocks > 0x7fffffff) return fm_error(FM_E_RANGE, "CUDA grid of %lld blocks is too large", (long long)blocks);
    q.sh_blocks = (int)sh_blocks;
    /* The shared expert's launches on its own stream ask for
     * FM_CUDA_SHARED_SMEM_MARK bytes of dynamic shared memory more than they
     * use: CUPTI reports each launch's dynamic shared memory, and a profile
     * (src/prof/kernels.c) tells them by it from the routed experts' launches
     * of the same kernel (kernels of their own would be a second copy of the
     * code in the instruction caches). The function's limit is raised for
     * the mark on every launch, so that no later launch lowers it below a
     * captured one's. */
    if (smem % 16)
        return fm_error(FM_E_RANGE, "%s: %zu bytes of shared memory, not a multiple of 16", what, smem);
    const size_t limit =
        smem + FM_CUDA_SHARED_SMEM_MARK <= (size_t)p->smem_optin ? smem + FM_CUDA_SHARED_SMEM_MARK : smem;
    const size_t dsm = p->max_active == 0 && p->sgate.n > 0 ? limit : smem;
    if (limit > 48 * 1024) {
        cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)limit);
        if (err != cudaSuccess) {
            cudaGetLastError();
            return fm_error(FM_E_CUDA, "cudaFuncSetAttribute(%zu bytes of shared memory, %s): %s", limit, what,
                            cudaGetErrorString(err));
        }
    }
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[2];
    cfg.gridDim = dim3((unsigned)blocks);
    cfg.blockDim = dim3((unsigned)threads);
    cfg.dynamicSmemBytes = dsm;
    cfg.stream = s;
    unsigned na = 0;
    if (pdl) {
        attr[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[na].val.programmaticStreamSerializationAllowed = 1;
        na++;
    }
    if (cluster > 1) {
        attr[na].id = cudaLaunchAttributeClusterDimension;
        attr[na].val.clusterDim.x = (unsigned)cluster;
        attr[na].val.clusterDim.y = 1;
        attr[na].val.clusterDim.z = 1;
        na++;
    }
    cfg.attrs = attr;
    cfg.numAttrs = na;
    FM_CU(cudaLaunchKernelEx(&cfg, fn, q, W, KS));
    FM_CU_LAUNCH(what);
    return FM_OK;
}

/* One wgmma launch's shape: kernel, rows per block (down: per row chunk),
 * tokens per pass, shared memory, K split, and down's row chunks per block
 * (lch: their log2). */
typedef struct {
    fm_expert_kfn fn;
    int nmax, wgs, rpb, chunk, ks, lch;
    size_t smem;
} wg_plan;

/* wgs: warpgroups per block (1, or 2 from the config's 128 rows per block;
 * passes of 8 tokens have one). Two warpgroups never split K. Down runs in
 * 128-row blocks, whose segments carry gate/up's bytes per barrier and per
 * copy group. */
static void plan_wg(const fm_expert_params *p, int nmat, int nmax, int wgs, wg_plan *w) {
    const int kind = nmat == 2 ? 1 : 2;
    if (nmax < 2) wgs = 1;
    if (nmax == 8 && wgs != 1) nmax = 4; /* 64-token passes are built with one warpgroup */
    w->nmax = nmax;
    w->wgs = wgs;
    w->rpb = (nmat == 1 ? 128 : 64) * wgs;
    w->chunk = 8 * nmax;
    w->smem = fm_expert_wg_smem(2, nmax, nmat == 1, wgs);
    int64_t sh_blocks;
    int sh_chunks;
    w->fn = fm_expert_wg_kernel_for(kind, p->mx, nmax, wgs);
    const int64_t items = grid_items(p, nmat, w->rpb, w->chunk, &sh_blocks, &sh_chunks);
    int ks = wgs > 1 ? 1
                     : wg_ks(p, nmat == 2, items, sh_blocks, w->rpb,
                             (int)((nmat == 2 ? p->gate.kp : p->down.kp) / FM_KSEG), w->fn, 128 * wgs, w->smem);
    /* gate/up's cluster reduction reuses CTA 0's rings for the others' sums */
    while (nmat == 2 && ks > 1 && (size_t)(ks - 1) * 2 * 4 * nmax * 128 * sizeof(float) > w->smem) ks /= 2;
    w->ks = ks;
    w->lch = 0;
    /* the occupancy is asked only where K is short enough for two chunks */
    const int dseg = (int)(p->down.kp / FM_KSEG);
    if (nmat == 1 && ks == 1 && w->fn && dseg > 0 && 2 * dseg <= FM_WG_DOWN_CHUNK_SEGS &&
        (!p->sdown.n || p->sdown.rows_p == p->down.rows_p)) {
        const int sms = p->sms > 0 ? p->sms : 132;
        const int ch = fm_sched_wg_down_chunks(sh_blocks, p->down.rows_p, w->rpb, dseg, p->down.n, p->k, p->T,
                                               p->max_active, sms,
                                               blocks_per_sm(w->fn, 128 * wgs, w->smem, p->smem_optin));
        while ((2 << w->lch) <= ch) w->lch++;
    }
}

static fm_status launch_wg(const fm_expert_params *p, int nmat, int pdl, int nmax, int wgs, cudaStream_t s) {
    wg_plan w;
    plan_wg(p, nmat, nmax, wgs, &w);
    /* down: items of 2^lch row chunks (the kernel's W) */
    return launch_grid(p, nmat, w.fn, w.rpb << w.lch, w.chunk, 128 * w.wgs, w.smem, pdl, w.lch, w.ks, w.ks,
                       nmat == 2 ? w.ks : 1, s, nmat == 2 ? "fm_expert_wg_kernel (gate/up)" : "fm_expert_wg_kernel (down)");
}

static int wg_nmax(const fm_launch_cfg *c) { return c->nt > 4 ? 8 : c->nt > 2 ? 4 : c->nt; }

extern "C" int fm_cuda_down_chunks(const fm_expert_params *p, const fm_launch_cfg *c) {
    if (!c->wgmma_path || c->splitk) return 1;
    wg_plan w;
    plan_wg(p, 1, wg_nmax(c), c->warps == 8 ? 2 : 1, &w);
    return 1 << w.lch;
}

extern "C" int fm_cuda_gateup_ksplit(const fm_expert_params *p, const fm_launch_cfg *c) {
    if (!c->wgmma_path || c->splitk) return 1;
    wg_plan w;
    plan_wg(p, 2, wg_nmax(c), c->warps == 8 ? 2 : 1, &w);
    return w.ks;
}

static fm_status launch(const fm_expert_params *p, const fm_launch_cfg *c, int nmat, cudaStream_t s) {
    if (c->wgmma_path)
        return launch_wg(p, nmat, c->pdl, wg_nmax(c), c->warps == 8 ? 2 : 1, s);
    if ((c->nt != 1 && c->nt != 2 && c->nt != 4) || c->warps < 1 || c->warps > 8 || c->ksplit < 1 ||
        c->warps % c->ksplit)
        return fm_error(FM_E_ARG, "invalid CUDA kernel config: tile_n %d, warps %d, k_split %d", c->nt * 8, c->warps,
                        c->ksplit);
    const size_t smem = c->ksplit > 1 ? (size_t)c->warps * nmat * c->nt * 4 * 32 * sizeof(float) : 0;
    if (smem > 48 * 1024 && smem > (size_t)p->smem_optin)
        return fm_error(FM_E_ARG,
                        "kernel config (warps %d, k_split %d, tile_n %d) needs %zu bytes of shared memory per "
                        "block; this GPU allows %d",
                        c->warps, c->ksplit, c->nt * 8, smem, p->smem_optin);
    return launch_grid(p, nmat, fm_expert_mma_kernel(nmat, c->nt, p->mx), 16 * (c->warps / c->ksplit), 8 * c->nt,
                       32 * c->warps, smem, c->pdl, c->warps, c->ksplit, 1, 1, s,
                       nmat == 2 ? "fm_expert_kernel (gate/up)" : "fm_expert_kernel (down)");
}

extern "C" fm_status fm_cuda_launch_gateup(const fm_expert_params *p, const fm_launch_cfg *c, cudaStream_t s) {
    return launch(p, c, 2, s);
}
extern "C" fm_status fm_cuda_launch_down(const fm_expert_params *p, const fm_launch_cfg *c, cudaStream_t s) {
    return launch(p, c, 1, s);
}

extern "C" const char *fm_cuda_kernel_names(const fm_launch_cfg *c, int mx, char *buf, size_t cap) {
    if (c->splitk && c->fused) {
        snprintf(buf, cap,
                 "fm_fused1_kernel<%s> gate_up+down in one launch (one token; mma.m16n8k16 bf16; a block per SM, "
                 "k x 16-row groups: each copies its expert's rows of gate/up and of down and the shared expert's "
                 "share into shared memory by TMA bulk copies as soon as the routing names the expert, h handed "
                 "over per expert, each block's down rows added into the output with atomics)",
                 mx ? "mxfp4" : "nvfp4");
        return buf;
    }
    if (c->splitk) {
        snprintf(buf, cap,
                 "fm_splitk_gu_kernel<%s> gate_up (mma.m16n8k16 bf16, a warp per 16 rows x 1/%d of K, partials "
                 "added in chunk order by the row group's last warp) + fm_splitk_down_kernel<%s> down (a block per "
                 "16 output rows over every expert, no atomics, three blocks per SM where two would take two "
                 "waves); shared expert inside both launches",
                 mx ? "mxfp4" : "nvfp4", c->ksplit, mx ? "mxfp4" : "nvfp4");
        return buf;
    }
    if (c->wgmma_path) {
        /* the kernels of passes up to 16 tokens (expert_wgmma.cu) */
        static const char V4[] = ", down's output added in 16-byte reductions";
        if (c->warps == 8 && c->nt > 1)
            snprintf(buf, cap,
                     "fm_expert_wg_kernel<%s> gate_up+down (wgmma.m64nNk16 bf16, A in registers, B in shared memory; "
                     "two warpgroups per block sharing one activation stage: 128-row gate/up and 256-row down "
                     "blocks, no K split; up to %d tokens per pass%s)",
                     mx ? "mxfp4" : "nvfp4", c->nt > 2 ? 32 : 8 * c->nt, c->nt <= 2 ? V4 : "");
        else
            snprintf(buf, cap,
                     "fm_expert_wg_kernel<%s> gate_up+down (wgmma.m64nNk16 bf16, A in registers, B in shared memory; "
                     "64-row gate/up and 128-row down blocks, K split in 2 where a grid is under 5 blocks per SM "
                     "or the split fills its last wave, gate/up's in 4 or 3 at the smallest grids; "
                     "up to %d tokens per pass%s)",
                     mx ? "mxfp4" : "nvfp4", c->nt > 2 ? 32 : 8 * c->nt, c->nt <= 2 ? V4 : "");
        return buf;
    }
    if (fm_expert_mma_xg(2, c->nt))
        snprintf(buf, cap,
                 "fm_expert_kernel<nt%d,%s> gate_up (regs x2, x per K step) + down (regs x2) (mma.m16n8k16 bf16, "
                 "%d warps, k_split %d)",
                 c->nt, mx ? "mxfp4" : "nvfp4", c->warps, c->ksplit);
    else
        snprintf(buf, cap, "fm_expert_kernel<nt%d,%s,regs x2> gate_up+down (mma.m16n8k16 bf16, %d warps, k_split %d)",
                 c->nt, mx ? "mxfp4" : "nvfp4", c->warps, c->ksplit);
    return buf;
}
