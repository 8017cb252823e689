//! Whole-layer activation checkpointing: a training step that keeps only each layer's input
//! (on the device or in host memory) and recomputes the layer in the backward.
//!
//! How, and why this way: burn 0.21's autodiff cannot run a backward inside a backward (a
//! custom node that re-ran its layer under autodiff and called `backward` would deadlock:
//! `backward` ends by locking every graph of the process, the running one included), and
//! its checkpoint strategies only recompute memory-bound ops, so every matmul output of
//! every layer stays alive. So the step itself does it, piece by piece, with top-level
//! backwards only:
//! 1. forward on the inner backend (no autodiff graph at all), keeping each layer's input;
//! 2. the head and the loss on the autodiff backend from the last hidden state (a leaf), a
//!    sequence tile at a time (both are token-wise): `backward` gives the head's gradients
//!    and the hidden state's;
//! 3. from the last layer to the first, the layer re-run from its kept input, in three
//!    pieces (below), each a graph of its own whose `backward` gives its parameters'
//!    gradients and its inputs', the upstream of the piece before it;
//! 4. the embedding likewise, or, where the model says its embedding is a lookup
//!    ([`LayeredLm::embedding_lookup`]), without a graph: the upstream rows added into the
//!    weight's gradient rows.
//!
//! **The pieces of a layer** ([`LayeredLm`]): only the attention core mixes tokens along the
//! sequence; what comes before it (the norm, the q/k/v projections, RoPE) and after it (the
//! output projection, the residuals, the MLP) treats every token alone. So the token-wise
//! parts run on sequence tiles of about [`LayerCheckpointing::tile_tokens`] tokens, one tile
//! at a time, each tile a leaf with its own `backward`: their intermediates, the MLP's
//! `S × ffn` ones above all (ALST's TiledMLP), exist for one tile at a time. The core runs on
//! the whole shard from leaves (q, k, v) and keeps only what its own backward needs. Per
//! layer in step 3:
//! - the core's inputs recomputed tile by tile without a graph, joined;
//! - the core with its graph, from those as leaves;
//! - the after-core tiles, from leaves cut from the layer's input and the core's output:
//!   their `backward`s give the core output's gradient and the residual part of the
//!   input's;
//! - the core's `backward` (the only one with collectives: the attention exchanges);
//! - the before-core tiles again, with graphs: their `backward`s give the rest of the input's
//!   gradient.
//!
//! With [`LayerCheckpointing::offload_to_host`], every `[batch, seq, d_model]` tensor that
//! waits between pieces (the layers' inputs, the upstream and residual gradients) waits in
//! host memory and comes back a tile of rows at a time; with
//! [`LayerCheckpointing::offload_layers`], those of the first layers alone, the later ones'
//! staying on the device. A tile leaves through a copy queued
//! behind the work that made it, awaited once the next tile's copy is queued (the device
//! still busy), the last when the tensor is complete: the host idles the device once per
//! offloaded tensor, not once per tile (`tests/device_waits.rs`). A tile comes back from pinned
//! memory where the backend has it (CUDA: an upload the host queues and does not wait for),
//! after two host copies: its rows gathered, then put in pinned memory (CubeCL 0.10 stages
//! bytes already filled, so the rows cannot be gathered into pinned memory directly).
//! Offloaded, the only whole-sequence
//! tensors on the device are the cores': at a core's backward, the most a layer holds, q, k,
//! v, the core's output, its softmax statistics and their gradients; no projection's,
//! norm's or MLP's intermediates, no hidden state.
//!
//! Every rank runs the same pieces in the same order in both passes, so the collectives
//! inside the cores stay in step; no tile runs a collective, and the ranks of an SP group run
//! as many tiles (each micro-batch's [`LayerCheckpointing::tiles`], from its shard's length,
//! which they share). Where ranks are
//! threads of one process, they meet at a barrier before each core's backward
//! ([`burn_ulysses::context::sync_thread_ranks`] says why).

use std::{collections::VecDeque, ops::Range};

use burn::{
    config::Config,
    module::{AutodiffModule, Module, ModuleVisitor, ParamId},
    optim::GradientsParams,
    tensor::{BasicOps, DType, FloatDType, IndexingUpdateOp, Int, Tensor, TensorData, backend::{AutodiffBackend, Backend}},
};

use burn_ulysses::{
    PlainBackend, UlyssesError,
    attention_guard::note_tile_of_the_shard,
    data::ShardPositions,
    device_io::{self, PendingRead},
};

use crate::{LmOutput, TrainBackend, gradients::{GradientSums, concatenated}, lm_loss_sum};

