/*
 * The fast CPU engine.
 *
 * One MoE block call:
 *   1. activations to F32 (finite check), and a copy in the FP4 kernels'
 *      split-16 layout (kern.h)                                   [other]
 *   2. router logits, parallel over (token, expert block); selection per
 *      token (route.c)                                            [routing]
 *   3. tokens grouped by expert: each active expert gets its token list and
 *      weights, so its FP4 bytes are read once per call            [sort]
 *   4. gate+up+activation, parallel over (expert, block of rows): writes
 *      the intermediate h of each (expert, token)                  [gate_up]
 *   5. down, parallel over blocks of output rows: each work item owns its
 *      rows for every token and adds the weighted outputs of all active
 *      experts, then the shared expert, in that fixed order: no races, no
 *      separate combine pass, and the result does not depend on the thread
 *      count                                                      [down]
 *   6. finite check of the output                                 [other]
 * The shared expert is one more "expert" with every token and weight 1;
 * activation, combine and shared are fused (fm_phase_times.fused_mask).
 * fm_cpu_experts is the same call without step 2: the caller's ids and
 * weights go straight to step 3 (ids < 0 are skipped there).
 *
 * The engine keeps its scratch between calls; one engine runs one call at a
 * time.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "cpu/cpu_internal.h"
#include "cpu/kern.h"
#include "route/route.h"
#include "util/util.h"

/* Rows per work item (multiples of 16). A down item reads a run of rows of
 * every active expert, and each run restarts the hardware prefetcher:
 * DOWN_ROWS is doubled up to DOWN_ROWS_MAX while every thread still gets
 * ITEMS_PER_THREAD items (one core streaming 64 experts' down matrices:
 * 6.6 GB/s with runs of 32 rows, 7.1 GB/s with 128) and while the item's
 * output block (tokens x rows floats, updated by every expert) stays within
 * DOWN_OUT_BYTES of L1 (batch 64 with 128-row items measured 30 % slower).
 * Many threads keep the short items for balance. */
#define GU_ROWS 32
#define DOWN_ROWS 32
#define DOWN_ROWS_MAX 128
#define DOWN_OUT_BYTES 8192
#define ITEMS_PER_THREAD 8
#define ROUTE_EXPERTS 32

float fm_cpu_lut_e4m3[256];
float fm_cpu_lut_e8m0[256];
float fm_cpu_lut_e4m3_half[256];
float fm_cpu_lut_e8m0_half[256];
static pthread_once_t g_lut_once = PTHREAD_ONCE_INIT;
static void lut_init_once(void) {
    for (int i = 0; i < 256; i++) {
        fm_cpu_lut_e4m3[i] = fm_e4m3_to_f32((uint8_t)i);
        fm_cpu_lut_e8m0[i] = fm_e8m0_to_f32((uint8_t)i);
        fm_cpu_lut_e4m3_half[i] = fm_cpu_lut_e4m3[i] * 0.5f;
        fm_cpu_lut_e8m0_half[i] = fm_cpu_lut_e8m0[i] * 0.5f;
    }
}
void fm_cpu_luts_init(void) { pthread_once(&g_lut_once, lut_init_once); }

const char *fm_cpu_isa_name(fm_cpu_isa i) {
    switch (i) {
    case FM_CPU_AUTO: return "auto";
    case FM_CPU_SCALAR: return "scalar";
    case FM_CPU_AVX2: return "avx2";
    case FM_CPU_AVX512: return "avx512";
    }
    return "unknown";
}

static int have_avx2(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}
static int have_avx512(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return have_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
    return 0;
#endif
}

fm_cpu_isa fm_cpu_isa_detect(void) {
    if (have_avx512()) return FM_CPU_AVX512;
    if (have_avx2()) return FM_CPU_AVX2;
    return FM_CPU_SCALAR;
}

