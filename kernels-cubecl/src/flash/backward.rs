//! Backward kernels: FlashAttention-2's backward without atomics, in three launches.
//!
//! 1. [`row_delta_kernel`]: `delta_i = Σ_d dO_id · O_id`, eight units a query row;
//! 2. [`key_value_grad_kernel`]: a cube owns `planes × 16` key rows of one kv head and streams
//!    the query rows of every q head it serves (grouped-query attention sums over the group
//!    here, so no atomics); per query tile a plane computes, on tiles, `Sᵀ = K·Qᵀ`,
//!    `Pᵀ = exp(scale·Sᵀ − lse)`, `dV += Pᵀ·dO`, `dPᵀ = V·dOᵀ`, `dSᵀ = Pᵀ ∘ (dPᵀ − delta)` and
//!    `dK += dSᵀ·Q`;
//! 3. [`query_grad_kernel`]: a cube owns `planes × 16` query rows and streams the keys:
//!    `S = Q·Kᵀ`, `P`, `dP = dO·Vᵀ`, `dS = P ∘ (dP − delta)`, `dQ += dS·K`.
//!
//! Probabilities are recomputed from the forward's log-sum-exp: no S × S matrix exists at
//! any point. Where dK's and dV's accumulators would not fit the registers together (head
//! dim 256 on tensor cores), the dK/dV kernel runs twice, dV then dK (`KeyValuePass`); where
//! even one gradient's would not (head dim 256 on TF32), each launch takes a part of its
//! columns (`ColumnPart`), as the forward's and dQ's launches do.
//! Splitting dK/dV from dQ computes the scores twice, in exchange for deterministic sums
//! (every gradient row is summed by one plane, in a fixed order) that run the same on every
//! runtime. Working with `Sᵀ` in the dK/dV kernel keeps every product in
//! the form `A·B` with operands read straight (or transposed) from shared memory.

use cubecl::prelude::*;

use super::{
    forward::MASKED,
    stage::{Blocks, accumulate_part, cube_in_range, cube_index, cube_place, cube_run, key_rows, row_keys, row_offset, stage_row_stats, stage_tile},
    tile_ops::{TILE, TileMma, accumulate_a_b, accumulate_a_bt, sync_tile},
};

/// Units that share a query row in [`row_delta_kernel`], each reading every
/// `DELTA_ROW_UNITS`-th vector of it, so that a warp's read is whole 128-byte lines (64 bf16
/// of each of four rows at vectors of 8) rather than one element of 32 rows 256 bytes apart.
pub(crate) const DELTA_ROW_UNITS: usize = 8;
/// Units a cube of [`row_delta_kernel`]: `DELTA_CUBE / DELTA_ROW_UNITS` rows.
pub(crate) const DELTA_CUBE: usize = 256;

/// `delta[b, h, i] = Σ_d dO[b, h, i, d] · O[b, h, i, d]` in f32, [`DELTA_ROW_UNITS`] units a row
/// reading vectors of `N`.
#[cube(launch, address_type = "dynamic")]
pub(crate) fn row_delta_kernel<F: Float, N: Size>(
    output: &Tensor<Vector<F, N>>,
    output_grad: &Tensor<Vector<F, N>>,
    delta: &mut Tensor<f32>,
    #[define(F)] _dtype: StorageType,
) {
    let n = N::value();
    let (heads, seq, value_dim) = (output.shape(1), output.shape(2), output.shape(3));
    let rows = output.shape(0) * heads * seq;
    let unit = UNIT_POS as usize;
    let index = cube_index() * comptime!(DELTA_CUBE / DELTA_ROW_UNITS) + unit / DELTA_ROW_UNITS;
    let mut sum = 0.0f32;
    let mut delta_at = 0usize;
    if index < rows {
        let (batch, head, row) = (index / (heads * seq), (index / seq) % heads, index % seq);
        delta_at = row_offset(delta, batch, head, row);
        let o_base = row_offset(output, batch, head, row);
        let g_base = row_offset(output_grad, batch, head, row);
        let mut column = (unit % DELTA_ROW_UNITS) * n;
        while column < value_dim {
            let (o, g) = (output[(o_base + column) / n], output_grad[(g_base + column) / n]);
            #[unroll]
            for e in 0..n {
                sum += f32::cast_from(o[e]) * f32::cast_from(g[e]);
            }
            column += comptime!(DELTA_ROW_UNITS) * n;
        }
    }
    // The row's units' sums, added by its first unit.
    let mut sums = SharedMemory::<f32>::new(DELTA_CUBE);
    sums[unit] = sum;
    sync_cube();
    if unit % DELTA_ROW_UNITS == 0 && index < rows {
        let mut total = 0.0f32;
        for u in 0..DELTA_ROW_UNITS {
            total += sums[unit + u];
        }
        delta[delta_at] = total;
    }
}

