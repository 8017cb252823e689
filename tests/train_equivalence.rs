//! Five optimizer steps of the Llama example give the same token-averaged loss at every step,
//! and the same parameters after the last, on one device and under DP and SP:
//!
//! | run          | backend                          | DP | SP | grad. accumulation |
//! |--------------|----------------------------------|----|----|--------------------|
//! | one device   | `Autodiff<NdArray>`              | 1  | 1  | 1                  |
//! | DP=2         | `UlyssesBackend<Autodiff<..>>`   | 2  | 1  | 1                  |
//! | SP=2, GAS=2  | `UlyssesBackend<Autodiff<..>>`   | 1  | 2  | 2                  |
//! | SP=4         | `UlyssesBackend<Autodiff<..>>`   | 1  | 4  | 1                  |
//! | SP=4, len 30 | `UlyssesBackend<Autodiff<..>>`   | 1  | 4  | 1                  |
//!
//! Batches mix sequence lengths (so shorter ones are padded), each padded to the run's
//! `seq_len` (256, or 30 in the last run: no multiple of 4, so padded on to 32; step 1's
//! sequence of 32 tokens fills it). Step 0's longest sequence has 13 tokens: at SP=4 and
//! length 32, rank 3's shard (positions 24..32) holds only padding with ignored labels, yet
//! that rank must run forward and backward for its peers' exchanges.

use std::time::Duration;

use burn::{
    backend::{Autodiff, NdArray},
    nn::loss::CrossEntropyLossConfig,
    optim::AdamWConfig,
    tensor::{FloatDType, Int, Tensor, TensorData},
};
use burn_ulysses::{
    ParallelGroups, ParallelLayout, RankGuard, RankScope, UlyssesBackend, UlyssesConfig,
    comm::ThreadGroup,
    data::{SequenceSharder, ShardPositions, ShardTensors},
};
use ulysses_training::{StepReport, TrainBackend, check_parameters_identical};
use ulysses_models::DecoderConfig;
use ulysses_trainer::train::{RunOptions, StepData, TrainConfig, train_rank};
use ulysses_suite::{VariedLengths, bit_identical, deterministic_params, largest_gap, max_abs_diff, paired_parameters, parameter_values, with_deadline, worst};

type Inner = NdArray<f32>;
type Reference = Autodiff<Inner>;
type Sp = UlyssesBackend<Autodiff<Inner>>;

const TOLERANCE: f32 = 1e-5;
const STEPS: usize = 5;
const VOCAB: usize = 32;
const INIT_SEED: u64 = 11;

fn config(layout: ParallelLayout, grad_accumulation: usize) -> TrainConfig {
    let model = DecoderConfig::new(VOCAB)
        .with_d_model(32)
        .with_n_heads(4)
        .with_n_kv_heads(2)
        .with_ffn_hidden(64)
        .with_repeat_kv(false);
    TrainConfig::new(model, AdamWConfig::new().with_weight_decay(0.01), layout)
        .with_grad_accumulation(grad_accumulation)
        .with_batch_size(4)
        .with_steps(STEPS)
        .with_learning_rate(1e-2)
        .with_warmup_steps(2)
        .with_eval_every(0)
}

struct Outcome {
    reports: Vec<StepReport>,
    params: Vec<(String, Vec<f32>)>,
}

impl Outcome {
    /// The largest gaps from `reference`'s step losses and final parameters; panics unless both
    /// took as many steps over the same valid tokens, with the same gradient norms (to
    /// [`TOLERANCE`] relative: AdamW's update and clipping divide a gradient's scale away, so a
    /// gradient off by a constant factor shows in its norm alone), and hold the same parameters.
    fn gaps_from(&self, reference: &Outcome, name: &str) -> (f32, f32) {
        let valid = |run: &Outcome| run.reports.iter().map(|r| r.valid_tokens).collect::<Vec<_>>();
        assert_eq!(valid(self), valid(reference), "{name}: the valid tokens of each step differ");
        let norms = |run: &Outcome| run.reports.iter().map(|r| r.grad_norm).collect::<Vec<_>>();
        let (norms, reference_norms) = (norms(self), norms(reference));
        let norm_gap = worst(norms.iter().zip(&reference_norms).map(|(a, b)| ((a - b) / b).abs() as f32));
        assert!(norms.len() == reference_norms.len() && norm_gap <= TOLERANCE, "{name}: gradient norms {norms:?} differ from one device's {reference_norms:?} by {norm_gap:e} relative");
        let losses = |run: &Outcome| run.reports.iter().map(|r| r.loss).collect::<Vec<_>>();
        (largest_gap(&losses(self), &losses(reference)), worst(paired_parameters(&self.params, &reference.params).map(|(_, a, b)| max_abs_diff(a, b))))
    }
}

/// Trains on every rank of the layout; returns world rank 0's outcome after checking that
/// all ranks agree on the reports and hold identical parameters.
fn train<B: TrainBackend<Wire = Inner>>(config: TrainConfig, enter: fn(&ParallelGroups<Inner>) -> Option<RankGuard>) -> Outcome {
    train_on::<B>(config, enter, &VariedLengths { vocab: VOCAB })
}

fn train_on<B: TrainBackend<Wire = Inner>>(config: TrainConfig, enter: fn(&ParallelGroups<Inner>) -> Option<RankGuard>, data: &dyn StepData) -> Outcome {
    let config = &config;
    let per_rank = ThreadGroup::new(config.layout.world_size()).run(|rank| {
        let groups: ParallelGroups<Inner> = ParallelGroups::new(rank.communicator(), config.layout).unwrap();
        let _sp = enter(&groups);
        let device = Default::default();
        // Ranks start from different values: training must broadcast rank 0's, which are the
        // same in every run.
        let model = deterministic_params(config.model.init::<B>(&device), INIT_SEED + rank.rank() as u64);
        let (trained, reports) = train_rank::<B>(config, model, data, &groups, &device, RunOptions::default()).unwrap();
        let model = trained.whole(&*groups.world).unwrap();
        check_parameters_identical::<B, _, Inner>(&model, &*groups.world).unwrap();
        Outcome { reports, params: parameter_values(&model) }
    });
    let mut per_rank: Vec<Outcome> = per_rank.into_iter().map(|r| r.unwrap_or_else(|p| panic!("{p}"))).collect();
    assert!(per_rank.iter().all(|o| o.reports == per_rank[0].reports), "ranks disagree on the step reports");
    per_rank.swap_remove(0)
}

fn enter_sp(groups: &ParallelGroups<Inner>) -> Option<RankGuard> {
    Some(burn_ulysses::context::enter(RankScope::Thread, groups.rank_context(UlyssesConfig::new())))
}

fn no_context(_: &ParallelGroups<Inner>) -> Option<RankGuard> {
    None
}

/// How one rank of [`errors_of_two_ranks`] trains: its config, the rank context it enters (if
/// any) and its data.
type RankSetup<D = VariedLengths> = (TrainConfig, Option<RankGuard>, D);

/// Trains on two rank threads, each set up by `setup(rank, groups)`, and returns each rank's
/// error; fails where a rank panicked or trained.
fn errors_of_two_ranks<D: StepData>(layout: ParallelLayout, setup: impl Fn(usize, &ParallelGroups<Inner>) -> RankSetup<D> + Send + Sync + 'static) -> Vec<String> {
    let results = with_deadline(Duration::from_secs(50), move || {
        ThreadGroup::new(2).run(|rank| {
            let groups: ParallelGroups<Inner> = ParallelGroups::new(rank.communicator(), layout).unwrap();
            let (config, _context, data) = setup(rank.rank(), &groups);
            let device = Default::default();
            let model = config.model.init::<Sp>(&device);
            train_rank::<Sp>(&config, model, &data, &groups, &device, RunOptions::default()).err().map(|e| e.to_string())
        })
    });
    results
        .into_iter()
        .enumerate()
        .map(|(rank, result)| {
            let error = result.unwrap_or_else(|p| panic!("rank {rank} panicked instead of returning an error: {p}"));
            error.unwrap_or_else(|| panic!("rank {rank} trained"))
        })
        .collect()
}

#[test]
fn one_device_dp_sp_and_accumulation_take_the_same_steps() {
    let runs = with_deadline(Duration::from_secs(55), || {
        let single = train::<Reference>(
            {
                let mut c = config(ParallelLayout::new(), 1);
                // Burn's own attention needs kv heads expanded; the parameters are the same.
                c.model.repeat_kv = true;
                c
            },
            no_context,
        );
        let dp2 = train::<Sp>(config(ParallelLayout::new().with_dp_size(2), 1), enter_sp);
        let sp2_gas2 = train::<Sp>(config(ParallelLayout::new().with_sp_size(2), 2), enter_sp);
        let sp4 = train::<Sp>(config(ParallelLayout::new().with_sp_size(4), 1), enter_sp);
        // A length that is no multiple of SP: batches padded past it, to 32.
        let sp4_uneven = train::<Sp>(config(ParallelLayout::new().with_sp_size(4), 1).with_seq_len(30), enter_sp);
        [("one device", single), ("DP=2", dp2), ("SP=2 GAS=2", sp2_gas2), ("SP=4", sp4), ("SP=4 len 30", sp4_uneven)]
    });

    let (_, reference) = &runs[0];
    let valid: Vec<usize> = (0..STEPS).map(|s| SequenceSharder::labels_in(&VariedLengths { vocab: VOCAB }.train_batch(s))).collect();
    assert_eq!(reference.reports.iter().map(|r| r.valid_tokens).collect::<Vec<_>>(), valid);
    let independent = first_step_loss_with_burn_cross_entropy();
    let diff = (reference.reports[0].loss - independent).abs();
    println!("step 0 loss {:.6}, burn's CrossEntropyLoss per unpadded sequence {independent:.6}", reference.reports[0].loss);
    assert!(diff <= TOLERANCE as f64, "the trainer's step-0 loss differs from burn's cross-entropy by {diff:e}");
    assert!(reference.reports[STEPS - 1].loss < reference.reports[0].loss, "the loss should fall");
    for (name, run) in &runs[1..] {
        let (loss_diff, param_diff) = run.gaps_from(reference, name);
        let losses: Vec<String> = run.reports.iter().map(|r| format!("{:.6}", r.loss)).collect();
        println!("{name:>10}: losses [{}], max |Δ| loss {loss_diff:.2e}, parameters {param_diff:.2e}", losses.join(", "));
        assert!(loss_diff <= TOLERANCE, "{name}: step loss differs from one device by {loss_diff:e}");
        assert!(param_diff <= TOLERANCE, "{name}: parameters differ from one device by {param_diff:e}");
    }
}

/// Two paragraphs (the first ends in a blank line, `\n\n` = tokens 10 10) per sequence of up
/// to 32 tokens, with boundaries on shard edges (8, 16) and inside shards; `split` gives each
/// paragraph as a sequence of its own instead.
struct Paragraphs {
    split: bool,
}

impl Paragraphs {
    const FIRST: [[usize; 4]; 2] = [[8, 16, 5, 13], [16, 3, 24, 9]];
    const SECOND: [[usize; 4]; 2] = [[24, 16, 20, 2], [10, 29, 8, 23]];
}

impl StepData for Paragraphs {
    fn train_batch(&self, step: usize) -> Vec<Vec<i64>> {
        let text = |seed: usize, len: usize| -> Vec<i64> {
            // Content tokens avoid 10, so the only blank line is the one that ends a paragraph.
            (0..len).map(|t| match ((seed * 13 + t * t + 5 * t) % VOCAB) as i64 { 10 => 11, token => token }).collect()
        };
        let mut sequences = vec![];
        for i in 0..4 {
            let (first_len, second_len) = (Self::FIRST[step % 2][i], Self::SECOND[step % 2][i]);
            let mut first = text(step * 8 + i, first_len - 2);
            first.extend([10, 10]);
            let second = text(step * 8 + i + 4, second_len);
            if self.split {
                sequences.extend([first, second]);
            } else {
                sequences.push([first, second].concat());
            }
        }
        sequences
    }

    fn eval_batch(&self) -> Option<Vec<Vec<i64>>> {
        None
    }
}

/// Packed training (`pack`: paragraphs are documents) gives, at SP 2 and 4, the steps of one
/// device, and those equal training on the same paragraphs as separate sequences: the
/// packing changes nothing but the layout.
#[test]
fn packed_documents_train_like_one_device_and_like_the_documents_one_by_one() {
    let packed = |layout: ParallelLayout| {
        let mut c = config(layout, 1).with_seq_len(32).with_pack(true);
        c.model.repeat_kv = layout.sp_size == 1;
        c
    };
    let runs = with_deadline(Duration::from_secs(55), move || {
        let single = train_on::<Reference>(packed(ParallelLayout::new()), no_context, &Paragraphs { split: false });
        let mut split = config(ParallelLayout::new(), 1).with_seq_len(32).with_batch_size(8);
        split.model.repeat_kv = true;
        let one_by_one = train_on::<Reference>(split, no_context, &Paragraphs { split: true });
        let sp2 = train_on::<Sp>(packed(ParallelLayout::new().with_sp_size(2)), enter_sp, &Paragraphs { split: false });
        let sp4 = train_on::<Sp>(packed(ParallelLayout::new().with_sp_size(4)), enter_sp, &Paragraphs { split: false });
        [("packed on one device", single), ("documents one by one", one_by_one), ("packed SP=2", sp2), ("packed SP=4", sp4)]
    });
    assert_like_the_first(&runs);
}

/// Every run after the first took the first's steps: the same valid tokens each step, losses
/// and final parameters within [`TOLERANCE`].
fn assert_like_the_first(runs: &[(&str, Outcome)]) {
    let (first, reference) = &runs[0];
    for (name, run) in &runs[1..] {
        let (loss_diff, param_diff) = run.gaps_from(reference, name);
        println!("{name:>22}: max |Δ| loss {loss_diff:.2e}, parameters {param_diff:.2e} against {first}");
        assert!(loss_diff <= TOLERANCE, "{name}: step loss differs by {loss_diff:e}");
        assert!(param_diff <= TOLERANCE, "{name}: parameters differ by {param_diff:e}");
    }
}

/// Ulysses × Ring training: SP=4 as 2 × 2 (contiguous and zigzag) and as a pure ring 1 × 4,
/// 5 AdamW steps with padding, against one device.
#[test]
fn ulysses_by_ring_trains_like_one_device() {
    use burn_ulysses::ring::RingSharding;
    let hybrid = |ring: usize, sharding: RingSharding| {
        let layout = ParallelLayout::new().with_sp_size(4).with_ring_size(ring).with_ring_sharding(sharding);
        // Zigzag cuts the sequence in 2 · 4 · ... pieces: pad to a length they divide.
        config(layout, 1).with_seq_len(32)
    };
    let runs = with_deadline(Duration::from_secs(55), move || {
        let mut single = config(ParallelLayout::new(), 1).with_seq_len(32);
        single.model.repeat_kv = true;
        let single = train::<Reference>(single, no_context);
        let two_by_two = train::<Sp>(hybrid(2, RingSharding::Contiguous), enter_sp);
        let zigzag = train::<Sp>(hybrid(2, RingSharding::Zigzag), enter_sp);
        let ring = train::<Sp>(hybrid(4, RingSharding::Zigzag), enter_sp);
        [("one device", single), ("2 x 2", two_by_two), ("2 x 2 zigzag", zigzag), ("1 x 4 zigzag", ring)]
    });
    let (_, reference) = &runs[0];
    for (name, run) in &runs[1..] {
        let (loss_diff, param_diff) = run.gaps_from(reference, name);
        println!("{name:>14}: max |Δ| loss {loss_diff:.2e}, parameters {param_diff:.2e} against one device");
        assert!(loss_diff <= TOLERANCE, "{name}: step loss differs by {loss_diff:e}");
        assert!(param_diff <= TOLERANCE, "{name}: parameters differ by {param_diff:e}");
    }
}

/// Supervised fine-tuning data: `VariedLengths`' sequences, each a prompt (its first third)
/// and an answer (the rest): only the answer's tokens are targets.
struct Answers;

impl Answers {
    fn targets(sequence: &[i64]) -> Vec<bool> {
        (0..sequence.len()).map(|j| j >= sequence.len() / 3).collect()
    }
}

impl StepData for Answers {
    fn train_batch(&self, step: usize) -> Vec<Vec<i64>> {
        VariedLengths { vocab: VOCAB }.train_batch(step)
    }
    fn eval_batch(&self) -> Option<Vec<Vec<i64>>> {
        None
    }
    fn train_targets(&self, _step: usize, batch: &[Vec<i64>]) -> Option<Vec<Vec<bool>>> {
        Some(batch.iter().map(|s| Answers::targets(s)).collect())
    }
}

/// Trained on the answers alone, SP=2 and SP=2 × DP=2 take the steps one device takes, and
/// step 0's loss is the mean cross-entropy over exactly the answers' tokens, computed without
/// the trainer (the model's logits over each whole sequence, log-softmax in f64, the answer
/// positions picked by hand); the valid tokens are the answers' token count. Broken once
/// (targets ignored by the sharder): every run's loss and count move.
#[test]
fn answers_alone_train_alike_at_every_layout_and_step_0_is_their_mean_loss() {
    let runs = with_deadline(Duration::from_secs(55), || {
        let mut single = config(ParallelLayout::new(), 1);
        single.model.repeat_kv = true;
        let single = train_on::<Reference>(single, no_context, &Answers);
        let sp2 = train_on::<Sp>(config(ParallelLayout::new().with_sp_size(2), 1), enter_sp, &Answers);
        let sp2dp2 = train_on::<Sp>(config(ParallelLayout::new().with_sp_size(2).with_dp_size(2), 1), enter_sp, &Answers);
        [("one device", single), ("SP=2", sp2), ("SP=2 x DP=2", sp2dp2)]
    });

    let device = Default::default();
    let model = deterministic_params(config(ParallelLayout::new(), 1).model.with_repeat_kv(true).init::<Inner>(&device), INIT_SEED);
    let (mut total, mut count) = (0.0f64, 0usize);
    for sequence in Answers.train_batch(0) {
        let (n, targets) = (sequence.len(), Answers::targets(&sequence));
        let inputs = Tensor::<Inner, 2, Int>::from_data(TensorData::new(sequence.clone(), [1, n]), &device);
        let logits: Vec<f32> = model.forward(inputs, &ShardPositions::consecutive(1, n)).into_data().to_vec().unwrap();
        for position in 0..n - 1 {
            if targets[position + 1] {
                let row: Vec<f64> = logits[position * VOCAB..(position + 1) * VOCAB].iter().map(|&x| f64::from(x)).collect();
                let largest = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let log_sum = largest + row.iter().map(|x| (x - largest).exp()).sum::<f64>().ln();
                total += log_sum - row[sequence[position + 1] as usize];
                count += 1;
            }
        }
    }
    let expected = total / count as f64;
    let (_, reference) = &runs[0];
    println!("step 0: {count} answer tokens, mean loss {expected:.7} by hand, {:.7} trained", reference.reports[0].loss);
    assert_eq!(reference.reports[0].valid_tokens, count, "the step's labels are not exactly the answers' tokens");
    assert!((reference.reports[0].loss - expected).abs() <= 1e-5, "step 0's loss {} is not the answers' mean {expected}", reference.reports[0].loss);
    assert_like_the_first(&runs);
}

