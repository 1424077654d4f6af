/* `fp4moe bench` as one library call: the engines, the bandwidth probe, the
 * layers and the loop over batch sizes; the command only parses and prints. */
#include <stdio.h>
#include <string.h>

#include "io/io_internal.h"
#include "parallel/parallel_internal.h"
#include "util/util.h"

/* Timed steps of a sharded layer per batch size. */
#define DIST_REPS 5

typedef struct {
    const fm_bench_opts *o;
    fm_bench_report *r;
    fm_cpu_engine *ce;
    fm_cuda_engine *ge;
    fm_ckpt *ck;
    fm_moe_layer *hl[FM_BENCH_MAX_LAYERS];
    fm_cuda_layer *gl[FM_BENCH_MAX_LAYERS];
    /* a TP shard on the host: hl[i] is views[i], a zero-copy view of full[i] */
    fm_moe_layer *full[FM_BENCH_MAX_LAYERS];
    fm_moe_layer views[FM_BENCH_MAX_LAYERS];
    fm_qmatrix *arrays[FM_BENCH_MAX_LAYERS];
    /* an EP shard: the full routing's layer (full[i], or the router alone
     * for a GPU preset), the most loaded rank's GPU layers when another
     * rank is, and a zero router for host views */
    fm_moe_layer *router[FM_BENCH_MAX_LAYERS];
    fm_cuda_layer *gmax[FM_BENCH_MAX_LAYERS];
    int gmax_rank;
    float *zero_router;
} bench_run;

static void progress(const fm_bench_opts *o, const char *what, double frac) {
    if (o->progress) o->progress(o->progress_ctx, what, frac);
}

static void emit(const fm_bench_opts *o, const fm_bench_report *r, int row) {
    if (o->on_row) o->on_row(o->row_ctx, r, row);
}

/* fm_cpu_bench's progress with the batch size in front of it. */
typedef struct {
    const fm_bench_opts *o;
    int T;
} batch_progress;

static void cpu_progress(void *ctx, const char *what, double frac) {
    const batch_progress *bp = ctx;
    char w[96];
    snprintf(w, sizeof w, "batch %d: %s", bp->T, what);
    progress(bp->o, w, frac);
}

/* The i-th MoE layer of the model (wrapping), for presets. */
static int nth_moe_layer(const fm_model_desc *d, int i) {
    int n_moe = 0;
    for (int l = 0; l < d->n_layers; l++) n_moe += fm_model_is_moe_layer(d, l);
    if (n_moe == 0) return -1;
    int want = i % n_moe;
    for (int l = 0; l < d->n_layers; l++)
        if (fm_model_is_moe_layer(d, l) && want-- == 0) return l;
    return -1;
}

