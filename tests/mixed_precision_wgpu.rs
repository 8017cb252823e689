//! Mixed precision (`Precision::Bf16`: f32 master weights, the layers in half precision) on a
//! CubeCL device: wgpu on lavapipe has f16 but no bf16, so there it computes in f16 (bf16
//! runs on CUDA only). The Llama example at SP=2 (thread ranks), against the same run in
//! f32:
//! - one backward step: the loss within 1e-3 relative and every parameter's gradient within
//!   1e-2 relative (L2) of f32's, yet not equal to them (the layers really ran in half
//!   precision); every gradient f32; the attention exchanges moved exactly half the bytes;
//! - three AdamW steps, also with whole-layer checkpointing (offloaded) and the token-wise
//!   parts in tiles of 3 tokens: losses within 1e-3 relative, parameters still f32 afterwards;
//!   and with the optimizer on the host (`offload_optimizer`): losses within 2e-4 of replicated
//!   half precision's (equal at steps 0 and 1 on lavapipe), and the device's parameters in half
//!   precision (the compute copy; the f32 master weights on the host).
//!
//! - the norm alone against f64, where f16 squares would overflow; and what autodiff keeps of
//!   it, measured on the device;
//! - what a checkpointed step (offloaded, tiled) keeps per token before each piece's
//!   backward: the attention core's tensors, and no hidden state;
//! - that a step's memory does not depend on the mask (packed documents against one), which
//!   the memory bench's longest-sequence mode relies on.
//!
//! The tolerances are f16's: 11 significant bits (4.9e-4 per rounding) through two layers,
//! the norm and softmax statistics and the loss being f32.

use burn::{
    backend::{Autodiff, NdArray},
    optim::AdamWConfig,
    tensor::{DType, FloatDType},
};
use burn_ulysses::{
    ParallelGroups, ParallelLayout, RankScope, UlyssesBackend, UlyssesConfig,
    comm::ThreadGroup,
    data::ShardTensors,
    precision::Precision,
};
use ulysses_training::{LayerCheckpointing, StepInput, backward_step, float_parameters};
use ulysses_kernels::testing::{bytes_in_use, runtime_available};
use ulysses_models::DecoderConfig;
use ulysses_trainer::train::{RunOptions, StepData, TrainConfig, train_rank};
use ulysses_suite::{HeldPerPiece, VariedLengths, deterministic_params, gradient_params_dtypes, gradient_params_values, with_deadline};

type Runtime = cubecl::wgpu::WgpuRuntime;
type Wgpu = burn_cubecl::CubeBackend<Runtime, f32, i32, u32>;
type Ad = Autodiff<Wgpu>;
type Sp = UlyssesBackend<Ad>;

const VOCAB: usize = 32;
const LOSS_TOLERANCE: f64 = 1e-3;
const GRADIENT_TOLERANCE: f64 = 1e-2;

fn config(precision: Precision) -> TrainConfig {
    let model = DecoderConfig::new(VOCAB).with_d_model(64).with_n_heads(4).with_n_kv_heads(2).with_ffn_hidden(128).with_repeat_kv(false);
    TrainConfig::new(model, AdamWConfig::new(), ParallelLayout::new().with_sp_size(2))
        .with_batch_size(4)
        .with_steps(3)
        .with_learning_rate(1e-2)
        .with_warmup_steps(0)
        .with_eval_every(0)
        .with_precision(precision)
}

struct Backward {
    dtype: FloatDType,
    loss: f64,
    grads: Vec<(String, Vec<f32>)>,
    grad_dtypes: Vec<DType>,
    exchanged_bytes: u64,
}

/// World rank 0's view of one backward step at SP=2 in `precision`.
fn backward(precision: Precision) -> Backward {
    let config = config(precision);
    let batch = VariedLengths { vocab: VOCAB }.train_batch(0);
    let mut ranks = ThreadGroup::new(2).run(|rank| {
        let groups: ParallelGroups<Wgpu> = ParallelGroups::new(rank.communicator(), config.layout).unwrap();
        let _sp = burn_ulysses::context::enter(RankScope::Thread, groups.rank_context(UlyssesConfig::new()));
        let device = Default::default();
        let dtype = precision.compute_dtype::<Sp>(&device).unwrap();
        let model = deterministic_params(config.model.init::<Sp>(&device), 5).with_compute_dtype(dtype);
        let micro_batches = [batch.clone()];
        let step = StepInput { index: 0, learning_rate: 0.0, micro_batches: &micro_batches, documents: None, targets: None, max_grad_norm: None };
        let local = backward_step(&model, &step, &config.sharder(), &groups, &device).unwrap();
        let grad_dtypes = gradient_params_dtypes(&model, &local.grads);
        Backward {
            dtype,
            loss: local.read_loss(),
            grads: gradient_params_values(&model, &local.grads),
            grad_dtypes,
            exchanged_bytes: groups.ulysses.traffic().all_to_all_bytes,
        }
    });
    ranks.swap_remove(0).unwrap_or_else(|p| panic!("{p}"))
}

fn relative_l2(got: &[f32], want: &[f32]) -> f64 {
    let (mut error, mut norm) = (0.0f64, 0.0f64);
    for (g, w) in got.iter().zip(want) {
        error += (*g as f64 - *w as f64).powi(2);
        norm += (*w as f64).powi(2);
    }
    // NaN or infinity anywhere: never within tolerance.
    if !error.is_finite() { f64::INFINITY } else { (error / norm.max(f64::MIN_POSITIVE)).sqrt() }
}

