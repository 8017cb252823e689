//! The matrix products of the kernels, on 16 × 16 tiles: one plane (warp) computes one
//! `16 × 16 += 16 × 16 · 16 × 16` step, with f32 accumulation.
//!
//! Two implementations behind one trait, chosen when the kernel is launched:
//! - [`CmmaTiles`]: tensor cores (`cmma`: CUDA's wmma, Vulkan's cooperative matrices) in
//!   fragments of the shape the device offers: f16 and bf16 operands as they are, f32 ones as
//!   TF32 (CUDA from sm_80, as PyTorch's `allow_tf32`); the accumulator is opaque and f32.
//! - [`PlaneTiles`]: the same product done by the plane's lanes from shared memory, for
//!   devices without tensor cores (a software Vulkan driver: the CPU tests) and for f32 in
//!   full precision. Each lane owns a `rows × cols` block of the 16 × 16 accumulator in
//!   registers, so each operand value it reads from shared memory serves `cols` (or `rows`)
//!   multiply-adds.
//!
//! Everything else in the kernels (tiling, online softmax, masking, causal skipping, GQA,
//! the backward's products) is the same code for both, so the CPU tests cover all of it but
//! the fragment itself.

use cubecl::{cmma, prelude::*};

/// Rows and columns of a tile (and the depth of one product step).
pub const TILE: usize = 16;

/// One tensor-core product: an `edge × edge` accumulator += `edge × depth` · `depth × edge`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fragment {
    /// 16 (NVIDIA) or 8 (lavapipe), dividing [`TILE`].
    pub edge: usize,
    /// `edge` for f16 and bf16; 8 for TF32 (CUDA's only TF32 shape is 16 × 16 × 8).
    pub depth: usize,
    /// Whether the operands are f32 read by the tensor cores as TF32 (their top 19 bits:
    /// 10 of mantissa, as f16, with f32's range); otherwise they are the storage type.
    pub tf32: bool,
}

impl Fragment {
    /// `edge³` fragments of the storage type.
    pub const fn cube(edge: usize) -> Self {
        Self { edge, depth: edge, tf32: false }
    }

    /// CUDA's TF32 shape.
    pub const TF32: Self = Self { edge: 16, depth: 8, tf32: true };
}

/// How a plane multiplies tiles, fixed at launch (a comptime argument).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TileUnit {
    /// Lanes of a plane.
    pub plane_dim: usize,
    /// The tensor-core fragment; unused by the plane engine.
    pub fragment: Fragment,
    /// Whether a plane may synchronise alone (CUDA). Elsewhere every barrier is the cube's,
    /// with memory ordered: each plane must then reach each barrier as often as the others.
    pub plane_sync: bool,
    /// Elements of padding after each row of a shared-memory tile (see [`TileUnit::stride`]).
    pub skew: usize,
}

impl TileUnit {
    /// The row stride in shared memory of a tile `width` elements wide: `width + skew`. Rows
    /// of 128 or 256 bytes, unpadded, all start in bank 0, so the 16 rows a fragment load
    /// reads collide in the same banks (the first GPU run's Nsight Compute: four of five
    /// shared-memory wavefronts were bank conflicts); 8 elements of skew start consecutive
    /// rows 4 (16-bit) or 8 (f32) banks apart, and keep every fragment's rows 32-byte aligned.
    pub fn stride(&self, width: usize) -> usize {
        width + self.skew
    }

    /// Accumulator fragments in one 16 × 16 tile.
    pub fn fragments_per_tile(&self) -> usize {
        (TILE / self.fragment.edge) * (TILE / self.fragment.edge)
    }
}

