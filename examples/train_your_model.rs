//! A Burn model of your own, trained with sequence parallelism: a one-layer causal transformer
//! that calls `burn::tensor::module::attention`, trained on 2 rank threads that each hold half
//! of every sequence (SP = 2), then on one device. The two print the same losses: its
//! attention needs no change, only the backend (`UlyssesBackend`) and the training step
//! (`train_step`); its positions come from the step (`ShardPositions`: each token's place in
//! the whole sequence, not in its rank's shard).
//!
//! cargo run --release --example train_your_model

use std::sync::Mutex;

use burn::{
    backend::{Autodiff, NdArray},
    module::{Module, ModuleMapper},
    nn::{Embedding, EmbeddingConfig, Linear, LinearConfig, RmsNorm, RmsNormConfig},
    optim::AdamWConfig,
    tensor::{Int, Tensor, TensorData, backend::{AutodiffBackend, Backend}, module::attention, ops::AttentionModuleOptions},
};
use burn_ulysses::{ParallelGroups, ParallelLayout, RankScope, UlyssesBackend, UlyssesConfig, comm::ThreadGroup, data::ShardPositions};
use ulysses_training::{CausalLm, StepInput, TrainBackend, broadcast_parameters, train_step};

const VOCAB: usize = 16;
const MODEL: usize = 32;
const HEADS: usize = 4;
const SEQ: usize = 32;
const STEPS: usize = 8;
/// The SP degree.
const SP: usize = 2;
type Inner = NdArray<f32>;

#[derive(Module, Debug)]
struct TinyLm<B: Backend> {
    tokens: Embedding<B>,
    positions: Embedding<B>,
    norm: RmsNorm<B>,
    qkv: Linear<B>,
    out: Linear<B>,
    head: Linear<B>,
}

impl<B: Backend> TinyLm<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            tokens: EmbeddingConfig::new(VOCAB, MODEL).init(device),
            // A row for every position a step can give: SP pads each sequence to a multiple of
            // its degree, and padding tokens get positions too.
            positions: EmbeddingConfig::new(SEQ.next_multiple_of(SP), MODEL).init(device),
            norm: RmsNormConfig::new(MODEL).init(device),
            qkv: LinearConfig::new(MODEL, 3 * MODEL).init(device),
            out: LinearConfig::new(MODEL, MODEL).init(device),
            head: LinearConfig::new(MODEL, VOCAB).init(device),
        }
    }

    /// `tokens: [batch, seq]`, this rank's part of each sequence; `positions` says where in the
    /// whole sequence each token sits (a rank's shard starts at `rank · seq / SP`).
    fn forward(&self, tokens: Tensor<B, 2, Int>, positions: &ShardPositions) -> Tensor<B, 3> {
        let [batch, seq] = tokens.dims();
        let device = tokens.device();
        let ids = positions.ids.ids().iter().map(|&p| p as i64).collect::<Vec<_>>();
        let at = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [batch, seq]), &device);
        let x = self.tokens.forward(tokens) + self.positions.forward(at);
        let heads = |t: Tensor<B, 3>| t.reshape([batch, seq, HEADS, MODEL / HEADS]).swap_dims(1, 2);
        let [q, k, v] = self.qkv.forward(self.norm.forward(x.clone())).chunk(3, 2).try_into().unwrap();
        // The one call Ulysses intercepts: under SP it attends over the whole sequence.
        let attended = attention(heads(q), heads(k), heads(v), None, None, AttentionModuleOptions { is_causal: true, ..Default::default() });
        let x = x + self.out.forward(attended.swap_dims(1, 2).reshape([batch, seq, MODEL]));
        self.head.forward(x)
    }
}

/// What `train_step` needs of a model.
impl<B: AutodiffBackend> CausalLm<B> for TinyLm<B> {
    fn logits(&self, tokens: Tensor<B, 2, Int>, positions: &ShardPositions) -> Tensor<B, 3> {
        self.forward(tokens, positions)
    }

    fn vocab_size(&self) -> usize {
        VOCAB
    }
    fn is_causal(&self) -> bool {
        true
    }
}

