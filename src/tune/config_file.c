/* Tuned config files: parsing, validation, key matching and writing.
 *
 * A file is untrusted input (it may be hand-edited, truncated, copied from
 * another machine): every field is type- and range-checked, and a file with
 * any problem is rejected as a whole with a message naming the field, so a
 * half-valid file can never steer a kernel. */
#include "tune/tune_internal.h"
#include "util/util.h"

#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

void fm_tune_appendf(char *buf, size_t cap, const char *fmt, ...) {
    if (!buf || cap == 0) return;
    size_t n = strnlen(buf, cap);
    if (n + 1 >= cap) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + n, cap - n, fmt, ap);
    va_end(ap);
}

void fm_tune_now_iso(char *buf, size_t cap) {
    time_t t = time(NULL);
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(buf, cap, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

/* The file's path token is the kernel path's name (src/cuda/defaults.c). */
const char *fm_tune_path_token(fm_kernel_path p) { return fm_kernel_path_name(p); }

int fm_tune_path_from_token(const char *s) {
    if (!s) return -1;
    if (!strcmp(s, "small")) return FM_PATH_SMALL;
    if (!strcmp(s, "large")) return FM_PATH_LARGE;
    if (!strcmp(s, "wgmma")) return FM_PATH_WGMMA;
    if (!strcmp(s, "splitk")) return FM_PATH_SPLITK;
    return -1;
}

/* The wgmma path has two block shapes (src/cuda/expert.cu): one warpgroup
 * (rows_per_block 64, warps 4) with passes of 8, 16 or 32 tokens, and two
 * warpgroups sharing the activations (rows_per_block 128, warps 8) with
 * passes of 16 or 32; anything else in a file is an error, not a silent
 * substitution. */
static int wgmma_shape_bad(const fm_kernel_config *c, char *why, size_t cap) {
    if (c->path != FM_PATH_WGMMA || (c->k_split == 1 && ((c->rows_per_block == 64 && c->warps == 4 &&
                                                          (c->tile_n == 8 || c->tile_n == 16 || c->tile_n == 32)) ||
                                                         (c->rows_per_block == 128 && c->warps == 8 &&
                                                          (c->tile_n == 16 || c->tile_n == 32)))))
        return 0;
    snprintf(why, cap,
             "the wgmma path takes k_split 1 and rows_per_block 64, warps 4, tile_n 8|16|32 or 128, 8, 16|32; "
             "not rows_per_block %d, k_split %d, warps %d, tile_n %d",
             c->rows_per_block, c->k_split, c->warps, c->tile_n);
    return 1;
}

/* Ranges wide enough for any sensible kernel, narrow enough that a value
 * from a corrupt file cannot become a huge launch or allocation. */
int fm_tune_config_invalid(const fm_kernel_config *c, char *why, size_t cap) {
    struct { const char *name; int v, lo, hi; } f[] = {
        {"rows_per_block", c->rows_per_block, 1, 256},
        {"k_split", c->k_split, 1, 64},
        {"warps", c->warps, 1, 32},
        {"stages", c->stages, 1, 1}, /* the register double buffer is the one weight pipeline */
        {"tile_n", c->tile_n, 1, 256},
    };
    if (c->path != FM_PATH_SMALL && c->path != FM_PATH_LARGE && c->path != FM_PATH_WGMMA && c->path != FM_PATH_SPLITK) {
        snprintf(why, cap, "path: unknown value %d", (int)c->path);
        return 1;
    }
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        if (f[i].v < f[i].lo || f[i].v > f[i].hi) {
            snprintf(why, cap, "%s: %d is outside [%d, %d]", f[i].name, f[i].v, f[i].lo, f[i].hi);
            return 1;
        }
    if (!isfinite(c->switch_tpe) || c->switch_tpe < 0 || c->switch_tpe > 1e6) {
        snprintf(why, cap, "switch_tpe: %g is outside [0, 1e6]", (double)c->switch_tpe);
        return 1;
    }
    if (c->path == FM_PATH_SPLITK && !(c->rows_per_block == 16 && c->warps == 8 && c->k_split <= 16 &&
                                       (c->tile_n == 8 || c->tile_n == 16))) {
        snprintf(why, cap,
                 "the splitk path takes rows_per_block 16, warps 8, k_split 1 .. 16 (K chunks), tile_n 8|16; not "
                 "rows_per_block %d, warps %d, k_split %d, tile_n %d",
                 c->rows_per_block, c->warps, c->k_split, c->tile_n);
        return 1;
    }
    return wgmma_shape_bad(c, why, cap);
}

/* ------------------------------------------------------------- parsing */

typedef struct {
    const char *what; /* file name for messages */
    char where[96];   /* current JSON location   */
} pctx;

static fm_status bad(const pctx *p, const char *field, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static fm_status bad(const pctx *p, const char *field, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return fm_error(FM_E_FORMAT, "%s: %s%s%s: %s", p->what, p->where, p->where[0] && field[0] ? "." : "", field, msg);
}

static fm_status get_int(const pctx *p, json_t *obj, const char *field, long lo, long hi, int *out) {
    json_t *v = json_object_get(obj, field);
    if (!v) return bad(p, field, "missing");
    if (!json_is_integer(v)) return bad(p, field, "must be an integer");
    json_int_t x = json_integer_value(v);
    if (x < lo || x > hi) return bad(p, field, "%lld is outside [%ld, %ld]", (long long)x, lo, hi);
    *out = (int)x;
    return FM_OK;
}

/* required: 0 leaves *out untouched when absent. */
static fm_status get_num(const pctx *p, json_t *obj, const char *field, int required, double lo, double hi,
                         double *out) {
    json_t *v = json_object_get(obj, field);
    if (!v) return required ? bad(p, field, "missing") : FM_OK;
    if (!json_is_number(v)) return bad(p, field, "must be a number");
    double x = json_number_value(v);
    if (!isfinite(x) || x < lo || x > hi) return bad(p, field, "%g is outside [%g, %g]", x, lo, hi);
    *out = x;
    return FM_OK;
}

static fm_status get_str(const pctx *p, json_t *obj, const char *field, char *out, size_t cap) {
    json_t *v = json_object_get(obj, field);
    if (!v) return bad(p, field, "missing");
    if (!json_is_string(v)) return bad(p, field, "must be a string");
    size_t n = json_string_length(v);
    if (n == 0) return bad(p, field, "is empty");
    if (n >= cap) return bad(p, field, "longer than %zu characters", cap - 1);
    memcpy(out, json_string_value(v), n + 1);
    return FM_OK;
}

static fm_status parse_params(pctx *p, json_t *obj, const char *field, fm_kernel_config *c) {
    json_t *o = json_object_get(obj, field);
    if (!o) return bad(p, field, "missing");
    if (!json_is_object(o)) return bad(p, field, "must be an object");
    char saved[sizeof p->where];
    memcpy(saved, p->where, sizeof saved);
    size_t n = strlen(p->where);
    snprintf(p->where + n, sizeof p->where - n, "%s%s", n ? "." : "", field);
    fm_status st;
    char path[16];
    memset(c, 0, sizeof *c);
    if ((st = get_str(p, o, "path", path, sizeof path))) goto out;
    int pv = fm_tune_path_from_token(path);
    if (pv < 0) { st = bad(p, "path", "unknown path '%s' (expected \"small\", \"large\" or \"wgmma\")", path); goto out; }
    c->path = (fm_kernel_path)pv;
    if ((st = get_int(p, o, "rows_per_block", 1, 256, &c->rows_per_block))) goto out;
    if ((st = get_int(p, o, "k_split", 1, 64, &c->k_split))) goto out;
    if ((st = get_int(p, o, "warps", 1, 32, &c->warps))) goto out;
    if ((st = get_int(p, o, "stages", 1, 1, &c->stages))) goto out; /* one weight pipeline */
    if ((st = get_int(p, o, "tile_n", 1, 256, &c->tile_n))) goto out;
    double sw = 0;
    if ((st = get_num(p, o, "switch_tpe", 1, 0, 1e6, &sw))) goto out;
    c->switch_tpe = (float)sw;
    char why[160];
    if (wgmma_shape_bad(c, why, sizeof why)) st = bad(p, "path", "%s", why);
out:
    memcpy(p->where, saved, sizeof saved);
    return st;
}

static fm_status parse_bucket(pctx *p, json_t *o, fm_tune_bucket *b) {
    fm_status st;
    memset(b, 0, sizeof *b);
    if (!json_is_object(o)) return bad(p, "", "must be an object");
    if ((st = get_int(p, o, "batch", 1, 1000000, &b->batch))) return st;
    if ((st = parse_params(p, o, "params", &b->cfg))) return st;
    if ((st = get_num(p, o, "us", 1, 1e-3, 1e9, &b->us))) return st;
    b->us_min = b->us_max = b->us;
    if ((st = get_num(p, o, "us_min", 0, 1e-3, 1e9, &b->us_min))) return st;
    if ((st = get_num(p, o, "us_max", 0, 1e-3, 1e9, &b->us_max))) return st;
    if ((st = get_num(p, o, "default_us", 1, 1e-3, 1e9, &b->default_us))) return st;
    b->default_us_min = b->default_us_max = b->default_us;
    if ((st = get_num(p, o, "default_us_min", 0, 1e-3, 1e9, &b->default_us_min))) return st;
    if ((st = get_num(p, o, "default_us_max", 0, 1e-3, 1e9, &b->default_us_max))) return st;
    if (b->us_min > b->us || b->us > b->us_max) return bad(p, "us", "not within [us_min, us_max]");
    if (b->default_us_min > b->default_us || b->default_us > b->default_us_max)
        return bad(p, "default_us", "not within [default_us_min, default_us_max]");
    if (json_object_get(o, "default_params")) {
        if ((st = parse_params(p, o, "default_params", &b->default_cfg))) return st;
        b->has_default_cfg = 1;
    }
    json_t *r = json_object_get(o, "replaced_default");
    if (r && !json_is_boolean(r)) return bad(p, "replaced_default", "must be true or false");
    b->replaced_default = r ? json_is_true(r) : 0;
    if ((st = get_str(p, o, "date", b->date, sizeof b->date))) return st;
    if ((st = get_str(p, o, "fp4moe_version", b->version, sizeof b->version))) return st;
    return FM_OK;
}

fm_status fm_tune_file_parse(const char *text, size_t len, const char *what, fm_tune_file *out) {
    pctx p = {.what = what ? what : "config", .where = ""};
    memset(out, 0, sizeof *out);
    json_error_t jerr;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return fm_error(FM_E_FORMAT, "%s: not valid JSON at line %d, column %d (byte %d): %s", p.what, jerr.line,
                        jerr.column, jerr.position, jerr.text);
    fm_status st = FM_OK;
    if (!json_is_object(root)) { st = fm_error(FM_E_FORMAT, "%s: the top level must be a JSON object", p.what); goto done; }

    int ver = 0;
    if ((st = get_int(&p, root, "fp4moe_tune_config", 0, 1000000, &ver))) goto done;
    if (ver != FM_TUNE_FILE_VERSION) {
        st = bad(&p, "fp4moe_tune_config", "version %d is not supported (this fp4moe reads %d)", ver, FM_TUNE_FILE_VERSION);
        goto done;
    }

    json_t *k = json_object_get(root, "key");
    if (!k) { st = bad(&p, "key", "missing"); goto done; }
    if (!json_is_object(k)) { st = bad(&p, "key", "must be an object"); goto done; }
    snprintf(p.where, sizeof p.where, "key");
    fm_tune_key *key = &out->key;
    char fmt[16];
    if ((st = get_str(&p, k, "gpu", key->gpu_name, sizeof key->gpu_name))) goto done;
    if ((st = get_int(&p, k, "sm_count", 1, 100000, &key->sm_count))) goto done;
    if ((st = get_int(&p, k, "cuda_version", 0, 10000000, &key->cuda_version))) goto done;
    if ((st = get_int(&p, k, "driver_version", 0, 10000000, &key->driver_version))) goto done;
    if ((st = get_str(&p, k, "format", fmt, sizeof fmt))) goto done;
    key->fmt = fm_qformat_from_name(fmt);
    if (key->fmt == FM_QF_NONE) { st = bad(&p, "format", "unknown format '%s'", fmt); goto done; }
    if ((st = get_int(&p, k, "E", 1, 1 << 20, &key->E))) goto done;
    if ((st = get_int(&p, k, "H", 1, 1 << 24, &key->H))) goto done;
    if ((st = get_int(&p, k, "I", 1, 1 << 24, &key->I))) goto done;
    if ((st = get_int(&p, k, "k", 1, 1 << 20, &key->k))) goto done;
    if (key->k > key->E) { st = bad(&p, "k", "%d is larger than E = %d", key->k, key->E); goto done; }
    p.where[0] = 0;

    json_t *bs = json_object_get(root, "buckets");
    if (!bs) { st = bad(&p, "buckets", "missing"); goto done; }
    if (!json_is_array(bs)) { st = bad(&p, "buckets", "must be an array"); goto done; }
    size_t nb = json_array_size(bs);
    if (nb == 0) { st = bad(&p, "buckets", "is empty"); goto done; }
    if (nb > FM_TUNE_MAX_BUCKETS) { st = bad(&p, "buckets", "%zu entries, more than %d", nb, FM_TUNE_MAX_BUCKETS); goto done; }
    for (size_t i = 0; i < nb; i++) {
        snprintf(p.where, sizeof p.where, "buckets[%zu]", i);
        fm_tune_bucket b;
        if ((st = parse_bucket(&p, json_array_get(bs, i), &b))) goto done;
        for (int j = 0; j < out->n; j++)
            if (out->b[j].batch == b.batch) { st = bad(&p, "batch", "%d appears twice", b.batch); goto done; }
        if ((st = fm_tune_file_put(out, &b))) goto done;
    }
done:
    json_decref(root);
    if (st) memset(out, 0, sizeof *out);
    return st;
}

fm_status fm_tune_file_put(fm_tune_file *f, const fm_tune_bucket *b) {
    int i = 0;
    while (i < f->n && f->b[i].batch < b->batch) i++;
    if (i < f->n && f->b[i].batch == b->batch) { f->b[i] = *b; return FM_OK; }
    if (f->n >= FM_TUNE_MAX_BUCKETS)
        return fm_error(FM_E_RANGE, "a config file holds at most %d batch buckets", FM_TUNE_MAX_BUCKETS);
    memmove(&f->b[i + 1], &f->b[i], (size_t)(f->n - i) * sizeof f->b[0]);
    f->b[i] = *b;
    f->n++;
    return FM_OK;
}

/* ------------------------------------------------------------- matching */

fm_tune_match fm_tune_key_match(const fm_tune_key *fk, const fm_tune_key *want, char *note, size_t cap) {
    if (note && cap) note[0] = 0;
    if (strcmp(fk->gpu_name, want->gpu_name) != 0) {
        snprintf(note, cap, "tuned for GPU '%s', not '%s'", fk->gpu_name, want->gpu_name);
        return FM_TUNE_MISMATCH_SHAPE;
    }
    if (fk->fmt != want->fmt || fk->E != want->E || fk->H != want->H || fk->I != want->I || fk->k != want->k) {
        snprintf(note, cap, "tuned for %s E=%d H=%d I=%d k=%d, not %s E=%d H=%d I=%d k=%d", fm_qformat_name(fk->fmt),
                 fk->E, fk->H, fk->I, fk->k, fm_qformat_name(want->fmt), want->E, want->H, want->I, want->k);
        return FM_TUNE_MISMATCH_SHAPE;
    }
    if (fk->sm_count != want->sm_count) {
        snprintf(note, cap, "tuned on %d SMs, this GPU has %d (a different part or a MIG slice)", fk->sm_count,
                 want->sm_count);
        return FM_TUNE_MISMATCH_SM;
    }
    /* Versions are noted, not enforced: a new toolkit rarely changes which
     * launch shape wins, and a stale config is better than none. 0 means
     * unknown (explain --gpu), which is not a difference. */
    if (fk->cuda_version && want->cuda_version && fk->cuda_version != want->cuda_version)
        fm_tune_appendf(note, cap, "tuned with CUDA runtime %d, running %d", fk->cuda_version, want->cuda_version);
    if (fk->driver_version && want->driver_version && fk->driver_version != want->driver_version)
        fm_tune_appendf(note, cap, "%stuned with driver %d, running %d", note[0] ? "; " : "", fk->driver_version,
                        want->driver_version);
    return FM_TUNE_MATCH;
}

/* ------------------------------------------------------------- writing */

void *fm_tune_params_json(const fm_kernel_config *c) {
    return json_pack("{s:s, s:i, s:i, s:i, s:i, s:i, s:f}", "path", fm_tune_path_token(c->path), "rows_per_block",
                     c->rows_per_block, "k_split", c->k_split, "warps", c->warps, "stages", c->stages, "tile_n",
                     c->tile_n, "switch_tpe", (double)c->switch_tpe);
}

/* Microseconds with 0.01 µs resolution: more digits are noise and make
 * files needlessly hard to read. */
static double us2(double x) { return round(x * 100.0) / 100.0; }

char *fm_tune_file_to_json(const fm_tune_file *f) {
    const fm_tune_key *k = &f->key;
    json_t *root = json_object();
    json_t *key = json_pack("{s:s, s:i, s:i, s:i, s:s, s:i, s:i, s:i, s:i}", "gpu", k->gpu_name, "sm_count",
                            k->sm_count, "cuda_version", k->cuda_version, "driver_version", k->driver_version,
                            "format", fm_qformat_name(k->fmt), "E", k->E, "H", k->H, "I", k->I, "k", k->k);
    json_t *arr = json_array();
    char *s = NULL;
    if (!root || !key || !arr) goto fail;
    json_object_set_new(root, "fp4moe_tune_config", json_integer(FM_TUNE_FILE_VERSION));
    json_object_set_new(root, "key", key);
    key = NULL;
    for (int i = 0; i < f->n; i++) {
        const fm_tune_bucket *b = &f->b[i];
        json_t *o = json_object();
        if (!o) goto fail;
        json_array_append_new(arr, o);
        json_object_set_new(o, "batch", json_integer(b->batch));
        json_object_set_new(o, "params", fm_tune_params_json(&b->cfg));
        json_object_set_new(o, "us", json_real(us2(b->us)));
        json_object_set_new(o, "us_min", json_real(us2(b->us_min)));
        json_object_set_new(o, "us_max", json_real(us2(b->us_max)));
        if (b->has_default_cfg) json_object_set_new(o, "default_params", fm_tune_params_json(&b->default_cfg));
        json_object_set_new(o, "default_us", json_real(us2(b->default_us)));
        json_object_set_new(o, "default_us_min", json_real(us2(b->default_us_min)));
        json_object_set_new(o, "default_us_max", json_real(us2(b->default_us_max)));
        json_object_set_new(o, "replaced_default", json_boolean(b->replaced_default));
        json_object_set_new(o, "date", json_string(b->date));
        json_object_set_new(o, "fp4moe_version", json_string(b->version));
    }
    json_object_set_new(root, "buckets", arr);
    arr = NULL;
    s = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(10));
    json_decref(root);
    if (!s) { fm_error(FM_E_NOMEM, "out of memory writing a tuned config"); return NULL; }
    /* Trailing newline so the files diff cleanly in the repo. */
    size_t n = strlen(s);
    char *t = fm_malloc(n + 2);
    if (t) { memcpy(t, s, n); t[n] = '\n'; t[n + 1] = 0; }
    free(s);
    return t;
fail:
    json_decref(root);
    json_decref(key);
    json_decref(arr);
    fm_error(FM_E_NOMEM, "out of memory writing a tuned config");
    return NULL;
}
