//! What the kernels share besides the tile products: the comptime block sizes, where a cube
//! sits, copying tiles from global to shared memory, and causal visibility.

use cubecl::prelude::*;

use super::tile_ops::{Fragment, TILE, TileMma, TileUnit, accumulate_a_b};

/// The comptime shape of a launch. A cube owns `planes × 16` rows of one (batch, head): the
/// query rows of the forward and dQ kernels, the key rows of the dK/dV kernel; plane `p`
/// owns rows `16p..16p + 16` of it. The other side streams through shared memory
/// `block_kv` rows at a time (keys, or queries for dK/dV), and the head dims
/// `dim_chunk` (`value_chunk`) columns at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Blocks {
    pub plane_dim: usize,
    pub planes: usize,
    pub block_kv: usize,
    /// Head dim and value dim, rounded up to a multiple of 16 (the padding reads as zeros).
    pub dim: usize,
    pub value_dim: usize,
    pub dim_chunk: usize,
    pub value_chunk: usize,
    /// Whether a plane may synchronise alone (CUDA); elsewhere the whole cube does.
    pub plane_sync: bool,
    /// Padding after each row of a shared tile ([`TileUnit::stride`]).
    pub skew: usize,
    /// The tensor-core fragment, from the device's; the plane engine ignores it.
    pub fragment: Fragment,
    pub causal: bool,
    /// Whether the call restricts rows to runs of keys ([`VisibleRanges`](super::VisibleRanges):
    /// documents, key padding); without, the range arguments are never read.
    pub ranged: bool,
    /// Which gradients a launch of the dK/dV kernel computes (the other kernels ignore it).
    pub key_value_pass: KeyValuePass,
    /// The output columns this launch accumulates (the forward's O, dQ, and dV or dK in a
    /// pass of one of them); `None`: all of them.
    pub part: Option<ColumnPart>,
}

/// Output columns `first..first + width` (multiples of 16): where a kernel's accumulators for
/// every column would not fit the registers (head dim 256 on TF32), it runs once per part,
/// each launch recomputing the scores (see `plan::part_width`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ColumnPart {
    pub first: usize,
    pub width: usize,
}

impl ColumnPart {
    /// Every column of an output `width` wide.
    pub fn whole(width: usize) -> Self {
        ColumnPart { first: 0, width }
    }

    /// The parts of `part_width` columns covering an output `width` wide (`None` alone when
    /// one part covers it).
    pub fn cover(width: usize, part_width: usize) -> Vec<Option<ColumnPart>> {
        if part_width >= width {
            return vec![None];
        }
        (0..width.div_ceil(part_width)).map(|i| Some(ColumnPart { first: i * part_width, width: part_width.min(width - i * part_width) })).collect()
    }
}

/// Where a chunk of staged columns meets a launch's part: the first accumulator tile it adds
/// to, its first column inside the chunk, and the tiles it covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkInPart {
    pub first_tile: usize,
    pub column: usize,
    pub tiles: usize,
}

/// The gradients one launch of the dK/dV kernel computes: both, or (where the two
/// accumulators would not fit the registers together) dV in one launch and dK in another,
/// each recomputing the probabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyValuePass {
    Both,
    Values,
    Keys,
}

impl KeyValuePass {
    pub fn keys(self) -> bool {
        self != KeyValuePass::Values
    }

    pub fn values(self) -> bool {
        self != KeyValuePass::Keys
    }
}

impl Blocks {
    /// Rows a cube owns.
    pub fn block_rows(&self) -> usize {
        self.planes * TILE
    }

    /// How the planes multiply tiles.
    pub fn unit(&self) -> TileUnit {
        TileUnit { plane_dim: self.plane_dim, fragment: self.fragment, plane_sync: self.plane_sync, skew: self.skew }
    }

    pub fn dim_chunks(&self) -> usize {
        self.dim / self.dim_chunk
    }

    pub fn value_chunks(&self) -> usize {
        self.value_dim / self.value_chunk
    }

    /// Accumulator tiles of an output `width` columns wide in this launch's part.
    pub fn part_tiles(&self, width: usize) -> usize {
        self.part.map_or(width, |part| part.width) / TILE
    }

