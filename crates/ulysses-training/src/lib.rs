//! Training any Burn model with sequence parallelism (SP) and data parallelism (DP) over
//! `burn_ulysses::UlyssesBackend`, equal to one device. The decorator crate (`burn-ulysses`)
//! makes attention sequence parallel; this crate is the rest of a training step around it.
//!
//! One optimizer step on one rank ([`train_step`]) has two halves, also callable on their
//! own (to inspect or change the local gradients in between):
//!
//! [`backward_step`]:
//! 1. **shard** each of its micro-batches ([`SequenceSharder`]): labels shifted, padded,
//!    this rank's slice of every sequence with its global positions;
//! 2. **count** the valid (non-ignored) labels of the whole step over every rank, so the loss
//!    is averaged over tokens, not over ranks or micro-batches;
//! 3. **forward/backward** each micro-batch with loss `Σ_shard CE / max(valid_tokens, 1)`.
//!    A rank whose shard holds only ignored labels still runs both passes: its attention
//!    exchanges are collectives that its peers wait for.
//!
//! [`apply_step`]:
//! 4. **check** every rank's loss and local gradients: a NaN or an infinity anywhere stops
//!    the step, on every rank, before the optimizer touches the parameters;
//! 5. **all-reduce** the gradients over the world group (sum), once: SP and DP ranks alike
//!    contribute a part of the global token-averaged loss, so one reduction over all of them
//!    gives every rank the whole gradient;
//! 6. **step** the optimizer; every rank takes the same step, so parameters stay identical
//!    ([`check_parameters_identical`] verifies it on request).
//!
//! A step with no valid label on any rank stops after 4: it has nothing to learn from, so the
//! parameters and the optimizer's state stay as they were (`StepReport`'s `valid_tokens` is 0).
//!
//! [`apply_step_sharded`] does 5 and 6 as ZeRO does, with the optimizer's state sharded over
//! the ranks and updated on the host ([`ShardedAdamW`]).

use std::marker::PhantomData;

use burn::{
    module::{AutodiffModule, Module, ModuleMapper, Param},
    optim::{GradientsParams, Optimizer},
    tensor::{
        ElementConversion, Int, Tensor,
        backend::{AutodiffBackend, Backend},
    },
};

mod backend;
pub mod checkpoint;
mod gradients;
mod layers;
mod loss;
mod matrix_decay;
mod panics;
mod parameters;
mod zero;
#[cfg(test)]
mod host_adamw_tests;

pub use backend::TrainBackend;
pub use layers::{PROGRESS_TARGET, EmbeddingLookup, LayerCheckpointing, LayerParameters, LayeredLm, ParameterGroup, Piece, WholeParameters, checkpointed_backward, checkpointed_backward_with, join_layered_output_gathers, layered_output};
pub use zero::{DeviceShardedAdamW, GradParts, OptimizerPlace, PartChecks, PartOptimizer, PartsFrom, ShardedParameters, Zero3Step};
pub use matrix_decay::MatrixDecayAdamW;
pub use panics::{catch_model_failure, quiet_caught_panics};
pub use parameters::{FloatParameter, float_parameters, parameter_elements, parameter_paths, parameter_shapes, take_lazy_flag, with_parameters_in};
pub use zero::{
    STATE_FOLDER_PREFIX, ShardedAdamW, ShardedState, adamw_settings, cast_master_part, check_folder_shared, host_adamw_config, load_sharded_optimizer, load_sharded_optimizer_on_device, load_sharded_training_checkpoint, remove_unnamed_state_folders, save_sharded_training_checkpoint,
    sharded_state_file, sharded_state_folder,
};
pub use ulysses_core::host_adamw::HostAdamWConfig;
pub use gradients::{
    GRADIENT_BUCKET_BYTES, agreed_gradient_norm, all_reduce_gradients, all_reduce_gradients_in_buckets, check_max_grad_norm, clip_gradient_norm, clip_with_norm,
    gradient_norm, read_loss_and_first_non_finite_gradient,
};
pub use loss::{
    LmOutput, OutputHead, chunked_linear_cross_entropy_sum, default_chunk_rows, linear_cross_entropy_sum, lm_loss_sum,
    lm_loss_sum_inference, masked_cross_entropy_sum,
};

use burn_ulysses::{
    ParallelGroups, UlyssesError,
    comm::{CommError, Communicator},
    data::{SequenceShard, SequenceSharder, ShardPositions, ShardTensors},
    primitive::{float_primitive, float_tensor},
};

/// A model that maps a shard of token ids to next-token logits.
pub trait CausalLm<B: AutodiffBackend>: AutodiffModule<B> {
    /// `tokens: [batch, seq]` at `positions` → `[batch, seq, vocab]`. When
    /// `positions.packed`, each row packs several documents and attention must stay inside
    /// each (`burn_ulysses::attention::attention_in_documents` with `positions.ids`).
    fn logits(&self, tokens: Tensor<B, 2, Int>, positions: &ShardPositions) -> Tensor<B, 3>;
    /// What training computes the loss from. The default is [`logits`](Self::logits). A
    /// model that returns [`LmOutput::Hidden`] (its last hidden states and output projection)
    /// gets a loss computed a chunk of rows at a time, which never holds all
    /// `tokens × vocab` logits: at long context with a large vocabulary they are the largest
    /// activation of the step.
    fn lm_output(&self, tokens: Tensor<B, 2, Int>, positions: &ShardPositions) -> LmOutput<B> {
        LmOutput::Logits(self.logits(tokens, positions))
    }
    /// Token ids must lie in `0..vocab_size()`.
    fn vocab_size(&self) -> usize;
    /// Training pads sequences at the end, which only causal attention leaves invisible to
    /// real tokens; [`train_step`] refuses a model that is not causal, and a step whose
    /// attention (through `UlyssesBackend`) looked both ways without a mask over padded
    /// sequences.
    fn is_causal(&self) -> bool;
}

/// What one optimizer step did, over all ranks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// Cross-entropy averaged over every valid label of the step, on every rank.
    pub loss: f64,
    /// Valid labels of the step over all ranks.
    pub valid_tokens: usize,
    /// Token positions processed over all ranks, padding included.
    pub processed_tokens: usize,
    /// The global L2 norm of the step's gradient (summed over ranks), before any clipping: rank
    /// 0's measure of it ([`agreed_gradient_norm`]), the same on every rank.
    pub grad_norm: f64,
    /// Whether any rank's process was asked to stop ([`request_stop`]) before this step's
    /// health check: the same on every rank, so that all can stop after this step.
    pub stop_requested: bool,
}

