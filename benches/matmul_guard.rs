//! What the guard against attention done by hand costs: one training step (forward, loss,
//! backward) of the main job's model (`ulysses-trainer`'s defaults: d_model 128, 2 layers, 8
//! heads, 2 kv heads, batch 8 × 256 byte tokens) at SP = 1 and SP = 2 (in-process ranks), with
//! the guard on and off, interleaved in one run; median of the repeats and the ratio.
//!
//! cargo bench --bench matmul_guard

use std::time::{Duration, Instant};

use burn::{
    backend::{Autodiff, NdArray},
    tensor::{Int, Tensor},
};
use burn_ulysses::{UlyssesBackend, comm::{Communicator, ThreadGroup}, data::{SequenceSharder, ShardTensors}, attention_guard::set_guard};
use ulysses_training::lm_loss_sum;
use ulysses_models::DecoderConfig;

type Inner = NdArray<f32>;
type Sp = UlyssesBackend<Autodiff<Inner>>;

const BATCH: usize = 8;
const SEQ: usize = 256;
const REPEATS: usize = 7;

fn batch() -> Vec<Vec<i64>> {
    (0..BATCH).map(|b| (0..SEQ).map(|i| ((b * 31 + i * 7) % 256) as i64).collect()).collect()
}

/// Wall time of one step over `ranks` in-process ranks (barrier to barrier, slowest rank).
fn step(ranks: usize) -> Duration {
    let sequences = batch();
    let times = ThreadGroup::new(ranks).run(|rank| {
        let comm = rank.communicator();
        let _sp = Sp::enter_thread(comm.clone());
        let device = Default::default();
        let model = DecoderConfig::new(256).init::<Sp>(&device);
        let shard = SequenceSharder::new(ranks).shard(&sequences, rank.rank());
        let labels: Tensor<Sp, 2, Int> = shard.labels(&device);
        Communicator::<Inner>::barrier(&*comm).unwrap();
        let started = Instant::now();
        let loss = lm_loss_sum(model.lm_output(shard.tokens(&device), &shard.positions), labels, -100);
        let _ = loss.backward();
        Communicator::<Inner>::barrier(&*comm).unwrap();
        started.elapsed()
    });
    times.into_iter().map(|t| t.expect("a rank failed")).max().unwrap()
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn main() {
    println!("one training step of the main job's model, batch {BATCH} x {SEQ} tokens, median of {REPEATS}:");
    println!("{:>4}  {:>12}  {:>12}  {:>8}", "SP", "guard off", "guard on", "on/off");
    for ranks in [1, 2] {
        step(ranks);
        let (mut off, mut on) = (Vec::new(), Vec::new());
        for _ in 0..REPEATS {
            set_guard(false);
            off.push(step(ranks));
            set_guard(true);
            on.push(step(ranks));
        }
        let (off, on) = (median(off), median(on));
        println!("{ranks:>4}  {:>10.1}ms  {:>10.1}ms  {:>8.3}", off.as_secs_f64() * 1e3, on.as_secs_f64() * 1e3, on.as_secs_f64() / off.as_secs_f64());
    }
}
