/* `fp4moe forward`: one MoE layer of a checkpoint on hidden states from a
 * safetensors file, so users can compare fp4moe with their own framework.
 * Every input is checked before any work; the output file is written only
 * after the computation succeeded, through the atomic writer. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "route/route.h"
#include "util/util.h"

#define MAX_TOKENS (1 << 20)

static fm_status write_output(const char *path, int T, int64_t H, int k, const float *out, const int32_t *ids,
                              const float *w) {
    fm_st_writer *wr = NULL;
    fm_status st = fm_st_writer_new(path, &wr);
    if (st) return st;
    const int64_t sh[2] = {T, H}, sk[2] = {T, k};
    st = fm_st_writer_declare(wr, "hidden_states", FM_DT_F32, 2, sh);
    if (!st) st = fm_st_writer_declare(wr, "topk_ids", FM_DT_I32, 2, sk);
    if (!st) st = fm_st_writer_declare(wr, "topk_weights", FM_DT_F32, 2, sk);
    if (!st) st = fm_st_writer_write(wr, out, sizeof(float) * (size_t)T * (size_t)H);
    if (!st) st = fm_st_writer_write(wr, ids, sizeof(int32_t) * (size_t)T * (size_t)k);
    if (!st) st = fm_st_writer_write(wr, w, sizeof(float) * (size_t)T * (size_t)k);
    if (st) {
        fm_st_writer_abort(wr);
        return st;
    }
    return fm_st_writer_finish(wr);
}

/* One device's part: the engine, the MoE block, the engine's description
 * for the summary line (and, on a GPU, the config's provenance). */
static fm_status forward_cpu(const fm_forward_file_opts *o, const fm_model_desc *d, const fm_moe_layer *l,
                             const void *x, fm_dtype xdt, int T, const int32_t *tok, fm_moe_out *mo, char *engine,
                             size_t cap) {
    fm_cpu_engine *ce = NULL;
    fm_status st = fm_cpu_engine_new(o->isa, o->n_threads, &ce);
    if (!st) st = fm_cpu_forward(ce, d, l, x, xdt, T, tok, mo);
    if (!st) snprintf(engine, cap, "%s", fm_cpu_engine_describe(ce));
    fm_cpu_engine_free(ce);
    return st;
}

static fm_status forward_cuda(const fm_model_desc *d, const fm_moe_layer *l, const void *x, fm_dtype xdt, int T,
                              const int32_t *tok, fm_moe_out *mo, char *engine, size_t cap, char *prov,
                              size_t prov_cap) {
    fm_cuda_engine *ge = NULL;
    fm_cuda_layer *gl = NULL;
    fm_status st = fm_cuda_engine_new(0, &ge);
    if (!st) {
        /* Provenance: the kernel config this batch will run with, and
         * from which tuned file (or the WARNING that none matched). */
        fm_tune_key key;
        fm_tune_choice ch;
        st = fm_cuda_engine_key(ge, d, l->fmt, &key);
        if (!st) st = fm_tune_choose(&key, T, &ch);
        if (!st) fm_tune_provenance_line(&key, T, &ch, prov, prov_cap);
    }
    if (!st) st = fm_cuda_layer_upload(ge, d, l, &gl);
    if (!st) st = fm_cuda_forward(ge, d, gl, x, xdt, T, tok, mo);
    if (!st) snprintf(engine, cap, "%s", fm_cuda_engine_describe(ge));
    if (gl) fm_cuda_layer_free(gl);
    if (ge) fm_cuda_engine_free(ge);
    return st;
}

static fm_status forward_sharded(const fm_forward_file_opts *o, const fm_model_desc *d, const fm_moe_layer *l,
                                 const void *x, fm_dtype xdt, int T, const int32_t *tok, fm_moe_out *mo, char *engine,
                                 size_t cap) {
    fm_cpu_engine *ce = NULL;
    fm_status st = o->device == FM_DEV_CPU ? fm_cpu_engine_new(o->isa, o->n_threads, &ce) : FM_OK;
    if (!st) st = fm_dist_run(o->dist, o->device, o->dist_mpi, ce, d, l, x, xdt, T, tok, mo, NULL);
    if (!st) snprintf(engine, cap, "sharded (src/parallel)");
    fm_cpu_engine_free(ce);
    return st;
}

