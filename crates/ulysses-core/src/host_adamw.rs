//! AdamW on the host, over a rank's part of the parameters (ZeRO with the optimizer offloaded:
//! the f32 master weights and both moments live in host memory, 12 bytes a parameter that the
//! device never holds). The update is burn's `AdamW` (burn-optim 0.21) operation for operation,
//! in f32 and in the same order, so it equals burn's on the same inputs within f32 rounding
//! (bit for bit against NdArray); the loop over elements is split across threads, each a plain
//! loop over slices that the compiler vectorises (no branch but none).

use std::num::NonZeroUsize;

/// AdamW's settings, burn's `AdamWConfig` defaults.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct HostAdamWConfig {
    pub beta_1: f32,
    pub beta_2: f32,
    pub epsilon: f32,
    pub weight_decay: f32,
}

/// A setting AdamW cannot train with: its name (burn's `AdamWConfig` field), the rule it
/// breaks, and its value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InvalidAdamWSetting {
    pub setting: &'static str,
    pub rule: &'static str,
    pub value: f64,
}

impl HostAdamWConfig {
    /// The first setting that cannot train at `learning_rate` (itself first: not finite, or
    /// below 0): a beta outside [0, 1) (at 1 a
    /// moment never forgets and its bias correction divides by 0), an epsilon not above 0 (a
    /// division by 0), a weight decay below 0 (the weights grow every step) or of
    /// `learning_rate · weight_decay` 1 or more (each step multiplies the parameters by
    /// `1 − learning_rate · weight_decay`: zeroes or flips them). NaN breaks every rule.
    pub fn invalid_setting(&self, learning_rate: f64) -> Option<InvalidAdamWSetting> {
        let invalid = |setting, rule, value: f32| Some(InvalidAdamWSetting { setting, rule, value: f64::from(value) });
        // The rules below read it: a rate of NaN would blame the decay.
        if !(learning_rate.is_finite() && learning_rate >= 0.0) {
            return Some(InvalidAdamWSetting { setting: "learning_rate", rule: "must be a finite number, 0 or more", value: learning_rate });
        }
        for (setting, beta) in [("beta_1", self.beta_1), ("beta_2", self.beta_2)] {
            if !(0.0..1.0).contains(&beta) {
                return invalid(setting, "must be at least 0 and below 1", beta);
            }
        }
        if !(self.epsilon.is_finite() && self.epsilon > 0.0) {
            return invalid("epsilon", "must be a finite number above 0 (1e-8 is usual)", self.epsilon);
        }
        let decay = self.weight_decay;
        if !(decay.is_finite() && decay >= 0.0 && learning_rate * f64::from(decay) < 1.0) {
            return invalid("weight_decay", "must be 0 or more, and below 1 / learning rate (each step multiplies the parameters by 1 - learning rate x weight decay)", decay);
        }
        None
    }

    /// [`invalid_setting`](Self::invalid_setting) as an error, at a step of `learning_rate`:
    /// what the optimizers that take these settings check before they update.
    pub fn check(&self, learning_rate: f64) -> Result<(), crate::error::UlyssesError> {
        match self.invalid_setting(learning_rate) {
            None => Ok(()),
            Some(InvalidAdamWSetting { setting, rule, value }) => Err(crate::error::UlyssesError::InvalidConfig(format!(
                "AdamW's {setting} {rule}, got {value} (at a learning rate of {learning_rate}): it cannot train"
            ))),
        }
    }

    /// The settings a parameter steps with: these, without the weight decay where it does not
    /// [`decays`].
    pub fn for_parameter(self, decays: bool) -> Self {
        Self { weight_decay: if decays { self.weight_decay } else { 0.0 }, ..self }
    }
}

impl Default for HostAdamWConfig {
    fn default() -> Self {
        Self { beta_1: 0.9, beta_2: 0.999, epsilon: 1e-5, weight_decay: 1e-4 }
    }
}

/// Whether AdamW's weight decay applies to a parameter of `dims` dimensions: to weight
/// matrices (embeddings, projections, the head), not to norms' gains or biases (one
/// dimension), as Hugging Face's Trainer and Megatron-LM decay.
pub fn decays(dims: usize) -> bool {
    dims >= 2
}

/// The moments of one parameter (part), and how many updates made them.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AdamWMoments {
    pub moment_1: Vec<f32>,
    pub moment_2: Vec<f32>,
    /// Updates so far: 0 before the first.
    pub time: u32,
}

