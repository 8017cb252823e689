#!/usr/bin/env bash
# FlashAttention-2's kernels as the static baseline of ours: compiles its forward (head dims 64
# and 128) and its backward (head dim 128), bf16, not causal, every length a multiple of its
# tiles, with the configurations its launch templates pick for an H100, to machine code for
# TARGET, and prints each one's step loop as `sass-loop-blocks.py` counts ours
# (benches/RESULTS.md, "FlashAttention-2's step loops, read the same way").
#
#   bash scripts/fa2-baseline.sh FLASH_ATTENTION CUTLASS [TARGET] [OUT]
#
# FLASH_ATTENTION: a checkout of Dao-AILab/flash-attention (its csrc/flash_attn/src); CUTLASS: a
# checkout of NVIDIA/cutlass at the commit flash-attention's csrc/cutlass submodule names (its
# include/). Neither is committed here. FA2_ONLY=NAME compiles one (forward-hdim64, ...). TARGET: sm_90a (default) or sm_80. Uses the CUDA 13 venv
# of `scripts/cuda-tools.sh 13` (nvcc, ptxas, cuobjdump). Each kernel takes 1-2 minutes.
set -euo pipefail
fa=$(cd "$1" && pwd)/csrc/flash_attn/src
cutlass=$(cd "$2" && pwd)/include
target="${3:-sm_90a}"
out="${4:-$(mktemp -d)}"
here=$(cd "$(dirname "$0")" && pwd)
venv=$(bash "$here/cuda-tools.sh" 13)
cuda=$(echo "$venv"/lib/python3*/site-packages/nvidia/cu13)
mkdir -p "$out/shim/ATen/cuda/detail"

# Dropout's random state comes from PyTorch's headers; the kernels below never use it.
cat > "$out/shim/ATen/cuda/PhiloxCudaState.h" <<'EOF'
#pragma once
#include <cstdint>
namespace at { struct PhiloxCudaState { uint64_t seed_; uint64_t offset_; }; }
EOF
cat > "$out/shim/ATen/cuda/detail/UnpackRaw.cuh" <<'EOF'
#pragma once
#include <tuple>
namespace at { namespace cuda { namespace philox {
__device__ __forceinline__ std::tuple<uint64_t, uint64_t> unpack(at::PhiloxCudaState s) { return {s.seed_, s.offset_}; }
}}}
EOF

# name, headers, the kernel's body, its traits (flash_{fwd,bwd}_launch_template.h, the H100's).
kernels=(
    "forward-hdim64|flash_fwd_kernel.h|Flash_fwd_params|compute_attn<Traits, false, false, false, false, true, true, false, false>|Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t>"
    "forward-hdim128|flash_fwd_kernel.h|Flash_fwd_params|compute_attn<Traits, false, false, false, false, true, true, false, false>|Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>"
    "backward-hdim128|flash_bwd_preprocess_kernel.h flash_bwd_kernel.h|Flash_bwd_params|compute_dq_dk_dv_seqk_parallel<Traits, false, false, false, false, true, true, false>|Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, false, false, cutlass::bfloat16_t>"
)
for kernel in "${kernels[@]}"; do
    IFS='|' read -r name headers params body traits <<< "$kernel"
    [[ -z "${FA2_ONLY:-}" || "$name" == "$FA2_ONLY" ]] || continue
    includes=$(for header in $headers; do echo "#include \"$header\""; done)
    cat > "$out/$name.cu" <<EOF
#include "namespace_config.h"
#include "flash.h"
$includes
namespace FLASH_NAMESPACE {
template<typename Traits>
__global__ void baseline(const __grid_constant__ $params params) { $body(params); }
template __global__ void baseline<$traits>(const __grid_constant__ $params);
}
EOF
    echo "== FlashAttention-2 $name ($target): $traits"
    PATH="$cuda/bin:$PATH" nvcc -ptx -w -arch="compute_${target#sm_}" -O3 -std=c++17 --use_fast_math --expt-relaxed-constexpr \
        --expt-extended-lambda -I"$out/shim" -I"$fa" -I"$cutlass" -I"$cuda/include/cccl" -o "$out/$name.ptx" "$out/$name.cu"
    rm -f "$out/$name.cubin"
    "$cuda/bin/ptxas" -arch="$target" -O3 -v -o "$out/$name.cubin" "$out/$name.ptx" > "$out/$name.ptxas.txt" 2>&1 \
        || { cat "$out/$name.ptxas.txt" >&2; exit 1; }
    grep -E "registers|spill" "$out/$name.ptxas.txt" || true
    "$venv/bin/python" "$here/sass-loop-blocks.py" "$out/$name.cubin" "$target"
done
