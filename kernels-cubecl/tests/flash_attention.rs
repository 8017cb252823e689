//! The flash-attention kernels against a naive attention computed in f64 on the host: output,
//! log-sum-exp, dQ, dK and dV, causal and not, grouped-query ratios 1, 2 and 4, odd and
//! unequal sequence lengths, head dims 16, 64, 128, 256 and an odd one, 4096 tokens, and f32,
//! f16 (and bf16 where the device has it); documents packed into a sequence (1, 2 and 5 per
//! sequence, at lengths that are no multiple of a tile) and key padding, causal and not. On the CPU the plane engine runs them (lavapipe has
//! no tensor cores); on CUDA, f16 and bf16 run on the register fragments at head dims 64, 128 and
//! 256 (`mma.sync`, the engine chosen there), on tensor cores at others, and f32 on TF32 ones.
//!
//! On the CPU they run through wgpu on a software Vulkan driver (lavapipe: Debian's
//! `mesa-vulkan-drivers`); with `--features cuda` on an NVIDIA GPU. Without a usable device
//! the tests say so and skip, unless `ULYSSES_REQUIRE_GPU_RUNTIME=1` (set by CI, which
//! installs lavapipe) makes that a failure.
//!
//! The engine: f16 and bf16 run on tensor cores where the device has them (CUDA; with
//! `--features spirv`, lavapipe 26.1's 8³ cooperative matrices, or 16³ with
//! `ULYSSES_FLASH_FRAGMENT=16`), the plane engine elsewhere. `ULYSSES_EXPECT_ENGINE`
//! (`plane`, `tensor-cores-8`, `tensor-cores-16`, `register-fragments`) makes every f16/bf16
//! case check that it runs on that engine, so a run meant for the tensor cores cannot pass on the plane
//! engine.
//!
//! `fragments` checks the register fragments of `mma.sync` (`ulysses_kernels::mma`) that the
//! FlashAttention-2-class engine is built on.
//!
//! Tolerances, relative to the largest reference magnitude: f32 1e-5 (summation order), f32
//! on TF32 tensor cores (CUDA from sm_80) 3e-3,
//! f16 1.5e-3 and bf16 5e-3 (the kernels round probabilities, dS and their outputs to the
//! storage type, as FlashAttention does; inputs are rounded before the reference sees them).
//! Rounding the probabilities of an f16 kernel to bf16 fails them.

use std::ops::Range;

/// The mma.sync register fragments the FlashAttention-2 engine is built on.
mod fragments;

use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive, ops::FloatTensorOps};
use burn_cubecl::CubeBackend;
use ulysses_kernels::{
    FlashError, FlashOptions, OperandInfo, VisibleRanges, flash_attention_backward, flash_attention_forward, plan_flash_attention, runs_on_fragments,
    testing::{runtime_available, supports_dtype, uniform_values},
};

#[cfg(feature = "cuda")]
type Runtime = cubecl::cuda::CudaRuntime;
#[cfg(not(feature = "cuda"))]
type Runtime = cubecl::wgpu::WgpuRuntime;

type B = CubeBackend<Runtime, f32, i32, u32>;
type Device = <Runtime as cubecl::Runtime>::Device;

/// The device, or `None` (with the reason printed) when this machine has none.
fn device() -> Option<Device> {
    runtime_available::<Runtime>().then(Device::default)
}

fn supports(device: &Device, dtype: DType) -> bool {
    supports_dtype::<Runtime>(device, dtype)
}

#[derive(Debug, Clone)]
struct Case {
    batch: usize,
    q_heads: usize,
    kv_heads: usize,
    seq_q: usize,
    seq_kv: usize,
    head_dim: usize,
    value_dim: usize,
    causal: bool,
    scale: Option<f64>,
    dtype: DType,
    /// Per sequence, the lengths of the documents packed into it.
    documents: Option<Vec<Vec<usize>>>,
    /// Per sequence, the keys that are not padding.
    key_runs: Option<Vec<Range<usize>>>,
    /// A sliding window: a row sees none of the keys more than `window - 1` before it.
    window: Option<usize>,
}

