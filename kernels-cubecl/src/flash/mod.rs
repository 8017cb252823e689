//! Host side of the flash-attention kernels: checks, tile sizes and launches on burn's
//! CubeCL tensors.

mod backward;
mod forward;
mod fragment_forward;
mod fragment_key_value_grad;
mod fragment_query_grad;
mod fragment_tiles;
mod plan;
pub(crate) mod stage;
pub mod tile_ops;
mod visibility;

use burn::tensor::{DType, Shape};
use burn_cubecl::{
    CubeRuntime,
    kernel::into_contiguous,
    ops::numeric::{empty_device_contiguous_dtype, zeros_client},
    tensor::CubeTensor,
};
use cubecl::prelude::*;

use crate::FlashError;
use backward::{key_value_grad_kernel, query_grad_kernel};
use forward::flash_forward_kernel;
pub use plan::{Engine, Plan};
pub use tile_ops::Fragment;
use stage::{Blocks, ColumnPart, KeyValuePass};
use fragment_tiles::FragmentKernel;
use tile_ops::TILE;
pub use visibility::VisibleRanges;

/// Largest head dim (and value dim) the kernels accept.
pub const MAX_HEAD_DIM: usize = 256;

/// Longest sequence (of q, or of k and v) the kernels accept: positions and the runs of
/// [`VisibleRanges`] are 32-bit, and the kernels add two of them (2^31 − 1).
pub const MAX_SEQUENCE: usize = i32::MAX as usize;

/// Options of one attention call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlashOptions {
    /// Multiplies `q·k`; `None` is `1/sqrt(head_dim)`.
    pub scale: Option<f64>,
    /// Bottom-right aligned causal mask, as burn's `is_causal`.
    pub causal: bool,
}

/// Shapes of one call, checked.
#[derive(Debug, Clone, Copy)]
pub struct Problem {
    pub batch: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub seq_q: usize,
    pub seq_kv: usize,
    pub head_dim: usize,
    pub value_dim: usize,
    pub scale: f32,
}

/// Shape and dtype of an operand, all the checks need: a fusion stream records work before
/// it runs, so it asks [`plan_flash_attention`] before it records a kernel.
#[derive(Debug, Clone, Copy)]
pub struct OperandInfo<'a> {
    pub shape: &'a [usize],
    pub dtype: DType,
}

/// The engine and blocks [`flash_attention_forward`] and [`flash_attention_backward`] would run
/// for q, k and v of these shapes and dtype on `client`'s device, or the error they would
/// return (a fusion stream asks before it records a kernel; tests assert the engine with it).
pub fn plan_flash_attention<R: CubeRuntime>(
    client: &ComputeClient<R>,
    query: OperandInfo,
    key: OperandInfo,
    value: OperandInfo,
    options: &FlashOptions,
) -> Result<Plan, FlashError> {
    let problem = Problem::new(client, query, key, value, options)?;
    Plan::new(&problem, query.dtype, options.causal, client)
}

impl Problem {
    fn of_tensors<R: CubeRuntime>(
        query: &CubeTensor<R>,
        key: &CubeTensor<R>,
        value: &CubeTensor<R>,
        options: &FlashOptions,
    ) -> Result<Self, FlashError> {
        let (q, k, v) = (query.meta.shape().to_vec(), key.meta.shape().to_vec(), value.meta.shape().to_vec());
        let info = |shape, tensor: &CubeTensor<R>| OperandInfo { shape, dtype: tensor.dtype };
        Self::new(&query.client, info(&q, query), info(&k, key), info(&v, value), options)
    }

    /// Checks q, k and v of these shapes and dtypes for `client`'s device.
    pub fn new<R: CubeRuntime>(
        client: &ComputeClient<R>,
        query: OperandInfo,
        key: OperandInfo,
        value: OperandInfo,
        options: &FlashOptions,
    ) -> Result<Self, FlashError> {
        let (q, k, v) = (query.shape, key.shape, value.shape);
        if q.len() != 4 || k.len() != 4 || v.len() != 4 {
            return Err(FlashError::Shape(format!("q, k and v must be 4-D [batch, heads, seq, dim]; got {q:?}, {k:?}, {v:?}")));
        }
        if k[0] != q[0] || v[0] != q[0] || k[1] != v[1] || k[2] != v[2] || k[3] != q[3] {
            return Err(FlashError::Shape(format!(
                "k and v must be [batch, kv_heads, kv_seq, _] with q's batch, and k must have q's head dim; got q {q:?}, k {k:?}, v {v:?}"
            )));
        }
        if k[1] == 0 || q[1] % k[1] != 0 {
            return Err(FlashError::Shape(format!("kv heads ({}) must divide q heads ({})", k[1], q[1])));
        }
        for (name, dim) in [("head dim", q[3]), ("value dim", v[3])] {
            if dim == 0 || dim > MAX_HEAD_DIM {
                return Err(FlashError::HeadDim { name, dim });
            }
        }
        for (name, dtype) in [("q", query.dtype), ("k", key.dtype), ("v", value.dtype)] {
            if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) || dtype != query.dtype {
                return Err(FlashError::DType { name, dtype, query: query.dtype });
            }
        }
        if q[0] == 0 || q[1] == 0 || q[2] == 0 || k[2] == 0 {
            return Err(FlashError::Shape(format!("empty attention: q {q:?}, k {k:?}")));
        }
        if !client.properties().supports_type(plan::float_storage(query.dtype)) {
            return Err(FlashError::DType { name: "q", dtype: query.dtype, query: query.dtype });
        }
        let scale = options.scale.unwrap_or(1.0 / (q[3] as f64).sqrt()) as f32;
        // A NaN scale masked every score (the planned engine's output zeros), an infinite one
        // made NaN: neither is an attention.
        if !scale.is_finite() {
            return Err(FlashError::Shape(format!("the attention scale {:?} is not a finite f32 number", options.scale)));
        }
        let problem = Self { batch: q[0], q_heads: q[1], kv_heads: k[1], seq_q: q[2], seq_kv: k[2], head_dim: q[3], value_dim: v[3], scale };
        problem.check_indexing(client.properties().supports_address(AddressType::U64), R::name(client))?;
        Ok(problem)
    }

    /// Elements of the call's largest tensor: q, k, v, the output or one of their gradients.
    pub fn largest_tensor(&self) -> usize {
        let rows_q = self.batch * self.q_heads * self.seq_q;
        let rows_kv = self.batch * self.kv_heads * self.seq_kv;
        [rows_q * self.head_dim, rows_q * self.value_dim, rows_kv * self.head_dim, rows_kv * self.value_dim].into_iter().max().unwrap_or(0)
    }

    /// Whether a tensor of `values` a query row, its heads padded by up to a step of rows
    /// (`fragment_key_value_grad::summed_rows`), is indexed by the call's index width as its
    /// other tensors are: not where 32-bit indices index heads of a few rows each, by the
    /// hundred thousand.
    fn padded_rows_indexable(&self, values: usize) -> bool {
        let rows = self.batch * self.q_heads * fragment_key_value_grad::summed_rows(self.seq_q, fragment_tiles::MAX_STEP);
        self.address_type() == AddressType::U64 || AddressType::from_len_signed(rows * values) == AddressType::U32
    }

    /// Whether the f32 sum of dQ that dK/dV's kernel may add up is indexable
    /// ([`padded_rows_indexable`](Self::padded_rows_indexable)); where not, dQ takes its own
    /// kernel.
    fn sum_of_query_grad_indexable(&self) -> bool {
        self.padded_rows_indexable(self.head_dim)
    }

    /// The index width the kernels are compiled with: 32 bits while every tensor holds fewer
    /// than 2^31 elements, 64 beyond. Offsets into a tensor stay below its length, but the
    /// kernels also form sums past one (a row's offset plus a column, two table entries per
    /// row), which the factor of two leaves room for; 32-bit indices are kept where they
    /// suffice because they are cheaper (registers, and integer multiplies).
    pub fn address_type(&self) -> AddressType {
        AddressType::from_len_signed(self.largest_tensor())
    }

    /// `Ok` when the kernels can index this call on a device that has (or lacks) 64-bit
    /// indices; otherwise which limit it passes.
    pub fn check_indexing(&self, device_has_u64: bool, runtime: &'static str) -> Result<(), FlashError> {
        for seq in [self.seq_q, self.seq_kv] {
            if seq > MAX_SEQUENCE {
                return Err(FlashError::SequenceLength { seq });
            }
        }
        if self.address_type() == AddressType::U64 && !device_has_u64 {
            return Err(FlashError::Indexing { elements: self.largest_tensor(), runtime });
        }
        Ok(())
    }
}

