//! Every trainer command `scripts/gpu-run.sh` would run on a lent GPU, checked here by the
//! trainer itself (`--check`: the command line, the settings and the data, without training):
//! a GPU's minutes must not go to a command that stops at its first line. The commands come
//! from the script's dry run, for each of its training parts; the paths the GPU bundle copies
//! (`hf-shapes`) are the checkout's. Two such failures reached the GPU before: `--progress`
//! without `--checkpoint-layers` (caught in review), and a 65 536-token sequence longer than
//! the default corpus's held-out split (the first GPU run's `train-scale-65536`).

use std::{path::Path, process::Command};

/// `(dry-run step name, the trainer's arguments)` of every trainer command of
/// `TRAIN_RUN=part`, with `env` beside it.
fn trainer_commands(part: &str, env: &[(&str, &str)]) -> Vec<(String, Vec<String>)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = std::env::temp_dir().join(format!("ulysses-gpu-commands-{}-{part}", std::process::id()));
    let output = Command::new("bash")
        .arg(root.join("scripts/gpu-run.sh"))
        .env("DRY_RUN", "1")
        .env("OUT", &out)
        .env("TRAIN_RUN", part)
        .envs(env.iter().copied())
        .output()
        .expect("bash runs gpu-run.sh");
    let _ = std::fs::remove_dir_all(&out);
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(output.status.success(), "the dry run of {part} failed: {stdout}{}", String::from_utf8_lossy(&output.stderr));
    let hf_shapes = root.join("benches/hf-shapes");
    stdout
        .lines()
        .filter_map(|line| {
            let (name, command) = line.split_once(": ")?;
            let (_, args) = command.split_once("/ulysses-trainer ")?;
            // The bundle's copy of benches/hf-shapes sits beside its scripts.
            let args = args.split_whitespace().map(|arg| match arg.split_once("/scripts/hf-shapes/") {
                Some((_, file)) => hf_shapes.join(file).display().to_string(),
                None => arg.to_string(),
            });
            Some((name.to_string(), args.collect()))
        })
        .collect()
}

/// The trainer's `--check` of `args` in `folder`: its output, stdout and stderr. A launched
/// rank's variables would make it a process of a job that is not there: removed.
fn trainer_check(args: &[String], folder: &Path) -> (std::process::Output, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_ulysses-trainer"))
        .current_dir(folder)
        .args(args)
        .arg("--check")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("SLURM_PROCID")
        .output()
        .expect("the trainer starts");
    let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout).into_owned(), String::from_utf8_lossy(&output.stderr).into_owned());
    (output, stdout, stderr)
}

#[test]
fn every_trainer_command_of_the_gpu_run_passes_the_trainers_check() {
    let parts: [(&str, &[(&str, &str)]); 6] = [
        ("check", &[]),
        ("scale", &[]),
        ("hf", &[]),
        ("8b", &[("EIGHT_B_ZERO3", "params"), ("EIGHT_B_SEQS", "65536 262144")]),
        ("8b", &[("EIGHT_B_ZERO3", "1")]),
        ("8b", &[]),
    ];
    let mut checked = 0;
    for (part, env) in parts {
        let commands = trainer_commands(part, env);
        assert!(!commands.is_empty(), "TRAIN_RUN={part} {env:?} has no trainer command");
        for (name, args) in commands {
            let (output, stdout, stderr) = trainer_check(&args, Path::new("."));
            assert!(output.status.success() && stdout.starts_with("checked: "), "TRAIN_RUN={part} {env:?}, {name}: {}\n{stdout}{stderr}", args.join(" "));
            checked += 1;
        }
    }
    println!("{checked} trainer commands checked");
}

