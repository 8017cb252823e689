//! burn-ulysses-ops's attention at SP = 2, 3 and 4 (ranks as threads, Flex + autodiff, or wgpu
//! with `--features wgpu` and `ULYSSES_022_DEVICE=wgpu`) against
//! a naive f64 attention and its gradients: causal and not, grouped kv heads (split and
//! replicated), uneven heads. The exchange's backward against the inverse exchange, and bad
//! layouts refused on every rank with ulysses-core's message (the one burn-ulysses gives).

use burn::tensor::{Tensor, TensorData, ops::AttentionModuleOptions};
use burn_ulysses_ops::{
    attention,
    blocked::{BlockedOptions, attention_in_blocks},
    comm::ThreadGroup,
    context,
    error::UlyssesError,
    exchange::{Direction, HeadExchange, exchange},
};

#[path = "../examples/model/device.rs"]
mod device;
#[path = "../examples/model/values.rs"]
mod values;

use device::plain_device;

use values::uniform;

/// f32 against the f64 reference, as burn-ulysses' SP tests.
const TOLERANCE: f64 = 1e-5;

/// `values` `[b, h, s, d]` (row-major), tokens `range` of every head.
fn tokens(values: &[f32], [b, h, s, d]: [usize; 4], range: std::ops::Range<usize>) -> Vec<f32> {
    let mut out = Vec::new();
    for bh in 0..b * h {
        out.extend_from_slice(&values[(bh * s + range.start) * d..(bh * s + range.end) * d]);
    }
    out
}

/// Shards `[b, h, s/P, d]` of every rank put back together as `[b, h, s, d]`.
fn unshard(shards: &[Vec<f32>], [b, h, s, d]: [usize; 4]) -> Vec<f32> {
    let local = s / shards.len();
    let mut out = vec![0.0; b * h * s * d];
    for (rank, shard) in shards.iter().enumerate() {
        for bh in 0..b * h {
            let dst = (bh * s + rank * local) * d;
            out[dst..dst + local * d].copy_from_slice(&shard[bh * local * d..(bh + 1) * local * d]);
        }
    }
    out
}

/// Naive f64 attention of q `[b, hq, s, d]`, k/v `[b, hkv, s, d]` (q head i uses kv head
/// i / (hq / hkv)) and its gradients for the loss `sum(output * w)`: (output, dq, dk, dv).
fn reference(q: &[f32], k: &[f32], v: &[f32], w: &[f32], [b, hq, s, d]: [usize; 4], hkv: usize, causal: bool) -> [Vec<f64>; 4] {
    reference_masked(q, k, v, w, [b, hq, s, d], hkv, causal, &|_, _, _| false, None)
}

/// [`reference`] with keys hidden by `hidden(batch, q head, key)` (a row that sees no key
/// gives zeros, burn's convention) and the scaled scores `x` capped to `c · tanh(x / c)` by a
/// softcap `c`.
#[allow(clippy::too_many_arguments)]
fn reference_masked(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    w: &[f32],
    [b, hq, s, d]: [usize; 4],
    hkv: usize,
    causal: bool,
    hidden: &dyn Fn(usize, usize, usize) -> bool,
    softcap: Option<f64>,
) -> [Vec<f64>; 4] {
    let at = |t: &[f32], heads: usize, bi: usize, h: usize, i: usize, x: usize| t[((bi * heads + h) * s + i) * d + x] as f64;
    let scale = 1.0 / (d as f64).sqrt();
    let (mut out, mut dq) = (vec![0.0; b * hq * s * d], vec![0.0; b * hq * s * d]);
    let (mut dk, mut dv) = (vec![0.0; b * hkv * s * d], vec![0.0; b * hkv * s * d]);
    for bi in 0..b {
        for h in 0..hq {
            let kv = h / (hq / hkv);
            for i in 0..s {
                let visible: Vec<usize> = (0..if causal { i + 1 } else { s }).filter(|&j| !hidden(bi, h, j)).collect();
                if visible.is_empty() {
                    continue;
                }
                let raw: Vec<f64> = visible.iter().map(|&j| (0..d).map(|x| at(q, hq, bi, h, i, x) * at(k, hkv, bi, kv, j, x)).sum::<f64>() * scale).collect();
                // d(score)/d(raw): 1, or 1 - tanh² under the cap.
                let (scores, slope): (Vec<f64>, Vec<f64>) = match softcap {
                    None => (raw.clone(), vec![1.0; raw.len()]),
                    Some(c) => raw.iter().map(|&x| ((x / c).tanh() * c, 1.0 - (x / c).tanh().powi(2))).unzip(),
                };
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let exps: Vec<f64> = scores.iter().map(|&x| (x - max).exp()).collect();
                let total: f64 = exps.iter().sum();
                let p: Vec<f64> = exps.iter().map(|e| e / total).collect();
                let o = |x: usize| visible.iter().enumerate().map(|(n, &j)| p[n] * at(v, hkv, bi, kv, j, x)).sum::<f64>();
                let row = ((bi * hq + h) * s + i) * d;
                for x in 0..d {
                    out[row + x] = o(x);
                }
                // dP_j = w_i · v_j; dS_j = p_j (dP_j - Σ p dP).
                let dp: Vec<f64> = visible.iter().map(|&j| (0..d).map(|x| at(w, hq, bi, h, i, x) * at(v, hkv, bi, kv, j, x)).sum()).collect();
                let mean: f64 = (0..visible.len()).map(|n| p[n] * dp[n]).sum();
                for (n, &j) in visible.iter().enumerate() {
                    let ds = p[n] * (dp[n] - mean) * slope[n] * scale;
                    let kv_row = ((bi * hkv + kv) * s + j) * d;
                    for x in 0..d {
                        dq[row + x] += ds * at(k, hkv, bi, kv, j, x);
                        dk[kv_row + x] += ds * at(q, hq, bi, h, i, x);
                        dv[kv_row + x] += p[n] * at(w, hq, bi, h, i, x);
                    }
                }
            }
        }
    }
    [out, dq, dk, dv]
}

