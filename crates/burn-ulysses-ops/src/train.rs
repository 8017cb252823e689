//! What a sequence-parallel training step needs besides attention, for burn 0.22 models: each
//! rank's part of the token-weighted loss, and gradients summed over the job.
//!
//! A step, on every rank (each holding its [`SequenceShard`] of its
//! data-parallel replica's part of the batch, from `SequenceSharder`):
//!
//! ```text
//! let count = labels_in_step(&shard) as f64;                 // the job's labelled tokens
//! if count == 0.0 { continue; }                               // none on any rank: 0/0, and AdamW would move
//! let loss = lm_loss_sum(model.forward(tokens, positions), shard_labels, IGNORE_INDEX) / count;
//! let grads = all_reduce_gradients(&model, GradientsParams::from_grads(loss.backward(), &model));
//! model = optimizer.step(lr, model, grads);                   // the same step on every rank
//! ```
//!
//! Each rank's loss is its tokens' cross-entropy over the whole batch's label count, so the
//! ranks' losses and gradients, summed over every SP and DP rank, are the single-device ones.
//! With micro-batches, count every micro-batch's shard first (`labels_in_step` of each,
//! summed) and divide each micro-batch's loss sum by that total: each by its own count would
//! average the micro-batches' means, not the step's tokens.
//! The count is the shards' `valid_tokens` summed over the job: right for chosen targets too,
//! where `SequenceSharder::labels_in` (every token but each row's last, of the whole global
//! batch) counts too many. [`labels_in_step`] also checks, before the forward, that the shard
//! is one the thread's group attends over as one sequence: this crate cannot see a model's
//! positions, so a shard attended outside its group would be attended within itself, silently.
//! The step stays the same on every rank only if nothing in it measures the gradients per
//! rank on a GPU: burn's norm clipping (`GradientClippingConfig::Norm`) sums squares on the
//! device, a sum that is not bit-reproducible there, and would clip the ranks apart (burn 0.21's
//! trainer clips with rank 0's norm instead; clipping by value is element-wise and safe).

use burn::{
    module::{Module, ModuleVisitor, Param},
    optim::GradientsParams,
    tensor::{Device, FloatDType, Int, Tensor, activation::log_softmax},
};
use ulysses_core::{
    comm::{Collective, CommError, HostCommunicator, HostDType, HostTensor, ReduceOp, all_gather_host_checked},
    gradients::{GRADIENT_BUCKET_BYTES, plan_buckets, present_anywhere},
};

use crate::{context, data::SequenceShard, host};

/// The labelled tokens of this step over the whole job, every rank's `shard.valid_tokens`
/// summed (exactly, in rank order): what each rank's [`lm_loss_sum`] is divided by. Every rank
/// calls it with the shard it trains on, before the forward (a collective over the job).
///
/// # Panics
///
/// On every rank where a rank's shard is not one its thread's groups can attend over, which
/// would be attention within the shard alone, or over shards out of order, with no error: a
/// shard cut for `P` ranks needs a sequence-parallel group of `P` ranks entered on this thread
/// (or its process), in which it is the rank's own (`rank.sp_rank`'s); whole sequences in a
/// group of more ranks would be joined as one; a zigzag ring's shard (two runs) and packed
/// documents in a group of two or more need attention this crate does not have (Ulysses over
/// one run of tokens per rank, no document attention). And when a collective fails.
pub fn labels_in_step(shard: &SequenceShard) -> usize {
    let problem = shard_outside_its_groups(shard);
    context::note_step_shard(shard.batch, shard.local_len);
    // Each rank's verdict reaches every rank before any refuses: a rank alone refusing would
    // leave the others waiting in the next collective.
    let every_rank = context::world().filter(|group| group.size() > 1).map(|world| {
        all_gather_host_checked(&*world, &[shard.valid_tokens as u64, problem.is_some() as u64], "the step's labelled tokens")
            .unwrap_or_else(|error| panic!("counting the step's labelled tokens: {error}"))
    });
    if let Some(problem) = problem {
        panic!("{problem}");
    }
    let Some(every_rank) = every_rank else { return shard.valid_tokens };
    if let Some(rank) = every_rank.iter().position(|verdict| verdict[1] != 0) {
        panic!("rank {rank} of the job holds a shard its sequence-parallel group cannot attend over (its own panic says why): the step is refused on every rank");
    }
    every_rank.iter().map(|verdict| verdict[0] as usize).sum()
}

