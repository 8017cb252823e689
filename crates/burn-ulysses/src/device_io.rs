//! What the host waits on the device for, counted where `UlyssesBackend` sees it: on a GPU
//! each of these stalls the host until the device has finished everything queued before it,
//! so a step's count of them, not its op count, says whether the GPU is kept busy.
//!
//! - a **read**: a tensor brought to the host (`into_data`, `into_scalar`, a transaction);
//! - a **sync**: `Backend::sync`;
//! - an **upload**: a tensor made from host data (`from_data`), which waits on the host side
//!   (a pageable copy) rather than on the device's queue, counted with its bytes.
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
    TensorData,
    backend::ExecutionError,
    ops::{BoolTensor, FloatTensor, IntTensor, TransactionPrimitive, TransactionPrimitiveData},
};

use crate::capabilities::ExchangeBackend;

/// Counts of what the host waited on the device for, on one thread (see the module doc).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceIo {
    /// Tensors (or transactions of tensors) read back to the host.
    pub reads: u64,
    /// Bytes those reads brought back.
    pub read_bytes: u64,
    /// Explicit device syncs.
    pub syncs: u64,
    /// Tensors made from host data.
    pub uploads: u64,
    /// Bytes those uploads moved.
    pub upload_bytes: u64,
}

impl DeviceIo {
    /// Everything this thread has counted so far; the difference of two is what happened
    /// between them.
    pub fn of_this_thread() -> Self {
        COUNTS.with(Cell::get)
    }

    /// The host's waits on the device: reads and syncs.
    pub fn waits(&self) -> u64 {
        self.reads + self.syncs
    }
}

impl Sub for DeviceIo {
    type Output = Self;
    fn sub(self, earlier: Self) -> Self {
        Self {
            reads: self.reads - earlier.reads,
            read_bytes: self.read_bytes - earlier.read_bytes,
            syncs: self.syncs - earlier.syncs,
            uploads: self.uploads - earlier.uploads,
            upload_bytes: self.upload_bytes - earlier.upload_bytes,
        }
    }
}

impl fmt::Display for DeviceIo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |bytes: u64| bytes as f64 / (1024.0 * 1024.0);
        write!(
            f,
            "{} waits ({} reads, {:.2} MiB; {} syncs), {} uploads ({:.2} MiB)",
            self.waits(),
            self.reads,
            mib(self.read_bytes),
            self.syncs,
            self.uploads,
            mib(self.upload_bytes)
        )
    }
}

thread_local! {
    static COUNTS: Cell<DeviceIo> = const { Cell::new(DeviceIo { reads: 0, read_bytes: 0, syncs: 0, uploads: 0, upload_bytes: 0 }) };
}

fn count(change: impl FnOnce(&mut DeviceIo)) {
    COUNTS.with(|counts| {
        let mut now = counts.get();
        change(&mut now);
        counts.set(now);
    });
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
        [&data.read_floats, &data.read_ints, &data.read_bools].into_iter().flatten().map(tensor_bytes).sum()
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
