//! Forward kernel: FlashAttention-2's loop, a plane per 16 query rows.
//!
//! A cube owns `planes × 16` consecutive query rows of one (batch, q head), plane `p` rows
//! `16p..16p + 16`. It walks the keys in tiles of `block_kv`, only those its rows can see
//! (causality, and the runs of keys of documents or key padding); for each tile:
//! 1. the cube stages K (and Q, unless it stays staged) into shared memory, `dim_chunk`
//!    columns at a time, and each plane computes its `16 × block_kv` scores `S = Q·Kᵀ` on
//!    tiles (tensor cores where there are some);
//! 2. the scores go to the plane's shared memory, where the online softmax runs a row at a
//!    time with the lanes across the columns, row maxima and sums by plane reductions; only a
//!    tile that crosses the edge of a row's visible keys (the causal diagonal, a document's
//!    edge, the end of the keys) is masked per element;
//! 3. `P` (in the storage type) and V feed `O += P·V`, the output staying in accumulator
//!    tiles for the whole loop.
//!
//! The row maximum is only moved (and `O` rescaled) when a new maximum exceeds it by more
//! than [`RESCALE_THRESHOLD`]: the result is exact either way, since `O` and the row sum are
//! always relative to the same maximum, and probabilities stay below e^8, which f16 holds. So
//! after the first tiles `O` is rarely rescaled, which on tensor cores is a round trip
//! through shared memory.
//!
//! It writes the output and the per-row log-sum-exp `lse = m + ln(l)`, which the backward
//! kernels use to recompute probabilities.

use cubecl::prelude::*;

use super::{
    stage::{Blocks, accumulate_part, cube_in_range, cube_place, cube_run, row_keys, row_offset, stage_tile},
    tile_ops::{TILE, TileMma, accumulate_a_bt, sync_tile},
};

/// Stand-in for -infinity in running maxima and masked scores (WGSL cannot spell infinity).
pub(crate) const MASKED: f32 = -1.0e30;

/// How far (natural log) a new row maximum may exceed the one `O` is relative to before
/// `O` is rescaled to it.
pub(crate) const RESCALE_THRESHOLD: f32 = 8.0;

