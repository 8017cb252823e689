//! The decoder of the four families (Llama, Mistral, Qwen2, Qwen3): RMSNorm, RoPE at global
//! positions, grouped-query causal attention through `burn::tensor::module::attention`, SwiGLU
//! feed-forward; as configuration, biases on q, k and v (Qwen2), RMSNorm over each head of q
//! and k (Qwen3), an output head tied to the embeddings, RoPE scaling. [`DecoderConfig::from_hf`]
//! builds the configuration of a checkpoint's `config.json`.
//!
//! Nothing here knows about sequence parallelism. Under `UlyssesBackend` each rank runs the
//! model on its shard of the sequence; the caller supplies the shard's position ids
//! ([`ShardPositions`]), global so that RoPE sees where each token sits. When the rows pack
//! several documents, positions restart at each one, and attention goes through
//! `burn_ulysses::attention::attention_within`, which keeps every token inside its document
//! and, for Mistral, within its sliding window (otherwise it is `module::attention`).
//!
//! Mixed precision ([`Decoder::with_compute_dtype`]): the hidden states are cast to the compute
//! dtype after the embedding and every op follows them (`burn_ulysses::precision`; norm
//! statistics in f32). The loss's logits are computed in the compute dtype (f32 with
//! [`Decoder::with_f32_head`]), a chunk of rows at a time (`lm_output`), their softmax and the
//! loss in f32; `forward` and `hidden` give all logits at once, in f32.

use std::{cell::RefCell, marker::PhantomData, ops::Range};

use burn::{
    config::Config,
    module::{Module, ModuleVisitor},
    record::{PrecisionSettings, Record},
    serde::{Serialize, Serializer, ser::{Error as _, SerializeSeq, SerializeStruct}},
    nn::{Embedding, EmbeddingConfig, Initializer, Linear, LinearConfig, RmsNorm, RmsNormConfig},
    tensor::{
        FloatDType, Int, Tensor,
        activation::silu,
        backend::{AutodiffBackend, Backend},
        ops::AttentionModuleOptions,
    },
};

use burn_ulysses::{
    attention::{attention_within, repeat_kv_heads},
    data::ShardPositions,
    precision::{linear, rms_norm},
    visibility::PositionIds,
};
use ulysses_training::{CausalLm, EmbeddingLookup, LayeredLm, LmOutput, OutputHead};

use crate::{HfConfig, rope::RopeScaling, rope_tables::RopeTables};

#[derive(Config, Debug)]
pub struct DecoderConfig {
    pub vocab_size: usize,
    #[config(default = 128)]
    pub d_model: usize,
    #[config(default = 2)]
    pub n_layers: usize,
    #[config(default = 8)]
    pub n_heads: usize,
    #[config(default = 2)]
    pub n_kv_heads: usize,
    #[config(default = 256)]
    pub ffn_hidden: usize,
    /// Each head's width; `None`: `d_model / n_heads` (Qwen3 and some Mistrals set their own).
    pub head_dim: Option<usize>,
    #[config(default = 10000.0)]
    pub rope_theta: f64,
    #[config(default = "RopeScaling::Default")]
    pub rope_scaling: RopeScaling,
    #[config(default = 1e-5)]
    pub norm_eps: f64,
    /// Biases on the q, k and v projections (Qwen2).
    #[config(default = false)]
    pub qkv_bias: bool,
    /// A bias on the attention's output projection.
    #[config(default = false)]
    pub output_bias: bool,
    /// RMSNorm over each head of q and k, before RoPE (Qwen3).
    #[config(default = false)]
    pub qk_norm: bool,
    /// The output head is the embedding matrix: no `lm_head` of its own.
    #[config(default = false)]
    pub tie_embeddings: bool,
    /// Mistral's window: each query sees only the last this many keys (itself included), in
    /// the flash kernels as in the dense attention (`burn_ulysses::attention::attention_within`).
    pub sliding_window: Option<usize>,
    /// Expand kv heads to the q head count before calling attention. Burn's own attention
    /// needs equal head counts (`attention_within` expands them for it where the model
    /// leaves them grouped); `UlyssesBackend` accepts grouped kv heads natively and then
    /// exchanges `n_heads / n_kv_heads` times fewer kv bytes. It changes no parameter.
    #[config(default = true)]
    pub repeat_kv: bool,
    /// Causal (decoder) attention.
    #[config(default = true)]
    pub causal: bool,
    /// Initialise every weight matrix and the embeddings from a normal distribution of this
    /// standard deviation, as transformers does (`initializer_range`, 0.02); `None`: burn's
    /// defaults (unit-variance embeddings, which tied to the output head give logits of
    /// size √d_model: a first loss of hundreds at a Hugging Face model's width).
    pub init_std: Option<f64>,
    /// The token whose embedding row takes no gradient from the inputs (a Hugging Face
    /// config's `pad_token_id`, as transformers' `nn.Embedding(padding_idx)` treats it), and
    /// starts at zero with `init_std`; a tied head still trains it.
    #[config(default = "None")]
    pub pad_token: Option<usize>,
}

