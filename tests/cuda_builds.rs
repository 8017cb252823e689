//! Every CUDA build the GPU machine runs tunes burn's kernels: burn-cubecl's `autotune` feature,
//! which the project's `default-features = false` on burn-cubecl leaves out. Without it every
//! matmul runs one fixed kernel whatever its shape, as in the four H100 runs up to 2026-11-27.
//!
//! The builds are the ones `scripts/gpu-bundle.sh` makes; for each, `cargo tree` resolves the
//! features burn-cubecl gets (no build), and a build that has burn-cubecl without `autotune`
//! fails here, naming the command.

use std::{path::Path, process::Command};

/// `-p PACKAGE`, `--features FEATURES` and whether it builds tests or benches (which take the
/// dev-dependencies) of each cargo command in `script`.
fn cargo_builds(script: &str) -> Vec<(String, Option<String>, bool)> {
    script
        .lines()
        .filter(|line| !line.trim_start().starts_with('#') && (line.contains("cargo build") || line.contains("test-executable.sh")))
        .map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            let after = |flag: &str| words.iter().position(|w| *w == flag).map(|i| words[i + 1].trim_end_matches(')').to_string());
            let package = after("-p").unwrap_or_else(|| panic!("gpu-bundle.sh builds without `-p PACKAGE`: {line}"));
            (package, after("--features"), line.contains("test-executable.sh"))
        })
        .collect()
}

/// burn-cubecl's features in the build that `selection` (cargo's package and feature flags)
/// makes, or `None` when that build has no burn-cubecl.
fn burn_cubecl_features(selection: &[&str]) -> Option<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let output = Command::new(env!("CARGO"))
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
    let script = include_str!("../scripts/gpu-bundle.sh");
    let builds = cargo_builds(script);
    let mut with_burn_cubecl = 0;
    for (package, features, with_dev) in &builds {
        // A binary's build has no dev-dependencies: they must not lend it the feature.
        let mut selection = vec!["-e", if *with_dev { "normal,build,dev" } else { "normal,build" }, "-p", package];
        selection.extend(features.iter().flat_map(|features| ["--features", features.as_str()]));
        let Some(tree) = burn_cubecl_features(&selection) else { continue };
        with_burn_cubecl += 1;
        assert!(
            tree.contains("burn-cubecl feature \"autotune\""),
            "gpu-bundle.sh builds -p {package} --features {features:?} with burn-cubecl but without its `autotune` feature: every matmul would run one untuned kernel. Enable it through the package's CUDA feature (`ulysses-nccl/autotune` or `burn-cubecl/autotune`).\n{tree}"
        );
    }
    // The kernel tests and bench, the two suite benches, the NCCL check and the trainer.
    assert!(with_burn_cubecl >= 6, "only {with_burn_cubecl} of gpu-bundle.sh's {} builds have burn-cubecl: {builds:?}", builds.len());
}

#[test]
fn the_workspace_cpu_build_does_not_autotune() {
    // The README's test command: tuning on lavapipe would time candidate kernels in every wgpu
    // test.
    let tree = burn_cubecl_features(&["--workspace"]).expect("the workspace's tests use burn-cubecl on wgpu");
    assert!(!tree.contains("burn-cubecl feature \"autotune\""), "the CPU build of the tests autotunes:\n{tree}");
}
