#!/usr/bin/env bash
# What the GPU draws when it only streams memory, and when it runs the layer,
# in one call on the GPU machine (after dev/gpu/build.sh): the device's
# power, SM clock and throttle reasons sampled by nvidia-smi every 50 ms
# while
#   1. the clocks idle for 2 s;
#   2. cuda_readpat reads the active experts' tiles of DeepSeek-V4-Flash at
#      B = 1 and B = 4 (pure reads, no decode, at 30 - 95 % of the bandwidth:
#      the variants of the tool), each variant for a few seconds;
#   3. cuda_bwprobe streams at the full bandwidth (its kernels one after the
#      other, ~1 s each: the first three read at the full rate);
#   4. `fp4moe bench --sustain-ms` runs the layer at each of POWER_BATCH.
# dev/analysis/power_plateaus.py then averages each phase over its settled
# part (nvidia-smi's power.draw is a one-second average) and fits the pure
# reads' power against their bandwidth.
#   POWER_BATCH=1,8,16,64,256,512 POWER_SUSTAIN_MS=4000 bash dev/gpu/power.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.devbuild/lib:${LD_LIBRARY_PATH:-}
export FP4MOE_SHIPPED_CONFIGS=${FP4MOE_SHIPPED_CONFIGS:-$PWD/configs}
BIN=${POWER_BIN:-$PWD/.devbuild/bin}
BATCH=${POWER_BATCH:-1,8,16,64,256,512}
SUSTAIN=${POWER_SUSTAIN_MS:-4000}
PRESET=${POWER_PRESET:-deepseek-v4-flash}
if ! command -v nvidia-smi > /dev/null; then
    echo "gpu_power: nvidia-smi not found" >&2
    exit 2
fi
M=$OUT/power_marks.txt
: > "$M"
stamp() { date '+%Y/%m/%d %H:%M:%S.%N'; }
mark() { echo "$(stamp) $*" >> "$M"; }
# every output line of a tool, stamped when it is printed (a variant's line
# ends its window)
stamped() { stdbuf -oL "$@" 2>&1 | while IFS= read -r line; do echo "$(stamp) $line"; done; }

nvidia-smi --query-gpu=timestamp,power.draw,power.limit,clocks.sm,clocks.mem,clocks_throttle_reasons.active \
    --format=csv,noheader -lms 50 > "$OUT/power_smi.csv" 2>&1 &
SMI=$!
trap 'kill $SMI 2> /dev/null' EXIT
sleep 1
mark "idle start"
sleep 2
mark "idle end"
# B = 1's tiles (6 experts): reps sized for 2 - 5 s per variant
mark "readpat start"
stamped "$BIN/cuda_readpat" --experts 6 --reps 12000 --scales sep > "$OUT/power_readpat1.txt"
stamped "$BIN/cuda_readpat" --experts 23 --occ 6 --reps 5000 --scales sep > "$OUT/power_readpat4.txt"
mark "readpat end"
sleep 1
mark "probe start"
stamped "$BIN/cuda_bwprobe" --reps 1000 > "$OUT/power_probe.txt"
mark "probe end"
for b in ${BATCH//,/ }; do
    sleep 2
    mark "layer $b start"
    "$BIN/fp4moe" bench --device cuda --preset "$PRESET" --batch "$b" --layers 8 --sustain-ms "$SUSTAIN" \
        > "$OUT/power_bench_$b.txt" 2>&1
    mark "layer $b end"
done
sleep 1
kill $SMI 2> /dev/null
python3 dev/analysis/power_plateaus.py "$OUT"
