//! What a rank holds between steps under ZeRO-3, counted by the allocator per rank thread
//! (`ulysses_suite::rank_memory`): its part of the parameters' compute copy and of the
//! optimizer's state (master weights and both moments). At world 2 and 4 a rank holds
//! 1/world of what one rank training the same model alone holds, within 10%; replicated AdamW
//! holds the whole model and both moments on every rank whatever the world. With the compute
//! copy's parts on the host, a rank alone holds 12 bytes a parameter, and 4 before its first
//! step: those parts are the host optimizer's master weights. The figures for a
//! Hugging Face shape (benches/RESULTS.md; replicated training at world 1 alone):
//! `ZERO_MEMORY_SHAPE=benches/hf-shapes/llama-3.2-1b.json ZERO_MEMORY_LAYERS=2 cargo test -p
//! ulysses-suite --test zero_memory zero_3_ranks -- --nocapture` (`ZERO_MEMORY_WORLDS=2,4`:
//! those worlds alone; world 4 of that slice fits 24 GiB only with `MALLOC_MMAP_THRESHOLD_=131072`).
//!
//! The ZeRO-3 runs cut their parts from world rank 0's parameters one at a time
//! (`ShardedParameters::shard_from`, the model lazy): a second test counts what the whole
//! process holds while four ranks do that, and a third while rank 0 writes the ZeRO-3 model
//! (`TrainedModel::save`). They run one after the other, so nothing else allocates while one
//! counts.

use std::{
    sync::{Barrier, Mutex, atomic::{AtomicUsize, Ordering}},
    time::Duration,
};

use burn::{
    backend::{Autodiff, NdArray},
    module::Module,
    optim::AdamWConfig,
    tensor::{FloatDType, backend::Backend},
};
use burn_ulysses::{
    ParallelGroups, ParallelLayout, RankScope, UlyssesBackend, UlyssesConfig,
    comm::ThreadGroup,
    data::SequenceSharder,
};
use ulysses_models::{Decoder, DecoderConfig, HfConfig, from_pretrained_lazily, save_pretrained};
use ulysses_suite::{
    VariedLengths, deterministic_params, parameter_values,
    rank_memory::{RankCounting, count_as_rank, live_bytes, process_live_bytes, process_peak_bytes, reset_process_peak},
    with_deadline,
};
use ulysses_trainer::train::{StepData, TrainedModel};
use ulysses_training::{
    HostAdamWConfig, LayerCheckpointing, OptimizerPlace, PartsFrom, ShardedAdamW, ShardedParameters, StepInput, apply_step, apply_step_zero3, backward_step_checkpointed,
    backward_step_zero3, float_parameters, parameter_elements,
};

#[global_allocator]
static ALLOCATOR: RankCounting = RankCounting;

type Inner = NdArray<f32>;
type Sp = UlyssesBackend<Autodiff<Inner>>;

const VOCAB: usize = 2048;
const STEPS: usize = 2;

/// The test's model, or the `config.json` that `ZERO_MEMORY_SHAPE` names with
/// `ZERO_MEMORY_LAYERS` of its layers.
fn model_config() -> DecoderConfig {
    let Ok(shape) = std::env::var("ZERO_MEMORY_SHAPE") else {
        return DecoderConfig::new(VOCAB).with_d_model(256).with_n_layers(2).with_n_heads(4).with_n_kv_heads(2).with_ffn_hidden(512).with_tie_embeddings(false).with_repeat_kv(false);
    };
    let hf = ulysses_models::HfConfig::from_hf(std::path::Path::new(&shape)).unwrap_or_else(|e| panic!("ZERO_MEMORY_SHAPE: {e}"));
    let config = DecoderConfig::from_hf(&hf).with_repeat_kv(false);
    match std::env::var("ZERO_MEMORY_LAYERS") {
        Ok(layers) => config.with_n_layers(layers.parse().expect("ZERO_MEMORY_LAYERS: a number of layers")),
        Err(_) => config,
    }
}

/// A narrower model of eight layers, for what an update in the backward leaves behind it: its
/// thread may lag the backward by the last two groups (the channel to it holds one), whose
/// gradient parts and new parts are then still held as the backward returns. With ten groups
/// that is at most 48% of the gradient parts' bytes, where the two-layer model's last two groups
/// are half its parameters (a loaded CI machine measured 91% of them held there).
fn deep_model_config() -> DecoderConfig {
    DecoderConfig::new(VOCAB).with_d_model(128).with_n_layers(8).with_n_heads(4).with_n_kv_heads(2).with_ffn_hidden(256).with_tie_embeddings(false).with_repeat_kv(false)
}

