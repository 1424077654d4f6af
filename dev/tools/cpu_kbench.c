/*
 * One-core timing of the CPU engine's kernels alone (no routing, no thread
 * pool), for the decode-speed figures in docs/perf.md: the gate/up kernel
 * over E experts of I x H NVFP4 rows (work items of 32 rows, as the engine
 * hands them out), or the down kernel over E experts of H x I rows in items
 * of --down-rows output rows that visit every expert. Prints the best of
 * --reps passes as weights/s and GB/s of NVFP4 bytes.
 *
 *   cpu_kbench [--isa avx2|avx512|scalar] [--experts E] [--tokens T]
 *              [--rows I] [--cols H] [--reps R] [--down] [--down-rows N]
 *
 * E x (bytes of one expert) larger than the last-level cache measures the
 * stream from memory; E = 1 with small I measures the kernel from cache.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/kern.h"
#include "util/util.h"

static int arg_int(const char *flag, const char *v, long lo, long hi, long *out) {
    char *end = NULL;
    long x = v ? strtol(v, &end, 10) : 0;
    if (!v || *end || x < lo || x > hi) {
        fprintf(stderr, "cpu_kbench: %s needs an integer in [%ld, %ld]\n", flag, lo, hi);
        return 0;
    }
    *out = x;
    return 1;
}

/* Random NVFP4 rows with scales near 1 (E4M3 0x30..0x3F). */
static int make_matrix(fm_qmatrix *m, int64_t rows, int64_t cols, uint64_t seed) {
    uint8_t *p = fm_aligned_alloc(64, (size_t)(rows * cols / 2));
    uint8_t *s = fm_aligned_alloc(64, (size_t)(rows * cols / 16));
    if (!p || !s) { free(p); free(s); return 0; }
    for (int64_t i = 0; i < rows * cols / 2; i++) p[i] = (uint8_t)fm_rng_u64(seed, 1, (uint64_t)i);
    for (int64_t i = 0; i < rows * cols / 16; i++) s[i] = (uint8_t)(0x30 + (fm_rng_u64(seed, 2, (uint64_t)i) & 15));
    *m = (fm_qmatrix){FM_QF_NVFP4, rows, cols, p, cols / 2, s, cols / 16, 1.0f, NULL};
    return 1;
}

