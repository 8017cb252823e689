//! Shared helpers of the integration tests and benches (the `ulysses-suite` library):
//! deterministic parameters, gradient collection, sharding and comparison.

pub mod block;
pub mod rank_memory;

use std::{
    sync::mpsc,
    time::{Duration, Instant},
};

use ulysses_trainer::{corpus::splitmix64, train::StepData};

use burn::{
    module::{Module, ModuleMapper, ModuleVisitor, Param},
    optim::GradientsParams,
    tensor::{
        BasicOps, DType, Tensor, TensorData,
        backend::{AutodiffBackend, Backend},
    },
};

/// Sets every float parameter of `module` to values that depend only on `seed`, the
/// parameter's position in the module and its shape. Two modules of the same config on
/// different backends (or ranks) get identical values, and each gets fresh autodiff leaves,
/// so in-process ranks never share an autodiff graph.
pub fn deterministic_params<B: Backend, M: Module<B>>(module: M, seed: u64) -> M {
    struct Mapper<'a, B: Backend> {
        seed: u64,
        index: u64,
        device: &'a B::Device,
    }
    impl<B: Backend> ModuleMapper<B> for Mapper<'_, B> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            let shape = tensor.shape();
            // Norm weights (1-D) sit around one, matrices around zero with a fan-in scale.
            let (center, scale) = match D {
                1 => (1.0, 0.1),
                _ => (0.0, 1.0 / (shape.dims::<D>()[D - 1] as f64).sqrt()),
            };
            let stream = self.seed ^ (self.index << 32);
            let values: Vec<f32> = (0..shape.num_elements() as u64)
                .map(|i| (center + scale * uniform(stream, i)) as f32)
                .collect();
            self.index += 1;
            let fresh = Tensor::from_data(TensorData::new(values, shape), self.device).require_grad();
            Param::from_mapped_value(id, fresh, mapper)
        }
    }
    let device = module.devices()[0].clone();
    module.map(&mut Mapper::<B> { seed, index: 0, device: &device })
}

/// A uniform value in [-1, 1) from (stream, index).
pub fn uniform(stream: u64, index: u64) -> f64 {
    let z = splitmix64(stream.wrapping_add(index.wrapping_mul(0x9E37_79B9_7F4A_7C15)));
    (z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
}

/// A tensor of deterministic uniform values in [-1, 1).
pub fn uniform_tensor<B: Backend, const D: usize>(
    shape: [usize; D],
    stream: u64,
    device: &B::Device,
) -> Tensor<B, D> {
    let count: usize = shape.iter().product();
    let values: Vec<f32> = (0..count as u64).map(|i| uniform(stream, i) as f32).collect();
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// Reads one float parameter as a flat vector.
trait ReadParam<B: Backend> {
    fn read<const D: usize>(&self, name: &str, param: &Param<Tensor<B, D>>) -> Vec<f32>;
}

/// Every float parameter of `module`, read by `reader`, with its path in the module.
fn named_params<B: Backend, M: Module<B>, R: ReadParam<B>>(module: &M, reader: &R) -> Vec<(String, Vec<f32>)> {
    struct Visitor<'a, R> {
        reader: &'a R,
        path: Vec<String>,
        out: Vec<(String, Vec<f32>)>,
    }
    impl<B: Backend, R: ReadParam<B>> ModuleVisitor<B> for Visitor<'_, R> {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let name = self.path.join(".");
            let values = self.reader.read(&name, param);
            self.out.push((name, values));
        }
    }
    let mut visitor = Visitor { reader, path: Vec::new(), out: Vec::new() };
    module.visit(&mut visitor);
    visitor.out
}

/// Every float parameter's values, flattened, with its path in the module.
pub fn parameter_values<B: Backend, M: Module<B>>(module: &M) -> Vec<(String, Vec<f32>)> {
    struct Values;
    impl<B: Backend> ReadParam<B> for Values {
        fn read<const D: usize>(&self, _name: &str, param: &Param<Tensor<B, D>>) -> Vec<f32> {
            values(param.val())
        }
    }
    named_params(module, &Values)
}

