//! A checkpoint's `tokenizer.json`, through Hugging Face's own `tokenizers` crate: the same
//! ids as the Python package on the same file.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

pub use crate::tokenizer_class::TransformersClass;
use crate::tokenizer_class::FOLLOWED_MODEL_TYPES;

/// A tokenizer read from `tokenizer.json`.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    /// The file it was read from, for messages.
    file: String,
    /// The transformers class whose reading of the file this follows.
    class: TransformersClass,
    /// The special tokens that class names where tokenizer_config.json (and
    /// special_tokens_map.json) name none.
    class_defaults: Vec<(&'static str, &'static str)>,
    /// `bos_token`, `eos_token`, `unk_token` and `pad_token` as the class resolves them: the
    /// configs' (tokenizer_config.json, special_tokens_map.json), else the class's defaults.
    special_tokens: Vec<(&'static str, String)>,
    /// [`reading`](Self::reading), found once when read.
    reading: String,
    /// [`added_before_text`](Self::added_before_text), found once when read.
    added_before_text: Vec<u32>,
}

/// A checkpoint folder's `tokenizer_config.json`: the special tokens it names and the rest as
/// JSON (the chat template, ...).
pub struct TokenizerConfig {
    pub file: PathBuf,
    /// The file's JSON; `Null` where the folder has none.
    pub json: serde_json::Value,
    /// `bos_token`, `eos_token`, `unk_token` and `pad_token` as written there (a string, or an
    /// added token's `{"content": ...}`).
    pub special_tokens: BTreeMap<String, String>,
}

impl TokenizerConfig {
    /// The folder's `tokenizer_config.json`; empty where it has none.
    pub fn read(dir: &Path) -> Result<Self, TokenizerError> {
        let file = dir.join("tokenizer_config.json");
        let json = optional_json(&file)?;
        // As transformers reads them: a config saved by transformers 4.34 or later (it has
        // `added_tokens_decoder`) alone; an earlier one with special_tokens_map.json's over it
        // (those checkpoints name them there alone).
        let map = match json.get("added_tokens_decoder") {
            Some(_) => serde_json::Value::Null,
            None => optional_json(&dir.join("special_tokens_map.json"))?,
        };
        let text = |token: &serde_json::Value| token.as_str().or_else(|| token["content"].as_str()).map(str::to_string);
        let special_tokens = ["bos_token", "eos_token", "unk_token", "pad_token"]
            .into_iter()
            .filter_map(|name| Some((name.to_string(), text(&map[name]).or_else(|| text(&json[name]))?)))
            .collect();
        Ok(Self { file, json, special_tokens })
    }

    /// The tokenizer's end-of-sequence token as written (`eos_token`), which transformers'
    /// `tokenizer.eos_token` and TRL's `SFTTrainer` end each example with.
    pub fn eos_token(&self) -> Option<&str> {
        self.special_tokens.get("eos_token").map(String::as_str)
    }
}

/// A checkpoint's JSON file, `Null` where the folder has none; refused, naming it, where it is
/// not JSON.
fn optional_json(file: &Path) -> Result<serde_json::Value, TokenizerError> {
    match std::fs::read_to_string(file) {
        Ok(text) => serde_json::from_str(&text).map_err(|e| TokenizerError { file: file.display().to_string(), problem: format!("is not JSON: {e}") }),
        Err(_) => Ok(serde_json::Value::Null),
    }
}

/// Why a tokenizer cannot be read or used, naming the file.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {problem}")]
pub struct TokenizerError {
    pub file: String,
    pub problem: String,
}

