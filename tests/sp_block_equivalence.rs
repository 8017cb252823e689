//! A Llama block under `UlyssesBackend<Autodiff<NdArray>>` with P in-process ranks gives the
//! same output and gradients as the same block on `Autodiff<NdArray>` alone.
//!
//! The block calls `burn::tensor::module::attention` with `is_causal`, applies RoPE at global
//! positions (each rank starts at `rank · S/P`) and uses grouped-query attention, with fewer
//! kv heads than ranks where P allows (`ulysses_suite::block` has the check).

use burn::backend::{Autodiff, NdArray};
use ulysses_suite::block::{BlockCase as Case, check_block_equivalence};

/// f32 end to end; the sharded run reorders a few sums (loss and parameter-gradient
/// reductions span ranks), nothing else.
const TOLERANCE: f32 = 1e-5;

fn check(case: Case) {
    check_block_equivalence::<Autodiff<NdArray<f32>>>(case, TOLERANCE);
}

#[test]
fn one_rank_with_grouped_kv_heads() {
    check(Case::new(1, 4, 2));
}

#[test]
fn two_ranks_with_fewer_kv_heads_than_ranks() {
    check(Case::new(2, 4, 1));
}

#[test]
fn two_ranks_with_kv_heads_split() {
    check(Case::new(2, 4, 2));
}

#[test]
fn two_ranks_non_causal() {
    check(Case { causal: false, ..Case::new(2, 4, 2) });
}

#[test]
fn three_ranks_with_fewer_kv_heads_than_ranks() {
    check(Case::new(3, 6, 1));
}

#[test]
fn three_ranks_with_kv_heads_split() {
    check(Case::new(3, 6, 3));
}

#[test]
fn four_ranks_with_fewer_kv_heads_than_ranks() {
    check(Case::new(4, 8, 2));
}

#[test]
fn four_ranks_with_a_model_that_expands_kv_itself() {
    check(Case { model_repeats_kv: true, ..Case::new(4, 8, 2) });
}

#[test]
fn eight_ranks_with_a_single_kv_head() {
    check(Case::new(8, 8, 1));
}

#[test]
fn two_ranks_with_two_local_kv_heads_per_rank() {
    check(Case::new(2, 8, 4));
}

/// Activation checkpointing (burn's `BalancedCheckpointing` recomputes memory-bound ops in
/// the backward) keeps the exchange and the attention: they are compute-bound nodes, never
/// recomputed, so no rank re-enters a collective that the others do not.
#[test]
fn four_ranks_with_activation_checkpointing() {
    use burn_autodiff::checkpoint::strategy::BalancedCheckpointing;
    check_block_equivalence::<Autodiff<NdArray<f32>, BalancedCheckpointing>>(Case::new(4, 8, 2), TOLERANCE);
}

/// Packed documents (3 and 4 per sequence, boundaries on shard edges and inside shards) equal
/// the same documents run one by one on one device, output and every gradient.
#[test]
fn packed_documents_on_one_two_and_four_ranks() {
    for sp in [1, 2, 4] {
        check(Case::packed(sp, 8, 2));
    }
}

#[test]
fn packed_documents_non_causal_on_two_ranks() {
    check(Case { causal: false, ..Case::packed(2, 4, 2) });
}

/// Uneven heads: the degree divides neither the q nor the kv heads; ranks get unequal head
/// counts through an uneven all-to-all and every q head still meets its own kv head.
#[test]
fn uneven_heads_fourteen_on_four_ranks() {
    check(Case::new(4, 14, 14));
    check(Case::new(4, 14, 7));
}

#[test]
fn uneven_heads_six_on_four_ranks_with_three_and_two_kv_heads() {
    check(Case::new(4, 6, 6));
    check(Case::new(4, 6, 3));
    check(Case::new(4, 6, 2));
}

#[test]
fn uneven_heads_on_two_and_three_ranks() {
    check(Case::new(2, 3, 3));
    check(Case::new(2, 12, 3));
    check(Case::new(3, 8, 2));
    check(Case { causal: false, ..Case::packed(3, 4, 2) });
}

/// Uneven heads under Ulysses × Ring: 6 heads over a Ulysses degree of 4, rings of 2.
#[test]
fn uneven_heads_with_a_ring() {
    check(Case { ring: 2, ..Case::new(8, 6, 3) });
}

/// Ulysses × Ring: `sp` ranks as Ulysses groups of `sp / ring` consecutive ranks, rings
/// across them; the block equals one device, causal and not, GQA and MQA.
fn hybrid(ulysses: usize, ring: usize, kv_heads: usize, causal: bool) -> Case {
    Case { ring, causal, ..Case::new(ulysses * ring, 8, kv_heads) }
}

#[test]
fn ulysses_by_ring_one_by_four_is_a_pure_ring() {
    check(hybrid(1, 4, 2, true));
    check(hybrid(1, 4, 2, false));
}

#[test]
fn ulysses_by_ring_two_by_two_and_two_by_four() {
    check(hybrid(2, 2, 2, true));
    check(hybrid(2, 2, 1, false));
    check(hybrid(2, 4, 2, true));
}

#[test]
fn ulysses_by_ring_four_by_two_on_eight_ranks() {
    check(hybrid(4, 2, 2, true));
    check(hybrid(4, 2, 1, true));
    check(hybrid(4, 2, 8, false));
}

/// Zigzag sharding: ring rank r holds chunks r and 2R − 1 − r of the sequence (each split
/// over its Ulysses group), positions stay global, causal and not.
#[test]
fn ulysses_by_ring_with_zigzag_sharding() {
    use burn_ulysses::ring::RingSharding;
    let zigzag = |ulysses, ring, kv_heads, causal| Case { ring_sharding: RingSharding::Zigzag, ..hybrid(ulysses, ring, kv_heads, causal) };
    check(zigzag(1, 4, 2, true));
    check(zigzag(2, 2, 2, true));
    check(zigzag(2, 2, 1, false));
}

/// A causal ring of three (odd: the middle rank's chunks pair with both ends'), contiguous
/// and zigzag (chunks r and 5 − r of six).
#[test]
fn a_causal_ring_of_three() {
    use burn_ulysses::ring::RingSharding;
    check(Case { seq: 24, ..hybrid(1, 3, 2, true) });
    check(Case { seq: 24, ring_sharding: RingSharding::Zigzag, ..hybrid(1, 3, 2, true) });
}

/// Zigzag over 8 ranks: 32 tokens cut in 2 · 4 (or 2 · 2) chunks, each split over its
/// Ulysses group.
#[test]
fn ulysses_by_ring_with_zigzag_sharding_on_eight_ranks() {
    use burn_ulysses::ring::RingSharding;
    let zigzag = |ulysses, ring, kv_heads, causal| Case { ring_sharding: RingSharding::Zigzag, seq: 32, ..hybrid(ulysses, ring, kv_heads, causal) };
    check(zigzag(2, 4, 2, true));
    check(zigzag(4, 2, 1, true));
    check(zigzag(4, 2, 2, false));
}
