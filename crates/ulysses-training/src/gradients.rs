//! Gradient synchronisation: every parameter's gradient summed over a group of ranks, in
//! bounded buckets (the rules, shared with burn 0.22: `ulysses_core::gradients`), and the
//! health check that runs before it.

use burn::{
    module::{AutodiffModule, Module, ModuleVisitor, Param},
    optim::GradientsParams,
    tensor::{DType, FloatDType, Tensor, backend::{AutodiffBackend, Backend}},
};

use burn_ulysses::{
    UlyssesError,
    comm::{Collective, CommError, Communicator, HostDType, ReduceOp, host::{burn_dtype, host_dtype}},
    primitive::{float_primitive, float_tensor},
};

use crate::TrainBackend;

pub use ulysses_core::gradients::GRADIENT_BUCKET_BYTES;
use ulysses_core::gradients::{gradient_dtypes, gradient_report, plan_buckets};

/// Sums every parameter gradient over the ranks of `communicator`, in buckets of at most
/// [`GRADIENT_BUCKET_BYTES`].
pub fn all_reduce_gradients<B: TrainBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: GradientsParams,
    communicator: &dyn Communicator<B::Wire>,
) -> Result<GradientsParams, UlyssesError> {
    all_reduce_gradients_in_buckets(module, grads, communicator, GRADIENT_BUCKET_BYTES)
}

/// Sums every parameter gradient over the ranks of `communicator`, one all-reduce per bucket
/// of at most `bucket_bytes` (the rules: `ulysses_core::gradients`).
pub fn all_reduce_gradients_in_buckets<B: TrainBackend, M: AutodiffModule<B>>(
    module: &M,
    mut grads: GradientsParams,
    communicator: &dyn Communicator<B::Wire>,
    bucket_bytes: usize,
) -> Result<GradientsParams, UlyssesError> {
    if communicator.size() == 1 {
        return Ok(grads);
    }
    let mut take = TakeGradients::<B> { grads: &mut grads, local: Vec::new() };
    module.visit(&mut take);
    let mut local = take.local;
    if local.is_empty() {
        return Ok(grads);
    }

    // Each gradient's dtype, not its parameter's: a half-precision copy's gradients may be
    // summed in f32 (`GradientSums`), and a rank without one sends zeros of that dtype.
    let op = Collective::AllReduce;
    let reports = local.iter().map(|l| l.grad.as_ref().map_or(Ok(0), |grad| Ok(gradient_report(Some(host_dtype(grad.dtype(), op)?))))).collect::<Result<Vec<u64>, CommError>>()?;
    let gathered = burn_ulysses::comm::all_gather_host_checked(communicator, &reports, "float parameters")?;
    let dtypes = gradient_dtypes(&gathered, reports.len()).map_err(|reason| CommError::InvalidArgument { op, reason })?;
    let sizes: Vec<_> = local.iter().zip(&dtypes).map(|(l, dtype)| (l.len() * dtype.map_or(0, HostDType::size), *dtype)).collect();
    let present_anywhere: Vec<bool> = dtypes.iter().map(Option::is_some).collect();

    let mut reduced: Vec<Option<Tensor<B::InnerBackend, 1>>> = vec![None; local.len()];
    for bucket in plan_buckets(&sizes, &present_anywhere, bucket_bytes) {
        let dtype = burn_dtype(dtypes[bucket[0]].expect("a bucket holds gradients present on some rank"));
        let members: Vec<_> = bucket.iter().map(|&i| local[i].take_or_zeros(dtype)).collect();
        let flat = float_primitive(concatenated(members, 0));
        let flat = float_tensor::<B::InnerBackend, 1>(communicator.all_reduce(flat, ReduceOp::Sum)?);
        let mut offset = 0;
        for &i in &bucket {
            let len = local[i].len();
            reduced[i] = Some(flat.clone().narrow(0, offset, len));
            offset += len;
        }
    }

    module.visit(&mut RegisterGradients::<B> { grads: &mut grads, reduced: reduced.into_iter() });
    Ok(grads)
}

