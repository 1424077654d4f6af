/*
 * One rank's share on one device (fm_shard, `--shard`): parsing, the rank's
 * shape, and that the ranks' outputs add up to the whole layer as the
 * float64 reference computes it (TP: the slices of every expert through the
 * CPU engine; EP: each rank's experts on the pairs of the full routing,
 * the shared expert on the rank's token chunk).
 */
#include "fm_test.h"
#include "parallel/parallel_internal.h"

static void test_parse(void **st) {
    (void)st;
    fm_shard s;
    assert_int_equal(fm_shard_parse("tp:8", &s), FM_OK);
    assert_int_equal(s.mode, FM_DIST_TP);
    assert_int_equal(s.ranks, 8);
    assert_int_equal(s.rank, 0);
    assert_int_equal(fm_shard_parse("tp:8/7", &s), FM_OK);
    assert_int_equal(s.rank, 7);
    assert_int_equal(fm_shard_parse("ep:8/3", &s), FM_OK);
    assert_int_equal(s.mode, FM_DIST_EP);
    assert_int_equal(s.rank, 3);
    const char *bad[] = {"", "tp", "tp:", "tp:8/", "tp:8/8", "ep:8", "ep:0/0", "tp:-1", "tp:8/1x", "xp:2",
                         "tp:257", "tp:1234567", "ep:2/ 1", "TP:2"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_not_equal(fm_shard_parse(bad[i], &s), FM_OK);
        assert_non_null(strstr(fm_last_error(), "--shard"));
    }
}

static void test_desc(void **st) {
    (void)st;
    fm_model_desc d, v;
    assert_int_equal(fm_preset_desc("glm-5", FM_QF_NONE, &d), FM_OK);
    fm_shard tp8 = {FM_DIST_TP, 8, 0}, ep8 = {FM_DIST_EP, 8, 5};
    assert_int_equal(fm_shard_desc(&d, FM_QF_NONE, &tp8, &v), FM_OK);
    assert_int_equal(v.moe_inter, 256);
    assert_int_equal(v.shared_inter, 256);
    assert_int_equal(v.n_experts, 256);
    assert_int_equal(v.topk, 8);
    char buf[192];
    fm_shard_describe(&tp8, &d, buf, sizeof buf);
    assert_string_equal(buf, "tp 8 rank 0 (I 256 of 2048, shared 256 of 2048)");
    assert_int_equal(fm_shard_desc(&d, FM_QF_NONE, &ep8, &v), FM_OK);
    assert_int_equal(v.n_experts, 32);
    assert_int_equal(v.topk, 8);
    assert_int_equal(v.moe_inter, 2048);
    assert_int_equal(v.n_shared, 1); /* replicated, on the rank's token chunk */
    fm_shard_describe(&ep8, &d, buf, sizeof buf);
    assert_non_null(strstr(buf, "ep 8 rank 5 (experts 160..191 of 256"));
    /* 2048/128 = 16 is a multiple of the NVFP4 block, not of MXFP4's 32 */
    fm_shard tp128 = {FM_DIST_TP, 128, 0}, ep3 = {FM_DIST_EP, 3, 0}, tp3 = {FM_DIST_TP, 3, 0};
    assert_int_equal(fm_shard_desc(&d, FM_QF_NVFP4, &tp128, &v), FM_OK);
    assert_int_not_equal(fm_shard_desc(&d, FM_QF_MXFP4, &tp128, &v), FM_OK);
    assert_non_null(strstr(fm_last_error(), "scale block (32)"));
    assert_int_not_equal(fm_shard_desc(&d, FM_QF_NONE, &ep3, &v), FM_OK);
    assert_non_null(strstr(fm_last_error(), "E=256 experts are not divisible by 3"));
    assert_int_not_equal(fm_shard_desc(&d, FM_QF_NONE, &tp3, &v), FM_OK);
    assert_non_null(strstr(fm_last_error(), "I=2048 is not divisible by 3"));
    /* mixtral EP8: one expert a rank, top-k capped at it */
    assert_int_equal(fm_preset_desc("mixtral-8x7b", FM_QF_NONE, &d), FM_OK);
    fm_shard ep8m = {FM_DIST_EP, 8, 7};
    assert_int_equal(fm_shard_desc(&d, FM_QF_NONE, &ep8m, &v), FM_OK);
    assert_int_equal(v.n_experts, 1);
    assert_int_equal(v.topk, 1);
}

