//! `scripts/gpu-run.sh` on this machine, with stand-ins for the bundle's binaries: a lent GPU's
//! minutes must not go to a run whose failures read as success. A failing step must fail the
//! run (exit 1, named), its whole output (a panic's message) must reach `$OUT`, and the run must
//! go on to the next step; a passing run exits 0. `scripts/gpu-call.sh` must end a part at its
//! time limit and go on, and bring the logs back in one file without the trainer's checkpoints.
//! `scripts/gpu-bundle.sh` must build again whenever anything but Markdown changed, and mark
//! what it built; `scripts/ptx-cache.sh` must compile ahead what gpu-run.sh's steps will launch.

use std::{fs, os::unix::fs::PermissionsExt, path::Path, process::Command};

/// A bundle folder holding gpu-run.sh and `flash-attention-tests` as a shell script `body`.
fn bundle_with_kernel_tests(body: &str) -> tempfile_dir::Dir {
    let dir = tempfile_dir::Dir::new("gpu-run");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gpu-run.sh");
    fs::copy(&script, dir.path().join("gpu-run.sh")).unwrap();
    write_script(&dir.path().join("flash-attention-tests"), &format!("{body}\n"));
    fs::create_dir(dir.path().join("out")).unwrap();
    dir
}

fn run(dir: &tempfile_dir::Dir) -> (i32, String) {
    let output = Command::new("bash")
        .arg(dir.path().join("gpu-run.sh"))
        .env("OUT", dir.path().join("out"))
        .env("KERNELS_RUN", "tests")
        .output()
        .expect("bash runs gpu-run.sh");
    (output.status.code().unwrap_or(-1), String::from_utf8_lossy(&output.stdout).into_owned())
}

#[test]
fn a_failing_step_fails_the_run_and_its_panic_reaches_out() {
    let dir = bundle_with_kernel_tests("echo \"thread 'f16_case' panicked at tests.rs:1: output differs\" >&2; exit 101");
    let (code, stdout) = run(&dir);
    assert_eq!(code, 1, "a failed step must fail the run; stdout:\n{stdout}");
    assert!(stdout.contains("kernel-tests FAILED with status 101"), "{stdout}");
    let log = fs::read_to_string(dir.path().join("out/kernel-tests.log")).unwrap();
    assert!(log.contains("panicked at tests.rs:1: output differs"), "the panic must reach $OUT: {log:?}");
    let status = fs::read_to_string(dir.path().join("out/status.txt")).unwrap();
    assert_eq!(status.trim(), "kernel-tests 101");
}

#[test]
fn a_passing_run_exits_zero_and_keeps_each_steps_status() {
    let dir = bundle_with_kernel_tests("echo 'test result: ok. 21 passed'");
    let (code, stdout) = run(&dir);
    assert_eq!(code, 0, "stdout:\n{stdout}");
    assert!(stdout.contains("every step passed"), "{stdout}");
    let status = fs::read_to_string(dir.path().join("out/status.txt")).unwrap();
    assert_eq!(status.trim(), "kernel-tests 0");
    let log = fs::read_to_string(dir.path().join("out/kernel-tests.log")).unwrap();
    assert!(log.contains("21 passed"), "{log:?}");
}

