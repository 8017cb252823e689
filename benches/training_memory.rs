//! Device memory of one training step (forward, loss, backward) of the Llama example against
//! the sequence length, on a CubeCL device: wgpu (on the CPU through lavapipe) by default,
//! CUDA with `--features cuda`. Attention runs the flash kernels (`UlyssesBackend` without a
//! group); f32, or with `--precision bf16` the layers in bf16 (f16 where the device has no
//! bf16, as lavapipe) with f32 parameters.
//!
//! cargo bench --bench training_memory -- [--seqs 512,1024,2048,4096] [--shape small|llama-8b]
//!     [--layers N] [--documents LEN] [--longest-under BYTES --max-seq S]
//!     [--checkpoint-layers [--offload-to-host] [--tile-tokens N]] [--precision f32|bf16]
//!     [--ffn N] [--vocab N] [--pieces]
//!
//! Per S (ascending), one step at batch 1, printing:
//! - `activations`: bytes in use once the forward and the loss are done, less the parameters
//!   (what the backward keeps alive: the dominant term at long context);
//! - `peak sampled`: the largest of that and the bytes in use right after the backward with
//!   every gradient alive (CubeCL reports no true peak, so this is sampled at the two points
//!   where a step's memory is highest);
//! - `reserved`: the allocator's reservation after the step (pools grow and never shrink in a
//!   run, so it is a high-water mark over every S so far);
//! - the ratio of `peak sampled` to the previous S's, against the ratio of the lengths
//!   (linear growth: equal ratios).
//!
//! `--pieces` (with checkpointing) also prints the bytes held before each piece's backward:
//! the head, then per layer its after-core tiles, its attention core and its before-core
//! tiles (`burn_ulysses::train::Piece`), then the embedding.
//!
//! `--documents LEN` packs documents of `LEN` tokens (attention within each, RoPE positions
//! restarting). `--longest-under BYTES` bisects (in multiples of 256 tokens, up to
//! `--max-seq`) the longest S whose sampled peak fits in `BYTES`: on a GPU, the longest
//! sequence per device for a model shape (`--shape llama-8b --layers N`).
//!
//! lavapipe stops kernels past about 4 096 tokens (Mesa's loop limiter), so on the CPU keep S
//! at or below that.

use burn::module::Module;
use burn_ulysses::{
    UlyssesBackend,
    data::SequenceSharder,
    precision::Precision,
    train::{LayerCheckpointing, ShardLengths, checkpointed_backward, lm_loss_sum},
};
use ulysses_llama::LlamaConfig;
use ulysses_suite::HeldPerPiece;

#[cfg(feature = "cuda")]
type Runtime = cubecl::cuda::CudaRuntime;
#[cfg(not(feature = "cuda"))]
type Runtime = cubecl::wgpu::WgpuRuntime;
type Device = <Runtime as cubecl::Runtime>::Device;
type Train = UlyssesBackend<burn_autodiff::Autodiff<burn_cubecl::CubeBackend<Runtime, f32, i32, u32>>>;

struct Args {
    seqs: Vec<usize>,
    shape: String,
    layers: Option<usize>,
    /// The MLP's hidden width, instead of the shape's.
    ffn: Option<usize>,
    /// The vocabulary size, instead of the shape's (lavapipe cannot hold Llama-3's 128K
    /// vocabulary's embedding in one buffer).
    vocab: Option<usize>,
    precision: Precision,
    documents: Option<usize>,
    longest_under: Option<u64>,
    max_seq: usize,
    /// `None`: the plain backward; else whole-layer checkpointing, offloaded or not, the
    /// token-wise parts tiled or not.
    checkpointing: Option<LayerCheckpointing>,
    /// Print what is held before each piece's backward, not only the most.
    pieces: bool,
}

