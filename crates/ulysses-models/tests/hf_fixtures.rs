//! Configs as transformers saves them, read here as transformers reads them: for each family
//! (and Llama with linear and llama3 RoPE; Qwen3 with YaRN; both scalings with their original
//! context beside them, which transformers takes over their own; each family's config.json with
//! its sizes alone, every other key transformers' default),
//! `tests/fixtures/NAME/config.json` is what the
//! family's config class wrote and `resolved.json` what transformers made of it, written by
//! `scripts/hf-fixtures.py` (transformers' version inside). Head dim, kv heads, norm epsilon,
//! tied embeddings and the sliding window equal transformers'; the RoPE inverse frequencies
//! and attention factor equal those its rotary embedding holds within 1e-6 relative
//! (transformers computes them in f32, this crate in f64); and a config written back reads the same.

use std::path::{Path, PathBuf};

use serde_json::Value;
use ulysses_models::{HfConfig, rope::inverse_frequencies};

fn fixtures() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut folders: Vec<PathBuf> = std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().path()).filter(|p| p.join("resolved.json").exists()).collect();
    folders.sort();
    assert_eq!(folders.len(), 15, "the fixtures of scripts/hf-fixtures.py in {}: {folders:?}", root.display());
    folders
}

#[test]
fn every_family_reads_as_transformers_reads_it() {
    for folder in fixtures() {
        let name = folder.file_name().unwrap().to_string_lossy().into_owned();
        let want: Value = serde_json::from_str(&std::fs::read_to_string(folder.join("resolved.json")).unwrap()).unwrap();
        let config = HfConfig::from_hf(&folder).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(config.family.model_type(), want["model_type"], "{name}");
        assert_eq!(config.head_dim as u64, want["head_dim"].as_u64().unwrap(), "{name}: head_dim");
        assert_eq!(config.num_key_value_heads as u64, want["num_key_value_heads"].as_u64().unwrap(), "{name}: kv heads");
        assert_eq!(config.rms_norm_eps, want["rms_norm_eps"].as_f64().unwrap(), "{name}: rms_norm_eps");
        assert_eq!(config.tie_word_embeddings, want["tie_word_embeddings"].as_bool().unwrap(), "{name}: tied embeddings");
        assert_eq!(config.sliding_window.map(|w| w as u64), want["sliding_window"].as_u64(), "{name}: sliding window");
        let scaling = want["attention_scaling"].as_f64().unwrap();
        assert!((config.rope_scaling.attention_factor() - scaling).abs() <= 1e-6 * scaling, "{name}: the attention factor, transformers' {scaling}");

        let expected: Vec<f64> = want["inv_freq"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        let got = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling);
        assert_eq!(got.len(), expected.len(), "{name}");
        let worst = got.iter().zip(&expected).map(|(g, e)| ((g - e) / e).abs()).fold(0.0f64, |a, b| if b.is_nan() || b > a { b } else { a });
        println!("{name} (transformers {}): {} frequencies, largest relative difference {worst:.1e}", want["transformers"], got.len());
        assert!(worst <= 1e-6, "{name}: RoPE frequencies differ from transformers' by {worst:e} (relative)");

        // Written as f32 weights: the same config but for the weights' dtype.
        let again = HfConfig::from_hf_json(&config.to_hf_json("float32").to_string(), "written back").unwrap();
        assert_eq!(again.torch_dtype, Some(burn::tensor::DType::F32), "{name}");
        assert_eq!(HfConfig { torch_dtype: config.torch_dtype, ..again }, config, "{name}: written back and read again");
    }
}

/// `tests/fixtures/tokenizer-bos`: that tokenizer with a BOS of its own and a post-processor
/// that adds it (as Llama 3's does), and a tokenizer_config.json that says `add_bos_token:
/// false`. transformers 5 follows the post-processor, whichever tokenizer class the config
/// names (its `tokenizer(text)` ids are in `encodings.json`); a document here is those ids and
/// the EOS, the BOS once where the text itself begins with it.
#[test]
fn a_document_begins_as_transformers_tokenizer_call_begins_it() {
    let folder = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer-bos");
    let tokenizer = ulysses_models::TextTokenizer::from_file(&folder).unwrap();
    let want: Value = serde_json::from_str(&std::fs::read_to_string(folder.join("encodings.json")).unwrap()).unwrap();
    let (bos, eos) = (tokenizer.token_id("<|begin_of_text|>").unwrap(), tokenizer.token_id("<|endoftext|>").unwrap());
    assert_ne!(bos, eos);
    assert_eq!(tokenizer.added_before_text(), [bos], "the post-processor's BOS");
    let mut begins_with_bos = 0;
    for case in want["encodings"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let mut expected: Vec<u32> = case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(expected[0], bos, "{text:?}: transformers {} adds the BOS", want["transformers"]);
        if text.starts_with("<|begin_of_text|>") {
            assert_eq!(expected[1], bos, "{text:?}: transformers gives it twice");
            expected.remove(0);
            begins_with_bos += 1;
        }
        expected.push(eos);
        assert_eq!(tokenizer.encode_document(text, eos).unwrap(), expected, "{text:?}");
    }
    assert_eq!(begins_with_bos, 1, "a text that begins with the BOS");
}

