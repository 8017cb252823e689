//! What the register-fragment kernels share (`fragment_forward`, `fragment_query_grad`,
//! `fragment_key_value_grad`): blocks of 64 rows (queries; keys for dK/dV), 16 a warp, or of
//! 128, 32 a warp, in the forward that stages its Q ([`Staging::row_tiles`]), 16 a warp of 8
//! in dK/dV's wide block ([`WIDE_WARPS`]); K and V
//! (Q and dO for dK/dV) staged a key step at a time in double-buffered shared
//! tiles (`cp.async` on CUDA, through no register), rows padded by 8 values so that
//! `ldmatrix`'s eight row reads fall in distinct banks; the keys a block's rows see; and the
//! two products every kernel runs on a step's tiles, one with the tiles as Bᵀ (S = Q·Kᵀ,
//! dP = dO·Vᵀ), one as B (O += P·V, dQ += dS·K), each from registers to registers.
//!
//! Head dims past [`register_columns`] (128; 64 in the backward with 64-bit indices) do not fit a warp's
//! registers whole: each output is accumulated in column parts of that width, a launch each,
//! that recompute the scores (the planned engine's column parts), and the score products read
//! each warp's row fragments from global memory 16 columns at a time as they need them
//! ([`RowOperand`]) where the rows are wider than [`held_columns`] (the forward with 32-bit
//! indices keeps Q's 256 whole beside its 128 accumulator columns): at 256 in parts of 128 the
//! forward's and dQ's work about 1.5 times, dK's and dV's likewise; in the backward's parts of
//! 64 with 64-bit indices dQ's about 1.7 times at 128 and 3 times at 256.
//!
//! The loops over tiles are unrolled where the fragments are registers (`unrolled`: CUDA); the
//! emulation keeps them loops, which a shader compiler takes in seconds rather than minutes.

use cubecl::{ir::AddressType, prelude::*};

use super::stage::{ColumnPart, Run, cube_place, first_row_seeing, keys_seen_by_rows, visible_run};
use crate::mma::{A_VALUES, B_VALUES, C_VALUES, FragmentMma, SCRATCH_BYTES_PER_WARP, lane};

/// Warps (of 32 units) per block, each owning 16 rows, or 32 ([`Staging::row_tiles`]): every
/// kernel's but dK/dV's wide block ([`WIDE_WARPS`]).
pub(crate) const WARPS: usize = 4;
/// dK/dV's warps per block where its rows are staged and the block fits an SM
/// ([`key_step`]): 128 keys of 16 a warp, as FlashAttention-2's backward (`kBlockN` 128, 8
/// warps at head dim 128). Each step's Q and dO tiles, and dQ's atomics, then serve twice the
/// keys: half the bytes from L2 per product. At head dim 128 each warp's work is that of the
/// block of 4 (at 64 its dQ sum takes half the rows and all the keys: [`query_grad_split`]);
/// an SM holds one such block where it held two of 4 (255 registers bound both).
pub(crate) const WIDE_WARPS: usize = 8;
/// Values of padding after each staged row of K and V: 16 bytes, which moves the next row
/// by 4 banks.
pub(crate) const PAD: usize = 8;
/// The most keys (queries for dK/dV) a step of any kernel's loop takes ([`key_step`]).
pub(crate) const MAX_STEP: usize = 64;
/// The widest rows a warp keeps in registers, as fragments (Q, dO; K and V for dK/dV) or as
/// accumulators (an output's columns), with 32-bit indices: at head dim 128 the kernels already
/// hold up to 255 registers (benches/RESULTS.md), so wider heads split their outputs and, but
/// for the forward's Q with 32-bit indices ([`held_columns`]), stream their row fragments (see
/// the module doc).
pub(crate) const REGISTER_COLUMNS: usize = 128;

/// The widest rows `kernel` keeps in registers with indices of width `indices`:
/// [`REGISTER_COLUMNS`], but 64 for the backward's kernels with 64-bit indices, whose offsets
/// take two registers each (dQ held 255 at head dim 128 there and spilled on the H100): head
/// dim 128 then streams its rows as 256 does and computes each gradient in two parts. The
/// forward keeps 128 (no spill with 64-bit indices: the machine-code check).
pub(crate) fn register_columns(kernel: FragmentKernel, indices: AddressType) -> usize {
    match (kernel, indices) {
        (FragmentKernel::QueryGrad | FragmentKernel::KeyValueGrad, AddressType::U64) => 64,
        _ => REGISTER_COLUMNS,
    }
}

/// The widest rows whose fragments `kernel` keeps in registers through its loop for the score
/// products (Q; K and V for dK/dV), with indices of width `indices`; wider rows are read as
/// the products need them ([`rows_streamed`]). [`register_columns`], but 256 for the forward
/// with 32-bit indices: Q's fragments (64 registers at 256) beside one part of 128 output
/// columns take 243–255 registers and spill nothing on sm_80, sm_89 and sm_90a, and its 64-key
/// step at 256 runs 609 instructions rather than 1 432, 16 × 63 of which read Q's chunks
/// (2026-11-29). With 64-bit indices it keeps 128 (at 128 already 255 registers there).
pub(crate) fn held_columns(kernel: FragmentKernel, indices: AddressType) -> usize {
    match (kernel, indices) {
        (FragmentKernel::Forward, AddressType::U32) => 256,
        _ => register_columns(kernel, indices),
    }
}

/// Whether rows of `head_dim` are read from memory 16 columns at a time as each product needs
/// them (wider than `held`: [`held_columns`]) rather than kept in registers as fragments.
pub(crate) fn rows_streamed(head_dim: usize, held: usize) -> bool {
    head_dim > held
}

/// A masked score: finite (WGSL has no infinity literal) and below any real one; its
/// probability, 2^(MASKED·scale·log2(e) − base), underflows to 0 (see [`exponent_base`]).
pub(crate) const MASKED: f32 = -1.0e30;

/// The softmax scales the register-fragment kernels take: positive, because they take each
/// row's maximum of the unscaled scores (a pass over a step's scores fewer), and so that a
/// [`MASKED`] score times the scale and log2(e) stays finite and below any real exponent
/// (−10^10 to −10^34). The planner gives other scales to the other engines.
pub(crate) const SCALES: std::ops::RangeInclusive<f32> = 1.0e-20..=1.0e4;

/// log2(e): the kernels' exponents are in base 2 ([`fast_exp2`]), their scale and bases
/// multiplied by it once (a row's or a column's), not once a score.
pub(crate) const LOG2_E: f32 = std::f32::consts::LOG2_E;

