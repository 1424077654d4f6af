#!/usr/bin/env bash
# --shard on the command line: bad values and combinations fail with a clear
# error naming the flag (exit 2, nothing on stdout); a TP / EP rank of a tiny
# preset runs on the CPU and its output names the shard.
set -u
BIN=${FM_CLI:-}
if [ -z "$BIN" ] || [ ! -x "$BIN" ]; then echo "SKIPPED: FM_CLI not set (run through ctest)"; exit 77; fi
. "$(dirname "$0")/tool_args.inc.sh"
LEFT=$T/out.json

for cmd in bench profile explain tune; do
    ARGS_PRE="$cmd --preset tiny-qwen3"
    bad "--shard 'xp:2': expected tp:R, tp:R/r or ep:R/r" --shard xp:2
    bad "--shard 'tp:': the rank count R" --shard tp:
    bad "--shard 'tp:2/': the rank r after '/'" --shard tp:2/
    bad "--shard 'tp:2x': unexpected 'x'" --shard tp:2x
    bad "--shard 'tp:2/2': rank 2 is not below the rank count 2" --shard tp:2/2
    bad "--shard 'tp:0': 0 ranks" --shard tp:0
    bad "--shard 'ep:4': EP ranks differ, give the rank" --shard ep:4
    bad "--shard needs a value" --shard
    # tiny-qwen3: I = 64, E = 16 (nvfp4: 16-element blocks)
    bad "--shard tp:3: expert intermediate size I=64 is not divisible by 3" --shard tp:3
    bad "--shard tp:8: slice I/R=8 is not a multiple of the nvfp4 scale block (16)" --shard tp:8
    bad "--shard ep:3/0: E=16 experts are not divisible by 3" --shard ep:3/0
done
ARGS_PRE="tune"
bad "--shard tunes one model's rank" --all-presets --shard tp:2
ARGS_PRE="bench --preset tiny-qwen3"
bad "--shard (one rank on one device) and --tp / --ep" --shard tp:2 --tp 2
bad "--shard (one rank on one device) and --tp / --ep" --shard ep:2/1 --ep 2
ARGS_PRE=""

run_ok() { # name args...: exit 0, stdout in $T/$1
    local n=$1; shift
    timeout 60 "$BIN" "$@" >"$T/$n" 2>"$T/$n.err" || fail "$*: exit $?: $(cat "$T/$n.err")"
}
C="--device cpu --threads 2 --time-ms 20 --bw-mib 16 --layers 2 --batch 1,8"
run_ok tp bench --preset tiny-deepseek --shard tp:2/1 $C --json "$T/tp.json"
grep -qF "shard: tp 2 rank 1 (I 32 of 64, shared 32 of 64)" "$T/tp" || fail "bench tp: no shard line: $(cat "$T/tp")"
grep -qF "H=128 I=32 E=16 k=4" "$T/tp" || fail "bench tp: not the rank's shape: $(head -2 "$T/tp")"
python3 - "$T/tp.json" <<'PY' || fail "bench tp JSON"
import json, sys
j = json.load(open(sys.argv[1]))
s = j["shard"]
assert (s["mode"], s["ranks"], s["rank"], j["moe_inter"], s["full_moe_inter"]) == ("tp", 2, 1, 32, 64), s
PY
run_ok ep bench --preset tiny-deepseek --shard ep:4/1 $C --json "$T/ep.json"
grep -qF "shard: ep 4 rank 1 (experts 4..7 of 16; shared expert on the rank's token chunk)" "$T/ep" ||
    fail "bench ep: no shard line: $(cat "$T/ep")"
grep -qF "H=128 I=64 E=4 k=4" "$T/ep" || fail "bench ep: not the rank's shape: $(head -2 "$T/ep")"
grep -q "most loaded: rank [0-3]" "$T/ep" || fail "bench ep: no most loaded rank"
python3 - "$T/ep.json" <<'PY' || fail "bench ep JSON"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["shard"]["mode"] == "ep" and j["n_experts"] == 4, j["shard"]
for row in j["results"]:
    ld = row["shard_load"]
    # every (token, expert) pair lands on exactly one rank
    assert abs(sum(ld["pairs"]) - row["batch"] * 4) < 1e-3, ld
    assert ld["bytes"][ld["max_rank"]] == max(ld["bytes"]), ld
    assert abs(ld["bytes"][1] - row["bytes_per_layer"]) <= 1, (ld, row["bytes_per_layer"])
    assert ("max_rank_us" in ld) == (ld["max_rank"] != 1), ld
PY
run_ok pr profile --preset tiny-deepseek --shard tp:2/1 --batch 4 --threads 2 --quiet --bw-mib 16 --steps 1 \
    --json "$T/pr.json"
grep -qF "shard tp 2 rank 1 (I 32 of 64, shared 32 of 64)" "$T/pr" || fail "profile tp: no shard: $(head -2 "$T/pr")"
grep -qF "H=128 I=32" "$T/pr" || fail "profile tp: not the rank's shape"
run_ok pe profile --preset tiny-deepseek --shard ep:2/1 --batch 4 --threads 2 --quiet --bw-mib 16 --steps 1
grep -qF "shard ep 2 rank 1 (experts 8..15 of 16" "$T/pe" || fail "profile ep: no shard: $(head -2 "$T/pe")"

# a checkpoint's layers: the shard is a view of each bound layer
"$BIN" gen --preset tiny-deepseek --out "$T/ck" --layers 2 --quiet || fail "gen tiny-deepseek"
run_ok mtp bench --model "$T/ck" --shard tp:4/3 $C
grep -qF "shard: tp 4 rank 3 (I 16 of 64, shared 16 of 64)" "$T/mtp" || fail "bench --model tp: $(head -3 "$T/mtp")"
run_ok mep bench --model "$T/ck" --shard ep:2/1 $C
grep -qF "shard: ep 2 rank 1 (experts 8..15 of 16" "$T/mep" || fail "bench --model ep: $(head -3 "$T/mep")"
grep -q "most loaded: rank [01]" "$T/mep" || fail "bench --model ep: no most loaded rank"

# explain names the shard and keys the config file by the rank's shape
run_ok ex explain --preset glm-5 --gpu H200 --shard tp:8 --batch 1
grep -qF "shard: tp 8 rank 0 (I 256 of 2048, shared 256 of 2048)" "$T/ex" || fail "explain tp: no shard line"
grep -qF "NVIDIA_H200-132sm-nvfp4-E256-H6144-I256-k8.json" "$T/ex" || fail "explain tp: not the rank's key"
run_ok exj explain --preset glm-5 --gpu H200 --shard ep:8/2 --batch 1,16 --json
python3 - "$T/exj" <<'PY' || fail "explain ep JSON"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["shard"]["mode"] == "ep" and j["shard"]["rank"] == 2, j["shard"]
assert (j["shape"]["E"], j["shape"]["k"], j["shape"]["I"]) == (32, 8, 2048), j["shape"]
PY
finish shard
