//! The crate's modules form layers: no module imports, directly or through others, a module
//! that imports it. Lower layers (comm, inner, layout, error) stay usable and testable on
//! their own, and the data path reads top-down: attention -> exchange / fused -> inner -> comm.
//!
//! Reads `src/` as text: every `crate::` path outside `#[cfg(test)]` blocks names the
//! top-level module it reaches (names the crate root re-exports are mapped to their module).

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::Path,
};

const SRC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src");

/// The top-level module a file belongs to (`comm/thread.rs` -> `comm`).
fn module_of(path: &Path) -> String {
    let relative = path.strip_prefix(SRC).unwrap();
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

/// The module graph: module -> modules it imports.
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(Path::new(SRC), &mut files);
    let modules: BTreeSet<String> = files.iter().map(|f| module_of(f)).collect();
    // What the crate root re-exports: `pub use backend::UlyssesBackend;` maps UlyssesBackend.
    let lib = fs::read_to_string(Path::new(SRC).join("lib.rs")).unwrap();
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
        let module = module_of(file);
        let text = fs::read_to_string(file).unwrap();
        let code = text.split("#[cfg(test)]").next().unwrap();
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
fn the_modules_import_each_other_without_cycles() {
    let graph = imports();
    for (module, targets) in &graph {
        println!("{module} -> {targets:?}");
    }
    // The parser sees the edges it must: a test that finds no edges proves nothing.
    assert!(graph["attention"].contains("exchange") && graph["exchange"].contains("inner"), "{graph:?}");
    let cycles: Vec<String> = graph.keys().filter_map(|m| cycle_through(&graph, m)).map(|c| c.join(" -> ")).collect();
    assert!(cycles.is_empty(), "import cycles: {cycles:#?}");
    for lower in ["comm", "inner", "layout", "error", "compare", "primitive"] {
        for higher in ["attention", "backend", "train", "exchange", "fused"] {
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
