/* Choosing a kernel config: where tuned files are looked up (directories,
 * the install found from this module's own path, the built-in copies), the
 * in-memory cache of parsed files, nearest-bucket selection, and the
 * provenance line every GPU run prints, so that which kernel ran, with which
 * parameters and from which file, is never silent. */
#include "tune/builtin_internal.h"
#include "tune/tune_internal.h"
#include "util/util.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <link.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---------------------------------------------------------------- keys */

fm_status fm_tune_key_set_shape(fm_tune_key *key, const fm_model_desc *d, fm_qformat fmt) {
    if (!key || !d) return fm_error(FM_E_ARG, "fm_tune_key_set_shape: NULL argument");
    if (d->n_experts < 1 || d->topk < 1 || d->topk > d->n_experts || d->hidden < 1 || d->moe_inter < 1)
        return fm_error(FM_E_ARG, "model shape E=%d k=%d H=%d I=%d is not a MoE shape", d->n_experts, d->topk,
                        d->hidden, d->moe_inter);
    key->fmt = fmt;
    key->E = d->n_experts;
    key->H = d->hidden;
    key->I = d->moe_inter;
    key->k = d->topk;
    return FM_OK;
}

fm_status fm_tune_key_filename(const fm_tune_key *key, char *buf, size_t cap) {
    char gpu[sizeof key->gpu_name];
    size_t n = strnlen(key->gpu_name, sizeof key->gpu_name - 1);
    for (size_t i = 0; i < n; i++) {
        char c = key->gpu_name[i];
        int ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.';
        gpu[i] = ok ? c : '_';
    }
    gpu[n] = 0;
    if (n == 0) snprintf(gpu, sizeof gpu, "unknown_gpu");
    int w = snprintf(buf, cap, "%s-%dsm-%s-E%d-H%d-I%d-k%d.json", gpu, key->sm_count, fm_qformat_name(key->fmt), key->E,
                     key->H, key->I, key->k);
    if (w < 0 || (size_t)w >= cap) return fm_error(FM_E_ARG, "config file name too long for GPU '%s'", key->gpu_name);
    return FM_OK;
}

void fm_tune_key_describe(const fm_tune_key *key, char *buf, size_t cap) {
    snprintf(buf, cap, "%s (%d SMs) %s E=%d H=%d I=%d k=%d", key->gpu_name[0] ? key->gpu_name : "unknown GPU",
             key->sm_count, fm_qformat_name(key->fmt), key->E, key->H, key->I, key->k);
}

/* --------------------------------------------------------- directories */

fm_status fm_tune_user_cache_dir(char *buf, size_t cap) {
    const char *x = getenv("XDG_CACHE_HOME");
    int w;
    if (x && x[0] == '/') w = snprintf(buf, cap, "%s/fp4moe/configs", x);
    else {
        const char *h = getenv("HOME");
        if (!h || !h[0]) return fm_error(FM_E_NOTFOUND, "no user cache directory: neither XDG_CACHE_HOME nor HOME is set");
        w = snprintf(buf, cap, "%s/.cache/fp4moe/configs", h);
    }
    if (w < 0 || (size_t)w >= cap) return fm_error(FM_E_ARG, "user cache directory path too long");
    return FM_OK;
}

/* The shipped configs of an install sit at a fixed place relative to the
 * module (executable or shared library) that holds this code, so an
 * installed tree finds them wherever it was copied. CMake passes the
 * relative paths and the build tree (whose binaries use the source tree's
 * configs/); the defaults are the GNU layout. */
#ifndef FM_REL_BIN_CONFIGS
#define FM_REL_BIN_CONFIGS "../share/fp4moe/configs"
#endif
#ifndef FM_REL_LIB_CONFIGS
#define FM_REL_LIB_CONFIGS "../share/fp4moe/configs"
#endif

static const char g_anchor = 0; /* an address inside this module */

typedef struct {
    uintptr_t addr;
    int found, is_main;
    char name[PATH_MAX];
} module_find;

static int module_cb(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    module_find *f = data;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type != PT_LOAD) continue;
        uintptr_t lo = (uintptr_t)info->dlpi_addr + (uintptr_t)ph->p_vaddr;
        if (f->addr < lo || f->addr - lo >= (uintptr_t)ph->p_memsz) continue;
        f->found = 1;
        f->is_main = !info->dlpi_name || !info->dlpi_name[0]; /* the program itself is unnamed */
        snprintf(f->name, sizeof f->name, "%s", f->is_main ? "" : info->dlpi_name);
        return 1;
    }
    return 0;
}

/* dir joined with a relative path, ".." resolved lexically (dir is a real
 * path, so no symlink can make that wrong). 0 on success. */
static int join_norm(char *out, size_t cap, const char *dir, const char *rel) {
    int w = snprintf(out, cap, "%s", dir);
    if (w < 0 || (size_t)w >= cap) return -1;
    size_t n = (size_t)w;
    while (*rel) {
        const char *e = strchr(rel, '/');
        size_t l = e ? (size_t)(e - rel) : strlen(rel);
        if (l == 2 && rel[0] == '.' && rel[1] == '.') {
            while (n > 0 && out[n - 1] != '/') n--;
            if (n > 1) n--; /* drop the '/', but keep the root's */
            out[n] = 0;
        } else if (l && !(l == 1 && rel[0] == '.')) {
            if (n + 1 + l + 1 > cap) return -1;
            if (n == 0 || out[n - 1] != '/') out[n++] = '/';
            memcpy(out + n, rel, l);
            n += l;
            out[n] = 0;
        }
        rel += l + (e ? 1 : 0);
    }
    return 0;
}

