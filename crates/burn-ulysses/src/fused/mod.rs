//! Attention over whole sequences: fused kernels where the backend has them, burn's
//! attention where it does not.
//!
//! Under autodiff, a fused forward becomes one [`FusedAttentionBackward`] node that saves q,
//! k, v, the output and the per-row log-sum-exp, and whose backward runs the fused backward
//! kernels: no `S × S` score matrix in either pass. burn's own `Autodiff` attention, by
//! contrast, is decomposed into matmul and softmax and keeps the whole score matrix.

use burn::tensor::{
    Tensor,
    backend::Backend,
    ops::{AttentionModuleOptions, BoolTensor, FloatTensor},
};
use burn_autodiff::{
    checkpoint::base::Checkpointer,
    grads::Gradients,
    ops::{Backward, Ops},
};

use crate::{
    attention::repeat_kv_heads,
    inner::{ExchangeBackend, PlainBackend},
    primitive::{float_primitive, float_tensor},
};

/// Attention over whole sequences with the best kernel `B` has: for
/// `Autodiff<CubeBackend<R, ..>>` and `CubeBackend<R, ..>` (feature `cubecl`) the
/// flash-attention kernels of `ulysses-kernels`, differentiable, without a score matrix.
/// k and v may have fewer heads than q (grouped-query attention).
pub fn flash_attention<B: ExchangeBackend>(
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
    let output = B::sequence_attention(float_primitive(query), float_primitive(key), float_primitive(value), None, None, options);
    float_tensor(output)
}

/// burn's attention, with grouped kv heads expanded to the q head count first.
pub(crate) fn reference_attention<B: Backend>(
    query: FloatTensor<B>,
    key: FloatTensor<B>,
    value: FloatTensor<B>,
    mask: Option<BoolTensor<B>>,
    attn_bias: Option<FloatTensor<B>>,
    options: AttentionModuleOptions,
) -> FloatTensor<B> {
    let query = float_tensor::<B, 4>(query);
    let (key, value) = (float_tensor::<B, 4>(key), float_tensor::<B, 4>(value));
    let group = query.dims()[1] / key.dims()[1];
    B::attention(
        float_primitive(query),
        float_primitive(repeat_kv_heads(key, group)),
        float_primitive(repeat_kv_heads(value, group)),
        mask,
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
mod cube;
#[cfg(feature = "cubecl")]
mod fusion;

/// Logs, once per process, why attention falls back to burn's: a refusal repeats at every
/// layer of every step.
#[cfg(feature = "cubecl")]
fn warn_fallback_once(reason: &dyn std::fmt::Display) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| tracing::warn!(%reason, "flash attention unavailable, using burn's attention (which builds the score matrix)"));
}
