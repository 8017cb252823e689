//! `burn::tensor::module::attention` called directly under `UlyssesBackend`: key-padding
//! masks gathered across ranks, and the bytes each rank sends per call.

use std::time::Duration;

use burn::{
    backend::{Autodiff, NdArray},
    tensor::{
        Bool, Tensor, TensorData,
        backend::{AutodiffBackend, Backend},
        module::attention,
        ops::AttentionModuleOptions,
    },
};
use burn_ulysses::{
    UlyssesBackend,
    attention::repeat_kv_heads,
    comm::{Communicator, ThreadGroup},
    layout::{AttentionLayout, HeadPlan, MaskKind},
};
use ulysses_suite::{max_abs_diff, shard, uniform_tensor, values, with_deadline};

type Inner = NdArray<f32>;
type Reference = Autodiff<Inner>;
type Sp = UlyssesBackend<Autodiff<Inner>>;

const TOLERANCE: f32 = 1e-5;
const CAUSAL: AttentionModuleOptions = AttentionModuleOptions { scale: None, softcap: None, is_causal: true };

/// q `[batch, heads, seq, dim]`, k and v with `kv_heads`, and the loss weights.
fn qkvw<B: Backend>([b, h, s, d]: [usize; 4], kv_heads: usize, device: &B::Device) -> [Tensor<B, 4>; 4] {
    [(1, h), (2, kv_heads), (3, kv_heads), (4, h)].map(|(stream, heads)| uniform_tensor([b, heads, s, d], stream, device))
}

/// Key-padding mask `[batch, mask_heads, 1, seq]`: true masks the key. Batch 0 masks key 5
/// (and per head, key 2·h), batch 1 masks its last three keys (right padding).
fn padding_mask<B: Backend>(batch: usize, mask_heads: usize, seq: usize, device: &B::Device) -> Tensor<B, 4, Bool> {
    let mut masked = Vec::new();
    for b in 0..batch {
        for h in 0..mask_heads {
            for s in 0..seq {
                masked.push(if b == 0 { s == 5 || (mask_heads > 1 && s == 2 * h) } else { s >= seq - 3 });
            }
        }
    }
    Tensor::from_data(TensorData::new(masked, [batch, mask_heads, 1, seq]), device)
}

