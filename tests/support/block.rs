//! The Llama-block equivalence check shared by the SP tests: P in-process ranks under
//! `UlyssesBackend<Inner>` against one device on `Autodiff<NdArray>`.
//!
//! Each rank's loss is `Σ output · W` over its shard, so the ranks' losses add up to the
//! single-device loss: input gradients must match shard by shard, parameter gradients once
//! summed over ranks.
//!
//! With packed documents the reference is independent of the packing code: each document
//! runs alone through the block on one device (positions from 0, plain causal attention),
//! and the packed run must equal the documents' outputs and summed gradients.

use std::time::Duration;

use burn::{
    backend::{Autodiff, NdArray},
    tensor::{Tensor, TensorData, backend::AutodiffBackend},
};
use std::sync::Arc;

use burn_ulysses::{
    ExchangeBackend, RankScope, UlyssesBackend, UlyssesConfig,
    comm::{Communicator, ThreadGroup},
    data::SequenceSharder,
    ring::RingSharding,
    visibility::PositionIds,
};
use ulysses_models::{DecoderConfig, rope_tables::RopeTables};

use crate::{deterministic_params, max_abs_diff, parameter_grads, sum_vectors, uniform_tensor, values, with_deadline};

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
    /// Per sequence (2 of 24 tokens, `seq` must stay 24), the lengths of the documents packed into it.
    pub documents: Option<[&'static [usize]; BATCH]>,
    /// Ring degree of Ulysses × Ring: `sp` ranks in `sp / ring` Ulysses groups of
    /// consecutive ranks, and `sp / ring` rings (1: Ulysses alone).
    pub ring: usize,
    /// How the sequence is cut over the ring.
    pub ring_sharding: RingSharding,
    /// Tokens per sequence (24; documents are laid out for 24).
    pub seq: usize,
}

impl BlockCase {
    pub fn new(sp: usize, heads: usize, kv_heads: usize) -> Self {
        Self { sp, heads, kv_heads, causal: true, model_repeats_kv: false, documents: None, ring: 1, ring_sharding: RingSharding::Contiguous, seq: SEQ }
    }

    /// Documents whose boundaries fall on shard edges (6, 12 at SP 2 and 4) and inside shards,
    /// 3 and 4 per sequence, one of a single token.
    pub fn packed(sp: usize, heads: usize, kv_heads: usize) -> Self {
        Self { documents: Some([&[6, 6, 12], &[5, 1, 13, 5]]), ..Self::new(sp, heads, kv_heads) }
    }

    /// The positions of the sequence rank `rank` holds, as the sharder places them.
    fn positions_of(&self, rank: usize) -> Vec<usize> {
        SequenceSharder::new(self.sp).with_ring_size(self.ring).with_ring_sharding(self.ring_sharding).positions_of(rank, self.seq)
    }

    /// Position ids of the whole batch: restarting at each document.
    fn position_ids(&self) -> Option<PositionIds> {
        let documents = self.documents?;
        let ids = documents.iter().flat_map(|lengths| lengths.iter().flat_map(|&len| 0..len as u64)).collect();
        Some(PositionIds::new(ids, BATCH, SEQ).unwrap())
    }

