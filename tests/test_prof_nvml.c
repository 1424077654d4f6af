/* The NVML path of the telemetry sampler against a fake libnvidia-ml built
 * now from tests/data/prof/fake_nvml.c (skipped without a C compiler), and
 * the profile's telemetry summary and verdict fed by it. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fp4moe.h"

static char g_dir[64] = "";
static char g_lib[128] = "";

static int setup(void **st) {
    (void)st;
    const char *data = getenv("FM_TEST_DATA");
    const char *cc = getenv("CC");
    if (!cc || !*cc) cc = "cc";
    char cmd[1024];
    snprintf(g_dir, sizeof g_dir, "/tmp/fm_nvml_XXXXXX");
    if (!data || !mkdtemp(g_dir)) return 0;
    snprintf(g_lib, sizeof g_lib, "%s/libfake-nvml.so", g_dir);
    /* no sanitizer flags: the fake is loaded into an instrumented process
     * like the real driver library would be */
    snprintf(cmd, sizeof cmd, "%s -shared -fPIC -O1 -o %s %s/prof/fake_nvml.c >/dev/null 2>&1", cc, g_lib, data);
    if (system(cmd) != 0) g_lib[0] = 0;
    return 0;
}

static int teardown(void **st) {
    (void)st;
    if (g_lib[0]) unlink(g_lib);
    if (g_dir[0]) rmdir(g_dir);
    return 0;
}

static int need_fake(void) {
    if (g_lib[0]) return 1;
    printf("SKIPPED: no C compiler (cc/$CC) to build the fake NVML, or FM_TEST_DATA unset\n");
    return 0;
}

static void test_nvml_samples(void **st) {
    (void)st;
    if (!need_fake()) skip();
    setenv("FP4MOE_NVML_LIB", g_lib, 1);
    unsetenv("FAKE_NVML_INIT_FAIL");
    fm_telemetry *t = NULL;
    uint64_t t0 = fm_now_ns();
    assert_int_equal(fm_telemetry_start(FM_DEV_CUDA, 0, 2, t0, &t), FM_OK);
    assert_int_equal(fm_telemetry_has_nvml(t), 1);
    assert_non_null(strstr(fm_telemetry_note(t), "Fake H200"));
    fm_telemetry_stop(t);
    const fm_telem_sample *s = NULL;
    size_t n = fm_telemetry_samples(t, &s);
    assert_true(n >= 2);
    for (size_t i = 0; i < n; i++) {
        assert_true(s[i].v[FM_TM_SM_UTIL] == 97 && s[i].v[FM_TM_MEM_UTIL] == 27);
        assert_true(s[i].v[FM_TM_POWER_W] == 328 && s[i].v[FM_TM_POWER_LIMIT_W] == 600);
        assert_true(s[i].v[FM_TM_SM_MHZ] == 1980 && s[i].v[FM_TM_MEM_MHZ] == 3201);
        assert_true(s[i].v[FM_TM_TEMP_C] == 61 && s[i].throttle == 0x4);
    }

    /* A GPU profile fed by these samples: telemetry beside the verdict. */
    fm_profile *p = fm_profile_new();
    assert_non_null(p);
    snprintf(p->model, sizeof p->model, "fake");
    p->device = FM_DEV_CUDA;
    p->fmt = FM_QF_NVFP4;
    p->E = 256, p->k = 6, p->H = 4096, p->I = 2048;
    p->layers_per_step = 43;
    p->bandwidth_Bps = 4.6e12;
    p->n_batch = 1;
    p->b[0].batch = 80;
    p->b[0].active_observed = 218;
    p->b[0].t_begin_s = 0;
    p->b[0].t_end_s = 1.0; /* short: the whole window counts (a GPU batch of 1.5 s or more is read from 1 s on) */
    p->samples = malloc(n * sizeof *s);
    memcpy(p->samples, s, n * sizeof *s);
    p->n_samples = n;
    /* the host's CPU readings depend on what else runs now: not part of this test */
    for (size_t i = 0; i < n; i++) p->samples[i].v[FM_TM_CPU_UTIL] = p->samples[i].v[FM_TM_PROC_UTIL] = NAN;
    fm_telemetry_free(t);
    double bytes = 43.0 * (218 * (14155776.0 + 12) + 256.0 * 4096 * 4);
    p->b[0].step_ns = 1e9 * bytes / 4.6e12 / 0.4; /* 40 % of floor */
    p->b[0].row_ns[FM_PH_GATEUP] = 0.6 * p->b[0].step_ns;
    p->b[0].row_ns[FM_PH_DOWN] = 0.3 * p->b[0].step_ns;
    assert_int_equal(fm_profile_finish(p), FM_OK);
    assert_int_equal(p->b[0].telem.n, (int)n);
    assert_true(fabs(p->b[0].telem.mean[FM_TM_POWER_W] - 328) < 1e-9);
    assert_true(p->b[0].telem.throttle_any == 0x4);
    assert_int_equal(p->b[0].verdict, FM_VERDICT_BUSY);
    assert_string_equal(p->b[0].verdict_text, "busy but not bandwidth-bound: 40 % of floor at 97 % SM utilization");

    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    assert_non_null(f);
    fm_profile_print(p, f);
    fclose(f);
    assert_non_null(strstr(buf, "55 % of 600 W")); /* 328 / 600 */
    assert_non_null(strstr(buf, "| 97/97 | 27/27 | 328/328 |"));
    assert_non_null(strstr(buf, "sw_power_cap"));
    free(buf);
    fm_profile_free(p);
    unsetenv("FP4MOE_NVML_LIB");
}

static void test_nvml_init_fails(void **st) {
    (void)st;
    if (!need_fake()) skip();
    setenv("FP4MOE_NVML_LIB", g_lib, 1);
    setenv("FAKE_NVML_INIT_FAIL", "1", 1);
    fm_telemetry *t = NULL;
    assert_int_equal(fm_telemetry_start(FM_DEV_CUDA, 0, 50, fm_now_ns(), &t), FM_OK);
    assert_int_equal(fm_telemetry_has_nvml(t), 0);
    assert_non_null(strstr(fm_telemetry_note(t), "Driver Not Loaded"));
    fm_telemetry_free(t);
    unsetenv("FAKE_NVML_INIT_FAIL");
    /* a device the library does not have */
    t = NULL;
    assert_int_equal(fm_telemetry_start(FM_DEV_CUDA, 3, 50, fm_now_ns(), &t), FM_OK);
    assert_int_equal(fm_telemetry_has_nvml(t), 0);
    assert_non_null(strstr(fm_telemetry_note(t), "no device 3"));
    fm_telemetry_free(t);
    unsetenv("FP4MOE_NVML_LIB");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_nvml_samples),
        cmocka_unit_test(test_nvml_init_fails),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
