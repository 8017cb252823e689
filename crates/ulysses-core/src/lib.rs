//! The parts of burn-ulysses that depend on no Burn version, so that the burn 0.21 decorator
//! (`burn-ulysses`) and the burn 0.22 crate (`burn-ulysses-ops`) share them rather than copy
//! them:
//!
//! - [`comm`]: what a collective is called and how it fails, the in-process group of rank
//!   threads, byte counters, the argument checks that need no peer;
//! - [`layout`]: the contract of one attention call (heads per rank, GQA replication, masks)
//!   and the ring's cut of the sequence;
//! - [`data`]: sequence sharding as ALST does it (labels shifted first, padding, positions,
//!   packed documents), on the host;
//! - [`gradients`]: which gradients an all-reduce sums, in which buckets;
//! - [`error`]: every refusal, naming the problem and the fix;
//! - [`zero`]: ZeRO's partition of parameters, gradients and optimizer state over the ranks;
//! - [`host_adamw`]: AdamW on the host over a rank's part (the optimizer offloaded);
//! - [`host_memory`]: the host memory available, to refuse state that would not fit;
//! - [`files`]: files read as data, refused where they are FIFOs or devices.

pub mod comm;
pub mod data;
pub mod digest;
pub mod error;
pub mod files;
pub mod gradients;
pub mod host_adamw;
pub mod host_memory;
pub mod layout;
pub mod zero;
