//! Checks NCCL on GPUs: every collective against the values it must produce, sequence-parallel
//! attention against the same attention on one device, and the time of an all-to-all at a
//! realistic size (64K tokens × 4096 hidden, bf16) with its host synchronisations.
//!
//! ulysses-launch --nproc-per-node 2 -- ulysses-nccl-check
//!
//! Two ranks on one GPU (NCCL refuses two ranks of a communicator on one GPU unless each
//! believes it is on another host):
//! ULYSSES_GPU=0 ulysses-launch --nproc-per-node 2 -- sh -c 'NCCL_HOSTID=host$RANK exec ulysses-nccl-check'
//!
//! Exits non-zero on the first mismatch.
//!
//! With `ULYSSES_NCCL_CHECK_LEAVE=R` (two ranks or more), it checks instead that a rank ending
//! its process while the others wait for it in a collective stops them, naming it, within
//! `PeerWatch::GRACE` and a few seconds: rank R exits (cleanly, so that the launcher keeps the
//! others running, as srun does without --kill-on-bad-exit) without the all-reduce the others
//! enter; they pass when the all-reduce fails so. Run it with `NCCL_RUNTIME_CONNECT=1` (NCCL
//! 2.22's default): the connections are then made at the first collective, which waits for
//! the rank that left as a collective on NVLink or shared memory waits for a member gone
//! (over sockets NCCL would notice a closed connection itself).

use std::{process::ExitCode, sync::Arc, time::Instant};

use burn::{
    backend::Autodiff,
    tensor::{DType, Tensor, TensorData, module::attention, ops::AttentionModuleOptions},
};
use burn_cubecl::CubeBackend;
use burn_ulysses::{
    RankScope, UlyssesBackend, UlyssesConfig,
    comm::{
        Communicator,
        check::{CheckSizes, check_collectives},
    },
    compare::check_within,
    context::enter_single_device,
};
use cubecl::cuda::{CudaDevice, CudaRuntime};
use ulysses_dist::{DistributedConfig, LaunchEnv};
use ulysses_nccl::NcclCommunicator;

type Cuda = CubeBackend<CudaRuntime, f32, i32, u8>;
type Train = UlyssesBackend<Autodiff<Cuda>>;

fn check(name: &str, got: &[f32], want: &[f32], tolerance: f32) -> Result<(), String> {
    println!("{}", check_within(name, got, want, tolerance)?);
    Ok(())
}

/// Every collective against the values it must produce (the check every transport runs).
fn collectives(comm: &Arc<NcclCommunicator>, device: &CudaDevice) -> Result<(), String> {
    let lines = check_collectives::<Cuda>(&**comm, device, CheckSizes::default())?;
    lines.iter().for_each(|line| println!("{line}"));
    Ok(())
}

/// SP attention (causal, GQA) with its gradients against one device, on this rank.
fn sequence_parallel_attention(comm: &Arc<NcclCommunicator>, device: &CudaDevice) -> Result<(), String> {
    let (r, p) = (Communicator::<Cuda>::rank(&**comm), Communicator::<Cuda>::size(&**comm));
    let options = AttentionModuleOptions { scale: None, softcap: None, is_causal: true };
    let (h, kv, s, d) = (8, 2, 256 * p, 64);
    let input = |stream: u64, heads: usize| {
        let n = heads * s * d;
        let values: Vec<f32> = (0..n as u64).map(|i| ((i * 2654435761 + stream * 97) % 1000) as f32 / 1000.0 - 0.5).collect();
        Tensor::<Train, 4>::from_data(TensorData::new(values, [1, heads, s, d]), device)
    };
    // Output and gradients of q, k, v, on this rank's shard or on the whole sequence.
    let run = |shard: bool| -> Vec<Vec<f32>> {
        let take = |t: Tensor<Train, 4>| if shard { t.narrow(2, r * s / p, s / p) } else { t };
        let (q, k, v) = (take(input(1, h)).require_grad(), take(input(2, kv)).require_grad(), take(input(3, kv)).require_grad());
        let output = attention(q.clone(), k.clone(), v.clone(), None, None, options);
        let grads = (output.clone() * take(input(4, h))).sum().backward();
        let values = |t: Tensor<UlyssesBackend<Cuda>, 4>| t.into_data().convert::<f32>().to_vec::<f32>().unwrap();
        vec![
            output.into_data().convert::<f32>().to_vec().unwrap(),
            values(q.grad(&grads).unwrap()),
            values(k.grad(&grads).unwrap()),
            values(v.grad(&grads).unwrap()),
        ]
    };
    let sharded = run(true);
    let whole = {
        let _one_device = enter_single_device();
        run(false)
    };
    let rows = s / p;
    let slice = |values: &[f32], heads: usize| -> Vec<f32> {
        (0..heads).flat_map(|head| values[(head * s + r * rows) * d..(head * s + (r + 1) * rows) * d].to_vec()).collect()
    };
    for (i, (name, heads)) in [("output", h), ("dq", h), ("dk", kv), ("dv", kv)].into_iter().enumerate() {
        check(&format!("SP attention {name}"), &sharded[i], &slice(&whole[i], heads), 1e-4)?;
    }
    Ok(())
}

