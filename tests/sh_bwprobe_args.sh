#!/usr/bin/env bash
# cuda_bwprobe's arguments: each bad one is refused with exit 2 and a message
# naming it, before any GPU is touched (so this runs on machines without one).
# Skipped where the CUDA backend is not built (FM_CUDA off or no nvcc).
set -u
CUDA_TOOL=cuda_bwprobe
. "$(dirname "$0")/tool_args.inc.sh"

bad "bad argument '--foo'" --foo 1
bad "bad argument '--mib'" --mib
bad "bad argument '--mib'" --mib 3
bad "bad argument '--mib'" --mib x
bad "bad argument '--reps'" --reps 0
bad "bad argument '--reps'" --reps 1001
bad "bad argument '--reps'" --reps 5x

finish cuda_bwprobe