/* Per-call scratch, grown on demand. */
typedef struct {
    void *p;
    size_t cap;
} buf;
static void *grow(buf *b, size_t n, size_t sz) {
    uint64_t bytes;
    if (!fm_mul_ok(n ? n : 1, sz, &bytes) || bytes > SIZE_MAX - 64) {
        fm_error(FM_E_RANGE, "CPU engine scratch of %zu x %zu bytes overflows", n, sz);
        return NULL;
    }
    if (bytes <= b->cap) return b->p;
    void *p = fm_aligned_alloc(64, (size_t)bytes);
    if (!p) return NULL;
    free(b->p);
    b->p = p;
    b->cap = (size_t)bytes;
    return p;
}

typedef struct {
    int expert; /* -1: the shared expert */
    int n;      /* tokens                */
    int64_t off;  /* into tok/wt/xptr/optr */
    int64_t hoff; /* into h (floats)       */
    int inter;
    const fm_qmatrix *gate, *up, *down;
} slot;

enum { B_X, B_XP, B_LOGITS, B_IDS, B_WT, B_RSCR, B_COUNT, B_SLOT, B_TOK, B_TWT, B_XPTR, B_OPTR, B_H,
       B_ITEM, B_WBUF, B_PERM, B_NBUF };

struct fm_cpu_engine {
    fm_cpu_isa isa;
    const fm_cpu_kernels *k;
    fm_pool *pool;
    int n_threads;
    fm_phase_times *pt;
    char desc[160];
    buf b[B_NBUF];
    int64_t perm_cols; /* the kernels' activation permutation, cached */
    fm_qformat perm_fmt;
};

fm_status fm_cpu_engine_new(fm_cpu_isa isa, int n_threads, fm_cpu_engine **out) {
    if (!out) return fm_error(FM_E_ARG, "fm_cpu_engine_new: out is NULL");
    *out = NULL;
    fm_cpu_luts_init();
    const fm_cpu_kernels *k;
    switch (isa) {
    case FM_CPU_AUTO:
        /* the widest the processor has: the AVX-512 kernels (the AVX2
         * decode on 512-bit vectors) measured faster than AVX2 at batch
         * 1 - 16 on a Xeon (docs/perf.md, CPU) */
        return fm_cpu_engine_new(fm_cpu_isa_detect(), n_threads, out);
    case FM_CPU_SCALAR: k = &fm_cpu_kern_scalar; break;
    case FM_CPU_AVX2:
        if (!have_avx2()) return fm_error(FM_E_UNSUPPORTED, "CPU lacks AVX2/FMA");
        k = &fm_cpu_kern_avx2;
        break;
    case FM_CPU_AVX512:
        if (!have_avx512()) return fm_error(FM_E_UNSUPPORTED, "CPU lacks AVX-512 (F/BW/VL/DQ)");
        k = &fm_cpu_kern_avx512;
        break;
    default: return fm_error(FM_E_ARG, "unknown CPU ISA %d", (int)isa);
    }
    fm_cpu_engine *e = fm_calloc(1, sizeof *e);
    if (!e) return FM_E_NOMEM;
    e->isa = isa;
    e->k = k;
    fm_status st = fm_pool_new(n_threads, &e->pool);
    if (st) { free(e); return st; }
    e->n_threads = fm_pool_size(e->pool);
    snprintf(e->desc, sizeof e->desc, "cpu/%s, %d thread%s, %s, FP32 accumulation", k->name, e->n_threads,
             e->n_threads == 1 ? "" : "s", isa == FM_CPU_SCALAR ? "portable C" : "FP4 decoded in registers");
    *out = e;
    return FM_OK;
}

void fm_cpu_engine_free(fm_cpu_engine *e) {
    if (!e) return;
    fm_pool_free(e->pool);
    for (int i = 0; i < B_NBUF; i++) free(e->b[i].p);
    free(e);
}

const char *fm_cpu_engine_describe(const fm_cpu_engine *e) { return e ? e->desc : "(no engine)"; }

void fm_cpu_engine_set_phase_times(fm_cpu_engine *e, fm_phase_times *pt) {
    if (e) e->pt = pt;
}

/* ---- parallel jobs */

