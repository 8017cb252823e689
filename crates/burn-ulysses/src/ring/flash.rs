//! The ring on fused kernels, as ring-flash-attention runs it.
//!
//! Forward: each block runs the backend's fused forward, which returns the block's output
//! and log-sum-exp; blocks merge by log-sum-exp in f32.
//!
//! Backward: not block by block through autodiff (that would save every block's output).
//! The whole ring is one autodiff node that saves q, k, v, the merged output and the merged
//! log-sum-exp, and whose backward runs the ring again: each block's backward kernel gets
//! the *merged* output and log-sum-exp, so its probabilities `exp(s − lse)` are the global
//! ones and its row term `rowsum(dO · O)` is the global one; the blocks' gradients then
//! simply add. dK/dV travel with their keys and values and one last pass takes them home.
//! Every rank runs every pass of the backward, whatever its blocks, so ranks stay in step.

use std::sync::Arc;

use burn::tensor::{DType, Tensor, backend::Backend, ops::{AttentionModuleOptions, FloatTensor}};
use burn_autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};

use super::{attend_around_ring, chunks_of, join, key_value_chunks, pass};
use crate::{
    comm::Communicator,
    error::UlyssesError,
    capabilities::PlainBackend,
    layout::{RingBlock, RingPlan},
    primitive::{float_primitive, float_tensor},
};

/// The options of one block's kernel call: the diagonal block is causal, the others full.
fn block_options(plan: &RingPlan, block: &RingBlock) -> AttentionModuleOptions {
    AttentionModuleOptions { scale: Some(plan.scale), softcap: None, is_causal: block.diagonal }
}

/// `Ok` when `B`'s fused kernels take every kind of block of `plan` for inputs of `dtype`
/// on `device`, else why not.
pub(super) fn check<B: PlainBackend>(plan: &RingPlan, dtype: DType, device: &B::Device) -> Result<(), String> {
    let query = [plan.batch, plan.q_heads, plan.chunk_len, plan.head_dim];
    let key = [plan.batch, plan.kv_heads, plan.chunk_len, plan.head_dim];
    let value = [plan.batch, plan.kv_heads, plan.chunk_len, plan.value_dim];
    let kinds: &[bool] = if plan.causal { &[false, true] } else { &[false] };
    for &diagonal in kinds {
        let options = block_options(plan, &RingBlock { query: 0, key: 0, diagonal });
        B::fused_attention_check([(&query, dtype), (&key, dtype), (&value, dtype)], device, &options)?;
    }
    Ok(())
}

/// Output `[B, H, S/R, Dv]` (q's dtype) and log-sum-exp `[B, H, S/R]` (f32) of this rank's
/// queries over the whole ring.
fn forward<B: PlainBackend>(
    query: Tensor<B, 4>,
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    plan: &RingPlan,
    ring: &Arc<dyn Communicator<B>>,
) -> Result<(Tensor<B, 4>, Tensor<B, 3>), UlyssesError> {
    let dtype = query.dtype();
    let forward = attend_around_ring(query, key, value, plan, ring, |[query, key, value], block| {
        let (output, lse) = B::fused_attention_forward(float_primitive(query), float_primitive(key), float_primitive(value), &block_options(plan, block), None)
            .map_err(|reason| UlyssesError::Shape(format!("ring attention: the fused kernels refused a block they had accepted: {reason}")))?;
        // Merged in f32, whatever the inputs' dtype.
        Ok((float_tensor::<B, 4>(output).cast(DType::F32), float_tensor::<B, 3>(lse).unsqueeze_dim(3)))
    })?;
    Ok((forward.output.cast(dtype), forward.lse.squeeze_dim(3)))
}

/// What the ring's backward needs, saved by the forward.
#[derive(Debug, Clone)]
struct RingState<B: Backend> {
    query: Tensor<B, 4>,
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    output: Tensor<B, 4>,
    lse: Tensor<B, 3>,
    plan: RingPlan,
}