impl Case {
    fn new(q_heads: usize, kv_heads: usize, seq: usize, head_dim: usize, causal: bool) -> Self {
        Self {
            batch: 2,
            q_heads,
            kv_heads,
            seq_q: seq,
            seq_kv: seq,
            head_dim,
            value_dim: head_dim,
            causal,
            scale: None,
            dtype: DType::F32,
            documents: None,
            key_runs: None,
            window: None,
        }
    }
    /// Whether query row `i` of sequence `b` sees key `j`, from the case's own description
    /// (not from `VisibleRanges`).
    fn sees(&self, b: usize, i: usize, j: usize) -> bool {
        let document_of = |position: usize| -> usize {
            let lengths = &self.documents.as_ref().unwrap()[b];
            lengths.iter().scan(0, |end, length| { *end += length; Some(*end) }).take_while(|&end| end <= position).count()
        };
        (!self.causal || j + self.seq_q <= i + self.seq_kv)
            && self.key_runs.as_ref().is_none_or(|runs| runs[b].contains(&j))
            && (self.documents.is_none() || document_of(i) == document_of(j))
            && self.window.is_none_or(|window| j + window > i)
    }
    fn ranges(&self) -> Option<VisibleRanges> {
        if self.documents.is_none() && self.key_runs.is_none() && self.window.is_none() {
            return None;
        }
        let mut ranges = VisibleRanges::all(self.batch, self.seq_q, self.seq_kv).unwrap();
        if let Some(documents) = &self.documents {
            ranges = ranges.with_documents(documents).unwrap();
        }
        if let Some(runs) = &self.key_runs {
            ranges = ranges.with_key_runs(runs).unwrap();
        }
        if let Some(window) = self.window {
            ranges = ranges.with_window(window).unwrap();
        }
        Some(ranges)
    }
    fn q_shape(&self) -> [usize; 4] {
        [self.batch, self.q_heads, self.seq_q, self.head_dim]
    }
    fn k_shape(&self) -> [usize; 4] {
        [self.batch, self.kv_heads, self.seq_kv, self.head_dim]
    }
    fn v_shape(&self) -> [usize; 4] {
        [self.batch, self.kv_heads, self.seq_kv, self.value_dim]
    }
    fn o_shape(&self) -> [usize; 4] {
        [self.batch, self.q_heads, self.seq_q, self.value_dim]
    }
    fn scale(&self) -> f64 {
        self.scale.unwrap_or(1.0 / (self.head_dim as f64).sqrt())
    }
    /// Relative to the largest reference value, for the engine the case runs on. Tight
    /// enough that rounding the probabilities to bf16 (8 bits of mantissa) inside an f16
    /// kernel fails. f32 on TF32 tensor cores: twice the 1.5e-3 that
    /// `benches/tf32_error_model.py` gives for operands truncated to TF32.
    fn tolerance(&self, engine: &str) -> f64 {
        match self.dtype {
            DType::F16 => 1.5e-3,
            DType::BF16 => 5e-3,
            _ if engine == "tensor-cores-tf32" => 3e-3,
            _ => 1e-5,
        }
    }
}

/// Deterministic values in [-1, 1), rounded to `dtype`.
fn values(count: usize, stream: u64, dtype: DType) -> Vec<f64> {
    uniform_values(count, stream)
        .into_iter()
        .map(|x| {
            let x = x as f32;
            match dtype {
                DType::F16 => half::f16::from_f32(x).to_f64(),
                DType::BF16 => half::bf16::from_f32(x).to_f64(),
                _ => x as f64,
            }
        })
        .collect()
}

fn upload(values: &[f64], shape: [usize; 4], dtype: DType, device: &Device) -> burn_cubecl::tensor::CubeTensor<Runtime> {
    let data = TensorData::new(values.iter().map(|&v| v as f32).collect::<Vec<_>>(), shape).convert_dtype(dtype);
    let tensor = B::float_from_data(data, device);
    assert_eq!(tensor.dtype, dtype);
    tensor
}

fn download<const D: usize>(tensor: burn_cubecl::tensor::CubeTensor<Runtime>) -> Vec<f64> {
    Tensor::<B, D>::from_primitive(TensorPrimitive::Float(tensor)).into_data().convert::<f64>().to_vec().unwrap()
}

struct Reference {
    output: Vec<f64>,
    lse: Vec<Option<f64>>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
}

/// Naive attention and its gradients in f64: softmax over the visible keys of each row.
fn reference(case: &Case, q: &[f64], k: &[f64], v: &[f64], d_out: &[f64]) -> Reference {
    let Case { batch, q_heads, kv_heads, seq_q, seq_kv, head_dim: d, value_dim: dv, .. } = *case;
    let scale = case.scale();
    let group = q_heads / kv_heads;
    let q_at = |b: usize, h: usize, i: usize| ((b * q_heads + h) * seq_q + i) * d;
    let k_at = |b: usize, h: usize, j: usize| ((b * kv_heads + h) * seq_kv + j) * d;
    let v_at = |b: usize, h: usize, j: usize| ((b * kv_heads + h) * seq_kv + j) * dv;
    let o_at = |b: usize, h: usize, i: usize| ((b * q_heads + h) * seq_q + i) * dv;
    let mut r = Reference {
        output: vec![0.0; batch * q_heads * seq_q * dv],
        lse: vec![None; batch * q_heads * seq_q],
        dq: vec![0.0; q.len()],
        dk: vec![0.0; k.len()],
        dv: vec![0.0; v.len()],
    };
    for b in 0..batch {
        for h in 0..q_heads {
            let kh = h / group;
            for i in 0..seq_q {
                let visible: Vec<usize> = (0..seq_kv).filter(|&j| case.sees(b, i, j)).collect();
                if visible.is_empty() {
                    continue;
                }
                let scores: Vec<f64> = visible
                    .iter()
                    .map(|&j| scale * (0..d).map(|x| q[q_at(b, h, i) + x] * k[k_at(b, kh, j) + x]).sum::<f64>())
                    .collect();
                let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                let l: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                let probs: Vec<f64> = scores.iter().map(|s| (s - m).exp() / l).collect();
                r.lse[(b * q_heads + h) * seq_q + i] = Some(m + l.ln());
                for (p, &j) in probs.iter().zip(&visible) {
                    for x in 0..dv {
                        r.output[o_at(b, h, i) + x] += p * v[v_at(b, kh, j) + x];
                    }
                }
                let g = &d_out[o_at(b, h, i)..o_at(b, h, i) + dv];
                let delta: f64 = (0..dv).map(|x| g[x] * r.output[o_at(b, h, i) + x]).sum();
                for (p, &j) in probs.iter().zip(&visible) {
                    let dp: f64 = (0..dv).map(|x| g[x] * v[v_at(b, kh, j) + x]).sum();
                    let ds = p * (dp - delta);
                    for x in 0..dv {
                        r.dv[v_at(b, kh, j) + x] += p * g[x];
                    }
                    for x in 0..d {
                        r.dq[q_at(b, h, i) + x] += scale * ds * k[k_at(b, kh, j) + x];
                        r.dk[k_at(b, kh, j) + x] += scale * ds * q[q_at(b, h, i) + x];
                    }
                }
            }
        }
    }
    r
}

