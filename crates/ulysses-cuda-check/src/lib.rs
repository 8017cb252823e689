//! The flash kernels as NVIDIA GPUs would compile them, on a machine without one.
//!
//! [`runtime::CompileOnly`] is a CubeCL runtime with an H100's, an A100's or an L40's device
//! properties that compiles every launch with cubecl-cuda's compiler and keeps the CUDA C++
//! source. [`collect`] runs the kernels' real host code on it (checks, planner, launches) for
//! every case of a [`Plan`](ulysses_kernels::Plan) the planner can choose: dtypes, head dims,
//! causal or not, with or without visible ranges, forward and backward. The sources then go
//! through NVRTC, ptxas and the disassembler (`scripts/cuda-machine-code.py`): registers,
//! spills, shared memory, blocks per SM and tensor-core instructions per kernel.
//!
//! Any other code run on the runtime (`ulysses-trainer --backend cuda-compile-only`: a training
//! step, burn's autotune candidates among its kernels) is written out by [`write_launched`], and
//! [`fill_ptx_cache`] compiles what it is given into the PTX cache a GPU run loads.

pub mod runtime;

use std::{collections::BTreeMap, fs, path::Path};

use burn::tensor::{DType, TensorData, ops::FloatTensorOps};
use burn_cubecl::CubeBackend;
use cubecl::Runtime as _;
use serde::Serialize;
use ulysses_kernels::{
    FlashOptions, OperandInfo, VisibleRanges, flash_attention_backward_fragments, flash_attention_backward_fragments_laid_out_for, flash_attention_backward_planned, flash_attention_forward_planned,
    flash_attention_forward_fragments, fused_cross_entropy,
    mma::fragment_products, plan_flash_attention,
};

use runtime::{CompileOnly, TARGETS, TargetDevice};

type Backend = CubeBackend<CompileOnly, f32, i32, u32>;

/// One case of the kernels' launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Case {
    pub dtype: &'static str,
    pub head_dim: usize,
    pub causal: bool,
    /// With [`VisibleRanges`] (packed documents, key padding).
    pub ranged: bool,
    /// Tensors past 2^31 elements, so the kernels index in 64 bits (CubeCL's dynamic address
    /// type): a different source, which the GPU compiles only when a sequence is that long.
    pub sixty_four_bit: bool,
}

/// A kernel source and every case that launches it.
#[derive(Debug, Clone, Serialize)]
pub struct Kernel {
    pub target: &'static str,
    /// `forward`, `row_delta`, `key_value_grad`, `query_grad`, or another name `kernel_of` gives.
    pub kernel: String,
    pub entrypoint: String,
    /// `tensor-cores-16` or `plane` (the flash kernels' plan), `tensor-cores-mma` (the mma.sync fragments), `-` (no tiles).
    pub engine: String,
    pub dynamic_shared_bytes: usize,
    pub block: (u32, u32, u32),
    pub cases: Vec<Case>,
    /// A hash of the source without what varies between compiles of one kernel
    /// ([`canonical_source`]): `scripts/cuda-machine-code.py` caches its results by it.
    pub source_key: String,
    #[serde(skip)]
    pub source: String,
}

/// `source` without what varies between two compiles of one kernel, so that they compare
/// equal: CubeCL declares types and local variables in hash-set order and lays shared memory
/// out in an order of its own, so the same kernel compiled for two cases, or in two processes,
/// differed in those lines alone and each copy was compiled again (2026-11-29: 384 of 444
/// sources differed between two runs; the machine-code cache hit almost nothing). Declarations
/// (struct definitions, `l_mut_` and `l_arr_` variables, shared memory with its offset masked)
/// are sorted and put first; every other line keeps its order.
pub fn canonical_source(source: &str) -> String {
    let mut declarations: Vec<String> = Vec::new();
    let mut body: Vec<&str> = Vec::new();
    let mut lines = source.lines();
    while let Some(line) = lines.next() {
        let trimmed = line.trim();
        if trimmed.starts_with("struct ") && trimmed.ends_with('{') {
            let mut unit = vec![line];
            for inner in lines.by_ref() {
                unit.push(inner);
                if inner.trim() == "};" {
                    break;
                }
            }
            declarations.push(unit.join("\n"));
        } else if trimmed.starts_with("// Shared array size") || trimmed.starts_with("// Shared value size") {
            continue;
        } else if let Some((before, after)) = trimmed.split_once("dynamic_shared_mem[").filter(|_| trimmed.contains("reinterpret_cast")) {
            let rest = after.split_once(']').map_or(after, |(_, rest)| rest);
            declarations.push(format!("{before}dynamic_shared_mem[_]{rest}"));
        } else if trimmed.ends_with(';') && !trimmed.contains('=') && !trimmed.contains('(') && (trimmed.contains(" l_mut_") || trimmed.contains(" l_arr_")) {
            declarations.push(trimmed.to_string());
        } else {
            body.push(line);
        }
    }
    declarations.sort();
    let mut out = declarations.join("\n");
    out.push('\n');
    out.push_str(&body.join("\n"));
    out
}

