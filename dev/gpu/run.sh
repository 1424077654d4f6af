#!/usr/bin/env bash
# The GPU run, on the GPU machine after dev/gpu/build.sh here (with
# .devbuild/bin and .devbuild/lib copied over): GPU tests, compute-sanitizer
# memcheck + racecheck on a small case, the reference benchmark
# (DeepSeek-V4-Flash NVFP4, B = 1..512, 8 layers in one CUDA graph) with the
# torch peers measured in the same call, other shapes and MXFP4, the
# read-pattern ceiling, the TP8 ranks' floors of their dependent reads and
# one token's top-k alone (floors), the CLI and the modules around the
# engine. Logs and JSON go to $OUT (or ./gpu_out); the summary table prints
# last.
#   bash dev/gpu/run.sh [all|test|bench|peers|cli|readpat|floors|integration|quick]...
# FLOORS_BATCH="1 4 16" (the default) names the floors' batch sizes.
# FM_GPU_QUICK=1 (or the mode "quick") runs only the GPU tests and one
# benchmark of the routed DeepSeek-V4-Flash layer with the built-in config
# and the per-kernel split at B = 1,4,16,64,256,512 (QUICK_BATCH overrides):
# about a minute of GPU time. In quick mode the sanitizers run after the
# benchmark, then, when QUICK_AB_BIN (another build's .devbuild/bin) or
# QUICK_AB_ENV (one of the engine's debugging switches, e.g.
# FP4MOE_CUDA_PDL=0) is set, the same benchmark with that build or switch
# (batches QUICK_AB_BATCH), each only within QUICK_DEADLINE seconds
# (default 160) of the start, so the call fits a short time limit.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.devbuild/lib:${LD_LIBRARY_PATH:-}
BIN=$PWD/.devbuild/bin
MODES=${*:-all}
if [[ "${FM_GPU_QUICK:-0}" == 1 || " $MODES " == *" quick "* ]]; then MODES="test quickbench"; fi
has() { [[ " $MODES " == *" $1 "* || " $MODES " == *" all "* ]]; }
BATCH=${BATCH:-1,2,4,8,16,32,64,128,256,512}
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"

QUICK=0
if [[ " $MODES " == *" quickbench "* ]]; then QUICK=1; fi
left() { echo $(( ${QUICK_DEADLINE:-160} - SECONDS )); }

run_sanitizers() {
    if command -v compute-sanitizer >/dev/null; then
        for tool in memcheck racecheck; do
            timeout "${SAN_TIMEOUT:-240}" compute-sanitizer --tool $tool --error-exitcode 9 "$BIN/cuda_smoke" > "$OUT/sanitizer_$tool.log" 2>&1
            rc=$?
            echo "compute-sanitizer $tool exit $rc: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log" | tail -1)" | tee -a "$SUMMARY"
        done
    else
        echo "compute-sanitizer not found" | tee -a "$SUMMARY"
    fi
}

if has test; then
    echo "== GPU tests"
    (cd "$OUT" && timeout "${TEST_TIMEOUT:-$(( QUICK ? 110 : 300 ))}" "$BIN/test_cuda") > "$OUT/test_cuda.log" 2>&1
    rc=$?
    grep -E "^# tiny-deepseek-v4|clamped vs|^\[ *(PASSED|FAILED|  FAILED|  PASSED)" "$OUT/test_cuda.log" | tail -n 12
    tail -n 8 "$OUT/test_cuda.log"
    echo "test_cuda exit $rc" | tee -a "$SUMMARY"
    # the device-side repack of engine tensors (byte-identical to the host
    # path) and the calls' config table; the tensors round trip on the GPU
    for t in test_cuda_repack test_tensors; do
        [ -x "$BIN/$t" ] || continue
        (cd "$OUT" && timeout "${TEST_TIMEOUT:-120}" "$BIN/$t") > "$OUT/$t.log" 2>&1
        rc=$?
        grep -E "^# |^\[ *(PASSED|FAILED|  FAILED|  SKIPPED)" "$OUT/$t.log" | tail -n 24
        echo "$t exit $rc" | tee -a "$SUMMARY"
    done
    if [[ $QUICK == 0 ]]; then run_sanitizers; fi
fi