/// 2^x as the special-function unit approximates it, for the probabilities, which are rounded
/// to f16/bf16 before they multiply. On CUDA `ex2.approx.ftz` (the vendored cubecl-cpp's fast
/// 2^x: one MUFU.EX2, where e^x takes a multiply by log2(e) more and `__expf` 5 instructions),
/// about 2 ulp, results below 2^-126 flushed to 0; elsewhere `pow(2, x)`. The kernels pass
/// `s·scale·log2(e) − base` (one multiply-add) with `base` a row's maximum or log-sum-exp in
/// the same units, or 0 for a row that has seen no key (see [`exponent_base`]), so x is at most
/// a rounding above 0, and a masked score's is about −10^10 or less: the fast-math scope's
/// promise of no infinite or NaN input or result holds.
#[cube(fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf)]
pub(crate) fn fast_exp2(x: f32) -> f32 {
    f32::powf(2.0f32, x)
}

/// The base a row's exponents subtract: its `statistic` in base-2 units (times `factor`: the
/// forward's unscaled maximum times scale·log2(e), the backward's log-sum-exp times log2(e)),
/// but 0 where that is [`MASKED`] (a row that has seen or sees no key), so that its masked
/// scores give 2^(−10^10...) = 0, not 2^0, with no test per score.
#[cube]
pub(crate) fn exponent_base(statistic: f32, factor: f32) -> f32 {
    select(statistic > f32::new(MASKED), statistic * factor, 0.0f32)
}

/// Whether every key of `[key0, key0 + keys)` is visible to both rows of every lane of the
/// warp (`low`'s and `high`'s runs: queries for dK/dV), so that the step needs no mask: every
/// step away from the causal diagonal, the ranges' edges and the sequence's end, where the
/// warp's rows share their runs (the forward passes the runs all its rows share; a warp whose rows straddle a document's edge masks every
/// step). The warp decides together, so that it takes one of the two paths, never both.
#[cube]
pub(crate) fn step_unmasked(key0: usize, keys: usize, low: &Run, high: &Run) -> bool {
    plane_all(key0 >= max(low.start, high.start) && key0 + keys <= min(low.end, high.end))
}

/// A step's unscaled scores of one row tile, `s` from `first` (`tiles` accumulator tiles:
/// `s[first + 4·tile + i]` is this lane's row `i / 2`, g or g + 8, and key
/// `key0 + 8·tile + 2t + i % 2`; for dK/dV rows are keys and keys queries) set to [`MASKED`]
/// where the row does not see the key (`low`'s and `high`'s runs),
/// unless the step is `unmasked` (the warp branches once, not once a score). Scaling is left
/// to each score's exponent (see [`fast_exp2`]).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn mask_scores(s: &mut Array<f32>, first: usize, key0: usize, low: &Run, high: &Run, unmasked: bool, #[comptime] tiles: usize, #[comptime] unrolled: bool) {
    if !unmasked {
        let t = lane() % 4;
        #[unroll(unrolled)]
        for tile in 0..tiles {
            #[unroll]
            for i in 0..C_VALUES {
                let at = first + tile * C_VALUES + i;
                let key = key0 + 8 * tile + 2 * t + i % 2;
                let (seen_from, seen_to) = (select(i < 2, low.start, high.start), select(i < 2, low.end, high.end));
                s[at] = select(key >= seen_from && key < seen_to, s[at], f32::new(MASKED));
            }
        }
    }
}

/// Which register-fragment kernel a key step is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FragmentKernel {
    Forward,
    QueryGrad,
    /// dK and dV (`fragment_key_value_grad`): its step is of queries.
    KeyValueGrad,
}

/// A kernel's loop step: its keys (queries for dK/dV) and the buffers of its staged tiles: two,
/// so that the next step's copies arrive while this step computes, or one on an emulating
/// device where [`key_step`] prefers a larger step or dK/dV's staged rows to a second buffer
/// (the copies then wait for the step before); whether its block's own rows (the forward's Q;
/// dK/dV's K and V) are staged in shared memory too, and how many 16-row tiles each warp owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Staging {
    pub keys: usize,
    pub buffers: usize,
    /// Warps of a block: [`WARPS`], or [`WIDE_WARPS`] for dK/dV.
    pub warps: usize,
    /// The block's own rows staged once in shared memory and read as A fragments by the score
    /// products (`ldmatrix`, [`times_rows_transposed`]), rather than held in registers. dK/dV's
    /// K and V: their 64 registers a lane at head dim 128 go to the scores, so one launch
    /// accumulates both gradients there, Sᵀ and dPᵀ computed once rather than once per gradient
    /// ([`key_step`] has the counts). The forward's Q: its registers go to a second row tile
    /// ([`row_tiles`](Self::row_tiles)). As FlashAttention-2 keeps them.
    pub rows_shared: bool,
    /// 16-row tiles of the block each warp owns: 1, or 2 in the forward with its Q staged
    /// (`rows_shared`), as FlashAttention-2's forward gives each of 4 warps 32 of 128 rows
    /// (`kBlockM` 128). Each K fragment read from shared memory (`ldmatrix`) then feeds two
    /// products, each V fragment two, and a step's fixed work (barrier, votes, copies) is
    /// spread over twice the rows: at head dim 128 a 32-key step (`key_step`) reads 32 K and Q
    /// fragments and 16 of V for 128 products, where one tile a warp with 64 keys reads 32 and
    /// 32 for 128 (0.375 reads a product against 0.5; 0.31 at head dim 64).
    pub row_tiles: usize,
    /// dK/dV's kernel sums dQ too (`fragment_key_value_grad`, its rows staged): each step's dS
    /// goes through a shared tile of the block's keys × the step's queries, and its product with the
    /// block's K is added to an f32 sum of dQ with atomics, as FlashAttention-2's backward
    /// does; dQ's own kernel, which recomputes S and dP, then does not run.
    pub query_grad: bool,
    /// dS written into its tile with `stmatrix` ([`FragmentMma::store_matrices`]): where the
    /// device has it (sm_90), set by the launch; [`key_step`] leaves it unset, since it
    /// changes no size.
    pub stores_matrices: bool,
    /// dK/dV's kernel, summing dQ, stores each step's dS into its tile before dV's and dK's
    /// products rather than after dK's: set by the launch where `stores_matrices`, which spills
    /// otherwise (`fragment_key_value_grad::store_score_grads` says why); the order alone, the
    /// same gradients.
    pub score_grads_first: bool,
}

