#!/usr/bin/env bash
# Prints the path of the executable of KIND (test, bench, bin) and NAME that `cargo CARGO-ARGS...`
# builds (cargo names it in a JSON message), building it if needed:
#
#   scripts/test-executable.sh test flash_attention test -p ulysses-kernels --no-run
#
# A failed build, or one that produced no such executable, exits 1 with cargo's messages on
# stderr: a caller never runs or bundles an empty path.
set -euo pipefail
kind=$1 name=$2; shift 2
path=$(cargo "$@" --message-format=json-render-diagnostics | python3 "$(dirname "$0")/cargo-executable.py" "$kind" "$name") \
    || { echo "test-executable: cargo $* failed or built no $kind executable $name" >&2; exit 1; }
[ -x "$path" ] || { echo "test-executable: $path is not an executable" >&2; exit 1; }
echo "$path"
