//! Attention in blocks of queries, with a backward that recomputes each block's scores: memory
//! linear in the sequence length, where burn 0.22.1's autodiff attention (`attention_fallback`:
//! matmul, softmax, matmul, each recorded) keeps an S × S matrix per head until the backward.
//!
//! Forward, for each block of `block` queries: the block's scores against the keys it can see
//! (under `is_causal`, the keys up to its last query; a key-padding mask hides more), an exact
//! softmax over them, the output rows, and each row's log-sum-exp. A row that sees no key
//! gives zeros, as burn's attention does. A softcap `c` turns the scaled scores `x` into
//! `c · tanh(x / c)` before any key is hidden, as burn's attention does. The backward
//! (FlashAttention's, by blocks of queries) recomputes the probabilities from the log-sum-exp:
//! `dV += Pᵀ dO`, `dS = P ∘ (dO Vᵀ − δ)` with `δ = rowsum(dO ∘ O)` (times `1 − tanh²(x / c)`
//! under a softcap), `dQ = dS K · scale`, `dK += dSᵀ Q · scale`. At most one block's
//! scores (`batch × heads × block × S`) exist at a time, in the forward and in the backward.
//! Whatever the inputs' dtype, the scores, the softmax's statistics, the log-sum-exp and the
//! sums of dK and dV over the blocks are f32 (f64 for f64 inputs, which f32 would round);
//! the matmuls take the inputs' dtype.
//!
//! It is a backend-extension op written with the backend's own float ops, so every backend
//! this crate routes (Flex, burn's CubeCL backend with the `cube` feature, and Autodiff over
//! either) runs it.

use burn::backend::{
    Backend, Dispatch, Flex, TensorMetadata, backend_extension,
    autodiff::{
        Autodiff,
        checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
        grads::Gradients,
        ops::{Backward, Ops, OpsKind},
    },
    tensor::FloatTensor,
};
use burn::tensor::{Bool, FloatDType, Shape, Slice, Tensor, TensorData};

/// Queries per block unless [`attention_in_blocks`] is told otherwise.
pub const DEFAULT_BLOCK: usize = 128;

/// How one call attends.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockedSettings {
    /// Query `i` sees keys `0..=i` only (q and k of one length).
    pub causal: bool,
    /// Multiplies `q·k`.
    pub scale: f64,
    /// `softcap · tanh(scores / softcap)` on the scaled scores (positive).
    pub softcap: Option<f64>,
    /// Queries per block (at least 1).
    pub block: usize,
}

#[backend_extension(Autodiff, Flex, Cube: cfg(feature = "cube"))]
pub trait BlockedAttentionOps: Backend {
    /// Attention of q `[b, h, s, d]` over k `[b, h, t, d]` and v `[b, h, t, dv]` (one kv head
    /// per q head), `key_bias` `[b, 1 | h, 1, t]` (0, or `-inf` for a hidden key) added to
    /// every row's scores: `[b, h, s, dv]`.
    fn blocked_attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        key_bias: FloatTensor<Self>,
        settings: BlockedSettings,
    ) -> FloatTensor<Self>;
}

/// How [`attention`] attends, as burn's `AttentionModuleOptions` say it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BlockedOptions {
    pub is_causal: bool,
    /// `None`: `1/sqrt(d)`.
    pub scale: Option<f64>,
    /// `softcap · tanh(scores / softcap)` before keys are hidden; must be positive.
    pub softcap: Option<f64>,
}

/// Attention of q `[b, h, s, d]` over k and v with as many heads, in blocks of
/// [`DEFAULT_BLOCK`] queries. `key_padding` `[b, 1 | h, 1, t]`: `true` hides that key from
/// every query (burn's mask convention).
pub fn attention(query: Tensor<4>, key: Tensor<4>, value: Tensor<4>, key_padding: Option<Tensor<4, Bool>>, options: BlockedOptions) -> Tensor<4> {
    attention_in_blocks(query, key, value, key_padding, options, DEFAULT_BLOCK)
}