/// What the ranks of one run of [`held_per_rank`] held.
struct Held {
    /// Each rank's bytes after [`STEPS`] steps, above what its thread held before it built its model.
    per_rank: Vec<usize>,
    /// The model's parameter count.
    parameters: usize,
    /// What rank 0 held before the first step.
    before_step: usize,
    /// The most the whole process (every rank) held at once during the run, above what it held
    /// before.
    process_peak: usize,
    /// What rank 0 held when its last step's backward returned (the gradient parts of a step
    /// updated at its end wait then), above what it held as the step began.
    after_backward: usize,
}

/// What each rank of a world of `world` (SP=2 × DP=world/2, or one rank) holds. `Parts::OnHost`:
/// ZeRO-3 with the compute copy's parts on the host, shared with the host optimizer's master
/// weights.
fn held_per_rank(world: usize, parts_at: Parts, config: DecoderConfig) -> Held {
    let zero3 = parts_at != Parts::Replicated;
    let in_backward = matches!(parts_at, Parts::OnHostUpdatedInBackward | Parts::OnDeviceUpdatedInBackward);
    let process_before = process_live_bytes();
    reset_process_peak();
    let layout = if world == 1 { ParallelLayout::new() } else { ParallelLayout::new().with_sp_size(2).with_dp_size(world / 2) };
    let slots = unused_slots(world);
    let per_rank = ThreadGroup::new(world).run(|rank| {
        let slot = slots + rank.rank();
        count_as_rank(slot);
        let groups: ParallelGroups<Inner> = ParallelGroups::new(rank.communicator(), layout).unwrap();
        let _sp = burn_ulysses::context::enter(RankScope::Thread, groups.rank_context(UlyssesConfig::new()));
        let device = Default::default();
        let before = live_bytes(slot);
        // ZeRO-3 cuts its parts from world rank 0's parameters one at a time: the model stays
        // lazy (built by rank 0 alone, a parameter at a time); replicated training holds it whole.
        let mut model: Decoder<Sp> = match zero3 {
            true => config.init(&device),
            false => deterministic_params(config.init(&device), 5),
        };
        let parameters: usize = parameter_elements(&model).iter().sum();
        let (dp_rank, _) = layout.coordinates(rank.rank());
        let sharder = SequenceSharder::new(layout.sp_size);
        let checkpointing = LayerCheckpointing::new();
        let mut replicated = ulysses_training::MatrixDecayAdamW::<Decoder<Sp>, Sp>::new(&AdamWConfig::new());
        let mut host = ShardedAdamW::new(HostAdamWConfig::default());
        let mut parts = None;
        if zero3 {
            // The update runs on a thread of its own beside the rank's: its allocations are the rank's.
            host.on_update_thread(move || count_as_rank(slot));
            let on_host = matches!(parts_at, Parts::OnHost | Parts::OnHostUpdatedInBackward);
            let (placeholders, mut sharded) = ShardedParameters::shard_from(model, PartsFrom::Rank0, &mut host, FloatDType::F32, on_host, &device, &*groups.world).unwrap();
            if on_host {
                sharded.share_master_weights(&mut host).unwrap();
            }
            (model, parts) = (placeholders, Some(sharded));
        }
        let before_step = live_bytes(slot) - before;
        let mut after_backward = 0;
        for index in 0..STEPS {
            let batch = VariedLengths { vocab: VOCAB.min(config.vocab_size) }.train_batch(index);
            let share = batch.len() / layout.dp_size;
            let mine = vec![batch[share * dp_rank..share * (dp_rank + 1)].to_vec()];
            let step = StepInput { index, learning_rate: 1e-3, micro_batches: &mine, documents: None, targets: None, max_grad_norm: None };
            let step_began = live_bytes(slot);
            model = match parts.as_mut() {
                Some(parts) => {
                    if in_backward {
                        parts.update_in_backward(&mut host, &step).unwrap();
                    }
                    let local = backward_step_zero3(&model, &step, &sharder, &groups, &device, &checkpointing, parts).unwrap();
                    after_backward = live_bytes(slot).saturating_sub(step_began);
                    apply_step_zero3(model, &mut host, parts, &step, local, &groups).unwrap().0
                }
                None => {
                    let local = backward_step_checkpointed(&model, &step, &sharder, &groups, &device, &checkpointing).unwrap();
                    apply_step(model, &mut replicated, &step, local, &groups).unwrap().0
                }
            };
        }
        // Between steps: once the last step's update has ended.
        host.settle().unwrap();
        if let Some(parts) = parts.as_mut() {
            parts.await_every_update().unwrap();
        }
        let held = live_bytes(slot) - before;
        drop((model, parts, replicated, host));
        (held, parameters, before_step, after_backward)
    });
    let per_rank: Vec<(usize, usize, usize, usize)> = per_rank.into_iter().map(|r| r.unwrap_or_else(|p| panic!("{p}"))).collect();
    let process_peak = process_peak_bytes().saturating_sub(process_before);
    Held { per_rank: per_rank.iter().map(|r| r.0).collect(), parameters: per_rank[0].1, before_step: per_rank[0].2, process_peak, after_backward: per_rank[0].3 }
}

