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
    /// Reads `path` and holds out its last `batch_size` sequences for evaluation when it has at
    /// least two batches. Every sequence must be non-empty, at most `seq_len` tokens, with ids
    /// in `0..vocab`.
    pub fn load(path: &Path, batch_size: usize, seq_len: usize, vocab: usize) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read the token file {}: {e}", path.display()))?;
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
        let eval = (sequences.len() >= 2 * batch_size).then(|| sequences.split_off(sequences.len() - batch_size));
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