typedef struct {
    fm_cpu_engine *e;
    const fm_model_desc *d;
    const fm_moe_layer *l;
    float *out; /* [T, H] */
    int T;
    int64_t H;
    atomic_int next;
    int n_items;
    const float *x;
    float *logits;
    slot *slots;
    int n_slots;
    const int32_t *tok;
    const float *twt;
    const float *const *xptr;
    float *const *optr;
    float *h;
    const int32_t *items; /* gate/up: (slot, row block) pairs */
    float *wbuf;
    int64_t wbuf_stride;
    int64_t down_rows; /* output rows per down item */
} job;

static int64_t down_item_rows(int64_t H, int T, int n_threads) {
    int64_t r = DOWN_ROWS;
    while (2 * r <= DOWN_ROWS_MAX && H / (2 * r) >= (int64_t)ITEMS_PER_THREAD * n_threads &&
           (int64_t)T * 2 * r * (int64_t)sizeof(float) <= DOWN_OUT_BYTES)
        r *= 2;
    return r;
}

static void job_logits(void *arg, int tid) {
    job *j = arg;
    const int E = j->l->n_experts;
    const int eb = (E + ROUTE_EXPERTS - 1) / ROUTE_EXPERTS;
    for (int it; (it = atomic_fetch_add(&j->next, 1)) < j->n_items;) {
        int t = it / eb, e0 = (it % eb) * ROUTE_EXPERTS;
        int e1 = e0 + ROUTE_EXPERTS < E ? e0 + ROUTE_EXPERTS : E;
        fm_route_logits(j->l, j->x + (int64_t)t * j->H, e0, e1, j->logits + (int64_t)t * E + e0);
    }
    (void)tid;
}

static void job_gate_up(void *arg, int tid) {
    job *j = arg;
    for (int it; (it = atomic_fetch_add(&j->next, 1)) < j->n_items;) {
        const slot *s = &j->slots[j->items[2 * it]];
        int64_t r0 = (int64_t)j->items[2 * it + 1] * GU_ROWS;
        int64_t r1 = r0 + GU_ROWS < s->inter ? r0 + GU_ROWS : s->inter;
        fm_gu_task t = {
            .gate = s->gate, .up = s->up, .x = j->xptr + s->off, .n = s->n, .h = j->h + s->hoff,
            .ldh = s->inter, .h_fmt = s->down->fmt, .r0 = r0, .r1 = r1, .act = j->d->act,
            .alpha = j->d->swiglu_alpha, .limit = j->d->swiglu_limit,
            .wbuf = j->wbuf + tid * j->wbuf_stride,
        };
        j->e->k->gate_up(&t);
    }
}

static void job_down(void *arg, int tid) {
    job *j = arg;
    for (int it; (it = atomic_fetch_add(&j->next, 1)) < j->n_items;) {
        int64_t r0 = (int64_t)it * j->down_rows;
        int64_t r1 = r0 + j->down_rows < j->H ? r0 + j->down_rows : j->H;
        for (int t = 0; t < j->T; t++) memset(j->out + t * j->H + r0, 0, sizeof(float) * (size_t)(r1 - r0));
        for (int si = 0; si < j->n_slots; si++) {
            const slot *s = &j->slots[si];
            fm_down_task t = {
                .down = s->down, .h = j->h + s->hoff, .ldh = s->inter, .n = s->n, .out = j->optr + s->off,
                .w = s->expert >= 0 ? j->twt + s->off : NULL, .r0 = r0, .r1 = r1,
                .wbuf = j->wbuf + tid * j->wbuf_stride,
            };
            j->e->k->down(&t);
        }
    }
}

static void run(fm_cpu_engine *e, fm_pool_fn fn, job *j, int n_items) {
    atomic_store(&j->next, 0);
    j->n_items = n_items;
    fm_pool_run(e->pool, fn, j);
}

/* xp[t][pos(c)] = x[t][c] in the kernels' layout; the index table is
 * cached for the last (H, format). */
