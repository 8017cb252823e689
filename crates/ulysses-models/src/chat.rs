//! A checkpoint's chat template, rendered as transformers' `apply_chat_template` renders it:
//! Jinja with `trim_blocks` and `lstrip_blocks`, loop controls, `raise_exception`, Python's
//! string methods (`minijinja-contrib`'s pycompat), the special tokens of
//! `tokenizer_config.json` as variables; the text then tokenized with no special tokens added
//! (the template writes its own). `{% generation %}…{% endgeneration %}` marks the assistant's
//! answers, as transformers' `AssistantTracker` does: each token that holds a character of one
//! is an assistant token (`return_assistant_tokens_mask`), the tokens supervised fine-tuning
//! trains on.

use std::{
    collections::{BTreeMap, BTreeSet},
    ops::Range,
    path::Path,
};

use minijinja::{Environment, Error, ErrorKind, Value};

use crate::tokenizer::{TextTokenizer, TokenizerConfig, TokenizerError, optional_text};

/// Why a chat template cannot be read or rendered, naming the file.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {problem}")]
pub struct ChatError {
    pub file: String,
    pub problem: String,
}

/// A chat template and the special tokens it may name.
pub struct ChatTemplate {
    /// The environment holding the template (its source with each generation block's tags
    /// replaced by markers, see [`marked`]), parsed once.
    env: Environment<'static>,
    generation_blocks: bool,
    /// Every quoted word of the source (`'tool'`, `"ipython"`, ...): the roles it may name.
    quoted_words: BTreeSet<String>,
    /// `bos_token`, `eos_token`, ... as `tokenizer_config.json` has them.
    special_tokens: BTreeMap<String, String>,
    file: String,
    /// What decides how a conversation renders: the source and the special tokens.
    rendering_text: String,
    /// The checkpoint's template named `tool_use`, which transformers renders a conversation
    /// with where it is given tools.
    tool_use: Option<Box<ChatTemplate>>,
}

/// A conversation rendered: the text, and the character ranges of the assistant's answers.
#[derive(Debug, Clone, PartialEq)]
pub struct RenderedChat {
    pub text: String,
    /// In characters (as Python indexes strings), each a `{% generation %}` block's output.
    pub generations: Vec<Range<usize>>,
    /// The system and user messages whose text the rendering does not hold: a template that
    /// drops or moves them (Mistral v0.3's keeps the system prompt only with the last user
    /// message, so a conversation ending in an answer trains without it). transformers
    /// renders the same; the trainer warns.
    pub left_out: Vec<usize>,
}

/// A conversation's tokens: ids (the rendered text, no special tokens added), which are the
/// assistant's, and [`RenderedChat::left_out`].
#[derive(Debug, Clone, PartialEq)]
pub struct TokenizedChat {
    pub ids: Vec<u32>,
    pub answers: Vec<bool>,
    pub left_out: Vec<usize>,
}

/// The private-use characters that stand for a generation block's start and end in the
/// rendered text (taken out again before anything sees it).
const GENERATION_START: char = '\u{E000}';
const GENERATION_END: char = '\u{E001}';

impl ChatTemplate {
    /// The chat template of a checkpoint folder: `chat_template.jinja`, else `chat_template` in
    /// `tokenizer_config.json` (a string, or a list of named templates: the one named
    /// `default`); `None` when it has neither. A template named `tool_use` (in that list, or
    /// `additional_chat_templates/tool_use.jinja`) renders the conversations given tools, as
    /// transformers' `get_chat_template` picks it. Its special tokens are tokenizer_config.json's;
    /// [`from_checkpoint_for`](Self::from_checkpoint_for) gives it the tokenizer's.
    pub fn from_checkpoint(dir: &Path) -> Result<Option<Self>, ChatError> {
        Self::from_checkpoint_for(dir, None)
    }

