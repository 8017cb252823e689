//! (A module of the flash-attention tests: the same binary runs on the GPU machine.)
//!
//! The register fragments of `mma.sync.m16n8k16` (`ulysses_kernels::mma`) as
//! FlashAttention-2's forward uses them, on one 16 × 16 tile of q, k and v: S = q·kᵀ from two
//! accumulator tiles, P = S rounded to the inputs' dtype and taken from those accumulators as
//! an A fragment, O = P·v. S against f64 (q and k as the kernel saw them, rounded to f16),
//! O against f64 from the kernel's own S rounded as the kernel rounds it (so a P value on a
//! rounding boundary cannot flip the comparison). Distinct values everywhere: a lane or a
//! register in the wrong place moves a product.
//!
//! Tolerance 1e-5: each output is a sum of 16 products of values below 1 (S) or 16 (O),
//! accumulated in f32 (2^-24 relative per addition), against f64.
//!
//! Here on the CPU through wgpu and lavapipe, where the products run in `SharedMemoryMma` (wgpu has
//! no manual MMA); under the `cuda` feature through `mma.sync`.

use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive, ops::FloatTensor};
use ulysses_kernels::{
    mma::{fragment_products, has_mma_sync},
    testing::{runtime_available, supports_dtype, uniform_values},
};

// The flash-attention tests' runtime: wgpu, or CUDA under the `cuda` feature.
use super::{B, Runtime};

const TOLERANCE: f64 = 1e-5;

fn values_of(tensor: FloatTensor<B>) -> Vec<f64> {
    let tensor = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(tensor));
    tensor.cast(DType::F32).into_data().to_vec::<f32>().unwrap().into_iter().map(f64::from).collect()
}

/// A `[16, 16]` tile of `values` in `dtype`, and its values as the kernel sees them.
fn tile(values: &[f64], dtype: DType, device: &<Runtime as cubecl::Runtime>::Device) -> (FloatTensor<B>, Vec<f64>) {
    let tensor = Tensor::<B, 2>::from_data(TensorData::new(values.iter().map(|&x| x as f32).collect::<Vec<_>>(), [16, 16]), device).cast(dtype);
    let primitive = tensor.into_primitive().tensor();
    (primitive.clone(), values_of(primitive))
}

/// `x · yᵀ` (`transposed`) or `x · y` of 16 × 16 row-major matrices, in f64.
fn product(x: &[f64], y: &[f64], transposed: bool) -> Vec<f64> {
    let mut out = vec![0.0; 256];
    for row in 0..16 {
        for column in 0..16 {
            out[row * 16 + column] = (0..16).map(|k| x[row * 16 + k] * if transposed { y[column * 16 + k] } else { y[k * 16 + column] }).sum();
        }
    }
    out
}

/// The largest `|got − want|`, infinite where either side is not finite (`f64::max` would drop
/// a NaN).
fn largest_difference(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).map(|(g, w)| (g - w).abs()).fold(0.0f64, |worst, d| if d.is_finite() { worst.max(d) } else { f64::INFINITY })
}

#[test]
fn fragments_give_flash_attentions_two_products() {
    if !runtime_available::<Runtime>() {
        return;
    }
    let device = Default::default();
    for dtype in [DType::F16, DType::BF16] {
        if !supports_dtype::<Runtime>(&device, dtype) {
            println!("{dtype:?}: not on this device");
            continue;
        }
        let (q, q_values) = tile(&uniform_values(256, 11), dtype, &device);
        let (k, k_values) = tile(&uniform_values(256, 12), dtype, &device);
        let (v, v_values) = tile(&uniform_values(256, 13), dtype, &device);
        let client = q.client.clone();
        let (s, o) = fragment_products(q, k, v).unwrap();
        let (s, o) = (values_of(s), values_of(o));

        let s_error = largest_difference(&s, &product(&q_values, &k_values, true));
        // P as the kernel makes it: its f32 S rounded to the inputs' dtype.
        let (p, _) = tile(&s, dtype, &device);
        let o_error = largest_difference(&o, &product(&values_of(p), &v_values, false));
        let path = if has_mma_sync(&client, dtype) { "mma.sync" } else { "shared memory" };
        println!("{dtype:?} ({path}): S within {s_error:.1e}, O within {o_error:.1e}");
        assert!(s_error <= TOLERANCE, "{dtype:?}: S = q·kᵀ differs by {s_error:e}");
        assert!(o_error <= TOLERANCE, "{dtype:?}: O = P·v differs by {o_error:e}");
    }
}

