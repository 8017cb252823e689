//! Chat templates against transformers' `apply_chat_template` (`scripts/chat-fixtures.py`, with
//! transformers 5.24): two templates of the kinds Llama 3 and Qwen ship (written for the
//! fixture: special tokens, a system prompt, multi-turn, `{% generation %}` around the answers,
//! whitespace control, `trim`, `loop.first`), four conversations each (one with the generation
//! prompt, one with non-ASCII text), and one of the kind Qwen3 ships with generation blocks
//! added (`thinking`: a `namespace` set in a loop over `messages[::-1]`, reasoning split out of
//! the content or given as `reasoning_content` and kept after the last query alone, tools and
//! tool calls through `tojson`, runs of tool responses, `enable_thinking`), three conversations,
//! rendered and tokenized with the fixture tokenizer and the
//! special tokens transformers added (each folder as `save_pretrained` wrote it; the template in
//! `tokenizer_config.json` for one, `chat_template.jinja` for the other): the text, the ids and
//! the assistant-token mask (`return_assistant_tokens_mask`) equal to transformers', exactly.

use std::path::{Path, PathBuf};

use ulysses_models::{ChatTemplate, TextTokenizer};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

#[test]
fn rendered_text_ids_and_assistant_masks_equal_transformers() {
    for name in ["llama3", "qwen", "thinking"] {
        // The checkpoint's own tokenizer.json: the fixture tokenizer with the template's special
        // tokens added, as transformers saved it.
        let folder = fixtures().join("chat").join(name);
        let tokenizer = TextTokenizer::from_file(&folder).unwrap();
        let template = ChatTemplate::from_checkpoint(&folder).unwrap().expect("the fixture has a chat template");
        assert!(template.marks_answers(), "{name}: the fixture's template marks the answers");
        let expected: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(folder.join("expected.json")).unwrap()).unwrap();
        for (i, case) in expected["cases"].as_array().unwrap().iter().enumerate() {
            let messages = case["messages"].as_array().unwrap();
            let add_generation_prompt = case["add_generation_prompt"].as_bool().unwrap();
            let variables = case["variables"].as_object().cloned().unwrap_or_default();
            let rendered = template.render_with(messages, &variables, add_generation_prompt).unwrap_or_else(|e| panic!("{name} case {i}: {e}"));
            assert_eq!(rendered.text, case["text"].as_str().unwrap(), "{name} case {i}: the rendered text");
            let ulysses_models::TokenizedChat { ids, answers, .. } = template.tokenize_with(&tokenizer, messages, &variables, add_generation_prompt).unwrap();
            let want_ids: Vec<u32> = serde_json::from_value(case["input_ids"].clone()).unwrap();
            let want_mask: Vec<u8> = serde_json::from_value(case["assistant_masks"].clone()).unwrap();
            assert_eq!(ids, want_ids, "{name} case {i}: the token ids");
            assert_eq!(answers.iter().map(|&a| u8::from(a)).collect::<Vec<_>>(), want_mask, "{name} case {i}: the assistant mask");
            println!("{name} case {i}: {} tokens, {} of them the assistant's, as transformers", ids.len(), answers.iter().filter(|&&a| a).count());
        }
    }
}

/// A role the template refuses (its `raise_exception`) is an error naming the template's file
/// and the template's own message; a folder without a template has none.
#[test]
fn a_refused_role_names_the_file_and_a_folder_without_a_template_has_none() {
    let folder = fixtures().join("chat/llama3");
    let template = ChatTemplate::from_checkpoint(&folder).unwrap().unwrap();
    let messages = [serde_json::json!({"role": "tool", "content": "42"})];
    let message = template.render(&messages, false).unwrap_err().to_string();
    assert!(message.contains("tokenizer_config.json") && message.contains("Unknown role: tool"), "{message}");
    assert!(ChatTemplate::from_checkpoint(&fixtures().join("tokenizer")).unwrap().is_none());
}

