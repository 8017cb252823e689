//! Whole-layer activation checkpointing: a training step that keeps only each layer's input
//! (on the device or in host memory) and recomputes the layer in the backward.
//!
//! How, and why this way: burn 0.21's autodiff cannot run a backward inside a backward (a
//! custom node that re-ran its layer under autodiff and called `backward` would deadlock:
//! `backward` ends by locking every graph of the process, the running one included), and
//! its checkpoint strategies only recompute memory-bound ops, so every matmul output of
//! every layer stays alive. So the step itself does it, layer by layer, with top-level
//! backwards only:
//! 1. forward on the inner backend (no autodiff graph at all), keeping each layer's input;
//! 2. the head and the loss on the autodiff backend from the last hidden state (a leaf):
//!    `backward` gives the head's gradients and the hidden state's;
//! 3. from the last layer to the first: the layer re-run from its kept input (a leaf), and
//!    `backward` of `Σ output · upstream` gives its parameters' gradients and its input's,
//!    the next layer's upstream;
//! 4. the embedding likewise.
//!
//! Every rank runs the same layers in the same order in both passes, so the collectives
//! inside them (the attention exchanges) stay in step. Peak activation memory is the kept
//! inputs (`layers × B × S × d`) plus one layer's graph, instead of every layer's graph.
//!
//! **Tiled MLP** (ALST's TiledMLP, [`LayerCheckpointing::mlp_tile_tokens`]): a layer is its
//! sequence-mixing half (attention) then its token-wise half (the MLP), and the token-wise
//! half treats every token alone, so it can run on slices of the sequence. In both passes it
//! runs one tile at a time; in step 3 each tile is a leaf cut from the re-run attention
//! half's output, with its own top-level `backward`, and the tiles' input gradients,
//! joined, are the upstream of the attention half's `backward`. The `S × ffn`
//! intermediates then exist for one tile at a time. The tile count is the same on every
//! rank ([`LayerCheckpointing::mlp_tiles`] over the step's shard lengths of all ranks).
//! Where ranks are threads of one process, they meet at a barrier before the attention
//! half's backward ([`crate::context::sync_thread_ranks`] says why).

use burn::{
    config::Config,
    module::{AutodiffModule, Module},
    optim::{GradientsAccumulator, GradientsParams},
    tensor::{ElementConversion, Int, Tensor, TensorData, backend::{AutodiffBackend, Backend}},
};

use super::{LmOutput, TrainBackend, lm_loss_sum};
use crate::{data::ShardPositions, error::UlyssesError};

/// A causal LM cut into the pieces whole-layer checkpointing runs one at a time. Implement
/// it for every backend (`impl<B: Backend> LayeredLm<B> for MyModel<B>`): the forward runs
/// on the inner backend, the recomputation on the autodiff one.
pub trait LayeredLm<B: Backend>: Module<B> {
    /// What every layer needs besides its input (rotary tables, document boundaries),
    /// built once per shard.
    type Context;
    fn context(&self, positions: &ShardPositions, device: &B::Device) -> Self::Context;
    /// The hidden states before the first layer, `[batch, seq, d_model]`.
    fn embed(&self, tokens: Tensor<B, 2, Int>, context: &Self::Context) -> Tensor<B, 3>;
    fn layer_count(&self) -> usize;
    /// The first half of layer `index`, whatever mixes tokens along the sequence (attention,
    /// with its norm and residual): `[batch, seq, d_model]` in and out, on the whole shard.
    /// Must be deterministic: the backward runs it again.
    fn sequence_mixing(&self, index: usize, hidden: Tensor<B, 3>, context: &Self::Context) -> Tensor<B, 3>;
    /// The second half of layer `index` (the MLP, with its norm and residual): every token
    /// on its own, so that it may run on any slice `[batch, tile, d_model]` of the sequence.
    /// A layer with nothing token-wise after its mixing returns `hidden`.
    fn token_wise(&self, index: usize, hidden: Tensor<B, 3>) -> Tensor<B, 3>;
    /// Layer `index`: its token-wise half after its sequence-mixing one.
    fn layer(&self, index: usize, hidden: Tensor<B, 3>, context: &Self::Context) -> Tensor<B, 3> {
        self.token_wise(index, self.sequence_mixing(index, hidden, context))
    }
    /// What the loss is computed from, given the last layer's output.
    fn head(&self, hidden: Tensor<B, 3>) -> LmOutput<B>;
}

