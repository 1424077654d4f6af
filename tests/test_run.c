/* src/run: fm_bench_run (the report, the order of its callbacks, the bytes
 * it accounts, checked from the shapes; bad options refused before any
 * work) and fm_forward_file (its output against the float64 reference). */
#include <sys/stat.h>

#include "fm_test.h"

/* ------------------------------------------------------------ helpers */

typedef struct {
    int rows[FM_BENCH_MAX_BATCH + 2]; /* the row argument of each call */
    int n;
    int layers_at_setup, n_rows_at_setup;
} row_log;

static void log_row(void *ctx, const fm_bench_report *r, int row) {
    row_log *g = ctx;
    if (g->n < (int)(sizeof g->rows / sizeof g->rows[0])) g->rows[g->n] = row;
    g->n++;
    if (row < 0) {
        g->layers_at_setup = r->layers;
        g->n_rows_at_setup = r->n_rows;
    } else {
        assert_int_equal(r->n_rows, row + 1);
    }
}

typedef struct {
    int calls, open; /* open: an operation has started and not ended */
    int bad_frac;
    int saw_batch3;
} prog_log;

static void log_progress(void *ctx, const char *what, double frac) {
    prog_log *p = ctx;
    p->calls++;
    if (!(frac >= 0 && frac <= 1)) p->bad_frac++;
    p->open = frac < 1.0;
    if (strstr(what, "batch 3: timing")) p->saw_batch3 = 1;
}

static fm_bench_opts cpu_opts(const int *batches, int n) {
    fm_bench_opts o;
    memset(&o, 0, sizeof o);
    o.preset = "tiny-qwen3";
    o.device = FM_DEV_CPU;
    o.batches = batches;
    o.n_batches = n;
    o.layers = 2;
    o.threads = 1;
    o.bw_probe_bytes = 8u << 20;
    o.seed = 3;
    return o;
}

/* Runs o (which must succeed), logging the callbacks into g: the set-up
 * first, then each row in order. */
static fm_bench_report *run_ok(fm_bench_opts *o, row_log *g) {
    memset(g, 0, sizeof *g);
    o->on_row = log_row;
    o->row_ctx = g;
    fm_bench_report *r = calloc(1, sizeof *r);
    assert_non_null(r);
    if (fm_bench_run(o, r) != FM_OK) fail_msg("bench: %s", fm_last_error());
    assert_int_equal(g->n, o->n_batches + 1);
    for (int i = 0; i <= o->n_batches; i++) assert_int_equal(g->rows[i], i - 1);
    assert_int_equal(g->n_rows_at_setup, 0);
    assert_int_equal(r->n_rows, o->n_batches);
    return r;
}

static char g_dir[256];

static int setup(void **state) {
    (void)state;
    return fm_test_mkdtemp(g_dir, sizeof g_dir, "test_run");
}

static int teardown(void **state) {
    (void)state;
    fm_test_rm_tree(g_dir);
    return 0;
}

/* A checkpoint of a tiny preset with its first n MoE layers. */
static void gen_model(const char *preset, int n, char *out, size_t cap) {
    fm_model_desc d;
    assert_int_equal(fm_preset_desc(preset, FM_QF_NONE, &d), FM_OK);
    snprintf(out, cap, "%s/%s-%d", g_dir, preset, n);
    struct stat sb;
    if (stat(out, &sb) == 0) return;
    fm_gen_opts go = {.n_moe_layers = n, .seed = 5};
    if (fm_gen_checkpoint(&d, &go, out) != FM_OK) fail_msg("gen %s: %s", preset, fm_last_error());
}

/* ------------------------------------------------------------ bench */