/// One plane's tile products, on a row of accumulator tiles: the plane's 16 rows by
/// `count × 16` columns (scores against a tile of keys, an output row block...).
///
/// Loops over a row's tiles live here rather than in the kernels: tensor-core fragments can
/// only be addressed by comptime indices (the loop is unrolled), while the lanes' registers
/// can be addressed by runtime ones, which keeps the shaders of the plane engine small (a
/// software Vulkan driver compiles them with LLVM, and unrolled kernels take it minutes).
#[cube]
pub trait TileMma: Send + Sync + 'static {
    /// A row of 16 × 16 f32 accumulator tiles of one plane.
    type Tiles: CubeType;

    /// `count` zeroed tiles.
    fn zeros(#[comptime] count: usize, #[comptime] unit: TileUnit) -> Self::Tiles;

    /// `tiles[first + t] += A · B_t` for `t` in `0..count`: `A` a 16 × 16 tile at `a`, `B_t`
    /// the 16 × 16 tile `t · b_step` elements after `b`. Operands are read from shared memory
    /// with the given row stride, row-major or column-major (a column-major `B` is the
    /// transpose of the row-major tile at the same place). `depth` is 16 passed at run time:
    /// the plane engine's loops run to it, so that shader compilers keep them rolled.
    #[allow(clippy::too_many_arguments)]
    fn mma_row<E: Float>(
        tiles: &mut Self::Tiles,
        #[comptime] first: usize,
        #[comptime] count: usize,
        a: &Slice<E>,
        a_stride: usize,
        #[comptime] a_col_major: bool,
        b: &Slice<E>,
        b_step: usize,
        b_stride: usize,
        #[comptime] b_col_major: bool,
        depth: usize,
        #[comptime] unit: TileUnit,
    );

    /// Writes `tiles[first + t]` for `t` in `0..count` row-major into `out`, side by side
    /// (tile `t` at column `16t`, row stride `stride`).
    fn store_row(
        tiles: &Self::Tiles,
        #[comptime] first: usize,
        #[comptime] count: usize,
        out: &mut SliceMut<f32>,
        stride: usize,
        #[comptime] unit: TileUnit,
    );

    /// Writes `tiles[t]` for `t` in `0..count`, row `r` times `factors[r]`, to `out` in its
    /// storage type (tile `t` at column `16t`, row stride `stride`), skipping rows from
    /// `rows` on and columns from `cols` on (the ends of the sequence and of the head dim).
    /// `scratch` as for [`scale_rows`](Self::scale_rows). Every plane of the cube calls it
    /// (with `rows` 0 past the sequence end), since implementations may hold barriers.
    #[allow(clippy::too_many_arguments)]
    fn write_rows<F: Float>(
        tiles: &Self::Tiles,
        #[comptime] count: usize,
        out: &mut SliceMut<F>,
        stride: usize,
        rows: usize,
        cols: usize,
        factors: &Array<f32>,
        scratch: &mut SliceMut<f32>,
        #[comptime] unit: TileUnit,
    );

    /// Multiplies row `r` of each of the `count` tiles by `factors[r]` (every lane holds all
    /// 16 factors). `scratch` (256 f32 of this plane's shared memory) is for implementations
    /// that go through shared memory; they synchronise with [`sync_tile`], so where the plane
    /// cannot synchronise alone every plane of the cube must call it.
    fn scale_rows(
        tiles: &mut Self::Tiles,
        #[comptime] count: usize,
        factors: &Array<f32>,
        scratch: &mut SliceMut<f32>,
        #[comptime] unit: TileUnit,
    );
}

/// Tensor cores: `cmma` fragments of `unit.fragment` (16³ on NVIDIA, 8³ on lavapipe, 16 × 16
/// × 8 for TF32), f32 accumulator. A 16 × 16 tile is `(16/edge)²` accumulator fragments,
/// fragment `(i, j)` of tile `t` at `(t · s + i) · s + j` with `s = 16/edge`, so the kernels
/// keep their 16-row tiles whatever the device's fragment.
pub struct CmmaTiles;

#[cube]
impl TileMma for CmmaTiles {
    type Tiles = Sequence<cmma::Matrix<f32>>;

    fn zeros(#[comptime] count: usize, #[comptime] unit: TileUnit) -> Sequence<cmma::Matrix<f32>> {
        let (f, d) = comptime!((unit.fragment.edge, unit.fragment.depth));
        let mut tiles = Sequence::new();
        #[unroll]
        for _ in 0..comptime!(count * unit.fragments_per_tile()) {
            tiles.push(cmma::Matrix::<f32>::from_value(cmma::MatrixIdent::Accumulator, f, f, d, cmma::MatrixLayout::Undefined, 0.0));
        }
        tiles
    }