fn assert_close(what: &str, got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: {} values, the reference has {}", got.len(), want.len());
    let mut worst = 0.0f64;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let error = (g as f64 - w).abs();
        // NaN compares false: a non-finite value fails here rather than vanishing in a max.
        assert!(error <= TOLERANCE, "{what}: element {i} is {g}, the f64 reference {w} (error {error:e}, tolerance {TOLERANCE:e})");
        worst = worst.max(error);
    }
    eprintln!("{what}: largest error {worst:.2e}");
}

fn values(tensor: Tensor<4>) -> Vec<f32> {
    tensor.into_data().try_to_vec::<f32>().unwrap()
}

/// Every rank holds `s / sp` tokens of q, k, v and the loss weights w; returns the
/// gathered output, dq, dk and dv.
fn sequence_parallel(sp: usize, shape: [usize; 4], kv_heads: usize, causal: bool) -> [Vec<f32>; 4] {
    sequence_parallel_masked(sp, shape, kv_heads, causal, None, None)
}

/// Key-padding mask `[batch, mask_heads, 1, seq]`, true hiding the key: batch 0 hides key 5
/// (and per head key 2·h), batch 1 its first two and last three keys (padding on both sides:
/// under `is_causal` its first two queries see no key at all, and give zeros).
fn hidden_key(mask_heads: usize, seq: usize) -> impl Fn(usize, usize, usize) -> bool {
    move |b, h, j| if b == 0 { j == 5 || (mask_heads > 1 && j == 2 * h) } else { j < 2 || j >= seq - 3 }
}

/// [`sequence_parallel`] with that key-padding mask (`[mask batch, mask heads]`: the batch's
/// rows or 1, every row's; 1 head or q heads), each rank passing its keys' part.
fn sequence_parallel_masked(sp: usize, shape: [usize; 4], kv_heads: usize, causal: bool, mask: Option<[usize; 2]>, softcap: Option<f64>) -> [Vec<f32>; 4] {
    let [b, hq, s, d] = shape;
    let kv_shape = [b, kv_heads, s, d];
    let (q, k, v, w) = (uniform(b * hq * s * d, 1), uniform(b * kv_heads * s * d, 2), uniform(b * kv_heads * s * d, 3), uniform(b * hq * s * d, 4));
    let local = s / sp;
    let results = ThreadGroup::new(sp).run(|rank| {
        let _sp = context::enter(rank.communicator());
        let device = plain_device().autodiff();
        let range = rank.rank() * local..(rank.rank() + 1) * local;
        let shard = |values: &[f32], [b, h, s, d]: [usize; 4]| {
            Tensor::<4>::from_data(TensorData::new(tokens(values, [b, h, s, d], range.clone()), [b, h, local, d]), &device)
        };
        let (q, k, v) = (shard(&q, shape).require_grad(), shard(&k, kv_shape).require_grad(), shard(&v, kv_shape).require_grad());
        let options = AttentionModuleOptions { is_causal: causal, softcap, ..Default::default() };
        let mask = mask.map(|[mask_batch, heads]| {
            let hidden = hidden_key(heads, s);
            let mut values = Vec::new();
            for bi in 0..mask_batch {
                for h in 0..heads {
                    values.extend(range.clone().map(|j| hidden(bi, h, j)));
                }
            }
            Tensor::<4, burn::tensor::Bool>::from_data(TensorData::new(values, [mask_batch, heads, 1, local]), &device)
        });
        let output = attention(q.clone(), k.clone(), v.clone(), mask, None, options);
        let grads = (output.clone() * shard(&w, shape)).sum().backward();
        [values(output), values(q.grad(&grads).unwrap()), values(k.grad(&grads).unwrap()), values(v.grad(&grads).unwrap())]
    });
    let shards: Vec<[Vec<f32>; 4]> = results.into_iter().map(|r| r.unwrap_or_else(|panic| panic!("{panic}"))).collect();
    let gather = |i: usize, shape| unshard(&shards.iter().map(|s| s[i].clone()).collect::<Vec<_>>(), shape);
    let hidden = hidden_key(mask.map_or(1, |[_, heads]| heads), s);
    let reference = match mask {
        None => reference_masked(&q, &k, &v, &w, shape, kv_heads, causal, &|_, _, _| false, softcap),
        Some([mask_batch, heads]) => reference_masked(
            &q,
            &k,
            &v,
            &w,
            shape,
            kv_heads,
            causal,
            &|bi, h, j| hidden(if mask_batch == 1 { 0 } else { bi }, if heads == 1 { 0 } else { h }, j),
            softcap,
        ),
    };
    let case = format!("SP={sp}, {hq} q heads, {kv_heads} kv heads, causal {causal}, mask [batch, heads] {mask:?}, softcap {softcap:?}");
    let got = [gather(0, shape), gather(1, shape), gather(2, kv_shape), gather(3, kv_shape)];
    for ((name, got), want) in ["output", "dq", "dk", "dv"].iter().zip(&got).zip(&reference) {
        assert_close(&format!("{case}: {name}"), got, want);
    }
    got
}

#[test]
fn sp_2_equals_the_f64_reference_causal_and_not() {
    for causal in [true, false] {
        sequence_parallel(2, [2, 4, 16, 8], 4, causal);
    }
}

