//! The wire format between two ranks: fixed 32-byte headers, payloads cut into bounded
//! frames.
//!
//! A *message* is what one rank sends another for one step of one collective. It travels as
//! one or more frames of at most [`MAX_FRAME_BYTES`]; the header of each frame carries the
//! whole message's length, which the receiver checks against its limit before it stores a
//! byte, so a corrupt or hostile header cannot make it allocate without bound.

use std::io::{self, Read, Write};

/// Bytes of one frame's payload at most.
pub const MAX_FRAME_BYTES: usize = 4 << 20;

const MAGIC: u16 = 0x554c; // "UL"
pub const HEADER_BYTES: usize = 32;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Part of a collective's message.
    Data = 0,
    /// The sender stops: its collectives failed. Payload: JSON [`AbortNotice`].
    Abort = 1,
    /// The sender is done and closes the connection cleanly.
    Goodbye = 2,
    /// First frame of a connection: JSON [`Hello`].
    Hello = 3,
    /// Answer to a hello: accepted (empty payload) ...
    Welcome = 4,
    /// ... or refused (payload: the reason, UTF-8).
    Rejected = 5,
}

impl Kind {
    fn from_byte(byte: u8) -> Option<Self> {
        Some(match byte {
            0 => Kind::Data,
            1 => Kind::Abort,
            2 => Kind::Goodbye,
            3 => Kind::Hello,
            4 => Kind::Welcome,
            5 => Kind::Rejected,
            _ => return None,
        })
    }
}

/// The fixed part of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    /// The collective (`Collective as u8`) of a data frame.
    pub op: u8,
    /// The group (world or a split of it) the message belongs to.
    pub group: u64,
    /// The collective's sequence number within its group.
    pub seq: u64,
    /// Bytes of the whole message this frame is part of.
    pub message_len: u64,
    /// Bytes of payload after this header.
    pub frame_len: u32,
}

/// The first frame a connecting rank sends.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Hello {
    pub token: String,
    pub rank: usize,
    pub world_size: usize,
}

/// Why a rank stopped, sent to every peer before it leaves.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AbortNotice {
    pub reason: String,
    /// The world ranks it holds responsible (dead, or not arriving), if any.
    pub blamed: Vec<usize>,
}

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("connection closed")]
    Closed,
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Io(#[from] io::Error),
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut bytes = [0u8; HEADER_BYTES];
        bytes[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        bytes[2] = self.kind as u8;
        bytes[3] = self.op;
        bytes[4..12].copy_from_slice(&self.group.to_le_bytes());
        bytes[12..20].copy_from_slice(&self.seq.to_le_bytes());
        bytes[20..28].copy_from_slice(&self.message_len.to_le_bytes());
        bytes[28..32].copy_from_slice(&self.frame_len.to_le_bytes());
        bytes
    }

    /// Checks the magic, the kind and both lengths against their limits.
    pub fn decode(bytes: &[u8; HEADER_BYTES], max_message_bytes: u64) -> Result<Self, FrameError> {
        let word = |range: std::ops::Range<usize>| u64::from_le_bytes(bytes[range].try_into().unwrap());
        if u16::from_le_bytes([bytes[0], bytes[1]]) != MAGIC {
            return Err(FrameError::Invalid("a frame without the burn-ulysses magic bytes (not a burn-ulysses rank?)".into()));
        }
        let kind = Kind::from_byte(bytes[2]).ok_or_else(|| FrameError::Invalid(format!("unknown frame kind {}", bytes[2])))?;
        let header = Header {
            kind,
            op: bytes[3],
            group: word(4..12),
            seq: word(12..20),
            message_len: word(20..28),
            frame_len: u32::from_le_bytes(bytes[28..32].try_into().unwrap()),
        };
        if header.frame_len as usize > MAX_FRAME_BYTES {
            return Err(FrameError::Invalid(format!(
                "a frame of {} bytes, over the limit of {MAX_FRAME_BYTES}",
                header.frame_len
            )));
        }
        if header.message_len > max_message_bytes {
            return Err(FrameError::Invalid(format!(
                "a message of {} bytes, over the limit of {max_message_bytes} (ULYSSES_TCP_MAX_MESSAGE_BYTES)",
                header.message_len
            )));
        }
        if u64::from(header.frame_len) > header.message_len {
            return Err(FrameError::Invalid("a frame longer than its message".into()));
        }
        Ok(header)
    }
}

/// Writes `payload` as one message: frames of at most [`MAX_FRAME_BYTES`] (at least one,
/// so an empty message still arrives).
pub fn write_message(writer: &mut impl Write, kind: Kind, op: u8, group: u64, seq: u64, payload: &[u8]) -> io::Result<()> {
    let message_len = payload.len() as u64;
    let mut chunks = payload.chunks(MAX_FRAME_BYTES).peekable();
    if chunks.peek().is_none() {
        let header = Header { kind, op, group, seq, message_len, frame_len: 0 };
        return writer.write_all(&header.encode());
    }
    for chunk in chunks {
        let header = Header { kind, op, group, seq, message_len, frame_len: chunk.len() as u32 };
        writer.write_all(&header.encode())?;
        writer.write_all(chunk)?;
    }
    Ok(())
}

