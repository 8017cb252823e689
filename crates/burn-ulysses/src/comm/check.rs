//! A self-check of any communicator: every collective against the values it must produce.
//! The NCCL and TCP check binaries run it on real jobs; the tests run it on every transport.

use std::sync::Arc;

use burn::tensor::{DType, Shape, Tensor, TensorData, backend::Backend};

use super::{Communicator, ReduceOp};
use crate::{compare::check_within, primitive::as_rows};

/// What [`check_collectives`] exchanges besides small tensors.
#[derive(Debug, Clone, Copy)]
pub struct CheckSizes {
    /// Elements per rank of the large all-to-all and all-reduce (bounded frames, chunking).
    pub large_elements: usize,
}

impl Default for CheckSizes {
    fn default() -> Self {
        // 12 MiB of f32 per rank: several frames of any transport that cuts messages.
        Self { large_elements: 3 << 20 }
    }
}

// The half-precision checks' values: whole numbers, and sums over up to 128 ranks, below 256,
// which bf16 (8 significant bits) holds exactly in any order of addition. Values that grew
// with the rank count were rounded from 14 ranks on, a working transport reported broken.

/// Element `k` of the part rank `from` sends rank `to` in the half-precision all-to-all.
fn half_exchanged(from: usize, to: usize, k: usize) -> f32 {
    ((16 * from + 4 * to + k) % 256) as f32
}

/// Rank `rank`'s tensor in the half-precision all-reduce: sums `p`, and the odd ranks' count.
fn half_reduced(rank: usize) -> [f32; 3] {
    let odd = (rank % 2) as f32;
    [1.0, odd, -odd]
}

/// Part `part` of rank `rank`'s tensor in the half-precision reduce-scatter: the parts' sums
/// differ from their neighbours' (a part delivered one off fails).
fn half_scattered(rank: usize, part: usize) -> [f32; 2] {
    [(1 + part % 2) as f32, -((rank % 2) as f32)]
}

