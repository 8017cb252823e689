#!/usr/bin/env bash
# Builds the CUDA binaries that a GPU machine (no Rust toolchain there) runs, strips them and
# puts them in .gpu-bundle/{kernels,memory,nccl,train} (git-ignored), each under the 64 MiB a
# device call carries (kernels 21 MB, memory 26, nccl 26, train 44 on 2026-11-24), and all of
# them compressed in .gpu-carry/bundle.tar.xz (20 MB): carry .gpu-carry and run
# scripts/gpu-call.sh there, which runs gpu-run.sh's parts (KERNELS_RUN / MEMORY_RUN / TRAIN_RUN).
# Then the flash kernels' PTX, compiled here into .gpu-cache/cubecl-cache.tar.gz (see the end):
# carry .gpu-cache too, from the first call on. Any failed build stops it with cargo's messages.
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=.gpu-bundle
rm -rf "$bundle" && mkdir -p "$bundle"/{kernels,memory,nccl,train}

tests=$(scripts/test-executable.sh flash_attention test --release --no-run -p ulysses-kernels --features cuda --test flash_attention)
bench=$(scripts/test-executable.sh flash_attention bench --no-run -p ulysses-kernels --features cuda --bench flash_attention)
memory=$(scripts/test-executable.sh training_memory bench --no-run -p ulysses-suite --features cuda --bench training_memory)
overhead=$(scripts/test-executable.sh decorator_overhead bench --no-run -p ulysses-suite --features cuda --bench decorator_overhead)
cp "$tests" "$bundle/kernels/flash-attention-tests"
cp "$bench" "$bundle/kernels/flash-attention-bench"
cp "$memory" "$bundle/memory/training-memory-bench"
cp "$overhead" "$bundle/memory/decorator-overhead-bench"
cargo build --release -p ulysses-nccl --features autotune --bin ulysses-nccl-check
cargo build --release -p ulysses-dist --bin ulysses-launch
cargo build --release -p ulysses-trainer --features cuda
release="${CARGO_TARGET_DIR:-target}/release"
cp "$release/ulysses-nccl-check" "$release/ulysses-launch" "$bundle/nccl/"
cp "$release/ulysses-trainer" "$release/ulysses-launch" "$bundle/train/"
for file in "$bundle"/*/*; do strip "$file"; done
cp benches/sdpa_reference.py "$bundle/kernels/"
cp benches/torch_llama_reference.py "$bundle/train/"
cp -r benches/hf-shapes "$bundle/train/"
for part in kernels memory nccl train; do cp scripts/gpu-run.sh "$bundle/$part/"; done
du -ah "$bundle"
# All four folders in one carry (about 20 MB; scripts/gpu-call.sh unpacks it on the GPU machine).
mkdir -p .gpu-carry
tar cf - "$bundle" | xz -T2 -6 >.gpu-carry/bundle.tar.xz
du -h .gpu-carry/bundle.tar.xz
# CubeCL's PTX cache for the calls: the flash kernels of every case the planner may choose on an
# H100 or H200, compiled here with the GPU image's NVRTC (scripts/ptx-cache.sh; 350 kernels,
# about 14 minutes on 2 cores the first time, seconds for those held already), added to the cache
# the last call returned, if any. The first call on a bare GPU then loads them, where the fifth
# run's calls spent most of their time in NVRTC.
fill=$(mktemp -d)
[ -f .gpu-cache/cubecl-cache.tar.gz ] && tar xzf .gpu-cache/cubecl-cache.tar.gz -C "$fill"
rm -rf "$fill"/compilation-*  # older bundles' caches, keyed by kernel id
bash scripts/ptx-cache.sh "$fill/compilation"
mkdir -p .gpu-cache
tar czf .gpu-cache/cubecl-cache.tar.gz.part -C "$fill" . && mv .gpu-cache/cubecl-cache.tar.gz.part .gpu-cache/cubecl-cache.tar.gz
rm -rf "$fill"
du -h .gpu-cache/cubecl-cache.tar.gz
