/*
 * Selection and grouping on the GPU, the second routing launch of a layer.
 * One warp per token adds the K slices of its logits, computes the family's
 * scores, the group limit and the top-k exactly as fm_route does (ties go to
 * the lower expert index, ids sorted ascending); the kernel is a template on
 * the routing family, so that it holds one family's code. The last block to
 * finish (a counter in global memory) groups the T*k (token, slot) pairs by
 * expert: counts, prefix sums, the list of active experts, the scatter.
 * When one block selects every token and T*k <= 32 (batch <= 4), one warp
 * groups the pairs in registers instead (one token's need no grouping),
 * and so does the last block's first warp up to 64 pairs (a bitonic sort
 * over the warp). The pre-routed path
 * (fm_preroute_kernel) takes the caller's ids and weights and groups them.
 * Nothing here waits on the host, so a whole step can be one CUDA graph.
 */
#include "route_pick.cuh"
#include <math.h>

#define RS_WARPS 4 /* tokens per selection block (8 measured level; docs/history) */
#define RS_THREADS (RS_WARPS * 32)
#define GB 8      /* pairs per thread and round in the grouping */

/* Block-wide exclusive scan of one int per thread; returns the total. */
static __device__ int block_exscan(int v, int *excl, int *warp_tot) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int inc = v;
    for (int o = 1; o < 32; o <<= 1) {
        int n = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += n;
    }
    if (lane == 31) warp_tot[w] = inc;
    __syncthreads();
    int base = 0, total = 0;
    for (int i = 0; i < (int)(blockDim.x >> 5); i++) {
        if (i < w) base += warp_tot[i];
        total += warp_tot[i];
    }
    *excl = base + inc - v;
    __syncthreads();
    return total;
}

/*
 * Selection and grouping: one warp per token (4 or 8 tokens per block).
 * The warp adds the K slices of its token's logits in slice order, applies
 * the family's scores, the group limit and the top-k exactly as fm_route
 * (ties to the lower expert index, ids ascending) and writes its ids and
 * weights (the logits kernel already wrote the token's activations in the
 * experts' layout and zeroed its output row). The last block to finish (a counter in global memory) groups the T*k pairs by
 * expert: counts (shared atomics), scans, active list, scatter.
 */
/* Selection of token t by one warp (lane j < k writes the j-th id and
 * weight in ascending id order);
 * ws: the warp's sel_warp_bytes(E) of shared memory, chosen: [RT_MAXK].
 * chosen_w (or NULL): [RT_MAXK]; then chosen and chosen_w end up holding the
 * token's ids (ascending) and weights as written to ids / wts.
 * RK: the routing family (fm_route_kind), a template parameter so that each
 * kernel holds only its family's code. The selection runs on one warp: at
 * decode sizes its time is that warp's chain of dependent loads and
 * reductions (instruction fetch was ruled out; docs/history). */
