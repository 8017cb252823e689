#!/usr/bin/env bash
# Builds the CUDA binaries that a GPU machine (no Rust toolchain there) runs, strips them and
# puts them in .gpu-bundle/{kernels,memory,nccl,train} (git-ignored), each under the 64 MiB a
# device call carries (kernels 21 MB, memory 26, nccl 26, train 44 on 2026-11-24), and all of
# them compressed in .gpu-carry/bundle.tar.xz (20 MB): carry .gpu-carry and run
# scripts/gpu-call.sh there, which runs gpu-run.sh's parts (KERNELS_RUN / MEMORY_RUN / TRAIN_RUN).
# Then the flash kernels' PTX and burn's of a training step, compiled here into
# .gpu-cache/cubecl-cache.tar.xz (see the end):
# carry .gpu-cache too, from the first call on. Any failed build stops it with cargo's messages.
#
# A bundle is current when it was built from a clean tree whose commit differs from HEAD in
# Markdown alone, and its fill had the plan the fill would have now (TRAIN_RUNS, HF_SEQ:
# `scripts/ptx-cache.sh --plan`). .gpu-carry/bundle.commit holds the commit, the plan and the
# runs the fill skipped. Then nothing is built, and a GPU session starts at once instead of
# 40-60 minutes later. FORCE_BUNDLE=1 builds anyway.
#
# `gpu-bundle.sh --check`: `cargo check` of what the bundle builds, with the trainer's
# compile-only feature too (ptx-cache.sh builds it), in the debug profile: no release build,
# nothing written to the bundle. CI runs it, so that code behind the CUDA features (which the
# workspace's tests never compile) cannot break a GPU session's build unseen (about 3 minutes
# the first time on the 2-core machine, 1 after a change).
set -euo pipefail
cd "$(dirname "$0")/.."

# One cargo invocation for all of them: features unify across its packages, so the burn and
# CubeCL stacks compile once. (Four invocations resolved the kernel tests and bench without
# fusion and tracing, and built both stacks twice: 36m57s on 2026-11-30.) Every one of them
# autotunes burn's kernels (tests/cuda_builds.rs reads this selection).
selection="-p ulysses-kernels -p ulysses-suite -p ulysses-nccl -p ulysses-dist -p ulysses-trainer --features ulysses-kernels/cuda,ulysses-suite/cuda,ulysses-nccl/autotune,ulysses-trainer/cuda"
targets="--test flash_attention --bench flash_attention --bench training_memory --bench decorator_overhead --bin ulysses-nccl-check --bin ulysses-launch --bin ulysses-trainer"
if [ "${1:-}" = --check ]; then
    # shellcheck disable=SC2086 # cargo's arguments
    exec cargo check $selection,ulysses-trainer/compile-only $targets
fi
bundle=.gpu-bundle
mark=.gpu-carry/bundle.commit
# The commit of a clean tree, or nothing where files differ from it (ignored ones aside).
clean_commit() { [ -z "$(git status --porcelain --untracked-files=normal)" ] && git rev-parse HEAD || true; }
# Whether two commits differ in Markdown alone (or in what gpu-call.sh takes from the checkout:
# the run script, the Python baselines, the shapes): the bundle of one is then the other's.
markdown_alone_between() {
    git diff --quiet "$1" "$2" -- . ':(exclude)*.md' ':(exclude)scripts/gpu-run.sh' ':(exclude)scripts/gpu-call.sh' \
        ':(exclude)benches/*.py' ':(exclude)benches/hf-shapes' 2>/dev/null
}
built=$(head -n 1 "$mark" 2>/dev/null || true)
now=$(clean_commit)
# Whether the mark's fill had the plan the fill would have now.
same_plan() { [ "$(sed -n '2,$p' "$mark" | grep -v '^skipped: ')" = "$(bash scripts/ptx-cache.sh --plan)" ]; }
if [ "${FORCE_BUNDLE:-0}" != 1 ] && [ -n "$built" ] && [ -n "$now" ] && [ -f .gpu-carry/bundle.tar.xz ] && [ -f .gpu-cache/cubecl-cache.tar.xz ] \
    && markdown_alone_between "$built" "$now" && same_plan; then
    echo "gpu-bundle: the bundle and kernel cache of $built are current for $now (they differ in Markdown alone): nothing to build (FORCE_BUNDLE=1 builds anyway)"
    skipped=$(sed -n 's/^skipped: //p' "$mark")
    if [ -n "$skipped" ]; then
        echo "gpu-bundle: warning: its kernel cache lacks the compile-only runs its fill skipped ($skipped, for want of memory): the GPU compiles those kernels itself; FORCE_BUNDLE=1 on a machine with the memory adds them"
    fi
    exit 0
