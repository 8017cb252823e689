//! The burn 0.22 crate's attention, forward and backward, at SP 4 on Flex (rank threads):
//! the seconds a call of causal attention over a sequence takes, to compare builds of the
//! crate side by side (`farm-bench` of two builds of this binary: benches/RESULTS.md).
//!
//! `cargo bench -p burn-ulysses-ops --bench sp_attention -- [TOKENS] [CALLS]` (8192 and 3 by
//! default): 8 q and 2 kv heads of 64, one sequence, each rank TOKENS / 4 of it.

use std::time::Instant;

use burn::tensor::{Device, Tensor, TensorData, ops::AttentionModuleOptions};
use burn_ulysses_ops::{attention, comm::ThreadGroup, context, host};

const SP: usize = 4;

fn main() {
    let numbers: Vec<usize> = std::env::args().skip(1).filter(|arg| arg != "--bench").map(|arg| arg.parse().expect("TOKENS and CALLS are whole numbers")).collect();
    let (tokens, calls) = (numbers.first().copied().unwrap_or(8192), numbers.get(1).copied().unwrap_or(3));
    assert!(tokens % SP == 0 && tokens > 0, "TOKENS must be a positive multiple of {SP}");
    let local = tokens / SP;
    let results = ThreadGroup::new(SP).run(|rank| {
        let _sp = context::enter(rank.communicator());
        let device = Device::flex().autodiff();
        let shard = |heads: usize, seed: usize| {
            let values: Vec<f32> = (0..heads * local * 64).map(|i| ((i * 7919 + seed * 104_729) % 1000) as f32 / 1000.0 - 0.5).collect();
            Tensor::<4>::from_data(TensorData::new(values, [1, heads, local, 64]), &device).require_grad()
        };
        let (q, k, v) = (shard(8, 1), shard(2, 2), shard(2, 3));
        let options = AttentionModuleOptions { is_causal: true, ..Default::default() };
        let mut seconds = Vec::new();
        for _ in 0..calls {
            let (reads, started) = (host::device_reads(), Instant::now());
            let output = attention(q.clone(), k.clone(), v.clone(), None, None, options);
            let grads = output.sum().backward();
            // Read back, so that the time holds the work.
            let _ = q.grad(&grads).expect("dq").into_data();
            seconds.push((started.elapsed().as_secs_f64(), host::device_reads() - reads));
        }
        seconds
    });
    let rank0 = results.into_iter().next().expect("rank 0").unwrap_or_else(|panic| panic!("{panic}"));
    for (call, (seconds, reads)) in rank0.iter().enumerate() {
        println!("call {call}: {seconds:.3} s forward and backward at {tokens} tokens over SP {SP}, {reads} reads from the device");
    }
}
