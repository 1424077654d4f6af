/*
 * The byte level of the trace reader: a strict, hand-written JSON tokenizer
 * over a refillable buffer, the number texts it yields, and the byte sources
 * (memory, plain or gzip file) that fill it.
 *
 * yajl was tried first and left too little time for the real work; this
 * reader scans strings 16 bytes at a time and materializes only the tokens
 * the event parser asks for (see docs/trace.md). It still validates the
 * whole document: JSON grammar, string escapes, UTF-8, control characters,
 * nesting depth, trailing data. Every error names the file and the byte
 * offset in the uncompressed text.
 */
#include "trace/trace_internal.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <zlib.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define MAX_TOKEN (256u << 20) /* one string or number longer than this is refused */

/* ----------------------------------------------------------------- reader */


fm_status fm_tr_jr_fail(fm_tr_jr *r, size_t at, const char *what) {
    if (r->st == FM_OK)
        r->st = fm_error(FM_E_FORMAT, "%s: byte %llu: %s", r->label, (unsigned long long)fm_tr_jr_off(r, at), what);
    return r->st;
}

/* Moves buf[keep..end) to the front and reads more. Returns the number of
 * bytes added (0 at end of input); sets r->st on error. */
static size_t jr_refill(fm_tr_jr *r, size_t keep) {
    if (r->st != FM_OK || r->eof) return 0;
    if (keep > 0) {
        memmove(r->buf, r->buf + keep, r->end - keep);
        r->base += keep;
        r->pos -= keep;
        r->end -= keep;
    }
    if (r->cap - r->end < r->cap / 4) {
        if (r->end >= MAX_TOKEN) {
            fm_tr_jr_fail(r, 0, "a single JSON token is longer than 256 MiB");
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
int fm_tr_jr_ws_slow(fm_tr_jr *r) {
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


static int sb_put(fm_tr_jr *r, const void *p, size_t n) {
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

static void put_utf8(fm_tr_jr *r, uint32_t cp) {
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
int fm_tr_jr_string(fm_tr_jr *r, const char **s, size_t *n) {
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
                            fm_tr_jr_fail(r, p, "invalid \\u escape in string");
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
                    fm_tr_jr_fail(r, p, "invalid escape sequence in string");
                    return -1;
                }
                if (sb_put(r, &out, 1)) return -1;
                p += 2;
                seg = p;
                continue;
            }
            if (c < 0x20) {
                fm_tr_jr_fail(r, p, "control character inside a string (unterminated string?)");
                return -1;
            }
            int l = utf8_len(r->buf + p, r->end - p);
            if (l < 0) goto more;
            if (l == 0) {
                fm_tr_jr_fail(r, p, "invalid UTF-8 in string");
                return -1;
            }
            p += (size_t)l;
        }
    more:
        if (r->st != FM_OK) return -1;
        if (!jr_refill(r, start)) {
            if (r->st == FM_OK) fm_tr_jr_fail(r, r->end, "unexpected end of input inside a string (truncated file?)");
            return -1;
        }
        /* the whole string is rescanned from its (moved) start */
    }
}

/* Scans a JSON number at r->pos; *s / *n view its text. */
int fm_tr_jr_number(fm_tr_jr *r, const char **s, size_t *n) {
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
            fm_tr_jr_fail(r, p, "invalid number");
            return -1;
        }
        if (p < e && b[p] == '.') {
            p++;
            NEED();
            if (!(b[p] >= '0' && b[p] <= '9')) {
                fm_tr_jr_fail(r, p, "invalid number: digit expected after '.'");
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
                fm_tr_jr_fail(r, p, "invalid number: digit expected in exponent");
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
            fm_tr_jr_fail(r, r->end, "unexpected end of input inside a number (truncated file?)");
            return -1;
        }
        jr_refill(r, start);
        if (r->st != FM_OK) return -1;
        /* rescan from the (moved) start; at end of input the number ends */
    }
}

/* Reports the byte at r->pos as the start of an invalid value. */
void fm_tr_jr_unexpected(fm_tr_jr *r) {
    uint8_t c = r->pos < r->end ? r->buf[r->pos] : 0;
    if (c == 'N' || c == 'I' || (c == '-' && r->pos + 1 < r->end && r->buf[r->pos + 1] == 'I'))
        fm_tr_jr_fail(r, r->pos, "invalid literal (NaN / Infinity are not JSON: a non-finite number?)");
    else
        fm_tr_jr_fail(r, r->pos, "unexpected character (expected a JSON value)");
}

/* Matches the literal lit at r->pos. */
static int jr_literal(fm_tr_jr *r, const char *lit) {
    size_t n = strlen(lit);
    while (r->end - r->pos < n) {
        if (!jr_refill(r, r->pos)) break;
    }
    if (r->st != FM_OK) return -1;
    if (r->end - r->pos < n || memcmp(r->buf + r->pos, lit, n) != 0) {
        if (r->end - r->pos < n && memcmp(r->buf + r->pos, lit, r->end - r->pos) == 0)
            fm_tr_jr_fail(r, r->end, "unexpected end of input (truncated file?)");
        else
            fm_tr_jr_unexpected(r);
        return -1;
    }
    r->pos += n;
    return 0;
}

/* After an object key: whitespace, then the ':' (consumed). Returns 0, or
 * -1 with the error set (eof_msg at end of input). A refill may move the
 * buffer, so callers read the key's bytes before calling this. */
int fm_tr_jr_colon(fm_tr_jr *r, const char *eof_msg) {
    int ch = fm_tr_jr_ws(r);
    if (ch < 0) {
        fm_tr_jr_fail(r, r->end, eof_msg);
        return -1;
    }
    if (ch != ':') {
        fm_tr_jr_fail(r, r->pos, "expected ':' after object key");
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
int fm_tr_jr_next(fm_tr_jr *r, int *ch, int close, const char *eof_msg, const char *what) {
    int c = fm_tr_jr_ws(r);
    if (c == ',') {
        r->pos++;
        *ch = fm_tr_jr_ws(r);
        return 1;
    }
    if (c == close) {
        r->pos++;
        return 0;
    }
    if (c >= 0) fm_tr_jr_fail(r, r->pos, what);
    else if (r->st == FM_OK) fm_tr_jr_fail(r, r->end, eof_msg);
    return -1;
}

/* Validates and skips one JSON value of any kind (iteratively, with a
 * depth limit). */
int fm_tr_jr_skip(fm_tr_jr *r) {
    int base = r->depth;
    int c;
    for (;;) {
        c = fm_tr_jr_ws(r);
        if (c < 0) goto eof;
        /* a value */
        switch (c) {
        case '{':
        case '[': {
            if (r->depth >= FM_TR_MAX_DEPTH) {
                fm_tr_jr_fail(r, r->pos, "nesting deeper than 512 levels");
                return -1;
            }
            r->stack[r->depth++] = (uint8_t)c;
            r->pos++;
            c = fm_tr_jr_ws(r);
            if (c < 0) goto eof;
            if ((c == '}' && r->stack[r->depth - 1] == '{') || (c == ']' && r->stack[r->depth - 1] == '[')) {
                r->pos++;
                r->depth--;
                break;
            }
            if (r->stack[r->depth - 1] == '{') {
                if (c != '"') {
                    fm_tr_jr_fail(r, r->pos, "expected a string key in object");
                    return -1;
                }
                const char *s;
                size_t n;
                if (fm_tr_jr_string(r, &s, &n) || fm_tr_jr_colon(r, "unexpected end of input (truncated file?)")) return -1;
            }
            continue; /* parse the first member value */
        }
        case '"': {
            const char *s;
            size_t n;
            if (fm_tr_jr_string(r, &s, &n)) return -1;
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
                    fm_tr_jr_unexpected(r);
                    return -1;
                }
                if (fm_tr_jr_number(r, &s, &n)) return -1;
            } else {
                fm_tr_jr_unexpected(r);
                return -1;
            }
        }
        /* after a value: close containers or move to the next member */
        for (;;) {
            if (r->depth == base) return 0;
            c = fm_tr_jr_ws(r);
            if (c < 0) goto eof;
            uint8_t k = r->stack[r->depth - 1];
            if (c == ',') {
                r->pos++;
                if (k == '{') {
                    c = fm_tr_jr_ws(r);
                    if (c < 0) goto eof;
                    if (c != '"') {
                        fm_tr_jr_fail(r, r->pos, "expected a string key in object");
                        return -1;
                    }
                    const char *s;
                    size_t n;
                    if (fm_tr_jr_string(r, &s, &n) || fm_tr_jr_colon(r, "unexpected end of input (truncated file?)")) return -1;
                }
                break; /* next value */
            }
            if ((c == '}' && k == '{') || (c == ']' && k == '[')) {
                r->pos++;
                r->depth--;
                continue;
            }
            fm_tr_jr_fail(r, r->pos, k == '{' ? "expected ',' or '}' in object" : "expected ',' or ']' in array");
            return -1;
        }
    }
eof:
    if (c == -1 || r->st == FM_OK) fm_tr_jr_fail(r, r->end, "unexpected end of input (truncated file?)");
    return -1;
}

/* ---------------------------------------------------------- number values */

/* |times| stay below 2^62 ns (146 years in us since the epoch; Kineto's
 * timestamps are ~1.7e18 ns), so that ts + dur and differences of two
 * times never overflow. */
#define TIME_LIMIT_NS (1ull << 62)

/* Converts a decimal microsecond value to integer nanoseconds (rounded
 * half away from zero). Returns 0 on success, -1 if not finite / too big. */
int fm_tr_us_text_to_ns(const char *s, size_t n, int64_t *out) {
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
int fm_tr_text_to_i64(const char *s, size_t n, int64_t *out) {
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
    return fm_tr_parse_sized(mem_read, &m, label, len + 1, out);
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
