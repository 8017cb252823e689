//! The training loop of one rank: Llama on byte tokens, with SP × DP through burn-ulysses,
//! crash-safe checkpoints and resumption.

use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::Instant;

use burn::{
    config::Config,
    module::{AutodiffModule, Module},
    optim::{AdamWConfig, Optimizer},
    record::{BurnRecord, FileRecorder, FullPrecisionSettings, NamedMpkFileRecorder, Record},
    tensor::{DType, FloatDType, Int, Tensor, backend::AutodiffBackend},
};
use burn_ulysses::{
    ParallelGroups, PlainBackend, ParallelLayout, UlyssesError,
    comm::{Communicator, all_gather_host_checked},
    data::{SequenceSharder, ShardPositions},
    device_io::DeviceIo,
    layout::HeadPlan,
    precision::Precision,
};
use ulysses_training::{
    DeviceShardedAdamW, LayerCheckpointing, LayerParameters, LayeredLm, LocalStep, MatrixDecayAdamW, ParameterGroup, PartsFrom, ShardedAdamW, ShardedParameters, StepInput, StepReport, TokenLoss, TrainBackend, apply_step, apply_step_sharded,
    apply_step_zero3, backward_step, backward_step_checkpointed, backward_step_zero3, broadcast_parameters, check_parameters_identical, evaluate, evaluate_single_device, float_parameters, join_layered_output_gathers, layered_output,
    host_adamw_config, load_sharded_optimizer, load_sharded_training_checkpoint, with_parameters_in, save_sharded_training_checkpoint,
    checkpoint::{load_training_checkpoint, read_checkpoint_state, TrainingCheckpoint, write_atomically_with},
};
use serde::{Deserialize, Serialize};

use ulysses_models::{HfCheckpointSnapshot, HfCheckpointWriter, HfConfig, Decoder, DecoderConfig, SaveOptions, plan_shard_paths, save_pretrained_including};

use crate::{
    corpus::{BYTE_VOCAB, ByteCorpus},
    data_identity::DataIdentity,
};

#[derive(Config, Debug)]
pub struct TrainConfig {
    pub model: DecoderConfig,
    pub optimizer: AdamWConfig,
    pub layout: ParallelLayout,
    /// Micro-batches per optimizer step on each DP rank.
    #[config(default = 1)]
    pub grad_accumulation: usize,
    /// Sequences per optimizer step, over all DP ranks and micro-batches.
    #[config(default = 8)]
    pub batch_size: usize,
    /// Tokens per sequence: every batch is padded to this length.
    #[config(default = 256)]
    pub seq_len: usize,
    #[config(default = 300)]
    pub steps: usize,
    #[config(default = 3e-3)]
    pub learning_rate: f64,
    /// Steps of linear warm-up to `learning_rate`, then `lr_schedule`'s decay.
    #[config(default = 20)]
    pub warmup_steps: usize,
    /// How the learning rate falls after the warm-up.
    #[config(default = "LrSchedule::Cosine")]
    pub lr_schedule: LrSchedule,
    /// The fraction of `learning_rate` the decay falls towards, reached where the steps end (the
    /// last step's rate is one step's fall above it).
    #[config(default = 0.1)]
    pub min_lr_ratio: f64,
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
    /// Train on packed documents: each sequence's paragraphs (runs of text ending in a blank
    /// line) are separate documents, attention and labels stay inside each and positions
    /// restart at each (with --corpus the held-out loss stays on unpacked windows, comparable
    /// across runs; --data's held-out documents are packed as its training ones).
    #[config(default = false)]
    pub pack: bool,
    /// Whole-layer activation checkpointing (`None`: off).
    #[config(default = "None")]
    pub layer_checkpointing: Option<LayerCheckpointing>,
    /// What the layers compute in; the parameters and optimizer state are f32 either way, but
    /// with [`offload_optimizer`](Self::offload_optimizer) the f32 master weights are on the
    /// host and the device holds the parameters (and gets their gradients) in this dtype.
    #[config(default = "Precision::F32")]
    pub precision: Precision,
    /// The loss's logits in f32 under a half precision (the old behaviour, slower): otherwise
    /// the head's matmuls run in the compute dtype, the softmax and loss in f32.
    #[config(default = false)]
    pub f32_head: bool,
    /// Clip each step's gradient, summed over all ranks, to this global L2 norm (`None`: no
    /// clipping).
    #[config(default = "None")]
    pub max_grad_norm: Option<f64>,
    /// Keep the token embeddings (and an output head tied to them) as they are.
    #[config(default = false)]
    pub freeze_embeddings: bool,
    /// The optimizer on the host, its state sharded over the world (ZeRO's optimizer half):
    /// AdamW's f32 master weights and moments in host memory, each world rank holding 1/world
    /// of them and updating them on the CPU; gradients reduce-scattered, the updated parameters
    /// all-gathered ([`ShardedAdamW`]). The devices keep the parameters and gradients alone, in
    /// the compute dtype (bf16: 4 bytes a parameter for both, against 16 with AdamW on the device).
    #[config(default = false)]
    pub offload_optimizer: bool,
    /// ZeRO's stage: 0, every rank holds the whole model (with
    /// [`offload_optimizer`](Self::offload_optimizer), the optimizer's state in parts); 3, each
    /// world rank holds 1/world of the parameters' compute copy and of the gradients too, each
    /// layer all-gathered just before it runs and its gradients reduce-scattered as soon as its
    /// backward is done ([`ShardedParameters`]). Stage 3 runs on layer checkpointing (a layer
    /// is gathered for its forward, then again for its recomputation); its optimizer keeps its
    /// parts of the state on the device ([`DeviceShardedAdamW`]), or on the host with
    /// [`offload_optimizer`](Self::offload_optimizer).
    #[config(default = 0)]
    pub zero_stage: usize,
    /// Under ZeRO-3 with the optimizer on the host, keep each rank's parts of the parameters
    /// in host memory too, uploaded for each gather: a device then holds no parameter between
    /// a layer's pieces, for a world too small to hold even its parts of the compute copy.
    #[config(default = false)]
    pub offload_parameters: bool,
    /// Under ZeRO-3 with the optimizer on the host, update each layer's parts in the backward
    /// as soon as its gradient parts reach the host ([`ShardedParameters::update_in_backward`]),
    /// so the host never holds the step's gradient parts together: 12 bytes a parameter of a
    /// rank's part, not 16. The same update; it cannot clip (`max_grad_norm` None) nor
    /// accumulate micro-batches, and a step whose gradient is not finite loses the optimizer's
    /// state (the run stops, as it does on one anyway: resume from the last checkpoint).
    #[config(default = false)]
    pub optimizer_in_backward: bool,
}

/// The most sequences a batch takes (`--batch-size`, a training step's or `--eval-only`'s): the
/// corpus draws a step's window i by hashing `step << 20 ^ i`, so more would repeat the next
/// step's windows.
pub const MAX_BATCH_SIZE: usize = 1 << 20;

/// The most ranks a parallel degree (`--sp`, `--dp`, `--ring`) takes: far past any machine, and
/// small enough that no product of the degrees and a length overflows.
pub const MAX_DEGREE: usize = 1 << 24;

impl TrainConfig {
    /// Whether the held-out batch is evaluated after step `step` (0-based): every
    /// `eval_every` steps, and after the last.
    pub fn eval_due(&self, step: usize) -> bool {
        self.eval_every > 0 && ((step + 1) % self.eval_every == 0 || step + 1 == self.steps)
    }

    /// Sequences in each micro-batch a DP replica runs: `--batch-size` over the replicas and
    /// the micro-batches (at least one).
    pub fn micro_batch_rows(&self) -> usize {
        (self.batch_size / self.layout.dp_size / self.grad_accumulation).max(1)
    }

    /// Whether each rank holds a part of the optimizer's state (its checkpoints hold one file
    /// of it per rank): on the host, or on the device under ZeRO-3.
    pub fn shards_optimizer(&self) -> bool {
        self.offload_optimizer || self.zero_stage == 3
    }

    /// A small Llama on byte tokens, trained by AdamW with PyTorch's defaults (burn's epsilon,
    /// 1e-5, is as large as a fine-tune's gradients and would slow its updates).
    pub fn small(layout: ParallelLayout) -> Self {
        Self::new(DecoderConfig::new(BYTE_VOCAB).with_repeat_kv(false), AdamWConfig::new().with_weight_decay(0.01).with_epsilon(1e-8), layout)
    }

    /// Fails, before any work, with the name of the first setting that cannot work and
    /// what to change.
    pub fn validate(&self) -> Result<(), String> {
        let model = &self.model;
        // Each count with the most any model or run takes: 0 is refused, and so is a size far
        // past any model (a typo, a -1 read as usize::MAX), where arithmetic on it would
        // overflow or an allocation abort.
        use ulysses_models::config::bounds;
        let counts = 1usize << 24;
        let bounded = [
            ("sp_size (--sp)", self.layout.sp_size, MAX_DEGREE),
            ("dp_size (--dp)", self.layout.dp_size, MAX_DEGREE),
            ("grad_accumulation (--grad-accumulation)", self.grad_accumulation, counts),
            ("batch_size (--batch-size)", self.batch_size, MAX_BATCH_SIZE),
            ("steps (--steps)", self.steps, 1 << 40),
            ("d_model (--d-model)", model.d_model, bounds::WIDTH),
            ("n_layers (--layers)", model.n_layers, bounds::LAYERS_OR_HEADS),
            ("n_heads (--heads)", model.n_heads, bounds::LAYERS_OR_HEADS),
            ("n_kv_heads (--kv-heads)", model.n_kv_heads, bounds::LAYERS_OR_HEADS),
            ("ffn_hidden (--ffn-hidden)", model.ffn_hidden, bounds::WIDTH),
            ("vocab_size", model.vocab_size, bounds::VOCABULARY),
        ];
        if let Some((name, _, _)) = bounded.iter().find(|(_, value, _)| *value == 0) {
            return Err(format!("{name} must be at least 1, got 0"));
        }
        let past = |name: &str, value: usize, most: usize| format!("{name} {value} is past any model or run this trainer takes (at most {most})");
        if let Some(&(name, value, most)) = bounded.iter().find(|(_, value, most)| value > most) {
            return Err(past(name, value, most));
        }
        // A checkpoint's own head_dim (config.json), beside the heads' count bounded above (one
        // from --d-model / --heads is bounded by them, and checked to divide below).
        if let Some(head_dim) = model.head_dim.filter(|head_dim| !(1..=bounds::HEAD_DIM).contains(head_dim)) {
            return Err(format!("head_dim {head_dim} (config.json) must be from 1 to {}", bounds::HEAD_DIM));
        }
        if !(self.learning_rate.is_finite() && self.learning_rate > 0.0) {
            return Err(format!(
                "learning_rate (--learning-rate) must be a finite number above 0 (3e-3 is the default, 2e-5 with --model), got {}",
                self.learning_rate
            ));
        }
        let adamw = ulysses_training::adamw_settings(&self.optimizer).map_err(|e| e.to_string())?;
        if let Some(invalid) = adamw.invalid_setting(self.learning_rate) {
            let flag = match invalid.setting {
                "learning_rate" => "--learning-rate",
                "beta_1" => "--adam-beta1",
                "beta_2" => "--adam-beta2",
                "epsilon" => "--adam-epsilon",
                _ => "--weight-decay",
            };
            let bound = if flag == "--weight-decay" { format!(" (1 / learning rate = {})", 1.0 / self.learning_rate) } else { String::new() };
            return Err(format!("the optimizer's {} ({flag}) {}{bound}, got {}", invalid.setting, invalid.rule, invalid.value));
        }
        if self.warmup_steps > self.steps {
            return Err(format!(
                "warmup_steps (--warmup-steps) {} is past --steps {}: the learning rate would never reach its peak",
                self.warmup_steps, self.steps
            ));
        }
        if !(0.0..=1.0).contains(&self.min_lr_ratio) {
            return Err(format!("min_lr_ratio (--min-lr-ratio) is a fraction of the learning rate, from 0 to 1; got {}", self.min_lr_ratio));
        }
        if self.seq_len < 2 {
            return Err(format!("seq_len (--seq-len) must be at least 2 tokens to have a label, got {}", self.seq_len));
        }
        if self.seq_len > 1 << 31 {
            return Err(past("seq_len (--seq-len)", self.seq_len, 1 << 31));
        }
        // Each bound above is far past any run, but their products are not: the memory plan
        // multiplies an activation's elements by a few hundred at most in u64 (wrapped, it
        // would plan a tiny step that "fits"). Bounded over the whole batch, which bounds each
        // rank's part of it; 2^48 elements is 512 TiB in bf16.
        let widest = [model.d_model, model.n_heads * model.head_dim(), model.ffn_hidden].into_iter().max().unwrap_or(0);
        let activation = self.batch_size as u128 * self.seq_len as u128 * widest as u128;
        if activation > 1 << 48 {
            return Err(format!(
                "batch_size × seq_len × the widest layer ({} × {} × {widest}) is {activation} elements, one activation of the batch, \
                 past any machine (at most 2^48): lower --batch-size or --seq-len",
                self.batch_size, self.seq_len
            ));
        }
        // burn's norm clipping measures each parameter's norm on each rank alone, with a
        // device sum that is not bit-reproducible: ranks would clip apart and part ways.
        let optimizer: serde_json::Value = serde_json::from_str(&self.optimizer.to_string()).map_err(|e| format!("the optimizer's config: {e}"))?;
        if optimizer["grad_clipping"].get("Norm").is_some() {
            return Err("the optimizer's grad_clipping is Norm: burn clips each rank's gradients by the norm that rank measures, \
                        and ranks part ways; leave it None and set max_grad_norm (--max-grad-norm), which clips the summed \
                        gradient with one norm for every rank"
                .into());
        }
        if self.offload_optimizer {
            host_adamw_config(&self.optimizer).map_err(|e| format!("--offload-optimizer: {e}"))?;
        }
        match self.zero_stage {
            0 => {}
            3 if self.layer_checkpointing.is_none() => {
                return Err("--zero 3 gathers each layer's parameters for its forward and again for its backward, which runs a layer \
                            at a time under layer checkpointing: add --checkpoint-layers"
                    .into());
            }
            3 => {
                // Its optimizer updates parts, on the host or the device: the host AdamW's rules.
                host_adamw_config(&self.optimizer).map_err(|e| format!("--zero 3: {e}"))?;
            }
            stage => {
                return Err(format!(
                    "zero_stage (--zero) {stage}: use 0 (each rank holds the whole model; --offload-optimizer shards the optimizer's \
                     state, ZeRO's stages 1 and 2) or 3 (parameters and gradients sharded too)"
                ));
            }
        }
        if self.optimizer_in_backward {
            if !(self.zero_stage == 3 && self.offload_optimizer) {
                return Err("--optimizer-in-backward updates ZeRO-3's parts on the host as the backward makes their gradients: add --zero 3 and --offload-optimizer".into());
            }
            if let Some(norm) = self.max_grad_norm {
                return Err(format!(
                    "--optimizer-in-backward updates each layer before the whole gradient's norm is known, so it cannot clip to --max-grad-norm {norm}: \
                     give --max-grad-norm 0, or leave out --optimizer-in-backward"
                ));
            }
            if self.grad_accumulation != 1 {
                return Err(format!(
                    "--optimizer-in-backward updates each layer from one micro-batch's gradient, and --grad-accumulation {} sums several: \
                     give --grad-accumulation 1 (a larger --dp or --batch-size a step), or leave out --optimizer-in-backward",
                    self.grad_accumulation
                ));
            }
        }
        if self.offload_parameters && !(self.zero_stage == 3 && self.offload_optimizer) {
            return Err("--offload-parameters keeps ZeRO-3's parts of the parameters on the host beside the optimizer's: add --zero 3 \
                        and --offload-optimizer"
                .into());
        }
        let parts = self.layout.dp_size * self.grad_accumulation;
        if self.batch_size % parts != 0 {
            let (below, above) = ((self.batch_size / parts) * parts, (self.batch_size / parts + 1) * parts);
            let choices = if below == 0 { above.to_string() } else { format!("{below} or {above}") };
            return Err(format!(
                "batch_size (--batch-size) {} must be a multiple of dp_size × grad_accumulation = {parts}: use {choices}",
                self.batch_size
            ));
        }
        if self.seq_len < self.layout.sp_size {
            return Err(format!(
                "seq_len (--seq-len) {} is shorter than the sequence-parallel degree {}: each rank needs at least one token",
                self.seq_len, self.layout.sp_size
            ));
        }
        // A checkpoint's explicit head_dim needs no quotient (transformers: Qwen3, Mistral Nemo).
        if model.head_dim.is_none() && model.d_model % model.n_heads != 0 {
            return Err(format!("d_model (--d-model) {} must be a multiple of the head count (--heads) {}", model.d_model, model.n_heads));
        }
        // RoPE turns pairs of a head's channels.
        if model.head_dim() % 2 != 0 {
            let source = match model.head_dim {
                Some(_) => "the model's head_dim".to_string(),
                None => format!("--d-model {} / --heads {}", model.d_model, model.n_heads),
            };
            return Err(format!(
                "the head dimension {} ({source}) is odd, and RoPE rotates pairs of channels: choose --d-model \
                 and --heads whose quotient is even",
                model.head_dim(),
            ));
        }
        // The rest of what no decoder follows (θ, ε, the padding row, the window), named before
        // `init` would panic with it.
        model.validate().map_err(|e| format!("the model: {e}"))?;
        self.layout.check_heads(model.n_heads, model.n_kv_heads).map_err(|e| format!("{e} (--sp, --heads, --kv-heads)"))?;
        let heads = HeadPlan::new(model.n_heads, model.n_kv_heads, self.layout.ulysses_size()).map_err(|e| e.to_string())?;
        if !heads.even {
            let note = format!(
                "{} heads over a Ulysses degree of {}: ranks attend over {} or {} heads (an uneven all-to-all); the busiest sets the pace, as with {} heads per rank",
                model.n_heads,
                self.layout.ulysses_size(),
                heads.local_q_heads(),
                heads.local_q_heads() - 1,
                heads.local_q_heads()
            );
            if first_time(&note) {
                tracing::info!("{note}");
            }
        }
        let multiple = self.layout.sharder().length_multiple();
        if self.seq_len % multiple != 0 {
            let zigzag = if multiple == self.layout.sp_size { String::new() } else { " (twice sp: --zigzag cuts each share in two)".to_string() };
            let note = format!(
                "seq_len {} is not a multiple of {multiple}{zigzag}: every batch is padded by {} token(s); a multiple of {multiple} wastes nothing",
                self.seq_len,
                multiple - self.seq_len % multiple,
            );
            if first_time(&note) {
                tracing::warn!("{note}");
            }
        }
        // The ring's attention takes no mask: neither packed documents nor a sliding window.
        let masked = match (self.pack, model.sliding_window) {
            (true, _) => Some("packed documents (--pack, and every --data run)".to_string()),
            (false, Some(window)) => Some(format!("the model's sliding window ({window} tokens)")),
            (false, None) => None,
        };
        if let (Some(what), true) = (masked, self.layout.ring_size > 1) {
            return Err(format!(
                "{what}: Ulysses × Ring cannot take it yet (--ring {}), its attention takes no mask. Use --ring 1, \
                 with --sp at most the head count {}",
                self.layout.ring_size, model.n_heads
            ));
        }
        if let Some(checkpointing) = &self.layer_checkpointing {
            match checkpointing.offload_layers {
                Some(0) => return Err("--offload-layers 0 offloads nothing: leave out --offload-to-host to keep every layer's input on the device".into()),
                Some(n) if n > model.n_layers => {
                    return Err(format!(
                        "--offload-layers {n}, but the model has {} layers: give at most {}, or leave the flag out to offload every layer's input and the head's",
                        model.n_layers, model.n_layers
                    ));
                }
                _ => {}
            }
            checkpointing.check_for(model.n_layers).map_err(|e| format!("{e} (--tile-tokens, --offload-layers)"))?;
        }
        Ok(())
    }

