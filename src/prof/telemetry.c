/* Telemetry sampled in the background during a profile: NVML for a GPU
 * (loaded at run time, so the library needs no NVIDIA driver to build or to
 * run on the CPU), and host CPU utilization from /proc/stat always.
 *
 * NVML is declared here by hand (the handful of entry points used, with the
 * types and constants of NVML's public nvml.h) because nvml.h ships with the
 * driver development files, not with every toolkit install. */
#include "prof/prof_internal.h"

#include <dlfcn.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef FM_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

typedef int nvml_ret;               /* nvmlReturn_t, 0 = NVML_SUCCESS   */
typedef struct nvml_dev_st *nvml_dev; /* nvmlDevice_t                   */
typedef struct { unsigned gpu, memory; } nvml_util; /* nvmlUtilization_t */
enum { NVML_CLOCK_SM = 1, NVML_CLOCK_MEM = 2, NVML_TEMPERATURE_GPU = 0 };
#define NVML_REASON_GPU_IDLE 0x1ull

typedef struct {
    void *lib;
    nvml_dev dev;
    nvml_ret (*init)(void);
    nvml_ret (*shutdown)(void);
    const char *(*err_str)(nvml_ret);
    nvml_ret (*by_index)(unsigned, nvml_dev *);
    nvml_ret (*by_pci)(const char *, nvml_dev *);
    nvml_ret (*name)(nvml_dev, char *, unsigned);
    nvml_ret (*util)(nvml_dev, nvml_util *);
    nvml_ret (*power)(nvml_dev, unsigned *);
    nvml_ret (*power_limit)(nvml_dev, unsigned *);
    nvml_ret (*clock)(nvml_dev, int, unsigned *);
    nvml_ret (*reasons)(nvml_dev, unsigned long long *);
    nvml_ret (*temp)(nvml_dev, int, unsigned *);
} nvml_api;

struct fm_telemetry {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int running, stop_req, joined;
    int period_ms;
    uint64_t t0_ns;
    int has_nvml;
    nvml_api nv;
    char note[256];
    /* /proc/stat: previous totals for the utilization delta */
    unsigned long long cpu_busy, cpu_total, proc_ticks;
    int cpu_ok, proc_ok;
    fm_telem_sample *s;
    size_t n, cap;
    int oom; /* sample storage could not grow: later samples dropped */
};

const char *fm_telem_metric_name(fm_telem_metric m) {
    static const char *const names[FM_TM_COUNT] = {"sm_util_pct", "mem_util_pct", "power_w", "power_limit_w",
                                                   "sm_mhz",      "mem_mhz",      "temp_c",  "cpu_util_pct",
                                                   "proc_cpu_util_pct"};
    return (unsigned)m < FM_TM_COUNT ? names[m] : "invalid";
}

void fm_telemetry_throttle_str(uint64_t bits, char *buf, size_t cap) {
    static const struct { uint64_t bit; const char *name; } k[] = {
        {0x1, "gpu_idle"},           {0x2, "app_clocks"},          {FM_THROTTLE_SW_POWER_CAP, "sw_power_cap"},
        {0x8, "hw_slowdown"},        {0x10, "sync_boost"},         {0x20, "sw_thermal"},
        {0x40, "hw_thermal"},        {FM_THROTTLE_HW_POWER_BRAKE, "hw_power_brake"},     {0x100, "display_clocks"},
    };
    if (!buf || !cap) return;
    buf[0] = 0;
    if (!bits) { snprintf(buf, cap, "none"); return; }
    size_t len = 0;
    uint64_t known = 0;
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
        known |= k[i].bit;
        if (!(bits & k[i].bit)) continue;
        int w = snprintf(buf + len, cap - len, "%s%s", len ? "," : "", k[i].name);
        if (w < 0 || (size_t)w >= cap - len) return;
        len += (size_t)w;
    }
    if (bits & ~known) snprintf(buf + len, cap - len, "%s0x%llx", len ? "," : "", (unsigned long long)(bits & ~known));
}