/// A grid of `cubes` cubes that no dimension overflows: X up to the device's limit, the rest
/// in Y. Kernels recover their index as `y · count_x + x` and skip indices past `cubes`.
pub(crate) fn grid<R: CubeRuntime>(client: &ComputeClient<R>, cubes: usize) -> Result<CubeCount, FlashError> {
    let (max_x, max_y, _) = client.properties().hardware.max_cube_count;
    // The kernels place a cube from its index in 32 bits (`stage::cube_place`); below 2^31
    // cubes, the grid's x · y, rounded up to a whole row of x, stays below 2^32.
    if cubes > i32::MAX as usize {
        return Err(FlashError::Shape(format!("{cubes} blocks of rows exceed the 2^31 a launch takes")));
    }
    let x = cubes.clamp(1, max_x as usize);
    let y = cubes.div_ceil(x);
    if y > max_y as usize {
        return Err(FlashError::Shape(format!("{cubes} blocks of rows exceed the device's grid")));
    }
    Ok(CubeCount::Static(x as u32, y as u32, 1))
}

/// The widest vectorised read that every tensor allows along its last dimension.
fn vector_size<R: CubeRuntime>(client: &ComputeClient<R>, tensors: &[&CubeTensor<R>]) -> usize {
    tensors
        .iter()
        .map(|t| {
            cubecl::tensor_vector_size_parallel(client.io_optimized_vector_sizes(t.dtype.size()), &t.meta.shape().clone(), &t.meta.strides().clone(), 3)
        })
        .min()
        .unwrap_or(1)
        .min(TILE)
}

fn cube_dim(blocks: &Blocks) -> CubeDim {
    CubeDim::new_2d(blocks.plane_dim as u32, blocks.planes as u32)
}

/// Launches `kernel` with the tile engine of `plan`.
macro_rules! launch_with_engine {
    ($plan:expr, $kernel:ident, $client:expr, $($arg:expr),* $(,)?) => {
        match $plan.engine {
            // SAFETY: every index is bounded by the staging checks against the shapes (the
            // tests compare every output with a host reference, masks and ragged ends included).
            Engine::TensorCores { .. } => unsafe { $kernel::launch_unchecked::<tile_ops::CmmaTiles, R>($client, $($arg),*) },
            Engine::Plane => unsafe { $kernel::launch_unchecked::<tile_ops::PlaneTiles, R>($client, $($arg),*) },
        }
    };
}

/// The device tables of `ranges` (checked against the call), or placeholders without.
fn range_tables<R: CubeRuntime>(ranges: Option<&VisibleRanges>, p: &Problem, client: &ComputeClient<R>, device: &R::Device) -> Result<[CubeTensor<R>; 2], FlashError> {
    Ok(match ranges {
        Some(ranges) => {
            ranges.check(p.batch, p.seq_q, p.seq_kv)?;
            ranges.upload(client, device)
        }
        None => [visibility::no_ranges(client, device), visibility::no_ranges(client, device)],
    })
}

/// Why the register-fragment kernels ([`flash_attention_forward_fragments`],
/// [`flash_attention_backward_fragments`]) do not take a call in `dtype` of problem `p`, if
/// they do not.
fn fragments_refusal(dtype: DType, p: &Problem) -> Option<String> {
    let takes = matches!(dtype, DType::F16 | DType::BF16) && p.head_dim == p.value_dim && matches!(p.head_dim, 64 | 128 | 256);
    if !takes {
        return Some(format!(
            "the register-fragment kernels take f16 or bf16 with head and value dims of 64, 128 or 256 (so far), got {dtype:?}, {} and {}",
            p.head_dim, p.value_dim
        ));
    }
    (!fragment_tiles::SCALES.contains(&p.scale)).then(|| {
        format!(
            "the register-fragment kernels take softmax scales from {:e} to {:e} (they take maxima before scaling), got {}",
            fragment_tiles::SCALES.start(),
            fragment_tiles::SCALES.end(),
            p.scale
        )
    })
}

/// Why the register-fragment backward does not take call `p`: [`fragments_refusal`], or the
/// row statistics dK/dV reads (2 values a query row, its heads padded:
/// `fragment_key_value_grad::row_statistics_kernel`) past the call's index width.
fn backward_fragments_refusal(dtype: DType, p: &Problem) -> Option<String> {
    fragments_refusal(dtype, p).or_else(|| {
        (!p.padded_rows_indexable(2)).then(|| {
            format!(
                "the register-fragment backward pads each head's query rows, and {} heads of {} rows padded so pass 32-bit indices",
                p.batch * p.q_heads,
                p.seq_q
            )
        })
    })
}

/// Attention's forward on the register-fragment engine (FlashAttention-2's design,
/// `fragment_forward.rs`): output `[B, Hq, Sq, D]` in the inputs' dtype and log-sum-exp
/// `[B, Hq, Sq]` in f32, as [`flash_attention_forward`] gives them, `ranges` restricting the
/// keys each row sees as there. f16 or bf16, head dim (and value dim) 64, 128 or 256 (two
/// launches of 128 output columns, each computing the scores). [`flash_attention_forward`]
/// chooses it where the device runs `mma.sync` (`plan::EngineRequest`); this runs it whatever
/// the device (emulated without `mma.sync`).
pub fn flash_attention_forward_fragments<R: CubeRuntime>(
    query: CubeTensor<R>,
    key: CubeTensor<R>,
    value: CubeTensor<R>,
    options: FlashOptions,
    ranges: Option<&VisibleRanges>,
) -> Result<(CubeTensor<R>, CubeTensor<R>), FlashError> {
    flash_attention_forward_fragments_laid_out_for(query, key, value, options, ranges, None, false)
}

/// For tests and the bench: [`flash_attention_forward_fragments`] with its kernel's registers
/// laid out as for indices of width `layout` (`fragment_tiles::held_columns`; `None`: the
/// call's), so that lavapipe runs the 64-bit layout (Q read as the scores need it at head dim
/// 256) too; `one_row_tile`: 16 query rows a warp with Q's fragments held in registers, where
/// the launch would stage Q for 32 (`fragment_tiles::Staging::row_tiles`), the two side by side.
#[doc(hidden)]
pub fn flash_attention_forward_fragments_laid_out_for<R: CubeRuntime>(
    query: CubeTensor<R>,
    key: CubeTensor<R>,
    value: CubeTensor<R>,
    options: FlashOptions,
    ranges: Option<&VisibleRanges>,
    layout: Option<AddressType>,
    one_row_tile: bool,
) -> Result<(CubeTensor<R>, CubeTensor<R>), FlashError> {
    let p = Problem::of_tensors(&query, &key, &value, &options)?;
    if let Some(refusal) = fragments_refusal(query.dtype, &p) {
        return Err(FlashError::Shape(refusal));
    }
    let layout = layout.unwrap_or(p.address_type());
    fragment_forward(p, query, key, value, options, ranges, layout, one_row_tile)
}

