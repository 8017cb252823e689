//! ZeRO stage 3 over a world of ranks (SP × DP together: SP ranks hold identical parameters,
//! so they share the parts too): each rank keeps only its part
//! (`ulysses_core::zero::Partition`) of every parameter's compute copy, on the device; the
//! model between steps holds placeholders. A checkpointed step
//! ([`checkpointed_backward_with`](crate::checkpointed_backward_with)) asks for one
//! [`ParameterGroup`] at a time, a layer or the rest (embeddings, final norm, head; a
//! standalone head and the embedding apart, [`LayeredLm::visit_standalone_head`]):
//!
//! - the group's parts are all-gathered (in the compute dtype, one collective for each
//!   [`GRADIENT_BUCKET_BYTES`] of this rank's parts) into a copy of the model just before its
//!   pieces run, and
//!   released with that copy after them: a layer's for its forward, again for its backward
//!   (recomputed under layer checkpointing); the embedding's for its forward (and its
//!   backward, unless [`LayeredLm::embedding_lookup`] says it is a lookup, whose gradient needs
//!   no weight), the head's for its piece (both the rest's where the head is tied);
//! - a group's gradients, once complete, are reduce-scattered (cast to f32, in buckets, each
//!   laid out rank-major as [`ShardedAdamW`]'s: the sums an all-reduce gives, in the same
//!   order) and this rank keeps its part where the optimizer runs ([`OptimizerPlace`]: copied to
//!   the host behind the reduce-scatter and awaited at the next group's, or left on the device),
//!   summed over the step's micro-batches in f32 in micro-batch order;
//! - the optimizer ([`PartOptimizer`]: [`ShardedAdamW`] on the host, [`DeviceShardedAdamW`] on
//!   the device) updates this rank's parts of the master weights from them, and the updated
//!   parts, cast to the compute dtype, become the compute copy's parts
//!   ([`apply_step_zero3`](crate::apply_step_zero3)): no all-gather after the step. On the host
//!   the update runs on a thread of its own while the device goes on with the next step: it
//!   takes the groups in the order the next forward gathers them (the embedding's, the
//!   layers, the head's), and each gather waits only for its own group's parts. Or, asked
//!   before the step ([`ShardedParameters::update_in_backward`]), it takes each group as its
//!   parts arrive, during the backward, so no gradient part waits for the step's end.
//!
//! So a rank holds `1/world` of the compute copy and of the gradients between steps; during a
//! step, besides, one group whole (a layer, the embedding, the head, or a tied embedding and
//! head together), with the optimizer on the host the previous group's gradient parts until
//! they arrive, and, where the head is tied, from the head's backward to the embedding's, the
//! rest's whole gradients (the embedding's added into the head's before they leave). With
//! [`ShardedParameters::with_parts_on_host`] the compute copy's parts wait in host memory and
//! the device holds none between gathers; with [`ShardedAdamW`] they are its f32 master
//! weights themselves (shared from the start by [`ShardedParameters::share_master_weights`],
//! else from its first update; updated in place, cast to the compute dtype as each gather
//! uploads them), so the host holds them once.
//! Uneven sizes are fine: a parameter is padded to a multiple of the world, so a part may be
//! partly or wholly padding, never missing.

use std::{
    collections::HashMap,
    num::NonZeroUsize,
    sync::{
        Arc,
        OnceLock,
        mpsc::{Receiver, SyncSender, channel, sync_channel},
    },
};

use burn::{
    module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId},
    optim::GradientsParams,
    tensor::{DType, FloatDType, Shape, Tensor, TensorData},
};
use burn_ulysses::{
    PlainBackend, UlyssesError,
    attention_guard::not_positions,
    comm::Communicator,
    primitive::{float_primitive, float_tensor},
};
use ulysses_core::{
    gradients::{GRADIENT_BUCKET_BYTES, plan_buckets},
    zero::Partition,
};

use super::{
    DeviceShardedAdamW, ShardedAdamW,
    host_adamw::{BackwardLink, GroupGradients, NewPart, PartChecks, PartForm, cast_master_part},
    parts::{PartsInFlight, all_gather_columns, arrive_parts, check_no_empty_parameter, check_parts_fit, device_parts, own_part, partition_of, reduce_scatter_buckets},
};
use crate::{
    LayerParameters, LayeredLm, ParameterGroup, TrainBackend, float_parameters,
    gradients::{LocalGradient, TakeGradients, concatenated},
};

/// Where a ZeRO-3 optimizer keeps and updates its parts of the master weights and moments,
/// and so where a step leaves its gradient parts for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimizerPlace {
    /// [`ShardedAdamW`]: each group's gradient parts leave for the host as soon as they are
    /// reduce-scattered, a copy queued behind them (the device keeps none once they arrive).
    Host,
    /// [`DeviceShardedAdamW`]: the gradient parts stay on the device.
    Device,
}

/// This rank's part of each parameter's gradient summed over the world (`None`: no rank had
/// one), where the optimizer takes them.
pub enum GradParts<B: TrainBackend> {
    Host(Vec<Option<Vec<f32>>>),
    Device(Vec<Option<Tensor<B::InnerBackend, 1>>>),
}

impl<B: TrainBackend> GradParts<B> {
    fn empty(place: OptimizerPlace, count: usize) -> Self {
        match place {
            OptimizerPlace::Host => GradParts::Host(vec![None; count]),
            OptimizerPlace::Device => GradParts::Device(vec![None; count]),
        }
    }

    /// Which parameters have a gradient part.
    pub fn present(&self) -> Vec<bool> {
        match self {
            GradParts::Host(parts) => parts.iter().map(Option::is_some).collect(),
            GradParts::Device(parts) => parts.iter().map(Option::is_some).collect(),
        }
    }
}

/// An optimizer over this rank's parts of the master weights, which ZeRO-3's step
/// ([`apply_step_zero3`](crate::apply_step_zero3)) updates and takes the compute copy's parts
/// from: [`ShardedAdamW`] on the host, [`DeviceShardedAdamW`] on the device.
pub trait PartOptimizer<B: TrainBackend> {
    fn place(&self) -> OptimizerPlace;
    /// Refuses parts of another rank, world or model than rank `rank` of `world` stepping a
    /// model of `elements` per parameter.
    fn check_holds(&self, rank: usize, world: usize, elements: &[usize]) -> Result<(), UlyssesError>;
    /// Updates the parts from `grads` (of [`place`](Self::place)), clipping to
    /// `max_grad_norm` with the whole gradient's norm, which it returns (before clipping), and
    /// hands `parameters` their compute copy's new parts (at once, or as they are made).
    /// Collective over `world`.
    fn update_parts(
        &mut self,
        learning_rate: f64,
        grads: GradParts<B>,
        max_grad_norm: Option<f64>,
        world: &dyn Communicator<B::Wire>,
        parameters: &mut ShardedParameters<B>,
    ) -> Result<f64, UlyssesError>;
    /// Waits for an update still running (on the host, beside the device), so that the state
    /// is the last step's.
    fn settle(&mut self) -> Result<(), UlyssesError> {
        Ok(())
    }
    /// [`settle`](Self::settle)s, and gives what the step's update in the backward
    /// ([`ShardedParameters::update_in_backward`]) found in its gradient parts; `None` where the
    /// step had none.
    fn part_checks(&mut self) -> Result<Option<PartChecks>, UlyssesError> {
        self.settle().map(|()| None)
    }
    /// Marks the state lost, for `why` (a step updated in the backward whose apply failed).
    fn lose(&mut self, _why: String) {}
    /// Drops any state and starts holding rank `rank`'s parts of a world of `world`, none yet
    /// ([`ShardedParameters::shard_from`] then hands over each parameter's).
    fn begin_master_parts(&mut self, rank: usize, world: usize);
    /// Takes `master` (f32, on the device: this rank's part, padded to the partition, of the
    /// next parameter in the model's order, of `elements` elements whole) as its master weights.
    fn keep_master_part(&mut self, elements: usize, master: Tensor<B::InnerBackend, 1>);
    /// This rank's part of parameter `index`'s master weights (padded to the partition) cast to
    /// `dtype`, on `device`: its part of the compute copy ([`ShardedParameters::shard_from`]
    /// from the master weights; [`check_holds`](Self::check_holds) first).
    fn compute_part(&self, index: usize, dtype: FloatDType, device: &burn::tensor::Device<B::InnerBackend>) -> Tensor<B::InnerBackend, 1>;
}

