/* From GPU kernel records (CUPTI) to per-step phase times. */
#include "prof/prof_internal.h"

#include <stdlib.h>
#include <string.h>

static int cmp_start(const void *a, const void *b) {
    const fm_kernel_rec *x = a, *y = b;
    if (x->stream != y->stream) return x->stream < y->stream ? -1 : 1;
    return x->start_ns < y->start_ns ? -1 : x->start_ns > y->start_ns;
}

/* The expert GEMMs may share one kernel template (fp4moe's CUDA backend
 * runs gate/up and down through one fm_expert_kernel<...>), so the name
 * cannot tell them apart; their order after the routing kernel can. The
 * shared expert's launches on their own stream (the same kernels) carry
 * FM_CUDA_SHARED_SMEM_MARK in their dynamic shared memory. */
static void assign_expert_phases(fm_kernel_rec *r, size_t n) {
    uint32_t stream = UINT32_MAX;
    int nth = 0;
    for (size_t i = 0; i < n; i++) {
        if (r[i].stream != stream) {
            stream = r[i].stream;
            nth = 0;
        }
        if (r[i].phase == FM_PH_ROUTE) nth = 0;
        if (r[i].phase != FM_PH_OTHER || !strstr(r[i].name, "expert")) continue;
        if (r[i].dyn_smem % 16 == FM_CUDA_SHARED_SMEM_MARK) {
            r[i].phase = FM_PH_SHARED;
            continue;
        }
        nth++;
        if (nth == 1) r[i].phase = FM_PH_GATEUP;
        else if (nth == 2) r[i].phase = FM_PH_DOWN;
    }
}

typedef struct {
    uint32_t corr;
    uint32_t count;
    int step;
} group;

static int cmp_group(const void *a, const void *b) {
    const group *x = a, *y = b;
    return x->corr < y->corr ? -1 : x->corr > y->corr;
}

static const group *find(const group *g, size_t m, uint32_t corr) {
    group key = {corr, 0, 0};
    return bsearch(&key, g, m, sizeof *g, cmp_group);
}

/* Sort key of a record: per device, in start order, the shared expert's
 * after the others (they are counted second). */
typedef struct {
    uint32_t device, shared;
    uint64_t start;
    size_t i;
} dkey;

static int cmp_dev(const void *a, const void *b) {
    const dkey *x = a, *y = b;
    if (x->device != y->device) return x->device < y->device ? -1 : 1;
    if (x->shared != y->shared) return x->shared < y->shared ? -1 : 1;
    return x->start < y->start ? -1 : x->start > y->start;
}

typedef struct {
    uint64_t s, e;
} span;

/* Nanoseconds of [s, e) that u[0 .. m) (sorted, disjoint) covers; *j: the
 * first interval that may still meet a later [s, e) of a sweep in start
 * order. */
static uint64_t covered_by(const span *u, size_t m, size_t *j, uint64_t s, uint64_t e) {
    while (*j < m && u[*j].e <= s) (*j)++;
    uint64_t c = 0;
    for (size_t q = *j; q < m && u[q].s < e; q++) {
        uint64_t a = u[q].s > s ? u[q].s : s, b = u[q].e < e ? u[q].e : e;
        if (b > a) c += b - a;
    }
    return c;
}

/* Kernels overlap: with programmatic dependent launch a kernel starts while
 * its predecessor drains, and the CUDA backend runs the shared expert on a
 * stream of its own beside the routing and the routed experts. Phase times
 * count each nanosecond of a device once: under the kernel that started
 * first among those that are not the shared expert's, and for the shared
 * expert's kernels only the nanoseconds in which no other kernel of the
 * device ran (the time it adds to the layer's chain). So the phases add up
 * to the union of the busy time and never past the step. Returns 0 when out
 * of memory. */
