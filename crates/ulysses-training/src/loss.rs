//! The training loss: cross-entropy summed over the labels that are not ignored, from all
//! logits at once, or from the last hidden states a chunk of rows at a time.
//!
//! The chunked form (ALST's "tiled loss") matters at long context: a rank's logits are
//! `tokens × vocab` (32K tokens × 128K vocab is 16 GiB in f32), and autodiff would keep them,
//! and their softmax, until the backward. Here each chunk's logits live only while the chunk
//! is computed: the forward also computes the gradients of the loss with respect to the
//! hidden states and the output projection, and hands them to autodiff as the given
//! gradients of one node ([`TrainBackend::with_gradients`]).

use burn::tensor::{FloatDType, IndexingUpdateOp, Int, Tensor, TensorPrimitive, activation::log_softmax, backend::Backend};
use burn_ulysses::PlainBackend;

use crate::{TrainBackend, gradients::concatenated};

/// What a [`CausalLm`](crate::CausalLm) gives the loss.
pub enum LmOutput<B: Backend> {
    /// `[batch, seq, vocab]` logits.
    Logits(Tensor<B, 3>),
    /// `[batch, seq, d_model]` last hidden states and the projection that makes them logits.
    /// The hidden states may be in a half dtype: the logits are computed a chunk at a time in
    /// the head's [`logits_dtype`](OutputHead::logits_dtype), the softmax and the loss in f32,
    /// and what the backward keeps of them stays in the hidden states' dtype.
    Hidden { hidden: Tensor<B, 3>, head: OutputHead<B> },
}

impl<B: Backend> LmOutput<B> {
    /// The vocabulary it scores: the logits' last dimension, or the head's outputs.
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Logits(logits) => logits.dims()[2],
            Self::Hidden { head, .. } => head.weight.dims()[1],
        }
    }
}

/// An output projection `logits = hidden · weight + bias`, laid out as burn's `Linear`
/// (`weight: [d_model, vocab]`, `bias: [vocab]`).
pub struct OutputHead<B: Backend> {
    pub weight: Tensor<B, 2>,
    pub bias: Option<Tensor<B, 1>>,
    /// What the logits are computed in: `None`, the weight's dtype (f32); or a half dtype, the
    /// weight cast to it once per call and each chunk's matmuls on half-precision tensor cores
    /// (f32 accumulation), as PyTorch's autocast computes a bf16 model's head. The softmax
    /// and the loss stay f32 either way; the weight's gradient is summed over the chunks in
    /// f32 and cast to the weight's dtype once (a bf16 compute copy's head at long context has
    /// hundreds of chunks, whose parts a bf16 sum rounds away), as the tiles' and
    /// micro-batches' sums are (docs/training.md, "compute copy").
    pub logits_dtype: Option<FloatDType>,
}

impl<B: Backend> OutputHead<B> {
    /// Logits in the weight's dtype.
    pub fn new(weight: Tensor<B, 2>, bias: Option<Tensor<B, 1>>) -> Self {
        Self { weight, bias, logits_dtype: None }
    }

    pub fn with_logits_dtype(mut self, dtype: Option<FloatDType>) -> Self {
        self.logits_dtype = dtype;
        self
    }
}

/// Rows per chunk: a multiple of 64 whose logits hold at most 2^26 values (256 MiB in f32),
/// and at least 64 rows: past a vocabulary of 2^20, 64 rows, whose logits hold more.
///
/// Each chunk costs, besides its matmuls, one pass over the head's whole weight gradient
/// (`d_model × vocab`), and its rows are the M and K of those matmuls: with 2^24 values and no
/// rounding, Llama-3's vocabulary of 128 256 gave chunks of 130 rows, 8 192 chunks for a
/// million tokens in tiles of 4096, each through matmuls whose sizes fit no tensor-core tile
/// (on an H100, an 8B-shaped million-token step spent more than 223 s past the head's first
/// tile without reaching the last layer). Now that vocabulary gets 512 rows.
pub fn default_chunk_rows(vocab: usize) -> usize {
    const ALIGN: usize = 64;
    ((1 << 26) / vocab.max(1) / ALIGN).max(1) * ALIGN
}

