//! The flash kernels as an H100, an A100 and an L40 (each dtype and head dim: `DEFAULT_TARGETS`)
//! would compile them: every case of `DEFAULT_TARGETS` must compile to CUDA C++ here, and,
//! with NVIDIA's compilers at hand (`ULYSSES_CUDA_TOOLS`: venvs with the PyPI wheels, separated
//! by `:`, each checked, on every target or, written `VENV@sm_90a,...`, on those; `.ci/run`
//! checks the A100 and the L40 with CUDA 12.9's and the H100 with 13.0's, the GPU image's), to machine
//! code that spills nothing, fits the shared memory and an SM, and uses the tensor cores in
//! every kernel of the tensor-core engine (`scripts/cuda-machine-code.py`). Without the tools that half says SKIPPED, unless
//! `ULYSSES_REQUIRE_CUDA_TOOLS=1` makes it a failure. `ULYSSES_CUDA_REPORT=FILE` appends the
//! reports and tables to FILE (CI prints it after the workspace's tests).

use std::{path::PathBuf, process::Command};

use ulysses_cuda_check::{DEFAULT_TARGETS, runtime::TARGETS, write_sources};

#[test]
fn every_planned_kernel_compiles_to_machine_code_that_fits_and_uses_tensor_cores() {
    let out = std::env::temp_dir().join(format!("ulysses-cuda-sources-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let (lines, _) = write_sources(&out, DEFAULT_TARGETS).unwrap_or_else(|e| panic!("{e}"));
    lines.iter().for_each(|line| println!("{line}"));
    assert_eq!(lines.len(), TARGETS.len());

    let Ok(tools) = std::env::var("ULYSSES_CUDA_TOOLS") else {
        let hint = "SKIPPED: the machine-code half needs NVIDIA's compilers, as .ci/run gives them: \
                    ULYSSES_CUDA_TOOLS=\"$(bash scripts/cuda-tools.sh 12)@sm_80,sm_89:$(bash scripts/cuda-tools.sh 13)@sm_90a\" \
                    (cuda-tools.sh makes each venv of pinned PyPI wheels: 12.9's for the A100 and L40, 13.0's, the GPU image's, for the H100)";
        assert_ne!(std::env::var("ULYSSES_REQUIRE_CUDA_TOOLS").as_deref(), Ok("1"), "{hint}");
        eprintln!("{hint}");
        let _ = std::fs::remove_dir_all(&out);
        return;
    };
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/cuda-machine-code.py");
    let mut checked: Vec<&str> = Vec::new();
    for (index, entry) in tools.split(':').filter(|t| !t.is_empty()).enumerate() {
        let (tools, only) = entry.split_once('@').map_or((entry, None), |(tools, only)| (tools, Some(only)));
        let table = out.join(format!("tables-{index}.txt"));
        let mut command = Command::new(PathBuf::from(tools).join("bin/python"));
        command.arg(&script).arg(&out).arg("--table").arg(&table);
        if let Some(only) = only {
            command.arg("--only").arg(only);
        }
        let output = command
            .output()
            .unwrap_or_else(|e| panic!("cannot run {} with {tools}/bin/python: {e}", script.display()));
        let report = String::from_utf8_lossy(&output.stdout);
        let shown = format!("{report}{}", std::fs::read_to_string(&table).unwrap_or_default());
        println!("{shown}");
        // For CI to print after the workspace's tests, without compiling everything again.
        if let Ok(path) = std::env::var("ULYSSES_CUDA_REPORT") {
            use std::io::Write;
            let mut file = std::fs::OpenOptions::new().create(true).append(true).open(&path).unwrap_or_else(|e| panic!("cannot write {path}: {e}"));
            writeln!(file, "{shown}").unwrap_or_else(|e| panic!("cannot write {path}: {e}"));
        }
        eprintln!("{}", String::from_utf8_lossy(&output.stderr));
        assert!(output.status.success(), "the machine-code check with {tools} failed:\n{report}");
        // The H100's known defects were measured with ptxas 13.0, the GPU image's: another
        // version's verdicts on sm_90a would not be the GPU's.
        let checks_h100 = only.is_none_or(|only| only.split(',').any(|name| name == "sm_90a"));
        if checks_h100 && std::env::var("ULYSSES_REQUIRE_CUDA_TOOLS").as_deref() == Ok("1") {
            assert!(report.contains("cuda-machine-code: nvrtc 13.0; Build cuda_13.0"), "sm_90a checked with other compilers than CUDA 13.0's ({tools}):\n{report}");
        }
        for target in TARGETS.iter().filter(|target| only.is_none_or(|only| only.split(',').any(|name| name == target.name))) {
            assert!(report.contains(&format!("{} (", target.name)), "no line for {} with {tools}:\n{report}", target.name);
            checked.push(target.name);
        }
    }
    // Required, the check covers every target: an empty ULYSSES_CUDA_TOOLS, or venvs for some
    // targets alone, checks less than it says.
    if std::env::var("ULYSSES_REQUIRE_CUDA_TOOLS").as_deref() == Ok("1") {
        let missing: Vec<&str> = TARGETS.iter().map(|target| target.name).filter(|name| !checked.contains(name)).collect();
        assert!(missing.is_empty(), "ULYSSES_CUDA_TOOLS={tools:?} checks no compiler on {missing:?}");
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// The check's parsers on made-up listings (`--self-test`, no compiler needed): a spill
/// reloaded at the top of a step is in the loop, every function's spills count, a report
/// without a register count is refused.
#[test]
fn the_machine_code_checks_parsers_read_what_they_claim() {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/cuda-machine-code.py");
    let output = Command::new("python3").arg(&script).arg("--self-test").output().unwrap_or_else(|e| panic!("cannot run python3 {}: {e}", script.display()));
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
}
