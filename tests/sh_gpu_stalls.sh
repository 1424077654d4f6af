#!/usr/bin/env bash
# dev/gpu/stalls.sh without a GPU: the script copied into a scratch tree
# with stand-ins for ncu (a report, then its raw and source pages in ncu's CSV
# layout) and nvidia-smi. Checks: no ncu, or a STALL_TIMEOUT_S that is not
# whole seconds, is exit 2 with a message; each
# kernel's summary comes from dev/analysis/stalls.py; an ncu failure is a line
# naming the kernel and batch, and the other kernels still run; a kernel the
# batch does not launch is a line saying so; the H200's
# configs are relabelled for another GPU's name.
set -u
command -v python3 > /dev/null || { echo "SKIPPED: sh_gpu_stalls: python3 not found"; exit 77; }
SCRATCH_NAME=sh_stalls . "$(dirname "$0")/scratch.inc.sh"

R=$T/tree
mkdir -p "$R/dev/gpu" "$R/dev/analysis" "$R/configs" "$R/fakebin"
cp "$SRC/dev/gpu/stalls.sh" "$SRC/dev/gpu/relabel.sh" "$R/dev/gpu/"
cp "$SRC/dev/analysis/stalls.py" "$SRC/dev/analysis/sass_lines.py" "$R/dev/analysis/"
printf '{"key": {"gpu": "NVIDIA H200"}}\n' > "$R/configs/NVIDIA_H200-132sm-x.json"
printf '#!/usr/bin/env bash\necho "NVIDIA H100 80GB HBM3"\n' > "$R/fakebin/nvidia-smi"
cat > "$R/fakebin/ncu" <<'NCU'
#!/usr/bin/env bash
# profile: -k regex:K ... -o REP ...; read back: -i REP --page raw|source --csv
args=" $* "
if [[ $args == *" -i "* ]]; then
    if [[ $args == *"--page raw"* ]]; then
        echo '"ID","Kernel Name","smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio"'
        echo '"","","ratio","ratio"'
        echo '"0","fm_route_kernel","3.0","1.0"'
    else
        echo '"# Address","Source","Warp Stall Sampling (All Samples)"'
        echo '"0x10","FMNMX R1, R2, R3 ;","30"'
        echo '"0x20","SHFL.BFLY PT, R4, R1, 0x1, 0x1f ;","70"'
    fi
    exit 0
fi
k= o=
while (($#)); do
    case $1 in -k) k=$2; shift ;; -o) o=$2; shift ;; esac
    shift
done
echo "$k" >> "$(dirname "$o")/kernels"
[[ $k == *fm_broken* ]] && { echo "==ERROR== the profiled process failed"; exit 1; }
# as ncu: no matching launch is exit 0 and no report
[[ $k == *fm_absent* ]] && { echo "==WARNING== No kernels were profiled."; exit 0; }
: > "$o.ncu-rep"
NCU
chmod +x "$R/fakebin/ncu" "$R/fakebin/nvidia-smi"

# no ncu: exit 2 and a message (only where this machine has none of its own)
if ! command -v ncu > /dev/null; then
    (cd "$R" && OUT=$T/o0 bash dev/gpu/stalls.sh) > "$T/out0" 2> "$T/err0"
    rc=$?
    [ "$rc" = 2 ] || fail "no ncu: exit $rc, expected 2"
    grep -q "ncu not found" "$T/err0" || fail "no ncu: message: $(cat "$T/err0")"
fi

(cd "$R" && PATH=$R/fakebin:$PATH OUT=$T/o2 STALL_TIMEOUT_S=1m bash dev/gpu/stalls.sh) > "$T/out2" 2> "$T/err2"
rc=$?
[ "$rc" = 2 ] || fail "STALL_TIMEOUT_S=1m: exit $rc, expected 2"
grep -q "STALL_TIMEOUT_S '1m' is not whole seconds" "$T/err2" || fail "STALL_TIMEOUT_S=1m: message: $(cat "$T/err2")"
[ ! -e "$T/o2/stalls.txt" ] || fail "STALL_TIMEOUT_S=1m: wrote a summary"

(cd "$R" && PATH=$R/fakebin:$PATH OUT=$T/o1 STALL_BATCH=1,4 STALL_KERNELS="fm_route_kernel fm_broken fm_absent" \
    bash dev/gpu/stalls.sh) > "$T/out1" 2>&1 || fail "run: exit $?: $(tail -n 5 "$T/out1")"
S=$T/o1/stalls.txt
grep -q "GPU: NVIDIA H100 80GB HBM3" "$S" || fail "GPU line: $(cat "$S")"
grep -q "relabelled for NVIDIA H100 80GB HBM3" "$S" || fail "relabel line"
grep -q '"gpu": "NVIDIA H100 80GB HBM3"' "$R/.devbuild/configs-relabelled/NVIDIA_H100_80GB_HBM3-132sm-x.json" ||
    fail "relabelled config"
for b in 1 4; do
    grep -q "== fm_route_kernel B=$b (glm-5 tp:8)" "$S" || fail "B=$b: no fm_route_kernel section"
    grep -q "== fm_broken B=$b: ncu exit 1: ==ERROR== the profiled process failed" "$S" || fail "B=$b: fm_broken's line"
    grep -q "== fm_absent B=$b: no launch of fm_absent at this batch size" "$S" || fail "B=$b: fm_absent's line"
done
# stalls.py's figures: wait 3.0 of 4.0 (75 %), the shuffle 70 of 100 samples first
grep -qE "^  wait +3\.00 +75\.0 %" "$S" || fail "wait's share: $(cat "$S")"
grep -qE "^  no_instruction +1\.00 +25\.0 %" "$S" || fail "no_instruction's share"
grep -m1 -E "^ +[0-9.]+ %  +0x" "$S" | grep -q "70.0 %.*SHFL" || fail "top instruction: $(grep -m1 ' %  ' "$S")"
[ "$(grep -c . "$T/o1/kernels")" = 6 ] || fail "ncu runs: $(cat "$T/o1/kernels")"

done_checks "stalls.sh"
