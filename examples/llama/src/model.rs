//! A Llama-shaped decoder: RMSNorm, RoPE at global positions, grouped-query causal attention
//! through `burn::tensor::module::attention`, SwiGLU feed-forward.
//!
//! Nothing here knows about sequence parallelism. Under `UlyssesBackend` each rank runs the
//! model on its shard of the sequence; the caller supplies the shard's position ids
//! ([`ShardPositions`]), global so that RoPE sees where each token sits. When the rows pack
//! several documents, positions restart at each one and attention goes through
//! `attention_in_documents`, which keeps every token inside its document.
//!
//! Mixed precision ([`Llama::with_compute_dtype`]): the hidden states are cast to the compute
//! dtype after the embedding and every op follows them (`burn_ulysses::precision`; norm
//! statistics in f32). The head and the loss compute in f32 from the last hidden states, a
//! chunk of rows at a time (`lm_output`), or all at once (`forward`, `hidden`).

use std::ops::Range;

use burn::{
    config::Config,
    module::Module,
    nn::{Embedding, EmbeddingConfig, Linear, LinearConfig, RmsNorm, RmsNormConfig},
    tensor::{
        FloatDType, Int, Tensor,
        activation::silu,
        backend::Backend,
        module::attention,
        ops::AttentionModuleOptions,
    },
};

use burn_ulysses::{
    attention::{attention_in_documents, repeat_kv_heads},
    data::ShardPositions,
    precision::{linear, rms_norm},
    train::{LayeredLm, LmOutput, OutputHead},
    visibility::PositionIds,
};

use crate::rope::RopeTables;

#[derive(Config, Debug)]
pub struct LlamaConfig {
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
    #[config(default = 10000.0)]
    pub rope_theta: f64,
    #[config(default = 1e-5)]
    pub norm_eps: f64,
    /// Expand kv heads to the q head count before calling attention. Burn's own attention
    /// needs equal head counts; `UlyssesBackend` accepts grouped kv heads natively and then
    /// exchanges `n_heads / n_kv_heads` times fewer kv bytes. It changes no parameter.
    #[config(default = true)]
    pub repeat_kv: bool,
    /// Causal (decoder) attention.
    #[config(default = true)]
    pub causal: bool,
}

