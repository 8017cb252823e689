//! Collectives between processes over TCP: multi-process training without GPUs, the way
//! PyTorch keeps gloo beside NCCL.
//!
//! Why TCP of our own rather than MPI: the job already has a token-checked rendezvous
//! (torchrun's variables, `ulysses-launch`, srun), and MPI would add a system library, its own
//! launcher (`mpirun`) and its own failure model (a dead rank usually aborts the whole job
//! without saying which). Over a plain TCP mesh we control what matters here: every message
//! bounded, a dead peer named within milliseconds (its kernel closes the socket), and
//! timeouts that name the collective and the ranks that did not arrive.
//!
//! It moves host tensors (`ulysses_core::comm::HostCommunicator`), so every Burn version uses
//! it: burn 0.21 through `burn_ulysses::comm::HostStaged`, burn 0.22 directly. It suits CPU
//! backends and tests; GPUs use NCCL (`ulysses-nccl`).
//!
//! How each collective moves data (`P` ranks, `n` bytes per rank):
//! - all-to-all: slice `j` straight to rank `j`;
//! - all-reduce: reduce-scatter then all-gather: rank `c` receives every rank's chunk `c`,
//!   reduces it in rank order (so every rank gets the same bits), and sends the result back
//!   to all; `2n(P-1)/P` bytes out per rank, like a ring;
//! - all-gather, host all-gather: every rank's part to every rank;
//! - broadcast: the ranks' roots compared (a host all-gather), then the root's tensor to every rank;
//! - split: a host all-gather of `(color, key)`; a sub-group shares the mesh, its messages
//!   tagged with the sub-group's id.

mod frame;
mod mesh;

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use ulysses_core::comm::{Agreed, Collective, CommError, HostCommunicator, HostTensor, ReduceOp, Traffic, TrafficCounter, check_agreed, check_parts, check_reduce_scatter, check_send_recv, disagreement, mismatched, reduce};

pub use frame::MAX_FRAME_BYTES;
pub use mesh::MeshSettings;
use mesh::Mesh;

use crate::{DistError, DistributedConfig, LaunchEnv, Rendezvous};

/// One rank's communicator over a group of processes (the world, or a split of it), on host
/// tensors.
pub struct TcpCommunicator {
    mesh: Arc<Mesh>,
    /// The group's id: 0 for the world, derived from the split otherwise (the same on every
    /// member without asking anyone).
    group: u64,
    /// World ranks of the members, in group-rank order.
    members: Arc<[usize]>,
    rank: usize,
    next_seq: AtomicU64,
    traffic: TrafficCounter,
}

impl TcpCommunicator {
    /// The bytes of part `c` of `host` (elements `c·n/P..(c+1)·n/P`), the part member `c`
    /// reduces.
    fn part_bytes(&self, host: &HostTensor, c: usize) -> std::ops::Range<usize> {
        let (size, element, elements) = (self.size_(), host.dtype.size(), host.elements());
        (c * elements / size * element)..((c + 1) * elements / size * element)
    }

    /// The first half of an all-reduce, a reduce-scatter: every member sends each other its
    /// part of `host` and reduces its own part over the members in rank order (every rank of
    /// an all-reduce then receives the same bits). Each part says its dtype, reduction and
    /// element count, which must be this rank's.
    fn reduce_part(&self, collective: Collective, seq: u64, host: &HostTensor, op: ReduceOp) -> Result<Vec<u8>, CommError> {
        const HEADER: usize = 10;
        let elements = host.elements();
        let header = |len: usize| {
            let mut message = vec![host.dtype.code(), op.code()];
            message.extend((elements as u64).to_le_bytes());
            message.reserve(len);
            message
        };
        let scatter = self.exchange(collective, seq, |j| {
            let mut message = header(self.part_bytes(host, j).len());
            message.extend_from_slice(&host.bytes[self.part_bytes(host, j)]);
            message
        })?;
        let mine = self.part_bytes(host, self.rank);
        let mut parts: Vec<&[u8]> = Vec::with_capacity(self.size_());
        for (j, message) in scatter.iter().enumerate() {
            match message {
                None => parts.push(&host.bytes[mine.clone()]),
                Some(message) if message.len() == HEADER + mine.len() && message[..HEADER] == header(0)[..] => parts.push(&message[HEADER..]),
                Some(message) => {
                    if let Some(&theirs) = message.get(1).and_then(|&code| ReduceOp::ALL.get(usize::from(code))).filter(|&&theirs| theirs != op) {
                        return Err(self.mesh.fail(disagreement(collective, j, Agreed::Reduction(theirs), Agreed::Reduction(op))));
                    }
                    return Err(self.mismatch(collective, j, format!("a tensor that is not {elements} elements of {:?}", host.dtype)));
                }
            }
        }
        Ok(reduce(&parts, host.dtype, op))
    }

