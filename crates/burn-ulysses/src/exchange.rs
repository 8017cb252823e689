//! The two all-to-alls around attention, and the backends they run on.
//!
//! [`sequence_to_heads`] turns tensors `[B, H, S/P, D]` (all heads of this rank's sequence
//! shard) into `[B, H/P, S, D]` (this rank's heads over the whole sequence);
//! [`heads_to_sequence`] is its inverse. Both pack their tensors into one `[P, n]` buffer
//! whose row `j` goes to rank `j`, so q, k and v travel in a single collective, and unpack
//! with reshapes and permutes. The packing is made of ordinary tensor ops, which autodiff
//! tracks; the all-to-all itself is the one custom autodiff node. An all-to-all over rows is
//! its own inverse (row `i` of rank `j` becomes row `j` of rank `i`), so that node's backward
//! is the same exchange applied to the gradient.

use std::sync::Arc;

use burn::tensor::{
    Tensor,
    backend::{AutodiffBackend, Backend},
    ops::FloatTensor,
};
use burn_autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind, unary},
};

use crate::{
    comm::{CommError, Communicator},
    error::UlyssesError,
    inner::{ExchangeBackend, PlainBackend},
    layout::RingPlan,
    primitive::{float_primitive, float_tensor},
    ring::{fused_ring_attention, fused_ring_attention_tracked},
};

/// Backward of the all-to-all: the same all-to-all on the gradient.
pub(crate) struct AllToAllBackward<B: Backend> {
    pub(crate) communicator: Arc<dyn Communicator<B>>,
}

impl<B: Backend> std::fmt::Debug for AllToAllBackward<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AllToAllBackward(rank {} of {})", self.communicator.rank(), self.communicator.size())
    }
}

impl<B: Backend> Backward<B, 1> for AllToAllBackward<B> {
    type State = ();

    fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            self.communicator
                .all_to_all(grad)
                .unwrap_or_else(|error| panic!("{}", UlyssesError::from(error)))
        });
    }
}

/// Backward of a `send_recv` from this rank to `to` and from `from` to this rank: the
/// gradient travels back, to `from` and from `to`.
pub(crate) struct SendRecvBackward<B: Backend> {
    pub(crate) communicator: Arc<dyn Communicator<B>>,
    pub(crate) to: usize,
    pub(crate) from: usize,
}

impl<B: Backend> std::fmt::Debug for SendRecvBackward<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SendRecvBackward(rank {}: to {}, from {})", self.communicator.rank(), self.to, self.from)
    }
}

impl<B: Backend> Backward<B, 1> for SendRecvBackward<B> {
    type State = ();

    fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            self.communicator
                .send_recv(grad, self.from, self.to)
                .unwrap_or_else(|error| panic!("{}", UlyssesError::from(error)))
        });
    }
}

impl<B: PlainBackend> ExchangeBackend for B {
    type Wire = B;

    fn all_to_all(
        tensor: FloatTensor<B>,
        communicator: &Arc<dyn Communicator<B>>,
    ) -> Result<FloatTensor<B>, CommError> {
        communicator.all_to_all(tensor)
    }

    fn send_recv(tensor: FloatTensor<B>, to: usize, from: usize, communicator: &Arc<dyn Communicator<B>>) -> Result<FloatTensor<B>, CommError> {
        communicator.send_recv(tensor, to, from)
    }

    fn fused_ring_attention(query: FloatTensor<B>, key: FloatTensor<B>, value: FloatTensor<B>, plan: &RingPlan, ring: &Arc<dyn Communicator<B>>) -> Result<FloatTensor<B>, UlyssesError> {
        fused_ring_attention::<B>(query, key, value, plan, ring)
    }

    fn all_gather_untracked(
        tensor: FloatTensor<B>,
        communicator: &Arc<dyn Communicator<B>>,
    ) -> Result<FloatTensor<B>, CommError> {
        communicator.all_gather(tensor)
    }
}

impl<B: PlainBackend, C: CheckpointStrategy> ExchangeBackend for Autodiff<B, C> {
    type Wire = B;

