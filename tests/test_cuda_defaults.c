/* Built-in CUDA kernel configs: available without CUDA, consistent, and
 * switching path on tokens per expert. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "fp4moe.h"

static fm_tune_key key(int E, int k) {
    fm_tune_key kk;
    memset(&kk, 0, sizeof kk);
    strcpy(kk.gpu_name, "NVIDIA H200");
    kk.sm_count = 132;
    kk.fmt = FM_QF_NVFP4;
    kk.E = E;
    kk.H = 4096;
    kk.I = 2048;
    kk.k = k;
    return kk;
}

static void test_consistent(void **state) {
    (void)state;
    const int Es[] = {8, 128, 256, 384}, ks[] = {2, 8, 6, 8};
    for (int i = 0; i < 4; i++) {
        fm_tune_key kk = key(Es[i], ks[i]);
        for (int T = 1; T <= 4096; T *= 2) {
            fm_kernel_config c = fm_kernel_config_default(&kk, T), m = fm_kernel_config_default_mma(&kk, T);
            assert_true(c.warps >= 1 && c.warps <= 8);
            assert_true(c.k_split >= 1 && c.warps % c.k_split == 0);
            assert_int_equal(c.rows_per_block, 16 * (c.warps / c.k_split));
            assert_true(c.tile_n == 8 || c.tile_n == 16 || c.tile_n == 32);
            assert_true(c.stages >= 1);
            double tpe = (double)T * ks[i] / Es[i];
            /* the mma.sync default switches on switch_tpe; the default is
             * that below FM_WGMMA_TPE and the wgmma path from there */
            assert_int_equal(m.path, tpe < m.switch_tpe ? FM_PATH_SMALL : FM_PATH_LARGE);
            if (tpe < FM_WGMMA_TPE) assert_memory_equal(&c, &m, sizeof c);
            else assert_int_equal(c.path, FM_PATH_WGMMA);
            if (m.path == FM_PATH_SMALL) assert_true(m.k_split > 1);
            else assert_int_equal(m.k_split, 1);
            /* the small path splits K, the large one does not; the wgmma
             * path is one warpgroup of 64 rows */
            if (c.path == FM_PATH_SMALL) assert_true(c.k_split > 1);
            else assert_int_equal(c.k_split, 1);
            if (c.path == FM_PATH_WGMMA) {
                assert_int_equal(c.warps, 4);
                assert_true(c.tile_n == 16 || c.tile_n == 32);
            }
        }
    }
}

static void test_switch_points(void **state) {
    (void)state;
    fm_tune_key kk = key(256, 6); /* DeepSeek-V4-Flash */
    assert_int_equal(fm_kernel_config_default(&kk, 1).path, FM_PATH_SMALL);   /* 0.023 tokens/expert */
    assert_int_equal(fm_kernel_config_default(&kk, 2).path, FM_PATH_WGMMA);   /* 0.047 */
    assert_int_equal(fm_kernel_config_default(&kk, 2).tile_n, 16);
    assert_int_equal(fm_kernel_config_default_mma(&kk, 2).path, FM_PATH_SMALL);
    assert_int_equal(fm_kernel_config_default_mma(&kk, 64).path, FM_PATH_LARGE); /* 1.5 */
    assert_int_equal(fm_kernel_config_default_mma(&kk, 64).tile_n, 8);
    assert_int_equal(fm_kernel_config_default_mma(&kk, 512).tile_n, 16);
    assert_int_equal(fm_kernel_config_default(&kk, 64).path, FM_PATH_WGMMA);
    assert_int_equal(fm_kernel_config_default(&kk, 256).path, FM_PATH_WGMMA); /* 6 */
    assert_int_equal(fm_kernel_config_default(&kk, 256).tile_n, 16);
    assert_int_equal(fm_kernel_config_default(&kk, 512).path, FM_PATH_WGMMA); /* 12 */
    assert_int_equal(fm_kernel_config_default(&kk, 512).tile_n, 32);
    /* no key: one token per expert assumed, never a crash */
    fm_kernel_config c = fm_kernel_config_default(NULL, 0);
    assert_true(c.warps >= 1);
}

/* src/cuda/defaults.c (declared in cuda_internal.h, which needs the CUDA
 * headers): the switches' reader. */
int fm_cuda_env_is(const char *name, const char *word);

/* A switch reads as set only to exactly its word: unset, empty, a prefix or
 * a longer value do not match. */