/// Step 0's token-averaged loss computed without the trainer: each sequence alone (no
/// padding, no sharding), burn's `CrossEntropyLoss` against the next tokens.
fn first_step_loss_with_burn_cross_entropy() -> f64 {
    let device = Default::default();
    let model_config = config(ParallelLayout::new(), 1).model.with_repeat_kv(true);
    let model = deterministic_params(model_config.init::<Inner>(&device), INIT_SEED);
    let loss = CrossEntropyLossConfig::new().init::<Inner>(&device);
    let (mut total, mut count) = (0.0, 0);
    for sequence in (VariedLengths { vocab: VOCAB }).train_batch(0) {
        let n = sequence.len() - 1;
        let inputs = Tensor::<Inner, 2, Int>::from_data(TensorData::new(sequence[..n].to_vec(), [1, n]), &device);
        let targets = Tensor::<Inner, 1, Int>::from_data(TensorData::new(sequence[1..].to_vec(), [n]), &device);
        let [rows, len] = inputs.dims();
        let logits = model.forward(inputs, &ShardPositions::consecutive(rows, len)).reshape([n, VOCAB]);
        let mean: f32 = loss.forward(logits, targets).into_scalar();
        total += mean as f64 * n as f64;
        count += n;
    }
    total / count as f64
}

#[test]
fn training_refuses_sequence_parallelism_that_attention_never_reached() {
    let layout = ParallelLayout::new().with_sp_size(2);
    // No rank context entered: attention would silently stay within each shard. It refuses
    // the shard the step noted (a model attending without the op is refused after the step:
    // `NotSequenceParallel`).
    for message in errors_of_two_ranks(layout, move |_, _| (config(layout, 1), None, VariedLengths { vocab: VOCAB })) {
        assert!(message.contains("spread over 2 ranks") && message.contains("no rank context spreads them") && message.contains("groups.rank_context(UlyssesConfig::new())"), "{message}");
    }
    // A model that attends on one device on purpose: the step finds no exchange.
    use ulysses_training::{StepInput, train_step};
    let on_one_device = with_deadline(Duration::from_secs(50), move || {
        ThreadGroup::new(2).run(|rank| {
            let groups: ParallelGroups<Inner> = ParallelGroups::new(rank.communicator(), layout).unwrap();
            let _sp = enter_sp(&groups);
            let device = Default::default();
            let decoder = deterministic_params(config(layout, 1).model.init::<Sp>(&device), INIT_SEED);
            let batch = vec![vec![(0..16).map(|t| t % 32).collect::<Vec<i64>>()]];
            let step = StepInput { index: 0, learning_rate: 1e-2, micro_batches: &batch, documents: None, targets: None, max_grad_norm: None };
            train_step(OnOneDevice { decoder }, &mut AdamWConfig::new().init(), &step, &layout.sharder(), &groups, &device).err().map(|e| e.to_string())
        })
    });
    for message in on_one_device {
        let message = message.unwrap_or_else(|p| panic!("{p}")).expect("a step whose attention stayed on each rank's shard was refused");
        assert!(message.contains("did not exchange through the SP group") && message.contains("groups.rank_context(UlyssesConfig::new())"), "{message}");
    }
    // A context entered with the world's communicator (the README's snippet once did so): its
    // all-to-alls are not the SP group's, and the step names the communicator to enter.
    for message in errors_of_two_ranks(layout, move |_, groups| (config(layout, 1), Some(Sp::enter_thread(groups.world.clone())), VariedLengths { vocab: VOCAB })) {
        assert!(
            message.contains("exchanged through the rank context entered on this thread, but not through this step's SP group")
                && message.contains("groups.rank_context(UlyssesConfig::new())"),
            "{message}"
        );
    }
}

/// A failure inside a rank's forward comes back from training as that step's error on every
/// rank, not as a panic that tears the rank down: here rank 1 forbids the dense attention
/// NdArray needs, and rank 0's next exchange finds rank 1 gone.
#[test]
fn a_failure_inside_the_forward_is_every_ranks_error_not_a_panic() {
    use burn_ulysses::{RankScope, UlyssesConfig};
    let layout = ParallelLayout::new().with_sp_size(2);
    let messages = errors_of_two_ranks(layout, move |rank, groups| {
        let forbid = UlyssesConfig::new().with_forbid_dense_fallback(rank == 1);
        (config(layout, 1), Some(Sp::enter(RankScope::Thread, groups.sp.clone(), forbid)), VariedLengths { vocab: VOCAB })
    });
    println!("{messages:#?}");
    assert!(messages[1].starts_with("step 0") && messages[1].contains("forbid_dense_fallback"), "{}", messages[1]);
    assert!(messages[0].starts_with("step 0") && messages[0].contains("rank 1 left"), "{}", messages[0]);
    // The errors as they were, not the panics' messages: rank 0's a peer's loss (a trainer
    // exits 76 on it, for a launcher to name rank 1), rank 1's its own.
    let peer_losses = with_deadline(Duration::from_secs(50), move || {
        ThreadGroup::new(2).run(|rank| {
            let groups: ParallelGroups<Inner> = ParallelGroups::new(rank.communicator(), layout).unwrap();
            let _context = Sp::enter(RankScope::Thread, groups.sp.clone(), UlyssesConfig::new().with_forbid_dense_fallback(rank.rank() == 1));
            let device = Default::default();
            let config = config(layout, 1);
            let model = config.model.init::<Sp>(&device);
            train_rank::<Sp>(&config, model, &VariedLengths { vocab: VOCAB }, &groups, &device, RunOptions::default()).err().map(|e| e.is_peer_loss())
        })
    });
    let peer_losses: Vec<_> = peer_losses.into_iter().map(|r| r.unwrap_or_else(|p| panic!("{p}"))).collect();
    assert_eq!(peer_losses, [Some(true), Some(false)], "rank 0 failed on rank 1's loss inside attention, rank 1 on its own");
}

/// Step inputs that would train wrong or part the ranks are refused on every rank, before any
/// forward, each rank naming the cause: a sharder that lays sequences over another ring than
/// the layout's (zigzag attention over contiguous shards would see the future), DP ranks with
/// different numbers of micro-batches (under ZeRO-3, collectives of different rounds), one
/// rank's document lengths that do not fit its tokens (the others name that rank, rather than
/// finding it gone), the ranks of an SP group given different sequences; `evaluate` refuses a
/// sharder for another SP degree.
#[test]
fn step_inputs_that_would_train_wrong_or_part_the_ranks_are_refused_on_every_rank() {
    use ulysses_training::{StepInput, backward_step, evaluate, train_step};
    type Scenario = fn(usize) -> (ParallelLayout, SequenceSharder, Vec<Vec<Vec<i64>>>, Option<Vec<Vec<Vec<usize>>>>);
    let sequence = |len: usize| (0..len as i64).map(|t| t % VOCAB as i64).collect::<Vec<i64>>();
    let run = |scenario: Scenario| -> Vec<String> {
        with_deadline(Duration::from_secs(50), move || {
            ThreadGroup::new(2).run(|rank| {
                let (layout, sharder, micro_batches, documents) = scenario(rank.rank());
                let groups: ParallelGroups<Inner> = ParallelGroups::new(rank.communicator(), layout).unwrap();
                let _sp = enter_sp(&groups);
                let device = Default::default();
                let model = config(layout, 1).model.init::<Sp>(&device);
                let step = StepInput { index: 0, learning_rate: 1e-2, micro_batches: &micro_batches, documents: documents.as_deref(), targets: None, max_grad_norm: None };
                backward_step(&model, &step, &sharder, &groups, &device).err().map(|e| e.to_string()).expect("refused")
            })
        })
        .into_iter()
        .enumerate()
        .map(|(rank, result)| result.unwrap_or_else(|p| panic!("rank {rank} panicked instead of refusing: {p}")))
        .collect()
    };

    let zigzag = ParallelLayout::new().with_sp_size(2).with_ring_size(2).with_ring_sharding(burn_ulysses::ring::RingSharding::Zigzag);
    for message in run(|_| {
        let layout = ParallelLayout::new().with_sp_size(2).with_ring_size(2).with_ring_sharding(burn_ulysses::ring::RingSharding::Zigzag);
        (layout, SequenceSharder::new(2), vec![vec![(0..16).map(|t| t % 32).collect()]], None)
    }) {
        assert!(message.contains("ring of 1 (Contiguous) but the layout's ring is 2 (Zigzag)") && message.contains("layout.sharder()"), "{message}");
    }
    assert_eq!((zigzag.sharder().ring_size, zigzag.sharder().ring_sharding), (2, burn_ulysses::ring::RingSharding::Zigzag));

    // An ignore index that is a token (every label equal to it would leave the loss), padding
    // outside the vocabulary (the lookup would fail deep in the embedding).
    for message in run(|_| {
        let layout = ParallelLayout::new().with_sp_size(2);
        (layout, layout.sharder().with_ignore_index(3), vec![vec![(0..16).map(|t| t % 32).collect()]], None)
    }) {
        assert!(message.contains("ignore_index 3 is a token of the model's vocabulary 0..32") && message.contains("-100"), "{message}");
    }
    for message in run(|_| {
        let layout = ParallelLayout::new().with_sp_size(2);
        (layout, layout.sharder().with_pad_token(32), vec![vec![(0..15).map(|t| t % 32).collect()]], None)
    }) {
        assert!(message.contains("pad_token 32 is outside the model's vocabulary 0..32"), "{message}");
    }

    let messages = run(|rank| {
        let layout = ParallelLayout::new().with_dp_size(2);
        (layout, layout.sharder(), vec![vec![(0..16).map(|t| t % 32).collect()]; 2 - rank], None)
    });
    for message in &messages {
        assert!(message.contains("different numbers of micro-batches for step 0 ([2, 1]"), "{message}");
    }

    // The ranks of an SP group given other sequences (data sliced by world rank).
    for message in run(|rank| {
        let layout = ParallelLayout::new().with_sp_size(2);
        (layout, layout.sharder(), vec![vec![(0..16).map(|t| (t + rank as i64) % 32).collect()]], None)
    }) {
        assert!(message.contains("world ranks 0 and 1 of one SP group (DP replica 0) were given different sequences for step 0"), "{message}");
    }

    let messages = run(|rank| {
        let layout = ParallelLayout::new().with_dp_size(2);
        let documents = vec![vec![if rank == 1 { vec![10, 5] } else { vec![10, 6] }]];
        (layout, layout.sharder(), vec![vec![(0..16).map(|t| t % 32).collect()]], Some(documents))
    });
    assert!(messages[1].contains("micro-batch 0: sequence 0: document lengths [10, 5] must be positive and sum to its 16 tokens"), "{}", messages[1]);
    assert!(messages[0].contains("rank 1 refused its inputs for step 0"), "{}", messages[0]);

    let results = with_deadline(Duration::from_secs(50), move || {
        ThreadGroup::new(2).run(|rank| {
            let groups: ParallelGroups<Inner> = ParallelGroups::new(rank.communicator(), ParallelLayout::new().with_sp_size(2)).unwrap();
            let device = Default::default();
            let batch = vec![sequence(16)];
            evaluate::<Inner, Inner>(|_, _| unreachable!("refused before the forward"), &batch, None, None, &SequenceSharder::new(4), groups.sp_rank(), &*groups.sp, &device)
                .err()
                .map(|e| e.to_string())
        })
    });
    for result in results {
        let message = result.unwrap().expect("evaluate refuses a sharder for 4 ranks in a group of 2");
        assert!(message.contains("cuts sequences into 4 shards") && message.contains("the SP group has 2 ranks"), "{message}");
    }

    // A rank context entered with another ring than the layout's (zigzag attention over
    // contiguous shards), refused by the step and by `evaluate`; `evaluate` on a thread without
    // the rank context (each rank would attend within its shard), refused by attention.
    let results_of_rings = with_deadline(Duration::from_secs(50), move || {
        ThreadGroup::new(2).run(|rank| {
            let layout = ParallelLayout::new().with_sp_size(2).with_ring_size(2);
            let groups: ParallelGroups<Inner> = ParallelGroups::new(rank.communicator(), layout).unwrap();
            let device = Default::default();
            let model = config(layout, 1).model.init::<Sp>(&device);
            let batch = vec![vec![(0..16).map(|t| t % 32).collect::<Vec<i64>>()]];
            let forward = |tokens, positions: &_| Ok(model.lm_output(tokens, positions));
            let unentered = evaluate::<Sp, Inner>(forward, &batch[0], None, None, &layout.sharder(), groups.sp_rank(), &*groups.sp, &device).err().map(|e| e.to_string());
            let zigzag = UlyssesConfig::new().with_ring_sharding(burn_ulysses::ring::RingSharding::Zigzag);
            let _ring = Sp::enter_hybrid(RankScope::Thread, groups.ulysses.clone(), groups.ring.clone().unwrap(), zigzag);
            let step = StepInput { index: 0, learning_rate: 1e-2, micro_batches: &batch, documents: None, targets: None, max_grad_norm: None };
            let stepped = backward_step(&model, &step, &layout.sharder(), &groups, &device).err().map(|e| e.to_string());
            let evaluated = evaluate::<Sp, Inner>(forward, &batch[0], None, None, &layout.sharder(), groups.sp_rank(), &*groups.sp, &device).err().map(|e| e.to_string());
            [unentered, stepped, evaluated]
        })
    });
    // Ranks whose models come from other seeds, never broadcast: refused at their first step.
    let one_step_at_sp_2 = |seed_of_rank: fn(usize) -> u64, ignores_documents: bool, documents: Option<Vec<Vec<Vec<usize>>>>| {
        with_deadline(Duration::from_secs(50), move || {
            ThreadGroup::new(2).run(|rank| {
                let layout = ParallelLayout::new().with_sp_size(2);
                let groups: ParallelGroups<Inner> = ParallelGroups::new(rank.communicator(), layout).unwrap();
                let _sp = enter_sp(&groups);
                let device = Default::default();
                let decoder = deterministic_params(config(layout, 1).model.init::<Sp>(&device), seed_of_rank(rank.rank()));
                let batch = vec![vec![(0..16).map(|t| t % 32).collect::<Vec<i64>>()]];
                let step = StepInput { index: 3, learning_rate: 1e-2, micro_batches: &batch, documents: documents.as_deref(), targets: None, max_grad_norm: None };
                // The whole step: the documents' refusal comes with the step's health check.
                let refused = match ignores_documents {
                    true => train_step(IgnoresDocuments { decoder }, &mut AdamWConfig::new().init(), &step, &layout.sharder(), &groups, &device).err(),
                    false => train_step(decoder, &mut AdamWConfig::new().init(), &step, &layout.sharder(), &groups, &device).err(),
                };
                refused.map(|e| e.to_string()).expect("refused")
            })
        })
        .into_iter()
        .map(|result| result.unwrap_or_else(|p| panic!("{p}")))
        .collect::<Vec<_>>()
    };
    for message in one_step_at_sp_2(|rank| INIT_SEED + rank as u64, false, None) {
        assert!(message.contains("world ranks 0 and 1 start step 3 from different parameters") && message.contains("broadcast_parameters"), "{message}");
    }
    // Two documents a sequence, and a model whose attention ignores them.
    for message in one_step_at_sp_2(|_| INIT_SEED, true, Some(vec![vec![vec![9, 7]]])) {
        assert!(message.contains("step 3 packs several documents") && message.contains("attention_in_documents"), "{message}");
    }
    for result in results_of_rings {
        let [unentered, stepped, evaluated] = result.unwrap_or_else(|p| panic!("{p}")).map(|m| m.expect("refused"));
        assert!(unentered.contains("spread over 2 ranks") && unentered.contains("no rank context spreads them"), "{unentered}");
        for message in [stepped, evaluated] {
            assert!(message.contains("attends over a ring of 2 (Zigzag) but the data is laid out over a ring of 2 (Contiguous)"), "{message}");
        }
    }
}

/// Step settings that would train silently wrong are refused on every rank by the library (the
/// trainer's flags are checked apart): a clipping limit below 0 turned the gradient around, 0
/// zeroed it, NaN clipped nothing; a learning rate below 0 climbed the loss.
#[test]
fn step_settings_that_would_train_wrong_are_refused_on_every_rank() {
    use ulysses_training::{StepInput, train_step};
    let cases = [
        (1e-2, Some(-1.0), "max_grad_norm is -1;"),
        (1e-2, Some(0.0), "max_grad_norm is 0;"),
        (1e-2, Some(f64::NAN), "max_grad_norm is NaN;"),
        (-1e-3, None, "the learning rate is -0.001;"),
        (f64::INFINITY, None, "the learning rate is inf;"),
    ];
    for (learning_rate, max_grad_norm, needle) in cases {
        let messages = refusals_at_sp_2(move |_, decoder, groups, batch| {
            let step = StepInput { index: 2, learning_rate, micro_batches: batch, documents: None, targets: None, max_grad_norm };
            train_step(decoder, &mut AdamWConfig::new().init(), &step, &groups.layout.sharder(), groups, &Default::default()).err()
        });
        for (rank, message) in messages.into_iter().enumerate() {
            assert!(message.contains("step 2") && message.contains(needle), "rank {rank}, `{needle}` missing from: {message}");
        }
    }
}

/// The ranks' parameters are compared at each model's first step on a rank thread, not at the
/// thread's first alone: a second model, built from other seeds on each rank after a first that
/// trained, is refused as the first would be (it was taken for the first, compared already).
#[test]
fn a_second_model_on_the_same_rank_threads_is_compared_too() {
    use ulysses_training::{StepInput, train_step};
    let messages = with_deadline(Duration::from_secs(50), || {
        ThreadGroup::new(2).run(|rank| {
            let layout = ParallelLayout::new().with_sp_size(2);
            let groups: ParallelGroups<Inner> = ParallelGroups::new(rank.communicator(), layout).unwrap();
            let _sp = enter_sp(&groups);
            let device = Default::default();
            let batch = vec![vec![(0..16).map(|t| t % 32).collect::<Vec<i64>>()]];
            let step = StepInput { index: 0, learning_rate: 1e-2, micro_batches: &batch, documents: None, targets: None, max_grad_norm: None };
            let first = deterministic_params(config(layout, 1).model.init::<Sp>(&device), INIT_SEED);
            train_step(first, &mut AdamWConfig::new().init(), &step, &layout.sharder(), &groups, &device).map(|_| ()).expect("one model on both ranks");
            let second = deterministic_params(config(layout, 1).model.init::<Sp>(&device), INIT_SEED + 1 + rank.rank() as u64);
            train_step(second, &mut AdamWConfig::new().init(), &step, &layout.sharder(), &groups, &device).err().map(|e| e.to_string()).expect("refused")
        })
    });
    for (rank, message) in messages.into_iter().enumerate() {
        let message = message.unwrap_or_else(|p| panic!("rank {rank} panicked: {p}"));
        assert!(message.contains("world ranks 0 and 1 start step 0 from different parameters"), "rank {rank}: {message}");
    }
}