static fm_status check_opts(const fm_bench_opts *o) {
    if (!!o->model_dir == !!o->preset) return fm_error(FM_E_ARG, "bench: give exactly one of a model directory or a preset");
    if (o->model_dir && o->fmt != FM_QF_NONE)
        return fm_error(FM_E_ARG, "bench: the experts' format applies to presets only (a checkpoint's is its own)");
    if (o->fmt != FM_QF_NONE && o->fmt != FM_QF_NVFP4 && o->fmt != FM_QF_MXFP4 && o->fmt != FM_QF_BF16)
        return fm_error(FM_E_ARG, "bench: unknown experts' format %d", (int)o->fmt);
    if (o->device != FM_DEV_CPU && o->device != FM_DEV_CUDA) return fm_error(FM_E_ARG, "bench: unknown device %d", (int)o->device);
    if (!o->batches || o->n_batches < 1 || o->n_batches > FM_BENCH_MAX_BATCH)
        return fm_error(FM_E_RANGE, "bench: %d batch sizes (1 to %d)", o->n_batches, FM_BENCH_MAX_BATCH);
    for (int i = 0; i < o->n_batches; i++)
        if (o->batches[i] < 1 || o->batches[i] > 1000000)
            return fm_error(FM_E_RANGE, "bench: batch %d outside [1, 1000000]", o->batches[i]);
    if (o->layers < 0 || o->layers > FM_BENCH_MAX_LAYERS)
        return fm_error(FM_E_RANGE, "bench: %d layers (0 for the default, at most %d)", o->layers, FM_BENCH_MAX_LAYERS);
    if (!(o->min_seconds >= 0 && o->min_seconds <= 3600))
        return fm_error(FM_E_RANGE, "bench: a minimum timing of %g s (0 to 3600)", o->min_seconds);
    if (!(o->sustain_ms >= 0 && o->sustain_ms <= 600000))
        return fm_error(FM_E_RANGE, "bench: sustained replays of %g ms (0 to 600000)", o->sustain_ms);
    if (o->shard && o->shard->mode && o->dist)
        return fm_error(FM_E_ARG, "bench: --shard runs one rank on one device; it does not go with --tp / --ep");
    if (o->sustain_ms > 0 && (o->device != FM_DEV_CUDA || o->dist))
        return fm_error(FM_E_ARG, "bench: sustained replays time one GPU's graph (not the CPU, not a sharded layer)");
    if (o->act != FM_DT_INVALID && o->act != FM_DT_F32) {
        if (o->act != FM_DT_BF16 && o->act != FM_DT_F16)
            return fm_error(FM_E_ARG, "bench: activations must be F32, BF16 or F16, not %s", fm_dtype_name(o->act));
        if (o->device != FM_DEV_CUDA || o->dist || (o->shard && o->shard->mode == FM_DIST_EP))
            return fm_error(FM_E_ARG, "bench: %s activations apply to one GPU's layer or a TP shard (--device cuda; "
                                      "not the CPU, --tp / --ep or an EP shard, which feed F32)",
                            fm_dtype_name(o->act));
    }
    return FM_OK;
}

/* ------------------------------------------------------ one device */

/* Bandwidth first, while memory is not yet filled with layers. */
static fm_status measure_bandwidth(bench_run *b) {
    const fm_bench_opts *o = b->o;
    fm_bench_report *r = b->r;
    const int cuda = o->device == FM_DEV_CUDA;
    size_t bytes = o->bw_probe_bytes ? o->bw_probe_bytes : (size_t)(cuda ? 4096 : 1024) << 20;
    const char *what = "measuring memory bandwidth";
    progress(o, what, 0.0);
    if (cuda) {
        r->bandwidth_Bps = fm_cuda_measure_bandwidth(b->ge, bytes);
        snprintf(r->bandwidth_probe, sizeof r->bandwidth_probe, "streaming read of %zu MiB of device memory", bytes >> 20);
    } else {
        r->bandwidth_Bps = fm_cpu_measure_bandwidth(bytes, o->threads);
        if (o->threads > 0)
            snprintf(r->bandwidth_probe, sizeof r->bandwidth_probe, "streaming read of %zu MiB, %d threads", bytes >> 20,
                     o->threads);
        else
            snprintf(r->bandwidth_probe, sizeof r->bandwidth_probe, "streaming read of %zu MiB, all CPU threads", bytes >> 20);
    }
    progress(o, what, 1.0);
    if (r->bandwidth_Bps <= 0) return fm_error(FM_E_RANGE, "bandwidth probe failed: %s", fm_last_error());
    return FM_OK;
}

static fm_status upload_ep_rank(bench_run *b, const fm_moe_layer *full, int p, fm_cuda_layer **out) {
    fm_model_desc dv;
    fm_moe_layer lv;
    const fm_shard sp = {FM_DIST_EP, b->r->shard.ranks, p};
    fm_shard_ep_view(&b->r->full_desc, full, &sp, b->zero_router, &dv, &lv);
    return fm_cuda_layer_upload(b->ge, &dv, &lv, out);
}

/* Slot `have` of a shard: the rank's share of the li-th MoE layer (preset)
 * or of the next MoE layer from *layer present in the checkpoint. CUDA
 * presets are generated as the share alone; otherwise the full layer is
 * built or bound and the share is a view of it (uploaded on a GPU). */
