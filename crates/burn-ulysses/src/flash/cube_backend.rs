//! burn's CubeCL backends run the flash-attention and cross-entropy kernels of
//! `ulysses-kernels`.

use std::{
    any::{Any, TypeId},
    collections::HashMap,
    sync::{LazyLock, Mutex},
};

use burn::tensor::{
    AllocationProperty, DType, TensorData,
    backend::{Backend, ExecutionError},
    ops::{AttentionModuleOptions, FloatTensor},
};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement, cubecl::{client::ComputeClient, device::{Device, DeviceId}, server::CopyDescriptor}};
use ulysses_kernels::{
    FlashError, FlashOptions, OperandInfo, VisibleRanges, check_cross_entropy, flash_attention_backward, flash_attention_forward, fused_cross_entropy,
    plan_flash_attention,
};

use super::no_fused_cross_entropy;
use crate::{
    capabilities::{PlainBackend, QueuedRead},
    visibility::Visibility,
};

fn flash_options(options: &AttentionModuleOptions) -> FlashOptions {
    FlashOptions { scale: options.scale, causal: options.is_causal }
}

/// Why the kernels refused a call, for a dense fallback; a wrong setting of the environment
/// (`ULYSSES_FLASH_ENGINE`, `ULYSSES_FLASH_SKEW`) stops instead: a fallback would turn a typo
/// into `S × S` attention at every call.
fn fallback_reason(error: FlashError) -> String {
    match error {
        FlashError::Setting(_) => panic!("{error}"),
        other => other.to_string(),
    }
}

/// The kernels' tables for `visibility`.
fn visible_ranges(visibility: &Visibility) -> Result<VisibleRanges, FlashError> {
    let (batch, seq_q, seq_kv) = visibility.dims();
    let mut ranges = VisibleRanges::all(batch, seq_q, seq_kv)?;
    if let Some(lengths) = visibility.document_lengths() {
        ranges = ranges.with_documents(lengths)?;
    }
    if let Some(runs) = visibility.key_runs() {
        ranges = ranges.with_key_runs(runs)?;
    }
    if let Some(window) = visibility.window() {
        ranges = ranges.with_window(window)?;
    }
    Ok(ranges)
}