static int is_dir(const char *p) {
    struct stat st;
    return p[0] && stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

static pthread_once_t g_ship_once = PTHREAD_ONCE_INIT;
static char g_module[PATH_MAX];   /* the module's real path ("" if unknown) */
static char g_ship_dir[1024];     /* the shipped directory found from it     */

static void find_shipped_dir(void) {
    module_find f;
    memset(&f, 0, sizeof f);
    f.addr = (uintptr_t)&g_anchor;
    dl_iterate_phdr(module_cb, &f);
    char real[PATH_MAX];
    if (f.found && f.is_main) {
        ssize_t n = readlink("/proc/self/exe", real, sizeof real - 1);
        if (n > 0) real[n] = 0;
        else real[0] = 0;
    } else if (!f.found || !realpath(f.name, real)) {
        real[0] = 0;
    }
    snprintf(g_module, sizeof g_module, "%s", real);
    if (!real[0]) return; /* no module path: the built-in copies remain */
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", real);
    char *slash = strrchr(dir, '/');
    if (!slash) return;
    if (slash == dir) slash[1] = 0;
    else *slash = 0;
    char cand[1024];
    if (join_norm(cand, sizeof cand, dir, f.is_main ? FM_REL_BIN_CONFIGS : FM_REL_LIB_CONFIGS) != 0) return;
    snprintf(g_ship_dir, sizeof g_ship_dir, "%s", cand);
    if (is_dir(cand)) return; /* an install (the build tree has no such directory) */
#if defined(FM_BUILD_DIR) && defined(FM_SOURCE_DIR)
    /* A binary of this build tree reads the source tree's configs/, so an
     * edited file takes effect without an install. */
    char bd[PATH_MAX];
    size_t bl;
    if (realpath(FM_BUILD_DIR, bd) && (bl = strlen(bd)) > 1 && !strncmp(real, bd, bl) && real[bl] == '/' &&
        is_dir(FM_SOURCE_DIR "/configs"))
        snprintf(g_ship_dir, sizeof g_ship_dir, "%s", FM_SOURCE_DIR "/configs");
#endif
}

/* The built-in copies count only where $FP4MOE_SHIPPED_CONFIGS does not
 * name the shipped set instead. */
static int builtin_enabled(void) {
    const char *s = getenv("FP4MOE_SHIPPED_CONFIGS");
    return !(s && s[0]);
}

int fm_tune_search_dirs(const char *labels[FM_TUNE_NDIRS], char paths[FM_TUNE_NDIRS][1024]) {
    const char *e = getenv("FP4MOE_CONFIG_DIR");
    labels[0] = "$FP4MOE_CONFIG_DIR";
    snprintf(paths[0], 1024, "%s", e ? e : "");
    labels[1] = "user cache";
    if (fm_tune_user_cache_dir(paths[1], 1024) != FM_OK) paths[1][0] = 0;
    const char *s = getenv("FP4MOE_SHIPPED_CONFIGS");
    labels[2] = "shipped";
    if (s && s[0]) snprintf(paths[2], 1024, "%s", s);
    else {
        pthread_once(&g_ship_once, find_shipped_dir);
        snprintf(paths[2], 1024, "%s", g_ship_dir);
    }
    labels[FM_TUNE_DIR_BUILTIN] = "built-in copies";
    paths[FM_TUNE_DIR_BUILTIN][0] = 0;
    return FM_TUNE_NDIRS;
}

const char *fm_tune_module_path(void) {
    pthread_once(&g_ship_once, find_shipped_dir);
    return g_module;
}

fm_status fm_tune_mkdirs(const char *dir) {
    char p[4096];
    size_t n = strlen(dir);
    if (n == 0 || n >= sizeof p) return fm_error(FM_E_ARG, "bad directory path '%s'", dir);
    memcpy(p, dir, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (p[i] != '/' && p[i] != 0) continue;
        char c = p[i];
        p[i] = 0;
        if (mkdir(p, 0777) != 0 && errno != EEXIST)
            return fm_error(FM_E_IO, "%s: cannot create directory: %s", p, strerror(errno));
        p[i] = c;
    }
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) return fm_error(FM_E_IO, "%s: not a directory", dir);
    return FM_OK;
}

/* ------------------------------------------------------------- cache */

/* Parsed files by path, revalidated by (device, inode, size, mtime) so an
 * edited or replaced file is re-read while an unchanged one costs a stat.
 * File times are coarse (a few ms) and inodes are reused, so a file
 * rewritten right after it was parsed can look unchanged: as git does for
 * "racy" index entries, an entry whose file was modified within two seconds
 * of its parse is confirmed by comparing the bytes. Bad files are cached
 * too, with their message, so a broken file costs one parse per change
 * rather than one per run. */
typedef struct cache_ent {
    struct cache_ent *next;
    char *path;
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtime;
    time_t parsed_at;
    char *text; /* the bytes parsed, for the racy check */
    size_t len;
    int ok;
    char msg[512];
    fm_tune_file file;
} cache_ent;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static cache_ent *g_cache;

static void ent_free(cache_ent *e) {
    free(e->path);
    free(e->text);
    free(e);
}

static void memo_clear_locked(void);
static void builtin_clear_locked(void);

void fm_tune_cache_clear(void) {
    pthread_mutex_lock(&g_mu);
    memo_clear_locked();
    builtin_clear_locked();
    while (g_cache) {
        cache_ent *n = g_cache->next;
        ent_free(g_cache);
        g_cache = n;
    }
    pthread_mutex_unlock(&g_mu);
}

static void cache_free_at_exit(void) { fm_tune_cache_clear(); }
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static void register_exit(void) { atexit(cache_free_at_exit); }

static int same_stat(const cache_ent *e, const struct stat *st) {
    return e->dev == st->st_dev && e->ino == st->st_ino && e->size == st->st_size &&
           e->mtime.tv_sec == st->st_mtim.tv_sec && e->mtime.tv_nsec == st->st_mtim.tv_nsec;
}

/* Strips the leading "<path>: " that fm_last_error messages carry. */
static void copy_msg(char *dst, size_t cap, const char *path, const char *m) {
    size_t pl = strlen(path);
    if (!strncmp(m, path, pl) && m[pl] == ':') m += pl + 1 + (m[pl + 1] == ' ');
    snprintf(dst, cap, "%s", m);
}

