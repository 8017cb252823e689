//! `attention`, with `burn::tensor::module::attention`'s signature: a model switches by changing
//! one `use`. Inside a group of more than one rank it is Ulysses; the rules of what a call
//! may be (shapes, head counts, masks) are ulysses-core's, the same as burn-ulysses' on 0.21.

use burn::tensor::{Bool, Tensor, TensorData, module, ops::AttentionModuleOptions};
use ulysses_core::{
    comm::{HostCommunicator, all_gather_host_checked},
    error::UlyssesError,
    layout::{AttentionLayout, CallOptions, HeadPlan, MaskKind},
};

pub use ulysses_core::layout::with_key_padding_mask;

use crate::{
    blocked,
    context,
    exchange::{Direction, HeadExchange, exchange},
};

/// Attention over `[batch, heads, seq, head_dim]` tensors, as `burn::tensor::module::attention`.
///
/// Outside a sequence-parallel group (or in a group of one) it is burn's attention, kv heads
/// repeated for grouped-query attention (burn 0.22.1's takes as many as q heads). In a group
/// of `P` ranks, each passing its `S/P` consecutive tokens: q/k/v are exchanged to `H/P` heads
/// over all `S` tokens (kv heads replicated when `P` does not split them, as ulysses-core's
/// `HeadPlan` decides; `⌈H/P⌉` or `⌊H/P⌋` heads per rank when `P` does not divide `H`), attended with [`blocked`] attention (`is_causal` over the
/// whole sequence), and exchanged back. A key-padding mask `[B | 1, 1 | H, 1, S/P]` is gathered
/// along the keys; any other mask, or a bias, made from local shapes cannot follow the
/// exchange and is refused, on every rank, with the same message as burn-ulysses.
///
/// # Panics
///
/// On a layout the group cannot run (every rank reaches the same verdict): burn's op has no
/// error channel.
pub fn attention(
    query: Tensor<4>,
    key: Tensor<4>,
    value: Tensor<4>,
    mask: Option<Tensor<4, Bool>>,
    attn_bias: Option<Tensor<4>>,
    options: AttentionModuleOptions,
) -> Tensor<4> {
    match context::current().filter(|group| group.size() > 1) {
        None => {
            // The checks burn-ulysses makes on one device too (a softcap burn asserts deep in
            // its op, a mask that fits no scores); burn 0.22.1's attention takes as many kv heads
            // as q heads: grouped here, kv heads dividing q heads.
            one_device_checks(&query, &key, &value, mask.as_ref(), attn_bias.as_ref(), options).unwrap_or_else(|error| panic!("{error}"));
            let [q_heads, kv_heads] = [query.dims()[1], key.dims()[1]];
            let repeats = q_heads / kv_heads;
            module::attention(query, repeat_kv_heads(key, repeats), repeat_kv_heads(value, repeats), mask, attn_bias, options)
        }
        Some(group) => sequence_parallel(&*group, query, key, value, mask, attn_bias, options).unwrap_or_else(|error| panic!("{error}")),
    }
}

/// What a call on one device must be, as burn-ulysses checks it: q, k and v of one dtype,
/// shapes and options that fit (ulysses-core's rule), kv heads that divide the q heads, a mask
/// or bias that broadcasts to the scores.
fn one_device_checks(query: &Tensor<4>, key: &Tensor<4>, value: &Tensor<4>, mask: Option<&Tensor<4, Bool>>, attn_bias: Option<&Tensor<4>>, options: AttentionModuleOptions) -> Result<(), UlyssesError> {
    let call = CallOptions { scale: options.scale, softcap: options.softcap, is_causal: options.is_causal };
    ulysses_core::layout::check_dtypes_agree([query, key, value].map(|t| t.dtype()))?;
    let mask_dims = mask.map(|mask| mask.dims().to_vec());
    let layout = AttentionLayout::of_call(&query.dims(), &key.dims(), &value.dims(), mask_dims.as_deref(), attn_bias.is_some(), call, false, None)?;
    HeadPlan::new(layout.q_heads, layout.kv_heads, 1)?;
    layout.check_mask_and_bias_fit(mask_dims.as_deref(), attn_bias.map(|bias| bias.dims().to_vec()).as_deref())
}

