//! The attention interception: what `UlyssesBackend::attention` does.
//!
//! 1. check the call locally, then across ranks ([`AttentionLayout`]);
//! 2. replicate kv heads when there are fewer than ranks ([`HeadPlan`]);
//! 3. exchange q/k/v: sequence shard → head shard ([`sequence_to_heads`]);
//! 4. gather what restricts the keys a row sees, for the whole sequence: a key-padding mask
//!    along the key dimension (read as one run of real keys per sequence), and the position
//!    ids of packed documents ([`attention_in_documents`]);
//! 5. attend over the whole sequence with the inner backend's best attention (the
//!    flash-attention kernels on CubeCL backends, burn's attention elsewhere);
//! 6. exchange the output back: head shard → sequence shard ([`heads_to_sequence`]).
//!
//! Without a rank context (or with a group of one) it is a single-device attention that
//! also accepts grouped-query k/v.

use std::{cell::RefCell, ops::Range, sync::Arc};

use burn::tensor::{
    Bool, Tensor, TensorMetadata,
    backend::Backend,
    module::attention,
    ops::{AttentionModuleOptions, BoolTensor, FloatTensor},
};

pub use crate::flash::repeat_kv_heads;
pub use ulysses_core::layout::with_key_padding_mask;
use crate::{
    comm::{Communicator, all_gather_host_checked},
    context,
    error::UlyssesError,
    exchange::{heads_to_sequence, sequence_to_heads},
    flash::dense_fallback,
    capabilities::{DenseFallback, ExchangeBackend, PlainBackend},
    layout::{AttentionLayout, HeadPlan, MaskKind},
    primitive::{float_primitive, float_tensor},
    ring::ring_attention,
    visibility::{PositionIds, Visibility},
};

/// What restricts the keys each query sees besides causality, handed by [`attention_within`]
/// to the attention op it calls: burn's op has no argument for it.
#[derive(Debug, Clone)]
struct Restriction {
    documents: Option<PositionIds>,
    window: Option<usize>,
}

thread_local! {
    static RESTRICTION: RefCell<Option<Restriction>> = const { RefCell::new(None) };
    static DOCUMENT_CALLS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    static CALLS_SEEING_EVERY_KEY: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// The layouts (`[q_seq, kv_seq, kv_heads, head_dim]`) of the non-causal calls whose keys
    /// [`refuse_keys_every_rank_holds_beside_its_shard`] checked, in the rank context of this
    /// number ([`context::current_entry_number`]: a thread may be a rank of another group later).
    static KEYS_CHECKED: RefCell<(Option<u64>, Vec<[usize; 4]>)> = const { RefCell::new((None, Vec::new())) };
}

/// Fails, on every rank, where non-causal attention's keys are tokens each rank holds beside
/// its shard ([`ulysses_core::layout::refuse_keys_beside_the_shard`]), checked at the first
/// call of each layout in a rank context ([`AttentionLayout::keys_to_check`]): one read of each
/// rank's first and last key and one gather of their digests, with whether the rank takes its
/// keys for its shard's own tokens (as many as the token ids embedded: each rank's first key
/// its shard's first token), gathered rather than acted on alone before a collective.
fn refuse_keys_every_rank_holds_beside_its_shard<X: ExchangeBackend>(key: &FloatTensor<X>, layout: &AttentionLayout, communicator: &dyn Communicator<X::Wire>) -> Result<(), UlyssesError> {
    if !KEYS_CHECKED.with(|checked| layout.keys_to_check(context::current_entry_number, &mut checked.borrow_mut())) {
        return Ok(());
    }
    let own_tokens = crate::attention_guard::shard_length() == Some(layout.kv_seq);
    let key = float_tensor::<X, 4>(key.clone());
    let digest = |at: usize| ulysses_core::digest::fnv1a(&[key.clone().narrow(2, at, 1).into_data().as_bytes()]);
    let per_rank = all_gather_host_checked(communicator, &[digest(0), digest(layout.kv_seq - 1), u64::from(own_tokens)], "the keys' first and last tokens")?;
    ulysses_core::layout::refuse_keys_beside_the_shard(&per_rank, layout.kv_seq)
}


/// How many self-attention calls (as many keys as queries) this thread has made through
/// `UlyssesBackend` that see every key (not causal, no mask, no bias, no documents): a training
/// step whose sequences are padded at the end and sees one made knows real tokens attended to
/// the padding. Cross-attention (to latents, a memory: other lengths) is not counted.
pub fn calls_seeing_every_key() -> u64 {
    CALLS_SEEING_EVERY_KEY.get()
}

