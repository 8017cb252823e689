//! Trains a small Llama on byte tokens with Ulysses sequence parallelism.
//!
//! With no launcher: every rank is a thread of this process (by default 4 SP ranks on the
//! CPU, on the licence texts every Debian machine has). Under `ulysses-launch`, torchrun or
//! srun: this process is one rank, and the ranks meet over TCP (CPU) or NCCL (CUDA). Writes
//! `metrics.csv`, `loss.png`, `config.json`, `model.mpk` and the training checkpoint
//! `checkpoint.ulysses` to `--out`.
//!
//! cargo run --release -p ulysses-trainer -- [--sp 4] [--dp 1] [--steps 300] [--backend cpu|cuda|cuda-fused|cuda-compile-only]
//! ulysses-launch --nproc-per-node 4 -- target/release/ulysses-trainer --sp 2      (SP=2 × DP=2)

use std::{
    fs,
    path::{Path, PathBuf},
    sync::Arc,
    time::Instant,
};

use burn::{
    backend::Autodiff,
    module::Module,
    optim::AdamWConfig,
    tensor::backend::Backend,
};
use burn_ulysses::{ParallelLayout, PlainBackend, UlyssesBackend, device_io::DeviceIo, precision::Precision};
use ulysses_training::{
    LayerCheckpointing, StepReport,
    checkpoint::{checkpoint_path, read_checkpoint_state, same_checkpoint},
};
use clap::{Parser, ValueEnum};
use ulysses_models::{COMPANION_FILES, ChatTemplate, HfConfig, TextTokenizer, TokenizerConfig, from_pretrained, from_pretrained_lazily, is_tokenizer_file};
use indicatif::{ProgressBar, ProgressStyle};
use burn_ulysses::job::{JobOptions, Launch, Tcp, Transport, run_ranks};
use ulysses_dist::DistributedConfig;
use ulysses_trainer::{
    corpus::{BYTE_VOCAB, ByteCorpus, DEFAULT_CORPUS},
    data_identity::{DataIdentity, TRAINED_WHOLE},
    memory,
    documents::{DOCUMENT_READER_VERSION, DocumentReader, Documents, LossOn, PackedDocuments, cut_documents_note, document_eos},
    plot,
    run_folder::{CHECKPOINT_FILE, CONFIG_FILE, Claim, METRICS_FILE, RunFolder, RunRecord, earlier_rows, earlier_run_files, resolved, resumed_folder, same_place},
    token_cache::{CacheFolder, read_through},
    tokens::TokenFile,
    train::{CorpusData, Faults, LrSchedule, MAX_BATCH_SIZE, Progress, RunOptions, RunState, StepData, TrainConfig, check_resumable, evaluate_sequences, train_rank},
};

/// What becomes of a document longer than --seq-len (`--too-long`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum TooLong {
    Cut,
    Truncate,
    Refuse,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BackendKind {
    /// NdArray on the CPU.
    Cpu,
    /// CubeCL CUDA (`CubeBackend`), one GPU per process (build with `--features cuda`).
    Cuda,
    /// burn's fused CUDA backend (`Fusion<CubeBackend>`, what `burn::backend::Cuda` is).
    CudaFused,
    /// No GPU, nothing computed: `--backend cuda`'s host code on an H100's compile-only runtime,
    /// which writes every kernel it launched (burn's autotune candidates among them) to
    /// OUT/cuda-sources for the PTX cache a GPU run is given (build with `--features
    /// compile-only`; scripts/ptx-cache.sh). Losses read as zero.
    CudaCompileOnly,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LaunchMode {
    /// A process of a launched job when RANK/WORLD_SIZE are set or this is a task of an srun
    /// step, else threads.
    Auto,
    /// Every rank a thread of this process, whatever the environment says.
    Threads,
    /// One rank of a launched job; fails without a launcher's variables.
    Process,
}

/// The dtype `--save-hf` writes the weights in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum SaveDtype {
    F32,
    Bf16,
    F16,
}

