#!/usr/bin/env bash
# The README's main job: benchmark the MoE layer on a built-in default.
set -euo pipefail
FP4MOE=${1:-build/fp4moe}
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/fp4moe
DEFAULT=${FM_DEFAULT_PRESET:-qwen3-30b-a3b}
mkdir -p "$CACHE"
if [ ! -f "$CACHE/$DEFAULT/config.json" ]; then
  echo "main job: generating the default checkpoint ($DEFAULT) into $CACHE/$DEFAULT"
  "$FP4MOE" gen --preset "$DEFAULT" --layers 4 --out "$CACHE/$DEFAULT"
fi
"$FP4MOE" inspect "$CACHE/$DEFAULT"
if "$FP4MOE" help 2>/dev/null | grep -q '^  bench'; then
  "$FP4MOE" bench --model "$CACHE/$DEFAULT" --batch 1,4,16,64
fi
