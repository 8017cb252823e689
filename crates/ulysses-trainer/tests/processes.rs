//! The real trainer binary, one process per rank under `ulysses-launch` (ranks meet over the
//! TCP transport), against the same binary on one device:
//! - SP=2 (2 processes) and SP=2 × DP=2 (4 processes): the loss of each of 5 AdamW steps and
//!   the final parameters within 1e-5, on batches with padding and, at step 0, a rank whose
//!   shard holds only ignored labels;
//! - a rank killed (SIGKILL) in the middle of a step: every other rank fails within seconds
//!   naming it, the launcher fails, and the last checkpoint loads;
//! - a NaN in one rank's gradient stops the run naming the step and the rank;
//! - a run stopped after 3 steps and resumed for 3 more equals 6 uninterrupted steps
//!   (losses within 1e-6, identical parameters), and the checkpoint also resumes with no SP;
//! - the optimizer on the host (`--offload-optimizer`, its state sharded over the 4 ranks of
//!   SP=2 × DP=2) trains like the replicated optimizer (losses within 1e-6, parameters within
//!   1e-5: the clipping norm's sum is ordered otherwise), its checkpoint holds one state file per
//!   rank, and, stopped after 3 steps, it resumes on 2 ranks (the state re-partitioned) with
//!   the same losses; a resume without the flag is refused naming it;
//! - layouts that cannot work fail before any work, saying what to change; so do settings
//!   that cannot train (a learning rate that is negative, NaN or infinite; a zero size), each
//!   naming its flag before any file is written;
//! - the run folder has one writer: a second trainer on it stops at once naming the first's pid
//!   while the first finishes intact; a fresh run leaves an earlier run's folder byte for byte
//!   as it was; a resume on other data (or with another model shape) is refused naming what
//!   changed, unless `--allow-new-data`; a binary corpus (unless `--bytes-ok`) and token
//!   sequences that leave no label are refused before step 1; a killed run leaves a folder the
//!   next run can lock; `config.json` and `metrics.csv` are written only once a step has
//!   succeeded (a run that fails before leaves the folder's record byte for byte as it was),
//!   and a resumed run appends to the rows it continues from;
//! - every flag the README and docs/training.md name is in the trainer's or the launcher's
//!   `--help`.

use std::{
    fs,
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

use burn::{
    backend::{Autodiff, NdArray},
    config::Config,
    optim::AdamWConfig,
    tensor::DType,
};
use burn_ulysses::{compare::{max_abs_diff, worst}};
use ulysses_training::{float_parameters, checkpoint::{load_training_checkpoint, read_checkpoint_state}};
use ulysses_models::Decoder;
use ulysses_trainer::{run_folder::earlier_run_files, train::{RunState, TrainConfig, load_model}};

type Cpu = Autodiff<NdArray<f32>>;

const TOLERANCE: f32 = 1e-5;

/// Sequence lengths per step, 4 sequences each (batch 4, `--seq-len 16`). Every batch is
/// padded to 16 tokens. At step 0 no sequence is longer than 8 tokens, so under SP=2 the rank
/// holding positions 8..16 has only ignored labels (and under SP=2 × DP=2, on both DP ranks).
const LENGTHS: [[usize; 4]; 7] = [
    [5, 8, 3, 7],
    [16, 11, 9, 14],
    [12, 16, 6, 10],
    [13, 4, 16, 15],
    [9, 16, 12, 2],
    [16, 7, 11, 13],
    [16, 10, 12, 8], // held out
];

fn trainer() -> &'static str {
    env!("CARGO_BIN_EXE_ulysses-trainer")
}

/// `ulysses-launch`, built beside the trainer by `cargo test --workspace` (it is
/// `ulysses-dist`'s binary, which the workspace's tests build).
fn launcher() -> PathBuf {
    let path = Path::new(trainer()).with_file_name("ulysses-launch");
    assert!(path.exists(), "{} is missing: run `cargo test --workspace` (or `cargo build -p ulysses-dist`) first", path.display());
    path
}

/// A fresh folder for one test, with the token file.
fn workspace(name: &str) -> PathBuf {
    workspace_with(name, false)
}

/// With `paragraphs`, each sequence of 6 tokens or more holds a blank line (tokens 10 10) at a
/// position that varies with the sequence, so `--pack` cuts it into two documents, the edge
/// falling on the shard edge (8) or inside a shard.
fn workspace_with(name: &str, paragraphs: bool) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ulysses-trainer-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    let lines: Vec<String> = LENGTHS
        .iter()
        .enumerate()
        .flat_map(|(step, lengths)| lengths.iter().enumerate().map(move |(i, &len)| (step, i, len)))
        .map(|(step, i, len)| {
            // Each token determines the next (a walk through a fixed permutation), so there
            // is something to learn within a few steps.
            let start = step * 37 + i * 101;
            let blank_line = if paragraphs && len >= 6 { Some(2 + (step + i) % (len - 4)) } else { None };
            let tokens: Vec<String> = (0..len)
                .map(|t| match blank_line {
                    Some(at) if t == at || t == at + 1 => 10,
                    _ => (start + t * 77) % 256,
                })
                .map(|token| token.to_string())
                .collect();
            format!("[{}]", tokens.join(", "))
        })
        .collect();
    fs::write(dir.join("data.jsonl"), lines.join("\n")).unwrap();
    dir
}

/// The trainer's arguments shared by every run: a small Llama on the token file.
fn common_args(dir: &Path, out: &str, steps: usize) -> Vec<String> {
    let args = format!(
        "--tokens {} --out {} --seq-len 16 --batch-size 4 --steps {steps} --learning-rate 0.01 --seed 7 \
         --d-model 64 --layers 2 --heads 4 --kv-heads 2 --ffn-hidden 128 --check-parameters-every 1",
        dir.join("data.jsonl").display(),
        dir.join(out).display()
    );
    args.split_whitespace().map(String::from).collect()
}

fn show(output: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}

/// Whether a run succeeded, and what it printed.
fn outcome(output: Output) -> (bool, String) {
    (output.status.success(), show(&output))
}

/// A folder `texts` in `dir` holding one text file of paragraphs to train on.
fn texts_to_train_on(dir: &Path) -> PathBuf {
    let texts = dir.join("texts");
    fs::create_dir_all(&texts).unwrap();
    fs::write(texts.join("a.txt"), "Some text to train on.\n\n".repeat(200)).unwrap();
    texts
}

/// The trainer alone, its ranks as threads of one process.
fn run_alone(args: &[String], extra: &[&str]) -> Output {
    Command::new(trainer()).args(args).args(extra).args(["--launch", "threads"]).output().unwrap()
}

/// `ulysses-launch` starting the trainer as `processes` processes on a free port, with a kill
/// grace of `grace` seconds; the trainer's arguments follow.
fn launched(processes: usize, grace: &str) -> Command {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let mut command = Command::new(launcher());
    command.args(["--nproc-per-node", &processes.to_string(), "--master-port", &port, "--kill-grace-secs", grace, "--"]).arg(trainer());
    command
}

/// The trainer as `processes` processes under `ulysses-launch`.
fn run_launched(processes: usize, args: &[String], extra: &[&str]) -> Output {
    launched(processes, "20")
        .args(args)
        .args(extra)
        .env("ULYSSES_COLLECTIVE_TIMEOUT", "120")
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

fn succeed(output: Output) -> Output {
    assert!(output.status.success(), "the run failed:\n{}", show(&output));
    output
}

/// `(step, loss)` of every training row of a run's metrics.
fn losses(out: &Path) -> Vec<(usize, f64)> {
    metric(out, 1)
}

/// The held-out losses a run logged (metrics.csv's `eval_loss`), by step.
fn eval_losses(out: &Path) -> Vec<(usize, f64)> {
    metric(out, 2)
}

/// metrics.csv's column `column`, by step, where the row has a value there.
fn metric(out: &Path, column: usize) -> Vec<(usize, f64)> {
    fs::read_to_string(out.join("metrics.csv"))
        .unwrap()
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(',').collect();
            Some((fields[0].parse().ok()?, fields[column].parse().ok()?))
        })
        .collect()
}

/// Every parameter of the model a run saved, flattened, with its path.
fn parameters(out: &Path) -> Vec<(String, Vec<f32>)> {
    let config = TrainConfig::load(out.join("config.json")).unwrap();
    let model: Decoder<Cpu> = load_model(&config.model, &out.join("model"), &Default::default()).unwrap();
    float_parameters(&model).into_iter().map(|p| (p.path, p.values.into_data().convert::<f32>().to_vec().unwrap())).collect()
}

/// Rank `rank`'s error line in a launch's output.
fn rank_error(text: &str, rank: usize) -> &str {
    text.lines()
        .find(|line| line.starts_with(&format!("[rank {rank}] error:")))
        .unwrap_or_else(|| panic!("rank {rank} reported no error:\n{text}"))
}

/// Largest difference of losses (same steps) and of parameters (same names) between runs;
/// panics unless their gradient norms agree to [`TOLERANCE`] relative (metrics.csv keeps six
/// decimals): AdamW's update and clipping divide a gradient's scale away, so a gradient off by
/// a constant factor shows in its norm alone.
fn differences(a: &Path, b: &Path) -> (f32, f32) {
    let (la, lb) = (losses(a), losses(b));
    assert_eq!(la.iter().map(|l| l.0).collect::<Vec<_>>(), lb.iter().map(|l| l.0).collect::<Vec<_>>(), "different steps");
    let (norms_a, norms_b) = (metric(a, 7), metric(b, 7));
    assert!(
        norms_a.len() == la.len() && norms_b.len() == lb.len() && norms_a.iter().zip(&norms_b).all(|(x, y)| (x.1 - y.1).abs() <= TOLERANCE as f64 * y.1.abs() + 1e-6),
        "gradient norms differ: {norms_a:?} against {norms_b:?}"
    );
    let loss = worst(la.iter().zip(&lb).map(|(x, y)| (x.1 - y.1).abs() as f32));
    let (pa, pb) = (parameters(a), parameters(b));
    assert_eq!(pa.len(), pb.len());
    let params = worst(pa.iter().zip(&pb).map(|((na, va), (nb, vb))| {
        assert_eq!(na, nb);
        max_abs_diff(va, vb)
    }));
    (loss, params)
}

#[test]
fn two_and_four_processes_train_like_one_device() {
    let dir = workspace("equivalence");
    succeed(run_alone(&common_args(&dir, "one", 5), &["--sp", "1"]));
    succeed(run_launched(2, &common_args(&dir, "sp2", 5), &["--sp", "2"]));
    succeed(run_launched(4, &common_args(&dir, "sp2dp2", 5), &["--sp", "2"]));

    let reference = losses(&dir.join("one"));
    assert_eq!(reference.len(), 5);
    assert!(reference.iter().all(|l| l.1.is_finite()) && reference[4].1 < reference[0].1, "{reference:?}");
    for run in ["sp2", "sp2dp2"] {
        let (loss, params) = differences(&dir.join(run), &dir.join("one"));
        let config = fs::read_to_string(dir.join(run).join("config.json")).unwrap();
        println!("{run}: max |Δ| loss {loss:.2e}, parameters {params:.2e} vs one device; losses {:?}", losses(&dir.join(run)));
        assert!(config.contains("\"sp_size\": 2"), "{config}");
        assert!(loss <= TOLERANCE, "{run}: losses differ from one device by {loss:e}");
        assert!(params <= TOLERANCE, "{run}: parameters differ from one device by {params:e}");
    }
    let _ = fs::remove_dir_all(&dir);
}

/// `--pack` across processes: the documents' position ids travel over TCP to every rank of
/// the group; two processes at SP=2 take the steps of one device, and packing changes them
/// (it is not silently off).
#[test]
fn packed_paragraphs_train_alike_in_two_processes_and_on_one_device() {
    let dir = workspace_with("packed", true);
    succeed(run_alone(&common_args(&dir, "one", 5), &["--sp", "1", "--pack"]));
    succeed(run_launched(2, &common_args(&dir, "sp2", 5), &["--sp", "2", "--pack"]));
    succeed(run_alone(&common_args(&dir, "unpacked", 5), &["--sp", "1"]));
    let (loss, params) = differences(&dir.join("sp2"), &dir.join("one"));
    println!("packed sp2: max |Δ| loss {loss:.2e}, parameters {params:.2e} vs one device");
    assert!(loss <= TOLERANCE && params <= TOLERANCE, "packed SP=2 differs from one device: loss {loss:e}, parameters {params:e}");
    let (packed, unpacked) = (losses(&dir.join("one")), losses(&dir.join("unpacked")));
    assert!((packed[0].1 - unpacked[0].1).abs() > 1e-3, "--pack changed nothing: {packed:?} against {unpacked:?}");
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_rank_killed_mid_step_stops_every_rank_and_the_last_checkpoint_loads() {
    let dir = workspace("kill");
    let out = killed_at_step_3(&dir, &["--sp", "2"]);
    let state: RunState = read_checkpoint_state(&out).unwrap();
    assert_eq!(state.completed_steps, 2);
    let config = TrainConfig::load(out.join("config.json")).unwrap();
    let model = config.model.init::<Cpu>(&Default::default());
    let optimizer = AdamWConfig::new().init::<Cpu, Decoder<Cpu>>();
    let (_, _, loaded): (_, _, RunState) = load_training_checkpoint(&out, model, optimizer, &Default::default()).unwrap();
    assert_eq!(loaded.data_position, 2);
    let _ = fs::remove_dir_all(&dir);
}

/// Under ZeRO-3 rank 1 is killed after step 3's backward, while the others wait for it in the
/// update's first collective (the death of a rank inside a parameter all-gather: burn-ulysses'
/// tests/tcp_processes.rs): they stop naming it, and the sharded checkpoint after step 2
/// resumes on the 4 ranks and finishes the run.
#[test]
fn a_rank_killed_in_a_zero_3_step_stops_every_rank_and_the_run_resumes() {
    let dir = workspace("kill-zero3");
    let zero3 = ["--sp", "2", "--offload-optimizer", "--checkpoint-layers", "--zero", "3"];
    let out = killed_at_step_3(&dir, &zero3);
    assert_eq!(read_checkpoint_state::<RunState>(&out).unwrap().completed_steps, 2);
    let mut resume = common_args(&dir, "run", 6);
    resume.extend(["--resume".to_string(), out.display().to_string()]);
    succeed(run_launched(4, &resume, &zero3));
    assert_eq!(read_checkpoint_state::<RunState>(&out).unwrap().completed_steps, 6);
    let _ = fs::remove_dir_all(&dir);
}

/// Runs 6 steps on 4 ranks with `extra`, a checkpoint every 2, rank 1 killed in step 3:
/// checks that the launcher fails within 90 s (far below the 120 s collective timeout: the
/// others noticed rank 1's closed connections) and every other rank stops at step 3 naming
/// rank 1, exiting 76 (failed on a peer's loss: a launcher names another rank first). Returns
/// the run's folder.
fn killed_at_step_3(dir: &Path, extra: &[&str]) -> PathBuf {
    let mut args = common_args(dir, "run", 6);
    args.extend(["--checkpoint-every", "2", "--fault-kill", "3:1"].map(String::from));
    let started = Instant::now();
    let output = run_launched(4, &args, extra);
    let elapsed = started.elapsed();
    let text = show(&output);
    println!("{text}");
    assert!(!output.status.success(), "the launcher must fail");
    assert!(elapsed < Duration::from_secs(90), "the job took {elapsed:?} to stop");
    assert!(text.contains("rank 1 was killed by signal 9"), "{text}");
    for rank in [0, 2, 3] {
        let error = rank_error(&text, rank);
        assert!(error.contains("step 3") && error.contains("world rank(s) [1] died"), "rank {rank}: {error}");
        assert!(text.contains(&format!("rank {rank} exited with status 76")), "{text}");
    }
    dir.join("run")
}

#[test]
fn a_nan_in_one_ranks_gradient_stops_the_run_naming_the_step() {
    let dir = workspace("nan");
    let mut args = common_args(&dir, "run", 6);
    args.extend(["--checkpoint-every", "1", "--fault-nan-gradient", "2:1"].map(String::from));
    let output = run_launched(2, &args, &["--sp", "2"]);
    let text = show(&output);
    println!("{text}");
    assert!(!output.status.success());
    for rank in [0, 1] {
        let error = rank_error(&text, rank);
        assert!(error.contains("step 2: a NaN or an infinity appeared in the gradients on rank(s) [1]"), "{error}");
    }
    // No parameter was touched by step 2: the checkpoint of step 1 is the last, and intact.
    let state: RunState = read_checkpoint_state(&dir.join("run")).unwrap();
    assert_eq!(state.completed_steps, 2);
    assert_eq!(losses(&dir.join("run")).iter().map(|l| l.0).collect::<Vec<_>>(), vec![0, 1]);
    // The failed run's curve is drawn from the rows it wrote.
    assert!(dir.join("run/loss.png").exists(), "a failed run left no curve of its rows");
    let _ = fs::remove_dir_all(&dir);
}

/// A run killed outright (SIGKILL: nothing of it runs after) keeps the curve drawn as its
/// last checkpoint was written (the sharded optimizer's, written in the step: said at once).
#[test]
fn a_killed_run_keeps_the_curve_of_its_last_checkpoint() {
    let dir = workspace("killed-curve");
    let mut args = common_args(&dir, "run", 6);
    args.extend(["--sp", "2", "--offload-optimizer", "--checkpoint-every", "2", "--fault-kill", "3:0"].map(String::from));
    let killed = run_alone(&args, &[]);
    assert!(!killed.status.success(), "{}", show(&killed));
    assert!(show(&killed).contains("step 2: checkpoint written"), "{}", show(&killed));
    assert!(dir.join("run/loss.png").exists(), "no curve of the killed run's rows:\n{}", show(&killed));
    let _ = fs::remove_dir_all(&dir);
}

/// A signal stops a run after the step under way, every rank after the same one, with a
/// checkpoint that `--resume` continues: SIGUSR1 to the launcher (as `sbatch
/// --signal=USR1@300` sends it), which passes it on to its two processes, and SIGTERM to a
/// run whose ranks are threads. (A kill lost the steps since the last checkpoint before; ranks
/// stopping at different steps would have left the others waiting in a collective.) The trainer
/// and the launcher exit 75, not 0 (a retry loop took 0 for a finished run).
#[test]
fn a_signal_stops_every_rank_after_the_same_step_with_a_checkpoint() {
    let dir = workspace("signal");
    let steps = 400;
    let stopped_by = |out: &str, signal: libc::c_int, processes: bool| {
        let mut args = common_args(&dir, out, steps);
        args.extend(["--sp", "2", "--checkpoint-every", "1"].map(String::from));
        let mut command = if processes {
            let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
            let mut command = Command::new(launcher());
            command.args(["--nproc-per-node", "2", "--master-port", &port, "--"]).arg(trainer()).args(&args);
            command
        } else {
            let mut command = Command::new(trainer());
            command.args(&args).args(["--launch", "threads"]);
            command
        };
        let child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        // Once the first checkpoint is written, the run is under way.
        let deadline = Instant::now() + Duration::from_secs(120);
        while !dir.join(out).join("checkpoint.ulysses").exists() {
            assert!(Instant::now() < deadline, "no checkpoint after 120 s");
            std::thread::sleep(Duration::from_millis(10));
        }
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(child.id() as libc::pid_t, signal) };
        let output = child.wait_with_output().unwrap();
        let text = show(&output);
        // Not 0: a job script or retry loop tells a run stopped to be resumed from a finished one.
        assert_eq!(output.status.code(), Some(75), "the stopped run must exit 75 (EX_TEMPFAIL):\n{text}");
        let state: RunState = read_checkpoint_state(&dir.join(out)).unwrap();
        let rows = losses(&dir.join(out)).len();
        println!("{out}: stopped after {} of {steps} steps", state.completed_steps);
        assert!(state.completed_steps < steps && state.completed_steps == rows, "{out}: checkpoint at {} steps, {rows} rows:\n{text}", state.completed_steps);
        assert!(text.contains(&format!("stopped at {} of {steps}; continue with --resume", state.completed_steps)), "{text}");
        // Stderr is piped (no bar): the step the signal ended the run at has its line.
        assert!(text.contains(&format!("step {}/{steps}: loss", state.completed_steps)), "{out}: no line of the last step:\n{text}");
        state.completed_steps
    };
    stopped_by("usr1", libc::SIGUSR1, true);
    // A first SIGTERM to the launcher (a preemption) is passed on too, not a stop by force.
    stopped_by("term-launched", libc::SIGTERM, true);
    let taken = stopped_by("term", libc::SIGTERM, false);
    // The checkpoint continues the run: the resumed run takes the steps left.
    let mut args = vec!["--tokens".to_string(), dir.join("data.jsonl").display().to_string(), "--steps".into(), (taken + 2).to_string()];
    args.extend(["--resume".to_string(), dir.join("term").display().to_string()]);
    succeed(run_alone(&args, &["--sp", "2"]));
    assert_eq!(losses(&dir.join("term")).iter().map(|l| l.0).collect::<Vec<_>>(), (0..taken + 2).collect::<Vec<_>>());
    let _ = fs::remove_dir_all(&dir);
}

