//! A rank's blocking connection to the rendezvous store.

use std::{
    io::ErrorKind,
    net::{TcpStream, ToSocketAddrs},
    time::{Duration, Instant},
};

use super::{
    LeftRanks,
    protocol::{FrameError, Prover, Request, Response, handshake_proof, proof_holds, read_blocking, write_blocking},
};
use crate::DistError;

pub struct RendezvousClient {
    stream: TcpStream,
    addr: String,
    rank: usize,
    max_message_bytes: usize,
    timeout: Duration,
    /// Set after a timeout or an i/o error: the stream may hold a late answer, so it is not
    /// used again.
    broken: bool,
    /// Times each barrier name was used, so a name can be reused.
    barriers: std::collections::HashMap<String, u64>,
}

impl RendezvousClient {
    /// Connects (retrying until `timeout`: rank 0 may start later) and says hello.
    pub fn connect(
        addr: &str,
        port: u16,
        rank: usize,
        world_size: usize,
        token: &str,
        timeout: Duration,
        max_message_bytes: usize,
    ) -> Result<Self, DistError> {
        let target = format!("{addr}:{port}");
        let host = crate::env::bare_host(addr);
        let deadline = Instant::now() + timeout;
        // Each attempt tries every address the name resolves to (`localhost` may give ::1
        // first where rank 0 listens on 127.0.0.1); the last failure goes into the timeout.
        let mut last_failure = String::new();
        loop {
            let stream = 'connected: loop {
                match (host, port).to_socket_addrs() {
                    Ok(sockets) => {
                        for socket in sockets {
                            let remaining = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10));
                            match TcpStream::connect_timeout(&socket, remaining.min(Duration::from_secs(5))) {
                                Ok(stream) => break 'connected stream,
                                Err(e) => last_failure = format!("{socket}: {e}"),
                            }
                        }
                    }
                    Err(e) => last_failure = format!("{host} does not resolve: {e}"),
                }
                if Instant::now() >= deadline {
                    return Err(DistError::RendezvousTimeout {
                        addr: target,
                        after: timeout,
                        waiting_for: format!("waiting for rank 0 to accept the connection (last attempt: {last_failure})"),
                    });
                }
                std::thread::sleep(Duration::from_millis(100));
            };
            let _ = stream.set_nodelay(true);
            let mut client = Self { stream, addr: target.clone(), rank, max_message_bytes, timeout, broken: false, barriers: Default::default() };
            let nonce = super::new_token();
            let hello = Request::Hello { rank, world_size, nonce: nonce.clone() };
            let answer = match client.request(&hello, "for rank 0's challenge") {
                // Rank 0's proof checked before anything of the job is sent: a program that took
                // MASTER_PORT first gets no proof it could join with, nor the job's keys.
                Ok(Response::Challenge { nonce: server_nonce, proof }) => {
                    if !proof_holds(&proof, token, Prover::Server, &nonce, &server_nonce, rank, world_size) {
                        // Not a word more to it, a goodbye included.
                        client.broken = true;
                        return Err(DistError::Rejected {
                            addr: client.addr.clone(),
                            reason: format!(
                                "what answers there does not know this job's token, so nothing more was sent to it: {}; or another \
                                 program took MASTER_PORT before rank 0",
                                super::server::WRONG_TOKEN
                            ),
                        });
                    }
                    let proof = handshake_proof(token, Prover::Rank, &nonce, &server_nonce, rank, world_size);
                    client.request(&Request::Proof { proof }, "for rank 0's welcome")
                }
                // Welcomed unproven: not rank 0's rendezvous (it challenges first), nothing sent to it.
                Ok(Response::Welcome) => {
                    client.broken = true;
                    return Err(DistError::Rejected {
                        addr: client.addr.clone(),
                        reason: "what answers there welcomed this rank without proving it knows the job's token, so nothing more \
                                 was sent to it: another program took MASTER_PORT before rank 0, or rank 0 runs another build of \
                                 burn-ulysses (its handshake differs)"
                            .into(),
                    });
                }
                // Rank 0 closed the connection at the hello: its build may read another one.
                Err(DistError::Protocol(message)) if message.contains("closed the connection") => {
                    Err(DistError::Protocol(format!("{message}; or rank 0 runs another build of burn-ulysses, whose handshake differs")))
                }
                other => other,
            };
            return match answer {
                Ok(Response::Welcome) => Ok(client),
                Ok(Response::Rejected { reason }) => Err(DistError::Rejected { addr: client.addr.clone(), reason }),
                // The server's handshakes all taken (a flood of connections): dialled again.
                Ok(Response::Busy) if Instant::now() < deadline => {
                    last_failure = "rank 0's rendezvous had too many connections in their handshake".into();
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
                Ok(Response::Busy) => Err(DistError::RendezvousTimeout {
                    addr: target,
                    after: timeout,
                    waiting_for: "waiting for rank 0's rendezvous, which had too many connections in their handshake (a flood of them)".into(),
                }),
                Ok(other) => Err(DistError::Protocol(format!("expected a welcome, got {other:?}"))),
                Err(error) => Err(error),
            };
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The local end of the connection to rank 0.
    pub fn local_addr(&self) -> std::io::Result<std::net::SocketAddr> {
        self.stream.local_addr()
    }

    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), DistError> {
        // JSON spells bytes as numbers of up to four characters; stay well inside the limit.
        if (key.len() + value.len()) * 4 + 64 > self.max_message_bytes {
            return Err(DistError::Protocol(format!(
                "a value of {} bytes for {key:?} exceeds the rendezvous message limit of {} bytes (ULYSSES_MAX_MESSAGE_BYTES)",
                value.len(),
                self.max_message_bytes
            )));
        }
        match self.request(&Request::Set { key: key.into(), value: value.to_vec() }, "to store a key")? {
            Response::Stored => Ok(()),
            other => Err(DistError::Protocol(format!("expected stored, got {other:?}"))),
        }
    }

    /// The value of `key`, waiting until some rank sets it (at most the timeout).
    pub fn get(&mut self, key: &str) -> Result<Vec<u8>, DistError> {
        self.get_key(key, None)
    }

    /// Says, for the job's other ranks, that this rank failed before its part of the job
    /// (`reason`); a rank that waits for a key this rank would have set names it.
    pub fn set_failure(&mut self, reason: &str) -> Result<(), DistError> {
        // Within a message however long the reason.
        let reason: String = reason.chars().take(2000).collect();
        self.set(&failure_key(self.rank), reason.as_bytes())
    }

    /// The value of `key`, which rank `writer` sets: waits until it does, fails at once if
    /// it left the job without (at most the timeout).
    pub fn get_set_by(&mut self, key: &str, writer: usize) -> Result<Vec<u8>, DistError> {
        self.get_key(key, Some(writer))
    }

    fn get_key(&mut self, key: &str, writer: Option<usize>) -> Result<Vec<u8>, DistError> {
        match self.request(&Request::Get { key: key.into(), writer }, &format!("for key {key:?}"))? {
            Response::Value { value } => Ok(value),
            Response::WriterLeft { rank, died } => {
                // A rank that failed before its part of the job said why, where it could.
                let reason = match (died, writer) {
                    (false, Some(_)) => match self.request(&Request::Get { key: failure_key(rank), writer: Some(rank) }, "for a rank's failure") {
                        Ok(Response::Value { value }) => Some(String::from_utf8_lossy(&value).into_owned()),
                        _ => None,
                    },
                    _ => None,
                };
                Err(DistError::WriterLeft { rank, key: key.into(), died, reason })
            }
            other => Err(DistError::Protocol(format!("expected a value, got {other:?}"))),
        }
    }

    /// Ranks whose connection closed without a goodbye (they crashed or were killed).
    pub fn departed(&mut self) -> Result<Vec<usize>, DistError> {
        self.left().map(|left| left.died)
    }

    /// Ranks that left the job: without a goodbye (died) or with one (finished).
    pub fn left(&mut self) -> Result<LeftRanks, DistError> {
        self.left_within(self.timeout)
    }

    /// [`left`](Self::left), waiting at most `limit` (and the timeout) for rank 0's answer: a
    /// collective that polls it has a deadline of its own, which a rank 0 that stopped
    /// answering (stopped, its node gone, the network cut) must not stretch to the timeout.
    pub fn left_within(&mut self, limit: Duration) -> Result<LeftRanks, DistError> {
        let limit = limit.min(self.timeout).max(Duration::from_millis(1));
        match self.request_within(&Request::Departed, "for the departed ranks", limit)? {
            Response::Departed { ranks, finished } => Ok(LeftRanks { died: ranks, finished }),
            other => Err(DistError::Protocol(format!("expected departed ranks, got {other:?}"))),
        }
    }

    /// Returns once every rank of the world has reached the barrier `name` (as often as each
    /// rank calls it: the n-th call of a name meets the others' n-th call).
    pub fn barrier(&mut self, name: &str, world_size: usize) -> Result<(), DistError> {
        let generation = self.barriers.entry(name.to_string()).or_insert(0);
        let key = format!("barrier/{name}/{generation}");
        *generation += 1;
        self.set(&format!("{key}/{}", self.rank), &[])?;
        for rank in 0..world_size {
            // The ranks are awaited in order: a timeout names the first that has not arrived.
            self.get_set_by(&format!("{key}/{rank}"), rank).map_err(|error| match error {
                DistError::RendezvousTimeout { addr, after, .. } => DistError::RendezvousTimeout {
                    addr,
                    after,
                    waiting_for: format!("waiting for rank {rank} at the barrier {name:?} (every rank below it had arrived)"),
                },
                other => other,
            })?;
        }
        Ok(())
    }

    fn request(&mut self, request: &Request, waiting_for: &str) -> Result<Response, DistError> {
        self.request_within(request, waiting_for, self.timeout)
    }

    /// A request whose answer is awaited at most `limit`.
    fn request_within(&mut self, request: &Request, waiting_for: &str, limit: Duration) -> Result<Response, DistError> {
        if self.broken {
            return Err(DistError::Protocol(format!("the connection to {} failed earlier and is closed", self.addr)));
        }
        let result = self.exchange(request, waiting_for, limit);
        if result.is_err() {
            self.broken = true;
            let _ = self.stream.shutdown(std::net::Shutdown::Both);
        }
        result
    }

    fn exchange(&mut self, request: &Request, waiting_for: &str, limit: Duration) -> Result<Response, DistError> {
        let protocol = |e: FrameError| DistError::Protocol(format!("{} ({})", e, self.addr));
        self.stream.set_read_timeout(Some(limit)).map_err(|e| protocol(e.into()))?;
        write_blocking(&mut self.stream, request).map_err(protocol)?;
        // Answers carry JSON framing on top of the value: allow for it.
        match read_blocking(&mut self.stream, self.max_message_bytes * 5) {
            Ok(response) => Ok(response),
            Err(FrameError::Io(e)) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                Err(DistError::RendezvousTimeout { addr: self.addr.clone(), after: limit, waiting_for: waiting_for.into() })
            }
            Err(FrameError::Closed) => Err(DistError::Protocol(format!(
                "rank 0's rendezvous on {} closed the connection (rank 0 exited?)",
                self.addr
            ))),
            Err(error) => Err(protocol(error)),
        }
    }
}

impl Drop for RendezvousClient {
    fn drop(&mut self) {
        // A goodbye tells the server this rank finished rather than died.
        if !self.broken {
            let _ = write_blocking(&mut self.stream, &Request::Goodbye);
        }
    }
}

/// Where rank `rank` says why it failed before its part of the job ([`RendezvousClient::set_failure`]).
fn failure_key(rank: usize) -> String {
    format!("failed/{rank}")
}
