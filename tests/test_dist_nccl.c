/*
 * NCCL transport: one rank on one GPU (collectives and the sharded layer
 * through the CUDA engine against the float64 reference), and, where the
 * machine has several GPUs, N ranks driven by one process. Skips visibly
 * without a CUDA build, a GPU or a loadable libnccl.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fm_test.h"
#include "parallel/parallel_internal.h"
#include "util/util.h"
#ifdef FM_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

/* Python environments (torch) carry NCCL in the nvidia-nccl package; point
 * FM_NCCL_LIB at it when the loader path has none. */
static void find_pip_nccl(void) {
    if (getenv("FM_NCCL_LIB")) return;
    FILE *p = popen("python3 -c \"import nvidia.nccl, os; "
                    "print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib', 'libnccl.so.2'))\" 2>/dev/null",
                    "r");
    if (!p) return;
    char path[1024] = "";
    if (fgets(path, sizeof path, p)) {
        path[strcspn(path, "\n")] = 0;
        if (path[0]) setenv("FM_NCCL_LIB", path, 1);
    }
    pclose(p);
}

/* Opens an NCCL communicator over n GPUs or skips the test with the reason. */
static fm_comm *open_or_skip(int n) {
    char why[256];
    if (!fm_cuda_available(why, sizeof why)) {
        print_message("SKIPPED: no CUDA GPU (%s)\n", why);
        skip();
    }
    fm_comm *c = NULL;
    fm_status s = fm_comm_nccl_new(n, &c);
    if (s == FM_E_UNSUPPORTED) {
        find_pip_nccl();
        s = fm_comm_nccl_new(n, &c);
    }
    if (s == FM_E_UNSUPPORTED) {
        print_message("SKIPPED: NCCL not usable: %s\n", fm_last_error());
        skip();
    }
    if (s) print_message("%s\n", fm_last_error());
    assert_int_equal(s, FM_OK);
    print_message("transport: %s\n", fm_comm_describe(c));
    return c;
}

/* Collectives over R ranks, all local, on hand-worked values. */
static void check_collectives(fm_comm *c) {
    const int R = fm_comm_size(c);
    assert_int_equal(fm_comm_local_count(c), R);
    float **a = calloc((size_t)R, sizeof *a), **rs = calloc((size_t)R, sizeof *rs);
    uint8_t **gs = calloc((size_t)R, sizeof *gs), **gr = calloc((size_t)R, sizeof *gr);
    size_t **sb = calloc((size_t)R, sizeof *sb), **rb = calloc((size_t)R, sizeof *rb);
    const int n = 1000;
    for (int r = 0; r < R; r++) {
        a[r] = malloc(sizeof(float) * (size_t)n * R);
        rs[r] = malloc(sizeof(float) * (size_t)n);
        gs[r] = malloc((size_t)R * 4);
        gr[r] = malloc((size_t)R * R * 4);
        sb[r] = malloc(sizeof(size_t) * (size_t)R);
        rb[r] = malloc(sizeof(size_t) * (size_t)R);
        assert_true(fm_comm_device(c, r) == r);
        for (int j = 0; j < n * R; j++) a[r][j] = (float)(r + 1) * 0.5f + (float)j;
    }
    /* all-reduce: sum_r ((r+1)/2 + j) = R(R+1)/4 + R j (exact in float) */
    assert_int_equal(fm_comm_all_reduce_sum(c, a, (size_t)n), FM_OK);
    for (int r = 0; r < R; r++)
        for (int j = 0; j < n; j++) assert_true(a[r][j] == (float)R * (R + 1) / 4.0f + (float)R * j);
    /* reduce-scatter of the (restored) inputs: rank q gets block q summed */
    for (int r = 0; r < R; r++)
        for (int j = 0; j < n * R; j++) a[r][j] = (float)(r + 1) * 0.5f + (float)j;
    assert_int_equal(fm_comm_reduce_scatter_sum(c, (const float *const *)a, rs, (size_t)n), FM_OK);
    for (int q = 0; q < R; q++)
        for (int j = 0; j < n; j++) assert_true(rs[q][j] == (float)R * (R + 1) / 4.0f + (float)R * (q * n + j));
    /* all-gather: rank r sends bytes r*10+b */
    for (int r = 0; r < R; r++)
        for (int b = 0; b < 4; b++) gs[r][b] = (uint8_t)(r * 10 + b);
    assert_int_equal(fm_comm_all_gather(c, (const void *const *)gs, (void *const *)gr, 4), FM_OK);
    for (int r = 0; r < R; r++)
        for (int q = 0; q < R; q++)
            for (int b = 0; b < 4; b++) assert_int_equal(gr[r][q * 4 + b], q * 10 + b);
    /* all-to-allv: rank r sends one byte (r*16+p) to every p, none to itself
     * when R > 1 (a zero-size pair must be skipped on both sides) */
    for (int r = 0; r < R; r++) {
        int at = 0;
        for (int p = 0; p < R; p++) {
            sb[r][p] = rb[r][p] = (R > 1 && p == r) ? 0 : 1;
            if (sb[r][p]) gs[r][at++] = (uint8_t)(r * 16 + p);
        }
    }
    assert_int_equal(fm_comm_all_to_allv(c, (const void *const *)gs, (const size_t *const *)sb, (void *const *)gr,
                                         (const size_t *const *)rb),
                     FM_OK);
    for (int p = 0; p < R; p++) {
        int at = 0;
        for (int r = 0; r < R; r++)
            if (rb[p][r]) assert_int_equal(gr[p][at++], r * 16 + p);
    }
    for (int r = 0; r < R; r++) {
        free(a[r]);
        free(rs[r]);
        free(gs[r]);
        free(gr[r]);
        free(sb[r]);
        free(rb[r]);
    }
    free(a);
    free(rs);
    free(gs);
    free(gr);
    free(sb);
    free(rb);
}

