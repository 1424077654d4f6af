#!/usr/bin/env bash
# Benchmark of `fp4moe trace summary`: generates a synthetic SGLang-style
# decode trace of SIZE_MB uncompressed megabytes (Kineto layout: CUDA-graph
# replays with long templated kernel names and full kernel args, NCCL on a
# second stream, cpu_op / python_function / cuda_runtime events with args,
# flow events, ProfilerStep annotations), times the summary on one core
# (--jobs 1) on the plain and the gzip file, and times Python's json.load on
# the plain file for comparison. Files go to $TMPDIR (default /tmp) and are
# removed at the end.
#
# usage: dev/trace_bench.sh [BUILD_DIR] [SIZE_MB]     (defaults: build 1000)
set -euo pipefail
BUILD=${1:-build}
SIZE_MB=${2:-1000}
CLI=$BUILD/fp4moe
[ -x "$CLI" ] || { echo "no $CLI: build first (cmake --build $BUILD)"; exit 1; }
DIR=$(mktemp -d "${TMPDIR:-/tmp}/fm_trace_bench.XXXXXX")
trap 'rm -rf "$DIR"' EXIT
TRACE=$DIR/bench-TP-0.trace.json

python3 - "$TRACE" "$SIZE_MB" <<'EOF'
import random, sys
path, size_mb = sys.argv[1], int(sys.argv[2])
target = size_mb * 1000 * 1000
rng = random.Random(7)
layer_kernels = [
    ("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>(__nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*, unsigned int, unsigned int, float)", 3.1),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", 9.5),
    ("void flash::flash_fwd_splitkv_mla_kernel<Flash_fwd_kernel_traits_mla<576, 64, 64, 8, cutlass::bfloat16_t, 512>, true, false, false, false>(Flash_fwd_mla_params)", 80.0),
    ("void flash::flash_fwd_splitkv_mla_combine_kernel<cutlass::bfloat16_t, float, 512, 8>(Flash_fwd_mla_params)", 4.0),
    ("void moe_fused_gate_kernel<float, 256, 8, 4>(void*, void*, float*, int*, long, long, long, long, long, double)", 4.2),
    ("void moe_align_block_size_kernel<int>(int const*, int*, int*, int*, int, int, int, unsigned long)", 3.0),
    ("void per_token_group_quant_8bit_kernel<__nv_bfloat16, c10::Float8_e4m3fn, false>(__nv_bfloat16 const*, void*, float*, int, int, int, float, float, float, int, int)", 2.5),
    ("fused_moe_kernel", 60.0),
    ("void act_and_mul_kernel<c10::BFloat16, &silu_kernel<c10::BFloat16>, false>(c10::BFloat16*, c10::BFloat16 const*, int)", 3.3),
    ("fused_moe_kernel", 40.0),
    ("void moe_sum_reduce_kernel<__nv_bfloat16, 8>(__nv_bfloat16 const*, __nv_bfloat16*, long, long, float)", 2.2),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, at::detail::Array<char*, 3>)", 1.9),
]
nccl = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
out = open(path, "w", buffering=1 << 22)
w = out.write
w('{\n  "schemaVersion": 1,\n  "deviceProperties": [\n    {\n      "id": 0, "name": "NVIDIA H200", "totalGlobalMem": 150109880320,\n'
  '      "computeMajor": 9, "computeMinor": 0, "numSms": 132\n    }\n  ],\n'
  '  "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 8},\n  "traceEvents": [\n')
first = True
size = 0
ts = 1712195495406752.125
corr = 1000
ext = 1
step = 1
parts = []
def emit(s):
    global first, size
    if not first:
        parts.append(",\n")
    first = False
    parts.append(s)
    size += len(s) + 2
