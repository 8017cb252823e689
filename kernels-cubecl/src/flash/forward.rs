//! Forward kernel: FlashAttention-2's loop, one unit per query row.
//!
//! A cube owns `block_q` consecutive query rows of one (batch, q head). It walks the keys in
//! tiles of `block_kv`: the cube loads a K and a V tile into shared memory, then each unit
//! scores its row against the tile, keeps the running max `m` and sum `l` of the online
//! softmax, and rescales its output accumulator once per tile. Everything is accumulated in
//! f32 whatever the storage type. It writes the output and the per-row log-sum-exp
//! `lse = m + ln(l)`, which the backward kernels use to recompute probabilities.
//!
//! Why these choices:
//! - one unit per row needs no cross-unit reduction, hence no plane operations (a software
//!   Vulkan driver has none) and no assumption on the plane size;
//! - K/V tiles in shared memory are read by every row of the cube, which is where the
//!   memory traffic goes from O(S²·D) to O(S²·D / block_q);
//! - finite sentinels instead of ±infinity, which WGSL cannot spell.

use cubecl::prelude::*;

use super::tiles::{load_row, load_tile, query_row, row_offset, visible_keys};

/// Stand-in for -infinity in running maxima and masked scores.
pub(crate) const MASKED: f32 = -1.0e30;

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_forward_kernel<F: Float>(
    query: &Tensor<F>,
    key: &Tensor<F>,
    value: &Tensor<F>,
    output: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    scale: f32,
    #[comptime] block_q: usize,
    #[comptime] block_kv: usize,
    #[comptime] head_dim: usize,
    #[comptime] value_dim: usize,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let position = query_row(query, key, block_q);
    let (seq_q, seq_kv) = (position.seq_q, position.seq_kv);
    let (batch, head, kv_head) = (position.batch, position.head, position.kv_head);
    let (first_row, row, row_valid) = (position.first_row, position.row, position.valid);

    let mut k_tile = SharedMemory::<f32>::new(block_kv * head_dim);
    let mut v_tile = SharedMemory::<f32>::new(block_kv * value_dim);
    let mut q_row = Array::<f32>::new(head_dim);
    let mut acc = Array::<f32>::new(value_dim);
    let mut scores = Array::<f32>::new(block_kv);

    let q_base = row_offset(query, batch, head, row);
    load_row(query, q_base, row_valid, &mut q_row, head_dim);
    for d in 0..head_dim {
        q_row[d] *= scale;
    }
    for d in 0..value_dim {
        acc[d] = 0.0f32;
    }
    let mut m = f32::new(MASKED);
    let mut l = 0.0f32;

    // Causal attention is aligned bottom-right, as burn's `is_causal`.
    let visible = visible_keys(first_row, seq_q, seq_kv, block_q, causal);
    let tiles = (visible + block_kv - 1) / block_kv;
    let k_base = row_offset(key, batch, kv_head, 0);
    let v_base = row_offset(value, batch, kv_head, 0);

    for tile in 0..tiles {
        let kv0 = tile * block_kv;
        // Every unit loads, valid row or not: the barrier needs the whole cube.
        load_tile(key, k_base, kv0, seq_kv, &mut k_tile, block_kv, head_dim);
        load_tile(value, v_base, kv0, seq_kv, &mut v_tile, block_kv, value_dim);
        sync_cube();

        let mut tile_max = m;
        for j in 0..block_kv {
            let mut s = 0.0f32;
            for d in 0..head_dim {
                s += q_row[d] * k_tile[j * head_dim + d];
            }
            let col = kv0 + j;
            let mut masked = col >= seq_kv;
            if causal {
                masked = masked || col + seq_q > row + seq_kv;
            }
            s = select(masked, f32::new(MASKED), s);
            scores[j] = s;
            tile_max = max(tile_max, s);
        }
        let rescale = (m - tile_max).exp();
        l *= rescale;
        for d in 0..value_dim {
            acc[d] *= rescale;
        }
        for j in 0..block_kv {
            let p = select(scores[j] > f32::new(0.5 * MASKED), (scores[j] - tile_max).exp(), 0.0f32);
            l += p;
            for d in 0..value_dim {
                acc[d] += p * v_tile[j * value_dim + d];
            }
        }
        m = tile_max;
        sync_cube();
    }

    if row_valid {
        let has_keys = l > 0.0f32;
        let inverse = select(has_keys, 1.0f32 / l, 0.0f32);
        let o_base = row_offset(output, batch, head, row);
        for d in 0..value_dim {
            output[o_base + d * output.stride(3)] = F::cast_from(acc[d] * inverse);
        }
        let lse_index = row_offset(lse, batch, head, row);
        lse[lse_index] = select(has_keys, m + l.ln(), f32::new(MASKED));
    }
}
