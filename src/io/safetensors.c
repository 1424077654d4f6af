/*
 * safetensors reader and streaming writer.
 *
 * File layout: u64 little-endian header length N, N bytes of UTF-8 JSON
 * (starting with '{', may be padded with trailing spaces), then the data
 * buffer. The reader applies the rules of the official reader
 * (huggingface/safetensors, tensor.rs), because a file it accepts must be
 * one that the rest of the ecosystem accepts too, and because every length
 * in the header is attacker-controlled:
 *   - N <= 100,000,000 and 8 + N <= file size;
 *   - the header is valid UTF-8, starts with '{' and is one JSON object
 *     with unique keys (duplicate keys are rejected, not "last wins");
 *   - "__metadata__" maps strings to strings;
 *   - every other entry has dtype, shape (non-negative integers) and
 *     data_offsets [begin, end]; sorted by offset, the entries tile the data
 *     buffer from 0 without gaps or overlaps and end exactly at file end;
 *   - end - begin == element count x dtype size, computed with checked
 *     multiplication; F4 (4 bits) needs an even element count.
 * Status codes: FM_E_FORMAT for malformed files, FM_E_RANGE for lengths and
 * shape products out of range, FM_E_UNSUPPORTED for dtypes or ranks this
 * library does not know (a valid file of a newer dtype is not "malformed").
 *
 * Data pointers point into a read-only mapping and carry no alignment
 * guarantee beyond what the writer chose; readers load through memcpy or
 * byte pointers.
 */
#include "util/util.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define ST_MAX_HEADER 100000000ull

struct fm_st_file {
    char *path;               /* "<memory>" for fm_st_parse             */
    fm_st_tensor *tensors;    /* sorted by (begin, end, name)           */
    size_t n;
    size_t *by_name;          /* indices into tensors, sorted by name   */
    char **meta_keys, **meta_vals;
    size_t n_meta;
    void *map;                /* whole-file mapping (fm_st_open)        */
    size_t map_len;
    uint64_t header_len, file_size;
};

/* ------------------------------------------------------------ UTF-8 */

/* Strict UTF-8 (no overlong forms, no surrogates, <= U+10FFFF), as Rust's
 * str::from_utf8 checks it. Returns the offset of the first bad byte, or
 * len when the whole buffer is valid. */