    fn mma_row<E: Float>(
        tiles: &mut Sequence<cmma::Matrix<f32>>,
        #[comptime] first: usize,
        #[comptime] count: usize,
        a: &Slice<E>,
        a_stride: usize,
        #[comptime] a_col_major: bool,
        b: &Slice<E>,
        b_step: usize,
        b_stride: usize,
        #[comptime] b_col_major: bool,
        _depth: usize,
        #[comptime] unit: TileUnit,
    ) {
        if comptime!(unit.fragment.tf32) {
            cmma_row::<E, tf32>(tiles, first, count, a, a_stride, a_col_major, b, b_step, b_stride, b_col_major, unit);
        } else {
            cmma_row::<E, E>(tiles, first, count, a, a_stride, a_col_major, b, b_step, b_stride, b_col_major, unit);
        }
    }

    fn store_row(
        tiles: &Sequence<cmma::Matrix<f32>>,
        #[comptime] first: usize,
        #[comptime] count: usize,
        out: &mut SliceMut<f32>,
        stride: usize,
        #[comptime] unit: TileUnit,
    ) {
        let f = comptime!(unit.fragment.edge);
        let s = comptime!(TILE / unit.fragment.edge);
        #[unroll]
        for t in 0..count {
            #[unroll]
            for i in 0..s {
                #[unroll]
                for j in 0..s {
                    let mut fragment_out = out.slice_mut(comptime!(i * f) * stride + comptime!(t * TILE + j * f), out.len());
                    cmma::store(&mut fragment_out, tiles.index(comptime!(((first + t) * s + i) * s + j)), stride as u32, cmma::MatrixLayout::RowMajor);
                }
            }
        }
    }

    fn write_rows<F: Float>(
        tiles: &Sequence<cmma::Matrix<f32>>,
        #[comptime] count: usize,
        out: &mut SliceMut<F>,
        stride: usize,
        rows: usize,
        cols: usize,
        factors: &Array<f32>,
        scratch: &mut SliceMut<f32>,
        #[comptime] unit: TileUnit,
    ) {
        // Every plane runs the same barriers (`rows` may be 0): only the writes are masked.
        let plane_dim = comptime!(unit.plane_dim);
        #[unroll]
        for t in 0..count {
            Self::store_row(tiles, t, 1usize, scratch, TILE, unit);
            sync_tile(unit.plane_sync);
            let mut i = UNIT_POS_X as usize;
            while i < TILE * TILE {
                let (r, c) = (i / TILE, t * TILE + i % TILE);
                if r < rows && c < cols {
                    out[r * stride + c] = F::cast_from(scratch[i] * factors[r]);
                }
                i += plane_dim;
            }
            sync_tile(unit.plane_sync);
        }
    }

    fn scale_rows(tiles: &mut Sequence<cmma::Matrix<f32>>, #[comptime] count: usize, factors: &Array<f32>, scratch: &mut SliceMut<f32>, #[comptime] unit: TileUnit) {
        // The fragments' layout is opaque: through shared memory and back.
        let f = comptime!(unit.fragment.edge);
        let s = comptime!(TILE / unit.fragment.edge);
        let plane_dim = comptime!(unit.plane_dim);
        #[unroll]
        for t in 0..count {
            Self::store_row(tiles, t, 1usize, scratch, TILE, unit);
            sync_tile(unit.plane_sync);
            let mut i = UNIT_POS_X as usize;
            while i < TILE * TILE {
                scratch[i] = scratch[i] * factors[i / TILE];
                i += plane_dim;
            }
            sync_tile(unit.plane_sync);
            #[unroll]
            for i in 0..s {
                #[unroll]
                for j in 0..s {
                    let acc = tiles.index_mut(comptime!((t * s + i) * s + j));
                    cmma::load_with_layout(acc, &scratch.slice(comptime!(i * f * TILE + j * f), scratch.len()), TILE as u32, cmma::MatrixLayout::RowMajor);
                }
            }
            sync_tile(unit.plane_sync);
        }
    }
}