template <int RK>
static __device__ void select_scores(const fm_route_params &p, int t, unsigned char *ws) {
    const int E = p.E, Ep = lg_stride(E);
    const int lane = threadIdx.x & 31;
    const int T = p.T;
    /* A lane owns experts 128 c + 4 lane .. + 3 (chunks c of 128): every
     * step below moves four experts with one 16-byte access, and the loops
     * are short. */
    float *lg = (float *)ws;  /* [Ep] logits          */
    float *sel = lg + Ep;     /* [Ep] selection score, then the top-k keys */
    float *wsc = sel + Ep;    /* [Ep] weight score, then [Ep] bytes of group flags (select_pick) */
        /* The biases of the lane's first SEL_RB chunks into registers first,
         * then the K slices in order, every slice of two chunks loaded before
         * the first add: one round trip to L2 per 8 slices instead of one per
         * load (the dependent loads dominate at B = 1) */
        const int nch = (E + 127) / 128;
        float4 sbias[SEL_RB], rbias[SEL_RB];
#pragma unroll
        for (int c = 0; c < SEL_RB; c++) {
            const int e = 128 * c + 4 * lane;
            sbias[c] = rbias[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (c < nch && e < E) {
                if (p.score_bias) sbias[c] = ld_quad(p.score_bias, e, E);
                if (p.router_bias) rbias[c] = ld_quad(p.router_bias, e, E);
            }
        }
#pragma unroll 1
        for (int c0 = 0; c0 < E; c0 += 256) {
            const int ea = c0 + 4 * lane, eb = ea + 128;
            float4 va = make_float4(0.0f, 0.0f, 0.0f, 0.0f), vb = va;
#pragma unroll 1
            for (int s0 = 0; s0 < p.kslices; s0 += 8) {
                float4 xa[8], xb[8];
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const bool in = s0 + j < p.kslices;
                    const size_t row = ((size_t)(s0 + j) * T + t) * Ep;
                    xa[j] = in && ea < E ? __ldcg((const float4 *)(p.logits + row + ea)) : make_float4(0, 0, 0, 0);
                    xb[j] = in && eb < E ? __ldcg((const float4 *)(p.logits + row + eb)) : make_float4(0, 0, 0, 0);
                }
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    if (s0 + j < p.kslices) {
                        va.x += xa[j].x; va.y += xa[j].y; va.z += xa[j].z; va.w += xa[j].w;
                        vb.x += xb[j].x; vb.y += xb[j].y; vb.z += xb[j].z; vb.w += xb[j].w;
                    }
                }
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int e = h ? eb : ea;
                float4 v = h ? vb : va;
                if (e < E) {
                    if (p.router_bias) {
                        const float4 b = bias_quad(rbias, p.router_bias, e, E);
                        v.x += b.x; v.y += b.y; v.z += b.z; v.w += b.w;
                    }
                    *(float4 *)&lg[e] = v;
                }
            }
        }
        __syncwarp();

        /* family scores (experts E .. Ep - 1 get scores too, never chosen) */
        if (RK == FM_ROUTE_SOFTMAX) {
            float m = -INFINITY;
            for (int e = 4 * lane; e < E; e += 128) {
                const float4 l = *(const float4 *)&lg[e];
                m = fmaxf(m, fmaxf(fmaxf(l.x, e + 1 < E ? l.y : -INFINITY),
                                   fmaxf(e + 2 < E ? l.z : -INFINITY, e + 3 < E ? l.w : -INFINITY)));
            }
            for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
            float sum = 0.0f;
            for (int e = 4 * lane; e < E; e += 128) {
                const float4 l = *(const float4 *)&lg[e];
                float4 x;
                x.x = expf(l.x - m);
                x.y = e + 1 < E ? expf(l.y - m) : 0.0f;
                x.z = e + 2 < E ? expf(l.z - m) : 0.0f;
                x.w = e + 3 < E ? expf(l.w - m) : 0.0f;
                sum += x.x + x.y + x.z + x.w;
                *(float4 *)&wsc[e] = x;
            }
            for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            for (int e = 4 * lane; e < E; e += 128) {
                float4 x = *(const float4 *)&wsc[e];
                x.x /= sum; x.y /= sum; x.z /= sum; x.w /= sum;
                *(float4 *)&wsc[e] = x;
                *(float4 *)&sel[e] = x;
            }
        } else if (RK == FM_ROUTE_GPTOSS) {
            for (int e = 4 * lane; e < E; e += 128) {
                const float4 l = *(const float4 *)&lg[e];
                *(float4 *)&sel[e] = l;
                *(float4 *)&wsc[e] = l;
            }
        } else {
            /* the chunks' expf / log1pf chains side by side */
#pragma unroll 4
            for (int e = 4 * lane; e < E; e += 128) {
                const float4 l = *(const float4 *)&lg[e];
                float4 sc;
                if (RK == FM_ROUTE_DSV4) {
                    sc.x = sqrtf(l.x > 20.0f ? l.x : log1pf(expf(l.x)));
                    sc.y = sqrtf(l.y > 20.0f ? l.y : log1pf(expf(l.y)));
                    sc.z = sqrtf(l.z > 20.0f ? l.z : log1pf(expf(l.z)));
                    sc.w = sqrtf(l.w > 20.0f ? l.w : log1pf(expf(l.w)));
                } else {
                    sc.x = 1.0f / (1.0f + expf(-l.x));
                    sc.y = 1.0f / (1.0f + expf(-l.y));
                    sc.z = 1.0f / (1.0f + expf(-l.z));
                    sc.w = 1.0f / (1.0f + expf(-l.w));
                }
                *(float4 *)&wsc[e] = sc;
                if (p.score_bias) {
                    const float4 b = bias_quad(sbias, p.score_bias, e, E);
                    sc.x += b.x; sc.y += b.y; sc.z += b.z; sc.w += b.w;
                }
                *(float4 *)&sel[e] = sc;
            }
        }
        __syncwarp();
}

