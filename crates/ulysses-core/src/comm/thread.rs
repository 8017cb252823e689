//! In-process ranks: a group whose ranks are threads of one process.
//!
//! Each collective is a *round*, numbered per group by how many collectives a rank has
//! issued. A rank deposits its contribution into the round (any `Send` value: each Burn
//! version's communicator deposits its own tensors), waits until every rank of the group has
//! deposited, then takes what it needs. Tensors move by ownership, so backends whose tensors
//! live in host memory copy nothing.
//!
//! Nothing hangs: a rank that leaves the group (its [`ThreadRank`] is dropped, normally or
//! while unwinding from a panic) fails every round it has not joined, and every wait has a
//! deadline.

use std::{
    any::Any,
    collections::HashMap,
    panic::{AssertUnwindSafe, catch_unwind},
    sync::{
        Arc, Condvar, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use super::{Collective, CommError, HostTensor, ReduceOp, Traffic, TrafficCounter};

/// Settings of an in-process group.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ThreadGroupConfig {
    /// Number of ranks (threads).
    pub size: usize,
    /// How long a rank waits for the others in one collective before failing (600 s by default).
    pub timeout_secs: f64,
}

impl ThreadGroupConfig {
    pub fn new(size: usize) -> Self {
        Self { size, timeout_secs: 600.0 }
    }

    pub fn with_timeout_secs(mut self, timeout_secs: f64) -> Self {
        self.timeout_secs = timeout_secs;
        self
    }
}

/// A group of ranks that are threads of this process. Cheap to clone.
#[derive(Clone)]
pub struct ThreadGroup {
    family: Arc<Family>,
}

/// One rank's membership of a [`ThreadGroup`]. Dropping it tells the other ranks that this
/// rank is gone, so their pending collectives fail instead of waiting.
pub struct ThreadRank {
    communicator: Arc<ThreadCommunicator>,
}

/// The payload of a panicked rank, as returned by [`ThreadGroup::run`].
#[derive(Debug, Clone)]
pub struct RankPanic {
    pub rank: usize,
    pub message: String,
}

impl std::fmt::Display for RankPanic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {} panicked: {}", self.rank, self.message)
    }
}

impl ThreadGroup {
    /// A group of `size` ranks with the default timeout.
    pub fn new(size: usize) -> Self {
        Self::from_config(&ThreadGroupConfig::new(size))
    }

    pub fn from_config(config: &ThreadGroupConfig) -> Self {
        assert!(config.size > 0, "a ThreadGroup needs at least one rank, got size 0");
        // Past a billion seconds (an infinity meant as "no timeout"), a deadline is past the
        // clock's range: `Duration::from_secs_f64` would panic without a word of why.
        assert!(
            config.timeout_secs > 0.0 && config.timeout_secs <= 1e9,
            "ThreadGroupConfig::timeout_secs must be positive, at most 1e9 seconds, got {}",
            config.timeout_secs
        );
        let family = Family {
            world_size: config.size,
            timeout: Duration::from_secs_f64(config.timeout_secs),
            state: Mutex::new(FamilyState {
                joined: vec![false; config.size],
                departed: vec![false; config.size],
                rounds: HashMap::new(),
                subgroups: HashMap::new(),
                next_group: 1,
            }),
            changed: Condvar::new(),
        };
        Self { family: Arc::new(family) }
    }

    pub fn size(&self) -> usize {
        self.family.world_size
    }

    /// Takes the membership of `rank`. Each rank can be joined once.
    pub fn join(&self, rank: usize) -> ThreadRank {
        let size = self.size();
        assert!(rank < size, "rank {rank} is out of range for a group of {size} ranks");
        {
            let mut state = self.family.lock();
            assert!(!state.joined[rank], "rank {rank} of this ThreadGroup was already joined");
            state.joined[rank] = true;
        }
        let communicator = ThreadCommunicator {
            family: self.family.clone(),
            group: 0,
            members: (0..size).collect::<Vec<_>>().into(),
            rank,
            next_seq: AtomicU64::new(0),
            traffic: TrafficCounter::default(),
        };
        ThreadRank { communicator: Arc::new(communicator) }
    }

