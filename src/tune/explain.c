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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Fills the target fields of x: the GPU named by --gpu, else the present
 * one, else the CPU. */
static fm_status find_target(const fm_explain_opts *o, fm_explanation *x) {
    if (o->gpu) {
        const fm_gpu_info *g = fm_gpu_lookup(o->gpu);
        if (!g) {
            char known[1024] = "";
            for (size_t i = 0; i < fm_gpu_count(); i++)
                fm_tune_appendf(known, sizeof known, "%s\"%s\"", i ? ", " : "", fm_gpu_at(i)->name);
            return fm_error(FM_E_NOTFOUND, "unknown GPU '%s'; known GPUs: %s", o->gpu, known);
        }
        x->gpu = 1;
        x->gpu_info = g;
        snprintf(x->key.gpu_name, sizeof x->key.gpu_name, "%s", g->name);
        x->key.sm_count = g->sm_count;
        snprintf(x->origin, sizeof x->origin, "--gpu (not present; datasheet figures)");
        snprintf(x->describe, sizeof x->describe, "%s: %d SMs, %.0f GB/s, %.0f MB L2, %.0f GB, %d W, sm_%d, %s",
                 g->name, g->sm_count, g->bandwidth_gbs, g->l2_mb, g->memory_gb, g->power_w, g->cc,
                 g->fp4_tensor_cores ? "FP4 tensor cores (not used yet: FP4 is decoded in registers)"
                                     : "no FP4 tensor cores (FP4 decoded in registers)");
        return FM_OK;
    }
    if (fm_cuda_available(x->no_gpu_why, sizeof x->no_gpu_why)) {
        fm_cuda_engine *e = NULL;
        fm_status s = fm_cuda_engine_new(0, &e);
        if (s == FM_OK) s = fm_cuda_engine_key(e, o->desc, o->fmt, &x->key);
        if (s == FM_OK) {
            x->gpu = 1;
            x->gpu_info = fm_gpu_lookup(x->key.gpu_name);
            snprintf(x->origin, sizeof x->origin, "present");
            snprintf(x->describe, sizeof x->describe, "%s", fm_cuda_engine_describe(e));
        }
        fm_cuda_engine_free(e);
        if (s == FM_OK) return FM_OK;
        snprintf(x->no_gpu_why, sizeof x->no_gpu_why, "%s", fm_last_error());
    }
    x->gpu = 0;
    fm_cpu_isa isa = fm_cpu_isa_detect();
    snprintf(x->describe, sizeof x->describe, "CPU, %s kernels", fm_cpu_isa_name(isa));
    return FM_OK;
}

/* A GPU target's decision at one batch: the default, the lookup, the router
 * logits' shape and the layer's schedule, as the engine would decide them. */