static void test_bench_cpu_preset(void **state) {
    (void)state;
    const int batches[] = {1, 3};
    fm_bench_opts o = cpu_opts(batches, 2);
    row_log g;
    prog_log p = {0};
    o.progress = log_progress;
    o.progress_ctx = &p;
    fm_bench_report *r = run_ok(&o, &g);
    assert_int_equal(g.layers_at_setup, 2);
    /* every operation ended with frac 1 */
    assert_true(p.calls > 0);
    assert_int_equal(p.bad_frac, 0);
    assert_int_equal(p.open, 0);
    assert_true(p.saw_batch3);

    assert_string_equal(r->source, "preset tiny-qwen3");
    assert_int_equal(r->fmt, FM_QF_NVFP4);
    assert_int_equal(r->layers, 2);
    assert_int_equal(r->n_batches, 2);
    assert_true(r->bandwidth_Bps > 0);
    assert_non_null(strstr(r->bandwidth_probe, "8 MiB, 1 threads"));
    assert_int_equal(r->dist_desc[0], 0);

    /* tiny-qwen3: E=16 k=4 H=128 I=64, no shared expert. NVFP4: per matrix
     * I*H/2 packed bytes and I*H/16 scale bytes; the router is F32 [E, H]. */
    const double eb = 3.0 * (64 * 128 / 2 + 64 * 128 / 16), router = 16.0 * 128 * 4;
    for (int i = 0; i < 2; i++) {
        const fm_bench_row *w = &r->rows[i];
        assert_int_equal(w->T, batches[i]);
        assert_true(w->us_per_layer > 0);
        assert_true(w->us_min <= w->us_per_layer && w->us_per_layer <= w->us_max);
        assert_true(fabs(w->tokens_per_s - w->T / (w->us_per_layer * 1e-6)) <= 1e-9 * w->tokens_per_s);
        assert_true(fabs(w->gbps - w->bytes_per_layer / (w->us_per_layer * 1e-6) * 1e-9) <= 1e-9 * w->gbps);
        assert_true(fabs(w->pct_bandwidth - 100.0 * w->gbps * 1e9 / r->bandwidth_Bps) <= 1e-9 * w->pct_bandwidth);
        assert_true(w->active_experts >= 4 && w->active_experts <= 4.0 * w->T);
        /* the bytes of the active experts (the mean over the layers) + router */
        assert_true(fabs((double)w->bytes_per_layer - (w->active_experts * eb + router)) <= 1.0);
        assert_string_equal(w->kernel, r->device_desc);
        assert_int_equal(w->provenance[0], 0);
        char want[64];
        snprintf(want, sizeof want, "provenance: backend=cpu batch=%d kernel=", w->T);
        assert_memory_equal(w->decision, want, strlen(want));
    }
    /* one token picks k distinct experts */
    assert_true(r->rows[0].active_experts == 4.0);
    assert_int_equal(r->rows[0].bytes_per_layer, (int64_t)(4 * eb + router));
    free(r);
}

static void test_bench_model_fewer_layers(void **state) {
    (void)state;
    char dir[512];
    gen_model("tiny-deepseek", 2, dir, sizeof dir);
    const int batches[] = {2};
    fm_bench_opts o = cpu_opts(batches, 1);
    o.preset = NULL;
    o.model_dir = dir;
    o.layers = 5;
    row_log g;
    fm_bench_report *r = run_ok(&o, &g);
    assert_int_equal(r->layers_wanted, 5);
    assert_int_equal(r->layers, 2); /* the checkpoint holds two MoE layers */
    char want[600];
    snprintf(want, sizeof want, "model %s", dir);
    assert_string_equal(r->source, want);
    assert_true(r->rows[0].bytes_per_layer > 0);
    free(r);
}

static void test_bench_sharded(void **state) {
    (void)state;
    const int batches[] = {1, 4};
    fm_bench_opts o = cpu_opts(batches, 2);
    fm_dist_opts dop = {.mode = FM_DIST_TP, .ranks = 2};
    o.dist = &dop;
    row_log g;
    fm_bench_report *r = run_ok(&o, &g);
    assert_true(r->dist_desc[0] != 0);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(r->rows[i].T, batches[i]);
        assert_int_equal(r->dist_rows[i].T, batches[i]);
        assert_int_equal(r->dist_rows[i].ranks, 2);
        assert_true(r->dist_rows[i].us_total > 0);
    }
    /* a split the layer does not allow fails before any row */
    dop.ranks = 3;
    memset(&g, 0, sizeof g);
    assert_int_not_equal(fm_bench_run(&o, r), FM_OK);
    assert_int_equal(g.n, 0);
    free(r);
}