static size_t utf8_invalid_at(const uint8_t *s, size_t len) {
    size_t i = 0;
    while (i < len) {
        uint8_t c = s[i];
        if (c < 0x80) { i++; continue; }
        size_t n;
        uint32_t cp, min;
        if ((c & 0xE0) == 0xC0) { n = 1; cp = c & 0x1F; min = 0x80; }
        else if ((c & 0xF0) == 0xE0) { n = 2; cp = c & 0x0F; min = 0x800; }
        else if ((c & 0xF8) == 0xF0) { n = 3; cp = c & 0x07; min = 0x10000; }
        else return i;
        if (len - i <= n) return i;
        for (size_t k = 1; k <= n; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return i;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
        i += n + 1;
    }
    return len;
}

/* ------------------------------------------------------------ reader */

void fm_st_close(fm_st_file *f) {
    if (!f) return;
    for (size_t i = 0; i < f->n; i++) free((char *)f->tensors[i].name);
    for (size_t i = 0; i < f->n_meta; i++) {
        free(f->meta_keys[i]);
        free(f->meta_vals[i]);
    }
    free(f->tensors);
    free(f->by_name);
    free(f->meta_keys);
    free(f->meta_vals);
    if (f->map) munmap(f->map, f->map_len);
    free(f->path);
    free(f);
}

static int cmp_offsets(const void *a, const void *b) {
    const fm_st_tensor *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* The name index sorts (name, position) pairs, which keeps the comparator
 * free of global state without the non-portable qsort_r. */
typedef struct { const char *name; size_t idx; } name_idx;
static int cmp_name_idx(const void *a, const void *b) {
    return strcmp(((const name_idx *)a)->name, ((const name_idx *)b)->name);
}

/* Reads a non-negative JSON integer. */
static int json_u64(const json_t *v, uint64_t *out) {
    if (!json_is_integer(v)) return 0;
    json_int_t x = json_integer_value(v);
    if (x < 0) return 0;
    *out = (uint64_t)x;
    return 1;
}

static fm_status parse_entry(const char *label, const char *name, json_t *v, fm_st_tensor *t) {
    if (!json_is_object(v))
        return fm_error(FM_E_FORMAT, "%s: tensor '%s': entry is not a JSON object", label, name);
    json_t *jd = json_object_get(v, "dtype"), *js = json_object_get(v, "shape"),
           *jo = json_object_get(v, "data_offsets");
    if (!jd || !js || !jo)
        return fm_error(FM_E_FORMAT, "%s: tensor '%s': missing %s", label, name,
                        !jd ? "dtype" : !js ? "shape" : "data_offsets");
    if (!json_is_string(jd))
        return fm_error(FM_E_FORMAT, "%s: tensor '%s': dtype is not a string", label, name);
    t->dtype = fm_dtype_from_name(json_string_value(jd));
    if (t->dtype == FM_DT_INVALID)
        return fm_error(FM_E_UNSUPPORTED, "%s: tensor '%s': unknown dtype '%s'", label, name,
                        json_string_value(jd));
    if (!json_is_array(js))
        return fm_error(FM_E_FORMAT, "%s: tensor '%s': shape is not an array", label, name);
    size_t nd = json_array_size(js);
    if (nd > FM_MAX_DIMS)
        return fm_error(FM_E_UNSUPPORTED, "%s: tensor '%s': %zu dimensions, at most %d supported",
                        label, name, nd, FM_MAX_DIMS);
    t->ndim = (int)nd;
    uint64_t count = 1;
    int overflow = 0;
    for (size_t d = 0; d < nd; d++) {
        uint64_t dim;
        if (!json_u64(json_array_get(js, d), &dim))
            return fm_error(FM_E_FORMAT,
                            "%s: tensor '%s': shape[%zu] is not a non-negative integer", label,
                            name, d);
        t->shape[d] = (int64_t)dim;
        if (!fm_mul_ok(count, dim, &count)) overflow = 1;
    }
    if (!json_is_array(jo) || json_array_size(jo) != 2)
        return fm_error(FM_E_FORMAT, "%s: tensor '%s': data_offsets is not [begin, end]", label,
                        name);
    if (!json_u64(json_array_get(jo, 0), &t->begin) || !json_u64(json_array_get(jo, 1), &t->end))
        return fm_error(FM_E_FORMAT,
                        "%s: tensor '%s': data_offsets are not non-negative integers", label, name);
    /* A zero dimension makes the product 0 however large the others are;
     * the official reader folds with checked_mul and fails on overflow
     * before it sees the zero, so do the same. */
    uint64_t bits;
    if (overflow || !fm_mul_ok(count, (uint64_t)fm_dtype_bits(t->dtype), &bits))
        return fm_error(FM_E_RANGE, "%s: tensor '%s': shape product overflows 64 bits", label,
                        name);
    if (bits % 8 != 0)
        return fm_error(FM_E_FORMAT,
                        "%s: tensor '%s': %llu elements of %s do not fill whole bytes", label,
                        name, (unsigned long long)count, fm_dtype_name(t->dtype));
    if (t->end < t->begin)
        return fm_error(FM_E_FORMAT, "%s: tensor '%s': data_offsets [%llu, %llu] end before begin",
                        label, name, (unsigned long long)t->begin, (unsigned long long)t->end);
    if (t->end - t->begin != bits / 8)
        return fm_error(FM_E_FORMAT,
                        "%s: tensor '%s': data_offsets [%llu, %llu] hold %llu bytes, but %s shape "
                        "needs %llu",
                        label, name, (unsigned long long)t->begin, (unsigned long long)t->end,
                        (unsigned long long)(t->end - t->begin), fm_dtype_name(t->dtype),
                        (unsigned long long)(bits / 8));
    return FM_OK;
}

static fm_status parse_meta(const char *label, json_t *v, fm_st_file *f) {
    if (json_is_null(v)) return FM_OK;
    if (!json_is_object(v))
        return fm_error(FM_E_FORMAT, "%s: __metadata__ is not an object of strings", label);
    size_t n = json_object_size(v);
    f->meta_keys = fm_calloc(n, sizeof(char *));
    f->meta_vals = fm_calloc(n, sizeof(char *));
    if (!f->meta_keys || !f->meta_vals) return FM_E_NOMEM;
    const char *k;
    json_t *val;
    json_object_foreach(v, k, val) {
        if (!json_is_string(val))
            return fm_error(FM_E_FORMAT, "%s: __metadata__ key '%s': value is not a string", label,
                            k);
        f->meta_keys[f->n_meta] = fm_strdup(k);
        f->meta_vals[f->n_meta] = fm_strdup(json_string_value(val));
        if (!f->meta_keys[f->n_meta] || !f->meta_vals[f->n_meta]) {
            free(f->meta_keys[f->n_meta]);
            free(f->meta_vals[f->n_meta]);
            return FM_E_NOMEM;
        }
        f->n_meta++;
    }
    return FM_OK;
}

/* Validates the header in buf (8 + N bytes at least) of a file of
 * file_size bytes and fills f. data pointers are set when data != NULL. */
static fm_status parse_into(const char *label, const uint8_t *buf, size_t buf_len,
                            uint64_t file_size, const uint8_t *data, fm_st_file *f) {
    if (file_size < 8 || buf_len < 8)
        return fm_error(FM_E_FORMAT, "%s: %llu bytes, too small for the 8-byte header length",
                        label, (unsigned long long)(file_size < buf_len ? file_size : buf_len));
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | buf[i];
    if (n > ST_MAX_HEADER)
        return fm_error(FM_E_RANGE, "%s: header length %llu exceeds the limit of %llu bytes", label,
                        (unsigned long long)n, ST_MAX_HEADER);
    if (n > file_size - 8)
        return fm_error(FM_E_FORMAT,
                        "%s: header length %llu runs past the end of the file (%llu bytes)",
                        label, (unsigned long long)n, (unsigned long long)file_size);
    if (n > buf_len - 8)
        return fm_error(FM_E_ARG, "%s: buffer of %zu bytes does not hold the %llu-byte header",
                        label, buf_len, (unsigned long long)n);
    f->header_len = n;
    f->file_size = file_size;
    const uint8_t *h = buf + 8;
    size_t bad = utf8_invalid_at(h, (size_t)n);
    if (bad != n)
        return fm_error(FM_E_FORMAT, "%s: header is not valid UTF-8 (byte offset %zu)", label,
                        bad + 8);
    if (n == 0 || h[0] != '{')
        return fm_error(FM_E_FORMAT, "%s: header does not start with '{' (byte offset 8)", label);

    json_error_t jerr;
    json_t *root = json_loadb((const char *)h, (size_t)n, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return fm_error(FM_E_FORMAT, "%s: invalid header JSON at byte offset %lld: %s", label,
                        (long long)jerr.position + 8, jerr.text);
    fm_status st = FM_OK;
    if (!json_is_object(root)) {
        st = fm_error(FM_E_FORMAT, "%s: header is not a JSON object", label);
        goto out;
    }
    size_t cap = json_object_size(root);
    f->tensors = fm_calloc(cap, sizeof(fm_st_tensor));
    if (!f->tensors) { st = FM_E_NOMEM; goto out; }
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val) {
        if (strcmp(key, "__metadata__") == 0) {
            if ((st = parse_meta(label, val, f)) != FM_OK) goto out;
            continue;
        }
        fm_st_tensor t;
        memset(&t, 0, sizeof t);
        if ((st = parse_entry(label, key, val, &t)) != FM_OK) goto out;
        t.name = fm_strdup(key);
        if (!t.name) { st = FM_E_NOMEM; goto out; }
        f->tensors[f->n++] = t;
    }
    qsort(f->tensors, f->n, sizeof(fm_st_tensor), cmp_offsets);
    uint64_t pos = 0;
    for (size_t i = 0; i < f->n; i++) {
        const fm_st_tensor *t = &f->tensors[i];
        if (t->begin != pos) {
            st = fm_error(FM_E_FORMAT, "%s: tensor '%s': data_offsets [%llu, %llu] %s: expected "
                          "begin %llu",
                          label, t->name, (unsigned long long)t->begin, (unsigned long long)t->end,
                          t->begin > pos ? "leave a gap" : "overlap the previous tensor",
                          (unsigned long long)pos);
            goto out;
        }
        pos = t->end;
    }
    uint64_t data_len = file_size - 8 - n;
    if (pos != data_len) {
        st = fm_error(FM_E_FORMAT, "%s: tensors cover %llu data bytes but the file holds %llu "
                      "(data must end exactly at the end of the file)",
                      label, (unsigned long long)pos, (unsigned long long)data_len);
        goto out;
    }
    if (data)
        for (size_t i = 0; i < f->n; i++) f->tensors[i].data = data + f->tensors[i].begin;
    name_idx *tmp = fm_calloc(f->n, sizeof(name_idx));
    f->by_name = fm_calloc(f->n, sizeof(size_t));
    if (!tmp || !f->by_name) { free(tmp); st = FM_E_NOMEM; goto out; }
    for (size_t i = 0; i < f->n; i++) tmp[i] = (name_idx){f->tensors[i].name, i};
    qsort(tmp, f->n, sizeof(name_idx), cmp_name_idx);
    for (size_t i = 0; i < f->n; i++) f->by_name[i] = tmp[i].idx;
    free(tmp);
out:
    json_decref(root);
    return st;
}

static fm_st_file *new_file(const char *path) {
    fm_st_file *f = fm_calloc(1, sizeof *f);
    if (!f) return NULL;
    f->path = fm_strdup(path);
    if (!f->path) { free(f); return NULL; }
    return f;
}

fm_status fm_st_parse(const uint8_t *buf, size_t buf_len, uint64_t file_size, fm_st_file **out) {
    *out = NULL;
    if (!buf && buf_len) return fm_error(FM_E_ARG, "fm_st_parse: NULL buffer");
    fm_st_file *f = new_file("<memory>");
    if (!f) return FM_E_NOMEM;
    /* Data pointers only when the whole file is in the buffer; they point
     * into the caller's buffer. */
    const uint8_t *data = NULL;
    if (buf_len >= file_size && file_size >= 8) {
        uint64_t n = 0;
        for (int i = 7; i >= 0; i--) n = (n << 8) | buf[i];
        if (n <= file_size - 8) data = buf + 8 + n;
    }
    fm_status st = parse_into(f->path, buf, buf_len, file_size, data, f);
    if (st != FM_OK) { fm_st_close(f); return st; }
    *out = f;
    return FM_OK;
}

static fm_status open_fd(const char *path, int *fd, uint64_t *size) {
    *fd = open(path, O_RDONLY | O_CLOEXEC);
    if (*fd < 0) return fm_error(FM_E_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(*fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(*fd);
        return fm_error(FM_E_IO, "%s: not a regular file", path);
    }
    *size = (uint64_t)sb.st_size;
    return FM_OK;
}

fm_status fm_st_open(const char *path, fm_st_file **out) {
    *out = NULL;
    int fd;
    uint64_t size;
    fm_status st = open_fd(path, &fd, &size);
    if (st != FM_OK) return st;
    if (size < 8) {
        close(fd);
        return fm_error(FM_E_FORMAT, "%s: %llu bytes, too small for the 8-byte header length", path,
                        (unsigned long long)size);
    }
    if (size > SIZE_MAX) {
        close(fd);
        return fm_error(FM_E_RANGE, "%s: file too large to map", path);
    }
    void *map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
    int err = errno;
    close(fd);
    if (map == MAP_FAILED) return fm_error(FM_E_IO, "%s: mmap failed: %s", path, strerror(err));
    fm_st_file *f = new_file(path);
    if (!f) { munmap(map, (size_t)size); return FM_E_NOMEM; }
    f->map = map;
    f->map_len = (size_t)size;
    const uint8_t *b = map;
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | b[i];
    const uint8_t *data = n <= size - 8 ? b + 8 + n : NULL;
    st = parse_into(path, b, (size_t)size, size, data, f);
    if (st != FM_OK) { fm_st_close(f); return st; }
    *out = f;
    return FM_OK;
}

static fm_status read_full(int fd, uint8_t *buf, size_t n, uint64_t off, const char *path) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, buf + got, n - got, (off_t)(off + got));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return fm_error(FM_E_IO, "%s: short read at byte offset %llu", path,
                                    (unsigned long long)(off + got));
        got += (size_t)r;
    }
    return FM_OK;
}