if [[ " $MODES " == *" quickbench "* ]]; then
    echo "== quick benchmark (built-in config, per-kernel split)"
    t=$(left); (( t > 150 )) && t=150; (( t < 30 )) && t=30
    timeout $t "$BIN/cuda_bench" --preset deepseek-v4-flash --batch "${QUICK_BATCH:-1,4,16,64,256,512}" --layers 8 \
        --no-shared --reps 20 --json "$OUT/bench.jsonl" > "$OUT/bench_quick.txt" 2>&1
    echo "rc=$?" >> "$OUT/bench_quick.txt"
    { echo "-- dsv4 routed, default config, with per-kernel split"; cat "$OUT/bench_quick.txt"; } >> "$SUMMARY"
    if (( $(left) > 40 )); then
        SAN_TIMEOUT=$(( ($(left) - 30) / 2 )) run_sanitizers
    else
        echo "sanitizers skipped: $(left) s left of QUICK_DEADLINE" | tee -a "$SUMMARY"
    fi
    if [[ -z "${QUICK_AB_BIN:-}${QUICK_AB_ENV:-}" ]]; then
        echo "A/B benchmark not asked for (QUICK_AB_BIN, QUICK_AB_ENV)" | tee -a "$SUMMARY"
    elif (( $(left) > 15 )); then
        # the A/B run: another build's binaries and/or a debugging switch
        ab_bin=${QUICK_AB_BIN:-$BIN}
        env ${QUICK_AB_ENV:-} timeout $(( $(left) - 5 )) "$ab_bin/cuda_bench" --preset deepseek-v4-flash \
            --batch "${QUICK_AB_BATCH:-${QUICK_BATCH:-1,4,16,64,256,512}}" --layers 8 --no-shared --reps 20 \
            > "$OUT/bench_quick_ab.txt" 2>&1
        echo "rc=$?" >> "$OUT/bench_quick_ab.txt"
        { echo "-- same, ${QUICK_AB_BIN:+binaries of $QUICK_AB_BIN }${QUICK_AB_ENV:-}"; cat "$OUT/bench_quick_ab.txt"; } >> "$SUMMARY"
    else
        echo "A/B benchmark skipped: $(left) s left" | tee -a "$SUMMARY"
    fi
fi

if has bench; then
    echo "== benchmark: every kernel variant per batch size, best one reported"
    run_bench() { # name args...   (BENCH_ONLY=name1,name2 limits the list)
        local name=$1; shift
        if [[ -n "${BENCH_ONLY:-}" && ",$BENCH_ONLY," != *",$name,"* ]]; then return; fi
        timeout 300 "$BIN/cuda_bench" "$@" --json "$OUT/bench.jsonl" > "$OUT/bench_$name.txt" 2>&1
        echo "rc=$?" >> "$OUT/bench_$name.txt"
        { echo "-- $name: $*"; sed -n '2p' "$OUT/bench_$name.txt"; sed -n '/^# best variant/,$p' "$OUT/bench_$name.txt"; } >> "$SUMMARY"
        sed -n '/^# best variant/,$p' "$OUT/bench_$name.txt"
    }
    run_bench dsv4_routed --preset deepseek-v4-flash --batch $BATCH --layers 8 --no-shared --variants --reps 20
fi

if has peers; then
    echo "== torch peers"
    PYTHONUNBUFFERED=1 timeout 300 python3 dev/gpu/torch_peer.py --E 256 --H 4096 --I 2048 --k 6 --batch $BATCH \
        --layers 8 --json "$OUT/peers.jsonl" > "$OUT/peers.txt" 2>&1
    echo "rc=$?" >> "$OUT/peers.txt"
    { echo "-- torch peers (DeepSeek-V4-Flash shape, routed experts, same routing distribution)"; cat "$OUT/peers.txt"; } >> "$SUMMARY"
fi