#[test]
fn half_precision_backward_follows_f32_with_f32_gradients_and_half_the_exchanged_bytes() {
    if !runtime_available::<Runtime>() {
        return;
    }
    let (full, half) = with_deadline(std::time::Duration::from_secs(200), || (backward(Precision::F32), backward(Precision::Bf16)));
    assert_eq!(full.dtype, FloatDType::F32);
    assert!(matches!(half.dtype, FloatDType::F16 | FloatDType::BF16), "Bf16 resolved to {:?}", half.dtype);
    println!("compute dtype: {:?}", half.dtype);

    let loss_error = ((half.loss - full.loss) / full.loss).abs();
    println!("loss: f32 {:.6}, half {:.6}: relative {loss_error:.2e}", full.loss, half.loss);
    assert!(loss_error <= LOSS_TOLERANCE, "the loss differs by {loss_error:e} relative");

    let mut worst: f64 = 0.0;
    for ((name, got), (_, want)) in half.grads.iter().zip(&full.grads) {
        let error = relative_l2(got, want);
        assert!(error <= GRADIENT_TOLERANCE, "the gradient of {name} differs by {error:e} (relative L2)");
        worst = if error > worst { error } else { worst };
    }
    println!("{} parameter gradients: worst relative L2 error {worst:.2e}", half.grads.len());
    assert!(worst > 0.0, "the half-precision gradients equal the f32 ones bit for bit: the layers did not run in half precision");
    assert!(half.grad_dtypes.iter().chain(&full.grad_dtypes).all(|&d| d == DType::F32), "gradients not all f32: {:?}", half.grad_dtypes);

    println!("all-to-all bytes: f32 {}, half {}", full.exchanged_bytes, half.exchanged_bytes);
    assert!(full.exchanged_bytes > 0);
    assert_eq!(half.exchanged_bytes * 2, full.exchanged_bytes, "the exchanges did not move half-precision tensors");
}

/// `config` trained at SP=2 (thread ranks) on the varied-length batches: rank 0's losses, and
/// the dtypes of the model's parameters afterwards.
fn train_two_ranks(config: TrainConfig) -> (Vec<f64>, Vec<DType>) {
    let mut ranks = ThreadGroup::new(2).run(|rank| {
        let groups: ParallelGroups<Wgpu> = ParallelGroups::new(rank.communicator(), config.layout).unwrap();
        let _sp = burn_ulysses::context::enter(RankScope::Thread, groups.rank_context(UlyssesConfig::new()));
        let device = Default::default();
        let model = deterministic_params(config.model.init::<Sp>(&device), 5);
        let (trained, reports) = train_rank::<Sp>(&config, model, &VariedLengths { vocab: VOCAB }, &groups, &device, RunOptions::default()).unwrap();
        let model = trained.whole(&*groups.world).unwrap();
        let dtypes: Vec<DType> = float_parameters(&model).iter().map(|p| p.values.dtype()).collect();
        (reports.iter().map(|r| r.loss).collect::<Vec<_>>(), dtypes)
    });
    ranks.swap_remove(0).unwrap_or_else(|p| panic!("{p}"))
}

#[test]
fn half_precision_training_keeps_f32_parameters_and_follows_f32_losses() {
    if !runtime_available::<Runtime>() {
        return;
    }
    let run = train_two_ranks;
    let checkpointed = config(Precision::Bf16).with_layer_checkpointing(Some(LayerCheckpointing::new().with_offload_to_host(true).with_tile_tokens(Some(3))));
    let on_host = config(Precision::Bf16).with_offload_optimizer(true);
    let ((full, _), (half, dtypes), (half_checkpointed, checkpointed_dtypes), (half_on_host, on_host_dtypes)) =
        with_deadline(std::time::Duration::from_secs(900), move || (run(config(Precision::F32)), run(config(Precision::Bf16)), run(checkpointed), run(on_host)));
    // Every run took every step: a run that ended early would leave steps out of the zip.
    let steps = config(Precision::F32).steps;
    assert!([&full, &half, &half_checkpointed, &half_on_host].iter().all(|losses| losses.len() == steps), "runs took other step counts than {steps}");
    for (step, (((h, c), o), f)) in half.iter().zip(&half_checkpointed).zip(&half_on_host).zip(&full).enumerate() {
        let (error, checkpointed_error, on_host_error) = (((h - f) / f).abs(), ((c - f) / f).abs(), ((o - f) / f).abs());
        println!(
            "step {step}: loss f32 {f:.6}, half {h:.6} ({error:.2e}), half checkpointed + tiled {c:.6} ({checkpointed_error:.2e}), \
             half with the optimizer on the host {o:.6} ({on_host_error:.2e}; {:.2e} from half)",
            ((o - h) / h).abs()
        );
        assert!(error <= LOSS_TOLERANCE, "step {step}: the loss differs by {error:e} relative");
        assert!(checkpointed_error <= LOSS_TOLERANCE, "step {step}: checkpointed, the loss differs by {checkpointed_error:e} relative");
        assert!(on_host_error <= LOSS_TOLERANCE, "step {step}: with the optimizer on the host, the loss differs by {on_host_error:e} relative");
        // The forward computes what replicated mixed precision computes; only gradient sums
        // inside the graph run in half precision (a head weight whose gradient came through an
        // f16 product was 37 times too large, and moved step 1 by 1.3e-2).
        assert!(((o - h) / h).abs() <= 2e-4, "step {step}: with the optimizer on the host, the loss is {o}, replicated half precision's {h}");
    }
    assert_eq!(checkpointed_dtypes, dtypes);
    assert!(!dtypes.is_empty() && dtypes.iter().all(|&d| d == DType::F32), "parameters after training in half precision: {dtypes:?}");
    assert!(on_host_dtypes.iter().all(|&d| d == DType::F16), "the device's parameters with the optimizer on the host: {on_host_dtypes:?}");
}

