//! Attention done by hand is refused under sequence parallelism, however the data was sharded,
//! and the port is short.
//!
//! - Four models that attend by hand (burn-nn's `MultiHeadAttention`, burn-nn's transformer
//!   encoder, a Llama attention written the usual Burn way with `[B, H, S, d]` heads, the same
//!   with heads folded into the batch, `[B·H, S, d]`) at SP = 2 and 3, each rank's input cut by
//!   `narrow` (no sharder, nothing recorded): every rank stops with the guard's message (no
//!   hang, no result). At SP = 1 and without a group they give one device's output.
//! - What the guard prevents: let through (the opt-out), each rank attends within its shard
//!   and the models' outputs are far from one device's.
//! - The same Llama ported as the porting guide (docs/library.md) shows (the attention op, `is_causal`,
//!   RoPE at the shard's global offset) equals the hand-written one on one device at SP = 2
//!   and 4; the guide's diff is checked against this file.
//! - The drop-in `burn_ulysses::nn::MultiHeadAttention` with `MhaInput::causal()` gives
//!   burn-nn's output with an autoregressive mask from the same record (≤ 1e-6) and is
//!   sequence parallel at SP = 2 and 4.
//! - Weights applied to values transposed (`vᵀ·wᵀ`), scores against quantized keys (burn's
//!   `q_matmul`) and integer scores (`int_matmul`) are refused too.
//! - Grouped query heads folded into rows (`[B, Hkv, G·S, d]`) are refused once the ranks
//!   embed their token ids (cut by `narrow`); let through, they attend within each shard.
//! - So are queries in chunks, latents, one pooling query and a loop over heads at batch 1
//!   (sums over the shard's tokens, known by the ids' length), and, with the heads folded into
//!   the batch, linear attention's `φ(k)ᵀ·v` and a Perceiver's latents; cross-attention and a
//!   stack of experts as wide as the shard pass.
//! - Attention with no matmul (scores a broadcast product summed, then softmax) and positions
//!   made of a mask's cumsum are refused too, naming the op; so are convolutions and pooling
//!   windows across the shard's edges (causal, overlapping, transposed, pooled to a length) and
//!   the sequence, its ids or a mask reversed. Windows that tile the shard (a patch embedding,
//!   pooling by a factor, under a zigzag ring too) pass and give one device's output.
//! - A linear layer as wide as the local sequence passes the guard.
//! - Positions counted from each rank's first token, through `evaluate` and `train_step` (which
//!   note the shard's positions): RoPE (`RotaryEncoding::forward`), burn-nn's sinusoids, a
//!   learned position embedding of `arange(0..len)` and a learned table's first rows (a
//!   parameter, tracked by autodiff) are refused on the ranks whose shard starts
//!   past 0 (the others stop as their peer leaves); RoPE at the shard's offset and a learned
//!   embedding at `positions.ids` give one device's loss at SP = 2 and 3. A token shift by a
//!   slice, or by `roll_dim`, is refused on every rank.

use std::time::Duration;

use burn::{
    backend::{Autodiff, NdArray},
    module::Module,
    nn::{
        Embedding, EmbeddingConfig, Linear, LinearConfig, PositionalEncodingConfig, RotaryEncoding, RotaryEncodingConfig,
        attention::{self as burn_nn, generate_autoregressive_mask},
        transformer::{TransformerEncoderConfig, TransformerEncoderInput},
    },
    record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder},
    tensor::{
        Int, Tensor, activation::softmax, backend::Backend, module::attention,
        ops::{AttentionModuleOptions, PadMode},
        quantization::{QuantScheme, QuantStore, QuantValue},
    },
};
use burn_ulysses::{RankScope, UlyssesBackend, UlyssesConfig, comm::ThreadGroup, data::ShardPositions, nn};
use ulysses_suite::{deterministic_params, max_abs_diff, shard, uniform_tensor, values, with_deadline};

type Inner = NdArray<f32>;
type Sp = UlyssesBackend<Autodiff<Inner>>;

const BATCH: usize = 2;
/// Divides by 2, 3 and 4: the group sizes below.
const SEQ: usize = 12;
const D_MODEL: usize = 32;
const HEADS: usize = 4;
const VOCAB: usize = 50;
const TOLERANCE: f32 = 1e-5;

/// What every rank must say when it refuses.
const REFUSAL: &str = "attention done by hand under sequence parallelism";

fn input<B: Backend>(device: &B::Device) -> Tensor<B, 3> {
    uniform_tensor::<B, 3>([BATCH, SEQ, D_MODEL], 5, device)
}

/// `work` on each of `sp` rank threads with its shard of the input, cut by `narrow` (nothing
/// tells the backend the shard's length); each rank's output, or its panic message.
fn on_ranks(sp: usize, config: UlyssesConfig, work: impl Fn(Tensor<Sp, 3>, usize) -> Tensor<Sp, 3> + Send + Sync + 'static) -> Vec<Result<Vec<f32>, String>> {
    with_deadline(Duration::from_secs(60), move || {
        ThreadGroup::new(sp)
            .run(|rank| {
                let _sp = Sp::enter(RankScope::Thread, rank.communicator(), config.clone());
                let (r, p) = (rank.rank(), rank.size());
                let x = shard(input::<Sp>(&Default::default()), 1, r, p);
                values(work(x, r * SEQ / p))
            })
            .into_iter()
            .map(|result| result.map_err(|panic| panic.message))
            .collect()
    })
}

fn assert_refused_on_every_rank(results: &[Result<Vec<f32>, String>], what: &str) {
    let p = results.len();
    for (rank, result) in results.iter().enumerate() {
        match result {
            Ok(_) => panic!("{what}: rank {rank} of {p} attended by hand under SP and returned a result"),
            Err(message) => assert!(message.contains(REFUSAL) && message.contains("module::attention"), "{what}, rank {rank} of {p}: {message}"),
        }
    }
}

/// Each rank's output against its shard of `want` (the whole sequence on one device).
fn assert_sequence_parallel(results: Vec<Result<Vec<f32>, String>>, want: Tensor<Inner, 3>) {
    let p = results.len();
    for (rank, got) in results.into_iter().enumerate() {
        let got = got.unwrap_or_else(|message| panic!("rank {rank} of {p}: {message}"));
        let diff = max_abs_diff(&got, &values(shard(want.clone(), 1, rank, p)));
        println!("rank {rank} of {p} vs one device: max |Δ| {diff:.2e}");
        assert!(diff <= TOLERANCE, "rank {rank} of {p} differs from one device by {diff:e}");
    }
}

fn burn_nn_mha<B: Backend>(device: &B::Device) -> burn_nn::MultiHeadAttention<B> {
    deterministic_params(burn_nn::MultiHeadAttentionConfig::new(D_MODEL, HEADS).with_dropout(0.0).init::<B>(device), 7)
}

/// A Llama attention block, written the usual Burn way, and ported.
#[derive(Module, Debug)]
struct LlamaAttention<B: Backend> {
    wq: Linear<B>,
    wk: Linear<B>,
    wv: Linear<B>,
    wo: Linear<B>,
    rope: RotaryEncoding<B>,
    heads: usize,
    head_dim: usize,
}

impl<B: Backend> LlamaAttention<B> {
    fn new(device: &B::Device) -> Self {
        let linear = || LinearConfig::new(D_MODEL, D_MODEL).with_bias(false).init(device);
        let module = Self {
            wq: linear(),
            wk: linear(),
            wv: linear(),
            wo: linear(),
            rope: RotaryEncodingConfig::new(4 * SEQ, D_MODEL / HEADS).init(device),
            heads: HEADS,
            head_dim: D_MODEL / HEADS,
        };
        deterministic_params(module, 11)
    }

    /// `[batch, seq, d_model]` → `[batch, heads, seq, head_dim]`.
    fn split_heads(&self, x: Tensor<B, 3>) -> Tensor<B, 4> {
        let [batch, seq, _] = x.dims();
        x.reshape([batch, seq, self.heads, self.head_dim]).swap_dims(1, 2)
    }

    fn merge_heads(&self, x: Tensor<B, 4>) -> Tensor<B, 3> {
        let [batch, _, seq, _] = x.dims();
        self.wo.forward(x.swap_dims(1, 2).reshape([batch, seq, self.heads * self.head_dim]))
    }

    /// Attention by hand: scores by matmul, a causal mask from the input's own length, RoPE
    /// from position 0.
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [batch, seq, _] = x.dims();
        let q = self.rope.forward(self.split_heads(self.wq.forward(x.clone())));
        let k = self.rope.forward(self.split_heads(self.wk.forward(x.clone())));
        let v = self.split_heads(self.wv.forward(x.clone()));
        let scores = q.matmul(k.swap_dims(2, 3)) / (self.head_dim as f64).sqrt();
        let mask = generate_autoregressive_mask::<B>(batch, seq, &x.device()).unsqueeze_dim::<4>(1);
        let scores = scores.mask_fill(mask, f32::NEG_INFINITY);
        self.merge_heads(softmax(scores, 3).matmul(v))
    }

    /// The same attention with heads folded into the batch, `[B·H, S, d]`, as many hand-written
    /// models do it.
    fn forward_folded(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [batch, seq, _] = x.dims();
        let fold = |t: Tensor<B, 4>| t.reshape([batch * self.heads, seq, self.head_dim]);
        let q = fold(self.rope.forward(self.split_heads(self.wq.forward(x.clone()))));
        let k = fold(self.rope.forward(self.split_heads(self.wk.forward(x.clone()))));
        let v = fold(self.split_heads(self.wv.forward(x.clone())));
        let scores = q.matmul(k.swap_dims(1, 2)) / (self.head_dim as f64).sqrt();
        let mask = generate_autoregressive_mask::<B>(batch * self.heads, seq, &x.device());
        let scores = scores.mask_fill(mask, f32::NEG_INFINITY);
        let context = softmax(scores, 2).matmul(v).reshape([batch, self.heads, seq, self.head_dim]);
        self.merge_heads(context)
    }

    /// The same block made sequence parallel (the porting guide, docs/library.md): the attention op,
    /// `is_causal` for the mask, RoPE at the shard's first global position.
    fn forward_ported(&self, x: Tensor<B, 3>, position_offset: usize) -> Tensor<B, 3> {
        let q = self.rope.apply(self.split_heads(self.wq.forward(x.clone())), position_offset);
        let k = self.rope.apply(self.split_heads(self.wk.forward(x.clone())), position_offset);
        let v = self.split_heads(self.wv.forward(x.clone()));
        let causal = AttentionModuleOptions { scale: None, softcap: None, is_causal: true };
        self.merge_heads(attention(q, k, v, None, None, causal))
    }
}

/// The models that attend by hand.
#[derive(Debug, Clone, Copy)]
enum HandWritten {
    BurnNnMultiHeadAttention,
    BurnNnTransformerEncoder,
    LlamaWithHeads,
    LlamaWithHeadsFoldedIntoTheBatch,
}

impl HandWritten {
    const ALL: [Self; 4] = [Self::BurnNnMultiHeadAttention, Self::BurnNnTransformerEncoder, Self::LlamaWithHeads, Self::LlamaWithHeadsFoldedIntoTheBatch];

    /// The model (the same parameters on every rank and device) applied to `x`.
    fn forward<B: Backend>(self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let device = x.device();
        match self {
            Self::BurnNnMultiHeadAttention => burn_nn_mha::<B>(&device).forward(burn_nn::MhaInput::self_attn(x)).context,
            Self::BurnNnTransformerEncoder => {
                let config = TransformerEncoderConfig::new(D_MODEL, 48, HEADS, 2).with_dropout(0.0);
                deterministic_params(config.init::<B>(&device), 3).forward(TransformerEncoderInput::new(x))
            }
            Self::LlamaWithHeads => LlamaAttention::<B>::new(&device).forward(x),
            Self::LlamaWithHeadsFoldedIntoTheBatch => LlamaAttention::<B>::new(&device).forward_folded(x),
        }
    }
}

#[test]
fn attention_by_hand_is_refused_on_every_rank_at_sp_2_and_3() {
    for model in HandWritten::ALL {
        for sp in [2, 3] {
            assert_refused_on_every_rank(&on_ranks(sp, UlyssesConfig::new(), move |x, _| model.forward(x)), &format!("{model:?} at SP = {sp}"));
        }
    }
}

#[test]
fn attention_by_hand_runs_unchanged_at_sp_1_and_without_a_group() {
    let device = Default::default();
    for model in HandWritten::ALL {
        let want = model.forward(input::<Inner>(&device));
        let alone = model.forward(input::<Sp>(&device));
        let diff = max_abs_diff(&values(alone), &values(want.clone()));
        println!("{model:?} without a group vs the plain backend: max |Δ| {diff:.2e}");
        assert!(diff <= TOLERANCE, "{model:?} without a group: {diff:e}");
        assert_sequence_parallel(on_ranks(1, UlyssesConfig::new(), move |x, _| model.forward(x)), want);
    }
    // Folding the heads into the batch changes nothing but the shapes.
    let heads = HandWritten::LlamaWithHeads.forward(input::<Inner>(&device));
    let folded = HandWritten::LlamaWithHeadsFoldedIntoTheBatch.forward(input::<Inner>(&device));
    let diff = max_abs_diff(&values(folded), &values(heads));
    assert!(diff <= TOLERANCE, "the folded Llama differs from the one with heads by {diff:e}");
}

