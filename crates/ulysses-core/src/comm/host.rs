//! Collectives on host memory: the transports' contract, the same for every Burn version.
//!
//! A [`HostCommunicator`] moves [`HostTensor`]s (a dtype, a shape and little-endian bytes)
//! between the ranks of a group. The TCP transport (`ulysses_dist::tcp`) and the in-process group
//! ([`ThreadCommunicator`](super::ThreadCommunicator)) implement it; each Burn version turns
//! its tensors into host tensors and back (burn 0.21: `burn_ulysses::comm::HostStaged`; burn
//! 0.22: `burn-ulysses-ops`'s exchange and gradient sum). Device-resident transports (NCCL)
//! move a backend's own buffers instead and sit beside this, in the crates of their Burn
//! version.

use std::sync::Arc;

use half::{bf16, f16};

use super::{Collective, CommError, ReduceOp, Traffic};

/// Element types a host tensor can hold: the float dtypes of both Burn versions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HostDType {
    F64,
    F32,
    /// burn 0.21's `Flex32`: stored as f32.
    Flex32,
    F16,
    BF16,
}

impl HostDType {
    const ALL: [HostDType; 5] = [HostDType::F64, HostDType::F32, HostDType::Flex32, HostDType::F16, HostDType::BF16];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            HostDType::F64 => 8,
            HostDType::F32 | HostDType::Flex32 => 4,
            HostDType::F16 | HostDType::BF16 => 2,
        }
    }

    /// The one-byte code of this dtype in messages.
    pub fn code(self) -> u8 {
        Self::ALL.iter().position(|&d| d == self).unwrap() as u8
    }

    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get(code as usize).copied()
    }
}

/// `host_dtype` and `burn_dtype`: a Burn version's `DType` (burn 0.21's and 0.22's have the
/// same float variants) to [`HostDType`] and back. Each Burn crate calls it with its `DType`.
#[macro_export]
macro_rules! host_dtype_conversions {
    ($dtype:ty) => {
        /// The host dtype of a burn float dtype, or the error naming the ones a transport
        /// carries.
        pub fn host_dtype(dtype: $dtype, op: $crate::comm::Collective) -> Result<$crate::comm::HostDType, $crate::comm::CommError> {
            type D = $dtype;
            Ok(match dtype {
                D::F64 => $crate::comm::HostDType::F64,
                D::F32 => $crate::comm::HostDType::F32,
                D::Flex32 => $crate::comm::HostDType::Flex32,
                D::F16 => $crate::comm::HostDType::F16,
                D::BF16 => $crate::comm::HostDType::BF16,
                other => {
                    return Err($crate::comm::CommError::InvalidArgument {
                        op,
                        reason: format!("tensors of {other:?} cannot be exchanged; use f64, f32, f16 or bf16"),
                    });
                }
            })
        }

        /// The burn dtype of a host dtype.
        pub fn burn_dtype(dtype: $crate::comm::HostDType) -> $dtype {
            type D = $dtype;
            match dtype {
                $crate::comm::HostDType::F64 => D::F64,
                $crate::comm::HostDType::F32 => D::F32,
                $crate::comm::HostDType::Flex32 => D::Flex32,
                $crate::comm::HostDType::F16 => D::F16,
                $crate::comm::HostDType::BF16 => D::BF16,
            }
        }
    };
}

