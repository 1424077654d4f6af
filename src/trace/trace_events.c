/*
 * The Kineto (PyTorch-profiler) event model of a Chrome-trace document: the
 * top-level object, traceEvents, and per event the fields the analysis needs
 * (GPU activities, launches with their correlation ids, step annotations,
 * B/E pairs), plus the name table they are interned in. The JSON tokens come
 * from the streaming reader in trace_json.c.
 *
 * Memory: the reader's buffer (4 MiB, grown only for a single longer token),
 * the per-name table, and compact records of GPU activities, launches and
 * step annotations; nothing else of the document is kept.
 */
#include "trace/trace_internal.h"

#include <stdio.h>
#include <string.h>
#include <strings.h>

#define CHUNK (4u << 20)

/* ------------------------------------------------------------ string table */

uint64_t fm_tr_hash(const void *p, size_t n) {
    /* FNV-1a over 8-byte words (then bytes): fast enough for names that are
     * hashed once per event, and stable across runs. */
    const uint8_t *s = p;
    uint64_t h = 1469598103934665603ull ^ (uint64_t)n;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, s, 8);
        h = (h ^ w) * 1099511628211ull;
        h ^= h >> 29;
        s += 8;
        n -= 8;
    }
    while (n--) h = (h ^ *s++) * 1099511628211ull;
    return h ^ (h >> 32);
}

fm_status fm_tr_strtab_init(fm_tr_strtab *t) {
    memset(t, 0, sizeof *t);
    t->nslots = 256;
    t->slots = fm_calloc(t->nslots, sizeof *t->slots);
    return t->slots ? FM_OK : FM_E_NOMEM;
}

void fm_tr_strtab_free(fm_tr_strtab *t) {
    for (size_t i = 0; i < t->n; i++) free(t->str[i]);
    free(t->str);
    free(t->len);
    free(t->hashes);
    free(t->slots);
    memset(t, 0, sizeof *t);
}

static int strtab_grow(fm_tr_strtab *t) {
    size_t ns = t->nslots * 2;
    uint32_t *s = fm_calloc(ns, sizeof *s);
    if (!s) return -1;
    for (size_t i = 0; i < t->n; i++) {
        size_t j = t->hashes[i] & (ns - 1);
        while (s[j]) j = (j + 1) & (ns - 1);
        s[j] = (uint32_t)i + 1;
    }
    free(t->slots);
    t->slots = s;
    t->nslots = ns;
    return 0;
}

int64_t fm_tr_strtab_intern(fm_tr_strtab *t, const char *str, size_t len) {
    uint64_t h = fm_tr_hash(str, len);
    size_t j = h & (t->nslots - 1);
    while (t->slots[j]) {
        uint32_t i = t->slots[j] - 1;
        if (t->hashes[i] == h && t->len[i] == len && memcmp(t->str[i], str, len) == 0) return i;
        j = (j + 1) & (t->nslots - 1);
    }
    if (t->n >= UINT32_MAX - 1 || len >= UINT32_MAX) {
        fm_error(FM_E_RANGE, "too many distinct names");
        return -1;
    }
    if (t->n == t->cap) {
        size_t nc = t->cap ? t->cap * 2 : 64;
        char **ns = realloc(t->str, nc * sizeof *ns);
        if (!ns) goto oom;
        t->str = ns;
        uint32_t *nl = realloc(t->len, nc * sizeof *nl);
        if (!nl) goto oom;
        t->len = nl;
        uint64_t *nh = realloc(t->hashes, nc * sizeof *nh);
        if (!nh) goto oom;
        t->hashes = nh;
        t->cap = nc;
    }
    char *c = fm_malloc(len + 1);
    if (!c) return -1;
    memcpy(c, str, len);
    c[len] = 0;
    size_t i = t->n++;
    t->str[i] = c;
    t->len[i] = (uint32_t)len;
    t->hashes[i] = h;
    t->slots[j] = (uint32_t)i + 1;
    if (t->n * 2 > t->nslots && strtab_grow(t) != 0) return -1;
    return (int64_t)i;
oom:
    fm_error(FM_E_NOMEM, "out of memory interning names");
    return -1;
}

/* ------------------------------------------------------------- the events */