/// Largest difference relative to the reference's largest magnitude (floored at 1e-3); NaN
/// or infinity anywhere in `got` is an infinite error.
fn relative_error(got: &[f64], want: &[f64]) -> f64 {
    relative_error_above(got, want, 1e-3)
}

/// The largest difference over the largest reference value, or over `floor` where every
/// reference value is smaller.
fn relative_error_above(got: &[f64], want: &[f64], floor: f64) -> f64 {
    assert_eq!(got.len(), want.len());
    // A non-finite value on either side is an infinite error: `f64::max` would drop a NaN.
    let magnitude = want.iter().fold(floor, |m, x| m.max(x.abs()));
    got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f64, |worst, d| if d.is_finite() { worst.max(d) } else { f64::INFINITY }) / magnitude
}

fn largest(values: &[f64]) -> f64 {
    values.iter().fold(0.0, |m, x| m.max(x.abs()))
}

fn check(case: Case) {
    let Some(device) = device() else { return };
    if !supports(&device, case.dtype) {
        eprintln!("SKIPPED {case:?}: the device has no {:?}", case.dtype);
        return;
    }
    let q = values(case.q_shape().iter().product(), 1, case.dtype);
    let k = values(case.k_shape().iter().product(), 2, case.dtype);
    let v = values(case.v_shape().iter().product(), 3, case.dtype);
    let g = values(case.o_shape().iter().product(), 4, case.dtype);
    let want = reference(&case, &q, &k, &v, &g);

    let options = FlashOptions { scale: case.scale, causal: case.causal };
    let engine = engine_of(&case, &device, &options);
    let ranges = case.ranges();
    let upload4 = |x: &[f64], shape| upload(x, shape, case.dtype, &device);
    let (output, lse) =
        flash_attention_forward(upload4(&q, case.q_shape()), upload4(&k, case.k_shape()), upload4(&v, case.v_shape()), options, ranges.as_ref()).unwrap();
    let (dq, dk, dv) = flash_attention_backward(
        upload4(&q, case.q_shape()),
        upload4(&k, case.k_shape()),
        upload4(&v, case.v_shape()),
        output.clone(),
        upload4(&g, case.o_shape()),
        lse.clone(),
        options,
        ranges.as_ref(),
    )
    .unwrap();

    let lse_got = download::<3>(lse);
    assert_eq!(lse_got.len(), want.lse.len(), "{case:?}: the log-sum-exp has another length than the reference's");
    for (got, want) in lse_got.iter().zip(&want.lse) {
        assert!(want.is_some() || *got <= -1e29, "{case:?}: a row without keys must get the -1e30 log-sum-exp, got {got}");
    }
    let (lse_got, lse_want): (Vec<f64>, Vec<f64>) =
        lse_got.iter().zip(&want.lse).filter_map(|(got, want)| want.map(|w| (*got, w))).unzip();
    // dQ and dK are sums of scale · P·(dP − D) · K (or Q) terms, and dP − D cancels: to zero
    // where a row sees one key (P = 1, dP = D). Their error is relative to one such term's size,
    // not to a result that cancelled (TF32's dP, rounded to 10 bits, leaves ~1e-4 there).
    let term = case.scale() * largest(&g) * largest(&v) * largest(&q).max(largest(&k));
    let errors = [
        ("output", relative_error(&download::<4>(output), &want.output)),
        ("lse", relative_error(&lse_got, &lse_want)),
        ("dq", relative_error_above(&download::<4>(dq), &want.dq, term)),
        ("dk", relative_error_above(&download::<4>(dk), &want.dk, term)),
        ("dv", relative_error(&download::<4>(dv), &want.dv)),
    ];
    println!("{case:?} on {engine}: relative max |Δ| {}", errors.iter().map(|(n, e)| format!("{n} {e:.1e}")).collect::<Vec<_>>().join(", "));
    let tolerance = case.tolerance(&engine);
    for (name, error) in errors {
        assert!(error <= tolerance, "{case:?} on {engine}: {name} differs from the f64 reference by {error:e} (tolerance {tolerance:e})");
    }
}

