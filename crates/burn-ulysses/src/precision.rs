//! Mixed precision with f32 master weights.
//!
//! Parameters, their gradients and the optimizer state stay f32. A model computes in the
//! dtype of its hidden states: it casts the embedding's output to the compute dtype once,
//! and every op after follows the tensor it is given:
//! - [`linear`]: the f32 weight cast to the input's dtype, then the matmul in that dtype;
//! - [`rms_norm`]: computed in f32 (its mean of squares needs f32's range), returned in the
//!   input's dtype;
//! - attention gets q/k/v in the compute dtype, so the exchanges move half the bytes and the
//!   flash kernels run their bf16/f16 paths (tensor cores on CUDA; f32 softmax statistics
//!   and accumulators in every case);
//! - the loss is computed from f32 hidden states and the f32 head (the model casts back
//!   before its output head).
//!
//! Every cast is an autodiff op whose backward casts the gradient back, so the gradients
//! reach the f32 parameters as f32, with no master copy to keep in sync. The price is that
//! each forward casts each weight again (as PyTorch's autocast does), and a layer's graph
//! holds its half-precision weight copies until its backward.

use burn::{
    config::Config,
    nn::{Linear, RmsNorm},
    tensor::{DType, FloatDType, Tensor, backend::Backend},
};

use crate::error::UlyssesError;

/// What a training run computes in.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum Precision {
    /// Everything in f32.
    F32,
    /// Matmuls, exchanges and attention in bf16, or in f16 where the device has no bf16;
    /// norms, softmax statistics, the loss, parameters and optimizer state in f32.
    Bf16,
}

impl Precision {
    /// The compute dtype on `device`, or an error naming the device when it has neither
    /// bf16 nor f16 (NdArray, for one).
    pub fn compute_dtype<B: Backend>(self, device: &B::Device) -> Result<FloatDType, UlyssesError> {
        match self {
            Precision::F32 => Ok(FloatDType::F32),
            Precision::Bf16 if B::supports_dtype(device, DType::BF16) => Ok(FloatDType::BF16),
            Precision::Bf16 if B::supports_dtype(device, DType::F16) => {
                tracing::info!("{device:?} has no bf16: computing in f16");
                Ok(FloatDType::F16)
            }
            Precision::Bf16 => Err(UlyssesError::InvalidConfig(format!(
                "bf16 compute: the device {device:?} of {} computes neither bf16 nor f16; train in f32 (--precision f32) \
                 or on a GPU backend",
                std::any::type_name::<B>()
            ))),
        }
    }
}

/// `linear.forward(x)` in `x`'s dtype: the f32 weight (and bias) cast to it inside the
/// graph, so their gradients come back f32. A no-op cast when `x` is f32.
pub fn linear<B: Backend, const D: usize>(linear: &Linear<B>, x: Tensor<B, D>) -> Tensor<B, D> {
    let dtype = FloatDType::from(x.dtype());
    let bias = linear.bias.as_ref().map(|bias| bias.val().cast(dtype));
    burn::tensor::module::linear(x, linear.weight.val().cast(dtype), bias)
}

/// `norm.forward(x)` computed in f32 and returned in `x`'s dtype.
pub fn rms_norm<B: Backend, const D: usize>(norm: &RmsNorm<B>, x: Tensor<B, D>) -> Tensor<B, D> {
    let dtype = FloatDType::from(x.dtype());
    norm.forward(x.cast(FloatDType::F32)).cast(dtype)
}
