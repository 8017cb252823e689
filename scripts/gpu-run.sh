#!/usr/bin/env bash
# Runs on the GPU machine, from one folder made by scripts/gpu-bundle.sh (kernels, memory, nccl
# or train: it runs what the folder holds). Every step's whole output goes to $OUT/<step>.log
# (panics and NCCL warnings included), its status to $OUT/status.txt; the script goes on after
# a failed step and exits 1 at the end if any failed, naming them.
#
# One device call lasts at most 10 minutes, so a folder's work is split by variables:
#   KERNELS_RUN = tests (default) | named | big | bench | ncu (kernels folder)
#   MEMORY_RUN  = alst (default) | layers4 | table | overhead   (memory folder; alst's range, trial
#                 limit and steps per trial: MEMORY_MIN_SEQ, MEMORY_MAX_SEQ, MEMORY_TRIAL_TIMEOUT,
#                 MEMORY_TRIAL_STEPS; alst's tiles and offload, to find what a piece's time is
#                 made of: MEMORY_TILE_TOKENS (4096), MEMORY_OFFLOAD=0 keeps the checkpointed
#                 inputs on the device; MEMORY_PROFILE=1 logs every kernel's time;
#                 MEMORY_UNPROBED=1 times a trial's later steps without the per-piece sync;
#                 MEMORY_CLEANUP=1 frees empty pool pages before each piece's backward;
#                 MEMORY_POOLS=exact gives each tensor a buffer of its own size, =exclusive a
#                 buffer per tensor in size classes, unused ones given back; overhead:
#                 the UlyssesBackend decorator against the plain backend, OVERHEAD_ARGS)
#   TRAIN_RUN   = check (default) | scale | hf | 8b   (train folder)
# DRY_RUN=1 prints the steps instead of running them (any machine: `DRY_RUN=1 OUT=/tmp/x
# scripts/gpu-run.sh` from a bundle folder, or from scripts/ to see every step).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-.}"
mkdir -p "$out"
: >"$out/status.txt"
failed=()
# Whether the folder holds a part (a dry run lists every part).
has() { [ "${DRY_RUN:-0}" = 1 ] || [ -x "$here/$1" ]; }

# `step NAME COMMAND...`: runs COMMAND, its output in full to $OUT/NAME.log and the last
# lines on the console; records the status.
step() {
    local name=$1; shift
    if [ "${DRY_RUN:-0}" = 1 ]; then
        printf '%s: %s\n' "$name" "$*"
        return 0
    fi
    echo "== $name"
    "$@" >"$out/$name.log" 2>&1
    local status=$?
    tail -n 15 "$out/$name.log"
    echo "$name $status" >>"$out/status.txt"
    if [ "$status" -ne 0 ]; then
        echo "== $name FAILED with status $status (log: $out/$name.log)"
        failed+=("$name")
    fi
    return "$status"
}

# `ratio NAME TORCH_STEP OUR_STEP`: ours against PyTorch in tokens/s over the steps PyTorch
# timed (benches/throughput_ratio.py), from TORCH_STEP's log and OUR_STEP's metrics.csv.
ratio() {
    step "$1" python3 "$here/throughput_ratio.py" --torch "$out/$2.log" --ours "$out/$3/metrics.csv"
}

# `corpus_for SEQ`: a corpus (file or folder) for the trainer's --corpus whose held-out tenth
# holds a sequence of SEQ tokens: $CORPUS (the system's licence texts by default, 240 KB: a
# 30 KB held-out split, too short past 30 309 tokens, which failed the first GPU run's 65 536),
# or, where that is too short, its text repeated into a file of 11 × (SEQ + 1) bytes in /tmp
# (made in a dry run too, so that the printed commands run).
corpus_for() {
    local source="${CORPUS:-/usr/share/common-licenses}" need=$(( ($1 + 1) * 11 ))
    local have
    have=$(find "$source" -type f -exec cat {} + 2>/dev/null | wc -c)
    if [ "$have" -ge "$need" ] || [ "$have" -eq 0 ]; then
        echo "$source"
        return
    fi
    local file="/tmp/gpu-run-corpus-$1.txt"
    if [ ! -f "$file" ] || [ "$(wc -c <"$file")" -lt "$need" ]; then
        : >"$file"
        while [ "$(wc -c <"$file")" -lt "$need" ]; do
            find "$source" -type f -exec cat {} + >>"$file"
        done
    fi
    echo "$file"
}

