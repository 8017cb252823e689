//! The rank context: how `UlyssesBackend::attention`, a static function, finds the group.
//!
//! A backend is a type with static methods, so the communicator cannot travel with the call.
//! It is looked up here instead, in two scopes:
//! - **thread**: several ranks as threads of one process (tests on CPU, single-node runs).
//!   They may share a device id (NdArray's CPU device), so the device cannot identify the
//!   rank; the thread can.
//! - **process**: one process per GPU (NCCL); background threads see it too.
//!
//! Either way, one thread per rank issues attention (and so collectives): collectives are
//! numbered per communicator, and two threads of one rank calling attention concurrently
//! would interleave them.
//!
//! The thread scope wins when both are set. With neither, attention runs on one device, as
//! it does inside [`enter_single_device`], unless the forward noted a shard of a sequence
//! spread over several ranks (`attention_guard::note_shard_positions`): that is refused.

use std::{
    any::{Any, TypeId, type_name},
    cell::RefCell,
    marker::PhantomData,
    sync::{Arc, RwLock},
};

use burn::{config::Config, tensor::backend::Backend};

use crate::{comm::Communicator, error::UlyssesError, layout::RingSharding};

/// Behaviour of the attention interception.
#[derive(Config, Debug)]
pub struct UlyssesConfig {
    /// Before each exchange, all-gather a few integers describing every rank's q/k/v layout
    /// and fail with a clear error when ranks disagree (a different local sequence length,
    /// say). Costs one tiny host collective per attention call; without it a mismatch
    /// surfaces later as a shape error or, on NCCL, as corrupted data.
    #[config(default = true)]
    pub verify_layout: bool,
    /// Fail, naming the reason, where attention would fall back to burn's dense attention
    /// (a mask, a bias, a softcap, or a backend or shape the flash kernels do not take):
    /// it builds the `S × S` score matrix, which at long sequences is an out-of-memory
    /// error rather than a slowdown. Off, each fallback is logged with its reason.
    #[config(default = false)]
    pub forbid_dense_fallback: bool,
    /// How the sequence is cut over the ring of Ulysses × Ring: the data must be sharded the
    /// same way (`ParallelLayout::sharder`; `ParallelGroups::rank_context` sets this field
    /// from the layout, and `ulysses_training`'s steps refuse a context that differs).
    #[config(default = "RingSharding::Contiguous")]
    pub ring_sharding: RingSharding,
    /// For a model that attends within each rank's shard on purpose (say, local windows that
    /// never cross a shard): lets its hand-written score matmuls through the guard against
    /// attention done by hand (`attention_guard`, a layer above), which otherwise refuses them,
    /// and with them every other shard-local refusal (a softmax over per-head weights, a scan,
    /// a flip or a window along the shard, positions counted from the shard's first token).
    #[config(default = false)]
    pub shard_local_attention_on_purpose: bool,
}

/// The group a rank belongs to, for tensors of the wire backend `W`.
pub struct RankContext<W: Backend> {
    /// The Ulysses group: attention exchanges sequence shards for head shards within it.
    pub communicator: Arc<dyn Communicator<W>>,
    /// The ring group of Ulysses × Ring (`None`: Ulysses alone): after the exchange, each
    /// Ulysses group holds one chunk of the sequence, and attention passes keys and values
    /// around the ranks of this group.
    pub ring: Option<Arc<dyn Communicator<W>>>,
    pub config: UlyssesConfig,
}

impl<W: Backend> RankContext<W> {
    /// Ulysses alone over `communicator`.
    pub fn ulysses(communicator: Arc<dyn Communicator<W>>, config: UlyssesConfig) -> Self {
        Self { communicator, ring: None, config }
    }
}

impl<W: Backend> Clone for RankContext<W> {
    fn clone(&self) -> Self {
        Self { communicator: self.communicator.clone(), ring: self.ring.clone(), config: self.config.clone() }
    }
}

