//! ZeRO's optimizer half over a world of ranks (SP × DP: SP ranks hold identical parameters,
//! so they share the state too): each rank keeps, in host memory, only its part
//! (`ulysses_core::zero::Partition`) of every float parameter's f32 master weights and AdamW
//! moments, 12 bytes a parameter divided by the world, where replicated training keeps both
//! moments of every parameter on every rank's device. A step
//!
//! 1. reduce-scatters the gradients, each padded to the partition, in buckets laid out
//!    rank-major (one collective and one read a bucket): every rank receives its part of each
//!    sum, the bits an all-reduce gives there;
//! 2. clips with the norm of the whole gradient, its parts' squares summed in f64 on each rank
//!    and over the ranks in rank order (the same on every rank);
//! 3. updates its part of the master weights with the host AdamW (`ulysses_core::host_adamw`,
//!    burn's AdamW operation for operation);
//! 4. all-gathers the updated parts into the model's parameters, a bucket at a time.
//!
//! So it trains as replicated AdamW does ([`crate::MatrixDecayAdamW`]: the same sums, the same
//! update, the decay on weight matrices alone), up to the clipping norm's rounding. Its state is saved as one file per rank ([`ShardedAdamW::save`], each
//! atomic) and loaded at any world size ([`ShardedAdamW::load`] re-partitions it).
//!
//! The model (its compute copy) stays whole on every rank (ZeRO-3, [`super::stage3`], cuts it
//! into parts too, and uses the pieces of this step). Each bucket's parts cross to the host
//! through a copy queued behind its reduce-scatter, the step's awaited at once, and back
//! through an upload. A world of one rank skips the collectives (its part is the whole).


use std::{
    num::NonZeroUsize,
    sync::{
        Arc, OnceLock, Weak,
        mpsc::{Receiver, Sender},
    },
    thread::JoinHandle,
};

use burn::{
    module::{AutodiffModule, ModuleMapper, Param},
    optim::GradientsParams,
    tensor::{DType, Element, ElementConversion, FloatDType, Tensor, TensorData, bf16, f16},
};
use burn_ulysses::{UlyssesError, comm::Communicator};
use ulysses_core::{
    gradients::{GRADIENT_BUCKET_BYTES, plan_buckets},
    host_adamw::{AdamWMoments, HostAdamW, HostAdamWConfig},
    zero::Partition,
};

use super::parts::{all_gather_columns, check_no_empty_parameter, check_parts_fit, host_part, host_parts, norm_of_parts, part_elements, reduce_scatter_buckets};
use crate::{
    TrainBackend,
    gradients::{LocalGradient, TakeGradients},
};

/// AdamW with its state sharded over the world's ranks and updated on the host (see the module
/// doc).
pub struct ShardedAdamW {
    pub(super) adamw: HostAdamW,
    /// Per float parameter of the model, in its visit order; filled at the first step. Held by
    /// `updating` while it runs: read through [`settled`](Self::settled).
    pub(super) parts: Vec<ParameterPart>,
    /// The rank and world the parts are of (set at the first step, or by `load`).
    pub(super) place: Option<(usize, usize)>,
    /// A ZeRO-3 step's update, running on a thread of its own while the device goes on
    /// ([`spawn_update`](Self::spawn_update)); it gives the parts back when it ends
    /// ([`settle`](Self::settle)).
    updating: Option<UpdateThread>,
    /// What the last update in the backward found in its gradient parts, once settled.
    checked: Option<PartChecks>,
    /// An update in the backward's link to the ZeRO-3 parameters that give it groups.
    backward: Option<BackwardLink>,
    /// A test's hold on that thread: one message lets it update one group.
    pace: Option<Receiver<()>>,
    /// Run first on each update thread ([`on_update_thread`](Self::on_update_thread)).
    thread_start: Option<Arc<dyn Fn() + Send + Sync>>,
    /// Why the state was lost (its update thread failed, or never started): every later use
    /// is refused, rather than meet an empty state.
    lost: Option<String>,
}

/// A step's update running on its thread: joined where it is dropped unjoined (an optimizer
/// dropped on an error's way out), so that no update outlives its optimizer, holding the state
/// and the host's cores beside a library caller's next try. One still open to its step's
/// groups (`open`: a backward under way, whose parameters still send them) is left to end as
/// they stop coming. On an error's way out a rank so leaves its group once its update has ended
/// (a second or two for an 8B model's part), a wait its peers spend before they learn of it.
struct UpdateThread {
    thread: Option<JoinHandle<UpdateEnd>>,
    open: Option<Weak<()>>,
}

impl UpdateThread {
    fn join(mut self) -> std::thread::Result<UpdateEnd> {
        self.thread.take().expect("an update thread is joined once").join()
    }
}

impl Drop for UpdateThread {
    fn drop(&mut self) {
        if let Some(thread) = self.thread.take().filter(|_| self.open.as_ref().is_none_or(|open| open.strong_count() == 0)) {
            let _ = thread.join();
        }
    }
}

/// This rank's part of one parameter's master weights and moments.
#[derive(Clone)]
pub(super) struct ParameterPart {
    /// The parameter's elements (unpadded), to check that the model is the one partitioned.
    pub(super) elements: usize,
    /// Shared with ZeRO-3's parameters where they keep their parts on the host
    /// ([`PartForm::Master`]): they let go of it before each update, which then writes it in
    /// place (`Arc::make_mut`: a copy only if one were still held).
    pub(super) master: Arc<Vec<f32>>,
    pub(super) moments: AdamWMoments,
}

/// One group's gradient parts for an update thread: (parameter index, this rank's part).
pub(super) type GroupGradients = Vec<(usize, Vec<f32>)>;

/// An update in the backward, as its optimizer sees the ZeRO-3 parameters that give it groups
/// ([`ShardedParameters::update_in_backward`](super::ShardedParameters::update_in_backward)):
/// while `open` has a holder, they may still send one (a settle would wait for ever: refused);
/// `abandoned`, once set, says why its step ended unapplied, after some groups were updated (the
/// state is then lost).
pub(super) struct BackwardLink {
    pub(super) open: Weak<()>,
    pub(super) abandoned: Arc<OnceLock<String>>,
}

/// What an update thread gives back: the state, a test's pace, and with updates in the
/// backward what it found in the gradient parts.
type UpdateEnd = (Vec<ParameterPart>, Option<Receiver<()>>, Option<PartChecks>);

/// What an update in the backward ([`ShardedParameters::update_in_backward`](super::ShardedParameters::update_in_backward))
/// found in the gradient parts it took, as it took them: there the step's health check and
/// gradient norm cannot read them at the step's end, they are gone.
#[derive(Debug, Clone, PartialEq)]
pub struct PartChecks {
    /// Each parameter's part's sum of squares (f64), `None` where it had no part: summed in
    /// parameter order for the norm, as [`ShardedAdamW::clip`] sums them.
    pub squares: Vec<Option<f64>>,
    /// The first part (by arrival) holding a NaN or an infinity: it and every later one were
    /// left as they were, and the state is lost.
    pub non_finite: Option<usize>,
}

/// The form in which [`ShardedAdamW::spawn_update`] hands over a parameter's new part of the
/// compute copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PartForm {
    /// Cast to the compute dtype on the update thread (for a part kept on the device).
    Compute(DType),
    /// The master weights themselves, shared (for a part kept on the host, cast as each
    /// gather uploads it: the host then holds the master weights once, not beside a copy).
    Master,
}

