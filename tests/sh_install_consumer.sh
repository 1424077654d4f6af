#!/usr/bin/env bash
# Programs built against an installed fp4moe, as a user builds them:
# tests/data/install/consumer.c through pkg-config (the shared library, and
# `--static` the static one) and through find_package(fp4moe) (both imported
# targets). Each run prints a preset's shape and expert bytes, checked against
# the shipped config's file name and 3*H*I*(1/2 + 1/16) bytes (NVFP4: 4-bit
# values, an FP8 scale per 16), and the tuned config chosen on an H200:
# the installed file for the shared library (found from the library's own
# path), the built-in copy for a static program that sits away from the
# install; its parameters against the JSON file read by Python.
set -u
CLI="${FM_CLI:-}"
SRC="${FM_SOURCE_DIR:-}"
DATA="${FM_TEST_DATA:-}/install"
if [ -z "$CLI" ] || [ ! -x "$CLI" ]; then echo "SKIPPED: FM_CLI not set or not executable"; exit 77; fi
if [ ! -f "$DATA/consumer.c" ] || [ -z "$SRC" ]; then echo "SKIPPED: test data missing"; exit 77; fi
if ! command -v pkg-config >/dev/null; then echo "SKIPPED: pkg-config not found"; exit 77; fi
B=$(dirname "$CLI")
cache() { sed -n "s/^$1:[A-Z]*=//p" "$B/CMakeCache.txt" 2>/dev/null | head -n 1; }
CMAKE=$(cache CMAKE_COMMAND)
[ -n "$CMAKE" ] || CMAKE=cmake
CC=$(cache CMAKE_C_COMPILER)
[ -n "$CC" ] || CC=cc
# A library built with sanitizers needs their runtime in the program too.
SAN=""
if [ "$(cache FM_SANITIZE)" = ON ]; then SAN="-fsanitize=address,undefined -fno-omit-frame-pointer"; fi
if [ "$(cache FM_BUILD_SHARED)" = OFF ] || [ "$(cache FM_EMBED_CONFIGS)" = OFF ]; then
    echo "SKIPPED: built with FM_BUILD_SHARED=OFF or FM_EMBED_CONFIGS=OFF"
    exit 77
fi
NAME=NVIDIA_H200-132sm-nvfp4-E256-H4096-I2048-k6.json
if [ ! -f "$SRC/configs/$NAME" ]; then echo "SKIPPED: configs/$NAME is not shipped"; exit 77; fi

T=$(mktemp -d /tmp/fm_sh_consumer.XXXXXX)
trap 'rm -rf "$T"' EXIT
T=$(cd -P "$T" && pwd)
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
P="$T/prefix"
if ! env -u DESTDIR "$CMAKE" --install "$B" --prefix "$P" >"$T/install.log" 2>&1; then
    echo "FAIL: cmake --install: $(cat "$T/install.log")"
    exit 1
fi
PC=$(find "$P" -name fp4moe.pc -path '*/pkgconfig/*' | head -n 1)
if [ -z "$PC" ]; then echo "FAIL: no fp4moe.pc installed"; exit 1; fi
LIB=$(dirname "$(dirname "$PC")")
CFG="$P/share/fp4moe/configs/$NAME"
mkdir -p "$T/home" "$T/xdg"
clean() { env -u FP4MOE_CONFIG_DIR -u FP4MOE_SHIPPED_CONFIGS HOME="$T/home" XDG_CACHE_HOME="$T/xdg" "$@"; }

val() { sed -n "s/^$2=//p" "$1"; }
# check OUT WHAT WANT-SOURCE
check() {
    local out=$1 what=$2 want=$3
    local shape bytes src
    shape=$(val "$out" shape)
    bytes=$(val "$out" expert_bytes)
    src=$(val "$out" source)
    # E256-H4096-I2048-k6: from the shipped file's name
    local want_shape=${NAME#*-nvfp4-}
    want_shape=${want_shape%.json}
    [ "$shape" = "$want_shape" ] || fail "$what: shape '$shape', expected '$want_shape'"
    local h i
    h=$(echo "$want_shape" | sed 's/.*-H\([0-9]*\)-.*/\1/')
    i=$(echo "$want_shape" | sed 's/.*-I\([0-9]*\)-.*/\1/')
    [ "$bytes" = $((3 * (h * i / 2 + h * i / 16))) ] || fail "$what: expert bytes '$bytes', expected $((3 * (h * i / 2 + h * i / 16)))"
    [ "$(val "$out" tuned)" = 1 ] || fail "$what: not tuned: $(cat "$out")"
    [ "$src" = "$want" ] || fail "$what: source '$src', expected '$want'"
    [ "$(val "$out" version)" = "$VER" ] || fail "$what: version '$(val "$out" version)', expected $VER"
    case "$(val "$out" cuda)" in 0 | 1) ;; *) fail "$what: no cuda=0|1 line" ;; esac
    if command -v python3 >/dev/null; then
        python3 - "$CFG" "$(val "$out" bucket)" "$(val "$out" params)" <<'EOF' || fail "$what: parameters differ from the file's"
