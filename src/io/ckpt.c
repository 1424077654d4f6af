/*
 * A checkpoint directory: model.safetensors.index.json ("weight_map": tensor
 * name -> shard file) with its shards, or a single model.safetensors.
 *
 * Real checkpoints have tens to hundreds of shards, and a command that binds
 * one layer touches few of them, so shards are opened (mapped and
 * validated) on first use and then kept open until fm_ckpt_close. Shard
 * names come from an untrusted file: a name that could leave the directory
 * ('/', '\\', "..") is refused, and every shard is checked to exist when the
 * checkpoint is opened, so a missing file is reported up front with a
 * tensor that needs it.
 */
#include "util/util.h"

#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <string.h>
#include <sys/stat.h>

#define CKPT_INDEX "model.safetensors.index.json"
#define CKPT_SINGLE "model.safetensors"
#define CKPT_MAX_INDEX (512u << 20)

typedef struct {
    char *file;       /* shard file name inside dir */
    fm_st_file *st;   /* NULL until first use       */
} shard;

typedef struct {
    char *name;
    size_t shard;
} entry;

struct fm_ckpt {
    char *dir;
    entry *e;         /* sorted by name */
    size_t n;
    shard *sh;
    size_t n_sh;
    pthread_mutex_t mu; /* guards lazy shard opening */
};

