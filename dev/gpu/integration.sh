#!/usr/bin/env bash
# The GPU checks of the modules around the CUDA engine: profiling (CUPTI,
# NVML), the single-rank NCCL path, the CPU ISAs of the GPU host, `fp4moe
# profile --device cuda`, `fp4moe tune` and the CLI's reference benchmark
# (`fp4moe bench --device cuda --preset deepseek-v4-flash`). On the GPU
# machine, after dev/gpu/build.sh here (which builds its programs too):
#   bash dev/gpu/integration.sh       (dev/gpu/run.sh runs it in mode "all")
set -uo pipefail
cd "$(dirname "$0")/../.."
case "${1:-run}" in
run)
    OUT=${OUT:-$PWD/gpu_out}
    mkdir -p "$OUT"
    export LD_LIBRARY_PATH=$PWD/.devbuild/lib:${LD_LIBRARY_PATH:-}
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    BIN=$PWD/.devbuild/bin
    SUMMARY=$OUT/summary.txt
    touch "$SUMMARY"
    # NCCL comes with the image's PyTorch (pip package nvidia-nccl-cu13).
    if [ -z "${FM_NCCL_LIB:-}" ]; then
        FM_NCCL_LIB=$(python3 -c 'import nvidia.nccl, os, glob; d=os.path.dirname(nvidia.nccl.__file__); print((glob.glob(d+"/lib/libnccl.so*") or [""])[0])' 2>/dev/null)
        export FM_NCCL_LIB
    fi
    t() { # name timeout cmd...
        local name=$1 to=$2; shift 2
        local t0=$(date +%s.%N)
        (cd "$OUT" && timeout "$to" "$@") > "$OUT/$name.log" 2>&1
        local rc=$?
        printf '%-22s exit %3d  %6.1f s\n' "$name" "$rc" "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')" | tee -a "$SUMMARY"
    }
    # forward --device cuda through files, against --device cpu (the float
    # path) on a generated checkpoint: ids equal, outputs within BF16 error.
    fwd_check() {
        local d=$OUT/fwd; rm -rf "$d"; mkdir -p "$d"
        "$BIN/fp4moe" gen --preset tiny-deepseek --layers 2 --out "$d/ck" --quiet || return 1
        python3 - "$d" <<'PY' || return 1
import sys, json, numpy as np
from safetensors.numpy import save_file
d = sys.argv[1]
H = json.load(open(d + "/ck/config.json"))["hidden_size"]
x = np.random.default_rng(5).standard_normal((37, H)).astype(np.float32)
save_file({"hidden_states": x}, d + "/in.safetensors")
PY
        local L; L=$("$BIN/fp4moe" inspect "$d/ck" --json | python3 -c 'import sys,json; j=json.load(sys.stdin); print(j["moe_layers_present"][0] if "moe_layers_present" in j else j["layers"][0]["layer"])') || return 1
        "$BIN/fp4moe" forward --model "$d/ck" --layer "$L" --input "$d/in.safetensors" --output "$d/gpu.safetensors" --device cuda || return 1
        "$BIN/fp4moe" forward --model "$d/ck" --layer "$L" --input "$d/in.safetensors" --output "$d/cpu.safetensors" --device cpu || return 1
        python3 - "$d" <<'PY'
import sys, numpy as np
from safetensors.numpy import load_file
d = sys.argv[1]
g, c = load_file(d + "/gpu.safetensors"), load_file(d + "/cpu.safetensors")
assert (g["topk_ids"] == c["topk_ids"]).all(), "top-k ids differ"
e = np.linalg.norm(g["hidden_states"] - c["hidden_states"]) / np.linalg.norm(c["hidden_states"])
print(f"forward cuda vs cpu: ids equal, relative error {e:.2e}")
assert e <= 5e-3 and np.isfinite(g["hidden_states"]).all()
PY
    }
    t forward_cuda 60 bash -c "$(declare -f fwd_check); BIN=$BIN OUT=$OUT fwd_check"
    t cli_bench_dsv4 120 "$BIN/fp4moe" bench --device cuda --preset deepseek-v4-flash \
        --batch 1,2,4,8,16,32,64,128,256,512 --layers 8 --json "$OUT/cli_bench_dsv4.json"
    # the same after a second of sustained load per batch size: the clocks
    # the GPU's power limit allows (a decode server's case)
    t cli_bench_dsv4_sustained 200 "$BIN/fp4moe" bench --device cuda --preset deepseek-v4-flash \
        --batch 1,2,4,8,16,32,64,128,256,512 --layers 8 --sustain-ms 1000 --json "$OUT/cli_bench_dsv4_sustained.json"
    t profile_dsv4 90 "$BIN/fp4moe" profile --device cuda --preset deepseek-v4-flash --batch 32,80 \
        --json "$OUT/profile.json" --trace "$OUT/profile_trace.json" --report "$OUT/profile_report.html" --quiet
    # the profile's verdicts (bandwidth-, power-, latency-bound ...) into the summary
    grep -A3 '^verdict:' "$OUT/profile_dsv4.log" | tail -n +2 | sed 's/^/  profile /' >> "$SUMMARY"
    t test_prof_cuda 60 "$BIN/test_prof_cuda"
    t test_dist_nccl 60 "$BIN/test_dist_nccl"
    t cpu_isa_check 60 "$BIN/cpu_isa_check"
    mkdir -p "$OUT/configs"
    [ "${FM_TUNE:-1}" = 1 ] && t tune ${TUNE_TIMEOUT:-150} "$BIN/fp4moe" tune --all-presets --batch ${TUNE_BATCH:-1,2,4,8,16,32,64,128,256,512} --out "$OUT/configs" --budget-s "${TUNE_BUDGET:-6}"
    t tune_summary 30 "$BIN/fp4moe" tune --summary "$OUT/configs"
    t cli_bench_dsv4_tuned 120 env FP4MOE_CONFIG_DIR="$OUT/configs" "$BIN/fp4moe" bench --device cuda \
        --preset deepseek-v4-flash --batch 1,2,4,8,16,32,64,128,256,512 --layers 8
    for p in glm-5 kimi-k2 qwen3-30b-a3b; do
        t "cli_bench_$p" 60 env FP4MOE_CONFIG_DIR="$OUT/configs" "$BIN/fp4moe" bench --device cuda --preset "$p" --batch 1,16,64,256 --layers 4
    done
    t cli_bench_dsv4_mxfp4 60 env FP4MOE_CONFIG_DIR="$OUT/configs" "$BIN/fp4moe" bench --device cuda --preset deepseek-v4-flash --format mxfp4 --batch 1,16,64,256 --layers 8
    { echo "-- fp4moe bench --device cuda --preset deepseek-v4-flash"; sed -n '/^ batch/,$p' "$OUT/cli_bench_dsv4.log" | head -30
      echo "-- fp4moe bench after 1000 ms of sustained load per batch size"
      grep -E "^memory bandwidth|^timing" "$OUT/cli_bench_dsv4_sustained.log"
      sed -n '/^ batch/,$p' "$OUT/cli_bench_dsv4_sustained.log" | grep -E "^ +[0-9]+ " | head -12
      echo "-- profile (head)"; head -60 "$OUT/profile_dsv4.log"
      echo "-- tune summary"; cat "$OUT/tune_summary.log"
      echo "-- fp4moe bench with the configs tuned in this call"; sed -n '/^ batch/,$p' "$OUT/cli_bench_dsv4_tuned.log" | head -24
      for p in glm-5 kimi-k2 qwen3-30b-a3b dsv4_mxfp4; do echo "-- $p"; grep -E "bandwidth|^ +[0-9]+ " "$OUT/cli_bench_${p#dsv4_}.log" "$OUT/cli_bench_$p.log" 2>/dev/null | head -8; done
      echo "-- forward"; tail -3 "$OUT/forward_cuda.log"; echo "-- nccl"; tail -5 "$OUT/test_dist_nccl.log"; echo "-- prof_cuda"; tail -5 "$OUT/test_prof_cuda.log"
      echo "-- isa"; tail -5 "$OUT/cpu_isa_check.log"; } >> "$SUMMARY"
    ;;
*) echo "usage: $0 [run]" >&2; exit 2 ;;
esac