static int read_proc_stat(unsigned long long *busy, unsigned long long *total) {
    FILE *f = fopen("/proc/stat", "r");
    if (!f) return 0;
    unsigned long long v[8] = {0};
    int n = fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6],
                   &v[7]);
    fclose(f);
    if (n < 4) return 0;
    unsigned long long t = 0;
    for (int i = 0; i < 8; i++) t += v[i];
    *total = t;
    *busy = t - v[3] - v[4]; /* idle + iowait */
    return 1;
}

/* utime + stime of this process, in clock ticks like /proc/stat. */
static int read_proc_self(unsigned long long *ticks) {
    char buf[1024];
    FILE *f = fopen("/proc/self/stat", "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    /* the command name (field 2) may hold spaces: fields resume after ')' */
    const char *p = strrchr(buf, ')');
    if (!p) return 0;
    unsigned long long ut = 0, st = 0;
    if (sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2) return 0;
    *ticks = ut + st;
    return 1;
}

static void take_sample(fm_telemetry *t) {
    fm_telem_sample s;
    s.t_s = (double)(fm_now_ns() - t->t0_ns) * 1e-9;
    for (int m = 0; m < FM_TM_COUNT; m++) s.v[m] = NAN;
    s.throttle = 0;
    unsigned long long busy, total, ticks = 0;
    int have_self = read_proc_self(&ticks);
    if (read_proc_stat(&busy, &total)) {
        if (t->cpu_ok && total > t->cpu_total) {
            s.v[FM_TM_CPU_UTIL] = 100.0 * (double)(busy - t->cpu_busy) / (double)(total - t->cpu_total);
            if (have_self && t->proc_ok && ticks >= t->proc_ticks) {
                double u = 100.0 * (double)(ticks - t->proc_ticks) / (double)(total - t->cpu_total);
                s.v[FM_TM_PROC_UTIL] = u > 100.0 ? 100.0 : u;
            }
        }
        if (have_self) {
            t->proc_ticks = ticks;
            t->proc_ok = 1;
        }
        t->cpu_busy = busy;
        t->cpu_total = total;
        t->cpu_ok = 1;
    }
    if (t->has_nvml) {
        nvml_api *nv = &t->nv;
        nvml_util u;
        unsigned x;
        unsigned long long r;
        if (nv->util && nv->util(nv->dev, &u) == 0) {
            s.v[FM_TM_SM_UTIL] = u.gpu;
            s.v[FM_TM_MEM_UTIL] = u.memory;
        }
        if (nv->power && nv->power(nv->dev, &x) == 0) s.v[FM_TM_POWER_W] = x / 1000.0;
        if (nv->power_limit && nv->power_limit(nv->dev, &x) == 0) s.v[FM_TM_POWER_LIMIT_W] = x / 1000.0;
        if (nv->clock && nv->clock(nv->dev, NVML_CLOCK_SM, &x) == 0) s.v[FM_TM_SM_MHZ] = x;
        if (nv->clock && nv->clock(nv->dev, NVML_CLOCK_MEM, &x) == 0) s.v[FM_TM_MEM_MHZ] = x;
        if (nv->temp && nv->temp(nv->dev, NVML_TEMPERATURE_GPU, &x) == 0) s.v[FM_TM_TEMP_C] = x;
        if (nv->reasons && nv->reasons(nv->dev, &r) == 0) s.throttle = r;
    }
    pthread_mutex_lock(&t->mu);
    if (t->n == t->cap && !t->oom) {
        size_t nc = t->cap ? 2 * t->cap : 256;
        fm_telem_sample *ns = realloc(t->s, nc * sizeof *ns);
        if (ns) {
            t->s = ns;
            t->cap = nc;
        } else {
            t->oom = 1;
        }
    }
    if (t->n < t->cap) t->s[t->n++] = s;
    pthread_mutex_unlock(&t->mu);
}

static void *sampler_main(void *arg) {
    fm_telemetry *t = arg;
    pthread_mutex_lock(&t->mu);
    while (!t->stop_req) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        long ns = ts.tv_nsec + (long)t->period_ms * 1000000L;
        ts.tv_sec += ns / 1000000000L;
        ts.tv_nsec = ns % 1000000000L;
        int rc = 0;
        while (!t->stop_req && rc != ETIMEDOUT) rc = pthread_cond_timedwait(&t->cv, &t->mu, &ts);
        if (t->stop_req) break;
        pthread_mutex_unlock(&t->mu);
        take_sample(t);
        pthread_mutex_lock(&t->mu);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

/* Loads NVML and picks the device; on any failure the note says why. */
static void nvml_open(fm_telemetry *t, int device_index) {
    const char *path = getenv("FP4MOE_NVML_LIB");
    if (!path || !*path) path = "libnvidia-ml.so.1";
    nvml_api *nv = &t->nv;
    nv->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!nv->lib) {
        const char *e = dlerror();
        snprintf(t->note, sizeof t->note, "NVML unavailable (%s: %s); GPU telemetry off", path, e ? e : "not found");
        return;
    }
#define SYM(field, name) *(void **)(&nv->field) = dlsym(nv->lib, name)
    SYM(init, "nvmlInit_v2");
    SYM(shutdown, "nvmlShutdown");
    SYM(err_str, "nvmlErrorString");
    SYM(by_index, "nvmlDeviceGetHandleByIndex_v2");
    SYM(by_pci, "nvmlDeviceGetHandleByPciBusId_v2");
    SYM(name, "nvmlDeviceGetName");
    SYM(util, "nvmlDeviceGetUtilizationRates");
    SYM(power, "nvmlDeviceGetPowerUsage");
    SYM(power_limit, "nvmlDeviceGetEnforcedPowerLimit");
    SYM(clock, "nvmlDeviceGetClockInfo");
    SYM(reasons, "nvmlDeviceGetCurrentClocksEventReasons");
    if (!nv->reasons) SYM(reasons, "nvmlDeviceGetCurrentClocksThrottleReasons");
    SYM(temp, "nvmlDeviceGetTemperature");
#undef SYM
    if (!nv->init || !nv->shutdown || (!nv->by_index && !nv->by_pci)) {
        snprintf(t->note, sizeof t->note, "NVML unavailable (%s lacks nvmlInit_v2/nvmlDeviceGetHandleByIndex_v2)", path);
        dlclose(nv->lib);
        memset(nv, 0, sizeof *nv);
        return;
    }
    nvml_ret r = nv->init();
    if (r != 0) {
        snprintf(t->note, sizeof t->note, "NVML unavailable (nvmlInit: %s)", nv->err_str ? nv->err_str(r) : "error");
        dlclose(nv->lib);
        memset(nv, 0, sizeof *nv);
        return;
    }
    /* NVML numbers GPUs in PCI order, CUDA fastest-first unless
     * CUDA_DEVICE_ORDER=PCI_BUS_ID: match by PCI bus id where we can. */
    r = -1;
#ifdef FM_HAVE_CUDA
    char bus[64];
    if (nv->by_pci && cudaDeviceGetPCIBusId(bus, (int)sizeof bus, device_index) == cudaSuccess)
        r = nv->by_pci(bus, &nv->dev);
#endif
    if (r != 0 && nv->by_index) r = nv->by_index((unsigned)device_index, &nv->dev);
    if (r != 0) {
        snprintf(t->note, sizeof t->note, "NVML has no device %d (%s); GPU telemetry off", device_index,
                 nv->err_str ? nv->err_str(r) : "error");
        nv->shutdown();
        dlclose(nv->lib);
        memset(nv, 0, sizeof *nv);
        return;
    }
    char name[96] = "?";
    if (nv->name && nv->name(nv->dev, name, sizeof name) != 0) snprintf(name, sizeof name, "?");
    name[sizeof name - 1] = 0;
    t->has_nvml = 1;
    snprintf(t->note, sizeof t->note, "NVML (%s) on %s every %d ms, host CPU from /proc/stat", path, name,
             t->period_ms);
}

fm_status fm_telemetry_start(fm_device dev, int device_index, int period_ms, uint64_t t0_ns, fm_telemetry **out) {
    if (!out) return fm_error(FM_E_ARG, "telemetry: NULL output");
    *out = NULL;
    if (period_ms < 1 || period_ms > 60000)
        return fm_error(FM_E_RANGE, "telemetry: period %d ms outside [1, 60000]", period_ms);
    fm_telemetry *t = fm_calloc(1, sizeof *t);
    if (!t) return FM_E_NOMEM;
    t->period_ms = period_ms;
    t->t0_ns = t0_ns;
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    if (dev == FM_DEV_CUDA)
        nvml_open(t, device_index);
    else
        snprintf(t->note, sizeof t->note, "host CPU utilization from /proc/stat every %d ms (no NVML on the CPU path)",
                 period_ms);
    take_sample(t);
    /* A baseline sample now, so that even a run shorter than one period
     * has utilization figures at its stop sample. */
    take_sample(t);
    if (pthread_create(&t->thread, NULL, sampler_main, t) != 0) {
        fm_telemetry_free(t);
        return fm_error(FM_E_NOMEM, "telemetry: cannot start the sampler thread");
    }
    t->running = 1;
    *out = t;
    return FM_OK;
}

void fm_telemetry_stop(fm_telemetry *t) {
    if (!t || !t->running || t->joined) return;
    pthread_mutex_lock(&t->mu);
    t->stop_req = 1;
    pthread_cond_signal(&t->cv);
    pthread_mutex_unlock(&t->mu);
    pthread_join(t->thread, NULL);
    t->joined = 1;
    take_sample(t);
}

void fm_telemetry_free(fm_telemetry *t) {
    if (!t) return;
    fm_telemetry_stop(t);
    if (t->has_nvml) {
        t->nv.shutdown();
        dlclose(t->nv.lib);
    }
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv);
    free(t->s);
    free(t);
}