/// Each of two SP ranks' refusal from `step` (its rank, the decoder of one seed, its groups
/// entered, a 16-token batch): a rank that panics, or does not refuse, fails the test.
fn refusals_at_sp_2(step: impl Fn(usize, ulysses_models::Decoder<Sp>, &ParallelGroups<Inner>, &[Vec<Vec<i64>>]) -> Option<burn_ulysses::UlyssesError> + Send + Sync + 'static) -> Vec<String> {
    let messages = with_deadline(Duration::from_secs(50), move || {
        ThreadGroup::new(2).run(|rank| {
            let layout = ParallelLayout::new().with_sp_size(2);
            let groups: ParallelGroups<Inner> = ParallelGroups::new(rank.communicator(), layout).unwrap();
            let _sp = enter_sp(&groups);
            let decoder = deterministic_params(config(layout, 1).model.init::<Sp>(&Default::default()), INIT_SEED);
            let batch = vec![vec![(0..16).map(|t| t % 32).collect::<Vec<i64>>()]];
            step(rank.rank(), decoder, &groups, &batch).map(|e| e.to_string()).expect("refused")
        })
    });
    messages.into_iter().enumerate().map(|(rank, m)| m.unwrap_or_else(|p| panic!("rank {rank} panicked: {p}"))).collect()
}

/// A model that attends both ways with no mask, though it says it is causal
/// (`CausalLm::is_causal`): a model adapted from a causal one, its attention's flag changed.
#[derive(burn::module::Module, Debug)]
struct BothWays<B: burn::tensor::backend::Backend> {
    embed: burn::nn::Embedding<B>,
    qkv: burn::nn::Linear<B>,
    head: burn::nn::Linear<B>,
}

impl<B: burn::tensor::backend::AutodiffBackend> ulysses_training::CausalLm<B> for BothWays<B> {
    fn logits(&self, tokens: Tensor<B, 2, Int>, _positions: &ShardPositions) -> Tensor<B, 3> {
        let [batch, seq] = tokens.dims();
        let x = self.embed.forward(tokens);
        let heads = |t: Tensor<B, 3>| t.reshape([batch, seq, 2, 8]).swap_dims(1, 2);
        let [q, k, v] = self.qkv.forward(x.clone()).chunk(3, 2).try_into().unwrap();
        let options = burn::tensor::ops::AttentionModuleOptions { is_causal: false, ..Default::default() };
        let attended = burn::tensor::module::attention(heads(q), heads(k), heads(v), None, None, options);
        self.head.forward(x + attended.swap_dims(1, 2).reshape([batch, seq, 16]))
    }
    fn vocab_size(&self) -> usize {
        VOCAB
    }
    fn is_causal(&self) -> bool {
        true
    }
}

/// A model whose attention looks both ways without a mask over sequences padded at their end
/// lets real tokens attend to the padding (one device on the sequences alone does not), at
/// any SP degree: refused on every rank at SP=2 and on one rank, naming `is_causal`. The same
/// model over sequences that need no padding trains.
#[test]
fn attention_both_ways_over_padded_sequences_is_refused() {
    use burn::nn::{EmbeddingConfig, LinearConfig};
    use ulysses_training::{StepInput, train_step};
    for sp in [2, 1] {
        let outcomes = with_deadline(Duration::from_secs(50), move || {
            ThreadGroup::new(sp).run(|rank| {
                let layout = ParallelLayout::new().with_sp_size(sp);
                let groups: ParallelGroups<Inner> = ParallelGroups::new(rank.communicator(), layout).unwrap();
                let _sp = enter_sp(&groups);
                let device = Default::default();
                let model = deterministic_params(
                    BothWays { embed: EmbeddingConfig::new(VOCAB, 16).init::<Sp>(&device), qkv: LinearConfig::new(16, 48).init(&device), head: LinearConfig::new(16, VOCAB).init(&device) },
                    INIT_SEED,
                );
                let mut optimizer = AdamWConfig::new().init();
                let step_on = |sequences: Vec<Vec<i64>>, model: BothWays<Sp>, optimizer: &mut _| {
                    let micro_batches = vec![sequences];
                    let step = StepInput { index: 0, learning_rate: 1e-3, micro_batches: &micro_batches, documents: None, targets: None, max_grad_norm: None };
                    train_step(model, optimizer, &step, &layout.sharder(), &groups, &device).map(|(_, report)| report.loss).map_err(|e| e.to_string())
                };
                // Lengths 8 and 6: the second padded to 8.
                let padded = step_on(vec![(0..8).collect(), (0..6).collect()], model.clone(), &mut optimizer);
                let unpadded = step_on(vec![(0..8).collect(), (8..16).collect()], model, &mut optimizer);
                (padded, unpadded)
            })
        });
        for (rank, outcome) in outcomes.into_iter().enumerate() {
            let (padded, unpadded) = outcome.unwrap_or_else(|p| panic!("SP={sp} rank {rank} panicked: {p}"));
            let message = padded.expect_err("padded sequences attended both ways were trained on");
            assert!(
                message.contains("looked both ways (is_causal false, and no mask or bias) over sequences padded at their end")
                    && message.contains("AttentionModuleOptions { is_causal: true, .. }"),
                "SP={sp} rank {rank}: {message}"
            );
            let loss = unpadded.unwrap_or_else(|e| panic!("SP={sp} rank {rank}: sequences without padding refused: {e}"));
            assert!(loss.is_finite(), "SP={sp} rank {rank}: {loss}");
        }
    }
}

/// Checkpointing settings one rank refuses (a tile of 0 tokens on rank 0 alone) stop every
/// rank: the refusing rank still joins the step's first collective, where the others learn it.
#[test]
fn checkpointing_one_rank_refuses_stops_every_rank() {
    use ulysses_training::{LayerCheckpointing, StepInput, backward_step_checkpointed};
    let messages = refusals_at_sp_2(|rank, decoder, groups, batch| {
        let step = StepInput { index: 3, learning_rate: 1e-3, micro_batches: batch, documents: None, targets: None, max_grad_norm: None };
        let checkpointing = LayerCheckpointing::new().with_tile_tokens(Some(if rank == 0 { 0 } else { 4 }));
        backward_step_checkpointed(&decoder, &step, &groups.layout.sharder(), groups, &Default::default(), &checkpointing).err()
    });
    assert!(messages[0].contains("tile_tokens is 0"), "{}", messages[0]);
    assert!(messages[1].contains("rank 0 refused its inputs for step 3"), "{}", messages[1]);
}

/// A port whose checkpointed layers count positions from each tile's first row: RoPE from the
/// shard's first rows in every tile (in the forward and its recomputation, or in the
/// recomputation alone), refused on every rank at SP = 2 and at SP = 1 (wrong at any degree);
/// a position signal from `arange(0..tile)` after the core, refused at SP = 2 (on one device
/// an arange may as well be indices). One that mixes a tile's tokens in a token-wise part (a
/// token shift), refused at any degree. The decoder as ported, in the same tiles, runs.
#[test]
fn positions_from_each_tiles_first_row_and_tokens_mixed_in_a_tile_are_refused() {
    use ulysses_training::{LayerCheckpointing, StepInput, backward_step_checkpointed};
    let step = |decoder, alteration, groups: &ParallelGroups<Inner>, batch: &[Vec<Vec<i64>>]| {
        let model = AlteredDecoder { decoder, alteration };
        let step = StepInput { index: 0, learning_rate: 1e-3, micro_batches: batch, documents: None, targets: None, max_grad_norm: None };
        let checkpointing = LayerCheckpointing::new().with_tile_tokens(Some(4));
        backward_step_checkpointed(&model, &step, &groups.layout.sharder(), groups, &Default::default(), &checkpointing).err()
    };
    // What each refusal names at `sp` on `rank`, shards of 16 / sp tokens in tiles of 4: the
    // shard's own table's rows 0..4 are right in the first tile, and an arange of 0..4 there on
    // rank 0 alone (positions 0..4); a shift is wrong in every tile.
    let expected = |alteration: Alteration, sp: usize, rank: usize| {
        let shard = 16 / sp;
        let tile = match alteration {
            Alteration::TokenShiftBeforeTheCore => 0,
            Alteration::ArangeAfterTheCore if rank > 0 => 0,
            _ => 4,
        };
        let mut needles = vec![format!("rows {tile}..{} of this rank's {shard}-token shard", tile + 4)];
        needles.extend(match alteration {
            Alteration::TokenShiftBeforeTheCore => vec!["drops the last 1 of the 4 tokens of this tile of the shard".into(), "LayeredLm::core".into()],
            Alteration::ArangeAfterTheCore => vec!["arange counts positions 0..4".into()],
            _ => vec!["slice takes rows 0..4 along dim 2".into()],
        });
        if alteration != Alteration::TokenShiftBeforeTheCore {
            needles.extend([format!("positions {}..{}", rank * shard + tile, rank * shard + tile + 4), "LayeredLm::context".into()]);
        }
        needles
    };
    let refused = [Alteration::RopeFromRowZeroInEachTile, Alteration::RopeFromRowZeroWhenRecomputed, Alteration::ArangeAfterTheCore, Alteration::TokenShiftBeforeTheCore];
    for alteration in refused {
        let messages = refusals_at_sp_2(move |_, decoder, groups, batch| step(decoder, alteration, groups, batch));
        for (rank, message) in messages.iter().enumerate() {
            for needle in expected(alteration, 2, rank) {
                assert!(message.contains(&needle) && message.contains("at any SP degree"), "{alteration:?}, rank {rank}: `{needle}` missing from: {message}");
            }
        }
    }
    let outcomes = with_deadline(Duration::from_secs(50), move || {
        ThreadGroup::new(1).run(|rank| {
            let groups: ParallelGroups<Inner> = ParallelGroups::new(rank.communicator(), ParallelLayout::new()).unwrap();
            let _sp = enter_sp(&groups);
            let batch = vec![vec![(0..16).map(|t| t % 32).collect::<Vec<i64>>()]];
            let decoder = || deterministic_params(config(ParallelLayout::new(), 1).model.init::<Sp>(&Default::default()), INIT_SEED);
            [refused.as_slice(), &[Alteration::AsPorted]].concat().into_iter().map(|alteration| (alteration, step(decoder(), alteration, &groups, &batch).map(|e| e.to_string()))).collect::<Vec<_>>()
        })
    });
    for (alteration, outcome) in outcomes.into_iter().next().unwrap().unwrap_or_else(|p| panic!("SP 1 panicked: {p}")) {
        match alteration {
            Alteration::ArangeAfterTheCore | Alteration::AsPorted => assert!(outcome.is_none(), "{alteration:?} in tiles of 4 at SP 1: {outcome:?}"),
            _ => {
                let message = outcome.unwrap_or_else(|| panic!("{alteration:?} at SP 1 ran"));
                for needle in expected(alteration, 1, 0) {
                    assert!(message.contains(&needle), "{alteration:?} at SP 1: `{needle}` missing from: {message}");
                }
            }
        }
    }
}

/// The decoder with attention that ignores the packed documents (as a model of one's own that
/// never calls `attention_in_documents`).
#[derive(burn::module::Module, Debug)]
struct IgnoresDocuments<B: burn::tensor::backend::Backend> {
    decoder: ulysses_models::Decoder<B>,
}

impl<B: burn::tensor::backend::AutodiffBackend> ulysses_training::CausalLm<B> for IgnoresDocuments<B> {
    fn logits(&self, tokens: Tensor<B, 2, Int>, positions: &ShardPositions) -> Tensor<B, 3> {
        self.decoder.forward(tokens, &ShardPositions { packed: false, ..positions.clone() })
    }
    fn vocab_size(&self) -> usize {
        self.decoder.vocab_size()
    }
    fn is_causal(&self) -> bool {
        true
    }
}

/// The decoder run inside `enter_single_device` (as a model of one's own that attends on one
/// device on purpose): under SP each rank attends within its shard, which the step refuses.
#[derive(burn::module::Module, Debug)]
struct OnOneDevice<B: burn::tensor::backend::Backend> {
    decoder: ulysses_models::Decoder<B>,
}

impl<B: burn::tensor::backend::AutodiffBackend> ulysses_training::CausalLm<B> for OnOneDevice<B> {
    fn logits(&self, tokens: Tensor<B, 2, Int>, positions: &ShardPositions) -> Tensor<B, 3> {
        let _one_device = burn_ulysses::context::enter_single_device();
        self.decoder.forward(tokens, positions)
    }
    fn vocab_size(&self) -> usize {
        self.decoder.vocab_size()
    }
    fn is_causal(&self) -> bool {
        true
    }
}

/// Ranks that read other data (node-local copies that differ) are refused before the first
/// step, on every rank, naming the rank: each draws the step's whole batch and takes its part,
/// so they would train on parts of different batches.
#[test]
fn ranks_that_read_other_data_are_refused_before_the_first_step() {
    let layout = ParallelLayout::new().with_dp_size(2);
    for message in errors_of_two_ranks(layout, move |rank, groups| (config(layout, 1), enter_sp(groups), VariedLengths { vocab: VOCAB - rank })) {
        assert!(message.contains("the ranks draw different batches for step 0 (world ranks [0] against [1]"), "{message}");
    }
    // The same batches, other held-out sequences (node-local --eval-data copies that differ):
    // unlike evaluations, under ZeRO-3 gathers that never pair up.
    struct HeldOut {
        data: VariedLengths,
        rank: usize,
    }
    impl StepData for HeldOut {
        fn train_batch(&self, step: usize) -> Vec<Vec<i64>> {
            self.data.train_batch(step)
        }
        fn eval_batch(&self) -> Option<Vec<Vec<i64>>> {
            Some(self.data.train_batch(1 + self.rank))
        }
    }
    for message in errors_of_two_ranks(layout, move |rank, groups| (config(layout, 1), enter_sp(groups), HeldOut { data: VariedLengths { vocab: VOCAB }, rank })) {
        assert!(message.contains("the ranks hold out different sequences (world ranks [0] against [1]"), "{message}");
    }
}

/// Whole-layer activation checkpointing (layers re-run in the backward from their kept
/// inputs, on the device and offloaded to the host), alone and with the token-wise parts
/// (all but the attention core) in sequence tiles, takes the same 5 AdamW steps as the plain backward at SP 1, 2 and 4, and with
/// packed documents at SP 2. Tiles of 3 tokens cut shards of 16, 8 and 4 tokens unevenly.
#[test]
fn layer_checkpointing_trains_like_the_plain_backward() {
    use ulysses_training::LayerCheckpointing;
    let checkpointed = |config: TrainConfig, offload: bool, tile_tokens: Option<usize>| {
        config.with_layer_checkpointing(Some(LayerCheckpointing::new().with_offload_to_host(offload).with_tile_tokens(tile_tokens)))
    };
    // A hang detector, not a time limit: the nine runs take about 45 s alone and reached 100 s
    // beside the binary's other tests on CI's two cores (2026-11-28, a clean clone of a7bfdad).
    let runs = with_deadline(Duration::from_secs(200), move || {
        let mut single = config(ParallelLayout::new(), 1);
        single.model.repeat_kv = true;
        let plain = train::<Reference>(single.clone(), no_context);
        let one = train::<Reference>(checkpointed(single.clone(), false, None), no_context);
        let one_tiled = train::<Reference>(checkpointed(single, false, Some(3)), no_context);
        let sp2 = train::<Sp>(checkpointed(config(ParallelLayout::new().with_sp_size(2), 1), true, None), enter_sp);
        let sp2_tiled = train::<Sp>(checkpointed(config(ParallelLayout::new().with_sp_size(2), 2), true, Some(3)), enter_sp);
        let sp4 = train::<Sp>(checkpointed(config(ParallelLayout::new().with_sp_size(4), 1), false, None), enter_sp);
        let sp4_tiled = train::<Sp>(checkpointed(config(ParallelLayout::new().with_sp_size(4), 1), false, Some(3)), enter_sp);
        let packed = |config: TrainConfig| config.with_seq_len(32).with_pack(true);
        let packed_plain = train_on::<Sp>(packed(config(ParallelLayout::new().with_sp_size(2), 1)), enter_sp, &Paragraphs { split: false });
        let packed_checkpointed =
            train_on::<Sp>(checkpointed(packed(config(ParallelLayout::new().with_sp_size(2), 1)), true, Some(5)), enter_sp, &Paragraphs { split: false });
        [
            (
                ("plain, one device", plain),
                vec![
                    ("checkpointed, one device", one),
                    ("checkpointed + tiled, one device", one_tiled),
                    ("checkpointed SP=2, offloaded", sp2),
                    ("checkpointed + tiled SP=2 GAS=2, offloaded", sp2_tiled),
                    ("checkpointed SP=4", sp4),
                    ("checkpointed + tiled SP=4", sp4_tiled),
                ],
            ),
            (("packed SP=2 plain", packed_plain), vec![("packed SP=2 checkpointed + tiled, offloaded", packed_checkpointed)]),
        ]
    });
    for ((reference_name, reference), others) in &runs {
        for (name, run) in others {
            let (loss_diff, param_diff) = run.gaps_from(reference, name);
            println!("{name:>44}: max |Δ| loss {loss_diff:.2e}, parameters {param_diff:.2e} against {reference_name}");
            assert!(loss_diff <= TOLERANCE, "{name}: step loss differs by {loss_diff:e}");
            assert!(param_diff <= TOLERANCE, "{name}: parameters differ by {param_diff:e}");
        }
    }
}