#[test]
fn sp_2_without_autodiff_equals_the_f64_reference() {
    // Inference: the exchange and the blocked attention on plain Flex tensors.
    let shape = [1, 4, 12, 8];
    let len = shape.iter().product();
    let (q, k, v) = (uniform(len, 41), uniform(len, 42), uniform(len, 43));
    let results = ThreadGroup::new(2).run(|rank| {
        let _sp = context::enter(rank.communicator());
        let device = plain_device();
        let range = rank.rank() * 6..(rank.rank() + 1) * 6;
        let shard = |values: &[f32]| Tensor::<4>::from_data(TensorData::new(tokens(values, shape, range.clone()), [1, 4, 6, 8]), &device);
        values(attention(shard(&q), shard(&k), shard(&v), None, None, AttentionModuleOptions { is_causal: true, ..Default::default() }))
    });
    let shards: Vec<Vec<f32>> = results.into_iter().map(|r| r.unwrap_or_else(|panic| panic!("{panic}"))).collect();
    let [output, ..] = reference(&q, &k, &v, &vec![0.0; len], shape, 4, true);
    assert_close("SP=2 without autodiff: output", &unshard(&shards, shape), &output);
}

#[test]
fn sp_4_with_grouped_kv_heads_split_and_replicated() {
    // 8 q heads over 4 kv heads (split: one kv head per rank) and over 2 (each sent to 2 ranks).
    sequence_parallel(4, [1, 8, 16, 8], 4, true);
    sequence_parallel(4, [1, 8, 16, 8], 2, true);
}

#[test]
fn sp_3_with_uneven_and_grouped_heads() {
    // 4 q heads on 3 ranks: 2, 1, 1. 6 q heads over 2 kv heads: 2 per rank, kv heads repeated.
    sequence_parallel(3, [1, 4, 12, 8], 4, true);
    sequence_parallel(3, [2, 6, 12, 8], 2, false);
    // 5 heads on 4 ranks: 2, 1, 1, 1.
    sequence_parallel(4, [1, 5, 8, 4], 5, true);
}

#[test]
fn key_padding_masks_are_gathered_along_the_keys() {
    // One mask for every head and one per head, at SP=2 and 4 (GQA), causal and not: as
    // burn-ulysses gathers them. The rank holding the last keys of batch 1 has them all hidden.
    // A mask of batch 1 is every row's (broadcast, as burn's attention takes it).
    for causal in [true, false] {
        sequence_parallel_masked(2, [2, 4, 12, 8], 4, causal, Some([2, 1]), None);
        sequence_parallel_masked(2, [2, 4, 12, 8], 2, causal, Some([2, 4]), None);
        sequence_parallel_masked(4, [2, 4, 12, 8], 2, causal, Some([2, 4]), None);
        sequence_parallel_masked(2, [2, 4, 12, 8], 2, causal, Some([1, 4]), None);
        // Masks of more than 64 keys a rank (80 keys, 640 bits a rank here), sent 64 keys a word.
        sequence_parallel_masked(2, [2, 4, 160, 8], 2, causal, Some([2, 4]), None);
    }
}

/// An exchange reads its parts from the device in one copy, and q, k and v go in one exchange:
/// a forward at SP 4 waits for the device twice (q, k and v; the output) and its backward twice
/// more, where q, k and v apart and a read a part of each exchange made it 16 and 32 (SP 4).
#[test]
fn an_attention_waits_for_the_device_once_an_exchange() {
    let results = ThreadGroup::new(4).run(|rank| {
        let _sp = context::enter(rank.communicator());
        let device = plain_device().autodiff();
        let shard = |heads: usize, seed| Tensor::<4>::from_data(TensorData::new(uniform(2 * heads * 4 * 8, seed), [2, heads, 4, 8]), &device).require_grad();
        let (q, k, v) = (shard(8, 1), shard(2, 2), shard(2, 3));
        let options = AttentionModuleOptions { is_causal: true, ..Default::default() };
        let call = || attention(q.clone(), k.clone(), v.clone(), None, None, options);
        // The layout's first call also reads its keys' first and last tokens (beside the shard?).
        drop(call());
        let before = burn_ulysses_ops::host::device_reads();
        let output = call();
        let forward = burn_ulysses_ops::host::device_reads() - before;
        let _grads = output.sum().backward();
        (forward, burn_ulysses_ops::host::device_reads() - before)
    });
    for (rank, reads) in results.into_iter().enumerate() {
        assert_eq!(reads.unwrap_or_else(|panic| panic!("{panic}")), (2, 4), "rank {rank}: reads in the forward, and with the backward");
    }
}

