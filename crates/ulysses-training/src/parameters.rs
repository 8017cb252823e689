//! A module's float parameters by name, for the code that compares, hashes or checks them.

use burn::{
    module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId},
    tensor::{FloatDType, Shape, Tensor, backend::Backend},
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
    struct Collect<B: Backend> {
        path: Vec<String>,
        found: Vec<FloatParameter<B>>,
    }
    impl<B: Backend> ModuleVisitor<B> for Collect<B> {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let value = param.val();
            self.found.push(FloatParameter { path: self.path.join("."), id: param.id, shape: value.shape(), values: value.flatten(0, D - 1) });
        }
    }
    let mut collect = Collect { path: Vec::new(), found: Vec::new() };
    module.visit(&mut collect);
    collect.found
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