static fm_status build_shard_layer(bench_run *b, int li, int *layer, int have) {
    const fm_bench_opts *o = b->o;
    fm_bench_report *r = b->r;
    const fm_model_desc *fd = &r->full_desc;
    const fm_shard *sh = &r->shard;
    const int cuda = o->device == FM_DEV_CUDA;
    int L;
    if (o->model_dir) {
        while (*layer < fd->n_layers && !fm_model_is_moe_layer(fd, *layer)) (*layer)++;
        if (*layer >= fd->n_layers) return FM_E_NOTFOUND;
        L = (*layer)++;
    } else {
        L = nth_moe_layer(fd, li);
    }
    const int ep = sh->mode == FM_DIST_EP;
    if (cuda && !o->model_dir) {
        fm_status st = fm_cuda_layer_random_shard(b->ge, fd, r->fmt, o->seed, L, sh, &b->gl[have]);
        if (!st && ep) st = fm_io_router_random(fd, r->fmt, o->seed, L, &b->router[have]);
        return st;
    }
    fm_moe_layer *full = NULL;
    fm_status st = o->model_dir ? fm_moe_layer_bind(b->ck, fd, L, FM_QF_NONE, &full)
                                : fm_moe_layer_random(fd, r->fmt, o->seed, L, &full);
    if (st) return st;
    if (ep) { /* host views are made per timing; a GPU gets the rank's experts */
        b->full[have] = full;
        b->router[have] = full;
        return cuda ? upload_ep_rank(b, full, sh->rank, &b->gl[have]) : FM_OK;
    }
    fm_model_desc dv;
    fm_moe_layer *v = &b->views[have];
    st = fm_dist_tp_view(fd, full, sh->rank, sh->ranks, &dv, v, &b->arrays[have]);
    if (!st && cuda) st = fm_cuda_layer_upload(b->ge, &r->desc, v, &b->gl[have]);
    if (st || cuda) { /* a GPU holds its copy; the host layer is not needed */
        free(b->arrays[have]);
        b->arrays[have] = NULL;
        fm_moe_layer_free(full);
        return st;
    }
    b->full[have] = full;
    b->hl[have] = v;
    return FM_OK;
}

/* Layers: seeded random (preset) or the MoE layers present (model). */
static fm_status build_layers(bench_run *b) {
    const fm_bench_opts *o = b->o;
    fm_bench_report *r = b->r;
    const fm_model_desc *d = &r->desc, *fd = &r->full_desc;
    const int cuda = o->device == FM_DEV_CUDA, want = r->layers_wanted;
    fm_status st = o->model_dir ? fm_ckpt_open(o->model_dir, &b->ck) : FM_OK;
    int have = 0;
    for (int li = 0, layer = 0; !st && have < want; li++) {
        char what[64];
        snprintf(what, sizeof what, "building layer %d/%d", have + 1, want);
        progress(o, what, (double)have / want);
        if (r->shard.mode) {
            st = build_shard_layer(b, li, &layer, have);
            if (st == FM_E_NOTFOUND && have > 0 && layer < fd->n_layers) { st = FM_OK; continue; }
            if (st == FM_E_NOTFOUND && have > 0) { st = FM_OK; break; }
        } else if (o->model_dir) {
            while (layer < d->n_layers && !fm_model_is_moe_layer(d, layer)) layer++;
            if (layer >= d->n_layers) break;
            st = fm_moe_layer_bind(b->ck, d, layer, FM_QF_NONE, &b->hl[have]);
            if (st == FM_E_NOTFOUND && have > 0) { st = FM_OK; layer++; continue; } /* layer not in this checkpoint */
            if (!st && cuda) st = fm_cuda_layer_upload(b->ge, d, b->hl[have], &b->gl[have]);
            layer++;
        } else {
            int layer_i = nth_moe_layer(d, li);
            st = cuda ? fm_cuda_layer_random(b->ge, d, r->fmt, o->seed, layer_i, &b->gl[have])
                      : fm_moe_layer_random(d, r->fmt, o->seed, layer_i, &b->hl[have]);
        }
        if (!st) have++;
    }
    progress(o, "building layers", 1.0);
    if (st) return st;
    if (have == 0) return fm_error(FM_E_NOTFOUND, "%s holds no MoE layer", o->model_dir);
    r->layers = have;
    return FM_OK;
}

