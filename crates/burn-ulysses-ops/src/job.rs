//! Starting the ranks of a burn 0.22 job: one process per rank under a launcher
//! (`ulysses-launch`, torchrun, srun; the ranks meet over TCP), or, with no launcher, every
//! rank as a thread of this process. `world = sp × dp`: consecutive ranks form a
//! sequence-parallel group (as in burn-ulysses), and each group of `sp` ranks trains on its
//! own part of the batch. Each rank runs `work` with its groups entered
//! ([`context::enter_groups`]), so [`attention`](crate::attention()) and [`train`](crate::train)
//! find them.
//!
//! ```no_run
//! use burn_ulysses_ops::job::{Launch, run_ranks};
//! use ulysses_dist::DistributedConfig;
//!
//! let launch = Launch::from_env().unwrap();
//! // SP groups of 2 (ULYSSES_SP_SIZE overrides); 4 threads without a launcher: SP 2 × DP 2.
//! let dist = DistributedConfig::new().with_sp_size(2).with_env_overrides().unwrap();
//! let losses = run_ranks(&launch, 4, &dist, |rank| {
//!     // build the model, train on shard rank.sp_rank of replica rank.dp_rank's sequences
//!     rank.rank
//! });
//! ```

use std::sync::Arc;

use ulysses_core::{
    comm::{HostCommunicator, ThreadGroup, ThreadGroupConfig, all_gather_host_checked},
    layout::{check_layouts_agree, dp_size_of_world, dp_sp_coordinates},
};
use ulysses_dist::{DistError, DistributedConfig, tcp::TcpCommunicator};

pub use ulysses_dist::Launch;

use crate::context::{self, Groups};

/// One rank of a running job, handed to the work of [`run_ranks`].
pub struct Rank {
    /// This rank's index in the job, `0..size`.
    pub rank: usize,
    pub size: usize,
    /// Its index in its sequence-parallel group, and the group's size.
    pub sp_rank: usize,
    pub sp_size: usize,
    /// Which data-parallel replica (sequence-parallel group) it belongs to, of how many.
    pub dp_rank: usize,
    pub dp_size: usize,
    /// Whether the ranks are processes (one each) rather than threads of this process.
    pub is_process: bool,
    pub groups: Groups,
}

/// Runs `work` on every rank this process holds, with the rank's groups entered, and returns
/// the results in rank order: one per thread, or the one of this process. The job has
/// `threads` ranks as threads, or `WORLD_SIZE` under a launcher; `dist.sp_size` ranks form
/// each sequence-parallel group and must divide it.
pub fn run_ranks<R: Send>(launch: &Launch, threads: usize, dist: &DistributedConfig, work: impl Fn(&Rank) -> R + Sync) -> Result<Vec<R>, DistError> {
    dist.validate()?;
    let world_size = launch.world_size().unwrap_or(threads);
    let sp = dist.sp_size;
    let dp = dp_size_of_world(world_size, sp).map_err(|e| DistError::Job(format!("{e} (ULYSSES_SP_SIZE / DistributedConfig::sp_size)")))?;
    let run = |world: Arc<dyn HostCommunicator>, is_process: bool| -> Result<R, DistError> {
        let rank = world.rank();
        let sequence = sequence_group(&*world, sp, dp)?;
        let (dp_rank, sp_rank) = dp_sp_coordinates(rank, sp);
        let groups = Groups { sequence, world };
        // A process is one rank: every thread of it sees its groups.
        let _groups = if is_process { context::enter_process(groups.clone()) } else { context::enter_groups(groups.clone()) };
        let rank = Rank { rank, size: world_size, sp_rank, sp_size: sp, dp_rank, dp_size: dp, is_process, groups };
        Ok(work(&rank))
    };
    match launch {
        Launch::Threads => {
            let config = ThreadGroupConfig::new(threads).with_timeout_secs(dist.collective_timeout_secs);
            let results = ThreadGroup::from_config(&config).run(|thread| run(thread.communicator(), false));
            ulysses_dist::first_cause(results)
        }
        Launch::Process(env) => Ok(vec![run(TcpCommunicator::connect(env, dist)?, true)?]),
    }
}

/// This rank's sequence-parallel group of `world`, split by `sp` (and `dp`, what it leaves of
/// the world) once every rank is known to have been given the same (collective).
fn sequence_group(world: &dyn HostCommunicator, sp: usize, dp: usize) -> Result<Arc<dyn HostCommunicator>, DistError> {
    let layouts = all_gather_host_checked(world, &[sp as u64, dp as u64, 1, 0], "the parallel layout").map_err(|e| DistError::Job(format!("forming the sequence-parallel groups: {e}")))?;
    check_layouts_agree(&layouts, "the same ULYSSES_SP_SIZE on every node, or DistributedConfig::sp_size").map_err(|e| DistError::Job(e.to_string()))?;
    let (dp_rank, sp_rank) = dp_sp_coordinates(world.rank(), sp);
    world.split(dp_rank as u32, sp_rank as u32).map_err(|e| DistError::Job(format!("forming the sequence-parallel groups: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ranks given different SP degrees (a node's ULYSSES_SP_SIZE) are refused on every rank,
    /// naming both layouts, before any group is formed.
    #[test]
    fn ranks_given_different_layouts_are_refused_on_every_rank() {
        let results = ThreadGroup::new(4).run(|thread| {
            let sp = if thread.rank() < 2 { 2 } else { 1 };
            sequence_group(&*thread.communicator(), sp, 4 / sp).map(|group| group.size())
        });
        for result in results {
            let error = result.expect("no rank panics").expect_err("refused").to_string();
            assert!(error.contains("rank 0 sp 2 × dp 2, rank 2 sp 1 × dp 4") && error.contains("ULYSSES_SP_SIZE"), "{error}");
        }
        let sizes = ThreadGroup::new(4).run(|thread| sequence_group(&*thread.communicator(), 2, 2).map(|group| group.size()).unwrap());
        assert_eq!(sizes.into_iter().map(|size| size.expect("no rank panics")).collect::<Vec<_>>(), [2, 2, 2, 2]);
    }

    #[test]
    fn a_world_the_sp_size_does_not_divide_is_refused_with_the_rule_of_burn_ulysses() {
        let dist = DistributedConfig::new().with_sp_size(2);
        let error = run_ranks(&Launch::Threads, 3, &dist, |rank| rank.rank).unwrap_err().to_string();
        // The message of ulysses-core's rule, which burn-ulysses' ParallelLayout::for_world returns,
        // and where this job's SP size comes from.
        let rule = ulysses_core::layout::dp_size_of_world(3, 2).unwrap_err().to_string();
        assert!(error.starts_with(&rule) && error.ends_with("(ULYSSES_SP_SIZE / DistributedConfig::sp_size)"), "{error}");
        assert!(error.contains("3 ranks") && error.contains("[1, 3]"), "{error}");

        let ranks = run_ranks(&Launch::Threads, 4, &dist, |rank| (rank.rank, rank.sp_rank, rank.dp_rank, rank.dp_size)).unwrap();
        assert_eq!(ranks, [(0, 0, 0, 2), (1, 1, 0, 2), (2, 0, 1, 2), (3, 1, 1, 2)]);
    }
}