impl<B: TrainBackend> PartOptimizer<B> for ShardedAdamW {
    fn place(&self) -> OptimizerPlace {
        OptimizerPlace::Host
    }
    fn check_holds(&self, rank: usize, world: usize, elements: &[usize]) -> Result<(), UlyssesError> {
        ShardedAdamW::check_holds(self, rank, world, elements)
    }
    fn update_parts(
        &mut self,
        learning_rate: f64,
        grads: GradParts<B>,
        max_grad_norm: Option<f64>,
        world: &dyn Communicator<B::Wire>,
        parameters: &mut ShardedParameters<B>,
    ) -> Result<f64, UlyssesError> {
        let GradParts::Host(grads) = grads else { return Err(misplaced(OptimizerPlace::Host)) };
        // The last update's parts all in place (none left in a channel this one replaces).
        parameters.await_every_update()?;
        let waiting: Vec<bool> = grads.iter().map(Option::is_some).collect();
        let (grad_norm, factor) = self.clip(&grads, max_grad_norm, world)?;
        // Released only now that nothing before the update can fail.
        let (order, forms) = (parameters.forward_order(), parameters.release_host_parts(&waiting));
        parameters.cast_threads = self.threads();
        let (updated, arriving) = channel();
        self.spawn_update(learning_rate, grads, parameters.decayed(), factor, order, forms, updated)?;
        parameters.updates = Some(PartUpdates { arriving, waiting });
        if serial_host_update() {
            self.settle()?;
            parameters.await_every_update()?;
        }
        Ok(grad_norm)
    }
    fn settle(&mut self) -> Result<(), UlyssesError> {
        ShardedAdamW::settle(self)
    }
    fn part_checks(&mut self) -> Result<Option<PartChecks>, UlyssesError> {
        self.take_part_checks()
    }
    fn lose(&mut self, why: String) {
        ShardedAdamW::lose(self, why);
    }
    fn begin_master_parts(&mut self, rank: usize, world: usize) {
        ShardedAdamW::begin_master_parts(self, rank, world);
    }
    fn keep_master_part(&mut self, elements: usize, master: Tensor<B::InnerBackend, 1>) {
        ShardedAdamW::keep_master_part(self, elements, master.into_data().convert::<f32>().to_vec::<f32>().expect("f32 values"));
    }
    fn compute_part(&self, index: usize, dtype: FloatDType, device: &burn::tensor::Device<B::InnerBackend>) -> Tensor<B::InnerBackend, 1> {
        // Cast on the host, as the update thread casts each new part: half the bytes uploaded in bf16.
        Tensor::from_data(cast_master_part(ShardedAdamW::master_part(self, index), dtype.into(), self.threads()), (device, DType::from(dtype)))
    }
}

/// `ULYSSES_HOST_ADAMW_SERIAL=1`: the step waits for the host optimizer's whole update, as
/// before it ran beside the device (for measuring the two side by side).
fn serial_host_update() -> bool {
    static SERIAL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SERIAL.get_or_init(|| std::env::var("ULYSSES_HOST_ADAMW_SERIAL").is_ok_and(|v| v == "1"))
}

impl<B: TrainBackend> PartOptimizer<B> for DeviceShardedAdamW<B> {
    fn place(&self) -> OptimizerPlace {
        OptimizerPlace::Device
    }
    fn check_holds(&self, rank: usize, world: usize, elements: &[usize]) -> Result<(), UlyssesError> {
        check_parts_fit(self.rank_and_world(), &self.elements(), rank, world, elements)
    }
    fn update_parts(
        &mut self,
        learning_rate: f64,
        grads: GradParts<B>,
        max_grad_norm: Option<f64>,
        world: &dyn Communicator<B::Wire>,
        parameters: &mut ShardedParameters<B>,
    ) -> Result<f64, UlyssesError> {
        let GradParts::Device(grads) = grads else { return Err(misplaced(OptimizerPlace::Device)) };
        let updated: Vec<bool> = grads.iter().map(Option::is_some).collect();
        let grad_norm = self.update(learning_rate, grads, &parameters.decayed(), max_grad_norm, world)?;
        parameters.update_from(self, &updated);
        Ok(grad_norm)
    }
    fn begin_master_parts(&mut self, rank: usize, world: usize) {
        DeviceShardedAdamW::begin_master_parts(self, rank, world);
    }
    fn keep_master_part(&mut self, elements: usize, master: Tensor<B::InnerBackend, 1>) {
        DeviceShardedAdamW::keep_master_part(self, elements, master);
    }
    fn compute_part(&self, index: usize, dtype: FloatDType, _device: &burn::tensor::Device<B::InnerBackend>) -> Tensor<B::InnerBackend, 1> {
        DeviceShardedAdamW::master_part(self, index, dtype.into())
    }
}

fn misplaced(optimizer: OptimizerPlace) -> UlyssesError {
    UlyssesError::InvalidConfig(format!(
        "the ZeRO-3 parameters keep their gradient parts elsewhere than the optimizer, which runs on the {optimizer:?}: shard them with OptimizerPlace::{optimizer:?}"
    ))
}

/// This rank's parts of a model's parameters under ZeRO-3 (see the module doc).
pub struct ShardedParameters<B: TrainBackend> {
    partition: Partition,
    rank: usize,
    /// Every float parameter of the model, in its visit order (the optimizer's order).
    parameters: Vec<PartOf<B>>,
    /// Indices into `parameters` of each layer's; of the rest's (every other), and of the rest
    /// without, and with only, a standalone head's (`ParameterGroup::Embedding`, `Head`).
    layers: Vec<Vec<usize>>,
    rest: Vec<usize>,
    embedding: Vec<usize>,
    head: Vec<usize>,
    /// This rank's part of each parameter's gradient summed over the world, summed over this
    /// step's shards so far, where the optimizer runs.
    grad_parts: GradParts<B>,
    /// The last group's gradient parts on their way to the host (optimizer on the host): their
    /// copies are queued behind the work that made them and awaited at the next group's, with
    /// that group's backward queued ahead of the device, or at once for the embedding's (a
    /// shard's last group).
    in_flight: Vec<PartsInFlight>,
    optimizer: OptimizerPlace,
    /// The last step's new parts still being made by the optimizer on the host.
    updates: Option<PartUpdates>,
    /// This step's update in the backward, while it takes groups
    /// ([`update_in_backward`](Self::update_in_backward)).
    in_backward: Option<InBackward>,
    /// Where the gathered parameters go.
    device: burn::tensor::Device<B::InnerBackend>,
    /// The threads a gather's cast of a part kept as master weights takes: the host
    /// optimizer's share of the host's cores.
    cast_threads: NonZeroUsize,
}

/// The compute copy's new parts as the host optimizer's update thread makes them (index and
/// part), and which of them have not arrived.
struct PartUpdates {
    arriving: Receiver<(usize, NewPart)>,
    waiting: Vec<bool>,
}

