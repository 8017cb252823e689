#!/usr/bin/env bash
# Runs the flash kernels' f16 tests on the tensor-core engine (`cmma` fragments) on a CPU:
# host-built test binaries, run through a Debian trixie root's loader and Mesa 26.1's lavapipe,
# which has Vulkan cooperative matrices (scripts/lavapipe-trixie.sh makes the root). Every
# f16 case checks that its plan runs the tensor cores (ULYSSES_EXPECT_ENGINE), so a fallback
# to the plane engine fails. Three fragment shapes:
#   - 8³, what lavapipe reports: the f16 tests (causal, documents, GQA, ragged lengths that are
#     no multiple of a tile, several planes per cube, head dims 40 to 128) but the grouped-query
#     one, whose shape the documents case covers (a cmma shader compiles in minutes here), and
#     head dim 256, which the two runs below cover with the shapes CUDA uses;
#   - 16³, what CUDA's planned engine uses for f16 and bf16 (past 2^31 elements and at head
#     dims the register fragments do not take), forced (ULYSSES_FLASH_FRAGMENT=16; lavapipe executes it though it
#     does not report it): head dim 256, causal, where each kernel is one launch;
#   - 16 x 16 x 8, TF32's shape on CUDA (f32 runs on it there; lavapipe has no TF32), forced
#     with f16 operands (ULYSSES_FLASH_FRAGMENT=16x16x8): head dim 256, causal, where the
#     forward, dQ, dV and dK each take two launches of 128 columns (plan::part_width: the
#     registers of two-step fragments hold 12 accumulator tiles) of two product steps per tile.
#     (The forced runs' documents case, causal with GQA and 150 tokens, went from both,
#     2026-11-30, for CI's minutes: masks, documents and grouped queries do not depend on the
#     fragment's shape, and the 8³ run covers them.)
# A cmma shader takes lavapipe 10-60 s to compile: these minutes are mostly that. The three runs
# go at once, as a run's last shaders leave a core idle: without 16³'s head dim 256, 551 s one
# after the other (CI), 294 s at once; with it, 400 s at once (2 cores, 2026-11-27).
# Prints one line per run with the count and the largest error against the f64 reference.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(scripts/lavapipe-trixie.sh --runner)
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
export ULYSSES_REQUIRE_GPU_RUNTIME=1
# lavapipe has f16 (the cooperative matrices' dtype), not bf16: f16's cases must run, not skip.
export ULYSSES_REQUIRE_DTYPES=f16
# LLVM's optimisation passes off in lavapipe's shader compiler: the runs are mostly compiling
# (the 16³ case: 47 s with them, 40 s without, 2026-11-26), and these tiny cases run as fast.
export GALLIVM_PERF="${GALLIVM_PERF:-nopt}"

exe=$(scripts/test-executable.sh test flash_attention test -p ulysses-kernels --features spirv --test flash_attention --no-run)

# `run NAME ENGINE FILTER...`: the filtered tests, each expected on tensor-cores-ENGINE.
run() {
    local name=$1 fragment=$2; shift 2
    local log
    log=$(mktemp)
    local status=0
    ULYSSES_EXPECT_ENGINE="tensor-cores-$fragment" "$root/ulysses-run" "$exe" --test-threads 2 --nocapture "$@" >"$log" 2>&1 || status=$?
    grep -v "XDG_RUNTIME_DIR" "$log" | grep -E "relative max|panicked|test result" || true
    # Cases run, and the largest error of the forward (output, lse) and of the backward.
    awk -v name="$name" '
        /on tensor-cores-[0-9x]+: relative max/ {
            cases++
            for (i = 1; i <= NF; i++) {
                v = $(i + 1); sub(/,$/, "", v)
                if ($i == "output" || $i == "lse") { if (v + 0 > fwd) fwd = v + 0 }
                if ($i == "dq" || $i == "dk" || $i == "dv") { if (v + 0 > bwd) bwd = v + 0 }
            }
        }
        END { printf "tensor cores %s: %d cases, largest error against f64: forward %.1e, backward %.1e\n", name, cases, fwd, bwd }' "$log"
    local ran=0
    grep -q "on tensor-cores-$fragment" "$log" && ran=1
    rm -f "$log"
    if [ "$status" -ne 0 ] || [ "$ran" -ne 1 ]; then
        echo "tensor-cores-on-cpu: the $name run failed (exit $status)" >&2
        exit 1
    fi
}
# The same kernels' SPIR-V in two processes: one test run twice, Mesa writing each module it is
# given to a file named by the module's hash. Else Mesa's shader cache never hits and every run
# compiles every shader with LLVM again (third_party/README.md, cubecl-opt and cubecl-spirv:
# minutes a run). Its first run also warms the cache for the 8³ run below.
same_modules() {
    local listings=() i dump log status
    log=$(mktemp)
    for i in 1 2; do
        dump=$(mktemp -d)
        status=0
        MESA_SPIRV_DUMP_PATH="$dump" ULYSSES_EXPECT_ENGINE=tensor-cores-8 "$root/ulysses-run" "$exe" --test-threads 1 --nocapture f16_non_causal_odd_head_dim >"$log" 2>&1 || status=$?
        listings+=("$(ls "$dump")")
        rm -rf "$dump"
        if [ "$status" -ne 0 ] || ! grep -q "on tensor-cores-8" "$log"; then
            tail -n 20 "$log" >&2
            echo "tensor-cores-on-cpu: the SPIR-V check's test failed or did not run on the tensor cores (exit $status)" >&2
            exit 1
        fi
    done
    rm -f "$log"
    local modules differ
    modules=$(printf '%s\n' "${listings[0]}" | grep -c . || true)
    if [ "$modules" -eq 0 ]; then
        echo "tensor-cores-on-cpu: Mesa dumped no SPIR-V (MESA_SPIRV_DUMP_PATH): the check cannot compare" >&2
        exit 1
    fi
    if [ "${listings[0]}" != "${listings[1]}" ]; then
        differ=$(comm -23 <(printf '%s\n' "${listings[0]}") <(printf '%s\n' "${listings[1]}") | grep -c . || true)
        echo "tensor-cores-on-cpu: the same test gave other SPIR-V in a second process ($differ of $modules modules differ): CubeCL's compilers iterate randomly seeded maps again (third_party/README.md)" >&2
        exit 1
    fi
    echo "SPIR-V: the same $modules modules in two processes"
}
same_modules
# The three runs at once, each printed in turn once it and those before it are done.
outputs=()
pids=()
# Interrupted: stop every run's test binary too (a background run ignores the terminal's ^C).
stop_runs() {
    for pid in "${pids[@]}"; do
        pkill -TERM -P "$pid" 2>/dev/null || true
        kill -TERM "$pid" 2>/dev/null || true
    done
}
trap 'stop_runs; exit 130' INT TERM
trap 'rm -f "${outputs[@]}"' EXIT
start() {
    local output
    output=$(mktemp)
    outputs+=("$output")
    run "$@" >"$output" 2>&1 &
    pids+=($!)
}
# Every f16 case but the grouped-query one, whose shape f16_causal_documents covers, and head
# dim 256, which the other two runs cover.
start "8x8x8 (lavapipe's own)" 8 f16_non_causal f16_causal_documents
ULYSSES_FLASH_FRAGMENT=16 start "16x16x16 (CUDA's, forced)" 16 f16_causal_head_dim_256
ULYSSES_FLASH_FRAGMENT=16x16x8 start "16x16x8 (TF32's shape, f16 operands, forced)" 16x16x8 f16_causal_head_dim_256
failed=0
for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || failed=1
    cat "${outputs[$i]}"
done
exit "$failed"