/// [`CmmaTiles::mma_row`] with operand fragments of type `O`, loaded from shared memory of
/// the storage type `E` (the same type, or f32 read as TF32).
#[cube]
#[allow(clippy::too_many_arguments)]
fn cmma_row<E: Float, O: Float>(
    tiles: &mut Sequence<cmma::Matrix<f32>>,
    #[comptime] first: usize,
    #[comptime] count: usize,
    a: &Slice<E>,
    a_stride: usize,
    #[comptime] a_col_major: bool,
    b: &Slice<E>,
    b_step: usize,
    b_stride: usize,
    #[comptime] b_col_major: bool,
    #[comptime] unit: TileUnit,
) {
    let (f, d) = comptime!((unit.fragment.edge, unit.fragment.depth));
    let (s, steps) = comptime!((TILE / f, TILE / d));
    let a_layout = if a_col_major { cmma::MatrixLayout::ColMajor } else { cmma::MatrixLayout::RowMajor };
    let b_layout = if b_col_major { cmma::MatrixLayout::ColMajor } else { cmma::MatrixLayout::RowMajor };
    // One product step of depth `d` at a time, so that only that step's A fragments (i, k),
    // `f × d` at row i·f and column k·d, are live: TF32 takes two steps per tile.
    #[unroll]
    for k in 0..steps {
        let mut lhs = Sequence::<cmma::Matrix<O>>::new();
        #[unroll]
        for i in 0..s {
            // Of a column-major operand, the transposed place.
            let at = comptime!(if a_col_major { k * d } else { i * f }) * a_stride + comptime!(if a_col_major { i * f } else { k * d });
            // SAFETY: loaded on the next line, before any use.
            let fragment = unsafe { cmma::Matrix::<O>::uninitialized(cmma::MatrixIdent::A, f, f, d, a_layout) };
            cmma::load(&fragment, &a.slice(at, a.len()), a_stride as u32);
            lhs.push(fragment);
        }
        #[unroll]
        for t in 0..count {
            #[unroll]
            for j in 0..s {
                // B's fragment (k, j): `d × f` at row k·d and column j·f.
                let at = t * b_step + comptime!(if b_col_major { j * f } else { k * d }) * b_stride + comptime!(if b_col_major { k * d } else { j * f });
                // SAFETY: loaded on the next line, before any use.
                let rhs = unsafe { cmma::Matrix::<O>::uninitialized(cmma::MatrixIdent::B, f, f, d, b_layout) };
                cmma::load(&rhs, &b.slice(at, b.len()), b_stride as u32);
                #[unroll]
                for i in 0..s {
                    let acc = tiles.index_mut(comptime!(((first + t) * s + i) * s + j));
                    cmma::execute::<O, O, f32, f32>(lhs.index(i), &rhs, acc, acc);
                }
            }
        }
    }
}

/// The plane's lanes as the matrix unit: lane `l` owns rows `rows·(l / lanes_c)..` and
/// columns `cols·(l % lanes_c)..` of each accumulator tile, a `rows × cols` block in
/// registers; the tiles of a row sit one after the other in one array.
pub struct PlaneTiles;

/// `(rows, cols)` of the block each of `plane_dim` lanes owns in a 16 × 16 tile (`plane_dim` a
/// power of two from 1 to 256): as square as the lane count allows, so each operand value
/// read serves as many products as possible.
pub fn lane_block(plane_dim: usize) -> (usize, usize) {
    let log = plane_dim.trailing_zeros() as usize;
    let lanes_r = 1 << log.div_ceil(2);
    let lanes_c = plane_dim / lanes_r;
    (TILE / lanes_r, TILE / lanes_c)
}

/// Where this lane's block of the plane engine starts in a 16 × 16 tile.
#[derive(CubeType, Clone)]
struct LaneOrigin {
    row: usize,
    col: usize,
}

#[cube]
fn lane_origin(#[comptime] plane_dim: usize) -> LaneOrigin {
    let (rows, cols) = comptime!(lane_block(plane_dim));
    let lanes_c = comptime!(TILE / cols);
    let lane = UNIT_POS_X as usize;
    LaneOrigin { row: (lane / lanes_c) * rows, col: (lane % lanes_c) * cols }
}

#[cube]
impl TileMma for PlaneTiles {
    type Tiles = Array<f32>;

    fn zeros(#[comptime] count: usize, #[comptime] unit: TileUnit) -> Array<f32> {
        let plane_dim = comptime!(unit.plane_dim);
        let elements = comptime!(count * TILE * TILE / plane_dim);
        let mut tiles = Array::<f32>::new(elements);
        for i in 0..elements {
            tiles[i] = 0.0f32;
        }
        tiles
    }