/// A step's update in the backward: where each group's gradient parts go as they arrive.
struct InBackward {
    /// The step it updates.
    step: usize,
    /// The learning rate it updates at: the step's backward and apply must be given the same.
    learning_rate: f64,
    /// Bounded: the host holds at most a group queued beside the one being updated (and the
    /// next arriving), whatever the update's pace.
    groups: SyncSender<GroupGradients>,
    /// Held while it may take groups ([`BackwardLink::open`]).
    _open: Arc<()>,
    /// Why its step ended unapplied, for the optimizer ([`BackwardLink::abandoned`]).
    abandoned: Arc<OnceLock<String>>,
    /// Whether the step has targets anywhere (a step without gives its parts to no update, as a
    /// step at its end does: [`apply_step_zero3`](crate::apply_step_zero3)).
    targets: bool,
    /// Which parameters' parts went: each goes once.
    sent: Vec<bool>,
}

/// One parameter: what it is, and this rank's part of its compute copy.
struct PartOf<B: TrainBackend> {
    id: ParamId,
    path: String,
    shape: Shape,
    dtype: DType,
    /// Whether the parameter requires a gradient: its placeholder always does (a piece that
    /// uses a parameter outside its group is then named by the gradient it gets, a frozen
    /// one's too), so the model gathered takes the flag from here.
    trains: bool,
    /// Flat, padded to the partition: `part_len` elements.
    part: Held<B>,
}

/// Where a part of the compute copy waits between its gathers.
enum Held<B: TrainBackend> {
    Device(Tensor<B::InnerBackend, 1>),
    /// In host memory (`--offload-parameters`), uploaded for each gather.
    Host(TensorData),
    /// In host memory as the host optimizer's master weights themselves (f32, shared), cast to
    /// the compute dtype as each gather uploads them: a part kept on the host with
    /// [`ShardedAdamW`] then costs the host nothing beside the optimizer's state.
    Master(Arc<Vec<f32>>),
    /// Handed back to the host optimizer for its update, which brings the new one.
    Released,
}

impl<B: TrainBackend> PartOf<B> {
    /// The form in which the host optimizer's update hands back its new part: cast to the
    /// compute dtype for a part on the device, the master weights themselves for one on the host.
    fn update_form(&self) -> PartForm {
        match self.part {
            Held::Device(_) => PartForm::Compute(self.dtype),
            _ => PartForm::Master,
        }
    }

    /// Lets go of a part kept on the host before the host optimizer updates it: the update
    /// writes the master weights in place, and brings the new part.
    fn release_for_update(&mut self) {
        if !matches!(self.part, Held::Device(_)) {
            self.part = Held::Released;
        }
    }

    fn elements(&self) -> usize {
        self.shape.num_elements()
    }

    /// Puts the host optimizer's new part in place of the one it was made from: uploaded to
    /// `device` where the part is kept there.
    fn put_in_place(&mut self, new: NewPart, device: &burn::tensor::Device<B::InnerBackend>) {
        self.part = match (new, &self.part) {
            (NewPart::Master(master), _) => Held::Master(master),
            (NewPart::Compute(values), Held::Device(_)) => Held::Device(Tensor::from_data(B::Wire::pin_for_upload(values, device), (device, self.dtype))),
            (NewPart::Compute(values), _) => Held::Host(values),
        };
    }
}

impl<B: TrainBackend> ShardedParameters<B> {
    /// Whether AdamW decays each parameter (`ulysses_core::host_adamw::decays`), in order.
    pub(crate) fn decayed(&self) -> Vec<bool> {
        self.parameters.iter().map(|p| ulysses_core::host_adamw::decays(p.shape.num_dims())).collect()
    }

    /// Cuts `model`'s parameters (whole, the same on every rank) into rank `rank`'s parts of a
    /// world of `world`, for an optimizer that runs at `optimizer`; returns the model with
    /// placeholders in their place (the same ids and gradient flags, one element each) and the
    /// parts. Refused when two layers ([`LayeredLm::visit_layer`]) claim the same parameter.
    /// Nothing compares the ranks' models (a replicated step's first check compares the
    /// parameters a step is given, here placeholders): ranks that built theirs from other seeds
    /// would train one stitched from their parts, silently. [`shard_from`](Self::shard_from)
    /// with [`PartsFrom::Rank0`] takes world rank 0's values, without a whole model elsewhere.
    pub fn shard<M: AutodiffModule<B> + LayeredLm<B>>(model: M, rank: usize, world: usize, optimizer: OptimizerPlace) -> Result<(M, Self), UlyssesError> {
        let partition = partition_of(rank, world)?;
        let found = float_parameters(&model);
        let ids: Vec<ParamId> = found.iter().map(|p| p.id).collect();
        let paths: Vec<String> = found.iter().map(|p| p.path.clone()).collect();
        let groups = Groups::of(&model, &ids, &paths)?;
        let device = model.devices().first().cloned().ok_or_else(|| UlyssesError::InvalidConfig("ZeRO-3 of a model without parameters".into()))?;
        let mut placeholders = Placeholders(Vec::with_capacity(found.len()));
        let model = model.map(&mut placeholders);
        let parameters = found
            .into_iter()
            .zip(placeholders.0)
            .map(|(p, trains)| {
                let part = own_part(&partition, rank, p.values.inner());
                PartOf { id: p.id, path: p.path, dtype: part.dtype(), shape: p.shape, trains, part: Held::Device(part) }
            })
            .collect::<Vec<_>>();
        Ok((model, Self::of_parts(partition, rank, parameters, groups, optimizer, device)))
    }

    /// ZeRO-3 from a model that no rank holds whole, one parameter at a time in the model's
    /// order, each rank keeping its part of the compute copy, cast to `compute`, on `device` (or
    /// in host memory where `parts_on_host`, as [`with_parts_on_host`](Self::with_parts_on_host)
    /// keeps them), and leaving a placeholder in the model:
    ///
    /// - [`PartsFrom::Rank0`]: what [`broadcast_parameters`](crate::broadcast_parameters),
    ///   `optimizer`'s `keep_master_weights`, [`with_parameters_in`](crate::with_parameters_in)
    ///   and [`shard`](Self::shard) make in turn. World rank 0's value of each parameter (built,
    ///   or built now where burn left it lazy, as `Config::init` does) is broadcast, this rank
    ///   keeps its part as `optimizer`'s f32 master weights and cast as the compute copy's, and
    ///   the whole is let go before the next. The other ranks never build a lazy parameter: they
    ///   receive it. So a rank holds one parameter whole beside its parts, where the four steps
    ///   hold the whole model (a copy a rank thread), and a lazy model is built from the seeded
    ///   generator in the order `fork` builds it.
    /// - [`PartsFrom::Masters`]: the compute copy's parts are `optimizer`'s master weights (a
    ///   resumed run's, loaded as this rank's parts) cast; nothing is gathered or built. What
    ///   the master weights all-gathered into the model, cast and cut give. Refused when the
    ///   optimizer holds parts of another model, rank or world.
    ///
    /// Collective over `world`.
    pub fn shard_from<M, O>(
        model: M,
        from: PartsFrom,
        optimizer: &mut O,
        compute: FloatDType,
        parts_on_host: bool,
        device: &burn::tensor::Device<B::InnerBackend>,
        world: &dyn Communicator<B::Wire>,
    ) -> Result<(M, Self), UlyssesError>
    where
        M: AutodiffModule<B> + LayeredLm<B>,
        O: PartOptimizer<B>,
    {
        let (rank, size) = (world.rank(), world.size());
        let partition = Partition::new(size).ok_or_else(|| UlyssesError::InvalidConfig("ZeRO-3 over a world of 0 ranks".into()))?;
        let mut ids = CollectIds(Vec::new());
        model.visit(&mut ids);
        let paths = crate::parameter_paths(&model);
        let groups = Groups::of(&model, &ids.0, &paths)?;
        if ids.0.is_empty() {
            return Err(UlyssesError::InvalidConfig("ZeRO-3 of a model without parameters".into()));
        }
        match from {
            PartsFrom::Rank0 => optimizer.begin_master_parts(rank, size),
            // The masters as the last step left them: its update may still run on its thread.
            PartsFrom::Masters => {
                optimizer.settle()?;
                optimizer.check_holds(rank, size, &crate::parameter_elements(&model))?
            }
        }
        let mut take = TakeParts { world, optimizer, from, partition, compute, parts_on_host, device: device.clone(), ids: &ids.0, paths: &paths, parts: Vec::new(), error: None };
        let model = model.map(&mut take);
        let TakeParts { parts, error, .. } = take;
        if let Some(error) = error {
            return Err(error);
        }
        let place = optimizer.place();
        Ok((model, Self::of_parts(partition, rank, parts, groups, place, device.clone())))
    }

