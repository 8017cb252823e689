//! Attention over whole sequences: fused kernels where the backend has them, burn's
//! attention where it does not.
//!
//! Under autodiff, a fused forward becomes one [`FusedAttentionBackward`] node that saves q,
//! k, v, the output and the per-row log-sum-exp, and whose backward runs the fused backward
//! kernels: no `S × S` score matrix in either pass. burn's own `Autodiff` attention, by
//! contrast, is decomposed into matmul and softmax and keeps the whole score matrix.

use std::sync::Arc;

use burn::tensor::{
    Bool, Tensor,
    backend::Backend,
    ops::{AttentionModuleOptions, BoolTensor, FloatTensor},
};
use burn_autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};

use crate::{
    error::UlyssesError,
    capabilities::{DenseFallback, PlainBackend, SequenceAttention},
    primitive::{float_primitive, float_tensor},
    visibility::Visibility,
};

/// Attention over whole sequences with the best kernel `B` has: for
/// `Autodiff<CubeBackend<R, ..>>` and `CubeBackend<R, ..>` (feature `cubecl`) the
/// flash-attention kernels of `ulysses-kernels`, differentiable, without a score matrix.
/// k and v may have fewer heads than q (grouped-query attention).
pub fn flash_attention<B: SequenceAttention>(
    query: Tensor<B, 4>,
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    options: AttentionModuleOptions,
) -> Tensor<B, 4> {
    let (q_heads, kv_heads) = (query.dims()[1], key.dims()[1]);
    assert!(
        kv_heads > 0 && q_heads % kv_heads == 0,
        "flash_attention: k/v have {kv_heads} heads and q has {q_heads}; grouped-query attention needs the kv head count to divide the q head count"
    );
    let output = B::sequence_attention(float_primitive(query), float_primitive(key), float_primitive(value), None, None, options, None, DenseFallback::Allow)
        .expect("an allowed fallback is not an error");
    float_tensor(output)
}

/// burn's attention, with grouped kv heads expanded to the q head count first, and
/// `visibility` as a dense mask (joined to `mask`).
pub(crate) fn reference_attention<B: Backend>(
    query: FloatTensor<B>,
    key: FloatTensor<B>,
    value: FloatTensor<B>,
    mask: Option<BoolTensor<B>>,
    attn_bias: Option<FloatTensor<B>>,
    options: AttentionModuleOptions,
    visibility: Option<&Visibility>,
) -> FloatTensor<B> {
    let query = float_tensor::<B, 4>(query);
    let (key, value) = (float_tensor::<B, 4>(key), float_tensor::<B, 4>(value));
    let group = query.dims()[1] / key.dims()[1];
    // Every head's scores' shape: a mask of one head is expanded, not left to a kernel's strides.
    let [batch, heads, rows, _] = query.dims();
    let scores = [batch, heads, rows, key.dims()[2]];
    let mask = match (mask.map(Tensor::<B, 4, Bool>::from_primitive), visibility) {
        (mask, None) => mask,
        (None, Some(visibility)) => Some(visibility.dense_mask::<B>(&query.device()).expand(scores)),
        (Some(mask), Some(visibility)) => Some(mask.expand(scores).bool_or(visibility.dense_mask::<B>(&query.device()).expand(scores))),
    };
    // burn's dense attention itself, not `B::attention`: a CubeCL backend's autotune may pick
    // cubek's flash kernel there, whose causal mask is aligned top-left (this crate's, and
    // burn's fallback, bottom-right).
    burn::tensor::ops::attention::attention_fallback::<B>(
        float_primitive(query),
        float_primitive(repeat_kv_heads(key, group)),
        float_primitive(repeat_kv_heads(value, group)),
        mask.map(Tensor::into_primitive),
        attn_bias,
        options,
    )
}

/// Saved by a fused forward for its backward.
#[derive(Debug, Clone)]
pub(crate) struct FusedAttentionState<B: Backend> {
    pub query: FloatTensor<B>,
    pub key: FloatTensor<B>,
    pub value: FloatTensor<B>,
    pub output: FloatTensor<B>,
    pub lse: FloatTensor<B>,
    pub options: AttentionModuleOptions,
    pub visibility: Option<Arc<Visibility>>,
}

/// The autodiff node of a fused attention: its parents are q, k and v.
#[derive(Debug)]
pub(crate) struct FusedAttentionBackward;

impl<B: PlainBackend> Backward<B, 3> for FusedAttentionBackward {
    type State = FusedAttentionState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let output_grad = grads.consume::<B>(&ops.node);
        let state = ops.state;
        let (dq, dk, dv) = B::fused_attention_backward(
            state.query,
            state.key,
            state.value,
            state.output,
            output_grad,
            state.lse,
            &state.options,
            state.visibility.as_deref(),
        );
        let [query, key, value] = ops.parents;
        for (parent, grad) in [(query, dq), (key, dk), (value, dv)] {
            if let Some(parent) = parent {
                grads.register::<B>(parent.id, grad);
            }
        }
    }
}

#[cfg(feature = "cubecl")]
mod cube_backend;
#[cfg(feature = "cubecl")]
mod fusion_backend;

impl<B: PlainBackend> SequenceAttention for B {
    fn sequence_attention(
        query: FloatTensor<B>,
        key: FloatTensor<B>,
        value: FloatTensor<B>,
        mask: Option<BoolTensor<B>>,
        attn_bias: Option<FloatTensor<B>>,
        options: AttentionModuleOptions,
        visibility: Option<Arc<Visibility>>,
        fallback: DenseFallback,
    ) -> Result<FloatTensor<B>, UlyssesError> {
        match fused_forward::<B>(&query, &key, &value, mask.is_some(), attn_bias.is_some(), &options, visibility.as_deref()) {
            Ok((output, _lse)) => Ok(output),
            Err(reason) => {
                dense_fallback(reason, fallback)?;
                Ok(reference_attention::<B>(query, key, value, mask, attn_bias, options, visibility.as_deref()))
            }
        }
    }
}

