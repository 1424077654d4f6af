/* A stand-in for libnvidia-ml.so.1 with fixed readings (the GLM-5 case of
 * CONTEXT.md: 97 % busy at 328 W of 600 W), so the NVML path of the
 * telemetry sampler runs in CI. Built at test time by test_prof_nvml.c.
 * FAKE_NVML_INIT_FAIL=1 makes nvmlInit_v2 fail like a missing driver. */
#include <stdlib.h>
#include <string.h>

typedef struct { unsigned gpu, memory; } util_t;
static int dev_token;

int nvmlInit_v2(void) { return getenv("FAKE_NVML_INIT_FAIL") ? 9 : 0; }
int nvmlShutdown(void) { return 0; }
const char *nvmlErrorString(int r) { return r == 9 ? "Driver Not Loaded" : "Unknown Error"; }
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void **dev) {
    if (i != 0) return 2; /* NVML_ERROR_INVALID_ARGUMENT */
    *dev = &dev_token;
    return 0;
}
int nvmlDeviceGetName(void *dev, char *name, unsigned len) {
    (void)dev;
    strncpy(name, "Fake H200", len);
    return 0;
}
int nvmlDeviceGetUtilizationRates(void *dev, util_t *u) {
    (void)dev;
    u->gpu = 97;
    u->memory = 27;
    return 0;
}
int nvmlDeviceGetPowerUsage(void *dev, unsigned *mw) { (void)dev; *mw = 328000; return 0; }
int nvmlDeviceGetEnforcedPowerLimit(void *dev, unsigned *mw) { (void)dev; *mw = 600000; return 0; }
int nvmlDeviceGetClockInfo(void *dev, int type, unsigned *mhz) {
    (void)dev;
    if (type == 1) { *mhz = 1980; return 0; } /* NVML_CLOCK_SM */
    if (type == 2) { *mhz = 3201; return 0; } /* NVML_CLOCK_MEM */
    return 2;
}
int nvmlDeviceGetCurrentClocksEventReasons(void *dev, unsigned long long *r) { (void)dev; *r = 0x4; return 0; }
int nvmlDeviceGetTemperature(void *dev, int sensor, unsigned *t) { (void)dev; (void)sensor; *t = 61; return 0; }
