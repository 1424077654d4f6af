#!/usr/bin/env bash
# transformers on fp4moe's experts, in one call on the GPU machine (after
# `bash dev/gpu/python.sh build` on the development machine): the tiny-model
# equality with the GPU quantizer's bytes against the CPU's and the NumPy
# quantizer's (tests/py_hf_tiny.py), then dev/hf_decode_bench.py at the two
# profiled batch sizes only, with its per-block check and the two-batch
# tables of Qwen3-30B-A3B and DeepSeek-V3 (each variant's kernels by
# category, B=32 vs 80, and the profiled GPU window against the timed step).
#   OUT=... bash dev/gpu/hf.sh          (about 4 minutes)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.devbuild/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export FP4MOE_LIBRARY=$PWD/.devbuild/lib/libfp4moe.so FM_CLI=$PWD/.devbuild/bin/fp4moe PYTHONUNBUFFERED=1
S=$OUT/hf_summary.txt
: > "$S"
timeout 150 python3 tests/py_hf_tiny.py > "$OUT/hf_tiny.log" 2>&1
rc=$?
echo "py_hf_tiny rc=$rc" >> "$S"
[ "$rc" = 0 ] || tail -n 15 "$OUT/hf_tiny.log" >> "$S"
grep -E "^FAIL|MoE layers|tiny models on" "$OUT/hf_tiny.log" >> "$S"
timeout ${HF_BENCH_TIMEOUT:-420} python3 dev/hf_decode_bench.py --batches ${HF_BATCHES:-32,80} --steps ${HF_STEPS:-10} \
    --profile "$OUT/hf_prof" --json "$OUT/hf_bench.json" > "$OUT/hf_bench.txt" 2> "$OUT/hf_bench.log"
rc=$?
echo "hf_decode_bench rc=$rc (log: hf_bench.log)" >> "$S"
[ "$rc" = 0 ] || tail -n 15 "$OUT/hf_bench.log" >> "$S"
cat "$OUT/hf_bench.txt" >> "$S"
cat "$S"