/// A causal LM cut into the pieces whole-layer checkpointing runs one at a time. Implement
/// it for every backend (`impl<B: Backend> LayeredLm<B> for MyModel<B>`): the forward runs
/// on the inner backend, the recomputation on the autodiff one.
///
/// A layer is `after_core(x, core(before_core(x)))`: `before_core` and `after_core` treat
/// every token alone (they may run on any slice of the sequence), `core` mixes tokens and
/// runs on the whole shard. Every piece must be deterministic: the backward runs it again,
/// under autodiff, where the forward ran on the inner backend (evaluation mode), so dropout
/// (on under autodiff alone) would differ between them: use none.
pub trait LayeredLm<B: Backend>: Module<B> {
    /// What every layer needs besides its input (rotary tables, document boundaries),
    /// built once per shard.
    type Context;
    fn context(&self, positions: &ShardPositions, device: &B::Device) -> Self::Context;
    /// The hidden states before the first layer, `[batch, seq, d_model]`.
    fn embed(&self, tokens: Tensor<B, 2, Int>, context: &Self::Context) -> Tensor<B, 3>;
    fn layer_count(&self) -> usize;
    /// Visits layer `index`'s parameters, and only them: ZeRO-3
    /// ([`ShardedParameters`](crate::ShardedParameters)) gathers them just before the layer
    /// runs. Every parameter no layer visits (embeddings, final norm, head) is gathered for
    /// the embedding and the head ([`visit_standalone_head`](Self::visit_standalone_head)
    /// splits them).
    fn visit_layer<V: ModuleVisitor<B>>(&self, index: usize, visitor: &mut V);
    /// Token-wise, before layer `index`'s core: the layer's input at rows `rows` of the
    /// shard (`hidden: [batch, rows.len(), d_model]`) → the core's inputs there (q, k and v
    /// after RoPE, for attention), each `[batch, heads, rows.len(), head_dim]`. RoPE at rows
    /// `rows` of the context's tables: the guard refuses positions counted from the tile's
    /// first row (`attention_guard::note_tile_of_the_shard`).
    fn before_core(&self, index: usize, hidden: Tensor<B, 3>, rows: Range<usize>, context: &Self::Context) -> Vec<Tensor<B, 4>>;
    /// Layer `index`'s core, the only piece that mixes tokens (attention), on the whole
    /// shard: [`before_core`](Self::before_core)'s tensors for every row in,
    /// `[batch, heads, seq, head_dim]` out.
    fn core(&self, index: usize, inputs: Vec<Tensor<B, 4>>, context: &Self::Context) -> Tensor<B, 4>;
    /// Token-wise, after layer `index`'s core: the layer's output at some rows, given its
    /// input there (`[batch, rows, d_model]`) and the core's output there
    /// (`[batch, heads, rows, head_dim]`): the output projection, the residuals, the MLP. The
    /// guard knows the rows too, as in [`before_core`](Self::before_core).
    fn after_core(&self, index: usize, hidden: Tensor<B, 3>, core: Tensor<B, 4>) -> Tensor<B, 3>;
    /// Layer `index` on the whole shard.
    fn layer(&self, index: usize, hidden: Tensor<B, 3>, context: &Self::Context) -> Tensor<B, 3> {
        let rows = 0..hidden.dims()[1];
        let core = self.core(index, self.before_core(index, hidden.clone(), rows, context), context);
        self.after_core(index, hidden, core)
    }
    /// What the loss is computed from, given the last layer's output: token-wise too, it
    /// may run on any slice of the sequence.
    fn head(&self, hidden: Tensor<B, 3>) -> LmOutput<B>;
    /// Visits every parameter [`head`](Self::head) uses (the final norm, the output weight)
    /// where no other piece uses any of them (an output head not tied to the embedding), and
    /// nothing otherwise (the default). Where it visits them they are a group of their own
    /// ([`ParameterGroup::Head`]): ZeRO-3 gathers them alone for the head's piece, not with the
    /// embedding (1 GB of bf16 for an 8B model), and their gradients leave right after that
    /// piece, not held whole through every layer's backward (2 GB of f32).
    fn visit_standalone_head<V: ModuleVisitor<B>>(&self, _visitor: &mut V) {}
    /// Where [`embed`](Self::embed) is a lookup of one weight's rows and nothing else (the rows
    /// passed on as they are, but for a cast to the compute dtype: no scale, no other
    /// parameter), that weight ([`EmbeddingLookup`]); `None` (the default) otherwise. A
    /// checkpointed step then makes the embedding's gradient itself, the upstream rows added
    /// into the weight's gradient rows in f32: it gathers no copy of the weight for the
    /// embedding's backward (ZeRO-3: one all-gather of the embedding a micro-batch fewer), and
    /// adds into a tied head's gradient in place, where autodiff would make a dense
    /// `[vocab, width]` gradient beside it and their sum.
    fn embedding_lookup(&self) -> Option<EmbeddingLookup> {
        None
    }
}

/// An embedding that [`LayeredLm::embed`] looks up ([`LayeredLm::embedding_lookup`]): token `t`
/// of the shard becomes row `t` of `weight`, a `[vocab, d_model]` parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbeddingLookup {
    pub weight: ParamId,
    /// The weight's rows: under ZeRO-3 the model's own weight is a placeholder.
    pub vocab: usize,
    /// Whether the weight trains (a frozen one gets no gradient).
    pub trains: bool,
    /// A token whose lookups pass no gradient to its row (transformers' `padding_idx`).
    pub no_gradient_token: Option<usize>,
}

impl EmbeddingLookup {
    /// Adds the lookup's gradient into `grads`: each row of `upstream` (`[batch, seq, width]`,
    /// the embedded shard's gradient) added in f32 to `tokens`' rows of the weight's gradient,
    /// which is the sum so far (a tied head's) or zeros. For an f32 weight, the sums of
    /// autodiff's embedding backward (`embedding_backward`: `select_add` of the same rows),
    /// started from the head's gradient rather than from zeros; for a half-precision one (a
    /// compute copy), the rows of a repeated token summed in f32 where autodiff summed them in
    /// the weight's dtype.
    fn add_gradient<B: Backend>(&self, grads: &mut GradientsParams, tokens: Tensor<B, 2, Int>, upstream: Tensor<B, 3>) {
        if !self.trains {
            return;
        }
        let [batch, seq, width] = upstream.dims();
        let device = upstream.device();
        let indices = tokens.reshape([batch * seq]);
        let mut rows = upstream.reshape([batch * seq, width]).cast(FloatDType::F32);
        if let Some(token) = self.no_gradient_token {
            let skipped = indices.clone().equal_elem(token as i64).unsqueeze_dim::<2>(1).expand([batch * seq, width]);
            rows = rows.mask_fill(skipped, 0.0);
        }
        let sum = match grads.remove::<B, 2>(self.weight) {
            Some(sum) => sum.cast(FloatDType::F32),
            None => Tensor::zeros([self.vocab, width], (&device, DType::F32)),
        };
        grads.register(self.weight, sum.select_assign(0, indices, rows, IndexingUpdateOp::Add));
    }
}

/// Whether `model`'s head is a group of its own ([`LayeredLm::visit_standalone_head`]).
fn head_stands_alone<B: Backend, M: LayeredLm<B>>(model: &M) -> bool {
    struct Any(bool);
    impl<B: Backend> ModuleVisitor<B> for Any {
        fn visit_float<const D: usize>(&mut self, _param: &burn::module::Param<Tensor<B, D>>) {
            self.0 = true;
        }
    }
    let mut any = Any(false);
    model.visit_standalone_head(&mut any);
    any.0
}

