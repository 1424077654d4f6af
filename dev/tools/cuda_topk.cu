/*
 * cuda_topk: what one token's top-k costs on an SM, as the engine runs it.
 * The one-token launch (expert_splitk.cu) and the selection kernel
 * (route_select.cu) pick a token's k experts on one warp with the routing's
 * own code (select_pick of route_pick.cuh, included here, not copied), and
 * the layer's stamps put that pick at 4,000 – 6,000 cycles, several times
 * what its instructions should take. This tool runs that code alone, on one
 * block of 256 threads per SM over scores already in shared memory, in the
 * shapes of the TP8 ranks' routers, and times it with clock64 in three
 * states of the SM's caches:
 *
 *   first   the kernel's first launch (its code comes from device memory;
 *           "-" where an earlier router shape ran the same kernel)
 *   cold    after 256 KB of other code ran on every SM (from L2)
 *   warm    the same launch again at once
 *
 * in three arrangements of the block:
 *
 *   barrier  warp 0 picks, the other warps wait at a block barrier (the
 *            selection kernel)
 *   spin     warp 0 picks, the others spin on the count of picks found
 *            with a short sleep (the one-token launch); warp 1 stamps the
 *            arrival of the first and of the last pick
 *   rank     every thread ranks its experts by counting the keys above
 *            them (no rounds); the picks land at their ranks (a design to
 *            weigh against the rounds, here only)
 *
 * Every run checks its picks against the host's top-k of the same scores
 * (larger score first, ties to the lower expert), and the tool exits 1 on a
 * mismatch. Medians over the SMs, then over the runs.
 *
 *   cuda_topk [--preset glm-5|deepseek-v4-flash|kimi-k2|all] [--reps 1..1000]
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#define TOOL "cuda_topk"
#include "cuda_check.cuh"
#include "route_pick.cuh"

#define TK_THREADS 256
/* per block: the end of the pick, the first pick's arrival, the last's */
#define TK_STAMPS 3

enum { TK_BARRIER, TK_SPIN, TK_RANK };

/* The top-k by counting: thread i ranks experts i, i + 256, ... against
 * every key (the keys above it, and equal keys of lower experts), and a rank
 * below k is a pick's place. The padding past E holds key 0, below every
 * expert's (score_key is at least 1). */
static __device__ void rank_pick(int E, int k, unsigned *key, const float *sel, int *order) {
    const int Ep = lg_stride(E);
    for (int e = threadIdx.x; e < Ep; e += TK_THREADS) key[e] = e < E ? score_key(sel[e]) : 0u;
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += TK_THREADS) {
        const unsigned me = key[e];
        int r = 0;
        for (int q = 0; q < Ep; q += 4) {
            const uint4 o = *(const uint4 *)&key[q];
            r += (o.x > me || (o.x == me && q < e)) + (o.y > me || (o.y == me && q + 1 < e)) +
                 (o.z > me || (o.z == me && q + 2 < e)) + (o.w > me || (o.w == me && q + 3 < e));
        }
        if (r < k) order[r] = e;
    }
    __syncthreads();
}

/* scores [gridDim.x][E] biased (sel) and unbiased (wsc); out: [gridDim.x][k]
 * picks in the order found (best first); cyc [gridDim.x][TK_STAMPS] */
template <int RK, int MODE>
__global__ void __launch_bounds__(TK_THREADS, 1) topk_kernel(fm_route_params p, const float *scores, const float *wscores,
                                                            int *out, long long *cyc) {
    extern __shared__ __align__(16) unsigned char ws[];
    __shared__ int pk_ord[RT_MAXK + 1];
    __shared__ int chosen[RT_MAXK];
    __shared__ float chosen_w[RT_MAXK];
    const int tid = threadIdx.x, wi = tid >> 5, lane = tid & 31, E = p.E, Ep = lg_stride(E), k = p.k;
    float *lg = (float *)ws, *sel = lg + Ep, *wsc = sel + Ep;
    const float *src = scores + (size_t)blockIdx.x * E, *wsrc = wscores + (size_t)blockIdx.x * E;
    for (int e = tid; e < Ep; e += TK_THREADS) {
        sel[e] = e < E ? src[e] : 0.0f;
        wsc[e] = e < E ? wsrc[e] : 0.0f;
    }
    if (tid == 0) pk_ord[RT_MAXK] = 0;
    __syncthreads();
    const long long t0 = clock64();
    long long *c = cyc + (size_t)blockIdx.x * TK_STAMPS;
    if (MODE == TK_RANK) {
        rank_pick(E, k, (unsigned *)lg, sel, pk_ord);
        if (tid == 0) c[0] = clock64() - t0;
    } else {
        if (wi == 0) {
            select_pick<RK>(p, 0, ws, chosen, chosen_w, false, MODE == TK_SPIN ? pk_ord : nullptr, nullptr);
            if (lane == 0) c[0] = clock64() - t0;
        } else if (MODE == TK_SPIN) {
            /* as the one-token launch's warps wait for their slot's pick */
            while (((volatile int *)pk_ord)[RT_MAXK] < 1) __nanosleep(20);
            if (wi == 1 && lane == 0) c[1] = clock64() - t0;
            while (((volatile int *)pk_ord)[RT_MAXK] < k) __nanosleep(20);
            if (wi == 1 && lane == 0) c[2] = clock64() - t0;
        }
        __syncthreads();
        /* the barrier arrangement keeps the picks ascending only: their
         * order comes back from the scores, best first */
        if (MODE == TK_BARRIER && tid == 0) {
            for (int i = 0; i < k; i++) pk_ord[i] = chosen[i];
            for (int i = 1; i < k; i++)
                for (int j = i; j > 0 && (sel[pk_ord[j]] > sel[pk_ord[j - 1]] ||
                                          (sel[pk_ord[j]] == sel[pk_ord[j - 1]] && pk_ord[j] < pk_ord[j - 1]));
                     j--) {
                    const int t = pk_ord[j];
                    pk_ord[j] = pk_ord[j - 1];
                    pk_ord[j - 1] = t;
                }
        }
        __syncthreads();
    }
    if (tid < k) out[(size_t)blockIdx.x * k + tid] = pk_ord[tid];
}

