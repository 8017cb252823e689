//! The store that rank 0 serves, on a tokio runtime of its own thread.
//!
//! Every connection must open with the handshake (`Hello`, `Challenge`, `Proof`: each side
//! proves it knows the job's token without sending it) and give a rank in range and the
//! server's world size; anything else is refused with a logged reason. Frames are
//! capped. A welcomed rank whose connection closes without `Goodbye` is recorded as
//! departed, so the others can name it when a collective stalls.

use std::{
    collections::{BTreeSet, HashMap},
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::{net::TcpStream, sync::watch};

use super::protocol::{FrameError, Prover, Request, Response, handshake_proof, proof_holds, read_async, write_async};
use crate::DistError;

/// Limits of the server.
#[derive(Clone)]
pub struct ServerSettings {
    pub world_size: usize,
    pub token: String,
    pub max_message_bytes: usize,
    /// A connection that has not finished its handshake (hello, then proof) within this time
    /// is dropped.
    pub handshake_timeout: Duration,
}

/// Without the token: settings in a log are not the job's key.
impl std::fmt::Debug for ServerSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerSettings")
            .field("world_size", &self.world_size)
            .field("token", &"<redacted>")
            .field("max_message_bytes", &self.max_message_bytes)
            .field("handshake_timeout", &self.handshake_timeout)
            .finish()
    }
}

pub struct RendezvousServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[derive(Default)]
struct State {
    store: HashMap<String, Vec<u8>>,
    /// Welcomed ranks and their peer address.
    joined: HashMap<usize, SocketAddr>,
    departed: BTreeSet<usize>,
    /// Ranks that said goodbye.
    finished: BTreeSet<usize>,
}

struct Shared {
    settings: ServerSettings,
    state: Mutex<State>,
    /// Bumped on every `Set` and whenever a rank leaves, so `Get` waiters re-check.
    version: watch::Sender<u64>,
    /// Connections not yet admitted: bounded, so that a flood of them (a port scan, another
    /// user's) cannot take the process's file descriptors, which checkpoints and NCCL need.
    handshakes: Arc<tokio::sync::Semaphore>,
    /// Connections past that bound being told so ([`say_busy`]).
    busy_replies: Arc<tokio::sync::Semaphore>,
    /// Connections refused so far: the first few are logged, then one in a thousand.
    refused: std::sync::atomic::AtomicU64,
}

/// Whether the `count`th of a kind of failure is logged: the first 20, then one in a thousand
/// (a flood of them would fill the job's output).
fn worth_saying(count: u64) -> bool {
    count <= 20 || count % 1000 == 0
}

/// Connections in their handshake at once, beyond the world's own.
const SPARE_HANDSHAKES: usize = 64;

impl Shared {
    /// Logs a refused connection, the first 20 and then one in a thousand (a flood of them
    /// would fill the job's output).
    fn say_refused(&self, peer: SocketAddr, reason: &str) {
        let count = self.refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        if worth_saying(count) {
            tracing::warn!(%peer, %reason, refused = count, "rendezvous refused a connection");
        }
    }
}

