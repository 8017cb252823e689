//! A CubeCL runtime that compiles and never runs: it reports the device properties of a chosen
//! NVIDIA GPU (what cubecl-cuda's own runtime would read from the driver), hands out host
//! memory for buffers, and on every launch compiles the kernel with cubecl-cuda's compiler
//! (CubeCL IR → CUDA C++) and records the source, its dynamic shared memory and its block.
//! The kernels' planner and launch code run unchanged on it, so the sources are exactly those
//! a launch on that GPU would compile with NVRTC.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use cubecl::{
    Runtime,
    client::ComputeClient,
    device::{Device, DeviceId, DeviceService, ServerUtilitiesHandle},
    bytes::Bytes,
    future::DynFut,
    stream_id::StreamId,
    ir::{ContiguousElements, DeviceProperties, HardwareProperties, MatrixLayout, MemoryDeviceProperties, MmaProperties, TargetProperties, VectorSize},
    profile::ProfileDuration,
    server::{
        Binding, ComputeServer, CopyDescriptor, CubeCount, ExecutionMode, KernelArguments, ProfileError, ProfilingToken, ServerCommunication, ServerError,
        ServerUtilities,
    },
    zspace::{Shape, Strides, striding::has_pitched_row_major_strides},
};
use cubecl_cpp::{
    cuda::{
        CudaDialect,
        mma::{CudaWmmaCompiler, contiguous_elements_cuda},
    },
    shared::{CompilationOptions, CppCompiler, CppSupportedFeatures},
};
use cubecl_runtime::{
    allocator::PitchedMemoryLayoutPolicy,
    compiler::CubeTask,
    id::KernelId,
    logging::ServerLogger,
    memory_management::{ManagedMemoryHandle, MemoryAllocationMode, MemoryConfiguration, MemoryManagement, MemoryManagementOptions, MemoryUsage},
    storage::{BytesResource, BytesStorage, ComputeStorage, ManagedResource},
    timestamp_profiler::TimestampProfiler,
};

/// cubecl-cuda's compiler (`cubecl_cuda::CudaCompiler`), built from its parts.
pub type CudaCompiler = CppCompiler<CudaDialect<CudaWmmaCompiler>>;

/// A GPU the kernels are compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Target {
    /// As NVRTC and ptxas name it: `sm_90a`, `sm_80`, `sm_89`.
    pub name: &'static str,
    pub gpu: &'static str,
    /// Compute capability × 10.
    pub arch: u32,
    /// Shared memory a block may opt into (`MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`), bytes.
    pub max_shared_per_block: usize,
    /// Shared memory of one SM, bytes (what blocks per SM divide).
    pub shared_per_sm: usize,
    pub registers_per_sm: usize,
    pub max_threads_per_sm: usize,
    pub max_blocks_per_sm: usize,
    pub sms: u32,
}

/// H100 (sm_90a), A100 (sm_80) and L40 / RTX 4090 (sm_89), from NVIDIA's tuning guides.
pub const TARGETS: [Target; 3] = [
    Target {
        name: "sm_90a",
        gpu: "H100",
        arch: 90,
        max_shared_per_block: 232_448,
        shared_per_sm: 233_472,
        registers_per_sm: 65_536,
        max_threads_per_sm: 2048,
        max_blocks_per_sm: 32,
        sms: 132,
    },
    Target {
        name: "sm_80",
        gpu: "A100",
        arch: 80,
        max_shared_per_block: 166_912,
        shared_per_sm: 167_936,
        registers_per_sm: 65_536,
        max_threads_per_sm: 2048,
        max_blocks_per_sm: 32,
        sms: 108,
    },
    Target {
        name: "sm_89",
        gpu: "L40 / RTX 4090",
        arch: 89,
        max_shared_per_block: 101_376,
        shared_per_sm: 102_400,
        registers_per_sm: 65_536,
        max_threads_per_sm: 1536,
        max_blocks_per_sm: 24,
        sms: 142,
    },
];

/// One kernel as a launch compiled it.
#[derive(Debug, Clone)]
pub struct CompiledSource {
    pub target: &'static str,
    /// The C++ entry point.
    pub entrypoint: String,
    pub source: String,
    /// Dynamic shared memory of a block, bytes (CubeCL declares it `extern __shared__`).
    pub dynamic_shared_bytes: usize,
    pub block: (u32, u32, u32),
}

