//! Documents to fine-tune on (`--data`), packed into sequences, each line read as TRL's
//! `SFTTrainer` prepares it (its token ids and labels: `tests/trl_sft.rs`):
//! - JSON Lines, one document per line: `{"text": "..."}`, tokenized here with the
//!   checkpoint's `tokenizer.json` and ended in EOS (unless it ends in one), or
//!   `{"input_ids": [...]}` (or a bare array), already tokenized and taken as given; other
//!   fields of a line are ignored (but a chat line's below);
//! - supervised fine-tuning, where only the answers are trained on (the other tokens are
//!   context: no label, no loss): `{"prompt": "...", "completion": "..."}`, tokenized as TRL's
//!   `SFTTrainer` does (the prompt alone, then prompt and completion together, ended in EOS; the
//!   tokens past the prompt's are the targets), or `{"input_ids": [...], "labels": [...]}` as
//!   transformers' collators make them (a label is the token's id, or -100 where it is not
//!   trained on), or `{"messages": [{"role", "content"}, ...]}` rendered with the checkpoint's
//!   chat template as TRL renders it through transformers' `apply_chat_template`, with the
//!   line's `tools` and `chat_template_kwargs` (`ulysses_models::ChatTemplate`; the assistant's
//!   answers, its `{% generation %}` blocks, are the targets; no EOS is appended: the template
//!   ends each turn itself, as TRL leaves conversations), or a conversational `{"prompt":
//!   [messages], "completion": [messages]}` rendered alike (the completion's answers are the
//!   targets);
//! - any other file given as `--data` is one text document; a folder is read for its `.jsonl`,
//!   `.json` and `.txt` files ([`data_files`](crate::files::data_files)).
//!
//! Documents are packed whole, in order, into sequences of `--seq-len` tokens
//! (`burn_ulysses::data::pack_documents`; a longer document is cut), and each trains as a
//! document of its own: positions restart, attention and labels stay inside it.

use std::{
    fs,
    io::{BufRead, BufReader},
    path::Path,
};

use burn_ulysses::data::pack_documents;
use indicatif::{HumanBytes, ProgressBar, ProgressStyle};
use serde_json::Value;
use ulysses_models::{ChatTemplate, TextTokenizer, TokenizerConfig};

use crate::{corpus::splitmix64, files::data_files, train::StepData};

/// Text lines tokenized together (on every core).
const TOKENIZE_CHUNK: usize = 512;

/// Which way [`DocumentReader`] turns lines into tokens and targets, recorded in checkpoints:
/// a reader that reads the same bytes otherwise makes other batches (2: one BOS, empty texts
/// left out, a prompt's trailing space, one EOS after a completion, the chat template's
/// tojson; 3: a chat line's tools and template arguments, the held-out sequences from a
/// document's start; 4: conversational prompt/completion lines, the tokenizer read as
/// transformers' class reads it, lines already tokenized taken as given, with no EOS
/// appended, as TRL takes them; 5: at most two
/// batches held out, so a long last document no longer holds most of the data out; 6: a
/// tokenized line's `assistant_masks` and `completion_mask` narrow its targets, and a chat
/// template sees `tools` and `documents` as None where a line has none, and the tokenizer's
/// special tokens with its class's defaults; 7: a chat line's `tools` given as a string of JSON
/// are parsed, as TRL parses them, and a file of JSON Lines under another name is found past
/// blank lines and a byte-order mark; 8: an answer's tokens are those that overlap its
/// generation block, where offsets that leave its first or last character out skipped it or
/// marked every later turn; 9: a message's `tool_calls` of null or [] is no call, where templates
/// that test the key rendered an empty call in place of the answer).
pub const DOCUMENT_READER_VERSION: u32 = 9;

/// Which tokens of --data's lines are targets (`--loss-on`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LossOn {
    /// The answers alone: a conversation's `{% generation %}` blocks (a template without them
    /// refused), a prompt/completion line's completion narrowed to them, the tokens with a
    /// label or an answer mask's 1 (TRL's `assistant_only_loss`).
    Assistant,
    /// TRL's defaults (`completion_only_loss`): a prompt/completion line's completion whole
    /// (a conversational one too, whatever its template marks), a tokenized line's labels and
    /// `completion_mask` (not its `assistant_masks`), a conversation's every token.
    Completion,
    /// Every token.
    All,
}

/// How documents become token ids.
pub struct DocumentReader<'a> {
    /// Tokenizes `{"text"}` lines and text files (`None`: only token ids can be read).
    pub tokenizer: Option<&'a TextTokenizer>,
    /// Ends every document.
    pub eos: u32,
    /// Every id must lie below it (the model's vocabulary).
    pub vocab: usize,
    /// Draw a progress bar over the bytes read (rank 0).
    pub progress: bool,
    /// Renders `{"messages"}` lines (`None`: the checkpoint has no chat template).
    pub chat: Option<&'a ChatTemplate>,
    /// Which tokens are targets: under [`LossOn::Assistant`] a conversation needs a template
    /// that marks its answers.
    pub loss_on: LossOn,
    /// Refuse a document longer than this (`--too-long refuse`), naming its line, rather than
    /// cut it into pieces when packing (`None`).
    pub refuse_longer_than: Option<usize>,
    /// Keep the first this many tokens of a longer document, its targets with them, and drop
    /// the rest (`--too-long truncate`, TRL's `max_length`).
    pub truncate_longer_than: Option<usize>,
    /// What reading noticed, for the whole read.
    pub noted: Noted,
}

/// What a [`DocumentReader`] noticed while it read.
#[derive(Default)]
pub struct Noted {
    /// Set once a `{"messages"}` line was rendered with `chat` ([`Documents::rendered_chat`]).
    rendered: std::cell::Cell<bool>,
    /// Prompt/completion lines whose prompt tokenizes otherwise alone than before its completion.
    merged_prompts: std::cell::Cell<usize>,
    /// Conversational prompt/completion lines whose prompt the template renders otherwise alone
    /// than before its completion.
    rerendered_prompts: std::cell::Cell<usize>,
    /// Conversations with no answer to train on under --loss-on assistant.
    unanswered: std::cell::Cell<usize>,
    /// Documents cut to their first --seq-len tokens (`--too-long truncate`).
    truncated: std::cell::Cell<usize>,
    /// Answers (runs of targets) followed by the EOS that is no target: a template whose
    /// `{% generation %}` block closes before its end-of-turn token.
    answers_before_eos: std::cell::Cell<usize>,
    /// Conversations whose system or user text the chat template leaves out of its rendering.
    left_out: std::cell::Cell<usize>,
}

impl Noted {
    /// Answers read so far that end just before an EOS that is no target (warned of at the end
    /// of a read).
    pub fn answers_before_eos(&self) -> usize {
        self.answers_before_eos.get()
    }

    /// Conversations read so far whose system or user text the chat template left out (warned
    /// of at the end of a read).
    pub fn left_out(&self) -> usize {
        self.left_out.get()
    }
}

/// A document as read, before it is tokenized.
enum Pending {
    Text(String),
    Ids(Vec<i64>),
    /// Token ids and whether each is a target (its label is not -100, and every answer mask
    /// the line has marks it).
    Labelled(Vec<i64>, Vec<bool>),
    /// A prompt and its completion: the completion's tokens are the targets.
    PromptCompletion(String, String),
    /// A conversation, rendered with the chat template with these more of its variables (the
    /// line's `tools` and `chat_template_kwargs`): the answers are the targets.
    Messages(Vec<Value>, serde_json::Map<String, Value>),
    /// A conversation's prompt (its messages) and completion (the messages that answer it),
    /// rendered as `Messages`: the completion's tokens are the targets.
    ChatPromptCompletion(Vec<Value>, Vec<Value>, serde_json::Map<String, Value>),
}

/// The progress of a read over its bytes: a bar on a terminal; where there is none (a launcher's
/// pipe, a scheduler's log file, where indicatif hides the bar) a line every half minute, so
/// that an hour of tokenizing is seen under way.
struct ReadProgress {
    bar: ProgressBar,
    lines: bool,
    flag: String,
    started: std::time::Instant,
    last_line: std::cell::Cell<std::time::Instant>,
}

/// How often a read without a bar says how far it is.
const READ_LINE_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

impl ReadProgress {
    fn new(shown: bool, flag: &str, total: u64) -> Self {
        let bar = if shown { ProgressBar::new(total) } else { ProgressBar::hidden() };
        bar.set_style(ProgressStyle::with_template("tokenizing {bytes}/{total_bytes} [{bar:30}] {msg}").unwrap().progress_chars("=> "));
        let now = std::time::Instant::now();
        Self { lines: shown && bar.is_hidden(), bar, flag: flag.to_string(), started: now, last_line: std::cell::Cell::new(now) }
    }

    fn set_message(&self, message: String) {
        self.bar.set_message(message);
    }

    fn inc(&self, bytes: u64) {
        self.bar.inc(bytes);
        if self.lines && self.last_line.get().elapsed() >= READ_LINE_EVERY {
            self.last_line.set(std::time::Instant::now());
            tracing::info!("{}", read_progress_line(&self.flag, self.bar.position(), self.bar.length().unwrap_or(0), self.started.elapsed()));
        }
    }

    fn finish_and_clear(&self) {
        self.bar.finish_and_clear();
    }
}

/// `done` of `total` bytes of `flag` tokenized after `elapsed`, the rate and the time left.
fn read_progress_line(flag: &str, done: u64, total: u64, elapsed: std::time::Duration) -> String {
    let rate = done as f64 / elapsed.as_secs_f64().max(1e-9);
    let left = (rate > 0.0).then(|| std::time::Duration::from_secs_f64(total.saturating_sub(done) as f64 / rate));
    format!(
        "tokenizing {flag}: {} of {} ({:.0}%), {}/s, about {} left",
        HumanBytes(done),
        HumanBytes(total),
        100.0 * done as f64 / total.max(1) as f64,
        HumanBytes(rate as u64),
        left.map_or_else(|| "an unknown time".to_string(), |left| indicatif::HumanDuration(left).to_string())
    )
}