/// Set by [`request_stop`]; read by each step's health check.
static STOP_REQUESTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Asks this process's ranks to stop after the step under way: the next health check of any
/// `apply_step` carries it to every rank of the world ([`StepReport::stop_requested`]), so
/// that all stop after the same step, where each alone (a signal reaches ranks at different
/// moments) would leave the others waiting in a collective. Async-signal-safe: a SIGTERM or
/// SIGUSR1 handler may call it (the trainer's do).
pub fn request_stop() {
    STOP_REQUESTED.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Whether [`request_stop`] was called in this process (since [`clear_stop_request`]).
pub fn stop_was_requested() -> bool {
    STOP_REQUESTED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Forgets a [`request_stop`] that was acted on: a loop that stopped for it clears it, or the
/// next run in the process would stop after its first step (the trainer clears it as a run
/// returns: every rank of the process has read it in its last health check by then).
pub fn clear_stop_request() {
    STOP_REQUESTED.store(false, std::sync::atomic::Ordering::Relaxed);
}

impl StepReport {
    /// The report of a step with no target on any rank (every token a prompt's: under
    /// `--loss-on assistant`, a long conversation's piece before its answers). Such a step
    /// has nothing to learn from, its gradients are zero, and AdamW would still move every
    /// parameter by its momentum and weight decay: the `apply_step` functions leave the model
    /// and the optimizer's state as they were and report no loss and no gradient.
    fn without_targets<B: TrainBackend>(local: &LocalStep<B>, stop_requested: bool) -> Self {
        Self { loss: 0.0, valid_tokens: 0, processed_tokens: local.processed_tokens, grad_norm: 0.0, stop_requested }
    }
}

/// One optimizer step's data on this rank.
#[derive(Debug, Clone, Copy)]
pub struct StepInput<'a> {
    /// The step's index in the run (named in errors).
    pub index: usize,
    pub learning_rate: f64,
    /// This DP rank's sequences for the step, one entry per gradient-accumulation
    /// micro-batch.
    pub micro_batches: &'a [Vec<Vec<i64>>],
    /// For packed data: per micro-batch, per sequence, the lengths of the documents packed
    /// into it ([`pack_documents`](burn_ulysses::data::pack_documents)). `None`: one document per
    /// sequence.
    pub documents: Option<&'a [Vec<Vec<usize>>]>,
    /// For supervised fine-tuning: per micro-batch, per sequence, whether each token is a
    /// target (trained on: an answer's tokens, not its prompt's;
    /// [`SequenceSharder::shard_targets`](burn_ulysses::data::SequenceSharder::shard_targets)).
    /// The loss is the mean over the targets alone, over every rank. `None`: every token.
    pub targets: Option<&'a [Vec<Vec<bool>>]>,
    /// Clip the summed gradient to this global L2 norm, with rank 0's measure of it
    /// ([`agreed_gradient_norm`], [`clip_with_norm`]); `None`: no clipping. The same on every
    /// rank (checked).
    pub max_grad_norm: Option<f64>,
}

/// This rank's half of a step: its gradients (not yet summed over ranks) and its part of the
/// loss. Returned by [`backward_step`], consumed by [`apply_step`].
pub struct LocalStep<B: TrainBackend> {
    /// Gradients of this rank's part of the token-averaged loss: in the parameters' dtype, but
    /// f32 where a step of two micro-batches or more summed a half-precision model's (and
    /// wherever a checkpointed step summed its pieces).
    pub grads: GradientsParams,
    /// This rank's part of the step's token-averaged loss, `[1]`, still on the device:
    /// [`apply_step`] reads it with the gradients' health check, the step's one read before
    /// the gradient sum ([`LocalStep::read_loss`] reads it alone).
    pub loss: Tensor<B::InnerBackend, 1>,
    /// Valid labels of the step over all ranks.
    pub valid_tokens: usize,
    /// Token positions processed over all ranks, padding included.
    pub processed_tokens: usize,
    /// Whether this rank's rows packed documents that the model's attention never took.
    pub(crate) ignored_documents: bool,
    /// Whether this rank's attention saw every key over sequences padded at their end.
    pub(crate) attended_padding: bool,
}

impl<B: TrainBackend> LocalStep<B> {
    /// The loss's value: a read from the device (a wait for everything queued).
    pub fn read_loss(&self) -> f64 {
        self.loss.clone().into_scalar().elem::<f64>()
    }
}

/// One optimizer step on this rank: [`backward_step`], then [`apply_step`].
pub fn train_step<B, M, O>(
    model: M,
    optimizer: &mut O,
    step: &StepInput,
    sharder: &SequenceSharder,
    groups: &ParallelGroups<B::Wire>,
    device: &B::Device,
) -> Result<(M, StepReport), UlyssesError>
where
    B: TrainBackend,
    M: CausalLm<B>,
    O: Optimizer<M, B>,
{
    let local = backward_step(&model, step, sharder, groups, device)?;
    apply_step(model, optimizer, step, local, groups)
}

/// Shards this rank's micro-batches, counts the step's labels over all ranks, and runs
/// forward and backward on each micro-batch. Collective: every rank of the world calls it.
pub fn backward_step<B, M>(
    model: &M,
    step: &StepInput,
    sharder: &SequenceSharder,
    groups: &ParallelGroups<B::Wire>,
    device: &B::Device,
) -> Result<LocalStep<B>, UlyssesError>
where
    B: TrainBackend,
    M: CausalLm<B>,
{
    backward_step_with(model, step, sharder, groups, Ok(()), |shard, weight, _| {
        model_failure_as_error(|| {
            let output = {
                // The model's forward alone, for the guard (`evaluate` says why); the token ids
                // uploaded before it, as no positions.
                let tokens = shard.tokens(device);
                let _positions = burn_ulysses::attention_guard::note_shard_positions(&shard.positions);
                model.lm_output(tokens, &shard.positions)
            };
            let shard_loss = lm_loss_sum(output, shard.labels(device), sharder.ignore_index) * weight;
            (shard_loss.clone().inner(), GradientsParams::from_grads(shard_loss.backward(), model))
        })
    })
}

/// [`backward_step`] with whole-layer activation checkpointing ([`LayerCheckpointing`]):
/// each layer keeps only its input and runs again in the backward, its token-wise parts in
/// sequence tiles when asked. The same loss and gradients; less memory, one more forward.
pub fn backward_step_checkpointed<B, M>(
    model: &M,
    step: &StepInput,
    sharder: &SequenceSharder,
    groups: &ParallelGroups<B::Wire>,
    device: &B::Device,
    checkpointing: &LayerCheckpointing,
) -> Result<LocalStep<B>, UlyssesError>
where
    B: TrainBackend,
    M: CausalLm<B> + LayeredLm<B>,
    M::InnerModule: LayeredLm<B::InnerBackend>,
{
    backward_step_layered(model, step, sharder, groups, device, checkpointing, &mut WholeParameters)
}

/// [`backward_step_checkpointed`] under ZeRO-3: each layer's parameters (the embedding's, the head's)
/// all-gathered from `parameters` just before its pieces run, its gradients reduce-scattered
/// into `parameters` as soon as they are complete ([`ShardedParameters`]). The returned
/// [`LocalStep`] holds no gradients; [`apply_step_zero3`] takes them from `parameters`.
pub fn backward_step_zero3<B, M>(
    model: &M,
    step: &StepInput,
    sharder: &SequenceSharder,
    groups: &ParallelGroups<B::Wire>,
    device: &B::Device,
    checkpointing: &LayerCheckpointing,
    parameters: &mut ShardedParameters<B>,
) -> Result<LocalStep<B>, UlyssesError>
where
    B: TrainBackend,
    M: CausalLm<B> + LayeredLm<B>,
    M::InnerModule: LayeredLm<B::InnerBackend>,
{
    // Parts a failed step left behind are not this step's.
    drop(parameters.take_gradient_parts());
    parameters.check_update_in_backward_of(step, "begun in its backward")?;
    let local = backward_step_layered(model, step, sharder, groups, device, checkpointing, &mut parameters.over(&*groups.world));
    if local.is_err() {
        // Its update in the backward has updated the groups it was given: the optimizer's
        // state is lost (said when it next settles).
        parameters.abandon_update_in_backward("failed in its backward");
    }
    local
}

/// The body of the checkpointed backward steps, each piece's parameters from `parameters`.
fn backward_step_layered<B, M>(
    model: &M,
    step: &StepInput,
    sharder: &SequenceSharder,
    groups: &ParallelGroups<B::Wire>,
    device: &B::Device,
    checkpointing: &LayerCheckpointing,
    parameters: &mut impl LayerParameters<B, M>,
) -> Result<LocalStep<B>, UlyssesError>
where
    B: TrainBackend,
    M: CausalLm<B> + LayeredLm<B>,
    M::InnerModule: LayeredLm<B::InnerBackend>,
{
    let report_progress = groups.world_rank() == 0 && tracing::enabled!(target: layers::PROGRESS_TARGET, tracing::Level::DEBUG);
    let mut micro_batch = 0;
    backward_step_with(model, step, sharder, groups, checkpointing.check(), |shard, weight, valid_tokens| {
        // Each micro-batch's own tiles, from its shard's length: over the step's shortest
        // shard, a short micro-batch beside a long one cut the long one into as few tiles as
        // the short one has tokens, each far past tile_tokens. The ranks of an SP group share
        // a micro-batch's shard length, so they run as many tiles (no tile runs a collective).
        let tiles = checkpointing.tiles(shard.local_len)?;
        parameters.step_targets(valid_tokens);
        let this_micro_batch = micro_batch;
        micro_batch += 1;
        if report_progress {
            tracing::debug!(
                target: layers::PROGRESS_TARGET,
                "step {} (micro-batch {this_micro_batch}): {} tokens a rank, the token-wise parts in {tiles} tile(s)",
                step.index,
                shard.batch * shard.local_len
            );
        }
        model_failure_as_error(|| {
            let (tokens, labels) = (shard.tokens(device), shard.labels(device));
            let mut parameters = layers::ReportProgress::new(&mut *parameters, report_progress, step.index, this_micro_batch, device.clone());
            layers::checkpointed_backward_with(model, tokens, labels, &shard.positions, weight, sharder.ignore_index, checkpointing, tiles, &mut parameters, |_| {})
        })?
    })
}

/// The body of both backward steps; `shard_backward` gives one shard's weighted loss and
/// gradients, given the step's target tokens over every rank. `settings` is the caller's check
/// of its own settings, refused (as the inputs are) only after every rank has joined the first
/// collective: a rank that returned before it would leave the others waiting there.
fn backward_step_with<B, M>(
    model: &M,
    step: &StepInput,
    sharder: &SequenceSharder,
    groups: &ParallelGroups<B::Wire>,
    settings: Result<(), UlyssesError>,
    mut shard_backward: impl FnMut(&SequenceShard, f64, usize) -> Result<(Tensor<B::InnerBackend, 1>, GradientsParams), UlyssesError>,
) -> Result<LocalStep<B>, UlyssesError>
where
    B: TrainBackend,
    M: CausalLm<B>,
{
    // A step begins: the table the last one embedded with may be another model's.
    burn_ulysses::attention_guard::forget_embedded_table();
    let checked = settings
        .and_then(|()| check_step_inputs::<B, M>(model, step.micro_batches, sharder, groups))
        .and_then(|()| check_step_annotations(step, sharder))
        .and_then(|()| check_step_settings(step.index, step.learning_rate, step.max_grad_norm));
    let sp_rank = groups.sp_rank();
    let shards: Vec<_> = match &checked {
        Ok(()) => step
            .micro_batches
            .iter()
            .enumerate()
            .map(|(m, batch)| sharder.shard_targets(batch, step.documents.map(|d| &d[m][..]), step.targets.map(|t| &t[m][..]), sp_rank))
            .collect(),
        Err(_) => Vec::new(),
    };
    let local_valid: usize = shards.iter().map(|s| s.valid_tokens).sum();
    let local_processed: usize = shards.iter().map(|s| s.batch * s.local_len).sum();
    // One host collective for the token counts, which every rank joins,
    // its inputs refused or not, so that each learns whether every rank can go on and all run
    // the same number of micro-batches (under ZeRO-3 each is a round of world collectives).
    // And the batch's digest: the ranks of an SP group cut the same sequences.
    // Once a model a rank thread, the parameters it starts from: ranks built from other seeds,
    // and not broadcast, would each step their own model with the summed gradients, without an
    // error. A model is told by its first parameter's id (an optimizer's step keeps it; a model
    // built anew has another, a record loaded the record's), so a second model trained on the
    // thread is compared too. Compared where every rank brings one: where some do and some do
    // not (a rank that compared this model before), none compares this step, and every rank
    // brings one at the next.
    let compared = (first_parameter_id(model), groups.world.size());
    let fingerprint = (groups.world.size() > 1 && PARAMETERS_COMPARED.get() != Some(compared) && checked.is_ok()).then(|| parameters_fingerprint(model)).flatten();
    let mine = [
        checked.is_ok() as u64,
        step.micro_batches.len() as u64,
        local_valid as u64,
        local_processed as u64,
        step_digest(step),
        fingerprint.unwrap_or(0),
        fingerprint.is_some() as u64,
    ];
    // Checked: a rank in another collective (another schedule's flags) is named, not an index past a shorter row.
    let gathered = burn_ulysses::comm::all_gather_host_checked(&*groups.world, &mine, "the step's inputs");
    checked?;
    let gathered = gathered?;
    let over_ranks = |i: usize| gathered.iter().map(move |v| v[i] as usize);
    if let Some(rank) = over_ranks(0).position(|ok| ok == 0) {
        return Err(UlyssesError::InvalidConfig(format!("rank {rank} refused its inputs for step {} (its error says why)", step.index)));
    }
    if over_ranks(1).any(|count| count != step.micro_batches.len()) {
        return Err(UlyssesError::InvalidConfig(format!(
            "the ranks have different numbers of micro-batches for step {} ({:?}, in world rank order): every rank must accumulate as many",
            step.index,
            over_ranks(1).collect::<Vec<_>>()
        )));
    }
    // Every rank checks every group, so all stop alike. An SP group's first rank is the one
    // with the same DP coordinate and SP rank 0.
    let first_of_group = |rank: usize| rank - groups.layout.coordinates(rank).1;
    if let Some(rank) = (0..gathered.len()).find(|&r| gathered[r][4] != gathered[first_of_group(r)][4]) {
        return Err(UlyssesError::InvalidConfig(format!(
            "world ranks {} and {rank} of one SP group (DP replica {}) were given different sequences for step {}: every rank of \
             an SP group passes its replica's whole micro-batches and cuts its own shard (slice the data by dp_rank, not by world rank)",
            first_of_group(rank),
            groups.layout.coordinates(rank).0,
            step.index
        )));
    }
    if gathered.iter().any(|v| v[6] == 1) && !gathered.iter().all(|v| v[6] == 1) {
        PARAMETERS_COMPARED.set(None);
    }
    if gathered.iter().all(|v| v[6] == 1) {
        PARAMETERS_COMPARED.set(Some(compared));
        if let Some(&rank) = ranks_differing_from_rank_0(&gathered, 5).first() {
            return Err(UlyssesError::InvalidConfig(format!(
                "world ranks 0 and {rank} start step {} from different parameters: build the model from one seed on every rank, or call \
                 ulysses_training::broadcast_parameters (rank 0's) before the first step",
                step.index
            )));
        }
    }
    let (valid_tokens, processed_tokens) = (over_ranks(2).sum::<usize>(), over_ranks(3).sum::<usize>());
    // Guard: a step whose labels are all ignored contributes zero loss, not NaN.
    let weight = 1.0 / valid_tokens.max(1) as f64;

    // A half-precision compute copy's gradients (the optimizer's on the host) are summed over
    // micro-batches in f32, as a checkpointed step's pieces are: a bf16 sum keeps 8 bits of
    // each. One micro-batch's stay as they are: the optimizer casts them itself.
    let mut sums = gradients::GradientSums::new(shards.len() > 1);
    // Summed on the device: a read per micro-batch would wait for each one's work.
    let mut loss: Option<Tensor<B::InnerBackend, 1>> = None;
    let (exchanges_before, context_before) = (groups.attention_exchanges(), context_exchanges::<B::Wire>());
    let document_calls_before = burn_ulysses::attention::calls_with_documents();
    let calls_seeing_every_key_before = burn_ulysses::attention::calls_seeing_every_key();
    for shard in &shards {
        let (shard_loss, grads) = shard_backward(shard, weight, valid_tokens)?;
        loss = Some(match loss.take() {
            Some(sum) => sum + shard_loss,
            None => shard_loss,
        });
        sums.add(model, grads);
    }
    let loss = loss.ok_or_else(|| UlyssesError::InvalidConfig("a step without micro-batches: give at least one".into()))?;
    let exchanges = groups.attention_exchanges() - exchanges_before;
    if groups.layout.sp_size > 1 && exchanges == 0 {
        // Attention exchanged, through the context entered on this thread, but not through
        // this step's SP group: a context entered with another communicator of as many ranks
        // (the world's at DP 1; at DP > 1 attention refuses its shard first:
        // `ShardOutsideItsGroup`).
        if context_before.zip(context_exchanges::<B::Wire>()).is_some_and(|(before, after)| after > before) {
            return Err(UlyssesError::InvalidConfig(format!(
                "step {}: the model's attention exchanged through the rank context entered on this thread, but not through this \
                 step's SP group (sp_size {}): the context was entered with another communicator (the world's: \
                 `enter_thread(rank.communicator())`?). Enter the groups' own: \
                 `burn_ulysses::context::enter(RankScope::Thread, groups.rank_context(UlyssesConfig::new()))`",
                step.index, groups.layout.sp_size
            )));
        }
        return Err(UlyssesError::NotSequenceParallel { sp_size: groups.layout.sp_size });
    }
    // Rows that pack documents, and a model whose attention never took them: under SP each
    // document attended to the ones before it (at SP = 1 a model may keep them apart by a mask
    // of its own). Refused by every rank at the step's health check (a collective).
    let packs = step.documents.is_some_and(|documents| documents.iter().flatten().any(|lengths| lengths.len() > 1));
    let ignored_documents = groups.layout.sp_size > 1 && packs && burn_ulysses::attention::calls_with_documents() == document_calls_before;
    // A model that says it is causal (`CausalLm::is_causal`) and attended both ways without a
    // mask over sequences padded at the end: real tokens attended to the padding (at any SP
    // degree; one device on the unpadded sequences does not). Refused by every rank at the
    // step's health check.
    let padded = step.micro_batches.iter().any(|batch| batch.iter().any(|sequence| sequence.len() < sharder.padded_len(batch)));
    let attended_padding = padded && burn_ulysses::attention::calls_seeing_every_key() > calls_seeing_every_key_before;
    Ok(LocalStep { grads: sums.into_grads(), loss, valid_tokens, processed_tokens, ignored_documents, attended_padding })
}

/// Checks every rank's loss and gradients, sums the gradients over the world and steps the
/// optimizer. Collective: every rank of the world calls it. On a NaN or an infinity on any
/// rank, every rank returns [`UlyssesError::NonFinite`] naming the step and the ranks, and
/// the parameters are left as they were.
pub fn apply_step<B, M, O>(
    model: M,
    optimizer: &mut O,
    step: &StepInput,
    local: LocalStep<B>,
    groups: &ParallelGroups<B::Wire>,
) -> Result<(M, StepReport), UlyssesError>
where
    B: TrainBackend,
    M: CausalLm<B>,
    O: Optimizer<M, B>,
{
    let (losses, stop_requested) = step_losses_if_healthy(&model, &local, None, false, step, groups)?;
    if local.valid_tokens == 0 {
        return Ok((model, StepReport::without_targets(&local, stop_requested)));
    }
    let grads = all_reduce_gradients(&model, local.grads, &*groups.world)?;
    // Every rank holds the same sums now, but not always the same norm of them (a GPU's sum
    // is not bit-reproducible): every rank clips with, and reports, rank 0's.
    let grad_norm = agreed_gradient_norm(gradient_norm(&model, &grads), &*groups.world)?;
    // Finite gradients on every rank whose sum overflowed (the norm, summed in f64, is finite
    // wherever every element is): stopped before the optimizer, as a NaN on a rank is.
    if !grad_norm.is_finite() {
        return Err(sum_overflowed(step.index));
    }
    let grads = match step.max_grad_norm {
        Some(max_norm) => clip_with_norm(&model, grads, grad_norm, max_norm)?,
        None => grads,
    };
    // Outside the guard: an optimizer's own products (a batched Newton–Schulz over stacked
    // experts' weights) mix no tokens, but have attention's shapes.
    let model = {
        let _single_device = burn_ulysses::context::enter_single_device();
        optimizer.step(step.learning_rate, model, grads)
    };
    // Summed in rank order on every rank, so every rank reports the same bits.
    let loss = losses.iter().sum();
    Ok((model, StepReport { loss, valid_tokens: local.valid_tokens, processed_tokens: local.processed_tokens, grad_norm, stop_requested }))
}

/// The error of a step whose gradients are finite on every rank but whose sum over the ranks
/// is not (the norm, summed in f64, is finite wherever every element is).
fn sum_overflowed(step: usize) -> UlyssesError {
    UlyssesError::NonFinite { step, loss_ranks: Vec::new(), gradient_ranks: Vec::new(), local_parameter: None, updated_in_backward: false }
}

/// [`apply_step`] with the optimizer's state sharded over the world's ranks and updated on the
/// host ([`ShardedAdamW`]: ZeRO's optimizer half): the same checks, then each gradient
/// reduce-scattered rather than all-reduced, this rank's part of the master weights updated,
/// and every rank's parts gathered into the parameters. Trains as [`apply_step`] with
/// [`MatrixDecayAdamW`] does (the weight decay on weight matrices alone).
pub fn apply_step_sharded<B, M>(
    model: M,
    optimizer: &mut ShardedAdamW,
    step: &StepInput,
    local: LocalStep<B>,
    groups: &ParallelGroups<B::Wire>,
) -> Result<(M, StepReport), UlyssesError>
where
    B: TrainBackend,
    M: CausalLm<B>,
{
    let (losses, stop_requested) = step_losses_if_healthy(&model, &local, None, false, step, groups)?;
    if local.valid_tokens == 0 {
        return Ok((model, StepReport::without_targets(&local, stop_requested)));
    }
    let (model, grad_norm) = optimizer.step(step.learning_rate, model, local.grads, step.max_grad_norm, &*groups.world)?;
    // As in apply_step: finite gradients whose sum overflowed, the state left as it was.
    if !grad_norm.is_finite() {
        return Err(sum_overflowed(step.index));
    }
    let loss = losses.iter().sum();
    Ok((model, StepReport { loss, valid_tokens: local.valid_tokens, processed_tokens: local.processed_tokens, grad_norm, stop_requested }))
}

/// [`apply_step_sharded`] under ZeRO-3: the step's gradient parts, reduce-scattered during
/// [`backward_step_zero3`], update this rank's part of the master weights (on the host with
/// [`ShardedAdamW`], on the device with [`DeviceShardedAdamW`]), which become its parts of the
/// compute copy; `model` (placeholders) is returned as it came. On the host the update goes on
/// after this returns, on a thread of its own, while the device runs the next step: each of
/// that step's gathers waits for its own group's parts alone, and the next `apply_step_zero3`
/// (or [`ShardedAdamW::settle`], before reading the state) for the rest
/// (`ULYSSES_HOST_ADAMW_SERIAL=1`: here, as before). A failed update thread fails this rank's
/// next gather or step; the others then stop in their next collective, naming it. The same checks: a NaN or an
/// infinity in any rank's loss or gradient parts stops every rank (a rank named for its
/// gradients holds the non-finite part of a sum, which any rank may have fed).
pub fn apply_step_zero3<B, M, O>(
    model: M,
    optimizer: &mut O,
    parameters: &mut ShardedParameters<B>,
    step: &StepInput,
    local: LocalStep<B>,
    groups: &ParallelGroups<B::Wire>,
) -> Result<(M, StepReport), UlyssesError>
where
    B: TrainBackend,
    M: CausalLm<B>,
    O: PartOptimizer<B>,
{
    // The step's parts leave `parameters` whatever happens: a failed step must not leave its
    // sums to the next one. The last step's update (on the host, beside this step's work)
    // ends here, if its groups' gathers have not yet taken all of it; an update in the
    // backward (`ShardedParameters::update_in_backward`) is given its last group and ends.
    let arrived = parameters.arrive_gradient_parts();
    let in_backward = parameters.updating_in_backward();
    let arrived = arrived.and(parameters.close_update_in_backward(step));
    let (arrived, checks) = match arrived.and_then(|()| optimizer.part_checks()) {
        // It stopped at a part that was not finite and sent no more: the state is lost, the
        // health check below names the part.
        Ok(Some(checks)) if checks.non_finite.is_some() => {
            parameters.forget_updates();
            (Ok(()), Some(checks))
        }
        Ok(checks) => (parameters.await_every_update(), checks),
        Err(error) => (Err(error), None),
    };
    let arrived = arrived.and_then(|()| match (in_backward, &checks) {
        (true, None) => Err(UlyssesError::InModel { message: "ZeRO-3's update in the backward ended without its checks: the optimizer must be the one it ran on".into() }),
        _ => Ok(()),
    });
    // Past here an update in the backward has run: a step that fails leaves the state partly
    // this step's, so the optimizer loses it (where an update at the end changes nothing).
    let outcome = (|| {
        let bad_part = match checks.as_ref().and_then(|checks| checks.non_finite) {
            Some(index) => Some(parameters.path(index).to_string()),
            None => parameters.first_non_finite_gradient(),
        };
        let grads = parameters.take_gradient_parts();
        let (rank, world) = parameters.place();
        let misfit = arrived.and_then(|()| if optimizer.place() != parameters.optimizer_place() {
            Err(UlyssesError::InvalidConfig(format!(
                "the optimizer runs on the {:?} but the parameters were sharded for one on the {:?}: shard them with OptimizerPlace::{:?}",
                optimizer.place(),
                parameters.optimizer_place(),
                optimizer.place()
            )))
        } else {
            optimizer.check_holds(rank, world, &parameters.elements()).map_err(|e| match e {
                UlyssesError::InvalidConfig(message) => UlyssesError::InvalidConfig(format!("{message} (ZeRO-3: keep_master_weights before ShardedParameters::shard, or load the state)")),
                other => other,
            })
        });
        // Agreed before any other collective: a rank that stopped alone would leave the others
        // waiting in the next one.
        let every_rank = burn_ulysses::comm::all_gather_host_checked(&*groups.world, &[misfit.is_ok() as u64], "ZeRO-3 optimizer checks")?;
        misfit?;
        if let Some(rank) = every_rank.iter().position(|ok| ok[0] == 0) {
            return Err(UlyssesError::InvalidConfig(format!(
                "world rank {rank}'s optimizer does not fit its ZeRO-3 parameters, its gradient parts did not arrive, or its last update failed (its error says why)"
            )));
        }
        let (losses, stop_requested) = step_losses_if_healthy(&model, &local, bad_part, in_backward, step, groups)?;
        if local.valid_tokens == 0 {
            // The parts stay as they are: `update_parts` alone releases or replaces them.
            return Ok((model, StepReport::without_targets(&local, stop_requested)));
        }
        let grad_norm = match checks {
            // Updated in the backward already: the norm of the parts it took, summed as at the end.
            Some(checks) => zero::norm_of_parts(checks.squares.iter().flatten().sum(), None, &*groups.world)?.0,
            None => optimizer.update_parts(step.learning_rate, grads, step.max_grad_norm, &*groups.world, parameters)?,
        };
        let loss = losses.iter().sum();
        Ok((model, StepReport { loss, valid_tokens: local.valid_tokens, processed_tokens: local.processed_tokens, grad_norm, stop_requested }))
    })();
    if let (true, Err(error)) = (in_backward, &outcome) {
        optimizer.lose(format!("step {} was updated in the backward, then failed: {error}", step.index));
    }
    outcome
}

/// Every rank's loss of a step whose losses and gradients are finite everywhere and whose
/// ranks were given the same settings, and whether any rank was asked to stop
/// ([`request_stop`]); otherwise the error every rank returns. One read brings the loss and
/// the gradients' health; one host collective carries them, the step's settings and the stop.
/// `bad_part`: a parameter whose gradient already left `local` (ZeRO-3), found non-finite,
/// counted as a non-finite gradient of this rank; `updated_in_backward`: the optimizer has
/// updated some parameters already (its state is lost on an error).
fn step_losses_if_healthy<B, M>(
    model: &M,
    local: &LocalStep<B>,
    bad_part: Option<String>,
    updated_in_backward: bool,
    step: &StepInput,
    groups: &ParallelGroups<B::Wire>,
) -> Result<(Vec<f64>, bool), UlyssesError>
where
    B: TrainBackend,
    M: CausalLm<B>,
{
    let (local_loss, bad_parameter) = read_loss_and_first_non_finite_gradient::<B, M>(model, &local.grads, local.loss.clone());
    let bad_parameter = bad_parameter.or(bad_part);
    let max_grad_norm = step.max_grad_norm.unwrap_or(f64::NAN);
    let verdict = [
        local_loss.to_bits(),
        u64::from(bad_parameter.is_some()),
        max_grad_norm.to_bits(),
        step.learning_rate.to_bits(),
        u64::from(stop_was_requested()),
        u64::from(local.ignored_documents),
        u64::from(local.attended_padding),
    ];
    let gathered = burn_ulysses::comm::all_gather_host_checked(&*groups.world, &verdict, "step health values")?;
    check_same_settings(step.index, &gathered)?;
    // Rank 0's, which every rank holds now (the same bits on each: NaN is no clipping).
    let (limit, rate) = (f64::from_bits(gathered[0][2]), f64::from_bits(gathered[0][3]));
    check_step_settings(step.index, rate, (!limit.is_nan()).then_some(limit))?;
    let ignoring: Vec<usize> = (0..gathered.len()).filter(|&r| gathered[r][5] == 1).collect();
    if !ignoring.is_empty() {
        return Err(UlyssesError::InvalidConfig(format!(
            "step {} packs several documents into a sequence (StepInput::documents), but the model's attention never took them \
             (ranks {ignoring:?}): call burn_ulysses::attention::attention_in_documents (or attention_within) with the shard's \
             positions.ids where positions.packed, or each document attends to the ones before it",
            step.index
        )));
    }
    let attending: Vec<usize> = (0..gathered.len()).filter(|&r| gathered[r][6] == 1).collect();
    if !attending.is_empty() {
        // Refused after the backward: an update in it has changed some parameters already.
        let updated = if updated_in_backward { " The optimizer had updated some parameters in the backward already: resume from the last checkpoint." } else { "" };
        return Err(UlyssesError::InvalidConfig(format!(
            "step {}: the model's attention looked both ways (is_causal false, and no mask or bias) over sequences padded at their \
             end (ranks {attending:?}), so real tokens attended to the padding, which one device on the sequences alone does not: \
             the model says it is causal (CausalLm::is_causal), so pass AttentionModuleOptions {{ is_causal: true, .. }}; \
             attention that must look both ways masks the padding keys (SequenceShard::padding).{updated}",
            step.index
        )));
    }
    let losses: Vec<f64> = gathered.iter().map(|v| f64::from_bits(v[0])).collect();
    let non_finite_loss: Vec<usize> = (0..losses.len()).filter(|&r| !losses[r].is_finite()).collect();
    let non_finite_grads: Vec<usize> = (0..gathered.len()).filter(|&r| gathered[r][1] == 1).collect();
    if !non_finite_loss.is_empty() || !non_finite_grads.is_empty() {
        return Err(UlyssesError::NonFinite {
            step: step.index,
            loss_ranks: non_finite_loss,
            gradient_ranks: non_finite_grads,
            local_parameter: bad_parameter,
            updated_in_backward,
        });
    }
    Ok((losses, gathered.iter().any(|v| v[4] == 1)))
}

/// Refuses step settings that would train silently wrong: a learning rate below 0 or not
/// finite (a step up the gradient, or NaN parameters), a clipping limit not above 0 (below 0
/// the clipping turns the gradient around, 0 zeroes it) or NaN (read as no clipping).
fn check_step_settings(step: usize, learning_rate: f64, max_grad_norm: Option<f64>) -> Result<(), UlyssesError> {
    if !(learning_rate.is_finite() && learning_rate >= 0.0) {
        return Err(UlyssesError::InvalidConfig(format!("step {step}: the learning rate is {learning_rate}; give a finite number, 0 or more")));
    }
    max_grad_norm.map_or(Ok(()), check_max_grad_norm).map_err(|error| error.at_step(step))
}

/// Refuses a step whose ranks were given different settings (gathered as
/// [`apply_step`]'s verdict: the clipping limit, NaN for none, and the learning rate, as bits):
/// their parameters would part without an error.
fn check_same_settings(step: usize, gathered: &[Vec<u64>]) -> Result<(), UlyssesError> {
    for (index, setting) in [(2, "max_grad_norm (the clipping limit; NaN: none)"), (3, "the learning rate")] {
        let differing = ranks_differing_from_rank_0(gathered, index);
        if let Some(&rank) = differing.first() {
            return Err(UlyssesError::InvalidConfig(format!(
                "step {step}: {setting} is {} on rank 0 but {} on rank {rank} (ranks {differing:?} differ); every rank \
                 must be given the same step settings, or their parameters part",
                f64::from_bits(gathered[0][index]),
                f64::from_bits(gathered[rank][index])
            )));
        }
    }
    Ok(())
}

/// Refuses a step that would train silently wrong.
fn check_step_inputs<B, M>(
    model: &M,
    micro_batches: &[Vec<Vec<i64>>],
    sharder: &SequenceSharder,
    groups: &ParallelGroups<B::Wire>,
) -> Result<(), UlyssesError>
where
    B: TrainBackend,
    M: CausalLm<B>,
{
    let invalid = |message: String| Err(UlyssesError::InvalidConfig(message));
    let layout = &groups.layout;
    if sharder.sp_size != groups.sp.size() {
        return invalid(format!(
            "the sharder cuts sequences into {} shards but the SP group has {} ranks; use \
             layout.sharder()",
            sharder.sp_size,
            groups.sp.size()
        ));
    }
    // A ring attends over its blocks as the layout lays them out: data cut otherwise would
    // see the future or miss its past, without an error.
    if ring_cut(sharder.ring_size, sharder.ring_sharding) != ring_cut(layout.ring_size, layout.ring_sharding) {
        return invalid(format!(
            "the sharder lays sequences over a ring of {} ({:?}) but the layout's ring is {} ({:?}); use layout.sharder()",
            sharder.ring_size, sharder.ring_sharding, layout.ring_size, layout.ring_sharding
        ));
    }
    check_context_ring::<B::Wire>(sharder)?;
    if !model.is_causal() {
        return invalid(
            "train_step pads sequences at the end, which only causal attention ignores; this \
             model is not causal"
                .into(),
        );
    }
    if micro_batches.is_empty() || micro_batches.iter().any(|b| b.is_empty() || b.iter().any(Vec::is_empty)) {
        return invalid("every step needs at least one micro-batch of non-empty sequences".into());
    }
    let vocab = model.vocab_size() as i64;
    for (m, batch) in micro_batches.iter().enumerate() {
        if let Some((i, p, t)) = first_token_outside(batch, vocab) {
            return invalid(format!(
                "token {t} (micro-batch {m}, sequence {i}, position {p}) is outside the \
                 model's vocabulary 0..{vocab}"
            ));
        }
    }
    // Padding is looked up like a token; an ignore index that is a token would drop every
    // label equal to it from the loss.
    if !(0..vocab).contains(&sharder.pad_token) {
        return invalid(format!(
            "the sharder's pad_token {} is outside the model's vocabulary 0..{vocab}: padding is embedded like a \
             token, so give one inside it (with_pad_token; its rows carry no loss)",
            sharder.pad_token
        ));
    }
    if (0..vocab).contains(&sharder.ignore_index) {
        return invalid(format!(
            "the sharder's ignore_index {} is a token of the model's vocabulary 0..{vocab}: every label equal to it \
             would be left out of the loss; use a value outside it (-100, as PyTorch and transformers do)",
            sharder.ignore_index
        ));
    }
    Ok(())
}

/// The first token of `batch` outside the vocabulary `0..vocab`: `(sequence, position, token)`.
fn first_token_outside(batch: &[Vec<i64>], vocab: i64) -> Option<(usize, usize, i64)> {
    batch.iter().enumerate().find_map(|(i, sequence)| sequence.iter().enumerate().find(|&(_, t)| !(0..vocab).contains(t)).map(|(p, &t)| (i, p, t)))
}

/// Refuses an evaluated batch (and the `pad_token` its shards are padded with) past the
/// vocabulary its forward scored: the embedding looked up rows it has not, a panic on the CPU
/// but on a GPU a read past the weight (a fault, or a loss that would be returned). Checked
/// after the forward, which alone knows the vocabulary: check ids before where the GPU must
/// never read past it. The SP group's ranks share the batch and the model, so all of them
/// refuse it, before any collective of the evaluation's own.
fn check_evaluated_vocabulary(batch: &[Vec<i64>], pad_token: i64, vocab: usize) -> Result<(), UlyssesError> {
    let vocab = vocab as i64;
    if let Some((i, p, t)) = first_token_outside(batch, vocab) {
        return Err(UlyssesError::InvalidConfig(format!("evaluate: token {t} (sequence {i}, position {p}) is outside the model's vocabulary 0..{vocab}")));
    }
    if !(0..vocab).contains(&pad_token) {
        return Err(UlyssesError::InvalidConfig(format!(
            "evaluate: the sharder's pad_token {pad_token} is outside the model's vocabulary 0..{vocab}: padding is embedded like a token, \
             so give one inside it (with_pad_token; its rows carry no loss)"
        )));
    }
    Ok(())
}

/// A digest of a batch's sequences: ranks given the same sequences get the same digest.
pub fn batch_digest(sequences: &[Vec<i64>]) -> u64 {
    sequences.iter().fold(checkpoint::FNV1A_START, |hash, sequence| {
        let hash = checkpoint::fnv1a_more(hash, &(sequence.len() as u64).to_le_bytes());
        sequence.iter().fold(hash, |hash, token| checkpoint::fnv1a_more(hash, &token.to_le_bytes()))
    })
}

thread_local! {
    /// The model whose parameters this rank thread compared last (its first parameter's id,
    /// with the world's size).
    static PARAMETERS_COMPARED: std::cell::Cell<Option<(Option<burn::module::ParamId>, usize)>> = const { std::cell::Cell::new(None) };
}

/// The id of `model`'s first float parameter, which tells one model from another built anew.
fn first_parameter_id<B: Backend, M: Module<B>>(model: &M) -> Option<burn::module::ParamId> {
    struct First(Option<burn::module::ParamId>);
    impl<B: Backend> burn::module::ModuleVisitor<B> for First {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.get_or_insert(param.id);
        }
    }
    let mut first = First(None);
    model.visit(&mut first);
    first.0
}

