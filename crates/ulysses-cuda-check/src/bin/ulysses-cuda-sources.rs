//! Writes the CUDA C++ sources of every flash kernel the planner would launch on an H100, an
//! A100 and an L40, with an index, for `scripts/cuda-machine-code.py`:
//!
//!     ulysses-cuda-sources OUT_DIR [--targets sm_90a:representative+sixty-four-bit,sm_80:representative,sm_89:representative]

use std::{path::PathBuf, process::ExitCode};

use ulysses_cuda_check::{DEFAULT_TARGETS, write_sources};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(out) = args.first().map(PathBuf::from) else {
        eprintln!("usage: ulysses-cuda-sources OUT_DIR [--targets {DEFAULT_TARGETS}]");
        return ExitCode::from(2);
    };
    let targets = args.iter().position(|a| a == "--targets").and_then(|i| args.get(i + 1)).map(String::as_str).unwrap_or(DEFAULT_TARGETS);
    match write_sources(&out, targets) {
        Ok(lines) => {
            lines.iter().for_each(|line| println!("{line}"));
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}
