//! Collectives' bookkeeping, shared by every Burn version's transports: what a collective is
//! called, how it fails, the byte counters, the argument checks that need no peer, and the
//! in-process group ([`ThreadGroup`]), whose rounds move any `Send` value between rank threads.
//!
//! [`HostCommunicator`] is the transports' contract on host tensors: the in-process group
//! implements it here, the TCP transport in `ulysses_dist::tcp`. burn 0.21's
//! `burn_ulysses::comm::Communicator` moves that version's tensors (on the threads, by
//! ownership through [`ThreadCommunicator::round`]; over TCP, staged through host tensors), and
//! burn-ulysses-ops uses any [`HostCommunicator`] directly.

mod host;
mod thread;
mod traffic;

use std::{fmt, time::Duration};

pub use thread::{RankPanic, ThreadCommunicator, ThreadGroup, ThreadGroupConfig, ThreadRank, mixed_kinds, panic_message};
pub use host::{HostCommunicator, HostDType, HostTensor, check_parts, mismatched, reduce};
pub use traffic::{Traffic, TrafficCounter};

/// Reduction applied by an all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ReduceOp {
    Sum,
    /// Sum divided by the group size.
    Mean,
    Max,
}

impl ReduceOp {
    /// Every reduction, in a fixed order (transports send the position).
    pub const ALL: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max];

    /// This reduction's position in [`ReduceOp::ALL`].
    pub fn code(self) -> u8 {
        Self::ALL.iter().position(|&r| r == self).unwrap() as u8
    }
}

/// What the ranks of a collective must agree on besides their tensors' shapes and dtypes. Ranks
/// that pass different ones get different results without an error (one a mean, another a sum;
/// two roots that each keep their own tensor), so every transport compares them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Agreed {
    Nothing,
    Reduction(ReduceOp),
    Root(usize),
}

impl fmt::Display for Agreed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Agreed::Nothing => f.write_str("nothing"),
            Agreed::Reduction(op) => write!(f, "the reduction {op:?}"),
            Agreed::Root(root) => write!(f, "root {root}"),
        }
    }
}

/// Fails unless every rank's `agreed` (in rank order) is this rank's (`rank`), naming the first
/// that differs. Every rank of a disagreeing group fails, none waits.
pub fn check_agreed(op: Collective, rank: usize, agreed: &[Agreed]) -> Result<(), CommError> {
    match agreed.iter().position(|&theirs| theirs != agreed[rank]) {
        None => Ok(()),
        Some(peer) => Err(disagreement(op, peer, agreed[peer], agreed[rank])),
    }
}

/// The error of a rank whose `peer` passed `theirs` where this rank passed `mine`.
pub fn disagreement(op: Collective, peer: usize, theirs: Agreed, mine: Agreed) -> CommError {
    CommError::InvalidArgument { op, reason: format!("rank {peer} of this group passed {theirs}, this rank {mine}; every rank must pass the same") }
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
    ReduceScatter,
}

impl Collective {
    /// Every collective, in a fixed order (transports number them by position).
    pub const ALL: [Collective; 10] = [
        Collective::AllToAll,
        Collective::AllReduce,
        Collective::AllGather,
        Collective::Broadcast,
        Collective::Barrier,
        Collective::AllGatherHost,
        Collective::Split,
        Collective::SendRecv,
        Collective::AllToAllUneven,
        Collective::ReduceScatter,
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
            Collective::ReduceScatter => "reduce_scatter",
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
         (ULYSSES_COLLECTIVE_TIMEOUT, or ThreadGroupConfig::with_timeout_secs for a ThreadGroup \
         of your own) if it is only slow. With ranks as threads, also check that \
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

/// A broadcast's root, which no peer is needed to refuse: a rank of the group.
pub fn check_broadcast_root(root: usize, size: usize) -> Result<(), CommError> {
    if root >= size {
        return Err(CommError::InvalidArgument { op: Collective::Broadcast, reason: format!("root {root} is out of range for a group of {size} ranks") });
    }
    Ok(())
}

/// The arguments of a send/recv that no peer is needed to refuse.
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

/// Fails unless rank `from`, which this rank receives from, sends to this rank (`their_to`):
/// the ranks' to and from must form a permutation.
pub fn check_sender_pairs(rank: usize, from: usize, their_to: usize) -> Result<(), CommError> {
    if their_to == rank {
        return Ok(());
    }
    Err(CommError::InvalidArgument {
        op: Collective::SendRecv,
        reason: format!("rank {rank} receives from rank {from}, which sends to rank {their_to}; the ranks' to and from must pair up"),
    })
}

/// `gathered` (every rank's values of a host all-gather) if every rank sent as many values as
/// this one (`mine`); otherwise the error naming `what` and the first rank that differs: the
/// ranks run different models, or different host collectives met.
pub fn check_gathered_lengths(gathered: Vec<Vec<u64>>, mine: usize, what: &'static str) -> Result<Vec<Vec<u64>>, CommError> {
    match gathered.iter().position(|v| v.len() != mine) {
        None => Ok(gathered),
        Some(rank) => Err(CommError::Diverged { what, mine, rank, theirs: gathered[rank].len() }),
    }
}

/// `communicator`'s all-gather of `values` ([`what`](CommError::Diverged) they are), every
/// rank's of this rank's length ([`check_gathered_lengths`]).
pub fn all_gather_host_checked(communicator: &dyn HostCommunicator, values: &[u64], what: &'static str) -> Result<Vec<Vec<u64>>, CommError> {
    check_gathered_lengths(communicator.all_gather_host(values)?, values.len(), what)
}

/// The tensor of a reduce-scatter, which no peer is needed to refuse unless it is 1-D with
/// one equal part per rank of a group of `size`.
pub fn check_reduce_scatter(shape: &[usize], size: usize) -> Result<(), CommError> {
    match shape {
        [elements] if *elements > 0 && elements % size == 0 => Ok(()),
        _ => Err(CommError::InvalidArgument {
            op: Collective::ReduceScatter,
            reason: format!(
                "the tensor must be 1-D with a multiple of the group size ({size}) elements, one equal part per rank; got shape {shape:?}. Pad it to a multiple of {size}"
            ),
        }),
    }
}

/// The arguments of an uneven all-to-all that no peer is needed to refuse.
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

