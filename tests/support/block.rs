//! The Llama-block equivalence check shared by the SP tests: P in-process ranks under
//! `UlyssesBackend<Inner>` against one device on `Autodiff<NdArray>`.
//!
//! Each rank's loss is `Σ output · W` over its shard, so the ranks' losses add up to the
//! single-device loss: input gradients must match shard by shard, parameter gradients once
//! summed over ranks.

use std::time::Duration;

use burn::{
    backend::{Autodiff, NdArray},
    tensor::{Tensor, TensorData, backend::AutodiffBackend},
};
use burn_ulysses::{ExchangeBackend, UlyssesBackend, comm::ThreadGroup};
use ulysses_llama::{LlamaConfig, RopeTables};

use crate::{deterministic_params, max_abs_diff, parameter_grads, shard, sum_vectors, uniform_tensor, values, with_deadline};

type Reference = Autodiff<NdArray<f32>>;

const BATCH: usize = 2;
const SEQ: usize = 24;
const HEAD_DIM: usize = 8;
const SEED: u64 = 7;

#[derive(Clone, Copy, Debug)]
pub struct BlockCase {
    pub sp: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub causal: bool,
    /// The model expands kv heads itself (what a plain burn model does) instead of passing
    /// grouped kv heads to attention.
    pub model_repeats_kv: bool,
}

impl BlockCase {
    pub fn new(sp: usize, heads: usize, kv_heads: usize) -> Self {
        Self { sp, heads, kv_heads, causal: true, model_repeats_kv: false }
    }

    fn config(&self) -> LlamaConfig {
        LlamaConfig::new(16)
            .with_d_model(self.heads * HEAD_DIM)
            .with_n_heads(self.heads)
            .with_n_kv_heads(self.kv_heads)
            .with_ffn_hidden(48)
            .with_causal(self.causal)
    }
}

struct Outcome {
    output: TensorData,
    input_grad: TensorData,
    param_grads: Vec<(String, Vec<f32>)>,
}

/// Runs the block on `x` (positions `offset..`), with loss `Σ output · weights`.
fn run_block<B: AutodiffBackend>(config: &LlamaConfig, x: Tensor<B, 3>, weights: Tensor<B, 3>, offset: usize) -> Outcome {
    let device = x.device();
    let block = deterministic_params(config.init_block::<B>(&device), SEED);
    let x = x.require_grad();
    let rope = RopeTables::new(offset, x.dims()[1], config.head_dim(), config.rope_theta, &device);
    let output = block.forward(x.clone(), &rope);
    let grads = (output.clone() * weights).sum().backward();
    Outcome {
        output: output.into_data().convert::<f32>(),
        input_grad: x.grad(&grads).expect("input has a gradient").into_data().convert::<f32>(),
        param_grads: parameter_grads(&block, &grads),
    }
}

fn inputs<B: AutodiffBackend>(case: &BlockCase, device: &B::Device) -> (Tensor<B, 3>, Tensor<B, 3>) {
    let shape = [BATCH, SEQ, case.heads * HEAD_DIM];
    (uniform_tensor(shape, 1, device), uniform_tensor(shape, 2, device))
}

/// Checks `case` with the ranks on `UlyssesBackend<Inner>` (an autodiff backend), within
/// `tolerance` (max absolute difference) of one device.
pub fn check_block_equivalence<Inner>(case: BlockCase, tolerance: f32)
where
    Inner: AutodiffBackend + ExchangeBackend,
    Inner::InnerBackend: ExchangeBackend,
{
    let device = Default::default();
    let (x, weights) = inputs::<Reference>(&case, &device);
    // Burn's own attention needs kv heads expanded to the q head count.
    let reference = run_block(&case.config().with_repeat_kv(true), x, weights, 0);

    let per_rank = with_deadline(Duration::from_secs(50), move || {
        ThreadGroup::new(case.sp).run(|rank| {
            let _sp = UlyssesBackend::<Inner>::enter_thread(rank.communicator());
            let device = Default::default();
            let (x, weights) = inputs::<UlyssesBackend<Inner>>(&case, &device);
            let (r, p) = (rank.rank(), rank.size());
            let config = case.config().with_repeat_kv(case.model_repeats_kv);
            run_block(&config, shard(x, 1, r, p), shard(weights, 1, r, p), r * SEQ / p)
        })
    });
    let per_rank: Vec<Outcome> = per_rank.into_iter().map(|r| r.unwrap_or_else(|panic| panic!("{panic}"))).collect();

    let full = |data: &TensorData| Tensor::<NdArray<f32>, 3>::from_data(data.clone(), &device);
    let mut output_diff = 0.0f32;
    let mut input_grad_diff = 0.0f32;
    for (r, outcome) in per_rank.iter().enumerate() {
        let want = values(shard(full(&reference.output), 1, r, case.sp));
        output_diff = output_diff.max(max_abs_diff(&values(full(&outcome.output)), &want));
        let want = values(shard(full(&reference.input_grad), 1, r, case.sp));
        input_grad_diff = input_grad_diff.max(max_abs_diff(&values(full(&outcome.input_grad)), &want));
    }
    let mut param_grad_diff = 0.0f32;
    for (i, (name, want)) in reference.param_grads.iter().enumerate() {
        let summed = sum_vectors(per_rank.iter().map(|o| &o.param_grads[i].1));
        assert_eq!(&per_rank[0].param_grads[i].0, name);
        let diff = max_abs_diff(&summed, want);
        assert!(diff <= tolerance, "{case:?}: gradient of {name} differs by {diff:e}");
        param_grad_diff = param_grad_diff.max(diff);
    }
    println!(
        "{case:?} on {}: max |Δ| output {output_diff:.2e}, input grad {input_grad_diff:.2e}, \
         parameter grads {param_grad_diff:.2e} ({} parameters)",
        std::any::type_name::<Inner>(),
        reference.param_grads.len()
    );
    assert!(output_diff <= tolerance, "{case:?}: output differs by {output_diff:e}");
    assert!(input_grad_diff <= tolerance, "{case:?}: input gradient differs by {input_grad_diff:e}");
}