typedef void (*tk_fn)(fm_route_params, const float *, const float *, int *, long long *);

struct tk_case {
    const char *name;
    int E, k, route;
};
static const tk_case k_cases[] = {
    {"glm-5", 256, 8, FM_ROUTE_NOAUX_TC},
    {"deepseek-v4-flash", 256, 6, FM_ROUTE_DSV4},
    {"kimi-k2", 384, 8, FM_ROUTE_NOAUX_TC},
};

template <int RK> static tk_fn kernel_for(int mode) {
    return mode == TK_BARRIER ? topk_kernel<RK, TK_BARRIER> : mode == TK_SPIN ? topk_kernel<RK, TK_SPIN>
                                                                               : topk_kernel<RK, TK_RANK>;
}

static void usage_error(const char *arg) {
    fprintf(stderr,
            "%s: bad argument '%s' (usage: %s [--preset glm-5|deepseek-v4-flash|kimi-k2|all] [--reps 1..1000])\n",
            TOOL, arg, TOOL);
    exit(2);
}

/* a fixed sequence of scores in (0, 1) and their unbiased halves */
static void make_scores(int blocks, int E, std::vector<float> &sel, std::vector<float> &wsc) {
    sel.resize((size_t)blocks * E);
    wsc.resize(sel.size());
    uint64_t s = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < sel.size(); i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        wsc[i] = (float)((s >> 40) + 1) / (float)(1ull << 24);
        /* a bias of a few hundredths, as the routers' correction biases */
        sel[i] = wsc[i] + (float)((s >> 20) & 0xFF) / 8192.0f;
    }
}

/* the host's top-k of one block's scores: larger first, ties to the lower */
static std::vector<int> host_topk(const float *sel, int E, int k) {
    std::vector<int> idx(E);
    for (int e = 0; e < E; e++) idx[e] = e;
    std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return sel[a] > sel[b]; });
    idx.resize(k);
    return idx;
}