struct Grads {
    output: Vec<f32>,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

/// Attention and its gradients; `expand_kv` expands grouped kv heads first (burn's own
/// attention needs that; UlyssesBackend takes them grouped).
fn attend<B: AutodiffBackend>(
    [q, k, v, w]: [Tensor<B, 4>; 4],
    mask: Option<Tensor<B, 4, Bool>>,
    expand_kv: bool,
    options: AttentionModuleOptions,
) -> Grads {
    let (q, k, v) = (q.require_grad(), k.require_grad(), v.require_grad());
    let group = if expand_kv { q.dims()[1] / k.dims()[1] } else { 1 };
    let (k_used, v_used) = (repeat_kv_heads(k.clone(), group), repeat_kv_heads(v.clone(), group));
    let output = attention(q.clone(), k_used, v_used, mask, None, options);
    let grads = (output.clone() * w).sum().backward();
    Grads {
        output: values(output),
        dq: values(q.grad(&grads).unwrap()),
        dk: values(k.grad(&grads).unwrap()),
        dv: values(v.grad(&grads).unwrap()),
    }
}

fn key_padding_mask_matches_single_device(sp: usize, mask_heads: usize, kv_heads: usize) {
    key_padding_mask_case(sp, 4, mask_heads, kv_heads, None, CAUSAL);
}

/// A key-padding mask against one device: the batch's rows, or where `every_row` is
/// `Some(row)`, that row's alone as every row's (`[1, ..]`, broadcast over the batch).
fn key_padding_mask_case(sp: usize, heads: usize, mask_heads: usize, kv_heads: usize, every_row: Option<usize>, options: AttentionModuleOptions) {
    let shape @ [batch, heads, seq, dim] = [2, heads, 16, 8];
    let device = Default::default();
    // Burn's attention takes the mask at full score shape.
    let mask_of = |mask: Tensor<_, 4, Bool>| match every_row {
        Some(row) => mask.narrow(0, row, 1),
        None => mask,
    };
    let full_mask = mask_of(padding_mask::<Reference>(batch, mask_heads, seq, &device)).expand([batch, heads, seq, seq]);
    let reference = attend(qkvw::<Reference>(shape, kv_heads, &device), Some(full_mask), true, options);
    let reference_shard = |values: &[f32], rank: usize, heads: usize| {
        let t = Tensor::<Inner, 4>::from_data(TensorData::new(values.to_vec(), [batch, heads, seq, dim]), &device);
        ulysses_suite::values(shard(t, 2, rank, sp))
    };

    let per_rank = with_deadline(Duration::from_secs(50), move || {
        ThreadGroup::new(sp).run(|rank| {
            let _sp = Sp::enter_thread(rank.communicator());
            let device = Default::default();
            let (r, p) = (rank.rank(), rank.size());
            let tensors = qkvw::<Sp>(shape, kv_heads, &device).map(|t| shard(t, 2, r, p));
            let mask = padding_mask::<Sp>(batch, mask_heads, seq, &device);
            let mask = shard(every_row.map_or(mask.clone(), |row| mask.narrow(0, row, 1)), 3, r, p);
            attend(tensors, Some(mask), false, options)
        })
    });
    let mut worst = 0.0f32;
    for (r, grads) in per_rank.into_iter().enumerate() {
        let grads = grads.unwrap();
        for (name, got, want, heads) in [
            ("output", &grads.output, &reference.output, heads),
            ("dq", &grads.dq, &reference.dq, heads),
            ("dk", &grads.dk, &reference.dk, kv_heads),
            ("dv", &grads.dv, &reference.dv, kv_heads),
        ] {
            let diff = max_abs_diff(got, &reference_shard(want, r, heads));
            assert!(diff <= TOLERANCE, "sp={sp}: {name} of rank {r} differs by {diff:e}");
            worst = worst.max(diff);
        }
    }
    println!(
        "key-padding mask [{}, {mask_heads}, 1, s/p], {heads} q / {kv_heads} kv heads, sp={sp}: \
         max |Δ| over output, dq, dk, dv {worst:.2e}",
        every_row.map_or(batch.to_string(), |row| format!("1 (row {row}'s)"))
    );
}

/// A softcap and a scale of one's own, without causality, with key padding, at SP = 2 and 4
/// (grouped kv heads): one device's output and gradients. Each exchange carries the options
/// to the whole sequence's attention.
#[test]
fn a_softcap_and_a_scale_without_causality_match_one_device() {
    let options = AttentionModuleOptions { scale: Some(0.3), softcap: Some(5.0), is_causal: false };
    key_padding_mask_case(2, 4, 1, 2, None, options);
    key_padding_mask_case(4, 4, 4, 4, None, options);
}

/// Uneven heads (6 on 4 ranks: 2, 2, 1, 1) with a mask per head: each rank gathers the
/// mask rows of its own heads.
#[test]
fn per_head_key_padding_mask_with_uneven_heads() {
    key_padding_mask_case(4, 6, 6, 3, None, CAUSAL);
}

/// A mask of batch 1, broadcast over the batch (as burn's attention broadcasts it): every
/// row's, one and one per head; a hole (a dense mask) and right padding (one run of keys).
#[test]
fn a_key_padding_mask_of_batch_1_is_every_rows() {
    key_padding_mask_case(2, 4, 1, 2, Some(0), CAUSAL);
    key_padding_mask_case(4, 4, 4, 4, Some(0), CAUSAL);
    key_padding_mask_case(2, 4, 1, 2, Some(1), CAUSAL);
    key_padding_mask_case(4, 4, 4, 4, Some(1), CAUSAL);
}

/// Cross-attention over a memory sharded as the queries are (each rank its contiguous part of
/// it), with heads the degree does not divide (6 q heads, 3 kv heads on 4 ranks: the uneven
/// exchange) and more memory than queries: output and every gradient as one device computes
/// them. The uneven exchange once sized the keys' parts by the queries' length.
#[test]
fn cross_attention_over_a_longer_sharded_memory_with_uneven_heads() {
    let (sp, batch, heads, kv_heads, queries, keys, dim) = (4, 2, 6, 3, 16, 24, 8);
    const NOT_CAUSAL: AttentionModuleOptions = AttentionModuleOptions { scale: None, softcap: None, is_causal: false };
    let tensors = |device| -> [Tensor<Reference, 4>; 4] {
        [(1, heads, queries), (2, kv_heads, keys), (3, kv_heads, keys), (4, heads, queries)].map(|(stream, h, s)| uniform_tensor([batch, h, s, dim], stream, device))
    };
    let attend_cross = |[q, k, v, w]: [Tensor<Reference, 4>; 4], group: usize| {
        let (q, k, v) = (q.require_grad(), k.require_grad(), v.require_grad());
        let output = attention(q.clone(), repeat_kv_heads(k.clone(), group), repeat_kv_heads(v.clone(), group), None, None, NOT_CAUSAL);
        let grads = (output.clone() * w).sum().backward();
        [values(output), values(q.grad(&grads).unwrap()), values(k.grad(&grads).unwrap()), values(v.grad(&grads).unwrap())]
    };
    let device = Default::default();
    let reference = attend_cross(tensors(&device), heads / kv_heads);
    let per_rank = with_deadline(Duration::from_secs(50), move || {
        ThreadGroup::new(sp).run(|rank| {
            let _sp = Sp::enter_thread(rank.communicator());
            let device = Default::default();
            let (r, p) = (rank.rank(), rank.size());
            let [q, k, v, w] = [(1, heads, queries), (2, kv_heads, keys), (3, kv_heads, keys), (4, heads, queries)]
                .map(|(stream, h, s)| shard(uniform_tensor::<Sp, 4>([batch, h, s, dim], stream, &device), 2, r, p));
            let (q, k, v) = (q.require_grad(), k.require_grad(), v.require_grad());
            let output = attention(q.clone(), k.clone(), v.clone(), None, None, NOT_CAUSAL);
            let grads = (output.clone() * w).sum().backward();
            [values(output), values(q.grad(&grads).unwrap()), values(k.grad(&grads).unwrap()), values(v.grad(&grads).unwrap())]
        })
    });
    let shard_of = |values: &[f32], h: usize, s: usize, rank: usize| {
        ulysses_suite::values(shard(Tensor::<Inner, 4>::from_data(TensorData::new(values.to_vec(), [batch, h, s, dim]), &device), 2, rank, sp))
    };
    let mut worst = 0.0f32;
    for (r, got) in per_rank.into_iter().enumerate() {
        let got = got.unwrap_or_else(|p| panic!("rank {r}: {p}"));
        for ((name, got), (want, h, s)) in ["output", "dq", "dk", "dv"].iter().zip(&got).zip([(0, heads, queries), (1, heads, queries), (2, kv_heads, keys), (3, kv_heads, keys)]) {
            let diff = max_abs_diff(got, &shard_of(&reference[want], h, s, r));
            assert!(diff <= TOLERANCE, "rank {r}: {name} differs by {diff:e}");
            worst = worst.max(diff);
        }
    }
    println!("cross-attention, {queries} queries over {keys} keys, {heads} q / {kv_heads} kv heads on {sp} ranks: max |Δ| {worst:.2e}");
}

#[test]
fn key_padding_mask_over_two_ranks() {
    key_padding_mask_matches_single_device(2, 1, 4);
}

#[test]
fn key_padding_mask_over_four_ranks_with_one_kv_head() {
    key_padding_mask_matches_single_device(4, 1, 1);
}

#[test]
fn per_head_key_padding_mask_over_two_ranks() {
    key_padding_mask_matches_single_device(2, 4, 4);
}

#[test]
fn per_head_key_padding_mask_over_four_ranks_with_grouped_kv_heads() {
    key_padding_mask_matches_single_device(4, 4, 2);
}

/// Bytes one rank hands to all-to-alls in one attention call, forward and backward; every
/// rank hands the same.
fn traffic_of_one_call(sp: usize, shape: [usize; 4], kv_heads: usize) -> (u64, u64, u64, u64) {
    let per_rank = traffic_per_rank(sp, shape, kv_heads);
    assert!(per_rank.iter().all(|r| r == &per_rank[0]), "ranks sent different volumes: {per_rank:?}");
    per_rank[0]
}

/// Per rank: bytes handed to all-to-alls in one attention call (forward), of them remote,
/// all-to-all calls, bytes forward and backward.
fn traffic_per_rank(sp: usize, [batch, heads, seq, dim]: [usize; 4], kv_heads: usize) -> Vec<(u64, u64, u64, u64)> {
    let per_rank = with_deadline(Duration::from_secs(50), move || ThreadGroup::new(sp).run(|rank| {
        let comm = rank.communicator();
        let _sp = Sp::enter_thread(comm.clone());
        let device = Default::default();
        let (r, p) = (rank.rank(), rank.size());
        let local = |shape, stream| shard(uniform_tensor::<Sp, 4>(shape, stream, &device), 2, r, p).require_grad();
        let q = local([batch, heads, seq, dim], 1);
        let k = local([batch, kv_heads, seq, dim], 2);
        let v = local([batch, kv_heads, seq, dim], 3);
        let traffic = || Communicator::<Inner>::traffic(&*comm);
        let before = traffic();
        let output = attention(q, k, v, None, None, CAUSAL);
        let forward = traffic().since(&before);
        let _grads = output.sum().backward();
        let total = traffic().since(&before);
        (forward.all_to_all_bytes, forward.all_to_all_remote_bytes, forward.all_to_all_calls, total.all_to_all_bytes)
    }));
    per_rank.into_iter().enumerate().map(|(r, bytes)| bytes.unwrap_or_else(|panic| panic!("rank {r}: {panic}"))).collect()
}

#[test]
fn each_rank_sends_4_bsdh_over_p_bytes_per_call() {
    let (sp, batch, heads, seq, dim) = (4u64, 2u64, 8u64, 32u64, 16u64);
    let f32_bytes = 4;
    let (sent, remote, calls, with_backward) =
        traffic_of_one_call(sp as usize, [2, 8, 32, 16], heads as usize);
    let formula = 4 * batch * seq * heads * dim / sp * f32_bytes;
    println!("no GQA, P={sp}: {sent} bytes per rank per call, formula 4·B·S·H·D/P·4 = {formula}");
    assert_eq!(sent, formula);
    assert_eq!(remote, formula / sp * (sp - 1), "the slice a rank keeps is not remote traffic");
    assert_eq!(calls, 2, "q, k and v travel in one all-to-all, the output in another");
    assert_eq!(with_backward, 2 * formula, "the backward pass exchanges the same volume");
}

#[test]
fn grouped_kv_heads_send_fewer_bytes() {
    // 2 kv heads over 4 ranks: each is replicated onto 2 ranks, so 4 kv heads travel.
    let (sp, batch, heads, seq, dim) = (4u64, 2u64, 8u64, 32u64, 16u64);
    let exchanged_kv_heads = 4;
    let (sent, _, _, _) = traffic_of_one_call(sp as usize, [2, 8, 32, 16], 2);
    let formula = (2 * heads + 2 * exchanged_kv_heads) * batch * (seq / sp) * dim * 4;
    println!("GQA 8q/2kv, P={sp}: {sent} bytes per rank per call, formula (2H+2H_kv')·B·S/P·D·4 = {formula}");
    assert_eq!(sent, formula);
    let (without_grouping, _, _, _) = traffic_of_one_call(sp as usize, [2, 8, 32, 16], 8);
    assert_eq!(sent * 4, without_grouping * 3, "grouped kv heads (4 of 8 travel) send 3/4 of the bytes");
    // The library's own accounting agrees.
    let layout = AttentionLayout {
        batch: 2, q_heads: 8, kv_heads: 2, q_seq: 8, kv_seq: 8, head_dim: 16, value_dim: 16,
        is_causal: true, scale: None, softcap: None, mask: MaskKind::None, has_bias: false, has_documents: false, window: None, dtype: 0,
    };
    let plan = HeadPlan::new(8, 2, 4).unwrap();
    assert_eq!(plan.elements_per_call(0, &layout) as u64 * 4, sent);
}

/// 6 heads on 4 ranks: ranks attend over 2, 2, 1 and 1 heads and the uneven all-to-all
/// moves exactly those (no padding heads): per rank `B·(S/P)·(H·D + Σkv·2D) + B·h_r·S·D`
/// elements, over all ranks `4·B·S·H·D`, as if the degree divided the heads.
#[test]
fn uneven_heads_move_no_padding() {
    let (sp, batch, heads, seq, dim) = (4usize, 2usize, 6usize, 32usize, 16usize);
    let per_rank = traffic_per_rank(sp, [batch, heads, seq, dim], heads);
    let plan = HeadPlan::new(heads, heads, sp).unwrap();
    let layout = AttentionLayout {
        batch, q_heads: heads, kv_heads: heads, q_seq: seq / sp, kv_seq: seq / sp, head_dim: dim, value_dim: dim,
        is_causal: true, scale: None, softcap: None, mask: MaskKind::None, has_bias: false, has_documents: false, window: None, dtype: 0,
    };
    for (rank, &(sent, _, calls, with_backward)) in per_rank.iter().enumerate() {
        let local_heads = plan.q_heads_of(rank).len();
        let formula = (batch * (seq / sp) * (heads * dim + heads * 2 * dim) + batch * local_heads * seq * dim) * 4;
        // The backward sends back what the forward received: this rank's heads of q, k, v
        // over the whole sequence, and every rank's heads of the output for its tokens.
        let local_kv = plan.kv_heads_of(rank).len();
        let backward = (batch * seq * (local_heads * dim + local_kv * 2 * dim) + batch * (seq / sp) * heads * dim) * 4;
        println!("6 heads on P={sp}, rank {rank} ({local_heads} heads): {sent} bytes, formula {formula}; backward {} formula {backward}", with_backward - sent);
        assert_eq!((sent, calls, with_backward), (formula as u64, 2, (formula + backward) as u64), "rank {rank}");
        assert_eq!(plan.elements_per_call(rank, &layout) * 4, formula, "rank {rank}: the plan's own count");
    }
    let total: u64 = per_rank.iter().map(|r| r.0).sum();
    let unpadded = (4 * batch * seq * heads * dim * 4) as u64;
    let padded = (4 * batch * seq * 8 * dim * 4) as u64;
    println!("all ranks: {total} bytes; 6 heads unpadded {unpadded}, padded to 8 {padded}");
    assert_eq!(total, unpadded);
    assert_eq!(per_rank.iter().map(|r| r.3).sum::<u64>(), 2 * unpadded, "the backward moves as much again over all ranks");
}

/// Ulysses × Ring, 2 × 2: per rank and attention call, the Ulysses all-to-alls move
/// `4·B·(S/P)·H·D` (the same as Ulysses over `P` ranks would), and the ring passes
/// `(R − 1)` blocks of k and v for this rank's `H/U` heads over `S/R` tokens; the backward
/// moves as much again.
#[test]
fn ulysses_by_ring_bytes_per_rank_match_their_formula() {
    use burn_ulysses::{ParallelGroups, ParallelLayout, RankScope, UlyssesConfig};
    let (ulysses, ring, batch, heads, seq, dim) = (2usize, 2usize, 2usize, 8usize, 32usize, 16usize);
    let sp = ulysses * ring;
    let per_rank = with_deadline(Duration::from_secs(50), move || {
        ThreadGroup::new(sp).run(move |rank| {
            let layout = ParallelLayout::new().with_sp_size(sp).with_ring_size(ring);
            let groups = ParallelGroups::<Inner>::new(rank.communicator(), layout).unwrap();
            let _context = burn_ulysses::context::enter(RankScope::Thread, groups.rank_context(UlyssesConfig::new()));
            let device = Default::default();
            let r = rank.rank();
            let local = |stream| shard(uniform_tensor::<Sp, 4>([batch, heads, seq, dim], stream, &device), 2, r, sp).require_grad();
            let ring_group = groups.ring.clone().unwrap();
            let traffic = || (Communicator::<Inner>::traffic(&*groups.ulysses).all_to_all_bytes, Communicator::<Inner>::traffic(&*ring_group).send_recv_bytes);
            let before = traffic();
            let output = attention(local(1), local(2), local(3), None, None, CAUSAL);
            let forward = traffic();
            let _grads = output.sum().backward();
            let total = traffic();
            [forward.0 - before.0, forward.1 - before.1, total.0 - before.0, total.1 - before.1]
        })
    });
    let all_to_all = 4 * batch * (seq / sp) * heads * dim * 4;
    let passes = (ring - 1) * batch * (heads / ulysses) * (seq / ring) * (2 * dim) * 4;
    for (r, bytes) in per_rank.into_iter().enumerate() {
        let bytes = bytes.unwrap_or_else(|panic| panic!("rank {r}: {panic}"));
        println!("2 x 2, rank {r}: all-to-all {} bytes (formula {all_to_all}), ring {} bytes (formula {passes}); with the backward {} and {}", bytes[0], bytes[1], bytes[2], bytes[3]);
        assert_eq!(bytes.map(|b| b as usize), [all_to_all, passes, 2 * all_to_all, 2 * passes], "rank {r}");
    }
}

/// What a padded training step's check counts (`attention::calls_seeing_every_key`):
/// self-attention that sees every key (not causal, no mask), not cross-attention to keys of
/// another length (latents, a memory), nor causal or masked self-attention.
#[test]
fn calls_seeing_every_key_count_unmasked_self_attention_alone() {
    use burn_ulysses::attention::calls_seeing_every_key;
    let device = Default::default();
    let [q, k] = [(4, 1), (6, 2)].map(|(seq, stream)| uniform_tensor::<Sp, 4>([1, 2, seq, 8], stream, &device));
    let both_ways = AttentionModuleOptions { is_causal: false, ..Default::default() };
    let counted = |call: &dyn Fn()| {
        let before = calls_seeing_every_key();
        call();
        calls_seeing_every_key() - before
    };
    assert_eq!(counted(&|| drop(attention(q.clone(), q.clone(), q.clone(), None, None, both_ways))), 1, "self-attention both ways");
    assert_eq!(counted(&|| drop(attention(q.clone(), k.clone(), k.clone(), None, None, both_ways))), 0, "cross-attention to 6 keys");
    let causal = AttentionModuleOptions { is_causal: true, ..Default::default() };
    assert_eq!(counted(&|| drop(attention(q.clone(), q.clone(), q.clone(), None, None, causal))), 0, "causal self-attention");
    let mask = Tensor::<Sp, 4, Bool>::from_data(TensorData::new(vec![false; 4], [1, 1, 1, 4]), &device);
    assert_eq!(counted(&|| drop(attention(q.clone(), q.clone(), q.clone(), Some(mask.clone()), None, both_ways))), 0, "masked self-attention");
}
