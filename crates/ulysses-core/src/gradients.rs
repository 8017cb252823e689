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

/// Default bucket size of a gradient all-reduce.
pub const GRADIENT_BUCKET_BYTES: usize = 32 * 1024 * 1024;

/// Which parameters have a gradient on some rank, from every rank's presence flags (one per
/// parameter, 1 for present, as gathered by `all_gather_host`).
pub fn present_anywhere(every_rank: &[Vec<u64>], parameters: usize) -> Vec<bool> {
    (0..parameters).map(|i| every_rank.iter().any(|flags| flags[i] == 1)).collect()
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
    fn a_gradient_on_any_rank_counts() {
        assert_eq!(present_anywhere(&[vec![1, 0, 0], vec![0, 0, 1]], 3), vec![true, false, true]);
    }
}
