//! Ring attention: the sequence is cut into one chunk per rank of a ring (two under zigzag
//! sharding); each rank keeps its chunks' queries and passes its keys and values around the
//! ring, attending to each block as it arrives. Partial results merge by their log-sum-exp,
//! so the result is exact. This is the "ring" half of Ulysses × Ring (USP): it goes past
//! the head count, where Ulysses alone stops.
//!
//! Two implementations of the same blocks ([`RingSharding::visible_blocks`]):
//! - [`flash`]: every block runs the backend's fused (flash) kernels, and the whole ring is
//!   one autodiff node whose backward runs the ring again (ring-flash-attention's scheme);
//!   nothing per block is saved.
//! - [`reference`]: every block is ordinary tensor ops (a `chunk × chunk` score matrix,
//!   never `S × S`), differentiated by autodiff through the `send_recv` nodes. It runs
//!   where the backend has no kernel for the blocks (NdArray, an unsupported head dim).

mod flash;
mod reference;

use std::sync::Arc;

use burn::tensor::{Tensor, backend::Backend, ops::AttentionModuleOptions};

pub use crate::layout::{BlockKind, RingBlock, RingPlan, RingSharding, pairs_per_rank};
use crate::{
    comm::Communicator,
    error::UlyssesError,
    capabilities::{DenseFallback, ExchangeBackend},
    flash::fallback_unless_forbidden,
    primitive::{float_primitive, float_tensor},
};
pub(crate) use flash::{attend as fused_ring_attention, attend_tracked as fused_ring_attention_tracked};

/// Attention of this ring rank's queries `[B, H, S/R, D]` over the whole sequence, whose
/// keys and values `[B, H_kv, S/R, D]` are held by the ring's ranks as `sharding` places
/// them (each rank's tensors are its chunks, concatenated in order). Collective over
/// `ring`: every rank calls it with tensors of the same shape. Runs the fused blocks when
/// the backend's kernels take them, else the reference blocks, the reason logged, where
/// `fallback` allows them (`UlyssesConfig::forbid_dense_fallback` does not: under autodiff they
/// keep each block's scores until the backward, `S² / R` a head, an out-of-memory error at
/// long sequences rather than a slowdown).
pub fn ring_attention<X: ExchangeBackend>(
    query: Tensor<X, 4>,
    key: Tensor<X, 4>,
    value: Tensor<X, 4>,
    options: AttentionModuleOptions,
    sharding: RingSharding,
    ring: &Arc<dyn Communicator<X::Wire>>,
    fallback: DenseFallback,
) -> Result<Tensor<X, 4>, UlyssesError> {
    // The kernels are checked for q's dtype alone, and the blocks' products need one.
    crate::layout::check_dtypes_agree([&query, &key, &value].map(|t| t.dtype()))?;
    let plan = RingPlan::new(query.dims(), key.dims(), value.dims(), crate::primitive::call_options(&options), sharding, ring.rank(), ring.size())?;
    let verdict = flash::check::<X::Wire>(&plan, query.dtype(), &query.device());
    match blocks_every_peer_fuses(verdict, ring)? {
        Ok(()) => {
            let output = X::fused_ring_attention(float_primitive(query), float_primitive(key), float_primitive(value), &plan, ring)?;
            Ok(float_tensor(output))
        }
        Err(reason) => {
            let reason = format!("the ring's fused kernels do not take its blocks ({reason}), so they would run as tensor ops with chunk x chunk scores");
            fallback_unless_forbidden(reason, fallback, "ring attention runs its blocks as tensor ops (chunk x chunk scores), not on fused kernels")?;
            reference::ring_attention(query, key, value, &plan, ring)
        }
    }
}

