//! Collectives between the ranks of a group.
//!
//! [`Communicator`] is generic over the backend whose float tensors it moves, so that an
//! implementation can work on that backend's own buffers: [`ThreadGroup`] moves tensors of
//! any backend between threads of one process, an NCCL implementation moves CUDA device
//! buffers on the backend's stream. Collectives are blocking from the caller's point of view
//! and must be called in the same order by every rank of the group.

pub mod check;
#[cfg(feature = "cubecl")]
mod fusion_backend;
pub mod host;
mod thread;

use std::sync::Arc;

use burn::tensor::{Tensor, TensorMetadata, backend::Backend, ops::FloatTensor};

#[cfg(feature = "cubecl")]
pub use fusion_backend::FusionCommunicator;
pub use host::HostStaged;
// The burn-free half (ulysses-core): names, errors, argument checks, counters and the
// in-process group, shared with the burn 0.22 crate.
pub use ulysses_core::comm::{
    Collective, CommError, HostCommunicator, HostDType, HostTensor, RankPanic, ReduceOp, ThreadCommunicator, ThreadGroup, ThreadGroupConfig, ThreadRank, Traffic,
    TrafficCounter, check_broadcast_root, check_counts_pair_up, check_gathered_lengths, check_reduce_scatter, check_send_recv, check_sender_pairs, check_uneven_counts, mismatched,
};

/// Collective operations of one rank within a group, over the float tensors of `B`.
///
/// Tensor layouts follow NCCL's conventions so that an NCCL implementation can pass the
/// backend's buffers straight through:
/// - [`all_to_all`](Communicator::all_to_all): dim 0 has size `size()`; slice `j` is sent to
///   rank `j`, and slice `i` of the result came from rank `i`.
/// - [`all_gather`](Communicator::all_gather): the result gains a leading dim of size
///   `size()`; slice `i` is rank `i`'s tensor.
/// - [`reduce_scatter`](Communicator::reduce_scatter): 1-D, rank `r` receives the `r`-th of
///   `size()` equal parts of the reduction.
pub trait Communicator<B: Backend>: Send + Sync + 'static {
    /// This rank's index in the group, `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;

    /// Exchanges slices of dim 0: slice `j` goes to rank `j`.
    fn all_to_all(&self, tensor: FloatTensor<B>) -> Result<FloatTensor<B>, CommError>;
    /// Element-wise reduction over all ranks; every rank receives the result. Every rank passes
    /// the same `op` (and a broadcast the same `root`): the threads and TCP refuse ranks that
    /// do not, on every rank; NCCL cannot tell without a host round per call, and does not.
    fn all_reduce(&self, tensor: FloatTensor<B>, op: ReduceOp) -> Result<FloatTensor<B>, CommError>;
    /// Stacks every rank's tensor along a new leading dim.
    fn all_gather(&self, tensor: FloatTensor<B>) -> Result<FloatTensor<B>, CommError>;
    /// This rank's part of the element-wise reduction over all ranks (`ncclReduceScatter`,
    /// what ZeRO sums gradients with): `tensor` is 1-D with `n` elements, `n` a multiple of
    /// `size()` and the same on every rank; rank `r` receives elements `r·n/P..(r+1)·n/P` of
    /// the reduction, 1-D.
    ///
    /// This default runs [`all_reduce`](Self::all_reduce) and keeps this rank's part: the
    /// same bits on any transport, at twice the traffic. Transports that reduce-scatter
    /// natively override it (threads, host transports, NCCL).
    fn reduce_scatter(&self, tensor: FloatTensor<B>, op: ReduceOp) -> Result<FloatTensor<B>, CommError> {
        let (rank, size) = (self.rank(), self.size());
        check_reduce_scatter(&tensor.shape().to_vec(), size)?;
        let part = tensor.shape().num_elements() / size;
        let reduced = crate::primitive::float_tensor::<B, 1>(self.all_reduce(tensor, op)?);
        Ok(crate::primitive::float_primitive(reduced.slice([rank * part..(rank + 1) * part])))
    }
    /// Every rank receives `root`'s tensor; the others pass a tensor of the same shape.
    fn broadcast(&self, tensor: FloatTensor<B>, root: usize) -> Result<FloatTensor<B>, CommError>;
    /// Point to point, every rank of the group at once (a collective permute: what ring
    /// attention does when it passes k/v blocks around): sends `tensor` to rank `to` and
    /// returns what rank `from` sent, of the same shape and dtype. The `to`s of all ranks form
    /// a permutation, and rank `from`'s `to` is this rank; `to == rank()` keeps the tensor
    /// (then `from == rank()` too). NCCL runs it as grouped send/recv.
    fn send_recv(&self, tensor: FloatTensor<B>, to: usize, from: usize) -> Result<FloatTensor<B>, CommError>;
    /// All-to-all of unequal parts (`MPI_Alltoallv`; what uneven heads need): `tensor` is
    /// 1-D, its first `send_counts[0]` elements go to rank 0, the next `send_counts[1]` to
    /// rank 1, and so on; the result is 1-D, `recv_counts[i]` elements from rank `i` in rank
    /// order. `recv_counts[i]` must be rank `i`'s `send_counts[rank()]`.
    ///
    /// This default pads every part to the largest part of any rank and runs
    /// [`all_to_all`](Self::all_to_all), after one host all-gather of the counts (which
    /// also checks that they pair up): correct on any transport, at the padding's cost.
    /// Transports that move unequal parts natively override it (threads, host-staged: TCP,
    /// NCCL). Counts that cannot pair up are refused on the rank that finds them, before any
    /// collective: its peers wait for it until their collective timeout, or until it leaves.
    fn all_to_all_uneven(&self, tensor: FloatTensor<B>, send_counts: &[usize], recv_counts: &[usize]) -> Result<FloatTensor<B>, CommError> {
        let (rank, size) = (self.rank(), self.size());
        check_uneven_counts(size, tensor.shape().num_elements(), tensor.shape().num_dims(), send_counts, recv_counts)?;
        let counts: Vec<u64> = send_counts.iter().map(|&c| c as u64).collect();
        let every_rank = self.all_gather_host(&counts)?;
        let sent_here: Vec<usize> = every_rank.iter().map(|counts| counts.get(rank).map_or(usize::MAX, |&c| c as usize)).collect();
        check_counts_pair_up(rank, &sent_here, recv_counts)?;
        let widest = every_rank.iter().flatten().copied().max().unwrap_or(0) as usize;
        let tensor = crate::primitive::float_tensor::<B, 1>(tensor);
        let padded: Vec<_> = split_parts(&tensor, send_counts).into_iter().map(|part| pad_part(part, widest, &tensor)).collect();
        let rows = Tensor::stack::<2>(padded, 0);
        let received = crate::primitive::float_tensor::<B, 2>(self.all_to_all(crate::primitive::float_primitive(rows))?);
        let parts: Vec<Tensor<B, 1>> =
            (0..size).filter(|&i| recv_counts[i] > 0).map(|i| received.clone().slice([i..i + 1, 0..recv_counts[i]]).reshape([recv_counts[i]])).collect();
        Ok(crate::primitive::float_primitive(Tensor::cat(parts, 0)))
    }
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<(), CommError>;
    /// Control-plane exchange of a few integers (shapes, token counts): returns every rank's
    /// values, in rank order.
    fn all_gather_host(&self, values: &[u64]) -> Result<Vec<Vec<u64>>, CommError>;
    /// Collectively splits the group like `MPI_Comm_split`/`ncclCommSplit`: ranks passing the
    /// same `color` form a new group, ordered by `key` (then by rank).
    fn split(&self, color: u32, key: u32) -> Result<Arc<dyn Communicator<B>>, CommError>;
    /// Bytes this rank has handed to each collective so far.
    fn traffic(&self) -> Traffic;
}