    pub fn learning_rate_at(&self, step: usize) -> f64 {
        if step < self.warmup_steps {
            return self.learning_rate * (step + 1) as f64 / self.warmup_steps as f64;
        }
        // From 0 after the warm-up towards 1 where the steps end, as Hugging Face's schedules.
        let progress = ((step - self.warmup_steps) as f64 / (self.steps.saturating_sub(self.warmup_steps)).max(1) as f64).min(1.0);
        let left = match self.lr_schedule {
            LrSchedule::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
            LrSchedule::Linear => 1.0 - progress,
            LrSchedule::Constant => 1.0,
        };
        self.learning_rate * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * left)
    }

    /// This DP rank's micro-batches of the step's global batch (`validate` first).
    pub fn micro_batches<T: Clone>(&self, global: &[T], dp_rank: usize) -> Vec<Vec<T>> {
        let per_rank = global.len() / self.layout.dp_size;
        let mine = &global[dp_rank * per_rank..(dp_rank + 1) * per_rank];
        mine.chunks(per_rank / self.grad_accumulation).map(<[_]>::to_vec).collect()
    }

    /// The sharder of this layout: batches padded to `seq_len`, so every step has the same
    /// shapes.
    pub fn sharder(&self) -> SequenceSharder {
        self.layout.sharder().with_pad_to(Some(self.seq_len))
    }
}

/// The sequences each optimizer step trains on (the same on every rank: each rank takes its
/// DP slice and SP shard of them), and an optional held-out batch.
///
/// The batch of a step must depend only on the step (and fixed settings such as the seed):
/// that is what lets a resumed run draw exactly the batches the uninterrupted one did.
pub trait StepData: Sync {
    fn train_batch(&self, step: usize) -> Vec<Vec<i64>>;
    fn eval_batch(&self) -> Option<Vec<Vec<i64>>>;

    /// With [`TrainConfig::pack`]: the lengths of the documents packed into each sequence of
    /// `batch`, the step's (`train_batch(step)`). By default the paragraphs of byte text
    /// ([`paragraph_lengths`]).
    fn train_documents(&self, _step: usize, batch: &[Vec<i64>]) -> Vec<Vec<usize>> {
        batch.iter().map(|sequence| paragraph_lengths(sequence)).collect()
    }

    /// For supervised fine-tuning, which tokens of step `step`'s sequences (`batch`) are
    /// targets, per sequence and token ([`StepInput::targets`]); `None` (the default): all.
    fn train_targets(&self, _step: usize, _batch: &[Vec<i64>]) -> Option<Vec<Vec<bool>>> {
        None
    }
    /// Which tokens of the held-out sequences are targets, as [`train_targets`](Self::train_targets).
    fn eval_targets(&self) -> Option<Vec<Vec<bool>>> {
        None
    }
    /// With [`TrainConfig::pack`]: the documents of each held-out sequence, or `None` to
    /// evaluate whole windows (the default: a byte corpus's held-out loss stays comparable
    /// between packed and unpacked runs).
    fn eval_documents(&self) -> Option<Vec<Vec<usize>>> {
        None
    }
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
        self.corpus.eval_batch(self.config.batch_size, self.config.seq_len)
    }
}

/// What rank 0 is told as training goes.
pub trait Progress {
    fn step(&mut self, step: usize, report: &StepReport, learning_rate: f64, seconds: f64);
    fn eval(&mut self, step: usize, loss: f64);
    /// Whether the record holds a held-out loss of step `step` (a resumed run's kept rows).
    fn has_eval(&self, _step: usize) -> bool {
        false
    }
    /// A checkpoint after step `step` is about to be taken: what was recorded of the steps it
    /// covers is to be made durable first.
    fn checkpoint_due(&mut self, _step: usize) {}
    fn checkpoint(&mut self, _step: usize, _path: &Path) {}
    /// What rank 0's thread waited on the device for during the step (reads back to the host
    /// and syncs, each a stall of a GPU's queue; uploads): after [`step`](Self::step).
    fn device_io(&mut self, _step: usize, _io: &DeviceIo) {}
    /// With [`RunOptions::time_phases`]: the seconds of the step up to the end of its backward,
    /// and from there to its end (the update and its collectives; `update_in_backward`: the
    /// host optimizer updated in the backward, and the rest is the step's checks), the device
    /// synchronised between; before [`device_io`](Self::device_io), whose counts leave that
    /// sync out.
    fn phases(&mut self, _step: usize, _backward: f64, _update: f64, _update_in_backward: bool) {}
}

/// The settings a run's config has gained since checkpoints were first written, each at the
/// default that is what the runs before it did; and `f32_head`, which they did under half
/// precision (the head was f32 before it could compute in the compute dtype).
const SETTINGS_ADDED: [&str; 6] = ["lr_schedule", "min_lr_ratio", "offload_optimizer", "zero_stage", "offload_parameters", "optimizer_in_backward"];

/// A [`RunState`] as any version of the trainer wrote it: the config's [`SETTINGS_ADDED`]
/// since take what the runs before them did (burn's `Config` refuses a missing field); any
/// other missing is refused.
#[derive(Deserialize)]
struct StoredRunState {
    completed_steps: usize,
    data_position: usize,
    seed: u64,
    config: serde_json::Value,
    #[serde(default)]
    data: Option<DataIdentity>,
    #[serde(default)]
    next_batch_digest: Option<u64>,
}

impl TryFrom<StoredRunState> for RunState {
    type Error = String;

    fn try_from(stored: StoredRunState) -> Result<Self, String> {
        let mut config = stored.config;
        // The schedule's settings came with weight decay on matrices alone: a config without
        // them is of a run that decayed every parameter.
        let decayed_every_parameter = config.get("lr_schedule").is_none();
        let defaults = serde_json::to_value(TrainConfig::small(ParallelLayout::new())).map_err(|e| e.to_string())?;
        if let Some(config) = config.as_object_mut() {
            for name in SETTINGS_ADDED {
                config.entry(name).or_insert_with(|| defaults[name].clone());
            }
            let half_precision = config.get("precision").is_some_and(|precision| *precision != serde_json::to_value(Precision::F32).unwrap_or_default());
            config.entry("f32_head").or_insert(half_precision.into());
        }
        let config = serde_json::from_value(config).map_err(|e| e.to_string())?;
        Ok(Self {
            completed_steps: stored.completed_steps,
            data_position: stored.data_position,
            seed: stored.seed,
            config,
            data: stored.data,
            next_batch_digest: stored.next_batch_digest,
            decayed_every_parameter,
        })
    }
}

impl RunState {
    /// What a resume of this state should be told of how its run trained and this one will,
    /// where they differ without a setting to say so.
    pub fn resume_notes(&self) -> Option<String> {
        let decay = ulysses_training::adamw_settings(&self.config.optimizer).ok()?.weight_decay;
        (self.decayed_every_parameter && decay > 0.0).then(|| {
            format!(
                "the checkpoint's run decayed every parameter (its trainer decayed norms' gains and biases too); from here its weight decay ({decay}) \
                 applies to weight matrices alone, not to norms' gains or biases, as Hugging Face's Trainer and Megatron-LM decay"
            )
        })
    }
}

/// How the learning rate falls from its peak after the warm-up to `min_lr_ratio` of it at the
/// last step (`--lr-schedule`).
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum LrSchedule {
    /// Along half a cosine (the trainer's default).
    Cosine,
    /// In a straight line (Hugging Face's Trainer's default, with a ratio of 0).
    Linear,
    /// Not at all.
    Constant,
}

impl std::str::FromStr for LrSchedule {
    type Err = String;

    fn from_str(value: &str) -> Result<Self, String> {
        match value {
            "cosine" => Ok(LrSchedule::Cosine),
            "linear" => Ok(LrSchedule::Linear),
            "constant" => Ok(LrSchedule::Constant),
            other => Err(format!("{other}: the schedules are cosine, linear and constant")),
        }
    }
}

/// Where training stands, saved in every checkpoint beside the model and the optimizer (a
/// sharded checkpoint's model is its optimizer parts' master weights).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(try_from = "StoredRunState")]
pub struct RunState {
    /// Optimizer steps taken.
    pub completed_steps: usize,
    /// The index of the next training batch. Batches are a pure function of (seed, index)
    /// (see [`StepData`]), so with the seed this is the whole state of the data order; the
    /// model draws no random numbers after initialisation (no dropout).
    pub data_position: usize,
    pub seed: u64,
    /// The run's config, to refuse a resumption that would train something else.
    pub config: TrainConfig,
    /// The data it trained on, to refuse a resumption on other data (absent in checkpoints
    /// written before it was recorded).
    #[serde(default)]
    pub data: Option<DataIdentity>,
    /// The digest of the training batch the next step draws ([`ulysses_training::batch_digest`]):
    /// a resume that would draw another (a file changed where `data`'s sampled bytes do not
    /// reach, a tokenizer that reads it otherwise) is refused. Absent after the last step, and
    /// in checkpoints written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_batch_digest: Option<u64>,
    /// Whether the run that wrote it decayed every parameter, norms' gains and biases too (a
    /// trainer before weight decay skipped them): read from its config, never written.
    #[serde(skip)]
    pub decayed_every_parameter: bool,
}

/// Test hooks: faults injected on purpose, to check that the run stops cleanly.
#[derive(Debug, Clone, Copy, Default)]
pub struct Faults {
    /// `(step, world rank)`: that rank's gradients become NaN after the step's backward (not
    /// under ZeRO-3, whose gradients leave during the backward: refused there).
    pub nan_gradient: Option<(usize, usize)>,
    /// `(step, world rank)`: that rank's process is killed (SIGKILL) after the step's
    /// backward, while its peers wait for its gradients (under ZeRO-3, in the update's first
    /// collective: the gradient's norm).
    pub kill: Option<(usize, usize)>,
    /// World rank 0's write of each replicated checkpoint (and of `--save-hf` where the model is
    /// whole) first waits this long (a slow disk).
    pub slow_checkpoint_write: std::time::Duration,
    /// World rank 0's write of each replicated checkpoint fails (a full disk).
    pub failed_checkpoint_write: bool,
    /// `(step, world rank)`: that rank fails with an error of its own as the step begins,
    /// while its peers wait for it in the step's first collective.
    pub fail: Option<(usize, usize)>,
}

/// How a rank's run is driven, beyond the config.
#[derive(Default)]
pub struct RunOptions<'a> {
    /// Rank 0's progress report.
    pub progress: Option<&'a mut dyn Progress>,
    /// Where world rank 0 writes the training checkpoint (`None`: nowhere). With the optimizer
    /// on the host every rank writes its part of the state there too: give every rank the
    /// same folder (shared by every node).
    pub checkpoint_dir: Option<PathBuf>,
    /// Write a checkpoint every this many steps (0: only at the end).
    pub checkpoint_every: usize,
    /// Keep this many checkpoints in `checkpoint_dir` (the ones before the newest as
    /// [`keep_earlier_checkpoint`](crate::run_folder::keep_earlier_checkpoint) names them); 0
    /// or 1: the newest alone.
    pub keep_checkpoints: usize,
    /// Continue from this checkpoint (folder or file).
    pub resume: Option<PathBuf>,
    /// The step the caller read `resume`'s checkpoint at, where what it shows counts from it
    /// (the trainer's record and progress): a checkpoint that has moved on since (its run was
    /// still writing) is refused on every rank, not resumed with those steps missing.
    pub resumed_at: Option<usize>,
    /// Stop, after checkpointing, once this many steps have been taken in total: a run
    /// interrupted on purpose (a job time limit), continued later with `resume`.
    pub stop_after: Option<usize>,
    /// The training data's identity, recorded in each checkpoint; a resume on data of another
    /// identity, or that draws another batch next, is refused unless `allow_new_data`.
    pub data_identity: Option<DataIdentity>,
    /// Resume on other data than the checkpoint's run trained on (`--allow-new-data`).
    pub allow_new_data: bool,
    /// Where world rank 0 writes the model in Hugging Face's format (in `save_hf_dtype`), with
    /// its configuration, at each checkpoint and at the end (`None`: nowhere).
    pub save_hf: Option<(PathBuf, HfConfig)>,
    /// The dtype `save_hf` writes the weights in (`--save-hf-dtype`); `None`: the checkpoint's
    /// own ([`HfConfig::saved_dtype`]), bf16 where the run holds a half-precision compute copy
    /// of an f32 checkpoint (its saves would hold no more than bf16's bits, twice as large).
    pub save_hf_dtype: Option<DType>,
    /// Files of the checkpoint the model started from that each `save_hf` folder gets a copy
    /// of (its tokenizer and generation settings: `ulysses_models::COMPANION_FILES`).
    pub save_hf_companions: Vec<(PathBuf, String)>,
    pub faults: Faults,
    /// Threads of this rank's optimizer on the host (`None`: every core): the host's cores
    /// divided among the ranks it runs ([`host_threads_per_rank`]).
    pub host_optimizer_threads: Option<NonZeroUsize>,
    /// What a step should hold on the device at most (`ulysses_trainer::memory`), shown beside
    /// what the device's pools held, at the end.
    pub estimated_peak: Option<u64>,
    /// This rank's host's ranks (0: unknown, taken as one): whether a resume's loads fit the
    /// host at once ([`HostTurn`]).
    pub ranks_on_this_host: usize,
    /// Synchronise the device after each step's backward too, to time the backward and the
    /// update apart ([`Progress::phases`]; the trainer's `--profile`): a wait a step more.
    pub time_phases: bool,
}

