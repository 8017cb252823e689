//! A Llama-shaped transformer, generic over the backend, and its training loop with
//! burn-ulysses. The model calls `burn::tensor::module::attention`, so under
//! `burn_ulysses::UlyssesBackend` it becomes sequence parallel without any change.

pub mod corpus;
pub mod data_identity;
pub mod model;
pub mod plot;
pub mod rope;
pub mod run_folder;
pub mod tokens;
pub mod train;

pub use model::{Attention, Block, FeedForward, Llama, LlamaConfig};
pub use rope::RopeTables;
