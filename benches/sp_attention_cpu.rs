//! Forward + backward of causal attention on the CPU (NdArray): one device against
//! `UlyssesBackend` with P in-process ranks on the same problem, in the same run.
//!
//! cargo bench --bench sp_attention_cpu
//!
//! On a machine with fewer cores than ranks the ranks share cores, so this shows the cost of
//! the exchange machinery more than any speed-up; memory per rank is what SP buys.

use std::time::{Duration, Instant};

use burn::{
    backend::{Autodiff, NdArray},
    tensor::{Tensor, backend::AutodiffBackend, module::attention, ops::AttentionModuleOptions},
};
use burn_ulysses::{
    UlyssesBackend,
    comm::{Communicator, ThreadGroup},
};
use ulysses_suite::{shard, uniform_tensor};

type Inner = NdArray<f32>;
type Reference = Autodiff<Inner>;
type Sp = UlyssesBackend<Autodiff<Inner>>;

const HEADS: usize = 8;
const HEAD_DIM: usize = 64;
const REPEATS: usize = 5;
const CAUSAL: AttentionModuleOptions = AttentionModuleOptions { scale: None, softcap: None, is_causal: true };

/// One forward + backward pass over this rank's part of `[1, HEADS, seq, HEAD_DIM]`.
fn step<B: AutodiffBackend>(seq: usize, rank: usize, ranks: usize) {
    let device = Default::default();
    let local = |stream| shard(uniform_tensor::<B, 4>([1, HEADS, seq, HEAD_DIM], stream, &device), 2, rank, ranks).require_grad();
    let (q, k, v) = (local(1), local(2), local(3));
    let output: Tensor<B, 4> = attention(q.clone(), k, v, None, None, CAUSAL);
    let grads = output.sum().backward();
    let _ = q.grad(&grads).unwrap().into_data();
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn single_device(seq: usize) -> Duration {
    step::<Reference>(seq, 0, 1);
    median((0..REPEATS).map(|_| {
        let started = Instant::now();
        step::<Reference>(seq, 0, 1);
        started.elapsed()
    }).collect())
}

/// Wall time of one step over all ranks (barrier to barrier), and bytes each rank sent.
fn sequence_parallel(seq: usize, ranks: usize) -> (Duration, u64) {
    let results = ThreadGroup::new(ranks).run(|rank| {
        let comm = rank.communicator();
        let _sp = Sp::enter_thread(comm.clone());
        let barrier = || Communicator::<Inner>::barrier(&*comm).unwrap();
        step::<Sp>(seq, rank.rank(), ranks);
        let before = Communicator::<Inner>::traffic(&*comm);
        let samples = (0..REPEATS).map(|_| {
            barrier();
            let started = Instant::now();
            step::<Sp>(seq, rank.rank(), ranks);
            barrier();
            started.elapsed()
        }).collect();
        let sent = Communicator::<Inner>::traffic(&*comm).since(&before).all_to_all_bytes / REPEATS as u64;
        (median(samples), sent)
    });
    results.into_iter().next().unwrap().unwrap()
}

fn main() {
    println!("causal attention fwd+bwd, batch 1, {HEADS} heads, head dim {HEAD_DIM}, f32, NdArray, median of {REPEATS}");
    println!("{:>6} {:>5} {:>12} {:>12} {:>8} {:>14}", "seq", "P", "one device", "SP", "SP/one", "bytes/rank");
    for seq in [512, 1024, 2048] {
        let reference = single_device(seq);
        for ranks in [2, 4] {
            let (time, bytes) = sequence_parallel(seq, ranks);
            println!(
                "{seq:>6} {ranks:>5} {:>12.2?} {:>12.2?} {:>8.2} {bytes:>14}",
                reference,
                time,
                time.as_secs_f64() / reference.as_secs_f64()
            );
        }
    }
}