/// Each of `ranks` ranks on a host with `cores` cores takes an equal share for its host
/// optimizer, at least one: the update runs beside the rank's device work (ZeRO-3), whose
/// launches need a core too, and `ranks` updates at once would otherwise each take every core.
/// A rank the launcher gave cores of its own (`LaunchEnv::cpus_of_its_own`, srun's
/// `--cpus-per-task`) takes those where what it sees agrees: bound to them (`cores` is that
/// share already, and dividing it again would leave most idle), or seeing enough for every
/// rank's. Otherwise (the variable left by the batch script, not the step's) the share.
pub fn host_threads_per_rank(cores: usize, ranks: usize, cpus_of_its_own: Option<usize>) -> NonZeroUsize {
    let ranks = ranks.max(1);
    let share = match cpus_of_its_own {
        Some(own) if cores == own || cores >= own.saturating_mul(ranks) => own,
        _ => cores / ranks,
    };
    NonZeroUsize::new(share).unwrap_or(NonZeroUsize::MIN)
}

/// `--precision bf16` on a device without bf16 computes in f16 (`Precision::compute_dtype`),
/// whose gradients need loss scaling, which this trainer does not do: each token's loss
/// gradient, 1/tokens of the step, falls below f16's smallest normal number (6.1e-5) past 16 384
/// tokens, what flows back from it is smaller still and rounds to zero below 6e-8, and a large
/// product overflows (the step is then refused as not finite). The command refuses to train so
/// (before any model is built), as Hugging Face's Trainer refuses `bf16=True` there;
/// evaluating in f16 (no gradients) and the library's `train_rank` (its f16 tests on lavapipe)
/// stay allowed.
pub fn refuse_f16_training(compute_dtype: FloatDType, device: &impl std::fmt::Debug) -> Result<(), UlyssesError> {
    if compute_dtype != FloatDType::F16 {
        return Ok(());
    }
    Err(UlyssesError::InvalidConfig(format!(
        "bf16 compute (--precision bf16, the default on CUDA): the device {device:?} has no bf16, only f16, and training in f16 needs \
         loss scaling (its small gradients round to zero, large ones overflow), which this trainer does not do: train in f32 \
         (--precision f32), or on a GPU with bf16 (NVIDIA Ampere, sm_80, or newer)"
    )))
}

/// Refuses, on every rank, a world whose processes were started with different settings,
/// naming the first that differs from world rank 0's: every field of `config` and the options
/// that decide which collectives a run takes (checkpoints, a stop, a resume, a save). Each
/// process reads its own flags; ranks that differ in one that changes their collectives (the
/// evaluation's schedule, the steps, the checkpoints) waited in different collectives until
/// the collective timeout, ten minutes, which then blamed a stuck rank. Compared by FNV-1a
/// hashes of each field's JSON (alike on every build and machine).
fn check_settings_agree<W: burn::tensor::backend::Backend>(config: &TrainConfig, options: &RunOptions, world: &dyn Communicator<W>) -> Result<(), UlyssesError> {
    let mut fields: Vec<(String, String)> = match serde_json::to_value(config) {
        Ok(serde_json::Value::Object(map)) => map.into_iter().map(|(name, value)| (name, value.to_string())).collect(),
        _ => Vec::new(),
    };
    fields.extend([
        ("checkpoint_every (--checkpoint-every)".to_string(), options.checkpoint_every.to_string()),
        ("stop_after (--stop-after)".to_string(), format!("{:?}", options.stop_after)),
        ("checkpoints written or not (--no-save)".to_string(), options.checkpoint_dir.is_some().to_string()),
        ("a resume or none (--resume)".to_string(), options.resume.is_some().to_string()),
        ("a Hugging Face save or none (--save-hf)".to_string(), options.save_hf.is_some().to_string()),
        // Under ZeRO-3 it decides the save's shards, which every rank gathers.
        ("the Hugging Face save's dtype (--save-hf-dtype)".to_string(), format!("{:?}", options.save_hf_dtype)),
    ]);
    fields.sort();
    let hashes: Vec<u64> = fields.iter().map(|(name, value)| ulysses_training::checkpoint::fnv1a(&[name.as_bytes(), &[0], value.as_bytes()])).collect();
    let gathered = all_gather_host_checked(world, &hashes, "the run's settings")?;
    for (rank, row) in gathered.iter().enumerate() {
        if let Some(field) = (0..hashes.len()).find(|&i| row[i] != gathered[0][i]) {
            return Err(UlyssesError::InvalidConfig(format!(
                "world rank {rank} was started with another {} than world rank 0 (the processes' flags differ): start every rank with the \
                 same flags",
                fields[field].0
            )));
        }
    }
    Ok(())
}

/// Trains `model` on this rank; returns it ([`TrainedModel`]: under ZeRO-3 in this rank's
/// parts) with the reports of the steps it took (the same on every rank). Rank 0's parameters are broadcast first, so ranks may start from any values
/// (under ZeRO-3 one at a time as each rank takes its part, so `model` may be lazy as
/// `Config::init` leaves it: the other ranks never build it); with `resume`, every rank loads
/// the checkpoint instead. `groups.sp` must already be the
/// rank context when `B` is a `UlyssesBackend` (`burn_ulysses::job::run_ranks` does that).
/// Where it fails while world rank 0's checkpoint is being written, the write goes on: call
/// [`finish_writes_left_running`] once the ranks have left their groups, before reading the
/// folder or ending the process.
pub fn train_rank<B>(
    config: &TrainConfig,
    model: Decoder<B>,
    data: &dyn StepData,
    groups: &ParallelGroups<B::Wire>,
    device: &B::Device,
    mut options: RunOptions,
) -> Result<(TrainedModel<B>, Vec<StepReport>), UlyssesError>
where
    B: TrainBackend,
{
    // A stop request, acted on or asked for after the last step's health check (in the last
    // checkpoint's write, the export), is no next run's: cleared however this one ends, or a
    // library's second run in this process would stop after its first step.
    struct ForgetLateStop;
    impl Drop for ForgetLateStop {
        fn drop(&mut self) {
            ulysses_training::clear_stop_request();
        }
    }
    let _forget_late_stop = ForgetLateStop;
    // Before validation: where the flags differ, every rank names the setting (a rank whose
    // flags alone fail validation would leave the others waiting in this gather).
    check_settings_agree(config, &options, &*groups.world)?;
    config.validate().map_err(UlyssesError::InvalidConfig)?;
    let compute_dtype = config.precision.compute_dtype::<B>(device)?;
    let model = model.with_compute_dtype(compute_dtype).with_f32_head(config.f32_head);
    let model = if config.freeze_embeddings { model.with_frozen_embeddings() } else { model };
    let sharder = config.sharder();
    let optimizer = match (config.offload_optimizer, config.zero_stage) {
        (true, _) => {
            let config = host_adamw_config(&config.optimizer)?;
            RankOptimizer::OnHost(options.host_optimizer_threads.map_or_else(|| ShardedAdamW::new(config), |threads| ShardedAdamW::with_threads(config, threads)))
        }
        (false, 3) => RankOptimizer::OnDevice(DeviceShardedAdamW::new(host_adamw_config(&config.optimizer)?)),
        // Weight matrices decayed alone, as the sharded optimizers decay them.
        (false, _) => RankOptimizer::Replicated(MatrixDecayAdamW::<Decoder<B>, B>::new(&config.optimizer)),
    };
    let is_first = groups.world_rank() == 0;
    // ZeRO-3 cuts each rank's parts one parameter at a time (ShardedParameters::shard_from),
    // from world rank 0's broadcast (its master part kept too) or a resumed run's master
    // weights, so no rank holds the whole model, and `model` may be lazy (built by world rank
    // 0 alone, or never).
    let zero_3 = config.zero_stage == 3;
    let (mut model, mut optimizer, resumed) = match &options.resume {
        None if zero_3 => (model, optimizer, None),
        None => (broadcast_parameters(model, &*groups.world)?, optimizer, None),
        Some(location) => {
            let (model, optimizer, state) = resume(config, location, model, optimizer, groups, device, options.ranks_on_this_host, options.resumed_at)?;
            if let Some(why) = state.data.as_ref().zip(options.data_identity.as_ref()).and_then(|(saved, ours)| ours.differs_from(saved)).filter(|_| !options.allow_new_data) {
                return Err(UlyssesError::InvalidConfig(why));
            }
            (model, optimizer, Some(state))
        }
    };
    let first_step = resumed.as_ref().map_or(0, |state| state.data_position);
    let (world_rank, world) = (groups.world_rank(), groups.world.size());
    // ZeRO-3's cut takes them itself.
    if first_step == 0 && !zero_3 {
        match &mut optimizer {
            RankOptimizer::Replicated(_) => {}
            RankOptimizer::OnHost(host) => host.keep_master_weights(&model, world_rank, world)?,
            RankOptimizer::OnDevice(on_device) => on_device.keep_master_weights(&model, world_rank, world)?,
        }
    }
    let sharded = !matches!(optimizer, RankOptimizer::Replicated(_));
    // A replicated checkpoint is a MessagePack record: refused before the first step where a
    // parameter does not fit one, not at the first checkpoint.
    if !sharded && options.checkpoint_dir.is_some() {
        ulysses_training::checkpoint::check_record_fits(&model, ulysses_training::checkpoint::REPLICATED_CHECKPOINT_FIX)?;
    }
    // The order of a sharded checkpoint's sections (a ZeRO-3 model holds placeholders later);
    // a replicated checkpoint goes by name.
    let parameter_paths = if sharded { ulysses_training::parameter_paths(&model) } else { Vec::new() };
    // Each rank writes its part of a sharded checkpoint: a folder of each node's own is found
    // now, not at the first checkpoint.
    if let (true, Some(dir)) = (sharded, &options.checkpoint_dir) {
        ulysses_training::check_folder_shared(dir, &*groups.world)?;
    }
    // The f32 master weights are the optimizer's: the model keeps the compute copy alone.
    if sharded && compute_dtype != FloatDType::F32 && !zero_3 {
        model = with_parameters_in(model, compute_dtype);
    }
    if let Some((_, checkpoint)) = &options.save_hf {
        let compute_copy = (sharded && compute_dtype != FloatDType::F32).then_some(compute_dtype);
        options.save_hf_dtype = Some(save_hf_dtype(options.save_hf_dtype, checkpoint.saved_dtype(), compute_copy).map_err(UlyssesError::InvalidConfig)?);
    }
    let mut parts = None;
    if zero_3 {
        let from = if options.resume.is_some() { PartsFrom::Masters } else { PartsFrom::Rank0 };
        let (on_host, world_comm) = (config.offload_parameters, &*groups.world);
        let (placeholders, mut sharded) = match &mut optimizer {
            RankOptimizer::OnHost(host) => ShardedParameters::shard_from(model, from, host, compute_dtype, on_host, device, world_comm)?,
            RankOptimizer::OnDevice(on_device) => ShardedParameters::shard_from(model, from, on_device, compute_dtype, on_host, device, world_comm)?,
            RankOptimizer::Replicated(_) => return Err(UlyssesError::InvalidConfig("ZeRO-3 with a replicated optimizer: --zero 3 shards the optimizer's state too".into())),
        };
        if let (true, RankOptimizer::OnHost(host)) = (config.offload_parameters, &mut optimizer) {
            sharded.share_master_weights(host)?;
        }
        (model, parts) = (placeholders, Some(sharded));
    }
    if is_first {
        log_memory(&model, &optimizer, parts.as_ref(), groups.world.size());
        if let RankOptimizer::OnHost(host) = &optimizer {
            tracing::info!("the optimizer on the host updates on {} thread(s) a rank", host.threads());
        }
    }
    let eval_batch = data.eval_batch();
    // Every rank draws the step's whole batch and takes its part, and evaluates the same
    // held-out sequences: ranks that read other data (node-local copies that differ) would
    // train on parts of different batches, or evaluate unlike numbers of batches (under
    // ZeRO-3, gathers that never pair up).
    if first_step < config.steps {
        let train = ulysses_training::batch_digest(&data.train_batch(first_step));
        let held_out = eval_batch.as_deref().map_or(0, ulysses_training::batch_digest);
        let digests = burn_ulysses::comm::all_gather_host_checked(&*groups.world, &[train, held_out], "the first step's batch")?;
        for (column, differ) in [(0, format!("draw different batches for step {first_step}")), (1, "hold out different sequences".to_string())] {
            if digests.iter().all(|d| d[column] == digests[0][column]) {
                continue;
            }
            // The ranks of each kind, so that the odd one out shows whatever its rank.
            let mut kinds: Vec<(u64, Vec<usize>)> = Vec::new();
            for (rank, d) in digests.iter().enumerate() {
                match kinds.iter_mut().find(|(digest, _)| *digest == d[column]) {
                    Some((_, ranks)) => ranks.push(rank),
                    None => kinds.push((d[column], vec![rank])),
                }
            }
            let groups: Vec<String> = kinds.iter().map(|(_, ranks)| format!("{ranks:?}")).collect();
            return Err(UlyssesError::InvalidConfig(format!(
                "the ranks {differ} (world ranks {}, each group alike): every rank must read the same data (one shared file system, \
                 or copies equal byte for byte, with the same tokenizer and flags)",
                groups.join(" against ")
            )));
        }
        // Every rank drew the same batch: all refuse alike, none is left waiting.
        if let Some(saved) = resumed.as_ref().and_then(|state| state.next_batch_digest).filter(|&saved| saved != train && !options.allow_new_data) {
            return Err(UlyssesError::InvalidConfig(format!(
                "step {first_step} would train on another batch than the run that wrote the checkpoint drew for it (digest {train:016x}, \
                 not {saved:016x}): the data, the tokenizer or how the data is read changed since, in a way its recorded identity \
                 does not show. Resume on the data and with the build it trained with, or give --allow-new-data to go on with this data"
            )));
        }
    }
    let eval_documents = if config.pack { data.eval_documents() } else { None };
    let eval_targets = data.eval_targets();
    let mut last_step = options.stop_after.map_or(config.steps, |stop| stop.min(config.steps));
    // Not sized ahead: --steps may be far more than a run takes before it stops.
    let mut reports = Vec::new();

    // Rank 0's write of the last replicated checkpoint: waited for at the end, or left running
    // on a way out with an error (`finish_writes_left_running`).
    let mut replicated_write = CheckpointWrite::default();
    STEPS_BEGUN.store(true, std::sync::atomic::Ordering::Relaxed);
    // The evaluation due at the step the checkpoint ended, where the record lacks it: a run
    // stopped between its checkpoint and its evaluation (killed there) lost it, and the model
    // is that step's. World rank 0's record decides for every rank (the others' nodes may not
    // see it; the evaluation is a collective); a finished run resumed (an export) takes none.
    let resumed_eval = first_step.checked_sub(1).filter(|&step| first_step < last_step && config.eval_due(step) && eval_batch.is_some());
    if let Some(step) = resumed_eval {
        let recorded = options.progress.as_deref().is_some_and(|progress| progress.has_eval(step));
        let verdicts = burn_ulysses::comm::all_gather_host_checked(&*groups.world, &[recorded as u64], "the record's held-out losses")?;
        if let (0, Some(sequences)) = (verdicts[0][0], &eval_batch) {
            let loss = evaluate_held_out(step, config, &model, parts.as_mut(), sequences, eval_documents.as_deref(), eval_targets.as_deref(), groups, device)?;
            if let (Some(progress), Some(loss)) = (options.progress.as_deref_mut(), loss) {
                progress.eval(step, loss);
            }
        }
    }
    for step in first_step..last_step {
        if options.faults.fail == Some((step, groups.world_rank())) {
            return Err(UlyssesError::InvalidConfig("test hook: this rank fails as the step begins".into()).at_step(step));
        }
        let started = Instant::now();
        let io_before = DeviceIo::of_this_thread();
        let (next, report, backward_done) =
            train_one_step(config, model, &mut optimizer, parts.as_mut(), data, step, &sharder, groups, device, &options.faults, options.time_phases)
                .map_err(|e| e.at_step(step))?;
        // The step's work done before its seconds are read: the update is queued after the
        // step's last read, and its time fell into the next step's (PyTorch's reference reads
        // its loss after its update). One wait a step, counted with the step's.
        B::sync(device).map_err(|e| UlyssesError::InModel { message: device_failure("the device failed finishing the step's work", &e) }.at_step(step))?;
        // The timing's own sync is not the step's: left out of its counts.
        let io = DeviceIo::of_this_thread() - io_before - backward_done.map_or_else(DeviceIo::default, |(_, io)| io);
        if let (Some((at, _)), Some(progress)) = (backward_done, options.progress.as_deref_mut()) {
            let in_backward = config.optimizer_in_backward && parts.is_some();
            progress.phases(step, (at - started).as_secs_f64(), at.elapsed().as_secs_f64(), in_backward);
        }
        model = next;
        reports.push(report);
        // A checkpoint write that failed stops the run at the step that finds it done, not at
        // the next checkpoint (every step since then lost).
        if replicated_write.done() {
            report_written(replicated_write.finish()?, options.progress.as_deref_mut());
        }
        // A signal (`ulysses_training::request_stop`) on any rank: every rank learned it in
        // this step's health check, so all make this step the last, with its checkpoint (the
        // request cleared as the run returns: `ForgetLateStop`).
        if report.stop_requested && step + 1 < last_step {
            last_step = step + 1;
            STOPPED_ON_SIGNAL.store(true, std::sync::atomic::Ordering::Relaxed);
            if is_first {
                tracing::warn!(step = step + 1, "asked to stop (SIGTERM or SIGUSR1): this step is the last, its checkpoint is written; --resume continues the run");
            }
        }
        if let Some(progress) = options.progress.as_deref_mut() {
            progress.step(step, &report, config.learning_rate_at(step), started.elapsed().as_secs_f64());
            progress.device_io(step, &io);
        }
        if config.check_parameters_every > 0 && (step + 1) % config.check_parameters_every == 0 && parts.is_none() {
            check_parameters_identical(&model, &*groups.world).map_err(|e| e.at_step(step))?;
        }
        let done = step + 1;
        let checkpoint_due = done == last_step || (options.checkpoint_every > 0 && done % options.checkpoint_every == 0);
        if checkpoint_due {
            if let Some(progress) = options.progress.as_deref_mut() {
                progress.checkpoint_due(step);
            }
            let state = RunState {
                completed_steps: done,
                data_position: done,
                seed: config.seed,
                config: config.clone(),
                data: options.data_identity.clone(),
                next_batch_digest: (done < config.steps).then(|| ulysses_training::batch_digest(&data.train_batch(done))),
                decayed_every_parameter: false,
            };
            // What rank 0 alone writes (a replicated checkpoint, --save-hf of the whole model)
            // is taken into host memory now and written on a thread of its own, so that the
            // other ranks do not wait through the write at the next step's collectives; the
            // last such write ended first (one copy in memory at a time), every rank waiting
            // with rank 0 (not in the next collective, whose timeout a slow disk would pass).
            replicated_write.wait_with_every_rank(&*groups.world)?;
            report_written(replicated_write.finish()?, options.progress.as_deref_mut());
            // The checkpoint this one replaces kept beside it, before the save (a sharded
            // one's commit removes the state no checkpoint names).
            if let (true, Some(dir), 2..) = (is_first, &options.checkpoint_dir, options.keep_checkpoints) {
                if dir.join(crate::run_folder::CHECKPOINT_FILE).exists()
                    && let Err(why) = keep_replaced_checkpoint(dir, options.keep_checkpoints, options.resume.as_deref())
                {
                    tracing::warn!("the checkpoint before this one is not kept: {why}");
                }
            }
            let mut checkpoint = None;
            match (&mut optimizer, &options.checkpoint_dir) {
                (RankOptimizer::Replicated(optimizer), Some(dir)) if is_first => {
                    checkpoint = Some(TrainingCheckpoint::take(dir, &model, optimizer, &state)?);
                }
                (RankOptimizer::Replicated(_), _) => {}
                // Sharded: every rank its part of the optimizer's state, whose master weights
                // are the model (a collective; nothing gathered).
                (RankOptimizer::OnHost(optimizer), Some(dir)) => {
                    let path = save_sharded_training_checkpoint::<B, _>(dir, optimizer, &parameter_paths, &state, done as u64, &*groups.world)?;
                    report_written(path.map(|path| (step, path)), options.progress.as_deref_mut());
                }
                (RankOptimizer::OnDevice(optimizer), Some(dir)) => {
                    let path = save_sharded_training_checkpoint::<B, _>(dir, optimizer, &parameter_paths, &state, done as u64, &*groups.world)?;
                    report_written(path.map(|path| (step, path)), options.progress.as_deref_mut());
                }
                (_, None) => {}
            }
            let (hf, hf_failed) = match parts.as_mut() {
                // Under ZeRO-3 every rank gathers a shard at a time for rank 0 (a collective).
                Some(parts) => {
                    save_hf_gathered_at(&model, parts, &options, groups, done)?;
                    (None, None)
                }
                // A snapshot that fails is said after the checkpoint taken beside it is on its
                // way (the run's error waits for its write): it is not lost with it.
                None if is_first => match take_hf(&model, &options) {
                    Ok(hf) => (hf, None),
                    Err(error) => (None, Some(error)),
                },
                None => (None, None),
            };
            if checkpoint.is_some() || hf.is_some() {
                let (delay, fails) = (options.faults.slow_checkpoint_write, options.faults.failed_checkpoint_write);
                replicated_write.begin(step, move || {
                    std::thread::sleep(delay);
                    let written = match checkpoint {
                        Some(checkpoint) if fails => Err(UlyssesError::Checkpoint { path: checkpoint.dir().display().to_string(), reason: "test hook: the write failed".into() }),
                        Some(checkpoint) => checkpoint.write().map(Some),
                        None => Ok(None),
                    };
                    // Written whatever became of the checkpoint; the first failure is the
                    // outcome, and a checkpoint written beside a failed save is said.
                    let saved = hf.map(|hf| write_hf(hf, done)).transpose();
                    if let (Ok(Some(path)), Err(_)) = (&written, &saved) {
                        tracing::info!(step = done, file = %path.display(), "checkpoint written");
                    }
                    saved?;
                    written
                })?;
            }
            if let Some(error) = hf_failed {
                return Err(error);
            }
        }
        // After the checkpoint: an evaluation that fails (out of memory on a held-out batch
        // that is larger than a step's part) loses no step. Held-out batches of a step's
        // micro-batch: what the step ran (and `--check` counted) fits them.
        if let (true, Some(sequences)) = (config.eval_due(step), &eval_batch) {
            let loss = evaluate_held_out(step, config, &model, parts.as_mut(), sequences, eval_documents.as_deref(), eval_targets.as_deref(), groups, device)?;
            if let (Some(progress), Some(loss)) = (options.progress.as_deref_mut(), loss) {
                progress.eval(step, loss);
            }
        }
        if done == last_step {
            break;
        }
    }
    report_written(replicated_write.finish()?, options.progress.as_deref_mut());
    // A resume of a run that had taken every step: --save-hf exports it.
    if first_step >= last_step {
        match (parts.as_mut(), &options.save_hf) {
            (Some(parts), _) => save_hf_gathered_at(&model, parts, &options, groups, first_step)?,
            // Nothing runs beside it: written a shard at a time, never the model whole in memory.
            (None, Some((dir, checkpoint))) if is_first => {
                let dtype = hf_dtype(&options, checkpoint);
                save_pretrained_including(&model, checkpoint, dir, SaveOptions::new(dtype), &options.save_hf_companions).map_err(|e| hf_error(dir, e))?;
                tracing::info!(step = first_step, folder = %dir.display(), ?dtype, "saved in Hugging Face's format");
            }
            (None, _) => {}
        }
    }
    // The last step's update may still run on the host optimizer's thread (ZeRO-3): its
    // failure is this run's, and the memory figures below are the run's end's.
    if let RankOptimizer::OnHost(host) = &mut optimizer {
        host.settle()?;
    }
    // Each rank's device, where the backend accounts for it (CubeCL's pools), and the host.
    if let Some(memory) = B::Wire::device_memory(device) {
        tracing::info!(
            rank = world_rank,
            "device memory after the last step: {:.3} GB in use, {:.3} GB reserved by the pools (the most they held){}",
            memory.in_use as f64 / 1e9,
            memory.reserved as f64 / 1e9,
            options.estimated_peak.map(|peak| format!("; the estimate of a step's peak in use: {:.3} GB", peak as f64 / 1e9)).unwrap_or_default()
        );
    }
    if is_first && let Some(peak) = ulysses_core::host_memory::peak_resident_bytes() {
        tracing::info!("host memory at its peak in this process (every rank thread of it): {:.3} GB", peak as f64 / 1e9);
    }
    Ok((TrainedModel { model, parts }, reports))
}