template <int RK>
static __device__ void select_token(const fm_route_params &p, int t, unsigned char *ws, int *chosen, float *chosen_w) {
    select_scores<RK>(p, t, ws);
    select_pick<RK>(p, t, ws, chosen, chosen_w);
}

/* The experts' offsets from their pair counts cnt[E] (shared memory): each
 * thread scans a run of consecutive experts, then two block-wide scans;
 * with act, the active list too. Returns the number of active experts. */
static __device__ int counts_to_offsets(const fm_route_params &p, const int *cnt, int *off, int *warp_tot, bool act) {
    const int E = p.E, nth = blockDim.x;
    const int per = (E + nth - 1) / nth;
    const int e0 = threadIdx.x * per, e1 = min(E, e0 + per);
    int mysum = 0, myact = 0;
    for (int e = e0; e < e1; e++) { mysum += cnt[e]; myact += cnt[e] > 0; }
    int base, abase;
    block_exscan(mysum, &base, warp_tot);
    const int n_act = block_exscan(myact, &abase, warp_tot);
    for (int e = e0; e < e1; e++) {
        off[e] = base;
        if (act && cnt[e] > 0) {
            p.act_e[abase] = e;
            p.act_off[abase] = base;
            p.act_cnt[abase] = cnt[e];
            abase++;
        }
        base += cnt[e];
    }
    return n_act;
}

/* Groups the T*k pairs by expert (one block, after every token's
 * selection): counts (shared atomics), scans, active list, scatter; then
 * resets the block counter that elected this block. smem: 12 E bytes. */
static __device__ void group_pairs(const fm_route_params &p, unsigned char *smem, int *warp_tot, unsigned *done) {
    const int E = p.E, k = p.k, T = p.T;
    const int tid = threadIdx.x, nth = blockDim.x;
    int *cnt = (int *)smem;  /* [E] (reuses the score arrays) */
    int *off = cnt + E;         /* [E] */
    int *cur = off + E;         /* [E] */
    const int n = T * k;
    for (int e = tid; e < E; e += nth) { cnt[e] = 0; cur[e] = 0; }
    __syncthreads();
    /* GB pairs per thread per round: their loads are issued together, so a
     * round costs one L2 latency (one block does this for the whole grid) */
    for (int i0 = 0; i0 < n; i0 += nth * GB) {
        int ev[GB];
#pragma unroll
        for (int j = 0; j < GB; j++) {
            int i = i0 + j * nth + tid;
            ev[j] = i < n ? __ldcg(&p.ids[i]) : -1;
        }
#pragma unroll
        for (int j = 0; j < GB; j++)
            if (ev[j] >= 0) atomicAdd(&cnt[ev[j]], 1);
    }
    __syncthreads();
    const int n_act = counts_to_offsets(p, cnt, off, warp_tot, true);
    __syncthreads();
    for (int i0 = 0; i0 < n; i0 += nth * GB) {
        int ev[GB];
        float wv[GB];
#pragma unroll
        for (int j = 0; j < GB; j++) {
            int i = i0 + j * nth + tid;
            ev[j] = i < n ? __ldcg(&p.ids[i]) : -1;
            wv[j] = i < n ? __ldcg(&p.wts[i]) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < GB; j++)
            if (ev[j] >= 0) {
                int i = i0 + j * nth + tid;
                int pos = off[ev[j]] + atomicAdd(&cur[ev[j]], 1);
                p.sorted_tok[pos] = i / k;
                p.sorted_w[pos] = wv[j];
            }
    }
    if (tid == 0) {
        *p.n_active = n_act;
        if (p.stat_active) *p.stat_active = n_act;
        *done = 0;
    }
}

