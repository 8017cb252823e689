#!/usr/bin/env python3
"""The `tojson` fixture for crates/ulysses-models: a chat template that writes a tool call's
arguments with transformers' `tojson` filter (plain, indented, with separators and sorted keys,
ASCII-only), and what transformers renders from it, in `chat/tojson/expected.json`. CI never
runs this.

transformers' filter is `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
sort_keys=False)` in an `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`
(transformers/utils/chat_template_utils.py, `_compile_jinja_template`): with transformers
installed that function is used, else the same few lines here (jinja2 alone).

    python3 scripts/chat-tojson-fixture.py crates/ulysses-models/tests/fixtures
"""
import json
import os
import sys

MESSAGES = [{
    "role": "assistant",
    "content": None,
    "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {
        "unit": "celsius",
        "location": "Zürich <CH> & \"Genève\"",
        "days": [1, 2.5, 1e-05, 1e17],
        "when": {},
        "tags": [],
        "ok": True,
        "none": None,
        "line": "a\nb\tc\u0001\u007f",
    }}}],
}]


def compile_template(source):
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
        return _compile_jinja_template(source)
    except ImportError:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        return env.from_string(source)


def main(fixtures):
    folder = os.path.join(fixtures, "chat", "tojson")
    with open(os.path.join(folder, "chat_template.jinja"), encoding="utf-8") as f:
        source = f.read()
    text = compile_template(source).render(messages=MESSAGES, add_generation_prompt=False)
    with open(os.path.join(folder, "expected.json"), "w", encoding="utf-8") as f:
        json.dump({"messages": MESSAGES, "text": text}, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
