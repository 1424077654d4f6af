#!/usr/bin/env bash
# Builds what scripts/gpu_run.sh runs on the GPU machine, here (that machine
# has nvcc but not the Debian libraries): Release, fatbins for sm_80 and
# sm_90, into .devbuild/ (git-ignored). The binaries go to .devbuild/bin and
# the shared libraries the GPU machine lacks to .devbuild/lib; carry both:
#   run(command="bash scripts/gpu_run.sh", carry=[".devbuild/bin", ".devbuild/lib"])
set -euo pipefail
cd "$(dirname "$0")/.."
B=${FM_GPU_BUILD_DIR:-.devbuild/build}
cmake -S . -B "$B" -DFM_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="80;90a" >/dev/null
cmake --build "$B" -j"$(nproc)" --target test_cuda cuda_bench cuda_smoke cuda_readpat cuda_bwprobe
rm -rf .devbuild/bin .devbuild/lib
mkdir -p .devbuild/bin .devbuild/lib
cp "$B/tests/test_cuda" "$B/tests/tools/cuda_bench" "$B/tests/tools/cuda_smoke" "$B/tests/tools/cuda_readpat" "$B/tests/tools/cuda_bwprobe" .devbuild/bin/
# the CLI is optional here: it needs every module's command to link
if cmake --build "$B" -j"$(nproc)" --target fp4moe_cli >/dev/null 2>&1; then
    cp "$B/fp4moe" .devbuild/bin/
else
    echo "gpu_build: the fp4moe CLI did not link; its run is skipped" >&2
fi
for f in .devbuild/bin/*; do
    ldd "$f" | awk '/=> \// {print $3}' | grep -E 'libjansson|libyajl|libcmocka|libcupti' || true
done | sort -u | while read -r lib; do cp -L "$lib" .devbuild/lib/; done
strip --strip-unneeded .devbuild/bin/* 2>/dev/null || true
du -sh .devbuild/bin .devbuild/lib