/// Where a folder has both, `chat_template.jinja` is the template, not `tokenizer_config.json`'s
/// entry: transformers' priority (its `test_chat_template_file_priority`).
#[test]
fn the_template_file_takes_priority_over_the_tokenizer_configs_entry() {
    let folder = std::env::temp_dir().join(format!("ulysses-chat-priority-{}", std::process::id()));
    std::fs::create_dir_all(&folder).unwrap();
    let config = serde_json::json!({"chat_template": "config: {{ messages[0].content }}", "eos_token": "</s>"});
    std::fs::write(folder.join("tokenizer_config.json"), config.to_string()).unwrap();
    std::fs::write(folder.join("chat_template.jinja"), "file: {{ messages[0].content }} {{ eos_token }}").unwrap();
    let messages = [serde_json::json!({"role": "user", "content": "hi"})];
    let template = ChatTemplate::from_checkpoint(&folder).unwrap().unwrap();
    assert_eq!(template.render(&messages, false).unwrap().text, "file: hi </s>");
    assert!(template.file().ends_with("chat_template.jinja"), "{}", template.file());
    // A template file that cannot be read is refused, naming it: read as absent, the config's
    // template (or none) would render the data without a word. Not UTF-8; a Git LFS pointer;
    // a tokenizer_config.json not UTF-8.
    let refused = |folder: &Path| ChatTemplate::from_checkpoint(folder).map(|_| ()).unwrap_err().to_string();
    std::fs::write(folder.join("chat_template.jinja"), b"{{ messages[0].content }} \xff\xfe").unwrap();
    let error = refused(&folder);
    assert!(error.contains("chat_template.jinja: cannot be read") && error.contains("UTF-8"), "{error}");
    std::fs::write(folder.join("chat_template.jinja"), "version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 1234\n").unwrap();
    let error = refused(&folder);
    assert!(error.contains("chat_template.jinja: is a Git LFS pointer") && error.contains("git lfs pull"), "{error}");
    std::fs::remove_file(folder.join("chat_template.jinja")).unwrap();
    let template = ChatTemplate::from_checkpoint(&folder).unwrap().unwrap();
    assert_eq!(template.render(&messages, false).unwrap().text, "config: hi");
    std::fs::write(folder.join("tokenizer_config.json"), b"{\"eos_token\": \"\xff\"}").unwrap();
    let error = refused(&folder);
    assert!(error.contains("tokenizer_config.json: cannot be read"), "{error}");
    std::fs::remove_dir_all(&folder).unwrap();
}

/// A checkpoint with a template named `tool_use` (in `tokenizer_config.json`'s list, or
/// `additional_chat_templates/tool_use.jinja`) renders a conversation given tools with it, and
/// one without tools with `default`, as transformers' `get_chat_template` picks them (the tool
/// lines rendered with `default` before); the data's identity names both.
#[test]
fn a_conversation_given_tools_renders_with_the_tool_use_template() {
    let folder = std::env::temp_dir().join(format!("ulysses-chat-tool-use-{}", std::process::id()));
    let messages = [serde_json::json!({"role": "user", "content": "hi"})];
    let tools = serde_json::json!({"tools": [{"type": "function", "function": {"name": "add"}}]}).as_object().cloned().unwrap();
    let default = "default: {{ messages[0].content }}";
    let tool_use = "tools: {{ tools | length }} {{ messages[0].content }}";
    for in_file in [false, true] {
        let _ = std::fs::remove_dir_all(&folder);
        std::fs::create_dir_all(folder.join("additional_chat_templates")).unwrap();
        let mut named = vec![serde_json::json!({"name": "default", "template": default})];
        match in_file {
            true => std::fs::write(folder.join("additional_chat_templates/tool_use.jinja"), tool_use).unwrap(),
            false => named.push(serde_json::json!({"name": "tool_use", "template": tool_use})),
        }
        std::fs::write(folder.join("tokenizer_config.json"), serde_json::json!({"chat_template": named}).to_string()).unwrap();
        let template = ChatTemplate::from_checkpoint(&folder).unwrap().unwrap();
        assert_eq!(template.render(&messages, false).unwrap().text, "default: hi", "in a file {in_file}");
        assert_eq!(template.render_with(&messages, &tools, false).unwrap().text, "tools: 1 hi", "in a file {in_file}");
        assert!(template.rendering_text().contains(default) && template.rendering_text().contains(tool_use), "in a file {in_file}");
    }
    std::fs::remove_dir_all(&folder).unwrap();
}