#[test]
fn what_the_guard_prevents_every_rank_attends_within_its_shard() {
    // Let through (the opt-out), each rank gives what the model gives on its shard alone,
    // which is far from its shard of one device's output: the silently wrong result.
    let device = Default::default();
    for model in HandWritten::ALL {
        let want = model.forward(input::<Inner>(&device));
        for sp in [2, 3] {
            let config = UlyssesConfig::new().with_shard_local_attention_on_purpose(true);
            let mut worst = 0.0f32;
            for (rank, got) in on_ranks(sp, config, move |x, _| model.forward(x)).into_iter().enumerate() {
                let got = got.unwrap_or_else(|message| panic!("{model:?}, rank {rank} of {sp}: {message}"));
                let alone = model.forward(shard(input::<Inner>(&device), 1, rank, sp));
                let diff = max_abs_diff(&got, &values(alone));
                assert!(diff <= TOLERANCE, "{model:?}, rank {rank} of {sp}: {diff:e} from its shard alone");
                worst = worst.max(max_abs_diff(&got, &values(shard(want.clone(), 1, rank, sp))));
            }
            println!("{model:?} at SP = {sp}, attending within each shard: max |Δ| from one device {worst:.2e}");
            assert!(worst > 0.05, "{model:?} at SP = {sp}: shard-local attention only {worst:e} from one device");
        }
    }
}

#[test]
fn the_ported_llama_attention_equals_one_device_at_sp_2_and_4() {
    let device = Default::default();
    let want = LlamaAttention::<Inner>::new(&device).forward(input::<Inner>(&device));
    let ported = LlamaAttention::<Inner>::new(&device).forward_ported(input::<Inner>(&device), 0);
    let diff = max_abs_diff(&values(ported), &values(want.clone()));
    assert!(diff <= TOLERANCE, "the port changes the single-device output by {diff:e}");
    for sp in [2, 4] {
        assert_sequence_parallel(on_ranks(sp, UlyssesConfig::new(), |x, offset| LlamaAttention::<Sp>::new(&x.device()).forward_ported(x, offset)), want.clone());
    }
}

/// `x` as `[batch, heads, seq, head_dim]`.
fn heads<B: Backend>(x: Tensor<B, 3>) -> Tensor<B, 4> {
    let [batch, seq, _] = x.dims();
    x.reshape([batch, seq, HEADS, D_MODEL / HEADS]).swap_dims(1, 2)
}

#[test]
fn weights_applied_to_values_transposed_are_refused() {
    // The scores without a matmul (a broadcast product summed), then vᵀ·wᵀ: a product by a
    // square [S/P, S/P] right operand, the weights of a rank's shard.
    let results = on_ranks(2, UlyssesConfig::new(), |x, _| {
        let [batch, seq, _] = x.dims();
        let (q, v) = (heads(x.clone()), heads(x * 0.5));
        let scores = (q.clone().unsqueeze_dim::<5>(3) * q.unsqueeze_dim::<5>(2)).sum_dim(4).squeeze_dim::<4>(4);
        // Normalised by hand: softmax over the weights is refused itself (below).
        let weights = scores.exp();
        let weights = weights.clone() / weights.sum_dim(3);
        let context = v.swap_dims(2, 3).matmul(weights.swap_dims(2, 3)).swap_dims(2, 3);
        context.swap_dims(1, 2).reshape([batch, seq, D_MODEL])
    });
    assert_refused_on_every_rank(&results, "vᵀ·wᵀ");
}

/// Attention with no matmul at all: the scores a broadcast product summed over the head dim,
/// the weights applied to the values the same way.
fn attention_without_a_matmul<B: Backend>(x: Tensor<B, 3>) -> Tensor<B, 3> {
    let [batch, seq, _] = x.dims();
    let (q, v) = (heads(x.clone()), heads(x * 0.5));
    let scores = (q.clone().unsqueeze_dim::<5>(3) * q.unsqueeze_dim::<5>(2)).sum_dim(4).squeeze_dim::<4>(4) / ((D_MODEL / HEADS) as f64).sqrt();
    let weights = softmax(scores, 3);
    let context = (weights.unsqueeze_dim::<5>(4) * v.unsqueeze_dim::<5>(2)).sum_dim(3).squeeze_dim::<4>(3);
    context.swap_dims(1, 2).reshape([batch, seq, D_MODEL])
}

/// Positions made of a padding mask's cumsum (as Hugging Face's models make them), added to the
/// embedded tokens.
fn positions_from_a_mask<B: Backend>(ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
    let embedding = deterministic_params(EmbeddingConfig::new(VOCAB, D_MODEL).init::<B>(&ids.device()), 13);
    let x = embedding.forward(ids.clone());
    let positions = ids.ones_like().cumsum(1) - 1;
    x + positions.float().unsqueeze_dim::<3>(2)
}

/// Each rank's refusal names `op` and the fix, and says it would have run within the shard.
fn assert_shard_local_refused<T>(results: &[Result<T, String>], op: &str, fix: &str) {
    for (rank, result) in results.iter().enumerate() {
        match result {
            Ok(_) => panic!("{op}: rank {rank} returned a result"),
            Err(message) => assert!(message.contains(&format!("{op} along dim")) && message.contains("within this rank's shard alone") && message.contains(fix), "{op}, rank {rank}: {message}"),
        }
    }
}

/// What no matmul shows: a softmax over the shard's per-head weights, and a scan along the
/// shard (positions that restart at every rank). Refused at SP = 2 and 3; one device's output
/// at SP = 1; let through, each rank's output is far from one device's.
#[test]
fn attention_without_a_matmul_and_positions_from_a_cumsum_are_refused() {
    for sp in [2, 3] {
        assert_shard_local_refused(&on_ranks(sp, UlyssesConfig::new(), |x, _| attention_without_a_matmul(x)), "softmax", "module::attention");
        assert_shard_local_refused(&on_ranks_from_ids(sp, UlyssesConfig::new(), positions_from_a_mask), "cumsum", "SequenceShard::positions");
    }
    assert_sequence_parallel(on_ranks(1, UlyssesConfig::new(), |x, _| attention_without_a_matmul(x)), attention_without_a_matmul(input::<Inner>(&Default::default())));
    let want = positions_from_a_mask(token_ids::<Inner>(&Default::default()));
    assert_sequence_parallel(on_ranks_from_ids(1, UlyssesConfig::new(), positions_from_a_mask), want.clone());
    let on_purpose = UlyssesConfig::new().with_shard_local_attention_on_purpose(true);
    let got = on_ranks_from_ids(2, on_purpose, positions_from_a_mask).pop().unwrap().unwrap();
    let worst = max_abs_diff(&got, &values(shard(want, 1, 1, 2)));
    assert!(worst >= 5.0, "rank 1's positions restarted, yet only {worst} from one device's");
}

/// What mixes neighbouring tokens without attention, each over the embedded tokens `[B, S, D]`:
/// a causal depthwise convolution along the sequence (a Mamba block's, kernel 4: burn pads 3
/// tokens on the left itself), a pooling window of 3, max pooling with its indices (windows of
/// 3 every 2 tokens), an upsampling whose kernel (4) overlaps the next token's (stride 2), a
/// pooling to a fixed length, sliding windows of 3 by `unfold`, a convolution of 3 over the
/// sequence pooled by 2 (an hourglass's), and the sequence reversed (a backward RNN's input), its token
/// ids reversed (an int flip) or a padding mask reversed (a bool flip).
#[derive(Clone, Copy, Debug)]
enum MixesNeighbours {
    CausalConvolution,
    Pooling,
    MaxPooling,
    OverlappingUpsampling,
    PooledToLength,
    SlidingWindows,
    ConvolutionAfterPooling,
    Reversed,
    ReversedIds,
    ReversedMask,
}

impl MixesNeighbours {
    const ALL: [Self; 10] = [
        Self::CausalConvolution,
        Self::Pooling,
        Self::MaxPooling,
        Self::OverlappingUpsampling,
        Self::PooledToLength,
        Self::SlidingWindows,
        Self::ConvolutionAfterPooling,
        Self::Reversed,
        Self::ReversedIds,
        Self::ReversedMask,
    ];

    fn forward<B: Backend>(self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        use burn::nn::{
            PaddingConfig1d,
            conv::{Conv1dConfig, ConvTranspose1dConfig},
            pool::AvgPool1dConfig,
        };
        use burn::tensor::module::{adaptive_avg_pool1d, max_pool1d_with_indices};
        let device = ids.device();
        let embed = |ids: Tensor<B, 2, Int>, seed| deterministic_params(EmbeddingConfig::new(VOCAB, D_MODEL).init::<B>(&device), seed).forward(ids);
        let x = embed(ids.clone(), 13);
        let channels_first = x.clone().swap_dims(1, 2);
        let channels_last = |y: Tensor<B, 3>| y.swap_dims(1, 2);
        match self {
            Self::CausalConvolution => {
                let conv = Conv1dConfig::new(D_MODEL, D_MODEL, 4).with_groups(D_MODEL).with_padding(PaddingConfig1d::Explicit(3, 0));
                channels_last(deterministic_params(conv.init::<B>(&device), 17).forward(channels_first))
            }
            Self::Pooling => channels_last(AvgPool1dConfig::new(3).with_stride(1).with_padding(PaddingConfig1d::Explicit(1, 1)).init().forward(channels_first)),
            Self::MaxPooling => {
                let (pooled, indices) = max_pool1d_with_indices(channels_first, 3, 2, 1, 1, false);
                channels_last(pooled + indices.float() * 0.01)
            }
            Self::OverlappingUpsampling => {
                let conv = ConvTranspose1dConfig::new([D_MODEL, D_MODEL], 4).with_stride(2).with_padding(1);
                channels_last(deterministic_params(conv.init::<B>(&device), 19).forward(channels_first))
            }
            Self::PooledToLength => channels_last(adaptive_avg_pool1d(channels_first, 2)),
            Self::SlidingWindows => x.unfold::<4, _>(1, 3, 1).sum_dim(3).squeeze_dim(3),
            Self::ConvolutionAfterPooling => {
                // Pooling by 2 tiles the shard (it passes); the convolution of 3 after it does not.
                let pooled = AvgPool1dConfig::new(2).with_stride(2).init().forward(channels_first);
                let conv = Conv1dConfig::new(D_MODEL, D_MODEL, 3).with_padding(PaddingConfig1d::Explicit(1, 1));
                channels_last(deterministic_params(conv.init::<B>(&device), 29).forward(pooled))
            }
            Self::Reversed => x.flip([1]),
            // Flipped after the first embedding, where the guard knows the shard's length.
            Self::ReversedIds => x + embed(ids.flip([1]), 23),
            Self::ReversedMask => {
                let [batch, seq] = ids.dims();
                let padding = ids.lower_elem(10).flip([1]);
                x.mask_fill(padding.unsqueeze_dim::<3>(2).expand([batch, seq, D_MODEL]), 0.0)
            }
        }
    }

    /// The op the guard names, and a word of its fix.
    fn refusal(self) -> (&'static str, &'static str) {
        match self {
            Self::CausalConvolution => ("conv1d", "halo"),
            Self::Pooling => ("avg_pool1d", "halo"),
            Self::MaxPooling => ("max_pool1d", "tile the shard"),
            Self::OverlappingUpsampling => ("conv_transpose1d", "a block of outputs of its own"),
            Self::PooledToLength => ("adaptive_avg_pool1d", "kernel = stride"),
            Self::SlidingWindows => ("unfold", "halo"),
            Self::ConvolutionAfterPooling => ("conv1d", "halo"),
            Self::Reversed | Self::ReversedIds | Self::ReversedMask => ("flip", "before it is sharded"),
        }
    }

    /// Whether a rank's output, let through, is as long as its shard of one device's (pooled
    /// to a fixed length or unfolded into windows of 3, it is not: each rank makes that
    /// length, or 2 fewer windows than tokens).
    fn shards_like_the_sequence(self) -> bool {
        !matches!(self, Self::PooledToLength | Self::SlidingWindows)
    }
}

/// A convolution or pooling window along the shard and a flip of it are refused at SP = 2 and
/// 3, naming the op; at SP = 1 they give one device's output; let through, rank 1's output is
/// far from its shard of one device's (its first tokens read padding, or another rank's
/// tokens belong there).
#[test]
fn windows_along_the_shard_and_flips_of_it_are_refused() {
    for form in MixesNeighbours::ALL {
        let (op, fix) = form.refusal();
        for sp in [2, 3] {
            assert_shard_local_refused(&on_ranks_from_ids(sp, UlyssesConfig::new(), move |ids| form.forward(ids)), op, fix);
        }
        let want = form.forward(token_ids::<Inner>(&Default::default()));
        assert_sequence_parallel(on_ranks_from_ids(1, UlyssesConfig::new(), move |ids| form.forward(ids)), want.clone());
        if form.shards_like_the_sequence() {
            let on_purpose = UlyssesConfig::new().with_shard_local_attention_on_purpose(true);
            let got = on_ranks_from_ids(2, on_purpose, move |ids| form.forward(ids)).pop().unwrap().unwrap();
            let worst = max_abs_diff(&got, &values(shard(want, 1, 1, 2)));
            assert!(worst >= 1e-2, "{form:?}: rank 1 ran within its shard, yet only {worst:e} from one device's");
        }
    }
}