    /// [`from_checkpoint`](Self::from_checkpoint) for the conversations `tokenizer` tokenizes:
    /// the template names its special tokens as transformers passes them (the tokenizer's
    /// `special_tokens_map`), a class's default (LlamaTokenizer's `<s>`) where the configs
    /// name none.
    pub fn from_checkpoint_for(dir: &Path, tokenizer: Option<&TextTokenizer>) -> Result<Option<Self>, ChatError> {
        let (TokenizerConfig { file: config_file, json: config, .. }, special_tokens) = special_tokens_of(dir, tokenizer)?;
        let named = |name: &str| config["chat_template"].as_array().and_then(|named| named.iter().find(|t| t["name"] == name)).and_then(|t| t["template"].as_str());
        // As in transformers, the file takes priority over the config's entry.
        let jinja = dir.join("chat_template.jinja");
        let read = |file: &Path| optional_text(file).map_err(|problem| error(file, problem));
        let (source, file) = match (read(&jinja)?, &config["chat_template"]) {
            (Some(source), _) => (source, jinja),
            (None, serde_json::Value::String(source)) => (source.clone(), config_file.clone()),
            (None, serde_json::Value::Array(_)) => {
                let source = named("default").ok_or_else(|| error(&config_file, "its chat_template list has no template named \"default\""))?;
                (source.to_string(), config_file.clone())
            }
            (None, _) => return Ok(None),
        };
        let mut template = Self::new(&source, special_tokens.clone(), &file.display().to_string())?;
        let tool_jinja = dir.join("additional_chat_templates").join("tool_use.jinja");
        let tool_use = match (read(&tool_jinja)?, named("tool_use")) {
            (Some(source), _) => Some((source, tool_jinja)),
            (None, Some(source)) => Some((source.to_string(), config_file)),
            (None, None) => None,
        };
        if let Some((source, file)) = tool_use {
            let tool_use = Self::new(&source, special_tokens, &file.display().to_string())?;
            template.rendering_text = format!("{}\ntool_use:\n{}", template.rendering_text, tool_use.rendering_text);
            template.tool_use = Some(Box::new(tool_use));
        }
        Ok(Some(template))
    }

    /// A template file given apart from the checkpoint's (a training template: answers marked
    /// with `{% generation %}`, every prompt rendered as the start of its conversation, as TRL's
    /// `*_training.jinja` are), with the special tokens [`from_checkpoint_for`](Self::from_checkpoint_for)
    /// gives the tokenizer folder `dir`'s template.
    pub fn from_file_for(file: &Path, dir: Option<&Path>, tokenizer: Option<&TextTokenizer>) -> Result<Self, ChatError> {
        let source = std::fs::read_to_string(file).map_err(|e| error(file, format!("cannot read the chat template: {e}")))?;
        let special_tokens = match dir {
            Some(dir) => special_tokens_of(dir, tokenizer)?.1,
            None => tokenizer.into_iter().flat_map(TextTokenizer::special_tokens).map(|(name, token)| (name.to_string(), token.to_string())).collect(),
        };
        Self::new(&source, special_tokens, &file.display().to_string())
    }