/// Whole-layer activation checkpointing (see the module doc).
#[derive(Config, Debug)]
pub struct LayerCheckpointing {
    /// Keep the layer inputs in host memory between the passes (copied back one layer at a
    /// time in the backward), not on the device.
    #[config(default = false)]
    pub offload_to_host: bool,
    /// Run each layer's token-wise half (the MLP) over sequence tiles of about this many
    /// tokens of the local shard, so its `S × ffn` intermediates exist one tile at a time
    /// (ALST uses `d_model`: a tile's intermediates then weigh about one MLP weight).
    /// `None`: the whole shard at once.
    #[config(default = "None")]
    pub mlp_tile_tokens: Option<usize>,
}

/// The shortest and the longest local shard (tokens per sequence) of one step, over every
/// rank and micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardLengths {
    pub shortest: usize,
    pub longest: usize,
}

impl LayerCheckpointing {
    /// Refuses settings that cannot work, before any step runs.
    pub fn check(&self) -> Result<(), UlyssesError> {
        if self.mlp_tile_tokens == Some(0) {
            return Err(UlyssesError::InvalidConfig(
                "mlp_tile_tokens is 0, but a tile holds at least one token: use a positive count (ALST uses \
                 d_model) or None for an untiled MLP"
                    .into(),
            ));
        }
        Ok(())
    }

    /// How many tiles the token-wise halves run in, in a step whose shards span `lengths`
    /// over every rank: `⌈longest / mlp_tile_tokens⌉`, but no more than the shortest shard
    /// has tokens (no tile is empty); 1 without tiling. Every rank gets the same count, so
    /// a collective inside a token-wise half would stay in step.
    pub fn mlp_tiles(&self, lengths: ShardLengths) -> Result<usize, UlyssesError> {
        self.check()?;
        Ok(match self.mlp_tile_tokens {
            None => 1,
            Some(tokens) => lengths.longest.div_ceil(tokens).clamp(1, lengths.shortest.max(1)),
        })
    }
}

/// `tiles` near-equal consecutive ranges covering `0..len`, none empty (`tiles ≤ len`).
fn tile_ranges(len: usize, tiles: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..tiles).map(move |t| t * len / tiles..(t + 1) * len / tiles)
}

/// Layer `index`'s token-wise half on `hidden`, one sequence tile at a time (no graph is
/// kept here: the forward of step 1).
fn token_wise_in_tiles<B: Backend, M: LayeredLm<B>>(model: &M, index: usize, hidden: Tensor<B, 3>, tiles: usize) -> Tensor<B, 3> {
    if tiles == 1 {
        return model.token_wise(index, hidden);
    }
    let len = hidden.dims()[1];
    let outputs = tile_ranges(len, tiles).map(|range| model.token_wise(index, hidden.clone().narrow(1, range.start, range.len()))).collect();
    Tensor::cat(outputs, 1)
}

/// A layer input kept between the passes.
enum Kept<B: Backend> {
    Device(Tensor<B, 3>),
    Host(TensorData),
}

impl<B: Backend> Kept<B> {
    fn keep(tensor: Tensor<B, 3>, offload: bool) -> Self {
        if offload { Kept::Host(tensor.into_data()) } else { Kept::Device(tensor) }
    }

    fn restore(self, device: &B::Device) -> Tensor<B, 3> {
        match self {
            Kept::Device(tensor) => tensor,
            // In its own dtype: `from_data` alone would make an f32 tensor of a bf16 input.
            Kept::Host(data) => {
                let dtype = data.dtype;
                Tensor::from_data(data, (device, dtype))
            }
        }
    }
}