/// Rank 0's write of a replicated checkpoint and of `--save-hf` of the whole model (after step
/// `.0`), on a thread of its own while
/// the ranks train on: waiting for it held every other rank at the next step's collectives
/// through the whole write, which for a large model on a slow disk outlasts their timeout.
/// The next checkpoint waits for it before it takes its records (two would hold the state
/// twice in host memory); dropped on a way out with an error, it goes on while the rank leaves
/// its group, for [`finish_writes_left_running`] to wait for before the process ends.
#[derive(Default)]
struct CheckpointWrite(Option<(usize, JoinHandle<Result<Option<PathBuf>, UlyssesError>>)>);

impl CheckpointWrite {
    /// Starts `write` on a thread of its own: what rank 0 saves after step `step`, returning
    /// the training checkpoint's file where it wrote one.
    fn begin(&mut self, step: usize, write: impl FnOnce() -> Result<Option<PathBuf>, UlyssesError> + Send + 'static) -> Result<(), UlyssesError> {
        debug_assert!(self.0.is_none(), "finish the write before the next");
        // Under ulysses-launch a rank that fails meanwhile does not get this write killed.
        let busy = ulysses_dist::launch::Busy::note(&format!("rank 0's write of the checkpoint after step {}", step + 1));
        let thread = std::thread::Builder::new().name("checkpoint-write".into()).spawn(move || {
            let _busy = busy;
            // A panic in it (burn-store's writers panic on a snapshot's error) is the run's
            // error like any other of the write's: rank 0 rethrowing it unwound past its
            // report to its peers, which then took it for a rank that had finished.
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(write)).unwrap_or_else(|panic| {
                // Its step said by `finish` (`at_step`), as the write's other errors.
                Err(UlyssesError::Checkpoint { path: "write".into(), reason: format!("its writer panicked: {}", ulysses_core::comm::panic_message(panic.as_ref())) })
            })
        });
        self.0 = Some((step, thread.map_err(|e| UlyssesError::InvalidConfig(format!("cannot start the thread that writes the checkpoint: {e}")))?));
        Ok(())
    }

    /// Whether a write begun has ended (its outcome is waiting for [`finish`](Self::finish)).
    fn done(&self) -> bool {
        self.0.as_ref().is_some_and(|(_, write)| write.is_finished())
    }

    /// Waits on every rank of `world` until world rank 0's write begun, if any, has ended, a
    /// second at a time (each rank learns whether it has ended in one gather a second): rank 0
    /// alone joining a write slower than the checkpoints are due kept the others waiting in
    /// their next collective, which timed out (`ULYSSES_COLLECTIVE_TIMEOUT`) blaming rank 0 as
    /// stuck.
    fn wait_with_every_rank(&self, world: &dyn Communicator<impl burn::tensor::backend::Backend>) -> Result<(), UlyssesError> {
        let (waited, mut said) = (std::time::Instant::now(), 0);
        loop {
            // Said each minute where it holds (a slow or hung file system): every rank waits here.
            if let Some((step, _)) = self.0.as_ref().filter(|_| waited.elapsed().as_secs() / 60 > said) {
                said += 1;
                tracing::warn!("still writing the checkpoint after step {} ({said} min): every rank waits for it", step + 1);
            }
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
            while self.0.is_some() && !self.done() && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            let writing = u64::from(self.0.is_some() && !self.done());
            if all_gather_host_checked(world, &[writing], "rank 0's checkpoint write under way")?.iter().all(|writing| writing == &[0]) {
                return Ok(());
            }
        }
    }

    /// Waits for the write begun, if any: its step and the training checkpoint's file.
    fn finish(&mut self) -> Result<Option<(usize, PathBuf)>, UlyssesError> {
        let Some((step, write)) = self.0.take() else { return Ok(None) };
        let path = write.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)).map_err(|e| e.at_step(step))?;
        Ok(path.map(|path| (step, path)))
    }
}

/// Keeps the run folder `dir`'s checkpoint, which a save or a resume going back past it is about
/// to replace, beside it under its steps ([`keep_earlier_checkpoint`](crate::run_folder::keep_earlier_checkpoint)),
/// `keep` checkpoints in all, never `resumed`.
pub fn keep_replaced_checkpoint(dir: &Path, keep: usize, resumed: Option<&Path>) -> Result<(), String> {
    let state = ulysses_training::checkpoint::read_checkpoint_state::<RunState>(&dir.join(crate::run_folder::CHECKPOINT_FILE)).map_err(|e| format!("it cannot be read: {e}"))?;
    crate::run_folder::keep_earlier_checkpoint(dir, state.completed_steps, keep, resumed)
}

/// Writes a rank's failure left under way, for [`finish_writes_left_running`].
type WriteUnderWay = (usize, JoinHandle<Result<Option<PathBuf>, UlyssesError>>);
static WRITES_LEFT_RUNNING: std::sync::Mutex<Vec<WriteUnderWay>> = std::sync::Mutex::new(Vec::new());

impl Drop for CheckpointWrite {
    fn drop(&mut self) {
        // On a way out that already has its error: the write goes on while the rank leaves its
        // group, so that its peers learn of the error at once (joined here, the rank stayed in
        // the group through the write, and they waited, or timed out calling it stuck).
        if let Some(write) = self.0.take() {
            WRITES_LEFT_RUNNING.lock().unwrap_or_else(|p| p.into_inner()).push(write);
        }
    }
}

/// Waits for the checkpoint writes that ranks which failed left under way, logging how each
/// ended: for the process to call once its ranks have left their groups, before it exits.
pub fn finish_writes_left_running() {
    let writes = std::mem::take(&mut *WRITES_LEFT_RUNNING.lock().unwrap_or_else(|p| p.into_inner()));
    for (step, write) in writes {
        match write.join() {
            Ok(Ok(Some(path))) => tracing::info!(step = step + 1, file = %path.display(), "checkpoint written"),
            Ok(Ok(None)) => {}
            Ok(Err(error)) => tracing::error!("{}", error.at_step(step)),
            Err(panic) => tracing::error!(step, "the thread writing the checkpoint panicked: {}", ulysses_core::comm::panic_message(panic.as_ref())),
        }
    }
}