/// `tensors` joined along `dim`, one alone returned as it is: burn's `cat` copies even one,
/// which for a bucket of one gradient (every parameter past the bucket size: an 8B model's
/// head and embedding, its MLP matrices) is a second whole copy of it, and a pass over its bytes.
pub(crate) fn concatenated<B: Backend, const D: usize>(mut tensors: Vec<Tensor<B, D>>, dim: usize) -> Tensor<B, D> {
    if tensors.len() == 1 { tensors.pop().expect("one tensor") } else { Tensor::cat(tensors, dim) }
}

/// One float parameter's gradient on this rank, flattened, or the parameter itself (for the
/// dtype and device of zeros) when this rank has none.
pub(crate) struct LocalGradient<B: TrainBackend> {
    pub(crate) grad: Option<Tensor<B::InnerBackend, 1>>,
    pub(crate) parameter: Tensor<B::InnerBackend, 1>,
    /// The parameter's elements: `parameter`'s, but where that is a placeholder (ZeRO-3), the
    /// whole one's.
    pub(crate) len: usize,
    /// Whether AdamW's weight decay applies to it (`ulysses_core::host_adamw::decays`).
    pub(crate) decays: bool,
}

impl<B: TrainBackend> LocalGradient<B> {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn dtype(&self) -> DType {
        self.parameter.dtype()
    }

    /// The gradient, or where this rank has none, zeros of `dtype` (the dtype the other ranks'
    /// gradients are summed in).
    pub(crate) fn take_or_zeros(&mut self, dtype: DType) -> Tensor<B::InnerBackend, 1> {
        self.grad.take().unwrap_or_else(|| Tensor::zeros([self.len], (&self.parameter.device(), dtype)))
    }
}

/// Takes every float parameter's gradient out of `grads`, flattened, in the module's visit
/// order.
pub(crate) struct TakeGradients<'a, B: TrainBackend> {
    pub(crate) grads: &'a mut GradientsParams,
    pub(crate) local: Vec<LocalGradient<B>>,
}

impl<B: TrainBackend> ModuleVisitor<B> for TakeGradients<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let grad = self.grads.remove::<B::InnerBackend, D>(param.id).map(|g| g.flatten(0, D - 1));
        let parameter = param.val().inner().flatten(0, D - 1);
        self.local.push(LocalGradient { grad, len: parameter.dims()[0], parameter, decays: ulysses_core::host_adamw::decays(D) });
    }
}

struct RegisterGradients<'a, B: TrainBackend> {
    grads: &'a mut GradientsParams,
    reduced: std::vec::IntoIter<Option<Tensor<B::InnerBackend, 1>>>,
}

impl<B: TrainBackend> ModuleVisitor<B> for RegisterGradients<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(Some(flat)) = self.reduced.next() {
            self.grads.register::<B::InnerBackend, D>(param.id, flat.reshape(param.val().shape()));
        }
    }
}

/// Gradients summed parameter by parameter (over a step's micro-batches; over a checkpointed
/// step's pieces: a head tile's, every tile's of a layer); in f32 where asked (a half-precision
/// compute copy's, whose bf16 sums keep 8 bits of each), each parameter's gradient cast as it is
/// added: no piece's gradients are ever whole in f32 beside the sum (4 bytes a parameter kept,
/// not 8).
pub(crate) struct GradientSums {
    sums: GradientsParams,
    in_f32: bool,
}

impl GradientSums {
    pub(crate) fn new(in_f32: bool) -> Self {
        Self { sums: GradientsParams::new(), in_f32 }
    }

