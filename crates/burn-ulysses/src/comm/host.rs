//! Any [`HostCommunicator`] (the TCP transport, or any other that moves host memory) as a
//! [`Communicator`] of burn 0.21 tensors: each collective reads the tensor to host memory and
//! uploads the result. Meant for CPU backends and tests; GPUs use NCCL.

use std::sync::Arc;

use burn::tensor::{DType, Shape, TensorData, TensorMetadata, backend::Backend, ops::FloatTensor};

use super::{Collective, CommError, Communicator, ReduceOp, Traffic, check_uneven_counts, check_counts_pair_up};
use ulysses_core::comm::{HostCommunicator, HostDType, HostTensor};

/// burn 0.21 tensors through a host-memory transport.
pub struct HostStaged {
    inner: Arc<dyn HostCommunicator>,
}

impl HostStaged {
    pub fn new(inner: Arc<dyn HostCommunicator>) -> Arc<Self> {
        Arc::new(Self { inner })
    }

    /// The host-level communicator underneath.
    pub fn host(&self) -> &Arc<dyn HostCommunicator> {
        &self.inner
    }
}

ulysses_core::host_dtype_conversions!(DType);

/// Copies `tensor` to the host (waiting for the work that computes it).
pub fn read<B: Backend>(tensor: FloatTensor<B>, op: Collective) -> Result<HostTensor, CommError> {
    let shape = tensor.shape().to_vec();
    let data = burn::tensor::try_read_sync(B::float_into_data(tensor))
        .ok_or_else(|| CommError::Backend(format!("{op}: this platform cannot read tensors synchronously")))?
        .map_err(|e| CommError::Backend(format!("{op}: cannot read the tensor: {e:?}")))?;
    let dtype = host_dtype(data.dtype, op)?;
    Ok(HostTensor { dtype, shape, bytes: data.into_bytes().to_vec() })
}

/// Uploads `host` to `device`.
pub fn upload<B: Backend>(host: HostTensor, device: &B::Device) -> FloatTensor<B> {
    B::float_from_data(TensorData::from_bytes_vec(host.bytes, Shape::from(host.shape), burn_dtype(host.dtype)), device)
}

/// `host` cut along dim 0 into `size` equal parts.
fn rows(host: HostTensor, size: usize) -> Vec<HostTensor> {
    let row = host.bytes.len() / size;
    let shape: Vec<usize> = [1].into_iter().chain(host.shape[1..].iter().copied()).collect();
    (0..size).map(|j| HostTensor { dtype: host.dtype, shape: shape.clone(), bytes: host.bytes[j * row..(j + 1) * row].to_vec() }).collect()
}

/// `parts` (each of `inner_shape`, or `[1, inner_shape..]`) joined along a new dim 0.
fn stack(parts: Vec<HostTensor>, dtype: HostDType, inner_shape: &[usize]) -> HostTensor {
    let shape: Vec<usize> = [parts.len()].into_iter().chain(inner_shape.iter().copied()).collect();
    HostTensor { dtype, shape, bytes: parts.into_iter().flat_map(|part| part.bytes).collect() }
}

impl<B: Backend> Communicator<B> for HostStaged {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn all_to_all(&self, tensor: FloatTensor<B>) -> Result<FloatTensor<B>, CommError> {
        let op = Collective::AllToAll;
        let size = self.inner.size();
        let shape = tensor.shape();
        if shape.num_dims() == 0 || shape[0] != size {
            return Err(CommError::InvalidArgument { op, reason: format!("dim 0 must equal the group size {size}, got shape {:?}", shape.to_vec()) });
        }
        let device = B::float_device(&tensor);
        let host = read::<B>(tensor, op)?;
        let (dtype, inner_shape) = (host.dtype, host.shape[1..].to_vec());
        let received = self.inner.all_to_all(rows(host, size))?;
        let expected: Vec<usize> = [1].into_iter().chain(inner_shape.iter().copied()).collect();
        if let Some(peer) = received.iter().position(|part| part.shape != expected) {
            return Err(super::mismatched(op, peer, format!("a slice of shape {:?} (this rank's: {expected:?})", received[peer].shape)));
        }
        Ok(upload::<B>(stack(received, dtype, &inner_shape), &device))
    }

    fn all_to_all_uneven(&self, tensor: FloatTensor<B>, send_counts: &[usize], recv_counts: &[usize]) -> Result<FloatTensor<B>, CommError> {
        let op = Collective::AllToAllUneven;
        let (rank, size) = (self.inner.rank(), self.inner.size());
        check_uneven_counts(size, tensor.shape().num_elements(), tensor.shape().num_dims(), send_counts, recv_counts)?;
        let device = B::float_device(&tensor);
        let host = read::<B>(tensor, op)?;
        let element = host.dtype.size();
        let mut offset = 0;
        let parts: Vec<HostTensor> = send_counts
            .iter()
            .map(|&count| {
                let bytes = host.bytes[offset * element..(offset + count) * element].to_vec();
                offset += count;
                HostTensor { dtype: host.dtype, shape: vec![count], bytes }
            })
            .collect();
        let received = self.inner.all_to_all(parts)?;
        let sent_here: Vec<usize> = received.iter().map(|part| part.elements()).collect();
        check_counts_pair_up(rank, &sent_here, recv_counts)?;
        let total = recv_counts.iter().sum();
        Ok(upload::<B>(HostTensor { dtype: host.dtype, shape: vec![total], bytes: received.into_iter().flat_map(|part| part.bytes).collect() }, &device))
    }

