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
    /// The named special tokens (`bos_token`, ..., `mask_token`, the model's own) as the class
    /// resolves them: the configs' (tokenizer_config.json, special_tokens_map.json), else the
    /// class's defaults.
    special_tokens: Vec<(String, String)>,
    /// [`reading`](Self::reading), found once when read.
    reading: String,
    /// [`added_before_text`](Self::added_before_text), found once when read.
    added_before_text: Vec<u32>,
}

/// transformers' named special tokens, in its order (`SPECIAL_TOKENS_ATTRIBUTES`); a config's
/// other `*_token` entries (`image_token`, ...) follow them as the model's own.
const NAMED_SPECIAL_TOKENS: [&str; 7] = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

/// A checkpoint folder's `tokenizer_config.json` as transformers 5 reads it: the special tokens
/// it names, the added tokens it lists and the rest as JSON (the chat template, ...).
pub struct TokenizerConfig {
    pub file: PathBuf,
    /// The file's JSON, for a config saved before transformers 4.34 (no `added_tokens_decoder`)
    /// with special_tokens_map.json's entries over it, as transformers reads them; `Null`
    /// where the folder has neither.
    pub json: serde_json::Value,
    /// The named special tokens as written (`bos_token`, `eos_token`, ..., `mask_token` and
    /// the model's own, `image_token`, ...), by name: a string, or an added token's
    /// `{"content": ...}`.
    pub special_tokens: BTreeMap<String, String>,
    /// added_tokens.json's tokens (id, token) where the config lists none itself (saved before
    /// transformers 4.34).
    legacy_added_tokens: Vec<(u32, tokenizers::AddedToken)>,
}

impl TokenizerConfig {
    /// The folder's `tokenizer_config.json`; empty where it has none.
    pub fn read(dir: &Path) -> Result<Self, TokenizerError> {
        let file = dir.join("tokenizer_config.json");
        let mut json = optional_json(&file)?;
        // transformers 5 reads `additional_special_tokens` as `extra_special_tokens` where those
        // are missing or empty, before any special_tokens_map.json.
        if let Some(fields) = json.as_object_mut() {
            if !fields.get("extra_special_tokens").is_some_and(truthy) {
                if let Some(additional) = fields.remove("additional_special_tokens") {
                    fields.insert("extra_special_tokens".into(), additional);
                }
            }
        }
        // As transformers reads them: a config saved by transformers 4.34 or later (it has
        // `added_tokens_decoder`) alone; an earlier one with special_tokens_map.json's over it
        // (those checkpoints name them there alone) and added_tokens.json's tokens.
        let mut legacy_added_tokens = Vec::new();
        if json.get("added_tokens_decoder").is_none() {
            if let serde_json::Value::Object(map) = optional_json(&dir.join("special_tokens_map.json"))? {
                if !json.is_object() {
                    json = serde_json::json!({});
                }
                let fields = json.as_object_mut().expect("an object");
                for (name, mut value) in map {
                    // The map's tokens are special ones (not normalized unless it says so); its
                    // extra ones join the config's.
                    let special = |token: &mut serde_json::Value| {
                        if let Some(token) = token.as_object_mut() {
                            token.insert("__type".into(), "AddedToken".into());
                            token.insert("special".into(), true.into());
                        }
                    };
                    match value.as_array_mut() {
                        Some(tokens) if name == "extra_special_tokens" => {
                            tokens.iter_mut().for_each(special);
                            let mut joined = fields.get("extra_special_tokens").and_then(|v| v.as_array()).cloned().unwrap_or_default();
                            joined.extend(tokens.drain(..).filter(|token| !joined.contains(token)).collect::<Vec<_>>());
                            value = joined.into();
                        }
                        _ => special(&mut value),
                    }
                    fields.insert(name, value);
                }
            }
            let added = dir.join("added_tokens.json");
            if let serde_json::Value::Object(tokens) = optional_json(&added)? {
                let special: Vec<String> = Self::named_tokens(&json)
                    .into_iter()
                    .filter(|(name, _)| NAMED_SPECIAL_TOKENS.contains(&name.as_str()))
                    .map(|(_, token)| token.content)
                    .chain(Self::extra_tokens(&json).into_iter().map(|token| token.content))
                    .collect();
                for (content, id) in tokens {
                    let id = id.as_u64().and_then(|id| u32::try_from(id).ok());
                    let id = id.ok_or_else(|| TokenizerError { file: added.display().to_string(), problem: format!("the id of {content:?} is not a token id") })?;
                    let is_special = special.contains(&content);
                    legacy_added_tokens.push((id, tokenizers::AddedToken::from(content, is_special)));
                }
            }
        }
        let special_tokens = Self::named_tokens(&json).into_iter().map(|(name, token)| (name, token.content)).collect();
        Ok(Self { file, json, special_tokens, legacy_added_tokens })
    }