/*
 * Grouping by one warp in registers, for up to 32 Q pairs: pair i =
 * (token i / k, slot i % k) is lane i % 32's q = i / 32. Each pair gets the
 * key expert << 11 | token << 5 | slot (tokens < 64, slots < 32: unique), a
 * bitonic sort over the warp puts the pairs in expert-major order with the
 * tokens of an expert ascending (position = the pair's place), and the
 * experts' runs, their offsets and counts come from ballots of the run
 * starts: log2(32 Q) (log2(32 Q) + 1) / 2 compare-exchange steps instead of
 * the 2 n shuffles per lane of counting smaller keys one by one (and a
 * fraction of the block-wide grouping's counts and scans). Same
 * outputs as group_pairs, with the tokens of an expert in ascending order.
 */
template <int Q>
static __device__ void group_pairs_sorted(const fm_route_params &p, const int (&idv)[Q], const float (&wv)[Q]) {
    const int k = p.k, n = p.T * p.k, lane = threadIdx.x & 31;
    unsigned key[Q];
    float w[Q];
#pragma unroll
    for (int q = 0; q < Q; q++) {
        const int i = lane + 32 * q;
        key[q] = i < n ? (unsigned)idv[q] << 11 | (unsigned)(i / k) << 5 | (unsigned)(i % k) : 0xffffffffu;
        w[q] = i < n ? wv[q] : 0.0f;
    }
    /* bitonic sort of the 32 Q keys, ascending by position q * 32 + lane */
#pragma unroll
    for (int size = 2; size <= 32 * Q; size <<= 1) {
#pragma unroll
        for (int j = size >> 1; j > 0; j >>= 1) {
            if (j == 32) {
                /* Q = 2, size 64: one ascending block, the partner the same
                 * lane's other register, register 0 the lower position */
                if (key[0] > key[Q - 1]) {
                    const unsigned tk = key[0];
                    key[0] = key[Q - 1];
                    key[Q - 1] = tk;
                    const float tw = w[0];
                    w[0] = w[Q - 1];
                    w[Q - 1] = tw;
                }
                continue;
            }
#pragma unroll
            for (int q = 0; q < Q; q++) {
                /* ascending where bit `size` of the position is 0; the
                 * lower position of a pair keeps the smaller key there */
                const bool up = ((q * 32 + lane) & size) == 0, lo = (lane & j) == 0;
                const unsigned ok = __shfl_xor_sync(0xffffffffu, key[q], j);
                const float ow = __shfl_xor_sync(0xffffffffu, w[q], j);
                if (up == lo ? ok < key[q] : ok > key[q]) {
                    key[q] = ok;
                    w[q] = ow;
                }
            }
        }
    }
    /* runs of one expert: a run starts where the expert differs from the
     * position before */
    unsigned first[Q];
    int nact = 0;
#pragma unroll
    for (int q = 0; q < Q; q++) {
        const int pos = q * 32 + lane;
        unsigned prev = __shfl_up_sync(0xffffffffu, key[q], 1);
        /* lane 0's predecessor is lane 31 of the register before */
        const unsigned wrap = __shfl_sync(0xffffffffu, key[q > 0 ? q - 1 : 0], 31);
        if (lane == 0) prev = q > 0 ? wrap : 0xffffffffu;
        const bool start = pos < n && (pos == 0 || (prev >> 11) != (key[q] >> 11));
        first[q] = __ballot_sync(0xffffffffu, start);
        nact += __popc(first[q]);
    }
#pragma unroll
    for (int q = 0; q < Q; q++) {
        const int pos = q * 32 + lane;
        if (pos >= n) continue;
        const int tok = (int)(key[q] >> 5 & 63u);
        p.sorted_tok[pos] = tok;
        p.sorted_w[pos] = w[q];
        if (!(first[q] >> lane & 1u)) continue;
        /* this run's index: the starts before it; its count: up to the next
         * start or n */
        int aidx = __popc(first[q] & ((1u << lane) - 1u));
        for (int r = 0; r < q; r++) aidx += __popc(first[r]);
        int next = n;
        const unsigned above = lane == 31 ? 0u : first[q] & ~((2u << lane) - 1u);
        if (above) next = q * 32 + __ffs(above) - 1;
        else
            for (int r = q + 1; r < Q; r++)
                if (first[r]) {
                    next = r * 32 + __ffs(first[r]) - 1;
                    break;
                }
        p.act_e[aidx] = (int)(key[q] >> 11);
        p.act_off[aidx] = pos;
        p.act_cnt[aidx] = next - pos;
    }
    if (lane == 0) {
        *p.n_active = nact;
        if (p.stat_active) *p.stat_active = nact;
    }
}

