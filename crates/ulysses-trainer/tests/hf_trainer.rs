//! The trainer's run against transformers' own `Trainer` on the same rows: the Qwen3 fixture
//! of ulysses-models fine-tuned for four optimizer steps of two micro-batches, each row's first
//! tokens labelled -100 in numbers that differ from row to row (so the Trainer's average over
//! a step's targets, not over its micro-batches, matters), AdamW with weight decay 0.01, the
//! cosine schedule from 1e-3 without warm-up (with one, Hugging Face's first step takes a rate
//! of 0, the trainer's a step's worth: docs/training.md), gradients clipped to norm 1.
//! `scripts/hf-fixtures.py --trainer-only` wrote the Trainer's rows, rates, losses, gradient
//! norms and trained parameters (`qwen3/trainer.safetensors`); here `train_rank`, the
//! trainer's own loop, runs the same steps at SP = 2, f32 on the CPU.

use std::{collections::HashMap, path::Path};

use burn::{backend::{Autodiff, NdArray}, optim::AdamWConfig, tensor::DType};
use burn_ulysses::{ParallelGroups, ParallelLayout, RankScope, UlyssesBackend, UlyssesConfig, comm::ThreadGroup};
use ulysses_trainer::train::{LrSchedule, Progress, RunOptions, StepData, TrainConfig, train_rank};
use ulysses_training::StepReport;

type Sp = UlyssesBackend<Autodiff<NdArray<f32>>>;

/// Every tensor of a safetensors file (f32, f64 or i64) as f64, with its shape.
fn tensors(file: &Path) -> HashMap<String, (Vec<usize>, Vec<f64>)> {
    let bytes = std::fs::read(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = match view.dtype() {
                safetensors::Dtype::F32 => view.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64).collect(),
                safetensors::Dtype::F64 => view.data().chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().unwrap())).collect(),
                safetensors::Dtype::I64 => view.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as f64).collect(),
                other => panic!("{name}: {other:?}"),
            };
            (name, (view.shape().to_vec(), values))
        })
        .collect()
}

/// The Trainer's rows in its order: step `s` takes rows `4s..4s + 4`, its first micro-batch
/// the first two.
struct TrainerRows {
    rows: Vec<Vec<i64>>,
    targets: Vec<Vec<bool>>,
}

impl StepData for TrainerRows {
    fn train_batch(&self, step: usize) -> Vec<Vec<i64>> {
        self.rows[4 * step..4 * step + 4].to_vec()
    }
    fn eval_batch(&self) -> Option<Vec<Vec<i64>>> {
        None
    }
    fn train_targets(&self, step: usize, _batch: &[Vec<i64>]) -> Option<Vec<Vec<bool>>> {
        Some(self.targets[4 * step..4 * step + 4].to_vec())
    }
}

/// Each step's learning rate, as the run reports it.
#[derive(Default)]
struct Rates(Vec<f64>);

impl Progress for Rates {
    fn step(&mut self, _step: usize, _report: &StepReport, learning_rate: f64, _seconds: f64) {
        self.0.push(learning_rate);
    }
    fn eval(&mut self, _step: usize, _loss: f64) {}
}

