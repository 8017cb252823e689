//! Which tokenizer class transformers 5's `AutoTokenizer` reads a checkpoint through, and what
//! that class makes of `tokenizer.json`. The generic class (`TokenizersBackend`, once
//! `PreTrainedTokenizerFast`) reads the file as it is; `LlamaTokenizer`, `Qwen2Tokenizer` and
//! `GPT2Tokenizer` keep only its vocabulary, merges, added tokens and post-processor and build
//! the rest their own way (Qwen's pre-tokenizer splits digits one by one and normalizes to NFC
//! whatever the file says). Which class it is depends on config.json's `model_type` as much as on
//! the `tokenizer_class` tokenizer_config.json names: checked against transformers 5.24 for the
//! four families' model types and none, ten configs and two tokenizer files
//! (`tests/fixtures/tokenizer-classes`, by `scripts/hf-fixtures.py`).

use serde_json::{Value, json};

/// Qwen2Tokenizer's pre-tokenizer pattern (transformers' `PRETOKENIZE_REGEX`).
const QWEN_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A tokenizer class of transformers 5, as far as reading `tokenizer.json` goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransformersClass {
    /// `TokenizersBackend` (`PreTrainedTokenizerFast`): the file as it is.
    FileAsIs,
    /// `LlamaTokenizer`: a sentencepiece-style BPE with byte fallback, no normalizer, a
    /// Metaspace pre-tokenizer.
    Llama,
    /// `Qwen2Tokenizer`: a byte-level BPE after NFC and Qwen's split.
    Qwen2,
    /// `GPT2Tokenizer`: a byte-level BPE with GPT-2's split.
    Gpt2,
    /// A class of its own that this crate does not follow: the file is read as it is.
    Other(String),
    /// A class this crate follows that cannot rebuild this file (`why`: a model that is not a
    /// BPE): the file is read as it is.
    Unfollowed { class: String, why: String },
}

/// The `model_type`s whose class choice [`TransformersClass::for_checkpoint`] follows (checked
/// against transformers); for another, the class the configs name is taken, which may not be
/// transformers' pick.
pub const FOLLOWED_MODEL_TYPES: [&str; 4] = ["llama", "mistral", "qwen2", "qwen3"];

impl TransformersClass {
    /// The class for a checkpoint whose config.json says `model_type`, whose
    /// tokenizer_config.json (or config.json) names `declared`, and whose `tokenizer.json`
    /// mentions `"ByteLevel"` or not (`byte_level`, transformers' own test).
    pub fn for_checkpoint(model_type: Option<&str>, declared: Option<&str>, byte_level: bool) -> Self {
        let declared = declared.map(|class| class.strip_suffix("Fast").unwrap_or(class));
        match model_type {
            // Registered as mistral-common's backend, which takes Mistral's own files alone
            // (tekken.json, params.json); any other folder reads as the file is.
            Some("mistral") => return Self::FileAsIs,
            // Qwen2's Hub configs are on transformers' list of unreliable ones: its own class
            // whatever they name (DeepSeek's Qwen distillations name LlamaTokenizerFast).
            Some("qwen2") => return Self::Qwen2,
            _ => {}
        }
        match declared {
            // A Llama 3 style file under Llama's old class name.
            Some("LlamaTokenizer") if byte_level => Self::FileAsIs,
            None if model_type == Some("qwen3") => Self::Qwen2,
            None | Some("PreTrainedTokenizer" | "TokenizersBackend") => Self::FileAsIs,
            Some("LlamaTokenizer") => Self::Llama,
            Some("Qwen2Tokenizer") => Self::Qwen2,
            Some("GPT2Tokenizer") => Self::Gpt2,
            Some(other) => Self::Other(other.to_string()),
        }
    }

    /// The class's name in transformers.
    pub fn name(&self) -> &str {
        match self {
            Self::FileAsIs => "TokenizersBackend",
            Self::Llama => "LlamaTokenizer",
            Self::Qwen2 => "Qwen2Tokenizer",
            Self::Gpt2 => "GPT2Tokenizer",
            Self::Other(name) => name,
            Self::Unfollowed { class, .. } => class,
        }
    }

    /// Whether the class ends by adding every special token again as a plain one (special,
    /// not normalized, no stripping), which drops the flags a config gave it (Qwen2Tokenizer).
    pub fn adds_special_tokens_again(&self) -> bool {
        *self == Self::Qwen2
    }

