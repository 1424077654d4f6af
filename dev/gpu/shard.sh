#!/usr/bin/env bash
# One TP8 / EP8 rank's share on one GPU, on the GPU machine after
# dev/gpu/build.sh here (.devbuild/bin and .devbuild/lib copied over): the
# GPU test that the shard layers compute what the CPU engine computes for
# that rank (test_cuda's test_shard_layers), then `bench --shard` of GLM-5
# (and of the preset in SHARD_PRESET) at TP8 rank 0 and EP8 rank 0.
# Logs and JSON go to $OUT (or ./gpu_out).
#   bash dev/gpu/shard.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.devbuild/lib:${LD_LIBRARY_PATH:-}
BIN=$PWD/.devbuild/bin
P=${SHARD_PRESET:-glm-5}
B=${SHARD_BATCH:-1,4,16,64,256}
rc=0
FM_TEST_DATA=$PWD/tests/data "$BIN/test_cuda" 2>&1 | tee "$OUT/shard_test_cuda.log" | grep -E "GPU shard vs CPU rank|test_shard_layers|PASSED|FAILED" || rc=1
grep -q "OK \] test_shard_layers" "$OUT/shard_test_cuda.log" || { echo "FAIL: test_shard_layers"; rc=1; }
for s in tp:8 ep:8/0; do
    tag=$(echo "$s" | tr ':/' '__')
    "$BIN/fp4moe" bench --device cuda --preset "$P" --shard "$s" --batch "$B" --json "$OUT/shard_${P}_${tag}.json" \
        2>&1 | tee "$OUT/shard_${P}_${tag}.log" || rc=1
done
"$BIN/fp4moe" bench --device cuda --preset "$P" --batch "$B" --json "$OUT/shard_${P}_full.json" \
    2>&1 | tee "$OUT/shard_${P}_full.log" || rc=1
exit $rc