/// `tests/fixtures/tokenizer-sentencepiece`: a sentencepiece-style BPE as Llama 2 and Mistral
/// ship it (a normalizer that prepends "▁", byte fallback, chat markers), read beside the
/// configs of `encodings.json`'s variants: transformers 5 rebuilds it for a Llama model that
/// names `LlamaTokenizerFast` (`legacy` false, absent or true; `add_prefix_space` false), and
/// reads it as the file has it for a Mistral one. Each document is transformers'
/// `tokenizer(text)` and the EOS, around special tokens and leading spaces too.
#[test]
fn a_sentencepiece_tokenizer_reads_as_transformers_5_rebuilds_it() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer-sentencepiece");
    let want: Value = serde_json::from_str(&std::fs::read_to_string(fixture.join("encodings.json")).unwrap()).unwrap();
    let variants = want["variants"].as_array().unwrap();
    assert!(variants.iter().any(|v| v["differs_from_the_file"] == true) && variants.iter().any(|v| v["differs_from_the_file"] == false));
    for (index, variant) in variants.iter().enumerate() {
        let dir = std::env::temp_dir().join(format!("ulysses-sentencepiece-{}-{index}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(fixture.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
        std::fs::write(dir.join("tokenizer_config.json"), variant["tokenizer_config"].to_string()).unwrap();
        std::fs::write(dir.join("config.json"), serde_json::json!({"model_type": variant["model_type"]}).to_string()).unwrap();
        let tokenizer = ulysses_models::TextTokenizer::from_file(&dir).unwrap();
        let eos = tokenizer.token_id("</s>").unwrap();
        for case in variant["encodings"].as_array().unwrap() {
            let text = case["text"].as_str().unwrap();
            let mut expected: Vec<u32> = case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            expected.push(eos);
            let what = format!("{} with {} ({}): {text:?}", variant["model_type"], variant["tokenizer_config"], variant["class"]);
            assert_eq!(tokenizer.encode_document(text, eos).unwrap(), expected, "{what}");
        }
        std::fs::remove_dir_all(dir).unwrap();
    }
}

/// `tests/fixtures/tokenizer-classes`: which class transformers 5's `AutoTokenizer` reads a
/// folder through, its special tokens, and its ids for texts with digits, a decomposed accent,
/// leading spaces, an apostrophe and special tokens (with what the post-processor adds and
/// without), for the byte-level file of `tokenizer-bos` and the sentencepiece-style one of
/// `tokenizer-sentencepiece` under each model type of the four families (or no config.json) and
/// seventeen tokenizer configs (none among them). Nine only pick the class and its options;
/// eight name special or added tokens the file lacks, or flags, or split special tokens: one
/// names a word of the text as its EOS; one names sep, cls, mask and an image token; one extra
/// special tokens; one lists an added token; one lists a token of the file with other flags;
/// one splits special tokens (and sets add_bos_token and add_eos_token, which transformers 5
/// leaves to the file's post-processor); two are configs from before transformers 4.34 with
/// special_tokens_map.json (and added_tokens.json) beside them. Each folder reads here as that class
/// and gives those ids; of the classes that rebuild the file, each changes the ids of some
/// folder, and each config that names tokens changes them in every folder (else the case would
/// test nothing).
#[test]
fn every_tokenizer_reads_as_transformers_5_picks_its_class() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let want: Value = serde_json::from_str(&std::fs::read_to_string(fixtures.join("tokenizer-classes/encodings.json")).unwrap()).unwrap();
    let texts: Vec<&str> = want["texts"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    let cases = want["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 170, "two files, five model types, seventeen configs");
    let file_ids = |file: &str| cases.iter().find(|c| c["file"] == file && c["model_type"].is_null() && c["tokenizer_config"].is_null()).unwrap()["ids"].clone();
    let ids = |value: &Value| -> Vec<u32> { value.as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect() };
    let mut rebuilt_differently = std::collections::BTreeSet::new();
    let mut changed_by_named_tokens: std::collections::BTreeMap<String, usize> = Default::default();
    let dir = std::env::temp_dir().join(format!("ulysses-tokenizer-classes-{}", std::process::id()));
    for case in cases {
        std::fs::create_dir_all(&dir).unwrap();
        let source = if case["file"] == "byte-level" { "tokenizer-bos" } else { "tokenizer-sentencepiece" };
        std::fs::copy(fixtures.join(source).join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
        if !case["model_type"].is_null() {
            std::fs::write(dir.join("config.json"), serde_json::json!({"model_type": case["model_type"]}).to_string()).unwrap();
        }
        if !case["tokenizer_config"].is_null() {
            std::fs::write(dir.join("tokenizer_config.json"), case["tokenizer_config"].to_string()).unwrap();
        }
        for (name, content) in case["other_files"].as_object().unwrap() {
            std::fs::write(dir.join(name), content.to_string()).unwrap();
        }
        let what = format!("{} file, model type {}, tokenizer_config {}, {:?}", case["file"], case["model_type"], case["tokenizer_config"], case["other_files"]);
        let tokenizer = ulysses_models::TextTokenizer::from_file(&dir).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(tokenizer.transformers_class().name(), case["class"].as_str().unwrap(), "{what}: the class");
        // The special tokens as the class resolves them: the EOS ends each document, as TRL's.
        let special_tokens = case["special_tokens"].as_object().unwrap();
        assert_eq!(special_tokens.len(), 7, "transformers' seven named special tokens");
        for (name, token) in special_tokens {
            assert_eq!(tokenizer.special_token(name), token.as_str(), "{what} ({}): {name}", case["class"]);
        }
        let added = tokenizer.added_before_text().to_vec();
        for ((text, plain), document) in texts.iter().zip(case["ids"].as_array().unwrap()).zip(case["document_ids"].as_array().unwrap()) {
            assert_eq!(tokenizer.encode(text).unwrap(), ids(plain), "{what} ({}): {text:?}", case["class"]);
            // A document: `tokenizer(text)`'s ids (what the post-processor adds once where the
            // text begins with it too), then the EOS.
            let mut expected = ids(document);
            if !added.is_empty() && expected.starts_with(&added) && expected[added.len()..].starts_with(&added) {
                expected.drain(..added.len());
            }
            expected.push(u32::MAX);
            assert_eq!(tokenizer.encode_document(text, u32::MAX).unwrap(), expected, "{what} ({}): {text:?} as a document", case["class"]);
        }
        let options = ["tokenizer_class", "legacy", "add_prefix_space"];
        let names_tokens = case["tokenizer_config"].as_object().is_some_and(|config| config.keys().any(|key| !options.contains(&key.as_str())));
        if case["ids"] != file_ids(case["file"].as_str().unwrap()) {
            if names_tokens {
                *changed_by_named_tokens.entry(case["tokenizer_config"].to_string()).or_default() += 1;
            } else {
                rebuilt_differently.insert(case["class"].as_str().unwrap().to_string());
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
    let expected: std::collections::BTreeSet<String> = ["GPT2Tokenizer", "LlamaTokenizer", "Qwen2Tokenizer"].map(String::from).into();
    assert_eq!(rebuilt_differently, expected, "the classes whose ids differ from the file's somewhere (transformers {})", want["transformers"]);
    assert_eq!(changed_by_named_tokens.len(), 8, "configs that name tokens: {changed_by_named_tokens:#?}");
    assert!(changed_by_named_tokens.values().all(|&folders| folders == 10), "each changes the ids in every folder: {changed_by_named_tokens:#?}");
}

/// `tests/fixtures/tokenizer`: a byte-level BPE the `tokenizers` Python package trained and
/// saved, and its ids for texts with spaces, tabs, new lines, non-ASCII text, an emoji, a
/// special token written in the text, and nothing at all.
#[test]
fn the_tokenizer_gives_the_python_packages_ids() {
    let folder = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer");
    let tokenizer = ulysses_models::TextTokenizer::from_file(&folder).unwrap();
    let want: Value = serde_json::from_str(&std::fs::read_to_string(folder.join("encodings.json")).unwrap()).unwrap();
    let encodings = want["encodings"].as_array().unwrap();
    assert_eq!(encodings.len(), 5);
    for case in encodings {
        let text = case["text"].as_str().unwrap();
        let expected: Vec<u32> = case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(tokenizer.encode(text).unwrap(), expected, "{text:?} (tokenizers {})", want["tokenizers"]);
    }
    let eos = tokenizer.token_id("<|endoftext|>").expect("the special token");
    let document = tokenizer.encode_document("a group.", eos).unwrap();
    assert_eq!(document.last(), Some(&eos));
    assert_eq!(&document[..document.len() - 1], tokenizer.encode("a group.").unwrap().as_slice());
    // Saved after a call that truncated and padded (transformers then writes both into the
    // file): read as transformers' `tokenizer(text)` reads it, neither.
    let mut saved: Value = serde_json::from_str(&std::fs::read_to_string(folder.join("tokenizer.json")).unwrap()).unwrap();
    saved["truncation"] = serde_json::json!({"direction": "Right", "max_length": 3, "strategy": "LongestFirst", "stride": 0});
    saved["padding"] = serde_json::json!({"strategy": {"Fixed": 40}, "direction": "Right", "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"});
    let dir = std::env::temp_dir().join(format!("ulysses-tokenizer-settings-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), saved.to_string()).unwrap();
    let with_settings = ulysses_models::TextTokenizer::from_file(&dir).unwrap();
    let texts = ["a group of words, longer than three tokens.", "a group."];
    assert_eq!(with_settings.encode_documents(&texts, eos).unwrap(), tokenizer.encode_documents(&texts, eos).unwrap());
    assert_eq!(with_settings.encode(texts[0]).unwrap(), tokenizer.encode(texts[0]).unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
    let missing = ulysses_models::TextTokenizer::from_file(&folder.join("absent")).err().expect("refused").to_string();
    assert!(missing.contains("absent") && missing.contains("tokenizer.json"), "{missing}");
}