impl Staging {
    /// Rows (queries; keys for dK/dV) of a block: 16 a row tile a warp.
    pub(crate) fn block_rows(&self) -> usize {
        16 * self.warps * self.row_tiles
    }

    /// Whether a step's tiles split evenly over the block's units, 16 bytes each
    /// ([`stage_keys`]), at `head_dim` (staged rows do: 16 a warp), and, where dK/dV sums dQ,
    /// its dQ tile over the warps ([`query_grad_split`]).
    fn divides(&self, head_dim: usize) -> bool {
        (self.keys * head_dim / 8) % (32 * self.warps) == 0 && (!self.query_grad || query_grad_split(head_dim, self.warps, self.keys).is_some())
    }
}

/// How dK/dV's sum of dQ shares a step's dQ tile (`queries` × `head_dim`) among the block's
/// `warps`: `(column_groups, row_groups)`, each warp whole 16-column pairs of one column group
/// for the 16-row tiles of one row group, every warp over all the block's keys (no reduction
/// between warps). The columns split first, so that each dS fragment a warp reads feeds all its
/// pairs: a quarter or an eighth of head dim 128 a warp, a quarter of 64 in blocks of 4; in the
/// wide block at 64 a quarter of the columns for half the rows. `None` where neither divides.
pub(crate) fn query_grad_split(head_dim: usize, warps: usize, queries: usize) -> Option<(usize, usize)> {
    let (pairs, row_tiles) = (head_dim / 16, queries / 16);
    if head_dim % 16 != 0 || queries % 16 != 0 || pairs == 0 {
        None
    } else if pairs % warps == 0 {
        Some((warps, 1))
    } else if warps % pairs == 0 && row_tiles % (warps / pairs) == 0 {
        Some((pairs, warps / pairs))
    } else {
        None
    }
}

/// Keys (queries for dK/dV) per step of `kernel`'s loop, with dK/dV's rows held in registers
/// (for its staged rows see the end): 64 at head dim 64 (8 score tiles of
/// 16 × 8 a warp) for the forward and dQ, 32 for dK/dV, which holds two accumulators and both
/// Sᵀ's and dPᵀ's tiles (64 spilled on sm_90a: 255 registers); from head dim 128, where the
/// accumulators take twice the registers, 64 for the forward too (at 128 it then holds 232–238
/// registers on sm_90a and spills nothing, and a step's fixed work, the barrier, the votes and
/// the row statistics' shuffles, is spread over twice the keys: 581 instructions a 64-key step
/// on the common path against 328 a 32-key one; where rows are streamed (at 256 with 64-bit
/// indices), each chunk read feeds
/// twice the products), and 16 for dQ, which holds dP's
/// tiles and dO's fragments too (32 spilled there: 255 registers on sm_80 and sm_89), and for
/// dK/dV, which holds K's and V's; but 32 for the backward where its rows are streamed (past
/// `register_columns`: no row fragments held), so that each 16-column chunk of a row read from
/// memory feeds four products rather than two; always double-buffered, and 32 keys, else 16,
/// where the larger step would not let two blocks share an SM. Where the product is emulated through
/// shared memory, the largest step up to that whose tiles fit the device's shared memory beside
/// the product's scratch, double-buffered where any step is, but the backward's streamed step
/// the largest before double-buffered (lavapipe's 32 KiB: 32 keys at head dim 64, 16 at 128;
/// at 256 16 keys, the forward double-buffered, the backward not; the backward at 128 with
/// 64-bit indices 32 keys, one buffer), so that the tests run the schedule CUDA runs wherever
/// the device allows. `Err` with the bytes the
/// smallest step needs where not even it fits (a kernel over the limit would not run at all).
///
/// dK/dV stages its own rows in shared memory ([`Staging::rows_shared`]) where its rows are
/// not streamed and they fit: with `mma_sync`, in blocks of 4 warps, where the block then fits
/// an SM twice (an H100 or an A100 at head dims 64 and 128, an L40 at 64 with 32 queries; not
/// an L40 at 128: but see the wide block below), else where some step fits at all, staged
/// before held; emulated, wherever they fit, before any
/// held step (lavapipe at 64: one 16-query buffer, where held rows took two of 32; not at 128,
/// where the rows alone exceed its 32 KiB), so that the tests run both paths.
/// Its registers then hold the scores of twice the queries: 64 a step at head dim 64 (232
/// registers on sm_90a, 612 instructions a step on the common path against 664 for two
/// 32-query steps with K and V held), 32 at 128 (248 registers, 458 against 834 for two
/// 16-query steps of each of the dV and dK launches), no spill (2026-11-29).
///
/// Staged, dK/dV sums dQ as well ([`Staging::query_grad`]) where the device adds f32 values
/// atomically (`atomic_add`) and the step's dQ tile splits over the warps in whole pairs of
/// fragments ([`query_grad_split`]): dS's tile (of 4 warps) (4.5 KB at head dim 128, 9 KB at 64) still leaves two blocks an SM on
/// an H100 and an A100 (73 KB at 128), and lavapipe's 32 KiB its 16-query step at 64.
///
/// The forward stages its Q and gives each warp two row tiles ([`Staging::row_tiles`]) where its
/// output is one part (head dims 64 and 128), in the order above (twice an SM, else once):
/// with `mma_sync` a 64-key step at 64 (55 KB with Q's 18 KB; 32 keys on an L40, 36 KB), but
/// 32 keys at 128, where 64 (FlashAttention-2's) held 255 registers and spilled 104–196 bytes
/// in the loop on sm_90a, and 32 hold 242–245 and spill nothing (2026-11-30): 68 KB with Q's
/// 35 KB, twice an H100 or an A100, not an L40 (Q and 16 keys: 52 KB), which keeps Q in
/// registers at 128.
/// Emulated, lavapipe's 32 KiB holds Q's 18 KB at 64 beside one 16-key buffer, so the tests
/// run both forwards: two row tiles at 64, one at 128 and 256.
///
/// `stage_rows` false keeps every kernel's rows in registers (the bench's forward with one row
/// tile a warp beside the default).
///
/// dK/dV's block is [`WIDE_WARPS`] warps (128 keys) with `mma_sync` where the mode the block of
/// [`WARPS`] would take first stages its rows, the wide block can take it too (its dQ sum
/// splits by columns at head dim 128, by columns and rows at 64, where a step of 16 queries
/// cannot: [`query_grad_split`]) and it fits an SM once (an H100 or an A100 at 128: 113 KB
/// with 32 queries; an L40 with 16: 91 KB; at 64 91 KB with 64 queries, an L40 too); else
/// [`WARPS`] as above. Emulated, [`WARPS`].
/// `key_warps` asks for dK/dV's blocks of that many warps instead, chosen as above where some
/// step of theirs fits (tests and the bench: lavapipe then holds the wide block's rows in
/// registers).
#[allow(clippy::too_many_arguments)]
pub(crate) fn key_step(
    kernel: FragmentKernel,
    head_dim: usize,
    register_columns: usize,
    mma_sync: bool,
    atomic_add: bool,
    stage_rows: bool,
    key_warps: Option<usize>,
    element_bytes: usize,
    shared_limit: usize,
) -> Result<Staging, usize> {
    let streamed = rows_streamed(head_dim, register_columns);
    // (rows staged, dQ summed), in the order tried, for blocks of `warps`.
    let modes = |warps: usize| -> &'static [(bool, bool)] {
        match kernel {
            _ if !stage_rows => &[(false, false)],
            // Where some step's dQ tile splits over the warps ([`Staging::divides`] checks each).
            FragmentKernel::KeyValueGrad if !streamed && atomic_add && query_grad_split(head_dim, warps, MAX_STEP).is_some() => &[(true, true), (true, false), (false, false)],
            FragmentKernel::KeyValueGrad if !streamed => &[(true, false), (false, false)],
            FragmentKernel::Forward if part_width(head_dim, register_columns) == head_dim => &[(true, false), (false, false)],
            _ => &[(false, false)],
        }
    };
    let steps = |warps: usize, modes: &[(bool, bool)]| -> Vec<Staging> {
        let all = modes.iter().flat_map(|&mode| mode_steps(kernel, head_dim, streamed, mma_sync, mode, warps));
        all.filter(|staging| staging.divides(head_dim)).collect()
    };
    let fits = |staging: &Staging| shared_bytes(kernel, head_dim, register_columns, *staging, mma_sync, element_bytes) <= shared_limit;
    // Two blocks an SM, each with the driver's reserve (an SM holds a block's limit and one
    // reserve): the forward's 64-key step fits an H100 twice at head dims 128 (70 KB) and 256
    // (102 KB), an A100 at 128 only; its 32-key step at 256 (51 KB) fits an A100 twice, an L40
    // (99 KB a block) once, so there it takes 16 keys.
    let twice = |staging: &Staging| 2 * (shared_bytes(kernel, head_dim, register_columns, *staging, true, element_bytes) + DRIVER_RESERVED) <= shared_limit + DRIVER_RESERVED;
    let warps = match kernel {
        FragmentKernel::KeyValueGrad => key_warps.unwrap_or(WARPS),
        _ => WARPS,
    };
    let found = if mma_sync {
        // dK/dV's wide block where nothing else is asked for and it takes the mode the block of
        // 4 would take first.
        let wide = match (kernel, key_warps, modes(WARPS)[0]) {
            (FragmentKernel::KeyValueGrad, None, first @ (true, _)) if modes(WIDE_WARPS).contains(&first) => steps(WIDE_WARPS, &[first]).into_iter().find(fits),
            _ => None,
        };
        // Else blocks of `warps`: of 4, twice an SM where they fit so; the wide block is once an
        // SM whatever its shared memory (its registers).
        let asked = steps(warps, modes(warps));
        let twice = |staging: &Staging| warps == WARPS && twice(staging);
        wide.or_else(|| asked.iter().copied().find(twice)).or_else(|| asked.iter().copied().find(fits))
    } else {
        modes(warps).iter().find_map(|&mode| steps(warps, &[mode]).into_iter().find(fits))
    };
    // The smallest step whose copies split over the block's units.
    let candidates = [16, 32, MAX_STEP].map(|keys| Staging { keys, buffers: if mma_sync { 2 } else { 1 }, warps, rows_shared: false, query_grad: false, stores_matrices: false, score_grads_first: false, row_tiles: 1 });
    let smallest = candidates.into_iter().find(|staging| staging.divides(head_dim)).unwrap_or(candidates[0]);
    found.ok_or_else(|| shared_bytes(kernel, head_dim, register_columns, smallest, mma_sync, element_bytes))
}