/* The bytes a rank reads for a hand-made routing of GLM-5 (E 256, k 8,
 * H 6144, I 2048, one shared expert of 2048), counted from the shapes. */
static void test_load_bytes(void **st) {
    (void)st;
    fm_model_desc d;
    assert_int_equal(fm_preset_desc("glm-5", FM_QF_NVFP4, &d), FM_OK);
    const int32_t ids[2 * 8] = {0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 40, 41, 42, 250};
    const int64_t H = 6144;
    fm_shard_load ld;
    fm_shard tp = {FM_DIST_TP, 8, 5};
    assert_int_equal(fm_shard_load_of(&d, FM_QF_NVFP4, &tp, ids, 2, &ld), FM_OK);
    const int64_t slice = 3 * (256 * H / 2 + 256 * H / 16); /* gate, up, down of I/8 = 256, with scales */
    for (int p = 0; p < 8; p++) {
        assert_int_equal(ld.active[p], 12);
        assert_int_equal(ld.pairs[p], 16);
        assert_int_equal(ld.bytes[p], 12 * slice + slice); /* + the shared expert's slice */
    }
    assert_int_equal(ld.router_bytes, 256 * H * 4);
    fm_shard ep = {FM_DIST_EP, 8, 1};
    assert_int_equal(fm_shard_load_of(&d, FM_QF_NVFP4, &ep, ids, 2, &ld), FM_OK);
    const int64_t whole = 3 * (2048 * H / 2 + 2048 * H / 16);
    /* chunks of ceil(2/8) = 1 token: the shared expert on ranks 0 and 1 */
    const int64_t want_pairs[8] = {12, 3, 0, 0, 0, 0, 0, 1}, want_active[8] = {8, 3, 0, 0, 0, 0, 0, 1};
    for (int p = 0; p < 8; p++) {
        assert_int_equal(ld.pairs[p], want_pairs[p]);
        assert_int_equal(ld.active[p], want_active[p]);
        assert_int_equal(ld.bytes[p], want_active[p] * whole + (p < 2 ? whole : 0));
    }
    assert_int_equal(ld.max_rank, 0);
    /* the bench's floor for the rank is its bytes over the bandwidth: the
     * local ids of rank 1 hold exactly its 3 pairs */
    int32_t lids[2 * 8];
    float w[2 * 8], lw[2 * 8];
    for (int i = 0; i < 16; i++) w[i] = 1.0f / 8;
    assert_int_equal(fm_shard_local_ids(&ep, 256, 8, 2, ids, w, 8, lids, lw), 3);
    assert_int_equal(lids[8], 40 - 32);
    assert_int_equal(lids[9], 41 - 32);
    assert_int_equal(lids[10], 42 - 32);
    assert_int_equal(lids[11], -1);
    assert_int_equal(lids[0], -1);
}

/* Loads of several routings add up rank by rank, and the most loaded rank
 * is chosen over the sums (bytes, then pairs, then the lower index). */
static void test_load_add(void **st) {
    (void)st;
    fm_shard_load a, b, sum;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    memset(&sum, 0, sizeof sum);
    a.ranks = b.ranks = 3;
    a.router_bytes = b.router_bytes = 99;
    const int64_t ap[3] = {5, 1, 0}, aa[3] = {2, 1, 0}, ab[3] = {200, 100, 0};
    const int64_t bp[3] = {0, 2, 6}, ba[3] = {0, 1, 2}, bb[3] = {0, 100, 200};
    for (int p = 0; p < 3; p++) {
        a.pairs[p] = ap[p], a.active[p] = (int)aa[p], a.bytes[p] = ab[p];
        b.pairs[p] = bp[p], b.active[p] = (int)ba[p], b.bytes[p] = bb[p];
    }
    fm_shard_load_add(&sum, &a);
    assert_int_equal(sum.ranks, 3);
    assert_int_equal(sum.max_rank, 0);
    fm_shard_load_add(&sum, &b);
    /* bytes 200 / 200 / 200: rank 2 has the most pairs (6 against 5 and 3) */
    const int64_t wp[3] = {5, 3, 6}, wa[3] = {2, 2, 2};
    for (int p = 0; p < 3; p++) {
        assert_int_equal(sum.pairs[p], wp[p]);
        assert_int_equal(sum.active[p], wa[p]);
        assert_int_equal(sum.bytes[p], 200);
    }
    assert_int_equal(sum.max_rank, 2);
    assert_int_equal(sum.router_bytes, 99);
    b.pairs[2] = 5; /* all tied on bytes, 0 and 2 on pairs: the lower index */
    memset(&sum, 0, sizeof sum);
    fm_shard_load_add(&sum, &a);
    fm_shard_load_add(&sum, &b);
    assert_int_equal(sum.max_rank, 0);
}