/// A real FFT along the sequence mixes every token of it: FNet's token mixing (the real part
/// of the embedded tokens' spectrum, padded to 16 points) and a long convolution's filter made
/// back from a spectrum to the shard's tokens padded to twice their length (cropped to them)
/// are refused at SP = 2 and 3, naming the op. (burn's autodiff has no FFT, so this runs in
/// inference alone, where the guard is the same.)
#[test]
fn an_fft_along_the_shard_is_refused() {
    fn embedded(ids: Tensor<Sp, 2, Int>) -> Tensor<Sp, 3> {
        deterministic_params(EmbeddingConfig::new(VOCAB, D_MODEL).init::<Sp>(&ids.device()), 13).forward(ids)
    }
    let fnet = |ids: Tensor<Sp, 2, Int>| burn::tensor::signal::rfft(embedded(ids), 1, Some(16)).0.narrow(1, 0, 2);
    let long_convolution = |ids: Tensor<Sp, 2, Int>| {
        let [batch, tokens] = ids.dims();
        let (device, x) = (ids.device(), embedded(ids));
        let points = (2 * tokens).next_power_of_two();
        let spectrum = || Tensor::<Sp, 3>::ones([batch, points / 2 + 1, D_MODEL], &device);
        let filter = burn::tensor::signal::irfft(spectrum(), spectrum(), 1, Some(points));
        x * filter.narrow(1, 0, tokens)
    };
    for sp in [2, 3] {
        assert_shard_local_refused(&on_ranks_from_ids(sp, UlyssesConfig::new(), fnet), "rfft", "enter_single_device");
        assert_shard_local_refused(&on_ranks_from_ids(sp, UlyssesConfig::new(), long_convolution), "irfft", "module::attention");
    }
}

/// A pooling over the whole shard (a kernel of the input's length: TextCNN's max over time, a
/// classifier's mean) tiles it with one window, and a CTC loss aligns its frames to whole
/// transcripts: each computes on the shard as if it were the sequence. Refused at SP = 2 and 3,
/// naming the op; at SP = 1 they give one device's output.
#[test]
fn a_pooling_over_the_whole_shard_and_a_ctc_loss_of_it_are_refused() {
    use burn::tensor::{activation::log_softmax, module::{avg_pool1d, ctc_loss, max_pool1d}};
    fn embedded<B: Backend>(ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        deterministic_params(EmbeddingConfig::new(VOCAB, D_MODEL).init::<B>(&ids.device()), 13).forward(ids)
    }
    fn over_time<B: Backend>(ids: Tensor<B, 2, Int>, max: bool) -> Tensor<B, 3> {
        let x = embedded(ids).swap_dims(1, 2);
        let length = x.dims()[2];
        let pooled = if max { max_pool1d(x, length, length, 0, 1, false) } else { avg_pool1d(x, length, length, 0, true, false) };
        pooled.swap_dims(1, 2)
    }
    fn ctc<B: Backend>(ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let device = ids.device();
        let x = embedded(ids);
        let [batch, frames, _] = x.dims();
        let targets = Tensor::<B, 2, Int>::from_data([[1, 2], [3, 4]], &device);
        let loss = ctc_loss(log_softmax(x, 2).swap_dims(0, 1), targets, Tensor::full([batch], frames as i64, &device), Tensor::full([batch], 2, &device), 0);
        loss.reshape([1, 1, batch])
    }
    for (op, max) in [("max_pool1d", true), ("avg_pool1d", false)] {
        for sp in [2, 3] {
            assert_shard_local_refused(&on_ranks_from_ids(sp, UlyssesConfig::new(), move |ids| over_time(ids, max)), op, "a window shorter than the shard");
        }
        let want = over_time(token_ids::<Inner>(&Default::default()), max);
        assert_sequence_parallel(on_ranks_from_ids(1, UlyssesConfig::new(), move |ids| over_time(ids, max)), want);
    }
    for sp in [2, 3] {
        assert_shard_local_refused(&on_ranks_from_ids(sp, UlyssesConfig::new(), ctc), "ctc_loss", "enter_single_device");
    }
    // Frames of another stream (5, no shard's length: an encoder's whole input) pass.
    let other_stream = |ids: Tensor<Sp, 2, Int>| {
        let device = ids.device();
        // The shard's tokens embedded, so that the guard knows its length.
        let _shard = embedded(ids);
        let frames = log_softmax(uniform_tensor::<Sp, 3>([5, 2, D_MODEL], 37, &device), 2);
        let targets = Tensor::<Sp, 2, Int>::from_data([[1, 2], [3, 4]], &device);
        ctc_loss(frames, targets, Tensor::full([2], 5, &device), Tensor::full([2], 2, &device), 0).reshape([1, 1, 2])
    };
    for (rank, result) in on_ranks_from_ids(2, UlyssesConfig::new(), other_stream).iter().enumerate() {
        assert!(result.as_ref().is_ok_and(|loss| loss.iter().all(|l| l.is_finite())), "rank {rank}: {result:?}");
    }
    let want = ctc(token_ids::<Inner>(&Default::default()));
    assert_sequence_parallel(on_ranks_from_ids(1, UlyssesConfig::new(), ctc), want);
}

/// Windows that tile the shard, each over the embedded tokens: a patch embedding (a
/// convolution with kernel = stride = 2), pooling by 2 (average, and max), chunks of 2 by
/// `unfold`, an upsampling by 2 (a transposed convolution with kernel = stride) and by 4 with
/// a kernel of 3 and an output padding of 1 (each token's block ends in a bias-only place).
#[derive(Clone, Copy, Debug)]
enum TilesTheShard {
    PatchEmbedding,
    AveragePooling,
    MaxPooling,
    Chunks,
    Upsampling,
    PaddedUpsampling,
}

impl TilesTheShard {
    fn forward<B: Backend>(self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        use burn::nn::conv::{Conv1dConfig, ConvTranspose1dConfig};
        use burn::tensor::module::{avg_pool1d, max_pool1d_with_indices};
        let device = ids.device();
        let x = deterministic_params(EmbeddingConfig::new(VOCAB, D_MODEL).init::<B>(&device), 13).forward(ids);
        let along_length = |window: &dyn Fn(Tensor<B, 3>) -> Tensor<B, 3>| window(x.clone().swap_dims(1, 2)).swap_dims(1, 2);
        match self {
            Self::PatchEmbedding => along_length(&|x| deterministic_params(Conv1dConfig::new(D_MODEL, D_MODEL, 2).with_stride(2).init::<B>(&device), 17).forward(x)),
            Self::AveragePooling => along_length(&|x| avg_pool1d(x, 2, 2, 0, true, false)),
            Self::MaxPooling => along_length(&|x| max_pool1d_with_indices(x, 2, 2, 0, 1, false).0),
            Self::Upsampling => along_length(&|x| deterministic_params(ConvTranspose1dConfig::new([D_MODEL, D_MODEL], 2).with_stride(2).init::<B>(&device), 19).forward(x)),
            Self::PaddedUpsampling => {
                let conv = ConvTranspose1dConfig::new([D_MODEL, D_MODEL], 3).with_stride(4).with_padding_out(1);
                along_length(&|x| deterministic_params(conv.init::<B>(&device), 31).forward(x))
            }
            // Along the sequence dim of [B, S, D]: each chunk's two tokens weighted 1 and 2.
            Self::Chunks => {
                let weights = Tensor::<B, 1>::from_floats([1.0, 2.0], &device).reshape([1, 1, 1, 2]);
                (x.unfold::<4, _>(1, 2, 2) * weights).sum_dim(3).squeeze_dim(3)
            }
        }
    }
}

/// Windows that tile the shard pass the guard and give each rank its shard of one device's
/// output at SP = 2 and 3 (shards of 6 and 4 tokens). At SP = 4 (shards of 3) the windows of
/// 2 would straddle two ranks and are refused; the upsamplings still pass (each token writes
/// its own outputs).
#[test]
fn windows_that_tile_the_shard_pass() {
    for form in [TilesTheShard::PatchEmbedding, TilesTheShard::AveragePooling, TilesTheShard::MaxPooling, TilesTheShard::Chunks, TilesTheShard::Upsampling, TilesTheShard::PaddedUpsampling] {
        let want = form.forward(token_ids::<Inner>(&Default::default()));
        for sp in [2, 3] {
            assert_sequence_parallel(on_ranks_from_ids(sp, UlyssesConfig::new(), move |ids| form.forward(ids)), want.clone());
        }
        let at_four = on_ranks_from_ids(4, UlyssesConfig::new(), move |ids| form.forward(ids));
        match form {
            TilesTheShard::Upsampling | TilesTheShard::PaddedUpsampling => assert_sequence_parallel(at_four, want),
            TilesTheShard::PatchEmbedding => assert_shard_local_refused(&at_four, "conv1d", "tile the shard"),
            TilesTheShard::Chunks => assert_shard_local_refused(&at_four, "unfold", "tile the shard"),
            _ => assert_shard_local_refused(&at_four, "_pool1d", "tile the shard"),
        }
    }
}

/// Under a zigzag ring a rank's shard may be two runs apart. Ring 2 with no Ulysses split:
/// rank 0 holds tokens 0–3 and 12–15 of 16, and pooling by 4 passes and gives one device's
/// pooled tokens at the shard's places, while pooling by 8 would mix the two runs and is
/// refused. Ulysses 3 × ring 2: the middle member of each ring rank's group holds 4–5 and
/// 18–19 of 24; pooling by 2 passes and matches, pooling by 4 is refused.
#[test]
fn pooling_under_a_zigzag_ring_tiles_each_run() {
    use burn::tensor::{TensorData, module::avg_pool1d};
    use burn_ulysses::{ParallelGroups, ParallelLayout, ring::RingSharding};
    fn pooled<B: Backend>(ids: Tensor<B, 2, Int>, by: usize) -> Tensor<B, 3> {
        let embedding = deterministic_params(EmbeddingConfig::new(VOCAB, D_MODEL).init(&ids.device()), 13);
        avg_pool1d(embedding.forward(ids).swap_dims(1, 2), by, by, 0, true, false).swap_dims(1, 2)
    }
    fn ids<B: Backend>(length: usize, device: &B::Device) -> Tensor<B, 2, Int> {
        Tensor::<B, 1, Int>::arange(0..(BATCH * length) as i64, device).remainder_scalar(VOCAB as i64).reshape([BATCH, length])
    }
    fn places<B: Backend>(positions: &[i64], device: &B::Device) -> Tensor<B, 1, Int> {
        Tensor::from_data(TensorData::new(positions.to_vec(), [positions.len()]), device)
    }
    // Each rank's token positions and its tokens pooled by `by`, or its panic message.
    let run = |sp: usize, length: usize, by: usize, config: UlyssesConfig| {
        let layout = ParallelLayout::new().with_sp_size(sp).with_ring_size(2).with_ring_sharding(RingSharding::Zigzag);
        with_deadline(Duration::from_secs(60), move || {
            ThreadGroup::new(sp)
                .run(|rank| {
                    let groups = ParallelGroups::<Inner>::new(rank.communicator(), layout).unwrap();
                    let _ring = burn_ulysses::context::enter(RankScope::Thread, groups.rank_context(config.clone()));
                    let positions: Vec<i64> = layout.sharder().positions_of(rank.rank(), length).into_iter().map(|p| p as i64).collect();
                    let device = Default::default();
                    (positions.clone(), values(pooled(ids::<Sp>(length, &device).select(1, places(&positions, &device)), by)))
                })
                .into_iter()
                .map(|result| result.map_err(|panic| panic.message))
                .collect::<Vec<_>>()
        })
    };
    let device = Default::default();
    for (sp, length) in [(2, 16), (6, 24)] {
        let by = length / sp / 2;
        let want = pooled(ids::<Inner>(length, &device), by);
        for (rank, result) in run(sp, length, by, UlyssesConfig::new()).into_iter().enumerate() {
            let (positions, got) = result.unwrap_or_else(|message| panic!("SP {sp}, rank {rank}: {message}"));
            let outputs: Vec<i64> = positions.iter().step_by(by).map(|p| p / by as i64).collect();
            let diff = max_abs_diff(&got, &values(want.clone().select(1, places(&outputs, &device))));
            assert!(diff <= TOLERANCE, "SP {sp}, rank {rank} (tokens {positions:?}) differs from one device's outputs {outputs:?} by {diff:e}");
        }
        let refused: Vec<Result<Vec<f32>, String>> = run(sp, length, 2 * by, UlyssesConfig::new()).into_iter().map(|r| r.map(|(_, got)| got)).collect();
        assert_shard_local_refused(&refused, "avg_pool1d", "zigzag");
    }
    // Let through, rank 0's one output of the first layout averages tokens 0–3 and 12–15, not
    // one device's 0–7.
    let (_, got) = run(2, 16, 8, UlyssesConfig::new().with_shard_local_attention_on_purpose(true)).remove(0).unwrap();
    let worst = max_abs_diff(&got, &values(pooled(ids::<Inner>(16, &device), 8).narrow(1, 0, 1)));
    assert!(worst >= 1e-2, "rank 0 pooled its two runs together, yet only {worst:e} from one device's");
}