/// Step `i`'s batch: 4 sequences counting up from different starts (predictable text).
fn batch(i: usize) -> Vec<Vec<i64>> {
    (0..4).map(|s| (0..SEQ).map(|t| ((i * 5 + s * 3 + t) % VOCAB) as i64).collect()).collect()
}

/// Burn draws a parameter's initial values on its first use; this draws them all at once.
struct DrawNow;

impl<B: Backend> ModuleMapper<B> for DrawNow {}

/// Trains on this rank of `groups`; returns the loss of every step.
fn train<B: TrainBackend>(groups: &ParallelGroups<B::Wire>, device: &B::Device) -> Vec<f64> {
    // Every rank starts from rank 0's parameters. The seed (rank threads share one generator:
    // one draws at a time) makes them the one-device run's too, to compare the losses.
    static INIT: Mutex<()> = Mutex::new(());
    let drawn = {
        let _one_at_a_time = INIT.lock().unwrap();
        B::seed(device, 7);
        TinyLm::<B>::new(device).map(&mut DrawNow)
    };
    let mut model = broadcast_parameters(drawn, &*groups.world).expect("rank 0's parameters");
    let mut optimizer = AdamWConfig::new().init::<B, TinyLm<B>>();
    // The layout's own sharder: it cuts the sequences as its attention expects (its ring too).
    let sharder = groups.layout.sharder();
    (0..STEPS)
        .map(|index| {
            let micro_batches = [batch(index)];
            let step = StepInput { index, learning_rate: 1e-2, micro_batches: &micro_batches, documents: None, targets: None, max_grad_norm: Some(1.0) };
            let (trained, report) = train_step(model.clone(), &mut optimizer, &step, &sharder, groups, device).expect("a training step");
            model = trained;
            report.loss
        })
        .collect()
}

/// The losses of every step at SP = 2 (rank 0's report, the same on both) and on one device.
fn sp_and_one_device() -> (Vec<f64>, Vec<f64>) {
    let layout = ParallelLayout::new().with_sp_size(SP);
    let sp = ThreadGroup::new(layout.world_size()).run(|rank| {
        let groups = ParallelGroups::new(rank.communicator(), layout).expect("2 ranks make one SP group");
        // Enter the group: from here on this thread's `attention` calls are sequence parallel.
        let _sp = burn_ulysses::context::enter(RankScope::Thread, groups.rank_context(UlyssesConfig::new()));
        train::<UlyssesBackend<Autodiff<Inner>>>(&groups, &Default::default())
    });
    let one = ThreadGroup::new(1).run(|rank| {
        let groups = ParallelGroups::new(rank.communicator(), ParallelLayout::new()).expect("one rank");
        train::<Autodiff<Inner>>(&groups, &Default::default())
    });
    let losses = |mut ranks: Vec<Result<Vec<f64>, _>>| ranks.remove(0).unwrap_or_else(|panic| panic!("rank 0: {panic}"));
    (losses(sp), losses(one))
}

fn largest_difference(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "SP = 2 and one device ran different numbers of steps");
    a.iter().zip(b).map(|(a, b)| (a - b).abs()).fold(0.0, |worst: f64, d| if worst.is_nan() || d.is_nan() { f64::NAN } else { worst.max(d) })
}

fn main() {
    let (sp, one) = sp_and_one_device();
    println!("step   loss, SP = 2   loss, one device");
    for (i, (sp, one)) in sp.iter().zip(&one).enumerate() {
        println!("{i:>4}   {sp:>12.6}   {one:>16.6}");
    }
    let worst = largest_difference(&sp, &one);
    println!("largest difference {worst:.1e}");
    if !(worst < 1e-5) {
        eprintln!("SP = 2 and one device differ by {worst:e}, more than 1e-5");
        std::process::exit(1);
    }
}

/// `cargo test` runs this (`test = true` in Cargo.toml): SP = 2 trains as one device does.
#[test]
fn sp_trains_as_one_device() {
    let (sp, one) = sp_and_one_device();
    let worst = largest_difference(&sp, &one);
    assert!(sp.len() == STEPS && worst < 1e-5, "SP = 2 {sp:?} and one device {one:?} differ by {worst}");
    assert!(one[STEPS - 1] < one[0] - 1.0, "training did not learn: {one:?}");
}