/// `(dQ, dK, dV)` of this rank's q, k and v: the ring again, see the module doc.
fn backward<B: PlainBackend>(state: RingState<B>, output_grad: Tensor<B, 4>, ring: &Arc<dyn Communicator<B>>) -> Result<[Tensor<B, 4>; 3], UlyssesError> {
    let RingState { query, key, value, output, lse, plan } = state;
    let dtype = query.dtype();
    let (queries, outputs) = (chunks_of(&query, plan.chunks), chunks_of(&output, plan.chunks));
    let (output_grads, lses) = (chunks_of(&output_grad, plan.chunks), chunks_of(&lse, plan.chunks));
    let mut query_grads: Vec<Option<Tensor<B, 4>>> = vec![None; plan.chunks];
    let mut block = Tensor::cat(vec![key, value], 3);
    // dK and dV of the keys and values in `block`, in f32, travelling with them.
    let kv_width = plan.head_dim + plan.value_dim;
    let mut block_grads: Vec<Tensor<B, 4>> =
        (0..plan.chunks).map(|_| Tensor::zeros([plan.batch, plan.kv_heads, plan.chunk_len, kv_width], (&block.device(), DType::F32))).collect();
    for step in 0..plan.size {
        if step > 0 {
            block = pass::<B, 4>(block, &plan, ring)?;
            block_grads = chunks_of(&pass::<B, 4>(join(block_grads), &plan, ring)?, plan.chunks);
        }
        let (keys, values) = key_value_chunks(&block, &plan);
        for b in plan.blocks(step) {
            let (dq, dk, dv) = B::fused_attention_backward(
                float_primitive(queries[b.query].clone()),
                float_primitive(keys[b.key].clone()),
                float_primitive(values[b.key].clone()),
                float_primitive(outputs[b.query].clone()),
                float_primitive(output_grads[b.query].clone()),
                float_primitive(lses[b.query].clone()),
                &block_options(&plan, &b),
                None,
            );
            let dq = float_tensor::<B, 4>(dq).cast(DType::F32);
            query_grads[b.query] = Some(match query_grads[b.query].take() {
                None => dq,
                Some(before) => before + dq,
            });
            let dkv = Tensor::cat(vec![float_tensor::<B, 4>(dk), float_tensor::<B, 4>(dv)], 3).cast(DType::F32);
            block_grads[b.key] = block_grads[b.key].clone() + dkv;
        }
    }
    // The gradients held now are those of the next rank's keys and values: one more pass
    // takes every rank's home.
    let kv_grad = if plan.size > 1 { pass::<B, 4>(join(block_grads), &plan, ring)? } else { join(block_grads) };
    let query_grad = join(query_grads.into_iter().map(|g| g.expect("a chunk sees itself")).collect());
    Ok([
        query_grad.cast(dtype),
        kv_grad.clone().narrow(3, 0, plan.head_dim).cast(dtype),
        kv_grad.narrow(3, plan.head_dim, plan.value_dim).cast(dtype),
    ])
}

/// [`super::ring_attention`] on fused blocks, without autodiff.
pub(crate) fn attend<B: PlainBackend>(
    query: FloatTensor<B>,
    key: FloatTensor<B>,
    value: FloatTensor<B>,
    plan: &RingPlan,
    ring: &Arc<dyn Communicator<B>>,
) -> Result<FloatTensor<B>, UlyssesError> {
    let (output, _lse) = forward(float_tensor(query), float_tensor(key), float_tensor(value), plan, ring)?;
    Ok(float_primitive(output))
}

/// The autodiff node of the fused ring: its parents are q, k and v.
struct FusedRingBackward<B: Backend> {
    ring: Arc<dyn Communicator<B>>,
}

impl<B: Backend> std::fmt::Debug for FusedRingBackward<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FusedRingBackward(ring rank {} of {})", self.ring.rank(), self.ring.size())
    }
}

impl<B: PlainBackend> Backward<B, 3> for FusedRingBackward<B> {
    type State = RingState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let output_grad = float_tensor::<B, 4>(grads.consume::<B>(&ops.node));
        // A backward op cannot return an error; every rank reaches the same verdict.
        let [dq, dk, dv] = backward(ops.state, output_grad, &self.ring).unwrap_or_else(|error| crate::failure::fail(error));
        let [query, key, value] = ops.parents;
        for (parent, grad) in [(query, dq), (key, dk), (value, dv)] {
            if let Some(parent) = parent {
                grads.register::<B>(parent.id, float_primitive(grad));
            }
        }
    }
}

/// [`super::ring_attention`] on fused blocks, as one autodiff node.
pub(crate) fn attend_tracked<B: PlainBackend, C: CheckpointStrategy>(
    query: FloatTensor<Autodiff<B, C>>,
    key: FloatTensor<Autodiff<B, C>>,
    value: FloatTensor<Autodiff<B, C>>,
    plan: &RingPlan,
    ring: &Arc<dyn Communicator<B>>,
) -> Result<FloatTensor<Autodiff<B, C>>, UlyssesError> {
    let (q, k, v) = (float_tensor::<B, 4>(query.primitive), float_tensor::<B, 4>(key.primitive), float_tensor::<B, 4>(value.primitive));
    let (output, lse) = forward(q.clone(), k.clone(), v.clone(), plan, ring)?;
    let node = FusedRingBackward { ring: ring.clone() };
    // Compute bound: the ring's passes are collectives and must never be recomputed on some
    // ranks only (they would deadlock), and recomputing attention costs what it saves.
    Ok(match node.prepare::<C>([query.node, key.node, value.node]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => {
            let state = RingState { query: q, key: k, value: v, output: output.clone(), lse, plan: *plan };
            prep.finish(state, float_primitive(output))
        }
        OpsKind::UnTracked(prep) => prep.finish(float_primitive(output)),
    })
}
