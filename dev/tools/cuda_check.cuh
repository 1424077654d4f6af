/* The CUDA tools' error check: CK(call) prints the tool's name (TOOL, a
 * string the including file defines first), the call, the error and the
 * line to stderr and exits with status 1. */
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
#endif
