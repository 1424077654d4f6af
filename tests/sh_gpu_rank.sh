#!/usr/bin/env bash
# dev/gpu/rank.sh without a GPU: the script copied into a scratch tree with a
# stand-in fp4moe that logs its arguments and prints a bench table. Checks:
# a RANK_ACT that is not f32, bf16 or f16 is exit 2 with a message naming
# it, before any output; RANK_ACT=bf16 reaches the TP benches as --act bf16
# and not the EP rank's (its pre-routed call takes F32 only).
set -u
SCRATCH_NAME=sh_rank . "$(dirname "$0")/scratch.inc.sh"

R=$T/tree
mkdir -p "$R/dev/gpu" "$R/fakebin"
cp "$SRC/dev/gpu/rank.sh" "$SRC/dev/gpu/cublas_path.sh" "$R/dev/gpu/"
cat > "$R/fakebin/fp4moe" <<'FAKE'
#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
echo "memory bandwidth: 3000.00 GB/s"
echo "     1        10.0        (9.9 .. 10.1)       1000      8.0      23.89   846.85   26.6%"
FAKE
chmod +x "$R/fakebin/fp4moe"

for bad in x bf-16 F32; do
    (cd "$R" && RANK_ACT=$bad OUT="$T/out_bad" bash dev/gpu/rank.sh) > "$T/o" 2> "$T/e"
    rc=$?
    [ "$rc" = 2 ] || fail "RANK_ACT=$bad: exit $rc, expected 2"
    grep -qF "RANK_ACT '$bad' is not f32, bf16 or f16" "$T/e" || fail "RANK_ACT=$bad: message: $(cat "$T/e")"
    [ ! -e "$T/out_bad" ] || fail "RANK_ACT=$bad: made the output folder"
done

export FAKE_LOG=$T/args
(cd "$R" && RANK_ACT=bf16 RANK_TRACE_BATCH= RANK_PEERS=0 RANK_EP=1 RANK_PRESETS=glm-5 RANK_BIN="$R/fakebin" \
    OUT="$T/out" bash dev/gpu/rank.sh) > "$T/o" 2> "$T/e" || fail "rank.sh with RANK_ACT=bf16: exit $?: $(cat "$T/e")"
grep -q -- "--shard tp:8 .*--act bf16" "$T/args" || fail "the TP bench did not get --act bf16: $(cat "$T/args")"
grep -- "--shard ep:8/0" "$T/args" | grep -q -- "--act" && fail "the EP bench got --act: $(cat "$T/args")"
grep -q "== bench glm-5 TP8 rank 0, bf16 activations (exit 0)" "$T/o" || fail "summary: $(cat "$T/o")"
done_checks sh_gpu_rank
