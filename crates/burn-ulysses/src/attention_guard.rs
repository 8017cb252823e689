//! The guard against attention done by hand: `UlyssesBackend` refuses, inside a group that
//! spreads each sequence over several ranks, a matmul shaped like the scores of a rank's shard
//! against itself, or like those scores' weights applied to values.
//!
//! A model that calls `burn::tensor::module::attention` is sequence parallel under
//! `UlyssesBackend`; one that multiplies `q·kᵀ` itself (burn-nn's `MultiHeadAttention`, most
//! hand-written Llamas) would run without a word while every rank attended only within its
//! shard. The guard goes by shape alone, so it does not matter how the data was sharded
//! (the project's sharder, `narrow`, a loader of the user's own):
//! - both operands are per-(batch, head) activations: 3-D or more, more than one matrix in
//!   all (`[B, H, ..]`, or heads folded into the batch, `[B·H, ..]`), the same leading dims
//!   except that either may be broadcast past the first (grouped kv heads,
//!   `[B, Hkv, G, ..] · [B, Hkv, 1, ..]`, or `[B, 1, ..] · [B, H, ..]` where the keys or
//!   values come first);
//! - and the product is self-attention's over two tokens or more: `[.., n, d] · [.., d, n]`
//!   (scores, square result, `d ≥ 2`: a per-token outer product contracts one),
//!   `[.., n, n] · [.., n, d]` (weights times values, square left operand, not broadcast) or
//!   `[.., d, n] · [.., n, n]` (the same transposed, `vᵀ·wᵀ`, square right operand, not
//!   broadcast: a `d × d` weight shared over the heads is no attention), `n ≥ 2` (a per-token
//!   dot product, `1 × 1`, is not attention).
//!
//! Quantized operands (an int8 key/value cache) take burn's `q_matmul`, and integer ones
//! (attention quantized by hand) `int_matmul`, guarded alike.
//!
//! A linear layer never matches: its weight is broadcast over batch and heads (leading dims 1),
//! and burn routes it through `ModuleOps::linear`, which the decorator forwards untouched.
//! Nor do the attention op's own products, the ring's blocks or any backward: they run on the
//! inner backend.
//!
//! Products that are not square, a group's query heads folded into rows (`q` as
//! `[B, Hkv, G·n, d]`), queries in chunks, latents or a pooling query attending to the shard,
//! cannot be told from cross-attention's by shape. The length of the token ids this thread
//! last embedded (`module::embedding`: the rank's shard, however it was cut) tells them apart:
//! a product of whole per-head operands, 4-D or more, that sums over that many tokens (`[.., m,
//! n] · [.., n, d]` with `n` that length: weights times values however the queries come,
//! transposed too, linear attention's `kᵀ·v`) is refused; cross-attention's sums run over its
//! memory. With the heads folded into the batch (3-D `[B·H, r, S]·[B·H, S, d]`, as a stack of
//! experts' `[E, C, f]·[E, f, d]` is) it is where both operands are activations under autodiff,
//! `S` is neither the embedding table's width nor its vocabulary, `r` is not the shard's length
//! and `d` not the model's width (an expert's or a hypernetwork's product gives that width, a
//! head's gives its own); otherwise only where square or a group's folded rows. At
//! batch 1 a head of its own (4-D or more, `[1, 1, n, d]`: a loop over heads) is refused where
//! its scores are the shard's square or it sums over the shard; a 3-D or 2-D matrix there
//! looks as a linear layer does and passes.
//!
//! The rule refuses any such product of whole per-head operands, legitimate or not; a
//! cross-attention whose memory is as long as the shard is the one legitimate product it
//! takes for attention.
//!
//! The lengths noted are forgotten at each backward (the next forward's ids may be of another
//! length) and at each `ulysses_training::evaluate`; a forward that embeds ids of two lengths
//! since (a decoder's and a memory's, or an evaluation loop of one's own over batches of several
//! lengths with no backward between) leaves the rules that go by the length off until the next
//! backward or [`forget_embedded_lengths`].
//!
//! Scores made without a matmul (a broadcast product summed over the head dim) meet the guard
//! at their softmax: `softmax`, `log_softmax` or `softmin` over either of the last two dims of
//! a 4-D or larger tensor whose last two dims are square (`[B, H, n, n]`, more than one matrix,
//! or one whose `n` is the shard's length) is refused; a 3-D `[B, S, V]` of logits never is.
//! So is a scan (`cumsum`, `cumprod`, `cummin`, `cummax`, quantized too) along the sequence
//! dim (`[B, S, ..]`'s dim 1) as long as the token ids last embedded: positions made of a padding mask's cumsum
//! would restart at every rank. And so, where that length shows, are a flip of the sequence
//! dim (each shard reversed in place, not the sequence) and the ops whose windows run along a
//! channels-first `[B, C, L]` tensor's length (the shard's, or up to the window less one
//! longer: burn pads the input itself for a causal convolution) across the shard's edges:
//! `conv1d`, `avg_pool1d` and `max_pool1d` whose windows overlap, pad or straddle two ranks
//! (at a shard's edges they read padding where the neighbouring ranks' tokens are),
//! `conv_transpose1d` whose outputs overlap or are cropped, and `adaptive_avg_pool1d` to
//! another length (to one: a classifier's mean over the shard alone), and an `unfold` of the
//! sequence dim into overlapping windows (local attention's). Windows that tile the shard are
//! right under SP and pass ([`Window`]): a patch embedding, pooling or chunks by a factor that
//! divides the shard (each half of it under a zigzag ring), an upsampling whose kernel is its
//! stride (`max_pool1d_with_indices`' indices are then the shard's, counted from its first
//! token, as any position a rank computes for itself). The lengths they resample the shard to
//! are the shard's too for every rule that goes by its length (a convolution of the sequence
//! pooled by 2 is refused as one of the tokens would be).
//!
//! What shape cannot tell apart stays unguarded: a single 3-D or 2-D matrix (a linear layer's
//! shapes), keys broadcast over the batch, rectangular products of a model that embeds no
//! token ids through `module::embedding` (or embeds more than the shard), extra keys
//! (attention sinks) beside the shard's, shards of one token, and cross-attention. Nor does
//! the guard see other ops that mix the sequence's tokens, each over its shard alone: 2-D
//! convolutions and pooling, 1-D ones over a channels-last `[B, S, C]`, a token shift, `roll`,
//! mean, max or sort over the sequence outside a forward whose positions are noted (below: a
//! sum over a shard is also a loss's, summed over the ranks after), a scan, flip or window
//! along another dim or before the first embedding since a backward (or in the first forward
//! of all).
//!
//! Positions are checked where this thread knows the shard's ([`note_shard_positions`]:
//! `ulysses_training`'s steps and `evaluate` note them around the model's forward): a slice of
//! a table of positions, or an `arange`, over as many tokens as the shard holds but at other
//! positions than its own is refused (RoPE's frequencies or burn-nn's sinusoids sliced from 0,
//! a learned position embedding of `arange(0..len)`); so are positions counted on the host and
//! uploaded, told by their values ([`positions_uploaded`]: ids or a float ramp as long, a table
//! of sinusoids from position 0). A table, by shape: no activation (under
//! autodiff an activation is tracked and no leaf; without autodiff, in `evaluate` and a
//! checkpointed forward's first pass, the shape alone decides), cut along one dim alone, every
//! dim before it of size 1, as long as the sequence over the ranks or longer. Counted from 0, the
//! positions are right on a rank whose shard starts at 0 (rank 0 of contiguous unpacked shards),
//! which runs on; the ranks they are wrong for refuse them (under a zigzag ring or packed
//! documents, every rank). What is as long as the shard but no position goes inside
//! [`not_positions`]. A checkpointed layer's token-wise parts run a tile of the shard's rows at
//! a time ([`note_tile_of_the_shard`]); there a table's rows as many as the tile's (a table as
//! long as the shard or longer) counted from the tile's first row as if it were the shard's
//! (RoPE from 0 in every tile) are refused at any SP degree, wrong on one device as well; under
//! SP, an `arange` as long at other positions than the tile's too. Token shifts and reductions
//! over the tile's tokens (the rules below) are refused there too, at any SP degree: token-wise
//! parts treat each token alone.
//!
//! Inside such a forward (a model's, not the loss's), a slice that drops one to four tokens
//! (at most a quarter of the shard) from either end of its sequence dim is refused too
//! ([`shard_shifted_by_a_slice`]): a token shift, a `roll` by as few (burn builds it of
//! slices), a difference of neighbouring tokens, each missing the neighbouring rank's tokens at
//! the shard's edge; so is a crop that keeps the shard's count of tokens from a sequence a few
//! tokens longer into which `pad` or `cat` put them at another place
//! ([`shard_shifted_by_padding`]: RWKV's shift by padding and cropping), and a slice that keeps
//! a single token ([`token_picked_from_the_shard`]: a reward head's last token, a recurrence
//! run token by token). Outside one (a loss's
//! chunks, a loop of one's own), inside [`not_positions`], and for longer shifts, slices pass
//! unchecked. Refused inside one as well:
//! a reduction of floats, integers, booleans or quantized values, where its maximum lies, or a
//! ranking, over the sequence dim of the shard's length in a tensor whose first dim is the
//! batch's rows ([`reduced_over_the_shard`]: a mean or max pooled over the sequence, a padding
//! mask's count of tokens or its first padding, a sort or top-k of its tokens), never over
//! features or flattened tokens.

use std::{
    cell::{Cell, RefCell},
    marker::PhantomData,
    ops::Range,
    sync::atomic::{AtomicBool, Ordering},
};

use burn::tensor::{
    BoolDType, Device, IntDType, Slice, TensorData, TensorMetadata, TensorPrimitive,
    ops::{BoolTensor, ConvOptions, ConvTransposeOptions, FloatTensor, IntTensor, MaxPool1dWithIndices, QuantizedTensor},
};

use crate::{
    context::{self, Sharding},
    data::{ShardCut, ShardPositions},
    visibility::PositionIds,
    error::UlyssesError,
    capabilities::ExchangeBackend,
};

/// The size of the token × token matrix in a product of these shapes that self-attention
/// makes (scores, or the weights applied to values), or `None`; `shard` the length of the
/// token ids last embedded (0: none), by which query heads folded into rows show; `one_length`
/// whether the thread's last two embeddings were of that length (not a model that embeds two
/// sequences, a decoder's and a memory's, whose products over the memory would look alike).
fn attention_matrix_size(lhs: &[usize], rhs: &[usize], shard: usize, one_length: bool) -> Option<usize> {
    let dims = lhs.len();
    if dims < 3 || rhs.len() != dims {
        return None;
    }
    let (lhs_leading, [m, k]) = lhs.split_at(dims - 2) else { return None };
    let (rhs_leading, [_, n]) = rhs.split_at(dims - 2) else { return None };
    // The batch (first) dim shared; past it, equal or either operand broadcast (kv heads
    // shared by a group, on the left in `k·qᵀ` and `vᵀ·wᵀ`, on the right otherwise).
    let leading = || lhs_leading.iter().zip(rhs_leading);
    let per_head = lhs_leading[0] == rhs_leading[0] && leading().skip(1).all(|(l, r)| l == r || *l == 1 || *r == 1);
    if !per_head {
        return None;
    }
    // Per token: the shard's tokens a leading dim past the batch and none of the matrices' dims
    // as long, each matrix a token's own (hyper-connections' mixing of a token's residual
    // streams `[B, S, n, n]·[B, S, n, d]`, a per-token Gram matrix): nothing crosses tokens.
    if one_length && shard >= 2 && leading().skip(1).any(|(l, r)| *l.max(r) == shard) && ![m, k, n].contains(&&shard) {
        return None;
    }
    // Whether an operand is whole where the other is (the token × token matrix, scores or
    // weights, is never broadcast: a weight shared over the heads is).
    let (lhs_whole, rhs_whole) = (leading().all(|(l, r)| l >= r), leading().all(|(l, r)| r >= l));
    // A sum over the shard's tokens of per-head operands (`[B, H, ..]`, 4-D or more: a stack
    // of experts `[E, C, d]` whose width is the shard's is no attention): weights times values
    // however the queries come (in chunks, latents, one pooling query, transposed), linear
    // attention's `kᵀ·v`.
    let sums_over_the_shard = one_length && dims >= 4 && shard >= 2 && *k == shard && lhs_whole && rhs_whole;
    // A group's query heads folded into rows, `[.., G·n, n]·[.., n, d]`, heads apart or folded
    // into the batch.
    let folded = shard >= 2 && *k == shard && *m > shard && *m % shard == 0 && lhs_whole && rhs_whole;
    if leading().map(|(l, r)| *l.max(r)).product::<usize>() < 2 {
        // One matrix. 3-D or 2-D, a linear layer's shapes at batch 1 (`[1, n, d]·[1, d, f]`);
        // 4-D or more, a head of its own at batch 1 (a loop over heads), known for attention
        // by the shard's length.
        let scores = one_length && shard >= 2 && *m == shard && *n == shard && *k >= 2;
        return (dims >= 4 && (scores || sums_over_the_shard)).then_some(shard);
    }
    if *m >= 2 && m == n && *k >= 2 {
        // Scores, `q·kᵀ` (or `k·qᵀ`), over a head dim of two or more (a per-token outer
        // product contracts one).
        Some(*m)
    } else if *m >= 2 && m == k && lhs_whole {
        // Weights times values.
        Some(*m)
    } else if *k >= 2 && k == n && rhs_whole {
        // Weights times values transposed: vᵀ·wᵀ.
        Some(*k)
    } else if sums_over_the_shard || folded {
        Some(shard)
    } else {
        None
    }
}

thread_local! {
    /// The lengths (last dim) of the token ids this thread last and next-to-last embedded, 0
    /// before any.
    static EMBEDDED_TOKENS: Cell<(usize, usize)> = const { Cell::new((0, 0)) };
    /// The shape `[vocabulary, width]` of the table this thread's tokens were last embedded
    /// with, `[0, 0]` before any: a last dim so long holds features or logits, not tokens.
    static EMBEDDED_TABLE: Cell<[usize; 2]> = const { Cell::new([0, 0]) };
    /// The lengths windows that tile the shard resampled it to since its ids were embedded (a
    /// sequence pooled by 2, pooled again, or upsampled), the latest first; 0: none. Cut as
    /// the tokens were, they are the shard too for the rules that go by its length.
    static RESAMPLED_SHARDS: Cell<[usize; 4]> = const { Cell::new([0; 4]) };
}

/// The lengths this rank's shard of the sequence has in this forward, two tokens or more: the
/// token ids' (where the thread's last two embeddings were of one length) first, then those
/// windows that tiled it resampled it to.
fn shard_lengths() -> impl Iterator<Item = usize> {
    let (shard, one_length) = embedded();
    let lengths = if one_length { RESAMPLED_SHARDS.get() } else { [0; 4] };
    std::iter::once(shard).filter(move |_| one_length).chain(lengths).filter(|&length| length >= 2)
}

/// Whether `length` is one the shard was resampled to by windows that tiled it (a pooled or
/// upsampled stream's tokens).
fn resampled(length: usize) -> bool {
    embedded().1 && RESAMPLED_SHARDS.get().contains(&length) && length >= 2
}

/// Notes `length`, the shard's after windows that tiled it, for the rules that go by its length.
fn note_resampled(length: usize) {
    let mut lengths = RESAMPLED_SHARDS.get();
    if length >= 2 && embedded().0 != length && !lengths.contains(&length) {
        lengths.rotate_right(1);
        lengths[0] = length;
        RESAMPLED_SHARDS.set(lengths);
    }
}

/// The length of the token ids last embedded, and whether the one before was as long (or none);
/// where no ids of two tokens or more were embedded, or two lengths were (ids looked up by
/// `select` from a tied table, a prompt's embedding beside the tokens'), the shard's length from
/// the positions noted for the forward ([`note_shard_positions`]), which says which is the
/// shard: the rules that go by its length then stay on.
/// The shard's length where [`embedded`] knows it (two tokens or more, of one length): the
/// attention op tells the shard's own tokens by it.
pub(crate) fn shard_length() -> Option<usize> {
    let (shard, one_length) = embedded();
    (one_length && shard >= 2).then_some(shard)
}

fn embedded() -> (usize, bool) {
    let (last, before) = EMBEDDED_TOKENS.get();
    let one_length = before == 0 || before == last;
    if last >= 2 && one_length {
        return (last, true);
    }
    match SHARD_POSITIONS.get().filter(|noted| noted.len >= 2) {
        Some(noted) => (noted.len, true),
        None => (last, one_length),
    }
}

/// Forgets the lengths embedded so far: a backward ends a forward, and the next one's token ids
/// may be of another length (dynamic padding) without two sequences in one forward, which the
/// rules that go by the length would take it for, and stop.
pub fn forget_embedded_lengths() {
    EMBEDDED_TOKENS.set((0, 0));
    RESAMPLED_SHARDS.set([0; 4]);
}

/// Forgets the table the last tokens were embedded with, as a step or an evaluation begins or
/// ends: the next model may embed no ids (features, patches), and another's width would stand
/// for its own. Not at a backward: layer checkpointing's recompute, after the head's backward,
/// goes by the table its first pass embedded with.
pub fn forget_embedded_table() {
    EMBEDDED_TABLE.set([0, 0]);
}

/// Forgets all the last forward embedded, its lengths and its table: an evaluation's, which no
/// backward ends, as it begins and ends.
pub fn forget_embedded() {
    forget_embedded_lengths();
    forget_embedded_table();
}

/// Why sequence-parallel attention over a query of `q_shape` (`[B, H, S, D]` as burn takes it)
/// is refused as one whose heads and tokens are swapped ([`ulysses_core::layout::heads_and_tokens_swapped`]),
/// or `None`: where the shard's length is known (the token ids embedded, or the positions noted).
pub fn heads_and_tokens_swapped(q_shape: &[usize]) -> Option<UlyssesError> {
    let (shard, one_length) = embedded();
    if !GUARD_ON.load(Ordering::Relaxed) || !one_length {
        return None;
    }
    ulysses_core::layout::heads_and_tokens_swapped(q_shape, &[shard])
}

/// Why sequence-parallel attention over a query of `q_shape` and keys of `k_shape` is refused
/// as chunks of the shard folded into the batch ([`ulysses_core::layout::chunks_folded_into_the_batch`]),
/// or `None`: inside a forward whose positions are noted (its rows, and the shard's lengths).
pub fn chunks_folded_into_the_batch(q_shape: &[usize], k_shape: &[usize]) -> Option<UlyssesError> {
    let noted = SHARD_POSITIONS.get().filter(|noted| noted.tile.is_none())?;
    if !GUARD_ON.load(Ordering::Relaxed) {
        return None;
    }
    let shards: Vec<[usize; 2]> = shard_lengths().map(|length| [noted.rows, length]).collect();
    let fix = "attend over the whole shard with a mask or a sliding window (burn_ulysses::attention::attention_within), or run the blocks \
               on one rank (burn_ulysses::context::enter_single_device())";
    ulysses_core::layout::chunks_folded_into_the_batch(q_shape, k_shape, &shards, fix)
}

/// Why packed documents' position ids handed to sequence-parallel attention
/// (`attention_in_documents`, `attention_within`) are refused, or `None`: inside a forward whose
/// positions are noted, ids of the shard's shape whose first or last is not the noted shard's:
/// ids counted within the shard (`0..S` on every rank), which would make every shard's edge a
/// document's, so that each shard attends within itself alone (a silently wrong result).
pub fn documents_not_the_shards(positions: &PositionIds, sharding: Option<Sharding>) -> Option<UlyssesError> {
    let noted = SHARD_POSITIONS.get().filter(|noted| noted.tile.is_none() && noted.rows == positions.batch() && noted.len == positions.len())?;
    let ends = (positions.ids().first().copied().unwrap_or(0), positions.ids().last().copied().unwrap_or(0));
    if ends == noted.ends {
        return None;
    }
    refusing(sharding)?;
    Some(UlyssesError::Shape(format!(
        "the position ids handed to attention run from {} to {}, where this rank's shard's run from {} to {} ({}): ids counted \
         within the shard would end a document at every shard's edge, each rank attending within its shard alone. Give attention the \
         shard's own ids, SequenceShard::positions.ids (as the training API hands them to the model)",
        ends.0,
        ends.1,
        noted.ends.0,
        noted.ends.1,
        noted.held()
    )))
}

/// The refusal of attention in a forward over a shard of sequences that the rank context
/// (`sharding`: none outside any context) does not hold: one spread over another number of
/// ranks (a loop of one's own that sharded its data but entered no context on the forward's
/// thread, or entered the world's communicator under data parallelism), or another shard of
/// as many, or cut in other runs (a zigzag ring's shards in a plain group, the DP group where
/// it is as large). Each rank would attend within its shard, across replicas, or over shards
/// joined out of order, without a word. Inside `enter_single_device` the model chose one
/// device (a whole sequence gathered) and nothing is refused; nor with the guard off
/// (`set_guard`).
pub fn shard_outside_its_group(sharding: Option<Sharding>) -> Option<UlyssesError> {
    if !GUARD_ON.load(Ordering::Relaxed) || context::single_device_entered() {
        return None;
    }
    let cut = SHARD_POSITIONS.get()?.cut;
    let context = sharding.map_or(ShardCut::WHOLE, |sharding| ShardCut { of: sharding.ranks, index: sharding.shard, runs: sharding.runs });
    match (cut.of, context) {
        (1, _) => None,
        (spread_over, context) if context.of != spread_over => Some(UlyssesError::ShardOutsideItsGroup { spread_over, context_ranks: context.of }),
        (_, context) if context != cut => Some(UlyssesError::ShardOfAnotherRank {
            spread_over: cut.of,
            shard: cut.index,
            runs: cut.runs,
            context_shard: context.index,
            context_runs: context.runs,
        }),
        _ => None,
    }
}

/// `UlyssesBackend`'s embedding: the inner backend's, noting the length of the token ids for
/// the guard (a rank's shard, however the data was cut). Ids of one token a row (a timestep's
/// or a label's embedding, `[B, 1]`) are no sequence and leave the length noted.
pub fn embedding_noting_length<X: ExchangeBackend>(weights: FloatTensor<X>, indices: IntTensor<X>) -> FloatTensor<X> {
    if let Some(&length) = indices.shape().last().filter(|&&length| length >= 2) {
        let last = EMBEDDED_TOKENS.get().0;
        if last != length {
            RESAMPLED_SHARDS.set([0; 4]);
        }
        EMBEDDED_TOKENS.set((length, last));
        if let [vocabulary, width] = weights.shape().as_slice() {
            EMBEDDED_TABLE.set([*vocabulary, *width]);
        }
    }
    X::embedding(weights, indices)
}

/// Why a matmul of these shapes is refused, or `None`: `sharding` the rank context's.
pub fn attention_by_hand(lhs: &[usize], rhs: &[usize], sharding: Option<Sharding>) -> Option<UlyssesError> {
    let (shard, one_length) = embedded();
    refusal(lhs, rhs, attention_matrix_size(lhs, rhs, shard, one_length)?, sharding)
}

/// The refusal of a product whose shapes make a `tokens × tokens` attention matrix, unless
/// `sharding` spreads no sequence or the model opted out.
fn refusal(lhs: &[usize], rhs: &[usize], tokens: usize, sharding: Option<Sharding>) -> Option<UlyssesError> {
    let sharding = spreads_sequences(sharding)?;
    Some(UlyssesError::AttentionByHand { lhs: lhs.to_vec(), rhs: rhs.to_vec(), tokens, ranks: sharding.ranks })
}

