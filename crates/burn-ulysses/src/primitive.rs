//! Conversions between backend primitives (what backend ops receive) and `Tensor`s (what
//! the readable tensor API works on).

use burn::tensor::{Shape, Tensor, TensorMetadata, TensorPrimitive, backend::Backend, ops::FloatTensor};

/// Views a float primitive as a `Tensor` of rank `D`.
pub fn float_tensor<B: Backend, const D: usize>(primitive: FloatTensor<B>) -> Tensor<B, D> {
    debug_assert_eq!(primitive.shape().num_dims(), D);
    Tensor::from_primitive(TensorPrimitive::Float(primitive))
}

/// Unwraps a `Tensor` back into its float primitive.
pub fn float_primitive<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> FloatTensor<B> {
    tensor.into_primitive().tensor()
}

/// Flattens any float primitive to `[rows, len / rows]`, the layout collectives work on.
pub(crate) fn as_rows<B: Backend>(primitive: FloatTensor<B>, rows: usize) -> Tensor<B, 2> {
    let elements = primitive.shape().num_elements();
    let columns = elements.checked_div(rows).unwrap_or(0);
    float_tensor::<B, 2>(B::float_reshape(primitive, Shape::new([rows, columns])))
}

/// Size in bytes of a float primitive.
pub(crate) fn byte_size<B: Backend>(primitive: &FloatTensor<B>) -> u64 {
    (primitive.shape().num_elements() * primitive.dtype().size()) as u64
}

/// What the layout rules (ulysses-core) read of burn's attention options.
pub(crate) fn call_options(options: &burn::tensor::ops::AttentionModuleOptions) -> crate::layout::CallOptions {
    crate::layout::CallOptions { scale: options.scale, softcap: options.softcap, is_causal: options.is_causal }
}