import json, sys
f, bucket, got = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
b = [x for x in json.load(open(f))["buckets"] if x["batch"] == bucket]
if len(b) != 1:
    sys.exit("bucket %d not in %s" % (bucket, f))
p = b[0]["params"]
want = [p[k] for k in ("rows_per_block", "k_split", "warps", "stages", "tile_n")]
if [int(v) for v in got[:5]] != want or abs(float(got[5]) - p["switch_tpe"]) > 1e-5 * max(1.0, p["switch_tpe"]):
    sys.exit("got %s, file has %s switch_tpe=%s" % (got, want, p["switch_tpe"]))
EOF
    fi
}
# run_consumer TAG PROGRAM WHAT WANT-SOURCE [WANT-MODULE]: the program run
# from $T in the clean environment, its output checked
run_consumer() {
    local tag=$1 prog=$2 what=$3 want=$4 mod=${5:-}
    (cd "$T" && clean "$prog" deepseek-v4-flash 4) >"$T/$tag.out" 2>"$T/$tag.err" ||
        fail "$what: run failed: $(cat "$T/$tag.err")"
    check "$T/$tag.out" "$what" "$want"
    if [ -n "$mod" ] && [ "$(val "$T/$tag.out" module)" != "$mod" ]; then
        fail "$what: module '$(val "$T/$tag.out" module)', expected $mod"
    fi
}
VER=$(sed -n 's/^#define FM_VERSION "\(.*\)"$/\1/p' "$P/include/fp4moe.h")

# 1. pkg-config, the shared library (found at run time through its rpath)
export PKG_CONFIG_PATH="$LIB/pkgconfig"
unset PKG_CONFIG_LIBDIR PKG_CONFIG_SYSROOT_DIR
[ "$(pkg-config --modversion fp4moe)" = "$VER" ] || fail "pkg-config --modversion: $(pkg-config --modversion fp4moe 2>&1)"
mkdir -p "$T/pc"
# shellcheck disable=SC2046,SC2086
if $CC $SAN -o "$T/pc/consumer_shared" "$DATA/consumer.c" $(pkg-config --cflags --libs fp4moe) -Wl,-rpath,"$LIB" \
    >"$T/cc1.log" 2>&1; then
    if readelf -d "$T/pc/consumer_shared" 2>/dev/null | grep -q 'NEEDED.*libfp4moe\.so'; then :; else
        fail "pkg-config shared: the program does not need libfp4moe.so"
    fi
    run_consumer pc_shared "$T/pc/consumer_shared" "pkg-config shared" "$CFG" "$LIB/libfp4moe.so.$VER"
else
    fail "pkg-config shared: compile failed: $(cat "$T/cc1.log")"
fi

# 2. pkg-config --static, the static library (-l: picks the archive by name)
# shellcheck disable=SC2046,SC2086
if $CC $SAN -o "$T/pc/consumer_static" "$DATA/consumer.c" $(pkg-config --cflags fp4moe) \
    $(pkg-config --static --libs fp4moe | sed 's/-lfp4moe\b/-l:libfp4moe.a/') >"$T/cc2.log" 2>&1; then
    if readelf -d "$T/pc/consumer_static" 2>/dev/null | grep -q 'NEEDED.*libfp4moe'; then
        fail "pkg-config static: the program needs a shared libfp4moe"
    fi
    run_consumer pc_static "$T/pc/consumer_static" "pkg-config static" "built-in copy of configs/$NAME" \
        "$T/pc/consumer_static"
else
    fail "pkg-config static: compile failed: $(cat "$T/cc2.log")"
fi

# 3. find_package(fp4moe), both imported targets
if "$CMAKE" -S "$DATA" -B "$T/cm" -DCMAKE_PREFIX_PATH="$P" -DCMAKE_C_COMPILER="$CC" -DFM_WANT_VERSION="$VER" \
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS="$SAN" -DCMAKE_EXE_LINKER_FLAGS="$SAN" >"$T/cm.log" 2>&1 &&
    "$CMAKE" --build "$T/cm" >>"$T/cm.log" 2>&1; then
    run_consumer cm_shared "$T/cm/consumer_shared" "find_package shared" "$CFG"
    run_consumer cm_static "$T/cm/consumer_static" "find_package static" "built-in copy of configs/$NAME"
else
    fail "find_package consumer did not build: $(cat "$T/cm.log")"
fi

if [ $fails -ne 0 ]; then echo "$fails failure(s)"; exit 1; fi
echo "OK: pkg-config (shared, static) and find_package (shared, static) consumers built and checked"