/// Documents as token ids (texts and completions ending in EOS, ids as given), and, where some
/// line marks answers, whether each token is a target (every token of the documents that mark
/// none).
pub struct Documents {
    pub ids: Vec<Vec<i64>>,
    pub targets: Option<Vec<Vec<bool>>>,
    /// Whether some document was a conversation rendered with the chat template (which a
    /// resume must then find the same).
    pub rendered_chat: bool,
    /// What the read noticed and said (said again where a cached read is reused:
    /// [`token_cache`](crate::token_cache)).
    pub notes: Vec<ReadNote>,
}

/// A warning or a note a read logged about its data.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ReadNote {
    pub warning: bool,
    pub text: String,
}

impl ReadNote {
    pub fn log(&self) {
        match self.warning {
            true => tracing::warn!("{}", self.text),
            false => tracing::info!("{}", self.text),
        }
    }
}

/// Logs a note of `warning` or not, and keeps it in `notes`.
fn say(notes: &mut Vec<ReadNote>, warning: bool, text: String) {
    let note = ReadNote { warning, text };
    note.log();
    notes.push(note);
}

impl DocumentReader<'_> {
    /// Every document of `path` (a `.jsonl` or `.json` file of JSON Lines, a text file, or a folder's data files, in name
    /// order) as token ids, texts and completions ending in EOS, ids as given. Documents of fewer
    /// than two tokens (nothing before their EOS; nothing to predict) are left out.
    pub fn read(&self, path: &Path) -> Result<Documents, String> {
        self.read_as("--data", path)
    }

    /// [`read`](Self::read), `flag` naming `path` in messages (`--eval-data`).
    pub fn read_as(&self, flag: &str, path: &Path) -> Result<Documents, String> {
        let (files, others) = data_files(flag, path)?;
        let mut notes = Vec::new();
        if !others.is_empty() {
            let names: Vec<String> = others.iter().map(|f| f.display().to_string()).collect();
            say(&mut notes, true, format!("{flag} {}: not read, neither JSON Lines (.jsonl, .json) nor text (.txt): {}", path.display(), names.join(", ")));
        }
        let total: u64 = files.iter().map(|f| fs::metadata(f).map_or(0, |m| m.len())).sum();
        if self.progress {
            tracing::info!("{flag} {}: reading {} file(s), {}", path.display(), files.len(), HumanBytes(total));
        }
        let bar = ReadProgress::new(self.progress, flag, total);
        let mut documents = Vec::new();
        for file in &files {
            bar.set_message(file.display().to_string());
            // JSON Lines by either name (`datasets`' `to_json` writes them as .json).
            if file.extension().is_some_and(|e| e.eq_ignore_ascii_case("jsonl") || e.eq_ignore_ascii_case("json")) {
                self.read_json_lines(file, &bar, &mut documents)?;
            } else {
                let text = fs::read_to_string(file).map_err(|e| format!("cannot read {} as UTF-8 text: {e}", file.display()))?;
                bar.inc(text.len() as u64);
                self.finish(file, &mut vec![(0, Pending::Text(text))], &mut documents)?;
            }
        }
        bar.finish_and_clear();
        let read = documents.len();
        documents.retain(|(document, _)| document.len() > 1);
        if documents.is_empty() {
            return Err(format!("{flag} {}: no document holds two tokens (besides a text's EOS) to train on", path.display()));
        }
        if documents.len() < read {
            say(&mut notes, false, format!("{flag} {}: left out {} document(s) of fewer than two tokens (empty texts): nothing to predict", path.display(), read - documents.len()));
        }
        let merged = self.noted.merged_prompts.get();
        if merged > 0 {
            say(
                &mut notes,
                true,
                format!(
                    "{flag} {}: {merged} prompt(s) tokenize otherwise alone than before their completion (a prompt ending in a space, \
                     as a rule, whose space joins the completion's first token): their targets start at the first token that differs \
                     (TRL masks as many tokens as the prompt alone has, so the completion's first token, merged, is not trained)",
                    path.display()
                ),
            );
        }
        let rerendered = self.noted.rerendered_prompts.get();
        if rerendered > 0 {
            say(
                &mut notes,
                true,
                format!(
                    "{flag} {}: the chat template renders {rerendered} conversational prompt(s) otherwise alone (with the generation \
                     prompt) than before their completion (a token merged at the join, or a generation prompt the completion's \
                     rendering does not begin with): their targets start at the first token that differs (TRL masks as many tokens \
                     as the prompt alone has)",
                    path.display()
                ),
            );
        }
        let left_out = self.noted.left_out.get();
        if left_out > 0 {
            say(
                &mut notes,
                true,
                format!(
                    "{flag} {}: the chat template leaves the text of a system or user message out of {left_out} conversation(s), which \
                     train without it (Mistral v0.3's keeps the system prompt only with the last user message; transformers renders \
                     them the same): if the model should learn from it, put it in a user message or use a template that keeps it",
                    path.display()
                ),
            );
        }
        let truncated = self.noted.truncated.get();
        if truncated > 0 {
            say(&mut notes, false, format!("{flag} {}: {truncated} document(s) longer than --seq-len kept their first tokens alone (--too-long truncate)", path.display()));
        }
        let before_eos = self.noted.answers_before_eos.get();
        if before_eos > 0 {
            say(
                &mut notes,
                true,
                format!(
                    "{flag} {}: {before_eos} answer(s) end just before the EOS (id {}) that ends their turn, which is then no target: the \
                     chat template's {{% generation %}} blocks close before its end-of-turn token, so the model would not learn to stop. \
                     Move each block's end past that token (TRL's training templates keep it inside)",
                    path.display(),
                    self.eos
                ),
            );
        }
        let unanswered = self.noted.unanswered.get();
        if unanswered > 0 {
            say(
                &mut notes,
                true,
                format!(
                    "{flag} {}: {unanswered} conversation(s) hold no answer the chat template marks, so they train nothing under \
                     --loss-on assistant (TRL's assistant_only_loss refuses such data); they still fill sequences",
                    path.display()
                ),
            );
        }
        let marked = documents.iter().any(|(_, targets)| targets.is_some());
        let unmarked = documents.iter().filter(|(_, targets)| targets.is_none()).count();
        // Text and token-id lines mark no answers: every token of them trains (a chat rendered
        // to text, its prompts too). Said beside lines that do mark them; noted where none does
        // (a plain text corpus trains whole, as meant).
        match (self.loss_on, marked, unmarked) {
            (LossOn::Assistant, true, 1..) => say(
                &mut notes,
                true,
                format!(
                    "{flag} {}: {unmarked} of {} document(s) mark no answers (text or input_ids lines), so every token of them trains under \
                     --loss-on assistant, prompts included, beside the answers of the others: give conversations (messages), \
                     prompt/completion or labelled lines for them too, or --loss-on all to train every token knowingly",
                    path.display(),
                    documents.len()
                ),
            ),
            (LossOn::Assistant, false, _) => say(
                &mut notes,
                false,
                format!(
                    "{flag} {}: no line marks answers (text or input_ids lines): every token trains (a chat rendered to text trains its \
                     prompts too: give messages or prompt/completion lines to train on the answers alone)",
                    path.display()
                ),
            ),
            _ => {}
        }
        let (ids, targets): (Vec<Vec<i64>>, Vec<Option<Vec<bool>>>) = documents.into_iter().unzip();
        let targets = marked.then(|| targets.into_iter().zip(&ids).map(|(targets, ids)| targets.unwrap_or_else(|| vec![true; ids.len()])).collect());
        Ok(Documents { ids, targets, rendered_chat: self.noted.rendered.get(), notes })
    }

    fn read_json_lines(&self, file: &Path, bar: &ReadProgress, documents: &mut Vec<Read>) -> Result<(), String> {
        let reader = BufReader::new(fs::File::open(file).map_err(|e| format!("cannot read {}: {e}", file.display()))?);
        let mut pending = Vec::new();
        for (index, line) in reader.lines().enumerate() {
            let line = line.map_err(|e| format!("{} line {}: {e}", file.display(), index + 1))?;
            bar.inc(line.len() as u64 + 1);
            if line.trim().is_empty() {
                continue;
            }
            let document = parse_line(&line, self.loss_on).map_err(|why| {
                // `[{"text": ...}, ...]` reads as a line of ids and fails as one.
                let hint = if file.extension().is_some_and(|e| e.eq_ignore_ascii_case("json")) {
                    " (a .json file is read as JSON Lines, a record per line, not as one JSON array of records)"
                } else {
                    ""
                };
                format!("{} line {}: {why}{hint}", file.display(), index + 1)
            })?;
            pending.push((index + 1, document));
            if pending.len() == TOKENIZE_CHUNK {
                self.finish(file, &mut pending, documents)?;
            }
        }
        self.finish(file, &mut pending, documents)
    }

    /// Where a completion's targets start in the tokens of prompt and completion together: past
    /// the prompt's own tokens. Where the prompt ends in a space, a byte-level tokenizer merges
    /// it into the completion's first token (or a chat template renders a prompt alone
    /// otherwise): then at the first token that differs, which holds the completion's start (TRL
    /// warns, and masks as many tokens as the prompt alone has: the merged token is not trained,
    /// only the completion's rest); counted in `differed` for one warning.
    fn completion_start<T: PartialEq>(prompt: &[T], whole: &[T], differed: &std::cell::Cell<usize>) -> usize {
        let shared = prompt.iter().zip(whole).take_while(|(a, b)| a == b).count();
        if shared < prompt.len() {
            differed.set(differed.get() + 1);
        }
        shared
    }

    /// The chat template and tokenizer a conversation line is rendered with (and noted as
    /// rendered), or why there are none; under --loss-on assistant, a template that marks no
    /// answers is refused (as TRL's assistant_only_loss refuses it).
    fn chat(&self, at: &dyn Fn() -> String) -> Result<(&ChatTemplate, &TextTokenizer), String> {
        match (self.chat, self.tokenizer) {
            (Some(chat), _) if self.loss_on == LossOn::Assistant && !chat.marks_answers() => Err(format!(
                "{}: the chat template marks no answers ({{% generation %}} blocks), so the answers alone cannot be told \
                 from the prompts: train as TRL does by default with --loss-on completion (a prompt/completion line's completion, \
                 a conversation's every token), on every token with --loss-on all, or give a template that marks them with \
                 --chat-template (TRL's trl/chat_templates/*_training.jinja do for Llama 3, Qwen2.5 and Qwen3)",
                at()
            )),
            (Some(chat), Some(tokenizer)) => {
                self.noted.rendered.set(true);
                Ok((chat, tokenizer))
            }
            (None, _) => Err(format!(
                "{}: a conversation line needs the tokenizer's chat template (chat_template.jinja, or chat_template in \
                 tokenizer_config.json), beside --tokenizer where it is given, else in the --model folder: the folder whose \
                 tokenizer files --save-hf copies (copy the template there), or give one with --chat-template",
                at()
            )),
            (_, None) => Err(format!("{}: a conversation line needs a tokenizer: give --tokenizer TOKENIZER_JSON", at())),
        }
    }

    /// Counts a conversation whose system or user text the template left out, for one warning.
    fn note_left_out(&self, left_out: &[usize]) {
        if !left_out.is_empty() {
            self.noted.left_out.set(self.noted.left_out.get() + 1);
        }
    }

    /// Counts a conversation with no target under --loss-on assistant, and its answers that
    /// end just before an EOS that is no target, for one warning each.
    fn note_unanswered(&self, ids: &[u32], targets: &[bool]) {
        if self.loss_on != LossOn::Assistant {
            return;
        }
        if !targets.contains(&true) {
            self.noted.unanswered.set(self.noted.unanswered.get() + 1);
        }
        let before_eos = (1..ids.len()).filter(|&i| targets[i - 1] && !targets[i] && ids[i] == self.eos).count();
        self.noted.answers_before_eos.set(self.noted.answers_before_eos.get() + before_eos);
    }

    /// Tokenizes the pending documents (all texts at once), appends EOS and checks the ids.
    fn finish(&self, file: &Path, pending: &mut Vec<(usize, Pending)>, documents: &mut Vec<Read>) -> Result<(), String> {
        let joined: Vec<String> = pending.iter().filter_map(|(_, p)| if let Pending::PromptCompletion(prompt, completion) = p { Some(format!("{prompt}{completion}")) } else { None }).collect();
        let mut joined_texts = joined.iter();
        let texts: Vec<&str> = pending
            .iter()
            .flat_map(|(_, p)| match p {
                Pending::Text(text) => vec![text.as_str()],
                // The prompt alone, then prompt and completion together (TRL's way).
                Pending::PromptCompletion(prompt, _) => vec![prompt.as_str(), joined_texts.next().expect("one joined text per prompt").as_str()],
                Pending::Ids(_) | Pending::Labelled(..) | Pending::Messages(..) | Pending::ChatPromptCompletion(..) => vec![],
            })
            .collect();
        let mut encoded = match (texts.is_empty(), self.tokenizer) {
            (true, _) => Vec::new(),
            (false, Some(tokenizer)) => tokenizer.encode_documents(&texts, self.eos).map_err(|e| e.to_string())?,
            (false, None) => {
                return Err(format!(
                    "{}: text needs a tokenizer: give --tokenizer TOKENIZER_JSON (a --model folder's tokenizer.json is used when it has one)",
                    file.display()
                ));
            }
        }
        .into_iter();
        let eos = i64::from(self.eos);
        // The tokens the tokenizer adds before a text (Llama 3's `<|begin_of_text|>`).
        let added = match self.tokenizer {
            Some(tokenizer) => tokenizer.added_before_text().len(),
            None => 0,
        };
        for (line, document) in pending.drain(..) {
            let at = || if line == 0 { file.display().to_string() } else { format!("{} line {line}", file.display()) };
            let mut next = || -> Vec<i64> { encoded.next().expect("one encoding per text").into_iter().map(i64::from).collect() };
            let (ids, targets): (Vec<i64>, Option<Vec<bool>>) = match document {
                Pending::Text(_) => {
                    let mut ids = next();
                    end_in_one_eos(&mut ids, eos);
                    // Nothing but what the tokenizer adds (a BOS) and the EOS: an empty text.
                    if ids.len() == added + 1 {
                        ids.truncate(1);
                    }
                    (ids, None)
                }
                Pending::PromptCompletion(..) => {
                    let mut prompt = next();
                    prompt.pop(); // The EOS the encoder appended.
                    let mut ids = next();
                    end_in_one_eos(&mut ids, eos);
                    let shared = Self::completion_start(&prompt, &ids, &self.noted.merged_prompts);
                    let targets = (0..ids.len()).map(|i| i >= shared).collect();
                    (ids, Some(targets))
                }
                // Already tokenized: as given, as TRL takes a line with `input_ids`.
                Pending::Ids(ids) => (ids, None),
                Pending::Labelled(ids, targets) => (ids, Some(targets)),
                Pending::Messages(messages, variables) => {
                    let (chat, tokenizer) = self.chat(&at)?;
                    let chat = chat.tokenize_with(tokenizer, &messages, &variables, false).map_err(|e| format!("{}: {e}", at()))?;
                    let (ids, answers) = (chat.ids, chat.answers);
                    self.note_left_out(&chat.left_out);
                    self.note_unanswered(&ids, &answers);
                    // A conversation has no completion: TRL's defaults train all of it.
                    let answers = (self.loss_on == LossOn::Assistant).then_some(answers);
                    (ids.into_iter().map(i64::from).collect(), answers)
                }
                Pending::ChatPromptCompletion(prompt, completion, variables) => {
                    let (chat, tokenizer) = self.chat(&at)?;
                    // TRL's way: the prompt alone with the generation prompt, then the whole
                    // conversation; the completion starts where they diverge (TRL's starts past as
                    // many tokens as the prompt alone has: the same where it is a prefix). Under --loss-on
                    // assistant, narrowed to the answers the template marks (TRL's
                    // assistant_only_loss).
                    let prompt_ids = chat.tokenize_with(tokenizer, &prompt, &variables, true).map_err(|e| format!("{}: {e}", at()))?.ids;
                    let whole: Vec<Value> = prompt.iter().cloned().chain(completion).collect();
                    let rendered = chat.tokenize_with(tokenizer, &whole, &variables, false).map_err(|e| format!("{}: {e}", at()))?;
                    let (ids, answers) = (rendered.ids, rendered.answers);
                    self.note_left_out(&rendered.left_out);
                    let shared = Self::completion_start(&prompt_ids, &ids, &self.noted.rerendered_prompts);
                    // Apart by more than the token at the join, and not only in the generation
                    // prompt (a completion that is no assistant turn): the template moves or
                    // drops the prompt's text (TRL would mask the prompt's length of tokens,
                    // wherever they fall).
                    let moved = || -> Result<bool, String> {
                        let plain = chat.tokenize_with(tokenizer, &prompt, &variables, false).map_err(|e| format!("{}: {e}", at()))?.ids;
                        Ok(plain.len() - plain.iter().zip(&ids).take_while(|(a, b)| a == b).count() > 1)
                    };
                    // Under --loss-on all every token trains: where the completion starts is moot.
                    if self.loss_on != LossOn::All && prompt_ids.len() - shared > 1 && moved()? {
                        return Err(format!(
                            "{}: the chat template renders the prompt alone (with its generation prompt) otherwise than the start of the \
                             whole conversation, {} tokens before the prompt's end (it moves or drops text: Mistral v0.3's puts the system \
                             prompt into the last user message only), so where the completion starts cannot be told and the prompt's \
                             turns would be trained: give the line as {{\"messages\": [...]}} with a template that marks the answers \
                             ({{% generation %}}), or use a template that renders a prompt as the start of its conversation",
                            at(),
                            prompt_ids.len() - shared
                        ));
                    }
                    let narrowed = self.loss_on == LossOn::Assistant;
                    let targets: Vec<bool> = answers.iter().enumerate().map(|(i, &answer)| i >= shared && (answer || !narrowed)).collect();
                    self.note_unanswered(&ids, &targets);
                    (ids.into_iter().map(i64::from).collect(), Some(targets))
                }
            };
            if let Some(id) = ids.iter().find(|&&id| !(0..self.vocab as i64).contains(&id)) {
                return Err(format!("{}: token {id} is outside the model's vocabulary 0..{}", at(), self.vocab));
            }
            if let Some(limit) = self.refuse_longer_than.filter(|&limit| ids.len() > limit) {
                return Err(format!(
                    "{}: the document has {} tokens, more than --seq-len {limit} (--too-long refuse): give a longer --seq-len, \
                     --too-long cut to train on it in pieces, or --too-long truncate on its first {limit} tokens alone",
                    at(),
                    ids.len()
                ));
            }
            let (mut ids, mut targets) = (ids, targets);
            if let Some(limit) = self.truncate_longer_than.filter(|&limit| ids.len() > limit) {
                ids.truncate(limit);
                if let Some(targets) = targets.as_mut() {
                    targets.truncate(limit);
                }
                self.noted.truncated.set(self.noted.truncated.get() + 1);
            }
            documents.push((ids, targets));
        }
        Ok(())
    }
}