/// A context stored without its wire type; `W` is checked on lookup.
#[derive(Clone)]
struct StoredContext {
    wire: TypeId,
    wire_name: &'static str,
    context: Arc<dyn Any + Send + Sync>,
    /// What the guard against attention done by hand reads on every matmul, without the
    /// wire type the model's backend does not name.
    sharding: Sharding,
    /// This entry's number among every [`enter`] of the process: what a thread noted of a
    /// group is told from what it noted of an earlier one (whose memory may be reused).
    entered: u64,
}

/// The [`enter`]s so far in the process.
static ENTERED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How a rank context cuts sequences: what the guard in `attention_guard` needs to know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sharding {
    /// Ranks a sequence is spread over (Ulysses × ring).
    pub ranks: usize,
    /// Equal runs of consecutive tokens a shard is cut into where its sequence's may end: 1,
    /// or 2 under a zigzag ring (a shard may hold the ends of two chunks apart).
    pub runs: usize,
    /// The shard this rank holds, `0..ranks`: its ring rank times the Ulysses group's size,
    /// plus its Ulysses rank (`ulysses_core::layout::ring_coordinates`' convention).
    pub shard: usize,
    /// [`UlyssesConfig::shard_local_attention_on_purpose`].
    pub shard_local_attention_on_purpose: bool,
}

/// What a scope says about the rank context.
#[derive(Clone)]
enum Entry {
    Rank(StoredContext),
    /// Explicitly single-device, shadowing any process-wide group (evaluation that bypasses
    /// sequence parallelism).
    SingleDevice,
}

thread_local! {
    static THREAD_CONTEXT: RefCell<Option<Entry>> = const { RefCell::new(None) };
}
static PROCESS_CONTEXT: RwLock<Option<Entry>> = RwLock::new(None);

/// Restores the previous context of its scope when dropped.
#[must_use = "the rank context is left as soon as the guard is dropped"]
pub struct RankGuard {
    scope: RankScope,
    previous: Option<Entry>,
    // A thread guard must be dropped on the thread that created it.
    _not_send: PhantomData<*const ()>,
}

/// Where a rank context is visible.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankScope {
    /// The current thread only: ranks that are threads of one process.
    Thread,
    /// Every thread of the process: one process per rank (per GPU).
    Process,
}

/// Makes `context` the rank context of `scope` until the guard is dropped.
pub fn enter<W: Backend>(scope: RankScope, context: RankContext<W>) -> RankGuard {
    let ring_size = context.ring.as_ref().map_or(1, |ring| ring.size());
    let sharding = Sharding {
        ranks: context.communicator.size() * ring_size,
        runs: context.config.ring_sharding.runs(ring_size),
        shard: context.ring.as_ref().map_or(0, |ring| ring.rank()) * context.communicator.size() + context.communicator.rank(),
        shard_local_attention_on_purpose: context.config.shard_local_attention_on_purpose,
    };
    let stored = StoredContext {
        wire: TypeId::of::<W>(),
        wire_name: type_name::<W>(),
        context: Arc::new(context),
        sharding,
        entered: ENTERED.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
    };
    replace(scope, Entry::Rank(stored))
}

/// Makes this thread run attention on a single device until the guard is dropped, even
/// inside a group: to evaluate a whole, unsharded batch on one rank.
pub fn enter_single_device() -> RankGuard {
    replace(RankScope::Thread, Entry::SingleDevice)
}

fn replace(scope: RankScope, entry: Entry) -> RankGuard {
    let previous = match scope {
        RankScope::Thread => THREAD_CONTEXT.with(|slot| slot.replace(Some(entry))),
        RankScope::Process => PROCESS_CONTEXT.write().unwrap_or_else(|p| p.into_inner()).replace(entry),
    };
    RankGuard { scope, previous, _not_send: PhantomData }
}

