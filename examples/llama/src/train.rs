//! The training loop of one rank: Llama on byte tokens, with SP × DP through burn-ulysses.

use std::{path::Path, time::Instant};

use burn::{
    config::Config,
    module::{AutodiffModule, Module},
    optim::AdamWConfig,
    record::{FullPrecisionSettings, NamedMpkFileRecorder},
    tensor::{Int, Tensor, backend::AutodiffBackend},
};
use burn_ulysses::{
    UlyssesError,
    comm::Communicator,
    data::SequenceSharder,
    train::{
        CausalLm, GroupSplit, LmOutput, ParallelGroups, ParallelLayout, StepReport, broadcast_parameters,
        check_parameters_identical, evaluate, evaluate_single_device, train_step,
    },
};

use crate::{
    Llama, LlamaConfig,
    corpus::{BYTE_VOCAB, ByteCorpus},
};

#[derive(Config, Debug)]
pub struct TrainConfig {
    pub model: LlamaConfig,
    pub optimizer: AdamWConfig,
    pub layout: ParallelLayout,
    /// Micro-batches per optimizer step on each DP rank.
    #[config(default = 1)]
    pub grad_accumulation: usize,
    /// Sequences per optimizer step, over all DP ranks and micro-batches.
    #[config(default = 8)]
    pub batch_size: usize,
    /// Tokens per sequence.
    #[config(default = 256)]
    pub seq_len: usize,
    #[config(default = 300)]
    pub steps: usize,
    #[config(default = 3e-3)]
    pub learning_rate: f64,
    /// Linear warm-up, then cosine decay to a tenth of `learning_rate`.
    #[config(default = 20)]
    pub warmup_steps: usize,
    /// Evaluate the held-out batch every this many steps (0: never).
    #[config(default = 50)]
    pub eval_every: usize,
    /// Evaluate on world rank 0 alone, bypassing sequence parallelism.
    #[config(default = false)]
    pub eval_single_device: bool,
    /// Check that every rank holds identical parameters every this many steps (0: never).
    #[config(default = 0)]
    pub check_parameters_every: usize,
    #[config(default = 42)]
    pub seed: u64,
}

impl TrainConfig {
    /// A small Llama on byte tokens.
    pub fn small(layout: ParallelLayout) -> Self {
        Self::new(LlamaConfig::new(BYTE_VOCAB).with_repeat_kv(false), AdamWConfig::new().with_weight_decay(0.01), layout)
    }

    /// Fails with the name of the first setting that cannot work.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("sp_size (--sp)", self.layout.sp_size),
            ("dp_size (--dp)", self.layout.dp_size),
            ("grad_accumulation (--grad-accumulation)", self.grad_accumulation),
            ("batch_size (--batch-size)", self.batch_size),
            ("steps (--steps)", self.steps),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, value)| *value == 0) {
            return Err(format!("{name} must be at least 1"));
        }
        if self.seq_len < 2 {
            return Err(format!("seq_len (--seq-len) must be at least 2 tokens to have a label, got {}", self.seq_len));
        }
        let parts = self.layout.dp_size * self.grad_accumulation;
        if self.batch_size % parts != 0 {
            return Err(format!(
                "batch_size (--batch-size) {} must be a multiple of dp_size × grad_accumulation = {parts}",
                self.batch_size
            ));
        }
        Ok(())
    }

    pub fn learning_rate_at(&self, step: usize) -> f64 {
        if step < self.warmup_steps {
            return self.learning_rate * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let progress = (step - self.warmup_steps) as f64 / (self.steps - self.warmup_steps).max(1) as f64;
        let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos());
        self.learning_rate * (0.1 + 0.9 * cosine)
    }

    /// This DP rank's micro-batches of the step's global batch (`validate` first).
    pub fn micro_batches(&self, global: &[Vec<i64>], dp_rank: usize) -> Vec<Vec<Vec<i64>>> {
        let per_rank = global.len() / self.layout.dp_size;
        let mine = &global[dp_rank * per_rank..(dp_rank + 1) * per_rank];
        mine.chunks(per_rank / self.grad_accumulation).map(<[_]>::to_vec).collect()
    }
}

impl<B: AutodiffBackend> CausalLm<B> for Llama<B> {
    fn logits(&self, tokens: Tensor<B, 2, Int>, position_offset: usize) -> Tensor<B, 3> {
        self.forward(tokens, position_offset)
    }

    /// The loss runs over the hidden states in chunks of rows, never holding all logits.
    fn lm_output(&self, tokens: Tensor<B, 2, Int>, position_offset: usize) -> LmOutput<B> {
        Llama::lm_output(self, tokens, position_offset)
    }

    fn vocab_size(&self) -> usize {
        Llama::vocab_size(self)
    }

    fn is_causal(&self) -> bool {
        Llama::is_causal(self)
    }
}

/// The sequences each optimizer step trains on (the same on every rank: each rank takes its
/// DP slice and SP shard of them), and an optional held-out batch.
pub trait StepData: Sync {
    fn train_batch(&self, step: usize) -> Vec<Vec<i64>>;
    fn eval_batch(&self) -> Option<Vec<Vec<i64>>>;
}

