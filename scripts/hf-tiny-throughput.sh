#!/usr/bin/env bash
# Fine-tunes each tiny Hugging Face fixture (Llama, Mistral, Qwen2, Qwen3: the checkpoints
# transformers wrote in crates/ulysses-models/tests/fixtures) on documents from the licence
# texts every Debian machine has, with the fixture tokenizer, at SP=1 and SP=2 (threads, on the
# CPU), and prints a table of training tokens/s (the median over steps after the first 3) and
# the first and last losses.
#
#   bash scripts/hf-tiny-throughput.sh [TRAINER] [STEPS]
#
# TRAINER defaults to target/release/ulysses-trainer (cargo build --release -p ulysses-trainer).
set -euo pipefail
cd "$(dirname "$0")/.."

trainer="${1:-target/release/ulysses-trainer}"
steps="${2:-30}"
fixtures=crates/ulysses-models/tests/fixtures
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# One document per paragraph of the licence texts.
python3 - "$work/documents.jsonl" <<'EOF'
import json, pathlib, sys
documents = []
for path in sorted(pathlib.Path("/usr/share/common-licenses").glob("*")):
    if path.is_file():
        documents += [p.strip() for p in path.read_text(errors="replace").split("\n\n") if p.strip()]
with open(sys.argv[1], "w") as out:
    for document in documents:
        out.write(json.dumps({"text": document}) + "\n")
EOF

printf '%-8s %3s %8s %12s %10s %10s\n' model sp seq_len tokens/s first_loss last_loss
for model in llama mistral qwen2 qwen3; do
    seq_len=512
    for sp in 1 2; do
        out="$work/$model-sp$sp"
        "$trainer" --model "$fixtures/$model" --tokenizer "$fixtures/tokenizer/tokenizer.json" --eos-token-id 0 \
            --data "$work/documents.jsonl" --seq-len "$seq_len" --batch-size 8 --steps "$steps" --learning-rate 3e-3 \
            --sp "$sp" --launch threads --no-save --out "$out" > "$out.log" 2>&1 || { cat "$out.log"; exit 1; }
        python3 - "$out/metrics.csv" "$model" "$sp" "$seq_len" <<'EOF'
import csv, statistics, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r["loss"]]
rate = statistics.median(float(r["tokens_per_second"]) for r in rows[3:])
print(f"{sys.argv[2]:<8} {sys.argv[3]:>3} {sys.argv[4]:>8} {rate:>12.0f} {float(rows[0]['loss']):>10.3f} {float(rows[-1]['loss']):>10.3f}")
EOF
    done
done
