#!/usr/bin/env python3
"""Chat-template fixtures for crates/ulysses-models from the real reference, transformers.

Two chat templates written for the fixture, of the kinds Llama 3 and Qwen ship (special tokens,
a system prompt, multi-turn, `{% generation %}` blocks around the assistant's answers,
whitespace control, `trim`, `loop.first`, `raise_exception`), each in
`chat/<name>/` as a checkpoint has it (tokenizer.json with the special tokens added,
tokenizer_config.json, the template in chat_template.jinja or, for llama3, in
tokenizer_config.json); and, for several conversations,
what transformers' `apply_chat_template` makes of them with the fixture tokenizer
(`tokenizer/tokenizer.json`): the rendered text, the token ids, and the assistant-token mask
(`return_assistant_tokens_mask`), in `chat/<name>/expected.json`. CI never runs this.

    python3 -m venv /var/tmp/chat-venv && /var/tmp/chat-venv/bin/pip install transformers jinja2
    /var/tmp/chat-venv/bin/python scripts/chat-fixtures.py crates/ulysses-models/tests/fixtures
"""
import json
import os
import sys

import transformers
from transformers import PreTrainedTokenizerFast

LLAMA3 = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "        {{- raise_exception('Unknown role: ' + message['role']) }}\n"
    "    {%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "    {%- if message['role'] == 'assistant' %}\n"
    "        {%- generation %}\n"
    "            {{- message['content'] | trim + '<|eot_id|>' }}\n"
    "        {%- endgeneration %}\n"
    "    {%- else %}\n"
    "        {{- message['content'] | trim + '<|eot_id|>' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

QWEN = (
    "{%- for message in messages %}\n"
    "{%- if loop.first and message.role != 'system' %}\n"
    "<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n"
    "{% endif %}\n"
    "{%- if message.role == 'assistant' %}\n"
    "<|im_start|>assistant\n"
    "    {% generation %}\n"
    "{{ message.content }}<|im_end|>\n"
    "  {% endgeneration %}\n"
    "{%- else %}\n"
    "<|im_start|>{{ message.role }}\n"
    "{{ message.content }}<|im_end|>\n"
    "\t{% endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "<|im_start|>assistant\n"
    "{% endif %}\n"
)

TEMPLATES = {
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
    "qwen": (QWEN, None, "<|im_end|>"),
}

CONVERSATIONS = [
    ([{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is sequence parallelism?"},
      {"role": "assistant", "content": "Each GPU holds a slice of the sequence."}], False),
    ([{"role": "user", "content": "  Two heads?  "}, {"role": "assistant", "content": "Yes, two."},
      {"role": "user", "content": "And four?"}, {"role": "assistant", "content": " Four, over an all-to-all. "}], False),
    ([{"role": "user", "content": "naïve café, 東京 — ünïcödé"}, {"role": "assistant", "content": "Ça marche: 東京."}], False),
    ([{"role": "system", "content": "Be exact."}, {"role": "user", "content": "Say hi."}], True),
]


def main(out):
    tokenizer_file = os.path.join(out, "tokenizer", "tokenizer.json")
    for name, (template, bos, eos) in TEMPLATES.items():
        tokens = {"eos_token": eos}
        if bos is not None:
            tokens["bos_token"] = bos
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file, **tokens)
        tokenizer.chat_template = template
        cases = []
        for messages, add_generation_prompt in CONVERSATIONS:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                                    add_generation_prompt=add_generation_prompt)
            cases.append({"messages": messages, "add_generation_prompt": add_generation_prompt, "text": text,
                          "input_ids": list(encoded["input_ids"]), "assistant_masks": list(encoded["assistant_masks"])})
        folder = os.path.join(out, "chat", name)
        os.makedirs(folder, exist_ok=True)
        # As a checkpoint holds it: tokenizer.json with the special tokens added, and the
        # template in chat_template.jinja (transformers 5 writes it there); for llama3 moved
        # into tokenizer_config.json, where older checkpoints keep it.
        tokenizer.save_pretrained(folder)
        if name == "llama3":
            config_file = os.path.join(folder, "tokenizer_config.json")
            with open(config_file) as f:
                config = json.load(f)
            config["chat_template"] = template
            with open(config_file, "w") as f:
                json.dump(config, f, indent=2, ensure_ascii=False)
            os.remove(os.path.join(folder, "chat_template.jinja"))
        with open(os.path.join(folder, "expected.json"), "w") as f:
            json.dump({"transformers": transformers.__version__, "cases": cases}, f, indent=1, ensure_ascii=False)
        print(name, [sum(c["assistant_masks"]) for c in cases])


if __name__ == "__main__":
    main(sys.argv[1])