/// What a template prints that is no string, and its `string` filter, read as Python's `str`
/// (jinja2's): tool-call arguments as Qwen's coder templates print them, `{'city': 'Paris'}`
/// (minijinja printed `{"city": "Paris"}`), and `1e-05` (it printed `0.00001`). CPython 3's `str`.
#[test]
fn values_that_are_no_string_print_as_python_prints_them() {
    let source = "{%- for m in messages %}{%- for call in m.tool_calls %}{{ call.arguments }}|{{ call.arguments | string }}|{{ call.arguments.rate }}|{{ call.arguments.rate | string }}{%- endfor %}{%- endfor %}";
    let template = ChatTemplate::new(source, Default::default(), "chat_template.jinja").unwrap();
    let call = serde_json::json!({"name": "weather", "arguments": {"city": "Paris", "rate": 1e-05, "days": [1, 2], "metric": true}});
    let messages = [serde_json::json!({"role": "assistant", "tool_calls": [call]})];
    let python = "{'city': 'Paris', 'rate': 1e-05, 'days': [1, 2], 'metric': True}";
    assert_eq!(template.render(&messages, false).unwrap().text, format!("{python}|{python}|1e-05|1e-05"));
}

/// A tool call's arguments written with the template's `tojson` (plain, indented, with
/// separators and sorted keys, ASCII only) render as transformers renders them: Python's
/// `json.dumps`, the arguments' keys in the data's order, `1e-05` and `1e+17` as Python writes
/// floats, nothing escaped for HTML (scripts/chat-tojson-fixture.py).
#[test]
fn tool_calls_written_with_tojson_render_as_transformers_renders_them() {
    let folder = fixtures().join("chat/tojson");
    let expected: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(folder.join("expected.json")).unwrap()).unwrap();
    let messages = expected["messages"].as_array().unwrap();
    let template = ChatTemplate::from_checkpoint(&folder).unwrap().unwrap();
    let rendered = template.render(messages, false).unwrap().text;
    let want = expected["text"].as_str().unwrap();
    assert!(rendered == want, "rendered:\n{rendered}\ntransformers:\n{want}");
}

/// A role the template never names is refused by name (the Qwen-kind template would render
/// it as a user's turn), as is a message without a role; the three standard roles render.
#[test]
fn a_role_the_template_never_names_is_refused() {
    let template = ChatTemplate::from_checkpoint(&fixtures().join("chat/qwen")).unwrap().unwrap();
    let turn = |role: &str| serde_json::json!({"role": role, "content": "hi"});
    let message = template.render(&[turn("user"), turn("narrator")], false).unwrap_err().to_string();
    assert!(message.contains("message 1 has the role \"narrator\", which the chat template never names") && message.contains("chat_template.jinja"), "{message}");
    let message = template.render(&[serde_json::json!({"content": "hi"})], false).unwrap_err().to_string();
    assert!(message.contains("message 0 has no \"role\""), "{message}");
    assert!(template.render(&[turn("system"), turn("user"), turn("assistant")], false).is_ok());
}