/// How many attention calls this thread has made over packed documents
/// ([`attention_within`] or [`attention_in_documents`] with documents): a training step that
/// packs documents and sees none made knows the model's attention crossed them.
pub fn calls_with_documents() -> u64 {
    DOCUMENT_CALLS.get()
}

/// Clears [`RESTRICTION`] however the call ends, so nothing outlives it.
struct RestrictionHandOver;

impl Drop for RestrictionHandOver {
    fn drop(&mut self) {
        take_restriction();
    }
}

/// `burn::tensor::module::attention` over documents packed into each sequence: a token sees
/// only tokens of its own document (and, with `is_causal`, none after it). `positions` are
/// the position ids of the query tokens, `[batch, seq]`, restarting at 0 at each document
/// (the Hugging Face / ALST convention); under sequence parallelism, those of this rank's
/// shard: the attention gathers them, so a document may cross a shard edge.
///
/// On `UlyssesBackend` (with or without a group) the flash kernels skip every tile outside a
/// document: no `S × S` mask exists. On any other backend the documents become a dense mask
/// (logged as a dense fallback; the attention then also runs once without them, which is
/// discarded).
pub fn attention_in_documents<B: Backend>(
    query: Tensor<B, 4>,
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    positions: &PositionIds,
    options: AttentionModuleOptions,
) -> Tensor<B, 4> {
    attention_within(query, key, value, Some(positions), None, options)
}

/// [`attention_in_documents`] (when `documents` are given) with a sliding window of `window`
/// keys (Mistral's `sliding_window`, when given): a token sees only the last `window` keys up
/// to itself (causal self-attention, refused otherwise; Hugging Face's convention, `query −
/// key < window`). Under
/// sequence parallelism the window is over the whole sequence, shard edges included; the
/// flash kernels skip every tile outside it. With neither, it is `module::attention`.
pub fn attention_within<B: Backend>(
    query: Tensor<B, 4>,
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    documents: Option<&PositionIds>,
    window: Option<usize>,
    options: AttentionModuleOptions,
) -> Tensor<B, 4> {
    if documents.is_some() {
        DOCUMENT_CALLS.set(DOCUMENT_CALLS.get() + 1);
    }
    let (key, value) = grouped_kv_for::<B>(&query, key, value);
    if documents.is_none() && window.is_none() {
        return attention(query, key, value, None, None, options);
    }
    // The window bounds the keys before a token alone; without causality it would see every
    // later key, neither Hugging Face's band nor a window.
    if let (Some(window), false) = (window, options.is_causal) {
        panic!(
            "a sliding window ({window} keys) needs causal attention: without is_causal a token would see every key after it; \
             give AttentionModuleOptions {{ is_causal: true, .. }}, or no window"
        );
    }
    let hand_over = RestrictionHandOver;
    RESTRICTION.with(|restriction| *restriction.borrow_mut() = Some(Restriction { documents: documents.cloned(), window }));
    let output = attention(query.clone(), key.clone(), value.clone(), None, None, options);
    let unclaimed = take_restriction();
    drop(hand_over);
    let Some(restriction) = unclaimed else { return output };
    // Not a UlyssesBackend: burn's attention did not see the restriction.
    let [batch, heads, seq, _] = query.dims();
    let visibility = restricted_visibility(&restriction, batch, seq, key.dims()[2]).unwrap_or_else(|error| panic!("{error}"));
    dense_fallback(format!("{} does not intercept attention, so documents and windows become a dense mask", std::any::type_name::<B>()), DenseFallback::Allow)
        .expect("an allowed fallback is not an error");
    let mask = visibility.dense_mask::<B>(&query.device()).expand([batch, heads, seq, seq]);
    attention(query, key, value, Some(mask), None, options)
}

