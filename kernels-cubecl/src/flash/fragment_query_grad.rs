//! dQ of the register-fragment engine, query-outer like the forward (`fragment_forward`): each
//! warp owns 16 query rows and keeps their Q and dO fragments, and per key step computes, from
//! registers to registers, S = Q·Kᵀ, P = exp(scale·S − lse) (the forward's log-sum-exp: no
//! second softmax pass), dP = dO·Vᵀ, dS = P ∘ (dP − D) (D = rowsum(dO ∘ O), the backward's
//! pre-pass), and dQ += dS·K with dS taken from its accumulators as the A fragment; dQ is
//! scaled once at the end. No atomics: each block owns its rows of dQ. K and V come through
//! the forward's double-buffered shared tiles (`fragment_tiles`). Past head dim 128 (64 with
//! 64-bit indices: `fragment_tiles::register_columns`) a launch accumulates one part of dQ's
//! columns, Q's and dO's fragments read as the products need them.

use cubecl::prelude::*;

use super::{
    fragment_tiles::{
        Staging, block_span, block_rows, LOG2_E, exponent_base, fast_exp2, mask_scores, next_step, rounded, row_operand, stage_step, step_tiles, step_unmasked,
        store_rows, times_tile, times_tile_transposed, zeros,
    },
    stage::{ColumnPart, cube_in_range, visible_run},
};
use crate::mma::{C_VALUES, FragmentMma, lane};

/// dQ `[B, Hq, Sq, D]` of attention over `q: [B, Hq, Sq, D]`, `k`, `v: [B, Hkv, Skv, D]`
/// (contiguous; head dim = value dim) given dO (`out_grad`, like q), the forward's log-sum-exp
/// and D (`[B, Hq, Sq]`, f32): its columns `part`. One cube per 64 query rows of one (batch,
/// head).
#[cube(launch, address_type = "dynamic")]
pub(crate) fn fragment_query_grad_kernel<E: Float, M: FragmentMma>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    out_grad: &Tensor<E>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    query_grad: &mut Tensor<E>,
    ranges: &Tensor<u32>,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] staging: Staging,
    #[comptime] held_columns: usize,
    #[comptime] part: ColumnPart,
    #[comptime] causal: bool,
    #[comptime] ranged: bool,
    #[comptime] unrolled: bool,
    #[define(E)] _dtype: StorageType,
) {
    let (q_heads, seq_q) = (q.shape(1), q.shape(2));
    let blocks_per_head = seq_q.div_ceil(comptime!(staging.block_rows()));
    if cube_in_range(q.shape(0), q_heads, blocks_per_head) {
        query_grad_block::<E, M>(q, k, v, out_grad, lse, delta, query_grad, ranges, scale, head_dim, staging, held_columns, part, causal, ranged, unrolled);
    }
}

