#!/usr/bin/env bash
# gen + inspect through the CLI: every tiny preset in every format, one real
# layer (qwen3-30b-a3b, ~340 MB), and bad inputs (missing shard, mis-shaped
# expert tensor, k > E in config.json) that must fail with a message, never crash.
set -u
CLI=${FM_CLI:-}
if [ -z "$CLI" ] || [ ! -x "$CLI" ]; then echo "SKIPPED: FM_CLI not set"; exit 77; fi
command -v perl >/dev/null || { echo "SKIPPED: perl not found"; exit 77; }
T=$(mktemp -d /tmp/fm_sh_gen.XXXXXX)
trap 'rm -rf "$T"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

# expect_fail RC_FILE OUT_FILE NEEDLE WHAT: exit status 1 or 2 (not a crash) and the message
expect_fail() {
    local rc=$1 out=$2 needle=$3 what=$4
    if [ "$rc" -eq 0 ]; then fail "$what: exit 0"; return; fi
    if [ "$rc" -gt 2 ]; then fail "$what: exit $rc (crash?)"; return; fi
    grep -qF -- "$needle" "$out" || { fail "$what: no '$needle' in output:"; cat "$out"; }
}

for p in tiny-deepseek tiny-deepseek-v4 tiny-qwen3 tiny-mixtral tiny-gptoss; do
    for f in nvfp4 mxfp4 bf16; do
        d="$T/$p-$f"
        "$CLI" gen --preset "$p" --format "$f" --layers 2 --seed 3 --out "$d" --quiet || { fail "gen $p $f"; continue; }
        "$CLI" inspect "$d" > "$T/out" 2>&1 || { fail "inspect $p $f"; cat "$T/out"; }
        grep -q "problems     0" "$T/out" || fail "inspect $p $f reports problems"
        grep -q "experts $f" "$T/out" || fail "inspect $p $f: format not shown"
        "$CLI" inspect "$d" --json > "$T/json" 2>&1 || fail "inspect --json $p $f"
        grep -q '"n_problems": 0' "$T/json" || fail "inspect --json $p $f"
    done
done
grep -q "MoE layers \[1, 2\]" <("$CLI" inspect "$T/tiny-deepseek-nvfp4") || fail "tiny-deepseek: layers 1, 2 present (layer 0 dense)"
grep -q "hash layers 0..1" <("$CLI" inspect "$T/tiny-deepseek-v4-mxfp4") || fail "tiny-deepseek-v4: hash layers shown"

# one real layer
d="$T/qwen3"
"$CLI" gen --preset qwen3-30b-a3b --out "$d" --quiet || fail "gen qwen3-30b-a3b"
"$CLI" inspect "$d" > "$T/out" 2>&1 || { fail "inspect qwen3-30b-a3b"; cat "$T/out"; }
grep -q "hidden 2048, expert inter 768, 128 routed experts, top-8" "$T/out" || { fail "qwen3 shape"; cat "$T/out"; }
rm -rf "$d"

# bad inputs: missing shard
d="$T/shards"
"$CLI" gen --preset tiny-qwen3 --layers 2 --shard-size 100K --out "$d" --quiet || fail "gen shards"
victim=$(ls "$d" | grep -m1 'model-00002-of-')
rm -f "$d/$victim"
"$CLI" inspect "$d" > "$T/out" 2>&1
expect_fail $? "$T/out" "$victim" "missing shard"

# bad inputs: a mis-shaped expert tensor ([128,32] -> [32,128]: same bytes, valid file)
d="$T/shape"
"$CLI" gen --preset tiny-deepseek --out "$d" --quiet || fail "gen shape"
perl -0777 -pi -e 's/("model\.layers\.1\.mlp\.experts\.3\.down_proj\.weight":\{"dtype":"U8","shape":)\[128,32\]/$1\[32,128\]/' \
    "$d/model-00001-of-00001.safetensors"
"$CLI" inspect "$d" > "$T/out" 2>&1
expect_fail $? "$T/out" "tensor 'model.layers.1.mlp.experts.3.down_proj.weight' has shape [32, 128], expected [128, 32]" "mis-shaped tensor"

# bad inputs: k > E in config.json
d="$T/k"
"$CLI" gen --preset tiny-mixtral --out "$d" --quiet || fail "gen k"
perl -pi -e 's/"num_experts_per_tok": 2/"num_experts_per_tok": 99/' "$d/config.json"
"$CLI" inspect "$d" > "$T/out" 2>&1
expect_fail $? "$T/out" "k=99 is greater than the number of experts E=8" "k > E"

# bad command lines
"$CLI" gen --preset no-such-model --out "$T/x" > "$T/out" 2>&1
expect_fail $? "$T/out" "unknown preset" "unknown preset"
"$CLI" gen --preset tiny-qwen3 --layers 0 --out "$T/x" > "$T/out" 2>&1
expect_fail $? "$T/out" "--layers" "--layers 0"
"$CLI" gen --preset tiny-qwen3 --layers 3 --out "$T/x" > "$T/out" 2>&1
expect_fail $? "$T/out" "has 2 MoE layers" "--layers 3"
"$CLI" gen --preset tiny-qwen3 --format fp8 --out "$T/x" > "$T/out" 2>&1
expect_fail $? "$T/out" "--format" "--format fp8"
"$CLI" gen --preset tiny-qwen3 --out "$T/k" > "$T/out" 2>&1
expect_fail $? "$T/out" "already exists" "existing output"
[ -e "$T/x" ] && fail "a failed gen left $T/x"
ls "$T" | grep -q '\.tmp\.' && fail "a temporary directory was left behind"
"$CLI" inspect "$T/nothing-here" > "$T/out" 2>&1
expect_fail $? "$T/out" "nothing-here" "missing directory"
"$CLI" gen --help > /dev/null || fail "gen --help"
"$CLI" inspect --help > /dev/null || fail "inspect --help"

[ "$fails" -eq 0 ] || { echo "$fails failure(s)"; exit 1; }
echo ok