int fm_tune_load_cached(const char *path, fm_tune_file *out, char *msg, size_t cap) {
    struct stat st;
    msg[0] = 0;
    if (stat(path, &st) != 0) {
        if (errno == ENOENT || errno == ENOTDIR) return 0;
        snprintf(msg, cap, "cannot stat: %s", strerror(errno));
        return -1;
    }
    if (!S_ISREG(st.st_mode)) { snprintf(msg, cap, "not a regular file"); return -1; }
    pthread_once(&g_once, register_exit);

    int racy = 0;
    pthread_mutex_lock(&g_mu);
    for (cache_ent *e = g_cache; e; e = e->next) {
        if (strcmp(e->path, path) != 0) continue;
        if (same_stat(e, &st)) {
            racy = st.st_mtim.tv_sec + 2 > e->parsed_at;
            if (!racy) {
                int ok = e->ok;
                if (ok) *out = e->file;
                else snprintf(msg, cap, "%s", e->msg);
                pthread_mutex_unlock(&g_mu);
                return ok ? 1 : -1;
            }
        }
        break;
    }
    pthread_mutex_unlock(&g_mu);

    char *text = NULL;
    size_t len = 0;
    fm_status s = fm_read_file(path, FM_TUNE_MAX_FILE_BYTES, &text, &len);
    if (s != FM_OK) {
        copy_msg(msg, cap, path, fm_last_error());
        return errno == ENOENT ? 0 : -1; /* removed between stat and open */
    }
    if (racy) {
        pthread_mutex_lock(&g_mu);
        for (cache_ent *e = g_cache; e; e = e->next) {
            if (strcmp(e->path, path) != 0) continue;
            if (same_stat(e, &st) && e->text && e->len == len && !memcmp(e->text, text, len)) {
                int ok = e->ok;
                if (ok) *out = e->file;
                else snprintf(msg, cap, "%s", e->msg);
                pthread_mutex_unlock(&g_mu);
                free(text);
                return ok ? 1 : -1;
            }
            break;
        }
        pthread_mutex_unlock(&g_mu);
    }

    /* Parse outside the lock: two threads may parse the same new file at
     * once, which is harmless (same result; the last one is kept). */
    cache_ent *ne = calloc(1, sizeof *ne);
    if (!ne) { free(text); snprintf(msg, cap, "out of memory"); return -1; }
    s = fm_tune_file_parse(text, len, path, &ne->file);
    ne->ok = s == FM_OK;
    if (!ne->ok) {
        copy_msg(ne->msg, sizeof ne->msg, path, fm_last_error());
        snprintf(msg, cap, "%s", ne->msg);
    } else {
        *out = ne->file;
    }
    int ok = ne->ok;
    ne->path = strdup(path);
    ne->text = text;
    ne->len = len;
    ne->dev = st.st_dev;
    ne->ino = st.st_ino;
    ne->size = st.st_size;
    ne->mtime = st.st_mtim;
    ne->parsed_at = time(NULL);
    if (!ne->path || (off_t)len != st.st_size) { /* changed while reading: do not cache */
        ent_free(ne);
        return ok ? 1 : -1;
    }

    pthread_mutex_lock(&g_mu);
    for (cache_ent **pp = &g_cache; *pp; pp = &(*pp)->next)
        if (!strcmp((*pp)->path, path)) {
            cache_ent *old = *pp;
            *pp = old->next;
            ent_free(old);
            break;
        }
    ne->next = g_cache;
    g_cache = ne;
    pthread_mutex_unlock(&g_mu);
    return ok ? 1 : -1;
}

/* The built-in copies, parsed once each on first use (the results of bad
 * copies too, with their message). */
typedef struct {
    int state; /* 0 not parsed, 1 ok, -1 bad */
    char msg[512];
    fm_tune_file *file;
} builtin_ent;
static builtin_ent *g_builtin; /* fm_builtin_config_count entries, under g_mu */

static void builtin_clear_locked(void) {
    if (!g_builtin) return;
    for (size_t i = 0; i < fm_builtin_config_count; i++) free(g_builtin[i].file);
    free(g_builtin);
    g_builtin = NULL;
}

static int builtin_index(const char *name) {
    for (size_t i = 0; i < fm_builtin_config_count; i++)
        if (!strcmp(fm_builtin_configs[i].name, name)) return (int)i;
    return -1;
}

/* Like fm_tune_load_cached, for built-in copy i: 1 parsed (copied to out),
 * -1 malformed (msg says why). */
static int builtin_load(int i, fm_tune_file *out, char *msg, size_t cap) {
    pthread_once(&g_once, register_exit);
    pthread_mutex_lock(&g_mu);
    if (!g_builtin) g_builtin = calloc(fm_builtin_config_count ? fm_builtin_config_count : 1, sizeof *g_builtin);
    if (g_builtin && g_builtin[i].state) {
        int st = g_builtin[i].state;
        if (st > 0) *out = *g_builtin[i].file;
        else snprintf(msg, cap, "%s", g_builtin[i].msg);
        pthread_mutex_unlock(&g_mu);
        return st;
    }
    pthread_mutex_unlock(&g_mu);
    const fm_builtin_config *b = &fm_builtin_configs[i];
    char what[600];
    snprintf(what, sizeof what, "built-in copy of configs/%s", b->name);
    fm_tune_file *f = malloc(sizeof *f);
    if (!f) { snprintf(msg, cap, "out of memory"); return -1; }
    int st = fm_tune_file_parse(b->text, b->len, what, f) == FM_OK ? 1 : -1;
    char m[512] = "";
    if (st < 0) copy_msg(m, sizeof m, what, fm_last_error());
    if (st > 0) *out = *f;
    else snprintf(msg, cap, "%s", m);
    pthread_mutex_lock(&g_mu);
    if (g_builtin && !g_builtin[i].state) {
        g_builtin[i].state = st;
        snprintf(g_builtin[i].msg, sizeof g_builtin[i].msg, "%s", m);
        g_builtin[i].file = st > 0 ? f : NULL;
        if (st > 0) f = NULL;
    }
    pthread_mutex_unlock(&g_mu);
    free(f);
    return st;
}

/* ------------------------------------------------------------ buckets */

int fm_tune_nearest_bucket(const int *b, int n, int T) {
    /* distance(b) = max(T/b, b/T) = hi/lo; compare hi1/lo1 < hi2/lo2 by
     * cross-multiplying in 64 bits (values are at most 1e6). */
    int best = 0;
    for (int i = 1; i < n; i++) {
        int64_t hb = b[best] > T ? b[best] : T, lb = b[best] > T ? T : b[best];
        int64_t hi = b[i] > T ? b[i] : T, li = b[i] > T ? T : b[i];
        int64_t lhs = hi * lb, rhs = hb * li;
        if (lhs < rhs || (lhs == rhs && b[i] < b[best])) best = i;
    }
    return best;
}

double fm_tune_expected_active(int E, int k, int T) {
    if (E <= 0 || k <= 0 || T <= 0) return 0.0;
    return (double)E * (1.0 - pow(1.0 - (double)k / (double)E, (double)T));
}

double fm_tune_tokens_per_expert(int E, int k, int T) {
    double a = fm_tune_expected_active(E, k, T);
    return a > 0 ? (double)T * k / a : 0.0;
}

/* ------------------------------------------------------------- choose */

/* Files of the same GPU name and shape but another SM count are not used,
 * and saying so explains a surprising default. other_sm_pattern splits the
 * key's file name around its SM count; other_sm_name tests a name. */