impl DecoderConfig {
    /// The model of a Hugging Face checkpoint's configuration (its `config.json`, read and
    /// checked by [`HfConfig::from_hf`]).
    pub fn from_hf(config: &HfConfig) -> Self {
        Self::new(config.vocab_size)
            .with_d_model(config.hidden_size)
            .with_n_layers(config.num_hidden_layers)
            .with_n_heads(config.num_attention_heads)
            .with_n_kv_heads(config.num_key_value_heads)
            .with_head_dim(Some(config.head_dim))
            .with_ffn_hidden(config.intermediate_size)
            .with_rope_theta(config.rope_theta)
            .with_rope_scaling(config.rope_scaling)
            .with_norm_eps(config.rms_norm_eps)
            .with_qkv_bias(config.qkv_bias)
            .with_output_bias(config.output_bias)
            .with_qk_norm(config.qk_norm)
            .with_tie_embeddings(config.tie_word_embeddings)
            .with_sliding_window(config.sliding_window)
            .with_init_std(Some(config.initializer_range))
            .with_pad_token(config.pad_token_id.map(|id| id as usize))
    }

    /// [`DecoderConfig::init_std`]'s normal distribution, if it asks for one.
    fn normal_init(&self) -> Option<Initializer> {
        self.init_std.map(|std| Initializer::Normal { mean: 0.0, std })
    }