/// A stop signal before any step has begun (here, a rank waiting in the rendezvous for a rank 0
/// that never comes) ends the process at once: there is no step to finish, and the wait
/// would last the rendezvous timeout.
#[test]
fn a_signal_before_the_first_step_ends_the_process_at_once() {
    let dir = workspace("early-signal");
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let mut args = common_args(&dir, "run", 2);
    args.extend(["--sp", "2"].map(String::from));
    let child = Command::new(trainer())
        .args(&args)
        .envs([("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_PORT", port.as_str()), ("ULYSSES_RENDEZVOUS_TOKEN", "early"), ("ULYSSES_RENDEZVOUS_TIMEOUT", "60")])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(1));
    let signalled = Instant::now();
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let output = child.wait_with_output().unwrap();
    assert!(signalled.elapsed() < Duration::from_secs(10), "ended {:?} after the signal:\n{}", signalled.elapsed(), show(&output));
    // 75, as a run stopped after a step: a job script's requeue fires (nothing was lost).
    assert_eq!(output.status.code(), Some(75), "{}", show(&output));
    assert!(show(&output).contains("before the first step: nothing to save"), "{}", show(&output));
    let _ = fs::remove_dir_all(&dir);
}

/// A scheduler's second signal while the stop's checkpoint is being written (a slow disk: 5 s;
/// `--signal=USR1` then the time limit's SIGTERM, or a grace's second SIGTERM) changes nothing:
/// the write finishes and the run exits 75 with its checkpoint at the step it stopped after.
/// The second signal ended the process at once before, losing that checkpoint.
#[test]
fn a_second_signal_while_the_stop_is_written_changes_nothing() {
    let dir = workspace("second-signal");
    let mut args = common_args(&dir, "run", 400);
    args.extend(["--sp", "2", "--launch", "threads", "--checkpoint-every", "0", "--eval-every", "0", "--fault-slow-checkpoint-write", "5"].map(String::from));
    let child = Command::new(trainer()).args(&args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while !dir.join("run/metrics.csv").exists() || losses(&dir.join("run")).is_empty() {
        assert!(Instant::now() < deadline, "no step after 120 s");
        std::thread::sleep(Duration::from_millis(10));
    }
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGUSR1) };
    std::thread::sleep(Duration::from_millis(3500));
    // SAFETY: as above; the child is not reaped before wait_with_output.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let output = child.wait_with_output().unwrap();
    let text = show(&output);
    assert_eq!(output.status.code(), Some(75), "{text}");
    let state: RunState = read_checkpoint_state(&dir.join("run")).unwrap_or_else(|e| panic!("no checkpoint: {e}\n{text}"));
    assert_eq!(state.completed_steps, losses(&dir.join("run")).len(), "{text}");
    let _ = fs::remove_dir_all(&dir);
}

/// `--auto-resume`, the command a scheduler requeues unchanged: an attempt killed before its
/// first checkpoint (its record alone left) is started over; one stopped with a checkpoint is
/// continued from it, its losses the uninterrupted run's; a folder holding another run's
/// checkpoints but no checkpoint.ulysses is refused as for a fresh run.
#[test]
fn auto_resume_starts_or_continues_the_run_in_its_folder() {
    let dir = workspace("auto-resume");
    let run = |out: &str, extra: &[&str]| {
        let mut args = common_args(&dir, out, 6);
        args.extend(["--sp", "2", "--launch", "threads", "--eval-every", "0", "--auto-resume"].map(String::from));
        args.extend(extra.iter().map(|a| a.to_string()));
        Command::new(trainer()).args(&args).output().unwrap()
    };
    // Killed in step 3, with no checkpoint (only after the last step): config.json and rows.
    let killed = run("run", &["--checkpoint-every", "0", "--fault-kill", "3:0"]);
    assert!(!killed.status.success() && !dir.join("run/checkpoint.ulysses").exists(), "{}", show(&killed));
    assert!(!losses(&dir.join("run")).is_empty(), "the killed attempt left its rows:\n{}", show(&killed));
    // And a sharded save killed before its checkpoint, which names its optimizer parts last.
    let cut_save = dir.join("run/optimizer-step-000000003");
    fs::create_dir_all(&cut_save).unwrap();
    fs::write(cut_save.join("rank-00000.bin"), b"part").unwrap();
    let stopped = run("run", &["--stop-after", "2"]);
    let text = show(&stopped);
    assert!(stopped.status.success() && text.contains("holds no checkpoint, only the record of an attempt"), "{text}");
    assert!(!cut_save.exists(), "the cut save's parts are removed as the folder is claimed");
    let continued = run("run", &[]);
    let text = show(&continued);
    assert!(continued.status.success() && text.contains("--auto-resume: continuing the run"), "{text}");
    let whole = run("whole", &[]);
    succeed(whole);
    let (resumed, uninterrupted) = (losses(&dir.join("run")), losses(&dir.join("whole")));
    assert_eq!(resumed.len(), 6, "{resumed:?}");
    assert!(resumed.iter().zip(&uninterrupted).all(|(a, b)| a.0 == b.0 && (a.1 - b.1).abs() <= TOLERANCE as f64), "{resumed:?} against {uninterrupted:?}");
    // Kept checkpoints without the newest: not an attempt's record alone.
    fs::create_dir_all(dir.join("kept")).unwrap();
    fs::copy(dir.join("run/checkpoint.ulysses"), dir.join("kept/checkpoint-step-000000006.ulysses")).unwrap();
    let refused = run("kept", &[]);
    let text = show(&refused);
    assert!(!refused.status.success() && text.contains("holds an earlier run's checkpoint-step-000000006.ulysses"), "{text}");
    let _ = fs::remove_dir_all(&dir);
}

/// A run stopped between a checkpoint and the evaluation due at its step (killed there, out of
/// memory there: its row is not in metrics.csv) takes that evaluation as its resume begins,
/// and its held-out losses are the uninterrupted run's; one whose row is kept writes none again.
#[test]
fn an_evaluation_lost_after_its_checkpoint_is_taken_at_the_resume() {
    let dir = workspace("lost-eval");
    let run = |out: &str, extra: &[&str]| {
        let mut args = common_args(&dir, out, 4);
        args.extend(["--eval-every", "2", "--checkpoint-every", "2"].map(String::from));
        args.extend(extra.iter().map(|a| a.to_string()));
        succeed(run_alone(&args, &["--sp", "2"]));
    };
    run("whole", &[]);
    let held_out = |out: &str| metric(&dir.join(out), 2);
    assert_eq!(held_out("whole").iter().map(|&(step, _)| step).collect::<Vec<_>>(), [1, 3]);
    for (out, lost) in [("lost", true), ("kept", false)] {
        run(out, &["--stop-after", "2"]);
        if lost {
            let metrics = dir.join(out).join("metrics.csv");
            let text = fs::read_to_string(&metrics).unwrap();
            let rows: Vec<&str> = text.lines().filter(|line| !line.starts_with("1,,")).collect();
            assert_eq!(rows.len() + 1, text.lines().count(), "step 1's held-out row:\n{text}");
            fs::write(&metrics, rows.join("\n") + "\n").unwrap();
        }
        run(out, &["--resume", &dir.join(out).display().to_string()]);
        assert_eq!(held_out(out), held_out("whole"), "{out}: the held-out losses");
    }
    let _ = fs::remove_dir_all(&dir);
}

/// `--keep-checkpoints 3` keeps the two checkpoints before the newest as
/// `checkpoint-step-S.ulysses`, hard links of the files each save replaced, with their sharded
/// optimizer state, and removes older ones; a resume from one goes back to its step and trains
/// on as the run did (replicated and with the optimizer's parts on the host).
#[test]
fn kept_checkpoints_go_back_to_an_earlier_step() {
    let dir = workspace("kept-checkpoints");
    for (run, layout) in [("replicated", &["--sp", "2"][..]), ("sharded", &["--sp", "2", "--offload-optimizer"])] {
        let flags = [layout, &["--checkpoint-every", "2", "--keep-checkpoints", "3", "--eval-every", "0"]].concat();
        succeed(run_alone(&common_args(&dir, run, 8), &flags));
        let out = dir.join(run);
        let names = |prefix: &str| -> Vec<String> {
            let mut names: Vec<String> = fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).filter(|n| n.starts_with(prefix)).collect();
            names.sort();
            names
        };
        assert_eq!(names("checkpoint-step-"), ["checkpoint-step-000000004.ulysses", "checkpoint-step-000000006.ulysses"], "{run}");
        assert_eq!(read_checkpoint_state::<RunState>(&out.join("checkpoint-step-000000004.ulysses")).unwrap().completed_steps, 4, "{run}");
        if run == "sharded" {
            assert_eq!(names("optimizer-step-").len(), 3, "a state folder for each checkpoint kept: {:?}", names("optimizer-step-"));
        }
        let original = losses(&out);
        let mut resumed = common_args(&dir, run, 8);
        resumed.extend(["--resume".to_string(), out.join("checkpoint-step-000000004.ulysses").display().to_string()]);
        // In the run's folder, over its later checkpoint (kept in turn as its steps').
        succeed(run_alone(&resumed, &[&flags[..], &["--overwrite"]].concat()));
        let again = losses(&out);
        assert!(
            again.len() == 8 && again.iter().zip(&original).all(|(a, o)| a.0 == o.0 && (a.1 - o.1).abs() <= 1e-6),
            "{run}: resumed at step 4, {again:?}; the run's {original:?}"
        );
        // The one resumed from stays, beside the later branch's and the resumed run's own.
        assert_eq!(names("checkpoint-step-"), ["checkpoint-step-000000004.ulysses", "checkpoint-step-000000006.ulysses", "checkpoint-step-000000008.ulysses"], "{run}");
        // Started over (--overwrite, no resume): the earlier run's kept checkpoints go with it.
        succeed(run_alone(&common_args(&dir, run, 2), &[layout, &["--overwrite", "--eval-every", "0"]].concat()));
        assert!(names("checkpoint-step-").is_empty(), "{run}: {:?}", names("checkpoint-step-"));
    }
    let _ = fs::remove_dir_all(&dir);
}

/// A run stopped after 3 of 6 steps resumes with the uninterrupted run's losses and
/// parameters: in place with the same flags, and elsewhere on one process with no flag but the
/// data's, its settings taken from the checkpoint (AdamW's too).
#[test]
fn a_stopped_run_resumes_exactly_and_at_another_layout() {
    let dir = workspace("resume");
    let adamw = ["--weight-decay", "0.05", "--adam-beta2", "0.95", "--adam-epsilon", "1e-6", "--warmup-steps", "2", "--lr-schedule", "linear", "--min-lr-ratio", "0"];
    let full = show(&succeed(run_launched(2, &common_args(&dir, "full", 6), &[&["--sp", "2"][..], &adamw].concat())));
    // A launcher pipes rank 0's stderr (no terminal, no progress bar): the held-out loss at the
    // last step and the last step's line are printed all the same.
    assert!(full.contains("step 6: held-out loss") && full.contains("step 6/6: loss"), "{full}");
    succeed(run_launched(2, &common_args(&dir, "part", 6), &[&["--sp", "2", "--stop-after", "3"][..], &adamw].concat()));
    assert_eq!(losses(&dir.join("part")).len(), 3);
    // A note of the run as a whole (its padding) is said once, not once a process.
    let mut odd = common_args(&dir, "odd", 1);
    set_flag(&mut odd, "--seq-len", "17");
    let text = show(&succeed(run_launched(2, &odd, &["--sp", "2"])));
    assert_eq!(text.matches("seq_len 17 is not a multiple of 2").count(), 1, "{text}");
    // A copy kept in the run's folder, as one keeps a checkpoint to come back to.
    fs::copy(dir.join("part/checkpoint.ulysses"), dir.join("part/step-3.ulysses")).unwrap();
    // A copy to resume elsewhere: one process, no sequence parallelism.
    fs::create_dir_all(dir.join("elsewhere")).unwrap();
    for file in ["checkpoint.ulysses", "metrics.csv", "config.json"] {
        fs::copy(dir.join("part").join(file), dir.join("elsewhere").join(file)).unwrap();
    }
    let resume = |from: &str| ["--resume".to_string(), dir.join(from).display().to_string()];
    let mut args = common_args(&dir, "part", 6);
    args.extend(resume("part"));
    succeed(run_launched(2, &args, &[&["--sp", "2"][..], &adamw].concat()));
    // The time goes on from the kept rows' across the resume, as the steps do.
    let elapsed: Vec<f64> = metric(&dir.join("part"), 8).into_iter().map(|(_, seconds)| seconds).collect();
    assert!(elapsed.len() >= 6 && elapsed.windows(2).all(|pair| pair[0] <= pair[1]), "elapsed_seconds {elapsed:?}");
    // Nothing but the data and the checkpoint: the run's settings (steps, learning rate, seed,
    // batch, length, the model's shape) are the checkpoint's, not the flags' defaults.
    let mut args = vec!["--tokens".to_string(), dir.join("data.jsonl").display().to_string()];
    args.extend(resume("elsewhere"));
    let resumed = succeed(run_alone(&args, &["--sp", "1"]));
    assert!(
        show(&resumed).contains(
            "resuming with the checkpoint's --steps 6, --learning-rate 0.01, --warmup-steps 2, --lr-schedule linear, --min-lr-ratio 0, \
             --weight-decay 5e-2, --adam-beta2 9.5e-1, --adam-epsilon 1e-6, --seed 7"
        ),
        "{}",
        show(&resumed)
    );
    // Without --sp, the checkpoint's layout too (not the flag's default, 4).
    let mut args = vec!["--tokens".to_string(), dir.join("data.jsonl").display().to_string(), "--check".into()];
    args.extend(resume("part"));
    let checked = show(&succeed(Command::new(trainer()).args(&args).args(["--launch", "threads"]).output().unwrap()));
    assert!(checked.contains("--sp 2") && checked.contains("sp 2 × dp 1"), "{checked}");
    assert!(checked.contains("every layer's activations on top (not estimated; --checkpoint-layers keeps one layer's)"), "{checked}");
    assert!(checked.contains("AdamW at 1e-2 (β 0.9, 0.95, ε 1e-6, weight decay 0.05) after 2 warm-up steps, then linear to 0 of it"), "{checked}");
    // Warm-up over 2 steps, then a line from the peak towards 0 where the 6 steps end.
    let rates: Vec<f64> = metric(&dir.join("full"), 3).into_iter().map(|(_, rate)| rate).collect();
    let want = [0.005, 0.01, 0.01, 0.0075, 0.005, 0.0025];
    assert!(rates.len() == 6 && rates.iter().zip(want).all(|(got, want)| (got - want).abs() < 1e-9), "learning rates {rates:?}, not {want:?}");

    // The finished run resumed elsewhere: nothing to take, and said so (it claimed to have
    // written a checkpoint, metrics and a config before).
    let mut args = vec!["--tokens".to_string(), dir.join("data.jsonl").display().to_string(), "--out".into(), dir.join("again").display().to_string()];
    args.extend(resume("part"));
    let again = show(&succeed(run_alone(&args, &["--sp", "1"])));
    assert!(again.contains("no step taken: the checkpoint had taken all 6 steps") && !dir.join("again/metrics.csv").exists(), "{again}");
    // The kept copy resumed in its run's folder would write over the later checkpoint (step
    // 6) and the metrics past step 3: refused, naming both and the ways on.
    let mut args = vec!["--tokens".to_string(), dir.join("data.jsonl").display().to_string()];
    args.extend(resume("part/step-3.ulysses"));
    let refused = run_alone(&args, &["--sp", "1"]);
    let text = show(&refused);
    assert!(!refused.status.success() && text.contains("is at step 3") && text.contains("at step 6") && text.contains("--overwrite"), "{text}");
    // A folder whose checkpoint is another line's at an earlier step than the copy resumed
    // there (a run that went on from an earlier copy): going on would write over that line's
    // only checkpoint, so it is refused too; a copy of the folder's own checkpoint is not.
    fs::create_dir_all(dir.join("lines")).unwrap();
    for (from, to) in [
        ("part/metrics.csv", "metrics.csv"),
        ("part/loss.png", "loss.png"),
        ("part/config.json", "config.json"),
        ("part/step-3.ulysses", "checkpoint.ulysses"),
        ("part/checkpoint.ulysses", "later.ulysses"),
        ("part/step-3.ulysses", "same.ulysses"),
    ] {
        fs::copy(dir.join(from), dir.join("lines").join(to)).unwrap();
    }
    let in_lines = |copy: &str, extra: &[&str]| {
        let mut args = vec!["--tokens".to_string(), dir.join("data.jsonl").display().to_string(), "--steps".into(), "8".into()];
        args.extend(resume(copy));
        args.extend(extra.iter().map(|a| a.to_string()));
        run_alone(&args, &["--sp", "1"])
    };
    let refused = in_lines("lines/later.ulysses", &["--check"]);
    let text = show(&refused);
    assert!(!refused.status.success() && text.contains("is at step 6") && text.contains("is another checkpoint (at step 3)") && text.contains("--overwrite to replace that checkpoint"), "{text}");
    succeed(in_lines("lines/same.ulysses", &["--check"]));
    // Replaced with --overwrite, and killed before its first checkpoint: the folder keeps no
    // checkpoint of the run it replaced for a `--resume lines` to go on with.
    let killed = in_lines("lines/later.ulysses", &["--overwrite", "--fault-kill", "7:0"]);
    assert!(!killed.status.success(), "{}", show(&killed));
    assert!(metric(&dir.join("lines"), 1).iter().any(|&(step, _)| step == 6), "the replacing run wrote its first row: {}", show(&killed));
    assert!(!dir.join("lines/checkpoint.ulysses").exists(), "the replaced run's checkpoint outlived the replacing run's first row");
    assert!(!dir.join("lines/loss.png").exists(), "the replaced run's curve outlived the replacing run's first row");
    assert!(dir.join("lines/later.ulysses").exists(), "the resumed copy went");
    // A --stop-after the checkpoint has passed is refused, not a run that takes no step.
    let mut args = vec!["--tokens".to_string(), dir.join("data.jsonl").display().to_string(), "--stop-after".into(), "3".into()];
    args.extend(resume("part"));
    let refused = run_alone(&args, &["--sp", "1"]);
    assert!(!refused.status.success() && show(&refused).contains("--stop-after 3: the checkpoint has already taken 6 steps"), "{}", show(&refused));
    let (full, part) = (losses(&dir.join("full")), losses(&dir.join("part")));
    println!("uninterrupted {full:?}\nresumed       {part:?}");
    assert_eq!(part.iter().map(|l| l.0).collect::<Vec<_>>(), (0..6).collect::<Vec<_>>());
    let (loss, params) = differences(&dir.join("part"), &dir.join("full"));
    assert!(loss <= 1e-6, "resumed losses differ by {loss:e}");
    assert_eq!(params, 0.0, "resumed parameters differ from the uninterrupted run's");
    let (loss, params) = differences(&dir.join("elsewhere"), &dir.join("full"));
    println!("resumed without SP: max |Δ| loss {loss:.2e}, parameters {params:.2e}");
    assert!(loss <= TOLERANCE && params <= TOLERANCE, "resumed at SP=1: loss {loss:e}, parameters {params:e}");
    let _ = fs::remove_dir_all(&dir);
}

