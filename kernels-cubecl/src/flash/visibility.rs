//! Which keys a query row may see besides causality: documents packed into one sequence
//! (block-diagonal attention) and key padding, as one contiguous run of keys per query row
//! and one contiguous run of query rows per key. Never an `S × S` mask: the kernels get
//! `2 × (S_q + S_kv)` integers per sequence, skip whole tiles outside a cube's runs and mask
//! per element only on tiles that cross a run's edge.

use std::ops::Range;

use burn_cubecl::{CubeRuntime, tensor::CubeTensor};
use burn::tensor::{DType, Shape};
use cubecl::prelude::ComputeClient;

use crate::FlashError;

/// Visible runs for every sequence of a batch, on the host. Both views (keys of a row, rows
/// of a key) are kept because the forward and dQ kernels walk a row's keys while the dK/dV
/// kernel walks a key's rows; they are built together, so they always agree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VisibleRanges {
    batch: usize,
    seq_q: usize,
    seq_kv: usize,
    /// `[batch, seq_q]` runs `start..end` of keys each query row sees.
    row_keys: Vec<Range<u32>>,
    /// `[batch, seq_kv]` runs of query rows that see each key.
    key_rows: Vec<Range<u32>>,
}

impl VisibleRanges {
    /// Every row sees every key (before causality); restrict with
    /// [`with_documents`](Self::with_documents) and [`with_key_runs`](Self::with_key_runs).
    pub fn all(batch: usize, seq_q: usize, seq_kv: usize) -> Result<Self, FlashError> {
        if seq_q > u32::MAX as usize || seq_kv > u32::MAX as usize {
            return Err(FlashError::Shape(format!("sequences of {seq_q} queries and {seq_kv} keys exceed the kernels' u32 positions")));
        }
        Ok(Self {
            batch,
            seq_q,
            seq_kv,
            row_keys: vec![0..seq_kv as u32; batch * seq_q],
            key_rows: vec![0..seq_q as u32; batch * seq_kv],
        })
    }

    /// Documents packed back to back: sequence `b` holds documents of lengths
    /// `lengths[b]`, which sum to the sequence length; a row sees only keys of its own
    /// document (self-attention: as many queries as keys).
    pub fn with_documents(mut self, lengths: &[Vec<usize>]) -> Result<Self, FlashError> {
        if self.seq_q != self.seq_kv {
            return Err(FlashError::Shape(format!(
                "documents need self-attention (as many queries as keys); got {} queries and {} keys",
                self.seq_q, self.seq_kv
            )));
        }
        if lengths.len() != self.batch {
            return Err(FlashError::Shape(format!("document lengths for {} sequences, but the batch holds {}", lengths.len(), self.batch)));
        }
        for (b, documents) in lengths.iter().enumerate() {
            let total: usize = documents.iter().sum();
            if total != self.seq_q || documents.contains(&0) {
                return Err(FlashError::Shape(format!(
                    "sequence {b}'s document lengths {documents:?} must be positive and sum to its length {}",
                    self.seq_q
                )));
            }
            let mut start = 0;
            for &length in documents {
                let document = start as u32..(start + length) as u32;
                for position in start..start + length {
                    let at = b * self.seq_q + position;
                    self.row_keys[at] = intersect(&self.row_keys[at], &document);
                    self.key_rows[at] = intersect(&self.key_rows[at], &document);
                }
                start += length;
            }
        }
        Ok(self)
    }

    /// A sliding window of `window` keys (Mistral's): row `r` sees no key before `r + 1 -
    /// window`, only the last `window` keys up to itself (self-attention: as many queries as
    /// keys). A band: each row's run and each key's rows stay one run.
    pub fn with_window(mut self, window: usize) -> Result<Self, FlashError> {
        if self.seq_q != self.seq_kv || window == 0 {
            return Err(FlashError::Shape(format!(
                "a sliding window needs self-attention (as many queries as keys) and at least one key; got {} queries, {} keys and a window of {window}",
                self.seq_q, self.seq_kv
            )));
        }
        for b in 0..self.batch {
            for position in 0..self.seq_q {
                let at = b * self.seq_q + position;
                let keys = (position + 1).saturating_sub(window) as u32..self.seq_kv as u32;
                self.row_keys[at] = intersect(&self.row_keys[at], &keys);
                // Saturating: a window of `usize::MAX` ("no limit") is no window.
                let rows = 0..position.saturating_add(window).min(self.seq_q) as u32;
                self.key_rows[at] = intersect(&self.key_rows[at], &rows);
            }
        }
        Ok(self)
    }

    /// Keys of sequence `b` outside `runs[b]` are padding: no row sees them.
    pub fn with_key_runs(mut self, runs: &[Range<usize>]) -> Result<Self, FlashError> {
        if runs.len() != self.batch {
            return Err(FlashError::Shape(format!("key runs for {} sequences, but the batch holds {}", runs.len(), self.batch)));
        }
        for (b, run) in runs.iter().enumerate() {
            if run.start > run.end || run.end > self.seq_kv {
                return Err(FlashError::Shape(format!("sequence {b}'s visible keys {run:?} do not lie within its {} keys", self.seq_kv)));
            }
            let keys = run.start as u32..run.end as u32;
            for row in &mut self.row_keys[b * self.seq_q..(b + 1) * self.seq_q] {
                *row = intersect(row, &keys);
            }
            for (key, rows) in self.key_rows[b * self.seq_kv..(b + 1) * self.seq_kv].iter_mut().enumerate() {
                if !keys.contains(&(key as u32)) {
                    *rows = 0..0;
                }
            }
        }
        Ok(self)
    }