impl<B: PlainBackend, C: CheckpointStrategy> SequenceAttention for Autodiff<B, C> {
    fn sequence_attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        mask: Option<BoolTensor<Self>>,
        attn_bias: Option<FloatTensor<Self>>,
        options: AttentionModuleOptions,
        visibility: Option<Arc<Visibility>>,
        fallback: DenseFallback,
    ) -> Result<FloatTensor<Self>, UlyssesError> {
        let (q, k, v) = (&query.primitive, &key.primitive, &value.primitive);
        match fused_forward::<B>(q, k, v, mask.is_some(), attn_bias.is_some(), &options, visibility.as_deref()) {
            Ok((output, lse)) => {
                let (q, k, v) = (q.clone(), k.clone(), v.clone());
                let nodes = [query.node, key.node, value.node];
                // Compute bound: recomputing attention would cost what the kernel saves.
                Ok(match FusedAttentionBackward.prepare::<C>(nodes).compute_bound().stateful() {
                    OpsKind::Tracked(prep) => {
                        let state = FusedAttentionState { query: q, key: k, value: v, output: output.clone(), lse, options, visibility };
                        prep.finish(state, output)
                    }
                    OpsKind::UnTracked(prep) => prep.finish(output),
                })
            }
            Err(reason) => {
                dense_fallback(reason, fallback)?;
                Ok(reference_attention::<Self>(query, key, value, mask, attn_bias, options, visibility.as_deref()))
            }
        }
    }
}

/// Repeats each head of `[batch, heads, seq, dim]` `times` times in place
/// (`[h0, h0, h1, h1, ..]`), as grouped-query attention pairs q heads with kv heads. Under
/// autodiff the copies' gradients are summed.
pub fn repeat_kv_heads<B: Backend>(tensor: Tensor<B, 4>, times: usize) -> Tensor<B, 4> {
    if times == 1 {
        return tensor;
    }
    let [b, h, s, d] = tensor.dims();
    tensor
        .reshape([b, h, 1, s, d])
        .expand([b, h, times, s, d])
        .reshape([b, h * times, s, d])
}

/// Why a call cannot go to a fused kernel whatever the backend: what the kernels do not take.
fn unfusable_reason(mask: bool, attn_bias: bool, options: &AttentionModuleOptions) -> Option<String> {
    if mask {
        Some("the call has a mask that is neither causal, nor key padding with one run of real keys per sequence, nor documents (attention_in_documents); the flash kernels take only those".into())
    } else if attn_bias {
        Some("the call has an attention bias (the flash kernels take none)".into())
    } else if options.softcap.is_some() {
        Some("the call has a softcap (the flash kernels have none)".into())
    } else {
        None
    }
}

/// The fused forward (output and log-sum-exp) of `B` for this call, or why not.
fn fused_forward<B: PlainBackend>(
    query: &FloatTensor<B>,
    key: &FloatTensor<B>,
    value: &FloatTensor<B>,
    mask: bool,
    attn_bias: bool,
    options: &AttentionModuleOptions,
    visibility: Option<&Visibility>,
) -> Result<(FloatTensor<B>, FloatTensor<B>), String> {
    if let Some(reason) = unfusable_reason(mask, attn_bias, options) {
        return Err(reason);
    }
    B::fused_attention_forward(query.clone(), key.clone(), value.clone(), options, visibility)
}

/// Applies `policy` to a fallback to burn's dense attention: an error, or a log line with the
/// reason.
pub(crate) fn dense_fallback(reason: String, policy: DenseFallback) -> Result<(), UlyssesError> {
    fallback_unless_forbidden(reason, policy, "flash attention unavailable, using burn's dense attention (it builds the S x S score matrix)")
}

/// Applies `policy` to a fallback from the fused kernels to tensor ops (`instead` says which):
/// [`UlyssesError::DenseFallback`] with `reason` where it is forbidden, else a log line.
pub(crate) fn fallback_unless_forbidden(reason: String, policy: DenseFallback, instead: &'static str) -> Result<(), UlyssesError> {
    if policy == DenseFallback::Forbid {
        return Err(UlyssesError::DenseFallback { reason });
    }
    warn_once_per_reason(&reason, instead);
    Ok(())
}

/// The cross-entropy hook's refusal: `reason`, logged once (the training loss then runs as
/// tensor ops), for the caller to return.
#[cfg(feature = "cubecl")]
pub(crate) fn no_fused_cross_entropy(reason: String) -> String {
    warn_once_per_reason(&reason, "fused cross-entropy unavailable, the loss runs as tensor ops");
    reason
}

/// Logs `what` with `reason`: a warning the first time this reason occurs in the process
/// (fallbacks repeat at every layer of every step), a debug line every time after. Reasons
/// that name a length (one for each length of a run whose lengths change every batch) are
/// warned of at their first 64, debug lines after.
pub(crate) fn warn_once_per_reason(reason: &str, what: &'static str) {
    static WARNED: std::sync::Mutex<Option<std::collections::HashSet<String>>> = std::sync::Mutex::new(None);
    let mut warned = WARNED.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let warned = warned.get_or_insert_with(Default::default);
    if warned.contains(reason) || warned.len() >= 64 {
        tracing::debug!(%reason, "{what}");
    } else {
        tracing::warn!(%reason, "{what}");
        warned.insert(reason.to_string());
    }
}