impl From<SaveDtype> for burn::tensor::DType {
    fn from(dtype: SaveDtype) -> Self {
        match dtype {
            SaveDtype::F32 => Self::F32,
            SaveDtype::Bf16 => Self::BF16,
            SaveDtype::F16 => Self::F16,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, ValueEnum)]
enum TransportKind {
    /// NCCL on CUDA, TCP on the CPU.
    Auto,
    /// Host copies over TCP: any backend.
    Tcp,
    /// NCCL (CUDA backends only).
    Nccl,
}

#[derive(Parser, Debug)]
#[command(about = "Train a Llama-family decoder with Ulysses sequence parallelism: a small Llama on bytes, or a Hugging Face checkpoint (--model) fine-tuned on your data")]
struct Args {
    /// Sequence-parallel degree: ranks that split each sequence.
    #[arg(long, default_value_t = 4)]
    sp: usize,
    /// Ring degree within the SP group (Ulysses × Ring: sp = ulysses × ring); it lets sp go
    /// past the head count.
    #[arg(long, default_value_t = 1)]
    ring: usize,
    /// Cut the sequence zigzag over the ring (ring rank r holds chunks r and 2·ring − 1 − r):
    /// equal causal work on every ring rank.
    #[arg(long)]
    zigzag: bool,
    /// Data-parallel degree: replicas that split each batch. Default: 1 with threads, the
    /// launched world size divided by --sp with processes.
    #[arg(long)]
    dp: Option<usize>,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    grad_accumulation: usize,
    /// Optimizer steps of the whole run (a resume trains on to it).
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// Sequences per optimizer step (over all ranks).
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Tokens (bytes) per sequence; every batch is padded to it.
    #[arg(long, default_value_t = 256)]
    seq_len: usize,
    /// The peak learning rate, reached after the warm-up [with --model: 2e-5, TRL's
    /// SFTTrainer's].
    #[arg(long, default_value_t = 3e-3)]
    learning_rate: f64,
    /// Steps of linear warm-up to --learning-rate (default: 20, or a fifth of --steps where
    /// that is fewer).
    #[arg(long)]
    warmup_steps: Option<usize>,
    /// How the learning rate falls after the warm-up: cosine, linear (with --min-lr-ratio 0,
    /// Hugging Face's Trainer's default but for its warm-up, which starts one step lower at 0)
    /// or constant.
    #[arg(long, default_value = "cosine")]
    lr_schedule: LrSchedule,
    /// The fraction of --learning-rate the schedule falls to where the steps end.
    #[arg(long, default_value_t = 0.1)]
    min_lr_ratio: f64,
    /// Clip each step's gradient, summed over every rank, to this global L2 norm, as Hugging
    /// Face's Trainer does by default (0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    max_grad_norm: f64,
    /// AdamW's decoupled weight decay: each step multiplies the weight matrices (not the norms'
    /// gains or biases, as Hugging Face's Trainer decays) by 1 − lr × this (PyTorch's default;
    /// the Trainer's is 0).
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f32,
    /// AdamW's β₁, the first moment's decay (PyTorch's default).
    #[arg(long, default_value_t = 0.9)]
    adam_beta1: f32,
    /// AdamW's β₂, the second moment's decay (PyTorch's default; Llama's pre-training took 0.95).
    #[arg(long, default_value_t = 0.999)]
    adam_beta2: f32,
    /// Added to the root of AdamW's second moment (PyTorch's and Hugging Face's default; burn's
    /// 1e-5 is as large as a fine-tune's gradients, and would slow its updates).
    #[arg(long, default_value_t = 1e-8)]
    adam_epsilon: f32,
    /// A text file, or a folder of them (byte tokens).
    #[arg(long, default_value = DEFAULT_CORPUS)]
    corpus: PathBuf,
    /// Train on a --corpus that does not look like text (not UTF-8, or 1% control bytes or more).
    #[arg(long)]
    bytes_ok: bool,
    /// Pre-tokenized data instead of --corpus: JSON Lines, one array of token ids (0..256,
    /// or the --model's vocabulary) per line, each at most --seq-len long.
    #[arg(long, conflicts_with = "corpus")]
    tokens: Option<PathBuf>,
    /// Documents to fine-tune a --model (or --hf-config) on: JSON Lines of {"text": ...}
    /// (tokenized with --tokenizer) or {"input_ids": [...]}, a text file (one document), or a
    /// folder of them. Texts end in EOS (ids are taken as given); documents are packed into
    /// sequences of --seq-len, each a document of its own (positions restart, attention stays
    /// inside it). Supervised fine-tuning: {"messages": [{"role": ..., "content": ...}, ...]}
    /// (rendered with the checkpoint's chat template), {"prompt": ..., "completion": ...} (text,
    /// or messages) or {"input_ids": [...], "labels": [...]} (-100: not trained on; or an
    /// "assistant_masks" or "completion_mask" of 0s and 1s) lines, where only the answers are
    /// trained on (--loss-on); each line as TRL's SFTTrainer prepares it.
    #[arg(long, conflicts_with_all = ["corpus", "tokens"])]
    data: Option<PathBuf>,
    /// Held-out documents to evaluate on, all of them, every --eval-every steps: a file or
    /// folder of --data's kinds, read as --data is; --data is then trained on whole [default:
    /// --data's last batch, held out where it has two or more and --eval-every is above 0].
    #[arg(long, requires = "data", conflicts_with = "eval_only")]
    eval_data: Option<PathBuf>,
    /// Evaluate the held-out documents every this many steps, and after the last (0: never, and
    /// --data, --tokens or --corpus is trained on whole).
    #[arg(long, default_value_t = 50)]
    eval_every: usize,
    /// What --data's chat, prompt/completion and labelled lines train on: `assistant`, the
    /// answers alone (the template's {% generation %} blocks, the completions narrowed to them,
    /// the tokens with a label or an answer mask's 1), as TRL's SFTTrainer does with
    /// `assistant_only_loss`; `completion`, TRL's defaults (a prompt/completion line's
    /// completion whole, whatever the template marks; a conversation's every token); `all`,
    /// every token.
    #[arg(long, value_enum, default_value = "assistant", requires = "data")]
    loss_on: LossOn,
    /// A chat template (a .jinja file) to render --data's conversation lines with, in place of
    /// the tokenizer's: a training template that marks the answers with {% generation %} and
    /// renders each prompt as the start of its conversation, as TRL's trl/chat_templates/
    /// *_training.jinja do for Llama 3, Qwen2.5 and Qwen3, whose own templates mark none. Given
    /// the tokenizer's special tokens; --save-hf still copies the tokenizer's own template.
    #[arg(long, requires = "data")]
    chat_template: Option<PathBuf>,
    /// A --data document (a conversation) longer than --seq-len: `cut` into pieces, each
    /// trained as a document of its own (a later piece's answers without their prompt);
    /// `truncate` to its first --seq-len tokens, the rest dropped (TRL's max_length); or
    /// `refuse`, naming its file and line.
    #[arg(long, value_enum, default_value = "cut", requires = "data")]
    too_long: TooLong,
    /// Where --data (and --eval-data) is kept tokenized, so that every process of a job and
    /// each later run of the same data, read the same way, loads it in place of tokenizing it
    /// again: a folder, or `off` [default: $XDG_CACHE_HOME/burn-ulysses/tokenized (else
    /// ~/.cache's) for data of 64 MiB or more; less tokenizes in seconds].
    #[arg(long, value_name = "FOLDER|off", requires = "data")]
    data_cache: Option<PathBuf>,
    /// The tokenizer.json that tokenizes --data's text, or a folder holding one [default: the
    /// --model folder's]. Its folder gives the tokenizer_config.json (EOS) and chat template.
    #[arg(long, requires = "data")]
    tokenizer: Option<PathBuf>,
    /// The token that ends each --data document [default: the tokenizer's eos_token
    /// (tokenizer_config.json, else its tokenizer class's default), else config.json's first
    /// eos_token_id].
    #[arg(long, requires = "data")]
    eos_token_id: Option<u32>,
    /// Fine-tune this Hugging Face checkpoint folder (config.json and model.safetensors of a
    /// Llama, Mistral, Qwen2 or Qwen3) rather than train a model from scratch; needs --data
    /// (documents) or --tokens (ids of the checkpoint's tokenizer).
    #[arg(long, conflicts_with_all = ["d_model", "layers", "heads", "kv_heads", "ffn_hidden"])]
    model: Option<PathBuf>,
    /// Train nothing: print the loss and perplexity of the --model on all of --data, at any
    /// --sp and --dp.
    #[arg(long, requires = "model", conflicts_with_all = ["resume", "stop_after", "save_hf"])]
    eval_only: bool,
    /// Keep the token embeddings (and an output head tied to them) as they are: no gradient,
    /// no update.
    #[arg(long)]
    freeze_embeddings: bool,
    /// Train a model of this Hugging Face config.json's shape (or a folder holding one) from
    /// seeded random weights, without its checkpoint: a Llama-3.2-1B- or Qwen3-shaped model to
    /// measure. --corpus bytes are ids 0..256 of its vocabulary.
    #[arg(long, value_name = "CONFIG_JSON", conflicts_with_all = ["model", "d_model", "layers", "heads", "kv_heads", "ffn_hidden"])]
    hf_config: Option<PathBuf>,
    /// With --model (or --hf-config): write the trained model to this folder in Hugging
    /// Face's format (safetensors and config.json), which transformers loads.
    #[arg(long)]
    save_hf: Option<PathBuf>,
    /// The dtype --save-hf writes the weights in [default: the checkpoint's `torch_dtype`
    /// (so a fine-tune of an f32 model keeps updates below bf16's step; f16 for a float16 one),
    /// bf16 where it names none; where the model is a bf16 compute copy beside the sharded
    /// optimizer's f32 masters (--offload-optimizer, --zero 3 with --precision bf16), bf16, and
    /// no other].
    #[arg(long, requires = "save_hf")]
    save_hf_dtype: Option<SaveDtype>,
    /// Output folder [default: runs/llama, or the --resume folder, or the folder of the --resume
    /// file]. One run at a time holds it (a lock); a fresh run, or a --resume into another
    /// folder, refuses a folder with an earlier run's files (checkpoint, model, config.json,
    /// metrics.csv).
    #[arg(long)]
    out: Option<PathBuf>,
    /// With --resume: continue on data other than the checkpoint's run trained on, or read
    /// otherwise (its path, size and digest, and how --data was read, are recorded in the
    /// checkpoint).
    #[arg(long, requires = "resume")]
    allow_new_data: bool,
    /// Start a fresh run in an --out folder that holds an earlier run's files (with
    /// --resume: continue the resumed run there, in place of that folder's run).
    #[arg(long)]
    overwrite: bool,
    /// Where the ranks compute.
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendKind,
    /// Ranks as threads of this process, or as the processes a launcher started.
    #[arg(long, value_enum, default_value = "auto")]
    launch: LaunchMode,
    /// How ranks that are processes pass tensors (ranks that are threads of one process share
    /// its memory and use neither).
    #[arg(long, value_enum, default_value = "auto")]
    transport: TransportKind,
    /// Device index of this process [default: LOCAL_RANK, or 0 where CUDA_VISIBLE_DEVICES shows
    /// the process one device; threads share device 0].
    #[arg(long)]
    device: Option<usize>,
    /// Evaluate on one rank with the whole sequence, bypassing sequence parallelism (under
    /// --zero 3 the other ranks join its gathers, a layer at a time).
    #[arg(long)]
    eval_single_device: bool,
    /// Verify every this many steps that all ranks hold identical parameters (0: never; under
    /// --zero 3 each rank holds parts, not a copy: never).
    #[arg(long, default_value_t = 50)]
    check_parameters_every: usize,
    /// Seed of the initial parameters and of the order the batches of --data and --corpus are
    /// drawn in (--tokens are drawn in the file's order: shuffle the file to shuffle them).
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Train on packed documents: the paragraphs of each sequence (ending in a blank line)
    /// are separate documents; attention and labels stay inside each, positions restart.
    #[arg(long)]
    pack: bool,
    /// Whole-layer activation checkpointing: each layer keeps only its input and runs again
    /// in the backward (less memory, one more forward).
    #[arg(long)]
    checkpoint_layers: bool,
    /// With --checkpoint-layers, keep the layer inputs in host memory.
    #[arg(long, requires = "checkpoint_layers")]
    offload_to_host: bool,
    /// With --offload-to-host, keep only the first N layers' inputs in host memory, the later
    /// layers' on the device (for a host that cannot hold them all: --check says what each
    /// side needs).
    #[arg(long, requires = "offload_to_host", value_name = "N")]
    offload_layers: Option<usize>,
    /// With --checkpoint-layers, run each layer's token-wise parts (everything but the
    /// attention core: norms, projections, RoPE, the MLP) over sequence tiles of about this
    /// many tokens of the local shard (ALST's tiled MLP, wider; ALST uses d_model).
    #[arg(long, requires = "checkpoint_layers", value_name = "TOKENS")]
    tile_tokens: Option<usize>,
    /// What the layers compute in: f32, or bf16 (training refused on a device without bf16,
    /// whose f16 needs loss scaling; not on NdArray) with f32 master weights, norm and softmax statistics and loss [default: bf16
    /// on CUDA, as ALST and Hugging Face train, where attention runs on tensor cores; f32 on
    /// the CPU].
    #[arg(long)]
    precision: Option<Precision>,
    /// The optimizer on the host: AdamW's f32 master weights and moments in host memory, each
    /// rank holding 1/world of them (12 bytes a parameter over the world) and updating them on
    /// the CPU; the devices keep the parameters and gradients alone (ZeRO's optimizer half with
    /// the optimizer offloaded). Checkpoints hold one file of optimizer state per rank.
    #[arg(long)]
    offload_optimizer: bool,
    /// ZeRO's stage: 0, each rank holds the whole model; 3, each rank holds 1/world of the
    /// parameters and gradients too, a layer gathered just before it runs and its gradients
    /// reduce-scattered after its backward (needs --checkpoint-layers); the optimizer's parts
    /// stay on the device, or go to the host with --offload-optimizer.
    #[arg(long, default_value_t = 0, value_name = "STAGE")]
    zero: usize,
    /// With --zero 3 and --offload-optimizer, keep each rank's parts of the parameters in host
    /// memory too, uploaded for each layer's gather (a device holds no parameter between them).
    #[arg(long)]
    offload_parameters: bool,
    /// With --zero 3 and --offload-optimizer, update each layer's parts as soon as its backward
    /// gives their gradients (the host never holds the step's gradient parts together: 12 bytes
    /// a parameter of a rank's part, not 16); needs --max-grad-norm 0 and no gradient accumulation
    #[arg(long)]
    optimizer_in_backward: bool,
    /// Under bf16, compute the loss's logits in f32 (TF32 matmuls) rather than in bf16 with f32
    /// accumulation; the softmax and loss are f32 either way. `--f32-head false` turns it off on
    /// a resume whose checkpoint has it on.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    f32_head: bool,
    /// The byte model's width (without --model or --hf-config).
    #[arg(long, default_value_t = 128)]
    d_model: usize,
    /// The byte model's decoder layers.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Query heads.
    #[arg(long, default_value_t = 8)]
    heads: usize,
    /// Key/value heads (grouped-query attention).
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    /// The byte model's MLP width.
    #[arg(long, default_value_t = 256)]
    ffn_hidden: usize,
    /// Write the training checkpoint every this many steps (and after the last; 0: only then).
    #[arg(long, default_value_t = 50)]
    checkpoint_every: usize,
    /// Keep this many training checkpoints: the newest as checkpoint.ulysses, the ones before it
    /// as checkpoint-step-S.ulysses (S its steps; hard links, no copies), each with its sharded
    /// optimizer state; `--resume OUT/checkpoint-step-S.ulysses --overwrite` goes back to one (a
    /// loss spike), keeping the later one in turn. Each kept checkpoint takes a checkpoint's
    /// disk space; not kept in the checkpoint (give it again to a --resume).
    #[arg(long, default_value_t = std::num::NonZeroUsize::MIN, conflicts_with = "no_save", value_name = "N")]
    keep_checkpoints: std::num::NonZeroUsize,
    /// A measuring run: write neither the training checkpoint nor model.mpk (a 1B model's
    /// checkpoint is 20 GB), only metrics.csv, the plot and config.json (and a --save-hf
    /// folder, every --checkpoint-every steps and at the end).
    #[arg(long, conflicts_with_all = ["resume", "stop_after"])]
    no_save: bool,
    /// Print, after each step, what rank 0 waited on the device for: reads back to the host
    /// and syncs (on a GPU each stalls until its queue drains) and uploads, with bytes; and,
    /// on the CubeCL backends, the kernels launched. Waits inside the collectives (the
    /// communicators' own syncs and reads) are not counted; their kernels are. And the step's
    /// seconds up to its backward's end and from there (the update), the device synchronised
    /// between (a wait a step more, left out of the counts).
    #[arg(long)]
    profile: bool,
    /// With --checkpoint-layers, log (rank 0) each layer's forward and backward as a step
    /// reaches it, with the seconds since the micro-batch began and the device memory in use
    /// and reserved: for steps that take minutes, how far one got and how its memory grew
    /// (the host's time: the device may trail it by what is queued)
    #[arg(long)]
    progress: bool,
    /// Check the command line, the settings, the data (a --resume's checkpoint too) and the --out
    /// folder, say what the run would be, and exit: nothing is trained or written. The memory a run needs is
    /// checked as it starts, on the chosen backend, before the model is built
    #[arg(long)]
    check: bool,
    /// With --check (and --checkpoint-layers): a device's memory, in GB, to plan for (ranks that
    /// are threads of one process share it): says whether the run fits it, where the layer inputs
    /// must go for it to (--offload-to-host, --offload-layers), and the longest --seq-len that fits
    #[arg(long, requires = "check", value_name = "GB")]
    device_memory: Option<f64>,
    /// With --device-memory: the memory of a host, in GB, shared by the ranks it runs: what it
    /// has available to them (`free`'s "available"; a run checks /proc/meminfo's MemAvailable,
    /// or its cgroup's limit, as it starts), not its total [default: not limited]
    #[arg(long, requires = "device_memory", value_name = "GB")]
    host_memory: Option<f64>,
    /// Continue the run whose checkpoint is in this folder (or file): losses continue as if
    /// it had never stopped. Every rank reads it. The run's settings are the checkpoint's
    /// unless given here; some may change (--steps, --learning-rate and its schedule,
    /// --max-grad-norm, --precision, --grad-accumulation, the layout, where the state lives
    /// but for a sharded optimizer's against a replicated one's),
    /// the rest must match (--seed, --batch-size, --seq-len, AdamW's, --pack,
    /// --freeze-embeddings, the model's shape, the data unless --allow-new-data):
    /// docs/training.md lists them
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Continue the run in --out from its checkpoint where it has one (as --resume OUT), else
    /// start it there: the command a scheduler requeues, unchanged. An attempt killed before its
    /// first checkpoint left only its record (config.json, metrics.csv), which a start replaces.
    #[arg(long, requires = "out", conflicts_with_all = ["resume", "overwrite", "eval_only", "no_save"])]
    auto_resume: bool,
    /// Stop after this many steps in total (writing a checkpoint), to continue later with
    /// --resume; the schedule still follows --steps.
    #[arg(long)]
    stop_after: Option<usize>,
    /// Test hook: STEP:RANK makes that rank's gradients NaN at that step.
    #[arg(long, hide = true, value_parser = step_and_rank)]
    fault_nan_gradient: Option<(usize, usize)>,
    /// Test hook: STEP:RANK kills that rank's process (SIGKILL) in the middle of that step.
    #[arg(long, hide = true, value_parser = step_and_rank)]
    fault_kill: Option<(usize, usize)>,
    /// Test hook: SECONDS world rank 0's write of each replicated checkpoint waits first (a
    /// slow disk).
    #[arg(long, hide = true)]
    fault_slow_checkpoint_write: Option<f64>,
    /// Test hook: world rank 0's write of each replicated checkpoint fails (a full disk).
    #[arg(long, hide = true)]
    fault_failed_checkpoint_write: bool,
    /// Test hook: STEP:RANK makes that rank fail with an error of its own as that step begins.
    #[arg(long, hide = true, value_parser = step_and_rank)]
    fault_fail: Option<(usize, usize)>,
    /// Test hook: with --eval-only, RANK kills its process (SIGKILL) before it evaluates, while
    /// its peers wait for it inside attention.
    #[arg(long, hide = true)]
    fault_kill_before_eval: Option<usize>,
    /// The flags given on the command line (clap's ids), to tell them from defaults.
    #[arg(skip)]
    given: std::collections::BTreeSet<String>,
}

fn step_and_rank(value: &str) -> Result<(usize, usize), String> {
    let (step, rank) = value.split_once(':').ok_or("expected STEP:RANK")?;
    Ok((step.parse().map_err(|_| "STEP must be a number")?, rank.parse().map_err(|_| "RANK must be a number")?))
}

fn main() {
    let matches = <Args as clap::CommandFactory>::command().get_matches();
    let mut args = <Args as clap::FromArgMatches>::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    args.given = matches.ids().filter(|id| matches.value_source(id.as_str()) == Some(clap::parser::ValueSource::CommandLine)).map(|id| id.to_string()).collect();
    // `--progress`: the checkpointed step's reports of each layer it reaches.
    let progress = format!("{}=debug", ulysses_training::PROGRESS_TARGET);
    let also: &[&str] = if args.progress { &[&progress] } else { &[] };
    // Beside the logs, the count of CubeCL's kernel launches that `--profile` prints.
    ulysses_dist::logging::init_with_directives("info", also, burn_ulysses::device_io::kernel_launch_counter());
    // A failure inside the model (a peer that died) is reported once, as the rank's error.
    ulysses_training::quiet_caught_panics();
    if !args.eval_only && !args.no_save {
        stop_on_signals();
    }
    let check = args.check;
    let ran = run(args);
    // A failed run may wait in the rendezvous to tell its peers why: a signal there ends it as
    // a failure, not with the status of a run to start again (75: a job script would requeue it).
    if ran.is_err() {
        // SAFETY: signal(2) resets the handlers this process installed.
        unsafe {
            for signal in [libc::SIGTERM, libc::SIGUSR1] {
                libc::signal(signal, libc::SIG_DFL);
            }
        }
    }
    // The ranks have left their groups: the writes a failed rank left under way end now.
    ulysses_trainer::train::finish_writes_left_running();
    if let Err(message) = ran {
        // A process's rank error was said as it failed (the same message).
        if !ERROR_SAID.load(std::sync::atomic::Ordering::Relaxed) {
            eprintln!("error: {message}");
        }
        // A rank that failed before it joined the job (its data, its run folder) says so to the
        // others, which would wait out the rendezvous timeout for it; `--check` joins no job.
        if let (Some(env), false, false) = (PROCESS_ENV.get(), ulysses_dist::rendezvous::join_tried(), check) {
            if env.rank == 0 {
                eprintln!("telling the job's other ranks why as they join (rank 0 serves the rendezvous until every rank has come and gone, or its timeout)");
            }
            let reported = DistributedConfig::new().with_env_overrides().map_err(|e| e.to_string()).and_then(|config| {
                ulysses_dist::rendezvous::Rendezvous::report_failure(env, &config, &message).map_err(|e| e.to_string())
            });
            if let Err(why) = reported {
                eprintln!("warning: this rank's failure could not be said to the job's other ranks ({why}): they wait out the rendezvous timeout");
            }
        }
        // A rank that failed because a peer did says so, for a launcher to name the peer.
        std::process::exit(if PEER_FAILED.load(std::sync::atomic::Ordering::Relaxed) { ulysses_dist::launch::EXIT_PEER_FAILED } else { 1 });
    }
    // Stopped early on a signal, its checkpoint written: not 0, so that a job script or retry
    // loop tells it from a finished run and resumes it.
    if ulysses_trainer::train::STOPPED_ON_SIGNAL.load(std::sync::atomic::Ordering::Relaxed) {
        std::process::exit(ulysses_dist::launch::EXIT_STOPPED_TO_RESUME);
    }
}

/// This process's launcher variables, where it is one rank of a job.
static PROCESS_ENV: std::sync::OnceLock<ulysses_dist::LaunchEnv> = std::sync::OnceLock::new();

/// Whether this process's rank failed because a peer did: it exits
/// [`ulysses_dist::launch::EXIT_PEER_FAILED`].
static PEER_FAILED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A rank's error as the trainer reports it, noting [`note_peer_loss`].
fn rank_failure(threads: bool, error: burn_ulysses::UlyssesError) -> String {
    note_peer_loss(threads, error.is_peer_loss());
    error.to_string()
}

/// Notes, for the process's exit status, a process's rank (the one of its process) that
/// failed on a peer's loss.
fn note_peer_loss(threads: bool, peer_loss: bool) {
    if !threads && peer_loss {
        PEER_FAILED.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Whether this process printed its error already ([`said_before_leaving`]).
static ERROR_SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A process's rank error, printed as it fails, while its communicator is still held: leaving
/// the job, its rendezvous waits for the other ranks to leave, which they do on noticing it
/// gone, so a launcher blames one of them first and may kill this rank, waiting, before it
/// printed why (a full disk under rank 0's checkpoint). Rank threads report after they join.
fn said_before_leaving(threads: bool, result: Result<(), String>) -> Result<(), String> {
    if let (Err(message), false) = (&result, threads) {
        eprintln!("error: {message}");
        ERROR_SAID.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    result
}

extern "C" fn on_stop_signal(_signal: libc::c_int) {
    // Before the first step there is none to finish: nothing is lost by ending now, with the
    // status of a run stopped to be run again (a job script's requeue on 75 fires).
    if !ulysses_trainer::train::STEPS_BEGUN.load(std::sync::atomic::Ordering::Relaxed) {
        const SAID: &[u8] = b"stopped on a signal before the first step: nothing to save; the same command starts the run again\n";
        // SAFETY: write(2) and _exit(2) are async-signal-safe; SAID is a valid buffer.
        unsafe {
            libc::write(libc::STDERR_FILENO, SAID.as_ptr().cast(), SAID.len());
            libc::_exit(ulysses_dist::launch::EXIT_STOPPED_TO_RESUME);
        }
    }
    // A repeat (a scheduler's grace ending in a second SIGTERM, `--signal=USR1` followed by the
    // time limit's SIGTERM) changes nothing: the step under way and its checkpoint finish, and
    // only SIGKILL, or SIGINT, ends the process sooner. Ending at the repeat lost the steps
    // since the last checkpoint where the scheduler would have waited for the write.
    ulysses_training::request_stop();
}

/// SIGTERM (a scheduler's preemption, `scancel`, the launcher stopping its ranks) and SIGUSR1
/// (`sbatch --signal=USR1@300`, `ulysses-launch` passing one on) stop the run after the step
/// under way, every rank after the same one, with a checkpoint, so that `--resume` continues
/// it: a kill lost the steps since the last checkpoint. Signals after the first change nothing
/// (a scheduler sends several); SIGINT or a scheduler's SIGKILL after its grace ends the process
/// sooner, the checkpoint before staying whole (its writes are atomic). Before any step has
/// begun (the model loading, the ranks meeting: nothing to finish) the first ends the process
/// at once, with the same status 75. Not for `--eval-only`, which has no step to stop after,
/// nor `--no-save`, which writes no checkpoint to continue from.
fn stop_on_signals() {
    let handler = on_stop_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only loads and stores atomics and calls write(2) and _exit(2), which
    // are async-signal-safe.
    unsafe {
        for signal in [libc::SIGTERM, libc::SIGUSR1] {
            libc::signal(signal, handler);
        }
    }
}

/// `--auto-resume`: `--resume OUT` where --out holds a checkpoint; else a start there, over the
/// record alone of an attempt that never wrote one, and optimizer parts of a save it did not
/// finish (kept checkpoints or a model are refused as for any fresh run: the folder's files
/// name them). Each process decides from the folder as it sees it: --out must be one folder
/// every rank sees.
fn auto_resume(args: &mut Args) {
    let out = args.out.clone().expect("--auto-resume requires --out");
    if out.join(CHECKPOINT_FILE).is_file() {
        tracing::info!("--auto-resume: continuing the run in {} from its checkpoint", out.display());
        args.resume = Some(out);
        return;
    }
    // Optimizer parts no checkpoint names (a save killed before it wrote the checkpoint,
    // which names them last) are removed as the folder is claimed.
    let earlier = earlier_run_files(&out);
    let attempt_record = |name: &String| name == CONFIG_FILE || name == METRICS_FILE || name.starts_with(ulysses_training::STATE_FOLDER_PREFIX);
    if !earlier.is_empty() && earlier.iter().all(attempt_record) {
        tracing::warn!(
            "--auto-resume: {} holds no checkpoint, only the record of an attempt that wrote none ({}): starting the run over there",
            out.display(),
            earlier.join(", ")
        );
        args.overwrite = true;
    }
}

/// The learning rate of a `--model` fine-tune given none (TRL's `SFTConfig` default).
const FINE_TUNE_LEARNING_RATE: f64 = 2e-5;

/// Everything a rank needs besides its backend.
struct Job<'a> {
    args: &'a Args,
    launch: Launch,
    config: TrainConfig,
    /// The Hugging Face configuration of --model or --hf-config.
    pretrained: Option<HfConfig>,
    data: Box<dyn StepData>,
    data_identity: DataIdentity,
    out: PathBuf,
    /// The step a resumed run starts at.
    resumed_at: Option<usize>,
    /// With --eval-only: every sequence of --data and its documents, evaluated instead of
    /// training.
    /// `--eval-only`: every sequence, its documents and, where the data marks answers, its targets.
    eval_sequences: Option<(Vec<Vec<i64>>, Vec<Vec<usize>>, Option<Vec<Vec<bool>>>)>,
    options: JobOptions,
    /// Held by world rank 0 for the whole run.
    _run_folder: Option<RunFolder>,
}

/// Under `--resume`, the checkpoint's run's settings for every flag of them the command line
/// does not give, so that a plain `--resume DIR` continues that run. Before, the flags'
/// defaults applied: a learning-rate schedule 150 times the run's (warned about alone), or a
/// refusal naming `--seq-len`. A setting given and different is kept: `check_resumable`
/// refuses what would train something else and warns of another schedule. `threads`: the
/// ranks are this process's threads, whose DP degree is `--dp`'s (with processes, what the
/// world leaves).
fn take_resumed_settings(args: &mut Args, saved: &RunState, threads: bool) -> ResumedSettings {
    let given = args.given.clone();
    let mut taken = Vec::new();
    let mut take = |id: &str, differs: bool, flag: String| {
        if !given.contains(id) && differs {
            taken.push(flag);
            true
        } else {
            false
        }
    };
    let config = &saved.config;
    if take("steps", args.steps != config.steps, format!("--steps {}", config.steps)) {
        args.steps = config.steps;
    }
    if take("learning_rate", args.learning_rate.to_bits() != config.learning_rate.to_bits(), format!("--learning-rate {}", config.learning_rate)) {
        args.learning_rate = config.learning_rate;
    }
    // A config that does not read (another burn's) takes none: check_resumable names it.
    // The run's warm-up, the default's too: a resume with more --steps would otherwise warm up
    // again, to the new steps' default, from part way through the peak. Fewer --steps than it
    // (a schedule that changes anyway, warned of) take their own default.
    let warmup_fits = config.warmup_steps <= args.steps;
    if take("warmup_steps", warmup_fits && config.warmup_steps != default_warmup(args.steps), format!("--warmup-steps {}", config.warmup_steps)) {
        args.warmup_steps = Some(config.warmup_steps);
    }
    if take("lr_schedule", args.lr_schedule != config.lr_schedule, format!("--lr-schedule {:?}", config.lr_schedule).to_lowercase()) {
        args.lr_schedule = config.lr_schedule;
    }
    if take("min_lr_ratio", args.min_lr_ratio.to_bits() != config.min_lr_ratio.to_bits(), format!("--min-lr-ratio {}", config.min_lr_ratio)) {
        args.min_lr_ratio = config.min_lr_ratio;
    }
    let adamw = ulysses_training::adamw_settings(&config.optimizer).unwrap_or(ulysses_training::HostAdamWConfig {
        weight_decay: args.weight_decay,
        beta_1: args.adam_beta1,
        beta_2: args.adam_beta2,
        epsilon: args.adam_epsilon,
    });
    for (id, value, saved) in [
        ("weight_decay", &mut args.weight_decay, adamw.weight_decay),
        ("adam_beta1", &mut args.adam_beta1, adamw.beta_1),
        ("adam_beta2", &mut args.adam_beta2, adamw.beta_2),
        ("adam_epsilon", &mut args.adam_epsilon, adamw.epsilon),
    ] {
        if take(id, value.to_bits() != saved.to_bits(), format!("--{} {saved:e}", id.replace('_', "-"))) {
            *value = saved;
        }
    }
    let norm = config.max_grad_norm.unwrap_or(0.0);
    if take("max_grad_norm", args.max_grad_norm.to_bits() != norm.to_bits(), format!("--max-grad-norm {norm}")) {
        args.max_grad_norm = norm;
    }
    if take("precision", precision_of(args) != config.precision, format!("--precision {:?}", config.precision).to_lowercase()) {
        args.precision = Some(config.precision);
    }
    if take("f32_head", args.f32_head != config.f32_head, format!("--f32-head {}", config.f32_head)) {
        args.f32_head = config.f32_head;
    }
    if take("eval_every", args.eval_every != config.eval_every, format!("--eval-every {}", config.eval_every)) {
        args.eval_every = config.eval_every;
    }
    if take("pack", args.pack != config.pack && args.data.is_none(), "--pack".into()) {
        args.pack = config.pack;
    }
    if take("freeze_embeddings", args.freeze_embeddings != config.freeze_embeddings, "--freeze-embeddings".into()) {
        args.freeze_embeddings = config.freeze_embeddings;
    }
    // The layout may change; unless any of it is given, it is the checkpoint's (DP with
    // processes is what the world leaves), else those of its flags not given again are named.
    let layout = &config.layout;
    let zigzag = layout.ring_sharding == burn_ulysses::ring::RingSharding::Zigzag;
    let saved_layout = [
        ("sp", args.sp != layout.sp_size, format!("--sp {}", layout.sp_size)),
        ("ring", args.ring != layout.ring_size, format!("--ring {}", layout.ring_size)),
        ("zigzag", args.zigzag != zigzag, "--zigzag".to_string()),
        ("dp", threads && args.dp.unwrap_or(1) != layout.dp_size, format!("--dp {}", layout.dp_size)),
    ];
    let replaced_layout = replaced_flags(&given, &saved_layout);
    if replaced_layout.is_none() {
        for (id, differs, flag) in saved_layout {
            if take(id, differs, flag) {
                match id {
                    "sp" => args.sp = layout.sp_size,
                    "ring" => args.ring = layout.ring_size,
                    "zigzag" => args.zigzag = zigzag,
                    _ => args.dp = Some(layout.dp_size),
                }
            }
        }
    }
    let replaced_layout = replaced_layout.unwrap_or_default();
    if take("seed", args.seed != saved.seed, format!("--seed {}", saved.seed)) {
        args.seed = saved.seed;
    }
    if take("batch_size", args.batch_size != config.batch_size, format!("--batch-size {}", config.batch_size)) {
        args.batch_size = config.batch_size;
    }
    if take("seq_len", args.seq_len != config.seq_len, format!("--seq-len {}", config.seq_len)) {
        args.seq_len = config.seq_len;
    }
    if take("grad_accumulation", args.grad_accumulation != config.grad_accumulation, format!("--grad-accumulation {}", config.grad_accumulation)) {
        args.grad_accumulation = config.grad_accumulation;
    }
    // The byte model's shape (a --model's or --hf-config's is the checkpoint's own).
    if args.model.is_none() && args.hf_config.is_none() {
        let model = &config.model;
        for (id, value, saved) in [
            ("d_model", &mut args.d_model, model.d_model),
            ("layers", &mut args.layers, model.n_layers),
            ("heads", &mut args.heads, model.n_heads),
            ("kv_heads", &mut args.kv_heads, model.n_kv_heads),
            ("ffn_hidden", &mut args.ffn_hidden, model.ffn_hidden),
        ] {
            if take(id, *value != saved, format!("--{} {saved}", id.replace('_', "-"))) {
                *value = saved;
            }
        }
    }
    // Where the state lives (a sharded optimizer's checkpoint resumes under one alone), as a
    // whole: any of these flags given, and the run's own are replaced (how a saved flag is
    // turned off), those not given again named.
    let layers = config.layer_checkpointing.as_ref();
    let (offload_to_host, offload_layers, tile_tokens) =
        (layers.is_some_and(|layers| layers.offload_to_host), layers.and_then(|layers| layers.offload_layers), layers.and_then(|layers| layers.tile_tokens));
    let saved_memory = [
        ("offload_optimizer", args.offload_optimizer != config.offload_optimizer, "--offload-optimizer".to_string()),
        ("zero", args.zero != config.zero_stage, format!("--zero {}", config.zero_stage)),
        ("checkpoint_layers", args.checkpoint_layers != layers.is_some(), "--checkpoint-layers".into()),
        ("offload_to_host", args.offload_to_host != offload_to_host, "--offload-to-host".into()),
        ("offload_layers", args.offload_layers != offload_layers, format!("--offload-layers {}", offload_layers.unwrap_or_default())),
        ("tile_tokens", args.tile_tokens != tile_tokens, format!("--tile-tokens {}", tile_tokens.unwrap_or_default())),
        ("offload_parameters", args.offload_parameters != config.offload_parameters, "--offload-parameters".into()),
        ("optimizer_in_backward", args.optimizer_in_backward != config.optimizer_in_backward, "--optimizer-in-backward".into()),
    ];
    if let Some(replaced_memory) = replaced_flags(&given, &saved_memory) {
        return ResumedSettings { taken, replaced_layout, replaced_memory };
    }
    for (id, differs, flag) in saved_memory {
        if take(id, differs, flag) {
            match id {
                "offload_optimizer" => args.offload_optimizer = config.offload_optimizer,
                "zero" => args.zero = config.zero_stage,
                "checkpoint_layers" => args.checkpoint_layers = layers.is_some(),
                "offload_to_host" => args.offload_to_host = offload_to_host,
                "offload_layers" => args.offload_layers = offload_layers,
                "tile_tokens" => args.tile_tokens = tile_tokens,
                "optimizer_in_backward" => args.optimizer_in_backward = config.optimizer_in_backward,
                _ => args.offload_parameters = config.offload_parameters,
            }
        }
    }
    ResumedSettings { taken, replaced_layout, replaced_memory: Vec::new() }
}

/// What [`take_resumed_settings`] did: the settings it took, as flags; and those of the run's
/// layout and memory settings that layout or memory flags given here replace (each group as a
/// whole), named in a warning.
struct ResumedSettings {
    taken: Vec<String>,
    replaced_layout: Vec<String>,
    replaced_memory: Vec<String>,
}

/// Of a group of settings resumed as a whole (`(id, differs from the checkpoint's, its flag)`):
/// where any of them is given again, the run's own are replaced, and the flags of those that
/// differ and are not given are returned, to be named; `None` where none is given (each that
/// differs is then the checkpoint's).
fn replaced_flags(given: &std::collections::BTreeSet<String>, saved: &[(&str, bool, String)]) -> Option<Vec<String>> {
    saved.iter().any(|(id, ..)| given.contains(*id)).then(|| {
        saved.iter().filter(|(id, differs, _)| !given.contains(*id) && *differs).map(|(.., flag)| flag.clone()).collect()
    })
}

/// The warm-up a run takes without --warmup-steps: 20 steps, or a fifth of `steps` where that
/// is fewer.
fn default_warmup(steps: usize) -> usize {
    TrainConfig::small(ParallelLayout::new()).warmup_steps.min(steps / 5)
}

/// Whether `model` is the byte model of some shape (a run without --model or --hf-config).
fn is_byte_model(model: &ulysses_models::DecoderConfig) -> bool {
    let byte = ulysses_models::DecoderConfig::new(BYTE_VOCAB)
        .with_d_model(model.d_model)
        .with_n_layers(model.n_layers)
        .with_n_heads(model.n_heads)
        .with_n_kv_heads(model.n_kv_heads)
        .with_ffn_hidden(model.ffn_hidden)
        .with_repeat_kv(model.repeat_kv);
    serde_json::to_value(&byte).ok() == serde_json::to_value(model).ok()
}

/// The flags given that change nothing in this run, each with why: warned, not refused (one
/// launch script may serve runs of several kinds).
fn ignored_flags(args: &Args, config: &TrainConfig, threads: bool) -> Vec<String> {
    let given = |id: &str| args.given.contains(id);
    let mut notes = Vec::new();
    if given("transport") && threads {
        notes.push("--transport connects ranks that are processes, and these ranks are threads of this one: it changes nothing".to_string());
    }
    if given("bytes_ok") && (args.data.is_some() || args.tokens.is_some()) {
        notes.push("--bytes-ok lets a --corpus that does not look like text train, and this run reads --data or --tokens: it changes nothing".to_string());
    }
    if given("check_parameters_every") && config.zero_stage == 3 && !args.eval_only {
        notes.push("--check-parameters-every compares the ranks' parameters, and under --zero 3 each holds its own part of them: it changes nothing".to_string());
    }
    if given("zigzag") && args.ring == 1 {
        notes.push("--zigzag cuts each sequence over the ring, and --ring 1 makes none: it changes nothing (give --ring 2 or more)".to_string());
    }
    if given("checkpoint_every") && args.no_save && args.save_hf.is_none() && !args.eval_only {
        notes.push("--checkpoint-every says how often a checkpoint is written, and --no-save writes none (nor a --save-hf): it changes nothing".to_string());
    }
    if given("min_lr_ratio") && config.lr_schedule == LrSchedule::Constant && !args.eval_only {
        notes.push("--min-lr-ratio is where a schedule's fall ends, and --lr-schedule constant does not fall: it changes nothing".to_string());
    }
    if given("device") && args.backend == BackendKind::Cpu {
        notes.push("--device picks a GPU, and the CPU backend has one device: it changes nothing".to_string());
    }
    if given("pack") && args.data.is_some() {
        notes.push("--pack makes paragraphs documents, and --data is read as documents always (packed): it changes nothing".to_string());
    }
    if given("eval_single_device") && args.eval_every == 0 && !args.eval_only {
        notes.push("--eval-single-device says how the held-out loss is computed, and --eval-every 0 computes none: it changes nothing".to_string());
    }
    if std::env::var_os("ULYSSES_GPU").is_some() {
        notes.push("ULYSSES_GPU places ulysses-nccl-check's ranks, and the trainer's device is LOCAL_RANK's or --device's: it changes nothing".to_string());
    }
    if given("f32_head") && args.f32_head && config.precision == Precision::F32 {
        notes.push("--f32-head computes the logits in f32 where the layers compute in bf16; under --precision f32 they are f32 already".to_string());
    }
    if args.eval_only {
        let flags = |ids: &[&str]| -> Vec<String> { ids.iter().filter(|id| given(id)).map(|id| format!("--{}", id.replace('_', "-"))).collect() };
        let training = flags(&["steps", "learning_rate", "grad_accumulation", "warmup_steps", "lr_schedule", "min_lr_ratio", "max_grad_norm", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "eval_every", "freeze_embeddings", "checkpoint_every", "keep_checkpoints", "check_parameters_every", "no_save", "out", "overwrite", "offload_to_host", "offload_layers", "progress", "profile", "device_memory", "host_memory"]);
        if !training.is_empty() {
            notes.push(format!("--eval-only trains nothing and saves nothing: {} change nothing", training.join(", ")));
        }
        let whole = flags(&["zero", "offload_optimizer", "offload_parameters", "optimizer_in_backward", "eval_single_device"]);
        if !whole.is_empty() {
            notes.push(format!(
                "--eval-only holds the whole model on every rank and evaluates over every SP group: {} change nothing",
                whole.join(", ")
            ));
        }
    }
    notes
}

/// What `--eval-only` checks of `config`: one micro-batch a replica, and what training alone
/// reads (the flags its note calls ignored: the optimizer, the schedule, ZeRO) at the defaults,
/// so that a value of theirs is not refused.
fn evaluation_settings(config: &TrainConfig) -> TrainConfig {
    let defaults = TrainConfig::new(config.model.clone(), AdamWConfig::new(), config.layout);
    TrainConfig {
        grad_accumulation: 1,
        batch_size: config.layout.dp_size,
        steps: defaults.steps,
        learning_rate: defaults.learning_rate,
        optimizer: defaults.optimizer,
        warmup_steps: defaults.warmup_steps,
        min_lr_ratio: defaults.min_lr_ratio,
        max_grad_norm: defaults.max_grad_norm,
        zero_stage: defaults.zero_stage,
        offload_optimizer: defaults.offload_optimizer,
        offload_parameters: defaults.offload_parameters,
        optimizer_in_backward: defaults.optimizer_in_backward,
        ..config.clone()
    }
}

/// `--precision`, or the backend's default: f32 on the CPU, bf16 on CUDA.
fn precision_of(args: &Args) -> Precision {
    args.precision.unwrap_or(match args.backend {
        BackendKind::Cpu => Precision::F32,
        BackendKind::Cuda | BackendKind::CudaFused | BackendKind::CudaCompileOnly => Precision::Bf16,
    })
}

fn run(mut args: Args) -> Result<(), String> {
    // A tokenizer's folder stands for its tokenizer.json, whose folder then gives its config,
    // chat template and the files --save-hf copies.
    if let Some(folder) = args.tokenizer.clone().filter(|path| path.is_dir()) {
        args.tokenizer = Some(folder.join("tokenizer.json"));
    }
    if args.auto_resume {
        auto_resume(&mut args);
    }
    // --launch threads reads no launcher variable: a broken or foreign one must not stop it.
    let launch = match args.launch {
        LaunchMode::Threads => {
            // Each process a launcher started would run the whole job (and contend for --out).
            if let Some(processes) = ulysses_dist::env::launched_processes().filter(|&processes| processes > 1) {
                tracing::warn!("--launch threads under a launcher that started {processes} processes (WORLD_SIZE, an srun step's tasks, or mpirun's): every process runs the whole job with its ranks as threads; leave --launch out to run one rank a process");
            }
            Launch::Threads
        }
        mode => match (mode, Launch::from_env().map_err(|e| e.to_string())?) {
            (LaunchMode::Process, Launch::Threads) if std::env::var_os("SLURM_PROCID").is_some() => {
                return Err("--launch process, but this is no srun step of several tasks (Slurm's batch script, or a step of one \
                            task, which runs its ranks as threads of this process): ask srun for one task a rank (`srun -n WORLD`)"
                    .into());
            }
            (LaunchMode::Process, Launch::Threads) => {
                return Err("--launch process, but no launcher set RANK and WORLD_SIZE (or an srun step's SLURM_PROCID): \
                            start this program with ulysses-launch, torchrun or srun"
                    .into());
            }
            (_, launch) => launch,
        },
    };
    if let Launch::Process(env) = &launch {
        let _ = PROCESS_ENV.set(env.clone());
    }
    // The run's notes once, not once a process.
    ulysses_trainer::train::say_run_notes(matches!(&launch, Launch::Threads) || matches!(&launch, Launch::Process(env) if env.rank == 0));
    // The --resume checkpoint's state, read once: its settings fill the flags not given, and
    // it is checked against the run once the run is set up.
    let resumed: Option<RunState> = args.resume.as_deref().map(read_checkpoint_state).transpose().map_err(|e| e.to_string())?;
    if let Some(saved) = &resumed {
        let resumed = take_resumed_settings(&mut args, saved, matches!(launch, Launch::Threads));
        if !resumed.taken.is_empty() && ulysses_trainer::train::says_run_notes() {
            tracing::info!("resuming with the checkpoint's {}", resumed.taken.join(", "));
        }
        for (replaced, what) in [(&resumed.replaced_layout, "layout flags given here replace its layout"), (&resumed.replaced_memory, "memory flags given here replace its memory settings")] {
            if !replaced.is_empty() && ulysses_trainer::train::says_run_notes() {
                tracing::warn!("the resumed run's {} are not kept: {what} as a whole; give them again to keep them", replaced.join(", "));
            }
        }
    }
    // A fine-tune's checkpoint holds its weights and settings, not the --model (or
    // --hf-config) folder its shape and tokenizer came from: without it the byte model's shape
    // would be refused as another model, naming fields, not the flag.
    if let Some(saved) = &resumed
        && args.model.is_none()
        && args.hf_config.is_none()
        && !is_byte_model(&saved.config.model)
    {
        let data = saved.data.as_ref().map(|data| format!(" (its data: {})", data.path)).unwrap_or_default();
        return Err(format!(
            "--resume: the checkpoint's run trained a Hugging Face model (--model or --hf-config){data}, which a checkpoint does not name: \
             give --model (or --hf-config) and the data flags of that run again with --resume; the weights and settings come from the checkpoint"
        ));
    }
    // After the resumed settings: a resumed run's --checkpoint-layers counts.
    if args.progress && !args.checkpoint_layers && !args.eval_only {
        return Err("--progress logs each layer's forward and backward under --checkpoint-layers: give --checkpoint-layers too".into());
    }
    // --device on every process of a node that sees all its GPUs: all of them on that one GPU.
    let sees_one_gpu = ulysses_dist::env::shows_one_device(std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref());
    if let (Some(index), Launch::Process(env), true) = (args.device, &launch, args.backend != BackendKind::Cpu)
        && env.local_world_size > 1
        && !sees_one_gpu
    {
        return Err(format!(
            "--device {index} puts each of this node's {} processes on GPU {index}: leave --device out (each process takes its LOCAL_RANK's GPU), \
             or show each process one GPU (CUDA_VISIBLE_DEVICES, `srun --gpus-per-task=1`)",
            env.local_world_size
        ));
    }
    // An SP group past one node: each attention's all-to-all crosses the network (slower, not
    // wrong), said once a node.
    if let Launch::Process(env) = &launch
        && env.node_size_known
        && env.local_rank == 0
        && env.world_size > env.local_world_size
        && args.sp > 1
        && (env.local_world_size % args.sp != 0 || env.rank % args.sp != 0)
    {
        tracing::warn!(
            "--sp {} groups span nodes (this node runs {} ranks, from rank {}): every attention's all-to-all then crosses the network; \
             make --sp divide each node's ranks, placed in blocks (srun's default distribution, not cyclic)",
            args.sp,
            env.local_world_size,
            env.rank
        );
    }
    // Each degree by its own flag (ParallelLayout::check names the field only), before any
    // product of them (a padding multiple of twice --sp) can overflow.
    for (field, flag, degree) in [("sp_size", "--sp", Some(args.sp)), ("dp_size", "--dp", args.dp), ("ring_size", "--ring", Some(args.ring))] {
        match degree {
            Some(0) => return Err(format!("{field} ({flag}) must be at least 1, got 0")),
            Some(degree) if degree > ulysses_trainer::train::MAX_DEGREE => {
                return Err(format!("{field} ({flag}) {degree} is past any run this trainer takes (at most {} ranks)", ulysses_trainer::train::MAX_DEGREE));
            }
            _ => {}
        }
    }
    let layout = match (launch.world_size(), args.dp) {
        (None, dp) => ParallelLayout::new().with_sp_size(args.sp).with_dp_size(dp.unwrap_or(1)),
        (Some(world), None) => ParallelLayout::for_world(world, args.sp).map_err(|e| format!("{e} (--sp)"))?,
        (Some(world), Some(dp)) if world != args.sp.saturating_mul(dp) => {
            let ranks = args.sp.saturating_mul(dp);
            return Err(format!(
                "the launcher started {world} ranks (WORLD_SIZE) and --sp {} × --dp {dp} makes {ranks}: launch {ranks} ranks, or leave --dp out (the world then gives it)",
                args.sp
            ));
        }
        (Some(_), Some(dp)) => ParallelLayout::new().with_sp_size(args.sp).with_dp_size(dp),
    };
    // Under --ring 1 a zigzag cut is the contiguous one, padded to twice the multiple for
    // nothing (more padding, and a dynamic RoPE refused at a length that fits): contiguous.
    let sharding = if args.zigzag && args.ring > 1 { burn_ulysses::ring::RingSharding::Zigzag } else { burn_ulysses::ring::RingSharding::Contiguous };
    let layout = layout.with_ring_size(args.ring).with_ring_sharding(sharding);
    layout.check().map_err(|e| format!("{e} (--sp, --ring)"))?;
    // The 0.22 crate's jobs read their SP degree from ULYSSES_SP_SIZE; the trainer reads --sp
    // alone (and the 0.21 jobs their layout's), refusing a variable that says otherwise.
    if let Some(value) = ulysses_dist::config::sp_size_variable_other_than(args.sp, std::env::var(ulysses_dist::config::ENV_SP_SIZE).ok()) {
        return Err(format!(
            "ULYSSES_SP_SIZE={value} but --sp {}: the trainer takes its sequence-parallel degree from --sp; pass --sp {value}, or unset ULYSSES_SP_SIZE",
            args.sp
        ));
    }
    // Checked here: clap skips `requires` when an argument that conflicts with the required
    // one (--d-model and the other shape flags) is given.
    if args.save_hf.is_some() && args.model.is_none() && args.hf_config.is_none() {
        return Err("--save-hf writes a Hugging Face checkpoint of a --model run: give --model DIR (the checkpoint to fine-tune) \
                    or --hf-config FILE (its shape, from random weights)"
            .into());
    }
    // Only world rank 0 saves, so only its node must be able to write there.
    let saves = match &launch {
        Launch::Threads => true,
        Launch::Process(env) => env.rank == 0,
    };
    let out = args.out.clone().or_else(|| args.resume.as_deref().map(resumed_folder)).unwrap_or_else(|| "runs/llama".into());
    // A copy resumed in its run's folder would write over the folder's checkpoint (and its
    // optimizer's parts) where that is another one: a later one of its run (the metrics cut
    // back too), or another run's that went on from an earlier copy, whatever its step.
    if let (Some(location), Some(saved), false) = (&args.resume, &resumed, args.overwrite)
        && same_place(&out, &resumed_folder(location))
    {
        let folder_file = out.join(CHECKPOINT_FILE);
        if !same_place(&checkpoint_path(location), &folder_file)
            && let Ok(other) = read_checkpoint_state::<RunState>(&folder_file)
            && !same_checkpoint(location, &folder_file).unwrap_or(false)
        {
            let which = if other.completed_steps > saved.completed_steps { "the later run" } else { "that checkpoint" };
            return Err(format!(
                "--resume {} is at step {}, and the run folder's {} is another checkpoint (at step {}), which going on in {} would \
                 write over: give --out ANOTHER_FOLDER to go on from step {} apart, or --overwrite to replace {which}",
                location.display(),
                saved.completed_steps,
                folder_file.display(),
                other.completed_steps,
                out.display(),
                saved.completed_steps
            ));
        }
    }
    // The run's folder holds its own config.json and checkpoint: never a checkpoint's or a
    // tokenizer's folder (an --overwrite would replace their config.json), nor one that --data
    // or --eval-data reads (a resume would read the run's files as documents).
    // (--eval-only writes nothing there.)
    // A save replaces the --hf-config's folder whole; the run's own config.json replaces a
    // config.json there (a folder given, or its config.json), not another file.
    let hf_config_folder = args.hf_config.as_deref().map(|config| if config.is_dir() { config } else { folder_of(config) });
    let hf_config_json = args.hf_config.as_deref().filter(|config| config.is_dir() || config.file_name().is_some_and(|name| name == "config.json")).and(hf_config_folder);
    for (other, flag) in [(args.model.as_deref(), "--model"), (args.tokenizer.as_deref().map(folder_of), "--tokenizer's"), (hf_config_json, "--hf-config's")]
        .into_iter()
        .filter(|_| !args.eval_only)
    {
        if other.is_some_and(|other| same_place(&out, other)) {
            return Err(format!("--out {} is the {flag} folder, whose config.json the run's own would replace: give the run a folder of its own", out.display()));
        }
    }
    // The corpus is read where neither --data nor --tokens is given.
    let corpus = (args.data.is_none() && args.tokens.is_none()).then_some(args.corpus.as_path());
    let data_folders = [(args.data.as_deref(), "--data"), (args.eval_data.as_deref(), "--eval-data"), (corpus, "--corpus")];
    // --eval-only writes nothing there.
    for (data, flag) in data_folders.into_iter().filter(|_| !args.eval_only) {
        if let Some(data) = data.filter(|data| data.is_dir() && inside(&out, data)) {
            return Err(format!(
                "--out {} lies in the {flag} folder {}, whose files are all read as documents (the run's own too, at a resume): give \
                 the run a folder outside it",
                out.display(),
                data.display()
            ));
        }
    }
    // A save replaces its folder whole: never the run's own, nor the checkpoint it starts from
    // (whose other files a save of files alone would not catch).
    if let Some(dir) = &args.save_hf {
        for (other, flag) in [(Some(out.as_path()), "--out"), (args.model.as_deref(), "--model"), (args.tokenizer.as_deref().map(folder_of), "--tokenizer's"), (hf_config_folder, "--hf-config's")] {
            if other.is_some_and(|other| same_place(dir, other)) {
                return Err(format!(
                    "--save-hf {} is the {flag} folder, which the save would replace whole: save into a folder of its own",
                    dir.display()
                ));
            }
        }
        if !same_place(dir, &out) && inside(&out, dir) {
            return Err(format!(
                "--out {} lies in the --save-hf folder {}, which a save replaces whole (with the run inside it): give them folders apart",
                out.display(),
                dir.display()
            ));
        }
        if let Some((data, flag)) = data_folders.into_iter().find_map(|(data, flag)| data.filter(|data| data.is_dir() && inside(dir, data)).map(|data| (data, flag))) {
            return Err(format!(
                "--save-hf {} lies in the {flag} folder {}, whose files are all read (the saved model's too, at the next run): save outside it",
                dir.display(),
                data.display()
            ));
        }
        check_companions_are_their_folders(&args)?;
    }
    if let (Some(dir), true) = (&args.save_hf, saves) {
        if !args.check {
            ulysses_models::recover_killed_saves(dir).map_err(|e| format!("--save-hf: {e}"))?;
        }
        ulysses_models::check_save_destination(dir).map_err(|e| format!("--save-hf: {e}"))?;
    }
    if args.model.is_some() && args.data.is_none() && args.tokens.is_none() {
        return Err("--model needs data to fine-tune on: --data FILE (JSON Lines of {\"text\"} or {\"input_ids\"}, or text) or --tokens FILE".into());
    }
    if args.data.is_some() && args.model.is_none() && args.hf_config.is_none() {
        return Err("--data is tokenized for a checkpoint: give --model DIR (or --hf-config FILE), whose vocabulary and EOS it uses".into());
    }
    if args.eval_only && args.data.is_none() {
        return Err("--eval-only evaluates the --model on documents: give --data FILE".into());
    }
    if let (Some(data), Some(held_out)) = (&args.data, &args.eval_data) {
        if args.eval_every == 0 {
            return Err(format!("--eval-data {} with --eval-every 0 evaluates nothing: give --eval-every N, or no --eval-data", held_out.display()));
        }
        check_held_out_apart(data, held_out)?;
    }
    let pretrained = match (&args.model, &args.hf_config) {
        // A trainer's own run folder has a config.json too, of another kind.
        (Some(dir), _) if [CHECKPOINT_FILE, METRICS_FILE, "model.mpk"].iter().any(|file| dir.join(file).exists()) && !dir.join("model.safetensors").exists() && !dir.join("model.safetensors.index.json").exists() => {
            return Err(format!(
                "--model {} is a run folder of this trainer, not a Hugging Face checkpoint: continue it with --resume {}, or fine-tune what \
                 its --save-hf folder holds",
                dir.display(),
                dir.display()
            ));
        }
        // As the weights make it (a tied head saved with values of its own loads untied).
        (Some(dir), _) => Some(ulysses_models::checkpoint_config(dir).map_err(|e| format!("--model: {e}"))?),
        (None, Some(file)) => Some(HfConfig::from_hf(file).map_err(|e| format!("--hf-config: {e}"))?),
        (None, None) => None,
    };
    // Positions up to the padded length: a batch is padded to a multiple of the SP degree (its
    // padding counts on from the last token where documents are not packed).
    let multiple = layout.sharder().length_multiple();
    // (Saturating: a --seq-len past any run is refused by name further on.)
    let padded_len = args.seq_len.div_ceil(multiple).saturating_mul(multiple);
    if let Some(represented) = pretrained.as_ref().and_then(|c| c.rope_scaling.positions_represented()).filter(|&n| padded_len > n) {
        let padded = if padded_len > args.seq_len { format!(" (padded to {padded_len}, a multiple of {multiple})") } else { String::new() };
        return Err(format!(
            "--seq-len {}{padded} is past the checkpoint's max_position_embeddings of {represented}, where its dynamic NTK RoPE (rope_type \
             \"dynamic\") changes its frequencies with each batch's longest position: train at --seq-len {} or below, or give config.json a \
             static scaling (rope_type \"yarn\" or \"linear\")",
            args.seq_len,
            represented / multiple * multiple
        ));
    }
    // YaRN stretches the original context by its factor (Qwen's guides keep
    // max_position_embeddings at the original). Whatever the data: --tokens and --corpus too.
    if let Some(checkpoint) = pretrained.as_ref().filter(|_| ulysses_trainer::train::says_run_notes()) {
        let reach = match checkpoint.rope_scaling {
            ulysses_models::rope::RopeScaling::Yarn { factor, original_max_position_embeddings, .. } => {
                checkpoint.max_position_embeddings.max((factor * original_max_position_embeddings) as usize)
            }
            _ => checkpoint.max_position_embeddings,
        };
        if args.seq_len > reach {
            tracing::warn!(
                "--seq-len {} is past the checkpoint's context of {reach} (config.json's max_position_embeddings, or YaRN's factor \
                 times its original context): positions beyond it were never trained",
                args.seq_len,
            );
        }
    }
    // The default rate trains the small model from scratch; at it a pretrained one forgets
    // what it knew within a few steps: a fine-tune's default is TRL's SFTTrainer's.
    if args.model.is_some() && args.resume.is_none() && !args.eval_only && !args.given.contains("learning_rate") {
        args.learning_rate = FINE_TUNE_LEARNING_RATE;
        if ulysses_trainer::train::says_run_notes() {
            tracing::info!(
                "--model without --learning-rate: fine-tuning at {FINE_TUNE_LEARNING_RATE:e}, TRL's SFTTrainer's default (the byte model's \
                 3e-3 would make a pretrained model forget what it knew); give --learning-rate for another"
            );
        }
    }
    let model = match &pretrained {
        Some(checkpoint) => ulysses_models::DecoderConfig::from_hf(checkpoint),
        None => ulysses_models::DecoderConfig::new(BYTE_VOCAB)
            .with_d_model(args.d_model)
            .with_n_layers(args.layers)
            .with_n_heads(args.heads)
            .with_n_kv_heads(args.kv_heads)
            .with_ffn_hidden(args.ffn_hidden),
    }
    .with_repeat_kv(false);
    let vocab = model.vocab_size;
    if args.tokens.is_none() && args.data.is_none() && vocab < BYTE_VOCAB {
        return Err(format!(
            "--hf-config: the vocabulary has {vocab} ids, fewer than the {BYTE_VOCAB} byte values of --corpus: give --tokens (ids below {vocab})"
        ));
    }
    // --pack's documents are byte text's paragraphs (ends at "\n\n", two ids 10): in a
    // tokenizer's ids 10 is some other token, and the cuts would fall anywhere.
    if args.pack && args.tokens.is_some() && pretrained.is_some() {
        return Err(
            "--pack cuts byte text at its blank lines, and --tokens holds ids of the checkpoint's tokenizer, not bytes: give the \
             documents as --data lines of {\"input_ids\": [...]}, each packed whole as a document of its own"
                .into(),
        );
    }
    let mut config = TrainConfig::small(layout)
        .with_grad_accumulation(args.grad_accumulation)
        .with_batch_size(args.batch_size)
        .with_seq_len(args.seq_len)
        .with_steps(args.steps)
        .with_learning_rate(args.learning_rate)
        .with_eval_single_device(args.eval_single_device)
        .with_eval_every(args.eval_every)
        .with_check_parameters_every(args.check_parameters_every)
        .with_seed(args.seed)
        .with_max_grad_norm((args.max_grad_norm > 0.0).then_some(args.max_grad_norm))
        .with_pack(args.pack || args.data.is_some())
        .with_freeze_embeddings(args.freeze_embeddings)
        .with_layer_checkpointing(args.checkpoint_layers.then(|| {
            LayerCheckpointing::new().with_offload_to_host(args.offload_to_host).with_offload_layers(args.offload_layers).with_tile_tokens(args.tile_tokens)
        }))
        .with_precision(precision_of(&args))
        .with_f32_head(args.f32_head)
        .with_offload_optimizer(args.offload_optimizer)
        .with_zero_stage(args.zero)
        .with_offload_parameters(args.offload_parameters)
        .with_optimizer_in_backward(args.optimizer_in_backward);
    config.model = model;
    config.optimizer = AdamWConfig::new()
        .with_weight_decay(args.weight_decay)
        .with_beta_1(args.adam_beta1)
        .with_beta_2(args.adam_beta2)
        .with_epsilon(args.adam_epsilon);
    config.warmup_steps = args.warmup_steps.unwrap_or(default_warmup(args.steps));
    config.lr_schedule = args.lr_schedule;
    config.min_lr_ratio = args.min_lr_ratio;
    // --eval-only evaluates whole batches round the DP replicas, one micro-batch each: its
    // batch need not divide over them.
    if args.eval_only && !(1..=MAX_BATCH_SIZE).contains(&config.batch_size) {
        return Err(format!("batch_size (--batch-size) must be from 1 to {} with --eval-only (sequences a held-out batch), got {}", MAX_BATCH_SIZE, config.batch_size));
    }
    // A resume keeps its batch (check_resumable): where it does not divide, the world or the
    // accumulation is what can change (validate would offer other batch sizes).
    if let Some(saved) = resumed.as_ref().filter(|saved| !args.eval_only && saved.config.batch_size == config.batch_size)
        && let Some(parts) = config.layout.dp_size.checked_mul(config.grad_accumulation).filter(|&parts| parts != 0 && config.batch_size % parts != 0)
    {
        return Err(format!(
            "the checkpoint's --batch-size {} does not divide over dp_size {} × grad_accumulation {} = {parts}, and a resume keeps its \
             batch: launch a world whose DP degree × --grad-accumulation divides {}",
            saved.config.batch_size, config.layout.dp_size, config.grad_accumulation, saved.config.batch_size
        ));
    }
    match args.eval_only {
        true => evaluation_settings(&config).validate()?,
        false => config.validate()?,
    }
    // What the CPU backend cannot run, refused here (so `--check` refuses it too).
    if args.backend == BackendKind::Cpu {
        if args.transport == TransportKind::Nccl {
            return Err("--transport nccl needs a CUDA backend (--backend cuda)".into());
        }
        if config.precision != Precision::F32 {
            return Err(format!(
                "--precision {}{}: the CPU backend (NdArray) computes neither bf16 nor f16: train in f32 (--precision f32), or on a GPU \
                 (--backend cuda)",
                format!("{:?}", config.precision).to_lowercase(),
                if args.precision.is_some() && !args.given.contains("precision") { " (the checkpoint's)" } else { "" }
            ));
        }
    }
    // And what the compile-only backend cannot: it needs no GPU, so no NCCL, and writes the
    // kernels of one process, whose ranks are threads.
    if args.backend == BackendKind::CudaCompileOnly {
        if args.transport == TransportKind::Nccl {
            return Err("--transport nccl needs a GPU: --backend cuda-compile-only runs without one".into());
        }
        if !matches!(launch, Launch::Threads) {
            return Err("--backend cuda-compile-only runs its ranks as threads of one process: add --launch threads (and start it without a launcher)".into());
        }
    }
    // An export the run cannot write as asked, before the model and the data are read (minutes
    // for 8B; `train_rank` would refuse it there): a sharded optimizer's half-precision compute
    // copy is what a --save-hf holds.
    if let (Some(asked), Some(_), false) = (args.save_hf_dtype, &args.save_hf, args.eval_only) {
        let compute_copy = (config.shards_optimizer() && config.precision != Precision::F32).then_some(burn::tensor::FloatDType::BF16);
        ulysses_trainer::train::save_hf_dtype(Some(asked.into()), asked.into(), compute_copy)?;
    }
    // A backend this binary lacks, before the data is read (minutes for a large --data): --check
    // goes on, saying which feature gives it (a GPU run's settings checked on a CPU build).
    if let (Some(feature), false) = (backend_feature_missing(args.backend), args.check) {
        let name = args.backend.to_possible_value().map_or_else(String::new, |value| value.get_name().to_string());
        return Err(format!("--backend {name}: this binary was built without it: rebuild with `--features {feature}`"));
    }
    if !(args.max_grad_norm >= 0.0 && args.max_grad_norm.is_finite()) {
        return Err(format!("--max-grad-norm {} must be a finite number, 0 or above (0: no clipping)", args.max_grad_norm));
    }
    if let Some(stop) = args.stop_after.filter(|&s| s == 0 || s > args.steps) {
        return Err(format!("--stop-after {stop} must lie in 1..=--steps {}", args.steps));
    }

    let is_first = ulysses_trainer::train::says_run_notes();
    if is_first {
        for note in ignored_flags(&args, &config, matches!(launch, Launch::Threads)) {
            tracing::warn!("{note}");
        }
    }
    // What needs no data, refused before it is read (minutes for a large --data): the
    // environment's settings, a run folder this run may not write, a resume's settings.
    let dist = DistributedConfig::new().with_env_overrides().map_err(|e| e.to_string())?;
    if is_first && !args.eval_only {
        RunFolder::check(&out, Claim::of(&out, args.resume.as_deref(), args.overwrite))?;
    }
    if let (Some(state), false) = (&resumed, args.eval_only) {
        check_resumable(&config, state)?;
        if let Some(stop) = args.stop_after.filter(|&stop| stop <= state.completed_steps) {
            return Err(format!("--stop-after {stop}: the checkpoint has already taken {} steps; stop after a later step", state.completed_steps));
        }
    }
    let mut eval_sequences = None;
    // The chat template --data's conversations were rendered with (file, rendering text).
    let mut chat_rendered = None;
    // The token that ends each --data document, as resolved, and what tokenized them.
    let mut data_reading = None;
    // With --eval-every 0 nothing is evaluated: the data is trained whole, nothing held out
    // (other batches than a run that held a part out, so the data identity says which).
    let trained_whole = config.eval_every == 0 && !args.eval_only;
    let data: Box<dyn StepData> = match (&args.data, &args.tokens) {
        (Some(path), _) => {
            let (documents, eos, tokenizer);
            (documents, chat_rendered, eos, tokenizer) = packed_documents(&args, path, pretrained.as_ref().expect("--data needs a checkpoint (checked)"), &config, is_first)?;
            data_reading = Some((eos, tokenizer));
            eval_sequences = args.eval_only.then(|| {
                let (sequences, lengths) = documents.everything();
                (sequences, lengths, documents.every_target())
            });
            Box::new(documents)
        }
        (None, Some(path)) => Box::new(TokenFile::load(path, config.batch_size, config.seq_len, vocab, !trained_whole)?),
        (None, None) => {
            let held_out = if trained_whole { 0.0 } else { 0.1 };
            let corpus = ByteCorpus::load(&args.corpus, held_out)?;
            if !args.bytes_ok {
                corpus.check_text()?;
            }
            corpus.check_sequence_length(config.seq_len)?;
            Box::new(OwnedCorpus { corpus, config: config.clone() })
        }
    };
    // Evaluations of a held-out batch the data does not have would never run: the summary's
    // held-out loss would stay "-" without a word why.
    if !args.eval_only && config.eval_every > 0 && data.eval_batch().is_none() {
        // --eval-data goes with --data alone: other data holds out more for more sequences.
        let fix = if args.data.is_some() { "give --eval-data FILE to evaluate on" } else { "give it at least two batches' sequences" };
        let why = format!(
            "--eval-every {} evaluates nothing: {} holds no batch out (it makes fewer than two batches of --batch-size {}, or its last ones continue a document trained on); \
             {fix}, or --eval-every 0",
            config.eval_every,
            args.data.as_ref().or(args.tokens.as_ref()).unwrap_or(&args.corpus).display(),
            config.batch_size
        );
        if args.given.contains("eval_every") {
            return Err(why);
        }
        if is_first {
            tracing::warn!("{why}");
        }
    }
    let data_path = args.data.as_ref().or(args.tokens.as_ref()).unwrap_or(&args.corpus);
    let mut data_identity = if args.data.is_some() { DataIdentity::of_data(data_path)? } else { DataIdentity::of(data_path)? };
    if let Some((eos, tokenizer)) = data_reading {
        // What turns --data's bytes into tokens and targets, as used (the tokenizer; the EOS
        // resolved), besides the checkpoint's config.
        let (loss_on, too_long) = (format!("{:?}", args.loss_on).to_lowercase(), format!("{:?}", args.too_long).to_lowercase());
        // The reader's version: a reader that tokenizes otherwise makes other batches of the
        // same bytes (`DOCUMENT_READER_VERSION` says what changed at each).
        // With --eval-data or --eval-every 0, --data is trained whole (no batch held out):
        // other batches.
        let whole = match (args.eval_data.is_some(), trained_whole) {
            (true, _) => ", trained whole (--eval-data)",
            (false, true) => &format!(", {TRAINED_WHOLE}"),
            (false, false) => "",
        };
        data_identity = data_identity.read_with(format!("{tokenizer}, EOS {eos}, --loss-on {loss_on}, --too-long {too_long}, reader {DOCUMENT_READER_VERSION}{whole}"));
        if let Some((file, text)) = &chat_rendered {
            data_identity = data_identity.rendered_with(file, text);
        }
    }
    if args.data.is_none() && !args.eval_only {
        // --tokens and --corpus: whether the part held out is trained on too, other batches
        // than a run that held it out. (A checkpoint from before this was recorded has no
        // reading: its run held the part out, which `DataIdentity::differs_from` knows.)
        let held_out = match (trained_whole, args.tokens.is_some()) {
            (true, _) => TRAINED_WHOLE,
            (false, true) => "its last batch held out",
            (false, false) => "its last 10% held out",
        };
        data_identity = data_identity.read_with(held_out.to_string());
    }
    if let Some(held_out) = &args.eval_data {
        data_identity = data_identity.evaluated_on(held_out)?;
    }
    let options = JobOptions { device_index: args.device, ..JobOptions::new(layout, dist) };
    if let Some(sequences) = eval_sequences {
        if args.check {
            let work = format!("an evaluation of all {} sequences (up to {} tokens each)", sequences.0.len(), config.seq_len);
            println!("{}", checked_run(&args, &config, layout, data_path, work));
            return Ok(());
        }
        let out = PathBuf::new();
        let job = Job { args: &args, launch, config, pretrained, data, data_identity, out, resumed_at: None, options, eval_sequences: Some(sequences), _run_folder: None };
        return on_backend(&job);
    }
    let resumed_at = match resumed {
        None => None,
        Some(state) => {
            if let Some(note) = state.resume_notes().filter(|_| is_first) {
                tracing::warn!("{note}");
            }
            // Before the model loads (minutes for a large one); train_rank checks it again, for
            // the library's callers, and the next batch's digest too.
            if let Some(why) = state.data.as_ref().and_then(|saved| data_identity.differs_from(saved)).filter(|_| !args.allow_new_data) {
                return Err(why);
            }
            Some(state.completed_steps)
        }
    };
    if args.check {
        let adamw = ulysses_training::adamw_settings(&config.optimizer).map_err(|e| e.to_string())?;
        let work = format!(
            "{} steps of {} sequences × {} tokens, AdamW at {:e} (β {}, {}, ε {:e}, weight decay {}) after {} warm-up steps, then {}",
            config.steps,
            config.batch_size,
            config.seq_len,
            config.learning_rate,
            adamw.beta_1,
            adamw.beta_2,
            adamw.epsilon,
            adamw.weight_decay,
            config.warmup_steps,
            match config.lr_schedule {
                LrSchedule::Constant => "constant".to_string(),
                schedule => format!("{} to {} of it", format!("{schedule:?}").to_lowercase(), config.min_lr_ratio),
            },
        );
        println!("{}", checked_run(&args, &config, layout, data_path, work));
        println!("memory: {}", checked_memory(&config));
        if let Some(plan) = planned_memory(&args, &config, &launch)? {
            println!("{plan}");
        }
        return Ok(());
    }
    if is_first {
        tracing::info!(
            data = %data_path.display(),
            sp = layout.sp_size,
            dp = layout.dp_size,
            backend = ?args.backend,
            ranks = if matches!(launch, Launch::Threads) { "threads" } else { "processes" },
            "training a {}-layer Llama, {} q / {} kv heads, on {} ranks",
            config.model.n_layers,
            config.model.n_heads,
            config.model.n_kv_heads,
            layout.world_size(),
        );
    }
    // Before anything is written into the folder.
    let run_folder = if is_first {
        Some(RunFolder::claim(&out, Claim::of(&out, args.resume.as_deref(), args.overwrite))?)
    } else {
        None
    };
    // The checkpoint was read before the folder was claimed: a run still stopping in it may
    // have written a later one since, whose steps this run's metrics would then drop.
    if let (Some(location), Some(read_at)) = (args.resume.as_deref().filter(|_| is_first), resumed_at) {
        let now = read_checkpoint_state::<RunState>(location).map_err(|e| e.to_string())?.completed_steps;
        if now != read_at {
            return Err(format!(
                "--resume {}: the checkpoint moved from step {read_at} to step {now} while this run started (the run that wrote it was \
                 still stopping): resume again",
                location.display()
            ));
        }
    }
    let job = Job { args: &args, launch, config, pretrained, data, data_identity, out, resumed_at, options, eval_sequences: None, _run_folder: run_folder };
    on_backend(&job)
}

/// The files each --save-hf folder gets beside the model: the tokenizer's from the tokenizer
/// the run used (the --tokenizer file as tokenizer.json, the others from its folder), else the
/// --model folder's, and the --model folder's generation settings.
fn save_hf_companions(args: &Args) -> Vec<(PathBuf, String)> {
    companion_sources(args).into_iter().map(|(file, name, _)| (file, name)).collect()
}

/// [`save_hf_companions`] with the folder each was found in (`None`: the --tokenizer file
/// itself, as given).
fn companion_sources(args: &Args) -> Vec<(PathBuf, String, Option<&Path>)> {
    fn found<'a>(folder: &'a Path, name: &str) -> Option<(PathBuf, String, Option<&'a Path>)> {
        Some(folder.join(name)).filter(|file| file.is_file()).map(|file| (file, name.to_string(), Some(folder)))
    }
    COMPANION_FILES
        .iter()
        .filter_map(|&name| match (&args.tokenizer, is_tokenizer_file(name)) {
            (Some(file), true) if name == "tokenizer.json" => Some((file.clone(), name.to_string(), None)),
            (Some(file), true) => found(folder_of(file), name),
            _ => args.model.as_deref().and_then(|model| found(model, name)),
        })
        .collect()
}

/// Refuses a file --save-hf would copy beside the model whose links lead out of the folder it
/// is found in: a crafted or shared checkpoint folder's `merges.txt -> ~/.ssh/id_ed25519`
/// would put that file in the export (a user's to publish). A Hugging Face cache's snapshot
/// files are links to its `blobs/`, beside `snapshots/`: those are the folder's own.
fn check_companions_are_their_folders(args: &Args) -> Result<(), String> {
    for (file, _, folder) in companion_sources(args) {
        let Some(folder) = folder else { continue };
        let (Ok(target), Ok(folder)) = (file.canonicalize(), folder.canonicalize()) else { continue };
        // snapshots/REV/NAME -> ../../blobs/HASH: the cache entry (two folders up) holds both.
        let cache_entry = folder.parent().filter(|snapshots| snapshots.file_name().is_some_and(|n| n == "snapshots")).and_then(Path::parent);
        let in_blobs = |entry: &Path| target.parent().is_some_and(|blobs| blobs == entry.join("blobs"));
        if !target.starts_with(&folder) && !cache_entry.is_some_and(in_blobs) {
            return Err(format!(
                "--save-hf would copy {} beside the model, and it leads out of its folder {} (to {}): a link there would put that file in \
                 the export. Copy the file itself into the folder, or remove the link",
                file.display(),
                folder.display(),
                target.display()
            ));
        }
    }
    Ok(())
}

/// The folder that holds `file` (the working folder for a bare name).
fn folder_of(file: &Path) -> &Path {
    file.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

/// Refuses an --eval-data that --data reads too (the same file, or one inside its folder, or
/// the other way round): it would be trained on.
fn check_held_out_apart(data: &Path, held_out: &Path) -> Result<(), String> {
    let files = |flag, path| -> Result<Vec<PathBuf>, String> {
        Ok(ulysses_trainer::files::data_files(flag, path)?.0.iter().map(|file| file.canonicalize().unwrap_or_else(|_| file.clone())).collect())
    };
    // A set: folders of 100 000 shards each.
    let trained: std::collections::HashSet<PathBuf> = files("--data", data)?.into_iter().collect();
    match files("--eval-data", held_out)?.into_iter().find(|file| trained.contains(file)) {
        Some(shared) => Err(format!(
            "--eval-data {}: {} is read by --data {} too, so it would be trained on: a held-out set is one not trained on; keep its files apart",
            held_out.display(),
            shared.display(),
            data.display()
        )),
        None => Ok(()),
    }
}

/// The tokenizer that tokenizes --data's text, with the `tokenizer_config.json` beside it and
/// what the data's identity records of it (its file's bytes and how its class reads them).
fn data_tokenizer(args: &Args) -> Result<Option<(TextTokenizer, TokenizerConfig, String)>, String> {
    let Some(file) = data_tokenizer_file(args) else { return Ok(None) };
    let tokenizer = TextTokenizer::from_file(&file).map_err(|e| format!("--tokenizer: {e}"))?;
    let config = TokenizerConfig::read(folder_of(&file)).map_err(|e| format!("--tokenizer: {e}"))?;
    let identity = DataIdentity::tokenizer(&file, tokenizer.reading())?;
    Ok(Some((tokenizer, config, identity)))
}

/// The tokenizer.json that tokenizes --data's text: --tokenizer, else the --model folder's.
fn data_tokenizer_file(args: &Args) -> Option<PathBuf> {
    args.tokenizer.clone().or_else(|| args.model.as_ref().map(|dir| dir.join("tokenizer.json")).filter(|file| file.exists()))
}

/// Whether `path` is `folder` or lies under it, however spelt (`path` may not exist yet).
fn inside(path: &Path, folder: &Path) -> bool {
    matches!((resolved(path), resolved(folder)), (Ok(path), Ok(folder)) if path.starts_with(&folder))
}


/// The cargo feature that gives `backend`, where this binary was built without it.
fn backend_feature_missing(backend: BackendKind) -> Option<&'static str> {
    match backend {
        BackendKind::Cpu => None,
        BackendKind::Cuda | BackendKind::CudaFused => (!cfg!(feature = "cuda")).then_some("cuda"),
        BackendKind::CudaCompileOnly => (!cfg!(feature = "compile-only")).then_some("compile-only"),
    }
}

/// What `--check` says of a run whose settings and data passed every check before training.
/// `work`: what the run would do with the data ("6 steps of 8 sequences × 256 tokens").
fn checked_run(args: &Args, config: &TrainConfig, layout: ParallelLayout, data: &Path, work: String) -> String {
    let missing = backend_feature_missing(args.backend);
    let (built, feature) = (missing.is_none(), missing.unwrap_or(""));
    let model = &config.model;
    format!(
        "checked: {work} from {}, a {}-layer model (d_model {}, {} q / {} kv heads, vocabulary {}), \
         sp {} × dp {} (ring {}), {:?}, ZeRO stage {}{}{}{}{}, backend {:?}{}; nothing trained or written",
        data.display(),
        model.n_layers,
        model.d_model,
        model.n_heads,
        model.n_kv_heads,
        model.vocab_size,
        layout.sp_size,
        layout.dp_size,
        layout.ring_size,
        config.precision,
        config.zero_stage,
        if config.offload_optimizer { ", the optimizer on the host" } else { "" },
        if config.offload_parameters { ", the parameters on the host" } else { "" },
        if config.optimizer_in_backward { ", updated in the backward" } else { "" },
        match &config.layer_checkpointing {
            Some(c) if c.offload_to_host => match c.offload_layers {
                Some(n) => format!(", layers checkpointed, the first {n} layers' inputs on the host"),
                None => ", layers checkpointed, their inputs on the host".into(),
            },
            Some(_) => ", layers checkpointed".into(),
            None => String::new(),
        },
        args.backend,
        if built { String::new() } else { format!(" (this binary was built without it: rebuild with `--features {feature}` to run it)") },
    )
}

/// What `--check` says of a rank's memory ([`memory::describe`]), the parameters counted on
/// a model whose tensors are not built, the layers' floats of the precision's size.
fn checked_memory(config: &TrainConfig) -> String {
    let (parameters, compute_bytes) = counted_parameters(config);
    memory_estimate(config, parameters, compute_bytes)
}

/// What `--device-memory` (and `--host-memory`) ask of `--check`: whether the run fits such
/// machines, where its layer inputs must go for it to, and the longest `--seq-len` that fits
/// (`memory::fitting_place`, `memory::longest_fitting`); `None` without `--device-memory`.
fn planned_memory(args: &Args, config: &TrainConfig, launch: &Launch) -> Result<Option<String>, String> {
    let Some(device_gb) = args.device_memory else { return Ok(None) };
    let bytes = |gb: f64, flag: &str| {
        if gb.is_finite() && gb > 0.0 { Ok((gb * 1e9) as u64) } else { Err(format!("{flag} {gb}: give the memory in GB, a number above 0")) }
    };
    if config.layer_checkpointing.is_none() {
        return Err("--device-memory: a step's peak is estimated for checkpointed layers alone: add --checkpoint-layers".into());
    }
    // Ranks that are threads of this process share its one GPU: each plans with its share.
    let sharing = match launch {
        Launch::Threads if args.backend != BackendKind::Cpu => config.layout.world_size() as u64,
        _ => 1,
    };
    let device_total = bytes(device_gb, "--device-memory")?;
    let machine = memory::Machine {
        device_bytes: device_total / sharing,
        host_bytes: args.host_memory.map(|gb| bytes(gb, "--host-memory")).transpose()?,
        ranks_per_host: match launch {
            Launch::Threads => config.layout.world_size(),
            Launch::Process(env) => env.local_world_size,
        } as u64,
    };
    let (parameters, compute_bytes) = counted_parameters(config);
    let gb = |bytes: u64| format!("{:.2} GB", bytes as f64 / 1e9);
    let host = match machine.host_bytes {
        Some(limit) => format!(" and a host of {} ({} rank(s) on it)", gb(limit), machine.ranks_per_host),
        None => String::new(),
    };
    let device = match sharing {
        1 => gb(device_total),
        ranks => format!(
            "{} shared by its {ranks} ranks, threads of one process ({} each; for a GPU a rank, --check under the launcher that \
             starts them: ulysses-launch --nproc-per-node {ranks} -- ulysses-trainer ... --check)",
            gb(device_total),
            gb(machine.device_bytes)
        ),
    };
    let machines = format!("a device of {device}{host}");
    let (device, host_needed) = memory::needs(config, parameters, compute_bytes, machine.ranks_per_host).expect("checkpointed");
    let this_run = if machine.holds(device, host_needed) {
        format!("this run fits {machines}: {} on the device, {} on the host", gb(device), gb(host_needed))
    } else {
        match memory::fitting_place(config, parameters, compute_bytes, &machine) {
            Some((at, placed_device, placed_host)) => format!(
                "this run fits {machines} with {} ({} on the device, {} on the host); as given it needs {} and {}",
                at.flags(),
                gb(placed_device),
                gb(placed_host),
                gb(device),
                gb(host_needed)
            ),
            None => format!("this run does not fit {machines} wherever its layer inputs are: it needs {} on the device and {} on the host", gb(device), gb(host_needed)),
        }
    };
    // World rank 0 evaluating whole sequences alone needs more than a step where sp > 2; no
    // place of the layer inputs changes that.
    let this_run = match memory::single_device_evaluation(config, parameters, compute_bytes).filter(|&bytes| bytes > machine.device_bytes) {
        Some(bytes) => format!(
            "{this_run}; and --eval-single-device has world rank 0 evaluate whole sequences alone, {} on its device, more than \
             it holds: without the flag the SP group evaluates, each rank its shard",
            gb(bytes)
        ),
        None => this_run,
    };
    // In steps of a rank's 1024 tokens, up to 64M tokens.
    let step = 1024 * config.layout.sp_size;
    let longest_of = |config: &TrainConfig| memory::longest_fitting(config, parameters, compute_bytes, &machine, step, 1 << 26);
    let longest_as_given = longest_of(config);
    let mut longest = match longest_as_given {
        Some((tokens, at)) => format!("the longest --seq-len that fits (in steps of {step}): {tokens}, with {}", at.flags()),
        None => format!("not even {step} tokens a sequence fit"),
    };
    // Where the host's share of the gradient parts is what limits it.
    if config.zero_stage == 3 && config.offload_optimizer && !config.optimizer_in_backward {
        let in_backward = config.clone().with_optimizer_in_backward(true).with_max_grad_norm(None).with_grad_accumulation(1);
        if let Some((tokens, at)) = longest_of(&in_backward).filter(|(tokens, _)| longest_as_given.is_none_or(|(before, _)| *tokens > before)) {
            longest += &format!(
                "; {tokens} with --optimizer-in-backward (no gradient part waits on the host for the step's end; it needs --max-grad-norm 0 and --grad-accumulation 1) and {}",
                at.flags()
            );
        }
    }
    Ok(Some(format!(
        "plan: {this_run}; {longest} (the estimate counts tensors, not what the backend's pools reserve beyond them: leave a margin)"
    )))
}

/// A model's parameters, counted on tensors not built, and its layers' float size.
fn counted_parameters(config: &TrainConfig) -> (u64, u64) {
    type Counted = burn::backend::NdArray<f32>;
    let parameters = ulysses_training::parameter_elements(&config.model.init::<Counted>(&Default::default())).iter().sum::<usize>() as u64;
    (parameters, memory::compute_bytes(config))
}

/// A rank's memory ([`memory::describe`]) for a model of `parameters` whose layers compute in
/// `compute_bytes`-byte floats.
fn memory_estimate(config: &TrainConfig, parameters: u64, compute_bytes: u64) -> String {
    memory::describe(config, parameters, compute_bytes, memory::offloaded_host_bytes(config, compute_bytes))
}

/// The chat template of --data's {"messages"} lines: the tokenizer's, as in transformers (the
/// one beside --tokenizer where it is given, else the --model folder's), from the folder
/// whose tokenizer files --save-hf copies, so a saved model renders as it was trained; given
/// `tokenizer`'s special tokens, as transformers gives them.
/// --chat-template, where given, in its place.
fn data_chat_template(args: &Args, tokenizer: Option<&TextTokenizer>) -> Result<Option<ChatTemplate>, String> {
    let folder = match (&args.tokenizer, &args.model) {
        (Some(file), _) => Some(folder_of(file)),
        (None, Some(model)) => Some(model.as_path()),
        (None, None) => None,
    };
    if let Some(file) = &args.chat_template {
        return ChatTemplate::from_file_for(file, folder, tokenizer).map(Some).map_err(|e| format!("--chat-template: {e}"));
    }
    let Some(folder) = folder else { return Ok(None) };
    ChatTemplate::from_checkpoint_for(folder, tokenizer).map_err(|e| format!("--data's chat template: {e}"))
}

/// Reads --data and packs it, with the checkpoint's tokenizer, EOS and vocabulary; and the
/// chat template's file and rendering text where it rendered a conversation, the EOS, and what
/// tokenized the documents (for the data's identity).
fn packed_documents(args: &Args, path: &Path, checkpoint: &HfConfig, config: &TrainConfig, show_progress: bool) -> Result<(PackedDocuments, Option<(String, String)>, u32, String), String> {
    let tokenizer = data_tokenizer(args)?;
    // Another model's tokenizer would train on ids that mean other words here. One with more
    // tokens than the model embeds is said: another model's, or added tokens the embeddings
    // lack (a `<pad>` past the vocabulary, harmless where the data never yields it: each id a
    // document yields is checked against the vocabulary as it is read).
    // Said once a job (each launched process reads the data): by the one that shows progress.
    if let Some((tokenizer, _, _)) = tokenizer.as_ref().filter(|_| show_progress) {
        if tokenizer.vocab_size() > config.model.vocab_size {
            tracing::warn!(
                "--tokenizer {}: it has {} tokens, more than the model's vocabulary of {} (config.json's vocab_size): another model's \
                 tokenizer, or added tokens without embeddings; a document that yields an id past the vocabulary is refused",
                data_tokenizer_file(args).map(|file| file.display().to_string()).unwrap_or_default(),
                tokenizer.vocab_size(),
                config.model.vocab_size
            );
        }
    }
    let (eos, note) = document_eos(args.eos_token_id, tokenizer.as_ref().map(|(t, c, _)| (t, c)), checkpoint.eos_token_id)?;
    if eos as usize >= config.model.vocab_size {
        let from = if args.eos_token_id.is_some() { "--eos-token-id" } else { "the EOS" };
        return Err(format!("{from} {eos} is outside the model's vocabulary 0..{}: give the id of its end-of-text token", config.model.vocab_size));
    }
    if let Some(note) = note.filter(|_| show_progress) {
        tracing::info!("{note}");
    }
    let (tokenizer, tokenized_by) = match tokenizer {
        Some((tokenizer, _, identity)) => (Some(tokenizer), identity),
        None => (None, "no tokenizer".into()),
    };
    let chat = data_chat_template(args, tokenizer.as_ref())?;
    let loss_on = args.loss_on;
    let reader = || DocumentReader {
        tokenizer: tokenizer.as_ref(),
        eos,
        vocab: config.model.vocab_size,
        progress: show_progress,
        chat: chat.as_ref(),
        loss_on,
        refuse_longer_than: (args.too_long == TooLong::Refuse).then_some(config.seq_len),
        truncate_longer_than: (args.too_long == TooLong::Truncate).then_some(config.seq_len),
        noted: Default::default(),
    };
    // All that decides the tokens besides --data's files, for the tokenized data's cache: its
    // files' identities and times are the rest. The tokenizer's files whole (the flags of its
    // added tokens, the files beside it), and this program (its tokenizing libraries).
    let stamp = |file: &Path| fs::metadata(file).map_or(0, |m| ulysses_trainer::token_cache::modified_nanos(&m));
    let tokenizer_files: Vec<PathBuf> = data_tokenizer_file(args).map_or_else(Vec::new, |file| {
        let folder = if file.is_dir() { file.clone() } else { folder_of(&file).to_path_buf() };
        let beside = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "config.json"].map(|name| folder.join(name));
        std::iter::once(file).filter(|file| file.is_file()).chain(beside).collect()
    });
    let program = std::env::current_exe().ok().and_then(|exe| fs::metadata(&exe).ok().map(|m| format!("{} ({} bytes, modified {})", exe.display(), m.len(), stamp(&exe))));
    let reading = format!(
        "reader {DOCUMENT_READER_VERSION} of {} {}, {tokenized_by} [{}], EOS {eos}, vocabulary {}, --loss-on {:?}, --too-long {:?}{}, chat template {}",
        env!("CARGO_PKG_VERSION"),
        program.unwrap_or_default(),
        ulysses_trainer::token_cache::stamps(&tokenizer_files),
        config.model.vocab_size,
        loss_on,
        args.too_long,
        if args.too_long == TooLong::Cut { String::new() } else { format!(" at --seq-len {}", config.seq_len) },
        chat.as_ref().map_or_else(
            || "none".to_string(),
            |chat| format!("{} (modified {}, digest {:016x})", chat.file(), stamp(Path::new(chat.file())), ulysses_training::checkpoint::fnv1a(&[chat.rendering_text().as_bytes()]))
        ),
    );
    let cache = CacheFolder::from_flag(args.data_cache.as_deref());
    let read = |flag: &str, path: &Path| read_through(&cache, flag, path, &reading, || reader().read_as(flag, path));
    let documents = read("--data", path)?;
    // The template's file and what decides its rendering, where it rendered a conversation.
    let rendered_with = chat.as_ref().filter(|_| documents.rendered_chat).map(|chat| (chat.file().to_string(), chat.rendering_text().to_string()));
    let targets = answers(&documents, loss_on, "--data", path)?;
    if let Some(targets) = targets.as_ref().filter(|_| show_progress) {
        let (trained, total) = (targets.iter().flatten().filter(|&&t| t).count(), targets.iter().map(Vec::len).sum::<usize>());
        tracing::info!("training on the {}: {trained} of {total} tokens are targets (--loss-on all: every token)", if loss_on == LossOn::Assistant { "answers alone" } else { "completions and labels" });
    }
    // Evaluating takes every sequence, however few.
    let batch_size = if args.eval_only { 1 } else { config.batch_size };
    // Nothing held out where nothing would evaluate it (--eval-every 0) or --eval-data does.
    let hold_out = !args.eval_only && args.eval_data.is_none() && config.eval_every > 0;
    // Said once, by the rank that shows progress; the others need not count.
    let note_cuts = |documents: &Documents, targets, flag: &str, evaluated: bool| {
        if let Some(note) = show_progress.then(|| cut_documents_note(&documents.ids, targets, config.seq_len, flag, evaluated)).flatten() {
            tracing::warn!("{note}");
        }
    };
    note_cuts(&documents, targets, "--data", args.eval_only);
    let mut packed = PackedDocuments::pack_with_targets(&documents.ids, targets, config.seq_len, batch_size, config.seed, hold_out)?;
    if let Some(held_out) = &args.eval_data {
        let documents = read("--eval-data", held_out)?;
        let targets = answers(&documents, loss_on, "--eval-data", held_out)?;
        note_cuts(&documents, targets, "--eval-data", true);
        packed = packed.held_out_by(PackedDocuments::pack_with_targets(&documents.ids, targets, config.seq_len, 1, config.seed, false)?);
    }
    if !args.eval_only && show_progress {
        // How often the run goes over its data: a small SFT set at the default 300 steps is
        // hundreds of epochs.
        let epochs = (config.steps * config.batch_size) as f64 / packed.train_count() as f64;
        tracing::info!("{} step(s) of {} sequence(s) go over the {} training sequence(s) {epochs:.2} time(s) (epochs)", config.steps, config.batch_size, packed.train_count());
    }
    Ok((packed, rendered_with, eos, tokenized_by))
}

/// The targets of `documents`, read from `path` by `flag`, where the data marks some and the
/// run trains on them (`loss_on` other than all); refused where none is a target.
fn answers<'a>(documents: &'a Documents, loss_on: LossOn, flag: &str, path: &Path) -> Result<Option<&'a [Vec<bool>]>, String> {
    let Some(targets) = documents.targets.as_deref().filter(|_| loss_on != LossOn::All) else { return Ok(None) };
    // A document's first token is never a label (no token of its own comes before it).
    if !targets.iter().any(|document| document.iter().skip(1).any(|&t| t)) {
        return Err(format!(
            "{flag} {}: no token is an answer (no assistant turn, completion or label), so the loss on the answers alone would be 0 \
             and nothing would train or be measured: give conversations with answers, or take every token with --loss-on all",
            path.display()
        ));
    }
    Ok(Some(targets))
}

