//! A small Llama written plainly for burn 0.22.1 (`examples/model`) trained at SP = 2 and 4,
//! ranks as threads on Flex + autodiff (or wgpu: `ULYSSES_022_DEVICE=wgpu`, `--features wgpu`), against the same model on one device with burn's own
//! attention: the loss of every step and every parameter after the last within 1e-5; SP = 2 ×
//! DP = 2 likewise. And SP = 2 as two processes meeting over TCP (this test binary, started
//! again as each rank), which must give the threads' bits.

#[path = "../examples/model/mod.rs"]
mod model;

use burn::{
    module::{Module, ModuleMapper, ModuleVisitor, Param},
    optim::{GradientsParams, SgdConfig, decay::WeightDecayConfig},
    tensor::{Int, Tensor, TensorData},
};
use burn_ulysses_ops::{
    data::{IGNORE_INDEX, SequenceShard, SequenceSharder},
    job::{Launch, Rank, run_ranks},
    train::{all_reduce_gradients, all_reduce_sum, labels_in_step, lm_loss_sum},
};
use ulysses_dist::DistributedConfig;
use model::{TinyLlamaConfig, init_seeded, plain_device, uniform};

const TOLERANCE: f64 = 1e-5;
const STEPS: usize = 3;

const CONFIG: TinyLlamaConfig = TinyLlamaConfig { vocab: 40, hidden: 32, heads: 4, kv_heads: 2, layers: 2, intermediate: 48, rope_theta: 10_000.0 };

struct Flatten(Vec<f32>);

impl ModuleVisitor for Flatten {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.0.extend(param.val().into_data().convert::<f32>().try_into_vec::<f32>().unwrap());
    }
}

/// Two sequences of 17 and 12 tokens (padded to the group's multiple).
fn batch() -> Vec<Vec<i64>> {
    [(17, 50), (12, 51)].iter().map(|&(len, stream)| uniform(len, stream).iter().map(|v| ((v + 1.0) * 20.0) as i64 % CONFIG.vocab as i64).collect()).collect()
}

/// Freezes the token embedding (the one `[vocab, hidden]` parameter).
struct FreezeEmbedding;

impl ModuleMapper for FreezeEmbedding {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let frozen = param.val().dims()[..] == [CONFIG.vocab, CONFIG.hidden];
        if frozen { param.set_require_grad(false) } else { param }
    }
}

/// Each step's loss within [`TOLERANCE`] of one device's, as many steps on each side.
fn assert_losses_within_tolerance(run: &str, losses: &[f64], reference: &[f64]) {
    assert_eq!(losses.len(), reference.len(), "{run}: steps taken, against one device's");
    for (step, (got, want)) in losses.iter().zip(reference).enumerate() {
        assert!((got - want).abs() <= TOLERANCE, "{run}, step {step}: loss {got}, one device {want}");
    }
}

/// The largest gap between as many parameter values on each side, NaN where one is NaN (so
/// that a `<=` fails).
fn largest_parameter_gap(parameters: &[f32], reference: &[f32]) -> f32 {
    assert_eq!(parameters.len(), reference.len(), "parameter values, against one device's");
    parameters.iter().zip(reference).map(|(a, b)| (a - b).abs()).fold(0.0f32, |worst, d| if d.is_nan() || d > worst { d } else { worst })
}

/// Each step's loss, and every parameter after the last step. `sp` 1 runs outside any group:
/// burn's own attention and no reduction, the single-device reference.
fn train(sp: usize) -> (Vec<f64>, Vec<f32>) {
    train_with(sp, 1, false)
}

/// [`train`] at `sp` × `dp` ranks (threads, started by `job::run_ranks`), with the embedding
/// frozen and weight decay when `frozen_embedding`.
fn train_with(sp: usize, dp: usize, frozen_embedding: bool) -> (Vec<f64>, Vec<f32>) {
    if sp * dp == 1 {
        return train_rank(Place { sp_rank: 0, sp_size: 1, dp_rank: 0, dp_size: 1 }, frozen_embedding);
    }
    let dist = DistributedConfig::new().with_sp_size(sp);
    let results = run_ranks(&Launch::Threads, sp * dp, &dist, |rank| train_rank(Place::of(rank), frozen_embedding)).unwrap_or_else(|error| panic!("{error}"));
    let mut results = results.into_iter();
    let first = results.next().unwrap();
    for (rank, other) in results.enumerate() {
        assert_eq!(other.1, first.1, "rank {} holds other parameters than rank 0", rank + 1);
    }
    first
}