static int other_sm_pattern(const fm_tune_key *key, char *pat, size_t cap, const char **prefix, const char **suffix) {
    fm_tune_key other = *key;
    other.sm_count = 0;
    if (fm_tune_key_filename(&other, pat, cap) != FM_OK) return -1;
    /* pat = "<gpu>-0sm-<rest>" */
    char *mid = strstr(pat, "-0sm-");
    if (!mid) return -1;
    *mid = 0;
    *prefix = pat;
    *suffix = mid + 4; /* "-<fmt>-E..json" */
    return 0;
}

static int other_sm_name(const char *nm, const char *prefix, const char *suffix, const char *want_name) {
    size_t pl = strlen(prefix), sl = strlen(suffix), nl = strlen(nm);
    return nl > pl + sl + 3 && !strncmp(nm, prefix, pl) && nm[pl] == '-' && !strcmp(nm + nl - sl, suffix) &&
           strcmp(nm, want_name) != 0;
}

static void note_other_sm_files(const char *dir, const fm_tune_key *key, const char *want_name, fm_tune_choice *c) {
    char pat[512];
    const char *prefix, *suffix;
    if (other_sm_pattern(key, pat, sizeof pat, &prefix, &suffix) != 0) return;
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (!other_sm_name(de->d_name, prefix, suffix, want_name)) continue;
        char path[1600];
        if (fm_path_join(path, sizeof path, dir, de->d_name) != FM_OK) continue;
        fm_tune_appendf(c->warnings, sizeof c->warnings, "%s: ignored: tuned for another SM count than this GPU's %d\n",
                        path, key->sm_count);
    }
    closedir(d);
}

static void note_other_sm_builtin(const fm_tune_key *key, const char *want_name, fm_tune_choice *c) {
    char pat[512];
    const char *prefix, *suffix;
    if (other_sm_pattern(key, pat, sizeof pat, &prefix, &suffix) != 0) return;
    for (size_t i = 0; i < fm_builtin_config_count; i++)
        if (other_sm_name(fm_builtin_configs[i].name, prefix, suffix, want_name))
            fm_tune_appendf(c->warnings, sizeof c->warnings,
                            "built-in copy of configs/%s: ignored: tuned for another SM count than this GPU's %d\n",
                            fm_builtin_configs[i].name, key->sm_count);
}

/* Whole answers of fm_tune_choose, for callers that ask per run: without
 * them a miss costs a directory scan and a preset search (~80 us), as much
 * as a decode layer. An answer is reused while everything it was derived
 * from looks the same: the three directory paths, a stat of each candidate
 * file up to the one used, and, for answers that found none, a stat of each
 * directory (files named for another SM count are reported). As for parsed
 * files, an answer derived from anything modified within two seconds of it
 * is not trusted (coarse file times). */
typedef struct {
    int exists;
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtime;
} stamp;

#define N_STAMPS (2 * FM_TUNE_NDIRS) /* even: directory i, odd: its file */

typedef struct memo_ent {
    struct memo_ent *next;
    fm_tune_key key;
    int T;
    char dirs[FM_TUNE_NDIRS][1024];
    int builtin; /* the built-in copies were searched */
    int ndep;
    int dep[N_STAMPS];
    stamp dep_st[N_STAMPS];
    time_t made_at;
    fm_tune_choice choice;
} memo_ent;

#define MEMO_MAX 256
static memo_ent *g_memo;
static int g_memo_n;

typedef struct {
    char paths[N_STAMPS][1600];
    int have[N_STAMPS];
    stamp st[N_STAMPS];
} stamper;

static const stamp *get_stamp(stamper *sp, int i) {
    if (!sp->have[i]) {
        struct stat st;
        stamp *x = &sp->st[i];
        memset(x, 0, sizeof *x);
        if (sp->paths[i][0] && stat(sp->paths[i], &st) == 0) {
            x->exists = 1;
            x->dev = st.st_dev;
            x->ino = st.st_ino;
            x->size = S_ISDIR(st.st_mode) ? 0 : st.st_size;
            x->mtime = st.st_mtim;
        }
        sp->have[i] = 1;
    }
    return &sp->st[i];
}

static int same_key(const fm_tune_key *a, const fm_tune_key *b) {
    return !strcmp(a->gpu_name, b->gpu_name) && a->sm_count == b->sm_count && a->cuda_version == b->cuda_version &&
           a->driver_version == b->driver_version && a->fmt == b->fmt && a->E == b->E && a->H == b->H &&
           a->I == b->I && a->k == b->k;
}

static void memo_clear_locked(void) {
    while (g_memo) {
        memo_ent *n = g_memo->next;
        free(g_memo);
        g_memo = n;
    }
    g_memo_n = 0;
}

