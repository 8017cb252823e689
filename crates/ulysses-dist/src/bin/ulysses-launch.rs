//! Starts one node's ranks of a burn-ulysses job, like torchrun.
//!
//! ulysses-launch --nproc-per-node 4 -- ./train --sp 4
//! ULYSSES_RENDEZVOUS_TOKEN=$SECRET ulysses-launch --nproc-per-node 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 -- ./train

use std::{process::ExitCode, time::Duration};

use clap::Parser;
use ulysses_dist::{
    DistError,
    config::ENV_TOKEN,
    env::DEFAULT_MASTER_PORT,
    launch::{DEFAULT_BUSY_LIMIT, EXIT_STOPPED_TO_RESUME, Ended, LaunchPlan, run},
    rendezvous::new_token,
};

#[derive(Parser, Debug)]
#[command(about = "Start one node's ranks of a burn-ulysses job (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set like torchrun)")]
struct Args {
    /// Ranks (processes, usually one per GPU) to start on this node.
    #[arg(long)]
    nproc_per_node: usize,
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This node's index, 0..nnodes.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Address of node 0, where rank 0 serves the rendezvous (the ranks' MASTER_ADDR).
    #[arg(long, env = "MASTER_ADDR", default_value = "127.0.0.1")]
    master_addr: String,
    /// The rendezvous' port on node 0 (the ranks' MASTER_PORT): a free one.
    #[arg(long, env = "MASTER_PORT", default_value_t = DEFAULT_MASTER_PORT, value_parser = clap::value_parser!(u16).range(1..))]
    master_port: u16,
    /// Seconds the other ranks get to exit after one failed, before they are killed.
    #[arg(long, default_value_t = 10.0)]
    kill_grace_secs: f64,
    /// Seconds at most the other ranks may go on, after one failed, with work that must not be
    /// cut short (a checkpoint's write) before they are stopped.
    #[arg(long, default_value_t = DEFAULT_BUSY_LIMIT.as_secs_f64())]
    busy_limit_secs: f64,
    /// The program and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let token = match (std::env::var(ENV_TOKEN).ok().filter(|t| !t.is_empty()), args.nnodes) {
        // On one node every rank is this launch's: a token of its own, so that a second
        // launch at the same port (an exported token, the default port) is refused, not joined.
        (_, 1) => new_token(),
        (Some(token), _) => token,
        (None, _) => {
            eprintln!(
                "ulysses-launch: with several nodes every node must pass the same token: export \
                 {ENV_TOKEN}=<secret> on each node (e.g. $(openssl rand -hex 16), shared through \
                 your job script)"
            );
            return ExitCode::FAILURE;
        }
    };
    // Duration::from_secs_f64 panics past its range; NaN would be no grace at all.
    for (flag, seconds) in [("--kill-grace-secs", args.kill_grace_secs), ("--busy-limit-secs", args.busy_limit_secs)] {
        if !(0.0..=ulysses_dist::config::MAX_TIMEOUT_SECS).contains(&seconds) {
            eprintln!("ulysses-launch: {flag} {seconds} must be from 0 to {:e} seconds", ulysses_dist::config::MAX_TIMEOUT_SECS);
            return ExitCode::FAILURE;
        }
    }
    let mut command = args.command.into_iter();
    let plan = LaunchPlan {
        nproc_per_node: args.nproc_per_node,
        nnodes: args.nnodes,
        node_rank: args.node_rank,
        master_addr: args.master_addr,
        master_port: args.master_port,
        token,
        program: command.next().unwrap_or_default(),
        args: command.collect(),
        kill_grace: Duration::from_secs_f64(args.kill_grace_secs),
        busy_limit: Duration::from_secs_f64(args.busy_limit_secs),
    };
    match run(&plan) {
        Ok(Ended::Finished) => ExitCode::SUCCESS,
        Ok(Ended::StoppedToResume) => {
            eprintln!("ulysses-launch: the ranks stopped early on a signal, with a checkpoint; exiting {EXIT_STOPPED_TO_RESUME} (continue with --resume)");
            ExitCode::from(EXIT_STOPPED_TO_RESUME as u8)
        }
        Err(error) => {
            eprintln!("{error}");
            match error {
                // The failed rank's own status, so that the cause (137: the OOM killer) shows.
                DistError::RankFailed { exit_code, .. } => ExitCode::from(exit_code),
                // 128 + the signal, as a shell reports a command it ended (130 for Ctrl-C).
                DistError::Interrupted { signal, .. } => ExitCode::from(u8::try_from(128 + signal).unwrap_or(1)),
                _ => ExitCode::FAILURE,
            }
        }
    }
}