/// Launches register-fragment kernel `$kernel` (a module `#[cube(launch)]` made) with the
/// arguments `($args)`, then the two the fragment implementation decides: `mma.sync`
/// ([`MmaSync`](crate::mma::MmaSync)) where [`FragmentLaunch`] `$l` chose it, with its loops
/// unrolled, else the emulation in shared memory with them rolled; and `$l`'s element type.
macro_rules! launch_fragments {
    ($kernel:ident, $runtime:ident, $l:expr, ($($arg:expr),* $(,)?)) => {
        if $l.mma_sync {
            $kernel::launch::<crate::mma::MmaSync, $runtime>($($arg,)* true, $l.elem)
        } else {
            $kernel::launch::<crate::mma::SharedMemoryMma, $runtime>($($arg,)* false, $l.elem)
        }
    };
}

/// [`flash_attention_forward_fragments`] of a checked call `p` that the fragments take, its
/// registers laid out for indices of width `layout` ([`FragmentLaunch::new`]), one row tile a
/// warp where `one_row_tile`.
#[allow(clippy::too_many_arguments)]
fn fragment_forward<R: CubeRuntime>(
    p: Problem,
    query: CubeTensor<R>,
    key: CubeTensor<R>,
    value: CubeTensor<R>,
    options: FlashOptions,
    ranges: Option<&VisibleRanges>,
    layout: AddressType,
    one_row_tile: bool,
) -> Result<(CubeTensor<R>, CubeTensor<R>), FlashError> {
    let dtype = query.dtype;
    let (query, key, value) = (into_contiguous(query), into_contiguous(key), into_contiguous(value));
    let client = query.client.clone();
    let device = query.device.clone();
    let output = empty_device_contiguous_dtype(client.clone(), device.clone(), Shape::new([p.batch, p.q_heads, p.seq_q, p.value_dim]), dtype);
    let lse = empty_device_contiguous_dtype(client.clone(), device, Shape::new([p.batch, p.q_heads, p.seq_q]), DType::F32);
    if p.seq_q == 0 {
        return Ok((output, lse));
    }
    let [row_keys, _] = range_tables(ranges, &p, &client, &query.device)?;
    let l = FragmentLaunch::new(&client, dtype, &p, FragmentKernel::Forward, layout, false, !one_row_tile, None)?;
    crate::stats::FORWARD.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    use fragment_forward::fragment_forward_kernel as kernel;
    let arg = |tensor: &CubeTensor<R>| tensor.clone().into_tensor_arg();
    for part in fragment_tiles::column_parts(p.head_dim, l.register_columns) {
        let args = (arg(&query), arg(&key), arg(&value), arg(&output), arg(&lse), arg(&row_keys));
        launch_fragments!(kernel, R, l, (&client, l.count.clone(), l.dim, p.address_type(), args.0, args.1, args.2, args.3, args.4, args.5, p.scale, p.head_dim, l.staging, l.held_columns, part, options.causal, ranges.is_some()));
    }
    Ok((output, lse))
}

/// What a register-fragment kernel's launch takes from the device and the call: whether the
/// product runs on `mma.sync` (else emulated, with the loops kept rolled), the step of its loop
/// (keys; queries for dK/dV) and its buffers, the widest outputs it accumulates in registers
/// (its column parts) and rows it keeps there, the grid of blocks of 64 or 128 rows (of queries; of keys
/// for dK/dV), the cube of 4 warps (8 in dK/dV's wide block) and the element type.
struct FragmentLaunch {
    mma_sync: bool,
    staging: fragment_tiles::Staging,
    /// f32 values per atomic of dK/dV's sum of dQ (where `staging.query_grad`).
    sum_vector: usize,
    register_columns: usize,
    held_columns: usize,
    count: CubeCount,
    dim: CubeDim,
    elem: StorageType,
}

/// Where dK/dV's kernel stores each step's dS for dQ's sum (`Staging::score_grads_first`):
/// 0 as the launch decides, 1 first, 2 after dK's product (the tests run both orders on
/// lavapipe: [`crate::testing::store_score_grads_first`]).
static SCORE_GRADS_FIRST: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// The order [`SCORE_GRADS_FIRST`] asks for, if any.
fn score_grads_first() -> Option<bool> {
    match SCORE_GRADS_FIRST.load(std::sync::atomic::Ordering::Relaxed) {
        1 => Some(true),
        2 => Some(false),
        _ => None,
    }
}

/// Asks dK/dV's launches for an order of its dS store (`None`: the launch's own), for tests.
pub(crate) fn set_score_grads_first(first: Option<bool>) {
    SCORE_GRADS_FIRST.store(first.map_or(0, |first| if first { 1 } else { 2 }), std::sync::atomic::Ordering::Relaxed);
}

impl FragmentLaunch {
    /// `layout`: the index width whose register layout the kernel takes (the call's, but for
    /// tests: [`flash_attention_forward_fragments_laid_out_for`],
    /// [`flash_attention_backward_fragments_laid_out_for`]).
    /// `atomic_sums`: whether the launch may sum with atomics where the device has them (dK/dV
    /// summing dQ: `fragment_tiles::Staging::query_grad`). `stage_rows`: whether it may stage
    /// the block's own rows in shared memory (`fragment_tiles::Staging::rows_shared`).
    /// `key_warps`: dK/dV's warps a block where asked for, else the planner's
    /// (`fragment_tiles::key_step`).
    #[allow(clippy::too_many_arguments)]
    fn new<R: CubeRuntime>(
        client: &ComputeClient<R>,
        dtype: DType,
        p: &Problem,
        kernel: FragmentKernel,
        layout: AddressType,
        atomic_sums: bool,
        stage_rows: bool,
        key_warps: Option<usize>,
    ) -> Result<Self, FlashError> {
        let mma_sync = crate::mma::has_mma_sync(client, dtype);
        let shared_limit = client.properties().hardware.max_shared_memory_size;
        let register_columns = fragment_tiles::register_columns(kernel, layout);
        let mut staging = fragment_tiles::key_step(kernel, p.head_dim, register_columns, mma_sync, atomic_sums && adds_f32_atomically(client), stage_rows, key_warps, dtype.size(), shared_limit)
            .map_err(|needed| FlashError::SharedMemory { needed, available: shared_limit })?;
        staging.stores_matrices = staging.query_grad && mma_sync && crate::mma::has_stmatrix(client, dtype);
        staging.score_grads_first = staging.query_grad && score_grads_first().unwrap_or(staging.stores_matrices);
        // dQ's sum added a lane's two adjacent columns at a time where the device can.
        let sum_vector = if staging.query_grad && adds_f32_vectors_atomically(client, 2) { 2 } else { 1 };
        let blocks = match kernel {
            FragmentKernel::KeyValueGrad => p.batch * p.kv_heads * p.seq_kv.div_ceil(staging.block_rows()),
            FragmentKernel::Forward | FragmentKernel::QueryGrad => p.batch * p.q_heads * p.seq_q.div_ceil(staging.block_rows()),
        };
        let count = grid(client, blocks)?;
        let held_columns = fragment_tiles::held_columns(kernel, layout);
        Ok(Self { mma_sync, staging, sum_vector, register_columns, held_columns, count, dim: CubeDim::new_1d(32 * staging.warps as u32), elem: dtype.into() })
    }
}

/// Attention output `[B, Hq, Sq, Dv]` and the log-sum-exp of every row `[B, Hq, Sq]` (f32;
/// a row that sees no key, under causal attention with more queries than keys or a run of
/// keys that is empty, gets output zeros and log-sum-exp `-1e30`, which stands in for
/// -infinity). `ranges` restricts each row to a run of keys (documents, key padding).
pub fn flash_attention_forward<R: CubeRuntime>(
    query: CubeTensor<R>,
    key: CubeTensor<R>,
    value: CubeTensor<R>,
    options: FlashOptions,
    ranges: Option<&VisibleRanges>,
) -> Result<(CubeTensor<R>, CubeTensor<R>), FlashError> {
    let problem = Problem::of_tensors(&query, &key, &value, &options)?;
    if runs_fragments(&query.client, query.dtype, &problem)? {
        let layout = problem.address_type();
        return fragment_forward(problem, query, key, value, options, ranges, layout, false);
    }
    forward_planned(problem, query, key, value, options, ranges)
}