/* The same for up to 12 pairs: a pair's place is the number of pairs
 * with a smaller (expert, token) key, counted one pair at a time, 3 n
 * shuffles per lane, fewer than the sort's 30 where n is this small (one or
 * two tokens). */
static __device__ void group_pairs_count(const fm_route_params &p, int id, float w) {
    const int k = p.k, n = p.T * p.k, lane = threadIdx.x & 31;
    const bool have = lane < n;
    const int tok = have ? lane / k : 0;
    /* (expert, token) as one 32-bit key; keys can repeat (a hash-routing
     * table may name an expert twice for a token): equal keys are ordered by
     * lane, so every pair gets its own place */
    const unsigned key = (unsigned)id * 64u + (unsigned)tok;
    int rank = 0, cnt = 0, before_in_e = 0;
#pragma unroll 4
    for (int j = 0; j < n; j++) {
        unsigned kj = __shfl_sync(0xffffffffu, key, j);
        int idj = __shfl_sync(0xffffffffu, id, j);
        const bool before = kj < key || (kj == key && j < lane);
        rank += before;
        cnt += idj == id;
        before_in_e += idj == id && before;
    }
    const bool first = have && before_in_e == 0;
    const unsigned firsts = __ballot_sync(0xffffffffu, first);
    int aidx = 0;
#pragma unroll 4
    for (int j = 0; j < n; j++) {
        int idj = __shfl_sync(0xffffffffu, id, j);
        aidx += ((firsts >> j) & 1u) && idj < id;
    }
    if (have) {
        p.sorted_tok[rank] = tok;
        p.sorted_w[rank] = w;
        if (first) {
            p.act_e[aidx] = id;
            p.act_off[aidx] = rank;
            p.act_cnt[aidx] = cnt;
        }
    }
    if (lane == 0) {
        *p.n_active = __popc(firsts);
        if (p.stat_active) *p.stat_active = __popc(firsts);
    }
}

/* One block selected every token (T * k <= 32): its first warp groups the
 * pairs from the block's picks (one token, no hash table: written as they
 * are, one active expert per pair). */
static __device__ void group_pairs_warp(const fm_route_params &p, int chosen[][RT_MAXK], float chosen_w[][RT_MAXK]) {
    const int k = p.k, n = p.T * p.k, lane = threadIdx.x & 31;
    const bool have = lane < n;
    if (p.T == 1 && !p.hash) {
        /* one token's ids are distinct and ascending: nothing to count */
        group_one_token(p, chosen[0], chosen_w[0]);
        return;
    }
    const int idv[1] = {have ? chosen[lane / k][lane % k] : 0x7fffffff};
    const float wv[1] = {have ? chosen_w[lane / k][lane % k] : 0.0f};
    if (n <= 12) group_pairs_count(p, idv[0], wv[0]);
    else group_pairs_sorted<1>(p, idv, wv);
}