/// Why this thread's groups cannot attend over `shard` as the sequences it was cut from, if so.
fn shard_outside_its_groups(shard: &SequenceShard) -> Option<String> {
    let cut = shard.positions.cut;
    let sequence = context::current();
    let (size, rank) = sequence.as_ref().map_or((1, 0), |group| (group.size(), group.rank()));
    let fix = "shard with SequenceSharder::new(rank.sp_size).shard(replica, rank.sp_rank) and run the step on the rank's own thread, \
               where job::run_ranks entered its groups (or context::enter_groups with the SP group and the whole job)";
    if cut.of != size {
        let held = match &sequence {
            None => "this thread has entered no sequence-parallel group: attention would be one device's, over the shard alone".to_string(),
            Some(_) if cut.of == 1 => format!("are whole sequences in a sequence-parallel group of {size} ranks: attention would join the ranks' rows as one sequence"),
            Some(_) => format!(
                "this thread's sequence-parallel group has {size} ranks (under data parallelism, the whole job entered as the sequence group?): \
                 attention would join other shards"
            ),
        };
        let what = if cut.of == 1 { "These tokens".to_string() } else { format!("A shard of sequences cut for {} ranks, but", cut.of) };
        return Some(format!("{what} {held}. Fix: {fix}"));
    }
    if cut.index != rank {
        return Some(format!(
            "shard {} of sequences cut for {size} ranks, on rank {rank} of its sequence-parallel group: attention would join the shards out of \
             order (a shard taken at the rank's place in the job, or in its data-parallel group?). Fix: {fix}",
            cut.index
        ));
    }
    if size > 1 && cut.runs != 1 {
        return Some(format!(
            "a zigzag ring's shard (two runs of tokens per rank): burn_ulysses_ops attends with Ulysses alone, over one run of consecutive \
             tokens per rank. Shard with SequenceSharder::new({size}) (no ring)"
        ));
    }
    if size > 1 && packs_documents(shard) {
        return Some(format!(
            "rows packing several documents, in a sequence-parallel group of {size} ranks: burn_ulysses_ops' attention has no document \
             attention, and a mask of the documents (which one device could pass) cannot follow the exchange, so each token would \
             attend across the documents before it. Shard one document per row (SequenceSharder::shard), or train on burn 0.21 \
             with burn-ulysses' attention_in_documents"
        ));
    }
    None
}

/// Whether a row of `shard` holds a token that begins a document after another's (its
/// position restarts): a packed row. Padding, which comes last and attends to nothing a label
/// reads, does not count; the shard's first token begins one where it restarts at 0 on a
/// shard after the first.
fn packs_documents(shard: &SequenceShard) -> bool {
    shard.positions.packed
        && (0..shard.batch).any(|row| {
            let ids = shard.positions.ids.row(row);
            let padding = &shard.padding[row * shard.local_len..(row + 1) * shard.local_len];
            (0..ids.len()).filter(|&i| !padding[i]).any(|i| if i == 0 { shard.positions.cut.index > 0 && ids[0] == 0 } else { ids[i] != ids[i - 1] + 1 })
        })
}

/// Cross-entropy of `logits` `[batch, seq, vocab]` against `labels` `[batch, seq]`, summed over
/// the labels that are not `ignore_index`: `[1]`.
pub fn lm_loss_sum(logits: Tensor<3>, labels: Tensor<2, Int>, ignore_index: i64) -> Tensor<1> {
    let [batch, seq, _] = logits.dims();
    let ignored = labels.clone().equal_elem(ignore_index);
    // Ignored positions read class 0, then count for nothing.
    let classes = labels.mask_fill(ignored.clone(), 0).reshape([batch, seq, 1]);
    // In f32 whatever the logits' dtype, as burn-ulysses' head computes its softmax and loss.
    let log_likelihood = log_softmax(logits.cast(FloatDType::F32), 2).gather(2, classes).reshape([batch, seq]);
    log_likelihood.mask_fill(ignored, 0.0).sum().neg()
}

