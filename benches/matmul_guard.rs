//! What the guard against attention done by hand costs: one training step (forward, loss,
//! backward) of the main job's model (`ulysses-trainer`'s defaults: d_model 128, 2 layers, 8
//! heads, 2 kv heads, batch 8 × 256 byte tokens) at SP = 1 and SP = 2 (in-process ranks), with
//! the guard on and off, interleaved in one run; median of the repeats and the ratio. With the
//! guard on, the forward runs with the shard's positions noted, as the training API runs it.
//!
//! cargo bench --bench matmul_guard

use std::time::{Duration, Instant};

use burn::{
    backend::{Autodiff, NdArray},
    tensor::{Int, Tensor},
};
use burn_ulysses::{UlyssesBackend, comm::{Communicator, ThreadGroup}, data::{SequenceSharder, ShardTensors}, attention_guard::{note_shard_positions, set_guard}};
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

/// Wall time of one step over `ranks` in-process ranks (barrier to barrier, slowest rank), the
/// guard on or off.
fn step(ranks: usize, guard_on: bool) -> Duration {
    set_guard(guard_on);
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
        // As the training API runs the forward: the token ids uploaded, then the shard's
        // positions noted for the guard's rules on positions (a check of every slice, arange
        // and upload), when the guard is on.
        let tokens = shard.tokens(&device);
        let positions = guard_on.then(|| note_shard_positions(&shard.positions));
        let output = model.lm_output(tokens, &shard.positions);
        drop(positions);
        let loss = lm_loss_sum(output, labels, -100);
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
        step(ranks, true);
        let (mut off, mut on) = (Vec::new(), Vec::new());
        for _ in 0..REPEATS {
            off.push(step(ranks, false));
            on.push(step(ranks, true));
        }
        let (off, on) = (median(off), median(on));
        println!("{ranks:>4}  {:>10.1}ms  {:>10.1}ms  {:>8.3}", off.as_secs_f64() * 1e3, on.as_secs_f64() * 1e3, on.as_secs_f64() / off.as_secs_f64());
    }
}