    fn config(&self) -> DecoderConfig {
        DecoderConfig::new(16)
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

/// Runs the block on `x` at `positions` (attention within documents when `packed`), with
/// loss `Σ output · weights`.
fn run_block<B: AutodiffBackend>(config: &DecoderConfig, x: Tensor<B, 3>, weights: Tensor<B, 3>, positions: &PositionIds, packed: bool) -> Outcome {
    let device = x.device();
    let block = deterministic_params(config.init_block::<B>(&device), SEED);
    let x = x.require_grad();
    let rope = RopeTables::at(positions, config.head_dim(), config.rope_theta, config.rope_scaling, &device);
    let output = block.forward(x.clone(), &rope, packed.then_some(positions));
    let grads = (output.clone() * weights).sum().backward();
    Outcome {
        output: output.into_data().convert::<f32>(),
        input_grad: x.grad(&grads).expect("input has a gradient").into_data().convert::<f32>(),
        param_grads: parameter_grads(&block, &grads),
    }
}

/// Each document of `documents` alone through the block on one device; outputs and input
/// gradients put back in place, parameter gradients summed.
fn run_documents_one_by_one(config: &DecoderConfig, x: Tensor<Reference, 3>, weights: Tensor<Reference, 3>, documents: [&[usize]; BATCH]) -> Outcome {
    let (mut outputs, mut input_grads, mut param_grads): (Vec<Tensor<NdArray<f32>, 3>>, Vec<_>, Vec<Vec<(String, Vec<f32>)>>) = (vec![], vec![], vec![]);
    for (b, lengths) in documents.iter().enumerate() {
        let (mut row_outputs, mut row_grads) = (vec![], vec![]);
        let mut start = 0;
        for &len in lengths.iter() {
            let piece = |t: &Tensor<Reference, 3>| t.clone().inner().narrow(0, b, 1).narrow(1, start, len);
            let (x, weights) = (Tensor::<Reference, 3>::from_inner(piece(&x)), Tensor::<Reference, 3>::from_inner(piece(&weights)));
            let outcome = run_block(config, x, weights, &PositionIds::consecutive(1, 0, len), false);
            let device = Default::default();
            row_outputs.push(Tensor::<NdArray<f32>, 3>::from_data(outcome.output, &device));
            row_grads.push(Tensor::<NdArray<f32>, 3>::from_data(outcome.input_grad, &device));
            param_grads.push(outcome.param_grads);
            start += len;
        }
        outputs.push(Tensor::cat(row_outputs, 1));
        input_grads.push(Tensor::cat(row_grads, 1));
    }
    let names: Vec<String> = param_grads[0].iter().map(|(name, _)| name.clone()).collect();
    Outcome {
        output: Tensor::cat(outputs, 0).into_data(),
        input_grad: Tensor::cat(input_grads, 0).into_data(),
        param_grads: names.into_iter().enumerate().map(|(i, name)| (name, sum_vectors(param_grads.iter().map(|p| &p[i].1)))).collect(),
    }
}

/// The rows of `[B, S, D]` at `positions`, in that order.
fn take_positions<B: burn::tensor::backend::Backend>(tensor: Tensor<B, 3>, positions: &[usize]) -> Tensor<B, 3> {
    let indices: Vec<i64> = positions.iter().map(|&p| p as i64).collect();
    let device = tensor.device();
    tensor.select(1, Tensor::<B, 1, burn::tensor::Int>::from_data(TensorData::new(indices.clone(), [indices.len()]), &device))
}

fn inputs<B: AutodiffBackend>(case: &BlockCase, device: &B::Device) -> (Tensor<B, 3>, Tensor<B, 3>) {
    let shape = [BATCH, case.seq, case.heads * HEAD_DIM];
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
    let reference_config = case.config().with_repeat_kv(true);
    let reference = match case.documents {
        None => run_block(&reference_config, x, weights, &PositionIds::consecutive(BATCH, 0, case.seq), false),
        Some(documents) => run_documents_one_by_one(&reference_config, x, weights, documents),
    };

    let per_rank = with_deadline(Duration::from_secs(50), move || {
        ThreadGroup::new(case.sp).run(|rank| {
            let _sp = if case.ring == 1 {
                UlyssesBackend::<Inner>::enter_thread(rank.communicator())
            } else {
                // Ulysses groups of consecutive ranks (together: one chunk), rings across them.
                let world: Arc<dyn Communicator<<Inner as ExchangeBackend>::Wire>> = rank.communicator();
                let (chunk, member) = burn_ulysses::layout::ring_coordinates(rank.rank(), case.sp / case.ring);
                let ulysses = world.split(chunk as u32, member as u32).unwrap();
                let ring = world.split(member as u32, chunk as u32).unwrap();
                UlyssesBackend::<Inner>::enter_hybrid(RankScope::Thread, ulysses, ring, UlyssesConfig::new().with_ring_sharding(case.ring_sharding))
            };
            let device = Default::default();
            let (x, weights) = inputs::<UlyssesBackend<Inner>>(&case, &device);
            let r = rank.rank();
            let config = case.config().with_repeat_kv(case.model_repeats_kv);
            let mine = case.positions_of(r);
            let positions = match case.position_ids() {
                // This rank's shard of the packed ids.
                Some(ids) => PositionIds::new((0..BATCH).flat_map(|b| mine.iter().map(|&at| ids.row(b)[at]).collect::<Vec<_>>()).collect(), BATCH, mine.len()).unwrap(),
                None => PositionIds::new(mine.iter().map(|&at| at as u64).collect::<Vec<_>>().repeat(BATCH), BATCH, mine.len()).unwrap(),
            };
            run_block(&config, take_positions(x, &mine), take_positions(weights, &mine), &positions, case.documents.is_some())
        })
    });
    let per_rank: Vec<Outcome> = per_rank.into_iter().map(|r| r.unwrap_or_else(|panic| panic!("{panic}"))).collect();

    let full = |data: &TensorData| Tensor::<NdArray<f32>, 3>::from_data(data.clone(), &device);
    let mut output_diff = 0.0f32;
    let mut input_grad_diff = 0.0f32;
    for (r, outcome) in per_rank.iter().enumerate() {
        let mine = case.positions_of(r);
        let want = values(take_positions(full(&reference.output), &mine));
        output_diff = output_diff.max(max_abs_diff(&values(full(&outcome.output)), &want));
        let want = values(take_positions(full(&reference.input_grad), &mine));
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
