#!/usr/bin/env bash
# One device call's work: runs parts of the GPU bundle one after another, each under its own time
# limit, packing every log into $OUT/logs.tar.gz after each part (a call brings back at most 8
# files, and gpu-run.sh writes one log per step; a call stopped at the device's limit still
# returns the parts that ended).
#
#   scripts/gpu-call.sh kernels:tests=240 nccl=60 train=240
#
# A part is FOLDER[:RUN][=SECONDS]: FOLDER one of scripts/gpu-bundle.sh's folders (kernels,
# memory, nccl, train), RUN its KERNELS_RUN, MEMORY_RUN or TRAIN_RUN (else the environment's, else
# tests, alst, check), SECONDS its limit (default 120; a part still running then is killed and
# recorded as status 124). Settings NAME=VALUE before a part are that part's alone, so one call
# can run a part twice, under two settings, side by side (a repeated part's logs go to
# FOLDER-RUN-2, -3, ...):
#
#   scripts/gpu-call.sh memory:alst=200 MEMORY_OFFLOAD=0 memory:alst=200
#
# The bundle comes either as the
# folders in .gpu-bundle or as the compressed .gpu-carry/bundle.tar.xz (all four folders in one
# carry, under the 64 MiB a call takes), unpacked with Python (no xz binary needed).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:?OUT must name the folder whose files come back}"
bundle=.gpu-bundle
if [ ! -d "$bundle/kernels" ] && [ -f .gpu-carry/bundle.tar.xz ]; then
    python3 -m tarfile -e .gpu-carry/bundle.tar.xz . || { echo "gpu-call: cannot unpack the bundle" >&2; exit 1; }
fi
[ -d "$bundle" ] || { echo "gpu-call: no bundle (run scripts/gpu-bundle.sh here, carry .gpu-carry)" >&2; exit 1; }
# This checkout's gpu-run.sh, Python baselines and shapes, not the bundle's copies: the steps and
# baselines may have changed since the build (no rebuild for them, see gpu-bundle.sh).
for folder in "$bundle"/*/; do cp scripts/gpu-run.sh "$folder"; done
cp benches/sdpa_reference.py "$bundle/kernels/"
cp benches/torch_llama_reference.py benches/throughput_ratio.py "$bundle/train/"
rm -rf "$bundle/train/hf-shapes" && cp -r benches/hf-shapes "$bundle/train/"
logs=/tmp/gpu-call-logs
rm -rf "$logs" /tmp/gpu-call-packed && mkdir -p "$logs"
# The host's memory as the trainer checks it (MemAvailable) against what `--check` planned for.
grep -E '^(MemTotal|MemAvailable):' /proc/meminfo >"$logs/meminfo.txt" 2>&1 || true
# The trainer's corpus: the system's licence texts where the image has them, else this
# project's own sources (text either way).
if [ -z "${CORPUS:-}" ]; then
    if [ -d /usr/share/common-licenses ]; then
        export CORPUS=/usr/share/common-licenses
    else
        cat $(find crates kernels-cubecl examples -name '*.rs' | sort) >/tmp/gpu-call-corpus.txt
        export CORPUS=/tmp/gpu-call-corpus.txt
    fi
fi
# CubeCL's compilation and autotune caches, kept across calls and sessions: the lent machine
# starts bare, and the fifth GPU run spent its 900 s compiling (NVRTC, seconds a fragment
# kernel) and tuning (4-45 s a matmul shape), not computing. They come back as
# $OUT/cubecl-cache.tar.xz; carried as .gpu-cache/cubecl-cache.tar.xz (git-ignored: copy the
# returned file there and name .gpu-cache in the call's carry), the next call starts with them.
# Compiled kernels are found by their CUDA source (third_party/README.md, "The PTX cache keyed
# by the source"), so they serve every bundle, and scripts/gpu-bundle.sh adds the flash kernels
# and a training step's (burn's, with their autotune candidates) compiled ahead on the CPU
# (scripts/ptx-cache.sh); tuned choices say which kernel, never what
# it computes. A cubecl.toml in the working folder sets them for every part run from here (the
# memory part runs in a folder with its own).
cache=/tmp/gpu-call-cubecl
mkdir -p "$cache"
# The carried caches are unpacked on a bare machine alone: on a warm one (a call moments ago; it
# goes back 30 s after a call) the machine's own are newer, holding what that call compiled and
# tuned, and CubeCL's cache files are logs that the carried, older copy would replace.
unpacked=/tmp/gpu-call-unpacked
mkdir -p "$unpacked"
if [ ! -f "$unpacked/cubecl" ]; then
    # With Python, as the bundle (the image may have no xz); .tar.gz until 2026-12-01.
    for carried in .gpu-cache/cubecl-cache.tar.xz .gpu-cache/cubecl-cache.tar.gz; do
        if [ -f "$carried" ]; then
            python3 -m tarfile -e "$carried" "$cache" || echo "gpu-call: cannot unpack $carried: every kernel compiles again" >&2
            break
        fi
    done
    touch "$unpacked/cubecl"
fi
# Caches of older bundles, keyed by kernel id, which nothing reads now.
rm -rf "$cache"/compilation-*
export GPU_CALL_COMPILATION_CACHE="$cache/compilation" GPU_CALL_CACHE="$cache"
cat >cubecl.toml <<TOML
[compilation]
cache = { file = "$GPU_CALL_COMPILATION_CACHE" }
[autotune]
cache = { file = "$cache/autotune" }
TOML
# How many compiled kernels the cache holds (one line of its table of contents each): what a
# part adds, it compiled on the GPU, so the CPU's fill did not cover it.
ptx_entries() { cat "$cache"/compilation/cuda/*/ptx-by-source/toc.json.log 2>/dev/null | wc -l; }
# The driver's own cache: loading a module, the driver builds machine code from CubeCL's PTX
# (which CubeCL's cache above keeps, not this), seconds for a register-fragment kernel, again in
# every process. Kept the same way, in its own file ($OUT/nv-cache.tar.gz, carried as
# .gpu-cache/nv-cache.tar.gz) so that one too large to come back cannot keep CubeCL's from
# coming back. The driver keys each entry by its PTX, the driver and the GPU: none is misused.
nv_cache=/tmp/gpu-call-nv
mkdir -p "$nv_cache"
if [ ! -f "$unpacked/nv" ]; then
    [ -f .gpu-cache/nv-cache.tar.gz ] && tar xzf .gpu-cache/nv-cache.tar.gz -C "$nv_cache"
    touch "$unpacked/nv"