    /// Adds `grads` (of `module`'s parameters) to the sums.
    pub(crate) fn add<B: AutodiffBackend, M: Module<B>>(&mut self, module: &M, grads: GradientsParams) {
        struct Add<'a> {
            sums: &'a mut GradientsParams,
            grads: GradientsParams,
            in_f32: bool,
        }
        impl<B: AutodiffBackend> ModuleVisitor<B> for Add<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) else { return };
                // Half dtypes alone: an f64 model's gradients keep their bits.
                let grad = if self.in_f32 && matches!(grad.dtype(), DType::F16 | DType::BF16) { grad.cast(FloatDType::F32) } else { grad };
                let sum = match self.sums.remove::<B::InnerBackend, D>(param.id) {
                    Some(sum) => sum + grad,
                    None => grad,
                };
                self.sums.register(param.id, sum);
            }
        }
        module.visit(&mut Add { sums: &mut self.sums, grads, in_f32: self.in_f32 });
    }

    pub(crate) fn into_grads(self) -> GradientsParams {
        self.sums
    }

    /// The sums so far, leaving none: the next [`add`](Self::add) starts anew.
    pub(crate) fn take(&mut self) -> GradientsParams {
        std::mem::replace(&mut self.sums, GradientsParams::new())
    }
}

/// The L2 norm of all of `grads` together (every parameter's gradient as one vector), in f64
/// ([`sum_of_squares`]). After [`all_reduce_gradients`] it is the norm of the whole group's
/// gradient on every rank, but a GPU's sum may differ in its last bits from rank to rank: ranks
/// that act on it use [`agreed_gradient_norm`].
pub fn gradient_norm<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M, grads: &GradientsParams) -> f64 {
    struct Flattened<'a, B: AutodiffBackend> {
        grads: &'a GradientsParams,
        parts: Vec<Tensor<B::InnerBackend, 1>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Flattened<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(grad) = self.grads.get::<B::InnerBackend, D>(param.id) {
                self.parts.push(grad.flatten(0, D - 1));
            }
        }
    }
    let mut flattened = Flattened::<B> { grads, parts: Vec::new() };
    module.visit(&mut flattened);
    sum_of_squares(&flattened.parts).sqrt()
}

/// The sum of the squares of every element of `parts`, in f64: each part's squares summed on
/// the device in f32, every part's sum read back at once and added in f64. A part whose f32 sum
/// overflows (an element past 1.8e19, a diverging run: clipping by an infinite norm would zero
/// the gradient and the step go on as if nothing happened) is summed again, each element
/// divided by the largest magnitude first, the sum scaled back in f64 (two more reads, for that
/// part alone).
pub(crate) fn sum_of_squares<B: Backend>(parts: &[Tensor<B, 1>]) -> f64 {
    if parts.is_empty() {
        return 0.0;
    }
    let squares = parts.iter().map(|part| part.clone().cast(DType::F32).powi_scalar(2).sum()).collect();
    let sums = concatenated(squares, 0).into_data().to_vec::<f32>().expect("f32 sums");
    sums.iter().zip(parts).map(|(&sum, part)| if sum == f32::INFINITY { scaled_sum_of_squares(part.clone()) } else { f64::from(sum) }).sum()
}

/// [`sum_of_squares`] of one part whose f32 sum overflowed.
fn scaled_sum_of_squares<B: Backend>(part: Tensor<B, 1>) -> f64 {
    let read = |tensor: Tensor<B, 1>| tensor.into_data().convert::<f64>().to_vec::<f64>().expect("one f64")[0];
    let part = part.cast(DType::F32);
    let largest = read(part.clone().abs().max());
    if !(largest > 0.0 && largest.is_finite()) {
        // Zeros, or an element that is itself infinite or NaN: the NaN check's.
        return largest * largest;
    }
    largest * largest * read(part.div_scalar(largest).powi_scalar(2).sum())
}

/// Scales every gradient by `max_norm / (norm + 1e-6)` where their global norm exceeds
/// `max_norm`, as `torch.nn.utils.clip_grad_norm_` (and Hugging Face's Trainer, whose default
/// `max_grad_norm` is 1.0) do; returns the gradients and their norm before clipping. For one
/// process alone: the ranks of a group must clip with the same norm, [`agreed_gradient_norm`]'s,
/// through [`clip_with_norm`] (as [`apply_step`](crate::apply_step) does).
/// Refused where `max_norm` is not above 0 ([`check_max_grad_norm`]).
pub fn clip_gradient_norm<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M, grads: GradientsParams, max_norm: f64) -> Result<(GradientsParams, f64), UlyssesError> {
    check_max_grad_norm(max_norm)?;
    let norm = gradient_norm(module, &grads);
    Ok((clip_with_norm(module, grads, norm, max_norm)?, norm))
}

