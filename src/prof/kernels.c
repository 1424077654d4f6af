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
 * cannot tell them apart; their order after the routing kernel can. */
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

/* Kernels of one stream may overlap: with programmatic dependent launch a
 * kernel starts while its predecessor drains. Phase times count each
 * nanosecond of a stream once, under the kernel that was running first, so
 * that the phases add up to the busy time and never past the step. */
static void exclusive_ns(const fm_kernel_rec *r, size_t n, const int *step, uint64_t *ex) {
    uint32_t stream = UINT32_MAX;
    uint64_t covered = 0;
    for (size_t i = 0; i < n; i++) {
        ex[i] = 0;
        if (step[i] < 0) continue; /* outside the measured steps */
        if (r[i].stream != stream) {
            stream = r[i].stream;
            covered = 0;
        }
        uint64_t s = r[i].start_ns > covered ? r[i].start_ns : covered;
        ex[i] = r[i].end_ns > s ? r[i].end_ns - s : 0;
        if (r[i].end_ns > covered) covered = r[i].end_ns;
    }
}

int fm_prof_kernel_steps(fm_kernel_rec *r, size_t n, int layers_per_step, int *step_of,
                         double ns_per_step[FM_PH_COUNT]) {
    for (int q = 0; q < FM_PH_COUNT; q++) ns_per_step[q] = 0;
    if (!r || n == 0) return 0;
    qsort(r, n, sizeof *r, cmp_start);
    assign_expert_phases(r, n);
    uint64_t *ex = fm_malloc(n * sizeof *ex);
    int *sof = fm_malloc(n * sizeof *sof);
    if (!ex || !sof) {
        free(ex);
        free(sof);
        return 0;
    }

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
    exclusive_ns(r, n, sof, ex);
    for (size_t i = 0; i < n; i++)
        if (sof[i] >= 0) ns_per_step[r[i].phase] += (double)ex[i];
    free(g);
    free(ex);
    free(sof);
    if (steps > 0)
        for (int q = 0; q < FM_PH_COUNT; q++) ns_per_step[q] /= steps;
    return steps;
}