/// Whole-layer activation checkpointing (see the module doc).
#[derive(Config, Debug)]
pub struct LayerCheckpointing {
    /// Keep the layer inputs, and the gradients passed between pieces, in host memory, not
    /// on the device; they come back one tile of rows at a time (see the module doc).
    #[config(default = false)]
    pub offload_to_host: bool,
    /// With [`offload_to_host`](Self::offload_to_host), only the first this many layers keep
    /// their inputs (and the gradients passed while they run back) in host memory; the later
    /// layers', the head's input and their gradients stay on the device (Megatron's
    /// `cpu_offloading_num_layers`). For a device that holds some of the inputs and a host that
    /// holds the rest: the first layers' wait longest, from the forward to the end of the
    /// backward, so their copies have the most work to hide behind. `None`: every one.
    #[config(default = "None")]
    pub offload_layers: Option<usize>,
    /// Run each layer's token-wise parts (everything but the attention core: norms,
    /// projections, RoPE, the MLP) over sequence tiles of about this many tokens of the local
    /// shard, so their intermediates (the MLP's `S × ffn` above all) exist one tile at a time
    /// (ALST tiles its MLP by `d_model` tokens: a tile's intermediates then weigh about one
    /// MLP weight). `None`: the whole shard as one tile.
    #[config(default = "None")]
    pub tile_tokens: Option<usize>,
}

impl LayerCheckpointing {
    /// The most host memory one rank's step holds for what
    /// [`offload_to_host`](Self::offload_to_host) keeps there (none without it): for a model of
    /// `layers` layers of width `d_model` on micro-batches of `rows` sequences of `shard_tokens`
    /// tokens each, hidden states of `dtype_bytes` bytes an element: each layer's input, and
    /// beside them, at the last layer's backward, the gradients passed between pieces (the
    /// upstream gradient, and the input's residual and total gradients as they are made).
    pub fn offloaded_host_bytes(&self, layers: usize, rows: usize, shard_tokens: usize, d_model: usize, dtype_bytes: usize) -> u64 {
        let tensors = match (self.offload_to_host, self.offload_layers) {
            (false, _) => 0,
            // At layer n - 1's backward (or n - 2's): n inputs, two gradients.
            (true, Some(n)) => n.min(layers) + 2,
            // At the last layer's backward: every layer's input, the upstream gradient and the
            // input's residual and total ones.
            (true, None) => layers + 3,
        };
        (tensors * rows * shard_tokens * d_model * dtype_bytes) as u64
    }

    /// The `[batch, seq, d_model]` tensors of a model of `layers` layers that the device keeps
    /// at once, at most, between a checkpointed step's pieces (on the device, or in host memory
    /// where [`offload_to_host`](Self::offload_to_host) puts them there): its layers' inputs
    /// and the gradients passed between pieces.
    pub fn device_kept_tensors(&self, layers: usize) -> usize {
        match (self.offload_to_host, self.offload_layers) {
            (true, None) => 0,
            // At the last layer's backward: the inputs of layers n.., the upstream gradient and
            // the input's two; past n = layers the head's input and its gradient alone.
            (true, Some(n)) if n >= layers => 2,
            (true, Some(n)) => layers - n + 3,
            (false, _) => layers + 3,
        }
    }

    /// Whether the tensor at `position` of the residual stream (the input of layer
    /// `position`, or of the head at the layer count), and the gradient with respect to it,
    /// wait in host memory.
    fn offloads(&self, position: usize) -> bool {
        self.offload_to_host && self.offload_layers.is_none_or(|n| position < n)
    }
}

impl LayerCheckpointing {
    /// Refuses settings that cannot work, before any step runs.
    pub fn check(&self) -> Result<(), UlyssesError> {
        if self.tile_tokens == Some(0) {
            return Err(UlyssesError::InvalidConfig(
                "tile_tokens is 0, but a tile holds at least one token: use a positive count (ALST uses \
                 d_model) or None for untiled layers"
                    .into(),
            ));
        }
        match self.offload_layers {
            Some(0) => Err(UlyssesError::InvalidConfig(
                "offload_layers is 0, which offloads nothing: use None with offload_to_host false to keep every \
                 input on the device"
                    .into(),
            )),
            Some(n) if !self.offload_to_host => Err(UlyssesError::InvalidConfig(format!(
                "offload_layers is {n}, but offload_to_host is false: it says how many layers' inputs offload_to_host \
                 keeps on the host, so set offload_to_host too"
            ))),
            _ => Ok(()),
        }
    }

    /// [`check`](Self::check) for a model of `layers` layers: no more offloaded layers than it has.
    pub fn check_for(&self, layers: usize) -> Result<(), UlyssesError> {
        self.check()?;
        match self.offload_layers {
            Some(n) if n > layers => Err(UlyssesError::InvalidConfig(format!(
                "offload_layers is {n}, but the model has {layers} layers: use at most {layers}, or None to offload every \
                 layer's input and the head's"
            ))),
            _ => Ok(()),
        }
    }

    /// How many tiles the token-wise parts of a shard of `shard_len` tokens a sequence run in:
    /// `⌈shard_len / tile_tokens⌉` (none empty, none past `tile_tokens`), at least 1; 1 without
    /// tiling. The ranks of an SP group share a micro-batch's shard length, so they run as
    /// many tiles.
    pub fn tiles(&self, shard_len: usize) -> Result<usize, UlyssesError> {
        self.check()?;
        Ok(match self.tile_tokens {
            None => 1,
            Some(tokens) => shard_len.div_ceil(tokens).max(1),
        })
    }
}

/// A set of a model's parameters that a checkpointed step needs together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParameterGroup {
    /// Layer `index`'s ([`LayeredLm::visit_layer`]).
    Layer(usize),
    /// Every parameter no layer holds: embeddings, final norm, head. The embedding's and the
    /// head's group where the head does not stand alone; the whole model's but the layers'
    /// (a saved record's).
    Rest,
    /// The rest without a standalone head's parameters: the embedding's group where the head
    /// stands alone.
    Embedding,
    /// A standalone head's parameters ([`LayeredLm::visit_standalone_head`]): the head's group
    /// where it stands alone, its gradients handed over right after its piece.
    Head,
}