/// Where a rank sits in the job.
struct Place {
    sp_rank: usize,
    sp_size: usize,
    dp_rank: usize,
    dp_size: usize,
}

impl Place {
    fn of(rank: &Rank) -> Self {
        Self { sp_rank: rank.sp_rank, sp_size: rank.sp_size, dp_rank: rank.dp_rank, dp_size: rank.dp_size }
    }
}

/// One rank (its groups entered, if any): its replica's sequences of the batch, its part of
/// each; each step's loss, and every parameter after the last step.
fn train_rank(place: Place, frozen_embedding: bool) -> (Vec<f64>, Vec<f32>) {
    let batch = batch();
    let per_replica = batch.len() / place.dp_size;
    let replica = &batch[place.dp_rank * per_replica..(place.dp_rank + 1) * per_replica];
    let device = plain_device().autodiff();
    let mut model = init_seeded(&CONFIG, &device, 7);
    let mut optimizer = SgdConfig::new().init();
    if frozen_embedding {
        model = model.map(&mut FreezeEmbedding);
        optimizer = SgdConfig::new().with_weight_decay(Some(WeightDecayConfig::new(0.1))).init();
    }
    let shard = SequenceSharder::new(place.sp_size).shard(replica, place.sp_rank);
    let labels = labels_in_step(&shard) as f64;
    let int_tensor = |values: &[i64]| Tensor::<2, Int>::from_data(TensorData::new(values.to_vec(), [shard.batch, shard.local_len]), &device);
    let mut losses = Vec::new();
    for _ in 0..STEPS {
        let logits = model.forward(&CONFIG, int_tensor(&shard.tokens), shard.positions.ids.ids());
        let loss = lm_loss_sum(logits, int_tensor(&shard.labels), IGNORE_INDEX) / labels;
        losses.push(all_reduce_sum(loss.clone().into_scalar::<f64>()));
        let grads = all_reduce_gradients(&model, GradientsParams::from_grads(loss.backward(), &model));
        model = optimizer.step(0.5, model, grads);
    }
    let mut parameters = Flatten(Vec::new());
    model.visit(&mut parameters);
    (losses, parameters.0)
}

/// Set on the processes [`sp_2_as_two_processes_over_tcp_equals_the_threads`] starts.
const RANK_PROCESS: &str = "ULYSSES_022_TEST_RANK_PROCESS";

/// One rank of [`sp_2_as_two_processes_over_tcp_equals_the_threads`]: prints its losses and
/// parameters (as f32 bits).
#[test]
#[ignore = "a rank process of sp_2_as_two_processes_over_tcp_equals_the_threads, which starts it"]
fn rank_process() {
    if std::env::var_os(RANK_PROCESS).is_none() {
        eprintln!("rank_process runs only as a process started by sp_2_as_two_processes_over_tcp_equals_the_threads; nothing to do here");
        return;
    }
    let launch = Launch::from_env().unwrap();
    let mut results = run_ranks(&launch, 0, &DistributedConfig::new().with_env_overrides().unwrap(), |rank| {
        assert!(rank.is_process);
        train_rank(Place::of(rank), false)
    })
    .unwrap();
    let (losses, parameters) = results.remove(0);
    println!("LOSSES {}", losses.iter().map(|l| format!("{:x}", l.to_bits())).collect::<Vec<_>>().join(" "));
    println!("PARAMETERS {}", parameters.iter().map(|p| format!("{:x}", p.to_bits())).collect::<Vec<_>>().join(" "));
}

/// A rank process's output without its (long) parameter line.
fn without_parameters(text: &str) -> String {
    text.lines().filter(|l| !l.contains("PARAMETERS ")).collect::<Vec<_>>().join("\n")
}