fn report_written(written: Option<(usize, PathBuf)>, progress: Option<&mut (dyn Progress + '_)>) {
    if let (Some((step, path)), Some(progress)) = (written, progress) {
        progress.checkpoint(step, &path);
    }
}

/// Whether a rank of this process has begun its steps: before, a stop signal has no step to
/// finish (the trainer then ends at once rather than wait, in a rendezvous, say, for peers
/// that may never come).
pub static STEPS_BEGUN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether a stop signal made a rank of this process end its run before its last step (with
/// a checkpoint): the trainer then exits [`ulysses_dist::launch::EXIT_STOPPED_TO_RESUME`].
pub static STOPPED_ON_SIGNAL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A rank's model after [`train_rank`]: whole, or under ZeRO-3 this rank's parts of it (the
/// model itself holding placeholders), gathered only as far as what is asked of it needs.
pub struct TrainedModel<B: TrainBackend> {
    model: Decoder<B>,
    parts: Option<ShardedParameters<B>>,
}

impl<B: TrainBackend> TrainedModel<B> {
    /// A model a loop of one's own trained: whole (`parts: None`), or under ZeRO-3 holding
    /// placeholders, with this rank's `parts` ([`ShardedParameters::shard`]).
    pub fn new(model: Decoder<B>, parts: Option<ShardedParameters<B>>) -> Self {
        Self { model, parts }
    }

    /// The model whole on this rank: under ZeRO-3 every parameter all-gathered (collective over
    /// `world`, and the whole model on every device).
    pub fn whole(self, world: &dyn Communicator<B::Wire>) -> Result<Decoder<B>, UlyssesError> {
        let Self { model, parts } = self;
        match parts {
            Some(mut parts) => parts.gather_all(model, world),
            None => Ok(model),
        }
    }

    /// Writes the model ([`save_model`]'s file, Burn's record) from world rank 0; every rank
    /// calls it. Under ZeRO-3 the ranks gather it a layer at a time (collective over `world`)
    /// as rank 0 writes it: rank 0 holds the rest's record (embeddings, final norm, head) and
    /// one layer's at a time, so no device and no host holds the whole model. Otherwise rank 0
    /// writes its model. Rank 0 alone learns whether the file was written: the others do not
    /// wait through the write (of 280 GB for 70B), which would outlast the collectives' timeout.
    /// A gather's error keeps its kind: a rank that failed on a peer's loss says so (exit 76).
    pub fn save(&mut self, path: &Path, world: &dyn Communicator<B::Wire>) -> Result<(), UlyssesError> {
        let Self { model, parts } = self;
        // Its own words name the file.
        let not_written = |message| UlyssesError::InModel { message };
        let Some(parts) = parts else {
            return if world.rank() == 0 { save_model(model, path).map_err(not_written) } else { Ok(()) };
        };
        let layers = model.layer_count();
        let mut gathers = parts.over(world);
        let mut gather = |group| {
            gathers.gather(model, group).map_err(|e| UlyssesError::While { doing: "cannot gather the model to save it", source: Box::new(e) })
        };
        // Layers 0..asked were gathered for rank 0's writer; the rest is gathered below.
        let (mut asked, mut written) = (0, Ok(()));
        if world.rank() == 0 {
            let rest = gather(ParameterGroup::Rest)?;
            let mut gather_failed = None;
            {
                let layer = |index| {
                    asked = index + 1;
                    gather(ParameterGroup::Layer(index)).inspect_err(|e| gather_failed = Some(e.clone())).map_err(|e| e.to_string())
                };
                written = write_model_record::<B, _>(path, Decoder::record_item_by_layers::<FullPrecisionSettings, _>(rest, layer)).map_err(not_written);
            }
            if let Some(error) = gather_failed {
                return Err(error);
            }
        } else {
            gather(ParameterGroup::Rest).map(drop)?;
        }
        // The other ranks gather every layer; rank 0 those a write that failed part way left.
        (asked..layers).try_for_each(|index| gather(ParameterGroup::Layer(index)).map(drop))?;
        written
    }
}

/// `--save-hf`, where asked, of the whole model on world rank 0: taken into host memory, to be
/// written by [`HfCheckpointSnapshot::write`].
fn take_hf<B: TrainBackend>(model: &Decoder<B>, options: &RunOptions) -> Result<Option<HfCheckpointSnapshot>, UlyssesError> {
    let Some((dir, checkpoint)) = &options.save_hf else { return Ok(None) };
    HfCheckpointSnapshot::take(model, checkpoint, dir, SaveOptions::new(hf_dtype(options, checkpoint)), &options.save_hf_companions).map(Some).map_err(|e| hf_error(dir, e))
}

/// Writes a `--save-hf` snapshot taken after step `done`.
fn write_hf(hf: HfCheckpointSnapshot, done: usize) -> Result<(), UlyssesError> {
    let dir = hf.dir().to_path_buf();
    let dtype = hf.dtype();
    hf.write().map_err(|e| hf_error(&dir, e))?;
    tracing::info!(step = done, folder = %dir.display(), ?dtype, "saved in Hugging Face's format");
    Ok(())
}

/// The dtype `--save-hf` writes in: the one `asked` for, or the checkpoint's own; where the
/// model a run exports is a half-precision compute copy (`compute_copy`: a sharded optimizer
/// holds the f32 masters), that copy's dtype, and a wider one asked for is refused: it would
/// hold the copy's values (bf16's grid under an f32 label; an f16 export rounded twice).
pub fn save_hf_dtype(asked: Option<DType>, own: DType, compute_copy: Option<FloatDType>) -> Result<DType, String> {
    let Some(copy) = compute_copy else { return Ok(asked.unwrap_or(own)) };
    let copy_dtype = DType::from(copy);
    match asked {
        Some(asked) if asked != copy_dtype => Err(format!(
            "--save-hf-dtype {asked:?}: this run exports its {copy_dtype:?} compute copy (the f32 master weights are the sharded \
             optimizer's, --offload-optimizer or --zero 3 with half precision), so an {asked:?} export would hold {copy_dtype:?}'s values \
             under another label; save in {copy_dtype:?}, or train with --precision f32 (or without a sharded optimizer) to export {asked:?}"
        )),
        _ => Ok(copy_dtype),
    }
}

/// The dtype a `--save-hf` writes the weights in: `options.save_hf_dtype` (resolved in
/// `train_rank`), else the checkpoint's own.
fn hf_dtype(options: &RunOptions, checkpoint: &HfConfig) -> DType {
    options.save_hf_dtype.unwrap_or_else(|| checkpoint.saved_dtype())
}

fn hf_error(dir: &Path, reason: impl std::fmt::Display) -> UlyssesError {
    UlyssesError::Checkpoint { path: dir.display().to_string(), reason: format!("--save-hf: {reason}") }
}

/// `--save-hf`, where asked, of the model after step `done` under ZeRO-3 (collective over the
/// world; world rank 0 writes).
fn save_hf_gathered_at<B: TrainBackend>(model: &Decoder<B>, parts: &mut ShardedParameters<B>, options: &RunOptions, groups: &ParallelGroups<B::Wire>, done: usize) -> Result<(), UlyssesError> {
    let Some((dir, checkpoint)) = &options.save_hf else { return Ok(()) };
    let dtype = hf_dtype(options, checkpoint);
    if save_hf_gathered(model, parts, checkpoint, dir, dtype, &options.save_hf_companions, groups).map_err(|reason| hf_error(dir, reason))?.is_some() {
        tracing::info!(step = done, folder = %dir.display(), ?dtype, "saved in Hugging Face's format");
    }
    Ok(())
}

/// `--save-hf` under ZeRO-3: every rank gathers one safetensors shard's parameters at a time
/// (the whole model is never gathered) and world rank 0 writes it. Collective; rank 0 goes on
/// gathering after a failed write so that no rank waits for it, and every rank learns the
/// outcome (`Some` on rank 0 when written).
fn save_hf_gathered<B: TrainBackend>(
    model: &Decoder<B>,
    parts: &mut ShardedParameters<B>,
    checkpoint: &HfConfig,
    dir: &Path,
    dtype: DType,
    companions: &[(PathBuf, String)],
    groups: &ParallelGroups<B::Wire>,
) -> Result<Option<()>, String> {
    let options = SaveOptions::new(dtype);
    let plan = plan_shard_paths(&parts.tensors(), options);
    let mut writer = match groups.world_rank() {
        0 => Some(HfCheckpointWriter::begin(checkpoint, dir, options, parts.tensors()).and_then(|mut writer| {
            companions.iter().try_for_each(|(file, name)| writer.include(file, name))?;
            Ok(writer)
        })
        .map_err(|e| e.to_string())),
        _ => None,
    };
    for (shard, paths) in plan.iter().enumerate() {
        let gathered = parts.gather_paths(model.clone(), paths, &*groups.world).map_err(|e| e.to_string())?;
        if let Some(Ok(ok)) = writer.as_mut() {
            if let Err(error) = ok.write_shard(shard, &gathered) {
                writer = Some(Err(error.to_string()));
            }
        }
    }
    let written = writer.map(|writer| writer.and_then(|writer| writer.finish().map_err(|e| e.to_string())));
    let ok = written.as_ref().is_none_or(Result::is_ok);
    let every_rank = all_gather_host_checked(&*groups.world, &[ok as u64], "--save-hf written").map_err(|e| e.to_string())?;
    match written {
        Some(result) => result.map(Some),
        None if every_rank[0][0] == 0 => Err("world rank 0 could not write the folder (its error says why)".into()),
        None => Ok(None),
    }
}

/// A rank's optimizer: burn's AdamW on the device, its state replicated on every rank, or
/// its state sharded over the world on the host ([`TrainConfig::offload_optimizer`]).
enum RankOptimizer<B: TrainBackend, O> {
    Replicated(O),
    OnHost(ShardedAdamW),
    /// ZeRO-3's parts of the state on the device.
    OnDevice(DeviceShardedAdamW<B>),
}

/// What a rank holds for training, on world rank 0's log: parameters and gradients on the
/// device (whole, or under ZeRO-3 this rank's parts), the optimizer's state on the device
/// (replicated AdamW's two moments) or the host (master weights and moments, this rank's
/// part).
fn log_memory<B: TrainBackend, O>(model: &Decoder<B>, optimizer: &RankOptimizer<B, O>, parts: Option<&ShardedParameters<B>>, world: usize) {
    let gb = |bytes: usize| format!("{:.3} GB", bytes as f64 / 1e9);
    if let Some(parts) = parts {
        let elements = parts.elements();
        tracing::info!(
            parameters = elements.iter().sum::<usize>(),
            "memory per rank (ZeRO-3 over {world}): its part of the parameters {} on the device, of the gradients {} (f32) and of AdamW's \
             state {} on the {:?}; during a step one layer (or the embeddings and head) whole on the device besides",
            gb(parts.device_bytes()),
            gb(ShardedAdamW::host_bytes_of(&elements, world) / 3),
            gb(ShardedAdamW::host_bytes_of(&elements, world)),
            parts.optimizer_place()
        );
        return;
    }
    let parameters = float_parameters(model);
    let elements: Vec<usize> = parameters.iter().map(|p| p.shape.iter().product()).collect();
    let count: usize = elements.iter().sum();
    // Gradients come in their parameter's dtype.
    let bytes: usize = parameters.iter().zip(&elements).map(|(p, n)| n * p.values.dtype().size()).sum();
    let (where_, state) = match optimizer {
        RankOptimizer::Replicated(_) => ("device", 8 * count),
        RankOptimizer::OnHost(_) => ("host", ShardedAdamW::host_bytes_of(&elements, world)),
        RankOptimizer::OnDevice(_) => ("device", ShardedAdamW::host_bytes_of(&elements, world)),
    };
    tracing::info!(
        parameters = count,
        "memory per rank: parameters {} and gradients {} on the device ({:?}), AdamW's state {} on the {where_}",
        gb(bytes),
        gb(bytes),
        parameters.first().map(|p| p.values.dtype()),
        gb(state)
    );
}

/// One optimizer step: this rank's micro-batches of the step's batch, forward and backward,
/// then the world's gradients applied.
#[allow(clippy::too_many_arguments)]
fn train_one_step<B, O>(
    config: &TrainConfig,
    model: Decoder<B>,
    optimizer: &mut RankOptimizer<B, O>,
    parts: Option<&mut ShardedParameters<B>>,
    data: &dyn StepData,
    step: usize,
    sharder: &SequenceSharder,
    groups: &ParallelGroups<B::Wire>,
    device: &B::Device,
    faults: &Faults,
    time_phases: bool,
) -> Result<(Decoder<B>, StepReport, Option<(Instant, DeviceIo)>), UlyssesError>
where
    B: TrainBackend,
    O: Optimizer<Decoder<B>, B>,
{
    // With `time_phases`: when the backward's work ended (the device synchronised), and what
    // that sync counted.
    let backward_done = || -> Result<Option<(Instant, DeviceIo)>, UlyssesError> {
        if !time_phases {
            return Ok(None);
        }
        let before = DeviceIo::of_this_thread();
        B::sync(device).map_err(|e| UlyssesError::InModel { message: device_failure("the device failed finishing the step's backward", &e) })?;
        Ok(Some((Instant::now(), DeviceIo::of_this_thread() - before)))
    };
    let global = data.train_batch(step);
    if global.len() != config.batch_size {
        let message = format!("the data gave {} sequences, the config says {}", global.len(), config.batch_size);
        return Err(UlyssesError::InvalidConfig(message));
    }
    let micro_batches = config.micro_batches(&global, groups.dp_rank());
    let documents = config.pack.then(|| config.micro_batches(&data.train_documents(step, &global), groups.dp_rank()));
    let targets = data.train_targets(step, &global).map(|targets| config.micro_batches(&targets, groups.dp_rank()));
    let input = StepInput {
        index: step,
        learning_rate: config.learning_rate_at(step),
        micro_batches: &micro_batches,
        documents: documents.as_deref(),
        targets: targets.as_deref(),
        max_grad_norm: config.max_grad_norm,
    };
    if let Some(parts) = parts {
        let Some(checkpointing) = &config.layer_checkpointing else { unreachable!("TrainConfig::validate: ZeRO-3 runs on layer checkpointing") };
        if faults.nan_gradient.is_some() {
            return Err(UlyssesError::InvalidConfig("the NaN-gradient test hook runs without --zero 3 (ZeRO-3's gradients leave during the backward)".into()));
        }
        if let (true, RankOptimizer::OnHost(optimizer)) = (config.optimizer_in_backward, &mut *optimizer) {
            parts.update_in_backward(optimizer, &input)?;
        }
        let local = backward_step_zero3(&model, &input, sharder, groups, device, checkpointing, parts)?;
        let timed = backward_done()?;
        // After the backward: every rank is in this step (a kill as it starts could cut a peer
        // still reading the last step's final collective).
        kill_if_asked(faults, step, groups.world_rank());
        let (model, report) = match optimizer {
            RankOptimizer::OnHost(optimizer) => apply_step_zero3(model, optimizer, parts, &input, local, groups),
            RankOptimizer::OnDevice(optimizer) => apply_step_zero3(model, optimizer, parts, &input, local, groups),
            RankOptimizer::Replicated(_) => unreachable!("ZeRO-3 shards the optimizer's state"),
        }?;
        return Ok((model, report, timed));
    }
    let mut local = match &config.layer_checkpointing {
        None => backward_step(&model, &input, sharder, groups, device)?,
        Some(checkpointing) => backward_step_checkpointed(&model, &input, sharder, groups, device, checkpointing)?,
    };
    inject_faults(faults, step, groups.world_rank(), &model, &mut local);
    let timed = backward_done()?;
    let (model, report) = match optimizer {
        RankOptimizer::Replicated(optimizer) => apply_step(model, optimizer, &input, local, groups),
        RankOptimizer::OnHost(optimizer) => apply_step_sharded(model, optimizer, &input, local, groups),
        RankOptimizer::OnDevice(_) => unreachable!("the optimizer stays on the device under ZeRO-3 alone"),
    }?;
    Ok((model, report, timed))
}

/// The lengths of the paragraphs of a byte sequence: each ends after a blank line (`\n\n`),
/// the last at the sequence's end. They are the documents `--pack` trains on.
pub fn paragraph_lengths(sequence: &[i64]) -> Vec<usize> {
    let newline = i64::from(b'\n');
    let mut lengths = vec![];
    let mut start = 0;
    for end in 1..sequence.len() {
        if sequence[end] == newline && sequence[end - 1] == newline {
            lengths.push(end + 1 - start);
            start = end + 1;
        }
    }
    if start < sequence.len() {
        lengths.push(sequence.len() - start);
    }
    lengths
}

/// This host's turn to load the replicated checkpoint at `location`, held until dropped: a
/// load holds the whole file and its decoded records at once (about twice the checkpoint on
/// the host, 16 bytes a parameter with AdamW's moments), so the eight ranks of a node loading
/// together need eight times that (a 1B model's 150 GB), which the kernel's OOM killer met.
/// Where that does not fit the host's memory ([`HostTurn::needed`]), one rank of the host at a
/// time, by a lock file in the temporary folder (the ranks of other hosts load meanwhile; the
/// load takes no collective). The ranks that loaded first then wait for the last in the next
/// collective, which the collective timeout bounds (`ULYSSES_COLLECTIVE_TIMEOUT`). Where the
/// lock cannot be taken, no turn: loads at once, with a warning.
struct HostTurn {
    /// The lock file, locked; released as it closes.
    _lock: Option<std::fs::File>,
}

impl HostTurn {
    /// Whether `ranks` loads of the checkpoint at `location` at once (twice its size each) would
    /// not fit `available` bytes of the host (`None`: unknown, taken as fitting); `say`: log
    /// why the loads take turns.
    fn needed(location: &Path, ranks: usize, available: Option<u64>, say: bool) -> bool {
        let file = ulysses_training::checkpoint::checkpoint_path(location);
        let (Ok(size), Some(available)) = (std::fs::metadata(&file).map(|m| m.len()), available) else { return false };
        let at_once = 2 * size * ranks as u64;
        let needed = ranks > 1 && at_once > available;
        if needed && say {
            tracing::info!(
                "the {ranks} ranks of this host load the checkpoint ({:.1} GB) one at a time: at once they would hold {:.1} GB of the {:.1} GB \
                 available (a load longer than the collective timeout divided by the ranks needs ULYSSES_COLLECTIVE_TIMEOUT raised)",
                size as f64 / 1e9,
                at_once as f64 / 1e9,
                available as f64 / 1e9
            );
        }
        needed
    }

    fn take(location: &Path) -> Self {
        let location = std::fs::canonicalize(location).unwrap_or_else(|_| location.to_path_buf());
        // This host's: a temporary folder that nodes share (some clusters') must not make the
        // turns the whole world's.
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let key = ulysses_training::checkpoint::fnv1a(&[location.as_os_str().as_encoded_bytes(), &[0], host.trim().as_bytes()]);
        let path = std::env::temp_dir().join(format!("ulysses-resume-{key:016x}.lock"));
        // Another user's file of that (computable) name is no turn of ours: its holder could
        // keep every rank of this host waiting for ever.
        // Nor one another user may open (a lock needs no write access): ours alone, 0600.
        let ours = |file: std::fs::File| {
            use std::os::unix::fs::{MetadataExt, PermissionsExt};
            // SAFETY: geteuid(2) cannot fail.
            let metadata = file.metadata()?;
            if metadata.uid() != unsafe { libc::geteuid() } {
                return Err(std::io::Error::other("another user's file holds its name"));
            }
            // An older build's 0644 file made ours alone; a folder that takes no chmod keeps it.
            if metadata.mode() & 0o077 != 0 {
                let _ = file.set_permissions(std::fs::Permissions::from_mode(0o600));
            }
            Ok(file)
        };
        let open = {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new().create(true).truncate(false).write(true).mode(0o600).custom_flags(libc::O_NOFOLLOW).open(&path)
        };
        let locked = open.and_then(ours).and_then(|file| file.lock().map(|()| file));
        match locked {
            Ok(file) => Self { _lock: Some(file) },
            Err(error) => {
                tracing::warn!(lock = %path.display(), %error, "the ranks of this host load the checkpoint at once (no lock for turns)");
                Self { _lock: None }
            }
        }
    }
}

/// Every rank loads the checkpoint (so it must be readable on every node; a replicated one a
/// rank of each host at a time, [`HostTurn`]), after checking that it continues this run; then
/// the ranks check they loaded the same thing.
fn resume<B, O>(
    config: &TrainConfig,
    location: &Path,
    model: Decoder<B>,
    optimizer: RankOptimizer<B, O>,
    groups: &ParallelGroups<B::Wire>,
    device: &B::Device,
    ranks_on_this_host: usize,
    read_at: Option<usize>,
) -> Result<(Decoder<B>, RankOptimizer<B, O>, RunState), UlyssesError>
where
    B: TrainBackend,
    O: Optimizer<Decoder<B>, B>,
{
    // From the header alone, before any record is read: a model of another shape is named
    // here, not by a record that does not fit it.
    check_resumable(config, &read_checkpoint_state::<RunState>(location)?).map_err(UlyssesError::InvalidConfig)?;
    let (model, optimizer, state): (_, _, RunState) = match optimizer {
        RankOptimizer::Replicated(optimizer) => {
            let _turn = HostTurn::needed(location, ranks_on_this_host, ulysses_core::host_memory::available_bytes(), groups.world_rank() == 0).then(|| HostTurn::take(location));
            let (model, optimizer, state) = load_training_checkpoint(location, model, optimizer, device)?;
            (model, RankOptimizer::Replicated(optimizer), state)
        }
        RankOptimizer::OnHost(fresh) => {
            let (model, mut optimizer, state) = load_sharded(config, location, model, &*groups.world)?;
            optimizer.set_threads(fresh.threads());
            (model, RankOptimizer::OnHost(optimizer), state)
        }
        // ZeRO-3 alone: each part uploaded as it is read (the host never holds the rank's state).
        RankOptimizer::OnDevice(_) => {
            let (optimizer, state) = ulysses_training::load_sharded_optimizer_on_device::<B, _, RunState>(location, &model, &*groups.world, device)?;
            (model, RankOptimizer::OnDevice(optimizer), state)
        }
    };
    let steps = all_gather_host_checked(&*groups.world, &[state.completed_steps as u64, read_at.map_or(u64::MAX, |step| step as u64)], "checkpoint steps")?;
    if let Some((rank, read)) = steps.iter().enumerate().find(|(_, s)| s[1] != u64::MAX && s[1] != state.completed_steps as u64).map(|(rank, s)| (rank, s[1])) {
        return Err(UlyssesError::InvalidConfig(format!(
            "{}: the checkpoint moved from step {read} (when world rank {rank} read it) to step {} before it was loaded (the run that \
             wrote it was still going): resume again",
            location.display(),
            state.completed_steps
        )));
    }
    if steps.iter().any(|s| s[0] as usize != state.completed_steps) {
        let steps: Vec<u64> = steps.iter().map(|s| s[0]).collect();
        return Err(UlyssesError::InvalidConfig(format!(
            "the ranks loaded checkpoints of different steps {steps:?} from {}: every rank must read the same file \
             (a shared file system, or the same copy on every node)",
            location.display()
        )));
    }
    // Each rank read a replicated checkpoint on its own; a sharded load agrees on what the
    // ranks read and gathers one model for all (reading an 8B model to the host to compare
    // would cost 32 GB a rank).
    if matches!(optimizer, RankOptimizer::Replicated(_)) {
        check_parameters_identical(&model, &*groups.world)?;
    }
    if groups.world_rank() == 0 {
        tracing::info!(step = state.completed_steps, from = %location.display(), "resuming");
    }
    Ok((model, optimizer, state))
}

/// A sharded checkpoint's optimizer state and run state, with `model` set from its master
/// weights, or (ZeRO-3, which cuts its parts from them: `ShardedParameters::shard_from`)
/// left as it is, possibly lazy.
fn load_sharded<B: TrainBackend>(config: &TrainConfig, location: &Path, model: Decoder<B>, world: &dyn Communicator<B::Wire>) -> Result<(Decoder<B>, ShardedAdamW, RunState), UlyssesError> {
    if config.zero_stage == 3 {
        let (optimizer, state) = load_sharded_optimizer::<B, _, RunState>(location, &model, world)?;
        return Ok((model, optimizer, state));
    }
    load_sharded_training_checkpoint(location, model, world)
}

/// Refuses to resume a run whose model or data would differ; warns when only the schedule does.
pub fn check_resumable(config: &TrainConfig, saved: &RunState) -> Result<(), String> {
    // (setting, the checkpoint's value, this run's).
    let mut settings = vec![
        ("--seed".to_string(), saved.seed.to_string(), config.seed.to_string()),
        ("--batch-size".to_string(), saved.config.batch_size.to_string(), config.batch_size.to_string()),
        ("--seq-len".to_string(), saved.config.seq_len.to_string(), config.seq_len.to_string()),
        ("--pack".to_string(), saved.config.pack.to_string(), config.pack.to_string()),
        ("--freeze-embeddings".to_string(), saved.config.freeze_embeddings.to_string(), config.freeze_embeddings.to_string()),
        ("a sharded optimizer state (--offload-optimizer or --zero 3)".to_string(), saved.config.shards_optimizer().to_string(), config.shards_optimizer().to_string()),
    ];
    // An f32 setting as it was given (0.95, not the f64 0.949999988079071 JSON holds).
    fn shown(value: &serde_json::Value) -> String {
        match value.as_f64() {
            Some(number) if value.is_f64() && f64::from(number as f32) == number => (number as f32).to_string(),
            _ => value.to_string(),
        }
    }
    fn fields(value: &impl serde::Serialize) -> serde_json::Map<String, serde_json::Value> {
        match serde_json::to_value(value) {
            Ok(serde_json::Value::Object(fields)) => fields,
            _ => Default::default(),
        }
    }
    // The model's shape, and AdamW's settings: the replicated optimizer would take this run's
    // and the sharded one the checkpoint's, so neither may change.
    for (part, was, now) in [("model", fields(&saved.config.model), fields(&config.model)), ("optimizer", fields(&saved.config.optimizer), fields(&config.optimizer))] {
        // Compared as values; shown as given, or raw where two values apart show alike.
        for (name, value) in was.iter().filter(|(name, value)| now.get(*name) != Some(*value)) {
            let now = now.get(name);
            let (before, after) = (shown(value), now.map_or("-".into(), shown));
            let (before, after) = if before == after { (value.to_string(), now.map_or("-".into(), ToString::to_string)) } else { (before, after) };
            settings.push((format!("{part}.{name}"), before, after));
        }
    }
    if let Some((what, was, now)) = settings.iter().find(|(_, was, now)| was != now) {
        return Err(format!(
            "the checkpoint was written by a run with {what} {was}, this one has {now}; resuming would not continue that \
             run. Resume with the settings in its config.json (layout and gradient accumulation may change)"
        ));
    }
    if saved.completed_steps > config.steps {
        return Err(format!("the checkpoint has already taken {} steps, more than --steps {}", saved.completed_steps, config.steps));
    }
    // Every checkpoint this trainer writes has them equal: the data would go on elsewhere than
    // the steps (an edited or corrupt header; older ones carry no checksum).
    if saved.data_position != saved.completed_steps {
        return Err(format!(
            "the checkpoint's state is inconsistent: {} steps taken, but its data at batch {}: the file was edited or is corrupt. Use an \
             earlier checkpoint",
            saved.completed_steps, saved.data_position
        ));
    }
    // Given on purpose (the trainer takes the checkpoint's where they are not given).
    let schedule = |c: &TrainConfig| (c.steps, c.warmup_steps, c.lr_schedule, c.min_lr_ratio.to_bits(), c.learning_rate.to_bits(), c.max_grad_norm.map(f64::to_bits), c.precision, c.f32_head);
    if schedule(config) != schedule(&saved.config) {
        let note = "the learning-rate schedule (--steps, --warmup-steps, --lr-schedule, --min-lr-ratio, --learning-rate), the clipping (--max-grad-norm) or the precision \
                    (--precision, --f32-head) differs from the checkpoint's run: later losses will differ from an uninterrupted run";
        if first_time(note) {
            tracing::warn!("{note}");
        }
    }
    Ok(())
}

/// Whether this process says the run's notes (those of the run as a whole, not of a rank):
/// a run of many processes says them once, in world rank 0's.
static SAYS_RUN_NOTES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether this process says the run's notes ([`says_run_notes`]): false in every process of a
/// launched run but world rank 0's.
pub fn say_run_notes(here: bool) {
    SAYS_RUN_NOTES.store(here, std::sync::atomic::Ordering::Relaxed);
}

/// `what` with the device's `error`, and, where the device ran out of memory (CubeCL's CUDA
/// server as third_party/README.md patches it), the flags that lower what a step holds.
fn device_failure(what: &str, error: &dyn std::fmt::Display) -> String {
    let error = error.to_string();
    let hint = if error.contains("out of device memory") {
        "; lower what a step holds: --checkpoint-layers (with --offload-to-host, --tile-tokens N), a larger --sp, --zero 3 \
         --offload-optimizer, or ULYSSES_MEMORY_POOLS=exclusive (pools that reserve less); --check --device-memory GB plans it"
    } else {
        ""
    };
    format!("{what}: {error}{hint}")
}

/// Whether this process says the run's notes (see [`say_run_notes`]).
pub fn says_run_notes() -> bool {
    SAYS_RUN_NOTES.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether this process is to log `note` now: it says the run's notes and has not logged this
/// one yet ([`TrainConfig::validate`] runs before the model is built and again on each rank's
/// thread, and says its notes once).
fn first_time(note: &str) -> bool {
    if !says_run_notes() {
        return false;
    }
    static SAID: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut said = SAID.lock().unwrap_or_else(|p| p.into_inner());
    let new = !said.iter().any(|s| s == note);
    if new {
        said.push(note.to_string());
    }
    new
}

/// The test hooks of [`Faults`], applied between a step's backward and its all-reduce.
fn inject_faults<B: TrainBackend>(faults: &Faults, step: usize, rank: usize, model: &Decoder<B>, local: &mut LocalStep<B>) {
    if faults.nan_gradient == Some((step, rank)) {
        tracing::warn!(step, rank, "test hook: making this rank's embedding gradient NaN");
        let id = model.embedding.weight.id;
        if let Some(grad) = local.grads.remove::<B::InnerBackend, 2>(id) {
            local.grads.register::<B::InnerBackend, 2>(id, grad.mul_scalar(f32::NAN));
        }
    }
    kill_if_asked(faults, step, rank);
}

/// The test hook [`Faults::kill`]: kills this process if it is rank `rank` at step `step`.
fn kill_if_asked(faults: &Faults, step: usize, rank: usize) {
    if faults.kill == Some((step, rank)) {
        tracing::warn!(step, rank, "test hook: killing this process (SIGKILL) in this step");
        // SAFETY: kill(2) on our own pid; nothing after it runs.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}

/// The loss of `batch` (packing `documents`, if given; over its `targets`, if given): over the
/// SP group, or on world rank 0 alone when `eval_single_device` is set (`None` on the other
/// ranks).
pub fn evaluate_model<B>(
    config: &TrainConfig,
    model: &Decoder<B::InnerBackend>,
    batch: &[Vec<i64>],
    documents: Option<&[Vec<usize>]>,
    targets: Option<&[Vec<bool>]>,
    groups: &ParallelGroups<B::Wire>,
    device: &B::Device,
) -> Result<Option<TokenLoss>, UlyssesError>
where
    B: TrainBackend,
{
    let sharder = config.sharder();
    let forward = |tokens: Tensor<B::InnerBackend, 2, Int>, positions: &ShardPositions| match &config.layer_checkpointing {
        // As the step runs it, so that an evaluation fits where the step does (on one rank, its
        // token-wise parts in tiles of the same size over the whole sequence).
        Some(checkpointing) => {
            let tiles = eval_tiles(checkpointing, &tokens)?;
            layered_output(model, tokens, positions, tiles, |_| Ok(model.clone()))
        }
        None => Ok(model.lm_output(tokens, positions)),
    };
    if config.eval_single_device {
        let is_first = groups.world_rank() == 0;
        return is_first.then(|| evaluate_single_device(forward, batch, documents, targets, sharder.ignore_index, device)).transpose();
    }
    evaluate(forward, batch, documents, targets, &sharder, groups.sp_rank(), &*groups.sp, device).map(Some)
}

/// The tiles of an evaluation's token-wise parts: as the step's for a shard of `tokens`' length
/// (every rank's shard of one batch is as long).
fn eval_tiles<B: burn::tensor::backend::Backend>(checkpointing: &LayerCheckpointing, tokens: &Tensor<B, 2, Int>) -> Result<usize, UlyssesError> {
    checkpointing.tiles(tokens.dims()[1])
}

/// [`evaluate_model`] under ZeRO-3 (`model` holds placeholders, `parts` this rank's parts),
/// each layer's parameters gathered just before it runs and dropped after it, so no rank holds
/// the whole model ([`layered_output`]); with `eval_single_device` world rank 0 alone runs the
/// model over the whole batch so, the other ranks joining its gathers. Collective over the world.
fn evaluate_in_parts<B: TrainBackend>(
    config: &TrainConfig,
    model: &Decoder<B>,
    parts: &mut ShardedParameters<B>,
    batch: &[Vec<i64>],
    documents: Option<&[Vec<usize>]>,
    targets: Option<&[Vec<bool>]>,
    groups: &ParallelGroups<B::Wire>,
    device: &B::Device,
) -> Result<Option<TokenLoss>, UlyssesError> {
    let Some(checkpointing) = &config.layer_checkpointing else { unreachable!("TrainConfig::validate: ZeRO-3 runs on layer checkpointing") };
    let mut gathers = parts.over(&*groups.world);
    let placeholders = model.valid();
    let forward = |tokens: Tensor<B::InnerBackend, 2, Int>, positions: &ShardPositions| {
        let tiles = eval_tiles(checkpointing, &tokens)?;
        layered_output(&placeholders, tokens, positions, tiles, |group| gathers.gather(model, group).map(|gathered| gathered.valid()))
    };
    if config.eval_single_device {
        if groups.world_rank() == 0 {
            return evaluate_single_device(forward, batch, documents, targets, config.sharder().ignore_index, device).map(Some);
        }
        drop(forward);
        join_layered_output_gathers(model, |group| gathers.gather(model, group).map(drop))?;
        return Ok(None);
    }
    evaluate(forward, batch, documents, targets, &config.sharder(), groups.sp_rank(), &*groups.sp, device).map(Some)
}

/// The loss of `model` over `sequences` (a whole file; each packing the documents of lengths
/// `documents[i]`, if given; over its `targets[i]`, if given), `batch_size` at a time: DP replica `r` evaluates batches `r`,
/// `r + dp`, ..., each over its SP group, and the world adds them up. Every rank returns the
/// same.
pub fn evaluate_sequences<B: TrainBackend>(
    config: &TrainConfig,
    model: Decoder<B>,
    sequences: &[Vec<i64>],
    documents: Option<&[Vec<usize>]>,
    targets: Option<&[Vec<bool>]>,
    groups: &ParallelGroups<B::Wire>,
    device: &B::Device,
) -> Result<TokenLoss, UlyssesError> {
    let config = config.clone().with_eval_single_device(false);
    let model = model.with_compute_dtype(config.precision.compute_dtype::<B>(device)?).with_f32_head(config.f32_head).valid();
    let evaluate_batch = |batch: &[Vec<i64>], documents: Option<&[Vec<usize>]>, targets: Option<&[Vec<bool>]>| {
        evaluate_model::<B>(&config, &model, batch, documents, targets, groups, device)
    };
    Ok(evaluate_batches(&config, config.batch_size, sequences, documents, targets, groups, false, evaluate_batch)?.expect("summed over the world"))
}

/// The held-out loss (token-averaged) of `sequences` (with their `documents` and `targets`) on
/// `model` after step `step`, to show where this rank reports it: `None` on other ranks, or
/// where the batch has no target (prompts alone). With ZeRO-3's `parts`, every rank joins each
/// batch's gathers (lockstep). Collective; an error names the step.
#[allow(clippy::too_many_arguments)]
fn evaluate_held_out<B: TrainBackend>(
    step: usize,
    config: &TrainConfig,
    model: &Decoder<B>,
    parts: Option<&mut ShardedParameters<B>>,
    sequences: &[Vec<i64>],
    documents: Option<&[Vec<usize>]>,
    targets: Option<&[Vec<bool>]>,
    groups: &ParallelGroups<B::Wire>,
    device: &B::Device,
) -> Result<Option<f64>, UlyssesError> {
    let loss = match parts {
        Some(parts) => evaluate_batches(config, config.micro_batch_rows(), sequences, documents, targets, groups, true, |batch, documents, targets| {
            evaluate_in_parts::<B>(config, model, parts, batch, documents, targets, groups, device)
        }),
        None => {
            let valid = model.valid();
            evaluate_batches(config, config.micro_batch_rows(), sequences, documents, targets, groups, false, |batch, documents, targets| {
                evaluate_model::<B>(config, &valid, batch, documents, targets, groups, device)
            })
        }
    };
    Ok(loss.map_err(|e| e.at_step(step))?.filter(|loss| loss.tokens > 0).map(|loss| loss.mean()))
}

/// The loss over `sequences` (each packing the documents of lengths `documents[i]`, if given;
/// over its `targets[i]`, if given), `rows` at a time (the sums do not depend on it), each batch through
/// `evaluate_batch` over the rank's SP group: DP replica `r` evaluates batches `r`, `r + dp`,
/// ..., and the world adds the groups' sums up, so every rank returns the same. Under ZeRO-3
/// (`lockstep`) every rank joins each batch's parameter gathers: a replica left without a
/// batch in the last round evaluates the first again and drops it. With `eval_single_device`,
/// every rank goes through every batch (world rank 0 evaluates them, the others join its
/// gathers) and rank 0 alone returns the sum.
#[allow(clippy::too_many_arguments)]
fn evaluate_batches<W: burn::tensor::backend::Backend>(
    config: &TrainConfig,
    rows: usize,
    sequences: &[Vec<i64>],
    documents: Option<&[Vec<usize>]>,
    targets: Option<&[Vec<bool>]>,
    groups: &ParallelGroups<W>,
    lockstep: bool,
    mut evaluate_batch: impl FnMut(&[Vec<i64>], Option<&[Vec<usize>]>, Option<&[Vec<bool>]>) -> Result<Option<TokenLoss>, UlyssesError>,
) -> Result<Option<TokenLoss>, UlyssesError> {
    let batches = sequences.len().div_ceil(rows);
    let mut evaluate_at = |index: usize| {
        let range = index * rows..((index + 1) * rows).min(sequences.len());
        evaluate_batch(&sequences[range.clone()], documents.map(|d| &d[range.clone()]), targets.map(|t| &t[range]))
    };
    if config.eval_single_device {
        let mut total = None;
        for index in 0..batches {
            if let Some(loss) = evaluate_at(index)? {
                total = Some(loss.add(total.unwrap_or_default()));
            }
        }
        return Ok(total);
    }
    let (dp, replica) = (config.layout.dp_size, groups.dp_rank());
    let mut total = TokenLoss::default();
    for round in 0..batches.div_ceil(dp) {
        match round * dp + replica {
            index if index < batches => total = total.add(evaluate_at(index)?.expect("evaluated over the SP group")),
            _ if lockstep => drop(evaluate_at(0)?),
            _ => {}
        }
    }
    // Each SP group's ranks hold its sums; the group's first rank speaks for it.
    let speaks = u64::from(groups.sp_rank() == 0);
    let gathered = all_gather_host_checked(&*groups.world, &[total.sum.to_bits(), total.tokens as u64, speaks], "evaluation sums")?;
    Ok(Some(gathered.iter().filter(|rank| rank[2] == 1).fold(TokenLoss::default(), |sum, rank| sum.add(TokenLoss { sum: f64::from_bits(rank[0]), tokens: rank[1] as usize }))))
}

pub fn model_recorder() -> NamedMpkFileRecorder<FullPrecisionSettings> {
    NamedMpkFileRecorder::new()
}

/// Saves the model's parameters alone (for evaluation and inference); they do not depend on
/// the SP or DP size, so the file loads under any layout. Training checkpoints, which also
/// hold the optimizer and the position in the data, are written by [`train_rank`].
pub fn save_model<B: AutodiffBackend>(model: &Decoder<B>, path: &Path) -> Result<(), String> {
    write_model_record::<B, _>(path, model.clone().into_record().into_item::<FullPrecisionSettings>())
}

/// Writes a model's record `item` as [`model_recorder`] does (Burn's record of it in named
/// MessagePack, at `path` with the extension `mpk`), atomically: an earlier file stays whole
/// until the new one is, where Burn's recorder deletes it first.
fn write_model_record<B: AutodiffBackend, I: Serialize>(path: &Path, item: I) -> Result<(), String> {
    let path = path.with_extension(<NamedMpkFileRecorder<FullPrecisionSettings> as FileRecorder<B>>::file_extension());
    let record = BurnRecord::<I, B>::new::<NamedMpkFileRecorder<FullPrecisionSettings>>(item);
    if let Some(folder) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(folder).map_err(|e| format!("cannot create {} for the model: {e}", folder.display()))?;
    }
    write_atomically_with(&path, |file| rmp_serde::encode::write_named(file, &record).map_err(std::io::Error::other)).map_err(|e| format!("cannot save the model to {}: {e}", path.display()))
}

pub fn load_model<B: AutodiffBackend>(config: &DecoderConfig, path: &Path, device: &B::Device) -> Result<Decoder<B>, String> {
    config
        .init::<B>(device)
        .load_file(path, &model_recorder(), device)
        .map_err(|e| format!("cannot load the model {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    /// A device out of memory is said with the flags that lower what a step holds; another
    /// failure as it is.
    #[test]
    fn a_device_out_of_memory_names_the_flags_that_lower_a_steps_memory() {
        let oom = super::device_failure("the device failed finishing the step's work", &"out of device memory: 4294967296 bytes could not be allocated");
        assert!(oom.contains("4294967296 bytes") && oom.contains("--checkpoint-layers") && oom.contains("--zero 3"), "{oom}");
        let other = super::device_failure("the device failed finishing the step's work", &"an illegal address");
        assert_eq!(other, "the device failed finishing the step's work: an illegal address");
    }

    /// A checkpoint writer that panics ends the run with an error naming the write and the
    /// panic, not a panic of rank 0's thread.
    #[test]
    fn a_panicking_checkpoint_write_is_an_error() {
        let mut write = super::CheckpointWrite::default();
        write.begin(4, || panic!("a snapshot failed")).unwrap();
        let error = write.finish().expect_err("the write panicked").to_string();
        assert!(error.contains("step 4: checkpoint write: its writer panicked: a snapshot failed"), "{error}");
    }

    use super::{ParallelLayout, RunState, TrainConfig, check_resumable, first_time, host_threads_per_rank, refuse_f16_training};
    use burn::tensor::FloatDType;

    /// bf16 asked on a device that computes f16 instead is refused for training (no loss
    /// scaling), naming the way out; bf16 and f32 pass.
    #[test]
    fn training_in_f16_without_loss_scaling_is_refused() {
        let error = refuse_f16_training(FloatDType::F16, &"Vulkan(0)").unwrap_err().to_string();
        assert!(error.contains("has no bf16, only f16") && error.contains("needs loss scaling") && error.contains("--precision f32") && error.contains("Vulkan(0)"), "{error}");
        for dtype in [FloatDType::BF16, FloatDType::F32] {
            refuse_f16_training(dtype, &"Cuda(0)").expect("computes in bf16 or f32");
        }
    }

    /// A resume under other AdamW settings is refused (the replicated optimizer would take the
    /// new ones and the sharded one the checkpoint's); another --f32-head only warned about; a
    /// state whose data position is not its steps' refused.
    #[test]
    fn a_resume_under_other_optimizer_settings_is_refused() {
        let config = TrainConfig::small(ParallelLayout::new());
        let saved = RunState { completed_steps: 2, data_position: 2, seed: config.seed, config: config.clone(), data: None, next_batch_digest: None, decayed_every_parameter: false };
        check_resumable(&config, &saved).expect("the same settings");
        check_resumable(&config.clone().with_f32_head(true), &saved).expect("a precision change is warned about, not refused");
        let mut decayed = config.clone();
        decayed.optimizer = decayed.optimizer.with_weight_decay(0.5);
        let error = check_resumable(&decayed, &saved).unwrap_err();
        assert!(error.contains("optimizer.weight_decay 0.01,") && error.contains("this one has 0.5"), "{error}");
        // A header whose data position is not its steps' (edited, or corrupt without a checksum).
        let error = check_resumable(&config, &RunState { data_position: 7, ..saved }).unwrap_err();
        assert!(error.contains("2 steps taken, but its data at batch 7") && error.contains("Use an earlier checkpoint"), "{error}");
    }

    /// The schedules: a linear warm-up to the peak, then a cosine, a line or nothing towards
    /// `min_lr_ratio` of it where the steps end (Hugging Face's progress, (step − warm-up) /
    /// (steps − warm-up)); a config written before the schedule was a setting reads as the
    /// cosine to a tenth it ran.
    #[test]
    fn the_learning_rate_follows_its_schedule() {
        use super::LrSchedule;
        let config = TrainConfig::small(ParallelLayout::new()).with_steps(110).with_warmup_steps(10).with_learning_rate(1.0);
        let rates = |schedule, ratio| {
            let config = config.clone().with_lr_schedule(schedule).with_min_lr_ratio(ratio);
            [0, 9, 10, 60, 109].map(|step| config.learning_rate_at(step))
        };
        let close = |got: [f64; 5], want: [f64; 5]| got.iter().zip(want).all(|(g, w)| (g - w).abs() < 1e-12);
        let cosine = rates(LrSchedule::Cosine, 0.1);
        let last = 0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * 0.99).cos());
        assert!(close(cosine, [0.1, 1.0, 1.0, 0.55, last]), "{cosine:?}");
        let linear = rates(LrSchedule::Linear, 0.0);
        assert!(close(linear, [0.1, 1.0, 1.0, 0.5, 0.01]), "{linear:?}");
        let constant = rates(LrSchedule::Constant, 0.0);
        assert!(close(constant, [0.1, 1.0, 1.0, 1.0, 1.0]), "{constant:?}");
        let error = config.clone().with_min_lr_ratio(1.5).validate().unwrap_err();
        assert!(error.contains("min_lr_ratio (--min-lr-ratio)"), "{error}");
        let error = config.clone().with_warmup_steps(111).validate().unwrap_err();
        assert!(error.contains("--warmup-steps) 111 is past --steps 110"), "{error}");

        let state = RunState {
            completed_steps: 2,
            data_position: 2,
            seed: 1,
            config: config.clone().with_lr_schedule(LrSchedule::Linear),
            data: None,
            next_batch_digest: None,
            decayed_every_parameter: false,
        };
        let mut old = serde_json::to_value(&state).unwrap();
        let fields = old["config"].as_object_mut().unwrap();
        for name in super::SETTINGS_ADDED.into_iter().chain(["f32_head"]) {
            fields.remove(name).expect("a field of the config");
        }
        let read: RunState = serde_json::from_value(old.clone()).expect("the state of an earlier run reads");
        assert_eq!((read.config.lr_schedule, read.config.min_lr_ratio, read.config.steps), (LrSchedule::Cosine, 0.1, 110));
        // Nothing was sharded or offloaded; the head computed in f32, the layers' dtype here.
        assert!(!read.config.f32_head && !read.config.offload_optimizer && !read.config.offload_parameters && !read.config.optimizer_in_backward);
        assert_eq!(read.config.zero_stage, 0);
        // Under half precision, the head was f32 where the layers were not.
        old["config"]["precision"] = serde_json::to_value(super::Precision::Bf16).unwrap();
        assert!(serde_json::from_value::<RunState>(old.clone()).unwrap().config.f32_head, "an earlier half-precision run's head");
        // Its run decayed norms' gains too: a resume is told it will not.
        let note = read.resume_notes().expect("a note for a run that decayed every parameter");
        assert!(note.contains("decayed every parameter") && note.contains("weight decay (0.01)"), "{note}");
        let read: RunState = serde_json::from_value(serde_json::to_value(&state).unwrap()).unwrap();
        assert_eq!(read.config.lr_schedule, LrSchedule::Linear, "a stored setting is kept");
        assert_eq!(read.resume_notes(), None, "a run of this trainer decayed matrices alone");
        // A setting missing that every checkpoint has held is no earlier version's: refused.
        let mut damaged = serde_json::to_value(&state).unwrap();
        damaged["config"].as_object_mut().unwrap().remove("optimizer");
        assert!(serde_json::from_value::<RunState>(damaged).is_err(), "a state without its optimizer's settings read");
    }

    /// AdamW settings that cannot train are named by their flag: betas outside [0, 1), an
    /// epsilon of 0, a negative decay, or one that zeroes the parameters at the first step.
    #[test]
    fn adamw_settings_that_cannot_train_are_named_by_their_flag() {
        let config = TrainConfig::small(ParallelLayout::new());
        config.validate().expect("the defaults");
        let with = |adamw: burn::optim::AdamWConfig| TrainConfig { optimizer: adamw, ..config.clone() }.validate().err().unwrap_or_default();
        let adamw = || config.optimizer.clone();
        assert!(with(adamw().with_beta_2(1.0)).contains("beta_2 (--adam-beta2) must be at least 0 and below 1, got 1"));
        assert!(with(adamw().with_beta_1(-0.1)).contains("beta_1 (--adam-beta1)"));
        assert!(with(adamw().with_epsilon(0.0)).contains("epsilon (--adam-epsilon) must be a finite number above 0"));
        assert!(with(adamw().with_weight_decay(-0.01)).contains("weight_decay (--weight-decay) must be 0 or more"));
        assert!(with(adamw().with_weight_decay(f32::NAN)).contains("--weight-decay"));
        // 3e-3 × 400 ≥ 1: every parameter would become 0 or flip its sign at the first step.
        assert!(with(adamw().with_weight_decay(400.0)).contains("below 1 / learning rate (each step") && with(adamw().with_weight_decay(400.0)).contains("(1 / learning rate = 333."));
        assert_eq!(with(adamw().with_weight_decay(0.1).with_beta_2(0.95).with_epsilon(1e-6)), "");
    }

    /// Sizes each within its bound whose product is past any machine (and would wrap the
    /// memory plan's u64 products) are refused by name; a million-token step of a 70B's widths
    /// is not.
    #[test]
    fn an_activation_past_any_machine_is_refused() {
        let config = TrainConfig::small(ParallelLayout::new());
        let mut huge = config.clone().with_batch_size(1 << 20).with_seq_len(1 << 31);
        huge.model.d_model = 4096;
        let error = huge.validate().unwrap_err();
        assert!(error.contains("batch_size × seq_len × the widest layer (1048576 × 2147483648 × 4096)") && error.contains("--seq-len"), "{error}");
        let mut long = config.with_seq_len(1 << 20);
        long.model.ffn_hidden = 28672;
        long.validate().expect("a million tokens of a 70B's MLP");
    }

    /// A model record written a layer at a time asks for each block in order as the writer
    /// reaches it and stops asking where the write fails, so that `TrainedModel::save` knows
    /// which layers rank 0 still has to gather for the other ranks.
    #[test]
    fn a_record_written_a_layer_at_a_time_stops_asking_where_the_write_fails() {
        use burn::record::FullPrecisionSettings;
        use std::io::Write;
        type B = burn::backend::Autodiff<burn::backend::NdArray>;
        /// Takes `left` bytes, then fails.
        struct Full {
            left: usize,
        }
        impl Write for Full {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                let taken = bytes.len().min(self.left);
                self.left -= taken;
                if taken == 0 && !bytes.is_empty() { Err(std::io::Error::other("the disk is full")) } else { Ok(taken) }
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let model = ulysses_models::DecoderConfig::new(32).with_d_model(32).with_n_layers(4).with_n_heads(4).with_n_kv_heads(2).with_ffn_hidden(64).init::<B>(&Default::default());
        let write = |left: usize| {
            let mut asked = Vec::new();
            let item = ulysses_models::Decoder::record_item_by_layers::<FullPrecisionSettings, _>(model.clone(), |layer| {
                asked.push(layer);
                Ok(model.clone())
            });
            let written = rmp_serde::encode::write_named(&mut Full { left }, &item).map_err(|e| e.to_string());
            drop(item);
            (written, asked)
        };
        let (whole, asked) = write(usize::MAX);
        assert_eq!((whole, asked), (Ok(()), vec![0, 1, 2, 3]), "a write that ends asks for every block once, in order");
        let (failed, asked) = write(std::mem::size_of::<f32>() * 32 * 32 * 6);
        assert!(failed.is_err(), "a write into a full disk: {failed:?}");
        assert!(!asked.is_empty() && asked.len() < 4 && asked.iter().copied().eq(0..asked.len()), "blocks asked for by a write that failed part way: {asked:?}");
    }

    /// `validate` runs in `main` and again on each rank's thread; its notes are logged the
    /// first time alone (each rank's thread repeated them before).
    #[test]
    fn validate_logs_a_note_once_a_process() {
        let mut config = TrainConfig::small(ParallelLayout::new().with_sp_size(2));
        config.seq_len = 63;
        let note = "seq_len 63 is not a multiple of 2: every batch is padded by 1 token(s); a multiple of 2 wastes nothing";
        for _ in 0..3 {
            config.validate().unwrap();
            assert!(!first_time(note), "validate has not logged the padding note, or would log it again");
        }
        // A zigzag ring pads to twice the SP degree, and says so (it named sp's multiple).
        let layout = ParallelLayout::new().with_sp_size(2).with_ring_size(2).with_ring_sharding(burn_ulysses::ring::RingSharding::Zigzag);
        let mut config = TrainConfig::small(layout);
        config.seq_len = 62;
        config.validate().unwrap();
        let note = "seq_len 62 is not a multiple of 4 (twice sp: --zigzag cuts each share in two): every batch is padded by 2 token(s); a multiple of 4 wastes nothing";
        assert!(!first_time(note), "validate has not logged the zigzag padding note");
    }

    /// Shapes that cannot train are named before any work, with choices that can.
    #[test]
    fn an_odd_head_dimension_and_an_undividable_batch_are_named() {
        use burn_ulysses::ParallelLayout;
        let layout = ParallelLayout::new().with_sp_size(2);
        let mut odd = super::TrainConfig::small(layout);
        odd.model = odd.model.clone().with_d_model(6).with_n_heads(2).with_n_kv_heads(2);
        let error = odd.validate().unwrap_err();
        assert!(error.contains("head dimension 3 (--d-model 6 / --heads 2) is odd"), "{error}");
        // A checkpoint's own head_dim: no quotient asked for (hidden 1000, 12 heads of 64).
        let mut explicit = super::TrainConfig::small(layout);
        explicit.model = explicit.model.clone().with_d_model(1000).with_n_heads(12).with_n_kv_heads(4).with_head_dim(Some(64));
        explicit.validate().unwrap_or_else(|e| panic!("a head_dim of 64 beside hidden 1000 and 12 heads is refused: {e}"));
        // More heads than --d-model has dimensions: the flags named, not a config.json.
        let mut narrow = super::TrainConfig::small(layout);
        narrow.model = narrow.model.clone().with_d_model(64).with_n_heads(128).with_n_kv_heads(128);
        let error = narrow.validate().unwrap_err();
        assert!(error.contains("--d-model") && !error.contains("config.json"), "{error}");
        // A config.json's head_dim past any model (n_heads × head_dim overflowed), or 0.
        for head_dim in [0, 1 << 17] {
            let mut wide = super::TrainConfig::small(layout);
            wide.model = wide.model.clone().with_head_dim(Some(head_dim));
            let error = wide.validate().unwrap_err();
            assert!(error.contains(&format!("head_dim {head_dim} (config.json) must be from 1 to")), "{error}");
        }
        // What the model itself refuses (DecoderConfig::validate), named before `init` panics.
        let mut unturned = super::TrainConfig::small(layout);
        unturned.model = unturned.model.clone().with_rope_theta(f64::NAN);
        let error = unturned.validate().unwrap_err();
        assert!(error.contains("the model: DecoderConfig::rope_theta must be a finite number above 0, got NaN"), "{error}");
        let dp3 = super::TrainConfig::small(ParallelLayout::new().with_sp_size(1).with_dp_size(3)).with_batch_size(2);
        let error = dp3.validate().unwrap_err();
        assert!(error.ends_with("= 3: use 3"), "no batch of 0 offered: {error}");
        let error = dp3.with_batch_size(4).validate().unwrap_err();
        assert!(error.ends_with("= 3: use 3 or 6"), "{error}");
    }

    /// Ranks started with different settings are refused on every rank, naming the setting;
    /// ranks that agree pass.
    #[test]
    fn ranks_started_with_different_settings_are_refused_naming_the_setting() {
        use burn::backend::NdArray;
        use burn_ulysses::ParallelLayout;
        let outcomes = burn_ulysses::comm::ThreadGroup::new(2).run(|rank| {
            let config = super::TrainConfig::small(ParallelLayout::new().with_sp_size(2)).with_eval_every(10 + rank.rank());
            super::check_settings_agree::<NdArray>(&config, &super::RunOptions::default(), &*rank.communicator())
        });
        for (rank, outcome) in outcomes.into_iter().enumerate() {
            let error = outcome.expect("no rank panicked").expect_err("different --eval-every refused").to_string();
            assert!(error.contains("world rank 1 was started with another eval_every than world rank 0"), "rank {rank}: {error}");
        }
        let outcomes = burn_ulysses::comm::ThreadGroup::new(2).run(|rank| {
            let options = super::RunOptions { checkpoint_every: 5, ranks_on_this_host: 1 + rank.rank(), ..Default::default() };
            super::check_settings_agree::<NdArray>(&super::TrainConfig::small(ParallelLayout::new().with_sp_size(2)), &options, &*rank.communicator())
        });
        assert!(outcomes.into_iter().all(|outcome| outcome.expect("no rank panicked").is_ok()), "agreeing ranks refused");
    }

    /// `--save-hf`'s dtype: the asked or the checkpoint's own where the model is the f32
    /// masters; where it is a bf16 compute copy, bf16 whatever the checkpoint's (an f16 one
    /// was rounded twice), and a wider one asked for refused, naming the fix.
    #[test]
    fn save_hf_exports_a_compute_copy_in_its_own_dtype_alone() {
        use burn::tensor::{DType, FloatDType};
        assert_eq!(super::save_hf_dtype(Some(DType::F32), DType::BF16, None), Ok(DType::F32));
        assert_eq!(super::save_hf_dtype(None, DType::F16, None), Ok(DType::F16));
        assert_eq!(super::save_hf_dtype(None, DType::F16, Some(FloatDType::BF16)), Ok(DType::BF16));
        assert_eq!(super::save_hf_dtype(None, DType::F32, Some(FloatDType::BF16)), Ok(DType::BF16));
        assert_eq!(super::save_hf_dtype(Some(DType::BF16), DType::F32, Some(FloatDType::BF16)), Ok(DType::BF16));
        let error = super::save_hf_dtype(Some(DType::F32), DType::F32, Some(FloatDType::BF16)).unwrap_err();
        assert!(error.contains("--save-hf-dtype F32: this run exports its BF16 compute copy") && error.contains("--precision f32"), "{error}");
    }

    /// A checkpoint that moved on after the caller read it (its run still going, which wrote
    /// step 2 where the caller read step 1) is refused, naming both steps, rather than resumed
    /// with the steps between missing from what the caller shows; read at its step, it resumes.
    #[test]
    fn a_checkpoint_that_moved_on_since_it_was_read_is_refused() {
        use burn::backend::{Autodiff, NdArray};
        use burn_ulysses::{ParallelGroups, ParallelLayout, UlyssesBackend};
        type B = UlyssesBackend<Autodiff<NdArray>>;
        struct Counting;
        impl super::StepData for Counting {
            fn train_batch(&self, step: usize) -> Vec<Vec<i64>> {
                (0..2).map(|row| (0..8).map(|t| ((step * 3 + row * 5 + t) % 256) as i64).collect()).collect()
            }
            fn eval_batch(&self) -> Option<Vec<Vec<i64>>> {
                None
            }
        }
        let dir = std::env::temp_dir().join(format!("ulysses-moved-on-{}", std::process::id()));
        let mut config = super::TrainConfig::small(ParallelLayout::new()).with_steps(3).with_warmup_steps(1).with_batch_size(2).with_seq_len(8).with_eval_every(0);
        config.model = config.model.clone().with_d_model(16).with_n_layers(1).with_n_heads(2).with_n_kv_heads(2).with_ffn_hidden(32);
        let run = |options: &(dyn Fn() -> super::RunOptions<'static> + Sync)| {
            let outcome = burn_ulysses::comm::ThreadGroup::new(1).run(|rank| {
                let groups: ParallelGroups<NdArray> = ParallelGroups::new(rank.communicator(), ParallelLayout::new()).unwrap();
                let device = Default::default();
                super::train_rank::<B>(&config, config.model.init::<B>(&device), &Counting, &groups, &device, options()).map(|_| ()).map_err(|e| e.to_string())
            });
            outcome.into_iter().next().unwrap().unwrap_or_else(|panic| panic!("{panic}"))
        };
        run(&|| super::RunOptions { checkpoint_dir: Some(dir.clone()), checkpoint_every: 1, stop_after: Some(2), ..Default::default() }).unwrap();
        let error = run(&|| super::RunOptions { resume: Some(dir.clone()), resumed_at: Some(1), ..Default::default() }).unwrap_err();
        assert!(error.contains("the checkpoint moved from step 1 (when world rank 0 read it) to step 2 before it was loaded"), "{error}");
        run(&|| super::RunOptions { resume: Some(dir.clone()), resumed_at: Some(2), ..Default::default() }).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Ranks of one host take their turns to load a checkpoint one at a time: never two
    /// inside at once, however many wait; another checkpoint's turns are its own.
    #[test]
    fn a_hosts_ranks_load_a_checkpoint_one_at_a_time() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let location = std::env::temp_dir().join(format!("ulysses-turns-{}", std::process::id())).join("checkpoint.ulysses");
        let (inside, most) = (AtomicUsize::new(0), AtomicUsize::new(0));
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    let turn = super::HostTurn::take(&location);
                    assert!(turn._lock.is_some(), "no lock taken");
                    most.fetch_max(inside.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
                    // Another checkpoint's turn is free meanwhile.
                    assert!(super::HostTurn::take(&location.with_file_name("other.ulysses"))._lock.is_some());
                    std::thread::sleep(std::time::Duration::from_millis(30));
                    inside.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        assert_eq!(most.load(Ordering::SeqCst), 1, "two ranks loaded at once");
        // Turns only where the loads at once (twice the file each) would not fit the host.
        std::fs::create_dir_all(location.parent().unwrap()).unwrap();
        std::fs::write(&location, vec![0u8; 1000]).unwrap();
        let needed = |ranks: usize, available: Option<u64>| super::HostTurn::needed(&location, ranks, available, false);
        assert!(needed(8, Some(15_999)) && !needed(8, Some(16_000)) && !needed(1, Some(10)) && !needed(8, None));
        assert!(!super::HostTurn::needed(&location.with_file_name("missing.ulysses"), 8, Some(1), false));
        let _ = std::fs::remove_dir_all(location.parent().unwrap());
    }

    /// A host's cores shared among its ranks' host optimizers: 8 GPUs' ranks on 16 cores take
    /// 2 each (not 16 each, 128 threads on 16 cores); never none.
    #[test]
    fn the_host_optimizer_takes_its_share_of_the_cores() {
        for (cores, ranks, each) in [(16, 8, 2), (16, 1, 16), (2, 4, 1), (3, 2, 1), (8, 0, 8)] {
            assert_eq!(host_threads_per_rank(cores, ranks, None).get(), each, "{cores} cores, {ranks} ranks");
        }
        // srun --cpus-per-task=12 with 4 tasks a node: bound to its 12 cores, or seeing the
        // node's 48 (--cpu-bind=none), each rank takes its 12, not 3. Seeing 8 (a step of 8
        // cores, 12 the batch script's), or 20, the share: 2, or 5.
        for (cores, own, each) in [(12, 12, 12), (48, 12, 12), (8, 12, 2), (20, 12, 5), (4, 0, 1)] {
            assert_eq!(host_threads_per_rank(cores, 4, Some(own)).get(), each, "{cores} cores, {own} its own");
        }
    }
}
