#!/usr/bin/env bash
# cuda_topk's arguments: each bad one is refused with exit 2 and a message
# naming it, before any GPU is touched (so this runs on machines without one).
# Skipped where the CUDA backend is not built (FM_CUDA off or no nvcc).
set -u
CUDA_TOOL=cuda_topk
. "$(dirname "$0")/tool_args.inc.sh"

bad "bad argument '--foo'" --foo
bad "bad argument '--preset'" --preset
bad "bad argument '--preset'" --preset glm5
bad "bad argument '--preset'" --preset ""
bad "bad argument '--preset'" --preset qwen3-235b-a22b
bad "bad argument '--reps'" --reps
bad "bad argument '--reps'" --reps 1001
bad "bad argument '--reps'" --reps 0
bad "bad argument '--reps'" --reps -3
bad "bad argument 'extra'" --reps 2 extra
bad "bad argument 'extra'" --preset all extra

finish cuda_topk
