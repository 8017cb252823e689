//! Drop-ins for burn-nn's `TransformerEncoder` and `TransformerDecoder`: the same config
//! fields (and defaults), the same module fields, hence the same records, with every attention
//! through [`super::MultiHeadAttention`] (the attention op). A model switches by its imports:
//!
//! ```text
//! // use burn::nn::transformer::{TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput};
//! use burn_ulysses::nn::{TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput};
//! ```
//!
//! Causal self-attention is `TransformerEncoderInput::causal()` and
//! `TransformerDecoderInput::target_causal()`, where burn-nn models pass an autoregressive
//! `mask_attn`; under sequence parallelism that mask, built from a shard's shapes, would be
//! wrong. What differs from burn-nn is what differs for the attention module (no dropout on
//! scores, no `quiet_softmax`) and that there is no autoregressive cache.

use burn::{
    config::Config,
    module::{Initializer, Module},
    nn::{
        Dropout, DropoutConfig, LayerNorm, LayerNormConfig,
        activation::ActivationConfig,
        transformer::{PositionWiseFeedForward, PositionWiseFeedForwardConfig},
    },
    tensor::{Bool, Tensor, backend::Backend},
};

use super::{MhaInput, MultiHeadAttention, MultiHeadAttentionConfig};

/// Same fields and defaults as `burn::nn::transformer::TransformerEncoderConfig`.
#[derive(Config, Debug)]
pub struct TransformerEncoderConfig {
    pub d_model: usize,
    pub d_ff: usize,
    pub n_heads: usize,
    pub n_layers: usize,
    /// Applied to the residual paths and the feed-forward; not to attention scores.
    #[config(default = 0.1)]
    pub dropout: f64,
    #[config(default = false)]
    pub norm_first: bool,
    /// Not supported: `init` panics when set (as [`MultiHeadAttentionConfig`]).
    #[config(default = false)]
    pub quiet_softmax: bool,
    #[config(default = "Initializer::KaimingUniform{gain:1.0/3.0f64.sqrt(), fan_out_only:false}")]
    pub initializer: Initializer,
    #[config(default = "ActivationConfig::Gelu")]
    pub activation: ActivationConfig,
    #[config(default = 1e-5)]
    pub layer_norm_eps: f64,
}

/// Same fields, hence the same record, as `burn::nn::transformer::TransformerEncoder`.
#[derive(Module, Debug)]
pub struct TransformerEncoder<B: Backend> {
    pub layers: Vec<TransformerEncoderLayer<B>>,
    pub d_model: usize,
    pub d_ff: usize,
    pub n_heads: usize,
    pub n_layers: usize,
    pub dropout: f64,
    pub norm_first: bool,
    pub quiet_softmax: bool,
}

/// Same fields as `burn::nn::transformer::TransformerEncoderLayer`.
#[derive(Module, Debug)]
pub struct TransformerEncoderLayer<B: Backend> {
    pub mha: MultiHeadAttention<B>,
    pub pwff: PositionWiseFeedForward<B>,
    /// Around the feed-forward.
    pub norm_1: LayerNorm<B>,
    /// Around the attention.
    pub norm_2: LayerNorm<B>,
    pub dropout: Dropout,
    pub norm_first: bool,
}

/// burn-nn's `TransformerEncoderInput`, with [`causal`](Self::causal).
#[derive(Debug, Clone)]
pub struct TransformerEncoderInput<B: Backend> {
    tensor: Tensor<B, 3>,
    mask_pad: Option<Tensor<B, 2, Bool>>,
    mask_attn: Option<Tensor<B, 3, Bool>>,
    causal: bool,
}

impl<B: Backend> TransformerEncoderInput<B> {
    pub fn new(tensor: Tensor<B, 3>) -> Self {
        Self { tensor, mask_pad: None, mask_attn: None, causal: false }
    }

