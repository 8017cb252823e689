//! In-process ranks: a group whose ranks are threads of one process.
//!
//! Each collective is a *round*, numbered per group by how many collectives a rank has
//! issued. A rank deposits its contribution into the round, waits until every rank of the
//! group has deposited, then takes what it needs. Tensors move by ownership (no copy for
//! backends whose tensors live in host memory); a rank on another device receives them
//! through `float_to_device`.
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

use burn::{
    config::Config,
    tensor::{Shape, Tensor, TensorMetadata, backend::Backend, ops::FloatTensor},
};

use super::{Collective, CommError, Communicator, ReduceOp, Traffic, TrafficCounter};
use crate::primitive::{as_rows, byte_size, float_primitive};

/// Settings of an in-process group.
#[derive(Config, Debug)]
pub struct ThreadGroupConfig {
    /// Number of ranks (threads).
    pub size: usize,
    /// How long a rank waits for the others in one collective before failing.
    #[config(default = 600.0)]
    pub timeout_secs: f64,
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
        assert!(
            config.timeout_secs > 0.0,
            "ThreadGroupConfig::timeout_secs must be positive, got {}",
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

    /// This rank's communicator over the whole group; it implements `Communicator<B>` for
    /// every backend `B`.
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

type Deposit = Box<dyn Any + Send>;

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
    /// clones). Returns the round's sequence number with the extracted value.
    fn round<T>(
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

    /// Clones every rank's deposited tensor, in rank order.
    fn gather_tensors<B: Backend>(
        &self,
        op: Collective,
        tensor: FloatTensor<B>,
    ) -> Result<Vec<FloatTensor<B>>, CommError> {
        let device = B::float_device(&tensor);
        settle::<B>(&device, op)?;
        let (_, tensors) = self.round(op, Box::new(tensor), |deposits| {
            deposits
                .iter()
                .map(|d| d.as_ref().and_then(|d| d.downcast_ref::<FloatTensor<B>>()).cloned())
                .collect::<Option<Vec<_>>>()
        })?;
        let tensors = tensors.ok_or_else(|| mixed_backends(op))?;
        Ok(tensors.into_iter().map(|t| B::float_to_device(t, &device)).collect())
    }

    fn check_same_shapes<B: Backend>(
        op: Collective,
        tensors: &[FloatTensor<B>],
    ) -> Result<(), CommError> {
        let first = tensors[0].shape();
        match tensors.iter().position(|t| t.shape() != first) {
            None => Ok(()),
            Some(rank) => Err(CommError::InvalidArgument {
                op,
                reason: format!(
                    "rank 0 passed shape {:?} but rank {rank} passed {:?}; every rank must pass \
                     the same shape",
                    first.to_vec(),
                    tensors[rank].shape().to_vec()
                ),
            }),
        }
    }
}

/// Waits for this thread's queued work on `device`. Tensors cross threads here, and a
/// backend with a stream per thread (CubeCL) would otherwise let another rank read a
/// buffer before this rank's kernels have written it.
fn settle<B: Backend>(device: &B::Device, op: Collective) -> Result<(), CommError> {
    B::sync(device).map_err(|error| CommError::Backend(format!("{op}: cannot finish the rank's queued work: {error}")))
}

/// Returns a collective's result once this thread's stream has finished computing it from
/// `received` (the other ranks' tensors). `received` is held until then: on a backend with a
/// stream per thread, a buffer whose last handle is dropped may be reused by its owner's
/// stream while ours still has reads of it queued, and an operation holding the last handle
/// may write in place.
fn adopt<B: Backend>(
    result: FloatTensor<B>,
    device: &B::Device,
    op: Collective,
    received: Vec<FloatTensor<B>>,
) -> Result<FloatTensor<B>, CommError> {
    settle::<B>(device, op)?;
    drop(received);
    Ok(result)
}

/// A rank found a deposit of another type than its own in the same round.
fn mixed_backends(op: Collective) -> CommError {
    CommError::InvalidArgument {
        op,
        reason: "ranks passed different kinds of values to the same collective (tensors of \
                 different backends, or different element types)"
            .into(),
    }
}

impl<B: Backend> Communicator<B> for ThreadCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn all_to_all(&self, tensor: FloatTensor<B>) -> Result<FloatTensor<B>, CommError> {
        let op = Collective::AllToAll;
        let size = self.members.len();
        let shape = tensor.shape();
        if shape.num_dims() == 0 || shape[0] != size {
            return Err(CommError::InvalidArgument {
                op,
                reason: format!(
                    "dim 0 must equal the group size {size}, got shape {:?}",
                    shape.to_vec()
                ),
            });
        }
        self.traffic.record_all_to_all(byte_size::<B>(&tensor), size);
        let device = B::float_device(&tensor);
        let slices: Vec<Option<FloatTensor<B>>> = as_rows::<B>(tensor, size)
            .chunk(size, 0)
            .into_iter()
            .map(|slice| Some(float_primitive(slice)))
            .collect();
        settle::<B>(&device, op)?;

        let me = self.rank;
        let (_, received) = self.round(op, Box::new(slices), |deposits| {
            deposits
                .iter_mut()
                .map(|d| {
                    d.as_mut()
                        .and_then(|d| d.downcast_mut::<Vec<Option<FloatTensor<B>>>>())
                        .and_then(|slices| slices[me].take())
                })
                .collect::<Option<Vec<_>>>()
        })?;
        let received = received.ok_or_else(|| mixed_backends(op))?;
        Self::check_same_shapes::<B>(op, &received)?;
        let rows: Vec<Tensor<B, 2>> = received
            .iter()
            .map(|t| crate::primitive::float_tensor(B::float_to_device(t.clone(), &device)))
            .collect();
        adopt::<B>(B::float_reshape(float_primitive(Tensor::cat(rows, 0)), shape), &device, op, received)
    }

    fn all_to_all_uneven(&self, tensor: FloatTensor<B>, send_counts: &[usize], recv_counts: &[usize]) -> Result<FloatTensor<B>, CommError> {
        let op = Collective::AllToAllUneven;
        let size = self.members.len();
        let shape = tensor.shape();
        super::check_uneven_counts(size, shape.num_elements(), shape.num_dims(), send_counts, recv_counts)?;
        let me = self.rank;
        let element = tensor.dtype().size() as u64;
        let total: usize = send_counts.iter().sum();
        self.traffic.record_all_to_all_parts(total as u64 * element, (total - send_counts[me]) as u64 * element);
        let device = B::float_device(&tensor);
        // Slot j holds the part for rank j (`None` when empty, and once taken).
        let parts: Vec<Option<Option<FloatTensor<B>>>> =
            super::split_parts(&crate::primitive::float_tensor::<B, 1>(tensor), send_counts).into_iter().map(|part| Some(part.map(float_primitive))).collect();
        settle::<B>(&device, op)?;
        let (_, received) = self.round(op, Box::new(parts), |deposits| {
            deposits
                .iter_mut()
                .map(|d| d.as_mut().and_then(|d| d.downcast_mut::<Vec<Option<Option<FloatTensor<B>>>>>()).and_then(|parts| parts[me].take()))
                .collect::<Option<Vec<_>>>()
        })?;
        let received = received.ok_or_else(|| mixed_backends(op))?;
        let sent_here: Vec<usize> = received.iter().map(|part| part.as_ref().map_or(0, |p| p.shape().num_elements())).collect();
        super::check_counts_pair_up(me, &sent_here, recv_counts)?;
        let received: Vec<FloatTensor<B>> = received.into_iter().flatten().collect();
        let parts: Vec<Tensor<B, 1>> = received.iter().map(|t| crate::primitive::float_tensor(B::float_to_device(t.clone(), &device))).collect();
        adopt::<B>(float_primitive(Tensor::cat(parts, 0)), &device, op, received)
    }

    fn all_reduce(&self, tensor: FloatTensor<B>, op: ReduceOp) -> Result<FloatTensor<B>, CommError> {
        self.traffic.record_all_reduce(byte_size::<B>(&tensor));
        let shape = tensor.shape();
        let tensors = self.gather_tensors::<B>(Collective::AllReduce, tensor)?;
        Self::check_same_shapes::<B>(Collective::AllReduce, &tensors)?;
        // Reduce in rank order on every rank, so all ranks get bit-identical results.
        let size = tensors.len();
        let mut rows = tensors.iter().map(|t| as_rows::<B>(t.clone(), 1));
        let first = rows.next().unwrap();
        let reduced = rows.fold(first, |acc, t| match op {
            ReduceOp::Sum | ReduceOp::Mean => acc + t,
            ReduceOp::Max => acc.max_pair(t),
        });
        let reduced = match op {
            ReduceOp::Mean => reduced / size as f64,
            _ => reduced,
        };
        let device = reduced.device();
        adopt::<B>(B::float_reshape(float_primitive(reduced), shape), &device, Collective::AllReduce, tensors)
    }

    fn all_gather(&self, tensor: FloatTensor<B>) -> Result<FloatTensor<B>, CommError> {
        self.traffic.record_all_gather(byte_size::<B>(&tensor));
        let mut shape = tensor.shape();
        let tensors = self.gather_tensors::<B>(Collective::AllGather, tensor)?;
        Self::check_same_shapes::<B>(Collective::AllGather, &tensors)?;
        shape.insert(0, tensors.len());
        let rows: Vec<Tensor<B, 2>> = tensors.iter().map(|t| as_rows::<B>(t.clone(), 1)).collect();
        let device = rows[0].device();
        adopt::<B>(B::float_reshape(float_primitive(Tensor::cat(rows, 0)), shape), &device, Collective::AllGather, tensors)
    }

    fn broadcast(&self, tensor: FloatTensor<B>, root: usize) -> Result<FloatTensor<B>, CommError> {
        let op = Collective::Broadcast;
        let size = self.members.len();
        if root >= size {
            return Err(CommError::InvalidArgument {
                op,
                reason: format!("root {root} is out of range for a group of {size} ranks"),
            });
        }
        if self.rank == root {
            self.traffic.record_broadcast(byte_size::<B>(&tensor));
        }
        let shape: Shape = tensor.shape();
        let mut tensors = self.gather_tensors::<B>(op, tensor)?;
        Self::check_same_shapes::<B>(op, &tensors)?;
        debug_assert_eq!(tensors[root].shape(), shape);
        let root_tensor = tensors.swap_remove(root);
        let device = B::float_device(&root_tensor);
        // A copy of our own: the root's buffer stays the root's.
        let copy = B::float_mul_scalar(root_tensor.clone(), 1.0.into());
        adopt::<B>(copy, &device, op, vec![root_tensor])
    }

    fn send_recv(&self, tensor: FloatTensor<B>, to: usize, from: usize) -> Result<FloatTensor<B>, CommError> {
        let op = Collective::SendRecv;
        let size = self.members.len();
        super::check_send_recv(self.rank, size, to, from)?;
        self.traffic.record_send_recv(byte_size::<B>(&tensor), to != self.rank);
        let shape = tensor.shape();
        let device = B::float_device(&tensor);
        settle::<B>(&device, op)?;
        let me = self.rank;
        let (_, received) = self.round(op, Box::new((to, tensor)), |deposits| {
            let deposit = deposits[from].as_ref()?.downcast_ref::<(usize, FloatTensor<B>)>()?;
            Some(deposit.clone())
        })?;
        let (their_to, received) = received.ok_or_else(|| mixed_backends(op))?;
        if their_to != me {
            return Err(CommError::InvalidArgument {
                op,
                reason: format!("rank {me} receives from rank {from}, which sends to rank {their_to}; the ranks' to and from must pair up"),
            });
        }
        if received.shape() != shape {
            return Err(CommError::InvalidArgument {
                op,
                reason: format!("rank {from} sent shape {:?}, rank {me} passed {:?}; send_recv moves tensors of one shape", received.shape().to_vec(), shape.to_vec()),
            });
        }
        // A copy of our own: the sender's buffer stays the sender's.
        let copy = B::float_mul_scalar(B::float_to_device(received.clone(), &device), 1.0.into());
        adopt::<B>(copy, &device, op, vec![received])
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.round(Collective::Barrier, Box::new(()), |_| ()).map(|_| ())
    }

    fn all_gather_host(&self, values: &[u64]) -> Result<Vec<Vec<u64>>, CommError> {
        let op = Collective::AllGatherHost;
        let (_, gathered) = self.round(op, Box::new(values.to_vec()), |deposits| {
            deposits
                .iter()
                .map(|d| d.as_ref().and_then(|d| d.downcast_ref::<Vec<u64>>()).cloned())
                .collect::<Option<Vec<_>>>()
        })?;
        gathered.ok_or_else(|| mixed_backends(op))
    }

    fn split(&self, color: u32, key: u32) -> Result<Arc<dyn Communicator<B>>, CommError> {
        Ok(self.split_group(color, key)?)
    }

    fn traffic(&self) -> Traffic {
        self.traffic.snapshot()
    }
}

impl ThreadCommunicator {
    /// [`Communicator::split`], returning the concrete type (a sub-group still moves the
    /// tensors of every backend).
    pub fn split_group(&self, color: u32, key: u32) -> Result<Arc<Self>, CommError> {
        let values = [u64::from(color), u64::from(key)];
        let (seq, gathered) = self.round(Collective::Split, Box::new(values), |deposits| {
            deposits
                .iter()
                .map(|d| d.as_ref().and_then(|d| d.downcast_ref::<[u64; 2]>()).copied())
                .collect::<Option<Vec<_>>>()
        })?;
        let gathered = gathered.ok_or_else(|| mixed_backends(Collective::Split))?;
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
pub(crate) fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(message) = payload.downcast_ref::<String>() {
        message.clone()
    } else if let Some(message) = payload.downcast_ref::<&str>() {
        message.to_string()
    } else {
        "non-string panic payload".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::{TensorData, ops::FloatTensorOps};

    type B = NdArray<f32>;

    fn tensor(values: Vec<f32>, shape: [usize; 2]) -> FloatTensor<B> {
        B::float_from_data(TensorData::new(values, shape), &Default::default())
    }

    fn flat(values: Vec<f32>) -> FloatTensor<B> {
        let len = values.len();
        B::float_from_data(TensorData::new(values, [len]), &Default::default())
    }

    fn values(t: FloatTensor<B>) -> Vec<f32> {
        crate::primitive::float_tensor::<B, 1>(B::float_reshape(
            t.clone(),
            Shape::new([t.shape().num_elements()]),
        ))
        .into_data()
        .to_vec()
        .unwrap()
    }

    #[test]
    fn send_recv_shifts_around_the_ring_and_swaps_pairs_for_1_to_8_ranks() {
        for size in 1..=8 {
            let results = ThreadGroup::new(size).run(|rank| {
                let comm = rank.communicator();
                let r = rank.rank();
                let mine = || tensor(vec![r as f32, 10.0 * r as f32], [1, 2]);
                let shifted = values(Communicator::<B>::send_recv(&*comm, mine(), (r + 1) % size, (r + size - 1) % size).unwrap());
                // Pairs (0 1) (2 3) ..; a last rank without a partner keeps its own.
                let partner = if r ^ 1 < size { r ^ 1 } else { r };
                let swapped = values(Communicator::<B>::send_recv(&*comm, mine(), partner, partner).unwrap());
                (shifted, swapped, Communicator::<B>::traffic(&*comm).send_recv_bytes)
            });
            for (r, result) in results.into_iter().enumerate() {
                let (shifted, swapped, bytes) = result.unwrap();
                let previous = ((r + size - 1) % size) as f32;
                assert_eq!(shifted, vec![previous, 10.0 * previous], "group of {size}, rank {r}");
                let partner = if r ^ 1 < size { r ^ 1 } else { r } as f32;
                assert_eq!(swapped, vec![partner, 10.0 * partner], "group of {size}, rank {r}");
                let remote_calls = u64::from(size > 1) + u64::from(r ^ 1 < size);
                assert_eq!(bytes, remote_calls * 8, "group of {size}, rank {r}");
            }
        }
    }

    #[test]
    fn send_recv_refuses_pairs_that_do_not_match() {
        let results = ThreadGroup::new(3).run(|rank| {
            let comm = rank.communicator();
            let r = rank.rank();
            // Everyone sends to rank 0 and receives from rank 1.
            let (to, from) = if r == 0 { (0, 0) } else { (0, 1) };
            Communicator::<B>::send_recv(&*comm, tensor(vec![1.0], [1, 1]), to, from).err().map(|e| e.to_string())
        });
        let messages: Vec<String> = results.into_iter().filter_map(|r| r.unwrap()).collect();
        assert!(messages.iter().any(|m| m.contains("must pair up") || m.contains("keeps its tensor")), "{messages:?}");
        let error = super::super::check_send_recv(0, 2, 1, 0).unwrap_err().to_string();
        assert!(error.contains("keeps its tensor") || error.contains("receives only its own"), "{error}");
    }

    /// Counts that do not pair up fail on the thread transport and on the padded default
    /// (reached through a communicator that does not override it), naming both ranks.
    #[test]
    fn all_to_all_uneven_refuses_counts_that_do_not_pair_up() {
        struct DefaultOnly(Arc<dyn Communicator<B>>);
        impl Communicator<B> for DefaultOnly {
            fn rank(&self) -> usize { self.0.rank() }
            fn size(&self) -> usize { self.0.size() }
            fn all_to_all(&self, t: FloatTensor<B>) -> Result<FloatTensor<B>, CommError> { self.0.all_to_all(t) }
            fn all_reduce(&self, t: FloatTensor<B>, op: ReduceOp) -> Result<FloatTensor<B>, CommError> { self.0.all_reduce(t, op) }
            fn all_gather(&self, t: FloatTensor<B>) -> Result<FloatTensor<B>, CommError> { self.0.all_gather(t) }
            fn broadcast(&self, t: FloatTensor<B>, root: usize) -> Result<FloatTensor<B>, CommError> { self.0.broadcast(t, root) }
            fn send_recv(&self, t: FloatTensor<B>, to: usize, from: usize) -> Result<FloatTensor<B>, CommError> { self.0.send_recv(t, to, from) }
            fn barrier(&self) -> Result<(), CommError> { self.0.barrier() }
            fn all_gather_host(&self, values: &[u64]) -> Result<Vec<Vec<u64>>, CommError> { self.0.all_gather_host(values) }
            fn split(&self, color: u32, key: u32) -> Result<Arc<dyn Communicator<B>>, CommError> { self.0.split(color, key) }
            fn traffic(&self) -> Traffic { self.0.traffic() }
        }
        for padded_default in [false, true] {
            let results = ThreadGroup::new(2).run(move |rank| {
                let threads: Arc<dyn Communicator<B>> = rank.communicator();
                let comm: Arc<dyn Communicator<B>> = if padded_default { Arc::new(DefaultOnly(threads)) } else { threads };
                // Both send 1 to rank 0 and 2 to rank 1; then rank 1 expects 3 from rank 0.
                let expected = if rank.rank() == 0 { [1, 1] } else { [2, 2] };
                let good = values(comm.all_to_all_uneven(flat(vec![1.0, 2.0, 3.0]), &[1, 2], &expected).unwrap());
                let wrong_expected = if rank.rank() == 0 { [1, 1] } else { [3, 2] };
                let wrong = comm.all_to_all_uneven(flat(vec![1.0, 2.0, 3.0]), &[1, 2], &wrong_expected);
                (good, wrong.err().map(|e| e.to_string()))
            });
            let outcomes: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
            // Rank 0 keeps its first value and gets rank 1's first; rank 1 gets two of each.
            assert_eq!(outcomes[0].0, vec![1.0, 1.0], "padded default {padded_default}");
            assert_eq!(outcomes[1].0, vec![2.0, 3.0, 2.0, 3.0], "padded default {padded_default}");
            let message = outcomes[1].1.clone().expect("rank 1 expected more than rank 0 sent");
            assert!(message.contains("rank 1 expects 3 elements from rank 0, which sends it 2"), "{message}");
        }
    }

    #[test]
    fn all_to_all_transposes_rank_and_slice_for_1_to_8_ranks() {
        for size in 1..=8 {
            let results = ThreadGroup::new(size).run(|rank| {
                let comm = rank.communicator();
                let r = rank.rank() as f32;
                // Slice j of rank r holds [100 r + 10 j, 100 r + 10 j + 1].
                let send = (0..size).flat_map(|j| [100.0 * r + 10.0 * j as f32, 100.0 * r + 10.0 * j as f32 + 1.0]);
                values(Communicator::<B>::all_to_all(&*comm, tensor(send.collect(), [size, 2])).unwrap())
            });
            for (r, got) in results.into_iter().enumerate() {
                let want: Vec<f32> = (0..size)
                    .flat_map(|i| [100.0 * i as f32 + 10.0 * r as f32, 100.0 * i as f32 + 10.0 * r as f32 + 1.0])
                    .collect();
                assert_eq!(got.unwrap(), want, "group of {size}, rank {r}");
            }
        }
    }

    #[test]
    fn all_reduce_gather_broadcast_and_split() {
        let results = ThreadGroup::new(4).run(|rank| {
            let comm = rank.communicator();
            let r = rank.rank() as f32;
            let t = || tensor(vec![r, 1.0], [1, 2]);
            let sum = values(Communicator::<B>::all_reduce(&*comm, t(), ReduceOp::Sum).unwrap());
            let mean = values(Communicator::<B>::all_reduce(&*comm, t(), ReduceOp::Mean).unwrap());
            let max = values(Communicator::<B>::all_reduce(&*comm, t(), ReduceOp::Max).unwrap());
            let gathered = values(Communicator::<B>::all_gather(&*comm, t()).unwrap());
            let bcast = values(Communicator::<B>::broadcast(&*comm, t(), 2).unwrap());
            // Even and odd ranks form two groups; key reverses the order.
            let sub = Communicator::<B>::split(&*comm, rank.rank() as u32 % 2, 10 - rank.rank() as u32)
                .unwrap();
            let sub_sum = values(sub.all_reduce(t(), ReduceOp::Sum).unwrap());
            (sum, mean, max, gathered, bcast, sub.rank(), sub_sum)
        });
        for (r, result) in results.into_iter().enumerate() {
            let (sum, mean, max, gathered, bcast, sub_rank, sub_sum) = result.unwrap();
            assert_eq!(sum, vec![6.0, 4.0]);
            assert_eq!(mean, vec![1.5, 1.0]);
            assert_eq!(max, vec![3.0, 1.0]);
            assert_eq!(gathered, vec![0.0, 1.0, 1.0, 1.0, 2.0, 1.0, 3.0, 1.0]);
            assert_eq!(bcast, vec![2.0, 1.0]);
            assert_eq!(sub_rank, if r < 2 { 1 } else { 0 });
            let want = if r % 2 == 0 { 2.0 } else { 4.0 };
            assert_eq!(sub_sum, vec![want, 2.0]);
        }
    }

    #[test]
    fn every_collective_passes_the_self_check_for_1_to_4_ranks() {
        use crate::comm::check::{CheckSizes, check_collectives};
        for size in 1..=4 {
            let results = ThreadGroup::new(size).run(|rank| {
                check_collectives::<B>(&*rank.communicator(), &Default::default(), CheckSizes { large_elements: 1 << 16 })
            });
            for (rank, result) in results.into_iter().enumerate() {
                result.unwrap().unwrap_or_else(|e| panic!("{size} ranks, rank {rank}: {e}"));
            }
        }
    }

    #[test]
    fn a_rank_that_panics_fails_its_peers_instead_of_hanging() {
        let started = Instant::now();
        let results = ThreadGroup::new(3).run(|rank| {
            if rank.rank() == 1 {
                panic!("rank 1 exploded");
            }
            Communicator::<B>::barrier(&*rank.communicator())
        });
        assert!(started.elapsed() < Duration::from_secs(30));
        assert!(results[1].as_ref().unwrap_err().message.contains("rank 1 exploded"));
        for r in [0, 2] {
            let err = results[r].as_ref().unwrap().as_ref().unwrap_err();
            assert!(matches!(err, CommError::PeerLeft { peer: 1, world_peer: 1, .. }), "{err}");
        }
    }

    #[test]
    fn mismatched_collectives_are_reported() {
        let results = ThreadGroup::new(2).run(|rank| {
            let comm = rank.communicator();
            if rank.rank() == 0 {
                Communicator::<B>::barrier(&*comm).map(|_| ())
            } else {
                Communicator::<B>::all_gather_host(&*comm, &[1]).map(|_| ())
            }
        });
        let errors: Vec<String> =
            results.into_iter().map(|r| r.unwrap().unwrap_err().to_string()).collect();
        assert!(errors.iter().all(|e| e.contains("barrier") && e.contains("all_gather_host")), "{errors:?}");
    }

    #[test]
    fn a_silent_peer_times_out() {
        let group = ThreadGroup::from_config(&ThreadGroupConfig::new(2).with_timeout_secs(0.2));
        let _silent = group.join(1);
        let active = group.join(0);
        let err = Communicator::<B>::barrier(&*active.communicator()).unwrap_err();
        assert!(matches!(err, CommError::Timeout { ref waiting_for, .. } if waiting_for == &[1]), "{err}");
    }
}
