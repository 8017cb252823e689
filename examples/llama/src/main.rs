//! Trains a small Llama on byte tokens with Ulysses sequence parallelism.
//!
//! By default: 4 SP ranks as threads on the CPU, on the licence texts every Debian machine
//! has. Writes `metrics.csv`, `loss.png`, `config.json` and `model.mpk` to `--out`.
//!
//! cargo run --release -p ulysses-llama -- [--sp 4] [--dp 1] [--steps 300] [--backend cpu|cuda]

use std::{
    fs::File,
    io::{BufWriter, Write},
    path::PathBuf,
    time::Instant,
};

use burn::{
    backend::{Autodiff, NdArray},
    config::Config,
    module::Module,
    tensor::backend::AutodiffBackend,
};
use burn_ulysses::{
    ExchangeBackend, UlyssesBackend,
    comm::{ThreadCommunicator, ThreadGroup},
    train::{ParallelGroups, ParallelLayout, StepReport},
};
use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use ulysses_llama::{
    corpus::{ByteCorpus, DEFAULT_CORPUS},
    plot,
    train::{CorpusData, Progress, TrainConfig, save_checkpoint, train_rank},
};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum BackendKind {
    /// NdArray on the CPU.
    Cpu,
    /// CubeCL CUDA on GPU 0 (build with `--features cuda`).
    Cuda,
}

