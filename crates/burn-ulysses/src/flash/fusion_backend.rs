//! burn's fused backends (`Fusion<B>`: burn's default `Cuda` and `Wgpu` types) run the
//! kernels of the backend they wrap.
//!
//! A fusion stream records operations and runs them later, so a kernel joins it as a custom
//! operation: the attention kernels, and the cross-entropy kernel of the training loss.
//! Whether the kernel accepts the call is decided before recording, from shapes and dtypes
//! alone: once recorded, the operation can no longer fall back to tensor ops.

use std::{marker::PhantomData, sync::Arc};

use burn::tensor::{
    DType, Shape, TensorData,
    ops::{AttentionModuleOptions, FloatTensor},
};
use burn_fusion::{
    Fusion, FusionBackend, FusionRuntime, FusionTensor,
    stream::{Operation, OperationStreams},
};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, OperationOutput, TensorIr};

use crate::{
    capabilities::{PlainBackend, QueuedRead},
    visibility::Visibility,
};

/// Which kernel a recorded operation runs.
#[derive(Debug, Clone, Copy)]
enum Pass {
    /// Inputs q, k, v; outputs the output and the log-sum-exp.
    Forward,
    /// Inputs q, k, v, output, output gradient, log-sum-exp; outputs dQ, dK, dV.
    Backward,
}

#[derive(Debug)]
struct FlashOperation<B> {
    desc: CustomOpIr,
    pass: Pass,
    options: AttentionModuleOptions,
    visibility: Option<Arc<Visibility>>,
    backend: PhantomData<fn() -> B>,
}

impl<B: FusionBackend + PlainBackend> Operation<B::FusionRuntime> for FlashOperation<B> {
    fn execute(&self, handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>) {
        let mut input = |ir: &TensorIr| handles.get_float_tensor::<B>(ir);
        let outputs = match self.pass {
            Pass::Forward => {
                let ([q, k, v], _) = self.desc.as_fixed::<3, 2>();
                let (output, lse) = B::fused_attention_forward(input(q), input(k), input(v), &self.options, self.visibility.as_deref())
                    .unwrap_or_else(|reason| panic!("fused_attention_check accepted this call before it was recorded, then: {reason}"));
                vec![output, lse]
            }
            Pass::Backward => {
                let ([q, k, v, output, output_grad, lse], _) = self.desc.as_fixed::<6, 3>();
                let (q, k, v) = (input(q), input(k), input(v));
                let (output, output_grad, lse) = (input(output), input(output_grad), input(lse));
                let (dq, dk, dv) = B::fused_attention_backward(q, k, v, output, output_grad, lse, &self.options, self.visibility.as_deref());
                vec![dq, dk, dv]
            }
        };
        for (ir, tensor) in self.desc.outputs.iter().zip(outputs) {
            handles.register_float_tensor::<B>(&ir.id, tensor);
        }
    }
}

/// Records one attention kernel on the inputs' streams; `outputs` are the shapes and dtypes
/// it writes.
fn record<B: FusionBackend + PlainBackend>(
    pass: Pass,
    inputs: Vec<FusionTensor<B::FusionRuntime>>,
    outputs: Vec<(Shape, DType)>,
    options: &AttentionModuleOptions,
    visibility: Option<&Visibility>,
) -> Vec<FusionTensor<B::FusionRuntime>> {
    let name = match pass {
        Pass::Forward => "ulysses_flash_attention_forward",
        Pass::Backward => "ulysses_flash_attention_backward",
    };
    let visibility = visibility.map(|visibility| Arc::new(visibility.clone()));
    record_custom::<B, _>(name, inputs, outputs, |desc| FlashOperation::<B> { desc, pass, options: *options, visibility, backend: PhantomData })
}

/// Records the custom operation `operation(desc)` named `name` on the inputs' streams, with
/// outputs of these shapes and dtypes.
fn record_custom<B: FusionBackend, O: Operation<B::FusionRuntime> + 'static>(
    name: &'static str,
    inputs: Vec<FusionTensor<B::FusionRuntime>>,
    outputs: Vec<(Shape, DType)>,
    operation: impl FnOnce(CustomOpIr) -> O,
) -> Vec<FusionTensor<B::FusionRuntime>> {
    let client = inputs[0].client.clone();
    let streams = OperationStreams::with_inputs(&inputs);
    let outputs: Vec<_> = outputs.into_iter().map(|(shape, dtype)| TensorIr::uninit(client.create_empty_handle(), shape, dtype)).collect();
    let inputs: Vec<_> = inputs.into_iter().map(|tensor| tensor.into_ir()).collect();
    let desc = CustomOpIr::new(name, &inputs, &outputs);
    client.register(streams, OperationIr::Custom(desc.clone()), operation(desc))
}

