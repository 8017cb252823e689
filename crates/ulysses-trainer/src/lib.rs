//! The trainer of burn-ulysses' decoder (`ulysses_models::decoder`) and its training loop with
//! burn-ulysses. The model calls `burn::tensor::module::attention`, so under
//! `burn_ulysses::UlyssesBackend` it becomes sequence parallel without any change.

pub mod corpus;
pub mod data_identity;
pub mod documents;
pub mod files;
pub mod memory;
pub mod plot;
pub mod run_folder;
pub mod token_cache;
pub mod tokens;
pub mod train;
