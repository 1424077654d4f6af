#!/usr/bin/env bash
# `fp4moe explain` and `fp4moe tune` through the CLI: the default path when no
# config file matches, the tuned file when one does (lookup order across
# $FP4MOE_CONFIG_DIR, the user cache and the shipped configs), malformed and
# mismatched files ignored with a warning on stderr, bad arguments, and `tune`
# failing clearly without a GPU.
set -u
CLI="${FM_CLI:-}"
DATA="${FM_TEST_DATA:-}/tune"
if [ -z "$CLI" ] || [ ! -x "$CLI" ]; then echo "SKIPPED: FM_CLI not set or not executable"; exit 77; fi
if [ ! -f "$DATA/NVIDIA_H200-132sm-nvfp4-E256-H4096-I2048-k6.json" ]; then echo "FAIL: test data missing in $DATA"; exit 1; fi

T=$(mktemp -d /tmp/fm_sh_tune.XXXXXX)
trap 'rm -rf "$T"' EXIT
mkdir -p "$T/env" "$T/xdg/fp4moe/configs" "$T/shipped" "$T/home"
export FP4MOE_CONFIG_DIR="$T/env" XDG_CACHE_HOME="$T/xdg" FP4MOE_SHIPPED_CONFIGS="$T/shipped" HOME="$T/home"
NAME=NVIDIA_H200-132sm-nvfp4-E256-H4096-I2048-k6.json
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
has() { grep -qF -- "$2" "$1" || fail "$3: expected '$2' in $(basename "$1"):"$'\n'"$(cat "$1")"; }
hasnt() { if grep -qF -- "$2" "$1"; then fail "$3: did not expect '$2'"; fi; }

run() { # run NAME ARGS...: stdout to $T/NAME.out, stderr to $T/NAME.err, status in $rc
    local n=$1; shift
    "$CLI" "$@" >"$T/$n.out" 2>"$T/$n.err"
    rc=$?
}

# 1. No file anywhere: the built-in default, loudly.
run none explain --preset deepseek-v4-flash --batch 16 --gpu "NVIDIA H200"
[ $rc -eq 0 ] || fail "explain without files exited $rc: $(cat "$T/none.err")"
has "$T/none.out" "chosen           built-in default" "no file"
has "$T/none.out" "WARNING: no tuned config for NVIDIA H200 (132 SMs) nvfp4 E=256 H=4096 I=2048 k=6; using defaults; run: fp4moe tune --preset deepseek-v4-flash --batch 16" "no file"
has "$T/none.out" "1. \$FP4MOE_CONFIG_DIR $T/env: no such file" "no file trail"
has "$T/none.out" "2. user cache $T/xdg/fp4moe/configs: no such file" "no file trail"
has "$T/none.out" "3. shipped $T/shipped: no such file" "no file trail"
# 256*(1-(250/256)^16) = 80.84; 16*6/80.84 = 1.19
has "$T/none.out" "= 80.8 of 256" "active experts at B=16"
has "$T/none.out" "16*6/80.8 = 1.19" "tokens per expert at B=16"
# bytes: 80.838 x 14,155,776 + the shared expert's 14,155,776 = 1158.5 MB
has "$T/none.out" "80.8 experts x 14.16 MB + shared 14.16 MB = 1158.5 MB" "bytes at B=16"
# three paths considered; from 0.04 tokens per expert (B*k/E) the default is wgmma
has "$T/none.out" "wgmma path: the large path's work with Hopper warpgroup MMAs" "paths considered"
has "$T/none.out" "default          built-in: wgmma path" "default path at B=16"
run none1 explain --preset deepseek-v4-flash --batch 1 --gpu "NVIDIA H200"
has "$T/none1.out" "default          built-in: small path" "default path at B=1"

# 2. A shipped file: used, with its bucket, figures and path.
cp "$DATA/$NAME" "$T/shipped/$NAME"
run shipped explain --preset deepseek-v4-flash --batch 16,20,200 --gpu H200
[ $rc -eq 0 ] || fail "explain with a shipped file exited $rc"
has "$T/shipped.out" "chosen           tuned, bucket 16 (nearest to 16" "shipped"
has "$T/shipped.out" "chosen           tuned, bucket 16 (nearest to 20" "shipped nearest"
has "$T/shipped.out" "chosen           tuned, bucket 256 (nearest to 200" "shipped nearest"
has "$T/shipped.out" "250.00 us vs the default's 262.00 us" "shipped figures"
has "$T/shipped.out" "provenance: backend=cuda gpu=\"NVIDIA H200\"" "shipped provenance"
has "$T/shipped.out" "config=$T/shipped/$NAME bucket=16" "shipped provenance"
has "$T/shipped.out" "params={rows_per_block=16,k_split=4,warps=4,stages=1,tile_n=8,switch_tpe=1.5}" "shipped params"
hasnt "$T/shipped.out" "WARNING" "shipped"
[ -s "$T/shipped.err" ] && fail "unexpected stderr: $(cat "$T/shipped.err")"

