/* The layer schedule's K-split rule for the wgmma kernels (schedule.c):
 * the minimum segments per half, the small-grid split, and the split where
 * it fills the last wave of resident blocks, on the shapes it was measured
 * on (docs/history/19-wave-fill-k-split.md). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>

#include "cuda/schedule.h"
#include "cuda/route_shape.h"
#include "fp4moe.h"

static void test_wave_fill(void **state) {
    (void)state;
    assert_true(fabs(fm_sched_wave_fill(792, 792) - 1.0) < 1e-12);
    assert_true(fabs(fm_sched_wave_fill(396, 792) - 0.5) < 1e-12);
    /* one block past a full wave: a second wave holding it alone */
    assert_true(fabs(fm_sched_wave_fill(793, 792) - 793.0 / 1584.0) < 1e-12);
    assert_true(fabs(fm_sched_wave_fill(2000, 792) - 2000.0 / 2376.0) < 1e-12);
    assert_true(fm_sched_wave_fill(0, 792) == 0.0);
    assert_true(fm_sched_wave_fill(10, 0) == 0.0);
}

/* One call of the rule and the split it must give. */
typedef struct {
    const char *what;
    int gu;
    long long blocks, sh_blocks;
    int rows_p, rpb, nseg, E, k, T, max_active, sms, per_sm;
    int want;
} ks_case;