/// ZeRO-3 in half precision (f32 master weights on the host, the compute copy's parts half,
/// the token-wise parts in tiles of 3 tokens) follows replicated half precision on the same
/// tiles: the tiles' gradients are summed in f32 as replicated training sums its f32
/// parameters'. Step 1's loss within 8e-6 relative (3.6e-6 on lavapipe, 2026-12-02; 1.6e-5
/// when the tiles' gradients were summed in half precision).
#[test]
fn half_precision_zero_3_sums_its_tiles_gradients_as_replicated_training_does() {
    if !runtime_available::<Runtime>() {
        return;
    }
    let run = |config: TrainConfig| train_two_ranks(config).0;
    let tiled = config(Precision::Bf16).with_steps(2).with_layer_checkpointing(Some(LayerCheckpointing::new().with_tile_tokens(Some(3))));
    let zero3 = tiled.clone().with_offload_optimizer(true).with_zero_stage(3);
    let (replicated, zero3) = with_deadline(std::time::Duration::from_secs(900), move || (run(tiled), run(zero3)));
    for (step, (r, z)) in replicated.iter().zip(&zero3).enumerate() {
        println!("step {step}: replicated half {r:.7}, ZeRO-3 half {z:.7} ({:.2e})", ((z - r) / r).abs());
    }
    assert_eq!(zero3[0], replicated[0], "step 0: the same forward");
    let error = ((zero3[1] - replicated[1]) / replicated[1]).abs();
    assert!(error.is_finite() && error <= 8e-6, "step 1: ZeRO-3's loss {} is {error:e} from replicated half precision's {}", zero3[1], replicated[1]);
}

/// A half-precision compute copy's gradients (the host optimizer's, `--offload-optimizer`) are
/// summed over a step's micro-batches in f32, as replicated mixed precision sums its f32
/// parameters' and as DeepSpeed's bf16 optimizer does by default: a half-precision sum rounds
/// each addition to 11 bits (f16) or 8 (bf16). Against each micro-batch's gradient computed
/// alone with the step's weight (the same operations, so the same half-precision values) and
/// summed in f64: every parameter's sum within 2e-7 of its largest value (f32's rounding of
/// four terms; 0 on lavapipe, 2026-12-02); summed in f16 the embedding's was 2.4e-4 apart.
#[test]
fn a_half_precision_compute_copy_sums_its_micro_batches_in_f32() {
    use burn::tensor::ElementConversion;
    use ulysses_training::{lm_loss_sum, with_parameters_in};
    if !runtime_available::<Runtime>() {
        return;
    }
    let mut config = config(Precision::Bf16);
    config.layout = ParallelLayout::new();
    let batch = VariedLengths { vocab: VOCAB }.train_batch(0);
    let micro_batches: Vec<Vec<Vec<i64>>> = batch.iter().map(|sequence| vec![sequence.clone()]).collect();
    assert_eq!(micro_batches.len(), 4);
    let (summed, reference, dtype) = with_deadline(std::time::Duration::from_secs(200), move || {
        let mut ranks = ThreadGroup::new(1).run(|rank| {
            let groups: ParallelGroups<Wgpu> = ParallelGroups::new(rank.communicator(), config.layout).unwrap();
            let _sp = burn_ulysses::context::enter(RankScope::Thread, groups.rank_context(UlyssesConfig::new()));
            let device = Default::default();
            let dtype = Precision::Bf16.compute_dtype::<Sp>(&device).unwrap();
            let model = with_parameters_in(deterministic_params(config.model.init::<Sp>(&device), 5).with_compute_dtype(dtype), dtype);
            let step = StepInput { index: 0, learning_rate: 0.0, micro_batches: &micro_batches, documents: None, targets: None, max_grad_norm: None };
            let sharder = config.sharder();
            let local = backward_step(&model, &step, &sharder, &groups, &device).unwrap();
            // Each micro-batch alone, with the step's weight: one over the labels of them all.
            let shards: Vec<_> = micro_batches.iter().map(|batch| sharder.shard_targets(batch, None, None, 0)).collect();
            let labels = |shard: &burn_ulysses::data::SequenceShard| shard.labels::<Sp>(&device);
            let valid: usize = shards.iter().map(|shard| labels(shard).not_equal_elem(sharder.ignore_index).int().sum().into_scalar().elem::<i64>() as usize).sum();
            let weight = 1.0 / valid as f64;
            let mut reference: Vec<(String, Vec<f64>)> = Vec::new();
            for shard in &shards {
                let loss = lm_loss_sum(model.lm_output(shard.tokens(&device), &shard.positions), labels(shard), sharder.ignore_index) * weight;
                let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &model);
                for (index, (name, values)) in gradient_params_values(&model, &grads).into_iter().enumerate() {
                    match reference.get_mut(index) {
                        Some((_, sum)) => sum.iter_mut().zip(values).for_each(|(s, v)| *s += v as f64),
                        None => reference.push((name, values.into_iter().map(f64::from).collect())),
                    }
                }
            }
            (gradient_params_values(&model, &local.grads), reference, dtype)
        });
        ranks.swap_remove(0).unwrap_or_else(|p| panic!("{p}"))
    });
    assert!(matches!(dtype, FloatDType::F16 | FloatDType::BF16), "Bf16 resolved to {dtype:?}");
    let mut worst: f64 = 0.0;
    for ((name, got), (_, want)) in summed.iter().zip(&reference) {
        let largest = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let error = got.iter().zip(want).map(|(g, w)| (*g as f64 - w).abs()).fold(0.0f64, |m, e| if e.is_nan() || m.is_nan() { f64::NAN } else { m.max(e) });
        assert!(largest > 0.0 && got.iter().all(|g| g.is_finite()), "{name}: no gradient, or one that is not finite");
        let relative = error / largest;
        assert!(relative <= 2e-7, "{name}: the micro-batches' sum is {relative:e} (of its largest value) from the f64 sum of each one's gradient");
        worst = if relative > worst { relative } else { worst };
    }
    println!("{} parameters, {:?} compute copy: the sum over 4 micro-batches at most {worst:.2e} of its largest value from f64's", summed.len(), dtype);
}