/// `grads` of `model`'s parameters summed over this rank's job (every SP and DP rank), by the
/// same rules as
/// burn-ulysses (`ulysses_core::gradients`: module order, buckets of one dtype, a parameter with
/// a gradient on any rank summed on every rank, a frozen one left without). Sums are computed
/// in rank order by the transport, so every rank holds the same bits and takes the same
/// optimizer step. Outside a group, or in a group of one, `grads` unchanged.
///
/// # Panics
///
/// When a collective fails (a rank died or ran another model), naming it; and at the first sum
/// of a model new to any rank's thread, where the ranks' parameters differ (models built from other seeds: rank threads
/// share a device's random generator, so `init` on each draws other weights), which would
/// train the replicas apart.
pub fn all_reduce_gradients<M: Module>(model: &M, grads: GradientsParams) -> GradientsParams {
    context::forget_step_shards();
    let Some(group) = context::world().filter(|group| group.size() > 1) else { return grads };
    // Once a model a thread (told by its first parameter's id: a model built anew has another,
    // a record loaded the record's). A comparison is a collective: every rank compares where any
    // rank's model is new to it (one that loaded rank 0's record has rank 0's ids).
    let compared = (first_parameter_id(model), context::current_entry_number());
    let new_here = PARAMETERS_COMPARED.replace(Some(compared)) != Some(compared);
    let every_rank = all_gather_host_checked(&*group, &[u64::from(new_here)], "whether the model is new").unwrap_or_else(|error| panic!("comparing the ranks' parameters: {error}"));
    if every_rank.iter().any(|new| new[0] == 1) {
        refuse_differing_parameters(model, &*group);
    }
    refuse_attention_that_never_exchanged();
    all_reduce_gradients_in_buckets(model, grads, &*group, GRADIENT_BUCKET_BYTES).unwrap_or_else(|error| panic!("summing the gradients over the group: {error}"))
}

thread_local! {
    /// The model whose parameters this thread compared last (its first parameter's id), in
    /// the groups of that entry number.
    static PARAMETERS_COMPARED: std::cell::Cell<Option<(Option<burn::module::ParamId>, Option<u64>)>> = const { std::cell::Cell::new(None) };
    /// The groups (their entry number) of this thread's last gradient sum and the
    /// all-to-alls its sequence group had made by then.
    static EXCHANGES_AT_LAST_SUM: std::cell::Cell<(Option<u64>, u64)> = const { std::cell::Cell::new((None, 0)) };
}

/// The id of `model`'s first float parameter, which tells one model from another built anew.
fn first_parameter_id<M: Module>(model: &M) -> Option<burn::module::ParamId> {
    struct First(Option<burn::module::ParamId>);
    impl ModuleVisitor for First {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.get_or_insert(param.id);
        }
    }
    let mut first = First(None);
    model.visit(&mut first);
    first.0
}

/// Panics where the sequence-parallel group (of two ranks or more) made no all-to-all since
/// this thread's last gradient sum (or since the group began): the model's attention never
/// reached it (burn's own attention, attention by hand), so each rank attended within its
/// shard.
fn refuse_attention_that_never_exchanged() {
    let Some(sequence) = context::current().filter(|group| group.size() > 1) else { return };
    // By the groups' entry number: a group dropped and another entered may reuse its address.
    let entry = context::current_entry_number();
    let calls = sequence.traffic().all_to_all_calls;
    let (last_entry, last_calls) = EXCHANGES_AT_LAST_SUM.replace((entry, calls));
    let before = if last_entry == entry { last_calls } else { 0 };
    if calls == before {
        panic!(
            "sequence parallelism over {} ranks, but the model's attention made no exchange through the group since the last \
             gradient sum: each rank attended within its shard alone. Call burn_ulysses_ops::attention in place of \
             burn::tensor::module::attention, and port attention written by hand to it (docs/library.md, \"Using burn 0.22\")",
            sequence.size()
        );
    }
}

/// Panics where the ranks of `group` hold other parameters (a digest of each one's first
/// values: one read of a few values each), naming the first rank that differs from rank 0.
fn refuse_differing_parameters<M: Module>(model: &M, group: &dyn HostCommunicator) {
    struct Firsts(Vec<f32>);
    impl ModuleVisitor for Firsts {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let values = param.val().flatten::<1>(0, D - 1);
            let count = values.dims()[0].min(ulysses_core::digest::DIGEST_VALUES);
            if count > 0 {
                self.0.extend(values.narrow(0, 0, count).into_data().convert::<f32>().iter::<f32>());
            }
        }
    }
    let mut firsts = Firsts(Vec::new());
    model.visit(&mut firsts);
    let digest = ulysses_core::digest::parameters_digest(firsts.0);
    let every_rank = all_gather_host_checked(group, &[digest], "the parameters' digest").unwrap_or_else(|error| panic!("comparing the ranks' parameters: {error}"));
    if let Some(rank) = every_rank.iter().position(|digests| digests[0] != every_rank[0][0]) {
        panic!(
            "ranks 0 and {rank} hold different parameters at the first gradient sum of their model: the replicas would train apart. Build the model \
             from one seed on every rank (rank threads share a device's random generator, so `init` on each draws other weights: \
             the tiny_llama example's `init_seeded`), or load one record on every rank"
        );
    }
}