    /// A linear layer whose weights follow [`DecoderConfig::init_std`] (burn's default without).
    fn init_linear<B: Backend>(&self, d_in: usize, d_out: usize, bias: bool, device: &B::Device) -> Linear<B> {
        let config = LinearConfig::new(d_in, d_out).with_bias(bias);
        match self.normal_init() {
            // As transformers' `_init_weights`: weights from the normal, biases zero.
            Some(initializer) => {
                let mut linear = config.with_initializer(initializer).init(device);
                // A new tensor: it takes the parameter's `require_grad` over, or it would not train.
                // Applied when burn builds the parameter (`init_mapper`), so a model stays lazy.
                linear.bias = linear.bias.map(|bias| bias.init_mapper(|values| values.zeros_like().set_require_grad(values.is_require_grad())));
                linear
            }
            None => config.init(device),
        }
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.d_model / self.n_heads)
    }

    /// What makes a model of this config impossible, or silently another (a padding row past
    /// the vocabulary is no row; a θ of NaN, NaN positions): named, where [`init`](Self::init)
    /// would panic deep in a forward or train a NaN loss. [`HfConfig`]'s reading refuses the
    /// same in a config.json, naming its keys.
    pub fn validate(&self) -> Result<(), String> {
        for (name, value) in [("vocab_size", self.vocab_size), ("d_model", self.d_model), ("n_layers", self.n_layers), ("n_heads", self.n_heads), ("n_kv_heads", self.n_kv_heads), ("ffn_hidden", self.ffn_hidden)] {
            if value == 0 {
                return Err(format!("DecoderConfig::{name} must be at least 1, got 0"));
            }
        }
        if self.head_dim.is_none() && self.d_model % self.n_heads != 0 {
            return Err(format!("d_model {} must be divisible by n_heads {} (or give head_dim)", self.d_model, self.n_heads));
        }
        if self.n_heads % self.n_kv_heads != 0 {
            return Err(format!("n_kv_heads {} must divide n_heads {}", self.n_kv_heads, self.n_heads));
        }
        if self.head_dim() == 0 || self.head_dim() % 2 != 0 {
            return Err(format!("the head dimension {} must be even and above 0: RoPE rotates pairs of channels", self.head_dim()));
        }
        for (name, value) in [("rope_theta", self.rope_theta), ("norm_eps", self.norm_eps)] {
            if !(value.is_finite() && value > 0.0) {
                return Err(format!("DecoderConfig::{name} must be a finite number above 0, got {value}"));
            }
        }
        if let Some(pad) = self.pad_token.filter(|&pad| pad >= self.vocab_size) {
            return Err(format!("pad_token {pad} is outside the vocabulary 0..{}: no embedding row is padding's", self.vocab_size));
        }
        if self.sliding_window == Some(0) || (self.sliding_window.is_some() && !self.causal) {
            return Err(format!("sliding_window {:?} needs causal attention and a window of at least 1 key", self.sliding_window));
        }
        Ok(())
    }

    fn check(&self) {
        if let Err(problem) = self.validate() {
            panic!("{problem}");
        }
    }

    pub fn init<B: Backend>(&self, device: &B::Device) -> Decoder<B> {
        self.check();
        Decoder {
            embedding: {
                let config = EmbeddingConfig::new(self.vocab_size, self.d_model);
                let mut embedding = match self.normal_init() {
                    Some(initializer) => config.with_initializer(initializer),
                    None => config,
                }
                .init(device);
                // The padding row starts at zero, as transformers' `_init_weights` sets it, when
                // burn builds the weight (`init_mapper`): a model too large to build stays lazy.
                if let Some(pad) = self.pad_token.filter(|_| self.init_std.is_some()) {
                    let d_model = self.d_model;
                    embedding.weight = embedding.weight.init_mapper(move |weight| {
                        let zeros = Tensor::zeros([1, d_model], &weight.device());
                        // Detached: a leaf again, which the flag can be set on.
                        weight.clone().slice_assign([pad..pad + 1, 0..d_model], zeros).detach().set_require_grad(weight.is_require_grad())
                    });
                }
                embedding
            },
            blocks: (0..self.n_layers).map(|_| self.init_block(device)).collect(),
            norm: RmsNormConfig::new(self.d_model).with_epsilon(self.norm_eps).init(device),
            lm_head: (!self.tie_embeddings).then(|| self.init_linear(self.d_model, self.vocab_size, false, device)),
            head_dim: self.head_dim(),
            rope_theta: self.rope_theta,
            rope_scaling: self.rope_scaling,
            compute_dtype: FloatDType::F32,
            f32_head: false,
            vocab_size: self.vocab_size,
            pad_token: self.pad_token,
        }
    }

    pub fn init_block<B: Backend>(&self, device: &B::Device) -> Block<B> {
        self.check();
        let linear = |d_in, d_out, bias| self.init_linear(d_in, d_out, bias, device);
        let head_dim = self.head_dim();
        let head_norm = || self.qk_norm.then(|| RmsNormConfig::new(head_dim).with_epsilon(self.norm_eps).init(device));
        Block {
            attention_norm: RmsNormConfig::new(self.d_model).with_epsilon(self.norm_eps).init(device),
            attention: Attention {
                wq: linear(self.d_model, self.n_heads * head_dim, self.qkv_bias),
                wk: linear(self.d_model, self.n_kv_heads * head_dim, self.qkv_bias),
                wv: linear(self.d_model, self.n_kv_heads * head_dim, self.qkv_bias),
                wo: linear(self.n_heads * head_dim, self.d_model, self.output_bias),
                q_norm: head_norm(),
                k_norm: head_norm(),
                n_heads: self.n_heads,
                n_kv_heads: self.n_kv_heads,
                head_dim,
                repeat_kv: self.repeat_kv,
                causal: self.causal,
                sliding_window: self.sliding_window,
            },
            ffn_norm: RmsNormConfig::new(self.d_model).with_epsilon(self.norm_eps).init(device),
            feed_forward: FeedForward {
                gate: linear(self.d_model, self.ffn_hidden, false),
                up: linear(self.d_model, self.ffn_hidden, false),
                down: linear(self.ffn_hidden, self.d_model, false),
            },
        }
    }
}

/// What every block needs besides its input, built once per shard.
pub struct LlamaContext<B: Backend> {
    rope: RopeTables<B>,
    /// The position ids, when the shard packs several documents per row.
    documents: Option<PositionIds>,
}

/// The model in the pieces that whole-layer checkpointing runs one at a time; the forward
/// above is made of the same pieces.
impl<B: Backend> LayeredLm<B> for Decoder<B> {
    type Context = LlamaContext<B>;

    fn context(&self, positions: &ShardPositions, device: &B::Device) -> LlamaContext<B> {
        let rope = RopeTables::at(&positions.ids, self.head_dim, self.rope_theta, self.rope_scaling, device).in_dtype(self.compute_dtype);
        LlamaContext { rope, documents: positions.packed.then(|| positions.ids.clone()) }
    }

