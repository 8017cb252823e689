#!/usr/bin/env bash
# Prints the path of the test or bench executable TARGET that `cargo CARGO-ARGS...` builds
# (cargo names it in a JSON message), building it if needed:
#
#   scripts/test-executable.sh flash_attention test -p ulysses-kernels --no-run
#
# A failed build, or one that produced no such executable, exits 1 with cargo's messages on
# stderr: a caller never runs or bundles an empty path.
set -euo pipefail
target=$1; shift
path=$(cargo "$@" --message-format=json | python3 -c 'import json, sys
target = sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == target:
        print(m["executable"])' "$target" | tail -n 1) || { echo "test-executable: cargo $* failed" >&2; exit 1; }
[ -n "$path" ] && [ -x "$path" ] || { echo "test-executable: cargo $* built no executable $target" >&2; exit 1; }
echo "$path"
