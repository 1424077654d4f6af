#!/usr/bin/env bash
# cpu_ab's arguments: each bad one is refused with exit 2 and a message
# naming it, before any layer is built, and nothing goes to stdout.
set -u
BIN="${FM_TOOLS_DIR:-}/cpu_ab"
if [ ! -x "$BIN" ]; then echo "SKIPPED: cpu_ab not built"; exit 77; fi

T=$(mktemp -d /tmp/fm_sh_cpu_ab.XXXXXX)
trap 'rm -rf "$T"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

bad() { # bad 'expected message' ARGS...
    local want=$1; shift
    timeout 20 "$BIN" "$@" >"$T/out" 2>"$T/err"
    local rc=$?
    [ "$rc" = 2 ] || fail "$*: exit $rc, expected 2"
    grep -qF -- "$want" "$T/err" || fail "$*: expected '$want' on stderr, got: $(cat "$T/err")"
    [ ! -s "$T/out" ] || fail "$*: wrote to stdout: $(cat "$T/out")"
}

bad "unknown or incomplete argument '--foo'" --foo 1
bad "unknown or incomplete argument '--preset'" --preset
bad "--threads needs an integer in [1, 1024]" --threads 0
bad "--rounds needs an integer in [1, 64]" --rounds 65
bad "--time-ms needs an integer in [1, 600000]" --time-ms x
bad "--isa needs two flavours, A,B" --isa avx2
bad "--isa: unknown flavour in 'avx2,neon'" --isa avx2,neon
bad "--batch needs an integer in [1, 4096]" --batch 1,x
bad "--batch is empty" --batch ,
bad "--batch lists more than 16 batch sizes" --batch 1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17
bad "unknown or incomplete argument '--env-b'" --env-b NOEQUALS
bad "unknown or incomplete argument '--env-b'" --env-b =1
bad "nosuch" --preset nosuch

if [ "$fails" -gt 0 ]; then echo "$fails failure(s)"; exit 1; fi
echo "cpu_ab argument checks: all passed"
