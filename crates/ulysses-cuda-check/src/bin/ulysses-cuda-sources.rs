//! Writes the CUDA C++ sources of every flash kernel the planner would launch on an H100, an
//! A100 and an L40, with an index, for `scripts/cuda-machine-code.py`; with `--ptx-cache ROOT`,
//! also compiles those the PTX cache under ROOT lacks and adds them (`scripts/ptx-cache.sh`):
//!
//!     ulysses-cuda-sources OUT_DIR [--targets sm_90a:representative+sixty-four-bit,sm_80:representative,sm_89:representative] [--ptx-cache ROOT]

use std::{path::PathBuf, process::ExitCode};

use ulysses_cuda_check::{DEFAULT_TARGETS, fill_ptx_cache, write_sources};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(out) = args.first().map(PathBuf::from) else {
        eprintln!("usage: ulysses-cuda-sources OUT_DIR [--targets {DEFAULT_TARGETS}] [--ptx-cache ROOT]");
        return ExitCode::from(2);
    };
    let option = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map(String::as_str);
    let targets = option("--targets").unwrap_or(DEFAULT_TARGETS);
    let (lines, kernels) = match write_sources(&out, targets) {
        Ok(written) => written,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::FAILURE;
        }
    };
    lines.iter().for_each(|line| println!("{line}"));
    if let Some(root) = option("--ptx-cache") {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        match fill_ptx_cache(root.as_ref(), &kernels, threads) {
            Ok(fill) => println!("PTX cache {root}: {} kernels held already, {} compiled and added", fill.cached, fill.compiled),
            Err(error) => {
                eprintln!("error: {error}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