/// The fused cross-entropy kernel as a recorded operation: inputs logits and labels, outputs
/// the rows' losses and the logits' gradient.
#[derive(Debug)]
struct CrossEntropyOperation<B> {
    desc: CustomOpIr,
    ignore_index: i64,
    backend: PhantomData<fn() -> B>,
}

impl<B: FusionBackend + PlainBackend> Operation<B::FusionRuntime> for CrossEntropyOperation<B> {
    fn execute(&self, handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>) {
        let ([logits, labels], [losses_ir, grads_ir]) = self.desc.as_fixed::<2, 2>();
        let (logits, labels) = (handles.get_float_tensor::<B>(logits), handles.get_float_tensor::<B>(labels));
        let (losses, grads) = B::fused_cross_entropy(logits, labels, self.ignore_index)
            .unwrap_or_else(|reason| panic!("fused_cross_entropy_check accepted this call before it was recorded, then: {reason}"));
        handles.register_float_tensor::<B>(&losses_ir.id, losses);
        handles.register_float_tensor::<B>(&grads_ir.id, grads);
    }
}

fn shape_and_dtype<R: FusionRuntime>(tensor: &FusionTensor<R>) -> (Shape, DType) {
    (tensor.shape.clone(), tensor.dtype)
}

impl<B: FusionBackend + PlainBackend> PlainBackend for Fusion<B> {
    fn fused_attention_check(
        operands: [(&[usize], DType); 3],
        device: &Self::Device,
        options: &AttentionModuleOptions,
    ) -> Result<(), String> {
        B::fused_attention_check(operands, device, options)
    }

    fn fused_attention_forward(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        options: &AttentionModuleOptions,
        visibility: Option<&Visibility>,
    ) -> Result<(FloatTensor<Self>, FloatTensor<Self>), String> {
        let operands = [&query, &key, &value].map(|tensor| (&tensor.shape[..], tensor.dtype));
        B::fused_attention_check(operands, query.client.device(), options)?;
        let (q, v) = (&query.shape, &value.shape);
        let output = (Shape::new([q[0], q[1], q[2], v[3]]), query.dtype);
        let lse = (Shape::new([q[0], q[1], q[2]]), DType::F32);
        let [output, lse] = record::<B>(Pass::Forward, vec![query, key, value], vec![output, lse], options, visibility).outputs();
        Ok((output, lse))
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
        // Gradients have the shapes and dtypes of what they differentiate.
        let grads = [&query, &key, &value].map(shape_and_dtype).to_vec();
        let inputs = vec![query, key, value, output, output_grad, lse];
        let [dq, dk, dv] = record::<B>(Pass::Backward, inputs, grads, options, visibility).outputs();
        (dq, dk, dv)
    }

    fn fused_cross_entropy(logits: FloatTensor<Self>, labels: FloatTensor<Self>, ignore_index: i64) -> Result<(FloatTensor<Self>, FloatTensor<Self>), String> {
        let (logits_of, labels_of) = ((&logits.shape[..], logits.dtype), (&labels.shape[..], labels.dtype));
        B::fused_cross_entropy_check(logits_of, labels_of, logits.client.device()).map_err(super::no_fused_cross_entropy)?;
        let outputs = vec![(Shape::new([logits.shape[0]]), DType::F32), shape_and_dtype(&logits)];
        let [losses, grads] = record_custom::<B, _>("ulysses_fused_cross_entropy", vec![logits, labels], outputs, |desc| CrossEntropyOperation::<B> {
            desc,
            ignore_index,
            backend: PhantomData,
        })
        .outputs();
        Ok((losses, grads))
    }

    fn fused_cross_entropy_check(logits: (&[usize], DType), labels: (&[usize], DType), device: &Self::Device) -> Result<(), String> {
        B::fused_cross_entropy_check(logits, labels, device)
    }

    /// The recorded operations behind `tensor` run first (launched, not waited for), then
    /// the wrapped backend queues the copy.
    fn queue_read(tensor: FloatTensor<Self>) -> QueuedRead {
        let client = tensor.client.clone();
        B::queue_read(client.resolve_tensor_float::<B>(tensor))
    }

    /// Fusion's `from_data` hands the bytes to the wrapped backend as they are.
    fn pin_for_upload(data: TensorData, device: &Self::Device) -> TensorData {
        B::pin_for_upload(data, device)
    }

    fn device_memory(device: &Self::Device) -> Option<crate::capabilities::DeviceMemory> {
        B::device_memory(device)
    }
}
