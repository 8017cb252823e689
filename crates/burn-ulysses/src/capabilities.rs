//! What `UlyssesBackend<Inner>` needs from the backend it wraps: a way to exchange tensors
//! between ranks ([`ExchangeBackend`]), and the best attention it has over whole sequences
//! ([`SequenceAttention`]). The traits only: their implementations live beside the autodiff
//! node each one builds (`exchange` for the all-to-all, `flash` for the fused attention), so
//! this module, like `comm`, imports nothing above it.
//!
//! Rust has no specialisation, so a backend says which kind it is: `Autodiff<B>` (the
//! exchange and the fused attention become autodiff nodes) or a [`PlainBackend`] (no
//! autodiff: tensors are exchanged as they are). This crate implements [`PlainBackend`] for
//! NdArray (feature `ndarray`) and for burn's CubeCL backends, fused or not (feature
//! `cubecl`: CUDA, wgpu; both run the flash kernels of `ulysses-kernels`); a backend type of
//! your own needs `impl PlainBackend for MyBackend {}`. Other burn backends (Candle,
//! LibTorch, Router) need that line here, behind a feature: the orphan rule forbids writing
//! it outside this crate.

use std::{future::Future, pin::Pin, sync::Arc};

use burn::tensor::{
    DType, TensorData,
    backend::{Backend, ExecutionError},
    ops::{AttentionModuleOptions, BoolTensor, FloatTensor},
};

use crate::{
    comm::{CommError, Communicator},
    error::UlyssesError,
    layout::RingPlan,
    visibility::Visibility,
};

/// How `UlyssesBackend`'s name (`Backend::name`) begins, `ulysses<inner>`: what tells the
/// decorator from a backend that does not intercept attention.
pub(crate) const NAME_PREFIX: &str = "ulysses<";

/// A backend that `UlyssesBackend` can wrap: it exchanges tensors (implemented in
/// `exchange`, beside the all-to-all's autodiff node) and attends over whole sequences
/// (implemented in `flash`, beside the fused attention's autodiff node).
pub trait ExchangeBackend: SequenceAttention {
    /// The backend whose tensors the communicator moves: `Self` for a plain backend, the
    /// inner backend for `Autodiff<B>`.
    type Wire: PlainBackend<Device = Self::Device>;

    /// All-to-all over dim 0 (row `j` goes to rank `j`). On an autodiff backend the
    /// gradient flows back through the same exchange.
    fn all_to_all(
        tensor: FloatTensor<Self>,
        communicator: &Arc<dyn Communicator<Self::Wire>>,
    ) -> Result<FloatTensor<Self>, CommError>;

    /// All-to-all of unequal parts of a 1-D tensor (see
    /// [`Communicator::all_to_all_uneven`]). On an autodiff backend the gradient flows back
    /// through the same exchange with the counts swapped.
    fn all_to_all_uneven(
        tensor: FloatTensor<Self>,
        send_counts: &[usize],
        recv_counts: &[usize],
        communicator: &Arc<dyn Communicator<Self::Wire>>,
    ) -> Result<FloatTensor<Self>, CommError>;

    /// Sends `tensor` to rank `to` and returns rank `from`'s (every rank at once, see
    /// [`Communicator::send_recv`]). On an autodiff backend the gradient goes back the way
    /// the tensor came.
    fn send_recv(
        tensor: FloatTensor<Self>,
        to: usize,
        from: usize,
        communicator: &Arc<dyn Communicator<Self::Wire>>,
    ) -> Result<FloatTensor<Self>, CommError>;

