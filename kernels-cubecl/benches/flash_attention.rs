//! Flash-attention throughput and memory, beside PyTorch's `scaled_dot_product_attention` on
//! the same shapes in the same run.
//!
//! On a GPU:   cargo bench -p ulysses-kernels --features cuda --bench flash_attention
//! On the CPU: cargo bench -p ulysses-kernels --bench flash_attention -- --quick
//!             (wgpu on lavapipe: checks the bench runs; the numbers mean nothing)
//!
//! For each shape it times the forward, the backward and both, reports TFLOP/s with the
//! usual attention count (forward `4·B·H·S²·D`, halved when causal; backward 2.5 times the
//! forward), and runs `benches/sdpa_reference.py` (next to this crate's workspace root) for
//! PyTorch's numbers when `python3 -c "import torch"` works, printing ours / PyTorch's. It
//! also reports the device memory in use after forward + backward, for S and 2S, which
//! grows linearly when no S×S buffer exists.
//!
//! Our times are wall-clock from launch to the end of a device synchronisation (which adds
//! tens of microseconds); PyTorch's come from CUDA events. At the sequence lengths that
//! matter here (milliseconds per call) the difference is below the noise.

use std::{
    process::Command,
    time::{Duration, Instant},
};

use burn::tensor::{DType, TensorData, ops::FloatTensorOps};
use burn_cubecl::{CubeBackend, tensor::CubeTensor};
use ulysses_kernels::{FlashOptions, flash_attention_backward, flash_attention_forward};

#[cfg(feature = "cuda")]
type Runtime = cubecl::cuda::CudaRuntime;
#[cfg(not(feature = "cuda"))]
type Runtime = cubecl::wgpu::WgpuRuntime;
type B = CubeBackend<Runtime, f32, i32, u32>;
type Device = <Runtime as cubecl::Runtime>::Device;

#[derive(Debug, Clone, Copy)]
struct Shape {
    batch: usize,
    heads: usize,
    seq: usize,
    head_dim: usize,
    causal: bool,
}

