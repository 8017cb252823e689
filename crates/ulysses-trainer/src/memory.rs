//! What a run's ranks need in memory, estimated from its settings before anything is built:
//! what `--check` prints and what the host check refuses on.
//!
//! Between steps a rank's device keeps its model state ([`device_state_bytes`]). A step adds
//! its activations. Without `--checkpoint-layers` every layer keeps its own for the backward
//! (not estimated here: long sequences need checkpointing). With it, a step runs in pieces
//! (`ulysses_training::checkpointed_backward`), and the estimate follows them, in the
//! compute dtype's bytes (`cb`), for a micro-batch of `R` sequences whose shard is `S` tokens
//! on each of the sequence's `sp = ulysses × ring` ranks:
//! - **kept**: each layer's input and the three gradients passed between pieces,
//!   `(layers + 3) · R · S · d_model · cb`, on the device, or in host memory with
//!   `--offload-to-host` (with `--offload-layers N` those of the first N layers, the device
//!   keeping `layers - N + 3`: `LayerCheckpointing::device_kept_tensors`);
//! - **the attention core**, the only piece on the whole shard: q, k and v as the core's
//!   inputs, its output and the output's gradient (q's size each), the softmax statistics
//!   (f32); under Ulysses (ulysses > 1) q, k, v and the output as the attention saved them,
//!   exchanged (the sequence's `S · ulysses` tokens, `1/ulysses` of the heads), beside the
//!   inputs and the gradient in the shard's layout; at its backward dq, dk and dv, in both
//!   layouts under Ulysses;
//! - **a tile** of the token-wise parts (norms, projections, RoPE, the MLP) of
//!   `--tile-tokens` tokens (the whole shard without it), with its graph and backward;
//! - **the loss**: a tile's logits in chunks ([`ulysses_training::default_chunk_rows`]) in
//!   f32, with their softmax and gradient, and the head weight's gradient and casts;
//! - under ZeRO-3, the layer gathered for its pieces, its gradients in f32 before they are
//!   reduce-scattered, a tied head's gradient whole, and the head's group gathered for its
//!   piece (the final norm and an untied head, or a tied one with its embedding); without it, after a first micro-batch, the step's gradient sum.
//!
//! The peak is the kept tensors plus the largest of the head's piece and a layer's. The
//! tensors are those the code holds; what the backend's pools reserve beyond them (CubeCL
//! rounds to pages) comes on top. `tests/mixed_precision_wgpu.rs` holds the core's estimate
//! against what a rank holds on lavapipe at SP = 1 and 2; the other parts are counted from the
//! code.

use burn_ulysses::precision::Precision;
use ulysses_models::DecoderConfig;
use ulysses_training::LayerCheckpointing;

use crate::train::TrainConfig;

/// Bytes a rank's device keeps between steps for each of `parameters` (a lower bound: a step's
/// activations and gathered layer come on top): replicated without the host optimizer, the
/// f32 parameters, their gradients and AdamW's two moments (16); with it, the compute copy and
/// its gradients (f32 where layers are checkpointed or micro-batches accumulated: their sums
/// are f32); under `--zero 3` a 1/world part of what the device keeps: the compute copy's (none
/// with `--offload-parameters`), and with the optimizer on the device its f32 master weights,
/// moments and gradients too.
pub fn device_state_bytes(config: &TrainConfig, parameters: u64, compute_bytes: u64) -> u64 {
    let world = config.layout.world_size() as u64;
    match (config.zero_stage, config.offload_optimizer) {
        (3, true) if config.offload_parameters => 0,
        (3, true) => compute_bytes * parameters / world,
        (3, false) => (compute_bytes + 16) * parameters / world,
        (_, true) => (compute_bytes + gradient_bytes(config, compute_bytes)) * parameters,
        (_, false) => 16 * parameters,
    }
}

/// What the device keeps between steps, in words ([`device_state_bytes`]).
fn device_state_what(config: &TrainConfig) -> &'static str {
    match (config.zero_stage, config.offload_optimizer) {
        (3, true) if config.offload_parameters => "nothing: the parameters' parts are on the host",
        (3, true) => "the rank's part of the compute copy",
        (3, false) => "the rank's part of the compute copy, its f32 master weights, gradients and AdamW's moments",
        (_, true) => "the compute copy and its gradients",
        (_, false) => "f32 parameters, their gradients and AdamW's moments",
    }
}

/// Bytes of a parameter's gradient on a replicated rank: f32 where it is an f32 parameter's
/// or where checkpointed pieces or micro-batches sum it in f32, else the compute dtype's.
fn gradient_bytes(config: &TrainConfig, compute_bytes: u64) -> u64 {
    if !config.offload_optimizer || config.layer_checkpointing.is_some() || config.grad_accumulation > 1 { 4 } else { compute_bytes }
}

/// Bytes a rank keeps in host memory for each of `parameters` with `--offload-optimizer`: of
/// its 1/world part, 12 of AdamW's state (master weights and both moments) and 4 of the step's
/// gradient (`ShardedAdamW::check_host_memory`, which the run checks as it starts); with
/// `--optimizer-in-backward` the gradient parts of a few groups alone
/// ([`in_backward_bytes`]).
pub fn host_state_bytes(config: &TrainConfig, parameters: u64) -> u64 {
    if !config.offload_optimizer {
        return 0;
    }
    let part = parameters.div_ceil(config.layout.world_size() as u64);
    match config.optimizer_in_backward {
        true => 12 * part + in_backward_bytes(config),
        false => 16 * part,
    }
}

/// The most a rank's host holds at once under `--optimizer-in-backward` beside the optimizer's
/// state: f32 gradient parts of the group being updated, of one queued for the update (its
/// channel holds one) and of one arriving; and where the parts are on the device (no
/// `--offload-parameters`), the new parts the update made of the last groups, in the compute
/// dtype, until the next group's send puts them in place. The largest groups, the head's and
/// the embedding's, come first and last, the layers between: the largest group and two layers'
/// of gradient parts, the largest and a layer's of new parts.
pub fn in_backward_bytes(config: &TrainConfig) -> u64 {
    if !config.optimizer_in_backward {
        return 0;
    }
    let model = &config.model;
    let layer = layer_parameters(model);
    let largest = (model.vocab_size as u64 * model.d_model as u64 + model.d_model as u64).max(layer);
    let new_parts = if config.offload_parameters { 0 } else { compute_bytes(config) * (largest + layer) };
    (4 * (largest + 2 * layer) + new_parts).div_ceil(config.layout.world_size() as u64)
}

/// Bytes of a float of the layers' compute dtype.
pub fn compute_bytes(config: &TrainConfig) -> u64 {
    match config.precision {
        Precision::F32 => 4,
        Precision::Bf16 => 2,
    }
}

