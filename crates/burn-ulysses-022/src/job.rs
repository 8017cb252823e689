//! Starting the ranks of a burn 0.22 sequence-parallel job: one process per rank under a
//! launcher (`ulysses-launch`, torchrun, srun; the ranks meet over TCP), or, with no launcher,
//! every rank as a thread of this process. Either way each rank runs `work` with its group
//! entered ([`context::enter`]), so [`attention`](crate::attention()) and [`train`](crate::train)
//! find it.
//!
//! ```no_run
//! use burn_ulysses_022::job::{Launch, run_ranks};
//! use ulysses_core::dist::DistributedConfig;
//!
//! let launch = Launch::from_env().unwrap();
//! let losses = run_ranks(&launch, 4, &DistributedConfig::new().with_env_overrides().unwrap(), |rank| {
//!     // build the model, train on this rank's shard (rank.rank of rank.size)
//!     rank.rank
//! });
//! ```

use std::sync::Arc;

use ulysses_core::{
    comm::{HostCommunicator, ThreadGroup, ThreadGroupConfig},
    dist::{DistError, DistributedConfig, tcp::TcpCommunicator},
};

pub use ulysses_core::dist::Launch;

use crate::context;

/// One rank of a running job, handed to the work of [`run_ranks`].
pub struct Rank {
    /// This rank's index in the sequence-parallel group.
    pub rank: usize,
    pub size: usize,
    /// Whether the ranks are processes (one each) rather than threads of this process.
    pub is_process: bool,
    pub communicator: Arc<dyn HostCommunicator>,
}

/// Runs `work` on every rank this process holds, with the rank's group entered, and returns
/// the results in rank order: one per thread, or the one of this process. With threads the
/// group has `threads` ranks; a launched job's world is one group of `WORLD_SIZE` ranks.
pub fn run_ranks<R: Send>(launch: &Launch, threads: usize, dist: &DistributedConfig, work: impl Fn(&Rank) -> R + Sync) -> Result<Vec<R>, DistError> {
    dist.validate()?;
    let run = |communicator: Arc<dyn HostCommunicator>, is_process: bool| {
        let _group = context::enter(communicator.clone());
        work(&Rank { rank: communicator.rank(), size: communicator.size(), is_process, communicator })
    };
    match launch {
        Launch::Threads => {
            if threads == 0 {
                return Err(DistError::Job("a job of rank threads needs at least one rank; ask for 1 or more".into()));
            }
            let config = ThreadGroupConfig::new(threads).with_timeout_secs(dist.collective_timeout_secs);
            ThreadGroup::from_config(&config)
                .run(|thread| run(thread.communicator(), false))
                .into_iter()
                .map(|result| result.map_err(|panic| DistError::Job(panic.to_string())))
                .collect()
        }
        Launch::Process(env) => {
            let communicator = TcpCommunicator::connect(env, dist)?;
            Ok(vec![run(communicator, true)])
        }
    }
}