impl ParameterGroup {
    /// The groups the embedding's and the head's pieces of `model` use: `Embedding` and `Head`
    /// where its head stands alone, else `Rest` for both.
    pub fn of_embedding_and_head<B: Backend, M: LayeredLm<B>>(model: &M) -> (Self, Self) {
        match head_stands_alone(model) {
            true => (Self::Embedding, Self::Head),
            false => (Self::Rest, Self::Rest),
        }
    }
}

/// Where a checkpointed step finds the parameters of each piece it runs, and leaves their
/// gradients: the model itself (every parameter whole on every rank, the gradients returned
/// whole), or ZeRO-3's parts ([`ShardedParameters`](crate::ShardedParameters): a group's
/// parameters all-gathered just before its pieces run and released after, its gradients
/// reduce-scattered as soon as they are complete). Collective where it gathers or scatters:
/// every rank asks for the same groups in the same order.
pub trait LayerParameters<B: AutodiffBackend, M> {
    /// `model` with `group`'s parameters whole, for the pieces that use them.
    fn gather(&mut self, model: &M, group: ParameterGroup) -> Result<M, UlyssesError>;
    /// `group`'s gradients of one shard, complete (of `gathered`: the model
    /// [`gather`](Self::gather) gave, or the step's own where it gathered none for the group's
    /// last piece; only its parameters' ids and order count): returned to go on with the step's
    /// others, or taken (`None`).
    fn gradients_done(&mut self, gathered: &M, group: ParameterGroup, grads: GradientsParams) -> Result<Option<GradientsParams>, UlyssesError>;
    /// The step reached a piece of `group` that needs none of its parameters whole, so gathers
    /// nothing (the embedding's backward where [`LayeredLm::embedding_lookup`] describes it):
    /// for progress reports.
    fn reached(&mut self, _group: ParameterGroup) {}
    /// The step's shards over every rank hold `valid_tokens` targets (told before each shard's
    /// pieces): ZeRO-3's update in the backward updates nothing for a step without.
    fn step_targets(&mut self, _valid_tokens: usize) {}
    /// Whether the parameter `id` requires a gradient, where the model's own flag does not say
    /// (ZeRO-3's placeholders all require one); `None` where it does. No default: a wrapper
    /// that kept one would train a frozen embedding looked up under ZeRO-3.
    fn trains(&self, id: ParamId) -> Option<bool>;
}

/// Every parameter whole in the model on every rank (no ZeRO-3): nothing to gather, the
/// gradients returned with the step's.
pub struct WholeParameters;

impl<B: AutodiffBackend, M: Clone> LayerParameters<B, M> for WholeParameters {
    fn gather(&mut self, model: &M, _group: ParameterGroup) -> Result<M, UlyssesError> {
        Ok(model.clone())
    }
    fn gradients_done(&mut self, _gathered: &M, _group: ParameterGroup, grads: GradientsParams) -> Result<Option<GradientsParams>, UlyssesError> {
        Ok(Some(grads))
    }
    fn trains(&self, _id: ParamId) -> Option<bool> {
        None
    }
}

/// The tracing target of a checkpointed step's progress: world rank 0 reports, at debug level,
/// each group's parameters as the step asks for them (each layer's forward and backward, the
/// embedding's and the head's), with the time since the micro-batch began and the device's
/// memory. For steps that take minutes (an 8B model at long sequences), whose end is far off:
/// how far a step got, and how its memory grew, when it is stopped. Reported by
/// [`backward_step_checkpointed`](crate::backward_step_checkpointed) and
/// [`backward_step_zero3`](crate::backward_step_zero3); the trainer's `--progress` turns it on.
/// The pools' figures are read from CubeCL's memory manager, which does not wait for the device.
pub const PROGRESS_TARGET: &str = "ulysses_training::progress";

/// `parameters` reporting the step's progress at each gather, and each piece reached without
/// one ([`LayerParameters::reached`]), ([`PROGRESS_TARGET`]) where `report`, passing them
/// through otherwise. The time is the host's: the device may
/// trail it by what the host has queued (a gather over more than one rank waits for the device
/// first).
pub(crate) struct ReportProgress<'a, P, D> {
    parameters: &'a mut P,
    report: bool,
    /// What is reported: the step's index, and the micro-batch's within it.
    step: usize,
    micro_batch: usize,
    started: std::time::Instant,
    /// Gathers (or pieces [`reached`](LayerParameters::reached)) so far of the groups outside
    /// the layers (the embedding's or the head's) and of each layer: the first is the forward's.
    outside_layer_gathers: usize,
    layer_gathers: Vec<usize>,
    device: D,
}

impl<'a, P, D> ReportProgress<'a, P, D> {
    pub(crate) fn new(parameters: &'a mut P, report: bool, step: usize, micro_batch: usize, device: D) -> Self {
        Self { parameters, report, step, micro_batch, started: std::time::Instant::now(), outside_layer_gathers: 0, layer_gathers: Vec::new(), device }
    }

    /// Reports that the step asks for `group`'s parameters.
    fn report<B: TrainBackend<Device = D>>(&mut self, group: ParameterGroup) {
        let what = match group {
            // The embedding's forward, the head's piece, the embedding's backward, in that order.
            ParameterGroup::Rest | ParameterGroup::Embedding | ParameterGroup::Head => {
                self.outside_layer_gathers += 1;
                ["the embedding's forward", "the head and the loss", "the embedding's backward"].get(self.outside_layer_gathers - 1).copied().unwrap_or("the embeddings and head").to_string()
            }
            ParameterGroup::Layer(index) => {
                if self.layer_gathers.len() <= index {
                    self.layer_gathers.resize(index + 1, 0);
                }
                self.layer_gathers[index] += 1;
                format!("layer {index}'s {}", if self.layer_gathers[index] == 1 { "forward" } else { "backward" })
            }
        };
        let memory = B::Wire::device_memory(&self.device)
            .map(|m| format!("; the device's pools: {:.2} GB in use, {:.2} GB reserved", m.in_use as f64 / 1e9, m.reserved as f64 / 1e9))
            .unwrap_or_default();
        tracing::debug!(target: PROGRESS_TARGET, "step {} (micro-batch {}): {what} at {:.1} s{memory}", self.step, self.micro_batch, self.started.elapsed().as_secs_f64());
    }
}

