/* From GPU kernel records (CUPTI) to per-step phase times. */
#include "prof/prof_internal.h"

#include <stdlib.h>
#include <string.h>

static int cmp_start(const void *a, const void *b) {
    const fm_kernel_rec *x = a, *y = b;
    if (x->stream != y->stream) return x->stream < y->stream ? -1 : 1;
    return x->start_ns < y->start_ns ? -1 : x->start_ns > y->start_ns;
}

/* Streams that run a routing kernel carry the layer's chain (routing, then
 * the expert GEMMs); a stream without one is a branch beside it: fp4moe's
 * CUDA backend forks the shared expert onto such a stream after the router
 * logits. route_stream[i]: record i's stream runs routing kernels. Records
 * are sorted by (stream, start). */
static void mark_route_streams(const fm_kernel_rec *r, size_t n, unsigned char *route_stream) {
    for (size_t a = 0; a < n;) {
        size_t b = a;
        int routes = 0;
        while (b < n && r[b].stream == r[a].stream) routes |= r[b++].phase == FM_PH_ROUTE;
        for (size_t i = a; i < b; i++) route_stream[i] = (unsigned char)routes;
        a = b;
    }
}

/* The expert GEMMs may share one kernel template (fp4moe's CUDA backend
 * runs gate/up and down through one fm_expert_kernel<...>), so the name
 * cannot tell them apart; their order after the routing kernel can. On a
 * stream without routing kernels they are the shared expert's. */
static void assign_expert_phases(fm_kernel_rec *r, size_t n, const unsigned char *route_stream) {
    uint32_t stream = UINT32_MAX;
    int nth = 0;
    for (size_t i = 0; i < n; i++) {
        if (r[i].stream != stream) {
            stream = r[i].stream;
            nth = 0;
        }
        if (r[i].phase == FM_PH_ROUTE) nth = 0;
        if (r[i].phase != FM_PH_OTHER || !strstr(r[i].name, "expert")) continue;
        if (!route_stream[i]) {
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

/* An interval of the routing streams' busy time on one device. */
typedef struct {
    uint32_t device;
    uint64_t s, e;
} busy;

static int cmp_busy(const void *a, const void *b) {
    const busy *x = a, *y = b;
    if (x->device != y->device) return x->device < y->device ? -1 : 1;
    return x->s < y->s ? -1 : x->s > y->s;
}

/* Nanoseconds of [s, e) that the union u[0 .. m) (sorted, disjoint) of one
 * device's routing streams covers. */
static uint64_t covered_by(const busy *u, size_t m, uint32_t device, uint64_t s, uint64_t e) {
    size_t lo = 0, hi = m;
    while (lo < hi) { /* first interval of the device ending after s */
        size_t mid = lo + (hi - lo) / 2;
        if (u[mid].device < device || (u[mid].device == device && u[mid].e <= s)) lo = mid + 1;
        else hi = mid;
    }
    uint64_t c = 0;
    for (size_t j = lo; j < m && u[j].device == device && u[j].s < e; j++) {
        uint64_t a = u[j].s > s ? u[j].s : s, b = u[j].e < e ? u[j].e : e;
        if (b > a) c += b - a;
    }
    return c;
}

/* Kernels of one stream may overlap: with programmatic dependent launch a
 * kernel starts while its predecessor drains. Phase times count each
 * nanosecond of a stream once, under the kernel that was running first.
 * A stream without routing kernels (the shared expert's branch) runs beside
 * the routing streams: its kernels count only the nanoseconds in which no
 * routing stream's kernel of the same device ran, so that the phases add up
 * to the union of the busy time and never past the step. Returns 0 when out
 * of memory. */
static int exclusive_ns(const fm_kernel_rec *r, size_t n, const int *step, const unsigned char *route_stream,
                        uint64_t *ex) {
    uint32_t stream = UINT32_MAX;
    uint64_t covered = 0;
    size_t nb = 0;
    for (size_t i = 0; i < n; i++) nb += step[i] >= 0 && route_stream[i];
    busy *u = fm_malloc((nb ? nb : 1) * sizeof *u);
    if (!u) return 0;
    nb = 0;
    for (size_t i = 0; i < n; i++)
        if (step[i] >= 0 && route_stream[i] && r[i].end_ns > r[i].start_ns)
            u[nb++] = (busy){r[i].device, r[i].start_ns, r[i].end_ns};
    qsort(u, nb, sizeof *u, cmp_busy);
    size_t m = 0; /* merged in place: disjoint, sorted by (device, start) */
    for (size_t j = 0; j < nb; j++) {
        if (m && u[m - 1].device == u[j].device && u[j].s <= u[m - 1].e) {
            if (u[j].e > u[m - 1].e) u[m - 1].e = u[j].e;
        } else {
            u[m++] = u[j];
        }
    }
    for (size_t i = 0; i < n; i++) {
        ex[i] = 0;
        if (step[i] < 0) continue; /* outside the measured steps */
        if (r[i].stream != stream) {
            stream = r[i].stream;
            covered = 0;
        }
        uint64_t s = r[i].start_ns > covered ? r[i].start_ns : covered;
        ex[i] = r[i].end_ns > s ? r[i].end_ns - s : 0;
        if (ex[i] && !route_stream[i]) ex[i] -= covered_by(u, m, r[i].device, s, r[i].end_ns);
        if (r[i].end_ns > covered) covered = r[i].end_ns;
    }
    free(u);
    return 1;
}

int fm_prof_kernel_steps(fm_kernel_rec *r, size_t n, int layers_per_step, int *step_of,
                         double ns_per_step[FM_PH_COUNT]) {
    for (int q = 0; q < FM_PH_COUNT; q++) ns_per_step[q] = 0;
    if (!r || n == 0) return 0;
    qsort(r, n, sizeof *r, cmp_start);
    unsigned char *rs = fm_malloc(n);
    uint64_t *ex = fm_malloc(n * sizeof *ex);
    int *sof = fm_malloc(n * sizeof *sof);
    if (!rs || !ex || !sof) {
        free(rs);
        free(ex);
        free(sof);
        return 0;
    }
    mark_route_streams(r, n, rs);
    assign_expert_phases(r, n, rs);

    /* correlation ids and their kernel counts */
    group *g = fm_malloc(n * sizeof *g);
    if (!g) {
        free(rs);
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
    if (!exclusive_ns(r, n, sof, rs, ex)) steps = 0;
    for (size_t i = 0; steps > 0 && i < n; i++)
        if (sof[i] >= 0) ns_per_step[r[i].phase] += (double)ex[i];
    free(g);
    free(rs);
    free(ex);
    free(sof);
    if (steps > 0)
        for (int q = 0; q < FM_PH_COUNT; q++) ns_per_step[q] /= steps;
    return steps;
}
