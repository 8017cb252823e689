//! Register fragments of `mma.sync.m16n8k16` (f16 or bf16 in, f32 accumulated), the building
//! block of a FlashAttention-2-class kernel: every lane of a warp (32 consecutive units of a
//! one-dimensional cube, [`lane`]) holds its part of each operand in registers, in the lane
//! layout of the PTX ISA ("Matrix fragments for mma.m16n8k16"). With g = lane / 4 and
//! t = lane % 4:
//!
//! - A (16 × 16, 8 values): `a[i]` at row g + 8·((i / 2) % 2), column 2t + i % 2 + 8·(i / 4);
//! - B (16 × 8, 4 values): `b[i]` at row 2t + i % 2 + 8·(i / 2), column g;
//! - C (16 × 8, 4 f32 values): `c[i]` at row g + 8·(i / 2), column 2t + i % 2.
//!
//! So the accumulators of two C tiles side by side (columns 0–7 and 8–15) are, value for
//! value, the A fragment of the 16 × 16 tile they make: `a[0..4]` the left tile's `c`,
//! `a[4..8]` the right one's ([`accumulators_as_a`]). That is how FlashAttention-2's P·V takes
//! its probabilities from the scores' accumulators without a trip through shared memory.
//!
//! The product is [`FragmentMma::mma`]: on CUDA from sm_80, one `mma.sync` (SASS `HMMA.16816`)
//! through CubeCL's `MmaDefinition` ([`MmaSync`]); on devices without manual MMA (wgpu, whose
//! SPIR-V and WGSL backends have none), [`SharedMemoryMma`] computes the same product from the
//! same registers through shared memory (lavapipe's planes have 8 lanes, so a warp of 32 is
//! not one plane there, and shuffles cannot gather it). Kernels written on these fragments
//! therefore run, and are tested, on the CPU (lavapipe) with CUDA's arithmetic and data layout
//! but not all of its code path: the emulated product and asynchronous copies synchronise the
//! whole cube (so a barrier missing between a shared tile's last read and its next copy races
//! on a GPU alone), and `ldmatrix`'s lane addressing, `stmatrix` and CUDA's step sizes run
//! on CUDA alone (the machine-code check sees their instructions; a run under
//! `compute-sanitizer --tool racecheck` on a GPU would see their races).

use burn::tensor::{DType, Shape};
use burn_cubecl::{CubeRuntime, kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor};
use cubecl::{
    cmma::{MatrixIdent, MmaDefinition},
    ir::{ElemType, FloatKind, StorageType, features::MmaConfig},
    prelude::{
        barrier::{Barrier, copy_async_checked},
        *,
    },
};

/// Values per lane of the A, B and C fragments.
pub const A_VALUES: usize = 8;
pub const B_VALUES: usize = 4;
pub const C_VALUES: usize = 4;

/// This unit's lane in its warp: the units of a one-dimensional cube in groups of 32 (on
/// CUDA, with a cube whose size is a multiple of 32, the hardware lane).
#[cube]
pub fn lane() -> usize {
    UNIT_POS as usize % 32
}

/// Values of the scratch [`SharedMemoryMma`] uses per warp: A (16 × 16) and B (16 × 8).
const SCRATCH_PER_WARP: usize = 16 * 16 + 16 * 8;
/// Its bytes (f32 values): what a kernel's shared memory holds beside its own on the emulation.
pub(crate) const SCRATCH_BYTES_PER_WARP: usize = 4 * SCRATCH_PER_WARP;

