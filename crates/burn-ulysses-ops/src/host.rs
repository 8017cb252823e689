//! burn 0.22 float tensors as ulysses-core's host tensors and back: what every transport
//! (rank threads, TCP) moves.

use burn::backend::{Backend, tensor::FloatTensor};
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

/// Copies `tensor` to the host (waiting for the work that computes it).
pub fn read<B: Backend>(tensor: FloatTensor<B>, op: Collective) -> Result<HostTensor, CommError> {
    let data = burn::tensor::try_read_sync(B::float_into_data(tensor))
        .ok_or_else(|| CommError::Backend(format!("{op}: this platform cannot read tensors synchronously")))?
        .map_err(|e| CommError::Backend(format!("{op}: cannot read the tensor: {e:?}")))?;
    from_data(data, op)
}

/// Uploads `host` to `device`.
pub fn upload<B: Backend>(host: HostTensor, device: &B::Device) -> FloatTensor<B> {
    B::float_from_data(to_data(host), device)
}