    fn mma_row<E: Float>(
        tiles: &mut Array<f32>,
        #[comptime] first: usize,
        #[comptime] count: usize,
        a: &Slice<E>,
        a_stride: usize,
        #[comptime] a_col_major: bool,
        b: &Slice<E>,
        b_step: usize,
        b_stride: usize,
        #[comptime] b_col_major: bool,
        depth: usize,
        #[comptime] unit: TileUnit,
    ) {
        let plane_dim = comptime!(unit.plane_dim);
        let (rows, cols) = comptime!(lane_block(plane_dim));
        let per_tile = comptime!(rows * cols);
        let origin = lane_origin(plane_dim);
        let (row0, col0) = (origin.row, origin.col);
        let mut a_values = Array::<f32>::new(rows);
        let mut b_values = Array::<f32>::new(cols);
        // Runtime bounds: a software Vulkan driver unrolls constant loops, and these unrolled
        // take it minutes to compile.
        for t in 0..count * depth / TILE {
            let b_at = t * b_step;
            let acc_at = (first + t) * per_tile;
            for k in 0..depth {
                #[unroll]
                for i in 0..rows {
                    let index = if a_col_major { k * a_stride + row0 + i } else { (row0 + i) * a_stride + k };
                    a_values[i] = f32::cast_from(a[index]);
                }
                #[unroll]
                for j in 0..cols {
                    let index = if b_col_major { (col0 + j) * b_stride + k } else { k * b_stride + col0 + j };
                    b_values[j] = f32::cast_from(b[b_at + index]);
                }
                #[unroll]
                for i in 0..rows {
                    #[unroll]
                    for j in 0..cols {
                        tiles[acc_at + i * cols + j] += a_values[i] * b_values[j];
                    }
                }
            }
        }
    }

    fn store_row(
        tiles: &Array<f32>,
        #[comptime] first: usize,
        #[comptime] count: usize,
        out: &mut SliceMut<f32>,
        stride: usize,
        #[comptime] unit: TileUnit,
    ) {
        let plane_dim = comptime!(unit.plane_dim);
        let (rows, cols) = comptime!(lane_block(plane_dim));
        let per_tile = comptime!(rows * cols);
        let origin = lane_origin(plane_dim);
        let (row0, col0) = (origin.row, origin.col);
        for t in 0..count {
            for i in 0..rows {
                #[unroll]
                for j in 0..cols {
                    out[(row0 + i) * stride + t * TILE + col0 + j] = tiles[(first + t) * per_tile + i * cols + j];
                }
            }
        }
    }

    fn write_rows<F: Float>(
        tiles: &Array<f32>,
        #[comptime] count: usize,
        out: &mut SliceMut<F>,
        stride: usize,
        rows: usize,
        cols: usize,
        factors: &Array<f32>,
        _scratch: &mut SliceMut<f32>,
        #[comptime] unit: TileUnit,
    ) {
        let plane_dim = comptime!(unit.plane_dim);
        // Straight from the registers: each lane knows where its values go.
        let (block_rows, block_cols) = comptime!(lane_block(plane_dim));
        let per_tile = comptime!(block_rows * block_cols);
        let origin = lane_origin(plane_dim);
        let (row0, col0) = (origin.row, origin.col);
        for t in 0..count {
            for i in 0..block_rows {
                let r = row0 + i;
                #[unroll]
                for j in 0..block_cols {
                    let c = t * TILE + col0 + j;
                    if r < rows && c < cols {
                        out[r * stride + c] = F::cast_from(tiles[t * per_tile + i * block_cols + j] * factors[r]);
                    }
                }
            }
        }
    }

    fn scale_rows(
        tiles: &mut Array<f32>,
        #[comptime] count: usize,
        factors: &Array<f32>,
        _scratch: &mut SliceMut<f32>,
        #[comptime] unit: TileUnit,
    ) {
        let plane_dim = comptime!(unit.plane_dim);
        // The lane knows its rows: scale in registers.
        let (rows, cols) = comptime!(lane_block(plane_dim));
        let row0 = lane_origin(plane_dim).row;
        for t in 0..count {
            for i in 0..rows {
                let factor = factors[row0 + i];
                #[unroll]
                for j in 0..cols {
                    tiles[(t * rows + i) * cols + j] *= factor;
                }
            }
        }
    }
}

