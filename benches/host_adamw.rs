//! AdamW on the host (`ulysses_core::host_adamw`, the optimizer `--offload-optimizer` runs)
//! against burn's own AdamW update (burn-optim's `SimpleOptimizer` on NdArray, the same f32
//! operations) on the same parameters and gradients: parameters updated per second, the
//! host's on one thread and on every core, and the largest difference after the timed steps
//! (0: bit for bit, as `host_adamw_tests` asserts); then clipping's squared norm of the same
//! gradients, one running f64 sum against `HostAdamW::sum_of_squares`; then the cast of master
//! weights to bf16 for an upload, a copy and `convert_dtype` against `cast_master_part`.
//!
//!     cargo bench -p ulysses-suite --bench host_adamw [-- --params 16777216 --steps 5]

use std::{num::NonZeroUsize, time::Instant};

use burn::{
    backend::NdArray,
    optim::{AdamWConfig, SimpleOptimizer},
    tensor::{Tensor, TensorData},
};
use ulysses_core::host_adamw::{AdamWMoments, HostAdamW, HostAdamWConfig};

type B = NdArray<f32>;

/// Seeded values in [-1, 1), as the kernel tests draw them.
fn values(count: usize, seed: u64) -> Vec<f32> {
    ulysses_kernels::testing::uniform_values(count, seed).into_iter().map(|v| v as f32).collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str, default: usize| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)?.parse().ok()).unwrap_or(default);
    let (len, steps) = (flag("--params", 1 << 24), flag("--steps", 5));
    let config = HostAdamWConfig { weight_decay: 0.01, ..HostAdamWConfig::default() };
    let start = values(len, 1);
    let grads: Vec<Vec<f32>> = (0..steps as u64).map(|s| values(len, 10 + s)).collect();
    let learning_rate = 1e-4;

    // burn's update, one step untimed first (its moments' allocation).
    let burn_adamw = AdamWConfig::new().with_weight_decay(config.weight_decay).build();
    let device = Default::default();
    let tensor = |v: &[f32]| Tensor::<B, 1>::from_data(TensorData::new(v.to_vec(), [len]), &device);
    let (mut theirs, mut state) = burn_adamw.step(learning_rate, tensor(&start), tensor(&grads[0]), None);
    let timed: Vec<Tensor<B, 1>> = grads.iter().map(|g| tensor(g)).collect();
    let began = Instant::now();
    for grad in timed {
        let (updated, next) = burn_adamw.step(learning_rate, theirs, grad, state);
        (theirs, state) = (updated, next);
    }
    let burn_seconds = began.elapsed().as_secs_f64() / steps as f64;
    let want = theirs.into_data().to_vec::<f32>().unwrap();

    let cores = std::thread::available_parallelism().map_or(1, NonZeroUsize::get);
    println!("AdamW over {len} f32 parameters, the mean of {steps} timed steps after an untimed one, {cores} core(s)");
    println!("{:<36} {:>12} {:>16} {:>10} {:>14}", "update", "s / step", "parameters / s", "vs burn", "max |Δ| vs burn");
    println!("{:<36} {:>12.4} {:>16.3e} {:>10} {:>14}", "burn's AdamW (NdArray, SimpleOptimizer)", burn_seconds, len as f64 / burn_seconds, "1.00", "-");
    for threads in [1, cores] {
        let host = HostAdamW::with_threads(config, NonZeroUsize::new(threads).unwrap());
        let (mut ours, mut moments) = (start.clone(), AdamWMoments::default());
        host.step(learning_rate, &mut ours, &grads[0], &mut moments);
        let began = Instant::now();
        for grad in &grads {
            host.step(learning_rate, &mut ours, grad, &mut moments);
        }
        let seconds = began.elapsed().as_secs_f64() / steps as f64;
        let difference = ours.iter().zip(&want).map(|(a, b)| if a.is_finite() { (a - b).abs() } else { f32::INFINITY }).fold(0f32, f32::max);
        let name = format!("host AdamW, {threads} thread(s)");
        println!("{name:<36} {seconds:>12.4} {:>16.3e} {:>10.2} {difference:>14.1e}", len as f64 / seconds, burn_seconds / seconds);
    }

    // Clipping's squared norm, which every rank computes before its update can start: one
    // running f64 sum (as it was), against `sum_of_squares`' blocks of 8 lanes on the threads.
    println!("\nthe squared norm of {len} f32 gradients (f64), the mean of {steps} timed passes");
    println!("{:<36} {:>12} {:>16} {:>10} {:>14}", "sum", "s / pass", "values / s", "vs one sum", "relative Δ");
    let timed = |sum: &dyn Fn(&[f32]) -> f64| {
        let began = Instant::now();
        let sums: Vec<f64> = grads.iter().map(|g| sum(g)).collect();
        (began.elapsed().as_secs_f64() / steps as f64, sums[0])
    };
    let (one_sum, want) = timed(&|g| g.iter().map(|&v| f64::from(v) * f64::from(v)).sum());
    println!("{:<36} {one_sum:>12.4} {:>16.3e} {:>10} {:>14}", "one running sum", len as f64 / one_sum, "1.00", "-");
    for threads in [1, cores] {
        let host = HostAdamW::with_threads(config, NonZeroUsize::new(threads).unwrap());
        let (seconds, got) = timed(&|g| host.sum_of_squares(g));
        let name = format!("sum_of_squares, {threads} thread(s)");
        println!("{name:<36} {seconds:>12.4} {:>16.3e} {:>10.2} {:>14.1e}", len as f64 / seconds, one_sum / seconds, ((got - want) / want).abs());
    }

    // A part kept on the host as master weights (`--offload-parameters`), cast to bf16 for each
    // gather's upload: an f32 copy then `convert_dtype` (as it was), against `cast_master_part`.
    println!("\nthe cast of {len} f32 master weights to bf16 for an upload, the mean of {steps} timed casts");
    println!("{:<36} {:>12} {:>16} {:>10} {:>14}", "cast", "s / cast", "values / s", "vs copy", "same bytes");
    let timed = |cast: &dyn Fn(&[f32]) -> TensorData| {
        let began = Instant::now();
        let casts: Vec<TensorData> = grads.iter().map(|g| cast(g)).collect();
        (began.elapsed().as_secs_f64() / steps as f64, casts.into_iter().next().expect("a timed step"))
    };
    let bf16 = burn::tensor::DType::BF16;
    let (copy, want) = timed(&|g| TensorData::new(g.to_vec(), [g.len()]).convert_dtype(bf16));
    println!("{:<36} {copy:>12.4} {:>16.3e} {:>10} {:>14}", "f32 copy, convert_dtype", len as f64 / copy, "1.00", "-");
    for threads in [1, cores] {
        let (seconds, got) = timed(&|g| ulysses_training::cast_master_part(g, bf16, NonZeroUsize::new(threads).unwrap()));
        let name = format!("cast_master_part, {threads} thread(s)");
        println!("{name:<36} {seconds:>12.4} {:>16.3e} {:>10.2} {:>14}", len as f64 / seconds, copy / seconds, got.as_bytes() == want.as_bytes());
    }
}