static const ks_case cases[] = {
    /* gate/up: halves of 10 segments or more; down: of 8 */
    {"gate/up, 19 segments", 1, 100, 0, 256, 64, 19, 256, 8, 1, 8, 132, 6, 1},
    {"gate/up, 20 segments", 1, 100, 0, 256, 64, 20, 256, 8, 1, 8, 132, 6, 2},
    {"down, 15 segments", 0, 100, 0, 6144, 128, 15, 256, 8, 1, 8, 132, 6, 1},
    {"down, 16 segments", 0, 100, 0, 6144, 128, 16, 256, 8, 1, 8, 132, 6, 2},
    /* a TP8 rank's down (K 256: 2 segments) never splits */
    {"TP8 down", 0, 12288, 0, 6144, 128, 2, 256, 8, 64, 256, 132, 6, 1},
    {"empty grid", 1, 0, 0, 256, 64, 48, 256, 8, 1, 8, 132, 6, 1},
    /* under 5 blocks per SM: split, whatever the occupancy */
    {"659 blocks, occupancy unknown", 1, 659, 0, 2048, 64, 32, 256, 6, 1, 6, 132, 0, 2},
    {"659 blocks", 1, 659, 0, 2048, 64, 32, 256, 6, 1, 6, 132, 6, 2},
    {"SM count defaults to 132", 1, 659, 0, 2048, 64, 32, 256, 6, 1, 6, 0, 0, 2},
    /* at 5 per SM and above, only with a known occupancy */
    {"660 blocks, occupancy unknown", 1, 660, 0, 2048, 64, 32, 256, 6, 4, 24, 132, 0, 1},
    /* GLM-5's TP8 rank at B = 64: 256 slots x 4 row blocks of 64; ~222.4
     * experts active -> 892 blocks on 6 x 132 = 792 slots, fill 0.56;
     * split 1,784, fill 0.75 */
    {"GLM-5 TP8 B = 64", 1, 1024, 0, 256, 64, 48, 256, 8, 64, 256, 132, 6, 2},
    /* max_active 150, below the expected 222: 600 blocks against 1,200,
     * both 0.76 full */
    {"GLM-5 TP8 B = 64, max_active 150", 1, 1024, 0, 256, 64, 48, 256, 8, 64, 150, 132, 6, 1},
    /* B = 128, 16-token passes (4 blocks per SM): 252 x 4 = 1,008 blocks on
     * 528 slots, 0.95 full either way */
    {"GLM-5 TP8 B = 128", 1, 1024, 0, 256, 64, 48, 256, 8, 128, 256, 132, 4, 1},
    /* the whole DeepSeek-V4-Flash layer at B = 64: ~200 experts x 32 row
     * blocks = 6,400 on 792 slots, 0.90 against 0.95 split */
    {"DeepSeek-V4-Flash B = 64", 1, 8192, 0, 2048, 64, 32, 256, 6, 64, 256, 132, 6, 1},
    /* the shared expert's blocks count: 892 routed and 700 shared, 1,592
     * on 792 slots (0.67 full) against 3,184 (0.80): under the margin */
    {"GLM-5 TP8 B = 64 with 700 shared blocks", 1, 1724, 700, 256, 64, 48, 256, 8, 64, 256, 132, 6, 1},
    /* gate/up in quarters where 4 x blocks <= 3 x SMs and K has 32
     * segments or more: the TP8 ranks at B = 2 (16 or 12 experts x 4 row
     * blocks) and DeepSeek-V4-Flash's at B = 4 (24 x 4) */
    {"GLM-5 TP8 B = 2", 1, 64, 0, 256, 64, 48, 256, 8, 2, 16, 132, 4, 4},
    {"DeepSeek-V4-Flash TP8 B = 4", 1, 96, 0, 256, 64, 32, 256, 6, 4, 24, 132, 4, 4},
    {"99 blocks on 132 SMs", 1, 99, 0, 256, 64, 48, 256, 8, 4, 32, 132, 4, 4},
    {"SM count defaults to 132, quarters", 1, 99, 0, 256, 64, 48, 256, 8, 4, 32, 0, 4, 4},
    {"31 segments: thirds, not quarters", 1, 64, 0, 256, 64, 31, 256, 8, 2, 16, 132, 4, 3},
    {"down never in quarters", 0, 64, 0, 6144, 128, 48, 256, 8, 2, 16, 132, 4, 2},
    /* in thirds where quarters would exceed 3 blocks per SM, the grid is at
     * most one block per SM and K has 24 segments or more: GLM-5's and
     * Kimi-K2's TP8 ranks at B = 4 (32 x 4) */
    {"GLM-5 TP8 B = 4", 1, 128, 0, 256, 64, 48, 256, 8, 4, 32, 132, 4, 3},
    {"Kimi-K2 TP8 B = 4", 1, 128, 0, 256, 64, 56, 384, 8, 4, 32, 132, 4, 3},
    {"100 blocks on 132 SMs", 1, 100, 0, 256, 64, 48, 256, 8, 4, 32, 132, 4, 3},
    {"132 blocks on 132 SMs", 1, 132, 0, 256, 64, 48, 256, 8, 4, 33, 132, 4, 3},
    {"133 blocks on 132 SMs: halves", 1, 133, 0, 256, 64, 48, 256, 8, 4, 34, 132, 4, 2},
    {"SM count defaults to 132, thirds", 1, 132, 0, 256, 64, 48, 256, 8, 4, 33, 0, 4, 3},
    {"24 segments: thirds", 1, 128, 0, 256, 64, 24, 256, 8, 4, 32, 132, 4, 3},
    {"23 segments: halves", 1, 128, 0, 256, 64, 23, 256, 8, 4, 32, 132, 4, 2},
    {"down never in thirds", 0, 128, 0, 6144, 128, 48, 256, 8, 4, 32, 132, 4, 2},
};

/* The splitk grids: GLM-5's TP8 rank at B = 1 (gate rows 256, shared 256,
 * 8 experts, 16 K chunks) is 288 gate/up blocks; down runs three per SM
 * only where 2 per SM take more than one wave, at one token tile and K of
 * at most two segments. */
/* The wgmma launch's work items: GLM-5's TP8 gate/up at B = 2 (16 slots x
 * 4 row blocks of 64, the shared expert on its own stream), the same with
 * the shared expert's 4 row blocks in the launch at B = 40 (three 16-token
 * chunks), a row count not a multiple of the block. */
