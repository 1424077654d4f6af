/*
 * cuda_readpat: how fast can a kernel that does nothing but read the bytes
 * of a decode step's active experts go, at exactly the sizes of a layer?
 *
 * The expert kernels stream their weights as 1 KB tiles (16 rows x 128 K
 * values of FP4), one warp per 16-row group, segment after segment. This
 * tool reads the same number of bytes, with the same grid and the same 16-
 * byte loads per lane, but no decode and no MMA, so its time is what the
 * memory system gives that access pattern at that size. Layouts of the
 * tiles inside one matrix (nrg row groups x nseg segments):
 *   rg   tile (r, s) at (r * nseg + s) KB: each warp reads one contiguous
 *        region (the expert kernels' layout);
 *   seg  tile (r, s) at (s * nrg + r) KB: at any moment the warps of a
 *        matrix read one contiguous front.
 * and the bandwidth probe's grid-stride loop over the same bytes ("probe").
 *
 * Each layer has its own copies (so L2, 50 MB, holds none of the next
 * layer); the layers' kernels are one CUDA graph, replayed; the best replay
 * is reported per layer. Reads are checked for completeness by an XOR of
 * every word against the host's XOR of the buffer.
 *
 *   cuda_readpat [--experts N] [--nrg R] [--nseg S] [--mats M] [--layers L]
 *                [--reps N] [--occ BLOCKS_PER_SM] [--scales sep|inter] [--json FILE]
 * Defaults: DeepSeek-V4-Flash at batch 1, gate/up (6 experts, 2 matrices of
 * 128 row groups x 32 segments); --nrg 256 --nseg 16 --mats 1 is its down.
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* the loads: fm_ld_nc, the same as the expert kernels' weight reads and the
 * engine's bandwidth probe, so that the ceiling is of the same loads */
#include "stream_read.cuh"

#define TOOL "cuda_readpat"
#include "cuda_check.cuh"

struct rp_params {
    const uint8_t *base; /* this layer's first expert            */
    size_t estride;      /* bytes between experts               */
    size_t mstride;      /* bytes between the matrices of one   */
    int nrg, nseg, nmat, wpb, ksplit, seg_major;
    unsigned *sink;
    int sc; /* block scales: 0 none, 1 a 128-byte tile per weight tile in an
               array after the weights, 2 after each weight tile (1152 B) */
};

/* Tile t of matrix m: its weights (lane's 16 bytes at + 0 and + 512) and
 * its scales (lanes 0 - 7, 16 bytes each). */
static __device__ __forceinline__ void rp_load(const rp_params &p, const uint8_t *mb, size_t t, int lane, uint4 *b) {
    const uint8_t *q = mb + t * (p.sc == 2 ? 1152 : 1024) + lane * 16;
    b[0] = fm_ld_nc(q);
    b[1] = fm_ld_nc(q + 512);
    if (p.sc && lane < 8)
        b[2] = fm_ld_nc(p.sc == 2 ? q + 1024
                                   : mb + (size_t)p.nrg * p.nseg * 1024 + t * 128 + lane * 16);
    else
        b[2] = make_uint4(0, 0, 0, 0);
}

/* One warp: row group r of every matrix, segments [s0, s1), D segments of
 * loads in flight (a register ring, as the expert kernels' register path). */
template <int D>
__global__ void rp_tiles(rp_params p) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int per_e = (p.nrg / p.wpb) * p.ksplit;
    const int e = blockIdx.x / per_e, rem = blockIdx.x % per_e;
    const int r = (rem / p.ksplit) * p.wpb + w, ks = rem % p.ksplit;
    const int s0 = ks * p.nseg / p.ksplit, s1 = (ks + 1) * p.nseg / p.ksplit;
    const uint8_t *eb = p.base + (size_t)e * p.estride;
    const size_t step = p.seg_major ? (size_t)p.nrg * 1024 : 1024;
    const size_t t0 = p.seg_major ? (size_t)s0 * p.nrg + r : (size_t)r * p.nseg + s0;
    uint32_t acc = 0;
    uint4 buf[D][2][3];
    const int n = s1 - s0;
    const size_t tstep = step / 1024;