# What the run links against, before anything else: the driver, CUDA's NVRTC (CubeCL compiles
# every kernel with it at run time) and NCCL, with their versions. Python finds the pip
# wheels' folders by their package paths (namespace packages have no __file__).
libraries() {
    python3 - <<'PY'
import ctypes, glob, importlib, os, sys
def folders(package):
    try:
        module = importlib.import_module(package)
    except ImportError:
        return []
    return [os.path.join(p, "lib") for p in getattr(module, "__path__", [])]
found = {}
for name, packages, patterns in [
    ("nccl", ["nvidia.nccl"], ["libnccl.so.2", "libnccl.so"]),
    ("nvrtc", ["nvidia.cuda_nvrtc", "nvidia.cu13", "nvidia.cu12"], ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]),
]:
    cuda = os.environ.get("CUDA_PATH", "")
    candidates = [f for p in packages for f in folders(p)] + ([os.path.join(cuda, "lib64")] if cuda else [])
    for folder in candidates:
        hits = [f for pattern in patterns for f in glob.glob(os.path.join(folder, pattern))]
        if hits:
            found[name] = hits[0]
            break
for name, path in found.items():
    print(f"{name}={path}")
PY
}
if [ "${DRY_RUN:-0}" != 1 ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/gpu.txt"
    # The toolkit, where the image has one (nvcc, NVRTC): CubeCL and cudarc read CUDA_PATH.
    if [ -z "${CUDA_PATH:-}" ]; then
        for candidate in /usr/local/cuda /usr/local/cuda-13.0 /usr/local/cuda-12; do
            [ -d "$candidate" ] && { export CUDA_PATH="$candidate"; break; }
        done
    fi
    [ -n "${CUDA_PATH:-}" ] && export LD_LIBRARY_PATH="$CUDA_PATH/lib64:${LD_LIBRARY_PATH:-}"
    # cudarc looks for libnccl.so and libnvrtc.so by their unversioned names: link them.
    mkdir -p /tmp/gpu-libs
    while IFS='=' read -r name path; do
        [ -n "$path" ] || continue
        ln -sf "$path" "/tmp/gpu-libs/lib$name.so"
        ln -sf "$path" "/tmp/gpu-libs/$(basename "$path")"
    done < <(libraries)
    export LD_LIBRARY_PATH="/tmp/gpu-libs:${LD_LIBRARY_PATH:-}"
    python3 - <<'PY' 2>&1 | tee "$out/libraries.txt"
import ctypes, os
def version(library, symbol, parts):
    try:
        handle = ctypes.CDLL(library)
    except OSError as e:
        return f"not loadable ({e})"
    values = [ctypes.c_int() for _ in range(parts)]
    getattr(handle, symbol)(*[ctypes.byref(v) for v in values])
    linked = f"/tmp/gpu-libs/{library}"
    where = os.path.realpath(linked) if os.path.exists(linked) else "(system)"
    return ".".join(str(v.value) for v in values) + "  " + where
print("driver (CUDA API):", version("libcuda.so.1", "cuDriverGetVersion", 1))
print("NVRTC:", version("libnvrtc.so", "nvrtcVersion", 2))
print("NCCL:", version("libnccl.so", "ncclGetVersion", 1))
print("CUDA_PATH:", os.environ.get("CUDA_PATH", "(unset)"))
PY
fi

if has flash-attention-tests; then
    case "${KERNELS_RUN:-tests}" in
    tests)
        # A CUDA start failure must fail here, not skip; so must a half-precision dtype the
        # device does not report (its cases would skip). The >2^32-element case has its call.
        step kernel-tests env ULYSSES_REQUIRE_GPU_RUNTIME=1 ULYSSES_REQUIRE_DTYPES=f16,bf16 "$here/flash-attention-tests" --nocapture --skip past_2_pow_32 ;;
    named)
        # The tests named in KERNEL_TESTS (space-separated), alone: a failure's whole message.
        step kernel-tests-named env ULYSSES_REQUIRE_GPU_RUNTIME=1 ULYSSES_REQUIRE_DTYPES=f16,bf16 RUST_BACKTRACE=1 "$here/flash-attention-tests" --nocapture --exact ${KERNEL_TESTS:?} ;;
    big)
        # q, the output, dO and dQ of 4.5e9 elements each (about 45 GB): 64-bit indexing.
        step kernel-test-past-2-pow-32 env ULYSSES_REQUIRE_GPU_RUNTIME=1 ULYSSES_REQUIRE_DTYPES=bf16 "$here/flash-attention-tests" --nocapture --exact bf16_past_2_pow_32_elements_per_tensor_against_chunks ;;
    bench)
        # BENCH_ARGS narrows or extends the sweep (e.g. "--heads 16 --seqs 8192,32768 --skews 0,8");
        # by default the register-fragment engine CUDA runs (not the planned one's 28 shapes), 1.5 s
        # a timing: the 16 shapes and SDPA's in about 150 s.
        step flash-bench env ULYSSES_SDPA_SCRIPT="$here/sdpa_reference.py" "$here/flash-attention-bench" \
            ${BENCH_ARGS:---fragments --heads 16 --seqs 8192,16384,32768,65536 --head-dims 128,64 --budget-secs 1.5} ;;
    ncu)
        # Nsight Compute on one launch of each kernel (forward, dK/dV, dQ) of the bench's first
        # shape (S 1024, 16 heads, bf16, head dim 128): the figures that name the limit (memory
        # or compute throughput, occupancy). A 0.2 s budget skips the long shapes; no SDPA. At the
        # GPU's own clocks: ncu locks them to base by default, which METHOD.md forbids.
        # The register-fragment kernels (forward, dK/dV, dQ) at 8192 tokens, head dim 128 (the
        # bench's --fragments).
        if [ "${DRY_RUN:-0}" = 1 ] || command -v ncu >/dev/null; then
            # The register-fragment kernels (what CUDA runs) first: a part cut short keeps them.
            for kernel in ${NCU_KERNELS:-fragment_forward_kernel fragment_key_value_grad_kernel fragment_query_grad_kernel flash_forward_kernel key_value_grad_kernel query_grad_kernel}; do
                args=""
                case "$kernel" in fragment_*) args="--fragments --heads 16 --seqs 8192 --head-dims 128" ;; esac
                step "ncu-$kernel" env ULYSSES_SDPA_SCRIPT=/nonexistent/sdpa.py ncu --set full --clock-control none --launch-count 1 \
                    -k "regex:$kernel" "$here/flash-attention-bench" --budget-secs 0.2 $args
            done
        else
            echo "SKIPPED ncu: Nsight Compute (ncu) is not in this image"
        fi ;;
    *) echo "KERNELS_RUN must be tests, named, big, bench or ncu, not ${KERNELS_RUN}" >&2; exit 2 ;;
    esac