static int exclusive_ns(const fm_kernel_rec *r, size_t n, const int *step, uint64_t *ex) {
    dkey *key = fm_malloc((n ? n : 1) * sizeof *key);
    span *u = fm_malloc((n ? n : 1) * sizeof *u);
    if (!key || !u) {
        free(key);
        free(u);
        return 0;
    }
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        ex[i] = 0;
        if (step[i] >= 0) /* outside the measured steps: nothing */
            key[m++] = (dkey){r[i].device, r[i].phase == FM_PH_SHARED, r[i].start_ns, i};
    }
    qsort(key, m, sizeof *key, cmp_dev);
    for (size_t a = 0; a < m;) {
        const uint32_t dev = key[a].device;
        size_t b = a;
        while (b < m && key[b].device == dev) b++;
        /* the device's kernels but the shared expert's: the union u */
        size_t nu = 0, q = a;
        uint64_t covered = 0;
        for (; q < b && !key[q].shared; q++) {
            const fm_kernel_rec *k = &r[key[q].i];
            uint64_t s = k->start_ns > covered ? k->start_ns : covered;
            ex[key[q].i] = k->end_ns > s ? k->end_ns - s : 0;
            if (k->end_ns > k->start_ns) {
                if (nu && k->start_ns <= u[nu - 1].e) {
                    if (k->end_ns > u[nu - 1].e) u[nu - 1].e = k->end_ns;
                } else {
                    u[nu++] = (span){k->start_ns, k->end_ns};
                }
            }
            if (k->end_ns > covered) covered = k->end_ns;
        }
        /* the shared expert's: outside u and outside each other */
        covered = 0;
        size_t j = 0;
        for (; q < b; q++) {
            const fm_kernel_rec *k = &r[key[q].i];
            uint64_t s = k->start_ns > covered ? k->start_ns : covered;
            if (k->end_ns > s) ex[key[q].i] = k->end_ns - s - covered_by(u, nu, &j, s, k->end_ns);
            if (k->end_ns > covered) covered = k->end_ns;
        }
        a = b;
    }
    free(key);
    free(u);
    return 1;
}

int fm_prof_kernel_steps(fm_kernel_rec *r, size_t n, int layers_per_step, int *step_of,
                         double ns_per_step[FM_PH_COUNT]) {
    for (int q = 0; q < FM_PH_COUNT; q++) ns_per_step[q] = 0;
    if (!r || n == 0) return 0;
    qsort(r, n, sizeof *r, cmp_start);
    uint64_t *ex = fm_malloc(n * sizeof *ex);
    int *sof = fm_malloc(n * sizeof *sof);
    if (!ex || !sof) {
        free(ex);
        free(sof);
        return 0;
    }
    assign_expert_phases(r, n);

    /* correlation ids and their kernel counts */
    group *g = fm_malloc(n * sizeof *g);
    if (!g) {
        free(ex);
        free(sof);
        return 0;
    }
    for (size_t i = 0; i < n; i++) g[i] = (group){r[i].correlation, 1, -1};
    qsort(g, n, sizeof *g, cmp_group);
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        if (m && g[m - 1].corr == g[i].corr)
            g[m - 1].count++;
        else
            g[m++] = g[i];
    }
    /* the most common group size above 1 (ties: the larger size) */
    uint32_t mode = 0, mode_n = 0;
    for (size_t j = 0; j < m; j++) {
        if (g[j].count < 2) continue;
        uint32_t f = 0;
        for (size_t q = 0; q < m; q++) f += g[q].count == g[j].count;
        if (f > mode_n || (f == mode_n && g[j].count > mode)) {
            mode = g[j].count;
            mode_n = f;
        }
    }
    int steps = 0;
    if (mode > 1) {
        for (size_t j = 0; j < m; j++)
            if (g[j].count == mode) g[j].step = steps++;
        for (size_t i = 0; i < n; i++) {
            const group *gi = find(g, m, r[i].correlation);
            int s = gi ? gi->step : -1;
            if (step_of) step_of[i] = s;
            sof[i] = s;
        }
    } else {
        /* no graphs: one routing kernel per layer */
        size_t routes = 0;
        for (size_t i = 0; i < n; i++) routes += r[i].phase == FM_PH_ROUTE;
        int per = layers_per_step > 0 ? layers_per_step : 1;
        steps = (int)(routes / (size_t)per);
        int layer = -1;
        for (size_t i = 0; i < n; i++) {
            if (r[i].phase == FM_PH_ROUTE) layer++;
            int s = layer >= 0 && layer / per < steps ? layer / per : -1;
            if (step_of) step_of[i] = s;
            sof[i] = s;
        }
    }
    if (!exclusive_ns(r, n, sof, ex)) steps = 0;
    for (size_t i = 0; steps > 0 && i < n; i++)
        if (sof[i] >= 0) ns_per_step[r[i].phase] += (double)ex[i];
    free(g);
    free(ex);
    free(sof);
    if (steps > 0)
        for (int q = 0; q < FM_PH_COUNT; q++) ns_per_step[q] /= steps;
    return steps;
}
