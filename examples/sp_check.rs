//! Runs a small Llama forward and backward pass with sequence parallelism over 4 in-process
//! ranks on the CPU, runs the same model on one device, and prints how far apart they are.
//!
//! cargo run --example sp_check [-- SP_SIZE]

use std::time::Instant;

use burn::{
    backend::{Autodiff, NdArray},
    tensor::{Int, Tensor, TensorData, backend::AutodiffBackend},
};
use burn_ulysses::{UlyssesBackend, comm::{Communicator, ReduceOp, ThreadGroup}, data::IGNORE_INDEX};
use ulysses_training::masked_cross_entropy_sum;
use ulysses_models::DecoderConfig;
use ulysses_suite::{deterministic_params, max_abs_diff, parameter_grads, shard, sum_vectors, values, worst};

type Inner = NdArray<f32>;
type Reference = Autodiff<Inner>;
type Sp = UlyssesBackend<Autodiff<Inner>>;

const BATCH: usize = 2;
const SEQ: usize = 64;
const VOCAB: usize = 64;

fn config() -> DecoderConfig {
    DecoderConfig::new(VOCAB).with_d_model(64).with_n_layers(2).with_n_heads(8).with_n_kv_heads(2)
}

/// Token `t` of sequence `b` and the next token as its target.
fn token(b: usize, t: usize) -> i64 {
    ((b * 31 + t * 17 + t * t) % VOCAB) as i64
}

fn tokens_and_targets<B: AutodiffBackend>(device: &B::Device) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
    let grid = |shift: usize| {
        let values: Vec<i64> = (0..BATCH).flat_map(|b| (0..SEQ).map(move |t| token(b, t + shift))).collect();
        Tensor::from_data(TensorData::new(values, [BATCH, SEQ]), device)
    };
    (grid(0), grid(1))
}

/// Σ over this shard's tokens of -log p(target), divided by the tokens of the whole batch,
/// so that the ranks' losses add up to the single-device mean.
fn shard_loss<B: AutodiffBackend>(logits: Tensor<B, 3>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
    masked_cross_entropy_sum(logits, targets, IGNORE_INDEX) / (BATCH * SEQ) as f64
}

struct Run {
    loss: f32,
    logits: Vec<f32>,
    grads: Vec<(String, Vec<f32>)>,
}

/// The model's loss, logits and gradients on `tokens`, shard `shard` of `of` of the batch's
/// sequences (0 of 1: the whole batch).
fn run<B: AutodiffBackend>(tokens: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>, (shard, of): (usize, usize), repeat_kv: bool) -> Run {
    let device = tokens.device();
    let model = deterministic_params(config().with_repeat_kv(repeat_kv).init::<B>(&device), 3);
    let [rows, len] = tokens.dims();
    let logits = model.forward(tokens, &burn_ulysses::data::ShardPositions::contiguous_shard(rows, len, shard, of));
    let loss = shard_loss(logits.clone(), targets);
    let grads = loss.backward();
    Run { loss: values(loss)[0], logits: values(logits), grads: parameter_grads(&model, &grads) }
}

fn main() {
    let sp: usize = std::env::args().nth(1).map_or(4, |a| a.parse().unwrap_or(0));
    if sp == 0 || SEQ % sp != 0 || config().n_heads % sp != 0 {
        eprintln!("SP_SIZE must divide both the {SEQ} tokens and the {} heads: 1, 2, 4 or 8", config().n_heads);
        std::process::exit(2);
    }
    let largest = check(sp);
    if largest > 1e-5 {
        eprintln!("FAILED: SP={sp} differs from one device by {largest:e} (> 1e-5; infinite when a value is NaN)");
        std::process::exit(1);
    }
    println!("OK: SP={sp} matches one device within 1e-5");
}

/// What `cargo run --example sp_check` prints, checked: SP=2 and SP=4 within 1e-5 of one device.
#[test]
fn sp_matches_one_device() {
    for sp in [2, 4] {
        let largest = check(sp);
        assert!(largest <= 1e-5, "SP={sp} differs from one device by {largest:e}");
    }
}

/// Runs the check at SP = `sp`, prints it, and returns the largest difference from one device
/// (infinite where a value is NaN).
fn check(sp: usize) -> f32 {
    let device = Default::default();

    let started = Instant::now();
    let (tokens, targets) = tokens_and_targets::<Reference>(&device);
    let single = run(tokens, targets, (0, 1), true);
    let single_time = started.elapsed();

    let started = Instant::now();
    let ranks = ThreadGroup::new(sp).run(|rank| {
        // Every rank is in the one SP group (no DP): the world's communicator is the group's.
        let comm = rank.communicator();
        let _sp = Sp::enter_thread(comm.clone());
        let device = Default::default();
        let (tokens, targets) = tokens_and_targets::<Sp>(&device);
        let (r, p) = (rank.rank(), rank.size());
        let run = run(shard(tokens, 1, r, p), shard(targets, 1, r, p), (r, p), false);
        let traffic = Communicator::<Inner>::traffic(&*comm);
        // The global loss is the sum of the shard losses.
        let loss = Tensor::<Inner, 1>::from_floats([run.loss], &device).into_primitive().tensor();
        let total = Communicator::<Inner>::all_reduce(&*comm, loss, ReduceOp::Sum).expect("all-reduce");
        let total: f32 = Tensor::<Inner, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(total)).into_scalar();
        (run, total, traffic)
    });
    let sp_time = started.elapsed();
    let ranks: Vec<_> = ranks.into_iter().map(|r| r.unwrap_or_else(|p| panic!("{p}"))).collect();

    let vocab_logits = |values: &[f32]| Tensor::<Inner, 3>::from_data(TensorData::new(values.to_vec(), [BATCH, SEQ, VOCAB]), &device);
    let logits_diff = worst(
        ranks
            .iter()
            .enumerate()
            .map(|(r, (run, _, _))| max_abs_diff(&run.logits, &values(shard(vocab_logits(&single.logits), 1, r, sp)))),
    );
    let grads_diff = worst(
        single
            .grads
            .iter()
            .enumerate()
            .map(|(i, (_, want))| max_abs_diff(&sum_vectors(ranks.iter().map(|(run, _, _)| &run.grads[i].1)), want)),
    );
    let sp_loss = ranks[0].1;
    let traffic = ranks[0].2;

    println!("Llama {} layers, {} q / {} kv heads, batch {BATCH} x {SEQ} tokens", config().n_layers, config().n_heads, config().n_kv_heads);
    println!("one device       : loss {:.6}  ({single_time:.2?})", single.loss);
    println!("SP={sp} (threads)  : loss {sp_loss:.6}  ({sp_time:.2?}), {} all-to-alls, {} bytes sent per rank", traffic.all_to_all_calls, traffic.all_to_all_bytes);
    println!("max |Δ| loss {:.2e}, logits {logits_diff:.2e}, gradients of {} parameters {grads_diff:.2e}", (sp_loss - single.loss).abs(), single.grads.len());
    worst([logits_diff, grads_diff, (sp_loss - single.loss).abs()])
}