/// Sequences in each micro-batch a rank runs, and tokens in its shard of each (the sequence
/// padded as the sharder pads it: to twice the SP degree under a zigzag ring).
fn micro_batch(config: &TrainConfig) -> (u64, u64) {
    let layout = &config.layout;
    let multiple = layout.sharder().length_multiple();
    (config.micro_batch_rows() as u64, (config.seq_len.div_ceil(multiple) * multiple / layout.sp_size) as u64)
}

/// Bytes of layer inputs and gradients `--offload-to-host` keeps in one rank's host memory
/// (`LayerCheckpointing::offloaded_host_bytes`; none without it).
pub fn offloaded_host_bytes(config: &TrainConfig, compute_bytes: u64) -> u64 {
    let (rows, shard) = micro_batch(config);
    config.layer_checkpointing.as_ref().map_or(0, |c| c.offloaded_host_bytes(config.model.n_layers, rows as usize, shard as usize, config.model.d_model, compute_bytes as usize))
}

/// The parameters of one of `model`'s layers: the attention's projections, the MLP's three,
/// the two norms (and Qwen3's q and k norms, Qwen2's q/k/v biases, an output projection's bias).
pub fn layer_parameters(model: &DecoderConfig) -> u64 {
    let (d, hd, f) = (model.d_model as u64, model.head_dim() as u64, model.ffn_hidden as u64);
    let (q, kv) = (model.n_heads as u64 * hd, model.n_kv_heads as u64 * hd);
    let biases = if model.qkv_bias { q + 2 * kv } else { 0 } + if model.output_bias { d } else { 0 };
    let attention = d * (q + 2 * kv) + q * d + biases + if model.qk_norm { 2 * hd } else { 0 };
    attention + 3 * d * f + 2 * d
}

/// The model's FLOPs a token of a step: 6 for each weight a matmul takes (forward, and
/// backward's two; PaLM's appendix B), the head's included and the embedding lookup's not, and
/// causal attention's two products over the sequence's earlier tokens, on average half of them
/// (6 · layers · q heads · head dim · sequence: PaLM's 12, which counts every key, halved for
/// the causal mask, as FlashAttention counts; PaLM's and torchtitan's MFU count the 12). Recomputed forwards (layer
/// checkpointing) are not counted: the hardware does them, the model does not need them. (In
/// this module for the model's counts it shares.)
pub fn model_flops_per_token(config: &TrainConfig) -> f64 {
    let model = &config.model;
    let matmul_weights = model.n_layers as f64 * layer_parameters(model) as f64 + (model.vocab_size * model.d_model) as f64;
    6.0 * matmul_weights + 6.0 * (model.n_layers * model.n_heads * model.head_dim()) as f64 * config.seq_len as f64
}

/// The parameters outside `model`'s layers: the embedding, the final norm and an untied head.
pub fn rest_parameters(model: &DecoderConfig) -> u64 {
    let (d, vocab) = (model.d_model as u64, model.vocab_size as u64);
    vocab * d * if model.tie_embeddings { 1 } else { 2 } + d
}

/// The most a checkpointed step's activations hold on one rank's device at once, by part
/// (see the module doc), in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepActivations {
    /// Layer inputs and the gradients between pieces kept on the device (0 when offloaded).
    pub kept: u64,
    /// The attention core's tensors, held from its forward to its backward.
    pub core: u64,
    /// What the core's backward adds to them (dq, dk, dv; exchanged copies under Ulysses).
    pub core_backward: u64,
    /// One token-wise tile with its graph and backward, beside the core's tensors (and under
    /// Ulysses the core's output in the shard's layout, which the tiles read).
    pub tile: u64,
    /// The head's piece: a tile's logits in chunks, their softmax and gradient, the head
    /// weight's gradient and its casts (under ZeRO-3 the head's group gathered too).
    pub head: u64,
    /// Beside each layer's pieces: a tile's gradients of the layer and their cast to f32; under
    /// ZeRO-3 the layer gathered too, its gradients summed in f32, and a tied head's gradient
    /// whole; f32 parameters' casts to the compute dtype otherwise.
    pub gathered: u64,
    /// Without ZeRO-3, beside every piece after the first micro-batch: the step's gradient
    /// sum, apart from the micro-batch's own.
    pub accumulated: u64,
    /// Sequences in a rank's micro-batch.
    pub rows: u64,
    /// Tokens of each sequence a rank's core attends over, for each of its heads.
    pub core_tokens: u64,
    /// Query heads per rank in the core.
    pub core_heads: u64,
}

impl StepActivations {
    /// The step's peak above what the device keeps between steps.
    pub fn peak(&self) -> u64 {
        self.kept + self.accumulated + self.head.max(self.layer())
    }

    /// What a layer's pieces hold at their most, beside the kept tensors.
    fn layer(&self) -> u64 {
        self.gathered + self.core + self.tile.max(self.core_backward)
    }