impl<B: TrainBackend, M, P: LayerParameters<B, M>> LayerParameters<B, M> for ReportProgress<'_, P, B::Device> {
    fn gather(&mut self, model: &M, group: ParameterGroup) -> Result<M, UlyssesError> {
        if self.report {
            self.report::<B>(group);
        }
        self.parameters.gather(model, group)
    }

    fn gradients_done(&mut self, gathered: &M, group: ParameterGroup, grads: GradientsParams) -> Result<Option<GradientsParams>, UlyssesError> {
        self.parameters.gradients_done(gathered, group, grads)
    }

    fn reached(&mut self, group: ParameterGroup) {
        if self.report {
            self.report::<B>(group);
        }
        self.parameters.reached(group)
    }

    fn step_targets(&mut self, valid_tokens: usize) {
        self.parameters.step_targets(valid_tokens)
    }

    fn trains(&self, id: ParamId) -> Option<bool> {
        self.parameters.trains(id)
    }
}

/// The piece of a checkpointed step whose backward is about to run (see
/// [`checkpointed_backward`]'s `probe`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece {
    /// The head and the loss.
    Head,
    /// One tile of layer `layer`'s token-wise part after its core.
    AfterCore { layer: usize },
    /// Layer `layer`'s core, on the whole shard.
    Core { layer: usize },
    /// One tile of layer `layer`'s token-wise part before its core.
    BeforeCore { layer: usize },
    Embedding,
}

/// `tiles` near-equal consecutive ranges covering `0..len`, none empty (`tiles ≤ len`).
fn tile_ranges(len: usize, tiles: usize) -> impl Iterator<Item = Range<usize>> {
    (0..tiles).map(move |t| t * len / tiles..(t + 1) * len / tiles)
}

/// Rows `rows` of a tensor whose sequence runs along `dim`: a tile's (of one row too, which
/// the guard would take for a token picked from the shard), outside its rules.
fn rows_of<B: Backend, const D: usize, K: BasicOps<B>>(tensor: &Tensor<B, D, K>, dim: usize, rows: &Range<usize>) -> Tensor<B, D, K> {
    burn_ulysses::attention_guard::not_positions(|| tensor.clone().narrow(dim, rows.start, rows.len()))
}

/// Layer `index`'s core inputs for the whole shard, computed tile by tile from `hidden`'s
/// rows (no graph is kept here: it runs on the inner backend) and joined along the sequence.
fn core_inputs_in_tiles<B: Backend, M: LayeredLm<B>>(model: &M, index: usize, hidden: &Kept<B>, tiles: usize, context: &M::Context, device: &B::Device) -> Vec<Tensor<B, 4>> {
    let per_tile: Vec<Vec<Tensor<B, 4>>> = tile_ranges(hidden.rows(), tiles)
        .map(|rows| {
            let tile = hidden.restore_rows(&rows, device);
            let _tile_noted = note_tile_of_the_shard(rows.clone());
            model.before_core(index, tile, rows, context)
        })
        .collect();
    let count = per_tile[0].len();
    let mut joined: Vec<Vec<Tensor<B, 4>>> = (0..count).map(|_| Vec::with_capacity(tiles)).collect();
    for tile in per_tile {
        assert_eq!(tile.len(), count, "LayeredLm::before_core returned a different number of tensors for another tile");
        for (parts, part) in joined.iter_mut().zip(tile) {
            parts.push(part);
        }
    }
    joined.into_iter().map(|parts| concatenated(parts, 2)).collect()
}

/// Layer `index` on `hidden` with its token-wise parts in `tiles` tiles, no graph kept (the
/// forward of step 1); the output kept like the input, on the host a tile at a time when
/// `offload`.
fn layer_in_tiles<B: Backend, M: LayeredLm<B>>(
    model: &M,
    index: usize,
    hidden: &Kept<B>,
    tiles: usize,
    context: &M::Context,
    offload: Option<HostLink<B>>,
    device: &B::Device,
) -> Kept<B> {
    let core = model.core(index, core_inputs_in_tiles(model, index, hidden, tiles, context, device), context);
    let mut output = KeptTiles::new(offload);
    for rows in tile_ranges(hidden.rows(), tiles) {
        let (tile, core) = (hidden.restore_rows(&rows, device), rows_of(&core, 2, &rows));
        let _tile_noted = note_tile_of_the_shard(rows);
        output.push(model.after_core(index, tile, core));
    }
    output.finish()
}

/// How offloaded tiles travel between the device and the host.
struct HostLink<B: Backend> {
    /// Out: a copy to the host queued behind the work that made the tile
    /// ([`device_io::queue_read`]), awaited later.
    queue_read: fn(Tensor<B, 3>) -> PendingRead,
    /// Back: the rows put in memory the device copies from without the host waiting
    /// ([`PlainBackend::pin_for_upload`]), then uploaded.
    pin_for_upload: fn(TensorData, &B::Device) -> TensorData,
}

// Two fn pointers: copied like one, whatever `B` is (a derive would ask `B: Copy`).
impl<B: Backend> Clone for HostLink<B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend> Copy for HostLink<B> {}

/// A tile's copy to the host is awaited once the next tile's copy has been queued: the
/// device then still has that tile's work ahead of it, so the wait never idles it, and the
/// device holds at most this many tiles that have left for the host.
const TILES_IN_FLIGHT: usize = 1;

/// A `[batch, seq, d]` tensor kept between pieces: on the device, or in host memory (sent
/// there a tile of rows at a time), whence it comes back whole or a tile at a time.
enum Kept<B: Backend> {
    Device(Tensor<B, 3>),
    Host(HostTiles, HostLink<B>),
}

impl<B: Backend> Kept<B> {
    fn keep(tensor: Tensor<B, 3>, offload: Option<HostLink<B>>) -> Self {
        let mut tiles = KeptTiles::new(offload);
        tiles.push(tensor);
        tiles.finish()
    }

    /// The sequence length.
    fn rows(&self) -> usize {
        match self {
            Kept::Device(tensor) => tensor.dims()[1],
            Kept::Host(tiles, _) => tiles.rows.last().map_or(0, |rows| rows.end),
        }
    }

