#!/usr/bin/env bash
# One call of experiments on the GPU machine, after dev/gpu/build.sh: the
# variant under test against the default build (.devbuild/bin), each with
#   EXP_BIN=DIR    the variant's binaries (another build, copied beside
#                  .devbuild/bin; by default .devbuild/bin itself)
#   EXP_ENV="..."  environment settings of the variant (e.g. one of the
#                  engine's debugging switches, FP4MOE_CUDA_PDL=0)
# and the parts, each on unless set to 0:
#   AB_VARIANTS=... AB_BATCH=... AB_ROUNDS=...  the interleaved A/B (dev/gpu/ab.sh;
#                 by default the two variants here)
#   EXP_TEST=0|1 test_cuda of both, memcheck and racecheck of the variant
#   EXP_SPLIT=0|1 cuda_bench's routing / per-phase split (EXP_SPLIT_BATCH)
#   EXP_NCU=0|1   Nsight Compute per-kernel durations and DRAM bytes (EXP_NCU_BATCH;
#                 EXP_NCU_METRICS adds metrics, e.g. regex:smsp__average_warps_issue_stalled_.*;
#                 EXP_NCU_VARIANTS=new|default profiles one of the two only,
#                 EXP_NCU_COUNT kernels profiled, 32 unless set)
# The summary goes to stdout and $OUT/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.devbuild/lib FP4MOE_SHIPPED_CONFIGS=$PWD/configs
B=$PWD/.devbuild/bin
NB=${EXP_BIN:-$B}
[[ $NB == /* ]] || NB=$PWD/$NB
S=$OUT/summary.txt
# "X=0" stands for no setting at all (env needs one word)
NEW=${EXP_ENV:-X=0}
if [[ $NB == "$B" && $NEW == X=0 ]]; then
    echo "exp: set EXP_BIN (the variant's binaries) and/or EXP_ENV (its settings)" >&2
    exit 2
fi
export AB_VARIANTS=${AB_VARIANTS:-"default: new:FM_AB_BIN=$NB,${NEW// /,}"}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > "$OUT/smi.txt" 2>&1
# bin_of default|new, env_of default|new
bin_of() { if [[ $1 == new ]]; then echo "$NB"; else echo "$B"; fi; }
env_of() { if [[ $1 == new ]]; then echo "$NEW"; else echo "X=0"; fi; }
if [[ ${EXP_TEST:-1} == 1 ]]; then
for v in default new; do
    (cd "$OUT" && env $(env_of $v) timeout 150 "$(bin_of $v)/test_cuda" > t.log 2>&1)
    echo "test_cuda [$v] exit $? $(grep -E '^\[  (PASSED|FAILED)' "$OUT/t.log" | tr '\n' ' ')" >> "$S"
done
env $NEW timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 "$NB/cuda_smoke" > "$OUT/memcheck.log" 2>&1
echo "memcheck [new] exit $? $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)" >> "$S"
env $NEW timeout 200 compute-sanitizer --tool racecheck --error-exitcode 9 "$NB/cuda_smoke" > "$OUT/racecheck.log" 2>&1
echo "racecheck [new] exit $? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/racecheck.log" | tail -1)" >> "$S"
fi
OUT=$OUT bash dev/gpu/ab.sh >> "$S" 2>&1
if [[ ${EXP_SPLIT:-1} == 1 ]]; then
for v in default new; do
    echo "-- cuda_bench [$v]" >> "$S"
    env $(env_of $v) timeout 100 "$(bin_of $v)/cuda_bench" --preset deepseek-v4-flash --batch ${EXP_SPLIT_BATCH:-1,2,16,128,512} --layers 8 --reps 10 >> "$S" 2>&1
done
fi
if [[ ${EXP_NCU:-1} == 1 ]]; then
i=0
NCU_VARS="default new"
[[ ${EXP_NCU_VARIANTS:-both} == new ]] && NCU_VARS=new
[[ ${EXP_NCU_VARIANTS:-both} == default ]] && NCU_VARS=default
MET=gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sector_hit_rate.pct
[[ -n ${EXP_NCU_METRICS:-} ]] && MET=$MET,$EXP_NCU_METRICS
for b in ${EXP_NCU_BATCH:-1 512}; do for v in $NCU_VARS; do
    i=$((i + 1))
    env $(env_of $v) timeout 120 ncu --clock-control none --cache-control none -k regex:"fm_(route|logits|expert)" \
        --launch-skip 64 --launch-count ${EXP_NCU_COUNT:-32} --metrics "$MET" \
        --print-summary per-kernel "$(bin_of $v)/cuda_bench" --preset deepseek-v4-flash --batch $b --layers 8 --reps 3 > "$OUT/ncu_$i.txt" 2>&1
    { echo "-- ncu B=$b [$v]"; grep -E "fm_|gpu__time|dram__bytes|hit_rate|stalled|inst_|issue_active|warps_active" "$OUT/ncu_$i.txt" | grep -v "^==PROF" | head -${EXP_NCU_LINES:-40}; } >> "$S"
done; done
fi
cat "$S"
