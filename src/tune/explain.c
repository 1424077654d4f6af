/* `fp4moe explain`: the whole kernel decision for a model shape, in words.
 *
 * Decode MoE is weight streaming: what matters is how many experts a batch
 * touches (their bytes are the floor) and how many tokens each of them gets
 * (which decides between the weight-streaming small path and tensor-core
 * tiles). So the explanation starts from those two numbers, then shows the
 * paths considered, the built-in default, the config lookup directory by
 * directory, and what would run. It never launches a kernel; with --gpu it
 * plans for a GPU that is not present. */
#include "tune/tune_internal.h"
#include "cuda/route_shape.h"
#include "cuda/schedule.h"
#include "util/util.h"

#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    char *buf;
    size_t len, cap;
    int oom;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static void sb_printf(sbuf *b, const char *fmt, ...) {
    if (b->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        size_t room = b->cap - b->len;
        int n = vsnprintf(b->buf ? b->buf + b->len : NULL, b->buf ? room : 0, fmt, ap);
        va_end(ap);
        if (n < 0) { b->oom = 1; return; }
        if (b->buf && (size_t)n < room) { b->len += (size_t)n; return; }
        size_t nc = (b->cap ? b->cap * 2 : 4096);
        while (nc < b->len + (size_t)n + 1) nc *= 2;
        char *p = realloc(b->buf, nc);
        if (!p) { b->oom = 1; return; }
        b->buf = p;
        b->cap = nc;
    }
}

typedef struct {
    int kind;                /* 0 CPU, 1 GPU                              */
    const fm_gpu_info *info; /* datasheet figures when known              */
    fm_tune_key key;         /* GPU fields (GPU targets)                  */
    char origin[64];         /* "--gpu" or "present"                      */
    char describe[512];
    char no_gpu_why[256];
} target;

static fm_status find_target(const fm_explain_opts *o, target *t) {
    memset(t, 0, sizeof *t);
    if (o->gpu) {
        const fm_gpu_info *g = fm_gpu_lookup(o->gpu);
        if (!g) {
            char known[1024] = "";
            for (size_t i = 0; i < fm_gpu_count(); i++)
                fm_tune_appendf(known, sizeof known, "%s\"%s\"", i ? ", " : "", fm_gpu_at(i)->name);
            return fm_error(FM_E_NOTFOUND, "unknown GPU '%s'; known GPUs: %s", o->gpu, known);
        }
        t->kind = 1;
        t->info = g;
        snprintf(t->key.gpu_name, sizeof t->key.gpu_name, "%s", g->name);
        t->key.sm_count = g->sm_count;
        snprintf(t->origin, sizeof t->origin, "--gpu (not present; datasheet figures)");
        snprintf(t->describe, sizeof t->describe, "%s: %d SMs, %.0f GB/s, %.0f MB L2, sm_%d, %s", g->name, g->sm_count,
                 g->bandwidth_gbs, g->l2_mb, g->cc,
                 g->fp4_tensor_cores ? "FP4 tensor cores (not used yet: FP4 is decoded in registers)"
                                     : "no FP4 tensor cores (FP4 decoded in registers)");
        return FM_OK;
    }
    if (fm_cuda_available(t->no_gpu_why, sizeof t->no_gpu_why)) {
        fm_cuda_engine *e = NULL;
        fm_status s = fm_cuda_engine_new(0, &e);
        if (s == FM_OK) s = fm_cuda_engine_key(e, o->desc, o->fmt, &t->key);
        if (s == FM_OK) {
            t->kind = 1;
            t->info = fm_gpu_lookup(t->key.gpu_name);
            snprintf(t->origin, sizeof t->origin, "present");
            snprintf(t->describe, sizeof t->describe, "%s", fm_cuda_engine_describe(e));
        }
        fm_cuda_engine_free(e);
        if (s == FM_OK) return FM_OK;
        snprintf(t->no_gpu_why, sizeof t->no_gpu_why, "%s", fm_last_error());
    }
    t->kind = 0;
    fm_cpu_isa isa = fm_cpu_isa_detect();
    snprintf(t->describe, sizeof t->describe, "CPU, %s kernels", fm_cpu_isa_name(isa));
    return FM_OK;
}