/// A tensor in host memory: `bytes` holds `shape`'s elements of `dtype`, little-endian, in
/// row-major order.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub dtype: HostDType,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl HostTensor {
    /// A tensor of `shape` from `bytes`, refused (naming `op`) when they do not match.
    pub fn new(dtype: HostDType, shape: Vec<usize>, bytes: Vec<u8>, op: Collective) -> Result<Self, CommError> {
        let expected = shape.iter().product::<usize>() * dtype.size();
        if expected != bytes.len() {
            return Err(CommError::InvalidArgument { op, reason: format!("{} bytes do not hold a {dtype:?} tensor of shape {shape:?} ({expected} bytes)", bytes.len()) });
        }
        Ok(Self { dtype, shape, bytes })
    }

    /// f64 values as a 1-D tensor.
    pub fn from_f64(values: &[f64]) -> Self {
        Self { dtype: HostDType::F64, shape: vec![values.len()], bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect() }
    }

    /// The elements as f64 (any dtype, widened exactly).
    pub fn to_f64(&self) -> Vec<f64> {
        let size = self.dtype.size();
        self.bytes.chunks_exact(size).map(|bytes| load(self.dtype, bytes)).collect()
    }

    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// `[dtype, rank, dims..., bytes...]`: a message that says what it holds.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(2 + 8 * self.shape.len() + self.bytes.len());
        out.push(self.dtype.code());
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
        let dtype = HostDType::from_code(code).ok_or_else(invalid)?;
        Self::new(dtype, shape, rest[dims_len..].to_vec(), op).map_err(|_| invalid())
    }
}

/// Collectives of one rank within a group, on host tensors. Blocking; every rank of the group
/// must call the same collectives in the same order. Reductions are computed in rank order,
/// so every rank receives the same bits.
pub trait HostCommunicator: Send + Sync + 'static {
    /// This rank's index in the group, `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// `parts[j]` goes to rank `j`; returns what every rank sent this one, in rank order.
    /// Parts may differ in shape (uneven heads), never in dtype.
    fn all_to_all(&self, parts: Vec<HostTensor>) -> Result<Vec<HostTensor>, CommError>;
    /// Element-wise reduction over all ranks (same shape and dtype everywhere).
    fn all_reduce(&self, tensor: HostTensor, op: ReduceOp) -> Result<HostTensor, CommError>;
    /// Every rank's tensor (same shape and dtype everywhere), in rank order.
    fn all_gather(&self, tensor: HostTensor) -> Result<Vec<HostTensor>, CommError>;
    /// This rank's part of the element-wise reduction over all ranks: a 1-D tensor of `n`
    /// elements (`n` a multiple of the group size, the same everywhere) reduced, rank `r`
    /// receiving elements `r·n/P..(r+1)·n/P`, bit for bit that part of [`all_reduce`]'s result.
    ///
    /// [`all_reduce`]: HostCommunicator::all_reduce
    fn reduce_scatter(&self, tensor: HostTensor, op: ReduceOp) -> Result<HostTensor, CommError>;
    /// Every rank receives `root`'s tensor; the others pass one of the same shape and dtype.
    fn broadcast(&self, tensor: HostTensor, root: usize) -> Result<HostTensor, CommError>;
    /// Sends `tensor` to rank `to` and returns what rank `from` sent (see
    /// [`check_send_recv`](super::check_send_recv) for the rules).
    fn send_recv(&self, tensor: HostTensor, to: usize, from: usize) -> Result<HostTensor, CommError>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<(), CommError>;
    /// A few integers from every rank (shapes, counts), in rank order.
    fn all_gather_host(&self, values: &[u64]) -> Result<Vec<Vec<u64>>, CommError>;
    /// Splits the group like `MPI_Comm_split`: ranks passing the same `color` form a new
    /// group, ordered by `key` (then by rank).
    fn split(&self, color: u32, key: u32) -> Result<Arc<dyn HostCommunicator>, CommError>;
    /// Bytes this rank has handed to each collective so far.
    fn traffic(&self) -> Traffic;
}

/// Fails unless `parts` has one part per rank of a group of `size`, all of one dtype.
pub fn check_parts(parts: &[HostTensor], size: usize) -> Result<(), CommError> {
    let invalid = |reason: String| Err(CommError::InvalidArgument { op: Collective::AllToAll, reason });
    if parts.len() != size {
        return invalid(format!("{} parts for a group of {size} ranks: one part per rank", parts.len()));
    }
    if let Some(part) = parts.iter().find(|part| part.dtype != parts[0].dtype) {
        return invalid(format!("parts of {:?} and {:?}: every part must have the same dtype", parts[0].dtype, part.dtype));
    }
    Ok(())
}

/// The error every member returns when rank `peer` passed a tensor that does not fit this
/// rank's (`what` says how).
pub fn mismatched(op: Collective, peer: usize, what: String) -> CommError {
    CommError::InvalidArgument { op, reason: format!("rank {peer} of this group passed {what}; every rank must pass the same shape and dtype") }
}