fm_status fm_tune_choose(const fm_tune_key *key, int T, fm_tune_choice *out) {
    if (!key || !out || T < 1) return fm_tune_choose_trail(key, T, out, NULL); /* the error path */
    const char *labels[FM_TUNE_NDIRS];
    char dirs[FM_TUNE_NDIRS][1024], name[512];
    memset(dirs, 0, sizeof dirs); /* compared whole below */
    fm_tune_search_dirs(labels, dirs);
    const int builtin = builtin_enabled();
    if (fm_tune_key_filename(key, name, sizeof name) != FM_OK) return fm_tune_choose_trail(key, T, out, NULL);
    stamper *sp = calloc(1, sizeof *sp);
    if (!sp) return fm_tune_choose_trail(key, T, out, NULL);
    for (int i = 0; i < FM_TUNE_NDIRS; i++) {
        const size_t dl = strnlen(dirs[i], sizeof dirs[i] - 1); /* < sizeof sp->paths[0] */
        memcpy(sp->paths[2 * i], dirs[i], dl);
        sp->paths[2 * i][dl] = 0;
        if (dirs[i][0] && fm_path_join(sp->paths[2 * i + 1], sizeof sp->paths[0], dirs[i], name) != FM_OK)
            sp->paths[2 * i + 1][0] = 0;
    }
    pthread_once(&g_once, register_exit);
    pthread_mutex_lock(&g_mu);
    for (memo_ent *m = g_memo; m; m = m->next) {
        if (m->T != T || !same_key(&m->key, key) || m->builtin != builtin || memcmp(m->dirs, dirs, sizeof dirs) != 0)
            continue;
        int ok = 1;
        for (int d = 0; d < m->ndep && ok; d++) {
            const stamp *x = get_stamp(sp, m->dep[d]);
            ok = !memcmp(x, &m->dep_st[d], sizeof *x) && !(x->exists && x->mtime.tv_sec + 2 > m->made_at);
        }
        if (!ok) continue;
        *out = m->choice;
        pthread_mutex_unlock(&g_mu);
        free(sp);
        return FM_OK;
    }
    pthread_mutex_unlock(&g_mu);

    /* A miss: stamp everything first, so a change during the lookup shows
     * up as a mismatch next time, then keep the stamps the answer used. */
    time_t now = time(NULL);
    for (int i = 0; i < N_STAMPS; i++) get_stamp(sp, i);
    fm_status s = fm_tune_choose_trail(key, T, out, NULL);
    memo_ent *m = s == FM_OK ? calloc(1, sizeof *m) : NULL;
    if (m) {
        m->key = *key;
        m->T = T;
        m->builtin = builtin;
        memcpy(m->dirs, dirs, sizeof dirs);
        int used = -1;
        for (int i = 0; i < FM_TUNE_NDIRS && used < 0; i++)
            if (out->tuned && sp->paths[2 * i + 1][0] && !strcmp(out->source, sp->paths[2 * i + 1])) used = i;
        for (int i = 0; i < FM_TUNE_NDIRS; i++) {
            if (used >= 0 && i > used) break;
            if (used < 0) { m->dep[m->ndep] = 2 * i; m->dep_st[m->ndep++] = sp->st[2 * i]; }
            m->dep[m->ndep] = 2 * i + 1;
            m->dep_st[m->ndep++] = sp->st[2 * i + 1];
        }
        m->made_at = now;
        m->choice = *out;
        pthread_mutex_lock(&g_mu);
        if (g_memo_n >= MEMO_MAX) memo_clear_locked();
        m->next = g_memo;
        g_memo = m;
        g_memo_n++;
        pthread_mutex_unlock(&g_mu);
    }
    free(sp);
    return s;
}

/* ------------------------------------------------ the nearest tuned shape */

double fm_tune_shape_distance(int E, int H, int I, int k, int E2, int H2, int I2, int k2) {
    if (E < 1 || H < 1 || I < 1 || k < 1 || E2 < 1 || H2 < 1 || I2 < 1 || k2 < 1) return INFINITY;
    return 4 * fabs(log2((double)H / H2)) + 2 * fabs(log2((double)I / I2)) + fabs(log2((double)E / E2)) +
           fabs(log2((double)k / k2));
}

/* The shape of a config file name of the key's GPU, SM count and format
 * ("<gpu>-<sm>sm-<fmt>-E<E>-H<H>-I<I>-k<k>.json"); 0 when it is one. */
static int parse_shape_name(const char *nm, const char *prefix, int *E, int *H, int *I, int *k) {
    const size_t pl = strlen(prefix);
    if (strncmp(nm, prefix, pl) != 0) return -1;
    int n = 0;
    if (sscanf(nm + pl, "E%d-H%d-I%d-k%d.json%n", E, H, I, k, &n) != 4 || n <= 0 || nm[pl + (size_t)n] != 0) return -1;
    return *E > 0 && *H > 0 && *I > 0 && *k > 0 && *k <= *E ? 0 : -1;
}

typedef struct {
    double dist;
    int E, H, I, k;
    int dir;         /* search-order index (FM_TUNE_DIR_BUILTIN: a built-in copy) */
    char name[512];
} near_cand;

/* Keeps the better of c and *best: smaller distance, then the earlier
 * directory, then the smaller name (so that the choice is stable). */
static void near_keep(near_cand *best, const near_cand *c) {
    if (best->dir < 0 || c->dist < best->dist - 1e-12 ||
        (fabs(c->dist - best->dist) <= 1e-12 &&
         (c->dir < best->dir || (c->dir == best->dir && strcmp(c->name, best->name) < 0))))
        *best = *c;
}

/* No file for the key's shape: borrow the choice of the nearest tuned shape
 * of the same GPU (name, SM count) and format, at the batch with the same
 * mean tokens per expert (T*k/E), where the paths switch. 0 when a file was
 * borrowed (out filled); -1 to fall back to the built-in default (out's
 * no_gpu_files set when no such file exists at all). */
