//! `burn_ulysses::nn::MultiHeadAttention` is a drop-in for burn-nn's: a burn-nn record loads
//! into it, it gives burn-nn's output (no dropout, a key-padding mask), and under
//! `UlyssesBackend` with 2 ranks it gives the single-device output.

use std::time::Duration;

use burn::{
    backend::{Autodiff, NdArray},
    module::Module,
    nn::attention as burn_nn,
    record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder},
    tensor::{Bool, Tensor, TensorData, backend::Backend},
};
use burn_ulysses::{UlyssesBackend, comm::ThreadGroup, nn};
use ulysses_suite::{max_abs_diff, shard, uniform_tensor, values, with_deadline};

type Inner = NdArray<f32>;
type Sp = UlyssesBackend<Autodiff<Inner>>;

const TOLERANCE: f32 = 1e-5;
const BATCH: usize = 2;
const SEQ: usize = 16;
const D_MODEL: usize = 32;
const HEADS: usize = 4;

/// Keys 13.. of batch 1 are padding.
fn mask_pad<B: Backend>(device: &B::Device) -> Tensor<B, 2, Bool> {
    let padded: Vec<bool> = (0..BATCH).flat_map(|b| (0..SEQ).map(move |s| b == 1 && s >= 13)).collect();
    Tensor::from_data(TensorData::new(padded, [BATCH, SEQ]), device)
}

/// burn-nn's module, saved as a named MessagePack record.
fn burn_nn_record() -> (Vec<f32>, Vec<u8>) {
    let device = Default::default();
    let mha = burn_nn::MultiHeadAttentionConfig::new(D_MODEL, HEADS).with_dropout(0.0).init::<Inner>(&device);
    let x = uniform_tensor::<Inner, 3>([BATCH, SEQ, D_MODEL], 5, &device);
    let output = mha.forward(burn_nn::MhaInput::self_attn(x).mask_pad(mask_pad(&device)));
    let bytes = NamedMpkBytesRecorder::<FullPrecisionSettings>::default().record(mha.into_record(), ()).unwrap();
    (values(output.context), bytes)
}

fn load<B: Backend>(bytes: Vec<u8>, device: &B::Device) -> nn::MultiHeadAttention<B> {
    let record = NamedMpkBytesRecorder::<FullPrecisionSettings>::default().load(bytes, device).unwrap();
    nn::MultiHeadAttentionConfig::new(D_MODEL, HEADS).with_dropout(0.0).init::<B>(device).load_record(record)
}

#[test]
fn loads_burn_nn_records_and_matches_its_output() {
    let (want, bytes) = burn_nn_record();
    let device = Default::default();
    let mha = load::<Inner>(bytes, &device);
    let x = uniform_tensor::<Inner, 3>([BATCH, SEQ, D_MODEL], 5, &device);
    let got = values(mha.forward(nn::MhaInput::self_attn(x).mask_pad(mask_pad(&device))).context);
    let diff = max_abs_diff(&got, &want);
    println!("drop-in vs burn-nn MultiHeadAttention: max |Δ| {diff:.2e}");
    assert!(diff <= TOLERANCE, "output differs from burn-nn's by {diff:e}");
}

#[test]
fn is_sequence_parallel_under_ulysses() {
    let (want, bytes) = burn_nn_record();
    let per_rank = with_deadline(Duration::from_secs(50), move || {
        ThreadGroup::new(2).run(|rank| {
            let _sp = Sp::enter_thread(rank.communicator());
            let device = Default::default();
            let mha = load::<Sp>(bytes.clone(), &device);
            let (r, p) = (rank.rank(), rank.size());
            let x = shard(uniform_tensor::<Sp, 3>([BATCH, SEQ, D_MODEL], 5, &device), 1, r, p);
            let mask = shard(mask_pad::<Sp>(&device), 1, r, p);
            values(mha.forward(nn::MhaInput::self_attn(x).mask_pad(mask)).context)
        })
    });
    let want = Tensor::<Inner, 3>::from_data(TensorData::new(want, [BATCH, SEQ, D_MODEL]), &Default::default());
    for (r, got) in per_rank.into_iter().enumerate() {
        let diff = max_abs_diff(&got.unwrap(), &values(shard(want.clone(), 1, r, 2)));
        println!("rank {r} of 2 vs burn-nn on one device: max |Δ| {diff:.2e}");
        assert!(diff <= TOLERANCE, "rank {r} differs by {diff:e}");
    }
}
