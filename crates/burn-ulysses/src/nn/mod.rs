//! Drop-ins for burn-nn's attention users that call the attention op: `MultiHeadAttention`
//! here, `TransformerEncoder` and `TransformerDecoder` in [`transformer`].
//!
//! burn-nn's module multiplies and softmaxes by hand, so `UlyssesBackend` never sees its
//! attention. This one has the same config fields (and defaults) and the same record, so a
//! model switches by changing one import, and checkpoints of either load into the other:
//!
//! ```text
//! // use burn::nn::attention::{MhaInput, MultiHeadAttention, MultiHeadAttentionConfig};
//! use burn_ulysses::nn::{MhaInput, MultiHeadAttention, MultiHeadAttentionConfig};
//! ```
//!
//! What differs, because the fused op never builds the `[S, S]` score matrix:
//! - [`MhaOutput`] has no `weights` (the attention probabilities);
//! - `dropout` is not applied to the scores (it is kept in the record);
//! - masked scores are `-inf`, not `min_float`: a row whose keys are all masked yields zeros
//!   instead of a uniform average;
//! - `quiet_softmax` is not supported and is rejected at `init`;
//! - there is no `forward_cache` (autoregressive decoding with a KV cache).
//!
//! Causal attention is [`MhaInput::causal`] (burn-nn models pass an autoregressive
//! `mask_attn` instead). Under sequence parallelism `mask_pad` (a key-padding mask) is
//! gathered across ranks, at one token a rank too (where `module::attention` refuses a mask
//! of that shape that no caller vouches for: `attention::with_key_padding_mask`); `mask_attn`
//! (a full `[S_q, S_k]` mask) is rejected with an explanation, at any shard length (one query
//! a rank too).

pub mod transformer;

pub use transformer::{
    TransformerDecoder, TransformerDecoderConfig, TransformerDecoderInput, TransformerDecoderLayer, TransformerEncoder, TransformerEncoderConfig,
    TransformerEncoderInput, TransformerEncoderLayer,
};

use burn::{
    config::Config,
    module::{Initializer, Module},
    nn::{Dropout, DropoutConfig, Gelu, Linear, LinearConfig},
    tensor::{Bool, Tensor, backend::Backend, module::attention, ops::AttentionModuleOptions},
};

/// Same fields and defaults as `burn::nn::attention::MultiHeadAttentionConfig`.
#[derive(Config, Debug)]
pub struct MultiHeadAttentionConfig {
    pub d_model: usize,
    pub n_heads: usize,
    /// Kept for record compatibility; the fused attention applies no dropout to scores.
    #[config(default = 0.1)]
    pub dropout: f64,
    /// Kept for record compatibility; masked scores are `-inf`.
    #[config(default = -1.0e4)]
    pub min_float: f64,
    /// Not supported: `init` panics when set.
    #[config(default = false)]
    pub quiet_softmax: bool,
    #[config(default = "Initializer::KaimingUniform{gain:1.0/3.0f64.sqrt(), fan_out_only:false}")]
    pub initializer: Initializer,
}

/// Same fields, hence the same record, as `burn::nn::attention::MultiHeadAttention`.
#[derive(Module, Debug)]
pub struct MultiHeadAttention<B: Backend> {
    pub query: Linear<B>,
    pub key: Linear<B>,
    pub value: Linear<B>,
    pub output: Linear<B>,
    pub dropout: Dropout,
    pub activation: Gelu,
    pub d_model: usize,
    pub n_heads: usize,
    pub d_k: usize,
    pub min_float: f64,
    pub quiet_softmax: bool,
}

impl MultiHeadAttentionConfig {
    pub fn init<B: Backend>(&self, device: &B::Device) -> MultiHeadAttention<B> {
        assert!(
            !self.quiet_softmax,
            "burn_ulysses::nn::MultiHeadAttention runs the fused attention op, which has no quiet \
             softmax; set quiet_softmax = false or keep burn-nn's module for this layer"
        );
        assert!(
            self.d_model % self.n_heads == 0,
            "d_model {} must be divisible by n_heads {}",
            self.d_model,
            self.n_heads
        );
        // Said once a process where a user looks: burn-nn's module applies dropout to the
        // scaled scores, before the mask and softmax, in training (its default is 0.1, the
        // Transformer drop-ins' layers' too), so the two train differently.
        if self.dropout > 0.0 {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                tracing::warn!(
                    dropout = self.dropout,
                    "burn_ulysses::nn's attention runs the fused attention op, which applies no dropout inside attention, where \
                     burn-nn's MultiHeadAttention applies this dropout to the scaled scores (before the mask and softmax) in training \
                     (a Transformer drop-in's other dropout applies as in burn-nn)"
                );
            });
        }
        let linear = || {
            LinearConfig::new(self.d_model, self.d_model)
                .with_initializer(self.initializer.clone())
                .init(device)
        };
        MultiHeadAttention {
            query: linear(),
            key: linear(),
            value: linear(),
            output: linear(),
            dropout: DropoutConfig::new(self.dropout).init(),
            activation: Gelu::new(),
            d_model: self.d_model,
            n_heads: self.n_heads,
            d_k: self.d_model / self.n_heads,
            min_float: self.min_float,
            quiet_softmax: self.quiet_softmax,
        }
    }
}

