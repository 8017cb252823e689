//! Collectives between the ranks of a group.
//!
//! [`Communicator`] is generic over the backend whose float tensors it moves, so that an
//! implementation can work on that backend's own buffers: [`ThreadGroup`] moves tensors of
//! any backend between threads of one process, an NCCL implementation moves CUDA device
//! buffers on the backend's stream. Collectives are blocking from the caller's point of view
//! and must be called in the same order by every rank of the group.

pub mod check;
#[cfg(feature = "cubecl")]
mod fusion;
mod thread;
mod traffic;

use std::{fmt, sync::Arc, time::Duration};

use burn::tensor::{Tensor, TensorMetadata, backend::Backend, ops::FloatTensor};

#[cfg(feature = "cubecl")]
pub use fusion::FusionCommunicator;
pub use thread::{RankPanic, ThreadCommunicator, ThreadGroup, ThreadGroupConfig, ThreadRank};
pub(crate) use thread::panic_message;
pub use traffic::{Traffic, TrafficCounter};

/// Reduction applied by [`Communicator::all_reduce`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ReduceOp {
    Sum,
    /// Sum divided by the group size.
    Mean,
    Max,
}

/// The name of a collective, for errors and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    AllToAll,
    AllReduce,
    AllGather,
    Broadcast,
    Barrier,
    AllGatherHost,
    Split,
    SendRecv,
    AllToAllUneven,
}

impl Collective {
    /// Every collective, in a fixed order (transports number them by position).
    pub const ALL: [Collective; 9] = [
        Collective::AllToAll,
        Collective::AllReduce,
        Collective::AllGather,
        Collective::Broadcast,
        Collective::Barrier,
        Collective::AllGatherHost,
        Collective::Split,
        Collective::SendRecv,
        Collective::AllToAllUneven,
    ];

    /// This collective's position in [`Collective::ALL`].
    pub fn code(self) -> u8 {
        Self::ALL.iter().position(|&c| c == self).unwrap() as u8
    }

    /// The collective at position `code` of [`Collective::ALL`].
    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get(code as usize).copied()
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Collective::AllToAll => "all_to_all",
            Collective::AllReduce => "all_reduce",
            Collective::AllGather => "all_gather",
            Collective::Broadcast => "broadcast",
            Collective::Barrier => "barrier",
            Collective::AllGatherHost => "all_gather_host",
            Collective::Split => "split",
            Collective::SendRecv => "send_recv",
            Collective::AllToAllUneven => "all_to_all_uneven",
        };
        f.write_str(name)
    }
}

/// Why a collective failed. Every variant says which rank or argument is at fault.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommError {
    #[error(
        "rank {peer} left the group (world rank {world_peer}) before joining collective #{seq} \
         ({op}); it failed or returned early, so this rank stops too. Look at world rank \
         {world_peer}'s own error first."
    )]
    PeerLeft { peer: usize, world_peer: usize, op: Collective, seq: u64 },
    #[error(
        "collective #{seq} ({op}) timed out after {after:?} waiting for world rank(s) \
         {waiting_for:?}. A rank is stuck or skipped a collective; raise the timeout \
         (ULYSSES_COLLECTIVE_TIMEOUT) if it is only slow. With ranks as threads, also check that \
         no two ranks share parameter tensors: their autodiff graphs merge and one rank's \
         backward blocks the other's."
    )]
    Timeout { op: Collective, seq: u64, waiting_for: Vec<usize>, after: Duration },
    #[error(
        "collective #{seq} ({op}) failed: world rank(s) {ranks:?} died or stopped answering \
         ({detail}); this rank stops too. Look at how rank(s) {ranks:?} ended first (their last \
         output, a kill signal, the out-of-memory killer, a hang)."
    )]
    PeersDied { op: Collective, seq: u64, ranks: Vec<usize>, detail: String },
    #[error(
        "collective #{seq}: this rank called {op} but rank {peer} called {peer_op}. Every rank \
         must issue the same collectives in the same order (same model code, same layer count)."
    )]
    Mismatch { seq: u64, op: Collective, peer: usize, peer_op: Collective },
    #[error("{op}: {reason}")]
    InvalidArgument { op: Collective, reason: String },
    #[error(
        "ranks diverged: this rank sent {mine} {what} but rank {rank} sent {theirs}. Every rank \
         must run the same model and issue the same collectives in the same order."
    )]
    Diverged { what: &'static str, mine: usize, rank: usize, theirs: usize },
    #[error("communicator backend error: {0}")]
    Backend(String),
}