    /// The parts of `parameters` (every float parameter, in the model's order) in `groups`.
    fn of_parts(partition: Partition, rank: usize, parameters: Vec<PartOf<B>>, groups: Groups, optimizer: OptimizerPlace, device: burn::tensor::Device<B::InnerBackend>) -> Self {
        let Groups { layers, rest, embedding, head } = groups;
        let grad_parts = GradParts::empty(optimizer, parameters.len());
        let cast_threads = std::thread::available_parallelism().unwrap_or(NonZeroUsize::MIN);
        Self { partition, rank, parameters, layers, rest, embedding, head, grad_parts, in_flight: Vec::new(), optimizer, updates: None, in_backward: None, device, cast_threads }
    }

    /// The parts kept in host memory between their gathers, uploaded for each
    /// (`--offload-parameters`: for a world too small to hold even its parts of the compute
    /// copy; every gather then crosses from the host).
    pub fn with_parts_on_host(mut self) -> Self {
        for parameter in &mut self.parameters {
            if let Held::Device(part) = &parameter.part {
                parameter.part = Held::Host(part.clone().into_data());
            }
        }
        self
    }

    /// The parts kept on the host ([`with_parts_on_host`](Self::with_parts_on_host)) as
    /// `optimizer`'s master weights from now on, where they are what those give cast to the
    /// compute dtype ([`cast_master_part`]; others stay copies): so the host holds no copy
    /// beside the master weights from the first step on (a resumed run's too), frozen
    /// parameters' included. Call it once the optimizer holds this rank's parts of this model.
    pub fn share_master_weights(&mut self, optimizer: &mut ShardedAdamW) -> Result<(), UlyssesError> {
        let masters = optimizer.shared_master_weights()?;
        self.cast_threads = optimizer.threads();
        if masters.len() != self.parameters.len() {
            return Err(UlyssesError::InvalidConfig(format!(
                "the host optimizer holds parts of {} parameters, the ZeRO-3 parameters {}: share the master weights of the optimizer of this model",
                masters.len(),
                self.parameters.len()
            )));
        }
        for (parameter, master) in self.parameters.iter_mut().zip(masters) {
            if let Held::Host(data) = &parameter.part
                && master.len() == data.num_elements()
                && cast_master_part(&master, parameter.dtype, self.cast_threads).as_bytes() == data.as_bytes()
            {
                parameter.part = Held::Master(master);
            }
        }
        Ok(())
    }

    /// The rank and world the parts are of.
    pub fn place(&self) -> (usize, usize) {
        (self.rank, self.partition.world())
    }

    /// Elements of each parameter (whole, unpadded), in the model's visit order.
    pub fn elements(&self) -> Vec<usize> {
        self.parameters.iter().map(PartOf::elements).collect()
    }

    /// Bytes this rank holds on the device between steps: its parts of the compute copy
    /// (none when they are on the host).
    pub fn device_bytes(&self) -> usize {
        self.parameters.iter().filter(|p| matches!(p.part, Held::Device(_))).map(|p| self.partition.part_len(p.elements()) * p.dtype.size()).sum()
    }

    /// Bytes of the compute copy's parts this rank holds in host memory beside the host
    /// optimizer's state (none once they are its master weights: `Held::Master`).
    pub fn host_bytes(&self) -> usize {
        self.parameters.iter().filter(|p| matches!(p.part, Held::Host(_))).map(|p| self.partition.part_len(p.elements()) * p.dtype.size()).sum()
    }

    /// `model` (with placeholders) with every parameter whole: all-gathered, for what needs
    /// the whole model on every rank (the trained model; an evaluation on world rank 0 alone).
    /// Collective over `world`.
    pub fn gather_all<M: AutodiffModule<B>>(&mut self, model: M, world: &dyn Communicator<B::Wire>) -> Result<M, UlyssesError> {
        let every: Vec<usize> = (0..self.parameters.len()).collect();
        self.gathered(model, &every, world)
    }