/* Provenance first: which kernel and config each batch will use, and from
 * which tuned file -- or a loud WARNING when none matches. */
static fm_status decide(bench_run *b) {
    fm_bench_report *r = b->r;
    fm_tune_key key;
    if (b->ge) {
        fm_status st = fm_cuda_engine_key(b->ge, &r->desc, r->fmt, &key);
        if (st) return st;
    }
    for (int i = 0; i < b->o->n_batches; i++) {
        fm_bench_row *row = &r->rows[i];
        row->T = b->o->batches[i];
        if (b->ge) {
            fm_tune_choice ch;
            fm_status st = fm_tune_choose(&key, row->T, &ch);
            if (st) return st;
            fm_tune_provenance_line(&key, row->T, &ch, row->decision, sizeof row->decision);
        } else {
            snprintf(row->decision, sizeof row->decision,
                     "provenance: backend=cpu batch=%d kernel=%s (ISA chosen at run time; the CPU path has no tuned configs)",
                     row->T, r->device_desc);
        }
    }
    return FM_OK;
}

/* A row from the device's median and spread; the throughput from them. */
static void set_row(fm_bench_row *row, double us, double us_min, double us_max, double active, int64_t bytes,
                    const char *kernel) {
    row->us_per_layer = us;
    row->us_min = us_min;
    row->us_max = us_max;
    row->tokens_per_s = row->T / (us * 1e-6);
    row->active_experts = active;
    row->bytes_per_layer = bytes;
    row->gbps = (double)bytes / (us * 1e-6) * 1e-9;
    snprintf(row->kernel, sizeof row->kernel, "%s", kernel);
}

static fm_status measure_row(bench_run *b, fm_bench_row *row) {
    const fm_bench_opts *o = b->o;
    const fm_model_desc *d = &b->r->desc;
    const int T = row->T;
    char what[64];
    snprintf(what, sizeof what, "batch %d: timing", T);
    progress(o, what, 0.0);
    fm_status st;
    if (b->ge) {
        fm_cuda_bench_result cr;
        st = fm_cuda_bench(b->ge, d, b->gl, b->r->layers, T, o->seed, 50, &cr);
        if (!st) {
            set_row(row, cr.us_per_layer, cr.us_min, cr.us_max, cr.active_experts, cr.bytes_per_layer, cr.kernel);
            snprintf(row->provenance, sizeof row->provenance,
                     "kernel %s, path %s, rows_per_block %d, k_split %d, warps %d, stages %d, tile_n %d, "
                     "switch_tpe %.2f; config from %s",
                     cr.kernel, fm_kernel_path_name(cr.cfg.path), cr.cfg.rows_per_block, cr.cfg.k_split, cr.cfg.warps,
                     cr.cfg.stages, cr.cfg.tile_n, (double)cr.cfg.switch_tpe, cr.config_source);
        }
    } else {
        fm_cpu_bench_result cr;
        batch_progress bp = {o, T};
        st = fm_cpu_bench(b->ce, d, b->hl, b->r->layers, T, o->seed, o->min_seconds, cpu_progress, &bp, &cr);
        if (!st) set_row(row, cr.us_per_layer, cr.us_min, cr.us_max, cr.active_experts, cr.bytes_per_layer, cr.kernel);
    }
    progress(o, what, 1.0);
    if (!st) row->pct_bandwidth = 100.0 * row->gbps * 1e9 / b->r->bandwidth_Bps;
    return st;
}

/* ------------------------------------------------------ an EP rank */

/* Rank p's step over the layers (pre-routed: ids / w [n][T][k] of the full
 * routing): median, min and max us per layer. */