/// A digest of the first values of every float parameter (one read from the device): ranks
/// whose models were built from other seeds differ in it. `None` for a model without
/// parameters or with them on several devices (not compared). Under ZeRO-3 the model holds
/// placeholders: equal on every rank, so nothing is compared there.
fn parameters_fingerprint<B: Backend, M: Module<B>>(model: &M) -> Option<u64> {
    let firsts: Vec<Tensor<B, 1>> = float_parameters(model)
        .into_iter()
        .filter(|parameter| parameter.values.dims()[0] > 0)
        .map(|parameter| {
            let count = parameter.values.dims()[0].min(ulysses_core::digest::DIGEST_VALUES);
            parameter.values.narrow(0, 0, count).cast(burn::tensor::DType::F32)
        })
        .collect();
    let device = firsts.first()?.device();
    if firsts.iter().any(|first| first.device() != device) {
        return None;
    }
    Some(ulysses_core::digest::parameters_digest(Tensor::cat(firsts, 0).into_data().iter::<f32>()))
}

/// A digest of a step's micro-batches (each apart), their document lengths and targets, the
/// same for the same step however it is spelt (no documents and one a row; no targets and
/// every token one).
fn step_digest(step: &StepInput) -> u64 {
    let mut hash = checkpoint::FNV1A_START;
    for (m, batch) in step.micro_batches.iter().enumerate() {
        hash = checkpoint::fnv1a_more(hash, &(batch.len() as u64).to_le_bytes());
        hash = checkpoint::fnv1a_more(hash, &batch_digest(batch).to_le_bytes());
        for (i, sequence) in batch.iter().enumerate() {
            if let Some(lengths) = step.documents.and_then(|d| d.get(m)?.get(i)).filter(|l| l.len() > 1) {
                hash = checkpoint::fnv1a_more(hash, &(i as u64).to_le_bytes());
                hash = lengths.iter().fold(hash, |hash, length| checkpoint::fnv1a_more(hash, &(*length as u64).to_le_bytes()));
            }
            if let Some(targets) = step.targets.and_then(|t| t.get(m)?.get(i)).filter(|t| t.len() == sequence.len() && t.iter().any(|&t| !t)) {
                hash = checkpoint::fnv1a_more(hash, &(i as u64).to_le_bytes());
                hash = targets.iter().fold(hash, |hash, &target| checkpoint::fnv1a_more(hash, &[target as u8]));
            }
        }
    }
    hash
}