fi
rm -f "$mark"
rm -rf "$bundle" && mkdir -p "$bundle"/{kernels,memory,nccl,train}

# shellcheck disable=SC2086 # the selection's and targets' words are cargo's arguments
artifacts=$(cargo build --release $selection $targets --message-format=json-render-diagnostics)
# `executable KIND NAME`: the path of the executable of that kind (test, bench, bin) and name.
executable() { python3 scripts/cargo-executable.py "$1" "$2" <<<"$artifacts"; }
cp "$(executable test flash_attention)" "$bundle/kernels/flash-attention-tests"
cp "$(executable bench flash_attention)" "$bundle/kernels/flash-attention-bench"
cp "$(executable bench training_memory)" "$bundle/memory/training-memory-bench"
cp "$(executable bench decorator_overhead)" "$bundle/memory/decorator-overhead-bench"
for part in nccl train; do cp "$(executable bin ulysses-launch)" "$bundle/$part/"; done
cp "$(executable bin ulysses-nccl-check)" "$bundle/nccl/"
cp "$(executable bin ulysses-trainer)" "$bundle/train/"
for file in "$bundle"/*/*; do strip "$file"; done
cp benches/sdpa_reference.py "$bundle/kernels/"
cp benches/torch_llama_reference.py benches/throughput_ratio.py "$bundle/train/"
cp -r benches/hf-shapes "$bundle/train/"
for part in kernels memory nccl train; do cp scripts/gpu-run.sh "$bundle/$part/"; done
du -ah "$bundle"
# All four folders in one carry (about 20 MB; scripts/gpu-call.sh unpacks it on the GPU machine).
mkdir -p .gpu-carry
tar cf - "$bundle" | xz -T2 -6 >.gpu-carry/bundle.tar.xz
du -h .gpu-carry/bundle.tar.xz
# CubeCL's PTX cache for the calls: the flash kernels of every case the planner may choose on an
# H100 or H200, and burn's kernels of the 1B shape's training step with every autotune candidate
# and of the 8B shape's (TRAIN_RUNS), compiled here with the GPU image's NVRTC
# (scripts/ptx-cache.sh; 634 kernels on 2026-12-01: 22 minutes on 2 cores with the build folder
# warm, 14.5 of them the 8B step's run, which needs swap here), with what
# the last call returned: its tuned choices, and its compiled kernels that the plan still has.
# The first call on a bare GPU then loads them, where the fifth run's calls spent most of their
# time in NVRTC. A failed fill fails the script after the bundle is whole.
old=$(mktemp -d)
fill=$(mktemp -d)
report=$(mktemp)
trap 'rm -rf "$old" "$fill" "$report"' EXIT
# (.tar.gz until 2026-12-01.)
if [ -f .gpu-cache/cubecl-cache.tar.xz ]; then
    tar xJf .gpu-cache/cubecl-cache.tar.xz -C "$old"
elif [ -f .gpu-cache/cubecl-cache.tar.gz ]; then
    tar xzf .gpu-cache/cubecl-cache.tar.gz -C "$old"
fi
# Tuned matmul choices travel on; compiled kernels only where the plan still has them.
[ -d "$old/autotune" ] && cp -r "$old/autotune" "$fill/"
FILL_REPORT=$report bash scripts/ptx-cache.sh "$fill/compilation" "$old/compilation"
mkdir -p .gpu-cache
tar -c -I "xz -T0 -3" -f .gpu-cache/cubecl-cache.tar.xz.part -C "$fill" .
mv .gpu-cache/cubecl-cache.tar.xz.part .gpu-cache/cubecl-cache.tar.xz
rm -f .gpu-cache/cubecl-cache.tar.gz
du -h .gpu-cache/cubecl-cache.tar.xz
# Built from a clean tree, and no file but Markdown changed since: the next run may skip the build.
end=$(clean_commit)
if [ -n "$now" ] && [ -n "$end" ] && markdown_alone_between "$now" "$end"; then
    { echo "$now"; cat "$report"; } >"$mark"
else
    echo "gpu-bundle: built from a tree with uncommitted changes (or changed during the build): the next run builds again"
fi