/// A [`canonical_source`]'s hash, as hex.
fn source_key(canonical: &str) -> String {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    canonical.hash(&mut hasher);
    format!("{:016x}", hasher.finish())
}

/// burn's own kernels that the cases launch (its copies and fills on upload), not ours to check.
const BURN_KERNELS: [&str; 2] = ["copy_kernel", "full_kernel"];

/// Which of the flash kernels a compiled entry point is, or `None` for another.
fn kernel_of(entrypoint: &str) -> Option<&'static str> {
    // First match wins: the fragment kernels before the planned ones their names contain.
    [
        ("row_statistics", "row_statistics"),
        ("fragment_query_grad", "fragment_query_grad"),
        ("fragment_key_value_grad", "fragment_key_value_grad"),
        ("row_delta", "row_delta"),
        ("key_value_grad", "key_value_grad"),
        ("query_grad", "query_grad"),
        ("flash_forward", "forward"),
        ("cross_entropy_rows", "cross_entropy"),
        ("fragment_products", "fragments"),
        ("fragment_forward", "fragment_forward"),
        ("scaled_sum", "scaled_sum"),
    ]
        .into_iter()
        .find(|(prefix, _)| entrypoint.contains(prefix))
        .map(|(_, kernel)| kernel)
}

/// The cases of the H100 plan: every dtype, head dims 64, 128 and 256, causal or not, with and
/// without ranges; and, indexed in 64 bits, head dim 128 in bf16 (plain, and causal with
/// ranges) and in f32 (causal with ranges): an 8B model's attention at a million tokens; and
/// bf16 causal with ranges at head dims 64 and 256, whose register budgets differ.
pub fn full_plan() -> Vec<Case> {
    let mut cases = Vec::new();
    for dtype in ["bf16", "f16", "f32"] {
        for head_dim in [64, 128, 256] {
            for causal in [false, true] {
                for ranged in [false, true] {
                    cases.push(Case { dtype, head_dim, causal, ranged, sixty_four_bit: false });
                }
            }
        }
    }
    for (dtype, head_dim, causal_and_ranged) in [("bf16", 128, false), ("bf16", 128, true), ("f32", 128, true), ("bf16", 64, true), ("bf16", 256, true)] {
        cases.push(Case { dtype, head_dim, causal: causal_and_ranged, ranged: causal_and_ranged, sixty_four_bit: true });
    }
    cases
}

/// A subset that still reaches every kernel shape of a smaller GPU: each dtype at each head
/// dim, causal with ranges (the variant with the most code), plus bf16 without either and bf16
/// causal without ranges (the trainer's variant for sequences of one document).
pub fn representative_plan() -> Vec<Case> {
    let mut cases: Vec<Case> = full_plan().into_iter().filter(|c| c.causal && c.ranged && !c.sixty_four_bit).collect();
    for causal in [false, true] {
        cases.extend([64, 128, 256].map(|head_dim| Case { dtype: "bf16", head_dim, causal, ranged: false, sixty_four_bit: false }));
    }
    cases
}

fn dtype_of(name: &str) -> DType {
    match name {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        _ => DType::F32,
    }
}