/// With ranks as threads a resume takes the run's DP degree with the rest of its layout (it
/// ran at DP 1 before, the flag's default), and the run's warm-up even where that was the
/// default and `--steps` grows (it warmed up again, to the new steps' default, from part way
/// through the peak); a layout flag given names those of the run's it replaces; `--f32-head
/// false` turns off the run's `--f32-head`.
#[test]
fn a_resume_of_thread_ranks_keeps_their_dp_and_the_runs_warm_up() {
    let dir = workspace("resume-threads");
    let mut args = common_args(&dir, "run", 6);
    args.extend(["--stop-after".to_string(), "2".into()]);
    succeed(run_alone(&args, &["--sp", "2", "--dp", "2", "--f32-head"]));
    let resume = |extra: &[&str]| {
        let mut args = vec!["--tokens".to_string(), dir.join("data.jsonl").display().to_string(), "--check".into(), "--resume".into(), dir.join("run").display().to_string()];
        args.extend(extra.iter().map(|a| a.to_string()));
        show(&succeed(run_alone(&args, &[])))
    };
    let text = resume(&["--steps", "100"]);
    let taken = text.lines().find(|line| line.contains("resuming with the checkpoint's")).unwrap_or_else(|| panic!("nothing taken:\n{text}"));
    assert!(taken.contains("--warmup-steps 1") && taken.contains("--sp 2") && taken.contains("--dp 2") && taken.contains("--f32-head true"), "{text}");
    assert!(text.contains("sp 2 × dp 2"), "{text}");
    // A switch the run turned on, turned off by its value (a bare flag cannot say false).
    let text = resume(&["--f32-head", "false"]);
    let taken = text.lines().find(|line| line.contains("resuming with the checkpoint's")).unwrap_or_else(|| panic!("nothing taken:\n{text}"));
    assert!(!taken.contains("--f32-head") && text.contains("or the precision (--precision, --f32-head) differs from the checkpoint's run"), "{text}");
    let text = resume(&["--dp", "1"]);
    let expected = "the resumed run's --sp 2 are not kept: layout flags given here replace its layout as a whole";
    assert!(text.contains(expected) && text.contains("sp 4 × dp 1"), "expected {expected:?}:\n{text}");
    let _ = fs::remove_dir_all(&dir);
}

/// A resume takes the run's memory settings as a whole: with none given, all of them (and
/// `--progress` finds the run's `--checkpoint-layers`); with some given, those replace the
/// run's, and the ones not given again are named.
#[test]
fn a_resume_keeps_the_runs_memory_settings_or_names_those_it_replaces() {
    let dir = workspace("resume-memory");
    succeed(run_alone(&common_args(&dir, "tiled", 2), &["--sp", "2", "--checkpoint-layers", "--tile-tokens", "4", "--stop-after", "1"]));
    let resume = |extra: &[&str]| {
        let mut args = vec!["--tokens".to_string(), dir.join("data.jsonl").display().to_string(), "--resume".into(), dir.join("tiled").display().to_string(), "--check".into()];
        args.extend(extra.iter().map(|s| s.to_string()));
        show(&succeed(run_alone(&args, &[])))
    };
    let text = resume(&["--progress"]);
    assert!(text.contains("--checkpoint-layers, --tile-tokens 4") && !text.contains("not kept"), "{text}");
    // What a rank would need, by piece: the core over the whole sequence (16 tokens) with
    // half the heads at SP = 2, for the batch's 4 sequences.
    assert!(text.contains("memory: a rank's device needs about") && text.contains("(4 sequences × 16 tokens × 2 heads a rank)"), "{text}");
    let text = resume(&["--checkpoint-layers"]);
    assert!(text.contains("the resumed run's --tile-tokens 4 are not kept") && text.contains("give them again"), "{text}");
    // A run without layers to log: refused, naming the flag.
    let refused = run_alone(&common_args(&dir, "plain", 1), &["--progress", "--check"]);
    assert!(!refused.status.success() && show(&refused).contains("give --checkpoint-layers too"), "{}", show(&refused));
    // Planned for machines: a device of a GB holds this small run, one of a kB none; a step's
    // peak is estimated for checkpointed layers alone.
    let text = resume(&["--device-memory", "1"]);
    assert!(text.contains("plan: this run fits a device of 1.00 GB") && text.contains("the longest --seq-len that fits (in steps of 2048)"), "{text}");
    let text = resume(&["--device-memory", "0.000001"]);
    assert!(text.contains("this run does not fit a device of 0.00 GB") && text.contains("not even 2048 tokens"), "{text}");
    // Ranks that are threads share one GPU: each plans with its share (a GPU run checked on a
    // CPU build).
    let text = show(&succeed(run_alone(&common_args(&dir, "gpu", 1), &["--backend", "cuda", "--sp", "2", "--checkpoint-layers", "--check", "--device-memory", "1"])));
    assert!(text.contains("a device of 1.00 GB shared by its 2 ranks, threads of one process (0.50 GB each; for a GPU a rank, --check under the launcher"), "{text}");
    let refused = run_alone(&common_args(&dir, "plain", 1), &["--check", "--device-memory", "80"]);
    assert!(!refused.status.success() && show(&refused).contains("add --checkpoint-layers"), "{}", show(&refused));
    // The first layer's inputs offloaded alone, in place of the run's memory settings.
    let text = resume(&["--checkpoint-layers", "--offload-to-host", "--offload-layers", "1"]);
    assert!(text.contains("layers checkpointed, the first 1 layers' inputs on the host") && text.contains("--tile-tokens 4 are not kept"), "{text}");
    let _ = fs::remove_dir_all(&dir);
}

/// `--optimizer-in-backward`: ZeRO-3's host optimizer updating each layer as its backward
/// gives its gradients trains as the update at the step's end (without clipping: the losses
/// and parameters equal), says so in `--check` with the host holding no gradient part, is
/// kept by a resume that names no memory flag, and is refused with clipping.
#[test]
fn updating_in_the_backward_trains_as_zero_3_at_the_steps_end() {
    let dir = workspace("in-backward");
    let zero3 = ["--sp", "2", "--offload-optimizer", "--checkpoint-layers", "--zero", "3", "--max-grad-norm", "0"];
    succeed(run_alone(&common_args(&dir, "at-the-end", 4), &zero3));
    succeed(run_alone(&common_args(&dir, "in-backward", 4), &[&zero3[..], &["--optimizer-in-backward", "--stop-after", "2"]].concat()));
    let resume = [common_args(&dir, "in-backward", 4), vec!["--resume".into(), dir.join("in-backward").display().to_string()]].concat();
    let checked = show(&succeed(run_alone(&[resume.clone(), vec!["--check".into()]].concat(), &["--sp", "2"])));
    assert!(checked.contains("the optimizer on the host, updated in the backward") && checked.contains("of the optimizer's state;"), "{checked}");
    succeed(run_alone(&resume, &["--sp", "2"]));
    let (loss, params) = differences(&dir.join("in-backward"), &dir.join("at-the-end"));
    assert!(loss == 0.0 && params == 0.0, "updated in the backward: losses {loss:e}, parameters {params:e} apart from the update at the step's end");
    let refused = run_alone(&common_args(&dir, "clipped", 2), &["--sp", "2", "--offload-optimizer", "--checkpoint-layers", "--zero", "3", "--optimizer-in-backward"]);
    assert!(!refused.status.success() && show(&refused).contains("cannot clip to --max-grad-norm 1: give --max-grad-norm 0"), "{}", show(&refused));
    let _ = fs::remove_dir_all(&dir);
}