/// Refuses document lengths or targets that do not fit the step's micro-batches, naming the
/// micro-batch.
fn check_step_annotations(step: &StepInput, sharder: &SequenceSharder) -> Result<(), UlyssesError> {
    for (what, count) in [("document lengths", step.documents.map(<[_]>::len)), ("targets", step.targets.map(<[_]>::len))] {
        if let Some(count) = count.filter(|&count| count != step.micro_batches.len()) {
            return Err(UlyssesError::InvalidConfig(format!("{what} for {count} micro-batches, but the step has {}", step.micro_batches.len())));
        }
    }
    for (m, batch) in step.micro_batches.iter().enumerate() {
        sharder.check_batch(batch, step.documents.map(|d| &d[m][..]), step.targets.map(|t| &t[m][..])).map_err(|error| match error {
            UlyssesError::InvalidConfig(message) => UlyssesError::InvalidConfig(format!("micro-batch {m}: {message}")),
            other => other,
        })?;
    }
    Ok(())
}

/// A cross-entropy summed over labelled tokens, and how many there were: what batches add up
/// to before the average.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TokenLoss {
    pub sum: f64,
    pub tokens: usize,
}

impl TokenLoss {
    /// The token-averaged loss (0 over no tokens).
    pub fn mean(&self) -> f64 {
        self.sum / self.tokens.max(1) as f64
    }