/// Grouped k/v (fewer kv heads than q heads) as the backend takes them: as they are on
/// `UlyssesBackend`, which exchanges them grouped; expanded to the q heads elsewhere, where
/// burn's attention would fail deep in a matmul of mismatched heads (a `DecoderConfig` with
/// `repeat_kv: false` run on a plain backend). A q head count that is no multiple of the kv
/// heads' is refused here, naming both.
fn grouped_kv_for<B: Backend>(query: &Tensor<B, 4>, key: Tensor<B, 4>, value: Tensor<B, 4>) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let (q_heads, kv_heads) = (query.dims()[1], key.dims()[1]);
    if q_heads == kv_heads || intercepts_attention::<B>(&query.device()) {
        return (key, value);
    }
    assert!(
        kv_heads > 0 && q_heads % kv_heads == 0,
        "attention of {q_heads} query heads over {kv_heads} kv heads: grouped-query attention needs the query heads a multiple of the kv heads \
         (each kv head serves as many query heads); check n_heads and n_kv_heads"
    );
    let group = q_heads / kv_heads;
    (repeat_kv_heads(key, group), repeat_kv_heads(value, group))
}

/// Whether `B` is `UlyssesBackend` itself, whose attention op this module's calls reach (not
/// one that wraps it: burn's autodiff decomposes attention before its inner backend sees it).
fn intercepts_attention<B: Backend>(device: &B::Device) -> bool {
    B::name(device).starts_with(crate::capabilities::NAME_PREFIX)
}

/// Takes what [`attention_within`] handed over, if this call came from it.
fn take_restriction() -> Option<Restriction> {
    RESTRICTION.with(|restriction| restriction.borrow_mut().take())
}

/// The visibility of a restriction on one device, whose ids (if any) cover the whole
/// sequences: `[batch, q_seq]` queries, `kv_seq` keys.
fn restricted_visibility(restriction: &Restriction, batch: usize, q_seq: usize, kv_seq: usize) -> Result<Visibility, UlyssesError> {
    let visibility = match &restriction.documents {
        Some(positions) => {
            check_document_ids(positions, batch, q_seq, kv_seq)?;
            Visibility::documents(positions)
        }
        None => Visibility::all(batch, q_seq, kv_seq),
    };
    match restriction.window {
        Some(window) => visibility.with_window(window),
        None => Ok(visibility),
    }
}

/// Fails unless `positions` are one id per query token of a self-attention call.
fn check_document_ids(positions: &PositionIds, batch: usize, q_seq: usize, kv_seq: usize) -> Result<(), UlyssesError> {
    if (positions.batch(), positions.len()) == (batch, q_seq) && kv_seq == q_seq {
        return Ok(());
    }
    Err(UlyssesError::Shape(format!(
        "attention_in_documents: position ids for {} rows of {} tokens, but q has {batch} rows of {q_seq} tokens and k {kv_seq}; \
         pass the ids of the tokens q was computed from (this rank's shard), for self-attention",
        positions.batch(),
        positions.len()
    )))
}

