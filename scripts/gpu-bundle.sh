#!/usr/bin/env bash
# Builds the CUDA binaries that a GPU machine (no Rust toolchain there) runs, strips them and
# puts them in .gpu-bundle/{kernels,memory,nccl,train} (git-ignored), each under the 64 MiB a
# device call carries (kernels 21 MB, memory 26, nccl 26, train 44 on 2026-11-24). Carry one
# folder per call and run its gpu-run.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=.gpu-bundle
rm -rf "$bundle" && mkdir -p "$bundle"/{kernels,memory,nccl,train}

# Test and bench executables: cargo prints their paths as JSON messages.
executables() {
    cargo "$@" --message-format=json 2>/dev/null \
        | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in ("flash_attention", "training_memory"):
        print(m["executable"])'
}
for exe in $(executables test --release --no-run -p ulysses-kernels --features cuda --test flash_attention); do
    cp "$exe" "$bundle/kernels/flash-attention-tests"
done
for exe in $(executables bench --no-run -p ulysses-kernels --features cuda --bench flash_attention); do
    cp "$exe" "$bundle/kernels/flash-attention-bench"
done
for exe in $(executables bench --no-run -p ulysses-suite --features cuda --bench training_memory); do
    cp "$exe" "$bundle/memory/training-memory-bench"
done
cargo build --release -p ulysses-nccl --bin ulysses-nccl-check
cargo build --release -p ulysses-dist --bin ulysses-launch
cargo build --release -p ulysses-llama --features cuda
cp target/release/ulysses-nccl-check target/release/ulysses-launch "$bundle/nccl/"
cp target/release/ulysses-llama target/release/ulysses-launch "$bundle/train/"
strip "$bundle"/*/* 2>/dev/null || true
cp benches/sdpa_reference.py "$bundle/kernels/"
for part in kernels memory nccl train; do cp scripts/gpu-run.sh "$bundle/$part/"; done
du -ah "$bundle"
