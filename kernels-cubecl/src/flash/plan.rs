//! Tile sizes per device, dtype and head dims: the largest blocks whose shared memory fits
//! what the runtime reports, and tensor cores where the device has them for the dtype.

use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use cubecl::{
    features::MmaConfig,
    ir::{AddressType, ElemType, FloatKind, StorageType},
    prelude::*,
};

use super::{
    Problem,
    stage::{Blocks, ColumnPart, KeyValuePass},
    tile_ops::{Fragment, TILE},
};
use crate::FlashError;

/// What multiplies the tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Engine {
    /// Tensor cores (`cmma`) where the device reports fragments for the dtype with f32
    /// accumulation (see [`fragment_for`]), on a runtime whose barriers order shared memory
    /// for them (see [`tensor_core_runtime`]).
    TensorCores { fragment: Fragment },
    /// The plane's lanes, from shared memory: devices without tensor cores, and f32 in full
    /// precision (`ULYSSES_FLASH_ENGINE=plane`).
    Plane,
}

/// `tensor-cores-16`, `tensor-cores-8`, `tensor-cores-tf32` or `plane`: what tests expect
/// (`ULYSSES_EXPECT_ENGINE`) and the machine-code check reports.
impl std::fmt::Display for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Engine::TensorCores { fragment } if fragment.tf32 => f.write_str("tensor-cores-tf32"),
            Engine::TensorCores { fragment } if fragment.depth == fragment.edge => write!(f, "tensor-cores-{}", fragment.edge),
            Engine::TensorCores { fragment } => write!(f, "tensor-cores-{0}x{0}x{1}", fragment.edge, fragment.depth),
            Engine::Plane => f.write_str("plane"),
        }
    }
}

/// The three kernels' blocks for one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Plan {
    pub engine: Engine,
    pub forward: Blocks,
    pub key_value: Blocks,
    pub query: Blocks,
    /// Whether dK and dV take a launch each (see [`split_key_value`]).
    pub split_key_value: bool,
    /// The kernels' index width (the problem's largest tensor decides): 64-bit offsets take
    /// two registers each, which narrows the forward's column parts (see [`part_width`]).
    pub address_type: AddressType,
}

/// Accumulator tiles of 16 × 16 f32 a warp's registers hold before the compiler spills: each
/// is 8 registers per lane on tensor cores, so 16 tiles are 128 of the 255 a thread may use,
/// next to the scores', dP's and the addresses' (head dims 128 + 128 for dK and dV together
/// compile to 236-252 registers on sm_90a, without spills; 256 + 256 to 255 with 1.2-2.2 KB
/// spilled: `cargo test -p ulysses-cuda-check`). Fragments that take two product steps per
/// 16-deep tile (TF32's 16 × 16 × 8) hold each step's operand fragments, and f32 addresses and
/// staging cost more: dK + dV at 128 + 128 spill 16-32 B together, 64 + 128 do not; one output
/// of 256 columns (16 tiles) spills 16-120 B in every kernel, 128 columns nothing. The forward
/// with 64-bit indices holds 12 at most: its 256 columns of f16/bf16 spill 60 B at 255
/// registers there (sm_90a), 128 nothing; dQ's 16 tiles and dK's and dV's do not spill.
fn accumulator_tiles_in_registers(fragment: Fragment, kernel: Kernel, indices: AddressType) -> usize {
    let tiles = if fragment.depth < fragment.edge { 12 } else { 16 };
    if kernel == Kernel::Forward && indices == AddressType::U64 { tiles.min(12) } else { tiles }
}

/// Whether the dK/dV kernel runs as two launches, dV then dK, each recomputing the
/// probabilities (one more `Q·Kᵀ` for the pair: about a quarter more work in that kernel)
/// rather than spilling both accumulators to local memory. Only the tensor-core engine keeps
/// its accumulators in registers; the plane engine indexes its own at run time (local memory
/// either way).
pub fn split_key_value(engine: Engine, dim: usize, value_dim: usize) -> bool {
    match engine {
        // dK's and dV's budget is the same with 64-bit indices (no spill there: the check).
        Engine::TensorCores { fragment } => dim.div_ceil(TILE) + value_dim.div_ceil(TILE) > accumulator_tiles_in_registers(fragment, Kernel::KeyValueGrad, AddressType::U32),
        Engine::Plane => false,
    }
}

