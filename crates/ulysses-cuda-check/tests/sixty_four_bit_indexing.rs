//! burn's kernels on a buffer of more than 2^32 elements, as the H100 would launch them: with
//! 64-bit indices. cubecl-std 0.10.0's 64-bit fast division panicked at launch for most
//! divisors (third_party/README.md); on an H100 that stopped the 4.5e9-element kernel test and
//! the 8B-shaped training step at 1.31M tokens. The compile-only runtime runs the same host
//! code (launch arguments, then CUDA C++), with no GPU: the buffer is only reserved (the host
//! allocator maps zero pages lazily, and nothing here touches them).

use burn::tensor::{FloatDType, Shape, Slice, TensorMetadata, ops::FloatTensorOps};
use burn_cubecl::CubeBackend;
use std::sync::Mutex;

use cubecl::Runtime as _;
use ulysses_cuda_check::runtime::{CompileOnly, TARGETS, TargetDevice, take_compiled};

type Backend = CubeBackend<CompileOnly, f32, i32, u32>;

/// Panics on any thread (the server's among them: a launch or an allocation that fails there
/// leaves the test's own thread running on).
static PANICS: Mutex<Vec<String>> = Mutex::new(Vec::new());

#[test]
fn a_copy_of_a_view_into_a_buffer_past_2_pow_32_elements_launches_with_64_bit_indices() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.lock().unwrap_or_else(|p| p.into_inner()).push(info.to_string());
        report(info);
    }));
    let h100 = TARGETS.iter().position(|t| t.arch == 90).expect("an sm_90 target");
    let device = TargetDevice(h100);
    let client = CompileOnly::client(&device);
    // 2^32 + 128 bf16 elements (8.6 GB reserved, never written).
    let (rows, columns) = ((1usize << 25) + 1, 128usize);
    assert!(rows * columns > u32::MAX as usize);
    let big = Backend::float_empty(Shape::new([rows, columns]), &device, FloatDType::BF16);
    // 2272 rows (no power of two: its multiplier is past 2^63) of 64 columns: a strided view,
    // which burn copies to contiguous memory with a kernel indexed in 64 bits.
    let view = Backend::float_slice(big.clone(), &[Slice::from(0..2272), Slice::from(0..64)]);
    take_compiled();
    let copy = burn_cubecl::kernel::into_contiguous(view);
    // The same copy of the next rows: recorded once (a training run launches each kernel
    // thousands of times).
    let again = burn_cubecl::kernel::into_contiguous(Backend::float_slice(big, &[Slice::from(2272..4544), Slice::from(0..64)]));
    cubecl::future::block_on(client.sync()).expect("the launches reach the compiler");
    assert_eq!((copy.shape(), again.shape()), (Shape::new([2272, 64]), Shape::new([2272, 64])));

    let compiled: Vec<_> = take_compiled().into_iter().collect::<Result<_, _>>().expect("the copy compiles to CUDA C++");
    assert_eq!(compiled.len(), 1, "one copy kernel, launched twice: {:?}", compiled.iter().map(|c| &c.entrypoint).collect::<Vec<_>>());
    let source = &compiled[0].source;
    // 64-bit indices: the fast division's operands are 64-bit and multiplied with __umul64hi.
    assert!(source.contains("__umul64hi"), "the copy is not indexed in 64 bits:\n{source}");
    let panics = PANICS.lock().unwrap_or_else(|p| p.into_inner());
    assert!(panics.is_empty(), "panicked on another thread: {panics:?}");
}
