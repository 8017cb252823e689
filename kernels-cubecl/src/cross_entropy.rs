//! Cross-entropy over rows of logits in one kernel: each row's loss and the logits' gradient.
//!
//! The training loss (`ulysses-training`'s chunked loss, after Liger Kernel's fused linear
//! cross-entropy) computes, per chunk of rows, `loss = lse(x) − x[label]` and
//! `d loss / d x = softmax(x) − one_hot(label)`, zero on ignored rows. With tensor ops that is
//! `log_softmax` (a maximum, a subtraction, an exponential, a sum and a logarithm, each a
//! kernel over the chunk), a gather, an exponential again and a scatter: the chunk's logits
//! are read or written about ten times. Here one cube owns a row: it reads the row once for
//! its maximum and sum of exponentials (online, as flash attention does), merges them over
//! its planes, then reads the row again and writes the gradient once.

use burn::tensor::{DType, Shape};
use burn_cubecl::{CubeRuntime, kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor};
use cubecl::prelude::*;

use crate::flash::{grid, stage::cube_index};

/// Planes per cube: 256 units on a 32-lane device, enough to stream a row of 128K logits.
const PLANES: usize = 8;

/// Smaller than any logit: a unit that owns no column leaves its maximum here.
const NO_LOGIT: f32 = -3.0e38;

/// Why the kernel refused a call.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CrossEntropyError {
    #[error("fused cross-entropy: {0}")]
    Shape(String),
    #[error("fused cross-entropy: {0}")]
    Device(String),
}

#[cube(launch, address_type = "dynamic")]
pub(crate) fn cross_entropy_rows_kernel<F: Float>(
    logits: &Tensor<F>,
    labels: &Tensor<f32>,
    losses: &mut Tensor<f32>,
    grads: &mut Tensor<F>,
    ignore_index: f32,
    #[comptime] planes: usize,
    #[define(F)] _dtype: StorageType,
) {
    let rows = logits.shape(0);
    let vocab = logits.shape(1);
    // One cube per row: the condition is the same for every unit of the cube, so the
    // barrier below is reached by all of them or by none.
    let row = cube_index();
    if row < rows {
        let plane_dim = CUBE_DIM_X as usize;
        let plane = UNIT_POS_Y as usize;
        let lane = UNIT_POS_X as usize;
        let unit = plane * plane_dim + lane;
        let units = planes * plane_dim;
        let at = row * logits.stride(0);
        let step = logits.stride(1);

        // Pass 1: this unit's maximum and sum of exp(x − maximum), updated online.
        let mut high = f32::new(NO_LOGIT);
        let mut sum = 0.0f32;
        let mut c = unit;
        while c < vocab {
            let x = f32::cast_from(logits[at + c * step]);
            if x > high {
                sum = sum * (high - x).exp() + 1.0;
                high = x;
            } else {
                sum += (x - high).exp();
            }
            c += units;
        }
        let plane_high = plane_max(high);
        let plane_total = plane_sum(sum * (high - plane_high).exp());
        let mut highs = SharedMemory::<f32>::new(planes);
        let mut sums = SharedMemory::<f32>::new(planes);
        if lane == 0 {
            highs[plane] = plane_high;
            sums[plane] = plane_total;
        }
        sync_cube();
        let mut row_high = highs[0];
        for p in 1..planes {
            row_high = max(row_high, highs[p]);
        }
        let mut row_sum = 0.0f32;
        for p in 0..planes {
            row_sum += sums[p] * (highs[p] - row_high).exp();
        }
        let lse = row_high + row_sum.ln();

        // Pass 2: the gradient, softmax − one_hot(label), zero on an ignored row.
        let label = labels[row * labels.stride(0)];
        let counted = label != ignore_index;
        let in_vocab = label >= 0.0 && label < f32::cast_from(vocab);
        let target = select(in_vocab, usize::cast_from(max(label, 0.0f32)), vocab);
        let out = row * grads.stride(0);
        let out_step = grads.stride(1);
        c = unit;
        while c < vocab {
            let x = f32::cast_from(logits[at + c * step]);
            let hit = select(c == target, 1.0f32, 0.0f32);
            grads[out + c * out_step] = F::cast_from(select(counted, (x - lse).exp() - hit, 0.0f32));
            c += units;
        }
        if unit == 0 {
            // A label outside the vocabulary that is not ignored is a bug upstream: an infinite
            // loss, so the step's non-finite check stops the step and names it. (Overflowed at
            // run time: WGSL has no literal for infinity or NaN, and rejects a shader with one.)
            let picked = f32::cast_from(logits[at + min(target, vocab - 1) * step]);
            let loss = select(in_vocab, lse - picked, f32::new(3.0e38) * (2.0 + row_sum));
            losses[row * losses.stride(0)] = select(counted, loss, 0.0f32);
        }
    }
}

