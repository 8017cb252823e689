//! dK and dV of the register-fragment engine, key-outer as FlashAttention-2's backward: each
//! warp owns 16 keys and keeps their dK and dV accumulators in registers, and their K and V
//! fragments in registers or, staged, in shared memory (below); a block's 64 keys (128 in a block of 8 warps, `fragment_tiles::WIDE_WARPS`) stream the query rows of every q head of their kv head's group
//! (grouped-query attention's sum over the group happens here, in a fixed order, without
//! atomics), a query step at a time through the double-buffered shared tiles the forward uses
//! for K and V (`fragment_tiles`), here Q and dO. Per step, registers to registers:
//! Sᵀ = K·Qᵀ, Pᵀ = exp(scale·Sᵀ − lse) (the forward's log-sum-exp of each query column),
//! dPᵀ − D = V·dOᵀ accumulated from −D, dSᵀ = Pᵀ ∘ (dPᵀ − D), dV += Pᵀ·dO, dK += dSᵀ·Q, with Pᵀ
//! and dSᵀ taken from their accumulators as A fragments; dK is scaled once at the end. Each
//! query column's lse (as an exponent base) and −D come from a tensor of both, two columns in
//! one 16-byte read ([`row_statistics_kernel`]). Documents, key runs and
//! windows bound the loop to the queries the block's keys are seen by and mask each score by
//! its key's run of queries (the `VisibleRanges` table of keys).
//!
//! Where the rows are not streamed and the block with them staged still fits an SM twice, or
//! the wide block of 8 warps once (`Staging::rows_shared`, `fragment_tiles::key_step`: 32-bit
//! indices on an H100, an A100 or an L40 at head dims 64 and 128, in the wide block but where
//! a block of 4 is asked for; emulated, wherever they fit: lavapipe at 64), K's and
//! V's rows are not held in registers but staged in shared memory once and read as fragments
//! each step, as FlashAttention-2's backward keeps them. Held in registers at head
//! dim 128, the two accumulators (128 registers a lane) beside K's and V's fragments (64)
//! leave a step's scores too few registers, so there the kernel runs twice ([`passes`]): a
//! launch for dV, one for dK, each recomputing Pᵀ, as the planned engine splits dK/dV at head
//! dim 256. Past 128 (64 with 64-bit indices) the kernel runs once per part of the
//! columns (`fragment_tiles`), K's and V's fragments read as the products need them: dV's and
//! dK's parts of 128 apart at 256 with 32-bit indices; with 64-bit ones both gradients a launch
//! in each part of 64 columns, at 128 and 256.
//!
//! With its rows staged, the kernel sums dQ as well where the device adds f32 atomically
//! ([`Staging::query_grad`], [`sum_query_grad`]), as FlashAttention-2's backward does: each
//! step's dS·K over the block's keys is added to an f32 dQ that [`scaled_sum_kernel`] then
//! scales into the inputs' dtype, and dQ's own kernel (`fragment_query_grad`), which computes
//! S and dP a second time, does not run. The sum's order then varies from run to run, so dQ
//! agrees to f32 rounding, not bit for bit; `ULYSSES_FLASH_DETERMINISTIC=1` keeps dQ's own
//! kernel.

use cubecl::prelude::*;

use super::{
    fragment_tiles::{
        PAD, Staging, block_span, column_parts, query_grad_split, LOG2_E, exponent_base, fast_exp2, mask_scores, next_step, part_width, rounded, row_operand, row_place, rows_tile, stage_step,
        step_tiles, step_unmasked, store_rows, times_rows_transposed, times_tile, times_tile_transposed, zeros,
    },
    stage::{ColumnPart, cube_in_range, cube_index, cube_place, visible_run},
};
use crate::mma::{A_VALUES, B_VALUES, C_VALUES, FragmentMma, lane};