#[test]
fn attention_by_hand_on_quantized_keys_is_refused() {
    // An int8 key cache: burn sends the scores' matmul to `q_matmul`, not `float_matmul`.
    // Quantization has no autodiff, so the plain backend (inference) under the decorator.
    type SpInference = UlyssesBackend<Inner>;
    let results: Vec<Result<Vec<f32>, String>> = with_deadline(Duration::from_secs(60), || {
        ThreadGroup::new(2)
            .run(|rank| {
                let _sp = SpInference::enter(RankScope::Thread, rank.communicator(), UlyssesConfig::new());
                let x = shard(input::<SpInference>(&Default::default()), 1, rank.rank(), rank.size());
                let (q, k) = (heads(x.clone()), heads(x * 0.5).quantize_dynamic(&QuantScheme::default().with_value(QuantValue::Q8S).with_store(QuantStore::Native)));
                values(q.matmul(k.swap_dims(2, 3)).sum_dim(3).squeeze_dim::<3>(3))
            })
            .into_iter()
            .map(|result| result.map_err(|panic| panic.message))
            .collect()
    });
    assert_refused_on_every_rank(&results, "scores against quantized keys");
}

/// A flip and a cumulative sum of the sequence where the activations are quantized (burn sends
/// them to `q_flip` and `q_cumsum`).
#[test]
fn a_quantized_flip_or_scan_of_the_sequence_is_refused() {
    type SpInference = UlyssesBackend<Inner>;
    for (op, fix) in [("flip", "before it is sharded"), ("cumsum", "enter_single_device")] {
        let results: Vec<Result<Vec<f32>, String>> = with_deadline(Duration::from_secs(60), move || {
            ThreadGroup::new(2)
                .run(|rank| {
                    let _sp = SpInference::enter(RankScope::Thread, rank.communicator(), UlyssesConfig::new());
                    let device = Default::default();
                    let length = SEQ / rank.size();
                    let ids = token_ids::<SpInference>(&device).narrow(1, rank.rank() * length, length);
                    let x = deterministic_params(EmbeddingConfig::new(VOCAB, D_MODEL).init(&device), 13).forward(ids);
                    let quantized = x.quantize_dynamic(&QuantScheme::default().with_value(QuantValue::Q8S).with_store(QuantStore::Native));
                    values(if op == "flip" { quantized.flip([1]).dequantize() } else { quantized.cumsum(1) })
                })
                .into_iter()
                .map(|result| result.map_err(|panic| panic.message))
                .collect()
        });
        assert_shard_local_refused(&results, op, fix);
    }
}

#[test]
fn attention_by_hand_on_integers_is_refused() {
    // Attention quantized by hand: integer scores take burn's `int_matmul`.
    let results = on_ranks(2, UlyssesConfig::new(), |x, _| {
        let (q, k) = (heads(x.clone() * 16.0).int(), heads(x * 8.0).int());
        q.matmul(k.swap_dims(2, 3)).float().sum_dim(3).squeeze_dim::<3>(3)
    });
    assert_refused_on_every_rank(&results, "integer scores");
}

/// Grouped-query attention by hand with the group's query heads folded into rows
/// (`[B, Hkv, G·S, d]`, no repeated keys): token ids embedded, 4 query heads over 2 kv heads.
fn folded_grouped_query_attention<B: Backend>(ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
    let [batch, seq] = ids.dims();
    let (kv_heads, head_dim) = (2, D_MODEL / HEADS);
    let embedding = deterministic_params(EmbeddingConfig::new(VOCAB, D_MODEL).init::<B>(&ids.device()), 13);
    let x = embedding.forward(ids);
    let kv = |scale: f64| x.clone().narrow(2, 0, kv_heads * head_dim).mul_scalar(scale).reshape([batch, seq, kv_heads, head_dim]).swap_dims(1, 2);
    let q = heads(x.clone()).reshape([batch, kv_heads, HEADS / kv_heads * seq, head_dim]);
    let weights = softmax(q.matmul(kv(0.5).swap_dims(2, 3)) / (head_dim as f64).sqrt(), 3);
    let context = weights.matmul(kv(4.0)).reshape([batch, HEADS, seq, head_dim]);
    context.swap_dims(1, 2).reshape([batch, seq, D_MODEL])
}

fn token_ids<B: Backend>(device: &B::Device) -> Tensor<B, 2, Int> {
    Tensor::arange(0..(BATCH * SEQ) as i64, device).remainder_scalar(VOCAB as i64).reshape([BATCH, SEQ])
}

/// `work` on each of `sp` rank threads with its shard of the token ids, cut by `narrow`; each
/// rank's output, or its panic message.
fn on_ranks_from_ids(sp: usize, config: UlyssesConfig, work: impl Fn(Tensor<Sp, 2, Int>) -> Tensor<Sp, 3> + Send + Sync + 'static) -> Vec<Result<Vec<f32>, String>> {
    with_deadline(Duration::from_secs(60), move || {
        ThreadGroup::new(sp)
            .run(|rank| {
                let _sp = Sp::enter(RankScope::Thread, rank.communicator(), config.clone());
                let length = SEQ / rank.size();
                values(work(token_ids::<Sp>(&Default::default()).narrow(1, rank.rank() * length, length)))
            })
            .into_iter()
            .map(|result| result.map_err(|panic| panic.message))
            .collect()
    })
}

#[test]
fn grouped_query_heads_folded_into_rows_are_refused_once_token_ids_are_embedded() {
    // Rectangular products: the guard knows them for attention by the length of the token ids
    // each rank embedded (its shard, cut here by `narrow`).
    let on_ranks = |sp: usize, config: UlyssesConfig| on_ranks_from_ids(sp, config, folded_grouped_query_attention);
    // SP = 2 and 4: shards of 6 and 3 tokens, whose folded weights [.., 2·n, n] no other rule
    // refuses (at SP = 3 the head dim, 8, equals 2·4, and the scores are refused as square).
    for (sp, shard) in [(2, 6), (4, 3)] {
        let results = on_ranks(sp, UlyssesConfig::new());
        assert_refused_on_every_rank(&results, &format!("folded query heads at SP = {sp}"));
        for message in results.iter().filter_map(|r| r.as_ref().err()) {
            assert!(message.contains(&format!("{shard} x {shard}")), "SP = {sp}: not the folded weights refused: {message}");
        }
    }
    // What it prevents: let through, every rank attends within its shard, far from one device.
    let want = folded_grouped_query_attention(token_ids::<Inner>(&Default::default()));
    let mut worst = 0.0f32;
    for (rank, got) in on_ranks(2, UlyssesConfig::new().with_shard_local_attention_on_purpose(true)).into_iter().enumerate() {
        let got = got.unwrap_or_else(|message| panic!("rank {rank}: {message}"));
        worst = worst.max(max_abs_diff(&got, &values(shard(want.clone(), 1, rank, 2))));
    }
    println!("folded query heads at SP = 2, attending within each shard: max |Δ| from one device {worst:.2e}");
    assert!(worst > 0.05, "shard-local attention only {worst:e} from one device");
    // At SP = 1, one device's output.
    assert_sequence_parallel(on_ranks(1, UlyssesConfig::new()), want);
}

/// Attention by hand whose products are not square: queries in chunks, latents, one pooling
/// query, a loop over heads at batch 1; and cross-attention to a memory of its own.
#[derive(Clone, Copy, Debug)]
enum OverTheShard {
    QueriesInChunks,
    Latents(usize),
    LoopOverHeadsAtBatchOne,
    CrossAttention(usize),
    /// Heads folded into the batch, `[B·H, S, d]`: linear attention's `φ(k)ᵀ·v` of a feature
    /// map twice the head dim (not square), and a Perceiver's latents.
    FoldedLinearAttention,
    FoldedLatents(usize),
}

impl OverTheShard {
    fn forward<B: Backend>(self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let device = ids.device();
        let embedding = deterministic_params(EmbeddingConfig::new(VOCAB, D_MODEL).init::<B>(&device), 13);
        let x = embedding.forward(ids);
        let [batch, seq, _] = x.dims();
        let attend = |q: Tensor<B, 4>, kv: Tensor<B, 3>| {
            let (k, v) = (heads(kv.clone() * 0.5), heads(kv * 4.0));
            softmax(q.matmul(k.swap_dims(2, 3)) / ((D_MODEL / HEADS) as f64).sqrt(), 3).matmul(v)
        };
        let merge = |context: Tensor<B, 4>| {
            let [batch, heads, rows, head_dim] = context.dims();
            context.swap_dims(1, 2).reshape([batch, rows, heads * head_dim])
        };
        match self {
            Self::QueriesInChunks => merge(Tensor::cat(heads(x.clone()).chunk(2, 2).into_iter().map(|q| attend(q, x.clone())).collect(), 2)),
            Self::Latents(latents) => {
                let q = uniform_tensor::<B, 3>([1, latents, D_MODEL], 11, &device).repeat_dim(0, batch);
                merge(attend(heads(q), x))
            }
            Self::LoopOverHeadsAtBatchOne => {
                let (q, x) = (heads(x.clone()).narrow(0, 0, 1), x.narrow(0, 0, 1));
                let (k, v) = (heads(x.clone() * 0.5), heads(x * 4.0));
                let per_head = (0..HEADS).map(|h| {
                    let (q, k, v) = (q.clone().narrow(1, h, 1), k.clone().narrow(1, h, 1), v.clone().narrow(1, h, 1));
                    softmax(q.matmul(k.swap_dims(2, 3)), 3).matmul(v)
                });
                merge(Tensor::cat(per_head.collect(), 1)).reshape([1, seq, D_MODEL])
            }
            Self::CrossAttention(memory) => merge(attend(heads(x), uniform_tensor::<B, 3>([batch, memory, D_MODEL], 17, &device))),
            Self::FoldedLinearAttention | Self::FoldedLatents(_) => {
                let head_dim = D_MODEL / HEADS;
                let fold = |t: Tensor<B, 3>| heads(t).reshape([batch * HEADS, seq, head_dim]);
                let (k, v) = (fold(x.clone() * 0.5), fold(x.clone() * 4.0));
                let context = match self {
                    Self::FoldedLatents(latents) => {
                        let q = uniform_tensor::<B, 3>([1, latents, D_MODEL], 11, &device).repeat_dim(0, batch);
                        let q = heads(q).reshape([batch * HEADS, latents, head_dim]);
                        softmax(q.matmul(k.swap_dims(1, 2)) / (head_dim as f64).sqrt(), 2).matmul(v)
                    }
                    _ => {
                        let feature_map = |t: Tensor<B, 3>| Tensor::cat(vec![t.clone().clamp_min(0.0), t.neg().clamp_min(0.0)], 2);
                        feature_map(fold(x)).matmul(feature_map(k).swap_dims(1, 2).matmul(v))
                    }
                };
                let rows = context.dims()[1];
                merge(context.reshape([batch, HEADS, rows, head_dim]))
            }
        }
    }
}

/// A stack of experts `[E, C, f]·[E, f, d]` whose `f` is as long as the shard (`C` one more
/// token than the shard's, padding), its weights parameters scaled first (as a cast to the
/// compute dtype or a stack of experts makes them activations): it gives the model's width, no
/// head's, so no sum over the shard's tokens, though its shapes are a folded one's.
fn experts_as_wide_as_the_shard<B: Backend>(ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
    let device = ids.device();
    let embedding = deterministic_params(EmbeddingConfig::new(VOCAB, D_MODEL).init::<B>(&device), 13);
    let x = embedding.forward(ids);
    let [experts, seq, _] = x.dims();
    let routed = Tensor::cat(vec![x, Tensor::zeros([experts, 1, D_MODEL], &device)], 1);
    let (up, down) = (uniform_tensor::<B, 3>([experts, D_MODEL, seq], 5, &device).require_grad(), uniform_tensor::<B, 3>([experts, seq, D_MODEL], 7, &device).require_grad());
    routed.matmul(up * 0.5).clamp_min(0.0).matmul(down * 0.5)
}

/// Token ids whose every third token is 1: every shard at SP 2 and 4 begins with it.
fn ids_every_shard_begins_alike<B: Backend>(device: &B::Device) -> Tensor<B, 2, Int> {
    let ids: Vec<i64> = (0..BATCH * SEQ).map(|i| if i % 3 == 0 { 1 } else { (i % (VOCAB - 2) + 2) as i64 }).collect();
    Tensor::from_data(burn::tensor::TensorData::new(ids, [BATCH, SEQ]), device)
}