static fm_status decide_gpu(fm_explanation *x, const fm_sched *sch, fm_explain_batch *e) {
    const fm_model_desc *d = &x->desc;
    const fm_tune_key *key = &x->key;
    const int T = e->batch;
    fm_status s = fm_tune_choose_trail(key, T, &e->choice, e->lookup);
    if (s) return s;
    const fm_tune_choice *c = &e->choice;
    e->default_cfg = fm_kernel_config_default(key, T);
    /* the wgmma kernels run on sm_90 only: on a GPU the datasheet names as
     * another, the engine runs the mma.sync default instead (and says so) */
    const int cc = x->gpu_info ? x->gpu_info->cc : 0;
    if (cc && cc / 10 != 9) {
        if (e->default_cfg.path == FM_PATH_WGMMA) e->default_cfg = fm_kernel_config_default_mma(key, T);
        if (e->choice.cfg.path == FM_PATH_WGMMA) {
            e->choice.cfg = fm_kernel_config_default_mma(key, T);
            size_t n = strlen(e->choice.source);
            snprintf(e->choice.source + n, sizeof e->choice.source - n,
                     " (wgmma path needs sm_90: the built-in mma.sync default used)");
        }
    }
    fm_tune_provenance_line(key, T, c, e->provenance, sizeof e->provenance);
    e->mean_tokens_per_expert = (double)T * d->topk / d->n_experts;
    /* the router logits' shape (src/cuda/route_shape.c, as the engine decides) */
    const int sms = key->sm_count > 0 ? key->sm_count : 132;
    e->logits_sms = sms;
    e->logits_gemv = fm_route_logits_gemv(T, d->hidden, d->n_experts, sms);
    e->logits_tiled_blocks = fm_route_tile_blocks(T, d->hidden, d->n_experts, sms);
    e->logits_why = T <= FM_LG_SMALL_T ? "up to 32 tokens"
                    : T > FM_LG_GEMV_MAX ? "above 128 tokens"
                    : e->logits_gemv     ? "up to 128 tokens where the tiled grid would be under a third of the SMs"
                                         : "the tiled grid fills a third of the SMs or more";
    /* the layer's schedule (src/cuda/schedule.c, as the engine decides): on
     * sm_90 with the wgmma path chosen, where the datasheet names the
     * compute capability */
    const int wg = cc == 90 && c->cfg.path == FM_PATH_WGMMA;
    const int nt = c->cfg.tile_n <= 8 ? 1 : c->cfg.tile_n <= 16 ? 2 : 4;
    const int sk = c->cfg.path == FM_PATH_SPLITK && T <= FM_SPLITK_MAX_TOKENS;
    e->shared_fork = sch->sh_fork && d->n_shared > 0 && !sk;
    e->shared_tokens = 8 * fm_sched_shared_nt(sch, wg, nt, c->cfg.warps, T);
    e->down_per_expert = fm_sched_handoff(sch, wg && sch->pdl, T);
    e->selection_spread =
        fm_sched_sel_spread(sch, d->route == FM_ROUTE_NOAUX_TC || d->route == FM_ROUTE_DSV4, T, d->topk);
    const int trig = sch->pdl ? (sk ? 2 : fm_sched_trigger(sch, e->shared_fork)) : 0;
    e->shared_how = !d->n_shared ? "none" : e->shared_fork ? "own stream" : "in the routed launches";
    e->down_per_expert = e->down_per_expert && !sk;
    e->expert_launch = !sch->pdl  ? "after the selection (no programmatic dependent launch)"
                       : trig == 1 ? "before the selection's wait on the logits"
                       : trig == 2 ? "right after the selection's wait on the logits"
                                   : "after the selection";
    /* the splitk path's grids, as expert_splitk.cu launches them, on the
     * matrices padded as the engine stores them */
    if (sk) {
        const int gate_rp = fm_sched_pad(d->moe_inter, FM_SCHED_KSEG);
        const int sgate_rp = d->n_shared > 0 && d->shared_inter > 0 ? fm_sched_pad(d->shared_inter, FM_SCHED_KSEG) : 0;
        const int ta = T * d->topk, max_active = ta < d->n_experts ? ta : d->n_experts;
        const int down_rp = fm_sched_pad(d->hidden, FM_SCHED_DOWN_ROWS);
        const int nseg = fm_sched_pad(d->moe_inter, FM_SCHED_KSEG) / FM_SCHED_KSEG;
        e->splitk_gu_blocks = fm_sched_splitk_gu_blocks(gate_rp, sgate_rp, max_active, c->cfg.k_split);
        e->splitk_down_blocks = down_rp / 16;
        e->splitk_down_per_sm = fm_sched_splitk_down_per_sm(down_rp, nt, nseg, sms);
        /* one token: gate/up and down in one launch, as
         * fm_cuda_fused1_fits decides it on the device */
        if (T == 1) {
            fm_fused1_layout L;
            const int hp = fm_sched_pad(d->hidden, FM_SCHED_KSEG);
            const fm_fused1_shape sh = {.T = T, .k_active = max_active, .Hp = hp,
                                        .gate_rows_p = gate_rp, .gate_kp = hp, .down_rows_p = down_rp, .down_kp = gate_rp,
                                        .sgate_rows_p = sgate_rp, .sgate_kp = hp, .sdown_rows_p = down_rp,
                                        .sdown_kp = sgate_rp, .mx = x->fmt == FM_QF_MXFP4, .E = d->n_experts};
            /* the opt-in shared memory per block: 227 KB on sm_90 and sm_100, 99 KB on sm_120 */
            const int optin = !cc ? 0 : cc / 10 == 12 ? 101376 : 232448;
            e->fused_why = fm_sched_fused1_why(&sh, cc, optin, sms, &L);
            e->fused_smem = L.total;
            e->fused_blocks = e->fused_why ? 0 : (long long)max_active * (gate_rp / 16);
            /* as fm_cuda_fused1_selects decides it, for a layer routed by
             * scores (hash-routed layers run the selection kernel) */
            e->fused_sel_why = e->fused_blocks ? fm_sched_fused1_selects(d->route, 0, d->n_experts) : NULL;
            e->fused_selects = e->fused_blocks > 0 && !e->fused_sel_why;
            /* the launch asks for the top-k's scratch past its layout */
            if (e->fused_selects) e->fused_smem += (int)FM_FUSED1_SEL_BYTES(d->n_experts);
            /* the logits kernel lets its dependents in right after its own wait */
            if (e->fused_selects && sch->pdl)
                e->expert_launch = "right after the logits' wait on the previous layer (the one-token launch, which "
                                   "selects the top-k itself)";
        }
    }
    /* the wgmma down's row chunks per block: the most the rule can give
     * (how many it gives depends on the occupancy the engine asks at run
     * time), in 128-row chunks, or 256 with two warpgroups */
    if (wg) {
        const int rpb = c->cfg.warps == 8 && nt > 1 ? 256 : 128;
        e->down_chunks_max = fm_sched_wg_down_chunks_max(fm_sched_pad(d->hidden, FM_SCHED_DOWN_ROWS), rpb,
                                                         fm_sched_pad(d->moe_inter, FM_SCHED_KSEG) / FM_SCHED_KSEG);
        /* gate/up's quarters or thirds (fm_sched_wg_ksplit without the occupancy):
         * one warpgroup per block, 64-row blocks, the shared expert's
         * blocks in the grid unless it runs on its own stream */
        if (!(c->cfg.warps == 8 && nt > 1)) {
            const int ta = T * d->topk, max_active = ta < d->n_experts ? ta : d->n_experts;
            const int gate_rp = fm_sched_pad(d->moe_inter, FM_SCHED_KSEG);
            const int sgate_rp = d->n_shared > 0 && d->shared_inter > 0 && !e->shared_fork
                                     ? fm_sched_pad(d->shared_inter, FM_SCHED_KSEG)
                                     : 0;
            int sh_chunks;
            long long sh_blocks;
            e->gateup_blocks = fm_sched_wg_items(max_active, gate_rp, sgate_rp, 64, T, 8 * nt, &sh_chunks, &sh_blocks);
            const int ks =
                fm_sched_wg_ksplit(1, e->gateup_blocks, sh_blocks, gate_rp, 64,
                                   fm_sched_pad(d->hidden, FM_SCHED_KSEG) / FM_SCHED_KSEG, d->n_experts, d->topk, T,
                                   max_active, sms, 0);
            e->gateup_k_split = ks >= 3 ? ks : 0;
        }
    }
    /* each ignored file once, however many batches saw it */
    if (c->warnings[0] && !strstr(x->warnings, c->warnings))
        fm_tune_appendf(x->warnings, sizeof x->warnings, "%s", c->warnings);
    return FM_OK;
}