static fm_status time_ep_rank(bench_run *b, int p, int T, const float *x, const int32_t *ids, const float *w,
                              double *med, double *mn, double *mx) {
    const fm_bench_opts *o = b->o;
    const fm_bench_report *r = b->r;
    const int n = r->layers, E = r->full_desc.n_experts, k = r->full_desc.topk, kl = r->desc.topk, H = r->desc.hidden;
    const fm_shard sp = {FM_DIST_EP, r->shard.ranks, p};
    int t0, nc;
    fm_shard_token_chunk(&sp, T, &t0, &nc);
    int32_t *lids = fm_calloc((size_t)n * T * kl, sizeof(int32_t));
    float *lw = fm_calloc((size_t)n * T * kl, sizeof(float)), *out = fm_calloc((size_t)T * H, sizeof(float));
    double *pass = fm_calloc(4096, sizeof(double));
    fm_shard_ep_work wk;
    memset(&wk, 0, sizeof wk);
    fm_status st = FM_OK;
    if (!lids || !lw || !out || !pass) st = FM_E_NOMEM;
    for (int i = 0; !st && i < n; i++)
        fm_shard_local_ids(&sp, E, k, T, ids + (size_t)i * T * k, w + (size_t)i * T * k, kl,
                           lids + (size_t)i * T * kl, lw + (size_t)i * T * kl);
    if (!st && b->ge) {
        fm_cuda_layer *const *gl = p == r->shard.rank ? b->gl : b->gmax;
        st = fm_cuda_bench_ep_rank(b->ge, gl, n, T, x, lids, lw, t0, nc, 50, med, mn, mx);
    } else if (!st && !(st = fm_shard_ep_work_init(&wk, &r->full_desc, &sp, T))) {
        /* passes over the layers for min_seconds (at least 3, at most 4096) */
        int np = 0;
        const uint64_t t_start = fm_now_ns();
        while (!st && np < 4096 && (np < 3 || (double)(fm_now_ns() - t_start) * 1e-9 < o->min_seconds)) {
            const uint64_t t1 = fm_now_ns();
            for (int i = 0; !st && i < n; i++)
                st = fm_shard_ep_run_cpu(b->ce, &r->full_desc, b->full[i], &sp, x, T, lids + (size_t)i * T * kl,
                                         lw + (size_t)i * T * kl, &wk, out);
            pass[np++] = (double)(fm_now_ns() - t1) * 1e-3 / n;
        }
        if (!st) {
            *mn = *mx = pass[0];
            for (int i = 0; i < np; i++) {
                if (pass[i] < *mn) *mn = pass[i];
                if (pass[i] > *mx) *mx = pass[i];
            }
            *med = fm_dist_median(pass, np);
        }
    }
    fm_shard_ep_work_free(&wk);
    free(lids);
    free(lw);
    free(out);
    free(pass);
    return st;
}

/* One batch size of an EP rank: the full routing of seeded activations
 * over every layer cycled, the load it puts on each rank, this rank's time
 * and, when another rank is more loaded, that rank's. */