/// One pooling query per rank over the shard's own keys (a classifier's attention pooling,
/// `[B, H, 1, d]` over `[B, H, n, d]`) with the key-padding mask of its `n` tokens from
/// `offset` on (the sequence's last 3 padded), `[B, 1, H·d]`: the pooled sequence on every rank.
fn pooled<B: Backend>(ids: Tensor<B, 2, Int>, offset: usize) -> Tensor<B, 3> {
    let device = ids.device();
    let embedding = deterministic_params(EmbeddingConfig::new(VOCAB, D_MODEL).init::<B>(&device), 13);
    let x = embedding.forward(ids);
    let [batch, seq, _] = x.dims();
    let query = heads(uniform_tensor::<B, 3>([1, 1, D_MODEL], 11, &device).repeat_dim(0, batch));
    let padded: Vec<bool> = (0..batch).flat_map(|_| (offset..offset + seq).map(|at| at >= SEQ - 3)).collect();
    let mask = Tensor::<B, 4, burn::tensor::Bool>::from_data(burn::tensor::TensorData::new(padded, [batch, 1, 1, seq]), &device);
    let options = AttentionModuleOptions { scale: None, softcap: None, is_causal: false };
    attention(query, heads(x.clone() * 0.5), heads(x * 4.0), Some(mask), None, options).swap_dims(1, 2).reshape([batch, 1, D_MODEL])
}

/// Attention over the shard's own tokens that the refusals of a shard's one-query mask and of
/// keys beside the shard must let through, at SP = 2 and 4, each one device's: a pooling query
/// per rank with the shard's key-padding mask (the pooled sequence on every rank), and
/// non-causal attention over ids whose every shard begins with the same token.
#[test]
fn pooling_the_shard_and_shards_that_begin_alike_are_sequence_parallel() {
    let non_causal = AttentionModuleOptions { scale: None, softcap: None, is_causal: false };
    let alike = move |ids: Tensor<Sp, 2, Int>| {
        let x = deterministic_params(EmbeddingConfig::new(VOCAB, D_MODEL).init::<Sp>(&ids.device()), 13).forward(ids);
        let [batch, seq, _] = x.dims();
        attention(heads(x.clone()), heads(x.clone() * 0.5), heads(x * 4.0), None, None, non_causal).swap_dims(1, 2).reshape([batch, seq, D_MODEL])
    };
    let device = Default::default();
    let want_pooled = values(pooled::<Inner>(ids_every_shard_begins_alike(&device), 0));
    let x = deterministic_params(EmbeddingConfig::new(VOCAB, D_MODEL).init::<Inner>(&device), 13).forward(ids_every_shard_begins_alike(&device));
    let want_alike = attention(heads(x.clone()), heads(x.clone() * 0.5), heads(x * 4.0), None, None, non_causal).swap_dims(1, 2).reshape([BATCH, SEQ, D_MODEL]);
    for sp in [2, 4] {
        let per_rank = with_deadline(Duration::from_secs(60), move || {
            ThreadGroup::new(sp).run(move |rank| {
                let _sp = Sp::enter(RankScope::Thread, rank.communicator(), UlyssesConfig::new());
                let length = SEQ / rank.size();
                let ids = ids_every_shard_begins_alike::<Sp>(&Default::default()).narrow(1, rank.rank() * length, length);
                (values(pooled(ids.clone(), rank.rank() * length)), values(alike(ids)))
            })
        });
        let mut alike_results = Vec::new();
        for (rank, result) in per_rank.into_iter().enumerate() {
            let (got_pooled, got_alike) = result.unwrap_or_else(|panic| panic!("SP = {sp}, rank {rank}: {}", panic.message));
            let diff = max_abs_diff(&got_pooled, &want_pooled);
            assert!(diff <= TOLERANCE, "SP = {sp}, rank {rank}: the pooled sequence differs from one device's by {diff:e}");
            alike_results.push(Ok(got_alike));
        }
        assert_sequence_parallel(alike_results, want_alike.clone());
    }
}

#[test]
fn sums_over_a_shards_tokens_are_refused_once_token_ids_are_embedded() {
    // Each is attention by hand over the shard, refused at SP = 2 and 4 (shards of 6 and 3
    // tokens); at SP = 1 one device's output.
    for form in [
        OverTheShard::QueriesInChunks,
        OverTheShard::Latents(4),
        OverTheShard::Latents(1),
        OverTheShard::LoopOverHeadsAtBatchOne,
        OverTheShard::FoldedLinearAttention,
        OverTheShard::FoldedLatents(4),
    ] {
        for sp in [2, 4] {
            assert_refused_on_every_rank(&on_ranks_from_ids(sp, UlyssesConfig::new(), move |ids| form.forward(ids)), &format!("{form:?} at SP = {sp}"));
        }
        assert_sequence_parallel(on_ranks_from_ids(1, UlyssesConfig::new(), move |ids| form.forward(ids)), form.forward(token_ids::<Inner>(&Default::default())));
    }
    // Cross-attention to a memory of 5 (no shard's length) is no attention over the shard, nor
    // is a stack of experts whose hidden width is the shard's: each gives one device's output.
    for sp in [2, 4] {
        for (rank, result) in on_ranks_from_ids(sp, UlyssesConfig::new(), |ids| OverTheShard::CrossAttention(5).forward(ids)).iter().enumerate() {
            assert!(result.is_ok(), "cross-attention at SP = {sp}, rank {rank}: {result:?}");
        }
        for (rank, result) in on_ranks_from_ids(sp, UlyssesConfig::new(), experts_as_wide_as_the_shard).iter().enumerate() {
            assert!(result.is_ok(), "experts as wide as the shard at SP = {sp}, rank {rank}: {result:?}");
        }
    }
}

/// The guard's rules that go by the shard's length survive a length that changes between steps
/// (dynamic padding): a step of 6 tokens a rank (forward and backward), then 3 latents attending
/// by hand over a shard of 4, refused at SP = 2 (the second length beside the first looked like
/// a model that embeds two sequences, and turned the rules off).
#[test]
fn a_shard_length_that_changes_between_steps_keeps_the_guard() {
    let results = with_deadline(Duration::from_secs(60), || {
        ThreadGroup::new(2)
            .run(|rank| {
                let _sp = Sp::enter(RankScope::Thread, rank.communicator(), UlyssesConfig::new());
                let device = Default::default();
                let ids = token_ids::<Sp>(&device);
                let embedding = deterministic_params(EmbeddingConfig::new(VOCAB, D_MODEL).init::<Sp>(&device), 13);
                let _step = embedding.forward(ids.clone().narrow(1, rank.rank() * 6, 6)).sum().backward();
                values(OverTheShard::Latents(3).forward(ids.narrow(1, rank.rank() * 4, 4)))
            })
            .into_iter()
            .map(|result| result.map_err(|panic| panic.message))
            .collect::<Vec<_>>()
    });
    assert_refused_on_every_rank(&results, "3 latents over a shard of 4 after a step over 6");
}

/// `ulysses_training::evaluate` forgets the lengths embedded before it: an evaluation loop's
/// batches of other lengths, with no backward between, keep the guard's rules that go by the
/// shard's length. A model that attends through `module::attention` (so evaluate's own check
/// that the exchange ran passes) and then by hand with 3 latents: refused at SP = 2 on a batch
/// of 4 tokens a rank evaluated after one of 6 (the two lengths looked like one forward's two
/// sequences, which turned the rules off).
#[test]
fn evaluation_batches_of_other_lengths_keep_the_guard() {
    use burn_ulysses::data::SequenceSharder;
    use ulysses_training::{LmOutput, evaluate};
    let results = with_deadline(Duration::from_secs(60), || {
        ThreadGroup::new(2)
            .run(|rank| {
                let communicator = rank.communicator();
                let _sp = Sp::enter(RankScope::Thread, communicator.clone(), UlyssesConfig::new());
                let device = Default::default();
                let forward = |latents: bool| {
                    move |ids: Tensor<Sp, 2, Int>, _: &ShardPositions| {
                        let device = ids.device();
                        let x = heads(deterministic_params(EmbeddingConfig::new(VOCAB, D_MODEL).init::<Sp>(&device), 13).forward(ids));
                        let mut context = attention(x.clone(), x.clone(), x, None, None, AttentionModuleOptions { scale: None, softcap: None, is_causal: true });
                        if latents {
                            let [batch, ..] = context.dims();
                            let q = heads(uniform_tensor::<Sp, 3>([1, 3, D_MODEL], 11, &device).repeat_dim(0, batch));
                            // The latents' summary added to every token: the shard's rows kept.
                            context = context.clone() + softmax(q.matmul(context.clone().swap_dims(2, 3)), 3).matmul(context).sum_dim(2);
                        }
                        let [batch, heads, rows, head_dim] = context.dims();
                        let hidden = context.swap_dims(1, 2).reshape([batch, rows, heads * head_dim]);
                        Ok(LmOutput::Logits(hidden.matmul(uniform_tensor::<Sp, 3>([1, D_MODEL, VOCAB], 19, &device))))
                    }
                };
                let batch = |len: usize| (0..BATCH).map(|b| (0..len).map(|t| ((b * len + t) % VOCAB) as i64).collect()).collect::<Vec<Vec<i64>>>();
                let sharder = SequenceSharder::new(2);
                evaluate::<Sp, Inner>(forward(false), &batch(12), None, None, &sharder, rank.rank(), &*communicator, &device).expect("attention through module::attention");
                evaluate::<Sp, Inner>(forward(true), &batch(8), None, None, &sharder, rank.rank(), &*communicator, &device).map(|loss| vec![loss.sum as f32]).map_err(|e| e.to_string())
            })
            .into_iter()
            .map(|result| result.map_err(|panic| panic.message).and_then(|r| r))
            .collect::<Vec<_>>()
    });
    assert_refused_on_every_rank(&results, "3 latents over a shard of 4 evaluated after a batch of 6 a rank");
}

#[test]
fn a_linear_layer_as_wide_as_the_local_sequence_is_not_refused() {
    // Per-head features [B, H, S/P, d] through a Linear of width S/P: a [.., S/P, S/P] result
    // of a broadcast weight, not scores.
    let results = on_ranks(2, UlyssesConfig::new(), |x, _| {
        let [batch, seq, _] = x.dims();
        let per_head = x.reshape([batch, seq, HEADS, D_MODEL / HEADS]).swap_dims(1, 2);
        let linear = LinearConfig::new(D_MODEL / HEADS, seq).init::<Sp>(&per_head.device());
        linear.forward(per_head).sum_dim(1).squeeze_dim(1)
    });
    for (rank, result) in results.iter().enumerate() {
        assert!(result.is_ok(), "rank {rank}: {result:?}");
    }
}

fn causal_mha_record() -> (Tensor<Inner, 3>, Vec<u8>) {
    let device = Default::default();
    let mha = burn_nn_mha::<Inner>(&device);
    let mask = generate_autoregressive_mask::<Inner>(BATCH, SEQ, &device);
    let output = mha.forward(burn_nn::MhaInput::self_attn(input::<Inner>(&device)).mask_attn(mask)).context;
    let bytes = NamedMpkBytesRecorder::<FullPrecisionSettings>::default().record(mha.into_record(), ()).unwrap();
    (output, bytes)
}

fn load_drop_in<B: Backend>(bytes: Vec<u8>, device: &B::Device) -> nn::MultiHeadAttention<B> {
    let record = NamedMpkBytesRecorder::<FullPrecisionSettings>::default().load(bytes, device).unwrap();
    nn::MultiHeadAttentionConfig::new(D_MODEL, HEADS).with_dropout(0.0).init::<B>(device).load_record(record)
}

#[test]
fn the_causal_drop_in_matches_burn_nn_with_an_autoregressive_mask() {
    let (want, bytes) = causal_mha_record();
    let device = Default::default();
    let got = load_drop_in::<Inner>(bytes, &device).forward(nn::MhaInput::self_attn(input::<Inner>(&device)).causal()).context;
    let diff = max_abs_diff(&values(got), &values(want));
    println!("causal drop-in vs burn-nn with an autoregressive mask: max |Δ| {diff:.2e}");
    assert!(diff <= 1e-6, "the causal drop-in differs from burn-nn by {diff:e}");
}

#[test]
fn the_causal_drop_in_is_sequence_parallel_at_sp_2_and_4() {
    let (want, bytes) = causal_mha_record();
    for sp in [2, 4] {
        let bytes = bytes.clone();
        let results = on_ranks(sp, UlyssesConfig::new(), move |x, _| load_drop_in::<Sp>(bytes.clone(), &x.device()).forward(nn::MhaInput::self_attn(x).causal()).context);
        assert_sequence_parallel(results, want.clone());
    }
}

#[test]
fn the_porting_guide_shows_this_files_port() {
    let guide = include_str!("../docs/library.md");
    let start = guide.find("```diff\n").expect("the porting guide has a diff");
    let diff = &guide[start + 8..];
    let diff = &diff[..diff.find("```").unwrap()];
    let this_file: String = include_str!("attention_guard.rs").split_whitespace().collect::<Vec<_>>().join(" ");
    let mut changed = 0;
    for line in diff.lines() {
        let Some(code) = line.strip_prefix('+').or_else(|| line.strip_prefix('-')) else { continue };
        let code = code.split_whitespace().collect::<Vec<_>>().join(" ");
        if !code.is_empty() {
            changed += 1;
            assert!(this_file.contains(&code), "the porting guide's diff has `{code}`, which tests/attention_guard.rs does not");
        }
    }
    assert!(changed >= 6, "the porting diff should show the three changes, found {changed} changed lines");
}

