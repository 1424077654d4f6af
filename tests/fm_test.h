/*
 * Helpers shared by the cmocka tests (tests/test_*.c), header-only: error
 * measures, seeded inputs, files of tests/data and temporary directories.
 * Everything a test reads comes from tests/data (through $FM_TEST_DATA,
 * which ctest sets) or from a directory the test made itself.
 */
#ifndef FM_TESTS_FM_TEST_H
#define FM_TESTS_FM_TEST_H
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <dirent.h>
#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fp4moe.h"
#include "util/util.h"

/* Relative L2 error of a against the reference ref over n values: the norm
 * of the difference over the norm of ref (over 1 when ref is all zeros, so
 * a zero reference still demands a zero result). */
static inline double fm_test_rel_err(const float *a, const float *ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* x[i] = the seeded normal value i of (seed, stream), for i < n. */
static inline void fm_test_normal(float *x, size_t n, uint64_t seed, uint64_t stream) {
    for (size_t i = 0; i < n; i++) x[i] = fm_rng_normal(seed, stream, i);
}

/* The same into a new buffer (free() it); fails the test when out of memory. */
static inline float *fm_test_normal_new(size_t n, uint64_t seed, uint64_t stream) {
    float *x = malloc(sizeof(float) * (n ? n : 1));
    assert_non_null(x);
    fm_test_normal(x, n, seed, stream);
    return x;
}

/* T seeded token ids below vocab (all 0 when vocab is not positive). */
static inline void fm_test_token_ids(int32_t *tok, int T, uint64_t seed, uint64_t stream, int64_t vocab) {
    for (int t = 0; t < T; t++) tok[t] = (int32_t)(fm_rng_u64(seed, stream, (uint64_t)t) % (uint64_t)(vocab > 0 ? vocab : 1));
}

/* The tuned-config key of an H200 (132 SMs, CUDA 13.0, driver 13.1) for
 * DeepSeek-V4-Flash's NVFP4 expert shape (E 256, H 4096, I 2048, k 6): the
 * key of the tune tests' files. */
static inline fm_tune_key fm_test_key_h200(void) {
    fm_tune_key k;
    memset(&k, 0, sizeof k);
    snprintf(k.gpu_name, sizeof k.gpu_name, "NVIDIA H200");
    k.sm_count = 132;
    k.cuda_version = 13000;
    k.driver_version = 13010;
    k.fmt = FM_QF_NVFP4;
    k.E = 256;
    k.H = 4096;
    k.I = 2048;
    k.k = 6;
    return k;
}

/* tests/data: $FM_TEST_DATA, or tests/data relative to the working
 * directory when a test is run by hand from the checkout. */
static inline const char *fm_test_data_dir(void) {
    const char *d = getenv("FM_TEST_DATA");
    return d && *d ? d : "tests/data";
}

/* The path of rel inside tests/data into buf; returns buf. */
static inline const char *fm_test_data_path(char *buf, size_t cap, const char *rel) {
    snprintf(buf, cap, "%s/%s", fm_test_data_dir(), rel);
    return buf;
}

/* The whole file at path, NUL-terminated (free() it), its size in *len when
 * len is not NULL; fails the test naming the path and the reader's error.
 * At most 1 MiB: what the tests read is small. */
static inline char *fm_test_read(const char *path, size_t *len) {
    char *buf = NULL;
    size_t n = 0;
    if (fm_read_file(path, 1 << 20, &buf, &n) != FM_OK) fail_msg("cannot read %s: %s", path, fm_last_error());
    if (len) *len = n;
    return buf;
}

/* A new directory /tmp/fm_<tag>_XXXXXX, its path into buf: 0, or -1 when it
 * could not be made (for group setups, which report failure by status). */
static inline int fm_test_mkdtemp(char *buf, size_t cap, const char *tag) {
    if (snprintf(buf, cap, "/tmp/fm_%s_XXXXXX", tag) >= (int)cap) return -1;
    return mkdtemp(buf) ? 0 : -1;
}

/* The same for a test body: fails the test when the directory cannot be made. */
static inline const char *fm_test_tmpdir(char *buf, size_t cap, const char *tag) {
    if (fm_test_mkdtemp(buf, cap, tag)) fail_msg("cannot make a temporary directory for %s", tag);
    return buf;
}

/* The number of entries in dir, "." and ".." not counted; -1 when dir
 * cannot be opened. */
static inline int fm_test_count_entries(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    closedir(d);
    return n;
}

static inline int fm_test_rm_cb_(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb;
    (void)flag;
    return ftw->level > 0 ? remove(p) : 0;
}

/* Removes everything inside dir, however deep, and keeps dir itself. */
static inline void fm_test_clear_dir(const char *dir) { nftw(dir, fm_test_rm_cb_, 16, FTW_DEPTH | FTW_PHYS); }

/* Removes dir and everything inside it; a missing dir is no error. */
static inline void fm_test_rm_tree(const char *dir) {
    fm_test_clear_dir(dir);
    rmdir(dir);
}

#endif