    /// Joins the job described by `env`: the rendezvous, then a connection to every rank.
    pub fn connect(env: &LaunchEnv, config: &DistributedConfig) -> Result<Arc<Self>, DistError> {
        let token = config.require_token()?.to_string();
        let rendezvous = Rendezvous::join(env, config)?;
        let settings = MeshSettings {
            collective_timeout: config.collective_timeout(),
            connect_timeout: config.rendezvous_timeout(),
            max_message_bytes: config.tcp_max_message_bytes,
            address: config.tcp_address.clone(),
        };
        let mesh = Mesh::connect(env, rendezvous, &token, settings)?;
        let members: Arc<[usize]> = (0..env.world_size).collect::<Vec<_>>().into();
        Ok(Arc::new(Self::member(Arc::new(mesh), 0, members, env.rank)))
    }

    fn member(mesh: Arc<Mesh>, group: u64, members: Arc<[usize]>, rank: usize) -> Self {
        Self { mesh, group, members, rank, next_seq: AtomicU64::new(0), traffic: TrafficCounter::default() }
    }

    /// [`HostCommunicator::split`], returning the concrete type.
    pub fn split_group(&self, color: u32, key: u32) -> Result<Arc<Self>, CommError> {
        let seq = self.next_seq.load(Ordering::Relaxed);
        let gathered = self.host_gather(Collective::Split, &[u64::from(color), u64::from(key)])?;
        let mut same_color: Vec<(u64, usize)> = (0..gathered.len())
            .filter(|&r| gathered[r].first() == Some(&u64::from(color)))
            .map(|r| (gathered[r].get(1).copied().unwrap_or(0), r))
            .collect();
        same_color.sort();
        let rank = same_color.iter().position(|&(_, r)| r == self.rank).expect("this rank passed its own color");
        let members: Arc<[usize]> = same_color.iter().map(|&(_, r)| self.members[r]).collect::<Vec<_>>().into();
        let group = sub_group_id(self.group, seq, color);
        Ok(Arc::new(Self::member(self.mesh.clone(), group, members, rank)))
    }

    fn size_(&self) -> usize {
        self.members.len()
    }

    /// The world ranks of every member but this one.
    fn peers(&self) -> Vec<usize> {
        self.members.iter().enumerate().filter(|&(r, _)| r != self.rank).map(|(_, &w)| w).collect()
    }

    /// The next collective's sequence number in this group.
    fn begin(&self) -> u64 {
        self.next_seq.fetch_add(1, Ordering::Relaxed)
    }

    /// Sends `payload(j)` to every member `j` but this one, then receives one message from
    /// each: the result holds, in group-rank order, what every member sent this rank, and
    /// `None` at this rank's own place.
    fn exchange(&self, op: Collective, seq: u64, payload: impl Fn(usize) -> Vec<u8>) -> Result<Vec<Option<Vec<u8>>>, CommError> {
        for (j, &world) in self.members.iter().enumerate() {
            if j != self.rank {
                self.mesh.send(world, self.group, seq, op, &payload(j))?;
            }
        }
        let mut received = self.mesh.receive(&self.peers(), self.group, seq, op)?.into_iter();
        Ok((0..self.size_()).map(|j| if j == self.rank { None } else { received.next() }).collect())
    }

