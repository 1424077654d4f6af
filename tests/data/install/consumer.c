/* A program built against an installed fp4moe (tests/sh_install_consumer.sh):
 * prints a preset's shape and expert bytes, the tuned config chosen for it
 * on an H200 at one batch, and whether a CUDA GPU is usable, as key=value
 * lines for the test to check. */
#include <fp4moe.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    const char *preset = argc > 1 ? argv[1] : "deepseek-v4-flash";
    int T = argc > 2 ? atoi(argv[2]) : 4;
    fm_model_desc d;
    if (fm_preset_desc(preset, FM_QF_NVFP4, &d) != FM_OK) {
        fprintf(stderr, "consumer: %s\n", fm_last_error());
        return 1;
    }
    printf("version=%s\n", FM_VERSION);
    printf("shape=E%d-H%d-I%d-k%d\n", d.n_experts, d.hidden, d.moe_inter, d.topk);
    printf("expert_bytes=%lld\n", (long long)fm_model_expert_bytes(&d, FM_QF_NVFP4));
    fm_tune_key key;
    memset(&key, 0, sizeof key);
    snprintf(key.gpu_name, sizeof key.gpu_name, "NVIDIA H200");
    key.sm_count = 132;
    if (fm_tune_key_set_shape(&key, &d, FM_QF_NVFP4) != FM_OK) {
        fprintf(stderr, "consumer: %s\n", fm_last_error());
        return 1;
    }
    fm_tune_choice c;
    if (fm_tune_choose(&key, T, &c) != FM_OK) {
        fprintf(stderr, "consumer: %s\n", fm_last_error());
        return 1;
    }
    printf("tuned=%d\nbucket=%d\nsource=%s\n", c.tuned, c.bucket, c.source);
    printf("params=%d %d %d %d %d %g\n", c.cfg.rows_per_block, c.cfg.k_split, c.cfg.warps, c.cfg.stages, c.cfg.tile_n,
           (double)c.cfg.switch_tpe);
    printf("module=%s\n", fm_tune_module_path());
    /* from the CUDA engine's object in a CUDA build, which a static link
     * then pulls in with everything it needs */
    char why[256] = "";
    printf("cuda=%d\n", fm_cuda_available(why, sizeof why));
    if (c.warnings[0]) fprintf(stderr, "%s", c.warnings);
    return 0;
}
