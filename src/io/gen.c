/*
 * `fp4moe gen`: writes a seeded random checkpoint of a model description.
 *
 * The tensors and their names come from the same plan that binding checks
 * (fm_io_layer_plan), and their bytes from the formulas of model_random.c, so a
 * generated checkpoint binds to exactly the weights of fm_moe_layer_random.
 * Tensors are produced in chunks straight into the streaming safetensors
 * writer: memory does not grow with the model. The whole directory is built
 * under a temporary sibling name and renamed at the end.
 */
#include "io/io_internal.h"
#include "util/util.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define GEN_CHUNK (8u << 20)
#define GEN_DEFAULT_SHARD (2000000000ull)

typedef struct {
    fm_st_writer *w;
    uint8_t *buf;
    size_t n;
    fm_status s;
    uint64_t done, total;
    int progress;
    uint64_t t0, t_last;
} emitter;

static void flush(emitter *em) {
    if (em->s == FM_OK && em->n) em->s = fm_st_writer_write(em->w, em->buf, em->n);
    em->done += em->n;
    em->n = 0;
    if (em->progress) {
        uint64_t now = fm_now_ns();
        if (now - em->t_last > 1000000000ull) {
            em->t_last = now;
            double sec = (double)(now - em->t0) * 1e-9;
            fprintf(stderr, "gen: %.2f of %.2f GB written (%.0f%%), %.0f MB/s\n", em->done * 1e-9, em->total * 1e-9,
                    100.0 * (double)em->done / (double)(em->total ? em->total : 1), em->done * 1e-6 / (sec > 0 ? sec : 1));
        }
    }
}

/* Space for n (<= GEN_CHUNK) more bytes. */
static uint8_t *reserve(emitter *em, size_t n) {
    if (em->n + n > GEN_CHUNK) flush(em);
    uint8_t *p = em->buf + em->n;
    em->n += n;
    return p;
}

