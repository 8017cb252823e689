//! `UlyssesBackend<Inner>`: a backend decorator that forwards every op to `Inner` and makes
//! attention sequence parallel.
//!
//! It reuses `Inner`'s device and tensor primitives, so a Ulysses tensor *is* an inner
//! tensor and forwarding is a plain call. The ~430 forwarding methods of the op traits are
//! generated into `forward/` by `cargo run -p xtask -- gen-forwarding` from the pinned
//! burn-backend sources (CI checks they are current); only `Backend`, `AutodiffBackend` and
//! the attention interception are written by hand.

mod forward;
mod prelude;
mod convert_primitives;

use std::{marker::PhantomData, sync::Arc};

use burn::tensor::{
    DType, TensorData,
    backend::{AutodiffBackend, Backend, BackendTypes, DTypeUsageSet, ExecutionError},
    ops::{BoolTensor, FloatTensor, IntTensor, QuantizedTensor},
};

use crate::{
    comm::Communicator,
    context::{self, RankContext, RankGuard, RankScope, UlyssesConfig},
    capabilities::ExchangeBackend,
};

/// Sequence parallelism as a backend: `UlyssesBackend<Autodiff<NdArray>>` trains,
/// `UlyssesBackend<NdArray>` runs inference. See the crate docs for the data path.
#[derive(Clone, Copy, Debug, Default)]
pub struct UlyssesBackend<Inner> {
    _inner: PhantomData<Inner>,
}

impl<Inner: ExchangeBackend> UlyssesBackend<Inner> {
    /// Makes this thread a rank of `communicator`'s group until the guard is dropped, with
    /// the default [`UlyssesConfig`]. Use this when ranks are threads of one process.
    /// `communicator` is the SP group's, never the world's under data parallelism (its
    /// all-to-all would join other replicas' shards): with a layout, enter
    /// `ParallelGroups::rank_context` through [`context::enter`] instead.
    pub fn enter_thread(communicator: Arc<dyn Communicator<Inner::Wire>>) -> RankGuard {
        Self::enter(RankScope::Thread, communicator, UlyssesConfig::new())
    }

    /// Makes this thread ([`RankScope::Thread`]) or this process ([`RankScope::Process`], one
    /// process per GPU) a rank of `communicator`'s group (the SP group's, as for
    /// [`enter_thread`](Self::enter_thread)) until the guard is dropped.
    pub fn enter(
        scope: RankScope,
        communicator: Arc<dyn Communicator<Inner::Wire>>,
        config: UlyssesConfig,
    ) -> RankGuard {
        context::enter(scope, RankContext::ulysses(communicator, config))
    }

    /// Ulysses × Ring: exchanges within `ulysses`, then ring attention across `ring`. The
    /// sequence shards of a Ulysses group must be consecutive (together they are the group's
    /// chunk of the sequence), and ring rank `r`'s group must hold chunk `r`: with shard
    /// index `ring_rank · ulysses_size + ulysses_rank`, split the world by `rank / U` for
    /// the Ulysses groups and by `rank % U` for the rings.
    pub fn enter_hybrid(
        scope: RankScope,
        ulysses: Arc<dyn Communicator<Inner::Wire>>,
        ring: Arc<dyn Communicator<Inner::Wire>>,
        config: UlyssesConfig,
    ) -> RankGuard {
        context::enter(scope, RankContext { communicator: ulysses, ring: Some(ring), config })
    }
}

impl<Inner: ExchangeBackend> BackendTypes for UlyssesBackend<Inner> {
    type Device = Inner::Device;

    type FloatTensorPrimitive = Inner::FloatTensorPrimitive;
    type FloatElem = Inner::FloatElem;

    type IntTensorPrimitive = Inner::IntTensorPrimitive;
    type IntElem = Inner::IntElem;

    type BoolTensorPrimitive = Inner::BoolTensorPrimitive;
    type BoolElem = Inner::BoolElem;

    type QuantizedTensorPrimitive = Inner::QuantizedTensorPrimitive;
}

impl<Inner: ExchangeBackend> Backend for UlyssesBackend<Inner> {
    fn ad_enabled(device: &Self::Device) -> bool {
        Inner::ad_enabled(device)
    }

