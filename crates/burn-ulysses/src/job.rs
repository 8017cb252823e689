//! Starting the ranks of a job, the same way for any model: one process per device under a
//! launcher (`ulysses-launch`, torchrun, srun), or, with no launcher, every rank as a thread
//! of this process.
//!
//! [`run_ranks`] gives `work` a [`Rank`] whose groups are built and whose rank context is
//! entered, so `UlyssesBackend` attention and the training API find the SP group:
//!
//! ```no_run
//! use burn::backend::{Autodiff, NdArray};
//! use burn_ulysses::{ParallelLayout, UlyssesBackend};
//! use burn_ulysses::job::{JobOptions, Launch, Tcp, run_ranks};
//! use ulysses_dist::DistributedConfig;
//!
//! let launch = Launch::from_env().unwrap();
//! let layout = ParallelLayout::new().with_sp_size(2).with_dp_size(launch.world_size().unwrap_or(2) / 2);
//! let options = JobOptions::new(layout, DistributedConfig::new().with_env_overrides().unwrap());
//! let losses = run_ranks::<NdArray, Tcp, _>(&launch, &options, |_index| Default::default(), |rank| {
//!     // build the model on UlyssesBackend<Autodiff<NdArray>> and train with rank.groups
//!     rank.world_rank
//! });
//! ```

use std::sync::Arc;

use burn::tensor::backend::Backend;
pub use ulysses_dist::Launch;
use ulysses_dist::{DistError, DistributedConfig, LaunchEnv, tcp::TcpCommunicator};

use crate::{
    ParallelGroups, ParallelLayout, RankScope, UlyssesConfig,
    comm::{Communicator, HostStaged, ThreadGroup, ThreadGroupConfig},
    context,
};

/// How a process joins the other processes of its job: builds this rank's world communicator
/// over tensors of the wire backend `W`.
pub trait Transport<W: Backend> {
    fn connect(env: &LaunchEnv, config: &DistributedConfig, device: &W::Device) -> Result<Arc<dyn Communicator<W>>, DistError>;
}

/// Collectives over TCP ([`TcpCommunicator`]), each tensor staged through host memory
/// ([`HostStaged`]): any backend, meant for CPUs and tests.
pub struct Tcp;

impl<W: Backend> Transport<W> for Tcp {
    fn connect(env: &LaunchEnv, config: &DistributedConfig, _device: &W::Device) -> Result<Arc<dyn Communicator<W>>, DistError> {
        Ok(HostStaged::new(TcpCommunicator::connect(env, config)?))
    }
}

/// What every rank of a job is started with.
#[derive(Debug, Clone)]
pub struct JobOptions {
    pub layout: ParallelLayout,
    pub dist: DistributedConfig,
    pub ulysses: UlyssesConfig,
    /// The device index of every rank: `None` means `LOCAL_RANK` for processes (one device
    /// each; 0 where `CUDA_VISIBLE_DEVICES` shows the process one) and device 0 for threads
    /// (which share it).
    pub device_index: Option<usize>,
}

impl JobOptions {
    pub fn new(layout: ParallelLayout, dist: DistributedConfig) -> Self {
        Self { layout, dist, ulysses: UlyssesConfig::new(), device_index: None }
    }

    /// The device index this process's ranks run on under `launch`.
    pub fn device_index_of(&self, launch: &Launch) -> usize {
        self.device_index.unwrap_or(match launch {
            Launch::Process(env) => env.device_index(),
            Launch::Threads => 0,
        })
    }
}

/// One rank of a running job, handed to the work of [`run_ranks`].
pub struct Rank<W: Backend> {
    pub world_rank: usize,
    pub world_size: usize,
    /// Rank among the processes (or threads) of this node.
    pub local_rank: usize,
    /// Whether the ranks are processes (one each) rather than threads of this process.
    pub is_process: bool,
    pub groups: ParallelGroups<W>,
    pub device: W::Device,
}

