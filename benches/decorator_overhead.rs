//! What the `UlyssesBackend` decorator costs without a group: the same training steps (forward,
//! loss, backward) on the plain autodiff backend and on `UlyssesBackend` over it, interleaved
//! in one process, from the same weights. The model is a stack of Llama MLP blocks (RMS norm,
//! SwiGLU, residual) and no attention, so both run the same kernels and the difference is the
//! decorator's own work per op: delegation, and the attention check it does not reach here. The
//! two must give losses and gradients equal to the bit (the decorator delegates every op,
//! forward and backward): the warm-up step's loss and first gradient, and the last timed step's
//! loss (autotuning may change a kernel in between, for both alike); the bench refuses to print
//! a ratio otherwise.
//!
//! cargo bench --bench decorator_overhead [--features cuda] -- [--shapes 256x2048,1024x8192]
//!     [--layers 4] [--steps 20] [--rounds 7]
//!
//! `--shapes DxT`: d_model D (the MLP 4·D wide) over T tokens; small shapes are launch-bound,
//! where a per-op cost would show most. Per shape: `--rounds` rounds, each timing `--steps`
//! steps of one backend and then the other (their order alternates between rounds), after one
//! warm-up step each; the table prints the median step of each and the ratio decorated /
//! plain (goal: at most 1.02). On CUDA with `--features cuda`, else on NdArray (the CPU).

use std::time::{Duration, Instant};

use burn::tensor::{ElementConversion, Tensor, TensorData, activation::silu, backend::AutodiffBackend};
use burn_ulysses::UlyssesBackend;
use ulysses_suite::uniform_tensor;

#[cfg(feature = "cuda")]
type Plain = burn_autodiff::Autodiff<burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u32>>;
#[cfg(not(feature = "cuda"))]
type Plain = burn_autodiff::Autodiff<burn::backend::NdArray<f32>>;
type Decorated = UlyssesBackend<Plain>;

struct Args {
    shapes: Vec<(usize, usize)>,
    layers: usize,
    steps: usize,
    rounds: usize,
}

fn args() -> Args {
    let argv: Vec<String> = std::env::args().collect();
    let value = |name: &str| argv.iter().position(|a| a == name).and_then(|i| argv.get(i + 1)).cloned();
    let number = |name: &str, default: usize| value(name).map_or(default, |v| v.parse().unwrap_or_else(|_| panic!("{name} takes a number, got {v}")));
    let shape = |text: &str| {
        let (d, t) = text.split_once('x').unwrap_or_else(|| panic!("--shapes takes DxT pairs (d_model x tokens), got {text}"));
        let parse = |n: &str| n.parse::<usize>().unwrap_or_else(|_| panic!("--shapes takes DxT pairs of numbers, got {text}"));
        (parse(d), parse(t))
    };
    Args {
        shapes: value("--shapes").map_or(vec![(256, 2048), (1024, 8192)], |list| list.split(',').map(shape).collect()),
        layers: number("--layers", 4).max(1),
        steps: number("--steps", 20).max(1),
        rounds: number("--rounds", 7).max(1),
    }
}

/// One MLP block's parameters: the norm's gain, gate and up projections, down projection.
struct Block<B: AutodiffBackend> {
    gain: Tensor<B, 1>,
    gate: Tensor<B, 2>,
    up: Tensor<B, 2>,
    down: Tensor<B, 2>,
}

struct Model<B: AutodiffBackend> {
    blocks: Vec<Block<B>>,
    input: Tensor<B, 2>,
}

impl<B: AutodiffBackend> Model<B> {
    fn new(d_model: usize, tokens: usize, layers: usize, device: &B::Device) -> Self {
        let hidden = 4 * d_model;
        // The suite's deterministic values: the same weights for both backends.
        let matrix = |rows: usize, cols: usize, stream: u64| (uniform_tensor::<B, 2>([rows, cols], stream, device) * (1.0 / rows as f32).sqrt()).require_grad();
        let blocks = (0..layers as u64)
            .map(|layer| Block {
                gain: Tensor::from_data(TensorData::new(vec![1.0f32; d_model], [d_model]), device).require_grad(),
                gate: matrix(d_model, hidden, 3 * layer + 1),
                up: matrix(d_model, hidden, 3 * layer + 2),
                down: matrix(hidden, d_model, 3 * layer + 3),
            })
            .collect();
        let input = uniform_tensor([tokens, d_model], 999, device);
        Model { blocks, input }
    }

