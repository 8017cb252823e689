//! Writes the CUDA C++ sources of every flash kernel the planner would launch on an H100, an
//! A100 and an L40, with an index, for `scripts/cuda-machine-code.py`; with `--ptx-cache ROOT`,
//! also writes CubeCL's PTX cache of those kernels at ROOT (new or empty), taking what the cache
//! at `--previous-ptx-cache OLD` holds and compiling the rest (`scripts/ptx-cache.sh`), and
//! with `--launched DIR,...` the kernels a compile-only run wrote there too (`ulysses-trainer
//! --backend cuda-compile-only`: burn's kernels and their autotune candidates):
//!
//!     ulysses-cuda-sources OUT_DIR [--targets sm_90a:representative+sixty-four-bit,sm_80:representative,sm_89:representative] [--ptx-cache ROOT [--previous-ptx-cache OLD] [--launched DIR,...]]

use std::{path::PathBuf, process::ExitCode};

use ulysses_cuda_check::{DEFAULT_TARGETS, fill_ptx_cache, read_kernels, write_sources};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = format!("usage: ulysses-cuda-sources OUT_DIR [--targets {DEFAULT_TARGETS}] [--ptx-cache ROOT [--previous-ptx-cache OLD] [--launched DIR,...]]");
    let Some(out) = args.first().filter(|a| !a.starts_with("--")).map(PathBuf::from) else {
        eprintln!("{usage}");
        return ExitCode::from(2);
    };
    let mut options = std::collections::HashMap::new();
    for pair in args[1..].chunks(2) {
        match pair {
            [name, value] if ["--targets", "--ptx-cache", "--previous-ptx-cache", "--launched"].contains(&name.as_str()) && !value.starts_with("--") => {
                options.insert(name.as_str(), value.as_str());
            }
            _ => {
                eprintln!("error: cannot read {pair:?}\n{usage}");
                return ExitCode::from(2);
            }
        }
    }
    for needs_cache in ["--previous-ptx-cache", "--launched"] {
        if options.contains_key(needs_cache) && !options.contains_key("--ptx-cache") {
            eprintln!("error: {needs_cache} without --ptx-cache\n{usage}");
            return ExitCode::from(2);
        }
    }
    let targets = options.get("--targets").copied().unwrap_or(DEFAULT_TARGETS);
    let (lines, mut kernels) = match write_sources(&out, targets) {
        Ok(written) => written,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::FAILURE;
        }
    };
    lines.iter().for_each(|line| println!("{line}"));
    for dir in options.get("--launched").into_iter().flat_map(|dirs| dirs.split(',')) {
        match read_kernels(dir.as_ref()) {
            Ok(launched) => {
                println!("{dir}: {} kernel sources launched by a compile-only run", launched.len());
                kernels.extend(launched);
            }
            Err(error) => {
                eprintln!("error: --launched: {error}");
                return ExitCode::FAILURE;
            }
        }
    }
    if let Some(root) = options.get("--ptx-cache") {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let previous = options.get("--previous-ptx-cache").map(std::path::Path::new);
        match fill_ptx_cache(root.as_ref(), previous, &kernels, threads) {
            Ok(fill) => {
                println!("PTX cache {root}: {} kernels kept from the previous cache, {} compiled and added", fill.kept, fill.compiled);
                if !fill.failed.is_empty() {
                    fill.failed.iter().for_each(|failure| eprintln!("error: NVRTC rejected {failure}"));
                    return ExitCode::FAILURE;
                }
            }
            Err(error) => {
                eprintln!("error: {error}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
