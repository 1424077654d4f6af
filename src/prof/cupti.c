/* Kernel-by-kernel GPU times from CUPTI activity records
 * (CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL). Unlike CUDA events between
 * phases, these see each kernel node inside a CUDA graph replay, with its
 * stream and the correlation id of the cudaGraphLaunch that ran it.
 *
 * CUPTI's activity API is process-global (one set of buffer callbacks), so
 * one collector exists at a time. Timestamps come on CUPTI's clock and are
 * shifted onto fm_now_ns() by an offset taken when the collector starts. */
#include "prof/prof_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef FM_HAVE_CUPTI
#include <cupti.h>
#include <pthread.h>

#define BUF_SIZE (8u << 20)
#define BUF_ALIGN 8
#define MAX_RECORDS (4u << 20) /* ~600 MB of records at most */

struct fm_cupti {
    pthread_mutex_t mu;
    fm_kernel_rec *r;
    size_t n, cap;
    uint64_t dropped;
    int64_t offset_ns; /* fm_now_ns() - cuptiGetTimestamp() */
};

static fm_cupti *g_active;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

static fm_status cupti_err(CUptiResult r, const char *call) {
    const char *s = NULL;
    cuptiGetResultString(r, &s);
    return fm_error(FM_E_CUDA, "CUPTI %s failed: %s", call, s ? s : "unknown error");
}

static void CUPTIAPI buf_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = fm_aligned_alloc(BUF_ALIGN, BUF_SIZE);
    *size = *buffer ? BUF_SIZE : 0;
    *max_records = 0;
}

static void add_record(fm_cupti *c, const CUpti_ActivityKernel10 *k) {
    if (c->n == c->cap) {
        size_t nc = c->cap ? 2 * c->cap : 4096;
        fm_kernel_rec *nr = nc <= MAX_RECORDS ? realloc(c->r, nc * sizeof *nr) : NULL;
        if (!nr) {
            c->dropped++;
            return;
        }
        c->r = nr;
        c->cap = nc;
    }
    fm_kernel_rec *o = &c->r[c->n++];
    memset(o, 0, sizeof *o);
    snprintf(o->name, sizeof o->name, "%s", k->name ? k->name : "?");
    o->start_ns = (uint64_t)((int64_t)k->start + c->offset_ns);
    o->end_ns = (uint64_t)((int64_t)k->end + c->offset_ns);
    o->device = k->deviceId;
    o->stream = k->streamId;
    o->dyn_smem = k->dynamicSharedMemory > 0 ? (uint32_t)k->dynamicSharedMemory : 0;
    o->correlation = k->correlationId;
    o->graph_id = k->graphId;
    o->phase = fm_prof_kernel_phase(o->name);
}

static void CUPTIAPI buf_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
    (void)ctx;
    (void)stream;
    (void)size;
    pthread_mutex_lock(&g_lock);
    fm_cupti *c = g_active;
    if (c) pthread_mutex_lock(&c->mu);
    CUpti_Activity *rec = NULL;
    while (valid && cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
        if (c && (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || rec->kind == CUPTI_ACTIVITY_KIND_KERNEL))
            add_record(c, (const CUpti_ActivityKernel10 *)rec);
    }
    if (c) {
        size_t dropped = 0;
        if (cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped) == CUPTI_SUCCESS) c->dropped += dropped;
        pthread_mutex_unlock(&c->mu);
    }
    pthread_mutex_unlock(&g_lock);
    free(buffer);
}

fm_status fm_cupti_start(fm_cupti **out) {
    if (!out) return fm_error(FM_E_ARG, "cupti: NULL output");
    *out = NULL;
    pthread_mutex_lock(&g_lock);
    if (g_active) {
        pthread_mutex_unlock(&g_lock);
        return fm_error(FM_E_ARG, "cupti: a collector is already running (one per process)");
    }
    fm_cupti *c = fm_calloc(1, sizeof *c);
    if (!c) {
        pthread_mutex_unlock(&g_lock);
        return FM_E_NOMEM;
    }
    pthread_mutex_init(&c->mu, NULL);
    uint64_t ts = 0;
    uint64_t h0 = fm_now_ns();
    CUptiResult r = cuptiGetTimestamp(&ts);
    uint64_t h1 = fm_now_ns();
    c->offset_ns = (int64_t)(h0 / 2 + h1 / 2) - (int64_t)ts;
    if (r == CUPTI_SUCCESS) r = cuptiActivityRegisterCallbacks(buf_requested, buf_completed);
    if (r == CUPTI_SUCCESS) r = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    if (r != CUPTI_SUCCESS) {
        pthread_mutex_unlock(&g_lock);
        pthread_mutex_destroy(&c->mu);
        free(c);
        return cupti_err(r, "activity setup");
    }
    g_active = c;
    pthread_mutex_unlock(&g_lock);
    *out = c;
    return FM_OK;
}

fm_status fm_cupti_flush(fm_cupti *c) {
    if (!c) return fm_error(FM_E_ARG, "cupti: NULL collector");
    /* buf_completed takes g_lock itself; flush without holding it. */
    CUptiResult r = cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    if (r != CUPTI_SUCCESS) return cupti_err(r, "cuptiActivityFlushAll");
    return FM_OK;
}

size_t fm_cupti_records(const fm_cupti *c, const fm_kernel_rec **out) {
    if (out) *out = c ? c->r : NULL;
    return c ? c->n : 0;
}

void fm_cupti_clear(fm_cupti *c) {
    if (!c) return;
    pthread_mutex_lock(&c->mu);
    c->n = 0;
    pthread_mutex_unlock(&c->mu);
}

uint64_t fm_cupti_dropped(const fm_cupti *c) { return c ? c->dropped : 0; }

void fm_cupti_stop(fm_cupti *c) {
    if (!c) return;
    cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    pthread_mutex_lock(&g_lock);
    if (g_active == c) g_active = NULL;
    pthread_mutex_unlock(&g_lock);
    pthread_mutex_destroy(&c->mu);
    free(c->r);
    free(c);
}

#else /* !FM_HAVE_CUPTI */

struct fm_cupti {
    int unused;
};

fm_status fm_cupti_start(fm_cupti **out) {
    if (out) *out = NULL;
    return fm_error(FM_E_UNSUPPORTED, "CUPTI kernel records need a CUDA build with CUPTI (FM_HAVE_CUPTI)");
}
fm_status fm_cupti_flush(fm_cupti *c) {
    (void)c;
    return fm_error(FM_E_UNSUPPORTED, "CUPTI not built in");
}
size_t fm_cupti_records(const fm_cupti *c, const fm_kernel_rec **out) {
    (void)c;
    if (out) *out = NULL;
    return 0;
}
void fm_cupti_clear(fm_cupti *c) { (void)c; }
uint64_t fm_cupti_dropped(const fm_cupti *c) {
    (void)c;
    return 0;
}
void fm_cupti_stop(fm_cupti *c) { (void)c; }

#endif
