//! Tensors as host bytes, and the element-wise reductions of an all-reduce on them.

use burn::tensor::{
    DType, Shape, TensorData, TensorMetadata, bf16, f16,
    backend::Backend,
    ops::FloatTensor,
};
use burn_ulysses::comm::{Collective, CommError, ReduceOp};

/// A float tensor copied to host memory.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl HostTensor {
    /// Copies `tensor` to the host (waiting for the work that computes it).
    pub fn read<W: Backend>(tensor: FloatTensor<W>, op: Collective) -> Result<Self, CommError> {
        let shape = tensor.shape().to_vec();
        let data = burn::tensor::try_read_sync(W::float_into_data(tensor))
            .ok_or_else(|| backend_error(op, "this platform cannot read tensors synchronously".into()))?
            .map_err(|e| backend_error(op, format!("cannot read the tensor: {e:?}")))?;
        let dtype = data.dtype;
        element_size(dtype, op)?;
        Ok(Self { dtype, shape, bytes: data.into_bytes().to_vec() })
    }

    /// Uploads to `device` as a tensor of this dtype and shape.
    pub fn upload<W: Backend>(self, device: &W::Device) -> FloatTensor<W> {
        W::float_from_data(TensorData::from_bytes_vec(self.bytes, Shape::from(self.shape), self.dtype), device)
    }

    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// `[dtype, rank, dims..., bytes...]`: a message that says what it holds.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(2 + 8 * self.shape.len() + self.bytes.len());
        out.push(dtype_code(self.dtype));
        out.push(self.shape.len() as u8);
        for &dim in &self.shape {
            out.extend((dim as u64).to_le_bytes());
        }
        out.extend_from_slice(&self.bytes);
        out
    }

    pub fn decode(message: &[u8], op: Collective) -> Result<Self, CommError> {
        let invalid = || CommError::InvalidArgument { op, reason: "a peer sent a malformed tensor message".into() };
        let (&code, rest) = message.split_first().ok_or_else(invalid)?;
        let (&rank, rest) = rest.split_first().ok_or_else(invalid)?;
        let dims_len = 8 * rank as usize;
        if rest.len() < dims_len {
            return Err(invalid());
        }
        let shape: Vec<usize> = rest[..dims_len].chunks_exact(8).map(|b| u64::from_le_bytes(b.try_into().unwrap()) as usize).collect();
        let dtype = dtype_from_code(code).ok_or_else(invalid)?;
        let bytes = rest[dims_len..].to_vec();
        if shape.iter().product::<usize>() * element_size(dtype, op)? != bytes.len() {
            return Err(invalid());
        }
        Ok(Self { dtype, shape, bytes })
    }
}

fn backend_error(op: Collective, message: String) -> CommError {
    CommError::Backend(format!("{op}: {message}"))
}

/// Bytes per element of the float dtypes the transport carries.
pub fn element_size(dtype: DType, op: Collective) -> Result<usize, CommError> {
    match dtype {
        DType::F64 => Ok(8),
        DType::F32 | DType::Flex32 => Ok(4),
        DType::F16 | DType::BF16 => Ok(2),
        other => Err(CommError::InvalidArgument { op, reason: format!("tensors of {other:?} cannot be exchanged; use f64, f32, f16 or bf16") }),
    }
}

/// The one-byte code of a float dtype in messages.
pub fn dtype_code(dtype: DType) -> u8 {
    match dtype {
        DType::F64 => 0,
        DType::F32 => 1,
        DType::Flex32 => 2,
        DType::F16 => 3,
        DType::BF16 => 4,
        _ => u8::MAX,
    }
}

fn dtype_from_code(code: u8) -> Option<DType> {
    Some(match code {
        0 => DType::F64,
        1 => DType::F32,
        2 => DType::Flex32,
        3 => DType::F16,
        4 => DType::BF16,
        _ => return None,
    })
}

/// A float element type reduced on the host.
trait Element: Copy {
    const SIZE: usize;
    fn load(bytes: &[u8]) -> f64;
    fn store(value: f64, bytes: &mut [u8]);
}

macro_rules! element {
    ($t:ty, $size:expr, $to:expr, $from:expr) => {
        impl Element for $t {
            const SIZE: usize = $size;
            fn load(bytes: &[u8]) -> f64 {
                $to(<$t>::from_le_bytes(bytes.try_into().unwrap()))
            }
            fn store(value: f64, bytes: &mut [u8]) {
                bytes.copy_from_slice(&$from(value).to_le_bytes());
            }
        }
    };
}
element!(f64, 8, |v: f64| v, |v: f64| v);
element!(f32, 4, f64::from, |v: f64| v as f32);
element!(f16, 2, f16::to_f64, f16::from_f64);
element!(bf16, 2, bf16::to_f64, bf16::from_f64);

