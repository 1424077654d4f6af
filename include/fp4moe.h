/*
 * fp4moe — decode-time Mixture-of-Experts with 4-bit float experts.
 *
 * One public header. Every name carries the prefix fm_ / FM_. Every function
 * that can fail returns an fm_status; fm_last_error() then holds a message
 * that names the problem (thread-local, valid until the next failing call on
 * the same thread).
 *
 * Modules (one folder each under src/):
 *   util     errors, RNG, clocks, thread pool, small helpers
 *   formats  E2M1, E4M3, E8M0, BF16, F16 and NVFP4 / MXFP4 (de)quantization
 *   io       safetensors, sharded checkpoints, config.json, expert binding, gen
 *   route    router math for every family (FP32)
 *   cpu      float64 reference and the fast CPU engine
 *   cuda     the CUDA backend (optional; built when nvcc is found)
 *   tune     kernel configs, tuned-config files, explain
 *   prof     phases, telemetry (NVML), roofline model, Chrome trace, HTML report
 *   trace    analysis of other engines' PyTorch-profiler traces
 *   parallel tensor- / expert-parallel sharding (CPU simulation and NCCL)
 *   run      driving a device: forward a file, bench over batch sizes
 */
#ifndef FP4MOE_H
#define FP4MOE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FM_VERSION "0.1.0"

struct fm_tune_key; /* defined in the tuning section */

/* The sections, in order (later ones use the types of earlier ones). */
#include "fp4moe/core.h"
#include "fp4moe/model.h"
#include "fp4moe/engine.h"
#include "fp4moe/cuda.h"
#include "fp4moe/tune.h"
#include "fp4moe/parallel.h"
#include "fp4moe/prof.h"
#include "fp4moe/trace.h"
#include "fp4moe/run.h"

#ifdef __cplusplus
}
#endif
#endif /* FP4MOE_H */
