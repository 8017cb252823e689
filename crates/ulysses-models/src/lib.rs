//! Hugging Face decoder checkpoints for burn-ulysses: one decoder with the four families
//! people fine-tune at long context (Llama, Mistral, Qwen2, Qwen3) as configuration.
//!
//! [`config`] reads a checkpoint's `config.json` into a [`HfConfig`], checks everything
//! the decoder cannot represent before any weight is read (each error names the key and the
//! file), and writes it back in Hugging Face's form; [`rope`] computes the rotary frequencies
//! of the `default`, `linear`, `llama3`, `yarn` and `dynamic` (up to
//! `max_position_embeddings`, refused past it) RoPE types as transformers does, and
//! [`rope_tables`] the rotations at each token's global position; [`decoder`] is the decoder,
//! generic over the backend, calling burn's attention op (so sequence parallel under
//! `burn_ulysses::UlyssesBackend`); [`pretrained`] loads a checkpoint folder's weights into
//! it; [`tokenizer`] reads `tokenizer.json` with the `tokenizers` crate; [`chat`] renders chat
//! data with a checkpoint's chat template as transformers does.

pub mod chat;
pub mod config;
pub mod decoder;
pub mod pretrained;
mod python_json;
pub mod rope;
pub mod rope_tables;
pub mod tokenizer;
mod tokenizer_class;

pub use chat::{ChatError, ChatTemplate, RenderedChat, TokenizedChat};
pub use config::{ConfigError, HfConfig, Family};
pub use decoder::{Decoder, DecoderConfig};
pub use pretrained::{CheckpointError, COMPANION_FILES, DEFAULT_MAX_SHARD_BYTES, HF_TO_DECODER, HfCheckpointSnapshot, HfCheckpointWriter, Pretrained, SaveOptions, plan_shard_paths, check_save_destination, recover_killed_saves, is_tokenizer_file, checkpoint_config, from_pretrained, from_pretrained_lazily, save_pretrained, save_pretrained_including, save_pretrained_with};
pub use rope::RopeScaling;
pub use tokenizer::{TextTokenizer, TokenizerConfig, TokenizerError, TransformersClass};