fm_status fm_forward_file(const fm_forward_file_opts *o, char *info, size_t cap) {
    if (!o || !o->model_dir || !o->input || !o->output)
        return fm_error(FM_E_ARG, "forward: model directory, input and output are required");
    fm_model_desc d;
    fm_status st = fm_model_desc_load(o->model_dir, &d);
    if (st) return st;
    if (o->layer < 0 || o->layer >= d.n_layers)
        return fm_error(FM_E_RANGE, "layer %d: the model in %s has layers 0..%d", o->layer, o->model_dir,
                        d.n_layers - 1);
    if (!fm_model_is_moe_layer(&d, o->layer))
        return fm_error(FM_E_ARG, "layer %d of %s is not an MoE layer (first_k_dense_replace=%d, moe_layer_freq=%d)",
                        o->layer, o->model_dir, d.first_dense, d.moe_layer_freq);

    fm_st_file *in = NULL;
    fm_ckpt *ck = NULL;
    fm_moe_layer *l = NULL;
    float *out = NULL, *w = NULL;
    int32_t *ids = NULL, *tok = NULL;
    st = fm_st_open(o->input, &in);
    if (st) goto done;
    const fm_st_tensor *hs = fm_st_find(in, "hidden_states");
    if (!hs) {
        st = fm_error(FM_E_NOTFOUND, "%s: no tensor 'hidden_states' (expected [T, %d] F32, BF16 or F16)", o->input,
                      d.hidden);
        goto done;
    }
    if (hs->dtype != FM_DT_F32 && hs->dtype != FM_DT_BF16 && hs->dtype != FM_DT_F16) {
        st = fm_error(FM_E_FORMAT, "%s: hidden_states is %s; expected F32, BF16 or F16", o->input,
                      fm_dtype_name(hs->dtype));
        goto done;
    }
    if (hs->ndim != 2 || hs->shape[1] != d.hidden || hs->shape[0] < 1 || hs->shape[0] > MAX_TOKENS) {
        char shape[96] = "";
        size_t n = 0;
        for (int i = 0; i < hs->ndim && n < sizeof shape - 24; i++)
            n += (size_t)snprintf(shape + n, sizeof shape - n, "%s%lld", i ? ", " : "", (long long)hs->shape[i]);
        st = fm_error(FM_E_FORMAT, "%s: hidden_states is [%s]; expected [T, %d] with 1 <= T <= %d (hidden size of %s)",
                      o->input, shape, d.hidden, MAX_TOKENS, o->model_dir);
        goto done;
    }
    const int T = (int)hs->shape[0];
    const int64_t H = d.hidden;
    const int k = d.topk;
    const fm_st_tensor *ti = fm_st_find(in, "token_ids");
    if (ti) {
        if (ti->dtype != FM_DT_I32 || ti->ndim != 1 || ti->shape[0] != T) {
            st = fm_error(FM_E_FORMAT, "%s: token_ids must be I32 [%d] (one per row of hidden_states)", o->input, T);
            goto done;
        }
        tok = fm_malloc(sizeof(int32_t) * (size_t)T);
        if (!tok) { st = FM_E_NOMEM; goto done; }
        memcpy(tok, ti->data, sizeof(int32_t) * (size_t)T); /* the mapping may be unaligned */
    }

    st = fm_ckpt_open(o->model_dir, &ck);
    if (!st) st = fm_moe_layer_bind(ck, &d, o->layer, FM_QF_NONE, &l);
    if (st) goto done;
    if (fm_route_is_hash_layer(&d, l) && !tok) {
        st = fm_error(FM_E_ARG, "layer %d routes by token id (tid2eid): add an I32 tensor 'token_ids' [%d] to %s",
                      o->layer, T, o->input);
        goto done;
    }
    out = fm_malloc(sizeof(float) * (size_t)T * (size_t)H);
    ids = fm_malloc(sizeof(int32_t) * (size_t)T * (size_t)k);
    w = fm_malloc(sizeof(float) * (size_t)T * (size_t)k);
    if (!out || !ids || !w) { st = FM_E_NOMEM; goto done; }
    fm_moe_out mo = {out, ids, w};
    char engine[640] = "", prov[1536] = "";
    if (o->dist)
        st = forward_sharded(o, &d, l, hs->data, hs->dtype, T, tok, &mo, engine, sizeof engine);
    else if (o->device == FM_DEV_CUDA)
        st = forward_cuda(&d, l, hs->data, hs->dtype, T, tok, &mo, engine, sizeof engine, prov, sizeof prov);
    else
        st = forward_cpu(o, &d, l, hs->data, hs->dtype, T, tok, &mo, engine, sizeof engine);
    if (st) goto done;
    st = write_output(o->output, T, H, k, out, ids, w);
    if (!st && info)
        snprintf(info, cap, "%s%swrote %s: hidden_states [%d, %lld] F32, topk_ids/topk_weights [%d, %d]; layer %d of %s (%s, %s); %s",
                 prov, prov[0] ? "\n" : "", o->output, T, (long long)H, T, k, o->layer, o->model_dir, d.family, fm_qformat_name(l->fmt), engine);
done:
    fm_moe_layer_free(l);
    fm_ckpt_close(ck);
    fm_st_close(in);
    free(out);
    free(ids);
    free(w);
    free(tok);
    return st;
}