fm_status fm_explain_decide(const fm_explain_opts *o, fm_explanation **out) {
    if (!out) return fm_error(FM_E_ARG, "fm_explain_decide: NULL output");
    *out = NULL;
    if (!o || !o->desc || !o->batches || o->n_batches < 1) return fm_error(FM_E_ARG, "fm_explain: missing argument");
    for (int i = 0; i < o->n_batches; i++)
        if (o->batches[i] < 1 || o->batches[i] > 1000000)
            return fm_error(FM_E_RANGE, "batch %d is out of range [1, 1000000]", o->batches[i]);
    fm_explanation *x = fm_calloc(1, sizeof *x);
    if (!x) return FM_E_NOMEM;
    x->batches = fm_calloc((size_t)o->n_batches, sizeof *x->batches);
    fm_status s = x->batches ? FM_OK : FM_E_NOMEM;
    const fm_shard *sh = o->shard && o->shard->mode ? o->shard : NULL;
    x->full_desc = *o->desc;
    x->desc = *o->desc;
    if (!s && sh) {
        s = fm_shard_desc(o->desc, o->fmt, sh, &x->desc);
        x->shard_mode = sh->mode;
        x->shard_ranks = sh->ranks;
        x->shard_rank = sh->rank;
        fm_shard_describe(sh, o->desc, x->shard_desc, sizeof x->shard_desc);
    }
    if (!s) s = find_target(o, x);
    if (!s) s = fm_tune_key_set_shape(&x->key, &x->desc, o->fmt);
    if (!s) s = fm_tune_key_filename(&x->key, x->config_file, sizeof x->config_file);
    if (s) {
        fm_explanation_free(x);
        return s;
    }
    const fm_model_desc *d = &x->desc, *fd = &x->full_desc;
    const int ep = sh && sh->mode == FM_DIST_EP;
    snprintf(x->model, sizeof x->model, "%s", o->model_label ? o->model_label : d->family);
    x->fmt = o->fmt;
    x->expert_bytes = fm_model_expert_bytes(d, o->fmt);
    x->n_batches = o->n_batches;
    /* the switches of the layer's schedule, as an engine made now reads them */
    const int cc = x->gpu && x->gpu_info ? x->gpu_info->cc : 0;
    x->has_schedule = cc != 0;
    fm_sched sch;
    fm_sched_read(&sch, cc / 10);
    const double eb = (double)x->expert_bytes;
    const double bw = x->gpu && x->gpu_info ? x->gpu_info->bandwidth_gbs : 0;
    for (int bi = 0; bi < o->n_batches; bi++) {
        fm_explain_batch *e = &x->batches[bi];
        const int T = o->batches[bi];
        e->batch = T;
        /* an EP rank: its E/R experts' share of the full routing's active
         * ones; TP ranks see the full routing's */
        e->active_experts = fm_tune_expected_active(fd->n_experts, fd->topk, T) * d->n_experts / fd->n_experts;
        e->tokens_per_expert = fm_tune_tokens_per_expert(fd->n_experts, fd->topk, T);
        /* The shared expert is read every step too; its matrices are those
         * of a routed expert with shared_inter in place of I (an EP rank:
         * only when its token chunk holds a token). */
        int t0 = 0, nchunk = T;
        if (ep) fm_shard_token_chunk(sh, T, &t0, &nchunk);
        e->shared_bytes = d->n_shared && d->moe_inter > 0 && nchunk > 0 ? eb * d->shared_inter / d->moe_inter : 0;
        e->bytes = e->active_experts * eb + e->shared_bytes;
        e->floor_us = bw > 0 ? e->bytes / (bw * 1e9) * 1e6 : 0;
        if (x->gpu && (s = decide_gpu(x, &sch, e))) {
            fm_explanation_free(x);
            return s;
        }
    }
    *out = x;
    return FM_OK;
}