/// What launches compiled, or failed to, since [`take_compiled`] was last called: each kernel
/// once, however often launched (a training run launches thousands a step).
static COMPILED: Mutex<Vec<Result<Arc<CompiledSource>, String>>> = Mutex::new(Vec::new());

/// The sources compiled so far (and compile errors), emptying the record.
pub fn take_compiled() -> Vec<Result<Arc<CompiledSource>, String>> {
    std::mem::take(&mut *COMPILED.lock().unwrap_or_else(|p| p.into_inner()))
}

/// Keeps this process's autotune cache in `folder`, emptied first, whatever a `cubecl.toml`
/// says (its other settings kept): choices timed on a runtime that runs nothing must never reach
/// a GPU, and a choice already cached would launch no candidates. Call it before the first
/// client; an error if CubeCL's configuration was read already.
pub fn keep_autotune_apart(folder: &std::path::Path) -> Result<(), String> {
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig, cache::CacheConfig};
    if CubeClRuntimeConfig::storage().lock().is_some() {
        return Err("CubeCL's configuration was read before the compile-only runtime could keep its autotune cache apart".into());
    }
    let _ = std::fs::remove_dir_all(folder);
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    config.autotune.cache = CacheConfig::File(folder.to_path_buf());
    CubeClRuntimeConfig::set(config);
    Ok(())
}

/// The runtime: `CompileOnly::client(&TargetDevice(i))` is a client of [`TARGETS`]`[i]`.
#[derive(Debug, Clone)]
pub struct CompileOnly;

/// [`TARGETS`]`[index]` as a device.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, Default)]
pub struct TargetDevice(pub usize);

impl TargetDevice {
    pub fn target(&self) -> &'static Target {
        &TARGETS[self.0]
    }
}

/// Not CUDA's device type id, so the two never share a server.
const DEVICE_TYPE: u16 = 0x55;

impl Device for TargetDevice {
    fn from_id(device_id: DeviceId) -> Self {
        Self(device_id.index_id as usize)
    }

    fn to_id(&self) -> DeviceId {
        DeviceId { type_id: DEVICE_TYPE, index_id: self.0 as u16 }
    }
}

impl burn_backend::DeviceOps for TargetDevice {}

#[derive(Debug)]
pub struct CompileOnlyServer {
    target: &'static Target,
    options: CompilationOptions,
    memory: MemoryManagement<BytesStorage>,
    utilities: Arc<ServerUtilities<Self>>,
    timestamps: TimestampProfiler,
    /// What each kernel id compiled to, as cubecl-cuda's server keeps its modules: a training
    /// step launches each kernel thousands of times.
    compiled: HashMap<KernelId, Result<Arc<CompiledSource>, String>>,
}

/// The properties and compilation options cubecl-cuda's runtime registers for `target` (its
/// `DeviceService::init`, from `cubecl_cuda::device_properties`), with the values it would read
/// from the driver filled in from the target.
fn properties(target: &Target, memory: MemoryDeviceProperties) -> (DeviceProperties, CompilationOptions) {
    let hardware = HardwareProperties {
        load_width: 128,
        plane_size_min: 32,
        plane_size_max: 32,
        max_bindings: cubecl_cuda::CUDA_MAX_BINDINGS,
        max_shared_memory_size: target.max_shared_per_block,
        max_cube_count: (i32::MAX as u32, u16::MAX as u32, u16::MAX as u32),
        max_units_per_cube: 1024,
        max_cube_dim: (1024, 1024, 64),
        num_streaming_multiprocessors: Some(target.sms),
        num_tensor_cores: cubecl_cuda::tensor_cores_per_sm(target.arch),
        min_tensor_cores_dim: Some(8),
        num_cpu_cores: None,
        max_vector_size: VectorSize::MAX,
    };
    let mut options = CompilationOptions { warp_size: 32, supports_features: CppSupportedFeatures { fast_math: true, ..Default::default() } };
    let properties = cubecl_cuda::device_properties(target.arch, memory, hardware, &mut options);
    (properties, options)
}