/// A model on a backend whose default float is half precision (`CubeBackend<_, f16, ..>`,
/// burn's `Cuda<bf16>`), computing in f32 (the models' default), gives the f32 model's logits
/// within its parameters' rounding to f16: its norms' f16 gains and its head meet the f32 rows
/// cast, where tensors of two dtypes read one's bytes as the other's (NaN logits).
#[test]
fn a_model_on_a_half_precision_default_backend_computes_in_f32() {
    use burn::tensor::{Int, Tensor, TensorData, backend::Backend};
    type Half = burn_cubecl::CubeBackend<Runtime, burn::tensor::f16, i32, u32>;
    if !runtime_available::<Runtime>() {
        return;
    }
    fn logits<B: Backend>(device: &B::Device) -> Vec<f32> {
        // Its kv heads repeated: burn's attention on a plain backend takes no grouped queries.
        let config = DecoderConfig::new(VOCAB).with_d_model(64).with_n_heads(4).with_n_kv_heads(2).with_ffn_hidden(128).with_repeat_kv(true);
        let model = deterministic_params(config.init::<B>(device), 5);
        let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new((0..16).map(|i| (i * 7 % VOCAB) as i64).collect::<Vec<_>>(), [1, 16]), device);
        let logits = model.forward(tokens, &burn_ulysses::data::ShardPositions::consecutive(1, 16));
        assert_eq!(logits.dtype(), DType::F32, "the logits of a model computing in f32");
        logits.into_data().convert::<f32>().to_vec().unwrap()
    }
    let want = logits::<NdArray>(&Default::default());
    let got = logits::<Half>(&Default::default());
    let difference = relative_l2(&got, &want);
    println!("logits on an f16-default backend, f32 compute: relative L2 {difference:.1e} from the f32 model's");
    assert!(got.iter().all(|v| v.is_finite()) && difference <= 1e-2, "relative L2 {difference:e}: tensors of two dtypes met");
}

#[test]
fn bf16_on_a_backend_without_half_precision_is_refused_by_name() {
    let error = Precision::Bf16.compute_dtype::<NdArray>(&Default::default()).unwrap_err().to_string();
    assert!(error.contains("neither bf16 nor f16") && error.contains("--precision f32"), "{error}");
    assert_eq!(Precision::F32.compute_dtype::<NdArray>(&Default::default()).unwrap(), FloatDType::F32);
}

/// `precision::rms_norm` in f16 (what the layers run) against RMSNorm in f64: output, input
/// gradient and gamma gradient within f16's tolerance, on rows of ordinary values, of values
/// whose squares overflow f16 (|x| up to 3000: x² > 65504), of values below epsilon's scale,
/// and of zeros. The input and gamma are f32 leaves cast inside, as in training.
#[test]
fn half_precision_rms_norm_follows_f64_where_f16_squares_would_overflow() {
    if !runtime_available::<Runtime>() {
        return;
    }
    const D: usize = 64;
    const EPSILON: f64 = 1e-5;
    let magnitudes = [1.0f64, 3.0e3, 2.0e-4, 0.0];
    let x: Vec<f64> =
        magnitudes.iter().enumerate().flat_map(|(row, m)| (0..D).map(move |i| m * (((i * 7 + row * 3) % 11) as f64 / 5.0 - 1.0))).collect();
    let gamma: Vec<f64> = (0..D).map(|i| 0.5 + i as f64 / D as f64).collect();
    let upstream: Vec<f64> = (0..x.len()).map(|i| ((i * 5) % 9) as f64 / 4.0 - 1.0).collect();

    // f64 reference: y = x g r, r = (mean(x²) + eps)^-1/2;
    // dx = r g u - x r³/D Σ_j u_j g_j x_j; dg = Σ_rows u x r.
    let (mut want_y, mut want_dx, mut want_dg) = (vec![0.0; x.len()], vec![0.0; x.len()], vec![0.0; D]);
    for row in 0..magnitudes.len() {
        let xs = &x[row * D..(row + 1) * D];
        let us = &upstream[row * D..(row + 1) * D];
        let r = (xs.iter().map(|v| v * v).sum::<f64>() / D as f64 + EPSILON).powf(-0.5);
        let dot: f64 = (0..D).map(|j| us[j] * gamma[j] * xs[j]).sum();
        for j in 0..D {
            want_y[row * D + j] = xs[j] * gamma[j] * r;
            want_dx[row * D + j] = r * gamma[j] * us[j] - xs[j] * r.powi(3) / D as f64 * dot;
            want_dg[j] += us[j] * xs[j] * r;
        }
    }

    let device = Default::default();
    let data = |values: &[f64], shape: Vec<usize>| burn::tensor::TensorData::new(values.iter().map(|&v| v as f32).collect::<Vec<_>>(), shape);
    let mut norm = burn::nn::RmsNormConfig::new(D).with_epsilon(EPSILON).init::<Ad>(&device);
    norm.gamma = norm.gamma.map(|_| burn::tensor::Tensor::from_data(data(&gamma, vec![D]), &device).require_grad());
    let input = burn::tensor::Tensor::<Ad, 2>::from_data(data(&x, vec![magnitudes.len(), D]), &device).require_grad();
    let y = burn_ulysses::precision::rms_norm(&norm, input.clone().cast(FloatDType::F16));
    assert_eq!(y.dtype(), DType::F16);
    let y = y.cast(FloatDType::F32);
    let grads = (y.clone() * burn::tensor::Tensor::from_data(data(&upstream, vec![magnitudes.len(), D]), &device)).sum().backward();
    let values = |t: burn::tensor::Tensor<Wgpu, 2>| t.into_data().to_vec::<f32>().unwrap();
    let got_y = values(y.inner());
    let got_dx = values(input.grad(&grads).unwrap());
    let got_dg: Vec<f32> = norm.gamma.grad(&grads).unwrap().into_data().to_vec().unwrap();

    let f32s = |v: &[f64]| v.iter().map(|&v| v as f32).collect::<Vec<_>>();
    // Row by row: each row's error against its own scale (the rows differ by 10^7).
    for (what, got, want) in [("output", &got_y, &want_y), ("input gradient", &got_dx, &want_dx)] {
        for row in 0..magnitudes.len() {
            let (got, want) = (&got[row * D..(row + 1) * D], f32s(&want[row * D..(row + 1) * D]));
            let error = if want.iter().all(|&w| w == 0.0) {
                // The zero row's output is 0; its input gradient is r·g·u, checked like the rest.
                if got.iter().all(|&g| g == 0.0) { 0.0 } else { f64::INFINITY }
            } else {
                relative_l2(got, &want)
            };
            println!("{what}, rows of magnitude {:e}: relative L2 error {error:.2e}", magnitudes[row]);
            assert!(error <= GRADIENT_TOLERANCE, "{what}, row {row} (magnitude {:e}): relative L2 error {error:e}", magnitudes[row]);
        }
    }
    let error = relative_l2(&got_dg, &f32s(&want_dg));
    println!("gamma gradient: relative L2 error {error:.2e}");
    assert!(error <= GRADIENT_TOLERANCE, "gamma gradient: relative L2 error {error:e}");
}