    fn all_to_all(
        tensor: FloatTensor<Self>,
        communicator: &Arc<dyn Communicator<B>>,
    ) -> Result<FloatTensor<Self>, CommError> {
        let output = communicator.all_to_all(tensor.primitive)?;
        let node = AllToAllBackward { communicator: communicator.clone() };
        // Compute bound: the exchange is never recomputed by checkpointing. A recomputed
        // collective would run on some ranks and not others, and they would deadlock.
        Ok(match node.prepare::<C>([tensor.node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((), output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        })
    }

    fn send_recv(tensor: FloatTensor<Self>, to: usize, from: usize, communicator: &Arc<dyn Communicator<B>>) -> Result<FloatTensor<Self>, CommError> {
        let output = communicator.send_recv(tensor.primitive, to, from)?;
        let node = SendRecvBackward { communicator: communicator.clone(), to, from };
        // Compute bound, as the all-to-all: never recomputed.
        Ok(match node.prepare::<C>([tensor.node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((), output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        })
    }

    fn fused_ring_attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        plan: &RingPlan,
        ring: &Arc<dyn Communicator<B>>,
    ) -> Result<FloatTensor<Self>, UlyssesError> {
        fused_ring_attention_tracked::<B, C>(query, key, value, plan, ring)
    }

    fn all_gather_untracked(
        tensor: FloatTensor<Self>,
        communicator: &Arc<dyn Communicator<B>>,
    ) -> Result<FloatTensor<Self>, CommError> {
        let gathered = communicator.all_gather(tensor.primitive)?;
        Ok(<Self as AutodiffBackend>::from_inner(gathered))
    }
}

/// `[B, H_t, S/P, D_t]` per tensor → `[B, H_t/P, S, D_t]` per tensor, in one exchange.
pub fn sequence_to_heads<X: ExchangeBackend>(
    tensors: Vec<Tensor<X, 4>>,
    communicator: &Arc<dyn Communicator<X::Wire>>,
) -> Result<Vec<Tensor<X, 4>>, CommError> {
    let p = communicator.size();
    let shapes: Vec<[usize; 4]> = tensors.iter().map(|t| t.dims()).collect();
    // Row j of each tensor holds heads [j·H/P, (j+1)·H/P) of every local token.
    let rows = tensors
        .into_iter()
        .map(|t| {
            let [b, h, s, d] = t.dims();
            t.reshape([b, p, h / p, s, d]).permute([1, 0, 2, 3, 4]).reshape([p as i32, -1])
        })
        .collect();
    let received = exchange_rows::<X>(rows, communicator)?;
    // Row i now holds our heads for rank i's tokens: put the tokens in rank order.
    Ok(split_columns(received, &shapes, |[b, h, s, d]| [b, h / p, s, d])
        .into_iter()
        .zip(&shapes)
        .map(|(t, &[b, h, s, d])| {
            t.reshape([p, b, h / p, s, d]).permute([1, 2, 0, 3, 4]).reshape([b, h / p, p * s, d])
        })
        .collect())
}

/// `[B, H/P, S, D]` → `[B, H, S/P, D]`: the inverse of [`sequence_to_heads`].
pub fn heads_to_sequence<X: ExchangeBackend>(
    tensor: Tensor<X, 4>,
    communicator: &Arc<dyn Communicator<X::Wire>>,
) -> Result<Tensor<X, 4>, CommError> {
    let p = communicator.size();
    let [b, h_local, s, d] = tensor.dims();
    let s_local = s / p;
    // Row j holds our heads for rank j's tokens.
    let rows = tensor
        .reshape([b, h_local, p, s_local, d])
        .permute([2, 0, 1, 3, 4])
        .reshape([p as i32, -1]);
    let received = exchange_rows::<X>(vec![rows], communicator)?;
    // Row i now holds rank i's heads for our tokens: put the heads in rank order.
    Ok(received
        .reshape([p, b, h_local, s_local, d])
        .permute([1, 0, 2, 3, 4])
        .reshape([b, p * h_local, s_local, d]))
}

/// Concatenates `[P, n_t]` row blocks, exchanges them, and returns the `[P, Σn_t]` result.
fn exchange_rows<X: ExchangeBackend>(
    rows: Vec<Tensor<X, 2>>,
    communicator: &Arc<dyn Communicator<X::Wire>>,
) -> Result<Tensor<X, 2>, CommError> {
    let packed = if rows.len() == 1 { rows.into_iter().next().unwrap() } else { Tensor::cat(rows, 1) };
    let exchanged = X::all_to_all(float_primitive(packed), communicator)?;
    Ok(float_tensor(exchanged))
}

/// Splits `[P, Σn_t]` back into one `[P, n_t]` block per tensor, where `n_t` is the element
/// count of `local_shape(shape_t)`.
fn split_columns<X: Backend>(
    received: Tensor<X, 2>,
    shapes: &[[usize; 4]],
    local_shape: impl Fn([usize; 4]) -> [usize; 4],
) -> Vec<Tensor<X, 2>> {
    let p = received.dims()[0];
    let mut offset = 0;
    shapes
        .iter()
        .map(|&shape| {
            let len: usize = local_shape(shape).iter().product();
            let block = received.clone().slice([0..p, offset..offset + len]);
            offset += len;
            block
        })
        .collect()
}