fm_status fm_st_open_header(const char *path, fm_st_file **out) {
    *out = NULL;
    int fd;
    uint64_t size;
    fm_status st = open_fd(path, &fd, &size);
    if (st != FM_OK) return st;
    uint8_t len8[8] = {0};
    if (size < 8) {
        close(fd);
        return fm_error(FM_E_FORMAT, "%s: %llu bytes, too small for the 8-byte header length", path,
                        (unsigned long long)size);
    }
    if ((st = read_full(fd, len8, 8, 0, path)) != FM_OK) { close(fd); return st; }
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | len8[i];
    /* Check the length before allocating it. */
    fm_st_file *f = NULL;
    if (n > ST_MAX_HEADER || n > size - 8) {
        close(fd);
        f = new_file(path);
        if (!f) return FM_E_NOMEM;
        st = parse_into(path, len8, 8, size, NULL, f);
        fm_st_close(f);
        return st;
    }
    uint8_t *buf = fm_malloc((size_t)n + 8);
    if (!buf) { close(fd); return FM_E_NOMEM; }
    memcpy(buf, len8, 8);
    st = read_full(fd, buf + 8, (size_t)n, 8, path);
    close(fd);
    if (st == FM_OK) {
        f = new_file(path);
        if (!f) st = FM_E_NOMEM;
        else st = parse_into(path, buf, (size_t)n + 8, size, NULL, f);
    }
    free(buf);
    if (st != FM_OK) { fm_st_close(f); return st; }
    *out = f;
    return FM_OK;
}

