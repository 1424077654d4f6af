#!/usr/bin/env bash
# profile --shard ep:R/r on the CPU: bad shards are refused (exit 2, a clear
# message, no output file); an EP rank of tiny-deepseek names the shard, and
# its bytes, pairs and most loaded rank agree with the shape (counted here)
# and, where every expert is hit, with bench --shard ep on the same rank.
set -u
BIN=${FM_CLI:-}
if [ -z "$BIN" ] || [ ! -x "$BIN" ]; then echo "SKIPPED: FM_CLI not set (run through ctest)"; exit 77; fi
. "$(dirname "$0")/tool_args.inc.sh"
LEFT=$T/left.json
ARGS_PRE="profile --device cpu --preset tiny-deepseek --batch 4 --quiet --json $LEFT"
bad "--shard 'ep:4/4': rank 4 is not below the rank count 4" --shard ep:4/4
bad "--shard ep:3/0: E=16 experts are not divisible by 3" --shard ep:3/0
bad "--shard 'ep:0/0': 0 ranks" --shard ep:0/0
bad "--shard 'ep:4': EP ranks differ, give the rank" --shard ep:4
ARGS_PRE=""

F="--device cpu --threads 2 --bw-mib 16"
timeout 120 "$BIN" profile --preset tiny-deepseek --shard ep:4/1 --batch 2,16,64 --steps 2 --quiet $F \
    --json "$T/p.json" --trace "$T/p.trace.json" --report "$T/p.html" >"$T/p" 2>"$T/p.err" ||
    fail "profile ep: exit $?: $(cat "$T/p.err")"
grep -qF "shard ep 4 rank 1 (experts 4..7 of 16; shared expert on the rank's token chunk)" "$T/p" ||
    fail "profile ep: no shard in the header: $(head -2 "$T/p")"
grep -qF "E=4 k=4 H=128 I=64" "$T/p" || fail "profile ep: not the rank's shape: $(head -1 "$T/p")"
grep -q "most loaded: rank [0-3]" "$T/p" || fail "profile ep: no most loaded rank"
grep -q 'data-rank="3"' "$T/p.html" || fail "profile ep: no ranks' load in the report"
timeout 120 "$BIN" bench --preset tiny-deepseek --shard ep:4/1 --batch 64 --layers 2 --time-ms 20 $F \
    --json "$T/b.json" >"$T/b" 2>"$T/b.err" || fail "bench ep: exit $?: $(cat "$T/b.err")"

python3 - "$T/p.json" "$T/b.json" "$T/p.trace.json" <<'PY' || fail "profile ep JSON"
import json, sys
j = json.load(open(sys.argv[1]))
s = j["shard"]
assert (s["mode"], s["ranks"], s["rank"], s["full_E"], s["full_k"]) == ("ep", 4, 1, 16, 4), s
sh = j["shape"]
H, I, SI, k, R, me = sh["H"], sh["I"], sh["shared_inter"], s["full_k"], s["ranks"], s["rank"]
assert (sh["E"], I) == (4, 64), sh
nv = lambda r, c: r * c // 2 + r * c // 16  # NVFP4: packed values + an E4M3 scale per 16
eb, sb = 3 * nv(I, H), 3 * nv(SI, H)
L = j["layers_per_step"]
for b in j["batches"]:
    B, ld, m = b["batch"], b["shard_load"], b["model"]
    assert ld["layer_calls"] == b["steps"] * L, (ld, b["steps"])
    # every (token, expert) pair of the full routing lands on exactly one rank
    assert abs(sum(ld["pairs"]) - B * k) < 1e-9, (B, ld)
    C = (B + R - 1) // R
    for r in range(R):
        want = ld["active"][r] * eb + (sb if r * C < B else 0)
        assert abs(ld["bytes"][r] - want) < 1e-6, (B, r, ld, want)
    key = lambda r: (ld["bytes"][r], ld["pairs"][r], -r)
    assert ld["max_rank"] == max(range(R), key=key), ld
    assert abs(m["bytes_per_step"] - ld["bytes"][me] * L) < 1e-6, (m, ld)
    assert abs(m["active_observed"] - ld["active"][me]) < 1e-12, (m, ld)
    assert abs(m["floor_ms"] - m["bytes_per_step"] / j["bandwidth_Bps"] * 1e3) < 1e-12, m
    ph = b["phases_ms"]
    assert ph["gate_up"] > 0 and ph["down"] > 0, ph
    assert sum(v for n, v in ph.items() if n != "total" and v) <= ph["total"] * (1 + 1e-9) + 1e-9, ph
    if B == 2:  # chunks of one token: ranks 2 and 3 hold none and read no shared expert
        assert ld["bytes"][2] == ld["active"][2] * eb and ld["bytes"][3] == ld["active"][3] * eb, ld
# 64 tokens hit all 16 experts: the rank reads what bench's rank reads
bj = json.load(open(sys.argv[2]))
row = bj["results"][0]
p64 = [b for b in j["batches"] if b["batch"] == 64][0]
assert p64["shard_load"]["active"] == [4.0] * 4, p64["shard_load"]
assert row["bytes_per_layer"] == p64["shard_load"]["bytes"][me] == 4 * eb + sb, (row["bytes_per_layer"], eb, sb)
assert bj["shard"]["rank"] == me and bj["n_experts"] == sh["E"], bj["shard"]
t = json.load(open(sys.argv[3]))
names = {e.get("name") for e in t["traceEvents"]}
assert any(str(n).startswith("layer ") for n in names) and "gate_up" in names, sorted(map(str, names))[:20]
PY
finish "profile --shard ep"