/// Runs the job on the --backend.
fn on_backend(job: &Job) -> Result<(), String> {
    let args = job.args;
    match args.backend {
        BackendKind::Cpu => train::<burn::backend::NdArray, Tcp>(job, |_| Default::default()),
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => {
            type Cuda = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
            cuda::train_on::<Cuda>(job)
        }
        #[cfg(feature = "cuda")]
        BackendKind::CudaFused => {
            type Cuda = burn_fusion::Fusion<burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>>;
            cuda::train_on::<Cuda>(job)
        }
        #[cfg(not(feature = "cuda"))]
        BackendKind::Cuda | BackendKind::CudaFused => Err("this binary was built without CUDA: rebuild with `--features cuda`".into()),
        #[cfg(feature = "compile-only")]
        BackendKind::CudaCompileOnly => {
            // `--backend cuda`'s types, on the H100 target (an H200 has its SMs and limits).
            type CompileOnly = burn_cubecl::CubeBackend<ulysses_cuda_check::runtime::CompileOnly, f32, i32, u8>;
            // One process writes OUT/cuda-sources (`run` refused a launch of processes).
            debug_assert!(matches!(job.launch, Launch::Threads));
            ulysses_cuda_check::runtime::keep_autotune_apart(&job.out.join("autotune-timed-on-nothing"))?;
            ulysses_cuda_check::runtime::take_compiled();
            train::<CompileOnly, Tcp>(job, |_| ulysses_cuda_check::runtime::TargetDevice(0))?;
            let written = ulysses_cuda_check::write_launched(&job.out.join("cuda-sources"))?;
            tracing::info!("{written}");
            Ok(())
        }
        #[cfg(not(feature = "compile-only"))]
        BackendKind::CudaCompileOnly => Err("this binary was built without the compile-only runtime: rebuild with `--features compile-only`".into()),
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use cubecl::cuda::CudaDevice;

    /// CUDA ranks: NCCL between processes unless `--transport tcp`.
    pub fn train_on<W>(job: &Job) -> Result<(), String>
    where
        W: PlainBackend<Device = CudaDevice>,
        ulysses_nccl::Nccl: Transport<W>,
    {
        // Without a driver or with a device index out of range, CubeCL would fail on its
        // device thread and leave this one a closed channel to report.
        ulysses_nccl::check_cuda_device(job.options.device_index_of(&job.launch)).map_err(|e| format!("the CUDA backend cannot start: {e}"))?;
        // Tuning makes the first steps slow: say so, and where the choices are kept.
        ulysses_nccl::autotune::AutotuneCache::of_this_run().announce();
        ulysses_nccl::memory_pools::configure_from_env()?;
        let device = |index| CudaDevice::new(index);
        match job.args.transport {
            TransportKind::Tcp => train::<W, Tcp>(job, device),
            TransportKind::Auto | TransportKind::Nccl => train::<W, ulysses_nccl::Nccl>(job, device),
        }
    }
}

/// A corpus and the config that draws its batches.
struct OwnedCorpus {
    corpus: ByteCorpus,
    config: TrainConfig,
}

impl StepData for OwnedCorpus {
    fn train_batch(&self, step: usize) -> Vec<Vec<i64>> {
        CorpusData { corpus: &self.corpus, config: &self.config }.train_batch(step)
    }

    fn eval_batch(&self) -> Option<Vec<Vec<i64>>> {
        CorpusData { corpus: &self.corpus, config: &self.config }.eval_batch()
    }
}

/// The initial model each of this process's ranks starts from: the last rank to ask takes it
/// rather than a clone, so no copy outlives the ranks' own (an 8B model's f32 parameters are
/// 32 GB of the device, which the rank's bf16 compute copy under --offload-optimizer replaces).
struct Template<M> {
    model: std::sync::Mutex<Option<M>>,
    ranks_left: std::sync::atomic::AtomicUsize,
}

impl<M: Clone> Template<M> {
    fn new(model: M, ranks: usize) -> Self {
        Self { model: std::sync::Mutex::new(Some(model)), ranks_left: ranks.into() }
    }

    fn take_or_clone(&self) -> M {
        let mut model = self.model.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let last = self.ranks_left.fetch_sub(1, std::sync::atomic::Ordering::SeqCst) <= 1;
        if last { model.take() } else { model.clone() }.expect("every rank of this process asks for the initial model once")
    }
}

/// Refuses, before the model is built, a host without the memory this process's `ranks_here`
/// ranks keep there: the optimizer's state and gradient parts (`--offload-optimizer`; under
/// `--offload-parameters` the compute copy's parts are its master weights), the layer inputs
/// `--offload-to-host` keeps, and on the CPU backend (`on_cpu`) what the devices keep
/// ([`memory::device_state_bytes`]; the parameters alone when `evaluating`). `elements`: each
/// parameter's, counted on a model not yet built ([`ulysses_training::parameter_elements`]).
fn check_host_memory(config: &TrainConfig, elements: &[usize], ranks_here: usize, on_cpu: bool, evaluating: bool, compute_bytes: u64, snapshot_bytes: u64) -> Result<(), String> {
    let parameters = elements.iter().sum::<usize>() as u64;
    let ranks = ranks_here as u64;
    let offloaded = if evaluating { 0 } else { memory::offloaded_host_bytes(config, compute_bytes) * ranks };
    let device_bytes_a_rank = match (on_cpu, evaluating) {
        (false, _) => 0,
        (true, true) => 4 * parameters,
        (true, false) => memory::device_state_bytes(config, parameters, compute_bytes),
    };
    let device_bytes = device_bytes_a_rank * ranks;
    let devices_what = "the ranks' devices keep in host memory (the CPU backend)";
    let offloaded_what = "of layer inputs --offload-to-host keeps there";
    if config.offload_optimizer && !evaluating {
        // With --offload-parameters the compute copy's parts on the host are the optimizer's
        // master weights (cast for each upload: ShardedParameters::share_master_weights), so
        // they add nothing.
        let parameter_bytes = 0;
        let in_flight = memory::in_backward_bytes(config) * ranks;
        let beside = [
            (device_bytes, devices_what),
            (offloaded, offloaded_what),
            (in_flight, "of gradient parts and new parts on their way through the update in the backward"),
            (snapshot_bytes, SNAPSHOT_WHAT),
        ];
        let gradient_bytes = if config.optimizer_in_backward { 0 } else { 4 };
        return ulysses_training::ShardedAdamW::check_host_memory(elements, config.layout.world_size(), ranks_here, parameter_bytes, gradient_bytes, &beside)
            .map_err(|e| format!("--offload-optimizer: {e}"));
    }
    let gb = |bytes: u64| format!("{:.2} GB", bytes as f64 / 1e9);
    let mut what = Vec::new();
    let mut fix = Vec::new();
    if device_bytes > 0 {
        what.push(format!("what the ranks' devices keep (the CPU backend's memory is the host's: {parameters} parameters, {} a rank)", gb(device_bytes_a_rank)));
        fix.push("train a smaller model, or spread the ranks over more hosts with --zero 3 (each keeps 1/world of the state), or train on a GPU (--backend cuda)");
    }
    if offloaded > 0 {
        what.push(format!("the layer inputs --offload-to-host keeps there ({})", gb(offloaded)));
        fix.push("spread the ranks over more nodes, cut each micro-batch (more --grad-accumulation), or keep the layer inputs on the device (without --offload-to-host)");
    }
    if snapshot_bytes > 0 {
        what.push(format!("the {} {SNAPSHOT_WHAT}", gb(snapshot_bytes)));
        fix.push("export with --zero 3 (gathered a shard at a time), or without --save-hf (convert model.mpk later)");
    }
    let what = format!("{}, for {ranks_here} rank(s) on this host,", what.join(" and "));
    ulysses_core::host_memory::check_fits(device_bytes + offloaded + snapshot_bytes, ulysses_core::host_memory::available_bytes(), &what, &fix.join("; "))
}

/// What [`snapshot_bytes`] counts, in a host memory check's words.
const SNAPSHOT_WHAT: &str = "of the --save-hf snapshot world rank 0 takes at each checkpoint (the model in the saved dtype, written beside the training; one shard twice as it is taken)";

/// Host memory a replicated `--save-hf` snapshot takes on world rank 0's host
/// (`HfCheckpointSnapshot`: the model in the dtype it is saved in, and one shard of it twice
/// while it is taken); 0 where this host writes none (another rank's, ZeRO-3's gathered
/// export, no --save-hf).
fn snapshot_bytes(job: &Job, parameters: u64, compute_dtype: burn::tensor::FloatDType, writes_here: bool) -> u64 {
    let config = &job.config;
    let (Some(_), Some(checkpoint), true) = (&job.args.save_hf, &job.pretrained, writes_here && config.zero_stage != 3 && job.eval_sequences.is_none()) else { return 0 };
    let own = checkpoint.saved_dtype();
    let copy = (config.shards_optimizer() && compute_dtype != burn::tensor::FloatDType::F32).then_some(compute_dtype);
    let dtype = ulysses_trainer::train::save_hf_dtype(job.args.save_hf_dtype.map(Into::into), own, copy).unwrap_or(own);
    let model = parameters * dtype.size() as u64;
    model + model.min(ulysses_models::DEFAULT_MAX_SHARD_BYTES)
}

/// Runs this process's ranks (all of them as threads, or its one rank) on `UlyssesBackend`
/// over `W`, joining other processes through `T`.
fn train<W, T>(job: &Job, device: impl Fn(usize) -> W::Device + Sync) -> Result<(), String>
where
    W: PlainBackend,
    T: Transport<W>,
{
    type Sp<W> = UlyssesBackend<Autodiff<W>>;
    let config = &job.config;
    // Seeded parameters, initialised here once (fork forces burn's lazy initialisation), so
    // that runs repeat; each rank forks its own copy, with its own autodiff leaves.
    let template_device = device(job.options.device_index_of(&job.launch));
    let threads = matches!(job.launch, Launch::Threads);
    let ranks_here = match &job.launch {
        Launch::Threads => config.layout.world_size(),
        Launch::Process(env) => env.local_world_size,
    };
    // Measured on a model whose parameters are not built yet (burn builds them lazily), so a
    // model the host cannot hold is refused before it fills the memory.
    let elements = ulysses_training::parameter_elements(&config.model.init::<Sp<W>>(&template_device));
    let on_cpu = matches!(job.args.backend, BackendKind::Cpu);
    let compute_dtype = config.precision.compute_dtype::<Sp<W>>(&template_device).map_err(|e| e.to_string())?;
    if job.eval_sequences.is_none() {
        ulysses_trainer::train::refuse_f16_training(compute_dtype, &template_device).map_err(|e| e.to_string())?;
    }
    let compute_bytes = burn::tensor::DType::from(compute_dtype).size() as u64;
    let parameters = elements.iter().sum::<usize>() as u64;
    let world_rank_0_here = threads || matches!(&job.launch, Launch::Process(env) if env.rank == 0);
    let snapshot = snapshot_bytes(job, parameters, compute_dtype, world_rank_0_here);
    check_host_memory(config, &elements, ranks_here, on_cpu, job.eval_sequences.is_some(), compute_bytes, snapshot)?;
    if job.eval_sequences.is_none() && (threads || matches!(&job.launch, Launch::Process(env) if env.rank == 0)) {
        tracing::info!("memory: {}", memory_estimate(config, parameters, compute_bytes));
    }
    let estimated_peak = memory::estimated_peak(config, parameters, compute_bytes);
    <Sp<W> as Backend>::seed(&template_device, config.seed);
    // ZeRO-3 builds no whole model (ShardedParameters::shard_from): the parameters stay lazy,
    // and world rank 0 builds each in the order fork would (the same values), or reads it from
    // --model's files, as the ranks take their parts; a resumed run's ranks take them from the
    // master weights. Every process of a run from the start checks --model's files (names,
    // shapes, sizes), so a checkpoint that does not fit fails by name on each. A resumed run
    // reads no weight of --model whatever the stage: the checkpoint replaces every parameter
    // (its model record, or its master weights), and an 8B model's files take minutes to read.
    let lazy = config.zero_stage == 3 && job.eval_sequences.is_none();
    let resumed_training = job.args.resume.is_some() && job.eval_sequences.is_none();
    let template = match &job.args.model {
        Some(dir) if !resumed_training => {
            let loaded = if lazy { from_pretrained_lazily::<Sp<W>>(dir, &template_device) } else { from_pretrained::<Sp<W>>(dir, &template_device) };
            loaded.map_err(|e| format!("--model: {e}"))?.model.with_repeat_kv(config.model.repeat_kv)
        }
        Some(dir) => {
            if world_rank_0_here {
                tracing::info!("resuming: the model's weights are the checkpoint's; those of --model {} are not loaded", dir.display());
            }
            config.model.init::<Sp<W>>(&template_device)
        }
        None => config.model.init::<Sp<W>>(&template_device),
    };
    let template = if lazy { template } else { template.fork(&template_device) };
    let cpus_of_its_own = match &job.launch {
        Launch::Threads => None,
        Launch::Process(env) => env.cpus_of_its_own,
    };
    let host_optimizer_threads = ulysses_trainer::train::host_threads_per_rank(std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get), ranks_here, cpus_of_its_own);
    let template = Template::new(template, if threads { config.layout.world_size() } else { 1 });

    let results = run_ranks::<W, T, _>(&job.launch, &job.options, device, |rank| said_before_leaving(threads, (|| -> Result<(), String> {
        if let Some((sequences, documents, targets)) = &job.eval_sequences {
            if job.args.fault_kill_before_eval == Some(rank.world_rank) {
                tracing::warn!(rank = rank.world_rank, "test hook: killing this process (SIGKILL) before it evaluates");
                // SAFETY: kill(2) on our own pid; nothing after it runs.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            }
            let model = template.take_or_clone().fork(&rank.device);
            let loss = evaluate_sequences::<Sp<W>>(config, model, sequences, Some(documents), targets.as_deref(), &rank.groups, &rank.device).map_err(|e| rank_failure(threads, e))?;
            if rank.world_rank == 0 {
                println!(
                    "eval: loss {:.6}, perplexity {:.4} over {} labelled tokens in {} sequences of {} (SP={} DP={})",
                    loss.mean(),
                    loss.mean().exp(),
                    loss.tokens,
                    sequences.len(),
                    job.data_identity.path,
                    config.layout.sp_size,
                    config.layout.dp_size
                );
            }
            return Ok(());
        }
        let mut log = (rank.world_rank == 0).then(|| RunLog::new(job));
        let options = RunOptions {
            progress: log.as_mut().map(|log| log as &mut dyn Progress),
            checkpoint_dir: (!job.args.no_save).then(|| job.out.clone()),
            checkpoint_every: job.args.checkpoint_every,
            keep_checkpoints: job.args.keep_checkpoints.get(),
            resume: job.args.resume.clone(),
            resumed_at: job.resumed_at,
            stop_after: job.args.stop_after,
            data_identity: Some(job.data_identity.clone()),
            allow_new_data: job.args.allow_new_data,
            save_hf: job.args.save_hf.clone().zip(job.pretrained.clone()),
            save_hf_dtype: job.args.save_hf_dtype.map(Into::into),
            save_hf_companions: save_hf_companions(job.args),
            faults: Faults {
                nan_gradient: job.args.fault_nan_gradient,
                kill: job.args.fault_kill,
                fail: job.args.fault_fail,
                slow_checkpoint_write: std::time::Duration::try_from_secs_f64(job.args.fault_slow_checkpoint_write.unwrap_or(0.0)).unwrap_or_default(),
                failed_checkpoint_write: job.args.fault_failed_checkpoint_write,
            },
            host_optimizer_threads: Some(host_optimizer_threads),
            estimated_peak,
            ranks_on_this_host: ranks_here,
            time_phases: job.args.profile,
        };
        let model = template.take_or_clone();
        let model = if lazy { model } else { model.fork(&rank.device) };
        // model.mpk is a MessagePack record, which holds no tensor past 4 GiB: not written then
        // (the checkpoint holds the model, `--save-hf` exports it).
        let unrecordable = ulysses_training::checkpoint::check_record_fits(
            &model,
            "model.mpk will not be written at the end (the checkpoint holds the model; --save-hf, with --model or --hf-config, exports it as safetensors)",
        )
        .err();
        // Said before training, not after it.
        if let (Some(why), 0, false) = (&unrecordable, rank.world_rank, job.args.no_save) {
            tracing::warn!("{why}");
        }
        // Where this fails, the log's drop draws the curve of the rows written.
        let (mut trained, _) = train_rank::<Sp<W>>(config, model, job.data.as_ref(), &rank.groups, &rank.device, options).map_err(|e| rank_failure(threads, e))?;
        match (&unrecordable, job.args.no_save) {
            (_, true) => {}
            (Some(_), false) => {
                if let Some(log) = log.as_mut() {
                    log.wrote = "metrics.csv, loss.png, config.json, checkpoint.ulysses";
                }
            }
            // Every rank: under ZeRO-3 the ranks gather it a layer at a time for rank 0.
            (None, false) => {
                trained.save(&job.out.join("model"), &*rank.groups.world).map_err(|e| rank_failure(threads, e))?
            }
        }
        if let Some(log) = log {
            log.finish()?;
        }
        Ok(())
    })()))
    .map_err(|e| {
        // A rank that failed joining because a peer did (it left, failing first).
        note_peer_loss(threads, e.is_peer_loss());
        e.to_string()
    })?;
    // Threads: every failed rank's line (the one that failed first is among them, the others
    // name it); a process: its own.
    let failures: Vec<String> =
        results.into_iter().enumerate().filter_map(|(rank, result)| result.err().map(|e| if threads { format!("rank {rank}: {e}") } else { e })).collect();
    match failures.is_empty() {
        true => Ok(()),
        false => Err(failures.join("\n")),
    }
}

/// World rank 0's view of the run: progress bar, CSV and loss curve.
struct RunLog {
    bar: ProgressBar,
    record: Record,
    out: PathBuf,
    started: Instant,
    /// Seconds the run had trained before this process resumed it (the last kept row's
    /// `elapsed_seconds`): this process's rows and summary continue from there.
    trained_before: f64,
    /// When a step's line was last printed where the bar is hidden (stderr not a terminal).
    last_line: Option<Instant>,
    /// The steps this process takes the run to (`--stop-after`, else `--steps`): the last
    /// one's line is printed whenever it comes.
    stop_at: usize,
    /// This run's record was begun (the earlier run's curve removed), and whether its curve
    /// has been drawn since: a run that ends without [`finish`](Self::finish) (failing after
    /// its first row, a panic) draws it as the log drops.
    began: bool,
    drawn: bool,
    /// What the loss is counted per: `byte` (--corpus) or `token`.
    unit: &'static str,
    /// (step, loss) of the steps that had a target: a step without one has no loss.
    train: Vec<(usize, f64)>,
    eval: Vec<(usize, f64)>,
    title: String,
    steps: usize,
    /// Steps taken so far, those without a target included.
    taken: usize,
    /// The folder held another run's checkpoint (`--overwrite`): removed once this run's
    /// record begins, so that it is never resumed under this run's record.
    replaces_checkpoint: bool,
    /// A resume over its folder's later checkpoint with `--keep-checkpoints` 2 or more: that
    /// one kept beside as its steps' (`checkpoint-step-S.ulysses`) before it goes, the one
    /// resumed (this pair's path) never removed. Another `--overwrite` removes the earlier
    /// run's kept checkpoints with its checkpoint.
    keeps_replaced_checkpoint: Option<(usize, PathBuf)>,
    /// The folder's checkpoints kept by an earlier run go with its checkpoint: `--overwrite`
    /// of another run, not a resume in this folder.
    replaces_kept_checkpoints: bool,
    /// This run keeps its optimizer's state in the checkpoint file (replicated): the earlier
    /// run's sharded parts (`optimizer-step-…`), which no commit of this run would remove, go
    /// with its checkpoint.
    replaces_state_parts: bool,
    /// The files the run writes, for the last line.
    wrote: &'static str,
    /// `--profile`: print each step's waits on the device, copies and kernel launches, and its
    /// backward's and update's seconds.
    profile: bool,
    /// This step's backward and update seconds (and whether the update ran in the backward),
    /// from [`Progress::phases`] to its waits' line.
    phases: Option<(f64, f64, bool)>,
    /// The model's FLOPs a token of a step (forward and backward, [`memory::model_flops_per_token`]),
    /// and the ranks that share them: a step's TFLOP/s a rank.
    flops_per_token: f64,
    ranks: usize,
    /// Seconds a step takes, averaged over the last ones (this process's first step, which
    /// compiles, only until a second comes): the ETA's, and the stall watch's.
    step_seconds: Option<f64>,
    steps_timed: usize,
    /// Every how many steps a held-out evaluation follows (0: none): what the watch names.
    eval_every: usize,
    /// The run's last step has ended (its end, or a stop signal's): the watch is off.
    steps_over: bool,
    /// What the stall watch reads (see [`StallWatch`]); dropped with the log, it ends.
    watch: Arc<StallWatch>,
}

/// `seconds` as `h:mm:ss`.
fn clock(seconds: f64) -> String {
    let seconds = seconds.max(0.0).round() as u64;
    format!("{}:{:02}:{:02}", seconds / 3600, seconds / 60 % 60, seconds % 60)
}

/// What rank 0's stall watch needs: when the last step ended and how long steps take. A thread
/// reads it every few seconds and says where no step has ended for three steps' time (two
/// minutes at least): a step that hangs in a collective shows nothing else until the
/// collective times out (ULYSSES_COLLECTIVE_TIMEOUT, 600 s by default), and the progress bar
/// stands still.
struct StallWatch {
    /// Milliseconds since the log began when the last step (or evaluation, or checkpoint) ended,
    /// and a step's average; 0 once the last step has ended (the run's end is not watched).
    last_step_ms: std::sync::atomic::AtomicU64,
    step_ms: std::sync::atomic::AtomicU64,
    /// What is under way: the next step, or the evaluation or checkpoint after a step.
    doing: std::sync::Mutex<String>,
}

/// Whether the stall watch says so now: nothing has ended for `quiet` ms, three steps' time
/// (`step_ms` each) and two minutes at least, and as long again since it last said so at
/// `said_at` ms (0: not yet); never where no step is watched (`step_ms` 0).
fn stall_to_say(quiet: u64, step_ms: u64, said_at: u64) -> bool {
    let limit = (3 * step_ms).max(120_000);
    step_ms > 0 && quiet >= limit && quiet >= said_at + limit
}

impl StallWatch {
    /// Starts the thread that watches `watch` for as long as anything else holds it.
    fn start(watch: &Arc<Self>, bar: ProgressBar, started: Instant) {
        let watch = Arc::downgrade(watch);
        let spawned = std::thread::Builder::new().name("stall-watch".into()).spawn(move || {
            use std::sync::atomic::Ordering::Relaxed;
            let mut said_at = 0;
            loop {
                std::thread::sleep(std::time::Duration::from_secs(5));
                let Some(watch) = watch.upgrade() else { return };
                let (now, last, step_ms) = (started.elapsed().as_millis() as u64, watch.last_step_ms.load(Relaxed), watch.step_ms.load(Relaxed));
                let quiet = now.saturating_sub(last);
                if stall_to_say(quiet, step_ms, said_at) {
                    said_at = quiet;
                    let doing = watch.doing.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    say(&bar, format!(
                        "warning: nothing has ended for {} ({doing} under way; a step takes about {:.1} s): a rank may be stuck, and a \
                         collective fails after ULYSSES_COLLECTIVE_TIMEOUT (600 s by default)",
                        clock(quiet as f64 / 1e3),
                        step_ms as f64 / 1e3
                    ));
                } else if quiet < said_at {
                    said_at = 0;
                }
            }
        });
        if let Err(error) = spawned {
            tracing::warn!(%error, "the stall watch cannot start: a step that hangs shows nothing until its collective times out");
        }
    }
}

/// The run's `config.json` and `metrics.csv`: nothing is written before the first step has
/// succeeded, so a run that fails earlier leaves an earlier run's record as it was.
enum Record {
    /// No step yet: what will be written then.
    Pending { config_json: String, kept: Vec<String> },
    Open(RunRecord),
    /// Writing it failed: the run goes on (its checkpoints are written on their own), and
    /// ends with this error.
    Failed(String),
}

const CSV_HEADER: &str = "step,loss,eval_loss,learning_rate,valid_tokens,processed_tokens,tokens_per_second,grad_norm,elapsed_seconds";

/// The loss curve rank 0 draws into the run's folder.
const LOSS_PLOT: &str = "loss.png";

/// How often a step's line is printed where the progress bar is hidden.
const STEP_LINE_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// `line` above the progress bar, or on stderr where the bar is hidden (stderr not a
/// terminal: a launcher's pipe, a log file), where the bar's `println` would print nothing.
fn say(bar: &ProgressBar, line: String) {
    match bar.is_hidden() {
        true => eprintln!("{line}"),
        false => bar.println(line),
    }
}

impl RunLog {
    /// A resumed run keeps the rows of the steps before its checkpoint (a crash may have
    /// left rows of later steps, which the resumed run takes again).
    fn new(job: &Job) -> Self {
        let kept = match job.resumed_at {
            // The resumed run's rows, also when it continues in another folder.
            Some(step) => earlier_rows(&resumed_folder(job.args.resume.as_deref().expect("resumed")).join(METRICS_FILE), step, CSV_HEADER),
            None => Vec::new(),
        };
        let (mut train, mut eval) = (Vec::new(), Vec::new());
        for row in &kept {
            let fields: Vec<&str> = row.split(',').collect();
            let step = fields[0].parse().unwrap_or(0);
            if let Some(Ok(loss)) = fields.get(1).map(|f| f.parse()) {
                train.push((step, loss));
            }
            if let Some(Ok(loss)) = fields.get(2).map(|f| f.parse()) {
                eval.push((step, loss));
            }
        }
        let config = &job.config;
        if let Some(resumed) = job.resumed_at {
            let rows: Vec<usize> = kept.iter().filter_map(|row| row.split(',').next()?.parse().ok()).collect();
            if let Some(gap) = ulysses_trainer::run_folder::kept_rows_gap(&rows, resumed) {
                tracing::warn!("{gap}");
            }
        }
        // The kept rows' last time, where they hold one.
        let trained_before = kept.last().and_then(|row| row.rsplit(',').next()?.parse::<f64>().ok()).filter(|s| s.is_finite() && *s >= 0.0).unwrap_or(0.0);
        let bar = ProgressBar::new(config.steps as u64);
        bar.set_position(job.resumed_at.unwrap_or(0) as u64);
        bar.set_style(
            ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} steps  {msg}")
                .unwrap()
                .progress_chars("=> "),
        );
        let ranks = if matches!(job.launch, Launch::Threads) { "threads" } else { "processes" };
        let title = format!(
            "{} on {}, SP={} DP={} ({:?}, {ranks}), {} tokens/sequence",
            job.pretrained.as_ref().map_or("Llama".to_string(), |c| format!("{:?}", c.family)),
            Path::new(&job.data_identity.path).file_name().map_or("bytes".into(), |name| name.to_string_lossy()),
            config.layout.sp_size,
            config.layout.dp_size,
            job.args.backend,
            config.seq_len
        );
        let watch = Arc::new(StallWatch {
            last_step_ms: Default::default(),
            step_ms: Default::default(),
            doing: std::sync::Mutex::new(format!("step {}", job.resumed_at.unwrap_or(0) + 1)),
        });
        let started = Instant::now();
        StallWatch::start(&watch, bar.clone(), started);
        Self {
            bar,
            record: Record::Pending { config_json: burn::config::config_to_json(config), kept },
            out: job.out.clone(),
            started,
            trained_before,
            last_line: None,
            stop_at: job.args.stop_after.map_or(config.steps, |stop| stop.min(config.steps)),
            began: false,
            drawn: false,
            unit: if job.args.data.is_none() && job.args.tokens.is_none() { "byte" } else { "token" },
            train,
            eval,
            title,
            steps: config.steps,
            taken: job.resumed_at.unwrap_or(0),
            // A copy resumed over its folder's checkpoint: that one goes too, or a run killed
            // before its first commit would leave it to a `--resume` of the folder, which would
            // continue the run this one replaces.
            replaces_checkpoint: job.args.overwrite && !job.args.resume.as_deref().is_some_and(|resumed| same_place(&checkpoint_path(resumed), &job.out.join(CHECKPOINT_FILE))),
            keeps_replaced_checkpoint: job
                .args
                .resume
                .clone()
                .filter(|resumed| same_place(&job.out, &resumed_folder(resumed)) && job.args.keep_checkpoints.get() > 1)
                .map(|resumed| (job.args.keep_checkpoints.get(), resumed)),
            replaces_kept_checkpoints: job.args.overwrite && !job.args.resume.as_deref().is_some_and(|resumed| same_place(&job.out, &resumed_folder(resumed))),
            // A sharded run that saves removes them at its first commit; one that does not,
            // here.
            replaces_state_parts: !job.config.shards_optimizer() || job.args.no_save,
            wrote: if job.args.no_save { "metrics.csv, loss.png, config.json" } else { "metrics.csv, loss.png, config.json, model.mpk, checkpoint.ulysses" },
            profile: job.args.profile,
            phases: None,
            flops_per_token: memory::model_flops_per_token(config),
            ranks: config.layout.world_size(),
            step_seconds: None,
            steps_timed: 0,
            eval_every: config.eval_every,
            steps_over: false,
            watch,
        }
    }

    fn row(&mut self, step: usize, loss: &str, eval_loss: &str, rest: &str) {
        if let Record::Pending { config_json, kept } = &self.record {
            self.record = match RunRecord::open(&self.out, config_json, CSV_HEADER, kept) {
                Ok(record) => {
                    // The file alone: rank 0 writes it, while other ranks may already write their
                    // parts of this run's first checkpoint; the earlier parts go at its commit.
                    // Its model too: this run writes its own at the end, or none (--no-save).
                    for (file, what) in [(CHECKPOINT_FILE, "checkpoint"), ("model.mpk", "model")] {
                        let earlier = self.out.join(file);
                        if self.replaces_checkpoint && earlier.exists() {
                            if let (CHECKPOINT_FILE, Some((keep, resumed))) = (file, &self.keeps_replaced_checkpoint) {
                                if let Err(why) = ulysses_trainer::train::keep_replaced_checkpoint(&self.out, *keep, Some(resumed)) {
                                    say(&self.bar, format!("warning: the checkpoint this run goes back past is not kept: {why}"));
                                }
                            }
                            if let Err(error) = fs::remove_file(&earlier) {
                                say(&self.bar, format!("warning: cannot remove the earlier run's {what} {}: {error}", earlier.display()));
                            }
                        }
                    }
                    if self.replaces_kept_checkpoints {
                        for failed in ulysses_trainer::run_folder::remove_kept_checkpoints(&self.out) {
                            say(&self.bar, format!("warning: cannot remove a checkpoint the earlier run kept: {failed}"));
                        }
                    }
                    // A sharded run's first commit removes them itself (its ranks may be
                    // writing their parts now); a replicated run writes none. Those a kept
                    // copy of a checkpoint file names stay, as at a commit.
                    if self.replaces_checkpoint && self.replaces_state_parts {
                        ulysses_training::remove_unnamed_state_folders(&self.out, None);
                    }
                    // The curve of the record as it was: drawn again from this one at the end,
                    // or where the run fails (the log's drop).
                    let _ = fs::remove_file(self.out.join(LOSS_PLOT));
                    self.began = true;
                    Record::Open(record)
                }
                Err(message) => {
                    say(&self.bar, format!("error: {message}; training goes on"));
                    Record::Failed(message)
                }
            };
        }
        let elapsed = self.trained_before + self.started.elapsed().as_secs_f64();
        // A row the curve does not show yet.
        self.drawn = false;
        if let Record::Open(record) = &mut self.record
            && let Err(error) = record.append(&format!("{step},{loss},{eval_loss},{rest},{elapsed:.3}"))
        {
            // Training goes on (its checkpoints are what resumes it); the run ends failed, as
            // one whose record could not be opened does, since its record has lost rows.
            let message = format!("cannot append step {step}'s row to {}: {error}; later rows are not written", self.out.join(METRICS_FILE).display());
            say(&self.bar, format!("error: {message}; training goes on"));
            self.record = Record::Failed(message);
        }
    }

    /// Tells the stall watch that something ended now and what is under way: `doing`, or after
    /// step `step` (0-based) its evaluation where one is due, else the next step; nothing once
    /// the run's steps are over. The trainer goes step, checkpoint, evaluation.
    fn watching(&self, doing: String) {
        use std::sync::atomic::Ordering::Relaxed;
        self.watch.last_step_ms.store(self.started.elapsed().as_millis() as u64, Relaxed);
        let step_ms = match (self.steps_over, self.step_seconds) {
            (false, Some(seconds)) => (seconds * 1e3).max(1.0) as u64,
            _ => 0,
        };
        self.watch.step_ms.store(step_ms, Relaxed);
        *self.watch.doing.lock().unwrap_or_else(|p| p.into_inner()) = doing;
    }

    fn watch_after(&self, step: usize) {
        let evaluates = self.eval_every > 0 && (step + 1) % self.eval_every == 0;
        self.watching(if evaluates { format!("the held-out evaluation after step {}", step + 1) } else { format!("step {}", step + 2) });
    }

    /// Draws the curve of this run's record; failing to draw it loses nothing.
    fn draw(&mut self) -> bool {
        self.drawn = true;
        plot::loss_curve(&self.out.join(LOSS_PLOT), &self.title, self.unit, &self.train, &self.eval)
            .map_err(|message| tracing::warn!("{message}; metrics.csv has every value it would show"))
            .is_ok()
    }

    fn finish(mut self) -> Result<(), String> {
        self.bar.finish();
        // A record that lost rows: the run fails, its curve drawn as the log drops.
        if let Record::Failed(message) = &self.record {
            return Err(message.clone());
        }
        let drew = self.draw();
        let wrote = |files: &str| if drew { files.to_string() } else { files.split(", ").filter(|&f| f != LOSS_PLOT).collect::<Vec<_>>().join(", ") };
        // "-" where no step had a target to take a loss on.
        let first = self.train.first().map_or("-".to_string(), |p| format!("{:.3}", p.1));
        let last = self.train.last().map_or("-".to_string(), |p| format!("{:.3}", p.1));
        let held_out = self.eval.last().map_or("-".to_string(), |p| format!("{:.3}", p.1));
        if matches!(self.record, Record::Pending { .. }) {
            // A resume of a run that had taken every step: no record is begun.
            let wrote = match wrote(if self.wrote.contains("model.mpk") { "model.mpk, loss.png" } else { "loss.png" }) {
                files if files.is_empty() => "wrote nothing".to_string(),
                files => format!("wrote {}/{{{files}}}", self.out.display()),
            };
            println!("no step taken: the checkpoint had taken all {} steps (a larger --steps trains on); {wrote}", self.steps);
            return Ok(());
        }
        let taken = self.taken;
        let stopped = if taken < self.steps { format!(" (stopped at {taken} of {}; continue with --resume)", self.steps) } else { String::new() };
        let session = self.started.elapsed().as_secs_f64();
        let time = match self.trained_before {
            0.0 => format!("{session:.1} s"),
            before => format!("{:.1} s, {session:.1} s of it since the resume", before + session),
        };
        println!("loss {first} -> {last} in {taken} steps{stopped} ({time}), held-out {held_out}; wrote {}/{{{}}}", self.out.display(), wrote(self.wrote));
        Ok(())
    }
}