static void test_wg_items(void **state) {
    (void)state;
    int shc = -1;
    long long shb = -1;
    assert_true(fm_sched_wg_items(16, 256, 0, 64, 2, 16, &shc, &shb) == 64);
    assert_int_equal(shc, 0);
    assert_true(shb == 0);
    assert_true(fm_sched_wg_items(32, 256, 256, 64, 40, 16, &shc, &shb) == 32 * 4 + 12);
    assert_int_equal(shc, 3);
    assert_true(shb == 12);
    assert_true(fm_sched_wg_items(3, 200, 0, 64, 1, 8, &shc, &shb) == 12);
    assert_true(fm_sched_wg_items(0, 256, 256, 64, 1, 8, &shc, &shb) == 4);
}

static void test_splitk_grids(void **state) {
    (void)state;
    assert_true(fm_sched_splitk_gu_blocks(256, 256, 8, 16) == 288);
    assert_true(fm_sched_splitk_gu_blocks(256, 0, 8, 16) == 256);
    assert_true(fm_sched_splitk_gu_blocks(256, 256, 6, 11) == 154); /* DeepSeek-V4-Flash TP8 */
    assert_true(fm_sched_splitk_gu_blocks(128, 0, 3, 3) == 9);
    assert_true(fm_sched_splitk_gu_blocks(256, 256, 8, 0) == 0);
    /* a grid past 2^31 - 1 blocks is counted without overflow (the launch
     * refuses it by this count) */
    assert_true(fm_sched_splitk_gu_blocks(1 << 24, 0, 4096, 16) == (1LL << 20) * 4096 * 16 / 8);
    assert_true(fm_sched_splitk_gu_blocks(1 << 24, 0, 4096, 16) > 0x7fffffffLL);
    assert_int_equal(fm_sched_splitk_down_per_sm(6144, 1, 2, 132), 3); /* GLM-5: 384 blocks */
    assert_int_equal(fm_sched_splitk_down_per_sm(7168, 1, 2, 132), 3); /* Kimi-K2: 448 */
    assert_int_equal(fm_sched_splitk_down_per_sm(4096, 1, 2, 132), 2); /* 256 blocks: one wave at 2 */
    assert_int_equal(fm_sched_splitk_down_per_sm(4224, 1, 2, 132), 2); /* exactly 264 */
    assert_int_equal(fm_sched_splitk_down_per_sm(4240, 1, 2, 132), 3);
    assert_int_equal(fm_sched_splitk_down_per_sm(6144, 2, 2, 132), 2); /* 16-token tiles */
    assert_int_equal(fm_sched_splitk_down_per_sm(6144, 1, 3, 132), 2); /* K of 3 segments */
    assert_int_equal(fm_sched_splitk_down_per_sm(6144, 1, 2, 192), 2); /* 384 blocks on 192 SMs */
    assert_int_equal(fm_sched_splitk_down_per_sm(6144, 1, 2, 0), 3);   /* unknown SMs: 132 */
}

/* The one-token launch's shared memory, worked by hand: GLM-5's TP8 rank
 * (H 6144, I 256, k 8, NVFP4): x 12,288 bytes; gate and up 48 segments of
 * 1,024 bytes each, then their scales 48 x 128 each (122,880); down's slice
 * of 384 / 16 = 24 row groups of 2 segments of 1,152 bytes (55,296), the
 * shared sub-slice ceil(24 / 8) = 3 of them (6,912); two h rows of 256
 * BF16 (1,024): 186,112 bytes. Kimi-K2's (H 7168, k 8): 218,112, still
 * under sm_90's 232,448; MXFP4 scales are half as large. */
