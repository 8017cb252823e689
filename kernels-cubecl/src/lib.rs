//! FlashAttention-2 style attention kernels in CubeCL: a forward that writes the output and
//! the log-sum-exp of every row, and a backward (dQ, dK, dV) that recomputes probabilities
//! from it. Neither materialises the `S × S` score matrix, so memory grows linearly with
//! the sequence.
//!
//! They run on burn's CubeCL tensors (`CubeBackend<R, ..>`, for any CubeCL runtime `R`:
//! CUDA, or wgpu, which is how the tests run on a CPU through a software Vulkan driver).
//! Supported: causal (bottom-right aligned, as burn's `is_causal`) and non-causal attention,
//! a custom scale, grouped-query attention (a kv head serves `q_heads / kv_heads` q heads),
//! head dims up to 256, any sequence length, f32 (on TF32 tensor cores where the device has
//! them), f16 and bf16 (f32 accumulation), and
//! [`VisibleRanges`]: documents packed into one sequence and key padding, as runs of keys per
//! row (whole tiles outside every row's run are skipped).
//!
//! Layout of `flash/`: `plan` picks the engine and tile sizes from the device, `stage`
//! places cubes on the grid and stages tiles into shared memory, `tile_ops` multiplies
//! 16 × 16 tiles (tensor cores in the device's fragment size, or the plane's lanes where
//! there are none),
//! and `forward` / `backward` hold the kernels; `mod.rs` checks shapes and launches. Beside
//! that planned engine, the register-fragment one (FlashAttention-2's design, what CUDA runs
//! by default: `plan`'s engine choice): `fragment_forward`, `fragment_key_value_grad` and
//! `fragment_query_grad` hold its kernels, on `fragment_tiles`' warp-level products
//! ([`mma`]); `visibility` turns [`VisibleRanges`] into the tiles each kernel skips.
//!
//! Beside them, [`cross_entropy`]: the training loss's rows (each row's loss and the logits'
//! gradient) in one kernel.

pub mod cross_entropy;
pub mod flash;
pub mod mma;

pub use flash::{
    Engine, FlashOptions, Fragment, MAX_HEAD_DIM, MAX_SEQUENCE, OperandInfo, Plan, VisibleRanges, flash_attention_backward, flash_attention_backward_fragments, flash_attention_backward_fragments_laid_out_for, flash_attention_backward_planned, flash_attention_forward, flash_attention_forward_fragments, flash_attention_forward_fragments_laid_out_for, flash_attention_forward_planned, plan_flash_attention, runs_on_fragments,
};

pub use cross_entropy::{CrossEntropyError, check_cross_entropy, fused_cross_entropy};

use burn::tensor::DType;

/// Why the kernels refused a call.
#[derive(Debug, Clone, thiserror::Error)]
pub enum FlashError {
    #[error("flash attention: {0}")]
    Shape(String),
    #[error(
        "flash attention: {name} {dim} is not supported; the kernels take head dims from 1 to \
         {MAX_HEAD_DIM}"
    )]
    HeadDim { name: &'static str, dim: usize },
    #[error(
        "flash attention: the smallest tiles need {needed} bytes of shared memory but the device \
         offers {available}; lower the head dim"
    )]
    SharedMemory { needed: usize, available: usize },
    #[error(
        "flash attention: the largest tensor of this call holds {elements} elements, which needs \
         64-bit indexing, and {runtime} offers none; give each rank fewer tokens or heads (a larger \
         sequence-parallel group, or shorter sequences), or run on CUDA"
    )]
    Indexing { elements: usize, runtime: &'static str },
    #[error(
        "flash attention: sequences of {seq} tokens are too long: the kernels index positions with \
         32 bits and take at most {MAX_SEQUENCE} tokens of q or of k per rank; split the sequence \
         over a ring (ParallelLayout::with_ring_size: Ulysses alone gathers the whole sequence on \
         each rank)"
    )]
    SequenceLength { seq: usize },
    #[error("flash attention: {0}")]
    Device(String),
    /// A setting of the environment that is wrong (a misspelt engine): no call can run as
    /// asked, so callers stop rather than fall back.
    #[error("flash attention: {0}")]
    Setting(String),
    #[error(
        "flash attention: {name} has dtype {dtype:?} and q {query:?}; the kernels take f32, f16 or \
         bf16, the same for q, k and v"
    )]
    DType { name: &'static str, dtype: DType, query: DType },
}

pub use stats::{backward_launches, forward_launches, query_grads_summed};

/// Launch counters, so tests can tell the fused kernels from a fallback.
mod stats {
    use std::sync::atomic::{AtomicU64, Ordering};

    pub(crate) static FORWARD: AtomicU64 = AtomicU64::new(0);
    pub(crate) static BACKWARD: AtomicU64 = AtomicU64::new(0);

    /// Forward launches so far in this process.
    pub fn forward_launches() -> u64 {
        FORWARD.load(Ordering::Relaxed)
    }

    /// Backward launches (each is three kernels) so far in this process.
    pub fn backward_launches() -> u64 {
        BACKWARD.load(Ordering::Relaxed)
    }

    thread_local! {
        /// Per thread, so that a test's count is its own launches' while other tests run.
        static QUERY_GRAD_SUMMED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    }

    pub(crate) fn count_query_grad_summed() {
        QUERY_GRAD_SUMMED.with(|count| count.set(count.get() + 1));
    }

    /// Register-fragment backward launches so far on this thread whose dQ the dK/dV kernel
    /// summed with atomics rather than dQ's own kernel computing it.
    pub fn query_grads_summed() -> u64 {
        QUERY_GRAD_SUMMED.with(|count| count.get())
    }
}