/// `UlyssesBackend::attention`. Panics with a [`UlyssesError`] message on bad input: backend
/// ops cannot return errors, and every rank reaches the same verdict.
pub fn sequence_parallel_attention<X: ExchangeBackend>(
    query: FloatTensor<X>,
    key: FloatTensor<X>,
    value: FloatTensor<X>,
    mask: Option<BoolTensor<X>>,
    attn_bias: Option<FloatTensor<X>>,
    options: AttentionModuleOptions,
) -> FloatTensor<X> {
    // Taken before anything can fail, so that it never reaches a later call.
    let restriction = take_restriction();
    if !options.is_causal && mask.is_none() && attn_bias.is_none() && restriction.is_none() && dims(&query).get(2) == dims(&key).get(2) {
        CALLS_SEEING_EVERY_KEY.set(CALLS_SEEING_EVERY_KEY.get() + 1);
    }
    let positions = restriction.as_ref().and_then(|r| r.documents.clone());
    let window = restriction.as_ref().and_then(|r| r.window);
    let attend_or_explain = || -> Result<FloatTensor<X>, UlyssesError> {
        let layout = local_layout::<X>(&query, &key, &value, mask.as_ref(), attn_bias.as_ref(), &options, positions.is_some(), window)?;
        // A key-padding mask of batch 1 is every row's: as the batch's, rows kept apart.
        let mask = match (layout.mask, mask) {
            (MaskKind::KeyPadding { heads }, Some(mask)) => {
                Some(bool_tensor::<X>(mask).expand([layout.batch, heads, 1, layout.kv_seq]).into_primitive())
            }
            (_, mask) => mask,
        };
        if let Some(positions) = &positions {
            check_document_ids(positions, layout.batch, layout.q_seq, layout.kv_seq)?;
        }
        if let Some(outside) = crate::attention_guard::shard_outside_its_group(context::current_sharding()) {
            return Err(outside);
        }
        let context = context::current::<X::Wire>()?;
        let forbid = context.as_ref().is_some_and(|c| c.config.forbid_dense_fallback);
        let fallback = if forbid { DenseFallback::Forbid } else { DenseFallback::Allow };
        let ring = context.as_ref().and_then(|c| c.ring.clone()).filter(|ring| ring.size() > 1);
        let Some(context) = context.filter(|c| c.communicator.size() > 1 || ring.is_some()) else {
            HeadPlan::new(layout.q_heads, layout.kv_heads, 1)?;
            layout.check_mask_and_bias_fit(mask.as_ref().map(dims).as_deref(), attn_bias.as_ref().map(dims).as_deref())?;
            let query = float_tensor::<X, 4>(query);
            // Nothing to attend (no row, or no key: a row that sees none gives zeros), which
            // no kernel takes and no dense fallback needs.
            if [layout.batch, layout.q_heads, layout.q_seq, layout.kv_seq].contains(&0) {
                let [batch, heads, rows, _] = query.dims();
                return Ok(float_primitive(Tensor::<X, 4>::zeros([batch, heads, rows, layout.value_dim], &query.device()).cast(query.dtype())));
            }
            let visibility = restriction.as_ref().map(|r| restricted_visibility(r, layout.batch, layout.q_seq, layout.kv_seq)).transpose()?;
            let (mask, visibility) = match (layout.mask, mask.map(bool_tensor::<X>)) {
                (MaskKind::KeyPadding { .. }, Some(mask)) => key_padding_as_runs::<X>(mask, visibility, &query, layout.kv_seq)?,
                (_, mask) => (mask, visibility),
            };
            let output = attend::<X>(query, float_tensor(key), float_tensor(value), mask, attn_bias.map(float_tensor), options, visibility, fallback)?;
            return Ok(float_primitive(output));
        };
        let communicator = &context.communicator;
        // The fold first: its batch tells it apart where its heads are as many as the shard's tokens.
        if let Some(folded) = crate::attention_guard::chunks_folded_into_the_batch(&dims(&query), &dims(&key)) {
            return Err(folded);
        }
        if let Some(swapped) = crate::attention_guard::heads_and_tokens_swapped(&dims(&query)) {
            return Err(swapped);
        }
        if let Some(local) = positions.as_ref().and_then(|positions| crate::attention_guard::documents_not_the_shards(positions, context::current_sharding())) {
            return Err(local);
        }

        if context.config.verify_layout {
            let per_rank = all_gather_host_checked(&**communicator, &layout.encode(), "attention layout fields")?;
            let agreed = AttentionLayout::check_agreement(&per_rank);
            // A ring's peers hold other blocks of the same sequences: the same layout, or their
            // blocks would not fit each other (NCCL cannot check a send's shape) or attend
            // under other options; the same cut, or they would place each other's keys wrong.
            // Gathered also where this rank's group refused, for its peers that wait in it.
            if let Some(ring) = &ring {
                let encoded = layout.encode_for_ring(context.config.ring_sharding, agreed.is_err());
                let per_rank = all_gather_host_checked(&**ring, &encoded, "attention layout fields over the ring")?;
                agreed?;
                AttentionLayout::check_ring_agreement(&per_rank)?;
            } else {
                agreed?;
            }
        }
        // One query a rank over the shard's own tokens (a pooling query) is no token of the
        // shard: a mask of its keys can only be their padding.
        let pooling_the_shard = layout.q_seq == 1 && crate::attention_guard::shard_length() == Some(layout.kv_seq);
        layout.refuse_unshardable(mask.as_ref().map(dims).as_deref(), attn_bias.as_ref().map(dims).as_deref(), ulysses_core::layout::key_padding_mask_said() || pooling_the_shard)?;
        refuse_keys_every_rank_holds_beside_its_shard::<X>(&key, &layout, &**communicator)?;
        if ring.is_some() && (layout.mask != MaskKind::None || positions.is_some() || window.is_some()) {
            return Err(UlyssesError::Shape("Ulysses × Ring does not take masks, packed documents or sliding windows yet; run them with Ulysses alone".into()));
        }
        let plan = HeadPlan::new(layout.q_heads, layout.kv_heads, communicator.size())?;
        tracing::trace!(?layout, ?plan, "sequence-parallel attention");
        if fallback == DenseFallback::Forbid && !plan.even {
            refuse_where_head_shares_disagree::<X>(&query, &layout, &plan, &options)?;
        }

        let [query, key, value] = sequence_to_heads(float_tensor(query), float_tensor(key), float_tensor(value), &plan, communicator)?;

        // The restriction over the whole sequence, which every rank holds now (for its heads):
        // every rank's position ids, in rank order.
        let documents = match &positions {
            Some(positions) => {
                let gathered = all_gather_host_checked(&**communicator, positions.ids(), "document position ids")?;
                let shards = gathered.into_iter().map(|ids| PositionIds::new(ids, layout.batch, layout.q_seq)).collect::<Result<Vec<_>, _>>()?;
                Some(PositionIds::concat(&shards)?)
            }
            None => None,
        };
        let (queries, keys) = (query.dims()[2], key.dims()[2]);
        let visibility = restriction.is_some().then(|| restricted_visibility(&Restriction { documents, window }, layout.batch, queries, keys)).transpose()?;
        let (mask, visibility) = match mask {
            Some(mask) => {
                let mask = gather_key_padding_mask::<X>(bool_tensor(mask), &plan, communicator, fallback)?;
                let s_k = key.dims()[2];
                key_padding_as_runs::<X>(mask, visibility, &query, s_k)?
            }
            None => (None, visibility),
        };
        let output = match &ring {
            None => attend::<X>(query, key, value, mask, None, options, visibility, fallback)?,
            Some(ring) => ring_attention::<X>(query, key, value, options, context.config.ring_sharding, ring, fallback)?,
        };
        let output = heads_to_sequence(output, &plan, communicator)?;
        Ok(float_primitive(output))
    };
    attend_or_explain().unwrap_or_else(|error| crate::failure::fail(error))
}