/// `sharding` where it spreads each sequence over several ranks and the model did not opt out
/// of the guard: where the guard refuses.
fn spreads_sequences(sharding: Option<Sharding>) -> Option<Sharding> {
    sharding.filter(|s| s.ranks > 1 && !s.shard_local_attention_on_purpose)
}

static GUARD_ON: AtomicBool = AtomicBool::new(true);

/// Turns the guard on or off for the whole process: for measuring what it costs
/// (`cargo bench --bench matmul_guard`), never for a model. A model
/// that attends within each shard on purpose sets
/// [`UlyssesConfig::shard_local_attention_on_purpose`](crate::UlyssesConfig) instead.
pub fn set_guard(on: bool) {
    GUARD_ON.store(on, Ordering::Relaxed);
}

/// The shard's length where `lhs · rhs` is a sum over the shard's tokens with the heads folded
/// into the batch, 3-D `[B·H, r, S] · [B·H, S, d]` (linear attention's `kᵀ·v`, a Perceiver's
/// latents' weights times values: `d` a head's), or `None`. The caller asks only of two
/// activations. A stack of experts `[E, C, f] · [E, f, d]` looks alike where `f` is the shard's
/// length, its weights cast or stacked (activations then), but gives the model's width `d`,
/// as a hypernetwork's per-example weights do; rows as many as the shard's tokens are a
/// token-wise product's (scores by a head dim as long are the square rule's). Nor is `S` the
/// embedding table's width or vocabulary (features).
fn folded_heads_summed_over_the_shard(lhs: &[usize], rhs: &[usize], shard: usize, one_length: bool) -> Option<usize> {
    let ([lhs_batch, rows, k], [rhs_batch, _, d]) = (<[usize; 3]>::try_from(lhs).ok()?, <[usize; 3]>::try_from(rhs).ok()?);
    let [vocabulary, width] = EMBEDDED_TABLE.get();
    let per_head = width != 0 && d != width && rows != shard && k != vocabulary && k != width;
    (one_length && shard >= 2 && k == shard && lhs_batch == rhs_batch && lhs_batch >= 2 && per_head).then_some(shard)
}

/// Panics with the refusal where a product of these shapes is attention by hand under SP;
/// `activations`: whether both operands are activations autodiff tracks (no parameter).
fn refuse_attention_by_hand(lhs_shape: &[usize], rhs_shape: &[usize], activations: impl FnOnce() -> bool) {
    // The shape test first: most matmuls end there, before any lookup.
    let (shard, one_length) = embedded();
    let summed = || folded_heads_summed_over_the_shard(lhs_shape, rhs_shape, shard, one_length).filter(|_| activations());
    if let Some(tokens) = attention_matrix_size(lhs_shape, rhs_shape, shard, one_length).or_else(summed)
        && GUARD_ON.load(Ordering::Relaxed)
    {
        let sharding = context::current_sharding();
        refuse(shard_outside_its_group(sharding).or_else(|| refusal(lhs_shape, rhs_shape, tokens, sharding)));
    }
}

/// `UlyssesBackend`'s matmul: the inner backend's, after the guard.
pub fn guarded_matmul<X: ExchangeBackend>(lhs: FloatTensor<X>, rhs: FloatTensor<X>) -> FloatTensor<X> {
    let activation = |tensor: &FloatTensor<X>| X::is_tracked(tensor) && !X::float_is_require_grad(tensor);
    refuse_attention_by_hand(&lhs.shape(), &rhs.shape(), || activation(&lhs) && activation(&rhs));
    X::float_matmul(lhs, rhs)
}

/// `UlyssesBackend`'s integer matmul: the inner backend's, after the guard.
pub fn guarded_int_matmul<X: ExchangeBackend>(lhs: IntTensor<X>, rhs: IntTensor<X>) -> IntTensor<X> {
    refuse_attention_by_hand(&lhs.shape(), &rhs.shape(), || false);
    X::int_matmul(lhs, rhs)
}

/// `UlyssesBackend`'s matmul where an operand is quantized: the inner backend's, after the
/// guard.
pub fn guarded_q_matmul<X: ExchangeBackend>(lhs: TensorPrimitive<X>, rhs: TensorPrimitive<X>) -> TensorPrimitive<X> {
    refuse_attention_by_hand(&lhs.shape(), &rhs.shape(), || false);
    X::q_matmul(lhs, rhs)
}

/// The size of the token × token matrix whose rows (or columns) a softmax over `dim` of
/// `shape` normalises where it is attention's weights, however the scores were made (a
/// broadcast product summed, `(q·k).sum_dim`, with no matmul to refuse), or `None`: 4-D or
/// more (`[B, H, n, n]`; a 3-D `[B, S, V]` of logits whose vocabulary is as long as the shard
/// is none), the last two dims equal, `n ≥ 2`, more than one matrix or, at batch 1 with one
/// head, `n` the shard's length.
fn attention_weights_size(shape: &[usize], dim: usize, shard: usize, one_length: bool) -> Option<usize> {
    let dims = shape.len();
    if dims < 4 || dim + 2 < dims {
        return None;
    }
    let (m, n) = (shape[dims - 2], shape[dims - 1]);
    let matrices: usize = shape[..dims - 2].iter().product();
    (m >= 2 && m == n && (matrices >= 2 || (one_length && m == shard))).then_some(m)
}

/// The refusal of an op over `dim` of `shape` that mixes the shard's tokens alone, unless the
/// guard is off, `sharding` spreads no sequence or the model opted out.
fn shard_local_refusal(op: &'static str, shape: &[usize], dim: usize, what: String, fix: &'static str, sharding: impl FnOnce() -> Option<Sharding>) -> Option<UlyssesError> {
    let sharding = refusing(sharding())?;
    Some(UlyssesError::ShardLocalByHand { op, shape: shape.to_vec(), dim, what, ranks: sharding.ranks, fix })
}

/// `sharding` where the guard is on and refuses under it ([`spreads_sequences`]): where the
/// rules that go by an op's shape alone refuse.
fn refusing(sharding: Option<Sharding>) -> Option<Sharding> {
    spreads_sequences(sharding.filter(|_| GUARD_ON.load(Ordering::Relaxed)))
}

/// Why a softmax (`op`: softmax, log_softmax, softmin) over `dim` of `shape` is refused, or
/// `None`: `sharding` gives the rank context's, looked up only for a shape the rule takes.
pub fn attention_weights_by_hand(op: &'static str, shape: &[usize], dim: usize, sharding: impl FnOnce() -> Option<Sharding>) -> Option<UlyssesError> {
    let (shard, one_length) = embedded();
    let Some(tokens) = attention_weights_size(shape, dim, shard, one_length) else {
        // Weights over the tokens that are no token × token matrix: attention pooling's one
        // query (`softmax(score(x), 1)` of a `[B, S, 1]`), a softmax over a mask's tokens.
        return reduced_over_the_shard(op, OverTheSequence::Normalises, shape, dim, false, sharding);
    };
    let what = format!("it normalises a {tokens} x {tokens} matrix per head, attention's weights over {tokens} tokens of this rank's shard");
    let fix = "Call `burn::tensor::module::attention` (with `is_causal: true` instead of a causal mask built from local shapes), or \
               use burn_ulysses::nn::MultiHeadAttention; apply RoPE at the shard's global positions (SequenceShard::positions).";
    shard_local_refusal(op, shape, dim, what, fix, sharding)
}

/// Why a scan (`op`: cumsum, cumprod, cummin, cummax) along `dim` of `shape` is refused, or
/// `None`: one along the sequence dim (`[B, S, ..]`'s dim 1, a 1-D tensor's only one, per head
/// `[B, H, S, ..]`'s: [`scanned_sequence`]) as long as the token ids last embedded (the rank's
/// shard; the thread's last two embeddings of that one length) restarts at each rank's first
/// token. Positions made of a padding mask's cumsum (`mask.cumsum(1) - 1`, Hugging Face's), and
/// causal linear attention's running sums, are the usual cases. A scan along another dim
/// that happens to be as long (`[B, S, D]`'s features, a batch; where the forward's positions
/// are noted, flattened tokens `[B·S, D]`: a 2-D tensor whose first dim is the batch's rows
/// times the shard's or tile's tokens) passes, and so does one before the forward's first embedding where no length is
/// noted yet (after a backward or `evaluate`).
pub fn scan_over_the_shard(op: &'static str, shape: &[usize], dim: usize, sharding: impl FnOnce() -> Option<Sharding>) -> Option<UlyssesError> {
    let shard = scanned_sequence(shape, dim)?;
    let what = format!("a running {op} over the {shard} tokens of this rank's shard restarts at every rank's first token");
    let fix = "Take positions from the sharder (SequenceShard::positions: each token's place in its whole sequence or document) \
               rather than from a mask's cumsum; a scan over a whole sequence needs the whole sequence, on one rank \
               (burn_ulysses::context::enter_single_device()).";
    shard_local_refusal(op, shape, dim, what, fix, sharding)
}

/// The shard's length where `dim` of `shape` is as long as the token ids last embedded (the
/// rank's shard; the thread's last two embeddings of that one length, two tokens or more) or
/// as a length windows that tiled it resampled it to.
fn along_the_shard(shape: &[usize], dim: usize) -> Option<usize> {
    let length = *shape.get(dim)?;
    shard_lengths().find(|&shard| shard == length)
}

/// The sequence dim of a `[B, S, ..]` tensor (1), or a 1-D one's only dim.
fn sequence_dim(shape: &[usize]) -> usize {
    usize::from(shape.len() > 1)
}

/// The shard's length where `dim` of `shape` is a sequence dim as long, for scans and flips:
/// `[B, S, ..]`'s dim 1 (a 1-D tensor's only dim), per-head `[B, H, S, D]`'s dim 2 (causal
/// linear attention's, RetNet's and GLA's running sums, `k.cumsum(2)`) and the one dim as long
/// of 5-D or more (their state `[B, H, S, dk, dv]`), where dim 1 is not as long. Dim 2 of a
/// 3-D tensor only where positions are noted and its middle dim is no piece's tokens: a
/// checkpointed layer's tile `[B, T, D]` may have as many features as the shard has tokens.
fn scanned_sequence(shape: &[usize], dim: usize) -> Option<usize> {
    let along = |dim: usize| along_the_shard(shape, dim);
    // A scan over flattened tokens' features (ON-LSTM's cumax).
    if flattened_tokens(shape) {
        return None;
    }
    match dim {
        _ if dim == sequence_dim(shape) => along(dim),
        _ if shape.len() >= 4 && along(1).is_none() => along_the_sequence(shape, dim, along),
        // Channels first `[B, C, L]` along `L`, where positions are noted and its middle dim is
        // no piece's tokens nor a few more or fewer (see [`reduced_over_the_shard`]).
        2 if shape.len() == 3 && SHARD_POSITIONS.get().is_some_and(|noted| noted.rows == shape[0]) => along(2).filter(|&shard| along_the_last_of_three(shape, shard)),
        _ => None,
    }
}

/// Whether `shape` is flattened tokens `[B·S, D]` (rows × the shard's or a tile's tokens, where
/// positions are noted): its dim 1 then holds features. Not any other first dim: per-head gates
/// `[H, S]` or `[B·H, S]`, a broadcast row `[1, S]`, along the tokens, are the shard's.
fn flattened_tokens(shape: &[usize]) -> bool {
    let flattened = |noted: NotedPositions| noted.rows != shape[0] && noted.pieces().any(|piece| shape[0] == noted.rows * piece.span().0);
    shape.len() == 2 && SHARD_POSITIONS.get().is_some_and(flattened)
}

/// Whether dim 2 of a 3-D `shape` may run along `len` tokens of the shard (channels first
/// `[B, C, L]`, a row of weights `[B, 1, S]`) rather than hold features: its middle dim is no
/// piece's tokens nor a few more or fewer (a class token's `[B, S + 1, D]`), and its last is
/// neither the width nor the vocabulary of the table the tokens were embedded with (features
/// or logits: a model whose width is as long as the shard leaves no telling, and passes).
fn along_the_last_of_three(shape: &[usize], len: usize) -> bool {
    let [_, middle, last] = <[usize; 3]>::try_from(shape).unwrap_or_default();
    let table = EMBEDDED_TABLE.get();
    table != [0, 0] && !table.contains(&last) && !tokens_in_the_middle(shape) && middle.abs_diff(len) > MOST_SHIFTED
}

/// Whether the middle dim of a 3-D `shape` is as long as a noted piece of the shard (a
/// checkpointed layer's tile `[B, T, D]`, or the shard): its dim 2 then holds features, however
/// many.
fn tokens_in_the_middle(shape: &[usize]) -> bool {
    shape.len() == 3 && SHARD_POSITIONS.get().is_some_and(|noted| noted.rows == shape[0] && (noted.pieces().any(|piece| shape[1] == piece.span().0) || resampled(shape[1])))
}

/// Why a flip (`op`) over `axes` of `shape` is refused, or `None`: one that reverses the
/// sequence dim (as [`scan_over_the_shard`] finds it) reverses each rank's shard in place,
/// not the sequence: the reversed sequence's first shard is the last rank's.
pub fn flip_over_the_shard(op: &'static str, shape: &[usize], axes: &[usize], sharding: impl FnOnce() -> Option<Sharding>) -> Option<UlyssesError> {
    let (dim, shard) = axes.iter().find_map(|&dim| scanned_sequence(shape, dim).map(|shard| (dim, shard)))?;
    let what = format!("reversing the {shard} tokens of this rank's shard leaves each shard where it was, reversed within itself");
    let fix = "Reverse the whole sequence before it is sharded (and shard the reversed one), or do it on one rank \
               (burn_ulysses::context::enter_single_device()).";
    shard_local_refusal(op, shape, dim, what, fix, sharding)
}

/// Why a real FFT (`op`: rfft, irfft) along `dim` of `shape` is refused, or `None`: along a
/// sequence dim (as [`along_the_sequence`] finds it: `[B, S, ..]`'s dim 1, a channels-first
/// `[B, C, L]`'s dim 2, per-head `[B, H, S, D]`'s dim 2) as long as the shard, each frequency
/// mixes every token of the sequence (FNet's token mixing, Hyena's and H3's long convolutions):
/// a shard's spectrum, or a signal made back from one, is not the sequence's. `shape` is the
/// signal's: rfft's input, irfft's output.
pub fn fft_over_the_shard(op: &'static str, shape: &[usize], dim: usize, sharding: impl FnOnce() -> Option<Sharding>) -> Option<UlyssesError> {
    // Over features: flattened tokens' (an STFT's frames `[B·F, n_fft]`), a tile's `[B, T, D]`.
    if flattened_tokens(shape) || (dim == 2 && tokens_in_the_middle(shape)) {
        return None;
    }
    let shard = along_the_sequence(shape, dim, |dim| along_the_shard(shape, dim))?;
    let what = format!("each frequency of the {shard} tokens of this rank's shard stands for every token of the whole sequence, which the other ranks hold");
    let fix = "Transform the whole sequence on one rank (burn_ulysses::context::enter_single_device()), or mix the tokens through \
               `burn::tensor::module::attention`, which sequence parallelism exchanges.";
    shard_local_refusal(op, shape, dim, what, fix, sharding)
}

/// A sliding window along a length: a convolution's or a pooling's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Tokens one window spans, dilation included.
    pub span: usize,
    /// Tokens from one window's start to the next's.
    pub stride: usize,
    /// Tokens of padding on each side of the length.
    pub padding: usize,
    /// A pooling's `ceil_mode`: an output more where the last window would stop short.
    pub ceil_mode: bool,
}

impl Window {
    /// `kernel` taps `dilation` apart, every `stride` tokens.
    pub fn new(kernel: usize, dilation: usize, stride: usize, padding: usize, ceil_mode: bool) -> Self {
        Self { span: dilation * (kernel.max(1) - 1) + 1, stride, padding, ceil_mode }
    }

    /// Whether the windows tile a run of `run` tokens with none across its edges: no padding,
    /// a stride no shorter than the span that divides the run, and no ceil-mode output past
    /// its end. Then a rank's outputs are its shard of the sequence's, in place.
    fn tiles(self, run: usize) -> bool {
        self.padding == 0 && self.stride > 0 && self.span <= self.stride && run % self.stride == 0 && (!self.ceil_mode || self.span == self.stride)
    }
}

/// The shard's length (`shape` a channels-first `[B, C, L]`) where its length dim is as long
/// as the token ids last embedded (or a length windows that tiled it resampled it to), or up
/// to `extra` tokens longer; with `L`.
fn length_along_the_shard(shape: &[usize], extra: usize) -> Option<(usize, usize)> {
    let length = *shape.get(2).filter(|_| shape.len() == 3)?;
    // A length that is one of the shard's is that one, not another's padded.
    let shard = shard_lengths().find(|&shard| shard == length).or_else(|| shard_lengths().find(|&shard| (shard..=shard + extra).contains(&length)))?;
    Some((shard, length))
}

/// Why a convolution or pooling (`op`) over the length dim of `shape` (`[B, C, L]`, channels
/// first, dim 2) with `window` is refused, or `None`: windows over the shard's tokens (as many
/// as its ids, or up to the span less one more: burn pads the input itself for padding that
/// differs on the two sides, a causal convolution's) read, at the shard's edges, padding where
/// the neighbouring ranks' tokens are (a causal convolution's first outputs, a pooling window
/// across two ranks), or start where the sequence's windows do not. Windows that tile each run
/// of the sequence the shard holds (the shard, or its halves under a zigzag ring) pass: a
/// patch embedding or pooling by a fixed factor, and a pointwise convolution.
pub fn window_over_the_shard(op: &'static str, shape: &[usize], window: Window, sharding: impl FnOnce() -> Option<Sharding>) -> Option<UlyssesError> {
    let (shard, length) = length_along_the_shard(shape, window.span.saturating_sub(1))?;
    windows_across_the_shard(op, shape, 2, (shard, length), window, sharding)
}

/// Why an unfold (`op`) of `shape` along `dim` into windows of `size` every `step` is refused,
/// or `None`: along the sequence dim (`[B, S, ..]`'s dim 1, a channels-first `[B, C, L]`'s dim
/// 2, or per-head `[B, H, S, D]`'s dim 2) as long as the token ids last embedded, its windows
/// are [`window_over_the_shard`]'s (sliding windows for local attention, overlapping chunks);
/// chunks that tile the shard pass.
pub fn unfold_over_the_shard(op: &'static str, shape: &[usize], dim: usize, size: usize, step: usize, sharding: impl FnOnce() -> Option<Sharding>) -> Option<UlyssesError> {
    let shard = along_the_sequence(shape, dim, |dim| along_the_shard(shape, dim))?;
    windows_across_the_shard(op, shape, dim, (shard, shard), Window::new(size, 1, step, 0, false), sharding)
}

/// `along(dim)` (the shard's length where `dim` of `shape` is as long) where `dim` is a sequence
/// dim: `[B, S, ..]`'s dim 1, a channels-first `[B, C, L]`'s dim 2 (its dim 1 not the shard's),
/// per-head `[B, H, S, D]`'s dim 2, or the one dim past the batch so long of 5-D or more
/// (a linear attention's state per token, `[B, H, S, dk, dv]`).
fn along_the_sequence(shape: &[usize], dim: usize, along: impl Fn(usize) -> Option<usize>) -> Option<usize> {
    let sequence = sequence_dim(shape);
    match dim {
        _ if dim == sequence => along(dim),
        2 if shape.len() == 3 && along(sequence).is_none() => along(dim),
        _ if shape.len() >= 4 && dim == shape.len() - 2 => along(dim),
        _ if shape.len() >= 5 && dim >= 1 && (1..shape.len()).filter(|&other| along(other).is_some()).count() == 1 => along(dim),
        _ => None,
    }
}

/// The refusal of `window`s along `dim` of `shape`, whose `length` is the `shard`'s (or burn
/// padded it), unless they tile each run of the sequence the shard holds.
fn windows_across_the_shard(op: &'static str, shape: &[usize], dim: usize, (shard, length): (usize, usize), window: Window, sharding: impl FnOnce() -> Option<Sharding>) -> Option<UlyssesError> {
    let sharding = sharding();
    let runs = sharding.map_or(1, |sharding| sharding.runs);
    // One window over the whole shard of embedded tokens (TextCNN's max over time, a
    // classifier's mean: a kernel of the input's length) tiles it too, but pools the shard as
    // if it were the sequence; a fixed factor as long as that shard is no model's (a pooled
    // stream's, a tiny factor's may be: they pass; so does a window over each run of a
    // zigzag ring, the sequence's own).
    let whole_shard = window.span >= MOST_SHIFTED && window.span >= shard && shard == embedded().0;
    if length == shard && shard % runs == 0 && window.tiles(shard / runs) && !whole_shard {
        note_resampled(shard / window.stride);
        return None;
    }
    let Window { span, stride, .. } = window;
    let padded = if length > shard { format!(" (padded to {length})") } else { String::new() };
    let what = format!(
        "its windows of {span} tokens, {stride} apart, run over the {shard} tokens of this rank's shard{padded} as if they were the whole sequence: \
         the windows across the shard's edges are missing or read padding where the neighbouring ranks' tokens are, or the windows fall where \
         the sequence's do not"
    );
    let fix = "Run it on the whole sequence on one rank (burn_ulysses::context::enter_single_device()), or give each shard the \
               window's (window − 1) tokens from the rank before it (a halo) and drop the outputs they add. Windows that tile the \
               shard pass: no padding, a stride at least the window's span that divides the shard (each half of it under a zigzag ring), \
               a window shorter than the shard, and with ceil_mode a kernel equal to the stride.";
    shard_local_refusal(op, shape, dim, what, fix, || sharding)
}

/// Why a transposed convolution over the length dim of `shape` (`[B, C, L]`, `L` the shard's:
/// burn never pads its input) is refused, or `None`: each token writes `window.span` outputs
/// from `window.stride` × its index on, and a rank lays its tokens' out as if the shard were
/// the whole sequence. Its outputs are its shard of the sequence's only where each token
/// writes a block of its own: no padding (it crops every shard's edges) and the span with
/// `padding_out` the stride (an upsampling by the kernel's length).
pub fn transposed_window_over_the_shard(shape: &[usize], window: Window, padding_out: usize, sharding: impl FnOnce() -> Option<Sharding>) -> Option<UlyssesError> {
    let (shard, _) = length_along_the_shard(shape, 0)?;
    let Window { span, stride, padding, .. } = window;
    if padding == 0 && span + padding_out == stride {
        note_resampled(shard * stride);
        return None;
    }
    let what = format!(
        "each of the {shard} tokens of this rank's shard writes {span} outputs, {stride} apart from the next token's (padding {padding}, output padding \
         {padding_out}), laid out as if the shard were the whole sequence: at its edges they miss the neighbouring ranks' overlap, are cropped by the \
         padding, or leave a gap"
    );
    let fix = "Run it on the whole sequence on one rank (burn_ulysses::context::enter_single_device()). An upsampling whose kernel span \
               (with the output padding) equals its stride, with no padding, passes: each token writes a block of outputs of its own.";
    shard_local_refusal("conv_transpose1d", shape, 2, what, fix, sharding)
}

