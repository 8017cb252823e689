//! On a machine without libnccl (CI, and any CPU-only machine), asking for NCCL fails with an
//! error that says how to make libnccl loadable, nothing panics, and in-process ranks keep
//! working. On a machine that has libnccl the test reports its version instead.

use burn::backend::NdArray;
use burn_ulysses::comm::{Communicator, ReduceOp, ThreadGroup};
use ulysses_dist::DistributedConfig;
use ulysses_nccl::{NcclCommunicator, NcclError, check_cuda_device, check_library};

#[test]
fn a_missing_libnccl_is_a_clear_error_and_the_cpu_path_keeps_working() {
    // In-process ranks need no libnccl: checked wherever the test runs.
    type B = NdArray<f32>;
    let sums = ThreadGroup::new(2).run(|rank| {
        let comm = rank.communicator();
        let t = burn::tensor::Tensor::<B, 1>::from_floats([rank.rank() as f32 + 1.0], &Default::default());
        let sum = Communicator::<B>::all_reduce(&*comm, t.into_primitive().tensor(), ReduceOp::Sum).unwrap();
        burn::tensor::Tensor::<B, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(sum)).into_scalar()
    });
    assert!(sums.into_iter().all(|s| s.unwrap() == 3.0));
    match check_library() {
        Ok(version) => {
            println!("libnccl {version} is loadable here; the missing-library path is not exercised");
            return;
        }
        Err(error) => {
            let message = error.to_string();
            println!("{message}");
            assert!(matches!(error, NcclError::LibraryMissing));
            for needle in ["libnccl.so", "libnccl.so.2", "LD_LIBRARY_PATH", "ThreadGroup"] {
                assert!(message.contains(needle), "missing {needle:?} in: {message}");
            }
        }
    }
    let from_env = NcclCommunicator::from_env(&DistributedConfig::new().with_token(Some("t".into())));
    assert!(matches!(from_env, Err(NcclError::LibraryMissing)), "from_env must fail before touching the job");
}

/// Asking for a GPU is a clear error before CubeCL starts: on a machine without the NVIDIA
/// driver (CI) it says so; where the driver is, a device index past the last says how many
/// there are.
#[test]
fn a_missing_driver_or_gpu_is_named_before_cuda_starts() {
    match check_cuda_device(0) {
        Err(NcclError::DriverMissing) => {
            let message = check_cuda_device(3).unwrap_err().to_string();
            println!("{message}");
            for needle in ["libcuda.so", "LD_LIBRARY_PATH", "CPU backend"] {
                assert!(message.contains(needle), "missing {needle:?} in: {message}");
            }
        }
        Ok(()) => {
            let error = check_cuda_device(4096).expect_err("no machine has 4097 GPUs");
            println!("{error}");
            assert!(matches!(error, NcclError::NoSuchGpu { ordinal: 4096, count } if count > 0), "{error}");
            assert!(error.to_string().contains("GPU 4096 does not exist"), "{error}");
        }
        Err(other) => {
            println!("the driver loads but CUDA cannot start here: {other}");
            assert!(matches!(other, NcclError::Cuda(ref m) if m.contains("cuInit") || m.contains("cuDeviceGetCount")), "{other}");
        }
    }
}

#[test]
fn nccl_versions_read_as_major_minor_patch() {
    assert_eq!(ulysses_nccl::NcclVersion(22803).to_string(), "2.28.3");
}
