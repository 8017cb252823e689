#!/usr/bin/env python3
"""Chat-template fixtures for crates/ulysses-models from the real reference, transformers.

Two chat templates written for the fixture, of the kinds Llama 3 and Qwen ship (special tokens,
a system prompt, multi-turn, `{% generation %}` blocks around the assistant's answers,
whitespace control, `trim`, `loop.first`, `raise_exception`), and one of the kind Qwen3 ships
with generation blocks added (`thinking`: reasoning, tools, tool calls and responses,
`enable_thinking`; its conversations pass template variables), each in
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

# Of the kind Qwen3 ships, with `{% generation %}` added as users add it for assistant-only
# loss: tools listed with `tojson`, the last user query found by walking the messages
# backwards (`[::-1]`, a `namespace` set inside the loop), the reasoning kept only after it
# (`split`, `rstrip`/`lstrip`/`strip` with arguments, `in`, `is string`, `startswith`), tool
# calls and runs of tool responses (`messages[loop.index0 - 1]`), `enable_thinking`.
THINKING = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}\n"
    "    {{- 'Tools you may call:' }}\n"
    "    {%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}\n"
    "    {{- '<|im_end|>\\n' }}\n"
    "{%- elif messages[0].role == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- set state = namespace(looking=true, last_query=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n"
    "    {%- set position = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if state.looking and message.role == 'user' and message.content is string\n"
    "          and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n"
    "        {%- set state.looking = false %}\n"
    "        {%- set state.last_query = position %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- set content = message.content if message.content is string else '' %}\n"
    "    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == 'assistant' %}\n"
    "        {%- set reasoning = '' %}\n"
    "        {%- if message.reasoning_content is string %}\n"
    "            {%- set reasoning = message.reasoning_content %}\n"
    "        {%- elif '</think>' in content %}\n"
    "            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}\n"
    "            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_start|>assistant\\n' }}\n"
    "        {%- generation %}\n"
    "        {%- if loop.index0 > state.last_query and (loop.last or reasoning) %}\n"
    "            {{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "        {%- else %}\n"
    "            {{- content }}\n"
    "        {%- endif %}\n"
    "        {%- for call in message.tool_calls or [] %}\n"
    "            {%- if content or not loop.first %}{{- '\\n' }}{%- endif %}\n"
    "            {%- if call.function %}{%- set call = call.function %}{%- endif %}\n"
    "            {{- '<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}\n"
    "            {{- call.arguments if call.arguments is string else call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>' }}\n"
    "        {%- endgeneration %}\n"
    "        {{- '\\n' }}\n"
    "    {%- elif message.role == 'tool' %}\n"
    "        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}\n"
    "        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}\n"
    "{%- endif %}\n"
)
THINKING_CONVERSATIONS = [
    # Reasoning written into the content: kept for the last turn after the last query only.
    ([{"role": "user", "content": "How many heads?"}, {"role": "assistant", "content": "<think>\nThe config says four.\n</think>\n\nFour."},
      {"role": "user", "content": "And kv heads?"}, {"role": "assistant", "content": "<think>\nTwo, grouped.\n</think>\n\nTwo."}], False, {}),
    # Reasoning as a field, a system prompt, tools, a tool call answered by two tool responses.
    ([{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "Weather in Paris and Lyon?"},
      {"role": "assistant", "content": "", "reasoning_content": "Two calls.", "tool_calls": [
          {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris", "unit": "C"}}},
          {"type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Lyon\"}"}}]},
      {"role": "tool", "content": "18"}, {"role": "tool", "content": "21"},
      {"role": "assistant", "content": "Paris 18 °C, Lyon 21 °C."}], False,
     {"tools": [{"type": "function", "function": {"name": "weather", "description": "Current temperature",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]}),
    # The generation prompt with thinking turned off.
    ([{"role": "user", "content": "Say hi."}], True, {"enable_thinking": False}),
]


TEMPLATES = {
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
    "qwen": (QWEN, None, "<|im_end|>"),
    "thinking": (THINKING, None, "<|im_end|>"),
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
        conversations = THINKING_CONVERSATIONS if name == "thinking" else [(m, g, {}) for m, g in CONVERSATIONS]
        for messages, add_generation_prompt, variables in conversations:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **variables)
            encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                                    add_generation_prompt=add_generation_prompt, **variables)
            cases.append({"messages": messages, "add_generation_prompt": add_generation_prompt, "variables": variables, "text": text,
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