/// The launches of the dK/dV kernel at `head_dim`, keeping rows of `register_columns` (see
/// `fragment_tiles::register_columns`) and its own rows in shared memory or not
/// (`rows_shared`), each `(dK, dV, columns)`: whether it computes that gradient, and which of
/// its columns (see the module doc). Parts of 64 columns take both gradients in one launch, as
/// head dim 64 does, and so does a launch whose rows are in shared memory.
pub(crate) fn passes(head_dim: usize, register_columns: usize, rows_shared: bool) -> Vec<(bool, bool, ColumnPart)> {
    let parts = column_parts(head_dim, register_columns);
    if part_width(head_dim, register_columns) > 64 && !rows_shared {
        let values = parts.iter().map(|&part| (false, true, part));
        let keys = parts.iter().map(|&part| (true, false, part));
        values.chain(keys).collect()
    } else {
        parts.into_iter().map(|part| (true, true, part)).collect()
    }
}

/// dK and dV `[B, Hkv, Skv, D]` (those `keys` and `values` ask for) of attention over
/// `q: [B, Hq, Sq, D]`, `k`, `v: [B, Hkv, Skv, D]` (contiguous; head dim = value dim) given dO
/// (`out_grad`, like q), each query row's exponent base and −D (`row_stats`, `[B, Hq, rows / 2,
/// 4]`: [`row_statistics_kernel`]), `ranges` the
/// query rows that see each key: their columns `part`. One cube per block of keys (16 a warp:
/// `staging.block_rows()`) of one (batch, kv head).
#[cube(launch, address_type = "dynamic")]
pub(crate) fn fragment_key_value_grad_kernel<E: Float, M: FragmentMma, N: Size>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    out_grad: &Tensor<E>,
    row_stats: &Tensor<Vector<f32, Const<4>>>,
    key_grad: &mut Tensor<E>,
    value_grad: &mut Tensor<E>,
    query_grad_sum: &mut Tensor<Atomic<Vector<f32, N>>>,
    ranges: &Tensor<u32>,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] staging: Staging,
    #[comptime] held_columns: usize,
    #[comptime] part: ColumnPart,
    #[comptime] causal: bool,
    #[comptime] ranged: bool,
    #[comptime] keys: bool,
    #[comptime] values: bool,
    #[comptime] unrolled: bool,
    #[define(E)] _dtype: StorageType,
) {
    let blocks_per_head = k.shape(2).div_ceil(comptime!(staging.block_rows()));
    if cube_in_range(k.shape(0), k.shape(1), blocks_per_head) {
        key_value_grad_block::<E, M, N>(
            q, k, v, out_grad, row_stats, key_grad, value_grad, query_grad_sum, ranges, scale, head_dim, staging, held_columns, part, causal, ranged, keys, values, unrolled,
        );
    }
}