enum { V_ABSENT = 0, V_OK, V_BAD };
enum { C_NONE = 0, C_KERNEL, C_MEMCPY, C_MEMSET, C_RUNTIME, C_ANNOT, C_GPU_ANNOT, C_OTHER };

typedef struct {
    int ph;            /* first char of ph, 0 if absent */
    int ph_len;
    int cat;
    int name_state;    /* V_ABSENT / V_OK / V_BAD (not a string) */
    char *name;
    size_t name_len, name_cap;
    int ts_state, dur_state, corr_state, ext_state;
    int64_t ts, dur, corr, ext;
    int64_t pid, tid;  /* ids: numbers as is, strings hashed (top bit set) */
    size_t ts_at, dur_at, name_at;
} ev_t;

typedef struct {
    int64_t pid, tid;
    int64_t ts;
    int cat;
    char *name;
    size_t name_len;
} open_b;

typedef struct {
    fm_tr_jr r;
    fm_tr_file *f;
    ev_t ev;
    open_b *ob;
    size_t nob, ob_cap;
} pctx;

static int name_store(pctx *c, const char *s, size_t n) {
    ev_t *e = &c->ev;
    if (n + 1 > e->name_cap) {
        size_t nc = e->name_cap ? e->name_cap : 256;
        while (nc < n + 1) nc *= 2;
        char *nn = realloc(e->name, nc);
        if (!nn) {
            c->r.st = fm_error(FM_E_NOMEM, "%s: out of memory", c->r.label);
            return -1;
        }
        e->name = nn;
        e->name_cap = nc;
    }
    memcpy(e->name, s, n);
    e->name[n] = 0;
    e->name_len = n;
    return 0;
}

static int cat_code(const char *s, size_t n) {
#define IS(lit) (n == sizeof(lit) - 1 && strncasecmp(s, lit, n) == 0)
    if (IS("kernel")) return C_KERNEL;
    if (IS("cpu_op") || IS("ac2g") || IS("python_function")) return C_OTHER;
    if (IS("cuda_runtime") || IS("cuda_driver")) return C_RUNTIME;
    if (IS("gpu_memcpy")) return C_MEMCPY;
    if (IS("gpu_memset")) return C_MEMSET;
    if (IS("user_annotation")) return C_ANNOT;
    if (IS("gpu_user_annotation")) return C_GPU_ANNOT;
#undef IS
    return C_OTHER;
}

/* A number value at r->pos, or a string holding a number (Kineto and other
 * writers sometimes quote numbers). */
static int read_num_field(pctx *c, int c0, const char **s, size_t *n, int *is_str) {
    fm_tr_jr *r = &c->r;
    *is_str = 0;
    if (c0 == '"') {
        *is_str = 1;
        return fm_tr_jr_string(r, s, n);
    }
    if (c0 == '-' || (c0 >= '0' && c0 <= '9')) {
        if (c0 == '-' && r->pos + 1 < r->end && r->buf[r->pos + 1] == 'I') {
            fm_tr_jr_unexpected(r);
            return -1;
        }
        return fm_tr_jr_number(r, s, n);
    }
    *s = NULL;
    *n = 0;
    return fm_tr_jr_skip(r);
}

static int64_t id_of(const char *s, size_t n, int is_str) {
    int64_t v;
    if (!is_str && fm_tr_text_to_i64(s, n, &v) == 0) return v;
    return (int64_t)(fm_tr_hash(s, n) | (1ull << 63));
}

static int parse_time(pctx *c, int c0, int64_t *dst, int *state, size_t *at) {
    const char *s;
    size_t n;
    int is_str;
    *at = c->r.pos;
    if (read_num_field(c, c0, &s, &n, &is_str)) return -1;
    if (!s) {
        *state = V_BAD;
        return 0;
    }
    *state = fm_tr_us_text_to_ns(s, n, dst) == 0 ? V_OK : V_BAD;
    return 0;
}

/* One member of an object that walk_object hands to its reader. */
typedef struct {
    const char *key;
    size_t klen;
    int (*take)(pctx *, int);
} member;

/* Walks one JSON object value (anything else is skipped): a member named in
 * want[0..nwant) is handed to its take(c, ch) with ch its first character,
 * every other member is skipped. where names the object in messages. */
