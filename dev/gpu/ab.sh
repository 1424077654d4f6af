#!/usr/bin/env bash
# A/B of two or more builds (or of the engine's debugging switches), in one
# call on the GPU machine, interleaved so that drift between calls does not
# decide: each round runs every variant once, and the table printed last
# holds the best of AB_ROUNDS rounds of each (variant, batch) and its ratio
# to the first variant. A variant is NAME:VARS, VARS a comma-separated list
# of environment settings; FM_AB_BIN=DIR among them runs DIR's binaries
# instead of .devbuild/bin (DIR relative to the checkout or absolute):
#   AB_VARIANTS="new: base:FM_AB_BIN=.devbuild/base/bin" AB_ROUNDS=3 bash dev/gpu/ab.sh
#   AB_VARIANTS="pdl: nopdl:FP4MOE_CUDA_PDL=0" AB_BATCH=1,2,4,8,16 bash dev/gpu/ab.sh
#   AB_VARIANTS="f32: bf16:FM_AB_ACT=bf16" AB_PRESET="glm-5@tp:8" bash dev/gpu/ab.sh
# Each variant runs `fp4moe bench --device cuda` on each case of AB_PRESET
# (space-separated PRESET or PRESET@SHARD, e.g. "deepseek-v4-flash
# glm-5@tp:8"; by default DeepSeek-V4-Flash, full layer), shipped configs. AB_TEST=1 also runs
# test_cuda under each variant first; AB_SUSTAIN=MS times each batch after
# MS ms of sustained load (--sustain-ms). Each case's table is printed when
# its rounds are done; AB_DEADLINE_S=N starts no case after N seconds (a
# call with a time limit keeps the tables it finished). docs/dev.md has the
# whole method.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.devbuild/lib:${LD_LIBRARY_PATH:-}
export FP4MOE_SHIPPED_CONFIGS=${FP4MOE_SHIPPED_CONFIGS:-$PWD/configs}
BIN=$PWD/.devbuild/bin
VARIANTS=${AB_VARIANTS:-"base:"}
BATCH=${AB_BATCH:-1,2,4,8,16,32,64}
ROUNDS=${AB_ROUNDS:-2}
CASES=${AB_PRESET:-deepseek-v4-flash}
vars_of() { local v=${1#*:}; echo "${v//,/ }"; }
# a variant may name another build: "base:FM_AB_BIN=DIR" runs DIR's
# binaries (copied to the GPU machine beside .devbuild/bin)
bin_of() {
    local v d
    for v in $(vars_of "$1"); do
        if [[ $v == FM_AB_BIN=* ]]; then
            d=${v#FM_AB_BIN=}
            [[ $d == /* ]] || d=$PWD/$d
            echo "$d"
            return
        fi
    done
    echo "$BIN"
}
# FM_AB_ACT=bf16 (or f16) among a variant's settings feeds its bench
# activations of that type (--act), as an engine passes them
act_of() {
    local v
    for v in $(vars_of "$1"); do
        [[ $v == FM_AB_ACT=* ]] && { echo "--act ${v#FM_AB_ACT=}"; return; }
    done
}
[[ -z ${AB_DEADLINE_S:-} || $AB_DEADLINE_S =~ ^[0-9]+$ ]] ||
    { echo "ab: AB_DEADLINE_S '$AB_DEADLINE_S' is not a whole number of seconds" >&2; exit 2; }
for spec in $VARIANTS; do
    [[ -x "$(bin_of "$spec")/fp4moe" ]] || { echo "ab: no $(bin_of "$spec")/fp4moe for variant '${spec%%:*}'" >&2; exit 2; }
done
if [[ "${AB_TEST:-0}" == 1 ]]; then
    for spec in $VARIANTS; do
        name=${spec%%:*}
        (cd "$OUT" && env $(vars_of "$spec") timeout 200 "$(bin_of "$spec")/test_cuda") > "$OUT/ab_test_$name.log" 2>&1
        echo "test_cuda [$name] exit $? $(grep -E '^\[  PASSED|^\[  FAILED' "$OUT/ab_test_$name.log" | tr '\n' ' ')"
    done
fi
# one case's table: best of the rounds per (variant, batch), ratio to the first
table() {
tag=$(echo "$1" | tr ':/@' '___')
echo "== $1"
python3 - "$OUT" "$ROUNDS" "$tag" $VARIANTS <<'PY'
import sys, re
out, rounds, tag, specs = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
names = [s.split(":")[0] for s in specs]
best, bw = {}, {}
for n in names:
    for r in range(1, rounds + 1):
        try:
            txt = open(f"{out}/ab_{tag}_{n}_{r}.txt").read()
        except OSError:
            continue
        m = re.search(r"bandwidth[^0-9]*([0-9.]+) (GB|TB)/s", txt)
        if m: bw.setdefault(n, []).append(m.group(1) + m.group(2))
        for line in txt.splitlines():
            f = line.split()
            if len(f) > 3 and f[0].isdigit() and re.match(r"^[0-9.]+$", f[1]):
                b, us = int(f[0]), float(f[1])
                best[(n, b)] = min(us, best.get((n, b), 1e30))
bs = sorted({b for (_, b) in best})
print("A/B, best µs per layer of", rounds, "rounds; ratio to", names[0])
print("bandwidth probes:", {n: bw.get(n) for n in names})
print("     B " + "".join(f"{n:>16}" for n in names))
for b in bs:
    base = best.get((names[0], b))
    row = f"{b:6d} "
    for n in names:
        v = best.get((n, b))
        row += f"{'-':>16}" if v is None else f"{v:9.1f} ({v / base:4.2f})" if base else f"{v:16.1f}"
    print(row)
PY
}
T0=$(date +%s)
# case after case, each case's rounds interleaving the variants, its table
# printed as soon as its rounds are done: a call cut short keeps the cases it
# finished; past AB_DEADLINE_S seconds no further case starts
for c in $CASES; do
    if [[ -n ${AB_DEADLINE_S:-} ]] && (($(date +%s) - T0 >= AB_DEADLINE_S)); then
        echo "== $c: not run (AB_DEADLINE_S=$AB_DEADLINE_S reached)"
        continue
    fi
    preset=${c%%@*}
    shard=()
    [[ $c == *@* ]] && shard=(--shard "${c#*@}")
    tag=$(echo "$c" | tr ':/@' '___')
    for r in $(seq 1 "$ROUNDS"); do
        for spec in $VARIANTS; do
            name=${spec%%:*}
            env $(vars_of "$spec") timeout 200 "$(bin_of "$spec")/fp4moe" bench --device cuda --preset "$preset" \
                "${shard[@]}" --batch "$BATCH" --layers 8 ${AB_SUSTAIN:+--sustain-ms $AB_SUSTAIN} $(act_of "$spec") \
                > "$OUT/ab_${tag}_${name}_$r.txt" 2>&1
            echo "round $r $c [$name] exit $?"
        done
    done
    table "$c"
done
# the logs in one archive: fewer files to copy back
(cd "$OUT" && shopt -s nullglob && f=(ab_*.txt ab_*.log) && ((${#f[@]})) && tar czf ab_logs.tgz "${f[@]}" && rm -f "${f[@]}")