/// Where a model takes its positions from: six ways a port counts them from each rank's first
/// token, and two right ones; or how it mixes the shard's tokens as if they were the sequence's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Placement {
    RopeForward,
    Sinusoids,
    LearnedOfArange,
    /// A learned position embedding looked up at ids `0..len` built on the host.
    LearnedOfHostIds,
    /// burn-nn's sinusoids computed for the length at hand (`generate_sinusoids(len, ..)`).
    HostSinusoids,
    LearnedTableRows,
    RopeAtOffset,
    LearnedAtIds,
    /// Each token plus the one before it (RWKV's token shift), by a slice and a concatenation.
    TokenShift,
    /// The same by `roll_dim`.
    Roll,
    /// Each token plus the mean over the sequence (a global context vector).
    MeanPooled,
    /// Mixture-of-depths: only the top half of the tokens by a score takes the layer.
    TopTokens,
    /// Each token plus its sequence's count of tokens that are no padding (an integer sum).
    CountedTokens,
    /// Each token plus the one where its sequence's first padding lies (an integer argmax, as
    /// transformers' sequence classifiers find their last token).
    FirstPadding,
    /// Each token plus whether its sequence has any padding (a boolean `any`).
    AnyPadding,
    /// Each token plus the one before it, by padding one zero before the sequence and cropping
    /// its last (RWKV's `ZeroPad2d((0, 0, 1, -1))`).
    PaddedShift,
    /// The same by concatenating a zero before the sequence and cropping.
    ConcatenatedShift,
    /// Padded by one and cropped back where the tokens went: no shift (as a class token or
    /// padding to a multiple removed again).
    PaddedAndCroppedBack,
    /// Each token plus the previous token's embedding, its ids shifted by concatenating one
    /// before them and cropping (a bigram feature).
    PreviousTokenIds,
    /// Each token plus causal linear attention's running sum of the keys before it, per head
    /// (`k.cumsum(2)` of `[B, H, S, dh]`).
    LinearAttentionSums,
    /// Each token plus a context vector pooled by one query's softmax over the tokens
    /// (attention pooling, `[B, S, 1]`).
    AttentionPooled,
    /// Tokens looked up by `select` from the embedding table (no `module::embedding` call for the
    /// guard to learn the shard's length from), then a running sum over them.
    SelectedThenSummed,
    /// Each token plus a token-mixing weight's sum over the tokens (gMLP's spatial gating unit),
    /// the weight cut to the length at hand.
    SpatialGating,
    /// Attention over q, k and v reshaped to `[B, S, H, D]` without `.swap_dims(1, 2)`.
    SwappedHeads,
    /// Block-local attention: chunks of 2 tokens folded into the batch, each attended within
    /// itself by `module::attention`.
    ChunksInTheBatch,
    /// A maximum and a running sum over time, channels first (`[B, D, S]`'s dim 2: a max over
    /// time, a causal scan written for a convolution's layout).
    ChannelsFirstMax,
    ChannelsFirstCumsum,
    /// Attention pooling with its query as a row: a softmax over dim 2 of `[B, 1, S]` (the
    /// layout `q @ k.transpose(-2, -1)` gives), applied to the tokens by a matmul.
    RowQueryPooled,
    /// Attention within documents whose position ids are counted within the shard (`0..S` on
    /// every rank), not the shard's.
    LocalDocumentIds,
    /// Each token plus its sequence's last token's state (a reward model's or a sequence
    /// classifier's `x[:, -1]`).
    LastTokenPooled,
    /// The same by `select` of the last index.
    LastTokenSelected,
    /// The same by `gather` at each row's last index (as transformers' reward models take it
    /// at the place the data loader computed).
    LastTokenGathered,
    /// Each token plus a running average of the tokens up to it, run token by token
    /// (`iter_dim` over the sequence: an RNN's loop, burn-nn's `Lstm`).
    RecurrentByHand,
}

/// The token id [`Placement`]'s padding rules look for (none of [`token_batch`]'s is one).
const PAD_ID: i64 = VOCAB as i64;

/// A causal attention layer over token embeddings placed by `from`: logits `[B, S, VOCAB]`.
fn positioned_logits<B: Backend>(ids: Tensor<B, 2, Int>, positions: &ShardPositions, from: Placement) -> Tensor<B, 3> {
    let device = ids.device();
    let [batch, len] = ids.dims();
    let max_len = 4 * SEQ;
    let embedding = deterministic_params(EmbeddingConfig::new(VOCAB, D_MODEL).init::<B>(&device), 13);
    let x = match from {
        Placement::SelectedThenSummed => embedding.weight.val().select(0, ids.clone().reshape([batch * len])).reshape([batch, len, D_MODEL]),
        _ => embedding.forward(ids.clone()),
    };
    let per_sequence = |values: Tensor<B, 2>| values.unsqueeze_dim::<3>(2);
    let learned = |at: Tensor<B, 2, Int>| deterministic_params(EmbeddingConfig::new(max_len, D_MODEL).init::<B>(&device), 17).forward(at);
    let x = match from {
        Placement::Sinusoids => PositionalEncodingConfig::new(D_MODEL).with_max_sequence_size(max_len).init::<B>(&device).forward(x),
        Placement::LearnedOfArange => x + learned(Tensor::<B, 1, Int>::arange(0..len as i64, &device).unsqueeze::<2>().repeat_dim(0, batch)),
        Placement::LearnedOfHostIds => {
            let ids = burn::tensor::TensorData::new((0..len as i64).collect::<Vec<_>>(), [1, len]);
            x + learned(Tensor::<B, 2, Int>::from_data(ids, &device).repeat_dim(0, batch))
        }
        Placement::HostSinusoids => x + burn::nn::generate_sinusoids::<B>(len, D_MODEL, 10_000, &device).unsqueeze::<3>(),
        Placement::LearnedAtIds => x + learned(position_ids(positions, &device)),
        Placement::TokenShift => {
            let before = Tensor::cat(vec![Tensor::zeros([batch, 1, D_MODEL], &device), x.clone().slice([0..batch, 0..len - 1])], 1);
            x + before
        }
        Placement::Roll => x.clone() + x.roll_dim(1, 1),
        Placement::MeanPooled => x.clone() + x.mean_dim(1),
        Placement::TopTokens => {
            let scores = x.clone().sum_dim(2).squeeze_dim::<2>(2);
            // The half's least score (burn's autodiff has no topk).
            let threshold = scores.clone().sort_descending(1).narrow(1, len / 2 - 1, 1);
            x.clone() * scores.greater_equal(threshold).float().unsqueeze_dim::<3>(2)
        }
        Placement::CountedTokens => x + per_sequence(ids.not_equal_elem(PAD_ID).int().sum_dim(1).float()),
        Placement::FirstPadding => {
            let at = ids.equal_elem(PAD_ID).int().argmax(1);
            x.clone() + x.gather(1, at.unsqueeze_dim::<3>(2).repeat_dim(2, D_MODEL))
        }
        Placement::AnyPadding => x + per_sequence(ids.equal_elem(PAD_ID).any_dim(1).float()),
        Placement::PaddedShift => x.clone() + x.pad([(1, 0), (0, 0)], PadMode::Constant(0.0)).slice([0..batch, 0..len]),
        Placement::ConcatenatedShift => x.clone() + Tensor::cat(vec![Tensor::zeros([batch, 1, D_MODEL], &device), x], 1).slice([0..batch, 0..len]),
        Placement::PreviousTokenIds => {
            let previous = Tensor::cat(vec![Tensor::<B, 2, Int>::zeros([batch, 1], &device), ids], 1).slice([0..batch, 0..len]);
            x + deterministic_params(EmbeddingConfig::new(VOCAB, D_MODEL).init::<B>(&device), 23).forward(previous)
        }
        Placement::PaddedAndCroppedBack => x.clone() * 2.0 - x.pad([(1, 0), (0, 0)], PadMode::Constant(0.0)).slice([0..batch, 1..len + 1]) * 0.5,
        // Two heads: as many as a shard's tokens (SP 3's 4) would leave no telling which dim is the sequence.
        Placement::LinearAttentionSums => x.clone() + x.reshape([batch, len, 2, D_MODEL / 2]).swap_dims(1, 2).cumsum(2).swap_dims(1, 2).reshape([batch, len, D_MODEL]),
        Placement::AttentionPooled => {
            let weights = softmax(x.clone().sum_dim(2), 1);
            x.clone() + weights.swap_dims(1, 2).matmul(x)
        }
        Placement::SelectedThenSummed => x.clone() + x.cumsum(1) * 0.1,
        Placement::ChannelsFirstMax => x.clone() + x.swap_dims(1, 2).max_dim(2).swap_dims(1, 2),
        Placement::ChannelsFirstCumsum => x.clone() + x.swap_dims(1, 2).cumsum(2).swap_dims(1, 2) * 0.1,
        Placement::RowQueryPooled => {
            let weights = softmax(x.clone().sum_dim(2).swap_dims(1, 2), 2);
            x.clone() + weights.matmul(x)
        }
        Placement::LastTokenPooled => x.clone() + x.narrow(1, len - 1, 1),
        Placement::LastTokenSelected => x.clone() + x.select(1, Tensor::<B, 1, Int>::from_data([len as i64 - 1], &device)),
        Placement::LastTokenGathered => x.clone() + x.gather(1, Tensor::<B, 3, Int>::full([batch, 1, D_MODEL], len as i64 - 1, &device)),
        Placement::RecurrentByHand => {
            let mut state = Tensor::<B, 3>::zeros([batch, 1, D_MODEL], &device);
            let mut states = Vec::with_capacity(len);
            for token in x.clone().iter_dim(1) {
                state = state * 0.5 + token;
                states.push(state.clone());
            }
            x + Tensor::cat(states, 1)
        }
        Placement::SpatialGating => x.clone() + uniform_tensor::<B, 2>([max_len, max_len], 29, &device).slice([0..len, 0..len]).unsqueeze::<3>().matmul(x) * 0.1,
        Placement::LearnedTableRows => {
            let table = deterministic_params(EmbeddingConfig::new(max_len, D_MODEL).init::<B>(&device), 17).weight.val();
            x + table.slice([0..len]).unsqueeze::<3>()
        }
        _ => x,
    };
    let rope = RotaryEncodingConfig::new(max_len, D_MODEL / HEADS).init::<B>(&device);
    let offset = positions.ids.ids()[0] as usize;
    let rotated = |t: Tensor<B, 4>| match from {
        Placement::RopeForward => rope.forward(t),
        Placement::RopeAtOffset => rope.apply(t, offset),
        _ => t,
    };
    let causal = AttentionModuleOptions { scale: None, softcap: None, is_causal: true };
    let hidden = match from {
        Placement::SwappedHeads => {
            let unswapped = |t: Tensor<B, 3>| t.reshape([batch, len, HEADS, D_MODEL / HEADS]);
            x.clone() + attention(unswapped(x.clone()), unswapped(x.clone()), unswapped(x), None, None, causal).reshape([batch, len, D_MODEL])
        }
        Placement::ChunksInTheBatch => {
            let chunks = len / 2;
            let folded = |t: Tensor<B, 3>| t.reshape([batch * chunks, 2, HEADS, D_MODEL / HEADS]).swap_dims(1, 2);
            x.clone() + attention(folded(x.clone()), folded(x.clone()), folded(x), None, None, causal).swap_dims(1, 2).reshape([batch, len, D_MODEL])
        }
        Placement::LocalDocumentIds => {
            let local = burn_ulysses::visibility::PositionIds::consecutive(batch, 0, len);
            let attended = burn_ulysses::attention::attention_in_documents(heads(x.clone()), heads(x.clone()), heads(x.clone()), &local, causal);
            x + attended.swap_dims(1, 2).reshape([batch, len, D_MODEL])
        }
        _ => x.clone() + attention(rotated(heads(x.clone())), rotated(heads(x.clone())), heads(x), None, None, causal).swap_dims(1, 2).reshape([batch, len, D_MODEL]),
    };
    hidden.matmul(uniform_tensor::<B, 3>([1, D_MODEL, VOCAB], 19, &device))
}

/// q, k and v reshaped to `[B, S, H, D]` and given to attention without `.swap_dims(1, 2)`:
/// refused on every rank at SP = 2 (the shard's 6 tokens where the heads go, 4 heads where
/// the tokens go), naming the swap; one device runs it (attending over the heads).
#[test]
fn a_query_with_its_heads_and_tokens_swapped_is_refused_under_sp() {
    for (rank, result) in evaluated(2, Placement::SwappedHeads).iter().enumerate() {
        let message = result.as_ref().err().unwrap_or_else(|| panic!("rank {rank} attended tokens as heads"));
        assert!(message.contains("[2, 6, 4, 8]") && message.contains(".swap_dims(1, 2)"), "rank {rank}: {message}");
    }
    assert!(evaluated(1, Placement::SwappedHeads).remove(0).is_ok_and(|loss| loss.is_finite()));
}