size_t fm_st_count(const fm_st_file *f) { return f ? f->n : 0; }

const fm_st_tensor *fm_st_at(const fm_st_file *f, size_t i) {
    return f && i < f->n ? &f->tensors[i] : NULL;
}

const fm_st_tensor *fm_st_find(const fm_st_file *f, const char *name) {
    if (!f || !name) return NULL;
    size_t lo = 0, hi = f->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const fm_st_tensor *t = &f->tensors[f->by_name[mid]];
        int c = strcmp(name, t->name);
        if (c == 0) return t;
        if (c < 0) hi = mid;
        else lo = mid + 1;
    }
    return NULL;
}

const char *fm_st_metadata(const fm_st_file *f, const char *key) {
    if (!f || !key) return NULL;
    for (size_t i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta_keys[i], key) == 0) return f->meta_vals[i];
    return NULL;
}

size_t fm_st_metadata_count(const fm_st_file *f) { return f ? f->n_meta : 0; }
const char *fm_st_path(const fm_st_file *f) { return f ? f->path : NULL; }

/* ------------------------------------------------------------ writer */

typedef struct {
    char *name;
    fm_dtype dt;
    int ndim;
    int64_t shape[FM_MAX_DIMS];
    uint64_t bytes;
} wentry;

struct fm_st_writer {
    char *path, *tmp;
    FILE *fp;
    wentry *e;
    size_t n, cap;
    char **mk, **mv;
    size_t n_meta;
    int started;         /* header written: no more declarations         */
    int failed;          /* a write failed: the temp file is gone         */
    size_t cur;          /* tensor receiving bytes                        */
    uint64_t cur_done;   /* bytes of it written                           */
    uint64_t total, done;
};

