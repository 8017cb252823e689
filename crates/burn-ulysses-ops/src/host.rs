//! burn 0.22 float tensors as ulysses-core's host tensors and back: what every transport
//! (rank threads, TCP) moves.

use std::cell::Cell;

use burn::backend::{Backend, TensorMetadata, tensor::FloatTensor};
use burn::tensor::{DType, TensorData};
use ulysses_core::comm::{Collective, CommError, HostTensor};

ulysses_core::host_dtype_conversions!(DType);

/// `data` as a host tensor.
pub fn from_data(data: TensorData, op: Collective) -> Result<HostTensor, CommError> {
    let dtype = host_dtype(data.dtype(), op)?;
    let shape = data.shape().to_vec();
    Ok(HostTensor { dtype, shape, bytes: data.into_bytes().to_vec() })
}

/// `host` as tensor data.
pub fn to_data(host: HostTensor) -> TensorData {
    TensorData::from_bytes_vec(host.bytes, host.shape, burn_dtype(host.dtype))
}

thread_local! {
    /// Tensors this thread copied from the device for this crate's attention ([`device_reads`]).
    static READS: Cell<u64> = const { Cell::new(0) };
}

/// How many tensors this thread has copied from the device to the host for this crate's
/// attention and exchanges: each waits for the device's queued work, what a GPU stalls on. A
/// count to compare (an exchange reads once, whatever the group's size), not a time.
pub fn device_reads() -> u64 {
    READS.get()
}

/// Counts a copy from the device to the host ([`device_reads`]).
pub(crate) fn note_device_read() {
    READS.set(READS.get() + 1);
}

/// Copies `tensor` to the host (waiting for the work that computes it).
pub fn read<B: Backend>(tensor: FloatTensor<B>, op: Collective) -> Result<HostTensor, CommError> {
    note_device_read();
    let data = burn::tensor::try_read_sync(B::float_into_data(tensor))
        .ok_or_else(|| CommError::Backend(format!("{op}: this platform cannot read tensors synchronously")))?
        .map_err(|e| CommError::Backend(format!("{op}: cannot read the tensor: {e:?}")))?;
    from_data(data, op)
}

/// Copies `parts` to the host in one read (one wait for the device, not one a part): flattened
/// and joined on the device, split again on the host.
pub fn read_parts<B: Backend>(parts: Vec<FloatTensor<B>>, op: Collective) -> Result<Vec<HostTensor>, CommError> {
    let shapes: Vec<Vec<usize>> = parts.iter().map(|part| part.shape().to_vec()).collect();
    let flat: Vec<FloatTensor<B>> = parts.into_iter().map(|part| {
        let elements = part.shape().num_elements();
        B::float_reshape(part, burn::tensor::Shape::new([elements]))
    }).collect();
    let joined = read::<B>(B::float_cat(flat, 0), op)?;
    let element = joined.dtype.size();
    let mut start = 0;
    shapes
        .into_iter()
        .map(|shape| {
            let end = start + shape.iter().product::<usize>() * element;
            let part = HostTensor::new(joined.dtype, shape, joined.bytes[start..end].to_vec(), op);
            start = end;
            part
        })
        .collect()
}

/// Uploads `host` to `device`.
pub fn upload<B: Backend>(host: HostTensor, device: &B::Device) -> FloatTensor<B> {
    B::float_from_data(to_data(host), device)
}