int main(int argc, char **argv) {
    long E = 1, T = 1, I = 768, H = 2048, reps = 200, down_rows = 32, down = 0;
    fm_cpu_isa isa = FM_CPU_AVX2;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int ok = 1;
        if (!strcmp(a, "--down")) { down = 1; continue; }
        if (!strcmp(a, "--isa")) {
            if (v && !strcmp(v, "avx2")) isa = FM_CPU_AVX2;
            else if (v && !strcmp(v, "avx512")) isa = FM_CPU_AVX512;
            else if (v && !strcmp(v, "scalar")) isa = FM_CPU_SCALAR;
            else { fprintf(stderr, "cpu_kbench: --isa avx2|avx512|scalar\n"); return 2; }
        } else if (!strcmp(a, "--experts")) ok = arg_int(a, v, 1, 4096, &E);
        else if (!strcmp(a, "--tokens")) ok = arg_int(a, v, 1, 64, &T);
        else if (!strcmp(a, "--rows")) ok = arg_int(a, v, 32, 1 << 16, &I);
        else if (!strcmp(a, "--cols")) ok = arg_int(a, v, 64, 1 << 16, &H);
        else if (!strcmp(a, "--reps")) ok = arg_int(a, v, 1, 1000000, &reps);
        else if (!strcmp(a, "--down-rows")) ok = arg_int(a, v, 16, 1 << 16, &down_rows);
        else { fprintf(stderr, "cpu_kbench: unknown argument %s\n", a); return 2; }
        if (!ok) return 2;
        i++;
    }
    if (I % 64 || H % 64 || down_rows % 16) {
        fprintf(stderr, "cpu_kbench: --rows and --cols must be multiples of 64, --down-rows of 16\n");
        return 2;
    }
    if (fm_cpu_isa_detect() < isa && isa != FM_CPU_SCALAR) {
        printf("SKIPPED: this CPU lacks %s\n", fm_cpu_isa_name(isa));
        return 77;
    }
    const fm_cpu_kernels *k = isa == FM_CPU_AVX512 ? &fm_cpu_kern_avx512
                              : isa == FM_CPU_AVX2 ? &fm_cpu_kern_avx2 : &fm_cpu_kern_scalar;
    fm_cpu_luts_init();
    const int n_mat = down ? 1 : 2;
    fm_qmatrix *m = calloc((size_t)(E * n_mat), sizeof *m);
    const int64_t xcols = H > I ? H : I;
    float *x = fm_aligned_alloc(64, sizeof(float) * (size_t)(T * xcols));
    float *out = fm_aligned_alloc(64, sizeof(float) * (size_t)(T * xcols));
    float *wbuf = fm_aligned_alloc(64, sizeof(float) * (size_t)fm_cpu_wbuf_floats(xcols));
    int rc = 1;
    if (!m || !x || !out || !wbuf) { fprintf(stderr, "cpu_kbench: out of memory\n"); goto done; }
    for (long e = 0; e < E * n_mat; e++)
        if (!(down ? make_matrix(&m[e], H, I, (uint64_t)e) : make_matrix(&m[e], I, H, (uint64_t)e))) {
            fprintf(stderr, "cpu_kbench: out of memory for expert %ld\n", e / n_mat);
            goto done;
        }
    for (long i = 0; i < T * xcols; i++) x[i] = (float)fm_rng_normal(7, 3, (uint64_t)i);
    memset(out, 0, sizeof(float) * (size_t)(T * xcols));
    const float *xp[64];
    float *op[64];
    for (long t = 0; t < T; t++) { xp[t] = x + t * xcols; op[t] = out + t * xcols; }
    double best = 1e30;
    for (long r = 0; r < reps; r++) {
        uint64_t t0 = fm_now_ns();
        if (!down) {
            for (long e = 0; e < E; e++)
                for (int64_t r0 = 0; r0 < I; r0 += 32) {
                    fm_gu_task t = {.gate = &m[2 * e], .up = &m[2 * e + 1], .x = xp, .n = (int)T, .h = out,
                                    .ldh = I, .h_fmt = FM_QF_NVFP4, .r0 = r0, .r1 = r0 + 32 < I ? r0 + 32 : I,
                                    .act = FM_ACT_SILU, .wbuf = wbuf};
                    k->gate_up(&t);
                }
        } else {
            for (int64_t r0 = 0; r0 < H; r0 += down_rows)
                for (long e = 0; e < E; e++) {
                    fm_down_task t = {.down = &m[e], .h = x, .ldh = xcols, .n = (int)T, .out = op, .w = NULL,
                                      .r0 = r0, .r1 = r0 + down_rows < H ? r0 + down_rows : H, .wbuf = wbuf};
                    k->down(&t);
                }
        }
        double s = (double)(fm_now_ns() - t0) * 1e-9;
        if (s < best) best = s;
    }
    const double w = (double)E * n_mat * (double)I * (double)H;
    double chk = 0;
    for (long i = 0; i < T * xcols; i++) chk += out[i];
    printf("%s %s: %ld experts x %ld x %ld, %ld token%s: %.3f ms, %.2f G weights/s, %.2f GB/s (checksum %.6g)\n",
           k->name, down ? "down" : "gate/up", E, down ? H : I, down ? I : H, T, T == 1 ? "" : "s", best * 1e3,
           w / best * 1e-9, w * 0.5625 / best * 1e-9, chk);
    rc = 0;
done:
    if (m)
        for (long e = 0; e < E * n_mat; e++) { free((void *)m[e].packed); free((void *)m[e].scales); }
    free(m);
    free(x);
    free(out);
    free(wbuf);
    return rc;
}