    /// Runs `work` on every rank, one scoped thread each, and returns each rank's result in
    /// rank order. A rank that panics yields a [`RankPanic`]; the others see it leave and fail
    /// their pending collectives rather than wait.
    pub fn run<T, F>(&self, work: F) -> Vec<Result<T, RankPanic>>
    where
        T: Send,
        F: Fn(&ThreadRank) -> T + Sync,
    {
        let work = &work;
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..self.size())
                .map(|rank| {
                    let membership = self.join(rank);
                    std::thread::Builder::new()
                        .name(format!("sp-rank-{rank}"))
                        .spawn_scoped(scope, move || {
                            let result = catch_unwind(AssertUnwindSafe(|| work(&membership)));
                            // Leave the group before reporting, so peers stop waiting.
                            drop(membership);
                            result.map_err(|payload| RankPanic {
                                rank,
                                message: panic_message(payload.as_ref()),
                            })
                        })
                        .expect("failed to spawn a rank thread")
                })
                .collect();
            handles
                .into_iter()
                .map(|handle| handle.join().expect("rank thread result was lost"))
                .collect()
        })
    }
}

impl ThreadRank {
    pub fn rank(&self) -> usize {
        self.communicator.rank
    }

    pub fn size(&self) -> usize {
        self.communicator.members.len()
    }

    /// This rank's communicator over the whole group: burn-ulysses implements its
    /// `Communicator<B>` on it for every backend `B`; burn-ulysses-ops enters it as the
    /// thread's group.
    pub fn communicator(&self) -> Arc<ThreadCommunicator> {
        self.communicator.clone()
    }
}

impl Drop for ThreadRank {
    fn drop(&mut self) {
        let world_rank = self.communicator.members[self.communicator.rank];
        self.communicator.family.lock().departed[world_rank] = true;
        self.communicator.family.changed.notify_all();
    }
}

/// A rank's communicator within a [`ThreadGroup`] or one of its splits.
pub struct ThreadCommunicator {
    family: Arc<Family>,
    /// Which group of the family (0 is the whole group, splits get new ids).
    group: u64,
    /// World ranks of this group's members, in group-rank order.
    members: Arc<[usize]>,
    rank: usize,
    next_seq: AtomicU64,
    traffic: TrafficCounter,
}

struct Family {
    world_size: usize,
    timeout: Duration,
    state: Mutex<FamilyState>,
    changed: Condvar,
}

struct FamilyState {
    joined: Vec<bool>,
    /// By world rank.
    departed: Vec<bool>,
    /// In-flight collectives, by (group, sequence number).
    rounds: HashMap<(u64, u64), Round>,
    /// Group ids created by splits, by (parent group, split's sequence number, color).
    subgroups: HashMap<(u64, u64, u32), u64>,
    next_group: u64,
}

/// One rank's contribution to a round.
pub type Deposit = Box<dyn Any + Send>;

struct Round {
    op: Collective,
    deposits: Vec<Option<Deposit>>,
    arrived: usize,
    readers_left: usize,
    /// Set when the round can never complete; every waiting rank returns it.
    failure: Option<CommError>,
}