/// A `[B, 1 | H, 1, S_k]` key-padding mask as one run of real keys per sequence (added to
/// `visibility`), which the flash kernels take; a mask whose real keys are not one run per
/// sequence, or differ between heads, stays a dense mask expanded to `[B, H, S_q, S_k]`.
/// Reading the mask costs one copy of `B × S_k` booleans to the host.
fn key_padding_as_runs<X: ExchangeBackend>(
    mask: Tensor<X, 4, Bool>,
    visibility: Option<Visibility>,
    query: &Tensor<X, 4>,
    s_k: usize,
) -> Result<(Option<Tensor<X, 4, Bool>>, Option<Visibility>), UlyssesError> {
    let [b, mask_heads, _, _] = mask.dims();
    let [_, heads, s_q, _] = query.dims();
    let masked = mask_values(&mask)?;
    match key_runs(&masked, b, mask_heads, 0..mask_heads, s_k) {
        Some(runs) => {
            let visibility = visibility.unwrap_or_else(|| Visibility::all(b, s_q, s_k)).with_key_runs(runs)?;
            Ok((None, Some(visibility)))
        }
        None => Ok((Some(mask.expand([b, heads, s_q, s_k])), visibility)),
    }
}

/// A boolean mask's values, read on the host (through floats: backends store booleans
/// differently, u8 or u32).
fn mask_values<X: ExchangeBackend>(mask: &Tensor<X, 4, Bool>) -> Result<Vec<bool>, UlyssesError> {
    Ok(mask
        .clone()
        .float()
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .map_err(|error| UlyssesError::Shape(format!("reading the key-padding mask: {error:?}")))?
        .into_iter()
        .map(|x| x > 0.5)
        .collect())
}

/// The real keys of `masked` (`[batch, mask_heads, 1, s_k]`, true where masked) as one run per
/// sequence, over the heads `heads`: `None` where a sequence's rows differ between those heads
/// or its real keys are not one run.
fn key_runs(masked: &[bool], batch: usize, mask_heads: usize, heads: Range<usize>, s_k: usize) -> Option<Vec<Range<usize>>> {
    let run_of = |row: &[bool]| -> Option<Range<usize>> {
        let start = row.iter().position(|&m| !m).unwrap_or(0);
        let end = row.iter().rposition(|&m| !m).map_or(0, |last| last + 1);
        row[start..end.max(start)].iter().all(|&m| !m).then_some(start..end.max(start))
    };
    (0..batch)
        .map(|sequence| {
            let rows: Vec<&[bool]> = heads.clone().map(|h| &masked[(sequence * mask_heads + h) * s_k..][..s_k]).collect();
            rows.iter().all(|row| row == &rows[0]).then(|| run_of(rows[0])).flatten()
        })
        .collect()
}