static void test_env_is(void **state) {
    (void)state;
    const char *n = "FP4MOE_CUDA_SH_FORK";
    unsetenv(n);
    assert_int_equal(fm_cuda_env_is(n, "0"), 0);
    setenv(n, "", 1);
    assert_int_equal(fm_cuda_env_is(n, "0"), 0);
    setenv(n, "0", 1);
    assert_int_equal(fm_cuda_env_is(n, "0"), 1);
    assert_int_equal(fm_cuda_env_is(n, "1"), 0);
    setenv(n, "01", 1);
    assert_int_equal(fm_cuda_env_is(n, "0"), 0);
    setenv(n, "simt", 1);
    assert_int_equal(fm_cuda_env_is(n, "sim"), 0);
    assert_int_equal(fm_cuda_env_is(n, "simt"), 1);
    unsetenv(n);
}

/* The debugging switches: unset, empty and accepted values pass; an
 * unknown name (the switches of removed variants among them) or a value the
 * switch does not take is an error naming it. */
static void test_env_check(void **state) {
    (void)state;
    assert_int_equal(fm_cuda_env_check(), FM_OK);
    const char *good[][2] = {{"FP4MOE_CUDA_PDL", ""},     {"FP4MOE_CUDA_PDL", "0"},    {"FP4MOE_CUDA_PDL", "1"},
                             {"FP4MOE_CUDA_SH_FORK", "0"}, {"FP4MOE_CUDA_SH_FORK", "1"},
                             {"FP4MOE_CUDA_BLAS", "0"},    {"FP4MOE_CUDA_BLAS", "1"}};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        setenv(good[i][0], good[i][1], 1);
        if (fm_cuda_env_check() != FM_OK) fail_msg("%s=%s refused: %s", good[i][0], good[i][1], fm_last_error());
        unsetenv(good[i][0]);
    }
    const char *bad[][3] = {
        {"FP4MOE_CUDA_PDL", "2", "FP4MOE_CUDA_PDL='2': expected 0|1"},
        {"FP4MOE_CUDA_PDL", "off", "FP4MOE_CUDA_PDL='off': expected 0|1"},
        {"FP4MOE_CUDA_SH_FORK", "yes", "FP4MOE_CUDA_SH_FORK='yes': expected 0|1"},
        {"FP4MOE_CUDA_SH_FORK", "01", "FP4MOE_CUDA_SH_FORK='01': expected 0|1"},
        {"FP4MOE_CUDA_BLAS", "off", "FP4MOE_CUDA_BLAS='off': expected 0|1"},
        {"FP4MOE_CUDA_STAGES", "3", "unknown environment variable FP4MOE_CUDA_STAGES"},
        {"FP4MOE_CUDA_WG", "3", "unknown environment variable FP4MOE_CUDA_WG"},
        {"FP4MOE_CUDA_FP4_DECODE", "v5", "unknown environment variable FP4MOE_CUDA_FP4_DECODE"},
        {"FP4MOE_CUDA_ROUTE_FUSE", "1", "unknown environment variable FP4MOE_CUDA_ROUTE_FUSE"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        setenv(bad[i][0], bad[i][1], 1);
        assert_int_equal(fm_cuda_env_check(), FM_E_ARG);
        if (!strstr(fm_last_error(), bad[i][2])) fail_msg("%s=%s: message '%s'", bad[i][0], bad[i][1], fm_last_error());
        unsetenv(bad[i][0]);
    }
    /* an unknown name lists every switch */
    setenv("FP4MOE_CUDA_NOPE", "1", 1);
    assert_int_equal(fm_cuda_env_check(), FM_E_ARG);
    if (!strstr(fm_last_error(), "(the CUDA switches are FP4MOE_CUDA_PDL, FP4MOE_CUDA_SH_FORK, FP4MOE_CUDA_BLAS)"))
        fail_msg("the list of switches is not whole: '%s'", fm_last_error());
    unsetenv("FP4MOE_CUDA_NOPE");
    assert_int_equal(fm_cuda_env_check(), FM_OK);
}

static void test_names(void **state) {
    (void)state;
    assert_string_equal(fm_kernel_path_name(FM_PATH_SMALL), "small");
    assert_string_equal(fm_kernel_path_name(FM_PATH_LARGE), "large");
    assert_string_equal(fm_kernel_path_name(FM_PATH_WGMMA), "wgmma");
    assert_string_equal(fm_kernel_path_name((fm_kernel_path)7), "unknown");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_consistent),
        cmocka_unit_test(test_switch_points),
        cmocka_unit_test(test_names),
        cmocka_unit_test(test_env_check),
        cmocka_unit_test(test_env_is),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
