//! `burn_ulysses::nn::{TransformerEncoder, TransformerDecoder}` are drop-ins for burn-nn's: a
//! burn-nn record loads into them and they give burn-nn's output (≤ 1e-6 of its largest value; causal through the
//! flag where burn-nn takes an autoregressive mask; pre- and post-norm), and under
//! `UlyssesBackend` at SP = 2 and 4 each rank gives its shard of the one-device output. (burn-nn's
//! own encoder under SP is refused by the guard against attention by hand: tests/attention_guard.rs.)

use std::time::Duration;

use burn::{
    backend::{Autodiff, NdArray},
    module::Module,
    nn::{attention::generate_autoregressive_mask, transformer as burn_nn},
    record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder},
    tensor::{Int, Tensor, TensorData, backend::Backend},
};
use burn_ulysses::{
    UlyssesBackend,
    comm::ThreadGroup,
    data::{SequenceSharder, ShardTensors},
    nn,
};
use ulysses_suite::{deterministic_params, max_abs_diff, shard, uniform_tensor, values, with_deadline};

type Inner = NdArray<f32>;
type Sp = UlyssesBackend<Autodiff<Inner>>;

const BATCH: usize = 2;
const SEQ: usize = 16;
/// The decoder's memory is longer than its target: cross-attention with unequal lengths.
const MEMORY: usize = 24;
const D_MODEL: usize = 32;
const D_FF: usize = 48;
const HEADS: usize = 4;
const LAYERS: usize = 2;

fn target<B: Backend>(device: &B::Device) -> Tensor<B, 3> {
    uniform_tensor::<B, 3>([BATCH, SEQ, D_MODEL], 5, device)
}

fn memory<B: Backend>(device: &B::Device) -> Tensor<B, 3> {
    uniform_tensor::<B, 3>([BATCH, MEMORY, D_MODEL], 6, device)
}

fn recorder() -> NamedMpkBytesRecorder<FullPrecisionSettings> {
    NamedMpkBytesRecorder::default()
}

/// burn-nn's encoder (causal through an autoregressive mask): its output and record.
fn burn_nn_encoder(norm_first: bool) -> (Tensor<Inner, 3>, Vec<u8>) {
    let device = Default::default();
    let config = burn_nn::TransformerEncoderConfig::new(D_MODEL, D_FF, HEADS, LAYERS).with_dropout(0.0).with_norm_first(norm_first);
    let encoder = deterministic_params(config.init::<Inner>(&device), 3);
    let mask = generate_autoregressive_mask::<Inner>(BATCH, SEQ, &device);
    let output = encoder.forward(burn_nn::TransformerEncoderInput::new(target(&device)).mask_attn(mask));
    (output, recorder().record(encoder.into_record(), ()).unwrap())
}

fn drop_in_encoder<B: Backend>(bytes: Vec<u8>, norm_first: bool, device: &B::Device) -> nn::TransformerEncoder<B> {
    let config = nn::TransformerEncoderConfig::new(D_MODEL, D_FF, HEADS, LAYERS).with_dropout(0.0).with_norm_first(norm_first);
    config.init::<B>(device).load_record(recorder().load(bytes, device).unwrap())
}

fn burn_nn_decoder(norm_first: bool) -> (Tensor<Inner, 3>, Vec<u8>) {
    let device = Default::default();
    let config = burn_nn::TransformerDecoderConfig::new(D_MODEL, D_FF, HEADS, LAYERS).with_dropout(0.0).with_norm_first(norm_first);
    let decoder = deterministic_params(config.init::<Inner>(&device), 4);
    let mask = generate_autoregressive_mask::<Inner>(BATCH, SEQ, &device);
    let output = decoder.forward(burn_nn::TransformerDecoderInput::new(target(&device), memory(&device)).target_mask_attn(mask));
    (output, recorder().record(decoder.into_record(), ()).unwrap())
}

fn drop_in_decoder<B: Backend>(bytes: Vec<u8>, norm_first: bool, device: &B::Device) -> nn::TransformerDecoder<B> {
    let config = nn::TransformerDecoderConfig::new(D_MODEL, D_FF, HEADS, LAYERS).with_dropout(0.0).with_norm_first(norm_first);
    config.init::<B>(device).load_record(recorder().load(bytes, device).unwrap())
}