/// Writes a plane's gradient rows (accumulator tiles, `count` of them: the launch's part)
/// times `factor` to rows `first_row..` of `target` (those before `len`), from the part's
/// first column to `cols`, the tensor's width.
#[cube]
#[allow(clippy::too_many_arguments)]
fn write_gradient<F: Float, M: TileMma>(
    tiles: &M::Tiles,
    target: &mut Tensor<F>,
    batch: usize,
    head: usize,
    first_row: usize,
    len: usize,
    cols: usize,
    factor: f32,
    scratch: &mut SliceMut<f32>,
    #[comptime] count: usize,
    #[comptime] blocks: Blocks,
) {
    // Every plane writes (a plane past the end writes no row): barriers stay uniform.
    let mut factors = Array::<f32>::new(TILE);
    for r in 0..TILE {
        factors[r] = factor;
    }
    let rows = len - min(first_row, len);
    let part_first = comptime!(blocks.part_first());
    let at = row_offset(target, batch, head, min(first_row, len - 1)) + part_first;
    let stride = target.stride(2);
    let mut out = target.slice_mut(at, target.len());
    let part_cols = min(cols - part_first, count * TILE);
    M::write_rows::<F>(tiles, count, &mut out, stride, rows, part_cols, &factors, scratch, comptime!(blocks.unit()));
}

