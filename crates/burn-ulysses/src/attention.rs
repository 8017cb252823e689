//! The attention interception: what `UlyssesBackend::attention` does.
//!
//! 1. check the call locally, then across ranks ([`AttentionLayout`]);
//! 2. replicate kv heads when there are fewer than ranks ([`HeadPlan`]);
//! 3. exchange q/k/v: sequence shard → head shard ([`sequence_to_heads`]);
//! 4. gather a key-padding mask along the key dimension;
//! 5. attend over the whole sequence with the inner backend's best attention (the
//!    flash-attention kernels on CubeCL backends, burn's attention elsewhere);
//! 6. exchange the output back: head shard → sequence shard ([`heads_to_sequence`]).
//!
//! Without a rank context (or with a group of one) it is a single-device attention that
//! also accepts grouped-query k/v.

use std::sync::Arc;

use burn::tensor::{
    Bool, Tensor, TensorMetadata,
    ops::{AttentionModuleOptions, BoolTensor, FloatTensor},
};

pub use crate::fused::repeat_kv_heads;
use crate::{
    comm::{Communicator, all_gather_host_checked},
    context,
    error::UlyssesError,
    exchange::{heads_to_sequence, sequence_to_heads},
    inner::{DenseFallback, ExchangeBackend},
    layout::{AttentionLayout, HeadPlan, MaskKind},
    primitive::{float_primitive, float_tensor},
};

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
    let attend_or_explain = || -> Result<FloatTensor<X>, UlyssesError> {
        let layout = local_layout::<X>(&query, &key, &value, mask.as_ref(), attn_bias.as_ref(), &options)?;
        let context = context::current::<X::Wire>()?;
        let forbid = context.as_ref().is_some_and(|c| c.config.forbid_dense_fallback);
        let fallback = if forbid { DenseFallback::Forbid } else { DenseFallback::Allow };
        let Some(context) = context.filter(|c| c.communicator.size() > 1) else {
            HeadPlan::new(layout.q_heads, layout.kv_heads, 1)?;
            let output = attend::<X>(
                float_tensor(query),
                float_tensor(key),
                float_tensor(value),
                mask.map(bool_tensor::<X>),
                attn_bias.map(float_tensor),
                options,
                fallback,
            )?;
            return Ok(float_primitive(output));
        };
        let communicator = &context.communicator;

        if context.config.verify_layout {
            let per_rank = all_gather_host_checked(&**communicator, &layout.encode(), "attention layout fields")?;
            AttentionLayout::check_agreement(&per_rank)?;
        }
        match (layout.mask, attn_bias) {
            (MaskKind::Unshardable, _) => {
                return Err(UlyssesError::UnshardableMask { shape: dims(mask.as_ref().unwrap()) });
            }
            (_, Some(bias)) => return Err(UlyssesError::UnshardableBias { shape: dims(&bias) }),
            _ => {}
        }
        let plan = HeadPlan::new(layout.q_heads, layout.kv_heads, communicator.size())?;
        tracing::trace!(?layout, ?plan, "sequence-parallel attention");

        let key = repeat_kv_heads(float_tensor::<X, 4>(key), plan.kv_replication);
        let value = repeat_kv_heads(float_tensor::<X, 4>(value), plan.kv_replication);
        let mut exchanged = sequence_to_heads(vec![float_tensor(query), key, value], communicator)?;
        let value = exchanged.pop().unwrap();
        let key = exchanged.pop().unwrap();
        let query = exchanged.pop().unwrap();

        let mask = match mask {
            Some(mask) => Some(gather_key_padding_mask::<X>(bool_tensor(mask), &query, &key, &plan, communicator)?),
            None => None,
        };
        let output = attend::<X>(query, key, value, mask, None, options, fallback)?;
        Ok(float_primitive(heads_to_sequence(output, communicator)?))
    };
    attend_or_explain().unwrap_or_else(|error| panic!("{error}"))
}

