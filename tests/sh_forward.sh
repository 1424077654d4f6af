#!/usr/bin/env bash
# `fp4moe forward` through files: round trips on every tiny preset (every
# routing family; NVFP4, MXFP4, BF16 experts; F32/BF16/F16 inputs; a hash
# layer with token ids) checked against the float64 reference by
# tools/cpu_fwdtool, and bad inputs (wrong H, missing tensor, not an MoE
# layer, non-finite input, hash layer without token ids, 3-D input) that
# must fail with a clear message and leave no output file.
set -u
CLI=${FM_CLI:-}
TOOL=${FM_TOOLS_DIR:-}/cpu_fwdtool
if [ -z "$CLI" ] || [ ! -x "$CLI" ]; then echo "SKIPPED: FM_CLI not set"; exit 77; fi
if [ ! -x "$TOOL" ]; then echo "FAIL: $TOOL not built"; exit 1; fi
T=$(mktemp -d /tmp/fm_sh_forward.XXXXXX)
trap 'rm -rf "$T"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

# expect_fail NEEDLE WHAT -- forward args...: exit 1 or 2, message, no output file
expect_fail() {
    local needle=$1 what=$2
    shift 3
    rm -f "$T/out.safetensors"
    "$CLI" forward "$@" --output "$T/out.safetensors" > "$T/msg" 2>&1
    local rc=$?
    if [ "$rc" -eq 0 ]; then fail "$what: exit 0"; return; fi
    if [ "$rc" -gt 2 ]; then fail "$what: exit $rc (crash?)"; cat "$T/msg"; return; fi
    grep -qF -- "$needle" "$T/msg" || { fail "$what: no '$needle' in:"; cat "$T/msg"; }
    if ls "$T"/out.safetensors* >/dev/null 2>&1; then fail "$what: an output file was left"; fi
}

roundtrip() { # preset format layer T dtype [opt]
    local p=$1 f=$2 layer=$3 n=$4 dt=$5 opt=${6:-}
    local d="$T/$p-$f" in="$T/in-$p-$f-$layer.safetensors" out="$T/out-$p-$f-$layer.safetensors"
    [ -d "$d" ] || "$CLI" gen --preset "$p" --format "$f" --layers 2 --seed 5 --out "$d" --quiet || { fail "gen $p $f"; return; }
    local h
    h=$(sed -n 's/.*"hidden_size": *\([0-9]*\).*/\1/p' "$d/config.json" | head -1)
    "$TOOL" mkinput "$in" "$n" "$h" "$dt" $opt || { fail "mkinput $p"; return; }
    "$CLI" forward --model "$d" --layer "$layer" --input "$in" --output "$out" > "$T/msg" 2>&1 || { fail "forward $p $f $layer"; cat "$T/msg"; return; }
    "$TOOL" check "$d" "$layer" "$in" "$out" > "$T/chk" 2>&1 || { fail "check $p $f layer $layer"; cat "$T/chk"; }
}

roundtrip tiny-deepseek nvfp4 1 7 F32
roundtrip tiny-deepseek mxfp4 2 3 BF16
roundtrip tiny-deepseek-v4 mxfp4 0 6 F32 tokens
roundtrip tiny-deepseek-v4 nvfp4 1 4 F16 tokens
roundtrip tiny-qwen3 nvfp4 1 9 BF16
roundtrip tiny-qwen3 bf16 0 2 F32
roundtrip tiny-mixtral nvfp4 1 5 F16
roundtrip tiny-gptoss mxfp4 1 8 F32
roundtrip tiny-gptoss bf16 0 1 BF16

d="$T/tiny-deepseek-nvfp4"
"$TOOL" mkinput "$T/h64.safetensors" 3 64 F32
"$TOOL" mkinput "$T/ok.safetensors" 3 128 F32
"$TOOL" mkinput "$T/nan.safetensors" 3 128 F32 nan
"$TOOL" mkinput "$T/noname.safetensors" 3 128 F32 noname
"$TOOL" mkinput "$T/3d.safetensors" 3 128 F32 3d
printf 'not a safetensors file' > "$T/junk.safetensors"
expect_fail "hidden_states is [3, 64]" "wrong H" -- --model "$d" --layer 1 --input "$T/h64.safetensors"
expect_fail "no tensor 'hidden_states'" "missing tensor" -- --model "$d" --layer 1 --input "$T/noname.safetensors"
expect_fail "hidden_states is [1, 3, 128]" "3-D input" -- --model "$d" --layer 1 --input "$T/3d.safetensors"
expect_fail "layer 0 of" "dense layer" -- --model "$d" --layer 0 --input "$T/ok.safetensors"
expect_fail "is not an MoE layer" "dense layer message" -- --model "$d" --layer 0 --input "$T/ok.safetensors"
expect_fail "token 2, feature 1" "non-finite input" -- --model "$d" --layer 1 --input "$T/nan.safetensors"
expect_fail "has layers 0..3" "layer out of range" -- --model "$d" --layer 4 --input "$T/ok.safetensors"
expect_fail "junk.safetensors" "not a safetensors file" -- --model "$d" --layer 1 --input "$T/junk.safetensors"
expect_fail "missing.safetensors" "missing input" -- --model "$d" --layer 1 --input "$T/missing.safetensors"
expect_fail "token_ids" "hash layer without token ids" -- --model "$T/tiny-deepseek-v4-mxfp4" --layer 0 --input "$T/ok.safetensors"
expect_fail "are required" "no --input" -- --model "$d" --layer 1
expect_fail "--device" "bad device" -- --model "$d" --layer 1 --input "$T/ok.safetensors" --device tpu
# A GPU-less build says so instead of crashing (on a CUDA machine this runs).
if ! "$CLI" forward --model "$d" --layer 1 --input "$T/ok.safetensors" --output "$T/cuda.safetensors" --device cuda > "$T/msg" 2>&1; then
    grep -qi "cuda\|gpu" "$T/msg" || { fail "--device cuda error does not say why"; cat "$T/msg"; }
    [ ! -e "$T/cuda.safetensors" ] || fail "--device cuda failed but wrote a file"
fi
"$CLI" forward --help | grep -q "topk_ids" || fail "--help"

if [ "$fails" -ne 0 ]; then echo "$fails failure(s)"; exit 1; fi
echo "all forward checks passed"
