//! The two all-to-alls around attention, and the backends they run on.
//!
//! [`sequence_to_heads`] turns tensors `[B, H, S/P, D]` (all heads of this rank's sequence
//! shard) into `[B, H/P, S, D]` (this rank's heads over the whole sequence);
//! [`heads_to_sequence`] is its inverse. Both pack their tensors into one buffer whose part
//! `j` goes to rank `j`, so q, k and v travel in a single collective, and unpack with
//! reshapes and permutes. When the degree does not divide the heads the parts differ in
//! size (an uneven all-to-all), see [`HeadPlan`]. The packing is made of ordinary tensor
//! ops, which autodiff tracks; each exchange (the all-to-alls, and the ring's `send_recv`)
//! is one custom autodiff node whose backward runs the reverse exchange on the gradient. An
//! all-to-all over rows is its own inverse (row `i` of rank `j` becomes row `j` of rank `i`).

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
    comm::{CommError, Communicator, split_parts},
    error::UlyssesError,
    flash::repeat_kv_heads,
    capabilities::{ExchangeBackend, PlainBackend},
    layout::{HeadPlan, RingPlan},
    primitive::{float_primitive, float_tensor},
    ring::{fused_ring_attention, fused_ring_attention_tracked},
};

/// A movement of a tensor between the ranks of a group, as its autodiff node must undo it.
#[derive(Debug, Clone)]
enum Exchange {
    /// All-to-all over dim 0: its own inverse.
    AllToAll,
    /// Unequal parts of a 1-D tensor; undone with the counts swapped.
    Uneven { send_counts: Vec<usize>, recv_counts: Vec<usize> },
    /// To rank `to`, from rank `from`; undone the other way round.
    SendRecv { to: usize, from: usize },
}

impl Exchange {
    fn run<B: Backend>(&self, tensor: FloatTensor<B>, communicator: &dyn Communicator<B>) -> Result<FloatTensor<B>, CommError> {
        match self {
            Exchange::AllToAll => communicator.all_to_all(tensor),
            Exchange::Uneven { send_counts, recv_counts } => communicator.all_to_all_uneven(tensor, send_counts, recv_counts),
            Exchange::SendRecv { to, from } => communicator.send_recv(tensor, *to, *from),
        }
    }

    /// The exchange that sends a gradient back the way the tensor came.
    fn reversed(self) -> Self {
        match self {
            Exchange::AllToAll => Exchange::AllToAll,
            Exchange::Uneven { send_counts, recv_counts } => Exchange::Uneven { send_counts: recv_counts, recv_counts: send_counts },
            Exchange::SendRecv { to, from } => Exchange::SendRecv { to: from, from: to },
        }
    }

    /// Runs the exchange on an autodiff tensor, as a node whose backward runs
    /// [`reversed`](Self::reversed) on the gradient.
    fn tracked<B: PlainBackend, C: CheckpointStrategy>(
        self,
        tensor: FloatTensor<Autodiff<B, C>>,
        communicator: &Arc<dyn Communicator<B>>,
    ) -> Result<FloatTensor<Autodiff<B, C>>, CommError> {
        let output = self.run(tensor.primitive, &**communicator)?;
        let node = ExchangeBackward { communicator: communicator.clone(), reverse: self.reversed() };
        // Compute bound: an exchange is never recomputed by checkpointing. A recomputed
        // collective would run on some ranks and not others, and they would deadlock.
        Ok(match node.prepare::<C>([tensor.node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((), output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        })
    }
}

/// Backward of an exchange: the reverse exchange on the gradient.
struct ExchangeBackward<B: Backend> {
    communicator: Arc<dyn Communicator<B>>,
    reverse: Exchange,
}

impl<B: Backend> std::fmt::Debug for ExchangeBackward<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ExchangeBackward(rank {} of {}: {:?})", self.communicator.rank(), self.communicator.size(), self.reverse)
    }
}

impl<B: Backend> Backward<B, 1> for ExchangeBackward<B> {
    type State = ();

    fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            self.reverse.run(grad, &*self.communicator).unwrap_or_else(|error| crate::failure::fail(UlyssesError::from(error)))
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

    fn all_to_all_uneven(tensor: FloatTensor<B>, send_counts: &[usize], recv_counts: &[usize], communicator: &Arc<dyn Communicator<B>>) -> Result<FloatTensor<B>, CommError> {
        communicator.all_to_all_uneven(tensor, send_counts, recv_counts)
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

    fn is_tracked(_tensor: &FloatTensor<B>) -> bool {
        false
    }
}

impl<B: PlainBackend, C: CheckpointStrategy> ExchangeBackend for Autodiff<B, C> {
    type Wire = B;

    fn all_to_all(tensor: FloatTensor<Self>, communicator: &Arc<dyn Communicator<B>>) -> Result<FloatTensor<Self>, CommError> {
        Exchange::AllToAll.tracked::<B, C>(tensor, communicator)
    }

    fn all_to_all_uneven(
        tensor: FloatTensor<Self>,
        send_counts: &[usize],
        recv_counts: &[usize],
        communicator: &Arc<dyn Communicator<B>>,
    ) -> Result<FloatTensor<Self>, CommError> {
        Exchange::Uneven { send_counts: send_counts.to_vec(), recv_counts: recv_counts.to_vec() }.tracked::<B, C>(tensor, communicator)
    }

