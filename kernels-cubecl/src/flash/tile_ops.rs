//! The matrix products of the kernels, on 16 × 16 tiles: one plane (warp) computes one
//! `16 × 16 += 16 × 16 · 16 × 16` step, with f32 accumulation.
//!
//! Two implementations behind one trait, chosen when the kernel is launched:
//! - [`CmmaTiles`]: tensor cores (`cmma`, CUDA's wmma) for f16 and bf16 operands; the
//!   accumulator is an opaque fragment.
//! - [`PlaneTiles`]: the same product done by the plane's lanes from shared memory, for
//!   devices without tensor cores (a software Vulkan driver: the CPU tests) and for f32.
//!   Each lane owns a `rows × cols` block of the 16 × 16 accumulator in registers, so each
//!   operand value it reads from shared memory serves `cols` (or `rows`) multiply-adds.
//!
//! Everything else in the kernels (tiling, online softmax, masking, causal skipping, GQA,
//! the backward's products) is the same code for both, so the CPU tests cover all of it but
//! the fragment itself.

use cubecl::{cmma, prelude::*};

/// Rows and columns of a tile (and the depth of one product step).
pub const TILE: usize = 16;

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
    fn zeros(#[comptime] count: usize, #[comptime] plane_dim: usize) -> Self::Tiles;

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
        #[comptime] plane_dim: usize,
    );

    /// Writes `tiles[first + t]` for `t` in `0..count` row-major into `out`, side by side
    /// (tile `t` at column `16t`, row stride `stride`).
    fn store_row(
        tiles: &Self::Tiles,
        #[comptime] first: usize,
        #[comptime] count: usize,
        out: &mut SliceMut<f32>,
        stride: usize,
        #[comptime] plane_dim: usize,
    );

    /// Writes `tiles[t]` for `t` in `0..count`, row `r` times `factors[r]`, to `out` in its
    /// storage type (tile `t` at column `16t`, row stride `stride`), skipping rows from
    /// `rows` on and columns from `cols` on (the ends of the sequence and of the head dim).
    /// `scratch` and `plane_sync` as for [`scale_rows`](Self::scale_rows).
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
        #[comptime] plane_dim: usize,
        #[comptime] plane_sync: bool,
    );

    /// Multiplies row `r` of each of the `count` tiles by `factors[r]` (every lane holds all
    /// 16 factors). `scratch` (256 f32 of this plane's shared memory) is for implementations
    /// that go through shared memory; they may synchronise the plane alone only where
    /// `plane_sync` (CUDA).
    fn scale_rows(
        tiles: &mut Self::Tiles,
        #[comptime] count: usize,
        factors: &Array<f32>,
        scratch: &mut SliceMut<f32>,
        #[comptime] plane_dim: usize,
        #[comptime] plane_sync: bool,
    );
}

/// Tensor cores: `cmma` fragments of 16 × 16 × 16, f16 or bf16 operands, f32 accumulator.
pub struct CmmaTiles;

#[cube]
impl TileMma for CmmaTiles {
    type Tiles = Sequence<cmma::Matrix<f32>>;