/// `Σ -log p(label)` over the labels of `labels: [batch, seq]` that are not `ignore_index`,
/// from either kind of [`LmOutput`], differentiable.
pub fn lm_loss_sum<B: TrainBackend>(output: LmOutput<B>, labels: Tensor<B, 2, Int>, ignore_index: i64) -> Tensor<B, 1> {
    match output {
        LmOutput::Hidden { hidden, head } => {
            let (hidden, labels, chunk_rows) = rows_of(hidden, &head, labels);
            chunked_linear_cross_entropy_sum(hidden, head, labels, ignore_index, chunk_rows)
        }
        // Whole logits are differentiable as they are.
        logits => lm_loss_sum_inference(logits, labels, ignore_index),
    }
}

/// [`lm_loss_sum`] on any backend: differentiable for logits, without gradients for hidden
/// states (evaluation).
pub fn lm_loss_sum_inference<B: Backend>(output: LmOutput<B>, labels: Tensor<B, 2, Int>, ignore_index: i64) -> Tensor<B, 1> {
    match output {
        LmOutput::Logits(logits) => masked_cross_entropy_sum(logits, labels, ignore_index),
        LmOutput::Hidden { hidden, head } => {
            let (hidden, labels, chunk_rows) = rows_of(hidden, &head, labels);
            linear_cross_entropy_sum(hidden, head, labels, ignore_index, chunk_rows)
        }
    }
}

/// `[batch, seq, d]` hidden states and `[batch, seq]` labels as rows, and the chunk size.
fn rows_of<B: Backend>(hidden: Tensor<B, 3>, head: &OutputHead<B>, labels: Tensor<B, 2, Int>) -> (Tensor<B, 2>, Tensor<B, 1, Int>, usize) {
    let [batch, seq, d_model] = hidden.dims();
    let chunk_rows = default_chunk_rows(head.weight.dims()[1]);
    (hidden.reshape([batch * seq, d_model]), labels.reshape([batch * seq]), chunk_rows)
}

/// `Σ -log p(label)` over the labels that are not `ignore_index`: `logits [B, S, V]`,
/// `labels [B, S]`. The graph stays connected when every label is ignored. Half-precision
/// logits are taken in f32, as transformers' loss takes them (`logits.float()`): the
/// log-sum-exp of a large vocabulary in bf16 is off by hundredths of a nat, its sums over
/// tokens by more.
pub fn masked_cross_entropy_sum<B: Backend>(
    logits: Tensor<B, 3>,
    labels: Tensor<B, 2, Int>,
    ignore_index: i64,
) -> Tensor<B, 1> {
    let logits = match FloatDType::from(logits.dtype()) {
        FloatDType::F16 | FloatDType::BF16 => logits.cast(FloatDType::F32),
        _ => logits,
    };
    let ignored = labels.clone().equal_elem(ignore_index);
    let targets = labels.mask_fill(ignored.clone(), 0);
    let log_probs = log_softmax(logits, 2);
    let picked = log_probs.gather(2, targets.unsqueeze_dim(2)).squeeze_dim::<2>(2);
    // Filled, not multiplied by 0: an ignored row's class-0 log-prob may be -inf.
    picked.mask_fill(ignored, 0.0).sum().neg()
}

/// The same sum as [`masked_cross_entropy_sum`] of `hidden · weight + bias`
/// (`hidden: [rows, d_model]`, `labels: [rows]`), computed `chunk_rows` rows at a time.
///
/// Gradients reach `hidden`, `weight` and `bias` as with the unchunked loss. Autodiff keeps
/// two tensors the size of `hidden` and one of `weight` instead of the logits. The price:
/// the forward does the work of the backward's two matmuls per chunk.
pub fn chunked_linear_cross_entropy_sum<B: TrainBackend>(
    hidden: Tensor<B, 2>,
    head: OutputHead<B>,
    labels: Tensor<B, 1, Int>,
    ignore_index: i64,
    chunk_rows: usize,
) -> Tensor<B, 1> {
    let inner_head = OutputHead::new(head.weight.clone().inner(), head.bias.clone().map(|b| b.inner())).with_logits_dtype(head.logits_dtype);
    // The rows' loss and gradient in one kernel where the wire backend has one (CubeCL).
    let fused = |logits: Tensor<B::InnerBackend, 2>, labels: Tensor<B::InnerBackend, 1>| {
        B::Wire::fused_cross_entropy(logits.into_primitive().tensor(), labels.into_primitive().tensor(), ignore_index)
            .ok()
            .map(|(losses, grads)| (Tensor::from_primitive(TensorPrimitive::Float(losses)), Tensor::from_primitive(TensorPrimitive::Float(grads))))
    };
    let (loss, grads) = chunked_loss(hidden.clone().inner(), inner_head, labels.inner(), ignore_index, chunk_rows, Some(&fused));
    let HeadGrads { hidden: hidden_grads, weight: weight_grad, bias: bias_grad } = grads.expect("asked for gradients");
    // Summed in f32; each gradient in its parameter's dtype.
    let (weight_grad, bias_grad) = (weight_grad.cast(FloatDType::from(head.weight.dtype())), bias_grad.zip(head.bias.as_ref()).map(|(grad, bias)| grad.cast(FloatDType::from(bias.dtype()))));

    // The loss as a node whose gradients are the ones computed above, scaled by its upstream.
    let hidden_grad = concatenated(hidden_grads, 0).into_primitive().tensor();
    let loss = loss.into_primitive().tensor();
    let (hidden, weight) = (hidden.into_primitive().tensor(), head.weight.into_primitive().tensor());
    let weight_grad = weight_grad.into_primitive().tensor();
    let value = match (head.bias, bias_grad) {
        (Some(bias), Some(bias_grad)) => {
            let bias_grad = bias_grad.squeeze_dim::<1>(0).into_primitive().tensor();
            B::with_gradients(loss, [(hidden, hidden_grad), (weight, weight_grad), (bias.into_primitive().tensor(), bias_grad)])
        }
        _ => B::with_gradients(loss, [(hidden, hidden_grad), (weight, weight_grad)]),
    };
    Tensor::from_primitive(TensorPrimitive::Float(value))
}

