/*
 * fm_comm: the collectives the sharded MoE layer needs, and the simulated
 * transport that runs R ranks in one process.
 *
 * Every collective takes one buffer per local rank, so the same caller code
 * drives a simulation (all R ranks local), one process with N GPUs (all local,
 * NCCL group calls) and one process per GPU (one local rank, MPI + NCCL).
 */
#include "parallel/parallel_internal.h"
#include "util/util.h"
#include <stdio.h>
#include <string.h>

fm_status fm_comm_alloc(const fm_comm_ops *ops, int size, int first, int n_local, fm_comm **out) {
    *out = NULL;
    if (size < 1 || size > FM_DIST_MAX_RANKS)
        return fm_error(FM_E_RANGE, "communicator: %d ranks (allowed 1..%d)", size, FM_DIST_MAX_RANKS);
    if (n_local < 1 || first < 0 || first + n_local > size)
        return fm_error(FM_E_RANGE, "communicator: local ranks %d..%d outside 0..%d", first, first + n_local - 1,
                        size - 1);
    fm_comm *c = fm_calloc(1, sizeof *c);
    if (!c) return FM_E_NOMEM;
    c->local_rank = fm_calloc((size_t)n_local, sizeof(int));
    c->device = fm_calloc((size_t)n_local, sizeof(int));
    if (!c->local_rank || !c->device) {
        free(c->local_rank);
        free(c->device);
        free(c);
        return FM_E_NOMEM;
    }
    c->ops = ops;
    c->size = size;
    c->n_local = n_local;
    for (int i = 0; i < n_local; i++) {
        c->local_rank[i] = first + i;
        c->device[i] = -1;
    }
    *out = c;
    return FM_OK;
}

void fm_comm_free(fm_comm *c) {
    if (!c) return;
    if (c->ops && c->ops->destroy) c->ops->destroy(c);
    free(c->local_rank);
    free(c->device);
    free(c);
}

int fm_comm_size(const fm_comm *c) { return c ? c->size : 0; }
int fm_comm_local_count(const fm_comm *c) { return c ? c->n_local : 0; }
int fm_comm_local_rank(const fm_comm *c, int i) { return (c && i >= 0 && i < c->n_local) ? c->local_rank[i] : -1; }
int fm_comm_device(const fm_comm *c, int i) { return (c && i >= 0 && i < c->n_local) ? c->device[i] : -1; }
const char *fm_comm_describe(const fm_comm *c) { return c ? c->desc : "(none)"; }

void fm_comm_get_stats(const fm_comm *c, fm_comm_stats *s) {
    if (c && s) *s = c->stats;
}
void fm_comm_reset_stats(fm_comm *c) {
    if (c) memset(&c->stats, 0, sizeof c->stats);
}

static fm_status check_bufs(const fm_comm *c, const void *arr, const char *what) {
    if (!c) return fm_error(FM_E_ARG, "collective: no communicator");
    if (!arr) return fm_error(FM_E_ARG, "collective: %s is NULL", what);
    return FM_OK;
}

#define TIMED(c, nbytes, call)                                                                                        \
    do {                                                                                                             \
        uint64_t t0_ = fm_now_ns();                                                                                  \
        fm_status s_ = (call);                                                                                       \
        (c)->stats.ns += (double)(fm_now_ns() - t0_);                                                                \
        (c)->stats.bytes += (int64_t)(nbytes);                                                                       \
        (c)->stats.calls++;                                                                                          \
        return s_;                                                                                                   \
    } while (0)

fm_status fm_comm_all_reduce_sum(fm_comm *c, float *const *buf, size_t count) {
    fm_status s = check_bufs(c, buf, "buffer array");
    if (s) return s;
    for (int i = 0; i < c->n_local; i++)
        if (!buf[i] && count) return fm_error(FM_E_ARG, "all_reduce: buffer of local rank %d is NULL", i);
    TIMED(c, count * sizeof(float), c->ops->all_reduce_sum(c, buf, count));
}

fm_status fm_comm_reduce_scatter_sum(fm_comm *c, const float *const *send, float *const *recv, size_t count) {
    fm_status s = check_bufs(c, send, "send array");
    if (!s) s = check_bufs(c, recv, "recv array");
    if (s) return s;
    uint64_t total;
    if (!fm_mul_ok(count, (uint64_t)c->size * sizeof(float), &total))
        return fm_error(FM_E_RANGE, "reduce_scatter: %zu floats x %d ranks overflows", count, c->size);
    TIMED(c, total, c->ops->reduce_scatter_sum(c, send, recv, count));
}

