#!/usr/bin/env bash
# One call on the GPU machine that checks a round of work end to end, the
# short table last: the interleaved A/B of this build (.devbuild/bin) against
# another (.devbuild/base/bin, e.g. the last build before the round) on
# DeepSeek-V4-Flash and GLM-5 at B = 1 .. 512; compute-sanitizer memcheck,
# racecheck and initcheck; test_cuda and test_tensors, and three test_cuda at
# once; the Python package's torch checks
# and its B = 1 benchmark (dev/gpu/python_tests.py); the transformers
# tiny-model equality (tests/py_hf_tiny.py). Needs .devbuild/bin (fp4moe,
# test_cuda, test_tensors, cuda_smoke) and .devbuild/lib (libfp4moe.so and
# the Debian libraries); VERIFY_HF_BENCH=1 also runs dev/hf_decode_bench.py
# with its two-batch profiles (about 4 minutes more).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.devbuild/lib:${LD_LIBRARY_PATH:-}
export FP4MOE_SHIPPED_CONFIGS=${FP4MOE_SHIPPED_CONFIGS:-$PWD/configs}
S=$OUT/summary.txt
: > "$S"
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv,noheader >> "$S" 2>&1
B=${VERIFY_BATCH:-1,2,4,8,16,32,64,128,256,512}
if [ -x .devbuild/base/bin/fp4moe ]; then
    for p in deepseek-v4-flash glm-5; do
        mkdir -p "$OUT/$p"
        OUT=$OUT/$p AB_PRESET=$p AB_VARIANTS="new: base:FM_AB_BIN=.devbuild/base/bin" AB_ROUNDS=${VERIFY_ROUNDS:-3} \
            AB_BATCH=$B timeout 240 bash dev/gpu/ab.sh > "$OUT/$p/ab.txt" 2>&1
        { echo "== A/B $p"; tail -n 13 "$OUT/$p/ab.txt"; } >> "$S"
    done
fi
for t in memcheck racecheck initcheck; do
    timeout 120 compute-sanitizer --tool $t --error-exitcode 9 --print-limit 3 .devbuild/bin/cuda_smoke > "$OUT/san_$t.log" 2>&1
    echo "$t rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/san_$t.log" | tail -n 1)" >> "$S"
done
for t in test_cuda test_tensors; do
    (cd "$OUT" && timeout 200 "$OLDPWD/.devbuild/bin/$t" > "$OUT/$t.log" 2>&1)
    echo "$t rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$OUT/$t.log" | tr '\n' ' ')" >> "$S"
done
# three copies at once: the library must not depend on a quiet GPU (setup
# writes that other processes' load delays, a missing stream dependency)
for i in 1 2 3; do
    (mkdir -p "$OUT/conc$i" && cd "$OUT/conc$i" && timeout 300 "$OLDPWD/.devbuild/bin/test_cuda" > "$OUT/conc$i.log" 2>&1
     echo "rc=$?" >> "$OUT/conc$i.log") &
done
wait
for i in 1 2 3; do
    echo "test_cuda copy $i of 3 at once: $(tail -n 1 "$OUT/conc$i.log") $(grep -E '^\[  (PASSED|FAILED)  \] [0-9]' "$OUT/conc$i.log" | tr '\n' ' ')" >> "$S"
done
timeout 240 bash dev/gpu/python.sh run > "$OUT/python.txt" 2>&1
echo "python_tests rc=$?" >> "$S"
{ grep -E '^FAIL|passed' "$OUT/python.txt"; tail -n 7 "$OUT/python.txt"; } >> "$S"
export FP4MOE_LIBRARY=$PWD/.devbuild/lib/libfp4moe.so FM_CLI=$PWD/.devbuild/bin/fp4moe PYTHONUNBUFFERED=1
timeout 200 python3 tests/py_hf_tiny.py > "$OUT/hf_tiny.log" 2>&1
echo "py_hf_tiny rc=$?" >> "$S"
tail -n 5 "$OUT/hf_tiny.log" >> "$S"
if [ "${VERIFY_HF_BENCH:-0}" = 1 ]; then
    timeout 420 python3 dev/hf_decode_bench.py --profile "$OUT/hf_prof" --json "$OUT/hf_bench.json" > "$OUT/hf_bench.log" 2>&1
    echo "hf_decode_bench rc=$?" >> "$S"
    tail -n 40 "$OUT/hf_bench.log" >> "$S"
fi
cat "$S"
