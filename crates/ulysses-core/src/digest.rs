//! FNV-1a, the digest the checkpoints, the data's identity and the ranks' agreement checks use:
//! the same on every build and machine.

/// FNV-1a over several byte slices, as if concatenated.
pub fn fnv1a(parts: &[&[u8]]) -> u64 {
    parts.iter().fold(FNV1A_START, |hash, part| fnv1a_more(hash, part))
}

/// FNV-1a's hash before any byte.
pub const FNV1A_START: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a's `hash` so far, continued over `bytes` (a long input hashed piece by piece).
pub fn fnv1a_more(hash: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(hash, |hash, &b| (hash ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// Values of each float parameter that [`parameters_digest`] takes: its first ones.
pub const DIGEST_VALUES: usize = 4;

/// A digest of every float parameter's first [`DIGEST_VALUES`] values (`firsts`, in module
/// order, as f32): ranks whose models were built from other seeds differ in it.
pub fn parameters_digest(firsts: impl IntoIterator<Item = f32>) -> u64 {
    firsts.into_iter().fold(FNV1A_START, |hash, value| fnv1a_more(hash, &value.to_bits().to_le_bytes()))
}