#[test]
fn a_call_ends_a_part_at_its_limit_goes_on_and_packs_the_logs_without_checkpoints() {
    let dir = tempfile_dir::Dir::new("gpu-call");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    fs::create_dir_all(dir.path().join("scripts")).unwrap();
    for script in ["gpu-call.sh", "gpu-run.sh"] {
        fs::copy(root.join("scripts").join(script), dir.path().join("scripts").join(script)).unwrap();
    }
    let kernels = dir.path().join(".gpu-bundle/kernels");
    fs::create_dir_all(&kernels).unwrap();
    // The named tests pass and leave a run folder behind; the whole suite hangs.
    // Where the driver would keep the machine code it built, the named tests write an entry;
    // they compile one kernel into CubeCL's PTX cache (a line of its table of contents).
    let stand_in = "case \"$*\" in\n*--exact*) mkdir -p \"$OUT/run\"; echo 5.5 >\"$OUT/run/metrics.csv\"; \
                    head -c 100000 /dev/zero >\"$OUT/run/checkpoint.ulysses\"; echo sass >\"${CUDA_CACHE_PATH:?}/entry\"; \
                    echo '{\"key\":3}' >>/tmp/gpu-call-cubecl/compilation/cuda/0.10.0/ptx-by-source/toc.json.log; \
                    echo 'test result: ok. 1 passed' ;;\n*) sleep 60 ;;\nesac\n";
    write_script(&kernels.join("flash-attention-tests"), stand_in);
    let out = dir.path().join("out");
    fs::create_dir(&out).unwrap();

    // The folders the script keeps the driver's cache and CubeCL's in (a warm machine's calls
    // share them), and its marks of having unpacked the carried ones: emptied, so that only
    // this call and what it carries can fill them.
    for folder in ["/tmp/gpu-call-nv", "/tmp/gpu-call-cubecl", "/tmp/gpu-call-unpacked"] {
        let _ = fs::remove_dir_all(folder);
    }
    // A previous call's driver cache, carried.
    let carried = dir.path().join("carried");
    fs::create_dir_all(&carried).unwrap();
    fs::write(carried.join("carried"), "sass").unwrap();
    fs::create_dir_all(dir.path().join(".gpu-cache")).unwrap();
    let packed = Command::new("tar").arg("czf").arg(dir.path().join(".gpu-cache/nv-cache.tar.gz")).arg("-C").arg(&carried).arg(".").status().expect("tar packs");
    assert!(packed.success());
    // CubeCL's cache as scripts/gpu-bundle.sh leaves it: two kernels compiled ahead, and an old
    // bundle's cache keyed by kernel id, which the call drops.
    let cubecl = dir.path().join("cubecl");
    let toc = cubecl.join("compilation/cuda/0.10.0/ptx-by-source");
    fs::create_dir_all(&toc).unwrap();
    fs::write(toc.join("toc.json.log"), "{\"key\":1}\n{\"key\":2}\n").unwrap();
    fs::create_dir_all(cubecl.join("compilation-0123456789abcdef")).unwrap();
    let packed = Command::new("tar").arg("cJf").arg(dir.path().join(".gpu-cache/cubecl-cache.tar.xz")).arg("-C").arg(&cubecl).arg(".").status().expect("tar packs");
    assert!(packed.success());
    let started = std::time::Instant::now();
    let output = Command::new("bash")
        .arg(dir.path().join("scripts/gpu-call.sh"))
        // A setting before a part is that part's alone: the second named part runs without it.
        .args(["kernels:tests=2", "KERNEL_TESTS=one_test", "kernels:named=30", "kernels:named=30"])
        .env("OUT", &out)
        .env_remove("KERNEL_TESTS")
        .env("CORPUS", "/dev/null")
        .output()
        .expect("bash runs gpu-call.sh");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(started.elapsed().as_secs() < 30, "the hung part was not ended at its 2 s limit:\n{stdout}");
    let parts = fs::read_to_string(out.join("parts.txt")).unwrap();
    let statuses: Vec<(&str, &str)> = parts.lines().map(|l| { let f: Vec<&str> = l.split(' ').collect(); (f[0], f[1]) }).collect();
    // The repeated part in a folder of its own, failing for want of the test names.
    assert_eq!(statuses[..2], [("kernels-tests", "124"), ("kernels-named", "0")], "{parts}\n{stdout}");
    assert_eq!(statuses.len(), 3, "{parts}\n{stdout}");
    assert_eq!(statuses[2].0, "kernels-named-2", "{parts}");
    assert_ne!(statuses[2].1, "0", "the second named part saw the first's setting:\n{parts}\n{stdout}");
    // Each part says how many kernels it found compiled and how many it compiled itself.
    let lines: Vec<&str> = parts.lines().collect();
    assert!(lines[0].ends_with("PTX cache 2 + 0 compiled here"), "{parts}");
    assert!(lines[1].ends_with("PTX cache 2 + 1 compiled here, KERNEL_TESTS=one_test"), "{parts}");

    let listing = Command::new("tar").arg("tzvf").arg(out.join("logs.tar.gz")).output().expect("tar lists the logs");
    let listing = String::from_utf8_lossy(&listing.stdout);
    assert!(listing.contains("kernels-named/kernel-tests-named.log"), "{listing}");
    assert!(listing.contains("kernels-named/run/metrics.csv"), "{listing}");
    assert!(!listing.contains("checkpoint.ulysses"), "a checkpoint went into the logs:\n{listing}");

    // The driver's cache comes back in its own file, with what was carried, for the next call.
    let listing = Command::new("tar").arg("tzf").arg(out.join("nv-cache.tar.gz")).output().expect("tar lists the driver's cache");
    let listing = String::from_utf8_lossy(&listing.stdout);
    for entry in ["carried", "entry"] {
        assert!(listing.lines().any(|line| line.trim_start_matches("./") == entry), "the driver's cache came back without {entry}: {listing:?}\n{stdout}");
    }
    // And CubeCL's, with the kernel compiled here, without the old bundle's.
    let listing = Command::new("tar").arg("tJf").arg(out.join("cubecl-cache.tar.xz")).output().expect("tar lists CubeCL's cache");
    let listing = String::from_utf8_lossy(&listing.stdout);
    assert!(!listing.contains("compilation-0123456789abcdef"), "an old bundle's cache came back: {listing}");
    let extracted = dir.path().join("returned");
    fs::create_dir_all(&extracted).unwrap();
    assert!(Command::new("tar").arg("xJf").arg(out.join("cubecl-cache.tar.xz")).arg("-C").arg(&extracted).status().unwrap().success());
    let toc = fs::read_to_string(extracted.join("compilation/cuda/0.10.0/ptx-by-source/toc.json.log")).unwrap();
    assert_eq!(toc.lines().count(), 3, "{toc}");

    // A second call on the warm machine, with the same carry: it starts from the kernels the
    // first compiled (3), not from the carried, older cache (2) unpacked over them.
    let again = dir.path().join("again");
    fs::create_dir(&again).unwrap();
    let output = Command::new("bash")
        .arg(dir.path().join("scripts/gpu-call.sh"))
        .args(["KERNEL_TESTS=one_test", "kernels:named=30"])
        .env("OUT", &again)
        .env_remove("KERNEL_TESTS")
        .env("CORPUS", "/dev/null")
        .output()
        .expect("bash runs gpu-call.sh");
    let parts = fs::read_to_string(again.join("parts.txt")).unwrap();
    assert!(parts.trim_end().ends_with("PTX cache 3 + 1 compiled here, KERNEL_TESTS=one_test"), "{parts}\n{}", String::from_utf8_lossy(&output.stdout));
}

