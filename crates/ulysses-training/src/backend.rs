//! Which backends the training API runs on, and the wire backend their gradients travel as.
//!
//! Communicators move the buffers of a plain backend `W` (NCCL: CubeCL CUDA; threads and TCP:
//! any). Training runs on `UlyssesBackend<Autodiff<W>>`, whose gradients are tensors of its
//! inner backend `UlyssesBackend<W>`; those *are* `W`'s tensors (the decorator reuses `W`'s
//! primitives). [`TrainBackend`] states that equality in the type system, once, so gradient
//! sync, parameter broadcast and evaluation take a `Communicator<W>` directly: the same
//! communicator the attention exchange uses, with no per-call conversion.

use burn::tensor::{
    DType, FloatDType, Shape, TensorMetadata,
    backend::{AutodiffBackend, Backend},
    ops::FloatTensor,
};
use burn_autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};

use burn_ulysses::{PlainBackend, UlyssesBackend};

/// An autodiff backend whose gradients are tensors of the plain backend `Wire`
/// ([`TrainBackend::Wire`]), the one communicators move.
///
/// Implemented for `UlyssesBackend<Autodiff<W>>` (sequence parallel training) and for
/// `Autodiff<W>` (data parallel only), for every [`PlainBackend`] `W`.
pub trait TrainBackend:
    AutodiffBackend<InnerBackend: Backend<FloatTensorPrimitive = FloatTensor<Self::Wire>, Device = Self::Device>>
{
    /// The plain backend whose buffers the communicators of this training stack move, and
    /// whose kernels the loss may use ([`PlainBackend::fused_cross_entropy`]).
    type Wire: PlainBackend<Device = Self::Device>;

    /// `value` (computed without a graph) as a tensor of the graph whose gradient with respect
    /// to each parent is its given gradient times the upstream one (a scalar: `value` has one
    /// element): for a piece whose gradients were computed with its value (the chunked loss),
    /// one node and one in-place scaling of each gradient, where a surrogate `sum(parent ·
    /// gradient)` made autodiff fill a tensor of ones the parent's size and multiply twice.
    fn with_gradients<const N: usize>(value: FloatTensor<Self::Wire>, parents: [(FloatTensor<Self>, FloatTensor<Self::Wire>); N]) -> FloatTensor<Self>;
}

impl<W: PlainBackend, C: CheckpointStrategy> TrainBackend for Autodiff<W, C> {
    type Wire = W;

    fn with_gradients<const N: usize>(value: FloatTensor<W>, parents: [(FloatTensor<Self>, FloatTensor<W>); N]) -> FloatTensor<Self> {
        with_gradients::<W, C, N>(value, parents)
    }
}

impl<W: PlainBackend, C: CheckpointStrategy> TrainBackend for UlyssesBackend<Autodiff<W, C>> {
    type Wire = W;

    fn with_gradients<const N: usize>(value: FloatTensor<W>, parents: [(FloatTensor<Self>, FloatTensor<W>); N]) -> FloatTensor<Self> {
        // The decorator's tensors are `Autodiff<W, C>`'s.
        with_gradients::<W, C, N>(value, parents)
    }
}

/// The node of [`TrainBackend::with_gradients`]: its state, each parent's gradient.
#[derive(Debug)]
struct GivenGradients;

impl<B: Backend, const N: usize> Backward<B, N> for GivenGradients {
    type State = Vec<FloatTensor<B>>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let upstream = grads.consume::<B>(&ops.node);
        for (parent, grad) in ops.parents.into_iter().zip(ops.state) {
            let Some(parent) = parent else { continue };
            // Each element times the upstream scalar: in the gradient's dtype where that is f32
            // or wider (what autodiff's `sum(parent · gradient)` gave, bit for bit); in f32 for a
            // half-precision one, rounded once after, where the scalar (the loss's 1 / valid
            // tokens) cast first was off by up to 0.4% in bf16, and in f16 subnormal past
            // 16 384 tokens.
            let rank = grad.shape().num_dims();
            let dtype: DType = grad.dtype();
            let shape = Shape::from(vec![1usize; rank]);
            let scaled = match dtype {
                DType::F16 | DType::BF16 => {
                    let scale = B::float_reshape(B::float_cast(upstream.clone(), FloatDType::F32), shape);
                    B::float_cast(B::float_mul(B::float_cast(grad, FloatDType::F32), scale), dtype.into())
                }
                _ => B::float_mul(grad, B::float_reshape(B::float_cast(upstream.clone(), dtype.into()), shape)),
            };
            grads.register::<B>(parent.id, scaled);
        }
    }
}

fn with_gradients<W: Backend, C: CheckpointStrategy, const N: usize>(
    value: FloatTensor<W>,
    parents: [(FloatTensor<Autodiff<W, C>>, FloatTensor<W>); N],
) -> FloatTensor<Autodiff<W, C>> {
    assert_eq!(value.shape().num_elements(), 1, "with_gradients: the value must be a scalar (its upstream gradient scales every given one)");
    // A gradient of another shape (a transposed one of the same size) or dtype would be summed
    // into the parent's as it is, silently wrong.
    for (index, (parent, gradient)) in parents.iter().enumerate() {
        let (want, got) = ((parent.primitive.shape(), parent.primitive.dtype()), (gradient.shape(), gradient.dtype()));
        assert_eq!(want, got, "with_gradients: parent {index}'s gradient must have its shape and dtype");
    }
    let nodes = parents.each_ref().map(|(parent, _)| parent.node.clone());
    let (tensors, gradients): (Vec<_>, Vec<_>) = parents.into_iter().unzip();
    // Compute bound: the gradients are already made, nothing is recomputed.
    let output = match GivenGradients.prepare::<C>(nodes).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish(gradients, value),
        OpsKind::UnTracked(prep) => prep.finish(value),
    };
    // The parents live until the node is registered: another rank thread's backward sweeps
    // every graph of the process and frees what no live tensor holds (burn-autodiff 0.21's
    // `float_cat` lost gradients that way: third_party/burn-autodiff).
    drop(tensors);
    output
}
