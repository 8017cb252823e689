//! NCCL for burn-ulysses: one process per GPU, on one node or many.
//!
//! [`NcclCommunicator`] implements `burn_ulysses::comm::Communicator` on the CUDA buffers of
//! burn's `CubeBackend<CudaRuntime, ..>` tensors (and, through `FusionCommunicator`, of its
//! fused form), with `split` through `ncclCommSplit`, so `ParallelGroups` builds the SP and
//! DP groups from it; [`Nccl`] is the transport `burn_ulysses::job::run_ranks` starts CUDA
//! ranks with. It joins the job through
//! `ulysses_dist::Rendezvous` (rank 0 hands out the NCCL unique id) and uses NCCL's
//! non-blocking communicators, so that no call waits forever: a collective that outlives its
//! timeout, or whose peer died (its rendezvous connection closed), aborts the communicator
//! and returns an error that names the ranks that died or left (a timeout says so: NCCL
//! does not say which peer it waits for).
//!
//! Ordering against CubeCL's own work: CubeCL does not expose its CUDA stream, so each
//! collective synchronises CubeCL's queue on the host before NCCL reads the inputs, and
//! waits for NCCL's stream before handing back the outputs. A stream-ordered version would
//! record an event on CubeCL's stream and make NCCL's stream wait on it (and the reverse),
//! which needs CubeCL to expose the stream of a client. cubecl-cuda 0.10 does not, but its
//! `Command::resource` knows the stream a binding is used on, so the vendored copy
//! (third_party/cubecl-cuda) could hand it out with the resource `get_resource` returns. The
//! host's polls (the dead-peer check and the deadline, [`wait`]) would then move to a watchdog
//! thread that aborts the communicator, and a step would wait for its collectives once, before
//! anything it made is committed.
//!
//! Status: its CPU-side behaviour (no libnccl) is tested here; on one H100 (world size 1, and
//! two processes on the one GPU) every collective and SP attention against one device matched
//! (`ulysses-nccl-check`), and SP = 2 trained over two NCCL processes as SP = 1 did
//! (benches/RESULTS.md); no run has had two GPUs (NVLink) yet. Every cudarc NCCL call panics
//! when libnccl is absent, so the library is checked first ([`check_library`]), and so are the
//! driver and the GPU ([`check_cuda_device`]), which callers of CubeCL's CUDA runtime use too:
//! CubeCL fails on its device thread.

pub mod autotune;
pub mod memory_pools;
mod comm;
mod library;
pub mod wait;
mod transport;

pub use comm::{NcclCommunicator, gpu_of};
pub use transport::Nccl;
pub use library::{MINIMUM as MINIMUM_NCCL, NcclVersion, check_cuda_device, check_library};

use burn::tensor::DType;

/// Why an NCCL operation failed. Each variant names the fix.
#[derive(Debug, thiserror::Error)]
pub enum NcclError {
    #[error(
        "libnccl is not loadable: cudarc looks for `libnccl.so` (not `libnccl.so.2`) on the \
         library path. Install NCCL (Debian: libnccl2, pip: nvidia-nccl-cu12/13), then make a \
         `libnccl.so` symlink to its `libnccl.so.2` in a folder on LD_LIBRARY_PATH, e.g. \
         `ln -s $(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))')/lib/libnccl.so.2 \
         ~/lib/libnccl.so && export LD_LIBRARY_PATH=~/lib:$LD_LIBRARY_PATH`. \
         In-process ranks (ThreadGroup) keep working without it."
    )]
    LibraryMissing,
    #[error("libnccl {found} is too old: burn-ulysses needs NCCL {needed} or newer (ncclCommSplit, non-blocking communicators)")]
    TooOld { found: NcclVersion, needed: NcclVersion },
    #[error(
        "no CUDA driver: libcuda.so is not loadable (no NVIDIA driver on this machine, or its folder is \
         not on LD_LIBRARY_PATH), so neither CUDA nor NCCL can run here. On a machine without an NVIDIA \
         GPU, train on a CPU backend; in-process ranks (ThreadGroup) need no driver."
    )]
    DriverMissing,
    #[error(
        "GPU {ordinal} does not exist: this process sees {count} CUDA device(s), 0..{count}. Pick one \
         of them (the launcher's LOCAL_RANK, the trainer's --device, or ulysses-nccl-check's ULYSSES_GPU), or widen \
         CUDA_VISIBLE_DEVICES"
    )]
    NoSuchGpu { ordinal: usize, count: usize },
    #[error("{call} failed: {code:?} ({message})")]
    Nccl { call: &'static str, code: cudarc::nccl::sys::ncclResult_t, message: String },
    #[error("CUDA: {0}")]
    Cuda(String),
    #[error(
        "{op} did not complete within {after:?} and no rank of its group has left the job; the communicator was aborted. A rank may be \
         stuck or slow (raise ULYSSES_COLLECTIVE_TIMEOUT if it is only slow), or, on the first collectives across nodes, NCCL may \
         have picked a network interface the other nodes cannot reach: run with NCCL_DEBUG=INFO to see which, and set \
         NCCL_SOCKET_IFNAME to the one that reaches rank 0"
    )]
    Timeout { op: &'static str, after: std::time::Duration },
    #[error(
        "{op} aborted: rank 0, which serves the rendezvous, did not answer within {after:?} whether any rank had left, while this rank \
         waited in the collective. Its process or node is likely stopped or unreachable (suspended, out of memory, a network partition): \
         look at rank 0's output and node first"
    )]
    RendezvousStalled { op: &'static str, after: std::time::Duration },
    #[error("{op} aborted: rank(s) {ranks:?} died (their rendezvous connection closed). Look at their own errors first.")]
    PeerDied { op: &'static str, ranks: Vec<usize> },
    #[error(
        "{op} aborted: rank(s) {ranks:?} of its group ended their process (an error, or the end of their run) \
         while this rank waited for them in it ({waited:?} after they left). Look at their own output first."
    )]
    PeerLeft { op: &'static str, ranks: Vec<usize>, waited: std::time::Duration },
    #[error("NCCL has no type for {0:?}; use f32, f16, bf16 or f64 tensors")]
    DType(DType),
    #[error(transparent)]
    Dist(#[from] ulysses_dist::DistError),
}
