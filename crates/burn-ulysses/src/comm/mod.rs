//! Collectives between the ranks of a group.
//!
//! [`Communicator`] is generic over the backend whose float tensors it moves, so that an
//! implementation can work on that backend's own buffers: [`ThreadGroup`] moves tensors of
//! any backend between threads of one process, an NCCL implementation moves CUDA device
//! buffers on the backend's stream. Collectives are blocking from the caller's point of view
//! and must be called in the same order by every rank of the group.

mod thread;
mod traffic;

use std::{fmt, sync::Arc, time::Duration};

use burn::tensor::{backend::Backend, ops::FloatTensor};

pub use thread::{RankPanic, ThreadCommunicator, ThreadGroup, ThreadGroupConfig, ThreadRank};
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
        };
        f.write_str(name)
    }
}

/// Why a collective failed. Every variant says which rank or argument is at fault.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommError {
    #[error(
        "rank {peer} left the group before joining collective #{seq} ({op}); it failed or \
         returned early, so this rank stops too. Look at rank {peer}'s own error first."
    )]
    PeerLeft { peer: usize, op: Collective, seq: u64 },
    #[error(
        "collective #{seq} ({op}) timed out after {after:?} waiting for ranks {waiting_for:?}. \
         A rank is stuck or skipped a collective; raise the timeout if it is only slow."
    )]
    Timeout { op: Collective, seq: u64, waiting_for: Vec<usize>, after: Duration },
    #[error(
        "collective #{seq}: this rank called {op} but rank {peer} called {peer_op}. Every rank \
         must issue the same collectives in the same order (same model code, same layer count)."
    )]
    Mismatch { seq: u64, op: Collective, peer: usize, peer_op: Collective },
    #[error("{op}: {reason}")]
    InvalidArgument { op: Collective, reason: String },
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
