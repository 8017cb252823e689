//! Rotary position embeddings of Hugging Face checkpoints: the inverse frequencies of each
//! RoPE type this project represents, computed as transformers' `modeling_rope_utils` does
//! (in f64 here; transformers computes in f32, so they agree to f32's precision).
//!
//! Pairs are the two halves of a head (`rotate_half`), as in every Hugging Face checkpoint of
//! the four families.

/// How a checkpoint stretches RoPE beyond the context it was pre-trained on
/// (`rope_scaling`, or `rope_parameters` in transformers 5).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum RopeScaling {
    /// `rope_type: "default"` (or no scaling at all).
    Default,
    /// `rope_type: "linear"`: positions divided by `factor` (every frequency, uniformly).
    Linear { factor: f64 },
    /// `rope_type: "dynamic"` (dynamic NTK): transformers raises θ with the longest position
    /// of each forward past `max_position_embeddings`, and keeps plain RoPE up to it. Only
    /// that plain part is represented: positions from `max_position_embeddings` on are
    /// refused ([`positions_represented`](RopeScaling::positions_represented)), as their
    /// frequencies would hang on the batch (under SP, on all the ranks' positions).
    Dynamic { factor: f64, max_position_embeddings: usize },
    /// `rope_type: "llama3"` (Llama 3.1 and later): low frequencies divided by `factor`,
    /// high ones kept, the band between them interpolated.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: f64 },
    /// `rope_type: "yarn"` (YaRN, Qwen's and DeepSeek's long contexts), as transformers 5
    /// computes it: the frequencies that turn more than `beta_fast` times over the original
    /// context kept, those that turn fewer than `beta_slow` times divided by `factor`, a linear
    /// ramp over the pairs between; cos and sin multiplied by the [attention
    /// factor](RopeScaling::attention_factor) (given, else from DeepSeek's `mscale` and
    /// `mscale_all_dim` where both are, else YaRN's `0.1 ln(factor) + 1`).
    /// `original_max_position_embeddings`: as the checkpoint gives it, else its
    /// `max_position_embeddings` (`original_given` false: written back without it).
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        original_given: bool,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: Option<f64>,
        mscales: Option<(f64, f64)>,
        truncate: bool,
    },
}

impl RopeScaling {
    /// The positions whose rotations this scaling represents, `0..n`: all but dynamic NTK's.
    pub fn positions_represented(&self) -> Option<usize> {
        match *self {
            RopeScaling::Dynamic { max_position_embeddings, .. } => Some(max_position_embeddings),
            _ => None,
        }
    }

    /// What cos and sin are multiplied by (YaRN's attention factor; 1 otherwise).
    pub fn attention_factor(&self) -> f64 {
        let mscale = |scale: f64, mscale: f64| if scale <= 1.0 { 1.0 } else { 0.1 * mscale * scale.ln() + 1.0 };
        match *self {
            RopeScaling::Yarn { attention_factor: Some(given), .. } => given,
            RopeScaling::Yarn { factor, mscales: Some((m, all)), .. } => mscale(factor, m) / mscale(factor, all),
            RopeScaling::Yarn { factor, .. } => mscale(factor, 1.0),
            _ => 1.0,
        }
    }
}