/// Runs every collective of `comm` (collective: every rank of the group calls it) and
/// returns one line per check, or the first mismatch. Values encode the sending rank and
/// position, so a slice delivered to the wrong rank or in the wrong order fails.
pub fn check_collectives<B: Backend>(comm: &dyn Communicator<B>, device: &B::Device, sizes: CheckSizes) -> Result<Vec<String>, String> {
    let mut report = Vec::new();
    let (r, p) = (comm.rank() as f32, comm.size());
    let tensor = |values: Vec<f32>, shape: Vec<usize>| {
        // f32 as written, not the device's default float (bf16 rounds the values past 256).
        let flat = Tensor::<B, 1>::from_data(TensorData::new(values, [shape.iter().product::<usize>()]), (device, burn::tensor::DType::F32));
        B::float_reshape(flat.into_primitive().tensor(), Shape::from(shape))
    };
    let host = |t| as_rows::<B>(t, 1).into_data().convert::<f32>().to_vec::<f32>().unwrap();
    let fail = |e: super::CommError| e.to_string();
    let check = |name: &str, got: Vec<f32>, want: Vec<f32>, tolerance: f32| check_within(name, &got, &want, tolerance);

    // Slice j of rank r holds 100 r + 10 j + k; afterwards slice i holds 100 i + 10 r + k.
    let send: Vec<f32> = (0..p).flat_map(|j| (0..3).map(move |k| 100.0 * r + 10.0 * j as f32 + k as f32)).collect();
    let got = host(comm.all_to_all(tensor(send, vec![p, 3])).map_err(fail)?);
    let want: Vec<f32> = (0..p).flat_map(|i| (0..3).map(move |k| 100.0 * i as f32 + 10.0 * r + k as f32)).collect();
    report.push(check("all_to_all", got, want, 0.0)?);

    // Uneven parts: rank r sends (r + j + 1) % 3 values to rank j (some empty), 1000 r + 10 j + k.
    let count = |from: usize, to: usize| (from + to + 1) % 3;
    let me = comm.rank();
    let send: Vec<f32> = (0..p).flat_map(|j| (0..count(me, j)).map(move |k| 1000.0 * r + 10.0 * j as f32 + k as f32)).collect();
    let (send_counts, recv_counts): (Vec<usize>, Vec<usize>) = (0..p).map(|j| (count(me, j), count(j, me))).unzip();
    let len = send.len();
    let got = host(comm.all_to_all_uneven(tensor(send, vec![len]), &send_counts, &recv_counts).map_err(fail)?);
    let want: Vec<f32> = (0..p).flat_map(|i| (0..count(i, me)).map(move |k| 1000.0 * i as f32 + 10.0 * r + k as f32)).collect();
    report.push(check("all_to_all_uneven", got, want, 0.0)?);

    let mine = || tensor(vec![r + 1.0, 2.0 * r, -r], vec![3]);
    let total: f32 = (1..=p).map(|i| i as f32).sum();
    let ranks_sum = total - p as f32;
    let got = host(comm.all_reduce(mine(), ReduceOp::Sum).map_err(fail)?);
    report.push(check("all_reduce sum", got, vec![total, 2.0 * ranks_sum, -ranks_sum], 1e-5)?);
    let got = host(comm.all_reduce(mine(), ReduceOp::Mean).map_err(fail)?);
    report.push(check("all_reduce mean", got, vec![total / p as f32, 2.0 * ranks_sum / p as f32, -ranks_sum / p as f32], 1e-5)?);
    let got = host(comm.all_reduce(mine(), ReduceOp::Max).map_err(fail)?);
    report.push(check("all_reduce max", got, vec![p as f32, 2.0 * (p as f32 - 1.0), 0.0], 0.0)?);
    let got = host(comm.all_gather(mine()).map_err(fail)?);
    let want: Vec<f32> = (0..p).flat_map(|i| [i as f32 + 1.0, 2.0 * i as f32, -(i as f32)]).collect();
    report.push(check("all_gather", got, want, 0.0)?);
    // Reduce-scatter: rank r gets part r of the reduction, all_reduce's there (values whose
    // f32 sum depends on the order: 1e8 beside small ones), and the maximum. Within the
    // rounding of another order of the ranks' sum: NCCL may reduce-scatter by a ring and
    // all-reduce by a tree (at 4 GPUs or more); the host transports agree bit for bit.
    let parts = 4;
    let spread = |r: f32| -> Vec<f32> { (0..parts * p).map(|i| 1e8 * (i % 3) as f32 + r + 0.25 * i as f32).collect() };
    let whole = host(comm.all_reduce(tensor(spread(r), vec![parts * p]), ReduceOp::Sum).map_err(fail)?);
    let got = host(comm.reduce_scatter(tensor(spread(r), vec![parts * p]), ReduceOp::Sum).map_err(fail)?);
    let order = (p - 1) as f32 * f32::EPSILON * whole.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    report.push(check("reduce_scatter sum: all_reduce's part", got, whole[me * parts..(me + 1) * parts].to_vec(), order)?);
    let got = host(comm.reduce_scatter(tensor(spread(r), vec![parts * p]), ReduceOp::Max).map_err(fail)?);
    report.push(check("reduce_scatter max", got, spread(p as f32 - 1.0)[me * parts..(me + 1) * parts].to_vec(), 0.0)?);
    let got = host(comm.reduce_scatter(tensor((0..p).flat_map(|_| [r, 2.0 * r]).collect(), vec![2 * p]), ReduceOp::Mean).map_err(fail)?);
    report.push(check("reduce_scatter mean", got, vec![ranks_sum / p as f32, 2.0 * ranks_sum / p as f32], 1e-6)?);
    for root in [0, p - 1] {
        let got = host(comm.broadcast(mine(), root).map_err(fail)?);
        report.push(check(&format!("broadcast from {root}"), got, vec![root as f32 + 1.0, 2.0 * root as f32, -(root as f32)], 0.0)?);
    }
    // A ring shift forward, as ring attention passes k/v: rank r receives rank r - 1's.
    let (next, previous) = ((comm.rank() + 1) % p, (comm.rank() + p - 1) % p);
    let got = host(comm.send_recv(mine(), next, previous).map_err(fail)?);
    let q = previous as f32;
    report.push(check("send_recv around the ring", got, vec![q + 1.0, 2.0 * q, -q], 0.0)?);
    comm.barrier().map_err(fail)?;
    let gathered = comm.all_gather_host(&[comm.rank() as u64, 7]).map_err(fail)?;
    if gathered != (0..p as u64).map(|i| vec![i, 7]).collect::<Vec<_>>() {
        return Err(format!("all_gather_host: {gathered:?}"));
    }
    report.push("ok   barrier, all_gather_host".into());

    // Large: many frames, and chunks of uneven length for a reduce-scatter.
    let n = sizes.large_elements / p * p + 1;
    let rows = n.div_ceil(p) * p;
    let large: Vec<f32> = (0..rows).map(|i| r * 1e-3 + (i % 1000) as f32).collect();
    let got = host(comm.all_to_all(tensor(large, vec![p, rows / p])).map_err(fail)?);
    let want: Vec<f32> = (0..p).flat_map(|i| ((comm.rank() * rows / p)..((comm.rank() + 1) * rows / p)).map(move |x| i as f32 * 1e-3 + (x % 1000) as f32)).collect();
    report.push(check(&format!("all_to_all of {} MiB", rows * 4 >> 20), got, want, 0.0)?);
    let values: Vec<f32> = (0..n).map(|i| (i % 97) as f32 + r).collect();
    let got = host(comm.all_reduce(tensor(values, vec![n]), ReduceOp::Sum).map_err(fail)?);
    let want: Vec<f32> = (0..n).map(|i| (i % 97) as f32 * p as f32 + ranks_sum).collect();
    report.push(check(&format!("all_reduce of {n} elements"), got, want, 1e-3)?);
    let n = sizes.large_elements / p * p;
    let values: Vec<f32> = (0..n).map(|i| (i % 97) as f32 + r).collect();
    let got = host(comm.reduce_scatter(tensor(values, vec![n]), ReduceOp::Sum).map_err(fail)?);
    let want: Vec<f32> = (me * n / p..(me + 1) * n / p).map(|i| (i % 97) as f32 * p as f32 + ranks_sum).collect();
    report.push(check(&format!("reduce_scatter of {n} elements"), got, want, 1e-3)?);

    // Half precision, as mixed-precision training exchanges it: the collectives must move
    // 2-byte elements of the dtype asked for (a transport that sent f32, or NCCL told another
    // type, gives other values or other bytes). bf16 where the device has it, else f16.
    match [DType::BF16, DType::F16].into_iter().find(|&dtype| B::supports_dtype(device, dtype)) {
        Some(dtype) => {
            let half = |values: Vec<f32>, shape: Vec<usize>| {
                let flat = Tensor::<B, 1>::from_data(TensorData::new(values, [shape.iter().product::<usize>()]).convert_dtype(dtype), (device, dtype));
                B::float_reshape(flat.into_primitive().tensor(), Shape::from(shape))
            };
            let send: Vec<f32> = (0..p).flat_map(|j| (0..3).map(move |k| half_exchanged(me, j, k))).collect();
            let exchanged = comm.all_to_all(half(send, vec![p, 3])).map_err(fail)?;
            let got_dtype = burn::tensor::TensorMetadata::dtype(&exchanged);
            let got = host(exchanged);
            let want: Vec<f32> = (0..p).flat_map(|i| (0..3).map(move |k| half_exchanged(i, me, k))).collect();
            if got_dtype != dtype {
                return Err(format!("all_to_all of {dtype:?} returned {got_dtype:?}"));
            }
            report.push(check(&format!("all_to_all in {dtype:?}"), got, want, 0.0)?);
            let sum_over_ranks = |value: &dyn Fn(usize) -> f32| (0..p).map(value).sum::<f32>();
            let got = host(comm.all_reduce(half(half_reduced(me).to_vec(), vec![3]), ReduceOp::Sum).map_err(fail)?);
            let want = (0..3).map(|i| sum_over_ranks(&|rank| half_reduced(rank)[i])).collect();
            report.push(check(&format!("all_reduce sum in {dtype:?}"), got, want, 0.0)?);
            let reduced = comm.reduce_scatter(half((0..p).flat_map(|j| half_scattered(me, j)).collect(), vec![2 * p]), ReduceOp::Sum).map_err(fail)?;
            let got_dtype = burn::tensor::TensorMetadata::dtype(&reduced);
            if got_dtype != dtype {
                return Err(format!("reduce_scatter of {dtype:?} returned {got_dtype:?}"));
            }
            let want = (0..2).map(|i| sum_over_ranks(&|rank| half_scattered(rank, me)[i])).collect();
            report.push(check(&format!("reduce_scatter sum in {dtype:?}"), host(reduced), want, 0.0)?);
        }
        None => report.push("skip all_to_all and all_reduce in bf16/f16: the device has neither".into()),
    }

    // Sub-groups: even and odd ranks, the order reversed by the key.
    let sub: Arc<dyn Communicator<B>> = comm.split(comm.rank() as u32 % 2, (p - comm.rank()) as u32).map_err(fail)?;
    let members: Vec<usize> = (0..p).filter(|i| i % 2 == comm.rank() % 2).collect();
    let expected_rank = members.len() - 1 - members.iter().position(|&i| i == comm.rank()).unwrap();
    if (sub.rank(), sub.size()) != (expected_rank, members.len()) {
        return Err(format!("split: rank {} of {}, expected {expected_rank} of {}", sub.rank(), sub.size(), members.len()));
    }
    let got = host(sub.all_reduce(mine(), ReduceOp::Sum).map_err(fail)?);
    let sum: f32 = members.iter().map(|&i| i as f32).sum();
    report.push(check("split, then all_reduce in the sub-group", got, vec![sum + members.len() as f32, 2.0 * sum, -sum], 1e-5)?);
    let gathered = sub.all_gather_host(&[comm.rank() as u64]).map_err(fail)?;
    let want: Vec<Vec<u64>> = members.iter().rev().map(|&i| vec![i as u64]).collect();
    if gathered != want {
        return Err(format!("all_gather_host in the sub-group: {gathered:?}, expected {want:?}"));
    }
    report.push("ok   sub-group order".into());
    Ok(report)
}