static int borrow_nearest(const fm_tune_key *key, int T, char dirs[FM_TUNE_NDIRS][1024], int builtin,
                          fm_tune_choice *out, const char *head, const char *trail) {
    char prefix[512];
    fm_tune_key pk = *key;
    pk.E = pk.H = pk.I = pk.k = 1;
    if (fm_tune_key_filename(&pk, prefix, sizeof prefix) != FM_OK) return -1;
    char *cut = strstr(prefix, "-E1-H1-I1-k1.json");
    if (!cut) return -1;
    cut[1] = 0; /* "<gpu>-<sm>sm-<fmt>-" */
    near_cand best = {.dir = -1}, tried[8];
    int n_tried = 0;
    /* the candidates, nearest first; a file that does not load or match is
     * skipped for the next one */
    for (int attempt = 0; attempt < 8; attempt++) {
        best.dir = -1;
        int any = 0;
        for (int i = 0; i < FM_TUNE_NDIRS; i++) {
            if (i == FM_TUNE_DIR_BUILTIN) {
                if (!builtin) continue;
                for (size_t b = 0; b < fm_builtin_config_count; b++) {
                    near_cand c = {.dir = i};
                    if (parse_shape_name(fm_builtin_configs[b].name, prefix, &c.E, &c.H, &c.I, &c.k)) continue;
                    any = 1;
                    snprintf(c.name, sizeof c.name, "%s", fm_builtin_configs[b].name);
                    c.dist = fm_tune_shape_distance(key->E, key->H, key->I, key->k, c.E, c.H, c.I, c.k);
                    int skip = 0;
                    for (int t = 0; t < n_tried; t++) skip |= tried[t].dir == i && !strcmp(tried[t].name, c.name);
                    if (!skip) near_keep(&best, &c);
                }
                continue;
            }
            if (!dirs[i][0]) continue;
            DIR *d = opendir(dirs[i]);
            if (!d) continue;
            struct dirent *de;
            while ((de = readdir(d)) != NULL) {
                near_cand c = {.dir = i};
                if (parse_shape_name(de->d_name, prefix, &c.E, &c.H, &c.I, &c.k)) continue;
                any = 1;
                snprintf(c.name, sizeof c.name, "%s", de->d_name);
                c.dist = fm_tune_shape_distance(key->E, key->H, key->I, key->k, c.E, c.H, c.I, c.k);
                int skip = 0;
                for (int t = 0; t < n_tried; t++) skip |= tried[t].dir == i && !strcmp(tried[t].name, c.name);
                if (!skip) near_keep(&best, &c);
            }
            closedir(d);
        }
        if (!any && attempt == 0) out->no_gpu_files = 1;
        if (best.dir < 0) return -1;
        if (best.dist > FM_TUNE_NEAREST_MAX) { /* nothing near enough: the default */
            out->nearest_too_far = 1;
            out->nearest_E = best.E;
            out->nearest_H = best.H;
            out->nearest_I = best.I;
            out->nearest_k = best.k;
            out->nearest_distance = best.dist;
            return -1;
        }
        tried[n_tried++] = best;
        fm_tune_file f;
        char msg[512], what[1600], note[512] = "";
        int r;
        if (best.dir == FM_TUNE_DIR_BUILTIN) {
            snprintf(what, sizeof what, "built-in copy of configs/%s", best.name);
            r = builtin_load(builtin_index(best.name), &f, msg, sizeof msg);
        } else {
            if (fm_path_join(what, sizeof what, dirs[best.dir], best.name) != FM_OK) continue;
            r = fm_tune_load_cached(what, &f, msg, sizeof msg);
        }
        if (r <= 0) continue; /* unreadable or malformed: the next nearest */
        fm_tune_key want = *key;
        want.E = best.E;
        want.H = best.H;
        want.I = best.I;
        want.k = best.k;
        if (fm_tune_key_match(&f.key, &want, note, sizeof note) != FM_TUNE_MATCH || f.n < 1) continue;
        /* the batch of the borrowed shape with this batch's tokens per expert */
        double te = (double)T * key->k / key->E * best.E / best.k;
        int Tb = te < 1 ? 1 : te > 1e6 ? 1000000 : (int)lround(te);
        int batches[FM_TUNE_MAX_BUCKETS];
        for (int i = 0; i < f.n; i++) batches[i] = f.b[i].batch;
        const fm_tune_bucket *b = &f.b[fm_tune_nearest_bucket(batches, f.n, Tb)];
        out->cfg = b->cfg;
        out->tuned = 0;
        out->nearest = 1;
        out->nearest_E = best.E;
        out->nearest_H = best.H;
        out->nearest_I = best.I;
        out->nearest_k = best.k;
        out->nearest_batch = Tb;
        out->nearest_distance = best.dist;
        out->bucket = b->batch;
        out->tuned_us = b->us;
        out->default_us = b->default_us;
        snprintf(out->date, sizeof out->date, "%s", b->date);
        snprintf(out->version, sizeof out->version, "%s", b->version);
        snprintf(out->source, sizeof out->source, "%.*s", (int)sizeof out->source - 1, what);
        char kdesc[320];
        fm_tune_key_describe(key, kdesc, sizeof kdesc);
        snprintf(out->reason, sizeof out->reason,
                 "no tuned config for %.300s; borrowed from the nearest tuned shape of this GPU and format, %.600s "
                 "(E=%d H=%d I=%d k=%d, distance %.2f = 4|log2 H/H'| + 2|log2 I/I'| + |log2 E/E'| + |log2 k/k'|), "
                 "its bucket %d (nearest to batch %d, the same tokens per expert as batch %d here); %.250s; lookup:%.200s",
                 kdesc, what, best.E, best.H, best.I, best.k, best.dist, b->batch, Tb, T, head, trail);
        return 0;
    }
    return -1;
}

