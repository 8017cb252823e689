//! Which groups a rank belongs to. burn 0.22's ops are static functions of the backend, so the
//! exchange finds its group here: a thread-scoped slot that [`enter`] fills and its guard
//! restores. Two groups: the sequence-parallel one, which attention exchanges over, and the
//! one gradients and losses are summed over (the whole job: SP × DP ranks). The groups may use
//! any transport: rank threads (`ThreadGroup`), or processes over TCP
//! (`ulysses_dist::tcp::TcpCommunicator`).

use std::{
    cell::RefCell,
    marker::PhantomData,
    sync::{Arc, RwLock},
};

use ulysses_core::comm::HostCommunicator;

/// A rank's groups.
#[derive(Clone)]
pub struct Groups {
    /// The ranks that hold parts of the same sequences: attention exchanges over them.
    pub sequence: Arc<dyn HostCommunicator>,
    /// Every rank of the job (sequence × data parallel): gradients and losses sum over them.
    pub world: Arc<dyn HostCommunicator>,
}

/// Groups as entered, with the entry's number among every enter of the process: what a thread
/// noted of a group is told from what it noted of an earlier one (whose memory may be reused).
#[derive(Clone)]
struct Entered {
    groups: Groups,
    number: u64,
}

/// The enters so far in the process.
static ENTERED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl Entered {
    fn new(groups: Groups) -> Self {
        Self { groups, number: ENTERED.fetch_add(1, std::sync::atomic::Ordering::Relaxed) }
    }
}

thread_local! {
    static GROUPS: RefCell<Option<Entered>> = const { RefCell::new(None) };
    /// The shards this thread's forwards may attend over, `[rows, tokens a row]` each, the
    /// newest first, with the groups' entry number and the sequence group's all-to-alls when
    /// the newest was noted: noted by `train::labels_in_step` before a forward (every
    /// micro-batch's where a loop counts them all first), forgotten at the gradient sum and
    /// with the groups.
    static STEP_SHARDS: RefCell<NotedShards> = const { RefCell::new(NotedShards { shards: Vec::new(), entry: None, exchanges: 0 }) };
}

/// The shards noted at most.
const NOTED_SHARDS: usize = 8;

/// What [`note_step_shard`] noted.
struct NotedShards {
    shards: Vec<[usize; 2]>,
    entry: Option<u64>,
    exchanges: u64,
}

/// Notes a shard this thread's next forwards may attend over (`rows` rows of `len` tokens
/// each), for the attention rules that go by the shard's length (this crate sees no token
/// ids): beside the shards noted before it where no attention exchanged since (micro-batches
/// counted first), in place of them otherwise (an evaluation's next batch).
pub(crate) fn note_step_shard(rows: usize, len: usize) {
    let (entry, exchanges) = (current_entry_number(), current().map_or(0, |group| group.traffic().all_to_all_calls));
    STEP_SHARDS.with(|noted| {
        let noted = &mut *noted.borrow_mut();
        if (noted.entry, noted.exchanges) != (entry, exchanges) {
            noted.shards.clear();
        }
        noted.shards.retain(|&shard| shard != [rows, len]);
        noted.shards.insert(0, [rows, len]);
        noted.shards.truncate(NOTED_SHARDS);
        (noted.entry, noted.exchanges) = (entry, exchanges);
    });
}

/// The shards noted for this thread's forwards in the groups it runs in, `[rows, tokens a
/// row]` each, the newest first.
pub(crate) fn step_shards() -> Vec<[usize; 2]> {
    let entry = current_entry_number();
    STEP_SHARDS.with(|noted| {
        let noted = noted.borrow();
        if noted.entry == entry { noted.shards.clone() } else { Vec::new() }
    })
}

/// Forgets the noted shards: their gradients are summed, and the next forward may be of other
/// shapes.
pub(crate) fn forget_step_shards() {
    STEP_SHARDS.with(|noted| noted.borrow_mut().shards.clear());
}