/* The last block of several, T * k <= 64: its first warp reads every
 * pair the blocks wrote (one L2 round trip), groups them in registers and
 * resets the block counter, instead of the block-wide counts and scans. */
static __device__ void group_pairs_last_warp(const fm_route_params &p, unsigned *done) {
    const int n = p.T * p.k, lane = threadIdx.x & 31;
    int idv[2];
    float wv[2];
#pragma unroll
    for (int q = 0; q < 2; q++) {
        const int i = lane + 32 * q;
        idv[q] = i < n ? __ldcg(&p.ids[i]) : 0;
        wv[q] = i < n ? __ldcg(&p.wts[i]) : 0.0f;
    }
    group_pairs_sorted<2>(p, idv, wv);
    if (lane == 0) *done = 0;
}

/* After every block's writes: true in the last block to finish, which then
 * sees them all (a counter in global memory, reset by the grouping; one
 * block is the last without the counter's round trip). */
static __device__ __forceinline__ bool elect_last_block(unsigned *done, unsigned *flag) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) *flag = gridDim.x == 1 || atomicAdd(done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!*flag) return false;
    __threadfence();
    return true;
}

/* More than 64 pairs, grouped by every block at once instead of by the last
 * block alone: each warp counts its token's picks into per-expert counters
 * in global memory (the count it gets back is the pair's place within its
 * expert), the blocks meet at a grid barrier (every block has let the
 * expert kernels launch, so every block is resident: nothing waits on one
 * that cannot start), then each block scans the counts, places its own
 * pairs, block 0 writes the active list, and the last block to leave
 * zeroes the counts and the barrier's two counters. */
static __device__ void group_pairs_grid(const fm_route_params &p, unsigned char *smem, int *warp_tot, bool have,
                                        const int *ch, const float *chw, int t) {
    const int E = p.E, k = p.k, tid = threadIdx.x, nth = blockDim.x, lane = tid & 31;
    unsigned *arrive = p.done + 1, *depart = p.done + 2;
    int *gcnt = (int *)(p.done + FM_ROUTE_COUNTERS);
    int *cnt = (int *)smem, *off = cnt + E; /* [E] each */
    __shared__ unsigned last;
    const bool mine = have && lane < k;
    const int e = mine ? ch[lane] : 0;
    const float w = mine ? chw[lane] : 0.0f;
    const int slot = mine ? atomicAdd(gcnt + e, 1) : 0;
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        atomicAdd(arrive, 1u);
        while (*(volatile unsigned *)arrive < gridDim.x) __nanosleep(32);
        __threadfence();
    }
    __syncthreads();
    for (int q = tid; q < E; q += nth) cnt[q] = __ldcg(gcnt + q);
    __syncthreads();
    const int n_act = counts_to_offsets(p, cnt, off, warp_tot, blockIdx.x == 0);
    if (blockIdx.x == 0 && tid == 0) {
        *p.n_active = n_act;
        if (p.stat_active) *p.stat_active = n_act;
    }
    __syncthreads();
    if (mine) {
        const int pos = off[e] + slot;
        p.sorted_tok[pos] = t;
        p.sorted_w[pos] = w;
    }
    /* every block has read the counts before the last one leaves */
    if (tid == 0) last = atomicAdd(depart, 1u) == gridDim.x - 1;
    __syncthreads();
    if (last) {
        for (int q = tid; q < E; q += nth) gcnt[q] = 0;
        if (tid == 0) {
            *arrive = 0;
            *depart = 0;
        }
    }
}

