//! The forward of the register-fragment engine, as FlashAttention-2 computes it: each warp owns
//! 16 query rows, keeps its Q fragments, its scores S = Q·Kᵀ and its output accumulators in
//! registers (`crate::mma`), runs the online softmax on the accumulators (a row's maximum and
//! sum over the 4 lanes that share it), and multiplies P·V with P taken from S's accumulators
//! without leaving registers. Four warps a block (64 query rows), steps of 64 keys (32 at head
//! dim 128).
//!
//! First version: K and V fragments are read from global memory (no shared staging, no
//! `cp.async`, no `ldmatrix` yet), no visible ranges; head dim 64 (128 is written, but
//! spills on sm_80 and sm_89 until K and V come through shared memory). The loops over
//! tiles are unrolled where the fragments are registers (`unrolled`: CUDA); the emulation
//! keeps them loops, which a shader compiler takes in seconds rather than minutes.

use cubecl::prelude::*;

use super::stage::{cube_in_range, cube_place};
use crate::mma::{A_VALUES, B_VALUES, C_VALUES, FragmentMma, lane};

/// Warps (of 32 units) per block, each owning 16 query rows.
pub(crate) const WARPS: usize = 4;
/// Query rows of a block.
pub(crate) const BLOCK_ROWS: usize = 16 * WARPS;
/// Keys per step of a warp's loop: 8 score tiles of 16 × 8 at head dim 64; 4 at head dim 128,
/// where the output accumulators take twice the registers (64 keys there spilled: 255
/// registers on sm_80 and sm_89).
fn key_block(head_dim: usize) -> usize {
    if head_dim > 64 { 32 } else { 64 }
}
/// A masked score: finite (WGSL has no infinity literal) and below any real one; its
/// probability is set to 0 explicitly.
const MASKED: f32 = -1.0e30;

/// Output `[B, Hq, Sq, D]` and log-sum-exp `[B, Hq, Sq]` (natural log, of the scaled scores)
/// of attention over `q: [B, Hq, Sq, D]`, `k`, `v: [B, Hkv, Skv, D]` (contiguous; `Hq` a
/// multiple of `Hkv`). One cube per 64 query rows of one (batch, head), over the grid
/// `flash::grid` spreads.
#[cube(launch)]
pub(crate) fn fragment_forward_kernel<E: Float, M: FragmentMma>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    out: &mut Tensor<E>,
    lse: &mut Tensor<f32>,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] causal: bool,
    #[comptime] unrolled: bool,
    #[define(E)] _dtype: StorageType,
) {
    let (q_heads, seq_q) = (q.shape(1), q.shape(2));
    let blocks_per_head = seq_q.div_ceil(BLOCK_ROWS);
    // The grid may hold a few more cubes than blocks; a cube has work or not as a whole.
    if cube_in_range(q.shape(0), q_heads, blocks_per_head) {
        forward_block::<E, M>(q, k, v, out, lse, scale, head_dim, causal, unrolled);
    }
}

