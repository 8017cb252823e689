//! Sequence-parallel ranks as threads of one process share burn's autodiff graph locator: a
//! `backward()` on one rank ends by sweeping every graph of the process for unused roots
//! (burn-autodiff 0.21's `GraphCleaner::cleanup_orphaned_entries`). `float_cat` dropped its
//! inputs' reference counts before registering its own step, so a sweep landing in that window
//! judged another rank's half-built graph unused and freed its steps: that rank's backward then
//! stopped short, a gradient silently missing (tracel-ai/burn#5573; CI saw it as a rank leaving
//! before the backward's all-to-all, `sp_attention::uneven_heads_move_no_padding`). The
//! workspace patches burn-autodiff 0.21.0's `float_cat` to keep them until its step is
//! registered (third_party/README.md).

use std::{
    sync::atomic::{AtomicBool, AtomicUsize, Ordering},
    time::{Duration, Instant},
};

use burn::{
    backend::{Autodiff, NdArray},
    tensor::{Distribution, Tensor},
};
use ulysses_suite::{max_abs_diff, values};

type B = Autodiff<NdArray<f32>>;

/// A graph from a leaf to a scalar: `cat` (the operation that dropped its inputs early) and the
/// operations a transformer's forward is made of, to find any other with the same window.
type Graph = fn(Tensor<B, 2>) -> Tensor<B, 1>;

const GRAPHS: [(&str, Graph); 5] = [
    ("cat", |x| Tensor::cat(vec![x.clone() * 2.0, x.clone() * 3.0, x.clone() * x], 0).sum()),
    ("matmul, exp, mean over a dim", |x| x.clone().matmul(x.clone().transpose()).mul_scalar(0.01).exp().mean_dim(1).sum()),
    ("reshape, swap_dims, slice, softmax", |x| {
        let [rows, cols] = x.dims();
        let heads = x.reshape([2, rows / 2, cols]).swap_dims(0, 1);
        burn::tensor::activation::softmax(heads.slice([0..rows / 4, 0..2, 0..cols]), 2).powf_scalar(2.0).sum()
    }),
    ("select rows, silu, sqrt", |x| {
        let ids = Tensor::<B, 1, burn::tensor::Int>::from_ints([3, 1, 4, 1, 5, 9, 2, 6], &x.device());
        burn::tensor::activation::silu(x.clone().select(0, ids)).add(x.powf_scalar(2.0).sum_dim(0).add_scalar(1.0).sqrt()).sum()
    }),
    // ulysses-training's node of given gradients (the chunked loss's), over an intermediate.
    ("given gradients", |x| {
        use burn::tensor::TensorPrimitive;
        use ulysses_training::TrainBackend;
        let y = x * 2.0;
        let value = y.clone().inner().sum().into_primitive().tensor();
        let given = y.clone().inner().add_scalar(1.0).into_primitive().tensor();
        Tensor::from_primitive(TensorPrimitive::Float(B::with_gradients(value, [(y.into_primitive().tensor(), given)])))
    }),
];

/// Threads that build graphs from a leaf a previous `backward()` consumed (its locator entry
/// is gone, so each graph starts with no live tensor holding it), beside threads that only call
/// `backward()` (each call sweeps every graph): every leaf's gradient must be there and equal
/// to the one the same graph gives on one thread alone, in every round.
#[test]
fn a_concurrent_backward_leaves_every_other_threads_gradient_whole() {
    const SWEEPERS: usize = 4;
    const SIZE: usize = 96;
    let budget = Duration::from_secs(6);
    let device = Default::default();
    let leaves: Vec<Tensor<B, 2>> = (0..GRAPHS.len())
        .map(|_| Tensor::<B, 2>::random([SIZE, SIZE], Distribution::Normal(0.0, 1.0), &device).require_grad())
        .collect();
    // Each graph's gradient on this thread alone, before any other thread runs.
    let expected: Vec<Vec<f32>> = GRAPHS.iter().zip(&leaves).map(|((_, graph), leaf)| values(leaf.grad(&graph(leaf.clone()).backward()).unwrap())).collect();
    let done = AtomicBool::new(false);
    let rounds: Vec<AtomicUsize> = GRAPHS.iter().map(|_| AtomicUsize::new(0)).collect();
    let wrong: Vec<AtomicUsize> = GRAPHS.iter().map(|_| AtomicUsize::new(0)).collect();
    std::thread::scope(|scope| {
        for _ in 0..SWEEPERS {
            scope.spawn(|| {
                while !done.load(Ordering::Relaxed) {
                    let x = Tensor::<B, 2>::random([8, 8], Distribution::Default, &device).require_grad();
                    let _ = (x.clone() * x).sum().backward();
                }
            });
        }
        let builders: Vec<_> = (0..GRAPHS.len())
            .map(|g| {
                let (leaf, expected, rounds, wrong) = (leaves[g].clone(), &expected[g], &rounds[g], &wrong[g]);
                let tolerance = 1e-5 * (1.0 + expected.iter().fold(0.0f32, |m, x| m.max(x.abs())));
                scope.spawn(move || {
                    let started = Instant::now();
                    while started.elapsed() < budget {
                        // A throwaway backward through the leaf: its locator entry goes.
                        let _ = leaf.clone().sum().backward();
                        let grads = GRAPHS[g].1(leaf.clone()).backward();
                        // max_abs_diff is infinite where either side is not finite (a tensor's
                        // max may skip a NaN).
                        let ok = leaf.grad(&grads).is_some_and(|grad| max_abs_diff(&values(grad), expected) <= tolerance);
                        if !ok {
                            wrong.fetch_add(1, Ordering::Relaxed);
                        }
                        rounds.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        builders.into_iter().for_each(|builder| builder.join().unwrap());
        done.store(true, Ordering::Relaxed);
    });
    let mut failures = Vec::new();
    for (((name, _), rounds), wrong) in GRAPHS.iter().zip(rounds).zip(wrong) {
        let (rounds, wrong) = (rounds.into_inner(), wrong.into_inner());
        println!("{name}: {rounds} rounds beside {SWEEPERS} sweeping threads, {wrong} with a gradient missing or wrong");
        assert!(rounds >= 20, "{name}: only {rounds} rounds, too few to meet the window");
        if wrong > 0 {
            failures.push(format!("{name}: {wrong} of {rounds} rounds"));
        }
    }
    assert!(failures.is_empty(), "gradients lost to another thread's backward: {failures:?}");
}