/// dK and dV of one block of keys of one (batch, kv head), the cube's place in the grid.
#[cube]
#[allow(clippy::too_many_arguments)]
fn key_value_grad_block<E: Float, M: FragmentMma, N: Size>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    out_grad: &Tensor<E>,
    row_stats: &Tensor<Vector<f32, Const<4>>>,
    key_grad: &mut Tensor<E>,
    value_grad: &mut Tensor<E>,
    query_grad_sum: &mut Tensor<Atomic<Vector<f32, N>>>,
    ranges: &Tensor<u32>,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] staging: Staging,
    #[comptime] held_columns: usize,
    #[comptime] part: ColumnPart,
    #[comptime] causal: bool,
    #[comptime] ranged: bool,
    #[comptime] keys: bool,
    #[comptime] values: bool,
    #[comptime] unrolled: bool,
) {
    let (q_heads, seq_q) = (q.shape(1), q.shape(2));
    let (kv_heads, seq_kv) = (k.shape(1), k.shape(2));
    let group = q_heads / kv_heads;
    // A key block's causal work shrinks with its place.
    let block_keys = comptime!(staging.block_rows());
    let place = cube_place(k.shape(0), kv_heads, seq_kv.div_ceil(block_keys), causal, false);
    let (batch, kv_index) = (place.batch, place.batch * kv_heads + place.head);
    let kv_base = kv_index * seq_kv * head_dim;
    let first_key = place.block * block_keys;
    // This warp's first key: this lane's two keys are `key0 + lane / 4` and 8 below.
    let key0 = first_key + (UNIT_POS as usize / 32) * 16;
    let lane = lane();
    let (g, t) = (lane / 4, lane % 4);

    let mut scratch = M::scratch(comptime!(staging.warps));
    let queries_per_step = comptime!(staging.keys);
    // Q's and dO's every column: the score products read them all.
    let whole = comptime!(ColumnPart::whole(head_dim));
    let mut q_tiles = step_tiles::<E>(staging, head_dim);
    let mut out_grad_tiles = step_tiles::<E>(staging, head_dim);
    let mut copies = M::copies();

    // Rows in shared memory: none held as fragments (held width 0) nor streamed.
    let rows_shared = comptime!(staging.rows_shared);
    let held = comptime!(if rows_shared { 0 } else { held_columns });
    let k_rows = row_operand::<E>(k, kv_base, key0, seq_kv, head_dim, held, unrolled);
    let v_rows = row_operand::<E>(v, kv_base, key0, seq_kv, head_dim, held, unrolled);
    let mut k_shared = rows_tile::<E>(rows_shared, block_keys, head_dim);
    let mut v_shared = rows_tile::<E>(rows_shared, block_keys, head_dim);
    let mut scores_shared = scores_tile::<E>(comptime!(staging.query_grad), queries_per_step, block_keys);
    let out_tiles = comptime!(part.width / 8);
    let mut key_acc = zeros(out_tiles * C_VALUES);
    let mut value_acc = zeros(out_tiles * C_VALUES);

    let run_low = visible_run(ranges, batch, key0 + g, seq_q, seq_kv, true, ranged, causal);
    let run_high = visible_run(ranges, batch, key0 + g + 8, seq_q, seq_kv, true, ranged, causal);
    let span = block_span(ranges, batch, first_key, seq_q, seq_kv, block_keys, queries_per_step, true, causal, ranged);
    let score_tiles = queries_per_step / 8;
    // Exponents in base 2 (`fast_exp2`): a score's is s·scale·log2(e) − lse·log2(e).
    let scale_log2 = scale * LOG2_E;
    // Rows a head of the tensors of padded query rows (the row statistics, the sum of dQ:
    // [`summed_rows`]).
    let padded_rows = row_stats.shape(2) * 2;
    if rows_shared {
        if span.steps > 0 {
            // Awaited with the first step's tiles.
            stage_step::<E, M>(k, v, kv_base, first_key, seq_kv, &mut k_shared, &mut v_shared, 0usize, block_keys, comptime!(staging.warps), head_dim, whole, unrolled);
        }
    }

    for member in 0..group {
        let head_index = kv_index * group + member;
        let q_base = head_index * seq_q * head_dim;
        // This head's first row in the row statistics and the sum of dQ.
        let padded_row0 = head_index * padded_rows;
        // Every warp is done with the last head's tiles before this head's overwrite them.
        sync_cube();
        if span.steps > 0 {
            stage_step::<E, M>(q, out_grad, q_base, span.start, seq_q, &mut q_tiles, &mut out_grad_tiles, 0usize, queries_per_step, comptime!(staging.warps), head_dim, whole, unrolled);
        }
        for step in 0..span.steps {
            let query0 = span.start + step * queries_per_step;
            let buffer = next_step::<E, M>(q, out_grad, q_base, &span, step, seq_q, &mut q_tiles, &mut out_grad_tiles, &mut copies, staging, head_dim, whole, unrolled);
            let mut s = zeros(score_tiles * C_VALUES);
            if rows_shared {
                times_rows_transposed::<E, M>(&k_shared, &q_tiles, buffer, &mut s, &mut scratch, queries_per_step, head_dim, 1usize, unrolled);
            } else {
                times_tile_transposed::<E, M>(&k_rows, k, &q_tiles, buffer, &mut s, &mut scratch, queries_per_step, head_dim, held_columns, unrolled);
            }

            // The log-sum-exp bases and −D of the lane's query columns 2t and 2t + 1 of each
            // tile, one 16-byte read a tile ([`row_statistics_kernel`]; a column past the
            // sequence, seen by no key, reads the head's padding, so no clamp; `query0` is
            // even). Read from lse and D, a column took two loads, a clamp, a compare and a
            // multiply.
            let mut column_base = zeros(score_tiles * 2);
            let mut column_minus_delta = zeros(score_tiles * 2);
            // Halved, the index stays under 2^31, so each tile's offset folds into its load.
            let stats0 = (padded_row0 + query0 + 2 * t) / 2;
            #[unroll(unrolled)]
            for tile in 0..score_tiles {
                // Inside the tensor (padded rows), so unchecked.
                let both = unsafe { *row_stats.index_unchecked(stats0 + 4 * tile) };
                #[unroll]
                for j in 0..2usize {
                    column_base[2 * tile + j] = both[j];
                    column_minus_delta[2 * tile + j] = both[2 + j];
                }
            }

            // Pᵀ in place of Sᵀ: 0 where the query does not see the key (its score masked only
            // in the steps that need it). Each path exponentiates on its own: with one
            // exponentiation after an optional mask, ptxas predicated the mask, so that every
            // step issued it.
            if step_unmasked(query0, queries_per_step, &run_low, &run_high) {
                column_probabilities(&mut s, scale_log2, &column_base, score_tiles, unrolled);
            } else {
                mask_scores(&mut s, 0usize, query0, &run_low, &run_high, false, score_tiles, unrolled);
                column_probabilities(&mut s, scale_log2, &column_base, score_tiles, unrolled);
            }

            // dSᵀ = Pᵀ ∘ (dPᵀ − D) first, dPᵀ − D accumulated from −D (dPᵀ = V·dOᵀ); then
            // dV[:, part] += Pᵀ·dO[:, part] and dK[:, part] += dSᵀ·Q[:, part] on their rounded
            // fragments. In this order D is dead before the products that follow, and Pᵀ and
            // dSᵀ in f32 before dV's and dK's: with dV's product first, Pᵀ, D and dV's
            // operands were live together, and ptxas spilled at head dim 128 (sm_90a).
            let mut dp = zeros(score_tiles * C_VALUES);
            if keys {
                #[unroll(unrolled)]
                for tile in 0..score_tiles {
                    #[unroll]
                    for i in 0..C_VALUES {
                        dp[tile * C_VALUES + i] = column_minus_delta[2 * tile + i % 2];
                    }
                }
                if rows_shared {
                    times_rows_transposed::<E, M>(&v_shared, &out_grad_tiles, buffer, &mut dp, &mut scratch, queries_per_step, head_dim, 1usize, unrolled);
                } else {
                    times_tile_transposed::<E, M>(&v_rows, v, &out_grad_tiles, buffer, &mut dp, &mut scratch, queries_per_step, head_dim, held_columns, unrolled);
                }
                #[unroll(unrolled)]
                for at in 0..score_tiles * C_VALUES {
                    dp[at] *= s[at];
                }
            }
            let ds = rounded::<E>(&dp, score_tiles * C_VALUES);
            // With `stmatrix` dS goes to the shared tile of dQ's sum first, else after dK's
            // product ([`store_score_grads`] says why).
            let stored_first = comptime!(staging.score_grads_first);
            if keys && stored_first {
                store_score_grads::<E, M>(&ds, &mut scores_shared, queries_per_step, staging.warps, staging.stores_matrices, unrolled);
            }
            if values {
                let p = rounded::<E>(&s, score_tiles * C_VALUES);
                times_tile::<E, M>(&p, &out_grad_tiles, buffer, &mut value_acc, &mut scratch, queries_per_step, head_dim, part, 1usize, unrolled);
            }
            if keys {
                times_tile::<E, M>(&ds, &q_tiles, buffer, &mut key_acc, &mut scratch, queries_per_step, head_dim, part, 1usize, unrolled);
                if comptime!(staging.query_grad) {
                    // dQ[step's queries] += dS·K over the block's keys. (The next step's
                    // barrier, before it writes the tile again, waits for every warp's reads.)
                    // A step's rows past the sequence fall into the head's padding.
                    if !stored_first {
                        store_score_grads::<E, M>(&ds, &mut scores_shared, queries_per_step, staging.warps, staging.stores_matrices, unrolled);
                    }
                    sum_query_grad::<E, M, N>(&scores_shared, &k_shared, query_grad_sum, &mut scratch, padded_row0, query0, seq_q, queries_per_step, head_dim, staging.warps, unrolled);
                }
            }
        }
    }

    // dK and dV have K's shape: K's rows' place is theirs, placed again here rather than
    // kept through the loop.
    let rows_place = row_place(kv_base, key0, seq_kv, head_dim);
    if keys {
        store_rows::<E>(&key_acc, scale, key_grad, &rows_place, part, unrolled);
    }
    if values {
        store_rows::<E>(&value_acc, 1.0f32, value_grad, &rows_place, part, unrolled);
    }
}