impl Family {
    fn lock(&self) -> MutexGuard<'_, FamilyState> {
        // A rank that panicked while holding the lock leaves the state consistent: every
        // mutation below is a single assignment.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl ThreadCommunicator {
    /// Deposits this rank's contribution to the next collective, waits for every rank, then
    /// lets `take` extract what this rank needs (under the lock: keep it to moves and
    /// clones). Returns the round's sequence number with the extracted value. Transports
    /// build their collectives on it; every rank must call it with the same `op`.
    pub fn round<T>(
        &self,
        op: Collective,
        deposit: Deposit,
        take: impl FnOnce(&mut [Option<Deposit>]) -> T,
    ) -> Result<(u64, T), CommError> {
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let key = (self.group, seq);
        let size = self.members.len();
        let deadline = Instant::now() + self.family.timeout;
        let mut state = self.family.lock();

        let round = state.rounds.entry(key).or_insert_with(|| Round {
            op,
            deposits: (0..size).map(|_| None).collect(),
            arrived: 0,
            readers_left: size,
            failure: None,
        });
        if round.op != op {
            let first = round.deposits.iter().position(Option::is_some).unwrap_or(0);
            round.failure = Some(CommError::Mismatch {
                seq,
                op: round.op,
                peer: self.rank,
                peer_op: op,
            });
            self.family.changed.notify_all();
            return Err(CommError::Mismatch { seq, op, peer: first, peer_op: round.op });
        }
        round.deposits[self.rank] = Some(deposit);
        round.arrived += 1;
        self.family.changed.notify_all();

        loop {
            let round = state.rounds.get_mut(&key).expect("round removed before completion");
            if let Some(failure) = &round.failure {
                return Err(failure.clone());
            }
            if round.arrived == size {
                break;
            }
            let missing: Vec<usize> =
                (0..size).filter(|&r| round.deposits[r].is_none()).collect();
            if let Some(&peer) = missing.iter().find(|&&r| state.departed[self.members[r]]) {
                let failure = CommError::PeerLeft { peer, world_peer: self.members[peer], op, seq };
                state.rounds.get_mut(&key).unwrap().failure = Some(failure.clone());
                self.family.changed.notify_all();
                return Err(failure);
            }
            let now = Instant::now();
            if now >= deadline {
                let waiting_for = missing.iter().map(|&r| self.members[r]).collect();
                let failure = CommError::Timeout { op, seq, waiting_for, after: self.family.timeout };
                // The ranks that did arrive fail now too, instead of each at its own deadline.
                state.rounds.get_mut(&key).unwrap().failure = Some(failure.clone());
                self.family.changed.notify_all();
                return Err(failure);
            }
            state = self
                .family
                .changed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }

        let round = state.rounds.get_mut(&key).unwrap();
        let taken = take(&mut round.deposits);
        round.readers_left -= 1;
        if round.readers_left == 0 {
            state.rounds.remove(&key);
        }
        Ok((seq, taken))
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// The byte counters that a transport built on this group records into.
    pub fn traffic_counter(&self) -> &TrafficCounter {
        &self.traffic
    }

    pub fn traffic(&self) -> Traffic {
        self.traffic.snapshot()
    }

    /// Returns once every rank has called it.
    pub fn barrier(&self) -> Result<(), CommError> {
        self.round(Collective::Barrier, Box::new(()), |_| ()).map(|_| ())
    }

    /// Every rank's `values`, in rank order.
    pub fn all_gather_host(&self, values: &[u64]) -> Result<Vec<Vec<u64>>, CommError> {
        let op = Collective::AllGatherHost;
        let (_, gathered) = self.round(op, Box::new(values.to_vec()), |deposits| {
            deposits.iter().map(|d| d.as_ref().and_then(|d| d.downcast_ref::<Vec<u64>>()).cloned()).collect::<Option<Vec<_>>>()
        })?;
        gathered.ok_or_else(|| mixed_kinds(op))
    }
}

/// A rank found a deposit of another type than its own in the same round.
pub fn mixed_kinds(op: Collective) -> CommError {
    CommError::InvalidArgument {
        op,
        reason: "ranks passed different kinds of values to the same collective (tensors of \
                 different backends, or different element types)"
            .into(),
    }
}

impl ThreadCommunicator {
    /// Collectively splits the group like `MPI_Comm_split`: ranks passing the same `color` form
    /// a new group, ordered by `key` (then by rank). A sub-group still moves any value.
    pub fn split_group(&self, color: u32, key: u32) -> Result<Arc<Self>, CommError> {
        let values = [u64::from(color), u64::from(key)];
        let (seq, gathered) = self.round(Collective::Split, Box::new(values), |deposits| {
            deposits
                .iter()
                .map(|d| d.as_ref().and_then(|d| d.downcast_ref::<[u64; 2]>()).copied())
                .collect::<Option<Vec<_>>>()
        })?;
        let gathered = gathered.ok_or_else(|| mixed_kinds(Collective::Split))?;
        let mut same_color: Vec<(u64, usize)> = gathered
            .iter()
            .enumerate()
            .filter(|(_, [c, _])| *c == u64::from(color))
            .map(|(rank, [_, k])| (*k, rank))
            .collect();
        same_color.sort();
        let new_rank = same_color.iter().position(|&(_, r)| r == self.rank).unwrap();
        let members: Arc<[usize]> =
            same_color.iter().map(|&(_, r)| self.members[r]).collect::<Vec<_>>().into();

        let group = {
            let mut state = self.family.lock();
            let next = state.next_group;
            let id = *state.subgroups.entry((self.group, seq, color)).or_insert(next);
            if id == next {
                state.next_group += 1;
            }
            id
        };
        Ok(Arc::new(ThreadCommunicator {
            family: self.family.clone(),
            group,
            members,
            rank: new_rank,
            next_seq: AtomicU64::new(0),
            traffic: TrafficCounter::default(),
        }))
    }
}

/// The text of a panic's payload.
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(message) = payload.downcast_ref::<String>() {
        message.clone()
    } else if let Some(message) = payload.downcast_ref::<&str>() {
        message.to_string()
    } else {
        "non-string panic payload".to_string()
    }
}