# 3. Lookup order: the user cache beats shipped, $FP4MOE_CONFIG_DIR beats both.
cp "$DATA/$NAME" "$T/xdg/fp4moe/configs/$NAME"
run cache explain --preset deepseek-v4-flash --batch 1 --gpu "NVIDIA H200"
has "$T/cache.out" "config=$T/xdg/fp4moe/configs/$NAME" "user cache first"
has "$T/cache.out" "3. shipped $T/shipped: not searched" "user cache first"
cp "$DATA/$NAME" "$T/env/$NAME"
run env explain --preset deepseek-v4-flash --batch 1 --gpu "NVIDIA H200"
has "$T/env.out" "config=$T/env/$NAME" "env dir first"
rm -f "$T/env/$NAME" "$T/xdg/fp4moe/configs/$NAME"

# 4. Malformed or mismatched files in $FP4MOE_CONFIG_DIR: ignored with a
#    warning that names the file and the problem; shipped still used.
check_bad() { # check_bad FILE EXPECTED-SUBSTRING
    cp "$DATA/$1" "$T/env/$NAME"
    run bad explain --preset deepseek-v4-flash --batch 16 --gpu "NVIDIA H200"
    [ $rc -eq 0 ] || fail "$1: exited $rc"
    has "$T/bad.err" "fp4moe explain: warning: $T/env/$NAME: ignored: " "$1"
    has "$T/bad.err" "$2" "$1"
    has "$T/bad.out" "config=$T/shipped/$NAME" "$1 falls through"
}
check_bad bad_truncated.json "not valid JSON"
check_bad bad_wrong_type.json "buckets[1].batch: must be an integer"
check_bad bad_missing_key.json "buckets[1].params.warps: missing"
check_bad bad_negative.json "buckets[1].params.k_split: -2 is outside"
check_bad bad_unknown_path.json "unknown path 'huge'"
check_bad bad_mismatched_key.json "tuned for nvfp4 E=128"
check_bad bad_other_sm.json "tuned on 114 SMs, this GPU has 132"
head -c 400 /dev/urandom >"$T/env/$NAME"
run rnd explain --preset deepseek-v4-flash --batch 16 --gpu "NVIDIA H200"
[ $rc -eq 0 ] || fail "random bytes: exited $rc"
has "$T/rnd.err" "ignored" "random bytes"
: >"$T/env/$NAME"
run empty explain --preset deepseek-v4-flash --batch 16 --gpu "NVIDIA H200"
has "$T/empty.err" "ignored" "empty file"
rm -f "$T/env/$NAME"

# 5. A file for another GPU does not apply: H100 gets the default.
run h100 explain --preset deepseek-v4-flash --batch 16 --gpu H100
has "$T/h100.out" "WARNING: no tuned config for NVIDIA H100 80GB HBM3 (132 SMs)" "other GPU"
has "$T/h100.out" "NVIDIA_H100_80GB_HBM3-132sm-nvfp4-E256-H4096-I2048-k6.json" "other GPU file name"