#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub(crate) fn key_value_grad_kernel<F: Float, M: TileMma, N: Size>(
    query: &Tensor<Vector<F, N>>,
    key: &Tensor<Vector<F, N>>,
    value: &Tensor<Vector<F, N>>,
    output_grad: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    key_grad: &mut Tensor<F>,
    value_grad: &mut Tensor<F>,
    // `[start, end]` of the query rows that see each key (`VisibleRanges`), read when
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
    let kv_heads = key_grad.shape(1);
    if cube_in_range(key_grad.shape(0), kv_heads, blocks_per_head) {
        let q_heads = lse.shape(1);
        let group = q_heads / kv_heads;
        let (seq_q, seq_kv) = (lse.shape(2), key_grad.shape(2));
        let (head_dim, value_dim) = (key_grad.shape(3), value_grad.shape(3));
        let place = cube_place(key_grad.shape(0), kv_heads, blocks_per_head, comptime!(blocks.causal), false);
        let (batch, kv_head) = (place.batch, place.head);
        let plane_dim = comptime!(blocks.plane_dim);
        let unit = comptime!(blocks.unit());
        let planes = comptime!(blocks.planes);
        let block_q = comptime!(blocks.block_kv);
        let dim_chunk = comptime!(blocks.dim_chunk);
        let value_chunk = comptime!(blocks.value_chunk);
        let block_rows = comptime!(blocks.block_rows());
        let q_tiles = comptime!(block_q / TILE);
        // Row strides of the shared tiles (padded: see `TileUnit::stride`).
        let (dim_stride, value_stride, q_stride) = comptime!((unit.stride(dim_chunk), unit.stride(value_chunk), unit.stride(block_q)));
        let whole_dims = comptime!(blocks.dim_chunks() == 1);
        let whole_values = comptime!(blocks.value_chunks() == 1);
        let first_col = place.block * block_rows;
        let plane = UNIT_POS_Y as usize;
        let lane = UNIT_POS_X as usize;
        let plane_col = first_col + plane * TILE;

        let mut k_tile = SharedMemory::<F>::new(block_rows * dim_stride);
        let mut v_tile = SharedMemory::<F>::new(block_rows * value_stride);
        let mut q_tile = SharedMemory::<F>::new(block_q * dim_stride);
        let mut g_tile = SharedMemory::<F>::new(block_q * value_stride);
        let mut lse_tile = SharedMemory::<f32>::new(block_q);
        let mut delta_tile = SharedMemory::<f32>::new(block_q);
        let mut scores = SharedMemory::<f32>::new(planes * TILE * q_stride);
        let mut dp_scores = SharedMemory::<f32>::new(planes * TILE * q_stride);
        let mut probs = SharedMemory::<F>::new(planes * TILE * q_stride);
        let scores_at = plane * TILE * q_stride;

        // A pass without one of the gradients keeps one unused tile in its place.
        let pass = comptime!(blocks.key_value_pass);
        let dim_tiles = comptime!(if pass.keys() { blocks.part_tiles(blocks.dim) } else { 1 });
        let value_tiles = comptime!(if pass.values() { blocks.part_tiles(blocks.value_dim) } else { 1 });
        let mut dk_acc = M::zeros(dim_tiles, unit);
        let mut dv_acc = M::zeros(value_tiles, unit);

        let k_base = row_offset(key, batch, kv_head, 0);
        let v_base = row_offset(value, batch, kv_head, 0);
        // The cube's own keys and values, staged once when whole head dims fit.
        if whole_dims {
            stage_tile(key, k_base, first_col, seq_kv, 0, head_dim, &mut k_tile, 0, block_rows, dim_chunk, unit);
        }
        if whole_values {
            stage_tile(value, v_base, first_col, seq_kv, 0, value_dim, &mut v_tile, 0, block_rows, value_chunk, unit);
        }
        // Only the tiles holding query rows that see some key of the cube.
        let rows = cube_run(ranges, batch, first_col, seq_q, seq_kv, block_rows, true, blocks);
        let (first_tile, end_tile) = (rows.start / block_q, rows.end.div_ceil(block_q));

        for member in 0..group {
            let head = kv_head * group + member;
            let q_base = row_offset(query, batch, head, 0);
            let g_base = row_offset(output_grad, batch, head, 0);
            for tile in first_tile..end_tile {
                let q0 = tile * block_q;
                // Every plane is done with the previous tile before it is overwritten.
                sync_cube();
                stage_row_stats(lse, row_offset(lse, batch, head, 0), q0, seq_q, &mut lse_tile, f32::new(MASKED), block_q);
                stage_row_stats(delta, row_offset(delta, batch, head, 0), q0, seq_q, &mut delta_tile, 0.0f32, block_q);
                if whole_dims {
                    stage_tile(query, q_base, q0, seq_q, 0, head_dim, &mut q_tile, 0, block_q, dim_chunk, unit);
                }
                if whole_values {
                    stage_tile(output_grad, g_base, q0, seq_q, 0, value_dim, &mut g_tile, 0, block_q, value_chunk, unit);
                }
                sync_cube();

                // Sᵀ = K · Qᵀ: this plane's 16 keys against the tile's queries.
                let mut s_acc = M::zeros(q_tiles, unit);
                #[unroll]
                for chunk in 0..comptime!(blocks.dim_chunks()) {
                    if !whole_dims {
                        sync_cube();
                        stage_tile(key, k_base, first_col, seq_kv, chunk * dim_chunk, head_dim, &mut k_tile, 0, block_rows, dim_chunk, unit);
                        stage_tile(query, q_base, q0, seq_q, chunk * dim_chunk, head_dim, &mut q_tile, 0, block_q, dim_chunk, unit);
                        sync_cube();
                    }
                    accumulate_a_bt::<F, M>(&mut s_acc, q_tiles, &k_tile.to_slice(), plane * TILE * dim_stride, &q_tile.to_slice(), dim_chunk, tile_rows, unit);
                }
                let mut out = scores.slice_mut(scores_at, scores_at + TILE * q_stride);
                M::store_row(&s_acc, 0usize, q_tiles, &mut out, q_stride, unit);
                sync_tile(blocks.plane_sync);

                // Pᵀ, masked on tiles that cross the edge of the rows that see the key.
                for r in 0..tile_rows {
                    let seeing = key_rows(ranges, batch, plane_col + r, seq_q, seq_kv, blocks);
                    let crosses = q0 < seeing.start || q0 + block_q > seeing.end;
                    let at = scores_at + r * q_stride;
                    let mut c = lane;
                    while c < block_q {
                        let row = q0 + c;
                        let visible = !crosses || (row >= seeing.start && row < seeing.end);
                        let p = select(visible, (scores[at + c] * scale - lse_tile[c]).exp(), 0.0f32);
                        scores[at + c] = p;
                        probs[at + c] = F::cast_from(p);
                        c += plane_dim;
                    }
                }
                sync_tile(blocks.plane_sync);

                // dV += Pᵀ · dO and dPᵀ = V · dOᵀ, the value dim a chunk at a time.
                let mut dp_acc = M::zeros(q_tiles, unit);
                #[unroll]
                for chunk in 0..comptime!(blocks.value_chunks()) {
                    // dV needs the chunks in its part; dP (for dK) needs every chunk.
                    let meets = comptime!(blocks.chunk_in_part(chunk, value_chunk).filter(|_| pass.values()));
                    if comptime!(meets.is_some() || pass.keys()) {
                        if !whole_values {
                            sync_cube();
                            stage_tile(value, v_base, first_col, seq_kv, chunk * value_chunk, value_dim, &mut v_tile, 0, block_rows, value_chunk, unit);
                            stage_tile(output_grad, g_base, q0, seq_q, chunk * value_chunk, value_dim, &mut g_tile, 0, block_q, value_chunk, unit);
                            sync_cube();
                        }
                        if comptime!(meets.is_some()) {
                            let first = comptime!(meets.unwrap().first_tile);
                            let column = comptime!(meets.unwrap().column);
                            let tiles = comptime!(meets.unwrap().tiles);
                            accumulate_a_b::<F, M>(&mut dv_acc, first, tiles, &probs.to_slice(), scores_at, block_q, &g_tile.to_slice().slice(column, g_tile.len()), value_chunk, tile_rows, unit);
                        }
                        if comptime!(pass.keys()) {
                            accumulate_a_bt::<F, M>(&mut dp_acc, q_tiles, &v_tile.to_slice(), plane * TILE * value_stride, &g_tile.to_slice(), value_chunk, tile_rows, unit);
                        }
                    }
                }

                if comptime!(pass.keys()) {
                    // dSᵀ = Pᵀ ∘ (dPᵀ − delta), into the storage copy of Pᵀ (dV is done with it).
                    let mut out = dp_scores.slice_mut(scores_at, scores_at + TILE * q_stride);
                    M::store_row(&dp_acc, 0usize, q_tiles, &mut out, q_stride, unit);
                    sync_tile(blocks.plane_sync);
                    let mut i = lane;
                    while i < TILE * block_q {
                        let c = i % block_q;
                        let at = scores_at + (i / block_q) * q_stride + c;
                        probs[at] = F::cast_from(scores[at] * (dp_scores[at] - delta_tile[c]));
                        i += plane_dim;
                    }
                    sync_tile(blocks.plane_sync);

                    // dK += dSᵀ · Q, over this launch's columns of dK.
                    let chunks = comptime!(blocks.dim_chunks());
                    accumulate_part::<F, M, N>(&mut dk_acc, &probs, scores_at, query, q_base, q0, seq_q, head_dim, &mut q_tile, tile_rows, block_q, dim_chunk, chunks, whole_dims, blocks);
                }
            }
        }

        let mut scratch = scores.slice_mut(scores_at, scores_at + TILE * TILE);
        if comptime!(pass.keys()) {
            write_gradient::<F, M>(&dk_acc, key_grad, batch, kv_head, plane_col, seq_kv, head_dim, scale, &mut scratch, dim_tiles, blocks);
        }
        if comptime!(pass.values()) {
            write_gradient::<F, M>(&dv_acc, value_grad, batch, kv_head, plane_col, seq_kv, value_dim, 1.0f32, &mut scratch, value_tiles, blocks);
        }
    }
}