/* An EP rank's view: its E/R experts (the layer's own matrices, not
 * copies) with the whole shared expert; the work buffers refuse more
 * tokens than they were sized for. */
static void test_ep_view_and_work(void **st) {
    (void)st;
    fm_model_desc d;
    assert_int_equal(fm_preset_desc("tiny-deepseek", FM_QF_NVFP4, &d), FM_OK);
    int layer = 0;
    while (!fm_model_is_moe_layer(&d, layer)) layer++;
    fm_moe_layer *l = NULL;
    assert_int_equal(fm_moe_layer_random(&d, FM_QF_NVFP4, 3, layer, &l), FM_OK);
    fm_shard sh = {FM_DIST_EP, 4, 2};
    fm_shard_ep_work w;
    assert_int_equal(fm_shard_ep_work_init(&w, &d, &sh, 5), FM_OK);
    assert_int_equal(w.kl, 4);
    fm_model_desc dv;
    fm_moe_layer lv;
    fm_shard_ep_view(&d, l, &sh, w.zero_router, &dv, &lv);
    assert_int_equal(dv.n_experts, 4);
    assert_int_equal(lv.n_experts, 4);
    assert_ptr_equal(lv.gate, l->gate + 8);
    assert_ptr_equal(lv.down, l->down + 8);
    assert_int_equal(lv.has_shared, 1);
    assert_int_equal(dv.n_shared, d.n_shared);
    assert_ptr_equal(lv.sh_gate.packed, l->sh_gate.packed);
    /* ceil(5/4) = 2 tokens a chunk: rank 2 runs the shared expert on token 4 */
    for (int i = 0; i < 2 * 4; i++) assert_int_equal(w.none[i], -1);
    const int H = d.hidden;
    float *x = fm_test_normal_new((size_t)6 * H, 5, 79), *out = calloc((size_t)6 * H, sizeof(float));
    fm_cpu_engine *e = NULL;
    assert_int_equal(fm_cpu_engine_new(FM_CPU_AUTO, 1, &e), FM_OK);
    for (int i = 0; i < 5 * 4; i++) w.lids[i] = -1; /* no routed pair: only the shared expert's token */
    assert_int_equal(fm_shard_ep_run_cpu(e, &d, l, &sh, x, 5, w.lids, w.lw, &w, out), FM_OK);
    for (int t = 0; t < 5; t++) {
        double n2 = 0;
        for (int c = 0; c < H; c++) n2 += (double)out[(size_t)t * H + c] * out[(size_t)t * H + c];
        if (t == 4) assert_true(n2 > 0);
        else assert_true(n2 == 0);
    }
    assert_int_not_equal(fm_shard_ep_run_cpu(e, &d, l, &sh, x, 6, w.lids, w.lw, &w, out), FM_OK);
    assert_non_null(strstr(fm_last_error(), "work buffers for 5 tokens, not 6"));
    fm_shard bad = {FM_DIST_EP, 3, 0};
    fm_shard_ep_work w3;
    assert_int_not_equal(fm_shard_ep_work_init(&w3, &d, &bad, 5), FM_OK);
    assert_null(w3.lids);
    fm_shard_ep_work_free(&w);
    fm_cpu_engine_free(e);
    free(x);
    free(out);
    fm_moe_layer_free(l);
}

/* The float64 reference of the whole layer against the sum over ranks of
 * fm_shard_forward_cpu. */