    /// Where chunk `index` (of `chunk` columns) of an output meets this launch's part, if it
    /// does.
    pub fn chunk_in_part(&self, index: usize, chunk: usize) -> Option<ChunkInPart> {
        let (start, end) = (index * chunk, (index + 1) * chunk);
        let (first, last) = self.part.map_or((0, usize::MAX), |part| (part.first, part.first + part.width));
        let (from, to) = (start.max(first), end.min(last));
        (from < to).then(|| ChunkInPart { first_tile: (from - first) / TILE, column: from - start, tiles: (to - from) / TILE })
    }

    /// The part's first column (0 without a part).
    pub fn part_first(&self) -> usize {
        self.part.map_or(0, |part| part.first)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_meet_parts_tile_by_tile() {
        assert_eq!(ColumnPart::cover(256, 256), vec![None]);
        assert_eq!(
            ColumnPart::cover(256, 128),
            vec![Some(ColumnPart { first: 0, width: 128 }), Some(ColumnPart { first: 128, width: 128 })]
        );
        let blocks = |part| Blocks {
            plane_dim: 32,
            planes: 4,
            block_kv: 64,
            dim: 256,
            value_dim: 256,
            dim_chunk: 256,
            value_chunk: 256,
            plane_sync: true,
            skew: 8,
            fragment: Fragment::cube(16),
            causal: false,
            ranged: false,
            key_value_pass: KeyValuePass::Both,
            part,
        };
        let whole = blocks(None);
        assert_eq!(whole.part_tiles(256), 16);
        assert_eq!(whole.chunk_in_part(0, 256), Some(ChunkInPart { first_tile: 0, column: 0, tiles: 16 }));
        // Without a part, chunk 2 of 64 columns adds to tiles 8..12.
        assert_eq!(whole.chunk_in_part(2, 64), Some(ChunkInPart { first_tile: 8, column: 0, tiles: 4 }));
        let second = blocks(Some(ColumnPart { first: 128, width: 128 }));
        assert_eq!(second.part_tiles(256), 8);
        // One staged chunk of every column: the part's half of it.
        assert_eq!(second.chunk_in_part(0, 256), Some(ChunkInPart { first_tile: 0, column: 128, tiles: 8 }));
        // Chunks of 64: the first two lie outside, the last two fill the part.
        assert_eq!(second.chunk_in_part(1, 64), None);
        assert_eq!(second.chunk_in_part(2, 64), Some(ChunkInPart { first_tile: 0, column: 0, tiles: 4 }));
        assert_eq!(second.chunk_in_part(3, 64), Some(ChunkInPart { first_tile: 4, column: 0, tiles: 4 }));
    }
}

/// The (batch, head) and first row of this cube, from a grid of
/// `blocks_per_head × batch·heads` cubes spread over X and Y so that no dimension exceeds
/// `max_x` (65 535 on wgpu) whatever the sequence length.
#[derive(CubeType, Clone)]
pub struct CubePlace {
    pub batch: usize,
    pub head: usize,
    pub block: usize,
}

/// The (batch · heads) blocks a causal launch orders together, longest first: about twice the
/// blocks an H100 or a B200 runs at once (132 or 148 SMs, two blocks each). A GPU starts blocks in
/// grid order as others end; causally a block's work grows (or shrinks) with its place in its
/// head, so in head order each head's longest blocks start last and the launch ends on a tail of
/// them (a model of that scheduler, `scripts/causal-block-order.py`: 86% of the SMs' time busy at
/// 16 heads of 16 384 queries in blocks of 128, 99.5% ordered so).
/// Ordering every head together would do as well, but each block of a group streams its head's
/// K and V (dK/dV's, Q and dO): fewer heads a group keep fewer of them in L2. A group holds fewer
/// than 512 + `blocks_per_head` blocks: under 131 072 rows at 128 a block where a head has fewer
/// than 512 blocks (64 MB of K and V at head dim 128), one head where it has more.
pub const LONGEST_FIRST_BLOCKS: usize = 512;

/// This cube's place in a launch over `batch · heads · blocks_per_head` blocks (the cube in
/// range: [`cube_in_range`]). Not causal, head by head. Causal, where a block's work grows with
/// its place in the head (`work_grows`: the forward's and dQ's query blocks) or shrinks (dK/dV's
/// key blocks), the heads in groups of [`LONGEST_FIRST_BLOCKS`] blocks or more, and within a
/// group block by block, longest first, every head of the group before the next block.
#[cube]
pub fn cube_place(batch: usize, heads: usize, blocks_per_head: usize, #[comptime] causal: bool, #[comptime] work_grows: bool) -> CubePlace {
    // In 32 bits (a grid's cubes fit them: `grid`): with 64-bit indices, 64-bit divisions here
    // cost registers that the forward at head dim 128 then spilled in its loop (sm_90a).
    let cube = CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X;
    let (heads, blocks_per_head) = (u32::cast_from(heads), u32::cast_from(blocks_per_head));
    let batch_heads = u32::cast_from(batch) * heads;
    // One head a group is the plain order.
    let mut group = 1u32;
    if causal {
        group = min((LONGEST_FIRST_BLOCKS as u32 + blocks_per_head - 1) / blocks_per_head, batch_heads);
    }
    let group_cubes = group * blocks_per_head;
    let first_head = (cube / group_cubes) * group;
    // The last group may have fewer heads.
    let heads_here = min(group, batch_heads - first_head);
    let within = cube % group_cubes;
    let rank = within / heads_here;
    let batch_head = first_head + within % heads_here;
    let mut block = rank;
    if comptime!(causal && work_grows) {
        block = blocks_per_head - 1 - rank;
    }
    CubePlace { batch: usize::cast_from(batch_head / heads), head: usize::cast_from(batch_head % heads), block: usize::cast_from(block) }
}

/// Each cube's place as [`cube_place`] gives it, `[batch, head, block]` at row
/// `cube` of `places` (f32: exact below 2^24), for the tests.
#[cube(launch, address_type = "dynamic")]
pub(crate) fn block_order_kernel(places: &mut Tensor<f32>, batch: usize, heads: usize, blocks_per_head: usize, #[comptime] causal: bool, #[comptime] work_grows: bool) {
    if cube_in_range(batch, heads, blocks_per_head) {
        let place = cube_place(batch, heads, blocks_per_head, causal, work_grows);
        let at = cube_index() * 3;
        places[at] = f32::cast_from(place.batch);
        places[at + 1] = f32::cast_from(place.head);
        places[at + 2] = f32::cast_from(place.block);
    }
}

/// Whether this cube has work: the grid may hold a few more cubes than blocks.
#[cube]
pub fn cube_in_range(batch: usize, heads: usize, blocks_per_head: usize) -> bool {
    cube_index() < batch * heads * blocks_per_head
}

/// This cube's index in a grid spread over X and Y (see `grid` on the host side).
#[cube]
pub fn cube_index() -> usize {
    CUBE_POS_Y as usize * CUBE_COUNT_X as usize + CUBE_POS_X as usize
}

/// Index of element `[batch, head, row, 0]` of a `[batch, heads, rows, ..]` tensor.
#[cube]
pub fn row_offset<T: CubePrimitive>(tensor: &Tensor<T>, batch: usize, head: usize, row: usize) -> usize {
    batch * tensor.stride(0) + head * tensor.stride(1) + row * tensor.stride(2)
}

/// Copies rows `first..first + rows` and columns `col0..col0 + width` of the (batch, head)
/// plane at element offset `base` of a `[batch, heads, len, dim]` tensor into `tile` at
/// `tile_offset` (`rows × width`, row-major with rows `unit.stride(width)` apart, in the
/// storage type). Rows past `len` and columns past `dim` read as zeros. The whole cube
/// cooperates, `N` elements per read (`dim` is a multiple of `N`, and the tensor contiguous
/// in its last dimension).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn stage_tile<F: Float, N: Size>(
    source: &Tensor<Vector<F, N>>,
    base: usize,
    first: usize,
    len: usize,
    col0: usize,
    dim: usize,
    tile: &mut SharedMemory<F>,
    tile_offset: usize,
    #[comptime] rows: usize,
    #[comptime] width: usize,
    #[comptime] unit: TileUnit,
) {
    let n = N::value();
    let vectors_per_row = comptime!(width / n);
    let stride = comptime!(unit.stride(width));
    let units = CUBE_DIM as usize;
    let mut i = UNIT_POS as usize;
    let row_stride = source.stride(2);
    while i < rows * vectors_per_row {
        let r = i / vectors_per_row;
        let col = col0 + (i % vectors_per_row) * n;
        let at = tile_offset + r * stride + (i % vectors_per_row) * n;
        if first + r < len && col < dim {
            let vector = source[(base + (first + r) * row_stride + col) / n];
            #[unroll]
            for e in 0..n {
                tile[at + e] = vector[e];
            }
        } else {
            #[unroll]
            for e in 0..n {
                tile[at + e] = F::from_int(0);
            }
        }
        i += units;
    }
}