    /// `[batch, seq]`, true where a token is padding.
    pub fn mask_pad(mut self, mask_pad: Tensor<B, 2, Bool>) -> Self {
        self.mask_pad = Some(mask_pad);
        self
    }

    /// `[batch, seq, seq]`, true where a score is masked (refused under SP: see
    /// [`MhaInput::mask_attn`]).
    pub fn mask_attn(mut self, mask_attn: Tensor<B, 3, Bool>) -> Self {
        self.mask_attn = Some(mask_attn);
        self
    }

    /// Causal self-attention ([`MhaInput::causal`]).
    pub fn causal(mut self) -> Self {
        self.causal = true;
        self
    }
}

/// `input` with a run's masks and causal flag.
fn with_masks<B: Backend>(mut input: MhaInput<B>, mask_pad: &Option<Tensor<B, 2, Bool>>, mask_attn: &Option<Tensor<B, 3, Bool>>, causal: bool) -> MhaInput<B> {
    if let Some(mask_pad) = mask_pad {
        input = input.mask_pad(mask_pad.clone());
    }
    if let Some(mask_attn) = mask_attn {
        input = input.mask_attn(mask_attn.clone());
    }
    if causal { input.causal() } else { input }
}

/// burn-nn's attention config for a layer of these settings.
fn attention_config(d_model: usize, n_heads: usize, dropout: f64, quiet_softmax: bool, initializer: &Initializer) -> MultiHeadAttentionConfig {
    MultiHeadAttentionConfig::new(d_model, n_heads)
        .with_initializer(initializer.clone())
        .with_dropout(dropout)
        .with_quiet_softmax(quiet_softmax)
}

fn feed_forward<B: Backend>(d_model: usize, d_ff: usize, dropout: f64, activation: &ActivationConfig, initializer: &Initializer, device: &B::Device) -> PositionWiseFeedForward<B> {
    PositionWiseFeedForwardConfig::new(d_model, d_ff)
        .with_initializer(initializer.clone())
        .with_dropout(dropout)
        .with_activation(activation.clone())
        .init(device)
}

impl TransformerEncoderConfig {
    pub fn init<B: Backend>(&self, device: &B::Device) -> TransformerEncoder<B> {
        let layer = || TransformerEncoderLayer {
            mha: attention_config(self.d_model, self.n_heads, self.dropout, self.quiet_softmax, &self.initializer).init(device),
            pwff: feed_forward(self.d_model, self.d_ff, self.dropout, &self.activation, &self.initializer, device),
            norm_1: LayerNormConfig::new(self.d_model).with_epsilon(self.layer_norm_eps).init(device),
            norm_2: LayerNormConfig::new(self.d_model).with_epsilon(self.layer_norm_eps).init(device),
            dropout: DropoutConfig::new(self.dropout).init(),
            norm_first: self.norm_first,
        };
        TransformerEncoder {
            layers: (0..self.n_layers).map(|_| layer()).collect(),
            d_model: self.d_model,
            d_ff: self.d_ff,
            n_heads: self.n_heads,
            n_layers: self.n_layers,
            dropout: self.dropout,
            norm_first: self.norm_first,
            quiet_softmax: self.quiet_softmax,
        }
    }
}

impl<B: Backend> TransformerEncoder<B> {
    /// `[batch, seq, d_model]` → `[batch, seq, d_model]`.
    pub fn forward(&self, input: TransformerEncoderInput<B>) -> Tensor<B, 3> {
        let TransformerEncoderInput { tensor, mask_pad, mask_attn, causal } = input;
        self.layers.iter().fold(tensor, |x, layer| layer.forward(x, &mask_pad, &mask_attn, causal))
    }
}