const char *fm_telemetry_note(const fm_telemetry *t) { return t ? t->note : ""; }
int fm_telemetry_has_nvml(const fm_telemetry *t) { return t ? t->has_nvml : 0; }

size_t fm_telemetry_samples(const fm_telemetry *t, const fm_telem_sample **out) {
    if (!t) {
        if (out) *out = NULL;
        return 0;
    }
    if (out) *out = t->s;
    return t->n;
}

void fm_telemetry_summarize(const fm_telem_sample *s, size_t n, double t_begin, double t_end, fm_telem_summary *out) {
    int cnt[FM_TM_COUNT] = {0};
    double sum[FM_TM_COUNT] = {0};
    memset(out, 0, sizeof *out);
    for (int m = 0; m < FM_TM_COUNT; m++) out->max[m] = NAN;
    for (size_t i = 0; s && i < n; i++) {
        if (s[i].t_s < t_begin || s[i].t_s > t_end) continue;
        out->n++;
        out->throttle_any |= s[i].throttle & ~NVML_REASON_GPU_IDLE;
        for (int m = 0; m < FM_TM_COUNT; m++) {
            double v = s[i].v[m];
            if (isnan(v)) continue;
            sum[m] += v;
            cnt[m]++;
            if (isnan(out->max[m]) || v > out->max[m]) out->max[m] = v;
        }
    }
    for (int m = 0; m < FM_TM_COUNT; m++) out->mean[m] = cnt[m] ? sum[m] / cnt[m] : NAN;
}