static void writer_free(fm_st_writer *w) {
    if (!w) return;
    if (w->fp) fclose(w->fp);
    if (w->tmp && !w->failed) unlink(w->tmp);
    for (size_t i = 0; i < w->n; i++) free(w->e[i].name);
    for (size_t i = 0; i < w->n_meta; i++) { free(w->mk[i]); free(w->mv[i]); }
    free(w->e);
    free(w->mk);
    free(w->mv);
    free(w->path);
    free(w->tmp);
    free(w);
}

/* Drops the temp file so that nothing is left behind after an error. */
static fm_status writer_fail(fm_st_writer *w, fm_status st) {
    if (!w->failed) {
        if (w->fp) { fclose(w->fp); w->fp = NULL; }
        unlink(w->tmp);
        w->failed = 1;
    }
    return st;
}

fm_status fm_st_writer_new(const char *path, fm_st_writer **out) {
    *out = NULL;
    if (!path || !*path) return fm_error(FM_E_ARG, "safetensors writer: empty path");
    fm_st_writer *w = fm_calloc(1, sizeof *w);
    if (!w) return FM_E_NOMEM;
    w->path = fm_strdup(path);
    size_t tl = strlen(path) + 16;
    w->tmp = fm_malloc(tl);
    if (!w->path || !w->tmp) { free(w->path); free(w->tmp); free(w); return FM_E_NOMEM; }
    snprintf(w->tmp, tl, "%s.tmp.XXXXXX", path);
    int fd = mkstemp(w->tmp);
    if (fd < 0) {
        fm_status st = fm_error(FM_E_IO, "%s: cannot create: %s", path, strerror(errno));
        free(w->path); free(w->tmp); free(w);
        return st;
    }
    /* mkstemp creates 0600; a model file is meant to be shared like any
     * other output. */
    (void)fchmod(fd, 0644);
    w->fp = fdopen(fd, "wb");
    if (!w->fp) {
        close(fd);
        unlink(w->tmp);
        free(w->path); free(w->tmp); free(w);
        return fm_error(FM_E_IO, "%s: cannot create: %s", path, strerror(errno));
    }
    *out = w;
    return FM_OK;
}

