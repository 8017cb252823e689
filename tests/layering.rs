//! The workspace is layered, crate by crate and module by module.
//!
//! - **Crates**: each crate depends only on crates of lower layers (`LAYERS`), so the data
//!   path reads bottom-up: the Burn-free core and launching, the kernels, the backend
//!   decorators, training, transports, models, programs. The core and the launching crate have
//!   no Burn dependency at all, and the core no async runtime.
//! - **Modules**: inside every crate, no module imports, directly or through others, a module
//!   that imports it; in burn-ulysses the lower layers (comm, capabilities, compare, primitive)
//!   stay usable and testable on their own: attention -> exchange / flash -> capabilities -> comm.
//!
//! Reads the manifests and `src/` as text: every `crate::` path outside `#[cfg(test)]` blocks
//! names the top-level module it reaches (names the crate root re-exports are mapped to their
//! module). Binaries (`src/bin`, a `main.rs` beside a `lib.rs`) are crates of their own.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::Path,
};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The workspace's crates, lowest layer first. A crate may depend only on crates of lower
/// layers (in every dependency section: a dev-dependency on a higher crate would let tests
/// of a lower layer reach up too).
const LAYERS: &[(&str, &[&str])] = &[
    ("the Burn-free core: groups, collectives' bookkeeping, layout rules, ZeRO's partition, the host AdamW", &["ulysses-core"]),
    ("launching, for every Burn version: launch environments, the rendezvous, the TCP transport", &["ulysses-dist"]),
    ("the flash-attention kernels (CubeCL)", &["ulysses-kernels"]),
    ("the backends: the burn 0.21 decorator, the burn 0.22 functions, the CUDA compile check", &["burn-ulysses", "burn-ulysses-ops", "ulysses-cuda-check"]),
    ("training any model", &["ulysses-training"]),
    ("the NCCL transport", &["ulysses-nccl"]),
    ("the Hugging Face decoders", &["ulysses-models"]),
    ("the trainer", &["ulysses-trainer"]),
    ("the integration tests and benches; code generation", &["ulysses-suite", "xtask"]),
];

/// Every package of the workspace: its name and folder.
fn packages() -> Vec<(String, std::path::PathBuf)> {
    let mut folders = vec![Path::new(ROOT).to_path_buf(), Path::new(ROOT).join("kernels-cubecl"), Path::new(ROOT).join("xtask")];
    for entry in fs::read_dir(Path::new(ROOT).join("crates")).unwrap() {
        folders.push(entry.unwrap().path());
    }
    folders.into_iter().filter(|f| f.join("Cargo.toml").exists()).map(|f| (manifest_name(&f), f)).collect()
}

fn manifest_name(folder: &Path) -> String {
    let manifest = fs::read_to_string(folder.join("Cargo.toml")).unwrap();
    let line = manifest.lines().find(|l| l.starts_with("name = ")).unwrap();
    line.trim_start_matches("name = ").trim_matches('"').to_string()
}

/// The dependencies a manifest names, in every section, as `(section, crate)`.
fn dependencies(folder: &Path) -> Vec<(String, String)> {
    let manifest = fs::read_to_string(folder.join("Cargo.toml")).unwrap();
    let mut section = String::new();
    let mut found = Vec::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line.trim_matches(|c| c == '[' || c == ']').to_string();
        } else if section.ends_with("dependencies") && !section.starts_with("workspace") && !line.starts_with('#') && line.contains('=') {
            found.push((section.clone(), line.split('=').next().unwrap().trim().to_string()));
        }
    }
    found
}

#[test]
fn each_crate_depends_only_on_lower_layers() {
    let layer_of: BTreeMap<&str, usize> = LAYERS.iter().enumerate().flat_map(|(i, (_, crates))| crates.iter().map(move |c| (*c, i))).collect();
    let packages = packages();
    let mut edges = 0;
    for (name, folder) in &packages {
        let Some(&layer) = layer_of.get(name.as_str()) else { panic!("{name} ({}) is in no layer: add it to LAYERS", folder.display()) };
        for (section, dependency) in dependencies(folder) {
            if let Some(&below) = layer_of.get(dependency.as_str()) {
                edges += 1;
                let (from, to) = (LAYERS[layer].0, LAYERS[below].0);
                assert!(below < layer || (section.starts_with("dev") && dependency == *name), "{name} ({from}) depends on {dependency} ({to}) in [{section}]: a lower layer must not reach a higher one or its own");
            }
        }
        if layer <= 1 {
            let burn: Vec<_> = dependencies(folder).into_iter().filter(|(_, d)| d.starts_with("burn") || d.starts_with("cubecl")).collect();
            assert!(burn.is_empty(), "{name} ({}) is Burn-free, yet depends on {burn:?}", LAYERS[layer].0);
        }
        if layer == 0 {
            let runtime: Vec<_> = dependencies(folder).into_iter().filter(|(_, d)| d == "tokio").collect();
            assert!(runtime.is_empty(), "{name} is the core, yet depends on {runtime:?}: async I/O belongs to ulysses-dist");
        }
    }
    assert_eq!(packages.len(), layer_of.len(), "LAYERS names a crate the workspace no longer has: {packages:?}");
    // The parser sees the edges it must: a test that finds no edges proves nothing.
    assert!(edges >= 15, "only {edges} edges between the workspace's crates found");
}