/// Pᵀ in place of Sᵀ's `tiles` accumulator tiles: 2^(scale_log2·s − base) with `scale_log2`
/// the scale times log2(e) and `base` the column's (query's) log-sum-exp base in the same
/// units, `column_base[2·tile + j]` for the lane's columns 2t + j.
#[cube]
fn column_probabilities(s: &mut Array<f32>, scale_log2: f32, column_base: &Array<f32>, #[comptime] tiles: usize, #[comptime] unrolled: bool) {
    #[unroll(unrolled)]
    for tile in 0..tiles {
        #[unroll]
        for i in 0..C_VALUES {
            let at = tile * C_VALUES + i;
            s[at] = fast_exp2(s[at] * scale_log2 - column_base[2 * tile + i % 2]);
        }
    }
}

/// dS of a step, query-major (`queries` rows of the block's `keys`, padded as the step's tiles
/// are), where this kernel sums dQ ([`Staging::query_grad`]); a placeholder of one value where
/// it does not.
#[cube]
fn scores_tile<E: Float>(#[comptime] summed: bool, #[comptime] queries: usize, #[comptime] keys: usize) -> SharedMemory<E> {
    let values = comptime!(if summed { queries * (keys + PAD) } else { 1 });
    SharedMemory::<E>::new_aligned(values, 16usize)
}

