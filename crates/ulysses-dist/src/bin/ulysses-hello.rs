//! A launch smoke test: every rank joins the rendezvous, receives a job id from rank 0 and
//! meets the others at a barrier. Run it under the launcher you will train with:
//!
//! ulysses-launch --nproc-per-node 4 -- ulysses-hello
//! srun -N 2 --ntasks-per-node 4 ulysses-hello   (with ULYSSES_RENDEZVOUS_TOKEN exported)

use std::process::ExitCode;

use ulysses_dist::{DistError, DistributedConfig, LaunchEnv, Rendezvous, rendezvous::new_token};

fn hello() -> Result<(), DistError> {
    let env = LaunchEnv::from_env()?;
    let config = DistributedConfig::new().with_env_overrides()?;
    let rendezvous = Rendezvous::join(&env, &config)?;
    let id = (env.rank == 0).then(new_token);
    let id = rendezvous.broadcast("hello/job-id", id.as_deref().map(str::as_bytes), 0)?;
    println!(
        "rank {}/{} (local {}/{}) joined {}:{}; job id {}",
        env.rank,
        env.world_size,
        env.local_rank,
        env.local_world_size,
        env.master_addr,
        env.master_port,
        String::from_utf8_lossy(&id)
    );
    rendezvous.barrier("hello/done")
}

fn main() -> ExitCode {
    ulysses_dist::logging::init("warn");
    match hello() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}
