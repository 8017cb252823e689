//! Sequence sharding, as ALST does it: shift labels, pad, then cut each sequence into `P`
//! contiguous shards.
//!
//! Everything happens on the host: a rank builds device tensors only for its own shard, so
//! the full batch never occupies device memory.
//!
//! - Labels are shifted *before* sharding: position `i` is trained to predict token `i + 1`,
//!   and the last token of a sequence gets [`SequenceSharder::ignore_index`]. Shifting after
//!   sharding would lose the label at every shard edge.
//! - The batch is padded to a multiple of `sp_size` (padding tokens carry no label; causal
//!   attention never sees them, and attention that looks both ways masks them with
//!   [`SequenceShard::padding`]), so every rank holds the same number of tokens; with `pad_to`, to at least that length too (fixed
//!   shapes from step to step, so kernels are tuned and memory is reserved once).
//! - Each shard carries its tokens' position ids, for RoPE: global positions, or, when
//!   documents are packed into a sequence ([`pack_documents`]), positions that restart at 0
//!   at each document (the Hugging Face / ALST convention). Packed labels never cross a
//!   document's end, and each padding token after the last document is a document of its own.

use std::sync::Arc;

use crate::{
    error::UlyssesError,
    layout::{RingSharding, ring_coordinates},
};

/// Label value that the loss skips (as in PyTorch's `ignore_index`).
pub const IGNORE_INDEX: i64 = -100;

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SequenceSharder {
    /// Ranks of the sequence-parallel group.
    pub sp_size: usize,
    /// Token placed after the end of shorter sequences (0 by default).
    pub pad_token: i64,
    /// Label of positions that carry no training signal ([`IGNORE_INDEX`] by default).
    pub ignore_index: i64,
    /// Pad every batch to at least this many tokens (then to a multiple of `sp_size`), not
    /// only to its longest sequence.
    pub pad_to: Option<usize>,
    /// Ring degree of Ulysses × Ring (1 by default: Ulysses alone). Rank `ring_rank · U + u`,
    /// with `U = sp_size / ring_size`, holds the `u`-th part of ring rank `ring_rank`'s chunks.
    pub ring_size: usize,
    /// How the sequence is cut over the ring (as `UlyssesConfig::ring_sharding`; contiguous by
    /// default).
    pub ring_sharding: RingSharding,
}

/// Position ids of a batch of token rows, on the host: `[batch, len]`, row-major.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PositionIds {
    batch: usize,
    len: usize,
    ids: Arc<[u64]>,
}

impl PositionIds {
    /// `ids` of `batch` rows of `len` tokens each.
    pub fn new(ids: Vec<u64>, batch: usize, len: usize) -> Result<Self, UlyssesError> {
        if ids.len() != batch * len || len == 0 {
            return Err(UlyssesError::Shape(format!("position ids: {} ids cannot be {batch} rows of {len} tokens", ids.len())));
        }
        Ok(Self { batch, len, ids: ids.into() })
    }

    /// One document per row: positions `offset..offset + len` in every row (an unpacked
    /// shard that starts at global position `offset`).
    pub fn consecutive(batch: usize, offset: usize, len: usize) -> Self {
        let row = (offset as u64..(offset + len) as u64).collect::<Vec<_>>();
        Self { batch, len, ids: row.repeat(batch).into() }
    }

    /// Rows are `[rows[0], rows[1], ..]` concatenated along the sequence, as the shards of
    /// an SP group concatenate into the whole sequence.
    pub fn concat(parts: &[PositionIds]) -> Result<Self, UlyssesError> {
        let batch = parts.first().map_or(0, |p| p.batch);
        if parts.is_empty() || parts.iter().any(|p| p.batch != batch) {
            return Err(UlyssesError::Shape("position ids: the parts to concatenate must share a batch size".into()));
        }
        let len: usize = parts.iter().map(|p| p.len).sum();
        let mut ids = Vec::with_capacity(batch * len);
        for b in 0..batch {
            for part in parts {
                ids.extend_from_slice(part.row(b));
            }
        }
        Self::new(ids, batch, len)
    }