/// [`flash_attention_forward`] on the planned engines (`cmma` or plane) wherever the register
/// fragments would be chosen: what they replaced, for side-by-sides and the machine-code check.
pub fn flash_attention_forward_planned<R: CubeRuntime>(
    query: CubeTensor<R>,
    key: CubeTensor<R>,
    value: CubeTensor<R>,
    options: FlashOptions,
    ranges: Option<&VisibleRanges>,
) -> Result<(CubeTensor<R>, CubeTensor<R>), FlashError> {
    let problem = Problem::of_tensors(&query, &key, &value, &options)?;
    forward_planned(problem, query, key, value, options, ranges)
}

/// Whether a call of `dtype` on `client`'s device runs on the register-fragment engine
/// ([`plan::EngineRequest`]), forward and backward alike: where the backward refuses it (heads
/// of a row by the million), the forward stays on the planned engine too.
fn runs_fragments<R: CubeRuntime>(client: &ComputeClient<R>, dtype: DType, problem: &Problem) -> Result<bool, FlashError> {
    let takes = backward_fragments_refusal(dtype, problem).is_none();
    let narrow = problem.address_type() == AddressType::U32;
    Ok(plan::EngineRequest::of_environment()?.runs_fragments(takes, crate::mma::has_mma_sync(client, dtype), narrow))
}

/// Whether [`flash_attention_forward`] and [`flash_attention_backward`] run q, k and v of
/// these shapes and dtypes on the register-fragment engine on `client`'s device (the engine a
/// test's tolerance and report name).
pub fn runs_on_fragments<R: CubeRuntime>(client: &ComputeClient<R>, query: OperandInfo, key: OperandInfo, value: OperandInfo, options: &FlashOptions) -> Result<bool, FlashError> {
    let problem = Problem::new(client, query, key, value, options)?;
    runs_fragments(client, query.dtype, &problem)
}

/// The planned engines' forward (see [`flash_attention_forward_planned`]).
fn forward_planned<R: CubeRuntime>(
    problem: Problem,
    query: CubeTensor<R>,
    key: CubeTensor<R>,
    value: CubeTensor<R>,
    options: FlashOptions,
    ranges: Option<&VisibleRanges>,
) -> Result<(CubeTensor<R>, CubeTensor<R>), FlashError> {
    let (query, key, value) = (into_contiguous(query), into_contiguous(key), into_contiguous(value));
    let client = query.client.clone();
    let device = query.device.clone();
    let plan = Plan::new(&problem, query.dtype, options.causal, &client)?;
    let p = problem;
    let [row_keys, _] = range_tables(ranges, &p, &client, &device)?;
    let blocks = Blocks { ranged: ranges.is_some(), ..plan.forward };
    let blocks_per_head = p.seq_q.div_ceil(blocks.block_rows());
    let count = grid(&client, p.batch * p.q_heads * blocks_per_head)?;
    let vectors = vector_size(&client, &[&query, &key, &value]);
    let output = empty_device_contiguous_dtype(client.clone(), device.clone(), Shape::new([p.batch, p.q_heads, p.seq_q, p.value_dim]), query.dtype);
    let lse = empty_device_contiguous_dtype(client.clone(), device, Shape::new([p.batch, p.q_heads, p.seq_q]), DType::F32);
    let dtype = query.dtype;
    crate::stats::FORWARD.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    for part in plan.column_parts(plan::Kernel::Forward, blocks.value_dim) {
        let blocks = Blocks { part, ..blocks };
        launch_with_engine!(
            plan,
            flash_forward_kernel,
            &client,
            count.clone(),
            cube_dim(&blocks),
            p.address_type(),
            vectors,
            query.clone().into_tensor_arg(),
            key.clone().into_tensor_arg(),
            value.clone().into_tensor_arg(),
            output.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            row_keys.clone().into_tensor_arg(),
            p.scale,
            blocks_per_head,
            TILE,
            blocks,
            dtype.into(),
        );
    }
    Ok((output, lse))
}

/// Gradients `(dQ, dK, dV)` from the forward's inputs, output and log-sum-exp; `options`
/// and `ranges` as the forward had them.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_backward<R: CubeRuntime>(
    query: CubeTensor<R>,
    key: CubeTensor<R>,
    value: CubeTensor<R>,
    output: CubeTensor<R>,
    output_grad: CubeTensor<R>,
    lse: CubeTensor<R>,
    options: FlashOptions,
    ranges: Option<&VisibleRanges>,
) -> Result<(CubeTensor<R>, CubeTensor<R>, CubeTensor<R>), FlashError> {
    let problem = Problem::of_tensors(&query, &key, &value, &options)?;
    let fragments = runs_fragments(&query.client, query.dtype, &problem)?.then(|| (problem.address_type(), None));
    backward(problem, query, key, value, output, output_grad, lse, options, ranges, fragments, deterministic_requested())
}

/// [`flash_attention_backward`] on the planned engines (see [`flash_attention_forward_planned`]).
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_backward_planned<R: CubeRuntime>(
    query: CubeTensor<R>,
    key: CubeTensor<R>,
    value: CubeTensor<R>,
    output: CubeTensor<R>,
    output_grad: CubeTensor<R>,
    lse: CubeTensor<R>,
    options: FlashOptions,
    ranges: Option<&VisibleRanges>,
) -> Result<(CubeTensor<R>, CubeTensor<R>, CubeTensor<R>), FlashError> {
    let problem = Problem::of_tensors(&query, &key, &value, &options)?;
    backward(problem, query, key, value, output, output_grad, lse, options, ranges, None, false)
}

/// The place of each cube of a flash-attention launch over `batch · heads · blocks_per_head`
/// blocks, in launch order: `[cubes, 3]` f32 rows of (batch, head, block), the query blocks'
/// order (`work_grows`) or the key blocks'; for the tests of that order.
pub(crate) fn block_order<R: CubeRuntime>(client: &ComputeClient<R>, device: &R::Device, batch: usize, heads: usize, blocks_per_head: usize, causal: bool, work_grows: bool) -> Result<CubeTensor<R>, FlashError> {
    let cubes = batch * heads * blocks_per_head;
    if cubes == 0 || cubes >= 1 << 24 {
        return Err(FlashError::Shape(format!("{cubes} blocks: the order is read as f32, so 1 to 2^24 of them")));
    }
    let places = empty_device_contiguous_dtype(client.clone(), device.clone(), Shape::new([cubes, 3]), DType::F32);
    stage::block_order_kernel::launch::<R>(client, grid(client, cubes)?, CubeDim::new_1d(1), AddressType::U32, places.clone().into_tensor_arg(), batch, heads, blocks_per_head, causal, work_grows);
    Ok(places)
}

/// Whether the device adds f32 values atomically, which the register-fragment backward needs
/// to sum dQ in its dK/dV kernel (`fragment_tiles::Staging::query_grad`).
pub(crate) fn adds_f32_atomically<R: cubecl::Runtime>(client: &ComputeClient<R>) -> bool {
    adds_f32_vectors_atomically(client, 1)
}

/// Whether the device adds vectors of `width` f32 values in one atomic (CUDA from sm_90 for 2
/// and 4: `red.global.add.v2.f32`; 1, a single value, wherever [`adds_f32_atomically`]).
fn adds_f32_vectors_atomically<R: cubecl::Runtime>(client: &ComputeClient<R>, width: usize) -> bool {
    use cubecl::ir::{ElemType, FloatKind, StorageType, Type, features::AtomicUsage};
    let vector = Type::new(StorageType::Atomic(ElemType::Float(FloatKind::F32))).with_vector_size(width);
    client.properties().atomic_type_usage(vector).contains(AtomicUsage::Add)
}