/// The gradients of one checkpointed backward (every layer re-run from its input; its
/// token-wise parts whole, in 4 uneven tiles of a 13-token shard, and in 13 one-token tiles; inputs on the
/// device, on the host, and the first layer's alone on the host) equal those of one plain backward through the same model,
/// parameter by parameter.
#[test]
fn checkpointed_gradients_equal_the_plain_backward() {
    use ulysses_training::{LayerCheckpointing, checkpointed_backward, lm_loss_sum};
    use ulysses_suite::{gradient_params_values, parameter_grads};
    let device = Default::default();
    let model = deterministic_params(config(ParallelLayout::new(), 1).model.with_repeat_kv(true).init::<Reference>(&device), INIT_SEED);
    let batch = VariedLengths { vocab: VOCAB }.train_batch(0);
    let shard = SequenceSharder::new(1).shard(&batch, 0);
    assert_eq!(shard.local_len, 13, "the batch's longest sequence sets the shard length");
    let weight = 1.0 / shard.valid_tokens as f64;

    let loss = lm_loss_sum(model.lm_output(shard.tokens::<Reference>(&device), &shard.positions), shard.labels(&device), -100) * weight;
    let plain_loss = loss.clone().into_scalar() as f64;
    let plain = parameter_grads(&model, &loss.backward());

    // Offloaded: every layer's input and the head's, or the first layer's alone (the others'
    // and the head's on the device).
    let offloaded = LayerCheckpointing::new().with_offload_to_host(true);
    let first_offloaded = offloaded.clone().with_offload_layers(Some(1));
    assert!(model.blocks.len() > 1, "a later layer's input stays on the device");
    for (checkpointing, tiles) in [(LayerCheckpointing::new(), 1), (offloaded, 4), (first_offloaded, 4), (LayerCheckpointing::new(), 13)] {
        let offload = match (checkpointing.offload_to_host, checkpointing.offload_layers) {
            (false, _) => "none".to_string(),
            (true, None) => "all".to_string(),
            (true, Some(n)) => format!("the first {n}"),
        };
        let (loss, grads) =
            checkpointed_backward(&model, shard.tokens(&device), shard.labels(&device), &shard.positions, weight, -100, &checkpointing, tiles, |_| {}).unwrap();
        let checkpointed = gradient_params_values(&model, &grads);
        assert_eq!(checkpointed.len(), plain.len());
        let loss_diff = (loss.into_scalar() as f64 - plain_loss).abs() as f32;
        assert!(loss_diff <= TOLERANCE, "{tiles} tiles: loss differs by {loss_diff:e}");
        for (name, got, want) in paired_parameters(&checkpointed, &plain) {
            let diff = max_abs_diff(got, want);
            assert!(diff <= TOLERANCE, "{tiles} tiles, offload {offload}: the gradient of {name} differs by {diff:e}");
        }
        println!("{tiles:>2} tile(s), offload {offload:>11}: {} parameter gradients within {TOLERANCE:e}", plain.len());
    }
}

/// The embedding's gradient that a checkpointed step adds itself (the decoder's embedding is a
/// lookup, `LayeredLm::embedding_lookup`: each token's upstream row added into its row of the
/// weight's gradient, into a tied head's in place) equals autodiff's through the plain
/// backward: untied and tied, with a padding token that occurs in the text (its lookups pass
/// no gradient), and with the embedding frozen (no gradient at all), within 1e-5.
#[test]
fn an_embedding_looked_up_takes_the_plain_backwards_gradient_tied_padded_or_frozen() {
    use burn::{module::{Module, ModuleVisitor, Param}, optim::GradientsParams, tensor::backend::AutodiffBackend};
    use ulysses_training::{LayerCheckpointing, checkpointed_backward, lm_loss_sum, parameter_paths};
    /// Each float parameter's gradient in `grads`, in module order (`None`: it has none).
    fn gradients<B: AutodiffBackend, M: Module<B>>(module: &M, grads: &GradientsParams) -> Vec<Option<Vec<f32>>> {
        struct Read<'a>(&'a GradientsParams, Vec<Option<Vec<f32>>>);
        impl<B: AutodiffBackend> ModuleVisitor<B> for Read<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let grad = self.0.get::<B::InnerBackend, D>(param.id);
                self.1.push(grad.map(|g| g.into_data().convert::<f32>().to_vec::<f32>().unwrap()));
            }
        }
        let mut read = Read(grads, Vec::new());
        module.visit(&mut read);
        read.1
    }
    let device = Default::default();
    let batch = VariedLengths { vocab: VOCAB }.train_batch(0);
    let shard = SequenceSharder::new(1).shard(&batch, 0);
    let weight = 1.0 / shard.valid_tokens as f64;
    // A content token, so that its lookups would carry a gradient but for the padding rule.
    let pad = batch[0][1] as usize;
    for (tied, pad_token, frozen) in [(false, None, false), (true, Some(pad), false), (false, Some(pad), false), (true, None, true)] {
        let case = format!("tied {tied}, pad {pad_token:?}, frozen {frozen}");
        let config = config(ParallelLayout::new(), 1).model.with_repeat_kv(true).with_tie_embeddings(tied).with_pad_token(pad_token);
        let mut model = deterministic_params(config.init::<Reference>(&device), INIT_SEED);
        if frozen {
            model.embedding.weight = model.embedding.weight.set_require_grad(false);
        }
        let loss = lm_loss_sum(model.lm_output(shard.tokens::<Reference>(&device), &shard.positions), shard.labels(&device), -100) * weight;
        let plain = gradients(&model, &GradientsParams::from_grads(loss.backward(), &model));
        let (_, grads) = checkpointed_backward(&model, shard.tokens(&device), shard.labels(&device), &shard.positions, weight, -100, &LayerCheckpointing::new(), 2, |_| {}).unwrap();
        let looked_up = gradients(&model, &grads);
        let paths = parameter_paths(&model);
        assert_eq!((looked_up.len(), plain.len()), (paths.len(), paths.len()), "{case}: a gradient for each parameter");
        for ((name, got), want) in paths.iter().zip(&looked_up).zip(&plain) {
            match (got, want) {
                (Some(got), Some(want)) => {
                    assert!(got.iter().all(|v| v.is_finite()), "{case}: {name}'s gradient is not finite");
                    let diff = max_abs_diff(got, want);
                    assert!(diff <= TOLERANCE, "{case}: the gradient of {name} differs by {diff:e}");
                }
                (None, None) => assert!(frozen && name.starts_with("embedding"), "{case}: {name} has no gradient"),
                _ => panic!("{case}: {name} has a gradient in one backward only (checkpointed {}, plain {})", got.is_some(), want.is_some()),
            }
        }
        if pad_token.is_some() {
            let rows = looked_up[0].as_ref().expect("the embedding trains");
            let row = &rows[pad * config.d_model..(pad + 1) * config.d_model];
            assert!(tied || row.iter().all(|&v| v == 0.0), "{case}: the padding row took a gradient");
        }
    }
}

/// Tile settings that cannot work are refused with the reason, before any layer runs: a
/// tile of 0 tokens, and more tiles than the shard has tokens.
#[test]
fn impossible_tiles_are_refused_before_the_step() {
    use ulysses_training::{LayerCheckpointing, checkpointed_backward};
    let zero = LayerCheckpointing::new().with_tile_tokens(Some(0));
    let message = zero.check().unwrap_err().to_string();
    assert!(message.contains("tile_tokens is 0"), "{message}");
    let mut config = config(ParallelLayout::new(), 1);
    config.layer_checkpointing = Some(zero);
    let message = config.validate().unwrap_err();
    assert!(message.contains("--tile-tokens"), "{message}");

    // A shard's count: none empty, none past tile_tokens, at least one.
    let tiling = LayerCheckpointing::new().with_tile_tokens(Some(2));
    assert_eq!([3, 40, 41, 0].map(|len| tiling.tiles(len).unwrap()), [2, 20, 21, 1]);
    assert_eq!(LayerCheckpointing::new().tiles(9).unwrap(), 1);

    let device = Default::default();
    let model = config.model.with_repeat_kv(true).init::<Reference>(&device);
    let shard = SequenceSharder::new(1).shard(&[vec![1, 2, 3, 4, 5]], 0);
    let tiles = shard.local_len + 1;
    let error = checkpointed_backward(&model, shard.tokens(&device), shard.labels(&device), &shard.positions, 1.0, -100, &tiling, tiles, |_| {})
        .err()
        .expect("more tiles than tokens");
    let expected = format!("{tiles} tiles for a shard of {} tokens", shard.local_len);
    assert!(error.to_string().contains(&expected), "{error}");
}

/// `offload_layers` that cannot say what to offload is refused with the reason before any
/// layer runs: 0 layers, a count without `offload_to_host`, more layers than the model has (by
/// the step, and by the trainer's validation naming its flags).
#[test]
fn offloaded_layer_counts_that_cannot_work_are_refused() {
    use ulysses_training::{LayerCheckpointing, checkpointed_backward};
    let offloaded = LayerCheckpointing::new().with_offload_to_host(true);
    let message = offloaded.clone().with_offload_layers(Some(0)).check().unwrap_err().to_string();
    assert!(message.contains("offload_layers is 0"), "{message}");
    let message = LayerCheckpointing::new().with_offload_layers(Some(1)).check().unwrap_err().to_string();
    assert!(message.contains("offload_to_host is false"), "{message}");

    let config = config(ParallelLayout::new(), 1);
    let layers = config.model.n_layers;
    let device = Default::default();
    let model = config.model.clone().with_repeat_kv(true).init::<Reference>(&device);
    let shard = SequenceSharder::new(1).shard(&[vec![1, 2, 3, 4, 5]], 0);
    let too_many = offloaded.with_offload_layers(Some(layers + 1));
    let error = checkpointed_backward(&model, shard.tokens(&device), shard.labels(&device), &shard.positions, 1.0, -100, &too_many, 1, |_| {})
        .err()
        .expect("more offloaded layers than the model has");
    assert!(error.to_string().contains(&format!("offload_layers is {}, but the model has {layers} layers", layers + 1)), "{error}");

    for (count, expected) in [(0, "--offload-layers 0 offloads nothing".to_string()), (layers + 1, format!("--offload-layers {}, but the model has {layers} layers", layers + 1))] {
        let mut config = config.clone();
        config.layer_checkpointing = Some(too_many.clone().with_offload_layers(Some(count)));
        let message = config.validate().unwrap_err();
        assert!(message.contains(&expected), "{message}");
    }
}

/// Settings that would make ranks clip apart are refused: burn's own norm clipping (each
/// rank's norm, measured alone) at validation, and ranks given different clipping limits
/// before their first step, on every rank, naming the setting.
#[test]
fn clipping_that_would_part_the_ranks_is_refused() {
    use burn::optim::grad_clipping::GradientClippingConfig;
    let mut burns = config(ParallelLayout::new(), 1);
    burns.optimizer = AdamWConfig::new().with_grad_clipping(Some(GradientClippingConfig::Norm(1.0)));
    let message = burns.validate().unwrap_err();
    assert!(message.contains("grad_clipping is Norm") && message.contains("--max-grad-norm"), "{message}");
    let mut by_value = config(ParallelLayout::new(), 1);
    by_value.optimizer = AdamWConfig::new().with_grad_clipping(Some(GradientClippingConfig::Value(1.0)));
    by_value.validate().expect("clipping by value is element-wise: the same on every rank");

    let layout = ParallelLayout::new().with_sp_size(2);
    let messages = errors_of_two_ranks(layout, move |rank, groups| {
        let config = config(layout, 1).with_max_grad_norm(if rank == 0 { Some(1.0) } else { None });
        (config, enter_sp(groups), VariedLengths { vocab: VOCAB })
    });
    for (rank, message) in messages.iter().enumerate() {
        // The trainer's settings check, before any step (the step's own check, which names
        // the values, serves loops of one's own).
        assert!(message.contains("world rank 1 was started with another max_grad_norm than world rank 0"), "rank {rank}: {message}");
    }
}

/// What one SP=2 × DP=2 run on the tiny Qwen3 fixture gives: world rank 0's losses, gradient
/// norms and parameters, and each rank's optimizer state bytes on the host.
struct Qwen3Run {
    losses: Vec<f64>,
    norms: Vec<f64>,
    params: Vec<(String, Vec<f32>)>,
    host_bytes: Vec<usize>,
    /// Per rank: bytes of the parameters' compute copy it holds between steps.
    device_bytes: Vec<usize>,
    /// Reduce-scatters world rank 0 ran.
    reduce_scatters: u64,
}

/// How a rank of [`qwen3_sp_dp`] holds its training state.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Zero {
    /// burn's AdamW on every rank, every moment on every rank.
    Replicated,
    /// The same, with whole-layer checkpointing.
    ReplicatedCheckpointed,
    /// `ShardedAdamW`: a quarter of the state each, on the host (ZeRO's optimizer half).
    ShardedOptimizer,
    /// The same, with whole-layer checkpointing (what ZeRO-3 runs on).
    ShardedOptimizerCheckpointed,
    /// ZeRO-3: the compute copy in quarters too, each layer gathered for its pieces.
    Stage3,
    /// ZeRO-3 with the optimizer's quarter on the device (`DeviceShardedAdamW`).
    Stage3OnDevice,
    /// ZeRO-3 with the compute copy's quarter on the host too, uploaded for each gather.
    Stage3PartsOnHost,
    /// ZeRO-3 after a backward whose step was abandoned (its gradient parts must not reach
    /// the next step).
    Stage3AfterAbandonedStep,
    /// ZeRO-3 cut by `ShardedParameters::shard_from` from world rank 0's (the optimizer on the host, or on
    /// the device): world rank 0 loads the fixture, the other ranks hold a model never built.
    Stage3FromRank0,
    Stage3FromRank0OnDevice,
    /// ZeRO-3 cut by `ShardedParameters::shard_from` from the host optimizer's master
    /// weights (as a resumed run is), into a model never built.
    Stage3FromMasters,
    /// ZeRO-3 with the host optimizer updating each group in the backward
    /// (`ShardedParameters::update_in_backward`); and the same with the compute copy's parts on
    /// the host as the optimizer's master weights (`share_master_weights`, the trainer's
    /// `--offload-parameters`).
    Stage3InBackward,
    Stage3InBackwardSharedMasters,
}

/// `steps` steps of SP=2 × DP=2 on the tiny Qwen3 fixture (transformers' weights), each rank
/// holding its state as `zero` says, clipping to `max_grad_norm`.
fn qwen3_sp_dp(zero: Zero, steps: usize, max_grad_norm: Option<f64>) -> Qwen3Run {
    qwen3_sp_dp_accumulating(zero, steps, max_grad_norm, 1)
}

/// [`qwen3_sp_dp`] with each DP rank's two sequences in `micro_batches` micro-batches.
fn qwen3_sp_dp_accumulating(zero: Zero, steps: usize, max_grad_norm: Option<f64>, micro_batches: usize) -> Qwen3Run {
    let schedule: Vec<(usize, bool)> = (0..steps).map(|step| (step, true)).collect();
    qwen3_sp_dp_schedule(zero, &schedule, max_grad_norm, micro_batches)
}

/// [`qwen3_sp_dp_accumulating`] with a step for each `(data, targets)` of `schedule`: the data
/// of `VariedLengths`' step `data`, every token a target or (`false`) none.
fn qwen3_sp_dp_schedule(zero: Zero, schedule: &[(usize, bool)], max_grad_norm: Option<f64>, micro_batches: usize) -> Qwen3Run {
    fixture_sp_dp_schedule("qwen3", zero, schedule, max_grad_norm, micro_batches)
}

/// [`qwen3_sp_dp_schedule`] on another of ulysses-models' fixtures of the same vocabulary.
fn fixture_sp_dp_schedule(fixture: &str, zero: Zero, schedule: &[(usize, bool)], max_grad_norm: Option<f64>, micro_batches: usize) -> Qwen3Run {
    fixture_run(fixture, (2, 2), zero, schedule, max_grad_norm, micro_batches)
}

/// [`fixture_sp_dp_schedule`] at SP × DP = `degrees`: each DP rank its `4 / dp` of the step's
/// four sequences (DP=3: one each, the fourth left out).
fn fixture_run(fixture: &str, (sp, dp): (usize, usize), zero: Zero, schedule: &[(usize, bool)], max_grad_norm: Option<f64>, micro_batches: usize) -> Qwen3Run {
    use ulysses_training::{
        DeviceShardedAdamW, HostAdamWConfig, LayerCheckpointing, MatrixDecayAdamW, OptimizerPlace, PartsFrom, ShardedAdamW, ShardedParameters, StepInput, apply_step,
        apply_step_sharded, apply_step_zero3, backward_step, backward_step_checkpointed, backward_step_zero3,
    };
    const WEIGHT_DECAY: f32 = 0.01;
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/ulysses-models/tests/fixtures").join(fixture);
    let layout = ParallelLayout::new().with_sp_size(sp).with_dp_size(dp);
    let (world, per_dp) = (sp * dp, 4 / dp);
    let per_rank = ThreadGroup::new(world).run(|rank| {
        let groups: ParallelGroups<Inner> = ParallelGroups::new(rank.communicator(), layout).unwrap();
        let _sp = enter_sp(&groups);
        let device = Default::default();
        let from_rank_0 = matches!(zero, Zero::Stage3FromRank0 | Zero::Stage3FromRank0OnDevice);
        // Lazy, the fixture's shape: a model whose parameters are never built.
        let never_built = || DecoderConfig::from_hf(&ulysses_models::checkpoint_config(&fixture).unwrap()).init::<Sp>(&device);
        let mut model = match from_rank_0 && rank.rank() != 0 {
            // World rank 0's values arrive one parameter at a time.
            true => never_built(),
            false => ulysses_models::from_pretrained::<Sp>(&fixture, &device).unwrap().model,
        };
        let whole_bytes: usize = 4 * ulysses_training::parameter_elements(&model).iter().sum::<usize>();
        let (dp_rank, _) = layout.coordinates(rank.rank());
        let sharder = SequenceSharder::new(sp);
        let checkpointing = LayerCheckpointing::new();
        // Decaying the matrices alone, as the sharded optimizers do.
        let mut replicated = MatrixDecayAdamW::<ulysses_models::Decoder<Sp>, Sp>::new(&AdamWConfig::new().with_weight_decay(WEIGHT_DECAY));
        let adamw = HostAdamWConfig { weight_decay: WEIGHT_DECAY, ..HostAdamWConfig::default() };
        let mut sharded_state = ShardedAdamW::new(adamw);
        let mut on_device = DeviceShardedAdamW::<Sp>::new(adamw);
        let mut parts = None;
        let in_backward = matches!(zero, Zero::Stage3InBackward | Zero::Stage3InBackwardSharedMasters);
        if matches!(zero, Zero::Stage3 | Zero::Stage3OnDevice | Zero::Stage3PartsOnHost | Zero::Stage3AfterAbandonedStep) || in_backward {
            sharded_state.keep_master_weights(&model, rank.rank(), world).unwrap();
            on_device.keep_master_weights(&model, rank.rank(), world).unwrap();
            let place = if zero == Zero::Stage3OnDevice { OptimizerPlace::Device } else { OptimizerPlace::Host };
            let (placeholders, sharded) = ShardedParameters::shard(model, rank.rank(), world, place).unwrap();
            let mut sharded = if matches!(zero, Zero::Stage3PartsOnHost | Zero::Stage3InBackwardSharedMasters) { sharded.with_parts_on_host() } else { sharded };
            if zero == Zero::Stage3InBackwardSharedMasters {
                sharded.share_master_weights(&mut sharded_state).unwrap();
            }
            (model, parts) = (placeholders, Some(sharded));
        }
        if zero == Zero::Stage3FromMasters {
            sharded_state.keep_master_weights(&model, rank.rank(), world).unwrap();
            let (placeholders, sharded) = ShardedParameters::shard_from(never_built(), PartsFrom::Masters, &mut sharded_state, FloatDType::F32, false, &device, &*groups.world).unwrap();
            (model, parts) = (placeholders, Some(sharded));
        }
        if from_rank_0 {
            let world = &*groups.world;
            let (placeholders, sharded) = match zero {
                Zero::Stage3FromRank0OnDevice => ShardedParameters::shard_from(model, PartsFrom::Rank0, &mut on_device, FloatDType::F32, false, &device, world),
                _ => ShardedParameters::shard_from(model, PartsFrom::Rank0, &mut sharded_state, FloatDType::F32, false, &device, world),
            }
            .unwrap();
            (model, parts) = (placeholders, Some(sharded));
        }
        if let (Zero::Stage3AfterAbandonedStep, Some(parts)) = (zero, parts.as_mut()) {
            let batch = VariedLengths { vocab: 320 }.train_batch(3);
            let mine = vec![batch[per_dp * dp_rank..per_dp * (dp_rank + 1)].to_vec()];
            let step = StepInput { index: 0, learning_rate: 1e-2, micro_batches: &mine, documents: None, targets: None, max_grad_norm };
            drop(backward_step_zero3(&model, &step, &sharder, &groups, &device, &checkpointing, parts).unwrap());
        }
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for (index, &(data, has_targets)) in schedule.iter().enumerate() {
            // Each DP rank its share of the step's four sequences.
            let batch = VariedLengths { vocab: 320 }.train_batch(data);
            let mine: Vec<Vec<Vec<i64>>> = batch[per_dp * dp_rank..per_dp * (dp_rank + 1)].chunks(per_dp / micro_batches).map(<[_]>::to_vec).collect();
            let no_targets: Vec<Vec<Vec<bool>>> = mine.iter().map(|micro| micro.iter().map(|s| vec![false; s.len()]).collect()).collect();
            let targets = (!has_targets).then_some(&no_targets[..]);
            let step = StepInput { index, learning_rate: 1e-2, micro_batches: &mine, documents: None, targets, max_grad_norm };
            if let (true, Some(parts)) = (in_backward, parts.as_mut()) {
                parts.update_in_backward(&mut sharded_state, &step).unwrap();
            }
            let local = match (zero, parts.as_mut()) {
                (Zero::Replicated | Zero::ShardedOptimizer, _) => backward_step(&model, &step, &sharder, &groups, &device),
                (Zero::ReplicatedCheckpointed | Zero::ShardedOptimizerCheckpointed, _) => {
                    backward_step_checkpointed(&model, &step, &sharder, &groups, &device, &checkpointing)
                }
                (_, Some(parts)) => backward_step_zero3(&model, &step, &sharder, &groups, &device, &checkpointing, parts),
                (_, None) => unreachable!("ZeRO-3 shards the model first"),
            }
            .unwrap();
            let (next, report) = match (zero, parts.as_mut()) {
                (Zero::Replicated | Zero::ReplicatedCheckpointed, _) => apply_step(model, &mut replicated, &step, local, &groups),
                (Zero::ShardedOptimizer | Zero::ShardedOptimizerCheckpointed, _) => apply_step_sharded(model, &mut sharded_state, &step, local, &groups),
                (Zero::Stage3OnDevice | Zero::Stage3FromRank0OnDevice, Some(parts)) => apply_step_zero3(model, &mut on_device, parts, &step, local, &groups),
                (_, Some(parts)) => apply_step_zero3(model, &mut sharded_state, parts, &step, local, &groups),
                (_, None) => unreachable!("ZeRO-3 shards the model first"),
            }
            .unwrap();
            model = next;
            losses.push(report.loss);
            norms.push(report.grad_norm);
        }
        let device_bytes = parts.as_ref().map_or(whole_bytes, ShardedParameters::device_bytes);
        if let Some(parts) = &mut parts {
            model = parts.gather_all(model, &*groups.world).unwrap();
        }
        check_parameters_identical::<Sp, _, Inner>(&model, &*groups.world).unwrap();
        (losses, norms, parameter_values(&model), sharded_state.host_bytes().unwrap(), device_bytes, groups.world.traffic().reduce_scatter_calls)
    });
    let per_rank: Vec<_> = per_rank.into_iter().map(|r| r.unwrap_or_else(|p| panic!("{p}"))).collect();
    let host_bytes = per_rank.iter().map(|r| r.3).collect();
    let device_bytes = per_rank.iter().map(|r| r.4).collect();
    let (losses, norms, params, _, _, reduce_scatters) = per_rank.into_iter().next().unwrap();
    Qwen3Run { losses, norms, params, host_bytes, device_bytes, reduce_scatters }
}