/// Loss `Σ_shard CE · weight` of one shard and the gradients of every parameter, with
/// whole-layer checkpointing: the same values as `backward` through the whole model.
/// `mlp_tiles` (from [`LayerCheckpointing::mlp_tiles`], at most the shard's length) is the
/// token-wise halves' tile count. `probe` runs whenever a piece's graph is complete, just
/// before its backward (the points where the step holds the most; the memory bench samples
/// there).
#[allow(clippy::too_many_arguments)]
pub fn checkpointed_backward<B, M>(
    model: &M,
    tokens: Tensor<B, 2, Int>,
    labels: Tensor<B, 2, Int>,
    positions: &ShardPositions,
    weight: f64,
    ignore_index: i64,
    checkpointing: &LayerCheckpointing,
    mlp_tiles: usize,
    mut probe: impl FnMut(),
) -> Result<(f64, GradientsParams), UlyssesError>
where
    B: TrainBackend,
    M: AutodiffModule<B> + LayeredLm<B>,
    M::InnerModule: LayeredLm<B::InnerBackend>,
{
    let device = tokens.device();
    let layers = model.layer_count();
    let shard_len = tokens.dims()[1];
    if mlp_tiles == 0 || mlp_tiles > shard_len {
        return Err(UlyssesError::InvalidConfig(format!(
            "{mlp_tiles} MLP tiles for a shard of {shard_len} tokens: each tile needs at least one token \
             (LayerCheckpointing::mlp_tiles gives a count that fits)"
        )));
    }

    // 1. Forward without a graph, keeping each layer's input.
    let inner = model.valid();
    let inner_context = inner.context(positions, &device);
    let mut kept = Vec::with_capacity(layers);
    let mut hidden = inner.embed(tokens.clone().inner(), &inner_context);
    for index in 0..layers {
        kept.push(Kept::keep(hidden.clone(), checkpointing.offload_to_host));
        let mixed = inner.sequence_mixing(index, hidden, &inner_context);
        hidden = token_wise_in_tiles(&inner, index, mixed, mlp_tiles);
    }
    drop((inner, inner_context));

    // 2. Head and loss.
    let mut accumulator = GradientsAccumulator::<M>::new();
    let last = Tensor::<B, 3>::from_inner(hidden).require_grad();
    let loss = lm_loss_sum(model.head(last.clone()), labels, ignore_index) * weight;
    let loss_value = loss.clone().into_scalar().elem::<f64>();
    probe();
    let grads = loss.backward();
    let mut upstream = upstream_of(&last, &grads, "the head")?;
    accumulator.accumulate(model, GradientsParams::from_grads(grads, model));

    // 3. Layers, last first, each re-run from its input: the sequence-mixing half with its
    //    graph kept, then the token-wise half tile by tile from leaves cut from its output,
    //    then the mixing half's backward with the tiles' input gradients joined.
    let context = model.context(positions, &device);
    for index in (0..layers).rev() {
        let input = Tensor::<B, 3>::from_inner(kept.pop().expect("one kept input per layer").restore(&device)).require_grad();
        let mixed = model.sequence_mixing(index, input.clone(), &context);
        let mixed_values = mixed.clone().inner();
        let mut mixed_upstream = Vec::with_capacity(mlp_tiles);
        for range in tile_ranges(shard_len, mlp_tiles) {
            let tile = Tensor::<B, 3>::from_inner(mixed_values.clone().narrow(1, range.start, range.len())).require_grad();
            let output = model.token_wise(index, tile.clone());
            probe();
            let tile_upstream = upstream.clone().narrow(1, range.start, range.len());
            let grads = (output * Tensor::from_inner(tile_upstream)).sum().backward();
            mixed_upstream.push(upstream_of(&tile, &grads, "a layer's token-wise half")?);
            accumulator.accumulate(model, GradientsParams::from_grads(grads, model));
        }
        // The layer's output gradient is in the tiles' now: not kept through the backward.
        drop((mixed_values, upstream));
        let seed = (mixed * Tensor::from_inner(Tensor::cat(mixed_upstream, 1))).sum();
        probe();
        // The tiles' backwards had no collective; this one has. Peers that are threads of
        // this process must not be inside it while this rank still runs tiles.
        crate::context::sync_thread_ranks::<B::Wire>()?;
        let grads = seed.backward();
        upstream = upstream_of(&input, &grads, "a layer's sequence-mixing half")?;
        accumulator.accumulate(model, GradientsParams::from_grads(grads, model));
    }

    // 4. Embedding.
    let embedded = model.embed(tokens, &context);
    let grads = (embedded * Tensor::from_inner(upstream)).sum().backward();
    accumulator.accumulate(model, GradientsParams::from_grads(grads, model));
    Ok((loss_value, accumulator.grads()))
}

/// The gradient of `input` (a leaf) in `grads`: what flows on to the piece before it.
fn upstream_of<B: AutodiffBackend>(input: &Tensor<B, 3>, grads: &B::Gradients, piece: &str) -> Result<Tensor<B::InnerBackend, 3>, UlyssesError> {
    input.grad(grads).ok_or_else(|| UlyssesError::InModel {
        message: format!("layer checkpointing: {piece} does not depend on its input (LayeredLm must chain embed, layer 0..n and head)"),
    })
}