static int walk_object(pctx *c, const member *want, int nwant, const char *where) {
    fm_tr_jr *r = &c->r;
    int ch = fm_tr_jr_ws(r);
    if (ch != '{') return fm_tr_jr_skip(r);
    r->pos++;
    ch = fm_tr_jr_ws(r);
    if (ch == '}') {
        r->pos++;
        return 0;
    }
    char msg[64];
    for (;;) {
        /* (fm_tr_jr_fail keeps the first error, e.g. a read error behind ch < 0) */
        if (ch != '"') {
            snprintf(msg, sizeof msg, "expected a string key in %s", where);
            fm_tr_jr_fail(r, ch < 0 ? r->end : r->pos, ch < 0 ? "unexpected end of input (truncated file?)" : msg);
            return -1;
        }
        const char *k;
        size_t kn;
        if (fm_tr_jr_string(r, &k, &kn)) return -1;
        const member *hit = NULL;
        for (int i = 0; i < nwant && !hit; i++)
            if (kn == want[i].klen && memcmp(k, want[i].key, kn) == 0) hit = &want[i];
        if (fm_tr_jr_colon(r, "unexpected end of input (truncated file?)")) return -1;
        ch = fm_tr_jr_ws(r);
        if (ch < 0) {
            fm_tr_jr_fail(r, r->end, "unexpected end of input (truncated file?)");
            return -1;
        }
        if (hit ? hit->take(c, ch) : fm_tr_jr_skip(r)) return -1;
        int nx = fm_tr_jr_next(r, &ch, '}', "unexpected end of input (truncated file?)", "expected ',' or '}' in object");
        if (nx <= 0) return nx;
    }
}

/* args.correlation: a number or a numeric string */
static int take_correlation(pctx *c, int ch) {
    const char *s;
    size_t n;
    int is_str;
    if (read_num_field(c, ch, &s, &n, &is_str)) return -1;
    if (s && fm_tr_text_to_i64(s, n, &c->ev.corr) == 0) c->ev.corr_state = V_OK;
    else c->ev.corr_state = V_BAD;
    return 0;
}

/* args."External id" (the annotation's id: Kineto writes one GPU span of a
 * step per stream, all with the CPU span's id): a number or a numeric string */
static int take_external_id(pctx *c, int ch) {
    const char *s;
    size_t n;
    int is_str;
    if (read_num_field(c, ch, &s, &n, &is_str)) return -1;
    if (s && fm_tr_text_to_i64(s, n, &c->ev.ext) == 0) c->ev.ext_state = V_OK;
    else c->ev.ext_state = V_BAD;
    return 0;
}

static int parse_args(pctx *c) {
    static const member want[] = {{"correlation", 11, take_correlation}, {"External id", 11, take_external_id}};
    return walk_object(c, want, 2, "\"args\"");
}

#define PUSH(arr, n, cap, val)                                                                     \
    do {                                                                                           \
        if ((n) == (cap)) {                                                                        \
            size_t nc_ = (cap) ? (cap) * 2 : 1024;                                                 \
            void *np_ = realloc((arr), nc_ * sizeof *(arr));                                       \
            if (!np_) return fm_error(FM_E_NOMEM, "out of memory storing trace events");          \
            (arr) = np_;                                                                           \
            (cap) = nc_;                                                                           \
        }                                                                                          \
        (arr)[(n)++] = (val);                                                                      \
    } while (0)