#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub(crate) fn query_grad_kernel<F: Float, M: TileMma, N: Size>(
    query: &Tensor<Vector<F, N>>,
    key: &Tensor<Vector<F, N>>,
    value: &Tensor<Vector<F, N>>,
    output_grad: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    query_grad: &mut Tensor<F>,
    // `[start, end]` of the keys each query row sees, read when `blocks.ranged`.
    ranges: &Tensor<u32>,
    scale: f32,
    blocks_per_head: usize,
    // 16, at run time (see the dK/dV kernel).
    tile_rows: usize,
    #[comptime] blocks: Blocks,
    #[define(F)] _dtype: StorageType,
) {
    let q_heads = query_grad.shape(1);
    if cube_in_range(query_grad.shape(0), q_heads, blocks_per_head) {
        let (seq_q, seq_kv) = (query_grad.shape(2), key.shape(2));
        let (head_dim, value_dim) = (query_grad.shape(3), value.shape(3));
        let place = cube_place(query_grad.shape(0), q_heads, blocks_per_head, comptime!(blocks.causal), true);
        let (batch, head) = (place.batch, place.head);
        let kv_head = head / (q_heads / key.shape(1));
        let plane_dim = comptime!(blocks.plane_dim);
        let unit = comptime!(blocks.unit());
        let planes = comptime!(blocks.planes);
        let block_kv = comptime!(blocks.block_kv);
        let dim_chunk = comptime!(blocks.dim_chunk);
        let value_chunk = comptime!(blocks.value_chunk);
        let block_rows = comptime!(blocks.block_rows());
        let kv_tiles = comptime!(block_kv / TILE);
        // Row strides of the shared tiles (padded: see `TileUnit::stride`).
        let (dim_stride, value_stride, kv_stride) = comptime!((unit.stride(dim_chunk), unit.stride(value_chunk), unit.stride(block_kv)));
        let whole_dims = comptime!(blocks.dim_chunks() == 1);
        let whole_values = comptime!(blocks.value_chunks() == 1);
        let first_row = place.block * block_rows;
        let plane = UNIT_POS_Y as usize;
        let lane = UNIT_POS_X as usize;
        let plane_row = first_row + plane * TILE;

        let mut q_tile = SharedMemory::<F>::new(block_rows * dim_stride);
        let mut g_tile = SharedMemory::<F>::new(block_rows * value_stride);
        let mut k_tile = SharedMemory::<F>::new(block_kv * dim_stride);
        let mut v_tile = SharedMemory::<F>::new(block_kv * value_stride);
        let mut scores = SharedMemory::<f32>::new(planes * TILE * kv_stride);
        let mut dp_scores = SharedMemory::<f32>::new(planes * TILE * kv_stride);
        let mut ds = SharedMemory::<F>::new(planes * TILE * kv_stride);
        let scores_at = plane * TILE * kv_stride;

        // This launch's columns of dQ (all of them, or its part).
        let dim_tiles = comptime!(blocks.part_tiles(blocks.dim));
        let mut dq_acc = M::zeros(dim_tiles, unit);
        // This plane's rows' statistics, in every lane.
        let mut row_lse = Array::<f32>::new(TILE);
        let mut row_delta = Array::<f32>::new(TILE);
        for r in 0..tile_rows {
            let row = plane_row + r;
            let mut l = f32::new(MASKED);
            let mut d = 0.0f32;
            if row < seq_q {
                l = lse[row_offset(lse, batch, head, row)];
                d = delta[row_offset(delta, batch, head, row)];
            }
            row_lse[r] = l;
            row_delta[r] = d;
        }

        let q_base = row_offset(query, batch, head, 0);
        let g_base = row_offset(output_grad, batch, head, 0);
        let k_base = row_offset(key, batch, kv_head, 0);
        let v_base = row_offset(value, batch, kv_head, 0);
        // The cube's own query rows and their output gradients, staged once when they fit.
        if whole_dims {
            stage_tile(query, q_base, first_row, seq_q, 0, head_dim, &mut q_tile, 0, block_rows, dim_chunk, unit);
        }
        if whole_values {
            stage_tile(output_grad, g_base, first_row, seq_q, 0, value_dim, &mut g_tile, 0, block_rows, value_chunk, unit);
        }
        let keys = cube_run(ranges, batch, first_row, seq_q, seq_kv, block_rows, false, blocks);
        let (first_tile, end_tile) = (keys.start / block_kv, keys.end.div_ceil(block_kv));

        for tile in first_tile..end_tile {
            let kv0 = tile * block_kv;
            // Every plane is done with the previous tile before it is overwritten.
            sync_cube();
            if whole_dims {
                stage_tile(key, k_base, kv0, seq_kv, 0, head_dim, &mut k_tile, 0, block_kv, dim_chunk, unit);
            }
            if whole_values {
                stage_tile(value, v_base, kv0, seq_kv, 0, value_dim, &mut v_tile, 0, block_kv, value_chunk, unit);
            }
            sync_cube();

            // S = Q · Kᵀ
            let mut s_acc = M::zeros(kv_tiles, unit);
            #[unroll]
            for chunk in 0..comptime!(blocks.dim_chunks()) {
                if !whole_dims {
                    sync_cube();
                    stage_tile(query, q_base, first_row, seq_q, chunk * dim_chunk, head_dim, &mut q_tile, 0, block_rows, dim_chunk, unit);
                    stage_tile(key, k_base, kv0, seq_kv, chunk * dim_chunk, head_dim, &mut k_tile, 0, block_kv, dim_chunk, unit);
                    sync_cube();
                }
                accumulate_a_bt::<F, M>(&mut s_acc, kv_tiles, &q_tile.to_slice(), plane * TILE * dim_stride, &k_tile.to_slice(), dim_chunk, tile_rows, unit);
            }
            let mut out = scores.slice_mut(scores_at, scores_at + TILE * kv_stride);
            M::store_row(&s_acc, 0usize, kv_tiles, &mut out, kv_stride, unit);

            // dP = dO · Vᵀ, the value dim a chunk at a time.
            let mut dp_acc = M::zeros(kv_tiles, unit);
            #[unroll]
            for chunk in 0..comptime!(blocks.value_chunks()) {
                if !whole_values {
                    sync_cube();
                    stage_tile(output_grad, g_base, first_row, seq_q, chunk * value_chunk, value_dim, &mut g_tile, 0, block_rows, value_chunk, unit);
                    stage_tile(value, v_base, kv0, seq_kv, chunk * value_chunk, value_dim, &mut v_tile, 0, block_kv, value_chunk, unit);
                    sync_cube();
                }
                accumulate_a_bt::<F, M>(&mut dp_acc, kv_tiles, &g_tile.to_slice(), plane * TILE * value_stride, &v_tile.to_slice(), value_chunk, tile_rows, unit);
            }
            let mut out = dp_scores.slice_mut(scores_at, scores_at + TILE * kv_stride);
            M::store_row(&dp_acc, 0usize, kv_tiles, &mut out, kv_stride, unit);
            sync_tile(blocks.plane_sync);

            // P and dS = P ∘ (dP − delta), masked on tiles that cross the edge of the row's keys.
            for r in 0..tile_rows {
                let seen = row_keys(ranges, batch, plane_row + r, seq_q, seq_kv, blocks);
                let crosses = kv0 < seen.start || kv0 + block_kv > seen.end;
                let at = scores_at + r * kv_stride;
                let mut c = lane;
                while c < block_kv {
                    let visible = !crosses || (kv0 + c >= seen.start && kv0 + c < seen.end);
                    let p = select(visible, (scores[at + c] * scale - row_lse[r]).exp(), 0.0f32);
                    ds[at + c] = F::cast_from(p * (dp_scores[at + c] - row_delta[r]));
                    c += plane_dim;
                }
            }
            sync_tile(blocks.plane_sync);

            // dQ += dS · K, over this launch's columns of dQ.
            let chunks = comptime!(blocks.dim_chunks());
            accumulate_part::<F, M, N>(&mut dq_acc, &ds, scores_at, key, k_base, kv0, seq_kv, head_dim, &mut k_tile, tile_rows, block_kv, dim_chunk, chunks, whole_dims, blocks);
        }

        let mut scratch = scores.slice_mut(scores_at, scores_at + TILE * TILE);
        write_gradient::<F, M>(&dq_acc, query_grad, batch, head, plane_row, seq_q, head_dim, scale, &mut scratch, dim_tiles, blocks);
    }
}