    fn embed(&self, tokens: Tensor<B, 2, Int>, _context: &LlamaContext<B>) -> Tensor<B, 3> {
        let embedded = self.embedding.forward(tokens.clone());
        // The padding row's lookups pass no gradient to it (transformers' `padding_idx`): the
        // same values, detached where the token is the pad.
        let embedded = match self.pad_token {
            Some(pad) if self.embedding.weight.is_require_grad() => {
                let is_pad = tokens.equal_elem(pad as i64).unsqueeze_dim::<3>(2).expand(embedded.shape());
                embedded.clone().mask_where(is_pad, embedded.detach())
            }
            _ => embedded,
        };
        embedded.cast(self.compute_dtype)
    }

    fn layer_count(&self) -> usize {
        self.blocks.len()
    }

    fn visit_layer<V: ModuleVisitor<B>>(&self, index: usize, visitor: &mut V) {
        self.blocks[index].visit(visitor);
    }

    fn before_core(&self, index: usize, hidden: Tensor<B, 3>, rows: Range<usize>, context: &LlamaContext<B>) -> Vec<Tensor<B, 4>> {
        self.blocks[index].attention_inputs(hidden, &context.rope.rows(rows)).into()
    }

    fn core(&self, index: usize, inputs: Vec<Tensor<B, 4>>, context: &LlamaContext<B>) -> Tensor<B, 4> {
        let [q, k, v] = inputs.try_into().unwrap_or_else(|inputs: Vec<_>| panic!("the attention core takes q, k and v, got {} tensors", inputs.len()));
        self.blocks[index].attention.core(q, k, v, context.documents.as_ref())
    }

    fn after_core(&self, index: usize, hidden: Tensor<B, 3>, core: Tensor<B, 4>) -> Tensor<B, 3> {
        self.blocks[index].after_attention(hidden, core)
    }

    fn head(&self, hidden: Tensor<B, 3>) -> LmOutput<B> {
        LmOutput::Hidden { hidden: self.final_norm(hidden), head: self.output_head() }
    }

    /// An untied head and the final norm (a tied head's weight is the embedding's).
    fn visit_standalone_head<V: ModuleVisitor<B>>(&self, visitor: &mut V) {
        if let Some(head) = &self.lm_head {
            self.norm.visit(visitor);
            head.visit(visitor);
        }
    }

    /// [`embed`](LayeredLm::embed) looks up the embedding's rows and casts them, the padding
    /// row passing no gradient.
    fn embedding_lookup(&self) -> Option<EmbeddingLookup> {
        let weight = &self.embedding.weight;
        Some(EmbeddingLookup { weight: weight.id, vocab: self.vocab_size, trains: weight.is_require_grad(), no_gradient_token: self.pad_token })
    }
}

/// What the training step needs of the model.
impl<B: AutodiffBackend> CausalLm<B> for Decoder<B> {
    fn logits(&self, tokens: Tensor<B, 2, Int>, positions: &ShardPositions) -> Tensor<B, 3> {
        self.forward(tokens, positions)
    }

    /// The loss runs over the hidden states in chunks of rows, never holding all logits.
    fn lm_output(&self, tokens: Tensor<B, 2, Int>, positions: &ShardPositions) -> LmOutput<B> {
        Decoder::lm_output(self, tokens, positions)
    }

    fn vocab_size(&self) -> usize {
        Decoder::vocab_size(self)
    }

    fn is_causal(&self) -> bool {
        Decoder::is_causal(self)
    }
}

/// [`Decoder::record_item_by_layers`]: the rest's record item, and where each block's comes from.
pub struct DecoderItemByLayers<B: Backend, S: PrecisionSettings, F> {
    rest: DecoderRecordItem<B, S>,
    layer: RefCell<F>,
}

impl<B: Backend, S: PrecisionSettings, F: FnMut(usize) -> Result<Decoder<B>, String>> Serialize for DecoderItemByLayers<B, S, F> {
    /// As the Record derive's `DecoderRecordItem` serializes (its fields, in the struct's order),
    /// `blocks` made one at a time: tests/checkpoint.rs holds the file to burn's byte for byte.
    fn serialize<Z: Serializer>(&self, serializer: Z) -> Result<Z::Ok, Z::Error> {
        let DecoderRecordItem { embedding, blocks, norm, lm_head, head_dim, rope_theta, rope_scaling, compute_dtype, f32_head, vocab_size, pad_token } = &self.rest;
        let mut item = serializer.serialize_struct("DecoderRecordItem", 11)?;
        item.serialize_field("embedding", embedding)?;
        item.serialize_field("blocks", &BlocksByLayer::<B, S, F> { count: blocks.len(), layer: &self.layer, precision: PhantomData })?;
        item.serialize_field("norm", norm)?;
        item.serialize_field("lm_head", lm_head)?;
        item.serialize_field("head_dim", head_dim)?;
        item.serialize_field("rope_theta", rope_theta)?;
        item.serialize_field("rope_scaling", rope_scaling)?;
        item.serialize_field("compute_dtype", compute_dtype)?;
        item.serialize_field("f32_head", f32_head)?;
        item.serialize_field("vocab_size", vocab_size)?;
        item.serialize_field("pad_token", pad_token)?;
        item.end()
    }
}