/// Bytes as megabytes (10^6), as the tables print them.
fn mb(bytes: usize) -> f64 {
    bytes as f64 / 1e6
}

/// Where a run of [`held_per_rank`] keeps the compute copy.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Parts {
    /// Replicated training: the whole model on every rank.
    Replicated,
    /// ZeRO-3, the rank's parts on its device.
    OnDevice,
    /// ZeRO-3, the rank's parts in host memory (`--offload-parameters`).
    OnHost,
    /// The same, each group updated in the backward (`--optimizer-in-backward`).
    OnHostUpdatedInBackward,
    /// ZeRO-3, the rank's parts on its device, each group updated in the backward.
    OnDeviceUpdatedInBackward,
}

/// ZeRO-3 with the host optimizer updating each group as its gradient parts arrive
/// (`ShardedParameters::update_in_backward`): when a step's backward returns, a rank holds none
/// of the step's gradient parts (the last group's may still be in the update's hands), where
/// an update at the step's end finds them all waiting, 4 bytes an element of its parts. World
/// 2, the parts on the host as the master weights, then on the device (whose new parts, compute
/// copies made on the host, go in place during the backward rather than wait for its end); the
/// last step's (the moments exist by then).
#[test]
fn updated_in_the_backward_no_gradient_part_waits_for_the_steps_end() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    for (end, during) in [(Parts::OnHost, Parts::OnHostUpdatedInBackward), (Parts::OnDevice, Parts::OnDeviceUpdatedInBackward)] {
        let (at_the_end, in_backward) = with_deadline(Duration::from_secs(300), move || (held_per_rank(2, end, deep_model_config()), held_per_rank(2, during, deep_model_config())));
        let gradient_parts = 4 * at_the_end.parameters / 2;
        let parts = if end == Parts::OnHost { "parts on the host" } else { "parts on the device" };
        println!(
            "{parts}: after the backward a rank holds {:.3} MB more than as the step began updated at the end ({:.3} MB of gradient parts), {:.3} MB updated in the backward; \
             between steps {:.3} and {:.3} MB; the process's peak {:.3} and {:.3} MB",
            mb(at_the_end.after_backward),
            mb(gradient_parts),
            mb(in_backward.after_backward),
            mb(at_the_end.per_rank[0]),
            mb(in_backward.per_rank[0]),
            mb(at_the_end.process_peak),
            mb(in_backward.process_peak)
        );
        assert!(at_the_end.after_backward >= gradient_parts, "{parts}: updated at the step's end, the gradient parts wait: {} bytes held, {gradient_parts} expected", at_the_end.after_backward);
        assert!(
            in_backward.after_backward <= at_the_end.after_backward - gradient_parts / 2,
            "{parts}: updated in the backward a rank holds {} bytes after it, against {} at the step's end",
            in_backward.after_backward,
            at_the_end.after_backward
        );
        // What is left is the last two groups' (the first layer's and the embedding's gradient
        // or new parts; at most 48% of the gradient parts' bytes when the update lags the
        // backward the most): where the new parts of parts on the device waited for the step's
        // end, every group's did (3.41 MB here, the gradient parts' bytes again).
        assert!(
            in_backward.after_backward <= 3 * gradient_parts / 4,
            "{parts}: updated in the backward a rank holds {} bytes after it, {gradient_parts} of gradient parts at the step's end: new parts wait for it",
            in_backward.after_backward
        );
        // The same state between steps: a channel's and a thread's bytes apart, within 1% of it
        // (a loaded CI machine saw 67 kB of 10.5 MB, 2026-12-05); a group's parts (a layer's,
        // over 6% of them in this model) missing or doubled is far past that.
        assert_eq!(in_backward.per_rank.len(), at_the_end.per_rank.len());
        for (a, b) in in_backward.per_rank.iter().zip(&at_the_end.per_rank) {
            assert!(a.abs_diff(*b) <= (64 * 1024).max(b / 100), "{parts}: between steps a rank holds {a} bytes updated in the backward, {b} at the step's end");
        }
    }
}

