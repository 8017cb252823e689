//! AdamW with its state sharded over the world but kept on the device: ZeRO-3 without the
//! optimizer on the host. Each rank holds, on its device, its part
//! (`ulysses_core::zero::Partition`) of every parameter's f32 master weights and both moments,
//! 12 bytes a parameter divided by the world, and updates them with tensor ops in burn's
//! `AdamW` order (the host AdamW's, `ulysses_core::host_adamw`, whose bits equal burn's), so a
//! step costs no copy to or from the host. Its checkpoints are [`ShardedAdamW`]'s files, so
//! either can resume the other.

use std::{
    borrow::Cow,
    path::{Path, PathBuf},
    sync::Arc,
};

use burn::{
    module::Module,
    tensor::{DType, FloatDType, Tensor, TensorData},
};
use burn_ulysses::{UlyssesError, comm::Communicator};
use ulysses_core::host_adamw::{AdamWMoments, HostAdamWConfig};

use super::{
    ShardedAdamW,
    host_adamw::ParameterPart,
    parts::{check_no_empty_parameter, norm_of_parts, own_part, partition_of},
    state_files::{ShardedState, write_state_file},
};
use crate::{TrainBackend, float_parameters};

/// AdamW on the device over this rank's parts (see the module doc).
pub struct DeviceShardedAdamW<B: TrainBackend> {
    config: HostAdamWConfig,
    /// Per float parameter of the model, in its visit order.
    parts: Vec<DevicePart<B>>,
    /// The rank and world the parts are of.
    place: Option<(usize, usize)>,
}

/// This rank's part of one parameter's master weights and moments, padded to the partition.
struct DevicePart<B: TrainBackend> {
    elements: usize,
    master: Tensor<B::InnerBackend, 1>,
    /// Both moments, from the first update on.
    moments: Option<(Tensor<B::InnerBackend, 1>, Tensor<B::InnerBackend, 1>)>,
    time: u32,
}

impl<B: TrainBackend> DevicePart<B> {
    /// A part of a parameter of `elements` elements from its master weights and moments on the
    /// host (moved into the uploads, not copied), the moments kept from the first update on.
    fn upload(elements: usize, [master, moment_1, moment_2]: [Vec<f32>; 3], time: u32, device: &burn::tensor::Device<B::InnerBackend>) -> Self {
        // f32 whatever the device's default float: the state is f32, as the gradients are.
        let upload = |values: Vec<f32>| {
            let len = values.len();
            Tensor::<B::InnerBackend, 1>::from_data(TensorData::new(values, [len]), (device, DType::F32))
        };
        Self { elements, master: upload(master), moments: (time > 0).then(|| (upload(moment_1), upload(moment_2))), time }
    }
}

impl<B: TrainBackend> DeviceShardedAdamW<B> {
    pub fn new(config: HostAdamWConfig) -> Self {
        Self { config, parts: Vec::new(), place: None }
    }

    /// Takes rank `rank`'s part (of a world of `world`) of `model`'s parameters as the f32
    /// master weights, replacing any state; call it before the model is sharded. Refused for a
    /// rank the world has not.
    pub fn keep_master_weights<M: Module<B>>(&mut self, model: &M, rank: usize, world: usize) -> Result<(), UlyssesError> {
        let partition = partition_of(rank, world)?;
        check_no_empty_parameter(&crate::parameter_elements(model), || crate::parameter_paths(model))?;
        self.begin_master_parts(rank, world);
        for p in float_parameters(model) {
            self.keep_master_part(p.values.dims()[0], own_part(&partition, rank, p.values.inner().cast(FloatDType::F32)));
        }
        Ok(())
    }

    /// Drops any state and starts holding rank `rank`'s parts of a world of `world`, none yet:
    /// [`keep_master_part`](Self::keep_master_part) then takes each parameter's, in the
    /// model's order.
    pub(super) fn begin_master_parts(&mut self, rank: usize, world: usize) {
        self.parts = Vec::new();
        self.place = Some((rank, world));
    }

    /// Takes `master` (f32, this rank's part, padded to the partition, of the next parameter,
    /// of `elements` elements whole) as its master weights, moments not yet made.
    pub(super) fn keep_master_part(&mut self, elements: usize, master: Tensor<B::InnerBackend, 1>) {
        self.parts.push(DevicePart { elements, master, moments: None, time: 0 });
    }

    /// Bytes of state this rank holds on its device (master weights, and both moments once
    /// they exist).
    pub fn device_bytes(&self) -> usize {
        self.parts.iter().map(|part| 4 * part.master.dims()[0] * if part.moments.is_some() { 3 } else { 1 }).sum()
    }

    /// The rank and world the parts are of (`None` before it holds any).
    pub(crate) fn rank_and_world(&self) -> Option<(usize, usize)> {
        self.place
    }

