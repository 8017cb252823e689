//! Ulysses sequence parallelism as ops (burn backend extensions with their own backward) for
//! models written for burn 0.22.1, by changing one import. (The crate was `burn-ulysses-022`,
//! named for the burn version rather than for how it works.)
//!
//! burn 0.22 routes every op through its closed `Dispatch` backend, so no backend decorator can
//! sit under a model (burn-ulysses does that on 0.21). What 0.22 does allow is a new op with its
//! own backward (`#[backend_extension]`); this crate adds two and a function with burn's
//! attention signature on top:
//!
//! 1. [`exchange`]: the Ulysses all-to-all, q/k/v from `[B, H, S/P, D]` (every head, this
//!    rank's tokens) to `[B, H/P, S, D]` (this rank's heads, every token) and back; its
//!    backward is the inverse exchange;
//! 2. [`blocked`]: attention over the whole sequence in blocks of queries, whose backward
//!    recomputes the scores block by block (memory linear in S; burn 0.22's own autodiff
//!    attention keeps an S × S matrix per head);
//! 3. [`attention()`]: `burn::tensor::module::attention`'s signature. Outside a group it is
//!    burn's attention; inside one ([`context::enter`]) it exchanges, attends, and exchanges
//!    back.
//!
//! Nothing here can see a model's own matmuls, so, unlike burn-ulysses, attention done by hand
//! is not refused where it runs: a model that computes `softmax(q·kᵀ)·v` itself, or calls
//! burn's attention rather than this crate's, attends within each rank's shard. Its step is
//! refused at the gradient sum ([`train::all_reduce_gradients`] finds no exchange through the
//! group since the last sum); a loop that sums otherwise is not. Port it (docs/library.md,
//! "Using burn 0.22") and check that SP = 2 gives SP = 1's loss. Nor can it see positions: a
//! shard attended outside its group (a thread that entered none, the whole job entered as the
//! sequence group, another rank's shard) is refused by [`train::labels_in_step`], which a step
//! calls for its loss's divisor before the forward.
//!
//! ```no_run
//! // use burn::tensor::module::attention;
//! use burn_ulysses_ops::attention;
//! # use burn::tensor::{Device, Tensor, ops::AttentionModuleOptions};
//! use burn_ulysses_ops::{comm::ThreadGroup, context};
//!
//! ThreadGroup::new(4).run(|rank| {
//!     let _sp = context::enter(rank.communicator());
//!     let device = Device::flex().autodiff();
//!     // Each rank thread builds its own model and holds S/4 tokens of each sequence.
//!     let q = Tensor::<4>::zeros([1, 8, 256, 64], &device);
//!     let out = attention(q.clone(), q.clone(), q, None, None, AttentionModuleOptions { is_causal: true, ..Default::default() });
//! });
//! ```
//!
//! [`train`] has the rest of a training step (the token-weighted loss, gradients summed over the
//! group); [`job`] starts the ranks, as threads or as one process per rank under a launcher
//! (torchrun's variables; the ranks meet over TCP). The transports (any
//! `ulysses_core::comm::HostCommunicator`), the sharding of sequences, the layout rules, the
//! gradient-sum rules and the errors are ulysses-core's, shared with burn-ulysses.

pub mod attention;
pub mod blocked;
pub mod context;
pub mod exchange;
pub mod host;
pub mod job;
pub mod train;

pub use attention::attention;
pub use ulysses_core::{comm, data, error, layout};