#[test]
fn the_exchange_backward_is_the_inverse_exchange() {
    // 3 kv heads over 2 ranks: ulysses-core replicates them (rank 0 gets [0, 0, 1], rank 1
    // [1, 2, 2]), so the inverse also sums the copies.
    let results = ThreadGroup::new(2).run(|rank| {
        let _sp = context::enter(rank.communicator());
        let heads = HeadExchange::new(&*context::current().unwrap(), 3, vec![vec![0, 0, 1], vec![1, 2, 2]]);
        let device = plain_device().autodiff();
        let x = Tensor::<4>::from_data(TensorData::new(uniform(2 * 3 * 4 * 5, 10 + rank.rank() as u64), [2, 3, 4, 5]), &device).require_grad();
        let heads_out = exchange(x.clone(), heads.clone(), Direction::ToHeads);
        assert_eq!(heads_out.dims(), [2, 3, 8, 5], "rank {}: three heads, both ranks' tokens", rank.rank());
        let g = Tensor::<4>::from_data(TensorData::new(uniform(2 * 3 * 8 * 5, 20 + rank.rank() as u64), [2, 3, 8, 5]), &device);
        let forward_dot = (heads_out.clone() * g.clone()).sum().into_scalar::<f64>();
        let grads = (heads_out * g.clone()).sum().backward();
        let through_backward = values(x.grad(&grads).unwrap());
        let inverse = exchange(g.inner(), heads.clone(), Direction::ToSequence);
        let inverse_dot = (x.inner() * inverse.clone()).sum().into_scalar::<f64>();
        (through_backward, values(inverse), forward_dot, inverse_dot)
    });
    let results: Vec<_> = results.into_iter().map(Result::unwrap).collect();
    for (rank, (backward, inverse, _, _)) in results.iter().enumerate() {
        assert!(backward.iter().all(|x| x.is_finite()));
        assert_eq!(backward, inverse, "rank {rank}: the exchange's gradient is the inverse exchange of the output's");
    }
    // And the inverse is the exchange's adjoint: Σ_ranks <ToHeads x, g> = Σ_ranks <x, ToSequence g>,
    // which a wrong head order or a copy not summed on the way back would break.
    let (forward, inverse): (f64, f64) = results.iter().map(|(_, _, f, i)| (*f, *i)).fold((0.0, 0.0), |(a, b), (f, i)| (a + f, b + i));
    assert!((forward - inverse).abs() <= 1e-4 * forward.abs().max(1.0), "<ToHeads x, g> = {forward}, <x, ToSequence g> = {inverse}");
}

/// Every rank's panic message, in rank order.
fn refusals(sp: usize, work: impl Fn(usize) -> ([usize; 4], [usize; 4]) + Sync) -> Vec<String> {
    refusals_with_mask(sp, None, work)
}

fn refusals_with_mask(sp: usize, mask: Option<[usize; 4]>, work: impl Fn(usize) -> ([usize; 4], [usize; 4]) + Sync) -> Vec<String> {
    refusals_with(sp, mask, AttentionModuleOptions::default(), work)
}

fn refusals_with(sp: usize, mask: Option<[usize; 4]>, options: AttentionModuleOptions, work: impl Fn(usize) -> ([usize; 4], [usize; 4]) + Sync) -> Vec<String> {
    ThreadGroup::new(sp)
        .run(|rank| {
            let _sp = context::enter(rank.communicator());
            let device = plain_device().autodiff();
            let (q_shape, kv_shape) = work(rank.rank());
            let q = Tensor::<4>::zeros(q_shape, &device);
            let kv = Tensor::<4>::zeros(kv_shape, &device);
            let mask = mask.map(|shape| Tensor::<4, burn::tensor::Bool>::empty(shape, &device));
            attention(q, kv.clone(), kv, mask, None, options);
        })
        .into_iter()
        .map(|result| result.expect_err("a bad layout must be refused").message)
        .collect()
}

#[test]
fn bad_layouts_are_refused_on_every_rank_with_burn_ulysses_message() {
    let too_few_heads = refusals(4, |_| ([1, 2, 4, 8], [1, 2, 4, 8]));
    let expected = UlyssesError::MoreRanksThanHeads { q_heads: 2, sp_size: 4 }.to_string();
    assert!(too_few_heads.iter().all(|m| *m == expected), "{too_few_heads:?}");

    let ungrouped = refusals(2, |_| ([1, 6, 4, 8], [1, 4, 4, 8]));
    let expected = UlyssesError::KvHeadsNotGrouping { q_heads: 6, kv_heads: 4 }.to_string();
    assert!(ungrouped.iter().all(|m| *m == expected), "{ungrouped:?}");

    // A [S, S] mask made from local shapes cannot follow the exchange.
    let square = refusals_with_mask(2, Some([1, 1, 4, 4]), |_| ([1, 2, 4, 8], [1, 2, 4, 8]));
    let expected = UlyssesError::UnshardableMask { shape: vec![1, 1, 4, 4] }.to_string();
    assert!(square.iter().all(|m| *m == expected), "{square:?}");

    // Rank 1 holds more tokens than rank 0: every rank names the field and both values.
    let uneven_tokens = refusals(2, |rank| ([1, 2, 4 + rank, 8], [1, 2, 4 + rank, 8]));
    assert!(uneven_tokens.iter().all(|m| m.contains("local query sequence length") && m.contains("rank 1 has 5")), "{uneven_tokens:?}");

    // Causal over more keys than queries (a key cache): refused before the exchange, saying why.
    let cached = refusals_with(2, None, AttentionModuleOptions { is_causal: true, ..Default::default() }, |_| ([1, 2, 4, 8], [1, 2, 6, 8]));
    assert!(cached.iter().all(|m| m.contains("4 queries over 6 keys") && m.contains("as many keys as queries")), "{cached:?}");

    // k and v in another dtype than q: named before the exchange joins the three in one buffer.
    let mixed: Vec<String> = ThreadGroup::new(2)
        .run(|rank| {
            let _sp = context::enter(rank.communicator());
            let device = plain_device().autodiff();
            let q = Tensor::<4>::zeros([1, 2, 4, 8], &device);
            let kv = q.clone().cast(burn::tensor::FloatDType::F64);
            attention(q, kv.clone(), kv, None, None, AttentionModuleOptions::default());
        })
        .into_iter()
        .map(|result| result.expect_err("mixed dtypes must be refused").message)
        .collect();
    assert!(mixed.iter().all(|m| m.contains("q, k and v must share a dtype; got q F32, k F64, v F64")), "{mixed:?}");
}