/// Host tensors between rank threads: parts move by ownership; reductions read every rank's
/// tensor (shared, not copied) and each rank reduces in rank order, so all get the same bits.
impl super::HostCommunicator for ThreadCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn all_to_all(&self, parts: Vec<HostTensor>) -> Result<Vec<HostTensor>, CommError> {
        let op = Collective::AllToAll;
        super::host::check_parts(&parts, self.members.len())?;
        let total: u64 = parts.iter().map(|part| part.bytes.len() as u64).sum();
        self.traffic.record_all_to_all_parts(total, total - parts[self.rank].bytes.len() as u64);
        let (dtype, rank) = (parts[self.rank].dtype, self.rank);
        let parts: Vec<Option<HostTensor>> = parts.into_iter().map(Some).collect();
        let (_, received) = self.round(op, Box::new(parts), |deposits| {
            deposits.iter_mut().map(|d| d.as_mut().and_then(|d| d.downcast_mut::<Vec<Option<HostTensor>>>()).and_then(|parts| parts[rank].take())).collect::<Option<Vec<_>>>()
        })?;
        let received = received.ok_or_else(|| mixed_kinds(op))?;
        match received.iter().position(|part| part.dtype != dtype) {
            None => Ok(received),
            Some(peer) => Err(super::host::mismatched(op, peer, format!("a part of {:?} (this rank's: {dtype:?})", received[peer].dtype))),
        }
    }

    fn all_reduce(&self, tensor: HostTensor, op: ReduceOp) -> Result<HostTensor, CommError> {
        let collective = Collective::AllReduce;
        self.traffic.record_all_reduce(tensor.bytes.len() as u64);
        let every_rank = self.shared_round(collective, tensor, super::Agreed::Reduction(op))?;
        let mine = &every_rank[self.rank];
        let parts: Vec<&[u8]> = every_rank.iter().map(|t| t.bytes.as_slice()).collect();
        Ok(HostTensor { dtype: mine.dtype, shape: mine.shape.clone(), bytes: super::host::reduce(&parts, mine.dtype, op) })
    }

    fn reduce_scatter(&self, tensor: HostTensor, op: ReduceOp) -> Result<HostTensor, CommError> {
        let collective = Collective::ReduceScatter;
        let size = self.members.len();
        super::check_reduce_scatter(&tensor.shape, size)?;
        self.traffic.record_reduce_scatter(tensor.bytes.len() as u64);
        let every_rank = self.shared_round(collective, tensor, super::Agreed::Reduction(op))?;
        let mine = &every_rank[self.rank];
        let part = mine.bytes.len() / size;
        let at = self.rank * part..(self.rank + 1) * part;
        let parts: Vec<&[u8]> = every_rank.iter().map(|t| &t.bytes[at.clone()]).collect();
        Ok(HostTensor { dtype: mine.dtype, shape: vec![mine.elements() / size], bytes: super::host::reduce(&parts, mine.dtype, op) })
    }

    fn all_gather(&self, tensor: HostTensor) -> Result<Vec<HostTensor>, CommError> {
        self.traffic.record_all_gather(tensor.bytes.len() as u64);
        Ok(self.shared_round(Collective::AllGather, tensor, super::Agreed::Nothing)?.iter().map(|t| (**t).clone()).collect())
    }

    fn broadcast(&self, tensor: HostTensor, root: usize) -> Result<HostTensor, CommError> {
        let op = Collective::Broadcast;
        super::check_broadcast_root(root, self.members.len())?;
        if self.rank == root {
            self.traffic.record_broadcast(tensor.bytes.len() as u64);
        }
        let every_rank = self.shared_round(op, tensor, super::Agreed::Root(root))?;
        Ok((*every_rank[root]).clone())
    }

    fn send_recv(&self, tensor: HostTensor, to: usize, from: usize) -> Result<HostTensor, CommError> {
        let op = Collective::SendRecv;
        super::check_send_recv(self.rank, self.members.len(), to, from)?;
        self.traffic.record_send_recv(tensor.bytes.len() as u64, to != self.rank);
        let (dtype, shape, rank) = (tensor.dtype, tensor.shape.clone(), self.rank);
        let (_, received) = self.round(op, Box::new((to, Some(tensor))), |deposits| {
            deposits[from].as_mut().and_then(|d| d.downcast_mut::<(usize, Option<HostTensor>)>()).map(|(their_to, tensor)| (*their_to, tensor.take()))
        })?;
        let (their_to, received) = received.ok_or_else(|| mixed_kinds(op))?;
        super::check_sender_pairs(rank, from, their_to)?;
        let received = received.ok_or_else(|| mixed_kinds(op))?;
        if received.dtype != dtype || received.shape != shape {
            return Err(super::host::mismatched(op, from, format!("{:?} of shape {:?} (this rank: {dtype:?} of {shape:?})", received.dtype, received.shape)));
        }
        Ok(received)
    }

    fn barrier(&self) -> Result<(), CommError> {
        ThreadCommunicator::barrier(self)
    }

    fn all_gather_host(&self, values: &[u64]) -> Result<Vec<Vec<u64>>, CommError> {
        ThreadCommunicator::all_gather_host(self, values)
    }

    fn split(&self, color: u32, key: u32) -> Result<Arc<dyn super::HostCommunicator>, CommError> {
        Ok(self.split_group(color, key)?)
    }

    fn traffic(&self) -> Traffic {
        self.traffic.snapshot()
    }
}

