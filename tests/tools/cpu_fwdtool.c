/*
 * Helper of tests/sh_forward.sh.
 *
 *   cpu_fwdtool mkinput OUT T H [DTYPE] [nan|tokens|noname|3d]
 *       writes seeded normal activations as tensor hidden_states [T, H]
 *       (DTYPE F32 | BF16 | F16, default F32); "nan" puts a NaN at token
 *       T-1, feature 1; "tokens" adds I32 token_ids [T] = 1, 2, ...;
 *       "noname" names the tensor "x"; "3d" writes shape [1, T, H].
 *   cpu_fwdtool check MODEL LAYER IN OUT
 *       recomputes the layer on IN with the float64 reference and checks
 *       OUT: hidden_states [T, H] F32 within relative error 1e-5 per token,
 *       topk_ids I32 [T, k] and topk_weights F32 [T, k] identical.
 *       Prints "ok" or what differs; exit 0 / 1.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fp4moe.h"
#include "util/util.h"

static int fail(const char *what) {
    fprintf(stderr, "cpu_fwdtool: %s: %s\n", what, fm_last_error());
    return 1;
}

static int mkinput(int argc, char **argv) {
    if (argc < 5) return fprintf(stderr, "usage: cpu_fwdtool mkinput OUT T H [DTYPE] [nan|tokens|noname|3d]\n"), 2;
    const char *out = argv[2];
    int T = atoi(argv[3]), H = atoi(argv[4]);
    fm_dtype dt = argc > 5 ? fm_dtype_from_name(argv[5]) : FM_DT_F32;
    const char *opt = argc > 6 ? argv[6] : "";
    if (T < 1 || H < 1 || (dt != FM_DT_F32 && dt != FM_DT_BF16 && dt != FM_DT_F16)) return fprintf(stderr, "bad args\n"), 2;
    size_t n = (size_t)T * (size_t)H, esz = dt == FM_DT_F32 ? 4 : 2;
    uint8_t *x = malloc(n * esz);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)T);
    if (!x || !tok) return 1;
    for (size_t i = 0; i < n; i++) {
        float v = fm_rng_normal(12345, 1, i);
        if (!strcmp(opt, "nan") && i == (size_t)(T - 1) * (size_t)H + 1) v = NAN;
        if (dt == FM_DT_F32) memcpy(x + 4 * i, &v, 4);
        else {
            uint16_t h = dt == FM_DT_BF16 ? fm_f32_to_bf16(v) : fm_f32_to_f16(v);
            memcpy(x + 2 * i, &h, 2);
        }
    }
    for (int t = 0; t < T; t++) tok[t] = t + 1;
    fm_st_writer *w = NULL;
    int64_t sh3[3] = {1, T, H}, tsh[1] = {T};
    int three = !strcmp(opt, "3d");
    fm_status st = fm_st_writer_new(out, &w);
    if (!st) st = fm_st_writer_declare(w, !strcmp(opt, "noname") ? "x" : "hidden_states", dt, three ? 3 : 2, three ? sh3 : sh3 + 1);
    if (!st && !strcmp(opt, "tokens")) st = fm_st_writer_declare(w, "token_ids", FM_DT_I32, 1, tsh);
    if (!st) st = fm_st_writer_write(w, x, n * esz);
    if (!st && !strcmp(opt, "tokens")) st = fm_st_writer_write(w, tok, sizeof(int32_t) * (size_t)T);
    if (st) { fm_st_writer_abort(w); free(x); free(tok); return fail(out); }
    free(x);
    free(tok);
    return fm_st_writer_finish(w) ? fail(out) : 0;
}

static const fm_st_tensor *need(fm_st_file *f, const char *name, fm_dtype dt, int64_t d0, int64_t d1) {
    const fm_st_tensor *t = fm_st_find(f, name);
    if (!t || t->dtype != dt || t->ndim != 2 || t->shape[0] != d0 || t->shape[1] != d1) {
        printf("%s: missing or not %s [%lld, %lld]\n", name, fm_dtype_name(dt), (long long)d0, (long long)d1);
        return NULL;
    }
    return t;
}

static int check(int argc, char **argv) {
    if (argc < 6) return fprintf(stderr, "usage: cpu_fwdtool check MODEL LAYER IN OUT\n"), 2;
    const char *dir = argv[2], *in_path = argv[4], *out_path = argv[5];
    int layer = atoi(argv[3]);
    fm_model_desc d;
    fm_ckpt *ck = NULL;
    fm_moe_layer *l = NULL;
    fm_st_file *in = NULL, *out = NULL;
    if (fm_model_desc_load(dir, &d) || fm_ckpt_open(dir, &ck) || fm_moe_layer_bind(ck, &d, layer, FM_QF_NONE, &l))
        return fail(dir);
    if (fm_st_open(in_path, &in)) return fail(in_path);
    if (fm_st_open(out_path, &out)) return fail(out_path);
    const fm_st_tensor *x = fm_st_find(in, "hidden_states"), *ti = fm_st_find(in, "token_ids");
    if (!x || x->ndim != 2) return printf("input has no 2-D hidden_states\n"), 1;
    const int T = (int)x->shape[0], k = d.topk;
    const int64_t H = d.hidden;
    int32_t *tok = NULL;
    if (ti) {
        tok = malloc(sizeof(int32_t) * (size_t)T);
        memcpy(tok, ti->data, sizeof(int32_t) * (size_t)T);
    }
    float *ref = malloc(sizeof(float) * (size_t)(T * H)), *wr = malloc(sizeof(float) * (size_t)(T * k));
    float *o = malloc(sizeof(float) * (size_t)(T * H)), *wo = malloc(sizeof(float) * (size_t)(T * k));
    int32_t *ir = malloc(sizeof(int32_t) * (size_t)(T * k)), *io = malloc(sizeof(int32_t) * (size_t)(T * k));
    fm_moe_out mo = {ref, ir, wr};
    if (fm_moe_forward_ref(&d, l, x->data, x->dtype, T, tok, &mo)) return fail("reference");
    const fm_st_tensor *th = need(out, "hidden_states", FM_DT_F32, T, H), *tid = need(out, "topk_ids", FM_DT_I32, T, k),
                       *tw = need(out, "topk_weights", FM_DT_F32, T, k);
    int bad = !th || !tid || !tw;
    if (!bad) {
        memcpy(o, th->data, sizeof(float) * (size_t)(T * H));
        memcpy(io, tid->data, sizeof(int32_t) * (size_t)(T * k));
        memcpy(wo, tw->data, sizeof(float) * (size_t)(T * k));
        if (memcmp(io, ir, sizeof(int32_t) * (size_t)(T * k))) { printf("topk_ids differ\n"); bad = 1; }
        if (memcmp(wo, wr, sizeof(float) * (size_t)(T * k))) { printf("topk_weights differ\n"); bad = 1; }
        for (int t = 0; t < T; t++) {
            double md = 0, mr = 0;
            for (int64_t c = 0; c < H; c++) {
                md = fmax(md, fabs((double)o[t * H + c] - ref[t * H + c]));
                mr = fmax(mr, fabs((double)ref[t * H + c]));
            }
            if (!(md <= 1e-5 * mr)) { printf("token %d: relative error %.3g\n", t, md / mr); bad = 1; }
        }
    }
    if (!bad) printf("ok\n");
    free(tok); free(ref); free(wr); free(o); free(wo); free(ir); free(io);
    fm_st_close(in);
    fm_st_close(out);
    fm_moe_layer_free(l);
    fm_ckpt_close(ck);
    return bad;
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "mkinput")) return mkinput(argc, argv);
    if (argc > 1 && !strcmp(argv[1], "check")) return check(argc, argv);
    fprintf(stderr, "usage: cpu_fwdtool mkinput|check ...\n");
    return 2;
}