/// The hf part sets ours beside PyTorch in tokens/s over the steps PyTorch timed, Σ tokens over
/// Σ seconds on both sides, and fails the run with no ratio where our run was cut short of them.
#[test]
fn the_hf_part_divides_ours_by_pytorch_over_the_steps_pytorch_timed() {
    let dir = tempfile_dir::Dir::new("gpu-run-ratio");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for (from, to) in [("scripts/gpu-run.sh", "gpu-run.sh"), ("benches/throughput_ratio.py", "throughput_ratio.py")] {
        fs::copy(root.join(from), dir.path().join(to)).unwrap();
    }
    // PyTorch timed steps 1-2 of 3 at 100 tokens/s, its warm-up as asked.
    fs::write(
        dir.path().join("torch_llama_reference.py"),
        "import sys\nwarmup = sys.argv[sys.argv.index('--warmup') + 1]\n\
         print(f'torch cuda bf16 (mixed) config=x checkpointing=True batch=1 seq=100: timed steps {warmup}-2 of 3: 100 tokens/s, peak 1 bytes')\n",
    )
    .unwrap();
    // Ours: step 0 tunes (10 s), step 1 takes 2 s and step 2 0.5 s; a held-out row between.
    // The run of shape `cut` ends after step 1.
    write_script(
        &dir.path().join("ulysses-trainer"),
        "while [ \"$1\" != --out ]; do shift; done; mkdir -p \"$2\"; m=\"$2/metrics.csv\"\n\
         echo step,loss,eval_loss,learning_rate,valid_tokens,processed_tokens,tokens_per_second,grad_norm,elapsed_seconds >\"$m\"\n\
         echo 0,5.5,,3e-4,99,100,10.0,1.0,10.0 >>\"$m\"\necho 1,5.4,,3e-4,99,100,50.0,1.0,12.0 >>\"$m\"\n\
         echo 1,,5.3,,,,,,12.5 >>\"$m\"\n\
         case \"$2\" in */hf-cut-sp*) exit 0 ;; esac\necho 2,5.3,,3e-4,99,100,200.0,1.0,13.0 >>\"$m\"\n",
    );
    let out = dir.path().join("out");
    let mut command = isolated("bash");
    for setting in ["HF_SPS", "HF_WARMUP", "HF_PURE_HALF", "HF_OLD_HEAD", "HF_PLANNED"] {
        command.env_remove(setting);
    }
    let output = command
        .arg(dir.path().join("gpu-run.sh"))
        .env("OUT", &out)
        .envs([("TRAIN_RUN", "hf"), ("HF_SHAPES", "whole cut"), ("HF_STEPS", "3"), ("HF_SEQ", "100"), ("CORPUS", root.join("scripts/gpu-run.sh").to_str().unwrap())])
        .output()
        .expect("bash runs gpu-run.sh");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let log = |name: &str| fs::read_to_string(out.join(format!("{name}.log"))).unwrap_or_else(|e| panic!("{name}.log: {e}\n{stdout}"));
    // 200 tokens in 2.5 s against 100 tokens/s (the median of our rates would say 1.250x, step 0
    // counted 0.240x).
    let whole = log("ratio-hf-whole-sp1");
    assert!(whole.starts_with("ours/torch 0.800x: ours 80 tokens/s, torch 100 tokens/s, both over steps 1-2 of 3"), "{whole}");
    let cut = log("ratio-hf-cut-sp1");
    assert!(cut.contains("no ratio") && cut.contains("no row for [2]"), "{cut}");
    assert_eq!(output.status.code(), Some(1), "a missing ratio must fail the run:\n{stdout}");
    assert!(stdout.contains("ratio-hf-cut-sp1 FAILED"), "{stdout}");
}

