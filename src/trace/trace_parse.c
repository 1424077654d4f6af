/*
 * Streaming reader of Kineto (PyTorch-profiler) Chrome-trace JSON.
 *
 * A strict, hand-written JSON tokenizer over a refillable buffer. yajl was
 * measured first: with empty callbacks it parses a Kineto-shaped file at
 * ~220 MB/s on the development machine, which leaves no room for the real
 * work under the 200 MB/s target; this reader scans strings 16 bytes at a
 * time and materializes only the fields the analysis needs (see
 * docs/trace.md). It still validates the whole document: JSON grammar,
 * string escapes, UTF-8, control characters, nesting depth, trailing data.
 * Every error names the file and the byte offset in the uncompressed text.
 *
 * Memory: the buffer (4 MiB, grown only for a single longer token), the
 * per-name table, and compact records of GPU activities, launches and step
 * annotations; nothing else of the document is kept.
 */
#include "trace/trace_internal.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <zlib.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define CHUNK (4u << 20)
#define MAX_TOKEN (256u << 20) /* one string or number longer than this is refused */
#define MAX_DEPTH 512

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

/* ----------------------------------------------------------------- reader */

typedef struct {
    fm_tr_read_fn rd;
    void *ctx;
    const char *label;
    uint8_t *buf;
    size_t cap, pos, end;
    uint64_t base; /* stream offset of buf[0] */
    int eof;
    fm_status st;  /* first error */
    int depth;
    uint8_t stack[MAX_DEPTH]; /* container kinds while skipping */
    /* scratch for unescaped strings */
    char *sb;
    size_t sb_len, sb_cap;
} jr;

static uint64_t off_at(const jr *r, size_t i) { return r->base + i; }

static fm_status jr_fail(jr *r, size_t at, const char *what) {
    if (r->st == FM_OK)
        r->st = fm_error(FM_E_FORMAT, "%s: byte %llu: %s", r->label, (unsigned long long)off_at(r, at), what);
    return r->st;
}

/* Moves buf[keep..end) to the front and reads more. Returns the number of
 * bytes added (0 at end of input); sets r->st on error. */
static size_t jr_refill(jr *r, size_t keep) {
    if (r->st != FM_OK || r->eof) return 0;
    if (keep > 0) {
        memmove(r->buf, r->buf + keep, r->end - keep);
        r->base += keep;
        r->pos -= keep;
        r->end -= keep;
    }
    if (r->cap - r->end < r->cap / 4) {
        if (r->end >= MAX_TOKEN) {
            jr_fail(r, 0, "a single JSON token is longer than 256 MiB");
            return 0;
        }
        size_t nc = r->cap * 2;
        uint8_t *nb = realloc(r->buf, nc + 16);
        if (!nb) {
            r->st = fm_error(FM_E_NOMEM, "%s: out of memory growing the read buffer", r->label);
            return 0;
        }
        r->buf = nb;
        r->cap = nc;
    }
    size_t got = 0;
    fm_status s = r->rd(r->ctx, r->buf + r->end, r->cap - r->end, &got);
    if (s != FM_OK) {
        r->st = s;
        return 0;
    }
    if (got == 0) r->eof = 1;
    r->end += got;
    return got;
}

/* Skips whitespace; returns the next byte (not consumed), -1 at end of
 * input, -2 on error. */
static int jr_ws_slow(jr *r) {
    for (;;) {
        const uint8_t *b = r->buf;
        size_t p = r->pos, e = r->end;
        while (p < e) {
            uint8_t c = b[p];
            if (c == ' ' || c == '\n' || c == '\r' || c == '\t') p++;
            else {
                r->pos = p;
                return c;
            }
        }
        r->pos = p;
        if (!jr_refill(r, r->pos)) return r->st != FM_OK ? -2 : -1;
    }
}

/* Most tokens follow zero or one byte of whitespace: test those inline. */
static inline int jr_ws(jr *r) {
    size_t p = r->pos;
    if (p + 1 < r->end) {
        uint8_t c = r->buf[p];
        if (c > ' ') return c;
        if (c == ' ' && r->buf[p + 1] > ' ') {
            r->pos = p + 1;
            return r->buf[p + 1];
        }
    }
    return jr_ws_slow(r);
}

static int sb_put(jr *r, const void *p, size_t n) {
    if (r->sb_len + n + 1 > r->sb_cap) {
        size_t nc = r->sb_cap ? r->sb_cap : 256;
        while (nc < r->sb_len + n + 1) nc *= 2;
        char *ns = realloc(r->sb, nc);
        if (!ns) {
            r->st = fm_error(FM_E_NOMEM, "%s: out of memory", r->label);
            return -1;
        }
        r->sb = ns;
        r->sb_cap = nc;
    }
    memcpy(r->sb + r->sb_len, p, n);
    r->sb_len += n;
    r->sb[r->sb_len] = 0;
    return 0;
}