/// The engine the kernels run `case` on (`register-fragments`, or the plan's: `plane`,
/// `tensor-cores-F` for F³ fragments, `tensor-cores-tf32`),
/// checked against `ULYSSES_EXPECT_ENGINE` for f16 and bf16 cases.
fn engine_of(case: &Case, device: &Device, options: &FlashOptions) -> String {
    let client = <Runtime as cubecl::Runtime>::client(device);
    let (q, k, v) = (case.q_shape(), case.k_shape(), case.v_shape());
    let dtype = case.dtype;
    let (q, k, v) = (OperandInfo { shape: &q, dtype }, OperandInfo { shape: &k, dtype }, OperandInfo { shape: &v, dtype });
    let plan = plan_flash_attention(&client, q, k, v, options).expect("the case is accepted");
    // Where the device runs `mma.sync` (CUDA), f16 and bf16 at head dims 64, 128 and 256 run on
    // the register fragments, not on the plan's engine.
    let engine = if runs_on_fragments(&client, q, k, v, options).expect("the case is accepted") { "register-fragments".to_string() } else { plan.engine.to_string() };
    if let Ok(expected) = std::env::var("ULYSSES_EXPECT_ENGINE")
        && matches!(case.dtype, DType::F16 | DType::BF16)
    {
        assert_eq!(engine, expected, "{case:?} must run on the engine ULYSSES_EXPECT_ENGINE names");
    }
    engine
}

// Each (dtype, head dim, value dim, causal) is one set of compiled kernels (a software
// Vulkan driver takes seconds per kernel), so the cases share them where they can.

#[test]
fn f32_causal_head_dim_64_grouped_query_ratios_1_and_2() {
    check(Case::new(4, 4, 37, 64, true));
    check(Case::new(4, 2, 37, 64, true));
}

/// A NaN in a key (or a query) makes every row that sees that key (or that query's row) NaN,
/// as burn's attention on one device does; a kernel that took a NaN score for a masked one
/// gave finite outputs that left the key out (and zeros for the query's row), silently. Rows
/// that do not see the key match the f64 reference. Causal, head dim 64: f32 (the kernels of
/// the first case) and bf16 (on CUDA the register-fragment kernel, whose exponent is
/// compiled for no NaN: this says whether one still comes out).
#[test]
fn a_nan_reaches_every_row_that_sees_it_as_on_one_device() {
    for dtype in [DType::F32, DType::BF16] {
        nan_reaches_every_row_that_sees_it(dtype);
    }
}

fn nan_reaches_every_row_that_sees_it(dtype: DType) {
    let Some(device) = device() else { return };
    if !supports(&device, dtype) {
        eprintln!("SKIPPED the NaN case in {dtype:?}: the device has no {dtype:?}");
        return;
    }
    let case = Case { dtype, ..Case::new(4, 2, 37, 64, true) };
    let (nan_key, nan_query) = (9, 20);
    let mut q = values(case.q_shape().iter().product(), 1, case.dtype);
    let mut k = values(case.k_shape().iter().product(), 2, case.dtype);
    let v = values(case.v_shape().iter().product(), 3, case.dtype);
    // Batch 0's kv head 0 (query heads 0 and 1): one element of key 9; batch 1's query head 3:
    // one element of row 20.
    k[nan_key * case.head_dim + 5] = f64::NAN;
    q[((case.q_heads + 3) * case.seq_q + nan_query) * case.head_dim + 7] = f64::NAN;
    let want = reference(&case, &q, &k, &v, &values(case.o_shape().iter().product(), 4, case.dtype));
    let options = FlashOptions { scale: case.scale, causal: case.causal };
    let tolerance = case.tolerance(&engine_of(&case, &device, &options));
    let upload4 = |x: &[f64], shape| upload(x, shape, case.dtype, &device);
    let (output, _) = flash_attention_forward(upload4(&q, case.q_shape()), upload4(&k, case.k_shape()), upload4(&v, case.v_shape()), options, None).unwrap();
    let got = download::<4>(output);
    let mut nan_rows = 0;
    for (row, (got, want)) in got.chunks(case.value_dim).zip(want.output.chunks(case.value_dim)).enumerate() {
        let (b, h, i) = (row / (case.q_heads * case.seq_q), row / case.seq_q % case.q_heads, row % case.seq_q);
        let sees_nan = (b == 0 && h < 2 && i >= nan_key) || (b == 1 && h == 3 && i == nan_query);
        assert_eq!(want.iter().all(|x| x.is_nan()), sees_nan, "the reference: batch {b} head {h} row {i}");
        if sees_nan {
            nan_rows += 1;
            assert!(got.iter().all(|x| x.is_nan()), "{dtype:?}: batch {b} head {h} row {i} sees a NaN, yet the kernel gave {:?}", &got[..4]);
        } else {
            let error = relative_error(got, want);
            assert!(error <= tolerance, "{dtype:?}: batch {b} head {h} row {i} sees no NaN: {error:e} from the f64 reference");
        }
    }
    assert_eq!(nan_rows, 2 * (case.seq_q - nan_key) + 1);
}