/// Runs the forward and backward of every case on target `target` (an index of
/// [`runtime::TARGETS`]) and returns each distinct kernel source once, with its cases.
pub fn collect(target: usize, cases: &[Case]) -> Result<Vec<Kernel>, String> {
    let device = TargetDevice(target);
    let client = CompileOnly::client(&device);
    cubecl::future::block_on(client.sync()).map_err(|e| format!("{e:?}"))?;
    runtime::take_compiled();
    // By canonical source and dynamic shared memory: the shared arrays' sizes, which the
    // canonical source leaves out with the layout, differ only there, and each size is checked
    // against the shared-memory limit and the blocks an SM holds.
    let mut kernels: BTreeMap<(String, usize), Kernel> = BTreeMap::new();
    for &case in cases {
        // Small shapes: tile sizes depend on head dims and dtype, not on lengths. GQA (2 q
        // heads per kv head) and a length that is no multiple of a tile. In 64 bits, one head
        // of 2^24 + 80 rows: every tensor just past 2^31 elements (an f32 one 8.6 GB of host
        // address space, reserved and never touched).
        let (seq, q_heads) = if case.sixty_four_bit { ((1 << 24) + 80, 1) } else { (80, 2) };
        let (batch, kv_heads, d) = (1, 1, case.head_dim);
        let dtype = dtype_of(case.dtype);
        let options = FlashOptions { scale: None, causal: case.causal };
        let (q_shape, kv_shape) = ([batch, q_heads, seq, d], [batch, kv_heads, seq, d]);
        let (q_info, kv_info) = (OperandInfo { shape: &q_shape, dtype }, OperandInfo { shape: &kv_shape, dtype });
        let plan = plan_flash_attention(&client, q_info, kv_info, kv_info, &options).map_err(|e| format!("{case:?}: {e}"))?;
        let tensor = |shape: [usize; 4]| {
            if case.sixty_four_bit {
                // Reserved, never written: the compile-only runtime runs no kernel, and the
                // host maps the pages of an untouched buffer lazily.
                return Backend::float_empty(shape.into(), &device, dtype.into());
            }
            let data = TensorData::new(vec![0.25f32; shape.iter().product()], shape).convert_dtype(dtype);
            Backend::float_from_data(data, &device)
        };
        let ranges = case.ranged.then(|| VisibleRanges::all(batch, seq, seq).and_then(|r| r.with_documents(&[vec![30, seq - 30]]))).transpose().map_err(|e| e.to_string())?;
        let (output, lse) = flash_attention_forward_planned(tensor(q_shape), tensor(kv_shape), tensor(kv_shape), options, ranges.as_ref()).map_err(|e| format!("{case:?}: {e}"))?;
        flash_attention_backward_planned(tensor(q_shape), tensor(kv_shape), tensor(kv_shape), output, tensor(q_shape), lse, options, ranges.as_ref()).map_err(|e| format!("{case:?}: {e}"))?;
        // The training loss's row kernel, in this case's dtype (its source depends on that alone).
        if !case.sixty_four_bit {
            let logits = Backend::float_from_data(TensorData::new(vec![0.25f32; 80 * 1000], [80, 1000]).convert_dtype(dtype), &device);
            let labels = Backend::float_from_data(TensorData::new(vec![1.0f32; 80], [80]), &device);
            fused_cross_entropy(logits, labels, -100).map_err(|e| format!("{case:?}: the cross-entropy kernel: {e}"))?;
        }
        // The register fragments of mma.sync (FlashAttention-2's two products on one tile),
        // in this case's half-precision dtype.
        if !case.sixty_four_bit && matches!(dtype, DType::F16 | DType::BF16) {
            let tile = || Backend::float_from_data(TensorData::new(vec![0.25f32; 256], [16, 16]).convert_dtype(dtype), &device);
            fragment_products(tile(), tile(), tile()).map_err(|e| format!("{case:?}: {e}"))?;
        }
        // The register-fragment engine's forward (FlashAttention-2's design), where it applies.
        if matches!(dtype, DType::F16 | DType::BF16) && matches!(case.head_dim, 64 | 128 | 256) {
            let (output, lse) = flash_attention_forward_fragments(tensor(q_shape), tensor(kv_shape), tensor(kv_shape), options, ranges.as_ref())
                .map_err(|e| format!("{case:?}: the fragment forward: {e}"))?;
            flash_attention_backward_fragments(tensor(q_shape), tensor(kv_shape), tensor(kv_shape), output.clone(), tensor(q_shape), lse.clone(), options, ranges.as_ref())
                .map_err(|e| format!("{case:?}: the fragment backward: {e}"))?;
            // And with dQ by its own kernel where the dK/dV kernel sums it
            // (`ULYSSES_FLASH_DETERMINISTIC=1`): bf16 alone, whose code f16's repeats.
            if dtype == DType::BF16 && !case.sixty_four_bit {
                flash_attention_backward_fragments_laid_out_for(tensor(q_shape), tensor(kv_shape), tensor(kv_shape), output, tensor(q_shape), lse, options, ranges.as_ref(), None, true, None)
                    .map_err(|e| format!("{case:?}: the deterministic fragment backward: {e}"))?;
            }
        }
        // Launches reach the server through a queue: every one of this case's is compiled
        // once the queue is drained.
        cubecl::future::block_on(client.sync()).map_err(|e| format!("{case:?}: {e:?}"))?;
        for compiled in runtime::take_compiled() {
            let compiled = compiled.map_err(|e| format!("{case:?}: a kernel failed to compile: {e}"))?;
            let Some(kernel) = kernel_of(&compiled.entrypoint) else {
                // A kernel of ours under a name the table does not know would go unchecked (the
                // fragment backward's row pre-pass did, unseen).
                if BURN_KERNELS.iter().any(|burn| compiled.entrypoint.starts_with(burn)) {
                    continue;
                }
                return Err(format!("{case:?}: kernel {} is none the check knows: add it to kernel_of (or, if burn's, to BURN_KERNELS)", compiled.entrypoint));
            };
            // One kernel however CubeCL ordered its declarations this time.
            let canonical = canonical_source(&compiled.source);
            let source_key = source_key(&canonical);
            let entry = kernels.entry((canonical, compiled.dynamic_shared_bytes)).or_insert_with(|| Kernel {
                target: compiled.target,
                kernel: kernel.to_string(),
                entrypoint: compiled.entrypoint.clone(),
                // The row pre-pass of the backward and the loss's rows multiply no tiles; the
                // fragments multiply with mma.sync whatever the plan.
                engine: match kernel {
                    "row_delta" | "cross_entropy" | "scaled_sum" | "row_statistics" => "-".into(),
                    "fragments" | "fragment_forward" | "fragment_query_grad" | "fragment_key_value_grad" => "tensor-cores-mma".into(),
                    _ => plan.engine.to_string(),
                },
                dynamic_shared_bytes: compiled.dynamic_shared_bytes,
                block: compiled.block,
                cases: Vec::new(),
                source_key,
                source: compiled.source.clone(),
            });
            if !entry.cases.contains(&case) {
                entry.cases.push(case);
            }
        }
    }
    Ok(kernels.into_values().collect())
}

