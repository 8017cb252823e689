//! The fused cross-entropy kernel against the same loss computed in f64 on the host: each
//! row's `lse(x) − x[label]` and the gradient `softmax(x) − one_hot(label)`, zero on ignored
//! rows. Vocabularies from 1 to 70 000 (past the 256 columns one pass of a cube covers, and
//! not a multiple of it), logits spread over ±40 and rows of huge logits (an exponential of
//! them would overflow), labels at both ends of the vocabulary, ignored rows; f32, f16 and
//! bf16 logits (inputs rounded before the reference sees them).
//!
//! Tolerances, in units of a row's scale `1 + max |x|` (f32 rounds `x − lse` to the ulp of the
//! largest logit, 1.2e-7 of it): the loss and the gradient within 2.5e-7 of it (two ulps), the
//! gradient past the storage type's rounding of values up to 1 in f16 (1e-3) and bf16 (8e-3).
//!
//! On the CPU through wgpu and lavapipe, as the flash-attention tests.

use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};
use burn_cubecl::CubeBackend;
use ulysses_kernels::{CrossEntropyError, cross_entropy::launches, fused_cross_entropy, testing::{runtime_available, supports_dtype, uniform_values}};

#[cfg(feature = "cuda")]
type Runtime = cubecl::cuda::CudaRuntime;
#[cfg(not(feature = "cuda"))]
type Runtime = cubecl::wgpu::WgpuRuntime;

type B = CubeBackend<Runtime, f32, i32, u32>;
type Device = <Runtime as cubecl::Runtime>::Device;

const IGNORE: i64 = -100;

fn device() -> Option<Device> {
    runtime_available::<Runtime>().then(Device::default)
}

/// Deterministic values in `-spread..spread`.
fn values(count: usize, seed: u64, spread: f64) -> Vec<f64> {
    uniform_values(count, seed).into_iter().map(|x| x * spread).collect()
}

/// Per row: the loss and the gradient row, in f64.
fn reference(logits: &[f64], labels: &[i64], vocab: usize) -> (Vec<f64>, Vec<f64>) {
    let (mut losses, mut grads) = (vec![], vec![]);
    for (row, &label) in logits.chunks(vocab).zip(labels) {
        let high = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = high + row.iter().map(|x| (x - high).exp()).sum::<f64>().ln();
        let counted = label != IGNORE;
        losses.push(if counted { lse - row[label as usize] } else { 0.0 });
        grads.extend(row.iter().enumerate().map(|(c, x)| if counted { (x - lse).exp() - f64::from(c as i64 == label) } else { 0.0 }));
    }
    (losses, grads)
}

fn float_data(tensor: burn_cubecl::tensor::CubeTensor<Runtime>) -> Vec<f64> {
    let tensor = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(tensor));
    let count = tensor.shape().num_elements();
    tensor.reshape([count]).cast(DType::F32).into_data().to_vec::<f32>().unwrap().into_iter().map(f64::from).collect()
}