#[test]
fn fragments_refuse_other_shapes_and_dtypes() {
    if !runtime_available::<Runtime>() {
        return;
    }
    let device = Default::default();
    let square = || Tensor::<B, 2>::zeros([16, 16], &device).cast(DType::F16).into_primitive().tensor();
    let wide = Tensor::<B, 2>::zeros([16, 32], &device).cast(DType::F16).into_primitive().tensor();
    let error = fragment_products(square(), wide, square()).unwrap_err().to_string();
    assert!(error.contains("[16, 16]"), "{error}");
    let f32_tile = Tensor::<B, 2>::zeros([16, 16], &device).into_primitive().tensor();
    let error = fragment_products(f32_tile, square(), square()).unwrap_err().to_string();
    assert!(error.contains("f16 or bf16"), "{error}");
}

/// The register-fragment engine's forward (`flash_attention_forward_fragments`) against the
/// f64 reference attention of the flash-attention tests: output and log-sum-exp, causal and
/// not, grouped-query, head dims 64 (two row tiles a warp, Q staged; the documents with one
/// too), 128 (one, as lavapipe's 32 KiB allows) and 256 (two column parts), lengths that are
/// no multiple of the blocks or the key steps (several steps each), unequal lengths both
/// ways (rows that see no key included), packed documents, key runs and a sliding window,
/// within the tests' f16 and bf16 tolerances; head dim 96 refused, naming what it takes. Head
/// dim 256 both as 32-bit indices lay it out (Q's fragments held whole) and as 64-bit ones do
/// (Q read 16 columns at a time as the scores need it), which lavapipe runs with 32-bit ones.
/// (That the launch passes the held width, not the parts', is the machine-code check's to see
/// (`q-streamed`: Q read in the loop), not this test's: both layouts compute the same values.)
#[test]
fn the_fragment_forward_matches_the_reference() {
    use super::{Case, device, download, reference, relative_error, supports, upload, values};
    use cubecl::ir::AddressType;
    use ulysses_kernels::{FlashOptions, flash_attention_forward_fragments, flash_attention_forward_fragments_laid_out_for};
    let Some(device) = device() else { return };
    for dtype in [DType::F16, DType::BF16] {
        if !supports(&device, dtype) {
            println!("{dtype:?}: not on this device");
            continue;
        }
        let unequal = |seq_q, seq_kv| Case { seq_q, seq_kv, ..Case::new(2, 1, 0, 64, true) };
        let cases = [
            Case::new(4, 2, 150, 64, true),
            Case::new(2, 2, 80, 64, false),
            unequal(70, 150),
            unequal(150, 70),
            Case::new(4, 2, 150, 128, true),
            Case::new(2, 2, 80, 128, false),
            // Documents (one shorter than a key step, one a block's rows apart), key runs
            // (one empty), a window with documents: the blocks' loops start past key 0.
            Case { documents: Some(vec![vec![70, 80], vec![5, 17, 100, 3, 25]]), ..Case::new(4, 1, 150, 64, true) },
            Case { key_runs: Some(vec![0..101, 30..150]), ..Case::new(2, 2, 150, 64, false) },
            Case { key_runs: Some(vec![0..0, 0..7]), ..Case::new(2, 2, 40, 128, false) },
            Case { window: Some(17), documents: Some(vec![vec![100, 50], vec![9, 141]]), ..Case::new(4, 2, 150, 128, true) },
            // Head dim 256: the output in two parts of 128 columns, each launch staging its
            // part of V.
            Case::new(2, 1, 80, 256, true),
            Case { documents: Some(vec![vec![70, 80], vec![5, 17, 100, 3, 25]]), ..Case::new(2, 1, 150, 256, true) },
        ];
        // (layout, one row tile a warp): head dim 256 in the 64-bit layout too; the documents at
        // 64, where a warp takes two row tiles (Q staged), with one too (the bench's other way).
        let layouts = |case: &Case| match (case.head_dim, case.documents.is_some()) {
            (256, _) => vec![(None, false), (Some(AddressType::U64), false)],
            (64, true) => vec![(None, false), (None, true)],
            _ => vec![(None, false)],
        };
        for (case, (layout, one_row_tile)) in cases.into_iter().flat_map(|case| layouts(&case).into_iter().map(move |layout| (case.clone(), layout))) {
            // Two sequences where the case packs documents or runs into each, else one.
            let batch = if case.ranges().is_some() { 2 } else { 1 };
            let case = Case { dtype, batch, ..case };
            let q = values(case.q_shape().iter().product(), 1, dtype);
            let k = values(case.k_shape().iter().product(), 2, dtype);
            let v = values(case.v_shape().iter().product(), 3, dtype);
            let want = reference(&case, &q, &k, &v, &vec![0.0; case.o_shape().iter().product()]);
            let options = FlashOptions { scale: case.scale, causal: case.causal };
            let ranges = case.ranges();
            let (q_tensor, k_tensor, v_tensor) = (upload(&q, case.q_shape(), dtype, &device), upload(&k, case.k_shape(), dtype, &device), upload(&v, case.v_shape(), dtype, &device));
            let (output, lse) = flash_attention_forward_fragments_laid_out_for(q_tensor, k_tensor, v_tensor, options, ranges.as_ref(), layout, one_row_tile).unwrap();
            let lse = download::<3>(lse);
            for (got, want) in lse.iter().zip(&want.lse) {
                assert!(want.is_some() || *got <= -1e29, "{case:?}: a row without keys must get the -1e30 log-sum-exp, got {got}");
            }
            let (lse_got, lse_want): (Vec<f64>, Vec<f64>) = lse.iter().zip(&want.lse).filter_map(|(got, want)| want.map(|w| (*got, w))).unzip();
            let (output_error, lse_error) = (relative_error(&download::<4>(output), &want.output), relative_error(&lse_got, &lse_want));
            println!("{case:?}, {layout:?}, one row tile {one_row_tile}: output {output_error:.1e}, lse {lse_error:.1e}");
            let tolerance = case.tolerance("fragments");
            assert!(output_error <= tolerance && lse_error <= tolerance, "{case:?}, {layout:?}: output {output_error:e}, lse {lse_error:e} (tolerance {tolerance:e})");
        }
        let case = Case { dtype, ..Case::new(2, 2, 80, 96, false) };
        let tile = |shape| upload(&vec![0.0; case.q_shape().iter().product()], shape, dtype, &device);
        let options = FlashOptions { scale: None, causal: false };
        let error = flash_attention_forward_fragments(tile(case.q_shape()), tile(case.k_shape()), tile(case.v_shape()), options, None).unwrap_err().to_string();
        assert!(error.contains("head and value dims of 64, 128 or 256"), "{error}");
    }
}