/// Why `adaptive_avg_pool1d` of `shape` (`[B, C, L]`, `L` the shard's) to `output_size` is
/// refused, or `None`: it pools this rank's tokens to `output_size` as if they were the
/// whole sequence (to one: a classifier's mean over the shard alone). To the shard's own
/// length it changes nothing and passes.
pub fn pooling_of_the_shard_to_a_length(shape: &[usize], output_size: usize, sharding: impl FnOnce() -> Option<Sharding>) -> Option<UlyssesError> {
    let (shard, _) = length_along_the_shard(shape, 0).filter(|_| output_size != shape[2])?;
    let what = format!("it pools the {shard} tokens of this rank's shard to {output_size} as if they were the whole sequence, whose pooling spans every rank's tokens");
    let fix = "Pool by a fixed factor with avg_pool1d (kernel = stride, dividing the shard, each half of it under a zigzag ring: that passes), \
               or pool the whole sequence on one rank (burn_ulysses::context::enter_single_device()).";
    shard_local_refusal("adaptive_avg_pool1d", shape, 2, what, fix, sharding)
}

/// Where this rank's tokens sit in the forward under way, as [`note_shard_positions`] noted
/// them: how many rows, how many tokens a row, and the start of the one run of positions every
/// row holds (`start..start + len`), if they do; and, inside a checkpointed layer's token-wise
/// part ([`note_tile_of_the_shard`]), the tile's rows of the shard (`start..end`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct NotedPositions {
    rows: usize,
    len: usize,
    run_start: Option<u64>,
    tile: Option<(usize, usize)>,
    /// The first and the last of the ids (row-major), which ids handed to attention as the
    /// shard's must have too.
    ends: (u64, u64),
    /// [`ShardPositions::cut`].
    cut: ShardCut,
}

impl NotedPositions {
    fn of(positions: &ShardPositions) -> Self {
        let ids = &positions.ids;
        let first = ids.ids().first().copied().unwrap_or(0);
        let one_run = (0..ids.batch()).all(|b| ids.row(b).iter().zip(first..).all(|(&id, expected)| id == expected));
        let ends = (first, ids.ids().last().copied().unwrap_or(0));
        Self { rows: ids.batch(), len: ids.len(), run_start: one_run.then_some(first), tile: None, ends, cut: positions.cut }
    }

    /// The tile's rows of the shard where `counted` is as many (two or more), and whether
    /// `counted` is the tile's positions.
    fn tile_counted(&self, counted: &Range<u64>) -> Option<(Range<u64>, bool)> {
        let (start, end) = self.tile?;
        let rows = start as u64..end as u64;
        let len = counted.end.saturating_sub(counted.start);
        (len >= 2 && len == rows.end - rows.start).then(|| (rows.clone(), self.run_start.is_some_and(|run| counted.start == run + rows.start)))
    }

    /// Whether rows `counted` of a table `table` long, as many as the tile's, are counted from the
    /// tile's first row as if it were the shard's: from 0, from the shard's first position, or
    /// at the tile's rows of a table as long as the sequence over the `ranks` (a global one: a
    /// table built for the shard may be padded). Right are the tile's positions and its rows of
    /// a table built for the shard; a table shorter than the shard holds no positions.
    fn tile_table_miscounted(&self, counted: &Range<u64>, table: usize, ranks: usize) -> bool {
        let Some((rows, at_positions)) = self.tile_counted(counted).filter(|_| table >= self.len) else { return false };
        let global = table >= ranks * self.len && table != self.len;
        let counted_as_the_shards = match *counted == rows {
            // The tile's rows: right of a table built for the shard, another tile's of a global one.
            true => global,
            false => counted.start == 0 || Some(counted.start) == self.run_start,
        };
        counted_as_the_shards && !at_positions
    }

    /// Whether an `arange` over `counted`, as many as the tile's rows, is at other positions than
    /// the tile's (as the shard's rule takes one as long as the shard for positions).
    fn tile_arange_miscounted(&self, counted: &Range<u64>) -> bool {
        self.tile_counted(counted).is_some_and(|(_, at_positions)| !at_positions)
    }

    /// The tokens a row of the piece under way holds (the tile's where one is noted, else the
    /// shard's), and how a refusal names them: whose tokens, what they are taken for the
    /// whole sequence as, and whose tokens are missing at their edge.
    fn span(&self) -> (usize, &'static str, &'static str, &'static str) {
        match self.tile {
            Some((start, end)) => (end - start, "this tile of the shard", "the tile", "tile"),
            None => (self.len, "this rank's shard", "the shard", "rank"),
        }
    }

    /// The pieces whose tokens a rule looks at: the tile, where one is noted, then the shard.
    fn pieces(self) -> impl Iterator<Item = NotedPositions> {
        self.tile.map(|_| self).into_iter().chain([NotedPositions { tile: None, ..self }])
    }

    fn tile_held(&self) -> String {
        let (start, end) = self.tile.unwrap_or((0, self.len));
        match self.run_start {
            Some(run) => format!("whose tokens sit at positions {}..{}", run + start as u64, run + end as u64),
            None => "whose positions are no one run from a common start in every row (a zigzag ring's two chunks apart, or packed documents)".into(),
        }
    }

    /// Whether `range` is this rank's positions: right for a table's rows or an `arange`.
    fn holds(&self, range: &Range<u64>) -> bool {
        self.run_start == Some(range.start) && range.end - range.start == self.len as u64
    }

    fn held(&self) -> String {
        match self.run_start {
            Some(start) => format!("positions {start}..{}", start + self.len as u64),
            None => "positions that are no one run from a common start in every row (a zigzag ring's two chunks apart, or packed documents restarting at 0)".into(),
        }
    }
}

thread_local! {
    /// This rank's positions in the forward under way: set by the training API around each
    /// forward (or by a loop of one's own), for the rule that positions are not counted from
    /// another shard's first token.
    static SHARD_POSITIONS: Cell<Option<NotedPositions>> = const { Cell::new(None) };
}

/// Makes `positions` (the shard a forward is about to run on) this thread's for the guard until
/// the returned value is dropped: a table of positions sliced, or an `arange` counted, over as
/// many tokens as the shard holds but at other positions than its own (RoPE or sinusoids from
/// 0 on every rank: `RotaryEncoding::forward`, `PositionalEncoding::forward`, a learned position
/// embedding of `arange(0..len)`) is then refused under SP. `ulysses_training`'s steps and
/// `evaluate` note their shards themselves; a loop of one's own calls it around its forward.
pub fn note_shard_positions(positions: &ShardPositions) -> ShardPositionsNoted {
    PLACED.with_borrow_mut(Vec::clear);
    let previous = SHARD_POSITIONS.replace(Some(NotedPositions::of(positions)));
    ShardPositionsNoted { previous, _not_send: PhantomData }
}

/// [`note_shard_positions`] where this thread's forward has none noted (a model's own entry
/// point, as `ulysses_models`' decoder's, called by a loop that noted nothing); `None`, leaving
/// them as they are, where a caller noted its shard (the training API, maybe a tile of it).
pub fn note_shard_positions_unless_noted(positions: &ShardPositions) -> Option<ShardPositionsNoted> {
    SHARD_POSITIONS.get().is_none().then(|| note_shard_positions(positions))
}

/// Narrows the positions noted (by [`note_shard_positions`]) to rows `rows` of the shard until
/// the returned value is dropped: `ulysses_training`'s layer checkpointing runs each layer's
/// token-wise parts (`LayeredLm::before_core`, `after_core`) a tile of rows at a time, and a
/// table of positions sliced over as many rows as the tile, counted from its first row as if it
/// were the shard's (RoPE from 0 in every tile; at the shard's offset, or at the tile's rows of
/// a global table), is then refused at any SP degree; under SP, so is an `arange` as long at
/// other positions than the tile's. A token shift, reduction or ranking over the tile's tokens
/// is refused at any SP degree too ([`shard_shifted_by_a_slice`], [`reduced_over_the_shard`]).
/// Rows that are the whole shard change nothing.
pub fn note_tile_of_the_shard(rows: Range<usize>) -> ShardPositionsNoted {
    let noted = SHARD_POSITIONS.get();
    let tiled = noted.filter(|noted| rows.end <= noted.len && rows.len() < noted.len).map(|noted| NotedPositions { tile: Some((rows.start, rows.end)), ..noted });
    let previous = if tiled.is_some() { SHARD_POSITIONS.replace(tiled) } else { noted };
    ShardPositionsNoted { previous, _not_send: PhantomData }
}

/// The refusal of positions (`what` an `op` counted) that are another tile's of `noted`'s shard,
/// unless the guard is off or the model opted out; `at_any_degree`: at SP 1 too (a table's rows,
/// wrong on one device as well), else only where the guard refuses under SP (an `arange`, which
/// on one device may as well be indices: MoE routing of the tile's tokens).
fn positions_of_another_tile(op: &'static str, what: String, noted: NotedPositions, at_any_degree: bool, sharding: impl FnOnce() -> Option<Sharding>) -> Option<UlyssesError> {
    let (start, end) = noted.tile?;
    let sharding = sharding();
    let refused = match at_any_degree {
        true => tile_refused(sharding),
        false => refusing(sharding).is_some(),
    };
    refused.then(|| UlyssesError::PositionsOfAnotherTile { op, what, rows: format!("{start}..{end}"), shard: noted.len, held: noted.tile_held() })
}

/// Runs `build` without the rules on positions: for what is no position but is as long as the
/// shard, which the guard cannot tell from positions counted from the shard's first token
/// (indices within the shard from an `arange`, to route its tokens to experts; `Tensor::eye` of
/// its length; a weight whose rows are split in parts as long as the shard, or as a
/// checkpointed layer's tile), and without the
/// rules on shifts and reductions (a chunk of a fixed size; an auxiliary loss's sum over the
/// shard that its caller adds over the ranks).
pub fn not_positions<T>(build: impl FnOnce() -> T) -> T {
    let _restored = ShardPositionsNoted { previous: SHARD_POSITIONS.replace(None), _not_send: PhantomData };
    build()
}

/// Restores the positions noted before it (by [`note_shard_positions`] or [`not_positions`]) when dropped.
#[must_use = "the positions are forgotten as soon as this is dropped"]
pub struct ShardPositionsNoted {
    previous: Option<NotedPositions>,
    // Dropped on the thread that noted them.
    _not_send: PhantomData<*const ()>,
}

impl Drop for ShardPositionsNoted {
    fn drop(&mut self) {
        SHARD_POSITIONS.set(self.previous.take());
    }
}

/// Why a slice of `shape` by `slices` is refused, or `None`: one that takes as many rows of a
/// table of positions as the shard has tokens, but not this rank's (RoPE's frequencies or
/// sinusoids from 0, as `RotaryEncoding::forward` and `PositionalEncoding::forward` take them,
/// a cos/sin cache's first rows, a learned table's). A table, by shape: two dims or more, cut
/// along one dim alone, every dim before it of size 1 and, for a float table, a dim of features
/// after it; as long as the whole sequence over the ranks or longer (as a table a model can
/// take every rank's positions from must be; no shard's activation, a few tokens longer than
/// the shard, is). `activation`: a tensor computed under autodiff, no table (not a parameter,
/// which autodiff keeps as a leaf); without autodiff (in `evaluate`) the shape alone decides.
pub fn positions_sliced_from_a_table(shape: &[usize], slices: &[Slice], activation: bool, features_after: bool, sharding: impl FnOnce() -> Option<Sharding>) -> Option<UlyssesError> {
    let noted = SHARD_POSITIONS.get().filter(|noted| noted.len >= 2 && !activation && shape.len() >= 2)?;
    let (dim, range) = one_cut(shape, slices)?;
    let rows = range.start as u64..range.end as u64;
    let table_like = shape[..dim].iter().all(|&size| size == 1) && (dim + 1 < shape.len() || !features_after);
    if !table_like {
        return None;
    }
    // Looked up once, where a rule needs it.
    let (mut lookup, mut looked_up) = (Some(sharding), None);
    let mut sharding = || *looked_up.get_or_insert_with(|| lookup.take().and_then(|lookup| lookup()));
    if noted.tile.is_some() && noted.tile_table_miscounted(&rows, shape[dim], sharding().map_or(1, |sharding| sharding.ranks)) {
        let what = format!("takes rows {}..{} along dim {dim} of a {shape:?} table of positions", range.start, range.end);
        return positions_of_another_tile("slice", what, noted, true, sharding);
    }
    if range.len() != noted.len || noted.holds(&rows) {
        return None;
    }
    let sharding = refusing(sharding()).filter(|sharding| shape[dim] >= sharding.ranks * noted.len)?;
    let what = format!(
        "takes rows {}..{} along dim {dim} of a {shape:?} table of positions (RotaryEncoding::forward's frequencies, \
         PositionalEncoding::forward's sinusoids, a cos/sin cache's or a learned table's first rows)",
        range.start, range.end
    );
    Some(UlyssesError::PositionsOfAnotherShard { op: "slice", what, len: noted.len, held: noted.held(), ranks: sharding.ranks })
}

/// The one dim `slices` cut `shape` along, in steps of 1, and its range; `None` where they cut
/// none, several, or with another step.
fn one_cut(shape: &[usize], slices: &[Slice]) -> Option<(usize, Range<usize>)> {
    let mut cut = cuts(shape, slices)?.into_iter();
    let (Some(cut), None) = (cut.next(), cut.next()) else { return None };
    Some(cut)
}

/// The dims `slices` cut `shape` along, each in steps of 1, with their ranges; `None` where one
/// is cut with another step.
fn cuts(shape: &[usize], slices: &[Slice]) -> Option<Vec<(usize, Range<usize>)>> {
    let slice = |dim: usize| slices.get(dim).copied().unwrap_or(Slice::full());
    let whole = |dim: usize| slice(dim).step == 1 && slice(dim).to_range(shape[dim]) == (0..shape[dim]);
    (0..shape.len()).filter(|&dim| !whole(dim)).map(|dim| (slice(dim).step == 1).then(|| (dim, slice(dim).to_range(shape[dim])))).collect()
}

/// Why a slice of `shape` by `slices` is refused as a token × token block cut to the shard, or
/// `None`: inside a forward whose positions are noted, a cut of a table (no activation, as
/// [`positions_sliced_from_a_table`] tells one) along two dims alone, both to the same rows, as
/// many as the shard has tokens, of a matrix as long as the whole sequence over the ranks or
/// longer along both: a weight or mask over the sequence's tokens (gMLP's spatial gating
/// weight, a Synthesizer's learned attention, a causal mask buffer's `[:T, :T]`), whose block
/// for the shard mixes its tokens among themselves alone, without the other ranks' columns.
pub fn token_matrix_cut_to_the_shard(shape: &[usize], slices: &[Slice], activation: bool, sharding: impl FnOnce() -> Option<Sharding>) -> Option<UlyssesError> {
    let noted = SHARD_POSITIONS.get().filter(|noted| noted.len >= 2 && !activation && shape.len() >= 2)?;
    let [(rows_dim, rows), (columns_dim, columns)] = <[_; 2]>::try_from(cuts(shape, slices)?).ok()?;
    if rows.len() != noted.len || rows != columns {
        return None;
    }
    let sharding = refusing(sharding()).filter(|sharding| shape[rows_dim].min(shape[columns_dim]) >= sharding.ranks * noted.len)?;
    let (n, (start, end)) = (noted.len, (rows.start, rows.end));
    let what = format!(
        "it takes the {n} x {n} block {start}..{end} along dims {rows_dim} and {columns_dim} of a matrix over the sequence's tokens \
         (gMLP's spatial gating weight, a learned attention, a causal mask buffer): the shard's tokens mixed among themselves alone, \
         without the other ranks' columns"
    );
    let fix = "Mix the tokens through burn::tensor::module::attention, or mix the whole sequence on one rank \
               (burn_ulysses::context::enter_single_device()); a block that is right per shard goes inside \
               burn_ulysses::attention_guard::not_positions(|| ..).";
    Some(UlyssesError::ShardLocalByHand { op: "slice", shape: shape.to_vec(), dim: columns_dim, what, ranks: sharding.ranks, fix })
}

/// The fix a refused token shift names ([`shard_shifted_by_a_slice`], [`shard_shifted_by_padding`]).
const SHIFT_FIX: &str = "Shift the whole sequence before it is sharded (the sharder's tokens and labels are already shifted for \
                         next-token prediction), give each shard the neighbouring rank's tokens (a halo) through a collective of \
                         one's own, or run it on one rank (burn_ulysses::context::enter_single_device()). A slice that is no shift \
                         (a chunk of a fixed size, a crop back to where a pad put the tokens) goes inside \
                         burn_ulysses::attention_guard::not_positions(|| ..).";

/// The most tokens a slice may drop from an end of the shard to be taken for a token shift:
/// shifts move a token or a few (a convolution's reach), where chunks of a fixed size drop
/// whatever the shard's length leaves over.
const MOST_SHIFTED: usize = 4;

/// Why a slice of `shape` by `slices` is refused as a shift of the shard, or `None`: inside a
/// forward whose positions are noted, one that drops a few tokens (one to [`MOST_SHIFTED`], and
/// at most a quarter of the shard, of four tokens or more) from either end of its sequence dim
/// (`[B, S, ..]`'s dim 1, `[B, C, L]`'s dim 2, per-head `[B, H, S, D]`'s dim 2; 2-D or more): a
/// token shift (RWKV's, a smeared key's), a `roll` by as few (burn builds it of such slices), a
/// difference of neighbouring tokens. At the shard's edge the neighbouring rank's tokens are
/// missing. A forward's tiles (halves or less of the shard) pass, and so does what runs inside
/// [`not_positions`]. Inside a checkpointed layer's tile ([`note_tile_of_the_shard`]) the same
/// goes for the tile's tokens, refused at any SP degree.
pub fn shard_shifted_by_a_slice(shape: &[usize], slices: &[Slice], sharding: impl FnOnce() -> Option<Sharding>) -> Option<UlyssesError> {
    let noted = SHARD_POSITIONS.get().filter(|_| shape.len() >= 2)?;
    let (dim, range) = one_cut(shape, slices)?;
    // The tile's tokens first, where one is noted, then the shard's.
    let (noted, shard, dropped) = noted.pieces().find_map(|piece| {
        let span = piece.span().0;
        let shard = shift_sequence(shape, dim, span, |dim: usize| (shape[dim] == span).then_some(span))?;
        let dropped = shard - range.len();
        let from_one_end = range.start == 0 || range.end == shard;
        (from_one_end && (1..=MOST_SHIFTED.min(shard / 4)).contains(&dropped)).then_some((piece, shard, dropped))
    })?;
    let (_, whose, it, next) = noted.span();
    let end = if range.start == 0 { "last" } else { "first" };
    let what = format!(
        "it drops the {end} {dropped} of the {shard} tokens of {whose} (a token shift, a roll, a difference of neighbouring tokens), \
         as if {it} were the whole sequence: at its edge the neighbouring {next}'s tokens are missing"
    );
    refusal_within(noted, "slice", shape, dim, what, SHIFT_FIX, sharding)
}

/// The fix a refused token pick names ([`token_picked_from_the_shard`]).
const PICK_FIX: &str = "Pick the sequence's token on the rank that holds it (SequenceShard::positions says which positions a rank's \
                        tokens sit at) and share it through a collective of one's own, or run the part on the whole sequence on one \
                        rank (burn_ulysses::context::enter_single_device()). A pick that is right per shard (a loop over tokens \
                        whose steps share nothing) goes inside burn_ulysses::attention_guard::not_positions(|| ..).";

/// Why a slice of `shape` by `slices` is refused as a token picked from the shard, or `None`:
/// inside a forward whose positions are noted, one that keeps a single token of the sequence
/// dim of a piece of four tokens or more (the shard's, or a checkpointed layer's tile: the dims
/// [`shard_shifted_by_a_slice`] takes for a sequence). The sequence's last or first token (a
/// reward model's or a classifier's head, `x[:, -1]`) is one rank's, not every rank's; a
/// recurrence run a token at a time (`iter_dim` over the tokens, burn-nn's `Lstm`, a selective
/// scan written as a loop) starts again from its initial state at every shard's first token.
/// The cut of a shard's tensor to a tile of one row (the layer checkpointing's own) passes.
pub fn token_picked_from_the_shard(shape: &[usize], slices: &[Slice], sharding: impl FnOnce() -> Option<Sharding>) -> Option<UlyssesError> {
    let (dim, range) = one_cut(shape, slices).filter(|(_, range)| range.len() == 1)?;
    if SHARD_POSITIONS.get()?.tile == Some((range.start, range.end)) {
        return None;
    }
    token_picked("slice", shape, dim, &format!("token {}", range.start), sharding)
}

/// Why `op` (`select`, `gather`) along `dim` of `shape` is refused as a token picked from the
/// shard, or `None`: where it keeps one token (`picked` is its output's length along `dim`) of
/// a sequence dim, as [`token_picked_from_the_shard`] refuses a slice; at an index the data
/// loader computed (a padded batch's last tokens, transformers' `hidden[arange(B), last]`),
/// each rank picks within its shard.
pub fn token_picked_by_index(op: &'static str, shape: &[usize], dim: usize, picked: usize, sharding: impl FnOnce() -> Option<Sharding>) -> Option<UlyssesError> {
    // In a checkpointed layer's tile of one row, a row picked may be the tile's own (its row of
    // a table built for the shard), as the slice rule lets the tile's rows through.
    let one_row_tile = SHARD_POSITIONS.get().and_then(|noted| noted.tile).is_some_and(|(start, end)| end - start == 1);
    (picked == 1 && !one_row_tile).then_some(())?;
    token_picked(op, shape, dim, "a token", sharding)
}

/// The refusal of `op` keeping `which` (one token) along `dim` of `shape`, where that is the
/// sequence dim of the piece noted (a tile's, then the shard's: [`shift_sequence`]).
fn token_picked(op: &'static str, shape: &[usize], dim: usize, which: &str, sharding: impl FnOnce() -> Option<Sharding>) -> Option<UlyssesError> {
    let noted = SHARD_POSITIONS.get().filter(|_| shape.len() >= 2)?;
    let noted = noted.pieces().find(|piece| {
        let span = piece.span().0;
        shift_sequence(shape, dim, span, |dim: usize| (shape[dim] == span).then_some(span)).is_some()
    })?;
    let (len, whose, it, next) = noted.span();
    let what = format!(
        "it picks {which} of the {len} tokens of {whose} as if {it} were the whole sequence (the last or first token's state for a \
         classifier's or reward model's head, a step of a recurrence run token by token): the sequence's token there is one {next}'s, \
         and a recurrence starts again at every {next}'s first token"
    );
    refusal_within(noted, op, shape, dim, what, PICK_FIX, sharding)
}

macro_rules! guarded_selects {
    ($(($name:ident, $tensor:ident, $op:ident)),* $(,)?) => {$(
        #[doc = concat!("`UlyssesBackend`'s `", stringify!($op), "`: the inner backend's, after the guard.")]
        pub fn $name<X: ExchangeBackend>(tensor: $tensor<X>, dim: usize, indices: IntTensor<X>) -> $tensor<X> {
            if SHARD_POSITIONS.get().is_some() {
                refuse(token_picked_by_index("select", &tensor.shape(), dim, indices.shape().num_elements(), context::current_sharding));
            }
            X::$op(tensor, dim, indices)
        }
    )*};
}

guarded_selects!((guarded_float_select, FloatTensor, float_select), (guarded_int_select, IntTensor, int_select));

macro_rules! guarded_gathers {
    ($(($name:ident, $tensor:ident, $op:ident)),* $(,)?) => {$(
        #[doc = concat!("`UlyssesBackend`'s `", stringify!($op), "`: the inner backend's, after the guard.")]
        pub fn $name<X: ExchangeBackend>(dim: usize, tensor: $tensor<X>, indices: IntTensor<X>) -> $tensor<X> {
            if SHARD_POSITIONS.get().is_some() {
                let picked = indices.shape().get(dim).copied().unwrap_or(0);
                refuse(token_picked_by_index("gather", &tensor.shape(), dim, picked, context::current_sharding));
            }
            X::$op(dim, tensor, indices)
        }
    )*};
}

