//! Attention in blocks of queries (placeholder: burn's attention).

use burn::tensor::{Tensor, module, ops::AttentionModuleOptions};

pub fn attention(query: Tensor<4>, key: Tensor<4>, value: Tensor<4>, is_causal: bool, scale: Option<f64>) -> Tensor<4> {
    module::attention(query, key, value, None, None, AttentionModuleOptions { scale, softcap: None, is_causal })
}