#[test]
fn zero_3_ranks_hold_a_world_th_of_the_training_state() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    // A Hugging Face shape measures replicated training at world 1 alone: it holds the same on
    // every rank whatever the world (the small model checks that below), and four whole copies
    // of a large shape's state do not fit the 24 GiB machine.
    let large = std::env::var("ZERO_MEMORY_SHAPE").is_ok();
    // `ZERO_MEMORY_WORLDS=4`: some of the worlds alone (a large shape's take many minutes each).
    let worlds: Vec<usize> = std::env::var("ZERO_MEMORY_WORLDS").map_or(vec![1, 2, 4], |list| {
        list.split(',').map(|world| world.trim().parse().ok().filter(|w| [1, 2, 4].contains(w)).expect("ZERO_MEMORY_WORLDS: some of 1, 2 and 4, comma-separated")).collect()
    });
    let deadline = Duration::from_secs(if large { 3600 } else { 300 });
    // Each world's row is printed as it is measured: a large shape's run takes many minutes.
    println!("bytes a rank holds between steps (f32):");
    println!("{:>6} {:>22} {:>22} {:>26}", "world", "ZeRO-3 (MB per rank)", "replicated (MB)", "process peak (MB): ZeRO-3, replicated");
    let measured = worlds.clone();
    let results = with_deadline(deadline, move || {
        measured
            .into_iter()
            .map(|world| {
                let zero3 = held_per_rank(world, Parts::OnDevice, model_config());
                let replicated = (world == 1 || !large).then(|| held_per_rank(world, Parts::Replicated, model_config()));
                let show = |v: &Vec<usize>| v.iter().map(|&b| format!("{:.2}", mb(b))).collect::<Vec<_>>().join(" ");
                let peaks = format!("{:.2}, {}", mb(zero3.process_peak), replicated.as_ref().map_or("-".into(), |r| format!("{:.2}", mb(r.process_peak))));
                println!("{world:>6} {:>22} {:>22} {peaks:>26}", show(&zero3.per_rank), replicated.as_ref().map_or("not run".into(), |r| show(&r.per_rank)));
                (world, zero3, replicated)
            })
            .collect::<Vec<_>>()
    });
    if worlds.contains(&1) {
        // The parts on the host are the optimizer's master weights after the first update: the
        // host holds those and both moments, no copy beside them.
        let Held { per_rank: on_host, parameters: parameters_on_host, before_step, .. } = with_deadline(deadline, || held_per_rank(1, Parts::OnHost, model_config()));
        let expected_on_host = 12 * parameters_on_host;
        println!("ZeRO-3 alone with its parts on the host: {:.2} MB for {parameters_on_host} parameters, {:.2} MB before the first step", mb(on_host[0]), mb(before_step));
        // Before the first step, the master weights alone (no moments yet, no copy beside them).
        let master_weights = 4 * parameters_on_host;
        assert!(before_step >= master_weights && before_step <= master_weights + master_weights / 10, "before the first step one rank holds {before_step} bytes for {parameters_on_host} parameters (4 a parameter expected)");
        assert!(on_host[0] >= expected_on_host && on_host[0] <= expected_on_host + expected_on_host / 10, "with its parts on the host one rank holds {} bytes for {parameters_on_host} parameters (12 a parameter expected)", on_host[0]);
    }
    let parameters = results[0].1.parameters;
    println!("{parameters} parameters");
    // Alone, a rank holds the compute copy and the master weights (f32 each) and both moments:
    // in a world of `world` a world-th of that.
    let alone = 16 * parameters;
    for (world, zero3, replicated) in &results {
        // The process held every rank's state at once at the end of its last step.
        for run in std::iter::once(zero3).chain(replicated) {
            let ranks: usize = run.per_rank.iter().sum();
            assert!(run.process_peak >= ranks, "world {world}: the process peak of {} bytes is below the {ranks} its ranks held", run.process_peak);
        }
        for (rank, &held) in zero3.per_rank.iter().enumerate() {
            let ratio = held as f64 * *world as f64 / alone as f64;
            let range = if *world == 1 { 1.0..=1.1 } else { 0.9..=1.1 };
            assert!(range.contains(&ratio), "world {world}, rank {rank}: holds {held} bytes, {ratio:.3} x 1/{world} of 16 bytes a parameter ({alone})");
        }
        // Replicated AdamW: the whole model and both moments on every rank (the measurement
        // sees what is not sharded).
        for (rank, &held) in replicated.iter().flat_map(|r| &r.per_rank).enumerate() {
            assert!(held >= 12 * parameters, "world {world}, rank {rank}: replicated AdamW holds only {held} bytes");
        }
    }
}

