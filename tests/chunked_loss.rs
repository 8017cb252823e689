//! The chunked loss (`chunked_linear_cross_entropy_sum`) against burn's autodiff through the
//! whole logits (`masked_cross_entropy_sum` of `hidden · weight + bias`): same value, same
//! gradients of the hidden states, the weight and the bias, for chunks of 1 row to more than
//! all rows, with ignored labels (a chunk of only ignored labels included). On burn's CubeCL
//! backends (wgpu on lavapipe here) the chunks' rows go through the fused cross-entropy kernel
//! (`ulysses_kernels::cross_entropy`), checked against NdArray's whole-logits autodiff, plain
//! and fused (`Fusion<CubeBackend>`, where the kernel is a recorded stream operation).

use burn::{
    backend::{Autodiff, NdArray},
    tensor::{FloatDType, Int, Tensor, TensorData},
};
use burn_ulysses::data::IGNORE_INDEX;
use ulysses_kernels::testing::runtime_available;
use ulysses_training::{OutputHead, TrainBackend, chunked_linear_cross_entropy_sum, masked_cross_entropy_sum};
use ulysses_suite::{max_abs_diff, uniform_tensor, values};

type B = Autodiff<NdArray<f32>>;

const ROWS: usize = 11;
const D_MODEL: usize = 6;
const VOCAB: usize = 9;
/// f32, sums over at most 11 rows reordered.
const TOLERANCE: f32 = 2e-6;

/// Loss, then gradients of hidden, weight and bias, on NdArray.
fn run(chunk_rows: Option<usize>, with_bias: bool) -> [Vec<f32>; 4] {
    run_on::<B>(chunk_rows, with_bias, &Default::default())
}

fn run_on<B: TrainBackend>(chunk_rows: Option<usize>, with_bias: bool, device: &B::Device) -> [Vec<f32>; 4] {
    run_in::<B>(chunk_rows, with_bias, None, device)
}

/// `run_on` with the chunks' logits in `logits_dtype` (`None`: the weight's f32).
fn run_in<B: TrainBackend>(chunk_rows: Option<usize>, with_bias: bool, logits_dtype: Option<FloatDType>, device: &B::Device) -> [Vec<f32>; 4] {
    let device = device.clone();
    let hidden = uniform_tensor::<B, 2>([ROWS, D_MODEL], 1, &device).require_grad();
    let weight = uniform_tensor::<B, 2>([D_MODEL, VOCAB], 2, &device).require_grad();
    let bias = uniform_tensor::<B, 1>([VOCAB], 3, &device).require_grad();
    // Rows 3, 4 and 5 ignored: with chunks of 3 rows, the second chunk has no valid label.
    let labels: Vec<i64> = (0..ROWS as i64).map(|i| if (3..6).contains(&i) { IGNORE_INDEX } else { (i * 5) % VOCAB as i64 }).collect();
    let labels = Tensor::<B, 1, Int>::from_data(TensorData::new(labels, [ROWS]), &device);
    let head_bias = with_bias.then(|| bias.clone());
    let loss = match chunk_rows {
        Some(rows) => {
            let head = OutputHead::new(weight.clone(), head_bias).with_logits_dtype(logits_dtype);
            chunked_linear_cross_entropy_sum(hidden.clone(), head, labels, IGNORE_INDEX, rows)
        }
        None => {
            let mut logits = hidden.clone().matmul(weight.clone());
            if let Some(bias) = head_bias {
                logits = logits + bias.unsqueeze_dim(0);
            }
            masked_cross_entropy_sum(logits.unsqueeze_dim(0), labels.unsqueeze_dim(0), IGNORE_INDEX)
        }
    };
    // A non-unit upstream gradient, as train_step's token weighting gives.
    let grads = (loss.clone() * 0.37).backward();
    let bias_grad = if with_bias { values(bias.grad(&grads).unwrap()) } else { Vec::new() };
    [values(loss), values(hidden.grad(&grads).unwrap()), values(weight.grad(&grads).unwrap()), bias_grad]
}