guarded_gathers!((guarded_float_gather, FloatTensor, float_gather), (guarded_int_gather, IntTensor, int_gather));

/// Where a piece's tokens (the shard's, or a tile's: `span` of them) went along a sequence dim
/// `dim` of a tensor of `shape` one to [`MOST_SHIFTED`] tokens longer: from `at`, padded
/// (`Tensor::pad`'s `slice_assign`) or concatenated with a few other tokens (`cat`); `integers`
/// for an int tensor (token ids), else a float one. Tensors are told apart by these alone.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Placed {
    integers: bool,
    shape: Vec<usize>,
    dim: usize,
    span: usize,
    at: usize,
}

/// The placements a forward keeps for [`shard_shifted_by_padding`]: the latest few, enough for
/// a layer's pads and crops.
const MOST_PLACED: usize = 16;

thread_local! {
    /// The shard's (or a tile's) tokens placed in a longer tensor in the forward under way
    /// ([`note_placed`]): forgotten where a forward's positions are noted.
    static PLACED: RefCell<Vec<Placed>> = const { RefCell::new(Vec::new()) };
}

/// The length of `dim` of `shape` where it is a sequence dim ([`shift_sequence`]) as long as a
/// piece of `span` tokens padded by one to [`MOST_SHIFTED`] (at most a quarter of them).
fn padded_sequence(shape: &[usize], dim: usize, span: usize) -> Option<usize> {
    shift_sequence(shape, dim, span, |dim: usize| shape.get(dim).copied().filter(|&length| length > span && length - span <= MOST_SHIFTED.min(span / 4)))
}

/// `along(dim)` (the length of `dim`, where it is as long as the shift rules look for: a piece
/// of `span` tokens, four or more, or that piece padded) where `dim` is a sequence dim of
/// `shape` ([`along_the_sequence`]); `None` where 4-D or more with dim 1 and dim len-2 both so
/// long (`[B, H, S, D]` or `[B, S, H, D]` with as many heads as tokens: no telling which is
/// the sequence), or for dim 2 of a 3-D `[B, S, D]` whose dim 1 is the piece (features, no
/// channels-first `[B, C, L]`).
fn shift_sequence(shape: &[usize], dim: usize, span: usize, along: impl Fn(usize) -> Option<usize>) -> Option<usize> {
    let ambiguous = shape.len() >= 4 && along(1).is_some() && along(shape.len() - 2).is_some();
    if span < 4 || ambiguous || (shape.len() == 3 && dim == 2 && shape[1] == span) {
        return None;
    }
    along_the_sequence(shape, dim, along)
}

/// Notes, inside a forward whose positions are noted, that `len` tokens went to `at..at + len`
/// along `dim` of a tensor of `shape` (of integers, or floats), where they are a piece's tokens
/// (the tile's, where one is noted, or the shard's) and the dim is that piece padded by a few
/// ([`padded_sequence`]; 2-D or more): what [`shard_shifted_by_padding`] compares a crop with.
pub fn note_placed(integers: bool, shape: &[usize], dim: usize, at: usize, len: usize) {
    let Some(noted) = SHARD_POSITIONS.get().filter(|_| shape.len() >= 2) else { return };
    if let Some(span) = noted.pieces().map(|piece| piece.span().0).find(|&span| span == len && padded_sequence(shape, dim, span).is_some()) {
        PLACED.with_borrow_mut(|placed| {
            if placed.len() == MOST_PLACED {
                placed.remove(0);
            }
            placed.push(Placed { integers, shape: shape.to_vec(), dim, span, at });
        });
    }
}

/// Why a slice of `shape` by `slices` is refused as a shift of the shard by padding, or `None`:
/// inside a forward whose positions are noted, one that keeps as many tokens as the shard holds
/// of a sequence dim one to [`MOST_SHIFTED`] tokens longer (at most a quarter of the shard), into
/// which the shard's tokens went at another place ([`note_placed`]): a token shift by padding
/// and cropping (RWKV's `ZeroPad2d((0, 0, 1, -1))`, `x.pad(..)` then a slice), or by
/// `cat([zeros, x])` and a crop. Each token then takes its neighbour, and the shard's first
/// (or last) zeros for the neighbouring rank's token. A crop that keeps the shard's tokens where
/// they went (padding to a multiple, or a class token, removed again) passes, and so does one
/// that any tensor of its kind (`integers`) and shape noted in this forward would keep where its
/// tokens went (tensors are told apart by shape alone); so does what runs inside
/// [`not_positions`]. Inside a checkpointed layer's tile ([`note_tile_of_the_shard`]) the same
/// goes for the tile's tokens, refused at any SP degree.
pub fn shard_shifted_by_padding(integers: bool, shape: &[usize], slices: &[Slice], sharding: impl FnOnce() -> Option<Sharding>) -> Option<UlyssesError> {
    let noted = SHARD_POSITIONS.get().filter(|_| shape.len() >= 2)?;
    let (dim, range) = one_cut(shape, slices)?;
    // The tile's tokens first, where one is noted, then the shard's.
    let (noted, at) = noted.pieces().find_map(|piece| {
        let span = piece.span().0;
        padded_sequence(shape, dim, span).filter(|_| range.len() == span)?;
        let places: Vec<usize> = PLACED.with_borrow(|placed| {
            let alike = placed.iter().filter(|placed| placed.integers == integers && placed.shape == shape && placed.dim == dim && placed.span == span);
            alike.map(|placed| placed.at).collect()
        });
        let at = places.last().copied().filter(|_| !places.contains(&range.start))?;
        Some((piece, at))
    })?;
    let (span, whose, it, next) = noted.span();
    let (by, neighbour) = (at.abs_diff(range.start), if at > range.start { "before" } else { "after" });
    let what = format!(
        "it keeps tokens {}..{} of {} along a dim into which the {span} tokens of {whose} went at {at}..{} (padded, or concatenated \
         with others): each token takes the one {by} {neighbour} it (a token shift by padding and cropping), as if {it} were the \
         whole sequence: at its edge the neighbouring {next}'s tokens are missing",
        range.start,
        range.end,
        shape[dim],
        at + span
    );
    refusal_within(noted, "slice", shape, dim, what, SHIFT_FIX, sharding)
}

/// What an op over a dim does to the tokens along it, for [`reduced_over_the_shard`]'s refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverTheSequence {
    /// A sum, mean, product, maximum or minimum, or whether any or all are nonzero, over the
    /// tokens.
    Reduces,
    /// Where the maximum or minimum lies: a position counted from the first token at hand.
    Locates,
    /// A sort or top-k: the tokens ranked among themselves.
    Ranks,
    /// A softmax: weights that sum to one over the tokens.
    Normalises,
}

/// Why `op` (a reduction or a ranking, as `kind` says) along `dim` of `shape` is refused, or
/// `None`: inside a forward whose positions are noted, one over as many tokens as the shard
/// holds along the sequence dim of a tensor whose first dim is the batch's rows (`[B, S]`'s
/// dim 1, `[B, S, ..]`'s dim 1, per-head `[B, H, S, D]`'s dim 2) sees this rank's tokens alone:
/// a mean or max pooled over the sequence, a sequence's statistic, a top-k of its tokens
/// (mixture-of-depths routing, expert choice) is each shard's, not the sequence's. Features
/// pass (`[B, S, D]`'s dim 2: a norm's, whatever its length), and so do flattened tokens
/// (`[B·S, D]`), a forward's tiles (shorter than the shard), parameters (`parameter`: a leaf
/// that requires its gradient, under autodiff; without it the shape alone decides), a shape
/// whose sequence dim cannot be told (two dims of the shard's length, one of them the reduced
/// one's alternative) and what runs inside [`not_positions`]. Inside a checkpointed layer's
/// tile ([`note_tile_of_the_shard`]) the same goes for the tile's tokens, refused at any SP
/// degree.
pub fn reduced_over_the_shard(op: &'static str, kind: OverTheSequence, shape: &[usize], dim: usize, parameter: bool, sharding: impl FnOnce() -> Option<Sharding>) -> Option<UlyssesError> {
    let noted = SHARD_POSITIONS.get().filter(|noted| !parameter && shape.first() == Some(&noted.rows))?;
    let last_but_one = shape.len().saturating_sub(2);
    // The tile's tokens first, where one is noted, then the shard's.
    let noted = noted.pieces().find(|piece| {
        let len = piece.span().0;
        let along = |dim: usize| shape.get(dim) == Some(&len);
        let sequence = match shape.len() {
            2 => dim == 1,
            // `[B, S, D]`, or channels first `[B, C, L]` where `C` and `L` are both as long; or
            // channels first's `L` (attentive statistics pooling, a max over time), or a row of
            // weights `[B, 1, S]` (attention pooling's query as a row), where the middle dim is
            // no piece's tokens nor a few more or fewer (a class token's `[B, S + 1, D]` whose
            // features are as many as the shard's tokens holds features there).
            3 => (dim == 1 && !along(2)) || (dim == 2 && along_the_last_of_three(shape, len)),
            // `[B, S, H, D]` or `[B, H, S, D]`: as many heads as tokens leave no telling which.
            dims => dims >= 4 && (dim == 1 || dim == last_but_one) && !(along(1) && along(last_but_one)),
        };
        len >= 2 && sequence && along(dim)
    })?;
    let (len, whose, it, _) = noted.span();
    let what = match kind {
        OverTheSequence::Reduces => format!(
            "it reduces over the {len} tokens of {whose} as if they were the whole sequence: a mean or maximum pooled over \
             the sequence, a statistic of it, a count of its tokens (of those that are no padding), whether any is padding, is \
             {it}'s alone"
        ),
        OverTheSequence::Locates => format!(
            "it finds where a maximum or minimum lies among the {len} tokens of {whose} as if they were the whole sequence: \
             the first padding token, a classifier's last token, is {it}'s own, counted from its first row"
        ),
        OverTheSequence::Ranks => format!(
            "it ranks the {len} tokens of {whose} among themselves as if they were the whole sequence: a top-k of the \
             sequence's tokens (mixture-of-depths routing, expert choice) picks {it}'s own"
        ),
        OverTheSequence::Normalises => format!(
            "it normalises over the {len} tokens of {whose} as if they were the whole sequence: weights that sum to one over \
             the sequence's tokens (attention pooling's single query, a softmax over a mask's tokens) sum to one over {it}'s"
        ),
    };
    let fix = "Compute what needs the whole sequence before it is sharded, or run it on one rank \
               (burn_ulysses::context::enter_single_device()). A reduction that is right per shard (a sum its caller adds over the \
               ranks, as the loss's) goes inside burn_ulysses::attention_guard::not_positions(|| ..).";
    refusal_within(noted, op, shape, dim, what, fix, sharding)
}

/// The refusal of an op over `dim` of `shape` that mixes the tokens of the piece `noted` holds
/// alone: a checkpointed layer's tile, at any SP degree ([`tile_refused`]), or the shard
/// ([`shard_local_refusal`], with `fix`).
fn refusal_within(noted: NotedPositions, op: &'static str, shape: &[usize], dim: usize, what: String, fix: &'static str, sharding: impl FnOnce() -> Option<Sharding>) -> Option<UlyssesError> {
    match noted.tile {
        Some((start, end)) => tile_refused(sharding()).then(|| UlyssesError::TileLocalByHand { op, shape: shape.to_vec(), dim, what, rows: format!("{start}..{end}"), shard: noted.len }),
        None => shard_local_refusal(op, shape, dim, what, fix, sharding),
    }
}

/// Whether what a checkpointed layer's tile gets wrong is refused: wherever the guard is on and
/// the model did not opt out, at any SP degree (wrong on one device as well).
fn tile_refused(sharding: Option<Sharding>) -> bool {
    GUARD_ON.load(Ordering::Relaxed) && !sharding.is_some_and(|sharding| sharding.shard_local_attention_on_purpose)
}

/// Why `arange(range)` (step `step`) is refused, or `None`: one that counts as many positions as
/// the shard has tokens, but not this rank's (a learned position embedding of `arange(0..len)`,
/// RoPE's or ALiBi's of it, a mask built from the local length). Indices within the shard that
/// are no positions go inside [`not_positions`].
pub fn positions_counted_by_arange(range: &Range<i64>, step: usize, sharding: impl FnOnce() -> Option<Sharding>) -> Option<UlyssesError> {
    let examples = "Tensor::arange: a learned position embedding's ids, RoPE's or ALiBi's positions, a mask built from the local length";
    (step == 1).then(|| positions_counted("arange", "counts", range, examples, sharding)).flatten()
}

/// The rule on positions counted over `range` by `op` (`verb`s them): as many as the tile's rows
/// at other positions than the tile's, under SP; as many as the shard's tokens but not this
/// rank's positions, under SP. `examples` says what builds them so.
fn positions_counted(op: &'static str, verb: &str, range: &Range<i64>, examples: &str, sharding: impl FnOnce() -> Option<Sharding>) -> Option<UlyssesError> {
    let counted = u64::try_from(range.start).ok().zip(u64::try_from(range.end).ok()).map(|(start, end)| start..end)?;
    let noted = SHARD_POSITIONS.get().filter(|noted| noted.len >= 2)?;
    if noted.tile_arange_miscounted(&counted) {
        return positions_of_another_tile(op, format!("{verb} positions {}..{}", range.start, range.end), noted, false, sharding);
    }
    if counted.end.saturating_sub(counted.start) != noted.len as u64 || noted.holds(&counted) {
        return None;
    }
    let sharding = refusing(sharding())?;
    let what = format!("{verb} positions {}..{} ({examples})", range.start, range.end);
    Some(UlyssesError::PositionsOfAnotherShard { op, what, len: noted.len, held: noted.held(), ranks: sharding.ranks })
}

/// Tokens a shard (or a tile) holds at least for [`positions_uploaded`] to look at its uploads.
const MIN_POSITIONS_UPLOADED: usize = 4;

/// Why host data uploaded inside a forward whose positions are noted is refused, or `None`:
/// positions counted on the host as if the shard (or the tile) were the whole sequence, told by
/// their values (already on the host: no wait for the device). Two kinds: whole numbers
/// `k..k + len` along the one dim that is not 1, or along each row of `[rows, len]` (ids built
/// as `(0..len).collect()`, a float ramp for sinusoids' angles), as many as the shard's tokens,
/// which the `arange` rule takes; and a float table with one dim as long as the shard whose row
/// at its first token is position 0's (sines 0, cosines one constant: `burn::nn::
/// generate_sinusoids(len, ..)` or RoPE's cos computed over `0..len` in the forward) where that
/// token sits past position 0. Rank 0's shard starts at 0, so from 0 passes there. Shards (or
/// tiles) of fewer than four tokens are not looked at.
pub fn positions_uploaded(data: &TensorData, sharding: impl FnOnce() -> Option<Sharding>) -> Option<UlyssesError> {
    let noted = SHARD_POSITIONS.get().filter(|noted| noted.len >= 2)?;
    if !(data.dtype.is_float() || data.dtype.is_int() || data.dtype.is_uint()) {
        return None;
    }
    let shape: &[usize] = &data.shape;
    // Shorter pieces are too short to tell positions from other small counts.
    let piece_len = |len: usize| len >= MIN_POSITIONS_UPLOADED && noted.pieces().any(|piece| piece.span().0 == len);
    let counted_along = match (shape.iter().filter(|&&size| size != 1).count(), shape) {
        (1, _) => shape.iter().copied().find(|&size| size != 1),
        (2, &[_, len]) => Some(len),
        _ => None,
    };
    let ramp = counted_along.filter(|&len| piece_len(len)).and_then(|len| Some((len, ramp_start(data, len)?)));
    if let Some((len, first)) = ramp {
        let examples = "counted on the host, from_data of `(0..len)`: a learned position embedding's ids, the angles of RoPE or sinusoids";
        return positions_counted("from_data", "uploads", &(first..first + len as i64), examples, sharding);
    }
    if !data.dtype.is_float() {
        return None;
    }
    for piece in noted.pieces() {
        let (len, whose, ..) = piece.span();
        let mut along = shape.iter().enumerate().filter(|&(_, &size)| size == len).map(|(dim, _)| dim);
        let (Some(dim), None) = (along.next(), along.next()) else { continue };
        if !piece_len(len) || shape[dim + 1..].iter().product::<usize>() < 2 || !starts_at_position_zero(data, dim) {
            continue;
        }
        let what = format!(
            "uploads a {shape:?} table whose row at the first token of {whose} (dim {dim}) is position 0's (sines 0, cosines one \
             constant: burn::nn::generate_sinusoids(len, ..), or RoPE's cos and sin computed on the host over 0..len)"
        );
        return match piece.tile {
            Some((start, _)) => match piece.run_start {
                Some(run) if run + start as u64 != 0 => positions_of_another_tile("from_data", what, piece, true, sharding),
                _ => None,
            },
            None => {
                let first = piece.run_start.unwrap_or(piece.ends.0);
                let sharding = refusing(sharding()).filter(|_| first != 0)?;
                Some(UlyssesError::PositionsOfAnotherShard { op: "from_data", what, len: piece.len, held: piece.held(), ranks: sharding.ranks })
            }
        };
    }
    None
}

/// The first of the whole numbers `k, k + 1, .., k + len - 1` that every row of `len` values of
/// `data` holds, if it holds them (position ids, or their float ramp).
fn ramp_start(data: &TensorData, len: usize) -> Option<i64> {
    let mut values = data.iter::<f64>();
    let first = values.next().filter(|&first| first >= 0.0 && first.fract() == 0.0 && first < (1u64 << 53) as f64)?;
    let counted = std::iter::once(first).chain(values).enumerate().all(|(i, value)| value == first + (i % len) as f64);
    counted.then_some(first as i64)
}

/// Whether a float table along `dim` of `data` starts at position 0 as sinusoids do, read in its
/// first block along the dims before `dim` (a batch's first row, whose first position the
/// refusal goes by; at most two rows read): the first row's values 0 or one nonzero constant,
/// which some hold (sin 0 and cos 0 times a scale), and the second row's not all so. A mask's
/// rows of 0 and 1 are no sinusoids, nor is a gradient whose first row an ignored label zeroed.
fn starts_at_position_zero(data: &TensorData, dim: usize) -> bool {
    let inner = data.shape[dim + 1..].iter().product::<usize>();
    let rows: Vec<f64> = data.iter::<f64>().take(2 * inner).collect();
    let (first, second) = rows.split_at(inner.min(rows.len()));
    let Some(constant) = first.iter().copied().find(|&value| value != 0.0).filter(|constant| constant.is_finite()) else { return false };
    let as_at_zero = |value: f64| value == 0.0 || value == constant;
    first.iter().all(|&value| as_at_zero(value)) && second.len() == inner && second.iter().all(|value| value.is_finite()) && !second.iter().all(|&value| as_at_zero(value))
}

/// `UlyssesBackend`'s `float_from_data`: the guard, then the upload (counted).
pub fn guarded_float_from_data<X: ExchangeBackend>(data: TensorData, device: &Device<X>) -> FloatTensor<X> {
    refuse(positions_uploaded(&data, context::current_sharding));
    crate::device_io::float_from_data::<X>(data, device)
}

/// `UlyssesBackend`'s `int_from_data`: the guard, then the upload (counted).
pub fn guarded_int_from_data<X: ExchangeBackend>(data: TensorData, device: &Device<X>) -> IntTensor<X> {
    refuse(positions_uploaded(&data, context::current_sharding));
    crate::device_io::int_from_data::<X>(data, device)
}

/// `UlyssesBackend`'s `float_slice`: the inner backend's, after the guard.
pub fn guarded_float_slice<X: ExchangeBackend>(tensor: FloatTensor<X>, slices: &[Slice]) -> FloatTensor<X> {
    if SHARD_POSITIONS.get().is_some() {
        let (shape, activation) = (tensor.shape(), X::is_tracked(&tensor) && !X::float_is_require_grad(&tensor));
        refuse(
            positions_sliced_from_a_table(&shape, slices, activation, true, context::current_sharding)
                .or_else(|| token_matrix_cut_to_the_shard(&shape, slices, activation, context::current_sharding))
                .or_else(|| shard_shifted_by_a_slice(&shape, slices, context::current_sharding))
                .or_else(|| token_picked_from_the_shard(&shape, slices, context::current_sharding))
                .or_else(|| shard_shifted_by_padding(false, &shape, slices, context::current_sharding)),
        );
    }
    X::float_slice(tensor, slices)
}

/// `UlyssesBackend`'s `int_slice`: the inner backend's, after the guard (a table of position
/// ids, `[1, max_len]`, has no dim of features after its positions).
pub fn guarded_int_slice<X: ExchangeBackend>(tensor: IntTensor<X>, slices: &[Slice]) -> IntTensor<X> {
    if SHARD_POSITIONS.get().is_some() {
        let shape = tensor.shape();
        refuse(
            positions_sliced_from_a_table(&shape, slices, false, false, context::current_sharding)
                .or_else(|| token_matrix_cut_to_the_shard(&shape, slices, false, context::current_sharding))
                .or_else(|| shard_shifted_by_a_slice(&shape, slices, context::current_sharding))
                .or_else(|| token_picked_from_the_shard(&shape, slices, context::current_sharding))
                .or_else(|| shard_shifted_by_padding(true, &shape, slices, context::current_sharding)),
        );
    }
    X::int_slice(tensor, slices)
}

/// Notes where a `slice_assign` puts `value` in a tensor of `shape` for [`note_placed`], where
/// it fills one dim's range (as `Tensor::pad` places what it pads).
fn note_assigned(integers: bool, shape: &[usize], slices: &[Slice]) {
    if let Some((dim, range)) = one_cut(shape, slices) {
        note_placed(integers, shape, dim, range.start, range.len());
    }
}

/// Notes where `cat` along `dim` puts each of the tensors of `shapes` for [`note_placed`].
fn note_concatenated(integers: bool, shapes: &[Vec<usize>], dim: usize) {
    let Some(mut shape) = shapes.first().cloned().filter(|shape| dim < shape.len()) else { return };
    shape[dim] = shapes.iter().map(|part| part[dim]).sum();
    let mut at = 0;
    for part in shapes {
        note_placed(integers, &shape, dim, at, part[dim]);
        at += part[dim];
    }
}

/// `UlyssesBackend`'s `float_slice_assign`: the inner backend's, where it is noted (a pad).
pub fn guarded_float_slice_assign<X: ExchangeBackend>(tensor: FloatTensor<X>, slices: &[Slice], value: FloatTensor<X>) -> FloatTensor<X> {
    if SHARD_POSITIONS.get().is_some() {
        note_assigned(false, &tensor.shape(), slices);
    }
    X::float_slice_assign(tensor, slices, value)
}

/// `UlyssesBackend`'s `int_slice_assign`: the inner backend's, where it is noted (a pad).
pub fn guarded_int_slice_assign<X: ExchangeBackend>(tensor: IntTensor<X>, slices: &[Slice], value: IntTensor<X>) -> IntTensor<X> {
    if SHARD_POSITIONS.get().is_some() {
        note_assigned(true, &tensor.shape(), slices);
    }
    X::int_slice_assign(tensor, slices, value)
}

/// `UlyssesBackend`'s `float_cat`: the inner backend's, its parts' places noted.
pub fn guarded_float_cat<X: ExchangeBackend>(tensors: Vec<FloatTensor<X>>, dim: usize) -> FloatTensor<X> {
    if SHARD_POSITIONS.get().is_some() {
        note_concatenated(false, &tensors.iter().map(|tensor| tensor.shape().to_vec()).collect::<Vec<_>>(), dim);
    }
    X::float_cat(tensors, dim)
}