    /// Every parameter's module path and shape, in the model's visit order (the model itself
    /// holds placeholders).
    pub fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        self.parameters.iter().map(|p| (p.path.clone(), p.shape.iter().copied().collect())).collect()
    }

    /// `model` with the parameters at `paths` (module paths, as [`tensors`](Self::tensors)
    /// names them) all-gathered into it, the others left as they are: one shard of a
    /// checkpoint at a time. Collective over `world`; refused for a path no parameter has.
    pub fn gather_paths<M: AutodiffModule<B>>(&mut self, model: M, paths: &[String], world: &dyn Communicator<B::Wire>) -> Result<M, UlyssesError> {
        let indices = paths
            .iter()
            .map(|path| {
                self.parameters.iter().position(|p| &p.path == path).ok_or_else(|| UlyssesError::InvalidConfig(format!("ZeRO-3: no parameter has the path {path}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.gathered(model, &indices, world)
    }

    /// `model` with the parameters at `indices` all-gathered into it (their parts from the last
    /// step's update, once they arrive).
    fn gathered<M: AutodiffModule<B>>(&mut self, model: M, indices: &[usize], world: &dyn Communicator<B::Wire>) -> Result<M, UlyssesError> {
        self.check_world(world)?;
        self.await_updates(indices)?;
        if let Some(&released) = indices.iter().find(|&&i| matches!(self.parameters[i].part, Held::Released)) {
            return Err(UlyssesError::InModel {
                message: format!(
                    "ZeRO-3: {}'s part went to the host optimizer for an update that never ran (its step failed): resume from the last checkpoint",
                    self.parameters[released].path
                ),
            });
        }
        let sizes: Vec<(usize, DType)> =
            indices.iter().map(|&i| (self.partition.part_len(self.parameters[i].elements()) * self.parameters[i].dtype.size(), self.parameters[i].dtype)).collect();
        let mut values = HashMap::with_capacity(indices.len());
        for bucket in plan_buckets(&sizes, &vec![true; indices.len()], GRADIENT_BUCKET_BYTES) {
            let mine = concatenated(bucket.iter().map(|&b| self.on_device(&self.parameters[indices[b]])).collect(), 0);
            let members = bucket.iter().map(|&b| (indices[b], self.parameters[indices[b]].elements()));
            for (index, whole) in all_gather_columns::<B>(mine, members, &self.partition, world)? {
                let parameter = &self.parameters[index];
                values.insert(parameter.id, (whole, parameter.shape.clone(), parameter.trains));
            }
        }
        Ok(model.map(&mut Gathered::<B> { values }))
    }

    /// A parameter's part on the device: uploaded (from memory the device copies from without
    /// the host waiting, where the backend has it) when it waits on the host.
    fn on_device(&self, parameter: &PartOf<B>) -> Tensor<B::InnerBackend, 1> {
        let upload = |data: TensorData| Tensor::from_data(B::Wire::pin_for_upload(data, &self.device), (&self.device, parameter.dtype));
        match &parameter.part {
            Held::Device(part) => part.clone(),
            Held::Host(data) => upload(data.clone()),
            // The cast the update thread makes for a part on the device (`spawn_update`), made here.
            Held::Master(master) => upload(cast_master_part(master, parameter.dtype, self.cast_threads)),
            Held::Released => unreachable!("{}'s part is gathered while the host optimizer holds it (gathered() refuses that)", parameter.path),
        }
    }

    fn check_world(&self, world: &dyn Communicator<B::Wire>) -> Result<(), UlyssesError> {
        if (world.rank(), world.size()) != self.place() {
            return Err(UlyssesError::InvalidConfig(format!(
                "ZeRO-3 parts of rank {} of a world of {}, used by rank {} of {}: shard the model for the world that trains it",
                self.rank,
                self.partition.world(),
                world.rank(),
                world.size()
            )));
        }
        Ok(())
    }

    fn group(&self, group: ParameterGroup) -> &[usize] {
        match group {
            ParameterGroup::Layer(index) => &self.layers[index],
            ParameterGroup::Rest => &self.rest,
            ParameterGroup::Embedding => &self.embedding,
            ParameterGroup::Head => &self.head,
        }
    }

    /// Reduce-scatters `group`'s gradients in `grads` (of `model`: with the group whole or
    /// with placeholders, whose ids and order alone count) and adds this rank's parts to the
    /// step's. Refused when `grads` holds a gradient of a parameter outside the group: a piece
    /// used a parameter its group does not name.
    fn take_group_gradients<M: AutodiffModule<B>>(&mut self, model: &M, group: ParameterGroup, mut grads: GradientsParams, world: &dyn Communicator<B::Wire>) -> Result<(), UlyssesError> {
        let mut take = TakeGradients::<B> { grads: &mut grads, local: Vec::new() };
        model.visit(&mut take);
        if take.local.len() != self.parameters.len() {
            return Err(UlyssesError::InModel {
                message: format!("ZeRO-3: gradients of a model of {} float parameters handed to parts of {}: one ShardedParameters per model", take.local.len(), self.parameters.len()),
            });
        }
        let indices = self.group(group).to_vec();
        let mut local: Vec<Option<LocalGradient<B>>> = take.local.into_iter().map(Some).collect();
        let mut members: Vec<LocalGradient<B>> = indices.iter().map(|&i| local[i].take().expect("each parameter once")).collect();
        // A gradient outside the group is its placeholder's (each requires one, a frozen
        // parameter's too): a piece computed with one element in place of the parameter.
        if let Some((index, _)) = local.iter().enumerate().find(|(_, l)| l.as_ref().is_some_and(|l| l.grad.is_some())) {
            let parameter = &self.parameters[index];
            return Err(UlyssesError::InModel {
                message: format!(
                    "ZeRO-3: the pieces of {group:?} use {}{}, which that group does not hold: while a group's pieces run every other parameter is a \
                     one-element placeholder, so they ran on it ({})",
                    parameter.path,
                    if parameter.trains { "" } else { " (frozen)" },
                    match group {
                        ParameterGroup::Layer(_) => "LayeredLm::visit_layer must visit every parameter a layer's pieces use, and only the rest may use the others",
                        _ => "LayeredLm::visit_standalone_head must visit every parameter the head uses, and none the embedding uses",
                    }
                ),
            });
        }
        for (local, &index) in members.iter_mut().zip(&indices) {
            let parameter = &self.parameters[index];
            local.len = parameter.elements();
            if let Some(grad) = local.grad.as_ref().filter(|grad| grad.dims()[0] != local.len) {
                return Err(UlyssesError::InModel {
                    message: format!("ZeRO-3: {}'s gradient has {} elements, the parameter {}", parameter.path, grad.dims()[0], local.len),
                });
            }
        }
        let buckets = reduce_scatter_buckets::<B>(&mut members, &self.partition, world)?;
        match &mut self.grad_parts {
            GradParts::Host(_) => {
                // This group's parts leave without a wait; the last group's, queued before this
                // group's backward, arrive with that backward still ahead of the device.
                let queued = buckets.into_iter().map(|mut bucket| {
                    bucket.members.iter_mut().for_each(|(member, _)| *member = indices[*member]);
                    bucket.queue_to_host()
                });
                let arrived = std::mem::replace(&mut self.in_flight, queued.collect());
                self.add_arrived(arrived)?;
                // The embedding's group is a shard's last: its parts (the embedding, the largest,
                // with a tied head) arrive now rather than wait on the device through the next
                // micro-batch.
                if matches!(group, ParameterGroup::Rest | ParameterGroup::Embedding) {
                    self.arrive_gradient_parts()?;
                }
            }
            GradParts::Device(sums) => {
                for (index, part) in indices.into_iter().zip(device_parts(buckets, members.len())) {
                    let Some(part) = part else { continue };
                    sums[index] = Some(match sums[index].take() {
                        Some(sum) => sum + part,
                        None => part,
                    });
                }
            }
        }
        Ok(())
    }

    /// Where the gradient parts wait: where the optimizer they were sharded for runs.
    pub fn optimizer_place(&self) -> OptimizerPlace {
        self.optimizer
    }

    /// Adds the gradient parts of `arrived` (waited for, in order) to the step's sums, in the
    /// order they were queued: each parameter's in micro-batch order. With an update in the
    /// backward, hands them to it instead, as one group (none where the step has no targets).
    fn add_arrived(&mut self, arrived: Vec<PartsInFlight>) -> Result<(), UlyssesError> {
        let GradParts::Host(sums) = &mut self.grad_parts else { return Ok(()) };
        if let Some(in_backward) = &mut self.in_backward {
            let parts = arrive_parts(arrived)?;
            if !in_backward.targets || parts.is_empty() {
                return Ok(());
            }
            let updates = self.updates.as_mut().expect("an update in the backward has its new parts' channel");
            for (index, _) in &parts {
                let parameter = &mut self.parameters[*index];
                if std::mem::replace(&mut in_backward.sent[*index], true) {
                    return Err(UlyssesError::InModel {
                        message: format!("ZeRO-3's update in the backward was given {}'s gradient twice in one step: it updates a parameter once, from one micro-batch", parameter.path),
                    });
                }
                parameter.release_for_update();
                updates.waiting[*index] = true;
            }
            in_backward.groups.send(parts).map_err(|_| UlyssesError::InModel {
                message: "the host optimizer's update thread ended before the step's backward did (its panic is printed above): resume from the last checkpoint".into(),
            })?;
            // The new parts made so far go in place now: those of parts kept on the device are
            // compute copies on the host until then, which left to the step's end would add
            // their bytes (2 a parameter in bf16) to the host's peak.
            self.put_arrived_updates_in_place();
            return Ok(());
        }
        for (index, part) in arrive_parts(arrived)? {
            match &mut sums[index] {
                Some(sum) => sum.iter_mut().zip(&part).for_each(|(sum, g)| *sum += g),
                empty => *empty = Some(part),
            }
        }
        Ok(())
    }

    /// Waits for the gradient parts still on their way to the host and adds them (a shard's or
    /// the step's end).
    pub(crate) fn arrive_gradient_parts(&mut self) -> Result<(), UlyssesError> {
        let arrived = std::mem::take(&mut self.in_flight);
        self.add_arrived(arrived)
    }

    /// The step's gradient parts so far (this rank's part of each parameter's gradient summed
    /// over the world and the step's shards), leaving none; those still on their way are awaited
    /// and dropped (their pinned buffers must not be reused mid-copy; a step's end arrives them
    /// first: [`arrive_gradient_parts`](Self::arrive_gradient_parts)).
    pub(crate) fn take_gradient_parts(&mut self) -> GradParts<B> {
        // A failed step's (none after `arrive_gradient_parts`): only the wait matters.
        let _ = arrive_parts(std::mem::take(&mut self.in_flight));
        std::mem::replace(&mut self.grad_parts, GradParts::empty(self.optimizer, self.parameters.len()))
    }

    /// The path of the first parameter whose gradient part holds a NaN or an infinity (on the
    /// device: by [`crate::gradients::non_finite_mark`], one read for all).
    pub(crate) fn first_non_finite_gradient(&self) -> Option<String> {
        let bad = match &self.grad_parts {
            // On the rank's host threads, as the norm's squares are: one thread's pass over an
            // 8B rank's parts held its device idle for seconds.
            GradParts::Host(parts) => parts.iter().position(|part| part.as_ref().is_some_and(|p| !all_finite_on_threads(p, self.cast_threads))),
            GradParts::Device(parts) => {
                let present: Vec<usize> = (0..parts.len()).filter(|&i| parts[i].is_some()).collect();
                if present.is_empty() {
                    return None;
                }
                let sums = Tensor::cat(present.iter().map(|&i| crate::gradients::non_finite_mark(parts[i].clone().expect("present"))).collect(), 0);
                let sums = sums.into_data().to_vec::<f32>().expect("f32 sums");
                sums.iter().position(|s| !s.is_finite()).map(|p| present[p])
            }
        };
        bad.map(|index| self.parameters[index].path.clone())
    }

    /// The parts of the parameters `updated` says changed, from `optimizer`'s master weights
    /// on the device, in the compute dtype (no collective).
    fn update_from(&mut self, optimizer: &DeviceShardedAdamW<B>, updated: &[bool]) {
        for (index, parameter) in self.parameters.iter_mut().enumerate().filter(|&(i, _)| updated[i]) {
            let part = optimizer.master_part(index, parameter.dtype);
            parameter.part = match parameter.part {
                Held::Device(_) => Held::Device(part),
                Held::Host(_) | Held::Master(_) | Held::Released => Held::Host(part.into_data()),
            };
        }
    }

    /// For the host optimizer's update of the parameters `waiting` marks: the form each new part
    /// should take ([`PartForm::Master`] for those kept on the host, which let go of their part
    /// now, so that the update writes the master weights in place; cast to the compute dtype for
    /// those on the device).
    fn release_host_parts(&mut self, waiting: &[bool]) -> Vec<PartForm> {
        self.parameters
            .iter_mut()
            .zip(waiting)
            .map(|(parameter, &waits)| {
                let form = parameter.update_form();
                if waits {
                    parameter.release_for_update();
                }
                form
            })
            .collect()
    }

    /// The groups in the order a forward gathers them: the embedding's (the rest's, but a
    /// standalone head's), the layers', the head's. The host optimizer updates them in this order.
    fn forward_order(&self) -> Vec<Vec<usize>> {
        std::iter::once(self.embedding.clone()).chain(self.layers.iter().cloned()).chain(std::iter::once(self.head.clone())).collect()
    }

    /// Puts in place the new parts of `indices` that the last step's update has not yet handed
    /// over, waiting for each on the update thread (the others may still be in the making).
    fn await_updates(&mut self, indices: &[usize]) -> Result<(), UlyssesError> {
        let Some(updates) = &mut self.updates else { return Ok(()) };
        while let Some(&wanted) = indices.iter().find(|&&i| updates.waiting[i]) {
            let (index, new) = updates.arriving.recv().map_err(|_| UlyssesError::InModel {
                message: format!(
                    "the host optimizer's update thread failed before it updated {} (its panic is printed above; the optimizer refuses every later use)",
                    self.parameters[wanted].path
                ),
            })?;
            self.parameters[index].put_in_place(new, &self.device);
            updates.waiting[index] = false;
        }
        // An update in the backward may still be given parts: its channel stays.
        if !updates.waiting.contains(&true) && self.in_backward.is_none() {
            self.updates = None;
        }
        Ok(())
    }

    /// Puts in place the new parts the update has already sent, waiting for none.
    fn put_arrived_updates_in_place(&mut self) {
        let Some(updates) = &mut self.updates else { return };
        // A thread that failed is named by the next wait for a part ([`await_updates`](Self::await_updates)).
        while let Ok((index, new)) = updates.arriving.try_recv() {
            self.parameters[index].put_in_place(new, &self.device);
            updates.waiting[index] = false;
        }
    }

    /// Updates each group's parameters in this step's backward, as soon as its gradient parts
    /// arrive on the host, on `optimizer`'s update thread (torchtune's `optimizer_in_bwd`, on
    /// ZeRO-3's parts): the host then never holds the step's gradient parts together, 4 bytes a
    /// parameter of a rank's part less at its peak (12 where it held 16), and the update runs
    /// beside the rest of the backward. Call it before the step's
    /// [`backward_step_zero3`](crate::backward_step_zero3);
    /// [`apply_step_zero3`](crate::apply_step_zero3) then ends it. The same update, bit for bit,
    /// as at the step's end, but it cannot wait for the whole gradient: refused with clipping
    /// (`max_grad_norm`, which needs the whole gradient's norm first) and with more than one
    /// micro-batch (a part must be the step's sum); a step whose gradient holds a NaN or an
    /// infinity has updated some parts by the time its health check fails, and loses the
    /// optimizer's state (resume from the last checkpoint), where a step at its end leaves the
    /// state as it was.
    pub fn update_in_backward(&mut self, optimizer: &mut ShardedAdamW, step: &crate::StepInput) -> Result<(), UlyssesError> {
        // A step whose update in the backward began but that was never applied: some of its
        // groups are updated (the settle below says so).
        self.abandon_update_in_backward("was never applied (apply_step_zero3)");
        if let Some(norm) = step.max_grad_norm {
            return Err(UlyssesError::InvalidConfig(format!(
                "step {}: the update in the backward cannot clip to a max_grad_norm ({norm}): clipping needs the whole gradient's norm before any update; set it to None (--max-grad-norm 0), or update at the step's end",
                step.index
            )));
        }
        if step.micro_batches.len() != 1 {
            return Err(UlyssesError::InvalidConfig(format!(
                "step {}: the update in the backward takes one micro-batch a step ({} given): a parameter's gradient is complete only after the last; use no gradient accumulation, or update at the step's end",
                step.index,
                step.micro_batches.len()
            )));
        }
        if self.optimizer != OptimizerPlace::Host {
            return Err(misplaced(OptimizerPlace::Host));
        }
        optimizer.settle()?;
        self.await_every_update()?;
        let (rank, world) = self.place();
        optimizer.check_holds(rank, world, &self.elements())?;
        let (forms, count) = (self.parameters.iter().map(PartOf::update_form).collect(), self.parameters.len());
        self.cast_threads = optimizer.threads();
        let (updated, arriving) = channel();
        let (groups, taken) = sync_channel(1);
        optimizer.spawn_update_of(step.learning_rate, taken, self.decayed(), None, forms, updated, true)?;
        let (open, abandoned) = (Arc::new(()), Arc::new(OnceLock::new()));
        optimizer.link_backward(BackwardLink { open: Arc::downgrade(&open), abandoned: Arc::clone(&abandoned) });
        self.updates = Some(PartUpdates { arriving, waiting: vec![false; count] });
        self.in_backward = Some(InBackward { step: step.index, learning_rate: step.learning_rate, groups, _open: open, abandoned, targets: true, sent: vec![false; count] });
        Ok(())
    }

    /// Ends this step's update in the backward, if there is one ([`update_in_backward`](Self::update_in_backward)):
    /// it takes no more groups, and ends once it has updated those it was given. Refused where
    /// it was begun for another step than `step` (that step's is then abandoned).
    pub(crate) fn close_update_in_backward(&mut self, step: &crate::StepInput) -> Result<(), UlyssesError> {
        self.check_update_in_backward_of(step, "applied")?;
        self.in_backward = None;
        Ok(())
    }

    /// Ends this step's update in the backward, if there is one, as a step that will not be
    /// applied (its backward failed, or it `was` otherwise left): the groups it was given are
    /// updated, so its optimizer loses its state, saying why, when it next settles.
    pub(crate) fn abandon_update_in_backward(&mut self, was: &str) {
        if let Some(in_backward) = self.in_backward.take() {
            let updated = match in_backward.sent.contains(&true) {
                true => "some of its groups were updated",
                // Lost all the same: nothing tells its checks from a later step's.
                false => "none of its groups had reached the update yet",
            };
            let _ = in_backward.abandoned.set(format!("step {}'s update in the backward began, and the step {was}: {updated}", in_backward.step));
        }
    }

    /// Refuses step `step` being `done` (its backward begun, or applied) while an update in
    /// the backward begun for another step is still open, or begun for this one with another
    /// learning rate, or where `step` asks for clipping (the update takes neither from it):
    /// that update is abandoned.
    pub(crate) fn check_update_in_backward_of(&mut self, step: &crate::StepInput, done: &str) -> Result<(), UlyssesError> {
        let Some((begun, rate)) = self.in_backward.as_ref().map(|in_backward| (in_backward.step, in_backward.learning_rate)) else { return Ok(()) };
        let index = step.index;
        if begun != index {
            self.abandon_update_in_backward(&format!("was never applied (step {index} was {done} instead)"));
            return Err(UlyssesError::InvalidConfig(format!(
                "step {index} {done}, but the update in the backward was begun for step {begun}, never applied: the host optimizer's state is lost (resume from the last checkpoint)"
            )));
        }
        if rate.to_bits() != step.learning_rate.to_bits() || step.max_grad_norm.is_some() {
            self.abandon_update_in_backward(&format!("was {done} with other settings"));
            return Err(UlyssesError::InvalidConfig(format!(
                "step {index} {done} with learning rate {} and max_grad_norm {:?}, but its update in the backward was begun with learning rate \
                 {rate} and no clipping, which is what it updates with: give update_in_backward, backward_step_zero3 and apply_step_zero3 \
                 the same StepInput. The host optimizer's state is lost (resume from the last checkpoint)",
                step.learning_rate, step.max_grad_norm
            )));
        }
        Ok(())
    }

    /// Gives up the new parts the last update has not yet sent (an update in the backward that
    /// stopped at a part that was not finite sends no more): the parts it held stay released,
    /// and a gather of them is refused.
    pub(crate) fn forget_updates(&mut self) {
        self.updates = None;
    }

    /// Whether this step's gradient parts go to an update in the backward.
    pub(crate) fn updating_in_backward(&self) -> bool {
        self.in_backward.is_some()
    }

    /// The path of parameter `index` (in the model's order).
    pub(crate) fn path(&self, index: usize) -> &str {
        &self.parameters[index].path
    }

    /// Puts every new part of the last step's update in place (waiting for those still in the
    /// making).
    pub fn await_every_update(&mut self) -> Result<(), UlyssesError> {
        let every: Vec<usize> = (0..self.parameters.len()).collect();
        self.await_updates(&every)
    }

    /// A view of the parts that gathers and scatters over `world`, for a step's
    /// [`checkpointed_backward_with`](crate::checkpointed_backward_with) or an evaluation's
    /// [`layered_output`](crate::layered_output).
    pub fn over<'a>(&'a mut self, world: &'a dyn Communicator<B::Wire>) -> Zero3Step<'a, B> {
        Zero3Step { parameters: self, world }
    }
}

/// [`ShardedParameters`] at work in one step or evaluation: where a checkpointed backward (or an
/// evaluation's forward) gets each group's parameters, and the backward leaves its gradients.
pub struct Zero3Step<'a, B: TrainBackend> {
    parameters: &'a mut ShardedParameters<B>,
    world: &'a dyn Communicator<B::Wire>,
}

impl<B: TrainBackend, M: AutodiffModule<B>> LayerParameters<B, M> for Zero3Step<'_, B> {
    // Both run inside a forward whose shard's positions are noted for the guard; their slices of
    // flat parameter buffers are no positions and no token shifts.
    fn gather(&mut self, model: &M, group: ParameterGroup) -> Result<M, UlyssesError> {
        let indices = self.parameters.group(group).to_vec();
        not_positions(|| self.parameters.gathered(model.clone(), &indices, self.world))
    }

    fn gradients_done(&mut self, model: &M, group: ParameterGroup, grads: GradientsParams) -> Result<Option<GradientsParams>, UlyssesError> {
        not_positions(|| self.parameters.take_group_gradients(model, group, grads, self.world))?;
        Ok(None)
    }

    fn trains(&self, id: ParamId) -> Option<bool> {
        self.parameters.parameters.iter().find(|p| p.id == id).map(|p| p.trains)
    }

    fn step_targets(&mut self, valid_tokens: usize) {
        if let Some(in_backward) = &mut self.parameters.in_backward {
            in_backward.targets = valid_tokens > 0;
        }
    }
}

/// The ids of the float parameters visited.
struct CollectIds(Vec<ParamId>);

impl<B: burn::tensor::backend::Backend> ModuleVisitor<B> for CollectIds {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.0.push(param.id);
    }
}

/// Which parameters (indices in the model's order) each group of a ZeRO-3 step gathers: each
/// layer's; the rest's (every other), and the rest without, and with only, a standalone head's
/// (`ParameterGroup::Embedding`, `Head`).
struct Groups {
    layers: Vec<Vec<usize>>,
    rest: Vec<usize>,
    embedding: Vec<usize>,
    head: Vec<usize>,
}

impl Groups {
    /// The groups of `model`, whose float parameters are `ids` (with their `paths`) in its
    /// order; read from the ids alone (a lazy model stays unbuilt). Refused when two layers
    /// ([`LayeredLm::visit_layer`]) claim the same parameter, or where one has no elements.
    fn of<B: TrainBackend, M: AutodiffModule<B> + LayeredLm<B>>(model: &M, ids: &[ParamId], paths: &[String]) -> Result<Self, UlyssesError> {
        check_no_empty_parameter(&crate::parameter_elements(model), || paths.to_vec())?;
        let mut index_of: HashMap<ParamId, usize> = HashMap::with_capacity(ids.len());
        for (index, id) in ids.iter().enumerate() {
            // Each place's part is gathered into the place; a second place of one parameter
            // would keep its placeholder (zeros), silently.
            if let Some(first) = index_of.insert(*id, index) {
                return Err(UlyssesError::InvalidConfig(format!(
                    "{} and {} are one parameter (one ParamId at two places of the model): ZeRO-3 gathers each place's part into it, \
                     and a second place of the same parameter would hold its placeholder. Give each place its own parameter (tie them \
                     as the decoder ties its head: one place, read twice in the forward), or train without --zero 3",
                    paths[first], paths[index]
                )));
            }
        }
        let mut owner: Vec<Option<usize>> = vec![None; ids.len()];
        let mut layers = Vec::with_capacity(model.layer_count());
        for layer in 0..model.layer_count() {
            let mut visited = CollectIds(Vec::new());
            model.visit_layer(layer, &mut visited);
            let mut indices = Vec::with_capacity(visited.0.len());
            for id in visited.0 {
                let index = *index_of.get(&id).ok_or_else(|| UlyssesError::InvalidConfig(format!("LayeredLm::visit_layer({layer}) visits a parameter the model does not hold")))?;
                if let Some(other) = owner[index].replace(layer) {
                    return Err(UlyssesError::InvalidConfig(format!(
                        "{} is visited by layers {other} and {layer} (LayeredLm::visit_layer): ZeRO-3 gathers a parameter with one layer, and \
                         while a layer runs the others' parameters (and the rest's: embeddings, head) are placeholders, so a parameter \
                         shared across layers is not supported under ZeRO-3: give each layer its own, or train without --zero 3",
                        paths[index]
                    )));
                }
                indices.push(index);
            }
            layers.push(indices);
        }
        let rest: Vec<usize> = (0..ids.len()).filter(|&i| owner[i].is_none()).collect();
        let mut head = CollectIds(Vec::new());
        model.visit_standalone_head(&mut head);
        if head.0.iter().any(|id| !index_of.contains_key(id)) {
            return Err(UlyssesError::InvalidConfig("LayeredLm::visit_standalone_head visits a parameter the model does not hold".into()));
        }
        if let Some(index) = head.0.iter().find_map(|id| index_of.get(id).filter(|&&i| owner[i].is_some())) {
            return Err(UlyssesError::InvalidConfig(format!(
                "{} is visited by LayeredLm::visit_standalone_head and by visit_layer({}): a standalone head's parameters are its own",
                paths[*index],
                owner[*index].unwrap_or_default()
            )));
        }
        let head: Vec<usize> = rest.iter().copied().filter(|&i| head.0.contains(&ids[i])).collect();
        let embedding = rest.iter().copied().filter(|i| !head.contains(i)).collect();
        Ok(Self { layers, rest, embedding, head })
    }
}

/// Where [`ShardedParameters::shard_from`] takes each parameter's parts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartsFrom {
    /// World rank 0's parameter, broadcast; the optimizer keeps this rank's part as its master
    /// weights.
    Rank0,
    /// The optimizer's master weights (a resumed run's): the model's values are not read.
    Masters,
}

