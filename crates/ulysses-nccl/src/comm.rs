//! The communicator: joining, collectives on CubeCL CUDA buffers, splitting, aborting.

use std::{
    ffi::{CStr, c_int, c_void},
    ptr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use burn::tensor::{DType, Shape, TensorMetadata, backend::Backend};
use burn_cubecl::{
    BoolElement, CubeBackend, FloatElement, IntElement, kernel::into_contiguous,
    ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor,
};
use burn_ulysses::comm::{CommError, Communicator, ReduceOp, Traffic, TrafficCounter, check_reduce_scatter};
use cubecl::{
    Runtime,
    cuda::{CudaDevice, CudaRuntime},
};
use cudarc::{
    driver::{result as cuda, sys as cuda_sys},
    nccl::sys as nccl,
};
use ulysses_dist::{
    DistributedConfig, LaunchEnv, Rendezvous,
    rendezvous::{LeftRanks, PeerLoss, PeerWatch},
};

use crate::{
    NcclError,
    library::{check_cuda_device, check_library},
    wait::Poll,
};

type CudaTensor = CubeTensor<CudaRuntime>;

/// What every communicator of a process shares: the device, its context, NCCL's stream and
/// the rendezvous (to name dead ranks).
struct Process {
    device: CudaDevice,
    /// The driver's device whose primary context this process holds (released on drop).
    cu_device: cuda_sys::CUdevice,
    context: Raw<cuda_sys::CUcontext>,
    stream: Raw<cuda_sys::CUstream>,
    /// Held for the whole of a collective on any of the process's communicators: they share
    /// `stream`, so one collective is enqueued and done before the next starts. It does not make
    /// collectives from two threads safe: which thread takes it first may differ between
    /// ranks, and a rank waiting in its SP collective while its DP peer waits in theirs stalls
    /// to the timeout. Every rank issues its collectives from one thread, in one order (the
    /// trainer does: the host optimizer's thread issues none).
    calls: Mutex<()>,
    rendezvous: Rendezvous,
    timeout: Duration,
    /// Set where NCCL's kernels still ran on `stream` 10 s after an abort: buffers a failed
    /// collective gave them are then never handed back to CubeCL's pool
    /// ([`NcclCommunicator::release_after_failure`]), which would give them to a tensor the
    /// kernels might still write.
    kernels_left_running: AtomicBool,
}

/// Refuses, on every rank, a job two of whose ranks run on one GPU (a launcher that set no
/// LOCAL_RANK, or each process shown the same one GPU): NCCL's init would fail with "Duplicate
/// GPU detected", naming neither cause. Ranks whose NCCL_HOSTID differ are on other machines
/// for NCCL and for this check. Rank 0 reads every rank's machine and PCI bus id and
/// tells each the verdict.
fn check_own_gpu(rendezvous: &Rendezvous, env: &LaunchEnv, device: cuda_sys::CUdevice) -> Result<(), NcclError> {
    let mut bus_id = [0 as std::ffi::c_char; 32];
    // SAFETY: a valid device and a buffer of the length given (NUL-terminated on success).
    let status = unsafe { cuda_sys::cuDeviceGetPCIBusId(bus_id.as_mut_ptr(), bus_id.len() as c_int, device) };
    if status != cuda_sys::CUresult::CUDA_SUCCESS {
        return Err(NcclError::Cuda(format!("cuDeviceGetPCIBusId: {status:?}")));
    }
    // SAFETY: NUL-terminated by the call above, within the buffer.
    let bus_id = unsafe { std::ffi::CStr::from_ptr(bus_id.as_ptr()) }.to_string_lossy().into_owned();
    // The machine as NCCL tells machines apart (its host hash: the host's name and boot id), so
    // that this check refuses what NCCL's init would; the rendezvous address where unreadable.
    // NCCL_HOSTID replaces it there, and so here: ranks given other ids share a GPU on purpose
    // (scripts/gpu-run.sh's two-rank checks on one GPU).
    let read = |path: &str| std::fs::read_to_string(path).ok().map(|text| text.trim().to_string());
    let machine = match (std::env::var_os("NCCL_HOSTID"), read("/proc/sys/kernel/hostname"), read("/proc/sys/kernel/random/boot_id")) {
        (Some(id), _, _) => format!("NCCL_HOSTID={}", id.to_string_lossy()),
        (_, Some(name), Some(boot)) => format!("{name} (boot {boot})"),
        _ => rendezvous.local_ip().map_err(|e| NcclError::Cuda(format!("this rank's address: {e}")))?,
    };
    rendezvous.set(&format!("nccl/gpu/{}", env.rank), format!("{machine} {bus_id}").as_bytes())?;
    let verdict = match env.rank {
        0 => {
            let devices = (0..env.world_size)
                .map(|rank| rendezvous.get_set_by(&format!("nccl/gpu/{rank}"), rank).map(|bytes| String::from_utf8_lossy(&bytes).into_owned()))
                .collect::<Result<Vec<_>, _>>()?;
            Some(ulysses_dist::env::ranks_sharing_a_device(&devices).unwrap_or_default())
        }
        _ => None,
    };
    let verdict = rendezvous.broadcast("nccl/gpu/verdict", verdict.as_deref().map(str::as_bytes), 0)?;
    match verdict.is_empty() {
        true => Ok(()),
        false => Err(NcclError::Cuda(String::from_utf8_lossy(&verdict).into_owned())),
    }
}

impl Drop for Process {
    /// The process's last communicator is gone: its stream, and its hold on the device's
    /// primary context (each join took one of each).
    fn drop(&mut self) {
        // SAFETY: the stream and the context's hold are this process's own; no communicator
        // is left to use them.
        unsafe {
            if cuda::ctx::set_current(self.context.0).is_ok() {
                let _ = cuda::stream::destroy(self.stream.0);
            }
            let _ = cuda::primary_ctx::release(self.cu_device);
        }
    }
}

/// One wait's deadline, when it next asks the rendezvous, and what it has seen leave.
struct WaitChecks {
    deadline: Instant,
    next_check: Instant,
    watch: PeerWatch,
}

/// A raw CUDA or NCCL handle. NCCL and CUDA handles may be used from any thread; the
/// communicator serialises its own calls.
#[derive(Clone, Copy)]
struct Raw<T>(T);
unsafe impl<T> Send for Raw<T> {}
unsafe impl<T> Sync for Raw<T> {}

/// One rank's NCCL communicator over a group (the world, or a split of it).
pub struct NcclCommunicator {
    comm: Raw<nccl::ncclComm_t>,
    aborted: AtomicBool,
    rank: usize,
    size: usize,
    /// The group's world ranks, in group order: whom a wait watches for leaving the job.
    members: Vec<usize>,
    process: Arc<Process>,
    traffic: TrafficCounter,
    /// Time spent waiting on the host for CubeCL's queue before collectives, and their count.
    host_sync_nanos: AtomicU64,
    collectives: AtomicU64,
}

impl NcclCommunicator {
    /// Mean seconds per collective spent waiting for CubeCL's queue on the host: the cost of
    /// ordering collectives by host synchronisation instead of stream events.
    pub fn host_sync_seconds_per_collective(&self) -> f64 {
        let count = self.collectives.load(Ordering::Relaxed).max(1);
        self.host_sync_nanos.load(Ordering::Relaxed) as f64 / count as f64 / 1e9
    }

    /// Joins the job described by the launcher's environment (`RANK`, `WORLD_SIZE`,
    /// `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, `ULYSSES_RENDEZVOUS_TOKEN`, or Slurm's) on
    /// GPU [`gpu_of`]`(env)`. Fails, without panicking, when libnccl or the CUDA driver is
    /// missing.
    pub fn from_env(config: &DistributedConfig) -> Result<Arc<Self>, NcclError> {
        // The library first: its absence is the likeliest problem, and says how to fix it.
        check_library()?;
        let env = LaunchEnv::from_env()?;
        Self::join(&env, config, gpu_of(&env)?)
    }

    /// Joins the job described by `env` with this process's communicator on GPU `gpu`.
    pub fn join(env: &LaunchEnv, config: &DistributedConfig, gpu: usize) -> Result<Arc<Self>, NcclError> {
        check_library()?;
        check_cuda_device(gpu)?;
        let rendezvous = Rendezvous::join(env, config)?;

        let ordinal = gpu as c_int;
        let device = cuda::device::get(ordinal).map_err(cuda_error)?;
        // SAFETY: `device` is a valid device; the primary context is the one CubeCL uses.
        let context = unsafe { cuda::primary_ctx::retain(device) }.map_err(cuda_error)?;
        // Failing before `Process` holds it, the context's hold is given back here.
        let released = |error| {
            // SAFETY: the hold `retain` just took, used by nothing.
            let _ = unsafe { cuda::primary_ctx::release(device) };
            cuda_error(error)
        };
        unsafe { cuda::ctx::set_current(context) }.map_err(released)?;
        let stream = cuda::stream::create(cuda::stream::StreamKind::NonBlocking).map_err(released)?;
        let process = Arc::new(Process {
            device: CudaDevice { index: gpu },
            cu_device: device,
            context: Raw(context),
            stream: Raw(stream),
            calls: Mutex::new(()),
            rendezvous,
            timeout: config.collective_timeout(),
            kernels_left_running: AtomicBool::new(false),
        });

        let id = if env.rank == 0 {
            let id = cudarc::nccl::result::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", e.0, ptr::null_mut()))?;
            Some(id.internal.iter().map(|&b| b as u8).collect::<Vec<u8>>())
        } else {
            None
        };
        let id_bytes = process.rendezvous.broadcast("nccl/unique-id", id.as_deref(), 0)?;
        check_own_gpu(&process.rendezvous, env, device)?;
        let mut unique_id = nccl::ncclUniqueId { internal: [0; 128] };
        if id_bytes.len() != unique_id.internal.len() {
            return Err(NcclError::Cuda(format!("the NCCL unique id from rank 0 has {} bytes, not 128", id_bytes.len())));
        }
        for (dst, src) in unique_id.internal.iter_mut().zip(&id_bytes) {
            *dst = *src as _;
        }

        let mut comm: nccl::ncclComm_t = ptr::null_mut();
        let mut nccl_config = non_blocking_config();
        // SAFETY: valid out-pointer, id and config; a non-blocking init returns at once.
        let started = unsafe {
            nccl::ncclCommInitRankConfig(&mut comm, env.world_size as c_int, unique_id, env.rank as c_int, &mut nccl_config)
        };
        let communicator = Self::wrap(comm, env.rank, env.world_size, (0..env.world_size).collect(), process);
        communicator.accept(started, "ncclCommInitRankConfig")?;
        communicator.wait_ready("ncclCommInitRankConfig")?;
        tracing::info!(rank = env.rank, world = env.world_size, gpu, "NCCL communicator ready");
        Ok(Arc::new(communicator))
    }

    /// The GPU this communicator's buffers live on: allocate tensors for it there.
    pub fn device(&self) -> CudaDevice {
        self.process.device.clone()
    }

    fn wrap(comm: nccl::ncclComm_t, rank: usize, size: usize, members: Vec<usize>, process: Arc<Process>) -> Self {
        Self {
            comm: Raw(comm),
            aborted: AtomicBool::new(false),
            rank,
            size,
            members,
            process,
            traffic: TrafficCounter::default(),
            host_sync_nanos: AtomicU64::new(0),
            collectives: AtomicU64::new(0),
        }
    }

    fn current_context(&self) -> Result<(), NcclError> {
        // SAFETY: the primary context retained at creation stays alive for the process.
        unsafe { cuda::ctx::set_current(self.process.context.0) }.map_err(cuda_error)
    }

    /// `ncclSuccess` and (non-blocking) `ncclInProgress` are fine; anything else aborts the
    /// communicator and is an error.
    fn accept(&self, result: nccl::ncclResult_t, call: &'static str) -> Result<(), NcclError> {
        match result {
            nccl::ncclResult_t::ncclSuccess | nccl::ncclResult_t::ncclInProgress => Ok(()),
            code => Err(self.fail(call, code)),
        }
    }

    /// The error for a failed call, with NCCL's last message, after aborting.
    fn fail(&self, call: &'static str, code: nccl::ncclResult_t) -> NcclError {
        let error = nccl_error(call, code, self.comm.0);
        self.abort();
        error
    }

    /// Waits until this communicator's pending non-blocking call has been issued.
    fn wait_ready(&self, call: &'static str) -> Result<(), NcclError> {
        self.wait_ready_within(call, &mut self.wait_checks())
    }

    /// [`wait_ready`](Self::wait_ready) within `checks`' deadline: a collective's wait for
    /// its launch and then for its stream share one, so that it fails after the timeout, not
    /// twice it.
    fn wait_ready_within(&self, call: &'static str, checks: &mut WaitChecks) -> Result<(), NcclError> {
        let poll = Poll::start();
        loop {
            match self.async_state() {
                nccl::ncclResult_t::ncclSuccess => return Ok(()),
                nccl::ncclResult_t::ncclInProgress => {}
                code => return Err(self.fail(call, code)),
            }
            self.check_peers(call, checks)?;
            poll.pause();
        }
    }

    /// The communicator's asynchronous state (`ncclInProgress` while a call is pending).
    fn async_state(&self) -> nccl::ncclResult_t {
        let mut state = nccl::ncclResult_t::ncclSuccess;
        // SAFETY: live communicator and a valid out-pointer.
        let queried = unsafe { nccl::ncclCommGetAsyncError(self.comm.0, &mut state) };
        if queried == nccl::ncclResult_t::ncclSuccess { state } else { queried }
    }

    /// A new wait's deadline and watch.
    fn wait_checks(&self) -> WaitChecks {
        let now = Instant::now();
        WaitChecks {
            deadline: now + self.process.timeout,
            next_check: now + Duration::from_secs(1),
            watch: PeerWatch::new(&self.members),
        }
    }

    /// Fails (and aborts) when a rank died, a member of this group left the job while this
    /// rank waits for it ([`PeerWatch`]), or the deadline passed; asks the rendezvous at most
    /// once a second. An unreachable rendezvous means rank 0, which serves it, is gone.
    fn check_peers(&self, op: &'static str, checks: &mut WaitChecks) -> Result<(), NcclError> {
        let now = Instant::now();
        if now < checks.next_check && now < checks.deadline {
            return Ok(());
        }
        checks.next_check = now + Duration::from_secs(1);
        // Rank 0's answer awaited no later than the collective's deadline (a second at least):
        // a rank 0 that stopped answering without closing its connection (stopped, its node
        // gone) would otherwise hold this wait for the rendezvous timeout.
        let limit = checks.deadline.saturating_duration_since(now).max(Duration::from_secs(1));
        let left = match self.process.rendezvous.left_within(limit) {
            Ok(left) => left,
            // Rank 0's server answers from a thread of its own whatever its rank does: no
            // answer means its process or node stopped, not that a collective ran long.
            Err(ulysses_dist::DistError::RendezvousTimeout { after, .. }) => {
                self.abort();
                return Err(NcclError::RendezvousStalled { op, after });
            }
            // A closed connection: rank 0, which serves the rendezvous, is gone.
            Err(_) => LeftRanks { died: vec![0], finished: Vec::new() },
        };
        let failure = match checks.watch.check(&left, now) {
            Some(PeerLoss::Died(ranks)) => NcclError::PeerDied { op, ranks },
            Some(PeerLoss::Left { ranks, waited }) => NcclError::PeerLeft { op, ranks, waited },
            None if now >= checks.deadline => NcclError::Timeout { op, after: self.process.timeout },
            None => return Ok(()),
        };
        self.abort();
        Err(failure)
    }

    fn abort(&self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            tracing::error!(rank = self.rank, "aborting the NCCL communicator");
            // SAFETY: live communicator; abort is the documented way out of a stuck collective.
            unsafe { nccl::ncclCommAbort(self.comm.0) };
        }
    }

    /// `error`, this rank's refusal of its part in a collective (a wrong argument, a tensor on
    /// another device), after aborting: its peers may be inside the collective already, and
    /// NCCL pairs collectives by their order alone, so this rank's next one would run against
    /// theirs.
    fn refuse<E>(&self, error: E) -> E {
        // Under the process's call lock (no caller holds it): another thread's collective on
        // this communicator, polling it, must not have it freed under it by the abort.
        let _exclusive = self.process.calls.lock().unwrap_or_else(|p| p.into_inner());
        self.abort();
        error
    }

    fn check_usable(&self, op: &'static str) -> Result<(), NcclError> {
        if self.aborted.load(Ordering::SeqCst) {
            return Err(NcclError::Cuda(format!("{op}: this communicator was aborted after an earlier failure")));
        }
        Ok(())
    }

    /// Runs one collective: CubeCL's queued work is finished first (it wrote the inputs),
    /// then `launch` enqueues NCCL work on NCCL's stream, which is waited for (with the
    /// timeout and the dead-peer check) before the outputs are handed back.
    fn collective(
        &self,
        op: &'static str,
        client: &cubecl::client::ComputeClient<CudaRuntime>,
        launch: impl FnOnce(nccl::ncclComm_t, nccl::cudaStream_t) -> nccl::ncclResult_t,
    ) -> Result<(), NcclError> {
        let _exclusive = self.process.calls.lock().unwrap_or_else(|p| p.into_inner());
        self.check_usable(op)?;
        let waited = Instant::now();
        // A rank that cannot take its part aborts, as one that fails in it does: never left
        // usable with its peers inside this collective.
        let failed = |error: NcclError| {
            self.abort();
            error
        };
        cubecl::future::block_on(client.sync()).map_err(|e| failed(NcclError::Cuda(format!("CubeCL work before {op} failed: {e:?}"))))?;
        self.host_sync_nanos.fetch_add(waited.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.collectives.fetch_add(1, Ordering::Relaxed);
        self.current_context().map_err(failed)?;
        let stream = self.process.stream.0 as nccl::cudaStream_t;
        // A launch that failed part-way (a group whose end queued some of its sends) leaves
        // kernels behind it too.
        let waited = self.accept(launch(self.comm.0, stream), op).and_then(|()| self.wait_for_stream(op));
        if waited.is_err() {
            self.drain_after_abort(op);
        }
        waited
    }

    /// Waits for the collective `launch` put on NCCL's stream: its launch, then its kernels.
    fn wait_for_stream(&self, op: &'static str) -> Result<(), NcclError> {
        let mut checks = self.wait_checks();
        self.wait_ready_within(op, &mut checks)?;
        let poll = Poll::start();
        loop {
            // SAFETY: our stream lives as long as the process.
            match unsafe { cuda_sys::cuStreamQuery(self.process.stream.0) } {
                cuda_sys::CUresult::CUDA_SUCCESS => return Ok(()),
                cuda_sys::CUresult::CUDA_ERROR_NOT_READY => {}
                error => {
                    self.abort();
                    return Err(NcclError::Cuda(format!("{op}: {error:?}")));
                }
            }
            match self.async_state() {
                nccl::ncclResult_t::ncclSuccess | nccl::ncclResult_t::ncclInProgress => {}
                code => return Err(self.fail(op, code)),
            }
            self.check_peers(op, &mut checks)?;
            poll.pause();
        }
    }

    /// After a collective failed and aborted the communicator: waits (10 s at most) for NCCL's
    /// kernels on its stream to end, so that the buffers, which go back to CubeCL's pool as
    /// the caller returns, are not written by them afterwards (an abort stops them, but does
    /// not wait for them). Where they still run, the process's failed collectives keep their
    /// buffers for good ([`Self::release_after_failure`]).
    fn drain_after_abort(&self, op: &'static str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let poll = Poll::start();
        // SAFETY: our stream lives as long as the process.
        while unsafe { cuda_sys::cuStreamQuery(self.process.stream.0) } == cuda_sys::CUresult::CUDA_ERROR_NOT_READY {
            if Instant::now() >= deadline {
                self.process.kernels_left_running.store(true, Ordering::SeqCst);
                tracing::error!(op, "NCCL's kernels still run 10 s after the abort; their buffers are kept from reuse (leaked): end this process");
                return;
            }
            poll.pause();
        }
    }

    /// Drops a failed collective's `buffers` (its tensors, handles and the guards holding
    /// their memory), or leaks them where NCCL's kernels were left running on the stream
    /// ([`Self::drain_after_abort`]): memory back in CubeCL's pool would be a later tensor's,
    /// written by them (a silently wrong value, in a parameter or a checkpoint).
    fn release_after_failure<T>(&self, buffers: T) {
        if self.process.kernels_left_running.load(Ordering::SeqCst) {
            std::mem::forget(buffers);
        }
    }

    fn client(&self) -> cubecl::client::ComputeClient<CudaRuntime> {
        CudaRuntime::client(&self.process.device)
    }
}

impl Drop for NcclCommunicator {
    /// Non-blocking teardown: finalize, wait for it (bounded), destroy; abort on any failure.
    fn drop(&mut self) {
        if self.aborted.load(Ordering::SeqCst) || self.current_context().is_err() {
            return;
        }
        // SAFETY: live communicator, no collective in flight (we are its last owner).
        let finalized = unsafe { nccl::ncclCommFinalize(self.comm.0) };
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut state = finalized;
        while state == nccl::ncclResult_t::ncclInProgress || (state == nccl::ncclResult_t::ncclSuccess && self.async_state() == nccl::ncclResult_t::ncclInProgress) {
            if Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
            state = self.async_state();
        }
        if state == nccl::ncclResult_t::ncclSuccess {
            // SAFETY: finalized communicator.
            unsafe { nccl::ncclCommDestroy(self.comm.0) };
        } else {
            self.abort();
        }
    }
}

/// The NCCL version whose `ncclConfig_t` layout cudarc's bindings describe (2.30).
const CONFIG_LAYOUT_VERSION: u32 = 23000;

/// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`. The version field tells NCCL which fields
/// exist: the older of the library's version and the bindings' layout.
fn non_blocking_config() -> nccl::ncclConfig_t {
    const UNDEF: c_int = c_int::MIN;
    let runtime = cudarc::nccl::result::get_nccl_version().map_or(CONFIG_LAYOUT_VERSION, |v| v as u32);
    nccl::ncclConfig_t {
        size: std::mem::size_of::<nccl::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: runtime.min(CONFIG_LAYOUT_VERSION),
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

/// The GPU of a rank: `ULYSSES_GPU` when set (several ranks on one GPU, for tests), else
/// [`LaunchEnv::device_index`] (`LOCAL_RANK`, or 0 where the process is shown one GPU).
pub fn gpu_of(env: &LaunchEnv) -> Result<usize, NcclError> {
    match std::env::var("ULYSSES_GPU") {
        Ok(value) => value.trim().parse().map_err(|_| NcclError::Cuda(format!("ULYSSES_GPU={value:?} is not a GPU index"))),
        Err(_) => Ok(env.device_index()),
    }
}

fn nccl_error(call: &'static str, code: nccl::ncclResult_t, comm: nccl::ncclComm_t) -> NcclError {
    // SAFETY: NCCL returns a static, NUL-terminated string.
    let message = unsafe { nccl::ncclGetLastError(comm) };
    let message = if message.is_null() {
        String::new()
    } else {
        unsafe { CStr::from_ptr(message) }.to_string_lossy().into_owned()
    };
    NcclError::Nccl { call, code, message }
}

fn cuda_error(error: cuda::DriverError) -> NcclError {
    NcclError::Cuda(format!("{error:?}"))
}

fn data_type(dtype: DType) -> Result<nccl::ncclDataType_t, NcclError> {
    Ok(match dtype {
        // burn's flex32 is stored as f32.
        DType::F32 | DType::Flex32 => nccl::ncclDataType_t::ncclFloat32,
        DType::F16 => nccl::ncclDataType_t::ncclFloat16,
        DType::BF16 => nccl::ncclDataType_t::ncclBfloat16,
        DType::F64 => nccl::ncclDataType_t::ncclFloat64,
        other => return Err(NcclError::DType(other)),
    })
}

/// A tensor's device address, valid while the returned guard lives.
fn device_pointer(tensor: &CudaTensor) -> Result<(u64, impl Sized + use<>), NcclError> {
    let resource = tensor
        .client
        .get_resource(tensor.handle.clone())
        .map_err(|e| NcclError::Cuda(format!("cannot reach a tensor's buffer: {e:?}")))?;
    Ok((resource.resource().ptr, resource))
}

/// NCCL's reduction of `op` in `dtype`, and whether the result is then divided by the group's
/// size: a mean in half precision is a sum divided once, as the host transports compute it
/// (NCCL's `ncclAvg` multiplies each input by 1/size rounded to the dtype first: 0.2% off at 3
/// ranks in bf16).
fn reduce_op(op: ReduceOp, dtype: DType) -> (nccl::ncclRedOp_t, bool) {
    match op {
        ReduceOp::Sum => (nccl::ncclRedOp_t::ncclSum, false),
        ReduceOp::Mean if matches!(dtype, DType::F16 | DType::BF16) => (nccl::ncclRedOp_t::ncclSum, true),
        ReduceOp::Mean => (nccl::ncclRedOp_t::ncclAvg, false),
        ReduceOp::Max => (nccl::ncclRedOp_t::ncclMax, false),
    }
}

fn to_comm_error(error: NcclError) -> CommError {
    CommError::Backend(error.to_string())
}

/// An empty contiguous tensor like `like`, with `shape`.
fn empty_like(like: &CudaTensor, shape: Shape) -> CudaTensor {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, like.dtype)
}

impl NcclCommunicator {
    /// `reduced` divided by the group's size where `divide` ([`reduce_op`]'s mean in half
    /// precision), on the device.
    fn divided_if<F: FloatElement, I: IntElement, BT: BoolElement>(&self, reduced: CudaTensor, divide: bool) -> CudaTensor
    where
        CubeBackend<CudaRuntime, F, I, BT>: Backend<FloatTensorPrimitive = CudaTensor>,
    {
        use burn::tensor::ops::FloatTensorOps;
        match divide {
            true => CubeBackend::<CudaRuntime, F, I, BT>::float_div_scalar(reduced, burn::tensor::Scalar::from(self.size as f64)),
            false => reduced,
        }
    }

    /// The collective shape shared by every tensor op: contiguous input, fresh output,
    /// pointers held for the duration of the call.
    fn tensor_collective(
        &self,
        op: &'static str,
        input: CudaTensor,
        output_shape: Shape,
        launch: impl FnOnce(*const c_void, *mut c_void, usize, nccl::ncclDataType_t, nccl::ncclComm_t, nccl::cudaStream_t) -> nccl::ncclResult_t,
    ) -> Result<CudaTensor, CommError> {
        if input.device != self.process.device {
            // NCCL would read another GPU's memory through this one's context.
            return Err(self.refuse(CommError::Backend(format!(
                "{op}: the tensor is on {:?}, but this rank's communicator is on {:?}: move it to the rank's device first",
                input.device, self.process.device
            ))));
        }
        let input = into_contiguous(input);
        let output = empty_like(&input, output_shape);
        let refused = |error: NcclError| self.refuse(to_comm_error(error));
        let dtype = data_type(input.dtype).map_err(refused)?;
        let count = input.shape().num_elements();
        let (send, send_guard) = device_pointer(&input).map_err(refused)?;
        let (recv, recv_guard) = device_pointer(&output).map_err(refused)?;
        let done = self.collective(op, &input.client, |comm, stream| {
            launch(send as *const c_void, recv as *mut c_void, count, dtype, comm, stream)
        });
        if let Err(error) = done {
            self.release_after_failure((send_guard, recv_guard, input, output));
            return Err(to_comm_error(error));
        }
        Ok(output)
    }
}

impl<F, I, BT> Communicator<CubeBackend<CudaRuntime, F, I, BT>> for NcclCommunicator
where
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
    CubeBackend<CudaRuntime, F, I, BT>: Backend<FloatTensorPrimitive = CudaTensor>,
{
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_to_all(&self, tensor: CudaTensor) -> Result<CudaTensor, CommError> {
        let shape = tensor.shape();
        if shape.num_dims() == 0 || shape[0] != self.size {
            return Err(self.refuse(CommError::InvalidArgument {
                op: burn_ulysses::comm::Collective::AllToAll,
                reason: format!("dim 0 must equal the group size {}, got shape {:?}", self.size, shape.to_vec()),
            }));
        }
        self.traffic.record_all_to_all((shape.num_elements() * tensor.dtype.size()) as u64, self.size);
        let size = self.size;
        let element = tensor.dtype.size();
        self.tensor_collective("all_to_all", tensor, shape, |send, recv, count, dtype, comm, stream| {
            let chunk = count / size;
            // SAFETY: the buffers hold `count` elements and outlive the call (guards above).
            unsafe {
                let started = nccl::ncclGroupStart();
                if started != nccl::ncclResult_t::ncclSuccess {
                    return started;
                }
                // The group is always ended (a peer's matching calls depend on it); the first
                // failure is reported.
                let mut first_error = nccl::ncclResult_t::ncclSuccess;
                for peer in 0..size {
                    let offset = peer * chunk * element;
                    let sent = nccl::ncclSend((send as *const u8).add(offset) as *const c_void, chunk, dtype, peer as c_int, comm, stream);
                    let received = nccl::ncclRecv((recv as *mut u8).add(offset) as *mut c_void, chunk, dtype, peer as c_int, comm, stream);
                    for result in [sent, received] {
                        let failed = !matches!(result, nccl::ncclResult_t::ncclSuccess | nccl::ncclResult_t::ncclInProgress);
                        if failed && first_error == nccl::ncclResult_t::ncclSuccess {
                            first_error = result;
                        }
                    }
                }
                let ended = nccl::ncclGroupEnd();
                if first_error == nccl::ncclResult_t::ncclSuccess { ended } else { first_error }
            }
        })
    }

    fn all_to_all_uneven(&self, tensor: CudaTensor, send_counts: &[usize], recv_counts: &[usize]) -> Result<CudaTensor, CommError> {
        let shape = tensor.shape();
        burn_ulysses::comm::check_uneven_counts(self.size, shape.num_elements(), shape.num_dims(), send_counts, recv_counts).map_err(|e| self.refuse(e))?;
        let element = tensor.dtype.size();
        let total: usize = send_counts.iter().sum();
        self.traffic.record_all_to_all_parts((total * element) as u64, ((total - send_counts[self.rank]) * element) as u64);
        let offsets = |counts: &[usize]| counts.iter().scan(0, |at, &c| { let start = *at; *at += c; Some(start) }).collect::<Vec<_>>();
        let (send_at, recv_at) = (offsets(send_counts), offsets(recv_counts));
        let (send_counts, recv_counts) = (send_counts.to_vec(), recv_counts.to_vec());
        // NCCL cannot check that the counts pair up (rank i's send_counts[j] is rank j's
        // recv_counts[i]): callers derive both from one plan.
        let output = Shape::new([recv_counts.iter().sum::<usize>()]);
        self.tensor_collective("all_to_all_uneven", tensor, output, |send, recv, _count, dtype, comm, stream| unsafe {
            let started = nccl::ncclGroupStart();
            if started != nccl::ncclResult_t::ncclSuccess {
                return started;
            }
            let mut first_error = nccl::ncclResult_t::ncclSuccess;
            for peer in 0..send_counts.len() {
                // Empty parts are skipped on both sides alike (the counts pair up).
                let mut results = Vec::with_capacity(2);
                if send_counts[peer] > 0 {
                    let from = (send as *const u8).add(send_at[peer] * element) as *const c_void;
                    results.push(nccl::ncclSend(from, send_counts[peer], dtype, peer as c_int, comm, stream));
                }
                if recv_counts[peer] > 0 {
                    let into = (recv as *mut u8).add(recv_at[peer] * element) as *mut c_void;
                    results.push(nccl::ncclRecv(into, recv_counts[peer], dtype, peer as c_int, comm, stream));
                }
                for result in results {
                    let failed = !matches!(result, nccl::ncclResult_t::ncclSuccess | nccl::ncclResult_t::ncclInProgress);
                    if failed && first_error == nccl::ncclResult_t::ncclSuccess {
                        first_error = result;
                    }
                }
            }
            let ended = nccl::ncclGroupEnd();
            if first_error == nccl::ncclResult_t::ncclSuccess { ended } else { first_error }
        })
    }

    fn all_reduce(&self, tensor: CudaTensor, op: ReduceOp) -> Result<CudaTensor, CommError> {
        self.traffic.record_all_reduce((tensor.shape().num_elements() * tensor.dtype.size()) as u64);
        let (reduce, divide) = reduce_op(op, tensor.dtype);
        let shape = tensor.shape();
        let reduced = self.tensor_collective("all_reduce", tensor, shape, |send, recv, count, dtype, comm, stream| unsafe {
            nccl::ncclAllReduce(send, recv, count, dtype, reduce, comm, stream)
        })?;
        Ok(self.divided_if::<F, I, BT>(reduced, divide))
    }

    fn reduce_scatter(&self, tensor: CudaTensor, op: ReduceOp) -> Result<CudaTensor, CommError> {
        let size = self.size;
        check_reduce_scatter(&tensor.shape().to_vec(), size).map_err(|e| self.refuse(e))?;
        self.traffic.record_reduce_scatter((tensor.shape().num_elements() * tensor.dtype.size()) as u64);
        let (reduce, divide) = reduce_op(op, tensor.dtype);
        let part = tensor.shape().num_elements() / size;
        // NCCL counts a reduce-scatter's elements per rank (what each receives).
        let reduced = self.tensor_collective("reduce_scatter", tensor, Shape::new([part]), |send, recv, _, dtype, comm, stream| unsafe {
            nccl::ncclReduceScatter(send, recv, part, dtype, reduce, comm, stream)
        })?;
        Ok(self.divided_if::<F, I, BT>(reduced, divide))
    }

    fn all_gather(&self, tensor: CudaTensor) -> Result<CudaTensor, CommError> {
        self.traffic.record_all_gather((tensor.shape().num_elements() * tensor.dtype.size()) as u64);
        let mut shape = tensor.shape();
        shape.insert(0, self.size);
        self.tensor_collective("all_gather", tensor, shape, |send, recv, count, dtype, comm, stream| unsafe {
            nccl::ncclAllGather(send, recv, count, dtype, comm, stream)
        })
    }

    fn broadcast(&self, tensor: CudaTensor, root: usize) -> Result<CudaTensor, CommError> {
        // Refused here: NCCL would fail it as an invalid argument, and the communicator with it.
        burn_ulysses::comm::check_broadcast_root(root, self.size).map_err(|e| self.refuse(e))?;
        if self.rank == root {
            self.traffic.record_broadcast((tensor.shape().num_elements() * tensor.dtype.size()) as u64);
        }
        let shape = tensor.shape();
        self.tensor_collective("broadcast", tensor, shape, |send, recv, count, dtype, comm, stream| unsafe {
            nccl::ncclBroadcast(send, recv, count, dtype, root as c_int, comm, stream)
        })
    }

    fn send_recv(&self, tensor: CudaTensor, to: usize, from: usize) -> Result<CudaTensor, CommError> {
        burn_ulysses::comm::check_send_recv(self.rank, self.size, to, from).map_err(|e| self.refuse(e))?;
        let shape = tensor.shape();
        let bytes = (shape.num_elements() * tensor.dtype.size()) as u64;
        self.traffic.record_send_recv(bytes, to != self.rank);
        if to == self.rank {
            return Ok(tensor);
        }
        // Grouped, so that every rank's send and receive progress together (a ring of blocking
        // sends would deadlock). The shapes must agree: NCCL cannot check them.
        self.tensor_collective("send_recv", tensor, shape, |send, recv, count, dtype, comm, stream| unsafe {
            let started = nccl::ncclGroupStart();
            if started != nccl::ncclResult_t::ncclSuccess {
                return started;
            }
            let sent = nccl::ncclSend(send, count, dtype, to as c_int, comm, stream);
            let received = nccl::ncclRecv(recv, count, dtype, from as c_int, comm, stream);
            let ended = nccl::ncclGroupEnd();
            [sent, received]
                .into_iter()
                .find(|result| !matches!(result, nccl::ncclResult_t::ncclSuccess | nccl::ncclResult_t::ncclInProgress))
                .unwrap_or(ended)
        })
    }

    fn barrier(&self) -> Result<(), CommError> {
        Communicator::<CubeBackend<CudaRuntime, F, I, BT>>::all_gather_host(self, &[]).map(|_| ())
    }

    fn all_gather_host(&self, values: &[u64]) -> Result<Vec<Vec<u64>>, CommError> {
        // Lengths first, so that ranks sending different numbers still run matching
        // collectives; then the values, padded to the longest.
        let lengths = self.gather_u64(&[values.len() as u64]).map_err(to_comm_error)?;
        let longest = lengths.iter().copied().max().unwrap_or(0) as usize;
        let mut padded = values.to_vec();
        padded.resize(longest, 0);
        let gathered = self.gather_u64(&padded).map_err(to_comm_error)?;
        Ok(lengths
            .iter()
            .enumerate()
            .map(|(rank, &len)| gathered[rank * longest..rank * longest + len as usize].to_vec())
            .collect())
    }

    fn split(&self, color: u32, key: u32) -> Result<Arc<dyn Communicator<CubeBackend<CudaRuntime, F, I, BT>>>, CommError> {
        Ok(self.split_group(color, key)?)
    }

    fn traffic(&self) -> Traffic {
        self.traffic.snapshot()
    }
}

impl NcclCommunicator {
    /// All-gathers `values.len()` u64 per rank through a device buffer.
    fn gather_u64(&self, values: &[u64]) -> Result<Vec<u64>, NcclError> {
        let count = values.len().max(1);
        let client = self.client();
        let bytes: Vec<u8> = values.iter().chain(std::iter::repeat(&0)).take(count).flat_map(|v| v.to_le_bytes()).collect();
        let input = client.create_from_slice(&bytes);
        let output = client.empty(count * 8 * self.size);
        // Refused as every rank's refusal is (aborted): its peers may be in the gather already.
        let refused = |e| self.refuse(NcclError::Cuda(format!("all_gather_host: {e:?}")));
        let input_resource = client.get_resource(input.clone()).map_err(refused)?;
        let output_resource = client.get_resource(output.clone()).map_err(refused)?;
        let (send, recv) = (input_resource.resource().ptr, output_resource.resource().ptr);
        let done = self.collective("all_gather_host", &client, |comm, stream| unsafe {
            nccl::ncclAllGather(send as *const c_void, recv as *mut c_void, count, nccl::ncclDataType_t::ncclUint64, comm, stream)
        });
        if let Err(error) = done {
            self.release_after_failure((input_resource, output_resource, input, output));
            return Err(error);
        }
        drop((input_resource, output_resource));
        let bytes = client.read_one(output).map_err(|e| NcclError::Cuda(format!("{e:?}")))?;
        let all: Vec<u64> = bytes.chunks_exact(8).map(|b| u64::from_le_bytes(b.try_into().unwrap())).collect();
        // Drop the padding of empty inputs.
        Ok(if values.is_empty() { Vec::new() } else { all })
    }
}

impl NcclCommunicator {
    /// [`Communicator::split`] through `ncclCommSplit`, returning the concrete type.
    pub fn split_group(&self, color: u32, key: u32) -> Result<Arc<Self>, CommError> {
        if color > i32::MAX as u32 || key > i32::MAX as u32 {
            // Aborted as every refusal is: the other ranks may be in ncclCommSplit already,
            // and NCCL pairs collectives by their order alone.
            return Err(self.refuse(CommError::InvalidArgument {
                op: burn_ulysses::comm::Collective::Split,
                reason: format!("color {color} and key {key} must fit in an i32 (NCCL's NOCOLOR is -1)"),
            }));
        }
        let mut child = {
            let _exclusive = self.process.calls.lock().unwrap_or_else(|p| p.into_inner());
            self.check_usable("ncclCommSplit").map_err(to_comm_error)?;
            self.current_context().map_err(to_comm_error)?;
            let mut child: nccl::ncclComm_t = ptr::null_mut();
            let mut config = non_blocking_config();
            // SAFETY: live parent communicator, valid out-pointer and config.
            let started = unsafe { nccl::ncclCommSplit(self.comm.0, color as c_int, key as c_int, &mut child, &mut config) };
            self.accept(started, "ncclCommSplit").map_err(to_comm_error)?;
            // One deadline for the parent's wait and the child's (the timeout, not twice it).
            let mut checks = self.wait_checks();
            if let Err(error) = self.wait_ready_within("ncclCommSplit", &mut checks) {
                // The parent is aborted; so is the child it began, not left behind.
                if !child.is_null() {
                    // SAFETY: a communicator ncclCommSplit made, used by nothing yet.
                    unsafe { nccl::ncclCommAbort(child) };
                }
                return Err(to_comm_error(error));
            }
            // The child has its own abort flag: a failure while it gets ready aborts it alone.
            // Until it knows its members it watches its parent's.
            let mut child = Self::wrap(child, 0, 0, self.members.clone(), self.process.clone());
            child.wait_ready_within("ncclCommSplit", &mut checks).map_err(to_comm_error)?;
            let (mut rank, mut size) = (0 as c_int, 0 as c_int);
            // SAFETY: `child` is a ready communicator; valid out-pointers.
            let (ranked, counted) = unsafe { (nccl::ncclCommUserRank(child.comm.0, &mut rank), nccl::ncclCommCount(child.comm.0, &mut size)) };
            child.accept(ranked, "ncclCommUserRank").and_then(|()| child.accept(counted, "ncclCommCount")).map_err(to_comm_error)?;
            child.rank = rank as usize;
            child.size = size as usize;
            child
        };
        // Its members' world ranks (a collective, so outside the lock above): a wait on it
        // then gives up on a member that left the job, not on a rank of another group.
        let world_rank = self.process.rendezvous.rank() as u64;
        let members = child.gather_u64(&[world_rank]).map_err(to_comm_error)?;
        child.members = members.into_iter().map(|rank| rank as usize).collect();
        Ok(Arc::new(child))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mean_in_half_precision_is_a_sum_divided_once() {
        // ncclAvg scales each input by 1/size rounded to the dtype first: only f32 and f64 take it.
        for dtype in [DType::F16, DType::BF16] {
            assert_eq!(reduce_op(ReduceOp::Mean, dtype), (nccl::ncclRedOp_t::ncclSum, true), "{dtype:?}");
        }
        for dtype in [DType::F32, DType::F64, DType::Flex32] {
            assert_eq!(reduce_op(ReduceOp::Mean, dtype), (nccl::ncclRedOp_t::ncclAvg, false), "{dtype:?}");
        }
        assert_eq!(reduce_op(ReduceOp::Sum, DType::BF16), (nccl::ncclRedOp_t::ncclSum, false));
        assert_eq!(reduce_op(ReduceOp::Max, DType::F16), (nccl::ncclRedOp_t::ncclMax, false));
        // burn's flex32 is f32 in memory.
        assert_eq!(data_type(DType::Flex32).unwrap(), nccl::ncclDataType_t::ncclFloat32);
    }
}
