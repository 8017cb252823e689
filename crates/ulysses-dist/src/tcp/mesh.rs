//! A full mesh of TCP connections between the ranks of a job, and what each rank knows of
//! its peers.
//!
//! Every pair of ranks shares one connection (the higher rank connects, the lower accepts,
//! after a hello that carries the job's token). One reader thread per peer drains its
//! connection into an inbox, so a sender never blocks on a busy receiver, and notices at once
//! when the peer's process ends: its kernel closes the socket, the read returns, and every
//! rank waiting in a collective wakes up with the dead rank's name.
//!
//! A rank that fails tells its peers why (an abort notice naming whom it blames) before it
//! leaves, so a cascade of failures still names the rank that died first. A rank that
//! finishes says goodbye, so its closing connection is not mistaken for a death.

use std::{
    collections::{BTreeSet, HashMap, VecDeque},
    io::{BufReader, BufWriter, Read, Write},
    net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs},
    sync::{Arc, Condvar, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use ulysses_core::comm::{Collective, CommError};

use super::frame::{AbortNotice, FrameError, Hello, Kind, read_message, write_message};
use crate::{DistError, LaunchEnv, Rendezvous};

/// One received message of a collective.
struct Message {
    seq: u64,
    op: u8,
    payload: Vec<u8>,
}

/// What this rank knows of a peer.
#[derive(Debug, Clone, PartialEq)]
enum PeerState {
    Alive,
    /// Said goodbye: it finished and left cleanly.
    Finished,
    /// Its connection broke without a goodbye.
    Died { detail: String },
    /// It stopped after a failure and said why.
    Aborted(AbortNotice),
}

struct State {
    /// Messages by (peer world rank, group), in arrival order.
    inbox: HashMap<(usize, u64), VecDeque<Message>>,
    peers: Vec<PeerState>,
    /// Set once this rank has failed: every later collective fails the same way.
    failed: Option<CommError>,
}

/// Settings of the mesh.
#[derive(Debug, Clone)]
pub struct MeshSettings {
    /// How long one collective may wait for its peers.
    pub collective_timeout: Duration,
    /// How long setting up the connections may take.
    pub connect_timeout: Duration,
    /// Largest message a peer may send.
    pub max_message_bytes: u64,
    /// Address this rank listens on and advertises; `None` picks the address the rendezvous
    /// connection uses (the interface that reaches rank 0).
    pub address: Option<String>,
}

pub struct Mesh {
    settings: MeshSettings,
    /// Write halves, by world rank (`None` for this rank).
    writers: Vec<Option<Mutex<BufWriter<TcpStream>>>>,
    shared: Arc<Shared>,
    /// Kept so rank 0's rendezvous outlives every rank's use of the job.
    _rendezvous: Rendezvous,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The address a rank offers the others for the listener `bound`: itself, or where it is every
/// interface (`ULYSSES_TCP_ADDR=0.0.0.0`, which no rank can dial), the port at the address
/// `reaching_rank_0` gives.
fn offered_address(bound: SocketAddr, reaching_rank_0: impl FnOnce() -> Result<String, DistError>) -> Result<SocketAddr, DistError> {
    if !bound.ip().is_unspecified() {
        return Ok(bound);
    }
    let ip = reaching_rank_0()?;
    let ip = ip.parse::<IpAddr>().map_err(|e| DistError::Transport(format!("this rank's address {ip:?}: {e}")))?;
    Ok(SocketAddr::new(ip, bound.port()))
}

impl Mesh {
    /// Joins the job's rendezvous and connects to every other rank.
    pub fn connect(env: &LaunchEnv, rendezvous: Rendezvous, token: &str, settings: MeshSettings) -> Result<Self, DistError> {
        let (rank, world_size) = (env.rank, env.world_size);
        // The address this rank reached rank 0 from, unless ULYSSES_TCP_ADDR says otherwise.
        let reaching_rank_0 = || rendezvous.local_ip().map_err(|e| DistError::Transport(format!("cannot tell this rank's address: {e}")));
        let host = match &settings.address {
            Some(address) => crate::env::bare_host(address).to_string(),
            None => reaching_rank_0()?,
        };
        let listener = TcpListener::bind((host.as_str(), 0))
            .map_err(|e| DistError::Transport(format!("cannot listen on {host}: {e}; set ULYSSES_TCP_ADDR to an address of this machine")))?;
        let bound = listener.local_addr().map_err(|e| DistError::Transport(e.to_string()))?;
        let advertised = offered_address(bound, reaching_rank_0)?;
        // Over loopback (MASTER_ADDR a name this node maps to 127.0.1.1, or ULYSSES_TCP_ADDR
        // 127.0.0.1) no other node could dial it.
        if env.spans_nodes() && advertised.ip().is_loopback() {
            let why = match &settings.address {
                Some(address) => format!("ULYSSES_TCP_ADDR {address} is this machine's loopback"),
                None => format!("it reaches rank 0 over loopback: MASTER_ADDR {} is this machine's own name here", env.master_addr),
            };
            return Err(DistError::Transport(format!(
                "rank {rank} would offer the other ranks {advertised} ({why}), which the ranks of other nodes could not dial: set \
                 ULYSSES_TCP_ADDR to this machine's network address, or MASTER_ADDR to rank 0's"
            )));
        }
        rendezvous.set(&format!("tcp/address/{rank}"), advertised.to_string().as_bytes())?;

        let deadline = Instant::now() + settings.connect_timeout;
        let mut streams: Vec<Option<TcpStream>> = (0..world_size).map(|_| None).collect();
        // Lower ranks accept, higher ranks connect: every rank finishes its connections to
        // lower ranks first, and rank 0 only accepts, so this never waits in a circle.
        for peer in 0..rank {
            let address = String::from_utf8_lossy(&rendezvous.get_set_by(&format!("tcp/address/{peer}"), peer)?).into_owned();
            streams[peer] = Some(dial(&address, peer, env, token, deadline).map_err(|error| loopback_hint(error, &address, peer, reaching_rank_0))?);
        }
        listener.set_nonblocking(true).map_err(|e| DistError::Transport(e.to_string()))?;
        // A higher rank that fails before it connects (its own setup, an address no one can
        // dial) leaves the job: asked of the rendezvous now and then, so this rank stops then,
        // not at the timeout.
        let mut next_look = Instant::now();
        while (rank + 1..world_size).any(|peer| streams[peer].is_none()) {
            match listener.accept() {
                Ok((stream, from)) => match admit(stream, env, token, &streams) {
                    Ok((peer, stream)) => streams[peer] = Some(stream),
                    Err(reason) => tracing::warn!(%from, %reason, "refused a connection"),
                },
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= next_look {
                        next_look = Instant::now() + Duration::from_millis(500);
                        // Bounded by this rank's own deadline, as the wait it interrupts.
                        let left = rendezvous.left_within(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(100)))?;
                        let mut gone: Vec<usize> = left.died.iter().chain(&left.finished).copied().filter(|&peer| peer > rank && streams[peer].is_none()).collect();
                        gone.sort_unstable();
                        gone.dedup();
                        if !gone.is_empty() {
                            return Err(DistError::Transport(format!(
                                "ranks {gone:?} left the job before connecting to rank {rank}: their own errors say why"
                            )));
                        }
                    }
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> = (rank + 1..world_size).filter(|&p| streams[p].is_none()).collect();
                        return Err(DistError::Transport(format!(
                            "ranks {missing:?} did not connect to rank {rank} within {:?} (ULYSSES_RENDEZVOUS_TIMEOUT)",
                            settings.connect_timeout
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(DistError::Transport(format!("accept failed: {e}"))),
            }
        }

        let shared = Arc::new(Shared {
            state: Mutex::new(State { inbox: HashMap::new(), peers: vec![PeerState::Alive; world_size], failed: None }),
            changed: Condvar::new(),
        });
        let mut writers = Vec::with_capacity(world_size);
        for (peer, stream) in streams.into_iter().enumerate() {
            let Some(stream) = stream else {
                writers.push(None);
                continue;
            };
            let transport = |e: std::io::Error| DistError::Transport(format!("connection to rank {peer}: {e}"));
            stream.set_nodelay(true).map_err(transport)?;
            stream.set_write_timeout(Some(settings.collective_timeout)).map_err(transport)?;
            let reader = stream.try_clone().map_err(transport)?;
            let (shared, limit) = (shared.clone(), settings.max_message_bytes);
            std::thread::Builder::new()
                .name(format!("ulysses-tcp-{peer}"))
                .spawn(move || receive_from(peer, reader, limit, &shared))
                .map_err(|e| DistError::Transport(format!("cannot start a reader thread: {e}")))?;
            writers.push(Some(Mutex::new(BufWriter::with_capacity(1 << 20, stream))));
        }
        tracing::debug!(rank, world_size, %advertised, "TCP mesh connected");
        Ok(Self { settings, writers, shared, _rendezvous: rendezvous })
    }

    /// Sends one message to `peer` (a world rank other than this one).
    pub fn send(&self, peer: usize, group: u64, seq: u64, op: Collective, payload: &[u8]) -> Result<(), CommError> {
        self.check_failed()?;
        let writer = self.writers[peer].as_ref().expect("a rank sends to itself without the network");
        let mut writer = writer.lock().unwrap_or_else(|p| p.into_inner());
        let sent = write_message(&mut *writer, Kind::Data, op.code(), group, seq, payload).and_then(|()| writer.flush());
        drop(writer);
        if let Err(error) = sent {
            let detail = format!("sending to it failed: {error}");
            self.mark(peer, PeerState::Died { detail });
            // The peer named: one that said goodbye first (its process gone) left; the
            // sender's notice then blames it, not the sender.
            let failure = failure_of(&self.shared.lock().peers, &[peer], op, seq);
            return Err(self.fail(failure.unwrap_or_else(|| CommError::Backend(format!("{op}: sending to world rank {peer} failed: {error}")))));
        }
        Ok(())
    }

    /// Waits for the message of collective `seq` from each of `peers` (world ranks) in
    /// `group`, and returns their payloads in the order of `peers`. Fails at once when any
    /// rank of the job has died or stopped, and after the collective timeout otherwise.
    pub fn receive(&self, peers: &[usize], group: u64, seq: u64, op: Collective) -> Result<Vec<Vec<u8>>, CommError> {
        let deadline = Instant::now() + self.settings.collective_timeout;
        let mut received: Vec<Option<Vec<u8>>> = vec![None; peers.len()];
        let mut state = self.shared.lock();
        loop {
            if let Some(failure) = &state.failed {
                return Err(failure.clone());
            }
            for (slot, &peer) in received.iter_mut().zip(peers).filter(|(slot, _)| slot.is_none()) {
                let Some(message) = state.inbox.get_mut(&(peer, group)).and_then(VecDeque::pop_front) else {
                    continue;
                };
                if message.seq != seq || message.op != op.code() {
                    drop(state);
                    let error = match Collective::from_code(message.op) {
                        Some(peer_op) if message.seq == seq => CommError::Mismatch { seq, op, peer, peer_op },
                        _ => CommError::InvalidArgument {
                            op,
                            reason: format!(
                                "world rank {peer} sent its collective #{} while this rank is at #{seq}: the ranks \
                                 issued different collectives in this group (different model code or layer counts)",
                                message.seq
                            ),
                        },
                    };
                    return Err(self.fail(error));
                }
                *slot = Some(message.payload);
            }
            if received.iter().all(Option::is_some) {
                return Ok(received.into_iter().map(Option::unwrap).collect());
            }
            let waiting: Vec<usize> = peers.iter().zip(&received).filter(|(_, r)| r.is_none()).map(|(&p, _)| p).collect();
            if let Some(failure) = failure_of(&state.peers, &waiting, op, seq) {
                drop(state);
                return Err(self.fail(failure));
            }
            let now = Instant::now();
            if now >= deadline {
                drop(state);
                let after = self.settings.collective_timeout;
                return Err(self.fail(CommError::Timeout { op, seq, waiting_for: waiting, after }));
            }
            state = self.shared.changed.wait_timeout(state, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Records that this rank failed with `error`, tells every peer still connected, and
    /// returns the error. Later collectives fail with it at once.
    pub fn fail(&self, error: CommError) -> CommError {
        {
            let mut state = self.shared.lock();
            if let Some(earlier) = &state.failed {
                return earlier.clone();
            }
            state.failed = Some(error.clone());
        }
        let (blamed, reason) = match &error {
            CommError::PeersDied { ranks, .. } => (ranks.clone(), format!("it lost rank(s) {ranks:?}")),
            CommError::Timeout { waiting_for, op, seq, after } => (
                waiting_for.clone(),
                format!("it timed out after {after:?} waiting for rank(s) {waiting_for:?} in collective #{seq} ({op})"),
            ),
            CommError::PeerLeft { world_peer, op, seq, .. } => {
                (vec![*world_peer], format!("rank {world_peer} left before collective #{seq} ({op})"))
            }
            other => (Vec::new(), other.to_string()),
        };
        let notice = serde_json::to_vec(&AbortNotice { reason, blamed }).unwrap_or_default();
        self.tell_everyone(Kind::Abort, &notice);
        error
    }

    fn check_failed(&self) -> Result<(), CommError> {
        match &self.shared.lock().failed {
            Some(failure) => Err(failure.clone()),
            None => Ok(()),
        }
    }

    fn mark(&self, peer: usize, new: PeerState) {
        let mut state = self.shared.lock();
        if state.peers[peer] == PeerState::Alive {
            state.peers[peer] = new;
        }
        self.shared.changed.notify_all();
    }

    /// Best effort: a peer that cannot be reached is not waiting for us anyway.
    fn tell_everyone(&self, kind: Kind, payload: &[u8]) {
        let alive: Vec<bool> = self.shared.lock().peers.iter().map(|p| *p == PeerState::Alive).collect();
        for (peer, writer) in self.writers.iter().enumerate() {
            let Some(writer) = writer.as_ref().filter(|_| alive[peer]) else { continue };
            // A writer held by a send in progress is skipped rather than waited for, and a
            // peer that stopped reading gets a second, not the collective timeout.
            if let Ok(mut writer) = writer.try_lock() {
                let _ = writer.get_ref().set_write_timeout(Some(Duration::from_secs(1)));
                let _ = write_message(&mut *writer, kind, 0, 0, 0, payload).and_then(|()| writer.flush());
            }
        }
    }
}

impl Drop for Mesh {
    /// Says goodbye (or nothing more, after a failure: the abort notice was the goodbye) and
    /// closes the write halves; the reader threads end when the peers close theirs.
    fn drop(&mut self) {
        if self.shared.lock().failed.is_none() {
            self.tell_everyone(Kind::Goodbye, &[]);
        }
        for writer in self.writers.iter().flatten() {
            let writer = writer.lock().unwrap_or_else(|p| p.into_inner());
            let _ = writer.get_ref().shutdown(Shutdown::Write);
        }
    }
}

/// The failure to report when peers died or stopped, naming the ranks at the root of it:
/// those whose connection broke, and those that ranks which stopped hold responsible. A
/// peer that finished cleanly is a failure only when this rank still waits for it.
fn failure_of(peers: &[PeerState], waiting: &[usize], op: Collective, seq: u64) -> Option<CommError> {
    let mut culprits = BTreeSet::new();
    let mut details = Vec::new();
    for (rank, peer) in peers.iter().enumerate() {
        match peer {
            PeerState::Died { detail } => {
                culprits.insert(rank);
                details.push(format!("rank {rank}: {detail}"));
            }
            // A rank that stopped because of others names them; one that stopped on its
            // own is a culprit itself.
            PeerState::Aborted(notice) => {
                culprits.extend(notice.blamed.iter().copied());
                if notice.blamed.is_empty() {
                    culprits.insert(rank);
                }
                details.push(format!("rank {rank} stopped: {}", notice.reason));
            }
            PeerState::Alive | PeerState::Finished => {}
        }
    }
    if !culprits.is_empty() {
        return Some(CommError::PeersDied { op, seq, ranks: culprits.into_iter().collect(), detail: details.join("; ") });
    }
    let finished = waiting.iter().find(|&&p| peers[p] == PeerState::Finished)?;
    Some(CommError::PeerLeft { peer: *finished, world_peer: *finished, op, seq })
}

/// The reader thread of one peer: messages into the inbox until the connection ends.
fn receive_from(peer: usize, stream: TcpStream, max_message_bytes: u64, shared: &Shared) {
    let mut reader = BufReader::with_capacity(1 << 20, stream);
    let ended = loop {
        match read_message(&mut reader, max_message_bytes) {
            Ok((header, payload)) => match header.kind {
                Kind::Data => {
                    let message = Message { seq: header.seq, op: header.op, payload };
                    shared.lock().inbox.entry((peer, header.group)).or_default().push_back(message);
                    shared.changed.notify_all();
                }
                Kind::Abort => {
                    let notice = serde_json::from_slice(&payload)
                        .unwrap_or_else(|_| AbortNotice { reason: "it stopped (unreadable notice)".into(), blamed: Vec::new() });
                    break PeerState::Aborted(notice);
                }
                Kind::Goodbye => break PeerState::Finished,
                other => break PeerState::Died { detail: format!("it sent an unexpected {other:?} frame") },
            },
            Err(FrameError::Closed) => {
                break PeerState::Died { detail: "its connection closed without a goodbye: the process exited or was killed".into() };
            }
            Err(FrameError::Io(error)) => break PeerState::Died { detail: format!("its connection broke: {error}") },
            Err(FrameError::Invalid(reason)) => break PeerState::Died { detail: format!("it sent {reason}") },
        }
    };
    let mut state = shared.lock();
    if state.peers[peer] == PeerState::Alive {
        state.peers[peer] = ended;
    }
    shared.changed.notify_all();
}

/// Connects to a lower rank and says hello; returns once it welcomes us.
fn dial(address: &str, peer: usize, env: &LaunchEnv, token: &str, deadline: Instant) -> Result<TcpStream, DistError> {
    let failed = |reason: String| DistError::Transport(format!("rank {} cannot connect to rank {peer} at {address}: {reason}", env.rank));
    let socket = address
        .to_socket_addrs()
        .map_err(|e| failed(e.to_string()))?
        .next()
        .ok_or_else(|| failed("the address does not resolve".into()))?;
    let remaining = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(100));
    let mut stream = TcpStream::connect_timeout(&socket, remaining).map_err(|e| failed(e.to_string()))?;
    stream.set_read_timeout(Some(remaining)).map_err(|e| failed(e.to_string()))?;
    let hello = Hello { token: token.into(), rank: env.rank, world_size: env.world_size };
    write_message(&mut stream, Kind::Hello, 0, 0, 0, &serde_json::to_vec(&hello).unwrap()).map_err(|e| failed(e.to_string()))?;
    match read_message(&mut stream, 64 * 1024) {
        Ok((header, _)) if header.kind == Kind::Welcome => {}
        Ok((header, reason)) if header.kind == Kind::Rejected => return Err(failed(format!("refused: {}", String::from_utf8_lossy(&reason)))),
        Ok((header, _)) => return Err(failed(format!("unexpected {:?} frame", header.kind))),
        Err(e) => return Err(failed(e.to_string())),
    }
    stream.set_read_timeout(None).map_err(|e| failed(e.to_string()))?;
    Ok(stream)
}

/// `error` (dialing rank `peer` at `address`) with the likely cause where `address` is a loopback
/// address but this rank reaches rank 0 over the network: `peer` runs on another machine and
/// offered an address only its own can dial (Kubeflow gives the master pod
/// `MASTER_ADDR=localhost`, which it then reaches rank 0 by).
fn loopback_hint(error: DistError, address: &str, peer: usize, reaching_rank_0: impl FnOnce() -> Result<String, DistError>) -> DistError {
    let loopback = address.parse::<SocketAddr>().is_ok_and(|address| address.ip().is_loopback());
    let over_the_network = || reaching_rank_0().ok().and_then(|ip| ip.parse::<IpAddr>().ok()).is_some_and(|ip| !ip.is_loopback());
    if !(loopback && over_the_network()) {
        return error;
    }
    DistError::Transport(format!(
        "{error}. Rank {peer} offered {address}, a loopback address, while this rank reaches rank 0 over the network: if rank {peer} runs on \
         another machine (Kubeflow gives the master pod MASTER_ADDR=localhost), set ULYSSES_TCP_ADDR there to its network address"
    ))
}

/// How long a connecting rank has to send its whole hello.
const HELLO_TIME: Duration = Duration::from_secs(10);

/// A stream read until a deadline: each read waits at most the time left, and none starts past it.
struct ReadWithin<'a> {
    stream: &'a mut TcpStream,
    deadline: Instant,
}

impl Read for ReadWithin<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, format!("the hello did not arrive whole within {} s", HELLO_TIME.as_secs())));
        }
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read(buf)
    }
}

