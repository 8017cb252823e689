//! [`Nccl`]: how `burn_ulysses::job::run_ranks` joins CUDA ranks of different processes, for
//! burn's CubeCL CUDA backend and for its fused form (burn's `Cuda` type).

use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement, tensor::CubeTensor};
use burn_fusion::Fusion;
use burn_ulysses::comm::{Communicator, FusionCommunicator};
use cubecl::cuda::{CudaDevice, CudaRuntime};
use burn_ulysses::job::Transport;
use ulysses_dist::{DistError, DistributedConfig, LaunchEnv};

use crate::NcclCommunicator;

/// NCCL between processes, one GPU each: the device `run_ranks` picked (`LOCAL_RANK` unless
/// configured otherwise).
pub struct Nccl;

fn join(env: &LaunchEnv, config: &DistributedConfig, device: &CudaDevice) -> Result<Arc<NcclCommunicator>, DistError> {
    NcclCommunicator::join(env, config, device.index).map_err(|error| DistError::Transport(format!("NCCL: {error}")))
}

impl<F, I, BT> Transport<CubeBackend<CudaRuntime, F, I, BT>> for Nccl
where
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
    CubeBackend<CudaRuntime, F, I, BT>: Backend<FloatTensorPrimitive = CubeTensor<CudaRuntime>, Device = CudaDevice>,
{
    fn connect(
        env: &LaunchEnv,
        config: &DistributedConfig,
        device: &CudaDevice,
    ) -> Result<Arc<dyn Communicator<CubeBackend<CudaRuntime, F, I, BT>>>, DistError> {
        Ok(join(env, config, device)?)
    }
}

impl<F, I, BT> Transport<Fusion<CubeBackend<CudaRuntime, F, I, BT>>> for Nccl
where
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
    CubeBackend<CudaRuntime, F, I, BT>: Backend<FloatTensorPrimitive = CubeTensor<CudaRuntime>, Device = CudaDevice>,
{
    fn connect(
        env: &LaunchEnv,
        config: &DistributedConfig,
        device: &CudaDevice,
    ) -> Result<Arc<dyn Communicator<Fusion<CubeBackend<CudaRuntime, F, I, BT>>>>, DistError> {
        let communicator: Arc<dyn Communicator<CubeBackend<CudaRuntime, F, I, BT>>> = join(env, config, device)?;
        Ok(Arc::new(FusionCommunicator::new(communicator)))
    }
}