impl TextTokenizer {
    /// Reads a checkpoint folder's `tokenizer.json` (or the file itself).
    pub fn from_file(path: &Path) -> Result<Self, TokenizerError> {
        let file = if path.is_dir() { path.join("tokenizer.json") } else { path.to_path_buf() };
        let file = file.display().to_string();
        let cannot_read = |e: &dyn std::fmt::Display| TokenizerError { file: file.clone(), problem: format!("cannot be read as a Hugging Face tokenizer.json: {e}") };
        let text = std::fs::read_to_string(&file).map_err(|e| cannot_read(&e))?;
        let folder = if path.is_dir() { path } else { path.parent().unwrap_or(Path::new(".")) };
        let config = TokenizerConfig::read(folder)?;
        let model_config = optional_json(&folder.join("config.json"))?;
        let declared = config.json["tokenizer_class"].as_str().or(model_config["tokenizer_class"].as_str());
        let mut class = TransformersClass::for_checkpoint(model_config["model_type"].as_str(), declared, text.contains("\"ByteLevel\""));
        // The file as JSON only where the class rebuilds it.
        let mut rebuilt = None;
        let mut defaults = Vec::new();
        if let Some(model_type) = model_config["model_type"].as_str().filter(|t| !FOLLOWED_MODEL_TYPES.contains(t)) {
            tracing::warn!(
                "{file}: the config.json beside it is of model_type {model_type:?}, for which this crate does not know which tokenizer class \
                 transformers picks (it knows {FOLLOWED_MODEL_TYPES:?}); read through {}, as the configs name it: its ids may differ from transformers'",
                class.name()
            );
        }
        if !matches!(class, TransformersClass::FileAsIs | TransformersClass::Other(_)) {
            let mut json: serde_json::Value = serde_json::from_str(&text).map_err(|e| cannot_read(&e))?;
            match class.rebuild(&mut json, &config.json) {
                // A token special_tokens_map.json names replaces the class's default as well.
                Ok(named) => (rebuilt, defaults) = (Some(json.to_string()), named.into_iter().filter(|(name, _)| !config.special_tokens.contains_key(*name)).collect()),
                Err(why) => class = TransformersClass::Unfollowed { class: class.name().to_string(), why },
            }
        }
        let mut inner: tokenizers::Tokenizer = rebuilt.as_deref().unwrap_or(&text).parse().map_err(|e| cannot_read(&e))?;
        match &class {
            TransformersClass::Other(name) => tracing::warn!(
                "{file}: transformers reads it through {name}, which this crate does not follow; read as the file has it \
                 (as transformers' TokenizersBackend reads it): its ids may differ from transformers'"
            ),
            TransformersClass::Unfollowed { class, why } => tracing::warn!(
                "{file}: transformers reads it through {class}, which this crate cannot follow here ({why}); read as the file has it \
                 (as transformers' TokenizersBackend reads it): its ids may differ from transformers'"
            ),
            TransformersClass::FileAsIs => {}
            rebuilds => tracing::info!("{file}: read as transformers 5 reads it for this checkpoint, through {}, which rebuilds it", rebuilds.name()),
        }
        // As transformers' tokenizer classes end: each special token the config names (or the
        // class's default for it) that is not an added token yet becomes a special one.
        let added: std::collections::HashSet<String> = inner.get_added_tokens_decoder().into_values().map(|token| token.content).collect();
        // In transformers' order (a token new to the vocabulary takes the next id).
        let special_tokens: Vec<(&'static str, String)> = ["bos_token", "eos_token", "unk_token", "pad_token"]
            .into_iter()
            .filter_map(|name| Some((name, config.special_tokens.get(name).map(String::as_str).or_else(|| defaults.iter().find(|(n, _)| *n == name).map(|(_, t)| *t))?.to_string())))
            .collect();
        let special: Vec<tokenizers::AddedToken> =
            special_tokens.iter().map(|(_, token)| token).filter(|token| !added.contains(*token)).map(|token| tokenizers::AddedToken::from(token.clone(), true)).collect();
        inner.add_special_tokens(&special);
        // The class's options (`Value::to_string` writes a missing one as null).
        let options: Vec<String> = ["add_prefix_space", "legacy"].iter().map(|name| format!("{name} {}", config.json[name])).collect();
        let special_names: Vec<&str> = special.iter().map(|token| token.content.as_str()).collect();
        let reading = format!("{} with {} and special tokens added [{}]", class.name(), options.join(" "), special_names.join(" "));
        // transformers' `tokenizer(text)` neither truncates nor pads unless asked; a file saved
        // after a call that did keeps the setting, which would cut or pad every document here.
        inner.with_truncation(None).map_err(|e| TokenizerError { file: file.clone(), problem: format!("cannot turn its truncation off: {e}") })?;
        inner.with_padding(None);
        let mut tokenizer = Self { inner, file, class, class_defaults: defaults, special_tokens, reading, added_before_text: Vec::new() };
        tokenizer.added_before_text = tokenizer.special_tokens_before_text()?;
        Ok(tokenizer)
    }

    /// The transformers 5 tokenizer class `AutoTokenizer` reads this checkpoint through
    /// (`TokenizersBackend`, `LlamaTokenizer`, `Qwen2Tokenizer`, ...), whose reading of the file
    /// this follows (but for a class [`TransformersClass::Other`]: the file as it is).
    pub fn transformers_class(&self) -> &TransformersClass {
        &self.class
    }

    /// The special token `name` (`bos_token`, `eos_token`, `unk_token`, `pad_token`) as
    /// transformers' class gives it (`tokenizer.eos_token`): the configs', else the class's
    /// default; `None` where neither names one.
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.special_tokens.iter().find(|(n, _)| *n == name).map(|(_, token)| token.as_str())
    }

    /// What decides how this reads a text beside `tokenizer.json`'s bytes: the class, the
    /// options it takes from tokenizer_config.json and the special tokens it added (from the
    /// configs or the class's defaults). A run's data identity records it: editing
    /// tokenizer_config.json or config.json's `model_type` can make other ids of the same file.
    pub fn reading(&self) -> &str {
        &self.reading
    }

