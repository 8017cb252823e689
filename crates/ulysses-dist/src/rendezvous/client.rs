//! A rank's blocking connection to the rendezvous store.

use std::{
    io::ErrorKind,
    net::{TcpStream, ToSocketAddrs},
    time::{Duration, Instant},
};

use super::protocol::{FrameError, Request, Response, read_blocking, write_blocking};
use crate::DistError;

pub struct RendezvousClient {
    stream: TcpStream,
    addr: String,
    rank: usize,
    max_message_bytes: usize,
    timeout: Duration,
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
        let deadline = Instant::now() + timeout;
        let stream = loop {
            let attempt = target.to_socket_addrs().ok().and_then(|mut addrs| addrs.next()).map(|socket| {
                let remaining = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10));
                TcpStream::connect_timeout(&socket, remaining.min(Duration::from_secs(5)))
            });
            match attempt {
                Some(Ok(stream)) => break stream,
                _ if Instant::now() >= deadline => {
                    return Err(DistError::RendezvousTimeout {
                        addr: target,
                        after: timeout,
                        waiting_for: "waiting for rank 0 to accept the connection".into(),
                    });
                }
                _ => std::thread::sleep(Duration::from_millis(100)),
            }
        };
        let _ = stream.set_nodelay(true);
        let mut client = Self { stream, addr: target, rank, max_message_bytes, timeout };
        let hello = Request::Hello { token: token.to_string(), rank, world_size };
        match client.request(&hello, "for rank 0's welcome")? {
            Response::Welcome => Ok(client),
            Response::Rejected { reason } => Err(DistError::Rejected { addr: client.addr.clone(), reason }),
            other => Err(DistError::Protocol(format!("expected a welcome, got {other:?}"))),
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), DistError> {
        match self.request(&Request::Set { key: key.into(), value: value.to_vec() }, "to store a key")? {
            Response::Stored => Ok(()),
            other => Err(DistError::Protocol(format!("expected stored, got {other:?}"))),
        }
    }

    /// The value of `key`, waiting until some rank sets it (at most the timeout).
    pub fn get(&mut self, key: &str) -> Result<Vec<u8>, DistError> {
        match self.request(&Request::Get { key: key.into() }, &format!("for key {key:?}"))? {
            Response::Value { value } => Ok(value),
            other => Err(DistError::Protocol(format!("expected a value, got {other:?}"))),
        }
    }

    /// Ranks whose connection closed without a goodbye (they crashed or were killed).
    pub fn departed(&mut self) -> Result<Vec<usize>, DistError> {
        match self.request(&Request::Departed, "for the departed ranks")? {
            Response::Departed { ranks } => Ok(ranks),
            other => Err(DistError::Protocol(format!("expected departed ranks, got {other:?}"))),
        }
    }

    /// Returns once every rank of the world has reached the barrier `name`.
    pub fn barrier(&mut self, name: &str, world_size: usize) -> Result<(), DistError> {
        self.set(&format!("barrier/{name}/{}", self.rank), &[])?;
        for rank in 0..world_size {
            self.get(&format!("barrier/{name}/{rank}"))?;
        }
        Ok(())
    }

    fn request(&mut self, request: &Request, waiting_for: &str) -> Result<Response, DistError> {
        let protocol = |e: FrameError| DistError::Protocol(format!("{} ({})", e, self.addr));
        self.stream.set_read_timeout(Some(self.timeout)).map_err(|e| protocol(e.into()))?;
        write_blocking(&mut self.stream, request).map_err(protocol)?;
        match read_blocking(&mut self.stream, self.max_message_bytes) {
            Ok(response) => Ok(response),
            Err(FrameError::Io(e)) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                Err(DistError::RendezvousTimeout { addr: self.addr.clone(), after: self.timeout, waiting_for: waiting_for.into() })
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
        let _ = write_blocking(&mut self.stream, &Request::Goodbye);
    }
}
