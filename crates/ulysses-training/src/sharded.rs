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
//! So it trains as replicated AdamW does (the same sums, the same update), up to the clipping
//! norm's rounding. Its state is saved as one file per rank ([`ShardedAdamW::save`], each
//! atomic) and loaded at any world size ([`ShardedAdamW::load`] re-partitions it).
//!
//! The model (its compute copy) stays whole on every rank (ZeRO-3, `crate::zero3`, cuts it
//! into parts too, and uses the pieces of this step). Each bucket's parts cross to the host
//! through a copy queued behind its reduce-scatter, the step's awaited at once, and back
//! through an upload. A world of one rank skips the collectives (its part is the whole).

use std::{
    fs,
    io::{Read, Seek, SeekFrom, Write},
    num::NonZeroUsize,
    path::{Path, PathBuf},
    sync::{
        Arc,
        mpsc::{Receiver, Sender},
    },
    thread::JoinHandle,
};

use burn::{
    module::{AutodiffModule, ModuleMapper, Param},
    optim::GradientsParams,
    tensor::{DType, Element, ElementConversion, FloatDType, Tensor, TensorData, bf16, f16},
};
use burn_ulysses::{
    UlyssesError,
    comm::{Communicator, ReduceOp},
    device_io::{self, PendingRead},
    primitive::{float_primitive, float_tensor},
};
use ulysses_core::{
    gradients::{GRADIENT_BUCKET_BYTES, plan_buckets, present_anywhere},
    host_adamw::{AdamWMoments, HostAdamW, HostAdamWConfig},
    zero::Partition,
};

use serde::{Deserialize, Serialize};

use crate::{
    TrainBackend,
    checkpoint::{FNV1A_START, fnv1a, fnv1a_more, write_atomically_with},
    gradients::{LocalGradient, TakeGradients},
};

/// AdamW with its state sharded over the world's ranks and updated on the host (see the module
/// doc).
pub struct ShardedAdamW {
    adamw: HostAdamW,
    /// Per float parameter of the model, in its visit order; filled at the first step. Held by
    /// `updating` while it runs: read through [`settled`](Self::settled).
    parts: Vec<ParameterPart>,
    /// The rank and world the parts are of (set at the first step, or by `load`).
    place: Option<(usize, usize)>,
    /// A ZeRO-3 step's update, running on a thread of its own while the device goes on
    /// ([`spawn_update`](Self::spawn_update)); it gives the parts back when it ends
    /// ([`settle`](Self::settle)).
    updating: Option<JoinHandle<(Vec<ParameterPart>, Option<Receiver<()>>)>>,
    /// A test's hold on that thread: one message lets it update one group.
    pace: Option<Receiver<()>>,
    /// Run first on each update thread ([`on_update_thread`](Self::on_update_thread)).
    thread_start: Option<Arc<dyn Fn() + Send + Sync>>,
    /// Why the state was lost (its update thread failed, or never started): every later use
    /// is refused, rather than meet an empty state.
    lost: Option<String>,
}

/// This rank's part of one parameter's master weights and moments.
struct ParameterPart {
    /// The parameter's elements (unpadded), to check that the model is the one partitioned.
    elements: usize,
    /// Shared with ZeRO-3's parameters where they keep their parts on the host
    /// ([`PartForm::Master`]): they let go of it before each update, which then writes it in
    /// place (`Arc::make_mut`: a copy only if one were still held).
    master: Arc<Vec<f32>>,
    moments: AdamWMoments,
}

/// The form in which [`ShardedAdamW::spawn_update`] hands over a parameter's new part of the
/// compute copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PartForm {
    /// Cast to the compute dtype on the update thread (for a part kept on the device).
    Compute(DType),
    /// The master weights themselves, shared (for a part kept on the host, cast as each
    /// gather uploads it: the host then holds the master weights once, not beside a copy).
    Master,
}

