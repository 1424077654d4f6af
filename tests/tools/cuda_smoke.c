/* One small CUDA forward per routing family, for compute-sanitizer
 * (memcheck / racecheck) runs: exits non-zero on any error or NaN. */
#include "fp4moe.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

int main(void) {
    const char *presets[] = {"tiny-deepseek", "tiny-deepseek-v4", "tiny-qwen3", "tiny-mixtral", "tiny-gptoss"};
    fm_cuda_engine *e;
    if (fm_cuda_engine_new(0, &e)) { fprintf(stderr, "cuda_smoke: %s\n", fm_last_error()); return 1; }
    int bad = 0;
    /* the five tiny presets, then tiny-deepseek with 512 experts and k = 9
     * (four 128-expert chunks per selection lane; at T = 8, two selection
     * blocks grouping its 72 pairs together) */
    for (int p = 0; p < 6; p++) {
        fm_model_desc d;
        if (fm_preset_desc(presets[p < 5 ? p : 0], FM_QF_NONE, &d)) { fprintf(stderr, "%s\n", fm_last_error()); return 1; }
        if (p == 5) {
            d.n_experts = 512;
            d.topk = 9;
        }
        int L = 0;
        while (!fm_model_is_moe_layer(&d, L)) L++;
        fm_cuda_layer *l;
        if (fm_cuda_layer_random(e, &d, d.expert_format, 3, L, &l)) { fprintf(stderr, "%s\n", fm_last_error()); return 1; }
        const int H = d.hidden, Ts[3] = {19, 5, 8};
        float *x = malloc(sizeof(float) * (size_t)19 * H), *out = malloc(sizeof(float) * (size_t)19 * H);
        int32_t tok[19];
        for (int i = 0; i < 19 * H; i++) x[i] = (float)sin(i * 0.37);
        for (int t = 0; t < 19; t++) tok[t] = t * 7;
        fm_moe_out o = {out, NULL, NULL};
        for (int ti = 0; ti < 3; ti++) {
            const int T = Ts[ti];
            /* T = 19: every pipeline; T = 5 and 8 (decode batches: one and
             * two selection blocks) on the wgmma path */
            for (int c = ti ? 4 : 0; c < (ti ? 5 : 6); c++) {
                /* the small and large mma.sync paths (K split in 8, 4 and
                 * 2; 8-, 16- and 32-token tiles); the wgmma path (sm_90)
                 * with passes of 8 and 16 tokens */
                static const fm_kernel_config mma[4] = {{FM_PATH_SMALL, 16, 8, 8, 1, 8, 0},
                                                        {FM_PATH_LARGE, 64, 1, 4, 1, 16, 0},
                                                        {FM_PATH_SMALL, 16, 4, 4, 1, 16, 0},
                                                        {FM_PATH_LARGE, 32, 2, 4, 1, 32, 0}};
                fm_kernel_config kc = c < 4 ? mma[c] : (fm_kernel_config){FM_PATH_WGMMA, 64, 1, 4, 1, c == 4 ? 8 : 16, 0};
                if (fm_cuda_engine_set_config(e, &kc)) {
                    fprintf(stderr, "config %d: %s\n", c, fm_last_error());
                    return 1;
                }
                if (fm_cuda_forward(e, &d, l, x, FM_DT_F32, T, tok, &o)) {
                    fprintf(stderr, "%s T=%d: %s\n", presets[p < 5 ? p : 0], T, fm_last_error());
                    bad = 1;
                }
                for (int i = 0; i < T * H; i++) if (!isfinite(out[i])) { bad = 1; break; }
            }
        }
        printf("%s%s ok\n", presets[p < 5 ? p : 0], p == 5 ? " (E = 512, k = 9)" : "");
        free(x); free(out);
        fm_cuda_layer_free(l);
    }
    fm_cuda_engine_free(e);
    return bad;
}
