#!/usr/bin/env bash
# Runs every built fuzz target for a bounded time on its seed corpus.
set -euo pipefail
BUILD=$1; SECS=${2:-30}
shopt -s nullglob
n=0
for bin in "$BUILD"/fuzz/fuzz_*; do
  [ -x "$bin" ] || continue
  name=$(basename "$bin")
  corpus=$(mktemp -d)
  seeds="fuzz/corpus/${name#fuzz_}"
  [ -d "$seeds" ] && cp -r "$seeds"/. "$corpus"/ 2>/dev/null || true
  echo "fuzz: $name for ${SECS}s"
  "$bin" -max_total_time="$SECS" -rss_limit_mb=2048 -max_len=65536 "$corpus" 2>&1 | tail -3
  rm -rf "$corpus"
  n=$((n+1))
done
echo "fuzz: $n targets ran, no crash"