fm_status fm_st_writer_meta(fm_st_writer *w, const char *key, const char *val) {
    if (!w || !key || !val) return fm_error(FM_E_ARG, "safetensors writer: NULL metadata argument");
    if (w->failed) return fm_error(FM_E_ARG, "%s: writer already failed", w->path);
    if (w->started)
        return writer_fail(w, fm_error(FM_E_ARG, "%s: metadata '%s' after data was written",
                                       w->path, key));
    if (utf8_invalid_at((const uint8_t *)key, strlen(key)) != strlen(key) ||
        utf8_invalid_at((const uint8_t *)val, strlen(val)) != strlen(val))
        return writer_fail(w, fm_error(FM_E_ARG, "%s: metadata '%s' is not valid UTF-8", w->path,
                                       key));
    for (size_t i = 0; i < w->n_meta; i++)
        if (strcmp(w->mk[i], key) == 0)
            return writer_fail(w, fm_error(FM_E_ARG, "%s: metadata key '%s' given twice",
                                           w->path, key));
    char **mk = realloc(w->mk, (w->n_meta + 1) * sizeof(char *));
    if (!mk) return writer_fail(w, fm_error(FM_E_NOMEM, "out of memory"));
    w->mk = mk;
    char **mv = realloc(w->mv, (w->n_meta + 1) * sizeof(char *));
    if (!mv) return writer_fail(w, fm_error(FM_E_NOMEM, "out of memory"));
    w->mv = mv;
    w->mk[w->n_meta] = fm_strdup(key);
    w->mv[w->n_meta] = fm_strdup(val);
    w->n_meta++;
    if (!w->mk[w->n_meta - 1] || !w->mv[w->n_meta - 1]) return writer_fail(w, FM_E_NOMEM);
    return FM_OK;
}

