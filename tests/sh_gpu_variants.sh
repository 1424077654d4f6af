#!/usr/bin/env bash
# dev/gpu/variants.sh and dev/gpu/ab.sh without a GPU: the scripts copied into
# a scratch tree of the same layout, with stand-ins for fp4moe, test_cuda
# and nvidia-smi. Checks: variants.sh refuses bad arguments with exit 2 and a
# message before any work; `run` unpacks the carried builds, puts
# cuda_icache's and every carried cuda_topk's output in its summary, runs
# each test_cuda, relabels the H200's configs for another GPU's name (file
# name and key) and leaves them alone on an H200; ab.sh's table holds the
# best of the rounds and the ratio to the first variant, each case's table
# comes as its rounds end, and AB_DEADLINE_S stops further cases.
set -u
for t in xz python3 git; do
    command -v "$t" > /dev/null || { echo "SKIPPED: sh_gpu_variants: $t not found"; exit 77; }
done
SCRATCH_NAME=sh_variants . "$(dirname "$0")/scratch.inc.sh"

R=$T/tree
mkdir -p "$R/dev/gpu/patches" "$R/configs" "$R/fakebin"
cp "$SRC/dev/gpu/variants.sh" "$SRC/dev/gpu/ab.sh" "$SRC/dev/gpu/pack.sh" "$SRC/dev/gpu/relabel.sh" "$SRC/dev/gpu/cublas_path.sh" "$R/dev/gpu/"
echo "diff" > "$R/dev/gpu/patches/one.patch"
printf '{"fp4moe_tune_config": 1, "key": {"gpu": "NVIDIA H200", "sm_count": 132}}\n' \
    > "$R/configs/NVIDIA_H200-132sm-nvfp4-E8-H64-I32-k2.json"

# argument checks: exit 2, a message naming the problem, nothing built
bad() {
    local want=$1; shift
    (cd "$R" && bash dev/gpu/variants.sh "$@") > "$T/out" 2> "$T/err"
    local rc=$?
    [ "$rc" = 2 ] || fail "variants.sh $*: exit $rc, expected 2"
    grep -qF -- "$want" "$T/err" || fail "variants.sh $*: expected '$want', got: $(cat "$T/err")"
    [ ! -e "$R/.devbuild" ] || fail "variants.sh $*: made .devbuild"
}
bad "usage: variants.sh build" 
bad "usage: variants.sh build" frob a=one
bad "build: no variant named" build
bad "'a' is not NAME=PATCH" build a
bad "'a b' is not a variant name" build "a b=one"
bad "'cur' is not a variant name" build cur=one
bad "'build-x' is not a variant name" build build-x=one
bad "variant 'a': no patch 'two'" build a=one+two
bad "variant 'a' names no patch" build a=
bad "run: no variant named" run
bad "'../x' is not a variant name" run ../x
bad "no .carry/devbuild.tar.xz" run a
VAR_TEST_TIMEOUT_S=1m bad "VAR_TEST_TIMEOUT_S '1m' is not whole seconds" run a
VAR_DEADLINE_S=5m bad "VAR_DEADLINE_S '5m' is not whole seconds" run a
VAR_SMOKE_S=0 bad "VAR_SMOKE_S '0' is not whole seconds" run a
VAR_TESTS="cur zz" bad "VAR_TESTS names 'zz', not cur or a variant of this run" run a
VAR_TEST_JOBS=0 bad "VAR_TEST_JOBS '0' is not a whole number of builds" run a
VAR_ACT=fp8 bad "VAR_ACT 'fp8' is not f32, bf16 or f16" run a