/// Within 1e-6 of burn-nn relative to the output's largest magnitude (a pre-norm stack's
/// output is not normalised: f32 rounding grows with it).
fn assert_close(got: Tensor<Inner, 3>, want: Tensor<Inner, 3>, what: &str) {
    let want = values(want);
    let scale = want.iter().fold(1.0f32, |m, v| if v.abs() > m { v.abs() } else { m });
    let diff = max_abs_diff(&values(got), &want) / scale;
    println!("{what}: max |Δ| relative to the largest value ({scale:.2}) {diff:.2e}");
    assert!(diff <= 1e-6, "{what} differs from burn-nn by {diff:e} of its largest value");
}

#[test]
fn the_encoder_loads_burn_nn_records_and_gives_its_output() {
    let device = Default::default();
    for norm_first in [false, true] {
        let (want, bytes) = burn_nn_encoder(norm_first);
        let got = drop_in_encoder::<Inner>(bytes, norm_first, &device).forward(nn::TransformerEncoderInput::new(target(&device)).causal());
        assert_close(got, want, &format!("encoder, norm_first {norm_first}"));
    }
}

#[test]
fn the_decoder_loads_burn_nn_records_and_gives_its_output() {
    let device = Default::default();
    for norm_first in [false, true] {
        let (want, bytes) = burn_nn_decoder(norm_first);
        let input = nn::TransformerDecoderInput::new(target(&device), memory(&device)).target_causal();
        let got = drop_in_decoder::<Inner>(bytes, norm_first, &device).forward(input);
        assert_close(got, want, &format!("decoder, norm_first {norm_first}"));
    }
}

/// Each rank of `sp` runs `work` on its shards of the target and the memory; its output, or
/// its panic message.
fn on_ranks(sp: usize, work: impl Fn(Tensor<Sp, 3>, Tensor<Sp, 3>) -> Tensor<Sp, 3> + Send + Sync + 'static) -> Vec<Result<Vec<f32>, String>> {
    with_deadline(Duration::from_secs(90), move || {
        ThreadGroup::new(sp)
            .run(|rank| {
                let _sp = Sp::enter_thread(rank.communicator());
                let (r, p) = (rank.rank(), rank.size());
                let device = Default::default();
                values(work(shard(target::<Sp>(&device), 1, r, p), shard(memory::<Sp>(&device), 1, r, p)))
            })
            .into_iter()
            .map(|result| result.map_err(|panic| panic.message))
            .collect()
    })
}

fn assert_sequence_parallel(results: Vec<Result<Vec<f32>, String>>, want: &Tensor<Inner, 3>, what: &str) {
    let p = results.len();
    for (rank, got) in results.into_iter().enumerate() {
        let got = got.unwrap_or_else(|message| panic!("{what}, rank {rank} of {p}: {message}"));
        let diff = max_abs_diff(&got, &values(shard(want.clone(), 1, rank, p)));
        println!("{what}, rank {rank} of {p} vs one device: max |Δ| {diff:.2e}");
        assert!(diff <= 1e-5, "{what}: rank {rank} of {p} differs from one device by {diff:e}");
    }
}

#[test]
fn the_encoder_and_decoder_are_sequence_parallel_at_sp_2_and_4() {
    let (encoded, encoder) = burn_nn_encoder(true);
    let (decoded, decoder) = burn_nn_decoder(false);
    for sp in [2, 4] {
        let bytes = encoder.clone();
        let results = on_ranks(sp, move |x, _| drop_in_encoder::<Sp>(bytes.clone(), true, &x.device()).forward(nn::TransformerEncoderInput::new(x).causal()));
        assert_sequence_parallel(results, &encoded, "encoder");
        let bytes = decoder.clone();
        let results = on_ranks(sp, move |x, memory| {
            drop_in_decoder::<Sp>(bytes.clone(), false, &x.device()).forward(nn::TransformerDecoderInput::new(x, memory).target_causal())
        });
        assert_sequence_parallel(results, &decoded, "decoder");
    }
}