/// The optimizer on the host (`--offload-optimizer`) and ZeRO-3 (`--zero 3`: parameters and
/// gradients in parts too, each layer gathered for its pieces; the optimizer's parts on the
/// host or on the device) train as replicated AdamW does,
/// over 4 processes (SP=2 × DP=2, TCP), and evaluate the held-out batch as it does (ZeRO-3 a
/// layer at a time, or a layer at a time for rank 0 alone); ZeRO-3 stopped after 3 steps on 4 ranks resumes on 2 with the
/// uninterrupted run's losses; a checkpoint of sharded state is refused to a run without the
/// optimizer on the host, naming the flag.
#[test]
fn the_optimizer_on_the_host_and_zero_3_train_like_the_replicated_one_and_resume_at_another_world() {
    let dir = workspace("offload-optimizer");
    // burn's epsilon: PyTorch's (1e-8, the trainer's) turns a gradient's last bits, which the
    // implementations sum in other orders, into parameters 1e-5 apart within 6 steps.
    let args = |out: &str, steps| [common_args(&dir, out, steps), vec!["--adam-epsilon".into(), "1e-5".into()]].concat();
    let host = ["--sp", "2", "--offload-optimizer"];
    let zero3 = ["--sp", "2", "--offload-optimizer", "--checkpoint-layers", "--zero", "3"];
    succeed(run_launched(4, &args("replicated", 6), &["--sp", "2"]));
    // Layer checkpointing without ZeRO-3: the evaluation runs the layers as the step does.
    succeed(run_launched(4, &args("host", 6), &[&host[..], &["--checkpoint-layers"]].concat()));
    // Shards of 8 tokens in tiles of 4: the step's token-wise parts and the evaluation's in two.
    succeed(run_launched(4, &args("zero3", 6), &[&zero3[..], &["--tile-tokens", "4"]].concat()));
    // The optimizer on the device, and the held-out batch on world rank 0 alone (gathered whole).
    succeed(run_launched(4, &args("zero3-device", 6), &["--sp", "2", "--checkpoint-layers", "--zero", "3", "--eval-single-device"]));
    // Stopped, and resumed at another world: each part loaded onto the device as it is read.
    let device = ["--sp", "2", "--checkpoint-layers", "--zero", "3"];
    succeed(run_launched(4, &args("device-part", 6), &[&device[..], &["--stop-after", "3"]].concat()));
    let device_resumed = [args("device-part", 6), vec!["--resume".into(), dir.join("device-part").display().to_string()]].concat();
    succeed(run_launched(2, &device_resumed, &device));
    // ZeRO-3 in a world of one rank: no collective gathers or scatters.
    succeed(run_alone(&args("alone", 6), &["--sp", "1", "--offload-optimizer", "--checkpoint-layers", "--zero", "3"]));
    succeed(run_launched(4, &args("part", 6), &[&zero3[..], &["--stop-after", "3"]].concat()));
    let parts: Vec<String> = fs::read_dir(dir.join("part/optimizer-step-000000003-of-00004")).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(parts.len(), 4, "one state file per rank of 4: {parts:?}");
    let mut resumed = args("part", 6);
    resumed.extend(["--resume".to_string(), dir.join("part").display().to_string()]);
    // Nothing said of where the state lives: the checkpoint's (the optimizer's parts on the
    // host, ZeRO-3, layers checkpointed).
    let checked = show(&succeed(run_alone(&[resumed.clone(), vec!["--check".into()]].concat(), &["--sp", "2"])));
    assert!(checked.contains("--offload-optimizer, --zero 3, --checkpoint-layers") && checked.contains("ZeRO stage 3, the optimizer on the host"), "{checked}");
    assert!(checked.contains("ZeRO-3's gathered layer and its gradients") && checked.contains("a rank's host memory keeps") && checked.contains("of the optimizer's state and gradient parts"), "{checked}");
    // Any of those flags given, the run's own: a replicated optimizer cannot take the parts.
    let refused = run_launched(2, &resumed, &["--sp", "2", "--checkpoint-layers"]);
    assert!(!refused.status.success() && show(&refused).contains("(--offload-optimizer or --zero 3) true, this one has false"), "{}", show(&refused));
    // Resumed with the parameters' parts on the host too; alone, that flag is refused.
    succeed(run_launched(2, &resumed, &[&zero3[..], &["--offload-parameters"]].concat()));
    let alone = run_alone(&args("parameters-alone", 2), &["--sp", "2", "--offload-parameters"]);
    assert!(!alone.status.success() && show(&alone).contains("add --zero 3 and --offload-optimizer"), "{}", show(&alone));

    println!(
        "replicated {:?}\nhost       {:?}\nZeRO-3     {:?}\n on device {:?}\nresumed    {:?}",
        losses(&dir.join("replicated")),
        losses(&dir.join("host")),
        losses(&dir.join("zero3")),
        losses(&dir.join("zero3-device")),
        losses(&dir.join("part"))
    );
    // A replicated run over a sharded one (--overwrite) takes its optimizer's parts away with
    // its checkpoint (12 bytes a parameter: 96 GB at 8B); none of its own commits would.
    let sharded_state = |run: &str| fs::read_dir(dir.join(run)).unwrap().filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with("optimizer-step-")).count();
    fs::create_dir_all(dir.join("over")).unwrap();
    for entry in fs::read_dir(dir.join("host")).unwrap() {
        let entry = entry.unwrap();
        let to = dir.join("over").join(entry.file_name());
        if entry.path().is_dir() {
            fs::create_dir_all(&to).unwrap();
            for part in fs::read_dir(entry.path()).unwrap() {
                let part = part.unwrap();
                fs::copy(part.path(), to.join(part.file_name())).unwrap();
            }
        } else {
            fs::copy(entry.path(), to).unwrap();
        }
    }
    assert_eq!(sharded_state("over"), 1, "the sharded run's state parts");
    succeed(run_alone(&args("over", 2), &["--sp", "2", "--overwrite"]));
    assert_eq!(sharded_state("over"), 0, "the overwritten run's state parts stayed");
    for run in ["host", "zero3", "zero3-device", "device-part", "part", "alone"] {
        let (loss, params) = differences(&dir.join(run), &dir.join("replicated"));
        println!("{run} against replicated: max |Δ| loss {loss:.2e}, parameters {params:.2e}");
        assert!(loss <= 1e-6 && params <= TOLERANCE, "{run}: losses differ by {loss:e}, parameters by {params:e}");
        let (held_out, reference) = (eval_losses(&dir.join(run)), eval_losses(&dir.join("replicated")));
        println!("{run} held-out {held_out:?}, replicated {reference:?}");
        assert!(!reference.is_empty() && held_out.len() == reference.len(), "{run}: held-out losses {held_out:?}, replicated {reference:?}");
        for ((step, loss), (reference_step, reference_loss)) in held_out.iter().zip(&reference) {
            assert!(step == reference_step && loss.is_finite() && (loss - reference_loss).abs() <= 1e-6, "{run}: held-out loss {loss} at step {step}, replicated {reference_loss} at {reference_step}");
        }
    }
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn layouts_that_cannot_work_fail_before_any_work_with_the_fix() {
    let dir = workspace("validation");
    let args = common_args(&dir, "run", 2);
    // Without a launcher's variables but `set`.
    let launched_by = |set: &[(&str, &str)], extra: &[&str]| {
        let mut command = Command::new(trainer());
        for name in ["RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_ID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"] {
            command.env_remove(name);
        }
        command.args(&args).args(extra).envs(set.iter().copied()).output().unwrap()
    };
    let one_task_step = [("SLURM_PROCID", "0"), ("SLURM_STEP_ID", "0"), ("SLURM_STEP_NUM_TASKS", "1"), ("SLURM_LOCALID", "0"), ("SLURM_NODEID", "0"), ("SLURM_STEP_TASKS_PER_NODE", "1"), ("SLURM_STEP_NODELIST", "gpu07")];
    let cases: [(Output, &str); 6] = [
        (run_alone(&args, &["--sp", "8"]), "q has 4 heads but its all-to-all (Ulysses) group has 8 ranks"),
        (run_alone(&args, &["--sp", "2", "--dp", "3"]), "must be a multiple of dp_size × grad_accumulation = 3"),
        (run_launched(2, &args, &["--sp", "4"]), "divisors of 2: [1, 2]"),
        (launched_by(&[("RANK", "0")], &[]), "WORLD_SIZE is not set"),
        // One of mpirun's processes, each of which would run the whole job.
        (launched_by(&[("OMPI_COMM_WORLD_SIZE", "2")], &[]), "OMPI_COMM_WORLD_SIZE=2: this process is one of 2 that an MPI launcher"),
        // --launch process in an srun step of one task, which runs threads.
        (launched_by(&one_task_step, &["--launch", "process"]), "--launch process, but this is no srun step of several tasks"),
    ];
    for (output, expected) in cases {
        let text = show(&output);
        assert!(!output.status.success() && text.contains(expected), "expected {expected:?}:\n{text}");
        assert!(!dir.join("run").join("metrics.csv").exists(), "no step may run:\n{text}");
    }
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_model_the_host_cannot_hold_is_refused_before_it_is_built() {
    let dir = workspace("too-large");
    // A 70B shape on the CPU backend at SP = 4 (the default): 68.5e9 parameters, with their
    // gradients and AdamW's moments 1.1 TB a rank. Its address space capped at 4 GB, the trainer could not even build the
    // model (274 GB in f32): a refusal that comes after building it aborts on allocation.
    let mut args = common_args(&dir, "run", 2);
    for (flag, value) in [("--d-model", "8192"), ("--layers", "80"), ("--heads", "64"), ("--kv-heads", "8"), ("--ffn-hidden", "28672")] {
        set_flag(&mut args, flag, value);
    }
    let output = Command::new("sh").args(["-c", "ulimit -v 4000000 && exec \"$@\"", "sh", trainer()]).args(&args).args(["--launch", "threads"]).output().unwrap();
    let text = show(&output);
    assert!(!output.status.success(), "{text}");
    // Counted by hand: embedding and head (256 ids), per layer q, k, v, o, gate, up, down and
    // two norms, the final norm.
    let (d, ff, kv, ids) = (8192u64, 28672, 8 * 128, 256);
    let parameters = 2 * ids * d + 80 * (2 * d * d + 2 * d * kv + 3 * d * ff + 2 * d) + d;
    // 16 bytes a parameter (f32 parameters, gradients, AdamW's moments) on each of 4 ranks.
    let needed = format!("for 4 rank(s) on this host, needs {:.2} GB of host memory", (4 * 16 * parameters) as f64 / 1e9);
    let devices = format!("what the ranks' devices keep (the CPU backend's memory is the host's: {parameters} parameters, {:.2} GB a rank)", (16 * parameters) as f64 / 1e9);
    for expected in [needed.as_str(), devices.as_str(), "--zero 3"] {
        assert!(text.contains(expected), "expected {expected:?}:\n{text}");
    }
    assert!(!dir.join("run").join("metrics.csv").exists(), "no step may run:\n{text}");
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn settings_that_cannot_train_are_refused_by_flag_before_any_file_is_written() {
    let dir = workspace("settings");
    let cases: [(&str, &str, &str); 22] = [
        ("--learning-rate", "-1", "learning_rate (--learning-rate) must be a finite number above 0"),
        ("--learning-rate", "nan", "learning_rate (--learning-rate) must be a finite number above 0"),
        ("--learning-rate", "inf", "learning_rate (--learning-rate) must be a finite number above 0"),
        ("--d-model", "0", "d_model (--d-model) must be at least 1"),
        ("--ffn-hidden", "0", "ffn_hidden (--ffn-hidden) must be at least 1"),
        ("--layers", "0", "n_layers (--layers) must be at least 1"),
        ("--sp", "0", "sp_size (--sp) must be at least 1, got 0"),
        ("--dp", "0", "dp_size (--dp) must be at least 1, got 0"),
        ("--ring", "0", "ring_size (--ring) must be at least 1, got 0"),
        ("--corpus", "README.md", "cannot be used with"),
        ("--zero", "2", "zero_stage (--zero) 2: use 0"),
        ("--zero", "3", "add --checkpoint-layers"),
        // What the CPU backend cannot run (refused by --check too, below).
        ("--precision", "bf16", "the CPU backend (NdArray) computes neither bf16 nor f16"),
        ("--transport", "nccl", "--transport nccl needs a CUDA backend"),
        // Nor the compile-only one, whatever the binary's features (with --transport nccl, below).
        ("--backend", "cuda-compile-only", "--transport nccl needs a GPU: --backend cuda-compile-only runs without one"),
        ("--eval-every", "0", "with --eval-every 0 evaluates nothing"),
        // Past any model or run: refused by name (arithmetic on them overflowed).
        ("--seq-len", "18446744073709551615", "seq_len (--seq-len) 18446744073709551615 is past any model or run"),
        ("--layers", "18446744073709551615", "n_layers (--layers) 18446744073709551615 is past any model or run"),
        // Its padding multiple (twice it, with --zigzag) overflowed before any check.
        ("--sp", "9223372036854775808", "sp_size (--sp) 9223372036854775808 is past any run this trainer takes"),
        ("--batch-size", "100000000", "batch_size (--batch-size) 100000000 is past any model or run"),
        // Past 2^20 the corpus's windows of one step repeat the next's.
        ("--batch-size", "2097152", "batch_size (--batch-size) 2097152 is past any model or run this trainer takes (at most 1048576)"),
        // With --eval-only, whose batch the step's rules do not check (it divided by zero).
        ("--batch-size", "0", "batch_size (--batch-size) must be from 1 to 1048576 with --eval-only"),
    ];
    // With --eval-only, training's flags are noted as ignored, not checked (a learning rate
    // below 0 and --zero 3 without --checkpoint-layers were refused).
    let args = qwen3_args(&dir.join("data.jsonl"), &format!("--eval-only --learning-rate=-1 --zero 3 --check --out {}", dir.join("run").display()));
    let output = Command::new(trainer()).args(args).args(["--launch", "threads"]).output().unwrap();
    let text = show(&output);
    assert!(output.status.success() && text.contains("trains nothing and saves nothing: --learning-rate,") && text.contains("--zero change nothing"), "{text}");
    for (flag, value, expected) in cases {
        // The shared arguments with this flag's value replaced (or added).
        let mut args = common_args(&dir, "run", 2);
        set_flag(&mut args, flag, value);
        if flag == "--eval-every" {
            // With a held-out file, which it would never evaluate.
            let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data-of-nothing.jsonl");
            args = qwen3_args(&dir.join("data.jsonl"), &format!("--eval-data {} --eval-every 0 --out {}", data.display(), dir.join("run").display()));
        }
        if flag == "--backend" {
            set_flag(&mut args, "--transport", "nccl");
        }
        if (flag, value) == ("--batch-size", "0") {
            args = qwen3_args(&dir.join("data.jsonl"), &format!("--eval-only --batch-size 0 --out {}", dir.join("run").display()));
        }
        // Refused by --check alike, which trains nothing.
        for check in [&[][..], &["--check"]] {
            let output = Command::new(trainer()).args(merge_flag_values(&args)).args(["--launch", "threads"]).args(check).output().unwrap();
            let text = show(&output);
            assert!(!output.status.success() && text.contains(expected), "{flag} {value} {check:?}: expected {expected:?}:\n{text}");
            assert!(!text.contains("panicked"), "{flag} {value} panicked:\n{text}");
            assert!(!dir.join("run").exists(), "{flag} {value} wrote into the run folder:\n{text}");
        }
    }
    let _ = fs::remove_dir_all(&dir);
}

/// Rank 0 writes a replicated checkpoint while the ranks train on: a write slower than the
/// collectives' timeout (5 s against 8; the timeout holds for every collective of the run, so
/// not so short that a loaded machine's lag between ranks trips it) stops no rank, and the last
/// checkpoint is whole.
#[test]
fn a_checkpoint_written_slower_than_the_collective_timeout_stops_no_rank() {
    let dir = workspace("slow-checkpoint");
    let output = launched(2, "20")
        .args(common_args(&dir, "run", 5))
        .args(["--sp", "2", "--checkpoint-every", "2", "--eval-every", "0", "--fault-slow-checkpoint-write", "8"])
        .env("ULYSSES_COLLECTIVE_TIMEOUT", "5")
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    // The checkpoint after step 4 waits for step 2's, still being written: every rank with rank
    // 0 (rank 1 timed out in step 5's first collective, naming rank 0 as stuck).
    succeed(output);
    assert_eq!(read_checkpoint_state::<RunState>(&dir.join("run")).unwrap().completed_steps, 5);
    // A write that fails (the checkpoint after step 5, counting from 0 as the metrics do)
    // stops the run at the step that finds it done, not at the next checkpoint (after step
    // 11), naming the step whose checkpoint it was.
    let output = run_alone(&common_args(&dir, "failed", 12), &["--sp", "2", "--checkpoint-every", "6", "--eval-every", "0", "--fault-failed-checkpoint-write"]);
    let text = show(&output);
    assert!(!output.status.success() && text.contains("step 5: checkpoint") && text.contains("test hook: the write failed"), "{text}");
    let steps = fs::read_to_string(dir.join("failed/metrics.csv")).map(|metrics| metrics.lines().count() - 1).expect("metrics of the steps taken");
    // Found done after step 6 at the soonest; a write thread scheduled late finds it later.
    assert!((6..12).contains(&steps), "the run took {steps} steps, its checkpoint after step 5 failed:\n{text}");
    let _ = fs::remove_dir_all(&dir);
}

/// A rank 0 that fails while its checkpoint's write goes on (a slow disk: 15 s) leaves its
/// group at once, the write finishing after: its peer, waiting in the step's collective, names
/// its loss within the collective timeout (10 s) and the checkpoint is whole. It stayed in the
/// group through the write, and the peer timed out calling it stuck.
#[test]
fn a_rank_that_fails_while_its_checkpoint_is_written_leaves_its_peers_at_once() {
    let dir = workspace("fails-while-writing");
    let output = launched(2, "30")
        .args(common_args(&dir, "run", 6))
        .args(["--sp", "2", "--checkpoint-every", "2", "--eval-every", "0", "--fault-slow-checkpoint-write", "15", "--fault-fail", "3:0"])
        .env("ULYSSES_COLLECTIVE_TIMEOUT", "10")
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let text = show(&output);
    assert!(!output.status.success() && rank_error(&text, 0).contains("test hook: this rank fails as the step begins"), "{text}");
    let error = rank_error(&text, 1);
    assert!(!error.contains("timed out") && error.contains("rank 0 left the group"), "rank 1 did not name rank 0's loss: {text}");
    assert_eq!(read_checkpoint_state::<RunState>(&dir.join("run")).unwrap().completed_steps, 2, "the checkpoint written as rank 0 failed");
    let _ = fs::remove_dir_all(&dir);
}

/// A rank process that fails (rank 0's checkpoint write, under the launcher) says why as it
/// fails, before it leaves the job (leaving, it waits for the others, and the launcher may stop
/// it there), and once: not again when the process ends.
#[test]
fn a_failing_rank_process_says_why_once() {
    let dir = workspace("failed-process");
    let output = launched(2, "5")
        .args(common_args(&dir, "run", 12))
        .args(["--sp", "2", "--checkpoint-every", "6", "--eval-every", "0", "--fault-failed-checkpoint-write"])
        .output()
        .unwrap();
    let text = show(&output);
    let said = text.lines().filter(|line| line.starts_with("[rank 0] error:") && line.contains("step 5: checkpoint")).count();
    assert!(!output.status.success() && said == 1, "rank 0 said why {said} times:\n{text}");
    let _ = fs::remove_dir_all(&dir);
}

/// A rank that dies while rank 0 still writes a checkpoint (a slow disk: 5 s): `ulysses-launch`
/// waits for the write, saying so, before it stops the ranks, where its grace (1 s, then 1 s
/// after SIGTERM) would have killed rank 0 mid-write and lost the checkpoint.
#[test]
fn a_checkpoint_being_written_when_a_rank_dies_is_kept() {
    let dir = workspace("write-then-die");
    let output = launched(2, "1")
        .args(common_args(&dir, "run", 8))
        .args(["--sp", "2", "--checkpoint-every", "2", "--eval-every", "0", "--fault-slow-checkpoint-write", "5", "--fault-kill", "3:1"])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let text = show(&output);
    assert!(!output.status.success() && text.contains("waiting for rank 0's write of the checkpoint after step 2"), "{text}");
    let kept = read_checkpoint_state::<RunState>(&dir.join("run")).unwrap_or_else(|e| panic!("no checkpoint: {e}\n{text}"));
    assert_eq!(kept.completed_steps, 2, "{text}");
    let _ = fs::remove_dir_all(&dir);
}

/// `--save-hf` of a replicated run is written by rank 0 on the checkpoint's thread too: a write
/// slower than the collective timeout stops no rank, and the folder holds the last step's model
/// (the run's own, in the checkpoint's f32).
#[test]
fn a_hugging_face_save_written_slower_than_the_collective_timeout_stops_no_rank() {
    let dir = workspace("slow-save-hf");
    let checkpoint = qwen3_and_tokenizer().0;
    let saved = dir.join("saved-hf");
    let output = launched(2, "20")
        .args(["--tokens", &dir.join("data.jsonl").display().to_string(), "--out", &dir.join("run").display().to_string(), "--model", &checkpoint.display().to_string()])
        .args(["--seq-len", "16", "--batch-size", "4", "--steps", "3", "--learning-rate", "0.01", "--sp", "2", "--checkpoint-every", "2", "--eval-every", "0"])
        .args(["--save-hf", &saved.display().to_string(), "--fault-slow-checkpoint-write", "8"])
        .env("ULYSSES_COLLECTIVE_TIMEOUT", "5")
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    let text = show(&succeed(output));
    assert!(text.contains("step=3") && text.contains("saved in Hugging Face's format"), "{text}");
    assert_saved_hf_is_the_run_model(&saved, &dir.join("run"), DType::F32);
    let _ = fs::remove_dir_all(&dir);
}

/// A fine-tune resumed (replicated, and with the optimizer on the host) takes its model from
/// the checkpoint alone: `--model`'s weights are not loaded (minutes for an 8B model), so its
/// losses are the uninterrupted run's though those weights are zeros by then (names, shapes
/// and sizes kept).
#[test]
fn a_resumed_fine_tune_loads_no_weight_of_its_model() {
    let dir = workspace("resume-model");
    let model = dir.join("model");
    fs::create_dir_all(&model).unwrap();
    for name in ["config.json", "generation_config.json", "model.safetensors"] {
        fs::copy(qwen3_and_tokenizer().0.join(name), model.join(name)).unwrap();
    }
    for optimizer in [&[][..], &["--offload-optimizer"]] {
        let args = |out: &str, extra: &[&str]| {
            let mut args: Vec<String> = ["--tokens", &dir.join("data.jsonl").display().to_string(), "--out", &dir.join(out).display().to_string(), "--model", &model.display().to_string()]
                .map(String::from)
                .into();
            args.extend(["--seq-len", "16", "--batch-size", "4", "--steps", "3", "--learning-rate", "0.01", "--sp", "2", "--eval-every", "0"].map(String::from));
            args.extend(optimizer.iter().chain(extra).map(|a| a.to_string()));
            args
        };
        let (full, part) = (format!("full{}", optimizer.len()), format!("part{}", optimizer.len()));
        let weights = fs::read(qwen3_and_tokenizer().0.join("model.safetensors")).unwrap();
        fs::write(model.join("model.safetensors"), &weights).unwrap();
        succeed(run_alone(&args(&full, &[]), &[]));
        succeed(run_alone(&args(&part, &["--stop-after", "1"]), &[]));
        // Every value zero, the header (names, dtypes, shapes, offsets) as it was.
        let data_start = 8 + u64::from_le_bytes(weights[..8].try_into().unwrap()) as usize;
        fs::write(model.join("model.safetensors"), [&weights[..data_start], &vec![0u8; weights.len() - data_start][..]].concat()).unwrap();
        let resumed = show(&succeed(run_alone(&args(&part, &["--resume", &dir.join(&part).display().to_string()]), &[])));
        assert!(resumed.contains("the model's weights are the checkpoint's; those of --model"), "{optimizer:?}: {resumed}");
        let (full, part) = (losses(&dir.join(&full)), losses(&dir.join(&part)));
        assert!(full.len() == 3 && full == part, "{optimizer:?}: uninterrupted {full:?}, resumed {part:?}");
    }
    let _ = fs::remove_dir_all(&dir);
}

/// The `--save-hf` folder `saved` holds the model the run in `out` saved, in `dtype` (f32, or
/// rounded to bf16), every tensor bit for bit, and its config.json names that dtype.
fn assert_saved_hf_is_the_run_model(saved: &Path, out: &Path, dtype: DType) {
    let config: serde_json::Value = serde_json::from_str(&fs::read_to_string(saved.join("config.json")).unwrap()).unwrap();
    let named = match dtype {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        other => panic!("{other:?} is not compared here"),
    };
    assert_eq!(config["torch_dtype"], named, "{}: the weights' dtype", saved.display());
    let loaded = ulysses_models::from_pretrained::<Cpu>(saved, &Default::default()).unwrap_or_else(|e| panic!("{} does not load: {e}", saved.display()));
    let trained = parameters(out);
    let loaded: Vec<_> = float_parameters(&loaded.model).into_iter().map(|p| (p.path, p.values.into_data().to_vec::<f32>().unwrap())).collect();
    assert_eq!(loaded.len(), trained.len());
    for ((name, got), (trained_name, want)) in loaded.iter().zip(&trained) {
        assert_eq!(name, trained_name);
        let rounded = want.iter().map(|&v| if dtype == DType::BF16 { burn::tensor::bf16::from_f32(v).to_f32() } else { v });
        assert!(got.iter().zip(rounded).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}: {} is not the model of the run's last step", saved.display());
    }
}

/// Under a launcher, `--sp` × `--dp` must make the launched world: refused by `--check`, before
/// any rank reads data or loads a model.
#[test]
fn a_layout_that_does_not_make_the_launched_world_is_refused_by_check() {
    let dir = workspace("world-layout");
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let launched = |extra: &[&str]| {
        let output = Command::new(trainer())
            .args(common_args(&dir, "run", 1))
            .args(["--check"])
            .args(extra)
            .envs([("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "4"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port.as_str())])
            .env_remove("CUDA_VISIBLE_DEVICES")
            .output()
            .unwrap();
        (output.status.success(), show(&output))
    };
    let (ok, text) = launched(&["--sp", "2", "--dp", "1"]);
    assert!(!ok && text.contains("started 4 ranks (WORLD_SIZE)") && text.contains("--dp 1 makes 2"), "{text}");
    let (ok, text) = launched(&["--sp", "2", "--dp", "2"]);
    assert!(ok && text.contains("sp 2 × dp 2"), "{text}");
    // The library's variable for the SP degree, which the trainer does not read: refused where
    // it says otherwise than --sp (it was ignored).
    for (value, refused) in [("4", true), ("2", false)] {
        let output = Command::new(trainer())
            .args(common_args(&dir, "run", 1))
            .args(["--check", "--sp", "2"])
            .envs([("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "4"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port.as_str())])
            .env("ULYSSES_SP_SIZE", value)
            .env_remove("CUDA_VISIBLE_DEVICES")
            .output()
            .unwrap();
        let text = show(&output);
        let named = text.contains("ULYSSES_SP_SIZE=4 but --sp 2: the trainer takes its sequence-parallel degree from --sp");
        assert!(output.status.success() != refused && named == refused, "ULYSSES_SP_SIZE={value}: {text}");
    }
    // SP groups of 4 over nodes of 2 ranks: said.
    let output = Command::new(trainer())
        .args(common_args(&dir, "run", 1))
        .args(["--check", "--sp", "4"])
        .envs([("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "2"), ("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", port.as_str())])
        .output()
        .unwrap();
    let text = show(&output);
    assert!(output.status.success() && text.contains("--sp 4 groups span nodes (this node runs 2 ranks, from rank 0)"), "{text}");
    // --device on each of the node's 4 processes, which see every GPU: all on one.
    let (ok, text) = launched(&["--sp", "2", "--backend", "cuda", "--device", "1"]);
    assert!(!ok && text.contains("--device 1 puts each of this node's 4 processes on GPU 1"), "{text}");
    // Each process shown one GPU (`srun --gpus-per-task=1`): --device 0 is that one.
    let output = Command::new(trainer())
        .args(common_args(&dir, "run", 1))
        .args(["--check", "--sp", "2", "--backend", "cuda", "--device", "0"])
        .envs([("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "4"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port.as_str())])
        .env("CUDA_VISIBLE_DEVICES", "3")
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", show(&output));
    // A backend this binary lacks is refused before the data is read (a --tokens file that is
    // not there is not reached); --check goes on and says which feature gives it.
    if !cfg!(feature = "cuda") {
        let mut args = common_args(&dir, "run", 1);
        set_flag(&mut args, "--tokens", dir.join("not-there.jsonl").to_str().unwrap());
        let refused = run_alone(&args, &["--backend", "cuda-fused"]);
        let text = show(&refused);
        assert!(!refused.status.success() && text.contains("--backend cuda-fused: this binary was built without it: rebuild with `--features cuda`"), "{text}");
    }
    let _ = fs::remove_dir_all(&dir);
}

/// A checkpoint whose RoPE is dynamic NTK trains up to its max_position_embeddings (plain RoPE
/// there, as transformers computes it); a longer --seq-len, where transformers' frequencies
/// change with each batch, is refused before any step. Plain RoPE past it is warned of.
#[test]
fn dynamic_rope_trains_up_to_max_position_embeddings_and_refuses_past_it() {
    let dir = workspace("dynamic-rope");
    let texts = texts_to_train_on(&dir);
    let mut config: serde_json::Value = serde_json::from_str(&fs::read_to_string(qwen3_and_tokenizer().0.join("config.json")).unwrap()).unwrap();
    config["max_position_embeddings"] = serde_json::json!(32);
    config["rope_parameters"] = serde_json::json!({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6});
    let config_file = dir.join("config.json");
    fs::write(&config_file, config.to_string()).unwrap();
    let args = ["--corpus", &texts.display().to_string(), "--hf-config", &config_file.display().to_string(), "--out", &dir.join("run").display().to_string()].map(String::from);
    let check = |seq_len: &str, sp: &str| outcome(run_alone(&args, &["--seq-len", seq_len, "--sp", sp, "--steps", "1", "--check"]));
    let (ok, text) = check("64", "4");
    assert!(!ok && text.contains("--seq-len 64 is past the checkpoint's max_position_embeddings of 32") && text.contains("rope_type \"dynamic\""), "{text}");
    // Padded to a multiple of the SP degree, a batch's positions would pass it too (unpacked,
    // the padding's count on past the last token).
    let (ok, text) = check("32", "3");
    assert!(!ok && text.contains("(padded to 33, a multiple of 3)") && text.contains("train at --seq-len 30 or below"), "{text}");
    for (seq_len, sp) in [("32", "4"), ("31", "4"), ("30", "3")] {
        let (ok, text) = check(seq_len, sp);
        assert!(ok && text.contains("checked:"), "--seq-len {seq_len} at sp {sp}: {text}");
    }
    // Plain RoPE past its context trains, warned of whatever the data (a --corpus here; the
    // warning was --data's alone).
    config["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 1e6});
    fs::write(&config_file, config.to_string()).unwrap();
    let (ok, text) = check("64", "4");
    assert!(ok && text.contains("--seq-len 64 is past the checkpoint's context of 32") && text.contains("never trained"), "{text}");
    let _ = fs::remove_dir_all(&dir);
}

/// With --eval-every 0 the corpus is trained whole (nothing would evaluate a held-out part): a
/// sequence as long as the whole corpus fits, where the last 10% held out would not leave room.
#[test]
fn a_corpus_is_trained_whole_with_eval_every_0() {
    let dir = workspace("corpus-whole");
    fs::create_dir_all(&dir).unwrap();
    let corpus = dir.join("corpus.txt");
    fs::write(&corpus, "word ".repeat(1000)).unwrap();
    let args = ["--corpus", &corpus.display().to_string(), "--out", &dir.join("run").display().to_string()].map(String::from);
    let check = |eval_every: &str| outcome(run_alone(&args, &["--eval-every", eval_every, "--seq-len", "4800", "--batch-size", "1", "--steps", "1", "--check", "--sp", "1"]));
    let (ok, text) = check("0");
    assert!(ok && text.contains("checked:"), "{text}");
    let (ok, text) = check("10");
    assert!(!ok && text.contains("--seq-len 4800 does not fit the corpus"), "{text}");
    let _ = fs::remove_dir_all(&dir);
}

/// The run's folder is never inside a folder the run reads (--corpus too: a later run would
/// read its checkpoint as text) nor inside its --save-hf folder (which a save replaces
/// whole), and --save-hf is not inside what the run reads.
#[test]
fn run_and_save_folders_inside_what_the_run_reads_or_replaces_are_refused() {
    let dir = workspace("folders-inside");
    let texts = texts_to_train_on(&dir);
    let config = qwen3_and_tokenizer().0.join("config.json");
    let check = |extra: &[String]| {
        let output = Command::new(trainer()).args(["--corpus", &texts.display().to_string(), "--seq-len", "16", "--steps", "1", "--check", "--launch", "threads"]).args(extra).output().unwrap();
        (output.status.success(), show(&output))
    };
    let path = |p: &Path| p.display().to_string();
    for (extra, expected) in [
        (vec!["--out".to_string(), path(&texts.join("run"))], "lies in the --corpus folder"),
        (vec!["--out".into(), path(&dir.join("hf/run")), "--hf-config".into(), path(&config), "--save-hf".into(), path(&dir.join("hf"))], "lies in the --save-hf folder"),
    ] {
        let (ok, text) = check(&extra);
        assert!(!ok && text.contains(expected), "{extra:?}: expected {expected:?}:\n{text}");
    }
    let (ok, text) = check(&["--out".into(), path(&dir.join("run")), "--hf-config".into(), path(&config), "--save-hf".into(), path(&texts.join("model"))]);
    assert!(!ok && text.contains("lies in the --corpus folder"), "{text}");
    // Apart, they pass.
    let (ok, text) = check(&["--out".into(), path(&dir.join("run")), "--hf-config".into(), path(&config), "--save-hf".into(), path(&dir.join("model"))]);
    assert!(ok && text.contains("checked:"), "{text}");
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn flags_that_change_nothing_in_the_run_are_warned_by_name() {
    let dir = workspace("ignored-flags");
    let data = dir.join("documents.jsonl");
    let lines: Vec<String> = (0..6).map(|i| serde_json::json!({ "input_ids": (1..13).map(|t| i * 13 + t).collect::<Vec<i64>>() }).to_string()).collect();
    fs::write(&data, lines.join("\n")).unwrap();
    let args = |extra: &str| qwen3_args(&data, &format!("--seq-len 16 --batch-size 2 --out {} --check {extra}", dir.join("run").display()));
    // --check with --eval-only evaluates nothing (a rank killed before the evaluation would
    // stop it): it says what it would evaluate.
    let text = show(&succeed(run_alone(&args("--eval-only --steps 9 --learning-rate 0.5 --zigzag --device 1 --f32-head --fault-kill-before-eval 0 --profile --pack"), &[])));
    for expected in [
        "checked: an evaluation of all 6 sequences (up to 16 tokens each)",
        "--zigzag cuts each sequence over the ring, and --ring 1 makes none",
        "--device picks a GPU, and the CPU backend has one device",
        "under --precision f32 they are f32 already",
        "--eval-only trains nothing and saves nothing: --steps, --learning-rate, --out, --profile change nothing",
        "--pack makes paragraphs documents, and --data is read as documents always (packed): it changes nothing",
    ] {
        assert!(text.contains(expected), "expected {expected:?}:\n{text}");
    }
    // Memory flags: every rank evaluates the whole model; a batch that does not divide over
    // the DP replicas (each evaluates whole batches), accumulation and all.
    let text = show(&succeed(run_alone(&args("--eval-only --zero 3 --checkpoint-layers --offload-optimizer --eval-single-device --grad-accumulation 3"), &["--sp", "2", "--dp", "3"])));
    let expected = "--eval-only holds the whole model on every rank and evaluates over every SP group: --zero, --offload-optimizer, --eval-single-device change nothing";
    assert!(text.contains(expected) && text.contains("sp 2 × dp 3"), "expected {expected:?}:\n{text}");
    // A transport between processes, for ranks that are threads; a comparison of the ranks'
    // parameters where each holds parts of them.
    // Checkpoints every 5 steps where none is written; a schedule's floor where it does not fall.
    let text = show(&succeed(run_alone(
        &args("--transport tcp --zero 3 --checkpoint-layers --offload-optimizer --check-parameters-every 5 --bytes-ok --no-save --checkpoint-every 5 --lr-schedule constant --min-lr-ratio 0.2 --eval-single-device --eval-every 0"),
        &["--sp", "2"],
    )));
    for expected in [
        "--eval-single-device says how the held-out loss is computed, and --eval-every 0 computes none: it changes nothing",
        "--transport connects ranks that are processes, and these ranks are threads of this one: it changes nothing",
        "this run reads --data or --tokens: it changes nothing",
        "--check-parameters-every compares the ranks' parameters, and under --zero 3 each holds its own part of them: it changes nothing",
        "--checkpoint-every says how often a checkpoint is written, and --no-save writes none (nor a --save-hf): it changes nothing",
        "--min-lr-ratio is where a schedule's fall ends, and --lr-schedule constant does not fall: it changes nothing",
    ] {
        assert!(text.contains(expected), "expected {expected:?}:\n{text}");
    }
    // An export the run cannot write as asked (a sharded optimizer's bf16 compute copy, as
    // f32) is refused by --check, before the model is read: a GPU run checked on a CPU build.
    let hf = dir.join("hf").display().to_string();
    let refused = run_alone(&args(&format!("--backend cuda --precision bf16 --offload-optimizer --save-hf {hf} --save-hf-dtype f32")), &[]);
    let expected = "--save-hf-dtype F32: this run exports its BF16 compute copy";
    assert!(!refused.status.success() && show(&refused).contains(expected), "expected {expected:?}:\n{}", show(&refused));
    // Data that holds no batch out (3 sequences, batch 2): an evaluation asked for would never
    // run. Refused where --eval-every is given, said where it is the default.
    let few = dir.join("few.jsonl");
    fs::write(&few, lines[..3].join("\n")).unwrap();
    let few_args = |extra: &str| qwen3_args(&few, &format!("--seq-len 16 --batch-size 2 --out {} --check {extra}", dir.join("few").display()));
    let refused = run_alone(&few_args("--eval-every 5"), &["--sp", "2"]);
    let expected = "--eval-every 5 evaluates nothing";
    assert!(!refused.status.success() && show(&refused).contains(expected) && show(&refused).contains("--eval-data"), "expected {expected:?}:\n{}", show(&refused));
    let warned = show(&succeed(run_alone(&few_args(""), &["--sp", "2"])));
    assert!(warned.contains("--eval-every 50 evaluates nothing"), "{warned}");
    // Lines of ids mark no answers: under the default --loss-on assistant every token of them
    // trains, which is noted (a chat rendered to text trained its prompts without a word);
    // --loss-on all says it is meant.
    assert!(warned.contains("no line marks answers (text or input_ids lines): every token trains"), "{warned}");
    let meant = show(&succeed(run_alone(&few_args("--loss-on all"), &["--sp", "2"])));
    assert!(!meant.contains("marks answers"), "{meant}");
    // --tokens takes no --eval-data: the fix named is more sequences.
    let mut few_tokens = common_args(&dir, "few-tokens", 2);
    few_tokens.extend(["--eval-every", "5", "--check"].map(String::from));
    let few_tokens_at = few_tokens.iter().position(|a| a == "--tokens").unwrap() + 1;
    fs::write(dir.join("few-tokens.jsonl"), fs::read_to_string(dir.join("data.jsonl")).unwrap().lines().take(6).collect::<Vec<_>>().join("\n")).unwrap();
    few_tokens[few_tokens_at] = dir.join("few-tokens.jsonl").display().to_string();
    let refused = show(&run_alone(&few_tokens, &["--sp", "2"]));
    assert!(refused.contains("--eval-every 5 evaluates nothing") && refused.contains("at least two batches' sequences") && !refused.contains("--eval-data"), "{refused}");
    // Where they do something, or are left out, no word.
    let text = show(&succeed(run_alone(&args("--steps 9 --learning-rate 0.5"), &["--sp", "2"])));
    let zigzag = show(&succeed(run_alone(&common_args(&dir, "ring", 2), &["--sp", "4", "--ring", "2", "--zigzag", "--check"])));
    for text in [text, zigzag] {
        assert!(!text.contains("change nothing") && !text.contains("changes nothing"), "{text}");
    }
    let _ = fs::remove_dir_all(&dir);
}

/// `--flag value` pairs as `--flag=value`, so that values such as `-1` read as values.
fn merge_flag_values(args: &[String]) -> Vec<String> {
    let mut merged = Vec::new();
    let mut i = 0;
    while i < args.len() {
        if args[i].starts_with("--") && i + 1 < args.len() && !args[i + 1].starts_with("--") {
            merged.push(format!("{}={}", args[i], args[i + 1]));
            i += 2;
        } else {
            merged.push(args[i].clone());
            i += 1;
        }
    }
    merged
}

/// Waits until the run of process `pid` holds `out`: its pid is in the lock file.
fn wait_until_locked_by(out: &Path, pid: u32) {
    let started = Instant::now();
    while fs::read_to_string(out.join(".lock")).map_or(true, |holder| holder.trim() != pid.to_string()) {
        assert!(started.elapsed() < Duration::from_secs(60), "process {pid} never locked {}", out.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `args` with `flag`'s value set to `value` (the flag added when absent).
fn set_flag(args: &mut Vec<String>, flag: &str, value: &str) {
    match args.iter().position(|arg| arg == flag) {
        Some(at) => args[at + 1] = value.to_string(),
        None => args.extend([flag.to_string(), value.to_string()]),
    }
}

/// Every file of `folder` with its bytes, sorted by name.
fn snapshot(folder: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<_> = fs::read_dir(folder)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.is_file())
        .map(|path| (path.file_name().unwrap().to_string_lossy().into_owned(), fs::read(&path).unwrap()))
        .collect();
    files.sort();
    files
}

#[test]
fn one_writer_per_run_folder_and_an_earlier_run_is_never_overwritten() {
    let dir = workspace("folder");
    let steps = 150;
    let args = common_args(&dir, "run", steps);
    let out = dir.join("run");
    let first = Command::new(trainer()).args(&args).args(["--launch", "threads", "--sp", "2"]).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    wait_until_locked_by(&out, first.id());
    let second = run_alone(&args, &["--sp", "2", "--overwrite"]);
    let text = show(&second);
    assert!(!second.status.success() && text.contains(&format!("in use by another run (pid {})", first.id())), "{text}");
    let first = first.wait_with_output().unwrap();
    assert!(first.status.success(), "the first run failed:\n{}", show(&first));
    // Its folder agrees with itself: one row per step, the checkpoint after the last.
    assert_eq!(losses(&out).iter().map(|l| l.0).collect::<Vec<_>>(), (0..steps).collect::<Vec<_>>());
    let state: RunState = read_checkpoint_state(&out).unwrap();
    assert_eq!(state.completed_steps, steps);
    assert_eq!(TrainConfig::load(out.join("config.json")).unwrap().steps, steps);

    // A fresh run on the finished folder is refused and changes nothing.
    let before = snapshot(&out);
    let refused = run_alone(&args, &["--sp", "2"]);
    let text = show(&refused);
    assert!(!refused.status.success() && text.contains("holds an earlier run's checkpoint.ulysses"), "{text}");
    // --check says so before a job is queued.
    let checked = run_alone(&args, &["--sp", "2", "--check"]);
    assert!(!checked.status.success() && show(&checked).contains("holds an earlier run's checkpoint.ulysses"), "{}", show(&checked));
    // Before the data is read (minutes for a large one): data that would be refused as well is
    // not what the run stops at.
    let bad = dir.join("bad.jsonl");
    fs::write(&bad, "[1, 2]\nnot a line of ids\n").unwrap();
    let mut bad_args = args.clone();
    set_flag(&mut bad_args, "--tokens", &bad.display().to_string());
    let refused = run_alone(&bad_args, &["--sp", "2"]);
    assert!(!refused.status.success() && show(&refused).contains("holds an earlier run's checkpoint.ulysses"), "{}", show(&refused));
    assert!(snapshot(&out) == before, "a refused run changed {}", out.display());
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_resume_on_other_data_or_another_model_is_refused_naming_what_changed() {
    let dir = workspace("resume-checks");
    succeed(run_alone(&common_args(&dir, "run", 4), &["--sp", "2", "--stop-after", "2"]));
    // The same token file with one token changed: the same size, other bytes.
    let other = dir.join("other.jsonl");
    fs::write(&other, fs::read_to_string(dir.join("data.jsonl")).unwrap().replacen('1', "2", 1)).unwrap();
    let resume_with = |flag: &str, value: &str, extra: &[&str]| {
        let mut args = common_args(&dir, "run", 4);
        set_flag(&mut args, flag, value);
        args.extend(["--resume".to_string(), dir.join("run").display().to_string()]);
        run_alone(&args, &[&["--sp", "2"], extra].concat())
    };
    let before = snapshot(&dir.join("run"));
    let refused = resume_with("--tokens", &other.display().to_string(), &[]);
    let text = show(&refused);
    assert!(!refused.status.success() && text.contains("other.jsonl") && text.contains("--allow-new-data"), "{text}");
    // Over 3 DP replicas the run's batch of 4 does not divide: the world is named, not another batch.
    let refused = resume_with("--batch-size", "4", &["--dp", "3"]);
    let text = show(&refused);
    assert!(!refused.status.success() && text.contains("the checkpoint's --batch-size 4 does not divide over dp_size 3") && !text.contains("use 3 or 6"), "{text}");
    let refused = resume_with("--d-model", "32", &[]);
    let text = show(&refused);
    assert!(!refused.status.success() && text.contains("model.d_model 64, this one has 32"), "{text}");
    assert!(snapshot(&dir.join("run")) == before, "a refused resume changed the run folder");
    // A resume into another run's folder is a fresh run there: refused, that run untouched.
    succeed(run_alone(&common_args(&dir, "another", 2), &["--sp", "2"]));
    let another = snapshot(&dir.join("another"));
    let mut into_another = common_args(&dir, "another", 4);
    into_another.extend(["--resume".to_string(), dir.join("run").join("checkpoint.ulysses").display().to_string()]);
    let refused = run_alone(&into_another, &["--sp", "2"]);
    let text = show(&refused);
    assert!(!refused.status.success() && text.contains("holds an earlier run's checkpoint.ulysses"), "{text}");
    assert!(snapshot(&dir.join("another")) == another, "a resume overwrote another run's folder");
    // Into a new folder, or with --overwrite, it continues there with the resumed run's rows.
    let run_rows = losses(&dir.join("run"));
    for (out, extra) in [("continued", vec![]), ("another", vec!["--overwrite"])] {
        let mut args = common_args(&dir, out, 4);
        args.extend(["--resume".to_string(), dir.join("run").join("checkpoint.ulysses").display().to_string()]);
        succeed(run_alone(&args, &[&["--sp", "2"], &extra[..]].concat()));
        let rows = losses(&dir.join(out));
        assert_eq!(rows.iter().map(|r| r.0).collect::<Vec<_>>(), [0, 1, 2, 3], "{out}");
        assert_eq!(rows[..2], run_rows[..2], "{out}: the resumed run's rows, not the folder's");
    }
    succeed(resume_with("--tokens", &other.display().to_string(), &["--allow-new-data"]));
    assert_eq!(losses(&dir.join("run")).len(), 4);
    let _ = fs::remove_dir_all(&dir);
}

/// `--profile` prints each step's waits; the step ends with a sync of its own, so that its
/// seconds hold its update (queued after its last read), as PyTorch's reference times a step.
/// It times the backward and the update apart too (a sync between, left out of the counts), and
/// the two make up the step's seconds in metrics.csv, within the host's bookkeeping.
#[test]
fn a_profiled_step_waits_for_its_update_before_its_seconds_are_read() {
    let dir = workspace("profiled");
    let output = run_alone(&common_args(&dir, "run", 2), &["--profile"]);
    let text = show(&output);
    assert!(output.status.success(), "{text}");
    let steps: Vec<&str> = text.lines().filter(|line| line.starts_with("step ") && line.contains("syncs")).collect();
    assert_eq!(steps.len(), 2, "{text}");
    assert!(steps.iter().all(|line| line.contains("; 1 syncs)")), "{steps:#?}");
    let seconds = |line: &str, after: &str| -> f64 { line.split(after).nth(1).and_then(|rest| rest.split(' ').next()).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("{after:?} in {line}")) };
    // The step's seconds: metrics.csv's tokens over its tokens per second.
    let rows = fs::read_to_string(dir.join("run/metrics.csv")).unwrap();
    for (line, row) in steps.iter().zip(rows.lines().skip(1)) {
        let (backward, update) = (seconds(line, "; backward "), seconds(line, ", then the update "));
        let fields: Vec<f64> = row.split(',').map(|f| f.parse().unwrap_or(f64::NAN)).collect();
        let step_seconds = fields[5] / fields[6];
        assert!(backward > 0.0 && update > 0.0 && (backward + update - step_seconds).abs() <= 0.05 * step_seconds + 0.01, "{line}: {backward} + {update} s against the step's {step_seconds} s");
    }
    let _ = fs::remove_dir_all(&dir);
}

/// A change the data's identity cannot see (the middle of a file larger than the 64 KiB it
/// reads at each end) still changes the next step's batch, whose digest the checkpoint keeps.
#[test]
fn a_resume_on_data_changed_where_its_identity_does_not_look_is_refused() {
    let dir = workspace("resume-middle");
    let path = dir.join("data.jsonl");
    let mut lines: Vec<String> = fs::read_to_string(&path).unwrap().lines().map(String::from).collect();
    // Step 2's batch (lines 8 to 11) in the middle: 70 KiB of blanks on each side of it.
    lines[7].push_str(&" ".repeat(70 * 1024));
    lines[12].insert_str(0, &" ".repeat(70 * 1024));
    fs::write(&path, lines.join("\n")).unwrap();
    succeed(run_alone(&common_args(&dir, "run", 4), &["--stop-after", "2"]));
    // One token of step 2's first sequence: the same size, the same ends.
    assert!(lines[8].starts_with("[74, "), "{}", lines[8]);
    lines[8] = lines[8].replacen("[74, ", "[75, ", 1);
    fs::write(&path, lines.join("\n")).unwrap();
    let resume = |extra: &[&str]| {
        let mut args = common_args(&dir, "run", 4);
        args.extend(["--resume".to_string(), dir.join("run").display().to_string()]);
        run_alone(&args, extra)
    };
    let refused = resume(&[]);
    let text = show(&refused);
    assert!(!refused.status.success() && text.contains("step 2 would train on another batch") && text.contains("--allow-new-data"), "{text}");
    succeed(resume(&["--allow-new-data"]));
    assert_eq!(losses(&dir.join("run")).len(), 4);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn data_that_cannot_train_is_refused_before_step_1() {
    let dir = workspace("untrainable");
    // A binary file as the corpus: refused, unless --bytes-ok.
    let binary = dir.join("binary.bin");
    fs::write(&binary, (0..16 * 1024).map(|i| (i * 7 % 256) as u8).collect::<Vec<u8>>()).unwrap();
    let corpus_args = |extra: &[&str]| {
        let mut args = common_args(&dir, "corpus-run", 1);
        let at = args.iter().position(|arg| arg == "--tokens").unwrap();
        args.drain(at..at + 2);
        args.extend(["--corpus".to_string(), binary.display().to_string()]);
        run_alone(&args, extra)
    };
    let refused = corpus_args(&[]);
    let text = show(&refused);
    assert!(!refused.status.success() && text.contains("does not look like text") && text.contains("--bytes-ok"), "{text}");
    assert!(!dir.join("corpus-run").exists(), "{text}");
    succeed(corpus_args(&["--bytes-ok"]));
    // Sequences of one token: no label anywhere.
    let single = dir.join("single.jsonl");
    fs::write(&single, (0..8).map(|i| format!("[{i}]")).collect::<Vec<_>>().join("\n")).unwrap();
    let mut args = common_args(&dir, "single-run", 1);
    set_flag(&mut args, "--tokens", &single.display().to_string());
    let refused = run_alone(&args, &[]);
    let text = show(&refused);
    assert!(!refused.status.success() && text.contains("no position has a label"), "{text}");
    assert!(!dir.join("single-run").exists(), "{text}");
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_killed_run_leaves_a_folder_the_next_run_can_lock() {
    let dir = workspace("killed");
    let args = common_args(&dir, "run", 400);
    let out = dir.join("run");
    let mut first = Command::new(trainer()).args(&args).args(["--launch", "threads"]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    wait_until_locked_by(&out, first.id());
    first.kill().unwrap();
    first.wait().unwrap();
    // The lock died with its holder; the pid it left behind does not block.
    let mut args = common_args(&dir, "run", 2);
    args.push("--overwrite".into());
    succeed(run_alone(&args, &[]));
    assert_eq!(losses(&out).len(), 2);
    let _ = fs::remove_dir_all(&dir);
}

/// `snapshot` without the lock file (which names its latest holder).
fn record_of(folder: &Path) -> Vec<(String, Vec<u8>)> {
    snapshot(folder).into_iter().filter(|(name, _)| name != ".lock").collect()
}

#[test]
fn the_run_record_is_written_only_once_a_step_has_succeeded() {
    let dir = workspace("record");
    let out = dir.join("run");
    let failing_at = |step: usize, extra: &[&str]| {
        let mut args = common_args(&dir, "run", 4);
        args.extend(["--fault-nan-gradient".to_string(), format!("{step}:1")]);
        args.extend(extra.iter().map(|s| s.to_string()));
        let output = run_alone(&args, &["--sp", "2"]);
        let text = show(&output);
        assert!(!output.status.success() && text.contains(&format!("step {step}: a NaN")), "{text}");
    };
    // A fresh run whose first step fails leaves no record.
    failing_at(0, &[]);
    assert_eq!(record_of(&out), Vec::new(), "a run without a step wrote into its folder");

    // Two steps, then a resume whose first step fails: the record is as it was.
    succeed(run_alone(&common_args(&dir, "run", 4), &["--sp", "2", "--stop-after", "2"]));
    let before = record_of(&out);
    let metrics_before = fs::read_to_string(out.join("metrics.csv")).unwrap();
    assert_eq!(losses(&out).iter().map(|l| l.0).collect::<Vec<_>>(), [0, 1]);
    let resume = ["--resume", out.to_str().unwrap()];
    failing_at(2, &resume);
    assert!(record_of(&out) == before, "a resume that took no step changed the run's record");

    // The resume proper appends the rows of steps 2 and 3 to those of steps 0 and 1.
    let mut args = common_args(&dir, "run", 4);
    args.extend(resume.map(String::from));
    succeed(run_alone(&args, &["--sp", "2"]));
    assert_eq!(losses(&out).iter().map(|l| l.0).collect::<Vec<_>>(), [0, 1, 2, 3]);
    let metrics = fs::read_to_string(out.join("metrics.csv")).unwrap();
    assert!(metrics.starts_with(&metrics_before), "the earlier rows changed:\n{metrics_before}\n---\n{metrics}");

    // --overwrite: a run that takes no step leaves the earlier run whole; one that does starts
    // its record and takes the earlier checkpoint away with it, so that no resume continues
    // the earlier run under this one's record.
    let finished = record_of(&out);
    failing_at(0, &["--overwrite"]);
    assert!(record_of(&out) == finished, "--overwrite without a step changed the earlier run");
    failing_at(1, &["--overwrite"]);
    assert_eq!(losses(&out).iter().map(|l| l.0).collect::<Vec<_>>(), [0]);
    assert!(!out.join("checkpoint.ulysses").exists(), "the earlier run's checkpoint outlived the new record");
    assert!(!out.join("model.mpk").exists(), "the earlier run's model outlived the new record");
    // Over a sharded run's folder, a --no-save run leaves neither its model nor its optimizer's
    // parts (no commit of its own would remove them).
    succeed(run_alone(&common_args(&dir, "run", 2), &["--sp", "2", "--offload-optimizer", "--overwrite"]));
    assert!(out.join("model.mpk").exists() && earlier_run_files(&out).iter().any(|f| f.starts_with("optimizer-step-")), "{:?}", earlier_run_files(&out));
    succeed(run_alone(&common_args(&dir, "run", 1), &["--sp", "2", "--no-save", "--overwrite"]));
    let left = earlier_run_files(&out);
    assert_eq!(left, ["config.json", "metrics.csv"], "a --no-save run over another left its files");
    // A loss curve that cannot be written (loss.png a folder) is a warning: the run succeeds,
    // and its last line does not name the curve.
    fs::create_dir_all(dir.join("curve/loss.png")).unwrap();
    let text = show(&succeed(run_alone(&common_args(&dir, "curve", 1), &["--sp", "2"])));
    let summary = text.lines().find(|line| line.starts_with("loss ")).unwrap_or_default();
    assert!(text.contains("cannot write") && summary.contains("wrote") && !summary.contains("loss.png"), "{text}");
    let _ = fs::remove_dir_all(&dir);
}

/// `--model` fine-tunes a Hugging Face checkpoint (the Qwen3 fixture transformers wrote: q/k
/// norms, head dim 32, vocabulary 320) at SP=2 on token ids, and `--save-hf` writes the result
/// back in Hugging Face's format: it loads with the checkpoint's configuration, every weight
/// finite, and training moved them. What cannot combine is refused by flag.
#[test]
fn a_hugging_face_checkpoint_fine_tunes_at_sp_2_and_saves_back() {
    use burn::backend::NdArray;
    use ulysses_models::from_pretrained;
    let dir = workspace("hugging-face");
    let checkpoint = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../crates/ulysses-models/tests/fixtures/qwen3");
    let args = |out: &str| -> Vec<String> {
        format!(
            "--tokens {} --out {} --seq-len 16 --batch-size 4 --steps 3 --learning-rate 0.01 --seed 7 --check-parameters-every 1 --sp 2 --model {}",
            dir.join("data.jsonl").display(),
            dir.join(out).display(),
            checkpoint.display()
        )
        .split_whitespace()
        .map(String::from)
        .collect()
    };
    let saved = dir.join("saved-hf");
    succeed(run_alone(&args("tuned"), &["--save-hf", &saved.display().to_string(), "--save-hf-dtype", "bf16"]));
    assert_eq!(losses(&dir.join("tuned")).len(), 3);
    // Rounded to bf16, as asked (the checkpoint's own f32 by default: below).
    assert_saved_hf_is_the_run_model(&saved, &dir.join("tuned"), DType::BF16);
    // The run's folder given as --model: named for what it is.
    let refused = run_alone(&args("as-model").into_iter().map(|a| if a == checkpoint.display().to_string() { dir.join("tuned").display().to_string() } else { a }).collect::<Vec<_>>(), &["--check"]);
    assert!(!refused.status.success() && show(&refused).contains("is a run folder of this trainer") && show(&refused).contains("--resume"), "{}", show(&refused));
    // Its checkpoint resumed without --model (which a checkpoint does not name): refused, naming
    // the flag and the run's data.
    let tuned = dir.join("tuned").display().to_string();
    let refused = run_alone(&["--tokens".into(), dir.join("data.jsonl").display().to_string(), "--resume".into(), tuned, "--check".into()], &[]);
    let text = show(&refused);
    assert!(!refused.status.success() && text.contains("give --model (or --hf-config)") && text.contains("data.jsonl"), "{text}");

    let original = from_pretrained::<NdArray>(&checkpoint, &Default::default()).unwrap();
    let tuned = from_pretrained::<NdArray>(&saved, &Default::default()).unwrap_or_else(|e| panic!("the saved folder does not load: {e}"));
    // The checkpoint's configuration, but for the weights' dtype it was saved in.
    assert_eq!(tuned.config, ulysses_models::HfConfig { torch_dtype: Some(DType::BF16), ..original.config.clone() });
    let values = |model: &ulysses_models::Decoder<NdArray>| model.embedding.weight.val().into_data().to_vec::<f32>().unwrap();
    let (before, after) = (values(&original.model), values(&tuned.model));
    assert!(after.iter().all(|v| v.is_finite()), "a saved weight is not finite");
    let moved = before.iter().zip(&after).map(|(b, a)| (b - a).abs()).fold(0.0f32, |m, d| if d > m { d } else { m });
    assert!(moved > 1e-3, "three steps at learning rate 0.01 moved the embeddings by {moved} only");

    // Under ZeRO-3 the folder is written a shard at a time from the ranks' parts: it holds the
    // trained model (the run's own, in the checkpoint's f32: three steps' updates kept, not
    // rounded to bf16's step), every tensor.
    let saved_zero3 = dir.join("saved-hf-zero3");
    succeed(run_alone(&args("zero3"), &["--checkpoint-layers", "--zero", "3", "--save-hf", &saved_zero3.display().to_string()]));
    assert_saved_hf_is_the_run_model(&saved_zero3, &dir.join("zero3"), DType::F32);

    // A model shape beside --model, --save-hf without --model, --model without --tokens.
    let refused = run_alone(&args("shaped"), &["--d-model", "64"]);
    assert!(!refused.status.success() && show(&refused).contains("--d-model"), "{}", show(&refused));
    let mut from_scratch = common_args(&dir, "scratch", 1);
    from_scratch.extend(["--save-hf".into(), saved.display().to_string()]);
    let refused = run_alone(&from_scratch, &[]);
    assert!(!refused.status.success() && show(&refused).contains("--model"), "{}", show(&refused));
    let refused = Command::new(trainer()).args(["--model", &checkpoint.display().to_string(), "--launch", "threads"]).output().unwrap();
    assert!(!refused.status.success() && show(&refused).contains("--tokens"), "{}", show(&refused));
    // --model without --learning-rate fine-tunes at TRL's default, not the small model's
    // from-scratch rate.
    let rated = |extra: &[&str]| {
        let tokens = dir.join("data.jsonl").display().to_string();
        let out = dir.join("rate").display().to_string();
        let base = ["--tokens", &tokens, "--model", &checkpoint.display().to_string(), "--out", &out, "--seq-len", "16", "--batch-size", "4", "--check"];
        show(&succeed(run_alone(&base.iter().chain(extra).map(|a| a.to_string()).collect::<Vec<_>>(), &[])))
    };
    let note = "--model without --learning-rate: fine-tuning at 2e-5";
    assert!(rated(&[]).contains(note), "{}", rated(&[]));
    assert!(!rated(&["--learning-rate", "3e-3"]).contains(note));

    // --hf-config: the checkpoint's shape from random weights, saved with its configuration;
    // beside --model it is refused, and a vocabulary smaller than --corpus's 256 byte values
    // is refused by name.
    let config = checkpoint.join("config.json");
    let shaped = |out: &str, config: &Path, tokens: bool| -> Vec<String> {
        let mut args: Vec<String> = format!(
            "--out {} --seq-len 16 --batch-size 4 --steps 2 --learning-rate 0.01 --seed 7 --check-parameters-every 1 --sp 2 --hf-config {}",
            dir.join(out).display(),
            config.display()
        )
        .split_whitespace()
        .map(String::from)
        .collect();
        if tokens {
            args.extend(["--tokens".into(), dir.join("data.jsonl").display().to_string()]);
        }
        args
    };
    succeed(run_alone(&shaped("shaped-random", &config, true), &["--save-hf", &dir.join("random-hf").display().to_string(), "--no-save"]));
    assert_eq!(losses(&dir.join("shaped-random")).len(), 2);
    // --no-save (a measuring run): no training checkpoint, no model.mpk.
    for file in ["checkpoint.ulysses", "model.mpk"] {
        assert!(!dir.join("shaped-random").join(file).exists(), "--no-save wrote {file}");
    }
    let random = from_pretrained::<NdArray>(&dir.join("random-hf"), &Default::default()).unwrap_or_else(|e| panic!("the saved folder does not load: {e}"));
    assert_eq!(random.config, original.config);
    // A --save-hf folder that cannot be written (below a file) is refused before any step,
    // not found at the save after training.
    let below_a_file = dir.join("data.jsonl").join("hf");
    let refused = run_alone(&shaped("unwritable", &config, true), &["--save-hf", &below_a_file.display().to_string()]);
    let text = show(&refused);
    assert!(!refused.status.success() && text.contains("--save-hf: ") && text.contains("data.jsonl: is not a folder"), "{text}");
    assert!(!dir.join("unwritable").join("metrics.csv").exists(), "a step ran before the refusal:\n{text}");
    let small = dir.join("small-vocabulary.json");
    let text = fs::read_to_string(&config).unwrap().replace("\"vocab_size\": 320", "\"vocab_size\": 200");
    assert!(text.contains("\"vocab_size\": 200"), "the fixture's config.json spells its vocabulary otherwise");
    fs::write(&small, text).unwrap();
    let refused = run_alone(&shaped("small-vocabulary", &small, false), &[]);
    assert!(!refused.status.success() && show(&refused).contains("vocabulary has 200 ids"), "{}", show(&refused));
    let refused = run_alone(&args("both"), &["--hf-config", &config.display().to_string()]);
    assert!(!refused.status.success() && show(&refused).contains("--hf-config"), "{}", show(&refused));
    // The run's own config.json, or a save, would replace the --hf-config's file.
    let shape = dir.join("shape");
    fs::create_dir_all(&shape).unwrap();
    fs::copy(&config, shape.join("config.json")).unwrap();
    for (extra, expected) in [(vec!["--overwrite"], "--out"), (vec!["--save-hf", shape.to_str().unwrap()], "--save-hf")] {
        let mut args = shaped("shape", &shape.join("config.json"), true);
        set_flag(&mut args, "--out", shape.to_str().unwrap());
        if extra[0] == "--save-hf" {
            set_flag(&mut args, "--out", dir.join("beside-shape").to_str().unwrap());
        }
        let refused = run_alone(&args, &extra);
        let text = show(&refused);
        assert!(!refused.status.success() && text.contains(&format!("{expected} {} is the --hf-config's folder", shape.display())), "{extra:?}:\n{text}");
    }
    assert_eq!(fs::read(shape.join("config.json")).unwrap(), fs::read(&config).unwrap(), "the --hf-config file was written over");
    // A file of another name beside the run's files is not written over: the run may be there.
    let shapes = dir.join("shapes");
    fs::create_dir_all(&shapes).unwrap();
    fs::copy(&config, shapes.join("llama.json")).unwrap();
    let mut beside = shaped("shapes", &shapes.join("llama.json"), true);
    beside.push("--check".into());
    succeed(run_alone(&beside, &[]));

    // The checkpoint's generation settings travel with the saved model.
    assert_eq!(fs::read(saved.join("generation_config.json")).unwrap(), fs::read(checkpoint.join("generation_config.json")).unwrap());
    // A save replaces its folder whole: the run's folder, the checkpoint's and one holding
    // other files are refused before any step; --pack has no paragraphs in a tokenizer's ids.
    let same = dir.join("same").display().to_string();
    let checkpoint_folder = checkpoint.display().to_string();
    let tuned_folder = dir.join("tuned").display().to_string();
    for (extra, expected) in [
        (vec!["--save-hf", same.as_str()], "is the --out folder"),
        (vec!["--save-hf", checkpoint_folder.as_str()], "is the --model folder"),
        (vec!["--save-hf", tuned_folder.as_str()], "checkpoint.ulysses"),
        (vec!["--pack"], "--pack cuts byte text"),
    ] {
        let refused = run_alone(&args("same"), &extra);
        let text = show(&refused);
        assert!(!refused.status.success() && text.contains(expected), "{extra:?}: expected {expected:?}:\n{text}");
        assert!(!dir.join("same").join("metrics.csv").exists(), "{extra:?}: a step ran before the refusal:\n{text}");
    }
    assert!(dir.join("tuned").join("checkpoint.ulysses").exists(), "a refused save deleted the run it was pointed at");
    let _ = fs::remove_dir_all(&dir);
}

/// The fixtures transformers and the `tokenizers` package wrote: (Qwen3 checkpoint folder,
/// its tokenizer.json). The checkpoint names no EOS; the tokenizer's `<|endoftext|>` is id 0.
/// The trainer's flags for the tiny Qwen3 checkpoint and the fixture tokenizer (EOS 0) on
/// `data`, then `rest`.
fn qwen3_args(data: &Path, rest: &str) -> Vec<String> {
    let (checkpoint, tokenizer) = qwen3_and_tokenizer();
    format!("--model {} --tokenizer {} --eos-token-id 0 --data {} {rest}", checkpoint.display(), tokenizer.display(), data.display())
        .split_whitespace()
        .map(String::from)
        .collect()
}

fn qwen3_and_tokenizer() -> (PathBuf, PathBuf) {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../crates/ulysses-models/tests/fixtures");
    (fixtures.join("qwen3"), fixtures.join("tokenizer/tokenizer.json"))
}

/// A file --save-hf would copy beside the model that links out of the --model folder is refused
/// before anything runs (the export would carry it: `vocab.json -> a private file`); a Hugging
/// Face cache's snapshot, whose files link to the entry's `blobs/`, is the folder's own.
#[test]
fn save_hf_refuses_companions_that_link_out_of_their_folder() {
    let dir = workspace("companion-links");
    let fixture = qwen3_and_tokenizer().0;
    let entry = dir.join("models--org--tiny");
    let (snapshot, blobs) = (entry.join("snapshots").join("abc123"), entry.join("blobs"));
    fs::create_dir_all(&snapshot).unwrap();
    fs::create_dir_all(&blobs).unwrap();
    for name in ["config.json", "model.safetensors"] {
        fs::copy(fixture.join(name), blobs.join(name)).unwrap();
        std::os::unix::fs::symlink(Path::new("../../blobs").join(name), snapshot.join(name)).unwrap();
    }
    fs::write(blobs.join("vocab-blob"), "{}").unwrap();
    std::os::unix::fs::symlink("../../blobs/vocab-blob", snapshot.join("vocab.json")).unwrap();
    let args = |out: &str| -> Vec<String> {
        let (tokens, saved, out) = (dir.join("data.jsonl"), dir.join(format!("{out}-hf")), dir.join(out));
        let mut args: Vec<String> = [&tokens, &snapshot, &out, &saved].iter().zip(["--tokens", "--model", "--out", "--save-hf"]).flat_map(|(path, flag)| [flag.to_string(), path.display().to_string()]).collect();
        args.extend("--seq-len 16 --batch-size 4 --learning-rate 0.01 --check".split_whitespace().map(String::from));
        args
    };
    succeed(run_alone(&args("cached"), &[]));
    let private = dir.join("private.txt");
    fs::write(&private, "not for an export").unwrap();
    fs::remove_file(snapshot.join("vocab.json")).unwrap();
    std::os::unix::fs::symlink(&private, snapshot.join("vocab.json")).unwrap();
    let refused = run_alone(&args("linked"), &[]);
    let text = show(&refused);
    assert!(!refused.status.success() && text.contains("vocab.json beside the model, and it leads out of its folder") && text.contains("private.txt"), "{text}");
    let _ = fs::remove_dir_all(&dir);
}

/// `{"prompt", "completion"}` lines train on the completions alone, as TRL's SFTTrainer
/// does: the targets are the tokens past the prompt's (counted here with the tokenizer, the
/// EOS included), the same at SP=1 and SP=2 (losses within 1e-5), and `--loss-on all` trains
/// on every token instead (another loss from step 0); `--eval-only` evaluates the same
/// targets at SP=1 and 2 (or every label, with `--loss-on all`).
#[test]
fn prompt_completion_lines_train_on_the_completions_alike_at_sp_1_and_2() {
    use ulysses_models::TextTokenizer;
    let dir = workspace("prompt-completion");
    let (checkpoint, tokenizer_file) = qwen3_and_tokenizer();
    let words = ["sequence", "parallel", "heads", "group", "GPUs", "trades", "shards", "attention", "long", "context"];
    let pairs: Vec<(String, String)> = (0..12)
        .map(|i| {
            let prompt = format!("Question {i}: {}?", (0..2 + i % 4).map(|w| words[(i * 3 + w) % words.len()]).collect::<Vec<_>>().join(" "));
            let completion = format!(" Answer: {}.", (0..1 + i % 5).map(|w| words[(i * 7 + w * 3) % words.len()]).collect::<Vec<_>>().join(" "));
            (prompt, completion)
        })
        .collect();
    let data = dir.join("sft.jsonl");
    fs::write(&data, pairs.iter().map(|(p, c)| serde_json::json!({ "prompt": p, "completion": c }).to_string()).collect::<Vec<_>>().join("\n")).unwrap();
    let tokenizer = TextTokenizer::from_file(&tokenizer_file).unwrap();
    let (mut targets, mut total) = (0, 0);
    for (prompt, completion) in &pairs {
        let prompt_len = tokenizer.encode_document(prompt, 0).unwrap().len() - 1;
        let whole = tokenizer.encode_document(&format!("{prompt}{completion}"), 0).unwrap().len();
        assert!(whole < 128, "a document would be cut at --seq-len 128");
        (targets, total) = (targets + whole - prompt_len, total + whole);
    }
    let run = |name: &str, extra: &str| {
        let args: Vec<String> = format!(
            "--model {} --tokenizer {} --eos-token-id 0 --data {} --seq-len 128 --batch-size 2 --steps 2 --learning-rate 0.01 --out {} {extra}",
            checkpoint.display(),
            tokenizer_file.display(),
            data.display(),
            dir.join(name).display()
        )
        .split_whitespace()
        .map(String::from)
        .collect();
        let output = succeed(run_alone(&args, &[]));
        (show(&output), losses(&dir.join(name)))
    };
    let (log, one) = run("sp1", "--sp 1");
    let (_, two) = run("sp2", "--sp 2");
    let (_, all) = run("all", "--sp 1 --loss-on all");
    println!("SP=1 {one:?}\nSP=2 {two:?}\nall tokens {all:?}");
    assert!(log.contains(&format!("training on the answers alone: {targets} of {total} tokens are targets")), "{log}");
    // Stderr is a pipe (no bar): the read says what it reads.
    assert!(log.contains("sft.jsonl: reading 1 file(s)"), "{log}");
    // Both runs' two steps (a zip over fewer rows, or none, would compare nothing).
    assert!(one.len() == 2 && two.len() == 2, "SP=1 {one:?}, SP=2 {two:?}: two rows each");
    assert!(one.iter().zip(&two).all(|(a, b)| a.0 == b.0 && (a.1 - b.1).abs() <= TOLERANCE as f64), "SP=2 {two:?} against SP=1 {one:?}");
    assert!((one[0].1 - all[0].1).abs() > 1e-3, "--loss-on all trained on the same tokens: {all:?} against {one:?}");
    // --eval-only counts the same targets (every one has a token before it in its document).
    let eval = |extra: &str| {
        let args: Vec<String> = format!(
            "--model {} --tokenizer {} --eos-token-id 0 --data {} --seq-len 128 --batch-size 2 --eval-only {extra}",
            checkpoint.display(),
            tokenizer_file.display(),
            data.display()
        )
        .split_whitespace()
        .map(String::from)
        .collect();
        eval_line(&succeed(run_alone(&args, &[])))
    };
    let ((answers_one, answers), (answers_two, answers_sp2), (_, every)) = (eval("--sp 1"), eval("--sp 2"), eval("--sp 1 --loss-on all"));
    assert_eq!((answers, answers_sp2, every), (targets, targets, total - pairs.len()), "tokens evaluated: answers at SP=1 and 2, then every label");
    assert!((answers_one - answers_two).abs() <= TOLERANCE as f64, "eval at SP=2 {answers_two} against SP=1 {answers_one}");
    let _ = fs::remove_dir_all(&dir);
}

/// `--eval-data` evaluates every sequence of its file, at every layout: five held-out
/// documents pack into five sequences, three batches of two, which two DP replicas share
/// unevenly (under ZeRO-3 the one without a last batch still joins the gathers). After one step
/// at a learning rate that moves no parameter, the held-out loss equals `--eval-only`'s on the
/// same file; `--data` is trained on whole; the file cannot be `--data` itself.
#[test]
fn a_held_out_file_is_evaluated_whole_at_every_layout_as_eval_only_measures_it() {
    let dir = workspace("eval-data");
    let ids = |seed: usize, count: usize, len: usize| -> String {
        (0..count).map(|d| serde_json::json!({ "input_ids": (0..len).map(|i| 1 + (seed + d * 31 + i * 7) % 300).collect::<Vec<_>>() }).to_string()).collect::<Vec<_>>().join("\n")
    };
    let (train, held_out) = (dir.join("train.jsonl"), dir.join("held-out.jsonl"));
    fs::write(&train, ids(0, 8, 30)).unwrap();
    fs::write(&held_out, ids(5, 5, 30)).unwrap();
    let args = |data: &Path, extra: &str| qwen3_args(data, &format!("--seq-len 32 --batch-size 2 {extra}"));
    let (reference, tokens) = eval_line(&succeed(run_alone(&args(&held_out, "--eval-only --sp 1"), &[])));
    assert_eq!(tokens, 5 * 29, "each held-out document's tokens after its first (ids are taken as given, no EOS appended)");
    let unmoved = format!("--eval-data {} --steps 1 --learning-rate 1e-30", held_out.display());
    for (name, layout, launched) in [
        ("sp1", "--sp 1", 1),
        ("sp2", "--sp 2", 1),
        ("sp2-dp2", "--sp 2 --dp 2", 1),
        ("zero3", "--sp 2 --dp 2 --checkpoint-layers --zero 3 --offload-optimizer", 4),
    ] {
        let run = args(&train, &format!("{unmoved} {layout} --out {}", dir.join(name).display()));
        let output = succeed(if launched > 1 { run_launched(launched, &run, &[]) } else { run_alone(&run, &[]) });
        let eval = eval_losses(&dir.join(name));
        println!("{name}: held-out {eval:?} against --eval-only {reference:.7}");
        assert!(eval.len() == 1 && (eval[0].1 - reference).abs() <= TOLERANCE as f64, "{name}: {eval:?} against {reference}");
        if name == "sp1" {
            assert!(show(&output).contains("go over the 8 training sequence(s)"), "--data trained on whole: {}", show(&output));
        }
    }
    // The run's folder may be neither the checkpoint's (an --overwrite would replace its
    // config.json) nor inside a folder --data reads (a resume would read the run's files).
    let (checkpoint, _) = qwen3_and_tokenizer();
    for (out, data, expected) in [(checkpoint.clone(), train.clone(), "is the --model folder"), (dir.join("run"), dir.clone(), "lies in the --data folder")] {
        let mut refused_args = args(&data, "--steps 1 --check --overwrite");
        refused_args.extend(["--out".into(), out.display().to_string()]);
        let refused = run_alone(&refused_args, &[]);
        assert!(!refused.status.success() && show(&refused).contains(expected), "{}", show(&refused));
    }
    assert!(checkpoint.join("config.json").exists() && !dir.join("run").exists());
    // Held-out files that --data reads too (the same file; one inside its folder) are refused.
    for (data, name) in [(&train, "train.jsonl"), (&dir, "held-out.jsonl")] {
        let out = dir.with_extension("same");
        let refused = run_alone(&args(data, &format!("--eval-data {} --steps 1 --check --out {}", dir.join(name).display(), out.display())), &[]);
        let text = show(&refused);
        assert!(!refused.status.success() && text.contains(&format!("{name} is read by --data")), "{text}");
    }
    // With --eval-data the training set is all of --data (without, its last batch is held out):
    // a resume that leaves it out would draw other batches, and is refused.
    let mut stopped = args(&train, &format!("--eval-data {} --steps 2 --stop-after 1 --out {}", held_out.display(), dir.join("stopped").display()));
    succeed(run_alone(&stopped, &[]));
    stopped.retain(|a| !a.contains("held-out") && a != "--eval-data" && a != "--stop-after" && a != "1");
    stopped.extend(["--resume".into(), dir.join("stopped").display().to_string()]);
    let refused = run_alone(&stopped, &[]);
    assert!(!refused.status.success() && show(&refused).contains("--allow-new-data"), "{}", show(&refused));
    let _ = fs::remove_dir_all(&dir);
}

/// `{"messages"}` lines rendered with the chat template beside `--tokenizer` (the Qwen-kind
/// fixture, whose text, ids and answers equal transformers': ulysses-models' chat test) train
/// on the answers alone: the targets counted with the template, the same losses at SP=1 and
/// SP=2, another with `--loss-on all`; a message without a role is refused naming the file and
/// line.
#[test]
fn chat_messages_train_on_the_answers_alike_at_sp_1_and_2() {
    use ulysses_models::{ChatTemplate, TextTokenizer};
    let dir = workspace("chat");
    let (checkpoint, _) = qwen3_and_tokenizer();
    let chat_folder = checkpoint.join("../chat/qwen");
    let tokenizer = TextTokenizer::from_file(&chat_folder).unwrap();
    let template = ChatTemplate::from_checkpoint_for(&chat_folder, Some(&tokenizer)).unwrap().unwrap();
    let conversations: Vec<Vec<serde_json::Value>> = (0..10)
        .map(|i| {
            let mut messages = vec![serde_json::json!({"role": "user", "content": format!("Question {i}: how many heads?")})];
            messages.push(serde_json::json!({"role": "assistant", "content": format!("{} heads.", 2 + i % 3)}));
            if i % 2 == 0 {
                messages.push(serde_json::json!({"role": "user", "content": "And the groups?"}));
                messages.push(serde_json::json!({"role": "assistant", "content": "One per rank."}));
            }
            messages
        })
        .collect();
    let (mut targets, mut total) = (0, 0);
    for messages in &conversations {
        let ulysses_models::TokenizedChat { ids, answers, .. } = template.tokenize(&tokenizer, messages, false).unwrap();
        assert!(ids.len() < 256, "a conversation would be cut at --seq-len 256");
        (targets, total) = (targets + answers.iter().filter(|&&a| a).count(), total + ids.len());
    }
    let data = dir.join("chat.jsonl");
    fs::write(&data, conversations.iter().map(|m| serde_json::json!({ "messages": m }).to_string()).collect::<Vec<_>>().join("\n")).unwrap();
    let args = |data: &Path, out: &str, extra: &str| -> Vec<String> {
        format!(
            "--model {} --tokenizer {} --eos-token-id 300 --data {} --seq-len 256 --batch-size 2 --steps 2 --learning-rate 0.01 --out {} {extra}",
            checkpoint.display(),
            chat_folder.join("tokenizer.json").display(),
            data.display(),
            dir.join(out).display()
        )
        .split_whitespace()
        .map(String::from)
        .collect()
    };
    let log = show(&succeed(run_alone(&args(&data, "sp1", "--sp 1"), &[])));
    succeed(run_alone(&args(&data, "sp2", "--sp 2"), &[]));
    succeed(run_alone(&args(&data, "all", "--sp 1 --loss-on all"), &[]));
    let (one, two, all) = (losses(&dir.join("sp1")), losses(&dir.join("sp2")), losses(&dir.join("all")));
    println!("SP=1 {one:?}\nSP=2 {two:?}\nall tokens {all:?}");
    assert!(log.contains(&format!("training on the answers alone: {targets} of {total} tokens are targets")), "{log}");
    // Both runs' two steps (a zip over fewer rows, or none, would compare nothing).
    assert!(one.len() == 2 && two.len() == 2, "SP=1 {one:?}, SP=2 {two:?}: two rows each");
    assert!(one.iter().zip(&two).all(|(a, b)| a.0 == b.0 && (a.1 - b.1).abs() <= TOLERANCE as f64), "SP=2 {two:?} against SP=1 {one:?}");
    assert!((one[0].1 - all[0].1).abs() > 1e-3, "--loss-on all trained on the same tokens: {all:?} against {one:?}");
    // The tokenizer's folder stands for its tokenizer.json, its template and its eos_token
    // (<|im_end|>, so no --eos-token-id) the folder's own.
    let mut by_folder: Vec<String> = args(&data, "by-folder", "--sp 1 --check").into_iter().filter(|a| a != "--eos-token-id" && a != "300").collect();
    let at = by_folder.iter().position(|a| a == "--tokenizer").unwrap();
    by_folder[at + 1] = chat_folder.display().to_string();
    let checked = show(&succeed(run_alone(&by_folder, &[])));
    assert!(checked.contains(&format!("training on the answers alone: {targets} of {total} tokens are targets")), "{checked}");

    let bad = dir.join("bad.jsonl");
    fs::write(&bad, format!("{}\n{}", serde_json::json!({"messages": conversations[0]}), serde_json::json!({"messages": [{"content": "who speaks?"}]}))).unwrap();
    let refused = run_alone(&args(&bad, "bad", "--sp 1"), &[]);
    let text = show(&refused);
    assert!(!refused.status.success() && text.contains("bad.jsonl line 2") && text.contains("{\"role\": ..., \"content\": ...}"), "{text}");
    // Conversations without an answer would train at a loss of 0: refused, naming the fix.
    let questions = dir.join("questions.jsonl");
    fs::write(&questions, conversations.iter().map(|m| serde_json::json!({ "messages": [m[0].clone()] }).to_string()).collect::<Vec<_>>().join("\n")).unwrap();
    let refused = run_alone(&args(&questions, "questions", "--sp 1"), &[]);
    let text = show(&refused);
    assert!(!refused.status.success() && text.contains("no token is an answer") && text.contains("--loss-on all"), "{text}");
    // An EOS outside the vocabulary is the flag's fault, not the data's.
    let mut outside = args(&data, "outside", "--sp 1");
    set_flag(&mut outside, "--eos-token-id", "5000");
    let refused = run_alone(&outside, &[]);
    let text = show(&refused);
    assert!(!refused.status.success() && text.contains("--eos-token-id 5000 is outside the model's vocabulary"), "{text}");
    // The same data read otherwise (every token a target) is other batches: a resume refuses it.
    let mut resumed = args(&data, "sp1", "--sp 1 --loss-on all");
    set_flag(&mut resumed, "--steps", "3");
    resumed.extend(["--resume".to_string(), dir.join("sp1").display().to_string()]);
    let refused = run_alone(&resumed, &[]);
    let text = show(&refused);
    assert!(!refused.status.success() && text.contains("--loss-on assistant") && text.contains("--allow-new-data"), "{text}");
    // So is the same data rendered with another template (the tokenizer the same bytes): the
    // template beside --tokenizer edited.
    let edited = dir.join("edited");
    fs::create_dir_all(&edited).unwrap();
    for entry in fs::read_dir(&chat_folder).unwrap() {
        let entry = entry.unwrap();
        fs::copy(entry.path(), edited.join(entry.file_name())).unwrap();
    }
    let source = fs::read_to_string(edited.join("chat_template.jinja")).unwrap();
    fs::write(edited.join("chat_template.jinja"), format!("{{# the system prompt changed #}}{source}")).unwrap();
    let mut resumed = args(&data, "sp1", "--sp 1");
    set_flag(&mut resumed, "--steps", "3");
    set_flag(&mut resumed, "--tokenizer", &edited.join("tokenizer.json").display().to_string());
    resumed.extend(["--resume".to_string(), dir.join("sp1").display().to_string()]);
    let refused = run_alone(&resumed, &[]);
    let text = show(&refused);
    assert!(!refused.status.success() && text.contains("rendered chat data with the template of chat_template.jinja") && text.contains("--allow-new-data"), "{text}");
    // The template is the tokenizer's, from the folder whose files --save-hf copies: with
    // --tokenizer from a folder without one, a template in the --model folder is not used
    // (the saved model would render otherwise than it trained).
    let model = dir.join("model-with-template");
    fs::create_dir_all(&model).unwrap();
    for name in ["config.json", "generation_config.json", "model.safetensors"] {
        fs::copy(checkpoint.join(name), model.join(name)).unwrap();
    }
    fs::copy(chat_folder.join("chat_template.jinja"), model.join("chat_template.jinja")).unwrap();
    let mut elsewhere = args(&data, "elsewhere", "--sp 1");
    set_flag(&mut elsewhere, "--model", &model.display().to_string());
    set_flag(&mut elsewhere, "--tokenizer", &qwen3_and_tokenizer().1.display().to_string());
    let refused = run_alone(&elsewhere, &[]);
    let text = show(&refused);
    assert!(!refused.status.success() && text.contains("needs the tokenizer's chat template") && text.contains("beside --tokenizer where it is given"), "{text}");
    // A tokenizer whose own template marks no answers (Llama 3's, Qwen2.5's) is refused under
    // --loss-on assistant, naming --chat-template; a training template given there marks them.
    let unmarked = dir.join("unmarked");
    fs::create_dir_all(&unmarked).unwrap();
    for entry in fs::read_dir(&chat_folder).unwrap() {
        let entry = entry.unwrap();
        fs::copy(entry.path(), unmarked.join(entry.file_name())).unwrap();
    }
    let without_marks = source.replace("{%- generation %}", "").replace("{%- endgeneration %}", "").replace("{% generation %}", "").replace("{% endgeneration %}", "");
    assert_ne!(without_marks, source, "the fixture's template marks its answers");
    fs::write(unmarked.join("chat_template.jinja"), without_marks).unwrap();
    let mut check = args(&data, "unmarked-run", "--sp 1 --check");
    set_flag(&mut check, "--tokenizer", &unmarked.join("tokenizer.json").display().to_string());
    let refused = run_alone(&check, &[]);
    let text = show(&refused);
    assert!(!refused.status.success() && text.contains("marks no answers") && text.contains("--chat-template"), "{text}");
    check.extend(["--chat-template".to_string(), chat_folder.join("chat_template.jinja").display().to_string()]);
    let checked = show(&succeed(run_alone(&check, &[])));
    assert!(checked.contains(&format!("training on the answers alone: {targets} of {total} tokens are targets")), "{checked}");
    let _ = fs::remove_dir_all(&dir);
}

/// The eval-only line's loss and labelled tokens.
fn eval_line(output: &Output) -> (f64, usize) {
    let text = show(output);
    // A launched rank's lines start with "[rank N] ".
    let line = text.lines().find_map(|l| l.find("eval: loss ").map(|at| &l[at..])).unwrap_or_else(|| panic!("no eval line:\n{text}"));
    let field = |after: &str| line.split(after).nth(1).and_then(|rest| rest.split([',', ' ']).next()).unwrap_or_else(|| panic!("{line}"));
    let (loss, perplexity): (f64, f64) = (field("loss ").parse().unwrap(), field("perplexity ").parse().unwrap());
    assert!(loss.is_finite() && (perplexity - loss.exp()).abs() <= 1e-3 * perplexity, "{line}");
    (loss, field("over ").parse().unwrap())
}

/// `--data`: JSON Lines of text (tokenized with the checkpoint's tokenizer.json) and of token
/// ids, each document ending in EOS, packed into sequences of `--seq-len` as separate
/// documents. `--eval-only` gives the same loss at SP=1, SP=2 (threads and two processes) and
/// SP=2 × DP=2, over exactly the labels the documents hold (every token but each document's
/// last, counted here with the tokenizer), tokenized or loaded as tokenized from `--data-cache`.
/// Fine-tuning with `--freeze-embeddings` moves every
/// weight but the embeddings, and `--save-hf` writes the folder at each checkpoint, not only at
/// the end. What cannot be read is refused naming the fix, the file and the line. Mistral
/// trains on documents shorter and longer than its sliding window.
#[test]
fn documents_are_tokenized_packed_evaluated_alike_at_every_layout_and_fine_tuned() {
    use ulysses_models::{TextTokenizer, from_pretrained};
    let dir = workspace("documents");
    let (checkpoint, tokenizer_file) = qwen3_and_tokenizer();
    let words = ["sequence", "parallel", "heads", "a", "group", "of", "GPUs", "trades", "shards", "attention", "long", "context"];
    let texts: Vec<String> =
        (0..24).map(|i| (0..2 + i % 8).map(|w| words[(i * 7 + w * 3) % words.len()]).collect::<Vec<_>>().join(" ")).collect();
    let token_documents: Vec<Vec<i64>> = vec![vec![5, 6, 7], vec![40, 41, 42, 43, 0], vec![100; 9], vec![200, 201]];
    let mut lines: Vec<String> = texts.iter().map(|t| serde_json::json!({ "text": t, "source": "test" }).to_string()).collect();
    for (i, ids) in token_documents.iter().enumerate() {
        lines.insert(i * 5 + 1, serde_json::json!({ "input_ids": ids }).to_string());
    }
    lines.insert(3, String::new());
    lines.insert(7, r#"{"text": ""}"#.into());
    let data = dir.join("documents.jsonl");
    fs::write(&data, lines.join("\n")).unwrap();

    // Every document's tokens (a text's EOS included; ids as given) but its first carry a
    // label: none is cut at 64.
    let tokenizer = TextTokenizer::from_file(&tokenizer_file).unwrap();
    let lengths: Vec<usize> = texts.iter().map(|t| tokenizer.encode_document(t, 0).unwrap().len()).chain(token_documents.iter().map(Vec::len)).collect();
    assert!(lengths.iter().all(|&l| l < 64), "{lengths:?}");
    let labelled: usize = lengths.iter().map(|l| l - 1).sum();

    let args = |extra: &str| qwen3_args(&data, &format!("--seq-len 64 --batch-size 4 {extra}"));
    let (reference, tokens) = eval_line(&succeed(run_alone(&args("--eval-only --sp 1"), &[])));
    assert_eq!(tokens, labelled, "labelled tokens evaluated");
    // Kept tokenized (--data-cache): the first run below tokenizes --data and writes it, the
    // later ones load it (the two processes too), saying what the first read noticed (the empty
    // text left out); each loss is the one of the data tokenized, above.
    let cache = dir.join("tokenized");
    let cached = |extra: &str| args(&format!("{extra} --data-cache {}", cache.display()));
    for (index, (layout, output)) in [
        ("SP=2", run_alone(&cached("--eval-only --sp 2"), &[])),
        ("SP=2 x DP=2", run_alone(&cached("--eval-only --sp 2 --dp 2"), &[])),
        ("SP=2, two processes", run_launched(2, &cached("--eval-only --sp 2"), &[])),
    ]
    .into_iter()
    .enumerate()
    {
        let text = show(&output);
        if let Some(read) = ["tokenized into", "read from the cache"].get(index) {
            assert!(text.contains(read) && text.contains("left out 1 document(s) of fewer than two tokens"), "{layout}: {text}");
        }
        let (loss, tokens) = eval_line(&succeed(output));
        println!("eval {layout}: loss {loss:.7} (SP=1: {reference:.7}) over {tokens} tokens");
        assert_eq!(tokens, labelled, "{layout}");
        assert!((loss - reference).abs() <= TOLERANCE as f64, "{layout}: loss {loss} against {reference} at SP=1");
    }

    let (out, saved) = (dir.join("tuned"), dir.join("tuned-hf"));
    let extra = format!("--sp 2 --steps 3 --checkpoint-every 2 --learning-rate 0.01 --freeze-embeddings --out {} --save-hf {}", out.display(), saved.display());
    let output = succeed(run_alone(&args(&extra), &[]));
    let saves: Vec<&str> = std::str::from_utf8(&output.stderr).unwrap().lines().filter(|l| l.contains("saved in Hugging Face's format")).collect();
    assert!(saves.len() == 2 && saves[0].contains("step=2") && saves[1].contains("step=3"), "{saves:?}");
    // The finished run resumed with --save-hf exports it again (no step taken): the same
    // weights, byte for byte (the tensors' bytes: burn writes the header's metadata in no fixed order).
    let again = dir.join("tuned-hf-again");
    let extra = format!("--sp 1 --freeze-embeddings --resume {} --save-hf {}", out.display(), again.display());
    let output = show(&succeed(run_alone(&args(&extra), &[])));
    assert!(output.contains("no step taken") && output.contains("saved in Hugging Face's format"), "{output}");
    let tensors = |folder: &Path| {
        let bytes = fs::read(folder.join("model.safetensors")).unwrap();
        let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        bytes[8 + header..].to_vec()
    };
    assert!(tensors(&again) == tensors(&saved), "the export differs from the run's own");
    assert!(losses(&out).iter().all(|l| l.1.is_finite()) && losses(&out).len() == 3);
    let original = from_pretrained::<NdArray>(&checkpoint, &Default::default()).unwrap().model;
    let before: Vec<(String, Vec<f32>)> =
        float_parameters(&original).into_iter().map(|p| (p.path, p.values.into_data().convert::<f32>().to_vec().unwrap())).collect();
    for ((name, was), (_, now)) in before.iter().zip(parameters(&out)) {
        let moved = max_abs_diff(was, &now);
        if name.starts_with("embedding") {
            assert!(moved == 0.0, "{name} moved by {moved} with --freeze-embeddings");
        } else if name.contains(".w") {
            assert!(moved > 1e-4, "{name} moved by {moved} only in three steps");
        }
    }
    from_pretrained::<NdArray>(&saved, &Default::default()).unwrap_or_else(|e| panic!("the saved folder does not load: {e}"));

    // Refused, naming the fix, the file and the line.
    let bad = dir.join("bad.jsonl");
    let refusals = [
        (args("--ring 2 --sp 4 --steps 1"), None, "--ring 1"),
        (args("--steps 1").into_iter().filter(|a| a != "--eos-token-id" && a != "0").collect(), None, "--eos-token-id"),
        (args("--steps 1").into_iter().skip(2).skip_while(|a| a != "--eos-token-id").chain(["--model".into(), checkpoint.display().to_string()]).collect(), None, "--tokenizer"),
        (args("--steps 1"), Some("{\"text\": \"a b\"}\n{\"txt\": \"a\"}"), "bad.jsonl line 2: needs a \"text\""),
        (args("--steps 1"), Some("{\"input_ids\": [3, 320]}"), "bad.jsonl line 1: token 320 is outside the model's vocabulary 0..320"),
        // Another model's tokenizer, larger than the model's vocabulary: said, and the first
        // id past the vocabulary it yields refused.
        (
            {
                let mut args = args("--steps 1");
                set_flag(&mut args, "--tokenizer", &tokenizer_file.with_file_name("../tokenizer-sentencepiece/tokenizer.json").display().to_string());
                args
            },
            None,
            "more than the model's vocabulary of 320 (config.json's vocab_size): another model's tokenizer",
        ),
    ];
    for (mut args, bad_lines, expected) in refusals {
        if let Some(lines) = bad_lines {
            fs::write(&bad, lines).unwrap();
            let at = args.iter().position(|a| a == "--data").unwrap();
            args[at + 1] = bad.display().to_string();
        }
        args.extend(["--out".into(), dir.join("refused").display().to_string()]);
        let output = run_alone(&args, &[]);
        assert!(!output.status.success() && show(&output).contains(expected), "{args:?}: expected {expected:?} in\n{}", show(&output));
        assert!(!dir.join("refused").join("metrics.csv").exists(), "a refused run wrote its metrics");
    }
    // Mistral (a sliding window of 64 tokens in the fixture) on documents shorter than the
    // window, with much padding after them, and on documents past it: both train at SP=2.
    let mut mistral = args("--steps 2 --sp 2");
    set_flag(&mut mistral, "--model", &checkpoint.with_file_name("mistral").display().to_string());
    set_flag(&mut mistral, "--seq-len", "128");
    set_flag(&mut mistral, "--out", &dir.join("mistral").display().to_string());
    succeed(run_alone(&mistral, &[]));
    let long = dir.join("long.jsonl");
    let long_text = serde_json::json!({ "text": words.repeat(12).join(" ") }).to_string();
    fs::write(&long, [long_text.as_str(); 8].join("\n")).unwrap();
    set_flag(&mut mistral, "--data", &long.display().to_string());
    set_flag(&mut mistral, "--out", &dir.join("mistral-long").display().to_string());
    succeed(run_alone(&mistral, &[]));
    assert!(losses(&dir.join("mistral-long")).iter().all(|l| l.1.is_finite()));
    let _ = fs::remove_dir_all(&dir);
}

/// A rank that fails before it joins the job (rank 0 refusing a run folder with an earlier
/// run's files, which only it claims) says why to the others, which end within seconds naming
/// it and the reason: they waited out the rendezvous timeout for it, saying only that it never
/// came.
#[test]
fn a_rank_that_fails_before_the_job_begins_is_named_with_its_reason_at_once() {
    let dir = workspace("fails-before-the-job");
    fs::create_dir_all(dir.join("run")).unwrap();
    fs::write(dir.join("run/metrics.csv"), "step,loss\n0,5.5\n").unwrap();
    let started = Instant::now();
    let output = launched(2, "60").args(common_args(&dir, "run", 2)).args(["--sp", "2"]).env("ULYSSES_RENDEZVOUS_TIMEOUT", "40").output().unwrap();
    let elapsed = started.elapsed();
    let text = show(&output);
    println!("{text}");
    assert!(!output.status.success(), "{text}");
    assert!(rank_error(&text, 0).contains("holds an earlier run's metrics.csv"), "{text}");
    let error = rank_error(&text, 1);
    assert!(error.contains("rank 0 ended its process") && error.contains("It failed before the job began") && error.contains("holds an earlier run's metrics.csv"), "{error}");
    // Rank 1 ends first (rank 0 serves the rendezvous until it has left) and exits 76: the
    // launcher names rank 0.
    assert!(text.contains("ulysses-launch: rank 0 exited with status 1;") && text.contains("rank 1 exited with status 76"), "{text}");
    assert!(elapsed < Duration::from_secs(20), "the job took {elapsed:?} to end");
    let _ = fs::remove_dir_all(&dir);
}

/// A rank that dies while its peers wait for it inside attention (an all-to-all that can only
/// panic) is reported by each survivor in one line naming it, with no panic message or
/// backtrace before it, even with RUST_BACKTRACE=1, and the survivor exits 76 (a peer's loss).
#[test]
fn a_rank_that_dies_inside_attention_is_named_in_one_line_per_survivor() {
    let dir = workspace("dies-in-attention");
    let (checkpoint, tokenizer_file) = qwen3_and_tokenizer();
    let data = dir.join("documents.jsonl");
    let lines: Vec<String> = (0..40).map(|i| serde_json::json!({ "text": format!("document {i} of a group of GPUs") }).to_string()).collect();
    fs::write(&data, lines.join("\n")).unwrap();
    let output = launched(2, "20")
        .args(["--model", &checkpoint.display().to_string(), "--tokenizer", &tokenizer_file.display().to_string(), "--eos-token-id", "0"])
        .args(["--data", &data.display().to_string(), "--seq-len", "64", "--batch-size", "2", "--sp", "2", "--eval-only", "--fault-kill-before-eval", "1"])
        .env("ULYSSES_COLLECTIVE_TIMEOUT", "60")
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let text = show(&output);
    println!("{text}");
    assert!(!output.status.success(), "the launcher must fail");
    let error = rank_error(&text, 0);
    assert!(error.contains("[1]"), "rank 0 does not name rank 1: {error}");
    // The peer's loss inside attention stays one (not a failure of the model's own): rank 0
    // exits 76, for the launcher to name rank 1.
    assert!(text.contains("rank 0 exited with status 76"), "{text}");
    for noise in ["panicked", "stack backtrace", "RUST_BACKTRACE"] {
        assert!(!text.contains(noise), "{noise:?} in the output:\n{text}");
    }
    let _ = fs::remove_dir_all(&dir);
}

/// Every `--flag` that the README and the training guide name is one the trainer's `--help`
/// lists, or the launcher's, or cargo's: a renamed or removed flag fails here, not in a
/// user's first command.
#[test]
fn the_flags_the_guides_name_exist() {
    // The flags a program's --help lists: the `-x, --name <VALUE>` at the start of its lines
    // (not the flags its descriptions mention).
    let flags = |program: &Path| -> Vec<String> {
        let output = Command::new(program).arg("--help").output().unwrap();
        assert!(output.status.success(), "{} --help failed:\n{}", program.display(), show(&output));
        let help = String::from_utf8_lossy(&output.stdout).into_owned();
        help.lines()
            .flat_map(|line| line.split_whitespace().take_while(|word| word.starts_with('-')).map(|word| word.trim_end_matches(',').to_string()).collect::<Vec<_>>())
            .filter(|word| word.starts_with("--"))
            .collect()
    };
    let known = [flags(Path::new(trainer())), flags(&launcher())].concat();
    assert!(known.iter().any(|flag| flag == "--checkpoint-layers"), "the trainer's --help lists no --checkpoint-layers: {known:?}");
    // Cargo's, in the guides' build and test commands, sbatch's `--signal` and `--mem`, srun's
    // `--cpus-per-task`, and docker's `--memory`.
    const CARGO: [&str; 11] = ["--release", "--workspace", "--features", "--example", "--test", "--nocapture", "--no-run", "--signal", "--cpus-per-task", "--mem", "--memory"];
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut checked = 0;
    for guide in ["README.md", "docs/training.md"] {
        let text = fs::read_to_string(root.join(guide)).unwrap();
        for (at, _) in text.match_indices("--") {
            let flag: String = text[at..].chars().take_while(|c| *c == '-' || c.is_ascii_alphanumeric()).collect();
            let name = &flag[2..];
            if name.is_empty() || !name.starts_with(|c: char| c.is_ascii_lowercase()) || CARGO.contains(&flag.as_str()) {
                continue;
            }
            checked += 1;
            assert!(known.contains(&flag), "{guide} names {flag}, which neither `ulysses-trainer --help` nor `ulysses-launch --help` lists");
        }
    }
    assert!(checked > 40, "only {checked} flags found in the guides");
}
