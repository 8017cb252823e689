//! Which groups a rank belongs to. burn 0.22's ops are static functions of the backend, so the
//! exchange finds its group here: a thread-scoped slot that [`enter`] fills and its guard
//! restores. Two groups: the sequence-parallel one, which attention exchanges over, and the
//! one gradients and losses are summed over (the whole job: SP × DP ranks). The groups may use
//! any transport: rank threads (`ThreadGroup`), or processes over TCP
//! (`ulysses_dist::tcp::TcpCommunicator`).

use std::{cell::RefCell, sync::Arc};

use ulysses_core::comm::HostCommunicator;

/// A rank's groups.
#[derive(Clone)]
pub struct Groups {
    /// The ranks that hold parts of the same sequences: attention exchanges over them.
    pub sequence: Arc<dyn HostCommunicator>,
    /// Every rank of the job (sequence × data parallel): gradients and losses sum over them.
    pub world: Arc<dyn HostCommunicator>,
}

thread_local! {
    static GROUPS: RefCell<Option<Groups>> = const { RefCell::new(None) };
}

/// Makes this thread a rank of `communicator`'s sequence-parallel group, which is also the
/// whole job (no data parallelism), until the guard drops. Enter once per rank (thread or
/// process), before building the model; a group of one rank is plain attention.
#[must_use = "the thread leaves the group when the guard drops"]
pub fn enter(communicator: Arc<dyn HostCommunicator>) -> GroupGuard {
    enter_groups(Groups { sequence: communicator.clone(), world: communicator })
}

/// [`enter`] with a sequence-parallel group inside a larger job (SP × DP).
#[must_use = "the thread leaves the groups when the guard drops"]
pub fn enter_groups(groups: Groups) -> GroupGuard {
    let previous = GROUPS.with(|slot| slot.borrow_mut().replace(groups));
    GroupGuard { previous }
}

/// The sequence-parallel group entered on this thread, if any.
pub fn current() -> Option<Arc<dyn HostCommunicator>> {
    GROUPS.with(|slot| slot.borrow().as_ref().map(|groups| groups.sequence.clone()))
}

/// The group gradients and losses sum over on this thread, if any.
pub fn world() -> Option<Arc<dyn HostCommunicator>> {
    GROUPS.with(|slot| slot.borrow().as_ref().map(|groups| groups.world.clone()))
}

/// Restores the groups that were entered before (usually none) when dropped.
pub struct GroupGuard {
    previous: Option<Groups>,
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        let previous = self.previous.take();
        GROUPS.with(|slot| *slot.borrow_mut() = previous);
    }
}

/// The group this thread's exchange runs in: a clear panic when none was entered (backend
/// ops cannot return errors).
pub(crate) fn required(what: &str) -> Arc<dyn HostCommunicator> {
    current().unwrap_or_else(|| {
        panic!("{what} needs a sequence-parallel group: call burn_ulysses_ops::context::enter(communicator) on each rank first (burn_ulysses_ops::job::run_ranks does)")
    })
}