static int hexval(uint8_t c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Length of a valid UTF-8 sequence at s (n bytes available), 0 if invalid,
 * -1 if more bytes are needed. */
static int utf8_len(const uint8_t *s, size_t n) {
    uint8_t c = s[0];
    int len;
    uint32_t min;
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) len = 2, min = 0x80;
    else if (c >= 0xE0 && c <= 0xEF) len = 3, min = 0x800;
    else if (c >= 0xF0 && c <= 0xF4) len = 4, min = 0x10000;
    else return 0;
    if ((size_t)len > n) {
        for (size_t i = 1; i < n; i++)
            if ((s[i] & 0xC0) != 0x80) return 0;
        return -1;
    }
    uint32_t cp = c & (0x7F >> len);
    for (int i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    return len;
}

static void put_utf8(jr *r, uint32_t cp) {
    uint8_t o[4];
    size_t n;
    if (cp == 0) cp = 0xFFFD; /* names are C strings: \u0000 is shown as U+FFFD */
    if (cp < 0x80) o[0] = (uint8_t)cp, n = 1;
    else if (cp < 0x800) o[0] = 0xC0 | (cp >> 6), o[1] = 0x80 | (cp & 0x3F), n = 2;
    else if (cp < 0x10000) o[0] = 0xE0 | (cp >> 12), o[1] = 0x80 | ((cp >> 6) & 0x3F), o[2] = 0x80 | (cp & 0x3F), n = 3;
    else o[0] = 0xF0 | (cp >> 18), o[1] = 0x80 | ((cp >> 12) & 0x3F), o[2] = 0x80 | ((cp >> 6) & 0x3F), o[3] = 0x80 | (cp & 0x3F), n = 4;
    sb_put(r, o, n);
}

/* Index of the first byte in [p, e) that is '"', '\\', a control character
 * or non-ASCII; e if none. */
static inline size_t scan_special(const uint8_t *b, size_t p, size_t e) {
#if defined(__SSE2__)
    const __m128i q = _mm_set1_epi8('"'), bs = _mm_set1_epi8('\\'), sp = _mm_set1_epi8(0x20);
    while (p + 16 <= e) {
        __m128i x = _mm_loadu_si128((const __m128i *)(b + p));
        /* signed compare: bytes >= 0x80 are negative, so "< 0x20" catches
         * control characters and non-ASCII bytes at once */
        __m128i m = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(x, q), _mm_cmpeq_epi8(x, bs)), _mm_cmplt_epi8(x, sp));
        int mask = _mm_movemask_epi8(m);
        if (mask) return p + (size_t)__builtin_ctz((unsigned)mask);
        p += 16;
    }
#endif
    while (p < e) {
        uint8_t c = b[p];
        if (c == '"' || c == '\\' || c < 0x20 || c >= 0x80) return p;
        p++;
    }
    return e;
}

/* Parses the string at r->pos (which is '"'). On success *s / *n view the
 * unescaped text: into the buffer when it had no escapes, else into the
 * scratch buffer. The view is valid until the next read. */
