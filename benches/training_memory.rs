//! Device memory of one training step (forward, loss, backward) of the Llama example against
//! the sequence length, on a CubeCL device: wgpu (on the CPU through lavapipe) by default,
//! CUDA with `--features cuda`. Attention runs the flash kernels (`UlyssesBackend` without a
//! group); f32, or with `--precision bf16` the layers in bf16 (f16 where the device has no
//! bf16, as lavapipe) with f32 parameters.
//!
//! cargo bench --bench training_memory -- [--seqs 512,1024,2048,4096] [--shape small|llama-8b]
//!     [--layers N] [--documents LEN] [--longest-under BYTES --max-seq S]
//!     [--checkpoint-layers [--offload-to-host] [--tile-tokens N]] [--precision f32|bf16]
//!     [--ffn N] [--vocab N] [--pieces] [--min-seq S] [--step-tokens N] [--trial-timeout SECS]
//!     [--phases] [--trial-steps N] [--unprobed-steps] [--memory-cleanup]
//!
//! Per S (ascending), one step at batch 1, printing:
//! - `parameters`: bytes in use before the step, every parameter created (burn creates one on
//!   its first use) and the rotary tables;
//! - `activations`: above `parameters`, bytes in use once the forward and the loss are done
//!   (what the backward keeps alive: the dominant term at long context); with checkpointing,
//!   the most held just before any piece's backward;
//! - `peak sampled`: above `parameters`, the largest of that and the bytes in use right after
//!   the backward with every gradient alive (CubeCL reports no true peak, so this is sampled
//!   at the points where a step's memory is highest);
//! - `reserved`: the allocator's reservation after the step (pools grow and never shrink in a
//!   run, so it is a high-water mark over every S so far), and `/ used`, it over the most the
//!   step used (`parameters` + `peak sampled`); `--memory-cleanup` gives the device back, before
//!   each piece's backward, every pool page no tensor holds (with checkpointing);
//! - the ratio of `peak sampled` to the previous S's, against the ratio of the lengths
//!   (linear growth: equal ratios).
//!
//! `--pieces` (with checkpointing) also prints the bytes held before each piece's backward:
//! the head, then per layer its after-core tiles, its attention core and its before-core
//! tiles (`ulysses_training::Piece`), then the embedding.
//!
//! `--phases` prints the wall time of a step's phases as they end (the device synchronised
//! first), the first step's kernel compilation included: the model built; without
//! checkpointing, the forward and loss, then the backward; with it, the time up to the first
//! tile of each piece's backward (the probe before it): up to the head's first tile is the
//! forward through every layer and that tile's loss; up to the first tile of the next piece is
//! the rest of the previous piece's tiles (forward and backward) and the next piece's
//! recomputation; then the end of the backward. `--trial-steps N` runs N steps in each trial's
//! child (the peak is the largest; `--trial-timeout` covers all of them): the second step's
//! phases are the step without compilation or autotuning. A trial's phase lines are printed
//! above its result, also when it timed out: where its time went. With checkpointing, the probe
//! before each piece's backward synchronises the device (it reads the bytes in use), which
//! stalls what overlaps it, the offload's copies among them; `--unprobed-steps` runs the steps
//! after a trial's first without it (no per-piece bytes, phases or cleanup), so their seconds
//! are the step's own as training runs it: compare offload on and off with those.
//!
//! `--documents LEN` packs documents of `LEN` tokens (attention within each, RoPE positions
//! restarting).
//!
//! `--longest-under BYTES` bisects the longest S whose step completes with its sampled peak,
//! parameters included, within `BYTES`: on a GPU, the longest sequence per device for a model
//! shape (`--shape llama-8b --layers N`). The lengths tried are `--min-seq` (default
//! `--step-tokens`) up to `--max-seq` in steps of `--step-tokens` (default 256). Each length
//! runs in a child process of this bench, so a step that runs out of memory fails alone:
//! CubeCL catches a failed allocation on its device thread and goes on with the buffer
//! unbound, which leaves that process's results untrustworthy (the child reports any panic,
//! on any thread, as a failed step). `--trial-timeout SECS` kills a child that runs longer.
//! The step's memory does not depend on which keys a query sees (no `S × S` buffer on the
//! flash path; the `training_memory_does_not_depend_on_the_mask` test checks it to the byte),
//! so with `--documents LEN` a trial measures the same bytes as one long document at a cost
//! linear in S: on a GPU, seconds a trial at a million tokens instead of many minutes.
//!
//! lavapipe stops kernels past about 4 096 tokens (Mesa's loop limiter), so on the CPU keep S
//! at or below that.