/// As burn-ulysses: non-causal attention over a class token put before each rank's shard, or
/// registers after it (joined once a rank, weighed P times), is refused on every rank; a
/// one-query key-padding mask is taken as one inside `with_key_padding_mask`; and on one device
/// a softcap of 0 or a mask per kv head is named, not a panic deep in burn.
#[test]
fn tokens_beside_the_shard_and_options_burn_asserts_are_refused_as_burn_ulysses_refuses_them() {
    for (what, beside_first) in [("begin", true), ("end", false)] {
        let refused: Vec<String> = ThreadGroup::new(2)
            .run(|rank| {
                let _sp = context::enter(rank.communicator());
                let device = plain_device().autodiff();
                let tensor = |stream: u64| {
                    let shared = Tensor::<4>::from_data(TensorData::new(uniform(2 * 8, stream), [1, 2, 1, 8]), &device);
                    let own = Tensor::<4>::from_data(TensorData::new(uniform(2 * 3 * 8, stream + 10 * (rank.rank() as u64 + 1)), [1, 2, 3, 8]), &device);
                    Tensor::cat(if beside_first { vec![shared, own] } else { vec![own, shared] }, 2)
                };
                attention(tensor(1), tensor(2), tensor(3), None, None, AttentionModuleOptions::default());
            })
            .into_iter()
            .map(|result| result.expect_err("tokens beside the shard must be refused").message)
            .collect();
        let named = format!("every rank's keys {what} with the same token (of 4 keys a rank)");
        assert!(refused.iter().all(|m| m.contains(&named) && m.contains("Put them into the sequence before it is sharded")), "{refused:?}");
    }
    // One pooling query a rank over its shard with the shard's key padding: said to be one.
    let pooled: Vec<_> = ThreadGroup::new(2)
        .run(|rank| {
            let _sp = context::enter(rank.communicator());
            let device = plain_device().autodiff();
            let tensor = |shape: [usize; 4], stream: u64| Tensor::<4>::from_data(TensorData::new(uniform(shape.iter().product(), stream + rank.rank() as u64), shape), &device);
            let mask = Tensor::<4, burn::tensor::Bool>::from_data(TensorData::new(vec![false, false, rank.rank() == 1], [1, 1, 1, 3]), &device);
            burn_ulysses_ops::attention::with_key_padding_mask(|| attention(tensor([1, 2, 1, 8], 1), tensor([1, 2, 3, 8], 3), tensor([1, 2, 3, 8], 5), Some(mask), None, AttentionModuleOptions::default())).dims()
        })
        .into_iter()
        .map(|result| result.unwrap_or_else(|panic| panic!("a pooling query refused: {}", panic.message)))
        .collect();
    assert!(pooled.iter().all(|dims| *dims == [1, 2, 1, 8]), "{pooled:?}");
    // One device: burn's asserts and expands reached with a clear message instead.
    let device = plain_device();
    let q = Tensor::<4>::from_data(TensorData::new(uniform(4 * 6 * 4, 1), [1, 4, 6, 4]), &device);
    let kv = Tensor::<4>::from_data(TensorData::new(uniform(2 * 6 * 4, 2), [1, 2, 6, 4]), &device);
    let softcap = std::panic::catch_unwind(|| attention(q.clone(), kv.clone(), kv.clone(), None, None, AttentionModuleOptions { softcap: Some(0.0), ..Default::default() })).expect_err("a softcap of 0");
    let message = softcap.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(message.contains("the softcap must be positive and finite"), "{message}");
    let per_kv_head = Tensor::<4, burn::tensor::Bool>::from_data(TensorData::new(vec![false; 12], [1, 2, 1, 6]), &device);
    let masked = std::panic::catch_unwind(|| attention(q.clone(), kv.clone(), kv.clone(), Some(per_kv_head), None, AttentionModuleOptions::default())).expect_err("a mask per kv head");
    let message = masked.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(message.contains("a mask of shape [1, 2, 1, 6] does not fit the scores") && message.contains("repeated over its group of query heads"), "{message}");
}

/// What a rank thread does in [`in_a_step`] before the call under test.
#[derive(Clone, Copy, Debug)]
enum Before {
    /// `labels_in_step` of a batch of `[sequences, tokens each]`, cut for 2 ranks.
    Count([usize; 2]),
    /// An attention of its own (an exchange).
    Attend,
    /// The gradient sum (of a layer of zeros, the same on every rank).
    Sum,
    /// The groups left and entered again (the same communicator, another entry).
    Reenter,
}

/// What each of 2 rank threads makes of `call` after `before`: its output's dims, or its
/// refusal.
fn in_a_step(before: &[Before], call: fn(&burn::tensor::Device, usize) -> Tensor<4>) -> Vec<Result<[usize; 4], String>> {
    ThreadGroup::new(2)
        .run(|rank| {
            let mut sp = Some(context::enter(rank.communicator()));
            let device = plain_device().autodiff();
            for &event in before {
                match event {
                    Before::Count([rows, len]) => {
                        let sequences: Vec<Vec<i64>> = (0..rows as i64).map(|row| (100 * row..100 * row + len as i64).collect()).collect();
                        burn_ulysses_ops::train::labels_in_step(&burn_ulysses_ops::data::SequenceSharder::new(2).shard(&sequences, rank.rank()));
                    }
                    Before::Attend => {
                        let q = Tensor::<4>::zeros([2, 2, 8, 4], &device);
                        attention(q.clone(), q.clone(), q, None, None, AttentionModuleOptions { is_causal: true, ..Default::default() });
                    }
                    Before::Sum => {
                        let layer = burn::nn::LinearConfig::new(2, 2).with_initializer(burn::nn::Initializer::Zeros).init(&device);
                        burn_ulysses_ops::train::all_reduce_gradients(&layer, burn::optim::GradientsParams::new());
                    }
                    Before::Reenter => {
                        // The guard left first: it restores the groups it found.
                        drop(sp.take());
                        sp = Some(context::enter(rank.communicator()));
                    }
                }
            }
            let dims = call(&device, rank.rank()).dims();
            drop(sp);
            dims
        })
        .into_iter()
        .map(|result| result.map_err(|panic| panic.message))
        .collect()
}