/// [`StepData`] drawn from a byte corpus with a config's batch shape and seed.
pub struct CorpusData<'a> {
    pub corpus: &'a ByteCorpus,
    pub config: &'a TrainConfig,
}

impl StepData for CorpusData<'_> {
    fn train_batch(&self, step: usize) -> Vec<Vec<i64>> {
        self.corpus.train_batch(self.config.seed, step, self.config.batch_size, self.config.seq_len)
    }

    fn eval_batch(&self) -> Option<Vec<Vec<i64>>> {
        Some(self.corpus.eval_batch(self.config.batch_size, self.config.seq_len))
    }
}

/// What rank 0 is told as training goes.
pub trait Progress {
    fn step(&mut self, step: usize, report: &StepReport, learning_rate: f64, seconds: f64);
    fn eval(&mut self, step: usize, loss: f64);
}

/// Trains `model` on this rank; returns it with every step's report (the same on every
/// rank). Rank 0's parameters are broadcast first, so ranks may start from any values.
/// `groups` must already be entered as the rank context when `B` is a `UlyssesBackend`.
pub fn train_rank<B, C>(
    config: &TrainConfig,
    model: Llama<B>,
    data: &dyn StepData,
    groups: &ParallelGroups<C>,
    device: &B::Device,
    mut progress: Option<&mut dyn Progress>,
) -> Result<(Llama<B>, Vec<StepReport>), UlyssesError>
where
    B: AutodiffBackend,
    C: GroupSplit + Communicator<B::InnerBackend>,
{
    config.validate().map_err(UlyssesError::InvalidConfig)?;
    let sharder = SequenceSharder::new(config.layout.sp_size);
    let mut model = broadcast_parameters(model, &*groups.world)?;
    let mut optimizer = config.optimizer.init::<B, Llama<B>>();
    let eval_batch = data.eval_batch();
    let mut reports = Vec::with_capacity(config.steps);

    for step in 0..config.steps {
        let started = Instant::now();
        let global = data.train_batch(step);
        if global.len() != config.batch_size {
            let message = format!("step {step} has {} sequences, the config says {}", global.len(), config.batch_size);
            return Err(UlyssesError::InvalidConfig(message));
        }
        let micro_batches = config.micro_batches(&global, groups.dp_rank());
        let learning_rate = config.learning_rate_at(step);
        let (next, report) = train_step(model, &mut optimizer, learning_rate, &micro_batches, &sharder, groups, device)?;
        model = next;
        reports.push(report);
        if let Some(progress) = progress.as_deref_mut() {
            progress.step(step, &report, learning_rate, started.elapsed().as_secs_f64());
        }
        if config.check_parameters_every > 0 && (step + 1) % config.check_parameters_every == 0 {
            check_parameters_identical(&model, &*groups.world)?;
        }
        let eval_due = config.eval_every > 0 && ((step + 1) % config.eval_every == 0 || step + 1 == config.steps);
        if let (true, Some(batch)) = (eval_due, &eval_batch) {
            let loss = evaluate_model::<B, C>(config, &model.valid(), batch, groups, device)?;
            if let (Some(progress), Some(loss)) = (progress.as_deref_mut(), loss) {
                progress.eval(step, loss);
            }
        }
    }
    Ok((model, reports))
}

/// The held-out loss: over the SP group, or on world rank 0 alone when
/// `eval_single_device` is set (`None` on the other ranks).
pub fn evaluate_model<B, C>(
    config: &TrainConfig,
    model: &Llama<B::InnerBackend>,
    batch: &[Vec<i64>],
    groups: &ParallelGroups<C>,
    device: &B::Device,
) -> Result<Option<f64>, UlyssesError>
where
    B: AutodiffBackend,
    C: GroupSplit + Communicator<B::InnerBackend>,
{
    let forward = |tokens, offset| model.lm_output(tokens, offset);
    let sharder = SequenceSharder::new(config.layout.sp_size);
    if config.eval_single_device {
        let is_first = groups.world.group_rank() == 0;
        return Ok(is_first.then(|| evaluate_single_device(forward, batch, sharder.ignore_index, device)));
    }
    evaluate(forward, batch, &sharder, groups.sp_rank(), &*groups.sp, device).map(Some)
}

pub fn checkpoint_recorder() -> NamedMpkFileRecorder<FullPrecisionSettings> {
    NamedMpkFileRecorder::new()
}

/// Saves the model's parameters; they do not depend on the SP or DP size, so a checkpoint
/// loads under any layout.
pub fn save_checkpoint<B: AutodiffBackend>(model: &Llama<B>, path: &Path) -> Result<(), String> {
    model.clone().save_file(path, &checkpoint_recorder()).map_err(|e| format!("cannot save checkpoint {}: {e}", path.display()))
}

pub fn load_checkpoint<B: AutodiffBackend>(config: &LlamaConfig, path: &Path, device: &B::Device) -> Result<Llama<B>, String> {
    config
        .init::<B>(device)
        .load_file(path, &checkpoint_recorder(), device)
        .map_err(|e| format!("cannot load checkpoint {}: {e}", path.display()))
}