use std::{
    io::Read,
    process::{Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use burn::module::Module;
use burn_ulysses::{UlyssesBackend, data::{SequenceSharder, ShardTensors}, precision::Precision};
use ulysses_training::{LayerCheckpointing, checkpointed_backward, float_parameters, lm_loss_sum};
use ulysses_models::DecoderConfig;
use ulysses_suite::{HeldPerPiece, longest_fitting};

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
    min_seq: Option<usize>,
    max_seq: usize,
    step_tokens: usize,
    trial_timeout: Option<Duration>,
    /// Set in the child process of one `--longest-under` trial: run one step of this many
    /// tokens and print its figures as one `trial:` line.
    trial: Option<usize>,
    /// `None`: the plain backward; else whole-layer checkpointing, offloaded or not, the
    /// token-wise parts tiled or not.
    checkpointing: Option<LayerCheckpointing>,
    /// Print what is held before each piece's backward, not only the most.
    pieces: bool,
    /// Print each phase's wall time as it ends.
    phases: bool,
    /// Steps per trial child.
    trial_steps: usize,
    /// Run a trial's steps after the first without the per-piece probe (no device sync).
    unprobed_steps: bool,
    /// Before each piece's backward, give the device back every pool page no tensor holds
    /// (`ComputeClient::memory_cleanup`): CubeCL 0.10's CUDA runtime builds its pools with
    /// fixed options (`RuntimeOptions::default()` in its device service; cubecl.toml sets only
    /// persistent memory and logging), and a page of a large tensor stays reserved once freed.
    memory_cleanup: bool,
}

fn args() -> Args {
    let argv: Vec<String> = std::env::args().collect();
    let value = |name: &str| argv.iter().position(|a| a == name).and_then(|i| argv.get(i + 1)).cloned();
    let number = |name: &str| value(name).map(|v| v.parse::<usize>().unwrap_or_else(|_| panic!("{name} takes a number, got {v}")));
    let flag = |name: &str| argv.iter().any(|a| a == name);
    if flag("--unprobed-steps") && !(flag("--checkpoint-layers") && number("--trial-steps").is_some_and(|n| n >= 2)) {
        panic!("--unprobed-steps leaves out the per-piece probe of a trial's steps after the first, with checkpointing: add --checkpoint-layers and --trial-steps 2 or more");
    }
    Args {
        seqs: value("--seqs").map_or(vec![512, 1024, 2048, 4096], |list| list.split(',').map(|s| s.parse().expect("--seqs takes numbers")).collect()),
        shape: value("--shape").unwrap_or_else(|| "small".into()),
        layers: number("--layers"),
        ffn: number("--ffn"),
        vocab: number("--vocab"),
        pieces: flag("--pieces"),
        phases: flag("--phases"),
        trial_steps: number("--trial-steps").unwrap_or(1).max(1),
        unprobed_steps: flag("--unprobed-steps"),
        memory_cleanup: flag("--memory-cleanup"),
        precision: value("--precision").map_or(Precision::F32, |v| v.parse().unwrap_or_else(|e| panic!("--precision: {e}"))),
        documents: number("--documents"),
        longest_under: number("--longest-under").map(|b| b as u64),
        min_seq: number("--min-seq"),
        max_seq: number("--max-seq").unwrap_or(4096),
        step_tokens: number("--step-tokens").unwrap_or(256),
        trial_timeout: number("--trial-timeout").map(|seconds| Duration::from_secs(seconds as u64)),
        trial: number("--trial"),
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
fn model(args: &Args) -> DecoderConfig {
    let config = match args.shape.as_str() {
        "small" => DecoderConfig::new(256),
        "llama-8b" => DecoderConfig::new(128_256).with_d_model(4096).with_n_heads(32).with_n_kv_heads(8).with_ffn_hidden(14_336).with_rope_theta(500_000.0).with_n_layers(32),
        other => panic!("--shape takes small or llama-8b, got {other}"),
    };
    let config = config.with_repeat_kv(false);
    let config = match args.ffn {
        Some(ffn) => config.with_ffn_hidden(ffn),
        None => config,
    };
    let config = match args.vocab {
        Some(vocab) => DecoderConfig { vocab_size: vocab, ..config },
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

/// Device memory of one training step, in bytes.
struct StepMemory {
    /// In use once the model is built, before the step: the parameters (and rotary tables).
    parameters: u64,
    /// Above `parameters`: what the plain step holds after its forward; with checkpointing,
    /// the most held before any piece's backward (its graph and every kept input).
    activations: u64,
    /// Above `parameters`: the larger of `activations` and what is in use after the backward
    /// with every gradient alive.
    peak: u64,
    /// The forward and backward's wall seconds, from the tokens on the device to the gradients
    /// (the device synchronised): without the model's build, the process's start or the other
    /// steps of a trial, which a trial's whole seconds hold.
    seconds: f64,
}

/// The wall time of a step's phases, printed as each ends (`--phases`), one line each:
/// `phase: <seconds since the step began> (+<seconds of this phase>) <what ended>`. Callers
/// synchronise the device first (`in_use` does), so a phase holds its kernels' time.
struct Phases {
    enabled: bool,
    started: Instant,
    last: Instant,
}

impl Phases {
    fn new(enabled: bool) -> Self {
        let now = Instant::now();
        Phases { enabled, started: now, last: now }
    }

    fn ended(&mut self, what: std::fmt::Arguments) {
        let now = Instant::now();
        if self.enabled {
            let (total, phase) = ((now - self.started).as_secs_f64(), (now - self.last).as_secs_f64());
            println!("phase: {total:>8.1} s (+{phase:>7.1} s) {what}");
        }
        self.last = now;
    }
}

/// One step at `seq` tokens; with checkpointing and `probed`, the bytes held (the device
/// synchronised) before each piece's backward. Panics if the loss is not finite: a step that
/// computed garbage measured nothing.
fn step(config: &DecoderConfig, seq: usize, args: &Args, device: &Device, probed: bool) -> StepMemory {
    let (documents, checkpointing) = (args.documents, args.checkpointing.as_ref());
    let mut phases = Phases::new(args.phases);
    let dtype = args.precision.compute_dtype::<Train>(device).unwrap_or_else(|e| panic!("{e}"));
    let model = config.init::<Train>(device).with_compute_dtype(dtype);
    // burn creates a parameter's tensor on its first use: create them all now, so that the
    // bytes in use before the step count them and the figures above that do not.
    drop(float_parameters(&model));
    let vocab = config.vocab_size as i64;
    let tokens: Vec<i64> = (0..seq as i64).map(|t| (t * 7919 + 13) % vocab).collect();
    let lengths = documents.map(|len| vec![(0..seq).step_by(len).map(|start| len.min(seq - start)).collect::<Vec<_>>()]);
    let shard = SequenceSharder::new(1).shard_documents(&[tokens], lengths.as_deref(), 0);
    let base = in_use(device);
    phases.ended(format_args!("the model built, its parameters created, the tokens sharded"));
    let timed = Instant::now();
    let (loss, activations, with_gradients, seconds) = if let Some(checkpointing) = checkpointing {
        let tiles = checkpointing.tiles(seq).expect("checked in args");
        let (tokens, labels) = (shard.tokens::<Train>(device), shard.labels::<Train>(device));
        let mut pieces = HeldPerPiece::default();
        let (loss, grads) = checkpointed_backward(&model, tokens, labels, &shard.positions, 1.0, -100, checkpointing, tiles, |piece| {
            if !probed {
                return;
            }
            if args.memory_cleanup {
                <Runtime as cubecl::Runtime>::client(device).memory_cleanup();
            }
            let held = in_use(device) - base;
            // A piece's first tile ends a phase: see the module doc for what each one holds.
            match pieces.0.last() {
                None => phases.ended(format_args!("up to the first tile of {piece:?}: the forward through every layer, that tile's loss")),
                Some((last, _)) if *last != piece => phases.ended(format_args!("up to the first tile of {piece:?}: the rest of {last:?}, {piece:?}'s recomputation")),
                _ => {}
            }
            pieces.record(piece, held)
        })
        .expect("the checkpointed step");
        let with_gradients = in_use(device) - base;
        let seconds = timed.elapsed().as_secs_f64();
        if let Some((last, _)) = pieces.0.last() {
            phases.ended(format_args!("the end of the backward: the rest of {last:?}"));
        }
        if args.pieces {
            for (piece, held) in &pieces.0 {
                println!("    S {seq}: {held:>14} bytes held before the backward of {piece:?}");
            }
        }
        drop(grads);
        (loss.into_scalar() as f64, pieces.most(), with_gradients, seconds)
    } else {
        let output = model.lm_output(shard.tokens::<Train>(device), &shard.positions);
        let loss = lm_loss_sum(output, shard.labels::<Train>(device), -100);
        let activations = in_use(device) - base;
        phases.ended(format_args!("the forward and loss"));
        let value = loss.clone().into_scalar() as f64;
        let grads = loss.backward();
        let with_gradients = in_use(device) - base;
        let seconds = timed.elapsed().as_secs_f64();
        phases.ended(format_args!("the backward"));
        drop(grads);
        (value, activations, with_gradients, seconds)
    };
    assert!(loss.is_finite(), "S {seq}: the step's loss is {loss}");
    drop(model);
    StepMemory { parameters: base, activations, peak: activations.max(with_gradients), seconds }
}

/// The child process of one `--longest-under` trial: `--trial-steps` steps of `seq` tokens
/// (the peak the largest, the seconds all of them), then one line
/// `trial: <peak with parameters> <parameters> <reserved> <seconds> <each step's seconds>...`
/// (a step's own: [`StepMemory::seconds`]); exits with 1 when any
/// thread panicked meanwhile. CubeCL's device thread catches a panic of its own (a failed
/// allocation) and goes on, so only the panic hook sees it.
fn run_trial(config: &DecoderConfig, seq: usize, args: &Args) {
    let panicked = Arc::new(AtomicBool::new(false));
    let default_hook = std::panic::take_hook();
    let flag = panicked.clone();
    std::panic::set_hook(Box::new(move |info| {
        flag.store(true, Ordering::SeqCst);
        default_hook(info)
    }));
    let device = Device::default();
    let started = Instant::now();
    let mut memory = step(config, seq, args, &device, true);
    let mut steps = vec![memory.seconds];
    for step_number in 2..=args.trial_steps {
        let probed = !args.unprobed_steps;
        if args.phases {
            let probes = if probed { "" } else { ", no per-piece probe" };
            println!("phase: step {step_number} (kernels compiled, autotuning done{probes})");
        }
        let again = step(config, seq, args, &device, probed);
        memory.peak = memory.peak.max(again.peak);
        steps.push(again.seconds);
    }
    let seconds = started.elapsed().as_secs_f64();
    if panicked.load(Ordering::SeqCst) {
        eprintln!("a thread panicked during the step of {seq} tokens (above): its figures cannot be trusted");
        std::process::exit(1);
    }
    let steps: Vec<String> = steps.iter().map(|s| format!("{s:.3}")).collect();
    println!("trial: {} {} {} {seconds:.1} {}", memory.parameters + memory.peak, memory.parameters, reserved(&device), steps.join(" "));
}

/// What a trial's child process reported.
struct Trial {
    /// The sampled peak, parameters included.
    peak: u64,
    parameters: u64,
    reserved: u64,
    /// The child's seconds from its device's start to its report (model builds, every step).
    seconds: f64,
    /// Each step's own seconds ([`StepMemory::seconds`]): what a comparison of settings
    /// divides, where the whole trial's would pull a ratio toward 1.
    steps: Vec<f64>,
}

/// Why a trial gave no figures.
enum TrialFailure {
    /// Killed past `--trial-timeout`: whether the step fits is not known.
    TimedOut(String),
    /// The step failed (out of memory among others), with the first panic's message.
    Failed(String),
}

impl From<String> for TrialFailure {
    fn from(why: String) -> Self {
        TrialFailure::Failed(why)
    }
}

/// Runs one step of `seq` tokens in a child process of this bench (same arguments, plus
/// `--trial seq`), killed past `args.trial_timeout`.
fn trial(seq: usize, args: &Args) -> Result<Trial, TrialFailure> {
    let mut child = Command::new(std::env::current_exe().map_err(|e| format!("cannot find this bench's executable: {e}"))?)
        .args(std::env::args().skip(1))
        .args(["--trial", &seq.to_string()])
        .env("RUST_BACKTRACE", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start a trial process: {e}"))?;
    let (stdout, stderr) = (drain(child.stdout.take()), drain(child.stderr.take()));
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| format!("cannot wait for the trial process: {e}"))? {
            break Some(status);
        }
        if args.trial_timeout.is_some_and(|limit| started.elapsed() > limit) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let (stdout, stderr) = (stdout.join().unwrap_or_default(), stderr.join().unwrap_or_default());
    for phase in stdout.lines().filter(|line| line.starts_with("phase: ")) {
        println!("    S {seq:>8}: {phase}");
    }
    let Some(status) = status else {
        return Err(TrialFailure::TimedOut(format!("timed out after {:.0} s (--trial-timeout)", started.elapsed().as_secs_f64())));
    };
    let report = stdout.lines().find_map(|line| line.strip_prefix("trial: "));
    match (status.success(), report) {
        (true, Some(report)) => {
            let fields: Vec<&str> = report.split_whitespace().collect();
            let number = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).ok_or_else(|| format!("unreadable trial report {report:?}"));
            let steps = (4..fields.len()).map(number).collect::<Result<Vec<_>, _>>()?;
            if steps.is_empty() {
                return Err(TrialFailure::Failed(format!("the trial report {report:?} has no step's seconds")));
            }
            Ok(Trial { peak: number(0)? as u64, parameters: number(1)? as u64, reserved: number(2)? as u64, seconds: number(3)?, steps })
        }
        _ => {
            // CubeCL reports a device error where it surfaces, often later than its cause: the
            // child's error lines (a compiler's among them, buried in the kernel source it
            // prints) and its last words help find it.
            let lines: Vec<&str> = stderr.lines().collect();
            let errors = lines.iter().filter(|line| line.contains("error")).take(10);
            for line in errors.chain(&lines[lines.len().saturating_sub(20)..]) {
                println!("    S {seq:>8}: stderr: {line}");
            }
            Err(TrialFailure::Failed(format!("{status}: {}", first_panic(&stderr))))
        }
    }
}

/// Reads a child's pipe to its end on a thread of its own, so a child that writes much never
/// blocks on a full pipe while its parent waits for it.
fn drain<R: Read + Send + 'static>(pipe: Option<R>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_string(&mut text);
        }
        text
    })
}