void fm_explanation_free(fm_explanation *x) {
    if (!x) return;
    free(x->batches);
    free(x);
}

/* ------------------------------------------------------------ text */

static void text_batch_head(const fm_explanation *x, const fm_explain_batch *e, FILE *f) {
    const fm_model_desc *d = &x->desc;
    fprintf(f, "\nbatch %d\n", e->batch);
    const fm_model_desc *fd = &x->full_desc;
    if (x->shard_mode == FM_DIST_EP)
        fprintf(f, "  active experts   (E/R)*(1-(1-k/E)^B) = %d*(1-(1-%d/%d)^%d) = %.1f of the rank's %d\n",
                d->n_experts, fd->topk, fd->n_experts, e->batch, e->active_experts, d->n_experts);
    else
        fprintf(f, "  active experts   E*(1-(1-k/E)^B) = %d*(1-(1-%d/%d)^%d) = %.1f of %d\n", d->n_experts, d->topk,
                d->n_experts, e->batch, e->active_experts, d->n_experts);
    fprintf(f, "  tokens/expert    B*k/active = %d*%d/%.1f = %.2f\n", e->batch, fd->topk,
            x->shard_mode == FM_DIST_EP ? e->active_experts * fd->n_experts / d->n_experts : e->active_experts,
            e->tokens_per_expert);
}