/// A head tied to the embeddings (Llama's fixture, as Llama-3.2-1B ties them) trains alike
/// under ZeRO-3 and replicated AdamW at SP=2 × DP=2: the head's gradient and the
/// embedding's, one parameter, summed before its part leaves. ZeRO-3 equals the sharded
/// optimizer on the same checkpointed step bit for bit; against replicated AdamW's plain
/// backward (autodiff over the whole graph, the tie summed by burn) the losses are within
/// 1e-6 and every parameter within 3e-5 of its largest value (Adam's normalised steps carry
/// the gradients' last bits: replicated AdamW's own checkpointed backward is 1.2e-5 from its
/// plain one here). The same with a padding token that occurs in the text (a copy of the
/// fixture naming one): the embedding's gradient, added by the checkpointed step itself
/// (`LayeredLm::embedding_lookup`) into ZeRO-3's placeholder model's, skips its lookups as
/// autodiff through `embed` does.
#[test]
fn a_tied_head_trains_under_zero_3_like_replicated_adamw() {
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/ulysses-models/tests/fixtures");
    let config = ulysses_models::HfConfig::from_hf(&fixtures.join("llama")).unwrap();
    assert!(config.tie_word_embeddings, "the fixture must tie its head");
    // A token of the first sequence the runs train on.
    let pad = VariedLengths { vocab: 320 }.train_batch(0)[0][1];
    let padded = std::env::temp_dir().join(format!("ulysses-train-equivalence-{}-llama-pad", std::process::id()));
    let _ = std::fs::remove_dir_all(&padded);
    std::fs::create_dir_all(&padded).unwrap();
    std::fs::copy(fixtures.join("llama/model.safetensors"), padded.join("model.safetensors")).unwrap();
    let text = std::fs::read_to_string(fixtures.join("llama/config.json")).unwrap();
    assert!(text.contains(r#""pad_token_id": null"#), "the fixture names no padding token");
    std::fs::write(padded.join("config.json"), text.replace(r#""pad_token_id": null"#, &format!(r#""pad_token_id": {pad}"#))).unwrap();
    let padded_name = padded.to_str().unwrap().to_string();
    with_deadline(Duration::from_secs(300), move || {
        for fixture in ["llama", padded_name.as_str()] {
            let schedule: Vec<(usize, bool)> = (0..5).map(|step| (step, true)).collect();
            let run = |zero| fixture_sp_dp_schedule(fixture, zero, &schedule, Some(1.0), 1);
            let (zero3, sharded, plain) = (run(Zero::Stage3), run(Zero::ShardedOptimizerCheckpointed), run(Zero::Replicated));
            let untrained = fixture_sp_dp_schedule(fixture, Zero::Replicated, &[], None, 1);
            assert!(zero3.losses.iter().all(|l| l.is_finite()), "{fixture}: {:?}", zero3.losses);
            let relative = |a: &Qwen3Run, b: &Qwen3Run| {
                worst(paired_parameters(&a.params, &b.params).map(|(_, x, y)| max_abs_diff(x, y) / y.iter().fold(f32::MIN_POSITIVE, |m, v| m.max(v.abs()))))
            };
            assert!(relative(&zero3, &untrained) > 1e-3, "{fixture}: five steps moved no parameter");
            assert_eq!(zero3.losses, sharded.losses, "{fixture}: ZeRO-3's losses against the sharded optimizer's on the same step");
            for (name, want, got) in paired_parameters(&sharded.params, &zero3.params) {
                assert!(bit_identical(got, want), "{fixture}, {name}: {:e} apart from the sharded optimizer's", max_abs_diff(got, want));
            }
            let loss_diff = largest_gap(&zero3.losses, &plain.losses);
            assert!(loss_diff <= 1e-6, "{fixture}: losses {loss_diff:e} apart: {:?} against {:?}", zero3.losses, plain.losses);
            for (name, want, got) in paired_parameters(&plain.params, &zero3.params) {
                let diff = max_abs_diff(got, want) / want.iter().fold(f32::MIN_POSITIVE, |m, v| m.max(v.abs()));
                assert!(diff <= 3e-5, "{fixture}, {name}: {diff:e} of its largest value apart from replicated AdamW");
            }
            println!("{fixture}: ZeRO-3 against replicated AdamW's plain backward: losses {loss_diff:.2e} apart, parameters {:.2e} of their largest", relative(&zero3, &plain));
        }
    });
    let _ = std::fs::remove_dir_all(&padded);
}

/// A step without a target on any rank (prompts alone: under `--loss-on assistant`, a long
/// conversation's piece before its answers) has nothing to learn from, so it changes nothing:
/// with every kind of optimizer (replicated, its state sharded on the host, ZeRO-3 on the host
/// and on the device), steps on data 0 and 1 with such a step between them end bit for bit as
/// the two steps alone, with the same losses. Broken once (the step taken with its zero
/// gradients): AdamW's momentum and weight decay moved every parameter.
#[test]
fn a_step_without_targets_changes_nothing() {
    with_deadline(Duration::from_secs(600), || {
        for zero in [Zero::Replicated, Zero::ShardedOptimizer, Zero::Stage3, Zero::Stage3OnDevice] {
            let two = qwen3_sp_dp_schedule(zero, &[(0, true), (1, true)], Some(1.0), 1);
            let between = qwen3_sp_dp_schedule(zero, &[(0, true), (5, false), (1, true)], Some(1.0), 1);
            assert!(two.losses.iter().all(|l| l.is_finite() && *l > 0.0), "{zero:?}: {:?}", two.losses);
            assert_eq!((between.losses[0], between.losses[2]), (two.losses[0], two.losses[1]), "{zero:?}: the losses around the step without targets");
            assert_eq!((between.losses[1], between.norms[1]), (0.0, 0.0), "{zero:?}: the step without targets reports no loss and no gradient");
            for (name, want, got) in paired_parameters(&two.params, &between.params) {
                assert!(bit_identical(got, want), "{zero:?}, {name}: {:e} apart", max_abs_diff(got, want));
            }
        }
    });
}

/// ZeRO's optimizer half (`apply_step_sharded`: each gradient reduce-scattered, AdamW's state
/// sharded over the 4 ranks and updated on the host, the parts all-gathered) trains the tiny
/// Qwen3 fixture at SP=2 × DP=2 for 20 steps as replicated AdamW does: without clipping, the
/// same losses and parameters bit for bit (the reduce-scatter's parts are the all-reduce's
/// bits, the host AdamW burn's operations), in one reduce-scatter a step (the gradients' one
/// bucket); each rank holds a quarter of the 12 bytes a parameter of master weights and
/// moments (the partition's padding aside).
///
/// With clipping, the norm is summed another way (f64 over the parts, against burn's f32 sum
/// of the whole): 2e-8 apart at step 0, which Adam's steps amplify (parameters 1e-4 apart of
/// their largest after 20 steps, as any two summation orders would); the losses stay within
/// 1e-6, the norms within 1e-7 at the first step and 1e-4 after.
#[test]
fn sharded_optimizer_state_trains_like_replicated_adamw() {
    with_deadline(Duration::from_secs(600), || {
        let (replicated, sharded) = (qwen3_sp_dp(Zero::Replicated, 20, None), qwen3_sp_dp(Zero::ShardedOptimizer, 20, None));
        assert_eq!(sharded.losses, replicated.losses, "losses without clipping");
        assert!(replicated.losses[19] < replicated.losses[0] && replicated.losses.iter().all(|l| l.is_finite()), "the runs must train: {:?}", replicated.losses);
        let parameters: usize = replicated.params.iter().map(|(_, v)| v.len()).sum();
        for (name, want, got) in paired_parameters(&replicated.params, &sharded.params) {
            assert!(bit_identical(got, want), "{name}: {:e} apart", max_abs_diff(got, want));
        }
        for (rank, bytes) in sharded.host_bytes.iter().enumerate() {
            assert!(*bytes >= 12 * parameters / 4 && *bytes <= 12 * (parameters / 4 + replicated.params.len()), "rank {rank} holds {bytes} bytes for {parameters} parameters");
        }
        // The model's 0.5 MB of gradients fit one bucket: one reduce-scatter a step.
        assert_eq!((sharded.reduce_scatters, replicated.reduce_scatters), (20, 0), "reduce-scatters of 20 steps, sharded and replicated");
        println!("losses {:.6} .. {:.6}; host state per rank {:?} bytes, of {} replicated", sharded.losses[0], sharded.losses[19], sharded.host_bytes, 12 * parameters);

        let (replicated, sharded) = (qwen3_sp_dp(Zero::Replicated, 20, Some(1.0)), qwen3_sp_dp(Zero::ShardedOptimizer, 20, Some(1.0)));
        assert!(replicated.norms.iter().all(|&n| n > 1.0), "clipping must engage: {:?}", replicated.norms);
        for step in 0..20 {
            let (loss, norm) = ((sharded.losses[step] / replicated.losses[step] - 1.0).abs(), (sharded.norms[step] / replicated.norms[step] - 1.0).abs());
            // The first step's norms differ only by their summation; later ones by the steps too.
            let norm_tolerance = if step == 0 { 1e-7 } else { 1e-4 };
            assert!(loss <= 1e-6 && norm <= norm_tolerance, "step {step}: loss {loss:e} and norm {norm:e} apart (relative), clipping to 1");
        }
    });
}

/// ZeRO-3's update on the host runs beside the next step, on a thread of its own:
/// `apply_step_zero3` returns before any group is updated, and each gather waits for its own
/// group's new parts alone, the groups updated in the order a forward gathers them (the
/// embedding's, then layer 0, ..., the head's). Held to two groups (`pace_updates`), the
/// embedding and layer 0 are gathered at SP=2 while the last layer's update has not begun, and they hold
/// the step's new values: not the old ones, and the same as once the whole update has ended.
#[test]
fn zero_3_gathers_each_group_once_the_host_optimizer_updated_it() {
    use ulysses_training::{
        HostAdamWConfig, LayerCheckpointing, LayerParameters, LayeredLm, OptimizerPlace, ParameterGroup, ShardedAdamW, ShardedParameters, StepInput, apply_step_zero3,
        backward_step_zero3,
    };
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/ulysses-models/tests/fixtures/qwen3");
    let per_rank = with_deadline(Duration::from_secs(300), move || {
        ThreadGroup::new(2).run(move |rank| {
            let groups: ParallelGroups<Inner> = ParallelGroups::new(rank.communicator(), ParallelLayout::new().with_sp_size(2)).unwrap();
            let _sp = enter_sp(&groups);
            let device = Default::default();
            let model = ulysses_models::from_pretrained::<Sp>(&fixture, &device).unwrap().model;
            assert!(model.layer_count() >= 2, "the fixture needs a layer after layer 0");
            let mut optimizer = ShardedAdamW::new(HostAdamWConfig::default());
            optimizer.keep_master_weights(&model, rank.rank(), 2).unwrap();
            let (pace, paced) = std::sync::mpsc::channel();
            optimizer.pace_updates(paced);
            let (model, mut parts) = ShardedParameters::shard(model, rank.rank(), 2, OptimizerPlace::Host).unwrap();
            // The fixture's head is untied: a forward gathers the embedding alone first.
            let early_groups = [ParameterGroup::Embedding, ParameterGroup::Layer(0)];
            let gather = |parts: &mut ShardedParameters<Sp>, model: &ulysses_models::Decoder<Sp>| early_groups.map(|group| parameter_values(&parts.over(&*groups.world).gather(model, group).unwrap()));
            let before = gather(&mut parts, &model);

            let batch = VariedLengths { vocab: 320 }.train_batch(0);
            let mine = vec![batch[..2].to_vec()];
            let step = StepInput { index: 0, learning_rate: 1e-2, micro_batches: &mine, documents: None, targets: None, max_grad_norm: Some(1.0) };
            let local = backward_step_zero3(&model, &step, &SequenceSharder::new(2), &groups, &device, &LayerCheckpointing::new(), &mut parts).unwrap();
            // Returns with no group updated: the thread waits for its first message.
            let (model, report) = apply_step_zero3(model, &mut optimizer, &mut parts, &step, local, &groups).unwrap();
            assert!(report.loss.is_finite() && report.grad_norm > 1.0, "the step: loss {} and norm {} (clipping must engage)", report.loss, report.grad_norm);
            for _ in early_groups {
                pace.send(()).unwrap();
            }
            let early = gather(&mut parts, &model);
            drop(pace);
            optimizer.settle().unwrap();
            parts.await_every_update().unwrap();
            (before, early, gather(&mut parts, &model))
        })
    });
    for (rank, result) in per_rank.into_iter().enumerate() {
        let (before, early, settled) = result.unwrap_or_else(|p| panic!("rank {rank}: {p}"));
        for (group, ((before, early), settled)) in before.iter().zip(&early).zip(&settled).enumerate() {
            let changed = paired_parameters(before, early).filter(|(_, b, e)| b != e).count();
            assert!(changed > 0, "rank {rank}, group {group}: gathered with the values from before the step");
            for (name, got, want) in paired_parameters(&early, &settled) {
                assert!(got.iter().chain(want).all(|v| v.is_finite()), "rank {rank}: {name} is not finite");
                assert!(bit_identical(got, want), "rank {rank}, {name}: {:e} apart from the whole update's", max_abs_diff(got, want));
            }
        }
    }
}

/// ZeRO-3 (`ShardedParameters`: each rank holds a quarter of the compute copy too, every layer
/// all-gathered for its forward and again for its backward, its gradients reduce-scattered as
/// soon as the layer's backward is done, the optimizer's quarter on the host) trains the tiny
/// Qwen3 fixture at SP=2 × DP=2 for 20 steps:
/// - bit for bit as the sharded optimizer on the same checkpointed step (the same sums in the
///   same order: gathering moves values, it adds nothing), and
/// - as replicated AdamW (burn's, on every rank) on the same checkpointed step within 1e-6:
///   the losses, and every parameter of its largest value;
/// - with the optimizer's parts on the device (`DeviceShardedAdamW`: burn's AdamW order in
///   tensor ops), bit for bit as replicated AdamW;
/// - with the compute copy's parts on the host (`with_parts_on_host`, uploaded for each
///   gather), bit for bit as with them on the device, which then hold none between steps;
/// - cut one parameter at a time from world rank 0's (`shard_from`; the other ranks'
///   models never built), bit for bit as cut from whole models, with the optimizer on the
///   host or the device; and from the optimizer's master weights (`PartsFrom::Masters`, a
///   resumed run's way) into models never built, bit for bit too.
///
/// Between steps each rank holds a quarter of the compute copy (the partition's padding aside).
#[test]
fn zero_3_trains_like_replicated_adamw() {
    with_deadline(Duration::from_secs(600), || {
        let zero3 = qwen3_sp_dp(Zero::Stage3, 20, None);
        let checkpointed = qwen3_sp_dp(Zero::ShardedOptimizerCheckpointed, 20, None);
        let replicated = qwen3_sp_dp(Zero::ReplicatedCheckpointed, 20, None);
        let on_device = qwen3_sp_dp(Zero::Stage3OnDevice, 20, None);
        let parts_on_host = qwen3_sp_dp(Zero::Stage3PartsOnHost, 20, None);
        assert_eq!(parts_on_host.losses, zero3.losses, "ZeRO-3 with the parameters' parts on the host");
        assert!(paired_parameters(&parts_on_host.params, &zero3.params).all(|(_, a, b)| bit_identical(a, b)), "the parameters' parts on the host change the parameters");
        assert!(parts_on_host.device_bytes.iter().all(|&bytes| bytes == 0), "parts on the host, yet {:?} bytes on the devices", parts_on_host.device_bytes);
        let after_abandoned = qwen3_sp_dp(Zero::Stage3AfterAbandonedStep, 20, None);
        assert_eq!(after_abandoned.losses, zero3.losses, "an abandoned step's gradient parts reached the next step");
        // Cut one parameter at a time from world rank 0's, the other ranks never building the
        // model: the same parts and master weights, so the same run bit for bit.
        let from_rank_0 = qwen3_sp_dp(Zero::Stage3FromRank0, 20, None);
        assert_eq!(from_rank_0.losses, zero3.losses, "ZeRO-3 cut from world rank 0's parameters");
        assert!(paired_parameters(&from_rank_0.params, &zero3.params).all(|(_, a, b)| bit_identical(a, b)), "ZeRO-3 cut from world rank 0's parameters ends elsewhere");
        assert_eq!(from_rank_0.device_bytes, zero3.device_bytes, "ZeRO-3 cut from world rank 0's parameters");
        // Cut from the optimizer's master weights (a resumed run's way), into a model never built.
        let from_masters = qwen3_sp_dp(Zero::Stage3FromMasters, 20, None);
        assert_eq!(from_masters.losses, zero3.losses, "ZeRO-3 cut from the master weights");
        assert!(paired_parameters(&from_masters.params, &zero3.params).all(|(_, a, b)| bit_identical(a, b)), "ZeRO-3 cut from the master weights ends elsewhere");
        let from_rank_0_on_device = qwen3_sp_dp(Zero::Stage3FromRank0OnDevice, 3, None);
        assert_eq!(from_rank_0_on_device.losses[..], on_device.losses[..3], "ZeRO-3 cut from world rank 0's parameters, the optimizer on the device");
        assert_eq!(on_device.losses, replicated.losses, "ZeRO-3 with the optimizer on the device against replicated AdamW");
        for (name, want, got) in paired_parameters(&replicated.params, &on_device.params) {
            assert!(bit_identical(got, want), "{name}: the optimizer on the device {:e} apart from replicated AdamW", max_abs_diff(got, want));
        }
        assert!(zero3.losses.iter().all(|l| l.is_finite()) && zero3.losses[19] < zero3.losses[0], "the run must train: {:?}", zero3.losses);
        assert_eq!(zero3.losses, checkpointed.losses, "ZeRO-3's losses against the sharded optimizer's on the same step");
        for (name, want, got) in paired_parameters(&checkpointed.params, &zero3.params) {
            assert!(bit_identical(got, want), "{name}: {:e} apart from the sharded optimizer's", max_abs_diff(got, want));
        }
        let loss_diff = largest_gap(&zero3.losses, &replicated.losses);
        assert!(loss_diff <= 1e-6, "losses {loss_diff:e} apart from replicated training");
        let mut relative = 0.0f32;
        for (name, want, got) in paired_parameters(&replicated.params, &zero3.params) {
            let largest = want.iter().fold(f32::MIN_POSITIVE, |m, v| m.max(v.abs()));
            let diff = max_abs_diff(got, want) / largest;
            assert!(diff <= 1e-6, "{name}: {diff:e} of its largest value apart from replicated training");
            relative = relative.max(diff);
        }
        // Two micro-batches a step: ZeRO-3 sums each one's reduce-scattered parts, replicated
        // training sums the gradients first. The same within rounding: the losses within 1e-6,
        // the parameters no further apart than replicated training's own with one micro-batch
        // and with two (the embedding's rarely seen rows move by Adam's normalised steps on
        // gradients that differ in their last bits: 5.5e-5 there, 1.5e-5 for ZeRO-3).
        let params_apart = |a: &Qwen3Run, b: &Qwen3Run| worst(paired_parameters(&a.params, &b.params).map(|(_, x, y)| max_abs_diff(x, y)));
        let zero3_accumulating = qwen3_sp_dp_accumulating(Zero::Stage3, 5, None, 2);
        let (replicated_accumulating, replicated_whole) =
            (qwen3_sp_dp_accumulating(Zero::ReplicatedCheckpointed, 5, None, 2), qwen3_sp_dp_accumulating(Zero::ReplicatedCheckpointed, 5, None, 1));
        let accumulated = largest_gap(&zero3_accumulating.losses, &replicated_accumulating.losses);
        let (accumulated_params, rounding) = (params_apart(&zero3_accumulating, &replicated_accumulating), params_apart(&replicated_accumulating, &replicated_whole));
        assert!(
            accumulated <= 1e-6 && accumulated_params <= rounding.max(1e-6),
            "two micro-batches: losses {accumulated:e} and parameters {accumulated_params:e} apart (replicated with one and two: {rounding:e})"
        );
        let whole = replicated.device_bytes[0];
        for (rank, bytes) in zero3.device_bytes.iter().enumerate() {
            assert!(*bytes >= whole / 4 && *bytes <= whole / 4 + 4 * zero3.params.len(), "rank {rank} holds {bytes} bytes of a {whole}-byte compute copy");
        }
        println!(
            "ZeRO-3: losses {:.6} .. {:.6}, {loss_diff:.1e} and parameters {relative:.1e} (of their largest) from replicated; compute copy per rank {:?} of {whole} bytes",
            zero3.losses[0], zero3.losses[19], zero3.device_bytes
        );
    });
}


/// ZeRO-3 over three ranks (SP=1 × DP=3), where the partition pads nearly every parameter (64,
/// 64 × 64 and 320 × 64 elements are no multiples of 3) and each rank's last part of a
/// parameter ends in padding: 8 steps train bit for bit as the sharded optimizer on the same
/// checkpointed step, and with the optimizer's parts on the device, or cut from world rank 0's
/// parameters, as before; within 1e-6 of replicated AdamW (losses, and every parameter of its
/// largest value). Clipped to a norm of 1 (the padding counts nothing in the norm), the losses
/// and norms within 1e-6 of replicated AdamW's. Between steps each rank holds a third of the
/// compute copy, its padding aside.
#[test]
fn zero_3_over_three_ranks_whose_parts_are_padded_trains_like_replicated_adamw() {
    with_deadline(Duration::from_secs(600), || {
        let schedule: Vec<(usize, bool)> = (0..8).map(|step| (step, true)).collect();
        let run = |zero, clip| fixture_run("qwen3", (1, 3), zero, &schedule, clip, 1);
        let zero3 = run(Zero::Stage3, None);
        assert!(zero3.losses.iter().all(|l| l.is_finite()) && zero3.losses[7] < zero3.losses[0], "the run must train: {:?}", zero3.losses);
        for (zero, against) in [(Zero::ShardedOptimizerCheckpointed, &zero3), (Zero::Stage3FromRank0, &zero3)] {
            let other = run(zero, None);
            assert_eq!(other.losses, against.losses, "{zero:?}: the losses over three ranks");
            for (name, want, got) in paired_parameters(&against.params, &other.params) {
                assert!(bit_identical(got, want), "{zero:?}: {name} {:e} apart from ZeRO-3's over three ranks", max_abs_diff(got, want));
            }
        }
        let replicated = run(Zero::ReplicatedCheckpointed, None);
        let on_device = run(Zero::Stage3OnDevice, None);
        assert_eq!(on_device.losses, replicated.losses, "ZeRO-3 with the optimizer on the device against replicated AdamW, over three ranks");
        for (name, want, got) in paired_parameters(&replicated.params, &on_device.params) {
            assert!(bit_identical(got, want), "{name}: the optimizer on the device {:e} apart from replicated AdamW over three ranks", max_abs_diff(got, want));
        }
        let loss_diff = largest_gap(&zero3.losses, &replicated.losses);
        assert!(loss_diff <= 1e-6, "losses {loss_diff:e} apart from replicated training over three ranks");
        for (name, want, got) in paired_parameters(&replicated.params, &zero3.params) {
            let largest = want.iter().fold(f32::MIN_POSITIVE, |m, v| m.max(v.abs()));
            let diff = max_abs_diff(got, want) / largest;
            assert!(diff <= 1e-6, "{name}: {diff:e} of its largest value apart from replicated training over three ranks");
        }
        let (clipped, replicated_clipped) = (run(Zero::Stage3, Some(1.0)), run(Zero::ReplicatedCheckpointed, Some(1.0)));
        assert!(replicated_clipped.norms.iter().all(|&n| n > 1.0), "clipping must engage: {:?}", replicated_clipped.norms);
        for step in 0..8 {
            let (loss, norm) = ((clipped.losses[step] / replicated_clipped.losses[step] - 1.0).abs(), (clipped.norms[step] / replicated_clipped.norms[step] - 1.0).abs());
            assert!(loss <= 1e-6 && norm <= 1e-6, "step {step}: loss {loss:e} and norm {norm:e} apart (relative) over three ranks, clipping to 1");
        }
        let whole = replicated.device_bytes[0];
        for (rank, bytes) in zero3.device_bytes.iter().enumerate() {
            assert!(*bytes >= whole / 3 && *bytes <= whole / 3 + 4 * 2 * zero3.params.len(), "rank {rank} holds {bytes} bytes of a {whole}-byte compute copy");
        }
        println!("ZeRO-3 over three ranks: losses {:.6} .. {:.6}, {loss_diff:.1e} from replicated; compute copy per rank {:?} of {whole} bytes", zero3.losses[0], zero3.losses[7], zero3.device_bytes);
    });
}

/// ZeRO-3 with the host optimizer updating each group's parts in the backward, as soon as they
/// arrive on the host (`ShardedParameters::update_in_backward`; the host never holds the step's
/// gradient parts together), trains bit for bit as the update at the step's end: the losses,
/// the gradient norms and every parameter over 20 steps of SP=2 × DP=2 without clipping, one of
/// them without targets (updated neither way), with the compute copy's parts on the device and
/// on the host as the master weights. What it cannot do is refused before the backward:
/// clipping (the whole gradient's norm comes first) and a second micro-batch.
#[test]
fn zero_3_updated_in_the_backward_trains_as_at_the_steps_end() {
    use ulysses_training::{HostAdamWConfig, OptimizerPlace, ShardedAdamW, ShardedParameters, StepInput};
    with_deadline(Duration::from_secs(600), || {
        let schedule: Vec<(usize, bool)> = (0..20).map(|step| (step, step != 7)).collect();
        let at_the_end = qwen3_sp_dp_schedule(Zero::Stage3, &schedule, None, 1);
        assert!(at_the_end.losses.iter().all(|l| l.is_finite()) && at_the_end.losses[19] < at_the_end.losses[0], "the run must train: {:?}", at_the_end.losses);
        for zero in [Zero::Stage3InBackward, Zero::Stage3InBackwardSharedMasters] {
            let run = qwen3_sp_dp_schedule(zero, &schedule, None, 1);
            assert_eq!(run.losses, at_the_end.losses, "{zero:?}: the losses");
            assert_eq!(run.norms, at_the_end.norms, "{zero:?}: the gradient norms");
            for (name, want, got) in paired_parameters(&at_the_end.params, &run.params) {
                assert!(bit_identical(got, want), "{zero:?}: {name} {:e} apart from the update at the step's end", max_abs_diff(got, want));
            }
            assert_eq!(run.host_bytes, at_the_end.host_bytes, "{zero:?}: the optimizer's state");
        }
        println!("updated in the backward: 20 steps bit for bit the update at the step's end, losses {:.6} .. {:.6}", at_the_end.losses[0], at_the_end.losses[19]);
    });

    // Refused before anything runs: one rank, its parts of a small model.
    let device = Default::default();
    let model = deterministic_params(config(ParallelLayout::new(), 1).model.init::<Sp>(&device), INIT_SEED);
    let mut optimizer = ShardedAdamW::new(HostAdamWConfig::default());
    optimizer.keep_master_weights(&model, 0, 1).unwrap();
    let (_, mut parts) = ShardedParameters::shard(model, 0, 1, OptimizerPlace::Host).unwrap();
    let sequences = vec![vec![vec![1, 2, 3]]];
    let step = StepInput { index: 4, learning_rate: 1e-2, micro_batches: &sequences, documents: None, targets: None, max_grad_norm: Some(1.0) };
    let message = parts.update_in_backward(&mut optimizer, &step).unwrap_err().to_string();
    assert!(message.contains("step 4: the update in the backward cannot clip") && message.contains("--max-grad-norm 0"), "{message}");
    let two = vec![vec![vec![1, 2, 3]], vec![vec![4, 5, 6]]];
    let step = StepInput { micro_batches: &two, max_grad_norm: None, ..step };
    let message = parts.update_in_backward(&mut optimizer, &step).unwrap_err().to_string();
    assert!(message.contains("takes one micro-batch a step (2 given)"), "{message}");
}

/// An update in the backward that cannot end as its step's update loses the optimizer's state
/// by name, rather than leave it partly one step's or wait for ever: a step whose gradient holds
/// NaN fails on every rank with the health check's error (saying the optimizer updated some
/// layers), and the state is refused after; a step begun and never applied is named by the next
/// one's update, and the state refused (a settle before that is refused, not left waiting for
/// groups that may still come); a step whose backward failed is named by the apply of the same
/// step run again. SP = 2, one replica, a final norm of NaN for the first.
#[test]
fn an_update_in_the_backward_that_cannot_end_loses_the_state_by_name() {
    use ulysses_training::{HostAdamWConfig, LayerCheckpointing, OptimizerPlace, ShardedAdamW, ShardedParameters, StepInput, apply_step_zero3, backward_step_zero3};
    let layout = ParallelLayout::new().with_sp_size(2);
    let outcome = with_deadline(Duration::from_secs(120), move || {
        ThreadGroup::new(2).run(|rank| {
            let groups: ParallelGroups<Inner> = ParallelGroups::new(rank.communicator(), layout).unwrap();
            let _sp = enter_sp(&groups);
            let device = Default::default();
            let sharder = SequenceSharder::new(2);
            let checkpointing = LayerCheckpointing::new();
            let sequences = vec![VariedLengths { vocab: VOCAB }.train_batch(0)];
            let shard = |mut model: ulysses_models::Decoder<Sp>, nan: bool| {
                if nan {
                    model.norm.gamma = model.norm.gamma.map(|gamma| gamma.mul_scalar(f32::NAN));
                }
                let mut optimizer = ShardedAdamW::new(HostAdamWConfig::default());
                optimizer.keep_master_weights(&model, rank.rank(), 2).unwrap();
                let (placeholders, parts) = ShardedParameters::shard(model, rank.rank(), 2, OptimizerPlace::Host).unwrap();
                (placeholders, parts, optimizer)
            };
            let fresh = || deterministic_params(config(layout, 1).model.init::<Sp>(&device), INIT_SEED);
            let step = |index| StepInput { index, learning_rate: 1e-2, micro_batches: &sequences, documents: None, targets: None, max_grad_norm: None };

            // NaN in the final norm: every gradient part is NaN; the health check names it.
            let (model, mut parts, mut optimizer) = shard(fresh(), true);
            parts.update_in_backward(&mut optimizer, &step(0)).unwrap();
            let local = backward_step_zero3(&model, &step(0), &sharder, &groups, &device, &checkpointing, &mut parts).unwrap();
            let failed = apply_step_zero3(model, &mut optimizer, &mut parts, &step(0), local, &groups).err().expect("a NaN step fails").to_string();
            let after = optimizer.settle().unwrap_err().to_string();

            // A step begun and never applied: the next step's update names it.
            let (model, mut parts, mut optimizer) = shard(fresh(), false);
            parts.update_in_backward(&mut optimizer, &step(0)).unwrap();
            drop(backward_step_zero3(&model, &step(0), &sharder, &groups, &device, &checkpointing, &mut parts).unwrap());
            // Its update may still be given groups: a settle would wait for ever.
            let open = optimizer.settle().unwrap_err().to_string();
            let unapplied = parts.update_in_backward(&mut optimizer, &step(1)).unwrap_err().to_string();
            let refused = optimizer.settle().unwrap_err().to_string();

            // A step whose backward failed (its inputs refused) before any group reached the
            // update, run again without it: its apply is refused, not taken for a step that
            // updated nothing (the abandoned update's empty checks for this one's).
            let (model, mut parts, mut optimizer) = shard(fresh(), false);
            parts.update_in_backward(&mut optimizer, &step(0)).unwrap();
            let outside = vec![vec![vec![VOCAB as i64; 8]]];
            let bad_step = StepInput { micro_batches: &outside, ..step(0) };
            let inputs = backward_step_zero3(&model, &bad_step, &sharder, &groups, &device, &checkpointing, &mut parts).err().expect("a token outside the vocabulary is refused").to_string();
            let local = backward_step_zero3(&model, &step(0), &sharder, &groups, &device, &checkpointing, &mut parts).unwrap();
            let retried = apply_step_zero3(model, &mut optimizer, &mut parts, &step(0), local, &groups).err().expect("the abandoned update lost the state").to_string();

            // The backward, or the apply, given other settings than the update began with (it
            // updates at its own learning rate, and clips nothing): refused, not ignored.
            let (model, mut parts, mut optimizer) = shard(fresh(), false);
            parts.update_in_backward(&mut optimizer, &step(0)).unwrap();
            let slower = StepInput { learning_rate: 1e-3, ..step(0) };
            let other_rate = backward_step_zero3(&model, &slower, &sharder, &groups, &device, &checkpointing, &mut parts).err().expect("another learning rate is refused").to_string();
            let (model, mut parts, mut optimizer) = shard(fresh(), false);
            parts.update_in_backward(&mut optimizer, &step(0)).unwrap();
            let local = backward_step_zero3(&model, &step(0), &sharder, &groups, &device, &checkpointing, &mut parts).unwrap();
            let clipped = StepInput { max_grad_norm: Some(1.0), ..step(0) };
            let clipping = apply_step_zero3(model, &mut optimizer, &mut parts, &clipped, local, &groups).err().expect("clipping is refused").to_string();
            (failed, after, open, unapplied, refused, inputs, retried, other_rate, clipping)
        })
    });
    for (rank, outcome) in outcome.into_iter().enumerate() {
        let (failed, after, open, unapplied, refused, inputs, retried, other_rate, clipping) = outcome.unwrap_or_else(|p| panic!("{p}"));
        assert!(other_rate.contains("learning rate 0.001") && other_rate.contains("begun with learning rate 0.01"), "rank {rank}: {other_rate}");
        assert!(clipping.contains("max_grad_norm Some(1.0)") && clipping.contains("the same StepInput"), "rank {rank}: {clipping}");
        assert!(inputs.contains("outside the model's vocabulary"), "rank {rank}: {inputs}");
        assert!(
            retried.contains("state is lost") && retried.contains("step 0's update in the backward began, and the step failed in its backward: none of its groups had reached the update yet"),
            "rank {rank}: {retried}"
        );
        assert!(open.contains("still takes its step's groups"), "rank {rank}: {open}");
        assert!(failed.contains("step 0: a NaN or an infinity appeared") && failed.contains("updated some layers in the backward"), "rank {rank}: {failed}");
        assert!(after.contains("state is lost"), "rank {rank}: {after}");
        assert!(unapplied.contains("step 0's update in the backward began, and the step was never applied") && unapplied.contains("state is lost"), "rank {rank}: {unapplied}");
        assert!(refused.contains("state is lost") && refused.contains("step 0's update in the backward began"), "rank {rank}: {refused}");
    }
}

/// An output head of its own (not tied to the embedding) is a group of its own with the final
/// norm: a checkpointed step gathers it alone for the head's piece, and the embedding without
/// it for the embedding's forward (under ZeRO-3 1 GB of bf16 each at 8B, not both's 2 GB), and
/// hands its gradients over right after its piece (`ParameterGroup::Head`, which ZeRO-3
/// reduce-scatters at once), not with the embedding's after every layer's backward, where an 8B
/// model's head would be held whole in f32 (2 GB) through the layers. A tied head's weight is
/// the embedding's: both pieces gather the rest, and its gradient, which the embedding's piece
/// adds to last, is handed over then, once. The embedding's backward gathers nothing: the
/// decoder's embedding is a lookup (`LayeredLm::embedding_lookup`).
#[test]
fn an_untied_head_is_gathered_alone_and_its_gradients_handed_over_before_the_layers_backward() {
    use burn::{optim::GradientsParams, tensor::backend::AutodiffBackend};
    use ulysses_training::{LayerCheckpointing, LayerParameters, ParameterGroup, WholeParameters, checkpointed_backward_with};
    /// The model itself, as `WholeParameters`, taking each group's gradients as ZeRO-3 does:
    /// the groups gathered, and those handed over with their gradients' count.
    #[derive(Default)]
    struct Recording {
        gathered: Vec<ParameterGroup>,
        handed: Vec<(ParameterGroup, usize)>,
    }
    impl<B: AutodiffBackend, M: Clone> LayerParameters<B, M> for Recording {
        fn gather(&mut self, model: &M, group: ParameterGroup) -> Result<M, burn_ulysses::UlyssesError> {
            self.gathered.push(group);
            <WholeParameters as LayerParameters<B, M>>::gather(&mut WholeParameters, model, group)
        }
        fn gradients_done(&mut self, _gathered: &M, group: ParameterGroup, grads: GradientsParams) -> Result<Option<GradientsParams>, burn_ulysses::UlyssesError> {
            self.handed.push((group, grads.len()));
            Ok(None)
        }
        fn trains(&self, _id: burn::module::ParamId) -> Option<bool> {
            None
        }
    }
    let device = Default::default();
    let sequence: Vec<i64> = (0..16).map(|t| (t * 7 + 3) % 64).collect();
    let shard = burn_ulysses::data::SequenceSharder::new(1).shard_documents(&[sequence], None, 0);
    let layers = [ParameterGroup::Layer(1), ParameterGroup::Layer(0)];
    let forward = [ParameterGroup::Layer(0), ParameterGroup::Layer(1)];
    for tied in [false, true] {
        let model = DecoderConfig::new(64).with_d_model(32).with_n_heads(4).with_n_kv_heads(2).with_ffn_hidden(64).with_tie_embeddings(tied).init::<Sp>(&device);
        let mut recording = Recording::default();
        let checkpointing = LayerCheckpointing::new();
        let (loss, left) = checkpointed_backward_with(&model, shard.tokens::<Sp>(&device), shard.labels::<Sp>(&device), &shard.positions, 1.0, -100, &checkpointing, 2, &mut recording, |_| {}).unwrap();
        assert!(loss.into_scalar().is_finite());
        let calls: Vec<ParameterGroup> = recording.handed.iter().map(|(group, _)| *group).collect();
        let counts: Vec<usize> = recording.handed.iter().map(|(_, count)| *count).collect();
        let (embedding, head) = if tied { (ParameterGroup::Rest, ParameterGroup::Rest) } else { (ParameterGroup::Embedding, ParameterGroup::Head) };
        assert_eq!(recording.gathered, [&[embedding][..], &forward, &[head], &layers].concat(), "tied {tied}: the gathers");
        if tied {
            // The layers, then the rest: the embedding (its two gradients summed) and the final norm.
            assert_eq!(calls, [&layers[..], &[ParameterGroup::Rest]].concat(), "tied");
            assert_eq!(counts[2], 2, "tied: the rest's gradients {counts:?}");
        } else {
            // The head and the final norm first, the layers, then the embedding alone.
            assert_eq!(calls, [&[ParameterGroup::Head][..], &layers, &[ParameterGroup::Embedding]].concat(), "untied");
            assert_eq!((counts[0], counts[3]), (2, 1), "untied: the head's and the embedding's gradients {counts:?}");
        }
        // Every parameter's gradient handed over once, none left with the step.
        assert_eq!((counts.iter().sum::<usize>(), left.len()), (ulysses_training::float_parameters(&model).len(), 0), "tied {tied}: {counts:?}");
    }
}

/// What ZeRO-3 gathers for each group of the embedding's and the head's: an untied head's group
/// holds the final norm and the head whole and the embedding a placeholder, the embedding's the
/// reverse, the rest all three; each whole one as the model held it before it was sharded.
#[test]
fn zero_3_gathers_an_untied_head_apart_from_the_embedding() {
    use ulysses_training::{LayerParameters, OptimizerPlace, ParameterGroup, ShardedParameters};
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/ulysses-models/tests/fixtures/qwen3");
    let per_rank = with_deadline(Duration::from_secs(120), move || {
        ThreadGroup::new(2).run(move |rank| {
            let groups: ParallelGroups<Inner> = ParallelGroups::new(rank.communicator(), ParallelLayout::new().with_sp_size(2)).unwrap();
            let device = Default::default();
            let model = ulysses_models::from_pretrained::<Sp>(&fixture, &device).unwrap().model;
            assert!(model.lm_head.is_some(), "the fixture's head must be untied");
            let whole = parameter_values(&model);
            let (model, mut parts) = ShardedParameters::shard(model, rank.rank(), 2, OptimizerPlace::Device).unwrap();
            let gathered = [ParameterGroup::Head, ParameterGroup::Embedding, ParameterGroup::Rest]
                .map(|group| (group, parameter_values(&parts.over(&*groups.world).gather(&model, group).unwrap())));
            (whole, gathered)
        })
    });
    for (rank, result) in per_rank.into_iter().enumerate() {
        let (whole, gathered) = result.unwrap_or_else(|p| panic!("rank {rank}: {p}"));
        for (group, values) in gathered {
            let is_whole = |prefix: &str| {
                let (name, got) = values.iter().find(|(name, _)| name.starts_with(prefix)).unwrap_or_else(|| panic!("no parameter {prefix}"));
                let want = &whole.iter().find(|(n, _)| n == name).unwrap().1;
                match got.len() {
                    1 => false,
                    _ => {
                        assert!(bit_identical(got, want), "rank {rank}, {group:?}: {name} gathered differs");
                        true
                    }
                }
            };
            let (head, norm, embedding) = (is_whole("lm_head"), is_whole("norm"), is_whole("embedding"));
            let want = match group {
                ParameterGroup::Head => (true, true, false),
                ParameterGroup::Embedding => (false, false, true),
                _ => (true, true, true),
            };
            assert_eq!((head, norm, embedding), want, "rank {rank}, {group:?}: (head, final norm, embedding) whole");
        }
    }
}

/// ZeRO-3 cut from master weights that are not this rank's (another rank's or world's, or
/// another model's) is refused before any part is cut, naming what the optimizer holds: a
/// resume must load the state for its own place (`ShardedAdamW::load` re-partitions it).
#[test]
fn zero_3_cut_from_master_weights_of_another_place_is_refused() {
    use ulysses_training::{HostAdamWConfig, PartsFrom, ShardedAdamW, ShardedParameters};
    let config = DecoderConfig::new(VOCAB).with_d_model(32).with_n_layers(2).with_n_heads(4).with_n_kv_heads(2).with_ffn_hidden(64).with_repeat_kv(false);
    let run = move || {
        ThreadGroup::new(1).run(|rank| {
            let device = Default::default();
            let mut errors = Vec::new();
            for (held_by, rank_of, world_of) in [(config.clone(), 1, 2), (config.clone().with_n_layers(1), 0, 1)] {
                let mut host = ShardedAdamW::new(HostAdamWConfig::default());
                host.keep_master_weights(&held_by.init::<Sp>(&device), rank_of, world_of).unwrap();
                let cut = ShardedParameters::shard_from(config.init::<Sp>(&device), PartsFrom::Masters, &mut host, FloatDType::F32, false, &device, &*rank.communicator());
                errors.push(cut.err().map(|e| e.to_string()));
            }
            errors
        })
    };
    let errors = with_deadline(Duration::from_secs(60), run).pop().unwrap().unwrap_or_else(|p| panic!("{p}"));
    let another_world = errors[0].as_deref().expect("master weights of rank 1 of 2 cut as rank 0 of 1");
    assert!(another_world.contains("rank 1's parts of a world of 2") && another_world.contains("rank 0 of 1"), "{another_world}");
    let another_model = errors[1].as_deref().expect("master weights of a 1-layer model cut into a 2-layer one");
    assert!(another_model.contains("one sharded optimizer per model"), "{another_model}");
}

/// One parameter at two places of a model (a norm's gain given to every norm: one ParamId) is
/// refused by ZeRO-3, naming two of its places: each place's part is gathered into it, and the
/// second place would keep its placeholder, zeros, silently.
#[test]
fn one_parameter_at_two_places_is_refused_by_zero_3() {
    use burn::module::{Module, ModuleMapper, Param};
    use ulysses_training::{OptimizerPlace, ShardedParameters};
    struct ShareTheFirstVector(Option<burn::module::ParamId>);
    impl<B: burn::tensor::backend::Backend> ModuleMapper<B> for ShareTheFirstVector {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            match (D, self.0) {
                (1, None) => {
                    self.0 = Some(param.id);
                    param
                }
                (1, Some(id)) => Param::initialized(id, param.val()),
                _ => param,
            }
        }
    }
    let config = DecoderConfig::new(VOCAB).with_d_model(16).with_n_layers(2).with_n_heads(2).with_n_kv_heads(2).with_ffn_hidden(32);
    let model = deterministic_params(config.init::<Sp>(&Default::default()), INIT_SEED);
    let shared = model.clone().map(&mut ShareTheFirstVector(None));
    let error = ShardedParameters::shard(shared, 0, 1, OptimizerPlace::Host).err().expect("one parameter at two places sharded").to_string();
    assert!(error.contains("blocks.0.attention_norm") && error.contains("are one parameter") && error.contains("--zero 3"), "{error}");
    assert!(ShardedParameters::shard(model, 0, 1, OptimizerPlace::Host).is_ok(), "the decoder as it is");
}

/// A parameter of no elements is refused where the sharded optimizers and ZeRO-3 first read
/// the model, naming it: its parts would be empty, and burn's `narrow` panics on those deep in
/// a step.
#[test]
fn a_parameter_of_no_elements_is_refused_by_the_sharded_optimizers_and_zero_3() {
    use burn::module::{Module, ModuleMapper, Param};
    use ulysses_training::{DeviceShardedAdamW, HostAdamWConfig, OptimizerPlace, ShardedAdamW, ShardedParameters};
    struct EmptyTheFirstVector(bool);
    impl<B: burn::tensor::backend::Backend> ModuleMapper<B> for EmptyTheFirstVector {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            if D != 1 || self.0 {
                return param;
            }
            self.0 = true;
            let device = param.val().device();
            Param::initialized(param.id, Tensor::zeros([0; D], &device).require_grad())
        }
    }
    let config = DecoderConfig::new(VOCAB).with_d_model(16).with_n_layers(2).with_n_heads(2).with_n_kv_heads(2).with_ffn_hidden(32);
    let model = deterministic_params(config.init::<Sp>(&Default::default()), INIT_SEED);
    let emptied = model.clone().map(&mut EmptyTheFirstVector(false));
    let named = |error: String| assert!(error.contains("blocks.0.attention_norm") && error.contains("has no elements"), "{error}");
    named(ShardedParameters::shard(emptied.clone(), 0, 2, OptimizerPlace::Host).err().expect("an empty parameter sharded").to_string());
    named(ShardedAdamW::new(HostAdamWConfig::default()).keep_master_weights(&emptied, 0, 2).err().expect("an empty parameter's master part kept").to_string());
    named(DeviceShardedAdamW::<Sp>::new(HostAdamWConfig::default()).keep_master_weights(&emptied, 1, 2).err().expect("an empty parameter's master part kept").to_string());
    assert!(ShardedParameters::shard(model, 0, 2, OptimizerPlace::Host).is_ok(), "the decoder as it is");
}

/// The decoder with one thing a port of one's own could get wrong.
#[derive(burn::module::Module, Debug)]
struct AlteredDecoder<B: burn::tensor::backend::Backend> {
    decoder: ulysses_models::Decoder<B>,
    #[module(skip)]
    alteration: Alteration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Alteration {
    /// None: the decoder as ported.
    AsPorted,
    /// Layer 1's first vector (a norm's weight) left out of what `LayeredLm::visit_layer(1)`
    /// visits, though that layer uses it: under ZeRO-3 it belongs to the rest, a one-element
    /// placeholder while layer 1 runs.
    LeavesOutANorm,
    /// Each tile's RoPE taken from the shard's first rows (`before_core` given `0..tile`, not
    /// its rows): RoPE from 0 in every tile.
    RopeFromRowZeroInEachTile,
    /// The same in the backward's recomputation alone (where `hidden` requires its gradient).
    RopeFromRowZeroWhenRecomputed,
    /// A position signal `arange(0..tile)` added after the core, in every tile from 0.
    ArangeAfterTheCore,
    /// Each token plus the one before it, before the core (a token shift within each tile).
    TokenShiftBeforeTheCore,
}

/// Visits all but the first vector it is shown.
struct SkipFirstVector<'a, V> {
    visitor: &'a mut V,
    skipped: Option<burn::module::ParamId>,
}

impl<B: burn::tensor::backend::Backend, V: burn::module::ModuleVisitor<B>> burn::module::ModuleVisitor<B> for SkipFirstVector<'_, V> {
    fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<B, D>>) {
        match (D, self.skipped) {
            (1, None) => self.skipped = Some(param.id),
            _ => self.visitor.visit_float(param),
        }
    }
}