#[cfg(test)]
mod tests {
    use burn::tensor::{bf16, f16};

    use super::{half_exchanged, half_reduced, half_scattered};

    /// Sums `values` in order, each partial sum rounded to bf16 (as NCCL's ring keeps them).
    fn bf16_sum(values: impl Iterator<Item = f32>) -> f32 {
        values.fold(0.0, |sum, value| bf16::from_f32(sum + value).to_f32())
    }

    /// The half-precision checks' values, and their sums over the ranks in bf16, are exact for
    /// groups of up to 128 ranks (the self-check compares them with tolerance 0): from 14 ranks
    /// on, the earlier values (16 r + 4 j + k) were not, and the check failed a working NCCL.
    /// Runs on the CPU, where no backend here computes in bf16 (the check itself skips there).
    #[test]
    fn the_half_precision_values_and_their_sums_are_exact_up_to_128_ranks() {
        let exact = |value: f32| bf16::from_f32(value).to_f32() == value && f16::from_f32(value).to_f32() == value;
        for p in 1..=128 {
            for from in 0..p {
                for to in 0..p {
                    assert!((0..3).all(|k| exact(half_exchanged(from, to, k))), "{p} ranks: {from} to {to}");
                }
            }
            for i in 0..3 {
                let want: f32 = (0..p).map(|rank| half_reduced(rank)[i]).sum();
                assert_eq!(bf16_sum((0..p).map(|rank| half_reduced(rank)[i])), want, "{p} ranks: all_reduce element {i}");
            }
            for part in 0..p {
                for i in 0..2 {
                    let want: f32 = (0..p).map(|rank| half_scattered(rank, part)[i]).sum();
                    assert_eq!(bf16_sum((0..p).map(|rank| half_scattered(rank, part)[i])), want, "{p} ranks: part {part} element {i}");
                }
                if part > 0 {
                    assert_ne!(half_scattered(0, part), half_scattered(0, part - 1), "neighbouring parts must differ");
                }
            }
        }
    }
}
