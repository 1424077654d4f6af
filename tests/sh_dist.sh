#!/usr/bin/env bash
# forward/bench --tp/--ep on the CLI (--device cpu: simulated ranks):
# sharded outputs equal the unsharded ones, bad splits and flag mixes give
# clear errors and no output file.
set -u
CLI=${FM_CLI:?FM_CLI not set}
if ! "$CLI" bench --help 2>&1 | grep -q -- '--tp'; then
    echo "SKIPPED: 'fp4moe bench' has no --tp/--ep flags yet (cli/dist_opts.c not wired)"
    exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# expect_error "message part" command...: non-zero exit and the message
expect_error() {
    local want=$1; shift
    if "$@" >"$tmp/out.txt" 2>"$tmp/err.txt"; then fail "succeeded: $*"; fi
    grep -q -- "$want" "$tmp/err.txt" || { cat "$tmp/err.txt"; fail "no '$want' in the error of: $*"; }
}

# ---- bench
"$CLI" bench --preset tiny-qwen3 --batch 1,4 --layers 1 --tp 2 --device cpu >"$tmp/b.txt" 2>&1 || { cat "$tmp/b.txt"; fail "bench --tp 2"; }
grep -q "tp2" "$tmp/b.txt" || fail "bench --tp 2 does not name the split"
grep -q "speedup" "$tmp/b.txt" || fail "bench --tp 2 prints no scaling table"
"$CLI" bench --preset tiny-mixtral --batch 3 --layers 1 --ep 4 --dist-layout token-sharded --comm-compress fp8 --device cpu >"$tmp/b.txt" 2>&1 \
    || { cat "$tmp/b.txt"; fail "bench --ep 4 token-sharded fp8"; }
grep -q "imbalance" "$tmp/b.txt" || fail "bench --ep prints no load imbalance"

# ---- bad splits and flag mixes (tiny-qwen3: H=128, I=64, E=16)
expect_error "not divisible by 3" "$CLI" bench --preset tiny-qwen3 --batch 1 --tp 3 --device cpu
expect_error "not divisible by 3" "$CLI" bench --preset tiny-qwen3 --batch 1 --ep 3 --device cpu
expect_error "scale block" "$CLI" bench --preset tiny-qwen3 --format mxfp4 --batch 1 --tp 4 --device cpu
expect_error "token-sharded" "$CLI" bench --preset tiny-qwen3 --batch 1 --ep 2 --comm-compress nvfp4 --device cpu
expect_error "--tp and --ep" "$CLI" bench --preset tiny-qwen3 --batch 1 --tp 2 --ep 2 --device cpu
expect_error "--device cuda" "$CLI" bench --preset tiny-qwen3 --batch 1 --tp 2 --gpus 2 --device cpu
expect_error "--tp" "$CLI" bench --preset tiny-qwen3 --batch 1 --tp 0 --device cpu
expect_error "--comm-compress" "$CLI" bench --preset tiny-qwen3 --batch 1 --ep 2 --comm-compress fp6 --device cpu

# ---- forward through files: sharded == unsharded
if ! python3 -c 'import numpy, safetensors' 2>/dev/null; then
    echo "SKIPPED: python3 with numpy and safetensors needed for the forward round trip"
    exit 77
fi
"$CLI" gen --preset tiny-deepseek --out "$tmp/ck" >/dev/null 2>&1 || fail "gen tiny-deepseek"
layer=$(python3 - "$tmp/ck" <<'PY'
import json, sys
c = json.load(open(sys.argv[1] + "/config.json"))
print(c.get("first_k_dense_replace", 0))
PY
)
python3 - "$tmp/in.safetensors" <<'PY'
import sys, numpy as np
from safetensors.numpy import save_file
rng = np.random.default_rng(5)
save_file({"hidden_states": rng.standard_normal((7, 128)).astype(np.float32)}, sys.argv[1])
PY
"$CLI" forward --model "$tmp/ck" --layer "$layer" --input "$tmp/in.safetensors" --output "$tmp/o0.safetensors" --device cpu \
    >/dev/null 2>"$tmp/err.txt" || { cat "$tmp/err.txt"; fail "forward unsharded"; }
n=1
for args in "--tp 2" "--tp 4 --dist-layout token-sharded" "--ep 4" "--ep 8 --dist-layout token-sharded"; do
    # shellcheck disable=SC2086
    "$CLI" forward --model "$tmp/ck" --layer "$layer" --input "$tmp/in.safetensors" --output "$tmp/o$n.safetensors" \
        --device cpu $args >/dev/null 2>"$tmp/err.txt" || { cat "$tmp/err.txt"; fail "forward $args"; }
    n=$((n + 1))
done
python3 - "$tmp" <<'PY' || fail "sharded forward differs from unsharded"
import sys, numpy as np
from safetensors.numpy import load_file
d = sys.argv[1]
a = load_file(d + "/o0.safetensors")
for i in range(1, 5):
    b = load_file(d + "/o%d.safetensors" % i)
    err = np.linalg.norm(b["hidden_states"].astype(np.float64) - a["hidden_states"]) / np.linalg.norm(a["hidden_states"])
    assert err <= 1e-5, (i, err)
    assert (b["topk_ids"] == a["topk_ids"]).all(), i
print("sharded forward outputs equal the unsharded one")
PY
# a refused split writes no output file
expect_error "not divisible" "$CLI" forward --model "$tmp/ck" --layer "$layer" --input "$tmp/in.safetensors" \
    --output "$tmp/bad.safetensors" --device cpu --ep 3
[ -e "$tmp/bad.safetensors" ] && fail "refused split left an output file"
echo "ok"