    /// The EOS token of the tokenizer's class where tokenizer_config.json and
    /// special_tokens_map.json name none, as
    /// transformers' `tokenizer.eos_token` gives it (Qwen2Tokenizer's and GPT2Tokenizer's
    /// `<|endoftext|>`, LlamaTokenizer's `</s>`); `None` for the file read as it is.
    pub fn class_eos_token(&self) -> Option<&str> {
        self.class_defaults.iter().find(|(name, _)| *name == "eos_token").map(|(_, token)| *token)
    }

    /// [`encode`](Self::encode) with each token's characters (`start..end`, in characters as
    /// Python indexes strings).
    pub fn encode_with_char_offsets(&self, text: &str) -> Result<(Vec<u32>, Vec<(usize, usize)>), TokenizerError> {
        let encoding = self.inner.encode_char_offsets(text, false).map_err(|e| self.cannot_encode(e))?;
        Ok((encoding.get_ids().to_vec(), encoding.get_offsets().to_vec()))
    }

    /// The ids of `text`, special tokens written in it parsed as such, none added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self.inner.encode(text, false).map_err(|e| self.cannot_encode(e))?;
        Ok(encoding.get_ids().to_vec())
    }

    fn cannot_encode(&self, error: impl std::fmt::Display) -> TokenizerError {
        TokenizerError { file: self.file.clone(), problem: format!("cannot encode: {error}") }
    }

    /// The ids of one document as transformers' `tokenizer(text)` gives them (the special
    /// tokens the file's post-processor adds, e.g. Llama 3's `<|begin_of_text|>`) followed by
    /// `eos`, so that packed documents end where the model learnt that text ends.
    pub fn encode_document(&self, text: &str, eos: u32) -> Result<Vec<u32>, TokenizerError> {
        Ok(self.encode_documents(&[text], eos)?.remove(0))
    }

    /// [`encode_document`](Self::encode_document) of each text, on every core. A text that
    /// begins with what the post-processor adds (a chat rendered to text with its
    /// `<|begin_of_text|>`) gets it once, not twice as `tokenizer(text)` gives it.
    pub fn encode_documents(&self, texts: &[&str], eos: u32) -> Result<Vec<Vec<u32>>, TokenizerError> {
        let added = &self.added_before_text;
        let encodings = self
            .inner
            .encode_batch(texts.to_vec(), true)
            .map_err(|e| self.cannot_encode(e))?;
        Ok(encodings
            .iter()
            .map(|encoding| {
                let mut ids = encoding.get_ids().to_vec();
                if !added.is_empty() && ids.len() >= 2 * added.len() && ids[added.len()..].starts_with(added) {
                    ids.drain(..added.len());
                }
                ids.push(eos);
                ids
            })
            .collect())
    }

    /// The ids the post-processor adds before a text (Llama 3's `<|begin_of_text|>`; none
    /// for most tokenizers).
    pub fn added_before_text(&self) -> &[u32] {
        &self.added_before_text
    }

    /// The special tokens that two texts differing from their first character share at
    /// their start.
    fn special_tokens_before_text(&self) -> Result<Vec<u32>, TokenizerError> {
        let encodings = self.inner.encode_batch(vec!["a", "b"], true).map_err(|e| self.cannot_encode(e))?;
        let (a, b) = (encodings[0].get_ids(), encodings[1].get_ids());
        let special = encodings[0].get_special_tokens_mask();
        Ok(a.iter().zip(b).zip(special).take_while(|((x, y), special)| x == y && **special == 1).map(|((x, _), _)| *x).collect())
    }

    /// The id of a token written out (e.g. `<|endoftext|>`), if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Tokens in the vocabulary, added ones included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

#[cfg(test)]
mod tests {
    use super::TokenizerConfig;

    /// As transformers reads special tokens: a tokenizer_config.json saved before transformers
    /// 4.34 (no `added_tokens_decoder`) with special_tokens_map.json's over it, a later one
    /// alone (the map, even unreadable, is not opened).
    #[test]
    fn special_tokens_are_read_from_the_map_where_transformers_reads_it() {
        let dir = std::env::temp_dir().join(format!("ulysses-special-tokens-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let read = |config: &str, map: &str| {
            std::fs::write(dir.join("tokenizer_config.json"), config).unwrap();
            std::fs::write(dir.join("special_tokens_map.json"), map).unwrap();
            TokenizerConfig::read(&dir).unwrap().special_tokens
        };
        let token = |tokens: &std::collections::BTreeMap<String, String>, name: &str| tokens.get(name).cloned();
        let legacy = read(r#"{"bos_token": "<s>", "unk_token": "<unk>"}"#, r#"{"bos_token": "<bos>", "eos_token": {"content": "</s>", "lstrip": false}}"#);
        let recent = read(r#"{"bos_token": "<s>", "added_tokens_decoder": {}}"#, "not JSON");
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!([token(&legacy, "bos_token"), token(&legacy, "eos_token"), token(&legacy, "unk_token")], [Some("<bos>".into()), Some("</s>".into()), Some("<unk>".into())]);
        assert_eq!((token(&recent, "bos_token"), token(&recent, "eos_token")), (Some("<s>".into()), None));
    }
}
