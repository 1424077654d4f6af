#!/usr/bin/env bash
# `cmake --install` into a temporary prefix: the layout (library, header,
# package files, CLI, every shipped config byte for byte); then the prefix
# copied elsewhere and the first one deleted, and the relocated CLI naming the
# shipped file under the new prefix (also through a symlink to it); and the
# CLI copied alone into an empty directory finding the built-in copy. Neither
# may fall back to the defaults or read the source tree's configs/.
set -u
CLI="${FM_CLI:-}"
SRC="${FM_SOURCE_DIR:-}"
if [ -z "$CLI" ] || [ ! -x "$CLI" ]; then echo "SKIPPED: FM_CLI not set or not executable"; exit 77; fi
if [ -z "$SRC" ] || [ ! -d "$SRC/configs" ]; then echo "SKIPPED: FM_SOURCE_DIR not set"; exit 77; fi
B=$(dirname "$CLI")
cache() { sed -n "s/^$1:[A-Z]*=//p" "$B/CMakeCache.txt" 2>/dev/null | head -n 1; }
CMAKE=$(cache CMAKE_COMMAND)
[ -n "$CMAKE" ] || CMAKE=cmake
SHARED=$(cache FM_BUILD_SHARED) # ON unless the build left libfp4moe.so out
EMBED=$(cache FM_EMBED_CONFIGS) # ON unless the build left the built-in copies out
NAME=NVIDIA_H200-132sm-nvfp4-E256-H4096-I2048-k6.json # the deepseek-v4-flash shape
if [ ! -f "$SRC/configs/$NAME" ]; then echo "SKIPPED: configs/$NAME is not shipped"; exit 77; fi

T=$(mktemp -d /tmp/fm_sh_install.XXXXXX)
trap 'rm -rf "$T"' EXIT
T=$(cd -P "$T" && pwd) # /tmp may be a symlink; the library reports real paths
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
has() { grep -qF -- "$2" "$1" || fail "$3: expected '$2' in:"$'\n'"$(cat "$1")"; }
hasnt() { if grep -qF -- "$2" "$1"; then fail "$3: did not expect '$2' in:"$'\n'"$(cat "$1")"; fi; }

P1="$T/first/prefix"
if ! env -u DESTDIR "$CMAKE" --install "$B" --prefix "$P1" >"$T/install.log" 2>&1; then
    echo "FAIL: cmake --install: $(cat "$T/install.log")"
    exit 1
fi

# 1. Layout. The library directory is wherever the pkg-config file went
#    (lib, or lib/<multiarch> for a /usr prefix).
PC=$(find "$P1" -name fp4moe.pc -path '*/pkgconfig/*' | head -n 1)
[ -n "$PC" ] || fail "no fp4moe.pc installed"
LIB=$(dirname "$(dirname "${PC:-$P1/lib/pkgconfig/fp4moe.pc}")")
LIBREL=${LIB#"$P1"/}
VER=$(sed -n 's/^#define FM_VERSION "\(.*\)"$/\1/p' "$SRC/include/fp4moe.h")
for f in bin/fp4moe include/fp4moe.h "$LIBREL/libfp4moe.a" \
    "$LIBREL/cmake/fp4moe/fp4moeConfig.cmake" "$LIBREL/cmake/fp4moe/fp4moeConfigVersion.cmake"; do
    [ -e "$P1/$f" ] || fail "not installed: $f"
done
if [ "$SHARED" = OFF ]; then
    echo "note: FM_BUILD_SHARED=OFF: no shared library to check"
else
    for f in "$LIBREL/libfp4moe.so" "$LIBREL/libfp4moe.so.$VER"; do [ -e "$P1/$f" ] || fail "not installed: $f"; done
fi
[ -x "$P1/bin/fp4moe" ] || fail "bin/fp4moe is not executable"
cmp -s "$SRC/include/fp4moe.h" "$P1/include/fp4moe.h" || fail "include/fp4moe.h differs from the source's"
# the sections fp4moe.h includes: every one installed, byte for byte, and no other
nsec=0
for h in "$SRC"/include/fp4moe/*.h; do
    nsec=$((nsec + 1))
    cmp -s "$h" "$P1/include/fp4moe/${h##*/}" || fail "include/fp4moe/${h##*/} not installed or differs from the source's"
done
[ "$nsec" -gt 0 ] || fail "no section headers under $SRC/include/fp4moe"
ninst=$(find "$P1/include/fp4moe" -name '*.h' 2>/dev/null | wc -l)
[ "$ninst" -eq "$nsec" ] || fail "$ninst headers installed under include/fp4moe, $nsec in the source"
SONAME=$(readelf -d "$P1/$LIBREL/libfp4moe.so" 2>/dev/null | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
case "$VER" in
0.*) want_so="libfp4moe.so.${VER%.*}" ;;
*) want_so="libfp4moe.so.${VER%%.*}" ;;
esac
if [ "$SHARED" != OFF ] && command -v readelf >/dev/null; then
    [ "$SONAME" = "$want_so" ] || fail "SONAME '$SONAME', expected '$want_so'"
    [ -e "$P1/$LIBREL/$want_so" ] || fail "no $want_so link"
    readelf -d "$P1/$LIBREL/libfp4moe.so" | grep -q 'NEEDED.*libcudart\.so' && fail "libfp4moe.so needs libcudart.so"
    # cuBLAS is loaded at run time where the engine finds it, never linked
    readelf -d "$P1/$LIBREL/libfp4moe.so" | grep -q 'NEEDED.*libcublas' && fail "libfp4moe.so needs libcublas"