/// `acc += A · B` over this launch's part of an output (all of it without one): `B` is
/// `depth` rows of `source` from row `first` (`len` of them), its columns in `chunks` chunks
/// of `chunk`, each staged into `b_tile` (unless `staged`: one chunk, in `b_tile` already)
/// only where it meets the part. `A` is the plane's 16 rows at `a_at` (probabilities or dS,
/// row stride `depth`): `O += P·V`, `dK += dSᵀ·Q`, `dQ += dS·K`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn accumulate_part<F: Float, M: TileMma, N: Size>(
    acc: &mut M::Tiles,
    a: &SharedMemory<F>,
    a_at: usize,
    source: &Tensor<Vector<F, N>>,
    base: usize,
    first: usize,
    len: usize,
    dim: usize,
    b_tile: &mut SharedMemory<F>,
    tile_rows: usize,
    #[comptime] depth: usize,
    #[comptime] chunk: usize,
    #[comptime] chunks: usize,
    #[comptime] staged: bool,
    #[comptime] blocks: Blocks,
) {
    #[unroll]
    for index in 0..chunks {
        let meets = comptime!(blocks.chunk_in_part(index, chunk));
        if comptime!(meets.is_some()) {
            let first_tile = comptime!(meets.unwrap().first_tile);
            let column = comptime!(meets.unwrap().column);
            let tiles = comptime!(meets.unwrap().tiles);
            if comptime!(!staged) {
                sync_cube();
                stage_tile(source, base, first, len, index * chunk, dim, b_tile, 0, depth, chunk, comptime!(blocks.unit()));
                sync_cube();
            }
            accumulate_a_b::<F, M>(acc, first_tile, tiles, &a.to_slice(), a_at, depth, &b_tile.to_slice().slice(column, b_tile.len()), chunk, tile_rows, comptime!(blocks.unit()));
        }
    }
}