/// Collective operations of one rank within a group, over the float tensors of `B`.
///
/// Tensor layouts follow NCCL's conventions so that an NCCL implementation can pass the
/// backend's buffers straight through:
/// - [`all_to_all`](Communicator::all_to_all): dim 0 has size `size()`; slice `j` is sent to
///   rank `j`, and slice `i` of the result came from rank `i`.
/// - [`all_gather`](Communicator::all_gather): the result gains a leading dim of size
///   `size()`; slice `i` is rank `i`'s tensor.
pub trait Communicator<B: Backend>: Send + Sync + 'static {
    /// This rank's index in the group, `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;

    /// Exchanges slices of dim 0: slice `j` goes to rank `j`.
    fn all_to_all(&self, tensor: FloatTensor<B>) -> Result<FloatTensor<B>, CommError>;
    /// Element-wise reduction over all ranks; every rank receives the result.
    fn all_reduce(&self, tensor: FloatTensor<B>, op: ReduceOp) -> Result<FloatTensor<B>, CommError>;
    /// Stacks every rank's tensor along a new leading dim.
    fn all_gather(&self, tensor: FloatTensor<B>) -> Result<FloatTensor<B>, CommError>;
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
    /// Transports that move unequal parts natively override it (threads, NCCL).
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

/// The arguments of [`Communicator::send_recv`] that no peer is needed to refuse.
pub fn check_send_recv(rank: usize, size: usize, to: usize, from: usize) -> Result<(), CommError> {
    let invalid = |reason: String| Err(CommError::InvalidArgument { op: Collective::SendRecv, reason });
    if to >= size || from >= size {
        return invalid(format!("to {to} and from {from} must be ranks of this group of {size}"));
    }
    if (to == rank) != (from == rank) {
        return invalid(format!("rank {rank} sends to {to} but receives from {from}: a rank that keeps its tensor receives only its own"));
    }
    Ok(())
}

/// The arguments of [`Communicator::all_to_all_uneven`] that no peer is needed to refuse.
pub fn check_uneven_counts(size: usize, elements: usize, dims: usize, send_counts: &[usize], recv_counts: &[usize]) -> Result<(), CommError> {
    let invalid = |reason: String| Err(CommError::InvalidArgument { op: Collective::AllToAllUneven, reason });
    if send_counts.len() != size || recv_counts.len() != size {
        return invalid(format!("{} send counts and {} receive counts for a group of {size}: one of each per rank", send_counts.len(), recv_counts.len()));
    }
    if send_counts.iter().sum::<usize>() == 0 || recv_counts.iter().sum::<usize>() == 0 {
        return invalid("every rank must send and receive at least one element (burn has no empty tensors)".into());
    }
    if dims != 1 || elements != send_counts.iter().sum::<usize>() {
        return invalid(format!("the tensor must be 1-D with the send counts' sum ({}) elements; it has {dims} dims and {elements} elements", send_counts.iter().sum::<usize>()));
    }
    Ok(())
}

/// Fails unless what each rank sends this one (`sent_here[i]` elements from rank `i`) is
/// what this rank expects from it (`recv_counts[i]`).
pub fn check_counts_pair_up(rank: usize, sent_here: &[usize], recv_counts: &[usize]) -> Result<(), CommError> {
    match (0..sent_here.len()).find(|&i| sent_here[i] != recv_counts[i]) {
        None => Ok(()),
        Some(i) => Err(CommError::InvalidArgument {
            op: Collective::AllToAllUneven,
            reason: format!(
                "rank {rank} expects {} elements from rank {i}, which sends it {}; every rank must derive its counts from the same plan",
                recv_counts[i], sent_here[i]
            ),
        }),
    }
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
pub fn all_gather_host_checked<B: Backend>(
    communicator: &dyn Communicator<B>,
    values: &[u64],
    what: &'static str,
) -> Result<Vec<Vec<u64>>, CommError> {
    let gathered = communicator.all_gather_host(values)?;
    match gathered.iter().position(|v| v.len() != values.len()) {
        None => Ok(gathered),
        Some(rank) => Err(CommError::Diverged { what, mine: values.len(), rank, theirs: gathered[rank].len() }),
    }
}