impl RendezvousServer {
    /// Binds `addr:port` (the address rank 0 is reached at, not every interface) and serves
    /// until dropped. Port 0 picks a free port; see [`local_addr`](Self::local_addr).
    pub fn start(addr: &str, port: u16, settings: ServerSettings) -> Result<Self, DistError> {
        let bind_error = |reason: String| DistError::Bind { addr: format!("{addr}:{port}"), reason };
        let listener = std::net::TcpListener::bind((addr, port)).map_err(|e| {
            bind_error(match e.kind() {
                // Rank 0's port taken: often by this job's own rank 0, started twice (RANK=0
                // exported by a batch script for every task).
                std::io::ErrorKind::AddrInUse => format!(
                    "{e} (another job's process may hold it, or a second process of this job with RANK=0: a batch script that \
                     exports RANK gives every task the same; leave RANK to the launcher)"
                ),
                _ => e.to_string(),
            })
        })?;
        listener.set_nonblocking(true).map_err(|e| bind_error(e.to_string()))?;
        let local = listener.local_addr().map_err(|e| bind_error(e.to_string()))?;
        let (shutdown, stop) = tokio::sync::oneshot::channel();
        let handshakes = Arc::new(tokio::sync::Semaphore::new(2 * settings.world_size + SPARE_HANDSHAKES));
        let busy_replies = Arc::new(tokio::sync::Semaphore::new(SPARE_HANDSHAKES));
        let shared = Arc::new(Shared { settings, state: Mutex::default(), version: watch::channel(0).0, handshakes, busy_replies, refused: Default::default() });
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| bind_error(e.to_string()))?;
        let thread = std::thread::Builder::new()
            .name("ulysses-rendezvous".into())
            .spawn({
                let shared = shared.clone();
                move || runtime.block_on(serve(listener, shared, stop))
            })
            .map_err(|e| bind_error(e.to_string()))?;
        tracing::info!(addr = %local, "rendezvous serving");
        Ok(Self { addr: local, shared, shutdown: Some(shutdown), thread: Some(thread) })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits until every rank that joined has said goodbye or died, at most `timeout`, so
    /// that rank 0 does not close the store under ranks still reading from it.
    pub fn wait_until_all_left(&self, timeout: Duration) {
        self.wait_until_left(0, timeout);
    }

    /// [`wait_until_all_left`](Self::wait_until_all_left), and until all `world_size` ranks have
    /// joined first: a rank 0 that failed before its job serves its reason to the ranks still
    /// on their way (loading data or a model), which a closed store would refuse.
    pub fn wait_until_every_rank_came_and_left(&self, world_size: usize, timeout: Duration) {
        self.wait_until_left(world_size, timeout);
    }

    /// Waits until `joining` ranks or more have joined and every one joined has left, at most
    /// `timeout`.
    fn wait_until_left(&self, joining: usize, timeout: Duration) {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let (joined, remaining): (usize, Vec<usize>) = {
                let state = self.shared.state.lock().unwrap();
                (state.joined.len(), state.joined.keys().filter(|r| !state.finished.contains(r) && !state.departed.contains(r)).copied().collect())
            };
            if remaining.is_empty() && joined >= joining {
                return;
            }
            if std::time::Instant::now() >= deadline {
                return tracing::warn!(?remaining, "rendezvous closing while ranks are still connected");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RendezvousServer {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn serve(listener: std::net::TcpListener, shared: Arc<Shared>, mut stop: tokio::sync::oneshot::Receiver<()>) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(listener) => listener,
        Err(error) => return tracing::error!(%error, "rendezvous cannot listen"),
    };
    let mut failed_accepts = 0u64;
    loop {
        tokio::select! {
            _ = &mut stop => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    failed_accepts = 0;
                    // Past the handshakes' bound: told `Busy` (a rank dials again, until its
                    // rendezvous timeout), after its hello is read where a few more tasks may
                    // (an answer to an unread hello can be lost to the reset its close sends),
                    // else in the one write the socket takes without waiting.
                    match (shared.handshakes.clone().try_acquire_owned(), shared.busy_replies.clone().try_acquire_owned()) {
                        (Ok(handshake), _) => drop(tokio::spawn(connection(stream, peer, shared.clone(), handshake))),
                        (Err(_), Ok(reply)) => drop(tokio::spawn(say_busy(stream, peer, shared.clone(), reply))),
                        (Err(_), Err(_)) => {
                            let _ = stream.try_write(&super::protocol::encode(&Response::Busy));
                            shared.say_refused(peer, "too many connections in their handshake");
                        }
                    }
                }
                Err(error) => {
                    // Out of descriptors, say: not a loop that logs as fast as it fails.
                    failed_accepts += 1;
                    if worth_saying(failed_accepts) {
                        tracing::warn!(%error, failed = failed_accepts, "rendezvous accept failed");
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
            },
        }
    }
}

/// What a rank whose proof of the job's token fails is told (and what a rank tells itself
/// when rank 0's fails).
pub(crate) const WRONG_TOKEN: &str = "wrong job token: ULYSSES_RENDEZVOUS_TOKEN differs from rank 0's, or this rank is of another run \
    that reached this one's port (another Slurm step or ULYSSES_RUN_ID, another launch): give each run its own MASTER_PORT, and one \
    run whose ranks several srun steps start one ULYSSES_RUN_ID";

/// Checks a proven `Hello`'s place in the job; the reason is sent to the peer and logged.
fn admit(shared: &Shared, rank: usize, world_size: usize, peer: SocketAddr) -> Result<usize, String> {
    let settings = &shared.settings;
    if world_size != settings.world_size {
        return Err(format!(
            "this rank was launched with WORLD_SIZE={world_size} but rank 0 with WORLD_SIZE={}",
            settings.world_size
        ));
    }
    if rank >= world_size {
        return Err(format!("rank {rank} is out of range for WORLD_SIZE={world_size}"));
    }
    let mut state = shared.state.lock().unwrap();
    let gone = state.departed.contains(&rank) || state.finished.contains(&rank);
    if let Some(previous) = state.joined.get(&rank).filter(|_| !gone) {
        return Err(format!("rank {rank} already joined from {previous}: two processes have RANK={rank}"));
    }
    state.departed.remove(&rank);
    state.finished.remove(&rank);
    state.joined.insert(rank, peer);
    Ok(rank)
}

/// Tells a connection past the handshakes' bound to dial again: its hello read first (a second
/// at most), so that the answer is not lost to the reset a close with unread bytes sends.
async fn say_busy(mut stream: TcpStream, peer: SocketAddr, shared: Arc<Shared>, _reply: tokio::sync::OwnedSemaphorePermit) {
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), read_async::<Request>(&mut stream, HELLO_LIMIT)).await;
    let _ = write_async(&mut stream, &Response::Busy).await;
    shared.say_refused(peer, "too many connections in their handshake");
}

