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
    /// `rope_type: "llama3"` (Llama 3.1 and later): low frequencies divided by `factor`,
    /// high ones kept, the band between them interpolated.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: f64 },
}

/// The `head_dim / 2` inverse frequencies of a head: rotation `i` turns position `p` by
/// `p · inv_freq[i]`.
pub fn inverse_frequencies(head_dim: usize, theta: f64, scaling: RopeScaling) -> Vec<f64> {
    let default = (0..head_dim / 2).map(|i| theta.powf(-((2 * i) as f64) / head_dim as f64));
    match scaling {
        RopeScaling::Default => default.collect(),
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
}