static fm_status measure_row_ep(bench_run *b, int ri) {
    const fm_bench_opts *o = b->o;
    fm_bench_report *r = b->r;
    fm_bench_row *row = &r->rows[ri];
    const fm_model_desc *fd = &r->full_desc;
    const int T = row->T, n = r->layers, H = fd->hidden, k = fd->topk, R = r->shard.ranks;
    float *x = fm_calloc((size_t)T * H, sizeof(float)), *w = fm_calloc((size_t)n * T * k, sizeof(float));
    int32_t *ids = fm_calloc((size_t)n * T * k, sizeof(int32_t)), *tid = fm_calloc((size_t)T, sizeof(int32_t));
    fm_status st = FM_OK;
    if (!x || !w || !ids || !tid) st = FM_E_NOMEM;
    const uint64_t kx = fm_hash_str("bench.x"), kt = fm_hash_str("bench.token_ids");
    for (int64_t i = 0; !st && i < (int64_t)T * H; i++) x[i] = fm_rng_normal(o->seed, kx, (uint64_t)i);
    for (int t = 0; !st && t < T; t++)
        tid[t] = fd->vocab_size > 0 ? (int32_t)(fm_rng_u64(o->seed, kt, (uint64_t)t) % (uint64_t)fd->vocab_size) : 0;
    fm_shard_load *sum = &r->shard_load[ri];
    memset(sum, 0, sizeof *sum);
    for (int i = 0; !st && i < n; i++) {
        fm_shard_load ld;
        st = fm_route(fd, b->router[i], x, T, tid, ids + (size_t)i * T * k, w + (size_t)i * T * k);
        if (!st) st = fm_shard_load_of(fd, r->fmt, &r->shard, ids + (size_t)i * T * k, T, &ld);
        if (!st) fm_shard_load_add(sum, &ld);
    }
    char what[64];
    snprintf(what, sizeof what, "batch %d: timing", T);
    progress(o, what, 0.0);
    double med = 0, mn = 0, mx = 0;
    const int me = r->shard.rank;
    if (!st) st = time_ep_rank(b, me, T, x, ids, w, &med, &mn, &mx);
    r->shard_max_us[ri] = -1;
    if (!st && sum->max_rank != me) {
        const int m = sum->max_rank;
        if (b->ge && b->gmax_rank != m) { /* the most loaded rank's experts on this GPU */
            for (int i = 0; i < n; i++) {
                fm_cuda_layer_free(b->gmax[i]);
                b->gmax[i] = NULL;
            }
            b->gmax_rank = -1;
            const fm_shard sm = {FM_DIST_EP, R, m};
            for (int i = 0; !st && i < n; i++)
                st = b->full[i] ? upload_ep_rank(b, b->full[i], m, &b->gmax[i])
                                : fm_cuda_layer_random_shard(b->ge, fd, r->fmt, o->seed, b->router[i]->layer, &sm,
                                                             &b->gmax[i]);
            if (!st) b->gmax_rank = m;
        }
        double a, c;
        if (!st) st = time_ep_rank(b, m, T, x, ids, w, &r->shard_max_us[ri], &a, &c);
    }
    progress(o, what, 1.0);
    if (!st) {
        char kern[640];
        snprintf(kern, sizeof kern, "%s pre-routed experts (%s) on the rank's pairs, shared expert on its token chunk",
                 b->ge ? "cuda" : "cpu", b->ge ? "fm_cuda_experts" : "fm_cpu_experts");
        set_row(row, med, mn, mx, (double)sum->active[me] / n, sum->bytes[me] / n, kern);
        row->pct_bandwidth = 100.0 * row->gbps * 1e9 / r->bandwidth_Bps;
    }
    free(x);
    free(w);
    free(ids);
    free(tid);
    return st;
}

static fm_status bench_device(bench_run *b) {
    const fm_bench_opts *o = b->o;
    fm_bench_report *r = b->r;
    fm_status st;
    if (o->device == FM_DEV_CUDA) {
        st = fm_cuda_engine_new(0, &b->ge);
        if (st) return st;
        fm_cuda_engine_set_sustain(b->ge, o->sustain_ms);
        if (o->act != FM_DT_INVALID && (st = fm_cuda_engine_set_bench_act(b->ge, o->act))) return st;
        snprintf(r->device_desc, sizeof r->device_desc, "%s", fm_cuda_engine_describe(b->ge));
    } else {
        st = fm_cpu_engine_new(o->isa, o->threads, &b->ce);
        if (st) return st;
        snprintf(r->device_desc, sizeof r->device_desc, "%s", fm_cpu_engine_describe(b->ce));
    }
    if ((st = measure_bandwidth(b)) || (st = build_layers(b)) || (st = decide(b))) return st;
    emit(o, r, -1);
    for (int i = 0; i < o->n_batches; i++) {
        if ((st = r->shard.mode == FM_DIST_EP ? measure_row_ep(b, i) : measure_row(b, &r->rows[i]))) return st;
        r->n_rows = i + 1;
        emit(o, r, i);
    }
    return FM_OK;
}

/* ------------------------------------------------------ sharded */

