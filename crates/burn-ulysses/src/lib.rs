//! Ulysses sequence parallelism for Burn.
//!
//! Every rank of a sequence-parallel (SP) group holds `S/P` tokens of each sequence and runs
//! every layer on its shard. Attention is the one exception: it needs the whole sequence.
//! [`UlyssesBackend`] is a backend decorator that forwards every op to the wrapped backend
//! and intercepts `burn::tensor::module::attention`:
//!
//! 1. [`exchange`]: an all-to-all turns q/k/v from `[B, H, S/P, D]` (all heads, sequence
//!    shard) into `[B, H/P, S, D]` (head shard, whole sequence);
//! 2. [`attention`]: attention runs over the whole sequence for `H/P` heads;
//! 3. [`exchange`]: the inverse all-to-all turns the output back into a sequence shard.
//!
//! Under autodiff the all-to-all is a custom autodiff node whose backward is the same
//! exchange, so gradients flow back to the rank that owns each token.
//!
//! The training stack is `UlyssesBackend<Autodiff<B>>` (not `Autodiff<UlyssesBackend<B>>`:
//! burn's autodiff decomposes attention into matmul/softmax before any inner backend sees
//! it). A rank finds its group through the [`context`]: enter it once per rank thread (in
//! process) or once per process (one process per GPU).
//!
//! ```no_run
//! use burn::backend::{Autodiff, NdArray};
//! use burn_ulysses::{ParallelGroups, ParallelLayout, RankScope, UlyssesBackend, UlyssesConfig, comm::ThreadGroup};
//!
//! type Train = UlyssesBackend<Autodiff<NdArray>>;
//!
//! let layout = ParallelLayout::new().with_sp_size(4);
//! let results = ThreadGroup::new(layout.world_size()).run(|rank| {
//!     // The step's groups and this thread's rank context on them (not the world's
//!     // communicator, which would mix DP replicas' sequences).
//!     let groups = ParallelGroups::<NdArray>::new(rank.communicator(), layout).unwrap();
//!     let _sp = burn_ulysses::context::enter(RankScope::Thread, groups.rank_context(UlyssesConfig::new()));
//!     // attention is now sequence parallel; build the model on `Train` with rank 0's
//!     // parameters on every rank and train it with `ulysses_training::train_step(.., &groups,
//!     // ..)` (the loss over every rank's tokens, the gradients summed over the ranks)
//!     rank.rank()
//! });
//! ```

pub mod attention;
pub mod attention_guard;
pub mod backend;
pub mod capabilities;
pub mod comm;
pub mod compare;
pub mod context;
pub mod data;
pub mod device_io;
pub mod exchange;
pub mod failure;
pub mod flash;
pub mod job;
pub mod nn;
pub mod precision;
pub mod ring;
pub mod primitive;
pub mod topology;
pub mod visibility;

// The patched burn-autodiff (third_party/README.md; docs/library.md, "Depending on it from a
// crate of your own"): a build against the registry's 0.21.0, which loses gradients when ranks
// are threads, stops here.
const _: () = burn_autodiff::BURN_ULYSSES_NEEDS_THE_PATCHED_BURN_AUTODIFF_SEE_ITS_THIRD_PARTY_README;

// The layout rules and errors are Burn-free (ulysses-core), shared with the burn 0.22 crate.
pub use ulysses_core::{error, layout};

/// The README's library example, compiled and run as a doctest by the README's test command.
#[cfg(all(doctest, feature = "ndarray"))]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeExample;

pub use backend::UlyssesBackend;
pub use context::{RankGuard, RankScope, UlyssesConfig};
pub use error::UlyssesError;
pub use capabilities::{DeviceMemory, ExchangeBackend, PlainBackend, SequenceAttention};
pub use topology::{ParallelGroups, ParallelLayout};