/// The backward on the register fragments (`flash_attention_backward_fragments`: dK and dV
/// key-outer; dQ summed in the same kernel with atomics where it stages its rows and the
/// device adds f32 atomically, else query-outer in its own kernel, as a case here asks for
/// explicitly) after the fragment forward, against the f64 reference's gradients
/// with the flash tests' measure (dQ and dK relative to one P·(dP − D)·K term, which cancels
/// where a row sees one key): causal with GQA (dK and dV summed over each group's heads),
/// unequal lengths both ways (rows that see no key, keys no row sees), documents, key runs with
/// an empty one, a window, head dims 64 (dK and dV in one launch, K's and V's rows staged in
/// shared memory: `Staging::rows_shared`, CUDA's path at 64 and 128; dQ summed there:
/// `Staging::query_grad`), 128 (K and V held in
/// registers, a launch each: lavapipe's 32 KiB do not hold the staged rows there) and 256 (one
/// per gradient and column part, the tiles single-buffered in lavapipe's shared memory); and
/// head dim 128 laid out as 64-bit indices lay it out (rows read as the products need them,
/// each gradient in two parts of 64 columns, dK and dV a launch each part), which lavapipe
/// runs with 32-bit ones.
#[test]
fn the_fragment_backward_matches_the_reference() {
    use super::{Case, device, supports};
    use cubecl::ir::AddressType;
    use ulysses_kernels::testing::adds_f32_atomically;
    let Some(device) = device() else { return };
    for dtype in [DType::F16, DType::BF16] {
        if !supports(&device, dtype) {
            println!("{dtype:?}: not on this device");
            continue;
        }
        let unequal = |seq_q, seq_kv| Case { batch: 1, seq_q, seq_kv, ..Case::new(2, 1, 0, 64, true) };
        let window = Case { window: Some(17), documents: Some(vec![vec![100, 50], vec![9, 141]]), ..Case::new(4, 2, 150, 128, true) };
        // (case, layout, dQ by its own kernel even where it could be summed).
        let (call, wide) = (None, Some(AddressType::U64));
        let documents = Case { documents: Some(vec![vec![70, 80], vec![5, 17, 100, 3, 25]]), ..Case::new(4, 1, 150, 64, true) };
        let cases = [
            (Case { batch: 1, ..Case::new(4, 2, 150, 64, true) }, call, false),
            (unequal(70, 150), call, false),
            (unequal(150, 70), call, false),
            (Case { batch: 1, ..Case::new(2, 2, 80, 128, false) }, call, false),
            (documents.clone(), call, false),
            // What `ULYSSES_FLASH_DETERMINISTIC=1` runs: the staged rows without the sum.
            (documents, call, true),
            (Case { key_runs: Some(vec![0..0, 0..7]), ..Case::new(2, 2, 40, 128, false) }, call, false),
            // The 64-bit layout first: a part it left unwritten must not find the same case's
            // gradient in a reused buffer.
            (window.clone(), wide, false),
            (window, call, false),
            (Case { batch: 1, ..Case::new(2, 1, 80, 256, true) }, call, false),
            (Case { window: Some(17), documents: Some(vec![vec![100, 50], vec![9, 141]]), ..Case::new(2, 1, 150, 256, true) }, call, false),
        ];
        // Cases whose dQ the dK/dV kernel summed with atomics (its rows staged: at head dim 64
        // on lavapipe, 64 and 128 on CUDA), the others by dQ's own kernel.
        let mut summed = 0;
        for (case, layout, deterministic) in cases.clone() {
            summed += usize::from(check_backward(Case { dtype, ..case }, layout, deterministic, None, &device));
        }
        // Where the device adds f32 atomically, the summed path ran too.
        assert!(summed > 0 || !adds_f32_atomically::<super::Runtime>(&device), "{dtype:?}: no case summed dQ in the dK/dV kernel on a device that could");
        // The summed cases again with each step's dS stored before dV's and dK's products, as
        // sm_90 stores it (`stmatrix`), where lavapipe stores it after dK's.
        ulysses_kernels::testing::store_score_grads_first(Some(true));
        let mut summed_first = 0;
        for (case, layout, deterministic) in cases.into_iter().take(5) {
            summed_first += usize::from(check_backward(Case { dtype, ..case }, layout, deterministic, None, &device));
        }
        ulysses_kernels::testing::store_score_grads_first(None);
        assert!(summed_first > 0 || !adds_f32_atomically::<super::Runtime>(&device), "{dtype:?}: no case summed dQ with dS stored first");
    }
}