fi
n_src=0
for f in "$SRC"/configs/*.json; do
    n_src=$((n_src + 1))
    cmp -s "$f" "$P1/share/fp4moe/configs/$(basename "$f")" || fail "share/fp4moe/configs/$(basename "$f") missing or different"
done
n_inst=$(find "$P1/share/fp4moe/configs" -name '*.json' | wc -l)
[ "$n_inst" -eq "$n_src" ] || fail "$n_inst configs installed, $n_src shipped"

# 2. Relocated: copied to another directory (another depth), the first deleted.
P2="$T/elsewhere/deeper/prefix"
mkdir -p "$(dirname "$P2")"
cp -a "$P1" "$P2"
rm -rf "$T/first"
mkdir -p "$T/home" "$T/xdg"
clean() { env -u FP4MOE_CONFIG_DIR -u FP4MOE_SHIPPED_CONFIGS HOME="$T/home" XDG_CACHE_HOME="$T/xdg" "$@"; }
check_shipped() { # check_shipped OUT WHAT: the relocated prefix's file, nothing else
    has "$1" "3. shipped $P2/share/fp4moe/configs: found" "$2"
    has "$1" "config=$P2/share/fp4moe/configs/$NAME bucket=" "$2"
    hasnt "$1" "no tuned config" "$2"
    hasnt "$1" "WARNING" "$2"
    hasnt "$1" "$SRC/configs" "$2"
    hasnt "$1" "$B/" "$2"
}
(cd "$T" && clean "$P2/bin/fp4moe" explain --gpu "NVIDIA H200" --preset deepseek-v4-flash) >"$T/moved.out" 2>&1 ||
    fail "relocated explain exited $?: $(cat "$T/moved.out")"
check_shipped "$T/moved.out" "relocated"
mkdir -p "$T/links"
ln -s "$P2/bin/fp4moe" "$T/links/fp4moe"
(cd "$T" && clean "$T/links/fp4moe" explain --gpu "NVIDIA H200" --preset deepseek-v4-flash --batch 8) >"$T/link.out" 2>&1 ||
    fail "explain through a symlink exited $?: $(cat "$T/link.out")"
check_shipped "$T/link.out" "through a symlink"

# 3. The binary alone, no share/ beside it: the copy built into it.
if [ "$EMBED" = OFF ]; then
    echo "note: FM_EMBED_CONFIGS=OFF: the lone binary's check is left out"
    if [ $fails -ne 0 ]; then echo "$fails failure(s)"; exit 1; fi
    exit 0
fi
mkdir -p "$T/alone/bin"
cp "$P2/bin/fp4moe" "$T/alone/bin/fp4moe"
(cd "$T" && clean "$T/alone/bin/fp4moe" explain --gpu "NVIDIA H200" --preset deepseek-v4-flash) >"$T/alone.out" 2>&1 ||
    fail "lone binary's explain exited $?: $(cat "$T/alone.out")"
has "$T/alone.out" "3. shipped $T/alone/share/fp4moe/configs: no such file" "lone binary"
has "$T/alone.out" "4. built-in copies: found" "lone binary"
has "$T/alone.out" "config=built-in copy of configs/$NAME bucket=" "lone binary"
hasnt "$T/alone.out" "no tuned config" "lone binary"
hasnt "$T/alone.out" "WARNING" "lone binary"
hasnt "$T/alone.out" "$SRC/configs" "lone binary"
# $FP4MOE_SHIPPED_CONFIGS names the shipped set: the copy inside gives way.
mkdir -p "$T/empty"
(cd "$T" && clean env FP4MOE_SHIPPED_CONFIGS="$T/empty" "$T/alone/bin/fp4moe" explain --gpu "NVIDIA H200" \
    --preset deepseek-v4-flash --batch 4) >"$T/alone_env.out" 2>&1 || fail "lone binary with the override exited $?"
has "$T/alone_env.out" "3. shipped $T/empty: no such file" "override"
has "$T/alone_env.out" "4. built-in copies: not searched" "override"
has "$T/alone_env.out" "WARNING: no tuned config" "override"

if [ $fails -ne 0 ]; then echo "$fails failure(s)"; exit 1; fi
echo "OK: installed into a prefix, relocated, and copied alone: shipped configs found each time"