/// The fragment operations a kernel runs on the tensor cores: the product, and fragments
/// loaded from shared memory. Every unit of the cube calls them together (the emulation
/// synchronises the cube).
#[cube]
pub trait FragmentMma: Send + Sync + 'static {
    /// Shared memory the product may use, for a cube of `warps` warps (allocated once per
    /// kernel; `MmaSync` uses none).
    fn scratch(#[comptime] warps: usize) -> SharedMemory<f32>;

    /// `c += a · b` on one warp's fragments (see the module doc for the layout): A's 8 values
    /// at `a[a_at..]`, B's 4 at `b[b_at..]`, C's 4 at `c[c_at..]` (a kernel keeps many
    /// fragments in one register array; on CUDA its loops are unrolled, so the offsets are
    /// constants and the arrays registers).
    #[allow(clippy::too_many_arguments)]
    fn mma<E: Float>(
        a: &Array<E>,
        a_at: usize,
        b: &Array<E>,
        b_at: usize,
        c: &mut Array<f32>,
        c_at: usize,
        scratch: &mut SharedMemory<f32>,
    );

    /// What `ldmatrix` gives this lane of `matrices` (1, 2 or 4) 8 × 8 matrices of `tile`
    /// (row-major, `stride` values a row): matrix m is the one `8 · (m % row_blocks)` rows and
    /// `8 · (m / row_blocks)` columns from `base`, and `values[2m..2m + 2]` are this lane's
    /// two values of it: row g, columns 2t and 2t + 1; with `transpose`, rows 2t and 2t + 1,
    /// column g (g = lane / 4, t = lane % 4).
    ///
    /// So, for a key-major tile of K at a key step, one matrix (8 keys × 8 dims) is half a B
    /// fragment of Kᵀ and two side by side (`row_blocks` 1) are one; of V, transposed, two one
    /// above the other (`row_blocks` 2) are a B fragment of V.
    fn load_matrices<E: Float>(
        tile: &SharedMemory<E>,
        base: usize,
        stride: usize,
        #[comptime] matrices: usize,
        #[comptime] row_blocks: usize,
        #[comptime] transpose: bool,
    ) -> Array<E>;

    /// The inverse of [`load_matrices`](Self::load_matrices): writes this lane's values
    /// `values[2m..2m + 2]` of each of `matrices` 8 × 8 matrices into `tile` where
    /// `load_matrices` with the same arguments reads them. With `instruction`, one `stmatrix`
    /// (SASS `STSM`, sm_90 and later: the device's `stmatrix` feature); else a store per value.
    #[allow(clippy::too_many_arguments)]
    fn store_matrices<E: Float>(
        tile: &mut SharedMemory<E>,
        base: usize,
        stride: usize,
        values: &Array<E>,
        #[comptime] matrices: usize,
        #[comptime] row_blocks: usize,
        #[comptime] transpose: bool,
        #[comptime] instruction: bool,
    );

    /// What a cube's copies into shared memory ([`copy_eight`](Self::copy_eight)) are
    /// awaited with ([`copies_arrived`](Self::copies_arrived)); made once per kernel, by
    /// [`copies`](Self::copies).
    type Copies: CubeType;
    fn copies() -> Self::Copies;

    /// Starts copying the 8 values (16 bytes, 16-byte aligned at both ends) of `source` from
    /// `from` into `tile` at `to`, or 8 zeros where not `valid` (then `source` is not read);
    /// they are there once [`copies_arrived`](Self::copies_arrived) returns.
    fn copy_eight<E: Float>(source: &Tensor<E>, from: usize, valid: bool, tile: &mut SharedMemory<E>, to: usize);

    /// Waits until every unit of the cube has reached it and the copies every unit started
    /// before it have arrived.
    fn copies_arrived(copies: &mut Self::Copies);
}

/// The offset from `base` of row `row` of matrix `matrix` of a [`FragmentMma::load_matrices`].
#[cube]
fn matrix_row(base: usize, stride: usize, matrix: usize, row: usize, #[comptime] row_blocks: usize) -> usize {
    base + (8 * (matrix % row_blocks) + row) * stride + 8 * (matrix / row_blocks)
}