/// The columns one launch of `kernel` accumulates of an output `width` wide (a multiple of 16)
/// with `indices`: all of them where their accumulator tiles fit the registers, else the
/// widest equal parts of whole tiles that do, each part a launch of its own that recomputes
/// the scores (head dim 256 on TF32, or the forward's with 64-bit indices: two launches of 128
/// columns, the forward's and dQ's work about 1.5 times, dK's and dV's passes likewise). The
/// plane engine's accumulators are in local memory either way.
pub fn part_width(engine: Engine, kernel: Kernel, indices: AddressType, width: usize) -> usize {
    match engine {
        Engine::TensorCores { fragment } => {
            let tiles = width / TILE;
            let limit = accumulator_tiles_in_registers(fragment, kernel, indices);
            (1..=tiles).find(|parts| tiles % parts == 0 && tiles / parts <= limit).map_or(TILE, |parts| width / parts)
        }
        Engine::Plane => width,
    }
}

/// Which kernel a budget or a column part is for: each stages different tiles and holds
/// different registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    Forward,
    KeyValueGrad,
    QueryGrad,
}

/// The variable that chooses the engine ([`EngineRequest`]), read in one place.
const ENGINE_VARIABLE: &str = "ULYSSES_FLASH_ENGINE";

/// What `ULYSSES_FLASH_ENGINE` asks for. By default a call runs on the register-fragment
/// engine (FlashAttention-2's design), which an H200 ran 7.5–7.8 times as fast as the `cmma`
/// engine forward and 4.1–4.3 times backward (benches/RESULTS.md, "GPU: the fifth run"), where
/// the device runs `mma.sync` on the dtype (CUDA from sm_80) and the kernels take the case with
/// 32-bit indices (the 64-bit layout has run on lavapipe only, and the planned engine's 64-bit
/// kernels on an H100 past 2^32 elements, so those stay there until the fragments' have run
/// there too); elsewhere on the planned engines (`cmma` where the runtime has tensor cores,
/// else the plane engine).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EngineRequest {
    /// Unset: as above.
    Default,
    /// `fragments`: the register fragments wherever their kernels take the case, emulated on
    /// devices without `mma.sync` (how lavapipe runs them).
    Fragments,
    /// `planned`: never the register fragments (to compare the engines on one GPU).
    Planned,
    /// `plane`: the plane engine where tensor cores would be used (to compare them, or to keep
    /// f32 attention in full precision rather than TF32).
    Plane,
}

impl EngineRequest {
    /// The variable's request ([`parse`](Self::parse)).
    pub(crate) fn of_environment() -> Result<Self, FlashError> {
        match std::env::var(ENGINE_VARIABLE) {
            Ok(value) => Self::parse(Some(&value)),
            Err(std::env::VarError::NotPresent) => Self::parse(None),
            // Refused, named as it reads.
            Err(std::env::VarError::NotUnicode(value)) => Self::parse(Some(&value.to_string_lossy())),
        }
    }

    /// The request of the variable's `value`; an error naming the values it takes for any
    /// other (a misspelt engine would otherwise measure the default under another name).
    fn parse(value: Option<&str>) -> Result<Self, FlashError> {
        match value {
            None | Some("") => Ok(Self::Default),
            Some("fragments") => Ok(Self::Fragments),
            Some("planned") => Ok(Self::Planned),
            Some("plane") => Ok(Self::Plane),
            Some(other) => Err(FlashError::Setting(format!("{ENGINE_VARIABLE}={other:?}: the engine is `fragments`, `planned` or `plane` (unset: the fastest the device runs)"))),
        }
    }

    /// Whether a case runs on the register fragments: `takes`, the kernels take it;
    /// `mma_sync`, the device multiplies the dtype with `mma.sync`; `narrow`, its indices fit
    /// 32 bits.
    pub(crate) fn runs_fragments(self, takes: bool, mma_sync: bool, narrow: bool) -> bool {
        match self {
            Self::Default => takes && mma_sync && narrow,
            Self::Fragments => takes,
            Self::Planned | Self::Plane => false,
        }
    }
}

