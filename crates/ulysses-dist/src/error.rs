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
         go on. {}",
        if *died { "died (its connection closed without a goodbye)" } else { "ended its process" },
        match reason {
            Some(reason) => format!("It failed before the job began: {reason}"),
            None => format!("Rank {rank}'s own log (or ulysses-launch's) says why"),
        }
    )]
    WriterLeft { rank: usize, key: String, died: bool, reason: Option<String> },
    #[error("the rendezvous on {addr} refused this rank: {reason}")]
    Rejected { addr: String, reason: String },
    #[error("rendezvous protocol: {0}")]
    Protocol(String),
    #[error("ulysses-launch: {0}")]
    Launch(String),
    /// A rank of the launch failed: `exit_code` is what the launcher exits with, the rank's
    /// own status (128 + the signal that killed it, as a shell gives: 137 for the OOM killer's
    /// SIGKILL), so that a job script or scheduler can tell the causes apart.
    #[error("ulysses-launch: rank {rank} {how}")]
    RankFailed { rank: usize, how: String, exit_code: u8 },
    /// The launcher was interrupted (SIGINT, SIGHUP, SIGQUIT) by `signal`
    /// and stopped its ranks: it exits 128 + `signal`, as a shell reports a command the signal
    /// ended, so that a script's loop stops at a Ctrl-C rather than go on.
    #[error("ulysses-launch: interrupted (signal {signal}) {when}; the ranks were stopped")]
    Interrupted { signal: i32, when: String },
    #[error("TCP transport: {0}")]
    Transport(String),
    #[error("{0}")]
    Job(String),
}

/// The outcomes of a group's ranks run as threads, in rank order (each rank's result, or its
/// panic): every rank's value, or the error that stopped the group, a panic as
/// [`DistError::Job`]. A rank that fails stops the others in their next collective,
/// each reporting its departure ("rank 1 left the group ..."): the first error that is no such
/// report is the cause, returned over rank 0's report of it (the first error where every one
/// is a departure).
pub fn first_cause<R, P: std::fmt::Display>(results: Vec<Result<Result<R, DistError>, P>>) -> Result<Vec<R>, DistError> {
    let is_departure = |e: &DistError| DEPARTURE.iter().any(|said| e.to_string().contains(said));
    let mut values = Vec::with_capacity(results.len());
    let mut departure = None;
    for result in results {
        let result = result.map_err(|panic| DistError::Job(panic.to_string())).and_then(|r| r);
        match result {
            Ok(value) => values.push(value),
            Err(error) if is_departure(&error) => departure = departure.or(Some(error)),
            Err(cause) => return Err(cause),
        }
    }
    departure.map_or(Ok(values), Err)
}

/// What `ulysses_core::comm::CommError::PeerLeft` says of the rank that left: displayed, and
/// as a `.unwrap()` prints it.
const DEPARTURE: [&str; 2] = [" left the group (world rank ", "PeerLeft { peer: "];

impl DistError {
    /// Whether this rank failed because a peer did: it left before publishing what this rank
    /// waits for, or left the group (a collective's error, carried as text).
    pub fn is_peer_loss(&self) -> bool {
        match self {
            DistError::WriterLeft { .. } => true,
            DistError::Job(message) => DEPARTURE.iter().any(|said| message.contains(said)),
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use ulysses_core::comm::{Collective, CommError};

    use super::*;

    /// Rank 1 fails; rank 0, waiting in a collective, reports its departure: the cause is rank
    /// 1's error, not rank 0's report. Departures alone give the first.
    #[test]
    fn the_cause_is_returned_over_the_departures_it_caused() {
        let departed = || DistError::Job(CommError::PeerLeft { peer: 1, world_peer: 1, op: Collective::AllToAll, seq: 3 }.to_string());
        let outcome = first_cause::<(), String>(vec![Ok(Err(departed())), Err("rank 1's own failure".into()), Ok(Ok(()))]);
        assert_eq!(outcome.unwrap_err().to_string(), "rank 1's own failure");
        let unwrapped = format!("called `Result::unwrap()` on an `Err` value: {:?}", CommError::PeerLeft { peer: 1, world_peer: 1, op: Collective::Barrier, seq: 2 });
        let outcome = first_cause::<(), String>(vec![Err(unwrapped), Err("rank 1's own failure".into())]);
        assert_eq!(outcome.unwrap_err().to_string(), "rank 1's own failure");
        let outcome = first_cause::<(), String>(vec![Ok(Ok(())), Ok(Err(departed()))]);
        assert!(outcome.unwrap_err().to_string().contains("rank 1 left the group"));
        assert_eq!(first_cause::<_, String>(vec![Ok(Ok(1)), Ok(Ok(2))]).unwrap(), [1, 2]);
    }
}