/// Where this lane's value `j` (0 or 1) of matrix `matrix` of a
/// [`FragmentMma::load_matrices`] lies in the tile: row g, column 2t + j of the matrix, or
/// with `transpose` row 2t + j, column g.
#[cube]
fn lane_value(base: usize, stride: usize, matrix: usize, j: usize, #[comptime] row_blocks: usize, #[comptime] transpose: bool) -> usize {
    let lane = lane();
    let (g, t) = (lane / 4, lane % 4);
    if transpose { matrix_row(base, stride, matrix, 2 * t + j, row_blocks) + g } else { matrix_row(base, stride, matrix, g, row_blocks) + 2 * t + j }
}

/// [`FragmentMma::store_matrices`] a value at a time, where the device has no `stmatrix`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_values<E: Float>(
    tile: &mut SharedMemory<E>,
    base: usize,
    stride: usize,
    values: &Array<E>,
    #[comptime] matrices: usize,
    #[comptime] row_blocks: usize,
    #[comptime] transpose: bool,
) {
    #[unroll]
    for m in 0..matrices {
        #[unroll]
        for j in 0..2usize {
            tile[lane_value(base, stride, m, j, row_blocks, transpose)] = values[2 * m + j];
        }
    }
}

/// One `mma.sync.aligned.m16n8k16` per product (CUDA, sm_80 and later). CubeCL's registers
/// are vectors: two f16/bf16 values (one 32-bit register) for A and B, two f32 (a lane's
/// adjacent columns, two registers) for C and D.
pub struct MmaSync;

#[cube]
impl FragmentMma for MmaSync {
    fn scratch(#[comptime] _warps: usize) -> SharedMemory<f32> {
        SharedMemory::new(1usize)
    }

    fn mma<E: Float>(
        a: &Array<E>,
        a_at: usize,
        b: &Array<E>,
        b_at: usize,
        c: &mut Array<f32>,
        c_at: usize,
        _scratch: &mut SharedMemory<f32>,
    ) {
        let def = MmaDefinition::<E, E, f32>::new(16usize, 8usize, 16usize);
        let a_regs = register_pairs::<E>(a, a_at, A_VALUES / 2);
        let b_regs = register_pairs::<E>(b, b_at, B_VALUES / 2);
        // Pairs, as CubeCL sizes the accumulator (`vector_size`: a lane's two adjacent columns):
        // `execute` declares its output as that many vectors, so vectors of one f32 left half
        // of the product's registers outside the array, and NVRTC dropped them (rows g + 8).
        let mut c_regs = Array::<Vector<f32, Const<2>>>::new(C_VALUES / 2);
        #[unroll]
        for r in 0..C_VALUES / 2 {
            let mut pair = Vector::empty();
            pair[0] = c[c_at + 2 * r];
            pair[1] = c[c_at + 2 * r + 1];
            c_regs[r] = pair;
        }
        let d = def.execute(&a_regs, &b_regs, &c_regs);
        #[unroll]
        for r in 0..C_VALUES / 2 {
            c[c_at + 2 * r] = d[r][0];
            c[c_at + 2 * r + 1] = d[r][1];
        }
    }

    /// One `ldmatrix` (SASS `LDSM`): lane l supplies the address of row l % 8 of matrix l / 8
    /// (lanes past the last matrix repeat the first ones; the instruction ignores them).
    fn load_matrices<E: Float>(
        tile: &SharedMemory<E>,
        base: usize,
        stride: usize,
        #[comptime] matrices: usize,
        #[comptime] row_blocks: usize,
        #[comptime] transpose: bool,
    ) -> Array<E> {
        let def = MmaDefinition::<E, E, f32>::new(16usize, 8usize, 16usize);
        let lane = lane();
        let start = matrix_row(base, stride, (lane / 8) % matrices, lane % 8, row_blocks);
        let registers = def.load_matrix::<E, Const<2>>(&tile.slice(start, start + 8), MatrixIdent::B, matrices, transpose);
        let mut values = Array::<E>::new(2 * matrices);
        #[unroll]
        for m in 0..matrices {
            values[2 * m] = registers[m][0];
            values[2 * m + 1] = registers[m][1];
        }
        values
    }