    /// Rewrites `file` (tokenizer.json's JSON) as this class rebuilds it, with `config`
    /// (tokenizer_config.json's JSON, `Null` where there is none) for its options. Returns the
    /// special tokens the class's defaults name where the config names none (bos, eos, unk,
    /// pad; transformers adds each that is not an added token yet). `Err`: a file this class
    /// cannot rebuild (not a BPE), which is then read as it is.
    pub fn rebuild(&self, file: &mut Value, config: &Value) -> Result<Vec<(&'static str, &'static str)>, String> {
        let flag = |name: &str, default: bool| config[name].as_bool().unwrap_or(default);
        let (normalizer, pre_tokenizer, decoder, model, defaults) = match self {
            Self::FileAsIs | Self::Other(_) | Self::Unfollowed { .. } => return Ok(Vec::new()),
            Self::Llama => {
                // Prepends "▁" to a text's first piece (`legacy` false, its default), to every
                // piece between special tokens (`legacy` true), or to none.
                let add_prefix_space = flag("add_prefix_space", true);
                let prepend = match (add_prefix_space, flag("legacy", false)) {
                    (false, _) => "never",
                    (true, true) => "always",
                    (true, false) => "first",
                };
                let mut decoders = vec![json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}), json!({"type": "ByteFallback"}), json!({"type": "Fuse"})];
                if add_prefix_space {
                    decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
                }
                (
                    Value::Null,
                    json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": prepend, "split": false}),
                    json!({"type": "Sequence", "decoders": decoders}),
                    json!({"continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true}),
                    vec![("bos_token", "<s>"), ("eos_token", "</s>"), ("unk_token", "<unk>")],
                )
            }
            Self::Qwen2 => (
                json!({"type": "NFC"}),
                json!({"type": "Sequence", "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": QWEN_PATTERN}, "behavior": "Isolated", "invert": false},
                    {"type": "ByteLevel", "add_prefix_space": flag("add_prefix_space", false), "trim_offsets": true, "use_regex": false},
                ]}),
                byte_level_decoder(),
                json!({"continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false}),
                vec![("eos_token", "<|endoftext|>"), ("unk_token", "<|endoftext|>"), ("pad_token", "<|endoftext|>")],
            ),
            Self::Gpt2 => (
                Value::Null,
                json!({"type": "ByteLevel", "add_prefix_space": flag("add_prefix_space", false), "trim_offsets": true, "use_regex": true}),
                byte_level_decoder(),
                json!({"continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false}),
                vec![("bos_token", "<|endoftext|>"), ("eos_token", "<|endoftext|>"), ("unk_token", "<|endoftext|>")],
            ),
        };
        let kind = file["model"]["type"].as_str().unwrap_or("untyped");
        if kind != "BPE" {
            return Err(format!("its model is {kind}, which transformers' {} rebuilds as a BPE", self.name()));
        }
        file["normalizer"] = normalizer;
        file["pre_tokenizer"] = pre_tokenizer;
        file["decoder"] = decoder;
        let fields = file["model"].as_object_mut().ok_or("its model is not a JSON object")?;
        // The class's BPE from the file's vocabulary and merges alone: no dropout, no unknown
        // token (byte fallback or the byte alphabet covers every text), every merge applied.
        fields.extend([("dropout".to_string(), Value::Null), ("unk_token".to_string(), Value::Null), ("ignore_merges".to_string(), Value::Bool(false))]);
        fields.extend(model.as_object().into_iter().flatten().map(|(k, v)| (k.clone(), v.clone())));
        // The config's own tokens replace the defaults, a null one removes its default.
        Ok(defaults.into_iter().filter(|(name, _)| config.get(*name).is_none()).collect())
    }
}

/// transformers' `decoders.ByteLevel()`.
fn byte_level_decoder() -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true})
}

#[cfg(test)]
mod tests {
    use super::TransformersClass;
    use serde_json::json;

    /// A file whose model is not a BPE, under a class that rebuilds one, is left as it is and
    /// the reason given (transformers would rebuild a BPE from its vocabulary: other ids).
    #[test]
    fn a_class_that_rebuilds_a_bpe_leaves_any_other_model_as_it_is() {
        let unigram = json!({"normalizer": null, "pre_tokenizer": null, "decoder": null, "model": {"type": "Unigram", "vocab": [["a", 0.0]]}});
        for class in [TransformersClass::Llama, TransformersClass::Qwen2, TransformersClass::Gpt2] {
            let mut file = unigram.clone();
            let why = class.rebuild(&mut file, &json!({})).unwrap_err();
            assert!(why.contains("Unigram") && why.contains(class.name()), "{why}");
            assert_eq!(file, unigram, "{} changed a file it refused", class.name());
        }
        let mut file = unigram.clone();
        assert_eq!(TransformersClass::FileAsIs.rebuild(&mut file, &json!({})), Ok(Vec::new()));
    }
}
