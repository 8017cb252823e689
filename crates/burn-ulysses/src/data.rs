//! Sequence sharding, as ALST does it: shift labels, pad, then cut each sequence into `P`
//! contiguous shards.
//!
//! Everything happens on the host: a rank builds device tensors only for its own shard, so
//! the full batch never occupies device memory.
//!
//! - Labels are shifted *before* sharding: position `i` is trained to predict token `i + 1`,
//!   and the last token of a sequence gets [`SequenceSharder::ignore_index`]. Shifting after
//!   sharding would lose the label at every shard edge.
//! - The batch is padded to a multiple of `sp_size` (padding tokens are ignored), so every
//!   rank holds the same number of tokens; with `pad_to`, to at least that length too (fixed
//!   shapes from step to step, so kernels are tuned and memory is reserved once).
//! - Each shard carries its global position offset, for RoPE.

use burn::{
    config::Config,
    tensor::{Int, Tensor, TensorData, backend::Backend},
};

/// Label value that the loss skips (as in PyTorch's `ignore_index`).
pub const IGNORE_INDEX: i64 = -100;

#[derive(Config, Debug)]
pub struct SequenceSharder {
    /// Ranks of the sequence-parallel group.
    pub sp_size: usize,
    /// Token placed after the end of shorter sequences.
    #[config(default = 0)]
    pub pad_token: i64,
    /// Label of positions that carry no training signal.
    #[config(default = -100)]
    pub ignore_index: i64,
    /// Pad every batch to at least this many tokens (then to a multiple of `sp_size`), not
    /// only to its longest sequence.
    pub pad_to: Option<usize>,
}

/// One rank's part of a batch of sequences, on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceShard {
    /// `[batch, local_len]`, row-major.
    pub tokens: Vec<i64>,
    /// `[batch, local_len]`; `ignore_index` where there is nothing to predict.
    pub labels: Vec<i64>,
    pub batch: usize,
    pub local_len: usize,
    /// Global position of this shard's first token.
    pub position_offset: usize,
    /// Labels that are not `ignore_index`.
    pub valid_tokens: usize,
}

impl SequenceSharder {
    /// Rank `rank`'s shard of `sequences` (token ids, any lengths ≥ 1).
    pub fn shard(&self, sequences: &[Vec<i64>], rank: usize) -> SequenceShard {
        assert!(self.sp_size > 0, "sp_size must be at least 1");
        assert!(rank < self.sp_size, "rank {rank} is out of range for sp_size {}", self.sp_size);
        assert!(!sequences.is_empty(), "cannot shard an empty batch");
        let longest = sequences.iter().map(Vec::len).max().unwrap();
        assert!(longest > 0, "cannot shard a batch of empty sequences");
        let global_len = longest.max(self.pad_to.unwrap_or(0)).div_ceil(self.sp_size) * self.sp_size;
        let local_len = global_len / self.sp_size;
        let start = rank * local_len;

        let mut tokens = Vec::with_capacity(sequences.len() * local_len);
        let mut labels = Vec::with_capacity(sequences.len() * local_len);
        for sequence in sequences {
            for position in start..start + local_len {
                tokens.push(sequence.get(position).copied().unwrap_or(self.pad_token));
                // The label of position i is token i + 1 of the *whole* sequence.
                labels.push(sequence.get(position + 1).copied().unwrap_or(self.ignore_index));
            }
        }
        let valid_tokens = labels.iter().filter(|&&l| l != self.ignore_index).count();
        SequenceShard {
            tokens,
            labels,
            batch: sequences.len(),
            local_len,
            position_offset: start,
            valid_tokens,
        }
    }

    /// Labels in `sequences` (every token but each sequence's last predicts its successor):
    /// what the loss of this batch is averaged over, summed over all ranks' shards.
    pub fn labels_in(sequences: &[Vec<i64>]) -> usize {
        sequences.iter().map(|s| s.len().saturating_sub(1)).sum()
    }
}