    /// Ring attention whose blocks run the wire backend's fused kernels (`ring::fused`;
    /// the caller has checked that they take the blocks of `plan`). On `Autodiff<B>` it is
    /// one autodiff node whose backward runs the ring again.
    fn fused_ring_attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        plan: &RingPlan,
        ring: &Arc<dyn Communicator<Self::Wire>>,
    ) -> Result<FloatTensor<Self>, UlyssesError>;

    /// Whether `tensor` is in an autodiff graph (a parameter, or computed from one): an
    /// activation under training, not a constant such as a table of positions (the guard's
    /// position rule tells them apart by it). Without autodiff, false.
    fn is_tracked(tensor: &FloatTensor<Self>) -> bool;

    /// All-gather along a new leading dim, without gradient (masks).
    fn all_gather_untracked(
        tensor: FloatTensor<Self>,
        communicator: &Arc<dyn Communicator<Self::Wire>>,
    ) -> Result<FloatTensor<Self>, CommError>;
}

/// Attention over whole sequences, with the backend's best kernel.
pub trait SequenceAttention: Backend {
    /// Attention over whole sequences: the backend's fused kernel when it has one for these
    /// inputs (no mask, bias or softcap; documents and key padding as `visibility`), else
    /// burn's attention, as `fallback` allows. k and v may have fewer heads than q
    /// (grouped-query attention, kv heads dividing q heads).
    #[allow(clippy::too_many_arguments)]
    fn sequence_attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        mask: Option<BoolTensor<Self>>,
        attn_bias: Option<FloatTensor<Self>>,
        options: AttentionModuleOptions,
        visibility: Option<Arc<Visibility>>,
        fallback: DenseFallback,
    ) -> Result<FloatTensor<Self>, UlyssesError>;
}

/// What attention does when no fused kernel takes a call and burn's dense attention, which
/// builds the `S × S` score matrix, would run instead (`UlyssesConfig::forbid_dense_fallback`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenseFallback {
    /// Run burn's attention and log why.
    Allow,
    /// Fail with [`UlyssesError::DenseFallback`], naming why.
    Forbid,
}

/// A backend without autodiff. A backend with its own attention kernels overrides the two
/// `fused_attention_*` hooks (burn's CubeCL backends do, with `ulysses-kernels`).
pub trait PlainBackend: Backend {
    /// `Ok` when [`fused_attention_forward`](Self::fused_attention_forward) would return
    /// `Ok` for q, k and v of these shapes and dtypes on `device`, else why not. Asked by
    /// backends that record work to run later (fusion), before they record.
    fn fused_attention_check(
        _operands: [(&[usize], DType); 3],
        _device: &Self::Device,
        _options: &AttentionModuleOptions,
    ) -> Result<(), String> {
        Err(no_fused_kernel::<Self>())
    }

    /// Output and per-row log-sum-exp (`[B, H, S_q]`, f32) of attention with grouped kv
    /// heads allowed, each row seeing the keys `visibility` gives it, or why this backend has
    /// no kernel for these inputs.
    fn fused_attention_forward(
        _query: FloatTensor<Self>,
        _key: FloatTensor<Self>,
        _value: FloatTensor<Self>,
        _options: &AttentionModuleOptions,
        _visibility: Option<&Visibility>,
    ) -> Result<(FloatTensor<Self>, FloatTensor<Self>), String> {
        Err(no_fused_kernel::<Self>())
    }

    /// `(dQ, dK, dV)` from the inputs, output, output gradient and log-sum-exp of a
    /// [`fused_attention_forward`](Self::fused_attention_forward) that returned `Ok`.
    #[allow(clippy::too_many_arguments)]
    fn fused_attention_backward(
        _query: FloatTensor<Self>,
        _key: FloatTensor<Self>,
        _value: FloatTensor<Self>,
        _output: FloatTensor<Self>,
        _output_grad: FloatTensor<Self>,
        _lse: FloatTensor<Self>,
        _options: &AttentionModuleOptions,
        _visibility: Option<&Visibility>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        unreachable!("fused_attention_backward without a fused forward on {}", std::any::type_name::<Self>())
    }

