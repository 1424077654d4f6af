#!/usr/bin/env bash
# Packs, on the development machine, the GPU binaries that dev/gpu/build.sh
# made into one xz archive under .carry/ (git-ignored; name it in the GPU
# call's carry list): the binaries are ~18 MB each, too large to travel
# unpacked. PACK_EXTRA="base ..." adds the same programs of .devbuild/base/bin,
# ... (other builds for an A/B).
# On the GPU machine `bash dev/gpu/pack.sh unpack` restores .devbuild.
#   bash dev/gpu/pack.sh [fp4moe test_cuda ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ ${1:-} == unpack ]]; then
    mkdir -p .devbuild
    tar -C .devbuild -xJf .carry/devbuild.tar.xz
    (cd .devbuild/lib && for f in libfp4moe.so.*.*.*; do [ -e "$f" ] && ln -sf "$f" libfp4moe.so && ln -sf "$f" "${f%.*}"; done; true)
    exit 0
fi
progs=${*:-fp4moe test_cuda test_tensors test_cuda_repack cuda_smoke}
files=()
for p in $progs; do files+=("bin/$p"); done
for f in .devbuild/lib/*; do
    [[ -L $f || $f == *libfp4moe.so || $f == *libfp4moe.so.?.? ]] && continue
    files+=("lib/${f##*/}")
done
# PACK_EXTRA="base pf": the same programs of those other builds under
# .devbuild too (those they have)
for x in ${PACK_EXTRA:-}; do
    for p in $progs; do [[ -e .devbuild/$x/bin/$p ]] && files+=("$x/bin/$p"); done
done
mkdir -p .carry
tar -C .devbuild -cf - "${files[@]}" | xz -T0 -6 > .carry/devbuild.tar.xz
ls -la .carry/devbuild.tar.xz
# a GPU call carries at most 64 MiB in all: refuse here, where fewer builds
# can be packed, rather than fail at the call
sz=$(stat -c %s .carry/devbuild.tar.xz)
if ((sz > 64 * 1024 * 1024)); then
    echo "pack: .carry/devbuild.tar.xz is $((sz / 1048576)) MiB, more than the 64 MiB a GPU call carries; pack fewer builds (PACK_EXTRA)" >&2
    exit 3
fi
