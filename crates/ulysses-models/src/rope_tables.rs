//! Rotary position embeddings at *global* positions.
//!
//! Under sequence parallelism a rank holds tokens `[offset, offset + S/P)` of each sequence,
//! so its rotations must start at `offset`, not 0. The tables are computed on the host from
//! integer positions, in f64, so every rank gets bit-identical angles for the same position
//! (no `max_sequence_length` cache either, which would cost memory at long contexts: a thread
//! keeps the values of its last two tables alone, which a rank's next step reuses).

use burn::tensor::{FloatDType, Tensor, TensorData, backend::Backend};
use burn_ulysses::visibility::PositionIds;

use crate::rope::{RopeScaling, inverse_frequencies};

/// cos/sin tables `[batch | 1, 1, seq, head_dim / 2]`.
#[derive(Debug, Clone)]
pub struct RopeTables<B: Backend> {
    cos: Tensor<B, 4>,
    sin: Tensor<B, 4>,
}

impl<B: Backend> RopeTables<B> {
    /// Tables for positions `offset..offset + seq`, the same in every row.
    pub fn new(offset: usize, seq: usize, head_dim: usize, theta: f64, scaling: RopeScaling, device: &B::Device) -> Self {
        Self::at(&PositionIds::consecutive(1, offset, seq), head_dim, theta, scaling, device)
    }

    /// Tables for each row's own position ids (packed documents restart at 0).
    pub fn at(positions: &PositionIds, head_dim: usize, theta: f64, scaling: RopeScaling, device: &B::Device) -> Self {
        assert!(head_dim % 2 == 0, "RoPE needs an even head_dim, got {head_dim}");
        let half = head_dim / 2;
        let (batch, seq) = (positions.batch(), positions.len());
        if let (Some(represented), Some(&last)) = (scaling.positions_represented(), positions.ids().iter().max()) {
            assert!(
                (last as usize) < represented,
                "position {last} is past max_position_embeddings {represented}, where dynamic NTK RoPE's frequencies change with each batch: \
                 train at most {represented} tokens a sequence, or give the checkpoint a static scaling (rope_type \"yarn\" or \"linear\")"
            );
        }
        // Moved where not kept, copied where kept.
        let (cos, sin) = match std::rc::Rc::try_unwrap(host_values(positions, head_dim, theta, scaling)) {
            Ok(made) => (made.cos, made.sin),
            Err(kept) => (kept.cos.clone(), kept.sin.clone()),
        };
        // f32, not the device's default float (bf16 would round them before any cast).
        let table = |values: Vec<f32>| Tensor::from_data(TensorData::new(values, [batch, 1, seq, half]), (device, burn::tensor::DType::F32));
        Self { cos: table(cos), sin: table(sin) }
    }

    /// The tables in `dtype` (the compute dtype), cast once rather than at every use.
    pub fn in_dtype(self, dtype: FloatDType) -> Self {
        Self { cos: self.cos.cast(dtype), sin: self.sin.cast(dtype) }
    }

    /// The tables of rows `rows` of the sequence (a view: no copy).
    pub fn rows(&self, rows: std::ops::Range<usize>) -> Self {
        let narrow = |table: &Tensor<B, 4>| table.clone().narrow(2, rows.start, rows.len());
        Self { cos: narrow(&self.cos), sin: narrow(&self.sin) }
    }

    /// Rotates `x: [batch, heads, seq, head_dim]` (the two halves of the head dim form the
    /// pairs, as in Hugging Face's Llama) in `x`'s dtype, as Hugging Face does: the angles
    /// are exact (f64 on the host), and in bf16 only their cos and sin are rounded. In f32
    /// the backward would keep nothing more, but the forward would make f32 copies of q,
    /// several at a time: at long context, a peak of its own.
    pub fn apply(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        // No-op casts when the tables are already in x's dtype (`in_dtype`).
        let dtype = FloatDType::from(x.dtype());
        let (cos, sin) = (self.cos.clone().cast(dtype), self.sin.clone().cast(dtype));
        let [b, h, s, d] = x.dims();
        let half = d / 2;
        let x1 = x.clone().slice([0..b, 0..h, 0..s, 0..half]);
        let x2 = x.slice([0..b, 0..h, 0..s, half..d]);
        let rotated_1 = x1.clone() * cos.clone() - x2.clone() * sin.clone();
        let rotated_2 = x2 * cos + x1 * sin;
        Tensor::cat(vec![rotated_1, rotated_2], 3)
    }
}