/// Same builder as burn-nn's `MhaInput`.
#[derive(Debug, Clone)]
pub struct MhaInput<B: Backend> {
    query: Tensor<B, 3>,
    key: Tensor<B, 3>,
    value: Tensor<B, 3>,
    mask_pad: Option<Tensor<B, 2, Bool>>,
    mask_attn: Option<Tensor<B, 3, Bool>>,
    causal: bool,
}

impl<B: Backend> MhaInput<B> {
    pub fn self_attn(tensor: Tensor<B, 3>) -> Self {
        Self::new(tensor.clone(), tensor.clone(), tensor)
    }

    pub fn new(query: Tensor<B, 3>, key: Tensor<B, 3>, value: Tensor<B, 3>) -> Self {
        Self { query, key, value, mask_pad: None, mask_attn: None, causal: false }
    }

    /// `[batch, seq_k]`, true where a key is padding.
    pub fn mask_pad(mut self, mask_pad: Tensor<B, 2, Bool>) -> Self {
        self.mask_pad = Some(mask_pad);
        self
    }

    /// `[batch, seq_q, seq_k]`, true where a score is masked.
    pub fn mask_attn(mut self, mask_attn: Tensor<B, 3, Bool>) -> Self {
        self.mask_attn = Some(mask_attn);
        self
    }

    /// Causal attention (each query sees the keys up to its own position, bottom-right
    /// aligned), sent to the kernels as `is_causal`: what burn-nn models express with
    /// `mask_attn(generate_autoregressive_mask(..))`. Under sequence parallelism a mask built
    /// from a shard's shapes would be wrong; this flag is right at any sharding.
    pub fn causal(mut self) -> Self {
        self.causal = true;
        self
    }
}

/// burn-nn's `MhaOutput` without the attention weights, which are never materialised.
#[derive(Debug, Clone)]
pub struct MhaOutput<B: Backend> {
    pub context: Tensor<B, 3>,
}

impl<B: Backend> MultiHeadAttention<B> {
    pub fn forward(&self, input: MhaInput<B>) -> MhaOutput<B> {
        let [batch, seq_q, _] = input.query.dims();
        let seq_k = input.key.dims()[1];
        let query = self.heads(input.query, &self.query);
        let key = self.heads(input.key, &self.key);
        let value = self.heads(input.value, &self.value);

        // A full mask of local shapes is refused by the op, but at one query a rank its
        // `[batch, heads, 1, S_k/P]` looks like a key-padding mask, which the exchange gathers:
        // refused here, where which mask it is is known.
        if input.mask_attn.is_some() && crate::context::current_sharding().is_some_and(|sharding| sharding.ranks > 1) {
            panic!(
                "sequence-parallel attention: MhaInput::mask_attn (shape {:?}) cannot be resharded: a mask built from the shard's \
                 shapes covers only this rank's block of the scores. Use MhaInput::causal() for causal attention \
                 (TransformerEncoderInput::causal(), TransformerDecoderInput::target_causal()) and mask_pad for padding, which is \
                 gathered along the keys",
                input.mask_attn.as_ref().map(|m| m.dims().to_vec()).unwrap_or_default()
            );
        }
        let pad = input.mask_pad.map(|m| m.reshape([batch, 1, 1, seq_k]));
        let full = input.mask_attn.map(|m| m.reshape([batch, 1, seq_q, seq_k]).expand([batch, self.n_heads, seq_q, seq_k]));
        let pad_alone = pad.is_some() && full.is_none();
        let mask = match (pad, full) {
            (pad, None) => pad,
            (None, full) => full,
            (Some(pad), Some(full)) => Some(full.bool_or(pad.expand([batch, self.n_heads, seq_q, seq_k]))),
        };
        let options = AttentionModuleOptions { scale: None, softcap: None, is_causal: input.causal };
        // `mask_pad` alone is a key-padding mask whatever the shard's length.
        let attend = || attention(query, key, value, mask, None, options);
        let context = if pad_alone { crate::attention::with_key_padding_mask(attend) } else { attend() };
        let context = context
            .swap_dims(1, 2)
            .reshape([batch, seq_q, self.d_model]);
        MhaOutput { context: self.output.forward(context) }
    }

    /// `[batch, seq, d_model]` → `[batch, heads, seq, d_k]`.
    fn heads(&self, x: Tensor<B, 3>, linear: &Linear<B>) -> Tensor<B, 4> {
        let [batch, seq, _] = x.dims();
        linear.forward(x).reshape([batch, seq, self.n_heads, self.d_k]).swap_dims(1, 2)
    }
}