impl<R, F, I, BT> PlainBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
    Self: Backend<FloatTensorPrimitive = burn_cubecl::tensor::CubeTensor<R>, Device = R::Device>,
{
    fn fused_attention_check(
        operands: [(&[usize], DType); 3],
        device: &Self::Device,
        options: &AttentionModuleOptions,
    ) -> Result<(), String> {
        let [query, key, value] = operands.map(|(shape, dtype)| OperandInfo { shape, dtype });
        plan_flash_attention(&R::client(device), query, key, value, &flash_options(options)).map(|_| ()).map_err(fallback_reason)
    }

    fn fused_attention_forward(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        options: &AttentionModuleOptions,
        visibility: Option<&Visibility>,
    ) -> Result<(FloatTensor<Self>, FloatTensor<Self>), String> {
        let ranges = visibility.map(visible_ranges).transpose().map_err(fallback_reason)?;
        flash_attention_forward(query, key, value, flash_options(options), ranges.as_ref()).map_err(fallback_reason)
    }

    fn fused_attention_backward(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        output: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        options: &AttentionModuleOptions,
        visibility: Option<&Visibility>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let ranges = visibility.map(|visibility| visible_ranges(visibility).expect("the forward built these ranges"));
        flash_attention_backward(query, key, value, output, output_grad, lse, flash_options(options), ranges.as_ref())
            .unwrap_or_else(|error| panic!("the forward accepted these inputs, the backward refused them: {error}"))
    }

    fn fused_cross_entropy(logits: FloatTensor<Self>, labels: FloatTensor<Self>, ignore_index: i64) -> Result<(FloatTensor<Self>, FloatTensor<Self>), String> {
        let result = cross_entropy_switch().and_then(|()| fused_cross_entropy(logits, labels, ignore_index).map_err(|e| e.to_string()));
        result.map_err(no_fused_cross_entropy)
    }

    fn fused_cross_entropy_check(logits: (&[usize], DType), labels: (&[usize], DType), device: &Self::Device) -> Result<(), String> {
        cross_entropy_switch()?;
        check_cross_entropy(&R::client(device), logits, labels).map_err(|e| e.to_string())
    }

    /// The copy goes into CubeCL's pinned staging memory on the device's stream, queued when
    /// `read_one_tensor_async` is called; its future waits on a fence when first polled.
    /// (burn's `into_data_async` cannot be split that way: its first poll both queues the
    /// copy and waits for it.) The device buffer may be reused once queued: the copy runs
    /// before anything queued after it.
    fn queue_read(tensor: FloatTensor<Self>) -> QueuedRead {
        let tensor = burn_cubecl::kernel::into_contiguous_aligned(tensor);
        let (shape, dtype) = (tensor.meta.shape().clone(), tensor.dtype);
        let (strides, elem_size) = (tensor.meta.strides().clone(), tensor.elem_size());
        let descriptor = CopyDescriptor::new(tensor.handle.binding(), shape.clone(), strides, elem_size);
        let bytes = static_client::<R>(&tensor.device).read_one_tensor_async(descriptor);
        QueuedRead::Queued(Box::pin(async move {
            let bytes = bytes.await.map_err(|error| ExecutionError::WithContext { reason: error.to_string() })?;
            Ok(TensorData::from_bytes(bytes, shape, dtype))
        }))
    }

    /// One host copy into CubeCL's pinned staging pool (reused from upload to upload), from
    /// which `from_data`'s copy is an asynchronous DMA on the device's stream. Runtimes
    /// without staging memory (wgpu) refuse, and `data` stays as it was.
    fn pin_for_upload(mut data: TensorData, device: &Self::Device) -> TensorData {
        if data.bytes.property() != AllocationProperty::Pinned {
            R::client(device).staging(std::iter::once(&mut data.bytes), false);
        }
        data
    }

    fn device_memory(device: &Self::Device) -> Option<crate::capabilities::DeviceMemory> {
        let usage = R::client(device).memory_usage().ok()?;
        Some(crate::capabilities::DeviceMemory { in_use: usage.bytes_in_use, reserved: usage.bytes_reserved })
    }
}

/// `ULYSSES_FUSED_CROSS_ENTROPY=0` runs the tensor-op loss instead, for a side-by-side
/// measurement: then the refusal that says so.
fn cross_entropy_switch() -> Result<(), String> {
    match std::env::var("ULYSSES_FUSED_CROSS_ENTROPY").as_deref() {
        Ok("0") => Err("ULYSSES_FUSED_CROSS_ENTROPY=0".to_string()),
        _ => Ok(()),
    }
}

/// `device`'s compute client, kept for the life of the process. CubeCL's read futures
/// borrow the client they came from (edition 2024 captures `&self`) though they hold nothing
/// of it, so a read that outlives the call needs a client that lives as long. CubeCL keeps
/// every device's server for the life of the process; one client per device and runtime
/// more is a few bytes.
fn static_client<R: CubeRuntime>(device: &R::Device) -> &'static ComputeClient<R> {
    static CLIENTS: LazyLock<Mutex<HashMap<(TypeId, DeviceId), &'static (dyn Any + Send + Sync)>>> = LazyLock::new(Default::default);
    let key = (TypeId::of::<R>(), device.to_id());
    let mut clients = CLIENTS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let client = *clients.entry(key).or_insert_with(|| Box::leak(Box::new(R::client(device))));
    client.downcast_ref().expect("the entry of runtime R holds R's client")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the kernels cannot take falls back to dense attention; a wrong setting stops.
    #[test]
    fn a_wrong_setting_stops_where_a_refused_shape_falls_back() {
        assert_eq!(fallback_reason(FlashError::Device("no fixed plane size".into())), "flash attention: no fixed plane size");
        let stopped = std::panic::catch_unwind(|| fallback_reason(FlashError::Setting("ULYSSES_FLASH_ENGINE=\"fragment\"".into())));
        let message = stopped.err().and_then(|panic| panic.downcast::<String>().ok()).expect("a panic with a message");
        assert!(message.contains("ULYSSES_FLASH_ENGINE=\"fragment\""), "{message}");
    }
}
