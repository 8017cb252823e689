#!/usr/bin/env python3
"""What TRL's SFTTrainer makes of each kind of fine-tuning line, for
crates/ulysses-trainer/tests/trl_sft.rs: the token ids and labels of its prepared dataset
(`trainer.train_dataset`, before the collator pads or packs), with its defaults but for
`assistant_only_loss` (on for conversations, as the trainer's `--loss-on assistant`) and no
truncation (`max_length=None`). The tokenizer and chat template are those of ulysses-models'
`chat/thinking` fixture (Qwen3's kind, `<|im_end|>` its EOS), and for texts and prompts also
its `tokenizer-bos` (a BOS added before each text); the model its tiny Qwen3.

Each line is prepared alone (a dataset of one row: Arrow makes the rows of a dataset share one
schema, which tool calls of two kinds would not). Writes `trl/expected.json` under the
trainer's test fixtures. CI never runs this.

    python3 -m venv /var/tmp/hf-venv && /var/tmp/hf-venv/bin/pip install torch transformers accelerate trl datasets
    /var/tmp/hf-venv/bin/python scripts/trl-fixtures.py
"""
import json
import os
import sys
import tempfile

import datasets
import transformers
import trl

MODELS = "crates/ulysses-models/tests/fixtures"
OUT = "crates/ulysses-trainer/tests/fixtures/trl"

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Current temperature",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
LINES = [
    # Language modelling: EOS appended, unless the text ends in it.
    {"text": "Sequence parallelism splits a sequence across the GPUs of a group."},
    {"text": "It already ends in the EOS.<|im_end|>"},
    # Prompt and completion: the completion's tokens are trained on, its EOS appended.
    {"prompt": "How many heads does the model have?", "completion": " Four, over two kv heads."},
    {"prompt": "A prompt that ends in a space ", "completion": "joins the completion's first token."},
    {"prompt": "Already ended:", "completion": " yes.<|im_end|>"},
    # Conversations: the answers (the template's generation blocks) are trained on.
    {"messages": [{"role": "user", "content": "How many heads?"}, {"role": "assistant", "content": "<think>\nFour.\n</think>\n\nFour."},
                  {"role": "user", "content": "And kv heads?"}, {"role": "assistant", "content": "Two."}]},
    {"messages": [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
                  {"role": "tool", "content": "18"}, {"role": "assistant", "content": "18 °C."}], "tools": TOOLS},
    {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}], "chat_template_kwargs": {"enable_thinking": False}},
    # Conversational prompt and completion: the completion's answers are trained on.
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Two plus two?"}],
     "completion": [{"role": "assistant", "content": "Four."}]},
    {"prompt": [{"role": "user", "content": "Weather in Paris?"}],
     "completion": [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
                    {"role": "tool", "content": "18"}, {"role": "assistant", "content": "18 °C."}], "tools": TOOLS},
    # Already tokenized: as given.
    {"input_ids": [5, 6, 7, 8, 9]},
    {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9]},
]


# The same kinds with a tokenizer whose post-processor adds a BOS (Llama 3's kind:
# ulysses-models' `tokenizer-bos`, `<|endoftext|>` its EOS): in the prompt and in the whole.
BOS_LINES = [
    {"text": "Sequence parallelism splits a sequence across the GPUs of a group."},
    {"prompt": "How many heads does the model have?", "completion": " Four, over two kv heads."},
    {"prompt": "A prompt that ends in a space ", "completion": "joins the completion's first token."},
    {"prompt": "Already ended:", "completion": " yes.<|endoftext|>"},
]


def prepared(tokenizer, model, lines, folder):
    cases = []
    for line in lines:
        with tempfile.TemporaryDirectory() as out:
            args = trl.SFTConfig(output_dir=out, report_to=[], use_cpu=True, max_length=None,
                                 assistant_only_loss="messages" in line or isinstance(line.get("prompt"), list))
            trainer = trl.SFTTrainer(model=model, args=args, processing_class=tokenizer,
                                     train_dataset=datasets.Dataset.from_list([line]))
            prepared = trainer.train_dataset[0]
        labels = prepared.get("labels", prepared["input_ids"])
        cases.append({"tokenizer": folder, "line": line, "input_ids": list(prepared["input_ids"]), "labels": list(labels)})
        print(f"{folder} {list(line)}: {len(prepared['input_ids'])} tokens, {sum(l != -100 for l in labels)} trained on")
    return cases


def main():
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(MODELS, "qwen3"))
    cases, eos_tokens = [], {}
    for folder, lines in (("chat/thinking", LINES), ("tokenizer-bos", BOS_LINES)):
        tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.join(MODELS, folder))
        eos_tokens[folder] = tokenizer.eos_token
        cases += prepared(tokenizer, model, lines, folder)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump({"trl": trl.__version__, "transformers": transformers.__version__, "eos_tokens": eos_tokens, "cases": cases},
                  f, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        OUT = sys.argv[1]
    main()
