#!/usr/bin/env python3
"""Loads checkpoints burn-ulysses saved (`save_pretrained`) in transformers and compares their
logits with those transformers gave for the original fixture models.

    ULYSSES_SAVED_HF_DIR=/tmp/saved cargo test -p ulysses-models --test pretrained a_saved_checkpoint
    /var/tmp/hf-venv/bin/python scripts/hf-check-saved.py  # torch and transformers from PyPI /tmp/saved crates/ulysses-models/tests/fixtures

The saved folders are bf16, so the logits differ by bf16's rounding of the weights; what must
hold is that transformers loads each without a missing, unexpected or mis-shaped tensor.
"""
import os
import sys

import torch
import transformers
from safetensors.torch import load_file


def main(saved, fixtures):
    worst = 0.0
    for name in sorted(os.listdir(saved)):
        folder = os.path.join(saved, name)
        model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, dtype=torch.float32)
        problems = {k: v for k, v in info.items() if v}
        assert not problems, f"{name}: {problems}"
        expected = load_file(os.path.join(fixtures, name, "expected.safetensors"))
        with torch.no_grad():
            logits = model.eval()(input_ids=expected["input_ids"], use_cache=False).logits
        difference = (logits - expected["logits"]).abs().max().item()
        worst = max(worst, difference)
        print(f"{name}: {type(model).__name__} loaded, nothing missing or unexpected; logits within {difference:.1e} of the f32 original's (bf16 weights)")
    print(f"transformers {transformers.__version__}: every saved checkpoint loads; largest logit difference {worst:.1e}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