    pub fn add(self, other: TokenLoss) -> TokenLoss {
        TokenLoss { sum: self.sum + other.sum, tokens: self.tokens + other.tokens }
    }
}

/// How a ring of `size` ranks cuts a sequence: its size, and its sharding where it has more
/// than one rank (without a ring both shardings cut alike).
fn ring_cut(size: usize, sharding: burn_ulysses::ring::RingSharding) -> (usize, Option<burn_ulysses::ring::RingSharding>) {
    (size, (size > 1).then_some(sharding))
}

/// Refuses a rank context whose ring (its size and sharding) is not the one `sharder` lays
/// the data out for: ring attention would see the future or miss its past, silently.
fn check_context_ring<W: Backend>(sharder: &SequenceSharder) -> Result<(), UlyssesError> {
    let Some(context) = burn_ulysses::context::current::<W>()? else { return Ok(()) };
    let entered = context.ring.as_ref().map_or(1, |ring| ring.size());
    if ring_cut(entered, context.config.ring_sharding) != ring_cut(sharder.ring_size, sharder.ring_sharding) {
        return Err(UlyssesError::InvalidConfig(format!(
            "the rank context entered attends over a ring of {entered} ({:?}) but the data is laid out over a ring of {} ({:?}): enter \
             groups.rank_context(config), whose ring is the layout's, and cut the data with layout.sharder()",
            context.config.ring_sharding, sharder.ring_size, sharder.ring_sharding
        )));
    }
    Ok(())
}