fn args() -> Args {
    let argv: Vec<String> = std::env::args().collect();
    let value = |name: &str| argv.iter().position(|a| a == name).and_then(|i| argv.get(i + 1)).cloned();
    let number = |name: &str| value(name).map(|v| v.parse::<usize>().unwrap_or_else(|_| panic!("{name} takes a number, got {v}")));
    let flag = |name: &str| argv.iter().any(|a| a == name);
    Args {
        seqs: value("--seqs").map_or(vec![512, 1024, 2048, 4096], |list| list.split(',').map(|s| s.parse().expect("--seqs takes numbers")).collect()),
        shape: value("--shape").unwrap_or_else(|| "small".into()),
        layers: number("--layers"),
        ffn: number("--ffn"),
        vocab: number("--vocab"),
        pieces: flag("--pieces"),
        precision: value("--precision").map_or(Precision::F32, |v| v.parse().unwrap_or_else(|e| panic!("--precision: {e}"))),
        documents: number("--documents"),
        longest_under: number("--longest-under").map(|b| b as u64),
        max_seq: number("--max-seq").unwrap_or(4096),
        checkpointing: {
            let tile_tokens = number("--tile-tokens");
            let checkpointing = flag("--checkpoint-layers").then(|| LayerCheckpointing::new().with_offload_to_host(flag("--offload-to-host")).with_tile_tokens(tile_tokens));
            if checkpointing.is_none() && (tile_tokens.is_some() || flag("--offload-to-host")) {
                panic!("--offload-to-host and --tile-tokens work inside --checkpoint-layers: add it");
            }
            if let Some(checkpointing) = &checkpointing {
                checkpointing.check().unwrap_or_else(|e| panic!("{e}"));
            }
            checkpointing
        },
    }
}

/// The model shapes the bench knows: the example's, and Llama-3.1-8B's (without tied
/// embeddings), with as many layers as asked for.
fn model(args: &Args) -> LlamaConfig {
    let config = match args.shape.as_str() {
        "small" => LlamaConfig::new(256),
        "llama-8b" => LlamaConfig::new(128_256).with_d_model(4096).with_n_heads(32).with_n_kv_heads(8).with_ffn_hidden(14_336).with_rope_theta(500_000.0).with_n_layers(32),
        other => panic!("--shape takes small or llama-8b, got {other}"),
    };
    let config = config.with_repeat_kv(false);
    let config = match args.ffn {
        Some(ffn) => config.with_ffn_hidden(ffn),
        None => config,
    };
    let config = match args.vocab {
        Some(vocab) => LlamaConfig { vocab_size: vocab, ..config },
        None => config,
    };
    match args.layers {
        Some(layers) => config.with_n_layers(layers),
        None => config,
    }
}

fn in_use(device: &Device) -> u64 {
    ulysses_kernels::testing::bytes_in_use::<Runtime>(device)
}

fn reserved(device: &Device) -> u64 {
    <Runtime as cubecl::Runtime>::client(device).memory_usage().expect("memory usage").bytes_reserved
}