impl Drop for RunLog {
    /// The curve of the rows a run wrote where it ends without drawing it (a failure after its
    /// first row, a panic), so that the folder's loss.png is its record's; none where it wrote
    /// no row (the earlier record stands, with its curve).
    fn drop(&mut self) {
        // A bar dropped unfinished would clear its line: the step the run stopped at stays.
        if !self.bar.is_finished() {
            self.bar.abandon();
        }
        if self.began && !self.drawn {
            self.draw();
        }
    }
}

impl Progress for RunLog {
    fn step(&mut self, step: usize, report: &StepReport, learning_rate: f64, seconds: f64) {
        let tokens_per_second = report.processed_tokens as f64 / seconds.max(1e-9);
        self.taken = step + 1;
        // A step whose sequences hold no target (prompts alone, under --loss-on assistant) has
        // no loss and changes no parameter (`ulysses_training`'s apply_step): its row leaves
        // the loss empty, and the curve and the summary skip it, rather than show a 0 that was
        // never a loss.
        let loss = if report.valid_tokens > 0 {
            self.train.push((step, report.loss));
            format!("{:.9}", report.loss)
        } else {
            String::new()
        };
        // Nor a gradient: its norm is left empty too.
        let grad_norm = if loss.is_empty() { String::new() } else { format!("{:.6}", report.grad_norm) };
        self.row(step, &loss, "", &format!("{learning_rate:.6e},{},{},{tokens_per_second:.1},{grad_norm}", report.valid_tokens, report.processed_tokens));
        let shown = match loss.is_empty() {
            true => "no target in this step: nothing learned".to_string(),
            false => format!("loss {:.4}  grad norm {:.3}", report.loss, report.grad_norm),
        };
        // The model's TFLOP/s a rank (no recompute counted), and the time left at the recent
        // steps' pace (this process's first step, which compiles, left out once a second came).
        let tflops = tokens_per_second / self.ranks as f64 * self.flops_per_token / 1e12;
        self.steps_timed += 1;
        let average = match (self.step_seconds, self.steps_timed) {
            (Some(average), 3..) => 0.9 * average + 0.1 * seconds,
            _ => seconds,
        };
        self.step_seconds = Some(average);
        let eta = clock(average * self.stop_at.saturating_sub(self.taken) as f64);
        self.steps_over = self.taken >= self.stop_at || report.stop_requested;
        self.watch_after(self.taken - 1);
        let flops = match tflops >= 1.0 {
            true => format!("{tflops:.1} TFLOP/s"),
            false => format!("{:.1} GFLOP/s", tflops * 1e3),
        };
        let pace = format!("lr {learning_rate:.2e}  {seconds:.1} s/step  {tokens_per_second:.0} tok/s  {flops} a rank");
        self.bar.set_message(format!("{shown}  {pace}  ETA {eta}"));
        self.bar.inc(1);
        // A log file or a launcher's pipe sees no bar: a line now and then, and the last step's.
        // The run's last step: its end, --stop-after's, or the one a stop signal ends it at.
        let due = self.last_line.is_none_or(|at| at.elapsed() >= STEP_LINE_EVERY) || self.taken == self.stop_at || report.stop_requested;
        if self.bar.is_hidden() && due {
            self.last_line = Some(Instant::now());
            eprintln!("step {}/{}: {shown}  {pace}  (elapsed {}, ETA {eta})", self.taken, self.steps, clock(self.started.elapsed().as_secs_f64()));
        }
    }