/// The token that ends each document: `flag` (`--eos-token-id`), else the tokenizer's
/// `eos_token` (its `tokenizer_config.json`, else its tokenizer class's default, as
/// transformers' `tokenizer.eos_token` gives it), which TRL's `SFTTrainer` ends texts and
/// completions with, else config.json's first `eos_token_id`. With it, a note to log where the
/// tokenizer's differs from config.json's (Llama 3's instruct models end turns in `<|eot_id|>`,
/// and list `<|end_of_text|>` first).
pub fn document_eos(flag: Option<u32>, tokenizer: Option<(&TextTokenizer, &TokenizerConfig)>, config_eos: Option<u64>) -> Result<(u32, Option<String>), String> {
    if let Some(id) = flag {
        return Ok((id, None));
    }
    // The config's, else its tokenizer class's default (transformers' `tokenizer.eos_token`).
    let named = tokenizer.and_then(|(tokenizer, config)| {
        let from_class = || tokenizer.class_eos_token().map(|token| (token, format!("{}'s default", tokenizer.transformers_class().name())));
        config.eos_token().map(|token| (token, config.file.display().to_string())).or_else(from_class).map(|(token, source)| (tokenizer, token, source))
    });
    if let Some((tokenizer, token, source)) = named {
        let Some(id) = tokenizer.token_id(token) else {
            return Err(format!(
                "{source}: its eos_token {token:?} is not a token of the tokenizer beside it: give --eos-token-id ID (the id of the token \
                 that ends a document)"
            ));
        };
        let note = config_eos.filter(|&first| first != u64::from(id)).map(|first| {
            format!(
                "documents end in the tokenizer's eos_token {token:?} (id {id}, {source}), as TRL's SFTTrainer ends them, not in config.json's \
                 first eos_token_id {first}: give --eos-token-id to choose"
            )
        });
        return Ok((id, note));
    }
    match config_eos {
        Some(id) => u32::try_from(id).map(|id| (id, None)).map_err(|_| format!("config.json's eos_token_id {id} is not a token id: give --eos-token-id")),
        None => Err("--data: neither the tokenizer's tokenizer_config.json (eos_token) nor the checkpoint's config.json (eos_token_id) names \
                     the token that ends each document: give --eos-token-id ID (the id of its end-of-text token, e.g. <|endoftext|>)"
            .into()),
    }
}