/// `UlyssesBackend`'s `int_cat`: the inner backend's, its parts' places noted.
pub fn guarded_int_cat<X: ExchangeBackend>(tensors: Vec<IntTensor<X>>, dim: usize) -> IntTensor<X> {
    if SHARD_POSITIONS.get().is_some() {
        note_concatenated(true, &tensors.iter().map(|tensor| tensor.shape().to_vec()).collect::<Vec<_>>(), dim);
    }
    X::int_cat(tensors, dim)
}

/// `UlyssesBackend`'s `int_arange`: the inner backend's, after the guard.
pub fn guarded_int_arange<X: ExchangeBackend>(range: Range<i64>, device: &Device<X>, dtype: IntDType) -> IntTensor<X> {
    refuse(positions_counted_by_arange(&range, 1, context::current_sharding));
    X::int_arange(range, device, dtype)
}

/// `UlyssesBackend`'s `int_arange_step`: the inner backend's, after the guard.
pub fn guarded_int_arange_step<X: ExchangeBackend>(range: Range<i64>, step: usize, device: &Device<X>, dtype: IntDType) -> IntTensor<X> {
    refuse(positions_counted_by_arange(&range, step, context::current_sharding));
    X::int_arange_step(range, step, device, dtype)
}

/// `UlyssesBackend`'s reductions and rankings along a dim, of `$tensor`s: the inner backend's,
/// after [`reduced_over_the_shard`] (looked at only inside a forward whose positions are noted),
/// `$parameter` telling a trainable parameter.
macro_rules! guarded_reductions {
    ($tensor:ident, $parameter:ident; $(($name:ident, $op:ident, $label:literal, $kind:ident, ($($arg:ident: $ty:ty),*) -> $output:ty)),* $(,)?) => {$(
        #[doc = concat!("`UlyssesBackend`'s `", stringify!($op), "`: the inner backend's, after the guard.")]
        pub fn $name<X: ExchangeBackend>(tensor: $tensor<X>, dim: usize, $($arg: $ty),*) -> $output {
            if SHARD_POSITIONS.get().is_some() {
                let parameter = $parameter::<X>(&tensor);
                refuse(reduced_over_the_shard($label, OverTheSequence::$kind, &tensor.shape(), dim, parameter, context::current_sharding));
            }
            X::$op(tensor, dim, $($arg),*)
        }
    )*};
}

/// Whether a float tensor is a trainable parameter (a leaf that requires its gradient).
fn float_parameter<X: ExchangeBackend>(tensor: &FloatTensor<X>) -> bool {
    X::float_is_require_grad(tensor)
}

/// Integer, boolean and quantized tensors are never trainable parameters.
fn never_a_parameter<X: ExchangeBackend>(_: &impl TensorMetadata) -> bool {
    false
}

guarded_reductions!(FloatTensor, float_parameter;
    (guarded_float_sum_dim, float_sum_dim, "sum_dim", Reduces, () -> FloatTensor<X>),
    (guarded_float_mean_dim, float_mean_dim, "mean_dim", Reduces, () -> FloatTensor<X>),
    (guarded_float_prod_dim, float_prod_dim, "prod_dim", Reduces, () -> FloatTensor<X>),
    (guarded_float_max_dim, float_max_dim, "max_dim", Reduces, () -> FloatTensor<X>),
    (guarded_float_min_dim, float_min_dim, "min_dim", Reduces, () -> FloatTensor<X>),
    (guarded_float_max_abs_dim, float_max_abs_dim, "max_abs_dim", Reduces, () -> FloatTensor<X>),
    (guarded_float_any_dim, float_any_dim, "any_dim", Reduces, (out_dtype: BoolDType) -> BoolTensor<X>),
    (guarded_float_all_dim, float_all_dim, "all_dim", Reduces, (out_dtype: BoolDType) -> BoolTensor<X>),
    (guarded_float_max_dim_with_indices, float_max_dim_with_indices, "max_dim_with_indices", Locates, (indices_dtype: IntDType) -> (FloatTensor<X>, IntTensor<X>)),
    (guarded_float_min_dim_with_indices, float_min_dim_with_indices, "min_dim_with_indices", Locates, (indices_dtype: IntDType) -> (FloatTensor<X>, IntTensor<X>)),
    (guarded_float_argmax, float_argmax, "argmax", Locates, (out_dtype: IntDType) -> IntTensor<X>),
    (guarded_float_argmin, float_argmin, "argmin", Locates, (out_dtype: IntDType) -> IntTensor<X>),
    (guarded_float_sort, float_sort, "sort", Ranks, (descending: bool) -> FloatTensor<X>),
    (guarded_float_sort_with_indices, float_sort_with_indices, "sort_with_indices", Ranks, (descending: bool, indices_dtype: IntDType) -> (FloatTensor<X>, IntTensor<X>)),
    (guarded_float_argsort, float_argsort, "argsort", Ranks, (descending: bool, out_dtype: IntDType) -> IntTensor<X>),
    (guarded_float_topk, float_topk, "topk", Ranks, (k: usize) -> FloatTensor<X>),
    (guarded_float_argtopk, float_argtopk, "argtopk", Ranks, (k: usize, out_dtype: IntDType) -> IntTensor<X>),
);

// A mask's count of tokens (`mask.int().sum_dim(1)`), where its first padding lies
// (`ids.equal_elem(pad).int().argmax(1)`, a sequence classifier's last token), whether any is
// padding: as wrong over a shard as a float's.
guarded_reductions!(IntTensor, never_a_parameter;
    (guarded_int_sum_dim, int_sum_dim, "sum_dim", Reduces, () -> IntTensor<X>),
    (guarded_int_mean_dim, int_mean_dim, "mean_dim", Reduces, () -> IntTensor<X>),
    (guarded_int_prod_dim, int_prod_dim, "prod_dim", Reduces, () -> IntTensor<X>),
    (guarded_int_max_dim, int_max_dim, "max_dim", Reduces, () -> IntTensor<X>),
    (guarded_int_min_dim, int_min_dim, "min_dim", Reduces, () -> IntTensor<X>),
    (guarded_int_max_abs_dim, int_max_abs_dim, "max_abs_dim", Reduces, () -> IntTensor<X>),
    (guarded_int_any_dim, int_any_dim, "any_dim", Reduces, (out_dtype: BoolDType) -> BoolTensor<X>),
    (guarded_int_all_dim, int_all_dim, "all_dim", Reduces, (out_dtype: BoolDType) -> BoolTensor<X>),
    (guarded_int_max_dim_with_indices, int_max_dim_with_indices, "max_dim_with_indices", Locates, () -> (IntTensor<X>, IntTensor<X>)),
    (guarded_int_min_dim_with_indices, int_min_dim_with_indices, "min_dim_with_indices", Locates, () -> (IntTensor<X>, IntTensor<X>)),
    (guarded_int_argmax, int_argmax, "argmax", Locates, () -> IntTensor<X>),
    (guarded_int_argmin, int_argmin, "argmin", Locates, () -> IntTensor<X>),
    (guarded_int_sort, int_sort, "sort", Ranks, (descending: bool) -> IntTensor<X>),
    (guarded_int_sort_with_indices, int_sort_with_indices, "sort_with_indices", Ranks, (descending: bool) -> (IntTensor<X>, IntTensor<X>)),
    (guarded_int_argsort, int_argsort, "argsort", Ranks, (descending: bool) -> IntTensor<X>),
    (guarded_int_topk, int_topk, "topk", Ranks, (k: usize) -> IntTensor<X>),
    (guarded_int_argtopk, int_argtopk, "argtopk", Ranks, (k: usize) -> IntTensor<X>),
);

guarded_reductions!(QuantizedTensor, never_a_parameter;
    (guarded_q_sum_dim, q_sum_dim, "sum_dim", Reduces, () -> TensorPrimitive<X>),
    (guarded_q_mean_dim, q_mean_dim, "mean_dim", Reduces, () -> TensorPrimitive<X>),
    (guarded_q_prod_dim, q_prod_dim, "prod_dim", Reduces, () -> TensorPrimitive<X>),
    (guarded_q_max_dim, q_max_dim, "max_dim", Reduces, () -> QuantizedTensor<X>),
    (guarded_q_min_dim, q_min_dim, "min_dim", Reduces, () -> QuantizedTensor<X>),
    (guarded_q_max_abs_dim, q_max_abs_dim, "max_abs_dim", Reduces, () -> QuantizedTensor<X>),
    (guarded_q_any_dim, q_any_dim, "any_dim", Reduces, (out_dtype: BoolDType) -> BoolTensor<X>),
    (guarded_q_all_dim, q_all_dim, "all_dim", Reduces, (out_dtype: BoolDType) -> BoolTensor<X>),
    (guarded_q_max_dim_with_indices, q_max_dim_with_indices, "max_dim_with_indices", Locates, (out_dtype: IntDType) -> (QuantizedTensor<X>, IntTensor<X>)),
    (guarded_q_min_dim_with_indices, q_min_dim_with_indices, "min_dim_with_indices", Locates, (out_dtype: IntDType) -> (QuantizedTensor<X>, IntTensor<X>)),
    (guarded_q_argmax, q_argmax, "argmax", Locates, (out_dtype: IntDType) -> IntTensor<X>),
    (guarded_q_argmin, q_argmin, "argmin", Locates, (out_dtype: IntDType) -> IntTensor<X>),
    (guarded_q_sort, q_sort, "sort", Ranks, (descending: bool) -> QuantizedTensor<X>),
    (guarded_q_sort_with_indices, q_sort_with_indices, "sort_with_indices", Ranks, (descending: bool, out_dtype: IntDType) -> (QuantizedTensor<X>, IntTensor<X>)),
    (guarded_q_argsort, q_argsort, "argsort", Ranks, (descending: bool, out_dtype: IntDType) -> IntTensor<X>),
    (guarded_q_topk, q_topk, "topk", Ranks, (k: usize) -> QuantizedTensor<X>),
    (guarded_q_argtopk, q_argtopk, "argtopk", Ranks, (k: usize, out_dtype: IntDType) -> IntTensor<X>),
);

guarded_reductions!(BoolTensor, never_a_parameter;
    (guarded_bool_any_dim, bool_any_dim, "any_dim", Reduces, () -> BoolTensor<X>),
    (guarded_bool_all_dim, bool_all_dim, "all_dim", Reduces, () -> BoolTensor<X>),
);

/// Panics with `refusal`'s error, if any: ops return tensors, and the training API turns a
/// model's panic into its error (`ulysses_training::catch_model_failure`).
fn refuse(refusal: Option<UlyssesError>) {
    if let Some(error) = refusal {
        panic!("{error}");
    }
}

macro_rules! guarded_dim_ops {
    ($check:ident, $tensor:ident => $output:ident, $(($name:ident, $op:ident, $label:literal)),* $(,)?) => {$(
        #[doc = concat!("`UlyssesBackend`'s `", stringify!($op), "`: the inner backend's, after the guard.")]
        pub fn $name<X: ExchangeBackend>(tensor: $tensor<X>, dim: usize) -> $output<X> {
            refuse($check($label, &tensor.shape(), dim, context::current_sharding));
            X::$op(tensor, dim)
        }
    )*};
}

macro_rules! guarded_flips {
    ($(($name:ident, $tensor:ident, $op:ident)),* $(,)?) => {$(
        #[doc = concat!("`UlyssesBackend`'s `", stringify!($op), "`: the inner backend's, after the guard.")]
        pub fn $name<X: ExchangeBackend>(tensor: $tensor<X>, axes: &[usize]) -> $tensor<X> {
            refuse(flip_over_the_shard("flip", &tensor.shape(), axes, context::current_sharding));
            X::$op(tensor, axes)
        }
    )*};
}

guarded_flips!(
    (guarded_float_flip, FloatTensor, float_flip),
    (guarded_int_flip, IntTensor, int_flip),
    (guarded_bool_flip, BoolTensor, bool_flip),
    (guarded_q_flip, QuantizedTensor, q_flip),
);

macro_rules! guarded_unfolds {
    ($(($name:ident, $tensor:ident, $op:ident)),* $(,)?) => {$(
        #[doc = concat!("`UlyssesBackend`'s `", stringify!($op), "`: the inner backend's, after the guard.")]
        pub fn $name<X: ExchangeBackend>(tensor: $tensor<X>, dim: usize, size: usize, step: usize) -> $tensor<X> {
            refuse(unfold_over_the_shard("unfold", &tensor.shape(), dim, size, step, context::current_sharding));
            X::$op(tensor, dim, size, step)
        }
    )*};
}

guarded_unfolds!((guarded_float_unfold, FloatTensor, float_unfold), (guarded_int_unfold, IntTensor, int_unfold), (guarded_bool_unfold, BoolTensor, bool_unfold));

/// `UlyssesBackend`'s `conv1d`: the inner backend's, after the guard.
pub fn guarded_conv1d<X: ExchangeBackend>(x: FloatTensor<X>, weight: FloatTensor<X>, bias: Option<FloatTensor<X>>, options: ConvOptions<1>) -> FloatTensor<X> {
    let kernel = weight.shape().last().copied().unwrap_or(1);
    let window = Window::new(kernel, options.dilation[0], options.stride[0], options.padding[0], false);
    refuse(window_over_the_shard("conv1d", &x.shape(), window, context::current_sharding));
    X::conv1d(x, weight, bias, options)
}

/// `UlyssesBackend`'s `conv_transpose1d`: the inner backend's, after the guard.
pub fn guarded_conv_transpose1d<X: ExchangeBackend>(x: FloatTensor<X>, weight: FloatTensor<X>, bias: Option<FloatTensor<X>>, options: ConvTransposeOptions<1>) -> FloatTensor<X> {
    let kernel = weight.shape().last().copied().unwrap_or(1);
    let window = Window::new(kernel, options.dilation[0], options.stride[0], options.padding[0], false);
    refuse(transposed_window_over_the_shard(&x.shape(), window, options.padding_out[0], context::current_sharding));
    X::conv_transpose1d(x, weight, bias, options)
}

/// `UlyssesBackend`'s `avg_pool1d`: the inner backend's, after the guard (with no padding,
/// `count_include_pad` changes nothing).
pub fn guarded_avg_pool1d<X: ExchangeBackend>(x: FloatTensor<X>, kernel_size: usize, stride: usize, padding: usize, count_include_pad: bool, ceil_mode: bool) -> FloatTensor<X> {
    refuse(window_over_the_shard("avg_pool1d", &x.shape(), Window::new(kernel_size, 1, stride, padding, ceil_mode), context::current_sharding));
    X::avg_pool1d(x, kernel_size, stride, padding, count_include_pad, ceil_mode)
}

/// `UlyssesBackend`'s `max_pool1d`: the inner backend's, after the guard.
pub fn guarded_max_pool1d<X: ExchangeBackend>(x: FloatTensor<X>, kernel_size: usize, stride: usize, padding: usize, dilation: usize, ceil_mode: bool) -> FloatTensor<X> {
    refuse(window_over_the_shard("max_pool1d", &x.shape(), Window::new(kernel_size, dilation, stride, padding, ceil_mode), context::current_sharding));
    X::max_pool1d(x, kernel_size, stride, padding, dilation, ceil_mode)
}

/// `UlyssesBackend`'s `max_pool1d_with_indices`: the inner backend's, after the guard (its
/// indices count from the shard's first token, as the shard's own positions would).
pub fn guarded_max_pool1d_with_indices<X: ExchangeBackend>(x: FloatTensor<X>, kernel_size: usize, stride: usize, padding: usize, dilation: usize, ceil_mode: bool) -> MaxPool1dWithIndices<X> {
    refuse(window_over_the_shard("max_pool1d", &x.shape(), Window::new(kernel_size, dilation, stride, padding, ceil_mode), context::current_sharding));
    X::max_pool1d_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode)
}

/// `UlyssesBackend`'s `adaptive_avg_pool1d`: the inner backend's, after the guard.
pub fn guarded_adaptive_avg_pool1d<X: ExchangeBackend>(x: FloatTensor<X>, output_size: usize) -> FloatTensor<X> {
    refuse(pooling_of_the_shard_to_a_length(&x.shape(), output_size, context::current_sharding));
    X::adaptive_avg_pool1d(x, output_size)
}

/// `UlyssesBackend`'s `ctc_loss`: the inner backend's, after the guard.
pub fn guarded_ctc_loss<X: ExchangeBackend>(log_probs: FloatTensor<X>, targets: IntTensor<X>, input_lengths: IntTensor<X>, target_lengths: IntTensor<X>, blank: usize) -> FloatTensor<X> {
    refuse(ctc_over_the_shard(&log_probs.shape(), context::current_sharding));
    X::ctc_loss(log_probs, targets, input_lengths, target_lengths, blank)
}

/// Why a CTC loss over log-probabilities of `shape` (`[T, B, C]`) is refused, or `None`: under
/// SP, where its frames are as many as the shard's tokens (or a resampled shard's), they are
/// aligned to the whole transcript as if they were the whole sequence (each rank's loss and
/// gradient, never any part of the sequence's).
pub fn ctc_over_the_shard(shape: &[usize], sharding: impl FnOnce() -> Option<Sharding>) -> Option<UlyssesError> {
    // Frames of another stream (an encoder's whole or replicated input, log-probabilities
    // gathered whole) pass.
    shard_lengths().find(|&shard| shape.first() == Some(&shard))?;
    let what = format!(
        "it aligns the {} frames of this rank's shard to each whole transcript, as if they were the whole sequence: no rank's alignment is any \
         part of the sequence's",
        shape.first().copied().unwrap_or(0)
    );
    let fix = "Gather the log-probabilities of the whole sequence and compute the CTC loss on one rank \
               (burn_ulysses::context::enter_single_device()).";
    shard_local_refusal("ctc_loss", shape, 0, what, fix, sharding)
}

/// `UlyssesBackend`'s `rfft`: the inner backend's, after the guard.
pub fn guarded_rfft<X: ExchangeBackend>(signal: FloatTensor<X>, dim: usize, n: Option<usize>) -> (FloatTensor<X>, FloatTensor<X>) {
    refuse(fft_over_the_shard("rfft", &signal.shape(), dim, context::current_sharding));
    X::rfft(signal, dim, n)
}

/// `UlyssesBackend`'s `irfft`: the inner backend's, after the guard on the signal it makes:
/// `n` points (`2 · (bins − 1)` without), or a shard's tokens where those are the shard's
/// length padded to a power of two (burn's FFT takes no other), once or to twice it (a long
/// convolution by FFT, cropped after).
pub fn guarded_irfft<X: ExchangeBackend>(spectrum_re: FloatTensor<X>, spectrum_im: FloatTensor<X>, dim: usize, n: Option<usize>) -> FloatTensor<X> {
    let spectrum = spectrum_re.shape().to_vec();
    if let Some(&bins) = spectrum.get(dim) {
        let points = n.unwrap_or(2 * bins.saturating_sub(1));
        let padded_from = shard_lengths().filter(|&shard| [shard.next_power_of_two(), (2 * shard).next_power_of_two()].contains(&points));
        for length in std::iter::once(points).chain(padded_from).collect::<Vec<_>>() {
            let mut signal = spectrum.clone();
            signal[dim] = length;
            refuse(fft_over_the_shard("irfft", &signal, dim, context::current_sharding));
        }
    }
    X::irfft(spectrum_re, spectrum_im, dim, n)
}

guarded_dim_ops!(attention_weights_by_hand, FloatTensor => FloatTensor, (guarded_softmax, softmax, "softmax"), (guarded_log_softmax, log_softmax, "log_softmax"), (guarded_softmin, softmin, "softmin"));
guarded_dim_ops!(
    scan_over_the_shard,
    FloatTensor => FloatTensor,
    (guarded_float_cumsum, float_cumsum, "cumsum"),
    (guarded_float_cumprod, float_cumprod, "cumprod"),
    (guarded_float_cummin, float_cummin, "cummin"),
    (guarded_float_cummax, float_cummax, "cummax"),
);
guarded_dim_ops!(
    scan_over_the_shard,
    IntTensor => IntTensor,
    (guarded_int_cumsum, int_cumsum, "cumsum"),
    (guarded_int_cumprod, int_cumprod, "cumprod"),
    (guarded_int_cummin, int_cummin, "cummin"),
    (guarded_int_cummax, int_cummax, "cummax"),
);

guarded_dim_ops!(
    scan_over_the_shard,
    QuantizedTensor => TensorPrimitive,
    (guarded_q_cumsum, q_cumsum, "cumsum"),
    (guarded_q_cumprod, q_cumprod, "cumprod"),
    (guarded_q_cummin, q_cummin, "cummin"),
    (guarded_q_cummax, q_cummax, "cummax"),
);

#[cfg(test)]
mod tests {
    use super::*;

    const SP2: Option<Sharding> = Some(Sharding { ranks: 2, runs: 1, shard: 0, shard_local_attention_on_purpose: false });

    #[test]
    fn scores_of_a_shard_against_itself_are_refused_with_the_fix() {
        let error = attention_by_hand(&[2, 4, 8, 16], &[2, 4, 16, 8], SP2).expect("refused");
        let message = error.to_string();
        for needle in ["[2, 4, 8, 16]", "8 x 8", "2 ranks", "module::attention", "is_causal", "MultiHeadAttention", "global positions", "enter_single_device", "shard_local_attention_on_purpose"] {
            assert!(message.contains(needle), "`{needle}` missing from: {message}");
        }
    }

    #[test]
    fn self_attention_shapes_are_refused() {
        for (lhs, rhs, tokens) in [
            // Scores and weights times values, 4-D heads.
            (&[2, 4, 8, 16][..], &[2, 4, 16, 8][..], 8),
            (&[2, 4, 8, 8], &[2, 4, 8, 16], 8),
            // Heads folded into the batch, batch 1 with several heads, one head with a batch.
            (&[8, 6, 16], &[8, 16, 6], 6),
            (&[8, 6, 6], &[8, 6, 16], 6),
            (&[1, 4, 8, 16], &[1, 4, 16, 8], 8),
            (&[2, 1, 8, 16], &[2, 1, 16, 8], 8),
            // A head as wide as the shard, 5-D grouped heads, kv heads broadcast over their
            // group (scores and weights times values), two tokens.
            (&[2, 4, 8, 8], &[2, 4, 8, 8], 8),
            (&[2, 2, 3, 8, 16], &[2, 2, 3, 16, 8], 8),
            (&[2, 2, 3, 8, 16], &[2, 2, 1, 16, 8], 8),
            (&[2, 2, 3, 8, 8], &[2, 2, 1, 8, 16], 8),
            (&[2, 4, 2, 16], &[2, 4, 16, 2], 2),
            // Weights times values transposed, vᵀ·wᵀ, heads 4-D and folded.
            (&[2, 4, 16, 8], &[2, 4, 8, 8], 8),
            (&[8, 16, 6], &[8, 6, 6], 6),
            // Shared kv heads on the left: vᵀ·wᵀ and k·qᵀ, 4-D and 5-D grouped.
            (&[2, 1, 16, 8], &[2, 4, 8, 8], 8),
            (&[2, 1, 8, 16], &[2, 4, 16, 8], 8),
            (&[2, 2, 1, 16, 8], &[2, 2, 3, 8, 8], 8),
            // One batch, one kv head shared by the query heads.
            (&[1, 4, 8, 16], &[1, 1, 16, 8], 8),
        ] {
            match attention_by_hand(lhs, rhs, SP2) {
                Some(UlyssesError::AttentionByHand { tokens: got, .. }) => assert_eq!(got, tokens, "{lhs:?} · {rhs:?}"),
                other => panic!("{lhs:?} · {rhs:?} not refused: {other:?}"),
            }
        }
    }

