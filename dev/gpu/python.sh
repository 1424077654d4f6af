#!/usr/bin/env bash
# The Python package's torch ops on the GPU (dev/gpu/python_tests.py).
#   bash dev/gpu/python.sh build   on the development machine (nvcc; the GPU
#                                  machine lacks the Debian libraries): the
#                                  CUDA build of libfp4moe.so and the CLI into
#                                  .devbuild/lib and .devbuild/bin, with the
#                                  shared libraries they need
#   bash dev/gpu/python.sh [run]   on the GPU machine, from a checkout that
#                                  has .devbuild/bin and .devbuild/lib: the
#                                  checks, then the B = 1 benchmark table
#                                  and the per-call timing
#   bash dev/gpu/python.sh percall on the GPU machine: only the eager vs
#                                  CUDA-graph µs per call of the ops
# The log goes to $OUT/python_tests.log (default ./gpu_out).
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=${1:-run}
case "$mode" in
build)
    B=${FM_GPU_BUILD_DIR:-.devbuild/build}
    cmake -S . -B "$B" -DFM_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="80;90a" >/dev/null
    cmake --build "$B" -j"$(nproc)" --target fp4moe_shared fp4moe_cli
    mkdir -p .devbuild/bin .devbuild/lib
    cp "$B/fp4moe" .devbuild/bin/
    cp -L "$B/libfp4moe.so" .devbuild/lib/libfp4moe.so
    for f in .devbuild/bin/fp4moe .devbuild/lib/libfp4moe.so; do
        ldd "$f" | awk '/=> \// {print $3}' | grep -E 'libjansson|libyajl|libcupti' || true
    done | sort -u | while read -r lib; do cp -L "$lib" .devbuild/lib/; done
    strip --strip-unneeded .devbuild/bin/fp4moe .devbuild/lib/libfp4moe.so 2>/dev/null || true
    du -sh .devbuild/bin .devbuild/lib
    ;;
run|percall)
    OUT=${OUT:-./gpu_out}
    mkdir -p "$OUT"
    for f in .devbuild/lib/libfp4moe.so .devbuild/bin/fp4moe; do
        [ -e "$f" ] || { echo "python.sh: $f missing: run 'bash dev/gpu/python.sh build' on the development machine and bring .devbuild/bin and .devbuild/lib along" >&2; exit 2; }
    done
    export LD_LIBRARY_PATH="$PWD/.devbuild/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export FP4MOE_LIBRARY="$PWD/.devbuild/lib/libfp4moe.so" FM_CLI="$PWD/.devbuild/bin/fp4moe" PYTHONUNBUFFERED=1
    args=()
    [ "$mode" = percall ] && args=(--per-call)
    python3 dev/gpu/python_tests.py "${args[@]}" 2>&1 | tee "$OUT/python_tests.log"
    exit "${PIPESTATUS[0]}"
    ;;
*)
    echo "usage: bash dev/gpu/python.sh [build|run|percall]" >&2
    exit 2
    ;;
esac
