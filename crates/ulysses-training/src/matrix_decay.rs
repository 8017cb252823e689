//! burn's AdamW with its weight decay on weight matrices alone, as Hugging Face's Trainer and
//! Megatron-LM decay (`ulysses_core::host_adamw::decays`): burn's decays every parameter,
//! norms' gains and biases too, pulling each RMSNorm's gain towards 0 through a fine-tune.
//! Two burn AdamWs, one with the decay and one without, each given its parameters'
//! gradients; the state is one record, keyed by parameter as burn's, so a checkpoint reads
//! either way.

use std::collections::HashSet;

use burn::{
    module::{AutodiffModule, ModuleVisitor, Param, ParamId},
    optim::{AdamW, AdamWConfig, GradientsParams, MultiGradientsParams, Optimizer, adaptor::OptimizerAdaptor},
    tensor::{Tensor, backend::AutodiffBackend},
};
use ulysses_core::host_adamw::decays;

type Adaptor<M, B> = OptimizerAdaptor<AdamW, M, B>;
type AdamWRecord<M, B> = <Adaptor<M, B> as Optimizer<M, B>>::Record;

/// burn's AdamW, decaying the parameters of two or more dimensions alone (see the module doc).
#[derive(Clone)]
pub struct MatrixDecayAdamW<M: AutodiffModule<B>, B: AutodiffBackend> {
    decayed: Adaptor<M, B>,
    undecayed: Adaptor<M, B>,
    /// A loaded state, split between the two at the next step (when the parameters are known).
    loaded: Option<AdamWRecord<M, B>>,
}

impl<M: AutodiffModule<B>, B: AutodiffBackend> MatrixDecayAdamW<M, B> {
    /// `config`'s AdamW (its weight decay on the matrices alone).
    pub fn new(config: &AdamWConfig) -> Self {
        Self { decayed: config.init(), undecayed: config.clone().with_weight_decay(0.0).init(), loaded: None }
    }

    /// Moves the gradients of the parameters AdamW does not decay out of `grads`.
    fn undecayed_grads(module: &M, grads: &mut GradientsParams) -> GradientsParams {
        let mut undecayed = GradientsParams::new();
        for id in undecayed_parameters(module) {
            if let Some(grad) = grads.remove::<B::InnerBackend, 1>(id) {
                undecayed.register::<B::InnerBackend, 1>(id, grad);
            }
        }
        undecayed
    }

    /// The loaded state, each parameter's to the AdamW that updates it.
    fn place_loaded(&mut self, module: &M) {
        let Some(record) = self.loaded.take() else { return };
        let undecayed = undecayed_parameters(module);
        let (mut decayed_record, mut undecayed_record) = (record.clone(), record);
        decayed_record.retain(|id, _| !undecayed.contains(id));
        undecayed_record.retain(|id, _| undecayed.contains(id));
        self.decayed = self.decayed.clone().load_record(decayed_record);
        self.undecayed = self.undecayed.clone().load_record(undecayed_record);
    }
}

/// The parameters of one dimension (norms' gains, biases): those AdamW does not decay.
fn undecayed_parameters<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M) -> HashSet<ParamId> {
    struct Vectors(HashSet<ParamId>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Vectors {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if !decays(D) {
                self.0.insert(param.id);
            }
        }
    }
    let mut vectors = Vectors(HashSet::new());
    module.visit(&mut vectors);
    vectors.0
}

impl<M: AutodiffModule<B>, B: AutodiffBackend> Optimizer<M, B> for MatrixDecayAdamW<M, B> {
    type Record = AdamWRecord<M, B>;

    fn step(&mut self, lr: f64, module: M, mut grads: GradientsParams) -> M {
        self.place_loaded(&module);
        let undecayed = Self::undecayed_grads(&module, &mut grads);
        let module = self.decayed.step(lr, module, grads);
        self.undecayed.step(lr, module, undecayed)
    }

    fn step_multi(&mut self, lr: f64, module: M, mut grads: MultiGradientsParams) -> M {
        self.place_loaded(&module);
        let mut undecayed = MultiGradientsParams::default();
        for (device_grads, device) in grads.grads.iter_mut() {
            undecayed.grads.push((Self::undecayed_grads(&module, device_grads), *device));
        }
        let module = self.decayed.step_multi(lr, module, grads);
        self.undecayed.step_multi(lr, module, undecayed)
    }