/// A sequence the sharder pads (15 tokens at SP = 2 and 4: 16 a rank group, one padding token)
/// through the encoder that looks both ways: with the shard's `mask_pad` each rank's real
/// tokens give one device's output for the 15 tokens alone, which no padding reaches.
#[test]
fn the_sharders_padding_is_masked_for_attention_that_looks_both_ways() {
    const TOKENS: usize = 15;
    let sequence: Vec<i64> = (0..TOKENS as i64).map(|t| t * 7 % 50).collect();
    let (_, bytes) = burn_nn_encoder(true);
    let encode = |ids: Tensor<Sp, 2, Int>, mask_pad: Option<Tensor<Sp, 2, burn::tensor::Bool>>, bytes: Vec<u8>| {
        let device = ids.device();
        let embedding = deterministic_params(burn::nn::EmbeddingConfig::new(50, D_MODEL).init::<Sp>(&device), 9);
        let input = nn::TransformerEncoderInput::new(embedding.forward(ids));
        drop_in_encoder::<Sp>(bytes, true, &device).forward(match mask_pad {
            Some(mask) => input.mask_pad(mask),
            None => input,
        })
    };
    let want = values(encode(Tensor::from_data(TensorData::new(sequence.clone(), [1, TOKENS]), &Default::default()), None, bytes.clone()));
    for (sp, masked) in [(2, true), (4, true), (2, false)] {
        let (sequence, bytes) = (sequence.clone(), bytes.clone());
        let results = with_deadline(Duration::from_secs(90), move || {
            ThreadGroup::new(sp).run(|rank| {
                let _sp = Sp::enter_thread(rank.communicator());
                let shard = SequenceSharder::new(sp).shard(&[sequence.clone()], rank.rank());
                let device = Default::default();
                let real = shard.padding.iter().filter(|&&padding| !padding).count();
                let mask = masked.then(|| shard.mask_pad::<Sp>(&device));
                (values(encode(shard.tokens::<Sp>(&device), mask, bytes.clone())), real)
            })
        });
        let mut worst = 0.0f32;
        for (rank, result) in results.into_iter().enumerate() {
            let (got, real) = result.unwrap_or_else(|panic| panic!("SP = {sp}, rank {rank}: {}", panic.message));
            let start = rank * (TOKENS + 1) / sp * D_MODEL;
            worst = worst.max(max_abs_diff(&got[..real * D_MODEL], &want[start..start + real * D_MODEL]));
        }
        println!("SP = {sp}, padding masked: {masked}: max |Δ| from one device {worst:.2e}");
        match masked {
            true => assert!(worst <= 1e-5, "SP = {sp}: {worst:e} from one device with the padding masked"),
            false => assert!(worst > 1e-3, "the padding unmasked changed nothing ({worst:e}): the test cannot see it"),
        }
    }
    // One token a rank (3 tokens padded to 4 at SP = 4): the drop-in's `mask_pad` is taken for
    // the key-padding mask it is, not refused as a mask the shard might have built itself.
    let short: Vec<i64> = sequence[..3].to_vec();
    let want = values(encode(Tensor::from_data(TensorData::new(short.clone(), [1, 3]), &Default::default()), None, bytes.clone()));
    let results = with_deadline(Duration::from_secs(90), move || {
        ThreadGroup::new(4).run(|rank| {
            let _sp = Sp::enter_thread(rank.communicator());
            let shard = SequenceSharder::new(4).shard(&[short.clone()], rank.rank());
            let device = Default::default();
            values(encode(shard.tokens::<Sp>(&device), Some(shard.mask_pad::<Sp>(&device)), bytes.clone()))
        })
    });
    for (rank, result) in results.into_iter().enumerate().take(3) {
        let got = result.unwrap_or_else(|panic| panic!("one token a rank, rank {rank}: {}", panic.message));
        let worst = max_abs_diff(&got, &want[rank * D_MODEL..(rank + 1) * D_MODEL]);
        assert!(worst <= 1e-5, "one token a rank, rank {rank}: {worst:e} from one device");
    }
}