    pub(crate) fn elements(&self) -> Vec<usize> {
        self.parts.iter().map(|part| part.elements).collect()
    }

    /// Updates the parts with `grads` (this rank's part of each gradient summed over `world`,
    /// f32 on the device; `None`: the parameter stays), each decayed where `decayed` says (see
    /// `ulysses_core::host_adamw::decays`), clipping to `max_grad_norm` with the
    /// whole gradient's norm (each part's squares summed on the device, read once, added in f64
    /// and over the ranks in rank order: `gradients::sum_of_squares`). Returns that norm, before
    /// clipping.
    pub(crate) fn update(
        &mut self,
        learning_rate: f64,
        grads: Vec<Option<Tensor<B::InnerBackend, 1>>>,
        decayed: &[bool],
        max_grad_norm: Option<f64>,
        world: &dyn Communicator<B::Wire>,
    ) -> Result<f64, UlyssesError> {
        self.config.check(learning_rate)?;
        let present: Vec<Tensor<B::InnerBackend, 1>> = grads.iter().flatten().cloned().collect();
        let local = crate::gradients::sum_of_squares(&present);
        let (grad_norm, factor) = norm_of_parts(local, max_grad_norm, world)?;
        assert_eq!(decayed.len(), grads.len(), "a decay for every parameter");
        for ((part, grad), &decays) in self.parts.iter_mut().zip(grads).zip(decayed) {
            let Some(mut grad) = grad else { continue };
            if let Some(factor) = factor {
                grad = grad.mul_scalar(factor as f32);
            }
            part.step(&self.config.for_parameter(decays), learning_rate, grad);
        }
        Ok(grad_norm)
    }

    /// This rank's part of parameter `index`'s master weights, in `dtype` (the same tensor in
    /// f32: the compute copy's part then costs nothing more).
    pub(crate) fn master_part(&self, index: usize, dtype: DType) -> Tensor<B::InnerBackend, 1> {
        self.parts[index].master.clone().cast(FloatDType::from(dtype))
    }

    /// Part `index`, read back to the host.
    fn host_part(&self, index: usize) -> ParameterPart {
        let read = |tensor: &Tensor<B::InnerBackend, 1>| tensor.clone().into_data().into_vec::<f32>().expect("f32 state");
        let part = &self.parts[index];
        let moments = match &part.moments {
            Some((moment_1, moment_2)) => AdamWMoments { moment_1: read(moment_1), moment_2: read(moment_2), time: part.time },
            None => AdamWMoments::default(),
        };
        ParameterPart { elements: part.elements, master: Arc::new(read(&part.master)), moments }
    }

    /// `host`'s state (loaded, re-partitioned, by [`ShardedAdamW::load`]) on `device`.
    pub fn from_host(host: &ShardedAdamW, device: &burn::tensor::Device<B::InnerBackend>) -> Self {
        let (config, parts, place) = host.parts();
        let parts = parts.map(|(elements, master, moments)| DevicePart::upload(elements, [master.to_vec(), moments.moment_1.clone(), moments.moment_2.clone()], moments.time, device)).collect();
        Self { config, parts, place }
    }

    /// The state a world of any size saved in `dir` ([`ShardedAdamW::load`]'s files),
    /// re-partitioned for rank `rank` of `world`, on `device`, each parameter's part uploaded
    /// as it is read; and the files' digest.
    pub(crate) fn load_with_digest(dir: &Path, rank: usize, world: usize, device: &burn::tensor::Device<B::InnerBackend>) -> Result<(Self, u64), UlyssesError> {
        let (config, parts, digest) = super::state_files::load_parts_with(dir, rank, world, |elements, values, time| DevicePart::upload(elements, values, time, device))?;
        Ok((Self { config, parts, place: Some((rank, world)) }, digest))
    }
}

/// Its files are [`ShardedAdamW`]'s, each part read back to the host twice (hashed, then
/// written), one at a time: the host never holds the rank's whole state (the 12 bytes a
/// parameter of its parts; 96 GB for 8B on one GPU).
impl<B: TrainBackend> ShardedState for DeviceShardedAdamW<B> {
    fn save(&mut self, dir: &Path, rank: usize, world: usize) -> Result<PathBuf, UlyssesError> {
        write_state_file(dir, self.place, rank, world, self.config, self.parts.len(), |index| Cow::Owned(self.host_part(index)))
    }
}