#[test]
fn sp_2_as_two_processes_over_tcp_equals_the_threads() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "rank_process", "--include-ignored", "--nocapture", "--test-threads", "1"])
                .env(RANK_PROCESS, "1")
                .envs([("RANK", rank.to_string()), ("WORLD_SIZE", "2".into()), ("LOCAL_RANK", rank.to_string()), ("LOCAL_WORLD_SIZE", "2".into())])
                .envs([("MASTER_ADDR", "127.0.0.1".to_string()), ("MASTER_PORT", port.clone()), ("ULYSSES_RENDEZVOUS_TOKEN", "test-token".into())])
                .envs([("ULYSSES_COLLECTIVE_TIMEOUT", "120"), ("ULYSSES_SP_SIZE", "2")])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outputs: Vec<String> = ranks
        .into_iter()
        .enumerate()
        .map(|(rank, child)| {
            let output = child.wait_with_output().unwrap();
            let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
            assert!(output.status.success(), "rank process {rank} failed:\n{}", without_parameters(&text));
            text
        })
        .collect();
    let line = |text: &str, key: &str| -> Vec<u64> {
        // The harness may print "test rank_process ... " before it on the same line.
        let line = text.lines().find_map(|l| l.split_once(key).map(|(_, rest)| rest)).unwrap_or_else(|| panic!("no {key}line in:\n{}", without_parameters(text)));
        line.split_whitespace().map(|v| u64::from_str_radix(v, 16).unwrap()).collect()
    };
    let (losses, parameters) = train(2);
    let want_losses: Vec<u64> = losses.iter().map(|l| l.to_bits()).collect();
    let want_parameters: Vec<u64> = parameters.iter().map(|p| u64::from(p.to_bits())).collect();
    for (rank, text) in outputs.iter().enumerate() {
        assert_eq!(line(text, "LOSSES "), want_losses, "rank process {rank}: losses differ from SP=2 as threads");
        let got = line(text, "PARAMETERS ");
        assert_eq!(got.len(), want_parameters.len(), "rank process {rank}");
        if let Some(i) = got.iter().zip(&want_parameters).position(|(a, b)| a != b) {
            panic!("rank process {rank}: parameter value {i} is {}, SP=2 as threads {}", f32::from_bits(got[i] as u32), f32::from_bits(want_parameters[i] as u32));
        }
    }
    eprintln!("SP=2 over TCP: {} losses and {} parameter values, bit for bit those of SP=2 as threads", want_losses.len(), want_parameters.len());
}

#[test]
fn training_at_sp_2_and_4_equals_one_device() {
    let (reference_losses, reference_parameters) = train(1);
    assert!(reference_losses.iter().all(|l| l.is_finite()), "{reference_losses:?}");
    assert!(reference_losses[STEPS - 1] < reference_losses[0], "the reference does not train: {reference_losses:?}");
    for sp in [2, 4] {
        let (losses, parameters) = train(sp);
        eprintln!("SP={sp}: losses {losses:?}, one device {reference_losses:?}");
        assert_losses_within_tolerance(&format!("SP={sp}"), &losses, &reference_losses);
        assert_eq!(parameters.len(), reference_parameters.len());
        let mut worst = 0.0f64;
        for (i, (&got, &want)) in parameters.iter().zip(&reference_parameters).enumerate() {
            let error = (got as f64 - want as f64).abs();
            assert!(error <= TOLERANCE, "SP={sp}: parameter value {i} is {got}, one device {want}");
            worst = worst.max(error);
        }
        eprintln!("SP={sp}: {} parameter values, largest difference {worst:.2e}", parameters.len());
    }
}