/// Where the dense fallback is an error and heads split unevenly, the kernels' verdict on
/// every rank's share, so that all ranks refuse together before the exchange: the shares'
/// tensors differ in size, and past 2^31 elements a device without 64-bit indices (wgpu)
/// takes the `⌊H/P⌋` heads and refuses the `⌈H/P⌉`; a rank refusing alone would leave its
/// peers waiting in the exchange back. Each rank decides from the same shapes.
fn refuse_where_head_shares_disagree<X: ExchangeBackend>(
    query: &FloatTensor<X>,
    layout: &AttentionLayout,
    plan: &HeadPlan,
    options: &AttentionModuleOptions,
) -> Result<(), UlyssesError> {
    let (device, dtype) = (X::float_device(query), query.dtype());
    let (queries, keys) = (layout.q_seq * plan.sp_size, layout.kv_seq * plan.sp_size);
    let verdict = |q_heads: usize, kv_heads: usize| {
        let q = [layout.batch, q_heads, queries, layout.head_dim];
        let (k, v) = ([layout.batch, kv_heads, keys, layout.head_dim], [layout.batch, kv_heads, keys, layout.value_dim]);
        <X::Wire as PlainBackend>::fused_attention_check([(&q[..], dtype), (&k[..], dtype), (&v[..], dtype)], &device, options)
    };
    match first_share_refused_alone(plan, verdict) {
        Some((rank, reason)) => Err(UlyssesError::DenseFallback {
            reason: format!(
                "rank {rank}'s share of the heads ({} of {}) would need it, though other ranks' would not: {reason}",
                plan.q_heads_of(rank).len(),
                plan.q_heads
            ),
        }),
        None => Ok(()),
    }
}

/// The first rank whose share of the heads `verdict` (q and kv head counts) refuses where
/// another rank's passes, with why; `None` where all agree.
fn first_share_refused_alone(plan: &HeadPlan, verdict: impl Fn(usize, usize) -> Result<(), String>) -> Option<(usize, String)> {
    // A verdict for each distinct share (two or three of them at any group size), not each rank:
    // this runs at every attention call.
    let shares: Vec<(usize, usize)> = (0..plan.sp_size).map(|rank| (plan.q_heads_of(rank).len(), plan.kv_heads_of(rank).len())).collect();
    let mut verdicts: Vec<((usize, usize), Result<(), String>)> = Vec::new();
    for &share in &shares {
        if !verdicts.iter().any(|(seen, _)| *seen == share) {
            verdicts.push((share, verdict(share.0, share.1)));
        }
    }
    if verdicts.iter().all(|(_, verdict)| verdict.is_err()) {
        return None;
    }
    let refused = |share: &(usize, usize)| verdicts.iter().find(|(seen, _)| seen == share).and_then(|(_, verdict)| verdict.clone().err());
    shares.iter().enumerate().find_map(|(rank, share)| refused(share).map(|reason| (rank, reason)))
}

/// Checks shapes that need no peer, and describes the call for the cross-rank check
/// (ulysses-core's rule, shared with the burn 0.22 crate).
#[allow(clippy::too_many_arguments)]
fn local_layout<X: ExchangeBackend>(
    query: &FloatTensor<X>,
    key: &FloatTensor<X>,
    value: &FloatTensor<X>,
    mask: Option<&BoolTensor<X>>,
    attn_bias: Option<&FloatTensor<X>>,
    options: &AttentionModuleOptions,
    has_documents: bool,
    window: Option<usize>,
) -> Result<AttentionLayout, UlyssesError> {
    ulysses_core::layout::check_dtypes_agree([query, key, value].map(|t| t.dtype()))?;
    AttentionLayout::of_call(&dims(query), &dims(key), &dims(value), mask.map(dims).as_deref(), attn_bias.is_some(), crate::primitive::call_options(options), has_documents, window)
        .map(|layout| layout.with_dtype(query.dtype()))
}

