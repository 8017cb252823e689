//! Wire format: each message is a frame, a big-endian `u32` length then that many bytes of
//! JSON. Frames above the configured limit are refused before they are read.

use std::io::{Read, Write};

use serde::{Deserialize, Serialize, de::DeserializeOwned};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Client to server.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Request {
    /// First message of every connection: no token, a nonce for rank 0 to prove it knows it
    /// by ([`Response::Challenge`]).
    Hello { rank: usize, world_size: usize, nonce: String },
    /// The rank's answer to the challenge: [`handshake_proof`] of the job's token, as the rank.
    Proof { proof: String },
    Set { key: String, value: Vec<u8> },
    /// Answered once the key is set, or, where `writer` names the rank that sets it, once
    /// that rank has left the job without setting it.
    Get {
        key: String,
        #[serde(default)]
        writer: Option<usize>,
    },
    /// Ranks whose connection closed without a goodbye, and those that said one.
    Departed,
    /// A clean disconnect: this rank is done, not dead.
    Goodbye,
}

/// Server to client.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Response {
    /// Rank 0's answer to a hello: its own nonce and [`handshake_proof`] of the job's token, as
    /// rank 0, over both nonces. The rank checks it before it proves its own knowledge.
    Challenge { nonce: String, proof: String },
    Welcome,
    Rejected { reason: String },
    Stored,
    Value { value: Vec<u8> },
    /// The key's writer left the job without setting it: `died` without a goodbye, else its
    /// process ended (an error of its own, as a rule).
    WriterLeft { rank: usize, died: bool },
    /// `ranks` died (no goodbye); `finished` said goodbye (absent from older servers).
    Departed {
        ranks: Vec<usize>,
        #[serde(default)]
        finished: Vec<usize>,
    },
    /// The server has too many connections in their handshake (a flood of them): dial again.
    Busy,
}

/// Who proves it knows the job's token in a handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prover {
    /// Rank 0's rendezvous, answering a hello.
    Server,
    /// The rank that said hello, answering the challenge.
    Rank,
}

/// The proof that `prover` knows `token`, bound to this handshake: HMAC-SHA256 keyed by the
/// token over the prover, both nonces and the rank's claimed place, in hex. The token never
/// crosses the wire: a program that took MASTER_PORT before rank 0 learns nothing it could
/// join the job with, and a rank tells it from rank 0 before it sends anything of the job.
pub fn handshake_proof(token: &str, prover: Prover, rank_nonce: &str, server_nonce: &str, rank: usize, world_size: usize) -> String {
    use hmac::Mac;
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(token.as_bytes()).expect("HMAC takes a key of any length");
    let who = match prover {
        Prover::Server => "rank 0",
        Prover::Rank => "rank",
    };
    for part in [who, rank_nonce, server_nonce, &rank.to_string(), &world_size.to_string()] {
        mac.update(&(part.len() as u64).to_be_bytes());
        mac.update(part.as_bytes());
    }
    mac.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `proof` is [`handshake_proof`]'s for these, compared in constant time.
pub fn proof_holds(proof: &str, token: &str, prover: Prover, rank_nonce: &str, server_nonce: &str, rank: usize, world_size: usize) -> bool {
    let expected = handshake_proof(token, prover, rank_nonce, server_nonce, rank, world_size);
    expected.len() == proof.len() && expected.bytes().zip(proof.bytes()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("connection closed")]
    Closed,
    #[error("frame of {size} bytes exceeds the limit of {limit}")]
    TooLarge { size: usize, limit: usize },
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

pub(crate) fn encode<T: Serialize>(message: &T) -> Vec<u8> {
    let body = serde_json::to_vec(message).expect("protocol messages serialize");
    let mut frame = (body.len() as u32).to_be_bytes().to_vec();
    frame.extend(body);
    frame
}

fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, FrameError> {
    serde_json::from_slice(body).map_err(|e| FrameError::Malformed(e.to_string()))
}

fn check_size(header: [u8; 4], limit: usize) -> Result<usize, FrameError> {
    let size = u32::from_be_bytes(header) as usize;
    if size > limit { Err(FrameError::TooLarge { size, limit }) } else { Ok(size) }
}

pub async fn read_async<T: DeserializeOwned>(reader: &mut (impl AsyncRead + Unpin), limit: usize) -> Result<T, FrameError> {
    let mut header = [0u8; 4];
    match reader.read_exact(&mut header).await {
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(FrameError::Closed),
        other => other?,
    };
    let mut body = vec![0u8; check_size(header, limit)?];
    reader.read_exact(&mut body).await?;
    decode(&body)
}

pub async fn write_async<T: Serialize>(writer: &mut (impl AsyncWrite + Unpin), message: &T) -> Result<(), FrameError> {
    writer.write_all(&encode(message)).await?;
    Ok(())
}

pub fn read_blocking<T: DeserializeOwned>(reader: &mut impl Read, limit: usize) -> Result<T, FrameError> {
    let mut header = [0u8; 4];
    match reader.read_exact(&mut header) {
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(FrameError::Closed),
        other => other?,
    };
    let mut body = vec![0u8; check_size(header, limit)?];
    reader.read_exact(&mut body)?;
    decode(&body)
}

pub fn write_blocking<T: Serialize>(writer: &mut impl Write, message: &T) -> Result<(), FrameError> {
    writer.write_all(&encode(message))?;
    Ok(())
}
