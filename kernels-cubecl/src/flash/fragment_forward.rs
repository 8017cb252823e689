//! The forward of the register-fragment engine, as FlashAttention-2 computes it: each warp owns
//! 16 query rows, keeps its Q fragments, its scores S = Q·Kᵀ and its output accumulators in
//! registers (`crate::mma`), runs the online softmax on the accumulators (a row's maximum and
//! sum over the 4 lanes that share it), and multiplies P·V with P taken from S's accumulators
//! without leaving registers. Four warps a block (64 query rows), steps of 64 keys (32 at head
//! dim 128; [`key_step`]).
//!
//! Each key step's K and V tiles are staged once per block in shared memory (the four warps
//! share them; rows padded by 8 values so that `ldmatrix`'s eight row reads fall in distinct
//! banks), double-buffered: the next step's copies (`cp.async` on CUDA, through no register)
//! are started as a step begins and awaited as the next one does, one cube-wide wait a step.
//! They come to fragments through `FragmentMma::load_matrices` (`ldmatrix` on CUDA,
//! transposed for V). Documents, key runs and windows (`VisibleRanges`) bound each block's
//! loop to the keys its rows see and mask each score by its row's run. The
//! loops over tiles are unrolled where the fragments are registers (`unrolled`: CUDA); the
//! emulation keeps them loops, which a shader compiler takes in seconds rather than minutes.

use cubecl::prelude::*;

use super::stage::{cube_in_range, cube_place, keys_seen_by_rows, visible_run};
use crate::mma::{A_VALUES, B_VALUES, C_VALUES, FragmentMma, SCRATCH_BYTES_PER_WARP, lane};

/// Warps (of 32 units) per block, each owning 16 query rows.
pub(crate) const WARPS: usize = 4;
/// Query rows of a block.
pub(crate) const BLOCK_ROWS: usize = 16 * WARPS;
/// Keys per step of the loop: 64 at head dim 64 (8 score tiles of 16 × 8 a warp); 32 at
/// head dim 128, where the output accumulators take twice the registers. Where the product
/// is emulated through shared memory, the largest step whose two buffers of K and V fit the
/// device's shared memory beside the product's scratch (lavapipe's 32 KiB: 32 keys at head
/// dim 64, 16 at 128), so that the tests run the double buffering CUDA runs.
/// `Err` with the bytes the smallest step needs where not even it fits (a kernel over the
/// limit would not run at all).
pub(crate) fn key_step(head_dim: usize, mma_sync: bool, element_bytes: usize, shared_limit: usize) -> Result<usize, usize> {
    let cuda = if head_dim > 64 { 32 } else { 64 };
    let fits = |keys: &usize| shared_bytes(head_dim, *keys, mma_sync, element_bytes) <= shared_limit;
    let found = if mma_sync { Some(cuda).filter(fits) } else { [cuda, 32, 16].into_iter().filter(|&keys| keys <= cuda).find(fits) };
    found.ok_or_else(|| shared_bytes(head_dim, if mma_sync { cuda } else { 16 }, mma_sync, element_bytes))
}

/// Shared memory of a block: two buffers of K and V tiles, and the emulated product's scratch.
fn shared_bytes(head_dim: usize, keys: usize, mma_sync: bool, element_bytes: usize) -> usize {
    let scratch = if mma_sync { 0 } else { WARPS * SCRATCH_BYTES_PER_WARP };
    2 * 2 * keys * (head_dim + PAD) * element_bytes + scratch
}