    /// The tokenizer's end-of-sequence token as written (`eos_token`), which transformers'
    /// `tokenizer.eos_token` and TRL's `SFTTrainer` end each example with.
    pub fn eos_token(&self) -> Option<&str> {
        self.special_tokens.get("eos_token").map(String::as_str)
    }

    /// The named special tokens in transformers' order: its seven, then the model's own
    /// (`image_token`, ... and `extra_special_tokens`' names).
    fn named_tokens(json: &serde_json::Value) -> Vec<(String, tokenizers::AddedToken)> {
        let fields = json.as_object().into_iter().flatten();
        // A model's own token is a string or an AddedToken (a plain dict is not one).
        let own = fields.filter(|(name, value)| {
            name.ends_with("_token") && !NAMED_SPECIAL_TOKENS.contains(&name.as_str()) && (value.is_string() || value["__type"] == "AddedToken")
        });
        let explicit = json["extra_special_tokens"].as_object().into_iter().flatten();
        let mut named: Vec<(String, tokenizers::AddedToken)> = Vec::new();
        let candidates = NAMED_SPECIAL_TOKENS.iter().map(|name| (name.to_string(), &json[*name])).chain(own.chain(explicit).map(|(name, value)| (name.clone(), value)));
        for (name, value) in candidates {
            if let Some(token) = added_token(value, true) {
                // `extra_special_tokens`' names replace a config entry of the same name.
                named.retain(|(other, _)| *other != name);
                named.push((name, token));
            }
        }
        named
    }

    /// The extra special tokens: `extra_special_tokens` as a list (a dict names them instead),
    /// else `additional_special_tokens` ([`read`](Self::read) moved them there already where
    /// transformers does).
    fn extra_tokens(json: &serde_json::Value) -> Vec<tokenizers::AddedToken> {
        let list = match json.get("extra_special_tokens") {
            Some(extra) => extra.as_array(),
            None => json["additional_special_tokens"].as_array(),
        };
        list.into_iter().flatten().filter_map(|value| added_token(value, true)).collect()
    }

    /// The added tokens the config lists (`added_tokens_decoder`), by id; `None` where it lists
    /// none (then added_tokens.json's and tokenizer.json's are the added tokens).
    fn listed_added_tokens(&self) -> Option<Vec<(u32, tokenizers::AddedToken)>> {
        let listed = self.json.get("added_tokens_decoder")?.as_object()?;
        let mut tokens: Vec<(u32, tokenizers::AddedToken)> =
            listed.iter().filter_map(|(id, value)| Some((id.parse().ok()?, added_token(value, false)?))).collect();
        tokens.sort_by_key(|(id, _)| *id);
        Some(tokens)
    }
}

/// Python's truth of a JSON value (`not value` false): a non-empty list or dict, a non-empty
/// string, a non-zero number, `true`.
fn truthy(value: &serde_json::Value) -> bool {
    match value {
        serde_json::Value::Null => false,
        serde_json::Value::Bool(b) => *b,
        serde_json::Value::Number(n) => n.as_f64() != Some(0.0),
        serde_json::Value::String(s) => !s.is_empty(),
        serde_json::Value::Array(a) => !a.is_empty(),
        serde_json::Value::Object(o) => !o.is_empty(),
    }
}