thread_local! {
    /// The layouts whose keys were checked for tokens beside the shard, in the groups of this
    /// entry number ([`AttentionLayout::keys_to_check`]).
    static KEYS_CHECKED: std::cell::RefCell<(Option<u64>, Vec<[usize; 4]>)> = const { std::cell::RefCell::new((None, Vec::new())) };
}

fn sequence_parallel(
    group: &dyn HostCommunicator,
    query: Tensor<4>,
    key: Tensor<4>,
    value: Tensor<4>,
    mask: Option<Tensor<4, Bool>>,
    attn_bias: Option<Tensor<4>>,
    options: AttentionModuleOptions,
) -> Result<Tensor<4>, UlyssesError> {
    let call = CallOptions { scale: options.scale, softcap: options.softcap, is_causal: options.is_causal };
    let mask_dims = mask.as_ref().map(|mask| mask.dims().to_vec());
    ulysses_core::layout::check_dtypes_agree([&query, &key, &value].map(|t| t.dtype()))?;
    let layout = AttentionLayout::of_call(&query.dims(), &key.dims(), &value.dims(), mask_dims.as_deref(), attn_bias.is_some(), call, false, None)?.with_dtype(query.dtype());
    // Of equal lengths first: a rank in another collective (its model diverged) is named, not
    // read past its values.
    let per_rank = all_gather_host_checked(group, &layout.encode(), "attention layout fields")?;
    AttentionLayout::check_agreement(&per_rank)?;
    // The shards this forward may attend over, where `train::labels_in_step` noted them: q and
    // k that fold chunks of one into the batch, or swap its tokens with the heads, would be
    // exchanged as sequences. Checked once the layouts agree, so that every rank refuses alike;
    // the fold first (its batch tells it apart where the heads are as many as the shard's tokens).
    let shards = context::step_shards();
    let lengths: Vec<usize> = shards.iter().map(|&[_, len]| len).collect();
    let fix = "the chunks lie within each rank's shard: attend them with burn::tensor::module::attention (no exchange), or over the \
               whole shard with a mask (on burn 0.21, burn_ulysses::attention::attention_within)";
    let refused = ulysses_core::layout::chunks_folded_into_the_batch(&query.dims(), &key.dims(), &shards, fix)
        .or_else(|| ulysses_core::layout::heads_and_tokens_swapped(&query.dims(), &lengths));
    if let Some(refused) = refused {
        return Err(refused);
    }
    let own_tokens = |kv_seq: usize| lengths.contains(&kv_seq);
    // A one-query mask is taken for key padding where said alone: a pooling query over keys as
    // many as a noted shard's tokens would pass in a step that counted its labels first and be
    // refused in the next that did not.
    layout.refuse_unshardable(mask_dims.as_deref(), attn_bias.as_ref().map(|bias| bias.dims().to_vec()).as_deref(), ulysses_core::layout::key_padding_mask_said())?;
    // Tokens each rank holds beside its shard, at the first call of each layout in these
    // groups; keys as many as a noted shard's tokens are taken for its own.
    if KEYS_CHECKED.with(|checked| layout.keys_to_check(context::current_entry_number, &mut checked.borrow_mut())) {
        let digest = |at: usize| {
            crate::host::note_device_read();
            ulysses_core::digest::fnv1a(&[key.clone().narrow(2, at, 1).into_data().as_bytes()])
        };
        let own = u64::from(own_tokens(layout.kv_seq));
        let per_rank = all_gather_host_checked(group, &[digest(0), digest(layout.kv_seq - 1), own], "the keys' first and last tokens")?;
        ulysses_core::layout::refuse_keys_beside_the_shard(&per_rank, layout.kv_seq)?;
    }
    let plan = HeadPlan::new(layout.q_heads, layout.kv_heads, group.size())?;
    let size = group.size();
    let q_heads = HeadExchange::new(group, layout.q_heads, (0..size).map(|rank| plan.q_heads_of(rank).collect()).collect());
    let kv_heads = HeadExchange::new(group, layout.kv_heads, (0..size).map(|rank| plan.kv_heads_of(rank)).collect());
    let to_heads = |tensor: Tensor<4>, heads: &HeadExchange| exchange(tensor, heads.clone(), Direction::ToHeads);
    // Any mask left is a key-padding one (refused otherwise); of batch 1, every row's: gathered
    // as the batch's.
    let key_padding = match (layout.mask, mask) {
        (MaskKind::KeyPadding { heads }, Some(mask)) => {
            Some(gather_key_padding(group, mask.expand([layout.batch, heads, 1, layout.kv_seq]), &q_heads.per_rank[group.rank()])?)
        }
        _ => None,
    };
    // q, k and v in one exchange where they stack along the heads (as many tokens, one head
    // dim): one all-to-all and one wait for the device, not three.
    let (query, key, value) = if layout.q_seq == layout.kv_seq && layout.head_dim == layout.value_dim {
        let (q, kv) = (layout.q_heads, layout.kv_heads);
        let per_rank = (0..size).map(|rank| {
            let kv_of = plan.kv_heads_of(rank);
            plan.q_heads_of(rank).chain(kv_of.iter().map(|head| q + head)).chain(kv_of.iter().map(|head| q + kv + head)).collect()
        });
        let qkv = HeadExchange::new(group, q + 2 * kv, per_rank.collect());
        let packed = to_heads(Tensor::cat(vec![query, key, value], 1), &qkv);
        let (q_here, kv_here) = (plan.q_heads_of(group.rank()).len(), plan.kv_heads_of(group.rank()).len());
        (packed.clone().narrow(1, 0, q_here), packed.clone().narrow(1, q_here, kv_here), packed.narrow(1, q_here + kv_here, kv_here))
    } else {
        (to_heads(query, &q_heads), to_heads(key, &kv_heads), to_heads(value, &kv_heads))
    };
    // Local q head i uses local kv entry i / (local q heads / local kv heads).
    let repeats = query.dims()[1] / key.dims()[1];
    let settings = blocked::BlockedOptions { is_causal: options.is_causal, scale: options.scale, softcap: options.softcap };
    let output = blocked::attention(query, repeat_kv_heads(key, repeats), repeat_kv_heads(value, repeats), key_padding, settings);
    Ok(exchange(output, q_heads, Direction::ToSequence))
}

