//! Tile sizes per device, dtype and head dims: the largest blocks whose shared memory fits
//! what the runtime reports, and tensor cores where the device has them for the dtype.

use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use cubecl::{
    features::MmaConfig,
    ir::{ElemType, FloatKind, StorageType},
    prelude::*,
};

use super::{Problem, stage::Blocks, tile_ops::TILE};
use crate::FlashError;

/// What multiplies the tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Engine {
    /// Tensor cores (`cmma`): f16 and bf16 where the device has 16 × 16 × 16 fragments with
    /// f32 accumulation and 32-lane planes.
    TensorCores,
    /// The plane's lanes, from shared memory: f32, and devices without tensor cores.
    Plane,
}

/// The three kernels' blocks for one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Plan {
    pub engine: Engine,
    pub forward: Blocks,
    pub key_value: Blocks,
    pub query: Blocks,
}

/// Which kernel a budget is for: each stages different tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    Forward,
    KeyValueGrad,
    QueryGrad,
}

/// Sets `ULYSSES_FLASH_ENGINE=plane` to run the plane engine where tensor cores would be used
/// (to compare them on one GPU).
const ENGINE_VARIABLE: &str = "ULYSSES_FLASH_ENGINE";

impl Plan {
    pub fn new<R: CubeRuntime>(problem: &Problem, dtype: DType, causal: bool, client: &ComputeClient<R>) -> Result<Self, FlashError> {
        let properties = client.properties();
        let hardware = &properties.hardware;
        let plane_dim = hardware.plane_size_max as usize;
        if hardware.plane_size_min != hardware.plane_size_max || !plane_dim.is_power_of_two() || plane_dim > TILE * TILE {
            return Err(FlashError::Device(format!(
                "the kernels need a fixed plane size, a power of two up to 256; this device reports {} to {}",
                hardware.plane_size_min, hardware.plane_size_max
            )));
        }
        let storage = float_storage(dtype);
        let tensor_cores = matches!(dtype, DType::F16 | DType::BF16)
            && plane_dim == 32
            && properties.features.matmul.cmma.contains(&MmaConfig { a_type: storage, b_type: storage, cd_type: float_storage(DType::F32), m: 16, n: 16, k: 16 })
            && std::env::var(ENGINE_VARIABLE).as_deref() != Ok("plane");
        let engine = if tensor_cores { Engine::TensorCores } else { Engine::Plane };
        // A plane synchronises alone on CUDA only (WGSL has no such barrier).
        let plane_sync = R::name(client) == "cuda";
        let budget = Budget {
            shared_bytes: hardware.max_shared_memory_size,
            max_units: hardware.max_units_per_cube as usize,
            element_bytes: dtype.size(),
            plane_dim,
            plane_sync,
            causal,
            dim: problem.head_dim.div_ceil(TILE) * TILE,
            value_dim: problem.value_dim.div_ceil(TILE) * TILE,
        };
        Ok(Self {
            engine,
            forward: budget.blocks(Kernel::Forward)?,
            key_value: budget.blocks(Kernel::KeyValueGrad)?,
            query: budget.blocks(Kernel::QueryGrad)?,
        })
    }
}

pub(crate) fn float_storage(dtype: DType) -> StorageType {
    let kind = match dtype {
        DType::F16 => FloatKind::F16,
        DType::BF16 => FloatKind::BF16,
        _ => FloatKind::F32,
    };
    StorageType::Scalar(ElemType::Float(kind))
}

/// What a device allows a cube.
#[derive(Debug, Clone, Copy)]
struct Budget {
    shared_bytes: usize,
    max_units: usize,
    element_bytes: usize,
    plane_dim: usize,
    plane_sync: bool,
    causal: bool,
    dim: usize,
    value_dim: usize,
}

