//! Ring attention: the sequence is cut into one chunk per rank of a ring (two under zigzag
//! sharding); each rank keeps its chunks' queries and passes its keys and values around the
//! ring, attending to each block as it arrives. Partial results merge by their log-sum-exp,
//! so the result is exact. This is the "ring" half of Ulysses × Ring (USP): it goes past
//! the head count, where Ulysses alone stops.
//!
//! Two implementations of the same blocks ([`RingSharding::visible_blocks`]):
//! - [`fused`]: every block runs the backend's fused (flash) kernels, and the whole ring is
//!   one autodiff node whose backward runs the ring again (ring-flash-attention's scheme);
//!   nothing per block is saved.
//! - [`reference`]: every block is ordinary tensor ops (a `chunk × chunk` score matrix,
//!   never `S × S`), differentiated by autodiff through the `send_recv` nodes. It runs
//!   where the backend has no kernel for the blocks (NdArray, an unsupported head dim).

mod fused;
mod reference;

use std::sync::Arc;

use burn::tensor::{Tensor, backend::Backend, ops::AttentionModuleOptions};

pub use crate::layout::{BlockKind, RingBlock, RingPlan, RingSharding, pairs_per_rank};
use crate::{
    comm::Communicator,
    error::UlyssesError,
    inner::ExchangeBackend,
    primitive::{float_primitive, float_tensor},
};
pub(crate) use fused::{attend as fused_ring_attention, attend_tracked as fused_ring_attention_tracked};

/// Attention of this ring rank's queries `[B, H, S/R, D]` over the whole sequence, whose
/// keys and values `[B, H_kv, S/R, D]` are held by the ring's ranks as `sharding` places
/// them (each rank's tensors are its chunks, concatenated in order). Collective over
/// `ring`: every rank calls it with tensors of the same shape. Runs the fused blocks when
/// the backend's kernels take them, else the reference blocks (the reason is logged).
pub fn ring_attention<X: ExchangeBackend>(
    query: Tensor<X, 4>,
    key: Tensor<X, 4>,
    value: Tensor<X, 4>,
    options: AttentionModuleOptions,
    sharding: RingSharding,
    ring: &Arc<dyn Communicator<X::Wire>>,
) -> Result<Tensor<X, 4>, UlyssesError> {
    let plan = RingPlan::new(query.dims(), key.dims(), value.dims(), &options, sharding, ring.rank(), ring.size())?;
    match fused::check::<X::Wire>(&plan, query.dtype(), &query.device()) {
        Ok(()) => {
            let output = X::fused_ring_attention(float_primitive(query), float_primitive(key), float_primitive(value), &plan, ring)?;
            Ok(float_tensor(output))
        }
        Err(reason) => {
            log_reference_blocks(reason);
            reference::ring_attention(query, key, value, &plan, ring)
        }
    }
}

/// The reason the blocks run as tensor ops: a warning the first time in the process, a
/// debug line after (it repeats at every layer of every step).
fn log_reference_blocks(reason: String) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    let mut first = false;
    WARNED.call_once(|| first = true);
    if first {
        tracing::warn!(%reason, "ring attention runs its blocks as tensor ops (chunk x chunk scores), not on fused kernels");
    } else {
        tracing::debug!(%reason, "ring attention on tensor-op blocks");
    }
}

/// This rank's tensor cut into its chunks along the sequence (dim 2).
fn chunks_of<B: Backend, const D: usize>(tensor: &Tensor<B, D>, count: usize) -> Vec<Tensor<B, D>> {
    let len = tensor.dims()[2] / count;
    (0..count).map(|i| tensor.clone().narrow(2, i * len, len)).collect()
}

/// Joins chunks back along the sequence (dim 2).
fn join<B: Backend, const D: usize>(chunks: Vec<Tensor<B, D>>) -> Tensor<B, D> {
    if chunks.len() == 1 { chunks.into_iter().next().unwrap() } else { Tensor::cat(chunks, 2) }
}

/// Two partial attentions of the same rows over disjoint keys, as one: outputs
/// `[B, H, S, D]` weighted by their share of the rows' total `exp(lse)`, log-sum-exps
/// `[B, H, S, 1]` added in log space.
fn merge<B: Backend>(output: Tensor<B, 4>, lse: Tensor<B, 4>, other: Tensor<B, 4>, other_lse: Tensor<B, 4>) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let max = lse.clone().max_pair(other_lse.clone()).detach();
    let (mine, theirs) = ((lse - max.clone()).exp(), (other_lse - max.clone()).exp());
    let total = mine.clone() + theirs.clone();
    let merged = (output * mine + other * theirs) / total.clone();
    (merged, max + total.log())
}

/// The one pass of the ring (to the next rank, from the previous one) on any backend.
fn pass<X: ExchangeBackend, const D: usize>(tensor: Tensor<X, D>, ring: &Arc<dyn Communicator<X::Wire>>) -> Result<Tensor<X, D>, UlyssesError> {
    let (rank, size) = (ring.rank(), ring.size());
    Ok(float_tensor(X::send_recv(float_primitive(tensor), (rank + 1) % size, (rank + size - 1) % size, ring)?))
}