/// One block of 64 query rows of one (batch, head), the cube's place in the grid.
#[cube]
#[allow(clippy::too_many_arguments)]
fn forward_block<E: Float, M: FragmentMma>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    out: &mut Tensor<E>,
    lse: &mut Tensor<f32>,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] causal: bool,
    #[comptime] unrolled: bool,
) {
    let (q_heads, seq_q) = (q.shape(1), q.shape(2));
    let (kv_heads, seq_kv) = (k.shape(1), k.shape(2));
    let blocks_per_head = seq_q.div_ceil(BLOCK_ROWS);
    let place = cube_place(q_heads, blocks_per_head);
    let (batch, head, block) = (place.batch, place.head, place.block);
    let head_index = batch * q_heads + head;
    let kv_head = head / (q_heads / kv_heads);
    let q_base = head_index * seq_q * head_dim;
    let kv_base = (batch * kv_heads + kv_head) * seq_kv * head_dim;

    let warp = UNIT_POS as usize / 32;
    let lane = lane();
    let (g, t) = (lane / 4, lane % 4);
    let row0 = block * BLOCK_ROWS + warp * 16;
    // This lane's two rows are g and g + 8 of the warp's 16: row0 + g + 8·half.

    let mut scratch = M::scratch(WARPS);

    // Q fragments, one per 16 columns of the head dim; rows past the sequence read as 0.
    let k_chunks = head_dim / 16;
    let mut q_frag = Array::<E>::new(k_chunks * A_VALUES);
    #[unroll(unrolled)]
    for chunk in 0..k_chunks {
        #[unroll]
        for i in 0..A_VALUES {
            let row = row0 + g + 8 * ((i / 2) % 2);
            let column = chunk * 16 + 2 * t + i % 2 + 8 * (i / 4);
            q_frag[chunk * A_VALUES + i] = select(row < seq_q, q[q_base + row * head_dim + column], E::from_int(0));
        }
    }

    let out_tiles = head_dim / 8;
    let mut acc = Array::<f32>::new(out_tiles * C_VALUES);
    #[unroll]
    for i in 0..out_tiles * C_VALUES {
        acc[i] = 0.0;
    }
    let mut row_max = Array::<f32>::new(2usize);
    let mut row_sum = Array::<f32>::new(2usize);
    #[unroll]
    for half in 0..2usize {
        row_max[half] = f32::new(MASKED);
        row_sum[half] = 0.0;
    }

    // Bottom-right aligned causal mask: key j is visible to query i when j + Sq ≤ i + Skv.
    let block_end = block * BLOCK_ROWS + BLOCK_ROWS + seq_kv;
    let causal_keys = select(block_end > seq_q, block_end - seq_q, 0usize);
    let visible_keys = if causal { seq_kv.min(causal_keys) } else { seq_kv };
    let keys_per_step = comptime!(key_block(head_dim));
    let key_blocks = visible_keys.div_ceil(keys_per_step);

    let score_tiles = keys_per_step / 8;
    for step in 0..key_blocks {
        let key0 = step * keys_per_step;
        let mut s = Array::<f32>::new(score_tiles * C_VALUES);
        #[unroll]
        for i in 0..score_tiles * C_VALUES {
            s[i] = 0.0;
        }
        // S = Q·Kᵀ: B[kk, n] = K[key0 + 8·tile + n, 16·chunk + kk].
        #[unroll(unrolled)]
        for tile in 0..score_tiles {
            let key = key0 + 8 * tile + g;
            #[unroll(unrolled)]
            for chunk in 0..k_chunks {
                let mut b = Array::<E>::new(B_VALUES);
                #[unroll]
                for i in 0..B_VALUES {
                    let column = chunk * 16 + 2 * t + i % 2 + 8 * (i / 2);
                    b[i] = select(key < seq_kv, k[kv_base + key * head_dim + column], E::from_int(0));
                }
                M::mma::<E>(&q_frag, chunk * A_VALUES, &b, &mut s, tile * C_VALUES, &mut scratch);
            }
        }

        // The online softmax on the accumulators: s[4·tile + i] is row rows[i / 2], key
        // key0 + 8·tile + 2t + i % 2.
        #[unroll]
        for half in 0..2usize {
            let row = row0 + g + 8 * half;
            let mut block_max = f32::new(MASKED);
            #[unroll(unrolled)]
            for tile in 0..score_tiles {
                #[unroll]
                for j in 0..2usize {
                    let key = key0 + 8 * tile + 2 * t + j;
                    let visible = key < seq_kv && (!causal || key + seq_q <= row + seq_kv);
                    let score = select(visible, s[tile * C_VALUES + 2 * half + j] * scale, f32::new(MASKED));
                    s[tile * C_VALUES + 2 * half + j] = score;
                    block_max = max(block_max, score);
                }
            }
            // The 4 lanes of a quad share the row.
            block_max = max(block_max, plane_shuffle_xor(block_max, 1));
            block_max = max(block_max, plane_shuffle_xor(block_max, 2));
            let new_max = max(row_max[half], block_max);
            let correction = (row_max[half] - new_max).exp();
            let mut block_sum = 0.0f32;
            #[unroll(unrolled)]
            for tile in 0..score_tiles {
                #[unroll]
                for j in 0..2usize {
                    let at = tile * C_VALUES + 2 * half + j;
                    let p = select(s[at] > f32::new(MASKED), (s[at] - new_max).exp(), 0.0f32);
                    s[at] = p;
                    block_sum += p;
                }
            }
            block_sum += plane_shuffle_xor(block_sum, 1);
            block_sum += plane_shuffle_xor(block_sum, 2);
            row_sum[half] = row_sum[half] * correction + block_sum;
            row_max[half] = new_max;
            #[unroll(unrolled)]
            for tile in 0..out_tiles {
                acc[tile * C_VALUES + 2 * half] *= correction;
                acc[tile * C_VALUES + 2 * half + 1] *= correction;
            }
        }

        // P·V, P in registers: the score accumulators are, value for value, the A fragments
        // of P's 16-key chunks (crate::mma).
        let mut p = Array::<E>::new(score_tiles * C_VALUES);
        #[unroll]
        for i in 0..score_tiles * C_VALUES {
            p[i] = E::cast_from(s[i]);
        }
        #[unroll(unrolled)]
        for chunk in 0..keys_per_step / 16 {
            #[unroll(unrolled)]
            for tile in 0..out_tiles {
                // B[kk, n] = V[key0 + 16·chunk + kk, 8·tile + n].
                let mut b = Array::<E>::new(B_VALUES);
                #[unroll]
                for i in 0..B_VALUES {
                    let key = key0 + chunk * 16 + 2 * t + i % 2 + 8 * (i / 2);
                    b[i] = select(key < seq_kv, v[kv_base + key * head_dim + tile * 8 + g], E::from_int(0));
                }
                M::mma::<E>(&p, chunk * A_VALUES, &b, &mut acc, tile * C_VALUES, &mut scratch);
            }
        }
    }

    #[unroll]
    for half in 0..2usize {
        let row = row0 + g + 8 * half;
        if row < seq_q {
            // A row that sees no key (causal, Sq > Skv) gets 0 and the masked log-sum-exp.
            let seen = row_sum[half] > 0.0;
            let inverse = select(seen, 1.0f32 / row_sum[half], 0.0f32);
            #[unroll(unrolled)]
            for tile in 0..out_tiles {
                #[unroll]
                for j in 0..2usize {
                    out[q_base + row * head_dim + tile * 8 + 2 * t + j] = E::cast_from(acc[tile * C_VALUES + 2 * half + j] * inverse);
                }
            }
            if t == 0 {
                lse[head_index * seq_q + row] = select(seen, row_max[half] + row_sum[half].ln(), f32::new(MASKED));
            }
        }
    }
}
