//! Every CUDA build the GPU machine runs tunes burn's kernels: burn-cubecl's `autotune` feature,
//! which the project's `default-features = false` on burn-cubecl leaves out. Without it every
//! matmul runs one fixed kernel whatever its shape, as in the four H100 runs up to 2026-11-27.
//!
//! The build is the one `scripts/gpu-bundle.sh` makes (one cargo invocation for every binary);
//! `cargo tree` resolves the features burn-cubecl gets in it (no build), and without `autotune`
//! it fails here, naming the selection.

use std::{path::Path, process::Command};

/// The packages and features of the one cargo build in `script` (its `selection="..."` line),
/// as cargo's arguments. Fails unless there is exactly one build and it uses that selection.
fn the_cargo_build(script: &str) -> Vec<String> {
    let code: Vec<&str> = script.lines().filter(|line| !line.trim_start().starts_with('#')).collect();
    let builds: Vec<&&str> = code.iter().filter(|line| line.contains("cargo build") || line.contains("test-executable.sh")).collect();
    assert!(
        builds.len() == 1 && builds[0].contains("cargo build --release $selection"),
        "gpu-bundle.sh must build everything in one `cargo build --release $selection` (features unify across one invocation alone): {builds:?}"
    );
    let selection = code
        .iter()
        .find_map(|line| line.strip_prefix("selection=\""))
        .and_then(|rest| rest.strip_suffix('"'))
        .expect("gpu-bundle.sh has a selection=\"...\" line");
    selection.split_whitespace().map(str::to_string).collect()
}

/// burn-cubecl's features in the build that `selection` (cargo's package and feature flags)
/// makes, or `None` when that build has no burn-cubecl.
fn burn_cubecl_features(selection: &[&str]) -> Option<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // The cargo running the tests, not the one that built them (a toolchain since removed).
    let output = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
        .current_dir(root)
        // burn 0.21's (burn-ulysses-ops builds burn 0.22's, which no CUDA build has).
        .args(["tree", "--locked", "-e", "features", "-i", "burn-cubecl@0.21.0"])
        .args(selection)
        .output()
        .expect("cargo runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    // A build whose packages cannot reach burn-cubecl at all (ulysses-dist's) is one without it.
    if !output.status.success() && stderr.contains("did not match any packages") {
        return None;
    }
    assert!(output.status.success(), "cargo tree {selection:?} failed: {stderr}");
    // cargo prints nothing (and warns so) for a build without burn-cubecl.
    (!stdout.trim().is_empty()).then_some(stdout)
}

#[test]
fn every_cuda_build_autotunes_burns_kernels() {
    let build = the_cargo_build(include_str!("../scripts/gpu-bundle.sh"));
    assert!(build.iter().filter(|word| *word == "-p").count() >= 5, "the kernels, suite, NCCL, launcher and trainer packages: {build:?}");
    // The build makes tests and benches too, so the dev-dependencies' features are its own.
    let mut selection = vec!["-e", "normal,build,dev"];
    selection.extend(build.iter().map(String::as_str));
    let tree = burn_cubecl_features(&selection).expect("the CUDA build has burn-cubecl");
    assert!(
        tree.contains("burn-cubecl feature \"autotune\""),
        "gpu-bundle.sh builds {build:?} with burn-cubecl but without its `autotune` feature: every matmul would run one untuned kernel. Enable it through the package's CUDA feature (`ulysses-nccl/autotune` or `burn-cubecl/autotune`).\n{tree}"
    );
}

#[test]
fn the_workspace_cpu_build_does_not_autotune() {
    // The README's test command: tuning on lavapipe would time candidate kernels in every wgpu
    // test.
    let tree = burn_cubecl_features(&["--workspace"]).expect("the workspace's tests use burn-cubecl on wgpu");
    assert!(!tree.contains("burn-cubecl feature \"autotune\""), "the CPU build of the tests autotunes:\n{tree}");
}
