#!/usr/bin/env bash
# Kernel variants kept as development patches (dev/gpu/patches), tested and
# A/B'd against the current tree in one GPU call.
#
# On the development machine (nvcc):
#   bash dev/gpu/variants.sh build NAME=PATCH[+PATCH...] ...
# builds the current tree (dev/gpu/build.sh, into .devbuild) and each variant
# into .devbuild/NAME: HEAD with the tree's uncommitted changes to tracked
# files and the variant's patches applied, in one scratch worktree
# (.devbuild/wt, built in .devbuild/build-wt) reused from variant to variant,
# so that only what a patch touches compiles again (sm_90a only: the variants
# run on Hopper); then packs fp4moe, test_cuda and cuda_topk of every build
# (a variant of the top-k shows there alone) and the tree's cuda_icache and
# cuda_chain (dev/gpu/pack.sh: .carry/devbuild.tar.xz, to carry).
# PATCH: a file of dev/gpu/patches, with or without .patch, or a path.
#
# On the GPU machine (a checkout of the same tree, .carry carried):
#   bash dev/gpu/variants.sh run NAME ...
# unpacks, runs cuda_icache (the cost of cold code) and every build's
# cuda_topk (one token's top-k alone), a short bench of each
# variant on the first case (one that fails or hangs within VAR_SMOKE_S s,
# default 40, leaves the A/B and the summary says so), then dev/gpu/ab.sh with
# the current build ("cur") first, then test_cuda of every build, one after
# another (VAR_TEST_TIMEOUT_S each, default 300; VAR_TESTS="cur a ..." names
# the builds whose test_cuda runs, default all, "none" none; VAR_TEST_JOBS
# of them at once, default 1); VAR_PRESET, VAR_BATCH,
# VAR_ROUNDS and VAR_DEADLINE_S go to it as AB_PRESET, AB_BATCH, AB_ROUNDS and
# AB_DEADLINE_S (defaults: the TP8 ranks of GLM-5, DeepSeek-V4-Flash and
# Kimi-K2, GLM-5's EP8 rank 0, the whole DeepSeek-V4-Flash layer; B = 1, 2, 4,
# 8, 16, 64, 256; 2 rounds; no deadline); VAR_ACT=bf16 or f16 gives every
# build's bench activations of that type (default FP32). Where the GPU is not
# an H200, the H200's shipped configs are copied under this GPU's name into
# FP4MOE_CONFIG_DIR (as the A/Bs on H100s have done), and the summary says
# so. The summary is printed last ($OUT/variants.txt).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
die() { echo "variants: $*" >&2; exit 2; }
name_ok() { [[ $1 =~ ^[A-Za-z0-9_-]+$ && $1 != cur && $1 != bin && $1 != lib && $1 != wt && $1 != build* ]]; }
patch_of() {
    local p=$1
    for c in "$p" "dev/gpu/patches/$p" "dev/gpu/patches/$p.patch"; do
        [[ -f $c ]] && { echo "$c"; return 0; }
    done
    return 1
}

