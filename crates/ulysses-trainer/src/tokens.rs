//! Pre-tokenized training data: a JSON Lines file with one sequence of token ids per line,
//! e.g. `[72, 101, 108, 108, 111]`. Sequences may have any length up to `--seq-len`; each
//! batch is padded (padding positions carry no label). Steps draw them in the file's order,
//! whatever the seed (the tests' files give each step's batch a shape on purpose).

use std::path::Path;

use crate::train::StepData;

pub struct TokenFile {
    train: Vec<Vec<i64>>,
    eval: Option<Vec<Vec<i64>>>,
    batch_size: usize,
}

impl TokenFile {
    /// Reads `path` and, with `hold_out`, holds out its last `batch_size` sequences for
    /// evaluation when it has at least two batches. Every sequence must be non-empty, at most
    /// `seq_len` tokens, with ids in `0..vocab`.
    pub fn load(path: &Path, batch_size: usize, seq_len: usize, vocab: usize, hold_out: bool) -> Result<Self, String> {
        crate::files::refuse_lfs_pointers("--tokens", &[path.to_path_buf()])?;
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read the token file {}: {e}", path.display()))?;
        // A byte-order mark (a file saved as "UTF-8 with BOM") is no part of the first line.
        let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
        let mut sequences = Vec::new();
        for (index, line) in text.lines().enumerate().filter(|(_, line)| !line.trim().is_empty()) {
            let at = || format!("{} line {}", path.display(), index + 1);
            let sequence: Vec<i64> =
                serde_json::from_str(line).map_err(|e| format!("{}: not a JSON array of token ids ({e})", at()))?;
            if sequence.is_empty() || sequence.len() > seq_len {
                return Err(format!("{}: {} tokens; every sequence needs 1 to --seq-len {seq_len} tokens", at(), sequence.len()));
            }
            if let Some(token) = sequence.iter().find(|&&t| !(0..vocab as i64).contains(&t)) {
                return Err(format!("{}: token {token} is outside the vocabulary 0..{vocab}", at()));
            }
            sequences.push(sequence);
        }
        if sequences.len() < batch_size {
            return Err(format!(
                "{} has {} sequences, fewer than one batch (--batch-size {batch_size})",
                path.display(),
                sequences.len()
            ));
        }
        let eval = (hold_out && sequences.len() >= 2 * batch_size).then(|| sequences.split_off(sequences.len() - batch_size));
        if sequences.iter().all(|sequence| sequence.len() < 2) {
            return Err(format!(
                "{}: every training sequence holds one token, so no position has a label (the next token) to learn: \
                 the loss would be 0 and nothing would train. Give sequences of at least 2 tokens",
                path.display()
            ));
        }
        Ok(Self { train: sequences, eval, batch_size })
    }
}

impl StepData for TokenFile {
    /// The file's training sequences in order, `batch_size` per step, wrapping around.
    fn train_batch(&self, step: usize) -> Vec<Vec<i64>> {
        (0..self.batch_size).map(|i| self.train[(step * self.batch_size + i) % self.train.len()].clone()).collect()
    }

    fn eval_batch(&self) -> Option<Vec<Vec<i64>>> {
        self.eval.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::TokenFile;
    use crate::train::StepData;

    fn token_file(name: &str, text: &str) -> std::path::PathBuf {
        let path = std::env::temp_dir().join(format!("ulysses-tokens-{name}-{}.jsonl", std::process::id()));
        std::fs::write(&path, text).unwrap();
        path
    }

    /// The last batch is held out only where it is asked for (`--eval-every` above 0); a
    /// byte-order mark is no part of the first line; a Git LFS pointer is named as one.
    #[test]
    fn the_last_batch_is_held_out_where_evaluated_a_bom_is_skipped_and_a_pointer_named() {
        let path = token_file("held-out", "\u{feff}[1, 2, 3]\n[4, 5]\n[6, 7, 8]\n[9, 10]\n");
        let held_out = TokenFile::load(&path, 2, 4, 16, true).expect("read");
        assert_eq!((held_out.train.len(), held_out.eval_batch()), (2, Some(vec![vec![6, 7, 8], vec![9, 10]])));
        assert_eq!(held_out.train[0], [1, 2, 3], "the first line read past its byte-order mark");
        let whole = TokenFile::load(&path, 2, 4, 16, false).expect("read");
        assert_eq!((whole.train.len(), whole.eval_batch()), (4, None));
        let pointer = token_file("pointer", "version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 1234\n");
        let error = TokenFile::load(&pointer, 1, 4, 16, true).err().expect("a pointer refused");
        assert!(error.contains("--tokens") && error.contains("is a Git LFS pointer") && error.contains("git lfs pull"), "{error}");
        for file in [path, pointer] {
            std::fs::remove_file(file).unwrap();
        }
    }
}