static void test_fused1_layout(void **state) {
    (void)state;
    fm_fused1_layout L;
    assert_int_equal(fm_sched_fused1_layout(6144, 256, 6144, 6144, 256, 8, 0, &L), 0);
    assert_int_equal(L.x, 0);
    assert_int_equal(L.gw, 12288);
    assert_int_equal(L.uw, 12288 + 49152);
    assert_int_equal(L.gs, 12288 + 2 * 49152);
    assert_int_equal(L.us, 12288 + 2 * 49152 + 6144);
    assert_int_equal(L.dn, 122880);
    assert_int_equal(L.sdn, 122880 + 55296);
    assert_int_equal(L.h, 122880 + 55296 + 6912);
    assert_int_equal(L.total, 186112);
    assert_int_equal(fm_sched_fused1_layout(7168, 256, 7168, 7168, 256, 8, 0, &L), 0);
    assert_int_equal(L.total, 218112);
    assert_int_equal(fm_sched_fused1_layout(6144, 256, 6144, 6144, 256, 8, 1, &L), 0);
    assert_int_equal(L.us - L.gs, 48 * 64);
    assert_int_equal(L.total, 12288 + 2 * 49152 + 2 * 3072 + 24 * 2 * 1088 + 3 * 2 * 1088 + 1024);
    /* every region 16-byte aligned (the bulk copies' rule), in order */
    assert_int_equal(fm_sched_fused1_layout(4096, 256, 4096, 4096, 256, 6, 0, &L), 0);
    const int at[] = {L.x, L.gw, L.uw, L.gs, L.us, L.dn, L.sdn, L.h, L.total};
    for (int i = 0; i < 9; i++) {
        assert_int_equal(at[i] % 16, 0);
        if (i) assert_true(at[i] > at[i - 1]);
    }
    /* the rule the engine and `explain` share: GLM-5's TP8 rank at one token
     * fits an H200 (sm_90, 227 KB a block, 132 SMs); each condition alone
     * gives its reason */
    const fm_fused1_shape glm = {.T = 1, .k_active = 8, .Hp = 6144, .gate_rows_p = 256, .gate_kp = 6144,
                                 .down_rows_p = 6144, .down_kp = 256, .sgate_rows_p = 256, .sgate_kp = 6144,
                                 .sdown_rows_p = 6144, .sdown_kp = 256, .mx = 0};
    assert_null(fm_sched_fused1_why(&glm, 90, 232448, 132, &L));
    assert_int_equal(L.total, 186112);
    assert_null(fm_sched_fused1_why(&glm, 0, 0, 0, &L)); /* unknown GPU: nothing of it checked */
    fm_fused1_shape c = glm;
    c.T = 2;
    assert_string_equal(fm_sched_fused1_why(&c, 90, 232448, 132, &L), "takes one token");
    assert_int_equal(L.total, 0);
    c = glm;
    c.sgate_rows_p = 0;
    assert_string_equal(fm_sched_fused1_why(&c, 90, 232448, 132, &L), "no shared expert");
    c = glm;
    c.sgate_rows_p = 384;
    c.sdown_kp = 384;
    assert_string_equal(fm_sched_fused1_why(&c, 90, 232448, 132, &L),
                        "the shared expert is not as wide as the routed ones");
    assert_string_equal(fm_sched_fused1_why(&glm, 80, 232448, 132, &L), "needs sm_90 or later");
    c = glm;
    c.gate_rows_p = c.sgate_rows_p = 640;
    c.down_kp = c.sdown_kp = 640;
    assert_string_equal(fm_sched_fused1_why(&c, 90, 232448, 132, &L), "takes experts of I up to 512");
    c = glm;
    c.down_rows_p = c.sdown_rows_p = 128;
    assert_string_equal(fm_sched_fused1_why(&c, 90, 232448, 132, &L), "down has fewer row groups than gate/up");
    c = glm;
    c.k_active = 17;
    assert_string_equal(fm_sched_fused1_why(&c, 90, 232448, 132, &L), "the shape is out of its range");
    assert_string_equal(fm_sched_fused1_why(&glm, 120, 101376, 188, &L),
                        "its shared memory per block is more than the GPU's");
    assert_string_equal(fm_sched_fused1_why(&glm, 90, 232448, 114, &L), "its blocks are more than the SMs");
    /* the launch's own top-k: the elementwise families (GLM-5's, DeepSeek-V4's)
     * at E 256 beside a 6144-wide gate; the reasons it is not */
    assert_null(fm_sched_fused1_selects(FM_ROUTE_NOAUX_TC, 0, 256));
    assert_null(fm_sched_fused1_selects(FM_ROUTE_DSV4, 0, 256));
    assert_string_equal(fm_sched_fused1_selects(FM_ROUTE_SOFTMAX, 0, 256),
                        "the routing family's scores are not expert by expert (softmax or gpt-oss)");
    assert_string_equal(fm_sched_fused1_selects(FM_ROUTE_GPTOSS, 0, 128),
                        "the routing family's scores are not expert by expert (softmax or gpt-oss)");
    assert_string_equal(fm_sched_fused1_selects(FM_ROUTE_DSV4, 1, 256), "a hash-routed layer");
    /* 13 bytes an expert, rounded up to 16 (one token's selection), and to
     * 128 past the launch's layout: 256 experts take 3,328 bytes either way,
     * 61 take 832 and 896 */
    assert_int_equal(FM_SEL_WARP_BYTES(256), 3328);
    assert_int_equal(FM_SEL_WARP_BYTES(61), 832);
    assert_int_equal(FM_FUSED1_SEL_BYTES(256), 3328);
    assert_int_equal(FM_FUSED1_SEL_BYTES(61), 896);
    assert_int_equal(FM_FUSED1_SEL_BYTES(384), 4992);
    assert_string_equal(fm_sched_fused1_selects(FM_ROUTE_NOAUX_TC, 0, 0), "no experts");
    assert_non_null(fm_sched_fused1_selects(FM_ROUTE_NOAUX_TC, 0, -3));
    /* the shared memory counts the top-k's scratch past the layout (every
     * build of the launch must be resident): GLM-5's 256 experts fit an
     * H200 with it; a block of the layout's bytes and less than the
     * scratch more does not, while the same shape without experts (no
     * scratch counted) does */
    c = glm;
    c.E = 256;
    assert_null(fm_sched_fused1_why(&c, 90, 232448, 132, &L));
    assert_int_equal(L.total, 186112);
    assert_string_equal(fm_sched_fused1_why(&c, 90, 186112 + 3327, 132, &L),
                        "its shared memory per block is more than the GPU's");
    assert_null(fm_sched_fused1_why(&c, 90, 186112 + 3328, 132, &L));
    assert_null(fm_sched_fused1_why(&glm, 90, 186112, 132, &L));
    /* sizes out of range: -1 and a zero layout */
    const int bad[][7] = {{0, 256, 6144, 6144, 256, 8, 0},    {6100, 256, 6144, 6144, 256, 8, 0},
                          {6144, 250, 6144, 6144, 256, 8, 0}, {6144, 256, 6144, 6144, 200, 8, 0},
                          {6144, 256, 6144, 6144, 256, 0, 0}, {6144, 256, 6144, 6144, 256, 17, 0},
                          {6144, 256, 6144, 8, 256, 8, 0},    {1 << 20, 256, 6144, 6144, 256, 8, 0}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(fm_sched_fused1_layout(bad[i][0], bad[i][1], bad[i][2], bad[i][3], bad[i][4], bad[i][5],
                                                bad[i][6], &L),
                         -1);
        assert_int_equal(L.total, 0);
    }
}