#[test]
fn f32_causal_unequal_lengths_aligned_bottom_right() {
    // More keys than queries, and more queries than keys (early rows see no key).
    check(Case { seq_q: 20, seq_kv: 45, ..Case::new(4, 2, 20, 64, true) });
    check(Case { seq_q: 45, seq_kv: 20, ..Case::new(2, 1, 45, 64, true) });
    // Several query tiles, more queries than keys: the dK/dV kernel starts late.
    check(Case { seq_q: 150, seq_kv: 70, ..Case::new(2, 1, 150, 64, true) });
}

#[test]
fn f32_causal_a_custom_scale() {
    check(Case { scale: Some(0.3), ..Case::new(2, 2, 21, 64, true) });
}

#[test]
fn f32_non_causal_grouped_query_ratio_4_and_multi_head() {
    check(Case::new(8, 2, 29, 64, false));
    check(Case::new(4, 4, 37, 64, false));
}

#[test]
fn f32_causal_head_dim_128() {
    check(Case::new(2, 1, 19, 128, true));
}

#[test]
fn f32_non_causal_head_dim_256() {
    check(Case::new(2, 2, 17, 256, false));
}

#[test]
fn f32_odd_head_dim_and_a_shorter_value_dim() {
    // Neither is a multiple of the 16-wide tiles: the padding must read as zeros.
    check(Case { value_dim: 24, ..Case::new(4, 1, 33, 40, true) });
}

#[test]
fn f32_one_row_and_a_grid_wider_than_65535_cubes() {
    check(Case { seq_q: 1, seq_kv: 1, ..Case::new(2, 1, 1, 16, true) });
    // 70 000 (batch, head) pairs of one row: the grid must spill into its Y dimension.
    check(Case { batch: 1, ..Case::new(70_000, 70_000, 1, 16, true) });
}

#[test]
fn f32_causal_4096_tokens() {
    // Head dim 16, which the one-row case compiled already. Longer sequences do not fit the
    // CPU driver: lavapipe stops every invocation after 65 535 loop iterations in total
    // (Mesa's loop limiter), silently, and a key block's dK/dV loop runs over every query
    // tile. Real devices have no such limit.
    check(Case { batch: 1, ..Case::new(2, 2, 4096, 16, true) });
}

#[test]
fn f16_causal_head_dim_64_grouped_query() {
    check(Case { dtype: DType::F16, ..Case::new(4, 2, 37, 64, true) });
}

#[test]
fn f16_non_causal_head_dim_128() {
    check(Case { dtype: DType::F16, ..Case::new(4, 1, 45, 128, false) });
}

#[test]
fn f16_causal_head_dim_256() {
    check(Case { dtype: DType::F16, ..Case::new(2, 2, 23, 256, true) });
}

#[test]
fn f16_non_causal_odd_head_dim() {
    check(Case { dtype: DType::F16, seq_kv: 26, ..Case::new(4, 2, 31, 40, false) });
}

#[test]
fn bf16_causal_grouped_query() {
    check(Case { dtype: DType::BF16, ..Case::new(4, 2, 37, 64, true) });
}

// Documents and key padding: per sequence, runs of visible keys. Sequences of 150 tokens span
// several query and key tiles, so whole tiles are skipped and crossing ones masked; lengths
// are no multiple of 16.

#[test]
fn f32_causal_documents_one_two_and_five_per_sequence_grouped_query() {
    let case = |documents: Vec<Vec<usize>>| Case { documents: Some(documents), ..Case::new(4, 2, 150, 64, true) };
    check(case(vec![vec![150], vec![37, 113]]));
    check(case(vec![vec![20, 33, 1, 64, 32], vec![149, 1]]));
}

#[test]
fn f32_non_causal_documents_block_diagonal() {
    check(Case { documents: Some(vec![vec![70, 80], vec![5, 17, 100, 3, 25]]), ..Case::new(4, 1, 150, 64, false) });
}

#[test]
fn f32_key_padding_alone_and_with_documents() {
    // Right padding, and left padding (the run starts late); non-causal so every row sees
    // the run; a sequence whose keys are all padding gets zeros and the -1e30 log-sum-exp.
    check(Case { key_runs: Some(vec![0..101, 30..150]), ..Case::new(2, 2, 150, 64, false) });
    check(Case { key_runs: Some(vec![0..0, 0..7]), ..Case::new(2, 2, 40, 64, false) });
    check(Case { key_runs: Some(vec![0..120, 0..150]), documents: Some(vec![vec![60, 90], vec![150]]), ..Case::new(2, 2, 150, 64, true) });
}