fi
if has training-memory-bench; then
    # Longest-sequence trials pack documents of 4096 tokens: the step's memory does not depend
    # on the mask (tested), and attention then costs linear time instead of many minutes per
    # trial. The budget includes the parameters; each trial is a child process, killed past
    # --trial-timeout. CubeCL's compilation cache (configured by a cubecl.toml in the working
    # folder or above) spares every trial after the first the kernels' compilation; under
    # scripts/gpu-call.sh it is the call's, kept across calls (GPU_CALL_COMPILATION_CACHE).
    mkdir -p /tmp/memory-run
    # CubeCL's logs straight into the part's folder (a part killed at its limit keeps them),
    # emptied first (CubeCL appends).
    memory_logs="$out/memory-logs"
    rm -rf "$memory_logs" && mkdir -p "$memory_logs"
    # Autotune (burn's matmuls try several kernels per new shape) at its least effort, cached
    # across trials too (under gpu-call.sh in the call's cache folder, which comes back and is
    # carried to the next call); both logs come back with the step's, to show where a trial's time goes.
    cat >/tmp/memory-run/cubecl.toml <<TOML
[compilation]
cache = { file = "${GPU_CALL_COMPILATION_CACHE:-/tmp/memory-run/cubecl-cache}" }
logger = { level = "basic", file = "$memory_logs/compilation.log" }
[autotune]
level = "minimal"
cache = { file = "${GPU_CALL_CACHE:-/tmp/memory-run}/autotune-memory" }
logger = { level = "minimal", file = "$memory_logs/autotune.log" }
TOML
    # MEMORY_PROFILE=1: CubeCL times every kernel on the device and, at each device sync (the
    # bench's --phases syncs at every phase), writes a table of kernel time by kernel name to
    # profile.log: a phase's kernel time against its wall time says whether the GPU or the
    # host holds it up. Each kernel is timed alone, so the step runs slower.
    if [ "${MEMORY_PROFILE:-0}" = 1 ]; then
        cat >>/tmp/memory-run/cubecl.toml <<TOML