/// Reduces `parts` (equally long byte slices of `dtype` elements) element by element, in
/// the order given, into a new buffer. For f32 and f64 each step rounds to the element type,
/// exactly as `a + b` on the device would; f16 and bf16 are summed in f64 and rounded once.
/// A NaN in any part makes the result NaN (also for `Max`).
pub fn reduce(parts: &[&[u8]], dtype: DType, op: ReduceOp) -> Vec<u8> {
    match dtype {
        DType::F64 => reduce_as::<f64>(parts, op, false),
        DType::F32 | DType::Flex32 => reduce_as::<f32>(parts, op, false),
        DType::F16 => reduce_as::<f16>(parts, op, true),
        DType::BF16 => reduce_as::<bf16>(parts, op, true),
        other => unreachable!("element_size refused {other:?} before any reduction"),
    }
}

fn reduce_as<E: Element>(parts: &[&[u8]], op: ReduceOp, widen: bool) -> Vec<u8> {
    let count = parts.len();
    let mut out = vec![0u8; parts[0].len()];
    for (i, slot) in out.chunks_exact_mut(E::SIZE).enumerate() {
        let at = |part: &&[u8]| E::load(&part[i * E::SIZE..(i + 1) * E::SIZE]);
        let mut acc = at(&parts[0]);
        for part in &parts[1..] {
            let value = at(part);
            acc = match op {
                ReduceOp::Sum | ReduceOp::Mean => acc + value,
                ReduceOp::Max if acc.is_nan() || value.is_nan() => f64::NAN,
                ReduceOp::Max => acc.max(value),
            };
            if !widen {
                // Round after every addition, like the device's own element type.
                acc = round_trip::<E>(acc);
            }
        }
        if op == ReduceOp::Mean {
            acc /= count as f64;
        }
        E::store(acc, slot);
    }
    out
}

fn round_trip<E: Element>(value: f64) -> f64 {
    let mut bytes = [0u8; 8];
    E::store(value, &mut bytes[..E::SIZE]);
    E::load(&bytes[..E::SIZE])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    fn f32_values(bytes: &[u8]) -> Vec<f32> {
        bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
    }

    #[test]
    fn sums_round_like_the_device_and_keep_rank_order() {
        // (1e8 + 1) + 1 rounds twice in f32: 1e8; summed in f64 and rounded once it would be 1e8 + 2.
        let parts = [f32_bytes(&[1e8, 1.0]), f32_bytes(&[1.0, 2.0]), f32_bytes(&[1.0, 3.0])];
        let views: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        assert_eq!(f32_values(&reduce(&views, DType::F32, ReduceOp::Sum)), vec![((1e8f32 + 1.0) + 1.0), 6.0]);
        assert_eq!(f32_values(&reduce(&views, DType::F32, ReduceOp::Mean))[1], 2.0);
        assert_eq!(f32_values(&reduce(&views, DType::F32, ReduceOp::Max)), vec![1e8, 3.0]);
    }

    #[test]
    fn nan_survives_every_reduction() {
        let parts = [f32_bytes(&[f32::NAN]), f32_bytes(&[1.0])];
        let views: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
            assert!(f32_values(&reduce(&views, DType::F32, op))[0].is_nan(), "{op:?}");
        }
    }

    #[test]
    fn half_precision_sums() {
        let parts: Vec<Vec<u8>> = [1.5f32, 2.25].iter().map(|&v| bf16::from_f32(v).to_le_bytes().to_vec()).collect();
        let views: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        let sum = reduce(&views, DType::BF16, ReduceOp::Sum);
        assert_eq!(bf16::from_le_bytes(sum.try_into().unwrap()).to_f32(), 3.75);
    }

    #[test]
    fn tensor_messages_round_trip_and_refuse_garbage() {
        let tensor = HostTensor { dtype: DType::F32, shape: vec![2, 3], bytes: f32_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) };
        assert_eq!(HostTensor::decode(&tensor.encode(), Collective::AllGather).unwrap(), tensor);
        let mut cut = tensor.encode();
        cut.pop();
        assert!(HostTensor::decode(&cut, Collective::AllGather).is_err());
        assert!(HostTensor::decode(&[], Collective::AllGather).is_err());
    }
}