static fm_status bench_sharded(const fm_bench_opts *o, fm_bench_report *r) {
    const fm_model_desc *d = &r->desc;
    fm_moe_layer *l = NULL;
    fm_cpu_engine *ce = NULL;
    fm_ckpt *ck = NULL;
    fm_comm *c = NULL;
    fm_dist *ds = NULL;
    int first = nth_moe_layer(d, 0);
    fm_status st;
    if (o->model_dir) {
        st = fm_ckpt_open(o->model_dir, &ck);
        if (!st) st = fm_moe_layer_bind(ck, d, first, FM_QF_NONE, &l);
    } else {
        st = fm_moe_layer_random(d, r->fmt, o->seed, first, &l);
    }
    if (!st && o->device == FM_DEV_CPU) {
        st = fm_cpu_engine_new(o->isa, o->threads, &ce);
        if (!st) snprintf(r->device_desc, sizeof r->device_desc, "%s", fm_cpu_engine_describe(ce));
    }
    if (!st) st = fm_dist_open(o->dist, o->device, o->dist_mpi, ce, d, l, &c, &ds);
    if (!st) {
        snprintf(r->dist_desc, sizeof r->dist_desc, "%s", fm_dist_describe(ds));
        emit(o, r, -1);
    }
    for (int i = 0; !st && i < o->n_batches; i++) {
        st = fm_dist_bench(ds, o->batches[i], o->seed, DIST_REPS, &r->dist_rows[i]);
        if (st) break;
        r->rows[i].T = o->batches[i];
        r->n_rows = i + 1;
        emit(o, r, i);
    }
    fm_dist_free(ds);
    fm_comm_free(c);
    fm_cpu_engine_free(ce);
    fm_moe_layer_free(l);
    fm_ckpt_close(ck);
    return st;
}

fm_status fm_bench_run(const fm_bench_opts *o, fm_bench_report *r) {
    if (!o || !r) return fm_error(FM_E_ARG, "fm_bench_run: NULL argument");
    memset(r, 0, sizeof *r);
    fm_status st = check_opts(o);
    if (st) return st;
    st = o->model_dir ? fm_model_desc_load(o->model_dir, &r->desc) : fm_preset_desc(o->preset, o->fmt, &r->desc);
    if (st) return st;
    r->fmt = o->fmt != FM_QF_NONE ? o->fmt : r->desc.expert_format;
    r->full_desc = r->desc;
    if (o->shard && o->shard->mode) {
        r->shard = *o->shard;
        if ((st = fm_shard_desc(&r->full_desc, r->fmt, &r->shard, &r->desc))) return st;
        fm_shard_describe(&r->shard, &r->full_desc, r->shard_desc, sizeof r->shard_desc);
    }
    snprintf(r->source, sizeof r->source, "%s %s", o->model_dir ? "model" : "preset", o->model_dir ? o->model_dir : o->preset);
    r->device = o->device;
    r->n_batches = o->n_batches;
    r->sustain_ms = o->sustain_ms;
    r->act = o->act == FM_DT_INVALID ? FM_DT_F32 : o->act;
    /* a host shard keeps its full layers: as many as the full model allows */
    const int host_full = r->shard.mode && (o->device == FM_DEV_CPU || o->model_dir);
    r->layers_wanted = o->layers ? o->layers : fm_cpu_bench_default_layers(host_full ? &r->full_desc : &r->desc, r->fmt);
    if (r->layers_wanted > FM_BENCH_MAX_LAYERS) r->layers_wanted = FM_BENCH_MAX_LAYERS;
    if (o->dist) return bench_sharded(o, r);

    bench_run b;
    memset(&b, 0, sizeof b);
    b.o = o;
    b.r = r;
    b.gmax_rank = -1;
    if (r->shard.mode == FM_DIST_EP && !(b.zero_router = fm_calloc((size_t)r->desc.n_experts * r->desc.hidden, sizeof(float))))
        return FM_E_NOMEM;
    st = bench_device(&b);
    for (int i = 0; i < FM_BENCH_MAX_LAYERS; i++) {
        if (b.gl[i]) fm_cuda_layer_free(b.gl[i]);
        if (b.gmax[i]) fm_cuda_layer_free(b.gmax[i]);
        if (b.router[i] != b.full[i]) fm_moe_layer_free(b.router[i]);
        if (b.full[i]) { /* a shard's view: the full layer owns the weights */
            fm_moe_layer_free(b.full[i]);
            free(b.arrays[i]);
        } else {
            fm_moe_layer_free(b.hl[i]);
        }
    }
    free(b.zero_router);
    fm_ckpt_close(b.ck);
    fm_cpu_engine_free(b.ce);
    if (b.ge) fm_cuda_engine_free(b.ge);
    return st;
}
