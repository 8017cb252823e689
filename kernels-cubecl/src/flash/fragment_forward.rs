//! The forward of the register-fragment engine, as FlashAttention-2 computes it: each warp owns
//! its query rows (16, or 32 in two row tiles: `Staging::row_tiles`), keeps its scores
//! S = Q·Kᵀ and its output accumulators in registers (`crate::mma`), runs the online softmax on
//! the accumulators (a row's maximum and sum over the 4 lanes that share it), and multiplies
//! P·V with P taken from S's accumulators without leaving registers. Four warps a block, K and
//! V a key step at a time through double-buffered shared tiles (`fragment_tiles`); Q's
//! fragments held in registers with one row tile a warp, else (two: FlashAttention-2's 128-row
//! blocks) Q staged once in shared memory and read with `ldmatrix` each step, each
//! K and V fragment then feeding both row tiles. Documents, key runs and windows
//! (`VisibleRanges`) bound each block's loop to the keys its rows see and mask each score by
//! its row's run. Past head dim 128 a launch accumulates one part of the output's columns (see
//! `fragment_tiles`), every part computing the same scores and writing the same log-sum-exp.

use cubecl::prelude::*;

use super::{
    fragment_tiles::{
        MASKED, Staging, block_span, block_rows, LOG2_E, exponent_base, fast_exp2, mask_scores, next_step, rounded, row_operand, rows_tile, stage_keys, stage_step, step_tiles,
        step_unmasked, times_rows_transposed, times_tile, times_tile_transposed, zeros,
    },
    stage::{ColumnPart, Run, cube_in_range, visible_run},
};
use crate::mma::{C_VALUES, FragmentMma, lane};

/// Output `[B, Hq, Sq, D]` and log-sum-exp `[B, Hq, Sq]` (natural log, of the scaled scores)
/// of attention over `q: [B, Hq, Sq, D]`, `k`, `v: [B, Hkv, Skv, D]` (contiguous; `Hq` a
/// multiple of `Hkv`), the output's columns `part`. One cube per block of query rows
/// (`staging.block_rows()`) of one (batch, head), over the grid `flash::grid` spreads.
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
    let blocks_per_head = seq_q.div_ceil(comptime!(staging.block_rows()));
    // The grid may hold a few more cubes than blocks; a cube has work or not as a whole.
    if cube_in_range(q.shape(0), q_heads, blocks_per_head) {
        forward_block::<E, M>(q, k, v, out, lse, ranges, scale, head_dim, staging, held_columns, part, causal, ranged, unrolled);
    }
}

