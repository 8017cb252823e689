//! The reference ring: every block is ordinary tensor ops (a `chunk × chunk` score matrix),
//! and the passes are [`ExchangeBackend::send_recv`], whose autodiff node sends gradients
//! back the way the blocks came, so the backward is the ring run in reverse by autodiff.

use std::sync::Arc;

use burn::tensor::{DType, Tensor};

use super::attend_around_ring;
use crate::{comm::Communicator, error::UlyssesError, flash::repeat_kv_heads, capabilities::ExchangeBackend, layout::RingPlan};

/// Stand-in for -infinity in masked scores (exact zeros after `exp`, no NaN from `-inf - -inf`).
const MASKED: f32 = -1.0e30;

/// [`super::ring_attention`] on tensor-op blocks.
pub(super) fn ring_attention<X: ExchangeBackend>(
    query: Tensor<X, 4>,
    key: Tensor<X, 4>,
    value: Tensor<X, 4>,
    plan: &RingPlan,
    ring: &Arc<dyn Communicator<X::Wire>>,
) -> Result<Tensor<X, 4>, UlyssesError> {
    let dtype = query.dtype();
    let forward = attend_around_ring(query, key, value, plan, ring, |[query, key, value], block| {
        Ok(block_attention(query, key, value, plan, block.diagonal))
    })?;
    // Every rank's backward must run every pass in reverse, or a rank whose last blocks
    // were invisible (causal) would skip collectives its peers wait in: a zero-weighted use
    // of the last block keeps the whole chain of passes in the graph on every rank.
    // Zeroed before the sum: in f16 a block's sum passes 65 504, and inf · 0 is NaN.
    let keep = (forward.last_block * 0.0).sum().cast(DType::F32).reshape([1, 1, 1, 1]);
    Ok((forward.output + keep).cast(dtype))
}

/// Softmax attention of `query` over one block of keys, normalised within the block, and
/// each row's log-sum-exp `[B, H, S_q, 1]`, both f32 (merged in f32, as the fused ring
/// merges); `diagonal` masks keys after the query (the block of a chunk with itself). The
/// matmuls take the inputs' dtype; the scores, their statistics and the log-sum-exp are f32
/// (in f16 a chunk's sums overflow past 65 504 keys, in bf16 a log-sum-exp shifts every
/// probability by up to 3% once a row sees 3 000 keys).
fn block_attention<X: ExchangeBackend>(query: Tensor<X, 4>, key: Tensor<X, 4>, value: Tensor<X, 4>, plan: &RingPlan, diagonal: bool) -> (Tensor<X, 4>, Tensor<X, 4>) {
    let dtype = query.dtype();
    let (key, value) = (repeat_kv_heads(key, plan.group), repeat_kv_heads(value, plan.group));
    let scores = query.matmul(key.swap_dims(2, 3)).cast(DType::F32) * plan.scale;
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
    // Normalised before the product, so that its sums stay within the values' range.
    let probabilities = (weights / sum.clone()).cast(dtype);
    (probabilities.matmul(value).cast(DType::F32), max + sum.log())
}