/// A model's own half-precision logits (`LmOutput::Logits`) give the loss of those values in
/// f32, as transformers' loss does (`logits.float()`): f16's log-sum-exp over 4 096 classes
/// and its sum over 64 tokens were 1e-4 relative off the f64 loss.
#[test]
fn half_precision_logits_give_their_loss_in_f32() {
    if !runtime_available::<Runtime>() {
        return;
    }
    const ROWS: usize = 64;
    const CLASSES: usize = 4096;
    let device = Default::default();
    // N(0, 3)-ish logits and labels, from a SplitMix stream; the f16 values are the input.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    let logits: Vec<f32> = (0..ROWS * CLASSES).map(|_| ((0..4).map(|_| next()).sum::<f64>() - 2.0) as f32 * 5.2).collect();
    let labels: Vec<i64> = (0..ROWS).map(|row| if row % 9 == 4 { -100 } else { (row * 389 % CLASSES) as i64 }).collect();
    let half = burn::tensor::Tensor::<Ad, 3>::from_data(burn::tensor::TensorData::new(logits, [1, ROWS, CLASSES]), &device).cast(FloatDType::F16);
    let rounded: Vec<f64> = half.clone().cast(FloatDType::F32).into_data().to_vec::<f32>().unwrap().iter().map(|&v| v as f64).collect();
    let want: f64 = (0..ROWS)
        .filter(|&row| labels[row] != -100)
        .map(|row| {
            let values = &rounded[row * CLASSES..(row + 1) * CLASSES];
            let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            max + values.iter().map(|v| (v - max).exp()).sum::<f64>().ln() - values[labels[row] as usize]
        })
        .sum();
    let labels = burn::tensor::Tensor::<Ad, 2, burn::tensor::Int>::from_data(burn::tensor::TensorData::new(labels, [1, ROWS]), &device);
    let loss = ulysses_training::masked_cross_entropy_sum(half, labels, -100);
    assert_eq!(loss.dtype(), DType::F32);
    let got = loss.into_scalar() as f64;
    let error = (got - want).abs() / want;
    println!("f16 logits: loss {got} against f64's {want}, relative error {error:.1e}");
    assert!(error.is_finite() && error <= 1e-5, "loss {got} against f64's {want}: relative error {error:e}");
}

/// What autodiff keeps of `precision::rms_norm` in f16, per token, measured on the device:
/// the input, its pre-scaled copy, the normalised rows and the output, all f16 (4 × 2 bytes
/// per feature), and a few bytes of per-row statistics. Computing the norm in f32 kept 48 bytes per feature (6 f16 tensors' worth),
/// and so did a pre-scaling whose statistics formed a graph of their own.
#[test]
fn half_precision_rms_norm_keeps_only_half_precision_copies_for_the_backward() {
    if !runtime_available::<Runtime>() {
        return;
    }
    const D: usize = 512;
    let device: <Runtime as cubecl::Runtime>::Device = Default::default();
    let in_use = || bytes_in_use::<Runtime>(&device);
    let norm = burn::nn::RmsNormConfig::new(D).init::<Ad>(&device);
    let held = |tokens: usize| {
        let base = in_use();
        let input = burn::tensor::Tensor::<Ad, 3>::random([1, tokens, D], burn::tensor::Distribution::Default, &device)
            .cast(FloatDType::F16)
            .require_grad();
        let output = burn_ulysses::precision::rms_norm(&norm, input.clone());
        let held = in_use() - base;
        let _ = output.cast(FloatDType::F32).sum().backward();
        held
    };
    let (short, long) = (held(1024), held(2048));
    let per_token = (long - short) as f64 / 1024.0;
    println!("held per token: {per_token} bytes ({} bytes per feature)", per_token / D as f64);
    // Besides the four rows, a few per-row statistics (scales, inverse RMS: bytes per token).
    let rows = (4 * 2 * D) as f64;
    assert!(per_token >= rows && per_token <= rows + 32.0, "the f16 norm keeps {per_token} bytes per token for its backward, not {rows} and a few statistics");
}