/// One block of query rows of one (batch, head), the cube's place in the grid.
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
    let row_tiles = comptime! {
        assert!(staging.rows_shared || staging.row_tiles == 1, "a warp holds the Q fragments of one row tile, so two need Q staged");
        staging.row_tiles
    };
    let rows_per_block = comptime!(staging.block_rows());
    let rows = block_rows(q.shape(0), q_heads, seq_q, kv_heads, seq_kv, head_dim, staging, causal);
    let (batch, head_index, q_base, kv_base, row0) = (rows.batch, rows.head_index, rows.q_base, rows.kv_base, rows.row0);
    let lane = lane();
    let (g, t) = (lane / 4, lane % 4);
    // This lane's rows: g and g + 8 of each of the warp's row tiles, row0 + 16·tile + g + 8·half,
    // its per-row values at 2·tile + half.

    let mut scratch = M::scratch(comptime!(staging.warps));
    let keys_per_step = comptime!(staging.keys);
    // V's columns of this part, staged alone.
    let v_columns = comptime!(ColumnPart::whole(part.width));
    let mut k_tiles = step_tiles::<E>(staging, head_dim);
    let mut v_tiles = step_tiles::<E>(staging, comptime!(part.width));
    let mut copies = M::copies();

    // Q: its fragments held (none where staged: held width 0), or the block's rows staged.
    let rows_shared = comptime!(staging.rows_shared);
    let held = comptime!(if rows_shared { 0 } else { held_columns });
    let q_rows = row_operand::<E>(q, q_base, row0, seq_q, head_dim, held, unrolled);
    let mut q_shared = rows_tile::<E>(rows_shared, rows_per_block, head_dim);
    let out_tiles = comptime!(part.width / 8);
    let score_tiles = keys_per_step / 8;
    let scores_per_tile = comptime!(score_tiles * C_VALUES);
    let acc_per_tile = comptime!(out_tiles * C_VALUES);
    let mut acc = zeros(comptime!(row_tiles * out_tiles * C_VALUES));
    let mut row_max = Array::<f32>::new(comptime!(2 * row_tiles));
    let mut row_sum = Array::<f32>::new(comptime!(2 * row_tiles));
    // The keys each of this lane's rows sees (causality, bottom-right aligned, and the call's
    // ranges folded in): every score's mask; and the keys all of them see.
    let mut run_start = Array::<usize>::new(comptime!(2 * row_tiles));
    let mut run_end = Array::<usize>::new(comptime!(2 * row_tiles));
    let mut common = Run { start: 0usize, end: seq_kv };
    #[unroll]
    for row in 0..comptime!(2 * row_tiles) {
        row_max[row] = f32::new(MASKED);
        row_sum[row] = 0.0;
        let run = visible_run(ranges, batch, row0 + 16 * (row / 2) + g + 8 * (row % 2), seq_q, seq_kv, false, ranged, causal);
        run_start[row] = run.start;
        run_end[row] = run.end;
        common.start = max(common.start, run.start);
        common.end = min(common.end, run.end);
    }
    let span = block_span(ranges, batch, rows.first_row, seq_q, seq_kv, rows_per_block, keys_per_step, false, causal, ranged);

    // Exponents in base 2: a score's is s·scale·log2(e) − base, one multiply-add.
    let scale_log2 = scale * LOG2_E;
    if span.steps > 0 {
        if rows_shared {
            // Awaited with the first step's tiles.
            stage_keys::<E, M>(q, q_base, rows.first_row, seq_q, &mut q_shared, 0usize, rows_per_block, comptime!(staging.warps), head_dim, comptime!(ColumnPart::whole(head_dim)), unrolled);
        }
        stage_step::<E, M>(k, v, kv_base, span.start, seq_kv, &mut k_tiles, &mut v_tiles, 0usize, keys_per_step, comptime!(staging.warps), head_dim, part, unrolled);
    }
    for step in 0..span.steps {
        let key0 = span.start + step * keys_per_step;
        let buffer = next_step::<E, M>(k, v, kv_base, &span, step, seq_kv, &mut k_tiles, &mut v_tiles, &mut copies, staging, head_dim, part, unrolled);
        let mut s = zeros(comptime!(row_tiles * score_tiles * C_VALUES));
        if rows_shared {
            times_rows_transposed::<E, M>(&q_shared, &k_tiles, buffer, &mut s, &mut scratch, keys_per_step, head_dim, row_tiles, unrolled);
        } else {
            times_tile_transposed::<E, M>(&q_rows, q, &k_tiles, buffer, &mut s, &mut scratch, keys_per_step, head_dim, held_columns, unrolled);
        }

        // The online softmax on the accumulators: s[scores_per_tile·r + 4·tile + i] is row
        // tile r's row i / 2, key key0 + 8·tile + 2t + i % 2. Maxima are of the unscaled scores
        // (the scale is positive: `SCALES`); each exponent scales its score, in base 2.
        let unmasked = step_unmasked(key0, keys_per_step, &common, &common);
        let mut corrections = Array::<f32>::new(comptime!(2 * row_tiles));
        #[unroll]
        for row_tile in 0..row_tiles {
            let first = row_tile * scores_per_tile;
            let low = Run { start: run_start[2 * row_tile], end: run_end[2 * row_tile] };
            let high = Run { start: run_start[2 * row_tile + 1], end: run_end[2 * row_tile + 1] };
            mask_scores(&mut s, first, key0, &low, &high, unmasked, score_tiles, unrolled);
            #[unroll]
            for half in 0..2usize {
                let row = 2 * row_tile + half;
                let mut block_max = f32::new(MASKED);
                #[unroll(unrolled)]
                for tile in 0..score_tiles {
                    #[unroll]
                    for j in 0..2usize {
                        block_max = max(block_max, s[first + tile * C_VALUES + 2 * half + j]);
                    }
                }
                // The 4 lanes of a quad share the row.
                block_max = max(block_max, plane_shuffle_xor(block_max, 1));
                block_max = max(block_max, plane_shuffle_xor(block_max, 2));
                let new_max = max(row_max[row], block_max);
                let base = exponent_base(new_max, scale_log2);
                // Exactly 1 where the maximum did not grow: the exponent would then be the
                // rounding the multiply-add keeps of row_max·scale·log2(e) − base, not 0, and
                // the vote below would rescale nearly every step.
                let correction = select(new_max > row_max[row], fast_exp2(row_max[row] * scale_log2 - base), 1.0f32);
                let mut block_sum = 0.0f32;
                #[unroll(unrolled)]
                for tile in 0..score_tiles {
                    #[unroll]
                    for j in 0..2usize {
                        let at = first + tile * C_VALUES + 2 * half + j;
                        let p = fast_exp2(s[at] * scale_log2 - base);
                        s[at] = p;
                        block_sum += p;
                    }
                }
                block_sum += plane_shuffle_xor(block_sum, 1);
                block_sum += plane_shuffle_xor(block_sum, 2);
                row_sum[row] = row_sum[row] * correction + block_sum;
                row_max[row] = new_max;
                corrections[row] = correction;
            }
        }
        // Once a row has seen many keys its maximum seldom grows: where no row of the warp's
        // grew, every correction is 1 and the output's rescaling is skipped.
        let mut grew = false;
        #[unroll]
        for row in 0..comptime!(2 * row_tiles) {
            grew = grew || corrections[row] != 1.0f32;
        }
        if plane_any(grew) {
            #[unroll]
            for row_tile in 0..row_tiles {
                #[unroll(unrolled)]
                for tile in 0..out_tiles {
                    #[unroll]
                    for i in 0..C_VALUES {
                        acc[row_tile * acc_per_tile + tile * C_VALUES + i] *= corrections[2 * row_tile + i / 2];
                    }
                }
            }
        }

        // P·V, P in registers: the score accumulators are, value for value, the A fragments
        // of P's 16-key chunks (crate::mma).
        let p = rounded::<E>(&s, comptime!(row_tiles * score_tiles * C_VALUES));
        times_tile::<E, M>(&p, &v_tiles, buffer, &mut acc, &mut scratch, keys_per_step, comptime!(part.width), v_columns, row_tiles, unrolled);
    }

    #[unroll]
    for row_tile in 0..row_tiles {
        #[unroll]
        for half in 0..2usize {
            let at = 2 * row_tile + half;
            let row = row0 + 16 * row_tile + g + 8 * half;
            if row < seq_q {
                // A row that sees no key (causal, Sq > Skv) gets 0 and the masked log-sum-exp;
                // a NaN sum (a NaN in q or a key the row sees) is no such row: NaN, as on one
                // device.
                let seen = row_sum[at] != 0.0;
                let inverse = select(seen, 1.0f32 / row_sum[at], 0.0f32);
                #[unroll(unrolled)]
                for tile in 0..out_tiles {
                    #[unroll]
                    for j in 0..2usize {
                        out[q_base + row * head_dim + comptime!(part.first) + tile * 8 + 2 * t + j] =
                            E::cast_from(acc[row_tile * acc_per_tile + tile * C_VALUES + 2 * half + j] * inverse);
                    }
                }
                if t == 0 {
                    lse[head_index * seq_q + row] = select(seen, row_max[at] * scale + row_sum[at].ln(), f32::new(MASKED));
                }
            }
        }
    }
}