/// The loss of [`chunked_linear_cross_entropy_sum`] without gradients, on any backend (for
/// evaluation at long context, where whole logits would not fit either).
pub fn linear_cross_entropy_sum<B: Backend>(
    hidden: Tensor<B, 2>,
    head: OutputHead<B>,
    labels: Tensor<B, 1, Int>,
    ignore_index: i64,
    chunk_rows: usize,
) -> Tensor<B, 1> {
    chunked_loss(hidden, head, labels, ignore_index, chunk_rows, None).0
}

/// A kernel for a chunk's rows: `(logits [rows, vocab], labels [rows] as f32)` to each row's
/// loss and `d loss / d logits`, or `None` where the backend has none.
type FusedRows<'a, B> = &'a dyn Fn(Tensor<B, 2>, Tensor<B, 1>) -> Option<(Tensor<B, 1>, Tensor<B, 2>)>;

/// Gradients of the summed loss with respect to the hidden states (one tensor per chunk of
/// rows, in the hidden states' dtype), the head's weight and its bias (`[1, vocab]`), summed
/// over the chunks so far in f32: at long context a half-precision compute copy's head has
/// hundreds of chunks, each part below the running sum's rounding step in bf16.
struct HeadGrads<B: Backend> {
    hidden: Vec<Tensor<B, 2>>,
    weight: Tensor<B, 2>,
    /// `None` for a head without a bias.
    bias: Option<Tensor<B, 2>>,
}

impl<B: Backend> HeadGrads<B> {
    /// Adds one chunk, given its hidden states and `d loss / d logits` (both in the logits'
    /// dtype), the weight in that dtype, and the hidden states' own dtype.
    fn add_chunk(mut self, chunk: Tensor<B, 2>, logits_grad: Tensor<B, 2>, weight: &Tensor<B, 2>, hidden_dtype: FloatDType) -> Self {
        let sum_dtype = FloatDType::from(self.weight.dtype());
        self.hidden.push(logits_grad.clone().matmul(weight.clone().transpose()).cast(hidden_dtype));
        // A chunk's weight gradient sums up to `chunk_rows` products per element: past f16's
        // 65 504 for a frequent label, so f16 operands multiply into f32 (bf16 has f32's range).
        let (chunk, rows_grad) = match FloatDType::from(logits_grad.dtype()) {
            FloatDType::F16 => (chunk.cast(FloatDType::F32), logits_grad.clone().cast(FloatDType::F32)),
            _ => (chunk, logits_grad.clone()),
        };
        self.weight = self.weight + chunk.transpose().matmul(rows_grad).cast(sum_dtype);
        self.bias = self.bias.map(|bias| bias + logits_grad.cast(sum_dtype).sum_dim(0));
        self
    }
}