/// The groups of a process that is one rank ([`enter_process`]): seen by every thread of it
/// that entered none of its own (a data loader's, a training loop on a worker thread), which
/// would otherwise attend over its shard alone.
static PROCESS_GROUPS: RwLock<Option<Entered>> = RwLock::new(None);

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
    let previous = GROUPS.with(|slot| slot.borrow_mut().replace(Entered::new(groups)));
    GroupGuard { previous, scope: Scope::Thread, _not_send: PhantomData }
}

/// [`enter_groups`] for every thread of this process, which is one rank (a launched process;
/// `job::run_ranks` enters so): a thread that entered groups of its own uses those. The
/// threads share the rank's communicators: one at a time may run attention or a collective
/// (two at once would interleave their exchanges).
#[must_use = "the process leaves the groups when the guard drops"]
pub fn enter_process(groups: Groups) -> GroupGuard {
    let previous = PROCESS_GROUPS.write().unwrap_or_else(|p| p.into_inner()).replace(Entered::new(groups));
    GroupGuard { previous, scope: Scope::Process, _not_send: PhantomData }
}

/// This thread's groups, else its process's.
fn entered() -> Option<Groups> {
    entry().map(|entered| entered.groups)
}

/// [`entered`], with its number.
fn entry() -> Option<Entered> {
    GROUPS.with(|slot| slot.borrow().clone()).or_else(|| PROCESS_GROUPS.read().unwrap_or_else(|p| p.into_inner()).clone())
}

/// The number of the groups this thread runs in among every enter of the process: unique for
/// the process's life, unlike their address.
pub(crate) fn current_entry_number() -> Option<u64> {
    entry().map(|entered| entered.number)
}

/// The sequence-parallel group entered on this thread (or its process), if any.
pub fn current() -> Option<Arc<dyn HostCommunicator>> {
    entered().map(|groups| groups.sequence)
}

/// The group gradients and losses sum over on this thread (or its process), if any.
pub fn world() -> Option<Arc<dyn HostCommunicator>> {
    entered().map(|groups| groups.world)
}

/// Where a guard's groups were entered.
enum Scope {
    Thread,
    Process,
}

/// Restores the groups that were entered before (usually none) when dropped, on the thread
/// that entered them (it is not `Send`: dropped elsewhere it would clear another thread's).
pub struct GroupGuard {
    previous: Option<Entered>,
    scope: Scope,
    _not_send: PhantomData<*const ()>,
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        let previous = self.previous.take();
        match self.scope {
            Scope::Thread => GROUPS.with(|slot| *slot.borrow_mut() = previous),
            Scope::Process => *PROCESS_GROUPS.write().unwrap_or_else(|p| p.into_inner()) = previous,
        }
    }
}

/// The group this thread's exchange runs in: a clear panic when none was entered (backend
/// ops cannot return errors).
pub(crate) fn required(what: &str) -> Arc<dyn HostCommunicator> {
    current().unwrap_or_else(|| {
        panic!("{what} needs a sequence-parallel group: call burn_ulysses_ops::context::enter(communicator) on each rank first (burn_ulysses_ops::job::run_ranks does)")
    })
}

#[cfg(test)]
mod tests {
    use ulysses_core::comm::ThreadGroup;

    use super::*;

    /// A process's groups reach every thread of it (a worker thread's attention exchanges
    /// over them instead of attending within its shard), a thread's own groups come first,
    /// and the guard's drop takes them away.
    #[test]
    fn a_processs_groups_reach_its_other_threads() {
        let group = || -> Arc<dyn HostCommunicator> { ThreadGroup::new(1).run(|rank| rank.communicator()).pop().unwrap().unwrap() };
        let address = |group: &Arc<dyn HostCommunicator>| Arc::as_ptr(group) as *const u8 as usize;
        let elsewhere = || std::thread::spawn(move || current().as_ref().map(address)).join().unwrap();
        assert_eq!(elsewhere(), None);
        let (process_group, own) = (group(), group());
        let process = enter_process(Groups { sequence: process_group.clone(), world: process_group.clone() });
        assert_eq!(elsewhere(), Some(address(&process_group)), "another thread of the process");
        let thread = enter(own.clone());
        assert_eq!(current().as_ref().map(address), Some(address(&own)), "the thread's own group first");
        drop(thread);
        drop(process);
        assert_eq!(elsewhere(), None, "left with the guard");
    }
}