impl<B: burn::tensor::backend::Backend> ulysses_training::LayeredLm<B> for AlteredDecoder<B> {
    type Context = <ulysses_models::Decoder<B> as ulysses_training::LayeredLm<B>>::Context;
    fn context(&self, positions: &ShardPositions, device: &B::Device) -> Self::Context {
        self.decoder.context(positions, device)
    }
    fn embed(&self, tokens: Tensor<B, 2, Int>, context: &Self::Context) -> Tensor<B, 3> {
        self.decoder.embed(tokens, context)
    }
    fn layer_count(&self) -> usize {
        self.decoder.layer_count()
    }
    fn visit_layer<V: burn::module::ModuleVisitor<B>>(&self, index: usize, visitor: &mut V) {
        match (self.alteration, index) {
            (Alteration::LeavesOutANorm, 1) => self.decoder.visit_layer(index, &mut SkipFirstVector { visitor, skipped: None }),
            _ => self.decoder.visit_layer(index, visitor),
        }
    }
    fn before_core(&self, index: usize, hidden: Tensor<B, 3>, rows: std::ops::Range<usize>, context: &Self::Context) -> Vec<Tensor<B, 4>> {
        let from_row_zero = match self.alteration {
            Alteration::RopeFromRowZeroInEachTile => true,
            Alteration::RopeFromRowZeroWhenRecomputed => hidden.is_require_grad(),
            _ => false,
        };
        let rows = if from_row_zero { 0..rows.len() } else { rows };
        let hidden = match self.alteration {
            Alteration::TokenShiftBeforeTheCore => {
                let [batch, tile, width] = hidden.dims();
                let before = Tensor::cat(vec![Tensor::zeros([batch, 1, width], &hidden.device()), hidden.clone().slice([0..batch, 0..tile - 1])], 1);
                hidden + before
            }
            _ => hidden,
        };
        self.decoder.before_core(index, hidden, rows, context)
    }
    fn core(&self, index: usize, inputs: Vec<Tensor<B, 4>>, context: &Self::Context) -> Tensor<B, 4> {
        self.decoder.core(index, inputs, context)
    }
    fn after_core(&self, index: usize, hidden: Tensor<B, 3>, core: Tensor<B, 4>) -> Tensor<B, 3> {
        let output = self.decoder.after_core(index, hidden, core);
        if self.alteration != Alteration::ArangeAfterTheCore {
            return output;
        }
        let tile = output.dims()[1];
        let positions = Tensor::<B, 1, Int>::arange(0..tile as i64, &output.device()).float().reshape([1, tile, 1]);
        output + positions * 1e-3
    }
    fn head(&self, hidden: Tensor<B, 3>) -> ulysses_training::LmOutput<B> {
        self.decoder.head(hidden)
    }
    fn visit_standalone_head<V: burn::module::ModuleVisitor<B>>(&self, visitor: &mut V) {
        self.decoder.visit_standalone_head(visitor)
    }
    fn embedding_lookup(&self) -> Option<ulysses_training::EmbeddingLookup> {
        self.decoder.embedding_lookup()
    }
}