int main(int argc, char **argv) {
    int reps = 5;
    const char *preset = "all";
    for (int i = 1; i < argc; i++) {
        if (tool_int_opt(argc, argv, &i, "--reps", 1, 1000, &reps, usage_error)) continue;
        if (!strcmp(argv[i], "--preset")) {
            bool ok = i + 1 < argc && !strcmp(argv[i + 1], "all");
            for (const tk_case &c : k_cases) ok = ok || (i + 1 < argc && !strcmp(argv[i + 1], c.name));
            if (!ok) usage_error("--preset");
            preset = argv[++i];
        } else {
            usage_error(argv[i]);
        }
    }
    int sms = 0;
    cudaDeviceProp prop;
    tool_device(&sms, &prop);
    long long *cyc = NULL;
    CK(cudaMalloc(&cyc, sizeof(long long) * TK_STAMPS * sms));
    printf("%s: %s, %d SMs, one block of %d threads per SM; cycles (clock64), median over the SMs "
           "(cold and warm: then the median of %d runs)\n",
           TOOL, prop.name, sms, TK_THREADS, reps);
    printf("%-18s %4s %2s %-8s %-10s %8s %8s %8s\n", "router", "E", "k", "block", "stamp", "first", "cold", "warm");
    int bad = 0;
    std::vector<tk_fn> ran; /* kernels launched so far: their first launch is past */
    for (const tk_case &tc : k_cases) {
        if (strcmp(preset, "all") && strcmp(preset, tc.name)) continue;
        std::vector<float> hs, hw;
        make_scores(sms, tc.E, hs, hw);
        float *ds = NULL, *dw = NULL;
        int *dout = NULL;
        CK(cudaMalloc(&ds, hs.size() * sizeof(float)));
        CK(cudaMalloc(&dw, hw.size() * sizeof(float)));
        CK(cudaMalloc(&dout, sizeof(int) * (size_t)sms * tc.k));
        CK(cudaMemcpy(ds, hs.data(), hs.size() * sizeof(float), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dw, hw.data(), hw.size() * sizeof(float), cudaMemcpyHostToDevice));
        fm_route_params p;
        memset(&p, 0, sizeof p);
        p.route = tc.route;
        p.E = tc.E;
        p.k = tc.k;
        p.T = 1;
        p.n_group = p.topk_group = 1;
        p.norm_topk = 1;
        p.scaling = 2.5f;
        const size_t smem = FM_SEL_WARP_BYTES(tc.E);
        std::vector<int> ref((size_t)sms * tc.k);
        for (int b = 0; b < sms; b++) {
            std::vector<int> r = host_topk(hs.data() + (size_t)b * tc.E, tc.E, tc.k);
            std::copy(r.begin(), r.end(), ref.begin() + (size_t)b * tc.k);
        }
        static const char *const mode_name[] = {"barrier", "spin", "rank"};
        for (int mode = TK_BARRIER; mode <= TK_RANK; mode++) {
            tk_fn f = tc.route == FM_ROUTE_DSV4 ? kernel_for<FM_ROUTE_DSV4>(mode) : kernel_for<FM_ROUTE_NOAUX_TC>(mode);
            std::vector<long long> h((size_t)TK_STAMPS * sms);
            std::vector<int> got((size_t)sms * tc.k);
            /* one launch: the median over the SMs of each stamp; the picks checked */
            auto run = [&](long long *med) {
                CK(cudaMemset(cyc, 0, sizeof(long long) * TK_STAMPS * sms));
                f<<<sms, TK_THREADS, smem>>>(p, ds, dw, dout, cyc);
                CK(cudaGetLastError());
                CK(cudaDeviceSynchronize());
                CK(cudaMemcpy(h.data(), cyc, sizeof(long long) * TK_STAMPS * sms, cudaMemcpyDeviceToHost));
                CK(cudaMemcpy(got.data(), dout, sizeof(int) * got.size(), cudaMemcpyDeviceToHost));
                if (got != ref && !bad++) {
                    for (int b = 0; b < sms; b++)
                        for (int j = 0; j < tc.k; j++)
                            if (got[(size_t)b * tc.k + j] != ref[(size_t)b * tc.k + j]) {
                                fprintf(stderr, "%s: %s, %s: SM block %d pick %d is expert %d, the host's %d\n", TOOL,
                                        tc.name, mode_name[mode], b, j, got[(size_t)b * tc.k + j],
                                        ref[(size_t)b * tc.k + j]);
                                b = sms;
                                break;
                            }
                }
                for (int s = 0; s < TK_STAMPS; s++) {
                    std::vector<long long> v(sms);
                    for (int b = 0; b < sms; b++) v[b] = h[(size_t)b * TK_STAMPS + s];
                    med[s] = tool_median(v);
                }
            };
            long long first[TK_STAMPS];
            const bool fresh = std::find(ran.begin(), ran.end(), f) == ran.end();
            ran.push_back(f);
            run(first);
            std::vector<long long> cold[TK_STAMPS], warm[TK_STAMPS];
            for (int r = 0; r < reps; r++) {
                tool_evict_code(sms);
                long long c[TK_STAMPS], w[TK_STAMPS];
                run(c);
                run(w);
                for (int s = 0; s < TK_STAMPS; s++) {
                    cold[s].push_back(c[s]);
                    warm[s].push_back(w[s]);
                }
            }
            static const char *const stamp_name[] = {"done", "first pick", "last pick"};
            for (int s = 0; s < (mode == TK_SPIN ? TK_STAMPS : 1); s++) {
                char fb[24] = "-";
                if (fresh) snprintf(fb, sizeof fb, "%lld", first[s]);
                printf("%-18s %4d %2d %-8s %-10s %8s %8lld %8lld\n", tc.name, tc.E, tc.k, mode_name[mode], stamp_name[s],
                       fb, tool_median(cold[s]), tool_median(warm[s]));
            }
        }
        CK(cudaFree(ds));
        CK(cudaFree(dw));
        CK(cudaFree(dout));
    }
    CK(cudaFree(cyc));
    if (bad) {
        fprintf(stderr, "%s: %d runs picked other experts than the host's top-k\n", TOOL, bad);
        return 1;
    }
    return 0;
}
