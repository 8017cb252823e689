//! What the host waits on the device for, counted where `UlyssesBackend` sees it: on a GPU
//! each of these stalls the host until the device has finished everything queued before it,
//! so a step's count of them, not its op count, says whether the GPU is kept busy.
//!
//! - a **read**: a tensor brought to the host (`into_data`, `into_scalar`, a transaction);
//! - a **sync**: `Backend::sync`;
//! - an **upload**: a tensor made from host data (`from_data`), counted with its bytes. From
//!   pageable memory the copy may first wait for the device's stream (CUDA stages it); from
//!   pinned memory ([`PlainBackend::pin_for_upload`]) it is queued like a kernel, and counted
//!   among the **pinned uploads** too;
//! - a **queued read** ([`queue_read`], [`PlainBackend::queue_read`]): a copy to the host
//!   queued behind the device's work, without waiting. The host waits for it later
//!   ([`arrive`]); that wait idles the device only if nothing was queued after the read, so
//!   it is counted as a wait (a **drain**) only then: when a later read has been queued on
//!   this thread since, the device still has that read's work ahead of it, and the wait
//!   counts as **overlapped**, not as a wait.
//!
//! - a **kernel launch**: a kernel CubeCL launches. Not a wait, but on a GPU each costs the
//!   host a few microseconds, so a step that launches a kernel per row or per tile is host-bound
//!   however few its waits. Counted by [`kernel_launch_counter`], a `tracing` layer over the
//!   span CubeCL opens for each launch (its `tracing` feature, which this crate's `cubecl`
//!   feature turns on): the trainer installs it with its logs, a test in its scoped subscriber;
//!   without it, or on NdArray (no kernels), launches stay 0. Unlike the waits, launches are
//!   counted below the decorator: `Autodiff`'s backward and the communicators' kernels too.
//!
//! Counted per thread (each rank of a `ThreadGroup` is one), for every `UlyssesBackend` level
//! (`UlyssesBackend<Autodiff<B>>` and the `UlyssesBackend<B>` beneath it). Ops that
//! `Autodiff`'s backward runs on `B` itself never reach the decorator; they make no reads.
//! Nor do the communicators' waits inside collectives (their syncs of the inner backend, the
//! host-staged transport's reads): those are below the decorator and not counted.
//! Counting costs a thread-local add per read or upload: on in every build, so that the CPU
//! tests and `--profile` see what a GPU run would wait on.

use std::{
    cell::Cell,
    fmt,
    future::Future,
    ops::Sub,
};

use burn::tensor::{
    AllocationProperty, TensorData,
    backend::ExecutionError,
    ops::{BoolTensor, FloatTensor, IntTensor, TransactionPrimitive, TransactionPrimitiveData},
};

use tracing::{Metadata, Subscriber, span};
use tracing_subscriber::{Layer, filter, layer, registry::LookupSpan};

use crate::capabilities::{ExchangeBackend, PlainBackend, QueuedRead};

/// Counts of what the host waited on the device for, on one thread (see the module doc).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceIo {
    /// Tensors (or transactions of tensors) read back to the host.
    pub reads: u64,
    /// Bytes those reads, and the queued ones, brought back.
    pub read_bytes: u64,
    /// Copies to the host queued without waiting ([`queue_read`]).
    pub queued_reads: u64,
    /// Waits for queued reads with nothing queued after them: the device idled.
    pub drains: u64,
    /// Waits for queued reads with later work queued: the device kept busy.
    pub overlapped_waits: u64,
    /// Explicit device syncs.
    pub syncs: u64,
    /// Tensors made from host data.
    pub uploads: u64,
    /// Bytes those uploads moved.
    pub upload_bytes: u64,
    /// Those of the uploads that came from pinned host memory: queued, not waited for.
    pub pinned_uploads: u64,
    /// Kernels launched by CubeCL on this thread, with [`kernel_launch_counter`] installed.
    pub launches: u64,
}

impl DeviceIo {
    /// Everything this thread has counted so far; the difference of two is what happened
    /// between them.
    pub fn of_this_thread() -> Self {
        COUNTS.with(Cell::get)
    }

    /// The host's waits that idle the device: reads, syncs, and drains.
    pub fn waits(&self) -> u64 {
        self.reads + self.syncs + self.drains
    }
}

impl Sub for DeviceIo {
    type Output = Self;
    fn sub(self, earlier: Self) -> Self {
        Self {
            reads: self.reads - earlier.reads,
            read_bytes: self.read_bytes - earlier.read_bytes,
            queued_reads: self.queued_reads - earlier.queued_reads,
            drains: self.drains - earlier.drains,
            overlapped_waits: self.overlapped_waits - earlier.overlapped_waits,
            syncs: self.syncs - earlier.syncs,
            uploads: self.uploads - earlier.uploads,
            upload_bytes: self.upload_bytes - earlier.upload_bytes,
            pinned_uploads: self.pinned_uploads - earlier.pinned_uploads,
            launches: self.launches - earlier.launches,
        }
    }
}