static fm_status add_gpu(pctx *c, int cat, const char *name, size_t nlen, int64_t ts, int64_t dur, int64_t corr,
                         int64_t pid, int64_t tid) {
    fm_tr_file *f = c->f;
    int64_t id = fm_tr_strtab_intern(&f->names, name, nlen);
    if (id < 0) return FM_E_NOMEM;
    if ((size_t)id >= f->name_is_mem_cap) {
        size_t nc = f->name_is_mem_cap ? f->name_is_mem_cap * 2 : 256;
        while (nc <= (size_t)id) nc *= 2;
        uint8_t *nm = realloc(f->name_is_mem, nc);
        if (!nm) return fm_error(FM_E_NOMEM, "out of memory");
        memset(nm + f->name_is_mem_cap, 0, nc - f->name_is_mem_cap);
        f->name_is_mem = nm;
        f->name_is_mem_cap = nc;
    }
    if (cat == C_MEMCPY || cat == C_MEMSET) f->name_is_mem[id] = 1;
    size_t si;
    for (si = 0; si < f->nstreams; si++)
        if (f->streams[2 * si] == pid && f->streams[2 * si + 1] == tid) break;
    if (si == f->nstreams) {
        if (f->nstreams >= 65536) return fm_error(FM_E_RANGE, "%s: more than 65536 GPU streams", f->path);
        if (2 * f->nstreams + 2 > f->streams_cap) {
            size_t nc = f->streams_cap ? f->streams_cap * 2 : 32;
            int64_t *ns = realloc(f->streams, nc * sizeof *ns);
            if (!ns) return fm_error(FM_E_NOMEM, "out of memory");
            f->streams = ns;
            f->streams_cap = nc;
        }
        f->streams[2 * si] = pid;
        f->streams[2 * si + 1] = tid;
        f->nstreams++;
    }
    fm_tr_gpu g = {ts, dur, corr, (uint32_t)id, (uint32_t)si};
    PUSH(f->gpu, f->ngpu, f->gpu_cap, g);
    return FM_OK;
}

/* "ProfilerStep#N" or "step[DECODE bs=N]..." -> kind, N; -1 otherwise. */
static int span_kind(const char *s, size_t n, int64_t *num) {
    if (n > 13 && memcmp(s, "ProfilerStep#", 13) == 0) {
        int64_t v = 0;
        size_t i = 13;
        for (; i < n && s[i] >= '0' && s[i] <= '9' && v < (INT64_MAX / 10 - 10); i++) v = v * 10 + (s[i] - '0');
        if (i != n) return -1;
        *num = v;
        return FM_TR_SPAN_PROFILER;
    }
    if (n > 15 && memcmp(s, "step[DECODE bs=", 15) == 0) {
        int64_t v = 0;
        size_t i = 15;
        for (; i < n && s[i] >= '0' && s[i] <= '9' && v < (INT64_MAX / 10 - 10); i++) v = v * 10 + (s[i] - '0');
        if (i == 15 || i >= n || (s[i] != ']' && s[i] != ' ')) return -1;
        *num = v;
        return FM_TR_SPAN_SGLANG;
    }
    return -1;
}

static fm_status bad_event(pctx *c, size_t at, int64_t idx, const char *what) {
    fm_tr_jr *r = &c->r;
    return fm_error(FM_E_FORMAT, "%s: byte %llu: traceEvents[%lld]: %s", r->label, (unsigned long long)fm_tr_jr_off(r, at),
                    (long long)idx, what);
}

/* A complete event (ph X, or a B/E pair) with its fields. */
static fm_status emit(pctx *c, int cat, const char *name, size_t nlen, int64_t ts, int64_t dur, int64_t corr,
                      int64_t ext, int64_t pid, int64_t tid) {
    if (cat == C_KERNEL || cat == C_MEMCPY || cat == C_MEMSET) return add_gpu(c, cat, name, nlen, ts, dur, corr, pid, tid);
    if (cat == C_ANNOT || cat == C_GPU_ANNOT) {
        int64_t num;
        int k = span_kind(name, nlen, &num);
        if (k >= 0) {
            fm_tr_span sp = {ts, dur, num, ext, (uint8_t)k, (uint8_t)(cat == C_GPU_ANNOT)};
            PUSH(c->f->span, c->f->nspan, c->f->span_cap, sp);
        }
    }
    return FM_OK;
}

