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
shopt -s nullglob # an empty lib/ adds nothing
for f in .devbuild/lib/*; do
    [[ -L $f || $f == *libfp4moe.so || $f == *libfp4moe.so.?.? ]] && continue
    files+=("lib/${f##*/}")
done
# PACK_EXTRA="base pf": the same programs of those other builds under
# .devbuild too (those they have)
for x in ${PACK_EXTRA:-}; do
    for p in $progs; do [[ -e .devbuild/$x/bin/$p ]] && files+=("$x/bin/$p"); done
done
# a GPU call carries at most 64 MiB in all (PACK_LIMIT_MIB): refuse here,
# where fewer builds can be packed, rather than fail at the call; the pack
# goes into place only when it fits, so a refused one leaves the last as it was
limit=${PACK_LIMIT_MIB:-64}
[[ $limit =~ ^[0-9]+$ ]] || { echo "pack: PACK_LIMIT_MIB '$limit' is not a whole number of MiB" >&2; exit 2; }
mkdir -p .carry
tmp=.carry/devbuild.tar.xz.part
trap 'rm -f "$tmp"' EXIT
tar -C .devbuild -cf - "${files[@]}" | xz -T0 -6 > "$tmp"
sz=$(stat -c %s "$tmp")
if ((sz > limit * 1024 * 1024)); then
    echo "pack: the pack is $((sz / 1048576)) MiB, more than the $limit MiB a GPU call carries; pack fewer builds (PACK_EXTRA)" >&2
    exit 3
fi
mv "$tmp" .carry/devbuild.tar.xz
ls -la .carry/devbuild.tar.xz