/// The steps [`key_step`] tries, in order, with dK/dV's rows staged or not and dQ summed or
/// not (`(rows_shared, query_grad)`), in blocks of `warps`.
fn mode_steps(kernel: FragmentKernel, head_dim: usize, streamed: bool, mma_sync: bool, (rows_shared, query_grad): (bool, bool), warps: usize) -> Vec<Staging> {
    let cuda = match (head_dim > 64, kernel) {
        (true, FragmentKernel::Forward) if rows_shared => 32,
        (_, FragmentKernel::KeyValueGrad) if rows_shared && head_dim <= 64 => 64,
        (_, FragmentKernel::KeyValueGrad) if rows_shared => 32,
        (false, FragmentKernel::Forward | FragmentKernel::QueryGrad) => 64,
        (false, FragmentKernel::KeyValueGrad) => 32,
        (true, FragmentKernel::Forward) => 64,
        (true, FragmentKernel::QueryGrad | FragmentKernel::KeyValueGrad) if streamed => 32,
        (true, FragmentKernel::QueryGrad | FragmentKernel::KeyValueGrad) => 16,
    };
    debug_assert!(cuda <= MAX_STEP);
    let keys: Vec<usize> = [cuda, 32, 16].into_iter().filter(|&keys| keys <= cuda).collect();
    let buffer_counts: &[usize] = if mma_sync { &[2] } else { &[2, 1] };
    let row_tiles = if kernel == FragmentKernel::Forward && rows_shared { 2 } else { 1 };
    let step = |(keys, buffers)| Staging { keys, buffers, warps, rows_shared, query_grad, stores_matrices: false, score_grads_first: false, row_tiles };
    if streamed && kernel != FragmentKernel::Forward {
        // The backward's streamed step: CUDA's keys before a second buffer, so that the loop
        // CUDA runs (each chunk read feeding `keys / 8` products) runs here too.
        keys.iter().flat_map(|&keys| buffer_counts.iter().map(move |&buffers| (keys, buffers))).map(step).collect()
    } else {
        buffer_counts.iter().flat_map(|&buffers| keys.iter().map(move |&keys| (keys, buffers))).map(step).collect()
    }
}