static void text_gpu_batch(const fm_explanation *x, const fm_explain_batch *e, FILE *f) {
    const fm_model_desc *d = &x->desc;
    const fm_tune_choice *c = &e->choice;
    const fm_kernel_config *def = &e->default_cfg;
    const int T = e->batch;
    const double eb = (double)x->expert_bytes;
    char shs[64] = "", dcs[256], ccs[256];
    if (e->shared_bytes > 0) snprintf(shs, sizeof shs, " + shared %.2f MB", e->shared_bytes / 1e6);
    fm_kernel_config_format(def, dcs, sizeof dcs);
    fm_kernel_config_format(&c->cfg, ccs, sizeof ccs);
    text_batch_head(x, e, f);
    if (e->floor_us > 0)
        fprintf(f, "  weight bytes     %.1f experts x %.2f MB%s = %.1f MB; floor %.1f us at %.0f GB/s (datasheet)\n",
                e->active_experts, eb / 1e6, shs, e->bytes / 1e6, e->floor_us, x->gpu_info->bandwidth_gbs);
    else
        fprintf(f, "  weight bytes     %.1f experts x %.2f MB%s = %.1f MB\n", e->active_experts, eb / 1e6, shs,
                e->bytes / 1e6);
    fprintf(f, "  considered       small path: streams each active expert's rows once, tokens on chip;\n"
               "                     for few tokens per expert (below switch_tpe)\n"
               "                   large path: tensor-core tiles of tile_n tokens per expert;\n"
               "                     for many tokens per expert (switch_tpe and above)\n"
               "                   wgmma path: the large path's work with Hopper warpgroup MMAs,\n"
               "                     64 rows x up to tile_n tokens per instruction; sm_90, from B*k/E = %g\n"
               "                   splitk path: gate/up's K over k_split warps per 16 rows, down a block per\n"
               "                     16 output rows over every expert; up to %d tokens, I <= %d (default at %d)\n",
            FM_WGMMA_TPE, FM_SPLITK_MAX_TOKENS, FM_SPLITK_DEFAULT_I, FM_SPLITK_DEFAULT_T);
    fprintf(f, "  default          built-in: %s path (switch_tpe %g; mean tokens per expert B*k/E = %.2f)\n"
               "                   %s\n",
            fm_tune_path_token(def->path), (double)def->switch_tpe, e->mean_tokens_per_expert, dcs);
    fprintf(f, "  router logits    %s shape (%s; the tiled grid: %ld blocks on %d SMs)\n",
            e->logits_gemv ? "GEMV" : "tiled", e->logits_why, e->logits_tiled_blocks, e->logits_sms);
    if (!e->logits_gemv)
        fprintf(f, "                   tiled: BF16 activations on a router exact in BF16 take one cuBLAS GEMM where\n"
                   "                     the engine loads cuBLAS (its description says), else fp4moe's mma.sync tiles\n");
    if (x->has_schedule) {
        if (d->n_shared)
            fprintf(f, "  schedule         shared expert: %s, %d-token passes\n",
                    e->shared_fork ? "its own launches on a second stream, beside the selection and the routed gate/up"
                                   : "inside the routed launches",
                    e->shared_tokens);
        else
            fprintf(f, "  schedule         no shared expert\n");
        fprintf(f, "                   down: %s\n",
                e->down_per_expert ? "starts per expert as its gate/up ends (up to 32 tokens)"
                                   : "waits for the whole gate/up launch");
        if (e->down_chunks_max > 1)
            fprintf(f, "                   down blocks: up to %d row chunks each (a short K: as many as keep one wave "
                       "of resident blocks; the bench's kernel line names how many ran)\n",
                    e->down_chunks_max);
        if (e->gateup_k_split == 4)
            fprintf(f, "                   gate/up blocks: K in quarters, a cluster of 4 per row block (%lld blocks x 4 "
                       "on %d SMs: at most 3 per SM; the bench's kernel line names the split)\n",
                    e->gateup_blocks, e->logits_sms);
        else if (e->gateup_k_split == 3)
            fprintf(f, "                   gate/up blocks: K in thirds, a cluster of 3 per row block (%lld blocks x 3 "
                       "on %d SMs: quarters would put more than 3 on an SM; the bench's kernel line names the "
                       "split)\n",
                    e->gateup_blocks, e->logits_sms);
        fprintf(f, "                   selection: %s%s\n",
                !e->selection_spread ? "one warp per token"
                : T == 1             ? "the token's sums and scores over the selection block's warps, one warp's top-k"
                                     : "each token's sums and scores over its half of the selection block's warps, "
                                       "one warp's top-k each",
                !e->fused_selects      ? ""
                : d->n_hash_layers > 0 ? " (in the one-token launch instead, below; the hash-routed layers keep the "
                                         "selection kernel)"
                                       : " (in the one-token launch instead, below)");
        fprintf(f, "                   expert kernels launched %s\n", e->expert_launch);
        if (e->splitk_gu_blocks > 0) {
            const double slots = (double)e->logits_sms;
            fprintf(f, "                   splitk grids: gate/up %lld blocks, %d per SM (%.2f waves); down %d blocks, "
                       "%d per SM (%.2f waves)\n",
                    e->splitk_gu_blocks, FM_SPLITK_PER_SM, (double)e->splitk_gu_blocks / (FM_SPLITK_PER_SM * slots),
                    e->splitk_down_blocks, e->splitk_down_per_sm,
                    (double)e->splitk_down_blocks / (e->splitk_down_per_sm * slots));
            if (e->fused_blocks > 0)
                fprintf(f, "                   one token: gate/up and down in one launch instead, %lld blocks (one per "
                           "SM), %.1f KB of shared memory each (sm_90 and later)\n",
                        e->fused_blocks, e->fused_smem / 1024.0);
            if (e->fused_selects)
                fprintf(f, "                   one token's top-k: inside that launch, no selection kernel%s\n",
                        d->n_hash_layers > 0 ? " (the hash-routed layers keep it)" : "");
            else if (e->fused_blocks > 0 && e->fused_sel_why)
                fprintf(f, "                   one token's top-k: the selection kernel before that launch (%s)\n",
                        e->fused_sel_why);
            if (e->fused_blocks <= 0 && e->fused_why)
                fprintf(f, "                   one token: the two launches above (not one launch: %s)\n",
                        e->fused_why);
        }
    }
    fprintf(f, "  config lookup    %s\n", x->config_file);
    for (int i = 0; i < FM_TUNE_NDIRS; i++)
        fprintf(f, "                   %d. %s%s%s: %s\n", i + 1, e->lookup[i].label, e->lookup[i].dir[0] ? " " : "",
                e->lookup[i].dir, e->lookup[i].status);
    if (c->tuned)
        fprintf(f, "  chosen           tuned, bucket %d (nearest to %d on a log scale): %s\n"
                   "                   %.2f us vs the default's %.2f us when tuned (%s, fp4moe %s)%s\n"
                   "                   from %s\n",
                c->bucket, T, ccs, c->tuned_us, c->default_us, c->date, c->version,
                memcmp(&c->cfg, def, sizeof *def) ? "" : "; the default held there", c->source);
    else if (c->nearest)
        fprintf(f, "  chosen           borrowed from the nearest tuned shape (no file for this one): %s\n"
                   "                   E=%d H=%d I=%d k=%d, distance %.2f (4|log2 H/H'| + 2|log2 I/I'| +\n"
                   "                   |log2 E/E'| + |log2 k/k'|); its bucket %d, nearest to its batch %d of the same\n"
                   "                   tokens per expert as batch %d here\n"
                   "                   from %s\n",
                ccs, c->nearest_E, c->nearest_H, c->nearest_I, c->nearest_k, c->nearest_distance, c->bucket,
                c->nearest_batch, T, c->source);
    else
        fprintf(f, "  chosen           built-in default: %s%s\n", ccs,
                c->no_gpu_files      ? " (no tuned config file of this GPU and format at all)"
                : c->nearest_too_far ? " (the nearest tuned shape is too far to borrow from)"
                                     : "");
    if (c->warnings[0]) {
        fprintf(f, "  ignored files\n");
        const char *p = c->warnings;
        while (*p) {
            const char *nl = strchr(p, '\n');
            int n = nl ? (int)(nl - p) : (int)strlen(p);
            fprintf(f, "                   %.*s\n", n, p);
            p += n + (nl ? 1 : 0);
        }
    }
    fprintf(f, "  %s\n", e->provenance);
}