    pub fn batch(&self) -> usize {
        self.batch
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// All ids, row-major.
    pub fn ids(&self) -> &[u64] {
        &self.ids
    }

    /// Row `b`'s ids.
    pub fn row(&self, b: usize) -> &[u64] {
        &self.ids[b * self.len..(b + 1) * self.len]
    }

    /// Per row, the lengths of its documents: a document ends where the next position does
    /// not continue it.
    pub fn document_lengths(&self) -> Vec<Vec<usize>> {
        (0..self.batch)
            .map(|b| {
                let row = self.row(b);
                let mut lengths = vec![1usize];
                for pair in row.windows(2) {
                    if pair[1] == pair[0] + 1 {
                        *lengths.last_mut().unwrap() += 1;
                    } else {
                        lengths.push(1);
                    }
                }
                lengths
            })
            .collect()
    }
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
    /// Global position of this shard's first token. Its tokens are at `position_offset + i`
    /// only where the shard is contiguous and holds one document per row: Ulysses alone or a
    /// contiguous ring, unpacked. A zigzag ring's shard holds two chunks apart, and packed
    /// documents restart at 0: RoPE takes [`positions`](Self::positions)' ids, which are right
    /// in every case.
    pub position_offset: usize,
    /// Where the shard's tokens sit in their sequences.
    pub positions: ShardPositions,
    /// Labels that are not `ignore_index`.
    pub valid_tokens: usize,
    /// `[batch, local_len]`: true where the token is padding, past its sequence's end. Causal
    /// attention never looks there (padding comes last); attention that looks both ways must
    /// mask those keys (`ShardTensors::mask_pad`), or it attends to them.
    pub padding: Vec<bool>,
}

/// Where a shard's tokens sit in their sequences: what a model needs for RoPE and attention.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPositions {
    /// `[batch, local_len]`: global positions, or positions within each packed document.
    pub ids: PositionIds,
    /// Whether the rows pack several documents: attention must then stay inside each
    /// (`burn_ulysses::attention::attention_in_documents` with `ids`).
    pub packed: bool,
    /// Which shard of its sequences these are ([`ShardCut::WHOLE`]: whole sequences). Under
    /// burn 0.21, attention on a forward that noted these positions
    /// (`burn_ulysses::attention_guard::note_shard_positions`) is refused outside a rank
    /// context that cuts sequences the same way and holds this shard: it would attend within
    /// the shard alone, or join shards out of order. The burn 0.22 crate checks it against the thread's groups in
    /// `burn_ulysses_ops::train::labels_in_step`.
    pub cut: ShardCut,
}

/// How a shard was cut from its sequences: one of `of` shards (the sharder's SP degree), the
/// `index`-th (its SP rank), in `runs` runs of consecutive tokens (2 under a zigzag ring).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardCut {
    pub of: usize,
    pub index: usize,
    pub runs: usize,
}

impl ShardCut {
    /// A whole sequence, no shard of one.
    pub const WHOLE: Self = Self { of: 1, index: 0, runs: 1 };
}

impl ShardPositions {
    /// Unpacked rows of whole sequences of `len` tokens, at positions `0..len`.
    pub fn consecutive(batch: usize, len: usize) -> Self {
        Self { ids: PositionIds::consecutive(batch, 0, len), packed: false, cut: ShardCut::WHOLE }
    }

    /// Refuses positions of other rows than tokens of `dims` (`[batch, len]`): RoPE's tables
    /// are narrowed to the tokens and broadcast over rows, so fewer positions panic deep in a
    /// forward, and one row's positions given for many would silently give many rows' output.
    pub fn check_tokens(&self, dims: [usize; 2]) -> Result<(), UlyssesError> {
        let [batch, len] = dims;
        if (self.ids.batch(), self.ids.len()) == (batch, len) {
            return Ok(());
        }
        Err(UlyssesError::Shape(format!(
            "positions of {} rows of {} tokens for tokens of [{batch}, {len}]: pass the shard's own positions (its sharder's, or \
             ShardPositions::consecutive({batch}, {len}) for whole sequences)",
            self.ids.batch(),
            self.ids.len()
        )))
    }

    /// Unpacked rows of shard `index` of sequences cut in `of` contiguous shards of `len`
    /// tokens each (positions `index · len..(index + 1) · len`), as `SequenceSharder::new(of)`
    /// cuts sequences of `of · len` tokens: noted, the guard holds it to its rank context.
    pub fn contiguous_shard(batch: usize, len: usize, index: usize, of: usize) -> Self {
        assert!(index < of, "shard {index} of {of}: out of range");
        Self { ids: PositionIds::consecutive(batch, index * len, len), packed: false, cut: ShardCut { of, index, runs: 1 } }
    }
}