/// Which cases to compile for which target: `TARGET:PLAN[+PLAN...],...` with plans `full`,
/// `representative` and `sixty-four-bit`. CI's: the H100 (the GPU machines') each dtype and
/// head dim with the 64-bit cases, the A100 and the L40 without them. The full plan (350
/// sources on sm_90a, another 9 minutes of a 2-core CI with a cold cache, 2026-11-29) adds
/// the causal-only, ranged-only and plain f16/f32 variants, whose code the representative
/// causal ranged cases contain: `ulysses-cuda-sources DIR --targets sm_90a:full` checks them.
pub const DEFAULT_TARGETS: &str = "sm_90a:representative+sixty-four-bit,sm_80:representative,sm_89:representative";

/// Collects the kernels of every target of `spec` (see [`DEFAULT_TARGETS`]) and writes them to
/// `out`: `index.json` (the targets' limits, and per kernel its target, kernel, engine, dynamic
/// shared memory, block, cases and file) and `<target>/<n>-<kernel>.cu`. Returns a line per
/// target, and the kernels.
pub fn write_sources(out: &Path, spec: &str) -> Result<(Vec<String>, Vec<Kernel>), String> {
    let mut lines = Vec::new();
    let mut all = Vec::new();
    for part in spec.split(',') {
        let (name, plan) = part.split_once(':').unwrap_or((part, "full"));
        let target = TARGETS
            .iter()
            .position(|t| t.name == name)
            .ok_or_else(|| format!("unknown target {name}: one of {:?}", TARGETS.iter().map(|t| t.name).collect::<Vec<_>>()))?;
        let mut cases = Vec::new();
        for plan in plan.split('+') {
            cases.extend(match plan {
                "full" => full_plan(),
                "representative" => representative_plan(),
                // The full plan's cases indexed in 64 bits alone, to check those quickly.
                "sixty-four-bit" => full_plan().into_iter().filter(|c| c.sixty_four_bit).collect(),
                other => return Err(format!("unknown plan {other}: full, representative or sixty-four-bit")),
            });
        }
        cases.sort();
        cases.dedup();
        let kernels = collect(target, &cases)?;
        lines.push(format!("{name} ({plan} plan, {} cases): {} distinct kernel sources", cases.len(), kernels.len()));
        all.extend(kernels);
    }
    write_index(out, &all)?;
    Ok((lines, all))
}

