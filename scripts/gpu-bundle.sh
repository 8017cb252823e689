#!/usr/bin/env bash
# Builds the CUDA binaries that a GPU machine (no Rust toolchain there) runs, strips them and
# puts them in .gpu-bundle/ (git-ignored) with the scripts they need. Carry that folder to the
# GPU machine and run scripts/gpu-run.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=.gpu-bundle
rm -rf "$bundle" && mkdir -p "$bundle"

# Test and bench executables: cargo prints their paths as JSON messages.
executables() {
    cargo "$@" --message-format=json 2>/dev/null \
        | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in ("flash_attention",):
        print(m["executable"])'
}
for exe in $(executables test --release --no-run -p ulysses-kernels --features cuda --test flash_attention); do
    cp "$exe" "$bundle/flash-attention-tests"
done
for exe in $(executables bench --no-run -p ulysses-kernels --features cuda --bench flash_attention); do
    cp "$exe" "$bundle/flash-attention-bench"
done
cargo build --release -p ulysses-nccl --bin ulysses-nccl-check
cargo build --release -p ulysses-dist --bin ulysses-launch
cargo build --release -p ulysses-llama --features cuda
cp target/release/ulysses-nccl-check target/release/ulysses-launch target/release/ulysses-llama "$bundle/"
strip "$bundle"/* 2>/dev/null || true
cp benches/sdpa_reference.py scripts/gpu-run.sh "$bundle/"
du -ah "$bundle"