/// Ends `ids` (which the encoder ended in EOS) in one EOS: a text that ended in it already
/// keeps its own.
fn end_in_one_eos(ids: &mut Vec<i64>, eos: i64) {
    if ids.len() >= 2 && ids[ids.len() - 2] == eos {
        ids.pop();
    }
}

/// A document read: its token ids, and whether each is a target where the line says.
type Read = (Vec<i64>, Option<Vec<bool>>);

/// The label transformers' collators give a token that is not trained on.
const NOT_TRAINED: i64 = -100;

/// One JSON line: `{"text": ...}`, `{"input_ids": [...]}` (with `"labels"`, `"assistant_masks"`
/// or `"completion_mask"`, or none), a
/// bare array of ids, or `{"prompt": ..., "completion": ...}`.
fn parse_line(line: &str, loss_on: LossOn) -> Result<Pending, String> {
    // A byte-order mark (a file saved as "UTF-8 with BOM") is no content.
    let line = line.strip_prefix('\u{feff}').unwrap_or(line);
    let value: Value = serde_json::from_str(line).map_err(|e| format!("not JSON ({e})"))?;
    let ids = |value: &Value, field: &str| -> Result<Vec<i64>, String> {
        serde_json::from_value(value.clone()).map_err(|_| format!("\"{field}\" must be an array of integer token ids"))
    };
    let Value::Object(fields) = &value else {
        return match &value {
            Value::Array(_) => ids(&value, "input_ids").map(Pending::Ids),
            _ => Err("expected an object with \"text\", \"input_ids\" or \"prompt\" and \"completion\"".into()),
        };
    };
    let kinds: Vec<&str> = ["text", "input_ids", "prompt", "messages"].into_iter().filter(|k| fields.contains_key(*k)).collect();
    match kinds.as_slice() {
        ["text"] => match &fields["text"] {
            Value::String(text) => Ok(Pending::Text(text.clone())),
            _ => Err("\"text\" must be a string".into()),
        },
        ["input_ids"] => {
            let input_ids = ids(&fields["input_ids"], "input_ids")?;
            // Padding a collator masked out would be trained on as text.
            if let Some(mask) = fields.get("attention_mask") {
                let mask: Vec<i64> = serde_json::from_value(mask.clone()).map_err(|_| "\"attention_mask\" must be an array of 0s and 1s".to_string())?;
                if mask.len() != input_ids.len() {
                    return Err(format!("\"attention_mask\" has {} entries and \"input_ids\" {}: one per token", mask.len(), input_ids.len()));
                }
                if let Some(masked) = Some(mask.iter().filter(|&&m| m != 1).count()).filter(|&n| n > 0) {
                    return Err(format!(
                        "\"attention_mask\" masks {masked} of its {} tokens out (padding, as a rule): give the tokens alone, without \
                         padding (documents are packed and padded here)",
                        input_ids.len()
                    ));
                }
            }
            // The answers' marks transformers and TRL give tokenized chats
            // (`apply_chat_template(..., return_assistant_tokens_mask=True)`'s `assistant_masks`,
            // TRL's `completion_mask`): its collator trains on the marked tokens alone; with TRL's
            // defaults (no `assistant_only_loss`), on the completion's alone.
            let mut targets: Option<Vec<bool>> = None;
            let masks: &[&str] = if loss_on == LossOn::Completion { &["completion_mask"] } else { &["assistant_masks", "completion_mask"] };
            for &field in masks {
                let Some(mask) = fields.get(field) else { continue };
                let mask: Vec<u8> = serde_json::from_value(mask.clone()).ok().filter(|m: &Vec<u8>| m.iter().all(|&m| m <= 1)).ok_or_else(|| format!("\"{field}\" must be an array of 0s and 1s"))?;
                if mask.len() != input_ids.len() {
                    return Err(format!("\"{field}\" has {} entries and \"input_ids\" {}: one per token", mask.len(), input_ids.len()));
                }
                let marked = targets.take().unwrap_or_else(|| vec![true; mask.len()]);
                targets = Some(marked.into_iter().zip(mask).map(|(target, m)| target && m == 1).collect());
            }
            if let Some(labels) = fields.get("labels") {
                let labels = ids(labels, "labels")?;
                if labels.len() != input_ids.len() {
                    return Err(format!("\"labels\" has {} entries and \"input_ids\" {}: one label per token", labels.len(), input_ids.len()));
                }
                if let Some((at, (label, id))) = labels.iter().zip(&input_ids).enumerate().find(|(_, (label, id))| **label != NOT_TRAINED && label != id) {
                    return Err(format!(
                        "label {label} at position {at} is neither {NOT_TRAINED} nor the token there ({id}): labels say which tokens are trained on, \
                         as transformers' collators make them (the model shifts them itself)"
                    ));
                }
                let marked = targets.take().unwrap_or_else(|| vec![true; labels.len()]);
                targets = Some(marked.into_iter().zip(labels).map(|(target, label)| target && label != NOT_TRAINED).collect());
            }
            Ok(match targets {
                Some(targets) => Pending::Labelled(input_ids, targets),
                None => Pending::Ids(input_ids),
            })
        }
        ["prompt"] => match (&fields["prompt"], fields.get("completion")) {
            (Value::String(prompt), Some(Value::String(completion))) => Ok(Pending::PromptCompletion(prompt.clone(), completion.clone())),
            // TRL's conversational prompt and completion.
            (prompt @ Value::Array(_), Some(completion @ Value::Array(_))) => match (conversation(prompt), conversation(completion)) {
                (Some(prompt), Some(completion)) => Ok(Pending::ChatPromptCompletion(prompt, completion, template_variables(fields)?)),
                _ => Err("a conversational \"prompt\" and \"completion\" must each be a non-empty array of {\"role\": ..., \"content\": ...} objects".into()),
            },
            (_, None) => Err("has a \"prompt\" but no \"completion\": give both (the completion is what is trained on)".into()),
            _ => Err("\"prompt\" and \"completion\" must be strings, or both arrays of messages".into()),
        },
        ["messages"] => match conversation(&fields["messages"]) {
            Some(messages) => Ok(Pending::Messages(messages, template_variables(fields)?)),
            None => Err("\"messages\" must be a non-empty array of {\"role\": ..., \"content\": ...} objects".into()),
        },
        [] => Err("needs a \"text\" (a string), an \"input_ids\" (token ids), a \"prompt\" and \"completion\", or a \"messages\" field".into()),
        several => Err(format!("has {}; give one kind of document", several.iter().map(|k| format!("\"{k}\"")).collect::<Vec<_>>().join(" and "))),
    }
}

/// A line's messages, where they are a non-empty array of objects with a `role` string (a
/// message's content is checked as the template renders it: a tool call may go without).
fn conversation(messages: &Value) -> Option<Vec<Value>> {
    messages.as_array().filter(|messages| !messages.is_empty() && messages.iter().all(|m| m["role"].is_string())).cloned()
}

/// A conversation line's variables for the chat template, as TRL's SFTTrainer renders a line:
/// its `tools` (a string of JSON parsed first, as TRL does: datasets store them so), and its
/// `chat_template_kwargs`.
fn template_variables(fields: &serde_json::Map<String, Value>) -> Result<serde_json::Map<String, Value>, String> {
    let mut variables = match fields.get("chat_template_kwargs") {
        None | Some(Value::Null) => serde_json::Map::new(),
        Some(Value::Object(kwargs)) => kwargs.clone(),
        Some(_) => return Err("\"chat_template_kwargs\" must be an object of the chat template's variables".into()),
    };
    let tools = match fields.get("tools") {
        Some(Value::String(json)) => Some(
            serde_json::from_str::<Value>(json).map_err(|e| format!("\"tools\" is a string that is not JSON ({e}): give the tool schemas as a list of objects, or as that list's JSON"))?,
        ),
        tools => tools.cloned(),
    };
    if let Some(tools) = tools.filter(|tools| !tools.is_null())
        && variables.insert("tools".into(), tools).is_some()
    {
        return Err("has \"tools\" both beside the messages and in \"chat_template_kwargs\": give them once".into());
    }
    Ok(variables)
}