/// The blocks of a [`DecoderItemByLayers`], each asked for as the serializer reaches it.
struct BlocksByLayer<'a, B, S, F> {
    count: usize,
    layer: &'a RefCell<F>,
    precision: PhantomData<(B, S)>,
}

impl<B: Backend, S: PrecisionSettings, F: FnMut(usize) -> Result<Decoder<B>, String>> Serialize for BlocksByLayer<'_, B, S, F> {
    fn serialize<Z: Serializer>(&self, serializer: Z) -> Result<Z::Ok, Z::Error> {
        let mut blocks = serializer.serialize_seq(Some(self.count))?;
        for index in 0..self.count {
            let mut whole = (self.layer.borrow_mut())(index).map_err(Z::Error::custom)?;
            blocks.serialize_element(&whole.blocks.swap_remove(index).into_record().into_item::<S>())?;
        }
        blocks.end()
    }
}

#[derive(Module, Debug)]
pub struct Decoder<B: Backend> {
    pub embedding: Embedding<B>,
    pub blocks: Vec<Block<B>>,
    pub norm: RmsNorm<B>,
    /// `None`: tied to the embeddings.
    pub lm_head: Option<Linear<B>>,
    head_dim: usize,
    rope_theta: f64,
    /// From the configuration, like the head dim; not part of the record.
    #[module(skip)]
    rope_scaling: RopeScaling,
    /// What the layers compute in (the parameters stay f32); not part of the record.
    #[module(skip)]
    compute_dtype: FloatDType,
    /// The loss's logits in f32 even when the layers compute in a half dtype.
    #[module(skip)]
    f32_head: bool,
    /// Kept apart from the embedding's shape: under ZeRO-3 a parameter between its gathers is
    /// a placeholder (`ulysses_training::ShardedParameters`).
    #[module(skip)]
    vocab_size: usize,
    /// The embedding row that takes no gradient from the inputs ([`DecoderConfig::pad_token`]);
    /// not part of the record (a record of before it loads).
    #[module(skip)]
    pad_token: Option<usize>,
}

impl<B: Backend> Decoder<B> {
    /// What a recorder writes of the whole model (it serializes as the model's record item),
    /// for a model whose parameters are never whole in one place (ZeRO-3): `rest` is the model
    /// with its embeddings, final norm and head whole, `layer(i)` the model with block `i`
    /// whole, asked for when the serializer reaches block `i` and dropped once it is written.
    /// So one block's record (`S`'s precision) is in memory at a time beside the rest's, never
    /// the whole model's; an `Err` from `layer` stops the serializer with its message. Serialize
    /// it once: each serialization asks for every block again (under ZeRO-3, collectives).
    pub fn record_item_by_layers<S: PrecisionSettings, F: FnMut(usize) -> Result<Self, String>>(rest: Self, layer: F) -> DecoderItemByLayers<B, S, F> {
        DecoderItemByLayers { rest: rest.into_record().into_item::<S>(), layer: RefCell::new(layer) }
    }