/// dK/dV in blocks of 8 warps (128 keys: `fragment_tiles::WIDE_WARPS`, CUDA's block at head
/// dims 64 and 128 with `mma.sync`) and of 4, asked for, against the f64 reference as above: causal
/// GQA at head dim 64 with 150 queries and keys (a last block of 22 keys; 8 warps' step copies
/// of 32 queries over 256 units), documents with a window at 128 (a launch for dV, one for
/// dK). Lavapipe's 32 KiB hold the wide block's rows in registers (its 128 staged rows take
/// 37 KB at 64), so its staged rows and dQ sum run on CUDA only (the kernel tests there).
#[test]
fn the_fragment_backward_runs_blocks_of_four_and_eight_warps() {
    use super::{Case, device, supports};
    let Some(device) = device() else { return };
    let dtype = DType::F16;
    if !supports(&device, dtype) {
        println!("{dtype:?}: not on this device");
        return;
    }
    let cases = [
        Case { batch: 1, dtype, ..Case::new(4, 2, 150, 64, true) },
        Case { window: Some(17), documents: Some(vec![vec![100, 50], vec![9, 141]]), dtype, ..Case::new(4, 2, 150, 128, true) },
    ];
    for case in cases {
        for warps in [8, 4] {
            check_backward(case.clone(), None, false, Some(warps), &device);
        }
    }
}