    /// A template from its source; `special_tokens` are the variables `bos_token`, ...
    pub fn new(source: &str, special_tokens: BTreeMap<String, String>, file: &str) -> Result<Self, ChatError> {
        let quoted_words = quoted_words(source);
        let rendering_text = std::iter::once(source.to_string()).chain(special_tokens.iter().map(|(name, text)| format!("{name}={text}"))).collect::<Vec<_>>().join("\n");
        let (source, generation_blocks) = marked(source);
        let mut env = environment();
        // Parsed once, here: a template that cannot parse is refused before any data.
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| ChatError { file: file.to_string(), problem: format!("its chat template does not parse: {e:#}") })?;
        Ok(Self { env, generation_blocks, quoted_words, special_tokens, file: file.to_string(), rendering_text, tool_use: None })
    }

    /// The file the template was read from.
    pub fn file(&self) -> &str {
        &self.file
    }

    /// What decides how a conversation renders (the template's source and the special tokens
    /// it is given), to tell this template from another: a resume records its digest.
    pub fn rendering_text(&self) -> &str {
        &self.rendering_text
    }

    /// Whether the template marks the assistant's answers (`{% generation %}`), which
    /// training on the answers alone needs.
    pub fn marks_answers(&self) -> bool {
        self.generation_blocks && self.tool_use.as_ref().is_none_or(|tool_use| tool_use.marks_answers())
    }

    /// `messages` (each an object with `role` and `content`, and whatever else the template
    /// reads) rendered, with the prompt for the next answer when `add_generation_prompt`.
    /// Refused: a message without a string `role`, one whose content is no string (unless it
    /// carries tool calls and has none: [`check_content`]), what the template refuses itself
    /// (`raise_exception`, its message), and a role other than system, user and assistant that
    /// the template does not name, which it rendered as the user's or as nothing (Qwen3's
    /// refuses no role: a misspelt one, `gpt`, would train silently on a wrong or missing turn).
    pub fn render(&self, messages: &[serde_json::Value], add_generation_prompt: bool) -> Result<RenderedChat, ChatError> {
        self.render_with(messages, &serde_json::Map::new(), add_generation_prompt)
    }

    /// [`render`](Self::render) with more of the template's variables, as transformers'
    /// `apply_chat_template` passes them (TRL's `SFTTrainer`: a line's `tools` and its
    /// `chat_template_kwargs`, say `enable_thinking`). Refused: a variable named as one the
    /// rendering sets itself (`messages`, `add_generation_prompt`, a special token).
    pub fn render_with(&self, messages: &[serde_json::Value], variables: &serde_json::Map<String, serde_json::Value>, add_generation_prompt: bool) -> Result<RenderedChat, ChatError> {
        if let Some(tool_use) = self.tool_use.as_ref().filter(|_| variables.get("tools").is_some_and(|tools| !tools.is_null())) {
            return tool_use.render_with(messages, variables, add_generation_prompt);
        }
        let messages = without_empty_tool_calls(messages);
        let messages = &messages[..];
        if let Some(name) = variables.keys().find(|name| ["messages", "add_generation_prompt"].contains(&name.as_str()) || self.special_tokens.iter().any(|(token, _)| token == *name)) {
            return Err(self.error(format!("the template variable {name:?} is set by the rendering itself: leave it out of the line's variables")));
        }
        // The rendering marks answers with two private-use characters: data that holds them
        // would move the marks (a prompt trained on as an answer).
        for (index, message) in messages.iter().enumerate() {
            if message.to_string().contains([GENERATION_START, GENERATION_END]) {
                return Err(self.error(format!(
                    "message {index} holds the private-use character U+E000 or U+E001, with which the rendering marks the answers: \
                     take it out of the data"
                )));
            }
        }
        // transformers refuses tools that are no list of objects (a JSON string, as some datasets
        // store them, would otherwise render character by character into the prompt).
        if let Some(tools) = variables.get("tools").filter(|tools| !tools.is_null())
            && !tools.as_array().is_some_and(|tools| tools.iter().all(serde_json::Value::is_object))
        {
            return Err(self.error(format!(
                "the line's \"tools\" is {}, not a list of tool schemas (objects), which transformers' apply_chat_template refuses: \
                 give each tool as a JSON object (a string of JSON parsed first)",
                match tools {
                    serde_json::Value::String(_) => "a string",
                    serde_json::Value::Array(_) => "a list holding something other than objects",
                    _ => "neither a list nor null",
                }
            )));
        }
        if serde_json::Value::Object(variables.clone()).to_string().contains([GENERATION_START, GENERATION_END]) {
            return Err(self.error("the template variables hold the private-use character U+E000 or U+E001, with which the rendering marks the answers: take it out of the data".into()));
        }
        let mut unnamed_role = None;
        for (index, message) in messages.iter().enumerate() {
            let Some(role) = message["role"].as_str() else {
                return Err(self.error(format!("message {index} has no \"role\" string: each message is {{\"role\": ..., \"content\": ...}}")));
            };
            if unnamed_role.is_none() && !["system", "user", "assistant"].contains(&role) && !self.quoted_words.contains(role) {
                unnamed_role = Some((index, role));
            }
            check_content(index, role, message).map_err(|problem| self.error(problem))?;
        }
        let mut rendered = self.rendered(messages, variables, add_generation_prompt)?;
        rendered.left_out = messages_left_out(messages, &rendered.text);
        // After the rendering: a template that refuses the role itself says so in its words.
        if let Some((index, role)) = unnamed_role {
            let named: Vec<&str> = ["tool", "ipython", "developer", "function"].into_iter().filter(|r| self.quoted_words.contains(*r)).collect();
            return Err(self.error(format!(
                "message {index} has the role {role:?}, which the chat template never names (it knows system, user, assistant{}): \
                 fix the data's role, or use a checkpoint whose template takes it",
                named.iter().map(|r| format!(", {r}")).collect::<String>()
            )));
        }
        Ok(rendered)
    }

    /// The template rendered on checked messages and variables.
    fn rendered(&self, messages: &[serde_json::Value], variables: &serde_json::Map<String, serde_json::Value>, add_generation_prompt: bool) -> Result<RenderedChat, ChatError> {
        let template = self.env.get_template(TEMPLATE_NAME).expect("added at construction");
        let mut context: BTreeMap<String, Value> = self.special_tokens.iter().map(|(name, text)| (name.clone(), Value::from(text.as_str()))).collect();
        // transformers passes `tools` and `documents` always, None where a conversation has
        // none: a template's `tools is not none` is false then, not true as for a name unset.
        context.extend(["tools", "documents"].map(|name| (name.to_string(), Value::from(()))));
        context.extend(variables.iter().map(|(name, value)| (name.clone(), Value::from_serialize(value))));
        context.insert("messages".into(), Value::from_serialize(messages));
        context.insert("add_generation_prompt".into(), Value::from(add_generation_prompt));
        let rendered = template.render(&context).map_err(|e| self.error(format!("the chat template failed on a conversation: {e:#}")))?;
        Ok(unmarked(&rendered))
    }

    /// The conversation's token ids (the rendered text, no special tokens added) and which are
    /// the assistant's: each token holding a character of a generation block.
    pub fn tokenize(&self, tokenizer: &TextTokenizer, messages: &[serde_json::Value], add_generation_prompt: bool) -> Result<TokenizedChat, ChatError> {
        self.tokenize_with(tokenizer, messages, &serde_json::Map::new(), add_generation_prompt)
    }

    /// [`tokenize`](Self::tokenize) with more of the template's variables
    /// ([`render_with`](Self::render_with)).
    pub fn tokenize_with(
        &self,
        tokenizer: &TextTokenizer,
        messages: &[serde_json::Value],
        variables: &serde_json::Map<String, serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<TokenizedChat, ChatError> {
        let rendered = self.render_with(messages, variables, add_generation_prompt)?;
        let (ids, offsets) = tokenizer.encode_with_char_offsets(&rendered.text).map_err(|e: TokenizerError| ChatError { file: e.file, problem: e.problem })?;
        let answers = answer_tokens(&offsets, &rendered.generations);
        Ok(TokenizedChat { ids, answers, left_out: rendered.left_out })
    }

    fn error(&self, problem: String) -> ChatError {
        ChatError { file: self.file.clone(), problem }
    }
}