impl DeviceService for CompileOnlyServer {
    fn init(device_id: DeviceId) -> Self {
        let target = TargetDevice::from_id(device_id).target();
        // Pages up to 16 GiB: a buffer past 2^32 bf16 elements (64-bit indexing) fits one. The
        // host maps the zeroed pages lazily; nothing runs, so they stay untouched.
        let memory_properties = MemoryDeviceProperties { max_page_size: 1 << 34, alignment: 512 };
        let logger = Arc::new(ServerLogger::default());
        let memory = MemoryManagement::from_configuration(
            BytesStorage::default(),
            &memory_properties,
            MemoryConfiguration::default(),
            logger.clone(),
            MemoryManagementOptions::new("compile-only host memory"),
        );
        let (properties, options) = properties(target, memory_properties.clone());
        // Pitched rows as cubecl-cuda allocates them: strides are part of burn's kernels' sources.
        let utilities = Arc::new(ServerUtilities::new(properties, logger, (), PitchedMemoryLayoutPolicy::new(memory_properties.alignment as usize)));
        Self { target, options, memory, utilities, timestamps: TimestampProfiler::default(), compiled: HashMap::new() }
    }

    fn utilities(&self) -> ServerUtilitiesHandle {
        ComputeServer::utilities(self) as ServerUtilitiesHandle
    }
}

/// A tensor's rows in a pitched buffer (cubecl-cuda's layout: the innermost dimension dense, each
/// row at a multiple of the pitch): how many, how many bytes each holds, and the pitch.
struct PitchedRows {
    count: usize,
    bytes: usize,
    pitch: usize,
}

impl PitchedRows {
    fn of(descriptor: &CopyDescriptor) -> Self {
        let (shape, strides, elem) = (&descriptor.shape[..], &descriptor.strides[..], descriptor.elem_size);
        let bytes = shape.last().map_or(elem, |&columns| columns * elem);
        let count = shape.iter().rev().skip(1).product();
        let pitch = if shape.len() >= 2 { strides[shape.len() - 2] * elem } else { bytes };
        Self { count, bytes, pitch }
    }
}

impl ServerCommunication for CompileOnlyServer {
    const SERVER_COMM_ENABLED: bool = false;
}

impl ComputeServer for CompileOnlyServer {
    type Kernel = Box<dyn CubeTask<CudaCompiler>>;
    type Storage = BytesStorage;
    type MemoryLayoutPolicy = PitchedMemoryLayoutPolicy;
    type Info = ();

    fn logger(&self) -> Arc<ServerLogger> {
        self.utilities.logger.clone()
    }

    fn utilities(&self) -> Arc<ServerUtilities<Self>> {
        self.utilities.clone()
    }

    fn initialize_memory(&mut self, memory: ManagedMemoryHandle, size: u64, _stream_id: StreamId) {
        let reserved = self.memory.reserve(size).expect("host memory for a compile-only buffer");
        self.memory.bind(reserved, memory, 0).expect("bind a compile-only buffer");
    }

    fn read(&mut self, descriptors: Vec<CopyDescriptor>, _stream_id: StreamId) -> DynFut<Result<Vec<Bytes>, ServerError>> {
        // Nothing ran: what is read is what was written, or zeros; row by row, as cubecl-cuda
        // copies a pitched buffer into a dense one.
        let bytes: Vec<Bytes> = descriptors
            .into_iter()
            .map(|descriptor| {
                let rows = PitchedRows::of(&descriptor);
                let resource = self.memory.get_resource(descriptor.handle.memory.clone(), descriptor.handle.offset_start, descriptor.handle.offset_end);
                let mut dense = vec![0; rows.count * rows.bytes];
                if let Ok(resource) = resource {
                    let buffer = resource.read();
                    for (row, out) in dense.chunks_exact_mut(rows.bytes.max(1)).enumerate() {
                        let start = row * rows.pitch;
                        if let Some(source) = buffer.get(start..start + out.len()) {
                            out.copy_from_slice(source);
                        }
                    }
                }
                Bytes::from_bytes_vec(dense)
            })
            .collect();
        Box::pin(async move { Ok(bytes) })
    }

    fn write(&mut self, descriptors: Vec<(CopyDescriptor, Bytes)>, _stream_id: StreamId) {
        for (descriptor, data) in descriptors {
            let rows = PitchedRows::of(&descriptor);
            let storage = self.memory.get_storage(descriptor.handle.memory).expect("a written buffer exists");
            let mut bytes = self.memory.storage().get(&storage);
            let buffer = bytes.write();
            for (row, source) in data.chunks(rows.bytes.max(1)).enumerate() {
                buffer[row * rows.pitch..row * rows.pitch + source.len()].copy_from_slice(source);
            }
        }
    }

