//! What a run trained on, recorded in its checkpoint so that `--resume` can refuse other
//! data: the path, the size in bytes and an FNV-1a digest of the first and last 64 KiB of each
//! file (a folder: of each file in name order, with its name and size). Cheap on any size; a
//! change confined to the middle of a large file goes unseen here, and is refused where it
//! changes the batch a resume draws first (`RunState::next_batch_digest`).

use std::{
    fs::File,
    io::{Read, Seek, SeekFrom},
    path::Path,
};

use serde::{Deserialize, Serialize};

/// Bytes read at each end of a file.
const BLOCK: u64 = 64 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataIdentity {
    pub path: String,
    pub bytes: u64,
    pub digest: String,
    /// How the data becomes tokens and targets (the tokenizer, EOS, `--loss-on`,
    /// `--too-long`; for `--tokens` and `--corpus`, whether a part is held out): the same bytes
    /// read otherwise are other batches. Empty in checkpoints written before it was recorded
    /// (whose runs held the part out).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reading: String,
    /// The chat template `{"messages"}` lines were rendered with (its file and a digest of
    /// what decides the rendering): another template is other tokens and targets. Empty in
    /// checkpoints written before it was recorded, and where no conversation was rendered.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub chat_template: String,
    /// The `--eval-data` the run's held-out losses are of (its path, bytes and digest): other
    /// held-out data would make the losses after a resume another curve. Empty without
    /// `--eval-data`, and in checkpoints written before it was recorded.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub held_out: String,
}