static fm_status finish_event(pctx *c, size_t at, int64_t idx) {
    ev_t *e = &c->ev;
    int cat = e->cat;
    if (e->ph_len != 1) return FM_OK;
    if (cat == C_RUNTIME) {
        if (e->ph == 'X' && e->corr_state == V_OK) {
            if (e->ts_state != V_OK)
                return bad_event(c, e->ts_state == V_BAD ? e->ts_at : at, idx,
                                 e->ts_state == V_BAD ? "\"ts\" of a CUDA runtime event is not a finite number"
                                                      : "CUDA runtime event has no \"ts\"");
            fm_tr_launch l = {e->ts, e->corr};
            PUSH(c->f->launch, c->f->nlaunch, c->f->launch_cap, l);
        }
        return FM_OK;
    }
    int is_gpu = cat == C_KERNEL || cat == C_MEMCPY || cat == C_MEMSET;
    int64_t num;
    /* annotations matter only when they mark steps */
    int is_span = (cat == C_ANNOT || cat == C_GPU_ANNOT) && e->name_state == V_OK &&
                  span_kind(e->name, e->name_len, &num) >= 0;
    int interesting = is_gpu || is_span;
    if (e->ph == 'X' && interesting) {
        if (e->name_state == V_ABSENT) return bad_event(c, at, idx, "GPU event has no \"name\"");
        if (e->name_state == V_BAD) return bad_event(c, e->name_at, idx, "\"name\" is not a string");
        if (e->ts_state == V_ABSENT) return bad_event(c, at, idx, is_gpu ? "GPU event has no \"ts\"" : "step annotation has no \"ts\"");
        if (e->ts_state == V_BAD) return bad_event(c, e->ts_at, idx, "\"ts\" is not a finite number");
        if (e->dur_state == V_ABSENT) return bad_event(c, at, idx, is_gpu ? "GPU event has no \"dur\"" : "step annotation has no \"dur\"");
        if (e->dur_state == V_BAD) return bad_event(c, e->dur_at, idx, "\"dur\" is not a finite number (NaN, inf, text or beyond 2^62 ns)");
        if (e->dur < 0) return bad_event(c, e->dur_at, idx, "\"dur\" is negative");
        return emit(c, cat, e->name, e->name_len, e->ts, e->dur, e->corr_state == V_OK ? e->corr : -1,
                    e->ext_state == V_OK && e->ext >= 0 ? e->ext : -1, e->pid, e->tid);
    }
    if (e->ph == 'B') {
        /* every B is kept (an E closes the most recent B of its thread,
         * whatever its category); only interesting ones keep their name */
        if (interesting) {
            if (e->name_state != V_OK) return bad_event(c, e->name_at, idx, "\"name\" is missing or not a string");
            if (e->ts_state != V_OK) return bad_event(c, e->ts_state == V_BAD ? e->ts_at : at, idx, "\"ts\" is missing or not a finite number");
        }
        open_b b = {e->pid, e->tid, e->ts, interesting ? cat : C_NONE, NULL, 0};
        if (interesting) {
            b.name = fm_malloc(e->name_len + 1);
            if (!b.name) return FM_E_NOMEM;
            memcpy(b.name, e->name, e->name_len + 1);
            b.name_len = e->name_len;
        }
        if (c->nob == c->ob_cap) {
            size_t nc = c->ob_cap ? c->ob_cap * 2 : 16;
            open_b *nb = realloc(c->ob, nc * sizeof *nb);
            if (!nb) {
                free(b.name);
                return fm_error(FM_E_NOMEM, "out of memory");
            }
            c->ob = nb;
            c->ob_cap = nc;
        }
        c->ob[c->nob++] = b;
        return FM_OK;
    }
    if (e->ph == 'E') {
        for (size_t i = c->nob; i-- > 0;) {
            open_b *b = &c->ob[i];
            if (b->pid != e->pid || b->tid != e->tid) continue;
            fm_status s = FM_OK;
            if (b->cat != C_NONE) {
                if (e->ts_state != V_OK) {
                    s = bad_event(c, e->ts_state == V_BAD ? e->ts_at : at, idx, "\"E\" event: \"ts\" is missing or not a finite number");
                } else if (e->ts < b->ts) {
                    s = bad_event(c, e->ts_at, idx, "\"E\" event ends before its \"B\" event");
                } else {
                    s = emit(c, b->cat, b->name, b->name_len, b->ts, e->ts - b->ts, -1, -1, b->pid, b->tid);
                }
            }
            free(b->name);
            memmove(b, b + 1, (c->nob - i - 1) * sizeof *b);
            c->nob--;
            return s;
        }
        c->f->n_unmatched++;
    }
    return FM_OK;
}