/// Every rank's key-padding mask `[b, 1 | H, 1, S/P]`, joined along the keys in rank order,
/// for this rank's heads `heads` (a mask per head) or for all of them (one mask): what the
/// rank's head shard attends with. As burn-ulysses gathers it.
fn gather_key_padding(group: &dyn HostCommunicator, mask: Tensor<4, Bool>, heads: &[usize]) -> Result<Tensor<4, Bool>, UlyssesError> {
    let [batch, mask_heads, _, local] = mask.dims();
    let device = mask.device();
    crate::host::note_device_read();
    // 64 keys a word: a word a key sent 64 times the bytes.
    let mut hidden = vec![0u64; (batch * mask_heads * local).div_ceil(64)];
    for (at, _) in mask.into_data().iter::<bool>().enumerate().filter(|&(_, hides)| hides) {
        hidden[at / 64] |= 1 << (at % 64);
    }
    let every_rank = all_gather_host_checked(group, &hidden, "key-padding mask")?;
    let kept: Vec<usize> = if mask_heads == 1 { vec![0] } else { heads.to_vec() };
    let keys = local * every_rank.len();
    let mut joined = Vec::with_capacity(batch * kept.len() * keys);
    for b in 0..batch {
        for &head in &kept {
            for part in &every_rank {
                let row = (b * mask_heads + head) * local;
                joined.extend((row..row + local).map(|at| part[at / 64] >> (at % 64) & 1 == 1));
            }
        }
    }
    Ok(Tensor::from_data(TensorData::new(joined, [batch, kept.len(), 1, keys]), &device))
}

/// `[b, h, s, d]` with each head repeated `repeats` times in place (`[b, h · repeats, s, d]`):
/// kv heads for grouped-query attention, q head `i` using kv head `i / repeats`.
pub fn repeat_kv_heads(tensor: Tensor<4>, repeats: usize) -> Tensor<4> {
    if repeats == 1 {
        return tensor;
    }
    let [batch, heads, seq, dim] = tensor.dims();
    tensor.unsqueeze_dim::<5>(2).repeat_dim(2, repeats).reshape([batch, heads * repeats, seq, dim])
}