impl Drop for RankGuard {
    fn drop(&mut self) {
        let previous = self.previous.take();
        match self.scope {
            RankScope::Thread => THREAD_CONTEXT.with(|slot| *slot.borrow_mut() = previous),
            RankScope::Process => {
                *PROCESS_CONTEXT.write().unwrap_or_else(|p| p.into_inner()) = previous
            }
        }
    }
}

/// The rank context for wire backend `W`: the thread's, else the process's, else `None`
/// (a single-device run).
pub fn current<W: Backend>() -> Result<Option<RankContext<W>>, UlyssesError> {
    let entry = THREAD_CONTEXT.with(|slot| slot.borrow().clone()).or_else(|| {
        PROCESS_CONTEXT.read().unwrap_or_else(|p| p.into_inner()).clone()
    });
    rank_context_of(entry)
}

/// How the current rank context (the thread's, else the process's) cuts sequences; `None`
/// outside any group or inside [`enter_single_device`]. No wire type needed: cheap enough to
/// ask on every op.
pub fn current_sharding() -> Option<Sharding> {
    let from = |entry: &Option<Entry>| match entry {
        Some(Entry::Rank(stored)) => Some(Some(stored.sharding)),
        Some(Entry::SingleDevice) => Some(None),
        None => None,
    };
    THREAD_CONTEXT
        .with(|slot| from(&slot.borrow()))
        .or_else(|| from(&PROCESS_CONTEXT.read().unwrap_or_else(|p| p.into_inner())))
        .flatten()
}

/// The number of the rank context this thread runs in among every [`enter`] of the process
/// (`None`: none, or a single device): unique for the process's life, unlike its address.
pub(crate) fn current_entry_number() -> Option<u64> {
    let from = |entry: &Option<Entry>| match entry {
        Some(Entry::Rank(stored)) => Some(Some(stored.entered)),
        Some(Entry::SingleDevice) => Some(None),
        None => None,
    };
    THREAD_CONTEXT.with(|slot| from(&slot.borrow())).or_else(|| from(&PROCESS_CONTEXT.read().unwrap_or_else(|p| p.into_inner()))).flatten()
}

/// Whether this thread runs inside [`enter_single_device`] (its own, or none entered on it and
/// the process's), where the model chose one device on purpose.
pub fn single_device_entered() -> bool {
    let single = |entry: &Option<Entry>| entry.as_ref().map(|entry| matches!(entry, Entry::SingleDevice));
    THREAD_CONTEXT.with(|slot| single(&slot.borrow())).or_else(|| single(&PROCESS_CONTEXT.read().unwrap_or_else(|p| p.into_inner()))).unwrap_or(false)
}

/// When this thread is one of several ranks that are threads of this process (a
/// thread-scoped context), waits until every rank of its group (Ulysses and ring) gets
/// here; otherwise returns at once. Burn's autodiff ends every `backward` by locking each
/// graph of the process in turn, so a rank that runs a collective-free backward while a
/// peer thread holds its own graph's lock inside a backward whose collectives wait for this
/// rank deadlocks both; a barrier before such a backward rules it out (see `ulysses_training`'s layers module).
pub fn sync_thread_ranks<W: Backend>() -> Result<(), UlyssesError> {
    let Some(context) = rank_context_of::<W>(THREAD_CONTEXT.with(|slot| slot.borrow().clone()))? else {
        return Ok(());
    };
    context.communicator.barrier()?;
    if let Some(ring) = &context.ring {
        ring.barrier()?;
    }
    Ok(())
}

fn rank_context_of<W: Backend>(entry: Option<Entry>) -> Result<Option<RankContext<W>>, UlyssesError> {
    let Some(Entry::Rank(stored)) = entry else {
        return Ok(None);
    };
    if stored.wire != TypeId::of::<W>() {
        return Err(UlyssesError::WrongWireBackend {
            entered: stored.wire_name,
            used: type_name::<W>(),
        });
    }
    let context = stored
        .context
        .downcast_ref::<RankContext<W>>()
        .expect("TypeId matched, so the downcast cannot fail");
    Ok(Some(context.clone()))
}