/// dQ of one block of 64 query rows of one (batch, head), the cube's place in the grid.
#[cube]
#[allow(clippy::too_many_arguments)]
fn query_grad_block<E: Float, M: FragmentMma>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    out_grad: &Tensor<E>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    query_grad: &mut Tensor<E>,
    ranges: &Tensor<u32>,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] staging: Staging,
    #[comptime] held_columns: usize,
    #[comptime] part: ColumnPart,
    #[comptime] causal: bool,
    #[comptime] ranged: bool,
    #[comptime] unrolled: bool,
) {
    let (q_heads, seq_q) = (q.shape(1), q.shape(2));
    let (kv_heads, seq_kv) = (k.shape(1), k.shape(2));
    let rows = block_rows(q.shape(0), q_heads, seq_q, kv_heads, seq_kv, head_dim, staging, causal);
    let (batch, head_index, q_base, kv_base, row0) = (rows.batch, rows.head_index, rows.q_base, rows.kv_base, rows.row0);
    let g = lane() / 4;

    let mut scratch = M::scratch(comptime!(staging.warps));
    let keys_per_step = comptime!(staging.keys);
    // K's and V's every column: the score products read them all.
    let whole = comptime!(ColumnPart::whole(head_dim));
    let mut k_tiles = step_tiles::<E>(staging, head_dim);
    let mut v_tiles = step_tiles::<E>(staging, head_dim);
    let mut copies = M::copies();

    let q_rows = row_operand::<E>(q, q_base, row0, seq_q, head_dim, held_columns, unrolled);
    let out_grad_rows = row_operand::<E>(out_grad, q_base, row0, seq_q, head_dim, held_columns, unrolled);
    let out_tiles = comptime!(part.width / 8);
    let mut acc = zeros(out_tiles * C_VALUES);

    let run_low = visible_run(ranges, batch, row0 + g, seq_q, seq_kv, false, ranged, causal);
    let run_high = visible_run(ranges, batch, row0 + g + 8, seq_q, seq_kv, false, ranged, causal);
    // This lane's two rows' log-sum-exp and D (rows past the sequence see no key: unused).
    let (row_low, row_high) = (min(row0 + g, seq_q - 1), min(row0 + g + 8, seq_q - 1));
    let (lse_low, lse_high) = (lse[head_index * seq_q + row_low], lse[head_index * seq_q + row_high]);
    let (delta_low, delta_high) = (delta[head_index * seq_q + row_low], delta[head_index * seq_q + row_high]);
    // Exponents in base 2 (`fast_exp2`): a score's is s·scale·log2(e) − lse·log2(e).
    let (base_low, base_high) = (exponent_base(lse_low, LOG2_E), exponent_base(lse_high, LOG2_E));
    let scale_log2 = scale * LOG2_E;
    let span = block_span(ranges, batch, rows.first_row, seq_q, seq_kv, comptime!(staging.block_rows()), keys_per_step, false, causal, ranged);

    let score_tiles = keys_per_step / 8;
    if span.steps > 0 {
        stage_step::<E, M>(k, v, kv_base, span.start, seq_kv, &mut k_tiles, &mut v_tiles, 0usize, keys_per_step, comptime!(staging.warps), head_dim, whole, unrolled);
    }
    for step in 0..span.steps {
        let key0 = span.start + step * keys_per_step;
        let buffer = next_step::<E, M>(k, v, kv_base, &span, step, seq_kv, &mut k_tiles, &mut v_tiles, &mut copies, staging, head_dim, whole, unrolled);
        let mut s = zeros(score_tiles * C_VALUES);
        let mut dp = zeros(score_tiles * C_VALUES);
        times_tile_transposed::<E, M>(&q_rows, q, &k_tiles, buffer, &mut s, &mut scratch, keys_per_step, head_dim, held_columns, unrolled);
        times_tile_transposed::<E, M>(&out_grad_rows, out_grad, &v_tiles, buffer, &mut dp, &mut scratch, keys_per_step, head_dim, held_columns, unrolled);

        // dS = P ∘ (dP − D), in place of S; P is 0 where the row does not see the key (its
        // score masked only in the steps that need it).
        let unmasked = step_unmasked(key0, keys_per_step, &run_low, &run_high);
        mask_scores(&mut s, 0usize, key0, &run_low, &run_high, unmasked, score_tiles, unrolled);
        #[unroll(unrolled)]
        for tile in 0..score_tiles {
            #[unroll]
            for i in 0..C_VALUES {
                let at = tile * C_VALUES + i;
                let (base, row_delta) = (select(i < 2, base_low, base_high), select(i < 2, delta_low, delta_high));
                s[at] = fast_exp2(s[at] * scale_log2 - base) * (dp[at] - row_delta);
            }
        }

        // dQ[:, part] += dS·K[:, part], dS in registers as P is in the forward.
        let ds = rounded::<E>(&s, score_tiles * C_VALUES);
        times_tile::<E, M>(&ds, &k_tiles, buffer, &mut acc, &mut scratch, keys_per_step, head_dim, part, 1usize, unrolled);
    }

    // dQ has Q's shape: Q's rows' place is its own.
    store_rows::<E>(&acc, scale, query_grad, &q_rows.place, part, unrolled);
}