/// Every float parameter's gradient, flattened, with its path in the module.
pub fn parameter_grads<B: AutodiffBackend, M: Module<B>>(
    module: &M,
    grads: &B::Gradients,
) -> Vec<(String, Vec<f32>)> {
    struct Grads<'a, B: AutodiffBackend>(&'a B::Gradients);
    impl<B: AutodiffBackend> ReadParam<B> for Grads<'_, B> {
        fn read<const D: usize>(&self, name: &str, param: &Param<Tensor<B, D>>) -> Vec<f32> {
            let grad = param.val().grad(self.0);
            values(grad.unwrap_or_else(|| panic!("parameter {name} has no gradient")))
        }
    }
    named_params(module, &Grads::<B>(grads))
}

/// Every float parameter's gradient in `grads` (as an optimizer receives them), flattened,
/// with its path in the module.
pub fn gradient_params_values<B: AutodiffBackend, M: Module<B>>(module: &M, grads: &GradientsParams) -> Vec<(String, Vec<f32>)> {
    struct Grads<'a>(&'a GradientsParams);
    impl<B: AutodiffBackend> ReadParam<B> for Grads<'_> {
        fn read<const D: usize>(&self, name: &str, param: &Param<Tensor<B, D>>) -> Vec<f32> {
            let grad = self.0.get::<B::InnerBackend, D>(param.id);
            values(grad.unwrap_or_else(|| panic!("parameter {name} has no gradient")))
        }
    }
    named_params(module, &Grads(grads))
}

/// The dtype of every float parameter's gradient in `grads`, in module order.
pub fn gradient_params_dtypes<B: AutodiffBackend, M: Module<B>>(module: &M, grads: &GradientsParams) -> Vec<DType> {
    struct Dtypes<'a, B: AutodiffBackend>(&'a GradientsParams, Vec<DType>, std::marker::PhantomData<B>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Dtypes<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let grad = self.0.get::<B::InnerBackend, D>(param.id).expect("every parameter has a gradient");
            self.1.push(grad.dtype());
        }
    }
    let mut visitor = Dtypes::<B>(grads, Vec::new(), std::marker::PhantomData);
    module.visit(&mut visitor);
    visitor.1
}

/// A tensor's values, flattened, as f32.
pub fn values<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Vec<f32> {
    tensor.into_data().convert::<f32>().to_vec().unwrap()
}

/// Rank `rank`'s contiguous shard of `tensor` along `dim`, out of `parts`.
pub fn shard<B: Backend, const D: usize, K: BasicOps<B>>(
    tensor: Tensor<B, D, K>,
    dim: usize,
    rank: usize,
    parts: usize,
) -> Tensor<B, D, K> {
    let len = tensor.dims()[dim] / parts;
    tensor.narrow(dim, rank * len, len)
}

/// Largest absolute difference, infinite when a value is NaN or infinite; panics when the
/// lengths differ.
pub use burn_ulysses::compare::{max_abs_diff, worst};

/// Two runs' named parameters ([`parameter_values`]) side by side, `(name, a's, b's)`; panics
/// unless both hold the same parameters in the same order, where a zip would stop at the
/// shorter or compare one parameter with another.
pub fn paired_parameters<'a>(a: &'a [(String, Vec<f32>)], b: &'a [(String, Vec<f32>)]) -> impl Iterator<Item = (&'a str, &'a [f32], &'a [f32])> {
    let names = |run: &'a [(String, Vec<f32>)]| run.iter().map(|(name, _)| name.as_str()).collect::<Vec<_>>();
    assert_eq!(names(a), names(b), "the runs hold different parameters");
    a.iter().zip(b).map(|((name, a), (_, b))| (name.as_str(), a.as_slice(), b.as_slice()))
}

