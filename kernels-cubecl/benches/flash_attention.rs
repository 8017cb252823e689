//! Flash-attention throughput and memory, beside PyTorch's `scaled_dot_product_attention` on
//! the same shapes in the same run.
//!
//! On a GPU:   cargo bench -p ulysses-kernels --features cuda --bench flash_attention
//! On the CPU: cargo bench -p ulysses-kernels --bench flash_attention -- --quick
//!             (wgpu on lavapipe: small f32 shapes; compares designs, not devices)
//!
//! For each shape (bf16 where the device has it, head dim 128, batch 1, 16 and 32 heads,
//! 1K to 64K tokens, causal and not) it times the planned engine's (`cmma` or plane: the
//! engine the plan below names, which CUDA calls leave for the register fragments since
//! 2026-11-30; `--fragments` times those) forward, backward and both, and reports
//! TFLOP/s with the usual attention count (forward `4·B·H·S²·D`, halved when causal; backward
//! 2.5 times the forward). `benches/sdpa_reference.py` times PyTorch's SDPA on every shape in
//! one Python process, names the backend PyTorch ran (flash, cuDNN, efficient, math) from the
//! kernels it launched, and the table prints ours / PyTorch's.
//!
//! Every shape gets a time budget (`--budget-secs`, 4 s), and a shape whose single forward +
//! backward would not fit it (extrapolated from the previous shape) is skipped and said so:
//! the whole sweep fits one 10-minute GPU call.
//!
//! It also prints the device memory in use after forward + backward at S and 2S (linear
//! growth means no S×S buffer), from the tile sizes the kernels chose, how many
//! shared-memory reads each FLOP of `Q·Kᵀ` costs, and for causal shapes of the first head
//! count the time of forward + backward over packed documents (`VisibleRanges`) against the
//! same shape without them: the tiles the kernels skip.
//!
//! `--fragments` instead times the forward and the backward at head dims 64 and 128 (the
//! register-fragment engine, FlashAttention-2's design, takes 256 too: `--head-dims 64,128,256`)
//! three ways in one run: the planned engine (`flash_attention_forward_planned`, `_backward_planned`), the
//! register fragments (`flash_attention_forward_fragments`, `_backward_fragments`) and SDPA,
//! with the fragments' output and gradients checked against the planned engine's first, and
//! the fragments' backward timed twice where it sums dQ in the dK/dV kernel with atomics: so,
//! and with dQ's own kernel (`ULYSSES_FLASH_DETERMINISTIC=1`, the "dQ kernel" column), and
//! their forward twice where it gives each warp two row tiles of 16 with Q staged: so, and
//! with one and Q's fragments in registers (the "16 rows" column, the forward before
//! 2026-11-30); and their backward with dK/dV's blocks of 4 warps (the "64 keys" column, the
//! H100's and the A100's block before 2026-11-30 where the default takes 8 warps and 128 keys at
//! head dims 64 and 128), and with each step's dS stored after dK's product where dQ is summed
//! (the "dS after" column: sm_80's order, the H100's before 2026-12-06, which stores it first);
//! then causal packed documents of 2048 tokens on both engines.

use std::{
    process::Command,
    time::{Duration, Instant},
};

