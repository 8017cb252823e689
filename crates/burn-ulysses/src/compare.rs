//! Comparing results with a reference (tests, `sp_check`, the NCCL check).
//!
//! A NaN or an infinity is always a failure, never a small difference: `f32::max` returns the
//! other operand when one is NaN, so a maximum folded with it reports 0 for an all-NaN result.
//! These helpers return `f32::INFINITY` instead, which fails every tolerance.

/// Largest `|actual - expected|`, or `f32::INFINITY` when either side holds a NaN or an
/// infinity. Panics when the lengths differ.
pub fn max_abs_diff(actual: &[f32], expected: &[f32]) -> f32 {
    assert_eq!(actual.len(), expected.len(), "compared tensors have different sizes");
    worst(actual.iter().zip(expected).map(|(a, e)| (a - e).abs()))
}

/// The largest of `differences` (0 when empty), or `f32::INFINITY` when any is NaN or
/// infinite.
pub fn worst(differences: impl IntoIterator<Item = f32>) -> f32 {
    differences.into_iter().fold(0.0, |worst, d| if d.is_finite() { worst.max(d) } else { f32::INFINITY })
}

/// `Ok("ok   {name} (max |Δ| ..)")` when `got` matches `want` within `tolerance`, else an
/// error that says by how much (or that the lengths differ).
pub fn check_within(name: &str, got: &[f32], want: &[f32], tolerance: f32) -> Result<String, String> {
    if got.len() != want.len() {
        return Err(format!("{name}: {} values, expected {}", got.len(), want.len()));
    }
    let diff = max_abs_diff(got, want);
    if diff > tolerance {
        return Err(format!("{name}: max |Δ| {diff:e} exceeds {tolerance:e} (infinite when a value is NaN or infinite)"));
    }
    Ok(format!("ok   {name} (max |Δ| {diff:.1e})"))
}

/// Panics, naming `what` and both values, unless `difference` is within `tolerance`.
#[track_caller]
pub fn assert_within(what: &str, difference: f32, tolerance: f32) {
    assert!(
        difference <= tolerance,
        "{what}: max |Δ| {difference:e} exceeds the tolerance {tolerance:e} (infinite when a value is NaN or infinite)"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_values_differ_by_zero_and_differences_are_maximal() {
        assert_eq!(max_abs_diff(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert_eq!(max_abs_diff(&[1.0, 2.0, 3.0], &[1.5, 2.0, 2.0]), 1.0);
    }

    #[test]
    fn any_nan_or_infinity_is_an_infinite_difference() {
        let nan = f32::NAN;
        assert_eq!(max_abs_diff(&[nan, nan], &[1.0, 2.0]), f32::INFINITY);
        assert_eq!(max_abs_diff(&[1.0, 2.0], &[1.0, nan]), f32::INFINITY);
        assert_eq!(max_abs_diff(&[nan], &[nan]), f32::INFINITY);
        assert_eq!(max_abs_diff(&[f32::INFINITY], &[f32::INFINITY]), f32::INFINITY);
        // A NaN first, then a finite value: the fold must not forget the NaN.
        assert_eq!(worst([nan, 0.5]), f32::INFINITY);
        assert_eq!(worst([0.5, nan]), f32::INFINITY);
        // What the old helper did: f32::max drops the NaN.
        assert_eq!([nan, nan].into_iter().fold(0.0, f32::max), 0.0);
    }

    #[test]
    #[should_panic(expected = "exceeds the tolerance")]
    fn an_all_nan_result_fails_a_tolerance() {
        assert_within("output", max_abs_diff(&[f32::NAN; 4], &[0.0; 4]), 1e-5);
    }
}
