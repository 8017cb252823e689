//! Backward kernels: FlashAttention-2's backward without atomics, in three launches.
//!
//! 1. [`row_delta_kernel`]: `delta_i = Σ_d dO_id · O_id`, one unit per query row;
//! 2. [`key_value_grad_kernel`]: one unit per key row `j` of one kv head accumulates
//!    `dV_j = Σ_i p_ij dO_i` and `dK_j = scale · Σ_i ds_ij q_i` over the query rows of every
//!    q head it serves (grouped-query attention sums over the group here, so no atomics);
//! 3. [`query_grad_kernel`]: one unit per query row accumulates `dQ_i = scale · Σ_j ds_ij k_j`.
//!
//! with `p_ij = exp(scale · q_i·k_j - lse_i)` recomputed from the forward's log-sum-exp and
//! `ds_ij = p_ij (dO_i·v_j - delta_i)`. No S×S matrix exists at any point. Splitting dK/dV
//! from dQ recomputes the scores twice, in exchange for deterministic, atomic-free sums that
//! run the same on WGSL and CUDA.

use cubecl::prelude::*;

use super::{
    forward::MASKED,
    tiles::{load_row, load_tile, query_row, row_offset, visible_keys},
};

#[cube(launch)]
pub(crate) fn row_delta_kernel<F: Float>(
    output: &Tensor<F>,
    output_grad: &Tensor<F>,
    delta: &mut Tensor<f32>,
    #[comptime] value_dim: usize,
    #[define(F)] _dtype: StorageType,
) {
    let heads = output.shape(1);
    let seq = output.shape(2);
    let rows = output.shape(0) * heads * seq;
    let index = (CUBE_POS_Y as usize * CUBE_COUNT_X as usize + CUBE_POS_X as usize) * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if index < rows {
        let batch = index / (heads * seq);
        let head = (index / seq) % heads;
        let row = index % seq;
        let o_base = row_offset(output, batch, head, row);
        let g_base = row_offset(output_grad, batch, head, row);
        let mut sum = 0.0f32;
        for d in 0..value_dim {
            sum += f32::cast_from(output[o_base + d * output.stride(3)])
                * f32::cast_from(output_grad[g_base + d * output_grad.stride(3)]);
        }
        delta[row_offset(delta, batch, head, row)] = sum;
    }
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn key_value_grad_kernel<F: Float>(
    query: &Tensor<F>,
    key: &Tensor<F>,
    value: &Tensor<F>,
    output_grad: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    key_grad: &mut Tensor<F>,
    value_grad: &mut Tensor<F>,
    scale: f32,
    #[comptime] block_q: usize,
    #[comptime] block_kv: usize,
    #[comptime] head_dim: usize,
    #[comptime] value_dim: usize,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let q_heads = query.shape(1);
    let kv_heads = key.shape(1);
    let group = q_heads / kv_heads;
    let seq_q = query.shape(2);
    let seq_kv = key.shape(2);
    let batch_head = CUBE_POS_Y as usize;
    let batch = batch_head / kv_heads;
    let kv_head = batch_head % kv_heads;
    let first_col = CUBE_POS_X as usize * block_kv;
    let col = first_col + UNIT_POS_X as usize;
    let col_valid = col < seq_kv;

    let mut q_tile = SharedMemory::<f32>::new(block_q * head_dim);
    let mut g_tile = SharedMemory::<f32>::new(block_q * value_dim);
    let mut lse_tile = SharedMemory::<f32>::new(block_q);
    let mut delta_tile = SharedMemory::<f32>::new(block_q);
    let mut k_row = Array::<f32>::new(head_dim);
    let mut v_row = Array::<f32>::new(value_dim);
    let mut dk = Array::<f32>::new(head_dim);
    let mut dv = Array::<f32>::new(value_dim);

    let k_base = row_offset(key, batch, kv_head, col);
    let v_base = row_offset(value, batch, kv_head, col);
    load_row(key, k_base, col_valid, &mut k_row, head_dim);
    load_row(value, v_base, col_valid, &mut v_row, value_dim);
    for d in 0..head_dim {
        dk[d] = 0.0f32;
    }
    for d in 0..value_dim {
        dv[d] = 0.0f32;
    }

    // Causal: the first query row that sees this cube's first key (bottom-right aligned).
    let mut first_row = 0usize;
    if causal {
        first_row = select(first_col + seq_q > seq_kv, first_col + seq_q - seq_kv, 0);
    }
    let first_tile = first_row / block_q;
    let tiles = (seq_q + block_q - 1) / block_q;

    for member in 0..group {
        let head = kv_head * group + member;
        let q_base = row_offset(query, batch, head, 0);
        let g_base = row_offset(output_grad, batch, head, 0);
        let lse_base = row_offset(lse, batch, head, 0);
        let delta_base = row_offset(delta, batch, head, 0);
        for tile in first_tile..tiles {
            let q0 = tile * block_q;
            load_tile(query, q_base, q0, seq_q, &mut q_tile, block_q, head_dim);
            load_tile(output_grad, g_base, q0, seq_q, &mut g_tile, block_q, value_dim);
            let mut i = UNIT_POS_X as usize;
            while i < block_q {
                let mut lse_x = f32::new(MASKED);
                let mut delta_x = 0.0f32;
                if q0 + i < seq_q {
                    lse_x = lse[lse_base + (q0 + i) * lse.stride(2)];
                    delta_x = delta[delta_base + (q0 + i) * delta.stride(2)];
                }
                lse_tile[i] = lse_x;
                delta_tile[i] = delta_x;
                i += CUBE_DIM_X as usize;
            }
            sync_cube();

            for r in 0..block_q {
                let query_row = q0 + r;
                let mut masked = query_row >= seq_q || !col_valid;
                if causal {
                    masked = masked || col + seq_q > query_row + seq_kv;
                }
                let mut s = 0.0f32;
                for d in 0..head_dim {
                    s += q_tile[r * head_dim + d] * k_row[d];
                }
                let p = select(masked, 0.0f32, (s * scale - lse_tile[r]).exp());
                let mut dp = 0.0f32;
                for d in 0..value_dim {
                    let g = g_tile[r * value_dim + d];
                    dv[d] += p * g;
                    dp += g * v_row[d];
                }
                let ds = p * (dp - delta_tile[r]);
                for d in 0..head_dim {
                    dk[d] += ds * q_tile[r * head_dim + d];
                }
            }
            sync_cube();
        }
    }

    if col_valid {
        let dk_base = row_offset(key_grad, batch, kv_head, col);
        for d in 0..head_dim {
            key_grad[dk_base + d * key_grad.stride(3)] = F::cast_from(dk[d] * scale);
        }
        let dv_base = row_offset(value_grad, batch, kv_head, col);
        for d in 0..value_dim {
            value_grad[dv_base + d * value_grad.stride(3)] = F::cast_from(dv[d]);
        }
    }
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn query_grad_kernel<F: Float>(
    query: &Tensor<F>,
    key: &Tensor<F>,
    value: &Tensor<F>,
    output_grad: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    query_grad: &mut Tensor<F>,
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
    let mut g_row = Array::<f32>::new(value_dim);
    let mut dq = Array::<f32>::new(head_dim);

    let q_base = row_offset(query, batch, head, row);
    let g_base = row_offset(output_grad, batch, head, row);
    load_row(query, q_base, row_valid, &mut q_row, head_dim);
    load_row(output_grad, g_base, row_valid, &mut g_row, value_dim);
    for d in 0..head_dim {
        dq[d] = 0.0f32;
    }
    let mut row_lse = f32::new(MASKED);
    let mut row_delta = 0.0f32;
    if row_valid {
        row_lse = lse[row_offset(lse, batch, head, row)];
        row_delta = delta[row_offset(delta, batch, head, row)];
    }

    let visible = visible_keys(first_row, seq_q, seq_kv, block_q, causal);
    let tiles = (visible + block_kv - 1) / block_kv;
    let k_base = row_offset(key, batch, kv_head, 0);
    let v_base = row_offset(value, batch, kv_head, 0);

    for tile in 0..tiles {
        let kv0 = tile * block_kv;
        load_tile(key, k_base, kv0, seq_kv, &mut k_tile, block_kv, head_dim);
        load_tile(value, v_base, kv0, seq_kv, &mut v_tile, block_kv, value_dim);
        sync_cube();

        for j in 0..block_kv {
            let col = kv0 + j;
            let mut masked = col >= seq_kv || !row_valid;
            if causal {
                masked = masked || col + seq_q > row + seq_kv;
            }
            let mut s = 0.0f32;
            for d in 0..head_dim {
                s += q_row[d] * k_tile[j * head_dim + d];
            }
            let p = select(masked, 0.0f32, (s * scale - row_lse).exp());
            let mut dp = 0.0f32;
            for d in 0..value_dim {
                dp += g_row[d] * v_tile[j * value_dim + d];
            }
            let ds = p * (dp - row_delta);
            for d in 0..head_dim {
                dq[d] += ds * k_tile[j * head_dim + d];
            }
        }
        sync_cube();
    }

    if row_valid {
        let dq_base = row_offset(query_grad, batch, head, row);
        for d in 0..head_dim {
            query_grad[dq_base + d * query_grad.stride(3)] = F::cast_from(dq[d] * scale);
        }
    }
}