static fm_status written(FILE *f) {
    return ferror(f) ? fm_error(FM_E_IO, "cannot write the explanation") : FM_OK;
}

fm_status fm_explain_render_text(const fm_explanation *x, FILE *f) {
    if (!x || !f) return fm_error(FM_E_ARG, "fm_explain_render_text: NULL argument");
    const fm_model_desc *d = &x->desc;
    fprintf(f, "fp4moe explain: %s, %s experts: E=%d H=%d I=%d k=%d%s\n", x->model, fm_qformat_name(x->fmt),
            d->n_experts, d->hidden, d->moe_inter, d->topk, d->n_shared ? " (+ shared expert)" : "");
    if (x->shard_mode)
        fprintf(f, "shard: %s (of E=%d H=%d I=%d k=%d); bytes and floor are this rank's\n", x->shard_desc,
                x->full_desc.n_experts, x->full_desc.hidden, x->full_desc.moe_inter, x->full_desc.topk);
    if (x->gpu)
        fprintf(f, "target: %s [%s]\n", x->describe, x->origin);
    else
        fprintf(f, "target: no CUDA GPU present (%s); explaining the CPU path (%s).\n"
                   "        For a GPU's decision without one, use --gpu NAME (e.g. --gpu \"NVIDIA H200\").\n",
                x->no_gpu_why[0] ? x->no_gpu_why : "none found", x->describe);
    fprintf(f, "bytes per routed expert: %lld (%s: gate, up, down with scales)\n", (long long)x->expert_bytes,
            fm_qformat_name(x->fmt));
    if (x->gpu) fprintf(f, "config file for this key: %s\n", x->config_file);
    for (int bi = 0; bi < x->n_batches; bi++) {
        const fm_explain_batch *e = &x->batches[bi];
        if (x->gpu) {
            text_gpu_batch(x, e, f);
            continue;
        }
        text_batch_head(x, e, f);
        fprintf(f, "  weight bytes     %.1f MB to stream per layer\n", e->bytes / 1e6);
        fprintf(f, "  CPU engine       %s: tokens grouped by expert, each active expert's %s bytes read once,\n"
                   "                   decoded in registers, gate+up+activation fused; all cores.\n"
                   "                   No kernel parameters to tune and no config file apply to the CPU path.\n",
                x->describe, fm_qformat_name(x->fmt));
    }
    return written(f);
}