/// Packs `documents` in order, whole, into sequences of at most `max_len` tokens (a document
/// longer than that is cut into pieces, each a document of its own). Returns the sequences
/// and, for each, the lengths of the documents in it, as [`SequenceSharder::shard_documents`]
/// takes them.
pub fn pack_documents(documents: &[Vec<i64>], max_len: usize) -> (Vec<Vec<i64>>, Vec<Vec<usize>>) {
    assert!(max_len > 0, "pack_documents: max_len must be at least 1");
    let (mut sequences, mut lengths) = (vec![], vec![]);
    let (mut tokens, mut current) = (Vec::new(), Vec::new());
    for piece in documents.iter().flat_map(|document| document.chunks(max_len)) {
        if tokens.len() + piece.len() > max_len {
            sequences.push(std::mem::take(&mut tokens));
            lengths.push(std::mem::take(&mut current));
        }
        tokens.extend_from_slice(piece);
        current.push(piece.len());
    }
    if !tokens.is_empty() {
        sequences.push(tokens);
        lengths.push(current);
    }
    (sequences, lengths)
}

impl SequenceSharder {
    /// A sharder for `sp_size` ranks: pad token 0, [`IGNORE_INDEX`], no fixed length, no ring.
    pub fn new(sp_size: usize) -> Self {
        Self { sp_size, pad_token: 0, ignore_index: IGNORE_INDEX, pad_to: None, ring_size: 1, ring_sharding: RingSharding::Contiguous }
    }

    pub fn with_pad_token(mut self, pad_token: i64) -> Self {
        self.pad_token = pad_token;
        self
    }

    pub fn with_ignore_index(mut self, ignore_index: i64) -> Self {
        self.ignore_index = ignore_index;
        self
    }

    pub fn with_pad_to(mut self, pad_to: Option<usize>) -> Self {
        self.pad_to = pad_to;
        self
    }

    pub fn with_ring_size(mut self, ring_size: usize) -> Self {
        self.ring_size = ring_size;
        self
    }

    pub fn with_ring_sharding(mut self, ring_sharding: RingSharding) -> Self {
        self.ring_sharding = ring_sharding;
        self
    }

    /// Rank `rank`'s shard of `sequences` (token ids, any lengths ≥ 1).
    pub fn shard(&self, sequences: &[Vec<i64>], rank: usize) -> SequenceShard {
        self.shard_documents(sequences, None, rank)
    }

    /// Rank `rank`'s shard of `sequences`, each packing documents of lengths `documents[i]`
    /// (summing to its length; `None`: one document per sequence, unpacked).
    pub fn shard_documents(&self, sequences: &[Vec<i64>], documents: Option<&[Vec<usize>]>, rank: usize) -> SequenceShard {
        self.shard_targets(sequences, documents, None, rank)
    }

    /// Why [`shard_targets`](Self::shard_targets) cannot shard this batch, or `Ok`: an empty
    /// batch (or one of empty sequences alone; a shorter row, even empty, is padded), document lengths that are not positive or do not sum to their
    /// sequence, targets of another shape than the tokens.
    pub fn check_batch(&self, sequences: &[Vec<i64>], documents: Option<&[Vec<usize>]>, targets: Option<&[Vec<bool>]>) -> Result<(), UlyssesError> {
        let invalid = |message: String| Err(UlyssesError::InvalidConfig(message));
        if self.sp_size == 0 {
            return invalid("the sharder's sp_size must be at least 1".into());
        }
        if sequences.iter().all(Vec::is_empty) {
            return invalid("cannot shard an empty batch, or a batch of empty sequences".into());
        }
        if let Some(documents) = documents {
            if documents.len() != sequences.len() {
                return invalid(format!("document lengths for {} sequences, but the batch holds {}", documents.len(), sequences.len()));
            }
            for (i, (lengths, sequence)) in documents.iter().zip(sequences).enumerate() {
                if lengths.iter().sum::<usize>() != sequence.len() || lengths.contains(&0) {
                    return invalid(format!("sequence {i}: document lengths {lengths:?} must be positive and sum to its {} tokens", sequence.len()));
                }
            }
        }
        if let Some(targets) = targets {
            if targets.len() != sequences.len() {
                return invalid(format!("targets for {} sequences, but the batch holds {}: one target flag per token", targets.len(), sequences.len()));
            }
            if let Some((i, (targets, sequence))) = targets.iter().zip(sequences).enumerate().find(|(_, (t, s))| t.len() != s.len()) {
                return invalid(format!("sequence {i}: {} targets for its {} tokens: one target flag per token", targets.len(), sequence.len()));
            }
        }
        Ok(())
    }

