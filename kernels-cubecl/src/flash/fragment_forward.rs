//! The forward of the register-fragment engine, as FlashAttention-2 computes it: each warp owns
//! 16 query rows, keeps its Q fragments, its scores S = Q·Kᵀ and its output accumulators in
//! registers (`crate::mma`), runs the online softmax on the accumulators (a row's maximum and
//! sum over the 4 lanes that share it), and multiplies P·V with P taken from S's accumulators
//! without leaving registers. Four warps a block (64 query rows), K and V a key step at a time
//! through double-buffered shared tiles (`fragment_tiles`). Documents, key runs and windows
//! (`VisibleRanges`) bound each block's loop to the keys its rows see and mask each score by
//! its row's run. Past head dim 128 a launch accumulates one part of the output's columns (see
//! `fragment_tiles`), every part computing the same scores and writing the same log-sum-exp.

use cubecl::prelude::*;

use super::{
    fragment_tiles::{
        BLOCK_ROWS, MASKED, Staging, WARPS, block_span, block_rows, LOG2_E, exponent_base, fast_exp2, mask_scores, next_step, rounded, row_operand, stage_step, step_tiles,
        step_unmasked, times_tile, times_tile_transposed, zeros,
    },
    stage::{ColumnPart, cube_in_range, visible_run},
};
use crate::mma::{C_VALUES, FragmentMma, lane};

