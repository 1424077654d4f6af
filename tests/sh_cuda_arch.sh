#!/usr/bin/env bash
# The device code of a CUDA build, read back with cuobjdump: machine code for
# every real architecture the build lists (by default sm_80, sm_90a, sm_100,
# sm_120) in every CUDA translation unit, PTX for every virtual one
# (compute_100 by default, for later GPUs), and the wgmma kernels' code only
# in sm_90a: every other architecture's copy of them, PTX included, is the
# empty body that the host never launches. Skips (visibly) without a CUDA
# build or without cuobjdump.
set -u
if [ "${FM_HAVE_CUDA:-0}" != 1 ]; then echo "SKIPPED: not a CUDA build"; exit 77; fi
BIN="${FM_DEVICE_BINARY:-}"
ARCHS="${FM_CUDA_ARCHS:-}"
if [ -z "$BIN" ] || [ ! -f "$BIN" ] || [ -z "$ARCHS" ]; then
    echo "FAIL: FM_DEVICE_BINARY or FM_CUDA_ARCHS not set by the build"
    exit 1
fi
# cuobjdump: beside nvcc, on PATH, or from the nvidia-cuda-cuobjdump wheel
# (scripts/deps.sh installs it where the toolkit lacks one)
CUOBJDUMP=""
for c in "${FM_CUDA_BIN_DIR:-}/cuobjdump" "$(command -v cuobjdump 2>/dev/null)"; do
    if [ -n "$c" ] && [ -x "$c" ]; then CUOBJDUMP=$c; break; fi
done
if [ -z "$CUOBJDUMP" ] && command -v python3 >/dev/null 2>&1; then
    CUOBJDUMP=$(python3 -c 'import glob, sysconfig
for p in sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}):
    for c in sorted(glob.glob(p + "/nvidia/cu*/bin/cuobjdump")):
        print(c)' 2>/dev/null | tail -n 1)
fi
if [ -z "$CUOBJDUMP" ] || [ ! -x "$CUOBJDUMP" ]; then
    echo "SKIPPED: no cuobjdump (not beside nvcc in ${FM_CUDA_BIN_DIR:-?}, not on PATH, no nvidia-cuda-cuobjdump wheel)"
    exit 77
fi
echo "cuobjdump: $CUOBJDUMP; binary: $BIN; architectures: $ARCHS"

T=$(mktemp -d /tmp/fm_sh_arch.XXXXXX)
trap 'rm -rf "$T"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

"$CUOBJDUMP" -lelf "$BIN" >"$T/elf.txt" 2>&1 || fail "cuobjdump -lelf: $(cat "$T/elf.txt")"
"$CUOBJDUMP" -lptx "$BIN" >"$T/ptx.txt" 2>&1 || fail "cuobjdump -lptx: $(cat "$T/ptx.txt")"
# "ELF file    3: expert_mma.sm_100.cubin" -> "expert_mma sm_100"
sed -n 's/^ELF file *[0-9]*: \(.*\)\.\(sm_[0-9a-z]*\)\.cubin$/\1 \2/p' "$T/elf.txt" | sort -u >"$T/elf"
sed -n 's/^PTX file *[0-9]*: \(.*\)\.\(sm_[0-9a-z]*\)\.ptx$/\1 \2/p' "$T/ptx.txt" | sort -u >"$T/ptx"
cut -d' ' -f1 "$T/elf" "$T/ptx" | sort -u >"$T/units"
grep -qx expert_mma "$T/units" || fail "no device code of expert_mma.cu in $BIN:"$'\n'"$(cat "$T/elf.txt")"
grep -qx expert_wgmma "$T/units" || fail "no device code of expert_wgmma.cu in $BIN"

# Each listed architecture: "80" is machine code and PTX, "80-real" machine
# code only, "80-virtual" PTX only; every translation unit has each.
reals="" virts=""
for a in ${ARCHS//,/ }; do
    n=${a%-real}
    n=${n%-virtual}
    case "$n" in
        *[!0-9a-z]* | "") echo "note: architecture '$a' is not a number: its code is not checked"; continue ;;
    esac
    [ "$a" != "$n-virtual" ] && reals="$reals sm_$n"
    [ "$a" != "$n-real" ] && virts="$virts sm_$n"