    /// The estimate for one rank of a run of `config` whose layers compute in
    /// `compute_bytes`-byte floats, or `None` without layer checkpointing.
    pub fn of(config: &TrainConfig, compute_bytes: u64) -> Option<Self> {
        let checkpointing = config.layer_checkpointing.as_ref()?;
        let model = &config.model;
        let layout = &config.layout;
        let cb = compute_bytes;
        let (ulysses, ring) = (layout.ulysses_size() as u64, layout.ring_size as u64);
        let (rows, shard) = micro_batch(config);
        let (d, hd, f, vocab) = (model.d_model as u64, model.head_dim() as u64, model.ffn_hidden as u64, model.vocab_size as u64);
        let (heads, kv_heads) = (model.n_heads as u64, if model.repeat_kv { model.n_heads } else { model.n_kv_heads } as u64);

        // Elements of q and of k (v alike) on a rank: its shard with every head, and in the
        // exchanged layout (the ring chunk, S · ulysses tokens, with its share of the heads;
        // kv heads fewer than the group are repeated, one a rank).
        let q = rows * shard * heads * hd;
        let kv = rows * shard * kv_heads * hd;
        let core_tokens = shard * ulysses;
        let core_heads = heads.div_ceil(ulysses);
        let (q_exchanged, kv_exchanged) = (rows * core_tokens * core_heads * hd, rows * core_tokens * kv_heads.div_ceil(ulysses) * hd);
        let statistics = 4 * rows * core_tokens * core_heads;
        // The core's graph: q, k and v (its leaves), the output the attention saved and the
        // output's gradient (the seed `core · dO` keeps dO alone: dO is no graph's); under
        // Ulysses the attention saved q, k, v and the output as exchanged, and the output in
        // the sequence's layout is freed. Its backward: dq, dk, dv, in both layouts under
        // Ulysses, with dO exchanged.
        let (held, backward) = if ulysses > 1 {
            (2 * q + 2 * kv + 2 * q_exchanged + 2 * kv_exchanged, q_exchanged + (q_exchanged + 2 * kv_exchanged) + (q + 2 * kv))
        } else {
            (3 * q + 2 * kv, q + 2 * kv)
        };
        // A ring passes a block of k and v (and at its backward of dk and dv) from rank to rank
        // while it computes on another: the block and the copy passed on; its backward sums dq
        // in f32 and passes dk and dv in f32 with their copies.
        let (ring_blocks, ring_backward) = if ring > 1 { (cb * 4 * kv_exchanged, 4 * q_exchanged + 16 * kv_exchanged) } else { (0, 0) };
        let core = cb * held + ring_blocks + statistics;
        // The flash backward's own: dq summed in f32 by the dK/dV kernel (Hopper's and Ampere's
        // path), each row's D (f32) and the two rows' statistics it reads (8 bytes a row).
        let flash_backward = 4 * q_exchanged + 3 * statistics;
        let core_backward = cb * backward + ring_backward + flash_backward;

        // A tile of the token-wise parts, forward graph and backward: the after-core part is
        // the larger (the output projection's input, the residuals, the norm's four tensors,
        // the MLP's gate, up, their activation and product, the down projection's output),
        // with the gradients of about as many as its backward runs.
        let tile_tokens = checkpointing.tile_tokens.map_or(shard, |t| (t as u64).min(shard).max(1));
        let tile_rows = rows * tile_tokens;
        // Under Ulysses the core's output in the shard's layout lives through the tiles.
        let core_output = if ulysses > 1 { cb * q } else { 0 };
        let tile = cb * 2 * tile_rows * (heads * hd + 9 * d + 4 * f) + core_output;

        // The loss: a tile's logits a chunk at a time, in f32, with their softmax and gradient;
        // and the head weight's size several times over. In the chunks: the weight cast to the
        // logits' dtype (f32 under --f32-head), each chunk's gradient in that dtype, and the
        // gradient summed over the chunks in f32 with its cast and new sum (cast to the
        // weight's dtype at the end).
        // From the second tile on, the tiles' gradient summed in f32 beside them; as a tile's
        // is added, that sum with the tile's gradient and its cast.
        let zero3 = config.zero_stage == 3;
        let (weight_bytes, logits_bytes) = weight_and_logits_bytes(config, cb);
        let logits_weight = if logits_bytes == weight_bytes { 0 } else { logits_bytes };
        let tiles_sum = if shard > tile_tokens { 4 } else { 0 };
        let head_weights = (logits_weight + logits_bytes + 3 * 4 + tiles_sum).max(4 + weight_bytes + 4);
        let chunk = (ulysses_training::default_chunk_rows(model.vocab_size) as u64).min(tile_rows);
        let mut head = 3 * 4 * chunk * vocab + cb * 2 * tile_rows * d + vocab * d * head_weights;
        if zero3 {
            // The head's group gathered for its piece: the final norm and an untied head alone,
            // a tied one with the embedding it is.
            head += cb * if model.tie_embeddings { rest_parameters(model) } else { vocab * d + d };
        }

        let kept = checkpointing.device_kept_tensors(model.n_layers) as u64 * rows * shard * d * cb;
        let layer = layer_parameters(model);
        // A tile's gradients of the layer's parameters (in the compute dtype), cast to f32 as
        // they are added to the layer's sum.
        let tile_gradients = layer * (cb + if cb == 4 { 0 } else { 4 });
        let gathered = if zero3 {
            // The layer's compute copy and its gradients summed in f32; a tied head's gradient
            // (it lands on the embedding) whole in f32 until the rest's gradients leave after
            // the embedding's piece (an untied one leaves after the head's:
            // `LayeredLm::visit_standalone_head`).
            let head_gradient = if model.tie_embeddings && !config.freeze_embeddings { 4 * vocab * d } else { 0 };
            // With the optimizer on the host, a group's f32 parts wait on the device until the
            // next group's are taken (`queue_to_host`): the next layer's, or an untied head's
            // through the last layer's pieces.
            let untied_head = if model.tie_embeddings { 0 } else { vocab * d };
            let parts_in_flight = if config.offload_optimizer { (4 * layer.max(untied_head)).div_ceil(config.layout.world_size() as u64) } else { 0 };
            layer * (cb + 4) + tile_gradients + head_gradient + parts_in_flight
        } else {
            // The sums are the step's gradients, counted with the device's state; f32
            // parameters are cast to the compute dtype for each piece.
            tile_gradients + if weight_bytes == 4 && cb != 4 { layer * cb } else { 0 }
        };
        let accumulated = if !zero3 && config.grad_accumulation > 1 { gradient_bytes(config, cb) * (model.n_layers as u64 * layer + rest_parameters(model)) } else { 0 };
        Some(Self { kept, core, core_backward, tile, head, gathered, accumulated, rows, core_tokens, core_heads })
    }
}

/// Bytes of a float of the layers' weights (the compute copy's under ZeRO-3 or the host
/// optimizer, else f32 parameters cast for each piece) and of the logits (f32 under
/// --f32-head), for layers that compute in `compute_bytes`-byte floats.
fn weight_and_logits_bytes(config: &TrainConfig, compute_bytes: u64) -> (u64, u64) {
    let weight_bytes = if config.zero_stage == 3 || config.offload_optimizer { compute_bytes } else { 4 };
    (weight_bytes, if config.f32_head { 4 } else { compute_bytes })
}

/// The most a rank's device holds in a checkpointed step of `config` (its state and the
/// step's peak), or `None` where layers are not checkpointed.
pub fn estimated_peak(config: &TrainConfig, parameters: u64, compute_bytes: u64) -> Option<u64> {
    StepActivations::of(config, compute_bytes).map(|a| device_state_bytes(config, parameters, compute_bytes) + a.peak())
}