    /// The whole tensor on `device`; a host copy stays kept, to be restored again.
    fn restore(&self, device: &B::Device) -> Tensor<B, 3> {
        self.restore_rows(&(0..self.rows()), device)
    }

    /// Rows `rows` on `device`: a view of a device tensor, a copy of just those rows of a
    /// host one.
    fn restore_rows(&self, rows: &Range<usize>, device: &B::Device) -> Tensor<B, 3> {
        match self {
            Kept::Device(tensor) => rows_of(tensor, 1, rows),
            Kept::Host(tiles, link) => {
                let data = (link.pin_for_upload)(tiles.rows(rows), device);
                // In its own dtype: `from_data` alone would make an f32 tensor of a bf16 one.
                // Kept activations or gradients, no positions: past the guard's rule on
                // positions uploaded (a gradient's first row zeroed by an ignored label).
                let dtype = data.dtype;
                burn_ulysses::attention_guard::not_positions(|| Tensor::from_data(data, (device, dtype)))
            }
        }
    }
}

/// Consecutive row tiles `[batch, rows, d]` gathered into one [`Kept`] tensor; offloaded,
/// each tile's copy to the host is queued as it comes, and all have arrived once finished
/// (so no device buffer waits on a copy past the piece that made it).
enum KeptTiles<B: Backend> {
    Device(Vec<Tensor<B, 3>>),
    Host { tiles: HostTiles, pending: VecDeque<PendingRead>, link: HostLink<B> },
}

impl<B: Backend> KeptTiles<B> {
    fn new(offload: Option<HostLink<B>>) -> Self {
        match offload {
            Some(link) => KeptTiles::Host { tiles: HostTiles::default(), pending: VecDeque::new(), link },
            None => KeptTiles::Device(Vec::new()),
        }
    }

    fn push(&mut self, tile: Tensor<B, 3>) {
        match self {
            KeptTiles::Device(tiles) => tiles.push(tile),
            KeptTiles::Host { tiles, pending, link } => {
                let start = tiles.rows.last().map_or(0, |rows| rows.end);
                tiles.rows.push(start..start + tile.dims()[1]);
                pending.push_back((link.queue_read)(tile));
                if pending.len() > TILES_IN_FLIGHT {
                    tiles.arrive(pending.drain(..pending.len() - TILES_IN_FLIGHT).collect());
                }
            }
        }
    }

    fn finish(self) -> Kept<B> {
        match self {
            KeptTiles::Device(tiles) => Kept::Device(concatenated(tiles, 1)),
            KeptTiles::Host { mut tiles, pending, link } => {
                tiles.arrive(pending.into());
                Kept::Host(tiles, link)
            }
        }
    }
}

/// The row tiles of a `[batch, seq, d]` tensor in host memory.
#[derive(Default)]
struct HostTiles {
    /// Each tile's rows, consecutive from 0.
    rows: Vec<Range<usize>>,
    /// Each tile's `[batch, rows, d]` data, once arrived (all of them in a [`Kept`]).
    data: Vec<TensorData>,
}

impl HostTiles {
    /// The next tiles' data, waiting once for all of them.
    fn arrive(&mut self, reads: Vec<PendingRead>) {
        if !reads.is_empty() {
            let data = device_io::arrive(reads).unwrap_or_else(|error| panic!("an offloaded tile could not be read back from the device: {error}"));
            self.data.extend(data);
        }
    }

    /// Rows `rows` (within the tiles) as one `[batch, rows, d]` tensor's data: a copy of a
    /// tile that spans exactly those rows, else those rows cut from the tiles they span.
    fn rows(&self, rows: &Range<usize>) -> TensorData {
        let tiles: Vec<(&Range<usize>, &TensorData)> = self.rows.iter().zip(&self.data).collect();
        if let Some((_, data)) = tiles.iter().find(|(range, _)| *range == rows) {
            return (*data).clone();
        }
        let (batch, width, dtype) = (tiles[0].1.shape[0], tiles[0].1.shape[2], tiles[0].1.dtype);
        let row_bytes = tiles[0].1.as_bytes().len() / (batch * tiles[0].0.len());
        let mut bytes = Vec::with_capacity(batch * rows.len() * row_bytes);
        // Row-major `[batch, seq, d]`: for each batch row, the wanted rows of each tile in turn.
        for b in 0..batch {
            for (range, data) in &tiles {
                let (start, end) = (rows.start.max(range.start), rows.end.min(range.end));
                if start < end {
                    let base = b * range.len();
                    let bytes_of_tile = data.as_bytes();
                    bytes.extend_from_slice(&bytes_of_tile[(base + start - range.start) * row_bytes..(base + end - range.start) * row_bytes]);
                }
            }
        }
        TensorData::from_bytes_vec(bytes, [batch, rows.len(), width], dtype)
    }
}

/// Loss `Σ_shard CE · weight` of one shard (`[1]`, left on the device: the caller reads it when it
/// needs it) and the gradients of every parameter, with whole-layer checkpointing: the same
/// values as `backward` through the whole model.
/// `tiles` (from [`LayerCheckpointing::tiles`], at most the shard's length) is the token-wise
/// parts' tile count. `probe` runs whenever a piece's graph is complete, just before its
/// backward (the points where the step holds the most; the memory bench samples there).
#[allow(clippy::too_many_arguments)]
pub fn checkpointed_backward<B, M>(
    model: &M,
    tokens: Tensor<B, 2, Int>,
    labels: Tensor<B, 2, Int>,
    positions: &ShardPositions,
    weight: f64,
    ignore_index: i64,
    checkpointing: &LayerCheckpointing,
    tiles: usize,
    probe: impl FnMut(Piece),
) -> Result<(Tensor<B::InnerBackend, 1>, GradientsParams), UlyssesError>
where
    B: TrainBackend,
    M: AutodiffModule<B> + LayeredLm<B>,
    M::InnerModule: LayeredLm<B::InnerBackend>,
{
    checkpointed_backward_with(model, tokens, labels, positions, weight, ignore_index, checkpointing, tiles, &mut WholeParameters, probe)
}