/// This rank's `verdict` on the fused blocks, or where a peer's refuses them, that peer named:
/// the ring runs the fused blocks on every peer or on none. Their backwards exchange otherwise
/// (other passes, directions and payloads), and peers that chose apart (GPUs of two kinds)
/// would pair each send with another receive: a hang, or data read as another's. Collective.
fn blocks_every_peer_fuses<W: Backend>(verdict: Result<(), String>, ring: &Arc<dyn Communicator<W>>) -> Result<Result<(), String>, UlyssesError> {
    let every_peer = crate::comm::all_gather_host_checked(&**ring, &[verdict.is_ok() as u64], "whether the ring's peers run fused blocks")?;
    Ok(verdict.and_then(|()| match every_peer.iter().position(|fuses| fuses[0] == 0) {
        Some(peer) => Err(format!("ring rank {peer}'s do not (its log names why), and every peer must run the blocks alike")),
        None => Ok(()),
    }))
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
fn pass<X: ExchangeBackend, const D: usize>(tensor: Tensor<X, D>, plan: &RingPlan, ring: &Arc<dyn Communicator<X::Wire>>) -> Result<Tensor<X, D>, UlyssesError> {
    let (next, previous) = plan.next_and_previous();
    Ok(float_tensor(X::send_recv(float_primitive(tensor), next, previous, ring)?))
}

/// The keys and values of a block (`[B, H_kv, S/R, D + Dv]`, as they travel), each cut into
/// the chunks of the rank they came from.
fn key_value_chunks<X: Backend>(block: &Tensor<X, 4>, plan: &RingPlan) -> (Vec<Tensor<X, 4>>, Vec<Tensor<X, 4>>) {
    let keys = chunks_of(&block.clone().narrow(3, 0, plan.head_dim), plan.chunks);
    let values = chunks_of(&block.clone().narrow(3, plan.head_dim, plan.value_dim), plan.chunks);
    (keys, values)
}

/// What the ring's forward gives: this rank's output and log-sum-exp `[B, H, S/R, 1]`
/// (chunks in order), and the last block of keys and values it held.
struct RingForward<X: Backend> {
    output: Tensor<X, 4>,
    lse: Tensor<X, 4>,
    last_block: Tensor<X, 4>,
}

/// The ring's forward, one traversal for both paths: keys and values travel together, one
/// pass per step, our own first; `attend` gives every visible block's output and
/// log-sum-exp (`[B, H, S_c, 1]`), merged into its query chunk's running result.
fn attend_around_ring<X: ExchangeBackend>(
    query: Tensor<X, 4>,
    key: Tensor<X, 4>,
    value: Tensor<X, 4>,
    plan: &RingPlan,
    ring: &Arc<dyn Communicator<X::Wire>>,
    mut attend: impl FnMut([Tensor<X, 4>; 3], &RingBlock) -> Result<(Tensor<X, 4>, Tensor<X, 4>), UlyssesError>,
) -> Result<RingForward<X>, UlyssesError> {
    let queries = chunks_of(&query, plan.chunks);
    // Per query chunk, the running (output, log-sum-exp) over the key chunks seen so far.
    let mut partial: Vec<Option<(Tensor<X, 4>, Tensor<X, 4>)>> = vec![None; plan.chunks];
    let mut block = Tensor::cat(vec![key, value], 3);
    for step in 0..plan.size {
        if step > 0 {
            block = pass(block, plan, ring)?;
        }
        let (keys, values) = key_value_chunks(&block, plan);
        for b in plan.blocks(step) {
            let (output, lse) = attend([queries[b.query].clone(), keys[b.key].clone(), values[b.key].clone()], &b)?;
            partial[b.query] = Some(match partial[b.query].take() {
                None => (output, lse),
                Some((before, before_lse)) => merge(before, before_lse, output, lse),
            });
        }
    }
    // Every chunk sees at least itself (its diagonal block), so every part is set.
    let (outputs, lses): (Vec<_>, Vec<_>) = partial.into_iter().map(|p| p.expect("a chunk sees itself")).unzip();
    Ok(RingForward { output: join(outputs), lse: join(lses), last_block: block })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use burn::backend::NdArray;

    use super::blocks_every_peer_fuses;
    use crate::comm::{Communicator, ThreadGroup};

    /// A ring whose peers' kernels judge its blocks apart (GPUs of two kinds) runs them alike:
    /// where one peer refuses the fused blocks, every peer takes the reference ones, naming it.
    #[test]
    fn the_ring_runs_fused_blocks_on_every_peer_or_on_none() {
        let verdicts = |refusing: Option<usize>| {
            ThreadGroup::new(3)
                .run(move |rank| {
                    let ring: Arc<dyn Communicator<NdArray<f32>>> = rank.communicator();
                    let own = if refusing == Some(rank.rank()) { Err("no kernel for this device".to_string()) } else { Ok(()) };
                    blocks_every_peer_fuses(own, &ring).unwrap()
                })
                .into_iter()
                .map(|verdict| verdict.unwrap_or_else(|panic| panic!("{}", panic.message)))
                .collect::<Vec<_>>()
        };
        assert_eq!(verdicts(None), [Ok(()), Ok(()), Ok(())]);
        let apart = verdicts(Some(1));
        assert_eq!(apart[1], Err("no kernel for this device".to_string()));
        for rank in [0, 2] {
            let reason = apart[rank].clone().expect_err("a peer ran the fused blocks beside one that did not");
            assert!(reason.contains("ring rank 1's do not"), "ring rank {rank}: {reason}");
        }
    }
}