    /// One `stmatrix` (SASS `STSM`) where `instruction`: lane l supplies the address of row
    /// l % 8 of matrix l / 8, as for `ldmatrix`.
    fn store_matrices<E: Float>(
        tile: &mut SharedMemory<E>,
        base: usize,
        stride: usize,
        values: &Array<E>,
        #[comptime] matrices: usize,
        #[comptime] row_blocks: usize,
        #[comptime] transpose: bool,
        #[comptime] instruction: bool,
    ) {
        if instruction {
            let def = MmaDefinition::<E, E, f32>::new(16usize, 8usize, 16usize);
            let lane = lane();
            let start = matrix_row(base, stride, (lane / 8) % matrices, lane % 8, row_blocks);
            let registers = register_pairs::<E>(values, 0usize, matrices);
            def.store_matrix::<E, Const<2>>(&mut tile.slice_mut(start, start + 8), &registers, MatrixIdent::A, matrices, transpose);
        } else {
            store_values::<E>(tile, base, stride, values, matrices, row_blocks, transpose);
        }
    }

    /// A cube-wide `cuda::barrier` in shared memory.
    type Copies = Shared<Barrier>;
    fn copies() -> Shared<Barrier> {
        Barrier::shared(CUBE_DIM, UNIT_POS == 0)
    }

    /// One `cp.async` of 16 bytes (SASS `LDGSTS`): global to shared memory without passing
    /// through registers; the zeros are its zero fill (a source of length 0).
    fn copy_eight<E: Float>(source: &Tensor<E>, from: usize, valid: bool, tile: &mut SharedMemory<E>, to: usize) {
        let start = select(valid, from, 0usize);
        let length = select(valid, 8usize, 0usize);
        copy_async_checked(&source.slice(start, start + length), &mut tile.slice_mut(to, to + 8), 8u32);
    }

    /// This unit's copies counted on the barrier (`cp.async.mbarrier.arrive`), then its arrival.
    fn copies_arrived(copies: &mut Shared<Barrier>) {
        copies.commit_copy_async();
        copies.arrive_and_wait();
    }
}

/// `values[at..]` as `registers` 32-bit registers of two half-precision values each, in order.
#[cube]
fn register_pairs<E: Float>(values: &Array<E>, at: usize, #[comptime] registers: usize) -> Array<Vector<E, Const<2>>> {
    let mut pairs = Array::<Vector<E, Const<2>>>::new(registers);
    #[unroll]
    for r in 0..registers {
        let mut pair = Vector::empty();
        pair[0] = values[at + 2 * r];
        pair[1] = values[at + 2 * r + 1];
        pairs[r] = pair;
    }
    pairs
}

/// The same product from the same registers, for devices without manual MMA: each warp
/// writes its A and B fragments into its part of the scratch at their (row, column), the cube
/// synchronises, and each lane sums its accumulators' 16 products in f32, in k order. Slow;
/// it exists so that kernels written on the fragments run on the CPU.
pub struct SharedMemoryMma;

#[cube]
impl FragmentMma for SharedMemoryMma {
    fn scratch(#[comptime] warps: usize) -> SharedMemory<f32> {
        SharedMemory::new(SCRATCH_PER_WARP * warps)
    }