/// [`checkpointed_backward`] with each piece's parameters from `parameters` (ZeRO-3: gathered
/// a group at a time): the gradients it takes ([`LayerParameters::gradients_done`]) are not
/// among those returned.
#[allow(clippy::too_many_arguments)]
pub fn checkpointed_backward_with<B, M>(
    model: &M,
    tokens: Tensor<B, 2, Int>,
    labels: Tensor<B, 2, Int>,
    positions: &ShardPositions,
    weight: f64,
    ignore_index: i64,
    checkpointing: &LayerCheckpointing,
    tiles: usize,
    parameters: &mut impl LayerParameters<B, M>,
    mut probe: impl FnMut(Piece),
) -> Result<(Tensor<B::InnerBackend, 1>, GradientsParams), UlyssesError>
where
    B: TrainBackend,
    M: AutodiffModule<B> + LayeredLm<B>,
    M::InnerModule: LayeredLm<B::InnerBackend>,
{
    let device = tokens.device();
    positions.check_tokens(tokens.dims())?;
    let layers = model.layer_count();
    let shard_len = tokens.dims()[1];
    let link: HostLink<B::InnerBackend> =
        HostLink { queue_read: |tile| device_io::queue_read::<B::Wire>(tile.into_primitive().tensor()), pin_for_upload: B::Wire::pin_for_upload };
    checkpointing.check_for(layers)?;
    // Where the residual stream's tensor at each position (a layer's input, the head's at
    // `layers`) and its gradient wait.
    let offload = |position: usize| checkpointing.offloads(position).then_some(link);
    check_tiles(tiles, shard_len)?;

    // 1. Forward without a graph, keeping each layer's input; each layer's parameters
    //    gathered for it alone.
    //    The model's pieces run with the shard's positions noted for the guard (not the
    //    loss's: `ulysses_training::evaluate` says why).
    let positions_noted = burn_ulysses::attention_guard::note_shard_positions(positions);
    let inner_context = model.valid().context(positions, &device);
    let mut kept = Vec::with_capacity(layers);
    let (embedding_group, head_group) = ParameterGroup::of_embedding_and_head(model);
    let embedded = parameters.gather(model, embedding_group)?.valid().embed(tokens.clone().inner(), &inner_context);
    let mut hidden = Kept::keep(embedded, offload(0));
    for index in 0..layers {
        let layer = parameters.gather(model, ParameterGroup::Layer(index))?.valid();
        let output = layer_in_tiles(&layer, index, &hidden, tiles, &inner_context, offload(index + 1), &device);
        kept.push(std::mem::replace(&mut hidden, output));
    }

    drop(positions_noted);

    // 2. Head and loss, token-wise too: tile by tile, the loss summed on the device and read
    //    by the caller (a read per tile would stall the device per tile).
    let mut accumulator = GradientSums::new(true);
    let mut loss_sum: Option<Tensor<B::InnerBackend, 1>> = None;
    let mut upstream = KeptTiles::new(offload(layers));
    let head = parameters.gather(model, head_group)?;
    for rows in tile_ranges(shard_len, tiles) {
        let last = leaf(hidden.restore_rows(&rows, &device));
        let loss = lm_loss_sum(head.head(last.clone()), rows_of(&labels, 1, &rows), ignore_index) * weight;
        let tile_loss = loss.clone().inner();
        loss_sum = Some(match loss_sum.take() {
            Some(sum) => sum + tile_loss,
            None => tile_loss,
        });
        probe(Piece::Head);
        let grads = loss.backward();
        upstream.push(upstream_of(&last, &grads, "the head")?);
        accumulator.add(&head, GradientsParams::from_grads(grads, &head));
    }
    if head_group == ParameterGroup::Head
        && let Some(grads) = parameters.gradients_done(&head, head_group, accumulator.take())?
    {
        accumulator.add(model, grads);
    }
    drop((hidden, head));
    let mut upstream = upstream.finish();

    // 3. Layers, last first, each re-run from its input in three pieces (see the module doc).
    //    With offload, the input, the upstream gradient and the residual one come from the
    //    host a tile at a time: whole on the device, only the core's tensors.
    let _positions_noted = burn_ulysses::attention_guard::note_shard_positions(positions);
    let context = model.context(positions, &device);
    for index in (0..layers).rev() {
        let input = kept.pop().expect("one kept input per layer");
        let layer = parameters.gather(model, ParameterGroup::Layer(index))?;
        let inner = layer.valid();
        let mut layer_grads = GradientSums::new(true);

        // The core with its graph, from its inputs recomputed without one.
        let core_inputs: Vec<Tensor<B, 4>> =
            core_inputs_in_tiles(&inner, index, &input, tiles, &inner_context, &device).into_iter().map(leaf).collect();
        let core = layer.core(index, core_inputs.clone(), &context);

        // After-core tiles: the core output's gradient, and the residual part of the input's.
        let core_values = core.clone().inner();
        let (mut core_grad, mut residual_grad) = (Vec::with_capacity(tiles), KeptTiles::new(offload(index)));
        for rows in tile_ranges(shard_len, tiles) {
            let (hidden, attended) = (leaf(input.restore_rows(&rows, &device)), leaf(rows_of(&core_values, 2, &rows)));
            let output = {
                let _tile_noted = note_tile_of_the_shard(rows.clone());
                layer.after_core(index, hidden.clone(), attended.clone())
            };
            probe(Piece::AfterCore { layer: index });
            let grads = (output * Tensor::from_inner(upstream.restore_rows(&rows, &device))).sum().backward();
            core_grad.push(upstream_of(&attended, &grads, "a layer's after-core part (its core output)")?);
            residual_grad.push(upstream_of(&hidden, &grads, "a layer's after-core part (its input)")?);
            layer_grads.add(&layer, GradientsParams::from_grads(grads, &layer));
        }
        // The layer's output gradient is in the tiles' now.
        drop(core_values);
        let residual_grad = residual_grad.finish();

        // The core's backward.
        let seed = (core * Tensor::from_inner(concatenated(core_grad, 2))).sum();
        probe(Piece::Core { layer: index });
        // The tiles' backwards had no collective; this one has. Peers that are threads of
        // this process must not be inside it while this rank still runs tiles.
        burn_ulysses::context::sync_thread_ranks::<B::Wire>()?;
        let grads = seed.backward();
        let input_grads =
            core_inputs.iter().map(|input| upstream_of(input, &grads, "a layer's core (one of its inputs)")).collect::<Result<Vec<_>, _>>()?;
        layer_grads.add(&layer, GradientsParams::from_grads(grads, &layer));
        drop(core_inputs);

        // Before-core tiles, with graphs this time: the rest of the input's gradient.
        let mut input_grad = KeptTiles::new(offload(index));
        for rows in tile_ranges(shard_len, tiles) {
            let hidden = leaf(input.restore_rows(&rows, &device));
            let outputs = {
                let _tile_noted = note_tile_of_the_shard(rows.clone());
                layer.before_core(index, hidden.clone(), rows.clone(), &context)
            };
            let seed = outputs
                .into_iter()
                .zip(&input_grads)
                .map(|(output, grad)| (output * Tensor::from_inner(rows_of(grad, 2, &rows))).sum())
                .reduce(|a, b| a + b)
                .expect("a core has inputs");
            probe(Piece::BeforeCore { layer: index });
            let grads = seed.backward();
            input_grad.push(upstream_of(&hidden, &grads, "a layer's before-core part")? + residual_grad.restore_rows(&rows, &device));
            layer_grads.add(&layer, GradientsParams::from_grads(grads, &layer));
        }
        upstream = input_grad.finish();
        if let Some(grads) = parameters.gradients_done(&layer, ParameterGroup::Layer(index), layer_grads.take())? {
            accumulator.add(model, grads);
        }
    }

    // 4. Embedding; then its group's gradients (the head's too where it does not stand alone:
    //    a tied head's weight is the embedding's, its two gradients summed before they leave).
    let upstream = upstream.restore(&device);
    let lookup = model.embedding_lookup().map(|lookup| EmbeddingLookup { trains: parameters.trains(lookup.weight).unwrap_or(lookup.trains), ..lookup });
    let grads = match lookup {
        // A lookup: its gradient added into the weight's here, nothing gathered for it.
        Some(lookup) => {
            parameters.reached(embedding_group);
            probe(Piece::Embedding);
            let mut grads = accumulator.take();
            lookup.add_gradient(&mut grads, tokens.inner(), upstream);
            parameters.gradients_done(model, embedding_group, grads)?
        }
        None => {
            let embedding = parameters.gather(model, embedding_group)?;
            let seed = (embedding.embed(tokens, &context) * Tensor::from_inner(upstream)).sum();
            probe(Piece::Embedding);
            let grads = seed.backward();
            accumulator.add(&embedding, GradientsParams::from_grads(grads, &embedding));
            parameters.gradients_done(&embedding, embedding_group, accumulator.take())?
        }
    };
    Ok((loss_sum.expect("a shard has at least one tile"), grads.unwrap_or_else(GradientsParams::new)))
}