/// A parameter's new part of the compute copy, as [`PartForm`] asked.
pub(super) enum NewPart {
    Compute(TensorData),
    Master(Arc<Vec<f32>>),
}

impl ShardedAdamW {
    /// On every core of the host.
    pub fn new(config: HostAdamWConfig) -> Self {
        Self::updating_with(HostAdamW::new(config))
    }

    /// On `threads` threads: a host's cores divided among the ranks it runs, so that the ranks'
    /// updates together take about the host's cores rather than each all of them.
    pub fn with_threads(config: HostAdamWConfig, threads: NonZeroUsize) -> Self {
        Self::updating_with(HostAdamW::with_threads(config, threads))
    }

    /// No state yet, updated by `adamw`.
    fn updating_with(adamw: HostAdamW) -> Self {
        Self { adamw, parts: Vec::new(), place: None, updating: None, checked: None, backward: None, pace: None, thread_start: None, lost: None }
    }

    /// The threads its update takes (a loaded state takes every core until told otherwise).
    pub fn threads(&self) -> NonZeroUsize {
        self.adamw.threads()
    }

    /// Takes `threads` threads for its updates from now on.
    pub fn set_threads(&mut self, threads: NonZeroUsize) {
        self.adamw = HostAdamW::with_threads(*self.adamw.config(), threads);
    }

    /// Runs `start` first on the thread each ZeRO-3 step's update is driven from (the norm's
    /// and the AdamW's worker threads it spawns per parameter do not run it): to count the
    /// update's allocations (the moments, the compute copy's new parts) as the rank's, or to
    /// set that thread's affinity.
    pub fn on_update_thread(&mut self, start: impl Fn() + Send + Sync + 'static) {
        self.thread_start = Some(Arc::new(start));
    }

    /// Waits for a step's update still running on its thread (ZeRO-3 with the optimizer on the
    /// host), so that the state is this step's. Refused, now and at every later call, when
    /// that thread failed: the state is then lost (resume from the last checkpoint).
    pub fn settle(&mut self) -> Result<(), UlyssesError> {
        if self.updating.is_some() && self.backward.as_ref().is_some_and(|link| link.open.strong_count() > 0) {
            return Err(UlyssesError::InModel {
                message: "the host optimizer's update in the backward still takes its step's groups: the step's apply_step_zero3 ends it first".into(),
            });
        }
        if let Some(updating) = self.updating.take() {
            match updating.join() {
                Ok((parts, pace, checked)) => {
                    if let Some(index) = checked.as_ref().and_then(|checked| checked.non_finite) {
                        self.lost = Some(format!(
                            "parameter #{index}'s gradient part held a NaN or an infinity when its update in the backward came, after earlier parts were updated"
                        ));
                    }
                    (self.parts, self.pace, self.checked) = (parts, pace, checked);
                }
                Err(panic) => self.lost = Some(format!("its update thread failed: {}", ulysses_core::comm::panic_message(panic.as_ref()))),
            }
        }
        if let Some(why) = self.backward.take().and_then(|link| link.abandoned.get().cloned()) {
            self.lost.get_or_insert(why);
        }
        match &self.lost {
            None => Ok(()),
            Some(why) => Err(UlyssesError::InModel { message: format!("the host optimizer's state is lost ({why}): resume from the last checkpoint") }),
        }
    }

    /// The parts, which no update holds: every reader [`settle`](Self::settle)s first.
    fn settled(&self) -> &[ParameterPart] {
        assert!(self.updating.is_none(), "ShardedAdamW read while a step's update still runs on its thread: settle() first");
        &self.parts
    }

    /// Holds the update thread of each later [`spawn_update`](Self::spawn_update): it
    /// updates a group only for each message `pace` brings (a test's view of the pipeline).
    #[doc(hidden)]
    pub fn pace_updates(&mut self, pace: Receiver<()>) {
        self.pace = Some(pace);
    }

    /// Takes this rank's part of `model`'s parameters (rank `rank` of a world of `world`) as the
    /// f32 master weights, replacing any state: call it before the model becomes a
    /// half-precision compute copy ([`crate::with_parameters_in`]), or the first step takes
    /// the master weights from the copy's rounded values. Refused for a rank the world has not.
    pub fn keep_master_weights<B: burn::tensor::backend::Backend, M: burn::module::Module<B>>(&mut self, model: &M, rank: usize, world: usize) -> Result<(), UlyssesError> {
        let partition = super::parts::partition_of(rank, world)?;
        check_no_empty_parameter(&crate::parameter_elements(model), || crate::parameter_paths(model))?;
        self.begin_master_parts(rank, world);
        for p in crate::float_parameters(model) {
            self.keep_master_part(p.values.dims()[0], host_part(&partition, rank, &p.values));
        }
        Ok(())
    }

    /// Drops any state and starts holding rank `rank`'s parts of a world of `world`, none yet:
    /// [`keep_master_part`](Self::keep_master_part) then takes each parameter's, in the
    /// model's order.
    pub(super) fn begin_master_parts(&mut self, rank: usize, world: usize) {
        // A running update's state is replaced whatever it became, a lost one too. One still
        // open to its step's groups (its backward under way) cannot be joined: it ends on its
        // own, its state dropped, not taken for the new one's at the next settle.
        let _ = self.settle();
        (self.updating, self.backward, self.checked) = (None, None, None);
        self.lost = None;
        self.parts = Vec::new();
        self.place = Some((rank, world));
    }

    /// Takes `master` (this rank's part, padded to the partition, of the next parameter, of
    /// `elements` elements whole) as its master weights, moments not yet made.
    pub(super) fn keep_master_part(&mut self, elements: usize, master: Vec<f32>) {
        self.parts.push(ParameterPart { elements, master: Arc::new(master), moments: AdamWMoments::default() });
    }

    /// This rank's part of parameter `index`'s master weights (padded to the partition).
    pub(super) fn master_part(&self, index: usize) -> &[f32] {
        &self.settled()[index].master
    }

    /// Bytes of optimizer state (master weights and both moments) each rank of a world of
    /// `world` holds on the host for parameters of `elements` elements each, once they have
    /// stepped: 12 bytes an element of its parts.
    pub fn host_bytes_of(elements: &[usize], world: usize) -> usize {
        12 * part_elements(elements, world)
    }

    /// Refuses, before any step, a host without the memory that `ranks_on_this_host` ranks
    /// (rank threads of one process, or processes on one node) of a world of `world` hold there
    /// at a step's end, for parameters of `elements` elements: of each element of a rank's
    /// parts, 12 bytes of state, `gradient_bytes` of the step's gradient (4, f32, all arrived
    /// before the update may start: the clipping norm and the NaN guard need every part; 0
    /// where ZeRO-3 updates each group in the backward as its parts arrive:
    /// `ShardedParameters::update_in_backward`), and
    /// `parameter_bytes` of the compute copy where its parts wait on the host as copies (none
    /// where they are the master weights: `ShardedParameters::share_master_weights`); `beside` that, what else those ranks keep on the host (bytes,
    /// and what they are: the devices' memory where it is the host's, offloaded activations).
    /// Says the bytes needed and available, and what to change.
    pub fn check_host_memory(elements: &[usize], world: usize, ranks_on_this_host: usize, parameter_bytes: usize, gradient_bytes: usize, beside: &[(u64, &str)]) -> Result<(), UlyssesError> {
        Self::check_host_memory_of(ulysses_core::host_memory::available_bytes(), elements, world, ranks_on_this_host, parameter_bytes, gradient_bytes, beside)
    }

