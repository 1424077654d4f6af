/* Private to src/tune: the copies of the JSON files of configs/ compiled
 * into the library (generated at build time by cmake/embed_configs.cmake), the
 * lookup's last resort when no shipped directory holds the file. */
#ifndef FM_TUNE_BUILTIN_INTERNAL_H
#define FM_TUNE_BUILTIN_INTERNAL_H
#include <stddef.h>

typedef struct {
    const char *name; /* file name under configs/, e.g. "NVIDIA_H200-132sm-...json" */
    const char *text; /* its bytes, NUL-terminated                          */
    size_t len;       /* without the NUL                                     */
} fm_builtin_config;

extern const fm_builtin_config fm_builtin_configs[];
extern const size_t fm_builtin_config_count;
/* The names of all the files of configs/ when the library was built, copied
 * above or not: the GPUs the project measured. */
extern const char *const fm_shipped_config_names[];
extern const size_t fm_shipped_config_name_count;
#endif
