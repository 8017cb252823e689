//! Mixed precision (`Precision::Bf16`: f32 master weights, the layers in half precision) on a
//! CubeCL device: wgpu on lavapipe has f16 but no bf16, so there it computes in f16 (bf16
//! runs on CUDA only). The Llama example at SP=2 (thread ranks), against the same run in
//! f32:
//! - one backward step: the loss within 1e-3 relative and every parameter's gradient within
//!   1e-2 relative (L2) of f32's, yet not equal to them (the layers really ran in half
//!   precision); every gradient f32; the attention exchanges moved exactly half the bytes;
//! - three AdamW steps, also with whole-layer checkpointing (offloaded) and the MLP in tiles
//!   of 3 tokens: losses within 1e-3 relative, parameters still f32 afterwards.
//!
//! The tolerances are f16's: 11 significant bits (4.9e-4 per rounding) through two layers,
//! the norms, RoPE, softmax statistics and loss being f32.

use burn::{
    backend::{Autodiff, NdArray},
    optim::AdamWConfig,
    tensor::{DType, FloatDType},
};
use burn_ulysses::{
    RankScope, UlyssesBackend, UlyssesConfig,
    comm::ThreadGroup,
    precision::Precision,
    train::{LayerCheckpointing, ParallelGroups, ParallelLayout, StepInput, backward_step, float_parameters},
};
use ulysses_kernels::testing::runtime_available;
use ulysses_llama::{
    LlamaConfig,
    train::{RunOptions, StepData, TrainConfig, train_rank},
};
use ulysses_suite::{VariedLengths, deterministic_params, gradient_params_dtypes, gradient_params_values, with_deadline};

type Runtime = cubecl::wgpu::WgpuRuntime;
type Wgpu = burn_cubecl::CubeBackend<Runtime, f32, i32, u32>;
type Sp = UlyssesBackend<Autodiff<Wgpu>>;

const VOCAB: usize = 32;
const LOSS_TOLERANCE: f64 = 1e-3;
const GRADIENT_TOLERANCE: f64 = 1e-2;

fn config(precision: Precision) -> TrainConfig {
    let model = LlamaConfig::new(VOCAB).with_d_model(64).with_n_heads(4).with_n_kv_heads(2).with_ffn_hidden(128).with_repeat_kv(false);
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
        let step = StepInput { index: 0, learning_rate: 0.0, micro_batches: &micro_batches, documents: None };
        let local = backward_step(&model, &step, &config.sharder(), &groups, &device).unwrap();
        let grad_dtypes = gradient_params_dtypes(&model, &local.grads);
        Backward {
            dtype,
            loss: local.loss,
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

#[test]
fn half_precision_training_keeps_f32_parameters_and_follows_f32_losses() {
    if !runtime_available::<Runtime>() {
        return;
    }
    let run = |config: TrainConfig| {
        let mut ranks = ThreadGroup::new(2).run(|rank| {
            let groups: ParallelGroups<Wgpu> = ParallelGroups::new(rank.communicator(), config.layout).unwrap();
            let _sp = burn_ulysses::context::enter(RankScope::Thread, groups.rank_context(UlyssesConfig::new()));
            let device = Default::default();
            let model = deterministic_params(config.model.init::<Sp>(&device), 5);
            let (model, reports) = train_rank::<Sp>(&config, model, &VariedLengths { vocab: VOCAB }, &groups, &device, RunOptions::default()).unwrap();
            let dtypes: Vec<DType> = float_parameters(&model).iter().map(|p| p.values.dtype()).collect();
            (reports.iter().map(|r| r.loss).collect::<Vec<_>>(), dtypes)
        });
        ranks.swap_remove(0).unwrap_or_else(|p| panic!("{p}"))
    };
    let checkpointed = config(Precision::Bf16).with_layer_checkpointing(Some(LayerCheckpointing::new().with_offload_to_host(true).with_mlp_tile_tokens(Some(3))));
    let ((full, _), (half, dtypes), (half_checkpointed, checkpointed_dtypes)) =
        with_deadline(std::time::Duration::from_secs(300), move || (run(config(Precision::F32)), run(config(Precision::Bf16)), run(checkpointed)));
    for (step, ((h, c), f)) in half.iter().zip(&half_checkpointed).zip(&full).enumerate() {
        let (error, checkpointed_error) = (((h - f) / f).abs(), ((c - f) / f).abs());
        println!("step {step}: loss f32 {f:.6}, half {h:.6} ({error:.2e}), half checkpointed + tiled {c:.6} ({checkpointed_error:.2e})");
        assert!(error <= LOSS_TOLERANCE, "step {step}: the loss differs by {error:e} relative");
        assert!(checkpointed_error <= LOSS_TOLERANCE, "step {step}: checkpointed, the loss differs by {checkpointed_error:e} relative");
    }
    assert_eq!(checkpointed_dtypes, dtypes);
    assert!(!dtypes.is_empty() && dtypes.iter().all(|&d| d == DType::F32), "parameters after training in half precision: {dtypes:?}");
}

#[test]
fn bf16_on_a_backend_without_half_precision_is_refused_by_name() {
    let error = Precision::Bf16.compute_dtype::<NdArray>(&Default::default()).unwrap_err().to_string();
    assert!(error.contains("neither bf16 nor f16") && error.contains("--precision f32"), "{error}");
    assert_eq!(Precision::F32.compute_dtype::<NdArray>(&Default::default()).unwrap(), FloatDType::F32);
}