/// Which tokens (their character `offsets` in the rendered text) lie in the generation
/// `blocks`. transformers: the tokens from the one holding a block's first character to the one
/// holding its last. Read here as the tokens that overlap the block, the same where a token
/// holds each of those characters; where none does (a tokenizer that trims whitespace out of
/// its offsets), transformers skipped the answer, or marked to the end of the conversation,
/// later turns and all.
fn answer_tokens(offsets: &[(usize, usize)], blocks: &[Range<usize>]) -> Vec<bool> {
    let mut answers = vec![false; offsets.len()];
    for block in blocks.iter().filter(|block| !block.is_empty()) {
        let overlapping = |&(start, end): &(usize, usize)| start < block.end && end > block.start;
        let (Some(first), Some(last)) = (offsets.iter().position(overlapping), offsets.iter().rposition(overlapping)) else { continue };
        answers[first..=last].iter_mut().for_each(|answer| *answer = true);
    }
    answers
}

/// The tokenizer folder's config, and the special tokens a template there is given: the
/// config's, then `tokenizer`'s (a class's default where the configs name none).
fn special_tokens_of(dir: &Path, tokenizer: Option<&TextTokenizer>) -> Result<(TokenizerConfig, BTreeMap<String, String>), ChatError> {
    let config = TokenizerConfig::read(dir).map_err(|e| ChatError { file: e.file, problem: e.problem })?;
    let mut special_tokens = config.special_tokens.clone();
    for (name, token) in tokenizer.into_iter().flat_map(TextTokenizer::special_tokens) {
        special_tokens.entry(name.to_string()).or_insert_with(|| token.to_string());
    }
    Ok((config, special_tokens))
}

/// `messages` without a `tool_calls` that is null or empty: no call, as datasets write it
/// into every message of a mixed set. Templates test the key's presence (Llama 3's `'tool_calls'
/// in message`, Mistral's `is defined and is not none`) and would render an empty call in place
/// of the answer and its end of turn, or fail on `null|length`.
fn without_empty_tool_calls(messages: &[serde_json::Value]) -> std::borrow::Cow<'_, [serde_json::Value]> {
    let empty = |message: &serde_json::Value| message.get("tool_calls").is_some_and(|calls| calls.is_null() || calls.as_array().is_some_and(Vec::is_empty));
    if !messages.iter().any(empty) {
        return std::borrow::Cow::Borrowed(messages);
    }
    let mut messages = messages.to_vec();
    for message in messages.iter_mut().filter(|message| empty(message)) {
        message.as_object_mut().expect("a message with a key is an object").remove("tool_calls");
    }
    std::borrow::Cow::Owned(messages)
}