/// Checks a connecting rank's hello: the job's token, the same world size, a higher rank not
/// yet connected. Answers it either way.
fn admit(mut stream: TcpStream, env: &LaunchEnv, token: &str, connected: &[Option<TcpStream>]) -> Result<(usize, TcpStream), String> {
    stream.set_nonblocking(false).map_err(|e| e.to_string())?;
    // Ten seconds for the whole hello, not for each read: a connection that sends a byte now
    // and then (anything on the network may dial this port) would hold the accept loop forever.
    let mut within = ReadWithin { stream: &mut stream, deadline: Instant::now() + HELLO_TIME };
    let (header, payload) = read_message(&mut within, 64 * 1024).map_err(|e| e.to_string())?;
    let verdict = (|| {
        if header.kind != Kind::Hello {
            return Err("the first frame must be a hello".to_string());
        }
        let hello: Hello = serde_json::from_slice(&payload).map_err(|e| format!("unreadable hello: {e}"))?;
        if !constant_time_eq(hello.token.as_bytes(), token.as_bytes()) {
            return Err("wrong job token (ULYSSES_RENDEZVOUS_TOKEN differs)".into());
        }
        if hello.world_size != env.world_size {
            return Err(format!("WORLD_SIZE={} differs from this rank's {}", hello.world_size, env.world_size));
        }
        if hello.rank <= env.rank || hello.rank >= env.world_size || connected[hello.rank].is_some() {
            return Err(format!("rank {} may not connect to rank {} (out of range, or already connected)", hello.rank, env.rank));
        }
        Ok(hello.rank)
    })();
    let (kind, answer) = match &verdict {
        Ok(_) => (Kind::Welcome, Vec::new()),
        Err(reason) => (Kind::Rejected, reason.as_bytes().to_vec()),
    };
    write_message(&mut stream, kind, 0, 0, 0, &answer).map_err(|e| e.to_string())?;
    stream.set_read_timeout(None).map_err(|e| e.to_string())?;
    verdict.map(|peer| (peer, stream))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A read within a deadline ends at it, though bytes keep coming (one each 50 ms: each read
    /// alone is quick, as a peer dripping its hello makes them).
    #[test]
    fn a_read_within_a_deadline_ends_at_it_though_bytes_keep_coming() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let dripping = std::thread::spawn(move || {
            let mut client = TcpStream::connect(address).unwrap();
            for _ in 0..40 {
                if client.write_all(&[1]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let (mut stream, _) = listener.accept().unwrap();
        let began = Instant::now();
        let mut within = ReadWithin { stream: &mut stream, deadline: Instant::now() + Duration::from_millis(300) };
        let error = within.read_exact(&mut [0u8; 64]).unwrap_err();
        // Past the deadline as a read begins, or while one waits (the socket's timeout: EAGAIN).
        assert!(matches!(error.kind(), std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock), "{error}");
        assert!(began.elapsed() < Duration::from_secs(1), "{:?}", began.elapsed());
        drop(stream);
        dripping.join().unwrap();
    }

    /// A loopback address that fails to dial from a rank that reaches rank 0 over the network
    /// is named as such, with ULYSSES_TCP_ADDR; other failures are left as they are.
    #[test]
    fn a_loopback_peer_address_dialed_from_another_machine_names_ulysses_tcp_addr() {
        let refused = || DistError::Transport("rank 1 cannot connect to rank 0 at 127.0.0.1:4100: Connection refused".into());
        let hinted = loopback_hint(refused(), "127.0.0.1:4100", 0, || Ok("10.1.2.3".to_string())).to_string();
        assert!(hinted.contains("Connection refused") && hinted.contains("a loopback address") && hinted.contains("ULYSSES_TCP_ADDR"), "{hinted}");
        for (address, ours) in [("10.1.2.4:4100", "10.1.2.3"), ("127.0.0.1:4100", "127.0.0.1")] {
            let plain = loopback_hint(refused(), address, 0, || Ok(ours.to_string())).to_string();
            assert!(!plain.contains("ULYSSES_TCP_ADDR"), "{address} from {ours}: {plain}");
        }
    }

    /// A listener on every interface offers the address that reaches rank 0, with its port;
    /// one on an address, that address.
    #[test]
    fn every_interface_is_offered_as_the_address_that_reaches_rank_0() {
        let reaching = || Ok("10.1.2.3".to_string());
        assert_eq!(offered_address("0.0.0.0:4100".parse().unwrap(), reaching).unwrap(), "10.1.2.3:4100".parse().unwrap());
        assert_eq!(offered_address("[::]:4100".parse().unwrap(), || Ok("fd00::7".to_string())).unwrap(), "[fd00::7]:4100".parse().unwrap());
        let unasked = || -> Result<String, DistError> { panic!("an address was given") };
        assert_eq!(offered_address("10.9.9.9:4100".parse().unwrap(), unasked).unwrap(), "10.9.9.9:4100".parse().unwrap());
    }
}