/// `tensor` cut into consecutive parts of `counts` elements (`None` for an empty part:
/// burn has no empty slices).
pub(crate) fn split_parts<B: Backend>(tensor: &Tensor<B, 1>, counts: &[usize]) -> Vec<Option<Tensor<B, 1>>> {
    let mut offset = 0;
    counts
        .iter()
        .map(|&count| {
            let part = (count > 0).then(|| tensor.clone().narrow(0, offset, count));
            offset += count;
            part
        })
        .collect()
}

/// `part` (`None`: empty) with zeros appended up to `len` elements.
fn pad_part<B: Backend>(part: Option<Tensor<B, 1>>, len: usize, like: &Tensor<B, 1>) -> Tensor<B, 1> {
    let have = part.as_ref().map_or(0, |p| p.dims()[0]);
    let zeros = (len > have).then(|| Tensor::zeros([len - have], (&like.device(), like.dtype())));
    match (part, zeros) {
        (Some(part), Some(zeros)) => Tensor::cat(vec![part, zeros], 0),
        (Some(part), None) => part,
        (None, Some(zeros)) => zeros,
        (None, None) => unreachable!("an empty part of an empty all-to-all"),
    }
}

/// All-gathers `values` on the host and fails, naming `what`, when ranks sent different
/// numbers of values: they are running different models, or different host collectives met.
/// A group of one rank gets its own values without a collective (NCCL's would wait for the
/// device: a one-GPU ZeRO-3 step asks once a layer).
pub fn all_gather_host_checked<B: Backend>(
    communicator: &dyn Communicator<B>,
    values: &[u64],
    what: &'static str,
) -> Result<Vec<Vec<u64>>, CommError> {
    if communicator.size() == 1 {
        return Ok(vec![values.to_vec()]);
    }
    check_gathered_lengths(communicator.all_gather_host(values)?, values.len(), what)
}