/// Largest hello: before the token is checked, a peer gets no more than this.
const HELLO_LIMIT: usize = 4096;

/// The handshake: the rank's hello (its place and a nonce), rank 0's challenge (a nonce and
/// its proof of the token), the rank's proof; the rank's place in the job checked last.
async fn handshake(stream: &mut TcpStream, shared: &Shared) -> Result<(usize, usize), Refusal> {
    let settings = &shared.settings;
    let (rank, world_size, rank_nonce) = match read_async::<Request>(stream, HELLO_LIMIT).await {
        Ok(Request::Hello { rank, world_size, nonce }) => (rank, world_size, nonce),
        Ok(_) => return Err(Refusal::told("the first message must be a hello")),
        // Read whole but not understood: a rank of another build, told so (its own build reads
        // a rejection as this one does).
        Err(FrameError::Malformed(error)) => {
            return Err(Refusal::told(format!(
                "an unreadable hello ({error}): a rank built from another version of burn-ulysses, whose handshake differs? \
                 build every rank from one checkout"
            )));
        }
        Err(error) => return Err(Refusal::untold(error.to_string())),
    };
    let nonce = super::new_token();
    let proof = handshake_proof(&settings.token, Prover::Server, &rank_nonce, &nonce, rank, world_size);
    write_async(stream, &Response::Challenge { nonce: nonce.clone(), proof }).await.map_err(|e| Refusal::untold(e.to_string()))?;
    match read_async::<Request>(stream, HELLO_LIMIT).await {
        Ok(Request::Proof { proof }) if proof_holds(&proof, &settings.token, Prover::Rank, &rank_nonce, &nonce, rank, world_size) => Ok((rank, world_size)),
        Ok(Request::Proof { .. }) => Err(Refusal::told(WRONG_TOKEN)),
        Ok(_) => Err(Refusal::told("the answer to the challenge must be a proof")),
        // The rank found rank 0's proof wrong (a token of its own) and said nothing more.
        Err(error) => Err(Refusal::untold(format!("no proof of the job's token ({error}): {WRONG_TOKEN}"))),
    }
}