    /// Forward, loss (the mean square of the output), backward; waits for the device. Returns
    /// the loss.
    fn step(&self, device: &B::Device) -> f32 {
        self.step_reading(device, false).0
    }

    /// [`Self::step`], and with `read_gradient` the first block's gate gradient as its bits.
    fn step_reading(&self, device: &B::Device, read_gradient: bool) -> (f32, Vec<u32>) {
        let mut x = self.input.clone();
        for block in &self.blocks {
            let norm = x.clone() * (x.clone().powi_scalar(2).mean_dim(1) + 1e-6).sqrt().recip() * block.gain.clone().unsqueeze();
            let mlp = (silu(norm.clone().matmul(block.gate.clone())) * norm.matmul(block.up.clone())).matmul(block.down.clone());
            x = x + mlp;
        }
        let loss = x.powi_scalar(2).mean();
        let value = loss.clone().into_scalar().elem::<f32>();
        let gradients = loss.backward();
        for block in &self.blocks {
            assert!(block.down.grad(&gradients).is_some(), "a parameter has no gradient");
        }
        let gradient = match read_gradient {
            true => {
                let gate = self.blocks[0].gate.grad(&gradients).expect("the gate has a gradient");
                gate.into_data().to_vec::<f32>().expect("f32 gradient").iter().map(|g| g.to_bits()).collect()
            }
            false => Vec::new(),
        };
        B::sync(device).expect("the device failed");
        (value, gradient)
    }
}

/// The median of `steps` timed steps, and the last one's loss.
fn timed<B: AutodiffBackend>(model: &Model<B>, steps: usize, device: &B::Device) -> (Duration, f32) {
    let mut times = Vec::with_capacity(steps);
    let mut loss = f32::NAN;
    for _ in 0..steps {
        let started = Instant::now();
        loss = model.step(device);
        times.push(started.elapsed());
    }
    times.sort();
    (times[times.len() / 2], loss)
}

fn median(mut durations: Vec<Duration>) -> Duration {
    durations.sort();
    durations[durations.len() / 2]
}

fn main() {
    let args = args();
    let device = Default::default();
    println!(
        "decorator overhead: {} MLP blocks (RMS norm, SwiGLU 4·d wide, residual), forward + backward, f32, {} (plain) against {}; median of {} rounds of {} steps",
        args.layers,
        std::any::type_name::<Plain>(),
        "UlyssesBackend<plain> without a group",
        args.rounds,
        args.steps,
    );
    println!("{:>8} {:>8} | {:>14} {:>14} | {:>8}", "d_model", "tokens", "plain ms/step", "decorated", "ratio");
    for &(d_model, tokens) in &args.shapes {
        let plain = Model::<Plain>::new(d_model, tokens, args.layers, &device);
        let decorated = Model::<Decorated>::new(d_model, tokens, args.layers, &device);
        // Warm-up: kernels compiled, autotuned and allocated for both before any timing.
        let ((plain_loss, plain_gradient), (decorated_loss, decorated_gradient)) = (plain.step_reading(&device, true), decorated.step_reading(&device, true));
        if !plain_loss.is_finite() || plain_loss.to_bits() != decorated_loss.to_bits() || plain_gradient != decorated_gradient {
            panic!(
                "{d_model}x{tokens}: the losses (plain {plain_loss}, decorated {decorated_loss}) or the gate gradients differ: the decorator changed the computation, no ratio to print"
            );
        }
        let (mut plain_times, mut decorated_times) = (Vec::new(), Vec::new());
        let (mut plain_last, mut decorated_last) = (f32::NAN, f32::NAN);
        for round in 0..args.rounds {
            let mut time_plain = || {
                let (time, loss) = timed(&plain, args.steps, &device);
                plain_times.push(time);
                plain_last = loss;
            };
            let mut time_decorated = || {
                let (time, loss) = timed(&decorated, args.steps, &device);
                decorated_times.push(time);
                decorated_last = loss;
            };
            if round % 2 == 0 {
                time_plain();
                time_decorated();
            } else {
                time_decorated();
                time_plain();
            }
        }
        if !plain_last.is_finite() || plain_last.to_bits() != decorated_last.to_bits() {
            panic!("{d_model}x{tokens}: the last timed losses differ (plain {plain_last}, decorated {decorated_last}): no ratio to print");
        }
        let (plain_step, decorated_step) = (median(plain_times), median(decorated_times));
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "{d_model:>8} {tokens:>8} | {:>14.3} {:>14.3} | {:>8.4}",
            ms(plain_step),
            ms(decorated_step),
            decorated_step.as_secs_f64() / plain_step.as_secs_f64()
        );
    }
}
