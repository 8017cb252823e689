//! burn-ulysses patch: the PTX cache, keyed by what NVRTC compiles rather than by the kernel's id.
//!
//! cubecl-cuda 0.10 keys its persistent PTX cache by `KernelId::stable_hash`, which hashes the
//! kernel's Rust type name (the runtime type among its generics) and the `TypeId` of its launch
//! settings: an entry serves only the binary that wrote it, and a rebuilt kernel with unchanged
//! settings would load its old code. Keyed by the CUDA C++ source, the NVRTC options that change
//! the output and NVRTC's version, an entry is right wherever it is found: written by the GPU run
//! of any binary, or ahead of it on a machine without a GPU (`ulysses-cuda-sources --ptx-cache`,
//! whose compile-only runtime writes the same sources), so the first launch on a lent GPU loads
//! PTX instead of spending NVRTC's seconds per register-fragment kernel.

use std::{
    ffi::{CStr, CString},
    hash::Hash,
    path::{Path, PathBuf},
    str::FromStr,
    sync::OnceLock,
};

use cubecl_common::{
    backtrace::BackTrace,
    cache::CacheOption,
    compilation_cache::CompilationCache,
    hash::{StableHash, StableHasher},
};
use cubecl_cpp::cuda::arch::CudaArchitecture;
use cubecl_runtime::compiler::CompilationError;

/// What the cache keeps of one compiled kernel: its PTX, NUL-terminated, as NVRTC wrote it.
///
/// A CBOR byte string, read back with one copy. The first entries kept `ptx` as an array of
/// integers (two bytes for each character of PTX) beside the kernel's entry point and shared
/// memory, which a hit takes from the kernel at hand: a process took 2.7 s to open the plan's
/// 126 MB cache. They are still read (an array of integers is read as bytes; fields not named
/// here are skipped), and a fill that takes them writes them anew as bytes.
#[derive(Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq, Clone)]
pub struct PtxCacheEntry {
    #[serde(with = "serde_bytes")]
    pub ptx: Vec<u8>,
}

/// The cache's type: entries by [`key`].
pub type PtxCache = CompilationCache<StableHash, PtxCacheEntry>;

/// The cache's folder under `cuda/<cubecl's version>/`. Not "ptx", the folder of entries keyed
/// by kernel id: those would never match a key here.
pub const FOLDER: &str = "ptx-by-source";

/// The cache under `root` (CubeCL's `[compilation] cache` folder): created if absent, its
/// entries loaded if present.
pub fn open(root: impl Into<PathBuf>) -> PtxCache {
    CompilationCache::new(FOLDER, CacheOption::default().name("cuda").root(root.into()))
}

/// NVRTC's target option for `arch`: the architecture-specific `a` variant from sm_90 on
/// (wgmma, setmaxnreg), as cubecl-cuda has always asked.
pub fn arch_option(arch: &CudaArchitecture) -> String {
    if arch.version >= 90 {
        format!("--gpu-architecture=sm_{}a", arch)
    } else {
        format!("--gpu-architecture=sm_{}", arch)
    }
}

/// Options besides the target and the include folders. The folders differ between machines and
/// are left out of the key, and so are the headers in them: NVRTC's version stands for them
/// (the GPU image's toolkit and the PyPI wheels the fill uses are both 13.0), so a header of
/// another patch release could change the PTX of an entry, not what the kernel computes.
const OPTIONS: &[&str] = &["-lineinfo"];

/// The loaded NVRTC's version, (major, minor): asked once, as every kernel's key holds it.
pub fn nvrtc_version() -> Result<(i32, i32), CompilationError> {
    static VERSION: OnceLock<Result<(i32, i32), String>> = OnceLock::new();
    let version = VERSION.get_or_init(|| {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two valid out-pointers; NVRTC writes both.
        unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
            .result()
            .map(|()| (major, minor))
            .map_err(|err| format!("NVRTC's version: {err:?}"))
    });
    version.clone().map_err(generic)
}

/// The entry's key: the source, the target option, the other options and NVRTC's version.
pub fn key(source: &str, arch_option: &str, nvrtc: (i32, i32)) -> StableHash {
    let mut hasher = StableHasher::new();
    source.hash(&mut hasher);
    arch_option.hash(&mut hasher);
    OPTIONS.hash(&mut hasher);
    nvrtc.hash(&mut hasher);
    hasher.finalize()
}

/// The include folders of the CUDA toolkit at `CUDA_PATH` (or the usual places): its headers,
/// and CCCL's (libcu++: `cuda/barrier`) where the toolkit keeps them apart. An error naming
/// `CUDA_PATH` where there is no toolkit.
pub fn toolkit_include_paths() -> Result<Vec<PathBuf>, CompilationError> {
    let include = crate::install::cuda_path()
        .map(|path| path.join("include"))
        .filter(|include| include.exists())
        .ok_or_else(|| generic("no CUDA toolkit headers: set CUDA_PATH to a toolkit (its include/ folder)".into()))?;
    let cccl = include.join("cccl");
    Ok(if cccl.exists() { vec![include, cccl] } else { vec![include] })
}

/// Compiles `source` to PTX (NUL-terminated) with NVRTC for `arch_option`, headers from
/// `include_paths`.
pub fn compile(source: &str, arch_option: &str, include_paths: &[PathBuf]) -> Result<Vec<u8>, CompilationError> {
    let includes: Vec<String> = include_paths.iter().map(|path| format!("--include-path={}", path_str(path))).collect();
    let options: Vec<&str> = [arch_option].into_iter().chain(OPTIONS.iter().copied()).chain(includes.iter().map(String::as_str)).collect();
    let source = CString::from_str(source).map_err(|err| generic(format!("the source holds a NUL byte: {err}")))?;
    let program = cudarc::nvrtc::result::create_program(source.as_c_str(), None).map_err(|err| generic(format!("{err:?}")))?;
    // SAFETY: `program` comes from `create_program` above, its source outlives it, and it is
    // destroyed once, after its last use.
    unsafe {
        let compiled = cudarc::nvrtc::result::compile_program(program, &options);
        let ptx = match compiled {
            Ok(()) => cudarc::nvrtc::result::get_ptx(program)
                .map(|ptx| ptx.into_iter().map(|c| c as u8).collect())
                .map_err(|err| generic(format!("{err:?}"))),
            Err(err) => {
                let log = match cudarc::nvrtc::result::get_program_log(program) {
                    Ok(log) => CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned(),
                    Err(log_err) => format!("{err:?} (and no log: {log_err:?})"),
                };
                let mut message = "[Compilation Error] ".to_string();
                for line in log.split('\n').filter(|line| !line.is_empty()) {
                    message += &format!("\n    {line}");
                }
                Err(generic(format!("{message}\n[Source]  \n{}", source.to_string_lossy())))
            }
        };
        let _ = cudarc::nvrtc::result::destroy_program(program);
        ptx
    }
}

fn path_str(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

fn generic(reason: String) -> CompilationError {
    CompilationError::Generic { reason, backtrace: BackTrace::capture() }
}