/// Time of an all-to-all of 64K tokens × 4096 hidden (bf16) spread over the ranks.
fn all_to_all_timing(comm: &Arc<NcclCommunicator>, device: &CudaDevice) -> Result<(), String> {
    let c: &dyn Communicator<Cuda> = &**comm;
    let p = c.size();
    let elements = 65536 * 4096 / p;
    let data = TensorData::new(vec![0.5f32; elements], [p, elements / p]).convert_dtype(DType::BF16);
    // The dtype named: `from_data` with a device alone makes the backend's default (f32).
    let send = Tensor::<Cuda, 2>::from_data(data, (device, DType::BF16)).into_primitive().tensor();
    if send.dtype != DType::BF16 {
        return Err(format!("the all-to-all timing must exchange bf16, got {:?}", send.dtype));
    }
    let mut samples = Vec::new();
    for _ in 0..10 {
        let started = Instant::now();
        let out = c.all_to_all(send.clone()).map_err(|e| e.to_string())?;
        drop(out);
        samples.push(started.elapsed().as_secs_f64());
    }
    samples.sort_by(f64::total_cmp);
    let median = samples[samples.len() / 2];
    let bytes = (elements * DType::BF16.size()) as f64;
    println!(
        "all_to_all of {:.0} MiB per rank (64K tokens x 4096 bf16 / {p}): median {:.3} ms, {:.1} GB/s, host sync {:.3} ms per call",
        bytes / 1048576.0,
        median * 1e3,
        bytes / median / 1e9,
        comm.host_sync_seconds_per_collective() * 1e3
    );
    Ok(())
}

/// The all-reduce that rank `leaver` never joins: the others must give up on it, naming it.
fn a_rank_that_leaves(comm: &Arc<NcclCommunicator>, device: &CudaDevice, leaver: usize) -> Result<(), String> {
    let c: &dyn Communicator<Cuda> = &**comm;
    if c.size() < 2 || leaver >= c.size() {
        return Err(format!("ULYSSES_NCCL_CHECK_LEAVE={leaver} needs two ranks or more and names one of them; this job has {}", c.size()));
    }
    if c.rank() == leaver {
        println!("rank {leaver} ends its process without the all-reduce the others wait in");
        return Ok(());
    }
    let ones = Tensor::<Cuda, 1>::ones([1024], device);
    // Made (its kernel compiled) before the clock starts.
    ones.clone().into_data();
    let started = Instant::now();
    let result = c.all_reduce(ones.into_primitive().tensor(), burn_ulysses::comm::ReduceOp::Sum);
    let waited = started.elapsed();
    // The grace, the rendezvous asked once a second, and the abort.
    let limit = ulysses_dist::rendezvous::PeerWatch::GRACE + std::time::Duration::from_secs(8);
    match result {
        Ok(_) => Err(format!("the all-reduce ended without rank {leaver}")),
        Err(error) if error.to_string().contains(&format!("rank(s) [{leaver}] of its group ended their process")) && waited <= limit => {
            println!("stopped after {waited:.1?}, as it should (at most {limit:?}): {error}");
            Ok(())
        }
        Err(error) => Err(format!("after {waited:.1?} (at most {limit:?} expected), the all-reduce failed otherwise: {error}")),
    }
}

fn main() -> ExitCode {
    let run = || -> Result<(), String> {
        let env = LaunchEnv::from_env().map_err(|e| e.to_string())?;
        let config = DistributedConfig::new().with_env_overrides().map_err(|e| e.to_string())?;
        let comm = NcclCommunicator::join(&env, &config, ulysses_nccl::gpu_of(&env).map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
        // The communicator's GPU (ULYSSES_GPU may put several ranks on one): tensors must
        // live where NCCL reads them.
        let device = comm.device();
        let _sp = Train::enter(RankScope::Process, comm.clone(), UlyssesConfig::new());
        if let Ok(leaver) = std::env::var("ULYSSES_NCCL_CHECK_LEAVE") {
            let leaver = leaver.parse().map_err(|_| format!("ULYSSES_NCCL_CHECK_LEAVE={leaver:?} is no rank"))?;
            return a_rank_that_leaves(&comm, &device, leaver);
        }
        collectives(&comm, &device)?;
        sequence_parallel_attention(&comm, &device)?;
        all_to_all_timing(&comm, &device)
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("FAILED: {message}");
            ExitCode::FAILURE
        }
    }
}