/// Writes `ds`, this warp's dSᵀ (its 16 keys × the step's `queries`, rounded accumulators), into
/// `tile` (a [`scores_tile`]) query-major, for [`sum_query_grad`]: dQ's rows are the step's
/// queries, so dS has to be transposed (`stmatrix` with its transpose, where
/// `stores_matrices`). With `stmatrix` the kernel stores it as soon as dS is rounded, before
/// dV's and dK's products: stored after them, just before the sum's barrier, ptxas 13.0 held
/// 255 registers on sm_90a and spilled (2 LDL/STL a step in the loop at head dim 64, 12–20
/// bytes at 64 and 128); stored first, dK/dV holds 221–248 and spills nothing, at 50–80 more
/// instructions a step (register moves). Without it (sm_80, sm_89) after dK's product: stored
/// first there, ptxas 12.9 spilled at head dim 128 (8 bytes, outside the loop), 2026-12-06.
#[cube]
fn store_score_grads<E: Float, M: FragmentMma>(
    ds: &Array<E>,
    tile: &mut SharedMemory<E>,
    #[comptime] queries: usize,
    #[comptime] warps: usize,
    #[comptime] stores_matrices: bool,
    #[comptime] unrolled: bool,
) {
    let warp = UNIT_POS as usize / 32;
    let stride = comptime!(16 * warps + PAD);
    // Value i of score tile n is dSᵀ at key 16·warp + g + 8·(i / 2), query 8·n + 2t + i % 2:
    // two score tiles are four 8 × 8 matrices of dSᵀ, each stored transposed (queries 8·n..,
    // keys 16·warp + 8·(i / 2)..), in the order `store_matrices` takes them (the row block,
    // the tile, varies first). With `stmatrix` two instructions a 32-query step, where a
    // store per value took 16 two-byte stores, their halves' extraction and an address each
    // (sm_90a: ~60 instructions).
    #[unroll(unrolled)]
    for n_pair in 0..queries / 16 {
        let mut matrices = Array::<E>::new(8usize);
        #[unroll]
        for m in 0..4usize {
            #[unroll]
            for j in 0..2usize {
                matrices[2 * m + j] = ds[(2 * n_pair + m % 2) * C_VALUES + 2 * (m / 2) + j];
            }
        }
        M::store_matrices::<E>(tile, 16 * n_pair * stride + 16 * warp, stride, &matrices, 4usize, 2usize, true, stores_matrices);
    }
}