static void put_u16(emitter *em, uint16_t v) {
    uint8_t *p = reserve(em, 2);
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static void put_f32(emitter *em, float f) {
    uint8_t *p = reserve(em, 4);
    memcpy(p, &f, 4); /* safetensors is little-endian, as is every host we build for */
}

/* Rows [0, R) of one logical matrix part (packed or scales), chunked. */
static void emit_matrix(emitter *em, uint64_t seed, int layer, int e, int m, fm_qformat f, int64_t R, int64_t K, int scales) {
    int blk = f == FM_QF_NVFP4 ? 16 : 32;
    int64_t rowb = scales ? K / blk : (f == FM_QF_BF16 ? 2 * K : K / 2);
    int64_t per = (int64_t)GEN_CHUNK / rowb;
    if (per < 1) per = 1;
    for (int64_t r = 0; r < R && em->s == FM_OK; r += per) {
        int64_t nr = R - r < per ? R - r : per;
        uint8_t *p = reserve(em, (size_t)(nr * rowb));
        fm_gen_matrix_rows(seed, layer, e, m, f, K, r, nr, scales ? NULL : p, scales ? p : NULL);
    }
}

static void emit_tensor(emitter *em, const fm_model_desc *d, int layer, uint64_t seed, const fm_io_tspec *t) {
    fm_qformat f = d->expert_format;
    int64_t E = d->n_experts, H = d->hidden;
    switch (t->role) {
    case FM_T_PACKED: emit_matrix(em, seed, layer, t->e, t->m, f, t->R, t->K, 0); break;
    case FM_T_SCALES: emit_matrix(em, seed, layer, t->e, t->m, f, t->R, t->K, 1); break;
    case FM_T_SCALE2: put_f32(em, fm_gen_nvfp4_scale2(t->K)); break;
    case FM_T_INSCALE: put_f32(em, 1.0f / 672.0f); break;
    case FM_T_EBIAS:
        for (int64_t r = 0; r < t->R; r++) put_u16(em, fm_io_gen_expert_bias(seed, layer, t->e, t->m, r));
        break;
    case FM_T_ROUTER_W:
        for (int64_t i = 0; i < E * H && em->s == FM_OK; i++) put_u16(em, fm_io_gen_router_w(seed, layer, (int)H, i));
        break;
    case FM_T_SCORE_BIAS:
        for (int e = 0; e < E; e++) put_f32(em, fm_io_gen_score_bias(seed, layer, e));
        break;
    case FM_T_ROUTER_BIAS:
        for (int e = 0; e < E; e++) put_u16(em, fm_io_gen_router_bias(seed, layer, e));
        break;
    case FM_T_TID2EID: {
        int32_t row[64];
        int k = d->topk;
        for (int64_t v = 0; v < d->vocab_size && em->s == FM_OK; v++) {
            fm_io_gen_tid2eid_row(seed, layer, (int)E, k, v, row);
            uint8_t *p = reserve(em, (size_t)(8 * k));
            for (int j = 0; j < k; j++) {
                int64_t x = row[j];
                memcpy(p + 8 * j, &x, 8);
            }
        }
        break;
    }
    case FM_T_FUSED_PACKED:
    case FM_T_FUSED_SCALES: {
        int sc = t->role == FM_T_FUSED_SCALES;
        for (int e = 0; e < E && em->s == FM_OK; e++) {
            if (t->m == 0) {
                /* interleave: fused row 2i = gate row i, 2i+1 = up row i */
                int64_t rowb = sc ? t->K / 32 : t->K / 2;
                for (int64_t j = 0; j < t->R && em->s == FM_OK; j++) {
                    uint8_t *p = reserve(em, (size_t)rowb);
                    fm_gen_matrix_rows(seed, layer, e, (int)(j & 1), FM_QF_MXFP4, t->K, j / 2, 1, sc ? NULL : p, sc ? p : NULL);
                }
            } else {
                emit_matrix(em, seed, layer, e, 2, FM_QF_MXFP4, t->R, t->K, sc);
            }
        }
        break;
    }
    case FM_T_FUSED_BIAS:
        for (int e = 0; e < E; e++) {
            if (t->m == 0)
                for (int64_t j = 0; j < t->R; j++) put_u16(em, fm_io_gen_expert_bias(seed, layer, e, (int)(j & 1), j / 2));
            else
                for (int64_t r = 0; r < t->R; r++) put_u16(em, fm_io_gen_expert_bias(seed, layer, e, 2, r));
        }
        break;
    }
}

/* ------------------------------------------------------------ directory */

typedef struct {
    fm_io_tspec t;
    int layer;
    int shard;
} gen_entry;

static void remove_tree(const char *dir, char **files, size_t n) {
    char p[4096];
    for (size_t i = 0; i < n; i++)
        if (fm_path_join(p, sizeof p, dir, files[i]) == FM_OK) unlink(p);
    rmdir(dir);
}

fm_status fm_gen_checkpoint(const fm_model_desc *d, const fm_gen_opts *o, const char *out_dir) {
    if (!d || !o || !out_dir || !*out_dir) return fm_error(FM_E_ARG, "fm_gen_checkpoint: NULL argument");
    fm_status s = fm_model_desc_validate(d);
    if (s != FM_OK) return s;
    int n_moe = 0;
    for (int l = 0; l < d->n_layers; l++) n_moe += fm_model_is_moe_layer(d, l);
    if (o->n_moe_layers < 1 || o->n_moe_layers > n_moe)
        return fm_error(FM_E_RANGE, "--layers %d: the model has %d MoE layers", o->n_moe_layers, n_moe);
    /* "out/" would put the temporary directory inside the output */
    char outp[4096];
    size_t ol = strlen(out_dir);
    if (ol >= sizeof outp) return fm_error(FM_E_ARG, "path too long: %s", out_dir);
    memcpy(outp, out_dir, ol + 1);
    while (ol > 1 && outp[ol - 1] == '/') outp[--ol] = 0;
    out_dir = outp;
    struct stat sb;
    if (stat(out_dir, &sb) == 0) return fm_error(FM_E_IO, "%s: already exists (gen never overwrites; remove it first)", out_dir);
    uint64_t shard_max = o->shard_bytes ? o->shard_bytes : GEN_DEFAULT_SHARD;

    /* 1. every tensor of the chosen layers, then shards */
    gen_entry *ents = NULL;
    size_t ne = 0, cap = 0;
    uint64_t total = 0;
    int done_layers = 0;
    for (int l = 0; l < d->n_layers && done_layers < o->n_moe_layers && s == FM_OK; l++) {
        if (!fm_model_is_moe_layer(d, l)) continue;
        done_layers++;
        fm_io_tspec *plan;
        size_t np;
        s = fm_io_layer_plan(d, l, &plan, &np);
        if (s != FM_OK) break;
        if (ne + np > cap) {
            size_t nc = (ne + np) * 2;
            gen_entry *nv = realloc(ents, nc * sizeof *nv);
            if (!nv) { free(plan); s = fm_error(FM_E_NOMEM, "out of memory"); break; }
            ents = nv;
            cap = nc;
        }
        for (size_t i = 0; i < np; i++) {
            ents[ne].t = plan[i];
            ents[ne].layer = l;
            total += fm_io_tspec_bytes(&plan[i]);
            ne++;
        }
        free(plan);
    }
    if (s != FM_OK) { free(ents); return s; }
    int n_shards = 1;
    uint64_t cur = 0;
    for (size_t i = 0; i < ne; i++) {
        uint64_t b = fm_io_tspec_bytes(&ents[i].t);
        if (cur > 0 && cur + b > shard_max) { n_shards++; cur = 0; }
        cur += b;
        ents[i].shard = n_shards - 1;
    }
    if (n_shards > 99999) { free(ents); return fm_error(FM_E_RANGE, "%d shards (raise --shard-size)", n_shards); }

    /* 2. the temporary directory and its files */
    char tmp[4096], path[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%d", out_dir, (int)getpid()) >= (int)sizeof tmp) {
        free(ents);
        return fm_error(FM_E_ARG, "path too long: %s", out_dir);
    }
    if (mkdir(tmp, 0755) != 0) {
        free(ents);
        return fm_error(FM_E_IO, "%s: cannot create: %s", tmp, strerror(errno));
    }
    char **files = calloc((size_t)n_shards + 4, sizeof *files);
    size_t nfiles = 0;
    char *cfg = NULL, *hq = NULL;
    json_t *index = NULL;
    char (*names)[48] = NULL;
    emitter em = {0};
    em.buf = fm_malloc(GEN_CHUNK);
    if (!files || !em.buf) { s = FM_E_NOMEM; goto fail; }
    em.total = total;
    em.progress = o->progress;
    em.t0 = em.t_last = fm_now_ns();

    s = fm_model_desc_to_json(d, &cfg, &hq);
    if (s != FM_OK) goto fail;
    files[nfiles++] = "config.json";
    if ((s = fm_path_join(path, sizeof path, tmp, "config.json")) != FM_OK) goto fail;
    if ((s = fm_write_file_atomic(path, cfg, strlen(cfg))) != FM_OK) goto fail;
    if (hq) {
        files[nfiles++] = "hf_quant_config.json";
        if ((s = fm_path_join(path, sizeof path, tmp, "hf_quant_config.json")) != FM_OK) goto fail;
        if ((s = fm_write_file_atomic(path, hq, strlen(hq))) != FM_OK) goto fail;
    }

    index = json_object();
    json_t *wmap = json_object();
    names = calloc((size_t)n_shards, sizeof *names);
    if (!names) { json_decref(wmap); s = FM_E_NOMEM; goto fail; }
    size_t i0 = 0;
    for (int sh = 0; sh < n_shards && s == FM_OK; sh++) {
        snprintf(names[sh], sizeof names[sh], "model-%05d-of-%05d.safetensors", sh + 1, n_shards);
        files[nfiles++] = names[sh];
        size_t i1 = i0;
        while (i1 < ne && ents[i1].shard == sh) i1++;
        if ((s = fm_path_join(path, sizeof path, tmp, names[sh])) != FM_OK) break;
        fm_st_writer *w = NULL;
        if ((s = fm_st_writer_new(path, &w)) != FM_OK) break;
        s = fm_st_writer_meta(w, "format", "pt");
        for (size_t i = i0; i < i1 && s == FM_OK; i++) {
            const fm_io_tspec *t = &ents[i].t;
            s = fm_st_writer_declare(w, t->name, t->dt, t->ndim, t->shape);
            json_object_set_new(wmap, t->name, json_string(names[sh]));
        }
        em.w = w;
        em.s = s;
        for (size_t i = i0; i < i1 && em.s == FM_OK; i++) emit_tensor(&em, d, ents[i].layer, o->seed, &ents[i].t);
        flush(&em);
        s = em.s;
        if (s == FM_OK) s = fm_st_writer_finish(w);
        else fm_st_writer_abort(w);
        i0 = i1;
    }
    if (s != FM_OK) { json_decref(wmap); goto fail; }
    json_t *meta = json_object();
    json_object_set_new(meta, "total_size", json_integer((json_int_t)total));
    json_object_set_new(index, "metadata", meta);
    json_object_set_new(index, "weight_map", wmap);
    char *idx = json_dumps(index, JSON_INDENT(2) | JSON_SORT_KEYS);
    files[nfiles++] = "model.safetensors.index.json";
    if (!idx) s = fm_error(FM_E_NOMEM, "out of memory writing the index");
    else if ((s = fm_path_join(path, sizeof path, tmp, "model.safetensors.index.json")) == FM_OK)
        s = fm_write_file_atomic(path, idx, strlen(idx));
    free(idx);
    if (s == FM_OK && rename(tmp, out_dir) != 0) s = fm_error(FM_E_IO, "%s: cannot rename %s: %s", out_dir, tmp, strerror(errno));
    if (s != FM_OK) goto fail;
    if (o->progress)
        fprintf(stderr, "gen: wrote %s: %d MoE layer(s), %zu tensors, %.3f GB in %d shard(s), %.1f s\n", out_dir,
                o->n_moe_layers, ne, total * 1e-9, n_shards, (double)(fm_now_ns() - em.t0) * 1e-9);
    free(names);
    free(files);
    free(ents);
    free(em.buf);
    free(cfg);
    free(hq);
    json_decref(index);
    return FM_OK;
fail: {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", fm_last_error());
    if (files) remove_tree(tmp, files, nfiles);
    else rmdir(tmp);
    free(names);
    free(files);
    free(ents);
    free(em.buf);
    free(cfg);
    free(hq);
    if (index) json_decref(index);
    return fm_error(s, "%s", msg);
}
}