#[test]
fn sp_2_by_dp_2_equals_one_device() {
    // Each replica one of the two sequences, each split over its SP group of 2.
    let (reference_losses, reference) = train(1);
    let (losses, parameters) = train_with(2, 2, false);
    eprintln!("SP=2 × DP=2: losses {losses:?}, one device {reference_losses:?}");
    assert_losses_within_tolerance("SP=2 × DP=2", &losses, &reference_losses);
    let worst = largest_parameter_gap(&parameters, &reference);
    assert!(worst <= TOLERANCE as f32, "SP=2 × DP=2: a parameter {worst} from one device");
    eprintln!("SP=2 × DP=2: {} parameter values, largest difference {worst:.2e}", parameters.len());
}

#[test]
fn a_frozen_parameter_stays_as_it_was_under_weight_decay() {
    // No rank has a gradient for the frozen embedding: the sum registers none, so the
    // optimizer's weight decay does not touch it (a zero gradient would decay it).
    let device = plain_device().autodiff();
    let mut initial = Flatten(Vec::new());
    init_seeded(&CONFIG, &device, 7).visit(&mut initial);
    let embedding = 0..CONFIG.vocab * CONFIG.hidden;
    let (reference_losses, reference) = train_with(1, 1, true);
    let (losses, parameters) = train_with(2, 1, true);
    let moved = |values: &[f32]| values[embedding.clone()].iter().zip(&initial.0[embedding.clone()]).filter(|(a, b)| a != b).count();
    assert_eq!(moved(&reference), 0, "one device moved values of the frozen embedding");
    assert_eq!(moved(&parameters), 0, "SP=2 moved values of the frozen embedding");
    assert_losses_within_tolerance("SP=2 with a frozen embedding", &losses, &reference_losses);
    let worst = largest_parameter_gap(&parameters, &reference);
    assert!(worst <= TOLERANCE as f32, "SP=2 with a frozen embedding: a parameter {worst} from one device");
}

/// A first gradient sum after one attention call, burn_ulysses_ops' (`exchanging`) or burn's
/// own, by ranks whose models come from `seed_of(rank)`: each rank's error, if any.
fn first_sum_after_attention(seed_of: fn(usize) -> u64, exchanging: bool) -> Vec<Result<(), String>> {
    use burn::tensor::ops::AttentionModuleOptions;
    run_ranks(&Launch::Threads, 2, &DistributedConfig::new().with_sp_size(2), move |rank| {
        let device = plain_device().autodiff();
        let model = init_seeded(&CONFIG, &device, seed_of(rank.rank));
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let x = || Tensor::<4>::zeros([1, 4, 4, 8], &device);
            let options = AttentionModuleOptions { is_causal: true, ..Default::default() };
            drop(match exchanging {
                true => burn_ulysses_ops::attention(x(), x(), x(), None, None, options),
                false => burn::tensor::module::attention(x(), x(), x(), None, None, options),
            });
            drop(all_reduce_gradients(&model, GradientsParams::new()));
        }))
        .map_err(|panic| ulysses_core::comm::panic_message(&*panic))
    })
    .unwrap_or_else(|error| panic!("{error}"))
}

/// Ranks whose models come from other seeds (as `init` on each rank thread draws) are refused at
/// their first gradient sum, naming the fix; from one seed they pass.
#[test]
fn ranks_with_other_parameters_are_refused_at_their_first_gradient_sum() {
    for (rank, result) in first_sum_after_attention(|rank| 7 + rank as u64, true).into_iter().enumerate() {
        let message = result.err().unwrap_or_else(|| panic!("rank {rank} summed gradients of other models"));
        assert!(message.contains("ranks 0 and 1 hold different parameters") && message.contains("init_seeded"), "rank {rank}: {message}");
    }
    assert_eq!(first_sum_after_attention(|_| 7, true), vec![Ok(()), Ok(())], "ranks with one seed");
}