#[test]
fn f32_sliding_window_alone_and_within_documents() {
    // Windows of 40 over 150 tokens: every query tile holds rows whose runs start in different
    // key tiles (a band), so tiles are skipped before the window, masked where it crosses them,
    // and the union of a cube's rows is no single row's run. A document shorter than the
    // window sees all of itself.
    check(Case { window: Some(40), ..Case::new(4, 2, 150, 64, true) });
    check(Case { window: Some(17), documents: Some(vec![vec![100, 50], vec![9, 141]]), ..Case::new(4, 2, 150, 64, true) });
}

#[test]
fn f16_causal_documents() {
    check(Case { dtype: DType::F16, documents: Some(vec![vec![50, 45, 55], vec![3, 147]]), ..Case::new(4, 2, 150, 64, true) });
}

#[test]
fn f32_causal_documents_over_4096_tokens() {
    // Head dim 16, as the 4096-token case.
    check(Case { batch: 1, documents: Some(vec![vec![1000, 96, 2999, 1]]), ..Case::new(2, 2, 4096, 16, true) });
}

/// Greedy list scheduling, as a GPU starts blocks in grid order as others end: the time
/// `slots` resident blocks take for blocks of `work`, in that order.
fn makespan(work: &[usize], slots: usize) -> usize {
    let mut ends = std::collections::BinaryHeap::new();
    for _ in 0..slots {
        ends.push(std::cmp::Reverse(0));
    }
    for &w in work {
        let std::cmp::Reverse(free) = ends.pop().unwrap();
        ends.push(std::cmp::Reverse(free + w));
    }
    ends.into_iter().map(|std::cmp::Reverse(end)| end).max().unwrap()
}

/// The flash-attention kernels' cube order (`testing::block_order`, the kernels' own
/// `flash::stage::cube_place`): every block exactly once; not causal, head by head; causal, the
/// heads in groups of `LONGEST_FIRST_BLOCKS` (512) blocks or more (the last one fewer), and within
/// a group by decreasing work, a block of each head in turn (query blocks' work grows with their
/// place, key blocks' shrinks). And what it is for: on a model of the scheduler (264 blocks at
/// once: an H100's 132 SMs, two each) 16 heads of 128 query blocks keep the SMs ≥ 98% busy
/// where the plain order keeps them < 90%.
#[test]
fn causal_blocks_start_longest_first() {
    use ulysses_kernels::testing::block_order;
    let Some(device) = device() else { return };
    let shapes = [(1, 16, 128), (2, 5, 100), (3, 7, 1), (1, 600, 1), (2, 3, 700), (1, 1, 5)];
    for (batch, heads, blocks) in shapes {
        for causal in [false, true] {
            for work_grows in [true, false] {
                let places = download::<2>(block_order::<Runtime>(&device, batch, heads, blocks, causal, work_grows).unwrap());
                let places: Vec<(usize, usize)> = places.chunks(3).map(|p| (p[0] as usize * heads + p[1] as usize, p[2] as usize)).collect();
                let work = |block: usize| if work_grows { block + 1 } else { blocks - block };
                // The expected order, by sorting: groups of whole heads, in each by work, longest
                // first, then head.
                let batch_heads = batch * heads;
                let group = if causal { 512usize.div_ceil(blocks).min(batch_heads) } else { 1 };
                let mut want = Vec::new();
                for first in (0..batch_heads).step_by(group) {
                    let mut cubes: Vec<(usize, usize)> = (first..(first + group).min(batch_heads)).flat_map(|head| (0..blocks).map(move |block| (head, block))).collect();
                    if causal {
                        cubes.sort_by_key(|&(head, block)| (std::cmp::Reverse(work(block)), head));
                    }
                    want.extend(cubes);
                }
                let first_wrong = places.iter().zip(&want).position(|(got, want)| got != want);
                assert!(
                    places.len() == want.len() && first_wrong.is_none(),
                    "batch {batch}, heads {heads}, {blocks} blocks a head, causal {causal}, work grows {work_grows}: {} cubes for {} blocks; cube {first_wrong:?} is (head, block) {:?}, not {:?}",
                    places.len(),
                    want.len(),
                    first_wrong.map(|i| places[i]),
                    first_wrong.map(|i| want[i]),
                );
            }
        }
    }
    let places = download::<2>(block_order::<Runtime>(&device, 1, 16, 128, true, true).unwrap());
    let ordered: Vec<usize> = places.chunks(3).map(|p| p[2] as usize + 1).collect();
    let plain: Vec<usize> = (0..16).flat_map(|_| 1..=128).collect();
    let busy = |work: &[usize]| work.iter().sum::<usize>() as f64 / (264 * makespan(work, 264)) as f64;
    println!("16 heads of 128 causal query blocks, 264 at once: SMs busy {:.3} ordered, {:.3} in head order", busy(&ordered), busy(&plain));
    assert!(busy(&ordered) >= 0.98 && busy(&plain) < 0.9, "ordered {}, plain {}", busy(&ordered), busy(&plain));
}

