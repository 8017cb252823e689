//! `scripts/gpu-run.sh` on this machine, with stand-ins for the bundle's binaries: a lent GPU's
//! minutes must not go to a run whose failures read as success. A failing step must fail the
//! run (exit 1, named), its whole output (a panic's message) must reach `$OUT`, and the run must
//! go on to the next step; a passing run exits 0. `scripts/gpu-call.sh` must end a part at its
//! time limit and go on, and bring the logs back in one file without the trainer's checkpoints.
//! `scripts/gpu-bundle.sh` must build again whenever anything but Markdown changed.

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
    let stand_in = "#!/bin/sh\ncase \"$*\" in\n*--exact*) mkdir -p \"$OUT/run\"; echo 5.5 >\"$OUT/run/metrics.csv\"; \
                    head -c 100000 /dev/zero >\"$OUT/run/checkpoint.ulysses\"; echo sass >\"${CUDA_CACHE_PATH:?}/entry\"; \
                    echo '{\"key\":3}' >>/tmp/gpu-call-cubecl/compilation/cuda/0.10.0/ptx-by-source/toc.json.log; \
                    echo 'test result: ok. 1 passed' ;;\n*) sleep 60 ;;\nesac\n";
    fs::write(kernels.join("flash-attention-tests"), stand_in).unwrap();
    fs::set_permissions(kernels.join("flash-attention-tests"), fs::Permissions::from_mode(0o755)).unwrap();
    let out = dir.path().join("out");
    fs::create_dir(&out).unwrap();

    // The folders the script keeps the driver's cache and CubeCL's in (a warm machine's calls
    // share them): emptied, so that only this call and what it carries can fill them.
    let _ = fs::remove_dir_all("/tmp/gpu-call-nv");
    let _ = fs::remove_dir_all("/tmp/gpu-call-cubecl");
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
        .args(["kernels:tests=2", "kernels:named=30"])
        .env("OUT", &out)
        .env("KERNEL_TESTS", "one_test")
        .env("CORPUS", "/dev/null")
        .output()
        .expect("bash runs gpu-call.sh");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(started.elapsed().as_secs() < 30, "the hung part was not ended at its 2 s limit:\n{stdout}");
    let parts = fs::read_to_string(out.join("parts.txt")).unwrap();
    let statuses: Vec<(&str, &str)> = parts.lines().map(|l| { let f: Vec<&str> = l.split(' ').collect(); (f[0], f[1]) }).collect();
    assert_eq!(statuses, [("kernels-tests", "124"), ("kernels-named", "0")], "{parts}\n{stdout}");
    // Each part says how many kernels it found compiled and how many it compiled itself.
    let lines: Vec<&str> = parts.lines().collect();
    assert!(lines[0].ends_with("PTX cache 2 + 0 compiled here"), "{parts}");
    assert!(lines[1].ends_with("PTX cache 2 + 1 compiled here"), "{parts}");

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
}

/// `scripts/gpu-bundle.sh` in a scratch repository, with a stand-in `cargo` that says it ran and
/// fails: whether the script built.
fn bundle_in(repo: &Path, bin: &Path) -> (i32, String) {
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let output = Command::new("bash").arg("scripts/gpu-bundle.sh").current_dir(repo).env("PATH", path).output().expect("bash runs gpu-bundle.sh");
    (output.status.code().unwrap_or(-1), format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr)))
}

fn git(repo: &Path, args: &[&str]) {
    let status = Command::new("git").args(["-c", "user.name=t", "-c", "user.email=t@t"]).args(args).current_dir(repo).status().expect("git runs");
    assert!(status.success(), "git {args:?}");
}

/// A lent GPU must never measure old code: the bundle is built again after any change but
/// Markdown, and with uncommitted changes; a bundle of a commit HEAD changes in Markdown alone is
/// kept (a GPU session then starts 40-60 minutes sooner).
#[test]
fn a_bundle_is_built_again_unless_markdown_alone_changed() {
    let dir = tempfile_dir::Dir::new("gpu-bundle");
    let (repo, bin) = (dir.path().join("repo"), dir.path().join("bin"));
    for folder in [repo.join("scripts"), repo.join(".gpu-carry"), repo.join(".gpu-cache"), bin.clone()] {
        fs::create_dir_all(folder).unwrap();
    }
    fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gpu-bundle.sh"), repo.join("scripts/gpu-bundle.sh")).unwrap();
    fs::write(bin.join("cargo"), "#!/bin/sh\necho 'cargo build ran' >&2\nexit 7\n").unwrap();
    fs::set_permissions(bin.join("cargo"), fs::Permissions::from_mode(0o755)).unwrap();
    fs::write(repo.join(".gitignore"), "/.gpu-bundle\n/.gpu-carry\n/.gpu-cache\n").unwrap();
    fs::write(repo.join("lib.rs"), "fn a() {}\n").unwrap();
    fs::write(repo.join("notes.md"), "measured\n").unwrap();
    git(&repo, &["init", "-q"]);
    git(&repo, &["add", "-A"]);
    git(&repo, &["commit", "-qm", "built"]);
    let built = Command::new("git").args(["rev-parse", "HEAD"]).current_dir(&repo).output().unwrap();
    let built = String::from_utf8(built.stdout).unwrap();
    let mark = || {
        fs::write(repo.join(".gpu-carry/bundle.tar.xz"), "binaries").unwrap();
        fs::write(repo.join(".gpu-cache/cubecl-cache.tar.xz"), "kernels").unwrap();
        fs::write(repo.join(".gpu-carry/bundle.commit"), &built).unwrap();
    };
    mark();

    // Markdown alone since: kept.
    fs::write(repo.join("notes.md"), "measured again\n").unwrap();
    git(&repo, &["commit", "-qam", "notes"]);
    let (code, out) = bundle_in(&repo, &bin);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("nothing to build") && !out.contains("cargo build ran"), "{out}");

    // A change not committed: built, and the old mark gone.
    fs::write(repo.join("lib.rs"), "fn b() {}\n").unwrap();
    let (code, out) = bundle_in(&repo, &bin);
    assert!(code != 0 && out.contains("cargo build ran"), "an uncommitted change must be built: {code}\n{out}");
    assert!(!repo.join(".gpu-carry/bundle.commit").exists(), "the mark of the old bundle stayed");

    // The change committed: built.
    mark();
    git(&repo, &["commit", "-qam", "code"]);
    let (code, out) = bundle_in(&repo, &bin);
    assert!(code != 0 && out.contains("cargo build ran"), "a committed code change must be built: {code}\n{out}");

    // A missing kernel cache: built.
    mark();
    git(&repo, &["reset", "-q", "--hard", "HEAD~1"]);
    fs::remove_file(repo.join(".gpu-cache/cubecl-cache.tar.xz")).unwrap();
    let (code, out) = bundle_in(&repo, &bin);
    assert!(code != 0 && out.contains("cargo build ran"), "a bundle without its kernel cache must be built: {code}\n{out}");
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