/// A model new on one rank's thread alone (built again from a seed: other ids; the other rank
/// keeps its first) is compared on every rank at the next sum: a comparison is a collective,
/// and one rank alone in it parted the ranks' collectives. The same values pass; others are
/// refused on both ranks.
#[test]
fn a_model_new_on_one_rank_alone_is_compared_on_every_rank() {
    use burn::tensor::ops::AttentionModuleOptions;
    for (seed, differs) in [(7, false), (8, true)] {
        let results = run_ranks(&Launch::Threads, 2, &DistributedConfig::new().with_sp_size(2), move |rank| {
            let device = plain_device().autodiff();
            let mut model = init_seeded(&CONFIG, &device, 7);
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                for sum in 0..2 {
                    if sum == 1 && rank.rank == 1 {
                        model = init_seeded(&CONFIG, &device, seed);
                    }
                    let x = || Tensor::<4>::zeros([1, 4, 4, 8], &device);
                    drop(burn_ulysses_ops::attention(x(), x(), x(), None, None, AttentionModuleOptions { is_causal: true, ..Default::default() }));
                    drop(all_reduce_gradients(&model, GradientsParams::new()));
                }
            }))
            .map_err(|panic| ulysses_core::comm::panic_message(&*panic))
        })
        .unwrap_or_else(|error| panic!("{error}"));
        for (rank, result) in results.into_iter().enumerate() {
            match differs {
                false => assert!(result.is_ok(), "seed {seed}, rank {rank}: {result:?}"),
                true => assert!(result.as_ref().is_err_and(|m| m.contains("ranks 0 and 1 hold different parameters")), "seed {seed}, rank {rank}: {result:?}"),
            }
        }
    }
}

/// A step whose attention never went through the group (burn's own attention: each rank
/// attends within its shard) is refused at its gradient sum on every rank, naming the fix.
#[test]
fn a_step_whose_attention_never_exchanged_is_refused_at_its_gradient_sum() {
    for (rank, result) in first_sum_after_attention(|_| 7, false).into_iter().enumerate() {
        let message = result.err().unwrap_or_else(|| panic!("rank {rank} summed the gradients of a step that attended within its shard"));
        assert!(message.contains("made no exchange through the group") && message.contains("burn_ulysses_ops::attention"), "rank {rank}: {message}");
    }
}

/// Each rank's `labels_in_step` at SP = 2 × DP = 2 (rank threads) on the shard `shard_of` cuts
/// from its replica's sequence, with the whole job entered as its sequence group where
/// `world_as_sequence`: the count, or the panic's message.
fn labels_in_step_at_sp_2_by_dp_2(shard_of: fn(&Rank, &[Vec<i64>]) -> SequenceShard, world_as_sequence: bool) -> Vec<Result<usize, String>> {
    run_ranks(&Launch::Threads, 4, &DistributedConfig::new().with_sp_size(2), move |rank| {
        let batch = batch();
        let shard = shard_of(rank, &batch[rank.dp_rank..rank.dp_rank + 1]);
        let _world = world_as_sequence.then(|| burn_ulysses_ops::context::enter(rank.groups.world.clone()));
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| labels_in_step(&shard))).map_err(|panic| ulysses_core::comm::panic_message(&*panic))
    })
    .unwrap_or_else(|error| panic!("{error}"))
}

/// Every rank's message, each containing `expected(rank)`: no rank counted.
fn assert_refused_on_every_rank(case: &str, results: Vec<Result<usize, String>>, expected: impl Fn(usize) -> &'static str) {
    for (rank, result) in results.into_iter().enumerate() {
        let message = result.err().unwrap_or_else(|| panic!("{case}: rank {rank} counted its labels"));
        assert!(message.contains(expected(rank)), "{case}, rank {rank}: {message}");
    }
}