/// The most world rank 0's device holds as it evaluates whole sequences alone
/// (`--eval-single-device`), its state included, or `None` where the run evaluates no such way
/// or layers are not checkpointed (its evaluation then runs the model whole: not estimated).
/// A forward without a graph over a micro-batch's `T = rows · seq_len` tokens, not a shard of
/// them: the residual stream and a layer's output (`2 · T · d_model`); the attention core's q,
/// k, v and output over every head, with its statistics; a token-wise tile's forward (the
/// projections' input, the norm, the MLP's gate, up, activation and product, the output); or
/// the final norm's f32 copy of the stream and its square with the loss's chunk of logits in f32
/// and its softmax; the weights' casts to the compute dtype, or under ZeRO-3 the layer or the
/// head's group gathered. Its core alone is `sp / 2` times a step's or more:
/// evaluating over the SP group (without the flag) fits where the step does.
pub fn single_device_evaluation(config: &TrainConfig, parameters: u64, compute_bytes: u64) -> Option<u64> {
    let checkpointing = config.layer_checkpointing.as_ref()?;
    if !config.eval_single_device || config.eval_every == 0 {
        return None;
    }
    let model = &config.model;
    let cb = compute_bytes;
    let tokens = config.micro_batch_rows() as u64 * config.seq_len as u64;
    let (d, hd, f, vocab) = (model.d_model as u64, model.head_dim() as u64, model.ffn_hidden as u64, model.vocab_size as u64);
    let (heads, kv_heads) = (model.n_heads as u64, if model.repeat_kv { model.n_heads } else { model.n_kv_heads } as u64);
    let core = cb * tokens * hd * (2 * heads + 2 * kv_heads) + 4 * tokens * heads;
    let tile_rows = checkpointing.tile_tokens.map_or(tokens, |t| (config.micro_batch_rows() as u64 * t as u64).min(tokens));
    let tile = cb * tile_rows * (heads * hd + 4 * d + 4 * f);
    // The loss's chunks run over the whole batch's rows; the final norm takes the whole stream
    // to f32 and squares it.
    let chunk = (ulysses_training::default_chunk_rows(model.vocab_size) as u64).min(tokens);
    let final_norm = (4 + 4) * tokens * d;
    // As the step's: f32 parameters (no ZeRO-3, no host optimizer) cast to the compute dtype
    // for each layer, and the head's weight to the logits' dtype where it differs.
    let (weight_bytes, logits_bytes) = weight_and_logits_bytes(config, cb);
    let head_cast = if logits_bytes == weight_bytes { 0 } else { logits_bytes * vocab * d };
    let layer_cast = if weight_bytes == cb { 0 } else { cb * layer_parameters(model) };
    let head = 3 * 4 * chunk * vocab + final_norm + head_cast;
    let (layer_gathered, head_gathered) = match config.zero_stage {
        3 => (cb * layer_parameters(model), cb * if model.tie_embeddings { rest_parameters(model) } else { vocab * d + d }),
        _ => (layer_cast, 0),
    };
    let stream = cb * 2 * tokens * d;
    Some(device_state_bytes(config, parameters, compute_bytes) + stream + (core + tile + layer_gathered).max(head + head_gathered))
}

/// The memory of the machines a run is planned for (`--check --device-memory GB --host-memory
/// GB`): a rank's device, and a host shared by `ranks_per_host` ranks (`None`: not limited).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Machine {
    pub device_bytes: u64,
    pub host_bytes: Option<u64>,
    pub ranks_per_host: u64,
}

impl Machine {
    /// Whether a rank's `device` bytes and its host's `host` bytes fit.
    pub fn holds(&self, device: u64, host: u64) -> bool {
        device <= self.device_bytes && self.host_bytes.is_none_or(|limit| host <= limit)
    }
}

/// Where a checkpointed run keeps its layer inputs: the device, the first `n` layers' on the
/// host (`--offload-layers n`), or every one (`--offload-to-host`), from least to most offloaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputsAt {
    Device,
    FirstOnHost(usize),
    Host,
}

impl InputsAt {
    /// Every place for a model of `layers` layers, from least to most offloaded.
    fn every(layers: usize) -> impl Iterator<Item = Self> {
        std::iter::once(Self::Device).chain((1..=layers).map(Self::FirstOnHost)).chain(std::iter::once(Self::Host))
    }

    /// `checkpointing` with its inputs here.
    fn applied(self, checkpointing: &LayerCheckpointing) -> LayerCheckpointing {
        let (offload, layers) = match self {
            Self::Device => (false, None),
            Self::FirstOnHost(n) => (true, Some(n)),
            Self::Host => (true, None),
        };
        checkpointing.clone().with_offload_to_host(offload).with_offload_layers(layers)
    }

    /// The trainer's flags for it.
    pub fn flags(self) -> String {
        match self {
            Self::Device => "every layer's input on the device (no --offload-to-host)".into(),
            Self::FirstOnHost(n) => format!("--offload-to-host --offload-layers {n}"),
            Self::Host => "--offload-to-host".into(),
        }
    }
}

/// What a run of `config` needs of a [`Machine`]: a rank's device at a step's peak (or at world
/// rank 0's evaluation of whole sequences, where `--eval-single-device` makes that the more), and the
/// host for its ranks ([`host_state_bytes`], [`offloaded_host_bytes`]); `None` without layer
/// checkpointing (no step's peak is estimated).
pub fn needs(config: &TrainConfig, parameters: u64, compute_bytes: u64, ranks_per_host: u64) -> Option<(u64, u64)> {
    // World rank 0's evaluation of whole sequences where `--eval-single-device` asks for it.
    let evaluation = single_device_evaluation(config, parameters, compute_bytes).unwrap_or(0);
    let device = estimated_peak(config, parameters, compute_bytes)?.max(evaluation);
    Some((device, ranks_per_host * (host_state_bytes(config, parameters) + offloaded_host_bytes(config, compute_bytes))))
}

/// Where the layer inputs of `config` go so that it fits `machine`, the least offloaded place
/// that does (offloading more only moves bytes from the device to the host), with what it then
/// needs of the device and the host; `None` where none does or without layer checkpointing.
pub fn fitting_place(config: &TrainConfig, parameters: u64, compute_bytes: u64, machine: &Machine) -> Option<(InputsAt, u64, u64)> {
    let checkpointing = config.layer_checkpointing.as_ref()?;
    let placed = |at: InputsAt| {
        let config = config.clone().with_layer_checkpointing(Some(at.applied(checkpointing)));
        needs(&config, parameters, compute_bytes, machine.ranks_per_host).map(|(device, host)| (at, device, host))
    };
    let (at, device, host) = InputsAt::every(config.model.n_layers).filter_map(placed).find(|&(_, device, _)| device <= machine.device_bytes)?;
    machine.holds(device, host).then_some((at, device, host))
}

/// The longest `--seq-len`, in steps of `step` tokens up to `longest`, whose run (`config`
/// otherwise) fits `machine` with its layer inputs somewhere ([`fitting_place`]), and where;
/// `None` where not even `step` tokens fit. Memory grows with the length, so it bisects
/// (`ulysses_core::host_memory::longest_fitting`).
pub fn longest_fitting(config: &TrainConfig, parameters: u64, compute_bytes: u64, machine: &Machine, step: usize, longest: usize) -> Option<(usize, InputsAt)> {
    let place = |tokens: usize| fitting_place(&config.clone().with_seq_len(tokens), parameters, compute_bytes, machine).map(|(at, _, _)| at);
    if longest < step {
        return None;
    }
    let tokens = ulysses_core::host_memory::longest_fitting(step, longest, step, |tokens| place(tokens).is_some())?;
    Some((tokens, place(tokens)?))
}