fm_status fm_comm_all_gather(fm_comm *c, const void *const *send, void *const *recv, size_t bytes) {
    fm_status s = check_bufs(c, send, "send array");
    if (!s) s = check_bufs(c, recv, "recv array");
    if (s) return s;
    uint64_t total;
    if (!fm_mul_ok(bytes, (uint64_t)c->size, &total))
        return fm_error(FM_E_RANGE, "all_gather: %zu bytes x %d ranks overflows", bytes, c->size);
    TIMED(c, bytes, c->ops->all_gather(c, send, recv, bytes));
}

fm_status fm_comm_all_to_allv(fm_comm *c, const void *const *send, const size_t *const *send_bytes,
                              void *const *recv, const size_t *const *recv_bytes) {
    fm_status s = check_bufs(c, send, "send array");
    if (!s) s = check_bufs(c, recv, "recv array");
    if (!s) s = check_bufs(c, send_bytes, "send_bytes array");
    if (!s) s = check_bufs(c, recv_bytes, "recv_bytes array");
    if (s) return s;
    uint64_t sent = 0;
    for (int i = 0; i < c->n_local; i++) {
        if (!send_bytes[i] || !recv_bytes[i])
            return fm_error(FM_E_ARG, "all_to_allv: byte counts of local rank %d are NULL", i);
        uint64_t si = 0;
        for (int p = 0; p < c->size; p++)
            if (!fm_add_ok(si, send_bytes[i][p], &si))
                return fm_error(FM_E_RANGE, "all_to_allv: byte counts of local rank %d overflow", i);
        if (i == 0) sent = si;
    }
    TIMED(c, sent, c->ops->all_to_allv(c, send, send_bytes, recv, recv_bytes));
}

/* ------------------------------------------------------------ simulated */

/* All R ranks are local; a collective is a loop over their buffers. The
 * reductions add rank 0, 1, ..., R-1 in that order into a scratch buffer, so
 * every rank receives bit-identical sums (as NCCL guarantees). */
typedef struct {
    float *scratch;
    size_t cap;
} sim_state;

static fm_status sim_scratch(fm_comm *c, size_t count) {
    sim_state *st = c->impl;
    if (count <= st->cap) return FM_OK;
    float *p = realloc(st->scratch, count * sizeof(float));
    if (!p) return fm_error(FM_E_NOMEM, "simulated all-reduce: %zu floats", count);
    st->scratch = p;
    st->cap = count;
    return FM_OK;
}

static fm_status sim_all_reduce(fm_comm *c, float *const *buf, size_t count) {
    if (c->size == 1 || count == 0) return FM_OK;
    fm_status s = sim_scratch(c, count);
    if (s) return s;
    float *acc = ((sim_state *)c->impl)->scratch;
    memcpy(acc, buf[0], count * sizeof(float));
    for (int r = 1; r < c->size; r++)
        for (size_t j = 0; j < count; j++) acc[j] += buf[r][j];
    for (int r = 0; r < c->size; r++) memcpy(buf[r], acc, count * sizeof(float));
    return FM_OK;
}

static fm_status sim_reduce_scatter(fm_comm *c, const float *const *send, float *const *recv, size_t count) {
    for (int r = 0; r < c->size; r++) {
        float *dst = recv[r];
        const size_t off = (size_t)r * count;
        if (count) memcpy(dst, send[0] + off, count * sizeof(float));
        for (int q = 1; q < c->size; q++)
            for (size_t j = 0; j < count; j++) dst[j] += send[q][off + j];
    }
    return FM_OK;
}

static fm_status sim_all_gather(fm_comm *c, const void *const *send, void *const *recv, size_t bytes) {
    if (!bytes) return FM_OK;
    for (int r = 0; r < c->size; r++)
        for (int q = 0; q < c->size; q++) memcpy((uint8_t *)recv[r] + (size_t)q * bytes, send[q], bytes);
    return FM_OK;
}