/// `ULYSSES_FLASH_DETERMINISTIC=1`: the register-fragment backward computes dQ in its own
/// kernel, whose sums run in a fixed order, rather than summing it with atomics (bitwise
/// reproducible gradients, for a little more work).
fn deterministic_requested() -> bool {
    std::env::var("ULYSSES_FLASH_DETERMINISTIC").as_deref() == Ok("1")
}

/// [`flash_attention_backward`] on the register-fragment engine: dK and dV key-outer
/// (`fragment_key_value_grad.rs`: a block's keys stream the queries of every head of their
/// group), the scores' gradients in registers; dQ summed by the same kernel with f32 atomics
/// where it stages its rows and the device has them (unless `ULYSSES_FLASH_DETERMINISTIC=1`),
/// else query-outer like the forward in its own kernel (`fragment_query_grad.rs`). f16 or bf16, head dim (and value dim) 64, 128 or 256 (each gradient
/// in two launches of 128 columns there; with 64-bit indices from 128 on, in parts of 64:
/// `fragment_tiles::register_columns`).
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_backward_fragments<R: CubeRuntime>(
    query: CubeTensor<R>,
    key: CubeTensor<R>,
    value: CubeTensor<R>,
    output: CubeTensor<R>,
    output_grad: CubeTensor<R>,
    lse: CubeTensor<R>,
    options: FlashOptions,
    ranges: Option<&VisibleRanges>,
) -> Result<(CubeTensor<R>, CubeTensor<R>, CubeTensor<R>), FlashError> {
    flash_attention_backward_fragments_laid_out_for(query, key, value, output, output_grad, lse, options, ranges, None, deterministic_requested(), None)
}

/// For tests and benches: [`flash_attention_backward_fragments`] with its kernels' registers
/// laid out as for indices of width `layout` (`fragment_tiles::register_columns`) whatever the
/// call's (`None`: the call's), so that a device without 64-bit indices (lavapipe) runs the
/// layout of 64-bit indices against the reference; with dQ in its own kernel where
/// `deterministic`, whatever `ULYSSES_FLASH_DETERMINISTIC` says; and with dK/dV's blocks of
/// `key_warps` warps where given (4, or 8: 128 keys), else the planner's.
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_backward_fragments_laid_out_for<R: CubeRuntime>(
    query: CubeTensor<R>,
    key: CubeTensor<R>,
    value: CubeTensor<R>,
    output: CubeTensor<R>,
    output_grad: CubeTensor<R>,
    lse: CubeTensor<R>,
    options: FlashOptions,
    ranges: Option<&VisibleRanges>,
    layout: Option<AddressType>,
    deterministic: bool,
    key_warps: Option<usize>,
) -> Result<(CubeTensor<R>, CubeTensor<R>, CubeTensor<R>), FlashError> {
    let problem = Problem::of_tensors(&query, &key, &value, &options)?;
    if let Some(refusal) = backward_fragments_refusal(query.dtype, &problem) {
        return Err(FlashError::Shape(refusal));
    }
    if let Some(warps) = key_warps.filter(|warps| ![fragment_tiles::WARPS, fragment_tiles::WIDE_WARPS].contains(warps)) {
        return Err(FlashError::Shape(format!("dK/dV's blocks take {} or {} warps, not {warps}", fragment_tiles::WARPS, fragment_tiles::WIDE_WARPS)));
    }
    let layout = layout.unwrap_or(problem.address_type());
    backward(problem, query, key, value, output, output_grad, lse, options, ranges, Some((layout, key_warps)), deterministic)
}