#[derive(Parser, Debug)]
#[command(about = "Train a small Llama with Ulysses sequence parallelism")]
struct Args {
    /// Sequence-parallel degree: ranks that split each sequence.
    #[arg(long, default_value_t = 4)]
    sp: usize,
    /// Data-parallel degree: replicas that split each batch.
    #[arg(long, default_value_t = 1)]
    dp: usize,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    grad_accumulation: usize,
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// Sequences per optimizer step (over all ranks).
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Tokens (bytes) per sequence.
    #[arg(long, default_value_t = 256)]
    seq_len: usize,
    #[arg(long, default_value_t = 3e-3)]
    learning_rate: f64,
    /// A text file, or a folder of them.
    #[arg(long, default_value = DEFAULT_CORPUS)]
    corpus: PathBuf,
    #[arg(long, default_value = "runs/llama")]
    out: PathBuf,
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendKind,
    /// Evaluate on one rank with the whole sequence, bypassing sequence parallelism.
    #[arg(long)]
    eval_single_device: bool,
    /// Verify every this many steps that all ranks hold identical parameters (0: never).
    #[arg(long, default_value_t = 50)]
    check_parameters_every: usize,
    /// Seed of the initial parameters and of the batches.
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    if let Err(message) = run(Args::parse()) {
        eprintln!("error: {message}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<(), String> {
    let layout = ParallelLayout::new().with_sp_size(args.sp).with_dp_size(args.dp);
    let mut config = TrainConfig::small(layout)
        .with_grad_accumulation(args.grad_accumulation)
        .with_batch_size(args.batch_size)
        .with_seq_len(args.seq_len)
        .with_steps(args.steps)
        .with_learning_rate(args.learning_rate)
        .with_eval_single_device(args.eval_single_device)
        .with_check_parameters_every(args.check_parameters_every)
        .with_seed(args.seed);
    config.warmup_steps = config.warmup_steps.min(args.steps / 5);
    config.validate()?;
    let corpus = ByteCorpus::load(&args.corpus, 0.1)?;
    corpus.check_sequence_length(config.seq_len)?;
    tracing::info!(
        corpus = %args.corpus.display(),
        files = corpus.files.len(),
        train_bytes = corpus.train_bytes(),
        sp = args.sp,
        dp = args.dp,
        backend = ?args.backend,
        "training a {}-layer Llama, {} q / {} kv heads, on {} ranks",
        config.model.n_layers,
        config.model.n_heads,
        config.model.n_kv_heads,
        layout.world_size(),
    );
    std::fs::create_dir_all(&args.out).map_err(|e| format!("cannot create {}: {e}", args.out.display()))?;
    config.save(args.out.join("config.json")).map_err(|e| e.to_string())?;

    match args.backend {
        BackendKind::Cpu => train::<Autodiff<NdArray>>(&config, &corpus, &args, Default::default()),
        // CubeBackend itself rather than burn's fused `Cuda`: the flash kernels run on it.
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => {
            type Cuda = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
            train::<Autodiff<Cuda>>(&config, &corpus, &args, Default::default())
        }
        #[cfg(not(feature = "cuda"))]
        BackendKind::Cuda => Err("this binary was built without CUDA: rebuild with `--features cuda`".into()),
    }
}

/// Runs every rank of the world as a thread; `Inner` is the autodiff backend under
/// `UlyssesBackend`.
fn train<Inner>(config: &TrainConfig, corpus: &ByteCorpus, args: &Args, device: Inner::Device) -> Result<(), String>
where
    Inner: AutodiffBackend + ExchangeBackend,
    Inner::InnerBackend: ExchangeBackend,
{
    // Seeded parameters, initialised here (fork forces burn's lazy initialisation) so that
    // runs repeat; each rank forks its own copy, with its own autodiff leaves.
    <UlyssesBackend<Inner> as burn::tensor::backend::Backend>::seed(&device, config.seed);
    let template = config.model.init::<UlyssesBackend<Inner>>(&device).fork(&device);
    let world = ThreadGroup::new(config.layout.world_size());
    let results = world.run(|rank| -> Result<(), String> {
        let groups: ParallelGroups<ThreadCommunicator> =
            ParallelGroups::new(rank.communicator(), config.layout).map_err(|e| e.to_string())?;
        let _sp = UlyssesBackend::<Inner>::enter_thread(groups.sp.clone());
        let mut log = (rank.rank() == 0).then(|| RunLog::new(config, args)).transpose()?;
        let progress = log.as_mut().map(|log| log as &mut dyn Progress);
        let data = CorpusData { corpus, config };
        let model = template.clone().fork(&device);
        let (model, _) = train_rank::<UlyssesBackend<Inner>, _>(config, model, &data, &groups, &device, progress)
            .map_err(|e| e.to_string())?;
        if let Some(log) = log {
            save_checkpoint(&model, &args.out.join("model"))?;
            log.finish()?;
        }
        Ok(())
    });
    for (rank, result) in results.into_iter().enumerate() {
        result.map_err(|panic| panic.to_string())?.map_err(|e| format!("rank {rank}: {e}"))?;
    }
    Ok(())
}

/// World rank 0's view of the run: progress bar, CSV and loss curve.
struct RunLog {
    bar: ProgressBar,
    csv: BufWriter<File>,
    out: PathBuf,
    started: Instant,
    train: Vec<(usize, f64)>,
    eval: Vec<(usize, f64)>,
    title: String,
}

impl RunLog {
    fn new(config: &TrainConfig, args: &Args) -> Result<Self, String> {
        let path = args.out.join("metrics.csv");
        let mut csv = BufWriter::new(File::create(&path).map_err(|e| format!("cannot create {}: {e}", path.display()))?);
        writeln!(csv, "step,loss,eval_loss,learning_rate,valid_tokens,processed_tokens,tokens_per_second,elapsed_seconds")
            .map_err(|e| e.to_string())?;
        let bar = ProgressBar::new(config.steps as u64);
        bar.set_style(
            ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} steps  {msg}")
                .unwrap()
                .progress_chars("=> "),
        );
        let title = format!(
            "Llama on bytes, SP={} DP={} ({:?}), {} tokens/sequence",
            config.layout.sp_size, config.layout.dp_size, args.backend, config.seq_len
        );
        Ok(Self { bar, csv, out: args.out.clone(), started: Instant::now(), train: Vec::new(), eval: Vec::new(), title })
    }

    fn row(&mut self, step: usize, loss: &str, eval_loss: &str, rest: &str) {
        let elapsed = self.started.elapsed().as_secs_f64();
        // A failed write only loses a metrics row; the run goes on.
        let _ = writeln!(self.csv, "{step},{loss},{eval_loss},{rest},{elapsed:.3}");
    }

    fn finish(mut self) -> Result<(), String> {
        self.bar.finish();
        self.csv.flush().map_err(|e| e.to_string())?;
        plot::loss_curve(&self.out.join("loss.png"), &self.title, &self.train, &self.eval)?;
        let first = self.train.first().map_or(f64::NAN, |p| p.1);
        let last = self.train.last().map_or(f64::NAN, |p| p.1);
        let held_out = self.eval.last().map_or("-".to_string(), |p| format!("{:.3}", p.1));
        println!(
            "loss {first:.3} -> {last:.3} in {} steps ({:.1?}), held-out {held_out}; wrote {}/{{metrics.csv, loss.png, config.json, model.mpk}}",
            self.train.len(),
            self.started.elapsed(),
            self.out.display()
        );
        Ok(())
    }
}

impl Progress for RunLog {
    fn step(&mut self, step: usize, report: &StepReport, learning_rate: f64, seconds: f64) {
        let tokens_per_second = report.processed_tokens as f64 / seconds.max(1e-9);
        self.train.push((step, report.loss));
        self.row(
            step,
            &format!("{:.6}", report.loss),
            "",
            &format!("{learning_rate:.6e},{},{},{tokens_per_second:.1}", report.valid_tokens, report.processed_tokens),
        );
        self.bar.set_message(format!("loss {:.4}  {tokens_per_second:.0} tok/s", report.loss));
        self.bar.inc(1);
    }

    fn eval(&mut self, step: usize, loss: f64) {
        self.eval.push((step, loss));
        self.row(step, "", &format!("{loss:.6}"), ",,,");
        self.bar.println(format!("step {step}: held-out loss {loss:.4}"));
    }
}