/// The top-level module a file of `src` belongs to (`comm/thread.rs` -> `comm`).
fn module_of(src: &Path, path: &Path) -> String {
    let relative = path.strip_prefix(src).unwrap();
    let first = relative.components().next().unwrap().as_os_str().to_string_lossy().into_owned();
    first.trim_end_matches(".rs").to_string()
}

fn rust_files(dir: &Path, files: &mut Vec<std::path::PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
}

fn identifier(text: &str) -> &str {
    let end = text.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(text.len());
    &text[..end]
}

/// The first segment of every path after `crate::` (`crate::{a::X, b}` gives a and b).
fn crate_paths(source: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = source;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // Top-level elements of the brace group.
            let (mut depth, mut element_start) = (0usize, 0usize);
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        names.push(identifier(group[element_start..i].trim_start()).to_string());
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        names.push(identifier(group[element_start..i].trim_start()).to_string());
                        element_start = i + 1;
                    }
                    _ => {}
                }
            }
        } else {
            names.push(identifier(rest).to_string());
        }
    }
    names.retain(|n| !n.is_empty());
    names
}

/// The module graph of the library in `src`: module -> modules it imports.
fn imports(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    // Binaries are crates of their own: their `crate::` is not the library's.
    files.retain(|f| !f.starts_with(src.join("bin")) && *f != src.join("main.rs"));
    let modules: BTreeSet<String> = files.iter().map(|f| module_of(src, f)).collect();
    // What the crate root re-exports: `pub use backend::UlyssesBackend;` maps UlyssesBackend.
    let lib = fs::read_to_string(src.join("lib.rs")).unwrap();
    let mut reexports = BTreeMap::new();
    for line in lib.lines().filter_map(|l| l.trim().strip_prefix("pub use ")) {
        let module = identifier(line).to_string();
        let names = line[module.len()..].trim_start_matches("::");
        for name in names.trim_matches(|c| c == '{' || c == '}' || c == ';').split(',') {
            reexports.insert(identifier(name.trim()).to_string(), module.clone());
        }
    }
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let module = module_of(src, file);
        let text = fs::read_to_string(file).unwrap();
        // Doc links and comments name modules without importing them.
        let code: String = text.split("#[cfg(test)]").next().unwrap().lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n");
        let code = code.as_str();
        for name in crate_paths(code) {
            let target = reexports.get(&name).cloned().unwrap_or(name);
            if target != module && modules.contains(&target) {
                graph.entry(module.clone()).or_default().insert(target);
            }
        }
    }
    graph
}

/// A cycle through `start`, if there is one.
fn cycle_through(graph: &BTreeMap<String, BTreeSet<String>>, start: &str) -> Option<Vec<String>> {
    let mut stack = vec![vec![start.to_string()]];
    let mut seen = BTreeSet::new();
    while let Some(path) = stack.pop() {
        for next in graph.get(path.last().unwrap()).into_iter().flatten() {
            let mut longer = path.clone();
            longer.push(next.clone());
            if next == start {
                return Some(longer);
            }
            if seen.insert(next.clone()) {
                stack.push(longer);
            }
        }
    }
    None
}

#[test]
fn the_modules_of_every_crate_import_each_other_without_cycles() {
    let mut libraries = 0;
    for (name, folder) in packages() {
        let src = folder.join(if name == "ulysses-suite" { "tests/support" } else { "src" });
        if !src.join("lib.rs").exists() {
            continue;
        }
        libraries += 1;
        let graph = imports(&src);
        for (module, targets) in &graph {
            println!("{name}: {module} -> {targets:?}");
        }
        let cycles: Vec<String> = graph.keys().filter_map(|m| cycle_through(&graph, m)).map(|c| c.join(" -> ")).collect();
        assert!(cycles.is_empty(), "import cycles in {name}: {cycles:#?}");
    }
    assert!(libraries >= 9, "only {libraries} libraries read");
}

#[test]
fn burn_ulysses_lower_modules_never_reach_higher_ones() {
    let graph = imports(&Path::new(ROOT).join("crates/burn-ulysses/src"));
    // The parser sees the edges it must: a test that finds no edges proves nothing.
    assert!(graph["attention"].contains("exchange") && graph["exchange"].contains("capabilities"), "{graph:?}");
    let (lower, higher) = (["comm", "capabilities", "compare", "primitive"], ["attention", "backend", "exchange", "flash"]);
    // Every name is a module of the crate: a name that is not could never fail the check.
    let modules: BTreeSet<&String> = graph.keys().chain(graph.values().flatten()).collect();
    for name in lower.iter().chain(&higher) {
        assert!(modules.contains(&name.to_string()), "{name} is no module of burn-ulysses (renamed?): {modules:?}");
    }
    for lower in lower {
        for higher in higher {
            let reaches = cycle_through(&graph_with_edge(&graph, higher, lower), higher).is_some();
            assert!(!reaches, "{lower} reaches {higher}: a lower layer imports a higher one");
        }
    }
}

/// `graph` plus the edge `from -> to`: a cycle then means `to` reaches `from`.
fn graph_with_edge(graph: &BTreeMap<String, BTreeSet<String>>, from: &str, to: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph = graph.clone();
    graph.entry(from.to_string()).or_default().insert(to.to_string());
    graph
}
