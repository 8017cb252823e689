#!/usr/bin/env bash
# Compiles, on this machine (no GPU), the flash kernels a GPU run will launch, with the NVRTC the
# GPU image has (13.0, scripts/cuda-tools.sh 13), into a new CubeCL PTX cache at ROOT: a lent
# GPU then loads them instead of spending NVRTC's seconds on each (the fifth GPU run spent most
# of its 900 s compiling). Entries are keyed by the source, the target and NVRTC's version
# (third_party/README.md, "The PTX cache keyed by the source"). Those the cache at PREVIOUS holds
# are taken from it; nothing else of it is (kernels changed since), so the cache stays the size of
# one plan. TARGETS as `ulysses-cuda-sources` reads them (default: every case the planner may
# choose on an H100 or H200).
#
# The training runs' kernels too: burn's, and each of its autotune candidates, since tuning
# launches every one (the fifth GPU run spent 3m40s tuning the 1B shape's first step). Each run
# of TRAIN_RUNS ("SHAPE:SP" words, shapes of benches/hf-shapes; default llama-3.2-1b:1, the GPU
# session's first) takes two steps of gpu-run.sh's hf part on `ulysses-trainer --backend
# cuda-compile-only` (an H100's compile-only runtime, a fresh autotune cache), which writes what
# it launched; TRAIN_RUNS="" leaves them out.
#
#   scripts/ptx-cache.sh ROOT [PREVIOUS] [TARGETS]
set -euo pipefail
cd "$(dirname "$0")/.."
root=${1:?usage: scripts/ptx-cache.sh ROOT [PREVIOUS] [TARGETS]}
previous=${2:-}
targets=${3:-sm_90a:full}
tools=$(bash scripts/cuda-tools.sh 13)
# The wheel's folder is laid out as a toolkit: include/, include/cccl/, lib/.
toolkit=("$tools"/lib/python3*/site-packages/nvidia/cu13)
toolkit=${toolkit[0]}
[ -f "$toolkit/lib/libnvrtc.so.13" ] || { echo "ptx-cache: no NVRTC 13 in $toolkit" >&2; exit 1; }
# Built without CUDA_PATH, as every other build here: cudarc's build script reads it, and a
# build with it would rebuild cudarc and all above it at the next build without.
# One invocation for both: their shared crates build once.
cargo build -q -p ulysses-cuda-check --bin ulysses-cuda-sources -p ulysses-trainer --bin ulysses-trainer --features ulysses-trainer/compile-only
sources_bin="${CARGO_TARGET_DIR:-target}/debug/ulysses-cuda-sources"
trainer_bin=$(cd "${CARGO_TARGET_DIR:-target}/debug" && pwd)/ulysses-trainer
# cudarc opens libnvrtc.so by that name; NVRTC opens its builtins from the same folder.
libs=$(mktemp -d)
sources=$(mktemp -d)
runs=$(mktemp -d)
trap 'rm -rf "$libs" "$sources" "$runs"' EXIT
ln -s "$toolkit/lib/libnvrtc.so.13" "$libs/libnvrtc.so"
args=(--targets "$targets" --ptx-cache "$root")
[ -n "$previous" ] && [ -d "$previous" ] && args+=(--previous-ptx-cache "$previous")
launched=()
for run in ${TRAIN_RUNS-llama-3.2-1b:1}; do
    shape=${run%%:*} sp=${run##*:}
    [ -f "benches/hf-shapes/$shape.json" ] && [[ $sp =~ ^[0-9]+$ ]] || { echo "ptx-cache: TRAIN_RUNS takes SHAPE:SP words, SHAPE of benches/hf-shapes, not $run" >&2; exit 1; }
    # The trainer keeps its autotune cache apart and empty (OUT/autotune-timed-on-nothing): a
    # choice timed on nothing must never reach a GPU, and a cached one would launch no candidates.
    work="$runs/$shape-sp$sp"
    mkdir -p "$work"
    # gpu-run.sh's hf part, two steps (any text long enough will do for the corpus: nothing is computed).
    (cd "$work" && "$trainer_bin" --backend cuda-compile-only --sp "$sp" --steps 2 --seq-len "${HF_SEQ:-16384}" --batch-size 1 --profile \
        --learning-rate 3e-4 --checkpoint-layers --no-save --check-parameters-every 0 --hf-config "$OLDPWD/benches/hf-shapes/$shape.json" \
        --corpus "$OLDPWD/benches/RESULTS.md" --out "$work/out" >"$work/log" 2>&1) || { tail -n 20 "$work/log" >&2; echo "ptx-cache: the compile-only run $run failed" >&2; exit 1; }
    tail -n 1 "$work/log"
    launched+=("$work/out/cuda-sources")
done
[ ${#launched[@]} -gt 0 ] && args+=(--launched "$(IFS=,; echo "${launched[*]}")")
CUDA_PATH=$toolkit LD_LIBRARY_PATH="$libs:$toolkit/lib:${LD_LIBRARY_PATH:-}" "$sources_bin" "$sources" "${args[@]}"