/// For tests and benches: whether a CubeCL runtime has a device here, and its memory in use.
pub mod testing {
    /// Makes the register-fragment dK/dV kernel store each step's dS for dQ's sum before its
    /// dV and dK products (`Some(true)`: as on sm_90, with `stmatrix`) or after dK's
    /// (`Some(false)`: as on sm_80 and sm_89, and lavapipe), or as the launch decides (`None`),
    /// for the launches that follow in this process: the order alone, the same gradients.
    pub fn store_score_grads_first(first: Option<bool>) {
        crate::flash::set_score_grads_first(first);
    }

    /// Whether the device adds f32 values atomically: where it does, the register-fragment
    /// backward sums dQ in its dK/dV kernel where that stages its rows.
    pub fn adds_f32_atomically<R: cubecl::Runtime>(device: &R::Device) -> bool {
        crate::flash::adds_f32_atomically(&R::client(device))
    }

    /// Where the flash-attention kernels place each cube of a launch over `batch · heads ·
    /// blocks_per_head` blocks (longest first where `causal`: `flash::stage::LONGEST_FIRST_BLOCKS`),
    /// in launch order: an f32 `[cubes, 3]` tensor of (batch, head, block) rows; `work_grows`
    /// for query blocks (the forward's and dQ's), else key blocks (dK/dV's).
    pub fn block_order<R: burn_cubecl::CubeRuntime>(
        device: &R::Device,
        batch: usize,
        heads: usize,
        blocks_per_head: usize,
        causal: bool,
        work_grows: bool,
    ) -> Result<burn_cubecl::tensor::CubeTensor<R>, crate::FlashError> {
        crate::flash::block_order(&R::client(device), device, batch, heads, blocks_per_head, causal, work_grows)
    }

    /// Bytes the allocator of runtime `R` has handed out on `device`, once the work queued
    /// so far has run (freed buffers then count no more).
    pub fn bytes_in_use<R: cubecl::Runtime>(device: &R::Device) -> u64 {
        let client = R::client(device);
        cubecl::future::block_on(client.sync()).expect("the device failed");
        client.memory_usage().expect("memory usage").bytes_in_use
    }

    /// `count` deterministic values in [-1, 1) from `stream` (splitmix64 of each index): the
    /// kernel tests' inputs, the same on every run and machine.
    pub fn uniform_values(count: usize, stream: u64) -> Vec<f64> {
        (0..count as u64)
            .map(|i| {
                let mut z = stream.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i.wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 31)).wrapping_mul(0x94D0_49BB_1331_11EB);
                (z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
            })
            .collect()
    }

    /// Whether `device` of runtime `R` stores and computes `dtype` (f16 and bf16 vary between
    /// devices: lavapipe has f16, not bf16; the other dtypes are taken as supported). A test
    /// skips the cases of a dtype the device lacks, unless `ULYSSES_REQUIRE_DTYPES` names it
    /// (`f16,bf16`: the GPU run sets it), where this panics: a run on an H100 whose bf16 cases
    /// all skipped would pass having checked none of them.
    pub fn supports_dtype<R: cubecl::Runtime>(device: &R::Device, dtype: burn::tensor::DType) -> bool {
        use cubecl::ir::{ElemType, FloatKind};
        let (elem, name) = match dtype {
            burn::tensor::DType::F16 => (ElemType::Float(FloatKind::F16), "f16"),
            burn::tensor::DType::BF16 => (ElemType::Float(FloatKind::BF16), "bf16"),
            _ => return true,
        };
        // Read first, so a misspelt list fails on every device, not only one lacking a dtype.
        let required = required_dtypes();
        let supported = R::client(device).properties().supports_type(elem);
        if !supported && required.iter().any(|required| required == name) {
            panic!("the device has no {name}, which ULYSSES_REQUIRE_DTYPES requires: its cases would skip");
        }
        supported
    }

    /// The dtypes `ULYSSES_REQUIRE_DTYPES` names (comma-separated `f16`, `bf16`; none when unset).
    fn required_dtypes() -> Vec<String> {
        let listed = std::env::var("ULYSSES_REQUIRE_DTYPES").unwrap_or_default();
        let names: Vec<String> = listed.split(',').map(|name| name.trim().to_ascii_lowercase()).filter(|name| !name.is_empty()).collect();
        if let Some(unknown) = names.iter().find(|name| !["f16", "bf16"].contains(&name.as_str())) {
            panic!("ULYSSES_REQUIRE_DTYPES={listed:?} names {unknown:?}: it takes f16 and bf16, comma-separated");
        }
        names
    }

    /// Whether runtime `R` can create a client on its default device. When it cannot, this
    /// prints why and returns false, unless `ULYSSES_REQUIRE_GPU_RUNTIME=1` (CI sets it after
    /// installing lavapipe), where it panics.
    pub fn runtime_available<R: cubecl::Runtime>() -> bool
    where
        R::Device: Default,
    {
        let probe = std::panic::catch_unwind(|| {
            let _ = R::client(&R::Device::default());
        });
        let hint = format!(
            "no CubeCL device for {}: wgpu needs a Vulkan driver (apt-get install mesa-vulkan-drivers libvulkan1), \
             CUDA the NVIDIA driver's libcuda.so on the library path",
            std::any::type_name::<R>()
        );
        match probe {
            Ok(()) => true,
            Err(_) if std::env::var("ULYSSES_REQUIRE_GPU_RUNTIME").as_deref() == Ok("1") => panic!("{hint}"),
            Err(_) => {
                eprintln!("SKIPPED: {hint}");
                false
            }
        }
    }
}