/// The backward of a checked call `problem`, on the register fragments where `fragments` is
/// given: laid out for its index width, dK/dV's blocks of its warps where given (see
/// [`FragmentLaunch::new`]), dQ by its own kernel there where `deterministic`.
#[allow(clippy::too_many_arguments)]
fn backward<R: CubeRuntime>(
    problem: Problem,
    query: CubeTensor<R>,
    key: CubeTensor<R>,
    value: CubeTensor<R>,
    output: CubeTensor<R>,
    output_grad: CubeTensor<R>,
    lse: CubeTensor<R>,
    options: FlashOptions,
    ranges: Option<&VisibleRanges>,
    fragments: Option<(AddressType, Option<usize>)>,
    deterministic: bool,
) -> Result<(CubeTensor<R>, CubeTensor<R>, CubeTensor<R>), FlashError> {
    let p = problem;
    let expected_output = [p.batch, p.q_heads, p.seq_q, p.value_dim];
    for (name, tensor) in [("output", &output), ("output gradient", &output_grad)] {
        if tensor.meta.shape().to_vec() != expected_output || tensor.dtype != query.dtype {
            return Err(FlashError::Shape(format!(
                "the {name} must be {expected_output:?} of q's dtype, got {:?} {:?}",
                tensor.meta.shape().to_vec(),
                tensor.dtype
            )));
        }
    }
    let expected_lse = [p.batch, p.q_heads, p.seq_q];
    if lse.meta.shape().to_vec() != expected_lse || lse.dtype != DType::F32 {
        return Err(FlashError::Shape(format!(
            "the log-sum-exp must be {expected_lse:?} f32, as the forward returns it; got {:?} {:?}",
            lse.meta.shape().to_vec(),
            lse.dtype
        )));
    }
    let contiguous = |t| into_contiguous(t);
    let (query, key, value) = (contiguous(query), contiguous(key), contiguous(value));
    let (output, output_grad, lse) = (contiguous(output), contiguous(output_grad), contiguous(lse));
    let client = query.client.clone();
    let device = query.device.clone();
    let dtype = query.dtype;
    let [row_keys, key_rows] = range_tables(ranges, &p, &client, &device)?;
    let ranged = ranges.is_some();
    let empty = |shape: [usize; 4]| empty_device_contiguous_dtype(client.clone(), device.clone(), Shape::new(shape), dtype);

    crate::stats::BACKWARD.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let delta = empty_device_contiguous_dtype(client.clone(), device.clone(), Shape::new([p.batch, p.q_heads, p.seq_q]), DType::F32);
    let rows = p.batch * p.q_heads * p.seq_q;
    backward::row_delta_kernel::launch::<R>(
        &client,
        grid(&client, rows.div_ceil(backward::DELTA_CUBE / backward::DELTA_ROW_UNITS))?,
        CubeDim::new_1d(backward::DELTA_CUBE as u32),
        p.address_type(),
        vector_size(&client, &[&output, &output_grad]),
        output.into_tensor_arg(),
        output_grad.clone().into_tensor_arg(),
        delta.clone().into_tensor_arg(),
        dtype.into(),
    );

    let key_grad = empty([p.batch, p.kv_heads, p.seq_kv, p.head_dim]);
    let value_grad = empty([p.batch, p.kv_heads, p.seq_kv, p.value_dim]);
    if let Some((layout, key_warps)) = fragments {
        let tensors = FragmentGradients { query: &query, key: &key, value: &value, output_grad: &output_grad, lse: &lse, delta: &delta };
        let key_value = FragmentLaunch::new(&client, dtype, &p, FragmentKernel::KeyValueGrad, layout, !deterministic && p.sum_of_query_grad_indexable(), true, key_warps)?;
        // dK/dV's view of lse and D: two rows' bases and −D together, the heads padded.
        let stats_rows = fragment_key_value_grad::summed_rows(p.seq_q, key_value.staging.keys);
        let row_stats = empty_device_contiguous_dtype(client.clone(), device.clone(), Shape::new([p.batch, p.q_heads, stats_rows / 2, 4]), DType::F32);
        let count = p.batch * p.q_heads * stats_rows;
        fragment_key_value_grad::row_statistics_kernel::launch::<R>(
            &client,
            grid(&client, count.div_ceil(256))?,
            CubeDim::new_1d(256),
            p.address_type(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            row_stats.clone().into_tensor_arg(),
        );
        let query_shape = [p.batch, p.q_heads, p.seq_q, p.head_dim];
        // dQ summed by the dK/dV kernel (f32, unscaled), or by its own kernel below.
        let query_grad_sum = if key_value.staging.query_grad {
            let rows = fragment_key_value_grad::summed_rows(p.seq_q, key_value.staging.keys);
            zeros_client(client.clone(), device.clone(), Shape::new([p.batch, p.q_heads, rows, p.head_dim]), DType::F32)
        } else {
            empty_device_contiguous_dtype(client.clone(), device.clone(), Shape::new([1]), DType::F32)
        };
        if p.seq_kv > 0 {
            launch_fragment_key_value_grad(&tensors, &key_value, &key_grad, &value_grad, &row_stats, &query_grad_sum, &key_rows, &p, options.causal, ranged)?;
        }
        let query_grad = empty(query_shape);
        if key_value.staging.query_grad {
            crate::stats::count_query_grad_summed();
            let count: usize = query_shape.iter().product();
            fragment_key_value_grad::scaled_sum_kernel::launch::<R>(
                &client,
                grid(&client, count.div_ceil(256))?,
                CubeDim::new_1d(256),
                p.address_type(),
                query_grad_sum.into_tensor_arg(),
                query_grad.clone().into_tensor_arg(),
                p.scale,
                dtype.into(),
            );
        } else if p.seq_q > 0 {
            launch_fragment_query_grad(&tensors, &query_grad, &row_keys, &p, options.causal, ranged, layout)?;
        }
        return Ok((query_grad, key_grad, value_grad));
    }
    // The planned engine's blocks; the fragment kernels above take none of them.
    let plan = Plan::new(&problem, dtype, options.causal, &client)?;
    let vectors = vector_size(&client, &[&query, &key, &value, &output_grad]);
    // dV's launches then dK's where their accumulators do not fit together, each in parts
    // where one alone does not.
    let (key_width, value_width) = (plan.key_value.dim, plan.key_value.value_dim);
    let passes: Vec<(KeyValuePass, Option<ColumnPart>)> = if plan.split_key_value {
        let values = plan.column_parts(plan::Kernel::KeyValueGrad, value_width).into_iter().map(|part| (KeyValuePass::Values, part));
        let keys = plan.column_parts(plan::Kernel::KeyValueGrad, key_width).into_iter().map(|part| (KeyValuePass::Keys, part));
        values.chain(keys).collect()
    } else {
        vec![(KeyValuePass::Both, None)]
    };
    for (key_value_pass, part) in passes {
        let blocks = Blocks { ranged, key_value_pass, part, ..plan.key_value };
        let blocks_per_head = p.seq_kv.div_ceil(blocks.block_rows());
        launch_with_engine!(
            plan,
            key_value_grad_kernel,
            &client,
            grid(&client, p.batch * p.kv_heads * blocks_per_head)?,
            cube_dim(&blocks),
            p.address_type(),
            vectors,
            query.clone().into_tensor_arg(),
            key.clone().into_tensor_arg(),
            value.clone().into_tensor_arg(),
            output_grad.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            key_grad.clone().into_tensor_arg(),
            value_grad.clone().into_tensor_arg(),
            key_rows.clone().into_tensor_arg(),
            p.scale,
            blocks_per_head,
            TILE,
            blocks,
            dtype.into(),
        );
    }

    let query_grad = empty([p.batch, p.q_heads, p.seq_q, p.head_dim]);
    let blocks = Blocks { ranged, ..plan.query };
    let blocks_per_head = p.seq_q.div_ceil(blocks.block_rows());
    for part in plan.column_parts(plan::Kernel::QueryGrad, blocks.dim) {
        let blocks = Blocks { part, ..blocks };
        launch_with_engine!(
            plan,
            query_grad_kernel,
            &client,
            grid(&client, p.batch * p.q_heads * blocks_per_head)?,
            cube_dim(&blocks),
            p.address_type(),
            vectors,
            query.clone().into_tensor_arg(),
            key.clone().into_tensor_arg(),
            value.clone().into_tensor_arg(),
            output_grad.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            query_grad.clone().into_tensor_arg(),
            row_keys.clone().into_tensor_arg(),
            p.scale,
            blocks_per_head,
            TILE,
            blocks,
            dtype.into(),
        );
    }
    Ok((query_grad, key_grad, value_grad))
}

/// The tensors the register-fragment backward kernels read: the forward's inputs, dO, its
/// log-sum-exp and the backward's D (dQ's kernel; dK/dV's reads both through the row
/// statistics).
struct FragmentGradients<'a, R: CubeRuntime> {
    query: &'a CubeTensor<R>,
    key: &'a CubeTensor<R>,
    value: &'a CubeTensor<R>,
    output_grad: &'a CubeTensor<R>,
    lse: &'a CubeTensor<R>,
    delta: &'a CubeTensor<R>,
}

/// Launches the register-fragment dK/dV kernel `l` into `key_grad` and `value_grad` (and, where
/// it sums dQ, `query_grad_sum`): once, or once per gradient and column part where it computes
/// them apart (`fragment_key_value_grad::passes`).
#[allow(clippy::too_many_arguments)]
fn launch_fragment_key_value_grad<R: CubeRuntime>(
    t: &FragmentGradients<R>,
    l: &FragmentLaunch,
    key_grad: &CubeTensor<R>,
    value_grad: &CubeTensor<R>,
    row_stats: &CubeTensor<R>,
    query_grad_sum: &CubeTensor<R>,
    key_rows: &CubeTensor<R>,
    p: &Problem,
    causal: bool,
    ranged: bool,
) -> Result<(), FlashError> {
    let client = &t.query.client;
    let arg = |tensor: &CubeTensor<R>| tensor.clone().into_tensor_arg();
    use fragment_key_value_grad::fragment_key_value_grad_kernel as kernel;
    let passes = fragment_key_value_grad::passes(p.head_dim, l.register_columns, l.staging.rows_shared);
    // Summing dQ takes dS and K's whole rows: one launch computing both gradients.
    debug_assert!(!l.staging.query_grad || passes == [(true, true, ColumnPart::whole(p.head_dim))], "dQ summed over {passes:?}");
    for (keys, values, part) in passes {
        let args = (arg(t.query), arg(t.key), arg(t.value), arg(t.output_grad), arg(row_stats), arg(key_grad), arg(value_grad), arg(query_grad_sum), arg(key_rows));
        launch_fragments!(
            kernel,
            R,
            l,
            (client, l.count.clone(), l.dim, p.address_type(), l.sum_vector, args.0, args.1, args.2, args.3, args.4, args.5, args.6, args.7, args.8, p.scale, p.head_dim, l.staging, l.held_columns, part, causal, ranged, keys, values)
        );
    }
    Ok(())
}