/// [`all_reduce_gradients`] over `group`, in buckets of at most `bucket_bytes`.
pub fn all_reduce_gradients_in_buckets<M: Module>(model: &M, mut grads: GradientsParams, group: &dyn HostCommunicator, bucket_bytes: usize) -> Result<GradientsParams, CommError> {
    let op = Collective::AllReduce;
    let mut take = TakeGradients { grads: &mut grads, local: Vec::new() };
    model.visit(&mut take);
    let mut local = take.local;
    let present: Vec<u64> = local.iter().map(|l| l.grad.is_some() as u64).collect();
    let every_rank = all_gather_host_checked(group, &present, "float parameters")?;
    let present_anywhere = present_anywhere(&every_rank, present.len());
    let mut sizes = Vec::with_capacity(local.len());
    for l in &local {
        sizes.push((l.elements * l.dtype.size(), l.dtype));
    }
    for bucket in plan_buckets(&sizes, &present_anywhere, bucket_bytes) {
        let dtype = local[bucket[0]].dtype;
        let mut bytes = Vec::new();
        for &i in &bucket {
            match local[i].grad.take() {
                Some(grad) => bytes.extend(grad.bytes),
                // This rank has none: zeros of the parameter's size.
                None => bytes.resize(bytes.len() + local[i].elements * dtype.size(), 0),
            }
        }
        let elements = bytes.len() / dtype.size();
        let summed = group.all_reduce(HostTensor::new(dtype, vec![elements], bytes, op)?, ReduceOp::Sum)?;
        let mut offset = 0;
        for &i in &bucket {
            let len = local[i].elements * dtype.size();
            local[i].grad = Some(HostTensor { dtype, shape: local[i].shape.clone(), bytes: summed.bytes[offset..offset + len].to_vec() });
            offset += len;
        }
    }
    let mut register = RegisterGradients { grads: &mut grads, summed: local.into_iter() };
    model.visit(&mut register);
    Ok(grads)
}

/// `value` summed over this rank's job (a loss to report), in rank order.
pub fn all_reduce_sum(value: f64) -> f64 {
    match context::world().filter(|group| group.size() > 1) {
        None => value,
        Some(group) => group
            .all_reduce(HostTensor::from_f64(&[value]), ReduceOp::Sum)
            .unwrap_or_else(|error| panic!("summing a value over the group: {error}"))
            .to_f64()[0],
    }
}

/// One float parameter's gradient on this rank, on the host (`None`: this rank has none), with
/// the parameter's shape, size and dtype; after the sum, the summed gradient.
struct LocalGradient {
    grad: Option<HostTensor>,
    shape: Vec<usize>,
    elements: usize,
    dtype: HostDType,
    device: Device,
}

struct TakeGradients<'a> {
    grads: &'a mut GradientsParams,
    local: Vec<LocalGradient>,
}

impl ModuleVisitor for TakeGradients<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let op = Collective::AllReduce;
        let value = param.val();
        // The parameter's dtype, on every rank alike (a gradient's could differ from rank to
        // rank, and with it the buckets): a gradient of another dtype is cast to it.
        let dtype = value.dtype();
        let grad = self.grads.remove::<D>(param.id).map(|grad| {
            let grad = if grad.dtype() == dtype { grad } else { grad.cast(dtype) };
            host::from_data(grad.into_data(), op).unwrap_or_else(|error| panic!("parameter {}: {error}", param.id))
        });
        let dtype = host::host_dtype(dtype, op).unwrap_or_else(|error| panic!("parameter {}: {error}", param.id));
        let shape = value.dims().to_vec();
        // Gradients live outside the autodiff graph, as the optimizer expects them.
        self.local.push(LocalGradient { grad, elements: shape.iter().product(), shape, dtype, device: value.device().without_autodiff() });
    }
}

struct RegisterGradients<'a> {
    grads: &'a mut GradientsParams,
    summed: std::vec::IntoIter<LocalGradient>,
}

impl ModuleVisitor for RegisterGradients<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let local = self.summed.next().expect("the same parameters on the second visit");
        // No rank has a gradient (a frozen parameter): none, as on one device.
        if let Some(summed) = local.grad {
            let data = host::to_data(summed);
            let dtype = data.dtype();
            self.grads.register(param.id, Tensor::<D>::from_data(data, (&local.device, dtype)));
        }
    }
}