/// For tests only: `ULYSSES_FLASH_FRAGMENT=16` runs 16³ fragments (CUDA's f16/bf16 shape) on a
/// device that reports another size for the dtype, and `16x16x8` TF32's shape with the
/// storage type's operands (two product steps per tile, as TF32 takes). lavapipe reports 8³
/// and executes both correctly, though Vulkan leaves an unreported size undefined.
const FRAGMENT_VARIABLE: &str = "ULYSSES_FLASH_FRAGMENT";

/// `ULYSSES_FLASH_SKEW=N` pads each row of the shared tiles by N elements instead of
/// [`DEFAULT_SKEW`] (0: the unpadded layout), to measure the layouts against each other in one
/// run (the flash bench's `--skews`).
const SKEW_VARIABLE: &str = "ULYSSES_FLASH_SKEW";

/// Elements of padding after each row of a shared tile (see `TileUnit::stride`).
pub const DEFAULT_SKEW: usize = 8;

/// The skew [`SKEW_VARIABLE`] asks for, or the default; a value that keeps fragments 32-byte
/// aligned (a multiple of 8 elements) or an error naming it.
fn skew() -> Result<usize, FlashError> {
    match std::env::var(SKEW_VARIABLE) {
        Err(_) => Ok(DEFAULT_SKEW),
        Ok(text) => match text.parse::<usize>() {
            Ok(skew) if skew % 8 == 0 && skew <= 64 => Ok(skew),
            _ => Err(FlashError::Setting(format!("{SKEW_VARIABLE}={text:?}: the padding must be a multiple of 8 elements from 0 to 64"))),
        },
    }
}

/// The fragment [`FRAGMENT_VARIABLE`] forces on f16/bf16, if any; any other value is refused
/// by name (a misspelt one would measure the default under another name).
fn forced_fragment() -> Result<Option<Fragment>, FlashError> {
    match std::env::var(FRAGMENT_VARIABLE) {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Ok(value) => parse_fragment(&value),
        Err(std::env::VarError::NotUnicode(value)) => parse_fragment(&value.to_string_lossy()),
    }
}

fn parse_fragment(value: &str) -> Result<Option<Fragment>, FlashError> {
    match value {
        "" => Ok(None),
        "16" => Ok(Some(Fragment::cube(16))),
        "16x16x8" => Ok(Some(Fragment { depth: 8, ..Fragment::cube(16) })),
        other => Err(FlashError::Setting(format!("{FRAGMENT_VARIABLE}={other:?}: the fragment is `16` or `16x16x8` (unset: the device's)"))),
    }
}

/// Whether the tensor-core engine's synchronisation is sound on the runtime called `name`.
/// It moves fragments through shared memory between lanes, so each barrier must order
/// memory. CUDA's `__syncwarp` and `__syncthreads` do, and there a plane may synchronise
/// alone. SPIR-V (wgpu on Vulkan) runs it with the cube's barrier only, which CubeCL emits with
/// workgroup memory semantics (its plane barrier is a relaxed one). WGSL has no cooperative
/// matrices; other runtimes run the plane engine.
pub fn tensor_core_runtime(name: &str) -> bool {
    matches!(name, "cuda" | "wgpu<spirv>")
}

/// The fragment for `dtype` on a device with these cmma configurations, accumulating in f32:
/// for f16 and bf16, 16³ where offered, else 8³; for f32, TF32's 16 × 16 × 8 (CUDA from
/// sm_80: 10 bits of mantissa in the products, as PyTorch's `allow_tf32`; the plane engine
/// keeps full precision). None: the plane engine.
pub fn fragment_for(configurations: &[MmaConfig], dtype: DType) -> Option<Fragment> {
    let accumulator = float_storage(DType::F32);
    let offered = |operand: StorageType, fragment: Fragment| {
        let (edge, depth) = (fragment.edge as u32, fragment.depth as u32);
        configurations.contains(&MmaConfig { a_type: operand, b_type: operand, cd_type: accumulator, m: edge, n: edge, k: depth })
    };
    match dtype {
        DType::F16 | DType::BF16 => [16, 8].into_iter().map(Fragment::cube).find(|&fragment| offered(float_storage(dtype), fragment)),
        DType::F32 => Some(Fragment::TF32).filter(|&fragment| offered(StorageType::Scalar(ElemType::Float(FloatKind::TF32)), fragment)),
        _ => None,
    }
}

