//! Ring attention: the sequence is cut into one chunk per rank of a ring; each rank keeps
//! its chunk's queries and passes its keys and values around the ring, attending to each
//! block as it arrives. Partial results merge by their log-sum-exp, so the result is exact.
//! This is the "ring" half of Ulysses × Ring (USP): it goes past the head count, where
//! Ulysses alone stops.
//!
//! This is the reference formulation: each block's attention is ordinary tensor ops (a
//! `chunk × chunk` score matrix per block, never `S × S`), and the passes are
//! [`ExchangeBackend::send_recv`], whose autodiff node sends gradients back the way the
//! blocks came, so the backward is the ring run in reverse. Causal attention over contiguous
//! chunks: ring rank `r` holds chunk `r`, sees earlier chunks whole, its own chunk
//! causally, later chunks not at all (it still forwards them).

use std::sync::Arc;

use burn::tensor::{Tensor, ops::AttentionModuleOptions};

pub use crate::layout::{BlockKind, RingSharding, pairs_per_rank};
use crate::{
    comm::Communicator,
    error::UlyssesError,
    fused::repeat_kv_heads,
    inner::ExchangeBackend,
    primitive::{float_primitive, float_tensor},
};

/// Stand-in for -infinity in masked scores (exact zeros after `exp`, no NaN from `-inf - -inf`).
const MASKED: f32 = -1.0e30;

/// Attention of this ring rank's queries `[B, H, S/R, D]` over the whole sequence, whose
/// keys and values `[B, H_kv, S/R, D]` are held by the ring's ranks as `sharding` places
/// them (each rank's tensors are its chunks, concatenated in order). Collective over
/// `ring`: every rank calls it with tensors of the same shape.
pub fn ring_attention<X: ExchangeBackend>(
    query: Tensor<X, 4>,
    key: Tensor<X, 4>,
    value: Tensor<X, 4>,
    options: AttentionModuleOptions,
    sharding: RingSharding,
    ring: &Arc<dyn Communicator<X::Wire>>,
) -> Result<Tensor<X, 4>, UlyssesError> {
    let [_, q_heads, local, head_dim] = query.dims();
    let [_, kv_heads, kv_local, _] = key.dims();
    if kv_heads == 0 || q_heads % kv_heads != 0 {
        return Err(UlyssesError::KvHeadsNotGrouping { q_heads, kv_heads });
    }
    if kv_local != local {
        return Err(UlyssesError::Shape(format!("ring attention: {local} queries and {kv_local} keys per rank; the ring needs self-attention chunks")));
    }
    if options.softcap.is_some() {
        return Err(UlyssesError::Shape("ring attention: softcap is not supported".into()));
    }
    let (rank, size) = (ring.rank(), ring.size());
    let (my_chunks, _) = sharding.chunks(rank, size);
    if local % my_chunks.len() != 0 {
        return Err(UlyssesError::Shape(format!(
            "ring attention: {local} tokens per rank do not split into its {} chunks; pad the sequence to a multiple of {}",
            my_chunks.len(),
            2 * size
        )));
    }
    let (next, previous) = ((rank + 1) % size, (rank + size - 1) % size);
    let scale = options.scale.unwrap_or(1.0 / (head_dim as f64).sqrt());
    let group = q_heads / kv_heads;
    let value_dim = value.dims()[3];
    let part = local / my_chunks.len();
    let parts = |t: &Tensor<X, 4>| -> Vec<Tensor<X, 4>> { (0..my_chunks.len()).map(|i| t.clone().narrow(2, i * part, part)).collect() };
    let queries = parts(&query);

    // Per query chunk, the running (output, log-sum-exp) over the key chunks seen so far.
    let mut partial: Vec<Option<(Tensor<X, 4>, Tensor<X, 4>)>> = vec![None; queries.len()];
    // Keys and values travel together, one send per step; our own come first.
    let mut block = Tensor::cat(vec![key, value], 3);
    for step in 0..size {
        if step > 0 {
            block = float_tensor(X::send_recv(float_primitive(block), next, previous, ring)?);
        }
        let (key_chunks, _) = sharding.chunks((rank + size - step) % size, size);
        let keys = parts(&block.clone().narrow(3, 0, head_dim));
        let values = parts(&block.clone().narrow(3, head_dim, value_dim));
        for (q, query_chunk) in my_chunks.iter().enumerate() {
            for (k, key_chunk) in key_chunks.iter().enumerate() {
                let kind = BlockKind::of(*query_chunk, *key_chunk, options.is_causal);
                if kind == BlockKind::Hidden {
                    continue;
                }
                let (output, lse) = block_attention(queries[q].clone(), keys[k].clone(), values[k].clone(), group, scale, kind == BlockKind::Diagonal);
                partial[q] = Some(match partial[q].take() {
                    None => (output, lse),
                    Some((before, before_lse)) => merge(before, before_lse, output, lse),
                });
            }
        }
    }
    // Every chunk sees at least itself (its diagonal block), so every part is set.
    let outputs: Vec<Tensor<X, 4>> = partial.into_iter().map(|p| p.expect("a chunk sees itself").0).collect();
    let output = if outputs.len() == 1 { outputs.into_iter().next().unwrap() } else { Tensor::cat(outputs, 2) };
    // Every rank's backward must run every pass in reverse, or a rank whose last blocks
    // were invisible (causal) would skip collectives its peers wait in: a zero-weighted use
    // of the last block keeps the whole chain of passes in the graph on every rank.
    let keep = (block.sum() * 0.0).reshape([1, 1, 1, 1]);
    Ok(output + keep)
}

/// Softmax attention of `query` over one block of keys, normalised within the block, and
/// each row's log-sum-exp `[B, H, S_q, 1]`; `diagonal` masks keys after the query
/// (the block of a chunk with itself).
fn block_attention<X: ExchangeBackend>(
    query: Tensor<X, 4>,
    key: Tensor<X, 4>,
    value: Tensor<X, 4>,
    group: usize,
    scale: f64,
    diagonal: bool,
) -> (Tensor<X, 4>, Tensor<X, 4>) {
    let (key, value) = (repeat_kv_heads(key, group), repeat_kv_heads(value, group));
    let scores = query.matmul(key.swap_dims(2, 3)) * scale;
    let scores = if diagonal {
        let [b, h, rows, cols] = scores.dims();
        let later = Tensor::<X, 2, burn::tensor::Bool>::tril_mask([rows, cols], 0, &scores.device()).reshape([1, 1, rows, cols]).expand([b, h, rows, cols]);
        scores.mask_fill(later, MASKED)
    } else {
        scores
    };
    let max = scores.clone().max_dim(3).detach();
    let weights = (scores - max.clone()).exp();
    let sum = weights.clone().sum_dim(3);
    let output = weights.matmul(value) / sum.clone();
    (output, max + sum.log())
}

/// Two partial attentions of the same rows over disjoint keys, as one.
fn merge<X: ExchangeBackend>(output: Tensor<X, 4>, lse: Tensor<X, 4>, other: Tensor<X, 4>, other_lse: Tensor<X, 4>) -> (Tensor<X, 4>, Tensor<X, 4>) {
    let max = lse.clone().max_pair(other_lse.clone()).detach();
    let (mine, theirs) = ((lse - max.clone()).exp(), (other_lse - max.clone()).exp());
    let total = mine.clone() + theirs.clone();
    let merged = (output * mine + other * theirs) / total.clone();
    (merged, max + total.log())
}