/// Copies `count` f32 row statistics (log-sum-exp, or delta) of rows `first..` into `tile`;
/// rows past `len` get `fill`.
#[cube]
pub fn stage_row_stats(source: &Tensor<f32>, base: usize, first: usize, len: usize, tile: &mut SharedMemory<f32>, fill: f32, #[comptime] count: usize) {
    let mut i = UNIT_POS as usize;
    while i < count {
        let mut x = fill;
        if first + i < len {
            x = source[base + (first + i) * source.stride(2)];
        }
        tile[i] = x;
        i += CUBE_DIM as usize;
    }
}

/// Under bottom-right aligned causal attention (burn's `is_causal`), query row `i` sees key
/// `j` when `j + seq_q <= i + seq_kv`: the number of keys row `row` sees (capped at `seq_kv`).
#[cube]
pub fn keys_seen(row: usize, seq_q: usize, seq_kv: usize) -> usize {
    min(seq_kv, select(row + 1 + seq_kv > seq_q, row + 1 + seq_kv - seq_q, 0))
}

/// How many keys the query rows `first_row..first_row + rows` see together: all of them,
/// or under causal attention those the last row (before `seq_q`) sees.
#[cube]
pub fn keys_seen_by_rows(first_row: usize, #[comptime] rows: usize, seq_q: usize, seq_kv: usize, #[comptime] causal: bool) -> usize {
    let mut visible = seq_kv;
    if causal {
        visible = keys_seen(min(first_row + rows, seq_q) - 1, seq_q, seq_kv);
    }
    visible
}

