#!/usr/bin/env bash
# The TP8 / EP8 rank shapes in one call on the GPU machine (after
# dev/gpu/build.sh): per-layer CUPTI timelines of each shape at the small
# batch sizes (`fp4moe profile --trace`, cut by dev/analysis/trace_layers.py:
# where the logits, selection, gate/up and down of a layer end), then the
# benchmark of every shape beside PyTorch's grouped BF16 / FP8 MoE on the
# same shard shape (dev/gpu/torch_peer.py); the summary last.
#   RANK_PRESETS="glm-5 deepseek-v4-flash kimi-k2" RANK_TRACE_BATCH=1,4,16 bash dev/gpu/rank.sh
# RANK_PEERS=0 skips the PyTorch peers; RANK_EP=1 adds GLM-5's EP8 rank 0;
# RANK_ACT=bf16 (or f16) gives the TP benchmarks activations of that type
# (the peers always take BF16; the EP rank's pre-routed call takes F32).
set -uo pipefail
cd "$(dirname "$0")/../.."
# checked before any work
ACT=${RANK_ACT:-f32}
[[ $ACT =~ ^(f32|bf16|f16)$ ]] || { echo "rank.sh: RANK_ACT '$ACT' is not f32, bf16 or f16" >&2; exit 2; }
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.devbuild/lib:${LD_LIBRARY_PATH:-} FP4MOE_SHIPPED_CONFIGS=$PWD/configs
. dev/gpu/cublas_path.sh
BIN=${RANK_BIN:-$PWD/.devbuild/bin}
S=$OUT/rank.txt
: > "$S"
PRESETS=${RANK_PRESETS:-glm-5 deepseek-v4-flash kimi-k2}
TB=${RANK_TRACE_BATCH-1,4,16}
BB=${RANK_BATCH:-1,4,16,64,256}
# the peers' shape of each preset's TP8 rank: E H I/8 k
peer_shape() {
    case $1 in
    glm-5) echo "256 6144 256 8" ;;
    deepseek-v4-flash) echo "256 4096 256 6" ;;
    kimi-k2) echo "384 7168 256 8" ;;
    deepseek-v3) echo "256 7168 256 8" ;;
    *) echo "" ;;
    esac
}
for p in $PRESETS; do
    if [[ -n $TB ]]; then
        for b in ${TB//,/ }; do
            timeout 120 "$BIN/fp4moe" profile --device cuda --preset "$p" --shard tp:8 --batch "$b" --layers 8 \
                --step-layers 8 --steps 2 --read-power-s 0 --trace "$OUT/tr_${p}_$b.json" --quiet > "$OUT/prof_${p}_$b.txt" 2>&1 ||
                echo "profile $p B=$b failed: $(tail -n 2 "$OUT/prof_${p}_$b.txt")" >> "$S"
        done
        { echo "== timeline $p TP8 (us after the logits kernel's end)"; python3 dev/analysis/trace_layers.py "$OUT"/tr_"${p}"_*.json; } >> "$S" 2>&1
    fi
    timeout 200 "$BIN/fp4moe" bench --device cuda --preset "$p" --shard tp:8 --batch "$BB" --layers 8 --act "$ACT" \
        --json "$OUT/bench_${p}_tp8.json" > "$OUT/bench_${p}_tp8.txt" 2>&1
    { echo "== bench $p TP8 rank 0, $ACT activations (exit $?)"; grep -E "^device:|bandwidth|^ *[0-9]+ " "$OUT/bench_${p}_tp8.txt"; } >> "$S"
    shape=$(peer_shape "$p")
    if [[ ${RANK_PEERS:-1} == 1 && -n $shape ]]; then
        read -r E H I k <<< "$shape"
        timeout 200 python3 dev/gpu/torch_peer.py --E "$E" --H "$H" --I "$I" --k "$k" --batch "$BB" --layers 8 \
            > "$OUT/peer_${p}_tp8.txt" 2>&1
        { echo "== PyTorch grouped MoE, $p TP8 shape (exit $?)"; tail -n 8 "$OUT/peer_${p}_tp8.txt"; } >> "$S"
    fi
done
if [[ ${RANK_EP:-0} == 1 ]]; then
    timeout 200 "$BIN/fp4moe" bench --device cuda --preset glm-5 --shard ep:8/0 --batch "$BB" --layers 8 \
        > "$OUT/bench_glm-5_ep8.txt" 2>&1
    { echo "== bench glm-5 EP8 rank 0 (exit $?)"; grep -E "bandwidth|^ *[0-9]+ |most loaded" "$OUT/bench_glm-5_ep8.txt"; } >> "$S"
fi
(cd "$OUT" && shopt -s nullglob && f=(tr_*.json) && ((${#f[@]})) && tar czf traces.tgz "${f[@]}" && rm -f "${f[@]}")
(cd "$OUT" && shopt -s nullglob && f=(prof_*.txt bench_*.txt bench_*.json peer_*.txt) && ((${#f[@]})) && tar czf rank_logs.tgz "${f[@]}")
cat "$S"