if has bench; then
    timeout 120 "$BIN/cuda_bench" --preset deepseek-v4-flash --batch $BATCH --layers 8 --reps 20 \
        --json "$OUT/bench.jsonl" > "$OUT/bench_dsv4_full_default.txt" 2>&1
    { echo "-- dsv4 full layer (shared expert on), default config, with per-kernel split"; grep -v '^# [Nn]' "$OUT/bench_dsv4_full_default.txt"; } >> "$SUMMARY"
    S="1,4,16,64,256,512"
    run_bench dsv4_mxfp4 --preset deepseek-v4-flash --format mxfp4 --batch $S --layers 8 --no-shared --variants --reps 10
    run_bench glm5 --preset glm-5 --batch $S --layers 4 --no-shared --variants --reps 10
    run_bench kimik2 --preset kimi-k2 --batch $S --layers 4 --no-shared --variants --reps 10
    run_bench qwen3 --preset qwen3-30b-a3b --batch $S --layers 8 --variants --reps 10
fi

# What a kernel that only reads the active experts' bytes achieves at the
# sizes of DeepSeek-V4-Flash's B = 1 and B = 4 layers (tiles, grid and
# loads of the expert kernels, no decode; dev/tools/cuda_readpat.cu):
# the ceiling the expert kernels are compared with in docs/perf.md. The
# "--nrg 192" rows read a layer's routed gate/up and down bytes in one
# launch (6, 12 and 24 experts: B = 1, 2 and 4): the fastest any design
# that routes first, then reads, could read them.
if has readpat; then
    echo "== read-pattern ceiling"
    {
        for a in "--experts 6" "--experts 6 --nrg 128 --nseg 16 --mats 2" "--experts 23 --occ 4" "--experts 23 --occ 6" \
            "--experts 23 --nrg 128 --nseg 16 --mats 2 --occ 4" "--experts 23 --nrg 128 --nseg 16 --mats 2 --occ 6" \
            "--experts 6 --nrg 192 --nseg 32 --mats 2" "--experts 12 --nrg 192 --nseg 32 --mats 2" \
            "--experts 24 --nrg 192 --nseg 32 --mats 2"; do
            echo "-- cuda_readpat $a --scales sep"
            timeout 60 "$BIN/cuda_readpat" $a --scales sep --reps 10
        done
    } > "$OUT/readpat.txt" 2>&1
    { echo "-- read-pattern ceiling (cuda_readpat)"; cat "$OUT/readpat.txt"; } >> "$SUMMARY"
fi

# How short a TP8 rank's layer can be when its reads form the chain routing
# imposes, with no arithmetic (dev/tools/cuda_chain.cu), at the batch sizes
# of the latency targets; and one token's top-k alone, as the engine's code
# runs it (dev/tools/cuda_topk.cu): the floors docs/perf.md sets the small
# batches against.
if has floors; then
    echo "== dependent-read floors, one token's top-k"
    {
        for b in ${FLOORS_BATCH:-1 4 16}; do
            echo "-- cuda_chain --batch $b"
            timeout 120 "$BIN/cuda_chain" --batch "$b"
        done
        echo "-- cuda_topk"
        timeout 120 "$BIN/cuda_topk"
    } > "$OUT/floors.txt" 2>&1
    { echo "-- dependent-read floors (cuda_chain), one token's top-k (cuda_topk)"; cat "$OUT/floors.txt"; } >> "$SUMMARY"
fi

if has cli; then
    echo "== CLI"
    timeout 200 "$BIN/fp4moe" bench --device cuda --preset deepseek-v4-flash --batch $BATCH --layers 8 > "$OUT/cli_bench.txt" 2>&1
    echo "rc=$?" >> "$OUT/cli_bench.txt"
    { echo "-- fp4moe bench --device cuda --preset deepseek-v4-flash --batch $BATCH --layers 8"; tail -n 20 "$OUT/cli_bench.txt"; } >> "$SUMMARY"
fi

# The modules around the engine: profile (CUPTI, NVML), NCCL single rank,
# the GPU host's CPU ISAs, tune, the CLI benchmark (dev/gpu/integration.sh).
if [[ " $MODES " == *" integration "* || " $MODES " == *" all "* ]]; then
    echo "== integration"
    bash dev/gpu/integration.sh
fi

echo "================ summary"
cat "$SUMMARY"
# the logs in one archive beside the summary: two files to copy back
(cd "$OUT" && tar czf all_logs.tgz --exclude=all_logs.tgz --exclude=summary.txt ./* 2>/dev/null &&
    find . -type f ! -name all_logs.tgz ! -name summary.txt -delete)