/* ------------------------------------------------------------ JSON */

static json_t *json_gpu_batch(const fm_explanation *x, const fm_explain_batch *e) {
    const fm_model_desc *d = &x->desc;
    json_t *j = json_object();
    json_object_set_new(j, "batch", json_integer(e->batch));
    json_object_set_new(j, "active_experts", json_real(e->active_experts));
    json_object_set_new(j, "tokens_per_expert", json_real(e->tokens_per_expert));
    json_object_set_new(j, "bytes", json_real(e->bytes));
    if (e->floor_us > 0) json_object_set_new(j, "floor_us", json_real(e->floor_us));
    json_t *cons = json_array();
    json_array_append_new(cons, json_pack("{s:s, s:s, s:s}", "path", "small", "kernel", fm_kernel_path_name(FM_PATH_SMALL),
                                          "when", "few tokens per expert (below switch_tpe)"));
    json_array_append_new(cons, json_pack("{s:s, s:s, s:s}", "path", "large", "kernel", fm_kernel_path_name(FM_PATH_LARGE),
                                          "when", "many tokens per expert (switch_tpe and above)"));
    char when[64];
    snprintf(when, sizeof when, "sm_90, from B*k/E = %g tokens per expert", FM_WGMMA_TPE);
    json_array_append_new(cons, json_pack("{s:s, s:s, s:s}", "path", "wgmma", "kernel", fm_kernel_path_name(FM_PATH_WGMMA),
                                          "when", when));
    json_array_append_new(cons, json_pack("{s:s, s:s, s:s}", "path", "splitk", "kernel", fm_kernel_path_name(FM_PATH_SPLITK),
                                          "when", "up to 16 tokens on experts of I <= 512 (the default at one token)"));
    json_object_set_new(j, "considered", cons);
    json_object_set_new(j, "switch_tpe", json_real(e->default_cfg.switch_tpe));
    json_object_set_new(j, "mean_tokens_per_expert", json_real(e->mean_tokens_per_expert));
    json_object_set_new(j, "router_logits", json_pack("{s:s, s:I, s:s}", "shape", e->logits_gemv ? "gemv" : "tiled",
                                                      "tiled_blocks", (json_int_t)e->logits_tiled_blocks, "why",
                                                      e->logits_why));
    if (x->has_schedule) {
        json_t *sj = json_pack("{s:s, s:b, s:s, s:s}", "shared_expert", e->shared_how, "down_per_expert",
                               e->down_per_expert, "selection",
                               e->selection_spread ? "spread over the block" : "one warp per token", "expert_launch",
                               e->expert_launch);
        if (d->n_shared) json_object_set_new(sj, "shared_tokens_per_pass", json_integer(e->shared_tokens));
        if (e->down_chunks_max > 1) json_object_set_new(sj, "down_chunks_max", json_integer(e->down_chunks_max));
        if (e->gateup_k_split) json_object_set_new(sj, "gateup_k_split", json_integer(e->gateup_k_split));
        if (e->splitk_gu_blocks > 0)
            json_object_set_new(sj, "splitk_grids",
                                json_pack("{s:I, s:i, s:i, s:i}", "gateup_blocks", (json_int_t)e->splitk_gu_blocks,
                                          "gateup_per_sm", FM_SPLITK_PER_SM, "down_blocks", e->splitk_down_blocks,
                                          "down_per_sm", e->splitk_down_per_sm));
        if (e->fused_blocks > 0)
            json_object_set_new(sj, "one_token_launch",
                                json_pack("{s:I, s:i, s:b, s:s*}", "blocks", (json_int_t)e->fused_blocks,
                                          "shared_memory_bytes", e->fused_smem, "selects_topk", e->fused_selects,
                                          "selection_kernel_why", e->fused_sel_why));
        json_object_set_new(j, "schedule", sj);
    }
    json_object_set_new(j, "default", fm_tune_params_json(&e->default_cfg));
    json_t *lk = json_array();
    for (int i = 0; i < FM_TUNE_NDIRS; i++)
        json_array_append_new(lk, json_pack("{s:s, s:s, s:s}", "where", e->lookup[i].label, "dir", e->lookup[i].dir,
                                            "status", e->lookup[i].status));
    json_object_set_new(j, "lookup", lk);
    char *cj = fm_tune_choice_to_json(&x->key, e->batch, &e->choice);
    json_t *cv = cj ? json_loads(cj, 0, NULL) : NULL;
    free(cj);
    json_object_set_new(j, "choice", cv ? cv : json_null());
    return j;
}