/// The exchanges this thread's rank context has made for attention so far (`None`: no
/// context): what tells a forward that attended within its shard alone.
fn context_exchanges<W: Backend>() -> Option<u64> {
    let context = burn_ulysses::context::current::<W>().ok().flatten()?;
    Some(context.communicator.traffic().all_to_all_calls + context.ring.as_ref().map_or(0, |ring| ring.traffic().send_recv_calls))
}

/// The cross-entropy of `batch` (each sequence packing the documents of lengths
/// `documents[i]`; `None`: one each) over its `targets` (all tokens: `None`; see
/// [`StepInput::targets`]), evaluated with sequence parallelism: this rank runs
/// `forward` on its shard, and the SP group sums losses and valid tokens. `forward` returns
/// logits, or hidden states and head for a loss computed in chunks, or the error of a
/// collective of its own (ZeRO-3's gathers: [`layered_output`]).
pub fn evaluate<B: Backend, G: Backend>(
    forward: impl FnOnce(Tensor<B, 2, Int>, &ShardPositions) -> Result<LmOutput<B>, UlyssesError>,
    batch: &[Vec<i64>],
    documents: Option<&[Vec<usize>]>,
    targets: Option<&[Vec<bool>]>,
    sharder: &SequenceSharder,
    sp_rank: usize,
    sp_group: &dyn Communicator<G>,
    device: &B::Device,
) -> Result<TokenLoss, UlyssesError> {
    if sharder.sp_size != sp_group.size() || sp_rank >= sp_group.size() {
        return Err(UlyssesError::InvalidConfig(format!(
            "evaluate: the sharder cuts sequences into {} shards for SP rank {sp_rank}, but the SP group has {} ranks; use layout.sharder()",
            sharder.sp_size,
            sp_group.size()
        )));
    }
    check_context_ring::<G>(sharder)?;
    sharder.check_batch(batch, documents, targets)?;
    check_evaluated_tokens(batch, sharder.ignore_index)?;
    // A forward of its own: the lengths embedded before it (an evaluation loop's other batches,
    // with no backward between) are no second sequence of this one, for the guard, nor is the
    // table (another model's, maybe).
    burn_ulysses::attention_guard::forget_embedded();
    let shard = sharder.shard_targets(batch, documents, targets, sp_rank);
    let exchanges_before = context_exchanges::<G>();
    let evaluated = model_failure_as_error(|| {
        let output = {
            // For the guard, which refuses positions counted from another shard's first token
            // (RoPE from 0 on every rank): the forward's alone, since the loss's chunks of
            // `[B·S, D]` rows, computed without a graph, would look like a table's rows. The
            // token ids are uploaded before it: no positions, whatever their values.
            let tokens = shard.tokens(device);
            let _positions = burn_ulysses::attention_guard::note_shard_positions(&shard.positions);
            forward(tokens, &shard.positions)?
        };
        check_evaluated_vocabulary(batch, sharder.pad_token, output.vocab_size())?;
        Ok::<_, UlyssesError>(lm_loss_sum_inference(output, shard.labels(device), sharder.ignore_index).into_scalar().elem::<f64>())
    });
    // Nor are its lengths and table the next forward's (no backward ends an evaluation).
    burn_ulysses::attention_guard::forget_embedded();
    let loss = evaluated??;
    // Attention that never reached the group (a model that attends by hand the guard cannot
    // see, or one device chosen inside the forward; attention on the noted shard with no rank
    // context is refused in the forward) attended within each shard.
    if sharder.sp_size > 1 && exchanges_before.zip(context_exchanges::<G>()).is_none_or(|(before, after)| before == after) {
        return Err(UlyssesError::NotSequenceParallel { sp_size: sharder.sp_size });
    }
    let sum = sum_f64_over_ranks(sp_group, loss)?;
    let [tokens] = sum_over_ranks(sp_group, [shard.valid_tokens])?;
    Ok(TokenLoss { sum, tokens })
}

