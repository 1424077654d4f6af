/* The CUDA tools' error check: CK(call) prints the tool's name (TOOL, a
 * string the including file defines first), the call, the error and the
 * line to stderr and exits with status 1. Also their shared argument and
 * device helpers. */
#ifndef FM_TOOLS_CUDA_CHECK_CUH
#define FM_TOOLS_CUDA_CHECK_CUH
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>
#define CK(x)                                                                                        \
    do {                                                                                             \
        cudaError_t e_ = (x);                                                                        \
        if (e_ != cudaSuccess) {                                                                     \
            fprintf(stderr, "%s: %s: %s (line %d)\n", TOOL, #x, cudaGetErrorString(e_), __LINE__); \
            exit(1);                                                                                 \
        }                                                                                            \
    } while (0)

/* s as a whole decimal number in [lo, hi] into *out: 0, else -1 */
static inline int tool_parse_int(const char *s, int lo, int hi, int *out) {
    char *end = NULL;
    long v = strtol(s, &end, 10);
    if (!s[0] || *end || v < lo || v > hi) return -1;
    *out = (int)v;
    return 0;
}

/* argv[*i] is name: its value, a whole number in [lo, hi], into *out, *i
 * past it, and true (a missing or bad value goes to usage(name), which
 * exits); another argument: false */
static inline bool tool_int_opt(int argc, char **argv, int *i, const char *name, int lo, int hi, int *out,
                                void (*usage)(const char *)) {
    if (strcmp(argv[*i], name)) return false;
    if (*i + 1 >= argc || tool_parse_int(argv[*i + 1], lo, hi, out)) usage(name);
    ++*i;
    return true;
}

/* the current device's SM count and properties (exits on an error) */
static inline void tool_device(int *sms, cudaDeviceProp *prop) {
    int dev = 0;
    CK(cudaGetDevice(&dev));
    CK(cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev));
    CK(cudaGetDeviceProperties(prop, dev));
}

static inline long long tool_median(std::vector<long long> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

/* N multiply-adds over 8 independent registers (no long dependent chain),
 * by a multiplier known only at run time, so that ptxas cannot fold them:
 * one IMAD each, timed with clock64 into cyc[block]; SALT makes kernels of
 * equal N distinct code (cuda_icache times them; other tools run them to
 * push their own code out of the SMs' caches). */
template <int N, int SALT>
__global__ void __launch_bounds__(32) tool_straight_kernel(unsigned *sink, long long *cyc, unsigned m) {
    unsigned a[8];
#pragma unroll
    for (int j = 0; j < 8; j++) a[j] = threadIdx.x + j + SALT;
    __syncwarp();
    const long long t0 = clock64();
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("mad.lo.u32 %0, %0, %1, %2;" : "+r"(a[i & 7]) : "r"(m), "r"((unsigned)((i * 7 + SALT) & 0xffff)));
    __syncwarp();
    const long long t1 = clock64();
    unsigned s = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) s += a[j];
    if (threadIdx.x == 0) {
        cyc[blockIdx.x] = t1 - t0;
        sink[blockIdx.x] = s;
    }
}

/* Runs 256 KB of other code on every SM (four distinct 64 KB straight-line
 * kernels), so that the caller's kernels come back cold, from L2. */
static inline void tool_evict_code(int sms) {
    static unsigned *sink;
    static long long *cyc;
    if (!sink) {
        CK(cudaMalloc(&sink, sizeof(unsigned) * sms));
        CK(cudaMalloc(&cyc, sizeof(long long) * sms));
    }
    tool_straight_kernel<4096, 11><<<sms, 32>>>(sink, cyc, 3u);
    tool_straight_kernel<4096, 12><<<sms, 32>>>(sink, cyc, 3u);
    tool_straight_kernel<4096, 13><<<sms, 32>>>(sink, cyc, 3u);
    tool_straight_kernel<4096, 14><<<sms, 32>>>(sink, cyc, 3u);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
}
#endif
