//! Checks the TCP transport of a launched job: every collective against the values it must
//! produce, then the bandwidth of an all-to-all. Run it under the launcher you train with:
//!
//! ulysses-launch --nproc-per-node 4 -- ulysses-tcp-check
//! srun -N 2 --ntasks-per-node 4 ulysses-tcp-check   (with ULYSSES_RENDEZVOUS_TOKEN exported)
//!
//! Exits non-zero on the first mismatch, or when a rank dies (naming it).

use std::{process::ExitCode, time::Instant};

use burn::tensor::{Tensor, TensorData};
use burn_ndarray::NdArray;
use burn_ulysses::comm::{
    Communicator, HostStaged,
    check::{CheckSizes, check_collectives},
};
use clap::Parser;
use ulysses_dist::{DistributedConfig, LaunchEnv, tcp::TcpCommunicator};

type B = NdArray<f32>;

#[derive(Parser, Debug)]
#[command(about = "Check the TCP transport of a launched burn-ulysses job")]
struct Args {
    /// MiB each rank sends in the timed all-to-all.
    #[arg(long, default_value_t = 64)]
    mib: usize,
    /// Test hook: this rank kills itself (SIGKILL) once connected; the others must name it.
    #[arg(long, hide = true)]
    die_rank: Option<usize>,
    /// Test hook, with --die-rank: that rank passes the check, then kills itself where it
    /// would enter this collective, which the others are in (ZeRO-3's two).
    #[arg(long, hide = true, requires = "die_rank")]
    die_in: Option<Collective>,
    /// Test hook: this rank passes the check, then ends (its goodbye said) while the others,
    /// a second later, all-gather --mib MiB each: their sends to it fail, and they must name it.
    #[arg(long, hide = true, conflicts_with = "die_rank")]
    leave_rank: Option<usize>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum Collective {
    AllGather,
    ReduceScatter,
}

/// SIGKILL to this process; nothing after it runs.
fn die(rank: usize, at: &str) {
    eprintln!("test hook: rank {rank} kills itself {at}");
    // SAFETY: kill(2) on our own pid.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
}

fn check(args: &Args) -> Result<(), String> {
    let env = LaunchEnv::from_env().map_err(|e| e.to_string())?;
    let config = DistributedConfig::new().with_env_overrides().map_err(|e| e.to_string())?;
    let comm = HostStaged::new(TcpCommunicator::connect(&env, &config).map_err(|e| e.to_string())?);
    if args.die_rank == Some(env.rank) && args.die_in.is_none() {
        die(env.rank, "once connected");
    }
    let device = Default::default();
    for line in check_collectives::<B>(&*comm, &device, CheckSizes::default())? {
        println!("{line}");
    }
    let c: &dyn Communicator<B> = &*comm;
    let p = c.size();
    if let Some(leaving) = args.leave_rank {
        if leaving == env.rank {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_secs(1));
        let values = Tensor::<B, 1>::from_data(TensorData::new(vec![1.0f32; args.mib << 18], [args.mib << 18]), &device).into_primitive().tensor();
        drop(c.all_gather(values).map_err(|e| e.to_string())?);
        return Err(format!("the all-gather finished although rank {leaving} had left"));
    }
    if let Some(collective) = args.die_in {
        let values = Tensor::<B, 1>::from_data(TensorData::new(vec![1.0f32; 1 << 16], [1 << 16]), &device).into_primitive().tensor();
        if args.die_rank == Some(env.rank) {
            die(env.rank, &format!("instead of entering {collective:?}"));
        }
        match collective {
            Collective::AllGather => drop(c.all_gather(values).map_err(|e| e.to_string())?),
            Collective::ReduceScatter => drop(c.reduce_scatter(values, burn_ulysses::comm::ReduceOp::Sum).map_err(|e| e.to_string())?),
        }
        return Err(format!("{collective:?} finished although rank {:?} died before entering it", args.die_rank));
    }
    let elements = (args.mib << 20) / 4 / p * p;
    let mut seconds = Vec::new();
    for _ in 0..5 {
        // A tensor of its own each time, as a layer's output is (a shared one is copied
        // element by element when read).
        let send = Tensor::<B, 2>::from_data(TensorData::new(vec![0.5f32; elements], [p, elements / p]), &device);
        c.barrier().map_err(|e| e.to_string())?;
        let started = Instant::now();
        drop(c.all_to_all(send.into_primitive().tensor()).map_err(|e| e.to_string())?);
        seconds.push(started.elapsed().as_secs_f64());
    }
    seconds.sort_by(f64::total_cmp);
    let median = seconds[seconds.len() / 2];
    let remote = (elements * 4) as f64 * (p - 1) as f64 / p as f64;
    println!("all_to_all of {} MiB per rank: median {:.1} ms, {:.2} GB/s sent per rank", args.mib, median * 1e3, remote / median / 1e9);
    Ok(())
}

fn main() -> ExitCode {
    ulysses_dist::logging::init("warn");
    match check(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}