impl<B: TrainBackend> DevicePart<B> {
    /// One AdamW update in burn's order (see `ulysses_core::host_adamw`): m = β₁m + (1−β₁)g;
    /// v = β₂v + (1−β₂)g²; δ = (m / c₁) / (√(v / c₂) + ε); p = p·(1 − lr·λ) − δ·lr, with the
    /// scalars rounded to f32 as burn rounds them.
    fn step(&mut self, config: &HostAdamWConfig, learning_rate: f64, grad: Tensor<B::InnerBackend, 1>) {
        let (moment_1, moment_2) = self.moments.take().unwrap_or_else(|| (grad.zeros_like(), grad.zeros_like()));
        self.time += 1;
        let time = self.time as i32;
        let moment_1 = moment_1.mul_scalar(config.beta_1) + grad.clone().mul_scalar(1.0 - config.beta_1);
        let moment_2 = moment_2.mul_scalar(config.beta_2) + (grad.clone() * grad).mul_scalar(1.0 - config.beta_2);
        let delta = moment_1.clone().div_scalar(1.0 - config.beta_1.powi(time)) / (moment_2.clone().div_scalar(1.0 - config.beta_2.powi(time)).sqrt().add_scalar(config.epsilon));
        let decay = (1.0 - learning_rate * config.weight_decay as f64) as f32;
        self.master = self.master.clone().mul_scalar(decay) - delta.mul_scalar(learning_rate as f32);
        self.moments = Some((moment_1, moment_2));
    }
}

#[cfg(test)]
mod tests {
    use burn::{
        backend::{Autodiff, NdArray},
        tensor::Tensor,
    };
    use ulysses_core::host_adamw::HostAdamWConfig;

    use super::DeviceShardedAdamW;

    /// A gradient of 1e20 squares past f32's range: the norm is still its own, so clipping to
    /// 1 moves every weight by the learning rate (AdamW's first step) rather than zeroing the
    /// gradient and moving nothing.
    #[test]
    fn a_gradient_whose_squares_overflow_f32_is_clipped_not_zeroed() {
        type Ad = Autodiff<NdArray<f32>>;
        let outcome = burn_ulysses::comm::ThreadGroup::new(1).run(|rank| {
            let comm = rank.communicator();
            let device = Default::default();
            let mut optimizer = DeviceShardedAdamW::<Ad>::new(HostAdamWConfig { weight_decay: 0.0, ..HostAdamWConfig::default() });
            optimizer.begin_master_parts(0, 1);
            optimizer.keep_master_part(4, Tensor::zeros([4], &device));
            let grad = Tensor::<NdArray<f32>, 1>::from_floats([3e20, -4e20, 0.0, 1e19], &device);
            let norm = optimizer.update(1e-2, vec![Some(grad)], &[false], Some(1.0), &*comm).unwrap();
            (norm, optimizer.master_part(0, burn::tensor::DType::F32).into_data().to_vec::<f32>().unwrap())
        });
        let (norm, master) = outcome.into_iter().next().unwrap().unwrap();
        let expected = (9e40f64 + 16e40 + 1e38).sqrt();
        assert!((norm - expected).abs() <= 1e-5 * expected, "norm {norm} against {expected}");
        assert_eq!(master.len(), 4, "{master:?}");
        for (got, want) in master.iter().zip([-1e-2f32, 1e-2, 0.0, -1e-2]) {
            assert!((got - want).abs() <= 1e-4, "master weights {master:?}, each moved by the learning rate against its gradient's sign");
        }
    }

    /// Settings that cannot train (a negative weight decay grows the weights every step; one
    /// of 1 / learning rate zeroes them) are refused at the update, naming the setting, and
    /// the master weights stay as they were.
    #[test]
    fn settings_that_cannot_train_are_refused_at_the_update() {
        type Ad = Autodiff<NdArray<f32>>;
        let outcome = burn_ulysses::comm::ThreadGroup::new(1).run(|rank| {
            let comm = rank.communicator();
            let device = Default::default();
            [-0.1f32, 100.0, 0.1].map(|weight_decay| {
                let mut optimizer = DeviceShardedAdamW::<Ad>::new(HostAdamWConfig { weight_decay, ..HostAdamWConfig::default() });
                optimizer.begin_master_parts(0, 1);
                optimizer.keep_master_part(2, Tensor::ones([2], &device));
                let grad = Tensor::<NdArray<f32>, 1>::from_floats([0.5, -0.5], &device);
                let result = optimizer.update(1e-2, vec![Some(grad)], &[true], None, &*comm).map_err(|error| error.to_string());
                (result, optimizer.master_part(0, burn::tensor::DType::F32).into_data().to_vec::<f32>().unwrap())
            })
        });
        let [negative, too_large, fine] = outcome.into_iter().next().unwrap().unwrap();
        for (case, (result, master)) in [("a negative decay", negative), ("a decay of 1 / learning rate", too_large)] {
            let message = result.expect_err(case);
            assert!(message.contains("AdamW's weight_decay must be 0 or more") && message.contains("cannot train"), "{case}: {message}");
            assert_eq!(master, [1.0, 1.0], "{case}: the master weights moved");
        }
        // AdamW's first step: each weight by the learning rate against its gradient's sign.
        assert!(fine.0.is_ok() && (fine.1[0] - 0.989).abs() < 1e-4 && (fine.1[1] - 1.009).abs() < 1e-4, "{fine:?}");
    }
}
