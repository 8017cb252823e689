//! A module's float parameters by name, for the code that compares, hashes or checks them.

use burn::{
    module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId, ParamMapper},
    tensor::{DType, FloatDType, Shape, Tensor, backend::Backend},
};

/// One float parameter of a module.
pub struct FloatParameter<B: Backend> {
    /// Its path in the module, e.g. `blocks.0.attention.wq.weight`.
    pub path: String,
    pub id: ParamId,
    pub shape: Shape,
    /// Its values, flattened.
    pub values: Tensor<B, 1>,
}

/// Every float parameter of `module`, in module order (the same on every rank: ids differ
/// between processes, paths and order do not).
pub fn float_parameters<B: Backend, M: Module<B>>(module: &M) -> Vec<FloatParameter<B>> {
    struct Collect<B: Backend>(Vec<(ParamId, Shape, Tensor<B, 1>)>);
    impl<B: Backend> ModuleVisitor<B> for Collect<B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let value = param.val();
            self.0.push((param.id, value.shape(), value.flatten(0, D - 1)));
        }
    }
    let mut collect = Collect(Vec::new());
    module.visit(&mut collect);
    parameter_paths(module).into_iter().zip(collect.0).map(|(path, (id, shape, values))| FloatParameter { path, id, shape, values }).collect()
}

/// The path of each float parameter of `module` (`layers.0.attention.wq.weight`), in module
/// order, read without its values (a lazily initialised module stays uninitialised).
pub fn parameter_paths<B: Backend, M: Module<B>>(module: &M) -> Vec<String> {
    struct Paths {
        path: Vec<String>,
        found: Vec<String>,
    }
    impl<B: Backend> ModuleVisitor<B> for Paths {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, _param: &Param<Tensor<B, D>>) {
            self.found.push(self.path.join("."));
        }
    }
    let mut paths = Paths { path: Vec::new(), found: Vec::new() };
    module.visit(&mut paths);
    paths.found
}

/// The number of elements of each float parameter of `module`, in module order, read from
/// the shapes alone: a module whose parameters burn initialises lazily (`Config::init`) stays
/// uninitialised, so a model too large to build can be measured before it is.
pub fn parameter_elements<B: Backend, M: Module<B>>(module: &M) -> Vec<usize> {
    parameter_shapes(module).iter().map(|shape| shape.iter().product()).collect()
}

/// The shape of each float parameter of `module`, in module order, read as
/// [`parameter_elements`] reads them (a lazy module stays unbuilt).
pub fn parameter_shapes<B: Backend, M: Module<B>>(module: &M) -> Vec<Vec<usize>> {
    struct Shapes(Vec<Vec<usize>>);
    impl<B: Backend> ModuleVisitor<B> for Shapes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push(param.lazy_shape().to_vec());
        }
    }
    let mut shapes = Shapes(Vec::new());
    module.visit(&mut shapes);
    shapes.0
}

/// A float parameter's id, whether it requires a gradient and its mapper, building nothing
/// where it is lazy: burn keeps a lazy parameter's flag private, and `transform_for_load`
/// gives a one-element tensor on the parameter's device that flag without calling its init.
pub fn take_lazy_flag<B: Backend, const D: usize>(param: Param<Tensor<B, D>>) -> (ParamId, bool, ParamMapper<Tensor<B, D>>) {
    let id = param.id;
    let one = Tensor::zeros([1; D], (&param.lazy_device(), DType::F32));
    let (id, flagged, mapper) = param.transform_for_load(one, id).consume();
    (id, flagged.is_require_grad(), mapper)
}

/// `module` with every float parameter cast to `dtype`, each keeping its id and whether it
/// requires a gradient (a leaf again, not a cast inside a graph): the compute copy of a model
/// whose f32 master weights live elsewhere (the optimizer on the host).
pub fn with_parameters_in<B: Backend, M: Module<B>>(module: M, dtype: FloatDType) -> M {
    struct Cast(FloatDType);
    impl<B: Backend> ModuleMapper<B> for Cast {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            let requires_grad = tensor.is_require_grad();
            Param::from_mapped_value(id, tensor.cast(self.0).detach().set_require_grad(requires_grad), mapper)
        }
    }
    module.map(&mut Cast(dtype))
}

#[cfg(test)]
mod tests {
    use burn::{
        backend::NdArray,
        nn::{EmbeddingConfig, LinearConfig},
    };

    use super::*;

    #[derive(Module, Debug)]
    struct Two<B: Backend> {
        embedding: burn::nn::Embedding<B>,
        linear: burn::nn::Linear<B>,
    }

    #[test]
    fn parameter_elements_are_read_without_initialising_the_parameters() {
        let device = Default::default();
        let lazy = || Two::<NdArray> { embedding: EmbeddingConfig::new(7, 3).init(&device), linear: LinearConfig::new(3, 5).init(&device) };
        let model = lazy();
        assert_eq!(parameter_elements(&model), [21, 15, 5]);
        assert!(!model.embedding.weight.is_initialized() && !model.linear.weight.is_initialized(), "counting must not build the tensors");
        // The same counts as the built parameters'.
        let built: Vec<usize> = float_parameters(&lazy()).iter().map(|p| p.shape.num_elements()).collect();
        assert_eq!(built, [21, 15, 5]);
    }
}