cmd=${1:-}
[[ $cmd == build || $cmd == run ]] || die "usage: variants.sh build NAME=PATCH[+PATCH...] ... | run NAME ..."
shift
(($#)) || die "$cmd: no variant named"

if [[ $cmd == build ]]; then
    names=() specs=()
    for s in "$@"; do
        [[ $s == *=* ]] || die "'$s' is not NAME=PATCH[+PATCH...]"
        n=${s%%=*}
        name_ok "$n" || die "'$n' is not a variant name (letters, digits, _ and -; not cur, bin, lib, wt, build*)"
        IFS=+ read -r -a ps <<< "${s#*=}"
        ((${#ps[@]})) || die "variant '$n' names no patch"
        for p in "${ps[@]}"; do patch_of "$p" >/dev/null || die "variant '$n': no patch '$p'"; done
        names+=("$n") specs+=("${s#*=}")
    done
    bash dev/gpu/build.sh || die "the current tree's build failed"
    WT=$ROOT/.devbuild/wt
    head=$(git rev-parse HEAD) || die "not a git checkout"
    if [[ ! -d $WT ]]; then git worktree add -q --detach "$WT" "$head" || die "cannot add the worktree $WT"; fi
    git diff HEAD > "$ROOT/.devbuild/uncommitted.diff"
    for i in "${!names[@]}"; do
        n=${names[$i]}
        git -C "$WT" checkout -q -f --detach "$head" && git -C "$WT" reset -q --hard "$head" || die "cannot reset $WT"
        if [[ -s $ROOT/.devbuild/uncommitted.diff ]]; then
            git -C "$WT" apply "$ROOT/.devbuild/uncommitted.diff" || die "the tree's uncommitted changes do not apply in $WT"
        fi
        IFS=+ read -r -a ps <<< "${specs[$i]}"
        for p in "${ps[@]}"; do
            f=$(patch_of "$p")
            [[ $f == /* ]] || f=$ROOT/$f
            # a three-way merge where two patches touch neighbouring lines
            # (against the tree so far, staged)
            git -C "$WT" apply "$f" 2>/dev/null || { git -C "$WT" add -A && git -C "$WT" apply --3way "$f"; } ||
                die "variant '$n': $f does not apply"
        done
        (cd "$WT" && FM_GPU_TARGETS="fp4moe_cli test_cuda cuda_topk" FM_GPU_ARCHS=90a FM_GPU_BUILD_DIR="$ROOT/.devbuild/build-wt" \
            FM_GPU_OUT="$ROOT/.devbuild/$n" bash dev/gpu/build.sh) || die "variant '$n': build failed"
    done
    PACK_EXTRA="${names[*]}" bash dev/gpu/pack.sh fp4moe test_cuda cuda_icache cuda_chain cuda_topk || die "packing failed"
    echo "variants: built cur ${names[*]}; carry .carry and run: bash dev/gpu/variants.sh run ${names[*]}"
    exit 0
fi

# run
tt=${VAR_TEST_TIMEOUT_S:-300}
[[ $tt =~ ^[1-9][0-9]*$ ]] || die "VAR_TEST_TIMEOUT_S '$tt' is not whole seconds"
tests=${VAR_TESTS:-cur $*}
[[ $tests == none ]] && tests=
for n in $tests; do
    [[ $n == cur || " $* " == *" $n "* ]] || die "VAR_TESTS names '$n', not cur or a variant of this run"
done
jobs=${VAR_TEST_JOBS:-1}
[[ $jobs =~ ^[1-9][0-9]*$ ]] || die "VAR_TEST_JOBS '$jobs' is not a whole number of builds"
smoke_s=${VAR_SMOKE_S:-40}
[[ $smoke_s =~ ^[1-9][0-9]*$ ]] || die "VAR_SMOKE_S '$smoke_s' is not whole seconds"
# checked here too, so that a bad deadline stops the call before any work
[[ -z ${VAR_DEADLINE_S:-} || $VAR_DEADLINE_S =~ ^[0-9]+$ ]] || die "VAR_DEADLINE_S '$VAR_DEADLINE_S' is not whole seconds"
[[ -z ${VAR_ACT:-} || $VAR_ACT =~ ^(f32|bf16|f16)$ ]] || die "VAR_ACT '$VAR_ACT' is not f32, bf16 or f16"
for n in "$@"; do name_ok "$n" || die "'$n' is not a variant name"; done
[[ -f .carry/devbuild.tar.xz ]] || die "no .carry/devbuild.tar.xz (variants.sh build, then carry .carry)"
carried=$(tar -tJf .carry/devbuild.tar.xz) || die "cannot read .carry/devbuild.tar.xz"
for n in "$@"; do
    grep -qx "\(\./\)\?$n/bin/fp4moe" <<< "$carried" || die "no $n/bin/fp4moe in the carried builds"
done
bash dev/gpu/pack.sh unpack || die "cannot unpack .carry/devbuild.tar.xz"
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
S=$OUT/variants.txt
export LD_LIBRARY_PATH=$ROOT/.devbuild/lib:${LD_LIBRARY_PATH:-} FP4MOE_SHIPPED_CONFIGS=$ROOT/configs
. dev/gpu/cublas_path.sh
. dev/gpu/relabel.sh
echo "GPU: ${gpu:-unknown}" > "$S"
[[ -z $RELABELLED ]] || echo "$RELABELLED" >> "$S"
# the cost of cold code first (a few seconds; dev/tools/cuda_icache.cu)
if [[ -x .devbuild/bin/cuda_icache ]]; then
    timeout 120 .devbuild/bin/cuda_icache > "$OUT/icache.txt" 2>&1
    { echo "cuda_icache (exit $?):"; cat "$OUT/icache.txt"; } >> "$S"
fi
# one token's top-k alone, as each build's code runs it (dev/tools/cuda_topk.cu)
for n in cur "$@"; do
    d=.devbuild/bin
    [[ $n == cur ]] || d=.devbuild/$n/bin
    [[ -x $d/cuda_topk ]] || continue
    timeout 120 "$d/cuda_topk" > "$OUT/topk_$n.txt" 2>&1
    { echo "cuda_topk [$n] (exit $?):"; cat "$OUT/topk_$n.txt"; } >> "$S"
done
# VAR_ACT=bf16 (or f16): every build's bench activations of that type
act=${VAR_ACT:+,FM_AB_ACT=$VAR_ACT}
v="cur:${act#,}"
cases=${VAR_PRESET:-"glm-5@tp:8 deepseek-v4-flash@tp:8 kimi-k2@tp:8 glm-5@ep:8/0 deepseek-v4-flash"}
batches=${VAR_BATCH:-1,2,4,8,16,64,256}
# a short bench of each variant first, the A/B's first case at its batch
# sizes over 2 layers: one that fails or hangs (a grid-wide wait that never
# ends) leaves the A/B, where each of its runs would cost ab.sh's 200 s
# timeout
c0=${cases%% *}
smoke_case=(--preset "${c0%%@*}")
[[ $c0 == *@* ]] && smoke_case+=(--shard "${c0#*@}")
for n in "$@"; do
    timeout "$smoke_s" ".devbuild/$n/bin/fp4moe" bench --device cuda "${smoke_case[@]}" \
        --batch "$batches" --layers 2 ${VAR_ACT:+--act $VAR_ACT} > "$OUT/smoke_$n.txt" 2>&1
    rc=$?
    if ((rc)); then
        echo "smoke [$n] exit $rc: left out of the A/B ($(tail -n 2 "$OUT/smoke_$n.txt" | tr '\n' ' '))" >> "$S"
    else
        v="$v $n:FM_AB_BIN=.devbuild/$n/bin$act"
    fi
done
OUT=$OUT AB_VARIANTS=$v AB_ROUNDS=${VAR_ROUNDS:-2} AB_BATCH=$batches AB_PRESET=$cases \
    AB_DEADLINE_S=${VAR_DEADLINE_S:-} bash dev/gpu/ab.sh > "$OUT/variants_ab.log" 2>&1
sed -n '/^== /,$p' "$OUT/variants_ab.log" | grep -v '^round ' >> "$S"
# correctness after the timings, VAR_TEST_JOBS builds at a time (default
# one; the library must not need a quiet GPU, so more only save time), each
# in a folder of its own; VAR_TEST_TIMEOUT_S bounds each
run_test() {
    local n=$1 d=.devbuild/bin
    [[ $n == cur ]] || d=.devbuild/$n/bin
    mkdir -p "$OUT/test_$n.d"
    (cd "$OUT/test_$n.d" && timeout "$tt" "$ROOT/$d/test_cuda") > "$OUT/test_$n.log" 2>&1
    echo "test_cuda [$n] exit $? $(grep -E '^\[  PASSED|^\[  FAILED' "$OUT/test_$n.log" | tr '\n' ' ')" > "$OUT/test_$n.res"
}
running=0
for n in $tests; do
    run_test "$n" &
    if ((++running >= jobs)); then wait -n; ((running--)); fi
done
wait
for n in $tests; do cat "$OUT/test_$n.res" >> "$S"; done
cat "$S"
