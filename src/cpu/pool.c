/* A persistent thread pool. Decode at batch 1 takes a millisecond or less
 * per layer, so workers spin briefly before sleeping on a condition
 * variable: a wake-up through the kernel would cost a visible fraction. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <unistd.h>

#include "cpu/cpu_internal.h"
#include "util/util.h"

#define SPIN_ITERS 4000

struct fm_pool {
    int n;
    pthread_t *th;
    pthread_mutex_t mu;
    pthread_cond_t cv_start, cv_done;
    atomic_uint gen;
    atomic_int pending;
    atomic_int stop;
    fm_pool_fn fn;
    void *ctx;
};

typedef struct {
    fm_pool *p;
    int tid;
} worker_arg;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void *worker(void *arg) {
    worker_arg *wa = arg;
    fm_pool *p = wa->p;
    const int tid = wa->tid;
    free(wa);
    unsigned seen = 0;
    for (;;) {
        int spins = 0;
        while (atomic_load(&p->gen) == seen && !atomic_load(&p->stop) && spins < SPIN_ITERS) {
            cpu_relax();
            spins++;
        }
        if (atomic_load(&p->gen) == seen && !atomic_load(&p->stop)) {
            pthread_mutex_lock(&p->mu);
            while (atomic_load(&p->gen) == seen && !atomic_load(&p->stop))
                pthread_cond_wait(&p->cv_start, &p->mu);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop)) break;
        seen = atomic_load(&p->gen);
        p->fn(p->ctx, tid);
        if (atomic_fetch_sub(&p->pending, 1) == 1) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->cv_done);
            pthread_mutex_unlock(&p->mu);
        }
    }
    return NULL;
}

int fm_cpu_default_threads(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0) return n;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

fm_status fm_pool_new(int n, fm_pool **out) {
    *out = NULL;
    if (n <= 0) n = fm_cpu_default_threads();
    if (n > 1024) return fm_error(FM_E_RANGE, "thread count %d is more than 1024", n);
    fm_pool *p = fm_calloc(1, sizeof *p);
    if (!p) return FM_E_NOMEM;
    p->n = n;
    p->th = fm_calloc((size_t)n, sizeof *p->th);
    if (!p->th) { free(p); return FM_E_NOMEM; }
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv_start, NULL);
    pthread_cond_init(&p->cv_done, NULL);
    atomic_init(&p->gen, 0);
    atomic_init(&p->pending, 0);
    atomic_init(&p->stop, 0);
    for (int i = 1; i < n; i++) {
        worker_arg *wa = fm_malloc(sizeof *wa);
        if (!wa) { p->n = i; fm_pool_free(p); return FM_E_NOMEM; }
        wa->p = p;
        wa->tid = i;
        if (pthread_create(&p->th[i], NULL, worker, wa) != 0) {
            free(wa);
            p->n = i;
            fm_pool_free(p);
            return fm_error(FM_E_NOMEM, "cannot start CPU worker thread %d of %d", i, n);
        }
    }
    *out = p;
    return FM_OK;
}

int fm_pool_size(const fm_pool *p) { return p->n; }

void fm_pool_run(fm_pool *p, fm_pool_fn fn, void *ctx) {
    if (p->n == 1) { fn(ctx, 0); return; }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    atomic_store(&p->pending, p->n - 1);
    atomic_fetch_add(&p->gen, 1);
    pthread_cond_broadcast(&p->cv_start);
    pthread_mutex_unlock(&p->mu);
    fn(ctx, 0);
    int spins = 0;
    while (atomic_load(&p->pending) != 0 && spins < SPIN_ITERS) {
        cpu_relax();
        spins++;
    }
    if (atomic_load(&p->pending) != 0) {
        pthread_mutex_lock(&p->mu);
        while (atomic_load(&p->pending) != 0) pthread_cond_wait(&p->cv_done, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
}

void fm_pool_free(fm_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, 1);
    pthread_cond_broadcast(&p->cv_start);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n; i++) pthread_join(p->th[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv_start);
    pthread_cond_destroy(&p->cv_done);
    free(p->th);
    free(p);
}