/// The system and user messages whose string content, trimmed, `text` does not hold.
fn messages_left_out(messages: &[serde_json::Value], text: &str) -> Vec<usize> {
    (0..messages.len())
        .filter(|&index| {
            let message = &messages[index];
            let content = message["content"].as_str().map(str::trim).unwrap_or_default();
            matches!(message["role"].as_str(), Some("system" | "user")) && !content.is_empty() && !text.contains(content)
        })
        .collect()
}

/// The words in quotes (`'…'` or `"…"`) in a template's source: letters, digits and `_`.
/// A message's `content` must be a string, or absent or null beside `tool_calls`. Templates
/// render anything else as their authors chose: a list of parts as its JSON, or (Qwen3's) as
/// nothing, so data written for multimodal models would train silently on mangled or empty
/// turns. transformers passes it to the template as it is; this is stricter on purpose.
fn check_content(index: usize, role: &str, message: &serde_json::Value) -> Result<(), String> {
    use serde_json::Value as Json;
    let calls_tools = message["tool_calls"].as_array().is_some_and(|calls| !calls.is_empty());
    let has = match message.get("content") {
        Some(Json::String(_)) => return Ok(()),
        None | Some(Json::Null) if calls_tools => return Ok(()),
        None | Some(Json::Null) => {
            return Err(format!(
                "message {index} ({role}) has no \"content\" string (only a message with \"tool_calls\" may go without): \
                 give it its text, or leave the message out"
            ));
        }
        Some(Json::Array(_)) => "a list (of parts, as multimodal data has)",
        Some(Json::Number(_)) => "a number",
        Some(Json::Bool(_)) => "a boolean",
        Some(Json::Object(_)) => "an object",
    };
    Err(format!(
        "message {index} ({role}) has {has} as its \"content\", where the chat template renders a string: \
         write the message's text as one string (for a list of parts, join the text of its \"text\" parts)"
    ))
}

fn quoted_words(source: &str) -> BTreeSet<String> {
    let mut words = BTreeSet::new();
    for quote in ['\'', '"'] {
        for (i, piece) in source.split(quote).enumerate() {
            // Odd pieces lie between a pair of quotes.
            if i % 2 == 1 && !piece.is_empty() && piece.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                words.insert(piece.to_string());
            }
        }
    }
    words
}

/// The name the template is held under in its environment.
const TEMPLATE_NAME: &str = "chat_template";

/// An environment with jinja2's settings in transformers (keep_trailing_newline stays off, as
/// there), its `raise_exception` and `tojson` (Python's `json.dumps`, key order kept), and
/// Python's string methods. transformers' `strftime_now` is left undefined: a template that
/// asks whether it is defined (Llama 3's) takes its own fixed date, so a conversation renders
/// to the same tokens on every rank and in every resume, as a date of the day would not.
fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |message: String| -> Result<Value, Error> { Err(Error::new(ErrorKind::InvalidOperation, message)) });
    env.add_filter("tojson", crate::python_json::tojson);
    // What a template prints, and its `string` filter, as Python's `str` (jinja2 prints so).
    env.set_formatter(|out, state, value| match value.kind() {
        minijinja::value::ValueKind::Number | minijinja::value::ValueKind::Seq | minijinja::value::ValueKind::Map | minijinja::value::ValueKind::Iterable => {
            out.write_str(&crate::python_json::python_str(value)?).map_err(Error::from)
        }
        _ => minijinja::escape_formatter(out, state, value),
    });
    env.add_filter("string", |value: Value| -> Result<Value, Error> {
        Ok(if value.kind() == minijinja::value::ValueKind::String { value } else { Value::from(crate::python_json::python_str(&value)?) })
    });
    env
}

fn error(path: &Path, problem: impl Into<String>) -> ChatError {
    ChatError { file: path.display().to_string(), problem: problem.into() }
}

