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

use burn::{
    config::Config,
    module::{AutodiffModule, Module},
    optim::{GradientsAccumulator, GradientsParams},
    tensor::{ElementConversion, Int, Tensor, TensorData, backend::{AutodiffBackend, Backend}},
};

use super::{LmOutput, lm_loss_sum};
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
    /// Layer `index` on `hidden`, `[batch, seq, d_model]` in and out. Must be
    /// deterministic: the backward runs it again.
    fn layer(&self, index: usize, hidden: Tensor<B, 3>, context: &Self::Context) -> Tensor<B, 3>;
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
            Kept::Host(data) => Tensor::from_data(data, device),
        }
    }
}

/// Loss `Σ_shard CE · weight` of one shard and the gradients of every parameter, with
/// whole-layer checkpointing: the same values as `backward` through the whole model.
/// `probe` runs whenever a piece's graph is complete, just before its backward (the points
/// where the step holds the most; the memory bench samples there).
pub fn checkpointed_backward<B, M>(
    model: &M,
    tokens: Tensor<B, 2, Int>,
    labels: Tensor<B, 2, Int>,
    positions: &ShardPositions,
    weight: f64,
    ignore_index: i64,
    checkpointing: &LayerCheckpointing,
    mut probe: impl FnMut(),
) -> Result<(f64, GradientsParams), UlyssesError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B> + LayeredLm<B>,
    M::InnerModule: LayeredLm<B::InnerBackend>,
{
    let device = tokens.device();
    let layers = model.layer_count();

    // 1. Forward without a graph, keeping each layer's input.
    let inner = model.valid();
    let inner_context = inner.context(positions, &device);
    let mut kept = Vec::with_capacity(layers);
    let mut hidden = inner.embed(tokens.clone().inner(), &inner_context);
    for index in 0..layers {
        kept.push(Kept::keep(hidden.clone(), checkpointing.offload_to_host));
        hidden = inner.layer(index, hidden, &inner_context);
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

    // 3. Layers, last first, each re-run from its input.
    let context = model.context(positions, &device);
    for index in (0..layers).rev() {
        let input = Tensor::<B, 3>::from_inner(kept.pop().expect("one kept input per layer").restore(&device)).require_grad();
        let output = model.layer(index, input.clone(), &context);
        probe();
        let grads = (output * Tensor::from_inner(upstream)).sum().backward();
        upstream = upstream_of(&input, &grads, "a layer")?;
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