template <int RK>
__global__ void __launch_bounds__(RS_THREADS) fm_route_kernel(fm_route_params p) {
    extern __shared__ __align__(16) unsigned char rs_smem[];
    const int E = p.E, T = p.T;
    const int tid = threadIdx.x, warp = tid >> 5;
    const int wpb = blockDim.x >> 5, nth = blockDim.x; /* tokens and threads per block */
    const int t = blockIdx.x * wpb + warp;
    __shared__ int chosen[RS_WARPS][RT_MAXK];
    __shared__ float chosen_w[RS_WARPS][RT_MAXK];
    __shared__ int warp_tot[RT_WARPS];
    __shared__ unsigned is_last;
    /* the biases are written by no kernel: ask L2 for them before waiting */
    for (int e = tid * 32; e < E; e += nth * 32) {
        if (p.score_bias) prefetch_l2_line(p.score_bias + e);
        if (p.router_bias) prefetch_l2_line(p.router_bias + e);
    }
    const bool small = gridDim.x == 1 && T * p.k <= 32;
    pdl_wait();
    /* where the shared expert has its own branch, the expert kernels may
     * launch from here on, so that the routed blocks take their places on
     * the SMs before the shared expert's */
    if (p.early_trigger == 2) pdl_launch_dependents();
    /* the experts' gate/up completion counters start from zero: the
     * previous layer's down, their last reader, finished before the logits
     * kernel this grid waited on */
    if (p.gu_done)
        for (int e = blockIdx.x * nth + tid; e < E; e += gridDim.x * nth) p.gu_done[e] = 0;
    if (sel_elementwise<RK>::value && small && T <= 2) {
        /* one or two tokens: each token's sums and scores over its share of
         * the block's warps, then its first warp picks its top-k */
        const int wpt = wpb / T, tt = warp / wpt;
        unsigned char *ws = rs_smem + (size_t)tt * sel_warp_bytes(E);
        select_scores_block<RK>(p, tt, ws, tid - tt * wpt * 32, wpt * 32);
        __syncthreads();
        if (warp == tt * wpt) select_pick<RK>(p, tt, ws, chosen[tt], chosen_w[tt]);
    } else if (t < T) {
        select_token<RK>(p, t, rs_smem + (size_t)warp * sel_warp_bytes(E), chosen[warp],
                         small || (T * p.k > 64 && gridDim.x <= 128) ? chosen_w[warp] : NULL);
    }
    pdl_launch_dependents();
    if (!small && T * p.k > 64 && gridDim.x <= 128) {
        __syncwarp();
        __syncthreads(); /* the selection's scratch becomes the offsets */
        group_pairs_grid(p, rs_smem, warp_tot, t < T, chosen[warp], chosen_w[warp], t);
        return;
    }
    if (small) {
        __syncthreads();
        if (warp == 0) group_pairs_warp(p, chosen, chosen_w);
        return;
    }

    /* the last block groups the pairs by expert */
    if (!elect_last_block(p.done, &is_last)) return;
    if (T * p.k <= 64) {
        if (warp == 0) group_pairs_last_warp(p, p.done);
        return;
    }
    group_pairs(p, rs_smem, warp_tot, p.done);
}


/* The pre-routed path: the caller's ids and weights (an id outside [0, E)
 * contributes nothing: it is written as -1, which the grouping skips), then
 * the block-wide grouping by the last block. */
__global__ void __launch_bounds__(RT_THREADS) fm_preroute_kernel(fm_route_params p) {
    extern __shared__ __align__(16) unsigned char rs_smem[];
    __shared__ int warp_tot[RT_WARPS];
    __shared__ unsigned is_last;
    const int n = p.T * p.k, tid = threadIdx.x, nth = blockDim.x;
    pdl_wait();
    if (p.gu_done)
        for (int e = blockIdx.x * nth + tid; e < p.E; e += gridDim.x * nth) p.gu_done[e] = 0;
    for (int i = blockIdx.x * nth + tid; i < n; i += gridDim.x * nth) {
        const int id = p.pre_ids[i];
        const bool ok = id >= 0 && id < p.E;
        p.ids[i] = ok ? id : -1;
        p.wts[i] = ok ? p.pre_wts[i] : 0.0f;
    }
    pdl_launch_dependents();
    if (!elect_last_block(p.done, &is_last)) return;
    group_pairs(p, rs_smem, warp_tot, p.done);
}

