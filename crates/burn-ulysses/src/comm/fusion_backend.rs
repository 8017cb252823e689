//! Collectives on burn's fused backends (`Fusion<B>`: what burn's `Cuda` and `Wgpu` types
//! are), through any communicator of the backend they wrap.
//!
//! A fused tensor is a handle into a stream of recorded operations, not a buffer. A
//! collective needs the buffer, so [`FusionCommunicator`] resolves each input (which runs
//! what its stream recorded), hands `B`'s buffer to the wrapped communicator, and registers
//! the result as a new fused tensor. One adapter serves every communicator of `B`: NCCL's for
//! CUDA, threads and TCP for any backend.

use std::sync::Arc;

use burn::tensor::{TensorMetadata, ops::FloatTensor};
use burn_fusion::{Fusion, FusionBackend, FusionTensor, NoOp, client::GlobalFusionClient, stream::OperationStreams};
use burn_ir::{InitOperationIr, OperationIr, OperationOutput};

use super::{CommError, Communicator, ReduceOp, Traffic};

/// A communicator of `B` that moves tensors of `Fusion<B>`.
pub struct FusionCommunicator<B: FusionBackend> {
    inner: Arc<dyn Communicator<B>>,
}

impl<B: FusionBackend> FusionCommunicator<B> {
    pub fn new(inner: Arc<dyn Communicator<B>>) -> Self {
        Self { inner }
    }

    /// The communicator of `B` underneath.
    pub fn inner(&self) -> &Arc<dyn Communicator<B>> {
        &self.inner
    }

    /// Runs `collective` on `B`'s buffer of `tensor` and wraps its result as a fused tensor
    /// on the same client.
    fn through(
        &self,
        tensor: FusionTensor<B::FusionRuntime>,
        collective: impl FnOnce(FloatTensor<B>) -> Result<FloatTensor<B>, CommError>,
    ) -> Result<FusionTensor<B::FusionRuntime>, CommError> {
        let client = tensor.client.clone();
        let buffer = client.resolve_tensor_float::<B>(tensor);
        Ok(register::<B>(&client, collective(buffer)?))
    }
}

/// Makes `tensor` a fused tensor of `client`, as `Fusion::float_from_data` does with fresh data.
fn register<B: FusionBackend>(
    client: &GlobalFusionClient<B::FusionRuntime>,
    tensor: FloatTensor<B>,
) -> FusionTensor<B::FusionRuntime> {
    let (shape, dtype) = (tensor.shape(), tensor.dtype());
    let handle = B::float_tensor_handle(tensor);
    let init = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
    client.register(OperationStreams::default(), OperationIr::Init(init), NoOp::<B>::new()).output()
}

impl<B: FusionBackend> Communicator<Fusion<B>> for FusionCommunicator<B> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn all_to_all(&self, tensor: FloatTensor<Fusion<B>>) -> Result<FloatTensor<Fusion<B>>, CommError> {
        self.through(tensor, |buffer| self.inner.all_to_all(buffer))
    }

    fn all_reduce(&self, tensor: FloatTensor<Fusion<B>>, op: ReduceOp) -> Result<FloatTensor<Fusion<B>>, CommError> {
        self.through(tensor, |buffer| self.inner.all_reduce(buffer, op))
    }

    fn all_gather(&self, tensor: FloatTensor<Fusion<B>>) -> Result<FloatTensor<Fusion<B>>, CommError> {
        self.through(tensor, |buffer| self.inner.all_gather(buffer))
    }

    fn reduce_scatter(&self, tensor: FloatTensor<Fusion<B>>, op: ReduceOp) -> Result<FloatTensor<Fusion<B>>, CommError> {
        self.through(tensor, |buffer| self.inner.reduce_scatter(buffer, op))
    }

    fn broadcast(&self, tensor: FloatTensor<Fusion<B>>, root: usize) -> Result<FloatTensor<Fusion<B>>, CommError> {
        self.through(tensor, |buffer| self.inner.broadcast(buffer, root))
    }

    fn send_recv(&self, tensor: FloatTensor<Fusion<B>>, to: usize, from: usize) -> Result<FloatTensor<Fusion<B>>, CommError> {
        self.through(tensor, |buffer| self.inner.send_recv(buffer, to, from))
    }

    fn all_to_all_uneven(&self, tensor: FloatTensor<Fusion<B>>, send_counts: &[usize], recv_counts: &[usize]) -> Result<FloatTensor<Fusion<B>>, CommError> {
        self.through(tensor, |buffer| self.inner.all_to_all_uneven(buffer, send_counts, recv_counts))
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.inner.barrier()
    }

    fn all_gather_host(&self, values: &[u64]) -> Result<Vec<Vec<u64>>, CommError> {
        self.inner.all_gather_host(values)
    }

    fn split(&self, color: u32, key: u32) -> Result<Arc<dyn Communicator<Fusion<B>>>, CommError> {
        Ok(Arc::new(Self::new(self.inner.split(color, key)?)))
    }

    fn traffic(&self) -> Traffic {
        self.inner.traffic()
    }
}