/// [`ShardedParameters::shard_from`]'s pass over the model: each float parameter in turn, its
/// parts taken, a placeholder left in its place.
struct TakeParts<'a, B: TrainBackend, O: PartOptimizer<B>> {
    world: &'a dyn Communicator<B::Wire>,
    optimizer: &'a mut O,
    from: PartsFrom,
    partition: Partition,
    compute: FloatDType,
    parts_on_host: bool,
    device: burn::tensor::Device<B::InnerBackend>,
    /// The model's float parameters in its visit order, which its map must follow (the
    /// optimizer takes its parts in that order).
    ids: &'a [ParamId],
    paths: &'a [String],
    parts: Vec<PartOf<B>>,
    /// The first failure: the parameters after it become placeholders, with no collective.
    error: Option<UlyssesError>,
}

impl<B: TrainBackend, O: PartOptimizer<B>> TakeParts<'_, B, O> {
    /// This rank's parts of the parameter at `index`: from world rank 0's values (`rank_0`:
    /// this rank's, on rank 0 alone), the f32 master part too, or from the optimizer's.
    fn take(&mut self, index: usize, shape: &Shape, trains: bool, rank_0: Option<Tensor<B::InnerBackend, 1>>) -> Result<(), UlyssesError> {
        let elements = shape.num_elements();
        let compute = match self.from {
            PartsFrom::Masters => self.optimizer.compute_part(index, self.compute, &self.device),
            PartsFrom::Rank0 => {
                let whole = match (rank_0, self.world.size()) {
                    (Some(values), 1) => values.cast(FloatDType::F32).to_device(&self.device),
                    (mine, _) => {
                        let mine = mine.map_or_else(|| Tensor::zeros([elements], (&self.device, DType::F32)), |values| values.cast(FloatDType::F32).to_device(&self.device));
                        float_tensor::<B::InnerBackend, 1>(self.world.broadcast(float_primitive(mine), 0)?)
                    }
                };
                let master = own_part(&self.partition, self.world.rank(), whole);
                self.optimizer.keep_master_part(elements, master.clone());
                if self.compute == FloatDType::F32 { master } else { master.cast(self.compute) }
            }
        };
        let part = if self.parts_on_host { Held::Host(compute.into_data()) } else { Held::Device(compute) };
        self.parts.push(PartOf { id: self.ids[index], path: self.paths[index].clone(), shape: shape.clone(), dtype: self.compute.into(), trains, part });
        Ok(())
    }
}