/// `source` with `{% generation %}` and `{% endgeneration %}` (any whitespace control)
/// replaced by block tags that keep their whitespace handling (lstrip before the first,
/// trim after the last) and print a marker between them: `{% if true %}{{ START }}{% if true
/// %}` and `{% endif %}{{ END }}{% endif %}`. Whether any was found.
fn marked(source: &str) -> (String, bool) {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    let mut found = false;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        // A statement opens with a name (`{%- if`, `{% generation`): `{%` before anything else
        // is text (`{{ '{%}' }}`), kept as it is, and the scan goes on after it.
        let opens_a_statement = tag[2..].trim_start_matches(['-', '+']).trim_start().starts_with(|c: char| c.is_alphabetic());
        // The close after the opening `{%` (in `{%}` they would overlap).
        let close = tag[2..].find("%}").map(|i| i + 2);
        let Some(close) = close.filter(|_| opens_a_statement) else {
            if close.is_none() {
                out.push_str(tag);
                return (out, found);
            }
            out.push_str("{%");
            rest = &tag[2..];
            continue;
        };
        let inner = &tag[2..close];
        let (left, body, right) = (inner.starts_with('-'), inner.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace()), inner.ends_with('-'));
        let (l, r) = (if left { "-" } else { "" }, if right { "-" } else { "" });
        match body {
            "generation" => {
                found = true;
                out.push_str(&format!("{{%{l} if true %}}{{{{ \"\\uE000\" }}}}{{% if true {r}%}}"));
            }
            "endgeneration" => out.push_str(&format!("{{%{l} endif %}}{{{{ \"\\uE001\" }}}}{{% endif {r}%}}")),
            _ => out.push_str(&tag[..close + 2]),
        }
        rest = &tag[close + 2..];
    }
    out.push_str(rest);
    (out, found)
}

/// The rendered text without its markers, and the character ranges between them.
fn unmarked(rendered: &str) -> RenderedChat {
    let (mut text, mut generations, mut open, mut chars) = (String::with_capacity(rendered.len()), Vec::new(), None, 0);
    for c in rendered.chars() {
        match c {
            GENERATION_START => open = Some(chars),
            GENERATION_END => generations.extend(open.take().map(|start| start..chars)),
            _ => {
                text.push(c);
                chars += 1;
            }
        }
    }
    RenderedChat { text, generations, left_out: Vec::new() }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer's tokens are those that overlap its block: where tokens hold its first and
    /// last characters, transformers' (the tokens holding them, and those between); where a
    /// tokenizer's offsets leave its first character out (a space trimmed), the answer is no
    /// longer skipped, and where they leave its last out, later turns are no longer marked.
    #[test]
    fn answer_tokens_are_those_that_overlap_the_block() {
        let offsets = [(0, 2), (2, 4), (4, 6), (6, 8)];
        assert_eq!(super::answer_tokens(&offsets, &[3..5]), [false, true, true, false]);
        let trimmed = [(0, 2), (3, 5), (5, 6), (7, 9), (9, 12)];
        assert_eq!(super::answer_tokens(&trimmed, &[2..5]), [false, true, false, false, false], "its first character in no token");
        assert_eq!(super::answer_tokens(&trimmed, &[3..7]), [false, true, true, false, false], "its last character in no token");
        assert_eq!(super::answer_tokens(&trimmed, &[6..7]), [false; 5], "no character in a token");
    }

    #[test]
    fn generation_tags_become_markers_with_their_whitespace_control() {
        let (source, found) = marked("a{%- generation %}b{% endgeneration -%}c{% if x %}d{% endif %}");
        assert!(found);
        assert_eq!(source, "a{%- if true %}{{ \"\\uE000\" }}{% if true %}b{% endif %}{{ \"\\uE001\" }}{% endif -%}c{% if x %}d{% endif %}");
        // `{%` that opens no statement (inside a string: `{%}`) is text, and the tags after it
        // are still found (it panicked, slicing `{%}`'s overlapping ends).
        let (source, found) = marked("{{ '{%}' }}{% generation %}b{% endgeneration %}{%");
        assert!(found, "{source}");
        assert_eq!(source, "{{ '{%}' }}{% if true %}{{ \"\\uE000\" }}{% if true %}b{% endif %}{{ \"\\uE001\" }}{% endif %}{%");
        let rendered = unmarked("x\u{E000}ü東\u{E001}y");
        assert_eq!(rendered, RenderedChat { text: "xü東y".into(), generations: vec![1..3], left_out: vec![] });
    }
}
