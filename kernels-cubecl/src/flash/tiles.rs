//! Loads shared by the kernels: a tile of rows into shared memory, one row into registers,
//! and how many keys a block of causal query rows can see. Everything lands in f32.

use cubecl::prelude::*;

/// Where a unit's query row sits, for the kernels that give each unit one query row: the
/// cube covers rows `first_row..first_row + block_q` of one (batch, q head), and q head `h`
/// reads kv head `h / (q_heads / kv_heads)` (grouped-query attention).
#[derive(CubeType, Clone)]
pub(crate) struct QueryRow {
    pub batch: usize,
    pub head: usize,
    pub kv_head: usize,
    pub first_row: usize,
    pub row: usize,
    pub valid: bool,
    pub seq_q: usize,
    pub seq_kv: usize,
}

/// Index of element `[batch, head, row, 0]` of a `[batch, heads, rows, ..]` tensor (row 0 gives
/// the start of a head, to which tile loads add `row · stride(2)`).
#[cube]
pub(crate) fn row_offset<T: CubePrimitive>(tensor: &Tensor<T>, batch: usize, head: usize, row: usize) -> usize {
    batch * tensor.stride(0) + head * tensor.stride(1) + row * tensor.stride(2)
}

#[cube]
pub(crate) fn query_row<F: Float>(query: &Tensor<F>, key: &Tensor<F>, #[comptime] block_q: usize) -> QueryRow {
    let q_heads = query.shape(1);
    let seq_q = query.shape(2);
    let group = q_heads / key.shape(1);
    let batch_head = CUBE_POS_Y as usize;
    let head = batch_head % q_heads;
    let first_row = CUBE_POS_X as usize * block_q;
    let row = first_row + UNIT_POS_X as usize;
    QueryRow {
        batch: batch_head / q_heads,
        head,
        kv_head: head / group,
        first_row,
        row,
        valid: row < seq_q,
        seq_q,
        seq_kv: key.shape(2),
    }
}

/// Rows `first..first + rows` of a `[batch, heads, seq, width]` tensor (rows past `len`
/// read as zeros) into `tile`, `rows × width` f32, the whole cube cooperating. `base` is the
/// offset of the (batch, head) plane.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_tile<F: Float>(
    source: &Tensor<F>,
    base: usize,
    first: usize,
    len: usize,
    tile: &mut SharedMemory<f32>,
    #[comptime] rows: usize,
    #[comptime] width: usize,
) {
    let mut i = UNIT_POS_X as usize;
    while i < rows * width {
        let r = i / width;
        let mut x = 0.0f32;
        if first + r < len {
            x = f32::cast_from(source[base + (first + r) * source.stride(2) + (i % width) * source.stride(3)]);
        }
        tile[i] = x;
        i += CUBE_DIM_X as usize;
    }
}

/// The row at `offset` (its first element) into registers, or zeros when `valid` is false.
#[cube]
pub(crate) fn load_row<F: Float>(source: &Tensor<F>, offset: usize, valid: bool, row: &mut Array<f32>, #[comptime] width: usize) {
    for d in 0..width {
        let mut x = 0.0f32;
        if valid {
            x = f32::cast_from(source[offset + d * source.stride(3)]);
        }
        row[d] = x;
    }
}

/// Keys visible to query rows `first_row..first_row + block` under bottom-right aligned
/// causal attention (row i sees key j when `j + seq_q <= i + seq_kv`); all keys otherwise.
#[cube]
pub(crate) fn visible_keys(first_row: usize, seq_q: usize, seq_kv: usize, #[comptime] block: usize, #[comptime] causal: bool) -> usize {
    let mut visible = seq_kv;
    if causal {
        let rows_end = min(first_row + block, seq_q);
        visible = min(seq_kv, select(rows_end + seq_kv > seq_q, rows_end + seq_kv - seq_q, 0));
    }
    visible
}