impl fmt::Display for DeviceIo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |bytes: u64| bytes as f64 / (1024.0 * 1024.0);
        write!(f, "{} waits ({} reads", self.waits(), self.reads)?;
        if self.queued_reads > 0 {
            write!(f, ", {} drains and {} overlapped waits for {} queued reads", self.drains, self.overlapped_waits, self.queued_reads)?;
        }
        write!(f, ", {:.2} MiB; {} syncs), {} uploads ({:.2} MiB", mib(self.read_bytes), self.syncs, self.uploads, mib(self.upload_bytes))?;
        if self.pinned_uploads > 0 {
            write!(f, "; {} from pinned memory", self.pinned_uploads)?;
        }
        write!(f, ")")?;
        if self.launches > 0 {
            write!(f, ", {} kernel launches", self.launches)?;
        }
        Ok(())
    }
}

thread_local! {
    static COUNTS: Cell<DeviceIo> = const {
        Cell::new(DeviceIo { reads: 0, read_bytes: 0, queued_reads: 0, drains: 0, overlapped_waits: 0, syncs: 0, uploads: 0, upload_bytes: 0, pinned_uploads: 0, launches: 0 })
    };
}

fn count(change: impl FnOnce(&mut DeviceIo)) {
    COUNTS.with(|counts| {
        let mut now = counts.get();
        change(&mut now);
        counts.set(now);
    });
}

/// A `tracing` layer that counts CubeCL's kernel launches into [`DeviceIo::launches`] of the
/// launching thread. It sees only the span CubeCL opens per launch (its own filter), so it
/// enables no other `trace` callsite and leaves the logs' filter as it is; add it beside the
/// logging layer, e.g. `registry().with(kernel_launch_counter()).with(fmt::layer())`.
pub fn kernel_launch_counter<S>() -> impl Layer<S> + Send + Sync + 'static
where
    S: Subscriber + for<'span> LookupSpan<'span>,
{
    LaunchCounter.with_filter(filter::filter_fn(is_kernel_launch))
}

/// The span `cubecl_runtime::client::ComputeClient::launch_inner` opens, with the `tracing`
/// feature, for every kernel launch, checked or not (cubecl-runtime 0.10).
fn is_kernel_launch(metadata: &Metadata<'_>) -> bool {
    metadata.is_span() && metadata.name() == "launch_inner" && metadata.target().starts_with("cubecl_runtime")
}

struct LaunchCounter;

impl<S: Subscriber> Layer<S> for LaunchCounter {
    fn on_new_span(&self, _: &span::Attributes<'_>, _: &span::Id, _: layer::Context<'_, S>) {
        count(|c| c.launches += 1);
    }
}

/// A read issued now; its bytes (`bytes_of` what arrives) are counted when it arrives.
fn counted_read<T, F>(read: F, bytes_of: fn(&T) -> usize) -> impl Future<Output = Result<T, ExecutionError>> + Send
where
    F: Future<Output = Result<T, ExecutionError>> + Send,
{
    count(|c| c.reads += 1);
    async move {
        let data = read.await?;
        count(|c| c.read_bytes += bytes_of(&data) as u64);
        Ok(data)
    }
}

fn tensor_bytes(data: &TensorData) -> usize {
    data.as_bytes().len()
}

fn counted_upload(data: &TensorData) {
    count(|c| {
        c.uploads += 1;
        c.upload_bytes += data.as_bytes().len() as u64;
        c.pinned_uploads += u64::from(data.bytes.property() == AllocationProperty::Pinned);
    });
}

/// `UlyssesBackend`'s `float_into_data`: the inner backend's, counted.
pub fn float_into_data<X: ExchangeBackend>(tensor: FloatTensor<X>) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send {
    counted_read(X::float_into_data(tensor), tensor_bytes)
}

/// `UlyssesBackend`'s `int_into_data`: the inner backend's, counted.
pub fn int_into_data<X: ExchangeBackend>(tensor: IntTensor<X>) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send {
    counted_read(X::int_into_data(tensor), tensor_bytes)
}

/// `UlyssesBackend`'s `bool_into_data`: the inner backend's, counted.
pub fn bool_into_data<X: ExchangeBackend>(tensor: BoolTensor<X>) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send {
    counted_read(X::bool_into_data(tensor), tensor_bytes)
}

/// `UlyssesBackend`'s transactions (several tensors read at once): one read, counted.
pub fn tr_execute<X: ExchangeBackend>(transaction: TransactionPrimitive<X>) -> impl Future<Output = Result<TransactionPrimitiveData, ExecutionError>> + Send {
    counted_read(X::tr_execute(transaction), |data: &TransactionPrimitiveData| {
        [&data.read_floats, &data.read_qfloats, &data.read_ints, &data.read_bools].into_iter().flatten().map(tensor_bytes).sum()
    })
}

/// `UlyssesBackend`'s `float_from_data`: the inner backend's, counted.
pub fn float_from_data<X: ExchangeBackend>(data: TensorData, device: &X::Device) -> FloatTensor<X> {
    counted_upload(&data);
    X::float_from_data(data, device)
}