/// The tests one after the other: each counts every thread of the process.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The first of `count` of the counting allocator's rank slots that no earlier run of this
/// binary counted on: what an earlier run's ranks left allocated when they ended (1.1 to 1.7 MB
/// a rank after the 64-layer run, seen), freed later by whichever thread, is charged back to
/// none of this run's ranks.
fn unused_slots(count: usize) -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    NEXT.fetch_add(count, Ordering::Relaxed)
}

/// ZeRO-3 cut from world rank 0's parameters one at a time
/// (`ShardedParameters::shard_from`), from a model that burn left lazy, built from its config
/// or read from a checkpoint folder (`from_pretrained_lazily`): at world 4 the process never
/// holds more than an eighth of the model in f32 beside what the ranks keep (cutting whole
/// models, every rank held one: four more; reading the folder whole, rank 0 held one more),
/// and the parameters are the ones `fork` builds from the same seed, or the folder's (world
/// rank 0 builds or reads them in its order; the others build none).
#[test]
fn zero_3_cut_from_rank_0_builds_no_whole_model() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let hf = HfConfig::from_hf_json(
        r#"{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512, "tie_word_embeddings": true}"#,
        "config.json",
    )
    .unwrap();
    let config = DecoderConfig::from_hf(&hf).with_repeat_kv(false);
    let device = Default::default();
    <Sp as Backend>::seed(&device, 11);
    let built = config.init::<Sp>(&device).fork(&device);
    let expected = parameter_values(&built);
    let folder = std::env::temp_dir().join(format!("ulysses-zero-memory-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&folder);
    save_pretrained(&built, &hf, &folder, burn::tensor::DType::F32).unwrap();
    drop(built);
    let from_config = move || {
        <Sp as Backend>::seed(&Default::default(), 11);
        config.init(&Default::default())
    };
    let from_folder = {
        let folder = folder.clone();
        move || from_pretrained_lazily::<Sp>(&folder, &Default::default()).unwrap().model.with_repeat_kv(false)
    };
    let sources: [(&str, Box<dyn FnOnce() -> Decoder<Sp> + Send>); 2] = [("built from its config", Box::new(from_config)), ("read from a checkpoint folder", Box::new(from_folder))];
    for (source, lazy) in sources {
        let expected = expected.clone();
        let (model_bytes, kept, peak, differing) = with_deadline(Duration::from_secs(300), move || cut_at_world_4(lazy, &expected));
        println!(
            "ZeRO-3 cut from world rank 0's parameters ({source}) at world 4: the ranks keep {:.2} MB of a {:.2} MB model (f32); the process held at most {:.2} MB",
            mb(kept),
            mb(model_bytes),
            mb(peak)
        );
        assert!(differing.is_empty(), "{source}: the ranks' parameters are not the ones expected: {differing:?}");
        assert!(kept >= 2 * model_bytes, "{source}: the ranks keep {kept} bytes of a {model_bytes}-byte model: each a quarter of the compute copy and of the master weights expected");
        assert!(peak <= kept + model_bytes / 8, "{source}: the process held up to {peak} bytes while the ranks cut their parts (they keep {kept}) of a {model_bytes}-byte model");
    }
    std::fs::remove_dir_all(folder).unwrap();
}

/// Four ranks cut their ZeRO-3 parts from world rank 0's copy of the model `lazy` makes: the
/// model's f32 bytes, what the ranks keep, the process's peak above what it held before the
/// model was made, and the parameters (gathered back) that differ from `expected`.
fn cut_at_world_4(lazy: impl FnOnce() -> Decoder<Sp>, expected: &[(String, Vec<f32>)]) -> (usize, usize, usize, Vec<String>) {
    const WORLD: usize = 4;
    let device = Default::default();
    let model_bytes: usize = 4 * expected.iter().map(|(_, values)| values.len()).sum::<usize>();
    let (kept, peak, ready) = (AtomicUsize::new(0), AtomicUsize::new(0), Barrier::new(WORLD));
    let (kept, peak, ready) = (&kept, &peak, &ready);
    let before = process_live_bytes();
    reset_process_peak();
    let lazy = &lazy();
    let slots = unused_slots(WORLD);
    let ranks = ThreadGroup::new(WORLD).run(|rank| {
        let slot = slots + rank.rank();
        count_as_rank(slot);
        let start = live_bytes(slot);
        let mut host = ShardedAdamW::new(HostAdamWConfig::default());
        let world = rank.communicator();
        let (placeholders, mut parts) = ShardedParameters::shard_from(lazy.clone(), PartsFrom::Rank0, &mut host, FloatDType::F32, false, &device, &*world).unwrap();
        kept.fetch_add(live_bytes(slot) - start, Ordering::Relaxed);
        if ready.wait().is_leader() {
            peak.store(process_peak_bytes().saturating_sub(before), Ordering::Relaxed);
        }
        ready.wait();
        let gathered = parameter_values(&parts.gather_all(placeholders, &*world).unwrap());
        gathered.iter().zip(expected).find(|((_, got), (_, want))| got.iter().zip(want).any(|(a, b)| a.to_bits() != b.to_bits())).map(|((name, _), _)| name.clone())
    });
    let differing = ranks.into_iter().filter_map(|r| r.unwrap_or_else(|p| panic!("{p}"))).collect();
    (model_bytes, kept.load(Ordering::Relaxed), peak.load(Ordering::Relaxed), differing)
}

/// Under ZeRO-3 rank 0 writes the model while the ranks gather it a layer at a time
/// (`TrainedModel::save`): the most the process holds during the save, above what it held
/// before, is what a layer and the rest take (gathered on each rank, and as rank 0's record),
/// with the writer's buffer: under a quarter of the model's f32 record for 64 layers. Building the whole
/// record before writing it held all of it.
#[test]
fn zero_3_writes_the_model_holding_a_layer_at_a_time() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let config = DecoderConfig::new(256).with_d_model(128).with_n_layers(64).with_n_heads(4).with_n_kv_heads(2).with_ffn_hidden(512).with_repeat_kv(false);
    let path = std::env::temp_dir().join(format!("burn-ulysses-zero3-save-memory-{}", std::process::id()));
    let run = {
        let path = path.clone();
        move || {
            let (config, path) = (&config, &path);
            let (before, parameters) = (AtomicUsize::new(0), AtomicUsize::new(0));
            let ready = Barrier::new(2);
            let (before, ready) = (&before, &ready);
            let parameters = &parameters;
            ThreadGroup::new(2).run(|rank| {
                let device = Default::default();
                let model: Decoder<Sp> = deterministic_params(config.init(&device), 7);
                parameters.store(float_parameters(&model).iter().map(|p| p.shape.num_elements()).sum(), Ordering::Relaxed);
                let (placeholders, parts) = ShardedParameters::shard(model, rank.rank(), 2, OptimizerPlace::Host).unwrap();
                let mut trained = TrainedModel::new(placeholders, Some(parts));
                if ready.wait().is_leader() {
                    before.store(process_live_bytes(), Ordering::Relaxed);
                    reset_process_peak();
                }
                ready.wait();
                trained.save(path, &*rank.communicator()).unwrap();
            });
            (process_peak_bytes().saturating_sub(before.load(Ordering::Relaxed)), parameters.load(Ordering::Relaxed))
        }
    };
    let (held, parameters) = with_deadline(Duration::from_secs(300), run);
    let written = std::fs::metadata(path.with_extension("mpk")).map(|m| m.len());
    let _ = std::fs::remove_file(path.with_extension("mpk"));
    let record = 4 * parameters;
    println!("the process held at most {held} bytes more while it wrote a model of {parameters} parameters ({record} bytes in f32; the file: {written:?})");
    assert!(written.as_ref().is_ok_and(|&bytes| bytes as usize > record), "the model's file: {written:?} for a record of {record} bytes");
    assert!(held < record / 4, "the process held up to {held} bytes more while rank 0 wrote the model, of a record of {record} bytes");
}