/// Bytes of one step at `seq` tokens: (activations, sampled peak), both above the parameters.
/// Activations: what the plain step holds after its forward; with checkpointing, the most
/// held at any piece's backward (its graph and every kept input).
fn step(config: &LlamaConfig, seq: usize, args: &Args, device: &Device) -> (u64, u64) {
    let (documents, checkpointing) = (args.documents, args.checkpointing.as_ref());
    let dtype = args.precision.compute_dtype::<Train>(device).unwrap_or_else(|e| panic!("{e}"));
    let model = config.init::<Train>(device).with_compute_dtype(dtype);
    let vocab = config.vocab_size as i64;
    let tokens: Vec<i64> = (0..seq as i64).map(|t| (t * 7919 + 13) % vocab).collect();
    let lengths = documents.map(|len| vec![(0..seq).step_by(len).map(|start| len.min(seq - start)).collect::<Vec<_>>()]);
    let shard = SequenceSharder::new(1).shard_documents(&[tokens], lengths.as_deref(), 0);
    let base = in_use(device);
    if let Some(checkpointing) = checkpointing {
        let tiles = checkpointing.tiles(ShardLengths { shortest: seq, longest: seq }).expect("checked in args");
        let (tokens, labels) = (shard.tokens::<Train>(device), shard.labels::<Train>(device));
        let mut pieces = HeldPerPiece::default();
        let (_, grads) = checkpointed_backward(&model, tokens, labels, &shard.positions, 1.0, -100, checkpointing, tiles, |piece| {
            pieces.record(piece, in_use(device) - base)
        })
        .expect("the checkpointed step");
        if args.pieces {
            for (piece, held) in &pieces.0 {
                println!("    S {seq}: {held:>14} bytes held before the backward of {piece:?}");
            }
        }
        let most = pieces.most();
        let with_gradients = in_use(device) - base;
        drop(grads);
        drop(model);
        return (most, most.max(with_gradients));
    }
    let output = model.lm_output(shard.tokens::<Train>(device), &shard.positions);
    let loss = lm_loss_sum(output, shard.labels::<Train>(device), -100);
    let activations = in_use(device) - base;
    let grads = loss.backward();
    let with_gradients = in_use(device) - base;
    drop(grads);
    drop(model);
    (activations, activations.max(with_gradients))
}

fn main() {
    let args = args();
    let config = model(&args);
    let device = Device::default();
    let parameters: usize = config.init::<Train>(&device).num_params();
    println!(
        "one training step, batch 1, {:?} compute, flash attention ({}): {} layers, d_model {}, {} q / {} kv heads, ffn {}, vocab {}: {:.1} M parameters{}",
        args.precision.compute_dtype::<Train>(&device).unwrap_or_else(|e| panic!("{e}")),
        std::any::type_name::<Runtime>(),
        config.n_layers,
        config.d_model,
        config.n_heads,
        config.n_kv_heads,
        config.ffn_hidden,
        config.vocab_size,
        parameters as f64 / 1e6,
        args.documents.map_or(String::new(), |len| format!(", packed documents of {len} tokens"))
            + &args.checkpointing.as_ref().map_or(String::new(), |c| {
                let tiling = c.tile_tokens.map_or(String::new(), |tokens| format!(", token-wise parts in tiles of {tokens} tokens"));
                format!(", layer checkpointing (inputs on the {}{tiling})", if c.offload_to_host { "host" } else { "device" })
            })
    );

    if let Some(budget) = args.longest_under {
        // Largest multiple of 256 in [256, max_seq] whose step fits the budget.
        let fits = |seq: usize| {
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| step(&config, seq, &args, &device)));
            let fits = matches!(outcome, Ok((_, peak)) if peak <= budget);
            println!("  S {seq:>8}: {}", match outcome {
                Ok((_, peak)) => format!("peak sampled {peak} bytes: {}", if fits { "fits" } else { "over the budget" }),
                Err(_) => "failed (out of memory)".into(),
            });
            fits
        };
        let (mut low, mut high) = (0usize, args.max_seq / 256 + 1);
        while high - low > 1 {
            let middle = (low + high) / 2;
            if fits(middle * 256) { low = middle } else { high = middle }
        }
        println!("longest sequence under {budget} bytes: {} tokens", low * 256);
        return;
    }

    println!("{:>8} | {:>14} {:>14} {:>14} | {:>14}", "S", "activations", "peak sampled", "reserved", "peak ratio");
    let mut previous: Option<(usize, u64)> = None;
    for &seq in &args.seqs {
        let (activations, peak) = step(&config, seq, &args, &device);
        let ratio = previous.map_or(String::new(), |(s, p)| format!("x{:.2} for x{:.1}", peak as f64 / p as f64, seq as f64 / s as f64));
        println!("{seq:>8} | {activations:>14} {peak:>14} {:>14} | {ratio:>14}", reserved(&device));
        previous = Some((seq, peak));
    }
}
