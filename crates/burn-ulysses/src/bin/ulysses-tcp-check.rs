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
}

fn check(args: &Args) -> Result<(), String> {
    let env = LaunchEnv::from_env().map_err(|e| e.to_string())?;
    let config = DistributedConfig::new().with_env_overrides().map_err(|e| e.to_string())?;
    let comm = HostStaged::new(TcpCommunicator::connect(&env, &config).map_err(|e| e.to_string())?);
    if args.die_rank == Some(env.rank) {
        eprintln!("test hook: rank {} kills itself", env.rank);
        // SAFETY: kill(2) on our own pid; nothing after it runs.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    let device = Default::default();
    for line in check_collectives::<B>(&*comm, &device, CheckSizes::default())? {
        println!("{line}");
    }
    let c: &dyn Communicator<B> = &*comm;
    let p = c.size();
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