/// As burn-ulysses, once a step's shard is noted (`labels_in_step`, 2 rows of 8 tokens a rank):
/// a query `[B, S, H, D]` (heads and tokens swapped) and chunks of the shard folded into the
/// batch are refused on every rank, after an attention too (until the gradient sum); the same
/// shapes pass before any count, after the sum, in groups entered since, and where the count
/// after an attention (an evaluation's next batch) or beside it (a micro-batch counted first) is
/// 4 tokens a rank.
/// Keys of a noted shard's length are its own: keys that begin alike on every rank are no
/// class token.
#[test]
fn a_swapped_query_and_folded_chunks_of_the_steps_shard_are_refused_as_burn_ulysses_refuses_them() {
    use Before::{Attend, Count, Reenter, Sum};
    // [B, S/P, H, D] of 2 heads: dim 1 is the shard's 8 tokens.
    let swapped: fn(&burn::tensor::Device, usize) -> Tensor<4> = |device, _| {
        let q = Tensor::<4>::zeros([2, 8, 2, 4], device);
        attention(q.clone(), q.clone(), q, None, None, AttentionModuleOptions { is_causal: true, ..Default::default() })
    };
    // The shard's 8 tokens in 2 chunks of 4, as 4 rows: block-local attention.
    let folded: fn(&burn::tensor::Device, usize) -> Tensor<4> = |device, _| {
        let q = Tensor::<4>::zeros([4, 2, 4, 4], device);
        attention(q.clone(), q.clone(), q, None, None, AttentionModuleOptions { is_causal: true, ..Default::default() })
    };
    let refused = |before: &[Before], call, says: &str| {
        let outcome = in_a_step(before, call);
        assert!(outcome.iter().all(|result| result.as_ref().is_err_and(|m| m.contains(says))), "after {before:?}: {outcome:?}");
    };
    let passed = |before: &[Before], call| {
        let outcome = in_a_step(before, call);
        assert!(outcome.iter().all(|result| result.is_ok()), "after {before:?}: {outcome:?}");
    };
    let swap = "the heads and the tokens look swapped";
    let fold = "chunks of 4 tokens of this rank's shard of 8, folded into the batch (2 rows × 2 chunks)";
    for before in [&[Count([2, 16])][..], &[Count([2, 16]), Attend]] {
        refused(before, swapped, swap);
        refused(before, folded, fold);
    }
    refused(&[Count([2, 16])], swapped, "[2, 8, 2, 4]");
    // Micro-batches of 4 rows × 4 tokens a rank and 2 × 8 counted before the first forward:
    // both noted, the first's query [4, 2, 4, 4] no fold of the second's shard.
    refused(&[Count([4, 8]), Count([2, 16])], swapped, swap);
    passed(&[Count([4, 8]), Count([2, 16])], folded);
    for call in [swapped, folded] {
        passed(&[], call);
        passed(&[Count([2, 16]), Attend, Sum], call);
        passed(&[Count([2, 16]), Attend, Count([4, 8])], call);
        // Noted in groups left since: not the next groups' shards.
        passed(&[Count([2, 16]), Reenter], call);
    }
    // The shard's own keys, the first alike on every rank (its tokens, not a class token put
    // before them): non-causal attention passes in a step, and is refused outside one.
    let first_alike: fn(&burn::tensor::Device, usize) -> Tensor<4> = |device, rank| {
        let shared = Tensor::<4>::from_data(TensorData::new(uniform(2 * 2 * 4, 1), [2, 2, 1, 4]), device);
        let own = Tensor::<4>::from_data(TensorData::new(uniform(2 * 2 * 7 * 4, 10 + rank as u64), [2, 2, 7, 4]), device);
        let x = Tensor::cat(vec![shared, own], 2);
        attention(x.clone(), x.clone(), x, None, None, AttentionModuleOptions::default())
    };
    passed(&[Count([2, 16])], first_alike);
    refused(&[], first_alike, "every rank's keys begin with the same token");
}

#[test]
fn outside_a_group_it_is_burns_attention() {
    let device = plain_device();
    let options = AttentionModuleOptions { is_causal: true, ..Default::default() };
    let tensor = |heads: usize, stream: u64| Tensor::<4>::from_data(TensorData::new(uniform(heads * 24, stream), [1, heads, 6, 4]), &device);
    let (q, k, v) = (tensor(2, 5), tensor(2, 6), tensor(2, 7));
    let ours = values(attention(q.clone(), k.clone(), v.clone(), None, None, options));
    let burns = values(burn::tensor::module::attention(q, k, v, None, None, options));
    assert_eq!(ours, burns);
    // Grouped kv heads (4 q heads over 2): as burn's attention on kv heads repeated by hand.
    let (q, k, v) = (tensor(4, 8), tensor(2, 9), tensor(2, 10));
    let by_hand = |t: Tensor<4>| Tensor::cat(vec![t.clone().narrow(1, 0, 1), t.clone().narrow(1, 0, 1), t.clone().narrow(1, 1, 1), t.narrow(1, 1, 1)], 1);
    let ours = values(attention(q.clone(), k.clone(), v.clone(), None, None, options));
    let burns = values(burn::tensor::module::attention(q, by_hand(k), by_hand(v), None, None, options));
    assert_eq!(ours, burns);
    // kv heads that do not divide the q heads: burn-ulysses' refusal, not a matmul panic.
    let refusal = std::panic::catch_unwind(|| attention(tensor(3, 11), tensor(2, 12), tensor(2, 13), None, None, options)).expect_err("3 q heads over 2 kv heads");
    let message = refusal.downcast_ref::<String>().cloned().unwrap_or_default();
    assert_eq!(message, UlyssesError::KvHeadsNotGrouping { q_heads: 3, kv_heads: 2 }.to_string());
}