    /// [`check_host_memory`](Self::check_host_memory) on a host with `available` bytes.
    fn check_host_memory_of(
        available: Option<u64>,
        elements: &[usize],
        world: usize,
        ranks_on_this_host: usize,
        parameter_bytes: usize,
        gradient_bytes: usize,
        beside: &[(u64, &str)],
    ) -> Result<(), UlyssesError> {
        let per_element = 12 + gradient_bytes + parameter_bytes;
        let beside: Vec<(u64, &str)> = beside.iter().copied().filter(|&(bytes, _)| bytes > 0).collect();
        let needed = (part_elements(elements, world) * per_element) as u64 * ranks_on_this_host as u64 + beside.iter().map(|(bytes, _)| bytes).sum::<u64>();
        let what = format!(
            "the optimizer on the host ({} parameters over a world of {world}: {per_element} bytes each of a rank's part, 12 of state, {}{}; for {ranks_on_this_host} rank(s) on this host{})",
            elements.iter().sum::<usize>(),
            if gradient_bytes > 0 { format!("{gradient_bytes} of the step's gradient") } else { "none of the gradient (updated in the backward)".into() },
            if parameter_bytes > 0 { format!(", {parameter_bytes} of the parameters kept on the host") } else { String::new() },
            beside.iter().map(|(bytes, what)| format!(", beside {:.2} GB {what}", *bytes as f64 / 1e9)).collect::<String>()
        );
        let fix = format!(
            "{}spread the ranks over more nodes (a larger world divides the state), or keep the optimizer on the device",
            if parameter_bytes > 0 { "keep the parameters on the device (without --offload-parameters), " } else { "" }
        );
        ulysses_core::host_memory::check_fits(needed, available, &what, &fix).map_err(UlyssesError::InvalidConfig)
    }

    /// Bytes of optimizer state (master weights and both moments) this rank holds on the host
    /// (once a running update ends).
    pub fn host_bytes(&mut self) -> Result<usize, UlyssesError> {
        self.settle()?;
        Ok(self.parts.iter().map(|part| 4 * (part.master.len() + part.moments.moment_1.len() + part.moments.moment_2.len())).sum())
    }

    /// One optimizer step of `model` by this rank's `grads` (not yet summed over the ranks) at
    /// `learning_rate`, clipping to `max_grad_norm`; collective over `world`, the ranks that
    /// share the parameters. Returns the updated model and the gradient norm before clipping;
    /// where that norm is not finite (every rank agrees), the model and the state as they were.
    pub fn step<B: TrainBackend, M: AutodiffModule<B>>(
        &mut self,
        learning_rate: f64,
        model: M,
        mut grads: GradientsParams,
        max_grad_norm: Option<f64>,
        world: &dyn Communicator<B::Wire>,
    ) -> Result<(M, f64), UlyssesError> {
        let partition = Partition::new(world.size()).expect("a world has a rank");
        let rank = world.rank();
        let mut take = TakeGradients::<B> { grads: &mut grads, local: Vec::new() };
        model.visit(&mut take);
        let mut local = take.local;
        let elements: Vec<usize> = local.iter().map(LocalGradient::len).collect();
        let misfit = self.settle().and_then(|()| check_no_empty_parameter(&elements, || crate::parameter_paths(&model))).and_then(|()| {
            if self.parts.is_empty() {
                self.parts = local.iter().map(|l| ParameterPart { elements: l.len(), master: Arc::new(host_part(&partition, rank, &l.parameter)), moments: AdamWMoments::default() }).collect();
                self.place = Some((rank, world.size()));
            }
            self.check_holds(rank, world.size(), &elements)
        });
        // Agreed before any other collective: a rank that stopped alone (its state of another
        // place, its last update failed) would leave the others waiting in the next one.
        let every_rank = burn_ulysses::comm::all_gather_host_checked(world, &[misfit.is_ok() as u64], "sharded optimizer checks")?;
        misfit?;
        if let Some(other) = every_rank.iter().position(|ok| ok[0] == 0) {
            return Err(UlyssesError::InvalidConfig(format!(
                "rank {other}'s sharded optimizer does not fit its model or place, or its last update failed (its error says why)"
            )));
        }

        // 1. This rank's part of every gradient's sum.
        let grad_parts = host_parts(reduce_scatter_buckets::<B>(&mut local, &partition, world)?, local.len())?;
        // 2. and 3. The norm, and the update of this rank's parts.
        let decayed: Vec<bool> = local.iter().map(|l| l.decays).collect();
        let grad_norm = self.update(learning_rate, &grad_parts, &decayed, max_grad_norm, world)?;
        if !grad_norm.is_finite() {
            return Ok((model, grad_norm));
        }
        // 4. Every rank's parts into the parameters.
        let updated: Vec<(usize, DType)> = local.iter().enumerate().filter(|&(i, _)| grad_parts[i].is_some()).map(|(i, l)| (i, l.dtype())).collect();
        let device = local.first().map(|l| l.parameter.device());
        let mut values: Vec<Option<Tensor<B::InnerBackend, 1>>> = vec![None; local.len()];
        if let Some(device) = device {
            for (i, whole) in self.all_gather_masters::<B>(&updated, world, &device)? {
                values[i] = Some(whole);
            }
        }
        let model = model.map(&mut SetParameters::<B> { values: Box::new(values.into_iter()) });
        Ok((model, grad_norm))
    }

    /// `model` with every float parameter set from the master weights, all-gathered in the
    /// parameter's dtype onto its device (what a resumed run starts from). Collective over
    /// `world`; refused when the parts are of another model.
    pub(crate) fn model_from_masters<B: TrainBackend, M: AutodiffModule<B>>(&self, model: M, world: &dyn Communicator<B::Wire>) -> Result<M, UlyssesError> {
        let parameters = crate::float_parameters(&model);
        self.check_holds(world.rank(), world.size(), &parameters.iter().map(|p| p.values.dims()[0]).collect::<Vec<_>>())?;
        let Some(device) = model.devices().first().cloned() else { return Ok(model) };
        let which: Vec<(usize, DType)> = parameters.iter().enumerate().map(|(i, p)| (i, p.values.dtype())).collect();
        drop(parameters);
        // One parameter gathered at a time, as the model's takes its place: the device holds
        // the model once, and one parameter beside it (not a second model, gathered whole).
        let failed = std::cell::RefCell::new(None);
        let gathered = which.iter().map(|&one| {
            if failed.borrow().is_some() {
                return None;
            }
            match self.all_gather_masters::<B>(&[one], world, &device) {
                Ok(mut whole) => whole.pop().map(|(_, values)| values),
                Err(error) => {
                    *failed.borrow_mut() = Some(error);
                    None
                }
            }
        });
        let model = model.map(&mut SetParameters::<B> { values: Box::new(gathered) });
        match failed.into_inner() {
            Some(error) => Err(error),
            None => Ok(model),
        }
    }