    #[test]
    fn other_products_and_contexts_pass() {
        // One rank, no group, the opt-out.
        assert!(attention_by_hand(&[2, 4, 8, 16], &[2, 4, 16, 8], Some(Sharding { ranks: 1, ..SP2.unwrap() })).is_none());
        assert!(attention_by_hand(&[2, 4, 8, 16], &[2, 4, 16, 8], None).is_none());
        assert!(attention_by_hand(&[2, 4, 8, 16], &[2, 4, 16, 8], Some(Sharding { shard_local_attention_on_purpose: true, ..SP2.unwrap() })).is_none());
        for (lhs, rhs) in [
            // A linear layer as wide as the shard, or as its own input (a broadcast weight).
            (&[2, 4, 8, 16][..], &[1, 1, 16, 8][..]),
            (&[2, 16, 16], &[1, 16, 32]),
            // One matrix, and 2-D: a linear layer's shapes.
            (&[1, 8, 16], &[1, 16, 8]),
            (&[8, 16], &[16, 8]),
            // Cross-attention's rectangles, and a product of neither form.
            (&[2, 4, 8, 16], &[2, 4, 16, 12]),
            (&[2, 4, 8, 12], &[2, 4, 12, 16]),
            // A weight per head, broadcast over the batch.
            (&[2, 4, 8, 16], &[1, 4, 16, 8]),
            // A per-token dot product (1 x 1), and a square left operand of one token.
            (&[2, 8, 1, 16], &[2, 8, 16, 1]),
            (&[2, 8, 1, 1], &[2, 8, 1, 16]),
            // A product by a square of one token.
            (&[2, 8, 16, 1], &[2, 8, 1, 1]),
            // Per-token outer products (a contraction of one).
            (&[2, 8, 16, 1], &[2, 8, 1, 16]),
            (&[2, 4, 8, 16, 1], &[2, 4, 8, 1, 16]),
            // A d x d weight per head shared over the batch's one sequence (batch 1), and
            // weights times values where the weights are broadcast (no attention's).
            (&[1, 4, 8, 16], &[1, 1, 16, 16]),
            (&[2, 1, 8, 8], &[2, 4, 8, 16]),
        ] {
            assert!(attention_by_hand(lhs, rhs, SP2).is_none(), "{lhs:?} · {rhs:?} refused");
        }
    }

    #[test]
    fn query_heads_folded_into_rows_are_refused_once_the_shard_length_is_known() {
        // Weights times values of 3 query heads folded over 8 keys, 4-D and heads folded into
        // the batch: refused with the 8 token ids embedded, passed without.
        for (lhs, rhs) in [(&[2, 2, 24, 8][..], &[2, 2, 8, 16][..]), (&[4, 16, 8], &[4, 8, 12])] {
            assert_eq!(attention_matrix_size(lhs, rhs, 8, true), Some(8), "{lhs:?} · {rhs:?}");
            assert_eq!(attention_matrix_size(lhs, rhs, 0, true), None, "{lhs:?} · {rhs:?}");
        }
        for (lhs, rhs) in [
            // Folded scores (also cross-attention's k·qᵀ over a memory of 24), and
            // cross-attention's scores and weights times values over a memory of 16 and 24.
            (&[2, 2, 24, 16][..], &[2, 2, 16, 8][..]),
            (&[2, 4, 8, 16], &[2, 4, 16, 24]),
            (&[2, 4, 8, 16], &[2, 4, 16, 12]),
            (&[2, 4, 8, 24], &[2, 4, 24, 16]),
            // Weights broadcast over the batch (square and folded), one matrix.
            (&[2, 2, 8, 8][..], &[1, 1, 8, 16][..]),
            (&[2, 2, 24, 8], &[1, 2, 8, 16]),
            (&[1, 24, 8], &[1, 8, 16]),
        ] {
            assert_eq!(attention_matrix_size(lhs, rhs, 8, true), None, "{lhs:?} · {rhs:?} refused");
        }
    }

    /// A product per token (the shard's 8 tokens a leading dim, its matrices 4 x 4 or 4 x 16:
    /// hyper-connections' mixing of residual streams, a per-token Gram matrix) passes once the
    /// shard's length is known; per-head scores over the shard, or where the length is unknown,
    /// are still refused.
    #[test]
    fn products_within_each_token_pass_once_the_shard_length_is_known() {
        for (lhs, rhs) in [(&[2, 8, 4, 4][..], &[2, 8, 4, 16][..]), (&[2, 8, 4, 16], &[2, 8, 16, 4]), (&[2, 8, 3, 4, 4], &[2, 8, 3, 4, 4])] {
            assert_eq!(attention_matrix_size(lhs, rhs, 8, true), None, "{lhs:?} · {rhs:?} refused");
            assert!(attention_matrix_size(lhs, rhs, 0, true).is_some(), "{lhs:?} · {rhs:?} passed by shape alone");
        }
        // Scores of 8 heads over the shard's 8 tokens; weights times values.
        for (lhs, rhs) in [(&[2, 8, 8, 16][..], &[2, 8, 16, 8][..]), (&[2, 8, 8, 8], &[2, 8, 8, 16])] {
            assert!(attention_matrix_size(lhs, rhs, 8, true).is_some(), "{lhs:?} · {rhs:?} passed");
        }
    }

    #[test]
    fn sums_over_the_shards_tokens_are_refused_once_the_shard_length_is_known() {
        // With 8 token ids embedded: weights times values of queries in chunks of 3, of 4
        // latents, of one pooling query; folded query heads transposed (vᵀ·wᵀ); linear
        // attention's kᵀ·v; at batch 1, a head of its own (scores, weights times values, 5-D);
        // each passed without.
        for (lhs, rhs) in [
            (&[2, 4, 3, 8][..], &[2, 4, 8, 16][..]),
            (&[2, 4, 4, 8], &[2, 4, 8, 16]),
            (&[2, 4, 1, 8], &[2, 4, 8, 16]),
            (&[2, 2, 16, 8], &[2, 2, 8, 24]),
            (&[2, 4, 16, 8], &[2, 4, 8, 20]),
            (&[1, 1, 8, 16], &[1, 1, 16, 8]),
            (&[1, 1, 3, 8], &[1, 1, 8, 16]),
            (&[1, 1, 1, 8, 8], &[1, 1, 1, 8, 16]),
        ] {
            assert!(attention_matrix_size(lhs, rhs, 8, true).is_some(), "{lhs:?} · {rhs:?}");
            assert_eq!(attention_matrix_size(lhs, rhs, 0, true), None, "{lhs:?} · {rhs:?}");
        }
        // A model that embeds two lengths (a decoder's and a memory's): its sums over the last
        // one (queries of another length over the memory) are not taken for the shard's.
        for (lhs, rhs) in [(&[2, 4, 3, 8][..], &[2, 4, 8, 16][..]), (&[2, 4, 1, 8], &[2, 4, 8, 16]), (&[1, 1, 3, 8], &[1, 1, 8, 16])] {
            assert_eq!(attention_matrix_size(lhs, rhs, 8, false), None, "{lhs:?} · {rhs:?}");
        }
        for (lhs, rhs) in [
            // At batch 1, one matrix 3-D or 2-D (a linear layer's shapes, even as wide as the
            // shard), a head's scores against a memory of another length, a per-head product
            // over the head dim.
            (&[1, 8, 16][..], &[1, 16, 8][..]),
            (&[1, 8, 8], &[1, 8, 16]),
            (&[1, 1, 8, 16], &[1, 1, 16, 12]),
            (&[1, 1, 16, 12], &[1, 1, 12, 16]),
            // Sums over other lengths (cross-attention's memory of 12), and over the shard's
            // length where a weight is broadcast (a linear layer's); 3-D, a stack of experts
            // `[E, C, d]·[E, d, f]` whose width is the shard's (heads folded into the batch
            // in chunks look alike: unguarded).
            (&[2, 4, 3, 12], &[2, 4, 12, 16]),
            (&[4, 3, 8], &[4, 8, 16]),
            (&[2, 4, 16, 8], &[1, 1, 8, 16]),
            (&[2, 4, 3, 8], &[2, 1, 8, 16]),
        ] {
            assert_eq!(attention_matrix_size(lhs, rhs, 8, true), None, "{lhs:?} · {rhs:?} refused");
        }
    }

    #[test]
    fn the_decorator_notes_the_length_of_the_token_ids_it_embeds() {
        use burn::tensor::{Int, Tensor, module::embedding};
        type B = crate::UlyssesBackend<burn::backend::NdArray<f32>>;
        let device = Default::default();
        let _ = embedding(Tensor::<B, 2>::zeros([10, 4], &device), Tensor::<B, 2, Int>::zeros([3, 7], &device));
        assert_eq!(embedded(), (7, true));
        // A timestep's embedding after the tokens' leaves the shard's length.
        let _ = embedding(Tensor::<B, 2>::zeros([10, 4], &device), Tensor::<B, 2, Int>::zeros([3, 1], &device));
        assert_eq!(embedded(), (7, true));
        assert!(attention_by_hand(&[2, 2, 21, 7], &[2, 2, 7, 16], SP2).is_some());
        // A memory of 5 ids embedded after the tokens (cross-attention): its sums pass; the
        // folded weights of the last length are still refused.
        let _ = embedding(Tensor::<B, 2>::zeros([10, 4], &device), Tensor::<B, 2, Int>::zeros([3, 5], &device));
        assert_eq!(embedded(), (5, false));
        assert!(attention_by_hand(&[2, 4, 7, 5], &[2, 4, 5, 16], SP2).is_none());
        assert!(attention_by_hand(&[2, 2, 10, 5], &[2, 2, 5, 16], SP2).is_some());
    }

    /// Softmax over attention weights made without a matmul, and scans along the shard: what
    /// the shape and the embedded length take, and what they leave (logits, other dims).
    #[test]
    fn softmax_over_a_shards_weights_and_scans_along_it_are_refused() {
        let weights = |shape: &[usize], dim: usize| attention_weights_by_hand("softmax", shape, dim, || SP2).map(|e| e.to_string());
        EMBEDDED_TOKENS.set((8, 8));
        let message = weights(&[2, 4, 8, 8], 3).expect("per-head weights refused");
        for needle in ["softmax along dim 3 of a [2, 4, 8, 8] tensor", "8 x 8", "2 ranks", "module::attention", "shard_local_attention_on_purpose"] {
            assert!(message.contains(needle), "`{needle}` missing from: {message}");
        }
        assert!(weights(&[2, 4, 8, 8], 2).is_some() && weights(&[1, 1, 8, 8], 3).is_some() && weights(&[2, 2, 3, 6, 6], 4).is_some());
        // Logits of a vocabulary as long as the shard (3-D), other dims, rectangles, one token.
        for (shape, dim) in [(&[2, 8, 8][..], 2), (&[2, 4, 8, 8], 1), (&[2, 4, 8, 16], 3), (&[2, 4, 1, 1], 3), (&[1, 1, 6, 6], 3)] {
            assert!(weights(shape, dim).is_none(), "{shape:?} over {dim} refused");
        }
        assert!(attention_weights_by_hand("softmax", &[2, 4, 8, 8], 3, || None).is_none(), "refused outside SP");
        let scan = |shape: &[usize], dim: usize| scan_over_the_shard("cumsum", shape, dim, || SP2).map(|e| e.to_string());
        let message = scan(&[2, 8], 1).expect("a scan along the shard refused");
        assert!(message.contains("cumsum along dim 1 of a [2, 8] tensor") && message.contains("SequenceShard::positions"), "{message}");
        assert!(scan(&[8], 0).is_some(), "a 1-D row of the shard");
        // Other dims as long as the shard: a batch, features (`[B, S, D]` with D the shard's length).
        assert!(scan(&[8, 8], 0).is_none() && scan(&[2, 8, 32], 2).is_none() && scan(&[2, 5, 8], 2).is_none());
        // Per head: causal linear attention's running sums over `[B, H, S, dk]` and its state
        // `[B, H, S, dk, dv]`; not where dim 1 is the sequence, nor a 5-D tensor with two dims so long.
        assert!(scan(&[2, 4, 8, 16], 2).is_some_and(|m| m.contains("cumsum along dim 2 of a [2, 4, 8, 16] tensor")));
        assert!(scan(&[2, 4, 8, 16, 16], 2).is_some() && flip_over_the_shard("flip", &[2, 4, 8, 16], &[3, 2], || SP2).is_some());
        assert!(scan(&[2, 8, 4, 16], 2).is_none() && scan(&[2, 4, 8, 8, 16], 2).is_none() && scan(&[2, 4, 8, 16], 3).is_none());
        EMBEDDED_TOKENS.set((8, 5));
        assert!(scan(&[2, 8], 1).is_none(), "a model that embeds two lengths leaves the length's rules off");
        forget_embedded_lengths();
        assert!(scan(&[2, 8], 1).is_none() && weights(&[1, 1, 8, 8], 3).is_none());
        // Where the forward's positions are noted they say which length is the shard's: with
        // two lengths embedded (a prompt's beside the tokens'), or none (ids looked up by
        // `select` from a tied table), the rules stay on.
        let noted = noted(&(8..16).collect::<Vec<_>>(), 2);
        assert!(scan(&[2, 8], 1).is_some() && weights(&[1, 1, 8, 8], 3).is_some(), "no embedding, the shard noted");
        EMBEDDED_TOKENS.set((8, 5));
        assert!(scan(&[2, 8], 1).is_some() && scan(&[2, 5], 1).is_none(), "two lengths embedded, the shard noted");
        EMBEDDED_TOKENS.set((6, 6));
        assert!(scan(&[2, 6], 1).is_some() && scan(&[2, 8], 1).is_none(), "one length embedded goes first");
        // Features of flattened tokens `[B·S, D]`, D the shard's length, beside the batch's 2
        // rows: pass; the batch's rows of tokens: refused.
        EMBEDDED_TOKENS.set((8, 8));
        assert!(scan(&[16, 8], 1).is_none() && flip_over_the_shard("flip", &[16, 8], &[1], || SP2).is_none(), "features of flattened tokens refused");
        assert!(scan(&[2, 8], 1).is_some() && flip_over_the_shard("flip", &[2, 8], &[1], || SP2).is_some());
        // Other first dims, along the tokens: per-head gates `[H, S]` and `[B·H, S]`, a row `[1, S]`.
        for rows in [4, 6, 1] {
            assert!(scan(&[rows, 8], 1).is_some() && flip_over_the_shard("flip", &[rows, 8], &[1], || SP2).is_some(), "[{rows}, 8] let through");
        }
        drop(noted);
        forget_embedded_lengths();
    }

    /// Windows that tile the shard resample it (pooled by 2: 4 places for its 8 tokens): the
    /// rules that go by the shard's length see the new lengths too, until a backward.
    #[test]
    fn a_resampled_shard_is_still_the_shard() {
        EMBEDDED_TOKENS.set((8, 8));
        let conv = |shape: &[usize]| window_over_the_shard("conv1d", shape, Window::new(3, 1, 1, 1, false), || SP2).map(|e| e.to_string());
        let tiling = |op: &'static str, shape: &[usize]| window_over_the_shard(op, shape, Window::new(2, 1, 2, 0, false), || SP2);
        assert!(conv(&[2, 16, 4]).is_none(), "a length of 4 refused before any pooling");
        assert!(tiling("avg_pool1d", &[2, 16, 8]).is_none());
        assert!(conv(&[2, 16, 4]).is_some_and(|m| m.contains("the 4 tokens of this rank's shard")), "a convolution of the pooled shard let through");
        assert!(flip_over_the_shard("flip", &[2, 4, 16], &[1], || SP2).is_some(), "a flip of the pooled shard let through");
        // Pooled again (4 → 2), then upsampled by 7 (2 → 14).
        assert!(tiling("max_pool1d", &[2, 16, 4]).is_none() && conv(&[2, 16, 2]).is_some());
        // A length that is one of the shard's is taken as it, not as the later 2 padded by burn:
        // windows of 4 that tile the 4 places pass (one window of a pooled stream: a fixed
        // factor's, as right under SP as any other).
        assert!(window_over_the_shard("avg_pool1d", &[2, 16, 4], Window::new(4, 1, 4, 0, false), || SP2).is_none());
        assert!(conv(&[2, 16, 14]).is_none());
        assert!(transposed_window_over_the_shard(&[2, 16, 2], Window::new(7, 1, 7, 0, false), 0, || SP2).is_none());
        assert!(conv(&[2, 16, 14]).is_some_and(|m| m.contains("the 14 tokens")));
        forget_embedded_lengths();
        EMBEDDED_TOKENS.set((8, 8));
        assert!(conv(&[2, 16, 4]).is_none() && conv(&[2, 16, 14]).is_none(), "a backward forgets the resampled lengths");
    }

    /// A real FFT along the sequence dim (`[B, S, D]`'s dim 1, channels-first `[B, C, L]`'s
    /// dim 2, per-head `[B, H, S, D]`'s dim 2) as long as the shard is refused; along the
    /// features, another length, or outside SP, not.
    #[test]
    fn ffts_along_the_shard_are_refused() {
        EMBEDDED_TOKENS.set((8, 8));
        let fft = |shape: &[usize], dim: usize| fft_over_the_shard("rfft", shape, dim, || SP2).map(|e| e.to_string());
        let message = fft(&[2, 8, 16], 1).expect("an FFT along the sequence refused");
        for needle in ["rfft along dim 1 of a [2, 8, 16] tensor", "every token of the whole sequence", "enter_single_device", "2 ranks"] {
            assert!(message.contains(needle), "`{needle}` missing from: {message}");
        }
        assert!(fft(&[2, 16, 8], 2).is_some() && fft(&[2, 4, 8, 16], 2).is_some() && fft(&[8], 0).is_some());
        assert!(fft(&[2, 8, 16], 2).is_none() && fft(&[2, 16, 16], 1).is_none() && fft(&[2, 16, 8], 1).is_none());
        assert!(fft_over_the_shard("rfft", &[2, 8, 16], 1, || None).is_none(), "refused outside SP");
        // Where positions are noted (2 rows of 8 tokens, then a tile of 4): over flattened
        // tokens' features (an STFT's frames) and a tile's features, as many as the shard's
        // tokens, pass; along the tokens, still refused.
        let _shard = noted(&(8..16).collect::<Vec<_>>(), 2);
        assert!(fft(&[16, 8], 1).is_none() && fft(&[2, 8, 8], 2).is_none() && fft(&[2, 8, 16], 1).is_some() && fft(&[2, 8], 1).is_some());
        let _tile = note_tile_of_the_shard(4..8);
        assert!(fft(&[2, 4, 8], 2).is_none() && fft(&[8, 8], 1).is_none(), "a tile's features refused");
    }

    /// Flips of the sequence dim, and convolutions and pooling windows of two tokens or more
    /// along a length as long as the shard: what they take and what they leave (other dims, a
    /// pointwise window, another length, outside SP).
    #[test]
    fn flips_of_the_shard_and_windows_along_it_are_refused() {
        EMBEDDED_TOKENS.set((8, 8));
        let flip = |shape: &[usize], axes: &[usize]| flip_over_the_shard("flip", shape, axes, || SP2).map(|e| e.to_string());
        let message = flip(&[2, 8, 16], &[1]).expect("a flip of the sequence refused");
        for needle in ["flip along dim 1 of a [2, 8, 16] tensor", "reversed within itself", "before it is sharded", "2 ranks", "shard_local_attention_on_purpose"] {
            assert!(message.contains(needle), "`{needle}` missing from: {message}");
        }
        assert!(flip(&[2, 8], &[0, 1]).is_some() && flip(&[8], &[0]).is_some());
        assert!(flip(&[2, 8, 16], &[2]).is_none() && flip(&[8, 8], &[0]).is_none() && flip(&[2, 5, 8], &[1, 2]).is_none());
        let sliding = |span: usize| Window::new(span, 1, 1, span / 2, false);
        let window = |shape: &[usize], window: Window| window_over_the_shard("conv1d", shape, window, || SP2).map(|e| e.to_string());
        let message = window(&[2, 16, 8], sliding(3)).expect("a convolution along the shard refused");
        for needle in ["conv1d along dim 2 of a [2, 16, 8] tensor", "windows of 3 tokens, 1 apart", "padding where the neighbouring ranks' tokens are", "halo", "enter_single_device", "tile the shard"] {
            assert!(message.contains(needle), "`{needle}` missing from: {message}");
        }
        // Padded by burn beforehand (a causal convolution's window − 1 on the left).
        let message = window(&[2, 16, 10], Window::new(3, 1, 1, 0, false)).expect("a padded shard refused");
        assert!(message.contains("shard (padded to 10)"), "{message}");
        // Dilated: 3 taps 2 apart span 5 tokens.
        assert!(window(&[2, 16, 12], Window::new(3, 2, 1, 0, false)).is_some_and(|m| m.contains("windows of 5 tokens")));
        // A pointwise window, a length other than the shard's (or padded by more than the
        // span), channels as long as the shard, not 3-D.
        for (shape, size) in [(&[2, 16, 8][..], Window::new(1, 1, 1, 0, false)), (&[2, 16, 7], sliding(3)), (&[2, 16, 11], sliding(3)), (&[2, 8, 16], sliding(3)), (&[2, 4, 16, 8], sliding(3))] {
            assert!(window(shape, size).is_none(), "{shape:?} with {size:?} refused");
        }
        // Windows that tile the shard (a patch embedding, pooling by 2 or 4, a kernel shorter
        // than its stride) pass; ones that overlap, pad, straddle the shard's end (8 % 3) or
        // add a ceil-mode output past it, and a strided pointwise one that starts where the
        // sequence's do not, are refused.
        for tiling in [Window::new(2, 1, 2, 0, false), Window::new(4, 1, 4, 0, true), Window::new(2, 1, 4, 0, false), Window::new(2, 2, 4, 0, false)] {
            assert!(window(&[2, 16, 8], tiling).is_none(), "{tiling:?} refused");
        }
        for straddling in [Window::new(3, 1, 2, 0, false), Window::new(2, 1, 2, 1, false), Window::new(3, 1, 3, 0, false), Window::new(2, 1, 4, 0, true), Window::new(1, 1, 3, 0, false), Window::new(2, 3, 2, 0, false)] {
            assert!(window(&[2, 16, 8], straddling).is_some(), "{straddling:?} let through");
        }
        // Under a zigzag ring each half of the shard is a run: 4 tokens tile by 4, not by 8.
        let zigzag = || Some(Sharding { runs: 2, ..SP2.unwrap() });
        assert!(window_over_the_shard("avg_pool1d", &[2, 16, 8], Window::new(4, 1, 4, 0, false), zigzag).is_none());
        assert!(window_over_the_shard("avg_pool1d", &[2, 16, 8], Window::new(8, 1, 8, 0, false), zigzag).is_some());
        // One window over the whole shard (a kernel of the input's length, TextCNN's max over
        // time) pools it as if it were the sequence: refused (under a zigzag ring too).
        let whole = window(&[2, 16, 8], Window::new(8, 1, 8, 0, false)).map(|e| e.to_string()).expect("a window over the whole shard let through");
        assert!(whole.contains("windows of 8 tokens") && whole.contains("a window shorter than the shard"), "{whole}");
        assert!(window_over_the_shard("conv1d", &[2, 16, 8], sliding(3), || None).is_none(), "refused outside SP");
        assert!(window_over_the_shard("conv1d", &[2, 16, 8], sliding(3), || Some(Sharding { ranks: 1, ..SP2.unwrap() })).is_none(), "refused at SP = 1");
        // Unfolds along the sequence dim ([B, S, D]'s 1, channels-first [B, C, L]'s 2): sliding
        // windows refused, chunks that tile the shard pass, the features of a [B, S, D] as
        // wide as the shard and other lengths pass.
        let unfold = |shape: &[usize], dim: usize, size: usize, step: usize| unfold_over_the_shard("unfold", shape, dim, size, step, || SP2).map(|e| e.to_string());
        let message = unfold(&[2, 8, 16], 1, 3, 1).expect("sliding windows along the sequence refused");
        for needle in ["unfold along dim 1 of a [2, 8, 16] tensor", "windows of 3 tokens, 1 apart", "halo"] {
            assert!(message.contains(needle), "`{needle}` missing from: {message}");
        }
        assert!(unfold(&[2, 8, 16], 1, 4, 4).is_none() && unfold(&[2, 8, 16], 1, 3, 3).is_some());
        assert!(unfold(&[2, 16, 8], 2, 3, 1).is_some() && unfold(&[2, 16, 8], 2, 2, 2).is_none());
        assert!(unfold(&[2, 8, 8], 2, 3, 1).is_none(), "the features of a [B, S, D] as wide as the shard refused");
        assert!(unfold(&[2, 16, 16], 1, 3, 1).is_none() && unfold(&[8, 16], 0, 3, 1).is_none());
        // Per head, [B, H, S, D]: the sequence is dim 2.
        assert!(unfold(&[2, 4, 8, 16], 2, 3, 1).is_some() && unfold(&[2, 4, 8, 16], 2, 4, 4).is_none() && unfold(&[2, 4, 8, 16], 3, 3, 1).is_none());
        // A transposed convolution: each token writing its own block (kernel, with the output
        // padding, = stride; no padding) passes; overlapping, cropped or gapped blocks do not.
        let transposed = |kernel: usize, stride: usize, padding: usize, padding_out: usize| {
            transposed_window_over_the_shard(&[2, 16, 8], Window::new(kernel, 1, stride, padding, false), padding_out, || SP2).map(|e| e.to_string())
        };
        assert!(transposed(2, 2, 0, 0).is_none() && transposed(1, 1, 0, 0).is_none() && transposed(3, 4, 0, 1).is_none());
        let message = transposed(4, 2, 1, 0).expect("overlapping blocks refused");
        for needle in ["conv_transpose1d along dim 2 of a [2, 16, 8] tensor", "writes 4 outputs, 2 apart", "padding 1", "passes"] {
            assert!(message.contains(needle), "`{needle}` missing from: {message}");
        }
        assert!(transposed(2, 2, 1, 0).is_some() && transposed(3, 4, 0, 0).is_some() && transposed(1, 2, 0, 0).is_some());
        assert!(transposed_window_over_the_shard(&[2, 16, 9], Window::new(4, 1, 2, 0, false), 0, || SP2).is_none(), "another length refused");
        // Pooled to another length: refused, to one output (a classifier's mean) too; to the
        // shard's own length it changes nothing.
        let pooled = |output_size: usize| pooling_of_the_shard_to_a_length(&[2, 16, 8], output_size, || SP2).map(|e| e.to_string());
        let message = pooled(1).expect("a mean over the shard refused");
        for needle in ["adaptive_avg_pool1d along dim 2", "pools the 8 tokens of this rank's shard to 1", "kernel = stride"] {
            assert!(message.contains(needle), "`{needle}` missing from: {message}");
        }
        assert!(pooled(4).is_some() && pooled(16).is_some() && pooled(8).is_none());
        forget_embedded_lengths();
        assert!(flip(&[2, 8, 16], &[1]).is_none() && window(&[2, 16, 8], sliding(3)).is_none(), "before any embedding");
    }