/// Shared memory CUDA reserves per block beside a kernel's own.
const DRIVER_RESERVED: usize = 1024;

/// Shared memory of a block: the buffers of its two staged tiles, its staged rows (the
/// forward's Q; dK/dV's K and V) and dS's tile where it has them, and the emulated product's
/// scratch. The forward stages only its part's columns of V; the backward's tiles are read
/// whole by the score products.
fn shared_bytes(kernel: FragmentKernel, head_dim: usize, register_columns: usize, staging: Staging, mma_sync: bool, element_bytes: usize) -> usize {
    let scratch = if mma_sync { 0 } else { staging.warps * SCRATCH_BYTES_PER_WARP };
    let second = if kernel == FragmentKernel::Forward { part_width(head_dim, register_columns) } else { head_dim };
    let tensors = if kernel == FragmentKernel::Forward { 1 } else { 2 };
    let rows = if staging.rows_shared { tensors * staging.block_rows() * (head_dim + PAD) * element_bytes } else { 0 };
    let scores = if staging.query_grad { staging.keys * (staging.block_rows() + PAD) * element_bytes } else { 0 };
    staging.buffers * staging.keys * (head_dim + PAD + second + PAD) * element_bytes + rows + scores + scratch
}

/// The output columns one launch accumulates, keeping `register_columns` (see
/// [`register_columns`]).
pub(crate) fn part_width(head_dim: usize, register_columns: usize) -> usize {
    head_dim.min(register_columns)
}

/// The column parts of an output `head_dim` wide, a launch each.
pub(crate) fn column_parts(head_dim: usize, register_columns: usize) -> Vec<ColumnPart> {
    ColumnPart::cover(head_dim, part_width(head_dim, register_columns)).into_iter().map(|part| part.unwrap_or(ColumnPart::whole(head_dim))).collect()
}

/// Where a block of query rows of one (batch, head) is, the cube's place in the grid.
#[derive(CubeType)]
pub(crate) struct BlockRows {
    pub batch: usize,
    /// `batch · q_heads + head`: the row of the `[B, Hq, Sq]` tensors (lse, D) times `Sq`.
    pub head_index: usize,
    /// Where its head starts in the `[B, Hq, Sq, D]` tensors, and its key/value head in K and V.
    pub q_base: usize,
    pub kv_base: usize,
    pub first_row: usize,
    /// This warp's first row: this lane's two rows of each of its row tiles are
    /// `row0 + 16 · tile + lane / 4` and 8 below.
    pub row0: usize,
}

/// The cube's block (see [`BlockRows`]) of a call with `batch` sequences of `q_heads` heads of
/// `seq_q` queries and `kv_heads` of `seq_kv` keys, `staging`'s rows a block and 16-row tiles a
/// warp; the longest blocks first where `causal` ([`cube_place`]).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_rows(
    batch: usize,
    q_heads: usize,
    seq_q: usize,
    kv_heads: usize,
    seq_kv: usize,
    #[comptime] head_dim: usize,
    #[comptime] staging: Staging,
    #[comptime] causal: bool,
) -> BlockRows {
    let (rows, row_tiles) = comptime!((staging.block_rows(), staging.row_tiles));
    // A query block's causal work grows with its place.
    let place = cube_place(batch, q_heads, seq_q.div_ceil(rows), causal, true);
    let head_index = place.batch * q_heads + place.head;
    let kv_head = place.head / (q_heads / kv_heads);
    let first_row = place.block * rows;
    BlockRows {
        batch: place.batch,
        head_index,
        q_base: head_index * seq_q * head_dim,
        kv_base: (place.batch * kv_heads + kv_head) * seq_kv * head_dim,
        first_row,
        row0: first_row + (UNIT_POS as usize / 32) * comptime!(16 * row_tiles),
    }
}

/// `buffers` buffers of a step's `keys` rows of `width` values (padded: [`PAD`]), 16-byte
/// aligned for `cp.async` and `ldmatrix`: a step's tiles arrive in one while the step before
/// computes on the other.
#[cube]
pub(crate) fn step_tiles<E: Float>(#[comptime] staging: Staging, #[comptime] width: usize) -> SharedMemory<E> {
    SharedMemory::<E>::new_aligned(comptime!(staging.buffers * staging.keys * (width + PAD)), 16usize)
}

/// Where buffer `buffer` of a tile of `keys` rows of `width` values starts.
#[cube]
fn buffer_start(buffer: usize, #[comptime] keys: usize, #[comptime] width: usize) -> usize {
    buffer * comptime!(keys * (width + PAD))
}

/// The keys (queries for dK/dV) a block's loop visits: `steps` steps from `start`.
#[derive(CubeType)]
pub(crate) struct KeySpan {
    pub start: usize,
    pub steps: usize,
}

/// The keys the block of `rows` query rows from `first` sees together or, `of_keys`, the
/// queries that see some of the block of keys from `first`, from an even one: without ranges
/// the causal bound; with, the span of its rows' (keys') runs (each unit reads them all, once).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_span(
    ranges: &Tensor<u32>,
    batch: usize,
    first: usize,
    seq_q: usize,
    seq_kv: usize,
    #[comptime] rows: usize,
    #[comptime] per_step: usize,
    #[comptime] of_keys: bool,
    #[comptime] causal: bool,
    #[comptime] ranged: bool,
) -> KeySpan {
    let mut start = 0usize;
    let mut end = seq_q;
    if of_keys {
        if causal {
            start = first_row_seeing(first, seq_q, seq_kv);
        }
    } else {
        end = keys_seen_by_rows(first, rows, seq_q, seq_kv, causal);
    }
    if ranged {
        start = seq_q + seq_kv;
        end = 0usize;
        for r in 0..rows {
            let run = visible_run(ranges, batch, first + r, seq_q, seq_kv, of_keys, ranged, causal);
            if run.start < run.end {
                start = min(start, run.start);
                end = max(end, run.end);
            }
        }
    }
    if of_keys {
        // dK/dV reads two query columns' statistics in one load from an even query
        // (`fragment_key_value_grad::row_statistics_kernel`); the column before, seen by
        // none of the block's keys, is masked.
        start = start / 2 * 2;
    }
    let mut steps = 0usize;
    if end > start {
        steps = (end - start).div_ceil(per_step);
    }
    KeySpan { start, steps }
}