/// The tables' values on the host, `[position][frequency]` row-major, and what they were made of.
struct HostTables {
    positions: PositionIds,
    head_dim: usize,
    theta: f64,
    scaling: RopeScaling,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

/// Tables whose values take more host memory than this are made anew at each use, not kept.
const KEPT_TABLE_BYTES: usize = 256 << 20;

thread_local! {
    /// The last two tables this thread made (a training shard's and an evaluation's, say),
    /// the newest first: a rank's shard has the same positions from step to step, and their
    /// cos and sin cost ~0.1 s of host time at 65 536 tokens and head_dim 128, twice a step with
    /// checkpointing, while the device waits for the tables.
    static KEPT: std::cell::RefCell<Vec<std::rc::Rc<HostTables>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// cos and sin of every position's angles, times the scaling's attention factor, in f64
/// (rounded once to f32): kept from this thread's last tables where they match.
fn host_values(positions: &PositionIds, head_dim: usize, theta: f64, scaling: RopeScaling) -> std::rc::Rc<HostTables> {
    let matches = |kept: &HostTables| kept.head_dim == head_dim && kept.theta.to_bits() == theta.to_bits() && kept.scaling == scaling && kept.positions == *positions;
    if let Some(kept) = KEPT.with(|kept| kept.borrow().iter().find(|kept| matches(kept)).cloned()) {
        return kept;
    }
    let values = positions.ids().len() * head_dim / 2;
    let mut cos = Vec::with_capacity(values);
    let mut sin = Vec::with_capacity(values);
    let (frequencies, factor) = (inverse_frequencies(head_dim, theta, scaling), scaling.attention_factor());
    for &position in positions.ids() {
        for &inv_freq in &frequencies {
            let angle = position as f64 * inv_freq;
            cos.push((angle.cos() * factor) as f32);
            sin.push((angle.sin() * factor) as f32);
        }
    }
    let made = std::rc::Rc::new(HostTables { positions: positions.clone(), head_dim, theta, scaling, cos, sin });
    if 2 * values * std::mem::size_of::<f32>() <= KEPT_TABLE_BYTES {
        KEPT.with(|kept| {
            let mut kept = kept.borrow_mut();
            kept.insert(0, made.clone());
            kept.truncate(2);
        });
    }
    made
}

#[cfg(test)]
mod tests {
    use burn::{
        backend::NdArray,
        tensor::{Tensor, TensorData},
    };

    use super::RopeTables;
    use crate::rope::RopeScaling;

    /// YaRN's attention factor scales what RoPE rotates (cos and sin alike, so q and k and
    /// each score by its square): at position 0 a head comes back times the factor; without
    /// scaling, whole.
    #[test]
    fn yarn_scales_what_it_rotates_by_its_attention_factor() {
        let yarn = RopeScaling::Yarn { factor: 4.0, original_max_position_embeddings: 64.0, original_given: true, beta_fast: 32.0, beta_slow: 1.0, attention_factor: Some(1.25), mscales: None, truncate: true };
        let head = Tensor::<NdArray, 4>::from_data(TensorData::new(vec![1.0f32, 2.0, 3.0, 4.0], [1, 1, 1, 4]), &Default::default());
        for (scaling, factor) in [(yarn, 1.25f32), (RopeScaling::Default, 1.0)] {
            let rotated = RopeTables::<NdArray>::new(0, 1, 4, 10_000.0, scaling, &Default::default()).apply(head.clone());
            let values: Vec<f32> = rotated.into_data().to_vec().unwrap();
            assert_eq!(values, [1.0, 2.0, 3.0, 4.0].map(|x| x * factor), "{scaling:?}");
        }
    }

    /// Dynamic NTK RoPE is plain RoPE up to its context (transformers: θ unchanged while the
    /// longest position is within it), the same tables bit for bit; past it, refused by name.
    #[test]
    fn dynamic_rope_is_plain_within_its_context_and_refused_past_it() {
        let dynamic = RopeScaling::Dynamic { factor: 4.0, max_position_embeddings: 16 };
        let head = Tensor::<NdArray, 4>::random([1, 2, 16, 8], burn::tensor::Distribution::Default, &Default::default());
        let rotate = |scaling| RopeTables::<NdArray>::new(0, 16, 8, 10_000.0, scaling, &Default::default()).apply(head.clone()).into_data();
        assert_eq!(rotate(dynamic), rotate(RopeScaling::Default));
        let past = std::panic::catch_unwind(|| RopeTables::<NdArray>::new(8, 9, 8, 10_000.0, dynamic, &Default::default())).unwrap_err();
        let message = past.downcast_ref::<String>().unwrap();
        assert!(message.contains("position 16 is past max_position_embeddings 16") && message.contains("rope_type \"yarn\""), "{message}");
    }

    /// Tables kept from this thread's earlier ones are those of their positions and settings:
    /// a sequence of calls, each setting changed once, each repeated, against tables made on a
    /// fresh thread (none kept), bit for bit.
    #[test]
    fn kept_tables_are_those_of_their_positions_and_settings() {
        let linear = RopeScaling::Linear { factor: 2.0 };
        let calls = [
            (0, 8, 4, 10_000.0, RopeScaling::Default),
            (8, 8, 4, 10_000.0, RopeScaling::Default),
            (0, 8, 4, 10_000.0, RopeScaling::Default),
            (0, 8, 4, 500_000.0, RopeScaling::Default),
            (0, 8, 4, 500_000.0, linear),
            (0, 8, 8, 500_000.0, linear),
            (0, 6, 8, 500_000.0, linear),
            (8, 8, 4, 10_000.0, RopeScaling::Default),
        ];
        let values = |(offset, seq, head_dim, theta, scaling): (usize, usize, usize, f64, RopeScaling)| {
            let tables = RopeTables::<NdArray>::new(offset, seq, head_dim, theta, scaling, &Default::default());
            [tables.cos, tables.sin].map(|table| table.into_data().to_vec::<f32>().unwrap())
        };
        for round in 0..2 {
            for call in calls {
                let fresh = std::thread::spawn(move || values(call)).join().unwrap();
                assert_eq!(values(call), fresh, "round {round}, {call:?}");
            }
        }
    }
}