/* TP/EP over the communicator through the CUDA engine vs the float64
 * reference (the CUDA engine's own bound, 5e-3). */
static void check_layer(fm_comm *c, const char *preset, fm_qformat fmt) {
    const int R = fm_comm_size(c), T = 7;
    fm_model_desc d;
    fm_moe_layer *l;
    assert_int_equal(fm_preset_desc(preset, fmt, &d), FM_OK);
    int layer = d.first_dense > d.n_hash_layers ? d.first_dense : d.n_hash_layers;
    assert_int_equal(fm_moe_layer_random(&d, fmt, 99, layer, &l), FM_OK);
    const int H = l->hidden;
    float *x = malloc(sizeof(float) * (size_t)T * H), *ref = malloc(sizeof(float) * (size_t)T * H),
          *out = malloc(sizeof(float) * (size_t)T * H);
    fm_test_normal(x, (size_t)T * H, 3, 4);
    fm_moe_out ro = {.out = ref};
    assert_int_equal(fm_moe_forward_ref(&d, l, x, FM_DT_F32, T, NULL, &ro), FM_OK);
    for (int mode = FM_DIST_TP; mode <= FM_DIST_EP; mode++)
        for (int lay = 0; lay < 2; lay++) {
            fm_dist_opts o = {.mode = (fm_dist_mode)mode, .ranks = R, .layout = (fm_dist_layout)lay};
            if (fm_dist_check(&d, l, &o)) continue; /* split not possible for this shape */
            fm_dist *ds;
            fm_status s = fm_dist_new_cuda(&d, l, &o, c, &ds);
            if (s) print_message("%s\n", fm_last_error());
            assert_int_equal(s, FM_OK);
            for (size_t i = 0; i < (size_t)T * H; i++) out[i] = NAN;
            fm_moe_out mo = {.out = out};
            fm_dist_stats st;
            s = fm_dist_forward(ds, x, FM_DT_F32, T, NULL, &mo, &st);
            if (s) print_message("%s\n", fm_last_error());
            assert_int_equal(s, FM_OK);
            double e = fm_test_rel_err(out, ref, (size_t)T * H);
            print_message("%s %s %s%d %s: rel err vs float64 reference %.2e, comm %.1f us\n", preset,
                          fm_qformat_name(fmt), fm_dist_mode_name(o.mode), R, fm_dist_layout_name(o.layout), e,
                          st.comm_ns / 1e3);
            assert_true(e <= 5e-3);
            fm_dist_free(ds);
        }
    free(x);
    free(ref);
    free(out);
    fm_moe_layer_free(l);
}

static void test_nccl_single_rank(void **state) {
    (void)state;
    fm_comm *c = open_or_skip(1);
    check_collectives(c);
    check_layer(c, "tiny-deepseek", FM_QF_NVFP4);
    check_layer(c, "tiny-gptoss", FM_QF_MXFP4);
    fm_comm_free(c);
}

static void test_nccl_several_gpus(void **state) {
    (void)state;
    int n = 0;
#ifdef FM_HAVE_CUDA
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
#endif
    if (n < 2) {
        print_message("SKIPPED: needs 2 or more GPUs (%d visible)\n", n);
        skip();
    }
    for (int R = 2; R <= n && R <= 8; R *= 2) {
        fm_comm *c = open_or_skip(R);
        check_collectives(c);
        check_layer(c, "tiny-deepseek", FM_QF_NVFP4);
        check_layer(c, "tiny-mixtral", FM_QF_NVFP4);
        fm_comm_free(c);
    }
}

static void test_mpi_entry_point(void **state) {
    (void)state;
    /* Without -DFM_MPI=ON the MPI launcher must say how to get it. */
#ifndef FM_HAVE_MPI
    fm_comm *c = (fm_comm *)1;
    assert_int_equal(fm_comm_nccl_new_mpi(&c), FM_E_UNSUPPORTED);
    assert_null(c);
    assert_non_null(strstr(fm_last_error(), "MPI"));
#else
    print_message("SKIPPED: built with MPI; the MPI launch is exercised under mpirun only\n");
    skip();
#endif
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mpi_entry_point),
        cmocka_unit_test(test_nccl_single_rank),
        cmocka_unit_test(test_nccl_several_gpus),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
