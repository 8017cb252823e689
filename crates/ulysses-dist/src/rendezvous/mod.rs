//! The rendezvous: rank 0 serves a key-value store on `MASTER_ADDR:MASTER_PORT`; every rank
//! (rank 0 included) connects to it with the job's token. The ranks use it to share the
//! NCCL unique id, to meet at barriers, and to learn which rank died when a collective
//! stalls.

mod client;
pub mod protocol;
mod server;
mod watch;

use std::{sync::Mutex, time::Duration};

pub use client::RendezvousClient;
pub use server::{RendezvousServer, ServerSettings};
pub use watch::{LeftRanks, PeerLoss, PeerWatch};

use crate::{DistError, DistributedConfig, LaunchEnv};

/// The longest [`Rendezvous::report_failure`] on a rank other than 0 waits for rank 0's server
/// (rank 0 serves its own failure the whole rendezvous timeout).
const REPORT_TIMEOUT_SECS: f64 = 30.0;

/// Whether this process has tried to join a job's rendezvous ([`Rendezvous::join`]).
static JOIN_TRIED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether this process has tried to join a job's rendezvous: a failure before it is said to
/// the job with [`Rendezvous::report_failure`]; one in or after the join is not (a join that
/// timed out would only time out again).
pub fn join_tried() -> bool {
    JOIN_TRIED.load(std::sync::atomic::Ordering::Relaxed)
}

/// This rank's membership of the job's rendezvous.
pub struct Rendezvous {
    client: Option<Mutex<RendezvousClient>>,
    world_size: usize,
    linger: Duration,
    server: Option<RendezvousServer>,
}

impl Rendezvous {
    /// Joins the job described by `env`; rank 0 also starts the server. Returns once every
    /// rank has joined, or fails after the rendezvous timeout.
    pub fn join(env: &LaunchEnv, config: &DistributedConfig) -> Result<Self, DistError> {
        let rendezvous = Self::connect(env, config)?;
        match rendezvous.meet_every_rank() {
            Ok(()) => Ok(rendezvous),
            // A rank that failed before the job said why; rank 0 serves that to the ranks still
            // on their way (its drop would serve only those already there).
            Err(left @ DistError::WriterLeft { .. }) => {
                rendezvous.serve_until_every_rank_came_and_left();
                Err(left)
            }
            Err(other) => Err(other),
        }
    }

    /// Leaves (a goodbye), and where this is rank 0 serves on until every rank of the world
    /// has joined and left, at most the rendezvous timeout.
    fn serve_until_every_rank_came_and_left(mut self) {
        drop(self.client.take());
        if let Some(server) = self.server.take() {
            server.wait_until_every_rank_came_and_left(self.world_size, self.linger);
        }
    }

    /// Connects to the job's rendezvous (rank 0 starts its server first), meeting no one.
    fn connect(env: &LaunchEnv, config: &DistributedConfig) -> Result<Self, DistError> {
        JOIN_TRIED.store(true, std::sync::atomic::Ordering::Relaxed);
        // A config built or read by hand: its timeouts and limits checked before they are used
        // (an infinite timeout panicked in `Duration`; 0 failed every wait, blamed on a peer).
        config.validate()?;
        let token = &run_token(config.require_token()?, env.source == crate::env::EnvSource::Slurm, |name| std::env::var(name).ok());
        let timeout = config.rendezvous_timeout();
        // Refused at once on the other nodes' ranks, which would wait out the timeout; on rank
        // 0's node (its ranks come first) it is the way there (Kubeflow's master pod is given
        // `localhost`).
        if env.spans_nodes() && env.rank >= env.local_world_size && crate::env::is_this_machine_only(&env.master_addr) {
            return Err(DistError::Env(format!(
                "MASTER_ADDR {} is this machine alone, but the job has {} ranks and this node {} (LOCAL_WORLD_SIZE): ranks on \
                 other nodes cannot reach it; set MASTER_ADDR to node 0's network address",
                env.master_addr, env.world_size, env.local_world_size
            )));
        }
        let server = (env.rank == 0)
            .then(|| {
                let settings = ServerSettings {
                    world_size: env.world_size,
                    token: token.to_string(),
                    max_message_bytes: config.max_message_bytes,
                    handshake_timeout: Duration::from_secs(10),
                };
                // Across nodes, every interface, as torch's store listens (the token guards it):
                // a host name that /etc/hosts maps to 127.0.1.1 here (Debian's default) would
                // bind loopback, out of the other nodes' reach; so where the launcher did not say
                // how many ranks this node runs (a PyTorchJob's pods). On one node, MASTER_ADDR's.
                let bind = match env.spans_nodes() || !env.node_size_known {
                    true => crate::env::every_interface_for(&env.master_addr),
                    // An IPv6 address as MASTER_ADDR takes (`[fd00::1]`) binds without its brackets.
                    false => crate::env::bare_host(&env.master_addr),
                };
                RendezvousServer::start(bind, env.master_port, settings)
            })
            .transpose()?;
        let client = RendezvousClient::connect(
            &env.master_addr,
            env.master_port,
            env.rank,
            env.world_size,
            token,
            timeout,
            config.max_message_bytes,
        )?;
        Ok(Self { client: Some(Mutex::new(client)), world_size: env.world_size, linger: timeout, server })
    }