impl DataIdentity {
    /// The identity of the file or folder at `path`.
    pub fn of(path: &Path) -> Result<Self, String> {
        let files = crate::files::files_under(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        Self::of_files(path, &files)
    }

    /// The identity of --data at `path`: the files read ([`data_files`](crate::files::data_files)),
    /// so that a dataset card edited beside them changes nothing.
    pub fn of_data(path: &Path) -> Result<Self, String> {
        Self::of_files(path, &crate::files::data_files("--data", path)?.0)
    }

    /// This identity with the held-out data at `path` (`--eval-data`), which a resume must
    /// evaluate on too.
    pub fn evaluated_on(self, path: &Path) -> Result<Self, String> {
        let held_out = Self::of_files(path, &crate::files::data_files("--eval-data", path)?.0)?;
        Ok(Self { held_out: format!("{} ({} bytes, digest {})", held_out.path, held_out.bytes, held_out.digest), ..self })
    }

    pub(crate) fn of_files(path: &Path, files: &[std::path::PathBuf]) -> Result<Self, String> {
        let mut digest = Fnv::new();
        let mut bytes = 0;
        for file in files {
            let (size, ends) = ends_of(file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
            digest.write(file.strip_prefix(path).unwrap_or(file).to_string_lossy().as_bytes());
            digest.write(&size.to_le_bytes());
            digest.write(&ends);
            bytes += size;
        }
        Ok(Self { path: path.display().to_string(), bytes, digest: format!("{:016x}", digest.0), reading: String::new(), chat_template: String::new(), held_out: String::new() })
    }

    /// This identity with how the data is read (`reading`: the settings that turn its bytes
    /// into tokens and targets), which a resume must match too.
    pub fn read_with(self, reading: String) -> Self {
        Self { reading, ..self }
    }

    /// How the tokenizer `file` reads text, for [`read_with`](Self::read_with): by the file's
    /// bytes (not its path) and `reading` (`TextTokenizer::reading`: its class, options and
    /// added special tokens, which tokenizer_config.json and config.json decide).
    pub fn tokenizer(file: &Path, reading: &str) -> Result<String, String> {
        let identity = Self::of(file)?;
        Ok(format!("a tokenizer of {} bytes (digest {}){TOKENIZER_READING}{reading}", identity.bytes, identity.digest))
    }

    /// This identity with the chat template of `file` whose rendering `text` decides
    /// (`ulysses_models::ChatTemplate::rendering_text`), recorded by the file's name (not its
    /// folder: a checkpoint moved is the same) and a digest.
    pub fn rendered_with(self, file: &str, text: &str) -> Self {
        let mut digest = Fnv::new();
        digest.write(text.as_bytes());
        let name = Path::new(file).file_name().map_or_else(|| file.to_string(), |name| name.to_string_lossy().into_owned());
        Self { chat_template: format!("{name} (digest {:016x})", digest.0), ..self }
    }

    /// Why `self` (now) is not the data `saved` recorded, or `None` when it is.
    pub fn differs_from(&self, saved: &DataIdentity) -> Option<String> {
        // A checkpoint that recorded no reading came from a trainer that held the data's last
        // part out at --eval-every 0 too (--corpus its last 10%, --tokens its last batch).
        if saved.reading.is_empty() && self.reading.contains(TRAINED_WHOLE) {
            return Some(format!(
                "the checkpoint's run held the last part of {} out of training, as this trainer's earlier versions did with --eval-every 0; \
                 this one trains on it too, so the batches from here on would differ: pass --allow-new-data to continue on the whole data",
                saved.path
            ));
        }
        // A checkpoint written before the tokenizer's reading (its class, options and added
        // special tokens; `TextTokenizer::reading`) was recorded is compared without it.
        let reading = match (saved.reading.contains(TOKENIZER_READING), self.reading.split_once(TOKENIZER_READING)) {
            (false, Some((tokenizer, rest))) => format!("{tokenizer}{}", rest.find(", EOS ").map_or("", |at| &rest[at..])),
            _ => self.reading.clone(),
        };
        if !saved.reading.is_empty() && reading != saved.reading {
            // Only the reader's version: this trainer reads the same settings otherwise.
            let without_reader = |reading: &str| reading.split(", ").filter(|part| !part.starts_with("reader ")).collect::<Vec<_>>().join(", ");
            if without_reader(&saved.reading) == without_reader(&reading) {
                return Some(format!(
                    "the checkpoint's run read its data with an earlier version of this trainer's reader ({}), which makes other batches of \
                     the same bytes in some data (a document cut across the held-out batch's edge; a chat line's tools; a tokenized line's \
                     answer masks; a template's special tokens); pass --allow-new-data to \
                     continue with this one",
                    saved.reading.split(", ").find(|part| part.starts_with("reader ")).unwrap_or("no version")
                ));
            }
            return Some(format!(
                "the checkpoint's run read its data with {}, this one would read it with {}; resuming would continue on other \
                 batches. Resume with the same settings, or pass --allow-new-data to continue with these",
                saved.reading, reading
            ));
        }
        // After the reading: a template given other special tokens by another reader is told by
        // the reader's version. By the digest alone: the same template moved from
        // tokenizer_config.json to chat_template.jinja (transformers' save_pretrained does) is
        // the same.
        let digest = |template: &str| template.rsplit_once("(digest ").map_or(template.to_string(), |(_, digest)| digest.to_string());
        if !saved.chat_template.is_empty() && digest(&self.chat_template) != digest(&saved.chat_template) {
            let now = if self.chat_template.is_empty() { "none".to_string() } else { self.chat_template.clone() };
            return Some(format!(
                "the checkpoint's run rendered chat data with the template of {}, this one would render it with {now}; resuming \
                 would continue on other tokens. Resume with that template, or pass --allow-new-data to continue with this one",
                saved.chat_template
            ));
        }
        // By bytes and digest, not path (a dataset moved is the same); a run that gained or
        // lost --eval-data reads --data otherwise, which `reading` tells.
        let contents = |held_out: &str| held_out.rsplit_once(" (").map_or(held_out.to_string(), |(_, contents)| contents.to_string());
        if !saved.held_out.is_empty() && !self.held_out.is_empty() && contents(&saved.held_out) != contents(&self.held_out) {
            return Some(format!(
                "the checkpoint's run evaluated on --eval-data {}, this one would evaluate on {}; the held-out losses after the resume \
                 would be another curve. Resume with that --eval-data, or pass --allow-new-data to evaluate on this",
                saved.held_out, self.held_out
            ));
        }
        (self.bytes != saved.bytes || self.digest != saved.digest).then(|| {
            format!(
                "the checkpoint's run trained on {} ({} bytes, digest {}), this one would train on {} ({} bytes, digest {}); \
                 resuming would continue on other data. Resume with that data, or pass --allow-new-data to continue on this",
                saved.path, saved.bytes, saved.digest, self.path, self.bytes, self.digest
            )
        })
    }
}

/// How a reading records its tokenizer's class after its bytes ([`DataIdentity::tokenizer`]).
const TOKENIZER_READING: &str = ", read as ";

/// What a reading says of data trained on whole at `--eval-every 0` (nothing held out).
pub const TRAINED_WHOLE: &str = "trained whole (--eval-every 0)";

/// A file's size and its first and last [`BLOCK`] bytes (the whole file when shorter).
fn ends_of(path: &Path) -> std::io::Result<(u64, Vec<u8>)> {
    let mut file = File::open(path)?;
    let size = file.metadata()?.len();
    let mut ends = Vec::new();
    (&mut file).take(BLOCK).read_to_end(&mut ends)?;
    if size > BLOCK {
        file.seek(SeekFrom::Start(size.saturating_sub(BLOCK).max(BLOCK)))?;
        file.take(BLOCK).read_to_end(&mut ends)?;
    }
    Ok((size, ends))
}

/// FNV-1a, 64 bits: stable across Rust versions, unlike std's hasher.
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0 ^ byte as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_file_or_an_edited_one_differs_and_the_same_does_not() {
        let dir = std::env::temp_dir().join(format!("ulysses-data-identity-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (dir.join("a.jsonl"), dir.join("b.jsonl"));
        std::fs::write(&a, "[1, 2, 3]\n").unwrap();
        std::fs::write(&b, "[1, 2, 4]\n").unwrap();
        let saved = DataIdentity::of(&a).unwrap();
        assert_eq!(DataIdentity::of(&a).unwrap().differs_from(&saved), None);
        let message = DataIdentity::of(&b).unwrap().differs_from(&saved).expect("same size, other bytes");
        assert!(message.contains("a.jsonl") && message.contains("b.jsonl") && message.contains("--allow-new-data"), "{message}");
        std::fs::write(&a, "[1, 2, 3]\n[4]\n").unwrap();
        assert!(DataIdentity::of(&a).unwrap().differs_from(&saved).is_some(), "an appended line");
        // A folder: its files in name order.
        assert_eq!(DataIdentity::of(&dir).unwrap(), DataIdentity::of(&dir).unwrap());
        // The same bytes read otherwise are other data; a checkpoint that recorded no reading
        // (written before it was) is compared by its bytes alone.
        let read = |how: &str| DataIdentity::of(&b).unwrap().read_with(how.into());
        assert_eq!(read("--loss-on all").differs_from(&read("--loss-on all")), None);
        let message = read("--loss-on all").differs_from(&read("--loss-on assistant")).expect("another --loss-on");
        assert!(message.contains("--loss-on assistant") && message.contains("--allow-new-data"), "{message}");
        assert_eq!(read("--loss-on all").differs_from(&DataIdentity::of(&b).unwrap()), None);
        // Except a run trained whole at --eval-every 0: those held the last part out.
        let message = read(TRAINED_WHOLE).differs_from(&DataIdentity::of(&b).unwrap()).expect("held out before");
        assert!(message.contains("held the last part of") && message.contains("--allow-new-data"), "{message}");
        assert_eq!(read(TRAINED_WHOLE).differs_from(&read(TRAINED_WHOLE)), None);
        // The tokenizer's class, options or added special tokens (an edited tokenizer_config.json)
        // are other ids; a checkpoint that recorded none is compared without them.
        let tokenizer = |class: &str| read(&format!("a tokenizer of 9 bytes (digest 1f), read as {class} with legacy null, EOS 2, reader 4"));
        assert_eq!(tokenizer("Qwen2Tokenizer").differs_from(&tokenizer("Qwen2Tokenizer")), None);
        let message = tokenizer("Qwen2Tokenizer").differs_from(&tokenizer("TokenizersBackend")).expect("another class");
        assert!(message.contains("read as TokenizersBackend") && message.contains("--allow-new-data"), "{message}");
        let unrecorded = read("a tokenizer of 9 bytes (digest 1f), EOS 2, reader 4");
        assert_eq!(tokenizer("Qwen2Tokenizer").differs_from(&unrecorded), None, "a checkpoint that recorded no class");
        assert!(tokenizer("Qwen2Tokenizer").differs_from(&read("a tokenizer of 9 bytes (digest 2e), EOS 2, reader 4")).is_some(), "another file");
        assert!(tokenizer("Qwen2Tokenizer").differs_from(&read("a tokenizer of 9 bytes (digest 1f), EOS 3, reader 4")).is_some(), "another EOS");
        // The reader's version alone: said so.
        let message = read("EOS 2, reader 3").differs_from(&read("EOS 2, reader 2")).expect("an earlier reader");
        assert!(message.contains("an earlier version of this trainer's reader (reader 2)") && message.contains("--allow-new-data"), "{message}");
        // So is another chat template (an edited system prompt); a checkpoint that recorded
        // none (written before it was) is compared without one.
        let rendered = |text: &str| DataIdentity::of(&b).unwrap().rendered_with("/models/qwen3/chat_template.jinja", text);
        let moved = DataIdentity::of(&b).unwrap().rendered_with("/elsewhere/qwen3/chat_template.jinja", "{{ messages }}");
        assert_eq!(moved.differs_from(&rendered("{{ messages }}")), None, "the same template in a folder moved");
        let in_config = DataIdentity::of(&b).unwrap().rendered_with("/models/qwen3/tokenizer_config.json", "{{ messages }}");
        assert_eq!(in_config.differs_from(&rendered("{{ messages }}")), None, "the same template in another file");
        assert_eq!(rendered("{{ messages }}").differs_from(&rendered("{{ messages }}")), None);
        let message = rendered("You are terse. {{ messages }}").differs_from(&rendered("{{ messages }}")).expect("another template");
        assert!(message.contains("chat_template.jinja (digest") && message.contains("--allow-new-data"), "{message}");
        assert!(DataIdentity::of(&b).unwrap().differs_from(&rendered("{{ messages }}")).is_some(), "the template gone");
        assert_eq!(rendered("{{ messages }}").differs_from(&DataIdentity::of(&b).unwrap()), None);
        // Other --eval-data: the held-out losses would be another curve; the same bytes
        // elsewhere, or a checkpoint that recorded none, are not.
        let evaluated = |held_out: &Path| DataIdentity::of(&b).unwrap().evaluated_on(held_out).unwrap();
        let message = evaluated(&a).differs_from(&evaluated(&b)).expect("other held-out data");
        assert!(message.contains("evaluated on --eval-data") && message.contains("a.jsonl") && message.contains("--allow-new-data"), "{message}");
        let copy = dir.join("copy.jsonl");
        std::fs::copy(&b, &copy).unwrap();
        assert_eq!(evaluated(&copy).differs_from(&evaluated(&b)), None);
        assert_eq!(evaluated(&a).differs_from(&DataIdentity::of(&b).unwrap()), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