    fn eval(&mut self, step: usize, loss: f64) {
        self.watching(format!("step {}", step + 2));
        self.eval.push((step, loss));
        self.row(step, "", &format!("{loss:.9}"), ",,,,");
        say(&self.bar, format!("step {}: held-out loss {loss:.4}", step + 1));
    }

    fn has_eval(&self, step: usize) -> bool {
        self.eval.iter().any(|&(evaluated, _)| evaluated == step)
    }

    fn checkpoint_due(&mut self, step: usize) {
        self.watching(format!("the checkpoint after step {}", step + 1));
        if let Record::Open(record) = &mut self.record
            && let Err(error) = record.sync()
        {
            say(&self.bar, format!("warning: cannot make {} durable before step {}'s checkpoint: {error}", self.out.join(METRICS_FILE).display(), step + 1));
        }
    }

    fn checkpoint(&mut self, step: usize, path: &Path) {
        // Which step a --resume would continue from, said as it becomes so; and the curve drawn
        // to it, for a run of days to show one before its end.
        say(&self.bar, format!("step {}: checkpoint written ({})", step + 1, path.display()));
        // The step just taken's (a replicated one's write is said at a later step's end).
        if step + 1 == self.taken {
            self.watch_after(step);
        }
        if self.began {
            self.draw();
        }
    }

