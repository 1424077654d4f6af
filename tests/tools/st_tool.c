/*
 * safetensors through the library, for tests/py_safetensors_interop.py.
 *
 *   st_tool dump FILE [KEY...]
 *       "count N" and "meta_count M", then "meta<TAB>KEY<TAB>VALUE" for each
 *       KEY asked for ("<absent>" when missing), then for every tensor in
 *       offset order "tensor<TAB>NAME<TAB>DTYPE<TAB>D0,D1,...<TAB>BEGIN<TAB>
 *       END<TAB>HEX-OF-DATA". Errors: "error: <status>: <message>", exit 1.
 *   st_tool write FILE
 *       writes the fixed tensor set below with the streaming writer, in
 *       5-byte chunks that straddle tensors. Byte i of tensor t is
 *       (31 i + 17 t + 5) mod 256 (BOOL: (i + t) mod 2).
 */
#include "fp4moe.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(void) {
    fprintf(stderr, "error: %s: %s\n", "st_tool", fm_last_error());
    return 1;
}

static int dump(const char *path, int nkeys, char **keys) {
    fm_st_file *f;
    fm_status st = fm_st_open(path, &f);
    if (st != FM_OK) {
        fprintf(stderr, "error: %s: %s\n", fm_status_name(st), fm_last_error());
        return 1;
    }
    printf("count %zu\nmeta_count %zu\n", fm_st_count(f), fm_st_metadata_count(f));
    for (int k = 0; k < nkeys; k++) {
        const char *v = fm_st_metadata(f, keys[k]);
        printf("meta\t%s\t%s\n", keys[k], v ? v : "<absent>");
    }
    for (size_t i = 0; i < fm_st_count(f); i++) {
        const fm_st_tensor *t = fm_st_at(f, i);
        printf("tensor\t%s\t%s\t", t->name, fm_dtype_name(t->dtype));
        for (int d = 0; d < t->ndim; d++) printf("%s%lld", d ? "," : "", (long long)t->shape[d]);
        printf("\t%llu\t%llu\t", (unsigned long long)t->begin, (unsigned long long)t->end);
        const unsigned char *p = t->data;
        for (uint64_t b = 0; b < t->end - t->begin; b++) printf("%02x", p[b]);
        printf("\n");
    }
    fm_st_close(f);
    return 0;
}

static const struct {
    const char *name;
    fm_dtype dt;
    int ndim;
    int64_t shape[3];
} k_set[] = {
    {"f32", FM_DT_F32, 2, {3, 4}},
    {"bf16", FM_DT_BF16, 2, {2, 3}},
    {"f16", FM_DT_F16, 1, {5}},
    {"f64", FM_DT_F64, 1, {2}},
    {"i64", FM_DT_I64, 2, {2, 2}},
    {"u8", FM_DT_U8, 1, {7}},
    {"i8", FM_DT_I8, 1, {3}},
    {"bool", FM_DT_BOOL, 1, {4}},
    {"i16", FM_DT_I16, 1, {3}},
    {"u16", FM_DT_U16, 1, {3}},
    {"i32", FM_DT_I32, 1, {2}},
    {"u32", FM_DT_U32, 1, {2}},
    {"u64", FM_DT_U64, 1, {2}},
    {"e4m3", FM_DT_F8_E4M3, 2, {4, 2}},
    {"e5m2", FM_DT_F8_E5M2, 1, {3}},
    {"e8m0", FM_DT_F8_E8M0, 2, {2, 2}},
    {"f4", FM_DT_F4, 2, {2, 6}},
    {"scalar", FM_DT_F32, 0, {0}},
    {"zero", FM_DT_F32, 2, {0, 3}},
    {"model.layers.0.mlp.experts.1.gate_proj.weight", FM_DT_U8, 2, {4, 8}},
};

static int write_set(const char *path) {
    fm_st_writer *w;
    if (fm_st_writer_new(path, &w) != FM_OK) return fail();
    const char *meta[][2] = {{"format", "pt"}, {"producer", "fp4moe st_tool"},
                             {"unicode", "h\xc3\xa9llo \xe2\x9c\x93"}, {"empty", ""}};
    for (size_t i = 0; i < sizeof meta / sizeof meta[0]; i++)
        if (fm_st_writer_meta(w, meta[i][0], meta[i][1]) != FM_OK) goto bad;
    size_t nt = sizeof k_set / sizeof k_set[0], total = 0;
    for (size_t t = 0; t < nt; t++) {
        if (fm_st_writer_declare(w, k_set[t].name, k_set[t].dt, k_set[t].ndim, k_set[t].shape) != FM_OK)
            goto bad;
        uint64_t n = 1;
        for (int d = 0; d < k_set[t].ndim; d++) n *= (uint64_t)k_set[t].shape[d];
        total += (size_t)(n * (uint64_t)fm_dtype_bits(k_set[t].dt) / 8);
    }
    unsigned char *all = malloc(total ? total : 1);
    if (!all) { fm_st_writer_abort(w); return 1; }
    size_t off = 0;
    for (size_t t = 0; t < nt; t++) {
        uint64_t n = 1;
        for (int d = 0; d < k_set[t].ndim; d++) n *= (uint64_t)k_set[t].shape[d];
        size_t bytes = (size_t)(n * (uint64_t)fm_dtype_bits(k_set[t].dt) / 8);
        for (size_t i = 0; i < bytes; i++)
            all[off + i] = k_set[t].dt == FM_DT_BOOL ? (unsigned char)((i + t) % 2)
                                                     : (unsigned char)((31 * i + 17 * t + 5) & 0xFF);
        off += bytes;
    }
    for (off = 0; off < total; off += 5) {
        size_t n = total - off < 5 ? total - off : 5;
        if (fm_st_writer_write(w, all + off, n) != FM_OK) { free(all); goto bad; }
    }
    free(all);
    if (fm_st_writer_finish(w) != FM_OK) return fail();
    return 0;
bad:
    fm_st_writer_abort(w);
    return fail();
}

int main(int argc, char **argv) {
    if (argc >= 3 && strcmp(argv[1], "dump") == 0) return dump(argv[2], argc - 3, argv + 3);
    if (argc == 3 && strcmp(argv[1], "write") == 0) return write_set(argv[2]);
    fprintf(stderr, "usage: st_tool dump FILE [KEY...] | st_tool write FILE\n");
    return 2;
}