    fn mma<E: Float>(
        a: &Array<E>,
        a_at: usize,
        b: &Array<E>,
        b_at: usize,
        c: &mut Array<f32>,
        c_at: usize,
        scratch: &mut SharedMemory<f32>,
    ) {
        let lane = lane();
        let (g, t) = (lane / 4, lane % 4);
        let a_base = (UNIT_POS as usize / 32) * SCRATCH_PER_WARP;
        let b_base = a_base + 16 * 16;
        #[unroll]
        for i in 0..A_VALUES {
            scratch[a_base + (g + 8 * ((i / 2) % 2)) * 16 + 2 * t + i % 2 + 8 * (i / 4)] = f32::cast_from(a[a_at + i]);
        }
        #[unroll]
        for i in 0..B_VALUES {
            scratch[b_base + (2 * t + i % 2 + 8 * (i / 2)) * 8 + g] = f32::cast_from(b[b_at + i]);
        }
        sync_cube();
        #[unroll]
        for i in 0..C_VALUES {
            let (row, column) = (g + 8 * (i / 2), 2 * t + i % 2);
            let mut sum = c[c_at + i];
            for k in 0..16usize {
                sum += scratch[a_base + row * 16 + k] * scratch[b_base + k * 8 + column];
            }
            c[c_at + i] = sum;
        }
        // The next product writes the scratch again.
        sync_cube();
    }

    /// Each lane reads its values where `ldmatrix` would put them (see the trait).
    fn load_matrices<E: Float>(
        tile: &SharedMemory<E>,
        base: usize,
        stride: usize,
        #[comptime] matrices: usize,
        #[comptime] row_blocks: usize,
        #[comptime] transpose: bool,
    ) -> Array<E> {
        let mut values = Array::<E>::new(2 * matrices);
        #[unroll]
        for m in 0..matrices {
            #[unroll]
            for j in 0..2usize {
                values[2 * m + j] = tile[lane_value(base, stride, m, j, row_blocks, transpose)];
            }
        }
        values
    }

    /// Each lane writes its values where `stmatrix` would.
    fn store_matrices<E: Float>(
        tile: &mut SharedMemory<E>,
        base: usize,
        stride: usize,
        values: &Array<E>,
        #[comptime] matrices: usize,
        #[comptime] row_blocks: usize,
        #[comptime] transpose: bool,
        #[comptime] _instruction: bool,
    ) {
        store_values::<E>(tile, base, stride, values, matrices, row_blocks, transpose);
    }

    /// Copies are plain loads and stores, there once the cube is synchronised.
    type Copies = ();
    fn copies() {}

    fn copy_eight<E: Float>(source: &Tensor<E>, from: usize, valid: bool, tile: &mut SharedMemory<E>, to: usize) {
        let start = select(valid, from, 0usize);
        #[unroll]
        for j in 0..8usize {
            tile[to + j] = select(valid, source[start + j], E::from_int(0));
        }
    }

    fn copies_arrived(_copies: &mut ()) {
        sync_cube();
    }
}

/// The A fragment of the 16 × 16 tile whose left and right 16 × 8 halves are the accumulators
/// `left` and `right`, rounded to `E` (see the module doc): registers only.
#[cube]
pub fn accumulators_as_a<E: Float>(left: &Array<f32>, right: &Array<f32>) -> Array<E> {
    let mut a = Array::<E>::new(A_VALUES);
    #[unroll]
    for i in 0..C_VALUES {
        a[i] = E::cast_from(left[i]);
        a[i + C_VALUES] = E::cast_from(right[i]);
    }
    a
}

/// This lane's A fragment of the 16 × 16 tile of `matrix` (row-major, `stride` values a row)
/// starting at `origin`.
#[cube]
pub fn load_a<E: Float>(matrix: &Tensor<E>, origin: usize, stride: usize) -> Array<E> {
    let lane = lane();
    let (g, t) = (lane / 4, lane % 4);
    let mut a = Array::<E>::new(A_VALUES);
    #[unroll]
    for i in 0..A_VALUES {
        let row = g + 8 * ((i / 2) % 2);
        let column = 2 * t + i % 2 + 8 * (i / 4);
        a[i] = matrix[origin + row * stride + column];
    }
    a
}

/// Writes this lane's accumulators of the 16 × 8 tile of `out` (row-major, `stride` values a
/// row) at `origin`.
#[cube]
pub fn store_c(c: &Array<f32>, out: &mut Tensor<f32>, origin: usize, stride: usize) {
    let lane = lane();
    let (g, t) = (lane / 4, lane % 4);
    #[unroll]
    for i in 0..C_VALUES {
        out[origin + (g + 8 * (i / 2)) * stride + 2 * t + i % 2] = c[i];
    }
}