impl Plan {
    pub fn new<R: CubeRuntime>(problem: &Problem, dtype: DType, causal: bool, client: &ComputeClient<R>) -> Result<Self, FlashError> {
        // The environment's settings first: a misspelt one stops on every device.
        let plane_requested = EngineRequest::of_environment()? == EngineRequest::Plane;
        let forced = forced_fragment()?;
        let skew = skew()?;
        let properties = client.properties();
        let hardware = &properties.hardware;
        let plane_dim = hardware.plane_size_max as usize;
        if hardware.plane_size_min != hardware.plane_size_max || !plane_dim.is_power_of_two() || plane_dim > TILE * TILE {
            return Err(FlashError::Device(format!(
                "the kernels need a fixed plane size, a power of two up to 256; this device reports {} to {}",
                hardware.plane_size_min, hardware.plane_size_max
            )));
        }
        let runtime = R::name(client);
        let configurations: Vec<MmaConfig> = properties.features.matmul.cmma.iter().copied().collect();
        let fragment = fragment_for(&configurations, dtype)
            .filter(|_| tensor_core_runtime(runtime) && !plane_requested)
            .map(|fragment| if fragment.tf32 { fragment } else { forced.unwrap_or(fragment) });
        let engine = match fragment {
            Some(fragment) => Engine::TensorCores { fragment },
            None => Engine::Plane,
        };
        // A plane synchronises alone on CUDA only (WGSL has no such barrier, SPIR-V's is relaxed).
        let plane_sync = runtime == "cuda";
        let budget = Budget {
            fragment: fragment.unwrap_or(Fragment::cube(TILE)),
            shared_bytes: hardware.max_shared_memory_size,
            max_units: hardware.max_units_per_cube as usize,
            element_bytes: dtype.size(),
            plane_dim,
            plane_sync,
            skew,
            causal,
            dim: problem.head_dim.div_ceil(TILE) * TILE,
            value_dim: problem.value_dim.div_ceil(TILE) * TILE,
        };
        Ok(Self {
            engine,
            forward: budget.blocks(Kernel::Forward)?,
            key_value: budget.blocks(Kernel::KeyValueGrad)?,
            query: budget.blocks(Kernel::QueryGrad)?,
            split_key_value: split_key_value(engine, problem.head_dim, problem.value_dim),
            address_type: problem.address_type(),
        })
    }
}

