/* Small internal helpers shared by every module (not public API). */
#ifndef FM_UTIL_H
#define FM_UTIL_H
#include "fp4moe.h"
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

/* Checked arithmetic: return false on overflow. */
static inline bool fm_mul_ok(uint64_t a, uint64_t b, uint64_t *r) { return !__builtin_mul_overflow(a, b, r); }
static inline bool fm_add_ok(uint64_t a, uint64_t b, uint64_t *r) { return !__builtin_add_overflow(a, b, r); }

/* Counter-based RNG (SplitMix64): value i of stream `key` is a pure function
 * of (seed, key, i), so weights can be generated in any order, in chunks,
 * on the CPU or the GPU, and always come out the same. */
static inline uint64_t fm_mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static inline uint64_t fm_rng_u64(uint64_t seed, uint64_t key, uint64_t i) {
    return fm_mix64(fm_mix64(seed ^ fm_mix64(key)) + i);
}
/* Uniform in [-1, 1). */
static inline float fm_rng_uniform(uint64_t seed, uint64_t key, uint64_t i) {
    return (float)((double)(fm_rng_u64(seed, key, i) >> 11) * (1.0 / 9007199254740992.0) * 2.0 - 1.0);
}
/* Approximately standard normal (sum of 4 uniforms, scaled). */
static inline float fm_rng_normal(uint64_t seed, uint64_t key, uint64_t i) {
    uint64_t a = fm_rng_u64(seed, key, 2 * i), b = fm_rng_u64(seed, key, 2 * i + 1);
    double s = (double)(a & 0xFFFFFFFFu) + (double)(a >> 32) + (double)(b & 0xFFFFFFFFu) + (double)(b >> 32);
    return (float)((s / 4294967296.0 - 2.0) * 1.7320508075688772); /* var(sum of 4 U[0,1)) = 1/3 */
}
/* Stable 64-bit hash of a string (FNV-1a), for RNG stream keys from names. */
static inline uint64_t fm_hash_str(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) { h ^= (unsigned char)*s; h *= 1099511628211ull; }
    return h;
}

void *fm_malloc(size_t n);            /* sets FM_E_NOMEM message on failure */
void *fm_calloc(size_t n, size_t sz);
void *fm_aligned_alloc(size_t align, size_t n); /* free with free()        */
char *fm_strdup(const char *s);

/* Reads a whole (small) file; *out is NUL-terminated. Refuses > max_bytes. */
fm_status fm_read_file(const char *path, size_t max_bytes, char **out, size_t *len);
/* Writes a file atomically (temp + rename); no partial file on failure. */
fm_status fm_write_file_atomic(const char *path, const void *data, size_t len);
/* Joins a directory and a name into buf. */
fm_status fm_path_join(char *buf, size_t cap, const char *dir, const char *name);

#endif
