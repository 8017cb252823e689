#!/usr/bin/env bash
# Makes (once) a venv outside the checkout with NVIDIA's compilers from PyPI, pinned: NVRTC and
# the CUDA headers (12.9), ptxas (12.9), cuobjdump and nvdisasm (13.5; they read sm_90a cubins
# of ptxas 12.9). About 350 MB. Prints the venv's folder, for ULYSSES_CUDA_TOOLS:
#
#   ULYSSES_CUDA_TOOLS=$(scripts/cuda-tools.sh) cargo test -p ulysses-cuda-check -- --nocapture
set -euo pipefail
venv="${ULYSSES_CUDA_TOOLS:-/var/tmp/ulysses-cuda-tools}"
if ! "$venv/bin/python" -c 'import nvidia' 2>/dev/null; then
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install -q --disable-pip-version-check \
        nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-nvcc-cu12==12.9.86 nvidia-cuda-runtime-cu12==12.9.79 \
        nvidia-cuda-nvdisasm==13.5.37 nvidia-cuda-cuobjdump==13.5.37 >&2
fi
echo "$venv"