/// Values of padding after each staged row of K and V: 16 bytes, which moves the next row
/// by 4 banks.
const PAD: usize = 8;
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
    ranges: &Tensor<u32>,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] keys_per_step: usize,
    #[comptime] causal: bool,
    #[comptime] ranged: bool,
    #[comptime] unrolled: bool,
    #[define(E)] _dtype: StorageType,
) {
    let (q_heads, seq_q) = (q.shape(1), q.shape(2));
    let blocks_per_head = seq_q.div_ceil(BLOCK_ROWS);
    // The grid may hold a few more cubes than blocks; a cube has work or not as a whole.
    if cube_in_range(q.shape(0), q_heads, blocks_per_head) {
        forward_block::<E, M>(q, k, v, out, lse, ranges, scale, head_dim, keys_per_step, causal, ranged, unrolled);
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
    #[comptime] keys_per_step: usize,
    #[comptime] causal: bool,
    #[comptime] ranged: bool,
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
    let stride = comptime!(head_dim + PAD);
    // Two buffers each: a step's tiles arrive while the step before computes.
    let buffer_size = comptime!(keys_per_step * stride);
    let mut k_tiles = SharedMemory::<E>::new_aligned(2 * buffer_size, 16usize);
    let mut v_tiles = SharedMemory::<E>::new_aligned(2 * buffer_size, 16usize);
    let mut copies = M::copies();

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

    // The keys this lane's two rows see (causality, bottom-right aligned, and the call's
    // ranges folded in): every score's mask.
    let run_low = visible_run(ranges, batch, row0 + g, seq_q, seq_kv, false, ranged, causal);
    let run_high = visible_run(ranges, batch, row0 + g + 8, seq_q, seq_kv, false, ranged, causal);
    // The keys the block's rows see together, which its loop visits: without ranges the
    // causal bound; with, the span of the 64 rows' runs (each unit reads them all, once).
    let first_row = block * BLOCK_ROWS;
    let mut key_start = 0usize;
    let mut key_end = keys_seen_by_rows(first_row, BLOCK_ROWS, seq_q, seq_kv, causal);
    if ranged {
        key_start = seq_kv;
        key_end = 0usize;
        for r in 0..BLOCK_ROWS {
            let run = visible_run(ranges, batch, first_row + r, seq_q, seq_kv, false, ranged, causal);
            if run.start < run.end {
                key_start = min(key_start, run.start);
                key_end = max(key_end, run.end);
            }
        }
    }
    let mut key_blocks = 0usize;
    if key_end > key_start {
        key_blocks = (key_end - key_start).div_ceil(keys_per_step);
    }

    let score_tiles = keys_per_step / 8;
    if key_blocks > 0 {
        stage_keys::<E, M>(k, kv_base, key_start, seq_kv, &mut k_tiles, 0usize, keys_per_step, head_dim, unrolled);
        stage_keys::<E, M>(v, kv_base, key_start, seq_kv, &mut v_tiles, 0usize, keys_per_step, head_dim, unrolled);
    }
    for step in 0..key_blocks {
        let key0 = key_start + step * keys_per_step;
        let buffer = (step % 2) * buffer_size;
        let mut s = Array::<f32>::new(score_tiles * C_VALUES);
        #[unroll]
        for i in 0..score_tiles * C_VALUES {
            s[i] = 0.0;
        }
        // This step's tiles have arrived, and every warp is done with the last step's, whose
        // buffers the next step's copies, started now, overwrite.
        M::copies_arrived(&mut copies);
        if step + 1 < key_blocks {
            let next = ((step + 1) % 2) * buffer_size;
            stage_keys::<E, M>(k, kv_base, key0 + keys_per_step, seq_kv, &mut k_tiles, next, keys_per_step, head_dim, unrolled);
            stage_keys::<E, M>(v, kv_base, key0 + keys_per_step, seq_kv, &mut v_tiles, next, keys_per_step, head_dim, unrolled);
        }
        // S = Q·Kᵀ: B[kk, n] = K[key0 + 8·tile + n, 16·chunk + kk]; four matrices of 8 keys
        // × 8 dims side by side are the B fragments of two chunks.
        #[unroll(unrolled)]
        for tile in 0..score_tiles {
            #[unroll(unrolled)]
            for pair in 0..k_chunks / 2 {
                let b = M::load_matrices::<E>(&k_tiles, buffer + 8 * tile * stride + 32 * pair, stride, 4usize, 1usize, false);
                M::mma::<E>(&q_frag, 2 * pair * A_VALUES, &b, 0usize, &mut s, tile * C_VALUES, &mut scratch);
                M::mma::<E>(&q_frag, (2 * pair + 1) * A_VALUES, &b, B_VALUES, &mut s, tile * C_VALUES, &mut scratch);
            }
        }

        // The online softmax on the accumulators: s[4·tile + i] is row rows[i / 2], key
        // key0 + 8·tile + 2t + i % 2.
        #[unroll]
        for half in 0..2usize {
            let (seen_from, seen_to) = (select(half == 0, run_low.start, run_high.start), select(half == 0, run_low.end, run_high.end));
            let mut block_max = f32::new(MASKED);
            #[unroll(unrolled)]
            for tile in 0..score_tiles {
                #[unroll]
                for j in 0..2usize {
                    let key = key0 + 8 * tile + 2 * t + j;
                    let visible = key >= seen_from && key < seen_to;
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
            for pair in 0..out_tiles / 2 {
                // B[kk, n] = V[key0 + 16·chunk + kk, 8·tile + n]: V's matrices transposed, two
                // above each other per output tile, the tiles 2·pair and 2·pair + 1.
                let b = M::load_matrices::<E>(&v_tiles, buffer + 16 * chunk * stride + 16 * pair, stride, 4usize, 2usize, true);
                M::mma::<E>(&p, chunk * A_VALUES, &b, 0usize, &mut acc, 2 * pair * C_VALUES, &mut scratch);
                M::mma::<E>(&p, chunk * A_VALUES, &b, B_VALUES, &mut acc, (2 * pair + 1) * C_VALUES, &mut scratch);
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

/// Keys `key0..key0 + keys` of `source` (`head_dim` values a key from `base`) into `tiles`
/// from `buffer` (`head_dim + PAD` a key), keys from `seq_kv` on as 0: started, there once the
/// cube's copies have arrived. The cube's units share the copy, 16 bytes each at a time,
/// consecutive units on consecutive bytes.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_keys<E: Float, M: FragmentMma>(
    source: &Tensor<E>,
    base: usize,
    key0: usize,
    seq_kv: usize,
    tiles: &mut SharedMemory<E>,
    buffer: usize,
    #[comptime] keys: usize,
    #[comptime] head_dim: usize,
    #[comptime] unrolled: bool,
) {
    let chunks_per_key = comptime!(head_dim / 8);
    let per_unit = comptime!(keys * chunks_per_key / (32 * WARPS));
    #[unroll(unrolled)]
    for i in 0..per_unit {
        let at = UNIT_POS as usize + 32 * WARPS * i;
        let (key, chunk) = (at / chunks_per_key, at % chunks_per_key);
        let from = base + (key0 + key) * head_dim + 8 * chunk;
        M::copy_eight::<E>(source, from, key0 + key < seq_kv, tiles, buffer + key * (head_dim + PAD) + 8 * chunk);
    }
}