    /// Waits until every rank of the world has connected (the barrier "joined").
    fn meet_every_rank(&self) -> Result<(), DistError> {
        let world_size = self.world_size;
        self.client().barrier("joined", world_size).map_err(|error| match error {
            DistError::RendezvousTimeout { addr, after, waiting_for } => DistError::RendezvousTimeout {
                addr,
                after,
                waiting_for: format!("waiting for all {world_size} ranks to join, {waiting_for}"),
            },
            other => other,
        })
    }

    /// For a rank that failed before it joined the job (its data, its run folder): connects to
    /// the rendezvous, says `reason`, and leaves. A rank that waits for what this one would
    /// have published (its place at the join's barrier first) names it and `reason` at once,
    /// where it waited out the rendezvous timeout for a rank that never came, and said not why.
    pub fn report_failure(env: &LaunchEnv, config: &DistributedConfig, reason: &str) -> Result<(), DistError> {
        Self::report_failure_within(env, config, reason, Duration::from_secs_f64(REPORT_TIMEOUT_SECS))
    }

    /// [`report_failure`](Self::report_failure), a rank other than 0 waiting at most `bound`
    /// (and the rendezvous timeout) for rank 0's server: a rank 0 that died before it served
    /// must not hold a failed rank for the whole timeout. Rank 0 serves the reason until every
    /// rank has joined and left, up to the whole timeout: the others may take minutes (reading
    /// data, loading a model) before they join, and find no server once it is gone.
    #[doc(hidden)]
    pub fn report_failure_within(env: &LaunchEnv, config: &DistributedConfig, reason: &str, bound: Duration) -> Result<(), DistError> {
        let config = match env.rank {
            0 => config.clone(),
            _ => config.clone().with_rendezvous_timeout_secs(config.rendezvous_timeout().min(bound).as_secs_f64()),
        };
        let rendezvous = Self::connect(env, &config)?;
        // Said before any wait, then gone (no barrier: a peer that failed too would end it): a
        // rank that waits at the join for this one's place learns why at once.
        rendezvous.client().set_failure(reason)?;
        rendezvous.serve_until_every_rank_came_and_left();
        Ok(())
    }

    pub fn rank(&self) -> usize {
        self.client().rank()
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Rank `root` publishes `value` under `key`; every rank returns it.
    pub fn broadcast(&self, key: &str, value: Option<&[u8]>, root: usize) -> Result<Vec<u8>, DistError> {
        let mut client = self.client();
        if client.rank() == root {
            let value = value.ok_or_else(|| DistError::Protocol(format!("rank {root} broadcasts {key:?} but gave no value")))?;
            client.set(key, value)?;
        }
        client.get_set_by(key, root)
    }

    /// Stores `value` under `key` for every rank to read.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), DistError> {
        self.client().set(key, value)
    }

    /// The value of `key`, waiting until some rank sets it (at most the rendezvous timeout).
    /// Where one rank sets it, [`get_set_by`](Self::get_set_by) stops as soon as that rank
    /// has left without.
    pub fn get(&self, key: &str) -> Result<Vec<u8>, DistError> {
        self.client().get(key)
    }

