//! `TensorPrimitive<Inner>` and `TensorPrimitive<UlyssesBackend<Inner>>` hold the same
//! primitives but are different types. The generated forwarding code converts between them
//! with [`Rebrand`]; a conversion only moves fields.

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

pub(crate) trait Rebrand<T> {
    fn rebrand(self) -> T;
}

impl<I: ExchangeBackend> Rebrand<TensorPrimitive<UlyssesBackend<I>>> for TensorPrimitive<I> {
    fn rebrand(self) -> TensorPrimitive<UlyssesBackend<I>> {
        match self {
            TensorPrimitive::Float(t) => TensorPrimitive::Float(t),
            TensorPrimitive::QFloat(t) => TensorPrimitive::QFloat(t),
        }
    }
}

impl<I: ExchangeBackend> Rebrand<TensorPrimitive<I>> for TensorPrimitive<UlyssesBackend<I>> {
    fn rebrand(self) -> TensorPrimitive<I> {
        match self {
            TensorPrimitive::Float(t) => TensorPrimitive::Float(t),
            TensorPrimitive::QFloat(t) => TensorPrimitive::QFloat(t),
        }
    }
}

impl<I: ExchangeBackend> Rebrand<TransactionPrimitive<I>>
    for TransactionPrimitive<UlyssesBackend<I>>
{
    fn rebrand(self) -> TransactionPrimitive<I> {
        // The read order is kept by the caller's transaction, not by the primitive passed to
        // `tr_execute`, so rebuilding it from the four lists loses nothing.
        TransactionPrimitive::new(self.read_floats, self.read_qfloats, self.read_ints, self.read_bools)
    }
}

/// Both directions of a struct whose fields are all primitives.
macro_rules! rebrand_struct {
    ($name:ident { $($field:ident),* }) => {
        impl<I: ExchangeBackend> Rebrand<$name<UlyssesBackend<I>>> for $name<I> {
            fn rebrand(self) -> $name<UlyssesBackend<I>> {
                $name { $($field: self.$field),* }
            }
        }
        impl<I: ExchangeBackend> Rebrand<$name<I>> for $name<UlyssesBackend<I>> {
            fn rebrand(self) -> $name<I> {
                $name { $($field: self.$field),* }
            }
        }
    };
}

rebrand_struct!(MaxPool1dWithIndices { output, indices });
rebrand_struct!(MaxPool2dWithIndices { output, indices });
rebrand_struct!(MaxPool1dBackward { x_grad });
rebrand_struct!(MaxPool2dBackward { x_grad });
rebrand_struct!(DeformConv2dBackward { x_grad, offset_grad, weight_grad, mask_grad, bias_grad });
rebrand_struct!(Conv2dBackward { x_grad, weights_grad, bias_grad });
rebrand_struct!(Conv3dBackward { x_grad, weights_grad, bias_grad });
rebrand_struct!(QuantizationParametersPrimitive { scales });