/// Where this lane's two rows of a warp's 16 from `row0` (`row0 + lane / 4` and 8 below) start
/// in a tensor of `stride` values a row from `base`, and whether each is one of its `rows` (a
/// row past them reads as 0 and is not written). Computed once and shared by the loads of
/// streamed rows and the store of the gradient of the same shape: with 64-bit indices each
/// offset is two registers, and ptxas spilled a second copy kept for the store (sm_90a, head
/// dim 128: 4-20 bytes at 72-128 registers, to stay under an occupancy step). (dK/dV with its
/// rows staged streams none, and places its store again after its loop, so that the place is
/// not kept through it: kept, ptxas spilled it there at head dim 128, 2026-11-30.)
#[derive(CubeType)]
pub(crate) struct RowPlace {
    pub low: usize,
    pub high: usize,
    pub low_inside: bool,
    pub high_inside: bool,
}

/// The [`RowPlace`] of this lane's rows of the 16 from `row0`.
#[cube]
pub(crate) fn row_place(base: usize, row0: usize, rows: usize, #[comptime] stride: usize) -> RowPlace {
    let low = row0 + lane() / 4;
    let (low_inside, high_inside) = (low < rows, low + 8 < rows);
    // A row outside is placed at the head's first, so that reads of it (discarded) stay in
    // bounds without the launch's check; nothing is stored there.
    RowPlace { low: base + select(low_inside, low, 0usize) * stride, high: base + select(high_inside, low + 8, 0usize) * stride, low_inside, high_inside }
}

/// This lane's A fragments of its rows `place` of `source`, columns `first..first + width`
/// (within the head dim), one per 16 columns; rows outside read as 0. `streamed`: read in the
/// loop, each step, without the launch's bounds check (in bounds: `row_place`); the fragments
/// held for the whole loop keep it, read once: unchecked there, ptxas spilled 8–200 bytes of
/// dQ and dK/dV before their loops on sm_80 and sm_89 (2026-11-29).
#[cube]
pub(crate) fn load_row_fragments<E: Float>(source: &Tensor<E>, place: &RowPlace, first: usize, #[comptime] width: usize, #[comptime] streamed: bool, #[comptime] unrolled: bool) -> Array<E> {
    let t = lane() % 4;
    let chunks = width / 16;
    let mut fragments = Array::<E>::new(chunks * A_VALUES);
    #[unroll(unrolled)]
    for chunk in 0..chunks {
        #[unroll]
        for i in 0..A_VALUES {
            let high = (i / 2) % 2 == 1;
            let inside = (high && place.high_inside) || (!high && place.low_inside);
            let column = first + chunk * 16 + 2 * t + i % 2 + 8 * (i / 4);
            let at = select(high, place.high, place.low) + column;
            let value = if comptime!(streamed) { unsafe { *source.index_unchecked(at) } } else { source[at] };
            fragments[chunk * A_VALUES + i] = select(inside, value, E::from_int(0));
        }
    }
    fragments
}

/// A warp's 16 rows from `row0` of a `[.., rows, head_dim]` tensor (from `base`) as the A
/// operand of the score products ([`times_tile_transposed`]): their fragments kept in
/// registers up to `held_columns` columns, else read from the tensor 16 columns at a time
/// as each product needs them (`fragments` then unused); `place` this lane's rows.
#[derive(CubeType)]
pub(crate) struct RowOperand<E: Float> {
    pub fragments: Array<E>,
    pub place: RowPlace,
}

/// The [`RowOperand`] of the 16 rows from `row0` of `source`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn row_operand<E: Float>(
    source: &Tensor<E>,
    base: usize,
    row0: usize,
    rows: usize,
    #[comptime] head_dim: usize,
    #[comptime] held_columns: usize,
    #[comptime] unrolled: bool,
) -> RowOperand<E> {
    let place = row_place(base, row0, rows, head_dim);
    let fragments = if comptime!(!rows_streamed(head_dim, held_columns)) {
        load_row_fragments::<E>(source, &place, 0usize, head_dim, false, unrolled)
    } else {
        Array::<E>::new(1usize)
    };
    RowOperand::<E> { fragments, place }
}

/// `count` zeros.
#[cube]
pub(crate) fn zeros(#[comptime] count: usize) -> Array<f32> {
    let mut values = Array::<f32>::new(count);
    #[unroll]
    for i in 0..count {
        values[i] = 0.0;
    }
    values
}

/// `values` rounded to `E`: accumulators (P, dS) taken as the A fragments of the next product.
#[cube]
pub(crate) fn rounded<E: Float>(values: &Array<f32>, #[comptime] count: usize) -> Array<E> {
    let mut out = Array::<E>::new(count);
    #[unroll]
    for i in 0..count {
        out[i] = E::cast_from(values[i]);
    }
    out
}

/// Writes this warp's 16 rows of accumulators (`part.width / 8` tiles) times `factor` to
/// columns `part` of this lane's rows `place` of `target`, those inside. (The forward writes
/// its own: a factor per row, and the log-sum-exp beside.)
#[cube]
pub(crate) fn store_rows<E: Float>(acc: &Array<f32>, factor: f32, target: &mut Tensor<E>, place: &RowPlace, #[comptime] part: ColumnPart, #[comptime] unrolled: bool) {
    let t = lane() % 4;
    #[unroll]
    for half in 0..2usize {
        let inside = (half == 1 && place.high_inside) || (half == 0 && place.low_inside);
        if inside {
            let start = select(half == 1, place.high, place.low) + comptime!(part.first);
            #[unroll(unrolled)]
            for tile in 0..comptime!(part.width / 8) {
                #[unroll]
                for j in 0..2usize {
                    target[start + tile * 8 + 2 * t + j] = E::cast_from(acc[tile * C_VALUES + 2 * half + j] * factor);
                }
            }
        }
    }
}