    /// The value of `key`, which rank `writer` sets: waits until it does (at most the
    /// rendezvous timeout), fails at once naming it if it left the job without.
    pub fn get_set_by(&self, key: &str, writer: usize) -> Result<Vec<u8>, DistError> {
        self.client().get_set_by(key, writer)
    }

    /// The IP address of this machine that reaches rank 0 (the local end of the rendezvous
    /// connection): what other ranks can connect to.
    pub fn local_ip(&self) -> std::io::Result<String> {
        self.client().local_addr().map(|addr| addr.ip().to_string())
    }

    pub fn barrier(&self, name: &str) -> Result<(), DistError> {
        self.client().barrier(name, self.world_size)
    }

    /// Ranks that died (their connection closed without a goodbye).
    pub fn departed(&self) -> Result<Vec<usize>, DistError> {
        self.client().departed()
    }

    /// Ranks that left the job: died, or finished (said goodbye). What a [`PeerWatch`] reads.
    pub fn left(&self) -> Result<LeftRanks, DistError> {
        self.client().left()
    }

    /// [`left`](Self::left), rank 0's answer awaited at most `limit`
    /// ([`RendezvousClient::left_within`]).
    pub fn left_within(&self, limit: std::time::Duration) -> Result<LeftRanks, DistError> {
        self.client().left_within(limit)
    }

    fn client(&self) -> std::sync::MutexGuard<'_, RendezvousClient> {
        let client = self.client.as_ref().expect("the client lives until drop");
        client.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Rendezvous {
    fn drop(&mut self) {
        // Say goodbye first; rank 0 then serves until the others have too.
        drop(self.client.take());
        if let Some(server) = self.server.take() {
            server.wait_until_all_left(self.linger);
        }
    }
}

/// The job's token joined with what tells this run from another of the same job (a Slurm
/// job's steps share the batch script's token): `ULYSSES_RUN_ID`, else, where the ranks are an
/// srun step's own tasks (`srun_tasks`: one step holds them all), the Slurm job and step. Two
/// runs that meet at one port (steps of a sweep, a port fixed by a template) are then refused,
/// not merged into one world. A run whose ranks come from several steps (an `srun` a node, each
/// starting a launcher) sets one `ULYSSES_RUN_ID`, or relies on the token alone.
fn run_token(token: &str, srun_tasks: bool, lookup: impl Fn(&str) -> Option<String>) -> String {
    let var = |name: &str| lookup(name).filter(|value| !value.trim().is_empty());
    let step = || var("SLURM_STEP_ID").or_else(|| var("SLURM_STEPID"));
    let run = var("ULYSSES_RUN_ID").or_else(|| srun_tasks.then(|| Some(format!("slurm {}.{}", var("SLURM_JOB_ID")?, step()?))).flatten());
    match run {
        Some(run) => format!("{token} ({run})"),
        None => token.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::run_token;

    #[test]
    fn two_steps_of_a_slurm_job_have_tokens_of_their_own() {
        let of_ranks = |srun_tasks, vars: &[(&str, &str)]| run_token("secret", srun_tasks, |name| vars.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string()));
        let of = |vars: &[(&str, &str)]| of_ranks(true, vars);
        let step = |id| of(&[("SLURM_JOB_ID", "4242"), ("SLURM_STEP_ID", id)]);
        assert_ne!(step("0"), step("1"));
        assert_eq!(step("0"), step("0"));
        // Ranks that are not one step's tasks (a launcher an srun a node): the token alone.
        assert_eq!(of_ranks(false, &[("SLURM_JOB_ID", "4242"), ("SLURM_STEP_ID", "1")]), "secret");
        // The batch script (no step), a machine without Slurm: the token alone.
        assert_eq!(of(&[("SLURM_JOB_ID", "4242")]), "secret");
        assert_eq!(of(&[]), "secret");
        assert_ne!(of(&[("ULYSSES_RUN_ID", "a")]), of(&[("ULYSSES_RUN_ID", "b")]));
    }
}

/// A fresh random token (32 hex digits) for a job.
pub fn new_token() -> String {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).expect("the operating system has no random source");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