/// Block-local attention with its chunks folded into the batch (`[B · m, H, 2, D]`): refused on
/// every rank at SP = 2 and 3 (shards of 6 and 4 tokens, 3 and 2 chunks a row), naming the
/// fold, where the exchange would join every rank's chunk of one index into one sequence; one
/// device runs it.
#[test]
fn chunks_of_the_shard_folded_into_the_batch_are_refused_under_sp() {
    for (sp, fold) in [(2, "2 rows × 3 chunks"), (3, "2 rows × 2 chunks")] {
        for (rank, result) in evaluated(sp, Placement::ChunksInTheBatch).iter().enumerate() {
            let message = result.as_ref().err().unwrap_or_else(|| panic!("SP {sp}, rank {rank} attended chunks across the ranks"));
            assert!(message.contains(fold) && message.contains("block-local attention"), "SP {sp}, rank {rank}: {message}");
        }
    }
    assert!(evaluated(1, Placement::ChunksInTheBatch).remove(0).is_ok_and(|loss| loss.is_finite()));
}

/// Packed documents' position ids counted within the shard (`0..S` on every rank) handed to
/// `attention_in_documents`: refused at SP = 2 by the rank whose shard starts past 0 (rank 0's
/// are its own, and it stops as rank 1 leaves); one device runs it.
#[test]
fn document_ids_counted_within_the_shard_are_refused_under_sp() {
    let results = evaluated(2, Placement::LocalDocumentIds);
    let message = results[1].as_ref().err().expect("rank 1 attended within its shard");
    assert!(message.contains("run from 0 to 5") && message.contains("from 6 to 11") && message.contains("SequenceShard::positions.ids"), "{message}");
    assert!(results[0].is_err(), "rank 0 returned while rank 1 refused");
    assert!(evaluated(1, Placement::LocalDocumentIds).remove(0).is_ok_and(|loss| loss.is_finite()));
}

/// `positions`' ids as a tensor.
fn position_ids<B: Backend>(positions: &ShardPositions, device: &B::Device) -> Tensor<B, 2, Int> {
    let ids = positions.ids.ids().iter().map(|&p| p as i64).collect::<Vec<_>>();
    Tensor::from_data(burn::tensor::TensorData::new(ids, [positions.ids.batch(), positions.ids.len()]), device)
}

fn token_batch() -> Vec<Vec<i64>> {
    (0..BATCH).map(|b| (0..SEQ).map(|t| ((b * 7 + t * 3) % VOCAB) as i64).collect()).collect()
}

/// Each rank's loss sum of [`token_batch`] through `ulysses_training::evaluate` at SP = `sp`, or
/// its error.
fn evaluated(sp: usize, from: Placement) -> Vec<Result<f64, String>> {
    use burn_ulysses::data::SequenceSharder;
    use ulysses_training::{LmOutput, evaluate};
    with_deadline(Duration::from_secs(60), move || {
        ThreadGroup::new(sp)
            .run(|rank| {
                let communicator = rank.communicator();
                let _sp = Sp::enter(RankScope::Thread, communicator.clone(), UlyssesConfig::new());
                let forward = |ids: Tensor<Sp, 2, Int>, positions: &ShardPositions| Ok(LmOutput::Logits(positioned_logits(ids, positions, from)));
                evaluate::<Sp, Inner>(forward, &token_batch(), None, None, &SequenceSharder::new(sp), rank.rank(), &*communicator, &Default::default())
                    .map(|loss| loss.sum)
                    .map_err(|e| e.to_string())
            })
            .into_iter()
            .map(|result| result.map_err(|panic| panic.message).and_then(|r| r))
            .collect()
    })
}

/// Ranks whose shard starts past position 0 refuse the positions `what` counted from their
/// first token, naming the two; rank 0, whose positions they are, stops as they leave.
fn assert_positions_refused<T: std::fmt::Debug>(results: &[Result<T, String>], counted: &str, what: &str) {
    let p = results.len();
    let local = SEQ / p;
    for (rank, result) in results.iter().enumerate() {
        let message = match result {
            Ok(value) => panic!("{what} at SP {p}: rank {rank} returned {value:?}"),
            Err(message) => message,
        };
        if rank == 0 {
            assert!(message.contains("left the group") || message.contains("positions"), "{what} at SP {p}, rank 0: {message}");
            continue;
        }
        let held = format!("{local} tokens sit at positions {}..{}", rank * local, (rank + 1) * local);
        for needle in [counted, held.as_str(), "RotaryEncoding::apply(x, shard.position_offset)", "SequenceShard::positions.ids"] {
            assert!(message.contains(needle), "{what} at SP {p}, rank {rank}: `{needle}` missing from: {message}");
        }
    }
}

#[test]
fn positions_counted_from_each_ranks_first_token_are_refused() {
    let one_device = evaluated(1, Placement::RopeForward).remove(0).expect("one device");
    for sp in [2, 3] {
        let local = SEQ / sp;
        let rows = format!("takes rows 0..{local} along dim 0 of a [{}, {}, 2] table", 4 * SEQ, D_MODEL / HEADS);
        assert_positions_refused(&evaluated(sp, Placement::RopeForward), &rows, "RotaryEncoding::forward");
        let rows = format!("takes rows 0..{local} along dim 1 of a [1, {}, {D_MODEL}] table", 4 * SEQ);
        assert_positions_refused(&evaluated(sp, Placement::Sinusoids), &rows, "PositionalEncoding::forward");
        assert_positions_refused(&evaluated(sp, Placement::LearnedOfArange), &format!("arange counts positions 0..{local}"), "a learned embedding of arange");
        assert_positions_refused(&evaluated(sp, Placement::LearnedOfHostIds), &format!("from_data uploads positions 0..{local}"), "a learned embedding of ids from the host");
        let table = format!("from_data uploads a [{local}, {D_MODEL}] table whose row at the first token of this rank's shard");
        assert_positions_refused(&evaluated(sp, Placement::HostSinusoids), &table, "generate_sinusoids(len, ..)");
        let rows = format!("takes rows 0..{local} along dim 0 of a [{}, {D_MODEL}] table", 4 * SEQ);
        assert_positions_refused(&evaluated(sp, Placement::LearnedTableRows), &rows, "a learned table's first rows (a parameter)");
        // Ported: RoPE at the shard's offset equals one device's loss (of RoPE from 0 there).
        let sums: Vec<f64> = evaluated(sp, Placement::RopeAtOffset).into_iter().map(|r| r.unwrap_or_else(|e| panic!("RoPE at the offset, SP {sp}: {e}"))).collect();
        for sum in sums {
            assert!((sum - one_device).abs() <= 1e-5 * one_device.abs(), "RoPE at the offset, SP {sp}: {sum} against one device's {one_device}");
        }
    }
    let learned = evaluated(1, Placement::LearnedOfArange).remove(0).expect("one device");
    // On one device the host's positions are right: the same as arange's, and as burn-nn's table.
    let host_ids = evaluated(1, Placement::LearnedOfHostIds).remove(0).expect("ids from the host, one device");
    assert!((host_ids - learned).abs() <= 1e-6 * learned.abs(), "ids from the host: {host_ids} against arange's {learned}");
    let (host_sinusoids, sinusoids) = (evaluated(1, Placement::HostSinusoids).remove(0), evaluated(1, Placement::Sinusoids).remove(0));
    let (host_sinusoids, sinusoids) = (host_sinusoids.expect("sinusoids from the host, one device"), sinusoids.expect("burn-nn's sinusoids, one device"));
    assert!((host_sinusoids - sinusoids).abs() <= 1e-6 * sinusoids.abs(), "sinusoids from the host: {host_sinusoids} against PositionalEncoding's {sinusoids}");
    let at_ids = evaluated(3, Placement::LearnedAtIds);
    for sum in at_ids.into_iter().map(|r| r.expect("a learned embedding at the ids, SP 3")) {
        assert!((sum - learned).abs() <= 1e-5 * learned.abs(), "a learned embedding at the ids, SP 3: {sum} against one device's {learned}");
    }
}

/// Tokens of the sequence mixed inside a forward whose positions are noted: each token with the
/// one before it (a token shift, by a slice or by `roll_dim`: each shard's first token would take
/// zeros, or its shard's last token, for the previous rank's last), a mean pooled over the
/// sequence, a sort of its tokens for a top-k (mixture-of-depths routing), a padding mask's
/// count of tokens, where its first padding lies, whether any is padding, a shift by padding or
/// concatenating and cropping (of the embeddings, or of the token ids), causal linear
/// attention's running sums per head, attention pooling's softmax over the tokens, a running sum
/// over tokens embedded by `select` (no embedding call), a token-mixing weight cut to the
/// shard's length (gMLP's), the last token's state (a reward model's: by a slice, `select` or
/// `gather`), a recurrence run token by token: each shard's alone. Refused on every rank at SP = 2 and 3, naming
/// the op and the fix; a finite loss at SP = 1. Padded and cropped back where the tokens went,
/// one device's loss.
#[test]
fn tokens_mixed_within_the_shard_are_refused_on_every_rank() {
    let mixed = [
        (Placement::TokenShift, "slice", "halo"),
        (Placement::Roll, "slice", "halo"),
        (Placement::MeanPooled, "mean_dim", "enter_single_device"),
        (Placement::TopTokens, "sort", "enter_single_device"),
        (Placement::CountedTokens, "sum_dim", "enter_single_device"),
        (Placement::FirstPadding, "argmax", "enter_single_device"),
        (Placement::AnyPadding, "any_dim", "enter_single_device"),
        (Placement::PaddedShift, "slice", "halo"),
        (Placement::ConcatenatedShift, "slice", "halo"),
        (Placement::PreviousTokenIds, "slice", "halo"),
        (Placement::LinearAttentionSums, "cumsum", "enter_single_device"),
        (Placement::AttentionPooled, "softmax", "enter_single_device"),
        (Placement::SelectedThenSummed, "cumsum", "enter_single_device"),
        (Placement::SpatialGating, "slice", "enter_single_device"),
        (Placement::LastTokenPooled, "slice", "enter_single_device"),
        (Placement::LastTokenSelected, "select", "enter_single_device"),
        (Placement::LastTokenGathered, "gather", "enter_single_device"),
        (Placement::RecurrentByHand, "slice", "enter_single_device"),
        (Placement::ChannelsFirstMax, "max_dim", "enter_single_device"),
        (Placement::ChannelsFirstCumsum, "cumsum", "enter_single_device"),
    ];
    for (placement, op, fix) in mixed {
        for sp in [2, 3] {
            assert_shard_local_refused(&evaluated(sp, placement), op, fix);
        }
        let loss = evaluated(1, placement).remove(0);
        assert!(loss.as_ref().is_ok_and(|loss| loss.is_finite()), "{placement:?} at SP 1: {loss:?}");
    }
    // A row of weights over the shard's 6 tokens (at SP 3 its 4 are within a class token's few
    // of the row's 1, and pass as a token's features would).
    assert_shard_local_refused(&evaluated(2, Placement::RowQueryPooled), "softmax", "enter_single_device");
    assert!(evaluated(1, Placement::RowQueryPooled).remove(0).is_ok_and(|loss| loss.is_finite()));
    // Cropped back where the tokens went: sequence parallel, one device's loss on every rank.
    let one_device = evaluated(1, Placement::PaddedAndCroppedBack).remove(0).expect("padded and cropped back, one device");
    for sp in [2, 3] {
        for sum in evaluated(sp, Placement::PaddedAndCroppedBack) {
            let sum = sum.unwrap_or_else(|e| panic!("padded and cropped back, SP {sp}: {e}"));
            assert!((sum - one_device).abs() <= 1e-5 * one_device.abs(), "padded and cropped back, SP {sp}: {sum} against one device's {one_device}");
        }
    }
}

/// A model that looks its learned positions up at `arange(0..len)`.
#[derive(Module, Debug)]
struct LocalPositionsLm<B: Backend> {
    tokens: Embedding<B>,
    positions: Embedding<B>,
    head: Linear<B>,
}

impl<B: burn::tensor::backend::AutodiffBackend> ulysses_training::CausalLm<B> for LocalPositionsLm<B> {
    fn logits(&self, tokens: Tensor<B, 2, Int>, _: &ShardPositions) -> Tensor<B, 3> {
        let [batch, len] = tokens.dims();
        let at = Tensor::<B, 1, Int>::arange(0..len as i64, &tokens.device()).unsqueeze::<2>().repeat_dim(0, batch);
        let x = self.tokens.forward(tokens) + self.positions.forward(at);
        let causal = AttentionModuleOptions { scale: None, softcap: None, is_causal: true };
        let attended = attention(heads(x.clone()), heads(x.clone()), heads(x.clone()), None, None, causal);
        self.head.forward(x + attended.swap_dims(1, 2).reshape([batch, len, D_MODEL]))
    }

    fn vocab_size(&self) -> usize {
        VOCAB
    }

    fn is_causal(&self) -> bool {
        true
    }
}