/// The first panic's message in a child's stderr (the cause: later panics are its echoes on
/// other threads), and how many there were; else stderr's last lines.
fn first_panic(stderr: &str) -> String {
    let lines: Vec<&str> = stderr.lines().map(str::trim).filter(|line| !line.is_empty()).collect();
    let panics: Vec<usize> = lines.iter().enumerate().filter(|(_, line)| line.contains(" panicked at ")).map(|(i, _)| i).collect();
    let text = match panics.first() {
        Some(&first) => {
            let message = lines[first + 1..].iter().take_while(|line| !line.contains(" panicked at ") && !line.starts_with("stack backtrace") && !line.starts_with("note:"));
            format!("{} ({} panics in all)", message.take(3).copied().collect::<Vec<_>>().join(" "), panics.len())
        }
        None => lines[lines.len().saturating_sub(3)..].join(" | "),
    };
    text.chars().take(400).collect()
}

/// The model, dtype and features of a run, for the first line it prints.
fn describe(config: &DecoderConfig, args: &Args) -> String {
    format!(
        "{} layers, d_model {}, {} q / {} kv heads, ffn {}, vocab {}, {:?} precision{}{}",
        config.n_layers,
        config.d_model,
        config.n_heads,
        config.n_kv_heads,
        config.ffn_hidden,
        config.vocab_size,
        args.precision,
        args.documents.map_or(String::new(), |len| format!(", packed documents of {len} tokens")),
        args.checkpointing.as_ref().map_or(String::new(), |c| {
            let tiling = c.tile_tokens.map_or(String::new(), |tokens| format!(", token-wise parts in tiles of {tokens} tokens"));
            format!(", layer checkpointing (inputs on the {}{tiling})", if c.offload_to_host { "host" } else { "device" })
        })
    )
}

