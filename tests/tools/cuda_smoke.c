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
    for (int p = 0; p < 5; p++) {
        fm_model_desc d;
        if (fm_preset_desc(presets[p], FM_QF_NONE, &d)) { fprintf(stderr, "%s\n", fm_last_error()); return 1; }
        int L = 0;
        while (!fm_model_is_moe_layer(&d, L)) L++;
        fm_cuda_layer *l;
        if (fm_cuda_layer_random(e, &d, d.expert_format, 3, L, &l)) { fprintf(stderr, "%s\n", fm_last_error()); return 1; }
        int T = 19, H = d.hidden;
        float *x = malloc(sizeof(float) * (size_t)T * H), *out = malloc(sizeof(float) * (size_t)T * H);
        int32_t tok[19];
        for (int i = 0; i < T * H; i++) x[i] = (float)sin(i * 0.37);
        for (int t = 0; t < T; t++) tok[t] = t * 7;
        fm_moe_out o = {out, NULL, NULL};
        for (int c = 0; c < 6; c++) {
            /* register and cp.async pipelines, small and large paths; the
             * wgmma path (sm_90) with passes of 8 and 16 tokens */
            int lg = c & 1;
            fm_kernel_config kc = {lg ? FM_PATH_LARGE : FM_PATH_SMALL, lg ? 64 : 16, lg ? 1 : 8, lg ? 4 : 8, c < 2 ? 1 : 3,
                                   lg ? 16 : 8, 0};
            if (c >= 4) kc = (fm_kernel_config){FM_PATH_WGMMA, 64, 1, 4, 1, c == 4 ? 8 : 16, 0};
            fm_cuda_engine_set_config(e, &kc);
            if (fm_cuda_forward(e, &d, l, x, FM_DT_F32, T, tok, &o)) { fprintf(stderr, "%s: %s\n", presets[p], fm_last_error()); bad = 1; }
            for (int i = 0; i < T * H; i++) if (!isfinite(out[i])) { bad = 1; break; }
        }
        printf("%s ok\n", presets[p]);
        free(x); free(out);
        fm_cuda_layer_free(l);
    }
    fm_cuda_engine_free(e);
    return bad;
}
