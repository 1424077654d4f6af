/* A Markdown summary of a directory of tuned config files: what tuning
 * gained over the built-in defaults, per shape and batch bucket, in a form
 * that goes straight into docs/perf.md. */
#include "tune/tune_internal.h"
#include "util/util.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

fm_status fm_tune_summarize(const char *dir, char **out) {
    *out = NULL;
    DIR *d = opendir(dir);
    if (!d) return fm_error(FM_E_IO, "%s: cannot open directory", dir);
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *de;
    fm_status s = FM_OK;
    while ((de = readdir(d)) != NULL) {
        size_t l = strlen(de->d_name);
        if (l < 6 || strcmp(de->d_name + l - 5, ".json") != 0 || de->d_name[0] == '.') continue;
        if (n == cap) {
            size_t nc = cap ? cap * 2 : 16;
            char **p = realloc(names, nc * sizeof *p);
            if (!p) { s = fm_error(FM_E_NOMEM, "out of memory"); break; }
            names = p;
            cap = nc;
        }
        if (!(names[n] = strdup(de->d_name))) { s = fm_error(FM_E_NOMEM, "out of memory"); break; }
        n++;
    }
    closedir(d);
    if (!s && n) qsort(names, n, sizeof *names, cmp_str);

    size_t bcap = 4096 + n * 16384;
    char *b = s ? NULL : calloc(1, bcap);
    if (!s && !b) s = fm_error(FM_E_NOMEM, "out of memory");
    fm_tune_file *f = s ? NULL : calloc(1, sizeof *f);
    if (!s && !f) s = fm_error(FM_E_NOMEM, "out of memory");
    if (!s && n == 0) fm_tune_appendf(b, bcap, "No tuned config files in %s.\n", dir);
    for (size_t i = 0; !s && i < n; i++) {
        char path[4096], msg[512];
        if (fm_path_join(path, sizeof path, dir, names[i]) != FM_OK) continue;
        int r = fm_tune_load_cached(path, f, msg, sizeof msg);
        if (r <= 0) {
            fm_tune_appendf(b, bcap, "- `%s`: ignored: %s\n\n", names[i], r < 0 ? msg : "vanished");
            continue;
        }
        char kd[320], fname[512];
        fm_tune_key_describe(&f->key, kd, sizeof kd);
        const char *preset = fm_tune_preset_for_key(&f->key);
        fm_tune_appendf(b, bcap, "### %s%s%s\n\n", kd, preset ? ", preset " : "", preset ? preset : "");
        if (fm_tune_key_filename(&f->key, fname, sizeof fname) == FM_OK && strcmp(fname, names[i]))
            fm_tune_appendf(b, bcap, "Warning: the file name `%s` does not match its key (`%s`); lookup will not find it.\n\n",
                            names[i], fname);
        fm_tune_appendf(b, bcap, "`%s`: CUDA %d, driver %d.\n\n", names[i], f->key.cuda_version, f->key.driver_version);
        fm_tune_appendf(b, bcap, "| batch | default µs | tuned µs | gain | chosen parameters | tuned |\n"
                                 "|---:|---:|---:|---:|---|---|\n");
        for (int j = 0; j < f->n; j++) {
            const fm_tune_bucket *t = &f->b[j];
            char cs[256];
            fm_kernel_config_format(&t->cfg, cs, sizeof cs);
            if (t->replaced_default)
                fm_tune_appendf(b, bcap, "| %d | %.2f | %.2f | %.1f %% | %s | %s, fp4moe %s |\n", t->batch, t->default_us,
                                t->us, 100.0 * (t->default_us - t->us) / t->default_us, cs, t->date, t->version);
            else
                fm_tune_appendf(b, bcap, "| %d | %.2f | %.2f | — | default kept: %s | %s, fp4moe %s |\n", t->batch,
                                t->default_us, t->us, cs, t->date, t->version);
        }
        fm_tune_appendf(b, bcap, "\n");
    }
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
    free(f);
    if (s) { free(b); return s; }
    *out = b;
    return FM_OK;
}