/// What a checkpointed step keeps per token in f16, inputs offloaded and the token-wise
/// parts tiled, measured on the device before each piece's backward (bytes at 512 tokens
/// less bytes at 256, over 256): only the attention core's tensors grow with the sequence.
/// The core holds q, k, v, its output, the output's gradient and the softmax statistics;
/// no piece holds a hidden state (`d_model` f16 values per token) beside them, and the head
/// holds no whole-sequence tensor at all. Keeping the layer input or a gradient of it on the
/// device, or the head untiled, adds 256 bytes per token and fails this.
#[test]
fn checkpointed_layers_keep_only_the_attention_core_per_token() {
    use ulysses_training::Piece;
    if !runtime_available::<Runtime>() {
        return;
    }
    let (d_model, heads, kv_heads) = (128, 8, 2);
    let device: <Runtime as cubecl::Runtime>::Device = Default::default();
    let dtype = Precision::Bf16.compute_dtype::<Sp>(&device).unwrap();
    let config = DecoderConfig::new(VOCAB).with_d_model(d_model).with_n_heads(heads).with_n_kv_heads(kv_heads).with_ffn_hidden(512).with_repeat_kv(false);
    let model = config.init::<Sp>(&device).with_compute_dtype(dtype);
    let checkpointing = LayerCheckpointing::new().with_offload_to_host(true);
    let held = |tokens: usize| held_per_piece(&model, &checkpointing, &one_sequence(tokens, None, 1, 0), &device);
    // The first step allocates what every later one reuses (kernel state, pools): not counted.
    held(128);
    let (short, long) = (held(256), held(512));
    assert_eq!(short.iter().map(|p| p.0).collect::<Vec<_>>(), long.iter().map(|p| p.0).collect::<Vec<_>>());
    // What the trainer's memory estimate says the core holds a token (q with all heads, k and
    // v with the kv heads, the output and its gradient in f16; the softmax statistics in f32):
    // its bytes at 512 tokens less those at 256.
    let estimate = |tokens: usize| {
        let run = TrainConfig::new(config.clone(), AdamWConfig::new(), ParallelLayout::new())
            .with_batch_size(1)
            .with_seq_len(tokens)
            .with_layer_checkpointing(Some(checkpointing.clone()));
        ulysses_trainer::memory::StepActivations::of(&run, 2).expect("checkpointed").core as f64
    };
    let core = (estimate(512) - estimate(256)) / 256.0;
    let f16 = 2.0;
    let hidden = d_model as f64 * f16;
    let mut core_seen = 0;
    for ((piece, short), (_, long)) in short.iter().zip(&long) {
        let per_token = (*long as f64 - *short as f64) / 256.0;
        println!("{piece:?}: {per_token} bytes per token (the core's tensors: {core}, a hidden state: {hidden})");
        // Slack for what is not a hidden state: rotary tables (32 bytes per token, in the
        // first pass's context and the backward's), token ids and labels.
        let slack = hidden / 2.0;
        let bound = match piece {
            Piece::Head => slack,
            Piece::Core { .. } => {
                core_seen += 1;
                assert!(per_token >= core, "{piece:?} holds {per_token} bytes per token: less than its own tensors ({core})?");
                core + slack
            }
            _ => core + slack,
        };
        assert!(per_token <= bound, "{piece:?} holds {per_token} bytes per token before its backward, more than {bound}");
    }
    assert_eq!(core_seen, config.n_layers);
}

/// `--offload-layers`: with the first n of L layers offloaded, the device keeps the later
/// layers' inputs and the gradients passed while they run back, no more: before layer i's
/// core backward it holds, beyond what a wholly offloaded step holds there, `i - n + 3` hidden
/// states a token for i >= n (the inputs of layers n..=i, the upstream gradient, the input's
/// residual gradient), one for i = n - 1 (the upstream gradient, of layer n's input) and none
/// below. The most it holds beyond that step, at any piece, is what the trainer's estimate
/// counts (`LayerCheckpointing::device_kept_tensors`) less the input's last gradient still
/// being made. Offloading every layer's input under `offload_layers`, or none, fails this.
#[test]
fn offloading_the_first_layers_keeps_the_later_ones_on_the_device() {
    use ulysses_training::Piece;
    if !runtime_available::<Runtime>() {
        return;
    }
    let (d_model, layers, offloaded) = (128, 4, 2);
    let device: <Runtime as cubecl::Runtime>::Device = Default::default();
    let dtype = Precision::Bf16.compute_dtype::<Sp>(&device).unwrap();
    let config = DecoderConfig::new(VOCAB).with_d_model(d_model).with_n_layers(layers).with_n_heads(8).with_n_kv_heads(2).with_ffn_hidden(512).with_repeat_kv(false);
    let model = config.init::<Sp>(&device).with_compute_dtype(dtype);
    let all = LayerCheckpointing::new().with_offload_to_host(true);
    let first = all.clone().with_offload_layers(Some(offloaded));
    let per_token = |checkpointing: &LayerCheckpointing| {
        let held = |tokens: usize| held_per_piece(&model, checkpointing, &one_sequence(tokens, None, 1, 0), &device);
        // The first step allocates what every later one reuses (kernel state, pools): not counted.
        held(128);
        let (short, long) = (held(256), held(512));
        short.iter().zip(&long).map(|((piece, short), (_, long))| (*piece, (*long as f64 - *short as f64) / 256.0)).collect::<Vec<_>>()
    };
    let (all_held, first_held) = (per_token(&all), per_token(&first));
    assert_eq!(all_held.iter().map(|p| p.0).collect::<Vec<_>>(), first_held.iter().map(|p| p.0).collect::<Vec<_>>());
    // A hidden state a token: d_model half-precision values.
    let hidden = d_model as f64 * 2.0;
    let mut cores = 0;
    let mut most: f64 = 0.0;
    for ((piece, all), (_, first)) in all_held.iter().zip(&first_held) {
        let beyond = (first - all) / hidden;
        most = most.max(beyond);
        println!("{piece:?}: {first} bytes a token with the first {offloaded} layers offloaded, {all} with every one: {beyond:.3} hidden states more");
        if let Piece::Core { layer } = *piece {
            cores += 1;
            let expected = match layer {
                i if i >= offloaded => i - offloaded + 3,
                i if i + 1 == offloaded => 1,
                _ => 0,
            };
            assert!((beyond - expected as f64).abs() < 0.25, "before layer {layer}'s core backward the device holds {beyond:.3} hidden states a token more than offloaded wholly; {expected} expected");
        }
    }
    assert_eq!(cores, layers);
    let estimate = first.device_kept_tensors(layers) as f64;
    assert!(most <= estimate + 0.25 && most >= estimate - 1.25, "at most {most:.3} hidden states a token beyond the wholly offloaded step; the estimate counts {estimate}");
}