    fn phases(&mut self, _step: usize, backward: f64, update: f64, update_in_backward: bool) {
        self.phases = Some((backward, update, update_in_backward));
    }

    fn device_io(&mut self, step: usize, io: &DeviceIo) {
        if self.profile {
            let phases = self.phases.take().map_or_else(String::new, |(backward, update, in_backward)| match in_backward {
                false => format!("; backward {backward:.3} s, then the update {update:.3} s (a sync between, left out of the counts)"),
                true => format!("; backward with the update in it {backward:.3} s, then the step's checks {update:.3} s (a sync between, left out of the counts)"),
            });
            // Printed also where the bar is hidden (output not a terminal): it is asked for.
            self.bar.suspend(|| println!("step {step}: {io}{phases}"));
        }
    }
}

#[cfg(test)]
mod tests {
    /// The stall watch speaks after three steps' time of nothing ending, two minutes at least,
    /// then once each as long again; never once the steps are over.
    #[test]
    fn the_stall_watch_speaks_after_three_steps_and_two_minutes() {
        use super::stall_to_say;
        // Steps of 50 s: after 150 s, not before; again at 300 s.
        assert!(!stall_to_say(149_999, 50_000, 0) && stall_to_say(150_000, 50_000, 0));
        assert!(!stall_to_say(299_999, 50_000, 150_000) && stall_to_say(300_000, 50_000, 150_000));
        // Steps of a second: two minutes.
        assert!(!stall_to_say(119_999, 1_000, 0) && stall_to_say(120_000, 1_000, 0));
        // Nothing watched after the last step.
        assert!(!stall_to_say(10_000_000, 0, 0));
    }

    /// Data whose only targets are documents' first tokens trains nothing (no token before
    /// them predicts them): refused as data without answers; one more target is taken.
    #[test]
    fn targets_on_first_tokens_alone_are_no_answers() {
        use super::{Documents, LossOn, answers};
        let documents = |targets: Vec<Vec<bool>>| Documents { ids: targets.iter().map(|t| vec![1; t.len()]).collect(), targets: Some(targets), rendered_chat: false, notes: Vec::new() };
        let firsts = documents(vec![vec![true, false, false], vec![true, false]]);
        let refused = answers(&firsts, LossOn::Assistant, "--data", std::path::Path::new("sft.jsonl")).unwrap_err();
        assert!(refused.contains("no token is an answer"), "{refused}");
        let one = documents(vec![vec![true, false, false], vec![true, true]]);
        assert!(answers(&one, LossOn::Assistant, "--data", std::path::Path::new("sft.jsonl")).unwrap().is_some());
    }
}