static void test_bench_bad_options(void **state) {
    (void)state;
    const int batches[] = {1, 0};
    fm_bench_report *r = calloc(1, sizeof *r);
    assert_non_null(r);
    row_log g = {0};
    fm_bench_opts o = cpu_opts(batches, 1);
    o.on_row = log_row;
    o.row_ctx = &g;
    assert_int_equal(fm_bench_run(NULL, r), FM_E_ARG);
    assert_int_equal(fm_bench_run(&o, NULL), FM_E_ARG);

    fm_bench_opts b = o;
    b.model_dir = "/nonexistent";
    assert_int_equal(fm_bench_run(&b, r), FM_E_ARG);
    assert_non_null(strstr(fm_last_error(), "exactly one"));
    b = o;
    b.preset = NULL;
    assert_int_equal(fm_bench_run(&b, r), FM_E_ARG);
    b = o;
    b.n_batches = 0;
    assert_int_equal(fm_bench_run(&b, r), FM_E_RANGE);
    b = o;
    b.n_batches = FM_BENCH_MAX_BATCH + 1;
    assert_int_equal(fm_bench_run(&b, r), FM_E_RANGE);
    b = o;
    b.n_batches = 2; /* the second batch is 0 */
    assert_int_equal(fm_bench_run(&b, r), FM_E_RANGE);
    assert_non_null(strstr(fm_last_error(), "batch 0"));
    b = o;
    b.layers = FM_BENCH_MAX_LAYERS + 1;
    assert_int_equal(fm_bench_run(&b, r), FM_E_RANGE);
    b = o;
    b.min_seconds = NAN;
    assert_int_equal(fm_bench_run(&b, r), FM_E_RANGE);
    b = o;
    b.sustain_ms = 100; /* the CPU path has no sustained replays */
    assert_int_equal(fm_bench_run(&b, r), FM_E_ARG);
    b = o;
    b.act = FM_DT_BF16; /* the CPU path feeds F32 */
    assert_int_equal(fm_bench_run(&b, r), FM_E_ARG);
    b = o;
    b.device = FM_DEV_CUDA;
    b.act = FM_DT_I8; /* not an activation type */
    assert_int_equal(fm_bench_run(&b, r), FM_E_ARG);
    {
        fm_shard ep = {.mode = FM_DIST_EP, .ranks = 8, .rank = 0};
        b = o;
        b.device = FM_DEV_CUDA;
        b.act = FM_DT_F16; /* an EP shard feeds the pre-routed call F32 */
        b.shard = &ep;
        assert_int_equal(fm_bench_run(&b, r), FM_E_ARG);
    }
    b = o;
    b.fmt = (fm_qformat)42;
    assert_int_equal(fm_bench_run(&b, r), FM_E_ARG);
    b = o;
    b.preset = "no-such-preset";
    assert_int_not_equal(fm_bench_run(&b, r), FM_OK);
    assert_int_equal(g.n, 0); /* no callback for a run that never started */

    char why[256];
    if (!fm_cuda_available(why, sizeof why)) {
        b = o;
        b.device = FM_DEV_CUDA;
        assert_int_not_equal(fm_bench_run(&b, r), FM_OK);
        assert_int_equal(g.n, 0);
    }
    free(r);
}

/* ------------------------------------------------------------ forward */

static void write_input(const char *path, int T, int H, const float *x) {
    fm_st_writer *w = NULL;
    const int64_t sh[2] = {T, H};
    assert_int_equal(fm_st_writer_new(path, &w), FM_OK);
    assert_int_equal(fm_st_writer_declare(w, "hidden_states", FM_DT_F32, 2, sh), FM_OK);
    assert_int_equal(fm_st_writer_write(w, x, sizeof(float) * (size_t)T * (size_t)H), FM_OK);
    assert_int_equal(fm_st_writer_finish(w), FM_OK);
}