/// `--check` stops where the run would: a sequence longer than the corpus's held-out split,
/// and a flag that needs another, each named; and it writes nothing.
#[test]
fn the_check_refuses_what_the_run_would_refuse_and_writes_nothing() {
    let out = std::env::temp_dir().join(format!("ulysses-check-{}", std::process::id()));
    let check = |extra: &[&str]| {
        let output = Command::new(env!("CARGO_BIN_EXE_ulysses-trainer"))
            .args(["--check", "--steps", "2", "--out"])
            .arg(&out)
            .args(extra)
            .output()
            .expect("the trainer starts");
        (output.status.success(), String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr))
    };
    let (ok, said) = check(&[]);
    assert!(ok && said.starts_with("checked: 2 steps of 8 sequences × 256 tokens"), "{said}");
    let (ok, said) = check(&["--seq-len", "65536"]);
    assert!(!ok && said.contains("does not fit the corpus"), "{said}");
    let (ok, said) = check(&["--progress"]);
    assert!(!ok && said.contains("--checkpoint-layers"), "{said}");
    assert!(!out.exists(), "--check wrote {}", out.display());
}

/// The trainer's arguments in every command of the guides' code blocks (README.md and
/// docs/*.md) that runs it, a launcher's part left out: `(file, the command, its arguments)`.
fn guides_trainer_commands(root: &Path) -> Vec<(String, String, Vec<String>)> {
    let mut guides = vec![root.join("README.md")];
    guides.extend(std::fs::read_dir(root.join("docs")).expect("docs/").flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|e| e == "md")));
    let mut commands = Vec::new();
    for guide in guides {
        let text = std::fs::read_to_string(&guide).unwrap();
        let (mut in_block, mut line) = (false, String::new());
        for raw in text.lines() {
            if raw.trim_start().starts_with("```") {
                in_block = !in_block;
                continue;
            }
            if !in_block {
                continue;
            }
            line.push_str(raw.trim_end().trim_end_matches('\\'));
            line.push(' ');
            if raw.trim_end().ends_with('\\') {
                continue;
            }
            let command = std::mem::take(&mut line);
            let words: Vec<&str> = command.split('#').next().unwrap().split_whitespace().collect();
            if words.first() == Some(&"cargo") && words.get(1) != Some(&"run") {
                continue;
            }
            let Some(at) = words.iter().position(|w| *w == "ulysses-trainer" || w.ends_with("/ulysses-trainer")) else { continue };
            let mut args = &words[at + 1..];
            if words.first() == Some(&"cargo") {
                args = args.iter().position(|w| *w == "--").map_or(&[][..], |dash| &args[dash + 1..]);
            }
            let name = guide.file_name().unwrap().to_string_lossy().into_owned();
            commands.push((name, command.trim().to_string(), args.iter().map(|s| s.to_string()).collect()));
        }
    }
    commands
}

/// Every command of the guides that runs the trainer on files this checkout has passes the
/// trainer's `--check` (`--out` moved to a fresh folder): a guide's example that stops at its
/// first line is a guide that misleads. Those naming the user's own files (a downloaded
/// checkpoint, `train.jsonl`) are skipped, and said so.
#[test]
fn every_trainer_command_of_the_guides_on_this_checkouts_files_passes_the_trainers_check() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = std::env::temp_dir().join(format!("ulysses-guides-{}", std::process::id()));
    let (mut checked, mut skipped) = (0, Vec::new());
    for (guide, command, mut args) in guides_trainer_commands(&root) {
        let paths = ["--model", "--data", "--tokens", "--tokenizer", "--hf-config", "--corpus", "--eval-data", "--resume"];
        if let Some(missing) = args.windows(2).find(|w| paths.contains(&w[0].as_str()) && !root.join(&w[1]).exists()) {
            skipped.push(format!("{guide}: {} {} (the user's)", missing[0], missing[1]));
            continue;
        }
        if let Some(at) = args.iter().position(|a| a == "--out") {
            args[at + 1] = out.join(checked.to_string()).display().to_string();
        }
        let (output, stdout, stderr) = trainer_check(&args, &root);
        assert!(output.status.success() && stdout.starts_with("checked: "), "{guide}: {command}\n{stdout}{stderr}");
        checked += 1;
    }
    assert!(!out.exists(), "--check wrote {}", out.display());
    println!("{checked} commands of the guides checked; skipped: {skipped:?}");
    assert!(checked >= 7, "only {checked} commands of the guides were checked; skipped: {skipped:?}");
}
