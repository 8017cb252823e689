//! The guard against attention done by hand: `UlyssesBackend` refuses, inside a group that
//! spreads each sequence over several ranks, a matmul that computes scores of a rank's shard
//! against itself.
//!
//! A model that calls `burn::tensor::module::attention` is sequence parallel under
//! `UlyssesBackend`; one that multiplies `q·kᵀ` itself (burn-nn's `MultiHeadAttention`, most
//! hand-written Llamas) would run without a word while every rank attended only within its
//! shard. Such scores have a recognisable shape: a 4-D `[.., S, D] · [.., D, S]` product of
//! per-(batch, head) operands whose result is `local × local`, `local` being the length the
//! sharding step recorded ([`context::record_local_sequence`]). A linear layer's weight is
//! broadcast over batch and heads (its leading dims are 1), so its output never matches, even
//! when its width equals the local length. The attention op's own products run on the inner
//! backend and never reach this guard.

use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::{
    TensorMetadata,
    ops::FloatTensor,
};

use crate::{
    context::{self, Sharding},
    error::UlyssesError,
    inner::ExchangeBackend,
};

/// Why a matmul of these shapes is refused, or `None`: `local_seq` the recorded local
/// sequence length, `sharding` the rank context's.
pub fn scores_within_shard(lhs: &[usize], rhs: &[usize], local_seq: Option<usize>, sharding: Option<Sharding>) -> Option<UlyssesError> {
    let sharding = sharding.filter(|s| s.ranks > 1 && !s.shard_local_attention_on_purpose)?;
    let local_seq = local_seq?;
    let ([.., m, _], [batch, heads, _, n]) = (lhs, rhs) else { return None };
    let per_head_operand = *batch > 1 || *heads > 1;
    (lhs.len() == 4 && rhs.len() == 4 && *m == local_seq && *n == local_seq && per_head_operand).then(|| UlyssesError::AttentionByHand {
        lhs: lhs.to_vec(),
        rhs: rhs.to_vec(),
        local_seq,
        ranks: sharding.ranks,
    })
}

static GUARD_ON: AtomicBool = AtomicBool::new(true);

/// Turns the guard on or off for the whole process: for measuring what it costs
/// (`cargo bench --bench matmul_guard`). A model that attends within each shard on purpose sets
/// [`UlyssesConfig::shard_local_attention_on_purpose`](crate::UlyssesConfig) instead.
pub fn set_guard(on: bool) {
    GUARD_ON.store(on, Ordering::Relaxed);
}

/// `UlyssesBackend`'s matmul: the inner backend's, after the guard.
pub fn guarded_matmul<X: ExchangeBackend>(lhs: FloatTensor<X>, rhs: FloatTensor<X>) -> FloatTensor<X> {
    // The shape test first: most matmuls end there, before any lookup.
    let (lhs_shape, rhs_shape) = (lhs.shape(), rhs.shape());
    if lhs_shape.num_dims() == 4 && rhs_shape.num_dims() == 4 && lhs_shape[2] == rhs_shape[3] && GUARD_ON.load(Ordering::Relaxed) {
        if let Some(error) = scores_within_shard(&lhs_shape, &rhs_shape, context::local_sequence(), context::current_sharding()) {
            panic!("{error}");
        }
    }
    X::float_matmul(lhs, rhs)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SP2: Option<Sharding> = Some(Sharding { ranks: 2, shard_local_attention_on_purpose: false });

    #[test]
    fn scores_of_a_shard_against_itself_are_refused_with_the_fix() {
        let error = scores_within_shard(&[2, 4, 8, 16], &[2, 4, 16, 8], Some(8), SP2).expect("refused");
        let message = error.to_string();
        for needle in ["[2, 4, 8, 16]", "8 x 8", "2 ranks", "module::attention", "is_causal", "MultiHeadAttention", "global positions", "shard_local_attention_on_purpose"] {
            assert!(message.contains(needle), "`{needle}` missing from: {message}");
        }
    }

    #[test]
    fn other_products_pass() {
        // One rank, no group, the opt-out, nothing recorded.
        assert!(scores_within_shard(&[2, 4, 8, 16], &[2, 4, 16, 8], Some(8), Some(Sharding { ranks: 1, ..SP2.unwrap() })).is_none());
        assert!(scores_within_shard(&[2, 4, 8, 16], &[2, 4, 16, 8], Some(8), None).is_none());
        assert!(scores_within_shard(&[2, 4, 8, 16], &[2, 4, 16, 8], Some(8), Some(Sharding { shard_local_attention_on_purpose: true, ..SP2.unwrap() })).is_none());
        assert!(scores_within_shard(&[2, 4, 8, 16], &[2, 4, 16, 8], None, SP2).is_none());
        // Another length (the whole sequence after an exchange), a 3-D product, probabilities
        // times values, and a linear layer as wide as the shard (a broadcast weight).
        assert!(scores_within_shard(&[2, 4, 16, 16], &[2, 4, 16, 16], Some(8), SP2).is_none());
        assert!(scores_within_shard(&[2, 8, 16], &[2, 16, 8], Some(8), SP2).is_none());
        assert!(scores_within_shard(&[2, 4, 8, 8], &[2, 4, 8, 16], Some(8), SP2).is_none());
        assert!(scores_within_shard(&[2, 4, 8, 16], &[1, 1, 16, 8], Some(8), SP2).is_none());
    }
}