static fm_status permute_x(fm_cpu_engine *e, fm_qformat f, const float *x, float *xp, int T, int64_t H) {
    int32_t *perm = e->b[B_PERM].p;
    if (e->perm_cols != H || e->perm_fmt != f || !perm) {
        perm = grow(&e->b[B_PERM], (size_t)H, sizeof(int32_t));
        if (!perm) return FM_E_NOMEM;
        for (int64_t c = 0; c < H; c++) perm[c] = (int32_t)e->k->pos(f, H, c);
        e->perm_cols = H;
        e->perm_fmt = f;
    }
    for (int t = 0; t < T; t++)
        for (int64_t c = 0; c < H; c++) xp[(int64_t)t * H + perm[c]] = x[(int64_t)t * H + c];
    return FM_OK;
}

/* Timestamps of one call, for the phase table. */
typedef struct {
    uint64_t start, route, sort, gu, down, end;
} stamps;

static void add_phases(fm_cpu_engine *e, const stamps *ts) {
    if (!e->pt) return;
    uint64_t t_fin = fm_now_ns();
    e->pt->ns[FM_PH_OTHER] += (double)(ts->route - ts->start) + (double)(t_fin - ts->end);
    e->pt->ns[FM_PH_ROUTE] += (double)(ts->sort - ts->route);
    e->pt->ns[FM_PH_SORT] += (double)(ts->gu - ts->sort);
    e->pt->ns[FM_PH_GATEUP] += (double)(ts->down - ts->gu);
    e->pt->ns[FM_PH_DOWN] += (double)(ts->end - ts->down);
    e->pt->calls++;
    e->pt->fused_mask |= (1u << FM_PH_ACT) | (1u << FM_PH_COMBINE) | (1u << FM_PH_SHARED);
}

/* Steps 3-6 on checked inputs: xp [T, H] in the kernels' layout, ids / wt
 * [T, k] with ids < E (ids < 0 are skipped), the shared expert when
 * shared. Writes out [T, H]; ts->gu, down, end are stamped here. */
