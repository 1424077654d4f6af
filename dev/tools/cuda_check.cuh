/* The CUDA tools' error check: CK(call) prints the tool's name (TOOL, a
 * string the including file defines first), the call, the error and the
 * line to stderr and exits with status 1. Also their shared argument and
 * device helpers. */
#ifndef FM_TOOLS_CUDA_CHECK_CUH
#define FM_TOOLS_CUDA_CHECK_CUH
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
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

/* the current device's SM count and properties (exits on an error) */
static inline void tool_device(int *sms, cudaDeviceProp *prop) {
    int dev = 0;
    CK(cudaGetDevice(&dev));
    CK(cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev));
    CK(cudaGetDeviceProperties(prop, dev));
}
#endif
