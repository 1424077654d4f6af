#!/usr/bin/env bash
# Why a TP8 rank's small-batch kernels wait: Nsight Compute's warp-state
# sampling of each kernel alone (one launch, after the first graph replays),
# per stall reason and per SASS instruction ("no instruction" is the cold
# instruction fetch; "long scoreboard" a load from L2 or DRAM; "wait" and
# "short scoreboard" dependent arithmetic and shuffles). After dev/gpu/build.sh:
#   STALL_PRESET=glm-5 STALL_BATCH=1,4 STALL_KERNELS="fm_route_kernel fm_splitk_gu" bash dev/gpu/stalls.sh
# The summary ($OUT/stalls.txt) is printed last; dev/analysis/stalls.py reads
# the saved CSVs again.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
[[ ${STALL_TIMEOUT_S:-90} =~ ^[1-9][0-9]*$ ]] || { echo "stalls: STALL_TIMEOUT_S '$STALL_TIMEOUT_S' is not whole seconds" >&2; exit 2; }
command -v ncu > /dev/null || { echo "stalls: ncu not found" >&2; exit 2; }
export LD_LIBRARY_PATH=$PWD/.devbuild/lib:${LD_LIBRARY_PATH:-} FP4MOE_SHIPPED_CONFIGS=$PWD/configs
BIN=${STALL_BIN:-$PWD/.devbuild/bin}
P=${STALL_PRESET:-glm-5}
SH=${STALL_SHARD:-tp:8}
S=$OUT/stalls.txt
: > "$S"
. dev/gpu/relabel.sh
echo "GPU: ${gpu:-unknown}" >> "$S"
[[ -z $RELABELLED ]] || echo "$RELABELLED" >> "$S"
BB=${STALL_BATCH:-1,4}
for b in ${BB//,/ }; do
    for k in ${STALL_KERNELS:-fm_logits_gemv fm_route_kernel fm_splitk_gu fm_splitk_down}; do
        rep=$OUT/st_${k}_$b
        timeout "${STALL_TIMEOUT_S:-90}" ncu --clock-control none -k "regex:$k" --launch-skip 16 --launch-count 1 \
            --section WarpStateStats --section SourceCounters --section LaunchStats \
            --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,sm__cycles_elapsed.max,gpu__time_duration.sum" \
            -f -o "$rep" "$BIN/fp4moe" bench --device cuda --preset "$P" --shard "$SH" --batch "$b" --layers 8 \
            > "$rep.log" 2>&1
        rc=$?
        if [[ $rc == 0 && ! -f $rep.ncu-rep ]]; then
            # ncu exits 0 when no launch matched: this batch runs other kernels
            echo "== $k B=$b: no launch of $k at this batch size (it runs other kernels)" >> "$S"
            continue
        fi
        if [[ $rc != 0 || ! -f $rep.ncu-rep ]]; then
            echo "== $k B=$b: ncu exit $rc: $(grep -v '^$' "$rep.log" | tail -n 3)" >> "$S"
            continue
        fi
        ncu -i "$rep.ncu-rep" --page raw --csv > "$rep.raw.csv" 2>&1
        ncu -i "$rep.ncu-rep" --page source --print-source sass --csv > "$rep.src.csv" 2>&1
        { echo "== $k B=$b ($P $SH)"; python3 dev/analysis/stalls.py "$rep.raw.csv" "$rep.src.csv"; } >> "$S" 2>&1
    done
done
cat "$S"
