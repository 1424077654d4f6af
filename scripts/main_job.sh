#!/usr/bin/env bash
# The README's main job (`make run`): benchmark the MoE layer of a real model
# shape on this machine, against its measured memory bandwidth.
#
# The default checkpoint (seeded random NVFP4 weights of Qwen3-30B-A3B's MoE
# layers, ~340 MB per layer) is generated into a cache directory on first
# use and reused afterwards. The number of layers is chosen to fit the free
# memory and disk (enough layers that caches do not flatter the figures);
# machines too small for two real layers get the tiny preset, with a warning.
#
#   scripts/main_job.sh [path/to/fp4moe]
#   FM_DEFAULT_PRESET=deepseek-v4-flash FM_DEFAULT_LAYERS=4 scripts/main_job.sh
set -euo pipefail
FP4MOE=${1:-build/fp4moe}
CACHE=${FP4MOE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fp4moe}
PRESET=${FM_DEFAULT_PRESET:-qwen3-30b-a3b}
LAYERS=${FM_DEFAULT_LAYERS:-6}
BATCH=${FM_BENCH_BATCH:-1,4,16,64,256}
SEED=1

mkdir -p "$CACHE"
# MB of one MoE layer (NVFP4 experts + router); other presets: a bound.
case "$PRESET" in
    qwen3-30b-a3b) layer_mb=341 ;;
    tiny-*) layer_mb=1; LAYERS=2 ;;
    *) layer_mb=4000 ;;
esac
mem_mb=$(awk '/MemAvailable/ {print int($2 / 1024)}' /proc/meminfo 2>/dev/null || echo 0)
disk_mb=$(df -Pm "$CACHE" | awk 'NR == 2 {print $4}')
fit=$(( (mem_mb / 2) / layer_mb ))
fit_disk=$(( (disk_mb / 2) / layer_mb ))
[ "$fit_disk" -lt "$fit" ] && fit=$fit_disk
if [ "$fit" -lt "$LAYERS" ]; then LAYERS=$fit; fi
if [ "$LAYERS" -lt 2 ]; then
    echo "main job: only ${mem_mb} MB of memory / ${disk_mb} MB of disk free; using the tiny preset instead of $PRESET" >&2
    PRESET=tiny-qwen3
    LAYERS=2
fi

DIR="$CACHE/$PRESET-seed$SEED-L$LAYERS"
if [ ! -f "$DIR/config.json" ]; then
    echo "main job: generating the default checkpoint ($PRESET, $LAYERS MoE layers) into $DIR"
    "$FP4MOE" gen --preset "$PRESET" --layers "$LAYERS" --seed "$SEED" --out "$DIR"
else
    echo "main job: reusing $DIR"
fi
"$FP4MOE" bench --model "$DIR" --batch "$BATCH" --layers "$LAYERS" --json "$CACHE/bench-last.json"