/// Refuses a clipping limit that is not above 0: below 0 the factor turns the gradient around,
/// 0 zeroes it, NaN is no limit (Hugging Face's Trainer reads 0 as no clipping: `None` here).
pub fn check_max_grad_norm(max_norm: f64) -> Result<(), UlyssesError> {
    if max_norm > 0.0 {
        return Ok(());
    }
    Err(UlyssesError::InvalidConfig(format!(
        "max_grad_norm is {max_norm}; clipping needs a limit above 0 (below 0 it turns the gradient around, 0 zeroes it): give one, or None to clip nothing"
    )))
}

/// Scales every gradient by `max_norm / (norm + 1e-6)` when `norm` (their global norm,
/// measured by the caller) exceeds `max_norm`; leaves them as they are otherwise. Refused where
/// `max_norm` is not above 0 ([`check_max_grad_norm`]).
pub fn clip_with_norm<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M, mut grads: GradientsParams, norm: f64, max_norm: f64) -> Result<GradientsParams, UlyssesError> {
    check_max_grad_norm(max_norm)?;
    struct Scale<'a> {
        grads: &'a mut GradientsParams,
        factor: f64,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                self.grads.register::<B::InnerBackend, D>(param.id, grad * self.factor);
            }
        }
    }
    if let Some(factor) = clipping_factor(norm, max_norm) {
        module.visit(&mut Scale { grads: &mut grads, factor });
    }
    Ok(grads)
}

/// The factor that scales a gradient of global norm `norm` to `max_norm`,
/// `max_norm / (norm + 1e-6)`, where it exceeds it (`None`: it stays as it is).
pub(crate) fn clipping_factor(norm: f64, max_norm: f64) -> Option<f64> {
    Some(max_norm / (norm + 1e-6)).filter(|&factor| factor < 1.0)
}

/// The gradient norm every rank of `communicator` clips with: rank 0's `local_norm`, one host
/// collective of one value per rank. After [`all_reduce_gradients`] every rank holds the same
/// gradient bits, but a GPU sums their squares in an order that varies from run to run (burn's
/// CubeCL sum adds partial sums with atomics, and autotunes its kernel per process), so the
/// ranks' norms can differ in their last bits, and a clipping factor one ulp apart is enough
/// for their parameters to part ways (SP=2 as threads on an H100, 2026-11-27).
pub fn agreed_gradient_norm<G: Backend>(local_norm: f64, communicator: &dyn Communicator<G>) -> Result<f64, UlyssesError> {
    let gathered = burn_ulysses::comm::all_gather_host_checked(communicator, &[local_norm.to_bits()], "gradient norms")?;
    Ok(f64::from_bits(gathered[0][0]))
}

/// 0 (`[1]`, f32, on the device) where every value of `tensor` is finite, NaN where one is not:
/// each value times 0, summed (a NaN or an infinity times 0 is NaN, which survives the sum). A
/// plain sum of finite values can overflow to an infinity (a diverging gradient's values near
/// f32's largest), which would read as a NaN in the gradient.
pub(crate) fn non_finite_mark<Bk: Backend, const D: usize>(tensor: Tensor<Bk, D>) -> Tensor<Bk, 1> {
    (tensor.cast(DType::F32) * 0.0).sum()
}