#[test]
fn chunked_loss_matches_the_whole_logits_loss_and_its_gradients() {
    for with_bias in [false, true] {
        let reference = run(None, with_bias);
        for chunk_rows in [1, 3, 4, ROWS, ROWS + 5] {
            let chunked = run(Some(chunk_rows), with_bias);
            for (name, (got, want)) in ["loss", "d hidden", "d weight", "d bias"].iter().zip(chunked.iter().zip(&reference)) {
                let diff = max_abs_diff(got, want);
                assert!(diff <= TOLERANCE, "{name}, chunks of {chunk_rows}, bias {with_bias}: |Δ| {diff:e}");
            }
        }
        println!("bias {with_bias}: loss {:?}, chunked equal within {TOLERANCE:e}", reference[0]);
    }
}

/// On a CubeCL backend every chunk's rows run in the fused kernel, with the loss and
/// gradients NdArray's whole logits give.
#[test]
fn the_fused_kernel_gives_the_whole_logits_loss_and_its_gradients() {
    type Runtime = cubecl::wgpu::WgpuRuntime;
    type Cube = Autodiff<burn_cubecl::CubeBackend<Runtime, f32, i32, u32>>;
    if !runtime_available::<Runtime>() {
        return;
    }
    let device = Default::default();
    for with_bias in [false, true] {
        let reference = run(None, with_bias);
        for chunk_rows in [1, 3, ROWS] {
            let before = ulysses_kernels::cross_entropy::launches();
            let fused = run_on::<Cube>(Some(chunk_rows), with_bias, &device);
            let launches = ulysses_kernels::cross_entropy::launches() - before;
            assert_eq!(launches as usize, ROWS.div_ceil(chunk_rows), "chunks of {chunk_rows}: one launch per chunk");
            for (name, (got, want)) in ["loss", "d hidden", "d weight", "d bias"].iter().zip(fused.iter().zip(&reference)) {
                let diff = max_abs_diff(got, want);
                assert!(diff <= TOLERANCE, "{name}, chunks of {chunk_rows}, bias {with_bias}: |Δ| {diff:e}");
            }
        }
    }
}

/// On `Fusion<CubeBackend>` (burn's `Wgpu` and `Cuda` types) the kernel is recorded as a
/// custom stream operation: the hook runs it (rather than refusing, which would leave the loss
/// to tensor ops) with the losses and gradient of an f64 reference, and the chunked loss
/// through it equals NdArray's whole logits.
#[test]
fn the_fused_kernel_runs_on_burns_fusion_backend() {
    use burn::tensor::{TensorPrimitive, ops::FloatTensor};
    use burn_ulysses::PlainBackend;
    type Runtime = cubecl::wgpu::WgpuRuntime;
    type Fused = burn_fusion::Fusion<burn_cubecl::CubeBackend<Runtime, f32, i32, u32>>;
    if !runtime_available::<Runtime>() {
        return;
    }
    let device = Default::default();
    let logits = uniform_tensor::<Fused, 2>([ROWS, VOCAB], 4, &device) * 3.0;
    let labels: Vec<f32> = (0..ROWS).map(|i| if i == 2 { IGNORE_INDEX as f32 } else { ((i * 7) % VOCAB) as f32 }).collect();
    let (logit_values, label_values) = (values(logits.clone()), labels.clone());
    let labels = Tensor::<Fused, 1>::from_data(TensorData::new(labels, [ROWS]), &device);
    let primitive = |tensor: FloatTensor<Fused>| values(Tensor::<Fused, 1>::from_primitive(TensorPrimitive::Float(tensor)).flatten::<1>(0, 0));
    let (losses, grads) = <Fused as PlainBackend>::fused_cross_entropy(logits.into_primitive().tensor(), labels.into_primitive().tensor(), IGNORE_INDEX)
        .unwrap_or_else(|reason| panic!("Fusion<CubeBackend> refused the fused cross-entropy: {reason}"));
    let (losses, grads) = (primitive(losses), primitive(grads));
    for row in 0..ROWS {
        let logits = &logit_values[row * VOCAB..(row + 1) * VOCAB];
        let max = logits.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
        let lse = max + logits.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
        let ignored = label_values[row] == IGNORE_INDEX as f32;
        let target = label_values[row] as usize;
        let want_loss = if ignored { 0.0 } else { lse - logits[target] as f64 };
        assert!((losses[row] as f64 - want_loss).abs() <= 1e-5, "row {row}: loss {} against {want_loss}", losses[row]);
        for (c, &x) in logits.iter().enumerate() {
            let want = if ignored { 0.0 } else { (x as f64 - lse).exp() - f64::from(u8::from(c == target)) };
            let got = grads[row * VOCAB + c] as f64;
            assert!((got - want).abs() <= 1e-6, "row {row}, class {c}: gradient {got} against {want}");
        }
    }
    for with_bias in [false, true] {
        let reference = run(None, with_bias);
        let fused = run_on::<Autodiff<Fused>>(Some(3), with_bias, &device);
        for (name, (got, want)) in ["loss", "d hidden", "d weight", "d bias"].iter().zip(fused.iter().zip(&reference)) {
            let diff = max_abs_diff(got, want);
            assert!(diff <= TOLERANCE, "{name}, bias {with_bias}, on Fusion: |Δ| {diff:e}");
        }
    }
}