static fm_status experts_run(fm_cpu_engine *e, const fm_model_desc *d, const fm_moe_layer *l, const float *xp,
                             int T, const int32_t *ids, const float *wt, int shared, float *out, stamps *ts) {
    const int64_t H = l->hidden;
    const int E = l->n_experts, k = l->topk;
    shared = shared && l->has_shared;
    const int64_t Tk = (int64_t)T * k;
    const int n_slots_max = E + (shared ? 1 : 0);
    const int64_t I = l->inter, Ish = shared ? l->shared_inter : 0;
    const int64_t maxcols = H > I ? (H > Ish ? H : Ish) : (I > Ish ? I : Ish);
    const int64_t ntok = Tk + (shared ? T : 0);
    const int64_t gu_items_max = (int64_t)E * ((I + GU_ROWS - 1) / GU_ROWS) + (Ish + GU_ROWS - 1) / GU_ROWS;

    int32_t *count = grow(&e->b[B_COUNT], (size_t)E + 1, sizeof(int32_t));
    slot *slots = grow(&e->b[B_SLOT], (size_t)n_slots_max, sizeof(slot));
    int32_t *tok = grow(&e->b[B_TOK], (size_t)ntok, sizeof(int32_t));
    float *twt = grow(&e->b[B_TWT], (size_t)ntok, sizeof(float));
    const float **xptr = grow(&e->b[B_XPTR], (size_t)ntok, sizeof(float *));
    float **optr = grow(&e->b[B_OPTR], (size_t)ntok, sizeof(float *));
    float *h = grow(&e->b[B_H], (size_t)(Tk * I + T * Ish), sizeof(float));
    int32_t *items = grow(&e->b[B_ITEM], (size_t)(2 * gu_items_max), sizeof(int32_t));
    const int64_t wstride = (fm_cpu_wbuf_floats(maxcols) + 15) & ~(int64_t)15; /* 64-byte aligned */
    float *wbuf = grow(&e->b[B_WBUF], (size_t)(wstride * e->n_threads), sizeof(float));
    if (!count || !slots || !tok || !twt || !xptr || !optr || !h || !items || !wbuf) return FM_E_NOMEM;

    /* Group tokens by expert, experts ascending, tokens ascending. */
    memset(count, 0, sizeof(int32_t) * (size_t)E);
    for (int64_t i = 0; i < Tk; i++)
        if (ids[i] >= 0) count[ids[i]]++;
    int ns = 0;
    int64_t off = 0, hoff = 0;
    for (int ex = 0; ex < E; ex++) {
        if (!count[ex]) continue;
        slots[ns] = (slot){ex, 0, off, hoff, (int)I, &l->gate[ex], &l->up[ex], &l->down[ex]};
        off += count[ex];
        hoff += (int64_t)count[ex] * I;
        count[ex] = ns++; /* count now maps expert -> slot */
    }
    for (int t = 0; t < T; t++)
        for (int q = 0; q < k; q++) {
            const int32_t id = ids[(int64_t)t * k + q];
            if (id < 0) continue;
            slot *s = &slots[count[id]];
            int64_t at = s->off + s->n++;
            tok[at] = t;
            twt[at] = wt[(int64_t)t * k + q];
        }
    if (shared) {
        slots[ns] = (slot){-1, T, off, hoff, l->shared_inter, &l->sh_gate, &l->sh_up, &l->sh_down};
        for (int t = 0; t < T; t++) { tok[off + t] = t; twt[off + t] = 1.0f; }
        off += T;
        ns++;
    }
    for (int64_t i = 0; i < off; i++) {
        xptr[i] = xp + (int64_t)tok[i] * H;
        optr[i] = out + (int64_t)tok[i] * H;
    }
    job j = {.e = e, .d = d, .l = l, .out = out, .T = T, .H = H, .wbuf = wbuf, .wbuf_stride = wstride};
    j.down_rows = down_item_rows(H, T, e->n_threads);
    int n_gu = 0;
    for (int si = 0; si < ns; si++)
        for (int rb = 0; rb * GU_ROWS < slots[si].inter; rb++) {
            items[2 * n_gu] = si;
            items[2 * n_gu + 1] = rb;
            n_gu++;
        }
    j.slots = slots;
    j.n_slots = ns;
    j.tok = tok;
    j.twt = twt;
    j.xptr = xptr;
    j.optr = optr;
    j.h = h;
    j.items = items;
    ts->gu = fm_now_ns();

    run(e, job_gate_up, &j, n_gu);
    ts->down = fm_now_ns();
    run(e, job_down, &j, (int)((H + j.down_rows - 1) / j.down_rows));
    ts->end = fm_now_ns();
    return fm_check_out_finite(l->layer, "output", out, T, H);
}

/* Step 1: activations to F32 (checked) and the kernels' copy of them. */
static fm_status load_acts(fm_cpu_engine *e, const fm_moe_layer *l, const void *x, fm_dtype xdt, int T, float **xf,
                           float **xp) {
    const int64_t H = l->hidden;
    *xf = grow(&e->b[B_X], (size_t)(T * H), sizeof(float));
    *xp = grow(&e->b[B_XP], (size_t)(T * H), sizeof(float));
    if (!*xf || !*xp) return FM_E_NOMEM;
    fm_status st = fm_cpu_load_x(x, xdt, T, H, *xf);
    return st ? st : permute_x(e, l->fmt, *xf, *xp, T, H);
}