typedef void (*fm_route_kfn)(fm_route_params);
static fm_route_kfn route_kernel_for(int route) {
    switch (route) {
    case FM_ROUTE_SOFTMAX: return fm_route_kernel<FM_ROUTE_SOFTMAX>;
    case FM_ROUTE_GPTOSS: return fm_route_kernel<FM_ROUTE_GPTOSS>;
    case FM_ROUTE_DSV4: return fm_route_kernel<FM_ROUTE_DSV4>;
    default: return fm_route_kernel<FM_ROUTE_NOAUX_TC>;
    }
}

extern "C" size_t fm_cuda_route_smem(int H, int E) {
    (void)H;
    size_t a = RS_WARPS * sel_warp_bytes(E);
    size_t b = (size_t)E * 12; /* the grouping's counts, offsets, cursors */
    return a > b ? a : b;
}

extern "C" fm_status fm_cuda_route_prepare(size_t smem) {
    if (smem > 48 * 1024) {
        for (int rk = FM_ROUTE_NOAUX_TC; rk <= FM_ROUTE_DSV4; rk++)
            FM_CU(cudaFuncSetAttribute(route_kernel_for(rk), cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        FM_CU(cudaFuncSetAttribute(fm_preroute_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    }
    return FM_OK;
}

static cudaLaunchConfig_t sel_cfg(cudaStream_t s, int pdl, size_t smem, cudaLaunchAttribute *attr) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.stream = s;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    cfg.dynamicSmemBytes = smem;
    return cfg;
}

extern "C" fm_status fm_cuda_launch_select(const fm_route_params *p, size_t smem, int pdl, cudaStream_t s) {
    cudaLaunchAttribute attr[1];
    cudaLaunchConfig_t cfg = sel_cfg(s, pdl, smem, attr);
    cfg.blockDim = dim3(RS_THREADS);
    cfg.gridDim = dim3((unsigned)((p->T + RS_WARPS - 1) / RS_WARPS));
    FM_CU(cudaLaunchKernelEx(&cfg, route_kernel_for(p->route), *p));
    FM_CU_LAUNCH("fm_route_kernel");
    return FM_OK;
}

extern "C" fm_status fm_cuda_launch_preroute(const fm_route_params *p, size_t smem, int pdl, cudaStream_t s) {
    cudaLaunchAttribute attr[1];
    cudaLaunchConfig_t cfg = sel_cfg(s, pdl, smem, attr);
    const int n = p->T * p->k;
    int blocks = (n + RT_THREADS - 1) / RT_THREADS;
    if (blocks > 64) blocks = 64;
    cfg.blockDim = dim3(RT_THREADS);
    cfg.gridDim = dim3((unsigned)blocks);
    FM_CU(cudaLaunchKernelEx(&cfg, fm_preroute_kernel, *p));
    FM_CU_LAUNCH("fm_preroute_kernel");
    return FM_OK;
}

extern "C" fm_status fm_cuda_launch_route(fm_route_params *p, size_t smem, int pdl, int parts, cudaStream_t s) {
    if (p->k > RT_MAXK) return fm_error(FM_E_UNSUPPORTED, "CUDA routing supports top-k up to %d, not %d", RT_MAXK, p->k);
    if (p->H % 4) return fm_error(FM_E_UNSUPPORTED, "CUDA routing needs the hidden size %d to be a multiple of 4", p->H);
    if (p->Hp % 8) return fm_error(FM_E_UNSUPPORTED, "CUDA routing needs the padded hidden size %d to be a multiple of 8", p->Hp);
    fm_status st;
    if (p->pre_ids) {
        if ((st = fm_cuda_launch_prep(p, pdl, s))) return st;
        return fm_cuda_launch_preroute(p, smem, pdl, s);
    }
    if ((parts & FM_ROUTE_PART_LOGITS) && (st = fm_cuda_launch_logits(p, pdl, s))) return st;
    if (!(parts & FM_ROUTE_PART_SELECT)) return FM_OK;
    return fm_cuda_launch_select(p, smem, pdl, s);
}