/// Reads one whole message: its first header and the payload of all its frames. The payload
/// grows frame by frame, so a message never holds more than the frames that arrived.
pub fn read_message(reader: &mut impl Read, max_message_bytes: u64) -> Result<(Header, Vec<u8>), FrameError> {
    let first = read_header(reader, max_message_bytes, true)?;
    let mut payload = Vec::with_capacity((first.frame_len as usize).min(MAX_FRAME_BYTES));
    let mut header = first;
    loop {
        let start = payload.len();
        payload.resize(start + header.frame_len as usize, 0);
        reader.read_exact(&mut payload[start..])?;
        if payload.len() as u64 >= first.message_len {
            return Ok((first, payload));
        }
        header = read_header(reader, max_message_bytes, false)?;
        let continues = header.kind == first.kind && header.group == first.group && header.seq == first.seq;
        if !continues || header.message_len != first.message_len {
            return Err(FrameError::Invalid("a message's frames were interleaved with another message".into()));
        }
        if payload.len() as u64 + u64::from(header.frame_len) > first.message_len {
            return Err(FrameError::Invalid("a message's frames hold more than its length".into()));
        }
        // Every frame after the first brings bytes: empty ones would keep a message coming forever.
        if header.frame_len == 0 {
            return Err(FrameError::Invalid("an empty frame inside a message that is not whole".into()));
        }
    }
}

fn read_header(reader: &mut impl Read, max_message_bytes: u64, first: bool) -> Result<Header, FrameError> {
    let mut bytes = [0u8; HEADER_BYTES];
    match reader.read_exact(&mut bytes) {
        Err(error) if error.kind() == io::ErrorKind::UnexpectedEof && first => return Err(FrameError::Closed),
        other => other?,
    }
    Header::decode(&bytes, max_message_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_across_frames() {
        for len in [0, 1, MAX_FRAME_BYTES, MAX_FRAME_BYTES + 7, 3 * MAX_FRAME_BYTES] {
            let payload: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let mut wire = Vec::new();
            write_message(&mut wire, Kind::Data, 2, 9, 41, &payload).unwrap();
            let frames = len.div_ceil(MAX_FRAME_BYTES).max(1);
            assert_eq!(wire.len(), frames * HEADER_BYTES + len);
            let (header, got) = read_message(&mut wire.as_slice(), u64::MAX).unwrap();
            assert_eq!((header.kind, header.op, header.group, header.seq, header.message_len), (Kind::Data, 2, 9, 41, len as u64));
            assert_eq!(got, payload);
        }
    }

    #[test]
    fn oversized_and_garbage_headers_are_refused_before_reading_the_payload() {
        let mut wire = Vec::new();
        write_message(&mut wire, Kind::Data, 0, 0, 0, &[7u8; 100]).unwrap();
        let error = read_message(&mut wire.as_slice(), 99).unwrap_err().to_string();
        assert!(error.contains("a message of 100 bytes, over the limit of 99"), "{error}");

        let mut forged = Header { kind: Kind::Data, op: 0, group: 0, seq: 0, message_len: 1 << 40, frame_len: u32::MAX }.encode().to_vec();
        forged.extend([0u8; 16]);
        let error = read_message(&mut forged.as_slice(), u64::MAX).unwrap_err().to_string();
        assert!(error.contains("over the limit of 4194304"), "{error}");

        let error = read_message(&mut [0x47u8; 64].as_slice(), u64::MAX).unwrap_err().to_string();
        assert!(error.contains("magic"), "{error}");
        assert!(matches!(read_message(&mut [].as_slice(), u64::MAX), Err(FrameError::Closed)));
    }

    #[test]
    fn a_message_cut_short_is_an_error() {
        let mut wire = Vec::new();
        write_message(&mut wire, Kind::Data, 0, 0, 0, &vec![1u8; MAX_FRAME_BYTES + 10]).unwrap();
        wire.truncate(wire.len() - 5);
        assert!(matches!(read_message(&mut wire.as_slice(), u64::MAX), Err(FrameError::Io(_))));
    }

    /// Empty frames after a message's first, before it is whole, are refused: a peer sending
    /// them one after another (anything on the network may dial a rank) kept the read going
    /// forever.
    #[test]
    fn an_empty_frame_inside_a_message_is_refused() {
        let header = |frame_len: u32| Header { kind: Kind::Hello, op: 0, group: 0, seq: 0, message_len: 4, frame_len }.encode().to_vec();
        let mut wire = header(2);
        wire.extend([1u8, 2]);
        for _ in 0..3 {
            wire.extend(header(0));
        }
        let error = read_message(&mut wire.as_slice(), u64::MAX).unwrap_err().to_string();
        assert!(error.contains("an empty frame inside a message that is not whole"), "{error}");
    }
}