    /// What a batch's sequences are padded to a multiple of: the SP degree, twice it where a
    /// zigzag ring cuts each ring rank's share in two chunks.
    pub fn length_multiple(&self) -> usize {
        if self.ring_sharding == RingSharding::Zigzag { 2 * self.sp_size } else { self.sp_size }
    }

    /// The length every sequence of `sequences` is padded to (the longest's, at least
    /// `pad_to`, up to a [`length_multiple`](Self::length_multiple)); 0 for no sequence.
    pub fn padded_len(&self, sequences: &[Vec<i64>]) -> usize {
        let longest = sequences.iter().map(Vec::len).max().unwrap_or(0);
        let multiple = self.length_multiple();
        longest.max(self.pad_to.unwrap_or(0)).div_ceil(multiple) * multiple
    }

    /// [`shard_documents`](Self::shard_documents) where only some tokens are trained on:
    /// `targets[i][j]` says whether token `j` of sequence `i` is a target, the label of
    /// position `j − 1` (supervised fine-tuning: the answers, not the prompts; Hugging Face's
    /// labels of -100 are the tokens that are not). `None`: every token.
    ///
    /// Panics where [`check_batch`](Self::check_batch) refuses the batch, or `rank` is out of
    /// range: check first where the input comes from a user.
    pub fn shard_targets(&self, sequences: &[Vec<i64>], documents: Option<&[Vec<usize>]>, targets: Option<&[Vec<bool>]>, rank: usize) -> SequenceShard {
        if let Err(error) = self.check_batch(sequences, documents, targets) {
            panic!("{error}");
        }
        assert!(rank < self.sp_size, "rank {rank} is out of range for sp_size {}", self.sp_size);
        let global_len = self.padded_len(sequences);
        let local_len = global_len / self.sp_size;
        let positions = self.positions_of(rank, global_len);
        let start = positions[0];

        let mut tokens = Vec::with_capacity(sequences.len() * local_len);
        let mut labels = Vec::with_capacity(sequences.len() * local_len);
        let mut ids = Vec::with_capacity(sequences.len() * local_len);
        let mut padding = Vec::with_capacity(sequences.len() * local_len);
        for (i, sequence) in sequences.iter().enumerate() {
            // Where each document of the whole padded sequence starts; padding is one more.
            let lengths = documents.map_or_else(|| vec![global_len], |documents| documents[i].clone());
            let starts = document_starts(&lengths, global_len);
            for &position in &positions {
                tokens.push(sequence.get(position).copied().unwrap_or(self.pad_token));
                padding.push(position >= sequence.len());
                // The label of position i is token i + 1 of the *whole* sequence, within its
                // document.
                let document_start = starts[starts.partition_point(|&s| s <= position) - 1];
                let same_document = starts.binary_search(&(position + 1)).is_err();
                let target = targets.is_none_or(|targets| targets[i].get(position + 1).copied().unwrap_or(false));
                let label = if same_document && target { sequence.get(position + 1).copied() } else { None };
                labels.push(label.unwrap_or(self.ignore_index));
                ids.push((position - document_start) as u64);
            }
        }
        let valid_tokens = labels.iter().filter(|&&l| l != self.ignore_index).count();
        let ids = PositionIds::new(ids, sequences.len(), local_len).expect("one id per token");
        SequenceShard {
            tokens,
            labels,
            batch: sequences.len(),
            local_len,
            position_offset: start,
            // Rows of one document each are not packed: attention over them needs no restriction
            // (which a ring refuses).
            positions: ShardPositions { ids, packed: documents.is_some_and(|documents| documents.iter().any(|lengths| lengths.len() > 1)), cut: self.cut(rank) },
            valid_tokens,
            padding,
        }
    }