[profiling]
logger = { level = "basic", file = "$memory_logs/profile.log" }
TOML
    fi
    # MEMORY_POOLS=exact: CubeCL's persistent pool for every allocation (cubecl.toml's
    # persistent_memory = "enforced": a buffer of each tensor's own size, reused only by a
    # tensor of that size; with MEMORY_CLEANUP=1 the free ones are given back before each
    # piece's backward), against its default sliced pages (pages up to a quarter of the
    # device, shared by tensors of many sizes): reserved against used, side by side.
    # MEMORY_POOLS=exclusive: CubeCL's exclusive pages (a buffer per tensor in 24 size classes,
    # unused ones given back; ULYSSES_MEMORY_POOLS, through the patched cubecl-cuda).
    case "${MEMORY_POOLS:-sliced}" in
        sliced) ;;
        exact) printf '[memory]\npersistent_memory = "enforced"\n' >>/tmp/memory-run/cubecl.toml ;;
        exclusive) export ULYSSES_MEMORY_POOLS=exclusive; memory_pools_set=1 ;;
        *) echo "MEMORY_POOLS must be sliced, exact or exclusive, not ${MEMORY_POOLS}" >&2; exit 2 ;;
    esac
    pushd /tmp/memory-run >/dev/null
    bench="$here/training-memory-bench"
    # Each phase's wall time is printed under its trial, also when the trial timed out; a second
    # step per trial (MEMORY_TRIAL_STEPS=2) times the step without compilation and autotuning.
    # A trial ends 25 s before the part's limit (gpu-call.sh's), so its phases are printed.
    trial_timeout=${MEMORY_TRIAL_TIMEOUT:-$(( ${GPU_CALL_PART_SECONDS:-125} > 55 ? ${GPU_CALL_PART_SECONDS:-125} - 25 : 30 ))}
    # Profiled, a second step (no compilation or tuning in it) by default.
    trial_steps=${MEMORY_TRIAL_STEPS:-$([ "${MEMORY_PROFILE:-0}" = 1 ] && echo 2 || echo 1)}
    longest="--shape llama-8b --longest-under 80000000000 --documents ${MEMORY_DOCUMENTS:-4096} --trial-timeout $trial_timeout"
    longest="$longest --phases --trial-steps $trial_steps"
    # MEMORY_UNPROBED=1: the steps after a trial's first run without the per-piece probe (a
    # device sync before each piece's backward, which stalls the offload's copies): compare
    # offload on and off with those steps' seconds.
    unprobed=""
    if [ "${MEMORY_UNPROBED:-0}" = 1 ]; then
        [ "$trial_steps" -ge 2 ] || { echo "MEMORY_UNPROBED=1 times a trial's steps after the first: set MEMORY_TRIAL_STEPS=2 or more" >&2; exit 2; }
        unprobed="--unprobed-steps"
    fi
    # MEMORY_CLEANUP=1: before each piece's backward the pools give back the pages no tensor
    # holds (CubeCL 0.10's CUDA pools take no options): reserved against used, with and without.
    cleanup=""
    [ "${MEMORY_CLEANUP:-0}" = 1 ] && cleanup="--memory-cleanup"
    longest="$longest $cleanup"
    case "${MEMORY_RUN:-alst}" in
    alst)
        # Everything ALST uses, on a Llama-3.1-8B-shaped stack of 2 layers: checkpointing
        # offloaded, the token-wise parts in tiles of d_model tokens, bf16. Goal: 1M tokens.
        # Bisection from 512K to 2M in steps of 128K: at most 4 trials of 100 s.
        offload="--offload-to-host"
        [ "${MEMORY_OFFLOAD:-1}" = 0 ] && offload=""
        step memory-alst "$bench" $longest --layers 2 --min-seq "${MEMORY_MIN_SEQ:-524288}" --max-seq "${MEMORY_MAX_SEQ:-2097152}" --step-tokens 131072 \
            --checkpoint-layers $offload $unprobed --tile-tokens "${MEMORY_TILE_TOKENS:-4096}" --precision bf16 ;;
    layers4)
        # 4 layers in f32, plain and checkpointed (offloaded).
        step memory-layers4-plain "$bench" $longest --layers 4 --min-seq 8192 --max-seq 262144 --step-tokens 8192
        step memory-layers4-checkpointed "$bench" $longest --layers 4 --min-seq 65536 --max-seq 1048576 --step-tokens 32768 --checkpoint-layers --offload-to-host $unprobed ;;
    table)
        # Memory of one step against S (the example's shape), plain and checkpointed.
        step memory-table-plain "$bench" --seqs 4096,8192,16384,32768,65536
        step memory-table-checkpointed "$bench" --seqs 4096,8192,16384,32768,65536 --checkpoint-layers --offload-to-host $cleanup ;;
    overhead)
        # The UlyssesBackend decorator without a group against the plain autodiff backend: the
        # same MLP steps interleaved, equal losses to the bit, the ratio (goal: at most 1.02).
        step decorator-overhead "$here/decorator-overhead-bench" ${OVERHEAD_ARGS:-} ;;
    *) echo "MEMORY_RUN must be alst, layers4, table or overhead, not ${MEMORY_RUN}" >&2; exit 2 ;;
    esac
    popd >/dev/null
    # The memory bench's pools only: the trainer's runs below keep CubeCL's default.
    [ "${memory_pools_set:-0}" = 1 ] && unset ULYSSES_MEMORY_POOLS
