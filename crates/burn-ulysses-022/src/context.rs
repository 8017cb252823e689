//! Which group a rank belongs to. burn 0.22's ops are static functions of the backend, so the
//! exchange finds its group here: a thread-scoped slot that [`enter`] fills and its guard
//! restores. The group may use any transport: rank threads (`ThreadGroup`), or processes over
//! TCP (`ulysses_core::dist::tcp::TcpCommunicator`).

use std::{cell::RefCell, sync::Arc};

use ulysses_core::comm::HostCommunicator;

thread_local! {
    static GROUP: RefCell<Option<Arc<dyn HostCommunicator>>> = const { RefCell::new(None) };
}

/// Makes this thread a rank of `communicator`'s sequence-parallel group until the guard drops.
/// Enter once per rank (thread or process), before building the model; a group of one rank is
/// plain attention.
#[must_use = "the thread leaves the group when the guard drops"]
pub fn enter(communicator: Arc<dyn HostCommunicator>) -> GroupGuard {
    let previous = GROUP.with(|slot| slot.borrow_mut().replace(communicator));
    GroupGuard { previous }
}

/// The group entered on this thread, if any.
pub fn current() -> Option<Arc<dyn HostCommunicator>> {
    GROUP.with(|slot| slot.borrow().clone())
}

/// Restores the group that was entered before (usually none) when dropped.
pub struct GroupGuard {
    previous: Option<Arc<dyn HostCommunicator>>,
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        let previous = self.previous.take();
        GROUP.with(|slot| *slot.borrow_mut() = previous);
    }
}

/// The group this thread's exchange runs in: a clear panic when none was entered (backend
/// ops cannot return errors).
pub(crate) fn required(what: &str) -> Arc<dyn HostCommunicator> {
    current().unwrap_or_else(|| {
        panic!("{what} needs a sequence-parallel group: call burn_ulysses_022::context::enter(communicator) on each rank first (burn_ulysses_022::job::run_ranks does)")
    })
}
