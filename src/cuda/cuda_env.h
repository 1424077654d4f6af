/* The CUDA backend's environment switches, for its plain-C and CUDA files
 * alike (the table and checks: defaults.c). */
#ifndef FM_CUDA_ENV_H
#define FM_CUDA_ENV_H
#ifdef __cplusplus
extern "C" {
#endif
/* 1 when the environment variable `name` (an FP4MOE_CUDA_* switch, checked
 * by fm_cuda_env_check when an engine is made) is set to exactly `word`. */
int fm_cuda_env_is(const char *name, const char *word);
#ifdef __cplusplus
}
#endif
#endif