    /// Refuses to step as another rank, or another model, than the parts are of.
    pub(crate) fn check_holds(&self, rank: usize, world: usize, elements: &[usize]) -> Result<(), UlyssesError> {
        check_parts_fit(self.place, &self.settled().iter().map(|part| part.elements).collect::<Vec<_>>(), rank, world, elements)
    }

    /// Updates this rank's parts with `grad_parts` (this rank's part of each parameter's
    /// gradient summed over `world`, in the parts' order; `None`: no rank has a gradient, the
    /// parameter stays), each decayed where `decayed` says (see `ulysses_core::host_adamw::decays`),
    /// clipping to `max_grad_norm` with the norm of the whole gradient: its
    /// parts' squares summed in f64 on each rank and over the ranks in rank order (the same on
    /// every rank; `clip_with_norm`'s factor). Returns that norm, before clipping; where it is
    /// not finite (finite gradients whose sum overflowed f32), no part is updated.
    pub(crate) fn update<G: burn::tensor::backend::Backend>(
        &mut self,
        learning_rate: f64,
        grad_parts: &[Option<Vec<f32>>],
        decayed: &[bool],
        max_grad_norm: Option<f64>,
        world: &dyn Communicator<G>,
    ) -> Result<f64, UlyssesError> {
        self.settle()?;
        self.adamw.config().check(learning_rate)?;
        assert_eq!(decayed.len(), grad_parts.len(), "a decay for every parameter");
        let (grad_norm, factor) = clipping(&self.adamw, grad_parts, max_grad_norm, world)?;
        if !grad_norm.is_finite() {
            return Ok(grad_norm);
        }
        for ((part, grad), &decays) in self.parts.iter_mut().zip(grad_parts.iter()).zip(decayed) {
            if let Some(grad) = grad {
                part.update(&self.adamw, learning_rate, grad, factor, decays);
            }
        }
        Ok(grad_norm)
    }

    /// Before a ZeRO-3 step's update ([`spawn_update`](Self::spawn_update)): once a running
    /// update ends, the whole gradient's norm (collective over `world`) and the factor that
    /// clips it to `max_grad_norm`, where it must be.
    pub(crate) fn clip<G: burn::tensor::backend::Backend>(&mut self, grad_parts: &[Option<Vec<f32>>], max_grad_norm: Option<f64>, world: &dyn Communicator<G>) -> Result<(f64, Option<f64>), UlyssesError> {
        self.settle()?;
        clipping(&self.adamw, grad_parts, max_grad_norm, world)
    }

    /// [`update`](Self::update) by `grad_parts` scaled by `factor` (from [`clip`](Self::clip)),
    /// on a thread of its own, so that the device goes on meanwhile (ZeRO-3's next forward):
    /// `order`'s groups of parameters one after another ([`spawn_update_of`](Self::spawn_update_of)).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn spawn_update(
        &mut self,
        learning_rate: f64,
        mut grad_parts: Vec<Option<Vec<f32>>>,
        decayed: Vec<bool>,
        factor: Option<f64>,
        order: Vec<Vec<usize>>,
        forms: Vec<PartForm>,
        updated: Sender<(usize, NewPart)>,
    ) -> Result<(), UlyssesError> {
        let (groups, arriving) = std::sync::mpsc::channel();
        for group in order {
            // Unbounded: every send is taken, and the thread drops nothing it was sent.
            let _ = groups.send(group.into_iter().filter_map(|index| grad_parts[index].take().map(|grad| (index, grad))).collect());
        }
        drop(groups);
        self.spawn_update_of(learning_rate, arriving, decayed, factor, forms, updated, false)
    }

    /// An update on a thread of its own of the groups of gradient parts `groups` brings, one
    /// after another as they come, until its senders are gone: each updated parameter's part
    /// of the compute copy sent to `updated` as soon as it is made, in the form `forms[index]`
    /// asks for; scaled by `factor`, decayed where `decayed[index]`. With `check` (an update in
    /// the backward, whose parts no one reads after), each part's sum of squares is taken first,
    /// and a part that is not finite stops the update there ([`PartChecks`]). The state is the
    /// step's once [`settle`](Self::settle)d, which every later use of it does first.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn spawn_update_of(
        &mut self,
        learning_rate: f64,
        groups: Receiver<GroupGradients>,
        decayed: Vec<bool>,
        factor: Option<f64>,
        forms: Vec<PartForm>,
        updated: Sender<(usize, NewPart)>,
        check: bool,
    ) -> Result<(), UlyssesError> {
        self.settle()?;
        self.adamw.config().check(learning_rate)?;
        self.checked = None;
        let (mut parts, pace, adamw, start) = (std::mem::take(&mut self.parts), self.pace.take(), self.adamw, self.thread_start.clone());
        let threads = adamw.threads();
        let update = move || {
            if let Some(start) = start {
                start();
            }
            let mut checked = check.then(|| PartChecks { squares: vec![None; parts.len()], non_finite: None });
            for group in groups {
                if let Some(pace) = &pace {
                    let _ = pace.recv();
                }
                for (index, grad) in group {
                    if let Some(checked) = &mut checked {
                        if checked.non_finite.is_some() {
                            continue;
                        }
                        // f64 squares of f32 values cannot overflow: the sum is finite where
                        // every value is.
                        let squares = adamw.sum_of_squares(&grad);
                        if !squares.is_finite() {
                            checked.non_finite = Some(index);
                            continue;
                        }
                        checked.squares[index] = Some(squares);
                    }
                    // Each gradient part goes as soon as it is used: the host's peak is the step's end.
                    parts[index].update(&adamw, learning_rate, &grad, factor, decayed[index]);
                    drop(grad);
                    let master = &parts[index].master;
                    let new = match forms[index] {
                        PartForm::Compute(dtype) => NewPart::Compute(cast_master_part(master, dtype, threads)),
                        PartForm::Master => NewPart::Master(Arc::clone(master)),
                    };
                    // Nobody waits any more after a failed step; the state is updated all the same.
                    let _ = updated.send((index, new));
                }
            }
            (parts, pace, checked)
        };
        match std::thread::Builder::new().name("host-adamw".into()).spawn(update) {
            Ok(thread) => self.updating = Some(UpdateThread { thread: Some(thread), open: None }),
            // The state went with the thread that never started.
            Err(e) => self.lost = Some(format!("its update thread could not start: {e}")),
        }
        if self.lost.is_some() {
            self.settle()?;
        }
        Ok(())
    }

    /// Links the update about to start to the ZeRO-3 parameters that give it groups in the
    /// backward ([`BackwardLink`]).
    pub(super) fn link_backward(&mut self, link: BackwardLink) {
        if let Some(updating) = &mut self.updating {
            updating.open = Some(link.open.clone());
        }
        self.backward = Some(link);
    }

    /// Marks the state lost, for `why`: a step updated in the backward that failed after its
    /// update (its groups are that step's, the others the last's). Every later use is refused.
    pub(crate) fn lose(&mut self, why: String) {
        let _ = self.settle();
        self.lost.get_or_insert(why);
    }

    /// What the last update in the backward found in its gradient parts (once it ends), taken;
    /// `None` after an update that was not in the backward. Given too where a part that was not
    /// finite lost the state (the step's health check names it; every later use is refused).
    pub(crate) fn take_part_checks(&mut self) -> Result<Option<PartChecks>, UlyssesError> {
        let settled = self.settle();
        match (self.checked.take(), settled) {
            // Lost for it: the step's health check names the part.
            (Some(checked), _) if checked.non_finite.is_some() => Ok(Some(checked)),
            (checked, Ok(())) => Ok(checked),
            // Lost otherwise (an abandoned update's checks are not this step's).
            (_, Err(error)) => Err(error),
        }
    }

    /// This rank's part of each parameter's master weights, shared (once a running update
    /// ends): for ZeRO-3's parts kept on the host to be them
    /// (`ShardedParameters::share_master_weights`).
    pub(crate) fn shared_master_weights(&mut self) -> Result<Vec<Arc<Vec<f32>>>, UlyssesError> {
        self.settle()?;
        Ok(self.parts.iter().map(|part| Arc::clone(&part.master)).collect())
    }

    /// A state from its parts: per parameter, its elements, this rank's part of the master
    /// weights and its moments; of rank and world `place`.
    pub(crate) fn from_parts(config: HostAdamWConfig, parts: Vec<(usize, Vec<f32>, AdamWMoments)>, place: Option<(usize, usize)>) -> Self {
        let parts = parts.into_iter().map(|(elements, master, moments)| ParameterPart { elements, master: Arc::new(master), moments }).collect();
        Self { parts, place, ..Self::new(config) }
    }

    /// The settings, the parts (as [`from_parts`](Self::from_parts) takes them) and the place.
    pub(crate) fn parts(&self) -> (HostAdamWConfig, impl Iterator<Item = (usize, &[f32], &AdamWMoments)>, Option<(usize, usize)>) {
        (*self.adamw.config(), self.settled().iter().map(|part| (part.elements, part.master.as_slice(), &part.moments)), self.place)
    }

    /// Parameters `which` (index in the parts' order, and the dtype to gather in) whole on
    /// `device`, flat: every rank's part of their master weights all-gathered, one upload and
    /// one all-gather a bucket of one dtype (a half-precision compute copy gathers half the
    /// bytes). Collective over `world`.
    pub(crate) fn all_gather_masters<B: TrainBackend>(&self, which: &[(usize, DType)], world: &dyn Communicator<B::Wire>, device: &burn::tensor::Device<B::InnerBackend>) -> Result<Vec<(usize, Tensor<B::InnerBackend, 1>)>, UlyssesError> {
        let partition = Partition::new(world.size()).expect("a world has a rank");
        let parts = self.settled();
        let sizes: Vec<(usize, DType)> = which.iter().map(|&(i, dtype)| (4 * partition.padded_len(parts[i].elements), dtype)).collect();
        let mut gathered = Vec::with_capacity(which.len());
        for bucket in plan_buckets(&sizes, &vec![true; which.len()], GRADIENT_BUCKET_BYTES) {
            let mine: Vec<f32> = bucket.iter().flat_map(|&b| parts[which[b].0].master.iter().copied()).collect();
            let len = mine.len();
            // Uploaded in f32 (not the device's default float, which may round them), then cast.
            let mine = Tensor::<B::InnerBackend, 1>::from_data(TensorData::new(mine, [len]), (device, burn::tensor::DType::F32)).cast(FloatDType::from(which[bucket[0]].1));
            gathered.extend(all_gather_columns::<B>(mine, bucket.iter().map(|&b| (which[b].0, parts[which[b].0].elements)), &partition, world)?);
        }
        Ok(gathered)
    }
}

