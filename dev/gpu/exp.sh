#!/usr/bin/env bash
# One call of experiments on the GPU machine, after dev/gpu/build.sh: the
# variant under test ("new") against a reference ("base"), each of
#   EXP_BIN=DIR    the variant's binaries (default .devbuild/bin)
#   EXP_BASE=DIR   the reference's binaries (default .devbuild/bin; a second
#                  build of the base commit, e.g. .devbuild/base/bin)
#   EXP_ENV="..."  environment settings of the variant (e.g. one of the
#                  engine's debugging switches, FP4MOE_CUDA_PDL=0)
# (DIRs relative to the checkout or absolute) and the parts, each on unless
# set to 0:
#   AB_VARIANTS=... AB_BATCH=... AB_ROUNDS=...  the interleaved A/B (dev/gpu/ab.sh;
#                 by default of the two here)
#   EXP_TEST=0|1 test_cuda of both, memcheck and racecheck of the variant
#   EXP_SPLIT=0|1 cuda_bench's routing / per-phase split (EXP_SPLIT_BATCH)
#   EXP_NCU=0|1   Nsight Compute per-kernel durations and DRAM bytes (EXP_NCU_BATCH;
#                 EXP_NCU_METRICS adds metrics, e.g. regex:smsp__average_warps_issue_stalled_.*;
#                 EXP_NCU_VARIANTS=new|base profiles one of the two only,
#                 EXP_NCU_COUNT kernels profiled, 32 unless set)
# The summary goes to stdout and $OUT/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.devbuild/lib FP4MOE_SHIPPED_CONFIGS=$PWD/configs
abs() { if [[ $1 == /* ]]; then echo "$1"; else echo "$PWD/$1"; fi; }
B=$(abs "${EXP_BASE:-.devbuild/bin}")
NB=$(abs "${EXP_BIN:-.devbuild/bin}")
S=$OUT/summary.txt
# "X=0" stands for no setting at all (env needs one word)
NEW=${EXP_ENV:-X=0}
if [[ $NB == "$B" && $NEW == X=0 ]]; then
    echo "exp: the variant is the reference: set EXP_BIN or EXP_BASE (binaries) and/or EXP_ENV (settings)" >&2
    exit 2
fi
# base first: the A/B's ratios are the variant's time over the reference's
export AB_VARIANTS=${AB_VARIANTS:-"base:FM_AB_BIN=$B new:FM_AB_BIN=$NB,${NEW// /,}"}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > "$OUT/smi.txt" 2>&1
# bin_of base|new, env_of base|new
bin_of() { if [[ $1 == new ]]; then echo "$NB"; else echo "$B"; fi; }
env_of() { if [[ $1 == new ]]; then echo "$NEW"; else echo "X=0"; fi; }
if [[ ${EXP_TEST:-1} == 1 ]]; then
for v in base new; do
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
for v in base new; do
    echo "-- cuda_bench [$v]" >> "$S"
    env $(env_of $v) timeout 100 "$(bin_of $v)/cuda_bench" --preset deepseek-v4-flash --batch ${EXP_SPLIT_BATCH:-1,2,16,128,512} --layers 8 --reps 10 >> "$S" 2>&1
done
fi
if [[ ${EXP_NCU:-1} == 1 ]]; then
i=0
NCU_VARS="base new"
[[ ${EXP_NCU_VARIANTS:-both} == new ]] && NCU_VARS=new
[[ ${EXP_NCU_VARIANTS:-both} == base ]] && NCU_VARS=base
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