/// Adds `dS·K` over the block's keys (16 for each of its `warps`) to rows `query0..query0 + queries` of the query rows
/// from `row0` of `sum` (f32, unscaled, its heads padded: [`summed_rows`]): `tile` the step's
/// dS, every warp's written ([`store_score_grads`]), `k_rows` the block's staged K, `seq_q` the
/// sequence's queries. After a barrier each warp reads dS's A fragments from the tile with
/// `ldmatrix` as the staged rows are read, takes its share of dQ's tile
/// ([`query_grad_split`]: whole pairs of 16 columns, for all the queries or, in the wide block
/// at head dim 64, half of them) over all the block's keys (no reduction between warps), and
/// adds its accumulators with one atomic each, or each pair (`N`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn sum_query_grad<E: Float, M: FragmentMma, N: Size>(
    tile: &SharedMemory<E>,
    k_rows: &SharedMemory<E>,
    sum: &mut Tensor<Atomic<Vector<f32, N>>>,
    scratch: &mut SharedMemory<f32>,
    row0: usize,
    query0: usize,
    seq_q: usize,
    #[comptime] queries: usize,
    #[comptime] head_dim: usize,
    #[comptime] warps: usize,
    #[comptime] unrolled: bool,
) {
    let lane = lane();
    let (g, t) = (lane / 4, lane % 4);
    let warp = UNIT_POS as usize / 32;
    let stride = comptime!(16 * warps + PAD);
    sync_cube();

    // This warp's 16-row tiles and 16-column pairs of the step's dQ ([`query_grad_split`]).
    let (m_tiles, pairs, column_groups, row_groups) = comptime! {
        let (column_groups, row_groups) = query_grad_split(head_dim, warps, queries).expect("dQ's sum splits its tile over the warps (Staging::divides)");
        (queries / 16 / row_groups, head_dim / 16 / column_groups, column_groups, row_groups)
    };
    let width = N::value();
    let k_stride = comptime!(head_dim + PAD);
    // Split by columns alone, the warp's place is its index: `warp % column_groups` would be the
    // same value, which ptxas cannot know (it does not know the block's size).
    let (first_column, first_tile) = if comptime!(row_groups == 1) {
        (warp * comptime!(16 * pairs), 0usize)
    } else {
        (warp % column_groups * comptime!(16 * pairs), warp / column_groups * m_tiles)
    };
    // The warp's share of dQ's columns at once, dS's A fragments read once for all of them.
    let per_pair = comptime!(m_tiles * 2 * C_VALUES);
    let mut acc = zeros(comptime!(pairs * m_tiles * 2 * C_VALUES));
    #[unroll(unrolled)]
    for chunk in 0..warps {
        let mut a = Array::<E>::new(comptime!(m_tiles * A_VALUES));
        #[unroll]
        for m_tile in 0..m_tiles {
            // dS's A fragment: this warp's m_tile-th 16 queries × keys 16·chunk.. of the
            // query-major tile.
            let fragment = M::load_matrices::<E>(tile, 16 * (first_tile + m_tile) * stride + 16 * chunk, stride, 4usize, 2usize, false);
            #[unroll]
            for i in 0..A_VALUES {
                a[m_tile * A_VALUES + i] = fragment[i];
            }
        }
        #[unroll(unrolled)]
        for pair in 0..pairs {
            // K's matrices transposed, two above each other per output tile: its B fragments
            // (as `times_tile` reads a step's tile).
            let b = M::load_matrices::<E>(k_rows, 16 * chunk * k_stride + first_column + 16 * pair, k_stride, 4usize, 2usize, true);
            #[unroll]
            for m_tile in 0..m_tiles {
                M::mma::<E>(&a, m_tile * A_VALUES, &b, 0usize, &mut acc, pair * per_pair + 2 * m_tile * C_VALUES, scratch);
                M::mma::<E>(&a, m_tile * A_VALUES, &b, B_VALUES, &mut acc, pair * per_pair + (2 * m_tile + 1) * C_VALUES, scratch);
            }
        }
    }
    #[unroll]
    for m_tile in 0..m_tiles {
        // The 16 rows from query0 + 16·(first_tile + m_tile), where the first is in the sequence: the
        // others past it land in the head's padding. One test a 16-row tile, the same for
        // the warp's lanes, where a test per row cost 4 instructions for 4 atomics; without
        // any, ptxas hoisted the atomics' addresses over the products and spilled.
        if query0 + 16 * (first_tile + m_tile) < seq_q {
            #[unroll]
            for half in 0..2usize {
                // Inside the sum's rows, so unchecked: no clamp per atomic. In vectors (the
                // columns 2t + 8·n_tile are even, so whole pairs of them); halved, the row's
                // index is known to stay under 2^31, so ptxas folds each atomic's constant
                // offset from it (its column) into the instruction. With single values (N 1)
                // each atomic still takes an add and a 64-bit multiply-add for its address: a
                // 32-bit index may wrap.
                let row = ((row0 + query0 + 16 * (first_tile + m_tile) + g + 8 * half) * head_dim + first_column + 2 * t) / width;
                #[unroll(unrolled)]
                for pair in 0..pairs {
                    #[unroll]
                    for n_tile in 0..2usize {
                        // The lane's two adjacent columns: one atomic of a pair where the
                        // device adds f32 pairs (`N` 2: sm_90's red.global.add.v2.f32), else two.
                        #[unroll]
                        for v in 0..comptime!(2 / width) {
                            let mut vector = Vector::<f32, N>::empty();
                            #[unroll]
                            for j in 0..width {
                                vector[j] = acc[pair * per_pair + (2 * m_tile + n_tile) * C_VALUES + 2 * half + v * width + j];
                            }
                            unsafe { sum.index_unchecked(row + (16 * pair + 8 * n_tile) / width + v) }.fetch_add(vector);
                        }
                    }
                }
            }
        }
    }
}