/// A bf16 model's head: logits in the compute dtype (f16 on lavapipe, which has no bf16), the
/// softmax, loss and gradient sums in f32. Within f16's rounding of the logits and of the
/// gradients' products (inputs of magnitude 1, d_model 6: 4e-3), and not the f32 head's
/// result: the logits are rounded.
#[test]
fn a_half_precision_head_stays_within_its_rounding() {
    type Runtime = cubecl::wgpu::WgpuRuntime;
    type Cube = Autodiff<burn_cubecl::CubeBackend<Runtime, f32, i32, u32>>;
    if !runtime_available::<Runtime>() {
        return;
    }
    let device = Default::default();
    let reference = run(None, true);
    let half = run_in::<Cube>(Some(4), true, Some(FloatDType::F16), &device);
    for (name, (got, want)) in ["loss", "d hidden", "d weight", "d bias"].iter().zip(half.iter().zip(&reference)) {
        let scale = want.iter().fold(1.0f32, |m, x| m.max(x.abs()));
        let diff = max_abs_diff(got, want) / scale;
        println!("{name}: {diff:.1e} of its scale {scale}");
        assert!(diff <= 4e-3, "{name}: |Δ| {diff:e} of its scale with f16 logits");
        if *name == "loss" {
            assert!(diff > 0.0, "f16 logits gave the f32 head's loss exactly: the logits were not computed in f16");
        }
    }
}

/// A half-precision weight (a sharded optimizer's compute copy) gets its gradient summed over
/// the chunks in f32, cast once: the weight gradient's row 0 holds one large part (row 0's
/// hidden state 1000 in a feature that reaches no logit) beside 63 small ones (0.25 each),
/// every one below the running sum's rounding step in f16, as at long context's hundreds of
/// chunks in bf16. Summed in the weight's f16 they were lost (0.69 of a largest 334); in f32,
/// f16's rounding of each part and of the sum remains (0.14), within one f16 step of the
/// largest value (2^-10 of it).
#[test]
fn a_half_precision_weight_sums_its_chunks_gradients_in_f32() {
    type Runtime = cubecl::wgpu::WgpuRuntime;
    type Cube = Autodiff<burn_cubecl::CubeBackend<Runtime, f32, i32, u32>>;
    if !runtime_available::<Runtime>() {
        return;
    }
    const MANY: usize = 64;
    let hidden: Vec<f32> = (0..MANY * D_MODEL)
        .map(|i| match (i / D_MODEL, i % D_MODEL) {
            (0, 0) => 1000.0,
            (_, 0) => 0.25,
            (row, feature) => ((row * 7 + feature * 3) % 8) as f32 / 8.0 - 0.5,
        })
        .collect();
    // Exact in f16 (multiples of 1/64); feature 0's row of zeros.
    let weight: Vec<f32> = (0..D_MODEL * VOCAB).map(|i| if i < VOCAB { 0.0 } else { ((i * 13) % 64) as f32 / 64.0 - 0.5 }).collect();
    let labels: Vec<i64> = (0..MANY as i64).map(|i| (i * 5) % VOCAB as i64).collect();
    fn weight_grad<B: TrainBackend>(hidden: &[f32], weight: &[f32], labels: &[i64], half: bool, device: &B::Device) -> Vec<f32> {
        let hidden = Tensor::<B, 2>::from_data(TensorData::new(hidden.to_vec(), [MANY, D_MODEL]), device).require_grad();
        let mut weight = Tensor::<B, 2>::from_data(TensorData::new(weight.to_vec(), [D_MODEL, VOCAB]), device);
        if half {
            weight = weight.cast(FloatDType::F16).detach();
        }
        let weight = weight.require_grad();
        let labels = Tensor::<B, 1, Int>::from_data(TensorData::new(labels.to_vec(), [MANY]), device);
        let loss = match half {
            true => chunked_linear_cross_entropy_sum(hidden, OutputHead::new(weight.clone(), None), labels, IGNORE_INDEX, 1),
            false => masked_cross_entropy_sum(hidden.matmul(weight.clone()).unsqueeze_dim(0), labels.unsqueeze_dim(0), IGNORE_INDEX),
        };
        values(weight.grad(&(loss * 0.37).backward()).unwrap())
    }
    let want = weight_grad::<B>(&hidden, &weight, &labels, false, &Default::default());
    let got = weight_grad::<Cube>(&hidden, &weight, &labels, true, &Default::default());
    let largest = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let diff = max_abs_diff(&got, &want);
    println!("d weight of an f16 weight over {MANY} chunks: |Δ| {diff:.2e}, its largest {largest:.1}");
    assert!(largest > 100.0 && diff <= largest / 1024.0, "|Δ| {diff:e} of a largest {largest}: the chunks' parts were summed in f16");
}

