/* CPU engine internals shared by the reference, the fast engine and the
 * benchmark (not public API). */
#ifndef FM_CPU_INTERNAL_H
#define FM_CPU_INTERNAL_H
#include "fp4moe.h"

#ifdef __cplusplus
extern "C" { /* the CUDA engine (C++) uses the checks below */
#endif

/* Checks a layer against its description before any kernel touches it:
 * formats, shapes, strides, pointers. Messages name layer, expert, matrix. */
fm_status fm_cpu_check_layer(const fm_model_desc *d, const fm_moe_layer *l);
/* The part of that check the pre-routed experts need: everything but the
 * router (shape agreement with d, formats, strides, pointers). */
fm_status fm_cpu_check_experts(const fm_model_desc *d, const fm_moe_layer *l);

/* Converts T x H activations (F32/BF16/F16, any alignment) to F32 and
 * rejects non-finite values, naming token and feature. */
fm_status fm_cpu_load_x(const void *x, fm_dtype xdt, int T, int64_t H, float *out);
/* The same check without the conversion (any alignment): FM_E_NUMERIC
 * "input token t, feature h is v" for the first value that is not finite. */
fm_status fm_check_x_finite(const void *x, fm_dtype xdt, int T, int64_t H);
/* A layer's output, every engine: FM_E_NUMERIC "layer L: <what> token t,
 * feature h is v (weights or scales not finite?)" for the first value that
 * is not finite. */
fm_status fm_check_out_finite(int layer, const char *what, const float *out, int T, int64_t H);

/* Bytes of weights one forward call reads: the routed experts that ids
 * name (each once), the shared expert and the router. */
int64_t fm_cpu_bytes_read(const fm_moe_layer *l, const int32_t *ids, int T, int *n_active);

/* A persistent pool of n threads (the caller is thread 0). run() calls
 * fn(ctx, tid) on every thread and returns when all have finished. */
typedef struct fm_pool fm_pool;
typedef void (*fm_pool_fn)(void *ctx, int tid);
fm_status fm_pool_new(int n_threads, fm_pool **out);
void fm_pool_run(fm_pool *p, fm_pool_fn fn, void *ctx);
int fm_pool_size(const fm_pool *p);
void fm_pool_free(fm_pool *p);

/* Threads to use when the caller passes n <= 0: the CPUs this process may
 * run on. */
int fm_cpu_default_threads(void);

#ifdef __cplusplus
}
#endif
#endif
