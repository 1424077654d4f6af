# Sourced by the GPU scripts: where the GPU is not an H200, copies the H200's
# shipped configs under this GPU's name into FP4MOE_CONFIG_DIR (a config names
# its GPU in the file name, non [A-Za-z0-9.] as _, and in its "gpu" key) and
# sets RELABELLED to a line saying so; no H200 config is tuned for another GPU.
RELABELLED=
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
if [[ -n $gpu && $gpu != "NVIDIA H200" ]]; then
    export FP4MOE_CONFIG_DIR=$PWD/.devbuild/configs-relabelled
    rm -rf "$FP4MOE_CONFIG_DIR" && mkdir -p "$FP4MOE_CONFIG_DIR"
    pfx=$(printf '%s' "$gpu" | sed 's/[^A-Za-z0-9.]/_/g')
    for f in configs/NVIDIA_H200-*.json; do
        b=${f##*/}
        sed "s|\"gpu\": \"NVIDIA H200\"|\"gpu\": \"$gpu\"|" "$f" > "$FP4MOE_CONFIG_DIR/$pfx-${b#NVIDIA_H200-}"
    done
    RELABELLED="configs: the H200's shipped configs relabelled for $gpu"
fi