static int jr_string(jr *r, const char **s, size_t *n) {
    for (;;) {
        size_t start = r->pos;
        size_t p = start + 1;
        int escaped = 0;
        r->sb_len = 0;
        size_t seg = p;
        for (;;) {
            p = scan_special(r->buf, p, r->end);
            if (p >= r->end) goto more;
            uint8_t c = r->buf[p];
            if (c == '"') {
                if (escaped) {
                    if (sb_put(r, r->buf + seg, p - seg)) return -1;
                    *s = r->sb;
                    *n = r->sb_len;
                } else {
                    *s = (const char *)r->buf + start + 1;
                    *n = p - start - 1;
                }
                r->pos = p + 1;
                return 0;
            }
            if (c == '\\') {
                if (!escaped) {
                    escaped = 1;
                    r->sb_len = 0;
                }
                if (sb_put(r, r->buf + seg, p - seg)) return -1;
                if (p + 1 >= r->end) goto more;
                uint8_t e = r->buf[p + 1];
                char out = 0;
                switch (e) {
                case '"': out = '"'; break;
                case '\\': out = '\\'; break;
                case '/': out = '/'; break;
                case 'b': out = '\b'; break;
                case 'f': out = '\f'; break;
                case 'n': out = '\n'; break;
                case 'r': out = '\r'; break;
                case 't': out = '\t'; break;
                case 'u': {
                    if (p + 6 > r->end) goto more;
                    uint32_t cp = 0;
                    for (int i = 0; i < 4; i++) {
                        int h = hexval(r->buf[p + 2 + i]);
                        if (h < 0) {
                            jr_fail(r, p, "invalid \\u escape in string");
                            return -1;
                        }
                        cp = cp * 16 + (uint32_t)h;
                    }
                    size_t adv = 6;
                    if (cp >= 0xD800 && cp <= 0xDBFF) {
                        if (p + 12 > r->end && !r->eof) goto more;
                        uint32_t lo = 0;
                        int ok = p + 12 <= r->end && r->buf[p + 6] == '\\' && r->buf[p + 7] == 'u';
                        for (int i = 0; ok && i < 4; i++) {
                            int h = hexval(r->buf[p + 8 + i]);
                            if (h < 0) ok = 0;
                            else lo = lo * 16 + (uint32_t)h;
                        }
                        if (ok && lo >= 0xDC00 && lo <= 0xDFFF) {
                            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                            adv = 12;
                        } else {
                            cp = 0xFFFD; /* lone surrogate: replaced, as JSON decoders that accept it display it */
                        }
                    } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                        cp = 0xFFFD;
                    }
                    put_utf8(r, cp);
                    if (r->st != FM_OK) return -1;
                    p += adv;
                    seg = p;
                    continue;
                }
                default:
                    jr_fail(r, p, "invalid escape sequence in string");
                    return -1;
                }
                if (sb_put(r, &out, 1)) return -1;
                p += 2;
                seg = p;
                continue;
            }
            if (c < 0x20) {
                jr_fail(r, p, "control character inside a string (unterminated string?)");
                return -1;
            }
            int l = utf8_len(r->buf + p, r->end - p);
            if (l < 0) goto more;
            if (l == 0) {
                jr_fail(r, p, "invalid UTF-8 in string");
                return -1;
            }
            p += (size_t)l;
        }
    more:
        if (r->st != FM_OK) return -1;
        if (!jr_refill(r, start)) {
            if (r->st == FM_OK) jr_fail(r, r->end, "unexpected end of input inside a string (truncated file?)");
            return -1;
        }
        /* the whole string is rescanned from its (moved) start */
    }
}

/* Scans a JSON number at r->pos; *s / *n view its text. */
static int jr_number(jr *r, const char **s, size_t *n) {
    for (;;) {
        size_t start = r->pos, p = start, e = r->end;
        const uint8_t *b = r->buf;
#define NEED()                                                                                     \
    do {                                                                                           \
        if (p >= e) goto more;                                                                     \
    } while (0)
        NEED();
        if (b[p] == '-') {
            p++;
            NEED();
        }
        if (b[p] == '0') {
            p++;
        } else if (b[p] >= '1' && b[p] <= '9') {
            while (p < e && b[p] >= '0' && b[p] <= '9') p++;
        } else {
            jr_fail(r, p, "invalid number");
            return -1;
        }
        if (p < e && b[p] == '.') {
            p++;
            NEED();
            if (!(b[p] >= '0' && b[p] <= '9')) {
                jr_fail(r, p, "invalid number: digit expected after '.'");
                return -1;
            }
            while (p < e && b[p] >= '0' && b[p] <= '9') p++;
        }
        if (p < e && (b[p] == 'e' || b[p] == 'E')) {
            p++;
            NEED();
            if (b[p] == '+' || b[p] == '-') {
                p++;
                NEED();
            }
            if (!(b[p] >= '0' && b[p] <= '9')) {
                jr_fail(r, p, "invalid number: digit expected in exponent");
                return -1;
            }
            while (p < e && b[p] >= '0' && b[p] <= '9') p++;
        }
        if (p >= e && !r->eof) goto more; /* the number may continue */
#undef NEED
        *s = (const char *)b + start;
        *n = p - start;
        r->pos = p;
        return 0;
    more:
        if (r->eof) {
            jr_fail(r, r->end, "unexpected end of input inside a number (truncated file?)");
            return -1;
        }
        jr_refill(r, start);
        if (r->st != FM_OK) return -1;
        /* rescan from the (moved) start; at end of input the number ends */
    }
}

/* Reports the byte at r->pos as the start of an invalid value. */
static void jr_unexpected(jr *r) {
    uint8_t c = r->pos < r->end ? r->buf[r->pos] : 0;
    if (c == 'N' || c == 'I' || (c == '-' && r->pos + 1 < r->end && r->buf[r->pos + 1] == 'I'))
        jr_fail(r, r->pos, "invalid literal (NaN / Infinity are not JSON: a non-finite number?)");
    else
        jr_fail(r, r->pos, "unexpected character (expected a JSON value)");
}