/// A template that raises for something else (Qwen3's, for a conversation without a user
/// query) and drops a role it does not name still has that role refused: such a turn rendered
/// as nothing, trained on silently. Tools given as a JSON string, or a list of other than
/// objects, are refused as transformers refuses them (they rendered character by character).
#[test]
fn a_role_dropped_by_a_template_that_raises_for_other_things_and_tools_no_list_are_refused() {
    let source = "{%- if messages | selectattr('role', 'equalto', 'user') | list | length == 0 %}{{ raise_exception('No user query found in messages.') }}{%- endif %}\
                  {%- for m in messages %}{%- if m.role == 'user' %}U: {{ m.content }};{%- elif m.role == 'assistant' %}A: {{ m.content }};{%- endif %}{%- endfor %}";
    let template = ChatTemplate::new(source, Default::default(), "tokenizer_config.json").unwrap();
    let turn = |role: &str, content: &str| serde_json::json!({"role": role, "content": content});
    assert_eq!(template.render(&[turn("user", "hi"), turn("assistant", "hello")], false).unwrap().text, "U: hi;A: hello;");
    let message = template.render(&[turn("user", "hi"), turn("gpt", "hello")], false).unwrap_err().to_string();
    assert!(message.contains("message 1 has the role \"gpt\", which the chat template never names"), "{message}");
    // The template's own refusal, in its words, where it raises.
    let message = template.render(&[turn("assistant", "hello")], false).unwrap_err().to_string();
    assert!(message.contains("No user query found in messages."), "{message}");
    let thinking = ChatTemplate::from_checkpoint(&fixtures().join("chat/thinking")).unwrap().unwrap();
    let schema = serde_json::json!({"type": "function", "function": {"name": "add", "parameters": {}}});
    for (tools, named) in [(serde_json::json!(schema.to_string()), "is a string"), (serde_json::json!([schema.to_string()]), "is a list holding something other than objects")] {
        let variables = serde_json::json!({"tools": tools}).as_object().cloned().unwrap();
        let message = thinking.render_with(&[turn("user", "hi")], &variables, false).unwrap_err().to_string();
        assert!(message.contains(&format!("\"tools\" {named}")) && message.contains("apply_chat_template refuses"), "{message}");
    }
    let variables = serde_json::json!({"tools": [schema]}).as_object().cloned().unwrap();
    assert!(thinking.render_with(&[turn("user", "hi")], &variables, false).is_ok());
}