/// Checks shapes that need no peer, and describes the call for the cross-rank check.
fn local_layout<X: ExchangeBackend>(
    query: &FloatTensor<X>,
    key: &FloatTensor<X>,
    value: &FloatTensor<X>,
    mask: Option<&BoolTensor<X>>,
    attn_bias: Option<&FloatTensor<X>>,
    options: &AttentionModuleOptions,
) -> Result<AttentionLayout, UlyssesError> {
    let (q, k, v) = (dims(query), dims(key), dims(value));
    if q.len() != 4 || k.len() != 4 || v.len() != 4 {
        return Err(UlyssesError::Shape(format!(
            "q, k and v must be 4-D [batch, heads, seq, head_dim]; got q {q:?}, k {k:?}, v {v:?}"
        )));
    }
    if k[0] != q[0] || v[0] != q[0] || k[1] != v[1] || k[2] != v[2] || k[3] != q[3] {
        return Err(UlyssesError::Shape(format!(
            "k and v must be [batch, kv_heads, kv_seq, _] with q's batch, and k must have q's \
             head_dim; got q {q:?}, k {k:?}, v {v:?}"
        )));
    }
    let mask_kind = match mask.map(dims) {
        None => MaskKind::None,
        Some(m) if m.len() == 4 && m[0] == q[0] && m[2] == 1 && m[3] == k[2] && (m[1] == 1 || m[1] == q[1]) => {
            MaskKind::KeyPadding { heads: m[1] }
        }
        Some(_) => MaskKind::Unshardable,
    };
    Ok(AttentionLayout {
        batch: q[0],
        q_heads: q[1],
        kv_heads: k[1],
        q_seq: q[2],
        kv_seq: k[2],
        head_dim: q[3],
        value_dim: v[3],
        is_causal: options.is_causal,
        scale: options.scale,
        softcap: options.softcap,
        mask: mask_kind,
        has_bias: attn_bias.is_some(),
    })
}

/// Attention over whole sequences with the inner backend's best kernel (a fused one takes
/// grouped kv heads as they are; burn's attention gets them expanded), falling back to
/// burn's dense attention as `fallback` allows.
fn attend<X: ExchangeBackend>(
    query: Tensor<X, 4>,
    key: Tensor<X, 4>,
    value: Tensor<X, 4>,
    mask: Option<Tensor<X, 4, Bool>>,
    attn_bias: Option<Tensor<X, 4>>,
    options: AttentionModuleOptions,
    fallback: DenseFallback,
) -> Result<Tensor<X, 4>, UlyssesError> {
    let output = X::sequence_attention(
        float_primitive(query),
        float_primitive(key),
        float_primitive(value),
        mask.map(Tensor::into_primitive),
        attn_bias.map(float_primitive),
        options,
        fallback,
    )?;
    Ok(float_tensor(output))
}

/// Gathers a `[B, 1 | H, 1, S_k/P]` key-padding mask from every rank into this rank's
/// `[B, H/P, S_q, S_k]` mask.
fn gather_key_padding_mask<X: ExchangeBackend>(
    mask: Tensor<X, 4, Bool>,
    query: &Tensor<X, 4>,
    key: &Tensor<X, 4>,
    plan: &HeadPlan,
    communicator: &Arc<dyn Communicator<X::Wire>>,
) -> Result<Tensor<X, 4, Bool>, UlyssesError> {
    let p = plan.sp_size;
    let [b, mask_heads, _, s_k_local] = mask.dims();
    let gathered = X::all_gather_untracked(float_primitive(mask.float()), communicator)?;
    let full: Tensor<X, 4> = float_tensor::<X, 5>(gathered)
        .permute([1, 2, 3, 0, 4])
        .reshape([b, mask_heads, 1, p * s_k_local]);
    let full = if mask_heads == 1 {
        full
    } else {
        let local = plan.local_q_heads();
        let first = communicator.rank() * local;
        full.slice([0..b, first..first + local, 0..1, 0..p * s_k_local])
    };
    let [_, heads, s_q, _] = query.dims();
    let s_k = key.dims()[2];
    Ok(full.greater_elem(0.5).expand([b, heads, s_q, s_k]))
}

fn bool_tensor<X: ExchangeBackend>(primitive: BoolTensor<X>) -> Tensor<X, 4, Bool> {
    Tensor::from_primitive(primitive)
}

fn dims<T: TensorMetadata>(tensor: &T) -> Vec<usize> {
    tensor.shape().to_vec()
}