/// The first query row that sees key `col` (bottom-right aligned causal attention).
#[cube]
pub fn first_row_seeing(col: usize, seq_q: usize, seq_kv: usize) -> usize {
    select(col + seq_q > seq_kv, col + seq_q - seq_kv, 0)
}

/// A run `start..end` of positions; empty when `start >= end`.
#[derive(CubeType, Clone)]
pub struct Run {
    pub start: usize,
    pub end: usize,
}

/// The keys query row `row` sees: its run of the call's ranges (all keys without), cut by
/// causality; empty past the last row.
#[cube]
pub fn row_keys(table: &Tensor<u32>, batch: usize, row: usize, seq_q: usize, seq_kv: usize, #[comptime] blocks: Blocks) -> Run {
    visible_run(table, batch, row, seq_q, seq_kv, false, blocks.ranged, blocks.causal)
}

/// The query rows that see key `key`: its run of the call's ranges (all rows without), cut
/// by causality; empty past the last key.
#[cube]
pub fn key_rows(table: &Tensor<u32>, batch: usize, key: usize, seq_q: usize, seq_kv: usize, #[comptime] blocks: Blocks) -> Run {
    visible_run(table, batch, key, seq_q, seq_kv, true, blocks.ranged, blocks.causal)
}

/// [`row_keys`] of query row `index`, or with `of_keys` [`key_rows`] of key `index`, for a
/// call with ranges (`ranged`) or without, causal or not.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn visible_run(
    table: &Tensor<u32>,
    batch: usize,
    index: usize,
    seq_q: usize,
    seq_kv: usize,
    #[comptime] of_keys: bool,
    #[comptime] ranged: bool,
    #[comptime] causal: bool,
) -> Run {
    let mut own = seq_q;
    let mut other = seq_kv;
    if of_keys {
        own = seq_kv;
        other = seq_q;
    }
    let mut start = 0usize;
    let mut end = other;
    if ranged {
        if index < own {
            let at = 2 * (batch * own + index);
            start = usize::cast_from(table[at]);
            end = usize::cast_from(table[at + 1]);
        }
    }
    if causal {
        if of_keys {
            start = max(start, first_row_seeing(index, seq_q, seq_kv));
        } else {
            end = min(end, keys_seen(index, seq_q, seq_kv));
        }
    }
    if index >= own {
        end = 0usize;
    }
    Run { start, end }
}

/// What the cube's `count` rows starting at `first` (query rows, or key rows when
/// `of_keys`) see together: a run covering each one's run, the same in every plane (each
/// reduces over all of the cube's rows), so loops bounded by it keep the cube's barriers
/// uniform. Without ranges it is the causal bound alone, as before ranges existed.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn cube_run(
    table: &Tensor<u32>,
    batch: usize,
    first: usize,
    seq_q: usize,
    seq_kv: usize,
    #[comptime] count: usize,
    #[comptime] of_keys: bool,
    #[comptime] blocks: Blocks,
) -> Run {
    let mut start = 0usize;
    let mut end = seq_q;
    if blocks.ranged {
        // Rows past the end have empty runs, so they add nothing; with no run at all the
        // result is empty too (`start > end`: above any position, below any end).
        let mut lowest = u32::cast_from(seq_q + seq_kv);
        let mut highest = 0u32;
        let mut i = UNIT_POS_X as usize;
        while i < count {
            let one = visible_run(table, batch, first + i, seq_q, seq_kv, of_keys, blocks.ranged, blocks.causal);
            if one.start < one.end {
                lowest = min(lowest, u32::cast_from(one.start));
                highest = max(highest, u32::cast_from(one.end));
            }
            i += CUBE_DIM_X as usize;
        }
        start = usize::cast_from(plane_min(lowest));
        end = usize::cast_from(plane_max(highest));
    } else if of_keys {
        if blocks.causal {
            start = first_row_seeing(first, seq_q, seq_kv);
        }
    } else {
        end = keys_seen_by_rows(first, count, seq_q, seq_kv, blocks.causal);
    }
    Run { start, end }
}