#[test]
fn a_softcap_is_applied_before_masking_and_through_the_backward() {
    // Scaled scores reach about ±1: a cap of 0.5 bends most of them.
    for causal in [true, false] {
        sequence_parallel_masked(2, [2, 4, 12, 8], 2, causal, None, Some(0.5));
        sequence_parallel_masked(3, [1, 3, 12, 8], 3, causal, Some([1, 3]), Some(0.5));
    }
}

#[test]
fn blocked_attention_equals_the_f64_reference_across_block_edges() {
    // Blocks of 5 queries over 13 tokens: a ragged last block, and causal blocks that see
    // different numbers of keys.
    let shape = [2, 3, 13, 4];
    let len = shape.iter().product();
    let (q, k, v, w) = (uniform(len, 31), uniform(len, 32), uniform(len, 33), uniform(len, 34));
    let device = plain_device().autodiff();
    for causal in [true, false] {
        for block in [1, 5, 13, 64] {
            let tensor = |values: &[f32]| Tensor::<4>::from_data(TensorData::new(values.to_vec(), shape), &device).require_grad();
            let (tq, tk, tv) = (tensor(&q), tensor(&k), tensor(&v));
            let options = BlockedOptions { is_causal: causal, ..Default::default() };
            let output = attention_in_blocks(tq.clone(), tk.clone(), tv.clone(), None, options, block);
            let grads = (output.clone() * tensor(&w)).sum().backward();
            let got = [values(output), values(tq.grad(&grads).unwrap()), values(tk.grad(&grads).unwrap()), values(tv.grad(&grads).unwrap())];
            let want = reference(&q, &k, &v, &w, shape, 3, causal);
            for ((name, got), want) in ["output", "dq", "dk", "dv"].iter().zip(&got).zip(&want) {
                assert_close(&format!("blocks of {block}, causal {causal}: {name}"), got, want);
            }
        }
    }
}

/// f64 inputs are attended in f64 (the scores, the softmax's statistics and the sums over
/// blocks): within 1e-12 of the f64 reference, where an f32 working dtype left them 1e-7
/// apart, silently less exact than burn's own f64 attention.
#[test]
fn blocked_attention_of_f64_inputs_is_exact_to_f64() {
    let shape = [2, 3, 13, 4];
    let len = shape.iter().product();
    let (q, k, v, w) = (uniform(len, 41), uniform(len, 42), uniform(len, 43), uniform(len, 44));
    let device = plain_device().autodiff();
    let as_f64 = |tensor: Tensor<4>| -> Vec<f64> { tensor.into_data().convert::<f64>().try_to_vec::<f64>().unwrap() };
    for causal in [true, false] {
        let tensor = |values: &[f32]| Tensor::<4>::from_data(TensorData::new(values.to_vec(), shape), &device).cast(burn::tensor::FloatDType::F64).require_grad();
        let (tq, tk, tv) = (tensor(&q), tensor(&k), tensor(&v));
        let output = attention_in_blocks(tq.clone(), tk.clone(), tv.clone(), None, BlockedOptions { is_causal: causal, ..Default::default() }, 5);
        assert_eq!(output.dtype(), burn::tensor::DType::F64);
        let grads = (output.clone() * tensor(&w)).sum().backward();
        let got = [as_f64(output), as_f64(tq.grad(&grads).unwrap()), as_f64(tk.grad(&grads).unwrap()), as_f64(tv.grad(&grads).unwrap())];
        let want = reference(&q, &k, &v, &w, shape, 3, causal);
        for ((name, got), want) in ["output", "dq", "dk", "dv"].iter().zip(&got).zip(&want) {
            let largest = want.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
            let error = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f64, |worst, d| if d.is_finite() { worst.max(d) } else { f64::INFINITY }) / largest;
            assert!(error <= 1e-12, "causal {causal}: {name} {error:e} from the f64 reference");
        }
    }
}

/// Nothing to attend gives zeros of the output's shape, as burn-ulysses answers it: no query
/// (a rank's shard of an empty sequence, at SP = 2 too), no key, no row (it panicked in `cat`).
#[test]
fn blocked_attention_with_nothing_to_attend_gives_zeros() {
    let device = plain_device().autodiff();
    for causal in [true, false] {
        let options = BlockedOptions { is_causal: causal, ..Default::default() };
        for ([b, h, s, t], dv) in [([2, 3, 0, 0], 5), ([0, 3, 4, 4], 5), ([2, 3, 4, 0], 5)] {
            if causal && s != t {
                continue;
            }
            let [q, k, v] = [[b, h, s, 4], [b, h, t, 4], [b, h, t, dv]].map(|shape| Tensor::<4>::ones(shape, &device).require_grad());
            let output = attention_in_blocks(q, k, v, None, options, 2);
            assert_eq!(output.dims(), [b, h, s, dv], "q {:?}, {t} keys, causal {causal}", [b, h, s]);
            assert!(values(output).iter().all(|&x| x == 0.0), "q {:?}, {t} keys, causal {causal}", [b, h, s]);
        }
    }
    let outputs = ThreadGroup::new(2).run(|rank| {
        let _sp = context::enter(rank.communicator());
        let empty = Tensor::<4>::zeros([1, 4, 0, 8], &plain_device().autodiff());
        attention(empty.clone(), empty.clone(), empty, None, None, AttentionModuleOptions { is_causal: true, ..Default::default() }).dims()
    });
    for (rank, output) in outputs.into_iter().enumerate() {
        assert_eq!(output.unwrap_or_else(|panic| panic!("rank {rank}: {}", panic.message)), [1, 4, 0, 8], "rank {rank}");
    }
}