/// Writes `kernels` to `out`: `<target>/<n>-<kernel>.cu` each, and `index.json` (the targets'
/// limits, and per kernel its target, kernel, engine, dynamic shared memory, block, cases and
/// file), which [`read_kernels`] reads back.
fn write_index(out: &Path, kernels: &[Kernel]) -> Result<(), String> {
    let mut index = Vec::new();
    let mut numbers: BTreeMap<&str, usize> = BTreeMap::new();
    for kernel in kernels {
        let n = numbers.entry(kernel.target).or_default();
        let file = format!("{}/{n:03}-{}.cu", kernel.target, kernel.kernel);
        *n += 1;
        fs::create_dir_all(out.join(kernel.target)).map_err(|e| format!("cannot create {}: {e}", out.join(kernel.target).display()))?;
        fs::write(out.join(&file), &kernel.source).map_err(|e| format!("cannot write {file}: {e}"))?;
        let mut entry = serde_json::to_value(kernel).map_err(|e| e.to_string())?;
        entry["file"] = serde_json::Value::String(file);
        index.push(entry);
    }
    let text = serde_json::to_string_pretty(&serde_json::json!({ "targets": TARGETS, "kernels": index })).map_err(|e| e.to_string())?;
    fs::write(out.join("index.json"), text).map_err(|e| format!("cannot write the index: {e}"))
}

