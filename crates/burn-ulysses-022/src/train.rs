//! What a sequence-parallel training step needs besides attention, for burn 0.22 models: each
//! rank's part of the token-weighted loss, and gradients summed over the group.
//!
//! A step, on every rank of the group (each holding its [`SequenceShard`](crate::data::SequenceShard)
//! of the same batch, from `SequenceSharder`):
//!
//! ```text
//! let labels = SequenceSharder::labels_in(&batch);            // the whole batch's, on every rank
//! let loss = lm_loss_sum(model.forward(tokens, positions), shard_labels, IGNORE_INDEX) / labels;
//! let grads = all_reduce_gradients(&model, GradientsParams::from_grads(loss.backward(), &model));
//! model = optimizer.step(lr, model, grads);                   // the same step on every rank
//! ```
//!
//! Each rank's loss is its tokens' cross-entropy over the whole batch's label count, so the
//! ranks' losses and gradients sum to the single-device ones.

use std::sync::Arc;

use burn::{
    module::{Module, ModuleVisitor, Param},
    optim::GradientsParams,
    tensor::{Int, Tensor, TensorData, activation::log_softmax},
};
use ulysses_core::comm::{Collective, ThreadCommunicator, mixed_kinds};

use crate::context;

/// Cross-entropy of `logits` `[batch, seq, vocab]` against `labels` `[batch, seq]`, summed over
/// the labels that are not `ignore_index`: `[1]`.
pub fn lm_loss_sum(logits: Tensor<3>, labels: Tensor<2, Int>, ignore_index: i64) -> Tensor<1> {
    let [batch, seq, _] = logits.dims();
    let ignored = labels.clone().equal_elem(ignore_index);
    // Ignored positions read class 0, then count for nothing.
    let classes = labels.mask_fill(ignored.clone(), 0).reshape([batch, seq, 1]);
    let log_likelihood = log_softmax(logits, 2).gather(2, classes).reshape([batch, seq]);
    log_likelihood.mask_fill(ignored, 0.0).sum().neg()
}

/// `grads` of `model`'s parameters summed over this thread's group, in rank order (so every
/// rank holds bit-identical sums and takes the same optimizer step); a parameter no rank has a
/// gradient for (frozen) stays without one. Outside a group, or in a group of one, `grads`
/// unchanged.
///
/// # Panics
///
/// When a collective fails (a rank died or ran another model), naming it.
pub fn all_reduce_gradients<M: Module>(model: &M, grads: GradientsParams) -> GradientsParams {
    let Some(group) = context::current().filter(|group| group.size() > 1) else { return grads };
    let mut sum = GradientSum { group: &group, grads };
    model.visit(&mut sum);
    sum.grads
}

/// `value` summed over this thread's group (a loss to report), in rank order.
pub fn all_reduce_sum(value: f64) -> f64 {
    match context::current().filter(|group| group.size() > 1) {
        None => value,
        Some(group) => sum_in_rank_order(&group, Some(Arc::new(vec![value])))
            .unwrap_or_else(|error| panic!("summing a value over the group: {error}"))
            .expect("every rank gave a value")[0],
    }
}

struct GradientSum<'a> {
    group: &'a ThreadCommunicator,
    grads: GradientsParams,
}

impl ModuleVisitor for GradientSum<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let gradient = self.grads.remove::<D>(param.id);
        let (shape, device, dtype) = match &gradient {
            Some(gradient) => (gradient.dims(), gradient.device(), gradient.dtype()),
            None => (param.val().dims(), param.val().device(), param.val().dtype()),
        };
        let values = gradient.map(|gradient| Arc::new(gradient.into_data().convert::<f64>().try_into_vec::<f64>().expect("a float gradient")));
        let summed = sum_in_rank_order(self.group, values).unwrap_or_else(|error| panic!("summing the gradient of parameter {}: {error}", param.id));
        // No rank has a gradient (a frozen parameter): none, as on one device.
        if let Some(summed) = summed {
            // Back in the gradient's own dtype (summed in f64).
            self.grads.register(param.id, Tensor::<D>::from_data(TensorData::new(summed, shape), (&device, dtype)));
        }
    }
}

/// Every rank's `values` added up in rank order, in f64; a rank without values adds zeros,
/// and `None` when no rank has any.
fn sum_in_rank_order(group: &ThreadCommunicator, values: Option<Arc<Vec<f64>>>) -> Result<Option<Vec<f64>>, ulysses_core::comm::CommError> {
    let op = Collective::AllReduce;
    let (_, deposits) = group.round(op, Box::new(values), |deposits| {
        deposits.iter().map(|d| d.as_ref().and_then(|d| d.downcast_ref::<Option<Arc<Vec<f64>>>>()).cloned()).collect::<Option<Vec<_>>>()
    })?;
    let deposits = deposits.ok_or_else(|| mixed_kinds(op))?;
    let present: Vec<(usize, &Arc<Vec<f64>>)> = deposits.iter().enumerate().filter_map(|(rank, values)| values.as_ref().map(|v| (rank, v))).collect();
    let Some(&(_, first)) = present.first() else { return Ok(None) };
    if let Some(&(rank, other)) = present.iter().find(|(_, values)| values.len() != first.len()) {
        return Err(ulysses_core::comm::CommError::Diverged { what: "values to sum", mine: first.len(), rank, theirs: other.len() });
    }
    Ok(Some((0..first.len()).map(|i| present.iter().map(|(_, values)| values[i]).sum()).collect()))
}