impl<B: burn::tensor::backend::AutodiffBackend> ulysses_training::CausalLm<B> for AlteredDecoder<B> {
    fn logits(&self, tokens: Tensor<B, 2, Int>, positions: &ShardPositions) -> Tensor<B, 3> {
        self.decoder.forward(tokens, positions)
    }
    fn vocab_size(&self) -> usize {
        self.decoder.vocab_size()
    }
    fn is_causal(&self) -> bool {
        true
    }
}

/// Visits nothing.
struct NoVisit;

impl<B: burn::tensor::backend::Backend> burn::module::ModuleVisitor<B> for NoVisit {}

/// Each float parameter's id and whether it requires a gradient.
struct RequiresGrad<'a>(&'a mut Vec<(burn::module::ParamId, bool)>);

impl<B: burn::tensor::backend::Backend> burn::module::ModuleVisitor<B> for RequiresGrad<'_> {
    fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<B, D>>) {
        self.0.push((param.id, param.val().is_require_grad()));
    }
}

/// `module` with the parameters `frozen` requiring no gradient.
fn frozen<B: burn::tensor::backend::AutodiffBackend, M: burn::module::Module<B>>(module: M, frozen: &[burn::module::ParamId]) -> M {
    use burn::module::{ModuleMapper, Param};
    struct Freeze<'a>(&'a [burn::module::ParamId]);
    impl<B: burn::tensor::backend::AutodiffBackend> ModuleMapper<B> for Freeze<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            if !self.0.contains(&param.id) {
                return param;
            }
            let (id, tensor, mapper) = param.consume();
            Param::from_mapped_value(id, tensor.set_require_grad(false), mapper)
        }
    }
    module.map(&mut Freeze(frozen))
}