    fn send_recv(tensor: FloatTensor<Self>, to: usize, from: usize, communicator: &Arc<dyn Communicator<B>>) -> Result<FloatTensor<Self>, CommError> {
        Exchange::SendRecv { to, from }.tracked::<B, C>(tensor, communicator)
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

    fn is_tracked(tensor: &FloatTensor<Self>) -> bool {
        tensor.is_tracked()
    }
}

/// q `[B, H, S/P, D]`, k and v `[B, H_kv, S/P, D]` (all heads of this rank's tokens) →
/// this rank's heads of q, k and v over the whole sequence, `[B, h, S, D]`, as `plan`
/// splits the heads, in one exchange: an equal all-to-all when the degree divides the
/// heads, an uneven one otherwise.
pub fn sequence_to_heads<X: ExchangeBackend>(
    query: Tensor<X, 4>,
    key: Tensor<X, 4>,
    value: Tensor<X, 4>,
    plan: &HeadPlan,
    communicator: &Arc<dyn Communicator<X::Wire>>,
) -> Result<[Tensor<X, 4>; 3], CommError> {
    let p = communicator.size();
    let me = communicator.rank();
    if plan.even {
        let key = repeat_kv_heads(key, plan.kv_replication);
        let value = repeat_kv_heads(value, plan.kv_replication);
        let tensors = [query, key, value];
        let shapes = tensors.clone().map(|t| t.dims());
        // Row j of each tensor holds heads [j·H/P, (j+1)·H/P) of every local token.
        let rows = tensors
            .into_iter()
            .map(|t| {
                let [b, h, s, d] = t.dims();
                t.reshape([b, p, h / p, s, d]).permute([1, 0, 2, 3, 4]).reshape([p as i32, -1])
            })
            .collect();
        let received = exchange_rows::<X>(rows, communicator)?;
        let local = shapes.map(|[b, h, s, d]| [b, h / p, s, d]);
        return Ok(tokens_in_rank_order(received, local));
    }
    // Uneven: rank j's part is its q heads, then its kv heads (repeats included), flattened.
    // The keys may be as many as the queries or not (cross-attention over a sharded memory).
    let [b, _, s, d] = query.dims();
    let (s_kv, d_v) = (key.dims()[2], value.dims()[3]);
    let heads = |tensor: &Tensor<X, 4>, list: &[usize]| -> Tensor<X, 1> {
        Tensor::cat(list.iter().map(|&h| tensor.clone().narrow(1, h, 1)).collect(), 1).reshape([-1])
    };
    // Each rank's q heads and the kv heads they use, once.
    let shares: Vec<(std::ops::Range<usize>, Vec<usize>)> = (0..p).map(|rank| (plan.q_heads_of(rank), plan.kv_heads_of(rank))).collect();
    let part_len = |(q, kv): &(std::ops::Range<usize>, Vec<usize>)| b * (s * q.len() * d + s_kv * kv.len() * (d + d_v));
    let mut parts = Vec::with_capacity(3 * p);
    for (q, kv) in &shares {
        parts.push(query.clone().narrow(1, q.start, q.len()).reshape([-1]));
        parts.push(heads(&key, kv));
        parts.push(heads(&value, kv));
    }
    let send_counts: Vec<usize> = shares.iter().map(part_len).collect();
    let mine = part_len(&shares[me]);
    let received = X::all_to_all_uneven(float_primitive(Tensor::cat(parts, 0)), &send_counts, &vec![mine; p], communicator)?;
    let received = float_tensor::<X, 1>(received).reshape([p, mine]);
    let (q_local, kv_local) = (shares[me].0.len(), shares[me].1.len());
    Ok(tokens_in_rank_order(received, [[b, q_local, s, d], [b, kv_local, s_kv, d], [b, kv_local, s_kv, d_v]]))
}

/// `[P, Σn_t]` received rows (row `i` holds rank `i`'s tokens of tensors of shapes `local`,
/// `[B, h, S/P, D]`, flattened one after the other) → each tensor over the whole sequence,
/// `[B, h, S, D]`, tokens in rank order.
fn tokens_in_rank_order<X: Backend>(received: Tensor<X, 2>, local: [[usize; 4]; 3]) -> [Tensor<X, 4>; 3] {
    let p = received.dims()[0];
    let mut columns = split_columns(received, &local).into_iter();
    local.map(|[b, h, s, d]| {
        let t = columns.next().unwrap();
        t.reshape([p, b, h, s, d]).permute([1, 2, 0, 3, 4]).reshape([b, h, p * s, d])
    })
}

/// `[B, h, S, D]` (this rank's heads over the whole sequence) → `[B, H, S/P, D]`: the
/// inverse of [`sequence_to_heads`] for the output.
pub fn heads_to_sequence<X: ExchangeBackend>(
    tensor: Tensor<X, 4>,
    plan: &HeadPlan,
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
    if !plan.even {
        // Rank i sends its own heads for our tokens: unequal parts.
        let send_counts = vec![b * h_local * s_local * d; p];
        let recv_counts: Vec<usize> = (0..p).map(|rank| b * plan.q_heads_of(rank).len() * s_local * d).collect();
        let received = X::all_to_all_uneven(float_primitive(rows.reshape([-1])), &send_counts, &recv_counts, communicator)?;
        let per_rank = split_parts(&float_tensor::<X, 1>(received), &recv_counts)
            .into_iter()
            .zip(0..p)
            .map(|(part, rank)| part.expect("every rank attends over a head").reshape([b, plan.q_heads_of(rank).len(), s_local, d]))
            .collect();
        return Ok(Tensor::cat(per_rank, 1));
    }
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
/// count of `shapes[t]`.
fn split_columns<X: Backend>(received: Tensor<X, 2>, shapes: &[[usize; 4]]) -> Vec<Tensor<X, 2>> {
    let p = received.dims()[0];
    let mut offset = 0;
    shapes
        .iter()
        .map(|&shape| {
            let len: usize = shape.iter().product();
            let block = received.clone().slice([0..p, offset..offset + len]);
            offset += len;
            block
        })
        .collect()
}