/// The `head_dim / 2` inverse frequencies of a head: rotation `i` turns position `p` by
/// `p · inv_freq[i]`.
pub fn inverse_frequencies(head_dim: usize, theta: f64, scaling: RopeScaling) -> Vec<f64> {
    let default = (0..head_dim / 2).map(|i| theta.powf(-((2 * i) as f64) / head_dim as f64));
    match scaling {
        RopeScaling::Default | RopeScaling::Dynamic { .. } => default.collect(),
        RopeScaling::Linear { factor } => default.map(|f| f / factor).collect(),
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings: context } => {
            let (low_freq_wavelen, high_freq_wavelen) = (context / low_freq_factor, context / high_freq_factor);
            default
                .map(|f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_freq_wavelen {
                        f
                    } else if wavelen > low_freq_wavelen {
                        f / factor
                    } else {
                        let smooth = (context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
        RopeScaling::Yarn { factor, original_max_position_embeddings: context, beta_fast, beta_slow, truncate, .. } => {
            let dim = head_dim as f64;
            // The index of the pair whose frequency turns `rotations` times over the original
            // context (transformers' `find_correction_dim`; clamped below `dim` as it clamps).
            let pair_turning = |rotations: f64| dim * (context / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
            let (low, high) = (pair_turning(beta_fast), pair_turning(beta_slow));
            let (low, high) = if truncate { (low.floor(), high.ceil()) } else { (low, high) };
            let (low, high) = (low.max(0.0), high.min(dim - 1.0));
            let high = if low == high { high + 0.001 } else { high };
            default
                .enumerate()
                .map(|(pair, f)| {
                    // 0: kept (extrapolated); 1: divided by the factor (interpolated).
                    let ramp = ((pair as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    f / factor * ramp + f * (1.0 - ramp)
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_frequencies_fall_from_one_to_theta_to_the_minus_one() {
        let f = inverse_frequencies(8, 10_000.0, RopeScaling::Default);
        assert_eq!(f.len(), 4);
        assert_eq!(f[0], 1.0);
        assert!((f[2] - 0.01).abs() < 1e-15, "{f:?}");
        let linear = inverse_frequencies(8, 10_000.0, RopeScaling::Linear { factor: 4.0 });
        assert!(f.iter().zip(&linear).all(|(a, b)| (a / 4.0 - b).abs() < 1e-18));
    }

    #[test]
    fn llama3_keeps_high_frequencies_divides_low_ones_and_blends_between() {
        let scaling = RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192.0 };
        let (plain, scaled) = (inverse_frequencies(128, 500_000.0, RopeScaling::Default), inverse_frequencies(128, 500_000.0, scaling));
        for (f, s) in plain.iter().zip(&scaled) {
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen < 2048.0 {
                assert_eq!(f, s);
            } else if wavelen > 8192.0 {
                assert!((f / 8.0 - s).abs() <= 1e-18 * f.abs().max(1.0));
            } else {
                assert!(*s < *f && *s > f / 8.0, "{f} -> {s}");
            }
        }
        assert!(scaled.iter().zip(&plain).any(|(s, f)| s < f) && scaled[0] == plain[0]);
    }

    /// YaRN as its paper defines it (Peng et al. 2023, section 3.2, and its code's ramp): a pair
    /// whose wavelength fits the original context more than `beta_fast` (32) times keeps its
    /// frequency, one that fits fewer than `beta_slow` (1) times is divided by the factor, and
    /// the pairs between blend linearly in their index. Qwen3's head (128, θ = 10⁶) over 32 768
    /// positions, factor 4.
    #[test]
    fn yarn_keeps_fast_pairs_divides_slow_ones_and_ramps_between() {
        let (context, factor) = (32_768.0, 4.0);
        let scaling = RopeScaling::Yarn { factor, original_max_position_embeddings: context, original_given: true, beta_fast: 32.0, beta_slow: 1.0, attention_factor: None, mscales: None, truncate: true };
        let (plain, scaled) = (inverse_frequencies(128, 1e6, RopeScaling::Default), inverse_frequencies(128, 1e6, scaling));
        let turns = |f: f64| context * f / (2.0 * std::f64::consts::PI);
        let (mut kept, mut divided, mut between) = (0, 0, Vec::new());
        for (pair, (f, s)) in plain.iter().zip(&scaled).enumerate() {
            let ratio = f / s;
            // The ramp's ends are whole pairs (truncated): a pair within one of a bound (a factor
            // of e^(2 ln θ / 128) = 1.24 in turns) may sit on either side; 2 is clear of it.
            if turns(*f) > 32.0 * 2.0 {
                assert_eq!(ratio, 1.0, "pair {pair} turns {} times: kept", turns(*f));
                kept += 1;
            } else if turns(*f) < 1.0 / 2.0 {
                assert!((ratio - factor).abs() < 1e-12, "pair {pair} turns {} times: divided by {factor}, not {ratio}", turns(*f));
                divided += 1;
            } else {
                // The kept frequency's weight w in s = f · w + f / factor · (1 − w).
                between.push((pair, (1.0 / ratio - 1.0 / factor) / (1.0 - 1.0 / factor)));
            }
        }
        assert!(kept > 10 && divided > 10 && between.len() > 5, "kept {kept}, divided {divided}, between {}", between.len());
        // Between: the weight of the kept frequency falls linearly with the pair's index.
        let steps: Vec<f64> = between.windows(2).map(|w| w[1].1 - w[0].1).collect();
        assert!(steps.iter().all(|s| *s <= 0.0), "{between:?}");
        let inner: Vec<f64> = steps.iter().copied().filter(|s| *s < 0.0).collect();
        assert!(inner.windows(2).all(|w| (w[0] - w[1]).abs() < 1e-9), "a linear ramp: {between:?}");
    }
}