fm_status fm_st_writer_declare(fm_st_writer *w, const char *name, fm_dtype dt, int ndim,
                               const int64_t *shape) {
    if (!w || !name) return fm_error(FM_E_ARG, "safetensors writer: NULL argument");
    if (w->failed) return fm_error(FM_E_ARG, "%s: writer already failed", w->path);
    if (w->started)
        return writer_fail(w, fm_error(FM_E_ARG, "%s: tensor '%s' declared after data was written",
                                       w->path, name));
    size_t nl = strlen(name);
    if (strcmp(name, "__metadata__") == 0 || utf8_invalid_at((const uint8_t *)name, nl) != nl)
        return writer_fail(w, fm_error(FM_E_ARG, "%s: invalid tensor name '%s'", w->path, name));
    if (fm_dtype_bits(dt) == 0)
        return writer_fail(w, fm_error(FM_E_ARG, "%s: tensor '%s': invalid dtype %d", w->path,
                                       name, (int)dt));
    if (ndim < 0 || ndim > FM_MAX_DIMS || (ndim > 0 && !shape))
        return writer_fail(w, fm_error(FM_E_ARG, "%s: tensor '%s': bad rank %d", w->path, name,
                                       ndim));
    uint64_t count = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0 || !fm_mul_ok(count, (uint64_t)shape[d], &count))
            return writer_fail(w, fm_error(FM_E_RANGE, "%s: tensor '%s': bad shape", w->path,
                                           name));
    }
    uint64_t bits, total;
    if (!fm_mul_ok(count, (uint64_t)fm_dtype_bits(dt), &bits) || bits % 8 != 0 ||
        !fm_add_ok(w->total, bits / 8, &total) || total > (uint64_t)INT64_MAX)
        return writer_fail(w, fm_error(FM_E_RANGE, "%s: tensor '%s': size not a whole number of "
                                       "bytes or too large", w->path, name));
    if (w->n == w->cap) {
        size_t nc = w->cap ? 2 * w->cap : 16;
        wentry *ne = realloc(w->e, nc * sizeof(wentry));
        if (!ne) return writer_fail(w, fm_error(FM_E_NOMEM, "out of memory"));
        w->e = ne;
        w->cap = nc;
    }
    wentry *e = &w->e[w->n];
    memset(e, 0, sizeof *e);
    e->name = fm_strdup(name);
    if (!e->name) return writer_fail(w, FM_E_NOMEM);
    e->dt = dt;
    e->ndim = ndim;
    for (int d = 0; d < ndim; d++) e->shape[d] = shape[d];
    e->bytes = bits / 8;
    w->n++;
    w->total = total;
    return FM_OK;
}