/// AdamW over host slices, on `threads` threads.
#[derive(Debug, Clone, Copy)]
pub struct HostAdamW {
    config: HostAdamWConfig,
    threads: NonZeroUsize,
}

/// Elements below which a thread of its own costs more than it saves.
const ELEMENTS_PER_THREAD: usize = 1 << 15;

impl HostAdamW {
    /// On as many threads as the machine has cores.
    pub fn new(config: HostAdamWConfig) -> Self {
        Self::with_threads(config, std::thread::available_parallelism().unwrap_or(NonZeroUsize::MIN))
    }

    pub fn with_threads(config: HostAdamWConfig, threads: NonZeroUsize) -> Self {
        Self { config, threads }
    }

    pub fn threads(&self) -> NonZeroUsize {
        self.threads
    }

    pub fn config(&self) -> &HostAdamWConfig {
        &self.config
    }

    /// One update of `params` by `grads` at `learning_rate`, `moments` starting empty (zeros
    /// of the parameter's length at the first update).
    ///
    /// # Panics
    ///
    /// When `grads` or non-empty moments differ in length from `params`: the caller's
    /// partition is wrong, and no update could be right.
    pub fn step(&self, learning_rate: f64, params: &mut [f32], grads: &[f32], moments: &mut AdamWMoments) {
        self.step_scaled(learning_rate, params, grads, 1.0, true, moments);
    }

    /// [`step`](Self::step) by the gradients times `grad_scale` (clipping's factor), each
    /// product rounded to f32 as a pass over the gradients first would round it; with the
    /// weight decay where `decays` (see [`decays`]), else none.
    pub fn step_scaled(&self, learning_rate: f64, params: &mut [f32], grads: &[f32], grad_scale: f32, decays: bool, moments: &mut AdamWMoments) {
        let len = params.len();
        assert_eq!(grads.len(), len, "AdamW: {} gradients for {len} parameters", grads.len());
        if moments.time == 0 {
            moments.moment_1 = vec![0.0; len];
            moments.moment_2 = vec![0.0; len];
        }
        assert!(moments.moment_1.len() == len && moments.moment_2.len() == len, "AdamW: moments of {} for {len} parameters", moments.moment_1.len());
        moments.time += 1;
        let update = Update { grad_scale, ..Update::new(&self.config.for_parameter(decays), learning_rate, moments.time) };
        let threads = self.threads.get().min(len.div_ceil(ELEMENTS_PER_THREAD)).max(1);
        if threads == 1 {
            update.apply(params, grads, &mut moments.moment_1, &mut moments.moment_2);
            return;
        }
        let chunk = len.div_ceil(threads);
        std::thread::scope(|scope| {
            let parts = params.chunks_mut(chunk).zip(grads.chunks(chunk)).zip(moments.moment_1.chunks_mut(chunk)).zip(moments.moment_2.chunks_mut(chunk));
            for (((params, grads), moment_1), moment_2) in parts {
                scope.spawn(move || update.apply(params, grads, moment_1, moment_2));
            }
        });
    }

    /// The sum of the squares of `values`, in f64 (a gradient's squared norm), on the threads.
    /// Each block of [`SQUARES_BLOCK`] elements is summed over 8 lanes (element i into lane
    /// i mod 8, which the compiler vectorises), then the lanes and the blocks are added in
    /// order: the result depends on the values alone, never on the threads.
    pub fn sum_of_squares(&self, values: &[f32]) -> f64 {
        let blocks: Vec<&[f32]> = values.chunks(SQUARES_BLOCK).collect();
        let mut sums = vec![0f64; blocks.len()];
        let threads = self.threads.get().min(values.len().div_ceil(ELEMENTS_PER_THREAD)).max(1);
        let per_thread = blocks.len().div_ceil(threads).max(1);
        let sum_blocks = |sums: &mut [f64], blocks: &[&[f32]]| sums.iter_mut().zip(blocks).for_each(|(sum, block)| *sum = block_squares(block));
        if threads == 1 {
            sum_blocks(&mut sums, &blocks);
        } else {
            std::thread::scope(|scope| {
                for (sums, blocks) in sums.chunks_mut(per_thread).zip(blocks.chunks(per_thread)) {
                    scope.spawn(move || sum_blocks(sums, blocks));
                }
            });
        }
        sums.iter().sum()
    }
}

