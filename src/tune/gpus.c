/* Known GPUs, so `explain --gpu NAME` can plan for a GPU that is not here.
 * Names are spelled as the CUDA runtime reports them (cudaDeviceProp.name),
 * because tuned config files are keyed by that string. Bandwidth, L2, memory
 * and power are NVIDIA's datasheet figures: good for planning, while `bench`
 * measures the real bandwidth of the GPU in hand. Sources for the Blackwell
 * rows: the NVIDIA RTX Blackwell GPU Architecture whitepaper (RTX 5090: 170
 * SMs, 96 MB L2, 1792 GB/s, 32 GB, 575 W), the RTX PRO 6000 Blackwell
 * Workstation, Max-Q and Server Edition datasheets (188 SMs, 128 MB L2, 96
 * GB; 1792 GB/s at 600 W and 300 W, Server Edition 1597 GB/s at up to 600 W)
 * and the HGX/DGX B200 datasheets (148 SMs, 180 GB, 8 TB/s, 1000 W). */
#include "fp4moe.h"

#include <ctype.h>
#include <string.h>
#include <strings.h>

static const fm_gpu_info k_gpus[] = {
    /* name, aliases, SMs, GB/s, L2 MB, cc, FP4 tensor cores, memory GB, W */
    {"NVIDIA H200", "H200,H200 SXM,H200-SXM", 132, 4800, 50, 90, 0, 141, 700},
    {"NVIDIA H100 80GB HBM3", "H100,H100 SXM,H100-SXM,H100 SXM5", 132, 3350, 50, 90, 0, 80, 700},
    {"NVIDIA H100 PCIe", "H100 PCIe,H100-PCIe", 114, 2000, 50, 90, 0, 80, 350},
    {"NVIDIA A100-SXM4-80GB", "A100,A100 SXM,A100-SXM4,A100 80GB", 108, 2039, 40, 80, 0, 80, 400},
    {"NVIDIA L40S", "L40S", 142, 864, 96, 89, 0, 48, 350},
    {"NVIDIA GeForce RTX 4090", "RTX 4090,4090,GeForce RTX 4090", 128, 1008, 72, 89, 0, 24, 450},
    {"NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
     "RTX PRO 6000,RTX PRO 6000 Blackwell,RTX PRO 6000 Workstation,RTX PRO 6000 Blackwell Workstation Edition", 188,
     1792, 128, 120, 1, 96, 600},
    {"NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition",
     "RTX PRO 6000 Max-Q,RTX PRO 6000 Blackwell Max-Q,RTX PRO 6000 Blackwell Max-Q Workstation Edition", 188, 1792,
     128, 120, 1, 96, 300},
    {"NVIDIA RTX PRO 6000 Blackwell Server Edition",
     "RTX PRO 6000 Server,RTX PRO 6000 Blackwell Server,RTX PRO 6000 Blackwell Server Edition", 188, 1597, 128, 120,
     1, 96, 600},
    {"NVIDIA GeForce RTX 5090", "RTX 5090,5090,GeForce RTX 5090", 170, 1792, 96, 120, 1, 32, 575},
    {"NVIDIA B200", "B200", 148, 8000, 126, 100, 1, 180, 1000},
};

size_t fm_gpu_count(void) { return sizeof k_gpus / sizeof k_gpus[0]; }
const fm_gpu_info *fm_gpu_at(size_t i) { return i < fm_gpu_count() ? &k_gpus[i] : NULL; }

/* Case-insensitive equality that also ignores a leading "NVIDIA ". */
static int name_eq(const char *a, size_t an, const char *b) {
    if (an >= 7 && !strncasecmp(a, "NVIDIA ", 7)) { a += 7; an -= 7; }
    if (!strncasecmp(b, "NVIDIA ", 7)) b += 7;
    return strlen(b) == an && !strncasecmp(a, b, an);
}

const fm_gpu_info *fm_gpu_lookup(const char *name) {
    if (!name) return NULL;
    while (isspace((unsigned char)*name)) name++;
    size_t n = strlen(name);
    while (n && isspace((unsigned char)name[n - 1])) n--;
    if (!n) return NULL;
    for (size_t i = 0; i < fm_gpu_count(); i++) {
        if (name_eq(name, n, k_gpus[i].name)) return &k_gpus[i];
        const char *a = k_gpus[i].aliases;
        while (a && *a) {
            const char *e = strchr(a, ',');
            size_t l = e ? (size_t)(e - a) : strlen(a);
            char tmp[96];
            if (l < sizeof tmp) {
                memcpy(tmp, a, l);
                tmp[l] = 0;
                if (name_eq(name, n, tmp)) return &k_gpus[i];
            }
            a = e ? e + 1 : NULL;
        }
    }
    return NULL;
}
