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
//!   `--offload-to-host`;
//! - **the attention core**, the only piece on the whole shard: q, k and v as the core's
//!   inputs, its output and the output's gradient (q's size each), the softmax statistics
//!   (f32); under Ulysses (ulysses > 1) q, k, v and the output as the attention saved them,
//!   exchanged (the sequence's `S · ulysses` tokens, `1/ulysses` of the heads), beside the
//!   inputs and the gradient in the shard's layout; at its backward dq, dk and dv, in both
//!   layouts under Ulysses;
//! - **a tile** of the token-wise parts (norms, projections, RoPE, the MLP) of
//!   `--tile-tokens` tokens (the whole shard without it), with its graph and backward;
//! - **the loss**: a tile's logits in chunks ([`ulysses_training::default_chunk_rows`]) in
//!   f32, with their softmax and gradient;
//! - under ZeRO-3, the layer gathered for its piece and the next one, its gradients in f32
//!   before they are reduce-scattered, and the head's gradient whole.
//!
//! The peak is the kept tensors plus the largest of the head's piece and a layer's. The
//! tensors are those the code holds; what the backend's pools reserve beyond them (CubeCL
//! rounds to pages) comes on top. `tests/activation_memory.rs` holds the estimate against what
//! a step holds, counted by the allocator on the CPU.

use ulysses_models::DecoderConfig;

use crate::train::TrainConfig;

/// Bytes a rank's device keeps between steps for each of `parameters` (a lower bound: a step's
/// activations and gathered layer come on top): replicated without the host optimizer, the
/// f32 parameters, their gradients and AdamW's two moments (16); with it, the compute copy and
/// its gradients; under `--zero 3` a 1/world part of what the device keeps: the compute copy's
/// (none with `--offload-parameters`), and with the optimizer on the device its f32 master
/// weights, moments and gradients too.
pub fn device_state_bytes(config: &TrainConfig, parameters: u64, compute_bytes: u64) -> u64 {
    let world = config.layout.world_size() as u64;
    match (config.zero_stage, config.offload_optimizer) {
        (3, true) if config.offload_parameters => 0,
        (3, true) => compute_bytes * parameters / world,
        (3, false) => (compute_bytes + 16) * parameters / world,
        (_, true) => 2 * compute_bytes * parameters,
        (_, false) => 16 * parameters,
    }
}

/// Bytes a rank keeps in host memory for each of `parameters` with `--offload-optimizer`: of
/// its 1/world part, 12 of AdamW's state (master weights and both moments) and 4 of the step's
/// gradient (`ShardedAdamW::check_host_memory`, which the run checks as it starts).
pub fn host_state_bytes(config: &TrainConfig, parameters: u64) -> u64 {
    if config.offload_optimizer { 16 * parameters.div_ceil(config.layout.world_size() as u64) } else { 0 }
}

/// The parameters of one of `model`'s layers: the attention's projections, the MLP's three,
/// the two norms (and Qwen3's q and k norms, Qwen2's q/k/v biases).
pub fn layer_parameters(model: &DecoderConfig) -> u64 {
    let (d, hd, f) = (model.d_model as u64, model.head_dim() as u64, model.ffn_hidden as u64);
    let (q, kv) = (model.n_heads as u64 * hd, model.n_kv_heads as u64 * hd);
    let attention = d * (q + 2 * kv) + q * d + if model.qkv_bias { q + 2 * kv } else { 0 } + if model.qk_norm { 2 * hd } else { 0 };
    attention + 3 * d * f + 2 * d
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
    /// One token-wise tile with its graph and backward, beside the core's tensors.
    pub tile: u64,
    /// The head's piece: a tile's logits in chunks, their softmax and gradient.
    pub head: u64,
    /// Under ZeRO-3: gathered layers and their gradients, the head's gradient whole.
    pub gathered: u64,
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
        self.kept + self.gathered + self.head.max(self.core + self.tile.max(self.core_backward))
    }

    /// The estimate for one rank of a run of `config` whose layers compute in
    /// `compute_bytes`-byte floats, or `None` without layer checkpointing.
    pub fn of(config: &TrainConfig, compute_bytes: u64) -> Option<Self> {
        let checkpointing = config.layer_checkpointing.as_ref()?;
        let model = &config.model;
        let layout = &config.layout;
        let cb = compute_bytes;
        let (ulysses, ring) = (layout.ulysses_size() as u64, layout.ring_size as u64);
        let rows = (config.batch_size / layout.dp_size / config.grad_accumulation).max(1) as u64;
        let shard = config.seq_len.div_ceil(layout.sp_size) as u64;
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
        // while it computes on another.
        let ring_blocks = if ring > 1 { 4 * kv_exchanged } else { 0 };
        let core = cb * (held + ring_blocks) + statistics;

        // A tile of the token-wise parts, forward graph and backward: the after-core part is
        // the larger (the output projection's input, the residuals, the norm's four tensors,
        // the MLP's gate, up, their activation and product, the down projection's output),
        // with the gradients of about as many as its backward runs.
        let tile_tokens = checkpointing.tile_tokens.map_or(shard, |t| (t as u64).min(shard).max(1));
        let tile_rows = rows * tile_tokens;
        let tile = cb * 2 * tile_rows * (heads * hd + 9 * d + 4 * f);

        // The loss: a tile's logits a chunk at a time, in f32, with their softmax and gradient.
        let chunk = (ulysses_training::default_chunk_rows(model.vocab_size) as u64).min(tile_rows);
        let head = 3 * 4 * chunk * vocab + cb * 2 * tile_rows * d;

        let kept = if checkpointing.offload_to_host { 0 } else { (model.n_layers as u64 + 3) * rows * shard * d * cb };
        let gathered = if config.zero_stage == 3 {
            // Two layers' compute copies (the next gathered early), one layer's f32 gradients,
            // an untied head's f32 gradient whole through the layers' backward.
            let head_gradient = if model.tie_embeddings { 0 } else { 4 * vocab * d };
            layer_parameters(model) * (2 * cb + 4) + head_gradient
        } else {
            0
        };
        Some(Self { kept, core, core_backward: cb * backward, tile, head, gathered, rows, core_tokens, core_heads })
    }
}