static int parse_event(pctx *c, int64_t idx) {
    fm_tr_jr *r = &c->r;
    ev_t *e = &c->ev;
    size_t at = r->pos;
    e->ph = 0;
    e->ph_len = 0;
    e->cat = C_NONE;
    e->name_state = e->ts_state = e->dur_state = e->corr_state = e->ext_state = V_ABSENT;
    e->pid = e->tid = 0;
    e->name_len = 0;
    r->pos++; /* '{' */
    int ch = fm_tr_jr_ws(r);
    if (ch == '}') {
        r->pos++;
        return 0;
    }
    for (;;) {
        if (ch < 0) goto eof;
        if (ch != '"') {
            fm_tr_jr_fail(r, r->pos, "expected a string key in event object");
            return -1;
        }
        const char *k;
        size_t kn;
        if (fm_tr_jr_string(r, &k, &kn)) return -1;
        /* identify the key before the buffer can move */
        int key = 0;
        switch (kn) {
        case 2:
            if (k[0] == 'p' && k[1] == 'h') key = 1;
            else if (k[0] == 't' && k[1] == 's') key = 2;
            break;
        case 3:
            if (!memcmp(k, "cat", 3)) key = 3;
            else if (!memcmp(k, "dur", 3)) key = 4;
            else if (!memcmp(k, "pid", 3)) key = 5;
            else if (!memcmp(k, "tid", 3)) key = 6;
            break;
        case 4:
            if (!memcmp(k, "name", 4)) key = 7;
            else if (!memcmp(k, "args", 4)) key = 8;
            break;
        }
        if (fm_tr_jr_colon(r, "unexpected end of input inside an event (truncated file?)")) return -1;
        ch = fm_tr_jr_ws(r);
        if (ch < 0) goto eof;
        switch (key) {
        case 1: /* ph */
            if (ch != '"') {
                fm_tr_jr_fail(r, r->pos, "\"ph\" is not a string");
                return -1;
            } else {
                const char *s;
                size_t n;
                if (fm_tr_jr_string(r, &s, &n)) return -1;
                e->ph = n ? (uint8_t)s[0] : 0;
                e->ph_len = (int)(n > 2 ? 2 : n);
            }
            break;
        case 3: /* cat */
            if (ch != '"') {
                fm_tr_jr_fail(r, r->pos, "\"cat\" is not a string");
                return -1;
            } else {
                const char *s;
                size_t n;
                if (fm_tr_jr_string(r, &s, &n)) return -1;
                e->cat = cat_code(s, n);
            }
            break;
        case 7: /* name */
            e->name_at = r->pos;
            if (ch == '"') {
                const char *s;
                size_t n;
                if (fm_tr_jr_string(r, &s, &n)) return -1;
                if (name_store(c, s, n)) return -1;
                e->name_state = V_OK;
            } else {
                if (fm_tr_jr_skip(r)) return -1;
                e->name_state = V_BAD;
            }
            break;
        case 2:
            if (parse_time(c, ch, &e->ts, &e->ts_state, &e->ts_at)) return -1;
            break;
        case 4:
            if (parse_time(c, ch, &e->dur, &e->dur_state, &e->dur_at)) return -1;
            break;
        case 5:
        case 6: {
            const char *s;
            size_t n;
            int is_str;
            if (read_num_field(c, ch, &s, &n, &is_str)) return -1;
            int64_t v = s ? id_of(s, n, is_str) : 0;
            if (key == 5) e->pid = v;
            else e->tid = v;
            break;
        }
        case 8:
            if (parse_args(c)) return -1;
            break;
        default:
            if (fm_tr_jr_skip(r)) return -1;
        }
        int nx = fm_tr_jr_next(r, &ch, '}', "unexpected end of input inside an event (truncated file?)",
                         "expected ',' or '}' in event object");
        if (nx < 0) return -1;
        if (nx == 0) break;
    }
    fm_status s = finish_event(c, at, idx);
    if (s != FM_OK) {
        r->st = s;
        return -1;
    }
    return 0;
eof:
    if (r->st == FM_OK) fm_tr_jr_fail(r, r->end, "unexpected end of input inside an event (truncated file?)");
    return -1;
}

static int parse_event_array(pctx *c) {
    fm_tr_jr *r = &c->r;
    r->pos++; /* '[' */
    int ch = fm_tr_jr_ws(r);
    if (ch == ']') {
        r->pos++;
        return 0;
    }
    for (;;) {
        if (ch < 0) goto eof;
        if (ch != '{') {
            char msg[96];
            snprintf(msg, sizeof msg, "traceEvents[%lld] is not an object", (long long)c->f->n_events);
            fm_tr_jr_fail(r, r->pos, msg);
            return -1;
        }
        if (parse_event(c, c->f->n_events)) return -1;
        c->f->n_events++;
        int nx = fm_tr_jr_next(r, &ch, ']', "unexpected end of input inside traceEvents (truncated file?)",
                         "expected ',' or ']' after an event in traceEvents");
        if (nx <= 0) return nx;
    }
eof:
    if (r->st == FM_OK) fm_tr_jr_fail(r, r->end, "unexpected end of input inside traceEvents (truncated file?)");
    return -1;
}