impl ParameterPart {
    /// One AdamW update by `grad` (this rank's part of the summed gradient), scaled first by
    /// the clipping `factor` where there is one; with the weight decay where `decays`.
    fn update(&mut self, adamw: &HostAdamW, learning_rate: f64, grad: &[f32], factor: Option<f64>, decays: bool) {
        // ZeRO-3's parts on the host let go of the master weights they share before an update.
        debug_assert_eq!(Arc::strong_count(&self.master), 1, "master weights updated while shared: make_mut copies them");
        adamw.step_scaled(learning_rate, Arc::<Vec<f32>>::make_mut(&mut self.master), grad, factor.map_or(1.0, |factor| factor as f32), decays, &mut self.moments);
    }
}

/// `master` in the compute dtype `dtype`: the part of the compute copy the update thread sends
/// for a part on the device, and what a gather uploads of a part kept as master weights. Each
/// value converted as burn's `TensorData::convert_dtype` converts it, straight from the master
/// weights (no f32 copy first) and, in a half dtype, on `threads` threads (at most 8: the cast
/// is bound by memory bandwidth before that): a layer of the 8B shape is 218M values, cast once
/// a step on the update thread, or at each gather. `threads` is the rank's share of the host's
/// cores (the host optimizer's, [`ShardedAdamW::threads`]), so that the ranks of one node do
/// not each take every core.
pub fn cast_master_part(master: &[f32], dtype: DType, threads: NonZeroUsize) -> TensorData {
    match dtype {
        DType::BF16 => TensorData::new(convert_on_threads::<bf16>(master, threads), [master.len()]),
        DType::F16 => TensorData::new(convert_on_threads::<f16>(master, threads), [master.len()]),
        _ => TensorData::new(master.to_vec(), [master.len()]).convert_dtype(dtype),
    }
}

/// `values` converted element by element (`ElementConversion`, as `convert_dtype` does), in
/// chunks of at least 64K values, one a thread.
fn convert_on_threads<T: Element>(values: &[f32], threads: NonZeroUsize) -> Vec<T> {
    let mut out = vec![0.0f32.elem::<T>(); values.len()];
    let chunk = values.len().div_ceil(threads.get().min(8)).max(1 << 16);
    std::thread::scope(|scope| {
        for (from, to) in values.chunks(chunk).zip(out.chunks_mut(chunk)) {
            scope.spawn(move || from.iter().zip(to).for_each(|(value, out)| *out = value.elem()));
        }
    });
    out
}

/// The norm of the whole gradient whose parts (this rank's of each parameter, summed over
/// `world`) are `grad_parts`, and the factor that clips it to `max_grad_norm`
/// ([`norm_of_parts`]): their squares summed in f64 on each rank (on its threads, by
/// parameter in order: `HostAdamW::sum_of_squares`). Collective.
fn clipping<G: burn::tensor::backend::Backend>(adamw: &HostAdamW, grad_parts: &[Option<Vec<f32>>], max_grad_norm: Option<f64>, world: &dyn Communicator<G>) -> Result<(f64, Option<f64>), UlyssesError> {
    norm_of_parts(grad_parts.iter().flatten().map(|part| adamw.sum_of_squares(part)).sum(), max_grad_norm, world)
}

/// The host AdamW's settings from burn's `AdamWConfig`, the same update; refused, naming the
/// setting, where burn's config asks for what the host AdamW does not do (AMSGrad, cautious
/// weight decay, clipping inside the optimizer: clip the summed gradient with `max_grad_norm`).
pub fn host_adamw_config(config: &burn::optim::AdamWConfig) -> Result<HostAdamWConfig, UlyssesError> {
    // burn's fields are private; its config serialises them all.
    let fields: serde_json::Value = serde_json::from_str(&config.to_string()).map_err(|e| UlyssesError::InvalidConfig(format!("the AdamW config: {e}")))?;
    for (setting, unsupported) in [("amsgrad", fields["amsgrad"] == true), ("cautious_weight_decay", fields["cautious_weight_decay"] == true), ("grad_clipping", !fields["grad_clipping"].is_null())] {
        if unsupported {
            return Err(UlyssesError::InvalidConfig(format!(
                "the AdamW config sets {setting}, which the optimizer on the host does not do: leave it unset (clip the summed gradient with max_grad_norm, --max-grad-norm), or keep the optimizer on the device"
            )));
        }
    }
    adamw_settings(config)
}

