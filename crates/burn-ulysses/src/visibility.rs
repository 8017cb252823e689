//! Which keys a query may see besides causality, described without an `S × S` matrix:
//! documents packed back to back into one sequence (attention never crosses a document's
//! edge) and key padding (a run of real keys per sequence).
//!
//! Documents come from position ids, the Hugging Face / ALST convention for packed
//! sequences: a document starts wherever a position does not continue the one before it
//! (positions restart at 0 at each document). Under sequence parallelism each rank holds the
//! ids of its shard; the attention gathers them, so every rank knows the boundaries of the
//! whole sequence wherever they fall, shard edges included.

use std::ops::Range;

use burn::tensor::{Bool, Tensor, TensorData, backend::Backend};

use crate::error::UlyssesError;
// Host position ids are Burn-free (ulysses-core), shared with the burn 0.22 crate.
pub use ulysses_core::data::PositionIds;


/// Which keys each query row sees besides causality, per sequence of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Visibility {
    batch: usize,
    seq_q: usize,
    seq_kv: usize,
    /// Per sequence, the lengths of its documents (self-attention only).
    documents: Option<Vec<Vec<usize>>>,
    /// Per sequence, its keys that are not padding.
    key_runs: Option<Vec<Range<usize>>>,
    /// A sliding window: a row sees none of the keys more than `window - 1` before it.
    window: Option<usize>,
}

impl Visibility {
    /// Every row sees every key.
    pub fn all(batch: usize, seq_q: usize, seq_kv: usize) -> Self {
        Self { batch, seq_q, seq_kv, documents: None, key_runs: None, window: None }
    }

    /// Documents of `positions` (the whole sequences, self-attention).
    pub fn documents(positions: &PositionIds) -> Self {
        let (batch, seq) = (positions.batch(), positions.len());
        Self { documents: Some(positions.document_lengths()), ..Self::all(batch, seq, seq) }
    }

    /// Keys of sequence `b` outside `runs[b]` are padding: no row sees them.
    pub fn with_key_runs(mut self, runs: Vec<Range<usize>>) -> Result<Self, UlyssesError> {
        if runs.len() != self.batch || runs.iter().any(|run| run.start > run.end || run.end > self.seq_kv) {
            return Err(UlyssesError::Shape(format!("key runs {runs:?} for {} sequences of {} keys", self.batch, self.seq_kv)));
        }
        self.key_runs = Some(runs);
        Ok(self)
    }

    /// A sliding window of `window` keys (Mistral's `sliding_window`): row `r` sees only keys
    /// `r + 1 - window ..= r` of what it sees otherwise (self-attention).
    pub fn with_window(mut self, window: usize) -> Result<Self, UlyssesError> {
        if self.seq_q != self.seq_kv || window == 0 {
            return Err(UlyssesError::Shape(format!(
                "a sliding window needs self-attention (as many queries as keys) and at least one key; got {} queries, {} keys and a window of {window}",
                self.seq_q, self.seq_kv
            )));
        }
        self.window = Some(window);
        Ok(self)
    }

    pub fn window(&self) -> Option<usize> {
        self.window
    }

    /// `(batch, seq_q, seq_kv)`.
    pub fn dims(&self) -> (usize, usize, usize) {
        (self.batch, self.seq_q, self.seq_kv)
    }

    pub fn document_lengths(&self) -> Option<&[Vec<usize>]> {
        self.documents.as_deref()
    }

    pub fn key_runs(&self) -> Option<&[Range<usize>]> {
        self.key_runs.as_deref()
    }

    /// Whether query row `row` of sequence `b` sees key `key` (causality aside).
    pub fn sees(&self, b: usize, row: usize, key: usize) -> bool {
        let in_run = self.key_runs.as_ref().is_none_or(|runs| runs[b].contains(&key));
        // Saturating: a window of `usize::MAX` ("no limit") is no window.
        let in_window = self.window.is_none_or(|window| key.saturating_add(window) > row);
        in_run && in_window && self.documents.as_ref().is_none_or(|documents| document_of(&documents[b], row) == document_of(&documents[b], key))
    }

    /// `[batch, 1, seq_q, seq_kv]`, `true` where a row must not see a key (burn's mask
    /// convention): for backends without the flash kernels, which build the `S × S` scores
    /// anyway.
    pub fn dense_mask<B: Backend>(&self, device: &B::Device) -> Tensor<B, 4, Bool> {
        let mut mask = Vec::with_capacity(self.batch * self.seq_q * self.seq_kv);
        for b in 0..self.batch {
            for row in 0..self.seq_q {
                mask.extend((0..self.seq_kv).map(|key| !self.sees(b, row, key)));
            }
        }
        Tensor::from_data(TensorData::new(mask, [self.batch, 1, self.seq_q, self.seq_kv]), device)
    }
}

/// Index of the document holding `position`.
fn document_of(lengths: &[usize], position: usize) -> usize {
    let mut end = 0;
    for (index, length) in lengths.iter().enumerate() {
        end += length;
        if position < end {
            return index;
        }
    }
    lengths.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_start_where_positions_restart() {
        let positions = PositionIds::new(vec![0, 1, 2, 0, 1, 0, /**/ 5, 6, 7, 8, 9, 10], 2, 6).unwrap();
        assert_eq!(positions.document_lengths(), vec![vec![3, 2, 1], vec![6]]);
        let visibility = Visibility::documents(&positions);
        assert!(visibility.sees(0, 2, 0) && !visibility.sees(0, 3, 2) && !visibility.sees(0, 5, 4) && visibility.sees(1, 0, 5));
    }

    #[test]
    fn shards_concatenate_and_a_boundary_on_a_shard_edge_is_kept() {
        let first = PositionIds::new(vec![0, 1, 2, 3], 1, 4).unwrap();
        let second = PositionIds::new(vec![0, 1, 0, 1], 1, 4).unwrap();
        let whole = PositionIds::concat(&[first, second]).unwrap();
        assert_eq!(whole.document_lengths(), vec![vec![4, 2, 2]]);
        assert_eq!(PositionIds::consecutive(2, 3, 2).ids(), &[3, 4, 3, 4]);
    }

    #[test]
    fn a_window_hides_keys_more_than_its_width_before_the_row() {
        let positions = PositionIds::new(vec![0, 1, 2, 3, 4, 0, 1], 1, 7).unwrap();
        let visibility = Visibility::documents(&positions).with_window(2).unwrap();
        assert!(visibility.sees(0, 4, 3) && !visibility.sees(0, 4, 2) && visibility.sees(0, 6, 5) && !visibility.sees(0, 5, 4));
        assert!(Visibility::all(1, 3, 4).with_window(2).is_err());
        // A window wider than the sequence, to `usize::MAX`, hides nothing.
        for window in [4, usize::MAX - 2, usize::MAX] {
            let visibility = Visibility::all(1, 4, 4).with_window(window).unwrap();
            assert!((0..4).all(|row| (0..4).all(|key| visibility.sees(0, row, key))), "window {window}");
        }
    }

    #[test]
    fn key_runs_hide_padding() {
        let visibility = Visibility::all(1, 3, 5).with_key_runs(vec![1..4]).unwrap();
        assert!(!visibility.sees(0, 0, 0) && visibility.sees(0, 2, 3) && !visibility.sees(0, 1, 4));
        assert!(Visibility::all(1, 3, 5).with_key_runs(vec![1..6]).is_err());
    }
}
