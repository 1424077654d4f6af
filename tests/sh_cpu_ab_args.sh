#!/usr/bin/env bash
# cpu_ab's arguments: each bad one is refused with exit 2 and a message
# naming it, before any layer is built, and nothing goes to stdout.
set -u
BIN="${FM_DEV_TOOLS_DIR:-}/cpu_ab"
if [ ! -x "$BIN" ]; then echo "FAIL: $BIN not built (run through ctest after a full build)"; exit 1; fi
. "$(dirname "$0")/tool_args.inc.sh"

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

finish cpu_ab
