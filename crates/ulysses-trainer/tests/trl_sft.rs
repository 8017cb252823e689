//! Fine-tuning lines read as TRL's `SFTTrainer` prepares them (`scripts/trl-fixtures.py`, TRL
//! 1.16 with transformers 5.24; `tests/fixtures/trl/expected.json`): texts, prompts with
//! completions (one whose prompt ends in a space the completion's first token takes, ones
//! that end in the EOS already), conversations with reasoning, tools and tool calls and
//! template arguments, a conversational prompt with its completion, and lines already
//! tokenized; texts and prompts again with a tokenizer that adds a BOS before each text. Each
//! line, read by the trainer's `DocumentReader` with the chat fixture's tokenizer and
//! Qwen3-kind template (`--loss-on assistant`, TRL's `assistant_only_loss` for conversations),
//! or `tokenizer-bos`, gives TRL's token ids, and trains on the tokens TRL's labels train on (the
//! first token's label is never used: no token comes before it).

use std::path::Path;

use serde_json::Value;
use ulysses_models::{ChatTemplate, TextTokenizer, TokenizerConfig};
use ulysses_trainer::documents::{DocumentReader, LossOn, document_eos};

#[test]
fn every_kind_of_line_reads_as_trls_sft_trainer_prepares_it() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let want: Value = serde_json::from_str(&std::fs::read_to_string(root.join("tests/fixtures/trl/expected.json")).unwrap()).unwrap();
    let dir = std::env::temp_dir().join(format!("ulysses-trl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut failures = Vec::new();
    let cases = want["cases"].as_array().unwrap();
    assert!(!cases.is_empty(), "expected.json holds no cases");
    for case in cases {
        let folder = case["tokenizer"].as_str().unwrap();
        let checkpoint = root.join("../ulysses-models/tests/fixtures").join(folder);
        let tokenizer = TextTokenizer::from_file(&checkpoint).unwrap();
        // As the trainer reads it: with the tokenizer's special tokens.
        let template = ChatTemplate::from_checkpoint_for(&checkpoint, Some(&tokenizer)).unwrap();
        // The EOS the trainer resolves (no --eos-token-id, no config.json) is transformers'.
        let (eos, _) = document_eos(None, Some((&tokenizer, &TokenizerConfig::read(&checkpoint).unwrap())), None).unwrap();
        assert_eq!(Some(eos), tokenizer.token_id(want["eos_tokens"][folder].as_str().unwrap()), "{folder}: the EOS");
        let file = dir.join("line.jsonl");
        std::fs::write(&file, case["line"].to_string()).unwrap();
        let reader = DocumentReader { tokenizer: Some(&tokenizer), eos, vocab: 320, progress: false, chat: template.as_ref(), loss_on: LossOn::Assistant, refuse_longer_than: None, truncate_longer_than: None, noted: Default::default() };
        let what = format!("{folder} {}", case["line"]);
        let documents = match reader.read(&file) {
            Ok(documents) => documents,
            Err(e) => {
                failures.push(format!("{what}: {e}"));
                continue;
            }
        };
        assert_eq!(documents.ids.len(), 1, "{what}");
        let ids = &documents.ids[0];
        let targets = documents.targets.as_ref().map_or_else(|| vec![true; ids.len()], |t| t[0].clone());
        let want_ids: Vec<i64> = serde_json::from_value(case["input_ids"].clone()).unwrap();
        let labels: Vec<i64> = serde_json::from_value(case["labels"].clone()).unwrap();
        let want_targets: Vec<bool> = labels.iter().map(|&label| label != -100).collect();
        if ids != &want_ids {
            failures.push(format!("{what}: ids {ids:?}, TRL's {want_ids:?}"));
        } else if targets[1..] != want_targets[1..] {
            failures.push(format!("{what}: targets {targets:?}, TRL's {want_targets:?}"));
        } else {
            println!("{what}: {} tokens, {} trained on, as TRL {}", ids.len(), targets[1..].iter().filter(|&&t| t).count(), want["trl"]);
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(failures.is_empty(), "{} of {} lines otherwise than TRL prepares them:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

/// Under `--loss-on assistant` both kinds of conversation line need a template that marks the
/// answers (TRL's `assistant_only_loss` raises without them): the fixture's template with its
/// `{% generation %}` tags taken out is refused for each, naming the line and `--loss-on
/// completion`, TRL's defaults, which need no marks.
/// A conversational prompt whose completion holds no answer (a tool's response alone) trains
/// nothing, where TRL refuses the data: read, with no target.
#[test]
fn conversations_need_a_template_that_marks_answers_to_train_on_answers_alone() {
    let checkpoint = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ulysses-models/tests/fixtures/chat/thinking");
    let tokenizer = TextTokenizer::from_file(&checkpoint).unwrap();
    let marking = ChatTemplate::from_checkpoint_for(&checkpoint, Some(&tokenizer)).unwrap().unwrap();
    let source = std::fs::read_to_string(checkpoint.join("chat_template.jinja")).unwrap();
    let unmarked = source.replace("{%- generation %}", "").replace("{%- endgeneration %}", "");
    assert_ne!(unmarked, source, "the fixture's template marks its answers");
    let unmarked = ChatTemplate::new(&unmarked, Default::default(), "unmarked.jinja").unwrap();
    let eos = tokenizer.token_id("<|im_end|>").unwrap();
    let dir = std::env::temp_dir().join(format!("ulysses-trl-unmarked-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let read_for = |loss_on: LossOn, template: &ChatTemplate, line: &str| {
        let file = dir.join("line.jsonl");
        std::fs::write(&file, line).unwrap();
        let reader = DocumentReader { tokenizer: Some(&tokenizer), eos, vocab: 320, progress: false, chat: Some(template), loss_on, refuse_longer_than: None, truncate_longer_than: None, noted: Default::default() };
        reader.read(&file)
    };
    let read = |template: &ChatTemplate, line: &str| read_for(LossOn::Assistant, template, line);
    let messages = r#"{"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}]}"#;
    let prompt_completion = r#"{"prompt": [{"role": "user", "content": "Say hi."}], "completion": [{"role": "assistant", "content": "Hi."}]}"#;
    for line in [messages, prompt_completion] {
        let trained = read(&marking, line).unwrap_or_else(|e| panic!("{line}: {e}"));
        assert!(trained.targets.as_ref().unwrap()[0].contains(&true), "{line}: the answer is a target");
        let refused = read(&unmarked, line).err().unwrap_or_else(|| panic!("{line} read with a template that marks no answers"));
        assert!(refused.contains("line 1") && refused.contains("marks no answers") && refused.contains("--loss-on completion"), "{refused}");
    }
    // TRL's defaults (--loss-on completion) need no marks: a conversational prompt/completion
    // line trains its completion whole, the tokens past its prompt's (its answer and what the
    // template closes it with); a conversation trains every token.
    for template in [&marking, &unmarked] {
        let documents = read_for(LossOn::Completion, template, prompt_completion).unwrap();
        let (ids, targets) = (&documents.ids[0], &documents.targets.as_ref().expect("the completion's targets")[0]);
        let prompt = template.tokenize_with(&tokenizer, &serde_json::from_str::<Value>(prompt_completion).unwrap()["prompt"].as_array().unwrap().clone(), &Default::default(), true).unwrap().ids;
        assert_eq!(targets.iter().position(|&t| t), Some(prompt.len()), "targets start past the prompt: {ids:?}");
        assert!(targets[prompt.len()..].iter().all(|&t| t), "the completion whole: {targets:?}");
        let documents = read_for(LossOn::Completion, template, messages).unwrap();
        assert!(documents.targets.is_none(), "a conversation's every token");
    }
    // The fixture's blocks hold each turn's end, `<|im_end|>` (the EOS): the model learns to
    // stop. A template whose blocks close before it trains no stop, which is counted (warned).
    let stopping = |template: &ChatTemplate| {
        let file = dir.join("line.jsonl");
        std::fs::write(&file, messages).unwrap();
        let reader = DocumentReader { tokenizer: Some(&tokenizer), eos, vocab: 320, progress: false, chat: Some(template), loss_on: LossOn::Assistant, refuse_longer_than: None, truncate_longer_than: None, noted: Default::default() };
        reader.read(&file).unwrap();
        reader.noted.answers_before_eos()
    };
    assert_eq!(stopping(&marking), 0, "the fixture's answers hold their end of turn");
    let early = source.replace("{{- '<|im_end|>' }}\n        {%- endgeneration %}", "{%- endgeneration %}\n        {{- '<|im_end|>' }}");
    assert_ne!(early, source, "the fixture's blocks end past <|im_end|>");
    assert_eq!(stopping(&ChatTemplate::new(&early, Default::default(), "early.jinja").unwrap()), 1, "an answer before its end of turn");
    let unanswered = r#"{"prompt": [{"role": "user", "content": "Weather?"}], "completion": [{"role": "tool", "content": "Sunny."}]}"#;
    let documents = read(&marking, unanswered).unwrap();
    assert_eq!(documents.targets.as_ref().unwrap()[0].iter().filter(|&&t| t).count(), 0, "a tool's response is no answer");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Mistral v0.3's way (its template's branches, verbatim where they decide, answers marked):
/// the system prompt rendered only with the last user message, and an assistant message taken
/// as tool calls where `tool_calls` is present and not none. A conversation ending in an
/// answer loses its system prompt, as transformers renders it: counted for a warning. A
/// prompt/completion line whose prompt renders otherwise alone (the system prompt with its
/// last user message) than in the whole is refused, not trained on its user turn. A
/// `tool_calls` of `[]` or `null` (a mixed dataset's) is no call: the answer and its end are
/// rendered, not an empty call.
#[test]
fn a_template_that_moves_the_system_prompt_is_noted_or_refused_and_empty_tool_calls_are_no_call() {
    let source = r#"{%- if messages[0]["role"] == "system" %}{%- set system_message = messages[0]["content"] %}{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}{{- tool_call.function | tojson }}{%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {%- generation %}{{- " " + message["content"]|trim + eos_token}}{%- endgeneration %}
    {%- endif %}
{%- endfor %}"#;
    let checkpoint = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ulysses-models/tests/fixtures/chat/thinking");
    let tokenizer = TextTokenizer::from_file(&checkpoint).unwrap();
    let special = [("bos_token", "<|im_start|>"), ("eos_token", "<|im_end|>")].map(|(name, text)| (name.to_string(), text.to_string())).into();
    let template = ChatTemplate::new(source, special, "mistral-v0.3-kind.jinja").unwrap();
    let eos = tokenizer.token_id("<|im_end|>").unwrap();
    let dir = std::env::temp_dir().join(format!("ulysses-trl-moved-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let read = |line: &str| {
        let file = dir.join("line.jsonl");
        std::fs::write(&file, line).unwrap();
        let reader = DocumentReader { tokenizer: Some(&tokenizer), eos, vocab: 320, progress: false, chat: Some(&template), loss_on: LossOn::Assistant, refuse_longer_than: None, truncate_longer_than: None, noted: Default::default() };
        reader.read(&file).map(|documents| (documents.ids[0].clone(), reader.noted.left_out()))
    };
    let system = r#"{"role": "system", "content": "Be brief."}"#;
    let (user, answer) = (r#"{"role": "user", "content": "Hi"}"#, r#"{"role": "assistant", "content": "Hello"}"#);
    let (_, left_out) = read(&format!(r#"{{"messages": [{system}, {user}, {answer}]}}"#)).unwrap();
    assert_eq!(left_out, 1, "the system prompt is not rendered before an answer");
    let (_, left_out) = read(&format!(r#"{{"messages": [{user}, {answer}]}}"#)).unwrap();
    assert_eq!(left_out, 0, "nothing left out");
    let moved = format!(r#"{{"prompt": [{system}, {user}], "completion": [{answer}]}}"#);
    let refused = read(&moved).unwrap_err();
    assert!(refused.contains("line 1") && refused.contains("renders the prompt alone") && refused.contains("\"messages\""), "{refused}");
    // Every token trains under --loss-on all: where the completion starts is moot.
    let file = dir.join("line.jsonl");
    std::fs::write(&file, &moved).unwrap();
    let every_token = DocumentReader { tokenizer: Some(&tokenizer), eos, vocab: 320, progress: false, chat: Some(&template), loss_on: LossOn::All, refuse_longer_than: None, truncate_longer_than: None, noted: Default::default() };
    every_token.read(&file).unwrap_or_else(|e| panic!("--loss-on all: {e}"));
    let (plain, _) = read(&format!(r#"{{"messages": [{user}, {answer}]}}"#)).unwrap();
    for calls in ["[]", "null"] {
        let answer = format!(r#"{{"role": "assistant", "content": "Hello", "tool_calls": {calls}}}"#);
        let (ids, _) = read(&format!(r#"{{"messages": [{user}, {answer}]}}"#)).unwrap_or_else(|e| panic!("tool_calls {calls}: {e}"));
        assert_eq!(ids, plain, "tool_calls {calls} is no call: the answer and its end are rendered");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