/// burn's `AdamWConfig`'s betas, epsilon and weight decay (its fields are private), whatever
/// else it sets.
pub fn adamw_settings(config: &burn::optim::AdamWConfig) -> Result<HostAdamWConfig, UlyssesError> {
    let fields: serde_json::Value = serde_json::from_str(&config.to_string()).map_err(|e| UlyssesError::InvalidConfig(format!("the AdamW config: {e}")))?;
    // JSON writes a NaN or an infinity as null: read back as NaN, for the caller to refuse by name.
    let number = |name: &str| match fields.get(name) {
        Some(serde_json::Value::Null) => Ok(f32::NAN),
        value => value.and_then(serde_json::Value::as_f64).map(|v| v as f32).ok_or_else(|| UlyssesError::InvalidConfig(format!("the AdamW config has no number {name}"))),
    };
    Ok(HostAdamWConfig { beta_1: number("beta_1")?, beta_2: number("beta_2")?, epsilon: number("epsilon")?, weight_decay: number("weight_decay")? })
}

/// Puts the gathered values (flat, in visit order; `None`: unchanged) into the parameters,
/// keeping their ids and whether they require gradients.
struct SetParameters<'a, B: TrainBackend> {
    values: Box<dyn Iterator<Item = Option<Tensor<B::InnerBackend, 1>>> + 'a>,
}