static fm_status sim_all_to_allv(fm_comm *c, const void *const *send, const size_t *const *send_bytes,
                                 void *const *recv, const size_t *const *recv_bytes) {
    const int R = c->size;
    for (int dst = 0; dst < R; dst++) {
        size_t roff = 0;
        for (int src = 0; src < R; src++) {
            size_t soff = 0;
            for (int p = 0; p < dst; p++) soff += send_bytes[src][p];
            const size_t n = send_bytes[src][dst];
            if (n != recv_bytes[dst][src])
                return fm_error(FM_E_ARG, "all_to_allv: rank %d sends %zu bytes to rank %d, which expects %zu", src,
                                n, dst, recv_bytes[dst][src]);
            if (n) memcpy((uint8_t *)recv[dst] + roff, (const uint8_t *)send[src] + soff, n);
            roff += recv_bytes[dst][src];
        }
    }
    return FM_OK;
}

/* The simulated all-reduce on scratch buffers, for bench's device path. */
static fm_status sim_time_all_reduce(fm_comm *c, size_t count, int reps, double *us) {
    const int R = c->size;
    float **b = fm_calloc((size_t)R, sizeof *b);
    double *t = fm_calloc((size_t)reps, sizeof *t);
    fm_status s = (b && t) ? FM_OK : FM_E_NOMEM;
    for (int r = 0; r < R && !s; r++)
        if (!(b[r] = fm_calloc(count ? count : 1, sizeof(float)))) s = FM_E_NOMEM;
    for (int it = 0; it < reps && !s; it++) {
        uint64_t t0 = fm_now_ns();
        s = sim_all_reduce(c, b, count);
        t[it] = (double)(fm_now_ns() - t0) / 1e3;
    }
    if (!s) *us = fm_dist_median(t, reps);
    if (b)
        for (int r = 0; r < R; r++) free(b[r]);
    free(b);
    free(t);
    return s;
}

static void sim_destroy(fm_comm *c) {
    sim_state *st = c->impl;
    if (st) free(st->scratch);
    free(st);
    c->impl = NULL;
}

static const fm_comm_ops sim_ops = {
    .name = "sim",
    .all_reduce_sum = sim_all_reduce,
    .reduce_scatter_sum = sim_reduce_scatter,
    .all_gather = sim_all_gather,
    .all_to_allv = sim_all_to_allv,
    .destroy = sim_destroy,
    .time_all_reduce = sim_time_all_reduce,
};

fm_status fm_comm_sim_new(int n_ranks, fm_comm **out) {
    fm_comm *c;
    fm_status s = fm_comm_alloc(&sim_ops, n_ranks, 0, n_ranks, &c);
    if (s) {
        *out = NULL;
        return s;
    }
    c->impl = fm_calloc(1, sizeof(sim_state));
    if (!c->impl) {
        fm_comm_free(c);
        *out = NULL;
        return FM_E_NOMEM;
    }
    snprintf(c->desc, sizeof c->desc, "simulated, %d rank%s in one process", n_ranks, n_ranks == 1 ? "" : "s");
    *out = c;
    return FM_OK;
}

/* ---------------------------------------------------------------- names */

const char *fm_dist_mode_name(fm_dist_mode m) {
    switch (m) {
    case FM_DIST_TP: return "tp";
    case FM_DIST_EP: return "ep";
    }
    return "?";
}
const char *fm_dist_layout_name(fm_dist_layout l) {
    switch (l) {
    case FM_DIST_REPLICATED: return "replicated";
    case FM_DIST_TOKEN_SHARDED: return "token-sharded";
    }
    return "?";
}
const char *fm_compress_name(fm_compress c) {
    switch (c) {
    case FM_COMPRESS_NONE: return "none";
    case FM_COMPRESS_FP8: return "fp8";
    case FM_COMPRESS_NVFP4: return "nvfp4";
    }
    return "?";
}
int fm_dist_layout_from_name(const char *s, fm_dist_layout *out) {
    if (!s) return -1;
    if (!strcmp(s, "replicated")) *out = FM_DIST_REPLICATED;
    else if (!strcmp(s, "token-sharded") || !strcmp(s, "sharded")) *out = FM_DIST_TOKEN_SHARDED;
    else return -1;
    return 0;
}
int fm_compress_from_name(const char *s, fm_compress *out) {
    if (!s) return -1;
    if (!strcmp(s, "none")) *out = FM_COMPRESS_NONE;
    else if (!strcmp(s, "fp8")) *out = FM_COMPRESS_FP8;
    else if (!strcmp(s, "nvfp4")) *out = FM_COMPRESS_NVFP4;
    else return -1;
    return 0;
}
