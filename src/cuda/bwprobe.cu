/* The bandwidth probe: the streaming read of a device buffer that every
 * benchmark measures its floor against, and the same read kept up for a
 * power baseline. */
#include "cuda_internal.h"
#include "stream_read.cuh"
extern "C" {
#include "util/util.h"
}

/* The probe's kernels (stream_read.cuh, shared with the read-pattern tools
 * under dev/): the grid-stride loads without an L2 fetch-size hint (the hint
 * reads slower) and, on sm_90, TMA bulk copies through a ring of four 32 KB
 * stages; the probe takes the faster of the two. */
#define FM_BULK_NS 4

__global__ void fm_fill_hash_kernel(uint32_t *p, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = (uint32_t)(i * 2654435761u) ^ 0x5bd1e995u;
}

/* What both reads of the probe's buffer start with: the device's SM count,
 * buf (the caller's scratch) filled with a hash of the word index, and n_acc
 * words for the reads' XORs. */
static fm_status stream_prep(const void *buf, size_t bytes, cudaStream_t s, int n_acc, int *sms, unsigned **acc) {
    int dev;
    FM_CU(cudaGetDevice(&dev));
    FM_CU(cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev));
    fm_fill_hash_kernel<<<*sms * 4, 256, 0, s>>>((uint32_t *)buf, bytes / 4);
    FM_CU_LAUNCH("fm_fill_hash_kernel");
    FM_CU(cudaMalloc(acc, n_acc * sizeof(unsigned)));
    return FM_OK;
}

/* Fills buf with a hash of the word index, then the best seconds of reps
 * timed reads of it (after one untimed) by the grid-stride loads and, where
 * the build has the sm_90a code, by the TMA bulk copies; a bulk read counts
 * only if its XOR of the bytes equals the loads'. */
extern "C" fm_status fm_cuda_stream_read(const void *buf, size_t bytes, cudaStream_t s, int reps, double *best_s) {
    const int bulk = fm_cuda_wgmma_built() && bytes % FM_BULK_CH == 0;
    if (bulk)
        FM_CU(cudaFuncSetAttribute(fm_bulk_read_kernel<FM_BULK_NS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   FM_BULK_NS * FM_BULK_CH));
    int sms;
    unsigned *acc;
    fm_status ps = stream_prep(buf, bytes, s, 2, &sms, &acc);
    if (ps != FM_OK) return ps;
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    double best[2] = {1e30, 1e30};
    unsigned x[2] = {0, 0};
    fm_status st = FM_OK;
    for (int kind = 0; kind < 1 + bulk && st == FM_OK; kind++) {
        for (int r = 0; r < reps + 1 && st == FM_OK; r++) {
            cudaError_t err = cudaMemsetAsync(acc + kind, 0, sizeof(unsigned), s);
            cudaEventRecord(a, s);
            if (kind == 0) fm_gs_read_kernel<4, false><<<sms * 8, 512, 0, s>>>((const uint4 *)buf, bytes / 16, acc);
            else
                fm_bulk_read_kernel<FM_BULK_NS>
                    <<<sms, 256, FM_BULK_NS * FM_BULK_CH, s>>>((const uint8_t *)buf, bytes, acc + 1);
            cudaEventRecord(b, s);
            if (err == cudaSuccess) err = cudaGetLastError();
            if (err == cudaSuccess) err = cudaEventSynchronize(b);
            if (err != cudaSuccess) {
                st = fm_error(FM_E_CUDA, "bandwidth kernel failed: %s", cudaGetErrorString(err));
                break;
            }
            float ms = 0;
            cudaEventElapsedTime(&ms, a, b);
            if (r > 0 && ms * 1e-3 < best[kind]) best[kind] = ms * 1e-3;
        }
    }
    if (st == FM_OK && cudaMemcpy(x, acc, sizeof x, cudaMemcpyDeviceToHost) != cudaSuccess)
        st = fm_error(FM_E_CUDA, "bandwidth check: %s", cudaGetErrorString(cudaGetLastError()));
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    cudaFree(acc);
    /* an empty bulk kernel (no sm_90 code) leaves 0; should the buffer's
     * XOR itself be 0, the bulk read is simply not counted */
    *best_s = bulk && x[1] == x[0] && x[0] != 0 && best[1] < best[0] ? best[1] : best[0];
    return st;
}