done
for kind in elf ptx; do
    [ $kind = elf ] && want=$reals || want=$virts
    for s in $want; do
        while read -r u; do
            grep -qx "$u $s" "$T/$kind" || fail "$u: no $kind for $s (listed: $ARCHS)"
        done <"$T/units"
    done
    # nothing beyond the list
    cut -d' ' -f2 "$T/$kind" | sort -u | while read -r s; do
        case " $want " in *" $s "*) ;; *) echo "FAIL: $kind for $s, which the build does not list ($ARCHS)" ;; esac
    done >>"$T/extra"
done
if [ -s "$T/extra" ]; then cat "$T/extra"; fails=$((fails + $(wc -l <"$T/extra"))); fi

# PTX: wgmma instructions only in sm_90a's (a JIT target must never get them).
(cd "$T" && "$CUOBJDUMP" -xptx all "$BIN" >/dev/null 2>&1) || fail "cuobjdump -xptx failed"
for f in "$T"/*.ptx; do
    [ -e "$f" ] || continue
    case "$f" in *.sm_90a.ptx) continue ;; esac
    grep -q 'wgmma\.mma_async' "$f" && fail "$(basename "$f"): wgmma instructions outside sm_90a"
done

# Machine code: the wgmma kernels' text is real only in sm_90a; elsewhere
# each is the empty body (a few instructions). Read from the cubins' section
# sizes, and from the disassembly (HGMMA) where nvdisasm is at hand.
if command -v readelf >/dev/null 2>&1; then
    (cd "$T" && "$CUOBJDUMP" -xelf all "$BIN" >/dev/null 2>&1) || fail "cuobjdump -xelf failed"
    for s in $reals; do
        f="$T/expert_wgmma.$s.cubin"
        [ -f "$f" ] || { fail "expert_wgmma.$s.cubin not extracted"; continue; }
        # the largest .text section of a wgmma kernel, in bytes
        max=0
        while read -r name _ _ _ size _; do
            case "$name" in .text.*fm_expert_wg_kernel*) [ $((16#$size)) -gt "$max" ] && max=$((16#$size)) ;; esac
        done < <(readelf -SW "$f" 2>/dev/null | sed -n 's/^ *\[ *[0-9]*\] *//p')
        if [ "$s" = sm_90a ]; then
            [ "$max" -gt 8192 ] || fail "sm_90a: the wgmma kernels' largest text is $max bytes: no wgmma code"
        else
            [ "$max" -gt 0 ] || fail "$s: no wgmma kernel symbols (the host's launch table needs them)"
            [ "$max" -le 1024 ] || fail "$s: a wgmma kernel has $max bytes of code; only sm_90a may"
        fi
        echo "$s: largest wgmma kernel text $max bytes"
    done
else
    echo "note: no readelf: the wgmma kernels' machine code is not checked"
fi
NVDISASM="$(dirname "$CUOBJDUMP")/nvdisasm"
[ -x "$NVDISASM" ] || NVDISASM=$(command -v nvdisasm 2>/dev/null)
if [ -n "$NVDISASM" ] && [ -x "$NVDISASM" ]; then
    for s in $reals; do
        n=$(NVDISASM_PATH=$(dirname "$NVDISASM") "$CUOBJDUMP" -sass -arch "$s" "$BIN" 2>/dev/null | grep -c HGMMA)
        if [ "$s" = sm_90a ]; then [ "$n" -gt 0 ] || fail "sm_90a: no HGMMA instruction"
        else [ "$n" -eq 0 ] || fail "$s: $n HGMMA instructions"; fi
    done
fi

if [ $fails -ne 0 ]; then echo "$fails failure(s)"; exit 1; fi
echo "OK: machine code for$reals, PTX for${virts:- none}; wgmma code only in sm_90a"