static void test_ksplit(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const ks_case *c = &cases[i];
        int got = fm_sched_wg_ksplit(c->gu, c->blocks, c->sh_blocks, c->rows_p, c->rpb, c->nseg, c->E, c->k, c->T,
                                     c->max_active, c->sms, c->per_sm);
        if (got != c->want) fail_msg("%s: split %d, expected %d", c->what, got, c->want);
    }
}

/* Down's row chunks per block: GLM-5's TP8 rank (H 6144, 48 chunks of 128
 * rows, K of 2 segments) at B = 16 expects 102 active experts, 4,896
 * blocks on 660 slots of the 8-token kernel (7.4 waves): 4, the most that K
 * of 2 segments takes; at B = 4 31 experts, 1,488 blocks on the 16-token
 * kernel's 528 slots (2.8 waves): 4 (halved twice, 0.7 waves); DeepSeek-V4-
 * Flash's rank at B = 4 24 experts, 768 blocks (1.45 waves): 2 (0.73 waves;
 * 4 would leave 0.36); the whole layer's K of 16 segments never; K of one
 * segment up to 8. */
typedef struct {
    const char *what;
    long long sh_blocks;
    int rows_p, rpb, nseg, E, k, T, max_active, sms, per_sm, want;
} dc_case;

static const dc_case dc_cases[] = {
    {"GLM-5 TP8 B = 16, 8-token kernel", 0, 6144, 128, 2, 256, 8, 16, 128, 132, 5, 4},
    {"GLM-5 TP8 B = 256, 32-token kernel", 0, 6144, 128, 2, 256, 8, 256, 256, 132, 4, 4},
    {"GLM-5 TP8 B = 4, 16-token kernel", 0, 6144, 128, 2, 256, 8, 4, 32, 132, 4, 4},
    {"DeepSeek-V4-Flash TP8 B = 4", 0, 4096, 128, 2, 256, 6, 4, 24, 132, 4, 2},
    /* under one wave (0.97: 512 blocks on 528 slots) a grid is not halved */
    {"just under one wave", 0, 2048, 128, 2, 128, 8, 256, 32, 132, 4, 1},
    {"DeepSeek-V4-Flash whole layer, K of 16 segments", 0, 4096, 128, 16, 256, 6, 256, 256, 132, 5, 1},
    /* K of one segment (Qwen3-30B-A3B's TP8 rank, I 96): 2,048 blocks on 792 slots (2.6 waves) */
    {"K of one segment", 0, 2048, 128, 1, 128, 8, 256, 128, 132, 6, 4},
    {"K of one segment, one block per SM", 0, 2048, 128, 1, 128, 8, 256, 128, 132, 1, 8},
    /* the shared expert's blocks count: 500 routed + 1,000 shared on 660 slots */
    {"500 routed blocks", 0, 6400, 128, 2, 10, 10, 64, 10, 132, 5, 1},
    {"500 routed and 1,000 shared blocks", 1000, 6400, 128, 2, 10, 10, 64, 10, 132, 5, 4},
    {"rows not whole chunks (gpt-oss's 2,880)", 0, 2880, 128, 2, 256, 8, 256, 256, 132, 5, 1},
    {"unknown occupancy", 0, 6144, 128, 2, 256, 8, 256, 256, 132, 0, 1},
    {"no experts", 0, 6144, 128, 2, 0, 8, 256, 0, 132, 5, 1},
    {"no K", 0, 6144, 128, 0, 256, 8, 256, 256, 132, 5, 1},
    {"unknown SMs count as 132", 0, 6144, 128, 2, 256, 8, 16, 128, 0, 5, 4},
};