/// Row stride of the shared tiles of [`fragment_products_kernel`]: 16 values and 8 of padding,
/// as the attention kernels pad theirs (so the tests read fragments across a padded stride).
const PRODUCTS_STRIDE: usize = 24;

/// One plane computes FlashAttention-2's two products on 16 × 16 tiles, through fragments
/// only: S = Q·Kᵀ (two 16 × 8 accumulator tiles), P = S rounded to `E` taken from those
/// accumulators as an A fragment, O = P·V (two tiles). K and V go through shared memory and
/// come to fragments as the attention kernels copy and load them ([`FragmentMma::copy_eight`],
/// [`FragmentMma::load_matrices`]: two
/// matrices for each S tile, four, transposed, for both of V's). Writes S and O (f32,
/// 16 × 16 each).
#[cube(launch)]
fn fragment_products_kernel<E: Float, M: FragmentMma>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    s: &mut Tensor<f32>,
    o: &mut Tensor<f32>,
    #[define(E)] _dtype: StorageType,
) {
    let mut scratch = M::scratch(1usize);
    let mut k_tile = SharedMemory::<E>::new_aligned(16 * PRODUCTS_STRIDE, 16usize);
    let mut v_tile = SharedMemory::<E>::new_aligned(16 * PRODUCTS_STRIDE, 16usize);
    let mut copies = M::copies();
    // Lane l copies the 8 values of row l / 2, columns 8·(l % 2) of each.
    let (row, column) = (lane() / 2, 8 * (lane() % 2));
    M::copy_eight::<E>(k, row * 16 + column, true, &mut k_tile, row * PRODUCTS_STRIDE + column);
    M::copy_eight::<E>(v, row * 16 + column, true, &mut v_tile, row * PRODUCTS_STRIDE + column);
    M::copies_arrived(&mut copies);
    let q_frag = load_a::<E>(q, 0, 16);
    let mut s_left = Array::<f32>::new(C_VALUES);
    let mut s_right = Array::<f32>::new(C_VALUES);
    let mut o_left = Array::<f32>::new(C_VALUES);
    let mut o_right = Array::<f32>::new(C_VALUES);
    #[unroll]
    for i in 0..C_VALUES {
        s_left[i] = 0.0;
        s_right[i] = 0.0;
        o_left[i] = 0.0;
        o_right[i] = 0.0;
    }
    // Kᵀ[kk, n] = K[n, kk]: the left tile takes keys 0–7, the right keys 8–15.
    let k_left = M::load_matrices::<E>(&k_tile, 0usize, PRODUCTS_STRIDE, 2usize, 1usize, false);
    let k_right = M::load_matrices::<E>(&k_tile, 8 * PRODUCTS_STRIDE, PRODUCTS_STRIDE, 2usize, 1usize, false);
    M::mma::<E>(&q_frag, 0usize, &k_left, 0usize, &mut s_left, 0usize, &mut scratch);
    M::mma::<E>(&q_frag, 0usize, &k_right, 0usize, &mut s_right, 0usize, &mut scratch);
    let p = accumulators_as_a::<E>(&s_left, &s_right);
    // V's columns 0–7 are its first B fragment (values 0–3), 8–15 its second.
    let v_both = M::load_matrices::<E>(&v_tile, 0usize, PRODUCTS_STRIDE, 4usize, 2usize, true);
    M::mma::<E>(&p, 0usize, &v_both, 0usize, &mut o_left, 0usize, &mut scratch);
    M::mma::<E>(&p, 0usize, &v_both, B_VALUES, &mut o_right, 0usize, &mut scratch);
    store_c(&s_left, s, 0, 16);
    store_c(&s_right, s, 8, 16);
    store_c(&o_left, o, 0, 16);
    store_c(&o_right, o, 8, 16);
}