impl Shape {
    fn forward_flops(&self) -> f64 {
        let full = 4.0 * (self.batch * self.heads) as f64 * (self.seq as f64).powi(2) * self.head_dim as f64;
        if self.causal { full / 2.0 } else { full }
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Timing {
    forward: f64,
    backward: f64,
    both: f64,
}

fn sync(device: &Device) {
    let client = <Runtime as cubecl::Runtime>::client(device);
    cubecl::future::block_on(client.sync()).expect("the device failed");
}

fn tensor(shape: [usize; 4], dtype: DType, device: &Device) -> CubeTensor<Runtime> {
    let count: usize = shape.iter().product();
    let values: Vec<f32> = (0..count).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
    B::float_from_data(TensorData::new(values, shape).convert_dtype(dtype), device)
}

/// Median seconds of `run` over enough repetitions to fill about `budget`.
fn time(device: &Device, budget: Duration, mut run: impl FnMut()) -> f64 {
    run();
    sync(device);
    let mut samples = Vec::new();
    let started = Instant::now();
    while samples.len() < 3 || (started.elapsed() < budget && samples.len() < 50) {
        let t = Instant::now();
        run();
        sync(device);
        samples.push(t.elapsed().as_secs_f64());
    }
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn bench(shape: Shape, dtype: DType, device: &Device, budget: Duration) -> (Timing, u64) {
    let q_shape = [shape.batch, shape.heads, shape.seq, shape.head_dim];
    let (q, k, v, g) = (tensor(q_shape, dtype, device), tensor(q_shape, dtype, device), tensor(q_shape, dtype, device), tensor(q_shape, dtype, device));
    let options = FlashOptions { scale: None, causal: shape.causal };
    let forward = || flash_attention_forward(q.clone(), k.clone(), v.clone(), options).unwrap();
    let (output, lse) = forward();
    let backward = || flash_attention_backward(q.clone(), k.clone(), v.clone(), output.clone(), g.clone(), lse.clone(), options).unwrap();
    let timing = Timing {
        forward: time(device, budget, || drop(forward())),
        backward: time(device, budget, || drop(backward())),
        both: time(device, budget, || {
            let (o, l) = forward();
            drop(flash_attention_backward(q.clone(), k.clone(), v.clone(), o, g.clone(), l, options).unwrap());
        }),
    };
    // Memory in use with every tensor of a forward + backward alive.
    let grads = backward();
    sync(device);
    let client = <Runtime as cubecl::Runtime>::client(device);
    let in_use = client.memory_usage().map(|u| u.bytes_in_use).unwrap_or(0);
    drop(grads);
    (timing, in_use)
}

/// PyTorch's timings for the same shape, when torch is importable.
fn sdpa(shape: Shape) -> Option<Timing> {
    // ULYSSES_SDPA_SCRIPT, else next to this executable (a carried bundle), else the source tree.
    let beside = std::env::current_exe().ok().and_then(|exe| Some(exe.parent()?.join("sdpa_reference.py"))).filter(|p| p.exists());
    let script = std::env::var("ULYSSES_SDPA_SCRIPT").ok().map(std::path::PathBuf::from).or(beside).unwrap_or_else(|| {
        std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../benches/sdpa_reference.py"))
    });
    let output = Command::new("python3")
        .arg(&script)
        .args(["--batch", &shape.batch.to_string(), "--heads", &shape.heads.to_string()])
        .args(["--seq", &shape.seq.to_string(), "--head-dim", &shape.head_dim.to_string()])
        .args(if shape.causal { &["--causal"][..] } else { &[][..] })
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text.lines().find(|l| l.starts_with("seconds "))?;
    let mut numbers = line.split_whitespace().skip(1).filter_map(|x| x.parse::<f64>().ok());
    Some(Timing { forward: numbers.next()?, backward: numbers.next()?, both: numbers.next()? })
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let device = Device::default();
    let client = <Runtime as cubecl::Runtime>::client(&device);
    let bf16 = client.properties().supports_type(cubecl::ir::ElemType::Float(cubecl::ir::FloatKind::BF16));
    let dtype = if bf16 { DType::BF16 } else { DType::F32 };
    let (seqs, heads, budget) = if quick { (vec![256, 512], vec![2], Duration::from_millis(200)) } else {
        (vec![1024, 2048, 4096, 8192, 16384, 32768, 65536], vec![16, 32], Duration::from_secs(2))
    };
    println!("flash attention, {dtype:?}, batch 1, head dim 128 ({})", std::any::type_name::<Runtime>());
    println!(
        "{:>5} {:>6} {:>6} | {:>8} {:>8} {:>8} TFLOP/s | {:>8} {:>8} {:>8} SDPA | {:>5} {:>5} {:>5} ratio",
        "heads", "seq", "causal", "fwd", "bwd", "fwd+bwd", "fwd", "bwd", "fwd+bwd", "fwd", "bwd", "both"
    );
    let mut memory = Vec::new();
    for &h in &heads {
        for &seq in &seqs {
            for causal in [false, true] {
                let shape = Shape { batch: 1, heads: h, seq, head_dim: 128, causal };
                let (ours, in_use) = bench(shape, dtype, &device, budget);
                let flops = shape.forward_flops();
                let tflops = |flops: f64, seconds: f64| flops / seconds / 1e12;
                let mine = [tflops(flops, ours.forward), tflops(2.5 * flops, ours.backward), tflops(3.5 * flops, ours.both)];
                let (theirs, ratio) = match sdpa(shape) {
                    Some(t) => {
                        let theirs = [tflops(flops, t.forward), tflops(2.5 * flops, t.backward), tflops(3.5 * flops, t.both)];
                        let ratio = [0, 1, 2].map(|i| format!("{:.2}", mine[i] / theirs[i]));
                        (theirs.map(|x| format!("{x:.1}")), ratio)
                    }
                    None => (["-".to_string(), "-".to_string(), "-".to_string()], ["-".to_string(), "-".to_string(), "-".to_string()]),
                };
                let mine = mine.map(|x| if x < 0.1 { format!("{x:.1e}") } else { format!("{x:.2}") });
                println!(
                    "{h:>5} {seq:>6} {causal:>6} | {:>8} {:>8} {:>8}         | {:>8} {:>8} {:>8}      | {:>5} {:>5} {:>5}",
                    mine[0], mine[1], mine[2], theirs[0], theirs[1], theirs[2], ratio[0], ratio[1], ratio[2]
                );
                if !causal {
                    memory.push((h, seq, in_use));
                }
            }
        }
    }
    println!("\ndevice memory in use with a forward + backward alive (non-causal):");
    for window in memory.windows(2) {
        let [(h0, s0, m0), (h1, s1, m1)] = [window[0], window[1]];
        if h0 == h1 {
            println!("heads {h0}: S {s0} -> {s1}: {m0} -> {m1} bytes (x{:.2} for x{:.0} tokens)", m1 as f64 / m0.max(1) as f64, s1 as f64 / s0 as f64);
        }
    }
}
