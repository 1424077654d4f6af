#!/usr/bin/env bash
# Installs what fp4moe needs to build and test: Debian packages (as root) and
# the Python test oracles (numpy, ml_dtypes, safetensors) from PyPI.
# Not root: prints the one apt command to run instead.
set -euo pipefail
PKGS="cmake make gcc clang libclang-rt-14-dev pkg-config libjansson-dev libyajl-dev libcmocka-dev zlib1g-dev python3 python3-pip chromium"
missing=""
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
# python3/pip may come from elsewhere (pyenv); do not demand Debian's then.
if command -v python3 >/dev/null; then missing=$(echo "$missing" | sed 's/ python3-pip//; s/ python3\b//'); fi
if [ -n "${missing// /}" ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "deps: installing Debian packages:$missing"
    (apt-get install -y -qq $missing >/dev/null 2>&1) || { apt-get update -qq && apt-get install -y -qq $missing; }
  else
    echo "deps: missing Debian packages. Run:"
    echo "  sudo apt-get install -y$missing"
    exit 1
  fi
fi
if [ "${FM_WITH_PY:-1}" = 1 ] && command -v python3 >/dev/null; then
  if ! python3 -c 'import numpy, ml_dtypes, safetensors' 2>/dev/null; then
    echo "deps: installing Python test oracles (numpy, ml_dtypes, safetensors)"
    python3 -m pip install -q numpy ml_dtypes safetensors 2>&1 | grep -v "Running pip as the 'root'" || true
  fi
fi
# cuobjdump, which tests/sh_cuda_arch.sh reads the CUDA build's device code
# with, where the CUDA toolkit came without it (the pip-installed toolkit):
# NVIDIA's wheel of the same CUDA major version.
NVCC=$(command -v nvcc 2>/dev/null || true)
[ -n "$NVCC" ] || { [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc; } || true
if [ "${FM_WITH_PY:-1}" = 1 ] && [ -n "$NVCC" ] && command -v python3 >/dev/null &&
   [ ! -x "$(dirname "$NVCC")/cuobjdump" ] && ! command -v cuobjdump >/dev/null; then
  major=$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
  if [ -n "$major" ] && ! python3 -c "import glob, sysconfig, sys; sys.exit(not glob.glob(sysconfig.get_paths()['purelib'] + '/nvidia/cu$major/bin/cuobjdump'))" 2>/dev/null; then
    echo "deps: installing cuobjdump (nvidia-cuda-cuobjdump, CUDA $major)"
    python3 -m pip install -q "nvidia-cuda-cuobjdump>=$major,<$((major + 1))" 2>&1 | grep -v "Running pip as the 'root'" || true
  fi
fi