    /// `tokens: [batch, seq]` at `positions` → logits `[batch, seq, vocab]`.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>, positions: &ShardPositions) -> Tensor<B, 3> {
        let head = self.output_head();
        // In the hidden states' f32, whatever the parameters' dtype (a compute copy, a
        // half-precision default float): tensors of two dtypes do not mix.
        let logits = self.hidden(tokens, positions).matmul(head.weight.cast(FloatDType::F32).unsqueeze());
        match head.bias {
            Some(bias) => logits + bias.cast(FloatDType::F32).unsqueeze(),
            None => logits,
        }
    }

    /// The embedding matrix (and the output head, where tied to it) kept as it is: it takes
    /// no gradient, so no optimizer updates it.
    pub fn with_frozen_embeddings(mut self) -> Self {
        self.embedding.weight = self.embedding.weight.set_require_grad(false);
        self
    }

    /// The projection from the last hidden states to logits: `lm_head`, or the embedding
    /// matrix transposed where the two are tied.
    pub fn output_head(&self) -> OutputHead<B> {
        match &self.lm_head {
            Some(head) => OutputHead::new(head.weight.val(), head.bias.as_ref().map(|b| b.val())),
            None => OutputHead::new(self.embedding.weight.val().transpose(), None),
        }
        // Named, not left to the weight's dtype: a sharded optimizer's compute copy holds the
        // head in bf16, where `--f32-head` would otherwise compute bf16 logits.
        .with_logits_dtype(match self.f32_head {
            true => Some(FloatDType::F32),
            false => (self.compute_dtype != FloatDType::F32).then_some(self.compute_dtype),
        })
    }

    /// The last hidden states and the output head, from which the loss is computed a chunk of
    /// rows at a time (never holding all `tokens × vocab` logits).
    pub fn lm_output(&self, tokens: Tensor<B, 2, Int>, positions: &ShardPositions) -> LmOutput<B> {
        let _noted = burn_ulysses::attention_guard::note_shard_positions_unless_noted(positions);
        let context = self.context_of(&tokens, positions);
        self.head(self.layers(self.embed(tokens, &context), &context))
    }

    /// The normalised last hidden states `[batch, seq, d_model]` that `lm_head` projects to
    /// logits, in f32 like the head.
    pub fn hidden(&self, tokens: Tensor<B, 2, Int>, positions: &ShardPositions) -> Tensor<B, 3> {
        // For the guard: attention on a shard its rank context does not hold is refused.
        let _noted = burn_ulysses::attention_guard::note_shard_positions_unless_noted(positions);
        let context = self.context_of(&tokens, positions);
        self.final_norm(self.layers(self.embed(tokens, &context), &context)).cast(FloatDType::F32)
    }

    /// The context of `tokens` at `positions`; a forward's panic (it returns no error) naming
    /// positions of other rows than the tokens'.
    fn context_of(&self, tokens: &Tensor<B, 2, Int>, positions: &ShardPositions) -> LlamaContext<B> {
        if let Err(error) = positions.check_tokens(tokens.dims()) {
            panic!("{error}");
        }
        self.context(positions, &tokens.device())
    }

    /// The last norm, in the compute dtype (the chunked loss computes each chunk's logits in
    /// the head's logits dtype).
    fn final_norm(&self, hidden: Tensor<B, 3>) -> Tensor<B, 3> {
        rms_norm(&self.norm, hidden)
    }

    fn layers(&self, mut x: Tensor<B, 3>, context: &LlamaContext<B>) -> Tensor<B, 3> {
        for index in 0..self.blocks.len() {
            x = self.layer(index, x, context);
        }
        x
    }

    /// Computes the layers in `dtype` (f32 master weights; see the module doc). Resolve it
    /// with `burn_ulysses::precision::Precision::compute_dtype`.
    pub fn with_compute_dtype(mut self, dtype: FloatDType) -> Self {
        self.compute_dtype = dtype;
        self
    }

    pub fn compute_dtype(&self) -> FloatDType {
        self.compute_dtype
    }

    /// Computes the loss's logits in f32 rather than in the compute dtype (the head's matmuls
    /// then run on TF32 rather than bf16 tensor cores; the softmax and loss are f32 either way).
    pub fn with_f32_head(mut self, f32_head: bool) -> Self {
        self.f32_head = f32_head;
        self
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Whether every attention layer is causal.
    pub fn is_causal(&self) -> bool {
        self.blocks.iter().all(|block| block.attention.causal)
    }

    /// Switches every attention layer between grouped kv heads and kv heads expanded to the
    /// q head count (see [`DecoderConfig::repeat_kv`]).
    pub fn with_repeat_kv(mut self, repeat_kv: bool) -> Self {
        for block in &mut self.blocks {
            block.attention.repeat_kv = repeat_kv;
        }
        self
    }
}

#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    pub attention_norm: RmsNorm<B>,
    pub attention: Attention<B>,
    pub ffn_norm: RmsNorm<B>,
    pub feed_forward: FeedForward<B>,
}

impl<B: Backend> Block<B> {
    /// `x: [batch, seq, d_model]`, with `rope` built for the same positions; `documents`:
    /// the position ids of rows that pack several documents.
    pub fn forward(&self, x: Tensor<B, 3>, rope: &RopeTables<B>, documents: Option<&PositionIds>) -> Tensor<B, 3> {
        let [q, k, v] = self.attention_inputs(x.clone(), rope);
        self.after_attention(x, self.attention.core(q, k, v, documents))
    }

    /// q, k and v of `norm(x)`: token by token, so it may run on a slice of the sequence
    /// (with `rope` for that slice).
    pub fn attention_inputs(&self, x: Tensor<B, 3>, rope: &RopeTables<B>) -> [Tensor<B, 4>; 3] {
        self.attention.inputs(rms_norm(&self.attention_norm, x), rope)
    }

