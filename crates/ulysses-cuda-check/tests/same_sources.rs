//! Two processes write every kernel's CUDA source byte for byte alike. The PTX cache a GPU run
//! carries (`scripts/ptx-cache.sh`, `cubecl_cuda::ptx_cache`) is keyed by the source: filled on
//! a machine without a GPU, it serves the GPU's process only if that process writes the same
//! text. CubeCL 0.10 declared types and mutable locals in randomly seeded hash order (patched in
//! third_party/cubecl-cpp and cubecl-opt), so the same kernel had another source in each process.

use std::{collections::BTreeMap, path::Path, process::Command};

fn sources_written_by_a_new_process(out: &Path) -> BTreeMap<String, Vec<u8>> {
    let _ = std::fs::remove_dir_all(out);
    let status = Command::new(env!("CARGO_BIN_EXE_ulysses-cuda-sources"))
        .arg(out)
        .args(["--targets", "sm_89:representative"])
        .status()
        .expect("ulysses-cuda-sources starts");
    assert!(status.success(), "ulysses-cuda-sources failed: {status}");
    let folder = out.join("sm_89");
    let files: BTreeMap<String, Vec<u8>> = std::fs::read_dir(&folder)
        .expect("the sources' folder")
        .map(|entry| {
            let path = entry.expect("a source").path();
            (path.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&path).expect("a readable source"))
        })
        .collect();
    let _ = std::fs::remove_dir_all(out);
    files
}

#[test]
fn two_processes_write_the_same_sources() {
    let base = std::env::temp_dir().join(format!("ulysses-same-sources-{}", std::process::id()));
    let first = sources_written_by_a_new_process(&base.join("first"));
    let second = sources_written_by_a_new_process(&base.join("second"));
    assert!(first.len() > 20, "only {} sources: the plan compiled less than it should", first.len());
    assert_eq!(first.keys().collect::<Vec<_>>(), second.keys().collect::<Vec<_>>(), "other kernels the second time");
    let differing: Vec<&String> = first.iter().filter(|(name, text)| second.get(*name) != Some(text)).map(|(name, _)| name).collect();
    assert!(differing.is_empty(), "{} of {} sources differ between two processes, e.g. {}", differing.len(), first.len(), differing[0]);
    let _ = std::fs::remove_dir_all(&base);
}