#[test]
fn ranges_for_another_shape_are_refused() {
    let Some(device) = device() else { return };
    let tensor = |shape: [usize; 4]| upload(&vec![0.0; shape.iter().product()], shape, DType::F32, &device);
    let ranges = VisibleRanges::all(1, 8, 8).unwrap();
    let error = flash_attention_forward(tensor([1, 2, 9, 16]), tensor([1, 2, 9, 16]), tensor([1, 2, 9, 16]), FlashOptions { scale: None, causal: true }, Some(&ranges))
        .map(|_| ())
        .unwrap_err();
    assert!(error.to_string().contains("built for"), "{error}");
}

#[test]
fn bad_inputs_are_refused_with_a_reason() {
    let Some(device) = device() else { return };
    let tensor = |shape: [usize; 4], dtype| upload(&vec![0.0; shape.iter().product()], shape, dtype, &device);
    let options = FlashOptions { scale: None, causal: true };
    let forward = |q, k, v| flash_attention_forward(q, k, v, options, None).map(|_| ()).unwrap_err();

    let err = forward(tensor([1, 2, 4, 300], DType::F32), tensor([1, 2, 4, 300], DType::F32), tensor([1, 2, 4, 300], DType::F32));
    assert!(matches!(err, FlashError::HeadDim { dim: 300, .. }), "{err}");
    let err = forward(tensor([1, 2, 4, 8], DType::F32), tensor([1, 2, 4, 16], DType::F32), tensor([1, 2, 4, 8], DType::F32));
    assert!(err.to_string().contains("k must have q's head dim"), "{err}");
    let err = forward(tensor([1, 3, 4, 8], DType::F32), tensor([1, 2, 4, 8], DType::F32), tensor([1, 2, 4, 8], DType::F32));
    assert!(err.to_string().contains("kv heads (2) must divide q heads (3)"), "{err}");
    let err = forward(tensor([1, 2, 4, 8], DType::F32), tensor([1, 2, 4, 8], DType::F32), tensor([1, 2, 5, 8], DType::F32));
    assert!(err.to_string().contains("kv_seq"), "{err}");
    let err = forward(tensor([1, 2, 4, 8], DType::F32), tensor([1, 2, 4, 8], DType::F16), tensor([1, 2, 4, 8], DType::F32));
    assert!(matches!(err, FlashError::DType { name: "k", .. }), "{err}");
    // A scale that is no finite f32 (NaN masked every score: the output was zeros).
    for scale in [f64::NAN, f64::INFINITY, 1e39] {
        let t = || tensor([1, 2, 4, 8], DType::F32);
        let err = flash_attention_forward(t(), t(), t(), FlashOptions { scale: Some(scale), causal: true }, None).map(|_| ()).unwrap_err();
        assert!(err.to_string().contains("is not a finite f32 number"), "{scale}: {err}");
    }
    if !supports(&device, DType::BF16) {
        let bf16 = || tensor([1, 2, 4, 8], DType::F32);
        // Uploaded as f32 and cast on the host side of the check: the device has no bf16.
        let err = flash_attention_forward(cast(bf16(), DType::BF16), cast(bf16(), DType::BF16), cast(bf16(), DType::BF16), options, None);
        assert!(matches!(err, Err(FlashError::DType { dtype: DType::BF16, .. })), "a device without bf16 must refuse it");
    }
}

/// Relabels a tensor's dtype without touching the device (enough for the host-side check).
fn cast(mut tensor: burn_cubecl::tensor::CubeTensor<Runtime>, dtype: DType) -> burn_cubecl::tensor::CubeTensor<Runtime> {
    tensor.dtype = dtype;
    tensor
}

