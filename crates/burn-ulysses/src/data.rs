//! Sequence sharding, as ALST does it (labels shifted first, padded, cut into `P` contiguous
//! shards, global or per-document positions): ulysses-core's, on the host, shared with the
//! burn 0.22 crate. This module adds the tensors a burn 0.21 model takes.

use burn::tensor::{Bool, Int, Tensor, TensorData, backend::Backend};
pub use ulysses_core::data::{IGNORE_INDEX, SequenceShard, SequenceSharder, ShardCut, ShardPositions, pack_documents};

/// A shard's tokens and labels as burn 0.21 tensors.
pub trait ShardTensors {
    /// `[batch, local_len]` token tensor on `device`.
    fn tokens<B: Backend>(&self, device: &B::Device) -> Tensor<B, 2, Int>;

    /// `[batch, local_len]` label tensor on `device`.
    fn labels<B: Backend>(&self, device: &B::Device) -> Tensor<B, 2, Int>;

    /// `[batch, local_len]` key-padding mask on `device`, true at padding
    /// ([`SequenceShard::padding`]): burn's `mask_pad` for attention that looks both ways
    /// (`burn_ulysses::nn`'s encoder, a `[batch, 1, 1, local_len]` mask to
    /// `module::attention`), which the group gathers with the keys.
    fn mask_pad<B: Backend>(&self, device: &B::Device) -> Tensor<B, 2, Bool>;
}

impl ShardTensors for SequenceShard {
    fn tokens<B: Backend>(&self, device: &B::Device) -> Tensor<B, 2, Int> {
        int_tensor(self, &self.tokens, device)
    }

    fn labels<B: Backend>(&self, device: &B::Device) -> Tensor<B, 2, Int> {
        int_tensor(self, &self.labels, device)
    }

    fn mask_pad<B: Backend>(&self, device: &B::Device) -> Tensor<B, 2, Bool> {
        Tensor::from_data(TensorData::new(self.padding.clone(), [self.batch, self.local_len]), device)
    }
}

fn int_tensor<B: Backend>(shard: &SequenceShard, values: &[i64], device: &B::Device) -> Tensor<B, 2, Int> {
    Tensor::from_data(TensorData::new(values.to_vec(), [shard.batch, shard.local_len]), device)
}