/// [`attention`] with `block` queries per block.
///
/// # Panics
///
/// When the shapes do not fit together (a message naming them), `block` is 0, or the softcap
/// is not positive.
pub fn attention_in_blocks(query: Tensor<4>, key: Tensor<4>, value: Tensor<4>, key_padding: Option<Tensor<4, Bool>>, options: BlockedOptions, block: usize) -> Tensor<4> {
    let BlockedOptions { is_causal, scale, softcap } = options;
    let ([b, h, s, d], k, v) = (query.dims(), key.dims(), value.dims());
    assert!(
        k[0] == b && v[0] == b && k[1] == h && v[1] == h && k[2] == v[2] && k[3] == d,
        "blocked attention takes q [b, h, s, d], k [b, h, t, d] and v [b, h, t, dv] (expand grouped kv heads first); got q {:?}, k {k:?}, v {v:?}",
        [b, h, s, d]
    );
    assert!(!is_causal || k[2] == s, "causal blocked attention needs as many keys as queries; got {s} queries and {} keys", k[2]);
    assert!(block > 0, "blocked attention needs at least one query per block");
    if let Some(softcap) = softcap {
        assert!(softcap > 0.0 && softcap.is_finite(), "the softcap must be positive and finite, got {softcap}");
    }
    let keys = k[2];
    // Nothing to attend (no row, or no key: a row that sees none gives zeros), as burn-ulysses
    // answers it: no block to run, and a softmax over no key has no maximum.
    if [b, h, s, keys].contains(&0) {
        return Tensor::<4>::zeros([b, h, s, v[3]], &query.device()).cast(query.dtype());
    }
    let key_bias = match key_padding {
        Some(mask) => {
            let m = mask.dims();
            assert!(
                m[0] == b && (m[1] == 1 || m[1] == h) && m[2] == 1 && m[3] == keys,
                "a key-padding mask is [batch, 1 | heads, 1, keys] = [{b}, 1 | {h}, 1, {keys}]; got {m:?}"
            );
            Tensor::<4>::zeros(m, &query.device()).mask_fill(mask, f32::NEG_INFINITY)
        }
        None => Tensor::<4>::zeros([b, 1, 1, keys], &query.device()),
    }
    .cast(query.dtype());
    let settings = BlockedSettings { causal: is_causal, scale: scale.unwrap_or(1.0 / (d as f64).sqrt()), softcap, block };
    let [query, key, value, key_bias] = [query, key, value, key_bias.detach()].map(Tensor::into_dispatch);
    Tensor::from_dispatch(<Dispatch as BlockedAttentionOps>::blocked_attention(query, key, value, key_bias, settings))
}

impl BlockedAttentionOps for Flex {
    fn blocked_attention(query: FloatTensor<Self>, key: FloatTensor<Self>, value: FloatTensor<Self>, key_bias: FloatTensor<Self>, settings: BlockedSettings) -> FloatTensor<Self> {
        forward::<Flex>(&query, &key, &value, &key_bias, settings).0
    }
}

/// burn's CubeCL backend (every CubeCL runtime; wgpu here), as [`ExchangeOps`](crate::exchange::ExchangeOps).
#[cfg(feature = "cube")]
impl BlockedAttentionOps for burn::backend::Cube {
    fn blocked_attention(query: FloatTensor<Self>, key: FloatTensor<Self>, value: FloatTensor<Self>, key_bias: FloatTensor<Self>, settings: BlockedSettings) -> FloatTensor<Self> {
        forward::<Self>(&query, &key, &value, &key_bias, settings).0
    }
}

impl<B: BlockedAttentionOps, C: CheckpointStrategy> BlockedAttentionOps for Autodiff<B, C> {
    fn blocked_attention(query: FloatTensor<Self>, key: FloatTensor<Self>, value: FloatTensor<Self>, key_bias: FloatTensor<Self>, settings: BlockedSettings) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct BlockedBackward {
            settings: BlockedSettings,
        }

