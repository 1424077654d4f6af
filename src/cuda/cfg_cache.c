/* The per-layer table of kernel configs by batch size (cfg_cache.h). */
#include "cuda/cfg_cache.h"

#include <stdlib.h>
#include <string.h>

void fm_cfg_cache_free(fm_cfg_cache *c) {
    if (!c) return;
    free(c->slot);
    free(c->ent);
    c->slot = NULL;
    c->ent = NULL;
    c->cap = c->n = c->n_alloc = 0;
}

typedef struct {
    fm_cfg_cache *c;
    fm_cfg_resolve_fn fn;
    void *ctx;
    unsigned char *scratch;
    int failed;
} filler;

/* The entry index of batch T's choice, added when new; -1 when out of memory. */
static int resolve(filler *f, int T) {
    fm_cfg_cache *c = f->c;
    memset(f->scratch, 0, c->entry_size);
    f->fn(f->ctx, T, f->scratch);
    c->resolves++;
    for (int i = 0; i < c->n; i++)
        if (!memcmp(c->ent + (size_t)i * c->entry_size, f->scratch, c->entry_size)) return i;
    if (c->n == 65535) return -1; /* slots are 16 bits; the choices are a handful */
    if (c->n == c->n_alloc) {
        int na = c->n_alloc ? 2 * c->n_alloc : 8;
        if (na > 65535) na = 65535;
        unsigned char *p = realloc(c->ent, (size_t)na * c->entry_size);
        if (!p) return -1;
        c->ent = p;
        c->n_alloc = na;
    }
    memcpy(c->ent + (size_t)c->n * c->entry_size, f->scratch, c->entry_size);
    return c->n++;
}

/* Batches lo .. hi, whose ends resolved to a and b. */
static void fill_range(filler *f, int lo, int hi, int a, int b) {
    if (f->failed) return;
    if (a == b) {
        for (int t = lo; t <= hi; t++) f->c->slot[t] = (uint16_t)a;
        return;
    }
    if (hi - lo <= 1) {
        f->c->slot[lo] = (uint16_t)a;
        f->c->slot[hi] = (uint16_t)b;
        return;
    }
    const int mid = lo + (hi - lo) / 2;
    const int m = resolve(f, mid);
    if (m < 0) { f->failed = 1; return; }
    fill_range(f, lo, mid, a, m);
    fill_range(f, mid, hi, m, b);
}

fm_status fm_cfg_cache_fill(fm_cfg_cache *c, int cap, size_t entry_size, uint64_t gen, fm_cfg_resolve_fn fn,
                            void *ctx) {
    if (!c || cap < 1 || entry_size == 0 || !fn) return fm_error(FM_E_ARG, "fm_cfg_cache_fill: bad argument");
    const long made = c->resolves;
    fm_cfg_cache_free(c);
    c->resolves = made;
    c->entry_size = entry_size;
    c->gen = gen;
    c->slot = calloc((size_t)cap + 1, sizeof *c->slot);
    filler f = {c, fn, ctx, malloc(entry_size), 0};
    if (!c->slot || !f.scratch) {
        free(f.scratch);
        fm_cfg_cache_free(c);
        return fm_error(FM_E_NOMEM, "out of memory (kernel config table of %d batches)", cap);
    }
    const int a = resolve(&f, 1), b = cap > 1 ? resolve(&f, cap) : a;
    if (a < 0 || b < 0) f.failed = 1;
    else fill_range(&f, 1, cap, a, b);
    free(f.scratch);
    if (f.failed) {
        fm_cfg_cache_free(c);
        return fm_error(FM_E_NOMEM, "out of memory (kernel config table of %d batches)", cap);
    }
    c->cap = cap;
    return FM_OK;
}