    /// Each row's cross-entropy (`[rows]`, f32) and the gradient of their sum with respect to
    /// the logits (`[rows, vocab]`, the logits' dtype), in one pass over `logits: [rows,
    /// vocab]` given `labels: [rows]` (ids as f32); rows labelled `ignore_index` give 0 and 0.
    /// Or why this backend has no kernel for them: the training loss then uses tensor ops.
    fn fused_cross_entropy(_logits: FloatTensor<Self>, _labels: FloatTensor<Self>, _ignore_index: i64) -> Result<(FloatTensor<Self>, FloatTensor<Self>), String> {
        Err(no_fused_cross_entropy::<Self>())
    }

    /// `Ok` when [`fused_cross_entropy`](Self::fused_cross_entropy) would run its kernel on
    /// logits and labels of these shapes and dtypes on `device`, else why not. Asked by
    /// backends that record work to run later (fusion), before they record.
    fn fused_cross_entropy_check(_logits: (&[usize], DType), _labels: (&[usize], DType), _device: &Self::Device) -> Result<(), String> {
        Err(no_fused_cross_entropy::<Self>())
    }

    /// Starts copying `tensor` to the host behind the work already queued on its device and
    /// returns without waiting for it (see [`QueuedRead`]). The default cannot queue a read:
    /// it reads now, which waits for the device.
    fn queue_read(tensor: FloatTensor<Self>) -> QueuedRead {
        QueuedRead::Arrived(burn::tensor::read_sync(Self::float_into_data(tensor)))
    }

    /// `data` in host memory that `device` can copy from behind its queued work, the host not
    /// waiting for it: page-locked (pinned) memory on CUDA. A copy from pageable memory may
    /// first wait for the device's stream (CUDA stages such a copy itself), so data uploaded
    /// often while the device is busy, such as restored offloaded tiles, goes through here.
    /// The default returns `data` as it is: a backend without pinned memory (NdArray, wgpu)
    /// uploads it as before.
    fn pin_for_upload(data: TensorData, _device: &Self::Device) -> TensorData {
        data
    }

    /// What `device`'s memory pools hold now, or `None` where the backend's memory is the
    /// host's (NdArray) or unknown.
    fn device_memory(_device: &Self::Device) -> Option<DeviceMemory> {
        None
    }
}

/// A device's memory as its pools account for it ([`PlainBackend::device_memory`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes the live tensors occupy.
    pub in_use: u64,
    /// Bytes the pools have taken from the device: they keep what they took, so this is the
    /// most they ever held (CubeCL's `bytes_reserved`), at least the peak of `in_use`.
    pub reserved: u64,
}

/// A tensor on its way to the host ([`PlainBackend::queue_read`]).
pub enum QueuedRead {
    /// The copy is queued on the device; awaiting this waits for it (and for everything
    /// queued before it), nothing before.
    Queued(Pin<Box<dyn Future<Output = Result<TensorData, ExecutionError>> + Send>>),
    /// The backend could not queue it: the host has already waited for it.
    Arrived(Result<TensorData, ExecutionError>),
}

fn no_fused_cross_entropy<B>() -> String {
    format!("{} has no fused cross-entropy kernel", std::any::type_name::<B>())
}

fn no_fused_kernel<B>() -> String {
    format!("{} has no fused attention kernel", std::any::type_name::<B>())
}

#[cfg(feature = "ndarray")]
impl<E, I, Q> PlainBackend for burn_ndarray::NdArray<E, I, Q>
where
    E: burn_ndarray::FloatNdArrayElement,
    I: burn_ndarray::IntNdArrayElement,
    Q: burn_ndarray::QuantElement,
    burn_ndarray::NdArrayTensor: From<burn_ndarray::SharedArray<E>>,
    burn_ndarray::NdArrayTensor: From<burn_ndarray::SharedArray<I>>,
{
    /// NdArray has no device to wait for: its tensors are host memory already, so the copy
    /// may run whenever the read is awaited.
    fn queue_read(tensor: FloatTensor<Self>) -> QueuedRead {
        QueuedRead::Queued(Box::pin(<Self as burn::tensor::ops::FloatTensorOps<Self>>::float_into_data(tensor)))
    }
}