/// Columns `columns` of keys `key0..key0 + keys` of `source` (`head_dim` values a key from
/// `base`) into buffer `buffer` of `tiles` (`columns.width + PAD` a key), keys from `seq_kv` on
/// as 0: started, there once the cube's copies have arrived. The cube's units (32 for each of
/// its `warps`) share the copy, 16 bytes each at a time, consecutive units on consecutive bytes.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage_keys<E: Float, M: FragmentMma>(
    source: &Tensor<E>,
    base: usize,
    key0: usize,
    seq_kv: usize,
    tiles: &mut SharedMemory<E>,
    buffer: usize,
    #[comptime] keys: usize,
    #[comptime] warps: usize,
    #[comptime] head_dim: usize,
    #[comptime] columns: ColumnPart,
    #[comptime] unrolled: bool,
) {
    let width = comptime!(columns.width);
    let chunks_per_key = comptime!(width / 8);
    let units = comptime!(32 * warps);
    let per_unit = comptime!(keys * chunks_per_key / units);
    let start = buffer_start(buffer, keys, width);
    // A unit's copies are `units` chunks apart: a key's chunks (8, 16 or 32: widths 64 to 256)
    // divide them, so they are `keys_apart` keys apart in the same chunk.
    let keys_apart = comptime! {
        assert!(units % chunks_per_key == 0, "a key's {chunks_per_key} chunks of 8 values must divide the cube's {units} units");
        assert!((keys * chunks_per_key) % units == 0, "{keys} keys of {chunks_per_key} chunks must split evenly over the cube's {units} units (Staging::divides)");
        units / chunks_per_key
    };
    if key0 + keys <= seq_kv {
        // A whole step (the cube branches together): one place computed, the copies at
        // constant offsets from it, no key checked. Per copy that leaves the global address
        // (an add and a wide multiply-add: 32-bit indices) and a constant in LDGSTS's shared
        // one (sm_90a, the forward's 64-key step at head dim 128: 107 instructions -> 82, and
        // 61 with the vendored cubecl-cpp's 32-bit shared addresses).
        let (key, chunk) = (UNIT_POS as usize / chunks_per_key, UNIT_POS as usize % chunks_per_key);
        let from = base + (key0 + key) * head_dim + comptime!(columns.first) + 8 * chunk;
        let to = start + key * (width + PAD) + 8 * chunk;
        #[unroll(unrolled)]
        for i in 0..per_unit {
            M::copy_eight::<E>(source, from + i * comptime!(keys_apart * head_dim), true, tiles, to + i * comptime!(keys_apart * (width + PAD)));
        }
    } else {
        #[unroll(unrolled)]
        for i in 0..per_unit {
            let at = UNIT_POS as usize + units * i;
            let (key, chunk) = (at / chunks_per_key, at % chunks_per_key);
            let from = base + (key0 + key) * head_dim + comptime!(columns.first) + 8 * chunk;
            M::copy_eight::<E>(source, from, key0 + key < seq_kv, tiles, start + key * (width + PAD) + 8 * chunk);
        }
    }
}

/// `out += a · tileᵀ` over a step: `a` a warp's 16 rows × `head_dim` of `source` (see
/// [`RowOperand`]), `tile` buffer `buffer` of a step's `keys` rows of `head_dim`; `out` its
/// 16 × `keys` products, `keys / 8` accumulator tiles. Four matrices of 8 keys × 8 dims side by
/// side are the B fragments of two 16-column chunks (S = Q·Kᵀ, dP = dO·Vᵀ); read rows take one
/// chunk at a time (two matrices). Each product sums its 16-column chunks in order, kept or read.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn times_tile_transposed<E: Float, M: FragmentMma>(
    a: &RowOperand<E>,
    source: &Tensor<E>,
    tile: &SharedMemory<E>,
    buffer: usize,
    out: &mut Array<f32>,
    scratch: &mut SharedMemory<f32>,
    #[comptime] keys: usize,
    #[comptime] head_dim: usize,
    #[comptime] held_columns: usize,
    #[comptime] unrolled: bool,
) {
    let stride = comptime!(head_dim + PAD);
    let start = buffer_start(buffer, keys, head_dim);
    if comptime!(!rows_streamed(head_dim, held_columns)) {
        #[unroll(unrolled)]
        for n_tile in 0..keys / 8 {
            #[unroll(unrolled)]
            for pair in 0..head_dim / 32 {
                let b = M::load_matrices::<E>(tile, start + 8 * n_tile * stride + 32 * pair, stride, 4usize, 1usize, false);
                M::mma::<E>(&a.fragments, 2 * pair * A_VALUES, &b, 0usize, out, n_tile * C_VALUES, scratch);
                M::mma::<E>(&a.fragments, (2 * pair + 1) * A_VALUES, &b, B_VALUES, out, n_tile * C_VALUES, scratch);
            }
        }
    } else {
        // A loop over 16-column chunks, even on CUDA: unrolled, the compiler would hoist every
        // chunk's global loads to the top and hold the whole rows again (dQ and dK spilled at
        // 255 registers); over 32-column pairs one dK/dV variant still spilled 8 B on sm_90a.
        for chunk in 0..head_dim / 16 {
            let a_chunk = load_row_fragments::<E>(source, &a.place, 16 * chunk, 16usize, true, unrolled);
            #[unroll(unrolled)]
            for n_tile in 0..keys / 8 {
                let b = M::load_matrices::<E>(tile, start + 8 * n_tile * stride + 16 * chunk, stride, 2usize, 1usize, false);
                M::mma::<E>(&a_chunk, 0usize, &b, 0usize, out, n_tile * C_VALUES, scratch);
            }
        }
    }
}

/// A block's own `rows` rows of `head_dim` (the forward's Q; dK/dV's K and V:
/// [`Staging::rows_shared`]) in shared memory, padded as the step's tiles are; a placeholder of
/// one value where they are not staged (`shared` false).
#[cube]
pub(crate) fn rows_tile<E: Float>(#[comptime] shared: bool, #[comptime] rows: usize, #[comptime] head_dim: usize) -> SharedMemory<E> {
    let values = comptime!(if shared { rows * (head_dim + PAD) } else { 1 });
    SharedMemory::<E>::new_aligned(values, 16usize)
}

