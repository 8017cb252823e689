//! Which backends the training API runs on, and the wire backend their gradients travel as.
//!
//! Communicators move the buffers of a plain backend `W` (NCCL: CubeCL CUDA; threads and TCP:
//! any). Training runs on `UlyssesBackend<Autodiff<W>>`, whose gradients are tensors of its
//! inner backend `UlyssesBackend<W>`; those *are* `W`'s tensors (the decorator reuses `W`'s
//! primitives). [`TrainBackend`] states that equality in the type system, once, so gradient
//! sync, parameter broadcast and evaluation take a `Communicator<W>` directly: the same
//! communicator the attention exchange uses, with no per-call conversion.

use burn::tensor::{
    backend::{AutodiffBackend, Backend},
    ops::FloatTensor,
};
use burn_autodiff::{Autodiff, checkpoint::strategy::CheckpointStrategy};

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
}

impl<W: PlainBackend, C: CheckpointStrategy> TrainBackend for Autodiff<W, C> {
    type Wire = W;
}

impl<W: PlainBackend, C: CheckpointStrategy> TrainBackend for UlyssesBackend<Autodiff<W, C>> {
    type Wire = W;
}