/// Documents packed into sequences of `seq_len`, drawn `batch_size` per step in a seeded
/// order that changes each epoch; the last batch is held out when there are two or more.
/// Each sequence keeps the lengths of the documents packed into it: an EOS inside a document
/// (a chat template's end of turn, when that is the checkpoint's EOS) does not end it.
pub struct PackedDocuments {
    train: Vec<Packed>,
    eval: Option<Vec<Packed>>,
    batch_size: usize,
    seed: u64,
    /// The last epoch's order built ([`epoch_order`](Self::epoch_order)): a step's batch, its
    /// targets and documents are drawn from it, each a shuffle of every sequence otherwise.
    last_order: std::sync::Mutex<Option<(usize, std::sync::Arc<Vec<usize>>)>>,
}

/// Whether each packed sequence (of the documents' `lengths` in it, as `pack_documents` gives
/// them) begins with a later piece of a document packing cut, not with a document's start.
fn begins_mid_document(documents: &[Vec<i64>], seq_len: usize, lengths: &[Vec<usize>]) -> Vec<bool> {
    let first_pieces: Vec<bool> = documents.iter().flat_map(|d| (0..d.len().div_ceil(seq_len)).map(|piece| piece == 0)).collect();
    let mut piece = 0;
    lengths
        .iter()
        .map(|pieces| {
            let mid = !first_pieces[piece];
            piece += pieces.len();
            mid
        })
        .collect()
}

/// What packing into sequences of a length cuts: documents longer, and (with targets) the
/// targets past each one's first piece.
#[derive(Debug, PartialEq)]
struct CutDocuments {
    documents: usize,
    later_targets: usize,
}

impl CutDocuments {
    fn of(documents: &[Vec<i64>], targets: Option<&[Vec<bool>]>, seq_len: usize) -> Self {
        let long: Vec<usize> = documents.iter().enumerate().filter(|(_, d)| d.len() > seq_len).map(|(i, _)| i).collect();
        let later_targets = targets.map_or(0, |targets| long.iter().map(|&i| targets[i].iter().skip(seq_len).filter(|&&t| t).count()).sum());
        Self { documents: long.len(), later_targets }
    }
}

/// What packing `documents` (those of `flag`, `--data` or `--eval-data`, `evaluated` or
/// trained on) into sequences of `seq_len` cuts, said for the log, or `None` where it cuts none.
pub fn cut_documents_note(documents: &[Vec<i64>], targets: Option<&[Vec<bool>]>, seq_len: usize, flag: &str, evaluated: bool) -> Option<String> {
    let cut = CutDocuments::of(documents, targets, seq_len);
    let how = if evaluated { "evaluated" } else { "trained" };
    let answers = match targets {
        Some(_) => format!("; {} of their target tokens lie past the first piece, {how} without the start of their document (the prompt)", cut.later_targets),
        None => String::new(),
    };
    (cut.documents > 0).then(|| {
        format!(
            "{} {flag} document(s) longer than --seq-len {seq_len} were cut into pieces, each {how} as a document of its own (positions \
             restart, no piece attends to another){answers}: --too-long refuse names them, --too-long truncate keeps their first piece \
             alone, a larger --seq-len keeps them whole",
            cut.documents
        )
    })
}

/// One packed sequence, the lengths of its documents and, for supervised fine-tuning, whether
/// each token is a target.
#[derive(Debug, Clone)]
struct Packed {
    tokens: Vec<i64>,
    documents: Vec<usize>,
    targets: Option<Vec<bool>>,
}

impl PackedDocuments {
    /// Packs `documents`; with `hold_out`, the last batch is kept for evaluation when there are
    /// at least two.
    pub fn pack(documents: &[Vec<i64>], seq_len: usize, batch_size: usize, seed: u64, hold_out: bool) -> Result<Self, String> {
        Self::pack_with_targets(documents, None, seq_len, batch_size, seed, hold_out)
    }

    /// [`pack`](Self::pack) with each token's target flag (`targets[d]` for document `d`),
    /// which follows its token into the packed sequences.
    pub fn pack_with_targets(documents: &[Vec<i64>], targets: Option<&[Vec<bool>]>, seq_len: usize, batch_size: usize, seed: u64, hold_out: bool) -> Result<Self, String> {
        let (sequences, lengths) = pack_documents(documents, seq_len);
        // Packing keeps every token in order: the flags, concatenated, cut as the tokens were.
        let mut flags = targets.map(|targets| targets.iter().flatten().copied());
        let mut packed_targets: Vec<Option<Vec<bool>>> = sequences.iter().map(|s| flags.as_mut().map(|flags| flags.by_ref().take(s.len()).collect())).collect();
        let tokens: usize = sequences.iter().map(Vec::len).sum();
        let count = sequences.len();
        if count < batch_size {
            return Err(format!(
                "--data packs into {count} sequence(s) of up to --seq-len {seq_len} tokens ({tokens} tokens), fewer than one batch \
                 (--batch-size {batch_size}): give more data, or a smaller --batch-size or --seq-len"
            ));
        }
        let mid_document = begins_mid_document(documents, seq_len, &lengths);
        let mut train: Vec<Packed> =
            sequences.into_iter().zip(lengths).zip(packed_targets.drain(..)).map(|((tokens, documents), targets)| Packed { tokens, documents, targets }).collect();
        // The last batch, or up to one more: the held-out sequences begin at a document's start
        // (a document cut by packing would be evaluated on the continuation of text trained on),
        // and never take more than two batches from training.
        let most_held_out = (2 * batch_size).min(count - batch_size);
        let eval = match (hold_out && count >= 2 * batch_size).then(|| (count - most_held_out..=count - batch_size).rev().find(|&split| !mid_document[split])) {
            Some(Some(split)) => Some(train.split_off(split)),
            Some(None) => {
                tracing::warn!(
                    "nothing held out of --data: a held-out part of one or two batches ({batch_size} to {most_held_out} sequences) would begin \
                     inside a document that training reads; give --eval-data"
                );
                None
            }
            None => None,
        };
        // A small set's last batch is a large part of it, and trained on nowhere.
        if let Some(eval) = eval.as_ref().filter(|eval| eval.len() * 10 > count && crate::train::says_run_notes()) {
            tracing::warn!(
                "{} of --data's {count} packed sequences ({:.0}%), its last, are held out to evaluate on and not trained on: give \
                 held-out documents apart with --eval-data (--data is then trained on whole), or --eval-every 0 to train on all",
                eval.len(),
                100.0 * eval.len() as f64 / count as f64
            );
        }
        tracing::info!(
            documents = documents.len(),
            sequences = count,
            tokens,
            fill = format!("{:.1}%", 100.0 * tokens as f64 / (seq_len * count) as f64),
            held_out = eval.as_ref().map_or(0, Vec::len),
            "packed the documents"
        );
        Ok(Self { train, eval, batch_size, seed, last_order: Default::default() })
    }

    /// These documents, trained on whole, evaluated on `held_out`'s sequences, all of them
    /// (packed apart: an `--eval-data` file).
    pub fn held_out_by(mut self, held_out: PackedDocuments) -> Self {
        let mut sequences = held_out.train;
        sequences.extend(held_out.eval.into_iter().flatten());
        self.train.extend(self.eval.take().into_iter().flatten());
        self.eval = Some(sequences);
        self.last_order = Default::default();
        self
    }

    /// Sequences drawn for training (the held-out batch not among them).
    pub fn train_count(&self) -> usize {
        self.train.len()
    }

    /// Every packed sequence (the held-out ones last) and its documents, for evaluating the
    /// whole file.
    pub fn everything(&self) -> (Vec<Vec<i64>>, Vec<Vec<usize>>) {
        self.train.iter().chain(self.eval.iter().flatten()).map(|p| (p.tokens.clone(), p.documents.clone())).unzip()
    }

    /// The target flags of [`everything`](Self::everything)'s sequences, where the data marks
    /// answers.
    pub fn every_target(&self) -> Option<Vec<Vec<bool>>> {
        self.train.iter().chain(self.eval.iter().flatten()).map(|p| p.targets.clone()).collect()
    }

    /// The order in which epoch `epoch` draws the sequences of `train`: a permutation seeded by
    /// (seed, epoch), so each epoch sees every sequence once. The last one built is kept.
    fn epoch_order(&self, epoch: usize) -> std::sync::Arc<Vec<usize>> {
        let mut last = self.last_order.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, order)) = last.as_ref().filter(|(built, _)| *built == epoch) {
            return order.clone();
        }
        let count = self.train.len();
        let mut order: Vec<usize> = (0..count).collect();
        for i in (1..count).rev() {
            let j = (splitmix64(self.seed ^ 0x646f_6373 ^ ((epoch as u64) << 32) ^ i as u64) % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
        let order = std::sync::Arc::new(order);
        *last = Some((epoch, order.clone()));
        order
    }

    /// The sequences of step `step`: draws `step · batch_size ..` of the epochs' orders, each
    /// order built once (a step may end one epoch and begin the next).
    fn step_sequences(&self, step: usize) -> impl Iterator<Item = &Packed> {
        let count = self.train.len();
        let first = step * self.batch_size;
        let mut order: Option<(usize, std::sync::Arc<Vec<usize>>)> = None;
        let drawn: Vec<usize> = (first..first + self.batch_size)
            .map(|index| {
                let epoch = index / count;
                if order.as_ref().is_none_or(|(built, _)| *built != epoch) {
                    order = Some((epoch, self.epoch_order(epoch)));
                }
                order.as_ref().unwrap().1[index % count]
            })
            .collect();
        drawn.into_iter().map(move |i| &self.train[i])
    }
}

impl StepData for PackedDocuments {
    fn train_batch(&self, step: usize) -> Vec<Vec<i64>> {
        self.step_sequences(step).map(|p| p.tokens.clone()).collect()
    }

    fn eval_batch(&self) -> Option<Vec<Vec<i64>>> {
        self.eval.as_ref().map(|eval| eval.iter().map(|p| p.tokens.clone()).collect())
    }

    fn train_documents(&self, step: usize, _batch: &[Vec<i64>]) -> Vec<Vec<usize>> {
        self.step_sequences(step).map(|p| p.documents.clone()).collect()
    }

