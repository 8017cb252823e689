//! A Llama-shaped transformer, generic over the backend. It calls
//! `burn::tensor::module::attention`, so under `burn_ulysses::UlyssesBackend` it becomes
//! sequence parallel without any change.

pub mod model;
pub mod rope;

pub use model::{Attention, Block, FeedForward, Llama, LlamaConfig};
pub use rope::RopeTables;
