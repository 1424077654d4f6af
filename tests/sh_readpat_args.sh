#!/usr/bin/env bash
# cuda_readpat's arguments: each bad one is refused with exit 2 and a message
# naming it, before any GPU is touched (so this runs on machines without one),
# and --json is not left behind. Skipped where the CUDA backend is not built
# (FM_CUDA off or no nvcc).
set -u
CUDA_TOOL=cuda_readpat
. "$(dirname "$0")/tool_args.inc.sh"
LEFT="$T/out.json"
ARGS_PRE="--json $LEFT"

bad "unknown argument '--foo'" --foo 1
bad "no value for '--occ'" --reps 3 --occ
bad "--nseg needs a positive integer, got 'x'" --nseg x
bad "--experts needs a positive integer, got '0'" --experts 0
bad "--layers needs a positive integer, got '-3'" --layers -3
bad "--scales takes sep or inter, not 'foo'" --scales foo
bad "--mats is 1 or 2 and --nrg a multiple of 4" --mats 3
bad "--mats is 1 or 2 and --nrg a multiple of 4" --nrg 126
bad "--occ 40: at most 32 blocks per SM" --occ 40
bad "is more than 256 GiB" --experts 100000 --layers 1000

finish cuda_readpat
