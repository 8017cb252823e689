//! Launching burn-ulysses jobs over many processes and nodes.
//!
//! - [`env`]: where this process sits (torchrun's and Slurm's variables);
//! - [`config`]: timeouts, limits and the job token, overridable from the environment;
//! - [`rendezvous`]: rank 0 serves a small key-value store over TCP (like torch's TCPStore)
//!   through which the ranks exchange the NCCL unique id; peers must present the job's token;
//! - [`launch`]: the `ulysses-launch` launcher, which starts a node's ranks, prefixes their
//!   output and fails the job when one rank fails;
//! - [`tcp`]: collectives between processes over TCP (CPUs, tests), with dead ranks named;
//! - [`job`]: starting a rank of a training job from the launch environment (or all ranks as
//!   threads without one), for any model and any transport.
//!
//! None of this needs a GPU; the NCCL communicator (`ulysses-nccl`) builds on it. The
//! environment, configuration, rendezvous and TCP transport need no Burn either: they live in
//! `ulysses_core::dist`, which burn 0.22 jobs use too, and are re-exported here.

pub mod job;
pub mod launch;
pub mod logging;

// Burn-free, shared with burn 0.22 (ulysses-core), at their old paths.
pub use ulysses_core::dist::{DistError, DistributedConfig, LaunchEnv, Rendezvous, config, env, rendezvous, tcp};