/// An executable shell script at `path`.
fn write_script(path: &Path, body: &str) {
    fs::write(path, format!("#!/bin/sh\n{body}")).unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(0o755)).unwrap();
}

/// What the scripts under test read from the environment, which a developer's shell (or a git
/// hook running the tests) may have set: the scratch repository's git and runs must not see it.
const INHERITED: [&str; 8] = ["GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "FORCE_BUNDLE", "TRAIN_RUNS", "HF_SEQ", "EIGHT_B_HOST_GB", "CORPUS"];

/// `program` without [`INHERITED`] in its environment.
fn isolated(program: &str) -> Command {
    let mut command = Command::new(program);
    for name in INHERITED {
        command.env_remove(name);
    }
    command
}

/// `scripts/gpu-bundle.sh` in a scratch repository, with the stand-ins in `bin` first on PATH
/// and `envs` set: its exit status and output.
fn bundle_in(repo: &Path, bin: &Path, envs: &[(&str, &str)]) -> (i32, String) {
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let output = isolated("bash").arg("scripts/gpu-bundle.sh").current_dir(repo).env("PATH", path).envs(envs.iter().copied()).output().expect("bash runs gpu-bundle.sh");
    (output.status.code().unwrap_or(-1), format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr)))
}

fn git(repo: &Path, args: &[&str]) {
    let status = isolated("git").args(["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]).args(args).current_dir(repo).status();
    assert!(status.expect("git runs").success(), "git {args:?}");
}

fn head(repo: &Path) -> String {
    let output = isolated("git").args(["rev-parse", "HEAD"]).current_dir(repo).output().unwrap();
    String::from_utf8(output.stdout).unwrap().trim().to_string()
}

/// A scratch repository holding gpu-bundle.sh and ptx-cache.sh (whose plan it reads), one source
/// file and one Markdown file, committed.
fn scratch_repo(root: &Path) -> std::path::PathBuf {
    let repo = root.join("repo");
    for folder in [repo.join("scripts"), repo.join(".gpu-carry"), repo.join(".gpu-cache")] {
        fs::create_dir_all(folder).unwrap();
    }
    for script in ["scripts/gpu-bundle.sh", "scripts/ptx-cache.sh"] {
        fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join(script), repo.join(script)).unwrap();
    }
    fs::write(repo.join(".gitignore"), "/.gpu-bundle\n/.gpu-carry\n/.gpu-cache\n").unwrap();
    fs::write(repo.join("lib.rs"), "fn a() {}\n").unwrap();
    fs::write(repo.join("notes.md"), "measured\n").unwrap();
    git(&repo, &["init", "-q"]);
    git(&repo, &["add", "-A"]);
    git(&repo, &["commit", "-qm", "built"]);
    repo
}

/// A lent GPU must never measure old code: the bundle is built again after any change but
/// Markdown, and with uncommitted changes; a bundle of a commit HEAD changes in Markdown alone is
/// kept (a GPU session then starts 40-60 minutes sooner).
#[test]
fn a_bundle_is_built_again_unless_markdown_alone_changed() {
    let dir = tempfile_dir::Dir::new("gpu-bundle");
    let (repo, bin) = (scratch_repo(dir.path()), dir.path().join("bin"));
    fs::create_dir_all(&bin).unwrap();
    write_script(&bin.join("cargo"), "echo 'cargo build ran' >&2\nexit 7\n");
    let built = head(&repo);
    let mark = || {
        fs::write(repo.join(".gpu-carry/bundle.tar.xz"), "binaries").unwrap();
        fs::write(repo.join(".gpu-cache/cubecl-cache.tar.xz"), "kernels").unwrap();
        fs::write(repo.join(".gpu-carry/bundle.commit"), format!("{built}\ntrain-runs: llama-3.2-1b:1 8b\nhf-seq: 16384\nskipped: \n")).unwrap();
    };
    mark();

    // Markdown alone since: kept.
    fs::write(repo.join("notes.md"), "measured again\n").unwrap();
    git(&repo, &["commit", "-qam", "notes"]);
    let (code, out) = bundle_in(&repo, &bin, &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("nothing to build") && !out.contains("cargo build ran") && !out.contains("warning"), "{out}");

    // The same plan named: kept; another: built.
    let (code, out) = bundle_in(&repo, &bin, &[("TRAIN_RUNS", " llama-3.2-1b:1   8b"), ("HF_SEQ", "16384")]);
    assert!(code == 0 && out.contains("nothing to build"), "the same plan must keep the bundle: {code}\n{out}");
    for other in [("TRAIN_RUNS", "llama-3.2-1b:1"), ("TRAIN_RUNS", ""), ("HF_SEQ", "4096")] {
        mark();
        let (code, out) = bundle_in(&repo, &bin, &[other]);
        assert!(code != 0 && out.contains("cargo build ran"), "{other:?} must be built: {code}\n{out}");
    }

    // A change not committed: built, and the old mark gone.
    mark();
    fs::write(repo.join("lib.rs"), "fn b() {}\n").unwrap();
    let (code, out) = bundle_in(&repo, &bin, &[]);
    assert!(code != 0 && out.contains("cargo build ran"), "an uncommitted change must be built: {code}\n{out}");
    assert!(!repo.join(".gpu-carry/bundle.commit").exists(), "the mark of the old bundle stayed");

    // A new file not committed, where git's configuration hides untracked files: built.
    git(&repo, &["checkout", "-q", "lib.rs"]);
    git(&repo, &["config", "status.showUntrackedFiles", "no"]);
    mark();
    fs::write(repo.join("new.rs"), "fn c() {}\n").unwrap();
    let (code, out) = bundle_in(&repo, &bin, &[]);
    assert!(code != 0 && out.contains("cargo build ran"), "an untracked source must be built: {code}\n{out}");
    fs::remove_file(repo.join("new.rs")).unwrap();

    // A code change committed: built.
    mark();
    fs::write(repo.join("lib.rs"), "fn b() {}\n").unwrap();
    git(&repo, &["commit", "-qam", "code"]);
    let (code, out) = bundle_in(&repo, &bin, &[]);
    assert!(code != 0 && out.contains("cargo build ran"), "a committed code change must be built: {code}\n{out}");

    // A missing kernel cache: built.
    mark();
    git(&repo, &["reset", "-q", "--hard", "HEAD~1"]);
    fs::remove_file(repo.join(".gpu-cache/cubecl-cache.tar.xz")).unwrap();
    let (code, out) = bundle_in(&repo, &bin, &[]);
    assert!(code != 0 && out.contains("cargo build ran"), "a bundle without its kernel cache must be built: {code}\n{out}");
}

/// A build that succeeds leaves its commit and its fill's report as the mark, so the next run
/// keeps it and says which compile-only runs the fill skipped (the GPU compiles those itself).
#[test]
fn a_finished_bundle_marks_its_commit_and_what_its_fill_skipped() {
    let dir = tempfile_dir::Dir::new("gpu-bundle-built");
    let (repo, bin, artifacts) = (scratch_repo(dir.path()), dir.path().join("bin"), dir.path().join("artifacts"));
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for folder in [&bin, &artifacts, &repo.join("benches")] {
        fs::create_dir_all(folder).unwrap();
    }
    for file in ["scripts/gpu-run.sh", "scripts/cargo-executable.py", "benches/sdpa_reference.py", "benches/torch_llama_reference.py", "benches/throughput_ratio.py"] {
        fs::copy(root.join(file), repo.join(file)).unwrap();
    }
    fs::create_dir_all(repo.join("benches/hf-shapes")).unwrap();
    fs::write(repo.join("benches/hf-shapes/tiny.json"), "{}\n").unwrap();
    // cargo prints the executables as `--message-format=json` does; strip has nothing to strip.
    let executables = [("test", "flash_attention"), ("bench", "flash_attention"), ("bench", "training_memory"), ("bench", "decorator_overhead"), ("bin", "ulysses-nccl-check"), ("bin", "ulysses-launch"), ("bin", "ulysses-trainer")];
    let messages: String = executables
        .iter()
        .map(|(kind, name)| {
            let path = artifacts.join(format!("{kind}-{name}"));
            fs::write(&path, "binary").unwrap();
            format!("echo '{{\"reason\":\"compiler-artifact\",\"executable\":\"{}\",\"target\":{{\"name\":\"{name}\",\"kind\":[\"{kind}\"]}}}}'\n", path.display())
        })
        .collect();
    write_script(&bin.join("cargo"), &messages);
    write_script(&bin.join("strip"), "exit 0\n");
    // The fill: its plan, one kernel compiled, the 8B run skipped.
    write_script(
        &repo.join("scripts/ptx-cache.sh"),
        "plan='train-runs: llama-3.2-1b:1 8b\nhf-seq: 16384'\n[ \"$1\" = --plan ] && { echo \"$plan\"; exit 0; }\n\
         mkdir -p \"$1\" && echo ptx >\"$1/kernel\"\nprintf '%s\\nskipped: 8b\\n' \"$plan\" >\"$FILL_REPORT\"\n",
    );
    git(&repo, &["add", "-A"]);
    git(&repo, &["commit", "-qm", "scripts"]);

    let (code, out) = bundle_in(&repo, &bin, &[]);
    assert_eq!(code, 0, "{out}");
    let mark = fs::read_to_string(repo.join(".gpu-carry/bundle.commit")).expect("a finished bundle is marked");
    assert_eq!(mark, format!("{}\ntrain-runs: llama-3.2-1b:1 8b\nhf-seq: 16384\nskipped: 8b\n", head(&repo)), "{out}");
    let listing = Command::new("tar").arg("tJf").arg(repo.join(".gpu-cache/cubecl-cache.tar.xz")).output().unwrap();
    assert!(String::from_utf8_lossy(&listing.stdout).contains("compilation/kernel"), "the fill's kernels are not in the cache: {out}");

    let (code, out) = bundle_in(&repo, &bin, &[]);
    assert!(code == 0 && out.contains("nothing to build"), "{out}");
    assert!(out.contains("warning") && out.contains("skipped (8b"), "the kept bundle must say its fill skipped 8b: {out}");
}

/// `scripts/ptx-cache.sh` runs gpu-run.sh's own trainer commands (from its dry run, which sees
/// none of the caller's GPU-call settings) on the compile-only runtime: two steps, the 8B shape
/// cut to 2 layers, no argument given twice; a run skipped for want of memory is reported, never
/// silently left out.
#[test]
fn the_fill_compiles_what_gpu_runs_steps_launch() {
    let dir = tempfile_dir::Dir::new("ptx-cache");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (repo, bin, target, tools) = (dir.path().join("repo"), dir.path().join("bin"), dir.path().join("target"), dir.path().join("tools"));
    let wheel = tools.join("lib/python3.12/site-packages/nvidia/cu13/lib");
    for folder in [repo.join("scripts"), repo.join("benches/hf-shapes"), bin.clone(), target.join("debug"), wheel.clone()] {
        fs::create_dir_all(folder).unwrap();
    }
    for file in ["scripts/ptx-cache.sh", "scripts/gpu-run.sh", "benches/hf-shapes/llama-3.2-1b.json", "benches/hf-shapes/llama-3.1-8b.json"] {
        fs::copy(root.join(file), repo.join(file)).unwrap();
    }
    fs::write(wheel.join("libnvrtc.so.13"), "").unwrap();
    write_script(&repo.join("scripts/cuda-tools.sh"), &format!("echo '{}'\n", tools.display()));
    write_script(&bin.join("cargo"), "exit 0\n");
    let (runs, sources) = (dir.path().join("runs.txt"), dir.path().join("sources.txt"));
    // The trainer writes its arguments and its config's layer count, and what it launched.
    write_script(
        &target.join("debug/ulysses-trainer"),
        &format!(
            "out=; config=; prev=\nfor a in \"$@\"; do [ \"$prev\" = --out ] && out=$a; [ \"$prev\" = --hf-config ] && config=$a; prev=$a; done\n\
             echo \"$* layers=$(grep -o '\"num_hidden_layers\": *[0-9]*' \"$config\" | grep -o '[0-9]*$')\" >>'{}'\nmkdir -p \"$out/cuda-sources\"\necho 'step 2 done'\n",
            runs.display()
        ),
    );
    write_script(&target.join("debug/ulysses-cuda-sources"), &format!("echo \"$*\" >>'{}'\n", sources.display()));
    let fill = |host_gb: &str| {
        let report = dir.path().join("report.txt");
        let _ = fs::remove_file(&runs);
        let output = isolated("bash")
            .arg(repo.join("scripts/ptx-cache.sh"))
            .arg(dir.path().join("cache"))
            .env("PATH", format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default()))
            .env("CARGO_TARGET_DIR", &target)
            .env("CORPUS", "/dev/null")
            .env("EIGHT_B_HOST_GB", host_gb)
            .env("FILL_REPORT", &report)
            // A GPU call's settings in the shell: the fill's dry run must not see them.
            .env("EIGHT_B_OFFLOAD", "1")
            .env("KERNELS_RUN", "named")
            .output()
            .expect("bash runs ptx-cache.sh");
        let out = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        assert!(output.status.success(), "{out}");
        (fs::read_to_string(&runs).unwrap_or_default(), fs::read_to_string(&report).unwrap(), out)
    };

    let (runs_made, report, out) = fill("0");
    let lines: Vec<&str> = runs_made.lines().collect();
    assert_eq!(lines.len(), 2, "the 1B and 8B runs: {runs_made}\n{out}");
    for line in &lines {
        let words: Vec<&str> = line.split(' ').collect();
        let flags: Vec<&&str> = words.iter().filter(|w| w.starts_with("--")).collect();
        let distinct: std::collections::BTreeSet<&&&str> = flags.iter().collect();
        assert_eq!(flags.len(), distinct.len(), "an argument given twice: {line}");
        assert!(line.contains("--backend cuda-compile-only ") && line.contains("--steps 2 ") && line.contains("--batch-size 1 "), "{line}");
    }
    assert!(lines[0].contains("--sp 1 ") && lines[0].contains("--seq-len 16384 ") && lines[0].contains("hf-shapes/llama-3.2-1b.json") && lines[0].ends_with("layers=16"), "{}", lines[0]);
    assert!(
        lines[1].contains("--seq-len 32768 ") && lines[1].contains("--zero 3 --offload-parameters ") && lines[1].contains("--tile-tokens 4096 ") && !lines[1].contains("--offload-to-host") && lines[1].ends_with("layers=2"),
        "the 8B run as EIGHT_B_ZERO3=params runs it, 2 layers: {}",
        lines[1]
    );
    assert_eq!(report, "train-runs: llama-3.2-1b:1 8b\nhf-seq: 16384\nskipped: \n");
    let compiled = fs::read_to_string(&sources).unwrap();
    assert!(compiled.contains("--launched ") && compiled.matches("cuda-sources").count() == 2, "{compiled}");

    let (runs_made, report, out) = fill("100000");
    assert_eq!(runs_made.lines().count(), 1, "{runs_made}");
    assert!(out.contains("warning: skipping 8b"), "{out}");
    assert_eq!(report, "train-runs: llama-3.2-1b:1 8b\nhf-seq: 16384\nskipped: 8b\n");
}

/// A temporary folder removed on drop (no extra dependency for these tests).
mod tempfile_dir {
    use std::path::{Path, PathBuf};

    pub struct Dir(PathBuf);

    impl Dir {
        pub fn new(prefix: &str) -> Self {
            let path = std::env::temp_dir().join(format!("{prefix}-{}-{:?}", std::process::id(), std::thread::current().id()));
            let _ = std::fs::remove_dir_all(&path);
            std::fs::create_dir_all(&path).unwrap();
            Self(path)
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}