fn main() {
    let args = args();
    let config = model(&args);
    // CubeCL would fail on its device thread, and each trial child with it, far from the cause.
    #[cfg(feature = "cuda")]
    if let Err(error) = ulysses_nccl::check_cuda_device(0).map_err(|e| e.to_string()).and_then(|()| ulysses_nccl::memory_pools::configure_from_env().map(drop)) {
        eprintln!("error: the CUDA device cannot start as asked: {error}");
        std::process::exit(2);
    }
    if let Some(seq) = args.trial {
        return run_trial(&config, seq, &args);
    }

    if let Some(budget) = args.longest_under {
        // No device in this process: the trials' children have it to themselves.
        let step_tokens = args.step_tokens;
        let shortest = args.min_seq.unwrap_or(step_tokens);
        println!(
            "longest sequence whose training step (batch 1, flash attention, {}) fits {budget} bytes: {}; trying {shortest}..={} tokens in steps of {step_tokens}, one child process each",
            std::any::type_name::<Runtime>(),
            describe(&config, &args),
            args.max_seq,
        );
        let timed_out = std::cell::RefCell::new(Vec::new());
        let fits = |seq: usize| match trial(seq, &args) {
            Ok(trial) => {
                let fits = trial.peak <= budget;
                let steps: Vec<String> = trial.steps.iter().map(|s| format!("{s:.2} s")).collect();
                println!(
                    "  S {seq:>8}: peak sampled {} bytes ({} of parameters), reserved {}, {:.1} s in all, the steps' own {}: {}",
                    trial.peak,
                    trial.parameters,
                    trial.reserved,
                    trial.seconds,
                    steps.join(", "),
                    if fits { "fits" } else { "over the budget" }
                );
                fits
            }
            Err(TrialFailure::Failed(why)) => {
                println!("  S {seq:>8}: failed: {why}");
                false
            }
            Err(TrialFailure::TimedOut(why)) => {
                // Searched as if it did not fit, but said: the answer is then a lower bound.
                println!("  S {seq:>8}: {why}: not known whether it fits");
                timed_out.borrow_mut().push(seq);
                false
            }
        };
        let longest = longest_fitting(shortest, args.max_seq, step_tokens, fits);
        let caveat = match timed_out.borrow().as_slice() {
            [] => String::new(),
            lengths => format!(" (a lower bound: the trials at {lengths:?} tokens timed out; raise --trial-timeout)"),
        };
        match longest {
            Some(longest) => println!("longest sequence under {budget} bytes: {longest} tokens{caveat}"),
            None => println!("longest sequence under {budget} bytes: none (not even {shortest} tokens){caveat}"),
        }
        return;
    }

    let device = Device::default();
    let parameters: usize = config.init::<Train>(&device).num_params();
    println!(
        "one training step, batch 1, {:?} compute, flash attention ({}): {}: {:.1} M parameters",
        args.precision.compute_dtype::<Train>(&device).unwrap_or_else(|e| panic!("{e}")),
        std::any::type_name::<Runtime>(),
        describe(&config, &args),
        parameters as f64 / 1e6,
    );
    println!("{:>8} | {:>14} | {:>14} {:>14} {:>14} {:>9} | {:>14}", "S", "parameters", "activations", "peak sampled", "reserved", "/ used", "peak ratio");
    let mut previous: Option<(usize, u64)> = None;
    for &seq in &args.seqs {
        let memory = step(&config, seq, &args, &device, true);
        let peak = memory.peak;
        let ratio = previous.map_or(String::new(), |(s, p)| format!("x{:.2} for x{:.1}", peak as f64 / p as f64, seq as f64 / s as f64));
        let reserved = reserved(&device);
        // What the pools hold against the most the step used (parameters and peak).
        let over_used = reserved as f64 / (memory.parameters + peak).max(1) as f64;
        println!("{seq:>8} | {:>14} | {:>14} {peak:>14} {reserved:>14} {over_used:>9.2} | {ratio:>14}", memory.parameters, memory.activations);
        previous = Some((seq, peak));
    }
}