/// The kernels [`write_index`] wrote to `dir` (their target, entry point and source: what a
/// PTX cache needs).
pub fn read_kernels(dir: &Path) -> Result<Vec<Kernel>, String> {
    let index = dir.join("index.json");
    let text = fs::read_to_string(&index).map_err(|e| format!("cannot read {}: {e}", index.display()))?;
    let index: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", index.display()))?;
    let entries = index["kernels"].as_array().ok_or_else(|| format!("{}/index.json lists no kernels", dir.display()))?;
    entries
        .iter()
        .map(|entry| {
            let field = |name: &str| entry[name].as_str().ok_or_else(|| format!("{}/index.json: a kernel without {name}", dir.display()));
            let target = TARGETS.iter().find(|t| Ok(t.name) == field("target")).ok_or_else(|| format!("{}/index.json: unknown target {entry}", dir.display()))?;
            let file = dir.join(field("file")?);
            let source = fs::read_to_string(&file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
            Ok(Kernel {
                target: target.name,
                kernel: field("kernel")?.to_string(),
                entrypoint: field("entrypoint")?.to_string(),
                engine: field("engine")?.to_string(),
                dynamic_shared_bytes: entry["dynamic_shared_bytes"].as_u64().ok_or_else(|| format!("{}/index.json: a kernel without dynamic_shared_bytes", dir.display()))? as usize,
                block: serde_json::from_value(entry["block"].clone()).map_err(|e| format!("{}/index.json: a kernel's block: {e}", dir.display()))?,
                cases: Vec::new(),
                source_key: field("source_key")?.to_string(),
                source,
            })
        })
        .collect()
}

/// Writes to `out` (as [`write_index`]) every distinct kernel source launched on the
/// compile-only runtime since its record was last taken, burn's own kernels among them (each
/// autotune candidate too: tuning launches every one), in the order first launched: what the
/// same code launches on that GPU, for [`fill_ptx_cache`]. Kernels CubeCL could not compile are
/// left out, as autotune leaves them out on a GPU. Returns a line saying what it wrote.
pub fn write_launched(out: &Path) -> Result<String, String> {
    let (mut kernels, mut seen, mut failed) = (Vec::new(), std::collections::HashSet::new(), BTreeMap::<String, usize>::new());
    for compiled in runtime::take_compiled() {
        let compiled = match compiled {
            Ok(compiled) => compiled,
            Err(error) => {
                *failed.entry(error).or_default() += 1;
                continue;
            }
        };
        if !seen.insert(compiled.source.clone()) {
            continue;
        }
        kernels.push(Kernel {
            target: compiled.target,
            kernel: kernel_of(&compiled.entrypoint).unwrap_or("burn").to_string(),
            entrypoint: compiled.entrypoint.clone(),
            engine: "-".into(),
            dynamic_shared_bytes: compiled.dynamic_shared_bytes,
            block: compiled.block,
            cases: Vec::new(),
            source_key: source_key(&canonical_source(&compiled.source)),
            source: compiled.source.clone(),
        });
    }
    fs::create_dir_all(out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    write_index(out, &kernels)?;
    let failures: String = failed.iter().map(|(error, launches)| format!("{launches} launches: {error}\n")).collect();
    fs::write(out.join("not-compiled.txt"), failures).map_err(|e| format!("cannot write {}/not-compiled.txt: {e}", out.display()))?;
    let flash = kernels.iter().filter(|k| k.kernel != "burn").count();
    Ok(format!(
        "{} distinct kernel sources launched ({flash} of them flash kernels, {} burn's), written to {}; {} launches of {} kernels CubeCL could not compile (not-compiled.txt)",
        kernels.len(),
        kernels.len() - flash,
        out.display(),
        failed.values().sum::<usize>(),
        failed.len()
    ))
}

/// What [`fill_ptx_cache`] found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PtxCacheFill {
    /// Kernels taken from the previous cache.
    pub kept: usize,
    /// Kernels compiled by NVRTC and added.
    pub compiled: usize,
    /// Kernels NVRTC rejected, each with its error (the others are in the cache all the same).
    pub failed: Vec<String>,
}

/// Writes to `root` (CubeCL's `[compilation] cache` folder, new or empty) a PTX cache of every
/// kernel of `kernels`, as cubecl-cuda's runtime looks them up when it launches them on a GPU
/// (`cubecl_cuda::ptx_cache`: entries keyed by the source, which this crate's runtime writes as
/// a GPU's would): taken from the cache at `previous` where it holds one, else compiled for its
/// target by NVRTC with the headers of the toolkit at `CUDA_PATH`, `threads` at once. Nothing
/// else of `previous` is kept (kernels changed since, kernels a GPU compiled), so the cache
/// stays the size of one plan. Each compiled kernel is added as soon as it is done: a fill
/// stopped early keeps what it finished.
pub fn fill_ptx_cache(root: &Path, previous: Option<&Path>, kernels: &[Kernel], threads: usize) -> Result<PtxCacheFill, String> {
    use cubecl_cuda::ptx_cache;
    use std::sync::{
        atomic::{AtomicUsize, Ordering},
        mpsc,
    };

    // cudarc loads NVRTC at its first call and panics where it finds none: said plainly here.
    let nvrtc = std::panic::catch_unwind(ptx_cache::nvrtc_version)
        .map_err(|_| "NVRTC could not be loaded: put the folder of libnvrtc.so on LD_LIBRARY_PATH (scripts/ptx-cache.sh does)".to_string())?
        .map_err(|e| format!("{e:?}"))?;
    // CubeCL's cache panics on a folder it cannot write, or reads one it should not append to.
    if fs::read_dir(root).is_ok_and(|mut entries| entries.next().is_some()) {
        return Err(format!("{} is not empty: the fill writes a new cache (give the old one as the previous)", root.display()));
    }
    fs::create_dir_all(root).and_then(|()| fs::write(root.join(".written"), b"")).map_err(|e| format!("cannot write the cache at {}: {e}", root.display()))?;
    let _ = fs::remove_file(root.join(".written"));
    let old = previous.map(ptx_cache::open);
    let mut cache = ptx_cache::open(root);
    let (mut kept, mut missing) = (0, Vec::new());
    for kernel in kernels {
        let target = TARGETS.iter().find(|t| t.name == kernel.target).ok_or_else(|| format!("unknown target {}", kernel.target))?;
        let arch = ptx_cache::arch_option(&cubecl_cpp::cuda::arch::CudaArchitecture { version: target.arch });
        let key = ptx_cache::key(&kernel.source, &arch, nvrtc);
        if cache.get(&key).is_some() || missing.iter().any(|(k, _, _)| *k == key) {
            continue;
        }
        match old.as_ref().and_then(|old| old.get(&key)) {
            Some(entry) => {
                cache.insert(key, entry.clone()).map_err(|e| format!("cannot add {} to the cache: {e:?}", kernel.entrypoint))?;
                kept += 1;
            }
            None => missing.push((key, arch, kernel)),
        }
    }
    if missing.is_empty() {
        return Ok(PtxCacheFill { kept, compiled: 0, failed: Vec::new() });
    }
    let includes = ptx_cache::toolkit_include_paths().map_err(|e| format!("{e:?} (scripts/ptx-cache.sh sets it)"))?;
    let next = AtomicUsize::new(0);
    let (done, results) = mpsc::channel();
    let (mut compiled, mut failed) = (0, Vec::new());
    std::thread::scope(|scope| -> Result<(), String> {
        for _ in 0..threads.max(1) {
            let done = done.clone();
            let (next, missing, includes) = (&next, &missing, &includes);
            scope.spawn(move || {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some((_, arch, kernel)) = missing.get(i) else { break };
                    let started = std::time::Instant::now();
                    let ptx = ptx_cache::compile(&kernel.source, arch, includes);
                    if done.send((i, ptx, started.elapsed())).is_err() {
                        break;
                    }
                }
            });
        }
        drop(done);
        for (i, ptx, took) in results {
            let (key, _, kernel) = &missing[i];
            match ptx {
                Ok(ptx) => {
                    cache.insert(*key, ptx_cache::PtxCacheEntry { ptx }).map_err(|e| format!("cannot add {} to the cache: {e:?}", kernel.entrypoint))?;
                    compiled += 1;
                    eprintln!("ptx-cache: {}/{} {} {} ({:.1} s)", compiled + failed.len(), missing.len(), kernel.target, kernel.entrypoint, took.as_secs_f64());
                }
                Err(e) => failed.push(format!("{} for {}: {e:?}", kernel.entrypoint, kernel.target)),
            }
        }
        Ok(())
    })?;
    Ok(PtxCacheFill { kept, compiled, failed })
}

