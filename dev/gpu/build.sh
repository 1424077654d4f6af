#!/usr/bin/env bash
# Builds, on this machine, everything dev/gpu/run.sh runs on the GPU machine
# (that machine has a GPU and nvcc but not the Debian libraries): Release,
# machine code for sm_80 and sm_90a, in .devbuild/build (git-ignored). The
# programs go to .devbuild/bin, the shared libraries they need that the GPU
# machine lacks (and libfp4moe.so where the build makes it) to .devbuild/lib.
# Then copy .devbuild/bin and .devbuild/lib to the GPU machine, into the
# same places of a checkout of the same tree, and run dev/gpu/run.sh there.
#   bash dev/gpu/build.sh
# FM_GPU_BUILD_DIR overrides the build directory, FM_GPU_OUT the folder of
# bin/ and lib/ (.devbuild): a second build to A/B against, made in a
# worktree of the base commit, goes beside the first with
#   FM_GPU_OUT=/path/to/this/checkout/.devbuild/base bash dev/gpu/build.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
B=${FM_GPU_BUILD_DIR:-.devbuild/build}
# <target> <its path in the build>: the tests, the test helpers, the CLI
# and the measurement programs of dev/tools
PROGRAMS="test_cuda:tests/test_cuda test_cuda_repack:tests/test_cuda_repack test_tensors:tests/test_tensors test_prof_cuda:tests/test_prof_cuda test_dist_nccl:tests/test_dist_nccl
  cuda_smoke:tests/tools/cuda_smoke cpu_isa_check:tests/tools/cpu_isa_check fp4moe_cli:fp4moe
  cuda_bench:dev/tools/cuda_bench cuda_readpat:dev/tools/cuda_readpat cuda_bwprobe:dev/tools/cuda_bwprobe cuda_icache:dev/tools/cuda_icache cuda_chain:dev/tools/cuda_chain cuda_topk:dev/tools/cuda_topk
  cpu_ab:dev/tools/cpu_ab cpu_kbench:dev/tools/cpu_kbench"
# FM_GPU_TARGETS="fp4moe_cli test_cuda": only those of the programs (a
# variant's build for an A/B needs no more)
if [[ -n ${FM_GPU_TARGETS:-} ]]; then
    sel=""
    for p in $PROGRAMS; do [[ " $FM_GPU_TARGETS " == *" ${p%%:*} "* ]] && sel="$sel $p"; done
    [[ -n $sel ]] || { echo "build.sh: FM_GPU_TARGETS names none of the programs" >&2; exit 2; }
    PROGRAMS=$sel
fi
# FM_GPU_ARCHS="90a": machine code for those only (a variant's build runs on
# Hopper alone, and half the size carries twice the variants in one call)
archs=${FM_GPU_ARCHS:-80;90a}
[[ $archs =~ ^[0-9]+a?(;[0-9]+a?)*$ ]] || { echo "build.sh: FM_GPU_ARCHS '$archs' is not a list like 80;90a" >&2; exit 2; }
targets=""
for p in $PROGRAMS; do targets="$targets ${p%%:*}"; done
# configured after the checks above, so that a bad FM_GPU_TARGETS or FM_GPU_ARCHS builds nothing
cmake -S . -B "$B" -DFM_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$archs" >/dev/null
# shellcheck disable=SC2086  # one word per target
cmake --build "$B" -j"$(nproc)" --target $targets
# the shared library, where the tree has its target
if grep -qsw fp4moe_shared "$B/Makefile" "$B/build.ninja"; then
    cmake --build "$B" -j"$(nproc)" --target fp4moe_shared
fi
D=${FM_GPU_OUT:-.devbuild}
rm -rf "$D/bin" "$D/lib"
mkdir -p "$D/bin" "$D/lib"
for p in $PROGRAMS; do cp "$B/${p#*:}" "$D/bin/"; done
# libfp4moe.so (and its versioned names) only where the build made it
find "$B" -name 'libfp4moe.so*' -not -path '*/CMakeFiles/*' -exec cp -L {} "$D/lib/" \;
for f in "$D"/bin/* "$D"/lib/libfp4moe.so*; do
    [ -e "$f" ] || continue
    ldd "$f" | awk '/=> \// {print $3}' | grep -E 'libjansson|libyajl|libcmocka|libcupti' || true
done | sort -u | while read -r lib; do cp -L "$lib" "$D/lib/"; done
strip --strip-unneeded "$D"/bin/* 2>/dev/null || true
ls "$D/bin" "$D/lib"
du -sh "$D/bin" "$D/lib"
