//! Names used by the generated forwarding impls in `forward/`: the signatures there are
//! copied from burn-backend's trait definitions, so they use burn-backend's type names.

pub(super) use core::{future::Future, ops::Range};

pub(super) use burn::tensor::{
    BoolDType, Distribution, FloatDType, IndexingUpdateOp, IntDType, Scalar, Shape, Slice,
    TensorData, TensorPrimitive,
    backend::ExecutionError,
    ops::*,
    quantization::{QuantScheme, QuantizationParametersPrimitive},
};

pub(super) use super::{UlyssesBackend, convert_primitives::ConvertPrimitives};
pub(super) use crate::capabilities::ExchangeBackend;