    fn train_targets(&self, step: usize, _batch: &[Vec<i64>]) -> Option<Vec<Vec<bool>>> {
        self.step_sequences(step).map(|p| p.targets.clone()).collect()
    }

    fn eval_documents(&self) -> Option<Vec<Vec<usize>>> {
        self.eval.as_ref().map(|eval| eval.iter().map(|p| p.documents.clone()).collect())
    }

    fn eval_targets(&self) -> Option<Vec<Vec<bool>>> {
        self.eval.as_ref()?.iter().map(|p| p.targets.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A line as `--loss-on assistant` reads it.
    fn parse_line(line: &str) -> Result<Pending, String> {
        super::parse_line(line, LossOn::Assistant)
    }

    /// A read without a bar says how far it is, its rate and the time left.
    #[test]
    fn a_read_without_a_bar_says_how_far_it_is() {
        let line = read_progress_line("--data", 3 << 30, 12 << 30, std::time::Duration::from_secs(60));
        assert_eq!(line, "tokenizing --data: 3.00 GiB of 12.00 GiB (25%), 51.20 MiB/s, about 3 minutes left");
        assert!(read_progress_line("--data", 0, 10, std::time::Duration::from_secs(1)).ends_with("about an unknown time left"));
    }

    #[test]
    fn lines_of_each_kind_and_what_is_refused() {
        assert!(matches!(parse_line(r#"{"text": "hi", "id": 3}"#), Ok(Pending::Text(t)) if t == "hi"));
        assert!(matches!(parse_line(r#"{"input_ids": [1, 2]}"#), Ok(Pending::Ids(ids)) if ids == [1, 2]));
        // A file saved as "UTF-8 with BOM": the mark before its first line is no content.
        assert!(matches!(parse_line("\u{feff}{\"input_ids\": [1, 2]}"), Ok(Pending::Ids(ids)) if ids == [1, 2]));
        assert!(matches!(parse_line("[4, 5]"), Ok(Pending::Ids(ids)) if ids == [4, 5]));
        assert!(matches!(parse_line(r#"{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}"#), Ok(Pending::Labelled(ids, targets)) if ids == [1, 2, 3] && targets == [false, true, true]));
        // A tokenized chat's answer marks (transformers' `assistant_masks`, TRL's
        // `completion_mask`), with labels too: the tokens every one of them marks.
        assert!(matches!(parse_line(r#"{"input_ids": [1, 2, 3], "attention_mask": [1, 1, 1], "assistant_masks": [0, 1, 1]}"#), Ok(Pending::Labelled(ids, targets)) if ids == [1, 2, 3] && targets == [false, true, true]));
        // TRL's defaults (--loss-on completion) take no assistant_masks: the completion's alone.
        assert!(matches!(super::parse_line(r#"{"input_ids": [1, 2, 3], "assistant_masks": [0, 1, 1]}"#, LossOn::Completion), Ok(Pending::Ids(ids)) if ids == [1, 2, 3]));
        assert!(matches!(super::parse_line(r#"{"input_ids": [1, 2, 3], "assistant_masks": [0, 0, 1], "completion_mask": [0, 1, 1]}"#, LossOn::Completion), Ok(Pending::Labelled(_, targets)) if targets == [false, true, true]));
        assert!(matches!(parse_line(r#"{"input_ids": [1, 2, 3, 4], "completion_mask": [0, 0, 1, 1], "labels": [1, 2, 3, -100]}"#), Ok(Pending::Labelled(_, targets)) if targets == [false, false, true, false]));
        assert!(matches!(parse_line(r#"{"prompt": "Q: ", "completion": "A"}"#), Ok(Pending::PromptCompletion(p, c)) if p == "Q: " && c == "A"));
        assert!(matches!(parse_line(r#"{"messages": [{"role": "user", "content": "hi"}]}"#), Ok(Pending::Messages(m, v)) if m.len() == 1 && v.is_empty()));
        // TRL's: the line's tools and template arguments go to the template; a tool call may
        // go without content (the template's check, which knows the calls).
        let line = r#"{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}], "tools": [{"name": "f"}], "chat_template_kwargs": {"enable_thinking": false}}"#;
        let Ok(Pending::Messages(_, variables)) = parse_line(line) else { panic!("{line} refused") };
        assert_eq!(Value::Object(variables), serde_json::json!({"tools": [{"name": "f"}], "enable_thinking": false}));
        // Tools stored as a string of JSON (as datasets keep them) are parsed, as TRL does.
        let line = r#"{"messages": [{"role": "user", "content": "hi"}], "tools": "[{\"name\": \"f\"}]"}"#;
        let Ok(Pending::Messages(_, variables)) = parse_line(line) else { panic!("{line} refused") };
        assert_eq!(Value::Object(variables), serde_json::json!({"tools": [{"name": "f"}]}));
        for (line, expected) in [
            (r#"{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": [1]}"#, "\"chat_template_kwargs\" must be an object"),
            (r#"{"messages": [{"role": "user", "content": "hi"}], "tools": [], "chat_template_kwargs": {"tools": []}}"#, "give them once"),
            (r#"{"messages": [{"role": "user", "content": "hi"}], "tools": "[{"}"#, "\"tools\" is a string that is not JSON"),
            (r#"{"text": "a", "input_ids": [1]}"#, "has \"text\" and \"input_ids\""),
            (r#"{"text": 3}"#, "must be a string"),
            (r#"{"input_ids": [1.5]}"#, "integer token ids"),
            (r#"{"input_ids": [1, 2], "labels": [1]}"#, "one label per token"),
            (r#"{"input_ids": [1, 2], "assistant_masks": [1]}"#, "\"assistant_masks\" has 1 entries and \"input_ids\" 2"),
            (r#"{"input_ids": [1, 2], "completion_mask": [0, 2]}"#, "\"completion_mask\" must be an array of 0s and 1s"),
            (r#"{"input_ids": [1, 2], "labels": [1, 7]}"#, "label 7 at position 1 is neither -100 nor the token there (2)"),
            (r#"{"prompt": "Q"}"#, "no \"completion\""),
            (r#"{"prompt": "Q", "completion": 3}"#, "must be strings"),
            (r#"{"messages": []}"#, "non-empty array"),
            (r#"{"messages": [{"content": "hi"}]}"#, "non-empty array"),
            (r#"{"content": "a"}"#, "needs a \"text\""),
            ("\"a\"", "expected an object"),
            ("{", "not JSON"),
        ] {
            let error = parse_line(line).err().unwrap_or_else(|| panic!("{line} was accepted"));
            assert!(error.contains(expected), "{line}: {error}");
        }
    }

    /// The held-out sequences begin at a document's start: a document cut across the last
    /// batch's edge is trained on whole, and the sequences from its start on are held out.
    #[test]
    fn no_held_out_sequence_continues_a_document_trained_on() {
        // Sequences of 4: [1 1 1 1] [2 2 2 2] [2 2 3 3] [4 4 4 4] [4 4 4 4] [4 5]; the last
        // batch of 2 would be the 4's second piece and [4 5].
        let documents = [vec![1; 4], vec![2; 6], vec![3; 2], vec![4; 9], vec![5]];
        let held_out = |documents: &[Vec<i64>]| PackedDocuments::pack(documents, 4, 2, 0, true).unwrap().eval.map(|eval| eval.iter().map(|p| p.tokens.clone()).collect::<Vec<_>>());
        assert_eq!(held_out(&documents), Some(vec![vec![4; 4], vec![4; 4], vec![4, 5]]));
        // Whole documents at the edge: the last batch.
        let whole = [vec![1; 4], vec![2; 4], vec![3; 4], vec![4; 4]];
        assert_eq!(held_out(&whole), Some(vec![vec![3; 4], vec![4; 4]]));
        // One document over every sequence: nothing can be held out apart.
        assert_eq!(held_out(&[vec![7; 16]]), None);
        // A long last document: never more than two batches held out (3 sequences trained on,
        // 10 held out, before), so nothing is.
        let long_last = [vec![1; 12], vec![2; 40]];
        let held_out_by_one = PackedDocuments::pack(&long_last, 4, 1, 0, true).unwrap();
        assert!(held_out_by_one.eval.is_none() && held_out_by_one.train.len() == 13, "{} sequences trained on", held_out_by_one.train.len());
        // Without hold_out (--eval-every 0, --eval-data): every sequence is trained on.
        assert!(PackedDocuments::pack(&documents, 4, 2, 0, false).unwrap().eval.is_none());
    }

    #[test]
    fn cut_documents_and_the_targets_past_their_first_piece_are_counted() {
        let documents = [vec![1; 5], vec![2; 9], vec![3; 4], vec![4; 13]];
        let targets = [vec![true; 5], [vec![false; 6], vec![true; 3]].concat(), vec![true; 4], [vec![false; 2], vec![true; 11]].concat()];
        // Pieces of 4: the 5, 9 and 13 are cut; past the first 4 tokens, 1 + 3 + 9 targets.
        assert_eq!(CutDocuments::of(&documents, Some(&targets), 4), CutDocuments { documents: 3, later_targets: 13 });
        assert_eq!(CutDocuments::of(&documents, None, 9), CutDocuments { documents: 1, later_targets: 0 });
        assert_eq!(CutDocuments::of(&documents, Some(&targets), 13), CutDocuments { documents: 0, later_targets: 0 });
        let note = cut_documents_note(&documents, Some(&targets), 4, "--eval-data", true).expect("three cut");
        assert!(note.starts_with("3 --eval-data document(s) longer than --seq-len 4") && note.contains("13 of their target tokens") && note.contains("evaluated without"), "{note}");
        assert_eq!(cut_documents_note(&documents, None, 13, "--data", false), None);
    }

    /// The tokenizer's eos_token ends documents, as in TRL, over config.json's first id; the
    /// flag over both; config.json's where the tokenizer names none.
    #[test]
    fn documents_end_in_the_flag_else_the_tokenizers_eos_else_the_configs() {
        let folder = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../ulysses-models/tests/fixtures/chat/llama3"));
        let (tokenizer, config) = (TextTokenizer::from_file(folder).unwrap(), TokenizerConfig::read(folder).unwrap());
        let eot = tokenizer.token_id("<|eot_id|>").expect("the fixture's end of turn");
        // Llama 3's <|end_of_text|>, which its instruct models' config.json lists first (the
        // fixture's vocabulary calls it <|endoftext|>).
        let end_of_text = u64::from(tokenizer.token_id("<|endoftext|>").expect("the fixture's end of text"));
        let (id, note) = document_eos(None, Some((&tokenizer, &config)), Some(end_of_text)).unwrap();
        assert_eq!(id, eot, "Llama 3 instruct's tokenizer ends in <|eot_id|>, config.json lists <|end_of_text|> first");
        assert!(note.is_some_and(|n| n.contains("\"<|eot_id|>\"") && n.contains(&format!("first eos_token_id {end_of_text}"))));
        assert_eq!(document_eos(None, Some((&tokenizer, &config)), Some(u64::from(eot))).unwrap(), (eot, None), "no note where they agree");
        assert_eq!(document_eos(Some(7), Some((&tokenizer, &config)), Some(end_of_text)).unwrap(), (7, None));
        let mut unnamed = TokenizerConfig::read(folder).unwrap();
        unnamed.special_tokens.clear();
        assert_eq!(document_eos(None, Some((&tokenizer, &unnamed)), Some(end_of_text)).unwrap(), (end_of_text as u32, None));
        assert_eq!(document_eos(None, None, Some(end_of_text)).unwrap(), (end_of_text as u32, None));
        let mut unknown = TokenizerConfig::read(folder).unwrap();
        unknown.special_tokens.insert("eos_token".into(), "<|not_a_token|>".into());
        let error = document_eos(None, Some((&tokenizer, &unknown)), Some(end_of_text)).unwrap_err();
        assert!(error.contains("tokenizer_config.json") && error.contains("<|not_a_token|>") && error.contains("--eos-token-id"), "{error}");
        let error = document_eos(None, None, None).unwrap_err();
        assert!(error.contains("--eos-token-id"), "{error}");
        // A Qwen2 checkpoint whose tokenizer_config.json names no EOS: Qwen2Tokenizer's
        // <|endoftext|>, transformers' `tokenizer.eos_token`, before config.json's.
        let qwen = std::env::temp_dir().join(format!("ulysses-class-eos-{}", std::process::id()));
        fs::create_dir_all(&qwen).unwrap();
        fs::copy(folder.join("../../tokenizer-bos/tokenizer.json"), qwen.join("tokenizer.json")).unwrap();
        fs::write(qwen.join("tokenizer_config.json"), "{}").unwrap();
        fs::write(qwen.join("config.json"), r#"{"model_type": "qwen2"}"#).unwrap();
        let (tokenizer, config) = (TextTokenizer::from_file(&qwen).unwrap(), TokenizerConfig::read(&qwen).unwrap());
        // special_tokens_map.json's EOS (read under a config without added_tokens_decoder)
        // replaces the class's default, as it does in transformers; a word of the text named
        // so becomes a special token: another reading of the same file.
        fs::write(qwen.join("special_tokens_map.json"), r#"{"eos_token": "parallelism"}"#).unwrap();
        let mapped = TextTokenizer::from_file(&qwen).unwrap();
        fs::remove_dir_all(&qwen).unwrap();
        let end_of_text = tokenizer.token_id("<|endoftext|>").unwrap();
        let (id, note) = document_eos(None, Some((&tokenizer, &config)), Some(300)).unwrap();
        assert_eq!(id, end_of_text);
        assert!(note.is_some_and(|n| n.contains("Qwen2Tokenizer's default")));
        assert_eq!((tokenizer.class_eos_token(), mapped.class_eos_token()), (Some("<|endoftext|>"), None));
        assert!(tokenizer.reading().starts_with("Qwen2Tokenizer") && !tokenizer.reading().contains("parallelism"), "{}", tokenizer.reading());
        assert!(mapped.reading().starts_with("Qwen2Tokenizer") && mapped.reading().contains("[parallelism]"), "{}", mapped.reading());
    }

    /// A text that ends in EOS written out gets no second one; every other text gets one.
    #[test]
    fn a_text_ends_in_one_eos() {
        let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/../ulysses-models/tests/fixtures/tokenizer/tokenizer.json");
        let tokenizer = TextTokenizer::from_file(Path::new(fixture)).unwrap();
        let eos = tokenizer.token_id("<|endoftext|>").expect("the fixture's EOS");
        let file = std::env::temp_dir().join(format!("ulysses-documents-eos-{}.jsonl", std::process::id()));
        fs::write(&file, "{\"text\": \"a group.\"}\n{\"text\": \"a group.<|endoftext|>\"}\n{\"text\": \"<|endoftext|>a group.\"}\n").unwrap();
        let reader = DocumentReader { tokenizer: Some(&tokenizer), eos, vocab: tokenizer.vocab_size(), progress: false, chat: None, loss_on: LossOn::All, refuse_longer_than: None, truncate_longer_than: None, noted: Default::default() };
        let documents = reader.read(&file).unwrap().ids;
        // The same lines in a .JSON file are JSON Lines too, not one text document.
        let json = file.with_extension("JSON");
        fs::copy(&file, &json).unwrap();
        assert_eq!(reader.read(&json).unwrap().ids, documents);
        fs::write(&json, "[{\"text\": \"a group.\"}]\n").unwrap();
        let error = reader.read(&json).err().expect("a JSON array of records");
        assert!(error.contains("line 1") && error.contains("not as one JSON array of records"), "{error}");
        let _ = fs::remove_file(&json);
        let _ = fs::remove_file(&file);
        let eos = i64::from(eos);
        let plain = &documents[0];
        assert_eq!(plain.iter().filter(|&&id| id == eos).count(), 1, "{plain:?}");
        assert_eq!(plain.last(), Some(&eos));
        assert_eq!(documents[1], *plain, "the written-out EOS is the one that ends it");
        assert_eq!(documents[2].iter().filter(|&&id| id == eos).count(), 2, "one that starts with it still ends in one: {:?}", documents[2]);
    }

    /// The fixture's tokenizer with a post-processor that adds `<|begin_of_text|>` before each
    /// text, as Llama 3's does; and that token's id.
    fn tokenizer_adding_bos(dir: &Path) -> (TextTokenizer, u32) {
        let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/../ulysses-models/tests/fixtures/tokenizer/tokenizer.json");
        let mut json: Value = serde_json::from_str(&fs::read_to_string(fixture).unwrap()).unwrap();
        let bos = TextTokenizer::from_file(Path::new(fixture)).unwrap().vocab_size() as u32;
        json["added_tokens"].as_array_mut().unwrap().push(serde_json::json!({
            "id": bos, "content": "<|begin_of_text|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true
        }));
        json["post_processor"] = serde_json::json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [bos], "tokens": ["<|begin_of_text|>"]}}
        });
        let file = dir.join("tokenizer.json");
        fs::write(&file, json.to_string()).unwrap();
        (TextTokenizer::from_file(&file).unwrap(), bos)
    }

    /// With a tokenizer that adds a BOS: each text gets one, also a text that begins with it
    /// (a chat rendered to text), and an empty text is left out. A prompt that ends in a
    /// space keeps its completion's first token a target (its space joins that token), and a
    /// completion that ends in EOS gets no second one.
    #[test]
    fn texts_get_one_bos_and_completions_keep_their_first_token_and_one_eos() {
        let dir = std::env::temp_dir().join(format!("ulysses-documents-bos-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let (tokenizer, bos) = tokenizer_adding_bos(&dir);
        let eos = tokenizer.token_id("<|endoftext|>").expect("the fixture's EOS");
        let file = dir.join("data.jsonl");
        let lines = [
            r#"{"text": "a group."}"#,
            r#"{"text": "<|begin_of_text|>a group."}"#,
            r#"{"text": ""}"#,
            r#"{"prompt": "a sip of ", "completion": "the sea"}"#,
            r#"{"prompt": "Q:", "completion": " A<|endoftext|>"}"#,
        ];
        fs::write(&file, lines.join("\n")).unwrap();
        let reader = DocumentReader { tokenizer: Some(&tokenizer), eos, vocab: tokenizer.vocab_size(), progress: false, chat: None, loss_on: LossOn::All, refuse_longer_than: None, truncate_longer_than: None, noted: Default::default() };
        let documents = reader.read(&file).unwrap();
        fs::remove_dir_all(&dir).unwrap();
        let (bos, eos) = (i64::from(bos), i64::from(eos));
        assert_eq!(documents.ids.len(), 4, "the empty text left out: {:?}", documents.ids);
        let plain = &documents.ids[0];
        assert_eq!((plain[0], plain.iter().filter(|&&id| id == bos).count()), (bos, 1), "{plain:?}");
        assert_eq!(documents.ids[1], *plain, "a text that begins with the BOS gets it once");
        let targets = documents.targets.unwrap();
        let (merged, merged_targets) = (&documents.ids[2], &targets[2]);
        assert_eq!(reader.noted.merged_prompts.get(), 1, "the first prompt's space joins the completion's first token");
        // The targets start at " the", which holds the prompt's last space and the
        // completion's first word; every token before it is the prompt's.
        let the = i64::from(tokenizer.token_id("Ġthe").expect("the fixture's vocabulary has \" the\""));
        let first = merged_targets.iter().position(|&t| t).unwrap();
        assert_eq!(merged[first], the, "{merged:?} {merged_targets:?}");
        assert!(merged_targets[first..].iter().all(|&t| t), "{merged_targets:?}");
        let (ended, ended_targets) = (&documents.ids[3], &targets[3]);
        assert_eq!(ended.iter().filter(|&&id| id == eos).count(), 1, "a completion ending in EOS gets no second: {ended:?}");
        assert_eq!(ended_targets.iter().filter(|&&t| t).count(), ended.len() - 3, "BOS, Q and : are the prompt: {ended:?} {ended_targets:?}");
    }

    /// A folder is read for its data files alone: hidden files and a dataset's README are
    /// not documents; a held-out split beside other files is refused, as are text files beside
    /// JSON Lines, a Git LFS pointer, and a single file of JSON Lines or CSV under a name read
    /// as text; an attention mask with padding is refused.
    #[test]
    fn a_folder_reads_its_data_files_alone() {
        let dir = std::env::temp_dir().join(format!("ulysses-documents-folder-{}", std::process::id()));
        fs::create_dir_all(dir.join(".cache")).unwrap();
        fs::write(dir.join("train.jsonl"), "[5, 6]\n").unwrap();
        fs::write(dir.join("README.md"), "# A dataset card").unwrap();
        fs::write(dir.join(".gitattributes"), "*.jsonl filter=lfs").unwrap();
        fs::write(dir.join(".cache/train.jsonl.metadata"), "abc").unwrap();
        let reader = DocumentReader { tokenizer: None, eos: 0, vocab: 16, progress: false, chat: None, loss_on: LossOn::All, refuse_longer_than: None, truncate_longer_than: None, noted: Default::default() };
        assert_eq!(reader.read(&dir).unwrap().ids, vec![vec![5, 6]]);
        // A file named for training is one, whatever else its name holds.
        fs::write(dir.join("unit_test_train.jsonl"), "[7, 8]\n").unwrap();
        assert_eq!(reader.read(&dir).unwrap().ids.len(), 2);
        fs::write(dir.join("test.jsonl"), "[7, 8]\n").unwrap();
        let error = reader.read(&dir).err().expect("a test split beside the training one");
        assert!(error.contains("holds held-out splits") && error.contains("test.jsonl"), "{error}");
        fs::remove_file(dir.join("test.jsonl")).unwrap();
        // Without a file named for training too (`data.jsonl` beside `data_test.jsonl`).
        fs::write(dir.join("data_test.jsonl"), "[7, 8]\n").unwrap();
        let error = reader.read(&dir).err().expect("a test split beside a file not named for training");
        assert!(error.contains("holds held-out splits") && error.contains("data_test.jsonl"), "{error}");
        fs::remove_file(dir.join("data_test.jsonl")).unwrap();
        // A licence as text beside the JSON Lines: it would be trained on as a document.
        fs::write(dir.join("LICENSE.txt"), "Permission is hereby granted").unwrap();
        let error = reader.read(&dir).err().expect("text beside JSON Lines");
        assert!(error.contains("beside text files") && error.contains("LICENSE.txt"), "{error}");
        fs::remove_file(dir.join("LICENSE.txt")).unwrap();
        // A clone without git-lfs: pointers in place of the data, refused as such.
        let pointer = "version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 1234\n";
        fs::write(dir.join("zz.jsonl"), pointer).unwrap();
        let error = reader.read(&dir).err().expect("an LFS pointer");
        assert!(error.contains("zz.jsonl is a Git LFS pointer") && error.contains("git lfs pull"), "{error}");
        fs::remove_file(dir.join("zz.jsonl")).unwrap();
        // A single file: JSON Lines under another name, CSV, a pointer as text; a text file
        // and a file with no extension are text.
        for (name, text, needle) in [
            ("lines.ndjson", "{\"text\": \"a group.\"}\n", "rename it to .jsonl"),
            ("table.csv", "text\na group.\n", "this format is not read"),
            ("corpus.txt", pointer, "is a Git LFS pointer"),
        ] {
            let file = std::env::temp_dir().join(format!("ulysses-documents-{}-{name}", std::process::id()));
            fs::write(&file, text).unwrap();
            let error = reader.read(&file).err().unwrap_or_else(|| panic!("{name} read"));
            assert!(error.contains(needle), "{name}: {error}");
            fs::remove_file(&file).unwrap();
        }
        // Splits as folders, as Hugging Face lays them out.
        fs::create_dir_all(dir.join("validation")).unwrap();
        fs::write(dir.join("validation/part-0.jsonl"), "[7, 8]\n").unwrap();
        let error = reader.read(&dir).err().expect("a validation folder beside the training file");
        assert!(error.contains("validation/part-0.jsonl"), "{error}");
        fs::remove_dir_all(&dir).unwrap();
        let error = parse_line(r#"{"input_ids": [1, 2, 0], "attention_mask": [1, 1, 0]}"#).err().expect("padding masked out");
        assert!(error.contains("masks 1 of its 3 tokens out"), "{error}");
        assert!(matches!(parse_line(r#"{"input_ids": [1, 2], "attention_mask": [1, 1]}"#), Ok(Pending::Ids(ids)) if ids == [1, 2]));
    }

    #[test]
    fn each_sequence_keeps_its_documents_even_with_eos_inside_one() {
        // EOS is 0; the second document holds a 0 inside (an end of turn), and stays whole.
        let documents = vec![vec![5, 6, 0], vec![7, 0, 8, 9, 0], vec![1, 2, 3, 4, 5, 6, 7, 0], vec![9, 0]];
        let data = PackedDocuments::pack(&documents, 8, 1, 3, false).unwrap();
        let (sequences, lengths) = data.everything();
        assert_eq!(sequences, vec![vec![5, 6, 0, 7, 0, 8, 9, 0], vec![1, 2, 3, 4, 5, 6, 7, 0], vec![9, 0]]);
        assert_eq!(lengths, vec![vec![3, 5], vec![8], vec![2]]);
        for step in 0..3 {
            let batch = data.train_batch(step);
            let expected: Vec<Vec<usize>> = batch.iter().map(|s| lengths[sequences.iter().position(|t| t == s).unwrap()].clone()).collect();
            assert_eq!(data.train_documents(step, &batch), expected, "step {step}");
        }
        // Byte paragraphs are cut after each blank line.
        assert_eq!(crate::train::paragraph_lengths(&[97, 10, 10, 98, 10]), [3, 2]);
    }

    /// Labelled ids keep their targets, and ids are taken as given (no EOS appended); the flags
    /// follow their tokens through packing, a cut document included.
    #[test]
    fn targets_follow_their_tokens_into_the_packed_sequences() {
        let reader = DocumentReader { tokenizer: None, eos: 0, vocab: 16, progress: false, chat: None, loss_on: LossOn::Assistant, refuse_longer_than: None, truncate_longer_than: None, noted: Default::default() };
        let dir = std::env::temp_dir().join(format!("ulysses-targets-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let file = dir.join("data.jsonl");
        fs::write(&file, "{\"input_ids\": [5, 6, 7, 0], \"labels\": [-100, 6, 7, 0]}\n[8, 9, 0]\n{\"input_ids\": [1, 2, 3, 4, 0], \"labels\": [-100, -100, 3, -100, -100]}\n[10, 11]\n").unwrap();
        let documents = reader.read(&file).unwrap();
        let strict = DocumentReader { refuse_longer_than: Some(4), ..reader };
        let refused = strict.read(&file).err().unwrap_or_default();
        assert!(refused.contains("data.jsonl line 3") && refused.contains("5 tokens, more than --seq-len 4"), "{refused}");
        // --too-long truncate: the first 4 tokens and their targets, the rest dropped.
        let truncating = DocumentReader { refuse_longer_than: None, truncate_longer_than: Some(4), noted: Noted::default(), ..strict };
        let truncated = truncating.read(&file).unwrap();
        assert_eq!((&truncated.ids[2], &truncated.targets.as_ref().unwrap()[2]), (&vec![1, 2, 3, 4], &vec![false, false, true, false]));
        assert_eq!((truncated.ids.len(), truncating.noted.truncated.get()), (4, 1));
        fs::remove_dir_all(&dir).unwrap();
        // As given: no EOS appended to the last, as TRL takes ids.
        assert_eq!(documents.ids, vec![vec![5, 6, 7, 0], vec![8, 9, 0], vec![1, 2, 3, 4, 0], vec![10, 11]]);
        let targets = documents.targets.unwrap();
        assert_eq!(targets, vec![vec![false, true, true, true], vec![true; 3], vec![false, false, true, false, false], vec![true; 2]]);
        let data = PackedDocuments::pack_with_targets(&documents.ids[..3], Some(&targets[..3]), 4, 1, 3, false).unwrap();
        let packed: Vec<(Vec<i64>, Vec<bool>)> = data.train.iter().map(|p| (p.tokens.clone(), p.targets.clone().unwrap())).collect();
        assert_eq!(
            packed,
            vec![
                (vec![5, 6, 7, 0], vec![false, true, true, true]),
                (vec![8, 9, 0], vec![true; 3]),
                (vec![1, 2, 3, 4], vec![false, false, true, false]),
                (vec![0], vec![false]),
            ]
        );
    }

    #[test]
    fn each_epoch_draws_every_sequence_once_in_a_seeded_order() {
        let documents: Vec<Vec<i64>> = (1..=10).map(|d| vec![d, 0]).collect();
        let data = PackedDocuments::pack(&documents, 2, 2, 7, false).unwrap();
        let (first, second) = (data.epoch_order(0).to_vec(), data.epoch_order(1).to_vec());
        assert_eq!(*data.epoch_order(0), first, "the order kept is another");
        let mut sorted = first.clone();
        sorted.sort();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>());
        assert_ne!(first, second, "every epoch in the same order");
        assert_ne!(first, (0..10).collect::<Vec<_>>(), "not shuffled");
        // Steps draw the epochs' orders one after the other, across the epoch's end too
        // (batches of 3 over 10 sequences).
        let data = PackedDocuments::pack(&documents, 2, 3, 7, false).unwrap();
        let count = data.train.len();
        let orders: Vec<usize> = (0..3).flat_map(|e| data.epoch_order(e).to_vec()).collect();
        let drawn: Vec<&Packed> = (0..count).flat_map(|step| data.step_sequences(step).collect::<Vec<_>>()).collect();
        let expected: Vec<&Packed> = orders[..3 * count].iter().map(|&i| &data.train[i]).collect();
        assert!(drawn.iter().zip(&expected).all(|(a, b)| std::ptr::eq(*a, *b)), "steps do not follow the epochs' orders");
    }
}