/// A token as a config writes it, as transformers' `AddedToken` reads it: a string (a special
/// token where `special`), or `{"content": ..., "lstrip": ..., ...}` (special where it says so
/// or where `special`).
fn added_token(value: &serde_json::Value, special: bool) -> Option<tokenizers::AddedToken> {
    if let Some(content) = value.as_str() {
        return Some(tokenizers::AddedToken::from(content, special));
    }
    let flag = |name: &str| value[name].as_bool();
    let written_special = flag("special").unwrap_or(false);
    Some(tokenizers::AddedToken {
        content: value["content"].as_str()?.to_string(),
        single_word: flag("single_word").unwrap_or(false),
        lstrip: flag("lstrip").unwrap_or(false),
        rstrip: flag("rstrip").unwrap_or(false),
        normalized: flag("normalized").unwrap_or(!written_special),
        special: written_special || special,
    })
}

/// Adds to `inner` the tokens transformers' `class` adds beside the file's vocabulary, in its
/// order (a token new to the vocabulary takes the next id): the added tokens the config lists
/// (else added_tokens.json's and `file_added`, the file's, which a class that rebuilds the file
/// starts without), then the named special tokens (the configs', else the class's `defaults`)
/// and the extra ones where their text is not an added token yet. Returns the named special
/// tokens (name, text) and what was added or left out beside the file's added tokens, for
/// [`TextTokenizer::reading`].
fn add_tokens_as_transformers(
    inner: &mut tokenizers::Tokenizer,
    class: &TransformersClass,
    config: &TokenizerConfig,
    defaults: &[(&'static str, &'static str)],
    file_added: &[(u32, tokenizers::AddedToken)],
) -> (Vec<(String, String)>, String) {
    // A class's default is for a name the configs leave out (`TransformersClass::rebuild`).
    let mut named = TokenizerConfig::named_tokens(&config.json);
    named.extend(defaults.iter().map(|(name, token)| (name.to_string(), tokenizers::AddedToken::from(*token, true))));
    named.sort_by_key(|(name, _)| NAMED_SPECIAL_TOKENS.iter().position(|n| n == name).unwrap_or(NAMED_SPECIAL_TOKENS.len()));
    let extra = TokenizerConfig::extra_tokens(&config.json);
    let listed = config.listed_added_tokens().unwrap_or_else(|| {
        let mut tokens: BTreeMap<u32, tokenizers::AddedToken> = config.legacy_added_tokens.iter().cloned().collect();
        tokens.extend(file_added.iter().cloned());
        tokens.into_iter().collect()
    });
    // Each listed token is added again (its flags, as listed, replace the file's; a named one
    // becomes special); a named or extra one only where its text is not an added token yet.
    let is_named = |content: &str| named.iter().any(|(_, token)| token.content == content);
    let mut present: std::collections::HashSet<String> = inner.get_added_tokens_decoder().into_values().map(|token| token.content).collect();
    present.extend(listed.iter().map(|(_, token)| token.content.clone()));
    let mut to_add: Vec<tokenizers::AddedToken> = listed.iter().map(|(_, token)| tokenizers::AddedToken { special: token.special || is_named(&token.content), ..token.clone() }).collect();
    to_add.extend(named.iter().map(|(_, token)| token.clone()).chain(extra.iter().cloned()).filter(|token| present.insert(token.content.clone())));
    inner.add_tokens(&to_add);
    if class.adds_special_tokens_again() {
        let mut once = std::collections::HashSet::new();
        let all: Vec<tokenizers::AddedToken> = named.iter().map(|(_, token)| &token.content).chain(extra.iter().map(|token| &token.content))
            .filter(|content| once.insert(*content))
            .map(|content| tokenizers::AddedToken::from(content.clone(), true))
            .collect();
        inner.add_tokens(&all);
    }
    // `split_special_tokens`: special tokens written in a text are read as its characters.
    let split = config.json["split_special_tokens"].as_bool().unwrap_or(false);
    inner.set_encode_special_tokens(split);
    // What the reading adds to the file's: the named special tokens new to it (a token named
    // twice, twice), the extra ones, the other listed ones.
    let in_file = |content: &str| file_added.iter().any(|(_, token)| token.content == content);
    let mut special: Vec<&str> = named.iter().map(|(_, token)| token.content.as_str()).filter(|content| !in_file(content)).collect();
    for content in extra.iter().map(|token| token.content.as_str()) {
        if !in_file(content) && !special.contains(&content) {
            special.push(content);
        }
    }
    let mut added = format!("special tokens added [{}]", special.join(" "));
    let plain: Vec<&str> = listed.iter().map(|(_, token)| token.content.as_str()).filter(|content| !in_file(content) && !special.contains(content)).collect();
    if !plain.is_empty() {
        added += &format!(", tokens added [{}]", plain.join(" "));
    }
    let left_out: Vec<&str> = file_added.iter().map(|(_, token)| token.content.as_str()).filter(|content| !present.contains(*content)).collect();
    if !left_out.is_empty() {
        added += &format!(", the file's added tokens [{}] left out", left_out.join(" "));
    }
    if split {
        added += ", special tokens in a text split";
    }
    (named.into_iter().map(|(name, token)| (name, token.content)).collect(), added)
}