    /// `h = x + wo(attended)`, then `h + feed_forward(norm(h))`, given the block's input `x`
    /// and the attention core's output for the same rows: token by token.
    pub fn after_attention(&self, x: Tensor<B, 3>, attended: Tensor<B, 4>) -> Tensor<B, 3> {
        let h = x + self.attention.output(attended);
        h.clone() + self.feed_forward.forward(rms_norm(&self.ffn_norm, h))
    }
}

#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    pub wq: Linear<B>,
    pub wk: Linear<B>,
    pub wv: Linear<B>,
    pub wo: Linear<B>,
    /// RMSNorm over each head of q and of k (Qwen3).
    pub q_norm: Option<RmsNorm<B>>,
    pub k_norm: Option<RmsNorm<B>>,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    repeat_kv: bool,
    causal: bool,
    /// Mistral's sliding window; from the configuration, not part of the record.
    #[module(skip)]
    sliding_window: Option<usize>,
}

impl<B: Backend> Attention<B> {
    /// `x: [batch, seq, d_model]` (normalised) → `[batch, seq, d_model]`.
    pub fn forward(&self, x: Tensor<B, 3>, rope: &RopeTables<B>, documents: Option<&PositionIds>) -> Tensor<B, 3> {
        let [q, k, v] = self.inputs(x, rope);
        self.output(self.core(q, k, v, documents))
    }

    /// The projections, with RoPE on q and k: `[batch, heads, seq, head_dim]` each (k and v
    /// with the kv head count).
    pub fn inputs(&self, x: Tensor<B, 3>, rope: &RopeTables<B>) -> [Tensor<B, 4>; 3] {
        let [b, s, _] = x.dims();
        let heads = |t: Tensor<B, 3>, n, norm: Option<&RmsNorm<B>>| {
            let t = t.reshape([b, s, n, self.head_dim]);
            let t = match norm {
                Some(norm) => rms_norm(norm, t),
                None => t,
            };
            t.swap_dims(1, 2)
        };
        let q = rope.apply(heads(linear(&self.wq, x.clone()), self.n_heads, self.q_norm.as_ref()));
        let k = rope.apply(heads(linear(&self.wk, x.clone()), self.n_kv_heads, self.k_norm.as_ref()));
        let v = heads(linear(&self.wv, x), self.n_kv_heads, None);
        [q, k, v]
    }

    /// Attention itself, the only part that mixes tokens: `[batch, heads, seq, head_dim]`.
    pub fn core(&self, q: Tensor<B, 4>, k: Tensor<B, 4>, v: Tensor<B, 4>, documents: Option<&PositionIds>) -> Tensor<B, 4> {
        let (k, v) = if self.repeat_kv {
            let group = self.n_heads / self.n_kv_heads;
            (repeat_kv_heads(k, group), repeat_kv_heads(v, group))
        } else {
            (k, v)
        };
        let options = AttentionModuleOptions { scale: None, softcap: None, is_causal: self.causal };
        attention_within(q, k, v, documents, self.sliding_window, options)
    }

    /// The output projection of the core's output `[batch, heads, seq, head_dim]`.
    pub fn output(&self, attended: Tensor<B, 4>) -> Tensor<B, 3> {
        let [b, _, s, _] = attended.dims();
        linear(&self.wo, attended.swap_dims(1, 2).reshape([b, s, self.n_heads * self.head_dim]))
    }
}

#[derive(Module, Debug)]
pub struct FeedForward<B: Backend> {
    pub gate: Linear<B>,
    pub up: Linear<B>,
    pub down: Linear<B>,
}

impl<B: Backend> FeedForward<B> {
    /// SwiGLU: `down(silu(gate(x)) · up(x))`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        linear(&self.down, silu(linear(&self.gate, x.clone())) * linear(&self.up, x))
    }
}

#[cfg(test)]
mod tests {
    use burn::{backend::NdArray, tensor::FloatDType};

    use super::DecoderConfig;

    /// `--f32-head` names f32 for the logits whatever the weight's dtype (a sharded optimizer's
    /// bf16 compute copy left them bf16: `None` read as the weight's dtype).
    #[test]
    fn an_f32_head_computes_its_logits_in_f32_whatever_the_weights_dtype() {
        let model = DecoderConfig::new(64).with_d_model(16).with_n_heads(2).with_n_kv_heads(2).with_ffn_hidden(32).init::<NdArray<f32>>(&Default::default());
        let model = model.with_compute_dtype(FloatDType::BF16);
        assert_eq!(model.clone().with_f32_head(true).output_head().logits_dtype, Some(FloatDType::F32));
        assert_eq!(model.with_f32_head(false).output_head().logits_dtype, Some(FloatDType::BF16));
    }

