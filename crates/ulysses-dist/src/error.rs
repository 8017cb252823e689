//! Why launching or joining a job failed.

use std::time::Duration;

/// Why launching or joining a job failed. Each variant names the fix.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    #[error("launch environment: {0}")]
    Env(String),
    #[error(
        "no rendezvous token: every rank must present the job's shared secret. ulysses-launch \
         sets ULYSSES_RENDEZVOUS_TOKEN itself; with torchrun or srun, export the same value to \
         every rank (e.g. `export ULYSSES_RENDEZVOUS_TOKEN=$(openssl rand -hex 16)`)"
    )]
    NoToken,
    #[error(
        "rank 0 cannot serve the rendezvous on {addr}: {reason}. MASTER_ADDR must be an address \
         of rank 0's machine and MASTER_PORT a free port (ulysses-launch's --master-port, or \
         MASTER_PORT in its environment; or set ULYSSES_RENDEZVOUS_PORT to one)"
    )]
    Bind { addr: String, reason: String },
    #[error(
        "rendezvous with {addr} timed out after {after:?} {waiting_for}. Is rank 0 running, and \
         are MASTER_ADDR/MASTER_PORT the same on every rank? Raise ULYSSES_RENDEZVOUS_TIMEOUT \
         if ranks start slowly"
    )]
    RendezvousTimeout { addr: String, after: Duration, waiting_for: String },
    #[error(
        "rank {rank} {} before publishing {key:?}, which this rank waits for: the job cannot \
         go on. Rank {rank}'s own log (or ulysses-launch's) says why",
        if *died { "died (its connection closed without a goodbye)" } else { "ended its process" }
    )]
    WriterLeft { rank: usize, key: String, died: bool },
    #[error("the rendezvous on {addr} refused this rank: {reason}")]
    Rejected { addr: String, reason: String },
    #[error("rendezvous protocol: {0}")]
    Protocol(String),
    #[error("ulysses-launch: {0}")]
    Launch(String),
    #[error("TCP transport: {0}")]
    Transport(String),
    #[error("{0}")]
    Job(String),
}