#[test]
fn blocked_attention_in_half_precision_keeps_its_softmax_statistics_in_f32() {
    use burn::tensor::DType;
    let device = plain_device().autodiff();
    let constant = |value: f32, shape: [usize; 4], dtype: DType| Tensor::<4>::from_data(TensorData::new(vec![value; shape.iter().product()], shape), &device).cast(dtype);
    // A query over `keys` equal keys: each value's gradient is 1/keys (the loss sums the
    // output), up to the half-precision rounding of the probabilities, `tolerance`.
    // - f16 over 70 000 keys: their exponentials' sum passes f16's largest value, 65 504.
    // - bf16 over 5 066 keys: a log-sum-exp of 8.53, which bf16 rounds to 8.5 (3% off).
    for (dtype, keys, tolerance) in [(DType::F16, 70_000, 0.01), (DType::BF16, 5_066, 0.005)] {
        let v = constant(1.0, [1, 1, keys, 16], dtype).require_grad();
        let output = attention_in_blocks(constant(0.0, [1, 1, 1, 16], dtype), constant(0.0, [1, 1, keys, 16], dtype), v.clone(), None, BlockedOptions::default(), 128);
        let output = output.cast(DType::F32);
        let grads = output.clone().sum().backward();
        // The output's own sum over the keys is the backend's matmul (Flex sums f16 in f16).
        let output = values(output);
        assert!(output.iter().all(|o| o.is_finite() && *o > 0.0), "{dtype:?} over {keys} keys: output {output:?}");
        let dv = values(v.grad(&grads).expect("dv").cast(DType::F32));
        let want = 1.0 / keys as f32;
        let worst = dv.iter().map(|g| if g.is_finite() { ((g - want) / want).abs() } else { f32::INFINITY }).fold(0.0f32, f32::max);
        println!("{dtype:?} over {keys} keys: output {}, dv relative to 1/{keys} at most {worst:.2e}", output[0]);
        assert!(worst < tolerance, "{dtype:?} over {keys} keys: dv {} where 1/{keys} is {want} (relative {worst:e})", dv[0]);
    }
}

/// bf16 inputs with scores up to about ±30 (q and k entries up to ±6): the blocked attention
/// makes its scores in f32, as FlashAttention-2 keeps them, and comes within bf16's rounding of
/// its output of the f64 attention of the same (rounded) inputs. Made in bf16, a score of 30 was
/// up to 0.06 off, and near-ties between keys flipped.
#[test]
fn blocked_attention_in_bf16_makes_its_scores_in_f32() {
    use burn::tensor::DType;
    let device = plain_device();
    let shape = [1, 2, 64, 16];
    let len: usize = shape.iter().product();
    let rounded = |values: Vec<f32>| -> Tensor<4> { Tensor::<4>::from_data(TensorData::new(values, shape), &device).cast(DType::BF16) };
    let scaled = |stream: u64, by: f32| uniform(len, stream).into_iter().map(|x| x * by).collect::<Vec<f32>>();
    let (q, k, v) = (rounded(scaled(61, 6.0)), rounded(scaled(62, 6.0)), rounded(scaled(63, 1.0)));
    let as_f32 = |t: &Tensor<4>| values(t.clone().cast(DType::F32));
    let (q32, k32, v32) = (as_f32(&q), as_f32(&k), as_f32(&v));
    let output = values(attention_in_blocks(q, k, v, None, BlockedOptions::default(), 16).cast(DType::F32));
    let [want, ..] = reference(&q32, &k32, &v32, &vec![0.0; len], shape, 2, false);
    let worst = output.iter().zip(&want).map(|(got, want)| if got.is_finite() { (*got as f64 - want).abs() } else { f64::INFINITY }).fold(0.0, f64::max);
    println!("bf16 blocked attention, scores up to about 30: max |Δ| from the f64 attention {worst:.2e}");
    assert!(worst <= 0.01, "bf16 blocked attention {worst:e} from the f64 attention of its inputs");
}

/// The exchange's backward runs in the group of its forward: one run while another group of the
/// same size is entered (here the same two ranks in the other order, whose exchange would swap
/// their parts without a word) is refused on every rank.
#[test]
fn the_exchange_backward_in_another_group_is_refused() {
    use std::sync::Arc;
    use burn_ulysses_ops::comm::HostCommunicator;
    let results = ThreadGroup::new(2).run(|rank| {
        let group: Arc<dyn HostCommunicator> = rank.communicator();
        let reversed = group.split(0, 1 - rank.rank() as u32).unwrap();
        let device = plain_device().autodiff();
        let x = Tensor::<4>::from_data(TensorData::new(uniform(2 * 2 * 4 * 5, 30 + rank.rank() as u64), [2, 2, 4, 5]), &device).require_grad();
        let heads_out = {
            let _sp = context::enter(group.clone());
            exchange(x.clone(), HeadExchange::new(&*group, 2, vec![vec![0], vec![1]]), Direction::ToHeads)
        };
        let _other = context::enter(reversed);
        drop(heads_out.sum().backward());
    });
    for (rank, result) in results.into_iter().enumerate() {
        let message = result.expect_err("the backward in another group must be refused").message;
        assert!(message.contains("runs in another group than its attention call's"), "rank {rank}: {message}");
    }
}