# 5b. GPUs that no config file names, for any shape (nothing shipped, nothing
#     tuned): the provenance says the kernels were never measured there. The
#     H200 has shipped configs: untuned for a shape, it is still measured,
#     and so is a GPU whose file for another shape is in a lookup directory.
never="fp4moe's kernels have never been measured on"
run b200 explain --preset deepseek-v4-flash --batch 16 --gpu "NVIDIA B200"
[ $rc -eq 0 ] || fail "explain --gpu B200 exited $rc: $(cat "$T/b200.err")"
has "$T/b200.out" "WARNING: no tuned config for NVIDIA B200 (148 SMs) nvfp4 E=256 H=4096 I=2048 k=6; $never NVIDIA B200: " "B200"
has "$T/b200.out" "NVIDIA B200: 148 SMs, 8000 GB/s, 126 MB L2, 180 GB, 1000 W, sm_100" "B200 datasheet"
# where the H200 takes the wgmma default (B = 16), sm_100 runs the mma.sync one
has "$T/none.out" "chosen           built-in default: path=wgmma" "H200 wgmma default"
has "$T/b200.out" "chosen           built-in default: path=large" "B200 mma.sync default"
hasnt "$T/b200.out" "kernel=wgmma" "B200 never wgmma"
run r5090 explain --preset qwen3-30b-a3b --batch 1 --gpu "RTX 5090"
[ $rc -eq 0 ] || fail "explain --gpu 'RTX 5090' exited $rc: $(cat "$T/r5090.err")"
has "$T/r5090.out" "$never NVIDIA GeForce RTX 5090: " "RTX 5090"
has "$T/r5090.out" "NVIDIA GeForce RTX 5090: 170 SMs, 1792 GB/s, 96 MB L2, 32 GB, 575 W, sm_120" "RTX 5090 datasheet"
run pro explain --preset qwen3-30b-a3b --batch 1 --gpu "RTX PRO 6000 Server" --json
has "$T/pro.out" "$never NVIDIA RTX PRO 6000 Blackwell Server Edition: " "RTX PRO 6000 Server Edition (JSON)"
has "$T/none.out" "WARNING: no tuned config for NVIDIA H200" "H200 untuned"
hasnt "$T/none.out" "$never" "H200 untuned"
run h200q explain --preset qwen3-30b-a3b --batch 1 --gpu H200
has "$T/h200q.out" "WARNING: no tuned config for NVIDIA H200" "H200, another shape"
hasnt "$T/h200q.out" "$never" "H200, another shape"
B200_NAME=NVIDIA_B200-148sm-nvfp4-E256-H4096-I2048-k6.json
sed 's/"gpu": "NVIDIA H200"/"gpu": "NVIDIA B200"/; s/"sm_count": 132/"sm_count": 148/' "$DATA/$NAME" >"$T/env/$B200_NAME"
run b200q explain --preset qwen3-30b-a3b --batch 1 --gpu B200
has "$T/b200q.out" "WARNING: no tuned config for NVIDIA B200" "B200 tuned for another shape"
hasnt "$T/b200q.out" "$never" "B200 tuned for another shape"
run b200t explain --preset deepseek-v4-flash --batch 16 --gpu B200
has "$T/b200t.out" "config=$T/env/$B200_NAME bucket=16" "B200 tuned"
rm -f "$T/env/$B200_NAME"

# 6. JSON output.
run json explain --preset deepseek-v4-flash --batch 1,16 --gpu "NVIDIA H200" --json
[ $rc -eq 0 ] || fail "--json exited $rc"
if command -v python3 >/dev/null 2>&1; then
    python3 - "$T/json.out" "$T/shipped/$NAME" <<'EOF' || fail "--json content"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["target"]["name"] == "NVIDIA H200" and d["target"]["sm_count"] == 132, d["target"]
b = {x["batch"]: x for x in d["batches"]}
assert b[1]["choice"]["tuned"] is True and b[1]["choice"]["config"] == sys.argv[2], b[1]["choice"]
assert b[16]["choice"]["bucket"] == 16 and b[16]["choice"]["params"]["k_split"] == 4
assert abs(b[1]["active_experts"] - 6.0) < 1e-9
assert [l["status"] for l in b[1]["lookup"]][:3] == ["no such file", "no such file", "found"], b[1]["lookup"]
s = b[1]["schedule"]
assert s["shared_expert"] == "own stream" and s["selection"] == "spread over the block", s
assert s["expert_launch"] == "right after the selection's wait on the logits", s
assert b[16]["schedule"]["selection"] == "one warp per token" and b[16]["schedule"]["shared_tokens_per_pass"] > 0
EOF
fi

# 6b. The router logits' shape: Qwen3-30B-A3B's tiled grid is 32 blocks, so
# the GEMV shape runs up to 128 tokens there, and not above.
run qlg explain --preset qwen3-30b-a3b --batch 64,130 --gpu "NVIDIA H200"
[ $rc -eq 0 ] || fail "explain qwen3 exited $rc"
has "$T/qlg.out" "router logits    GEMV shape (up to 128 tokens where the tiled grid would be under a third of the SMs; the tiled grid: 32 blocks on 132 SMs)" "qwen3 B = 64 logits"
has "$T/qlg.out" "router logits    tiled shape (above 128 tokens" "qwen3 B = 130 logits"