impl LlamaConfig {
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads
    }

    fn check(&self) {
        assert!(
            self.d_model % self.n_heads == 0,
            "d_model {} must be divisible by n_heads {}",
            self.d_model,
            self.n_heads
        );
        assert!(
            self.n_kv_heads > 0 && self.n_heads % self.n_kv_heads == 0,
            "n_kv_heads {} must divide n_heads {}",
            self.n_kv_heads,
            self.n_heads
        );
    }

    pub fn init<B: Backend>(&self, device: &B::Device) -> Llama<B> {
        self.check();
        Llama {
            embedding: EmbeddingConfig::new(self.vocab_size, self.d_model).init(device),
            blocks: (0..self.n_layers).map(|_| self.init_block(device)).collect(),
            norm: RmsNormConfig::new(self.d_model).with_epsilon(self.norm_eps).init(device),
            lm_head: LinearConfig::new(self.d_model, self.vocab_size).with_bias(false).init(device),
            head_dim: self.head_dim(),
            rope_theta: self.rope_theta,
            compute_dtype: FloatDType::F32,
        }
    }

    pub fn init_block<B: Backend>(&self, device: &B::Device) -> Block<B> {
        self.check();
        let linear = |d_in, d_out| LinearConfig::new(d_in, d_out).with_bias(false).init(device);
        let head_dim = self.head_dim();
        Block {
            attention_norm: RmsNormConfig::new(self.d_model).with_epsilon(self.norm_eps).init(device),
            attention: Attention {
                wq: linear(self.d_model, self.n_heads * head_dim),
                wk: linear(self.d_model, self.n_kv_heads * head_dim),
                wv: linear(self.d_model, self.n_kv_heads * head_dim),
                wo: linear(self.n_heads * head_dim, self.d_model),
                n_heads: self.n_heads,
                n_kv_heads: self.n_kv_heads,
                head_dim,
                repeat_kv: self.repeat_kv,
                causal: self.causal,
            },
            ffn_norm: RmsNormConfig::new(self.d_model).with_epsilon(self.norm_eps).init(device),
            feed_forward: FeedForward {
                gate: linear(self.d_model, self.ffn_hidden),
                up: linear(self.d_model, self.ffn_hidden),
                down: linear(self.ffn_hidden, self.d_model),
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
impl<B: Backend> LayeredLm<B> for Llama<B> {
    type Context = LlamaContext<B>;

    fn context(&self, positions: &ShardPositions, device: &B::Device) -> LlamaContext<B> {
        let rope = RopeTables::at(&positions.ids, self.head_dim, self.rope_theta, device).in_dtype(self.compute_dtype);
        LlamaContext { rope, documents: positions.packed.then(|| positions.ids.clone()) }
    }

    fn embed(&self, tokens: Tensor<B, 2, Int>, _context: &LlamaContext<B>) -> Tensor<B, 3> {
        self.embedding.forward(tokens).cast(self.compute_dtype)
    }

    fn layer_count(&self) -> usize {
        self.blocks.len()
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
        let head = OutputHead { weight: self.lm_head.weight.val(), bias: self.lm_head.bias.as_ref().map(|b| b.val()) };
        LmOutput::Hidden { hidden: self.final_norm(hidden), head }
    }
}

#[derive(Module, Debug)]
pub struct Llama<B: Backend> {
    pub embedding: Embedding<B>,
    pub blocks: Vec<Block<B>>,
    pub norm: RmsNorm<B>,
    pub lm_head: Linear<B>,
    head_dim: usize,
    rope_theta: f64,
    /// What the layers compute in (the parameters stay f32); not part of the record.
    #[module(skip)]
    compute_dtype: FloatDType,
}

impl<B: Backend> Llama<B> {
    /// `tokens: [batch, seq]` at `positions` → logits `[batch, seq, vocab]`.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>, positions: &ShardPositions) -> Tensor<B, 3> {
        self.lm_head.forward(self.hidden(tokens, positions))
    }

    /// The last hidden states and the output head, from which the loss is computed a chunk of
    /// rows at a time (never holding all `tokens × vocab` logits).
    pub fn lm_output(&self, tokens: Tensor<B, 2, Int>, positions: &ShardPositions) -> LmOutput<B> {
        let context = self.context(positions, &tokens.device());
        self.head(self.layers(self.embed(tokens, &context), &context))
    }

    /// The normalised last hidden states `[batch, seq, d_model]` that `lm_head` projects to
    /// logits, in f32 like the head.
    pub fn hidden(&self, tokens: Tensor<B, 2, Int>, positions: &ShardPositions) -> Tensor<B, 3> {
        let context = self.context(positions, &tokens.device());
        self.final_norm(self.layers(self.embed(tokens, &context), &context)).cast(FloatDType::F32)
    }

    /// The last norm, in the compute dtype (the chunked loss computes each chunk's logits in
    /// the head's f32).
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

    pub fn vocab_size(&self) -> usize {
        self.lm_head.weight.dims()[1]
    }

    /// Whether every attention layer is causal.
    pub fn is_causal(&self) -> bool {
        self.blocks.iter().all(|block| block.attention.causal)
    }

    /// Switches every attention layer between grouped kv heads and kv heads expanded to the
    /// q head count (see [`LlamaConfig::repeat_kv`]).
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
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    repeat_kv: bool,
    causal: bool,
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
        let heads = |t: Tensor<B, 3>, n| t.reshape([b, s, n, self.head_dim]).swap_dims(1, 2);
        let q = rope.apply(heads(linear(&self.wq, x.clone()), self.n_heads));
        let k = rope.apply(heads(linear(&self.wk, x.clone()), self.n_kv_heads));
        let v = heads(linear(&self.wv, x), self.n_kv_heads);
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
        match documents {
            Some(positions) => attention_in_documents(q, k, v, positions, options),
            None => attention(q, k, v, None, None, options),
        }
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