/* Matches the literal lit at r->pos. */
static int jr_literal(jr *r, const char *lit) {
    size_t n = strlen(lit);
    while (r->end - r->pos < n) {
        if (!jr_refill(r, r->pos)) break;
    }
    if (r->st != FM_OK) return -1;
    if (r->end - r->pos < n || memcmp(r->buf + r->pos, lit, n) != 0) {
        if (r->end - r->pos < n && memcmp(r->buf + r->pos, lit, r->end - r->pos) == 0)
            jr_fail(r, r->end, "unexpected end of input (truncated file?)");
        else
            jr_unexpected(r);
        return -1;
    }
    r->pos += n;
    return 0;
}

/* After an object key: whitespace, then the ':' (consumed). Returns 0, or
 * -1 with the error set (eof_msg at end of input). A refill may move the
 * buffer, so callers read the key's bytes before calling this. */
static int jr_colon(jr *r, const char *eof_msg) {
    int ch = jr_ws(r);
    if (ch < 0) {
        jr_fail(r, r->end, eof_msg);
        return -1;
    }
    if (ch != ':') {
        jr_fail(r, r->pos, "expected ':' after object key");
        return -1;
    }
    r->pos++;
    return 0;
}

/* After a member of an object (close '}') or an element of an array (close
 * ']'): a ',' (returns 1, *ch = the next non-space character), the closing
 * bracket (returns 0, consumed), or an error (returns -1): input that ends
 * here (eof_msg, unless a read error is already recorded) or any other
 * character (what). */
static int jr_next(jr *r, int *ch, int close, const char *eof_msg, const char *what) {
    int c = jr_ws(r);
    if (c == ',') {
        r->pos++;
        *ch = jr_ws(r);
        return 1;
    }
    if (c == close) {
        r->pos++;
        return 0;
    }
    if (c >= 0) jr_fail(r, r->pos, what);
    else if (r->st == FM_OK) jr_fail(r, r->end, eof_msg);
    return -1;
}

/* Validates and skips one JSON value of any kind (iteratively, with a
 * depth limit). */
static int jr_skip(jr *r) {
    int base = r->depth;
    int c;
    for (;;) {
        c = jr_ws(r);
        if (c < 0) goto eof;
        /* a value */
        switch (c) {
        case '{':
        case '[': {
            if (r->depth >= MAX_DEPTH) {
                jr_fail(r, r->pos, "nesting deeper than 512 levels");
                return -1;
            }
            r->stack[r->depth++] = (uint8_t)c;
            r->pos++;
            c = jr_ws(r);
            if (c < 0) goto eof;
            if ((c == '}' && r->stack[r->depth - 1] == '{') || (c == ']' && r->stack[r->depth - 1] == '[')) {
                r->pos++;
                r->depth--;
                break;
            }
            if (r->stack[r->depth - 1] == '{') {
                if (c != '"') {
                    jr_fail(r, r->pos, "expected a string key in object");
                    return -1;
                }
                const char *s;
                size_t n;
                if (jr_string(r, &s, &n) || jr_colon(r, "unexpected end of input (truncated file?)")) return -1;
            }
            continue; /* parse the first member value */
        }
        case '"': {
            const char *s;
            size_t n;
            if (jr_string(r, &s, &n)) return -1;
            break;
        }
        case 't': if (jr_literal(r, "true")) return -1; break;
        case 'f': if (jr_literal(r, "false")) return -1; break;
        case 'n': if (jr_literal(r, "null")) return -1; break;
        default:
            if (c == '-' || (c >= '0' && c <= '9')) {
                const char *s;
                size_t n;
                if (c == '-' && r->pos + 1 < r->end && r->buf[r->pos + 1] == 'I') {
                    jr_unexpected(r);
                    return -1;
                }
                if (jr_number(r, &s, &n)) return -1;
            } else {
                jr_unexpected(r);
                return -1;
            }
        }
        /* after a value: close containers or move to the next member */
        for (;;) {
            if (r->depth == base) return 0;
            c = jr_ws(r);
            if (c < 0) goto eof;
            uint8_t k = r->stack[r->depth - 1];
            if (c == ',') {
                r->pos++;
                if (k == '{') {
                    c = jr_ws(r);
                    if (c < 0) goto eof;
                    if (c != '"') {
                        jr_fail(r, r->pos, "expected a string key in object");
                        return -1;
                    }
                    const char *s;
                    size_t n;
                    if (jr_string(r, &s, &n) || jr_colon(r, "unexpected end of input (truncated file?)")) return -1;
                }
                break; /* next value */
            }
            if ((c == '}' && k == '{') || (c == ']' && k == '[')) {
                r->pos++;
                r->depth--;
                continue;
            }
            jr_fail(r, r->pos, k == '{' ? "expected ',' or '}' in object" : "expected ',' or ']' in array");
            return -1;
        }
    }
eof:
    if (c == -1 || r->st == FM_OK) jr_fail(r, r->end, "unexpected end of input (truncated file?)");
    return -1;
}

