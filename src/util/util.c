#include "util/util.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static _Thread_local char g_err[1024];

const char *fm_status_name(fm_status s) {
    switch (s) {
    case FM_OK: return "ok";
    case FM_E_ARG: return "bad argument";
    case FM_E_IO: return "I/O error";
    case FM_E_FORMAT: return "malformed input";
    case FM_E_RANGE: return "out of range";
    case FM_E_NOMEM: return "out of memory";
    case FM_E_NOTFOUND: return "not found";
    case FM_E_UNSUPPORTED: return "unsupported";
    case FM_E_CUDA: return "CUDA error";
    case FM_E_NUMERIC: return "non-finite value";
    }
    return "unknown status";
}

const char *fm_last_error(void) { return g_err; }
void fm_clear_error(void) { g_err[0] = 0; }

fm_status fm_error(fm_status s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err, sizeof g_err, fmt, ap);
    va_end(ap);
    return s;
}

uint64_t fm_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static const struct { fm_dtype dt; const char *name; int bits; } k_dtypes[] = {
    {FM_DT_BOOL, "BOOL", 8},       {FM_DT_U8, "U8", 8},         {FM_DT_I8, "I8", 8},
    {FM_DT_F8_E5M2, "F8_E5M2", 8}, {FM_DT_F8_E4M3, "F8_E4M3", 8}, {FM_DT_F8_E8M0, "F8_E8M0", 8},
    {FM_DT_I16, "I16", 16},        {FM_DT_U16, "U16", 16},      {FM_DT_F16, "F16", 16},
    {FM_DT_BF16, "BF16", 16},      {FM_DT_I32, "I32", 32},      {FM_DT_U32, "U32", 32},
    {FM_DT_F32, "F32", 32},        {FM_DT_F64, "F64", 64},      {FM_DT_I64, "I64", 64},
    {FM_DT_U64, "U64", 64},        {FM_DT_F4, "F4", 4},
};

const char *fm_dtype_name(fm_dtype dt) {
    for (size_t i = 0; i < sizeof k_dtypes / sizeof k_dtypes[0]; i++)
        if (k_dtypes[i].dt == dt) return k_dtypes[i].name;
    return "INVALID";
}
fm_dtype fm_dtype_from_name(const char *s) {
    if (!s) return FM_DT_INVALID;
    for (size_t i = 0; i < sizeof k_dtypes / sizeof k_dtypes[0]; i++)
        if (strcmp(k_dtypes[i].name, s) == 0) return k_dtypes[i].dt;
    return FM_DT_INVALID;
}
int fm_dtype_bits(fm_dtype dt) {
    for (size_t i = 0; i < sizeof k_dtypes / sizeof k_dtypes[0]; i++)
        if (k_dtypes[i].dt == dt) return k_dtypes[i].bits;
    return 0;
}

void *fm_malloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) fm_error(FM_E_NOMEM, "out of memory allocating %zu bytes", n);
    return p;
}
void *fm_calloc(size_t n, size_t sz) {
    void *p = calloc(n ? n : 1, sz ? sz : 1);
    if (!p) fm_error(FM_E_NOMEM, "out of memory allocating %zu x %zu bytes", n, sz);
    return p;
}
void *fm_aligned_alloc(size_t align, size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, align, n ? n : align) != 0) {
        fm_error(FM_E_NOMEM, "out of memory allocating %zu bytes", n);
        return NULL;
    }
    return p;
}
char *fm_strdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *p = fm_malloc(n);
    if (p) memcpy(p, s, n);
    return p;
}

fm_status fm_read_file(const char *path, size_t max_bytes, char **out, size_t *len) {
    *out = NULL;
    if (len) *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return fm_error(FM_E_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
        fclose(f);
        return fm_error(FM_E_IO, "%s: not a regular file", path);
    }
    if ((uint64_t)st.st_size > max_bytes) {
        fclose(f);
        return fm_error(FM_E_RANGE, "%s: %lld bytes, more than the limit of %zu", path,
                        (long long)st.st_size, max_bytes);
    }
    size_t n = (size_t)st.st_size;
    char *buf = fm_malloc(n + 1);
    if (!buf) { fclose(f); return FM_E_NOMEM; }
    if (n && fread(buf, 1, n, f) != n) {
        free(buf);
        fclose(f);
        return fm_error(FM_E_IO, "%s: short read", path);
    }
    fclose(f);
    buf[n] = 0;
    *out = buf;
    if (len) *len = n;
    return FM_OK;
}

fm_status fm_write_file_atomic(const char *path, const void *data, size_t len) {
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid()) >= (int)sizeof tmp)
        return fm_error(FM_E_ARG, "path too long: %s", path);
    FILE *f = fopen(tmp, "wb");
    if (!f) return fm_error(FM_E_IO, "%s: cannot create: %s", path, strerror(errno));
    int ok = fwrite(data, 1, len, f) == len;
    ok = (fclose(f) == 0) && ok;
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return fm_error(FM_E_IO, "%s: write failed: %s", path, strerror(errno));
    }
    return FM_OK;
}

fm_status fm_path_join(char *buf, size_t cap, const char *dir, const char *name) {
    int n = snprintf(buf, cap, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= cap) return fm_error(FM_E_ARG, "path too long: %s/%s", dir, name);
    return FM_OK;
}

const char *fm_phase_name(fm_phase p) {
    static const char *const names[FM_PH_COUNT] = {"routing", "sort", "gate_up", "activation",
                                                   "down", "combine", "shared", "other"};
    return (unsigned)p < FM_PH_COUNT ? names[p] : "invalid";
}