/// `loss`'s value (`[1]`, on the device) and the path (`blocks.0.attention.wq.weight`) of the
/// first parameter whose gradient holds a NaN or an infinity, or `None`, in one read: what a
/// training step needs from the device before its gradients are summed. Each gradient is
/// marked on the device ([`non_finite_mark`]) and the marks come back with the loss, one
/// small transfer.
pub fn read_loss_and_first_non_finite_gradient<B: TrainBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &GradientsParams,
    loss: Tensor<B::InnerBackend, 1>,
) -> (f64, Option<String>) {
    let (names, sums) = gradient_sums::<B, M>(module, grads);
    let values: Vec<f32> =
        Tensor::cat([vec![loss.cast(DType::F32)], sums].concat(), 0).into_data().convert::<f32>().to_vec().expect("f32 loss and sums");
    let first_non_finite = values[1..].iter().position(|v| !v.is_finite()).map(|i| names[i].clone());
    (values[0] as f64, first_non_finite)
}

/// Each gradient's path and its [`non_finite_mark`] (on the device), in the module's order.
fn gradient_sums<B: TrainBackend, M: AutodiffModule<B>>(module: &M, grads: &GradientsParams) -> (Vec<String>, Vec<Tensor<B::InnerBackend, 1>>) {
    struct Sums<'a, B: TrainBackend> {
        grads: &'a GradientsParams,
        path: Vec<String>,
        names: Vec<String>,
        sums: Vec<Tensor<B::InnerBackend, 1>>,
    }
    impl<B: TrainBackend> ModuleVisitor<B> for Sums<'_, B> {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(grad) = self.grads.get::<B::InnerBackend, D>(param.id) {
                self.names.push(self.path.join("."));
                self.sums.push(non_finite_mark(grad));
            }
        }
    }
    let mut sums = Sums::<B> { grads, path: Vec::new(), names: Vec::new(), sums: Vec::new() };
    module.visit(&mut sums);
    (sums.names, sums.sums)
}

#[cfg(test)]
mod tests {
    use burn::{backend::NdArray, tensor::Tensor};

    use super::{GradientSums, non_finite_mark};

    /// Finite values whose sum overflows f32 are finite; a NaN or an infinity is not.
    #[test]
    fn a_gradient_is_non_finite_by_its_values_not_its_sum() {
        let mark = |values: Vec<f32>| non_finite_mark(Tensor::<NdArray, 1>::from_floats(values.as_slice(), &Default::default())).into_scalar();
        let near_the_largest = vec![3e38f32, 3e38, -1.0];
        assert!(Tensor::<NdArray, 1>::from_floats(near_the_largest.as_slice(), &Default::default()).sum().into_scalar().is_infinite(), "the plain sum overflows");
        assert_eq!(mark(near_the_largest), 0.0);
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            assert!(mark(vec![1.0, bad, 2.0]).is_nan(), "{bad} marked");
        }
    }

    /// Sums "in f32" (for half-precision gradients) leave an f64 model's in f64: they were
    /// rounded to f32, losing their low bits.
    #[test]
    fn sums_in_f32_keep_an_f64_models_gradients_in_f64() {
        use burn::{
            backend::Autodiff,
            module::Param,
            nn::Linear,
            tensor::{DType, FloatDType, TensorData},
        };
        type B = Autodiff<NdArray<f64>>;
        let device = Default::default();
        // Cast, and the low bits added in f64: data is taken in the device's default dtype, f32
        // once another test of this process used the device.
        let f64_tensor = |values: Vec<f64>, shape: [usize; 2]| Tensor::<B, 2>::from_data(TensorData::new(values, shape), &device).cast(FloatDType::F64);
        let linear = Linear { weight: Param::from_tensor(f64_tensor(vec![0.5, -0.25], [2, 1])), bias: None };
        let input = f64_tensor(vec![1.0, 3.0], [1, 2]).add_scalar(1e-12);
        let grads = burn::optim::GradientsParams::from_grads(linear.forward(input).sum().backward(), &linear);
        let mut sums = GradientSums::new(true);
        sums.add(&linear, grads);
        let weight = sums.into_grads().get::<NdArray<f64>, 2>(linear.weight.id).unwrap();
        assert_eq!(weight.dtype(), DType::F64);
        assert_eq!(weight.into_data().to_vec::<f64>().unwrap()[0], 1.0 + 1e-12);
    }
}