#[test]
fn the_trainer_follows_transformers_trainer_step_by_step() {
    let folder = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ulysses-models/tests/fixtures/qwen3");
    let want = tensors(&folder.join("trainer.safetensors"));
    let ((shape, ids), labels) = (&want["input_ids"], &want["labels"].1);
    let width = shape[1];
    let rows: Vec<Vec<i64>> = ids.chunks(width).map(|row| row.iter().map(|&v| v as i64).collect()).collect();
    let targets: Vec<Vec<bool>> = labels.chunks(width).map(|row| row.iter().map(|&v| v != -100.0).collect()).collect();
    let counts: Vec<usize> = targets.iter().map(|row| row.iter().filter(|&&t| t).count()).collect();
    assert!(counts[0] + counts[1] != counts[2] + counts[3], "the micro-batches of step 0 count {counts:?} targets: alike, the average over them would pass too");
    let data = TrainerRows { rows, targets };
    let steps = want["learning_rates"].1.len();
    let saved = std::env::temp_dir().join(format!("ulysses-trainer-{}-hf-trainer", std::process::id()));

    let per_rank = ThreadGroup::new(2).run(|rank| {
        let layout = ParallelLayout::new().with_sp_size(2);
        let groups: ParallelGroups<NdArray<f32>> = ParallelGroups::new(rank.communicator(), layout).unwrap();
        let _sp = burn_ulysses::context::enter(RankScope::Thread, groups.rank_context(UlyssesConfig::new()));
        let device = Default::default();
        let pretrained = ulysses_models::from_pretrained::<Sp>(&folder, &device).unwrap();
        let config = TrainConfig::new(
            ulysses_models::DecoderConfig::from_hf(&pretrained.config),
            AdamWConfig::new().with_weight_decay(0.01).with_beta_1(0.9).with_beta_2(0.999).with_epsilon(1e-8),
            layout,
        )
        .with_steps(steps)
        .with_batch_size(4)
        .with_grad_accumulation(2)
        .with_seq_len(width)
        .with_learning_rate(1e-3)
        .with_warmup_steps(0)
        .with_lr_schedule(LrSchedule::Cosine)
        .with_min_lr_ratio(0.0)
        .with_max_grad_norm(Some(1.0))
        .with_eval_every(0);
        let mut rates = Rates::default();
        let options = RunOptions { progress: Some(&mut rates), ..Default::default() };
        let (trained, reports) = train_rank::<Sp>(&config, pretrained.model, &data, &groups, &device, options).unwrap();
        let model = trained.whole(&*groups.world).unwrap();
        if rank.rank() == 0 {
            ulysses_models::save_pretrained(&model, &pretrained.config, &saved, DType::F32).unwrap();
        }
        (reports, rates.0)
    });
    let (reports, rates) = per_rank.into_iter().next().unwrap().unwrap_or_else(|panic| panic!("{panic}"));
    assert_eq!(reports.len(), steps);

    let mut worst = [0.0f64; 4];
    for (step, report) in reports.iter().enumerate() {
        let (rate, loss, norm) = (want["learning_rates"].1[step], want["losses"].1[step], want["grad_norms"].1[step]);
        let differences = [(rates[step] - rate).abs() / rate, (report.loss - loss).abs(), (report.grad_norm - norm).abs() / norm];
        assert!(differences[0] <= 1e-12, "step {step}: learning rate {} against the Trainer's {rate}", rates[step]);
        assert!(differences[1] <= 1e-5, "step {step}: loss {} against the Trainer's {loss}", report.loss);
        assert!(differences[2] <= 1e-4, "step {step}: gradient norm {} against the Trainer's {norm}", report.grad_norm);
        for (w, d) in worst.iter_mut().zip(differences) {
            *w = w.max(d);
        }
    }
    // What the steps changed, against what the Trainer's changed: each tensor's update within
    // 1e-3 of its largest (Adam's updates are about the learning rate each, so a rate or a
    // decay off by one step shows at once), but for one element in a thousand at most, each
    // within the largest update: Adam turns a gradient that is all rounding (here one element of
    // a few MLP weights) into a step of up to the rate, of either sign.
    let initial = tensors(&folder.join("model.safetensors"));
    let trained = tensors(&saved.join("model.safetensors"));
    let mut outliers = 0;
    let compared = want.keys().filter(|key| key.starts_with("trained.")).count();
    assert!(compared > 0, "the fixture holds none of the Trainer's trained tensors");
    for (key, (_, theirs)) in want.iter().filter(|(key, _)| key.starts_with("trained.")) {
        let name = &key["trained.".len()..];
        let (start, ours) = (&initial[name].1, &trained.get(name).unwrap_or_else(|| panic!("{name} not saved")).1);
        assert_eq!((start.len(), ours.len()), (theirs.len(), theirs.len()), "{name}: elements at the start and ours, against the Trainer's");
        let largest = theirs.iter().zip(start).fold(0.0f64, |a, (t, s)| a.max((t - s).abs()));
        assert!(largest > 0.0, "{name}: the Trainer left it as it was");
        let mut differences: Vec<f64> = ours.iter().zip(theirs).map(|(o, t)| if (o - t).is_finite() { (o - t).abs() / largest } else { f64::INFINITY }).collect();
        differences.sort_by(f64::total_cmp);
        let off = differences.iter().filter(|&&d| d > 1e-3).count();
        let last = differences.last().copied().unwrap_or_default();
        assert!(off * 1000 <= differences.len() && last <= 1.0, "{name}: {off} of {} elements' updates are past 1e-3 of the largest from the Trainer's (up to {last:e})", differences.len());
        outliers += off;
        worst[3] = worst[3].max(differences[differences.len() - 1 - off]);
    }
    std::fs::remove_dir_all(&saved).unwrap();
    println!(
        "{steps} steps against transformers' Trainer: learning rate {:.1e} (relative), loss {:.1e}, gradient norm {:.1e} (relative), \
         updates {:.1e} (of each tensor's largest; {outliers} element(s) past 1e-3)",
        worst[0], worst[1], worst[2], worst[3]
    );
}
