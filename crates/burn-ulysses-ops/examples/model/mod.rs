//! A small Llama written plainly for burn 0.22.1 (no backend type parameter): RMSNorm, rotary
//! positions, grouped-query attention, a SwiGLU MLP. The one line that makes it sequence
//! parallel is the `use` of `attention`; the other is that RoPE takes each token's position
//! (a rank holds tokens from the middle of the sequence).

use burn::{
    module::{Module, ModuleMapper, Param},
    nn::{Embedding, EmbeddingConfig, Linear, LinearConfig, RmsNorm, RmsNormConfig},
    tensor::{Device, Int, Tensor, TensorData, activation::silu, ops::AttentionModuleOptions},
};
// was: use burn::tensor::module::attention;
use burn_ulysses_ops::attention;

mod device;
mod values;
pub use device::plain_device;
pub use values::uniform;

#[derive(Debug, Clone, Copy)]
pub struct TinyLlamaConfig {
    pub vocab: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub layers: usize,
    pub intermediate: usize,
    pub rope_theta: f64,
}

#[derive(Module, Debug)]
pub struct Block {
    attention_norm: RmsNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    mlp_norm: RmsNorm,
    gate: Linear,
    up: Linear,
    down: Linear,
}

#[derive(Module, Debug)]
pub struct TinyLlama {
    embed: Embedding,
    blocks: Vec<Block>,
    norm: RmsNorm,
    head: Linear,
}

impl TinyLlamaConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    pub fn init(&self, device: &Device) -> TinyLlama {
        let linear = |input, output| LinearConfig::new(input, output).with_bias(false).init(device);
        let norm = || RmsNormConfig::new(self.hidden).init(device);
        let kv = self.kv_heads * self.head_dim();
        let block = || Block {
            attention_norm: norm(),
            q: linear(self.hidden, self.hidden),
            k: linear(self.hidden, kv),
            v: linear(self.hidden, kv),
            o: linear(self.hidden, self.hidden),
            mlp_norm: norm(),
            gate: linear(self.hidden, self.intermediate),
            up: linear(self.hidden, self.intermediate),
            down: linear(self.intermediate, self.hidden),
        };
        TinyLlama {
            embed: EmbeddingConfig::new(self.vocab, self.hidden).init(device),
            blocks: (0..self.layers).map(|_| block()).collect(),
            norm: norm(),
            head: linear(self.hidden, self.vocab),
        }
    }
}

/// `config.init(device)` with every weight drawn from `seed` in a fixed order: the same model
/// on every rank thread, each built by the thread itself (burn 0.22 merges the autodiff graphs
/// of tensors that share a node, and a device's random generator is shared by threads).
pub fn init_seeded(config: &TinyLlamaConfig, device: &Device, seed: u64) -> TinyLlama {
    config.init(device).map(&mut Seeded { stream: seed << 16, device: device.clone() })
}

struct Seeded {
    stream: u64,
    device: Device,
}

impl ModuleMapper for Seeded {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let dims = param.val().dims();
        self.stream += 1;
        // Norm weights start at one, as Llama's; the others uniform in [-0.3, 0.3).
        let values = if D == 1 { vec![1.0; dims.iter().product()] } else { uniform(dims.iter().product(), self.stream).into_iter().map(|v| v * 0.3).collect() };
        Param::from_tensor(Tensor::from_data(TensorData::new(values, dims), &self.device))
    }
}

impl TinyLlama {
    /// Logits `[batch, seq, vocab]` of `tokens` `[batch, seq]` at `positions` (row-major, one
    /// per token: a shard's global positions).
    pub fn forward(&self, config: &TinyLlamaConfig, tokens: Tensor<2, Int>, positions: &[u64]) -> Tensor<3> {
        let [batch, seq] = tokens.dims();
        let device = tokens.device();
        let rope = Rope::new(config, batch, seq, positions, &device);
        let mut x = self.embed.forward(tokens);
        for block in &self.blocks {
            x = block.forward(config, x, &rope);
        }
        self.head.forward(self.norm.forward(x))
    }
}

impl Block {
    fn forward(&self, config: &TinyLlamaConfig, x: Tensor<3>, rope: &Rope) -> Tensor<3> {
        let [batch, seq, hidden] = x.dims();
        let head_dim = config.head_dim();
        let heads = |linear: &Linear, count: usize, h: &Tensor<3>| linear.forward(h.clone()).reshape([batch, seq, count, head_dim]).swap_dims(1, 2);
        let h = self.attention_norm.forward(x.clone());
        let q = rope.apply(heads(&self.q, config.heads, &h));
        let k = rope.apply(heads(&self.k, config.kv_heads, &h));
        let v = heads(&self.v, config.kv_heads, &h);
        let options = AttentionModuleOptions { is_causal: true, ..Default::default() };
        let attended = attention(q, k, v, None, None, options).swap_dims(1, 2).reshape([batch, seq, hidden]);
        let x = x + self.o.forward(attended);
        let h = self.mlp_norm.forward(x.clone());
        x.clone() + self.down.forward(silu(self.gate.forward(h.clone())) * self.up.forward(h))
    }
}

/// Rotary position embedding (rotate-half) at the given positions: `[batch, 1, seq, head_dim]`
/// cosines and sines.
struct Rope {
    cos: Tensor<4>,
    sin: Tensor<4>,
}

impl Rope {
    fn new(config: &TinyLlamaConfig, batch: usize, seq: usize, positions: &[u64], device: &Device) -> Self {
        let half = config.head_dim() / 2;
        let angle = |position: u64, i: usize| position as f64 / config.rope_theta.powf(2.0 * (i % half) as f64 / config.head_dim() as f64);
        let table = |f: fn(f64) -> f64| {
            let values: Vec<f32> = positions.iter().flat_map(|&p| (0..2 * half).map(move |i| f(angle(p, i)) as f32)).collect();
            Tensor::<4>::from_data(TensorData::new(values, [batch, 1, seq, 2 * half]), device)
        };
        Self { cos: table(f64::cos), sin: table(f64::sin) }
    }

    fn apply(&self, x: Tensor<4>) -> Tensor<4> {
        let half = x.dims()[3] / 2;
        let (first, second) = (x.clone().narrow(3, 0, half), x.clone().narrow(3, half, half));
        let rotated = Tensor::cat(vec![second.neg(), first], 3);
        x * self.cos.clone() + rotated * self.sin.clone()
    }
}
