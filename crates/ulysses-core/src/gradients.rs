//! The rules of a gradient all-reduce, for every Burn version: which parameters travel, and
//! in which buckets.
//!
//! Reducing each parameter on its own would cost one collective per tensor (hundreds per
//! step); concatenating all of them into one buffer would hold a second copy of every
//! gradient. Buckets of at most [`GRADIENT_BUCKET_BYTES`] (like PyTorch DDP's) bound the extra
//! memory to one bucket and the collectives to `total / bucket` calls.
//!
//! Parameters are taken in module order (parameter ids differ between ranks). A parameter that
//! has a gradient on any rank gets the sum on every rank, ranks without one contributing zeros;
//! one without a gradient anywhere (frozen) is left out. So all ranks issue the same
//! collectives.

use crate::comm::HostDType;

/// Default bucket size of a gradient all-reduce.
pub const GRADIENT_BUCKET_BYTES: usize = 32 * 1024 * 1024;

/// Which parameters have a gradient on some rank, from every rank's presence flags (one per
/// parameter, 1 for present, as gathered by `all_gather_host`).
pub fn present_anywhere(every_rank: &[Vec<u64>], parameters: usize) -> Vec<bool> {
    (0..parameters).map(|i| every_rank.iter().any(|flags| flags[i] == 1)).collect()
}

/// What a rank reports of one parameter's gradient before a sum whose gradients may differ in
/// dtype from their parameters (a half-precision copy's summed in f32): 0 where it has none,
/// else 1 + its dtype's [`HostDType::code`].
pub fn gradient_report(dtype: Option<HostDType>) -> u64 {
    dtype.map_or(0, |dtype| 1 + dtype.code() as u64)
}

/// Each parameter's gradient dtype over every rank, from every rank's [`gradient_report`]s (as
/// gathered by `all_gather_host`): `None` where no rank has one, and the dtype of the zeros a
/// rank without one sends. Refused where two ranks' gradients of one parameter differ in dtype
/// (their bytes could not be summed), naming the parameter's index and the two dtypes.
pub fn gradient_dtypes(every_rank: &[Vec<u64>], parameters: usize) -> Result<Vec<Option<HostDType>>, String> {
    (0..parameters)
        .map(|i| {
            let mut reported = every_rank.iter().map(|reports| reports[i]).filter(|&report| report != 0);
            let Some(first) = reported.next() else { return Ok(None) };
            let dtype = |report: u64| u8::try_from(report - 1).ok().and_then(HostDType::from_code).ok_or_else(|| format!("parameter {i}: a gradient dtype code {report} no rank sends"));
            match reported.find(|&other| other != first) {
                Some(other) => Err(format!("parameter {i}'s gradient is {:?} on one rank and {:?} on another: every rank must sum its gradients in one dtype", dtype(first)?, dtype(other)?)),
                None => dtype(first).map(Some),
            }
        })
        .collect()
}

/// Buckets of parameter indices: consecutive parameters present on some rank, of one dtype,
/// at most `bucket_bytes` together unless a single parameter is larger. `sizes` are each
/// parameter's gradient bytes and dtype.
pub fn plan_buckets<D: PartialEq + Copy>(sizes: &[(usize, D)], present_anywhere: &[bool], bucket_bytes: usize) -> Vec<Vec<usize>> {
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut current_bytes = 0;
    for (i, &(bytes, dtype)) in sizes.iter().enumerate().filter(|&(i, _)| present_anywhere[i]) {
        let same_dtype = current.first().is_none_or(|&first| sizes[first].1 == dtype);
        if !current.is_empty() && (!same_dtype || current_bytes + bytes > bucket_bytes) {
            buckets.push(std::mem::take(&mut current));
            current_bytes = 0;
        }
        current.push(i);
        current_bytes += bytes;
    }
    if !current.is_empty() {
        buckets.push(current);
    }
    buckets
}

#[cfg(test)]
mod tests {
    use super::*;

    const F32: &str = "f32";

    #[test]
    fn buckets_fill_up_to_the_cap_and_keep_order() {
        let sizes = [(40, F32), (40, F32), (30, F32), (100, F32), (10, F32)];
        assert_eq!(plan_buckets(&sizes, &[true; 5], 100), vec![vec![0, 1], vec![2], vec![3], vec![4]]);
        assert_eq!(plan_buckets(&sizes, &[true; 5], 1 << 20), vec![vec![0, 1, 2, 3, 4]]);
    }

    #[test]
    fn a_parameter_larger_than_the_cap_travels_alone() {
        let sizes = [(10, F32), (500, F32), (10, F32)];
        assert_eq!(plan_buckets(&sizes, &[true; 3], 100), vec![vec![0], vec![1], vec![2]]);
    }

    #[test]
    fn dtypes_never_share_a_bucket_and_absent_gradients_are_left_out() {
        let sizes = [(4, F32), (2, "bf16"), (2, "bf16"), (4, F32), (4, F32)];
        let present = [true, true, true, false, true];
        assert_eq!(plan_buckets(&sizes, &present, 1 << 20), vec![vec![0], vec![1, 2], vec![4]]);
    }

    #[test]
    fn a_gradient_takes_the_dtype_any_rank_reports_and_ranks_must_agree() {
        let (f32, bf16) = (gradient_report(Some(HostDType::F32)), gradient_report(Some(HostDType::BF16)));
        assert_eq!(gradient_dtypes(&[vec![f32, 0, bf16], vec![0, 0, bf16]], 3), Ok(vec![Some(HostDType::F32), None, Some(HostDType::BF16)]));
        let refused = gradient_dtypes(&[vec![0, f32], vec![0, 0], vec![0, bf16]], 2).unwrap_err();
        assert!(refused.contains("parameter 1") && refused.contains("F32") && refused.contains("BF16"), "{refused}");
        assert!(gradient_dtypes(&[vec![99]], 1).unwrap_err().contains("code 99"));
    }

    #[test]
    fn a_gradient_on_any_rank_counts() {
        assert_eq!(present_anywhere(&[vec![1, 0, 0], vec![0, 0, 1]], 3), vec![true, false, true]);
    }
}