#pragma unroll
    for (int d = 0; d < D; d++)
        if (d < n)
            for (int m = 0; m < 2; m++)
                if (m < p.nmat) rp_load(p, eb + m * p.mstride, t0 + d * tstep, lane, buf[d][m]);
    for (int i = 0; i < n; i += D) {
#pragma unroll
        for (int d = 0; d < D; d++) {
            if (i + d < n) {
                for (int m = 0; m < 2; m++)
                    if (m < p.nmat) {
                        uint4 a = buf[d][m][0], b = buf[d][m][1], c = buf[d][m][2];
                        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w;
                    }
                if (i + d + D < n)
                    for (int m = 0; m < 2; m++)
                        if (m < p.nmat) rp_load(p, eb + m * p.mstride, t0 + (size_t)(i + d + D) * tstep, lane, buf[d][m]);
            }
        }
    }
    atomicXor(p.sink, acc);
}

/* The bandwidth probe's loop over each expert's bytes (nmat matrices
 * back to back): grid-stride, four 16-byte loads in flight per thread. */
__global__ void rp_probe(rp_params p, size_t n16, int blocks_per_e) {
    const int e = blockIdx.x / blocks_per_e;
    const uint4 *q = (const uint4 *)(p.base + (size_t)e * p.estride);
    const size_t stride = (size_t)blocks_per_e * blockDim.x;
    size_t i = (size_t)(blockIdx.x % blocks_per_e) * blockDim.x + threadIdx.x;
    uint32_t acc = 0;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 a = fm_ld_nc(q + i), b = fm_ld_nc(q + i + stride), c = fm_ld_nc(q + i + 2 * stride),
              d = fm_ld_nc(q + i + 3 * stride);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n16; i += stride) {
        uint4 a = fm_ld_nc(q + i);
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    atomicXor(p.sink, acc);
}

__global__ void rp_fill(uint32_t *p, size_t n, uint32_t seed) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t x = (uint32_t)i * 2654435761u ^ seed;
        x ^= x >> 15;
        x *= 2246822519u;
        x ^= x >> 13;
        p[i] = x;
    }
}
__global__ void rp_xor(const uint32_t *p, size_t n, unsigned *out) {
    uint32_t acc = 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) acc ^= p[i];
    atomicXor(out, acc);
}

struct variant {
    const char *name;
    int kind; /* 0 tiles, 1 probe */
    int depth, wpb, ksplit, seg_major, probe_bpe;
};

static double run_variant(const variant &v, const rp_params &base, size_t layer_bytes, int layers, int experts,
                          size_t ebytes, int reps, unsigned want, int sms, size_t smem, bool *ok) {
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaMemset(base.sink, 0, 4));
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int l = 0; l < layers; l++) {
        rp_params p = base;
        p.base = base.base + (size_t)l * layer_bytes;
        p.wpb = v.wpb;
        p.ksplit = v.ksplit;
        p.seg_major = v.seg_major;
        if (v.kind == 1) {
            int bpe = v.probe_bpe > 0 ? v.probe_bpe : (sms * 8 + experts - 1) / experts;
            rp_probe<<<bpe * experts, 512, 0, s>>>(p, ebytes / 16, bpe);
        } else {
            int grid = experts * (p.nrg / p.wpb) * p.ksplit;
            void (*fn)(rp_params) = v.depth == 1 ? rp_tiles<1> : v.depth == 2 ? rp_tiles<2> : v.depth == 3 ? rp_tiles<3> : rp_tiles<4>;
            /* unused shared memory: limits the blocks per SM as an expert
             * kernel's resources do */
            CK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
            fn<<<grid, 32 * p.wpb, smem, s>>>(p);
        }
    }
    CK(cudaStreamEndCapture(s, &g));
    cudaGraphExec_t ge;
    CK(cudaGraphInstantiate(&ge, g, 0));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    double best = 1e30;
    unsigned got = 0;
    for (int r = 0; r <= reps; r++) {
        CK(cudaMemsetAsync(base.sink, 0, 4, s));
        CK(cudaEventRecord(a, s));
        CK(cudaGraphLaunch(ge, s));
        CK(cudaEventRecord(b, s));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        if (r > 0 && ms < best) best = ms;
        CK(cudaMemcpy(&got, base.sink, 4, cudaMemcpyDeviceToHost));
    }
    *ok = got == want;
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    cudaStreamDestroy(s);
    return best * 1e3 / layers;
}

static int arg_int(int argc, char **argv, const char *name, int def) {
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], name)) {
            char *end;
            long v = strtol(argv[i + 1], &end, 10);
            if (*end || v < 1 || v > 1 << 20) {
                fprintf(stderr, "cuda_readpat: %s needs a positive integer, got '%s'\n", name, argv[i + 1]);
                exit(2);
            }
            return (int)v;
        }
    return def;
}