use burn::tensor::{DType, TensorData, ops::FloatTensorOps};
use burn_cubecl::{CubeBackend, tensor::CubeTensor};
use ulysses_kernels::{
    FlashOptions, OperandInfo, Plan, VisibleRanges, flash_attention_backward_fragments, flash_attention_backward_fragments_laid_out_for, flash_attention_backward_planned, flash_attention_forward_planned,
    flash_attention_forward_fragments, flash_attention_forward_fragments_laid_out_for,
    flash::{Engine, Problem},
};

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
    /// The backward's usual count: 2.5 times the forward's.
    fn backward_flops(&self) -> f64 {
        2.5 * self.forward_flops()
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

/// A tensor of uniform values in [-0.5, 0.5), its own for each `seed` (q, k, v and the output's
/// gradient drawn apart, as SDPA's baseline draws them, though from a normal distribution
/// there: q = k would put each row's largest score on its diagonal, no attention's).
fn tensor(shape: [usize; 4], dtype: DType, device: &Device, seed: u64) -> CubeTensor<Runtime> {
    let count: usize = shape.iter().product();
    // SplitMix64: cheap, and no dependency for a bench. Each seed's stream starts at a mixed
    // state: seeds a step apart would otherwise give the same stream shifted by one value.
    let mix = |mut z: u64| {
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut state = mix(seed);
    let values: Vec<f32> = (0..count)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            (mix(state) >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect();
    B::float_from_data(TensorData::new(values, shape).convert_dtype(dtype), device)
}

/// q, k, v and the output's gradient of a shape, each drawn apart.
fn inputs(shape: [usize; 4], dtype: DType, device: &Device) -> [CubeTensor<Runtime>; 4] {
    [1, 2, 3, 4].map(|seed| tensor(shape, dtype, device, seed))
}

/// Median seconds of `run`: at least one sample, more while the budget lasts (at most 20); of
/// an even count the mean of the middle two, as `statistics.median` gives SDPA's (the upper one
/// alone was the slower of two samples at long lengths, where SDPA's was their mean).
fn time(device: &Device, budget: Duration, mut run: impl FnMut()) -> f64 {
    let mut samples = Vec::new();
    let started = Instant::now();
    while samples.is_empty() || (started.elapsed() < budget && samples.len() < 20) {
        let t = Instant::now();
        run();
        sync(device);
        samples.push(t.elapsed().as_secs_f64());
    }
    samples.sort_by(f64::total_cmp);
    let middle = samples.len() / 2;
    if samples.len() % 2 == 0 { (samples[middle - 1] + samples[middle]) / 2.0 } else { samples[middle] }
}

fn bench(shape: Shape, dtype: DType, device: &Device, budget: Duration, ranges: Option<&VisibleRanges>) -> (Timing, u64) {
    let q_shape = [shape.batch, shape.heads, shape.seq, shape.head_dim];
    let [q, k, v, g] = inputs(q_shape, dtype, device);
    let options = FlashOptions { scale: None, causal: shape.causal };
    let forward = || flash_attention_forward_planned(q.clone(), k.clone(), v.clone(), options, ranges).unwrap();
    // Warm-up: compiles the kernels.
    let (output, lse) = forward();
    let backward = || flash_attention_backward_planned(q.clone(), k.clone(), v.clone(), output.clone(), g.clone(), lse.clone(), options, ranges).unwrap();
    drop(backward());
    sync(device);
    let each = budget / 3;
    let timing = Timing {
        forward: time(device, each, || drop(forward())),
        backward: time(device, each, || drop(backward())),
        both: time(device, each, || {
            let (o, l) = forward();
            drop(flash_attention_backward_planned(q.clone(), k.clone(), v.clone(), o, g.clone(), l, options, ranges).unwrap());
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

/// PyTorch's timing of one shape and the SDPA backend it used.
#[derive(Debug, Clone)]
struct Sdpa {
    timing: Timing,
    backend: String,
}

/// Runs the SDPA script once for every shape, `each` the budget of each of its timings (ours
/// get the same); `None` per shape when torch is missing.
fn sdpa(shapes: &[Shape], each: Duration) -> Vec<Option<Sdpa>> {
    // ULYSSES_SDPA_SCRIPT, else next to this executable (a carried bundle), else the source tree.
    let beside = std::env::current_exe().ok().and_then(|exe| Some(exe.parent()?.join("sdpa_reference.py"))).filter(|p| p.exists());
    let script = std::env::var("ULYSSES_SDPA_SCRIPT").ok().map(std::path::PathBuf::from).or(beside).unwrap_or_else(|| {
        std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../benches/sdpa_reference.py"))
    });
    let list: Vec<String> = shapes.iter().map(|s| format!("{}x{}x{}x{}{}", s.batch, s.heads, s.seq, s.head_dim, if s.causal { "c" } else { "" })).collect();
    let output = Command::new("python3")
        .arg(&script)
        .args(["--shapes", &list.join(","), "--budget", &format!("{}", each.as_secs_f64())])
        .output();
    let text = output.as_ref().map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
    if let Ok(output) = &output
        && !output.status.success()
    {
        eprintln!("SDPA reference unavailable: {}", String::from_utf8_lossy(&output.stderr).trim());
    }
    shapes
        .iter()
        .enumerate()
        .map(|(i, _)| {
            let line = text.lines().find(|l| l.starts_with(&format!("shape {i} ")))?;
            let fields: Vec<&str> = line.split_whitespace().collect();
            let number = |at: usize| fields.get(at)?.parse::<f64>().ok();
            Some(Sdpa { timing: Timing { forward: number(2)?, backward: number(3)?, both: number(4)? }, backend: fields.get(5)?.to_string() })
        })
        .collect()
}

/// Shared-memory reads per FLOP of `Q·Kᵀ` for a plan: what the tile sizes buy.
fn reads_per_flop(plan: &Plan) -> f64 {
    let blocks = plan.forward;
    match plan.engine {
        // Per 16×16×16 step a plane reads the A tile once for the row's tiles and a B tile
        // for each: (256 + n·256) elements for n·8192 FLOPs.
        Engine::TensorCores { .. } => {
            let n = (blocks.block_kv / 16) as f64;
            (256.0 + n * 256.0) / (n * 8192.0)
        }
        // Per k a lane reads `rows + cols` values for `rows × cols` multiply-adds.
        Engine::Plane => {
            let (rows, cols) = ulysses_kernels::flash::tile_ops::lane_block(blocks.plane_dim);
            (rows + cols) as f64 / (2.0 * (rows * cols) as f64)
        }
    }
}

/// `--fragments`: the forward and the backward on the planned engine, on the register
/// fragments and in SDPA, same shapes, same run; then, for causal shapes, packed documents of
/// `document` tokens on both engines (SDPA has no documents).
fn fragments_against_planned(shapes: &[Shape], dtype: DType, device: &Device, budget: Duration, quick: bool) {
    // Each engine's timings get a quarter of a shape's budget (`both_engines`), SDPA's too.
    let theirs = if quick { vec![None; shapes.len()] } else { sdpa(shapes, budget / 4) };
    let number = |x: f64| if x < 0.1 { format!("{x:.1e}") } else { format!("{x:.2}") };
    // SDPA's figures as they come, before ours: a run stopped at its time limit keeps them.
    for (shape, sdpa) in shapes.iter().zip(&theirs) {
        if let Some(sdpa) = sdpa {
            println!(
                "SDPA dim {} heads {} seq {} causal {}: forward {} TFLOP/s, backward {} ({})",
                shape.head_dim,
                shape.heads,
                shape.seq,
                shape.causal,
                number(shape.forward_flops() / sdpa.timing.forward / 1e12),
                number(shape.backward_flops() / sdpa.timing.backward / 1e12),
                sdpa.backend
            );
        }
    }
    let text = |x: Option<f64>| x.map_or("-".to_string(), number);
    // Each shape's (planned, fragments, SDPA's) seconds, timed once, printed in two tables.
    let mut rows = Vec::new();
    for (shape, sdpa) in shapes.iter().zip(theirs) {
        let compared = both_engines(shape, dtype, device, budget, None);
        // Each shape as it is measured, before the tables: a run stopped at its time limit (a
        // lent GPU's call) keeps the shapes it finished.
        let (forward, backward) = (shape.forward_flops() / 1e12, shape.backward_flops() / 1e12);
        println!(
            "measured dim {} heads {} seq {} causal {}: forward {} / {} TFLOP/s, backward {} / {} (planned / fragments)",
            shape.head_dim,
            shape.heads,
            shape.seq,
            shape.causal,
            number(forward / compared.planned.forward),
            number(forward / compared.fragments.forward),
            number(backward / compared.planned.backward),
            number(backward / compared.fragments.backward)
        );
        rows.push((*shape, compared, sdpa.map(|sdpa| sdpa.timing)));
    }
    for backward in [false, true] {
        let pass = if backward { "backward" } else { "forward" };
        println!("\n{pass}, {dtype:?}: planned engine / register fragments (FlashAttention-2's design) / SDPA");
        // The backward's fragments once more with dQ's own kernel (`ULYSSES_FLASH_DETERMINISTIC=1`)
        // where the default sums it in the dK/dV kernel with atomics, the forward's with one row
        // tile a warp where the default takes two: the two ways side by side.
        println!(
            "{:>4} {:>5} {:>6} {:>6} | {:>8} {:>10} {:>8} {:>9} {:>8} {:>8} TFLOP/s | {:>9} {:>9} | max |Δ| fragments vs planned",
            "dim",
            "heads",
            "seq",
            "causal",
            "planned",
            "fragments",
            "SDPA",
            if backward { "dQ kernel" } else { "16 rows" },
            if backward { "64 keys" } else { "" },
            if backward { "dS after" } else { "" },
            "frag/plan",
            "frag/SDPA"
        );
        for (shape, compared, sdpa) in &rows {
            let (planned_s, fragments_s, difference) = if backward {
                (compared.planned.backward, compared.fragments.backward, compared.backward_difference)
            } else {
                (compared.planned.forward, compared.fragments.forward, compared.forward_difference)
            };
            let flops = if backward { shape.backward_flops() } else { shape.forward_flops() };
            let tflops = |seconds: f64| flops / seconds / 1e12;
            let sdpa_tflops = sdpa.map(|t| tflops(if backward { t.backward } else { t.forward }));
            let other_way = if backward { compared.query_grad_kernel_backward } else { compared.one_row_tile_forward }.map(tflops);
            let four_warps = if backward { number(tflops(compared.four_warp_backward)) } else { String::new() };
            let score_grads_after = if backward { text(compared.score_grads_after_backward.map(tflops)) } else { String::new() };
            // On the CPU the products run in the shared-memory emulation: compare there for
            // agreement, not for speed.
            println!(
                "{:>4} {:>5} {:>6} {:>6} | {:>8} {:>10} {:>8} {:>9} {:>8} {:>8} TFLOP/s | {:>9.2} {:>9} | {difference:.1e}",
                shape.head_dim,
                shape.heads,
                shape.seq,
                shape.causal,
                number(tflops(planned_s)),
                number(tflops(fragments_s)),
                text(sdpa_tflops),
                text(other_way),
                four_warps,
                score_grads_after,
                planned_s / fragments_s,
                text(sdpa_tflops.map(|theirs| tflops(fragments_s) / theirs))
            );
        }
    }
    let document = if quick { 64 } else { 2048 };
    println!("\npacked documents of {document} tokens, causal: seconds, planned engine / fragments, and each against the whole sequence");
    for (shape, whole, _) in rows.into_iter().filter(|(shape, ..)| shape.causal && shape.seq >= 2 * document) {
        let lengths: Vec<usize> = (0..shape.seq).step_by(document).map(|start| document.min(shape.seq - start)).collect();
        let ranges = VisibleRanges::all(1, shape.seq, shape.seq).and_then(|r| r.with_documents(&[lengths])).unwrap();
        let packed = both_engines(&shape, dtype, device, budget, Some(&ranges));
        for (pass, planned_s, fragments_s, planned_whole, fragments_whole, difference) in [
            ("forward", packed.planned.forward, packed.fragments.forward, whole.planned.forward, whole.fragments.forward, packed.forward_difference),
            ("backward", packed.planned.backward, packed.fragments.backward, whole.planned.backward, whole.fragments.backward, packed.backward_difference),
        ] {
            println!(
                "dim {:>3} heads {:>3} seq {:>6} {pass:>8}: {:.3e} s / {:.3e} s = {:.2} (against the whole sequence: {:.3} / {:.3}; work {:.3}), max |Δ| {difference:.1e}",
                shape.head_dim,
                shape.heads,
                shape.seq,
                planned_s,
                fragments_s,
                planned_s / fragments_s,
                planned_s / planned_whole,
                fragments_s / fragments_whole,
                document as f64 / shape.seq as f64
            );
        }
    }
}

/// One shape on both engines: seconds of each pass, and the largest differences of their
/// outputs (forward) and of their gradients (backward, over dQ, dK and dV).
struct Compared {
    planned: Timing,
    fragments: Timing,
    /// The fragments' backward with dQ's own kernel, where the default sums dQ with atomics.
    query_grad_kernel_backward: Option<f64>,
    /// The fragments' forward with one row tile a warp, where the default takes two.
    one_row_tile_forward: Option<f64>,
    /// The fragments' backward with dK/dV's blocks of 4 warps (64 keys).
    four_warp_backward: f64,
    /// The fragments' backward with each step's dS stored after dK's product, where it sums
    /// dQ (the default stores it first where the device has `stmatrix`: sm_90).
    score_grads_after_backward: Option<f64>,
    forward_difference: f32,
    backward_difference: f32,
}

/// One shape's forward and backward timed on the planned engine and on the fragments (each
/// after a warm-up run that compiles it and checks that they agree); the backward from each
/// engine's own forward.
fn both_engines(shape: &Shape, dtype: DType, device: &Device, budget: Duration, ranges: Option<&VisibleRanges>) -> Compared {
    let q_shape = [shape.batch, shape.heads, shape.seq, shape.head_dim];
    let [q, k, v, g] = inputs(q_shape, dtype, device);
    let options = FlashOptions { scale: None, causal: shape.causal };
    let planned = || flash_attention_forward_planned(q.clone(), k.clone(), v.clone(), options, ranges).unwrap();
    let fragments = || flash_attention_forward_fragments(q.clone(), k.clone(), v.clone(), options, ranges).unwrap();
    let values = |tensor: CubeTensor<Runtime>| -> Vec<f32> {
        burn::tensor::Tensor::<B, 4>::from_primitive(burn::tensor::TensorPrimitive::Float(tensor)).cast(DType::F32).into_data().to_vec().unwrap()
    };
    // Infinite where either engine gives a non-finite value (`f32::max` would drop a NaN).
    let largest_difference = |a: Vec<f32>, b: Vec<f32>| a.iter().zip(b).map(|(a, b)| (a - b).abs()).fold(0.0f32, |worst, d| if d.is_finite() { worst.max(d) } else { f32::INFINITY });
    let ((planned_out, planned_lse), (fragments_out, fragments_lse)) = (planned(), fragments());
    let mut forward_difference = largest_difference(values(planned_out.clone()), values(fragments_out.clone()));
    let planned_backward = || flash_attention_backward_planned(q.clone(), k.clone(), v.clone(), planned_out.clone(), g.clone(), planned_lse.clone(), options, ranges).unwrap();
    let fragments_backward = || flash_attention_backward_fragments(q.clone(), k.clone(), v.clone(), fragments_out.clone(), g.clone(), fragments_lse.clone(), options, ranges).unwrap();
    let summed_before = ulysses_kernels::query_grads_summed();
    let (want, got) = (planned_backward(), fragments_backward());
    let summed = ulysses_kernels::query_grads_summed() > summed_before;
    let want_grads = want.clone();
    let mut backward_difference = [(want.0.clone(), got.0), (want.1.clone(), got.1), (want.2.clone(), got.2)].into_iter().map(|(a, b)| largest_difference(values(a), values(b))).fold(0.0f32, f32::max);
    let each = budget / 4;
    let timing = |forward: f64, backward: f64| Timing { forward, backward, both: forward + backward };
    let query_grad_kernel_backward = summed.then(|| {
        // What `ULYSSES_FLASH_DETERMINISTIC=1` runs.
        let own_kernel = || {
            flash_attention_backward_fragments_laid_out_for(q.clone(), k.clone(), v.clone(), fragments_out.clone(), g.clone(), fragments_lse.clone(), options, ranges, None, true, None).unwrap()
        };
        let own = own_kernel();
        backward_difference = [(want.0, own.0), (want.1, own.1), (want.2, own.2)].into_iter().map(|(a, b)| largest_difference(values(a), values(b))).fold(backward_difference, f32::max);
        time(device, each, || drop(own_kernel()))
    });
    // Two row tiles a warp (Q staged) where the output is one part: one, to compare.
    let one_row_tile_forward = (shape.head_dim <= 128).then(|| {
        let one_tile = || flash_attention_forward_fragments_laid_out_for(q.clone(), k.clone(), v.clone(), options, ranges, None, true).unwrap();
        let (out, _) = one_tile();
        forward_difference = forward_difference.max(largest_difference(values(planned_out.clone()), values(out)));
        time(device, each, || drop(one_tile()))
    });
    // dK/dV's blocks of 4 warps, where the default may take 8 (head dims 64 and 128 with mma.sync).
    let four_warps = || {
        flash_attention_backward_fragments_laid_out_for(q.clone(), k.clone(), v.clone(), fragments_out.clone(), g.clone(), fragments_lse.clone(), options, ranges, None, false, Some(4)).unwrap()
    };
    let four = four_warps();
    backward_difference = [(want_grads.0.clone(), four.0), (want_grads.1.clone(), four.1), (want_grads.2.clone(), four.2)].into_iter().map(|(a, b)| largest_difference(values(a), values(b))).fold(backward_difference, f32::max);
    let four_warp_backward = time(device, each, || drop(four_warps()));
    // dS stored after dK's product (sm_80's order) where dQ is summed, to compare with sm_90's
    // default, which stores it first (`Staging::score_grads_first`).
    let score_grads_after_backward = summed.then(|| {
        ulysses_kernels::testing::store_score_grads_first(Some(false));
        let after = fragments_backward();
        backward_difference = [(want_grads.0, after.0), (want_grads.1, after.1), (want_grads.2, after.2)]
            .into_iter()
            .map(|(a, b)| largest_difference(values(a), values(b)))
            .fold(backward_difference, f32::max);
        let seconds = time(device, each, || drop(fragments_backward()));
        ulysses_kernels::testing::store_score_grads_first(None);
        seconds
    });
    Compared {
        planned: timing(time(device, each, || drop(planned())), time(device, each, || drop(planned_backward()))),
        fragments: timing(time(device, each, || drop(fragments())), time(device, each, || drop(fragments_backward()))),
        query_grad_kernel_backward,
        one_row_tile_forward,
        four_warp_backward,
        score_grads_after_backward,
        forward_difference,
        backward_difference,
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let budget_secs: f64 = args.iter().position(|a| a == "--budget-secs").and_then(|i| args.get(i + 1)?.parse().ok()).unwrap_or(4.0);
    let budget = Duration::from_secs_f64(budget_secs);
    let device = Device::default();
    let client = <Runtime as cubecl::Runtime>::client(&device);
    let bf16 = client.properties().supports_type(cubecl::ir::ElemType::Float(cubecl::ir::FloatKind::BF16));
    let dtype = if bf16 && !quick { DType::BF16 } else { DType::F32 };
    // `--seqs 4096,16384` and `--heads 16` narrow the sweep (a short GPU call); `--skews 0,8`
    // times our kernels once per shared-tile padding (`ULYSSES_FLASH_SKEW`), each against
    // the same SDPA figures: the layouts compared in one run.
    let list = |flag: &str| -> Option<Vec<usize>> {
        let at = args.iter().position(|a| a == flag)?;
        let text = args.get(at + 1).unwrap_or_else(|| panic!("{flag} needs a comma-separated list of numbers"));
        Some(text.split(',').map(|n| n.trim().parse().unwrap_or_else(|_| panic!("{flag} {text}: {n:?} is not a number"))).collect())
    };
    let (seqs, heads) = if quick { (vec![256, 512], vec![2]) } else { (vec![1024, 2048, 4096, 8192, 16384, 32768, 65536], vec![16, 32]) };
    let (seqs, heads) = (list("--seqs").unwrap_or(seqs), list("--heads").unwrap_or(heads));
    let skews: Vec<Option<usize>> = list("--skews").map_or(vec![None], |skews| skews.into_iter().map(Some).collect());
    let shapes_of = |head_dim: usize| -> Vec<Shape> {
        heads.iter().flat_map(|&h| seqs.iter().flat_map(move |&seq| [false, true].map(|causal| Shape { batch: 1, heads: h, seq, head_dim, causal }))).collect()
    };
    if args.iter().any(|a| a == "--fragments") {
        // `--head-dims 64,128` (the dims the fragments take so far, the default).
        let shapes: Vec<Shape> = list("--head-dims").unwrap_or(vec![64, 128]).into_iter().flat_map(shapes_of).collect();
        // The fragments take f16 and bf16 only: f16 where the device has no bf16 (lavapipe).
        let dtype = if bf16 { DType::BF16 } else { DType::F16 };
        fragments_against_planned(&shapes, dtype, &device, budget, quick);
        return;
    }
    let shapes = shapes_of(128);

    let q_shape = [1, 2, 512, 128];
    let info = OperandInfo { shape: &q_shape, dtype };
    let problem = Problem::new(&client, info, info, info, &FlashOptions { scale: None, causal: true }).unwrap();
    let plan = Plan::new(&problem, dtype, true, &client).unwrap();
    println!("flash attention, {dtype:?}, batch 1, head dim 128 ({})", std::any::type_name::<Runtime>());
    println!("plan: {:?} engine; forward blocks {:?}", plan.engine, plan.forward);
    println!(
        "shared-memory reads per FLOP of Q·Kᵀ: {:.3} here; the scalar kernels before read one K value per multiply-add: 0.500",
        reads_per_flop(&plan)
    );

    // A third of a shape's budget for each timing (`bench`), SDPA's too.
    let theirs = if quick { vec![None; shapes.len()] } else { sdpa(&shapes, budget / 3) };
    let mut memory = Vec::new();
    let mut plain_causal = Vec::new();
    for skew in skews {
        // What follows the table (memory, packed documents) uses the last layout's runs.
        memory.clear();
        plain_causal.clear();
        let mut seconds_per_flop: Option<f64> = None;
        if let Some(skew) = skew {
            // SAFETY: this bench is single-threaded; the planner reads it at each call.
            unsafe { std::env::set_var("ULYSSES_FLASH_SKEW", skew.to_string()) };
            println!("\nshared tiles padded by {skew} elements per row (ULYSSES_FLASH_SKEW={skew})");
        }
        println!(
            "{:>5} {:>6} {:>6} | {:>8} {:>8} {:>8} TFLOP/s | {:>8} {:>8} {:>8} SDPA ({:>9}) | {:>5} {:>5} {:>5} ratio",
            "heads", "seq", "causal", "fwd", "bwd", "fwd+bwd", "fwd", "bwd", "fwd+bwd", "backend", "fwd", "bwd", "both"
        );
        for (shape, sdpa) in shapes.iter().zip(theirs.iter().cloned()) {
            let flops = shape.forward_flops();
            let tflops = |flops: f64, seconds: f64| flops / seconds / 1e12;
            // Skip what one forward + backward could not finish within the budget.
            if let Some(rate) = seconds_per_flop
                && rate * 3.5 * flops > budget_secs
            {
                println!("{:>5} {:>6} {:>6} | skipped: one forward + backward would take about {:.0} s", shape.heads, shape.seq, shape.causal, rate * 3.5 * flops);
                continue;
            }
            let (ours, in_use) = bench(*shape, dtype, &device, budget, None);
            if shape.causal && shape.heads == heads[0] {
                plain_causal.push((*shape, ours.both));
            }
            seconds_per_flop = Some(ours.both / (3.5 * flops));
            let mine = [tflops(flops, ours.forward), tflops(2.5 * flops, ours.backward), tflops(3.5 * flops, ours.both)];
            let (theirs, backend, ratio) = match sdpa {
                Some(sdpa) => {
                    let t = sdpa.timing;
                    let theirs = [tflops(flops, t.forward), tflops(2.5 * flops, t.backward), tflops(3.5 * flops, t.both)];
                    let ratio = [0, 1, 2].map(|i| format!("{:.2}", mine[i] / theirs[i]));
                    (theirs.map(|x| format!("{x:.1}")), sdpa.backend, ratio)
                }
                None => (["-".to_string(), "-".to_string(), "-".to_string()], "-".to_string(), ["-".to_string(), "-".to_string(), "-".to_string()]),
            };
            let mine = mine.map(|x| if x < 0.1 { format!("{x:.1e}") } else { format!("{x:.2}") });
            println!(
                "{:>5} {:>6} {:>6} | {:>8} {:>8} {:>8}         | {:>8} {:>8} {:>8}      ({backend:>9}) | {:>5} {:>5} {:>5}",
                shape.heads, shape.seq, shape.causal, mine[0], mine[1], mine[2], theirs[0], theirs[1], theirs[2], ratio[0], ratio[1], ratio[2]
            );
            println!("  seconds: forward {:.4e}, backward {:.4e}, both {:.4e}", ours.forward, ours.backward, ours.both);
            if !shape.causal {
                memory.push((shape.heads, shape.seq, in_use));
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

    // Documents of `document` tokens: causal attention does document/S of the work of the
    // whole sequence (a little more at tile edges), if whole tiles are skipped.
    let document = if quick { 64 } else { 2048 };
    println!("\npacked documents of {document} tokens, causal: forward + backward seconds with documents / without, same run");
    for (shape, without) in plain_causal.into_iter().filter(|(shape, _)| shape.seq >= 4 * document) {
        let lengths: Vec<usize> = (0..shape.seq).step_by(document).map(|start| document.min(shape.seq - start)).collect();
        let ranges = VisibleRanges::all(1, shape.seq, shape.seq).and_then(|r| r.with_documents(&[lengths])).unwrap();
        let (with, _) = bench(shape, dtype, &device, budget, Some(&ranges));
        println!(
            "heads {} seq {:>6}: {:.4e} s / {:.4e} s = {:.3} (work ratio {:.3})",
            shape.heads,
            shape.seq,
            with.both,
            without,
            with.both / without,
            document as f64 / shape.seq as f64
        );
    }
}