void fm_ckpt_close(fm_ckpt *c) {
    if (!c) return;
    for (size_t i = 0; i < c->n; i++) free(c->e[i].name);
    for (size_t i = 0; i < c->n_sh; i++) {
        free(c->sh[i].file);
        fm_st_close(c->sh[i].st);
    }
    free(c->e);
    free(c->sh);
    free(c->dir);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

static int cmp_entry(const void *a, const void *b) {
    return strcmp(((const entry *)a)->name, ((const entry *)b)->name);
}

static int file_exists(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

static int bad_shard_name(const char *s) {
    return !*s || strchr(s, '/') || strchr(s, '\\') || strstr(s, "..");
}

static fm_status add_shard(fm_ckpt *c, const char *file, size_t *idx) {
    /* Index files list a shard's tensors together: try the latest first. */
    if (c->n_sh && strcmp(c->sh[c->n_sh - 1].file, file) == 0) { *idx = c->n_sh - 1; return FM_OK; }
    for (size_t i = 0; i < c->n_sh; i++)
        if (strcmp(c->sh[i].file, file) == 0) { *idx = i; return FM_OK; }
    shard *ns = realloc(c->sh, (c->n_sh + 1) * sizeof(shard));
    if (!ns) return fm_error(FM_E_NOMEM, "out of memory");
    c->sh = ns;
    c->sh[c->n_sh].st = NULL;
    c->sh[c->n_sh].file = fm_strdup(file);
    if (!c->sh[c->n_sh].file) return FM_E_NOMEM;
    *idx = c->n_sh++;
    return FM_OK;
}

static fm_status load_index(fm_ckpt *c, const char *path) {
    char *txt;
    size_t len;
    fm_status st = fm_read_file(path, CKPT_MAX_INDEX, &txt, &len);
    if (st != FM_OK) return st;
    json_error_t jerr;
    json_t *root = json_loadb(txt, len, JSON_REJECT_DUPLICATES, &jerr);
    free(txt);
    if (!root)
        return fm_error(FM_E_FORMAT, "%s: invalid JSON at byte offset %d: %s", path,
                        jerr.position, jerr.text);
    json_t *wm = json_is_object(root) ? json_object_get(root, "weight_map") : NULL;
    if (!json_is_object(wm)) {
        json_decref(root);
        return fm_error(FM_E_FORMAT, "%s: no \"weight_map\" object", path);
    }
    size_t n = json_object_size(wm);
    c->e = fm_calloc(n, sizeof(entry));
    if (!c->e) { json_decref(root); return FM_E_NOMEM; }
    const char *name;
    json_t *v;
    json_object_foreach(wm, name, v) {
        if (!json_is_string(v)) {
            st = fm_error(FM_E_FORMAT, "%s: weight_map['%s'] is not a file name", path, name);
            break;
        }
        const char *file = json_string_value(v);
        if (bad_shard_name(file)) {
            st = fm_error(FM_E_FORMAT,
                          "%s: weight_map['%s'] = '%s': shard name must be a plain file name in "
                          "the checkpoint directory",
                          path, name, file);
            break;
        }
        size_t si;
        if ((st = add_shard(c, file, &si)) != FM_OK) break;
        c->e[c->n].name = fm_strdup(name);
        if (!c->e[c->n].name) { st = FM_E_NOMEM; break; }
        c->e[c->n].shard = si;
        c->n++;
    }
    json_decref(root);
    if (st != FM_OK) return st;
    qsort(c->e, c->n, sizeof(entry), cmp_entry);
    /* Every shard must exist; name one tensor that needs a missing one. */
    for (size_t s = 0; s < c->n_sh; s++) {
        char sp[4096];
        if ((st = fm_path_join(sp, sizeof sp, c->dir, c->sh[s].file)) != FM_OK) return st;
        if (!file_exists(sp)) {
            const char *needer = "?";
            for (size_t i = 0; i < c->n; i++)
                if (c->e[i].shard == s) { needer = c->e[i].name; break; }
            return fm_error(FM_E_NOTFOUND, "%s: shard '%s' (needed by tensor '%s') is missing",
                            c->dir, c->sh[s].file, needer);
        }
    }
    return FM_OK;
}

static fm_status load_single(fm_ckpt *c, const char *path) {
    size_t si;
    fm_status st = add_shard(c, CKPT_SINGLE, &si);
    if (st != FM_OK) return st;
    if ((st = fm_st_open(path, &c->sh[si].st)) != FM_OK) return st;
    size_t n = fm_st_count(c->sh[si].st);
    c->e = fm_calloc(n, sizeof(entry));
    if (!c->e) return FM_E_NOMEM;
    for (size_t i = 0; i < n; i++) {
        c->e[i].name = fm_strdup(fm_st_at(c->sh[si].st, i)->name);
        if (!c->e[i].name) return FM_E_NOMEM;
        c->e[i].shard = si;
        c->n++;
    }
    qsort(c->e, c->n, sizeof(entry), cmp_entry);
    return FM_OK;
}

fm_status fm_ckpt_open(const char *dir, fm_ckpt **out) {
    *out = NULL;
    if (!dir || !*dir) return fm_error(FM_E_ARG, "checkpoint: empty directory name");
    fm_ckpt *c = fm_calloc(1, sizeof *c);
    if (!c) return FM_E_NOMEM;
    pthread_mutex_init(&c->mu, NULL);
    c->dir = fm_strdup(dir);
    if (!c->dir) { fm_ckpt_close(c); return FM_E_NOMEM; }
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
        fm_status st = fm_error(FM_E_NOTFOUND, "%s: not a directory", dir);
        fm_ckpt_close(c);
        return st;
    }
    char p[4096];
    fm_status st = fm_path_join(p, sizeof p, dir, CKPT_INDEX);
    if (st == FM_OK) {
        if (file_exists(p)) st = load_index(c, p);
        else if ((st = fm_path_join(p, sizeof p, dir, CKPT_SINGLE)) == FM_OK) {
            if (file_exists(p)) st = load_single(c, p);
            else st = fm_error(FM_E_NOTFOUND, "%s: neither %s nor %s found", dir, CKPT_INDEX,
                               CKPT_SINGLE);
        }
    }
    if (st != FM_OK) { fm_ckpt_close(c); return st; }
    *out = c;
    return FM_OK;
}

const fm_st_tensor *fm_ckpt_find(fm_ckpt *c, const char *name) {
    if (!c || !name) {
        fm_error(FM_E_ARG, "fm_ckpt_find: NULL argument");
        return NULL;
    }
    entry key = {(char *)name, 0};
    const entry *e = bsearch(&key, c->e, c->n, sizeof(entry), cmp_entry);
    if (!e) {
        fm_error(FM_E_NOTFOUND, "%s: no tensor '%s' in the checkpoint", c->dir, name);
        return NULL;
    }
    shard *s = &c->sh[e->shard];
    pthread_mutex_lock(&c->mu);
    if (!s->st) {
        char p[4096];
        fm_status st = fm_path_join(p, sizeof p, c->dir, s->file);
        if (st == FM_OK) st = fm_st_open(p, &s->st);
        if (st != FM_OK) {
            pthread_mutex_unlock(&c->mu);
            char why[1024];
            snprintf(why, sizeof why, "%s", fm_last_error());
            fm_error(st, "tensor '%s': %s", name, why);
            return NULL;
        }
    }
    pthread_mutex_unlock(&c->mu);
    const fm_st_tensor *t = fm_st_find(s->st, name);
    if (!t)
        fm_error(FM_E_FORMAT, "%s: tensor '%s' is listed in %s for shard '%s' but absent from it",
                 c->dir, name, CKPT_INDEX, s->file);
    return t;
}

const char *fm_ckpt_dir(const fm_ckpt *c) { return c ? c->dir : NULL; }
size_t fm_ckpt_count(const fm_ckpt *c) { return c ? c->n : 0; }
const char *fm_ckpt_name_at(const fm_ckpt *c, size_t i) {
    return c && i < c->n ? c->e[i].name : NULL;
}