/// `out += rows · tileᵀ` over a step, as [`times_tile_transposed`] with its rows kept in
/// registers, but the warp's `row_tiles` tiles of 16 rows read from `rows` (a [`rows_tile`],
/// this warp's from `16 · row_tiles · warp`) as A fragments, one `ldmatrix` of four matrices
/// per 16-column chunk, two chunks at a time; each B fragment read feeds every row tile's
/// product. `out` holds each row tile's `keys / 8` accumulator tiles after the one before.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn times_rows_transposed<E: Float, M: FragmentMma>(
    rows: &SharedMemory<E>,
    tile: &SharedMemory<E>,
    buffer: usize,
    out: &mut Array<f32>,
    scratch: &mut SharedMemory<f32>,
    #[comptime] keys: usize,
    #[comptime] head_dim: usize,
    #[comptime] row_tiles: usize,
    #[comptime] unrolled: bool,
) {
    let stride = comptime!(head_dim + PAD);
    let start = buffer_start(buffer, keys, head_dim);
    let warp_rows = (UNIT_POS as usize / 32) * comptime!(16 * row_tiles * stride);
    let out_per_tile = comptime!(keys / 8 * C_VALUES);
    #[unroll(unrolled)]
    for pair in 0..head_dim / 32 {
        // Each row tile's A fragments of the pair's two chunks, side by side: matrices
        // (rows 0-7, 8-15) × (columns 0-7, 8-15), the A fragment's order.
        let mut a = Array::<E>::new(comptime!(row_tiles * 2 * A_VALUES));
        #[unroll(unrolled)]
        for row_tile in 0..row_tiles {
            let at = warp_rows + row_tile * comptime!(16 * stride) + 32 * pair;
            let low = M::load_matrices::<E>(rows, at, stride, 4usize, 2usize, false);
            let high = M::load_matrices::<E>(rows, at + 16, stride, 4usize, 2usize, false);
            #[unroll]
            for i in 0..A_VALUES {
                a[2 * row_tile * A_VALUES + i] = low[i];
                a[(2 * row_tile + 1) * A_VALUES + i] = high[i];
            }
        }
        #[unroll(unrolled)]
        for n_tile in 0..keys / 8 {
            let b = M::load_matrices::<E>(tile, start + 8 * n_tile * stride + 32 * pair, stride, 4usize, 1usize, false);
            #[unroll(unrolled)]
            for row_tile in 0..row_tiles {
                let c_at = row_tile * out_per_tile + n_tile * C_VALUES;
                M::mma::<E>(&a, 2 * row_tile * A_VALUES, &b, 0usize, out, c_at, scratch);
                M::mma::<E>(&a, (2 * row_tile + 1) * A_VALUES, &b, B_VALUES, out, c_at, scratch);
            }
        }
    }
}

/// `acc += p · tile[:, part]` over a step: `p` this warp's `row_tiles` tiles of 16 rows ×
/// `keys` as A fragments (each the accumulators of `keys / 8` score tiles, rounded:
/// `crate::mma`), `tile` buffer `buffer` of a step's `keys` rows of `width` values; `acc` their
/// 16 × `part.width` accumulators, a row tile's after the one before. The tile's matrices
/// transposed, two above each other per output tile, are its B fragments (O += P·V,
/// dQ += dS·K), each read once for every row tile.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn times_tile<E: Float, M: FragmentMma>(
    p: &Array<E>,
    tile: &SharedMemory<E>,
    buffer: usize,
    acc: &mut Array<f32>,
    scratch: &mut SharedMemory<f32>,
    #[comptime] keys: usize,
    #[comptime] width: usize,
    #[comptime] part: ColumnPart,
    #[comptime] row_tiles: usize,
    #[comptime] unrolled: bool,
) {
    let stride = comptime!(width + PAD);
    let start = buffer_start(buffer, keys, width) + comptime!(part.first);
    let p_per_tile = comptime!(keys / 8 * C_VALUES);
    let acc_per_tile = comptime!(part.width / 8 * C_VALUES);
    #[unroll(unrolled)]
    for chunk in 0..keys / 16 {
        #[unroll(unrolled)]
        for pair in 0..comptime!(part.width / 16) {
            let b = M::load_matrices::<E>(tile, start + 16 * chunk * stride + 16 * pair, stride, 4usize, 2usize, true);
            #[unroll(unrolled)]
            for row_tile in 0..row_tiles {
                let p_at = row_tile * p_per_tile + chunk * A_VALUES;
                let acc_at = row_tile * acc_per_tile + 2 * pair * C_VALUES;
                M::mma::<E>(p, p_at, &b, 0usize, acc, acc_at, scratch);
                M::mma::<E>(p, p_at, &b, B_VALUES, acc, acc_at + C_VALUES, scratch);
            }
        }
    }
}

/// Waits for step `step`'s tiles of `span` and, double-buffered, starts copying the next
/// step's into the other buffer (every warp is then done with the step before, whose buffer it
/// reuses); single-buffered, first waits for every warp to be done with the step before, then
/// copies this step's. Gives this step's buffer. Step 0's copies are started by
/// [`stage_step`] before the loop.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn next_step<E: Float, M: FragmentMma>(
    k: &Tensor<E>,
    v: &Tensor<E>,
    kv_base: usize,
    span: &KeySpan,
    step: usize,
    seq_kv: usize,
    k_tiles: &mut SharedMemory<E>,
    v_tiles: &mut SharedMemory<E>,
    copies: &mut M::Copies,
    #[comptime] staging: Staging,
    #[comptime] head_dim: usize,
    #[comptime] v_columns: ColumnPart,
    #[comptime] unrolled: bool,
) -> usize {
    let keys = comptime!(staging.keys);
    let mut buffer = 0usize;
    if comptime!(staging.buffers == 2) {
        M::copies_arrived(copies);
        if step + 1 < span.steps {
            stage_step::<E, M>(k, v, kv_base, span.start + (step + 1) * keys, seq_kv, k_tiles, v_tiles, (step + 1) % 2, keys, staging.warps, head_dim, v_columns, unrolled);
        }
        buffer = step % 2;
    } else {
        if step > 0 {
            // No copy is in flight: this waits for the cube alone.
            M::copies_arrived(copies);
            stage_step::<E, M>(k, v, kv_base, span.start + step * keys, seq_kv, k_tiles, v_tiles, 0usize, keys, staging.warps, head_dim, v_columns, unrolled);
        }
        M::copies_arrived(copies);
    }
    buffer
}

/// Starts copying the step from `key0`'s K (every column) and V (columns `v_columns`) tiles
/// into buffer `buffer` of `k_tiles` and `v_tiles` (see [`stage_keys`]).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage_step<E: Float, M: FragmentMma>(
    k: &Tensor<E>,
    v: &Tensor<E>,
    kv_base: usize,
    key0: usize,
    seq_kv: usize,
    k_tiles: &mut SharedMemory<E>,
    v_tiles: &mut SharedMemory<E>,
    buffer: usize,
    #[comptime] keys: usize,
    #[comptime] warps: usize,
    #[comptime] head_dim: usize,
    #[comptime] v_columns: ColumnPart,
    #[comptime] unrolled: bool,
) {
    stage_keys::<E, M>(k, kv_base, key0, seq_kv, k_tiles, buffer, keys, warps, head_dim, comptime!(ColumnPart::whole(head_dim)), unrolled);
    stage_keys::<E, M>(v, kv_base, key0, seq_kv, v_tiles, buffer, keys, warps, head_dim, v_columns, unrolled);
}