/// Attention over whole sequences with the inner backend's best kernel (a fused one takes
/// grouped kv heads as they are; burn's attention gets them expanded), falling back to
/// burn's dense attention as `fallback` allows.
#[allow(clippy::too_many_arguments)]
fn attend<X: ExchangeBackend>(
    query: Tensor<X, 4>,
    key: Tensor<X, 4>,
    value: Tensor<X, 4>,
    mask: Option<Tensor<X, 4, Bool>>,
    attn_bias: Option<Tensor<X, 4>>,
    options: AttentionModuleOptions,
    visibility: Option<Visibility>,
    fallback: DenseFallback,
) -> Result<Tensor<X, 4>, UlyssesError> {
    let output = X::sequence_attention(
        float_primitive(query),
        float_primitive(key),
        float_primitive(value),
        mask.map(Tensor::into_primitive),
        attn_bias.map(float_primitive),
        options,
        visibility.map(Arc::new),
        fallback,
    )?;
    Ok(float_tensor(output))
}

/// Gathers a `[B, 1 | H, 1, S_k/P]` key-padding mask from every rank into this rank's
/// `[B, 1 | h, 1, S_k]` mask (`h`: its q heads). Where `fallback` forbids the dense
/// fallback, refused on every rank when any rank's heads' rows would need it.
fn gather_key_padding_mask<X: ExchangeBackend>(
    mask: Tensor<X, 4, Bool>,
    plan: &HeadPlan,
    communicator: &Arc<dyn Communicator<X::Wire>>,
    fallback: DenseFallback,
) -> Result<Tensor<X, 4, Bool>, UlyssesError> {
    let p = plan.sp_size;
    let [b, mask_heads, _, s_k_local] = mask.dims();
    let gathered = X::all_gather_untracked(float_primitive(mask.float()), communicator)?;
    let full: Tensor<X, 4> = float_tensor::<X, 5>(gathered)
        .permute([1, 2, 3, 0, 4])
        .reshape([b, mask_heads, 1, p * s_k_local]);
    let full = full.greater_elem(0.5);
    if mask_heads == 1 {
        return Ok(full);
    }
    // Each rank runs the kernels or the dense fallback by its own heads' rows. Where that
    // fallback is an error, a rank refusing alone would leave the others waiting in the
    // exchange back: every rank refuses if any must, from the whole mask each holds.
    if fallback == DenseFallback::Forbid {
        let masked = mask_values(&full)?;
        if let Some(rank) = (0..p).find(|&rank| key_runs(&masked, b, mask_heads, plan.q_heads_of(rank), p * s_k_local).is_none()) {
            return Err(UlyssesError::DenseFallback {
                reason: format!("the key-padding mask's rows for rank {rank}'s heads differ between heads, or its real keys are not one run a sequence: the attention has a mask"),
            });
        }
    }
    Ok(full.slice([0..b, plan.q_heads_of(communicator.rank()), 0..1, 0..p * s_k_local]))
}

fn bool_tensor<X: ExchangeBackend>(primitive: BoolTensor<X>) -> Tensor<X, 4, Bool> {
    Tensor::from_primitive(primitive)
}

fn dims<T: TensorMetadata>(tensor: &T) -> Vec<usize> {
    tensor.shape().to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 14 heads over 4 ranks (4, 4, 3, 3): a verdict that refuses 4 heads refuses rank 0's
    /// share on every rank; one that takes or refuses every share leaves the kernels' own
    /// verdict to each rank (the same everywhere).
    #[test]
    fn uneven_head_shares_refused_together_where_their_verdicts_differ() {
        let plan = HeadPlan::new(14, 2, 4).unwrap();
        let refusing = |most: usize| move |q_heads: usize, _kv: usize| if q_heads > most { Err(format!("{q_heads} heads")) } else { Ok(()) };
        assert_eq!(first_share_refused_alone(&plan, refusing(3)), Some((0, "4 heads".into())));
        assert_eq!(first_share_refused_alone(&plan, refusing(4)), None);
        assert_eq!(first_share_refused_alone(&plan, refusing(2)), None);
        // The kv heads count too: rank 1's q heads 4..8 use kv heads 0, 0, 0, 1, sent one
        // a q head; the others' one each.
        assert_eq!((0..4).map(|rank| plan.kv_heads_of(rank).len()).collect::<Vec<_>>(), [1, 4, 1, 1]);
        let by_kv = |_q: usize, kv: usize| if kv > 1 { Err("kv".to_string()) } else { Ok(()) };
        assert_eq!(first_share_refused_alone(&plan, by_kv), Some((1, "kv".into())));
    }
}
