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
# of TRAIN_RUNS takes two steps of a gpu-run.sh step on `ulysses-trainer --backend
# cuda-compile-only` (an H100's compile-only runtime, a fresh autotune cache), which writes what
# it launched. Its arguments are the GPU run's own, from a dry run of gpu-run.sh (the backend,
# the steps and the run folder replaced), so the two never drift apart. TRAIN_RUNS="" leaves
# them out. Its words (default "llama-3.2-1b:1 8b", the GPU session's plan):
#   SHAPE:SP  the hf part's step for a shape of benches/hf-shapes at HF_SEQ tokens (16 384), SP ranks;
#   8b[:SEQ]  the 8b part as EIGHT_B_ZERO3=params runs it (32 768 tokens by default, as gpu-run.sh), on the Llama-3.1-8B
#             shape cut to 2 layers: every layer launches the same kernels, and the host still
#             holds 16 bytes a parameter (the vocabulary's 1.05 B of 1.49 B), 24 GB resident at
#             the peak. Skipped, with a warning, where memory and swap have less than
#             EIGHT_B_HOST_GB (28): the GPU then compiles those kernels itself.
# FILL_REPORT names a file that gets the plan (`train-runs: ...`, `hf-seq: ...`) and the runs
# skipped (`skipped: ...`): scripts/gpu-bundle.sh keeps them in its mark. The dry run sees
# nothing else of the environment (no KERNELS_RUN, EIGHT_B_OFFLOAD... set for a GPU call); its
# corpus is benches/RESULTS.md unless CORPUS names one (nothing is computed: any text serves).
#
#   scripts/ptx-cache.sh ROOT [PREVIOUS] [TARGETS]
#   scripts/ptx-cache.sh --plan    (the runs it would make, as the report names them)
set -euo pipefail
cd "$(dirname "$0")/.."
# What the training runs compile (the fill's plan): `--plan` prints it, as FILL_REPORT gets it.
# shellcheck disable=SC2086 # one space between words, as the mark compares them
requested=$(echo ${TRAIN_RUNS-llama-3.2-1b:1 8b})
hf_seq=${HF_SEQ:-16384}
plan() { printf 'train-runs: %s\nhf-seq: %s\n' "$requested" "$hf_seq"; }
[ "${1:-}" = --plan ] && { plan; exit 0; }
root=${1:?usage: scripts/ptx-cache.sh ROOT [PREVIOUS] [TARGETS] | --plan}
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
# A stand-in for the bundle's train folder, where gpu-run.sh's dry run prints the commands the GPU
# run will run: the trainer built here, benches/hf-shapes with the 8B shape cut to 2 layers.
train="$runs/train"
mkdir -p "$train/hf-shapes"
cp scripts/gpu-run.sh "$train/"
ln -s "$trainer_bin" "$train/ulysses-trainer"
cp benches/hf-shapes/*.json "$train/hf-shapes/"
python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["num_hidden_layers"] = 2; json.dump(c, open(sys.argv[1], "w"))' \
    "$train/hf-shapes/llama-3.1-8b.json"
# `gpu_run_step PART STEP VAR=VALUE...`: STEP's command in a dry run of gpu-run.sh's TRAIN_RUN
# PART with those variables.
gpu_run_step() {
    local part=$1 step=$2 steps line
    shift 2
    steps=$(env -i PATH="$PATH" HF_SEQ="$hf_seq" CORPUS="${CORPUS:-$PWD/benches/RESULTS.md}" "$@" TRAIN_RUN="$part" DRY_RUN=1 OUT="$runs/dry" \
        bash "$train/gpu-run.sh") || { echo "ptx-cache: gpu-run.sh's dry run of $part ($*) failed" >&2; return 1; }
    while IFS= read -r line; do
        [[ $line == "$step: "* ]] && { echo "${line#"$step: "}"; return 0; }
    done <<<"$steps"
    echo "ptx-cache: gpu-run.sh's dry run of $part ($*) has no step $step" >&2
    return 1
}
# `compile_only PART STEP VAR=VALUE...`: two steps of gpu_run_step's command on the compile-only
# runtime, in a folder named for the step; what it launched joins the fill.
compile_only() {
    local step=$2 work="$runs/$2" command words trainer args=()
    command=$(gpu_run_step "$@")
    read -ra words <<<"$command"
    trainer=${words[0]}
    set -- "${words[@]:1}"
    while [ $# -gt 0 ]; do
        case $1 in
            --backend) args+=(--backend cuda-compile-only); shift ;;
            --steps) args+=(--steps 2); shift ;;
            --out) shift ;;
            *) args+=("$1") ;;
        esac
        shift
    done
    mkdir -p "$work"
    # The trainer keeps its autotune cache apart and empty (OUT/autotune-timed-on-nothing): a
    # choice timed on nothing must never reach a GPU, and a cached one would launch no candidates.
    (cd "$work" && "$trainer" "${args[@]}" --out "$work/out" >"$work/log" 2>&1) \
        || { tail -n 20 "$work/log" >&2; echo "ptx-cache: the compile-only run $step failed" >&2; exit 1; }
    tail -n 1 "$work/log"
    launched+=("$work/out/cuda-sources")
}
skipped=()
for run in $requested; do
    case $run in
        8b | 8b:*)
            seq=${run#8b}
            seq=${seq#:}
            seq=${seq:-32768}
            [[ $seq =~ ^[0-9]+$ ]] || { echo "ptx-cache: 8b takes a sequence length (8b:65536), not $run" >&2; exit 1; }
            have=$(awk '/^(MemAvailable|SwapFree):/ { kib += $2 } END { printf "%d", kib / 1048576 }' /proc/meminfo)
            if [ "$have" -lt "${EIGHT_B_HOST_GB:-28}" ]; then
                echo "ptx-cache: warning: skipping $run: its compile-only run needs ${EIGHT_B_HOST_GB:-28} GB of memory and swap, this machine has $have GB (add swap: fallocate -l 16G F && chmod 600 F && mkswap F && swapon F); the GPU will compile the 8B step's kernels itself" >&2
                skipped+=("$run")
                continue
            fi
            compile_only 8b "llama-8b-$seq" EIGHT_B_ZERO3=params EIGHT_B_SEQS="$seq" ;;
        *)
            shape=${run%%:*} sp=${run##*:}
            [ -f "benches/hf-shapes/$shape.json" ] && [[ $sp =~ ^[0-9]+$ ]] || { echo "ptx-cache: TRAIN_RUNS takes SHAPE:SP words, SHAPE of benches/hf-shapes, or 8b[:SEQ], not $run" >&2; exit 1; }
            compile_only hf "hf-$shape-sp$sp" HF_SHAPES="$shape" HF_SPS="$sp" HF_OLD_HEAD=0 ;;
    esac
done
[ -z "${FILL_REPORT:-}" ] || { plan; echo "skipped: ${skipped[*]}"; } >"$FILL_REPORT"
[ ${#launched[@]} -gt 0 ] && args+=(--launched "$(IFS=,; echo "${launched[*]}")")
CUDA_PATH=$toolkit LD_LIBRARY_PATH="$libs:$toolkit/lib:${LD_LIBRARY_PATH:-}" "$sources_bin" "$sources" "${args[@]}"