    fn all_reduce(&self, tensor: FloatTensor<B>, op: ReduceOp) -> Result<FloatTensor<B>, CommError> {
        let device = B::float_device(&tensor);
        let host = read::<B>(tensor, Collective::AllReduce)?;
        Ok(upload::<B>(self.inner.all_reduce(host, op)?, &device))
    }

    fn all_gather(&self, tensor: FloatTensor<B>) -> Result<FloatTensor<B>, CommError> {
        let device = B::float_device(&tensor);
        let host = read::<B>(tensor, Collective::AllGather)?;
        let (dtype, shape) = (host.dtype, host.shape.clone());
        Ok(upload::<B>(stack(self.inner.all_gather(host)?, dtype, &shape), &device))
    }

    fn reduce_scatter(&self, tensor: FloatTensor<B>, op: ReduceOp) -> Result<FloatTensor<B>, CommError> {
        let device = B::float_device(&tensor);
        let host = read::<B>(tensor, Collective::ReduceScatter)?;
        Ok(upload::<B>(self.inner.reduce_scatter(host, op)?, &device))
    }

    fn broadcast(&self, tensor: FloatTensor<B>, root: usize) -> Result<FloatTensor<B>, CommError> {
        let device = B::float_device(&tensor);
        let host = read::<B>(tensor, Collective::Broadcast)?;
        Ok(upload::<B>(self.inner.broadcast(host, root)?, &device))
    }

    fn send_recv(&self, tensor: FloatTensor<B>, to: usize, from: usize) -> Result<FloatTensor<B>, CommError> {
        let device = B::float_device(&tensor);
        let host = read::<B>(tensor, Collective::SendRecv)?;
        Ok(upload::<B>(self.inner.send_recv(host, to, from)?, &device))
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.inner.barrier()
    }

    fn all_gather_host(&self, values: &[u64]) -> Result<Vec<Vec<u64>>, CommError> {
        self.inner.all_gather_host(values)
    }

    fn split(&self, color: u32, key: u32) -> Result<Arc<dyn Communicator<B>>, CommError> {
        Ok(HostStaged::new(self.inner.split(color, key)?))
    }

    fn traffic(&self) -> Traffic {
        self.inner.traffic()
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;

    use super::*;
    use crate::comm::{
        ThreadGroup,
        check::{CheckSizes, check_collectives},
    };

    type B = NdArray<f32>;

    /// The adapter over the rank threads' host collectives (the same path as over TCP, whose
    /// own tests run it between connected ranks): every collective's values, 1 to 4 ranks.
    #[test]
    fn every_collective_passes_the_self_check_through_host_tensors() {
        for size in 1..=4 {
            let results = ThreadGroup::new(size).run(|rank| {
                let staged = HostStaged::new(rank.communicator());
                check_collectives::<B>(&*staged, &Default::default(), CheckSizes { large_elements: 1 << 16 })
            });
            for (rank, result) in results.into_iter().enumerate() {
                result.unwrap().unwrap_or_else(|e| panic!("{size} ranks, rank {rank}: {e}"));
            }
        }
    }

    #[test]
    fn host_reductions_on_threads_give_every_rank_the_same_bits_in_rank_order() {
        // Values whose f32 sum depends on the order: every rank must get rank order's.
        let parts = [1e8f32, 1.0, -1e8, 1.0, 3.0];
        let results = ThreadGroup::new(5).run(|rank| {
            let mine = HostTensor { dtype: HostDType::F32, shape: vec![3], bytes: [parts[rank.rank()]; 3].iter().flat_map(|v| v.to_le_bytes()).collect() };
            HostCommunicator::all_reduce(&*rank.communicator(), mine, ReduceOp::Sum).unwrap().to_f64()
        });
        let in_order = parts[1..].iter().fold(parts[0], |acc, &v| acc + v);
        for result in results {
            assert!(result.unwrap().iter().all(|&v| (v as f32).to_bits() == in_order.to_bits()), "expected {in_order}");
        }
    }

    #[test]
    fn a_rank_passing_another_shape_fails_every_rank_with_the_shapes_named() {
        let results = ThreadGroup::new(2).run(|rank| {
            let mine = HostTensor::from_f64(&vec![1.0; 2 + rank.rank()]);
            HostCommunicator::all_gather(&*rank.communicator(), mine).unwrap_err().to_string()
        });
        for message in results {
            let message = message.unwrap();
            assert!(message.contains("all_gather") && message.contains("same shape") && message.contains("[3]"), "{message}");
        }
    }

    #[test]
    fn a_send_that_is_not_to_the_receiver_is_refused_naming_both() {
        // Rank 0 receives from rank 1, which sends to rank 2.
        let pairs = [(1, 1), (2, 0), (0, 1)];
        let results = ThreadGroup::new(3).run(|rank| {
            let (to, from) = pairs[rank.rank()];
            HostCommunicator::send_recv(&*rank.communicator(), HostTensor::from_f64(&[rank.rank() as f64]), to, from).map_err(|e| e.to_string())
        });
        let message = results[0].as_ref().unwrap().as_ref().unwrap_err();
        assert!(message.contains("rank 0 receives from rank 1, which sends to rank 2"), "{message}");
    }
}