/// Whether [`fused_cross_entropy`] takes logits and labels of these shapes and dtypes on
/// `client`'s device, decided from them alone (backends that record work to run later ask
/// before they record): logits `[rows, vocab]` in f32, f16 or bf16 with 1 to 2^24 − 1 classes,
/// labels `[rows]` f32, and a device with a fixed plane size and 8 planes per cube.
pub fn check_cross_entropy<R: CubeRuntime>(
    client: &ComputeClient<R>,
    (shape, dtype): (&[usize], DType),
    (label_shape, label_dtype): (&[usize], DType),
) -> Result<(), CrossEntropyError> {
    let [rows, vocab] = shape[..] else {
        return Err(CrossEntropyError::Shape(format!("logits must be [rows, vocab], got {shape:?}")));
    };
    if label_shape != [rows] || label_dtype != DType::F32 {
        return Err(CrossEntropyError::Shape(format!("labels must be [{rows}] f32 for logits {shape:?}, got {label_shape:?} {label_dtype:?}")));
    }
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) || vocab == 0 || vocab >= 1 << 24 {
        return Err(CrossEntropyError::Shape(format!("logits {shape:?} {dtype:?}: the kernel takes f32, f16 or bf16 and 1 to 2^24 − 1 classes")));
    }
    // Past 2^31 elements (16 384 rows of a 151 936-word vocabulary) the kernel indexes in 64
    // bits, which not every device's language has (WGSL's has not).
    if AddressType::from_len_signed(rows * vocab) == AddressType::U64 && !client.properties().supports_address(AddressType::U64) {
        return Err(CrossEntropyError::Device(format!(
            "logits {shape:?} have {} elements, past what 32-bit indices reach, and this device has no 64-bit indexing: use chunks of fewer rows",
            rows * vocab
        )));
    }
    let hardware = &client.properties().hardware;
    let plane_dim = hardware.plane_size_max;
    if plane_dim == 0 || hardware.plane_size_min != plane_dim || plane_dim as usize * PLANES > hardware.max_units_per_cube as usize {
        return Err(CrossEntropyError::Device(format!(
            "the kernel needs a fixed plane size and {PLANES} planes per cube; this device has planes of {} to {plane_dim} units, at most {} units per cube",
            hardware.plane_size_min, hardware.max_units_per_cube
        )));
    }
    Ok(())
}

/// Each row's cross-entropy and the gradient of their sum with respect to the logits, for
/// `logits: [rows, vocab]` (f32, f16 or bf16) and `labels: [rows]` (label ids as f32, exact
/// below 2^24; a row whose label is `ignore_index` has loss 0 and gradient 0).
///
/// Returns `(losses [rows] f32, gradient [rows, vocab] in the logits' dtype)`. The sum and
/// exponentials are computed in f32 whatever the logits' dtype.
pub fn fused_cross_entropy<R: CubeRuntime>(
    logits: CubeTensor<R>,
    labels: CubeTensor<R>,
    ignore_index: i64,
) -> Result<(CubeTensor<R>, CubeTensor<R>), CrossEntropyError> {
    let client = logits.client.clone();
    check_cross_entropy(&client, (logits.meta.shape(), logits.dtype), (labels.meta.shape(), labels.dtype))?;
    let rows = logits.meta.shape()[0];
    let vocab = logits.meta.shape()[1];
    let device = logits.device.clone();
    let plane_dim = client.properties().hardware.plane_size_max;
    let dtype = logits.dtype;
    let logits = into_contiguous(logits);
    let losses = empty_device_contiguous_dtype(client.clone(), device.clone(), Shape::new([rows]), DType::F32);
    let grads = empty_device_contiguous_dtype(client.clone(), device, Shape::new([rows, vocab]), dtype);
    if rows == 0 {
        return Ok((losses, grads));
    }
    let address = AddressType::from_len_signed(rows * vocab);
    let cubes = grid(&client, rows).map_err(|e| CrossEntropyError::Device(e.to_string()))?;
    LAUNCHES.with(|count| count.set(count.get() + 1));
    cross_entropy_rows_kernel::launch::<R>(
        &client,
        cubes,
        CubeDim::new_2d(plane_dim, PLANES as u32),
        address,
        logits.into_tensor_arg(),
        labels.into_tensor_arg(),
        losses.clone().into_tensor_arg(),
        grads.clone().into_tensor_arg(),
        ignore_index as f32,
        PLANES,
        dtype.into(),
    );
    Ok((losses, grads))
}

thread_local! {
    static LAUNCHES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Launches of the fused cross-entropy kernel so far from this thread (tests running side by
/// side count apart), so tests can tell it from the tensor-op path.
pub fn launches() -> u64 {
    LAUNCHES.with(|count| count.get())
}