/// Content that is no string is refused, naming the message and the fix: a template renders a
/// list of parts, a number or a missing content as whatever its author wrote for them (the
/// Qwen3 kind renders anything but a string as nothing), so such data would train silently on
/// empty or mangled turns. A message that carries tool calls may have no content.
#[test]
fn content_that_is_no_string_is_refused() {
    for name in ["llama3", "qwen", "thinking"] {
        let template = ChatTemplate::from_checkpoint(&fixtures().join("chat").join(name)).unwrap().unwrap();
        let user = serde_json::json!({"role": "user", "content": "hi"});
        for (content, names) in [
            (serde_json::json!([{"type": "text", "text": "hello"}]), "a list (of parts, as multimodal data has)"),
            (serde_json::json!(42), "a number"),
            (serde_json::json!(null), "no \"content\""),
            (serde_json::json!({"text": "hello"}), "an object"),
        ] {
            let answer = serde_json::json!({"role": "assistant", "content": content});
            let message = template.render(&[user.clone(), answer], false).unwrap_err().to_string();
            assert!(message.contains(&format!("message 1 (assistant) has {names}")) && message.contains("string"), "{name}, {content}: {message}");
        }
        let missing = serde_json::json!({"role": "assistant"});
        let message = template.render(&[user.clone(), missing], false).unwrap_err().to_string();
        assert!(message.contains("message 1 (assistant) has no \"content\""), "{name}: {message}");
        // Tool calls without content, as OpenAI's format writes them.
        let call = serde_json::json!({"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]});
        assert!(template.render(&[user.clone(), call], false).is_ok(), "{name}: a tool call without content");
    }
}

/// A chat line's `tools` and `chat_template_kwargs` reach the template as transformers passes
/// them (TRL's `SFTTrainer`: `apply_chat_template(messages, tools=..., **chat_template_kwargs)`);
/// the rendering's own variables and the characters that mark answers are refused in the data.
#[test]
fn tools_and_template_arguments_reach_the_template() {
    let source = "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}{% if enable_thinking is defined and not enable_thinking %}[no think]\n{% endif %}\
                  {% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}";
    let template = ChatTemplate::new(source, [("eos_token".to_string(), "</s>".to_string())].into(), "t.jinja").unwrap();
    let messages = [serde_json::json!({"role": "user", "content": "hi"})];
    let variables = serde_json::json!({"tools": [{"type": "function", "function": {"name": "f"}}], "enable_thinking": false});
    let variables = variables.as_object().unwrap();
    let text = template.render_with(&messages, variables, false).unwrap().text;
    assert_eq!(text, "Tools: [{\"type\": \"function\", \"function\": {\"name\": \"f\"}}]\n[no think]\nuser: hi\n");
    assert_eq!(template.render(&messages, false).unwrap().text, "user: hi\n");
    // Without them, `tools` and `documents` are None, as transformers passes them.
    let none_test = "{% if tools is not none %}T{% endif %}{% if documents is not none %}D{% endif %}{% if tools is defined %}d{% endif %}x";
    let none_test = ChatTemplate::new(none_test, Default::default(), "t.jinja").unwrap();
    assert_eq!(none_test.render(&messages, false).unwrap().text, "dx");
    for (name, value) in [("messages", serde_json::json!([])), ("add_generation_prompt", serde_json::json!(true)), ("eos_token", serde_json::json!("x"))] {
        let variables = serde_json::Map::from_iter([(name.to_string(), value)]);
        let message = template.render_with(&messages, &variables, false).unwrap_err().to_string();
        assert!(message.contains(&format!("the template variable {name:?} is set by the rendering itself")), "{message}");
    }
    let marked = [serde_json::json!({"role": "user", "content": "a \u{E000} b"})];
    let message = template.render(&marked, false).unwrap_err().to_string();
    assert!(message.contains("message 0 holds the private-use character U+E000 or U+E001"), "{message}");
}

/// The template names the tokenizer's special tokens as transformers passes them (its
/// `special_tokens_map`): a LlamaTokenizer's `<s>` where tokenizer_config.json names no
/// `bos_token`, the config's own where it names one.
#[test]
fn the_template_is_given_the_tokenizer_classes_default_special_tokens() {
    let dir = std::env::temp_dir().join(format!("ulysses-template-class-tokens-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(fixtures().join("tokenizer-sentencepiece/tokenizer.json"), dir.join("tokenizer.json")).unwrap();
    std::fs::write(dir.join("config.json"), r#"{"model_type": "llama"}"#).unwrap();
    let messages = [serde_json::json!({"role": "user", "content": "hi"})];
    for (config, expected) in [
        (serde_json::json!({"tokenizer_class": "LlamaTokenizerFast", "eos_token": "</s>", "chat_template": "{{ bos_token }}x{{ eos_token }}"}), "<s>x</s>"),
        (serde_json::json!({"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<unk>", "chat_template": "{{ bos_token }}x{{ eos_token }}"}), "<unk>x</s>"),
        // Named null: none, as transformers reads it (no class default).
        (serde_json::json!({"tokenizer_class": "LlamaTokenizerFast", "bos_token": null, "chat_template": "{{ bos_token }}x{{ eos_token }}"}), "x</s>"),
    ] {
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        let tokenizer = TextTokenizer::from_file(&dir).unwrap();
        let template = ChatTemplate::from_checkpoint_for(&dir, Some(&tokenizer)).unwrap().unwrap();
        assert_eq!(template.render(&messages, false).unwrap().text, expected, "{config}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