/* The probe's grid-stride read of buf kept up for `seconds` of host time:
 * batches of reads back to back (one event wait per batch, so the device
 * never idles between reads of a batch), the mean rate over all of them.
 * What the device draws while it only reads memory (`profile`'s power
 * baseline). */
extern "C" fm_status fm_cuda_stream_read_for(const void *buf, size_t bytes, cudaStream_t s, double seconds,
                                             double *rate_Bps) {
    *rate_Bps = 0;
    int sms;
    unsigned *acc;
    fm_status ps = stream_prep(buf, bytes, s, 1, &sms, &acc);
    if (ps != FM_OK) return ps;
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    fm_status st = FM_OK;
    double gpu_s = 0, n_reads = 0;
    const uint64_t t0 = fm_now_ns();
    /* about 20 ms of reads per batch at an H200's 4.5 TB/s */
    const double want = 9e10 / (double)bytes;
    const int per = want < 1 ? 1 : want > 256 ? 256 : (int)want;
    while (st == FM_OK && (double)(fm_now_ns() - t0) * 1e-9 < seconds) {
        cudaEventRecord(a, s);
        for (int r = 0; r < per; r++)
            fm_gs_read_kernel<4, false><<<sms * 8, 512, 0, s>>>((const uint4 *)buf, bytes / 16, acc);
        cudaEventRecord(b, s);
        cudaError_t err = cudaGetLastError();
        if (err == cudaSuccess) err = cudaEventSynchronize(b);
        if (err != cudaSuccess) {
            st = fm_error(FM_E_CUDA, "sustained read failed: %s", cudaGetErrorString(err));
            break;
        }
        float ms = 0;
        cudaEventElapsedTime(&ms, a, b);
        gpu_s += ms * 1e-3;
        n_reads += per;
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    cudaFree(acc);
    if (st == FM_OK && gpu_s > 0) *rate_Bps = n_reads * (double)bytes / gpu_s;
    return st;
}

/* The probe's buffer on e's device: at least 64 MiB, whole 32 KB chunks for
 * the bulk-copy read; NULL with the error set when it cannot be had. */
static void *probe_buffer(fm_cuda_engine *e, size_t *bytes) {
    if (cudaSetDevice(e->device) != cudaSuccess) {
        fm_error(FM_E_CUDA, "bandwidth probe: %s", cudaGetErrorString(cudaGetLastError()));
        return NULL;
    }
    if (*bytes < (64u << 20)) *bytes = 64u << 20;
    *bytes &= ~(size_t)32767;
    void *buf = NULL;
    if (cudaMalloc(&buf, *bytes) != cudaSuccess) {
        cudaGetLastError();
        fm_error(FM_E_NOMEM, "bandwidth probe: no %zu MiB of device memory", *bytes >> 20);
        return NULL;
    }
    return buf;
}

double fm_cuda_measure_bandwidth(fm_cuda_engine *e, size_t bytes) {
    if (!e) return 0.0;
    void *buf = probe_buffer(e, &bytes);
    if (!buf) return 0.0;
    double best = 0;
    fm_status s = fm_cuda_stream_read(buf, bytes, e->stream, 10, &best);
    cudaFree(buf);
    return s == FM_OK && best > 0 ? (double)bytes / best : 0.0;
}

double fm_cuda_sustained_read(fm_cuda_engine *e, size_t bytes, double seconds) {
    if (!e) return fm_error(FM_E_ARG, "sustained read: NULL engine"), 0.0;
    if (!(seconds > 0 && seconds <= 600)) return fm_error(FM_E_RANGE, "sustained read: %g s", seconds), 0.0;
    void *buf = probe_buffer(e, &bytes);
    if (!buf) return 0.0;
    double rate = 0;
    fm_status s = fm_cuda_stream_read_for(buf, bytes, e->stream, seconds, &rate);
    cudaFree(buf);
    return s == FM_OK ? rate : 0.0;
}
