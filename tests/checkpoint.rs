//! A checkpoint saved by an SP=4 run loads at SP=1 (and on a plain backend) and gives the
//! same held-out loss; evaluation that bypasses SP agrees with evaluation under SP.

use std::{path::PathBuf, time::Duration};

use burn::{
    backend::{Autodiff, NdArray},
    optim::AdamWConfig,
};
use burn_ulysses::{ParallelGroups, ParallelLayout, UlyssesBackend, comm::ThreadGroup};
use ulysses_training::LmOutput;
use ulysses_models::DecoderConfig;
use ulysses_trainer::train::{RunOptions, StepData, TrainConfig, TrainedModel, evaluate_model, load_model, model_recorder, save_model, train_rank};
use ulysses_training::{OptimizerPlace, ShardedParameters};
use ulysses_suite::{VariedLengths, with_deadline};

type Inner = NdArray<f32>;
type Reference = Autodiff<Inner>;
type Sp = UlyssesBackend<Autodiff<Inner>>;

const TOLERANCE: f64 = 1e-5;
const VOCAB: usize = 32;

fn config(sp_size: usize) -> TrainConfig {
    let model = DecoderConfig::new(VOCAB).with_d_model(32).with_n_heads(4).with_n_kv_heads(2).with_ffn_hidden(64).with_repeat_kv(false);
    TrainConfig::new(model, AdamWConfig::new(), ParallelLayout::new().with_sp_size(sp_size))
        .with_batch_size(4)
        .with_steps(3)
        .with_learning_rate(1e-2)
        .with_warmup_steps(1)
        .with_eval_every(0)
}

/// Held-out loss of `config`'s layout, with the model from `checkpoint` or, without one,
/// trained for a few steps and saved there. Returns (loss under SP, loss bypassing SP).
fn evaluate_at(config: TrainConfig, checkpoint: PathBuf, train_first: bool) -> (f64, f64) {
    let config = &config;
    let checkpoint = &checkpoint;
    let per_rank = ThreadGroup::new(config.layout.world_size()).run(|rank| {
        let groups: ParallelGroups<Inner> = ParallelGroups::new(rank.communicator(), config.layout).unwrap();
        let _sp = Sp::enter_thread(groups.sp.clone());
        let device = Default::default();
        let model = if train_first {
            let data = VariedLengths { vocab: VOCAB };
            let (trained, _) = train_rank::<Sp>(config, config.model.init(&device), &data, &groups, &device, RunOptions::default()).unwrap();
            let model = trained.whole(&*groups.world).unwrap();
            if rank.rank() == 0 {
                save_model(&model, checkpoint).unwrap();
            }
            model
        } else {
            load_model::<Sp>(&config.model, checkpoint, &device).unwrap()
        };
        let batch = VariedLengths { vocab: VOCAB }.eval_batch().unwrap();
        let with_sp = evaluate_model::<Sp>(config, &burn::module::AutodiffModule::valid(&model), &batch, None, None, &groups, &device).unwrap().map(|l| l.mean());
        let bypass_config = config.clone().with_eval_single_device(true);
        let bypass = evaluate_model::<Sp>(&bypass_config, &burn::module::AutodiffModule::valid(&model), &batch, None, None, &groups, &device).unwrap().map(|l| l.mean());
        (with_sp.unwrap(), bypass)
    });
    let results: Vec<(f64, Option<f64>)> = per_rank.into_iter().map(|r| r.unwrap_or_else(|p| panic!("{p}"))).collect();
    assert!(results.iter().all(|r| r.0 == results[0].0), "SP ranks disagree on the held-out loss");
    assert!(results[1..].iter().all(|r| r.1.is_none()), "only rank 0 evaluates when bypassing SP");
    (results[0].0, results[0].1.expect("rank 0 evaluates when bypassing SP"))
}