impl Budget {
    /// The first blocks that fit, trying whole head dims before chunks of them, then longer
    /// streamed tiles (fewer loop iterations and barriers per row) before more planes (rows
    /// per cube: more reuse of every staged tile). A large device fits the largest of both.
    fn blocks(&self, kernel: Kernel) -> Result<Blocks, FlashError> {
        let chunks = |dim: usize| -> Vec<usize> {
            let tiles = dim / TILE;
            (1..=tiles).rev().filter(|t| tiles % t == 0).map(|t| t * TILE).collect()
        };
        let (dim_chunks, value_chunks) = (chunks(self.dim), chunks(self.value_dim));
        let mut smallest = usize::MAX;
        for level in 0..dim_chunks.len().max(value_chunks.len()) {
            let dim_chunk = dim_chunks[level.min(dim_chunks.len() - 1)];
            let value_chunk = value_chunks[level.min(value_chunks.len() - 1)];
            for block_kv in [64, 32, 16] {
                for planes in [8, 4, 2, 1].into_iter().filter(|p| p * self.plane_dim <= self.max_units) {
                    let blocks = Blocks {
                        plane_dim: self.plane_dim,
                        planes,
                        block_kv,
                        dim: self.dim,
                        value_dim: self.value_dim,
                        dim_chunk,
                        value_chunk,
                        plane_sync: self.plane_sync,
                        causal: self.causal,
                        ranged: false,
                    };
                    let bytes = self.shared_bytes_of(kernel, &blocks);
                    smallest = smallest.min(bytes);
                    if bytes <= self.shared_bytes {
                        return Ok(blocks);
                    }
                }
            }
        }
        Err(FlashError::SharedMemory { needed: smallest, available: self.shared_bytes })
    }

    /// Shared memory of one cube of `kernel`.
    fn shared_bytes_of(&self, kernel: Kernel, blocks: &Blocks) -> usize {
        let e = self.element_bytes;
        let (rows, kv) = (blocks.block_rows(), blocks.block_kv);
        let (dc, vc) = (blocks.dim_chunk, blocks.value_chunk);
        let plane_tile = blocks.planes * TILE * kv;
        match kernel {
            // Q, K, V tiles; scores (f32) and probabilities (storage type) per plane.
            Kernel::Forward => (rows * dc + kv * dc + kv * vc) * e + plane_tile * (4 + e),
            // K, V (own rows), Q, dO (streamed); lse and delta; scores and dPᵀ (f32), Pᵀ/dSᵀ.
            Kernel::KeyValueGrad => (rows * dc + rows * vc + kv * dc + kv * vc) * e + 2 * kv * 4 + plane_tile * (8 + e),
            // Q, dO (own rows), K, V (streamed); scores and dP (f32), dS.
            Kernel::QueryGrad => (rows * dc + rows * vc + kv * dc + kv * vc) * e + plane_tile * (8 + e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(shared_bytes: usize, element_bytes: usize, plane_dim: usize, dim: usize) -> Budget {
        Budget { shared_bytes, max_units: 1024, element_bytes, plane_dim, plane_sync: false, causal: true, dim, value_dim: dim }
    }

    #[test]
    fn an_h100_keeps_whole_head_dims_and_eight_planes() {
        // 227 KiB, bf16, head dim 128.
        let blocks = budget(232_448, 2, 32, 128).blocks(Kernel::Forward).unwrap();
        assert_eq!((blocks.planes, blocks.block_kv, blocks.dim_chunk, blocks.value_chunk), (8, 64, 128, 128));
    }

    #[test]
    fn a_32_kib_device_chunks_large_head_dims_and_everything_fits() {
        for kernel in [Kernel::Forward, Kernel::KeyValueGrad, Kernel::QueryGrad] {
            for dim in [16, 64, 80, 128, 256] {
                for bytes in [2, 4] {
                    let budget = budget(32 * 1024, bytes, 8, dim);
                    let blocks = budget.blocks(kernel).unwrap();
                    assert!(budget.shared_bytes_of(kernel, &blocks) <= 32 * 1024);
                    assert_eq!(blocks.dim % blocks.dim_chunk, 0);
                }
            }
        }
        let blocks = budget(32 * 1024, 4, 8, 256).blocks(Kernel::Forward).unwrap();
        assert!(blocks.dim_chunk < 256, "{blocks:?}");
    }

    #[test]
    fn too_little_shared_memory_is_an_error_that_says_how_much() {
        let error = budget(1024, 4, 32, 256).blocks(Kernel::QueryGrad).unwrap_err().to_string();
        assert!(error.contains("1024"), "{error}");
    }
}