    /// `(batch, seq_q, seq_kv)` the runs were built for.
    pub fn dims(&self) -> (usize, usize, usize) {
        (self.batch, self.seq_q, self.seq_kv)
    }

    /// Whether query row `row` of sequence `batch` sees key `key` (before causality).
    pub fn visible(&self, batch: usize, row: usize, key: usize) -> bool {
        self.row_keys[batch * self.seq_q + row].contains(&(key as u32))
    }

    /// `true` where row `row` of sequence `b` must not see key `key`: a `[batch, seq_q,
    /// seq_kv]` mask in burn's convention, for backends without the kernels (it is the
    /// `S × S` matrix the kernels avoid).
    pub fn dense_mask(&self) -> Vec<bool> {
        let mut mask = Vec::with_capacity(self.batch * self.seq_q * self.seq_kv);
        for b in 0..self.batch {
            for row in 0..self.seq_q {
                mask.extend((0..self.seq_kv).map(|key| !self.visible(b, row, key)));
            }
        }
        mask
    }

    pub(crate) fn check(&self, batch: usize, seq_q: usize, seq_kv: usize) -> Result<(), FlashError> {
        if self.dims() != (batch, seq_q, seq_kv) {
            return Err(FlashError::Shape(format!(
                "the visible ranges were built for (batch, queries, keys) = {:?}, the call has {:?}",
                self.dims(),
                (batch, seq_q, seq_kv)
            )));
        }
        Ok(())
    }

    /// The two views on the device, as flat u32 `[start, end]` pairs.
    pub(crate) fn upload<R: CubeRuntime>(&self, client: &ComputeClient<R>, device: &R::Device) -> [CubeTensor<R>; 2] {
        [&self.row_keys, &self.key_rows].map(|runs| {
            let bytes: Vec<u8> = runs.iter().flat_map(|run| [run.start, run.end]).flat_map(u32::to_ne_bytes).collect();
            let handle = client.create_from_slice(&bytes);
            CubeTensor::new_contiguous(client.clone(), device.clone(), Shape::new([runs.len() * 2]), handle, DType::U32)
        })
    }
}

/// An empty intersection is `0..0`, so that no empty run reads as a position.
fn intersect(a: &Range<u32>, b: &Range<u32>) -> Range<u32> {
    let run = a.start.max(b.start)..a.end.min(b.end);
    if run.is_empty() { 0..0 } else { run }
}

/// Placeholder bound to the kernels' range arguments when a call has no ranges (a comptime
/// flag keeps the kernels from reading it).
pub(crate) fn no_ranges<R: CubeRuntime>(client: &ComputeClient<R>, device: &R::Device) -> CubeTensor<R> {
    let handle = client.create_from_slice(&[0u8; 8]);
    CubeTensor::new_contiguous(client.clone(), device.clone(), Shape::new([2]), handle, DType::U32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_and_key_runs_agree_in_both_views() {
        let ranges = VisibleRanges::all(2, 7, 7)
            .unwrap()
            .with_documents(&[vec![3, 4], vec![1, 5, 1]])
            .unwrap()
            .with_key_runs(&[0..7, 0..5])
            .unwrap();
        for b in 0..2 {
            for row in 0..7 {
                for key in 0..7 {
                    let by_key = ranges.key_rows[b * 7 + key].contains(&(row as u32));
                    assert_eq!(ranges.visible(b, row, key), by_key, "b {b} row {row} key {key}");
                }
            }
        }
        assert!(ranges.visible(0, 2, 0) && !ranges.visible(0, 3, 2) && ranges.visible(0, 6, 3));
        // Sequence 1: documents [0], [1..6), [6]; keys 5 and 6 are padding.
        assert!(!ranges.visible(1, 0, 1) && ranges.visible(1, 5, 4) && !ranges.visible(1, 5, 5) && !ranges.visible(1, 6, 6));
    }

    #[test]
    fn a_window_keeps_the_last_keys_of_each_row_in_both_views() {
        let ranges = VisibleRanges::all(1, 9, 9).unwrap().with_documents(&[vec![6, 3]]).unwrap().with_window(3).unwrap();
        for row in 0..9 {
            for key in 0..9 {
                let same_document = (row < 6) == (key < 6);
                let expected = same_document && key + 3 > row;
                assert_eq!(ranges.visible(0, row, key), expected, "row {row} key {key}");
                assert_eq!(ranges.key_rows[key].contains(&(row as u32)), expected, "row {row} key {key} by key");
            }
        }
        assert!(VisibleRanges::all(1, 4, 5).unwrap().with_window(2).is_err());
        assert!(VisibleRanges::all(1, 4, 4).unwrap().with_window(0).is_err());
        // A window wider than the sequence, to `usize::MAX`, hides nothing.
        for window in [4, 5, usize::MAX - 2, usize::MAX] {
            assert_eq!(VisibleRanges::all(1, 4, 4).unwrap().with_window(window).unwrap(), VisibleRanges::all(1, 4, 4).unwrap(), "window {window}");
        }
    }

    #[test]
    fn lengths_that_do_not_cover_the_sequence_are_refused() {
        let error = VisibleRanges::all(1, 6, 6).unwrap().with_documents(&[vec![2, 3]]).unwrap_err();
        assert!(error.to_string().contains("sum to its length 6"), "{error}");
        let error = VisibleRanges::all(1, 6, 8).unwrap().with_documents(&[vec![6]]).unwrap_err();
        assert!(error.to_string().contains("self-attention"), "{error}");
        assert!(VisibleRanges::all(1, 6, 6).unwrap().with_key_runs(&[2..9]).is_err());
    }
}