while size < target:
    cpu = ts
    emit('  {\n    "ph": "X", "cat": "user_annotation", "name": "ProfilerStep#%d", "pid": 812, "tid": 812,\n    "ts": %.3f, "dur": %.3f,\n    "args": {\n      "External id": %d, "Record function id": 0, "Ev Idx": %d\n    }\n  }' % (step, cpu, 3900.0, ext, ext))
    # scheduler-side CPU work with shapes and stacks
    for i in range(150):
        c = cpu + 5 + i * 2.5
        emit('  {\n    "ph": "X", "cat": "cpu_op", "name": "aten::%s", "pid": 812, "tid": 812,\n    "ts": %.3f, "dur": %.3f,\n    "args": {\n      "External id": %d, "Record function id": 0, "Concrete Inputs": ["", "", ""], "Input Dims": [[%d, 7168], [7168], []], "Input type": ["c10::BFloat16", "c10::BFloat16", "Scalar"], "Input Strides": [[7168, 1], [1], []], "Ev Idx": %d\n    }\n  }'
             % (rng.choice(["copy_", "index_select", "cat", "to", "empty", "add"]), c, rng.uniform(1, 9), ext, rng.randint(1, 96), ext))
        emit('  {\n    "ph": "X", "cat": "python_function", "name": "sglang/srt/managers/scheduler.py(%d): run_batch", "pid": 812, "tid": 812,\n    "ts": %.3f, "dur": %.3f,\n    "args": {\n      "Python parent id": %d, "Python id": %d, "Ev Idx": %d\n    }\n  }' % (rng.randint(100, 2000), c, 2.0, ext, ext + 1, ext))
        ext += 1
    # one CUDA-graph replay per step: every kernel carries its correlation id
    emit('  {\n    "ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": 812, "tid": 812,\n    "ts": %.3f, "dur": %.3f,\n    "args": {\n      "External id": %d, "cbid": 311, "correlation": %d\n    }\n  }' % (cpu + 400, 25.0, ext, corr))
    emit('  {\n    "ph": "s", "id": %d, "pid": 812, "tid": 812, "ts": %.3f,\n    "cat": "ac2g", "name": "ac2g"\n  }' % (corr, cpu + 400))
    g = cpu + 900.0
    for layer in range(43):
        for name, d in layer_kernels:
            d = d * rng.uniform(0.8, 1.3)
            emit('  {\n    "ph": "X", "cat": "kernel", "name": "%s", "pid": 0, "tid": 7,\n    "ts": %.3f, "dur": %.3f,\n    "args": {\n      "External id": %d,      "queued": 0, "device": 0, "context": 1,      "stream": 7, "correlation": %d,      "registers per thread": 128,      "shared memory": 49152,      "blocks per SM": %s,      "warps per SM": 4.000000,      "grid": [132, 1, 1],      "block": [128, 1, 1],      "est. achieved occupancy %%": 6\n    }\n  }'
                 % (name, g, d, ext, corr, '"inf"' if rng.random() < 0.05 else "%.6f" % rng.uniform(0.1, 2)))
            emit('  {\n    "ph": "f", "id": %d, "pid": 0, "tid": 7, "ts": %.3f,\n    "cat": "ac2g", "name": "ac2g", "bp": "e"\n  }' % (corr, g))
            g += d + 0.6
        emit('  {\n    "ph": "X", "cat": "kernel", "name": "%s", "pid": 0, "tid": 21,\n    "ts": %.3f, "dur": %.3f,\n    "args": {\n      "External id": %d,      "queued": 0, "device": 0, "context": 1,      "stream": 21, "correlation": %d,      "registers per thread": 96,      "shared memory": 0,      "blocks per SM": 0.242424,      "warps per SM": 3.878788,      "grid": [32, 1, 1],      "block": [512, 1, 1],      "est. achieved occupancy %%": 6\n    }\n  }' % (nccl, g - 10, 25.0 * rng.uniform(0.9, 1.5), ext, corr))
    if len(parts) > 20000:
        w("".join(parts)); parts.clear()
    ts += 4000.0
    corr += 7
    step += 1
w("".join(parts))
w('\n  ],\n  "traceName": "bench-TP-0.trace.json",\n  "displayTimeUnit": "ms",\n  "baseTimeNanoseconds": 1712195400000000000\n}\n')
out.close()
EOF

bytes=$(stat -c %s "$TRACE")
echo "trace: $TRACE, $bytes bytes ($(grep -c '"cat": "kernel"' "$TRACE") kernel events)"
gzip -1 -c "$TRACE" >"$TRACE.gz"
echo "gzip -1: $(stat -c %s "$TRACE.gz") bytes"
cat "$TRACE" >/dev/null # page cache

# Throughput per core = uncompressed bytes / CPU seconds (user + system) of
# the single-threaded run, best of 3; wall time is shown too (on a shared
# machine it includes time spent waiting for a core).
run() { # label file
  local best= bw= rss=
  for i in 1 2 3; do
    /usr/bin/time -f "%e %U %S %M" -o "$DIR/t" "$CLI" trace summary "$2" --jobs 1 --format csv >/dev/null
    read -r wall u sy m <"$DIR/t"
    local cpu
    cpu=$(echo "$u + $sy" | bc -l)
    if [ -z "$best" ] || [ "$(echo "$cpu < $best" | bc -l)" = 1 ]; then best=$cpu; bw=$wall; rss=$m; fi
  done
  printf '%-30s cpu %7.3f s  %7.1f MB/s per core   (wall %6.2f s)  peak RSS %d MiB\n' "$1" "$best" \
    "$(echo "$bytes / $best / 1000000" | bc -l)" "$bw" $((rss / 1024))
}
run "fp4moe trace summary, plain" "$TRACE"
run "fp4moe trace summary, gzip" "$TRACE.gz"

/usr/bin/time -f "%e %U %S %M" -o "$DIR/t" python3 -c "import json,sys; json.load(open(sys.argv[1]))" "$TRACE"
read -r wall u sy m <"$DIR/t"
cpu=$(echo "$u + $sy" | bc -l)
printf '%-30s cpu %7.3f s  %7.1f MB/s per core   (wall %6.2f s)  peak RSS %d MiB\n' "python3 json.load, plain" "$cpu" \
  "$(echo "$bytes / $cpu / 1000000" | bc -l)" "$wall" $((m / 1024))
