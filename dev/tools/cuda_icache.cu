/*
 * cuda_icache: what code costs the first time an SM runs it. The routing's
 * selection runs once per layer, after the expert kernels, and its steps
 * take several times the cycles their instructions issue in; this tool times
 * straight-line code (independent integer multiply-adds, one SASS instruction each,
 * no memory access) of 4 to 64 KB on one warp of every SM, with clock64
 * around the code, in three states:
 *
 *   first   the kernel's first launch (its code comes from device memory)
 *   cold    after kernels of 256 KB of other code ran on every SM (the
 *           code comes from L2, as a kernel's that other kernels ran
 *           between)
 *   warm    the same kernel launched again at once (the SM's caches)
 *
 * and prints, per size, the median cycles over the SMs of each state and the
 * cycles the cold run spends beyond the warm one per 128-byte line of code.
 * `python3 dev/analysis/sass_lines.py` on the tool's cubin counts what each
 * kernel really holds (the sizes here are what the source asks for).
 *
 *   cuda_icache [--reps N]       (default 5: the cold and warm runs repeated,
 *                                 each SM's median kept)
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#define TOOL "cuda_icache"
#include "cuda_check.cuh"

typedef void (*kfn)(unsigned *, long long *, unsigned);

static void usage_error(const char *arg) {
    fprintf(stderr, "%s: bad argument '%s' (usage: %s [--reps 1..1000])\n", TOOL, arg, TOOL);
    exit(2);
}

int main(int argc, char **argv) {
    int reps = 5;
    for (int i = 1; i < argc; i++)
        if (!tool_int_opt(argc, argv, &i, "--reps", 1, 1000, &reps, usage_error)) usage_error(argv[i]);
    int sms = 0;
    cudaDeviceProp prop;
    tool_device(&sms, &prop);
    unsigned *sink = NULL;
    long long *cyc = NULL;
    CK(cudaMalloc(&sink, sizeof(unsigned) * sms));
    CK(cudaMalloc(&cyc, sizeof(long long) * sms));
    std::vector<long long> h(sms);

    /* the measured kernels, 4 .. 64 KB of multiply-adds (tool_evict_code's
     * four distinct 64 KB kernels push them out of the SMs' caches) */
    const int sizes[] = {256, 1024, 2048, 4096};
    const kfn meas[] = {tool_straight_kernel<256, 1>, tool_straight_kernel<1024, 2>, tool_straight_kernel<2048, 3>,
                        tool_straight_kernel<4096, 4>};
    auto run = [&](kfn f) -> long long {
        f<<<sms, 32>>>(sink, cyc, 3u);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(h.data(), cyc, sizeof(long long) * sms, cudaMemcpyDeviceToHost));
        return tool_median(h);
    };
    printf("%s: %s, %d SMs, one warp per SM; median cycles over the SMs (cold and warm: median of %d runs)\n",
           TOOL, prop.name, sms, reps);
    printf("%8s %8s %10s %10s %10s %18s\n", "KB", "IMADs", "first", "cold", "warm", "cold-warm per line");
    for (int s = 0; s < 4; s++) {
        const long long first = run(meas[s]);
        std::vector<long long> cold, warm;
        for (int r = 0; r < reps; r++) {
            tool_evict_code(sms);
            cold.push_back(run(meas[s]));
            warm.push_back(run(meas[s]));
        }
        const long long c = tool_median(cold), w = tool_median(warm);
        const double lines = sizes[s] * 16.0 / 128.0;
        printf("%8d %8d %10lld %10lld %10lld %18.1f\n", sizes[s] * 16 / 1024, sizes[s], first, c, w, (c - w) / lines);
    }
    CK(cudaFree(sink));
    CK(cudaFree(cyc));
    return 0;
}