/// What an evaluation can check of its tokens before the forward (the vocabulary is checked
/// once the forward has scored it: [`check_evaluated_vocabulary`]): none negative, which the embedding cannot look
/// up, and none equal to `ignore_index`, whose labels the loss would leave out. The SP group's
/// ranks share the batch, so all of them refuse it, before any collective.
fn check_evaluated_tokens(batch: &[Vec<i64>], ignore_index: i64) -> Result<(), UlyssesError> {
    for (i, sequence) in batch.iter().enumerate() {
        if let Some((p, &t)) = sequence.iter().enumerate().find(|&(_, &t)| t < 0 || t == ignore_index) {
            let why = if t == ignore_index {
                "the sharder's ignore_index, so every label equal to it would be left out of the loss; use an ignore_index outside the vocabulary (-100, as PyTorch and transformers do)".to_string()
            } else {
                "negative, outside every vocabulary".to_string()
            };
            return Err(UlyssesError::InvalidConfig(format!("evaluate: token {t} (sequence {i}, position {p}) is {why}")));
        }
    }
    Ok(())
}

/// The cross-entropy of the whole, unsharded `batch` on this rank alone, bypassing sequence
/// parallelism even inside a group: no collective but those `forward` issues itself (ZeRO-3's
/// gathers, which the other ranks join: [`join_layered_output_gathers`]). A batch it refuses
/// is refused before the forward, so ranks joining its gathers would wait for them until their
/// collective timeout: where they do, check the batch on every rank first
/// (`SequenceSharder::check_batch`, and no token below 0 or equal to `ignore_index`).
pub fn evaluate_single_device<B: Backend>(
    forward: impl FnOnce(Tensor<B, 2, Int>, &ShardPositions) -> Result<LmOutput<B>, UlyssesError>,
    batch: &[Vec<i64>],
    documents: Option<&[Vec<usize>]>,
    targets: Option<&[Vec<bool>]>,
    ignore_index: i64,
    device: &B::Device,
) -> Result<TokenLoss, UlyssesError> {
    let _single_device = burn_ulysses::context::enter_single_device();
    let sharder = SequenceSharder::new(1).with_ignore_index(ignore_index);
    sharder.check_batch(batch, documents, targets)?;
    check_evaluated_tokens(batch, ignore_index)?;
    let whole = sharder.shard_targets(batch, documents, targets, 0);
    let evaluated = model_failure_as_error(|| {
        let output = forward(whole.tokens(device), &whole.positions)?;
        check_evaluated_vocabulary(batch, sharder.pad_token, output.vocab_size())?;
        Ok::<_, UlyssesError>(lm_loss_sum_inference(output, whole.labels(device), ignore_index).into_scalar().elem::<f64>())
    });
    // As `evaluate`'s: its lengths and table are no next forward's.
    burn_ulysses::attention_guard::forget_embedded();
    let loss = evaluated??;
    Ok(TokenLoss { sum: loss, tokens: whole.valid_tokens })
}

/// Runs a model's forward (and backward): a collective that fails inside attention or its
/// backward (a peer died), or any other failure there, can only panic, since backend ops
/// return no errors. Caught here, it becomes an error like every other of the step.
fn model_failure_as_error<T>(run: impl FnOnce() -> T) -> Result<T, UlyssesError> {
    // A failure of burn-ulysses' own ops as the error it was (a peer's loss stays one); one
    // left by a panic another caller caught is not this run's.
    burn_ulysses::failure::clear_failure();
    catch_model_failure(run).map_err(|message| burn_ulysses::failure::take_failure(&message).unwrap_or(UlyssesError::InModel { message }))
}

/// Sums a few counters over the ranks of `communicator` (a host collective).
pub fn sum_over_ranks<G: Backend, const N: usize>(
    communicator: &dyn Communicator<G>,
    values: [usize; N],
) -> Result<[usize; N], CommError> {
    let gathered = burn_ulysses::comm::all_gather_host_checked(communicator, &values.map(|v| v as u64), "counters summed over the ranks")?;
    Ok(std::array::from_fn(|i| gathered.iter().map(|v| v[i] as usize).sum()))
}

/// Sums an f64 over the ranks, in rank order, so every rank gets the same bits.
pub fn sum_f64_over_ranks<G: Backend>(
    communicator: &dyn Communicator<G>,
    value: f64,
) -> Result<f64, CommError> {
    let gathered = burn_ulysses::comm::all_gather_host_checked(communicator, &[value.to_bits()], "a value summed over the ranks")?;
    Ok(gathered.iter().map(|v| f64::from_bits(v[0])).sum())
}

