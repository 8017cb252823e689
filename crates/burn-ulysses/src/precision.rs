//! Mixed precision with f32 master weights.
//!
//! Parameters, their gradients and the optimizer state stay f32. A model computes in the
//! dtype of its hidden states: it casts the embedding's output to the compute dtype once,
//! and every op after follows the tensor it is given:
//! - [`linear`]: the f32 weight cast to the input's dtype, then the matmul in that dtype;
//! - [`rms_norm`]: its mean of squares in f32, the rows it normalises (and what autodiff keeps
//!   of them) in the input's dtype;
//! - attention gets q/k/v in the compute dtype, so the exchanges move half the bytes and the
//!   flash kernels run their bf16/f16 paths (tensor cores on CUDA; f32 softmax statistics
//!   and accumulators in every case);
//! - the loss: each chunk of the last hidden states gets its logits in the compute dtype (the
//!   head's weight cast once per step; f32 accumulation), then its softmax and loss in f32
//!   (`ulysses_training::lm_loss_sum`, `OutputHead::logits_dtype`); what the backward keeps
//!   of them stays in the hidden states' dtype.
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
    /// Matmuls, exchanges and attention in bf16, or in f16 where the device has no bf16
    /// (without loss scaling: fit for tests and evaluation, and the trainer refuses to train
    /// so); norm and softmax statistics, the loss, parameters and optimizer state in f32.
    Bf16,
}

/// `f32` or `bf16`, as the trainer's and the memory bench's `--precision` take it.
impl std::str::FromStr for Precision {
    type Err = String;

    fn from_str(value: &str) -> Result<Self, String> {
        match value {
            "f32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            other => Err(format!("{other}: the precisions are f32 and bf16")),
        }
    }
}