/// Rows per head of the tensors of padded query rows, the row statistics
/// ([`row_statistics_kernel`]) and the f32 sum of dQ ([`Staging::query_grad`]), for `seq_q`
/// queries and a loop of `queries` a step: a block's steps start at an even query (so that
/// two columns' statistics are one read) at or before its first visible one, so its last step
/// may reach `queries - 1` rows past the sequence; the atomics test only a 16-row tile's first
/// row against the sequence, so they write up to 15 rows past it (`queries` is 16 or more).
/// Even, so that a pair of rows' statistics never straddles two heads. The padding is read
/// only by masked columns and never read from the sum.
pub(crate) fn summed_rows(seq_q: usize, queries: usize) -> usize {
    (seq_q + queries - 1).next_multiple_of(2)
}

/// Each query row's exponent base (its log-sum-exp times log2(e), [`exponent_base`]) and −D,
/// `[B, H, rows / 2, 4]` (an even row's base, the next row's, then their −D, which dP's
/// accumulators start from: negated here, not by 8 instructions a step; `rows`
/// [`summed_rows`], zeros past the sequence), so that the dK/dV kernel reads both for two query
/// columns in one 16-byte load, with no clamp to the sequence: a padded row's column is
/// masked, and 2^(masked score − 0) is 0.
#[cube(launch, address_type = "dynamic")]
pub(crate) fn row_statistics_kernel(lse: &Tensor<f32>, delta: &Tensor<f32>, stats: &mut Tensor<f32>) {
    let (seq, rows) = (lse.shape(2), stats.shape(2) * 2);
    let index = cube_index() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if index < stats.shape(0) * stats.shape(1) * rows {
        let (head, row) = (index / rows, index % rows);
        let mut base = 0.0f32;
        let mut minus_delta = 0.0f32;
        if row < seq {
            base = exponent_base(lse[head * seq + row], LOG2_E);
            minus_delta = -delta[head * seq + row];
        }
        let at = (head * rows + row) / 2 * 4 + row % 2;
        stats[at] = base;
        stats[at + 2] = minus_delta;
    }
}

/// dQ in its dtype (`[B, H, Sq, D]`) from the f32 sum `sum` the dK/dV kernel's blocks added up
/// ([`Staging::query_grad`], `[B, H, summed_rows, D]`), times `scale` (the scores' scale,
/// which dS·K leaves out).
#[cube(launch, address_type = "dynamic")]
pub(crate) fn scaled_sum_kernel<E: Float>(sum: &Tensor<f32>, out: &mut Tensor<E>, scale: f32, #[define(E)] _dtype: StorageType) {
    let index = cube_index() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if index < out.len() {
        let head_values = out.shape(2) * out.shape(3);
        let (head, within) = (index / head_values, index % head_values);
        out[index] = E::cast_from(sum[head * sum.shape(2) * sum.shape(3) + within] * scale);
    }
}