/// Runs the kernel on `logits` (rounded to `dtype`) and checks it against the f64 reference.
fn check(device: &Device, rows: usize, vocab: usize, dtype: DType, seed: u64) {
    let mut logits = values(rows * vocab, seed, 40.0);
    // The last row's logits are huge: exp(x) overflows f32, exp(x − max) does not.
    if rows > 2 {
        logits[(rows - 1) * vocab..].iter_mut().for_each(|x| *x += 1.0e4);
    }
    let labels: Vec<i64> = (0..rows).map(|r| match r % 4 { 0 => 0, 1 => vocab as i64 - 1, 2 => IGNORE, _ => (r * 7919 % vocab) as i64 }).collect();
    let input = Tensor::<B, 2>::from_data(TensorData::new(logits.iter().map(|&x| x as f32).collect::<Vec<_>>(), [rows, vocab]), device).cast(dtype);
    // What the kernel sees, rounded to the dtype, is what the reference gets.
    let rounded: Vec<f64> = input.clone().cast(DType::F32).into_data().to_vec::<f32>().unwrap().into_iter().map(f64::from).collect();
    let label_tensor = Tensor::<B, 1>::from_data(TensorData::new(labels.iter().map(|&l| l as f32).collect::<Vec<_>>(), [rows]), device);
    let before = launches();
    let (losses, grads) = fused_cross_entropy(input.into_primitive().tensor(), label_tensor.into_primitive().tensor(), IGNORE).unwrap();
    assert_eq!(launches(), before + 1, "the kernel ran once");
    let grad_dtype = grads.dtype;
    let (losses, grads) = (float_data(losses), float_data(grads));
    let (want_losses, want_grads) = reference(&rounded, &labels, vocab);
    // f32 rounds `x − lse` to the ulp of the row's largest logit: errors are measured in units
    // of that row's scale, `1 + max |x|` (1e4 in the row of huge logits).
    let scale: Vec<f64> = rounded.chunks(vocab).map(|row| 1.0 + row.iter().fold(0.0f64, |m, x| m.max(x.abs()))).collect();
    // A half-precision gradient is rounded to its dtype: relative to each value (probabilities
    // are ~1e-3 at 70 000 words, below any absolute allowance sized for 1), down to f16's
    // subnormal step.
    let (grad_relative, grad_floor) = match dtype {
        DType::F16 => (1e-3, 6e-8),
        DType::BF16 => (4e-3, 0.0),
        _ => (0.0, 0.0),
    };
    let loss_error = losses.iter().zip(&want_losses).enumerate().map(|(r, (a, b))| (a - b).abs() / scale[r]).fold(0.0, f64::max);
    let grad_error = grads.iter().zip(&want_grads).enumerate().map(|(i, (a, b))| ((a - b).abs() - grad_relative * b.abs() - grad_floor).max(0.0) / scale[i / vocab]).fold(0.0, f64::max);
    println!("{rows} x {vocab} {dtype:?}: loss {loss_error:.1e}, gradient {grad_error:.1e}");
    assert_eq!(grad_dtype, dtype, "the gradient keeps the logits' dtype");
    assert!(losses.iter().chain(&grads).all(|v| v.is_finite()), "{rows} x {vocab} {dtype:?}: a value is not finite");
    assert!(loss_error <= 2.5e-7, "{rows} x {vocab} {dtype:?}: loss off by {loss_error:e} of its row's scale");
    assert!(grad_error <= 2.5e-7, "{rows} x {vocab} {dtype:?}: gradient off by {grad_error:e} of its row's scale, past the dtype's rounding");
}

fn supports(device: &Device, dtype: DType) -> bool {
    supports_dtype::<Runtime>(device, dtype)
}

#[test]
fn rows_of_logits_give_the_f64_loss_and_gradient() {
    let Some(device) = device() else { return };
    for (rows, vocab) in [(1, 1), (5, 7), (4, 256), (9, 1000), (64, 5003), (3, 70_000)] {
        check(&device, rows, vocab, DType::F32, (rows * vocab) as u64);
    }
    for dtype in [DType::F16, DType::BF16] {
        if supports(&device, dtype) {
            check(&device, 9, 1000, dtype, 5);
            // Four rows: the last, of huge logits, is counted (row 2's label is ignored).
            check(&device, 4, 70_000, dtype, 6);
        } else {
            println!("{dtype:?}: not supported by this device, skipped");
        }
    }
}

#[test]
fn a_label_outside_the_vocabulary_gives_an_infinite_loss_and_bad_shapes_are_refused() {
    let Some(device) = device() else { return };
    let logits = || Tensor::<B, 2>::from_data(TensorData::new(vec![0.5f32, 1.0, -2.0, 0.0, 3.0, 1.0], [2, 3]), &device).into_primitive().tensor();
    let labels = |ids: Vec<f32>| Tensor::<B, 1>::from_data(TensorData::new(ids.clone(), [ids.len()]), &device).into_primitive().tensor();
    let (losses, _) = fused_cross_entropy(logits(), labels(vec![1.0, 3.0]), IGNORE).unwrap();
    let losses = float_data(losses);
    assert!(losses[0].is_finite() && losses[1].is_infinite(), "label 3 of 3 classes must give an infinite loss: {losses:?}");
    let error = fused_cross_entropy(logits(), labels(vec![1.0, 2.0, 0.0]), IGNORE).unwrap_err();
    assert!(matches!(error, CrossEntropyError::Shape(_)) && error.to_string().contains("labels must be [2]"), "{error}");
    // Logits past 2^31 elements (16 384 rows of Qwen's 151 936 words) need 64-bit indices: taken
    // where the device has them, refused by name where not (decided from the shape: nothing
    // is allocated).
    let client = <Runtime as cubecl::Runtime>::client(&device);
    let checked = ulysses_kernels::check_cross_entropy(&client, (&[16_384, 151_936], DType::BF16), (&[16_384], DType::F32));
    let has_64_bit = client.properties().supports_address(cubecl::ir::AddressType::U64);
    println!("a device with 64-bit indices: {has_64_bit}; 2.5e9 logits: {checked:?}");
    match has_64_bit {
        true => assert!(checked.is_ok(), "{checked:?}"),
        false => assert!(matches!(&checked, Err(CrossEntropyError::Device(message)) if message.contains("no 64-bit indexing")), "{checked:?}"),
    }
}