fm_status fm_explain(const fm_explain_opts *o, char **out) {
    *out = NULL;
    if (o && o->warnings && o->warnings_cap) o->warnings[0] = 0;
    if (!o || !o->desc || !o->batches || o->n_batches < 1) return fm_error(FM_E_ARG, "fm_explain: missing argument");
    for (int i = 0; i < o->n_batches; i++)
        if (o->batches[i] < 1 || o->batches[i] > 1000000)
            return fm_error(FM_E_RANGE, "batch %d is out of range [1, 1000000]", o->batches[i]);
    const fm_model_desc *d = o->desc;
    target t;
    fm_status s = find_target(o, &t);
    if (s) return s;
    if ((s = fm_tune_key_set_shape(&t.key, d, o->fmt))) return s;
    const fm_tune_key *key = &t.key;
    int64_t eb = fm_model_expert_bytes(d, o->fmt);
    char fname[512];
    if ((s = fm_tune_key_filename(key, fname, sizeof fname))) return s;
    const char *label = o->model_label ? o->model_label : d->family;

    sbuf b = {0};
    json_t *root = NULL, *jb = NULL;
    if (o->json) {
        root = json_object();
        jb = json_array();
        if (!root || !jb) { json_decref(root); json_decref(jb); return fm_error(FM_E_NOMEM, "out of memory"); }
        json_object_set_new(root, "model", json_string(label));
        json_object_set_new(root, "family", json_string(d->family));
        json_object_set_new(root, "format", json_string(fm_qformat_name(o->fmt)));
        json_object_set_new(root, "shape", json_pack("{s:i, s:i, s:i, s:i, s:i}", "E", d->n_experts, "H", d->hidden, "I",
                                                     d->moe_inter, "k", d->topk, "shared", d->n_shared));
        json_object_set_new(root, "expert_bytes", json_integer(eb));
        json_t *tj = json_object();
        json_object_set_new(tj, "kind", json_string(t.kind ? "gpu" : "cpu"));
        json_object_set_new(tj, "describe", json_string(t.describe));
        if (t.kind) {
            json_object_set_new(tj, "name", json_string(key->gpu_name));
            json_object_set_new(tj, "sm_count", json_integer(key->sm_count));
            json_object_set_new(tj, "origin", json_string(t.origin));
            if (t.info) {
                json_object_set_new(tj, "bandwidth_gbs", json_real(t.info->bandwidth_gbs));
                json_object_set_new(tj, "l2_mb", json_real(t.info->l2_mb));
                json_object_set_new(tj, "cc", json_integer(t.info->cc));
            }
            json_object_set_new(root, "config_file", json_string(fname));
        } else {
            json_object_set_new(tj, "no_gpu", json_string(t.no_gpu_why));
            json_object_set_new(tj, "isa", json_string(fm_cpu_isa_name(fm_cpu_isa_detect())));
        }
        json_object_set_new(root, "target", tj);
        json_object_set_new(root, "batches", jb);
    } else {
        sb_printf(&b, "fp4moe explain: %s, %s experts: E=%d H=%d I=%d k=%d%s\n", label, fm_qformat_name(o->fmt),
                  d->n_experts, d->hidden, d->moe_inter, d->topk, d->n_shared ? " (+ shared expert)" : "");
        if (t.kind)
            sb_printf(&b, "target: %s [%s]\n", t.describe, t.origin);
        else
            sb_printf(&b, "target: no CUDA GPU present (%s); explaining the CPU path (%s).\n"
                          "        For a GPU's decision without one, use --gpu NAME (e.g. --gpu \"NVIDIA H200\").\n",
                      t.no_gpu_why[0] ? t.no_gpu_why : "none found", t.describe);
        sb_printf(&b, "bytes per routed expert: %lld (%s: gate, up, down with scales)\n", (long long)eb,
                  fm_qformat_name(o->fmt));
        if (t.kind) sb_printf(&b, "config file for this key: %s\n", fname);
    }

    /* the switches of the layer's schedule, as an engine made now reads them */
    const int cc = t.kind && t.info ? t.info->cc : 0;
    fm_sched sch;
    fm_sched_read(&sch, cc / 10);

    for (int bi = 0; bi < o->n_batches; bi++) {
        int T = o->batches[bi];
        double act = fm_tune_expected_active(d->n_experts, d->topk, T);
        double tpe = fm_tune_tokens_per_expert(d->n_experts, d->topk, T);
        /* The shared expert is read every step too; its matrices are those
         * of a routed expert with shared_inter in place of I. */
        double shared = d->n_shared && d->moe_inter > 0 ? (double)eb * d->shared_inter / d->moe_inter : 0;
        double bytes = act * (double)eb + shared;
        char shs[64] = "";
        if (shared > 0) snprintf(shs, sizeof shs, " + shared %.2f MB", shared / 1e6);
        double bw = t.kind && t.info ? t.info->bandwidth_gbs : 0;
        double floor_us = bw > 0 ? bytes / (bw * 1e9) * 1e6 : 0;
        if (!t.kind) {
            if (o->json) {
                json_array_append_new(jb, json_pack("{s:i, s:f, s:f, s:f, s:s}", "batch", T, "active_experts", act,
                                                    "tokens_per_expert", tpe, "bytes", bytes, "engine", t.describe));
            } else {
                sb_printf(&b, "\nbatch %d\n", T);
                sb_printf(&b, "  active experts   E*(1-(1-k/E)^B) = %d*(1-(1-%d/%d)^%d) = %.1f of %d\n", d->n_experts,
                          d->topk, d->n_experts, T, act, d->n_experts);
                sb_printf(&b, "  tokens/expert    B*k/active = %d*%d/%.1f = %.2f\n", T, d->topk, act, tpe);
                sb_printf(&b, "  weight bytes     %.1f MB to stream per layer\n", bytes / 1e6);
                sb_printf(&b, "  CPU engine       %s: tokens grouped by expert, each active expert's %s bytes read once,\n"
                              "                   decoded in registers, gate+up+activation fused; all cores.\n"
                              "                   No kernel parameters to tune and no config file apply to the CPU path.\n",
                          t.describe, fm_qformat_name(o->fmt));
            }
            continue;
        }
        fm_kernel_config def = fm_kernel_config_default(key, T);
        fm_tune_choice c;
        fm_tune_trail tr[FM_TUNE_NDIRS];
        if ((s = fm_tune_choose_trail(key, T, &c, tr))) goto fail;
        char line[1024], dcs[256], ccs[256];
        fm_tune_provenance_line(key, T, &c, line, sizeof line);
        fm_kernel_config_format(&def, dcs, sizeof dcs);
        fm_kernel_config_format(&c.cfg, ccs, sizeof ccs);
        double mean_tpe = (double)T * d->topk / d->n_experts;
        /* the router logits' shape (src/cuda/route_shape.c, as the engine decides) */
        const int sms = key->sm_count > 0 ? key->sm_count : 132;
        const int lg_gemv = fm_route_logits_gemv(T, d->hidden, d->n_experts, sms);
        const long lg_blocks = fm_route_tile_blocks(T, d->hidden, d->n_experts, sms);
        const char *lg_why = T <= FM_LG_SMALL_T     ? "up to 32 tokens"
                              : T > FM_LG_GEMV_MAX   ? "above 128 tokens"
                              : lg_gemv              ? "up to 128 tokens where the tiled grid would be under a third of the SMs"
                                                     : "the tiled grid fills a third of the SMs or more";
        /* the layer's schedule (src/cuda/schedule.c, as the engine decides):
         * on sm_90 with the wgmma path chosen, where the datasheet names the
         * compute capability */
        const int wg = cc == 90 && c.cfg.path == FM_PATH_WGMMA;
        const int nt = c.cfg.tile_n <= 8 ? 1 : c.cfg.tile_n <= 16 ? 2 : 4;
        const int fork = sch.sh_fork && d->n_shared > 0;
        const int sh_tok = 8 * fm_sched_shared_nt(&sch, wg, nt, c.cfg.warps, T);
        const int handoff = fm_sched_handoff(&sch, wg && sch.pdl, T);
        const int spread =
            fm_sched_sel_spread(&sch, d->route == FM_ROUTE_NOAUX_TC || d->route == FM_ROUTE_DSV4, T, d->topk);
        const int trig = sch.pdl ? fm_sched_trigger(&sch, fork) : 0;
        const char *sh_how = !d->n_shared ? "none" : fork ? "own stream" : "in the routed launches";
        const char *trig_how = !sch.pdl      ? "after the selection (no programmatic dependent launch)"
                               : trig == 1   ? "before the selection's wait on the logits"
                               : trig == 2   ? "right after the selection's wait on the logits"
                                             : "after the selection";
        if (o->json) {
            json_t *e = json_object();
            json_array_append_new(jb, e);
            json_object_set_new(e, "batch", json_integer(T));
            json_object_set_new(e, "active_experts", json_real(act));
            json_object_set_new(e, "tokens_per_expert", json_real(tpe));
            json_object_set_new(e, "bytes", json_real(bytes));
            if (floor_us > 0) json_object_set_new(e, "floor_us", json_real(floor_us));
            json_t *cons = json_array();
            json_array_append_new(cons, json_pack("{s:s, s:s, s:s}", "path", "small", "kernel",
                                                  fm_kernel_path_name(FM_PATH_SMALL), "when", "few tokens per expert (below switch_tpe)"));
            json_array_append_new(cons, json_pack("{s:s, s:s, s:s}", "path", "large", "kernel",
                                                  fm_kernel_path_name(FM_PATH_LARGE), "when", "many tokens per expert (switch_tpe and above)"));
            char when[64];
            snprintf(when, sizeof when, "sm_90, from B*k/E = %g tokens per expert", FM_WGMMA_TPE);
            json_array_append_new(cons, json_pack("{s:s, s:s, s:s}", "path", "wgmma", "kernel",
                                                  fm_kernel_path_name(FM_PATH_WGMMA), "when", when));
            json_object_set_new(e, "considered", cons);
            json_object_set_new(e, "switch_tpe", json_real(def.switch_tpe));
            json_object_set_new(e, "mean_tokens_per_expert", json_real(mean_tpe));
            json_object_set_new(e, "router_logits",
                                json_pack("{s:s, s:I, s:s}", "shape", lg_gemv ? "gemv" : "tiled", "tiled_blocks",
                                          (json_int_t)lg_blocks, "why", lg_why));
            if (cc) {
                json_t *sj = json_pack("{s:s, s:b, s:s, s:s}", "shared_expert", sh_how, "down_per_expert", handoff,
                                       "selection", spread ? "spread over the block" : "one warp per token",
                                       "expert_launch", trig_how);
                if (d->n_shared) json_object_set_new(sj, "shared_tokens_per_pass", json_integer(sh_tok));
                json_object_set_new(e, "schedule", sj);
            }
            json_object_set_new(e, "default", fm_tune_params_json(&def));
            json_t *lk = json_array();
            for (int i = 0; i < FM_TUNE_NDIRS; i++)
                json_array_append_new(lk, json_pack("{s:s, s:s, s:s}", "where", tr[i].label, "dir", tr[i].dir, "status",
                                                    tr[i].status));
            json_object_set_new(e, "lookup", lk);
            if (c.warnings[0] && o->warnings && o->warnings_cap && !strstr(o->warnings, c.warnings))
                fm_tune_appendf(o->warnings, o->warnings_cap, "%s", c.warnings);
            char *cj = fm_tune_choice_to_json(key, T, &c);
            json_t *cv = cj ? json_loads(cj, 0, NULL) : NULL;
            free(cj);
            json_object_set_new(e, "choice", cv ? cv : json_null());
            continue;
        }
        sb_printf(&b, "\nbatch %d\n", T);
        sb_printf(&b, "  active experts   E*(1-(1-k/E)^B) = %d*(1-(1-%d/%d)^%d) = %.1f of %d\n", d->n_experts, d->topk,
                  d->n_experts, T, act, d->n_experts);
        sb_printf(&b, "  tokens/expert    B*k/active = %d*%d/%.1f = %.2f\n", T, d->topk, act, tpe);
        if (floor_us > 0)
            sb_printf(&b, "  weight bytes     %.1f experts x %.2f MB%s = %.1f MB; floor %.1f us at %.0f GB/s (datasheet)\n",
                      act, (double)eb / 1e6, shs, bytes / 1e6, floor_us, bw);
        else
            sb_printf(&b, "  weight bytes     %.1f experts x %.2f MB%s = %.1f MB\n", act, (double)eb / 1e6, shs, bytes / 1e6);
        sb_printf(&b, "  considered       small path: streams each active expert's rows once, tokens on chip;\n"
                      "                     for few tokens per expert (below switch_tpe)\n"
                      "                   large path: tensor-core tiles of tile_n tokens per expert;\n"
                      "                     for many tokens per expert (switch_tpe and above)\n"
                      "                   wgmma path: the large path's work with Hopper warpgroup MMAs,\n"
                      "                     64 rows x up to tile_n tokens per instruction; sm_90, from B*k/E = %g\n",
                  FM_WGMMA_TPE);
        sb_printf(&b, "  default          built-in: %s path (switch_tpe %g; mean tokens per expert B*k/E = %.2f)\n"
                      "                   %s\n",
                  fm_tune_path_token(def.path), (double)def.switch_tpe, mean_tpe, dcs);
        sb_printf(&b, "  router logits    %s shape (%s; the tiled grid: %ld blocks on %d SMs)\n",
                  lg_gemv ? "GEMV" : "tiled", lg_why, lg_blocks, sms);
        if (cc) {
            if (d->n_shared)
                sb_printf(&b, "  schedule         shared expert: %s, %d-token passes\n",
                          fork ? "its own launches on a second stream, beside the selection and the routed gate/up"
                               : "inside the routed launches",
                          sh_tok);
            else
                sb_printf(&b, "  schedule         no shared expert\n");
            sb_printf(&b, "                   down: %s\n",
                      handoff ? "starts per expert as its gate/up ends (up to 32 tokens)"
                              : "waits for the whole gate/up launch");
            sb_printf(&b, "                   selection: %s\n",
                      spread ? "the token's sums and scores over the selection block's warps, one warp's top-k"
                             : "one warp per token");
            sb_printf(&b, "                   expert kernels launched %s\n", trig_how);
        }
        sb_printf(&b, "  config lookup    %s\n", fname);
        for (int i = 0; i < FM_TUNE_NDIRS; i++)
            sb_printf(&b, "                   %d. %s%s%s: %s\n", i + 1, tr[i].label, tr[i].dir[0] ? " " : "", tr[i].dir,
                      tr[i].status);
        if (c.tuned)
            sb_printf(&b, "  chosen           tuned, bucket %d (nearest to %d on a log scale): %s\n"
                          "                   %.2f us vs the default's %.2f us when tuned (%s, fp4moe %s)%s\n"
                          "                   from %s\n",
                      c.bucket, T, ccs, c.tuned_us, c.default_us, c.date, c.version,
                      memcmp(&c.cfg, &def, sizeof def) ? "" : "; the default held there",
                      c.source);
        else
            sb_printf(&b, "  chosen           built-in default: %s\n", ccs);
        if (c.warnings[0] && o->warnings && o->warnings_cap && !strstr(o->warnings, c.warnings))
            fm_tune_appendf(o->warnings, o->warnings_cap, "%s", c.warnings);
        if (c.warnings[0]) {
            sb_printf(&b, "  ignored files\n");
            const char *p = c.warnings;
            while (*p) {
                const char *e = strchr(p, '\n');
                int n = e ? (int)(e - p) : (int)strlen(p);
                sb_printf(&b, "                   %.*s\n", n, p);
                p += n + (e ? 1 : 0);
            }
        }
        sb_printf(&b, "  %s\n", line);
    }

    if (o->json) {
        char *js = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
        json_decref(root);
        if (!js) { free(b.buf); return fm_error(FM_E_NOMEM, "out of memory"); }
        size_t n = strlen(js);
        char *r = realloc(js, n + 2);
        if (!r) { free(js); return fm_error(FM_E_NOMEM, "out of memory"); }
        r[n] = '\n';
        r[n + 1] = 0;
        *out = r;
        return FM_OK;
    }
    if (b.oom || !b.buf) { free(b.buf); return fm_error(FM_E_NOMEM, "out of memory"); }
    *out = b.buf;
    return FM_OK;
fail:
    json_decref(root);
    free(b.buf);
    return s;
}