fi
# Two ranks on the one GPU: a host id each (or NCCL refuses a duplicate GPU), so NCCL talks
# over sockets; on loopback, with InfiniBand off.
two_ranks_on_one_gpu="NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo NCCL_HOSTID=host\$RANK"
if has ulysses-nccl-check; then
    step nccl-check-1 "$here/ulysses-launch" --nproc-per-node 1 -- "$here/ulysses-nccl-check"
    step nccl-check-2 env ULYSSES_GPU=0 "$here/ulysses-launch" --nproc-per-node 2 -- sh -c "$two_ranks_on_one_gpu exec $here/ulysses-nccl-check"
    # Rank 1 ends its process while rank 0 waits for it in an all-reduce: rank 0 stops within
    # PeerWatch::GRACE (10 s) and a few seconds, naming it (it waited out the 600 s timeout
    # before). Connections made at the first collective, so that it waits for rank 1.
    step nccl-check-leave env ULYSSES_GPU=0 ULYSSES_NCCL_CHECK_LEAVE=1 NCCL_RUNTIME_CONNECT=1 "$here/ulysses-launch" --nproc-per-node 2 -- sh -c "$two_ranks_on_one_gpu exec $here/ulysses-nccl-check"
fi
if has ulysses-trainer; then
    case "${TRAIN_RUN:-check}" in
    check)
        train="--steps 50 --seq-len 2048 --batch-size 2 --corpus ${CORPUS:-/usr/share/common-licenses}"
        # One process: SP=1, and SP=2 as threads sharing the GPU; burn's fused CUDA backend too.
        for sp in 1 2; do
            step "train-sp$sp" "$here/ulysses-trainer" --backend cuda --sp "$sp" $train --out "$out/train-sp$sp"
        done
        step train-fused-sp1 "$here/ulysses-trainer" --backend cuda-fused --sp 1 $train --out "$out/train-fused-sp1"
        # SP=2 as two processes over NCCL on the one GPU.
        step train-sp2-processes "$here/ulysses-launch" --nproc-per-node 2 -- sh -c \
            "$two_ranks_on_one_gpu exec $here/ulysses-trainer --backend cuda --device 0 --sp 2 $train --out $out/train-sp2-processes"
        # The same model in PyTorch (transformers' LlamaForCausalLM, SDPA, bf16 as the trainer's
        # CUDA default), same batch and length: tokens/s and peak memory beside ours.
        step torch-llama python3 "$here/torch_llama_reference.py" --seq-len 2048 --batch-size 2 --dtype bf16 --steps 50
        ratio ratio-sp1 torch-llama train-sp1 ;;
    scale)
        # Tokens/s against S at batch 1, ours (metrics.csv's per-step rate) and PyTorch's on the
        # same model; the first steps compile kernels, so both runs take 16 and time the last.
        for seq in ${TRAIN_SEQS:-4096 16384 65536}; do
            step "train-scale-$seq" "$here/ulysses-trainer" --backend cuda --sp 1 --steps 16 --seq-len "$seq" --batch-size 1 --profile \
                --checkpoint-every 0 --check-parameters-every 0 --eval-every 0 --corpus "$(corpus_for "$seq")" --out "$out/train-scale-$seq"
            step "torch-scale-$seq" python3 "$here/torch_llama_reference.py" --seq-len "$seq" --batch-size 1 --dtype bf16 --steps 16 --warmup 4
            ratio "ratio-scale-$seq" "torch-scale-$seq" "train-scale-$seq"
        done ;;
    hf)
        # Hugging Face shapes from their config.json (benches/hf-shapes: Llama-3.2-1B, Qwen3-0.6B),
        # random weights, bf16, every layer checkpointed, HF_SEQ tokens (16K) per sequence, at
        # SP=1 and SP=2 (two rank threads sharing the one GPU, each holding a model copy), and
        # PyTorch on the same shape (gradient checkpointing, SDPA). --no-save: a 1B model's
        # checkpoint would be 20 GB of the disk.
        # HF_SHAPES, HF_SPS (" ": PyTorch alone), HF_STEPS and HF_SEQ narrow it. --profile: each
        # step's waits on the device (reads, syncs, uploads) in the log. Both sides time the
        # steps after the first HF_WARMUP (1: ours tunes its matmuls in step 0), and a ratio step
        # divides Σ tokens by Σ seconds over those same steps on each side. HF_PURE_HALF=1 runs
        # PyTorch once more in pure bf16 (--pure-half: parameters and AdamW's state in bf16, the
        # second GPU run's baseline) after ours, with its ratio beside.
        seq=${HF_SEQ:-16384}
        corpus=$(corpus_for "$seq")
        hf_torch="--checkpointing --seq-len $seq --batch-size 1 --dtype bf16 --steps ${HF_STEPS:-6} --warmup ${HF_WARMUP:-1} --learning-rate 3e-4"
        for shape in ${HF_SHAPES:-llama-3.2-1b qwen3-0.6b}; do
            # PyTorch first: a part stopped at its limit keeps the baseline every ratio needs.
            step "torch-hf-$shape" python3 "$here/torch_llama_reference.py" --hf-config "$here/hf-shapes/$shape.json" $hf_torch
            for sp in ${HF_SPS:-1}; do
                step "hf-$shape-sp$sp" "$here/ulysses-trainer" --backend cuda --sp "$sp" --steps "${HF_STEPS:-6}" --seq-len "$seq" --batch-size 1 --profile \
                    --learning-rate 3e-4 --checkpoint-layers --no-save --check-parameters-every 0 --eval-every 0 --hf-config "$here/hf-shapes/$shape.json" \
                    --corpus "$corpus" --out "$out/hf-$shape-sp$sp"
                ratio "ratio-hf-$shape-sp$sp" "torch-hf-$shape" "hf-$shape-sp$sp"
            done
            if [ "${HF_PURE_HALF:-0}" = 1 ]; then
                step "torch-hf-$shape-pure-half" python3 "$here/torch_llama_reference.py" --hf-config "$here/hf-shapes/$shape.json" $hf_torch --pure-half
                # Against ours at SP=1, where HF_SPS ran it (PyTorch alone has nothing to divide).
                case " ${HF_SPS:-1} " in
                *" 1 "*) ratio "ratio-hf-$shape-sp1-pure-half" "torch-hf-$shape-pure-half" "hf-$shape-sp1" ;;
                esac
            fi
            # The head and loss as before 2026-11-27 (f32 logits, tensor-op softmax), beside the
            # bf16 head and fused cross-entropy above; HF_OLD_HEAD=1 adds it.
            if [ "${HF_OLD_HEAD:-0}" = 1 ]; then
                step "hf-$shape-sp1-old-head" env ULYSSES_FUSED_CROSS_ENTROPY=0 "$here/ulysses-trainer" --backend cuda --sp 1 --f32-head \
                    --steps "${HF_STEPS:-6}" --seq-len "$seq" --batch-size 1 --profile --learning-rate 3e-4 --checkpoint-layers --no-save \
                    --check-parameters-every 0 --hf-config "$here/hf-shapes/$shape.json" --corpus "$corpus" \
                    --out "$out/hf-$shape-sp1-old-head"
            fi
            # Attention on the planned engine (`cmma`, ULYSSES_FLASH_ENGINE=planned) beside the
            # register fragments the runs above choose on CUDA since 2026-11-30; HF_PLANNED=1 adds it.
            if [ "${HF_PLANNED:-0}" = 1 ]; then
                step "hf-$shape-sp1-planned" env ULYSSES_FLASH_ENGINE=planned "$here/ulysses-trainer" --backend cuda --sp 1 \
                    --steps "${HF_STEPS:-6}" --seq-len "$seq" --batch-size 1 --profile --learning-rate 3e-4 --checkpoint-layers --no-save \
                    --check-parameters-every 0 --hf-config "$here/hf-shapes/$shape.json" --corpus "$corpus" \
                    --out "$out/hf-$shape-sp1-planned"
            fi
        done ;;
    8b)
        # The whole Llama-3.1-8B shape (benches/hf-shapes, 32 layers, random weights) on the one
        # GPU with the optimizer on the host (--offload-optimizer: 12 bytes a parameter, 96 GB of
        # the host; the device keeps bf16 parameters and gradients, 32 GB), every layer
        # checkpointed, the token-wise parts in tiles of 4096. EIGHT_B_SEQS: one run per length
        # (32 768 by default: about 3.2e15 FLOP a step, some 5 minutes at 10.7 TFLOP/s, so one
        # step fits a call with EIGHT_B_STEPS=1 (the default 2 does not); 65 536 is about 9e15,
        # some 14 minutes, more than a call: benches/NEXT-GPU-RUN.md); EIGHT_B_OFFLOAD=1 also keeps the layer inputs on the host (35 × 8 KB a
        # token: 18.8 GB at 64K beside the optimizer's 128.5 GB, more than a 128 GiB machine:
        # refused before step 1, the figures named). EIGHT_B_ZERO3=1
        # runs it under ZeRO-3 (--zero 3: each layer's gradients leave for the host as its
        # backward ends, so the device never holds the 16 GB of bf16 gradients) and
        # EIGHT_B_ZERO3=params keeps the parameters on the host too (--offload-parameters: each
        # layer cast from the host optimizer's f32 master weights as it is uploaded for its
        # pieces, so the host holds 16 bytes a parameter, 128.5 GB, and the device none). Under ZeRO-3 the host AdamW of step N runs beside
        # step N+1's forward; ULYSSES_HOST_ADAMW_SERIAL=1 in the environment makes each step
        # wait for it (the side-by-side: compare step 2's seconds). The log holds the memory line
        # (per rank, before step 1), each step's seconds and waits (--profile), and each layer's
        # forward and backward as the step reaches it, with the seconds and the device's pools
        # (--progress): a step the part's limit stops still says how far it got.
        offload=""
        [ "${EIGHT_B_OFFLOAD:-0}" = 1 ] && offload="--offload-to-host"
        # EIGHT_B_OFFLOAD_LAYERS=N: the first N layers' inputs alone on the host, the rest on
        # the device (what `ulysses-trainer --check --device-memory GB --host-memory GB` names
        # for the longest length that fits the machine).
        [ -n "${EIGHT_B_OFFLOAD_LAYERS:-}" ] && offload="--offload-to-host --offload-layers ${EIGHT_B_OFFLOAD_LAYERS}"
        # EIGHT_B_IN_BACKWARD=1 (under ZeRO-3): the host optimizer updates each layer as its
        # backward ends, no clipping, so the host holds 12 bytes a parameter, not 16 (96.4 GB,
        # not 128.5): room for layer inputs on a 128 GiB host.
        [ "${EIGHT_B_IN_BACKWARD:-0}" = 1 ] && offload="$offload --optimizer-in-backward --max-grad-norm 0"
        case "${EIGHT_B_ZERO3:-0}" in
            0) zero="" ;;
            1) zero="--zero 3" ;;
            params) zero="--zero 3 --offload-parameters" ;;
            *) echo "EIGHT_B_ZERO3 must be 0, 1 or params, not ${EIGHT_B_ZERO3}" >&2; exit 2 ;;
        esac
        for seq in ${EIGHT_B_SEQS:-32768}; do
            step "llama-8b-$seq" "$here/ulysses-trainer" --backend cuda --sp 1 --steps "${EIGHT_B_STEPS:-2}" --seq-len "$seq" --batch-size 1 --profile --progress \
                --offload-optimizer --checkpoint-layers $offload $zero --tile-tokens 4096 --learning-rate 1e-5 --no-save --check-parameters-every 0 --eval-every 0 \
                --hf-config "$here/hf-shapes/llama-3.1-8b.json" --corpus "$(corpus_for "$seq")" --out "$out/llama-8b-$seq" \
                || break  # a longer one would build the 8B model's host state again only to fail
        done ;;
    *) echo "TRAIN_RUN must be check, scale, hf or 8b, not ${TRAIN_RUN}" >&2; exit 2 ;;
    esac
fi

if [ "${#failed[@]}" -gt 0 ]; then
    echo "gpu-run: ${#failed[@]} step(s) failed: ${failed[*]} (logs in $out)"
    exit 1
fi
echo "gpu-run: every step passed (logs in $out)"