# stand-ins: fp4moe prints a bench table whose times depend on the build
# (its directory) and the round (a counter file); test_cuda passes
mk_build() {  # DIR SCALE
    mkdir -p "$1"
    cat > "$1/fp4moe" << EOF
#!/usr/bin/env bash
n=\$(cat "$T/count_$2" 2>/dev/null || echo 0); echo \$((n + 1)) > "$T/count_$2"
echo "device bandwidth (probe): 3.00 TB/s"
echo "     B       us   GB/s  % bw  x floor"
for b in 1 4; do awk -v b=\$b -v s=$2 -v n=\$n 'BEGIN { printf "%6d %8.1f %6.1f %5.1f %5.2f\n", b, (10 * b + 20 - n) * s, 100, 50, 2 }'; done
echo "\$@" >> "$T/args_$2"
EOF
    cat > "$1/test_cuda" << EOF
#!/usr/bin/env bash
echo "start $2" >> "$T/tlog"; [ -n "\${FAKE_TEST_SLEEP:-}" ] && sleep "\$FAKE_TEST_SLEEP"; echo "end $2" >> "$T/tlog"
echo "[  PASSED  ] 23 tests."
EOF
    chmod +x "$1/fp4moe" "$1/test_cuda"
}
mk_build "$T/pack/bin" 1
printf '#!/usr/bin/env bash\necho "cold-warm per line 42.0"\n' > "$T/pack/bin/cuda_icache"
chmod +x "$T/pack/bin/cuda_icache"
printf '#!/usr/bin/env bash\necho "glm-5 256 8 spin last pick 4242"\n' > "$T/pack/bin/cuda_topk"
chmod +x "$T/pack/bin/cuda_topk"
mk_build "$T/pack/v1/bin" 2
printf '#!/usr/bin/env bash\necho "glm-5 256 8 spin last pick 1717"\n' > "$T/pack/v1/bin/cuda_topk"
chmod +x "$T/pack/v1/bin/cuda_topk"
# v2's bench fails: its smoke leaves it out of the A/B
mk_build "$T/pack/v2/bin" 3
printf '#!/usr/bin/env bash\necho "grid wait never ended" >&2\nexit 1\n' > "$T/pack/v2/bin/fp4moe"
mkdir -p "$T/pack/lib" "$R/.carry"
tar -C "$T/pack" -cf - bin lib v1 v2 | xz > "$R/.carry/devbuild.tar.xz"

cat > "$R/fakebin/nvidia-smi" << 'EOF'
#!/usr/bin/env bash
echo "${FAKE_GPU:-NVIDIA H100 80GB HBM3}"
EOF
chmod +x "$R/fakebin/nvidia-smi"
bad "no zz/bin/fp4moe in the carried builds" run zz

(cd "$R" && PATH=$R/fakebin:$PATH OUT=$T/out1 VAR_PRESET="glm-5@tp:8 qwen3" VAR_BATCH=1,4 VAR_ROUNDS=2 \
    bash dev/gpu/variants.sh run v1 v2) > "$T/run1" 2>&1 || fail "run: exit $?: $(tail -n 5 "$T/run1")"
S=$T/out1/variants.txt
grep -q "GPU: NVIDIA H100 80GB HBM3" "$S" || fail "run: GPU line missing: $(cat "$S")"
grep -q "configs: the H200's shipped configs relabelled for NVIDIA H100 80GB HBM3" "$S" || fail "run: relabel line missing"
cf=$R/.devbuild/configs-relabelled/NVIDIA_H100_80GB_HBM3-132sm-nvfp4-E8-H64-I32-k2.json
[ -f "$cf" ] || fail "run: no relabelled config $cf"
grep -q '"gpu": "NVIDIA H100 80GB HBM3"' "$cf" 2>/dev/null || fail "run: the relabelled config keeps another gpu key"
grep -q "cold-warm per line 42.0" "$S" || fail "run: no cuda_icache output in the summary"
grep -A1 "cuda_topk \[cur\] (exit 0):" "$S" | grep -q "spin last pick 4242" || fail "run: no cuda_topk output in the summary"
grep -A1 "cuda_topk \[v1\] (exit 0):" "$S" | grep -q "spin last pick 1717" || fail "run: no v1 cuda_topk output in the summary"
! grep -q "cuda_topk \[v2\]" "$S" || fail "run: a cuda_topk line for v2, which carries none"
grep -q "test_cuda \[cur\] exit 0 \[  PASSED  \] 23 tests." "$S" || fail "run: cur's test line: $(cat "$S")"
grep -q "test_cuda \[v1\] exit 0" "$S" || fail "run: v1's test line"
# rounds: cur gives 30, 29 at B = 1 (best 29); v1's smoke is its first
# call, then 2 * (29, 28) (best 56): ratio 1.93
grep -q "^== glm-5@tp:8" "$S" || fail "run: no glm-5@tp:8 table"
grep -A6 "^== glm-5@tp:8" "$S" | grep -Eq "^ +1 +29\.0 \(1\.00\) +56\.0 \(1\.93\)$" || fail "run: B = 1 row: $(cat "$S")"
grep -q -- "--preset glm-5 --shard tp:8 --batch 1,4 --layers 2" "$T/args_2" || fail "run: v1's smoke: $(cat "$T/args_2")"
grep -q "smoke \[v2\] exit 1: left out of the A/B (grid wait never ended" "$S" || fail "run: v2's smoke line: $(cat "$S")"
! grep -A3 "^== glm-5@tp:8" "$S" | grep -q " v2" || fail "run: v2 in the A/B after a failed smoke"
grep -q "^== qwen3" "$S" || fail "run: no qwen3 table"
grep -q -- "--preset glm-5 --shard tp:8 --batch 1,4 --layers 8" "$T/args_1" || fail "run: bench arguments: $(cat "$T/args_1")"
grep -q -- "--preset qwen3 --batch 1,4 --layers 8" "$T/args_2" || fail "run: the second case's arguments"
# the first case's table comes before the second case runs
log=$T/out1/variants_ab.log
first_table=$(grep -n "^== glm-5@tp:8" "$log" | head -n 1 | cut -d: -f1)
second_run=$(grep -n "round 1 qwen3" "$log" | head -n 1 | cut -d: -f1)
[ -n "$first_table" ] && [ -n "$second_run" ] && [ "$first_table" -lt "$second_run" ] || fail "ab: a case's table not printed as it ends"

