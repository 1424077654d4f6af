/*
 * Timing of the sharded layer against the unsharded one.
 *
 * A step's time is that of its slowest rank plus the time inside
 * collectives, i.e. compute and communication are not overlapped. Under the
 * simulated transport the ranks run one after another in one process, so
 * each rank's compute is timed alone and the step time is what R parallel
 * ranks would take; the communication time of the simulation is that of
 * memory copies and says nothing about a network.
 */
#include "parallel/parallel_internal.h"
#include "util/util.h"
#include <stdio.h>
#include <string.h>

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
double fm_dist_median(double *v, int n) {
    if (n < 1) return 0;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Every process learns every rank's time (one double per rank). */
static fm_status gather_rank_times(fm_dist *ds, fm_dist_bench_result *r) {
    const int nl = ds->nloc, R = ds->R;
    double *snd = fm_calloc((size_t)nl, sizeof(double)), *rcv = fm_calloc((size_t)nl * R, sizeof(double));
    const void **sp = fm_calloc((size_t)nl, sizeof(void *));
    void **rp = fm_calloc((size_t)nl, sizeof(void *));
    fm_status s = FM_E_NOMEM;
    if (snd && rcv && sp && rp) {
        for (int i = 0; i < nl; i++) {
            snd[i] = r->us_rank[ds->rs[i].rank];
            sp[i] = &snd[i];
            rp[i] = rcv + (size_t)i * R;
        }
        s = fm_comm_all_gather(ds->c, sp, rp, sizeof(double));
        if (!s)
            for (int p = 0; p < R; p++) r->us_rank[p] = rcv[p];
    }
    free(snd);
    free(rcv);
    free(sp);
    free(rp);
    return s;
}

/*
 * TP with replicated tokens on an engine and transport that can time
 * themselves on the device: each rank's slice by the engine's own benchmark
 * (CUDA-graph replay), the all-reduce on device buffers, the unsharded
 * layer likewise. No host staging enters these figures.
 */
static fm_status bench_device(fm_dist *ds, int T, uint64_t seed, int reps, fm_dist_bench_result *r) {
    fm_status s;
    for (int i = 0; i < ds->nloc; i++) {
        rank_state *rs = &ds->rs[i];
        if ((s = ds->ex.bench(ds->ex.ctx, i, rs->htp, &rs->dtp, &rs->ltp, T, seed, reps, &r->us_rank[rs->rank])))
            return s;
    }
    if ((s = gather_rank_times(ds, r))) return s;
    const size_t count = (size_t)T * (size_t)ds->l->hidden;
    if ((s = ds->c->ops->time_all_reduce(ds->c, count, reps, &r->us_comm))) return s;
    if (!ds->hfull_ready) {
        if ((s = ds->ex.prepare(ds->ex.ctx, 0, ds->d, ds->l, &ds->hfull))) return s;
        ds->hfull_ready = 1;
    }
    if ((s = ds->ex.bench(ds->ex.ctx, 0, ds->hfull, ds->d, ds->l, T, seed, reps, &r->us_single))) return s;
    double mx = 0;
    for (int p = 0; p < ds->R; p++)
        if (r->us_rank[p] > mx) mx = r->us_rank[p];
    r->us_total = mx + r->us_comm;
    r->load_imbalance = 1.0;
    r->comm_bytes = (int64_t)(count * sizeof(float));
    snprintf(r->method, sizeof r->method,
             "device: each rank's slice by engine replay, all-reduce on device buffers, not overlapped");
    return FM_OK;
}

fm_status fm_dist_bench(fm_dist *ds, int T, uint64_t seed, int reps, fm_dist_bench_result *r) {
    if (!ds || !r) return fm_error(FM_E_ARG, "dist bench: layer and result are required");
    if (T < 1 || reps < 1 || reps > 100000)
        return fm_error(FM_E_RANGE, "dist bench: T=%d reps=%d (need T >= 1, 1 <= reps <= 100000)", T, reps);
    const fm_moe_layer *l = ds->l;
    const int H = l->hidden, R = ds->R;
    memset(r, 0, sizeof *r);
    r->T = T;
    r->ranks = R;
    r->reps = reps;
    snprintf(r->transport, sizeof r->transport, "%s", fm_comm_describe(ds->c));

    if (ds->o.mode == FM_DIST_TP && ds->o.layout == FM_DIST_REPLICATED && ds->ex.bench && ds->ex.prepare &&
        ds->c->ops->time_all_reduce) {
        fm_status s = bench_device(ds, T, seed, reps, r);
        if (!s) {
            r->speedup = r->us_total > 0 ? r->us_single / r->us_total : 0;
            r->efficiency = r->speedup / R;
        }
        return s;
    }
    snprintf(r->method, sizeof r->method, "%s",
             ds->ex.bench ? "host-staged engine calls per rank (host buffers in and out); collectives staged"
                          : "engine calls per rank, ranks timed one after another; collectives timed as run");

    fm_status s = FM_OK;
    float *x = NULL, *out = NULL;
    int32_t *tid = NULL;
    double *tot = NULL, *comm = NULL, *single = NULL, *rank_t = NULL;
    uint64_t n;
    if (!fm_mul_ok((uint64_t)T, (uint64_t)H, &n) || n > (1ull << 32)) {
        return fm_error(FM_E_RANGE, "dist bench: T=%d x H=%d is too large", T, H);
    }
    x = fm_malloc(n * sizeof(float));
    out = fm_calloc(n, sizeof(float));
    tot = fm_calloc((size_t)reps, sizeof(double));
    comm = fm_calloc((size_t)reps, sizeof(double));
    single = fm_calloc((size_t)reps, sizeof(double));
    rank_t = fm_calloc((size_t)reps * (size_t)R, sizeof(double));
    if (!x || !out || !tot || !comm || !single || !rank_t) {
        s = FM_E_NOMEM;
        goto done;
    }
    const uint64_t key = fm_hash_str("dist.bench.x");
    for (uint64_t i = 0; i < n; i++) x[i] = fm_rng_normal(seed, key, i);
    if (l->tid2eid && l->tid2eid_rows > 0) {
        tid = fm_malloc((size_t)T * sizeof(int32_t));
        if (!tid) {
            s = FM_E_NOMEM;
            goto done;
        }
        for (int t = 0; t < T; t++)
            tid[t] = (int32_t)(fm_rng_u64(seed, fm_hash_str("dist.bench.tid"), (uint64_t)t) % (uint64_t)l->tid2eid_rows);
    }
    fm_moe_out o = {.out = out};
    fm_dist_stats st;
    /* one untimed step each: first-touch of buffers, lazy uploads */
    if ((s = fm_dist_forward(ds, x, FM_DT_F32, T, tid, &o, &st))) goto done;
    if ((s = fm_dist_forward_single(ds, x, FM_DT_F32, T, tid, &o))) goto done;
    double imb = 0;
    for (int it = 0; it < reps; it++) {
        if ((s = fm_dist_forward(ds, x, FM_DT_F32, T, tid, &o, &st))) goto done;
        double mx = 0;
        for (int p = 0; p < R; p++) {
            rank_t[(size_t)p * reps + it] = st.compute_ns[p];
            if (st.compute_ns[p] > mx) mx = st.compute_ns[p];
        }
        tot[it] = mx + st.comm_ns;
        comm[it] = st.comm_ns;
        imb += st.load_imbalance;
        r->comm_bytes = st.comm_bytes;
    }
    for (int it = 0; it < reps; it++) {
        uint64_t t0 = fm_now_ns();
        if ((s = fm_dist_forward_single(ds, x, FM_DT_F32, T, tid, &o))) goto done;
        single[it] = (double)(fm_now_ns() - t0);
    }
    r->us_total = fm_dist_median(tot, reps) / 1e3;
    r->us_comm = fm_dist_median(comm, reps) / 1e3;
    r->us_single = fm_dist_median(single, reps) / 1e3;
    for (int p = 0; p < R; p++) r->us_rank[p] = fm_dist_median(rank_t + (size_t)p * reps, reps) / 1e3;
    if ((s = gather_rank_times(ds, r))) goto done;
    r->load_imbalance = imb / reps;
    r->speedup = r->us_total > 0 ? r->us_single / r->us_total : 0;
    r->efficiency = r->speedup / R;
done:
    free(x);
    free(out);
    free(tid);
    free(tot);
    free(comm);
    free(single);
    free(rank_t);
    return s;
}