/// The same at SP = 2 (Ulysses, two rank threads on one device, each thread's bytes counted
/// apart by CubeCL's pools): the core holds q, k and v in both layouts, the output as the
/// attention saved it and the output's gradient, as the trainer's estimate says.
#[test]
fn under_ulysses_the_core_holds_what_the_memory_estimate_says() {
    use ulysses_training::Piece;
    if !runtime_available::<Runtime>() {
        return;
    }
    let layout = ParallelLayout::new().with_sp_size(2);
    let config = DecoderConfig::new(VOCAB).with_d_model(128).with_n_heads(8).with_n_kv_heads(2).with_ffn_hidden(512).with_repeat_kv(false);
    let checkpointing = LayerCheckpointing::new().with_offload_to_host(true);
    let estimate = |tokens: usize| {
        let run = TrainConfig::new(config.clone(), AdamWConfig::new(), layout).with_batch_size(1).with_seq_len(tokens).with_layer_checkpointing(Some(checkpointing.clone()));
        ulysses_trainer::memory::StepActivations::of(&run, 2).expect("checkpointed").core as f64
    };
    let core = (estimate(1024) - estimate(512)) / 512.0;
    let layers = config.n_layers;
    let mut ranks = with_deadline(std::time::Duration::from_secs(900), move || {
        ThreadGroup::new(2).run(|rank| {
            let groups: ParallelGroups<Wgpu> = ParallelGroups::new(rank.communicator(), layout).unwrap();
            let _sp = burn_ulysses::context::enter(RankScope::Thread, groups.rank_context(UlyssesConfig::new()));
            let device = Default::default();
            let dtype = Precision::Bf16.compute_dtype::<Sp>(&device).unwrap();
            let model = deterministic_params(config.init::<Sp>(&device), 5).with_compute_dtype(dtype);
            let held = |tokens: usize| held_per_piece(&model, &checkpointing, &one_sequence(tokens, None, 2, rank.rank()), &device);
            held(256);
            (held(512), held(1024))
        })
    });
    let (short, long) = ranks.swap_remove(0).unwrap_or_else(|p| panic!("{p}"));
    let mut core_seen = 0;
    for ((piece, short), (_, long)) in short.iter().zip(&long) {
        if !matches!(piece, Piece::Core { .. }) {
            continue;
        }
        core_seen += 1;
        let per_token = (*long as f64 - *short as f64) / 512.0;
        println!("{piece:?}: {per_token} bytes per token of the sequence on a rank (the estimate: {core})");
        // Beside the core's: rotary tables and token ids (36 bytes a token here). An estimate
        // that counted the output in the shard's layout too (784) fails, as one without the
        // exchanged copies (336).
        assert!(per_token >= core && per_token <= core + 128.0, "{piece:?} holds {per_token} bytes per token a rank; the estimate says {core}");
    }
    assert_eq!(core_seen, layers);
}

/// One checkpointed step of `shard` in tiles of 64 tokens: the bytes held on `device` before
/// each piece's backward, above what was in use before the step.
fn held_per_piece(
    model: &ulysses_models::Decoder<Sp>,
    checkpointing: &LayerCheckpointing,
    shard: &burn_ulysses::data::SequenceShard,
    device: &<Runtime as cubecl::Runtime>::Device,
) -> Vec<(ulysses_training::Piece, u64)> {
    use ulysses_training::checkpointed_backward;
    let base = bytes_in_use::<Runtime>(device);
    let mut pieces = HeldPerPiece::default();
    let (ids, labels) = (shard.tokens::<Sp>(device), shard.labels::<Sp>(device));
    let (loss, _grads) = checkpointed_backward(model, ids, labels, &shard.positions, 1.0, -100, checkpointing, shard.local_len / 64, |piece| {
        pieces.record(piece, bytes_in_use::<Runtime>(device) - base)
    })
    .unwrap();
    let loss = loss.into_scalar();
    assert!(loss.is_finite(), "loss {loss}");
    pieces.0
}

/// Rank `rank`'s shard (of `sp`) of one sequence of `tokens` tokens, packed in documents of
/// `documents` tokens or one document.
fn one_sequence(tokens: usize, documents: Option<usize>, sp: usize, rank: usize) -> burn_ulysses::data::SequenceShard {
    let sequence: Vec<i64> = (0..tokens as i64).map(|t| (t * 7 + 3) % VOCAB as i64).collect();
    let lengths = documents.map(|len| vec![vec![len; tokens / len]]);
    burn_ulysses::data::SequenceSharder::new(sp).shard_documents(&[sequence], lengths.as_deref(), rank)
}