/* ---------------------------------------------------------- number values */

/* |times| stay below 2^62 ns (146 years in us since the epoch; Kineto's
 * timestamps are ~1.7e18 ns), so that ts + dur and differences of two
 * times never overflow. */
#define TIME_LIMIT_NS (1ull << 62)

/* Converts a decimal microsecond value to integer nanoseconds (rounded
 * half away from zero). Returns 0 on success, -1 if not finite / too big. */
static int us_text_to_ns(const char *s, size_t n, int64_t *out) {
    size_t i = 0;
    int neg = 0;
    if (i < n && s[i] == '-') neg = 1, i++;
    uint64_t ip = 0;
    size_t nd = 0;
    while (i < n && s[i] >= '0' && s[i] <= '9') {
        if (nd >= 16) goto slow;
        ip = ip * 10 + (uint64_t)(s[i] - '0');
        i++;
        nd++;
    }
    if (nd == 0) return -1;
    uint64_t frac = 0;
    int fd = 0;
    int round_up = 0;
    if (i < n && s[i] == '.') {
        i++;
        size_t f0 = i;
        while (i < n && s[i] >= '0' && s[i] <= '9') {
            if (fd < 3) frac = frac * 10 + (uint64_t)(s[i] - '0'), fd++;
            else if (i == f0 + 3 && s[i] >= '5') round_up = 1;
            i++;
        }
        if (i == f0) return -1;
    }
    if (i != n || ip > 9000000000000000ull) goto slow; /* exponent, or too large */
    while (fd < 3) frac *= 10, fd++;
    uint64_t v = ip * 1000 + frac + (uint64_t)round_up;
    if (v >= TIME_LIMIT_NS) return -1;
    *out = neg ? -(int64_t)v : (int64_t)v;
    return 0;
slow: {
    char tmp[512];
    if (n >= sizeof tmp) return -1;
    memcpy(tmp, s, n);
    tmp[n] = 0;
    char *end = NULL;
    double d = strtod(tmp, &end);
    if (!end || *end || !isfinite(d)) return -1;
    d *= 1000.0;
    if (!(fabs(d) < (double)TIME_LIMIT_NS)) return -1;
    *out = (int64_t)llround(d);
    return 0;
}
}

/* Integer (correlation ids): exact for integers, rejects fractions. */
static int text_to_i64(const char *s, size_t n, int64_t *out) {
    size_t i = 0;
    int neg = 0;
    if (i < n && s[i] == '-') neg = 1, i++;
    if (i == n) return -1;
    uint64_t v = 0;
    for (; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return -1;
        if (v > (UINT64_MAX / 10) - 10) return -1;
        v = v * 10 + (uint64_t)(s[i] - '0');
    }
    if (v > (uint64_t)INT64_MAX) return -1;
    *out = neg ? -(int64_t)v : (int64_t)v;
    return 0;
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
    int ts_state, dur_state, corr_state;
    int64_t ts, dur, corr;
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
    jr r;
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
    jr *r = &c->r;
    *is_str = 0;
    if (c0 == '"') {
        *is_str = 1;
        return jr_string(r, s, n);
    }
    if (c0 == '-' || (c0 >= '0' && c0 <= '9')) {
        if (c0 == '-' && r->pos + 1 < r->end && r->buf[r->pos + 1] == 'I') {
            jr_unexpected(r);
            return -1;
        }
        return jr_number(r, s, n);
    }
    *s = NULL;
    *n = 0;
    return jr_skip(r);
}

static int64_t id_of(const char *s, size_t n, int is_str) {
    int64_t v;
    if (!is_str && text_to_i64(s, n, &v) == 0) return v;
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
    *state = us_text_to_ns(s, n, dst) == 0 ? V_OK : V_BAD;
    return 0;
}

/* Walks one JSON object value (anything else is skipped): the member named
 * key (klen bytes) is handed to take(c, ch) with ch its first character, every
 * other member is skipped. where names the object in messages. */