impl Precision {
    /// The compute dtype on `device`, or an error naming the device when it has neither
    /// bf16 nor f16 (NdArray, for one).
    pub fn compute_dtype<B: Backend>(self, device: &B::Device) -> Result<FloatDType, UlyssesError> {
        match self {
            Precision::F32 => Ok(FloatDType::F32),
            Precision::Bf16 if B::supports_dtype(device, DType::BF16) => Ok(FloatDType::BF16),
            Precision::Bf16 if B::supports_dtype(device, DType::F16) => {
                tracing::warn!("{device:?} has no bf16: computing in f16, without loss scaling (small gradients round to zero)");
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

/// `norm.forward(x)` in `x`'s dtype, its statistics in f32, and what autodiff keeps for the
/// backward in `x`'s dtype.
///
/// In f32 this is burn's norm. In bf16/f16 what autodiff keeps matters at long context: per
/// token and feature, input and output included, the norm computed in f32 keeps 12 bytes
/// (f32 copies of the input and of the normalised rows), burn's norm 10 (an f32 copy for its
/// squares), this form 8 (`tests/mixed_precision_wgpu.rs` measures it on the device).
///
/// Here the input is first scaled, per row, by a constant `s ≈ 1 / rms(x)` computed in f32
/// outside the graph, so its squares are near 1 (no f16 overflow, no bf16 loss of range);
/// then RMSNorm of `x · s` with `eps · s²` in place of `eps` is exactly RMSNorm of `x`,
/// values and gradients (`mean((x s)²) + eps s² = s² (mean(x²) + eps)`), while the graph
/// keeps only `x · s` and the normalised rows, both in `x`'s dtype.
pub fn rms_norm<B: Backend, const D: usize>(norm: &RmsNorm<B>, x: Tensor<B, D>) -> Tensor<B, D> {
    match FloatDType::from(x.dtype()) {
        // burn's norm multiplies by the gain as it is: only where the two dtypes agree (a
        // half-precision default float's gain beside f32 rows would be read as f32).
        FloatDType::F32 | FloatDType::F64 if norm.gamma.dtype() == x.dtype() => norm.forward(x),
        _ => prescaled_rms_norm(norm, x),
    }
}

/// The half-precision form of [`rms_norm`], in any dtype (public so that it can be checked
/// against burn's norm in f32, where the two must agree).
pub fn prescaled_rms_norm<B: Backend, const D: usize>(norm: &RmsNorm<B>, x: Tensor<B, D>) -> Tensor<B, D> {
    let dtype = FloatDType::from(x.dtype());
    let last = D - 1;
    // Outside the graph: `detach` alone keeps a leaf's `require_grad`, and this would be a
    // graph of its own, keeping its f32 square until a backward that never comes. Capped at
    // 2^14 so that it stays finite in f16 for rows of zeros and tiny epsilons (any positive
    // constant keeps the identity); rounded to the dtype before use, so that the identity
    // holds for the `s` actually applied.
    let scale = x.clone().detach().set_require_grad(false).cast(FloatDType::F32).square().mean_dim(last).add_scalar(norm.epsilon).sqrt().recip();
    let scale = scale.clamp_max(16384.0).cast(dtype);
    let scaled_epsilon = scale.clone().cast(FloatDType::F32).square().mul_scalar(norm.epsilon);
    let scaled = x * scale;
    let mean_square = scaled.clone().square().cast(FloatDType::F32).mean_dim(last);
    let inverse_rms = (mean_square + scaled_epsilon).sqrt().recip().cast(dtype);
    scaled * inverse_rms * norm.gamma.val().cast(dtype).unsqueeze()
}

#[cfg(test)]
mod tests {
    use burn::{
        backend::{Autodiff, NdArray},
        nn::RmsNormConfig,
        tensor::TensorData,
    };

    use super::*;

    type B = Autodiff<NdArray<f32>>;

    /// Rows that stress the pre-scaling: ordinary, large (squares past f16's range), tiny
    /// (below epsilon's scale), all zeros.
    fn rows() -> Vec<f32> {
        let mut values = Vec::new();
        for (row, magnitude) in [1.0f32, 3.0e3, 2.0e-4, 0.0].into_iter().enumerate() {
            values.extend((0..8).map(|i| magnitude * ((i * 7 + row * 3) % 11) as f32 / 5.0 - magnitude));
        }
        values
    }

    /// Output, input gradient and gamma gradient of `norm` applied by `apply`, under a fixed
    /// non-uniform upstream gradient.
    fn run(apply: impl Fn(&RmsNorm<B>, Tensor<B, 2>) -> Tensor<B, 2>) -> [Vec<f32>; 3] {
        let device = Default::default();
        let mut norm = RmsNormConfig::new(8).with_epsilon(1e-5).init::<B>(&device);
        let gamma: Vec<f32> = (0..8).map(|i| 0.5 + i as f32 * 0.25).collect();
        norm.gamma = norm.gamma.map(|_| Tensor::from_data(TensorData::new(gamma, [8]), &device).require_grad());
        let x = Tensor::<B, 2>::from_data(TensorData::new(rows(), [4, 8]), &device).require_grad();
        let upstream: Vec<f32> = (0..32).map(|i| ((i * 5) % 9) as f32 / 4.0 - 1.0).collect();
        let y = apply(&norm, x.clone());
        let grads = (y.clone() * Tensor::from_data(TensorData::new(upstream, [4, 8]), &device)).sum().backward();
        let values = |t: Tensor<NdArray<f32>, 2>| t.into_data().to_vec::<f32>().unwrap();
        [values(y.inner()), values(x.grad(&grads).unwrap()), norm.gamma.grad(&grads).unwrap().into_data().to_vec().unwrap()]
    }

    #[test]
    fn the_prescaled_norm_is_burns_norm_in_values_and_gradients() {
        let want = run(|norm, x| norm.forward(x));
        let got = run(|norm, x| prescaled_rms_norm(norm, x));
        for (what, (got, want)) in ["output", "input gradient", "gamma gradient"].iter().zip(got.iter().zip(&want)) {
            assert_eq!(got.len(), want.len(), "{what}");
            // Relative to the largest value of each row of 8 (the gamma gradient is one): the
            // large row's input gradient is ~1e-3 (1 / its RMS), where an error relative to 1
            // would pass 1%.
            for (index, (g, w)) in got.iter().zip(want).enumerate() {
                let row = &want[index / 8 * 8..(index / 8 + 1) * 8];
                let scale = row.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
                let error = (g - w).abs() / scale;
                assert!(error <= 1e-5, "{what}[{index}]: {g} against burn's {w} (error {error} of its row's largest)");
            }
        }
    }
}