/// A checkpoint's JSON file, `Null` where the folder has none; refused, naming it, where it is
/// not JSON.
fn optional_json(file: &Path) -> Result<serde_json::Value, TokenizerError> {
    let refused = |problem: String| TokenizerError { file: file.display().to_string(), problem };
    match optional_text(file).map_err(refused)? {
        Some(text) => serde_json::from_str(&text).map_err(|e| refused(format!("is not JSON: {e}"))),
        None => Ok(serde_json::Value::Null),
    }
}

/// A checkpoint's optional file as text: `None` where the folder has none; the problem where
/// it has one that cannot be read (no permission, not UTF-8, a Git LFS pointer), which read as
/// absent would change the tokens or the template without a word.
pub(crate) fn optional_text(file: &Path) -> Result<Option<String>, String> {
    match ulysses_core::files::read_to_string_regular(file) {
        Ok(text) if crate::pretrained::is_git_lfs_pointer_text(text.as_bytes()) => Err(crate::pretrained::git_lfs_pointer_problem()),
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("cannot be read: {e}")),
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
        let text = ulysses_core::files::read_to_string_regular(Path::new(&file)).map_err(|e| cannot_read(&e))?;
        if crate::pretrained::is_git_lfs_pointer_text(text.as_bytes()) {
            return Err(TokenizerError { file, problem: crate::pretrained::git_lfs_pointer_problem() });
        }
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
        // The added tokens of the file, (id, token): a class that rebuilds the file starts
        // without them and adds them back as transformers does.
        let mut file_added = None;
        if !matches!(class, TransformersClass::FileAsIs | TransformersClass::Other(_)) {
            let mut json: serde_json::Value = serde_json::from_str(&text).map_err(|e| cannot_read(&e))?;
            match class.rebuild(&mut json, &config.json) {
                Ok(named) => {
                    let listed = json["added_tokens"].as_array().into_iter().flatten();
                    file_added = Some(listed.filter_map(|token| Some((u32::try_from(token["id"].as_u64()?).ok()?, added_token(token, false)?))).collect::<Vec<_>>());
                    json["added_tokens"] = serde_json::json!([]);
                    (rebuilt, defaults) = (Some(json.to_string()), named);
                }
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
        let file_added = file_added.unwrap_or_else(|| {
            let mut added: Vec<(u32, tokenizers::AddedToken)> = inner.get_added_tokens_decoder().into_iter().collect();
            added.sort_by_key(|(id, _)| *id);
            added
        });
        let (special_tokens, added) = add_tokens_as_transformers(&mut inner, &class, &config, &defaults, &file_added);
        // What decides the ids beside the file: the class, its options (`Value::to_string`
        // writes a missing one as null) and the tokens it added or left out.
        let options: Vec<String> = ["add_prefix_space", "legacy"].iter().map(|name| format!("{name} {}", config.json[name])).collect();
        let reading = format!("{} with {} and {added}", class.name(), options.join(" "));
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

    /// The special token `name` (`bos_token`, `eos_token`, `unk_token`, `sep_token`,
    /// `pad_token`, `cls_token`, `mask_token` or a model's own, `image_token`, ...) as
    /// transformers' class gives it (`tokenizer.eos_token`): the configs', else the class's
    /// default; `None` where neither names one.
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.special_tokens.iter().find(|(n, _)| *n == name).map(|(_, token)| token.as_str())
    }

    /// Every named special token as [`special_token`](Self::special_token) gives it: name and
    /// token, transformers' `special_tokens_map`.
    pub fn special_tokens(&self) -> impl Iterator<Item = (&str, &str)> {
        self.special_tokens.iter().map(|(name, token)| (name.as_str(), token.as_str()))
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