#[test]
fn a_training_step_refuses_positions_counted_from_each_ranks_first_token() {
    use burn::optim::AdamWConfig;
    use burn_ulysses::{ParallelGroups, ParallelLayout, data::SequenceSharder};
    use ulysses_training::{StepInput, train_step};
    let results = with_deadline(Duration::from_secs(60), || {
        let layout = ParallelLayout::new().with_sp_size(2);
        ThreadGroup::new(2)
            .run(|rank| {
                let groups = ParallelGroups::new(rank.communicator(), layout).expect("one SP group");
                let _sp = burn_ulysses::context::enter(RankScope::Thread, groups.rank_context(UlyssesConfig::new()));
                let device = Default::default();
                let model = LocalPositionsLm::<Sp> {
                    tokens: deterministic_params(EmbeddingConfig::new(VOCAB, D_MODEL).init(&device), 3),
                    positions: deterministic_params(EmbeddingConfig::new(SEQ, D_MODEL).init(&device), 5),
                    head: deterministic_params(LinearConfig::new(D_MODEL, VOCAB).init(&device), 7),
                };
                let mut optimizer = AdamWConfig::new().init::<Sp, LocalPositionsLm<Sp>>();
                let micro_batches = [token_batch()];
                let step = StepInput { index: 0, learning_rate: 1e-2, micro_batches: &micro_batches, documents: None, targets: None, max_grad_norm: None };
                train_step(model, &mut optimizer, &step, &SequenceSharder::new(2), &groups, &device).map(|(_, report)| report.loss).map_err(|e| e.to_string())
            })
            .into_iter()
            .map(|result| result.map_err(|panic| panic.message).and_then(|r| r))
            .collect::<Vec<_>>()
    });
    assert_positions_refused(&results, &format!("arange counts positions 0..{}", SEQ / 2), "a training step with learned positions of arange");
}

/// A loop of one's own that shards with the layout's sharder and notes the shard's positions
/// (as docs/library.md says to) is refused by attention (the op, or by hand) on a thread with no rank context, and
/// in the world's context under data parallelism (SP 2 × DP 2: the all-to-all would join two
/// replicas' shards as one sequence), naming the fix; in its SP group's context every rank gets
/// its shard of one device's causal attention; inside `enter_single_device` it is let be.
#[test]
fn attention_on_a_noted_shard_outside_its_sp_group_is_refused() {
    use burn_ulysses::{ParallelGroups, ParallelLayout, attention_guard::note_shard_positions, context};
    type Plain = UlyssesBackend<Inner>;
    const HEAD_DIM: usize = 8;
    let whole = |seed: u64| uniform_tensor::<Inner, 4>([1, HEADS, SEQ, HEAD_DIM], seed, &Default::default());
    let causal = AttentionModuleOptions { scale: None, softcap: None, is_causal: true };
    let want = attention(whole(1), whole(2), whole(3), None, None, causal);
    let results = with_deadline(Duration::from_secs(60), move || {
        ThreadGroup::new(4).run(|rank| {
            let layout = ParallelLayout::new().with_sp_size(2).with_dp_size(2);
            let groups = ParallelGroups::<Inner>::new(rank.communicator(), layout).unwrap();
            let shard = layout.sharder().shard(&[(0..SEQ as i64).collect()], groups.sp_rank());
            let _noted = note_shard_positions(&shard.positions);
            let local = |seed: u64| {
                let part = whole(seed).narrow(2, shard.position_offset, SEQ / 2);
                Tensor::<Plain, 4>::from_data(part.into_data(), &Default::default())
            };
            let attend = || {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| values(attention(local(1), local(2), local(3), None, None, causal))))
                    .map_err(|panic| ulysses_core::comm::panic_message(&*panic))
            };
            let outside = attend();
            // By hand too (scores of the shard's tokens against themselves).
            let by_hand_outside = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| values(local(1).matmul(local(2).swap_dims(2, 3)))))
                .map_err(|panic| ulysses_core::comm::panic_message(&*panic));
            assert!(by_hand_outside.as_ref().is_err_and(|m| m.contains("no rank context spreads them")), "rank {}: {by_hand_outside:?}", rank.rank());
            let in_the_world = {
                let _world = Plain::enter_thread(rank.communicator());
                attend()
            };
            let in_its_group = {
                let _sp = context::enter(RankScope::Thread, groups.rank_context(UlyssesConfig::new()));
                attend()
            };
            // One device chosen on purpose (a whole sequence gathered): nothing refused.
            let on_one_device = {
                let _one = context::enter_single_device();
                attend()
            };
            assert!(on_one_device.is_ok(), "rank {}: attention inside enter_single_device refused: {on_one_device:?}", rank.rank());
            (outside, in_the_world, in_its_group, shard.position_offset)
        })
    });
    for (rank, result) in results.into_iter().enumerate() {
        let (outside, in_the_world, in_its_group, offset) = result.unwrap_or_else(|panic| panic!("rank {rank}: {}", panic.message));
        let outside = outside.err().unwrap_or_else(|| panic!("rank {rank} attended within its shard outside any rank context"));
        assert!(outside.contains("spread over 2 ranks") && outside.contains("no rank context spreads them") && outside.contains("groups.rank_context"), "rank {rank}: {outside}");
        let in_the_world = in_the_world.err().unwrap_or_else(|| panic!("rank {rank} attended over the world's four shards of two replicas"));
        assert!(in_the_world.contains("the rank context spreads them over 4"), "rank {rank}: {in_the_world}");
        let got = in_its_group.unwrap_or_else(|message| panic!("rank {rank} in its SP group: {message}"));
        let diff = max_abs_diff(&got, &values(want.clone().narrow(2, offset, SEQ / 2)));
        assert!(diff <= TOLERANCE, "rank {rank} in its SP group differs from one device by {diff:e}");
    }
}

/// A ulysses_models decoder notes the positions it is given where its caller noted none: its
/// forward on shard `r` of 2 is refused on a thread that entered no rank context (attention
/// within the shard alone) and in a group whose rank holds the other shard; on its own shard,
/// in its group, it runs.
#[test]
fn a_decoders_forward_on_a_shard_outside_its_rank_context_is_refused() {
    use burn::tensor::TensorData;
    use ulysses_models::DecoderConfig;
    type Plain = UlyssesBackend<Inner>;
    let results = with_deadline(Duration::from_secs(60), move || {
        ThreadGroup::new(2).run(|rank| {
            let device = Default::default();
            let model = DecoderConfig::new(16).with_d_model(16).with_n_layers(1).with_n_heads(HEADS).with_n_kv_heads(2).init::<Plain>(&device);
            let local = SEQ / 2;
            let tokens = Tensor::<Plain, 2, Int>::from_data(TensorData::new((0..local as i64).collect::<Vec<_>>(), [1, local]), &device);
            let forward = |shard: usize| {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| values(model.forward(tokens.clone(), &ShardPositions::contiguous_shard(1, local, shard, 2)))))
                    .map_err(|panic| ulysses_core::comm::panic_message(&*panic))
            };
            let no_context = forward(rank.rank());
            let _sp = Plain::enter_thread(rank.communicator());
            (no_context, forward(1 - rank.rank()), forward(rank.rank()))
        })
    });
    for (rank, result) in results.into_iter().enumerate() {
        let (no_context, other, own) = result.unwrap_or_else(|panic| panic!("rank {rank}: {}", panic.message));
        let no_context = no_context.err().unwrap_or_else(|| panic!("rank {rank} attended a shard with no rank context"));
        assert!(no_context.contains("spread over 2 ranks") && no_context.contains("no rank context spreads them"), "rank {rank}: {no_context}");
        let other = other.err().unwrap_or_else(|| panic!("rank {rank} attended the other rank's shard"));
        assert!(other.contains(&format!("runs on shard {} of sequences spread over 2 ranks", 1 - rank)), "rank {rank}: {other}");
        let own = own.unwrap_or_else(|message| panic!("rank {rank} on its own shard: {message}"));
        assert!(!own.is_empty() && own.iter().all(|x| x.is_finite()), "rank {rank}: a non-finite logit on its own shard");
    }
}

/// A zigzag ring of one rank (entered through `enter_hybrid`) cuts as no ring does, as the
/// sharder cuts it: the sharder's shard attends there, giving what the plain group gives.
#[test]
fn a_zigzag_ring_of_one_attends_the_sharders_shard_as_a_plain_group() {
    use burn_ulysses::{attention_guard::note_shard_positions, comm::Communicator, data::SequenceSharder, ring::RingSharding};
    type Plain = UlyssesBackend<Inner>;
    let causal = AttentionModuleOptions { scale: None, softcap: None, is_causal: true };
    let results = with_deadline(Duration::from_secs(60), move || {
        ThreadGroup::new(2).run(|rank| {
            let sharder = SequenceSharder::new(2).with_ring_size(1).with_ring_sharding(RingSharding::Zigzag);
            let shard = sharder.shard(&[(0..SEQ as i64).collect()], rank.rank());
            let _noted = note_shard_positions(&shard.positions);
            let local = |seed: u64| uniform_tensor::<Plain, 4>([1, HEADS, shard.local_len, 8], seed + 10 * rank.rank() as u64, &Default::default());
            let attend = || {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| values(attention(local(1), local(2), local(3), None, None, causal))))
                    .map_err(|panic| ulysses_core::comm::panic_message(&*panic))
            };
            let ring_of_one = rank.communicator().split(rank.rank() as u32, 0).unwrap();
            let zigzag = {
                let config = UlyssesConfig::new().with_ring_sharding(RingSharding::Zigzag);
                let _hybrid = Plain::enter_hybrid(RankScope::Thread, rank.communicator(), ring_of_one, config);
                attend()
            };
            let plain = {
                let _plain = Plain::enter_thread(rank.communicator());
                attend()
            };
            (zigzag, plain)
        })
    });
    for (rank, result) in results.into_iter().enumerate() {
        let (zigzag, plain) = result.unwrap_or_else(|panic| panic!("rank {rank}: {}", panic.message));
        let zigzag = zigzag.unwrap_or_else(|message| panic!("rank {rank}, a zigzag ring of one: {message}"));
        let plain = plain.unwrap_or_else(|message| panic!("rank {rank}, the plain group: {message}"));
        let worst = zigzag.iter().zip(&plain).map(|(a, b)| (a - b).abs()).fold(0.0f32, |w, d| if d.is_nan() || d > w { d } else { w });
        assert!(zigzag.len() == plain.len() && worst <= 1e-6, "rank {rank}: a zigzag ring of one {worst} from the plain group");
    }
}

/// A zigzag ring's shard (SP 4 over a ring of 2) attended in a plain group of its four ranks
/// (entered with the SP group's communicator, no ring): the group holds as many ranks but cuts
/// otherwise, and its all-to-all would join zigzag shards as contiguous ones. Refused on every
/// rank, naming the fix; in the groups' own context (the ring and its cut) it attends.
#[test]
fn a_zigzag_rings_shard_in_a_plain_group_of_as_many_ranks_is_refused() {
    use burn_ulysses::{ParallelGroups, ParallelLayout, attention_guard::note_shard_positions, context, ring::RingSharding};
    type Plain = UlyssesBackend<Inner>;
    let causal = AttentionModuleOptions { scale: None, softcap: None, is_causal: true };
    let results = with_deadline(Duration::from_secs(60), move || {
        ThreadGroup::new(4).run(|rank| {
            let layout = ParallelLayout::new().with_sp_size(4).with_ring_size(2).with_ring_sharding(RingSharding::Zigzag);
            let groups = ParallelGroups::<Inner>::new(rank.communicator(), layout).unwrap();
            let shard = layout.sharder().shard(&[(0..SEQ as i64).collect()], groups.sp_rank());
            let _noted = note_shard_positions(&shard.positions);
            let local = |seed: u64| uniform_tensor::<Plain, 4>([1, HEADS, shard.local_len, 8], seed + 10 * rank.rank() as u64, &Default::default());
            let attend = || {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| values(attention(local(1), local(2), local(3), None, None, causal))))
                    .map_err(|panic| ulysses_core::comm::panic_message(&*panic))
            };
            let plain = {
                let _plain = Plain::enter_thread(groups.sp.clone());
                attend()
            };
            let own = {
                let _own = context::enter(RankScope::Thread, groups.rank_context(UlyssesConfig::new()));
                attend()
            };
            (plain, own, groups.sp_rank())
        })
    });
    for (rank, result) in results.into_iter().enumerate() {
        let (plain, own, sp_rank) = result.unwrap_or_else(|panic| panic!("rank {rank}: {}", panic.message));
        let plain = plain.err().unwrap_or_else(|| panic!("rank {rank} attended over zigzag shards joined as contiguous ones"));
        assert!(plain.contains(&format!("runs on shard {sp_rank} of sequences spread over 4 ranks, cut in 2 run(s)")) && plain.contains("cut in 1"), "rank {rank}: {plain}");
        let own = own.unwrap_or_else(|message| panic!("rank {rank} in its groups' context: {message}"));
        assert!(own.iter().all(|x| x.is_finite()), "rank {rank}: a non-finite output in its groups' context");
    }
}