/* fm_forward_file on a checkpoint against the float64 reference on the
 * same layer; sharded (TP over 2 simulated ranks) too. */
static void test_forward_file(void **state) {
    (void)state;
    char dir[512], in[600], out[600];
    gen_model("tiny-qwen3", 2, dir, sizeof dir);
    fm_model_desc d;
    assert_int_equal(fm_model_desc_load(dir, &d), FM_OK);
    const int T = 5, H = d.hidden, k = d.topk, layer = 1;
    float *x = fm_test_normal_new((size_t)T * H, 7, 0x1A), *ref = malloc(sizeof(float) * T * H);
    int32_t *ref_ids = malloc(sizeof(int32_t) * T * k);
    assert_non_null(ref);
    assert_non_null(ref_ids);
    snprintf(in, sizeof in, "%s/in.safetensors", dir);
    write_input(in, T, H, x);

    fm_ckpt *ck = NULL;
    fm_moe_layer *l = NULL;
    assert_int_equal(fm_ckpt_open(dir, &ck), FM_OK);
    assert_int_equal(fm_moe_layer_bind(ck, &d, layer, FM_QF_NONE, &l), FM_OK);
    fm_moe_out ro = {ref, ref_ids, NULL};
    assert_int_equal(fm_moe_forward_ref(&d, l, x, FM_DT_F32, T, NULL, &ro), FM_OK);
    float *got = malloc(sizeof(float) * T * H);
    assert_non_null(got);

    fm_dist_opts dop = {.mode = FM_DIST_TP, .ranks = 2};
    for (int sharded = 0; sharded < 2; sharded++) {
        snprintf(out, sizeof out, "%s/out%d.safetensors", dir, sharded);
        fm_forward_file_opts o = {.model_dir = dir, .input = in, .output = out, .layer = layer,
                                  .device = FM_DEV_CPU, .n_threads = 1, .dist = sharded ? &dop : NULL};
        char info[4096];
        if (fm_forward_file(&o, info, sizeof info) != FM_OK) fail_msg("forward: %s", fm_last_error());
        assert_non_null(strstr(info, sharded ? "sharded" : "wrote"));
        fm_st_file *f = NULL;
        assert_int_equal(fm_st_open(out, &f), FM_OK);
        const fm_st_tensor *hs = fm_st_find(f, "hidden_states"), *ids = fm_st_find(f, "topk_ids");
        assert_non_null(hs);
        assert_non_null(ids);
        assert_int_equal(hs->shape[0], T);
        assert_int_equal(hs->shape[1], H);
        memcpy(got, hs->data, sizeof(float) * T * H); /* the mapping may be unaligned */
        double err = fm_test_rel_err(got, ref, (size_t)T * H);
        if (!(err <= 1e-3)) fail_msg("%s: relative error %g against the float64 reference", sharded ? "tp2" : "cpu", err);
        assert_memory_equal(ids->data, ref_ids, sizeof(int32_t) * T * k);
        fm_st_close(f);
    }

    /* a bad layer fails before any output appears */
    snprintf(out, sizeof out, "%s/bad.safetensors", dir);
    fm_forward_file_opts bad = {.model_dir = dir, .input = in, .output = out, .layer = 7, .device = FM_DEV_CPU};
    assert_int_equal(fm_forward_file(&bad, NULL, 0), FM_E_RANGE);
    assert_int_not_equal(access(out, F_OK), 0);

    fm_moe_layer_free(l);
    fm_ckpt_close(ck);
    free(x);
    free(ref);
    free(ref_ids);
    free(got);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bench_cpu_preset),
        cmocka_unit_test(test_bench_model_fewer_layers),
        cmocka_unit_test(test_bench_sharded),
        cmocka_unit_test(test_bench_bad_options),
        cmocka_unit_test(test_forward_file),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