/// ZeRO-3 runs a group's pieces with every other parameter a one-element placeholder. A model
/// whose `LayeredLm::visit_layer` leaves out a parameter its layer uses is refused by name,
/// trainable or frozen: a frozen norm's placeholder (a zero, broadcast) ran the layer silently
/// wrong before, as it asks for no gradient. A model that visits its layers right keeps its
/// frozen parameters (a looked-up embedding, a layer's norm) frozen and unchanged through a
/// step, and its others trained, on one rank and on three (DP=3: padded parts, the ranks'
/// models equal after the step).
#[test]
fn zero_3_names_a_parameter_a_group_leaves_out_and_keeps_frozen_ones_frozen() {
    use burn::module::Module;
    use ulysses_training::{HostAdamWConfig, LayerCheckpointing, LayeredLm, OptimizerPlace, ShardedAdamW, ShardedParameters, StepInput, apply_step_zero3, backward_step_zero3};
    ThreadGroup::new(1).run(|rank| {
        let groups: ParallelGroups<Inner> = ParallelGroups::new(rank.communicator(), ParallelLayout::new()).unwrap();
        let device = Default::default();
        let batches = vec![VariedLengths { vocab: VOCAB }.train_batch(0)];
        let step = StepInput { index: 0, learning_rate: 1e-2, micro_batches: &batches, documents: None, targets: None, max_grad_norm: None };
        let checkpointing = LayerCheckpointing::new();
        let decoder = || deterministic_params(config(ParallelLayout::new(), 1).model.init::<Sp>(&device), INIT_SEED);
        fn sharded<M: burn::module::AutodiffModule<Sp> + LayeredLm<Sp>>(model: M) -> (M, ShardedParameters<Sp>, ShardedAdamW) {
            let mut optimizer = ShardedAdamW::new(HostAdamWConfig::default());
            optimizer.keep_master_weights(&model, 0, 1).unwrap();
            let (placeholders, parts) = ShardedParameters::shard(model, 0, 1, OptimizerPlace::Host).unwrap();
            (placeholders, parts, optimizer)
        }

        for freeze in [false, true] {
            let model = AlteredDecoder { decoder: decoder(), alteration: Alteration::LeavesOutANorm };
            let mut left_out = SkipFirstVector { visitor: &mut NoVisit, skipped: None };
            model.decoder.visit_layer(1, &mut left_out);
            let left_out = left_out.skipped.expect("layer 1 has a norm");
            let model = if freeze { frozen(model, &[left_out]) } else { model };
            let (placeholders, mut parts, _) = sharded(model);
            let message = backward_step_zero3(&placeholders, &step, &SequenceSharder::new(1), &groups, &device, &checkpointing, &mut parts).err().map(|e| e.to_string());
            let message = message.unwrap_or_else(|| panic!("frozen {freeze}: the step ran layer 1 on a placeholder"));
            let frozen_note = if freeze { " (frozen)" } else { "" };
            assert!(
                message.contains("the pieces of Layer(1) use decoder.blocks.1.attention_norm.gamma") && message.contains(&format!("{frozen_note}, which that group does not hold")) && message.contains("LayeredLm::visit_layer must visit"),
                "frozen {freeze}: {message}"
            );
        }

    })
    .into_iter()
    .for_each(|rank| rank.unwrap_or_else(|panic| panic!("{panic}")));

    // Visited right: the embedding (a lookup, untied) and layer 0's first vector frozen, on one
    // rank and on three (DP=3, the parts padded; the frozen ones have no gradient anywhere).
    for world in [1, 3] {
        let per_rank = ThreadGroup::new(world).run(|rank| {
            let groups: ParallelGroups<Inner> = ParallelGroups::new(rank.communicator(), ParallelLayout::new().with_dp_size(world)).unwrap();
            let device = Default::default();
            let batches = vec![VariedLengths { vocab: VOCAB }.train_batch(rank.rank())];
            let step = StepInput { index: 0, learning_rate: 1e-2, micro_batches: &batches, documents: None, targets: None, max_grad_norm: None };
            let model = deterministic_params(config(ParallelLayout::new(), 1).model.init::<Sp>(&device), INIT_SEED);
            let mut first = SkipFirstVector { visitor: &mut NoVisit, skipped: None };
            model.visit_layer(0, &mut first);
            let frozen_ids = [model.embedding.weight.id, first.skipped.unwrap()];
            let model = frozen(model, &frozen_ids);
            let before = parameter_values(&model);
            let mut optimizer = ShardedAdamW::new(HostAdamWConfig::default());
            optimizer.keep_master_weights(&model, rank.rank(), world).unwrap();
            let (placeholders, mut parts) = ShardedParameters::shard(model, rank.rank(), world, OptimizerPlace::Host).unwrap();
            let local = backward_step_zero3(&placeholders, &step, &SequenceSharder::new(1), &groups, &device, &LayerCheckpointing::new(), &mut parts).unwrap();
            let (placeholders, report) = apply_step_zero3(placeholders, &mut optimizer, &mut parts, &step, local, &groups).unwrap();
            assert!(report.loss.is_finite(), "{world} rank(s): {report:?}");
            let model = parts.gather_all(placeholders, &*groups.world).unwrap();
            let mut flags = Vec::new();
            model.visit(&mut RequiresGrad(&mut flags));
            let after = parameter_values(&model);
            assert_eq!(flags.len(), before.len(), "a flag for each parameter");
            for ((name, want, got), (id, trains)) in paired_parameters(&before, &after).zip(flags) {
                let is_frozen = frozen_ids.contains(&id);
                assert_eq!(trains, !is_frozen, "{world} rank(s): {name} requires a gradient after the step");
                assert_eq!(got == want, is_frozen, "{world} rank(s): {name}: frozen {is_frozen}, changed by the step {}", got != want);
            }
            after
        });
        let per_rank: Vec<_> = per_rank.into_iter().map(|rank| rank.unwrap_or_else(|panic| panic!("{panic}"))).collect();
        assert!(per_rank.iter().all(|after| *after == per_rank[0]), "{world} ranks ended with different parameters");
    }
}

/// ZeRO-3 cut again from the host optimizer's master weights right after a step, its update
/// still on its thread (`PartsFrom::Masters`, as switching where the parts live would): the
/// cut waits for the update and holds the step's parameters, where it panicked ("ShardedAdamW
/// read while a step's update still runs").
#[test]
fn zero_3_cut_from_the_masters_while_the_update_runs_waits_for_it() {
    use ulysses_training::{HostAdamWConfig, LayerCheckpointing, PartsFrom, ShardedAdamW, ShardedParameters, StepInput, apply_step_zero3, backward_step_zero3};
    ThreadGroup::new(1)
        .run(|rank| {
            let groups: ParallelGroups<Inner> = ParallelGroups::new(rank.communicator(), ParallelLayout::new()).unwrap();
            let device = Default::default();
            let model = || deterministic_params(config(ParallelLayout::new(), 1).model.init::<Sp>(&device), INIT_SEED);
            let mut optimizer = ShardedAdamW::new(HostAdamWConfig::default());
            let (placeholders, mut parts) = ShardedParameters::shard_from(model(), PartsFrom::Rank0, &mut optimizer, FloatDType::F32, false, &device, &*groups.world).unwrap();
            let batches = vec![VariedLengths { vocab: VOCAB }.train_batch(0)];
            let step = StepInput { index: 0, learning_rate: 1e-2, micro_batches: &batches, documents: None, targets: None, max_grad_norm: None };
            let local = backward_step_zero3(&placeholders, &step, &SequenceSharder::new(1), &groups, &device, &LayerCheckpointing::new(), &mut parts).unwrap();
            let (placeholders, _) = apply_step_zero3(placeholders, &mut optimizer, &mut parts, &step, local, &groups).unwrap();
            let (again, mut cut) = ShardedParameters::shard_from(model(), PartsFrom::Masters, &mut optimizer, FloatDType::F32, false, &device, &*groups.world).unwrap();
            let (stepped, recut) = (parameter_values(&parts.gather_all(placeholders, &*groups.world).unwrap()), parameter_values(&cut.gather_all(again, &*groups.world).unwrap()));
            assert!(paired_parameters(&stepped, &recut).all(|(_, a, b)| bit_identical(a, b)), "the cut from the masters is not the step's parameters");
            assert!(paired_parameters(&stepped, &parameter_values(&model())).any(|(_, a, b)| a != b), "the step changed nothing");
        })
        .into_iter()
        .for_each(|rank| rank.unwrap_or_else(|panic| panic!("{panic}")));
}

/// Gradients finite on every rank whose sum over the ranks overflows f32 (each near f32's
/// largest, a diverging run) stop the step before the optimizer, as a NaN on a rank does,
/// rather than reaching AdamW as an infinity (clipped by an infinite norm: NaN parameters),
/// with the optimizer replicated and sharded on the host (ZeRO-1's `--offload-optimizer`:
/// its state as it was, byte for byte in its files).
#[test]
fn finite_gradients_whose_sum_over_the_ranks_overflows_stop_the_step_unchanged() {
    use ulysses_training::{ShardedAdamW, ShardedState, StepInput, apply_step, apply_step_sharded, backward_step, host_adamw_config};
    let results = ThreadGroup::new(2).run(|rank| {
        let groups: ParallelGroups<Inner> = ParallelGroups::new(rank.communicator(), ParallelLayout::new().with_dp_size(2)).unwrap();
        let device = Default::default();
        let config = DecoderConfig::new(VOCAB).with_d_model(16).with_n_layers(1).with_n_heads(2).with_n_kv_heads(2).with_ffn_hidden(32);
        let model = deterministic_params(config.init::<Sp>(&device), INIT_SEED);
        let batches = vec![VariedLengths { vocab: VOCAB }.train_batch(0)];
        let step = StepInput { index: 0, learning_rate: 1e-3, micro_batches: &batches, documents: None, targets: None, max_grad_norm: Some(1.0) };
        let overflowing = || {
            let mut local = backward_step(&model, &step, &SequenceSharder::new(1), &groups, &device).unwrap();
            // The embedding's gradient, 2e38 everywhere on both ranks: finite, its sum 4e38 not.
            let id = model.embedding.weight.id;
            type Grad = <Sp as burn::tensor::backend::AutodiffBackend>::InnerBackend;
            let huge = local.grads.get::<Grad, 2>(id).expect("the embedding's gradient").ones_like() * 2e38;
            local.grads.register::<Grad, 2>(id, huge);
            local
        };
        let before = model.embedding.weight.val().into_data();
        let kept = model.clone();
        let replicated = apply_step(model.clone(), &mut AdamWConfig::new().init(), &step, overflowing(), &groups).err().expect("the step stopped").to_string();
        assert_eq!(kept.embedding.weight.val().into_data(), before);
        let mut sharded = ShardedAdamW::new(host_adamw_config(&AdamWConfig::new()).unwrap());
        sharded.keep_master_weights(&model, rank.rank(), 2).unwrap();
        let dir = std::env::temp_dir().join(format!("ulysses-overflow-sum-{}", std::process::id()));
        let state = |name: &str, optimizer: &mut ShardedAdamW| std::fs::read(optimizer.save(&dir.join(name), rank.rank(), 2).unwrap()).unwrap();
        let state_before = state("before", &mut sharded);
        let on_host = match apply_step_sharded(model.clone(), &mut sharded, &step, overflowing(), &groups) {
            Ok((_, report)) => format!("the step went on, its norm {}", report.grad_norm),
            Err(error) => error.to_string(),
        };
        assert!(state("after", &mut sharded) == state_before, "the host optimizer's state changed");
        [replicated, on_host]
    });
    for errors in results {
        for error in errors.unwrap_or_else(|panic| panic!("{panic}")) {
            assert!(error.contains("step 0: a NaN or an infinity appeared in the gradients summed over the ranks") && error.contains("changed no parameter"), "{error}");
        }
    }
}

/// An optimizer's step runs outside the guard: its own batched square products (Muon's
/// Newton–Schulz over stacked experts' weights, a Shampoo preconditioner) mix no tokens but
/// have attention's shapes, and were refused under SP. The model's forward stays guarded.
#[test]
fn an_optimizers_own_square_products_are_not_taken_for_attention() {
    use burn::{
        module::AutodiffModule,
        optim::{GradientsParams, MultiGradientsParams, Optimizer, adaptor::OptimizerAdaptor},
        tensor::backend::AutodiffBackend,
    };
    use ulysses_training::{StepInput, apply_step, backward_step};
    /// AdamW after a batched square product of its own, as Muon's iteration makes.
    #[derive(Clone)]
    struct SquaresInStep<O>(O);
    impl<M: AutodiffModule<B>, B: AutodiffBackend, O: Optimizer<M, B> + Clone> Optimizer<M, B> for SquaresInStep<O> {
        type Record = O::Record;
        fn step(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
            let square = Tensor::<B::InnerBackend, 3>::ones([4, 8, 8], &module.devices()[0]);
            let _ = square.clone().matmul(square);
            self.0.step(lr, module, grads)
        }
        fn step_multi(&mut self, lr: f64, module: M, grads: MultiGradientsParams) -> M {
            self.0.step_multi(lr, module, grads)
        }
        fn to_record(&self) -> Self::Record {
            self.0.to_record()
        }
        fn load_record(self, record: Self::Record) -> Self {
            Self(self.0.load_record(record))
        }
    }
    let results = ThreadGroup::new(2).run(|rank| {
        let groups: ParallelGroups<Inner> = ParallelGroups::new(rank.communicator(), ParallelLayout::new().with_sp_size(2)).unwrap();
        let _sp = enter_sp(&groups);
        let device = Default::default();
        let config = DecoderConfig::new(VOCAB).with_d_model(16).with_n_layers(1).with_n_heads(2).with_n_kv_heads(2).with_ffn_hidden(32);
        let model = deterministic_params(config.init::<Sp>(&device), INIT_SEED);
        let batches = vec![VariedLengths { vocab: VOCAB }.train_batch(0)];
        let step = StepInput { index: 0, learning_rate: 1e-3, micro_batches: &batches, documents: None, targets: None, max_grad_norm: None };
        let local = backward_step(&model, &step, &SequenceSharder::new(2), &groups, &device).unwrap();
        let mut optimizer: SquaresInStep<OptimizerAdaptor<_, _, Sp>> = SquaresInStep(AdamWConfig::new().init());
        let (_, report) = apply_step(model, &mut optimizer, &step, local, &groups).unwrap();
        // The same product in the model's place is still refused.
        let square = Tensor::<Sp, 3>::ones([4, 8, 8], &device);
        let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| square.clone().matmul(square))).is_err();
        (report.loss.is_finite(), refused)
    });
    for result in results {
        let (stepped, refused) = result.unwrap_or_else(|panic| panic!("{panic}"));
        assert!(stepped && refused, "stepped {stepped}, the forward's square refused {refused}");
    }
}

/// A loop of one's own, as docs/library.md writes it for burn 0.21 (the layout's sharder, the
/// SP group's context, the shard's positions noted around the forward, the loss summed over the
/// step's labelled tokens on every rank, the gradients summed over the world, the optimizer
/// outside the group), trains at SP 2 × DP 2 as on one device: the losses and parameters of
/// three SGD steps (SGD: a gradient off by a factor shows) within [`TOLERANCE`].
#[test]
fn a_loop_of_ones_own_as_the_guide_writes_it_trains_like_one_device() {
    use burn::optim::{GradientsParams, Optimizer, SgdConfig};
    use burn_ulysses::{attention_guard::note_shard_positions, context, data::IGNORE_INDEX};
    use ulysses_training::{all_reduce_gradients, broadcast_parameters, masked_cross_entropy_sum, sum_f64_over_ranks, sum_over_ranks};

    fn own_loop(layout: ParallelLayout) -> (Vec<f64>, Vec<(String, Vec<f32>)>) {
        let mut ranks = ThreadGroup::new(layout.world_size()).run(|rank| {
            let groups = ParallelGroups::<Inner>::new(rank.communicator(), layout).unwrap();
            // The SP group's context (never the world's under DP), on the forward's thread.
            let _sp = context::enter(RankScope::Thread, groups.rank_context(UlyssesConfig::new()));
            let device = Default::default();
            let model = deterministic_params(config(layout, 1).model.init::<Sp>(&device), INIT_SEED + rank.rank() as u64);
            let mut model = broadcast_parameters(model, &*groups.world).unwrap();
            let mut optimizer = SgdConfig::new().init();
            let mut losses = vec![];
            for step in 0..3 {
                // This replica's sequences, then this rank's shard of each (labels shifted first).
                let batch = VariedLengths { vocab: VOCAB }.train_batch(step);
                let per_replica = batch.len() / layout.dp_size;
                let replica = &batch[groups.dp_rank() * per_replica..(groups.dp_rank() + 1) * per_replica];
                let shard = layout.sharder().shard(replica, groups.sp_rank());
                let [count] = sum_over_ranks(&*groups.world, [shard.valid_tokens]).unwrap();
                if count == 0 {
                    continue;
                }
                let logits = {
                    let _noted = note_shard_positions(&shard.positions);
                    model.forward(shard.tokens(&device), &shard.positions)
                };
                let loss = masked_cross_entropy_sum(logits, shard.labels(&device), IGNORE_INDEX).div_scalar(count as f64);
                let local: f64 = loss.clone().into_data().convert::<f64>().to_vec::<f64>().unwrap()[0];
                losses.push(sum_f64_over_ranks(&*groups.world, local).unwrap());
                let grads = all_reduce_gradients(&model, GradientsParams::from_grads(loss.backward(), &model), &*groups.world).unwrap();
                model = {
                    let _one_device = context::enter_single_device();
                    optimizer.step(0.5, model, grads)
                };
            }
            (losses, parameter_values(&model))
        });
        ranks.swap_remove(0).unwrap_or_else(|p| panic!("{}", p.message))
    }
    let (one_device, sp2_dp2) = with_deadline(Duration::from_secs(60), || (own_loop(ParallelLayout::new()), own_loop(ParallelLayout::new().with_sp_size(2).with_dp_size(2))));
    println!("one device {:?}, SP 2 × DP 2 {:?}", one_device.0, sp2_dp2.0);
    assert!(one_device.0.iter().all(|l| l.is_finite()) && one_device.0[2] < one_device.0[0], "the loss should fall: {:?}", one_device.0);
    let loss_gap = largest_gap(&sp2_dp2.0, &one_device.0);
    let parameter_gap = worst(paired_parameters(&sp2_dp2.1, &one_device.1).map(|(_, a, b)| max_abs_diff(a, b)));
    assert!(loss_gap <= TOLERANCE && parameter_gap <= TOLERANCE, "SP 2 × DP 2 differs from one device: losses by {loss_gap:e}, parameters by {parameter_gap:e}");
}