        impl<B: Backend> Backward<B, 3> for BlockedBackward {
            /// q, k, v, the key bias, the output and each row's log-sum-exp: linear in S.
            type State = [FloatTensor<B>; 6];

            fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
                let [query_node, key_node, value_node] = ops.parents;
                let grad = grads.consume::<B>(&ops.node);
                let [query, key, value, key_bias, output, lse] = ops.state;
                let [dq, dk, dv] = backward::<B>(&query, &key, &value, &key_bias, &output, &lse, grad, self.settings);
                for (node, gradient) in [(query_node, dq), (key_node, dk), (value_node, dv)] {
                    if let Some(node) = node {
                        grads.register::<B>(node.id, gradient);
                    }
                }
            }
        }

        let (query, query_node) = query.into_parts();
        let (key, key_node) = key.into_parts();
        let (value, value_node) = value.into_parts();
        // A constant: the bias takes no gradient.
        let key_bias = key_bias.into_primitive();
        let (output, lse) = forward::<B>(&query, &key, &value, &key_bias, settings);
        let prepared = BlockedBackward { settings }.prepare::<C>([query_node, key_node, value_node]).compute_bound().stateful();
        match prepared {
            OpsKind::Tracked(prep) => prep.finish([query, key, value, key_bias, output.clone(), lse], output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        }
    }
}

/// `tensor[:, :, rows, :]`.
fn rows<B: Backend>(tensor: &FloatTensor<B>, rows: std::ops::Range<usize>) -> FloatTensor<B> {
    let shape = tensor.shape();
    B::float_slice(tensor.clone(), &[Slice::from(0..shape[0]), Slice::from(0..shape[1]), Slice::from(rows), Slice::from(0..shape[3])])
}

fn transpose<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    B::float_swap_dims(tensor, 2, 3)
}

/// Queries `first..first + count` against keys `0..keys`: the block's scaled (and capped)
/// scores plus the keys' bias, `-inf` where causality or the key-padding mask hides a key;
/// under a softcap also `tanh(x / softcap)` of the scaled scores `x`, for the backward. In f32
/// whatever the inputs' dtype (f64 for f64 inputs): the softmax's statistics overflow f16 past
/// 65 504 keys, and a log-sum-exp in bf16 shifts every probability by up to 3% once a row sees
/// 3 000 keys. The products too, as FlashAttention-2 keeps its scores: made in bf16 a score of
/// 20 was 0.04 off (and `q·k` overflowed f16 before the scale).
fn scores<B: Backend>(query_block: &FloatTensor<B>, visible_keys: &FloatTensor<B>, key_bias: &FloatTensor<B>, first: usize, settings: BlockedSettings) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    let work = working_dtype::<B>(query_block);
    let products = B::float_matmul(cast::<B>(query_block.clone(), work), transpose::<B>(cast::<B>(visible_keys.clone(), work)));
    let scores = B::float_mul_scalar(products, settings.scale.into());
    // Capped before any key is hidden: tanh would turn -inf into a finite score.
    let (scores, tanh) = match settings.softcap {
        None => (scores, None),
        Some(softcap) => {
            let tanh = B::float_tanh(B::float_div_scalar(scores, softcap.into()));
            (B::float_mul_scalar(tanh.clone(), softcap.into()), Some(tanh))
        }
    };
    let keys = visible_keys.shape()[2];
    let bias = key_bias.shape();
    let bias = B::float_slice(key_bias.clone(), &[Slice::from(0..bias[0]), Slice::from(0..bias[1]), Slice::from(0..1), Slice::from(0..keys)]);
    let scores = B::float_add(scores, cast::<B>(bias, work));
    if !settings.causal {
        return (scores, tanh);
    }
    // Each row sees every key before the block's first query: only the keys from it on (the
    // block's own, an upper triangle) are masked, built on the host at O(block²) a block, not
    // O(block · keys), which summed over a sequence's blocks was S²/2 floats made and uploaded.
    let count = query_block.shape()[2];
    let own = keys.saturating_sub(first);
    if own == 0 {
        return (scores, tanh);
    }
    let hidden: Vec<f32> = (0..count).flat_map(|row| (0..own).map(move |key| if key > row { f32::NEG_INFINITY } else { 0.0 })).collect();
    let mask = cast::<B>(B::float_from_data(TensorData::new(hidden, [1, 1, count, own]), &scores.device()), work);
    let shape = scores.shape();
    let columns = [Slice::from(0..shape[0]), Slice::from(0..shape[1]), Slice::from(0..shape[2]), Slice::from(first..keys)];
    let masked = B::float_add(B::float_slice(scores.clone(), &columns), mask);
    (B::float_slice_assign(scores, &columns, masked), tanh)
}