static int walk_object(pctx *c, const char *key, size_t klen, int (*take)(pctx *, int), const char *where) {
    jr *r = &c->r;
    int ch = jr_ws(r);
    if (ch != '{') return jr_skip(r);
    r->pos++;
    ch = jr_ws(r);
    if (ch == '}') {
        r->pos++;
        return 0;
    }
    char msg[64];
    for (;;) {
        /* (jr_fail keeps the first error, e.g. a read error behind ch < 0) */
        if (ch != '"') {
            snprintf(msg, sizeof msg, "expected a string key in %s", where);
            jr_fail(r, ch < 0 ? r->end : r->pos, ch < 0 ? "unexpected end of input (truncated file?)" : msg);
            return -1;
        }
        const char *k;
        size_t kn;
        if (jr_string(r, &k, &kn)) return -1;
        const int hit = kn == klen && memcmp(k, key, klen) == 0;
        if (jr_colon(r, "unexpected end of input (truncated file?)")) return -1;
        ch = jr_ws(r);
        if (ch < 0) {
            jr_fail(r, r->end, "unexpected end of input (truncated file?)");
            return -1;
        }
        if (hit ? take(c, ch) : jr_skip(r)) return -1;
        int nx = jr_next(r, &ch, '}', "unexpected end of input (truncated file?)", "expected ',' or '}' in object");
        if (nx <= 0) return nx;
    }
}

/* args.correlation: a number or a numeric string */
static int take_correlation(pctx *c, int ch) {
    const char *s;
    size_t n;
    int is_str;
    if (read_num_field(c, ch, &s, &n, &is_str)) return -1;
    if (s && text_to_i64(s, n, &c->ev.corr) == 0) c->ev.corr_state = V_OK;
    else c->ev.corr_state = V_BAD;
    return 0;
}

static int parse_args(pctx *c) { return walk_object(c, "correlation", 11, take_correlation, "\"args\""); }

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
    jr *r = &c->r;
    return fm_error(FM_E_FORMAT, "%s: byte %llu: traceEvents[%lld]: %s", r->label, (unsigned long long)off_at(r, at),
                    (long long)idx, what);
}