int main(int argc, char **argv) {
    static const char *known[] = {"--experts", "--nrg", "--nseg", "--mats", "--layers",
                                  "--reps", "--occ", "--scales", "--json"};
    for (int i = 1; i < argc; i += 2) {
        bool ok = false;
        for (const char *k : known) ok = ok || !strcmp(argv[i], k);
        if (!ok || i + 1 >= argc) {
            fprintf(stderr, "cuda_readpat: %s '%s' (flags: --experts --nrg --nseg --mats --layers --reps --occ "
                    "--scales --json, each with a value)\n", ok ? "no value for" : "unknown argument", argv[i]);
            return 2;
        }
    }
    const int experts = arg_int(argc, argv, "--experts", 6), nrg = arg_int(argc, argv, "--nrg", 128),
              nseg = arg_int(argc, argv, "--nseg", 32), nmat = arg_int(argc, argv, "--mats", 2),
              layers = arg_int(argc, argv, "--layers", 8), reps = arg_int(argc, argv, "--reps", 20);
    /* --scales sep|inter: also the NVFP4 block scales, 128 bytes per tile,
     * in an array of their own (the expert kernels' layout) or after each
     * tile */
    int sc = 0;
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--scales")) {
            sc = !strcmp(argv[i + 1], "sep") ? 1 : !strcmp(argv[i + 1], "inter") ? 2 : -1;
            if (sc < 0) {
                fprintf(stderr, "cuda_readpat: --scales takes sep or inter, not '%s'\n", argv[i + 1]);
                return 2;
            }
        }
    /* --occ N: at most N tile blocks per SM (by their shared memory) */
    const int occ = arg_int(argc, argv, "--occ", 0);
    const char *json = NULL;
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--json")) json = argv[i + 1];
    if (nmat > 2 || nrg % 4) {
        fprintf(stderr, "cuda_readpat: --mats is 1 or 2 and --nrg a multiple of 4\n");
        return 2;
    }
    if (occ > 32) {
        fprintf(stderr, "cuda_readpat: --occ %d: at most 32 blocks per SM\n", occ);
        return 2;
    }
    /* the layers' bytes must fit the device: refuse sizes past 256 GiB
     * before any product can overflow */
    if ((double)nrg * nseg * 1152.0 * nmat * experts * layers > 256.0 * (1 << 30)) {
        fprintf(stderr, "cuda_readpat: %d layers x %d experts x %d matrices of %d x %d tiles is more than 256 GiB\n",
                layers, experts, nmat, nrg, nseg);
        return 2;
    }
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) {
        printf("cuda_readpat: no CUDA device: SKIPPED\n");
        return 0;
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    const size_t smem = occ ? (size_t)prop.sharedMemPerMultiprocessor / occ - prop.reservedSharedMemPerBlock - 128 : 0;
    const size_t mbytes = (size_t)nrg * nseg * (sc ? 1152 : 1024), ebytes = mbytes * nmat, lbytes = ebytes * experts;
    const size_t total = lbytes * layers;
    /* the bandwidth figure: the probe over 2 GiB in one launch */
    const size_t pbytes = (size_t)2 << 30;
    uint8_t *buf;
    CK(cudaMalloc(&buf, total > pbytes ? total : pbytes));
    unsigned *sink, want = 0;
    CK(cudaMalloc(&sink, 4));
    CK(cudaMemset(sink, 0, 4));
    rp_fill<<<sms * 8, 256>>>((uint32_t *)buf, (total > pbytes ? total : pbytes) / 4, 12345u);
    rp_xor<<<sms * 8, 256>>>((const uint32_t *)buf, total / 4, sink);
    CK(cudaDeviceSynchronize());
    /* a replay reads every word of every layer once: its XOR must be this */
    CK(cudaMemcpy(&want, sink, 4, cudaMemcpyDeviceToHost));
    double bw;
    {
        rp_params p = {buf, pbytes, 0, 4, 1, 1, 4, 1, 0, sink, 0};
        variant v = {"probe", 1, 0, 0, 0, 0, sms * 8};
        bool ok;
        double us = run_variant(v, p, 0, 1, 1, pbytes, 5, 0, sms, 0, &ok);
        bw = (double)pbytes / (us * 1e-6);
    }
    rp_params base = {buf, ebytes, mbytes, nrg, nseg, nmat, 4, 1, 0, sink, sc};
    printf("cuda_readpat on %s (%d SMs): %d layers x %d experts x %d matrices of %d row groups x %d segments%s "
           "(%.1f MB per layer)\n",
           prop.name, sms, layers, experts, nmat, nrg, nseg,
           sc == 1 ? ", scales in an array of their own" : sc == 2 ? ", scales after each tile" : "", lbytes / 1e6);
    if (occ) printf("%zu bytes of shared memory per tile block: at most %d blocks per SM\n", smem, occ);
    printf("streaming-read bandwidth (2 GiB, one launch): %.0f GB/s; floor of one layer %.2f us\n", bw / 1e9,
           lbytes / bw * 1e6);
    const variant vs[] = {
        {"rg 4w d1", 0, 1, 4, 1, 0, 0},   {"rg 4w d2", 0, 2, 4, 1, 0, 0},   {"rg 4w d3", 0, 3, 4, 1, 0, 0},
        {"rg 4w d4", 0, 4, 4, 1, 0, 0},   {"rg 4w d2 ks2", 0, 2, 4, 2, 0, 0}, {"rg 4w d2 ks4", 0, 2, 4, 4, 0, 0},
        {"rg 1w d2 ks4", 0, 2, 1, 4, 0, 0}, {"rg 4w d4 ks2", 0, 4, 4, 2, 0, 0}, {"seg 4w d1", 0, 1, 4, 1, 1, 0},
        {"seg 4w d2", 0, 2, 4, 1, 1, 0},  {"seg 4w d4", 0, 4, 4, 1, 1, 0},  {"seg 4w d2 ks2", 0, 2, 4, 2, 1, 0},
        {"seg 4w d2 ks4", 0, 2, 4, 4, 1, 0}, {"seg 4w d4 ks4", 0, 4, 4, 4, 1, 0}, {"seg 8w d2 ks2", 0, 2, 8, 2, 1, 0},
        {"probe 8/SM", 1, 0, 0, 0, 0, 0},  {"probe 4/SM", 1, 0, 0, 0, 0, -4}, {"probe 16/SM", 1, 0, 0, 0, 0, -16},
    };
    /* the JSON lines are kept until every variant ran, then written to a
     * temporary file renamed over --json: no partial file on a failure */
    static char jbuf[64][256];
    int nj = 0;
    printf("%-16s %10s %10s %8s %8s %6s\n", "variant", "grid", "us/layer", "GB/s", "% bw", "check");
    int bad = 0;
    for (const variant &v0 : vs) {
        variant v = v0;
        if (v.kind == 1 && v.probe_bpe < 0) v.probe_bpe = (sms * -v.probe_bpe + experts - 1) / experts;
        if (v.kind == 0 && (nrg % v.wpb || v.ksplit > nseg)) continue;
        if (occ && (v.kind != 0 || v.wpb != 4 || v.ksplit != 1 || v.seg_major)) continue;
        bool ok;
        double us = run_variant(v, base, lbytes, layers, experts, ebytes, reps, want, sms, smem, &ok);
        int grid = v.kind == 1 ? (v.probe_bpe ? v.probe_bpe : (sms * 8 + experts - 1) / experts) * experts
                               : experts * (nrg / v.wpb) * v.ksplit;
        double gbs = lbytes / (us * 1e-6) / 1e9;
        printf("%-16s %10d %10.2f %8.0f %8.1f %6s\n", v.name, grid, us, gbs, 100.0 * gbs * 1e9 / bw, ok ? "ok" : "BAD");
        if (!ok) bad++;
        if (nj < 64)
            snprintf(jbuf[nj++], sizeof jbuf[0],
                     "{\"variant\":\"%s\",\"experts\":%d,\"nrg\":%d,\"nseg\":%d,\"mats\":%d,\"grid\":%d,\"us\":%.3f,"
                     "\"gbs\":%.1f,\"bw_gbs\":%.1f,\"ok\":%s}\n",
                     v.name, experts, nrg, nseg, nmat, grid, us, gbs, bw / 1e9, ok ? "true" : "false");
    }
    if (json) {
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s.tmp", json);
        FILE *jf = fopen(tmp, "w");
        int werr = !jf;
        for (int i = 0; jf && i < nj; i++) werr |= fputs(jbuf[i], jf) < 0;
        if (jf) werr |= fclose(jf) != 0;
        if (werr || rename(tmp, json) != 0) {
            remove(tmp);
            fprintf(stderr, "cuda_readpat: cannot write %s\n", json);
            return 1;
        }
    }
    cudaFree(buf);
    cudaFree(sink);
    return bad ? 1 : 0;
}
