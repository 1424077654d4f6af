/* Whether fp4moe's kernels were ever measured on a GPU: `fp4moe tune` writes
 * a config file for every GPU it runs on, and the shipped ones (configs/,
 * whose names the build records) hold the GPUs the project measured, so a
 * GPU with no config file of any shape or SM count, neither in the lookup's
 * directories nor among the shipped names, has never been measured. The
 * provenance line says so: its defaults were set on other GPUs. */
#include "tune/builtin_internal.h"
#include "tune/tune_internal.h"

#include <dirent.h>
#include <string.h>

/* "<gpu>-<digits>sm-....json", the file names fm_tune_key_filename makes,
 * for the GPU part prefix (of length pl). */
static int names_gpu(const char *nm, const char *prefix, size_t pl) {
    if (strncmp(nm, prefix, pl) || nm[pl] != '-') return 0;
    const char *p = nm + pl + 1;
    if (*p < '0' || *p > '9') return 0;
    while (*p >= '0' && *p <= '9') p++;
    size_t n = strlen(nm);
    return !strncmp(p, "sm-", 3) && n > 5 && !strcmp(nm + n - 5, ".json");
}

int fm_tune_gpu_measured(const fm_tune_key *key, char dirs[FM_TUNE_NDIRS][1024]) {
    fm_tune_key k = *key;
    k.sm_count = 0;
    char prefix[512];
    if (fm_tune_key_filename(&k, prefix, sizeof prefix) != FM_OK) return 1; /* cannot tell: say nothing */
    char *cut = strstr(prefix, "-0sm-");
    if (!cut) return 1;
    *cut = 0;
    const size_t pl = strlen(prefix);
    /* the shipped names even where $FP4MOE_SHIPPED_CONFIGS replaces the
     * shipped directory in the lookup: they record what the project measured */
    for (size_t i = 0; i < fm_shipped_config_name_count; i++)
        if (names_gpu(fm_shipped_config_names[i], prefix, pl)) return 1;
    for (int i = 0; i < FM_TUNE_NDIRS; i++) {
        if (!dirs[i][0]) continue;
        DIR *d = opendir(dirs[i]);
        if (!d) continue;
        struct dirent *de;
        int hit = 0;
        while (!hit && (de = readdir(d)) != NULL) hit = names_gpu(de->d_name, prefix, pl);
        closedir(d);
        if (hit) return 1;
    }
    return 0;
}
