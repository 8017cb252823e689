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
use ulysses_models::{ChatTemplate, TextTokenizer};
use ulysses_trainer::documents::DocumentReader;

#[test]
fn every_kind_of_line_reads_as_trls_sft_trainer_prepares_it() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let want: Value = serde_json::from_str(&std::fs::read_to_string(root.join("tests/fixtures/trl/expected.json")).unwrap()).unwrap();
    let dir = std::env::temp_dir().join(format!("ulysses-trl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut failures = Vec::new();
    for case in want["cases"].as_array().unwrap() {
        let folder = case["tokenizer"].as_str().unwrap();
        let checkpoint = root.join("../ulysses-models/tests/fixtures").join(folder);
        let tokenizer = TextTokenizer::from_file(&checkpoint).unwrap();
        let template = ChatTemplate::from_checkpoint(&checkpoint).unwrap();
        let eos = tokenizer.token_id(want["eos_tokens"][folder].as_str().unwrap()).unwrap();
        let file = dir.join("line.jsonl");
        std::fs::write(&file, case["line"].to_string()).unwrap();
        let reader = DocumentReader { tokenizer: Some(&tokenizer), eos, vocab: 320, progress: false, chat: template.as_ref(), answers_only: true, refuse_longer_than: None, noted: Default::default() };
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
    assert!(failures.is_empty(), "{} of {} lines otherwise than TRL prepares them:\n{}", failures.len(), want["cases"].as_array().unwrap().len(), failures.join("\n"));
}