# 6c. The layer's schedule (src/cuda/schedule.c, as the engine decides):
# the built-in wgmma default at B = 16 takes the per-expert handoff and
# 16-token shared passes; B = 1's small path does not hand off, and its one
# token's selection is spread over the block; the two switches change it.
has "$T/none.out" "schedule         shared expert: its own launches on a second stream, beside the selection and the routed gate/up, 16-token passes" "schedule B=16"
has "$T/none.out" "down: starts per expert as its gate/up ends (up to 32 tokens)" "handoff B=16"
has "$T/none.out" "selection: one warp per token" "selection B=16"
has "$T/none.out" "expert kernels launched right after the selection's wait on the logits" "trigger B=16"
has "$T/none1.out" "selection: the token's sums and scores over the selection block's warps" "spread B=1"
has "$T/none1.out" "down: waits for the whole gate/up launch" "no handoff on the small path"
export FP4MOE_CUDA_SH_FORK=0
run sch0 explain --preset deepseek-v4-flash --batch 1,16 --gpu "NVIDIA H200"
unset FP4MOE_CUDA_SH_FORK
[ $rc -eq 0 ] || fail "explain with SH_FORK=0 exited $rc"
has "$T/sch0.out" "schedule         shared expert: inside the routed launches" "SH_FORK=0"
has "$T/sch0.out" "expert kernels launched after the selection" "SH_FORK=0 trigger"
export FP4MOE_CUDA_PDL=0
run sch1 explain --preset deepseek-v4-flash --batch 16 --gpu "NVIDIA H200"
unset FP4MOE_CUDA_PDL
[ $rc -eq 0 ] || fail "explain with PDL=0 exited $rc"
hasnt "$T/sch1.out" "down: starts per expert" "PDL=0: no handoff"
has "$T/qlg.out" "schedule         no shared expert" "qwen3 schedule"
has "$T/qlg.out" "expert kernels launched after the selection" "qwen3 trigger (single-stream layout)"

# 7. The CPU path and bad arguments.
run cpu explain --preset tiny-qwen3 --batch 4
[ $rc -eq 0 ] || fail "explain without --gpu exited $rc"
if grep -qF "no CUDA GPU present" "$T/cpu.out"; then
    has "$T/cpu.out" "CPU engine" "cpu path"
    # tune needs a GPU: a clear error, non-zero exit, no file written.
    run tune tune --preset tiny-qwen3 --batch 1 --out "$T/tuned"
    [ $rc -ne 0 ] || fail "tune without a GPU succeeded"
    has "$T/tune.err" "no CUDA GPU" "tune without a GPU"
    [ -e "$T/tuned" ] && [ -n "$(ls -A "$T/tuned")" ] && fail "tune without a GPU wrote files"
fi
run nogpu explain --preset deepseek-v4-flash --gpu "Voodoo 2"
[ $rc -ne 0 ] || fail "unknown GPU accepted"
has "$T/nogpu.err" "unknown GPU 'Voodoo 2'" "unknown GPU"
run nomodel explain --batch 4
[ $rc -eq 2 ] || fail "explain without a model exited $rc"
run nopreset explain --preset no-such-model
[ $rc -ne 0 ] || fail "unknown preset accepted"
has "$T/nopreset.err" "no-such-model" "unknown preset"
run badbatch explain --preset tiny-qwen3 --batch 0,x
[ $rc -eq 2 ] || fail "bad --batch exited $rc"
run badfmt explain --preset tiny-qwen3 --format fp3
[ $rc -eq 2 ] || fail "bad --format exited $rc"
run help explain --help
[ $rc -eq 0 ] || fail "explain --help exited $rc"
has "$T/help.out" "NVIDIA H200" "explain --help lists GPUs"
run thelp tune --help
[ $rc -eq 0 ] || fail "tune --help exited $rc"
run tbad tune --preset tiny-qwen3 --all-presets
[ $rc -eq 2 ] || fail "tune with two model sources exited $rc"

# 8. --summary: the gain table for docs/perf.md, hand-checked against the
#    sample (262 -> 250 us is 4.6 %), bad files listed as ignored; no GPU.
run sum tune --summary "$DATA"
[ $rc -eq 0 ] || fail "tune --summary exited $rc"
has "$T/sum.out" "### NVIDIA H200 (132 SMs) nvfp4 E=256 H=4096 I=2048 k=6, preset deepseek-v4-flash" "summary"
has "$T/sum.out" "| 16 | 262.00 | 250.00 | 4.6 % | path=small rows_per_block=16 k_split=4" "summary"
has "$T/sum.out" "| 1 | 21.50 | 21.50 | — | default kept:" "summary"
has "$T/sum.out" "\`bad_wrong_type.json\`: ignored: buckets[1].batch: must be an integer" "summary"
has "$T/sum.out" "does not match its key" "summary"
run sumnone tune --summary "$T/nonexistent"
[ $rc -ne 0 ] || fail "tune --summary of a missing dir succeeded"

# 9. --model DIR: the shape comes from config.json.
mkdir -p "$T/model"
cat >"$T/model/config.json" <<'EOF'
{"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
 "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
 "norm_topk_prob": true, "vocab_size": 151936, "intermediate_size": 6144}
EOF
run model explain --model "$T/model" --batch 8 --gpu "NVIDIA H200"
if [ $rc -eq 0 ]; then
    has "$T/model.out" "E=128 H=2048 I=768 k=8" "--model shape"
    has "$T/model.out" "run: fp4moe tune --preset qwen3-30b-a3b" "--model preset hint"
else
    fail "--model exited $rc: $(cat "$T/model.err")"
fi

if [ $fails -ne 0 ]; then echo "$fails failure(s)"; exit 1; fi
echo "ok"