    /// A host all-gather of `values`, in group-rank order.
    fn host_gather(&self, op: Collective, values: &[u64]) -> Result<Vec<Vec<u64>>, CommError> {
        let seq = self.begin();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let received = self.exchange(op, seq, |_| bytes.clone())?;
        Ok(received
            .into_iter()
            .map(|message| match message {
                None => values.to_vec(),
                Some(bytes) => bytes.chunks_exact(8).map(|b| u64::from_le_bytes(b.try_into().unwrap())).collect(),
            })
            .collect())
    }

    /// Fails every member the same way when ranks passed tensors of different shapes or
    /// dtypes (a message that does not fit what this rank expects).
    fn mismatch(&self, op: Collective, peer: usize, what: String) -> CommError {
        self.mesh.fail(mismatched(op, peer, what))
    }
}

/// The id of the sub-group of `parent` with `color`, made by the split that was the parent's
/// collective `seq`: the same on every member.
fn sub_group_id(parent: u64, seq: u64, color: u32) -> u64 {
    [parent, seq, u64::from(color)]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325u64, |hash, b| (hash ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
        | 1 // never 0, the world's id
}

impl HostCommunicator for TcpCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size_()
    }

    fn all_to_all(&self, mut parts: Vec<HostTensor>) -> Result<Vec<HostTensor>, CommError> {
        let op = Collective::AllToAll;
        check_parts(&parts, self.size_())?;
        let total: u64 = parts.iter().map(|part| part.bytes.len() as u64).sum();
        self.traffic.record_all_to_all_parts(total, total - parts[self.rank].bytes.len() as u64);
        let dtype = parts[self.rank].dtype;
        let seq = self.begin();
        let received = self.exchange(op, seq, |j| parts[j].encode())?;
        let mut mine = Some(std::mem::replace(&mut parts[self.rank], HostTensor { dtype, shape: vec![0], bytes: Vec::new() }));
        received
            .into_iter()
            .enumerate()
            .map(|(j, message)| match message {
                None => Ok(mine.take().expect("this rank's own part, once")),
                Some(message) => {
                    let part = HostTensor::decode(&message, op)?;
                    if part.dtype != dtype {
                        return Err(self.mismatch(op, j, format!("a part of {:?} (this rank's: {dtype:?})", part.dtype)));
                    }
                    Ok(part)
                }
            })
            .collect()
    }

    fn all_reduce(&self, host: HostTensor, op: ReduceOp) -> Result<HostTensor, CommError> {
        let collective = Collective::AllReduce;
        self.traffic.record_all_reduce(host.bytes.len() as u64);
        let seq = self.begin();
        let reduced = self.reduce_part(collective, seq, &host, op)?;
        let gathered = self.exchange(collective, seq, |_| reduced.clone())?;
        let mut bytes = Vec::with_capacity(host.bytes.len());
        for (j, message) in gathered.into_iter().enumerate() {
            let part = message.unwrap_or_else(|| reduced.clone());
            let expected = self.part_bytes(&host, j);
            if part.len() != expected.len() {
                return Err(self.mismatch(collective, j, format!("a reduced chunk of {} bytes, not {}", part.len(), expected.len())));
            }
            bytes.extend(part);
        }
        Ok(HostTensor { bytes, ..host })
    }

    fn reduce_scatter(&self, host: HostTensor, op: ReduceOp) -> Result<HostTensor, CommError> {
        let collective = Collective::ReduceScatter;
        check_reduce_scatter(&host.shape, self.size_())?;
        self.traffic.record_reduce_scatter(host.bytes.len() as u64);
        let seq = self.begin();
        let bytes = self.reduce_part(collective, seq, &host, op)?;
        Ok(HostTensor { dtype: host.dtype, shape: vec![host.elements() / self.size_()], bytes })
    }

    fn all_gather(&self, host: HostTensor) -> Result<Vec<HostTensor>, CommError> {
        let op = Collective::AllGather;
        self.traffic.record_all_gather(host.bytes.len() as u64);
        let message = host.encode();
        let seq = self.begin();
        let received = self.exchange(op, seq, |_| message.clone())?;
        let mut gathered = Vec::with_capacity(self.size_());
        for (j, message) in received.into_iter().enumerate() {
            match message {
                None => gathered.push(host.clone()),
                Some(message) => {
                    let theirs = HostTensor::decode(&message, op)?;
                    if theirs.shape != host.shape || theirs.dtype != host.dtype {
                        return Err(self.mismatch(op, j, format!("{:?} of shape {:?} (this rank: {:?} of {:?})", theirs.dtype, theirs.shape, host.dtype, host.shape)));
                    }
                    gathered.push(theirs);
                }
            }
        }
        Ok(gathered)
    }

    fn broadcast(&self, tensor: HostTensor, root: usize) -> Result<HostTensor, CommError> {
        let op = Collective::Broadcast;
        ulysses_core::comm::check_broadcast_root(root, self.size_())?;
        // Ranks that name different roots would each keep their own tensor, or wait for each
        // other: the roots are compared first (one small round; broadcasts are rare).
        let roots: Vec<Agreed> = self.host_gather(op, &[root as u64])?.iter().map(|r| Agreed::Root(r.first().map_or(usize::MAX, |&r| r as usize))).collect();
        check_agreed(op, self.rank, &roots)?;
        let seq = self.begin();
        if self.rank == root {
            self.traffic.record_broadcast(tensor.bytes.len() as u64);
            let message = tensor.encode();
            for (j, &world) in self.members.iter().enumerate() {
                if j != root {
                    self.mesh.send(world, self.group, seq, op, &message)?;
                }
            }
            return Ok(tensor);
        }
        let message = self.mesh.receive(&[self.members[root]], self.group, seq, op)?.remove(0);
        let theirs = HostTensor::decode(&message, op)?;
        if theirs.shape != tensor.shape || theirs.dtype != tensor.dtype {
            return Err(self.mismatch(op, root, format!("{:?} of shape {:?} (this rank: {:?} of {:?})", theirs.dtype, theirs.shape, tensor.dtype, tensor.shape)));
        }
        Ok(theirs)
    }

    fn send_recv(&self, tensor: HostTensor, to: usize, from: usize) -> Result<HostTensor, CommError> {
        let op = Collective::SendRecv;
        check_send_recv(self.rank, self.size_(), to, from)?;
        let seq = self.begin();
        if to == self.rank {
            self.traffic.record_send_recv(0, false);
            return Ok(tensor);
        }
        self.traffic.record_send_recv(tensor.bytes.len() as u64, true);
        self.mesh.send(self.members[to], self.group, seq, op, &tensor.encode())?;
        let message = self.mesh.receive(&[self.members[from]], self.group, seq, op)?.remove(0);
        let theirs = HostTensor::decode(&message, op)?;
        if theirs.shape != tensor.shape || theirs.dtype != tensor.dtype {
            return Err(self.mismatch(op, from, format!("{:?} of shape {:?} (this rank: {:?} of {:?})", theirs.dtype, theirs.shape, tensor.dtype, tensor.shape)));
        }
        Ok(theirs)
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.host_gather(Collective::Barrier, &[]).map(|_| ())
    }

    fn all_gather_host(&self, values: &[u64]) -> Result<Vec<Vec<u64>>, CommError> {
        self.host_gather(Collective::AllGatherHost, values)
    }

    fn split(&self, color: u32, key: u32) -> Result<Arc<dyn HostCommunicator>, CommError> {
        Ok(self.split_group(color, key)?)
    }

    fn traffic(&self) -> Traffic {
        self.traffic.snapshot()
    }
}