static int cmp_str_ptr(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static fm_status write_header(fm_st_writer *w) {
    w->started = 1;
    /* Duplicate names, checked once over sorted names. */
    if (w->n > 1) {
        char **names = fm_calloc(w->n, sizeof(char *));
        if (!names) return writer_fail(w, FM_E_NOMEM);
        for (size_t i = 0; i < w->n; i++) names[i] = w->e[i].name;
        qsort(names, w->n, sizeof(char *), cmp_str_ptr);
        for (size_t i = 1; i < w->n; i++)
            if (strcmp(names[i - 1], names[i]) == 0) {
                fm_status st = fm_error(FM_E_ARG, "%s: tensor '%s' declared twice", w->path,
                                        names[i]);
                free(names);
                return writer_fail(w, st);
            }
        free(names);
    }
    json_t *root = json_object();
    if (!root) return writer_fail(w, fm_error(FM_E_NOMEM, "out of memory"));
    int bad = 0;
    if (w->n_meta) {
        json_t *m = json_object();
        bad |= !m;
        for (size_t i = 0; m && i < w->n_meta; i++)
            bad |= json_object_set_new(m, w->mk[i], json_string(w->mv[i])) != 0;
        bad |= json_object_set_new(root, "__metadata__", m) != 0;
    }
    uint64_t off = 0;
    for (size_t i = 0; i < w->n && !bad; i++) {
        const wentry *e = &w->e[i];
        json_t *t = json_object(), *sh = json_array(), *offs = json_array();
        bad |= !t || !sh || !offs;
        for (int d = 0; sh && d < e->ndim; d++)
            bad |= json_array_append_new(sh, json_integer((json_int_t)e->shape[d])) != 0;
        if (offs) {
            bad |= json_array_append_new(offs, json_integer((json_int_t)off)) != 0;
            bad |= json_array_append_new(offs, json_integer((json_int_t)(off + e->bytes))) != 0;
        }
        off += e->bytes;
        if (t) {
            bad |= json_object_set_new(t, "dtype", json_string(fm_dtype_name(e->dt))) != 0;
            bad |= json_object_set_new(t, "shape", sh) != 0;
            bad |= json_object_set_new(t, "data_offsets", offs) != 0;
        } else {
            json_decref(sh);
            json_decref(offs);
        }
        bad |= json_object_set_new(root, e->name, t) != 0;
    }
    char *js = bad ? NULL : json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(root);
    if (!js) return writer_fail(w, fm_error(FM_E_NOMEM, "%s: cannot build the header", w->path));
    size_t jl = strlen(js);
    /* Pad with spaces so the data buffer starts 8-byte aligned. */
    uint64_t n = (jl + 7) / 8 * 8;
    if (n > ST_MAX_HEADER) {
        free(js);
        return writer_fail(w, fm_error(FM_E_RANGE, "%s: header of %llu bytes exceeds the limit",
                                       w->path, (unsigned long long)n));
    }
    uint8_t len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (uint8_t)(n >> (8 * i));
    int ok = fwrite(len8, 1, 8, w->fp) == 8 && fwrite(js, 1, jl, w->fp) == jl;
    for (size_t i = jl; ok && i < n; i++) ok = fputc(' ', w->fp) != EOF;
    free(js);
    if (!ok) return writer_fail(w, fm_error(FM_E_IO, "%s: write failed: %s", w->path,
                                            strerror(errno)));
    /* Skip leading empty tensors. */
    while (w->cur < w->n && w->e[w->cur].bytes == 0) w->cur++;
    return FM_OK;
}

fm_status fm_st_writer_write(fm_st_writer *w, const void *data, size_t n) {
    if (!w) return fm_error(FM_E_ARG, "safetensors writer: NULL writer");
    if (w->failed) return fm_error(FM_E_ARG, "%s: writer already failed", w->path);
    if (!w->started) {
        fm_status st = write_header(w);
        if (st != FM_OK) return st;
    }
    if (n == 0) return FM_OK;
    if (!data) return writer_fail(w, fm_error(FM_E_ARG, "%s: NULL data", w->path));
    if (n > w->total - w->done)
        return writer_fail(w, fm_error(FM_E_RANGE, "%s: %zu bytes written past the %llu declared",
                                       w->path, n, (unsigned long long)w->total));
    if (fwrite(data, 1, n, w->fp) != n)
        return writer_fail(w, fm_error(FM_E_IO, "%s: write failed: %s", w->path, strerror(errno)));
    w->done += n;
    uint64_t left = n;
    while (left && w->cur < w->n) {
        uint64_t room = w->e[w->cur].bytes - w->cur_done;
        uint64_t take = left < room ? left : room;
        w->cur_done += take;
        left -= take;
        if (w->cur_done == w->e[w->cur].bytes) {
            w->cur++;
            w->cur_done = 0;
            while (w->cur < w->n && w->e[w->cur].bytes == 0) w->cur++;
        }
    }
    return FM_OK;
}

fm_status fm_st_writer_finish(fm_st_writer *w) {
    if (!w) return fm_error(FM_E_ARG, "safetensors writer: NULL writer");
    fm_status st = FM_OK;
    if (w->failed) {
        st = fm_error(FM_E_ARG, "%s: writer failed earlier; no file written", w->path);
        writer_free(w);
        return st;
    }
    if (!w->started && (st = write_header(w)) != FM_OK) { writer_free(w); return st; }
    if (w->done != w->total) {
        st = fm_error(FM_E_ARG, "%s: tensor '%s': %llu of %llu bytes written", w->path,
                      w->e[w->cur].name, (unsigned long long)w->cur_done,
                      (unsigned long long)w->e[w->cur].bytes);
        writer_fail(w, st);
        writer_free(w);
        return st;
    }
    int ok = fflush(w->fp) == 0;
    ok = (fclose(w->fp) == 0) && ok;
    w->fp = NULL;
    if (!ok || rename(w->tmp, w->path) != 0) {
        st = fm_error(FM_E_IO, "%s: write failed: %s", w->path, strerror(errno));
        writer_fail(w, st);
        writer_free(w);
        return st;
    }
    w->failed = 1; /* renamed: nothing left to remove */
    writer_free(w);
    return FM_OK;
}

void fm_st_writer_abort(fm_st_writer *w) {
    if (!w) return;
    writer_fail(w, FM_OK);
    writer_free(w);
}