/// Runs `work` on every rank this process holds, with the rank's groups built and its rank
/// context entered (thread scope for threads, process scope for a process), and returns the
/// results in rank order: one per thread, or the one of this process.
///
/// `device(index)` makes the device of an index: for processes `LOCAL_RANK` unless
/// [`JobOptions::device_index`] says otherwise. A process rank joins its job through the
/// transport `T`.
pub fn run_ranks<W, T, R>(
    launch: &Launch,
    options: &JobOptions,
    device: impl Fn(usize) -> W::Device + Sync,
    work: impl Fn(&Rank<W>) -> R + Sync,
) -> Result<Vec<R>, DistError>
where
    W: Backend,
    T: Transport<W>,
    R: Send,
{
    options.dist.validate()?;
    let layout = options.layout;
    check_sp_size_variable(&layout, std::env::var(ulysses_dist::config::ENV_SP_SIZE).ok())?;
    // The 0.22 crate's degree, set on the config: here it would be ignored without a word.
    if options.dist.sp_size != 1 && options.dist.sp_size != layout.sp_size {
        return Err(DistError::Job(format!(
            "DistributedConfig::sp_size is {} but the job's layout has sp {}: these jobs take the sequence-parallel degree from \
             JobOptions::layout (ParallelLayout::with_sp_size); build the layout with sp {}, and leave the config's at 1",
            options.dist.sp_size, layout.sp_size, options.dist.sp_size
        )));
    }
    match launch {
        Launch::Threads => {
            // A degree of 0 (`dp = world / sp` with world < sp) named, not a group of no rank.
            layout.check().map_err(|e| DistError::Job(e.to_string()))?;
            let config = ThreadGroupConfig::new(layout.world_size()).with_timeout_secs(options.dist.collective_timeout_secs);
            let device = device(options.device_index_of(launch));
            let results = ThreadGroup::from_config(&config).run(|thread| -> Result<R, DistError> {
                let groups = ParallelGroups::new(thread.communicator(), layout).map_err(|e| DistError::Job(e.to_string()))?;
                let rank = Rank {
                    world_rank: thread.rank(),
                    world_size: thread.size(),
                    local_rank: thread.rank(),
                    is_process: false,
                    groups,
                    device: device.clone(),
                };
                let _context = context::enter(RankScope::Thread, rank.groups.rank_context(options.ulysses.clone()));
                Ok(work(&rank))
            });
            ulysses_dist::first_cause(results)
        }
        Launch::Process(env) => {
            if env.world_size != layout.world_size() {
                return Err(DistError::Job(format!(
                    "the launcher started {} processes (WORLD_SIZE) but the layout asks for sp {} × dp {} = {}; \
                     launch {} processes, or choose sp and dp whose product is {}",
                    env.world_size,
                    layout.sp_size,
                    layout.dp_size,
                    layout.world_size(),
                    layout.world_size(),
                    env.world_size
                )));
            }
            let device = device(options.device_index_of(launch));
            let world = T::connect(env, &options.dist, &device)?;
            let groups = ParallelGroups::new(world, layout).map_err(|e| DistError::Job(e.to_string()))?;
            let rank = Rank {
                world_rank: env.rank,
                world_size: env.world_size,
                local_rank: env.local_rank,
                is_process: true,
                groups,
                device,
            };
            let _context = context::enter(RankScope::Process, rank.groups.rank_context(options.ulysses.clone()));
            Ok(vec![work(&rank)])
        }
    }
}

/// Refuses a launcher's `ULYSSES_SP_SIZE` (`value`) that names another SP degree than
/// `layout`'s: these jobs take theirs from the layout (the 0.22 crate's from the variable), so
/// a job script's degree would be ignored without a word.
fn check_sp_size_variable(layout: &ParallelLayout, value: Option<String>) -> Result<(), DistError> {
    match ulysses_dist::config::sp_size_variable_other_than(layout.sp_size, value) {
        Some(value) => Err(DistError::Job(format!(
            "ULYSSES_SP_SIZE={value} but the job's layout has sp {}: these jobs take the sequence-parallel degree from \
             JobOptions::layout (ParallelLayout::with_sp_size); build the layout with sp {value}, or unset ULYSSES_SP_SIZE",
            layout.sp_size
        ))),
        None => Ok(()),
    }
}

#[cfg(all(test, feature = "ndarray"))]
mod tests {
    use burn::backend::NdArray;

    use super::*;

    /// A layout with a degree of 0 (`dp = world / sp` where the world is smaller than sp) is an
    /// error naming it, as a process launch's is, not a panic of a group of no rank.
    #[test]
    fn a_layout_with_a_degree_of_0_is_an_error_on_threads() {
        let options = JobOptions::new(ParallelLayout::new().with_sp_size(4).with_dp_size(0), DistributedConfig::new());
        let error = run_ranks::<NdArray, Tcp, ()>(&Launch::Threads, &options, |_| Default::default(), |_| ()).err().expect("refused");
        assert!(error.to_string().contains("dp_size must be at least 1"), "{error}");
        // An SP degree set on the config (the 0.22 crate's place for it) rather than the layout.
        let options = JobOptions::new(ParallelLayout::new(), DistributedConfig::new().with_sp_size(4));
        let error = run_ranks::<NdArray, Tcp, ()>(&Launch::Threads, &options, |_| Default::default(), |_| ()).err().expect("refused");
        assert!(error.to_string().contains("DistributedConfig::sp_size is 4 but the job's layout has sp 1"), "{error}");
    }

    /// A job script's `ULYSSES_SP_SIZE` that the layout does not follow is refused by name; one
    /// that agrees (or none) passes.
    #[test]
    fn an_sp_size_variable_the_layout_does_not_follow_is_refused() {
        let layout = ParallelLayout::new().with_sp_size(2).with_dp_size(2);
        let error = check_sp_size_variable(&layout, Some("4".into())).err().expect("refused");
        assert!(error.to_string().contains("ULYSSES_SP_SIZE=4 but the job's layout has sp 2"), "{error}");
        assert!(check_sp_size_variable(&layout, Some("two".into())).is_err());
        assert!(check_sp_size_variable(&layout, Some(" 2".into())).is_ok());
        assert!(check_sp_size_variable(&layout, None).is_ok());
    }

    /// A rank that fails stops the others in their next collective: the error returned is its
    /// own, not rank 0's report that it left.
    #[test]
    fn the_failing_ranks_error_is_returned_not_the_others_reports_of_it() {
        let options = JobOptions::new(ParallelLayout::new().with_sp_size(2), DistributedConfig::new());
        let error = run_ranks::<NdArray, Tcp, ()>(&Launch::Threads, &options, |_| Default::default(), |rank| {
            assert!(rank.world_rank == 0, "rank 1's own failure");
            rank.groups.world.barrier().unwrap();
        })
        .err()
        .expect("a rank failed");
        assert!(error.to_string().contains("rank 1's own failure"), "{error}");
    }
}