static void check_sum(const char *preset, fm_qformat fmt, fm_dist_mode mode, int R, int T) {
    fm_model_desc d;
    assert_int_equal(fm_preset_desc(preset, fmt, &d), FM_OK);
    int layer = 0;
    while (!fm_model_is_moe_layer(&d, layer)) layer++;
    fm_moe_layer *l = NULL;
    assert_int_equal(fm_moe_layer_random(&d, fmt, 11, layer, &l), FM_OK);
    fm_cpu_engine *e = NULL;
    assert_int_equal(fm_cpu_engine_new(FM_CPU_AUTO, 2, &e), FM_OK);
    const int H = d.hidden, k = d.topk;
    float *x = fm_test_normal_new((size_t)T * H, 5, 77);
    int32_t *tid = calloc((size_t)T, sizeof *tid);
    fm_test_token_ids(tid, T, 5, 78, d.vocab_size);
    float *ref = calloc((size_t)T * H, sizeof(float)), *sum = calloc((size_t)T * H, sizeof(float)),
          *part = calloc((size_t)T * H, sizeof(float));
    int32_t *rids = calloc((size_t)T * k, sizeof(int32_t)), *ids = calloc((size_t)T * k, sizeof(int32_t));
    float *rw = calloc((size_t)T * k, sizeof(float)), *w = calloc((size_t)T * k, sizeof(float));
    fm_moe_out o = {ref, rids, rw};
    assert_int_equal(fm_moe_forward_ref(&d, l, x, FM_DT_F32, T, tid, &o), FM_OK);
    int64_t pairs = 0;
    for (int r = 0; r < R; r++) {
        fm_shard sh = {mode, R, r};
        fm_shard_load ld;
        assert_int_equal(fm_shard_forward_cpu(e, &d, l, &sh, x, FM_DT_F32, T, tid, part, ids, w, &ld), FM_OK);
        assert_memory_equal(ids, rids, sizeof(int32_t) * (size_t)T * k); /* the full routing */
        for (size_t i = 0; i < (size_t)T * H; i++) sum[i] += part[i];
        if (mode == FM_DIST_EP) pairs += ld.pairs[r];
        else assert_int_equal(ld.pairs[r], (int64_t)T * k);
    }
    if (mode == FM_DIST_EP) assert_int_equal(pairs, (int64_t)T * k);
    double err = fm_test_rel_err(sum, ref, (size_t)T * H);
    if (err > 2e-5) fail_msg("%s %s %d ranks, T=%d: rel. error %.3g against the float64 reference", preset,
                             mode == FM_DIST_TP ? "tp" : "ep", R, T, err);
    free(x); free(tid); free(ref); free(sum); free(part); free(rids); free(ids); free(rw); free(w);
    fm_cpu_engine_free(e);
    fm_moe_layer_free(l);
}

static void test_tp_sum(void **st) {
    (void)st;
    check_sum("tiny-deepseek", FM_QF_NVFP4, FM_DIST_TP, 2, 5);  /* shared expert, grouped noaux_tc */
    check_sum("tiny-deepseek", FM_QF_NVFP4, FM_DIST_TP, 4, 3);
    check_sum("tiny-gptoss", FM_QF_MXFP4, FM_DIST_TP, 2, 4);    /* biases: down's on rank 0 only */
    check_sum("tiny-qwen3", FM_QF_BF16, FM_DIST_TP, 4, 2);
}

static void test_ep_sum(void **st) {
    (void)st;
    check_sum("tiny-deepseek", FM_QF_NVFP4, FM_DIST_EP, 4, 5); /* shared expert on each rank's chunk */
    check_sum("tiny-deepseek", FM_QF_NVFP4, FM_DIST_EP, 8, 3); /* more ranks than tokens: empty chunks */
    check_sum("tiny-qwen3", FM_QF_NVFP4, FM_DIST_EP, 2, 7);
    check_sum("tiny-mixtral", FM_QF_NVFP4, FM_DIST_EP, 8, 4);  /* one expert a rank, top-2 */
    check_sum("tiny-gptoss", FM_QF_MXFP4, FM_DIST_EP, 4, 3);
    check_sum("tiny-deepseek-v4", FM_QF_MXFP4, FM_DIST_EP, 2, 3); /* hash-routed first layer */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse),
        cmocka_unit_test(test_desc),
        cmocka_unit_test(test_load_bytes),
        cmocka_unit_test(test_load_add),
        cmocka_unit_test(test_ep_view_and_work),
        cmocka_unit_test(test_tp_sum),
        cmocka_unit_test(test_ep_sum),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