# VAR_ACT: every build's bench gets the activations' type
rm -f "$T"/args_*
(cd "$R" && PATH=$R/fakebin:$PATH OUT=$T/out4 VAR_PRESET="glm-5@tp:8" VAR_BATCH=1 VAR_ROUNDS=1 VAR_ACT=bf16 \
    bash dev/gpu/variants.sh run v1) > "$T/run4" 2>&1 || fail "VAR_ACT run: exit $?: $(tail -n 5 "$T/run4")"
grep -q -- "--act bf16" "$T/args_1" || fail "VAR_ACT: cur's bench: $(cat "$T/args_1")"
grep -q -- "--act bf16" "$T/args_2" || fail "VAR_ACT: v1's bench: $(cat "$T/args_2")"
grep -q "test_cuda \[v1\]" "$T/out4/variants.txt" || fail "VAR_ACT run: no v1 test line"

# VAR_TESTS: only the builds it names run test_cuda; none runs none
(cd "$R" && PATH=$R/fakebin:$PATH OUT=$T/out5 VAR_PRESET="glm-5@tp:8" VAR_BATCH=1 VAR_ROUNDS=1 VAR_TESTS=v1 \
    bash dev/gpu/variants.sh run v1) > "$T/run5" 2>&1 || fail "VAR_TESTS=v1 run: exit $?: $(tail -n 5 "$T/run5")"
grep -q "test_cuda \[v1\] exit 0" "$T/out5/variants.txt" || fail "VAR_TESTS=v1: no v1 test line"
! grep -q "test_cuda \[cur\]" "$T/out5/variants.txt" || fail "VAR_TESTS=v1: cur's test_cuda ran"
(cd "$R" && PATH=$R/fakebin:$PATH OUT=$T/out6 VAR_PRESET="glm-5@tp:8" VAR_BATCH=1 VAR_ROUNDS=1 VAR_TESTS=none \
    bash dev/gpu/variants.sh run v1) > "$T/run6" 2>&1 || fail "VAR_TESTS=none run: exit $?: $(tail -n 5 "$T/run6")"
! grep -q "test_cuda" "$T/out6/variants.txt" || fail "VAR_TESTS=none: a test_cuda ran"

# VAR_TEST_JOBS=2: two builds' tests at once, their lines in the builds' order
rm -f "$T/tlog"
(cd "$R" && PATH=$R/fakebin:$PATH OUT=$T/out7 VAR_PRESET="glm-5@tp:8" VAR_BATCH=1 VAR_ROUNDS=1 VAR_TEST_JOBS=2 \
    FAKE_TEST_SLEEP=1 bash dev/gpu/variants.sh run v1) > "$T/run7" 2>&1 || fail "VAR_TEST_JOBS=2 run: exit $?: $(tail -n 5 "$T/run7")"
[ "$(sed -n 2p "$T/tlog" | cut -c1-5)" = "start" ] || fail "VAR_TEST_JOBS=2: the tests ran one after another: $(cat "$T/tlog")"
grep -A1 "test_cuda \[cur\] exit 0" "$T/out7/variants.txt" | grep -q "test_cuda \[v1\] exit 0" ||
    fail "VAR_TEST_JOBS=2: test lines: $(grep test_cuda "$T/out7/variants.txt")"
# one at a time by default
rm -f "$T/tlog"
(cd "$R" && PATH=$R/fakebin:$PATH OUT=$T/out8 VAR_PRESET="glm-5@tp:8" VAR_BATCH=1 VAR_ROUNDS=1 \
    bash dev/gpu/variants.sh run v1) > "$T/run8" 2>&1 || fail "default test run: exit $?"
[ "$(sed -n 2p "$T/tlog" | cut -c1-3)" = "end" ] || fail "default: the tests overlapped: $(cat "$T/tlog")"

# on an H200 the shipped configs stay as they are; a deadline of 0 runs no case
rm -rf "$R/.devbuild"
(cd "$R" && PATH=$R/fakebin:$PATH FAKE_GPU="NVIDIA H200" OUT=$T/out2 VAR_PRESET="a b" VAR_DEADLINE_S=0 \
    bash dev/gpu/variants.sh run v1) > "$T/run2" 2>&1 || fail "run on H200: exit $?"
