//! Deterministic values, the same on every rank thread and in every test.

/// Values in [-1, 1) from a 64-bit LCG seeded by `stream`.
pub fn uniform(len: usize, stream: u64) -> Vec<f32> {
    let mut state = stream.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 40) as f64 / (1u64 << 24) as f64 * 2.0 - 1.0) as f32
        })
        .collect()
}