/// One backward case on the register fragments (after their forward) against the f64
/// reference, laid out for `layout`, dQ by its own kernel where `deterministic`, dK/dV's
/// blocks of `key_warps` where given; whether the dK/dV kernel summed dQ.
fn check_backward(case: super::Case, layout: Option<cubecl::ir::AddressType>, deterministic: bool, key_warps: Option<usize>, device: &<Runtime as cubecl::Runtime>::Device) -> bool {
    use super::{download, largest, reference, relative_error, relative_error_above, upload, values};
    use ulysses_kernels::{FlashOptions, flash_attention_backward_fragments_laid_out_for, flash_attention_forward_fragments, query_grads_summed};
    let dtype = case.dtype;
    let summed_before = query_grads_summed();
    let q = values(case.q_shape().iter().product(), 1, dtype);
    let k = values(case.k_shape().iter().product(), 2, dtype);
    let v = values(case.v_shape().iter().product(), 3, dtype);
    let g = values(case.o_shape().iter().product(), 4, dtype);
    let want = reference(&case, &q, &k, &v, &g);
    let options = FlashOptions { scale: case.scale, causal: case.causal };
    let ranges = case.ranges();
    let up = |x: &[f64], shape| upload(x, shape, dtype, device);
    let (output, lse) = flash_attention_forward_fragments(up(&q, case.q_shape()), up(&k, case.k_shape()), up(&v, case.v_shape()), options, ranges.as_ref()).unwrap();
    let (dq, dk, dv) =
        flash_attention_backward_fragments_laid_out_for(up(&q, case.q_shape()), up(&k, case.k_shape()), up(&v, case.v_shape()), output, up(&g, case.o_shape()), lse, options, ranges.as_ref(), layout, deterministic, key_warps).unwrap();
    let term = case.scale() * largest(&g) * largest(&v) * largest(&q).max(largest(&k));
    let errors = [
        ("dq", relative_error_above(&download::<4>(dq), &want.dq, term)),
        ("dk", relative_error_above(&download::<4>(dk), &want.dk, term)),
        ("dv", relative_error(&download::<4>(dv), &want.dv)),
    ];
    let was_summed = query_grads_summed() > summed_before;
    assert!(!(deterministic && was_summed), "{case:?}: dQ summed with atomics where its own kernel was asked for");
    let dq_by = if was_summed { "dQ summed" } else { "dQ's kernel" };
    let blocks = key_warps.map_or(String::new(), |warps| format!(", dK/dV {warps} warps a block"));
    println!("{case:?}, {layout:?}, {dq_by}{blocks}: {}", errors.iter().map(|(n, e)| format!("{n} {e:.1e}")).collect::<Vec<_>>().join(", "));
    let tolerance = case.tolerance("fragments");
    for (name, error) in errors {
        assert!(error <= tolerance, "{case:?}, {layout:?}, {dq_by}{blocks}: {name} differs from the f64 reference by {error:e} (tolerance {tolerance:e})");
    }
    was_summed
}
