/* The per-layer table of kernel configs by batch size that the calls on
 * caller-owned memory read (engine.cu): every T in [1, cap] maps to one of
 * a few distinct entries (a kernel config, its launch parameters and where
 * it came from), resolved once when the table is filled, so that a call does
 * no lookup, no file I/O, no parsing and no allocation. Plain C (no CUDA
 * header), so that the host tests check it without a GPU. */
#ifndef FM_CFG_CACHE_H
#define FM_CFG_CACHE_H
#include "fp4moe.h"
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Writes the entry of batch T into entry (entry_size bytes, zeroed first by
 * the table, so equal choices compare equal byte for byte). */
typedef void (*fm_cfg_resolve_fn)(void *ctx, int T, void *entry);

typedef struct fm_cfg_cache {
    int cap;               /* batches 1 .. cap are in the table             */
    size_t entry_size;
    uint16_t *slot;        /* [cap + 1]: entry index of batch T             */
    unsigned char *ent;    /* [n][entry_size] distinct entries              */
    int n, n_alloc;
    uint64_t gen;          /* what the entries were resolved under (the
                            * engine's forced-config generation)            */
    long resolves;         /* resolver calls made so far (tests)            */
} fm_cfg_cache;

/* Fills the table for batches 1 .. cap with the resolver's choices. The
 * choice of each batch is asked for only where the choices at the ends of a
 * range differ (bisection), so a table of cap batches costs a few resolver
 * calls per distinct choice and log2(cap); this relies on each distinct
 * choice covering one range of batches, as nearest-bucket selection and the
 * defaults' thresholds do: the resolver must tell equal configs of buckets
 * that are not adjacent apart (the engine's entries carry the bucket, see
 * fm_tune_choice_source). On failure (FM_E_NOMEM) the table is empty. */
fm_status fm_cfg_cache_fill(fm_cfg_cache *c, int cap, size_t entry_size, uint64_t gen, fm_cfg_resolve_fn fn,
                            void *ctx);
/* The entry of batch T (1 <= T <= cap), or NULL outside the table. */
static inline const void *fm_cfg_cache_get(const fm_cfg_cache *c, int T) {
    if (!c || !c->slot || T < 1 || T > c->cap) return NULL;
    return c->ent + (size_t)c->slot[T] * c->entry_size;
}
void fm_cfg_cache_free(fm_cfg_cache *c);

/* For the tests, of a CUDA layer: how many config lookups its table has
 * made (engine.cu; the calls themselves make none), and whether two layers
 * hold the same bytes on the device (layer.cu: every matrix, scale, bias
 * and the router; experts_only leaves the router out). 0 when they do,
 * else -1 and the first difference in why. */
long fm_cuda_layer_config_lookups(const fm_cuda_layer *l);
int fm_cuda_layer_bytes_differ(const fm_cuda_layer *a, const fm_cuda_layer *b, int experts_only, char *why,
                               size_t cap);

#ifdef __cplusplus
}
#endif
#endif