/// Makes every rank's parameters equal to world rank 0's (call once before training). Each
/// parameter becomes a fresh autodiff leaf, so in-process ranks share no graph.
pub fn broadcast_parameters<B: TrainBackend, M: AutodiffModule<B>>(
    module: M,
    communicator: &dyn Communicator<B::Wire>,
) -> Result<M, CommError> {
    struct Broadcast<'a, B: TrainBackend> {
        communicator: &'a dyn Communicator<B::Wire>,
        error: Option<CommError>,
        _backend: PhantomData<B>,
    }
    impl<B: TrainBackend> ModuleMapper<B> for Broadcast<'_, B> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            if self.error.is_some() {
                return Param::from_mapped_value(id, tensor, mapper);
            }
            let require_grad = tensor.is_require_grad();
            let inner = float_primitive(tensor.inner());
            let value = match self.communicator.broadcast(inner, 0) {
                Ok(value) => Tensor::from_inner(float_tensor(value)),
                Err(error) => {
                    self.error = Some(error);
                    return Param::from_mapped_value(id, Tensor::empty([0; D], &Default::default()), mapper);
                }
            };
            Param::from_mapped_value(id, value.set_require_grad(require_grad), mapper)
        }
    }
    let mut broadcast = Broadcast::<B> { communicator, error: None, _backend: PhantomData };
    let module = module.map(&mut broadcast);
    match broadcast.error {
        Some(error) => Err(error),
        None => Ok(module),
    }
}

/// Fails, naming the first parameter that differs and the ranks that disagree, unless every
/// rank of `communicator` holds bit-identical parameters. Costs a device-to-host copy of
/// every parameter: run it every few hundred steps, or when debugging.
pub fn check_parameters_identical<B: Backend, M: Module<B>, G: Backend>(
    module: &M,
    communicator: &dyn Communicator<G>,
) -> Result<(), UlyssesError> {
    let parameters = float_parameters(module);
    let hashes: Vec<u64> = parameters.iter().map(|p| checkpoint::fnv1a(&[p.values.to_data().as_bytes()])).collect();
    let gathered = burn_ulysses::comm::all_gather_host_checked(communicator, &hashes, "float parameters")?;
    for (i, parameter) in parameters.iter().enumerate() {
        let differing = ranks_differing_from_rank_0(&gathered, i);
        if !differing.is_empty() {
            return Err(UlyssesError::ParametersDiverged { parameter: parameter.path.clone(), ranks: differing });
        }
    }
    Ok(())
}

/// The ranks whose gathered value at `index` is not rank 0's.
fn ranks_differing_from_rank_0(gathered: &[Vec<u64>], index: usize) -> Vec<usize> {
    (0..gathered.len()).filter(|&r| gathered[r][index] != gathered[0][index]).collect()
}

#[cfg(test)]
mod parameters_identical_tests {
    use burn::backend::NdArray;
    use burn::nn::Linear;

    use super::*;

    /// Three rank threads hold the same `Linear`, except that rank 2's bias differs by one ulp in
    /// one element: the check names the bias and rank 2 on every rank, and passes when they agree.
    #[test]
    fn a_rank_whose_parameters_differ_is_named_with_the_parameter() {
        let linear = |bias_ulp: u32| -> Linear<NdArray> {
            let device = Default::default();
            let weight = Tensor::<NdArray, 2>::from_floats([[0.5, -1.0, 2.0], [0.25, 3.0, -0.75]], &device);
            let bias = [0.1f32, 0.2, f32::from_bits(0.3f32.to_bits() + bias_ulp)];
            Linear { weight: Param::from_tensor(weight), bias: Some(Param::from_tensor(Tensor::from_floats(bias, &device))) }
        };
        for (differing_rank, want) in [(None, Ok(())), (Some(2), Err(("bias".to_string(), vec![2])))] {
            let outcomes = burn_ulysses::comm::ThreadGroup::new(3).run(|rank| {
                let model = linear(u32::from(Some(rank.rank()) == differing_rank));
                check_parameters_identical::<NdArray, _, NdArray>(&model, &*rank.communicator())
            });
            for (rank, outcome) in outcomes.into_iter().enumerate() {
                let got = match outcome.expect("no rank panicked") {
                    Ok(()) => Ok(()),
                    Err(UlyssesError::ParametersDiverged { parameter, ranks }) => Err((parameter, ranks)),
                    Err(other) => panic!("rank {rank}: {other}"),
                };
                assert_eq!(got, want, "rank {rank}, differing rank {differing_rank:?}");
            }
        }
    }
}

#[cfg(test)]
mod sums_over_ranks_tests {
    use burn::backend::NdArray;

    use super::*;

    /// Ranks that sum different counts of values (in different collectives: their schedules
    /// differ) get an error naming the collective, not a panic indexing past a shorter row.
    #[test]
    fn ranks_summing_different_counts_are_told_not_panicked() {
        let outcomes = burn_ulysses::comm::ThreadGroup::new(2).run(|rank| match rank.rank() {
            0 => sum_over_ranks::<NdArray, 2>(&*rank.communicator(), [1, 2]).map(|_| ()),
            _ => sum_over_ranks::<NdArray, 1>(&*rank.communicator(), [3]).map(|_| ()),
        });
        for (rank, outcome) in outcomes.into_iter().enumerate() {
            let error = outcome.expect("no rank panicked").expect_err("mismatched sums refused").to_string();
            assert!(error.contains("counters summed over the ranks"), "rank {rank}: {error}");
        }
        let sums = burn_ulysses::comm::ThreadGroup::new(2).run(|rank| sum_over_ranks::<NdArray, 2>(&*rank.communicator(), [rank.rank() + 1, 10]).unwrap());
        assert!(sums.into_iter().all(|sum| sum.expect("no rank panicked") == [3, 20]));
    }
}

#[cfg(test)]
mod evaluate_tests {
    use burn::backend::NdArray;

    use super::*;

    /// Tokens an evaluation cannot take are refused before its forward: one equal to the
    /// ignore index (its labels would leave the loss), a negative one (no embedding row).
    #[test]
    fn an_evaluation_refuses_tokens_it_would_drop_or_cannot_embed() {
        for (tokens, ignore_index, needle) in [(vec![1, 0, 2], 0, "token 0 (sequence 0, position 1) is the sharder's ignore_index"), (vec![3, -4], -100, "token -4 (sequence 0, position 1) is negative")] {
            let forward = |_: Tensor<NdArray, 2, Int>, _: &ShardPositions| -> Result<LmOutput<NdArray>, UlyssesError> { panic!("the forward ran") };
            let error = evaluate_single_device::<NdArray>(forward, &[tokens], None, None, ignore_index, &Default::default()).unwrap_err().to_string();
            assert!(error.contains(needle), "{error}");
        }
    }
}

#[cfg(test)]
mod evaluation_tests {
    use burn::{backend::NdArray, tensor::{Int, Tensor}};
    use burn_ulysses::comm::ThreadGroup;

    use super::*;

    type B = NdArray<f32>;

    /// Uniform logits over 5 tokens whatever the ids: a GPU's embedding reads past its weight
    /// without a fault, so nothing before the loss notices ids past the vocabulary.
    fn five_way(tokens: Tensor<B, 2, Int>, _: &ShardPositions) -> Result<LmOutput<B>, UlyssesError> {
        let [batch, len] = tokens.dims();
        Ok(LmOutput::Logits(Tensor::zeros([batch, len, 5], &tokens.device())))
    }

    /// A token, or the sharder's padding, past the vocabulary the forward scored is refused,
    /// naming it, where a loss was returned; tokens inside it give the uniform loss, ln 5.
    #[test]
    fn an_evaluated_token_or_padding_past_the_scored_vocabulary_is_refused() {
        let device = Default::default();
        let uniform = evaluate_single_device(five_way, &[vec![1, 2, 4]], None, None, -100, &device).unwrap();
        assert!((uniform.sum / uniform.tokens as f64 - 5f64.ln()).abs() < 1e-6, "{uniform:?}");
        let error = evaluate_single_device(five_way, &[vec![1, 2, 4], vec![0, 5, 1]], None, None, -100, &device).unwrap_err().to_string();
        assert!(error.contains("token 5 (sequence 1, position 1) is outside the model's vocabulary 0..5"), "{error}");
        let errors = ThreadGroup::new(1).run(|rank| {
            let sharder = SequenceSharder::new(1).with_pad_token(7);
            evaluate::<B, B>(five_way, &[vec![1, 2, 4]], None, None, &sharder, 0, &*rank.communicator(), &device).map(|_| ()).unwrap_err().to_string()
        });
        let error = errors.into_iter().next().unwrap().unwrap();
        assert!(error.contains("pad_token 7 is outside the model's vocabulary 0..5"), "{error}");
    }
}
