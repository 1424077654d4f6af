#!/usr/bin/env bash
# cuda_chain's arguments: each bad one is refused with exit 2 and a message
# naming it, before any GPU is touched (so this runs on machines without one).
# Skipped where the CUDA backend is not built (FM_CUDA off or no nvcc).
set -u
CUDA_TOOL=cuda_chain
. "$(dirname "$0")/tool_args.inc.sh"

bad "bad argument '--foo'" --foo
bad "bad argument '--preset'" --preset
bad "bad argument '--preset'" --preset glm5
bad "bad argument '--preset'" --preset ""
bad "bad argument '--layers'" --layers 0
bad "bad argument '--layers'" --layers 65
bad "bad argument '--layers'" --layers 8x
bad "bad argument '--reps'" --reps
bad "bad argument '--reps'" --reps 1001
bad "bad argument 'extra'" --reps 2 extra
bad "bad argument 'extra'" --preset all extra
bad "bad argument '--blocks-per-sm'" --blocks-per-sm 0
bad "bad argument '--blocks-per-sm'" --blocks-per-sm 3
bad "bad argument '--blocks-per-sm'" --blocks-per-sm
bad "bad argument '--batch'" --batch 0
bad "bad argument '--batch'" --batch 513
bad "bad argument '--batch'" --batch 4k
bad "bad argument '--batch'" --batch

finish cuda_chain