#[test]
fn a_checkpoint_saved_at_sp4_loads_at_sp1_with_the_same_loss() {
    let checkpoint = std::env::temp_dir().join(format!("burn-ulysses-checkpoint-{}", std::process::id()));
    let (sp4, sp4_bypass, sp1, plain) = with_deadline(Duration::from_secs(55), {
        let checkpoint = checkpoint.clone();
        move || {
            let (sp4, sp4_bypass) = evaluate_at(config(4), checkpoint.clone(), true);
            let (sp1, _) = evaluate_at(config(1), checkpoint.clone(), false);
            // No decorator at all: burn's attention, kv heads expanded by the model, and the
            // loss from whole logits (the SP runs compute it in chunks of hidden states).
            let model_config = config(1).model.with_repeat_kv(true);
            let plain_model = load_model::<Reference>(&model_config, &checkpoint, &Default::default()).unwrap();
            let batch = VariedLengths { vocab: VOCAB }.eval_batch().unwrap();
            let forward = |tokens, positions: &_| Ok(LmOutput::Logits(plain_model.forward(tokens, positions)));
            let plain = ulysses_training::evaluate_single_device::<Reference>(forward, &batch, None, None, -100, &Default::default()).unwrap().mean();
            (sp4, sp4_bypass, sp1, plain)
        }
    });
    let _ = std::fs::remove_file(checkpoint.with_extension("mpk"));
    println!("held-out loss: SP=4 {sp4:.7}, SP=4 bypassing SP {sp4_bypass:.7}, SP=1 from checkpoint {sp1:.7}, plain backend {plain:.7}");
    assert!((sp4 - sp1).abs() <= TOLERANCE, "SP=1 after loading: {sp1} vs SP=4: {sp4}");
    assert!((sp4 - sp4_bypass).abs() <= TOLERANCE, "bypassing SP: {sp4_bypass} vs SP=4: {sp4}");
    assert!((sp4 - plain).abs() <= TOLERANCE, "plain backend: {plain} vs SP=4: {sp4}");
}