/// For the GPU run: 1 × 32 heads × 1.1M tokens × 128 in bf16, so q, the output, dO and dQ hold
/// 4.5e9 elements each, past 2^32 (32-bit offsets would wrap); 8 kv heads; documents of 4 096
/// tokens (linear cost, about 45 GB on the device). The reference is chunked: each document
/// attends only within itself, so a document of one kv head's group, run alone as a small
/// call (32-bit indices, the path the f64 tests check), must give the same output and
/// gradients as the big call gives it. Checked where offsets pass 2^32 (the last group's last
/// documents, one of them shorter than a tile multiple) and at the start; that shorter one
/// against the f64 reference as well.
#[cfg(feature = "cuda")]
#[test]
fn bf16_past_2_pow_32_elements_per_tensor_against_chunks() {
    use burn::tensor::{Distribution, backend::Backend};
    use ulysses_kernels::{flash_attention_backward_planned, flash_attention_forward_planned};
    let Some(device) = device() else { return };
    let (heads, kv_heads, seq, dim, document) = (32usize, 8usize, 1_100_000usize, 128usize, 4096usize);
    let group = heads / kv_heads;
    assert!(heads * seq * dim > u32::MAX as usize);
    let random = |heads: usize, seed: u64| {
        B::seed(&device, seed);
        // Drawn in f32 on the device, kept in bf16 (the f32 draft is dropped at once).
        Tensor::<B, 4>::random([1, heads, seq, dim], Distribution::Uniform(-1.0, 1.0), &device).cast(DType::BF16)
    };
    let (q, k, v, g) = (random(heads, 1), random(kv_heads, 2), random(kv_heads, 3), random(heads, 4));
    let mut lengths = vec![document; seq / document];
    lengths.push(seq % document);
    let ranges = VisibleRanges::all(1, seq, seq).unwrap().with_documents(&[lengths]).unwrap();
    let options = FlashOptions { scale: None, causal: true };
    let prim = |t: &Tensor<B, 4>| t.clone().into_primitive().tensor();
    // The planned engine on both sides: past 2^31 elements the calls choose it (the
    // fragments' 64-bit layout has not run on a GPU yet), and the chunks must not compare
    // another engine's rounding against it.
    let (output, lse) = flash_attention_forward_planned(prim(&q), prim(&k), prim(&v), options, Some(&ranges)).unwrap();
    let (dq, dk, dv) = flash_attention_backward_planned(prim(&q), prim(&k), prim(&v), output.clone(), prim(&g), lse, options, Some(&ranges)).unwrap();
    let big = |t: burn_cubecl::tensor::CubeTensor<Runtime>| Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(t));
    let (output, dq, dk, dv) = (big(output), big(dq), big(dk), big(dv));

    let last_full = (seq / document - 1) * document;
    for (kv_head, rows) in [(kv_heads - 1, last_full..last_full + document), (kv_heads - 1, last_full + document..seq), (0, 0..document)] {
        let q_heads = kv_head * group..(kv_head + 1) * group;
        let kv = kv_head..kv_head + 1;
        let chunk = |t: &Tensor<B, 4>, heads: std::ops::Range<usize>| t.clone().slice([0..1, heads, rows.clone(), 0..dim]);
        let (cq, ck, cv, cg) = (chunk(&q, q_heads.clone()), chunk(&k, kv.clone()), chunk(&v, kv.clone()), chunk(&g, q_heads.clone()));
        let (c_out, c_lse) = flash_attention_forward_planned(prim(&cq), prim(&ck), prim(&cv), options, None).unwrap();
        let (c_dq, c_dk, c_dv) = flash_attention_backward_planned(prim(&cq), prim(&ck), prim(&cv), c_out.clone(), prim(&cg), c_lse, options, None).unwrap();
        let host = |t: Tensor<B, 4>| t.into_data().convert::<f64>().to_vec::<f64>().unwrap();
        let first_offset = ((q_heads.start * seq + rows.start) * dim) as f64;
        for (name, got, want) in [
            ("output", chunk(&output, q_heads.clone()), big(c_out)),
            ("dq", chunk(&dq, q_heads.clone()), big(c_dq)),
            ("dk", chunk(&dk, kv.clone()), big(c_dk)),
            ("dv", chunk(&dv, kv.clone()), big(c_dv)),
        ] {
            let error = relative_error(&host(got), &host(want));
            println!("rows {rows:?} of kv head {kv_head} (q offsets from {first_offset:.2e}): {name} differs from the chunk by {error:.1e}");
            assert!(error <= 5e-3, "{name} of rows {rows:?}, kv head {kv_head}: {error:e} against the chunked reference");
        }
        // The chunks run the same kernels: a fault both calls shared would pass above. The
        // short last document (no multiple of a tile, offsets past 2^32) is checked against
        // the f64 reference too (4 heads × 2 272 rows: seconds on the host).
        if rows.len() < document {
            let case = Case { batch: 1, dtype: DType::BF16, ..Case::new(group, 1, rows.len(), dim, true) };
            let (hq, hk, hv, hg) = (host(cq.clone()), host(ck.clone()), host(cv.clone()), host(cg.clone()));
            let want = reference(&case, &hq, &hk, &hv, &hg);
            // dQ and dK relative to one term's size, as `check` measures them.
            let term = case.scale() * largest(&hg) * largest(&hv) * largest(&hq).max(largest(&hk));
            let tolerance = case.tolerance("planned");
            for (name, got, want, floor) in [
                ("output", chunk(&output, q_heads.clone()), &want.output, 1e-3),
                ("dq", chunk(&dq, q_heads.clone()), &want.dq, term),
                ("dk", chunk(&dk, kv.clone()), &want.dk, term),
                ("dv", chunk(&dv, kv.clone()), &want.dv, 1e-3),
            ] {
                let error = relative_error_above(&host(got), want, floor);
                println!("rows {rows:?} of kv head {kv_head}: {name} differs from the f64 reference by {error:.1e}");
                assert!(error <= tolerance, "{name} of rows {rows:?}, kv head {kv_head}: {error:e} against the f64 reference (tolerance {tolerance:e})");
            }
        }
    }
}