impl<B: TrainBackend, O: PartOptimizer<B>> ModuleMapper<B> for TakeParts<'_, B, O> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let index = self.parts.len();
        let shape = param.lazy_shape();
        let placeholder = Tensor::<B::InnerBackend, D>::zeros([1; D], (&self.device, DType::from(self.compute)));
        if self.error.is_none() && self.ids.get(index) != Some(&param.id) {
            self.error = Some(UlyssesError::InvalidConfig(format!(
                "the model maps its parameters in another order than it visits them (at {}): ZeRO-3 takes their parts in one order",
                self.paths.get(index).map_or("its end", String::as_str)
            )));
        }
        // Rank 0 builds a lazy parameter now, for its values; the others (and every rank taking
        // the optimizer's) take its flag alone, building nothing.
        let (values, id, requires_grad, mapper) = if self.world.rank() == 0 && self.from == PartsFrom::Rank0 {
            let (id, tensor, mapper) = param.consume();
            let requires_grad = tensor.is_require_grad();
            (Some(tensor.inner().reshape([-1])), id, requires_grad, mapper)
        } else {
            let (id, requires_grad, mapper) = crate::take_lazy_flag(param);
            (None, id, requires_grad, mapper)
        };
        // The placeholder on this rank's device, whichever device the model was built for.
        let param = Param::from_mapped_value(id, Tensor::from_inner(placeholder).require_grad(), mapper);
        if self.error.is_none()
            && let Err(error) = self.take(index, &shape, requires_grad, values)
        {
            self.error = Some(error);
        }
        param
    }
}