    /// How rank `rank`'s shard is cut ([`RingSharding::runs`]).
    pub fn cut(&self, rank: usize) -> ShardCut {
        ShardCut { of: self.sp_size, index: rank, runs: self.ring_sharding.runs(self.ring_size) }
    }

    /// The global positions rank `rank` holds in a sequence of `global_len` tokens, in order.
    ///
    /// # Panics
    ///
    /// Where `global_len` is not a multiple of [`length_multiple`](Self::length_multiple)
    /// (pad it: [`padded_len`](Self::padded_len)): the ranks' parts would leave its last tokens
    /// to none.
    pub fn positions_of(&self, rank: usize, global_len: usize) -> Vec<usize> {
        assert!(
            self.ring_size > 0 && self.sp_size % self.ring_size == 0,
            "the ring degree {} must divide sp_size {}",
            self.ring_size,
            self.sp_size
        );
        let multiple = self.length_multiple();
        assert!(
            global_len % multiple == 0,
            "positions_of: a sequence of {global_len} tokens is not a multiple of {multiple} (the SP degree, twice it under a zigzag ring): pad it \
             to padded_len's, or its last tokens would be no rank's"
        );
        let ulysses = self.sp_size / self.ring_size;
        let (ring_rank, member) = ring_coordinates(rank, ulysses);
        let (chunks, count) = self.ring_sharding.chunks(ring_rank, self.ring_size);
        let chunk_len = global_len / count;
        let share: Vec<usize> = chunks.iter().flat_map(|&c| c * chunk_len..(c + 1) * chunk_len).collect();
        let part = share.len() / ulysses;
        share[member * part..(member + 1) * part].to_vec()
    }

    /// Labels in `sequences` (every token but each sequence's last predicts its successor):
    /// what the loss of a batch of whole, unpacked sequences, every token a target, is
    /// averaged over. Packed documents and chosen targets have fewer: the shards'
    /// `valid_tokens` count them.
    pub fn labels_in(sequences: &[Vec<i64>]) -> usize {
        sequences.iter().map(|s| s.len().saturating_sub(1)).sum()
    }
}

