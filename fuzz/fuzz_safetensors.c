/*
 * libFuzzer target for the safetensors header parser: fm_st_parse on the
 * input as a whole file (data pointers into the input) and as the first
 * bytes of a longer file (header-only), then every accessor over the
 * result. ASan catches any read outside the input.
 */
#include "fp4moe.h"

#include <stdint.h>
#include <string.h>

static unsigned touch(const fm_st_file *f) {
    unsigned acc = 0;
    for (size_t i = 0; i < fm_st_count(f); i++) {
        const fm_st_tensor *t = fm_st_at(f, i);
        acc += (unsigned)strlen(t->name) + (unsigned)t->ndim + (unsigned)t->dtype;
        for (int d = 0; d < t->ndim; d++) acc += (unsigned)t->shape[d];
        if (fm_st_find(f, t->name) != t) __builtin_trap();
        if (t->end < t->begin) __builtin_trap();
        if (t->data && t->end > t->begin) {
            const uint8_t *p = t->data;
            acc += p[0] + p[t->end - t->begin - 1];
        }
    }
    acc += (unsigned)fm_st_metadata_count(f);
    const char *v = fm_st_metadata(f, "format");
    if (v) acc += (unsigned)strlen(v);
    if (fm_st_find(f, "model.layers.0.mlp.experts.0.gate_proj.weight")) acc++;
    return acc;
}

/* Keeps the reads of touch() from being optimized away. */
volatile unsigned fm_fuzz_sink;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    unsigned sink = 0;
    fm_st_file *f = NULL;
    if (fm_st_parse(data, size, size, &f) == FM_OK) {
        sink += touch(f);
        fm_st_close(f);
    }
    f = NULL;
    if (fm_st_parse(data, size, (uint64_t)size + 4096, &f) == FM_OK) {
        sink += touch(f);
        fm_st_close(f);
    }
    fm_fuzz_sink = sink;
    return 0;
}