impl ThreadCommunicator {
    /// Every rank's `tensor`, shared, in rank order; fails on every rank when one passed
    /// another shape or dtype than this rank, or another `agreed`.
    fn shared_round(&self, op: Collective, tensor: HostTensor, agreed: super::Agreed) -> Result<Vec<Arc<HostTensor>>, CommError> {
        let (_, every_rank) = self.round(op, Box::new((Arc::new(tensor), agreed)), |deposits| {
            deposits.iter().map(|d| d.as_ref().and_then(|d| d.downcast_ref::<(Arc<HostTensor>, super::Agreed)>()).cloned()).collect::<Option<Vec<_>>>()
        })?;
        let (every_rank, agreed): (Vec<Arc<HostTensor>>, Vec<super::Agreed>) = every_rank.ok_or_else(|| mixed_kinds(op))?.into_iter().unzip();
        super::check_agreed(op, self.rank, &agreed)?;
        let mine = &every_rank[self.rank];
        match every_rank.iter().position(|t| t.dtype != mine.dtype || t.shape != mine.shape) {
            None => Ok(every_rank),
            Some(peer) => {
                let theirs = &every_rank[peer];
                Err(super::host::mismatched(op, peer, format!("{:?} of shape {:?} (this rank: {:?} of {:?})", theirs.dtype, theirs.shape, mine.dtype, mine.shape)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{HostCommunicator, HostDType, HostTensor, ReduceOp};
    use super::*;

    /// Host tensors between rank threads: a rank that passes another reduction or root gets an
    /// error on every rank, naming the other rank's, not each rank a result of its own.
    #[test]
    fn ranks_that_pass_another_reduction_or_root_are_refused() {
        let reductions = [ReduceOp::Max, ReduceOp::Sum];
        let errors = ThreadGroup::new(2).run(|rank| {
            let (comm, r) = (rank.communicator(), rank.rank());
            let pair = || HostTensor::new(HostDType::F32, vec![2], vec![0; 8], Collective::AllReduce).unwrap();
            let calls: [&dyn Fn() -> Result<HostTensor, CommError>; 3] = [
                &|| HostCommunicator::all_reduce(&*comm, pair(), reductions[r]),
                &|| HostCommunicator::reduce_scatter(&*comm, pair(), reductions[r]),
                &|| HostCommunicator::broadcast(&*comm, pair(), r),
            ];
            calls.map(|call| call().map(drop).unwrap_err().to_string())
        });
        for (r, errors) in errors.into_iter().enumerate() {
            let reduction = format!("rank {} of this group passed the reduction {:?}, this rank the reduction {:?}", 1 - r, reductions[1 - r], reductions[r]);
            let expected = [reduction.clone(), reduction, format!("rank {} of this group passed root {}, this rank root {r}", 1 - r, 1 - r)];
            for (error, expected) in errors.unwrap().iter().zip(expected) {
                assert!(error.contains(&expected), "expected {expected:?}: {error}");
            }
        }
    }
}