    fn zeros(#[comptime] count: usize, #[comptime] _plane_dim: usize) -> Sequence<cmma::Matrix<f32>> {
        let mut tiles = Sequence::new();
        #[unroll]
        for _ in 0..count {
            tiles.push(cmma::Matrix::<f32>::from_value(cmma::MatrixIdent::Accumulator, TILE, TILE, TILE, cmma::MatrixLayout::Undefined, 0.0));
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
        #[comptime] _plane_dim: usize,
    ) {
        let a_layout = if a_col_major { cmma::MatrixLayout::ColMajor } else { cmma::MatrixLayout::RowMajor };
        let b_layout = if b_col_major { cmma::MatrixLayout::ColMajor } else { cmma::MatrixLayout::RowMajor };
        let lhs = cmma::Matrix::<E>::from_slice(cmma::MatrixIdent::A, TILE, TILE, TILE, a_layout, a, a_stride as u32);
        #[unroll]
        for t in 0..count {
            let rhs = cmma::Matrix::<E>::from_slice(cmma::MatrixIdent::B, TILE, TILE, TILE, b_layout, &b.slice(t * b_step, b.len()), b_stride as u32);
            let acc = tiles.index_mut(first + t);
            cmma::execute::<E, E, f32, f32>(&lhs, &rhs, acc, acc);
        }
    }

    fn store_row(
        tiles: &Sequence<cmma::Matrix<f32>>,
        #[comptime] first: usize,
        #[comptime] count: usize,
        out: &mut SliceMut<f32>,
        stride: usize,
        #[comptime] _plane_dim: usize,
    ) {
        #[unroll]
        for t in 0..count {
            let mut tile_out = out.slice_mut(t * TILE, out.len());
            cmma::store(&mut tile_out, tiles.index(first + t), stride as u32, cmma::MatrixLayout::RowMajor);
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
        #[comptime] plane_dim: usize,
        #[comptime] _plane_sync: bool,
    ) {
        #[unroll]
        for t in 0..count {
            cmma::store(scratch, tiles.index(t), TILE as u32, cmma::MatrixLayout::RowMajor);
            sync_plane();
            let mut i = UNIT_POS_X as usize;
            while i < TILE * TILE {
                let (r, c) = (i / TILE, t * TILE + i % TILE);
                if r < rows && c < cols {
                    out[r * stride + c] = F::cast_from(scratch[i] * factors[r]);
                }
                i += plane_dim;
            }
            sync_plane();
        }
    }

    fn scale_rows(
        tiles: &mut Sequence<cmma::Matrix<f32>>,
        #[comptime] count: usize,
        factors: &Array<f32>,
        scratch: &mut SliceMut<f32>,
        #[comptime] plane_dim: usize,
        #[comptime] _plane_sync: bool,
    ) {
        // The fragments' layout is opaque: through shared memory and back. Only on CUDA,
        // where the plane synchronises alone.
        #[unroll]
        for t in 0..count {
            let acc = tiles.index_mut(t);
            cmma::store(scratch, acc, TILE as u32, cmma::MatrixLayout::RowMajor);
            sync_plane();
            let mut i = UNIT_POS_X as usize;
            while i < TILE * TILE {
                scratch[i] = scratch[i] * factors[i / TILE];
                i += plane_dim;
            }
            sync_plane();
            cmma::load_with_layout(acc, &scratch.to_slice(), TILE as u32, cmma::MatrixLayout::RowMajor);
            sync_plane();
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

    fn zeros(#[comptime] count: usize, #[comptime] plane_dim: usize) -> Array<f32> {
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
        #[comptime] plane_dim: usize,
    ) {
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
        #[comptime] plane_dim: usize,
    ) {
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
        #[comptime] plane_dim: usize,
        #[comptime] _plane_sync: bool,
    ) {
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
        #[comptime] plane_dim: usize,
        #[comptime] _plane_sync: bool,
    ) {
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
/// starting at `a_at` of a row-major tile, B the `count × 16` rows of a row-major tile
/// (`S = Q·Kᵀ`, `dP = dO·Vᵀ` and their transposes).
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
    #[comptime] plane_dim: usize,
) {
    for k in 0..width / tile_rows {
        let a_k = a.slice(a_at + k * TILE, a.len());
        let b_k = b.slice(k * TILE, b.len());
        M::mma_row::<F>(tiles, 0usize, count, &a_k, width, false, &b_k, TILE * width, width, true, tile_rows, plane_dim);
    }
}

/// `tiles[first..first + count] += A · B` over `depth` streamed rows: A the plane's 16 rows
/// starting at `a_at`, row stride `depth` (probabilities or dS), B a row-major tile of
/// `depth` rows and `width` columns (`O += P·V`, `dV += Pᵀ·dO`, `dK += dSᵀ·Q`, `dQ += dS·K`).
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
    #[comptime] plane_dim: usize,
) {
    for k in 0..depth / tile_rows {
        let a_k = a.slice(a_at + k * TILE, a.len());
        let b_k = b.slice(k * TILE * width, b.len());
        M::mma_row::<F>(tiles, first, count, &a_k, depth, false, &b_k, TILE, width, false, tile_rows, plane_dim);
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

    #[test]
    fn lane_blocks_cover_the_tile_squarely() {
        for (plane, block) in [(1, (16, 16)), (4, (8, 8)), (8, (4, 8)), (16, (4, 4)), (32, (2, 4)), (64, (2, 2))] {
            assert_eq!(lane_block(plane), block, "plane of {plane}");
            assert_eq!(block.0 * block.1 * plane, TILE * TILE);
        }
    }
}