/// A shard its thread's groups would attend over within itself or out of order (this crate
/// cannot see positions) is refused by `labels_in_step` on every rank, before the forward:
/// a thread with no group, the job entered as the sequence group, a shard taken at another
/// rank's place, whole sequences in a group, a zigzag ring's shard, packed documents. The
/// rank's own shard, in its own groups, counts the job's labels.
#[test]
fn a_shard_outside_its_sequence_parallel_group_is_refused_before_the_step() {
    use burn_ulysses_ops::layout::RingSharding;
    let own = |rank: &Rank, replica: &[Vec<i64>]| SequenceSharder::new(rank.sp_size).shard(replica, rank.sp_rank);
    let counts: Vec<usize> = labels_in_step_at_sp_2_by_dp_2(own, false).into_iter().map(|count| count.unwrap_or_else(|message| panic!("{message}"))).collect();
    assert_eq!(counts, [SequenceSharder::labels_in(&batch()); 4], "the job's labels, on every rank");

    let on_a_thread_of_its_own = run_ranks(&Launch::Threads, 2, &DistributedConfig::new().with_sp_size(2), |rank| {
        let shard = SequenceSharder::new(2).shard(&batch(), rank.sp_rank);
        std::thread::spawn(move || labels_in_step(&shard)).join().map_err(|panic| ulysses_core::comm::panic_message(&*panic))
    });
    assert_refused_on_every_rank("a thread the rank spawned", on_a_thread_of_its_own.unwrap(), |_| "entered no sequence-parallel group");
    assert_refused_on_every_rank("the job entered as the sequence group", labels_in_step_at_sp_2_by_dp_2(own, true), |_| "group has 4 ranks");
    let at_its_dp_rank = |rank: &Rank, replica: &[Vec<i64>]| SequenceSharder::new(2).shard(replica, rank.dp_rank);
    // Ranks 1 and 2 hold the other's shard; 0 and 3 hear of rank 1.
    let of = |rank: usize| if rank == 1 || rank == 2 { "on rank" } else { "rank 1 of the job holds a shard" };
    assert_refused_on_every_rank("a shard at the rank's DP rank", labels_in_step_at_sp_2_by_dp_2(at_its_dp_rank, false), of);
    let whole = |_: &Rank, replica: &[Vec<i64>]| SequenceSharder::new(1).shard(replica, 0);
    assert_refused_on_every_rank("whole sequences", labels_in_step_at_sp_2_by_dp_2(whole, false), |_| "whole sequences in a sequence-parallel group of 2");
    let zigzag = |rank: &Rank, replica: &[Vec<i64>]| SequenceSharder::new(2).with_ring_size(2).with_ring_sharding(RingSharding::Zigzag).shard(replica, rank.sp_rank);
    assert_refused_on_every_rank("a zigzag ring's shard", labels_in_step_at_sp_2_by_dp_2(zigzag, false), |_| "a zigzag ring's shard");
    let packed = |rank: &Rank, replica: &[Vec<i64>]| {
        let documents = vec![vec![5, replica[0].len() - 5]];
        SequenceSharder::new(2).shard_documents(replica, Some(&documents), rank.sp_rank)
    };
    // The second document begins in each replica's first shard: those ranks (0 and 2) name it,
    // the others hear of rank 0.
    let packing = |rank: usize| if rank % 2 == 0 { "packing several documents" } else { "rank 0 of the job holds a shard" };
    assert_refused_on_every_rank("packed documents", labels_in_step_at_sp_2_by_dp_2(packed, false), packing);
    // The second document begins at the shard edge (at 9 of 17 padded to 18, 6 of 12): the
    // second shards' first tokens, which ranks 1 and 3 name; 0 and 2 hear of rank 1.
    let at_the_edge = |rank: &Rank, replica: &[Vec<i64>]| {
        let len = replica[0].len();
        let edge = len.div_ceil(2);
        SequenceSharder::new(2).shard_documents(replica, Some(&[vec![edge, len - edge]]), rank.sp_rank)
    };
    let packing = |rank: usize| if rank % 2 == 1 { "packing several documents" } else { "rank 1 of the job holds a shard" };
    assert_refused_on_every_rank("a document at the shard edge", labels_in_step_at_sp_2_by_dp_2(at_the_edge, false), packing);
    // One document a row, given as documents: no row packs two, so nothing is refused.
    let one_a_row = |rank: &Rank, replica: &[Vec<i64>]| SequenceSharder::new(2).shard_documents(replica, Some(&[vec![replica[0].len()]]), rank.sp_rank);
    let counts: Vec<usize> = labels_in_step_at_sp_2_by_dp_2(one_a_row, false).into_iter().map(|count| count.unwrap_or_else(|message| panic!("{message}"))).collect();
    assert_eq!(counts, [SequenceSharder::labels_in(&batch()); 4], "one document a row, given as documents");
}