#[cfg(test)]
mod tests {
    use super::canonical_source;

    /// Two compiles of one kernel as CubeCL wrote them: types, locals and shared memory in
    /// other orders and at other offsets.
    const FIRST: &str = "struct __align__(4) half_2 {\n    half i_0;\n};\nstruct __align__(8) float_2 {\n    float i_0;\n};\nextern \"C\" __global__ void k() {\n// Shared array size: 16, 64 bytes\nfloat *shared_memory_1 = reinterpret_cast<float*>(&dynamic_shared_mem[0]);\n// Shared value size: 8 bytes\nbar &shared_memory_2 = reinterpret_cast<bar&>(dynamic_shared_mem[64]);\nfloat l_mut_3;\nuint32 l_mut_4;\nfloat l_arr_5[4];\nl_mut_3 = 1.0;\nl_mut_4 = l_mut_3 + 2;\n}";
    const SECOND: &str = "struct __align__(8) float_2 {\n    float i_0;\n};\nstruct __align__(4) half_2 {\n    half i_0;\n};\nextern \"C\" __global__ void k() {\n// Shared value size: 8 bytes\nbar &shared_memory_2 = reinterpret_cast<bar&>(dynamic_shared_mem[0]);\n// Shared array size: 16, 64 bytes\nfloat *shared_memory_1 = reinterpret_cast<float*>(&dynamic_shared_mem[16]);\nfloat l_arr_5[4];\nuint32 l_mut_4;\nfloat l_mut_3;\nl_mut_3 = 1.0;\nl_mut_4 = l_mut_3 + 2;\n}";

