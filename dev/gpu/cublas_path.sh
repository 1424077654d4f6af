# Sourced by the GPU scripts: where the dynamic loader's cache has no
# libcublas.so.13 (the engine loads it at run time for the BF16 router
# logits), appends to LD_LIBRARY_PATH the CUDA toolkit's copy or the one
# PyTorch's wheels bring (too large to carry).
if ! ldconfig -p 2> /dev/null | grep -q 'libcublas\.so\.13 '; then
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
        $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, s, "lib") for p in nvidia.__path__ for s in ("cu13", "cublas")))' 2> /dev/null); do
        [[ -e $d/libcublas.so.13 ]] && { export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d; break; }
    done
fi
