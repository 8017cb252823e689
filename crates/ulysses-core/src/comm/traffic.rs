//! Byte counters, so tests and benches can check the communication volume.

use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes one rank handed to collectives, and how many calls it made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Bytes passed to `all_to_all`, the slice a rank keeps for itself included
    /// (what an NCCL all-to-all reads from the send buffer).
    pub all_to_all_bytes: u64,
    /// The part of `all_to_all_bytes` that went to other ranks.
    pub all_to_all_remote_bytes: u64,
    pub all_to_all_calls: u64,
    pub all_reduce_bytes: u64,
    pub all_reduce_calls: u64,
    pub all_gather_bytes: u64,
    /// Bytes passed to `reduce_scatter` (the whole tensor, every rank's part included).
    pub reduce_scatter_bytes: u64,
    pub reduce_scatter_calls: u64,
    pub broadcast_bytes: u64,
    /// Bytes `send_recv` sent to another rank.
    pub send_recv_bytes: u64,
    pub send_recv_calls: u64,
}

impl Traffic {
    /// Traffic between two snapshots.
    pub fn since(&self, earlier: &Traffic) -> Traffic {
        Traffic {
            all_to_all_bytes: self.all_to_all_bytes - earlier.all_to_all_bytes,
            all_to_all_remote_bytes: self.all_to_all_remote_bytes - earlier.all_to_all_remote_bytes,
            all_to_all_calls: self.all_to_all_calls - earlier.all_to_all_calls,
            all_reduce_bytes: self.all_reduce_bytes - earlier.all_reduce_bytes,
            all_reduce_calls: self.all_reduce_calls - earlier.all_reduce_calls,
            all_gather_bytes: self.all_gather_bytes - earlier.all_gather_bytes,
            reduce_scatter_bytes: self.reduce_scatter_bytes - earlier.reduce_scatter_bytes,
            reduce_scatter_calls: self.reduce_scatter_calls - earlier.reduce_scatter_calls,
            broadcast_bytes: self.broadcast_bytes - earlier.broadcast_bytes,
            send_recv_bytes: self.send_recv_bytes - earlier.send_recv_bytes,
            send_recv_calls: self.send_recv_calls - earlier.send_recv_calls,
        }
    }
}

/// Lock-free counters behind [`Traffic`], for communicator implementations.
#[derive(Debug, Default)]
pub struct TrafficCounter {
    all_to_all_bytes: AtomicU64,
    all_to_all_remote_bytes: AtomicU64,
    all_to_all_calls: AtomicU64,
    all_reduce_bytes: AtomicU64,
    all_reduce_calls: AtomicU64,
    all_gather_bytes: AtomicU64,
    reduce_scatter_bytes: AtomicU64,
    reduce_scatter_calls: AtomicU64,
    broadcast_bytes: AtomicU64,
    send_recv_bytes: AtomicU64,
    send_recv_calls: AtomicU64,
}

impl TrafficCounter {
    /// Records an all-to-all of `bytes` over a group of `size` ranks.
    pub fn record_all_to_all(&self, bytes: u64, size: usize) {
        self.record_all_to_all_parts(bytes, bytes / size as u64 * (size as u64 - 1));
    }

    /// Records an all-to-all (equal parts or not) that hands over `bytes`, of which
    /// `remote` go to other ranks.
    pub fn record_all_to_all_parts(&self, bytes: u64, remote: u64) {
        self.all_to_all_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.all_to_all_remote_bytes.fetch_add(remote, Ordering::Relaxed);
        self.all_to_all_calls.fetch_add(1, Ordering::Relaxed);
    }

    pub fn record_all_reduce(&self, bytes: u64) {
        self.all_reduce_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.all_reduce_calls.fetch_add(1, Ordering::Relaxed);
    }

    pub fn record_all_gather(&self, bytes: u64) {
        self.all_gather_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    pub fn record_reduce_scatter(&self, bytes: u64) {
        self.reduce_scatter_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.reduce_scatter_calls.fetch_add(1, Ordering::Relaxed);
    }

    pub fn record_broadcast(&self, bytes: u64) {
        self.broadcast_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Records a `send_recv` of `bytes`, which stay on this rank when `remote` is false.
    pub fn record_send_recv(&self, bytes: u64, remote: bool) {
        if remote {
            self.send_recv_bytes.fetch_add(bytes, Ordering::Relaxed);
        }
        self.send_recv_calls.fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> Traffic {
        Traffic {
            all_to_all_bytes: self.all_to_all_bytes.load(Ordering::Relaxed),
            all_to_all_remote_bytes: self.all_to_all_remote_bytes.load(Ordering::Relaxed),
            all_to_all_calls: self.all_to_all_calls.load(Ordering::Relaxed),
            all_reduce_bytes: self.all_reduce_bytes.load(Ordering::Relaxed),
            all_reduce_calls: self.all_reduce_calls.load(Ordering::Relaxed),
            all_gather_bytes: self.all_gather_bytes.load(Ordering::Relaxed),
            reduce_scatter_bytes: self.reduce_scatter_bytes.load(Ordering::Relaxed),
            reduce_scatter_calls: self.reduce_scatter_calls.load(Ordering::Relaxed),
            broadcast_bytes: self.broadcast_bytes.load(Ordering::Relaxed),
            send_recv_bytes: self.send_recv_bytes.load(Ordering::Relaxed),
            send_recv_calls: self.send_recv_calls.load(Ordering::Relaxed),
        }
    }
}