/* distributedInfo: {"rank": r, ...}; a rank that is not a small
 * non-negative integer is skipped */
static int take_rank(pctx *c, int ch) {
    if (ch < '0' || ch > '9') return fm_tr_jr_skip(&c->r);
    const char *s;
    size_t n;
    int64_t v;
    if (fm_tr_jr_number(&c->r, &s, &n)) return -1;
    if (fm_tr_text_to_i64(s, n, &v) == 0 && v < 1000000) c->f->dist_rank = (int)v;
    return 0;
}

static int parse_dist_info(pctx *c) {
    static const member want[] = {{"rank", 4, take_rank}};
    return walk_object(c, want, 1, "object");
}

static const char *kind_of(int ch) {
    switch (ch) {
    case '"': return "a string";
    case 't':
    case 'f': return "a boolean";
    case 'n': return "null";
    default: return "a number";
    }
}

static fm_status parse_doc(pctx *c) {
    fm_tr_jr *r = &c->r;
    int ch = fm_tr_jr_ws(r);
    if (ch == -2) return r->st;
    if (ch < 0) return fm_error(FM_E_FORMAT, "%s: empty file: not a JSON document", r->label);
    int seen_events = 0;
    if (ch == '[') {
        /* Chrome's "JSON array format": the document is the event list */
        if (parse_event_array(c)) return r->st;
        seen_events = 1;
    } else if (ch == '{') {
        r->pos++;
        ch = fm_tr_jr_ws(r);
        if (ch == '}') {
            r->pos++;
        } else {
            for (;;) {
                if (ch < 0) goto eof;
                if (ch != '"') {
                    fm_tr_jr_fail(r, r->pos, "expected a string key in the top-level object");
                    return r->st;
                }
                const char *k;
                size_t kn;
                if (fm_tr_jr_string(r, &k, &kn)) return r->st;
                int key = 0;
                if (kn == 11 && !memcmp(k, "traceEvents", 11)) key = 1;
                else if (kn == 15 && !memcmp(k, "distributedInfo", 15)) key = 2;
                if (fm_tr_jr_colon(r, "unexpected end of input (truncated file?)")) return r->st;
                ch = fm_tr_jr_ws(r);
                if (ch < 0) goto eof;
                if (key == 1) {
                    if (seen_events) {
                        fm_tr_jr_fail(r, r->pos, "\"traceEvents\" appears twice");
                        return r->st;
                    }
                    if (ch != '[') {
                        char msg[96];
                        snprintf(msg, sizeof msg, "\"traceEvents\" is %s, not an array",
                                 ch == '{' ? "an object" : kind_of(ch));
                        fm_tr_jr_fail(r, r->pos, msg);
                        return r->st;
                    }
                    if (parse_event_array(c)) return r->st;
                    seen_events = 1;
                } else if (key == 2) {
                    if (parse_dist_info(c)) return r->st;
                } else if (fm_tr_jr_skip(r)) {
                    return r->st;
                }
                int nx = fm_tr_jr_next(r, &ch, '}', "unexpected end of input (truncated file?)",
                                 "expected ',' or '}' in the top-level object");
                if (nx < 0) return r->st;
                if (nx == 0) break;
            }
        }
    } else {
        char msg[128];
        snprintf(msg, sizeof msg, "not a trace: the document is %s, not an object with \"traceEvents\"", kind_of(ch));
        fm_tr_jr_fail(r, r->pos, msg);
        return r->st;
    }
    ch = fm_tr_jr_ws(r);
    if (ch == -2) return r->st;
    if (ch >= 0) {
        fm_tr_jr_fail(r, r->pos, "trailing data after the JSON document");
        return r->st;
    }
    if (!seen_events)
        return fm_error(FM_E_FORMAT, "%s: not a PyTorch-profiler trace: the top-level object has no \"traceEvents\" array",
                        r->label);
    return FM_OK;
eof:
    if (r->st == FM_OK) fm_tr_jr_fail(r, r->end, "unexpected end of input (truncated file?)");
    return r->st;
}

