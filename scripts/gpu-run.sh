#!/usr/bin/env bash
# Runs on the GPU machine, from one folder made by scripts/gpu-bundle.sh (kernels, memory, nccl
# or train: it runs what the folder holds). Writes logs to ${OUT:-.}.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-.}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"

# libnccl.so from the PyTorch wheel (cudarc looks for the unversioned name).
nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) + "/lib")' 2>/dev/null || true)
if [ -n "$nccl_dir" ] && [ -e "$nccl_dir/libnccl.so.2" ]; then
    mkdir -p /tmp/ncclib && ln -sf "$nccl_dir/libnccl.so.2" /tmp/ncclib/libnccl.so
    export LD_LIBRARY_PATH="/tmp/ncclib:${LD_LIBRARY_PATH:-}"
fi

if [ -x "$here/flash-attention-tests" ]; then
    # A CUDA start failure must fail here, not skip.
    ULYSSES_REQUIRE_GPU_RUNTIME=1 "$here/flash-attention-tests" --nocapture 2>&1 | tee "$out/kernel-tests.log"
    ULYSSES_SDPA_SCRIPT="$here/sdpa_reference.py" "$here/flash-attention-bench" 2>&1 | tee "$out/flash-bench.log"
fi
if [ -x "$here/training-memory-bench" ]; then
    # A device call lasts at most 10 minutes: MEMORY_RUN picks what this one measures.
    # Longest-sequence trials pack documents of 4096 tokens: the step's memory does not depend
    # on the mask (tested), and attention then costs linear time instead of many minutes per
    # trial. The budget includes the parameters; each trial is a child process, killed past
    # --trial-timeout.
    bench="$here/training-memory-bench"
    longest="--shape llama-8b --longest-under 80000000000 --documents 4096 --trial-timeout 150"
    case "${MEMORY_RUN:-alst}" in
    alst)
        # Everything ALST uses, on a Llama-3.1-8B-shaped stack of 2 layers: checkpointing
        # offloaded, the token-wise parts in tiles of d_model tokens, bf16. Goal: 1M tokens.
        "$bench" $longest --layers 2 --min-seq 524288 --max-seq 2097152 --step-tokens 65536 \
            --checkpoint-layers --offload-to-host --tile-tokens 4096 --precision bf16 2>&1 | tee -a "$out/training-memory.log" ;;
    layers4)
        # 4 layers in f32, plain and checkpointed (offloaded).
        "$bench" $longest --layers 4 --min-seq 8192 --max-seq 262144 --step-tokens 8192 2>&1 | tee -a "$out/training-memory.log"
        "$bench" $longest --layers 4 --min-seq 65536 --max-seq 1048576 --step-tokens 32768 --checkpoint-layers --offload-to-host 2>&1 | tee -a "$out/training-memory.log" ;;
    table)
        # Memory of one step against S (the example's shape), plain and checkpointed.
        "$bench" --seqs 4096,8192,16384,32768,65536 2>&1 | tee -a "$out/training-memory.log"
        "$bench" --seqs 4096,8192,16384,32768,65536 --checkpoint-layers --offload-to-host 2>&1 | tee -a "$out/training-memory.log" ;;
    *) echo "MEMORY_RUN must be alst, layers4 or table, not ${MEMORY_RUN}" >&2; exit 2 ;;
    esac
fi
if [ -x "$here/ulysses-nccl-check" ]; then
    "$here/ulysses-launch" --nproc-per-node 1 -- "$here/ulysses-nccl-check" 2>&1 | tee "$out/nccl-check-1.log"
    ULYSSES_GPU=0 "$here/ulysses-launch" --nproc-per-node 2 -- sh -c "NCCL_HOSTID=host\$RANK exec $here/ulysses-nccl-check" 2>&1 | tee "$out/nccl-check.log"
fi
if [ -x "$here/ulysses-llama" ]; then
    train="--steps 50 --seq-len 2048 --batch-size 2 --corpus ${CORPUS:-/usr/share/common-licenses}"
    # One process: SP=1, and SP=2 as threads sharing the GPU; burn's fused CUDA backend too.
    for sp in 1 2; do
        "$here/ulysses-llama" --backend cuda --sp "$sp" $train --out "$out/train-sp$sp" 2>&1 | tail -3 | tee -a "$out/train.log"
    done
    "$here/ulysses-llama" --backend cuda-fused --sp 1 $train --out "$out/train-fused-sp1" 2>&1 | tail -3 | tee -a "$out/train.log"
    # SP=2 as two processes over NCCL on the one GPU (a host id each, or NCCL refuses).
    "$here/ulysses-launch" --nproc-per-node 2 -- sh -c "NCCL_HOSTID=host\$RANK exec $here/ulysses-llama --backend cuda --device 0 --sp 2 $train --out $out/train-sp2-processes" 2>&1 | tail -5 | tee -a "$out/train.log"
fi