impl<B: Backend> TransformerEncoderLayer<B> {
    /// burn-nn's order: attention then feed-forward, each a residual path, layer norms before
    /// (`norm_first`) or after them.
    pub fn forward(&self, x: Tensor<B, 3>, mask_pad: &Option<Tensor<B, 2, Bool>>, mask_attn: &Option<Tensor<B, 3, Bool>>, causal: bool) -> Tensor<B, 3> {
        let attended = if self.norm_first { self.norm_2.forward(x.clone()) } else { x.clone() };
        let attended = self.mha.forward(with_masks(MhaInput::self_attn(attended), mask_pad, mask_attn, causal)).context;
        let x = x + self.dropout.forward(attended);
        let (x, fed) = pre_or_post_norm(x, &self.norm_1, self.norm_first);
        let x = x + self.dropout.forward(self.pwff.forward(fed));
        if self.norm_first { x } else { self.norm_2.forward(x) }
    }
}

/// The residual stream and a sub-layer's input: with `norm_first` the stream as it is and its
/// normalised copy; otherwise the stream normalised, twice.
fn pre_or_post_norm<B: Backend>(x: Tensor<B, 3>, norm: &LayerNorm<B>, norm_first: bool) -> (Tensor<B, 3>, Tensor<B, 3>) {
    let normalised = norm.forward(x.clone());
    if norm_first { (x, normalised) } else { (normalised.clone(), normalised) }
}

/// Same fields and defaults as `burn::nn::transformer::TransformerDecoderConfig`.
#[derive(Config, Debug)]
pub struct TransformerDecoderConfig {
    pub d_model: usize,
    pub d_ff: usize,
    pub n_heads: usize,
    pub n_layers: usize,
    /// Applied to the residual paths and the feed-forward; not to attention scores.
    #[config(default = 0.1)]
    pub dropout: f64,
    #[config(default = false)]
    pub norm_first: bool,
    /// Not supported: `init` panics when set (as [`MultiHeadAttentionConfig`]).
    #[config(default = false)]
    pub quiet_softmax: bool,
    #[config(default = "Initializer::KaimingUniform{gain:1.0/3.0f64.sqrt(), fan_out_only:false}")]
    pub initializer: Initializer,
    #[config(default = "ActivationConfig::Gelu")]
    pub activation: ActivationConfig,
    #[config(default = 1e-5)]
    pub layer_norm_eps: f64,
}

/// Same fields, hence the same record, as `burn::nn::transformer::TransformerDecoder`.
#[derive(Module, Debug)]
pub struct TransformerDecoder<B: Backend> {
    pub layers: Vec<TransformerDecoderLayer<B>>,
    pub d_model: usize,
    pub d_ff: usize,
    pub n_heads: usize,
    pub n_layers: usize,
    pub dropout: f64,
    pub norm_first: bool,
    pub quiet_softmax: bool,
}

/// Same fields as `burn::nn::transformer::TransformerDecoderLayer`.
#[derive(Module, Debug)]
pub struct TransformerDecoderLayer<B: Backend> {
    pub cross_attn: MultiHeadAttention<B>,
    pub self_attn: MultiHeadAttention<B>,
    pub pwff: PositionWiseFeedForward<B>,
    /// Around the cross-attention.
    pub norm_1: LayerNorm<B>,
    /// Around the feed-forward.
    pub norm_2: LayerNorm<B>,
    /// Around the self-attention.
    pub norm_3: LayerNorm<B>,
    pub dropout: Dropout,
    pub norm_first: bool,
}

/// burn-nn's `TransformerDecoderInput`, with [`target_causal`](Self::target_causal).
#[derive(Debug, Clone)]
pub struct TransformerDecoderInput<B: Backend> {
    target: Tensor<B, 3>,
    target_mask_pad: Option<Tensor<B, 2, Bool>>,
    target_mask_attn: Option<Tensor<B, 3, Bool>>,
    target_causal: bool,
    memory: Tensor<B, 3>,
    memory_mask_pad: Option<Tensor<B, 2, Bool>>,
    memory_mask_attn: Option<Tensor<B, 3, Bool>>,
}