/// The chunk loop: the summed loss, and its gradients when given `fused_rows` (which
/// computes a chunk's rows in one kernel where the backend has one).
fn chunked_loss<B: Backend>(
    hidden: Tensor<B, 2>,
    head: OutputHead<B>,
    labels: Tensor<B, 1, Int>,
    ignore_index: i64,
    chunk_rows: usize,
    fused_rows: Option<FusedRows<B>>,
) -> (Tensor<B, 1>, Option<HeadGrads<B>>) {
    let with_grads = fused_rows.is_some();
    assert!(chunk_rows > 0, "chunked cross-entropy: chunk_rows must be positive");
    let [rows, d_model] = hidden.dims();
    let [weight_rows, vocab] = head.weight.dims();
    assert!(
        weight_rows == d_model && labels.dims()[0] == rows && head.bias.as_ref().is_none_or(|b| b.dims()[0] == vocab),
        "chunked cross-entropy: hidden {:?}, weight {:?}, bias {:?} and labels {:?} do not fit \
         (expected [rows, d], [d, vocab], [vocab], [rows])",
        hidden.dims(),
        head.weight.dims(),
        head.bias.as_ref().map(|b| b.dims()),
        labels.dims()
    );
    let device = hidden.device();
    let hidden_dtype = FloatDType::from(hidden.dtype());
    let logits_dtype = head.logits_dtype.unwrap_or(FloatDType::from(head.weight.dtype()));
    // The gradient sums are f32 (cast to the parameters' dtypes by the caller); the chunks
    // use the weight's cast.
    let weight_sum = with_grads.then(|| head.weight.zeros_like().cast(FloatDType::F32));
    let weight = head.weight.cast(logits_dtype);
    let bias = head.bias.map(|b| b.cast(logits_dtype).unsqueeze_dim::<2>(0));
    let with_bias = bias.is_some();

    // f32 whatever the device's default float: the rows' losses are f32, and a sum of an f32
    // and an f16 tensor reads one's bytes as the other's dtype.
    let mut loss = Tensor::<B, 1>::zeros([1], (&device, burn::tensor::DType::F32));
    // Gradient accumulators, only when asked: evaluation allocates nothing the size of the head.
    let mut grads = weight_sum.map(|weight_sum| HeadGrads {
        hidden: Vec::with_capacity(rows.div_ceil(chunk_rows)),
        bias: with_bias.then(|| weight_sum.clone().narrow(0, 0, 1)),
        weight: weight_sum,
    });
    for start in (0..rows).step_by(chunk_rows) {
        let end = (start + chunk_rows).min(rows);
        let chunk = hidden.clone().narrow(0, start, end - start).cast(logits_dtype);
        let chunk_labels = labels.clone().narrow(0, start, end - start);
        let mut logits = chunk.clone().matmul(weight.clone());
        if let Some(bias) = &bias {
            logits = logits + bias.clone();
        }
        // The labels as f32 exactly (`float()` gives the device's default float: in bf16,
        // ids past 256 are rounded to other tokens).
        let labels_f32 = || Tensor::from_primitive(TensorPrimitive::Float(B::int_into_float(chunk_labels.clone().into_primitive(), FloatDType::F32)));
        if let Some((row_losses, logits_grad)) = fused_rows.and_then(|rows| rows(logits.clone(), labels_f32())) {
            loss = loss + row_losses.sum();
            grads = grads.take().map(|sums| sums.add_chunk(chunk, logits_grad, &weight, hidden_dtype));
            continue;
        }
        let ignored = chunk_labels.clone().equal_elem(ignore_index);
        let targets = chunk_labels.mask_fill(ignored.clone(), 0).unsqueeze_dim::<2>(1);
        let ignored = ignored.unsqueeze_dim::<2>(1);
        let log_probs = log_softmax(logits.cast(FloatDType::F32), 1);
        let picked = log_probs.clone().gather(1, targets.clone());
        // Filled, not multiplied by 0: an ignored row's logits may hold -inf (a NaN row of softmax).
        loss = loss - picked.mask_fill(ignored.clone(), 0.0).sum();
        if let Some(sums) = grads.take() {
            // d loss / d logits = softmax - one_hot(label), zero on ignored rows.
            let minus_one = Tensor::full([end - start, 1], -1.0, (&device, burn::tensor::DType::F32));
            let vocab = log_probs.dims()[1];
            let logits_grad = log_probs.exp().scatter(1, targets, minus_one, IndexingUpdateOp::Add).mask_fill(ignored.expand([end - start, vocab]), 0.0);
            grads = Some(sums.add_chunk(chunk, logits_grad.cast(logits_dtype), &weight, hidden_dtype));
        }
    }
    (loss, grads)
}
