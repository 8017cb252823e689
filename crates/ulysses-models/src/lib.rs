//! Hugging Face decoder checkpoints for burn-ulysses: one decoder with the four families
//! people fine-tune at long context (Llama, Mistral, Qwen2, Qwen3) as configuration.
//!
//! This first layer is independent of Burn: [`config`] reads a checkpoint's `config.json`
//! into a [`DecoderConfig`], checks everything the decoder cannot represent before any
//! weight is read (each error names the key and the file), and writes it back in Hugging
//! Face's form; [`rope`] computes the rotary frequencies of the `default`, `linear` and
//! `llama3` RoPE types as transformers does; [`tokenizer`] reads `tokenizer.json` with the
//! `tokenizers` crate.

pub mod config;
pub mod rope;
pub mod tokenizer;

pub use config::{ConfigError, DecoderConfig, Family};
pub use rope::RopeScaling;
pub use tokenizer::{TextTokenizer, TokenizerError};
