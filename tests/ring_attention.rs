//! Ring attention (`burn_ulysses::ring`) with R in-process ranks, each holding one chunk of
//! the sequence, against burn's attention on one device: the output of every chunk and the
//! gradients of q, k and v within 1e-5 (f32), causal and not, multi-head, grouped-query and
//! multi-query. The gradients come from autodiff through the ring's `send_recv` nodes, whose
//! backward sends them back around the ring.

use std::time::Duration;

use burn::{
    backend::{Autodiff, NdArray},
    tensor::{Tensor, backend::AutodiffBackend, module::attention, ops::AttentionModuleOptions},
};
use burn_ulysses::{attention::repeat_kv_heads, capabilities::DenseFallback, comm::ThreadGroup, ring::{RingSharding, ring_attention}};
use ulysses_suite::{max_abs_diff, shard, uniform_tensor, values, with_deadline};

type Reference = Autodiff<NdArray<f32>>;

const TOLERANCE: f32 = 1e-5;
const SEQ: usize = 24;
const HEAD_DIM: usize = 8;

/// Output and gradients of q, k, v (each `values`), for loss `Σ output · W`.
fn run<B: AutodiffBackend>(q: Tensor<B, 4>, k: Tensor<B, 4>, v: Tensor<B, 4>, w: Tensor<B, 4>, attend: impl Fn(Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) -> Tensor<B, 4>) -> [Vec<f32>; 4] {
    let (q, k, v) = (q.require_grad(), k.require_grad(), v.require_grad());
    let output = attend(q.clone(), k.clone(), v.clone());
    let grads = (output.clone() * w).sum().backward();
    [values(output), values(q.grad(&grads).unwrap()), values(k.grad(&grads).unwrap()), values(v.grad(&grads).unwrap())]
}

fn check(ranks: usize, heads: usize, kv_heads: usize, causal: bool) {
    let options = AttentionModuleOptions { scale: None, softcap: None, is_causal: causal };
    let inputs = move |device: &_| {
        let t = |h, stream| uniform_tensor::<Reference, 4>([2, h, SEQ, HEAD_DIM], stream, device);
        (t(heads, 1), t(kv_heads, 2), t(kv_heads, 3), t(heads, 4))
    };
    let device = Default::default();
    let (q, k, v, w) = inputs(&device);
    let group = heads / kv_heads;
    let reference = run(q, k, v, w, |q, k, v| attention(q, repeat_kv_heads(k, group), repeat_kv_heads(v, group), None, None, options));

    let per_rank = with_deadline(Duration::from_secs(50), move || {
        ThreadGroup::new(ranks).run(move |rank| {
            let device = Default::default();
            let (q, k, v, w) = inputs(&device);
            let (r, p) = (rank.rank(), rank.size());
            let comm: std::sync::Arc<dyn burn_ulysses::comm::Communicator<NdArray<f32>>> = rank.communicator();
            let chunk = |t| shard(t, 2, r, p);
            run(chunk(q), chunk(k), chunk(v), chunk(w), |q, k, v| ring_attention(q, k, v, options, RingSharding::Contiguous, &comm, DenseFallback::Allow).unwrap())
        })
    });
    let full = |values: &[f32], h: usize| Tensor::<NdArray<f32>, 4>::from_data(burn::tensor::TensorData::new(values.to_vec(), [2, h, SEQ, HEAD_DIM]), &device);
    let mut worst = [0.0f32; 4];
    for (r, outcome) in per_rank.into_iter().enumerate() {
        let outcome = outcome.unwrap_or_else(|panic| panic!("rank {r}: {panic}"));
        for (i, (got, heads_of)) in outcome.iter().zip([heads, heads, kv_heads, kv_heads]).enumerate() {
            let want = values(shard(full(&reference[i], heads_of), 2, r, ranks));
            worst[i] = worst[i].max(max_abs_diff(got, &want));
        }
    }
    println!("ring of {ranks}, {heads} q / {kv_heads} kv heads, causal {causal}: max |Δ| output {:.2e}, dq {:.2e}, dk {:.2e}, dv {:.2e}", worst[0], worst[1], worst[2], worst[3]);
    for (name, diff) in ["output", "dq", "dk", "dv"].iter().zip(worst) {
        assert!(diff <= TOLERANCE, "ring of {ranks}, {heads}/{kv_heads} heads, causal {causal}: {name} differs by {diff:e}");
    }
}

#[test]
fn a_ring_of_two_and_four_causal() {
    check(2, 4, 4, true);
    check(4, 4, 4, true);
}

#[test]
fn a_ring_of_four_non_causal() {
    check(4, 4, 4, false);
}

#[test]
fn a_ring_of_four_with_grouped_and_single_kv_heads() {
    check(4, 4, 2, true);
    check(4, 4, 1, true);
    check(3, 4, 1, false);
}

#[test]
fn a_ring_of_one_is_plain_attention() {
    check(1, 4, 2, true);
}

/// k and v whose shapes do not fit q (k's head dim 16 for q's 8: the ring cut the joined k, v
/// block at q's head dim and attended over k's second half as values) are refused on every rank.
#[test]
fn keys_and_values_that_do_not_fit_the_queries_are_refused() {
    let results = with_deadline(Duration::from_secs(50), || {
        ThreadGroup::new(2).run(|rank| {
            let device = Default::default();
            let comm: std::sync::Arc<dyn burn_ulysses::comm::Communicator<NdArray<f32>>> = rank.communicator();
            let t = |h, d, stream| uniform_tensor::<NdArray<f32>, 4>([2, h, SEQ / 2, d], stream, &device);
            let options = AttentionModuleOptions { scale: None, softcap: None, is_causal: true };
            let wide_keys = ring_attention(t(4, HEAD_DIM, 1), t(2, 2 * HEAD_DIM, 2), t(2, HEAD_DIM, 3), options, RingSharding::Contiguous, &comm, DenseFallback::Allow).err().map(|e| e.to_string());
            let other_value_heads = ring_attention(t(4, HEAD_DIM, 1), t(2, HEAD_DIM, 2), t(4, HEAD_DIM, 3), options, RingSharding::Contiguous, &comm, DenseFallback::Allow).err().map(|e| e.to_string());
            // A k of another dtype than q's: checked before the kernels, which look at q's alone
            // (NdArray's matmul of the reference blocks panicked on it).
            let f64_keys = ring_attention(t(4, HEAD_DIM, 1), t(2, HEAD_DIM, 2).cast(burn::tensor::FloatDType::F64), t(2, HEAD_DIM, 3), options, RingSharding::Contiguous, &comm, DenseFallback::Allow)
                .err()
                .map(|e| e.to_string());
            [wide_keys, other_value_heads, f64_keys]
        })
    });
    for (rank, result) in results.into_iter().enumerate() {
        for message in result.unwrap_or_else(|panic| panic!("rank {rank}: {panic}")) {
            let message = message.unwrap_or_else(|| panic!("rank {rank}: attended over k and v that do not fit q"));
            let named = ["ring attention takes q [B, H, S/R, D], k [B, H_kv, S/R, D] and v [B, H_kv, S/R, Dv]", "q, k and v must share a dtype; got q F32, k F64, v F32"];
            assert!(named.iter().any(|said| message.contains(said)), "rank {rank}: {message}");
        }
    }
}