static void test_down_chunks(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof dc_cases / sizeof dc_cases[0]; i++) {
        const dc_case *c = &dc_cases[i];
        int got = fm_sched_wg_down_chunks(c->sh_blocks, c->rows_p, c->rpb, c->nseg, c->E, c->k, c->T, c->max_active,
                                          c->sms, c->per_sm);
        if (got != c->want) fail_msg("%s: %d chunks, expected %d", c->what, got, c->want);
    }
    /* the most chunks, whatever the grid: 8 segments per block, at most 8 chunks */
    assert_int_equal(fm_sched_wg_down_chunks_max(6144, 128, 2), 4);
    assert_int_equal(fm_sched_wg_down_chunks_max(6144, 128, 1), 8);
    assert_int_equal(fm_sched_wg_down_chunks_max(6144, 128, 3), 2);
    assert_int_equal(fm_sched_wg_down_chunks_max(4096, 128, 16), 1);
    assert_int_equal(fm_sched_wg_down_chunks_max(2880, 128, 2), 1);
    assert_int_equal(fm_sched_wg_down_chunks_max(6144, 128, 0), 1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wave_fill),
        cmocka_unit_test(test_splitk_grids),
        cmocka_unit_test(test_wg_items),
        cmocka_unit_test(test_fused1_layout),
        cmocka_unit_test(test_ksplit),
        cmocka_unit_test(test_down_chunks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