    /// Where CubeCL's PTX cache keeps its table of contents under a `[compilation] cache`
    /// folder: scripts/gpu-call.sh counts the kernels a part compiled there, and
    /// tests/gpu_scripts.rs writes its stand-in entries there.
    #[test]
    fn the_ptx_cache_keeps_its_table_where_the_gpu_calls_count_it() {
        use cubecl_cuda::ptx_cache;
        let root = std::env::temp_dir().join(format!("ulysses-ptx-cache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let ptx = [b".version 9.0\n.target sm_90a\n".repeat(100), vec![0]].concat();
        let entry = ptx_cache::PtxCacheEntry { ptx: ptx.clone() };
        let key = ptx_cache::key("extern \"C\" __global__ void k() {}", "--gpu-architecture=sm_90a", (13, 0));
        ptx_cache::open(&root).insert(key, entry.clone()).unwrap();
        let folder = root.join("cuda/0.10.0/ptx-by-source");
        let toc = std::fs::read_to_string(folder.join("toc.json.log")).unwrap();
        assert_eq!(toc.lines().count(), 1, "{toc}");
        // The PTX as bytes (an array of integers took two bytes a character, and 2.7 s to open
        // the plan's 126 MB).
        let chunk = std::fs::metadata(folder.join("chunk0.cbor")).unwrap().len() as usize;
        assert!(chunk < ptx.len() + 100, "{chunk} bytes kept for {} of PTX", ptx.len());
        // Another opening (another process, in effect) finds it; another NVRTC does not.
        assert_eq!(ptx_cache::open(&root).get(&key), Some(&entry));
        assert_ne!(key, ptx_cache::key("extern \"C\" __global__ void k() {}", "--gpu-architecture=sm_90a", (13, 1)));
        let _ = std::fs::remove_dir_all(&root);
    }

    /// Caches of the first format (the PTX as an array of integers, beside the entry point and
    /// shared memory) are still read, so the next fill takes what one holds.
    #[test]
    fn a_ptx_cache_of_the_first_format_is_still_read() {
        use cubecl::{cache::CacheOption, compilation_cache::CompilationCache, hash::StableHash};
        use cubecl_cuda::ptx_cache;
        #[derive(Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq, Clone)]
        struct FirstFormat {
            entrypoint_name: String,
            shared_mem_bytes: usize,
            ptx: Vec<std::ffi::c_char>,
        }
        let root = std::env::temp_dir().join(format!("ulysses-ptx-cache-first-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let ptx = b".version 9.0\n.target sm_90a\n\0".to_vec();
        let key = ptx_cache::key("extern \"C\" __global__ void k() {}", "--gpu-architecture=sm_90a", (13, 0));
        let first = FirstFormat { entrypoint_name: "k".into(), shared_mem_bytes: 64, ptx: ptx.iter().map(|&b| b as std::ffi::c_char).collect() };
        CompilationCache::<StableHash, FirstFormat>::new(ptx_cache::FOLDER, CacheOption::default().name("cuda").root(root.clone())).insert(key, first).unwrap();
        assert_eq!(ptx_cache::open(&root).get(&key), Some(&ptx_cache::PtxCacheEntry { ptx }));
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn one_kernel_compiled_twice_is_one_source_and_a_changed_one_is_not() {
        assert_eq!(canonical_source(FIRST), canonical_source(SECOND));
        // The statements keep their order and text: a kernel whose code changed stays apart.
        let swapped = SECOND.replace("l_mut_3 = 1.0;\nl_mut_4 = l_mut_3 + 2;", "l_mut_4 = l_mut_3 + 2;\nl_mut_3 = 1.0;");
        assert_ne!(canonical_source(FIRST), canonical_source(&swapped));
        assert_ne!(canonical_source(FIRST), canonical_source(&SECOND.replace("+ 2", "+ 3")));
        // Another shared array is another kernel.
        assert_ne!(canonical_source(FIRST), canonical_source(&SECOND.replace("float *shared_memory_1", "half *shared_memory_1")));
    }
}

/// The engine an NVIDIA device gets from `flash_attention_forward` and `_backward`, read off
/// the compile-only devices (each registers `mma.sync` as cubecl-cuda does for its
/// architecture).
#[cfg(test)]
mod engine_choice {
    use burn::tensor::DType;
    use cubecl::Runtime as _;
    use ulysses_kernels::{FlashOptions, OperandInfo, runs_on_fragments};

    use crate::runtime::{CompileOnly, TARGETS, TargetDevice};

    #[test]
    fn half_precision_runs_on_the_register_fragments_where_they_take_it() {
        for (index, target) in TARGETS.iter().enumerate() {
            let client = CompileOnly::client(&TargetDevice(index));
            let runs = |dtype, seq: usize, head_dim: usize| {
                let shape = [1, 16, seq, head_dim];
                let operand = OperandInfo { shape: &shape, dtype };
                runs_on_fragments(&client, operand, operand, operand, &FlashOptions { scale: None, causal: true }).unwrap()
            };
            for head_dim in [64, 128, 256] {
                assert!(runs(DType::BF16, 4096, head_dim) && runs(DType::F16, 4096, head_dim), "{}: head dim {head_dim}", target.name);
            }
            // f32 (TF32 on the `cmma` engine), a head dim the fragments do not take, and
            // tensors past 2^31 elements (64-bit indices) stay on the planned engines.
            assert!(!runs(DType::F32, 4096, 128), "{}: f32", target.name);
            assert!(!runs(DType::BF16, 4096, 96), "{}: head dim 96", target.name);
            assert!(!runs(DType::BF16, 1 << 21, 128), "{}: 2^32 elements", target.name);
        }
    }
}