/// `UlyssesBackend`'s `int_from_data`: the inner backend's, counted.
pub fn int_from_data<X: ExchangeBackend>(data: TensorData, device: &X::Device) -> IntTensor<X> {
    counted_upload(&data);
    X::int_from_data(data, device)
}

/// `UlyssesBackend`'s `bool_from_data`: the inner backend's, counted.
pub fn bool_from_data<X: ExchangeBackend>(data: TensorData, device: &X::Device) -> BoolTensor<X> {
    counted_upload(&data);
    X::bool_from_data(data, device)
}

/// `UlyssesBackend`'s `sync`, counted.
pub(crate) fn counted_sync() {
    count(|c| c.syncs += 1);
}

/// A tensor's copy to the host, queued on its device ([`queue_read`]); [`arrive`] waits for
/// it.
#[must_use = "a queued read holds its device buffer and staging memory until it arrives"]
pub struct PendingRead {
    /// `None` once [`arrive`] took it.
    read: Option<QueuedRead>,
    /// This thread's count of queued reads when it was queued (its sequence number).
    sequence: u64,
}

impl Drop for PendingRead {
    /// A read dropped before it arrived (a step that failed with tiles' reads queued) is
    /// waited for: its pinned host buffer goes back to a pool that would hand it out again
    /// while the device still writes into it.
    fn drop(&mut self) {
        if let Some(QueuedRead::Queued(future)) = self.read.take() {
            // Dropped while a failure unwinds too: a panic here would abort the process.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| burn::tensor::read_sync(future)));
        }
    }
}

/// Queues a copy of `tensor` to the host without waiting for the device
/// ([`PlainBackend::queue_read`]); counted as a queued read, or as a read (a wait now) where
/// the backend cannot queue one.
pub fn queue_read<W: PlainBackend>(tensor: FloatTensor<W>) -> PendingRead {
    let read = W::queue_read(tensor);
    match &read {
        QueuedRead::Queued(_) => count(|c| c.queued_reads += 1),
        QueuedRead::Arrived(data) => count(|c| {
            c.reads += 1;
            c.read_bytes += data.as_ref().map_or(0, tensor_bytes) as u64;
        }),
    }
    PendingRead { read: Some(read), sequence: COUNTS.with(Cell::get).queued_reads }
}

/// The data of `reads`, in order, waiting once for all of them: one drain, or one overlapped
/// wait if a read was queued on this thread after the last of them (see the module doc);
/// nothing if every one had arrived already. Every read is waited for, a failed one's
/// followers too (dropped, [`PendingRead`] waits), before the first failure is returned.
pub fn arrive(reads: Vec<PendingRead>) -> Result<Vec<TensorData>, ExecutionError> {
    let newest = reads.iter().filter(|pending| matches!(pending.read, Some(QueuedRead::Queued(_)))).map(|pending| pending.sequence).max();
    if let Some(newest) = newest {
        let overlapped = COUNTS.with(Cell::get).queued_reads > newest;
        count(|c| if overlapped { c.overlapped_waits += 1 } else { c.drains += 1 });
    }
    reads
        .into_iter()
        .map(|mut pending| match pending.read.take().expect("a pending read holds its read until it arrives") {
            QueuedRead::Arrived(data) => data,
            QueuedRead::Queued(future) => {
                let data = burn::tensor::read_sync(future)?;
                count(|c| c.read_bytes += tensor_bytes(&data) as u64);
                Ok(data)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    };

    use burn::tensor::{TensorData, backend::ExecutionError};

    use super::{PendingRead, QueuedRead, arrive};

    /// A queued read that counts its wait in `waited`, and fails where asked.
    fn read(waited: &Arc<AtomicUsize>, fails: bool) -> PendingRead {
        let waited = waited.clone();
        let future = async move {
            waited.fetch_add(1, Ordering::SeqCst);
            match fails {
                true => Err(ExecutionError::WithContext { reason: "the copy failed".into() }),
                false => Ok(TensorData::new(vec![1.0f32], [1])),
            }
        };
        PendingRead { read: Some(QueuedRead::Queued(Box::pin(future))), sequence: 0 }
    }

    /// A queued read is waited for where it is dropped before it arrived, and where a read
    /// before it failed: its pinned buffer must not go back to the pool while the device
    /// still writes into it.
    #[test]
    fn a_queued_read_is_waited_for_however_it_ends() {
        let waited = Arc::new(AtomicUsize::new(0));
        drop(read(&waited, false));
        assert_eq!(waited.load(Ordering::SeqCst), 1, "a dropped read was not waited for");
        let error = arrive(vec![read(&waited, true), read(&waited, false), read(&waited, false)]).unwrap_err();
        assert!(error.to_string().contains("the copy failed"), "{error}");
        assert_eq!(waited.load(Ordering::SeqCst), 4, "the reads after a failed one were not waited for");
    }
}