fm_status fm_tune_choose_trail(const fm_tune_key *key, int T, fm_tune_choice *out, fm_tune_trail trail_out[FM_TUNE_NDIRS]) {
    if (!key || !out) return fm_error(FM_E_ARG, "fm_tune_choose: NULL argument");
    memset(out, 0, sizeof *out);
    if (T < 1) return fm_error(FM_E_ARG, "fm_tune_choose: batch %d < 1", T);
    if (key->E < 1 || key->k < 1 || key->k > key->E || key->H < 1 || key->I < 1)
        return fm_error(FM_E_ARG, "fm_tune_choose: bad shape E=%d k=%d H=%d I=%d", key->E, key->k, key->H, key->I);

    fm_kernel_config def = fm_kernel_config_default(key, T);
    out->cfg = def;
    snprintf(out->source, sizeof out->source, "built-in default");

    char name[512], kdesc[320];
    fm_tune_key_describe(key, kdesc, sizeof kdesc);
    fm_status s = fm_tune_key_filename(key, name, sizeof name);
    if (s) return s;

    double act = fm_tune_expected_active(key->E, key->k, T);
    double tpe = fm_tune_tokens_per_expert(key->E, key->k, T);
    char head[256];
    double mean_tpe = (double)T * key->k / key->E;
    snprintf(head, sizeof head, "batch %d: ~%.1f active experts, %.2f tokens per active expert (T*k/E = %.2f; switch_tpe %g)",
             T, act, tpe, mean_tpe, (double)def.switch_tpe);

    fm_tune_trail tr[FM_TUNE_NDIRS];
    const char *labels[FM_TUNE_NDIRS];
    char dirs[FM_TUNE_NDIRS][1024];
    fm_tune_search_dirs(labels, dirs);
    for (int i = 0; i < FM_TUNE_NDIRS; i++) {
        tr[i].label = labels[i];
        memcpy(tr[i].dir, dirs[i], sizeof tr[i].dir);
        tr[i].status[0] = 0;
    }
    int found = -1;
    fm_tune_file f;
    char note[512] = "";
    const int builtin = builtin_enabled();
    for (int i = 0; i < FM_TUNE_NDIRS && found < 0; i++) {
        /* what: the file's path, or the name of its built-in copy */
        char msg[512], what[1600];
        int r;
        if (i == FM_TUNE_DIR_BUILTIN) {
            if (!builtin) {
                snprintf(tr[i].status, sizeof tr[i].status, "not searched ($FP4MOE_SHIPPED_CONFIGS names the shipped set)");
                continue;
            }
            int bi = builtin_index(name);
            if (bi < 0) {
                snprintf(tr[i].status, sizeof tr[i].status, "no such file (%zu compiled in)", fm_builtin_config_count);
                continue;
            }
            snprintf(what, sizeof what, "built-in copy of configs/%s", name);
            r = builtin_load(bi, &f, msg, sizeof msg);
        } else {
            if (!dirs[i][0]) { snprintf(tr[i].status, sizeof tr[i].status, "not set"); continue; }
            if (fm_path_join(what, sizeof what, dirs[i], name) != FM_OK) {
                snprintf(tr[i].status, sizeof tr[i].status, "path too long");
                continue;
            }
            r = fm_tune_load_cached(what, &f, msg, sizeof msg);
            if (r == 0) { snprintf(tr[i].status, sizeof tr[i].status, "no such file"); continue; }
        }
        if (r < 0) {
            snprintf(tr[i].status, sizeof tr[i].status, "ignored: %s", msg);
            fm_tune_appendf(out->warnings, sizeof out->warnings, "%s: ignored: %s\n", what, msg);
            continue;
        }
        fm_tune_match m = fm_tune_key_match(&f.key, key, note, sizeof note);
        if (m != FM_TUNE_MATCH) {
            snprintf(tr[i].status, sizeof tr[i].status, "ignored: %s", note);
            fm_tune_appendf(out->warnings, sizeof out->warnings, "%s: ignored: %s\n", what, note);
            note[0] = 0;
            continue;
        }
        snprintf(tr[i].status, sizeof tr[i].status, "found%s%s", note[0] ? "; note: " : "", note);
        snprintf(out->source, sizeof out->source, "%.*s", (int)sizeof out->source - 1, what);
        found = i;
    }
    char trail[1536] = "";
    for (int i = 0; i < FM_TUNE_NDIRS; i++) {
        if (!tr[i].status[0]) snprintf(tr[i].status, sizeof tr[i].status, "not searched (found earlier)");
        else fm_tune_appendf(trail, sizeof trail, "%s %d. %s%s%s: %.120s", i ? ";" : "", i + 1, tr[i].label,
                             tr[i].dir[0] ? " " : "", tr[i].dir, tr[i].status);
    }
    if (trail_out) memcpy(trail_out, tr, sizeof tr);

    if (found < 0) {
        for (int i = 0; i < FM_TUNE_NDIRS; i++)
            if (dirs[i][0]) note_other_sm_files(dirs[i], key, name, out);
        if (builtin) note_other_sm_builtin(key, name, out);
        out->never_measured = !fm_tune_gpu_measured(key, dirs);
        if (borrow_nearest(key, T, dirs, builtin, out, head, trail) == 0) return FM_OK;
        char hint[1024];
        fm_tune_provenance_line(key, T, out, hint, sizeof hint); /* the WARNING line */
        const char *w = strstr(hint, "no tuned config");
        const char *cut = strstr(hint, "  [");
        int wl = w ? (int)((cut && cut > w ? cut : w + strlen(w)) - w) : 0;
        snprintf(out->reason, sizeof out->reason,
                 "%.*s; %s; the built-in default takes the %s path; lookup of %.200s:%.1000s", wl, w ? w : "", head,
                 fm_tune_path_token(def.path), name, trail);
        return FM_OK;
    }

    int batches[FM_TUNE_MAX_BUCKETS];
    for (int i = 0; i < f.n; i++) batches[i] = f.b[i].batch;
    int bi = fm_tune_nearest_bucket(batches, f.n, T);
    const fm_tune_bucket *b = &f.b[bi];
    out->cfg = b->cfg;
    out->tuned = 1;
    out->bucket = b->batch;
    out->tuned_us = b->us;
    out->default_us = b->default_us;
    snprintf(out->date, sizeof out->date, "%s", b->date);
    snprintf(out->version, sizeof out->version, "%s", b->version);
    char blist[400] = "";
    for (int i = 0; i < f.n; i++) fm_tune_appendf(blist, sizeof blist, "%s%d", i ? "," : "", f.b[i].batch);
    fm_tune_appendf(out->reason, sizeof out->reason,
             "tuned config for %s; %s; bucket %d is the nearest of {%s} (log scale, ties to the smaller); "
             "%s there: %.2f us vs default %.2f us (tuned %s, fp4moe %s)%s%s; lookup of %s:%s",
             kdesc, head, b->batch, blist, b->replaced_default ? "the tuned parameters won" : "the default held",
             b->us, b->default_us, b->date, b->version, note[0] ? "; note: " : "", note, name, trail);
    return FM_OK;
}

/* ---------------------------------------------------------- provenance */

void fm_kernel_config_format(const fm_kernel_config *c, char *buf, size_t cap) {
    snprintf(buf, cap, "path=%s rows_per_block=%d k_split=%d warps=%d stages=%d tile_n=%d switch_tpe=%g",
             fm_tune_path_token(c->path), c->rows_per_block, c->k_split, c->warps, c->stages, c->tile_n,
             (double)c->switch_tpe);
}

const char *fm_tune_preset_for_key(const fm_tune_key *key) {
    size_t n = fm_preset_count();
    for (size_t i = 0; i < n; i++) {
        const char *nm = fm_preset_name(i);
        fm_model_desc d;
        if (!nm || fm_preset_desc(nm, key->fmt, &d) != FM_OK) continue;
        if (d.n_experts == key->E && d.hidden == key->H && d.moe_inter == key->I && d.topk == key->k) return nm;
    }
    return NULL;
}

static void params_brace(const fm_kernel_config *c, char *buf, size_t cap) {
    snprintf(buf, cap, "{rows_per_block=%d,k_split=%d,warps=%d,stages=%d,tile_n=%d,switch_tpe=%g}", c->rows_per_block,
             c->k_split, c->warps, c->stages, c->tile_n, (double)c->switch_tpe);
}