    /// A config no model can follow, or one that would train another silently, is refused
    /// naming the field: 0 heads panicked in a remainder, a padding row past the vocabulary was
    /// no row, a θ of NaN trained a NaN loss.
    #[test]
    fn a_config_no_decoder_follows_is_refused_naming_the_field() {
        let base = || DecoderConfig::new(64).with_d_model(16).with_n_heads(2).with_n_kv_heads(2).with_ffn_hidden(32);
        assert_eq!(base().validate(), Ok(()));
        for (config, named) in [
            (base().with_n_heads(0), "n_heads must be at least 1"),
            (base().with_head_dim(Some(7)), "head dimension 7 must be even"),
            (base().with_n_kv_heads(3).with_n_heads(4), "n_kv_heads 3 must divide n_heads 4"),
            (base().with_rope_theta(f64::NAN), "rope_theta must be a finite number above 0, got NaN"),
            (base().with_pad_token(Some(64)), "pad_token 64 is outside the vocabulary 0..64"),
            (base().with_sliding_window(Some(8)).with_causal(false), "needs causal attention"),
        ] {
            let problem = config.validate().expect_err(named);
            assert!(problem.contains(named), "{problem}");
            let refused = std::panic::catch_unwind(|| config.init::<NdArray<f32>>(&Default::default())).err().expect("init refuses it");
            assert_eq!(refused.downcast_ref::<String>(), Some(&problem));
        }
    }

    /// Positions of other rows than the tokens' are refused naming both: fewer tokens' panicked
    /// deep in RoPE's narrow, and one row's positions for two rows gave two rows' logits of
    /// one row's tokens.
    #[test]
    fn positions_of_other_rows_than_the_tokens_are_refused() {
        use burn::tensor::{Int, Tensor};
        use burn_ulysses::data::ShardPositions;
        let model = DecoderConfig::new(64).with_d_model(16).with_n_heads(2).with_n_kv_heads(2).with_ffn_hidden(32).init::<NdArray<f32>>(&Default::default());
        let tokens = Tensor::<NdArray<f32>, 2, Int>::from_data([[1, 2, 3, 4]], &Default::default());
        for (positions, named) in [(ShardPositions::consecutive(1, 3), "positions of 1 rows of 3 tokens"), (ShardPositions::consecutive(2, 4), "positions of 2 rows of 4 tokens")] {
            let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| model.forward(tokens.clone(), &positions))).err().expect("positions of other rows");
            let message = refused.downcast_ref::<String>().cloned().unwrap_or_default();
            assert!(message.contains(named) && message.contains("tokens of [1, 4]"), "{message}");
        }
        assert_eq!(model.forward(tokens, &ShardPositions::consecutive(1, 4)).dims(), [1, 4, 64]);
    }

    /// Grouped kv heads left grouped (`repeat_kv: false`, as the trainer runs) on a backend
    /// that is not `UlyssesBackend` give the logits of kv heads expanded in the model, with a
    /// sliding window too: burn's attention failed deep in a matmul of 4 heads by 2.
    #[test]
    fn grouped_kv_heads_left_grouped_on_a_plain_backend_match_expanded_ones() {
        use burn::tensor::{Int, Tensor};
        use burn_ulysses::data::ShardPositions;
        let tokens = Tensor::<NdArray<f32>, 2, Int>::from_data([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]], &Default::default());
        let positions = ShardPositions::consecutive(2, 6);
        for window in [None, Some(3)] {
            let config = DecoderConfig::new(64).with_d_model(16).with_n_heads(4).with_n_kv_heads(2).with_ffn_hidden(32).with_sliding_window(window);
            let expanded = config.with_repeat_kv(true).init::<NdArray<f32>>(&Default::default());
            // Forward first: a clone of parameters not yet initialised draws its own.
            let want = expanded.forward(tokens.clone(), &positions);
            let got = expanded.with_repeat_kv(false).forward(tokens.clone(), &positions);
            let (want, got) = (want.into_data().to_vec::<f32>().unwrap(), got.into_data().to_vec::<f32>().unwrap());
            let worst = want.iter().zip(&got).map(|(w, g)| (w - g).abs()).fold(0f32, f32::max);
            assert!(want.iter().chain(&got).all(|x| x.is_finite()) && worst <= 1e-6, "window {window:?}: worst difference {worst}");
        }
    }
}