/// What `--check` says of a rank's memory: `parameters` the model's count, `compute_bytes`
/// the layers' float size, `host_offloaded` what `--offload-to-host` keeps in host memory.
pub fn describe(config: &TrainConfig, parameters: u64, compute_bytes: u64, host_offloaded: u64) -> String {
    let gb = |bytes: u64| format!("{:.2} GB", bytes as f64 / 1e9);
    let states = device_state_bytes(config, parameters, compute_bytes);
    let host = match (host_state_bytes(config, parameters), host_offloaded) {
        (0, 0) => String::new(),
        (state, offloaded) => {
            let what = [(state, "the optimizer's state and gradient parts"), (offloaded, "layer inputs and gradients")]
                .iter()
                .filter(|(bytes, _)| *bytes > 0)
                .map(|(bytes, what)| format!("{} of {what}", gb(*bytes)))
                .collect::<Vec<_>>();
            format!("; a rank's host memory keeps {}", what.join(" and "))
        }
    };
    let Some(a) = StepActivations::of(config, compute_bytes) else {
        return format!(
            "a rank's device keeps {} between steps ({parameters} parameters, their gradients and optimizer state), and a step every layer's activations on top \
             (not estimated; --checkpoint-layers keeps one layer's){host}",
            gb(states)
        );
    };
    let peak = states + a.peak();
    let mut parts = vec![
        format!("{} kept between steps ({parameters} parameters, their gradients and optimizer state)", gb(states)),
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
        parts.push(format!("ZeRO-3's gathered layers and gradients {}", gb(a.gathered)));
    }
    // What would cut the parts of an eighth of the peak or more.
    let large = |bytes: u64| 8 * bytes >= peak;
    let checkpointing = config.layer_checkpointing.as_ref().expect("an estimate is made for checkpointed steps");
    let mut cuts = Vec::new();
    if large(a.tile) && checkpointing.tile_tokens.is_none() {
        cuts.push(format!("--tile-tokens {} runs the token-wise parts in tiles (ALST's size: d_model)", config.model.d_model));
    }
    if large(a.kept) {
        cuts.push("--offload-to-host keeps the layer inputs in host memory".to_string());
    }
    if large(a.core + a.core_backward) {
        cuts.push("more --sp ranks share the attention core".to_string());
    }
    if large(states) && config.zero_stage != 3 {
        cuts.push("--zero 3 (with --offload-optimizer) shares the model state over the ranks".to_string());
    }
    let cuts = if cuts.is_empty() { String::new() } else { format!(". To need less: {}", cuts.join("; ")) };
    format!("a rank's device needs about {} at a step's peak, estimated: {}{host}; the backend's pools reserve more{cuts}", gb(peak), parts.join(", "))
}

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;
    use burn_ulysses::ParallelLayout;
    use burn::optim::AdamWConfig;
    use ulysses_training::{LayerCheckpointing, parameter_elements};

    use super::*;

    /// A model's parameters, counted on its lazily built tensors.
    fn counted(model: &DecoderConfig) -> u64 {
        parameter_elements(&model.init::<NdArray<f32>>(&Default::default())).iter().sum::<usize>() as u64
    }

    #[test]
    fn a_layer_has_the_parameters_of_the_built_model_s_layers() {
        let llama = DecoderConfig::new(300).with_d_model(64).with_n_heads(4).with_n_kv_heads(2).with_ffn_hidden(96);
        let qwen2 = llama.clone().with_qkv_bias(true).with_tie_embeddings(true);
        let qwen3 = llama.clone().with_qk_norm(true).with_head_dim(Some(32));
        for model in [llama, qwen2, qwen3] {
            let (one, three) = (counted(&model.clone().with_n_layers(1)), counted(&model.clone().with_n_layers(3)));
            assert_eq!(three - one, 2 * layer_parameters(&model), "{model:?}");
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