fm_status fm_cpu_forward(fm_cpu_engine *e, const fm_model_desc *d, const fm_moe_layer *l,
                         const void *x, fm_dtype xdt, int T, const int32_t *token_ids, fm_moe_out *o) {
    if (!e || !o || !o->out) return fm_error(FM_E_ARG, "fm_cpu_forward: engine or output is NULL");
    if (T < 0) return fm_error(FM_E_ARG, "fm_cpu_forward: negative token count %d", T);
    if (T > (1 << 24)) return fm_error(FM_E_RANGE, "fm_cpu_forward: %d tokens in one call (at most 2^24)", T);
    fm_status st = fm_cpu_check_layer(d, l);
    if (st) return st;
    if (T == 0) return FM_OK;
    if (!x) return fm_error(FM_E_ARG, "fm_cpu_forward: input is NULL");

    stamps ts = {.start = fm_now_ns()};
    const int64_t H = l->hidden;
    const int E = l->n_experts, k = l->topk;
    const int64_t Tk = (int64_t)T * k;
    float *xf, *xp;
    float *logits = grow(&e->b[B_LOGITS], (size_t)T * (size_t)E, sizeof(float));
    int32_t *ids = grow(&e->b[B_IDS], (size_t)Tk, sizeof(int32_t));
    float *wt = grow(&e->b[B_WT], (size_t)Tk, sizeof(float));
    float *rscr = grow(&e->b[B_RSCR], fm_route_scratch_floats(E), sizeof(float));
    if (!logits || !ids || !wt || !rscr) return FM_E_NOMEM;
    if ((st = load_acts(e, l, x, xdt, T, &xf, &xp))) return st;
    ts.route = fm_now_ns();

    /* Step 2: routing; the experts path below is fm_cpu_experts'. */
    job j = {.e = e, .d = d, .l = l, .T = T, .H = H, .x = xf, .logits = logits};
    run(e, job_logits, &j, T * ((E + ROUTE_EXPERTS - 1) / ROUTE_EXPERTS));
    for (int t = 0; t < T; t++) {
        st = fm_route_select(d, l, t, logits + (int64_t)t * E, token_ids ? token_ids + t : NULL, ids + (int64_t)t * k,
                             wt + (int64_t)t * k, rscr);
        if (st) return st;
    }
    ts.sort = fm_now_ns();
    if ((st = experts_run(e, d, l, xp, T, ids, wt, 1, o->out, &ts))) return st;
    if (o->topk_ids) memcpy(o->topk_ids, ids, sizeof(int32_t) * (size_t)Tk);
    if (o->topk_weights) memcpy(o->topk_weights, wt, sizeof(float) * (size_t)Tk);
    add_phases(e, &ts);
    return FM_OK;
}

fm_status fm_cpu_experts(fm_cpu_engine *e, const fm_model_desc *d, const fm_moe_layer *l, const void *x,
                         fm_dtype xdt, int T, const int32_t *topk_ids, const float *topk_weights, int include_shared,
                         float *out) {
    if (!e || !out) return fm_error(FM_E_ARG, "fm_cpu_experts: engine or output is NULL");
    if (T < 1) return fm_error(FM_E_RANGE, "fm_cpu_experts: T=%d tokens (need >= 1)", T);
    if (T > (1 << 24)) return fm_error(FM_E_RANGE, "fm_cpu_experts: %d tokens in one call (at most 2^24)", T);
    fm_status st = fm_cpu_check_experts(d, l);
    if (st) return st;
    if (!x || !topk_ids || !topk_weights)
        return fm_error(FM_E_ARG, "fm_cpu_experts: input, topk_ids or topk_weights is NULL");
    const int E = l->n_experts, k = l->topk;
    for (int64_t i = 0; i < (int64_t)T * k; i++) {
        if (topk_ids[i] >= E)
            return fm_error(FM_E_RANGE, "fm_cpu_experts: token %lld, slot %lld: expert id %d is not below E=%d",
                            (long long)(i / k), (long long)(i % k), (int)topk_ids[i], E);
        if (!isfinite(topk_weights[i]))
            return fm_error(FM_E_NUMERIC, "fm_cpu_experts: token %lld, slot %lld: weight is %g", (long long)(i / k),
                            (long long)(i % k), (double)topk_weights[i]);
    }
    stamps ts = {.start = fm_now_ns()};
    float *xf, *xp;
    if ((st = load_acts(e, l, x, xdt, T, &xf, &xp))) return st;
    ts.route = ts.sort = fm_now_ns();
    if ((st = experts_run(e, d, l, xp, T, topk_ids, topk_weights, include_shared, out, &ts))) return st;
    add_phases(e, &ts);
    return FM_OK;
}
