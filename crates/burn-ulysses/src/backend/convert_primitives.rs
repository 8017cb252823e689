//! `TensorPrimitive<Inner>` and `TensorPrimitive<UlyssesBackend<Inner>>` hold the same
//! primitives but are different types. The generated forwarding code converts between them
//! with [`ConvertPrimitives`]; a conversion only moves fields.

use burn::tensor::{
    TensorPrimitive,
    ops::{
        Conv2dBackward, Conv3dBackward, DeformConv2dBackward, MaxPool1dBackward,
        MaxPool1dWithIndices, MaxPool2dBackward, MaxPool2dWithIndices, TransactionPrimitive,
    },
    quantization::QuantizationParametersPrimitive,
};

use super::UlyssesBackend;
use crate::capabilities::ExchangeBackend;

pub(crate) trait ConvertPrimitives<T> {
    fn convert(self) -> T;
}

impl<I: ExchangeBackend> ConvertPrimitives<TensorPrimitive<UlyssesBackend<I>>> for TensorPrimitive<I> {
    fn convert(self) -> TensorPrimitive<UlyssesBackend<I>> {
        match self {
            TensorPrimitive::Float(t) => TensorPrimitive::Float(t),
            TensorPrimitive::QFloat(t) => TensorPrimitive::QFloat(t),
        }
    }
}

impl<I: ExchangeBackend> ConvertPrimitives<TensorPrimitive<I>> for TensorPrimitive<UlyssesBackend<I>> {
    fn convert(self) -> TensorPrimitive<I> {
        match self {
            TensorPrimitive::Float(t) => TensorPrimitive::Float(t),
            TensorPrimitive::QFloat(t) => TensorPrimitive::QFloat(t),
        }
    }
}

impl<I: ExchangeBackend> ConvertPrimitives<TransactionPrimitive<I>>
    for TransactionPrimitive<UlyssesBackend<I>>
{
    fn convert(self) -> TransactionPrimitive<I> {
        // The read order is kept by the caller's transaction, not by the primitive passed to
        // `tr_execute`, so rebuilding it from the four lists loses nothing.
        TransactionPrimitive::new(self.read_floats, self.read_qfloats, self.read_ints, self.read_bools)
    }
}

/// Both directions of a struct whose fields are all primitives.
macro_rules! convert_struct {
    ($name:ident { $($field:ident),* }) => {
        impl<I: ExchangeBackend> ConvertPrimitives<$name<UlyssesBackend<I>>> for $name<I> {
            fn convert(self) -> $name<UlyssesBackend<I>> {
                $name { $($field: self.$field),* }
            }
        }
        impl<I: ExchangeBackend> ConvertPrimitives<$name<I>> for $name<UlyssesBackend<I>> {
            fn convert(self) -> $name<I> {
                $name { $($field: self.$field),* }
            }
        }
    };
}

convert_struct!(MaxPool1dWithIndices { output, indices });
convert_struct!(MaxPool2dWithIndices { output, indices });
convert_struct!(MaxPool1dBackward { x_grad });
convert_struct!(MaxPool2dBackward { x_grad });
convert_struct!(DeformConv2dBackward { x_grad, offset_grad, weight_grad, mask_grad, bias_grad });
convert_struct!(Conv2dBackward { x_grad, weights_grad, bias_grad });
convert_struct!(Conv3dBackward { x_grad, weights_grad, bias_grad });
convert_struct!(QuantizationParametersPrimitive { scales });