    fn memory_persistent_allocations<Output: Send, Input: Send, Func: Fn(Input) -> Output + Send>(
        device: &Self::Device,
        input: Input,
        func: Func,
    ) -> Output {
        Inner::memory_persistent_allocations(device, input, func)
    }

    fn memory_cleanup(device: &Self::Device) {
        Inner::memory_cleanup(device)
    }

    fn name(device: &Self::Device) -> String {
        format!("{}{}>", crate::capabilities::NAME_PREFIX, Inner::name(device))
    }

    fn seed(device: &Self::Device, seed: u64) {
        Inner::seed(device, seed)
    }

    fn sync(device: &Self::Device) -> Result<(), ExecutionError> {
        crate::device_io::counted_sync();
        Inner::sync(device)
    }

    fn staging<'a, Iter>(data: Iter, device: &Self::Device)
    where
        Iter: Iterator<Item = &'a mut TensorData>,
    {
        Inner::staging(data, device)
    }

    fn supports_dtype(device: &Self::Device, dtype: DType) -> bool {
        Inner::supports_dtype(device, dtype)
    }

    fn dtype_usage(device: &Self::Device, dtype: DType) -> DTypeUsageSet {
        Inner::dtype_usage(device, dtype)
    }

    fn device_count(type_id: u16) -> usize {
        Inner::device_count(type_id)
    }
}

/// `UlyssesBackend<Autodiff<B>>` is the training stack: it stands wherever burn expects an
/// autodiff backend, and its inner backend is `UlyssesBackend<B>` so that `model.valid()`
/// keeps sequence-parallel attention for evaluation.
impl<Inner> AutodiffBackend for UlyssesBackend<Inner>
where
    Inner: AutodiffBackend + ExchangeBackend,
    Inner::InnerBackend: ExchangeBackend,
{
    type InnerBackend = UlyssesBackend<Inner::InnerBackend>;
    type Gradients = Inner::Gradients;

    fn backward(tensor: FloatTensor<Self>) -> Self::Gradients {
        crate::attention_guard::forget_embedded_lengths();
        Inner::backward(tensor)
    }

    fn grad(
        tensor: &FloatTensor<Self>,
        grads: &Self::Gradients,
    ) -> Option<FloatTensor<Self::InnerBackend>> {
        Inner::grad(tensor, grads)
    }

    fn grad_remove(
        tensor: &FloatTensor<Self>,
        grads: &mut Self::Gradients,
    ) -> Option<FloatTensor<Self::InnerBackend>> {
        Inner::grad_remove(tensor, grads)
    }

    fn grad_replace(
        tensor: &FloatTensor<Self>,
        grads: &mut Self::Gradients,
        grad: FloatTensor<Self::InnerBackend>,
    ) {
        Inner::grad_replace(tensor, grads, grad)
    }

    fn inner(tensor: FloatTensor<Self>) -> FloatTensor<Self::InnerBackend> {
        Inner::inner(tensor)
    }

    fn int_inner(tensor: IntTensor<Self>) -> IntTensor<Self::InnerBackend> {
        Inner::int_inner(tensor)
    }

    fn bool_inner(tensor: BoolTensor<Self>) -> BoolTensor<Self::InnerBackend> {
        Inner::bool_inner(tensor)
    }

    fn q_inner(tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self::InnerBackend> {
        Inner::q_inner(tensor)
    }

    fn from_inner(tensor: FloatTensor<Self::InnerBackend>) -> FloatTensor<Self> {
        Inner::from_inner(tensor)
    }

    fn int_from_inner(tensor: IntTensor<Self::InnerBackend>) -> IntTensor<Self> {
        Inner::int_from_inner(tensor)
    }

    fn bool_from_inner(tensor: BoolTensor<Self::InnerBackend>) -> BoolTensor<Self> {
        Inner::bool_from_inner(tensor)
    }

    fn q_from_inner(tensor: QuantizedTensor<Self::InnerBackend>) -> QuantizedTensor<Self> {
        Inner::q_from_inner(tensor)
    }
}
