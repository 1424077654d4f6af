#!/usr/bin/env bash
# Where the time of the large batches goes, in one call on the GPU machine
# (after dev/gpu/build.sh): CUPTI traces of the DeepSeek-V4-Flash layer
# (`fp4moe profile --trace`) cut into per-layer timelines by
# dev/analysis/trace_layers.py, and Nsight Compute sections of the routed
# gate/up and down kernels at two batch sizes.
#   WHERE_BATCH=64,128,256,512 WHERE_NCU_BATCH="64 512" bash dev/gpu/where.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.devbuild/lib FP4MOE_SHIPPED_CONFIGS=$PWD/configs
B=${WHERE_BIN:-$PWD/.devbuild/bin}
S=$OUT/where.txt
: > "$S"
WHERE_BATCH=${WHERE_BATCH-64,128,256,512}
for b in ${WHERE_BATCH//,/ }; do
    timeout 120 "$B/fp4moe" profile --device cuda --preset ${WHERE_PRESET:-deepseek-v4-flash} --batch "$b" --layers 8 \
        --steps 2 --trace "$OUT/tr_$b.json" --quiet > "$OUT/prof_$b.txt" 2>&1
    echo "profile B=$b exit $?" >> "$S"
done
if [[ -n ${WHERE_BATCH:-} ]]; then
    python3 dev/analysis/trace_layers.py "$OUT"/tr_*.json >> "$S" 2>&1
    gzip -f "$OUT"/tr_*.json
fi
# WHERE_NCU_BATCH: Nsight Compute on the kernels matching WHERE_NCU_KERNELS
# (default the wgmma expert kernels) at those batch sizes, with the sections
# below or, when WHERE_NCU_METRICS is set, those metrics only.
if [[ -n ${WHERE_NCU_BATCH:-} ]] && command -v ncu > /dev/null; then
    if [[ -n ${WHERE_NCU_METRICS:-} ]]; then
        what=(--metrics "$WHERE_NCU_METRICS")
    else
        what=(--section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis --section Occupancy
              --section LaunchStats --section InstructionStats --metrics
              sm__inst_executed_pipe_alu.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed.sum,dram__bytes_read.sum)
    fi
    for b in $WHERE_NCU_BATCH; do
        timeout ${WHERE_NCU_TIMEOUT:-150} ncu --clock-control none -k "regex:${WHERE_NCU_KERNELS:-fm_expert_wg}" \
            --launch-skip ${WHERE_NCU_SKIP:-16} --launch-count ${WHERE_NCU_COUNT:-2} "${what[@]}" \
            "$B/cuda_bench" --preset deepseek-v4-flash --batch "$b" --layers 8 --reps 2 --no-shared > "$OUT/ncu_$b.txt" 2>&1
        echo "ncu B=$b exit $?" >> "$S"
        grep -vE '^==|^ *-+ *-+|^$|Warning: Data collection' "$OUT/ncu_$b.txt" | grep -E "fm_|Duration|Throughput|Issue Slots|Warp Cycles|Registers Per|Occupancy|\.sum|\.pct|\.ratio|lts__" | head -${WHERE_NCU_LINES:-80} >> "$S"
    done
fi
cat "$S"