/// The dtype of the scores, the softmax's statistics and the sums over blocks for inputs like
/// `tensor`: f32, or f64 for f64 inputs.
fn working_dtype<B: Backend>(tensor: &FloatTensor<B>) -> FloatDType {
    match FloatDType::from(tensor.dtype()) {
        FloatDType::F64 => FloatDType::F64,
        _ => FloatDType::F32,
    }
}

/// `tensor` in `dtype` (itself where it is already).
fn cast<B: Backend>(tensor: FloatTensor<B>, dtype: FloatDType) -> FloatTensor<B> {
    match FloatDType::from(tensor.dtype()) == dtype {
        true => tensor,
        false => B::float_cast(tensor, dtype),
    }
}

/// The keys (or values) a block ending at query `end` can see.
fn visible<B: Backend>(tensor: &FloatTensor<B>, end: usize, settings: BlockedSettings) -> FloatTensor<B> {
    if settings.causal { rows::<B>(tensor, 0..end) } else { tensor.clone() }
}

fn blocks(queries: usize, block: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..queries).step_by(block).map(move |first| first..(first + block).min(queries))
}

/// The output `[b, h, s, dv]` (in the inputs' dtype) and each row's log-sum-exp `[b, h, s, 1]`
/// (f32; f64 for f64 inputs).
fn forward<B: Backend>(query: &FloatTensor<B>, key: &FloatTensor<B>, value: &FloatTensor<B>, key_bias: &FloatTensor<B>, settings: BlockedSettings) -> (FloatTensor<B>, FloatTensor<B>) {
    let dtype = FloatDType::from(query.dtype());
    // The working dtype's lowest finite value and smallest positive one.
    let (lowest, tiniest) = match working_dtype::<B>(query) {
        FloatDType::F64 => (f64::MIN, f64::MIN_POSITIVE),
        _ => (f64::from(f32::MIN), f64::from(f32::MIN_POSITIVE)),
    };
    let (mut outputs, mut lses) = (Vec::new(), Vec::new());
    // In the scores' dtype once, not each block's visible keys again.
    let key_work = cast::<B>(key.clone(), working_dtype::<B>(query));
    for block in blocks(query.shape()[2], settings.block) {
        let (scores, _) = scores::<B>(&rows::<B>(query, block.clone()), &visible::<B>(&key_work, block.end, settings), key_bias, block.start, settings);
        // A row that sees no key (all -inf): the max clamped to the working dtype's lowest
        // finite value and the sum to its smallest positive one give it zeros, as burn's attention.
        let max = B::float_clamp_min(B::float_max_dim(scores.clone(), 3), lowest.into());
        let weights = B::float_exp(B::float_sub(scores, max.clone()));
        let total = B::float_clamp_min(B::float_sum_dim(weights.clone(), 3), tiniest.into());
        // Normalised before the product, so the output's sums stay within the values' range.
        let probabilities = cast::<B>(B::float_div(weights, total.clone()), dtype);
        outputs.push(B::float_matmul(probabilities, visible::<B>(value, block.end, settings)));
        lses.push(B::float_add(max, B::float_log(total)));
    }
    (B::float_cat(outputs, 2), B::float_cat(lses, 2))
}