void fm_tune_provenance_line(const fm_tune_key *key, int T, const fm_tune_choice *c, char *buf, size_t cap) {
    if (!buf || !cap) return;
    char params[256], kdesc[320];
    params_brace(&c->cfg, params, sizeof params);
    fm_tune_key_describe(key, kdesc, sizeof kdesc);
    if (c->tuned) {
        snprintf(buf, cap, "provenance: backend=cuda gpu=\"%s\" shape=%s-E%d-H%d-I%d-k%d batch=%d kernel=%s params=%s config=%s bucket=%d",
                 key->gpu_name, fm_qformat_name(key->fmt), key->E, key->H, key->I, key->k, T,
                 fm_kernel_path_name(c->cfg.path), params, c->source, c->bucket);
        return;
    }
    const char *preset = fm_tune_preset_for_key(key);
    char how[160];
    if (preset) snprintf(how, sizeof how, "--preset %s", preset);
    else snprintf(how, sizeof how, "--model DIR");
    char far[200] = "";
    if (c->nearest_too_far)
        snprintf(far, sizeof far, " (the nearest tuned shape, E=%d H=%d I=%d k=%d, is too far to borrow from: distance "
                 "%.2f > %g)", c->nearest_E, c->nearest_H, c->nearest_I, c->nearest_k, c->nearest_distance,
                 FM_TUNE_NEAREST_MAX);
    const char *fo = key->fmt != FM_QF_NVFP4 ? " --format " : "", *fn = key->fmt != FM_QF_NVFP4 ? fm_qformat_name(key->fmt) : "";
    if (c->nearest) {
        snprintf(buf, cap, "WARNING: no tuned config for %s; borrowing the nearest tuned shape's choice: E=%d H=%d I=%d "
                 "k=%d (distance %.2f) bucket %d from %s; run: fp4moe tune %s%s%s --batch %d  "
                 "[backend=cuda kernel=%s params=%s config=%s]",
                 kdesc, c->nearest_E, c->nearest_H, c->nearest_I, c->nearest_k, c->nearest_distance, c->bucket,
                 c->source, how, fo, fn, T, fm_kernel_path_name(c->cfg.path), params, c->source);
        return;
    }
    char never[256] = "";
    if (c->never_measured)
        snprintf(never, sizeof never, "; fp4moe's kernels have never been measured on %s: its defaults were set on other GPUs",
                 key->gpu_name[0] ? key->gpu_name : "this GPU");
    snprintf(buf, cap, "WARNING: no tuned config for %s%s; using defaults; run: fp4moe tune %s%s%s --batch %d%s  "
             "[backend=cuda kernel=%s params=%s config=built-in default]",
             kdesc, never, how, fo, fn, T,
             c->no_gpu_files ? " (no tuned config file of this GPU and format at all: none to borrow from)"
             : c->nearest_too_far ? far : "",
             fm_kernel_path_name(c->cfg.path), params);
}

/* Paths and GPU names come from outside and need not be UTF-8, which JSON
 * strings must be: such bytes become '?' rather than losing the record. */
static json_t *jstr(const char *s) {
    json_t *j = json_string(s);
    if (j) return j;
    char *t = strdup(s);
    if (!t) return NULL;
    for (char *p = t; *p; p++)
        if ((unsigned char)*p >= 0x80 || (unsigned char)*p < 0x20) *p = '?';
    j = json_string(t);
    free(t);
    return j;
}

char *fm_tune_choice_to_json(const fm_tune_key *key, int T, const fm_tune_choice *c) {
    char line[1024];
    fm_tune_provenance_line(key, T, c, line, sizeof line);
    const fm_kernel_config *k = &c->cfg;
    json_t *o = json_object(), *kj = json_object(), *pj = fm_tune_params_json(k), *ws = json_array();
    if (!o || !kj || !pj || !ws) {
        json_decref(o); json_decref(kj); json_decref(pj); json_decref(ws);
        fm_error(FM_E_NOMEM, "out of memory building the provenance JSON");
        return NULL;
    }
    json_object_set_new(kj, "gpu", jstr(key->gpu_name));
    json_object_set_new(kj, "sm_count", json_integer(key->sm_count));
    json_object_set_new(kj, "cuda_version", json_integer(key->cuda_version));
    json_object_set_new(kj, "driver_version", json_integer(key->driver_version));
    json_object_set_new(kj, "format", json_string(fm_qformat_name(key->fmt)));
    json_object_set_new(kj, "E", json_integer(key->E));
    json_object_set_new(kj, "H", json_integer(key->H));
    json_object_set_new(kj, "I", json_integer(key->I));
    json_object_set_new(kj, "k", json_integer(key->k));
    json_object_set_new(o, "backend", json_string("cuda"));
    json_object_set_new(o, "key", kj);
    json_object_set_new(o, "batch", json_integer(T));
    json_object_set_new(o, "kernel", jstr(fm_kernel_path_name(k->path)));
    json_object_set_new(o, "path", json_string(fm_tune_path_token(k->path)));
    json_object_set_new(o, "params", pj);
    json_object_set_new(o, "tuned", json_boolean(c->tuned));
    json_object_set_new(o, "config", jstr(c->source));
    if (c->tuned) {
        json_object_set_new(o, "bucket", json_integer(c->bucket));
        json_object_set_new(o, "tuned_us", json_real(c->tuned_us));
        json_object_set_new(o, "default_us", json_real(c->default_us));
        json_object_set_new(o, "tuned_date", jstr(c->date));
        json_object_set_new(o, "tuned_version", jstr(c->version));
        json_object_set_new(o, "warning", json_null());
    } else {
        const char *w = strstr(line, "no tuned config");
        json_object_set_new(o, "warning", jstr(w ? w : line));
        if (c->nearest)
            json_object_set_new(o, "nearest",
                                json_pack("{s:i, s:i, s:i, s:i, s:f, s:i, s:i}", "E", c->nearest_E, "H", c->nearest_H,
                                          "I", c->nearest_I, "k", c->nearest_k, "distance", c->nearest_distance,
                                          "batch", c->nearest_batch, "bucket", c->bucket));
        json_object_set_new(o, "no_gpu_files", json_boolean(c->no_gpu_files));
    }
    const char *p = c->warnings;
    while (*p) {
        const char *e = strchr(p, '\n');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        char one[1024];
        snprintf(one, sizeof one, "%.*s", (int)(n < sizeof one ? n : sizeof one - 1), p);
        if (n) json_array_append_new(ws, jstr(one));
        p += n + (e ? 1 : 0);
    }
    json_object_set_new(o, "ignored_files", ws);
    json_object_set_new(o, "reason", jstr(c->reason));
    json_object_set_new(o, "provenance", jstr(line));
    char *s = json_dumps(o, JSON_PRESERVE_ORDER | JSON_COMPACT);
    json_decref(o);
    if (!s) fm_error(FM_E_NOMEM, "out of memory building the provenance JSON");
    return s;
}

void fm_tune_choice_source(const fm_tune_choice *ch, char *buf, size_t cap) {
    if (!buf || !cap) return;
    if (!ch) snprintf(buf, cap, "built-in default");
    else if ((ch->tuned || ch->nearest) && ch->source[0]) snprintf(buf, cap, "%s (bucket %d)", ch->source, ch->bucket);
    else snprintf(buf, cap, "%s", ch->source[0] ? ch->source : "built-in default");
}