/// On a backend whose default float is half precision (`CubeBackend<_, f16, ..>`, burn's
/// `Cuda<bf16>`), the chunked loss equals f32's within f16's rounding: its labels reach the
/// fused kernel as f32 exactly (`Int::float()` gave f16, which rounds an odd id past 2048 to its
/// even neighbour: another token's logit, or one past the vocabulary, infinite here), and its
/// sum starts from f32 zeros (f16 ones, added to the rows' f32 losses, read their bytes as f16:
/// 10.38 where the loss is 31.66; the tensor-op path, `ULYSSES_FUSED_CROSS_ENTROPY=0`, -10.38).
#[test]
fn labels_past_halfs_integers_reach_the_kernel_exactly() {
    type Runtime = cubecl::wgpu::WgpuRuntime;
    type Half = Autodiff<burn_cubecl::CubeBackend<Runtime, burn::tensor::f16, i32, u32>>;
    if !runtime_available::<Runtime>() {
        return;
    }
    const WIDE: usize = 2100;
    fn loss<B: TrainBackend>(fused: bool, device: &B::Device) -> f32 {
        let hidden = uniform_tensor::<B, 2>([4, D_MODEL], 4, device).require_grad();
        let weight = uniform_tensor::<B, 2>([D_MODEL, WIDE], 5, device).require_grad();
        let labels = Tensor::<B, 1, Int>::from_data(TensorData::new(vec![2049i64, 2051, 2061, 2099], [4]), device);
        let loss = match fused {
            true => chunked_linear_cross_entropy_sum(hidden, OutputHead::new(weight, None), labels, IGNORE_INDEX, 4),
            false => masked_cross_entropy_sum(hidden.matmul(weight).unsqueeze_dim(0), labels.unsqueeze_dim(0), IGNORE_INDEX),
        };
        values(loss)[0]
    }
    let want = loss::<B>(false, &Default::default());
    let got = loss::<Half>(true, &Default::default());
    println!("4 rows, labels past 2048, f16 backend: loss {got} against f32's {want}");
    assert!((got - want).abs() <= 2e-3 * want.abs(), "loss {got} against {want}: the labels were rounded");
}

/// Evaluation's loss (`linear_cross_entropy_sum`, no gradients, any backend) equals the
/// whole-logits loss on a plain backend.
#[test]
fn evaluation_loss_in_chunks_matches_the_whole_logits_loss() {
    use ulysses_training::linear_cross_entropy_sum;
    type Plain = NdArray<f32>;
    let device = Default::default();
    let hidden = uniform_tensor::<Plain, 2>([ROWS, D_MODEL], 1, &device);
    let weight = uniform_tensor::<Plain, 2>([D_MODEL, VOCAB], 2, &device);
    let labels: Vec<i64> = (0..ROWS as i64).map(|i| if i == 4 { IGNORE_INDEX } else { (i * 7) % VOCAB as i64 }).collect();
    let labels = Tensor::<Plain, 1, Int>::from_data(TensorData::new(labels, [ROWS]), &device);
    let whole = masked_cross_entropy_sum(hidden.clone().matmul(weight.clone()).unsqueeze_dim(0), labels.clone().unsqueeze_dim(0), IGNORE_INDEX);
    for chunk_rows in [1, 2, ROWS] {
        let head = OutputHead::new(weight.clone(), None);
        let chunked = linear_cross_entropy_sum(hidden.clone(), head, labels.clone(), IGNORE_INDEX, chunk_rows);
        let diff = max_abs_diff(&values(chunked), &values(whole.clone()));
        assert!(diff <= TOLERANCE, "chunks of {chunk_rows}: |Δ| {diff:e}");
    }
}

