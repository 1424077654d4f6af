#!/usr/bin/env bash
# fp4moe bench from the outside: --sustain-ms (the GPU's sustained-load
# timing, docs/perf.md) and --act (the GPU benchmark's activations) are
# checked before any work: a clear error and exit 2 for bad values, for the
# CPU path (which times for --time-ms and feeds f32) and with --tp / --ep;
# nothing on stdout, no JSON written.
set -u
BIN=${FM_CLI:-}
if [ -z "$BIN" ] || [ ! -x "$BIN" ]; then echo "SKIPPED: FM_CLI not set (run through ctest)"; exit 77; fi
. "$(dirname "$0")/tool_args.inc.sh"
LEFT=$T/out.json
ARGS_PRE="bench --json $LEFT"

"$BIN" bench --help >"$T/help" || fail "--help exit status"
grep -qF -- "--sustain-ms MS" "$T/help" || fail "--help lacks --sustain-ms"
grep -qF "median of 50 replays" "$T/help" || fail "--help does not say how the GPU timing works"

bad "--sustain-ms expects an integer in [0, 600000], got '-1'" --device cuda --sustain-ms -1
bad "--sustain-ms expects an integer in [0, 600000], got 'x'" --device cuda --sustain-ms x
bad "--sustain-ms expects an integer in [0, 600000], got '600001'" --device cuda --sustain-ms 600001
bad "--sustain-ms needs a value" --device cuda --sustain-ms
bad "--sustain-ms applies to --device cuda" --preset tiny-qwen3 --sustain-ms 100
bad "--sustain-ms applies to --device cuda" --sustain-ms 0 --device cpu
bad "it does not apply with --tp / --ep" --device cuda --tp 2 --sustain-ms 100
# --act: the GPU benchmark's activations (f32 by default, bf16 as engines pass them)
grep -qF -- "--act f32|bf16|f16" "$T/help" || fail "--help lacks --act"
bad "--act 'fp8' (expected f32, bf16 or f16)" --device cuda --act fp8
bad "--act needs a value" --device cuda --act
bad "--act applies to --device cuda" --preset tiny-qwen3 --act bf16
bad "BF16 activations apply to one GPU's layer or a TP shard" --device cuda --preset glm-5 --shard ep:8/0 --act bf16
bad "F16 activations apply to one GPU's layer or a TP shard" --device cuda --tp 2 --act f16

# Where no GPU is usable the CUDA path says so (exit non-zero, no JSON, nothing
# on stdout).
"$BIN" bench --device cuda --preset tiny-qwen3 --batch 1 --layers 1 --sustain-ms 20 --json "$T/g.json" >"$T/g.out" 2>"$T/g.err"
rc=$?
if grep -q "no usable CUDA GPU\|no CUDA backend\|built without CUDA" "$T/g.err"; then
    [ "$rc" != 0 ] || fail "bench --device cuda without a GPU exited 0"
    [ ! -e "$T/g.json" ] || fail "bench --device cuda without a GPU wrote its JSON"
    [ ! -s "$T/g.out" ] || fail "bench --device cuda without a GPU printed: $(cat "$T/g.out")"
    echo "note: no usable GPU here; the sustained timing and BF16 activations run in test_cuda on the GPU machine"
else
    [ "$rc" = 0 ] || fail "bench --device cuda --sustain-ms 20 exited $rc: $(cat "$T/g.err")"
    grep -qF "after 20 ms of sustained replays" "$T/g.out" || fail "the timing line does not name the sustained replays"
    python3 -c 'import json,sys; assert json.load(open(sys.argv[1]))["sustain_ms"] == 20' "$T/g.json" || fail "JSON sustain_ms"
    "$BIN" bench --device cuda --preset tiny-qwen3 --batch 1,64 --layers 1 --act bf16 --json "$T/b.json" >"$T/b.out" 2>"$T/b.err" ||
        fail "bench --device cuda --act bf16 exited non-zero: $(cat "$T/b.err")"
    grep -qF "activations: BF16" "$T/b.out" || fail "the header does not name the BF16 activations"
    python3 -c 'import json,sys; assert json.load(open(sys.argv[1]))["activations"] == "BF16"' "$T/b.json" || fail "JSON activations"
    python3 -c 'import json,sys; assert json.load(open(sys.argv[1]))["activations"] == "F32"' "$T/g.json" || fail "JSON activations (default)"
fi

finish bench