#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_forward_kernel<F: Float, M: TileMma, N: Size>(
    query: &Tensor<Vector<F, N>>,
    key: &Tensor<Vector<F, N>>,
    value: &Tensor<Vector<F, N>>,
    output: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    // `[start, end]` of the keys each query row sees (`VisibleRanges`), read when
    // `blocks.ranged`.
    ranges: &Tensor<u32>,
    scale: f32,
    blocks_per_head: usize,
    // 16 (a tile's rows), as a runtime value so that the loops over a tile's rows stay
    // loops: a software Vulkan driver unrolls constant ones into shaders it takes minutes to
    // compile.
    tile_rows: usize,
    #[comptime] blocks: Blocks,
    #[define(F)] _dtype: StorageType,
) {
    let q_heads = output.shape(1);
    if cube_in_range(output.shape(0), q_heads, blocks_per_head) {
        let (seq_q, seq_kv) = (output.shape(2), key.shape(2));
        let (head_dim, value_dim) = (query.shape(3), value.shape(3));
        let place = cube_place(output.shape(0), q_heads, blocks_per_head, comptime!(blocks.causal), true);
        let (batch, head) = (place.batch, place.head);
        let kv_head = head / (q_heads / key.shape(1));
        let (plane_dim, planes, block_kv) = comptime!((blocks.plane_dim, blocks.planes, blocks.block_kv));
        let unit = comptime!(blocks.unit());
        let (dim_chunk, value_chunk) = comptime!((blocks.dim_chunk, blocks.value_chunk));
        let block_rows = comptime!(blocks.block_rows());
        let kv_tiles = comptime!(block_kv / TILE);
        // Row strides of the shared tiles (padded: see `TileUnit::stride`).
        let (dim_stride, value_stride, kv_stride) = comptime!((unit.stride(dim_chunk), unit.stride(value_chunk), unit.stride(block_kv)));
        let first_row = place.block * block_rows;
        let plane = UNIT_POS_Y as usize;
        let lane = UNIT_POS_X as usize;
        let plane_row = first_row + plane * TILE;

        let mut q_tile = SharedMemory::<F>::new(block_rows * dim_stride);
        let mut k_tile = SharedMemory::<F>::new(block_kv * dim_stride);
        let mut v_tile = SharedMemory::<F>::new(block_kv * value_stride);
        let mut scores = SharedMemory::<f32>::new(planes * TILE * kv_stride);
        let mut probs = SharedMemory::<F>::new(planes * TILE * kv_stride);
        // Whether each plane rescales its output this tile (read where the cube synchronises).
        let mut rescaling = SharedMemory::<u32>::new(planes);
        let scores_at = plane * TILE * kv_stride;

        // This launch's output columns (all of them, or its part).
        let value_tiles = comptime!(blocks.part_tiles(blocks.value_dim));
        let mut out_acc = M::zeros(value_tiles, unit);
        let mut row_max = Array::<f32>::new(TILE);
        let mut row_sum = Array::<f32>::new(TILE);
        let mut factors = Array::<f32>::new(TILE);
        for r in 0..tile_rows {
            row_max[r] = f32::new(MASKED);
            row_sum[r] = 0.0f32;
        }

        let q_base = row_offset(query, batch, head, 0);
        let k_base = row_offset(key, batch, kv_head, 0);
        let v_base = row_offset(value, batch, kv_head, 0);
        // Only the tiles holding keys that some row of the cube sees.
        let keys = cube_run(ranges, batch, first_row, seq_q, seq_kv, block_rows, false, blocks);
        let (first_tile, end_tile) = (keys.start / block_kv, keys.end.div_ceil(block_kv));
        if comptime!(blocks.dim_chunks() == 1) {
            // Staged once; the first tile's barriers make it visible.
            stage_tile(query, q_base, first_row, seq_q, 0, head_dim, &mut q_tile, 0, block_rows, dim_chunk, unit);
        }

        for tile in first_tile..end_tile {
            let kv0 = tile * block_kv;

            // S = Q · Kᵀ for this plane's 16 rows. With whole head dims, K and V are staged
            // together behind one barrier (the one before it keeps a slower plane's reads of
            // the previous tiles from being overwritten).
            let mut s_acc = M::zeros(kv_tiles, unit);
            if comptime!(blocks.dim_chunks() == 1) {
                sync_cube();
                stage_tile(key, k_base, kv0, seq_kv, 0, head_dim, &mut k_tile, 0, block_kv, dim_chunk, unit);
                if comptime!(blocks.value_chunks() == 1) {
                    stage_tile(value, v_base, kv0, seq_kv, 0, value_dim, &mut v_tile, 0, block_kv, value_chunk, unit);
                }
                sync_cube();
                accumulate_a_bt::<F, M>(&mut s_acc, kv_tiles, &q_tile.to_slice(), plane * TILE * dim_stride, &k_tile.to_slice(), dim_chunk, tile_rows, unit);
            } else {
                for chunk in 0..comptime!(blocks.dim_chunks()) {
                    let col0 = chunk * dim_chunk;
                    sync_cube();
                    stage_tile(query, q_base, first_row, seq_q, col0, head_dim, &mut q_tile, 0, block_rows, dim_chunk, unit);
                    stage_tile(key, k_base, kv0, seq_kv, col0, head_dim, &mut k_tile, 0, block_kv, dim_chunk, unit);
                    sync_cube();
                    accumulate_a_bt::<F, M>(&mut s_acc, kv_tiles, &q_tile.to_slice(), plane * TILE * dim_stride, &k_tile.to_slice(), dim_chunk, tile_rows, unit);
                }
            }
            let mut out = scores.slice_mut(scores_at, scores_at + TILE * kv_stride);
            M::store_row(&s_acc, 0usize, kv_tiles, &mut out, kv_stride, unit);
            sync_tile(blocks.plane_sync);

            // Online softmax, a row at a time, the lanes across the columns.
            let mut rescale = false;
            for r in 0..tile_rows {
                let seen = row_keys(ranges, batch, plane_row + r, seq_q, seq_kv, blocks);
                // Only a tile that reaches past what the row sees is masked per element.
                let crosses = kv0 < seen.start || kv0 + block_kv > seen.end;
                let row_at = scores_at + r * kv_stride;
                let mut local_max = f32::new(MASKED);
                let mut c = lane;
                while c < block_kv {
                    let mut s = scores[row_at + c] * scale;
                    if crosses && (kv0 + c < seen.start || kv0 + c >= seen.end) {
                        s = f32::new(MASKED);
                    }
                    scores[row_at + c] = s;
                    local_max = max(local_max, s);
                    c += plane_dim;
                }
                let tile_max = plane_max(local_max);
                let mut factor = 1.0f32;
                if tile_max > row_max[r] + RESCALE_THRESHOLD {
                    factor = (row_max[r] - tile_max).exp();
                    row_max[r] = tile_max;
                    rescale = true;
                }
                let reference = row_max[r];
                let mut local_sum = 0.0f32;
                c = lane;
                while c < block_kv {
                    let s = scores[row_at + c];
                    // A NaN score is no masked one: it reaches the row as burn's softmax takes it.
                    let p = select(s <= f32::new(0.5 * MASKED), 0.0f32, (s - reference).exp());
                    probs[row_at + c] = F::cast_from(p);
                    local_sum += p;
                    c += plane_dim;
                }
                row_sum[r] = row_sum[r] * factor + plane_sum(local_sum);
                factors[r] = factor;
            }
            if comptime!(!blocks.plane_sync) {
                if lane == 0 {
                    rescaling[plane] = u32::cast_from(rescale);
                }
            }
            sync_tile(blocks.plane_sync);
            // Uniform over the plane: every lane holds the same maxima. Where barriers are the
            // cube's, every plane rescales when one does (by 1 where it need not), since
            // `scale_rows` may hold barriers. The flags are rewritten only after the next
            // tile's first barrier, when every plane has read them.
            if comptime!(!blocks.plane_sync) {
                for p in 0..planes {
                    rescale = rescale || rescaling[p] != 0;
                }
            }
            if rescale {
                let mut scratch = scores.slice_mut(scores_at, scores_at + TILE * TILE);
                M::scale_rows(&mut out_acc, value_tiles, &factors, &mut scratch, unit);
            }

            // O += P · V, over this launch's output columns; V is staged already where K and
            // V went in together.
            let staged = comptime!(blocks.dim_chunks() == 1 && blocks.value_chunks() == 1);
            let chunks = comptime!(blocks.value_chunks());
            accumulate_part::<F, M, N>(&mut out_acc, &probs, scores_at, value, v_base, kv0, seq_kv, value_dim, &mut v_tile, tile_rows, block_kv, value_chunk, chunks, staged, blocks);
        }

        // O / l, and the log-sum-exp.
        let mut inverse = Array::<f32>::new(TILE);
        for r in 0..tile_rows {
            let sum = row_sum[r];
            inverse[r] = select(sum == 0.0f32, 0.0f32, 1.0f32 / sum);
        }
        let mut scratch = scores.slice_mut(scores_at, scores_at + TILE * TILE);
        // Every plane writes (a plane past the end writes no row): barriers stay uniform.
        let rows = seq_q - min(plane_row, seq_q);
        let part_first = comptime!(blocks.part_first());
        let o_row = row_offset(output, batch, head, min(plane_row, seq_q - 1)) + part_first;
        let mut out = output.slice_mut(o_row, output.len());
        let cols = min(value_dim - part_first, value_tiles * TILE);
        M::write_rows::<F>(&out_acc, value_tiles, &mut out, output.stride(2), rows, cols, &inverse, &mut scratch, unit);
        // The log-sum-exp once, by the launch of the first part.
        let mut r = lane;
        if comptime!(part_first != 0) {
            r = TILE;
        }
        while r < TILE {
            let row = plane_row + r;
            if row < seq_q {
                let sum = row_sum[r];
                lse[row_offset(lse, batch, head, row)] = select(sum == 0.0f32, f32::new(MASKED), row_max[r] + sum.ln());
            }
            r += plane_dim;
        }
    }
}