/// The default chunk: a multiple of 64 rows (a tensor-core tile's M and K), at least 64, whose
/// logits hold at most 2^26 values wherever 64 rows do; Llama-3's vocabulary gets 512 rows.
#[test]
fn default_chunks_are_whole_tiles_within_the_logits_budget() {
    use ulysses_training::default_chunk_rows;
    assert_eq!(default_chunk_rows(128_256), 512);
    for vocab in [1, 256, 320, 32_000, 128_256, 151_936, 262_144, 1 << 20, 1 << 21, 1 << 30] {
        let rows = default_chunk_rows(vocab);
        assert!(rows >= 64 && rows % 64 == 0, "vocab {vocab}: {rows} rows, not a positive multiple of 64");
        if 64 * vocab <= 1 << 26 {
            assert!(rows * vocab <= 1 << 26, "vocab {vocab}: {rows} rows hold {} logits, past 2^26", rows * vocab);
            assert!((rows + 64) * vocab > 1 << 26, "vocab {vocab}: {rows} rows, though {} would fit", rows + 64);
        }
    }
}

/// An ignored row adds nothing, whatever its logits: with every label-0 row ignored and class
/// 0's logit -inf (a masked token), the whole-logits loss, the chunked one and evaluation's, and
/// their gradients, are finite and those of -1e30 in its place (exp gives 0 for both in f32).
/// Multiplying an ignored row's -inf log-prob by 0 gave NaN.
#[test]
fn an_ignored_row_whose_label_slot_is_minus_infinity_adds_nothing() {
    use ulysses_training::linear_cross_entropy_sum;
    let device = Default::default();
    let labels: Vec<i64> = (0..ROWS as i64).map(|i| (i * 5) % VOCAB as i64).map(|l| if l == 0 { IGNORE_INDEX } else { l }).collect();
    assert!(labels.contains(&IGNORE_INDEX));
    let labels = Tensor::<B, 1, Int>::from_data(TensorData::new(labels, [ROWS]), &device);
    let run = |class_0: f32, chunk_rows: Option<usize>| {
        let hidden = uniform_tensor::<B, 2>([ROWS, D_MODEL], 1, &device).require_grad();
        let weight = uniform_tensor::<B, 2>([D_MODEL, VOCAB], 2, &device).require_grad();
        let mut bias = values(uniform_tensor::<B, 1>([VOCAB], 3, &device));
        bias[0] = class_0;
        let bias = Tensor::<B, 1>::from_data(TensorData::new(bias, [VOCAB]), &device).require_grad();
        let loss = match chunk_rows {
            Some(rows) => {
                let evaluated = linear_cross_entropy_sum(hidden.clone().inner(), OutputHead::new(weight.clone().inner(), Some(bias.clone().inner())), labels.clone().inner(), IGNORE_INDEX, rows);
                let loss = chunked_linear_cross_entropy_sum(hidden.clone(), OutputHead::new(weight.clone(), Some(bias.clone())), labels.clone(), IGNORE_INDEX, rows);
                assert_eq!(values(evaluated), values(loss.clone()), "evaluation against training, chunks of {rows}");
                loss
            }
            None => masked_cross_entropy_sum((hidden.clone().matmul(weight.clone()) + bias.clone().unsqueeze_dim(0)).unsqueeze_dim(0), labels.clone().unsqueeze_dim(0), IGNORE_INDEX),
        };
        let grads = loss.clone().backward();
        [values(loss), values(hidden.grad(&grads).unwrap()), values(weight.grad(&grads).unwrap()), values(bias.grad(&grads).unwrap())]
    };
    for chunk_rows in [None, Some(1), Some(4)] {
        let (masked, reference) = (run(f32::NEG_INFINITY, chunk_rows), run(-1e30, chunk_rows));
        for (name, (got, want)) in ["loss", "d hidden", "d weight", "d bias"].iter().zip(masked.iter().zip(&reference)) {
            assert!(got.iter().chain(want).all(|v| v.is_finite()), "{name}, chunks {chunk_rows:?}: {got:?} against {want:?}");
            let diff = max_abs_diff(got, want);
            assert!(diff <= TOLERANCE, "{name}, chunks {chunk_rows:?}: |Δ| {diff:e}");
        }
    }
}