/* A complete event (ph X, or a B/E pair) with its fields. */
static fm_status emit(pctx *c, int cat, const char *name, size_t nlen, int64_t ts, int64_t dur, int64_t corr,
                      int64_t pid, int64_t tid) {
    if (cat == C_KERNEL || cat == C_MEMCPY || cat == C_MEMSET) return add_gpu(c, cat, name, nlen, ts, dur, corr, pid, tid);
    if (cat == C_ANNOT || cat == C_GPU_ANNOT) {
        int64_t num;
        int k = span_kind(name, nlen, &num);
        if (k >= 0) {
            fm_tr_span sp = {ts, dur, num, (uint8_t)k, (uint8_t)(cat == C_GPU_ANNOT)};
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
        return emit(c, cat, e->name, e->name_len, e->ts, e->dur, e->corr_state == V_OK ? e->corr : -1, e->pid, e->tid);
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
                    s = emit(c, b->cat, b->name, b->name_len, b->ts, e->ts - b->ts, -1, b->pid, b->tid);
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
    jr *r = &c->r;
    ev_t *e = &c->ev;
    size_t at = r->pos;
    e->ph = 0;
    e->ph_len = 0;
    e->cat = C_NONE;
    e->name_state = e->ts_state = e->dur_state = e->corr_state = V_ABSENT;
    e->pid = e->tid = 0;
    e->name_len = 0;
    r->pos++; /* '{' */
    int ch = jr_ws(r);
    if (ch == '}') {
        r->pos++;
        return 0;
    }
    for (;;) {
        if (ch < 0) goto eof;
        if (ch != '"') {
            jr_fail(r, r->pos, "expected a string key in event object");
            return -1;
        }
        const char *k;
        size_t kn;
        if (jr_string(r, &k, &kn)) return -1;
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
        if (jr_colon(r, "unexpected end of input inside an event (truncated file?)")) return -1;
        ch = jr_ws(r);
        if (ch < 0) goto eof;
        switch (key) {
        case 1: /* ph */
            if (ch != '"') {
                jr_fail(r, r->pos, "\"ph\" is not a string");
                return -1;
            } else {
                const char *s;
                size_t n;
                if (jr_string(r, &s, &n)) return -1;
                e->ph = n ? (uint8_t)s[0] : 0;
                e->ph_len = (int)(n > 2 ? 2 : n);
            }
            break;
        case 3: /* cat */
            if (ch != '"') {
                jr_fail(r, r->pos, "\"cat\" is not a string");
                return -1;
            } else {
                const char *s;
                size_t n;
                if (jr_string(r, &s, &n)) return -1;
                e->cat = cat_code(s, n);
            }
            break;
        case 7: /* name */
            e->name_at = r->pos;
            if (ch == '"') {
                const char *s;
                size_t n;
                if (jr_string(r, &s, &n)) return -1;
                if (name_store(c, s, n)) return -1;
                e->name_state = V_OK;
            } else {
                if (jr_skip(r)) return -1;
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
            if (jr_skip(r)) return -1;
        }
        int nx = jr_next(r, &ch, '}', "unexpected end of input inside an event (truncated file?)",
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
    if (r->st == FM_OK) jr_fail(r, r->end, "unexpected end of input inside an event (truncated file?)");
    return -1;
}

static int parse_event_array(pctx *c) {
    jr *r = &c->r;
    r->pos++; /* '[' */
    int ch = jr_ws(r);
    if (ch == ']') {
        r->pos++;
        return 0;
    }
    for (;;) {
        if (ch < 0) goto eof;
        if (ch != '{') {
            char msg[96];
            snprintf(msg, sizeof msg, "traceEvents[%lld] is not an object", (long long)c->f->n_events);
            jr_fail(r, r->pos, msg);
            return -1;
        }
        if (parse_event(c, c->f->n_events)) return -1;
        c->f->n_events++;
        int nx = jr_next(r, &ch, ']', "unexpected end of input inside traceEvents (truncated file?)",
                         "expected ',' or ']' after an event in traceEvents");
        if (nx <= 0) return nx;
    }
eof:
    if (r->st == FM_OK) jr_fail(r, r->end, "unexpected end of input inside traceEvents (truncated file?)");
    return -1;
}

/* distributedInfo: {"rank": r, ...}; a rank that is not a small
 * non-negative integer is skipped */
static int take_rank(pctx *c, int ch) {
    if (ch < '0' || ch > '9') return jr_skip(&c->r);
    const char *s;
    size_t n;
    int64_t v;
    if (jr_number(&c->r, &s, &n)) return -1;
    if (text_to_i64(s, n, &v) == 0 && v < 1000000) c->f->dist_rank = (int)v;
    return 0;
}

static int parse_dist_info(pctx *c) { return walk_object(c, "rank", 4, take_rank, "object"); }

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
    jr *r = &c->r;
    int ch = jr_ws(r);
    if (ch == -2) return r->st;
    if (ch < 0) return fm_error(FM_E_FORMAT, "%s: empty file: not a JSON document", r->label);
    int seen_events = 0;
    if (ch == '[') {
        /* Chrome's "JSON array format": the document is the event list */
        if (parse_event_array(c)) return r->st;
        seen_events = 1;
    } else if (ch == '{') {
        r->pos++;
        ch = jr_ws(r);
        if (ch == '}') {
            r->pos++;
        } else {
            for (;;) {
                if (ch < 0) goto eof;
                if (ch != '"') {
                    jr_fail(r, r->pos, "expected a string key in the top-level object");
                    return r->st;
                }
                const char *k;
                size_t kn;
                if (jr_string(r, &k, &kn)) return r->st;
                int key = 0;
                if (kn == 11 && !memcmp(k, "traceEvents", 11)) key = 1;
                else if (kn == 15 && !memcmp(k, "distributedInfo", 15)) key = 2;
                if (jr_colon(r, "unexpected end of input (truncated file?)")) return r->st;
                ch = jr_ws(r);
                if (ch < 0) goto eof;
                if (key == 1) {
                    if (seen_events) {
                        jr_fail(r, r->pos, "\"traceEvents\" appears twice");
                        return r->st;
                    }
                    if (ch != '[') {
                        char msg[96];
                        snprintf(msg, sizeof msg, "\"traceEvents\" is %s, not an array",
                                 ch == '{' ? "an object" : kind_of(ch));
                        jr_fail(r, r->pos, msg);
                        return r->st;
                    }
                    if (parse_event_array(c)) return r->st;
                    seen_events = 1;
                } else if (key == 2) {
                    if (parse_dist_info(c)) return r->st;
                } else if (jr_skip(r)) {
                    return r->st;
                }
                int nx = jr_next(r, &ch, '}', "unexpected end of input (truncated file?)",
                                 "expected ',' or '}' in the top-level object");
                if (nx < 0) return r->st;
                if (nx == 0) break;
            }
        }
    } else {
        char msg[128];
        snprintf(msg, sizeof msg, "not a trace: the document is %s, not an object with \"traceEvents\"", kind_of(ch));
        jr_fail(r, r->pos, msg);
        return r->st;
    }
    ch = jr_ws(r);
    if (ch == -2) return r->st;
    if (ch >= 0) {
        jr_fail(r, r->pos, "trailing data after the JSON document");
        return r->st;
    }
    if (!seen_events)
        return fm_error(FM_E_FORMAT, "%s: not a PyTorch-profiler trace: the top-level object has no \"traceEvents\" array",
                        r->label);
    return FM_OK;
eof:
    if (r->st == FM_OK) jr_fail(r, r->end, "unexpected end of input (truncated file?)");
    return r->st;
}

static fm_status parse_sized(fm_tr_read_fn rd, void *ctx, const char *label, size_t cap_hint, fm_tr_file *f) {
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
    for (size_t i = 0; i < c.nob; i++) free(c.ob[i].name);
    f->n_unmatched += (int64_t)c.nob;
    free(c.ob);
    free(c.ev.name);
    free(c.r.sb);
    free(c.r.buf);
    return s;
}

fm_status fm_tr_parse(fm_tr_read_fn rd, void *ctx, const char *label, fm_tr_file *f) {
    return parse_sized(rd, ctx, label, 0, f);
}

/* ------------------------------------------------------------------ inputs */

typedef struct {
    const uint8_t *p;
    size_t n, off;
} mem_src;

static fm_status mem_read(void *ctx, uint8_t *dst, size_t cap, size_t *got) {
    mem_src *m = ctx;
    size_t k = m->n - m->off < cap ? m->n - m->off : cap;
    memcpy(dst, m->p + m->off, k);
    m->off += k;
    *got = k;
    return FM_OK;
}

fm_status fm_tr_parse_mem(const void *buf, size_t len, const char *label, fm_tr_file *out) {
    mem_src m = {buf, len, 0};
    /* a buffer sized to a small document, so that tests and the fuzzer do
     * not allocate 4 MiB per call */
    return parse_sized(mem_read, &m, label, len + 1, out);
}

typedef struct {
    gzFile gz;
    const char *path;
    uint64_t total;
} gz_src;

static fm_status gz_read_fn(void *ctx, uint8_t *dst, size_t cap, size_t *got) {
    gz_src *g = ctx;
    if (cap > (1u << 30)) cap = 1u << 30;
    int n = gzread(g->gz, dst, (unsigned)cap);
    if (n < 0) {
        int err = 0;
        const char *m = gzerror(g->gz, &err);
        size_t pl = strlen(g->path);
        if (strncmp(m, g->path, pl) == 0 && m[pl] == ':') m += pl + 1 + (m[pl + 1] == ' ');
        return fm_error(FM_E_FORMAT, "%s: corrupt or truncated gzip data after %llu uncompressed bytes: %s", g->path,
                        (unsigned long long)g->total, err == Z_ERRNO ? strerror(errno) : m);
    }
    if (n == 0) {
        /* zlib reports a stream cut short at the end only through gzerror */
        int err = 0;
        const char *m = gzerror(g->gz, &err);
        size_t pl = strlen(g->path);
        if (strncmp(m, g->path, pl) == 0 && m[pl] == ':') m += pl + 1 + (m[pl + 1] == ' ');
        if (err != Z_OK && err != Z_STREAM_END)
            return fm_error(FM_E_FORMAT, "%s: corrupt or truncated gzip data after %llu uncompressed bytes: %s", g->path,
                            (unsigned long long)g->total, m);
    }
    g->total += (uint64_t)n;
    *got = (size_t)n;
    return FM_OK;
}

static int tp_rank_of(const char *path) {
    const char *b = strrchr(path, '/');
    b = b ? b + 1 : path;
    const char *p = b;
    int r = -1;
    while ((p = strstr(p, "-TP-")) != NULL) {
        p += 4;
        if (*p >= '0' && *p <= '9') {
            long v = strtol(p, NULL, 10);
            if (v >= 0 && v < 1000000) r = (int)v;
        }
    }
    return r;
}

fm_status fm_tr_parse_path(const char *path, fm_tr_file *out) {
    memset(out, 0, sizeof *out);
    FILE *fp = fopen(path, "rb");
    if (!fp) return fm_error(FM_E_IO, "%s: cannot open: %s", path, strerror(errno));
    uint8_t magic[2] = {0, 0};
    size_t m = fread(magic, 1, 2, fp);
    fclose(fp);
    gzFile gz = gzopen(path, "rb");
    if (!gz) return fm_error(FM_E_IO, "%s: cannot open: %s", path, strerror(errno));
    gzbuffer(gz, 1u << 20);
    gz_src g = {gz, path, 0};
    fm_status s = fm_tr_parse(gz_read_fn, &g, path, out);
    gzclose(gz);
    out->compressed = m == 2 && magic[0] == 0x1f && magic[1] == 0x8b;
    out->rank_hint = tp_rank_of(path);
    return s;
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