/* Kineto writes a gpu_user_annotation per (device, stream) that ran work of
 * the annotation: a step whose kernels ran on several streams (a CUDA graph's
 * parallel branches, a side stream) has several GPU spans, each covering its
 * own stream's kernels. They are folded into one span per step, the union of
 * their windows: same kind and number, and the same "External id" (the CPU
 * annotation's id) or, where a writer gives none, overlapping windows. */
static int cmp_gspan(const void *a, const void *b) {
    const fm_tr_span *x = a, *y = b;
    if (x->gpu != y->gpu) return y->gpu - x->gpu; /* GPU spans first */
    if (x->kind != y->kind) return (x->kind > y->kind) - (x->kind < y->kind);
    if (x->num != y->num) return (x->num > y->num) - (x->num < y->num);
    if (x->ext != y->ext) return (x->ext > y->ext) - (x->ext < y->ext);
    return (x->ts > y->ts) - (x->ts < y->ts);
}

static void merge_gpu_spans(fm_tr_file *f) {
    if (f->nspan < 2) return;
    qsort(f->span, f->nspan, sizeof *f->span, cmp_gspan);
    size_t ngpu = 0;
    while (ngpu < f->nspan && f->span[ngpu].gpu) ngpu++;
    size_t out = 0;
    for (size_t i = 0; i < ngpu; i++) {
        fm_tr_span *cur = out ? &f->span[out - 1] : NULL, *sp = &f->span[i];
        int same = cur && cur->kind == sp->kind && cur->num == sp->num && cur->ext == sp->ext &&
                   (sp->ext >= 0 || sp->ts < cur->ts + cur->dur);
        if (same) {
            int64_t end = sp->ts + sp->dur > cur->ts + cur->dur ? sp->ts + sp->dur : cur->ts + cur->dur;
            cur->dur = end - cur->ts; /* sorted by ts within a group: cur->ts is the earliest */
            f->n_span_merged++;
        } else {
            f->span[out++] = *sp;
        }
    }
    if (out < ngpu) memmove(&f->span[out], &f->span[ngpu], (f->nspan - ngpu) * sizeof *f->span);
    f->nspan -= ngpu - out;
}

fm_status fm_tr_parse_sized(fm_tr_read_fn rd, void *ctx, const char *label, size_t cap_hint, fm_tr_file *f) {
    memset(f, 0, sizeof *f);
    f->rank_hint = -1;
    f->dist_rank = -1;
    f->path = fm_strdup(label);
    if (!f->path) return FM_E_NOMEM;
    fm_status s = fm_tr_strtab_init(&f->names);
    if (s != FM_OK) return s;
    pctx c;
    memset(&c, 0, sizeof c);
    c.f = f;
    c.r.rd = rd;
    c.r.ctx = ctx;
    c.r.label = f->path;
    c.r.cap = cap_hint && cap_hint < CHUNK ? (cap_hint < 256 ? 256 : cap_hint) : CHUNK;
    c.r.buf = fm_malloc(c.r.cap + 16);
    if (!c.r.buf) return FM_E_NOMEM;
    uint64_t t0 = fm_now_ns();
    s = parse_doc(&c);
    f->parse_s = (double)(fm_now_ns() - t0) * 1e-9;
    f->bytes = c.r.base + c.r.end;
    if (s == FM_OK) merge_gpu_spans(f);
    for (size_t i = 0; i < c.nob; i++) free(c.ob[i].name);
    f->n_unmatched += (int64_t)c.nob;
    free(c.ob);
    free(c.ev.name);
    free(c.r.sb);
    free(c.r.buf);
    return s;
}

fm_status fm_tr_parse(fm_tr_read_fn rd, void *ctx, const char *label, fm_tr_file *f) {
    return fm_tr_parse_sized(rd, ctx, label, 0, f);
}


void fm_tr_file_free(fm_tr_file *f) {
    if (!f) return;
    free(f->path);
    fm_tr_strtab_free(&f->names);
    free(f->name_is_mem);
    free(f->streams);
    free(f->gpu);
    free(f->launch);
    free(f->span);
    memset(f, 0, sizeof *f);
}