fn load(dtype: HostDType, bytes: &[u8]) -> f64 {
    match dtype {
        HostDType::F64 => f64::from_le_bytes(bytes.try_into().unwrap()),
        HostDType::F32 | HostDType::Flex32 => f64::from(f32::from_le_bytes(bytes.try_into().unwrap())),
        HostDType::F16 => f16::from_le_bytes(bytes.try_into().unwrap()).to_f64(),
        HostDType::BF16 => bf16::from_le_bytes(bytes.try_into().unwrap()).to_f64(),
    }
}

fn store(dtype: HostDType, value: f64, bytes: &mut [u8]) {
    match dtype {
        HostDType::F64 => bytes.copy_from_slice(&value.to_le_bytes()),
        HostDType::F32 | HostDType::Flex32 => bytes.copy_from_slice(&(value as f32).to_le_bytes()),
        HostDType::F16 => bytes.copy_from_slice(&f16::from_f64(value).to_le_bytes()),
        HostDType::BF16 => bytes.copy_from_slice(&bf16::from_f64(value).to_le_bytes()),
    }
}

/// Reduces `parts` (equally long byte slices of `dtype` elements) element by element, in
/// the order given, into a new buffer. For f32 and f64 each step rounds to the element type,
/// exactly as `a + b` on the device would; f16 and bf16 are summed in f64 and rounded once.
/// A NaN in any part makes the result NaN (also for `Max`).
pub fn reduce(parts: &[&[u8]], dtype: HostDType, op: ReduceOp) -> Vec<u8> {
    let size = dtype.size();
    let widen = matches!(dtype, HostDType::F16 | HostDType::BF16);
    let count = parts.len();
    let mut out = vec![0u8; parts[0].len()];
    for (i, slot) in out.chunks_exact_mut(size).enumerate() {
        let at = |part: &&[u8]| load(dtype, &part[i * size..(i + 1) * size]);
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
                store(dtype, acc, slot);
                acc = load(dtype, slot);
            }
        }
        if op == ReduceOp::Mean {
            acc /= count as f64;
        }
        store(dtype, acc, slot);
    }
    out
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
        assert_eq!(f32_values(&reduce(&views, HostDType::F32, ReduceOp::Sum)), vec![((1e8f32 + 1.0) + 1.0), 6.0]);
        assert_eq!(f32_values(&reduce(&views, HostDType::F32, ReduceOp::Mean))[1], 2.0);
        assert_eq!(f32_values(&reduce(&views, HostDType::F32, ReduceOp::Max)), vec![1e8, 3.0]);
    }

    #[test]
    fn nan_survives_every_reduction() {
        let parts = [f32_bytes(&[f32::NAN]), f32_bytes(&[1.0])];
        let views: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
            assert!(f32_values(&reduce(&views, HostDType::F32, op))[0].is_nan(), "{op:?}");
        }
    }

    #[test]
    fn half_precision_sums() {
        let parts: Vec<Vec<u8>> = [1.5f32, 2.25].iter().map(|&v| bf16::from_f32(v).to_le_bytes().to_vec()).collect();
        let views: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        let sum = reduce(&views, HostDType::BF16, ReduceOp::Sum);
        assert_eq!(bf16::from_le_bytes(sum.try_into().unwrap()).to_f32(), 3.75);
    }

    #[test]
    fn tensor_messages_round_trip_and_refuse_garbage() {
        let tensor = HostTensor { dtype: HostDType::F32, shape: vec![2, 3], bytes: f32_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) };
        assert_eq!(HostTensor::decode(&tensor.encode(), Collective::AllGather).unwrap(), tensor);
        let mut cut = tensor.encode();
        cut.pop();
        assert!(HostTensor::decode(&cut, Collective::AllGather).is_err());
        assert!(HostTensor::decode(&[], Collective::AllGather).is_err());
        assert!(HostTensor::new(HostDType::BF16, vec![3], vec![0; 4], Collective::AllGather).is_err());
    }
}