    /// Positions noted for one thread: `rows` rows each of `ids`.
    fn noted(ids: &[u64], rows: usize) -> ShardPositionsNoted {
        let positions = crate::visibility::PositionIds::new(ids.repeat(rows), rows, ids.len()).expect("ids");
        note_shard_positions(&ShardPositions { ids: positions, packed: false, cut: ShardCut { of: 2, index: 0, runs: 1 } })
    }

    /// Document position ids that are not the noted shard's (counted within the shard) are
    /// refused; the shard's own pass, and so does anything where nothing is noted.
    #[test]
    fn document_ids_counted_within_the_shard_are_refused() {
        let shard_ids: Vec<u64> = [(8..16).collect::<Vec<u64>>(), (0..8).collect()].concat();
        let ids = |ids: Vec<u64>| PositionIds::new(ids, 2, 8).expect("ids");
        assert!(documents_not_the_shards(&ids((0..16).map(|i| i % 8).collect()), SP2).is_none(), "nothing noted");
        let _noted = note_shard_positions(&ShardPositions { ids: ids(shard_ids.clone()), packed: true, cut: ShardCut { of: 2, index: 0, runs: 1 } });
        let message = documents_not_the_shards(&ids((0..16).map(|i| i % 8).collect()), SP2).expect("local ids refused").to_string();
        for needle in ["run from 0 to 7", "from 8 to 7", "SequenceShard::positions.ids"] {
            assert!(message.contains(needle), "`{needle}` missing from: {message}");
        }
        assert!(documents_not_the_shards(&ids(shard_ids), SP2).is_none(), "the shard's own ids refused");
        assert!(documents_not_the_shards(&ids((0..16).map(|i| i % 8).collect()), None).is_none(), "refused outside SP");
    }

    /// A query whose heads and tokens are swapped (`[B, S, H, D]`) is refused where the
    /// shard's length is known; one whose heads are as many as the shard's tokens is not.
    #[test]
    fn a_query_with_its_heads_and_tokens_swapped_is_refused() {
        assert!(heads_and_tokens_swapped(&[2, 8, 4, 16]).is_none(), "no length known");
        EMBEDDED_TOKENS.set((8, 8));
        let message = heads_and_tokens_swapped(&[2, 8, 4, 16]).expect("[B, S, H, D] refused").to_string();
        for needle in ["[2, 8, 4, 16]", "dim 1 (8)", "dim 2 (4)", ".swap_dims(1, 2)", "silently wrong"] {
            assert!(message.contains(needle), "`{needle}` missing from: {message}");
        }
        assert!(heads_and_tokens_swapped(&[2, 4, 8, 16]).is_none() && heads_and_tokens_swapped(&[2, 8, 8, 16]).is_none());
        forget_embedded_lengths();
    }

    /// A square block of a matrix over the sequence's tokens, cut to the shard's length: a
    /// gMLP's spatial weight, a causal mask buffer's `[:T, :T]`.
    #[test]
    fn a_token_matrix_cut_to_the_shard_is_refused() {
        let cut = |shape: &[usize], slices: &[Slice], activation: bool| token_matrix_cut_to_the_shard(shape, slices, activation, || SP2).map(|e| e.to_string());
        let block = |range: Range<usize>| [Slice::from(range.clone()), Slice::from(range)];
        assert!(cut(&[32, 32], &block(0..8), false).is_none(), "nothing noted");
        let _noted = noted(&(8..16).collect::<Vec<_>>(), 2);
        let message = cut(&[32, 32], &block(0..8), false).expect("a spatial weight cut to the shard refused");
        for needle in ["slice along dim 1 of a [32, 32] tensor", "8 x 8 block 0..8", "gMLP", "2 ranks", "enter_single_device"] {
            assert!(message.contains(needle), "`{needle}` missing from: {message}");
        }
        assert!(cut(&[32, 32], &block(8..16), false).is_some(), "at the shard's own rows too: the other ranks' columns are missing");
        assert!(cut(&[1, 1, 32, 32], &[Slice::full(), Slice::full(), Slice::from(0..8), Slice::from(0..8)], false).is_some(), "a mask buffer");
        // An activation, rows and columns apart, another length, one dim, a matrix shorter
        // than the sequence, outside SP: no such block.
        assert!(cut(&[32, 32], &block(0..8), true).is_none() && cut(&[32, 32], &[Slice::from(0..8), Slice::from(8..16)], false).is_none());
        assert!(cut(&[32, 32], &block(0..6), false).is_none() && cut(&[32, 32], &[Slice::from(0..8), Slice::full()], false).is_none());
        assert!(cut(&[12, 12], &block(0..8), false).is_none() && token_matrix_cut_to_the_shard(&[32, 32], &block(0..8), false, || None).is_none());
    }

    #[test]
    fn positions_counted_from_another_shards_first_token_are_refused() {
        let sliced = |shape: &[usize], dim: usize, rows: Range<usize>| {
            let slices: Vec<Slice> = (0..shape.len()).map(|d| if d == dim { Slice::from(rows.clone()) } else { Slice::full() }).collect();
            positions_sliced_from_a_table(shape, &slices, false, true, || SP2).map(|e| e.to_string())
        };
        let counted = |range: Range<i64>| positions_counted_by_arange(&range, 1, || SP2).map(|e| e.to_string());
        assert!(sliced(&[32, 4, 2], 0, 0..8).is_none() && counted(0..8).is_none(), "nothing noted");
        {
            // SP rank 1 of 2, 8 tokens a row at positions 8..16.
            let _noted = noted(&(8..16).collect::<Vec<_>>(), 2);
            // RoPE's frequencies [max_len, d, 2] and burn-nn's sinusoids [1, max_len, d] from 0.
            let message = sliced(&[32, 4, 2], 0, 0..8).expect("RoPE from 0 on rank 1 refused");
            for needle in ["slice takes rows 0..8 along dim 0 of a [32, 4, 2] table", "8 tokens sit at positions 8..16", "2 ranks", "RotaryEncoding::apply(x, shard.position_offset)", "positions.ids", "attention_guard::not_positions"] {
                assert!(message.contains(needle), "`{needle}` missing from: {message}");
            }
            assert!(sliced(&[1, 32, 16], 1, 0..8).is_some() && sliced(&[32, 16], 0, 4..12).is_some());
            // This rank's own rows pass; so do other lengths, a table too short for every rank's
            // positions (shorter than the sequence over the ranks: the shard's own length, a few
            // tokens more), a cut of the features, a batch of rows, an activation, a step.
            assert!(sliced(&[32, 4, 2], 0, 8..16).is_none() && sliced(&[1, 32, 16], 1, 8..16).is_none());
            assert!(sliced(&[32, 4, 2], 0, 0..4).is_none() && sliced(&[32, 4, 2], 0, 0..16).is_none());
            assert!(sliced(&[8, 16], 0, 0..8).is_none() && sliced(&[1, 10, 16], 1, 0..8).is_none() && sliced(&[15, 16], 0, 0..8).is_none());
            // Indices or weights as long as the shard that are no positions, built inside
            // `not_positions`, pass.
            assert!(not_positions(|| counted(0..8).is_none() && sliced(&[32, 16], 0, 0..8).is_none()) && counted(0..8).is_some());
            assert!(sliced(&[32, 8], 1, 0..8).is_none() && sliced(&[32, 16, 8], 2, 0..8).is_none() && sliced(&[2, 32, 16], 1, 0..8).is_none());
            assert!(sliced(&[32], 0, 0..8).is_none(), "a 1-D tensor (a flat buffer) refused");
            let slices = [Slice::from(0..8), Slice::full()];
            assert!(positions_sliced_from_a_table(&[32, 16], &slices, true, true, || SP2).is_none(), "an activation refused");
            assert!(positions_sliced_from_a_table(&[32, 16], &[Slice::new(0, Some(16), 2), Slice::full()], false, true, || SP2).is_none());
            // Position ids `[1, max_len]` (no features after): refused from 0 as an int table.
            assert!(positions_sliced_from_a_table(&[1, 32], &[Slice::full(), Slice::from(0..8)], false, false, || SP2).is_some());
            assert!(positions_sliced_from_a_table(&[1, 32], &[Slice::full(), Slice::from(0..8)], false, true, || SP2).is_none());
            // arange over the shard from 0 (a learned position embedding's ids) refused; this
            // rank's positions, other lengths or steps pass; so does anything at one rank, or
            // with the guard opted out.
            let message = counted(0..8).expect("arange(0..8) on rank 1 refused");
            assert!(message.contains("arange counts positions 0..8") && message.contains("positions 8..16"), "{message}");
            assert!(counted(8..16).is_none() && counted(0..4).is_none() && counted(0..16).is_none());
            assert!(positions_counted_by_arange(&(0..16), 2, || SP2).is_none());
            let one_rank = Some(Sharding { ranks: 1, ..SP2.unwrap() });
            let opted_out = Some(Sharding { shard_local_attention_on_purpose: true, ..SP2.unwrap() });
            for sharding in [None, one_rank, opted_out] {
                assert!(positions_counted_by_arange(&(0..8), 1, || sharding).is_none() && positions_sliced_from_a_table(&[32, 16], &slices, false, true, || sharding).is_none());
            }
            {
                // Rank 0 of the same group: from 0 is its own.
                let _rank_0 = noted(&(0..8).collect::<Vec<_>>(), 2);
                assert!(sliced(&[32, 4, 2], 0, 0..8).is_none() && counted(0..8).is_none() && sliced(&[32, 4, 2], 0, 8..16).is_some());
                // A shard's activation a few tokens longer (registers prepended) is no table.
                assert!(sliced(&[1, 10, 16], 1, 2..10).is_none());
            }
            assert!(counted(0..8).is_some(), "rank 1's positions back once rank 0's are dropped");
        }
        assert!(counted(0..8).is_none(), "the positions are forgotten when their note is dropped");
        // A zigzag ring's shard (two chunks apart) or packed documents: no one run, so no
        // slice or arange of the shard's length is right.
        let _zigzag = noted(&[4, 5, 6, 7, 24, 25, 26, 27], 2);
        let message = sliced(&[32, 4, 2], 0, 4..12).expect("one run refused where the shard holds two");
        assert!(message.contains("no one run from a common start"), "{message}");
        assert!(counted(4..12).is_some() && counted(24..32).is_some());
    }

    /// Positions counted on the host as if the shard were the sequence, uploaded inside a noted
    /// forward: ids or a float ramp from 0, a table of sinusoids from position 0.
    #[test]
    fn positions_uploaded_from_the_host_are_refused() {
        use burn::tensor::TensorData;
        let ramp = |values: std::ops::Range<i64>, shape: Vec<usize>| TensorData::new(values.cycle().take(shape.iter().product()).collect::<Vec<_>>(), shape);
        let float_ramp = |values: std::ops::Range<i64>, shape: Vec<usize>| ramp(values, shape).convert::<f32>();
        // burn-nn's `generate_sinusoids(len, d, ..)` at positions `from..from + len`.
        let sinusoids = |from: usize, len: usize, d: usize| {
            let values = (from..from + len).flat_map(|p| (0..d / 2).flat_map(move |k| {
                let angle = p as f32 * (-(k as f32 * 2.0) * (10_000f32).ln() / d as f32).exp();
                [angle.sin(), angle.cos()]
            }));
            TensorData::new(values.collect::<Vec<_>>(), [len, d])
        };
        let uploaded = |data: &TensorData| positions_uploaded(data, || SP2).map(|e| e.to_string());
        assert!(uploaded(&ramp(0..8, vec![8])).is_none() && uploaded(&sinusoids(0, 8, 4)).is_none(), "nothing noted");
        {
            // SP rank 1 of 2, 8 tokens a row at positions 8..16.
            let _noted = noted(&(8..16).collect::<Vec<_>>(), 2);
            let message = uploaded(&ramp(0..8, vec![8])).expect("ids 0..8 uploaded on rank 1 refused");
            for needle in ["from_data uploads positions 0..8", "counted on the host", "positions 8..16", "2 ranks", "positions.ids", "not_positions"] {
                assert!(message.contains(needle), "`{needle}` missing from: {message}");
            }
            // Ids a row `[B, S]`, `[1, S]`, a column `[S, 1]`, a float ramp, unsigned: refused.
            for data in [ramp(0..8, vec![2, 8]), ramp(0..8, vec![1, 8]), ramp(0..8, vec![8, 1]), float_ramp(0..8, vec![1, 8]), ramp(0..8, vec![8]).convert::<u32>()] {
                assert!(uploaded(&data).is_some(), "{:?} {:?} refused", data.dtype, data.shape);
            }
            // This rank's positions pass; so do other lengths, what is no ramp, booleans.
            assert!(uploaded(&ramp(8..16, vec![2, 8])).is_none() && uploaded(&ramp(0..4, vec![4])).is_none() && uploaded(&ramp(0..16, vec![16])).is_none());
            assert!(uploaded(&TensorData::new(vec![3i64; 8], [8])).is_none() && uploaded(&TensorData::new(vec![true; 8], [8])).is_none());
            let mut shuffled = ramp(0..8, vec![8]).to_vec::<i64>().unwrap();
            shuffled.swap(2, 5);
            assert!(uploaded(&TensorData::new(shuffled, [8])).is_none());
            // A table of sinusoids from position 0 (`[S, D]`, or RoPE's `[1, 1, S, D]`): refused;
            // at this rank's positions, or a mask of 0 and 1, or zeros: pass.
            let message = uploaded(&sinusoids(0, 8, 4)).expect("sinusoids from 0 on rank 1 refused");
            for needle in ["from_data uploads a [8, 4] table", "first token of this rank's shard (dim 0) is position 0's", "generate_sinusoids", "positions 8..16"] {
                assert!(message.contains(needle), "`{needle}` missing from: {message}");
            }
            let cos_table = TensorData::new((0..8).flat_map(|p| (0..4).map(move |k| (p as f32 / (k + 1) as f32).cos())).collect::<Vec<_>>(), [1, 1, 8, 4]);
            assert!(uploaded(&cos_table).is_some(), "RoPE's cos from 0 refused");
            assert!(uploaded(&sinusoids(8, 8, 4)).is_none() && uploaded(&sinusoids(0, 8, 4).convert::<i64>()).is_none());
            let mask = TensorData::new((0..8).flat_map(|r| (0..4).map(move |c| if c <= r { 1.0f32 } else { 0.0 })).collect::<Vec<_>>(), [8, 4]);
            assert!(uploaded(&mask).is_none() && uploaded(&TensorData::new(vec![0.0f32; 32], [8, 4])).is_none());
            assert!(uploaded(&sinusoids(0, 8, 4).convert::<burn::tensor::bf16>()).is_some(), "bf16 sinusoids from 0 refused");
            // A gradient whose first row an ignored label zeroed (sin 0 alone: no constant).
            let zeroed_first_row = TensorData::new((0..32).map(|i| if i < 4 { 0.0f32 } else { 0.25 + i as f32 }).collect::<Vec<_>>(), [8, 4]);
            assert!(uploaded(&zeroed_first_row).is_none(), "a first row of zeros followed by values refused");
            // Two dims as long as the shard: no telling which; nothing at one rank or opted out.
            assert!(uploaded(&TensorData::new(sinusoids(0, 8, 8).to_vec::<f32>().unwrap(), [8, 8])).is_none());
            assert!(not_positions(|| uploaded(&ramp(0..8, vec![8]))).is_none());
            for sharding in [None, Some(Sharding { ranks: 1, ..SP2.unwrap() }), Some(Sharding { shard_local_attention_on_purpose: true, ..SP2.unwrap() })] {
                assert!(positions_uploaded(&ramp(0..8, vec![8]), || sharding).is_none() && positions_uploaded(&sinusoids(0, 8, 4), || sharding).is_none());
            }
            {
                // Rank 0: from 0 is its own.
                let _rank_0 = noted(&(0..8).collect::<Vec<_>>(), 2);
                assert!(uploaded(&ramp(0..8, vec![8])).is_none() && uploaded(&sinusoids(0, 8, 4)).is_none() && uploaded(&ramp(8..16, vec![8])).is_some());
                // A tile of 4 rows from row 4: a table of 4 from position 0 is another tile's, at
                // any SP degree; the tile's own rows pass.
                let _tile = note_tile_of_the_shard(4..8);
                let message = positions_uploaded(&sinusoids(0, 4, 6), || None).expect("a tile's sinusoids from 0 refused on one device").to_string();
                assert!(message.contains("rows 4..8") && message.contains("first token of this tile of the shard"), "{message}");
                assert!(positions_uploaded(&sinusoids(4, 4, 6), || None).is_none() && uploaded(&ramp(0..4, vec![4])).is_some() && uploaded(&ramp(4..8, vec![4])).is_none());
            }
        }
        {
            // Shards of fewer than four tokens: too short to tell positions from small counts.
            let _short = noted(&[3, 4, 5], 2);
            assert!(uploaded(&ramp(0..3, vec![3])).is_none() && uploaded(&sinusoids(0, 3, 4)).is_none());
        }
        // A zigzag ring's shard: ids 0..8 are no one run of it.
        let _zigzag = noted(&[4, 5, 6, 7, 24, 25, 26, 27], 2);
        assert!(uploaded(&ramp(0..8, vec![8])).is_some() && uploaded(&sinusoids(0, 8, 4)).is_some());
    }

    #[test]
    fn a_few_tokens_dropped_from_an_end_of_the_shard_are_refused() {
        let shifted = |shape: &[usize], dim: usize, rows: Range<usize>| {
            let slices: Vec<Slice> = (0..shape.len()).map(|d| if d == dim { Slice::from(rows.clone()) } else { Slice::full() }).collect();
            shard_shifted_by_a_slice(shape, &slices, || SP2).map(|e| e.to_string())
        };
        assert!(shifted(&[2, 8, 16], 1, 0..7).is_none(), "nothing noted");
        let _noted = noted(&(8..16).collect::<Vec<_>>(), 2);
        let message = shifted(&[2, 8, 16], 1, 0..7).expect("a token shift refused");
        for needle in ["slice along dim 1 of a [2, 8, 16] tensor", "drops the last 1 of the 8 tokens", "halo", "enter_single_device"] {
            assert!(message.contains(needle), "`{needle}` missing from: {message}");
        }
        // From the start, by two (a quarter), per head [B, H, S, D], channels first [B, C, L].
        assert!(shifted(&[2, 8, 16], 1, 1..8).is_some() && shifted(&[2, 8, 16], 1, 2..8).is_some());
        assert!(shifted(&[2, 4, 8, 16], 2, 0..7).is_some() && shifted(&[2, 16, 8], 2, 1..8).is_some());
        // More than a quarter (a forward's tiles: halves or less), the middle, the whole, other
        // dims (features as long as the shard, heads), another length: pass.
        assert!(shifted(&[2, 8, 16], 1, 0..4).is_none() && shifted(&[2, 8, 16], 1, 4..8).is_none() && shifted(&[2, 8, 16], 1, 0..5).is_none());
        assert!(shifted(&[2, 8, 16], 1, 1..7).is_none() && shifted(&[2, 8, 16], 1, 0..8).is_none());
        assert!(shifted(&[2, 8, 8], 2, 0..7).is_none() && shifted(&[2, 4, 8, 16], 3, 0..7).is_none() && shifted(&[2, 9, 16], 1, 0..8).is_none());
        // As many heads as tokens (`[B, H, S, D]` or `[B, S, H, D]`): no telling; a 1-D buffer.
        assert!(shifted(&[2, 8, 8, 16], 1, 0..7).is_none() && shifted(&[2, 8, 8, 16], 2, 0..7).is_none() && shifted(&[8], 0, 0..7).is_none());
        {
            // A shard of 32: up to four tokens is a shift; a chunk of 27 (5 left over) is not.
            let _longer = noted(&(32..64).collect::<Vec<_>>(), 2);
            assert!(shifted(&[2, 32, 16], 1, 0..28).is_some() && shifted(&[2, 32, 16], 1, 4..32).is_some());
            assert!(shifted(&[2, 32, 16], 1, 0..27).is_none() && shifted(&[2, 32, 16], 1, 5..32).is_none());
        }
        assert!(not_positions(|| shifted(&[2, 8, 16], 1, 0..7)).is_none(), "not_positions lets a slice through");
        // One rank, the opt-out.
        let slices = [Slice::full(), Slice::from(0..7), Slice::full()];
        assert!(shard_shifted_by_a_slice(&[2, 8, 16], &slices, || Some(Sharding { ranks: 1, ..SP2.unwrap() })).is_none());
        assert!(shard_shifted_by_a_slice(&[2, 8, 16], &slices, || Some(Sharding { shard_local_attention_on_purpose: true, ..SP2.unwrap() })).is_none());
    }