/// The longest-sequence mode of the memory bench (`--longest-under` with `--documents`)
/// packs short documents so that a trial at a million tokens costs seconds, not the minutes
/// of causal attention over all of them. That measures the right bytes only if a step's
/// memory does not depend on which keys a query sees; on the flash path it must not (no
/// `S × S` buffer; the visible runs are `2 × (S_q + S_kv)` integers). Documents of 64 tokens
/// against one document of 512, in bf16 (f16 where the device lacks it): the checkpointed step piece by piece, and the plain
/// step after its forward and after its backward.
#[test]
fn training_memory_does_not_depend_on_the_mask() {
    use ulysses_training::lm_loss_sum;
    if !runtime_available::<Runtime>() {
        return;
    }
    let tokens = 512;
    let device: <Runtime as cubecl::Runtime>::Device = Default::default();
    let dtype = Precision::Bf16.compute_dtype::<Sp>(&device).unwrap();
    let config = DecoderConfig::new(VOCAB).with_d_model(128).with_n_heads(8).with_n_kv_heads(2).with_ffn_hidden(512).with_repeat_kv(false);
    let model = config.init::<Sp>(&device).with_compute_dtype(dtype);
    let checkpointing = LayerCheckpointing::new().with_offload_to_host(true);
    let plain = |documents: Option<usize>| -> (u64, u64) {
        let shard = one_sequence(tokens, documents, 1, 0);
        let base = bytes_in_use::<Runtime>(&device);
        let output = model.lm_output(shard.tokens::<Sp>(&device), &shard.positions);
        let loss = lm_loss_sum(output, shard.labels::<Sp>(&device), -100);
        let after_forward = bytes_in_use::<Runtime>(&device) - base;
        // A handle on the same tensor (no bytes of its own), read once the bytes are counted.
        let loss_value = loss.clone();
        let grads = loss.backward();
        let after_backward = bytes_in_use::<Runtime>(&device) - base;
        drop(grads);
        let loss_value = loss_value.into_scalar() as f64;
        assert!(loss_value.is_finite(), "plain step, documents {documents:?}: loss {loss_value}");
        (after_forward, after_backward)
    };
    // The first steps allocate what every later one reuses (kernel state, pools): not counted.
    held_per_piece(&model, &checkpointing, &one_sequence(tokens, Some(64), 1, 0), &device);
    plain(Some(64));
    let (one, packed) = (held_per_piece(&model, &checkpointing, &one_sequence(tokens, None, 1, 0), &device), held_per_piece(&model, &checkpointing, &one_sequence(tokens, Some(64), 1, 0), &device));
    println!("checkpointed, one document: {one:?}\ncheckpointed, documents of 64: {packed:?}");
    assert_eq!(packed, one, "a checkpointed step holds other bytes with documents of 64 tokens than with one document");
    assert!(one.iter().all(|&(_, held)| held > 0), "nothing measured: {one:?}");
    let (one, packed) = (plain(None), plain(Some(64)));
    println!("plain (after forward, after backward), one document: {one:?}; documents of 64: {packed:?}");
    assert!(one.0 > 0 && one.1 > 0, "nothing measured: {one:?}");
    assert_eq!(packed, one, "a plain step holds other bytes with documents of 64 tokens than with one document");
}

/// The node of given gradients (the chunked loss's) scales a half-precision gradient by its
/// upstream scalar (the loss's 1 / valid tokens, f32) in f32 and rounds once: each element is
/// the f16 nearest the exact product. The scalar cast to f16 first, then multiplied in f16, made
/// two roundings (off by up to 0.4% in bf16; in f16, 1 / N is subnormal past N = 16 384).
#[test]
fn a_given_half_precision_gradient_is_scaled_by_its_upstream_in_f32() {
    use burn::tensor::{Tensor, TensorData, TensorPrimitive, f16};
    use ulysses_training::TrainBackend;
    if !runtime_available::<Runtime>() {
        return;
    }
    let device = Default::default();
    // 1 + i/64: exact in f16; 12 289 tokens: 1/N is no f16.
    let values: Vec<f32> = (1..=64).map(|i| 1.0 + i as f32 / 64.0).collect();
    let tokens = 12_289.0f64;
    let half = |values: &[f32]| TensorData::new(values.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>(), [values.len()]);
    let parent = Tensor::<Ad, 1>::from_data(half(&values), (&device, DType::F16)).require_grad();
    let given = Tensor::<Wgpu, 1>::from_data(half(&values), (&device, DType::F16)).into_primitive().tensor();
    let value = Tensor::<Wgpu, 1>::zeros([1], &device).into_primitive().tensor();
    let node = Tensor::<Ad, 1>::from_primitive(TensorPrimitive::Float(Ad::with_gradients(value, [(parent.clone().into_primitive().tensor(), given)])));
    let grads = node.mul_scalar(1.0 / tokens).sum().backward();
    let got = parent.grad(&grads).expect("the parent's gradient").into_data();
    assert_eq!(got.dtype, DType::F16);
    let got = got.convert::<f32>().to_vec::<f32>().unwrap();
    let wrong: Vec<(f32, f32, f32)> = values
        .iter()
        .zip(&got)
        .map(|(&v, &g)| (v, g, f16::from_f64(f64::from(v) / tokens).to_f32()))
        .filter(|(_, g, exact)| g != exact)
        .collect();
    assert!(wrong.is_empty(), "{} of 64 not the f16 nearest value / {tokens} (value, got, nearest): {wrong:?}", wrong.len());
}

/// A half-precision embedding (a compute copy's weight, looked up outside layer checkpointing)
/// sums a repeated token's gradient rows in f32, as PyTorch's embedding backward does, and
/// keeps its dtype: 4 096 lookups of one row give 4 096, where f16's own sum stops at 2 048
/// (its spacing there is 2; in bf16 the sum stops at 256 times the addends).
#[test]
fn a_half_precision_embedding_sums_a_repeated_tokens_rows_in_f32() {
    use burn::tensor::{Int, Tensor};
    if !runtime_available::<Runtime>() {
        return;
    }
    const REPEATS: usize = 4096;
    const WIDTH: usize = 8;
    let device = Default::default();
    let weight = Tensor::<Ad, 2>::zeros([3, WIDTH], (&device, DType::F16)).require_grad();
    let tokens = Tensor::<Ad, 2, Int>::ones([1, REPEATS], &device);
    let embedded = burn::tensor::module::embedding(weight.clone(), tokens);
    let grads = embedded.cast(FloatDType::F32).sum().backward();
    let got = weight.grad(&grads).expect("the weight's gradient").into_data();
    assert_eq!(got.dtype, DType::F16, "the gradient keeps the weight's dtype");
    let got = got.convert::<f32>().to_vec::<f32>().unwrap();
    let want: Vec<f32> = (0..3).flat_map(|row| [if row == 1 { REPEATS as f32 } else { 0.0 }; WIDTH]).collect();
    assert_eq!(got, want, "row 1 looked up {REPEATS} times (rows 0 and 2 never)");
}
