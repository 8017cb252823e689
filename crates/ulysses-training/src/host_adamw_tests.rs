//! `ulysses_core::host_adamw` against burn's own AdamW (burn-optim's `SimpleOptimizer`, the
//! update every burn model trains with), on NdArray in f32: the same parameters, gradients and
//! learning rates for several steps, weight decay on and off.

use std::num::NonZeroUsize;

use burn::{
    backend::NdArray,
    optim::{AdamWConfig, SimpleOptimizer},
    tensor::{Tensor, TensorData},
};
use ulysses_core::host_adamw::{AdamWMoments, HostAdamW, HostAdamWConfig};

type B = NdArray<f32>;

/// Values of every scale a training run meets (zeros, 1e-8 to 1e3, both signs), from a
/// seeded generator.
fn values(count: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..count)
        .map(|i| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32;
            let scale = 10f32.powi((state % 12) as i32 - 8);
            if i % 17 == 0 { 0.0 } else { (unit - 0.5) * 2.0 * scale }
        })
        .collect()
}

/// Five steps of burn's AdamW and of the host's from the same start: the largest difference
/// of the parameters relative to the largest parameter, after each step.
fn differences(config: HostAdamWConfig, threads: usize) -> Vec<f32> {
    let len = 70_001;
    let burn_adamw = AdamWConfig::new()
        .with_beta_1(config.beta_1)
        .with_beta_2(config.beta_2)
        .with_epsilon(config.epsilon)
        .with_weight_decay(config.weight_decay)
        .build();
    let host = HostAdamW::with_threads(config, NonZeroUsize::new(threads).unwrap());
    let device = Default::default();
    let start = values(len, 1);
    let mut theirs = Tensor::<B, 1>::from_data(TensorData::new(start.clone(), [len]), &device);
    let mut their_state = None;
    let (mut ours, mut moments) = (start, AdamWMoments::default());
    let mut differences = Vec::new();
    for step in 0..5u64 {
        let grads = values(len, 10 + step);
        let learning_rate = 1e-3 * (step + 1) as f64;
        let (updated, state) = burn_adamw.step(learning_rate, theirs, Tensor::from_data(TensorData::new(grads.clone(), [len]), &device), their_state);
        (theirs, their_state) = (updated, state);
        host.step(learning_rate, &mut ours, &grads, &mut moments);
        let want = theirs.clone().into_data().to_vec::<f32>().unwrap();
        let largest = want.iter().fold(0f32, |a, b| a.max(b.abs()));
        let difference = ours.iter().zip(&want).map(|(a, b)| if a.is_finite() { (a - b).abs() } else { f32::INFINITY }).fold(0f32, f32::max);
        differences.push(difference / largest);
    }
    assert_eq!(moments.time, 5);
    differences
}

/// Equal to burn's AdamW bit for bit on NdArray (the same f32 operations in the same order; a
/// bias correction one step off is 5e-7 apart after one step), on one thread and split over
/// three, with and without weight decay.
#[test]
fn the_host_adamw_equals_burns() {
    for weight_decay in [0.0, 0.05] {
        let config = HostAdamWConfig { weight_decay, ..HostAdamWConfig::default() };
        for threads in [1, 3] {
            let differences = differences(config, threads);
            println!("weight decay {weight_decay}, {threads} thread(s): {differences:?}");
            assert!(differences.iter().all(|d| *d == 0.0), "weight decay {weight_decay}, {threads} thread(s): {differences:?}");
        }
    }
}

/// Clipping's factor folded into the update (`step_scaled`) is a pass over the gradients
/// first, then `step`, bit for bit, on one thread and on three.
#[test]
fn a_scaled_step_equals_scaling_the_gradients_first() {
    let (len, scale) = (70_001, 0.37f32);
    for threads in [1, 3] {
        let host = HostAdamW::with_threads(HostAdamWConfig { weight_decay: 0.05, ..HostAdamWConfig::default() }, NonZeroUsize::new(threads).unwrap());
        let (mut scaled, mut first) = ((values(len, 1), AdamWMoments::default()), (values(len, 1), AdamWMoments::default()));
        for step in 0..3u64 {
            let grads = values(len, 20 + step);
            host.step_scaled(1e-3, &mut scaled.0, &grads, scale, true, &mut scaled.1);
            let multiplied: Vec<f32> = grads.iter().map(|g| g * scale).collect();
            host.step(1e-3, &mut first.0, &multiplied, &mut first.1);
        }
        assert!(scaled.0.iter().zip(&first.0).all(|(a, b)| a.to_bits() == b.to_bits()), "{threads} thread(s): the scaled step parts from scaling first");
        assert_eq!(scaled.1, first.1, "{threads} thread(s): the moments");
    }
}

/// The squared norm (`sum_of_squares`, clipping's): within 1e-13 of a plain f64 sum, and the
/// same bits whatever the threads (its blocks are summed in order), at lengths that are no
/// multiple of its lanes or blocks.
#[test]
fn the_sum_of_squares_is_the_f64_sum_whatever_the_threads() {
    for len in [0, 7, 16_385, 200_003] {
        let values = values(len, 3);
        let plain: f64 = values.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let sums: Vec<f64> = [1, 3, 4].iter().map(|&t| HostAdamW::with_threads(HostAdamWConfig::default(), NonZeroUsize::new(t).unwrap()).sum_of_squares(&values)).collect();
        assert!(sums.iter().all(|s| s.to_bits() == sums[0].to_bits()), "{len} values: {sums:?} on 1, 3 and 4 threads");
        assert!((sums[0] - plain).abs() <= 1e-13 * plain, "{len} values: {} against the plain sum {plain}", sums[0]);
    }
}