impl SequenceShard {
    /// `[batch, local_len]` token tensor on `device`.
    pub fn tokens<B: Backend>(&self, device: &B::Device) -> Tensor<B, 2, Int> {
        self.int_tensor(&self.tokens, device)
    }

    /// `[batch, local_len]` label tensor on `device`.
    pub fn labels<B: Backend>(&self, device: &B::Device) -> Tensor<B, 2, Int> {
        self.int_tensor(&self.labels, device)
    }

    fn int_tensor<B: Backend>(&self, values: &[i64], device: &B::Device) -> Tensor<B, 2, Int> {
        Tensor::from_data(TensorData::new(values.to_vec(), [self.batch, self.local_len]), device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_shifted_before_sharding_and_padding_is_ignored() {
        let sharder = SequenceSharder::new(2);
        // Lengths 5 and 3: padded to 6, shards of 3.
        let batch = vec![vec![10, 11, 12, 13, 14], vec![20, 21, 22]];
        let first = sharder.shard(&batch, 0);
        let second = sharder.shard(&batch, 1);
        assert_eq!(first.tokens, vec![10, 11, 12, 20, 21, 22]);
        // Position 2's label is token 3, which lives in the other shard.
        assert_eq!(first.labels, vec![11, 12, 13, 21, 22, IGNORE_INDEX]);
        assert_eq!(second.tokens, vec![13, 14, 0, 0, 0, 0]);
        assert_eq!(second.labels, vec![14, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]);
        assert_eq!((first.position_offset, second.position_offset), (0, 3));
        assert_eq!(first.local_len, 3);
        assert_eq!(first.valid_tokens + second.valid_tokens, SequenceSharder::labels_in(&batch));
        assert_eq!((first.valid_tokens, second.valid_tokens), (5, 1));
    }

    #[test]
    fn a_shard_can_hold_only_ignored_labels() {
        let shard = SequenceSharder::new(4).shard(&[vec![1, 2, 3, 4, 5]], 3);
        assert_eq!(shard.valid_tokens, 0);
        assert_eq!(shard.tokens, vec![0, 0]);
    }

    #[test]
    fn pad_to_fixes_the_length_and_can_leave_a_shard_without_labels() {
        let sharder = SequenceSharder::new(2).with_pad_to(Some(10));
        let batch = vec![vec![1, 2, 3], vec![4, 5]];
        let (first, second) = (sharder.shard(&batch, 0), sharder.shard(&batch, 1));
        assert_eq!((first.local_len, second.position_offset), (5, 5));
        assert_eq!((first.valid_tokens, second.valid_tokens), (3, 0));
        // Longer sequences than pad_to still fit.
        assert_eq!(SequenceSharder::new(4).with_pad_to(Some(2)).shard(&batch, 0).local_len, 1);
    }

    #[test]
    fn shards_concatenate_to_the_unsharded_batch() {
        let batch: Vec<Vec<i64>> = (0..3).map(|b| (0..(7 + b)).map(|t| (b * 100 + t) as i64).collect()).collect();
        let whole = SequenceSharder::new(1).shard(&batch, 0);
        for sp in [2, 3, 4] {
            let shards: Vec<_> = (0..sp).map(|r| SequenceSharder::new(sp).shard(&batch, r)).collect();
            for (b, _) in batch.iter().enumerate() {
                let row = |s: &SequenceShard, v: &Vec<i64>| v[b * s.local_len..(b + 1) * s.local_len].to_vec();
                let tokens: Vec<i64> = shards.iter().flat_map(|s| row(s, &s.tokens)).collect();
                let labels: Vec<i64> = shards.iter().flat_map(|s| row(s, &s.labels)).collect();
                assert_eq!(tokens[..whole.local_len], row(&whole, &whole.tokens)[..]);
                assert_eq!(labels[..whole.local_len], row(&whole, &whole.labels)[..]);
                assert!(labels[whole.local_len..].iter().all(|&l| l == IGNORE_INDEX));
            }
        }
    }
}