! grep -q "relabelled" "$T/out2/variants.txt" || fail "run on H200: configs relabelled"
[ ! -d "$R/.devbuild/configs-relabelled" ] || fail "run on H200: made a relabelled config folder"
grep -q "== a: not run (AB_DEADLINE_S=0 reached)" "$T/out2/variants.txt" || fail "deadline: $(cat "$T/out2/variants.txt")"
grep -q "== b: not run" "$T/out2/variants.txt" || fail "deadline: second case"

# ab.sh refuses a deadline that is not a whole number, before any run
rm -f "$T/args_1"
(cd "$R" && PATH=$R/fakebin:$PATH OUT=$T/out3 AB_DEADLINE_S=5m AB_VARIANTS="cur:FM_AB_BIN=.devbuild/bin" \
    bash dev/gpu/ab.sh) > "$T/ab3" 2> "$T/ab3.err"
rc=$?
[ "$rc" = 2 ] || fail "ab.sh AB_DEADLINE_S=5m: exit $rc, expected 2"
grep -qF "AB_DEADLINE_S '5m' is not a whole number of seconds" "$T/ab3.err" || fail "ab.sh AB_DEADLINE_S=5m: $(cat "$T/ab3.err")"
[ ! -e "$T/args_1" ] || fail "ab.sh AB_DEADLINE_S=5m: ran the bench"

# pack.sh refuses a pack larger than a GPU call carries and leaves the
# last pack as it was; and a limit that is not a number
cp "$R/.carry/devbuild.tar.xz" "$T/pack_before"
(cd "$R" && PACK_LIMIT_MIB=0 bash dev/gpu/pack.sh fp4moe) > "$T/p.out" 2> "$T/p.err"
rc=$?
[ "$rc" = 3 ] || fail "pack.sh PACK_LIMIT_MIB=0: exit $rc, expected 3"
grep -qF "more than the 0 MiB a GPU call carries" "$T/p.err" || fail "pack.sh PACK_LIMIT_MIB=0: $(cat "$T/p.err")"
cmp -s "$T/pack_before" "$R/.carry/devbuild.tar.xz" || fail "pack.sh: a refused pack replaced the last one"
[ ! -e "$R/.carry/devbuild.tar.xz.part" ] || fail "pack.sh: a refused pack left its part file"
(cd "$R" && PACK_LIMIT_MIB=6x bash dev/gpu/pack.sh fp4moe) > "$T/p.out" 2> "$T/p.err"
rc=$?
[ "$rc" = 2 ] || fail "pack.sh PACK_LIMIT_MIB=6x: exit $rc, expected 2"
grep -qF "PACK_LIMIT_MIB '6x' is not a whole number of MiB" "$T/p.err" || fail "pack.sh PACK_LIMIT_MIB=6x: $(cat "$T/p.err")"
(cd "$R" && bash dev/gpu/pack.sh fp4moe) > "$T/p.out" 2> "$T/p.err" || fail "pack.sh: exit $?: $(cat "$T/p.err")"
tar -tJf "$R/.carry/devbuild.tar.xz" | grep -qx "bin/fp4moe" || fail "pack.sh: no bin/fp4moe in the pack"

# build.sh refuses FM_GPU_TARGETS that names none of its programs before it
# configures or builds anything
cp "$SRC/dev/gpu/build.sh" "$R/dev/gpu/"
(cd "$R" && FM_GPU_TARGETS="no_such_target" FM_GPU_BUILD_DIR="$T/bdir" bash dev/gpu/build.sh) > "$T/b.out" 2> "$T/b.err"
rc=$?
[ "$rc" = 2 ] || fail "build.sh FM_GPU_TARGETS=no_such_target: exit $rc, expected 2"
grep -qF "FM_GPU_TARGETS names none of the programs" "$T/b.err" || fail "build.sh: $(cat "$T/b.err")"
[ ! -e "$T/bdir" ] || fail "build.sh: configured a build for a bad FM_GPU_TARGETS"
(cd "$R" && FM_GPU_ARCHS="90a;all" FM_GPU_BUILD_DIR="$T/bdir" bash dev/gpu/build.sh) > "$T/b.out" 2> "$T/b.err"
rc=$?
[ "$rc" = 2 ] || fail "build.sh FM_GPU_ARCHS='90a;all': exit $rc, expected 2"
grep -qF "FM_GPU_ARCHS '90a;all' is not a list like 80;90a" "$T/b.err" || fail "build.sh FM_GPU_ARCHS: $(cat "$T/b.err")"
[ ! -e "$T/bdir" ] || fail "build.sh: configured a build for a bad FM_GPU_ARCHS"

done_checks "variants.sh and ab.sh"