/// A parameter's new part of the compute copy, as [`PartForm`] asked.
pub(crate) enum NewPart {
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
        Self { adamw, parts: Vec::new(), place: None, updating: None, pace: None, thread_start: None, lost: None }
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
        if let Some(updating) = self.updating.take() {
            match updating.join() {
                Ok((parts, pace)) => (self.parts, self.pace) = (parts, pace),
                Err(panic) => self.lost = Some(format!("its update thread failed: {}", ulysses_core::comm::panic_message(panic.as_ref()))),
            }
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
    /// the master weights from the copy's rounded values.
    pub fn keep_master_weights<B: burn::tensor::backend::Backend, M: burn::module::Module<B>>(&mut self, model: &M, rank: usize, world: usize) {
        // A running update's state is replaced whatever it became, a lost one too.
        let _ = self.settle();
        self.lost = None;
        let partition = Partition::new(world).expect("a world has a rank");
        self.parts = crate::float_parameters(model)
            .iter()
            .map(|p| ParameterPart { elements: p.values.dims()[0], master: Arc::new(host_part(&partition, rank, &p.values)), moments: AdamWMoments::default() })
            .collect();
        self.place = Some((rank, world));
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
    /// parts, 12 bytes of state, 4 of the step's gradient (f32, all arrived before the update
    /// may start: the clipping norm and the NaN guard need every part), and
    /// `parameter_bytes` of the compute copy where its parts wait on the host as copies (none
    /// where they are the master weights: `ShardedParameters::share_master_weights`); `beside` that, what else those ranks keep on the host (bytes,
    /// and what they are: the devices' memory where it is the host's, offloaded activations).
    /// Says the bytes needed and available, and what to change.
    pub fn check_host_memory(elements: &[usize], world: usize, ranks_on_this_host: usize, parameter_bytes: usize, beside: &[(u64, &str)]) -> Result<(), UlyssesError> {
        Self::check_host_memory_of(ulysses_core::host_memory::available_bytes(), elements, world, ranks_on_this_host, parameter_bytes, beside)
    }

    /// [`check_host_memory`](Self::check_host_memory) on a host with `available` bytes.
    fn check_host_memory_of(available: Option<u64>, elements: &[usize], world: usize, ranks_on_this_host: usize, parameter_bytes: usize, beside: &[(u64, &str)]) -> Result<(), UlyssesError> {
        let per_element = 16 + parameter_bytes;
        let beside: Vec<(u64, &str)> = beside.iter().copied().filter(|&(bytes, _)| bytes > 0).collect();
        let needed = (part_elements(elements, world) * per_element) as u64 * ranks_on_this_host as u64 + beside.iter().map(|(bytes, _)| bytes).sum::<u64>();
        let what = format!(
            "the optimizer on the host ({} parameters over a world of {world}: {per_element} bytes each of a rank's part, 12 of state, 4 of the step's gradient{}; for {ranks_on_this_host} rank(s) on this host{})",
            elements.iter().sum::<usize>(),
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
    /// share the parameters. Returns the updated model and the gradient norm before clipping.
    pub fn step<B: TrainBackend, M: AutodiffModule<B>>(
        &mut self,
        learning_rate: f64,
        model: M,
        mut grads: GradientsParams,
        max_grad_norm: Option<f64>,
        world: &dyn Communicator<B::Wire>,
    ) -> Result<(M, f64), UlyssesError> {
        self.settle()?;
        let partition = Partition::new(world.size()).expect("a world has a rank");
        let rank = world.rank();
        let mut take = TakeGradients::<B> { grads: &mut grads, local: Vec::new() };
        model.visit(&mut take);
        let mut local = take.local;
        if self.parts.is_empty() {
            self.parts = local.iter().map(|l| ParameterPart { elements: l.len(), master: Arc::new(host_part(&partition, rank, &l.parameter)), moments: AdamWMoments::default() }).collect();
            self.place = Some((rank, world.size()));
        }
        self.check_holds(rank, world.size(), &local.iter().map(LocalGradient::len).collect::<Vec<_>>())?;

        // 1. This rank's part of every gradient's sum.
        let grad_parts = host_parts(reduce_scatter_buckets::<B>(&mut local, &partition, world)?, local.len())?;
        // 2. and 3. The norm, and the update of this rank's parts.
        let grad_norm = self.update(learning_rate, &grad_parts, max_grad_norm, world)?;
        // 4. Every rank's parts into the parameters.
        let updated: Vec<(usize, DType)> = local.iter().enumerate().filter(|&(i, _)| grad_parts[i].is_some()).map(|(i, l)| (i, l.dtype())).collect();
        let device = local.first().map(|l| l.parameter.device());
        let mut values: Vec<Option<Tensor<B::InnerBackend, 1>>> = vec![None; local.len()];
        if let Some(device) = device {
            for (i, whole) in self.all_gather_masters::<B>(&updated, world, &device)? {
                values[i] = Some(whole);
            }
        }
        let model = model.map(&mut SetParameters::<B> { values: values.into_iter() });
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
        let mut values: Vec<Option<Tensor<B::InnerBackend, 1>>> = vec![None; which.len()];
        for (i, whole) in self.all_gather_masters::<B>(&which, world, &device)? {
            values[i] = Some(whole);
        }
        Ok(model.map(&mut SetParameters::<B> { values: values.into_iter() }))
    }

    /// Refuses to step as another rank, or another model, than the parts are of.
    pub(crate) fn check_holds(&self, rank: usize, world: usize, elements: &[usize]) -> Result<(), UlyssesError> {
        check_parts_fit(self.place, &self.settled().iter().map(|part| part.elements).collect::<Vec<_>>(), rank, world, elements)
    }

    /// Updates this rank's parts with `grad_parts` (this rank's part of each parameter's
    /// gradient summed over `world`, in the parts' order; `None`: no rank has a gradient, the
    /// parameter stays), clipping to `max_grad_norm` with the norm of the whole gradient: its
    /// parts' squares summed in f64 on each rank and over the ranks in rank order (the same on
    /// every rank; `clip_with_norm`'s factor). Returns that norm, before clipping.
    pub(crate) fn update<G: burn::tensor::backend::Backend>(&mut self, learning_rate: f64, grad_parts: &[Option<Vec<f32>>], max_grad_norm: Option<f64>, world: &dyn Communicator<G>) -> Result<f64, UlyssesError> {
        self.settle()?;
        let (grad_norm, factor) = clipping(&self.adamw, grad_parts, max_grad_norm, world)?;
        for (part, grad) in self.parts.iter_mut().zip(grad_parts.iter()) {
            if let Some(grad) = grad {
                part.update(&self.adamw, learning_rate, grad, factor);
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
    /// `order`'s groups of parameters one after another, each updated parameter's part of the
    /// compute copy sent to `updated` as soon as it is made, in the form `forms[index]` asks
    /// for. The state is the step's once [`settle`](Self::settle)d, which every later use of it
    /// does first.
    pub(crate) fn spawn_update(
        &mut self,
        learning_rate: f64,
        mut grad_parts: Vec<Option<Vec<f32>>>,
        factor: Option<f64>,
        order: Vec<Vec<usize>>,
        forms: Vec<PartForm>,
        updated: Sender<(usize, NewPart)>,
    ) -> Result<(), UlyssesError> {
        self.settle()?;
        let (mut parts, pace, adamw, start) = (std::mem::take(&mut self.parts), self.pace.take(), self.adamw, self.thread_start.clone());
        let threads = adamw.threads();
        let update = move || {
            if let Some(start) = start {
                start();
            }
            for group in order {
                if let Some(pace) = &pace {
                    let _ = pace.recv();
                }
                for index in group {
                    // Each gradient part goes as soon as it is used: the host's peak is the step's end.
                    let Some(grad) = grad_parts[index].take() else { continue };
                    parts[index].update(&adamw, learning_rate, &grad, factor);
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
            (parts, pace)
        };
        match std::thread::Builder::new().name("host-adamw".into()).spawn(update) {
            Ok(thread) => self.updating = Some(thread),
            // The state went with the thread that never started.
            Err(e) => self.lost = Some(format!("its update thread could not start: {e}")),
        }
        if self.lost.is_some() {
            self.settle()?;
        }
        Ok(())
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
            let mine = Tensor::<B::InnerBackend, 1>::from_data(TensorData::new(mine, [len]), device).cast(FloatDType::from(which[bucket[0]].1));
            gathered.extend(all_gather_columns::<B>(mine, bucket.iter().map(|&b| (which[b].0, parts[which[b].0].elements)), &partition, world)?);
        }
        Ok(gathered)
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

/// Elements of a rank's parts of parameters of `elements` elements each over a world of
/// `world` (the partition's padding included).
fn part_elements(elements: &[usize], world: usize) -> usize {
    let partition = Partition::new(world.max(1)).expect("a world has a rank");
    elements.iter().map(|&n| partition.part_len(n)).sum()
}

/// The norm of the whole gradient whose parts (this rank's of each parameter, summed over
/// `world`) are `grad_parts`: their squares summed in f64 on each rank (on its threads, by
/// parameter in order: `HostAdamW::sum_of_squares`) and over the ranks in rank order (the same
/// on every rank; collective), and the factor that clips it to
/// `max_grad_norm` (`clip_with_norm`'s), where it must be clipped.
fn clipping<G: burn::tensor::backend::Backend>(adamw: &HostAdamW, grad_parts: &[Option<Vec<f32>>], max_grad_norm: Option<f64>, world: &dyn Communicator<G>) -> Result<(f64, Option<f64>), UlyssesError> {
    let squares: f64 = grad_parts.iter().flatten().map(|part| adamw.sum_of_squares(part)).sum();
    let every_rank = burn_ulysses::comm::all_gather_host_checked(world, &[squares.to_bits()], "squared gradient sums")?;
    let grad_norm = every_rank.iter().map(|bits| f64::from_bits(bits[0])).sum::<f64>().sqrt();
    Ok((grad_norm, max_grad_norm.map(|max_norm| max_norm / (grad_norm + 1e-6)).filter(|&factor| factor < 1.0)))
}

/// One reduce-scatter's result: this rank's parts (f32, on the device) of its members,
/// `(index, part length)` each, one after another.
pub(crate) struct ScatteredBucket<B: TrainBackend> {
    pub(crate) members: Vec<(usize, usize)>,
    pub(crate) parts: Tensor<B::InnerBackend, 1>,
}

/// This rank's part of the sum over `world` of each gradient of `local` (taken from it; cast
/// to f32; none where no rank has one), by the partition: in buckets of consecutive
/// parameters, each laid out rank-major (row r holds every member's part r), so one
/// reduce-scatter a bucket hands each rank its parts, the bits an all-reduce gives there.
/// Collective over `world`: one host collective for which gradients exist anywhere, then the
/// buckets.
pub(crate) fn reduce_scatter_buckets<B: TrainBackend>(local: &mut [LocalGradient<B>], partition: &Partition, world: &dyn Communicator<B::Wire>) -> Result<Vec<ScatteredBucket<B>>, UlyssesError> {
    let present: Vec<u64> = local.iter().map(|l| l.grad.is_some() as u64).collect();
    let gathered = burn_ulysses::comm::all_gather_host_checked(world, &present, "float parameters")?;
    let updated_anywhere = present_anywhere(&gathered, present.len());
    let padded_bytes: Vec<_> = local.iter().map(|l| (4 * partition.padded_len(l.len()), l.dtype())).collect();
    plan_buckets(&padded_bytes, &updated_anywhere, GRADIENT_BUCKET_BYTES)
        .into_iter()
        .map(|bucket| {
            let rows: Vec<Tensor<B::InnerBackend, 2>> =
                bucket.iter().map(|&i| padded(partition, local[i].take_or_zeros().cast(FloatDType::F32)).reshape([partition.world() as i32, -1])).collect();
            let flat = Tensor::cat(rows, 1).reshape([-1]);
            // A world of one: its part is the whole sum (no collective, which waits for the device).
            let parts = match world.size() {
                1 => flat,
                _ => float_tensor::<B::InnerBackend, 1>(world.reduce_scatter(float_primitive(flat), ReduceOp::Sum)?),
            };
            Ok(ScatteredBucket { members: bucket.iter().map(|&i| (i, partition.part_len(local[i].len()))).collect(), parts })
        })
        .collect()
}

/// A bucket of gradient parts being copied to the host: its members (index, part length), one
/// after another, and the copy.
pub(crate) struct PartsInFlight {
    members: Vec<(usize, usize)>,
    read: PendingRead,
}

impl<B: TrainBackend> ScatteredBucket<B> {
    /// Its parts' copy to the host, queued behind the work that made them (no wait).
    pub(crate) fn queue_to_host(self) -> PartsInFlight {
        PartsInFlight { members: self.members, read: device_io::queue_read::<B::Wire>(float_primitive(self.parts)) }
    }
}

/// The parts of `buckets`, `(index, values)` in order, waited for once.
pub(crate) fn arrive_parts(buckets: Vec<PartsInFlight>) -> Result<Vec<(usize, Vec<f32>)>, UlyssesError> {
    let (members, reads): (Vec<_>, Vec<_>) = buckets.into_iter().map(|bucket| (bucket.members, bucket.read)).unzip();
    let data = device_io::arrive(reads).map_err(|error| UlyssesError::InModel { message: format!("gradient parts could not be read to the host: {error:?}") })?;
    let mut parts = Vec::new();
    for (members, data) in members.into_iter().zip(data) {
        let mut values = data.to_vec::<f32>().expect("f32 gradient parts").into_iter();
        parts.extend(members.into_iter().map(|(index, len)| (index, values.by_ref().take(len).collect())));
    }
    Ok(parts)
}

/// [`reduce_scatter_buckets`]' parts on the host, by index (`count` of them): every bucket's
/// copy queued, then one wait for all.
pub(crate) fn host_parts<B: TrainBackend>(buckets: Vec<ScatteredBucket<B>>, count: usize) -> Result<Vec<Option<Vec<f32>>>, UlyssesError> {
    let mut parts = vec![None; count];
    for (index, values) in arrive_parts(buckets.into_iter().map(ScatteredBucket::queue_to_host).collect())? {
        parts[index] = Some(values);
    }
    Ok(parts)
}

/// [`reduce_scatter_buckets`]' parts left on the device, by index (`count` of them).
pub(crate) fn device_parts<B: TrainBackend>(buckets: Vec<ScatteredBucket<B>>, count: usize) -> Vec<Option<Tensor<B::InnerBackend, 1>>> {
    let mut parts = vec![None; count];
    for bucket in buckets {
        let mut offset = 0;
        for (index, len) in bucket.members {
            parts[index] = Some(bucket.parts.clone().narrow(0, offset, len));
            offset += len;
        }
    }
    parts
}

/// `mine` (this rank's parts of `members`, `(index, elements)` each, one after another)
/// all-gathered over `world`: each member whole and flat, by index. Collective.
pub(crate) fn all_gather_columns<B: TrainBackend>(
    mine: Tensor<B::InnerBackend, 1>,
    members: impl Iterator<Item = (usize, usize)>,
    partition: &Partition,
    world: &dyn Communicator<B::Wire>,
) -> Result<Vec<(usize, Tensor<B::InnerBackend, 1>)>, UlyssesError> {
    // Row r: rank r's parts of every member, in order. A world of one: its parts are the whole
    // (no collective, which waits for the device).
    let rows = match world.size() {
        1 => mine.reshape([1, -1]),
        _ => float_tensor::<B::InnerBackend, 2>(world.all_gather(float_primitive(mine))?),
    };
    let mut column = 0;
    Ok(members
        .map(|(index, elements)| {
            let part_len = partition.part_len(elements);
            let whole = rows.clone().narrow(1, column, part_len).reshape([-1]).narrow(0, 0, elements);
            column += part_len;
            (index, whole)
        })
        .collect())
}

/// Refuses parts of another place (`held`: rank and world) or another model (`held_elements`
/// per parameter) than rank `rank` of `world` stepping a model of `elements`.
pub(crate) fn check_parts_fit(held: Option<(usize, usize)>, held_elements: &[usize], rank: usize, world: usize, elements: &[usize]) -> Result<(), UlyssesError> {
    if let Some((held_rank, held_world)) = held.filter(|&place| place != (rank, world)) {
        return Err(UlyssesError::InvalidConfig(format!(
            "the sharded optimizer holds rank {held_rank}'s parts of a world of {held_world}, but steps as rank {rank} of {world}: load the saved state for this place with ShardedAdamW::load(dir, {rank}, {world})"
        )));
    }
    if elements != held_elements {
        return Err(UlyssesError::InvalidConfig(format!(
            "the sharded optimizer holds parts of {} parameters ({} elements) but the model has {} ({} elements): one sharded optimizer per model",
            held_elements.len(),
            held_elements.iter().sum::<usize>(),
            elements.len(),
            elements.iter().sum::<usize>()
        )));
    }
    Ok(())
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
    let number = |name: &str| fields[name].as_f64().map(|v| v as f32).ok_or_else(|| UlyssesError::InvalidConfig(format!("the AdamW config has no number {name}")));
    Ok(HostAdamWConfig { beta_1: number("beta_1")?, beta_2: number("beta_2")?, epsilon: number("epsilon")?, weight_decay: number("weight_decay")? })
}

/// The file in a checkpoint folder that holds world rank `rank`'s part of a [`ShardedAdamW`]'s
/// state, of a world of `world` ranks.
pub fn sharded_state_file(rank: usize, world: usize) -> String {
    format!("optimizer-{rank:05}-of-{world:05}.ulysses")
}

const SHARD_MAGIC: &[u8; 8] = b"ULYSHRD1";
const SHARD_FORMAT: u32 = 1;

/// What a rank's state file says about itself and each parameter's section of its payload.
#[derive(Serialize, Deserialize)]
struct ShardHeader {
    format: u32,
    rank: usize,
    world: usize,
    config: HostAdamWConfig,
    parameters: Vec<SectionHeader>,
}

/// One parameter's section: its part of the master weights, then of each moment (f32,
/// little-endian, the partition's part length each), and their FNV-1a.
#[derive(Serialize, Deserialize, Clone, Copy)]
struct SectionHeader {
    elements: usize,
    time: u32,
    checksum: u64,
}

impl ShardedAdamW {
    /// Writes this rank's part of the state (rank `rank` of `world`, the world it steps over)
    /// to `dir`/[`sharded_state_file`] (the folder made if need be), atomically: every rank writes its own file, and
    /// together they are the state. Nothing to write before the first step.
    pub fn save(&mut self, dir: &Path, rank: usize, world: usize) -> Result<PathBuf, UlyssesError> {
        self.settle()?;
        let path = dir.join(sharded_state_file(rank, world));
        fs::create_dir_all(dir).map_err(|e| shard_error(dir, format!("cannot create the folder: {e}")))?;
        // Each section is hashed, then written, a piece at a time: the state is never copied
        // whole (at 8B it is 96 GB of a 137 GB host).
        let mut bytes = Vec::with_capacity(SECTION_PIECE_BYTES);
        let checksum = |part: &ParameterPart, bytes: &mut Vec<u8>| {
            let mut hash = FNV1A_START;
            part.section_pieces(bytes, |piece| hash = fnv1a_more(hash, piece));
            hash
        };
        let header = ShardHeader {
            format: SHARD_FORMAT,
            rank,
            world,
            config: *self.adamw.config(),
            parameters: self.parts.iter().map(|part| SectionHeader { elements: part.elements, time: part.moments.time, checksum: checksum(part, &mut bytes) }).collect(),
        };
        let header = serde_json::to_vec(&header).map_err(|e| shard_error(&path, format!("cannot encode the header: {e}")))?;
        let length = (header.len() as u64).to_le_bytes();
        write_atomically_with(&path, |file| {
            for piece in [SHARD_MAGIC.as_slice(), &length, &header] {
                file.write_all(piece)?;
            }
            for part in &self.parts {
                let mut written = Ok(());
                part.section_pieces(&mut bytes, |piece| {
                    if written.is_ok() {
                        written = file.write_all(piece);
                    }
                });
                written?;
            }
            Ok(())
        })
        .map_err(|e| shard_error(&path, format!("cannot write: {e}")))?;
        Ok(path)
    }

    /// The state a world of any size saved in `dir` ([`save`](Self::save) on each of its
    /// ranks), re-partitioned for rank `rank` of a world of `world`: each rank reads, of every
    /// parameter, the sections of the saved ranks whose parts overlap its own. Refused, naming
    /// the file, when a saved rank's file is missing, torn or of another run.
    pub fn load(dir: &Path, rank: usize, world: usize) -> Result<Self, UlyssesError> {
        Self::load_with_digest(dir, rank, world).map(|(state, _)| state)
    }

    /// [`load`](Self::load), and a digest of every saved rank's file (their sections'
    /// checksums): ranks that read the same state get the same digest.
    pub(crate) fn load_with_digest(dir: &Path, rank: usize, world: usize) -> Result<(Self, u64), UlyssesError> {
        let saved_world = saved_world(dir)?;
        let (old, new) = (Partition::new(saved_world).expect("a saved world has a rank"), Partition::new(world).expect("a world has a rank"));
        let mut files: Vec<ShardFile> = (0..saved_world).map(|r| ShardFile::open(&dir.join(sharded_state_file(r, saved_world)), r, saved_world)).collect::<Result<_, _>>()?;
        let layout: Vec<(usize, u32)> = files[0].header.parameters.iter().map(|p| (p.elements, p.time)).collect();
        if let Some(file) = files.iter().find(|f| f.header.parameters.iter().map(|p| (p.elements, p.time)).ne(layout.iter().copied())) {
            return Err(shard_error(&file.path, "its parameters or step counts differ from rank 0's file: the files are of different runs or steps"));
        }
        let config = files[0].header.config;
        let checksums: Vec<u8> = files.iter().flat_map(|f| f.header.parameters.iter().flat_map(|p| p.checksum.to_le_bytes())).collect();
        let digest = fnv1a(&[&saved_world.to_le_bytes(), &checksums]);
        let mut parts = Vec::with_capacity(layout.len());
        for (index, &(elements, time)) in layout.iter().enumerate() {
            // This rank's new part, assembled from the old parts that overlap it.
            let mine = new.owned(elements, rank);
            let mut values = [vec![0.0f32; new.part_len(elements)], vec![0.0; new.part_len(elements)], vec![0.0; new.part_len(elements)]];
            for (r, file) in files.iter_mut().enumerate() {
                let theirs = old.owned(elements, r);
                let (from, to) = (mine.start.max(theirs.start), mine.end.min(theirs.end));
                if from >= to {
                    continue;
                }
                let section = file.section(index, old.part_len(elements))?;
                for (which, target) in values.iter_mut().enumerate() {
                    let source = &section[which * old.part_len(elements)..];
                    target[from - mine.start..to - mine.start].copy_from_slice(&source[from - theirs.start..to - theirs.start]);
                }
            }
            let [master, moment_1, moment_2] = values;
            let moments = if time == 0 { AdamWMoments::default() } else { AdamWMoments { moment_1, moment_2, time } };
            parts.push(ParameterPart { elements, master: Arc::new(master), moments });
        }
        Ok((Self { parts, place: Some((rank, world)), ..Self::new(config) }, digest))
    }
}

impl ParameterPart {
    /// One AdamW update by `grad` (this rank's part of the summed gradient), scaled first by
    /// the clipping `factor` where there is one.
    fn update(&mut self, adamw: &HostAdamW, learning_rate: f64, grad: &[f32], factor: Option<f64>) {
        // ZeRO-3's parts on the host let go of the master weights they share before an update.
        debug_assert_eq!(Arc::strong_count(&self.master), 1, "master weights updated while shared: make_mut copies them");
        adamw.step_scaled(learning_rate, Arc::<Vec<f32>>::make_mut(&mut self.master), grad, factor.map_or(1.0, |factor| factor as f32), &mut self.moments);
    }

    /// Its section of a state file, master weights then both moments (zeros before the first
    /// update) as f32 little-endian bytes, handed to `take` in pieces of at most
    /// [`SECTION_PIECE_BYTES`] made in `bytes`.
    fn section_pieces(&self, bytes: &mut Vec<u8>, mut take: impl FnMut(&[u8])) {
        let zeros = [0.0f32; SECTION_PIECE_BYTES / 4];
        for values in [self.master.as_slice(), &self.moments.moment_1, &self.moments.moment_2] {
            let mut left = self.master.len();
            for chunk in values.chunks(SECTION_PIECE_BYTES / 4) {
                bytes.clear();
                bytes.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
                take(bytes);
                left -= chunk.len();
            }
            // A moment before the first update: zeros of the master's length.
            while left > 0 {
                let count = left.min(zeros.len());
                bytes.clear();
                bytes.extend(zeros[..count].iter().flat_map(|v| v.to_le_bytes()));
                take(bytes);
                left -= count;
            }
        }
    }
}

/// The largest piece of a section a save holds at once.
const SECTION_PIECE_BYTES: usize = 1 << 20;

/// One saved rank's state file, its header checked and its sections read on demand.
struct ShardFile {
    path: PathBuf,
    file: fs::File,
    header: ShardHeader,
    /// Where the payload starts.
    payload: u64,
}

impl ShardFile {
    fn open(path: &Path, rank: usize, world: usize) -> Result<Self, UlyssesError> {
        let mut file = fs::File::open(path).map_err(|e| shard_error(path, format!("cannot open ({e}): every rank of the saved world of {world} writes one, and all are needed")))?;
        let mut start = [0u8; 16];
        file.read_exact(&mut start).map_err(|_| shard_error(path, "too short to be a sharded optimizer state"))?;
        if &start[..8] != SHARD_MAGIC {
            return Err(shard_error(path, "not a burn-ulysses sharded optimizer state (wrong magic bytes)"));
        }
        let header_len = u64::from_le_bytes(start[8..].try_into().unwrap());
        let mut header = vec![0u8; usize::try_from(header_len).unwrap_or(usize::MAX).min(1 << 30)];
        file.read_exact(&mut header).map_err(|_| shard_error(path, "the header is cut off; the file is truncated"))?;
        let header: ShardHeader = serde_json::from_slice(&header).map_err(|e| shard_error(path, format!("unreadable header: {e}")))?;
        if header.format != SHARD_FORMAT || header.rank != rank || header.world != world {
            return Err(shard_error(path, format!("holds rank {} of {} in format {}, not rank {rank} of {world} in format {SHARD_FORMAT}", header.rank, header.world, header.format)));
        }
        let payload = 16 + header_len;
        let expected: u64 = header.parameters.iter().map(|p| 12 * Partition::new(world).unwrap().part_len(p.elements) as u64).sum();
        let length = file.metadata().map_err(|e| shard_error(path, e))?.len();
        if length != payload + expected {
            return Err(shard_error(path, format!("has {length} bytes but its header describes {}; the file is truncated or corrupt", payload + expected)));
        }
        Ok(Self { path: path.to_path_buf(), file, header, payload })
    }

    /// Parameter `index`'s section (`part_len` values of each of master, moment 1, moment 2),
    /// checked against its checksum.
    fn section(&mut self, index: usize, part_len: usize) -> Result<Vec<f32>, UlyssesError> {
        let world = Partition::new(self.header.world).unwrap();
        let offset: u64 = self.header.parameters[..index].iter().map(|p| 12 * world.part_len(p.elements) as u64).sum();
        let mut bytes = vec![0u8; 12 * part_len];
        self.file.seek(SeekFrom::Start(self.payload + offset)).and_then(|_| self.file.read_exact(&mut bytes)).map_err(|e| shard_error(&self.path, format!("cannot read: {e}")))?;
        if fnv1a(&[&bytes]) != self.header.parameters[index].checksum {
            return Err(shard_error(&self.path, format!("parameter {index}'s section does not match its checksum; the file is corrupt. Use an earlier checkpoint.")));
        }
        Ok(bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect())
    }
}

/// The world size the state in `dir` was saved by, from its rank 0 file.
fn saved_world(dir: &Path) -> Result<usize, UlyssesError> {
    let entries = fs::read_dir(dir).map_err(|e| shard_error(dir, format!("cannot list the folder: {e}")))?;
    let worlds: Vec<usize> = entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.strip_prefix("optimizer-00000-of-")?.strip_suffix(".ulysses")?.parse().ok())
        .collect();
    match worlds.as_slice() {
        [world] if *world > 0 => Ok(*world),
        [] => Err(shard_error(dir, "holds no sharded optimizer state (no optimizer-00000-of-*.ulysses)")),
        _ => Err(shard_error(dir, format!("holds the states of several world sizes ({worlds:?}); keep one run's files per folder"))),
    }
}

/// The folder, inside a checkpoint folder, that holds every rank's part of the sharded
/// optimizer state of the checkpoint taken after `step` steps.
pub fn sharded_state_folder(step: u64) -> String {
    format!("optimizer-step-{step:09}")
}

const STATE_FOLDER_PREFIX: &str = "optimizer-step-";

/// A training checkpoint whose optimizer state is sharded over `world` (a [`ShardedAdamW`]):
/// collective, every rank of `world` calls it with the same `step` and the same folder (shared
/// by every node). The commit:
/// 1. every rank writes its part, atomically, into `dir/`[`sharded_state_folder`]`(step)`, a
///    folder no earlier checkpoint uses;
/// 2. the ranks agree that every part is written (one host collective);
/// 3. rank 0 writes `dir/checkpoint.ulysses` (`state`, naming that folder), atomically: the
///    checkpoint switches to the new state here, all of it at once;
/// 4. rank 0 removes the state folders no checkpoint names (the previous one, and any left by
///    a crash between 1 and 3), and every rank learns whether 3 succeeded.
///
/// A crash anywhere leaves `checkpoint.ulysses` naming a complete set of parts: the previous
/// checkpoint's or this one's. The parts' master weights are the model: no rank gathers it to
/// save it ([`load_sharded_training_checkpoint`] sets a model from them). Returns the
/// checkpoint file's path on rank 0.
pub fn save_sharded_training_checkpoint<B, S>(dir: &Path, optimizer: &mut ShardedAdamW, state: &S, step: u64, world: &dyn Communicator<B::Wire>) -> Result<Option<PathBuf>, UlyssesError>
where
    B: TrainBackend,
    S: Serialize,
{
    let (rank, size) = (world.rank(), world.size());
    let folder_name = sharded_state_folder(step);
    let folder = dir.join(&folder_name);
    let written = optimizer.save(&folder, rank, size);
    let every_rank = burn_ulysses::comm::all_gather_host_checked(world, &[written.is_ok() as u64], "optimizer state parts written")?;
    written?;
    let failed: Vec<usize> = every_rank.iter().enumerate().filter(|(_, ok)| ok[0] == 0).map(|(r, _)| r).collect();
    if !failed.is_empty() {
        return Err(shard_error(&folder, format!("rank(s) {failed:?} could not write their part of the optimizer state; the previous checkpoint stays the one to resume from")));
    }
    let committed = if rank == 0 {
        let path = crate::checkpoint::write_checkpoint(dir, &[], &[], Some(&folder_name), state);
        if path.is_ok() {
            remove_unnamed_state_folders(dir, &folder_name);
        }
        Some(path)
    } else {
        None
    };
    let ok = committed.as_ref().is_none_or(Result::is_ok);
    let every_rank = burn_ulysses::comm::all_gather_host_checked(world, &[ok as u64], "checkpoint written")?;
    if let Some(path) = committed {
        return path.map(Some);
    }
    if every_rank[0][0] == 0 {
        return Err(shard_error(dir, "rank 0 could not write the checkpoint file (its error says why); the previous checkpoint stays the one to resume from"));
    }
    Ok(None)
}

/// Removes every sharded-state folder in `dir` but `keep` (what a crash or the previous
/// checkpoint left); a folder that cannot be removed is a warning.
fn remove_unnamed_state_folders(dir: &Path, keep: &str) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(STATE_FOLDER_PREFIX) && name != keep {
            if let Err(error) = fs::remove_dir_all(entry.path()) {
                tracing::warn!(folder = %entry.path().display(), %error, "cannot remove an optimizer state folder no checkpoint names");
            }
        }
    }
}

/// Loads a checkpoint written by [`save_sharded_training_checkpoint`]: the optimizer state
/// re-partitioned for this rank of `world` (any size: [`ShardedAdamW::load`]), `model` (a fresh
/// one of the same shapes, on its device) with every float parameter set from the master
/// weights (all-gathered, in the parameter's dtype), and the saved state. Collective over
/// `world`: the ranks first agree that each loaded the checkpoint and that all read the same
/// state (a digest of every part's checksums); refused then, on every rank, when one could
/// not or they read different states, and before the gather when the parts are of another
/// model.
pub fn load_sharded_training_checkpoint<B, M, S>(location: &Path, model: M, world: &dyn Communicator<B::Wire>) -> Result<(M, ShardedAdamW, S), UlyssesError>
where
    B: TrainBackend,
    M: AutodiffModule<B>,
    S: serde::de::DeserializeOwned,
{
    let path = crate::checkpoint::checkpoint_path(location);
    let loaded = || -> Result<(S, ShardedAdamW, u64), UlyssesError> {
        let contents = crate::checkpoint::read_checkpoint::<S>(location)?;
        let Some(folder) = contents.optimizer_shards else {
            return Err(crate::checkpoint::error(
                &path,
                "it holds a replicated optimizer's state, not a sharded one (a run without the optimizer on the host): load it with \
                 load_training_checkpoint (the trainer: without --offload-optimizer)",
            ));
        };
        let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let (optimizer, digest) = ShardedAdamW::load_with_digest(&dir.join(folder), world.rank(), world.size())?;
        Ok((contents.state, optimizer, digest))
    };
    let loaded = loaded();
    // Every rank must gather the same parameters from the same parts.
    let mine = match &loaded {
        Ok((_, _, digest)) => [1, *digest],
        Err(_) => [0, 0],
    };
    let every_rank = burn_ulysses::comm::all_gather_host_checked(world, &mine, "sharded checkpoint loaded")?;
    let (state, optimizer, digest) = loaded?;
    if let Some(rank) = every_rank.iter().position(|r| r[0] == 0) {
        return Err(shard_error(&path, format!("rank {rank} could not load the checkpoint (its error says why)")));
    }
    if let Some(rank) = every_rank.iter().position(|r| r[1] != digest) {
        return Err(shard_error(
            &path,
            format!("rank {rank} read other optimizer state than rank {} (the digests of their parts differ): every rank must read the same files (a shared file system)", world.rank()),
        ));
    }
    let model = optimizer.model_from_masters::<B, M>(model, world).map_err(|e| shard_error(&path, e))?;
    Ok((model, optimizer, state))
}

fn shard_error(path: &Path, reason: impl std::fmt::Display) -> UlyssesError {
    UlyssesError::Checkpoint { path: path.display().to_string(), reason: reason.to_string() }
}

/// `flat` padded with zeros (of its dtype) to the partition's length.
pub(crate) fn padded<B: burn::tensor::backend::Backend>(partition: &Partition, flat: Tensor<B, 1>) -> Tensor<B, 1> {
    let (len, target) = (flat.dims()[0], partition.padded_len(flat.dims()[0]));
    if target == len {
        return flat;
    }
    let zeros = Tensor::zeros([target - len], (&flat.device(), flat.dtype()));
    Tensor::cat(vec![flat, zeros], 0)
}

/// Rank `rank`'s part of `flat` (a parameter, padded to the partition) on its device, in a
/// buffer of its own: a view would keep the whole parameter's buffer alive.
pub(crate) fn own_part<B: burn::tensor::backend::Backend>(partition: &Partition, rank: usize, flat: Tensor<B, 1>) -> Tensor<B, 1> {
    let elements = flat.dims()[0];
    let view = padded(partition, flat).narrow(0, partition.part(elements, rank).start, partition.part_len(elements));
    let (dtype, device) = (view.dtype(), view.device());
    Tensor::from_data(view.into_data(), (&device, dtype))
}

/// Rank `rank`'s part of `parameter` (flat), padded, on the host.
fn host_part<B: burn::tensor::backend::Backend>(partition: &Partition, rank: usize, parameter: &Tensor<B, 1>) -> Vec<f32> {
    let elements = parameter.dims()[0];
    let owned = partition.owned(elements, rank);
    let mut part = vec![0.0; partition.part_len(elements)];
    if !owned.is_empty() {
        let values = parameter.clone().narrow(0, owned.start, owned.len()).into_data().convert::<f32>().to_vec::<f32>().expect("f32 values");
        part[..values.len()].copy_from_slice(&values);
    }
    part
}

/// Puts the gathered values (flat, in visit order; `None`: unchanged) into the parameters,
/// keeping their ids and whether they require gradients.
struct SetParameters<B: TrainBackend> {
    values: std::vec::IntoIter<Option<Tensor<B::InnerBackend, 1>>>,
}

impl<B: TrainBackend> ModuleMapper<B> for SetParameters<B> {
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
mod tests {
    use super::*;

    /// Per parameter: elements, step count, and the whole master weights and moments.
    type Whole = Vec<(usize, u32, [Vec<f32>; 3])>;

    fn whole() -> Whole {
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
    fn of_rank(whole: &Whole, rank: usize, world: usize) -> ShardedAdamW {
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
            optimizer.spawn_update(1e-2, grads, factor, vec![(0..4).collect()], vec![PartForm::Compute(DType::F32); 4], sent).unwrap();
            let first = optimizer.settle().unwrap_err().to_string();
            let dir = std::env::temp_dir().join(format!("ulysses-lost-state-{}", std::process::id()));
            let later = [optimizer.settle().map(drop), optimizer.save(&dir, 0, 1).map(drop), optimizer.host_bytes().map(drop)].map(|r| r.unwrap_err().to_string());
            let saved = dir.join(sharded_state_file(0, 1)).exists();
            let model = burn::nn::LinearConfig::new(2, 2).init::<burn::backend::NdArray>(&Default::default());
            optimizer.keep_master_weights(&model, 0, 1);
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

    /// The full Llama-3.1-8B shape (8.03e9 parameters) with the optimizer on the host of a GPU
    /// machine (137 GB, 128 GiB): alone it needs 128.5 GB at a step's end (state and the
    /// step's f32 gradient), which fits; with copies of its bf16 parameters on the host too
    /// (where they are not the master weights), 144.5 GB, refused before step 1 naming both
    /// figures and the flag to drop; over a world of 2 half;
    /// with its layer inputs of 64K tokens offloaded beside the state, 147.3 GB, refused.
    #[test]
    fn the_host_check_counts_the_gradient_and_the_parameters_kept_there() {
        let (eight_b, machine) = ([8_030_261_248usize], Some(137_438_953_472u64));
        assert!(ShardedAdamW::check_host_memory_of(machine, &eight_b, 1, 1, 0, &[]).is_ok(), "state and gradient: 128.5 GB");
        let refused = ShardedAdamW::check_host_memory_of(machine, &eight_b, 1, 1, 2, &[]).unwrap_err().to_string();
        assert!(refused.contains("needs 144.54 GB") && refused.contains("137.44 GB available") && refused.contains("--offload-parameters"), "{refused}");
        assert!(ShardedAdamW::check_host_memory_of(machine, &eight_b, 2, 1, 2, &[]).is_ok(), "a world of 2 holds half each");
        let two_ranks = ShardedAdamW::check_host_memory_of(machine, &eight_b, 2, 2, 2, &[]).unwrap_err().to_string();
        assert!(two_ranks.contains("needs 144.54 GB") && two_ranks.contains("2 rank(s) on this host"), "{two_ranks}");
        // Its 32 layers' inputs and 3 gradients of 65 536 tokens (bf16, 4096 wide) on the host too: 18.79 GB more.
        let inputs = crate::LayerCheckpointing::new().with_offload_to_host(true).offloaded_host_bytes(32, 1, 65_536, 4096, 2);
        assert_eq!(inputs, 35 * 65_536 * 4096 * 2);
        let offloaded = ShardedAdamW::check_host_memory_of(machine, &eight_b, 1, 1, 0, &[(inputs, "of layer inputs (--offload-to-host)")]).unwrap_err().to_string();
        assert!(offloaded.contains("needs 147.27 GB") && offloaded.contains("beside 18.79 GB of layer inputs (--offload-to-host)"), "{offloaded}");
        assert_eq!(crate::LayerCheckpointing::new().offloaded_host_bytes(32, 1, 65_536, 4096, 2), 0, "nothing offloaded without offload_to_host");
    }

    /// A section handed out in pieces (a save holds one piece at a time) is, end to end, the
    /// master weights and both moments as f32 little-endian bytes, zeros for the moments
    /// before the first update; across pieces of 1 MiB and a tail.
    #[test]
    fn a_section_in_pieces_is_the_whole_section() {
        let len = 600_001;
        let values = |seed: f32| (0..len).map(|i| seed + i as f32 * 0.25).collect::<Vec<f32>>();
        let whole = |arrays: [&[f32]; 3]| arrays.concat().iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
        let stepped = ParameterPart { elements: len, master: Arc::new(values(1.0)), moments: AdamWMoments { moment_1: values(2.0), moment_2: values(3.0), time: 4 } };
        let fresh = ParameterPart { elements: len, master: Arc::new(values(1.0)), moments: AdamWMoments::default() };
        let zeros = vec![0.0f32; len];
        for (part, want) in [(&stepped, whole([&values(1.0), &values(2.0), &values(3.0)])), (&fresh, whole([&values(1.0), &zeros, &zeros]))] {
            let (mut got, mut pieces, mut bytes) = (Vec::new(), 0, Vec::new());
            part.section_pieces(&mut bytes, |piece| {
                assert!(piece.len() <= SECTION_PIECE_BYTES);
                got.extend_from_slice(piece);
                pieces += 1;
            });
            assert_eq!(pieces, 9, "three arrays of 2.4 MB in pieces of 1 MiB");
            assert!(got == want, "the pieces differ from the section");
        }
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

    fn same(a: &ShardedAdamW, b: &ShardedAdamW) -> bool {
        a.adamw.config() == b.adamw.config()
            && a.place == b.place
            && a.parts.len() == b.parts.len()
            && a.parts.iter().zip(&b.parts).all(|(a, b)| a.elements == b.elements && a.master == b.master && a.moments == b.moments)
    }

    /// Saved by 4 ranks, the state loads at 4 (each rank its own part back), at 3, 2 and 1
    /// (each rank the parts the partition gives it at that size, from the saved ones that
    /// overlap it), parameters that never stepped included.
    #[test]
    fn the_state_saved_by_each_rank_loads_at_any_world_size() {
        let dir = std::env::temp_dir().join(format!("ulysses-sharded-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let whole = whole();
        for rank in 0..4 {
            of_rank(&whole, rank, 4).save(&dir, rank, 4).unwrap();
        }
        for world in [4, 3, 2, 1] {
            for rank in 0..world {
                let loaded = ShardedAdamW::load(&dir, rank, world).unwrap();
                assert!(same(&loaded, &of_rank(&whole, rank, world)), "rank {rank} of {world}");
            }
        }
        fs::remove_dir_all(&dir).unwrap();
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

    /// The sharded checkpoint's commit: two ranks step twice and checkpoint after each step;
    /// the folder then holds the last checkpoint's parts alone (the first's, and a crash's
    /// leftover, removed), and loads at world 1 with the master weights equal to the model's
    /// parameters, a fresh model set from them (the file holds no model), and both steps in
    /// the moments. Parts written for a later step that no
    /// checkpoint file names (a crash before the commit) change nothing; a replicated load
    /// is refused, naming the flag.
    #[test]
    fn a_sharded_checkpoint_commits_every_part_at_once_and_loads_at_another_world() {
        use burn::{
            backend::{Autodiff, NdArray},
            nn::{Initializer, Linear, LinearConfig},
            optim::AdamWConfig,
        };
        type Ad = Autodiff<NdArray<f32>>;
        let dir = std::env::temp_dir().join(format!("ulysses-sharded-commit-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join(sharded_state_folder(7))).unwrap();
        let layer = || LinearConfig::new(3, 2).with_initializer(Initializer::Constant { value: 0.5 }).init::<Ad>(&Default::default());
        let shared = dir.clone();
        let outcome = burn_ulysses::comm::ThreadGroup::new(2).run(move |rank| {
            let comm = rank.communicator();
            let (mut linear, mut optimizer) = (layer(), ShardedAdamW::new(HostAdamWConfig::default()));
            for step in 1..=2u64 {
                let input = Tensor::<Ad, 2>::ones([1, 3], &Default::default()) * (comm.rank() + step as usize) as f32;
                let grads = GradientsParams::from_grads(linear.forward(input).sum().backward(), &linear);
                linear = optimizer.step::<Ad, _>(1e-2, linear, grads, None, &*comm).unwrap().0;
                save_sharded_training_checkpoint::<Ad, _>(&shared, &mut optimizer, &step, step, &*comm).unwrap();
            }
            let weights: Vec<f32> = [linear.weight.val().into_data().to_vec().unwrap(), linear.bias.as_ref().unwrap().val().into_data().to_vec().unwrap()].concat();
            // A crash after every part of step 3 was written, before the checkpoint file was.
            optimizer.save(&shared.join(sharded_state_folder(3)), comm.rank(), 2).map(|_| weights)
        });
        let weights: Vec<Vec<f32>> = outcome.into_iter().map(|r| r.unwrap().unwrap()).collect();
        assert_eq!(weights[0], weights[1], "the ranks' parameters parted");

        let mut folders: Vec<String> = fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).filter(|n| n.starts_with(STATE_FOLDER_PREFIX)).collect();
        folders.sort();
        assert_eq!(folders, [sharded_state_folder(2), sharded_state_folder(3)], "the first checkpoint's parts and the crash's leftover are removed");
        assert!(crate::checkpoint::read_checkpoint::<u64>(&dir).unwrap().model.is_empty(), "the master weights are the model: the file holds none");
        let shared = dir.clone();
        let loaded = burn_ulysses::comm::ThreadGroup::new(1).run(move |rank| load_sharded_training_checkpoint::<Ad, Linear<Ad>, u64>(&shared, layer(), &*rank.communicator()).unwrap());
        let (loaded, optimizer, step) = loaded.into_iter().next().unwrap().unwrap();
        assert_eq!(step, 2, "the checkpoint file names the last committed step");
        let values = [loaded.weight.val().into_data().to_vec::<f32>().unwrap(), loaded.bias.unwrap().val().into_data().to_vec::<f32>().unwrap()].concat();
        assert_eq!(values, weights[0], "the fresh model (every value 0.5) set from the master weights");
        assert_eq!([optimizer.parts[0].master.to_vec(), optimizer.parts[1].master.to_vec()].concat(), weights[0], "rank 0 of 1 holds the whole master weights, as the parameters");
        assert!(optimizer.parts.iter().all(|part| part.moments.time == 2));

        let replicated = crate::checkpoint::load_training_checkpoint::<Ad, _, _, u64>(&dir, layer(), AdamWConfig::new().init::<Ad, Linear<Ad>>(), &Default::default());
        let message = replicated.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(message.contains("sharded") && message.contains("--offload-optimizer"), "{message}");
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A rank whose optimizer does not fit its model (here rank 1's holds another model's
    /// parts) stops with its own error before the step's collectives, and the other ranks
    /// stop at the first of them, naming it, rather than wait for it.
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
        assert!(messages[0].contains("rank 1 left the group") && messages[0].contains("world rank 1's own error"), "rank 0: {}", messages[0]);
    }

    /// A missing rank's file, a corrupt section, a torn file and two runs' files in one
    /// folder are refused, naming the file and what to do.
    #[test]
    fn incomplete_or_corrupt_state_is_refused_naming_the_file() {
        let dir = std::env::temp_dir().join(format!("ulysses-sharded-bad-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let whole = whole();
        let saved: Vec<PathBuf> = (0..2).map(|rank| of_rank(&whole, rank, 2).save(&dir, rank, 2).unwrap()).collect();
        let error = |world| ShardedAdamW::load(&dir, 0, world).err().map(|e| e.to_string()).unwrap_or_default();

        let bytes = fs::read(&saved[1]).unwrap();
        fs::remove_file(&saved[1]).unwrap();
        let missing = error(2);
        assert!(missing.contains("optimizer-00001-of-00002.ulysses") && missing.contains("all are needed"), "{missing}");

        let mut flipped = bytes.clone();
        *flipped.last_mut().unwrap() ^= 1;
        fs::write(&saved[1], &flipped).unwrap();
        let corrupt = error(1);
        assert!(corrupt.contains("checksum") && corrupt.contains("optimizer-00001-of-00002"), "{corrupt}");

        fs::write(&saved[1], &bytes[..bytes.len() - 4]).unwrap();
        let torn = error(2);
        assert!(torn.contains("truncated"), "{torn}");

        fs::write(&saved[1], &bytes).unwrap();
        of_rank(&whole, 0, 3).save(&dir, 0, 3).unwrap();
        let mixed = error(2);
        assert!(mixed.contains("several world sizes"), "{mixed}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