/// Under ZeRO-3 (SP=2, the optimizer on the host) the trained model is written from its parts
/// a layer at a time (`TrainedModel::save`: the ranks gather the rest, then each layer as rank
/// 0's writer reaches it): the file is byte for byte the one burn's recorder writes of the model
/// gathered whole, as `save_model`'s is, and it loads.
#[test]
fn a_zero_3_model_is_saved_a_layer_at_a_time_as_the_whole_model_would_be() {
    let dir = std::env::temp_dir().join(format!("burn-ulysses-zero3-model-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (by_layers, whole, by_burn) = (dir.join("by-layers"), dir.join("whole"), dir.join("by-burn"));
    let run = {
        let (by_layers, whole, by_burn) = (by_layers.clone(), whole.clone(), by_burn.clone());
        move || {
            let config = config(2).with_zero_stage(3).with_offload_optimizer(true).with_layer_checkpointing(Some(ulysses_training::LayerCheckpointing::new()));
            let config = &config;
            ThreadGroup::new(2).run(|rank| {
                let groups: ParallelGroups<Inner> = ParallelGroups::new(rank.communicator(), config.layout).unwrap();
                let _sp = Sp::enter_thread(groups.sp.clone());
                let device = Default::default();
                let (mut trained, _) = train_rank::<Sp>(config, config.model.init(&device), &VariedLengths { vocab: VOCAB }, &groups, &device, RunOptions::default()).unwrap();
                trained.save(&by_layers, &*groups.world).unwrap();
                let model = trained.whole(&*groups.world).unwrap();
                if rank.rank() == 0 {
                    save_model(&model, &whole).unwrap();
                    burn::module::Module::save_file(model, &by_burn, &model_recorder()).unwrap();
                    load_model::<Sp>(&config.model, &by_layers, &device).unwrap();
                }
            })
        }
    };
    for (rank, result) in with_deadline(Duration::from_secs(120), run).into_iter().enumerate() {
        result.unwrap_or_else(|p| panic!("rank {rank}: {p}"));
    }
    let read = |path: &PathBuf| std::fs::read(path.with_extension("mpk")).unwrap();
    let (by_layers, whole, by_burn) = (read(&by_layers), read(&whole), read(&by_burn));
    let _ = std::fs::remove_dir_all(&dir);
    assert!(by_burn.len() > 10_000, "burn's file of the whole model holds {} bytes", by_burn.len());
    assert!(whole == by_burn, "save_model's file ({} bytes) differs from burn's recorder's ({} bytes)", whole.len(), by_burn.len());
    assert!(by_layers == by_burn, "the file saved a layer at a time ({} bytes) differs from burn's of the whole model ({} bytes)", by_layers.len(), by_burn.len());
}

/// Under ZeRO-3 a model rank 0 cannot write (its folder is a file) fails on rank 0 alone, with
/// the path; rank 0 still joins every gather, so the other rank's save ends as it should rather
/// than at a rank that left.
#[test]
fn a_zero_3_model_rank_0_cannot_write_fails_on_rank_0_alone() {
    let blocker = std::env::temp_dir().join(format!("burn-ulysses-zero3-unwritable-{}", std::process::id()));
    std::fs::write(&blocker, b"a file where the model's folder would be").unwrap();
    let path = blocker.join("model");
    let run = move || {
        ThreadGroup::new(2).run(|rank| {
            let device = Default::default();
            let model = DecoderConfig::new(VOCAB).with_d_model(32).with_n_layers(3).with_n_heads(4).with_n_kv_heads(2).with_ffn_hidden(64).init::<Sp>(&device);
            let (placeholders, parts) = ShardedParameters::shard(model, rank.rank(), 2, OptimizerPlace::Host).unwrap();
            TrainedModel::new(placeholders, Some(parts)).save(&path, &*rank.communicator()).map_err(|e| e.to_string())
        })
    };
    let results = with_deadline(Duration::from_secs(60), run);
    let _ = std::fs::remove_file(&blocker);
    let results: Vec<Result<(), String>> = results.into_iter().enumerate().map(|(rank, r)| r.unwrap_or_else(|p| panic!("rank {rank} panicked: {p}"))).collect();
    let error = results[0].as_ref().expect_err("rank 0 wrote into a folder that is a file");
    assert!(error.contains("burn-ulysses-zero3-unwritable"), "rank 0's error names no path: {error}");
    assert_eq!(results[1], Ok(()), "rank 1's save");
}

/// Under ZeRO-3 a rank whose peer leaves while the model is gathered for its save fails on a
/// peer's loss (the trainer then exits 76, for a launcher to name the peer), not on its own.
#[test]
fn a_zero_3_save_that_loses_a_peer_fails_as_a_peer_loss() {
    let path = std::env::temp_dir().join(format!("burn-ulysses-zero3-peer-left-{}", std::process::id())).join("model");
    let results = with_deadline(Duration::from_secs(60), move || {
        ThreadGroup::new(2).run(|rank| {
            let device = Default::default();
            let model = DecoderConfig::new(VOCAB).with_d_model(32).with_n_layers(2).with_n_heads(4).with_n_kv_heads(2).with_ffn_hidden(64).init::<Sp>(&device);
            let (placeholders, parts) = ShardedParameters::shard(model, rank.rank(), 2, OptimizerPlace::Host).unwrap();
            // Rank 1 leaves (its communicator dropped) instead of joining the gathers.
            (rank.rank() == 0).then(|| TrainedModel::new(placeholders, Some(parts)).save(&path, &*rank.communicator()).err().map(|e| (e.is_peer_loss(), e.to_string())))
        })
    });
    let rank_0 = results.into_iter().next().unwrap().unwrap_or_else(|p| panic!("rank 0 panicked: {p}"));
    let (peer_loss, message) = rank_0.flatten().expect("rank 0 saved a model it could not gather");
    assert!(peer_loss && message.contains("rank 1"), "rank 0's error is not a peer's loss naming rank 1: {message}");
    assert!(message.starts_with("cannot gather the model to save it: "), "rank 0's error does not say what it stopped: {message}");
}
