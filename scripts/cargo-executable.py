#!/usr/bin/env python3
"""Prints the path of the one executable of KIND (test, bench, bin) named NAME among the JSON
messages of a cargo build on stdin (`--message-format=json...`); exits 1 naming how many it
found otherwise, so a caller never runs or bundles an empty or ambiguous path.

    cargo build ... --message-format=json | scripts/cargo-executable.py KIND NAME
"""
import json
import sys

kind, name = sys.argv[1:]
paths = [m["executable"] for m in map(json.loads, filter(str.strip, sys.stdin))
         if m.get("reason") == "compiler-artifact" and m.get("executable")
         and m["target"]["name"] == name and kind in m["target"]["kind"]]
if len(paths) != 1:
    sys.exit(f"cargo-executable: the build made {len(paths)} {kind} executables named {name}")
print(paths[0])
