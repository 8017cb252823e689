//! `scripts/gpu-run.sh` on this machine, with stand-ins for the bundle's binaries: a lent GPU's
//! minutes must not go to a run whose failures read as success. A failing step must fail the
//! run (exit 1, named), its whole output (a panic's message) must reach `$OUT`, and the run must
//! go on to the next step; a passing run exits 0.

use std::{fs, os::unix::fs::PermissionsExt, path::Path, process::Command};

/// A bundle folder holding gpu-run.sh and `flash-attention-tests` as a shell script `body`.
fn bundle_with_kernel_tests(body: &str) -> tempfile_dir::Dir {
    let dir = tempfile_dir::Dir::new("gpu-run");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gpu-run.sh");
    fs::copy(&script, dir.path().join("gpu-run.sh")).unwrap();
    let tests = dir.path().join("flash-attention-tests");
    fs::write(&tests, format!("#!/bin/sh\n{body}\n")).unwrap();
    fs::set_permissions(&tests, fs::Permissions::from_mode(0o755)).unwrap();
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

/// A temporary folder removed on drop (no extra dependency for two tests).
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