/// Whether `client`'s device stores fragments of `dtype` with `stmatrix` (CUDA from sm_90):
/// [`FragmentMma::store_matrices`]'s `instruction`.
pub fn has_stmatrix<R: CubeRuntime>(client: &ComputeClient<R>, dtype: DType) -> bool {
    half_precision(dtype).is_some_and(|input| client.properties().features.matmul.stmatrix.contains(&input))
}

/// `dtype` as CubeCL's storage type where it is f16 or bf16, the fragments' inputs.
fn half_precision(dtype: DType) -> Option<StorageType> {
    let kind = match dtype {
        DType::F16 => FloatKind::F16,
        DType::BF16 => FloatKind::BF16,
        _ => return None,
    };
    Some(StorageType::Scalar(ElemType::Float(kind)))
}

/// Whether `client`'s device runs `mma.sync.m16n8k16` on `dtype` (f16 or bf16) with f32
/// accumulation: CUDA from sm_80. Elsewhere the fragments multiply through [`SharedMemoryMma`].
pub fn has_mma_sync<R: CubeRuntime>(client: &ComputeClient<R>, dtype: DType) -> bool {
    let Some(input) = half_precision(dtype) else { return false };
    let output = StorageType::Scalar(ElemType::Float(FloatKind::F32));
    client.properties().features.matmul.mma.contains(&MmaConfig { a_type: input, b_type: input, cd_type: output, m: 16, n: 8, k: 16 })
}

/// Why [`fragment_products`] refused its inputs.
#[derive(Debug, thiserror::Error)]
#[error("fragment products: {0}")]
pub struct FragmentError(String);

/// FlashAttention-2's two products on one 16 × 16 tile of each of q, k and v (f16 or bf16,
/// `[16, 16]`), by one warp of 32 units through register fragments: `(S = q·kᵀ, O = P·v)` in
/// f32, P being S rounded to the inputs' dtype. `mma.sync` where the device has it, shared
/// memory elsewhere. For the tests and the machine-code check of the fragments.
pub fn fragment_products<R: CubeRuntime>(q: CubeTensor<R>, k: CubeTensor<R>, v: CubeTensor<R>) -> Result<(CubeTensor<R>, CubeTensor<R>), FragmentError> {
    let dtype = q.dtype;
    for tensor in [&q, &k, &v] {
        if tensor.meta.shape().to_vec() != [16, 16] || tensor.dtype != dtype || !matches!(dtype, DType::F16 | DType::BF16) {
            return Err(FragmentError(format!("q, k and v must be [16, 16] in f16 or bf16 alike, got {:?} {:?}", tensor.meta.shape(), tensor.dtype)));
        }
    }
    let client = q.client.clone();
    let device = q.device.clone();
    let (q, k, v) = (into_contiguous(q), into_contiguous(k), into_contiguous(v));
    let s = empty_device_contiguous_dtype(client.clone(), device.clone(), Shape::new([16, 16]), DType::F32);
    let o = empty_device_contiguous_dtype(client.clone(), device, Shape::new([16, 16]), DType::F32);
    let args = (q.into_tensor_arg(), k.into_tensor_arg(), v.into_tensor_arg(), s.clone().into_tensor_arg(), o.clone().into_tensor_arg());
    let (cubes, dim) = (CubeCount::Static(1, 1, 1), CubeDim::new_1d(32));
    let elem: StorageType = dtype.into();
    if has_mma_sync(&client, dtype) {
        fragment_products_kernel::launch::<MmaSync, R>(&client, cubes, dim, args.0, args.1, args.2, args.3, args.4, elem);
    } else {
        fragment_products_kernel::launch::<SharedMemoryMma, R>(&client, cubes, dim, args.0, args.1, args.2, args.3, args.4, elem);
    }
    Ok((s, o))
}
