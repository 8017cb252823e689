#!/usr/bin/env bash
# Makes (once) a venv outside the checkout with NVIDIA's compilers from PyPI, pinned, and prints
# its folder, for ULYSSES_CUDA_TOOLS. `scripts/cuda-tools.sh` (or `12`): NVRTC, the CUDA headers
# (libcu++'s, for cp.async and barriers, among them) and ptxas 12.9; `scripts/cuda-tools.sh 13`: 13.0, the GPU image's (driver 580). Both with
# cuobjdump and nvdisasm 13.5 (they read sm_90a cubins of either ptxas); 13's NVVM is pinned
# too, else nvcc (scripts/fa2-baseline.sh) writes PTX newer than its ptxas reads. About 350 and 540 MB.
#
#   ULYSSES_CUDA_TOOLS=$(scripts/cuda-tools.sh)@sm_80,sm_89:$(scripts/cuda-tools.sh 13)@sm_90a \
#       cargo test -p ulysses-cuda-check -- --nocapture
set -euo pipefail
case "${1:-12}" in
    12)
        venv="${ULYSSES_CUDA_TOOLS_VENV:-/var/tmp/ulysses-cuda-tools}"
        wheels=(nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-nvcc-cu12==12.9.86 nvidia-cuda-runtime-cu12==12.9.79 nvidia-cuda-cccl-cu12==12.9.27) ;;
    13)
        # Beside the 12.9 venv, never in it: one venv holding both versions' wheels checks
        # with whichever sorts last.
        venv="${ULYSSES_CUDA_TOOLS_VENV:-/var/tmp/ulysses-cuda-tools}-13"
        wheels=(nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85 nvidia-nvvm==13.0.88) ;;
    *)
        echo "cuda-tools.sh: CUDA $1 is not pinned here; 12 or 13" >&2
        exit 2 ;;
esac
# A venv made before a wheel was added to its list, or pinned, gets it at its version (pip
# keeps what matches and replaces what does not): each pin is looked for in `pip freeze`.
missing=0
installed=$("$venv/bin/pip" freeze 2>/dev/null || true)
for wheel in "${wheels[@]}"; do
    grep -qix -- "$wheel" <<< "$installed" || missing=1
done
if [ "$missing" = 1 ]; then
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install -q --disable-pip-version-check \
        "${wheels[@]}" nvidia-cuda-nvdisasm==13.5.37 nvidia-cuda-cuobjdump==13.5.37 >&2
fi
echo "$venv"