fm_status fm_explain_render_json(const fm_explanation *x, FILE *f) {
    if (!x || !f) return fm_error(FM_E_ARG, "fm_explain_render_json: NULL argument");
    const fm_model_desc *d = &x->desc;
    json_t *root = json_object(), *jb = json_array();
    if (!root || !jb) {
        json_decref(root);
        json_decref(jb);
        return fm_error(FM_E_NOMEM, "out of memory");
    }
    json_object_set_new(root, "model", json_string(x->model));
    json_object_set_new(root, "family", json_string(d->family));
    json_object_set_new(root, "format", json_string(fm_qformat_name(x->fmt)));
    json_object_set_new(root, "shape", json_pack("{s:i, s:i, s:i, s:i, s:i}", "E", d->n_experts, "H", d->hidden, "I",
                                                 d->moe_inter, "k", d->topk, "shared", d->n_shared));
    json_object_set_new(root, "expert_bytes", json_integer(x->expert_bytes));
    if (x->shard_mode)
        json_object_set_new(root, "shard",
                            json_pack("{s:s, s:i, s:i, s:s, s:{s:i, s:i, s:i, s:i}}", "mode",
                                      fm_dist_mode_name((fm_dist_mode)x->shard_mode), "ranks", x->shard_ranks, "rank",
                                      x->shard_rank, "describe", x->shard_desc, "full_shape", "E",
                                      x->full_desc.n_experts, "H", x->full_desc.hidden, "I", x->full_desc.moe_inter,
                                      "k", x->full_desc.topk));
    json_t *tj = json_object();
    json_object_set_new(tj, "kind", json_string(x->gpu ? "gpu" : "cpu"));
    json_object_set_new(tj, "describe", json_string(x->describe));
    if (x->gpu) {
        json_object_set_new(tj, "name", json_string(x->key.gpu_name));
        json_object_set_new(tj, "sm_count", json_integer(x->key.sm_count));
        json_object_set_new(tj, "origin", json_string(x->origin));
        if (x->gpu_info) {
            json_object_set_new(tj, "bandwidth_gbs", json_real(x->gpu_info->bandwidth_gbs));
            json_object_set_new(tj, "l2_mb", json_real(x->gpu_info->l2_mb));
            json_object_set_new(tj, "cc", json_integer(x->gpu_info->cc));
            json_object_set_new(tj, "memory_gb", json_real(x->gpu_info->memory_gb));
            json_object_set_new(tj, "power_w", json_integer(x->gpu_info->power_w));
        }
        json_object_set_new(root, "config_file", json_string(x->config_file));
    } else {
        json_object_set_new(tj, "no_gpu", json_string(x->no_gpu_why));
        json_object_set_new(tj, "isa", json_string(fm_cpu_isa_name(fm_cpu_isa_detect())));
    }
    json_object_set_new(root, "target", tj);
    json_object_set_new(root, "batches", jb);
    for (int bi = 0; bi < x->n_batches; bi++) {
        const fm_explain_batch *e = &x->batches[bi];
        json_array_append_new(jb, x->gpu ? json_gpu_batch(x, e)
                                         : json_pack("{s:i, s:f, s:f, s:f, s:s}", "batch", e->batch, "active_experts",
                                                     e->active_experts, "tokens_per_expert", e->tokens_per_expert,
                                                     "bytes", e->bytes, "engine", x->describe));
    }
    int rc = json_dumpf(root, f, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(root);
    if (rc) return fm_error(FM_E_IO, "cannot write the explanation");
    fputc('\n', f);
    return written(f);
}

/* ------------------------------------------------------------ both */

fm_status fm_explain(const fm_explain_opts *o, char **out) {
    if (!out) return fm_error(FM_E_ARG, "fm_explain: NULL output");
    *out = NULL;
    if (o && o->warnings && o->warnings_cap) o->warnings[0] = 0;
    fm_explanation *x = NULL;
    fm_status s = fm_explain_decide(o, &x);
    if (s) return s;
    if (o->warnings && o->warnings_cap) snprintf(o->warnings, o->warnings_cap, "%s", x->warnings);
    char *buf = NULL;
    size_t len = 0;
    FILE *m = open_memstream(&buf, &len);
    if (!m) {
        fm_explanation_free(x);
        return fm_error(FM_E_NOMEM, "out of memory");
    }
    s = o->json ? fm_explain_render_json(x, m) : fm_explain_render_text(x, m);
    if (fclose(m) != 0 && !s) s = fm_error(FM_E_NOMEM, "out of memory");
    fm_explanation_free(x);
    if (s) {
        free(buf);
        return s;
    }
    *out = buf;
    return FM_OK;
}
