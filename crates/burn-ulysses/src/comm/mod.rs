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

use burn::tensor::{backend::Backend, ops::FloatTensor};

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
}

impl Collective {
    /// Every collective, in a fixed order (transports number them by position).
    pub const ALL: [Collective; 8] = [
        Collective::AllToAll,
        Collective::AllReduce,
        Collective::AllGather,
        Collective::Broadcast,
        Collective::Barrier,
        Collective::AllGatherHost,
        Collective::Split,
        Collective::SendRecv,
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
