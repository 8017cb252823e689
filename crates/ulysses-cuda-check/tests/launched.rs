//! What runs on the compile-only runtime is written out and read back whole, burn's own kernels
//! among it (`write_launched`, `read_kernels`): `ulysses-trainer --backend cuda-compile-only`
//! writes a training step's kernels so, for the PTX cache a GPU run is given.

use burn::tensor::{DType, Tensor};
use ulysses_cuda_check::{read_kernels, runtime::TargetDevice, write_launched};

type CompileOnly = burn_cubecl::CubeBackend<ulysses_cuda_check::runtime::CompileOnly, f32, i32, u8>;

#[test]
fn a_compile_only_run_writes_every_kernel_it_launched() {
    let out = std::env::temp_dir().join(format!("ulysses-launched-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let device = TargetDevice(0);
    ulysses_cuda_check::runtime::take_compiled();
    // A bf16 matmul (burn's tensor-core kernels) and its cast and sum: nothing runs, the
    // values read are zeros.
    let a = Tensor::<CompileOnly, 2>::ones([256, 512], &device).cast(DType::BF16);
    let b = Tensor::<CompileOnly, 2>::ones([512, 128], &device).cast(DType::BF16);
    let sum = a.matmul(b).sum().into_data();
    assert_eq!(sum.shape.iter().product::<usize>(), 1);
    let line = write_launched(&out).expect("the launched kernels are written");
    let kernels = read_kernels(&out).expect("and read back");
    assert!(kernels.len() >= 3, "{line}: {:?}", kernels.iter().map(|k| &k.entrypoint).collect::<Vec<_>>());
    assert!(kernels.iter().any(|k| k.entrypoint.contains("matmul")), "no matmul among {:?}", kernels.iter().map(|k| &k.entrypoint).collect::<Vec<_>>());
    assert!(kernels.iter().all(|k| k.target == "sm_90a" && k.source.contains(&k.entrypoint)), "a kernel read back without its source");
    // Each source once: launched again, nothing new.
    let sources: std::collections::HashSet<&String> = kernels.iter().map(|k| &k.source).collect();
    assert_eq!(sources.len(), kernels.len(), "a source written twice");
    let not_compiled = std::fs::read_to_string(out.join("not-compiled.txt")).unwrap();
    assert!(not_compiled.is_empty(), "kernels CubeCL could not compile for an H100: {not_compiled}");
    let _ = std::fs::remove_dir_all(&out);
}

/// What is written is read back as written, and a kernel's output as zeros of its shape, though
/// cubecl-cuda's layout pads rows whose bytes are no power of two (12 here) to a pitch (16): the
/// host code of a run (`into_data`, the loss) sees tensors of the shapes it made, never padding.
#[test]
fn tensors_read_back_dense_from_pitched_rows() {
    let device = TargetDevice(0);
    let data = burn::tensor::TensorData::new((0..18).map(|i| i as f32).collect::<Vec<_>>(), [3, 2, 3]);
    let written = Tensor::<CompileOnly, 3>::from_data(data.clone(), &device);
    // Nothing runs: the product's own buffer (`written` is still held, so not reused in place;
    // laid out by the pitched policy) holds zeros.
    let output = (written.clone() * 2.0).into_data();
    assert_eq!(output.as_slice::<f32>().expect("f32 values"), &[0.0; 18][..], "a pitched output read with its padding");
    assert_eq!(written.into_data(), data);
}
