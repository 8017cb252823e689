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
cargo build -q -p ulysses-cuda-check --bin ulysses-cuda-sources
sources_bin="${CARGO_TARGET_DIR:-target}/debug/ulysses-cuda-sources"
# cudarc opens libnvrtc.so by that name; NVRTC opens its builtins from the same folder.
libs=$(mktemp -d)
sources=$(mktemp -d)
trap 'rm -rf "$libs" "$sources"' EXIT
ln -s "$toolkit/lib/libnvrtc.so.13" "$libs/libnvrtc.so"
args=(--targets "$targets" --ptx-cache "$root")
[ -n "$previous" ] && [ -d "$previous" ] && args+=(--previous-ptx-cache "$previous")
CUDA_PATH=$toolkit LD_LIBRARY_PATH="$libs:$toolkit/lib:${LD_LIBRARY_PATH:-}" "$sources_bin" "$sources" "${args[@]}"