/// `bytes` in GB, MB or kB, whichever shows them with a digit before the point.
fn shown(bytes: u64) -> String {
    match bytes as f64 {
        b if b >= 1e9 => format!("{:.2} GB", b / 1e9),
        b if b >= 1e6 => format!("{:.2} MB", b / 1e6),
        b => format!("{:.2} kB", b / 1e3),
    }
}

/// What `--check` says of a rank's memory: `parameters` the model's count, `compute_bytes`
/// the layers' float size, `host_offloaded` what `--offload-to-host` keeps in host memory.
pub fn describe(config: &TrainConfig, parameters: u64, compute_bytes: u64, host_offloaded: u64) -> String {
    let gb = shown;
    let states = device_state_bytes(config, parameters, compute_bytes);
    let host = match (host_state_bytes(config, parameters), host_offloaded) {
        (0, 0) => String::new(),
        (state, offloaded) => {
            let state_what = if config.optimizer_in_backward { "the optimizer's state" } else { "the optimizer's state and gradient parts" };
            let what = [(state, state_what), (offloaded, "layer inputs and gradients")]
                .iter()
                .filter(|(bytes, _)| *bytes > 0)
                .map(|(bytes, what)| format!("{} of {what}", gb(*bytes)))
                .collect::<Vec<_>>();
            format!("; a rank's host memory keeps {}", what.join(" and "))
        }
    };
    let Some(a) = StepActivations::of(config, compute_bytes) else {
        return format!(
            "a rank's device keeps {} between steps ({}, of {parameters} parameters), and a step every layer's activations on top \
             (not estimated; --checkpoint-layers keeps one layer's){host}",
            gb(states),
            device_state_what(config)
        );
    };
    let peak = states + a.peak();
    let mut parts = vec![
        format!("{} kept between steps ({}, of {parameters} parameters)", gb(states), device_state_what(config)),
        format!(
            "the attention core {} and its backward {} ({} sequence{} × {} tokens × {} heads a rank)",
            gb(a.core),
            gb(a.core_backward),
            a.rows,
            if a.rows == 1 { "" } else { "s" },
            a.core_tokens,
            a.core_heads
        ),
        format!("a token-wise tile {}", gb(a.tile)),
        format!("the loss {}", gb(a.head)),
    ];
    if a.kept > 0 {
        parts.push(format!("layer inputs and gradients kept {}", gb(a.kept)));
    }
    if a.gathered > 0 {
        let what = if config.zero_stage == 3 { "ZeRO-3's gathered layer and its gradients" } else { "a layer's gradients as a tile's are summed" };
        parts.push(format!("{what} {}", gb(a.gathered)));
    }
    if a.accumulated > 0 {
        parts.push(format!("the gradients summed over micro-batches {}", gb(a.accumulated)));
    }
    // What would cut the parts of an eighth of the peak or more: of a layer's, where a layer
    // makes the peak (not the head's piece, which no flag cuts).
    let large = |bytes: u64| 8 * bytes >= peak;
    let in_layer = |bytes: u64| a.layer() > a.head && large(bytes);
    let checkpointing = config.layer_checkpointing.as_ref().expect("an estimate is made for checkpointed steps");
    let mut cuts = Vec::new();
    let (_, shard) = micro_batch(config);
    // Every activation grows with the sequences a micro-batch holds (`--batch-size 8` by
    // default, long contexts usually want one at a time).
    if a.rows > 1 && large(a.peak()) {
        cuts.push(match config.optimizer_in_backward {
            // Which takes no accumulation.
            true => format!("a smaller --batch-size (or a larger --dp) runs fewer sequences at once: each rank's micro-batch now holds {}", a.rows),
            false => format!(
                "a larger --grad-accumulation (up to {}) runs fewer of the step's sequences at once: each rank's micro-batch now holds {}",
                a.rows * config.grad_accumulation as u64,
                a.rows
            ),
        });
    }
    if in_layer(a.tile) && checkpointing.tile_tokens.is_none() && shard > config.model.d_model as u64 {
        cuts.push(format!("--tile-tokens {} runs the token-wise parts in tiles (ALST's size: d_model)", config.model.d_model));
    }
    if large(a.kept) {
        cuts.push(match checkpointing.offload_layers {
            Some(n) => format!("a larger --offload-layers (now {n} of {}) keeps more layer inputs in host memory", config.model.n_layers),
            None => "--offload-to-host keeps the layer inputs in host memory (with --offload-layers N, the first N layers' alone)".to_string(),
        });
    }
    if in_layer(a.core + a.core_backward) {
        cuts.push("more --sp ranks share the attention core".to_string());
    }
    if large(states) && config.zero_stage != 3 {
        cuts.push(if config.layout.world_size() > 1 {
            "--zero 3 (with --offload-optimizer) shares the model state over the ranks".to_string()
        } else {
            "--offload-optimizer keeps AdamW's state on the host (with --zero 3 and --offload-parameters, the parameters too)".to_string()
        });
    }
    let cuts = if cuts.is_empty() { String::new() } else { format!(". To need less: {}", cuts.join("; ")) };
    let evaluation = match single_device_evaluation(config, parameters, compute_bytes) {
        Some(bytes) if bytes > peak => format!(
            "; world rank 0's device needs about {} to evaluate whole sequences alone (--eval-single-device), more than a step: \
             without the flag the SP group evaluates, each rank its shard",
            gb(bytes)
        ),
        Some(bytes) => format!("; world rank 0's device needs about {} to evaluate whole sequences alone (--eval-single-device)", gb(bytes)),
        None => String::new(),
    };
    format!("a rank's device needs about {} at a step's peak, estimated: {}{host}; the backend's pools reserve more{cuts}{evaluation}", gb(peak), parts.join(", "))
}

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;
    use burn_ulysses::ParallelLayout;
    use burn::optim::AdamWConfig;
    use ulysses_training::parameter_elements;

    use super::*;

    /// A model's parameters, counted on its lazily built tensors.
    fn counted(model: &DecoderConfig) -> u64 {
        parameter_elements(&model.init::<NdArray<f32>>(&Default::default())).iter().sum::<usize>() as u64
    }

    /// Llama-3.1-8B (8 030 261 248 parameters) at 131 072 tokens: 6 × its 7 504 920 576 matmul
    /// weights (32 layers of 218 112 000, the head's 525 336 576; not the embedding's lookup)
    /// and causal attention's 6 × 32 layers × 4096 × 131 072, more than twice the weights' share.
    #[test]
    fn a_tokens_model_flops_are_the_weights_and_causal_attention() {
        let model = DecoderConfig::new(128_256).with_d_model(4096).with_n_layers(32).with_n_heads(32).with_n_kv_heads(8).with_ffn_hidden(14_336);
        assert_eq!(counted(&model), 8_030_261_248);
        let config = TrainConfig::new(model, AdamWConfig::new(), ParallelLayout::new()).with_seq_len(131_072);
        assert_eq!(model_flops_per_token(&config), 6.0 * 7_504_920_576.0 + 6.0 * 32.0 * 4096.0 * 131_072.0);
    }

    #[test]
    fn a_layer_and_the_rest_have_the_parameters_of_the_built_model() {
        let llama = DecoderConfig::new(300).with_d_model(64).with_n_heads(4).with_n_kv_heads(2).with_ffn_hidden(96);
        let qwen2 = llama.clone().with_qkv_bias(true).with_tie_embeddings(true);
        let qwen3 = llama.clone().with_qk_norm(true).with_head_dim(Some(32)).with_output_bias(true);
        for model in [llama, qwen2, qwen3] {
            let (one, three) = (counted(&model.clone().with_n_layers(1)), counted(&model.clone().with_n_layers(3)));
            assert_eq!(three - one, 2 * layer_parameters(&model), "{model:?}");
            assert_eq!(one, layer_parameters(&model) + rest_parameters(&model), "{model:?}");
        }
    }

    /// The estimate of a run of `seq_len` tokens over `sp` ranks (`ring` of them a ring), in
    /// bf16, tiles of `tile_tokens`.
    fn activations(seq_len: usize, sp: usize, ring: usize, tile_tokens: Option<usize>) -> StepActivations {
        let model = DecoderConfig::new(128_256).with_d_model(4096).with_n_layers(32).with_n_heads(32).with_n_kv_heads(8).with_ffn_hidden(14_336).with_repeat_kv(false);
        let layout = ParallelLayout::new().with_sp_size(sp).with_ring_size(ring);
        let config = TrainConfig::new(model, AdamWConfig::new(), layout)
            .with_batch_size(1)
            .with_seq_len(seq_len)
            .with_layer_checkpointing(Some(LayerCheckpointing::new().with_offload_to_host(true).with_tile_tokens(tile_tokens)));
        StepActivations::of(&config, 2).expect("checkpointed")
    }

    /// A micro-batch of several sequences (`--batch-size 8`, the default, at one DP replica)
    /// multiplies every activation: the estimate names `--grad-accumulation`, up to the
    /// sequences a replica's step holds; a micro-batch of one has no such cut.
    #[test]
    fn several_sequences_at_once_name_grad_accumulation() {
        let model = DecoderConfig::new(32_000).with_d_model(1024).with_n_layers(4).with_n_heads(8).with_n_kv_heads(2).with_ffn_hidden(2816);
        let config = |batch: usize, accumulation: usize| {
            TrainConfig::new(model.clone(), AdamWConfig::new(), ParallelLayout::new().with_sp_size(4))
                .with_batch_size(batch)
                .with_grad_accumulation(accumulation)
                .with_seq_len(65_536)
                .with_layer_checkpointing(Some(LayerCheckpointing::new()))
        };
        let said = |config: &TrainConfig| describe(config, 32 * layer_parameters(&model) + rest_parameters(&model), 2, 0);
        let eight = said(&config(8, 1));
        assert!(eight.contains("a larger --grad-accumulation (up to 8) runs fewer of the step's sequences at once: each rank's micro-batch now holds 8"), "{eight}");
        assert!(said(&config(8, 2)).contains("(up to 8)") && said(&config(8, 2)).contains("now holds 4"));
        assert!(!said(&config(8, 8)).contains("--grad-accumulation"), "{}", said(&config(8, 8)));
    }

    /// `--eval-single-device` has world rank 0 run whole sequences alone: its estimate counts
    /// the core over every token and head (which a step shares over the SP ranks), the same
    /// whatever the SP size, and says where it is more than a step's peak.
    #[test]
    fn a_single_device_evaluation_counts_whole_sequences() {
        let model = DecoderConfig::new(128_256).with_d_model(4096).with_n_layers(32).with_n_heads(32).with_n_kv_heads(8).with_ffn_hidden(14_336).with_repeat_kv(false);
        let parameters = 32 * layer_parameters(&model) + rest_parameters(&model);
        let config = |sp: usize, seq_len: usize, single: bool, every: usize| {
            TrainConfig::new(model.clone(), AdamWConfig::new(), ParallelLayout::new().with_sp_size(sp))
                .with_batch_size(1)
                .with_seq_len(seq_len)
                .with_eval_every(every)
                .with_eval_single_device(single)
                .with_layer_checkpointing(Some(LayerCheckpointing::new().with_offload_to_host(true).with_tile_tokens(Some(4096))))
        };
        let evaluation = |config: &TrainConfig| single_device_evaluation(config, parameters, 2);
        assert_eq!(evaluation(&config(8, 1_048_576, false, 10)), None, "the SP group evaluates");
        assert_eq!(evaluation(&config(8, 1_048_576, true, 0)), None, "no evaluation");
        let (sp8, sp1) = (evaluation(&config(8, 1_048_576, true, 10)).unwrap(), evaluation(&config(1, 1_048_576, true, 10)).unwrap());
        assert_eq!(sp8, sp1, "whole sequences whatever the SP size (the replicated state alike)");
        // Per token: the residual stream and a layer's output in bf16, and the larger of the
        // core (q, k, v and the output in bf16 over 32 q and 8 kv heads of 128, the f32
        // statistics of each q head) and the head's piece (the final norm's f32 copy of the
        // stream and its square), the head's here.
        let longer = evaluation(&config(8, 2_097_152, true, 10)).unwrap();
        let core = (2 * 32 + 2 * 8) * 128 * 2 + 32 * 4;
        assert!(core < 8 * 4096);
        assert_eq!(longer - sp8, 1_048_576 * (2 * 4096 * 2 + 8 * 4096));
        // With k and v repeated to every q head, the core is the larger, by its statistics (128
        // bytes a token, past the head's constant parts from about 10M tokens on).
        let repeated = |seq_len: usize| {
            let mut config = config(8, seq_len, true, 10);
            config.model = config.model.clone().with_repeat_kv(true);
            single_device_evaluation(&config, parameters, 2).unwrap()
        };
        assert_eq!(repeated(1 << 25) - repeated(1 << 24), (1 << 24) * (2 * 4096 * 2 + (2 * 32 + 2 * 32) * 128 * 2 + 32 * 4));
        let step = estimated_peak(&config(8, 1_048_576, true, 10), parameters, 2).unwrap();
        assert!(sp8 > step, "{sp8} > {step}");
        let said = describe(&config(8, 1_048_576, true, 10), parameters, 2, 0);
        assert!(said.contains("to evaluate whole sequences alone (--eval-single-device), more than a step"), "{said}");
    }

    /// What the review found the estimate left out: the flash backward's f32 dq sum and its
    /// rows' statistics (2.4 times short of the 8B shape's core backward), the head's gradient
    /// summed in f32 over tiles, an f32 head's weight and chunk gradients, and a tile's
    /// gradients of a layer without ZeRO-3. Per token, or per head weight element (V · d).
    #[test]
    fn the_flash_backward_the_heads_f32_sums_and_a_tiles_layer_gradients_are_counted() {
        let (short, long) = (activations(65_536, 1, 1, Some(4096)), activations(131_072, 1, 1, Some(4096)));
        // dq, dk, dv in bf16; dq summed in f32; D and the statistics in f32, three a row.
        assert_eq!(long.core_backward - short.core_backward, 65_536 * ((32 + 2 * 8) * 128 * 2 + 32 * 128 * 4 + 3 * 32 * 4));
        let head_weight = 128_256 * 4096;
        let config = |f32_head: bool, tile_tokens: usize, zero: usize| {
            let model = DecoderConfig::new(128_256).with_d_model(4096).with_n_layers(32).with_n_heads(32).with_n_kv_heads(8).with_ffn_hidden(14_336);
            TrainConfig::new(model, AdamWConfig::new(), ParallelLayout::new())
                .with_batch_size(1)
                .with_seq_len(8192)
                .with_f32_head(f32_head)
                .with_zero_stage(zero)
                .with_offload_optimizer(zero == 3)
                .with_layer_checkpointing(Some(LayerCheckpointing::new().with_tile_tokens(Some(tile_tokens))))
        };
        let head = |f32_head, tile_tokens| StepActivations::of(&config(f32_head, tile_tokens, 3), 2).unwrap().head;
        // Two tiles: the f32 sum of the first beside the second's chunks (the chunks' sums in
        // f32: 18 bytes an element, 14 at one tile; a tile of 4096 rows holds half the hidden
        // states and their gradients, bf16); an f32 head: its weight and chunk gradients in f32.
        assert_eq!(head(false, 4096) + 2 * 2 * 4096 * 4096 - head(false, 8192), 4 * head_weight);
        assert_eq!(head(true, 4096) - head(false, 4096), 6 * head_weight);
        // Without ZeRO-3, f32 parameters: a tile's gradients of a layer, their cast, and the
        // layer's weights cast to bf16 for each piece.
        let replicated = StepActivations::of(&config(false, 4096, 0), 2).unwrap();
        assert_eq!(replicated.gathered, layer_parameters(&config(false, 4096, 0).model) * (2 + 4 + 2));
        // ZeRO-3 with the optimizer on the host, one rank: the layer gathered (bf16) and summed
        // (f32), a tile's gradients and their cast, and the untied head's f32 parts waiting on
        // the device for the host through the last layer's pieces.
        let layer = layer_parameters(&config(false, 4096, 3).model);
        assert_eq!(StepActivations::of(&config(false, 4096, 3), 2).unwrap().gathered, layer * (2 + 4) + layer * (2 + 4) + 4 * head_weight);
    }

    /// A zigzag ring's shard is of the sequence padded to twice the SP degree, as the sharder
    /// pads it: 12 tokens over sp 4 (ring 2) are 16, 4 a rank (3 before).
    #[test]
    fn a_zigzag_rings_shard_is_of_the_padded_sequence() {
        let model = DecoderConfig::new(64).with_d_model(32).with_n_heads(4).with_n_kv_heads(4).with_ffn_hidden(64);
        let layout = |sharding| ParallelLayout::new().with_sp_size(4).with_ring_size(2).with_ring_sharding(sharding);
        let shard = |sharding| micro_batch(&TrainConfig::new(model.clone(), AdamWConfig::new(), layout(sharding)).with_batch_size(1).with_seq_len(12)).1;
        assert_eq!((shard(burn_ulysses::ring::RingSharding::Contiguous), shard(burn_ulysses::ring::RingSharding::Zigzag)), (3, 4));
    }

    #[test]
    fn the_core_grows_with_the_tokens_a_rank_attends_over_and_the_tiles_do_not() {
        let (short, long) = (activations(65_536, 1, 1, Some(4096)), activations(131_072, 1, 1, Some(4096)));
        // q, k, v, the output and its gradient in bf16 and the statistics in f32, a token:
        // (3 · 32 + 2 · 8) · 128 · 2 + 32 · 4 bytes.
        assert_eq!(long.core - short.core, 65_536 * ((3 * 32 + 2 * 8) * 128 * 2 + 32 * 4));
        assert_eq!((long.tile, long.head, long.kept), (short.tile, short.head, short.kept));
        // SP = 4 as Ulysses: a quarter of the heads over the whole sequence, plus the layouts
        // the exchanges make; as a ring: the whole heads over a quarter, plus blocks in flight.
        let (ulysses, ring) = (activations(131_072, 4, 1, Some(4096)), activations(131_072, 4, 4, Some(4096)));
        assert_eq!((ulysses.core_tokens, ulysses.core_heads, ring.core_tokens, ring.core_heads), (131_072, 8, 32_768, 32));
        assert!(ulysses.core < long.core / 2 && ring.core < long.core / 2, "{ulysses:?} {ring:?} {long:?}");
        // Without tiles the token-wise parts run on the whole shard.
        assert_eq!(activations(131_072, 1, 1, None).tile, long.tile * 32);
    }

    /// `--offload-layers N`: the device keeps the later layers' inputs and the gradients
    /// passed between their pieces, the host the first N's and theirs.
    #[test]
    fn the_first_layers_inputs_offloaded_leave_the_rest_on_the_device() {
        let model = DecoderConfig::new(128_256).with_d_model(4096).with_n_layers(32).with_n_heads(32).with_n_kv_heads(8).with_ffn_hidden(14_336);
        let config = |checkpointing: LayerCheckpointing| {
            TrainConfig::new(model.clone(), AdamWConfig::new(), ParallelLayout::new()).with_batch_size(1).with_seq_len(131_072).with_layer_checkpointing(Some(checkpointing))
        };
        // A hidden state of the whole sequence in bf16.
        let hidden = 131_072 * 4096 * 2;
        let offloaded = LayerCheckpointing::new().with_offload_to_host(true);
        for (checkpointing, device, host) in [
            (LayerCheckpointing::new(), 35, 0),
            (offloaded.clone(), 0, 35),
            (offloaded.clone().with_offload_layers(Some(8)), 27, 10),
            (offloaded.clone().with_offload_layers(Some(32)), 2, 34),
        ] {
            let config = config(checkpointing.clone());
            assert_eq!(StepActivations::of(&config, 2).unwrap().kept, device * hidden, "{checkpointing:?}");
            assert_eq!(offloaded_host_bytes(&config, 2), host * hidden, "{checkpointing:?}");
        }
        let some = describe(&config(offloaded.with_offload_layers(Some(4))), counted(&model), 2, 0);
        assert!(some.contains("a larger --offload-layers (now 4 of 32)"), "{some}");
    }

    /// `--check --device-memory --host-memory`: the least offloaded place that fits, and the
    /// longest length that fits somewhere, each the boundary (one layer less offloaded, or one
    /// step longer, does not fit). The 8B shape, ZeRO-3, everything on the host but the layer
    /// inputs, one rank.
    #[test]
    fn the_plan_for_a_machine_offloads_least_and_goes_longest() {
        let model = DecoderConfig::new(128_256).with_d_model(4096).with_n_layers(32).with_n_heads(32).with_n_kv_heads(8).with_ffn_hidden(14_336).with_repeat_kv(false);
        let parameters = counted(&model);
        let config = TrainConfig::new(model, AdamWConfig::new(), ParallelLayout::new())
            .with_batch_size(1)
            .with_seq_len(262_144)
            .with_zero_stage(3)
            .with_offload_optimizer(true)
            .with_offload_parameters(true)
            .with_layer_checkpointing(Some(LayerCheckpointing::new().with_tile_tokens(Some(4096))));
        let machine = |device_gb: u64, host_gb: u64| Machine { device_bytes: device_gb * 1_000_000_000, host_bytes: Some(host_gb * 1_000_000_000), ranks_per_host: 1 };
        let fits = |config: &TrainConfig, machine: &Machine| {
            let (device, host) = needs(config, parameters, 2, machine.ranks_per_host).unwrap();
            machine.holds(device, host)
        };
        let at = |config: &TrainConfig, place: InputsAt| config.clone().with_layer_checkpointing(Some(place.applied(config.layer_checkpointing.as_ref().unwrap())));
        // 88 GB on the device with every input there.
        assert_eq!(fitting_place(&config, parameters, 2, &machine(149, 1000)).map(|p| p.0), Some(InputsAt::Device));
        // An 80 GB device: the fewest first layers on the host that leave it enough.
        let (place, device, _) = fitting_place(&config, parameters, 2, &machine(80, 1000)).expect("fits with some offloaded");
        let InputsAt::FirstOnHost(n) = place else { panic!("{place:?}") };
        assert!(device <= 80_000_000_000 && fits(&at(&config, place), &machine(80, 1000)));
        assert!(!fits(&at(&config, if n == 1 { InputsAt::Device } else { InputsAt::FirstOnHost(n - 1) }), &machine(80, 1000)), "{n}");
        // A host that holds the optimizer's 128.5 GB and no layer input: nothing fits an 80 GB device.
        assert_eq!(fitting_place(&config, parameters, 2, &machine(80, 130)), None);
        // The longest: fits, and a step more does not, wherever the inputs go.
        for machine in [machine(149, 137), machine(80, 1000), machine(149, 170)] {
            let (tokens, place) = longest_fitting(&config, parameters, 2, &machine, 1024, 1 << 26).expect("some length fits");
            let longer = config.clone().with_seq_len(tokens + 1024);
            assert!(fits(&at(&config.clone().with_seq_len(tokens), place), &machine), "{machine:?}: {tokens}");
            assert!(fitting_place(&longer, parameters, 2, &machine).is_none(), "{machine:?}: {} fits too", tokens + 1024);
        }
        // Nothing fits a device of a byte.
        assert_eq!(longest_fitting(&config, parameters, 2, &Machine { device_bytes: 1, host_bytes: None, ranks_per_host: 1 }, 1024, 1 << 26), None);
        // World rank 0 evaluating whole sequences (--eval-single-device) needs more than the
        // step where every input is on the host: a device between the two holds the step and
        // not the run, wherever the inputs go, and the longest length is shorter.
        let mut evaluated = config.clone().with_eval_single_device(true).with_eval_every(10);
        evaluated.layout = ParallelLayout::new().with_sp_size(8);
        let step = estimated_peak(&at(&evaluated, InputsAt::Host), parameters, 2).unwrap();
        let evaluation = single_device_evaluation(&evaluated, parameters, 2).unwrap();
        assert!(evaluation > step, "{evaluation} > {step}");
        assert_eq!(needs(&evaluated, parameters, 2, 1).unwrap().0.max(evaluation), needs(&evaluated, parameters, 2, 1).unwrap().0);
        let between = Machine { device_bytes: (step + evaluation) / 2, host_bytes: None, ranks_per_host: 1 };
        assert!(fitting_place(&evaluated.clone().with_eval_single_device(false), parameters, 2, &between).is_some());
        assert_eq!(fitting_place(&evaluated, parameters, 2, &between), None);
        let longest = |config: &TrainConfig| longest_fitting(config, parameters, 2, &between, 8192, 1 << 26).map(|(tokens, _)| tokens);
        assert!(longest(&evaluated) < longest(&evaluated.clone().with_eval_single_device(false)));
    }

    #[test]
    fn what_would_cut_the_largest_parts_is_named() {
        let model = DecoderConfig::new(128_256).with_d_model(4096).with_n_layers(32).with_n_heads(32).with_n_kv_heads(8).with_ffn_hidden(14_336);
        let run = |checkpointing: LayerCheckpointing| {
            let config = TrainConfig::new(model.clone(), AdamWConfig::new(), ParallelLayout::new()).with_batch_size(1).with_seq_len(131_072).with_layer_checkpointing(Some(checkpointing));
            describe(&config, counted(&model), 2, 0)
        };
        // The whole shard as one tile (51.5 GB), the layer inputs on the device (37.6 GB).
        let untiled = run(LayerCheckpointing::new());
        assert!(untiled.contains("--tile-tokens 4096 runs the token-wise parts in tiles") && untiled.contains("--offload-to-host keeps the layer inputs"), "{untiled}");
        let tiled = run(LayerCheckpointing::new().with_offload_to_host(true).with_tile_tokens(Some(4096)));
        assert!(!tiled.contains("--tile-tokens") && !tiled.contains("--offload-to-host") && tiled.contains("--zero 3"), "{tiled}");
    }
}