/// Whether `a` and `b` hold the same values bit for bit; panics when their lengths differ.
pub fn bit_identical(a: &[f32], b: &[f32]) -> bool {
    assert_eq!(a.len(), b.len(), "compared values have different lengths");
    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The largest gap between two runs' per-step figures (losses), infinite where one is not
/// finite; panics when the runs took different numbers of steps.
pub fn largest_gap(a: &[f64], b: &[f64]) -> f32 {
    assert_eq!(a.len(), b.len(), "the runs took different numbers of steps");
    worst(a.iter().zip(b).map(|(x, y)| (x - y).abs() as f32))
}

/// Element-wise sum of equally long vectors.
pub fn sum_vectors<'a>(vectors: impl IntoIterator<Item = &'a Vec<f32>>) -> Vec<f32> {
    let mut iter = vectors.into_iter();
    let mut sum = iter.next().expect("nothing to sum").clone();
    for v in iter {
        sum.iter_mut().zip(v).for_each(|(s, x)| *s += x);
    }
    sum
}

/// The most bytes held before each piece's backward of a checkpointed step
/// (`checkpointed_backward`'s probe), in the order the pieces ran, a piece's tiles as one.
#[derive(Debug, Default)]
pub struct HeldPerPiece(pub Vec<(ulysses_training::Piece, u64)>);

impl HeldPerPiece {
    /// Records `held` bytes before the backward of `piece`: a probe of the same piece as the
    /// last one (its next tile) keeps the larger figure.
    pub fn record(&mut self, piece: ulysses_training::Piece, held: u64) {
        match self.0.last_mut() {
            Some((last, most)) if *last == piece => *most = (*most).max(held),
            _ => self.0.push((piece, held)),
        }
    }

    /// The most held before any piece's backward.
    pub fn most(&self) -> u64 {
        self.0.iter().map(|&(_, held)| held).max().unwrap_or(0)
    }
}

/// The project's bisection over lengths (the memory bench's `--longest-under`).
pub use ulysses_core::host_memory::longest_fitting;

/// Runs `work` on another thread and panics if it has not finished within `limit`, at least
/// five minutes, so a test that would hang fails instead. A hang detector, never a speed test:
/// a test beside its binary's others on a loaded 2-core machine takes 2 to 2.5 times what it
/// takes alone (runs of 45 s alone took 114 s), and `limit` is what it took alone, doubled.
pub fn with_deadline<T: Send + 'static>(limit: Duration, work: impl FnOnce() -> T + Send + 'static) -> T {
    let limit = limit.max(Duration::from_secs(300));
    let (sender, receiver) = mpsc::channel();
    let started = Instant::now();
    std::thread::spawn(move || {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
        let _ = sender.send(result);
    });
    match receiver.recv_timeout(limit) {
        Ok(Ok(value)) => value,
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => panic!("test did not finish within {limit:?} (started {:?} ago): it hangs", started.elapsed()),
    }
}

/// Four sequences per step with varied lengths, so shorter ones are padded. Step 0's
/// longest sequence has 13 tokens: padded to 16 for SP=4, rank 3's shard (positions 12..16)
/// holds only ignored labels.
pub struct VariedLengths {
    pub vocab: usize,
}

impl StepData for VariedLengths {
    fn train_batch(&self, step: usize) -> Vec<Vec<i64>> {
        let lengths: [usize; 4] = match step {
            0 => [13, 9, 13, 5],
            1 => [32, 29, 17, 20],
            2 => [24, 24, 24, 24],
            3 => [7, 31, 12, 3],
            _ => [16, 15, 2, 30],
        };
        lengths
            .iter()
            .enumerate()
            .map(|(i, &len)| (0..len).map(|t| ((step * 7 + i * 5 + t * t + 3 * t) % self.vocab) as i64).collect())
            .collect()
    }

    fn eval_batch(&self) -> Option<Vec<Vec<i64>>> {
        Some(self.train_batch(1))
    }
}