impl<B: Backend> TransformerDecoderInput<B> {
    pub fn new(target: Tensor<B, 3>, memory: Tensor<B, 3>) -> Self {
        Self { target, target_mask_pad: None, target_mask_attn: None, target_causal: false, memory, memory_mask_pad: None, memory_mask_attn: None }
    }

    pub fn memory_mask_pad(mut self, mask_pad: Tensor<B, 2, Bool>) -> Self {
        self.memory_mask_pad = Some(mask_pad);
        self
    }

    pub fn memory_mask_attn(mut self, mask_attn: Tensor<B, 3, Bool>) -> Self {
        self.memory_mask_attn = Some(mask_attn);
        self
    }

    pub fn target_mask_pad(mut self, mask_pad: Tensor<B, 2, Bool>) -> Self {
        self.target_mask_pad = Some(mask_pad);
        self
    }

    pub fn target_mask_attn(mut self, mask_attn: Tensor<B, 3, Bool>) -> Self {
        self.target_mask_attn = Some(mask_attn);
        self
    }

    /// Causal self-attention over the target ([`MhaInput::causal`]).
    pub fn target_causal(mut self) -> Self {
        self.target_causal = true;
        self
    }
}

impl TransformerDecoderConfig {
    pub fn init<B: Backend>(&self, device: &B::Device) -> TransformerDecoder<B> {
        let attention = || attention_config(self.d_model, self.n_heads, self.dropout, self.quiet_softmax, &self.initializer).init(device);
        let norm = || LayerNormConfig::new(self.d_model).with_epsilon(self.layer_norm_eps).init(device);
        let layer = || TransformerDecoderLayer {
            cross_attn: attention(),
            self_attn: attention(),
            pwff: feed_forward(self.d_model, self.d_ff, self.dropout, &self.activation, &self.initializer, device),
            norm_1: norm(),
            norm_2: norm(),
            norm_3: norm(),
            dropout: DropoutConfig::new(self.dropout).init(),
            norm_first: self.norm_first,
        };
        TransformerDecoder {
            layers: (0..self.n_layers).map(|_| layer()).collect(),
            d_model: self.d_model,
            d_ff: self.d_ff,
            n_heads: self.n_heads,
            n_layers: self.n_layers,
            dropout: self.dropout,
            norm_first: self.norm_first,
            quiet_softmax: self.quiet_softmax,
        }
    }
}

impl<B: Backend> TransformerDecoder<B> {
    /// The target `[batch, seq_target, d_model]` after every layer.
    pub fn forward(&self, input: TransformerDecoderInput<B>) -> Tensor<B, 3> {
        self.layers.iter().fold(input, |input, layer| layer.forward(input)).target
    }
}

impl<B: Backend> TransformerDecoderLayer<B> {
    /// burn-nn's order: self-attention, cross-attention over the memory, feed-forward.
    pub fn forward(&self, mut input: TransformerDecoderInput<B>) -> TransformerDecoderInput<B> {
        let x = input.target.clone();
        let attended = if self.norm_first { self.norm_3.forward(x.clone()) } else { x.clone() };
        let attended = self.self_attn.forward(with_masks(MhaInput::self_attn(attended), &input.target_mask_pad, &input.target_mask_attn, input.target_causal)).context;
        let x = x + self.dropout.forward(attended);

        let (x, crossing) = pre_or_post_norm(x, &self.norm_1, self.norm_first);
        let cross = with_masks(MhaInput::new(crossing, input.memory.clone(), input.memory.clone()), &input.memory_mask_pad, &input.memory_mask_attn, false);
        let x = x + self.dropout.forward(self.cross_attn.forward(cross).context);

        let (x, fed) = pre_or_post_norm(x, &self.norm_2, self.norm_first);
        let x = x + self.dropout.forward(self.pwff.forward(fed));
        input.target = if self.norm_first { x } else { self.norm_3.forward(x) };
        input
    }
}