/// Every float parameter replaced by a one-element placeholder of its dtype, keeping its id,
/// that requires a gradient (see [`PartOf::trains`]); collects whether each parameter did.
struct Placeholders(Vec<bool>);

impl<B: burn::tensor::backend::AutodiffBackend> ModuleMapper<B> for Placeholders {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        self.0.push(tensor.is_require_grad());
        let placeholder = Tensor::<B::InnerBackend, D>::zeros([1; D], (&tensor.device(), tensor.dtype()));
        Param::from_mapped_value(id, Tensor::from_inner(placeholder).require_grad(), mapper)
    }
}

/// Gathered values (flat, with their shapes and whether they require a gradient) put in place
/// of the parameters with those ids.
struct Gathered<B: TrainBackend> {
    values: HashMap<ParamId, (Tensor<B::InnerBackend, 1>, Shape, bool)>,
}

impl<B: TrainBackend> ModuleMapper<B> for Gathered<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let Some((flat, shape, trains)) = self.values.remove(&param.id) else { return param };
        let (id, _placeholder, mapper) = param.consume();
        Param::from_mapped_value(id, Tensor::from_inner(flat.reshape(shape)).set_require_grad(trains), mapper)
    }
}

/// Whether every value is finite, in chunks of at least 1M values, one a thread.
fn all_finite_on_threads(values: &[f32], threads: NonZeroUsize) -> bool {
    let chunk = values.len().div_ceil(threads.get()).max(1 << 20);
    std::thread::scope(|scope| {
        let chunks: Vec<_> = values.chunks(chunk).map(|chunk| scope.spawn(move || chunk.iter().all(|g| g.is_finite()))).collect();
        chunks.into_iter().all(|chunk| chunk.join().expect("a finiteness scan cannot panic"))
    })
}


#[cfg(test)]
mod tests {
    use super::*;

    /// A NaN or an infinity anywhere, the last of several threads' chunks included, is found.
    #[test]
    fn a_value_that_is_not_finite_is_found_in_any_chunk() {
        let threads = NonZeroUsize::new(4).unwrap();
        let mut values = vec![1.5f32; (3 << 20) + 7];
        assert!(all_finite_on_threads(&values, threads));
        assert!(all_finite_on_threads(&[], threads));
        for (at, bad) in [(0, f32::NAN), (values.len() - 1, f32::INFINITY), (1 << 20, f32::NEG_INFINITY)] {
            values[at] = bad;
            assert!(!all_finite_on_threads(&values, threads), "{bad} at {at}");
            values[at] = 1.5;
        }
    }
}