fi
unset CUDA_CACHE_DISABLE
# Capped so that its archive stays under the 16 MiB a returned file may have (the driver drops
# the oldest entries past it); `archive` says when it does not.
export CUDA_CACHE_PATH="$nv_cache" CUDA_CACHE_MAXSIZE=$((32 << 20))
# Logs only: the trainer's checkpoints and weights would pass the 16 MiB a returned file may have.
# Packed again after every part, so a call stopped at the device's limit still returns the
# parts that ended.
# `archive NAME FOLDER [TAR OPTIONS...]`: FOLDER packed as $OUT/NAME, written beside, then
# renamed: a call stopped while packing keeps the previous archive whole. A returned file may
# have 16 MiB: past that it says so (the driver's cache is capped above). A folder unchanged since
# its last packing is not packed again. A `.tar.xz` NAME is packed by Python's lzma (the image
# may have no xz binary): CubeCL's cache, the flash kernels' and a 1B training step's PTX text
# (95 MB), is 6.3 MB so against gzip's 13.4 (xz -3, 2026-12-01).
archive() {
    local name=$1 folder=$2
    shift 2
    # When it was last packed: beside, not in $OUT, whose files (8 at most) all come back.
    local packed="/tmp/gpu-call-packed/$name"
    mkdir -p /tmp/gpu-call-packed
    if [ -f "$out/$name" ] && [ -f "$packed" ] && [ -z "$(find "$folder" -newer "$packed" -print -quit)" ]; then
        return
    fi
    touch "$packed.next"
    if [[ $name == *.tar.xz ]]; then
        python3 -c 'import sys, tarfile
with tarfile.open(sys.argv[1], "w:xz", preset=3) as archive:
    archive.add(sys.argv[2], arcname=".")' "$out/$name.part" "$folder"
    else
        tar czf "$out/$name.part" "$@" -C "$folder" .
    fi || { echo "gpu-call: cannot pack $name: the previous one, if any, comes back" >&2; return; }
    mv "$out/$name.part" "$out/$name" && mv "$packed.next" "$packed"
    [ "$(stat -c %s "$out/$name")" -lt $((16 << 20)) ] || echo "gpu-call: $name is over 16 MiB and will not come back" >&2
}
pack() {
    archive logs.tar.gz "$logs" --exclude='*.ulysses' --exclude='*.mpk' --exclude='*.ulysses.*'
    cp "$logs/parts.txt" "$out/parts.txt" 2>/dev/null
    archive cubecl-cache.tar.xz "$cache"
    archive nv-cache.tar.gz "$nv_cache"
}
settings=()
for part in "$@"; do
    # A setting for the next part (upper-case names; folders are lower-case).
    if [[ $part =~ ^[A-Z_][A-Z0-9_]*= ]]; then
        settings+=("$part")
        continue
    fi
    spec=${part%%=*}
    seconds=120
    [ "$spec" != "$part" ] && seconds=${part#*=}
    folder=${spec%%:*}
    run=""
    [ "$spec" != "$folder" ] && run=${spec#*:}
    name=${spec/:/-}
    if [ -e "$logs/$name" ]; then
        n=2
        while [ -e "$logs/$name-$n" ]; do n=$((n + 1)); done
        name="$name-$n"
    fi
    mkdir -p "$logs/$name"
    echo "== part $name (limit ${seconds} s)${settings[*]:+ with ${settings[*]}}"
    started=$(date +%s)
    entries=$(ptx_entries)
    # timeout signals its whole process group: a part's children (launched ranks) end too.
    env KERNELS_RUN="${run:-${KERNELS_RUN:-tests}}" MEMORY_RUN="${run:-${MEMORY_RUN:-alst}}" TRAIN_RUN="${run:-${TRAIN_RUN:-check}}" \
        OUT="$logs/$name" GPU_CALL_PART_SECONDS="$seconds" ${settings[@]+"${settings[@]}"} \
        timeout --kill-after=10 "$seconds" "$bundle/$folder/gpu-run.sh" 2>&1 | tee "$logs/$name/console.log" | tail -n 40
    status=${PIPESTATUS[0]}
    echo "$name $status $(( $(date +%s) - started ))s, PTX cache $entries + $(( $(ptx_entries) - entries )) compiled here${settings[*]:+, ${settings[*]}}" | tee -a "$logs/parts.txt"
    settings=()
    pack
done
[ "${#settings[@]}" -eq 0 ] || echo "gpu-call: ${settings[*]} after the last part, for no part: not used" >&2
nvidia-smi >"$logs/nvidia-smi.txt" 2>&1
pack