/// Output `[B, Hq, Sq, D]` and log-sum-exp `[B, Hq, Sq]` (natural log, of the scaled scores)
/// of attention over `q: [B, Hq, Sq, D]`, `k`, `v: [B, Hkv, Skv, D]` (contiguous; `Hq` a
/// multiple of `Hkv`), the output's columns `part`. One cube per 64 query rows of one (batch,
/// head), over the grid `flash::grid` spreads.
#[cube(launch, address_type = "dynamic")]
pub(crate) fn fragment_forward_kernel<E: Float, M: FragmentMma>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    out: &mut Tensor<E>,
    lse: &mut Tensor<f32>,
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
    let blocks_per_head = seq_q.div_ceil(BLOCK_ROWS);
    // The grid may hold a few more cubes than blocks; a cube has work or not as a whole.
    if cube_in_range(q.shape(0), q_heads, blocks_per_head) {
        forward_block::<E, M>(q, k, v, out, lse, ranges, scale, head_dim, staging, held_columns, part, causal, ranged, unrolled);
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
    let rows = block_rows(q_heads, seq_q, kv_heads, seq_kv, head_dim);
    let (batch, head_index, q_base, kv_base, row0) = (rows.batch, rows.head_index, rows.q_base, rows.kv_base, rows.row0);
    let lane = lane();
    let (g, t) = (lane / 4, lane % 4);
    // This lane's two rows are g and g + 8 of the warp's 16: row0 + g + 8·half.

    let mut scratch = M::scratch(WARPS);
    let keys_per_step = comptime!(staging.keys);
    // V's columns of this part, staged alone.
    let v_columns = comptime!(ColumnPart::whole(part.width));
    let mut k_tiles = step_tiles::<E>(staging, head_dim);
    let mut v_tiles = step_tiles::<E>(staging, comptime!(part.width));
    let mut copies = M::copies();

    let q_rows = row_operand::<E>(q, q_base, row0, seq_q, head_dim, held_columns, unrolled);
    let out_tiles = comptime!(part.width / 8);
    let mut acc = zeros(out_tiles * C_VALUES);
    let mut row_max = Array::<f32>::new(2usize);
    let mut row_sum = Array::<f32>::new(2usize);
    #[unroll]
    for half in 0..2usize {
        row_max[half] = f32::new(MASKED);
        row_sum[half] = 0.0;
    }

    // The keys this lane's two rows see (causality, bottom-right aligned, and the call's
    // ranges folded in): every score's mask.
    let run_low = visible_run(ranges, batch, row0 + g, seq_q, seq_kv, false, ranged, causal);
    let run_high = visible_run(ranges, batch, row0 + g + 8, seq_q, seq_kv, false, ranged, causal);
    let span = block_span(ranges, batch, rows.first_row, seq_q, seq_kv, keys_per_step, false, causal, ranged);

    let score_tiles = keys_per_step / 8;
    // Exponents in base 2: a score's is s·scale·log2(e) − base, one multiply-add.
    let scale_log2 = scale * LOG2_E;
    if span.steps > 0 {
        stage_step::<E, M>(k, v, kv_base, span.start, seq_kv, &mut k_tiles, &mut v_tiles, 0usize, keys_per_step, head_dim, part, unrolled);
    }
    for step in 0..span.steps {
        let key0 = span.start + step * keys_per_step;
        let buffer = next_step::<E, M>(k, v, kv_base, &span, step, seq_kv, &mut k_tiles, &mut v_tiles, &mut copies, staging, head_dim, part, unrolled);
        let mut s = zeros(score_tiles * C_VALUES);
        times_tile_transposed::<E, M>(&q_rows, q, &k_tiles, buffer, &mut s, &mut scratch, keys_per_step, head_dim, held_columns, unrolled);

        // The online softmax on the accumulators: s[4·tile + i] is row rows[i / 2], key
        // key0 + 8·tile + 2t + i % 2. Maxima are of the unscaled scores (the scale is
        // positive: `SCALES`); each exponent scales its score, in base 2.
        let unmasked = step_unmasked(key0, keys_per_step, &run_low, &run_high);
        mask_scores(&mut s, key0, &run_low, &run_high, unmasked, score_tiles, unrolled);
        let mut corrections = Array::<f32>::new(2usize);
        #[unroll]
        for half in 0..2usize {
            let mut block_max = f32::new(MASKED);
            #[unroll(unrolled)]
            for tile in 0..score_tiles {
                #[unroll]
                for j in 0..2usize {
                    block_max = max(block_max, s[tile * C_VALUES + 2 * half + j]);
                }
            }
            // The 4 lanes of a quad share the row.
            block_max = max(block_max, plane_shuffle_xor(block_max, 1));
            block_max = max(block_max, plane_shuffle_xor(block_max, 2));
            let new_max = max(row_max[half], block_max);
            let base = exponent_base(new_max, scale_log2);
            // Exactly 1 where the maximum did not grow: the exponent would then be the rounding
            // the multiply-add keeps of row_max·scale·log2(e) − base, not 0, and the vote below
            // would rescale nearly every step.
            let correction = select(new_max > row_max[half], fast_exp2(row_max[half] * scale_log2 - base), 1.0f32);
            let mut block_sum = 0.0f32;
            #[unroll(unrolled)]
            for tile in 0..score_tiles {
                #[unroll]
                for j in 0..2usize {
                    let at = tile * C_VALUES + 2 * half + j;
                    let p = fast_exp2(s[at] * scale_log2 - base);
                    s[at] = p;
                    block_sum += p;
                }
            }
            block_sum += plane_shuffle_xor(block_sum, 1);
            block_sum += plane_shuffle_xor(block_sum, 2);
            row_sum[half] = row_sum[half] * correction + block_sum;
            row_max[half] = new_max;
            corrections[half] = correction;
        }
        // Once a row has seen many keys its maximum seldom grows: where no row of the warp's
        // grew, every correction is 1 and the output's rescaling is skipped.
        if plane_any(corrections[0] != 1.0f32 || corrections[1] != 1.0f32) {
            #[unroll(unrolled)]
            for tile in 0..out_tiles {
                #[unroll]
                for i in 0..C_VALUES {
                    acc[tile * C_VALUES + i] *= corrections[i / 2];
                }
            }
        }

        // P·V, P in registers: the score accumulators are, value for value, the A fragments
        // of P's 16-key chunks (crate::mma).
        let p = rounded::<E>(&s, score_tiles * C_VALUES);
        times_tile::<E, M>(&p, &v_tiles, buffer, &mut acc, &mut scratch, keys_per_step, comptime!(part.width), v_columns, unrolled);
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
                    out[q_base + row * head_dim + comptime!(part.first) + tile * 8 + 2 * t + j] = E::cast_from(acc[tile * C_VALUES + 2 * half + j] * inverse);
                }
            }
            if t == 0 {
                lse[head_index * seq_q + row] = select(seen, row_max[half] * scale + row_sum[half].ln(), f32::new(MASKED));
            }
        }
    }
}