/// First position of each document of a sequence padded to `padded_len`, each padding token
/// after the last one being a document of its own: its position id is 0 (however long the
/// padding, no id reaches past a real document's, e.g. a sliding window) and it attends to
/// itself alone (the kernels skip padding tiles).
fn document_starts(lengths: &[usize], padded_len: usize) -> Vec<usize> {
    let mut starts = vec![0];
    let mut end = 0;
    for length in lengths {
        end += length;
        if end < padded_len {
            starts.push(end);
        }
    }
    starts.extend(end + 1..padded_len);
    starts
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
    fn packed_labels_stop_at_each_document_and_positions_restart() {
        let (sequences, lengths) = pack_documents(&[vec![1, 2, 3], vec![4, 5], vec![6, 7, 8, 9, 10, 11, 12]], 6);
        // The third document is longer than a sequence: cut into 6 + 1.
        assert_eq!(sequences, vec![vec![1, 2, 3, 4, 5], vec![6, 7, 8, 9, 10, 11], vec![12]]);
        assert_eq!(lengths, vec![vec![3, 2], vec![6], vec![1]]);
        let sharder = SequenceSharder::new(2).with_pad_to(Some(6));
        let shards: Vec<_> = (0..2).map(|rank| sharder.shard_documents(&sequences[..1], Some(&lengths[..1]), rank)).collect();
        let labels: Vec<i64> = shards.iter().flat_map(|s| s.labels.clone()).collect();
        let ids: Vec<u64> = shards.iter().flat_map(|s| s.positions.ids.ids().to_vec()).collect();
        // Tokens 1 2 3 | 4 5 | pad: no label crosses a document's end, padding has none.
        assert_eq!(labels, vec![2, 3, IGNORE_INDEX, 5, IGNORE_INDEX, IGNORE_INDEX]);
        assert_eq!(ids, vec![0, 1, 2, 0, 1, 0]);
        // Three padding tokens: three documents of one, all at position 0.
        let padded = SequenceSharder::new(2).with_pad_to(Some(8));
        let ids: Vec<u64> = (0..2).flat_map(|rank| padded.shard_documents(&sequences[..1], Some(&lengths[..1]), rank).positions.ids.ids().to_vec()).collect();
        assert_eq!(ids, vec![0, 1, 2, 0, 1, 0, 0, 0]);
        assert!(shards[0].positions.packed);
        // A row of one document given as one is not packed: its attention needs no restriction.
        assert!(!sharder.shard_documents(&sequences[1..2], Some(&lengths[1..2]), 0).positions.packed);
        assert_eq!(shards[0].valid_tokens + shards[1].valid_tokens, 3);
        // Unpacked: global positions, padding included.
        let unpacked = SequenceSharder::new(2).with_pad_to(Some(6)).shard(&sequences[..1], 1);
        assert_eq!((unpacked.positions.ids.ids(), unpacked.positions.packed), (&[3u64, 4, 5][..], false));
    }

    #[test]
    fn zigzag_shards_hold_an_early_and_a_late_chunk_and_cover_the_sequence() {
        // 4 ranks as 2 (Ulysses) × 2 (ring): chunks of 16 / 4 = 4 tokens; ring rank 0 holds
        // chunks 0 and 3, ring rank 1 chunks 1 and 2, each split over its 2 Ulysses ranks.
        let sharder = SequenceSharder::new(4).with_ring_size(2).with_ring_sharding(RingSharding::Zigzag);
        let positions: Vec<Vec<usize>> = (0..4).map(|rank| sharder.positions_of(rank, 16)).collect();
        assert_eq!(positions, vec![vec![0, 1, 2, 3], vec![12, 13, 14, 15], vec![4, 5, 6, 7], vec![8, 9, 10, 11]]);
        let batch = vec![(0..13).collect::<Vec<i64>>()];
        let shards: Vec<_> = (0..4).map(|rank| sharder.shard(&batch, rank)).collect();
        // Padded to a multiple of 2 · 4; labels are the next token of the whole sequence.
        assert_eq!(shards[1].local_len, 4);
        assert_eq!(shards[2].tokens, vec![4, 5, 6, 7]);
        assert_eq!(shards[2].labels, vec![5, 6, 7, 8]);
        assert_eq!(shards[1].positions.ids.ids(), &[12, 13, 14, 15]);
        assert_eq!(shards.iter().map(|s| s.valid_tokens).sum::<usize>(), 12);
        // Contiguous with a ring is plain contiguous sharding.
        let contiguous = SequenceSharder::new(4).with_ring_size(2);
        assert_eq!(contiguous.positions_of(3, 16), vec![12, 13, 14, 15]);
        // A length the cut does not take whole (13: token 12 would be no rank's) is refused.
        let unpadded = std::panic::catch_unwind(|| sharder.positions_of(0, 13)).expect_err("13 tokens cut over 8 chunks");
        let message = crate::comm::panic_message(&*unpadded);
        assert!(message.contains("13 tokens is not a multiple of 8") && message.contains("padded_len"), "{message}");
    }

    #[test]
    fn only_targets_are_labels_on_every_rank() {
        // Two documents packed: a prompt (7, 8) and its answer (9, 10), then another (4 | 5, 6).
        let batch = vec![vec![7, 8, 9, 10, 4, 5, 6, 0]];
        let documents = vec![vec![4, 4]];
        let targets = vec![vec![false, false, true, true, false, true, true, false]];
        let sharder = SequenceSharder::new(2);
        let shards: Vec<SequenceShard> = (0..2).map(|rank| sharder.shard_targets(&batch, Some(&documents), Some(&targets), rank)).collect();
        let labels: Vec<i64> = shards.iter().flat_map(|s| s.labels.clone()).collect();
        // Position 1 predicts 9 (a target); 2 predicts 10; 3 would cross into the next
        // document; 4 predicts 5, 5 predicts 6; 6 predicts 0 (not a target).
        assert_eq!(labels, vec![IGNORE_INDEX, 9, 10, IGNORE_INDEX, 5, 6, IGNORE_INDEX, IGNORE_INDEX]);
        assert_eq!(shards.iter().map(|s| s.valid_tokens).sum::<usize>(), 4);
        // Every token a target: the labels of shard_documents.
        let all = vec![vec![true; 8]];
        for rank in 0..2 {
            assert_eq!(sharder.shard_targets(&batch, Some(&documents), Some(&all), rank).labels, sharder.shard_documents(&batch, Some(&documents), rank).labels);
        }
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