/// dq, dk, dv for the output gradient `grad`, recomputing each block's probabilities.
#[allow(clippy::too_many_arguments)]
fn backward<B: Backend>(
    query: &FloatTensor<B>,
    key: &FloatTensor<B>,
    value: &FloatTensor<B>,
    key_bias: &FloatTensor<B>,
    output: &FloatTensor<B>,
    lse: &FloatTensor<B>,
    grad: FloatTensor<B>,
    settings: BlockedSettings,
) -> [FloatTensor<B>; 3] {
    let (device, dtype, work) = (query.device(), FloatDType::from(query.dtype()), working_dtype::<B>(query));
    // Summed over the blocks in f32 (f64), cast once at the end.
    let zeros = |like: &FloatTensor<B>| B::float_zeros(like.shape(), &device, work);
    let (mut dk, mut dv) = (zeros(key), zeros(value));
    // δ = rowsum(dO ∘ O): [b, h, s, 1].
    let delta = B::float_sum_dim(B::float_mul(cast::<B>(grad.clone(), work), cast::<B>(output.clone(), work)), 3);
    let mut dq = Vec::new();
    // In the scores' dtype once, not each block's visible keys and values again.
    let (key_work, value_work) = (cast::<B>(key.clone(), work), cast::<B>(value.clone(), work));
    for block in blocks(query.shape()[2], settings.block) {
        let (query_block, grad_block) = (rows::<B>(query, block.clone()), rows::<B>(&grad, block.clone()));
        let keys = visible::<B>(key, block.end, settings);
        let (scores, tanh) = scores::<B>(&query_block, &visible::<B>(&key_work, block.end, settings), key_bias, block.start, settings);
        let probabilities = B::float_exp(B::float_sub(scores, rows::<B>(lse, block.clone())));
        let dv_block = B::float_matmul(transpose::<B>(cast::<B>(probabilities.clone(), dtype)), grad_block.clone());
        let dp = B::float_matmul(cast::<B>(grad_block, work), transpose::<B>(visible::<B>(&value_work, block.end, settings)));
        let ds = B::float_mul(probabilities, B::float_sub(dp, rows::<B>(&delta, block.clone())));
        // Through the cap: d(c · tanh(x / c))/dx = 1 − tanh².
        let ds = match tanh {
            None => ds,
            Some(tanh) => B::float_mul(ds, B::float_neg(B::float_sub_scalar(B::float_mul(tanh.clone(), tanh), 1.0f64.into()))),
        };
        let ds = cast::<B>(B::float_mul_scalar(ds, settings.scale.into()), dtype);
        dq.push(B::float_matmul(ds.clone(), keys));
        let dk_block = B::float_matmul(transpose::<B>(ds), query_block);
        let seen = dk_block.shape()[2];
        dk = add_rows::<B>(dk, cast::<B>(dk_block, work), seen);
        dv = add_rows::<B>(dv, cast::<B>(dv_block, work), seen);
    }
    [B::float_cat(dq, 2), cast::<B>(dk, dtype), cast::<B>(dv, dtype)]
}

/// `total[:, :, 0..count, :] += part`.
fn add_rows<B: Backend>(total: FloatTensor<B>, part: FloatTensor<B>, count: usize) -> FloatTensor<B> {
    let shape: Shape = total.shape();
    if count == shape[2] {
        return B::float_add(total, part);
    }
    let slices = [Slice::from(0..shape[0]), Slice::from(0..shape[1]), Slice::from(0..count), Slice::from(0..shape[3])];
    let current = B::float_slice(total.clone(), &slices);
    B::float_slice_assign(total, &slices, B::float_add(current, part))
}