    fn to_record(&self) -> Self::Record {
        if let Some(loaded) = &self.loaded {
            return loaded.clone();
        }
        // Each holds the state of the parameters it updates alone.
        let mut record = self.decayed.to_record();
        record.extend(self.undecayed.to_record());
        record
    }

    fn load_record(mut self, record: Self::Record) -> Self {
        self.loaded = Some(record);
        self
    }
}

#[cfg(test)]
mod tests {
    use burn::{
        backend::{Autodiff, NdArray},
        nn::{Initializer, Linear, LinearConfig},
        optim::{AdamWConfig, GradientsParams, Optimizer},
        tensor::{Tensor, TensorData},
    };

    use super::MatrixDecayAdamW;

    type B = Autodiff<NdArray>;

    fn values(tensor: Tensor<B, 2>) -> Vec<f32> {
        tensor.into_data().to_vec().unwrap()
    }

    fn bias(linear: &Linear<B>) -> Vec<f32> {
        linear.bias.as_ref().unwrap().val().into_data().to_vec().unwrap()
    }

    /// Gradients of `linear`'s loss on fixed inputs: linear in the parameters, so the same
    /// at any parameters (runs that part ways still see the same gradients).
    fn grads(linear: &Linear<B>, scale: f32) -> GradientsParams {
        let input = Tensor::<B, 2>::from_data(TensorData::new(vec![0.5, -1.0, 2.0, 0.25, 1.5, -0.75], [2, 3]), &Default::default());
        let loss = (linear.forward(input) * scale).sum();
        GradientsParams::from_grads(loss.backward(), linear)
    }

    /// The weight matrix steps as burn's AdamW with the decay, the bias as burn's without it;
    /// a state saved and loaded into a fresh optimizer steps on as the one that saved it.
    #[test]
    fn the_weight_matrix_decays_and_the_bias_does_not() {
        let config = AdamWConfig::new().with_weight_decay(0.5).with_epsilon(1e-8);
        // Constant: a lazily initialised random parameter would differ in each clone.
        let linear = LinearConfig::new(3, 2).with_initializer(Initializer::Constant { value: 0.5 }).init::<B>(&Default::default());
        let mut ours = MatrixDecayAdamW::<Linear<B>, B>::new(&config);
        let (mut decayed, mut undecayed) = (config.init::<B, Linear<B>>(), config.clone().with_weight_decay(0.0).init::<B, Linear<B>>());
        let (mut mine, mut theirs_decayed, mut theirs_undecayed) = (linear.clone(), linear.clone(), linear.clone());
        for step in 0..3 {
            mine = ours.step(0.1, mine.clone(), grads(&mine, 1.0 + step as f32));
            theirs_decayed = decayed.step(0.1, theirs_decayed.clone(), grads(&theirs_decayed, 1.0 + step as f32));
            theirs_undecayed = undecayed.step(0.1, theirs_undecayed.clone(), grads(&theirs_undecayed, 1.0 + step as f32));
        }
        // burn's AdamW with the decay on both moves the bias otherwise: the test can tell.
        assert_ne!(bias(&theirs_decayed), bias(&theirs_undecayed));
        assert_eq!(values(mine.weight.val()), values(theirs_decayed.weight.val()), "the weight matrix steps as burn's AdamW with the decay");
        assert_eq!(bias(&mine), bias(&theirs_undecayed), "the bias steps as burn's AdamW without the decay");

        // Saved after 3 steps and loaded into a fresh optimizer: the 4th step is the same.
        let mut resumed = MatrixDecayAdamW::<Linear<B>, B>::new(&config).load_record(ours.to_record());
        assert_eq!(resumed.to_record().len(), 2, "a state for the weight and the bias, before any step");
        let continued = ours.step(0.1, mine.clone(), grads(&mine, 4.0));
        let after_load = resumed.step(0.1, mine.clone(), grads(&mine, 4.0));
        assert_eq!(values(continued.weight.val()), values(after_load.weight.val()));
        assert_eq!(bias(&continued), bias(&after_load));
        assert_eq!(resumed.to_record().len(), 2, "one state a parameter after the step");
    }
}