impl Plan {
    /// The column parts of `kernel`'s launches for an output `width` wide (padded to 16):
    /// `[None]` where one launch takes every column (see [`part_width`]).
    pub fn column_parts(&self, kernel: Kernel, width: usize) -> Vec<Option<ColumnPart>> {
        ColumnPart::cover(width, part_width(self.engine, kernel, self.address_type, width))
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
    fragment: Fragment,
    shared_bytes: usize,
    max_units: usize,
    element_bytes: usize,
    plane_dim: usize,
    plane_sync: bool,
    skew: usize,
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
                        skew: self.skew,
                        fragment: self.fragment,
                        causal: self.causal,
                        ranged: false,
                        key_value_pass: KeyValuePass::Both,
                        part: None,
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
        // Every shared tile's rows are padded (`TileUnit::stride`).
        let unit = blocks.unit();
        let (rows, kv) = (blocks.block_rows(), blocks.block_kv);
        let (dc, vc) = (unit.stride(blocks.dim_chunk), unit.stride(blocks.value_chunk));
        let plane_tile = blocks.planes * TILE * unit.stride(kv);
        match kernel {
            // Q, K, V tiles; scores (f32) and probabilities (storage type) per plane; a
            // rescale flag (u32) per plane.
            Kernel::Forward => (rows * dc + kv * dc + kv * vc) * e + plane_tile * (4 + e) + blocks.planes * 4,
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
        Budget { fragment: Fragment::cube(TILE), shared_bytes, max_units: 1024, element_bytes, plane_dim, plane_sync: false, skew: DEFAULT_SKEW, causal: true, dim, value_dim: dim }
    }

    #[test]
    fn the_fragments_run_by_default_only_on_mma_sync_with_32_bit_indices() {
        use EngineRequest::*;
        // (choice, takes, mma_sync, narrow) → runs on the fragments.
        for (choice, takes, mma_sync, narrow, runs) in [
            (Default, true, true, true, true),
            (Default, true, false, true, false),
            (Default, true, true, false, false),
            (Default, false, true, true, false),
            (Fragments, true, false, false, true),
            (Fragments, false, true, true, false),
            (Planned, true, true, true, false),
            (Plane, true, true, true, false),
        ] {
            assert_eq!(choice.runs_fragments(takes, mma_sync, narrow), runs, "{choice:?}, takes {takes}, mma.sync {mma_sync}, 32-bit {narrow}");
        }
        let parsed = [None, Some(""), Some("fragments"), Some("planned"), Some("plane")].map(|value| EngineRequest::parse(value).unwrap());
        assert_eq!(parsed, [Default, Default, Fragments, Planned, Plane]);
        let refusal = EngineRequest::parse(Some("fragment")).unwrap_err().to_string();
        assert!(refusal.contains("ULYSSES_FLASH_ENGINE=\"fragment\"") && refusal.contains("`planned`"), "{refusal}");
        assert_eq!(parse_fragment("16").unwrap().map(|f| f.depth), Some(16));
        assert_eq!(parse_fragment("16x16x8").unwrap().map(|f| f.depth), Some(8));
        assert!(parse_fragment("").unwrap().is_none());
        let refusal = parse_fragment("16x8").unwrap_err();
        assert!(matches!(refusal, FlashError::Setting(_)) && refusal.to_string().contains("ULYSSES_FLASH_FRAGMENT=\"16x8\""), "{refusal}");
    }

    #[test]
    fn an_h100_keeps_whole_head_dims_and_eight_planes() {
        // 227 KiB, bf16, head dim 128.
        let blocks = budget(232_448, 2, 32, 128).blocks(Kernel::Forward).unwrap();
        assert_eq!((blocks.planes, blocks.block_kv, blocks.dim_chunk, blocks.value_chunk), (8, 64, 128, 128));
    }

    #[test]
    fn a_bad_skew_is_refused_by_name() {
        // The variable is read per plan; only this test sets it.
        // SAFETY: no other test of this binary reads or writes ULYSSES_FLASH_SKEW.
        unsafe { std::env::set_var(SKEW_VARIABLE, "4") };
        let error = skew().unwrap_err().to_string();
        unsafe { std::env::remove_var(SKEW_VARIABLE) };
        assert!(error.contains("ULYSSES_FLASH_SKEW") && error.contains("multiple of 8"), "{error}");
        assert_eq!(skew().unwrap(), DEFAULT_SKEW);
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

    fn cmma(dtype: DType, edge: u32) -> MmaConfig {
        MmaConfig { a_type: float_storage(dtype), b_type: float_storage(dtype), cd_type: float_storage(DType::F32), m: edge, n: edge, k: edge }
    }

    #[test]
    fn fragments_are_the_devices_own_16_before_8() {
        // NVIDIA reports 16³ (among others), lavapipe 26.1 only 8³ and only for f16.
        let nvidia = [cmma(DType::F16, 16), cmma(DType::BF16, 16), cmma(DType::F16, 8)];
        assert_eq!(fragment_for(&nvidia, DType::BF16), Some(Fragment::cube(16)));
        assert_eq!(fragment_for(&nvidia, DType::F16), Some(Fragment::cube(16)));
        let lavapipe = [cmma(DType::F16, 8)];
        assert_eq!(fragment_for(&lavapipe, DType::F16), Some(Fragment::cube(8)));
        assert_eq!(fragment_for(&lavapipe, DType::BF16), None);
        assert_eq!(fragment_for(&lavapipe, DType::F32), None);
        // f16 accumulation is not what the kernels need.
        let f16_accumulator = [MmaConfig { cd_type: float_storage(DType::F16), ..cmma(DType::F16, 16) }];
        assert_eq!(fragment_for(&f16_accumulator, DType::F16), None);
    }

    #[test]
    fn f32_runs_on_tf32_fragments_where_the_device_offers_them() {
        let tf32 = StorageType::Scalar(ElemType::Float(FloatKind::TF32));
        let ampere = [cmma(DType::F16, 16), MmaConfig { a_type: tf32, b_type: tf32, cd_type: float_storage(DType::F32), m: 16, n: 16, k: 8 }];
        assert_eq!(fragment_for(&ampere, DType::F32), Some(Fragment::TF32));
        assert_eq!(Engine::TensorCores { fragment: Fragment::TF32 }.to_string(), "tensor-cores-tf32");
        // A device without TF32 (before sm_80) runs f32 on the plane engine.
        assert_eq!(fragment_for(&ampere[..1], DType::F32), None);
    }

    #[test]
    fn tensor_cores_only_where_barriers_order_memory() {
        assert!(tensor_core_runtime("cuda"));
        assert!(tensor_core_runtime("wgpu<spirv>"));
        for other in ["wgpu<wgsl>", "wgpu<msl>", "hip", "cpu"] {
            assert!(!tensor_core_runtime(other), "{other}");
        }
    }

    #[test]
    fn dk_and_dv_take_a_launch_each_only_where_their_accumulators_would_spill() {
        let cores = Engine::TensorCores { fragment: Fragment::cube(16) };
        assert!(!split_key_value(cores, 128, 128));
        assert!(!split_key_value(cores, 64, 128));
        assert!(split_key_value(cores, 256, 256));
        assert!(split_key_value(cores, 256, 64));
        assert!(!split_key_value(Engine::Plane, 256, 256));
        let tf32 = Engine::TensorCores { fragment: Fragment::TF32 };
        assert!(split_key_value(tf32, 128, 128));
        assert!(!split_key_value(tf32, 64, 128));
    }

    #[test]
    fn outputs_too_wide_for_the_registers_take_a_launch_per_part() {
        let cores = Engine::TensorCores { fragment: Fragment::cube(16) };
        let tf32 = Engine::TensorCores { fragment: Fragment::TF32 };
        let narrow = |engine, width| part_width(engine, Kernel::QueryGrad, AddressType::U32, width);
        for width in [16, 64, 128, 256] {
            assert_eq!(narrow(cores, width), width);
            assert_eq!(narrow(Engine::Plane, width), width);
        }
        assert_eq!(narrow(tf32, 128), 128);
        assert_eq!(narrow(tf32, 192), 192);
        assert_eq!(narrow(tf32, 256), 128);
        assert_eq!(narrow(cores, 512), 256);
        // 20 tiles: two parts of 10 on TF32 (12 at most per launch).
        assert_eq!(narrow(tf32, 320), 160);
        // TF32's shape with f16 operands, as the tensor-core tests on the CPU force it.
        let two_steps = Engine::TensorCores { fragment: Fragment { depth: 8, ..Fragment::cube(16) } };
        assert_eq!(narrow(two_steps, 256), 128);
        // The forward with 64-bit indices: 256 columns in two parts, 128 whole; the backward's
        // kernels and 32-bit indices keep 256 whole.
        assert_eq!(part_width(cores, Kernel::Forward, AddressType::U64, 256), 128);
        assert_eq!(part_width(cores, Kernel::Forward, AddressType::U64, 128), 128);
        assert_eq!(part_width(cores, Kernel::Forward, AddressType::U32, 256), 256);
        assert_eq!(part_width(cores, Kernel::QueryGrad, AddressType::U64, 256), 256);
    }

    #[test]
    fn too_little_shared_memory_is_an_error_that_says_how_much() {
        let error = budget(1024, 4, 32, 256).blocks(Kernel::QueryGrad).unwrap_err().to_string();
        assert!(error.contains("1024"), "{error}");
    }
}