/// Why a handshake failed, and whether the peer is told (not where the connection broke, a
/// frame was too large to read, or time ran out: it is closed).
struct Refusal {
    reason: String,
    told: bool,
}

impl Refusal {
    fn told(reason: impl Into<String>) -> Self {
        Self { reason: reason.into(), told: true }
    }

    fn untold(reason: impl Into<String>) -> Self {
        Self { reason: reason.into(), told: false }
    }
}

async fn connection(mut stream: TcpStream, peer: SocketAddr, shared: Arc<Shared>, handshake_slot: tokio::sync::OwnedSemaphorePermit) {
    // One deadline for the whole handshake: a silent peer holds its slot no longer.
    let admitted = match tokio::time::timeout(shared.settings.handshake_timeout, handshake(&mut stream, &shared)).await {
        Ok(Ok((rank, world_size))) => admit(&shared, rank, world_size, peer).map_err(Refusal::told),
        Ok(Err(refusal)) => Err(refusal),
        Err(_) => Err(Refusal::untold("no handshake in time")),
    };
    let rank = match admitted {
        Ok(rank) => rank,
        Err(Refusal { reason, told }) => {
            shared.say_refused(peer, &reason);
            if told {
                let _ = write_async(&mut stream, &Response::Rejected { reason }).await;
            }
            return;
        }
    };
    drop(handshake_slot);
    if write_async(&mut stream, &Response::Welcome).await.is_err() {
        return;
    }
    tracing::debug!(%peer, rank, "rank joined the rendezvous");

    let clean = serve_rank(&mut stream, &shared).await;
    {
        let mut state = shared.state.lock().unwrap();
        match clean {
            Ok(()) => {
                state.finished.insert(rank);
            }
            Err(error) => {
                state.departed.insert(rank);
                tracing::warn!(%peer, rank, %error, "rank left the rendezvous without saying goodbye");
            }
        }
    }
    // Wake the waiters on keys this rank was to set.
    shared.version.send_modify(|v| *v += 1);
}

/// Answers one rank's requests; `Ok` after a goodbye, `Err` when the connection broke.
async fn serve_rank(stream: &mut TcpStream, shared: &Shared) -> Result<(), FrameError> {
    let limit = shared.settings.max_message_bytes;
    loop {
        let response = match read_async::<Request>(stream, limit).await? {
            Request::Goodbye => return Ok(()),
            Request::Hello { .. } | Request::Proof { .. } => Response::Rejected { reason: "already joined".into() },
            Request::Set { key, value } => {
                shared.state.lock().unwrap().store.insert(key, value);
                shared.version.send_modify(|v| *v += 1);
                Response::Stored
            }
            Request::Get { key, writer } => {
                let mut changes = shared.version.subscribe();
                loop {
                    {
                        let state = shared.state.lock().unwrap();
                        if let Some(value) = state.store.get(&key).cloned() {
                            break Response::Value { value };
                        }
                        // A writer that left will never set it: say so now, not at the timeout.
                        if let Some(rank) = writer.filter(|r| state.departed.contains(r) || state.finished.contains(r)) {
                            break Response::WriterLeft { rank, died: state.departed.contains(&rank) };
                        }
                    }
                    // A waiting client sends nothing, so a readable socket means it closed:
                    // notice a rank that dies while it waits.
                    let mut probe = [0u8; 1];
                    tokio::select! {
                        changed = changes.changed() => if changed.is_err() { return Err(FrameError::Closed) },
                        peeked = stream.peek(&mut probe) => return Err(match peeked {
                            Ok(0) => FrameError::Closed,
                            Ok(_) => FrameError::Malformed("request sent while waiting for a key".into()),
                            Err(error) => error.into(),
                        }),
                    }
                }
            }
            Request::Departed => {
                let state = shared.state.lock().unwrap();
                Response::Departed {
                    ranks: state.departed.iter().copied().collect(),
                    finished: state.finished.iter().copied().collect(),
                }
            }
        };
        write_async(stream, &response).await?;
    }
}
