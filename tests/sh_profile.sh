#!/usr/bin/env bash
# fp4moe profile from the outside: help, bad flags and bad inputs (clear
# error, non-zero exit, no output file), a checkpoint directory from `gen`,
# and --device cuda on a build or machine without a GPU.
set -u
CLI=${FM_CLI:-}
if [ -z "$CLI" ] || [ ! -x "$CLI" ]; then echo "SKIPPED: FM_CLI not set (run through ctest)"; exit 77; fi
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

# expect_error RC-WANTED "message substring" args...
expect_error() {
    local want=$1 msg=$2
    shift 2
    "$CLI" profile "$@" --quiet --json "$T/out.json" --report "$T/out.html" --trace "$T/out.trace" \
        >"$T/stdout" 2>"$T/stderr"
    local rc=$?
    if [ "$rc" != "$want" ]; then fail "profile $* -> rc $rc, wanted $want: $(cat "$T/stderr")"; fi
    if ! grep -qF -- "$msg" "$T/stderr"; then fail "profile $* -> stderr lacks '$msg': $(cat "$T/stderr")"; fi
    if grep -q "AddressSanitizer\|runtime error" "$T/stderr"; then fail "profile $*: sanitizer report"; fi
    for f in out.json out.html out.trace; do
        if [ -e "$T/$f" ]; then fail "profile $* left $f behind"; rm -f "$T/$f"; fi
    done
    if ls "$T" | grep -q '\.tmp\.'; then fail "profile $* left a temporary file"; fi
}

"$CLI" profile --help >"$T/help" || fail "--help exit status"
grep -q "usage: fp4moe profile" "$T/help" || fail "--help text"

Q=(--preset tiny-qwen3 --bandwidth 5 --peak-gflops 10 --steps 1 --warmup 0)
expect_error 2 "unknown option '--bogus'" "${Q[@]}" --bogus 1
expect_error 2 "bad list '0,4'" "${Q[@]}" --batch 0,4
expect_error 2 "bad list '4,x'" "${Q[@]}" --batch 4,x
expect_error 2 "more than 16 entries" "${Q[@]}" --batch 1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17
expect_error 2 "--device expects cpu or cuda, got 'gpu'" "${Q[@]}" --device gpu
expect_error 2 "--steps expects an integer" "${Q[@]}" --steps 0
expect_error 2 "--bandwidth expects a number" --preset tiny-qwen3 --bandwidth -3
expect_error 2 "--bandwidth expects a number" --preset tiny-qwen3 --bandwidth nan
expect_error 2 "--format expects nvfp4, mxfp4 or bf16" "${Q[@]}" --format fp8
expect_error 2 "--read-power-s expects a number in [0, 60]" "${Q[@]}" --read-power-s -1
expect_error 2 "--read-power-s expects a number in [0, 60]" "${Q[@]}" --read-power-s soon
expect_error 2 "--read-power-s expects a number in [0, 60]" "${Q[@]}" --read-power-s 61
expect_error 2 "--read-power-s is 0 or at least 1.5" "${Q[@]}" --read-power-s 1
expect_error 2 "exactly one of --model DIR or --preset NAME" --batch 4
expect_error 2 "exactly one of --model DIR or --preset NAME" "${Q[@]}" --model "$T"
"$CLI" profile "${Q[@]}" --tile-n >"$T/stdout" 2>"$T/stderr"
[ $? = 2 ] && grep -q "tile-n needs a value" "$T/stderr" || fail "--tile-n without a value: $(cat "$T/stderr")"
expect_error 1 "no-such-preset" --preset no-such-preset --bandwidth 5
expect_error 1 "$T/nowhere" --model "$T/nowhere" --bandwidth 5
expect_error 1 "batch 70000 outside" "${Q[@]}" --batch 70000

# an output directory that does not exist: refused before the run
"$CLI" profile "${Q[@]}" --quiet --report "$T/no/dir/r.html" >"$T/stdout" 2>"$T/stderr"
[ $? = 2 ] || fail "unwritable --report accepted"
grep -q "not writable" "$T/stderr" || fail "unwritable --report message: $(cat "$T/stderr")"

# --device cuda without a usable GPU (or without a CUDA build): a clear error
"$CLI" profile "${Q[@]}" --device cuda --quiet --json "$T/cuda.json" >"$T/stdout" 2>"$T/stderr"
rc=$?
if [ $rc != 0 ]; then
    grep -qi "cuda" "$T/stderr" || fail "--device cuda error does not say why: $(cat "$T/stderr")"
    [ -e "$T/cuda.json" ] && fail "--device cuda failed but left cuda.json"
fi

# a checkpoint directory written by gen
if "$CLI" gen --preset tiny-deepseek --out "$T/ck" --quiet >"$T/gen.out" 2>&1; then
    "$CLI" profile --model "$T/ck" --batch 2,6 --bandwidth 5 --peak-gflops 10 --steps 1 --quiet \
        --json "$T/ck.json" >"$T/stdout" 2>"$T/stderr" || fail "profile --model: $(cat "$T/stderr")"
    grep -q "^model: $T/ck (deepseek_v3)" "$T/stdout" || fail "profile --model output: $(head -3 "$T/stdout")"
    grep -q '"model": "'"$T/ck"'"' "$T/ck.json" || fail "profile --model JSON lacks the model"
    # a truncated shard: the error names the file, nothing is written
    shard=$(ls "$T/ck"/*.safetensors | head -1)
    head -c 200 "$shard" >"$T/trunc" && mv "$T/trunc" "$shard"
    expect_error 1 "$(basename "$shard")" --model "$T/ck" --batch 2 --bandwidth 5 --steps 1
else
    fail "gen tiny-deepseek: $(cat "$T/gen.out")"
fi

# a real run writes all three files, complete
"$CLI" profile --preset tiny-mixtral --batch 3,9 --bandwidth 5 --peak-gflops 10 --steps 1 --quiet \
    --json "$T/a.json" --trace "$T/a.trace" --report "$T/a.html" >"$T/stdout" 2>"$T/stderr" || fail "tiny-mixtral run"
grep -q '"batches"' "$T/a.json" || fail "a.json incomplete"
grep -q '"traceEvents"' "$T/a.trace" || fail "a.trace incomplete"
tail -c 20 "$T/a.html" | grep -q "</html>" || fail "a.html incomplete"
grep -q "^verdict:" "$T/stdout" || fail "no verdict section"

if [ $fails -ne 0 ]; then echo "$fails failure(s)"; exit 1; fi
echo "sh_profile: all checks passed"
