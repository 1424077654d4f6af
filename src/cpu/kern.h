/*
 * CPU kernels (internal). One set per ISA: portable C, AVX2, AVX-512,
 * chosen at run time.
 *
 * Layout of activations fed to FP4 weights: within every 16-element block
 * the even elements come first, then the odd ones ("split-16"). A packed
 * byte holds elements 2j (low nibble) and 2j+1 (high nibble), so decoding
 * 8 bytes' low nibbles yields the block's evens and their high nibbles the
 * odds, in order; permuting the activations once per token instead of the
 * weights for every row saves the interleaving shuffles. BF16 weights use
 * the natural order. The gate/up kernel writes its output (the down
 * projection's input) directly in the layout down's format wants.
 *
 * Every (row, token) dot product is one fixed sequence of operations in
 * every kernel, whatever the number of tokens or rows handled together, so
 * a token's result does not depend on the rest of the batch.
 */
#ifndef FM_CPU_KERN_H
#define FM_CPU_KERN_H
#include "fp4moe.h"

/* Position of natural index c in the split-16 layout of format f. */
static inline int64_t fm_cpu_layout_pos(fm_qformat f, int64_t c) {
    if (f == FM_QF_BF16) return c;
    int64_t j = c & 15;
    return (c & ~(int64_t)15) | ((j & 1) ? 8 + (j >> 1) : (j >> 1));
}

/* Scale tables: decoded scales, and decoded scale x 0.5 for the kernels
 * that decode E2M1 as twice its value (small integers, exact as int8). */
extern float fm_cpu_lut_e4m3[256];
extern float fm_cpu_lut_e8m0[256];
extern float fm_cpu_lut_e4m3_half[256];
extern float fm_cpu_lut_e8m0_half[256];
void fm_cpu_luts_init(void);

/* The per-tensor factor of a matrix's rows (scale2 for NVFP4, else 1). */
static inline float fm_cpu_row_scale(const fm_qmatrix *m) {
    return m->fmt == FM_QF_NVFP4 ? m->scale2 : 1.0f;
}

/* Gate and up rows [r0, r1) for n tokens: h[t][pos(r)] = act(gate.x_t, up.x_t). */
typedef struct {
    const fm_qmatrix *gate, *up;  /* [I, H]                                   */
    const float *const *x;        /* n rows of H floats, in gate's layout      */
    int n;
    float *h;                     /* n rows of ldh floats                     */
    int64_t ldh;
    fm_qformat h_fmt;             /* layout of h (the down matrix's format)   */
    int64_t r0, r1;
    fm_act_kind act;
    float alpha, limit;
    float *wbuf;                  /* per-thread scratch, fm_cpu_wbuf_floats   */
} fm_gu_task;

/* Down rows [r0, r1) for n tokens: out[t][r] += w[t] * (down.h_t + bias). */
typedef struct {
    const fm_qmatrix *down;       /* [H, I]                                    */
    const float *h;               /* n rows of ldh floats, in down's layout   */
    int64_t ldh;
    int n;
    float *const *out;            /* n rows of H floats                       */
    const float *w;               /* n routing weights; NULL means 1          */
    int64_t r0, r1;
    float *wbuf;                  /* per-thread scratch, fm_cpu_wbuf_floats   */
} fm_down_task;

typedef struct {
    const char *name;
    void (*gate_up)(const fm_gu_task *t);
    void (*down)(const fm_down_task *t);
    /* Position of natural index c of a cols-long activation row in the
     * layout these kernels read for format f. */
    int64_t (*pos)(fm_qformat f, int64_t cols, int64_t c);
} fm_cpu_kernels;

/* Per-thread scratch (floats) the kernels need for rows of cols inputs. */
static inline int64_t fm_cpu_wbuf_floats(int64_t cols) { return 3 * cols + 64; }

extern const fm_cpu_kernels fm_cpu_kern_scalar;
extern const fm_cpu_kernels fm_cpu_kern_avx2;
extern const fm_cpu_kernels fm_cpu_kern_avx512;

/* Activation of one (gate, up) pair in FP32, as the models define it. */
#include <math.h>
static inline float fm_cpu_act(fm_act_kind act, float g, float u, float alpha, float limit) {
    if (act == FM_ACT_GPTOSS) {
        /* Written so that NaN passes through, as torch.clamp does. */
        if (g > limit) g = limit;
        if (u > limit) u = limit;
        else if (u < -limit) u = -limit;
        return g * (1.0f / (1.0f + expf(-alpha * g))) * (u + 1.0f);
    }
    if (limit > 0.0f) {
        /* DeepSeek-V4 (swiglu_limit in config.json): SiLU-gated with the
         * same clamps as gpt-oss, gate <= limit, -limit <= up <= limit. */
        if (g > limit) g = limit;
        if (u > limit) u = limit;
        else if (u < -limit) u = -limit;
    }
    return g / (1.0f + expf(-g)) * u;
}

#endif