/// `tiles[0..count] += A · Bᵀ` over a staged dim of `width` columns: A the plane's 16 rows
/// starting at `a_at` of a row-major tile, B the `count × 16` rows of a row-major tile, both
/// with rows `unit.stride(width)` apart (`S = Q·Kᵀ`, `dP = dO·Vᵀ` and their transposes).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn accumulate_a_bt<F: Float, M: TileMma>(
    tiles: &mut M::Tiles,
    #[comptime] count: usize,
    a: &Slice<F>,
    a_at: usize,
    b: &Slice<F>,
    #[comptime] width: usize,
    tile_rows: usize,
    #[comptime] unit: TileUnit,
) {
    let stride = comptime!(unit.stride(width));
    for k in 0..width / tile_rows {
        let a_k = a.slice(a_at + k * TILE, a.len());
        let b_k = b.slice(k * TILE, b.len());
        M::mma_row::<F>(tiles, 0usize, count, &a_k, stride, false, &b_k, TILE * stride, stride, true, tile_rows, unit);
    }
}

/// `tiles[first..first + count] += A · B` over `depth` streamed rows: A the plane's 16 rows
/// starting at `a_at`, row stride `unit.stride(depth)` (probabilities or dS), B a row-major
/// tile of `depth` rows and `width` columns, row stride `unit.stride(width)` (`O += P·V`,
/// `dV += Pᵀ·dO`, `dK += dSᵀ·Q`, `dQ += dS·K`).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn accumulate_a_b<F: Float, M: TileMma>(
    tiles: &mut M::Tiles,
    #[comptime] first: usize,
    #[comptime] count: usize,
    a: &Slice<F>,
    a_at: usize,
    #[comptime] depth: usize,
    b: &Slice<F>,
    #[comptime] width: usize,
    tile_rows: usize,
    #[comptime] unit: TileUnit,
) {
    let (a_stride, b_stride) = comptime!((unit.stride(depth), unit.stride(width)));
    for k in 0..depth / tile_rows {
        let a_k = a.slice(a_at + k * TILE, a.len());
        let b_k = b.slice(k * TILE * b_stride, b.len());
        M::mma_row::<F>(tiles, first, count, &a_k, a_stride, false, &b_k, TILE, b_stride, false, tile_rows, unit);
    }
}

/// Waits until every lane of this plane has reached this point (and, where the plane cannot
/// synchronise alone, every lane of the cube: all planes reach it the same number of times).
#[cube]
pub fn sync_tile(#[comptime] plane_sync: bool) {
    if plane_sync {
        sync_plane();
    } else {
        sync_cube();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The banks (4 bytes each, 32 of them) that row `row` of a shared tile starts in.
    fn first_bank(unit: &TileUnit, width: usize, element_bytes: usize, row: usize) -> usize {
        (row * unit.stride(width) * element_bytes / 4) % 32
    }

    #[test]
    fn padded_rows_that_one_wavefront_reads_start_in_different_banks() {
        let unit = |skew| TileUnit { plane_dim: 32, fragment: Fragment::cube(16), plane_sync: true, skew };
        for width in [64, 128, 256] {
            // A wavefront serves 128 bytes: 8 rows of 16 bytes (an 8 × 8 16-bit fragment
            // piece), or 4 rows of TF32's 8 f32. Each must get banks of its own.
            for (element_bytes, rows, banks_per_row) in [(2, 8, 4), (4, 4, 8)] {
                let groups = |skew| -> Vec<usize> { (0..rows).map(|row| first_bank(&unit(skew), width, element_bytes, row) / banks_per_row).collect() };
                let mut padded = groups(8);
                padded.sort();
                padded.dedup();
                assert_eq!(padded.len(), rows, "width {width}, {element_bytes}-byte elements: {:?}", groups(8));
                // Unpadded, every row starts in bank 0: the conflicts the padding removes.
                assert!(groups(0).iter().all(|&group| group == 0), "width {width}: {:?}", groups(0));
            }
        }
        // Fragments load from 32-byte aligned rows: 16 rows (or 8, TF32's depth) down.
        for width in [16, 64, 128, 256] {
            for element_bytes in [2, 4] {
                assert_eq!(8 * unit(8).stride(width) * element_bytes % 32, 0);
            }
        }
    }

    #[test]
    fn lane_blocks_cover_the_tile_squarely() {
        for (plane, block) in [(1, (16, 16)), (4, (8, 8)), (8, (4, 8)), (16, (4, 4)), (32, (2, 4)), (64, (2, 2))] {
            assert_eq!(lane_block(plane), block, "plane of {plane}");
            assert_eq!(block.0 * block.1 * plane, TILE * TILE);
        }
    }
}