impl<B: TrainBackend> ModuleMapper<B> for SetParameters<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let Some(Some(flat)) = self.values.next() else { return param };
        let (id, tensor, mapper) = param.consume();
        let requires_grad = tensor.is_require_grad();
        let mut updated = Tensor::<B, D>::from_inner(flat.reshape(tensor.shape()));
        if requires_grad {
            updated = updated.require_grad();
        }
        Param::from_mapped_value(id, updated, mapper)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::zero::state_files::{ShardedState, sharded_state_file};

    /// Per parameter: elements, step count, and the whole master weights and moments.
    pub(in crate::zero) type Whole = Vec<(usize, u32, [Vec<f32>; 3])>;

    pub(in crate::zero) fn whole() -> Whole {
        [(10usize, 3u32), (1, 3), (7, 0), (16, 3)]
            .into_iter()
            .enumerate()
            .map(|(p, (elements, time))| {
                let values = |which: usize| (0..elements).map(|i| (100 * p + 10 * which + i) as f32 + 0.5).collect::<Vec<f32>>();
                (elements, time, [values(0), values(1), values(2)])
            })
            .collect()
    }

    /// Rank `rank`'s parts of `whole` over a world of `world`, as a step would hold them.
    pub(in crate::zero) fn of_rank(whole: &Whole, rank: usize, world: usize) -> ShardedAdamW {
        let partition = Partition::new(world).unwrap();
        let part = |values: &Vec<f32>, elements: usize| {
            let owned = partition.owned(elements, rank);
            let mut part = vec![0.0; partition.part_len(elements)];
            part[..owned.len()].copy_from_slice(&values[owned]);
            part
        };
        let parts = whole
            .iter()
            .map(|(elements, time, [master, m1, m2])| ParameterPart {
                elements: *elements,
                master: Arc::new(part(master, *elements)),
                moments: if *time == 0 { AdamWMoments::default() } else { AdamWMoments { moment_1: part(m1, *elements), moment_2: part(m2, *elements), time: *time } },
            })
            .collect();
        ShardedAdamW { parts, place: Some((rank, world)), ..ShardedAdamW::new(HostAdamWConfig { weight_decay: 0.03, ..HostAdamWConfig::default() }) }
    }

    /// A place the world has not (an empty world, a rank past its last) is refused by name where
    /// the state is taken or loaded: an empty world divided by zero, a rank past the last took
    /// an empty part (zeros loaded as its state).
    #[test]
    fn a_place_the_world_has_not_is_refused() {
        let model = burn::nn::LinearConfig::new(2, 3).init::<burn::backend::NdArray>(&Default::default());
        let dir = std::env::temp_dir().join(format!("ulysses-no-such-place-{}", std::process::id()));
        of_rank(&whole(), 0, 1).save(&dir, 0, 1).unwrap();
        for (rank, world) in [(0, 0), (2, 2), (1, 1)] {
            let mut optimizer = ShardedAdamW::new(HostAdamWConfig::default());
            for message in [optimizer.keep_master_weights(&model, rank, world).unwrap_err().to_string(), ShardedAdamW::load(&dir, rank, world).err().unwrap().to_string()] {
                assert!(message.contains(&format!("rank {rank} of a world of {world}")) && message.contains("size()"), "{message}");
            }
        }
        assert!(ShardedAdamW::load(&dir, 0, 2).is_ok());
        let message = of_rank(&whole(), 0, 2).save(&dir, 1, 2).unwrap_err().to_string();
        assert!(message.contains("holds rank 0's parts of a world of 2") && message.contains("as rank 1 of 2"), "{message}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Settings that cannot train (a beta of 1, a negative weight decay) are refused by the
    /// update, on the step's thread and on its own (as in the backward), naming the setting,
    /// before any part moves.
    #[test]
    fn settings_that_cannot_train_are_refused_by_every_update() {
        let outcome = burn_ulysses::comm::ThreadGroup::new(1).run(|rank| {
            let comm = rank.communicator();
            let grads = || -> Vec<Option<Vec<f32>>> { whole().iter().map(|(elements, _, _)| Some(vec![0.25; *elements])).collect() };
            let mut messages = Vec::new();
            for bad in [HostAdamWConfig { beta_2: 1.0, ..HostAdamWConfig::default() }, HostAdamWConfig { weight_decay: -0.5, ..HostAdamWConfig::default() }] {
                let mut optimizer = ShardedAdamW { adamw: HostAdamW::new(bad), ..of_rank(&whole(), 0, 1) };
                let update = optimizer.update::<burn::backend::NdArray>(1e-2, &grads(), &[true; 4], None, &*comm).map(drop);
                let (sent, _arriving) = std::sync::mpsc::channel();
                let spawned = optimizer.spawn_update(1e-2, grads(), vec![true; 4], None, vec![(0..4).collect()], vec![PartForm::Compute(DType::F32); 4], sent);
                let unmoved = optimizer.parts.iter().zip(of_rank(&whole(), 0, 1).parts).all(|(part, fresh)| part.master == fresh.master);
                messages.push((update.unwrap_err().to_string(), spawned.unwrap_err().to_string(), unmoved));
            }
            messages
        });
        let messages = outcome.into_iter().next().unwrap().unwrap();
        for ((update, spawned, unmoved), setting) in messages.into_iter().zip(["AdamW's beta_2 must be at least 0 and below 1", "AdamW's weight_decay must be 0 or more"]) {
            assert!(update.contains(setting) && spawned.contains(setting), "{setting}: {update} / {spawned}");
            assert!(unmoved, "{setting}: a part moved");
        }
    }

    /// An update thread that fails loses the state for good: the settle after it and every
    /// later use (another settle, a save, the bytes it holds, a step) are refused, naming the
    /// failure, rather than meet the empty state the thread took with it. A fresh state
    /// (`keep_master_weights`) ends that.
    #[test]
    fn a_failed_update_thread_loses_the_state_for_good() {
        let outcome = burn_ulysses::comm::ThreadGroup::new(1).run(|rank| {
            let comm = rank.communicator();
            let mut optimizer = of_rank(&whole(), 0, 1);
            optimizer.on_update_thread(|| panic!("a test's failing update thread"));
            let grads: Vec<Option<Vec<f32>>> = whole().iter().map(|(elements, _, _)| Some(vec![0.25; *elements])).collect();
            let (sent, _arriving) = std::sync::mpsc::channel();
            let (_, factor) = optimizer.clip::<burn::backend::NdArray>(&grads, None, &*comm).unwrap();
            optimizer.spawn_update(1e-2, grads, vec![true; 4], factor, vec![(0..4).collect()], vec![PartForm::Compute(DType::F32); 4], sent).unwrap();
            let first = optimizer.settle().unwrap_err().to_string();
            let dir = std::env::temp_dir().join(format!("ulysses-lost-state-{}", std::process::id()));
            let later = [optimizer.settle().map(drop), optimizer.save(&dir, 0, 1).map(drop), optimizer.host_bytes().map(drop)].map(|r| r.unwrap_err().to_string());
            let saved = dir.join(sharded_state_file(0, 1)).exists();
            let model = burn::nn::LinearConfig::new(2, 2).init::<burn::backend::NdArray>(&Default::default());
            optimizer.keep_master_weights(&model, 0, 1).unwrap();
            (first, later, saved, optimizer.settle().is_ok())
        });
        let (first, later, saved, fresh) = outcome.into_iter().next().unwrap().unwrap();
        assert!(first.contains("a test's failing update thread") && first.contains("resume from the last checkpoint"), "{first}");
        for message in later {
            assert!(message.contains("state is lost") && message.contains("a test's failing update thread"), "a later use: {message}");
        }
        assert!(!saved, "a lost state was saved");
        assert!(fresh, "keep_master_weights gives it a state again");
    }

    /// An optimizer dropped while its update runs (an error's way out) waits for the update:
    /// no thread of it outlives it. One linked to a backward still under way (its parameters
    /// still send groups) is left to end on its own, not waited for.
    #[test]
    fn a_dropped_optimizer_waits_for_its_running_update_unless_a_backward_feeds_it() {
        use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
        let running = |link: Option<&Arc<()>>| {
            let mut optimizer = of_rank(&whole(), 0, 1);
            let (groups, taken) = std::sync::mpsc::channel::<Vec<(usize, Vec<f32>)>>();
            let (updated, _arriving) = std::sync::mpsc::channel();
            optimizer.spawn_update_of(1e-2, taken, vec![true; 4], None, vec![PartForm::Compute(DType::F32); 4], updated, true).unwrap();
            if let Some(open) = link {
                optimizer.link_backward(BackwardLink { open: Arc::downgrade(open), abandoned: Arc::new(OnceLock::new()) });
            }
            let dropped = Arc::new(AtomicBool::new(false));
            let dropping = {
                let dropped = Arc::clone(&dropped);
                std::thread::spawn(move || {
                    drop(optimizer);
                    dropped.store(true, SeqCst);
                })
            };
            (groups, dropped, dropping)
        };
        let (groups, dropped, dropping) = running(None);
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(!dropped.load(SeqCst), "the optimizer was gone while its update still waited for groups");
        drop(groups);
        dropping.join().unwrap();
        assert!(dropped.load(SeqCst));
        // Linked to a backward still open: dropped at once, its update left to end.
        let open = Arc::new(());
        let (groups, dropped, dropping) = running(Some(&open));
        let waited = std::time::Instant::now();
        while !dropping.is_finished() && waited.elapsed() < std::time::Duration::from_secs(5) {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(dropped.load(SeqCst), "an optimizer whose backward still feeds its update waited for it");
        drop((groups, open));
    }

    /// An update in the backward checks each part as it takes it: the sums of squares of the
    /// finite ones (what the norm sums, as `clip` sums them), and at the first part holding a
    /// NaN or an infinity it stops, leaving it and every later part as they were, and loses the
    /// state (a step at its end updates nothing past its health check; this one has updated
    /// some parts already). The checks are still given, to name the parameter.
    #[test]
    fn an_update_in_the_backward_stops_at_a_part_that_is_not_finite() {
        let mut optimizer = of_rank(&whole(), 0, 1);
        let before: Vec<Vec<f32>> = optimizer.parts.iter().map(|part| part.master.to_vec()).collect();
        let grad = |index: usize, value: f32| (index, vec![value; whole()[index].0]);
        let (groups, taken) = std::sync::mpsc::channel();
        let (updated, _arriving) = std::sync::mpsc::channel();
        optimizer.spawn_update_of(1e-2, taken, vec![true; 4], None, vec![PartForm::Compute(DType::F32); 4], updated, true).unwrap();
        groups.send(vec![grad(3, 0.5)]).unwrap();
        groups.send(vec![grad(0, 0.25), grad(1, f32::NAN), grad(2, 0.125)]).unwrap();
        drop(groups);
        let checks = optimizer.take_part_checks().unwrap().expect("an update in the backward gives its checks");
        assert_eq!(checks.non_finite, Some(1));
        assert_eq!(checks.squares, vec![Some(10.0 * 0.0625), None, None, Some(16.0 * 0.25)]);
        let lost = optimizer.settle().unwrap_err().to_string();
        assert!(lost.contains("parameter #1's gradient part held a NaN or an infinity") && lost.contains("resume from the last checkpoint"), "{lost}");
        // Read past the loss: the parts before the NaN moved, it and the one after did not.
        let after: Vec<Vec<f32>> = optimizer.parts.iter().map(|part| part.master.to_vec()).collect();
        let moved: Vec<bool> = before.iter().zip(&after).map(|(a, b)| a != b).collect();
        assert_eq!(moved, [true, false, false, true]);
    }

    /// The full Llama-3.1-8B shape (8.03e9 parameters) with the optimizer on the host of a GPU
    /// machine (137 GB, 128 GiB): alone it needs 128.5 GB at a step's end (state and the
    /// step's f32 gradient), which fits; with copies of its bf16 parameters on the host too
    /// (where they are not the master weights), 144.5 GB, refused before step 1 naming both
    /// figures and the flag to drop; over a world of 2 half;
    /// with its layer inputs of 64K tokens offloaded beside the state, 147.3 GB, refused.
    #[test]
    fn the_host_check_counts_the_gradient_and_the_parameters_kept_there() {
        let (eight_b, machine) = ([8_030_261_248usize], Some(137_438_953_472u64));
        assert!(ShardedAdamW::check_host_memory_of(machine, &eight_b, 1, 1, 0, 4, &[]).is_ok(), "state and gradient: 128.5 GB");
        let refused = ShardedAdamW::check_host_memory_of(machine, &eight_b, 1, 1, 2, 4, &[]).unwrap_err().to_string();
        assert!(refused.contains("needs 144.54 GB") && refused.contains("137.44 GB available") && refused.contains("--offload-parameters"), "{refused}");
        assert!(ShardedAdamW::check_host_memory_of(machine, &eight_b, 2, 1, 2, 4, &[]).is_ok(), "a world of 2 holds half each");
        let two_ranks = ShardedAdamW::check_host_memory_of(machine, &eight_b, 2, 2, 2, 4, &[]).unwrap_err().to_string();
        assert!(two_ranks.contains("needs 144.54 GB") && two_ranks.contains("2 rank(s) on this host"), "{two_ranks}");
        // Its 32 layers' inputs and 3 gradients of 65 536 tokens (bf16, 4096 wide) on the host too: 18.79 GB more.
        let inputs = crate::LayerCheckpointing::new().with_offload_to_host(true).offloaded_host_bytes(32, 1, 65_536, 4096, 2);
        assert_eq!(inputs, 35 * 65_536 * 4096 * 2);
        let offloaded = ShardedAdamW::check_host_memory_of(machine, &eight_b, 1, 1, 0, 4, &[(inputs, "of layer inputs (--offload-to-host)")]).unwrap_err().to_string();
        assert!(offloaded.contains("needs 147.27 GB") && offloaded.contains("beside 18.79 GB of layer inputs (--offload-to-host)"), "{offloaded}");
        // Updated in the backward, no gradient part waits for the step's end: 96.4 GB of state
        // beside them fits; with the parameters' copies too (112.4 GB) and twice the inputs
        // (37.58 GB), not.
        assert!(ShardedAdamW::check_host_memory_of(machine, &eight_b, 1, 1, 0, 0, &[(inputs, "of layer inputs (--offload-to-host)")]).is_ok(), "12 bytes a parameter and the inputs");
        let copies = ShardedAdamW::check_host_memory_of(machine, &eight_b, 1, 1, 2, 0, &[(2 * inputs, "of layer inputs")]).unwrap_err().to_string();
        assert!(copies.contains("needs 150.00 GB") && copies.contains("14 bytes each") && copies.contains("none of the gradient (updated in the backward)"), "{copies}");
        assert_eq!(crate::LayerCheckpointing::new().offloaded_host_bytes(32, 1, 65_536, 4096, 2), 0, "nothing offloaded without offload_to_host");
    }

    /// A part kept as master weights is uploaded with the bits `convert_dtype` gives (what the
    /// update thread sends for a part on the device): ties, subnormals, the largest values,
    /// infinities, signed zeros and NaN, over enough values for several threads.
    #[test]
    fn a_master_part_is_cast_as_convert_dtype_casts() {
        let special = [1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8), 1.0 + 2f32.powi(-11), f32::MIN_POSITIVE / 3.0, f32::MAX, 65_520.0, -65_519.0, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, f32::NAN];
        let values: Vec<f32> = (0..300_000u32).map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761))).chain(special).collect();
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            let reference = TensorData::new(values.clone(), [values.len()]).convert_dtype(dtype);
            // One thread, a share that cuts the values unevenly, and more than the cast takes.
            for threads in [1, 3, 16] {
                let cast = cast_master_part(&values, dtype, NonZeroUsize::new(threads).unwrap());
                assert_eq!((cast.dtype, &cast.shape), (dtype, &reference.shape));
                assert!(cast.as_bytes() == reference.as_bytes(), "{dtype:?} on {threads} threads: the cast differs from convert_dtype's");
            }
        }
    }

    /// State partitioned for another rank or world (loaded for the wrong place) is refused at
    /// the step, naming the load that fits, before any collective or update.
    #[test]
    fn state_of_another_place_is_refused_at_the_step() {
        use burn::{backend::{Autodiff, NdArray}, nn::LinearConfig};
        type Ad = Autodiff<NdArray<f32>>;
        let outcome = burn_ulysses::comm::ThreadGroup::new(1).run(|rank| {
            let comm = rank.communicator();
            let device = Default::default();
            let linear = LinearConfig::new(3, 2).init::<Ad>(&device);
            let loss = linear.forward(Tensor::<Ad, 2>::ones([1, 3], &device)).sum();
            let grads = GradientsParams::from_grads(loss.backward(), &linear);
            let mut optimizer = of_rank(&whole(), 1, 2);
            optimizer.step::<Ad, _>(1e-3, linear, grads, None, &*comm).err().map(|e| e.to_string())
        });
        let message = outcome.into_iter().next().unwrap().unwrap().unwrap_or_default();
        assert!(message.contains("rank 1's parts of a world of 2") && message.contains("ShardedAdamW::load(dir, 0, 1)"), "{message}");
    }

    /// burn's AdamW settings carry over (its defaults are the host AdamW's); what the host
    /// AdamW does not do is refused by name.
    #[test]
    fn burns_adamw_settings_carry_over_and_the_rest_is_refused() {
        use burn::optim::{AdamWConfig, grad_clipping::GradientClippingConfig};
        assert_eq!(host_adamw_config(&AdamWConfig::new()).unwrap(), HostAdamWConfig::default());
        let set = AdamWConfig::new().with_beta_1(0.8).with_beta_2(0.95).with_epsilon(1e-8).with_weight_decay(0.1);
        assert_eq!(host_adamw_config(&set).unwrap(), HostAdamWConfig { beta_1: 0.8, beta_2: 0.95, epsilon: 1e-8, weight_decay: 0.1 });
        for (config, setting) in [
            (AdamWConfig::new().with_amsgrad(true), "amsgrad"),
            (AdamWConfig::new().with_cautious_weight_decay(true), "cautious_weight_decay"),
            (AdamWConfig::new().with_grad_clipping(Some(GradientClippingConfig::Value(1.0))), "grad_clipping"),
        ] {
            let message = host_adamw_config(&config).unwrap_err().to_string();
            assert!(message.contains(setting) && message.contains("max_grad_norm"), "{message}");
        }
    }

    /// A rank whose optimizer does not fit its model (here rank 1's holds another model's
    /// parts) stops with its own error, and the other ranks with it, naming it: the ranks agree
    /// on their checks before the step's collectives (a library caller's rank that returned
    /// alone left the others waiting in them until it left, or for their timeout).
    #[test]
    fn a_rank_whose_optimizer_does_not_fit_stops_every_rank_naming_it() {
        use burn::{
            backend::{Autodiff, NdArray},
            nn::LinearConfig,
        };
        type Ad = Autodiff<NdArray<f32>>;
        // A regression waits in a collective: the group's timeout fails it instead.
        let group = burn_ulysses::comm::ThreadGroup::from_config(&burn_ulysses::comm::ThreadGroupConfig::new(2).with_timeout_secs(30.0));
        let outcome = group.run(|rank| {
            let comm = rank.communicator();
            let linear = LinearConfig::new(3, 2).init::<Ad>(&Default::default());
            let mut optimizer = if comm.rank() == 1 { of_rank(&whole(), 1, 2) } else { ShardedAdamW::new(HostAdamWConfig::default()) };
            let grads = GradientsParams::from_grads(linear.forward(Tensor::<Ad, 2>::ones([1, 3], &Default::default())).sum().backward(), &linear);
            optimizer.step::<Ad, _>(1e-2, linear, grads, None, &*comm).err().map(|e| e.to_string()).unwrap_or_default()
        });
        let messages: Vec<String> = outcome.into_iter().map(|r| r.unwrap()).collect();
        assert!(messages[1].contains("one sharded optimizer per model"), "rank 1: {}", messages[1]);
        assert!(messages[0].contains("rank 1's sharded optimizer does not fit its model or place"), "rank 0: {}", messages[0]);
    }
}