/// `model`'s output on a shard without a graph (evaluation), run as the checkpointed step's
/// forward runs it: the token-wise parts of each layer in `tiles` tiles of rows (the MLP's
/// `S × ffn` intermediates exist a tile at a time, so an evaluation fits where the step does),
/// each group's parameters from `gather` just before its pieces run and dropped after them
/// (under ZeRO-3 all-gathered: a rank holds one layer whole at a time; else the model itself).
/// `model` gives the layer count and the context (ZeRO-3's placeholders do). Collective where
/// `gather` is: every rank of its world calls it with the same groups.
pub fn layered_output<B: Backend, M: LayeredLm<B>>(
    model: &M,
    tokens: Tensor<B, 2, Int>,
    positions: &ShardPositions,
    tiles: usize,
    mut gather: impl FnMut(ParameterGroup) -> Result<M, UlyssesError>,
) -> Result<LmOutput<B>, UlyssesError> {
    let device = tokens.device();
    positions.check_tokens(tokens.dims())?;
    check_tiles(tiles, tokens.dims()[1])?;
    let context = model.context(positions, &device);
    let (embedding_group, head_group) = ParameterGroup::of_embedding_and_head(model);
    let mut hidden = Kept::keep(gather(embedding_group)?.embed(tokens, &context), None);
    for index in 0..model.layer_count() {
        hidden = layer_in_tiles(&gather(ParameterGroup::Layer(index))?, index, &hidden, tiles, &context, None, &device);
    }
    Ok(gather(head_group)?.head(hidden.restore(&device)))
}

/// The gathers [`layered_output`] makes of `model`, in its order (the embedding's group, each
/// layer, the head's group), for a rank that only joins them while another runs the model
/// alone (an evaluation on world rank 0: `evaluate_single_device`).
pub fn join_layered_output_gathers<B: Backend, M: LayeredLm<B>>(model: &M, mut gather: impl FnMut(ParameterGroup) -> Result<(), UlyssesError>) -> Result<(), UlyssesError> {
    let (embedding_group, head_group) = ParameterGroup::of_embedding_and_head(model);
    gather(embedding_group)?;
    (0..model.layer_count()).try_for_each(|index| gather(ParameterGroup::Layer(index)))?;
    gather(head_group)
}

/// Refuses a tile count a shard of `shard_len` tokens cannot be cut into.
fn check_tiles(tiles: usize, shard_len: usize) -> Result<(), UlyssesError> {
    if tiles == 0 || tiles > shard_len {
        return Err(UlyssesError::InvalidConfig(format!(
            "{tiles} tiles for a shard of {shard_len} tokens: each tile needs at least one token \
             (LayerCheckpointing::tiles gives a count that fits)"
        )));
    }
    Ok(())
}

/// A leaf of a piece's graph, holding `values`.
fn leaf<B: AutodiffBackend, const D: usize>(values: Tensor<B::InnerBackend, D>) -> Tensor<B, D> {
    Tensor::from_inner(values).require_grad()
}

/// The gradient of `input` (a leaf) in `grads`: what flows on to the piece before it.
fn upstream_of<B: AutodiffBackend, const D: usize>(input: &Tensor<B, D>, grads: &B::Gradients, piece: &str) -> Result<Tensor<B::InnerBackend, D>, UlyssesError> {
    input.grad(grads).ok_or_else(|| UlyssesError::InModel {
        message: format!("layer checkpointing: {piece} does not depend on its input (LayeredLm must chain embed, before_core, core and after_core of layers 0..n, and head)"),
    })
}
