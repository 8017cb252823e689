//! Launching burn-ulysses jobs over many processes and nodes, and the transport between their
//! host memories, for every Burn version (no Burn here: the burn 0.21 decorator's
//! `burn_ulysses::job` and the burn 0.22 crate's `burn_ulysses_ops::job` start their ranks
//! with it, and the NCCL communicator meets its peers through its rendezvous):
//!
//! - [`env`]: where this process sits (torchrun's and Slurm's variables);
//! - [`config`]: timeouts, limits and the job token, overridable from the environment;
//! - [`rendezvous`]: rank 0 serves a small key-value store over TCP (like torch's TCPStore)
//!   through which the ranks exchange addresses and the NCCL unique id; peers must present the
//!   job's token;
//! - [`tcp`]: collectives between processes over TCP on host tensors (CPUs, tests), with dead
//!   ranks named;
//! - [`launch`]: the `ulysses-launch` launcher, which starts a node's ranks, prefixes their
//!   output and fails the job when one rank fails;
//! - [`logging`]: the programs' log setup;
//! - [`error`]: why launching or joining failed, naming the fix.
//!
//! None of this needs a GPU.

pub mod config;
pub mod env;
pub mod error;
pub mod launch;
pub mod logging;
pub mod rendezvous;
pub mod tcp;

pub use config::DistributedConfig;
pub use env::{Launch, LaunchEnv};
pub use error::{DistError, first_cause};
pub use rendezvous::Rendezvous;