/// Launches the register-fragment dQ kernel into `query_grad`, once per column part.
fn launch_fragment_query_grad<R: CubeRuntime>(
    t: &FragmentGradients<R>,
    query_grad: &CubeTensor<R>,
    row_keys: &CubeTensor<R>,
    p: &Problem,
    causal: bool,
    ranged: bool,
    layout: AddressType,
) -> Result<(), FlashError> {
    let client = &t.query.client;
    let l = FragmentLaunch::new(client, t.query.dtype, p, FragmentKernel::QueryGrad, layout, false, true, None)?;
    let arg = |tensor: &CubeTensor<R>| tensor.clone().into_tensor_arg();
    use fragment_query_grad::fragment_query_grad_kernel as kernel;
    for part in fragment_tiles::column_parts(p.head_dim, l.register_columns) {
        let args = (arg(t.query), arg(t.key), arg(t.value), arg(t.output_grad), arg(t.lse), arg(t.delta), arg(query_grad), arg(row_keys));
        launch_fragments!(kernel, R, l, (client, l.count.clone(), l.dim, p.address_type(), args.0, args.1, args.2, args.3, args.4, args.5, args.6, args.7, p.scale, p.head_dim, l.staging, l.held_columns, part, causal, ranged));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problem(batch: usize, q_heads: usize, kv_heads: usize, seq: usize, head_dim: usize) -> Problem {
        Problem { batch, q_heads, kv_heads, seq_q: seq, seq_kv: seq, head_dim, value_dim: head_dim, scale: 1.0 }
    }

    #[test]
    fn the_fragment_kernels_say_what_they_take() {
        let small = problem(1, 16, 8, 8192, 128);
        assert_eq!(fragments_refusal(DType::BF16, &small), None);
        let f32_refusal = fragments_refusal(DType::F32, &small).unwrap();
        assert!(f32_refusal.contains("f16 or bf16") && f32_refusal.contains("F32"), "{f32_refusal}");
        assert_eq!(fragments_refusal(DType::BF16, &problem(1, 16, 8, 8192, 256)), None);
        let refusal = fragments_refusal(DType::BF16, &problem(1, 16, 8, 8192, 96)).unwrap();
        assert!(refusal.contains("64, 128 or 256") && refusal.contains("96"), "{refusal}");
        // Maxima are taken before scaling: a scale that is not positive goes to the other
        // engines, as does one whose masked score times it would not stay far below 0.
        for scale in [0.0, -0.125, 1.0e-25, 1.0e5, f32::NAN] {
            let refusal = fragments_refusal(DType::BF16, &Problem { scale, ..small }).unwrap();
            assert!(refusal.contains("softmax scales"), "{refusal}");
        }
        assert_eq!(fragments_refusal(DType::BF16, &Problem { scale: 0.0625, ..small }), None);
        // Past 2^31 elements both take 64-bit indices, the backward keeping rows of 64 columns
        // in registers (the forward 128): at head dim 128 two parts a gradient, K's and V's
        // (Q's and dO's) fragments read as the products need them, dK and dV in one launch a
        // part as at head dim 64.
        use fragment_tiles::{FragmentKernel::*, column_parts, register_columns};
        let past = problem(1, 32, 8, 1_100_000, 128);
        assert_eq!(fragments_refusal(DType::BF16, &past), None);
        let (u32, u64) = (AddressType::U32, AddressType::U64);
        assert_eq!([Forward, QueryGrad, KeyValueGrad].map(|kernel| register_columns(kernel, u64)), [128, 64, 64]);
        assert_eq!([Forward, QueryGrad, KeyValueGrad].map(|kernel| register_columns(kernel, u32)), [128; 3]);
        // The forward keeps Q's fragments whole up to 256 columns with 32-bit indices.
        use fragment_tiles::held_columns;
        assert_eq!([Forward, QueryGrad, KeyValueGrad].map(|kernel| held_columns(kernel, u32)), [256, 128, 128]);
        assert_eq!([Forward, QueryGrad, KeyValueGrad].map(|kernel| held_columns(kernel, u64)), [128, 64, 64]);
        let halves = [ColumnPart { first: 0, width: 64 }, ColumnPart { first: 64, width: 64 }];
        assert_eq!(column_parts(128, 64), halves);
        assert_eq!(fragment_key_value_grad::passes(128, 64, false), halves.map(|part| (true, true, part)));
        assert_eq!(fragment_key_value_grad::passes(128, 128, false), [(false, true, ColumnPart::whole(128)), (true, false, ColumnPart::whole(128))]);
        // K and V in shared memory: one launch for both at 128.
        assert_eq!(fragment_key_value_grad::passes(128, 128, true), [(true, true, ColumnPart::whole(128))]);
        // Steps (keys; queries for dK/dV) with mma.sync in an H100's shared memory, which the
        // registers bound (`key_step`); emulated, within lavapipe's 32 KiB; and over a limit.
        use fragment_tiles::{Staging, key_step};
        // The devices here add f32 atomically.
        let steps = |head_dim, mma_sync, limit| [Forward, QueryGrad, KeyValueGrad].map(|kernel| key_step(kernel, head_dim, 128, mma_sync, true, true, None, 2, limit));
        let double = |keys| Ok(Staging { keys, buffers: 2, warps: 4, rows_shared: false, query_grad: false, stores_matrices: false, score_grads_first: false, row_tiles: 1 });
        // dK/dV with its K and V rows in shared memory (`Staging::rows_shared`), summing dQ
        // (`Staging::query_grad`) or, without atomics, not.
        let summed = |keys, buffers| Ok(Staging { keys, buffers, warps: 4, rows_shared: true, query_grad: true, stores_matrices: false, score_grads_first: false, row_tiles: 1 });
        let shared = |keys, buffers| Ok(Staging { keys, buffers, warps: 4, rows_shared: true, query_grad: false, stores_matrices: false, score_grads_first: false, row_tiles: 1 });
        // The forward with its Q in shared memory and two row tiles a warp
        // (`Staging::row_tiles`), where its output is one part.
        let staged_q = |keys, buffers| Ok(Staging { keys, buffers, warps: 4, rows_shared: true, query_grad: false, stores_matrices: false, score_grads_first: false, row_tiles: 2 });
        // dK/dV's wide block: 8 warps, 128 keys (`fragment_tiles::WIDE_WARPS`).
        let wide_summed = |keys, buffers| Ok(Staging { warps: 8, ..summed(keys, buffers).unwrap() });
        // dQ's sum gives each warp whole 16-column pairs: at 128 an eighth of the columns in
        // the wide block; at 64, where an eighth would be half a pair, a quarter for half the
        // rows (two of a 64-query step's four row tiles), which a 16-query step cannot split.
        use fragment_tiles::query_grad_split;
        assert_eq!([(128, 4, 16), (128, 8, 32), (64, 4, 16), (64, 8, 64), (64, 8, 32)].map(|(d, w, q)| query_grad_split(d, w, q)), [Some((4, 1)), Some((8, 1)), Some((4, 1)), Some((4, 2)), Some((4, 2))]);
        assert_eq!([(64, 8, 16), (64, 16, 32), (96, 4, 32)].map(|(d, w, q)| query_grad_split(d, w, q)), [None; 3]);
        // dK/dV at 64 in the wide block too (91 KB with 64 queries a step, once an SM); asked
        // for 4 warps, 64 queries twice.
        assert_eq!(steps(64, true, 227 * 1024), [staged_q(64, 2), double(64), wide_summed(64, 2)]);
        assert_eq!(key_step(KeyValueGrad, 64, 128, true, true, true, Some(4), 2, 227 * 1024), summed(64, 2));
        // At 128 32 keys: 64 spilled on sm_90a. Told not to stage rows, one row tile a warp
        // with Q's fragments held.
        // dK/dV in the wide block there (113 KB, once an SM); asked for 4 warps, 73 KB twice.
        assert_eq!(steps(128, true, 227 * 1024), [staged_q(32, 2), double(16), wide_summed(32, 2)]);
        assert_eq!(key_step(KeyValueGrad, 128, 128, true, true, true, Some(4), 2, 227 * 1024), summed(32, 2));
        assert_eq!(key_step(Forward, 128, 128, true, true, false, None, 2, 227 * 1024), double(64));
        assert_eq!(key_step(KeyValueGrad, 128, 128, true, false, true, None, 2, 227 * 1024), Ok(Staging { warps: 8, ..shared(32, 2).unwrap() }));
        // The forward's 32-key step at 128 with Q (68 KB) fits an A100 twice, dK/dV's wide
        // block once.
        assert_eq!(steps(128, true, 164 * 1024), [staged_q(32, 2), double(16), wide_summed(32, 2)]);
        // Past the register columns the backward streams its rows: 32-step there (two blocks
        // of 68 KB an H100 or an A100); the forward's 64-key step (102 KB) fits an H100 twice,
        // an A100 once, so there it takes 32 keys.
        assert_eq!(steps(256, true, 227 * 1024), [double(64), double(32), double(32)]);
        assert_eq!(steps(256, true, 164 * 1024), [double(32), double(32), double(32)]);
        assert_eq!(key_step(QueryGrad, 128, 64, true, true, true, None, 2, 227 * 1024), double(32));
        assert_eq!(key_step(KeyValueGrad, 128, 64, true, true, true, None, 2, 227 * 1024), double(32));
        // An L40's 99 KB a block holds the forward's 32-key step at 256 once: 16 keys, twice;
        // at 128 its 32-key step twice, not its 64-key one, nor any with Q staged (52 KB with 16
        // keys), so Q stays in registers there.
        // dK/dV's rows in shared memory at 128 fit it once: in the wide block (91 KB with 16
        // queries a step), one launch summing dQ where 4 warps held K and V in registers, a
        // launch for dV, one for dK and dQ's own.
        assert_eq!(steps(256, true, 101_376), [double(16), double(16), double(16)]);
        assert_eq!(steps(128, true, 101_376), [double(32), double(16), wide_summed(16, 2)]);
        // Asked for 4 warps there, the block of before: K and V held, twice an SM.
        assert_eq!(key_step(KeyValueGrad, 128, 128, true, true, true, Some(4), 2, 101_376), double(16));
        // At 64 the forward's 36 KB with Q staged and 32 keys fit it twice, dK/dV's wide block
        // (91 KB) once; asked for 4 warps, 42 KB with 32 queries twice.
        assert_eq!(steps(64, true, 101_376), [staged_q(32, 2), double(64), wide_summed(64, 2)]);
        assert_eq!(key_step(KeyValueGrad, 64, 128, true, true, true, Some(4), 2, 101_376), summed(32, 2));
        // Emulated, dK/dV stages its rows wherever they fit: lavapipe at 64 (18 KB beside one
        // 16-query buffer, dS's 2 KB and the product's scratch: 31 488 bytes), not at 128
        // (35 KB); the forward stages its Q likewise (18 KB at 64 beside one 16-key buffer and
        // the scratch: 29 184 bytes; 35 KB at 128).
        assert_eq!(steps(64, false, 32 * 1024), [staged_q(16, 1), double(32), summed(16, 1)]);
        assert_eq!(key_step(KeyValueGrad, 64, 128, false, false, true, None, 2, 32 * 1024), shared(16, 1));
        assert_eq!(steps(128, false, 32 * 1024), [double(16), double(16), double(16)]);
        // At 256 the backward's two whole-width tiles fit lavapipe once, not twice.
        let single = Ok(Staging { keys: 16, buffers: 1, warps: 4, rows_shared: false, query_grad: false, stores_matrices: false, score_grads_first: false, row_tiles: 1 });
        assert_eq!(steps(256, false, 32 * 1024), [double(16), single, single]);
        // The backward with 64-bit indices at 128 streams its rows: CUDA's 32-query step, one
        // buffer, before two of 16.
        let wide = Ok(Staging { keys: 32, buffers: 1, warps: 4, rows_shared: false, query_grad: false, stores_matrices: false, score_grads_first: false, row_tiles: 1 });
        assert_eq!([QueryGrad, KeyValueGrad].map(|kernel| key_step(kernel, 128, 64, false, true, true, None, 2, 32 * 1024)), [wide, wide]);
        // dK/dV's wide block asked for on lavapipe: its 128 staged rows do not fit (37 KB at
        // 64), so held in registers, 32 queries a step at 64 (31 KB with the 8 warps'
        // scratch), 16 at 128; a step's copies split over its 256 units (16 queries of 64 do not).
        let held_wide = |keys| Ok(Staging { keys, buffers: 2, warps: 8, rows_shared: false, query_grad: false, stores_matrices: false, score_grads_first: false, row_tiles: 1 });
        assert_eq!([64, 128].map(|head_dim| key_step(KeyValueGrad, head_dim, 128, false, true, true, Some(8), 2, 32 * 1024)), [held_wide(32), held_wide(16)]);
        assert!(steps(128, false, 8 * 1024).iter().all(|step| matches!(step, Err(needed) if *needed > 8 * 1024)));
    }

    #[test]
    fn a_million_tokens_of_32_heads_are_indexed_with_64_bits() {
        // 1 × 32 × 1.1M × 128: 4.5e9 elements, past 2^32 (u32 offsets would wrap).
        let past = problem(1, 32, 8, 1_100_000, 128);
        assert!(past.largest_tensor() > u32::MAX as usize);
        assert_eq!(past.address_type(), AddressType::U64);
        assert!(past.check_indexing(true, "cuda").is_ok());
        let error = past.check_indexing(false, "wgpu<wgsl>").unwrap_err().to_string();
        assert!(error.contains("4505600000 elements") && error.contains("64-bit") && error.contains("wgpu<wgsl>"), "{error}");
        // The kv tensors alone (8 heads) cross 2^31 too: the largest of all decides.
        let kv_heavy = Problem { q_heads: 1, kv_heads: 1, value_dim: 256, ..problem(1, 1, 1, 9_000_000, 16) };
        assert_eq!(kv_heavy.largest_tensor(), 9_000_000 * 256);
        assert_eq!(kv_heavy.address_type(), AddressType::U64);
    }

    #[test]
    fn small_calls_keep_32_bit_indices_up_to_2_pow_31_elements() {
        // 2^31 − 1 elements at most with 32 bits: room for the sums past an offset.
        let last = problem(1, 1, 1, (i32::MAX as usize) / 128, 128);
        assert!(last.largest_tensor() <= i32::MAX as usize);
        assert_eq!(last.address_type(), AddressType::U32);
        assert!(last.check_indexing(false, "wgpu<wgsl>").is_ok());
        let next = problem(1, 1, 1, (i32::MAX as usize) / 128 + 1, 128);
        assert_eq!(next.address_type(), AddressType::U64);
        assert!(matches!(next.check_indexing(false, "wgpu<wgsl>"), Err(FlashError::Indexing { .. })));
    }

    #[test]
    fn the_fragment_backward_takes_only_calls_whose_padded_rows_are_indexable() {
        let long = problem(1, 32, 8, 16_384, 128);
        assert_eq!(backward_fragments_refusal(DType::BF16, &long), None);
        assert!(long.sum_of_query_grad_indexable());
        // Heads of one row: dQ holds 2^27 elements, its f32 sum (63 padding rows a head) 2^33,
        // so dQ takes its own kernel; the row statistics (2^27) still fit 32-bit indices.
        let one_row_heads = problem(1 << 20, 1, 1, 1, 128);
        assert_eq!(one_row_heads.address_type(), AddressType::U32);
        assert!(!one_row_heads.sum_of_query_grad_indexable());
        assert_eq!(backward_fragments_refusal(DType::BF16, &one_row_heads), None);
        // 2^24 heads of one row: q holds 2^30 elements, the row statistics 2^31.
        let more_heads = problem(1 << 24, 1, 1, 1, 64);
        assert_eq!(more_heads.address_type(), AddressType::U32);
        assert_eq!(fragments_refusal(DType::BF16, &more_heads), None);
        let refusal = backward_fragments_refusal(DType::BF16, &more_heads).unwrap();
        assert!(refusal.contains("16777216 heads of 1 rows"), "{refusal}");
        // Indexed in 64 bits anyway.
        let past = problem(1, 32, 8, 1_100_000, 128);
        assert!(past.sum_of_query_grad_indexable());
        assert_eq!(backward_fragments_refusal(DType::BF16, &past), None);
    }

    #[test]
    fn sequences_past_32_bit_positions_are_refused_by_name() {
        let long = problem(1, 1, 1, MAX_SEQUENCE + 1, 1);
        let error = long.check_indexing(true, "cuda").unwrap_err();
        assert!(matches!(error, FlashError::SequenceLength { seq } if seq == MAX_SEQUENCE + 1), "{error}");
        assert!(error.to_string().contains("2147483647"), "{error}");
    }
}