    #[test]
    fn a_token_picked_from_the_shard_is_refused() {
        let picked = |shape: &[usize], dim: usize, rows: Range<usize>| {
            let slices: Vec<Slice> = (0..shape.len()).map(|d| if d == dim { Slice::from(rows.clone()) } else { Slice::full() }).collect();
            token_picked_from_the_shard(shape, &slices, || SP2).map(|e| e.to_string())
        };
        assert!(picked(&[2, 8, 16], 1, 7..8).is_none(), "nothing noted");
        let noted_shard = noted(&(8..16).collect::<Vec<_>>(), 2);
        let message = picked(&[2, 8, 16], 1, 7..8).expect("the shard's last token refused");
        for needle in ["slice along dim 1 of a [2, 8, 16] tensor", "picks token 7 of the 8 tokens of this rank's shard", "reward model", "enter_single_device"] {
            assert!(message.contains(needle), "`{needle}` missing from: {message}");
        }
        // The first, one in the middle (a recurrence's step), of token ids, per head, channels first.
        assert!(picked(&[2, 8, 16], 1, 0..1).is_some() && picked(&[2, 8, 16], 1, 3..4).is_some() && picked(&[2, 8], 1, 0..1).is_some());
        assert!(picked(&[2, 4, 8, 16], 2, 5..6).is_some() && picked(&[2, 16, 8], 2, 0..1).is_some());
        // Two tokens or more, features or heads as long as the shard, another length, a 1-D buffer: pass.
        assert!(picked(&[2, 8, 16], 1, 6..8).is_none() && picked(&[2, 8, 8], 2, 0..1).is_none() && picked(&[2, 4, 8, 16], 3, 0..1).is_none());
        assert!(picked(&[2, 9, 16], 1, 8..9).is_none() && picked(&[8], 0, 7..8).is_none() && picked(&[2, 8, 8, 16], 2, 0..1).is_none());
        assert!(not_positions(|| picked(&[2, 8, 16], 1, 7..8)).is_none(), "not_positions lets a pick through");
        // One rank, the opt-out.
        let slices = [Slice::full(), Slice::from(7..8), Slice::full()];
        assert!(token_picked_from_the_shard(&[2, 8, 16], &slices, || Some(Sharding { ranks: 1, ..SP2.unwrap() })).is_none());
        assert!(token_picked_from_the_shard(&[2, 8, 16], &slices, || Some(Sharding { shard_local_attention_on_purpose: true, ..SP2.unwrap() })).is_none());
        {
            // In a checkpointed layer's tile of 4 rows: its last token refused at one rank too;
            // a tile of one row cut from the shard's tensor (the checkpointing's own cut) passes.
            let _tile = note_tile_of_the_shard(4..8);
            let one_rank = || Some(Sharding { ranks: 1, ..SP2.unwrap() });
            let message = token_picked_from_the_shard(&[2, 4, 16], &[Slice::full(), Slice::from(3..4)], one_rank).map(|e| e.to_string()).expect("the tile's last token refused");
            assert!(message.contains("rows 4..8 of this rank's 8-token shard") && message.contains("picks token 3 of the 4 tokens of this tile"), "{message}");
        }
        {
            let _tile = note_tile_of_the_shard(5..6);
            assert!(picked(&[2, 8, 16], 1, 5..6).is_none(), "the tile's own row refused");
            assert!(picked(&[2, 8, 16], 1, 7..8).is_some());
        }
        // By index: one token (select's one index, gather's one place a row) refused, two pass.
        let message = token_picked_by_index("gather", &[2, 8, 16], 1, 1, || SP2).map(|e| e.to_string()).expect("gather of one token refused");
        assert!(message.contains("gather along dim 1") && message.contains("picks a token of the 8 tokens"), "{message}");
        assert!(token_picked_by_index("select", &[2, 8, 16], 1, 2, || SP2).is_none() && token_picked_by_index("select", &[8, 16], 0, 1, || SP2).is_none());
        {
            // In a tile of one row, its row of a table built for the shard, by index: passes.
            let _tile = note_tile_of_the_shard(5..6);
            assert!(token_picked_by_index("select", &[2, 8, 16], 1, 1, || SP2).is_none());
        }
        drop(noted_shard);
        // A shard of three tokens: too few to tell.
        let _short = noted(&[3, 4, 5], 2);
        assert!(picked(&[2, 3, 16], 1, 2..3).is_none());
    }

    #[test]
    fn a_shard_padded_and_cropped_to_another_place_is_refused() {
        let cropped = |shape: &[usize], dim: usize, rows: Range<usize>| {
            let slices: Vec<Slice> = (0..shape.len()).map(|d| if d == dim { Slice::from(rows.clone()) } else { Slice::full() }).collect();
            shard_shifted_by_padding(false, shape, &slices, || SP2).map(|e| e.to_string())
        };
        note_placed(false, &[2, 9, 16], 1, 1, 8);
        assert!(cropped(&[2, 9, 16], 1, 0..8).is_none(), "nothing noted");
        {
            let _earlier = noted(&(0..8).collect::<Vec<_>>(), 2);
            note_placed(false, &[2, 9, 16], 1, 1, 8);
            assert!(cropped(&[2, 9, 16], 1, 0..8).is_some(), "a shift by padding and cropping refused");
        }
        let _noted = noted(&(8..16).collect::<Vec<_>>(), 2);
        assert!(cropped(&[2, 9, 16], 1, 0..8).is_none(), "a placement noted in an earlier forward");
        // RWKV's time shift: padded by one before, cropped to the first 8.
        note_placed(false, &[2, 9, 16], 1, 1, 8);
        let message = cropped(&[2, 9, 16], 1, 0..8).expect("a shift by padding and cropping refused");
        for needle in ["slice along dim 1 of a [2, 9, 16] tensor", "keeps tokens 0..8 of 9", "went at 1..9", "the one 1 before it", "halo", "not_positions"] {
            assert!(message.contains(needle), "`{needle}` missing from: {message}");
        }
        // Cropped back where the tokens went (a class token removed): passes; padded at the end
        // and cropped from the start: the token after.
        assert!(cropped(&[2, 9, 16], 1, 1..9).is_none());
        {
            let _another_forward = noted(&(8..16).collect::<Vec<_>>(), 2);
            note_concatenated(false, &[vec![2, 8, 16], vec![2, 1, 16]], 1);
            assert!(cropped(&[2, 9, 16], 1, 1..9).is_some_and(|message| message.contains("the one 1 after it")) && cropped(&[2, 9, 16], 1, 0..8).is_none());
            // Two tensors of one shape, their tokens placed apart (padded at the end; a class
            // token before them): a crop that keeps either one's where they went passes; token
            // ids placed elsewhere say nothing of floats.
            note_concatenated(false, &[vec![2, 1, 16], vec![2, 8, 16]], 1);
            assert!(cropped(&[2, 9, 16], 1, 0..8).is_none() && cropped(&[2, 9, 16], 1, 1..9).is_none());
            note_placed(true, &[2, 9], 1, 1, 8);
            let ids_cropped = |integers: bool| shard_shifted_by_padding(integers, &[2, 9], &[Slice::full(), Slice::from(0..8)], || SP2);
            assert!(ids_cropped(true).is_some() && ids_cropped(false).is_none());
        }
        // A fresh forward's shift by padding, for the rules below.
        let _fresh = noted(&(8..16).collect::<Vec<_>>(), 2);
        note_placed(false, &[2, 9, 16], 1, 1, 8);
        // Per head `[B, H, S + 2, D]`; channels first `[B, C, L + 1]`; at most a quarter of the
        // shard: 3 tokens of 8 is none, and no shard of 8 padded by them is noted.
        note_placed(false, &[2, 4, 10, 16], 2, 2, 8);
        note_placed(false, &[2, 16, 9], 2, 1, 8);
        assert!(cropped(&[2, 4, 10, 16], 2, 0..8).is_some() && cropped(&[2, 4, 10, 16], 2, 1..9).is_some() && cropped(&[2, 16, 9], 2, 0..8).is_some());
        note_placed(false, &[2, 11, 16], 1, 3, 8);
        assert!(cropped(&[2, 11, 16], 1, 0..8).is_none());
        // Features, another dim's placement, as many heads as padded tokens, another shape: pass.
        note_placed(false, &[2, 8, 9], 2, 1, 8);
        note_placed(false, &[2, 9, 9, 16], 1, 1, 8);
        assert!(cropped(&[2, 8, 9], 2, 0..8).is_none() && cropped(&[2, 9, 9, 16], 1, 0..8).is_none() && cropped(&[3, 9, 16], 1, 0..8).is_none());
        assert!(not_positions(|| cropped(&[2, 9, 16], 1, 0..8)).is_none(), "not_positions lets a crop through");
        let slices = [Slice::full(), Slice::from(0..8), Slice::full()];
        for sharding in [None, Some(Sharding { ranks: 1, ..SP2.unwrap() }), Some(Sharding { shard_local_attention_on_purpose: true, ..SP2.unwrap() })] {
            assert!(shard_shifted_by_padding(false, &[2, 9, 16], &slices, || sharding).is_none());
        }
        // In a tile of 4 rows: the tile padded by one and cropped, at any SP degree.
        let _tile = note_tile_of_the_shard(4..8);
        note_placed(false, &[2, 5, 16], 1, 1, 4);
        let slices = [Slice::full(), Slice::from(0..4), Slice::full()];
        let in_a_tile = shard_shifted_by_padding(false, &[2, 5, 16], &slices, || None).expect("a tile padded and cropped refused on one device").to_string();
        assert!(in_a_tile.contains("tile"), "{in_a_tile}");
    }

    #[test]
    fn reductions_and_rankings_over_the_shards_tokens_are_refused() {
        let reduced = |shape: &[usize], dim: usize| reduced_over_the_shard("mean_dim", OverTheSequence::Reduces, shape, dim, false, || SP2).map(|e| e.to_string());
        assert!(reduced(&[2, 8, 16], 1).is_none(), "nothing noted");
        let _noted = noted(&(8..16).collect::<Vec<_>>(), 2);
        let message = reduced(&[2, 8, 16], 1).expect("a mean over the shard's tokens refused");
        for needle in ["mean_dim along dim 1 of a [2, 8, 16] tensor", "reduces over the 8 tokens of this rank's shard", "enter_single_device", "not_positions"] {
            assert!(message.contains(needle), "`{needle}` missing from: {message}");
        }
        let ranked = reduced_over_the_shard("topk", OverTheSequence::Ranks, &[2, 8], 1, false, || SP2).expect("a top-k of the shard's tokens refused").to_string();
        assert!(ranked.contains("ranks the 8 tokens") && ranked.contains("mixture-of-depths"), "{ranked}");
        let located = reduced_over_the_shard("argmax", OverTheSequence::Locates, &[2, 8], 1, false, || SP2).expect("where the first padding lies refused").to_string();
        assert!(located.contains("argmax along dim 1") && located.contains("among the 8 tokens") && located.contains("first padding"), "{located}");
        // A softmax over the tokens that is no token × token matrix: attention pooling's
        // `[B, S, 1]`, a mask's `[B, S]`; not over features (logits `[B, S, V]`).
        let normalised = attention_weights_by_hand("softmax", &[2, 8, 1], 1, || SP2).expect("attention pooling's weights refused").to_string();
        assert!(normalised.contains("softmax along dim 1 of a [2, 8, 1] tensor") && normalised.contains("normalises over the 8 tokens") && normalised.contains("attention pooling"), "{normalised}");
        assert!(attention_weights_by_hand("log_softmax", &[2, 8], 1, || SP2).is_some());
        assert!(attention_weights_by_hand("log_softmax", &[2, 8, 8], 2, || SP2).is_none() && attention_weights_by_hand("softmax", &[2, 8, 1], 1, || None).is_none());
        // Per head `[B, H, S, D]` and `[B, S, H, D]`, `[B, S]` scores, 5-D.
        assert!(reduced(&[2, 4, 8, 16], 2).is_some() && reduced(&[2, 8, 4, 16], 1).is_some() && reduced(&[2, 8], 1).is_some() && reduced(&[2, 4, 2, 8, 16], 3).is_some());
        // Features (a norm's, as long as the shard or not), heads, a tile `[B, T, D]`, another
        // length, the batch: pass.
        assert!(reduced(&[2, 8, 16], 2).is_none() && reduced(&[2, 4, 8], 2).is_none() && reduced(&[2, 4, 8, 16], 3).is_none());
        assert!(reduced(&[2, 4, 16], 1).is_none() && reduced(&[2, 9, 16], 1).is_none() && reduced(&[2, 8, 16], 0).is_none());
        // Other firsts than the batch's 2 rows: flattened tokens `[B·S, D]` or `[B·T, D]`, pooled
        // `[1, D]`, heads folded into the batch, with D the shard's length.
        assert!(reduced(&[16, 8], 1).is_none() && reduced(&[8, 8], 1).is_none() && reduced(&[1, 8], 1).is_none() && reduced(&[8, 8, 16], 1).is_none());
        // Two dims as long as the shard: `[B, S, D]` or channels first `[B, C, L]`; `[B, H, S, D]`
        // or `[B, S, H, D]`. No telling which is the sequence; a 1-D buffer.
        assert!(reduced(&[2, 8, 8], 1).is_none() && reduced(&[2, 8, 8, 16], 1).is_none() && reduced(&[2, 8, 8, 16], 2).is_none() && reduced(&[8], 0).is_none());
        // Dim 2 of `[B, C, L]` (channels first) or of a row of weights `[B, 1, S]`, once the
        // table the tokens were embedded with is known: refused where the last dim is neither
        // its width nor its vocabulary, and the middle no tokens nor a class token's few more;
        // features as wide as the shard (a width of 8) leave no telling, and pass.
        EMBEDDED_TABLE.set([50, 16]);
        assert!(reduced(&[2, 16, 8], 2).is_some_and(|m| m.contains("along dim 2 of a [2, 16, 8] tensor")) && reduced(&[2, 1, 8], 2).is_some());
        // Forgotten as a step or an evaluation begins or ends: the next model, which may embed no
        // ids, is not held to this one's width.
        forget_embedded_table();
        assert!(reduced(&[2, 16, 8], 2).is_none(), "the last model's table outlived its step");
        EMBEDDED_TABLE.set([50, 16]);
        assert!(reduced(&[2, 9, 8], 2).is_none() && reduced(&[2, 16, 16], 2).is_none() && reduced(&[2, 16, 50], 2).is_none());
        EMBEDDED_TABLE.set([50, 8]);
        assert!(reduced(&[2, 16, 8], 2).is_none() && reduced(&[2, 1, 8], 2).is_none(), "features as wide as the shard refused");
        EMBEDDED_TABLE.set([0, 0]);
        // A parameter, `not_positions`, one rank, the opt-out: pass.
        assert!(reduced_over_the_shard("sum_dim", OverTheSequence::Reduces, &[2, 8, 16], 1, true, || SP2).is_none(), "a parameter refused");
        assert!(not_positions(|| reduced(&[2, 8, 16], 1)).is_none(), "not_positions lets a reduction through");
        for sharding in [None, Some(Sharding { ranks: 1, ..SP2.unwrap() }), Some(Sharding { shard_local_attention_on_purpose: true, ..SP2.unwrap() })] {
            assert!(reduced_over_the_shard("sum_dim", OverTheSequence::Reduces, &[2, 8, 16], 1, false, || sharding).is_none());
        }
    }

    #[test]
    fn positions_counted_from_a_tiles_first_row_are_refused() {
        let sliced = |shape: &[usize], dim: usize, rows: Range<usize>, sharding: Option<Sharding>| {
            let slices: Vec<Slice> = (0..shape.len()).map(|d| if d == dim { Slice::from(rows.clone()) } else { Slice::full() }).collect();
            positions_sliced_from_a_table(shape, &slices, false, true, || sharding).map(|e| e.to_string())
        };
        let counted = |range: Range<i64>, sharding: Option<Sharding>| positions_counted_by_arange(&range, 1, || sharding).map(|e| e.to_string());
        {
            let _nothing_noted = note_tile_of_the_shard(4..8);
            assert!(counted(0..4, SP2).is_none() && SHARD_POSITIONS.get().is_none(), "a tile noted where no shard is");
        }
        // SP rank 1 of 2, 8 tokens a row at positions 8..16; the tile of rows 4..8.
        let _shard = noted(&(8..16).collect::<Vec<_>>(), 2);
        {
            let _tile = note_tile_of_the_shard(4..8);
            // RoPE from 0 in each tile: a global table's first rows, refused at SP 2 and at SP 1.
            for sharding in [SP2, Some(Sharding { ranks: 1, ..SP2.unwrap() }), None] {
                let message = sliced(&[32, 4, 2], 0, 0..4, sharding).expect("a global table's rows 0..4 in the tile of rows 4..8 refused");
                for needle in ["slice takes rows 0..4 along dim 0 of a [32, 4, 2] table", "rows 4..8 of this rank's 8-token shard", "positions 12..16", "LayeredLm::context", "not_positions"] {
                    assert!(message.contains(needle), "`{needle}` missing from: {message}");
                }
            }
            // The tile's positions of a global table, or its rows of a table built for the
            // shard (exactly as long), pass; the shard's rows 0..4, or a global table's rows at
            // the shard's offset or at the tile's rows, are counted as if the tile were the shard.
            assert!(sliced(&[32, 4, 2], 0, 12..16, SP2).is_none() && sliced(&[1, 1, 8, 4], 2, 4..8, SP2).is_none());
            assert!(sliced(&[1, 1, 8, 4], 2, 0..4, SP2).is_some() && sliced(&[32, 4, 2], 0, 4..8, SP2).is_some() && sliced(&[32, 4, 2], 0, 8..12, SP2).is_some());
            // A table built for the shard but padded (shorter than the sequence over the ranks)
            // at the tile's rows, rows from elsewhere (no tile's count: a weight's part), a table
            // shorter than the shard (no positions), other lengths: pass.
            assert!(sliced(&[1, 1, 9, 4], 2, 4..8, SP2).is_none());
            assert!(sliced(&[32, 4, 2], 0, 20..24, None).is_none() && sliced(&[6, 4], 0, 0..4, SP2).is_none() && sliced(&[32, 4, 2], 0, 0..3, SP2).is_none());
            // Under SP an arange as long as the tile at its positions passes, and at others
            // (from 0, its rows of the shard) is refused; at SP 1 it may be indices and passes.
            assert!(counted(12..16, SP2).is_none() && counted(4..8, SP2).is_some());
            let message = counted(0..4, SP2).expect("arange(0..4) in the tile of rows 4..8 refused under SP");
            assert!(message.contains("arange counts positions 0..4") && message.contains("at any SP degree"), "{message}");
            assert!(counted(0..4, None).is_none() && counted(0..4, Some(Sharding { ranks: 1, ..SP2.unwrap() })).is_none());
            // The shard's rules hold inside the tile.
            assert!(sliced(&[32, 4, 2], 0, 0..8, SP2).is_some_and(|m| m.contains("8 tokens sit at positions 8..16")));
            // Opted out, or inside `not_positions`: pass.
            assert!(sliced(&[32, 4, 2], 0, 0..4, Some(Sharding { shard_local_attention_on_purpose: true, ..SP2.unwrap() })).is_none());
            assert!(not_positions(|| counted(0..4, SP2).or_else(|| sliced(&[32, 4, 2], 0, 0..4, None))).is_none());
        }
        assert!(counted(0..4, SP2).is_none(), "the tile is forgotten when its note is dropped");
        let _whole = note_tile_of_the_shard(0..8);
        assert!(counted(0..4, SP2).is_none() && counted(0..8, SP2).is_some(), "rows that are the whole shard are no tile");
    }

    #[test]
    fn tokens_mixed_within_a_tile_are_refused_at_any_sp_degree() {
        let shifted = |shape: &[usize], dim: usize, rows: Range<usize>, sharding: Option<Sharding>| {
            let slices: Vec<Slice> = (0..shape.len()).map(|d| if d == dim { Slice::from(rows.clone()) } else { Slice::full() }).collect();
            shard_shifted_by_a_slice(shape, &slices, || sharding).map(|e| e.to_string())
        };
        let reduced = |shape: &[usize], dim: usize, sharding: Option<Sharding>| reduced_over_the_shard("mean_dim", OverTheSequence::Reduces, shape, dim, false, || sharding).map(|e| e.to_string());
        // SP rank 1 of 2, 16 tokens a row; the tile of rows 8..16.
        let _shard = noted(&(16..32).collect::<Vec<_>>(), 2);
        let _tile = note_tile_of_the_shard(8..16);
        for sharding in [SP2, None] {
            let message = shifted(&[2, 8, 16], 1, 0..7, sharding).expect("a token shift within the tile refused");
            for needle in ["slice along dim 1 of a [2, 8, 16] tensor in a token-wise part", "rows 8..16 of this rank's 16-token shard", "drops the last 1 of the 8 tokens of this tile of the shard", "neighbouring tile's tokens", "LayeredLm::core"] {
                assert!(message.contains(needle), "`{needle}` missing from: {message}");
            }
            let message = reduced(&[2, 8, 16], 1, sharding).expect("a mean over the tile's tokens refused");
            assert!(message.contains("reduces over the 8 tokens of this tile of the shard") && message.contains("the tile's alone"), "{message}");
        }
        // By two (a quarter of the tile), per head; features, the shard's length, more than a
        // quarter: pass.
        assert!(shifted(&[2, 8, 16], 1, 2..8, None).is_some() && reduced(&[2, 4, 8, 16], 2, None).is_some());
        assert!(shifted(&[2, 8, 16], 1, 0..5, None).is_none() && shifted(&[2, 8, 16], 2, 0..15, None).is_none() && reduced(&[2, 8, 16], 2, None).is_none() && reduced(&[2, 16, 4], 1, None).is_none());
        // The shard's rules hold in the tile: a shift or mean of the shard's tokens, refused
        // under SP alone.
        let message = shifted(&[2, 16, 8], 1, 0..15, SP2).expect("a shift of the shard's tokens in a tile refused under SP");
        assert!(message.contains("of the 16 tokens of this rank's shard") && message.contains("spread over 2 ranks"), "{message}");
        assert!(reduced(&[2, 16, 8], 1, SP2).is_some_and(|m| m.contains("this rank's shard")) && reduced(&[2, 16, 8], 1, None).is_none());
        // Opted out, or inside `not_positions`: pass.
        let opted_out = Some(Sharding { shard_local_attention_on_purpose: true, ..SP2.unwrap() });
        assert!(shifted(&[2, 8, 16], 1, 0..7, opted_out).is_none() && reduced(&[2, 8, 16], 1, opted_out).is_none());
        assert!(not_positions(|| shifted(&[2, 8, 16], 1, 0..7, None).or_else(|| reduced(&[2, 8, 16], 1, None))).is_none());
    }
}