/// Elements [`HostAdamW::sum_of_squares`] sums as one block.
pub const SQUARES_BLOCK: usize = 1 << 14;

/// The squares of `block` summed in f64 over 8 lanes, then the lanes in order.
fn block_squares(block: &[f32]) -> f64 {
    let mut lanes = [0f64; 8];
    let mut chunks = block.chunks_exact(8);
    for chunk in &mut chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane += f64::from(v) * f64::from(v);
        }
    }
    for (lane, &v) in lanes.iter_mut().zip(chunks.remainder()) {
        *lane += f64::from(v) * f64::from(v);
    }
    lanes.iter().sum()
}

/// One step's scalars, rounded to f32 as burn's tensor ops round them.
#[derive(Debug, Clone, Copy)]
struct Update {
    beta_1: f32,
    beta_2: f32,
    factor_1: f32,
    factor_2: f32,
    correction_1: f32,
    correction_2: f32,
    epsilon: f32,
    decay: f32,
    learning_rate: f32,
    /// Each gradient is multiplied by it first (1: as it is).
    grad_scale: f32,
}

impl Update {
    fn new(config: &HostAdamWConfig, learning_rate: f64, time: u32) -> Self {
        let time = time as i32;
        Self {
            beta_1: config.beta_1,
            beta_2: config.beta_2,
            factor_1: 1.0 - config.beta_1,
            factor_2: 1.0 - config.beta_2,
            // Bias corrections: 1 − βᵗ, in f32 (burn: `1f32 - beta.powi(time)`).
            correction_1: 1.0 - config.beta_1.powi(time),
            correction_2: 1.0 - config.beta_2.powi(time),
            epsilon: config.epsilon,
            // Decoupled weight decay: the parameter times 1 − lr·λ, computed in f64.
            decay: (1.0 - learning_rate * config.weight_decay as f64) as f32,
            learning_rate: learning_rate as f32,
            grad_scale: 1.0,
        }
    }

    /// burn's order: m = β₁m + (1−β₁)g; v = β₂v + (1−β₂)g²; δ = (m / c₁) / (√(v / c₂) + ε);
    /// p = p·(1 − lr·λ) − δ·lr.
    fn apply(&self, params: &mut [f32], grads: &[f32], moment_1: &mut [f32], moment_2: &mut [f32]) {
        for (((p, &g), m), v) in params.iter_mut().zip(grads).zip(moment_1.iter_mut()).zip(moment_2.iter_mut()) {
            let g = g * self.grad_scale;
            *m = *m * self.beta_1 + g * self.factor_1;
            *v = *v * self.beta_2 + g * g * self.factor_2;
            let delta = (*m / self.correction_1) / ((*v / self.correction_2).sqrt() + self.epsilon);
            *p = *p * self.decay - delta * self.learning_rate;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::HostAdamWConfig;

    /// Each setting that cannot train is named, the learning rate first (a NaN rate made
    /// `rate · decay` NaN, which blamed a decay of 0); the defaults, and a decay just below
    /// 1 / rate, train.
    #[test]
    fn the_setting_that_cannot_train_is_the_one_named() {
        let fine = HostAdamWConfig::default();
        let named = |config: HostAdamWConfig, rate: f64| config.invalid_setting(rate).map(|invalid| invalid.setting);
        assert_eq!(named(fine, 1e-3), None);
        assert_eq!(named(HostAdamWConfig { weight_decay: 0.0, ..fine }, f64::NAN), Some("learning_rate"));
        assert_eq!(named(fine, -1e-3), Some("learning_rate"));
        assert_eq!(named(HostAdamWConfig { beta_1: 1.0, ..fine }, 1e-3), Some("beta_1"));
        assert_eq!(named(HostAdamWConfig { beta_2: f32::NAN, ..fine }, 1e-3), Some("beta_2"));
        assert_eq!(named(HostAdamWConfig { epsilon: 0.0, ..fine }, 1e-3), Some("epsilon"));
        assert_eq!(named(HostAdamWConfig { weight_decay: -1e-4, ..fine }, 1e-3), Some("weight_decay"));
        assert_eq!(named(HostAdamWConfig { weight_decay: 1000.0, ..fine }, 1e-3), Some("weight_decay"));
        assert_eq!(named(HostAdamWConfig { weight_decay: 999.0, ..fine }, 1e-3), None);
    }
}