    fn sync(&mut self, _stream_id: StreamId) -> DynFut<Result<(), ServerError>> {
        Box::pin(async { Ok(()) })
    }

    fn get_resource(&mut self, binding: Binding, _stream_id: StreamId) -> Result<ManagedResource<BytesResource>, ServerError> {
        let resource = self.memory.get_resource(binding.memory.clone(), binding.offset_start, binding.offset_end)?;
        Ok(ManagedResource::new(binding.memory, resource))
    }

    /// Records the kernel's source, once until it is taken; a kernel id compiled once.
    unsafe fn launch(&mut self, kernel: Self::Kernel, _count: CubeCount, _bindings: KernelArguments, mode: ExecutionMode, _stream_id: StreamId) {
        let mut id = kernel.id();
        id.mode(mode);
        let (target, options) = (self.target.name, &self.options);
        let compiled = self.compiled.entry(id).or_insert_with(|| {
            kernel
                .compile(&mut CudaCompiler::default(), options, mode, kernel.address_type())
                .map(|compiled| {
                    Arc::new(CompiledSource {
                        target,
                        entrypoint: compiled.entrypoint_name,
                        dynamic_shared_bytes: compiled.repr.as_ref().map(|repr| repr.shared_memory_size()).unwrap_or(0),
                        block: (compiled.cube_dim.x, compiled.cube_dim.y, compiled.cube_dim.z),
                        source: compiled.source,
                    })
                })
                .map_err(|error| format!("{}: {error:?}", kernel.name()))
        });
        let mut record = COMPILED.lock().unwrap_or_else(|p| p.into_inner());
        let recorded = |seen: &Result<Arc<CompiledSource>, String>| match (seen, &*compiled) {
            (Ok(seen), Ok(compiled)) => Arc::ptr_eq(seen, compiled),
            (Err(seen), Err(error)) => seen == error,
            _ => false,
        };
        if !record.iter().any(recorded) {
            record.push(compiled.clone());
        }
    }

    fn flush(&mut self, _stream_id: StreamId) -> Result<(), ServerError> {
        Ok(())
    }

    fn memory_usage(&mut self, _stream_id: StreamId) -> Result<MemoryUsage, ServerError> {
        Ok(self.memory.memory_usage())
    }

    fn memory_cleanup(&mut self, _stream_id: StreamId) {
        self.memory.cleanup(true);
    }

    fn start_profile(&mut self, _stream_id: StreamId) -> Result<ProfilingToken, ServerError> {
        Ok(self.timestamps.start())
    }

    fn end_profile(&mut self, _stream_id: StreamId, token: ProfilingToken) -> Result<ProfileDuration, ProfileError> {
        self.timestamps.stop(token)
    }

    fn allocation_mode(&mut self, mode: MemoryAllocationMode, _stream_id: StreamId) {
        self.memory.mode(mode)
    }
}

impl Runtime for CompileOnly {
    type Compiler = CudaCompiler;
    type Server = CompileOnlyServer;
    type Device = TargetDevice;

    fn client(device: &Self::Device) -> ComputeClient<Self> {
        ComputeClient::load(device)
    }

    /// CUDA's name: the planner treats this runtime exactly as it treats CUDA.
    fn name(_client: &ComputeClient<Self>) -> &'static str {
        "cuda"
    }

    fn require_array_lengths() -> bool {
        true
    }

    fn max_cube_count() -> (u32, u32, u32) {
        (i32::MAX as u32, u16::MAX as u32, u16::MAX as u32)
    }

    fn can_read_tensor(shape: &Shape, strides: &Strides) -> bool {
        has_pitched_row_major_strides(shape, strides)
    }

    fn target_properties() -> TargetProperties {
        TargetProperties {
            mma: MmaProperties {
                register_size_bits: 32,
                const_plane_size: 32,
                register_layout_a: MatrixLayout::RowMajor,
                register_layout_b: MatrixLayout::ColMajor,
                register_layout_acc: MatrixLayout::RowMajor,
                register_duplication_a: 1,
                register_duplication_b: 1,
                register_duplication_acc: 1,
                contiguous_elements: ContiguousElements::new(contiguous_elements_cuda),
            },
        }
    }

    fn enumerate_devices(_type_id: u16, _info: &()) -> Vec<DeviceId> {
        (0..TARGETS.len()).map(|i| TargetDevice(i).to_id()).collect()
    }
}
