//! A checkpoint's `config.json`: read into a [`HfConfig`], checked, and written back.
//!
//! The four families differ only in configuration: Qwen2 adds biases to q, k and v; Qwen3
//! normalises each head of q and k (RMSNorm over the head dim) before RoPE; Mistral may
//! restrict each query to the last `sliding_window` keys; any of them may tie the output
//! head to the embeddings. Defaults are transformers' own for each family, where the file
//! leaves a key out. Whatever the decoder cannot represent is refused here, naming the key
//! and the file, before a weight is read.

use std::{fmt, path::Path};

use burn::tensor::DType;
use serde_json::{Map, Value, json};

use crate::rope::RopeScaling;

/// The architectures this decoder represents (`model_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
}

impl Family {
    pub const ALL: [Family; 4] = [Family::Llama, Family::Mistral, Family::Qwen2, Family::Qwen3];

    /// `model_type` in `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
        }
    }

    /// The causal-LM class transformers builds (`architectures`).
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    fn from_model_type(model_type: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|family| family.model_type() == model_type)
    }
}

/// A decoder of one of the four families, as its checkpoint describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct HfConfig {
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Biases on the q, k and v projections (Qwen2 always; Llama and Qwen3 by
    /// `attention_bias`).
    pub qkv_bias: bool,
    /// Biases on the attention's output projection (`attention_bias` on Llama).
    pub output_bias: bool,
    /// RMSNorm over each head of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Each query sees only the last this many keys (itself included).
    pub sliding_window: Option<usize>,
    pub bos_token_id: Option<u64>,
    /// The first of `eos_token_ids`: the token a packed document ends in.
    pub eos_token_id: Option<u64>,
    /// Every token that ends a generation, as config.json lists them (Llama 3's instruct
    /// models: `<|end_of_text|>`, `<|eom_id|>`, `<|eot_id|>`), written back whole so that
    /// `generate` on a saved model stops where the original's did.
    pub eos_token_ids: Vec<u64>,
    /// The embedding's padding row (`pad_token_id`, a negative one counted from the end): it
    /// takes no gradient from the inputs, as in transformers (`nn.Embedding`'s `padding_idx`).
    /// Written back as the file had it (with the [`unmodelled`](Self::unmodelled) keys).
    pub pad_token_id: Option<u64>,
    /// The standard deviation of a fresh model's weight matrices and embeddings
    /// (transformers' `_init_weights`): only a model built from random weights uses it.
    pub initializer_range: f64,
    /// The weights' dtype as `config.json` names it (`torch_dtype`, transformers 5's `dtype`)
    /// where it is f32, bf16 or f16 (not "auto"): the dtype a save writes by default
    /// ([`saved_dtype`](Self::saved_dtype)).
    pub torch_dtype: Option<DType>,
    /// The `config.json` keys this decoder does not read or writes back as they were
    /// (`pad_token_id`, `attention_dropout`,
    /// `use_cache`, a Qwen's `sliding_window` and `max_window_layers`, ...), written back as
    /// they were, so that a saved model's config is its checkpoint's but for the weights' dtype.
    pub unmodelled: Map<String, Value>,
    /// The keys of a scaled RoPE's section its type does not read (DeepSeek's `attn_factor`
    /// beside YaRN's, which transformers ignores and vLLM applies), warned of as they are read
    /// and written back into `rope_scaling` as they were.
    pub unmodelled_rope: Map<String, Value>,
}

/// The largest sizes a model may have here, far past any published one (widths reach about
/// 2^16, vocabularies 2^18): a size past one is a typo or a -1 read unsigned, where arithmetic
/// on it would overflow or an allocation abort. config.json's keys and the trainer's flags are
/// held to them.
pub mod bounds {
    /// `hidden_size` and `intermediate_size`.
    pub const WIDTH: usize = 1 << 20;
    /// `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`.
    pub const LAYERS_OR_HEADS: usize = 1 << 12;
    pub const HEAD_DIM: usize = 1 << 16;
    pub const VOCABULARY: usize = 1 << 26;
}

/// Keys of a `config.json` that [`HfConfig::to_hf_json`] writes in another form
/// (`rope_theta` and `rope_scaling`, `torch_dtype`).
const REPLACED_KEYS: [&str; 2] = ["rope_parameters", "dtype"];

/// Why a `config.json` cannot be used: the file, the key and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    pub file: String,
    pub key: String,
    pub problem: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: `{}` {}", self.file, self.key, self.problem)
    }
}

/// Reads keys of one file, naming it and the key in every error.
struct Keys<'a> {
    object: &'a Map<String, Value>,
    file: &'a str,
}

impl<'a> Keys<'a> {
    fn error(&self, key: &str, problem: impl Into<String>) -> ConfigError {
        ConfigError { file: self.file.to_string(), key: key.to_string(), problem: problem.into() }
    }

    /// The value of `key`, `None` when it is absent or `null`.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.object.get(key).filter(|value| !value.is_null())
    }

    /// Whether the file names `key`, `null` included: where transformers tells an absent key
    /// (the family's default) from a `null` one (none).
    fn names(&self, key: &str) -> bool {
        self.object.contains_key(key)
    }

    fn count(&self, key: &str, default: Option<usize>) -> Result<usize, ConfigError> {
        match self.get(key) {
            None => default.ok_or_else(|| self.error(key, "is missing")),
            Some(value) => match value.as_u64() {
                Some(n) if n > 0 => Ok(n as usize),
                _ => Err(self.error(key, format!("must be a whole number above 0, got {value}"))),
            },
        }
    }

    /// [`count`](Self::count), at most `most` (one of [`bounds`]).
    fn size(&self, key: &str, default: Option<usize>, most: usize) -> Result<usize, ConfigError> {
        let size = self.count(key, default)?;
        if size > most {
            return Err(self.error(key, format!("is {size}, past any model this decoder builds (at most {most}): is the file damaged?")));
        }
        Ok(size)
    }

    /// A whole number, 0 allowed (a layer index).
    fn whole(&self, key: &str, default: usize) -> Result<usize, ConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(value) => value.as_u64().map(|n| n as usize).ok_or_else(|| self.error(key, format!("must be a whole number, got {value}"))),
        }
    }

    fn optional_count(&self, key: &str) -> Result<Option<usize>, ConfigError> {
        self.get(key).map(|_| self.count(key, None)).transpose()
    }

    fn positive(&self, key: &str, default: f64) -> Result<f64, ConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(value) => match value.as_f64() {
                Some(x) if x.is_finite() && x > 0.0 => Ok(x),
                _ => Err(self.error(key, format!("must be a finite number above 0, got {value}"))),
            },
        }
    }

    fn flag(&self, key: &str, default: bool) -> Result<bool, ConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(value) => value.as_bool().ok_or_else(|| self.error(key, format!("must be true or false, got {value}"))),
        }
    }

    /// Token ids: one, a list of them, or none (absent or null).
    fn tokens(&self, key: &str) -> Result<Vec<u64>, ConfigError> {
        let not_ids = |value: &Value| self.error(key, format!("must be a token id or a list of them, got {value}"));
        match self.get(key) {
            None | Some(Value::Null) => Ok(vec![]),
            Some(Value::Array(ids)) => ids.iter().map(|id| id.as_u64().ok_or_else(|| not_ids(id))).collect(),
            Some(value) => value.as_u64().map(|id| vec![id]).ok_or_else(|| not_ids(value)),
        }
    }
}

impl HfConfig {
    /// Reads a checkpoint folder's `config.json` (or the file itself).
    pub fn from_hf(path: &Path) -> Result<Self, ConfigError> {
        let file = if path.is_dir() { path.join("config.json") } else { path.to_path_buf() };
        let name = file.display().to_string();
        let text = ulysses_core::files::read_to_string_regular(&file).map_err(|e| {
            // The folder given, or the one of a config.json named (not a mistyped folder's parent).
            let folder = if path.is_dir() { Some(path) } else { path.parent().filter(|_| path.file_name().is_some_and(|name| name == "config.json")) };
            let hint = folder.and_then(not_a_transformers_checkpoint).map(|why| format!(": the folder {why}")).unwrap_or_default();
            ConfigError { file: name.clone(), key: "config.json".into(), problem: format!("cannot be read ({e}){hint}") }
        })?;
        Self::from_hf_json(&text, &name)
    }

    /// Parses the text of a `config.json`; `file` names it in errors.
    pub fn from_hf_json(text: &str, file: &str) -> Result<Self, ConfigError> {
        let value: Value = serde_json::from_str(text).map_err(|e| ConfigError { file: file.into(), key: "config.json".into(), problem: format!("is not JSON: {e}") })?;
        let object = value.as_object().ok_or_else(|| ConfigError { file: file.into(), key: "config.json".into(), problem: "is not a JSON object".into() })?;
        let keys = Keys { object, file };

        let model_type = keys.get("model_type").and_then(Value::as_str).ok_or_else(|| keys.error("model_type", "is missing"))?;
        let family = Family::from_model_type(model_type).ok_or_else(|| {
            let known: Vec<_> = Family::ALL.iter().map(|f| f.model_type()).collect();
            keys.error("model_type", format!("is {model_type:?}; this decoder represents {}", known.join(", ")))
        })?;
        if let Some(architectures) = keys.get("architectures") {
            // A class of another head (a sequence classifier's) is refused; transformers'
            // AutoModelForCausalLM goes by model_type, so none named (`[]`, `null`, no list) or
            // any causal LM class (`LLaMAForCausalLM`, an older spelling) loads.
            let names: Vec<&str> = architectures.as_array().map(|a| a.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
            if !names.is_empty() && !names.iter().any(|name| *name == family.architecture() || name.ends_with("ForCausalLM")) {
                return Err(keys.error("architectures", format!("is {architectures}; a {model_type} causal LM is {}", family.architecture())));
            }
        }
        // Modeling code of the checkpoint's own, which transformers runs in place of its
        // family's with trust_remote_code: trained here as the family's, as transformers does
        // without it; said, for a model whose code differs (Yarn-Llama's, an embedding model's).
        if let Some(code) = keys.get("auto_map").and_then(|map| map.get("AutoModelForCausalLM")) {
            tracing::warn!(file = keys.file, %code, "config.json names modeling code of its own (auto_map): it is read as transformers' own {model_type}, as transformers reads it without trust_remote_code");
        }
        if let Some(activation) = keys.get("hidden_act") {
            // transformers' "swish" is the same function (torch's SiLU).
            if !matches!(activation.as_str(), Some("silu" | "swish")) {
                return Err(keys.error("hidden_act", format!("is {activation}; the four families' MLP is SwiGLU (\"silu\")")));
            }
        }
        for key in ["mlp_bias"] {
            if keys.flag(key, false)? {
                return Err(keys.error(key, "is true; biases on the MLP are not represented"));
            }
        }
        // Quantized weights (FP8 with their scales, GPTQ, AWQ, bitsandbytes) are not what the
        // loader reads: refused here rather than as an unused scale tensor later.
        if let Some(quantization) = keys.get("quantization_config") {
            let method = quantization.get("quant_method").and_then(Value::as_str).unwrap_or("unnamed");
            return Err(keys.error("quantization_config", format!("is present ({method}); quantized checkpoints are not loaded: give the checkpoint in bf16, f16 or f32")));
        }
        if let Some(factor) = keys.get("partial_rotary_factor").and_then(Value::as_f64).filter(|&f| f != 1.0) {
            return Err(keys.error("partial_rotary_factor", format!("is {factor}; only RoPE over the whole head (1.0) is represented")));
        }

        let hidden_size = keys.size("hidden_size", None, bounds::WIDTH)?;
        let num_attention_heads = keys.size("num_attention_heads", None, bounds::LAYERS_OR_HEADS)?;
        // Absent, Mistral's default is 8 kv heads and Qwen's 32; `null`, the head count.
        let kv_default = match family {
            Family::Mistral if !keys.names("num_key_value_heads") => 8,
            Family::Qwen2 | Family::Qwen3 if !keys.names("num_key_value_heads") => 32,
            _ => num_attention_heads,
        };
        let num_key_value_heads = keys.size("num_key_value_heads", Some(kv_default), bounds::LAYERS_OR_HEADS)?;
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(keys.error(
                "num_key_value_heads",
                format!("is {num_key_value_heads}, which does not divide num_attention_heads {num_attention_heads}"),
            ));
        }
        // Qwen3's default head dim is 128 whatever the width; the others' is hidden / heads.
        let head_dim = match (keys.get("head_dim"), family) {
            (None, Family::Qwen3) => 128,
            (None, _) if hidden_size % num_attention_heads != 0 => {
                return Err(keys.error("head_dim", format!("is missing and hidden_size {hidden_size} is no multiple of num_attention_heads {num_attention_heads}")));
            }
            (None, _) => hidden_size / num_attention_heads,
            (Some(_), _) => keys.size("head_dim", None, bounds::HEAD_DIM)?,
        };
        if head_dim % 2 != 0 {
            return Err(keys.error("head_dim", format!("is {head_dim}; RoPE rotates pairs, so it must be even")));
        }

        let max_position_embeddings = keys.count(
            "max_position_embeddings",
            Some(match family {
                Family::Llama => 2048,
                Family::Mistral => 131_072,
                Family::Qwen2 | Family::Qwen3 => 32_768,
            }),
        )?;
        let (rope_theta, rope_scaling, unmodelled_rope) = rope(&keys, max_position_embeddings)?;
        let attention_bias = keys.flag("attention_bias", false)?;
        let (qkv_bias, output_bias) = match family {
            Family::Qwen2 => (true, false),
            Family::Llama => (attention_bias, attention_bias),
            Family::Qwen3 => (attention_bias, attention_bias),
            Family::Mistral => (false, false),
        };
        let num_hidden_layers = keys.size("num_hidden_layers", None, bounds::LAYERS_OR_HEADS)?;
        // Each layer's attention where the config lists it (`"sliding_attention"` or
        // `"full_attention"`).
        let layer_types = keys.get("layer_types").and_then(Value::as_array);
        if let (Some(types), Family::Mistral | Family::Qwen2 | Family::Qwen3) = (layer_types, family)
            && (types.len() != num_hidden_layers || !types.iter().all(|t| matches!(t.as_str(), Some("full_attention" | "sliding_attention"))))
        {
            return Err(keys.error(
                "layer_types",
                format!("has {} entries for {num_hidden_layers} layers: give one a layer, \"full_attention\" or \"sliding_attention\" (transformers refuses it too)", types.len()),
            ));
        }
        let all_layers = |kind: &str| layer_types.is_some_and(|types| types.iter().all(|t| t.as_str() == Some(kind)));
        let sliding_window = match family {
            Family::Mistral => {
                // Absent, Mistral's window is 4096 keys (transformers' default); `null`, none.
                let window = if keys.names("sliding_window") { keys.optional_count("sliding_window")? } else { Some(4096) };
                // transformers loads a Mistral config that lists `layer_types` as Ministral's,
                // whose window is each listed sliding layer's alone.
                match (layer_types, window) {
                    (None, window) => window,
                    (Some(_), _) if all_layers("full_attention") => None,
                    (Some(_), Some(window)) if all_layers("sliding_attention") => Some(window),
                    (Some(_), _) => {
                        return Err(keys.error(
                            "layer_types",
                            "lists attention that differs by layer (or sliding layers without a sliding_window), as Ministral's configs do \
                             (transformers loads a Mistral config with layer_types as Ministral): a window on some layers alone is not represented",
                        ));
                    }
                }
            }
            Family::Qwen2 | Family::Qwen3 => {
                // Which layers slide, as transformers lays them out: `layer_types` where given,
                // else (with sliding switched on) every layer from `max_window_layers` (28) on.
                // None sliding is full attention everywhere, which the decoder represents.
                let listed_sliding = layer_types.map(|types| types.iter().any(|t| t.as_str() == Some("sliding_attention")));
                if keys.flag("use_sliding_window", false)? {
                    let sliding = match listed_sliding {
                        Some(sliding) => sliding,
                        None => keys.whole("max_window_layers", 28)? < num_hidden_layers,
                    };
                    // An absent window is transformers' 4096; `null`, none.
                    if sliding && (!keys.names("sliding_window") || keys.get("sliding_window").is_some()) {
                        return Err(keys.error("use_sliding_window", "is true and some layers slide (max_window_layers or layer_types); Qwen's per-layer sliding window is not represented"));
                    }
                }
                // A sliding layer listed with no window (sliding switched off, or a `null`
                // window): transformers refuses to build its mask.
                if listed_sliding == Some(true) {
                    return Err(keys.error(
                        "layer_types",
                        "lists sliding_attention layers with no window (use_sliding_window is false, or sliding_window null), which transformers \
                         cannot run either: list full_attention layers alone",
                    ));
                }
                None
            }
            Family::Llama => None,
        };
        // transformers builds the embedding with `padding_idx = pad_token_id`: that row takes no
        // gradient from the inputs (and starts at zero in a fresh model); negative counts from
        // the vocabulary's end, as torch reads it.
        let vocab_size = keys.size("vocab_size", None, bounds::VOCABULARY)?;
        let pad_token_id = match keys.get("pad_token_id") {
            None => None,
            Some(value) => {
                let id = value.as_i64().ok_or_else(|| keys.error("pad_token_id", format!("is {value}, not a token id")))?;
                let index = if id < 0 { vocab_size as i64 + id } else { id };
                if !(0..vocab_size as i64).contains(&index) {
                    return Err(keys.error("pad_token_id", format!("is {id}, outside the vocabulary of {vocab_size} tokens (transformers' embedding refuses it too)")));
                }
                Some(index as u64)
            }
        };
        if let Some(dropout) = keys.get("attention_dropout").and_then(Value::as_f64).filter(|&p| p != 0.0) {
            tracing::warn!(file = keys.file, dropout, "config.json's attention_dropout is not applied: this decoder attends without dropout (transformers drops attention weights while training)");
        }
        // Absent token ids: Llama's and Mistral's defaults are 1 and 2, Qwen's none.
        let default_token = |key: &str, id: u64| -> Result<Vec<u64>, ConfigError> {
            match family {
                Family::Llama | Family::Mistral if !keys.names(key) => Ok(vec![id]),
                _ => keys.tokens(key),
            }
        };
        let (bos_token_ids, eos_token_ids) = (default_token("bos_token_id", 1)?, default_token("eos_token_id", 2)?);
        let mut config = Self {
            family,
            vocab_size,
            hidden_size,
            intermediate_size: keys.size("intermediate_size", None, bounds::WIDTH)?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: keys.positive("rms_norm_eps", 1e-6)?,
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings: keys.flag("tie_word_embeddings", false)?,
            qkv_bias,
            output_bias,
            qk_norm: family == Family::Qwen3,
            sliding_window,
            bos_token_id: bos_token_ids.first().copied(),
            eos_token_id: eos_token_ids.first().copied(),
            eos_token_ids,
            pad_token_id,
            initializer_range: keys.positive("initializer_range", 0.02)?,
            torch_dtype: ["torch_dtype", "dtype"].iter().find_map(|key| match keys.get(key)?.as_str()? {
                "float32" => Some(DType::F32),
                "bfloat16" => Some(DType::BF16),
                "float16" => Some(DType::F16),
                _ => None,
            }),
            unmodelled: Map::new(),
            unmodelled_rope,
        };
        let written = config.to_hf_json("float32");
        config.unmodelled = object.iter().filter(|(key, _)| written.get(key.as_str()).is_none() && !REPLACED_KEYS.contains(&key.as_str())).map(|(k, v)| (k.clone(), v.clone())).collect();
        Ok(config)
    }

    /// The dtype a checkpoint of this config is saved in unless asked otherwise: its own
    /// weights' (as `save_pretrained` keeps a model's dtype: a fine-tune of an f32 checkpoint
    /// rounded to bf16 would lose its updates below bf16's step), bf16 where it names none.
    pub fn saved_dtype(&self) -> DType {
        self.torch_dtype.unwrap_or(DType::BF16)
    }

    /// The `config.json` transformers reads back: the family's `model_type` and
    /// `architectures`, every size, RoPE as `rope_theta` and `rope_scaling` (transformers 4's
    /// form, which transformers 5 also reads), weights of `torch_dtype` `dtype`, and the
    /// [`unmodelled`](Self::unmodelled) keys as they were.
    pub fn to_hf_json(&self, dtype: &str) -> Value {
        let rope_scaling = match self.rope_scaling {
            RopeScaling::Default => Value::Null,
            RopeScaling::Linear { factor } => json!({ "rope_type": "linear", "factor": factor }),
            RopeScaling::Dynamic { factor, .. } => json!({ "rope_type": "dynamic", "factor": factor }),
            RopeScaling::Yarn { factor, original_max_position_embeddings, original_given, beta_fast, beta_slow, attention_factor, mscales, truncate } => {
                let mut yarn = json!({ "rope_type": "yarn", "factor": factor, "beta_fast": beta_fast, "beta_slow": beta_slow });
                // Absent reads as true; transformers before `truncate` existed (4.54) warn of
                // the key as unknown, so it is written only where it says otherwise.
                if !truncate {
                    yarn["truncate"] = json!(false);
                }
                // What the checkpoint gave, not what it implies (read back, the same bits).
                if let Some(given) = attention_factor {
                    yarn["attention_factor"] = json!(given);
                }
                if let Some((mscale, all)) = mscales {
                    (yarn["mscale"], yarn["mscale_all_dim"]) = (json!(mscale), json!(all));
                }
                // Only where the checkpoint gave it: transformers 4.48-4.57 take the factor as
                // the ratio of the two contexts where it is present.
                if original_given {
                    yarn["original_max_position_embeddings"] = json!(original_max_position_embeddings as u64);
                }
                yarn
            }
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings as u64,
            }),
        };
        let mut rope_scaling = rope_scaling;
        if let Some(section) = rope_scaling.as_object_mut() {
            for (key, value) in &self.unmodelled_rope {
                section.entry(key.as_str()).or_insert_with(|| value.clone());
            }
        }
        let mut config = json!({
            "model_type": self.family.model_type(),
            "architectures": [self.family.architecture()],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": match self.eos_token_ids.as_slice() {
                [] => Value::Null,
                [id] => json!(id),
                ids => json!(ids),
            },
            "initializer_range": self.initializer_range,
        });
        let object = config.as_object_mut().expect("an object");
        for (key, value) in &self.unmodelled {
            object.entry(key.as_str()).or_insert_with(|| value.clone());
        }
        match self.family {
            Family::Llama | Family::Qwen3 => {
                object.insert("attention_bias".into(), json!(self.qkv_bias));
            }
            Family::Mistral => {
                object.insert("sliding_window".into(), json!(self.sliding_window));
            }
            Family::Qwen2 => {}
        }
        if matches!(self.family, Family::Qwen2 | Family::Qwen3) {
            object.insert("use_sliding_window".into(), json!(false));
            // Every layer attends in full, as the model computed (a sliding layer listed with
            // no window would load nowhere, this reader included).
            if let Some(types) = object.get_mut("layer_types").and_then(Value::as_array_mut) {
                types.iter_mut().for_each(|kind| *kind = json!("full_attention"));
            }
        }
        config
    }
}

/// What a folder holds where it is no transformers checkpoint (`config.json` and safetensors
/// weights) but something a user may take for one, with what to do: a PEFT adapter, Mistral's
/// own format, PyTorch's `.bin` weights.
pub(crate) fn not_a_transformers_checkpoint(dir: &Path) -> Option<String> {
    let has = |name: &str| dir.join(name).exists();
    if has("adapter_config.json") {
        let base = ulysses_core::files::read_to_string_regular(&dir.join("adapter_config.json"))
            .ok()
            .and_then(|text| serde_json::from_str::<Value>(&text).ok())
            .and_then(|config| config.get("base_model_name_or_path")?.as_str().map(str::to_string))
            .map(|base| format!(" ({base})"))
            .unwrap_or_default();
        return Some(format!(
            "is a PEFT adapter (adapter_config.json), not a whole model: merge it into its base model{base} with peft's merge_and_unload() and \
             save_pretrained, then give that folder"
        ));
    }
    if has("params.json") && (has("consolidated.safetensors") || has("consolidated.00.pth")) {
        return Some(
            "holds Mistral's own format (params.json, consolidated.*): take the repository's transformers files (config.json, model*.safetensors), \
             or convert it with transformers' convert_mistral_weights_to_hf script"
                .into(),
        );
    }
    if (has("pytorch_model.bin") || has("pytorch_model.bin.index.json")) && !has("model.safetensors") && !has("model.safetensors.index.json") {
        return Some(
            "holds PyTorch .bin weights: convert them to safetensors (transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out, \
             safe_serialization=True))"
                .into(),
        );
    }
    None
}

/// `rope_theta` and the scaling, from `rope_parameters` (transformers 5) or `rope_theta` and
/// `rope_scaling` (transformers 4).
fn rope(keys: &Keys, max_position_embeddings: usize) -> Result<(f64, RopeScaling, Map<String, Value>), ConfigError> {
    let (section, scaling) = match (keys.get("rope_parameters"), keys.get("rope_scaling")) {
        // transformers 5 takes rope_scaling over rope_parameters (its theta then from beside
        // them): a config that says two things is refused rather than read either way.
        (Some(parameters), Some(scaling)) if parameters != scaling => {
            return Err(keys.error(
                "rope_scaling",
                format!("is {scaling} beside rope_parameters {parameters}, which say different things: keep one (rope_parameters, with rope_theta inside, for transformers 5)"),
            ));
        }
        (Some(parameters), _) => ("rope_parameters", Some(parameters)),
        (None, scaling) => ("rope_scaling", scaling),
    };
    let Some(scaling) = scaling else { return Ok((keys.positive("rope_theta", 10_000.0)?, RopeScaling::Default, Map::new())) };
    let inner = scaling.as_object().ok_or_else(|| keys.error(section, format!("must be an object, got {scaling}")))?;
    // transformers 5's per-layer-type form (`{"full_attention": {..}, "sliding_attention": {..}}`),
    // which these families' rotary embedding cannot read (it looks up the section's own
    // `rope_type`): read at the top level it would be default RoPE at θ 10 000, silently.
    if let Some((name, _)) = inner.iter().find(|(_, value)| value.is_object()) {
        return Err(keys.error(
            &format!("{section}.{name}"),
            "is an object: RoPE per layer type is not read (transformers cannot run Llama, Mistral, Qwen2 or Qwen3 with it either); \
             give one section, its keys (rope_type, rope_theta, factor, ...) at its top level",
        ));
    }
    let inner_keys = Keys { object: inner, file: keys.file };
    let field = |name: &str| format!("{section}.{name}");
    let number = |name: &str| -> Result<f64, ConfigError> {
        match inner_keys.get(name).and_then(Value::as_f64) {
            Some(x) if x.is_finite() && x > 0.0 => Ok(x),
            Some(x) => Err(keys.error(&field(name), format!("must be a finite number above 0, got {x}"))),
            None => Err(keys.error(&field(name), "is missing")),
        }
    };
    // `rope_parameters` holds rope_theta itself; `rope_scaling` sits beside it.
    let theta = match inner_keys.get("rope_theta") {
        Some(_) => number("rope_theta")?,
        None => keys.positive("rope_theta", 10_000.0)?,
    };
    // transformers 5 reads a partial rotary factor from here too.
    if let Some(factor) = inner_keys.get("partial_rotary_factor").and_then(Value::as_f64).filter(|&f| f != 1.0) {
        return Err(keys.error(&field("partial_rotary_factor"), format!("is {factor}; only RoPE over the whole head (1.0) is represented")));
    }
    // The keys the section has beyond theta, the partial factor and its type: a scaling's.
    let scaling_keys: Vec<&str> =
        inner.iter().filter(|(key, value)| !value.is_null() && !["rope_theta", "partial_rotary_factor", "rope_type", "type"].contains(&key.as_str())).map(|(key, _)| key.as_str()).collect();
    let type_key = if inner_keys.get("rope_type").is_none() && inner_keys.get("type").is_some() { "type" } else { "rope_type" };
    let rope_type = match inner_keys.get(type_key) {
        Some(value) => value.as_str().ok_or_else(|| keys.error(&field(type_key), format!("is {value}, not a name: \"default\", \"linear\", \"dynamic\", \"llama3\" or \"yarn\"")))?,
        None if scaling_keys.is_empty() => "default",
        // Read as plain RoPE, a llama3 or linear scaling that lost its type would set every
        // position's frequencies wrong (and `--save-hf` would write that); transformers 4 fails.
        None => {
            return Err(keys.error(
                section,
                format!("has {scaling_keys:?} but no rope_type: name the scaling they are for (\"linear\", \"llama3\" or \"yarn\"), or remove them for plain RoPE"),
            ));
        }
    };
    if rope_type == "default" && !scaling_keys.is_empty() {
        // As transformers: default RoPE, the keys unused, said.
        tracing::warn!(file = keys.file, ?scaling_keys, "config.json's {section} is rope_type \"default\": plain RoPE, these keys unused");
    }
    // Null or 0 is "not given", as transformers' `or` and truthiness read them.
    let optional = |name: &str| match inner_keys.get(name) {
        None => Ok(None),
        Some(value) if value.as_f64() == Some(0.0) => Ok(None),
        Some(_) => number(name).map(Some),
    };
    // The context the scaled types were trained at, as transformers 5 standardizes it: one
    // beside the scaling (Phi-3 writes it there) over the scaling's own; `None`, neither. A
    // null or 0 in either place is refused: transformers 5 takes it as it is and fails (null)
    // or divides by it (0).
    let original_context = || {
        const KEY: &str = "original_max_position_embeddings";
        let given = |keys: &Keys, name: &str| match keys.object.get(KEY) {
            None => Ok(None),
            Some(value) => match value.as_f64() {
                // Whole: a context of tokens, written back as one (8192.5 trained as such was
                // saved as 8192, another RoPE).
                Some(x) if x.is_finite() && x > 0.0 && x.fract() == 0.0 && x <= 2f64.powi(53) => Ok(Some(x)),
                _ => Err(keys.error(name, format!("is {value}: give the context the model was trained at (a whole number of tokens), or leave the key out (then max_position_embeddings)"))),
            },
        };
        match given(keys, KEY)? {
            Some(outside) => Ok(Some(outside)),
            None => given(&inner_keys, &field(KEY)),
        }
    };
    let scaling = match rope_type {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear { factor: number("factor")? },
        "dynamic" => RopeScaling::Dynamic { factor: number("factor")?, max_position_embeddings },
        "llama3" => {
            let (low, high) = (number("low_freq_factor")?, number("high_freq_factor")?);
            if high <= low {
                return Err(keys.error(&field("high_freq_factor"), format!("is {high}, not above low_freq_factor {low}")));
            }
            RopeScaling::Llama3 {
                factor: number("factor")?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: original_context()?.unwrap_or(max_position_embeddings as f64),
            }
        }
        "yarn" => {
            // As transformers 5: the correction range over the original context (the config's
            // own where none is given), the factor given (else the ratio of the two contexts),
            // the attention factor given or YaRN's.
            let original = original_context()?;
            let context = original.unwrap_or(max_position_embeddings as f64);
            let factor = optional("factor")?.unwrap_or(max_position_embeddings as f64 / context);
            let (attention_factor, mscales) = (optional("attention_factor")?, optional("mscale")?.zip(optional("mscale_all_dim")?));
            let (beta_fast, beta_slow) = (optional("beta_fast")?.unwrap_or(32.0), optional("beta_slow")?.unwrap_or(1.0));
            // Absent: true; an explicit null is falsy to transformers.
            let truncate = match inner_keys.object.get("truncate") {
                None => true,
                Some(Value::Null) => false,
                Some(value) => value.as_bool().ok_or_else(|| keys.error(&field("truncate"), format!("is {value}, not true or false")))?,
            };
            RopeScaling::Yarn { factor, original_max_position_embeddings: context, original_given: original.is_some(), beta_fast, beta_slow, attention_factor, mscales, truncate }
        }
        other => {
            // Named by the key the file has (transformers 4's `type` where `rope_type` is absent).
            return Err(keys.error(
                &field(type_key),
                format!("is {other:?}; the RoPE types represented are \"default\", \"linear\", \"dynamic\", \"llama3\" and \"yarn\""),
            ));
        }
    };
    // What the scaling's type does not read, as transformers does not: said (a misspelled
    // `original_max_position_embeddings` falls back to max_position_embeddings, a checkpoint's
    // `attn_factor` is ignored) and kept for the saved config. Default RoPE's were said above.
    let read: &[&str] = match rope_type {
        "linear" | "dynamic" => &["factor"],
        "llama3" => &["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"],
        "yarn" => &["factor", "original_max_position_embeddings", "attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow", "truncate"],
        _ => return Ok((theta, scaling, Map::new())),
    };
    let unread: Map<String, Value> = inner.iter().filter(|(key, _)| scaling_keys.contains(&key.as_str()) && !read.contains(&key.as_str())).map(|(k, v)| (k.clone(), v.clone())).collect();
    if !unread.is_empty() {
        let names: Vec<&String> = unread.keys().collect();
        tracing::warn!(
            file = keys.file,
            keys = ?names,
            "config.json's {section} (rope_type {rope_type:?}) has keys this RoPE does not read, as transformers does not (a misspelled one falls back to its \
             default); they are written back as they were"
        );
    }
    Ok((theta, scaling, unread))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA: &str = r#"{
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "hidden_act": "silu",
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "max_position_embeddings": 131072,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": true, "attention_bias": false, "mlp_bias": false,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16"
    }"#;

    /// `layer_types` for LLAMA's 16 layers, the last sliding.
    fn one_sliding_layer() -> Value {
        let mut types = vec!["full_attention"; 15];
        types.push("sliding_attention");
        json!(types)
    }

    fn with(base: &str, key: &str, value: Value) -> String {
        let mut config: Value = serde_json::from_str(base).unwrap();
        if value.is_null() {
            config.as_object_mut().unwrap().remove(key);
        } else {
            config[key] = value;
        }
        config.to_string()
    }

    fn refused(text: &str) -> ConfigError {
        HfConfig::from_hf_json(text, "ckpt/config.json").expect_err("refused")
    }

    #[test]
    fn a_llama_3_2_config_reads_with_its_llama3_rope() {
        let config = HfConfig::from_hf_json(LLAMA, "ckpt/config.json").unwrap();
        assert_eq!(config.family, Family::Llama);
        assert_eq!((config.num_attention_heads, config.num_key_value_heads, config.head_dim), (32, 8, 64));
        assert_eq!(config.rope_scaling, RopeScaling::Llama3 { factor: 32.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192.0 });
        assert_eq!((config.rope_theta, config.rms_norm_eps), (500_000.0, 1e-5));
        assert!(config.tie_word_embeddings && !config.qkv_bias && !config.qk_norm);
        assert_eq!((config.bos_token_id, config.eos_token_id), (Some(128000), Some(128001)));
        assert_eq!(config.eos_token_ids, [128001, 128008, 128009]);
    }

    /// Llama 3's scaling without its original context anywhere reads it as the config's
    /// `max_position_embeddings`, as transformers 5 fills it in (the fixtures check one beside
    /// the scaling); one of 0, null or no whole number, inside or beside the scaling, is refused by
    /// name (8192.5 was saved as 8192).
    #[test]
    fn llama3_without_an_original_context_takes_the_configs() {
        let scaling = json!({"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "rope_type": "llama3"});
        let llama = with(&with(LLAMA, "rope_scaling", scaling.clone()), "max_position_embeddings", json!(4096));
        let RopeScaling::Llama3 { original_max_position_embeddings, .. } = HfConfig::from_hf_json(&llama, "ckpt/config.json").unwrap().rope_scaling else { panic!("llama3") };
        assert_eq!(original_max_position_embeddings, 4096.0);
        for bad in [json!(0), Value::Null, json!(8192.5), json!(0.5)] {
            let mut inside = scaling.clone();
            inside["original_max_position_embeddings"] = bad.clone();
            let error = refused(&with(LLAMA, "rope_scaling", inside));
            assert_eq!(error.key, "rope_scaling.original_max_position_embeddings", "{error}");
        }
        // Beside the scaling: a null is written back, where transformers would fail on it.
        let mut config: Value = serde_json::from_str(LLAMA).unwrap();
        config["original_max_position_embeddings"] = Value::Null;
        for bad in [config.to_string(), with(LLAMA, "original_max_position_embeddings", json!("8k"))] {
            let error = refused(&bad);
            assert_eq!(error.key, "original_max_position_embeddings", "{error}");
        }
    }

    /// A save keeps the checkpoint's weight dtype (`torch_dtype`, transformers 5's `dtype`);
    /// where it names none, or "auto", bf16.
    #[test]
    fn a_save_keeps_the_checkpoints_weight_dtype() {
        let saved = |text: &str| HfConfig::from_hf_json(text, "a").unwrap().saved_dtype();
        assert_eq!(saved(LLAMA), DType::BF16);
        assert_eq!(saved(&with(LLAMA, "torch_dtype", json!("float32"))), DType::F32);
        let transformers_5 = with(&with(LLAMA, "torch_dtype", Value::Null), "dtype", json!("float16"));
        assert_eq!(saved(&transformers_5), DType::F16);
        for none in [Value::Null, json!("auto")] {
            assert_eq!(saved(&with(LLAMA, "torch_dtype", none)), DType::BF16);
        }
    }

    /// Every end token comes back in the saved config.json (`generate` stops at each), one
    /// as a number, none as null; a list with a non-id is refused, naming the key.
    #[test]
    fn every_end_token_is_written_back() {
        let config = HfConfig::from_hf_json(LLAMA, "a").unwrap();
        assert_eq!(config.to_hf_json("bfloat16")["eos_token_id"], json!([128001, 128008, 128009]));
        let one = HfConfig::from_hf_json(&with(LLAMA, "eos_token_id", json!(7)), "a").unwrap();
        assert_eq!((one.eos_token_id, one.to_hf_json("bfloat16")["eos_token_id"].clone()), (Some(7), json!(7)));
        let mut nulled: Value = serde_json::from_str(LLAMA).unwrap();
        nulled["eos_token_id"] = Value::Null;
        let none = HfConfig::from_hf_json(&nulled.to_string(), "a").unwrap();
        assert_eq!((none.eos_token_id, none.to_hf_json("bfloat16")["eos_token_id"].clone()), (None, Value::Null));
        let error = refused(&with(LLAMA, "eos_token_id", json!([1, "two"])));
        assert!(error.key == "eos_token_id" && error.problem.contains("a list of them"), "{error}");
    }

    /// A saved model's config.json is its checkpoint's, keys this decoder does not read
    /// included (`pad_token_id`, `use_cache`, a Qwen's window settings, a custom key), but for
    /// the weights' dtype and RoPE in one form.
    #[test]
    fn keys_the_decoder_does_not_read_are_written_back() {
        let qwen2 = r#"{"model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 999,
                        "use_cache": false, "sliding_window": 4096, "max_window_layers": 21, "my_key": {"kept": [1, 2]},
                        "dtype": "bfloat16", "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}"#;
        let config = HfConfig::from_hf_json(qwen2, "q").unwrap();
        let written = config.to_hf_json("float32");
        for (key, value) in [("pad_token_id", json!(999)), ("use_cache", json!(false)), ("sliding_window", json!(4096)), ("max_window_layers", json!(21)), ("my_key", json!({"kept": [1, 2]}))] {
            assert_eq!(written[key], value, "{key}");
        }
        assert_eq!((written["torch_dtype"].clone(), written["rope_theta"].clone(), written["use_sliding_window"].clone()), (json!("float32"), json!(1e6), json!(false)));
        for key in ["dtype", "rope_parameters"] {
            assert!(written.get(key).is_none(), "{key} written back: {written}");
        }
        // Read back, the same but for the weights' dtype it was written with.
        assert_eq!(config.torch_dtype, Some(DType::BF16), "transformers 5's `dtype`");
        assert_eq!(HfConfig::from_hf_json(&written.to_string(), "again").unwrap(), HfConfig { torch_dtype: Some(DType::F32), ..config }, "read back, the same");
        // Sliding switched on with no window (`null`) and layers from max_window_layers on
        // (none listed): transformers lays every layer out in full, as it reads back once
        // written. Listed sliding layers without a window are refused (transformers
        // cannot build their mask).
        let mut windowless: Value = serde_json::from_str(qwen2).unwrap();
        windowless["use_sliding_window"] = json!(true);
        windowless["sliding_window"] = Value::Null;
        windowless["max_window_layers"] = json!(0);
        let full = HfConfig::from_hf_json(&windowless.to_string(), "q").unwrap();
        assert_eq!(full.sliding_window, None);
        assert_eq!(HfConfig::from_hf_json(&full.to_hf_json("float32").to_string(), "again").unwrap().sliding_window, None);
        windowless["layer_types"] = json!(["full_attention", "sliding_attention"]);
        let refused = HfConfig::from_hf_json(&windowless.to_string(), "q").unwrap_err().to_string();
        assert!(refused.contains("`layer_types` lists sliding_attention layers with no window"), "{refused}");
    }

    /// A PEFT adapter's folder, Mistral's own format and PyTorch `.bin` weights are named with
    /// what to do, not only as a missing file.
    #[test]
    fn folders_that_are_no_transformers_checkpoint_say_what_to_do() {
        let dir = std::env::temp_dir().join(format!("ulysses-not-a-checkpoint-{}", std::process::id()));
        for (files, named) in [
            (&[("adapter_config.json", r#"{"base_model_name_or_path": "Qwen/Qwen3-8B"}"#)][..], "is a PEFT adapter (adapter_config.json), not a whole model: merge it into its base model (Qwen/Qwen3-8B)"),
            (&[("params.json", "{}"), ("consolidated.safetensors", "")], "holds Mistral's own format"),
        ] {
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            for (name, text) in files {
                std::fs::write(dir.join(name), text).unwrap();
            }
            let error = HfConfig::from_hf(&dir).unwrap_err().to_string();
            assert!(error.contains("cannot be read") && error.contains(named), "{error}");
        }
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("pytorch_model.bin"), b"").unwrap();
        assert!(not_a_transformers_checkpoint(&dir).is_some_and(|why| why.contains("convert them to safetensors")));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// YaRN as Qwen's guides add it for long contexts, and as DeepSeek's configs give it
    /// (mscale and mscale_all_dim): the factor given, the correction range over the original
    /// context, the attention factor transformers 5 derives; written back, the same.
    #[test]
    fn yarn_reads_as_transformers_5_reads_it() {
        let qwen3 = r#"{"model_type": "qwen3", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 40960,
                        "rope_theta": 1000000.0,
                        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}"#;
        let config = HfConfig::from_hf_json(qwen3, "q").unwrap();
        let yarn = RopeScaling::Yarn { factor: 4.0, original_max_position_embeddings: 32768.0, original_given: true, beta_fast: 32.0, beta_slow: 1.0, attention_factor: None, mscales: None, truncate: true };
        assert_eq!(config.rope_scaling, yarn);
        assert_eq!(yarn.attention_factor(), 0.1 * 4f64.ln() + 1.0);
        assert_eq!(HfConfig::from_hf_json(&config.to_hf_json("bfloat16").to_string(), "again").unwrap(), HfConfig { torch_dtype: Some(DType::BF16), ..config.clone() });
        // No original context: the config's own (and none written back); DeepSeek's mscales:
        // their ratio; a beta of 0 or a null is transformers' default.
        let deepseek = with(qwen3, "rope_scaling", json!({"type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 0, "beta_slow": null}));
        let config = HfConfig::from_hf_json(&deepseek, "d").unwrap();
        let RopeScaling::Yarn { original_max_position_embeddings, original_given, beta_fast, beta_slow, .. } = config.rope_scaling else { panic!("yarn") };
        let mscale = |m: f64| 0.1 * m * 40f64.ln() + 1.0;
        assert_eq!((original_max_position_embeddings, original_given, beta_fast, beta_slow), (40960.0, false, 32.0, 1.0));
        assert_eq!(config.rope_scaling.attention_factor(), mscale(1.0) / mscale(0.707));
        assert_eq!(HfConfig::from_hf_json(&config.to_hf_json("bfloat16").to_string(), "again").unwrap(), HfConfig { torch_dtype: Some(DType::BF16), ..config.clone() });
        assert!(config.to_hf_json("bfloat16")["rope_scaling"].get("original_max_position_embeddings").is_none());
        // A key YaRN does not read (DeepSeek-R1-0528-Qwen3-8B's `attn_factor`, which vLLM
        // applies): as transformers, not read; written back as it was (a save dropped it).
        let extra = with(qwen3, "rope_scaling", json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "attn_factor": 0.8782488562869419}));
        let config = HfConfig::from_hf_json(&extra, "e").unwrap();
        assert_eq!(config.rope_scaling, yarn);
        assert_eq!(config.to_hf_json("bfloat16")["rope_scaling"]["attn_factor"], json!(0.8782488562869419));
        assert_eq!(HfConfig::from_hf_json(&config.to_hf_json("bfloat16").to_string(), "again").unwrap(), HfConfig { torch_dtype: Some(DType::BF16), ..config.clone() });
        // No factor: the ratio of the contexts; no max_position_embeddings either: the family's.
        let no_factor = with(&with(qwen3, "max_position_embeddings", Value::Null), "rope_scaling", json!({"rope_type": "yarn", "original_max_position_embeddings": 8192}));
        let RopeScaling::Yarn { factor, .. } = HfConfig::from_hf_json(&no_factor, "n").unwrap().rope_scaling else { panic!("yarn") };
        assert_eq!(factor, 32768.0 / 8192.0);
        // `truncate`: absent, true; an explicit null, false (transformers' `.get("truncate", True)`).
        let truncate = |value: Value| {
            let RopeScaling::Yarn { truncate, .. } = HfConfig::from_hf_json(&with(qwen3, "rope_scaling", json!({"rope_type": "yarn", "factor": 4.0, "truncate": value})), "t").unwrap().rope_scaling else { panic!("yarn") };
            truncate
        };
        assert!(!truncate(Value::Null) && !truncate(json!(false)) && truncate(json!(true)));
        // Written back only where false (transformers before 4.54 warn of it as unknown), and
        // read back the same either way.
        let written = |value: Value| HfConfig::from_hf_json(&with(qwen3, "rope_scaling", json!({"rope_type": "yarn", "factor": 4.0, "truncate": value})), "t").unwrap().to_hf_json("bfloat16");
        assert_eq!((written(json!(true))["rope_scaling"].get("truncate"), written(json!(false))["rope_scaling"].get("truncate")), (None, Some(&json!(false))));
        for value in [json!(true), json!(false)] {
            let config = HfConfig::from_hf_json(&with(qwen3, "rope_scaling", json!({"rope_type": "yarn", "factor": 4.0, "truncate": value})), "t").unwrap();
            assert_eq!(HfConfig::from_hf_json(&config.to_hf_json("bfloat16").to_string(), "again").unwrap(), HfConfig { torch_dtype: Some(DType::BF16), ..config });
        }
    }

    /// Dynamic NTK RoPE is read (transformers 4's `type` too) with the context up to which it
    /// is plain RoPE, the config's `max_position_embeddings`.
    #[test]
    fn dynamic_rope_is_read_with_its_plain_context() {
        for key in ["rope_type", "type"] {
            let config = HfConfig::from_hf_json(&with(LLAMA, "rope_scaling", json!({key: "dynamic", "factor": 4.0})), "d").unwrap();
            assert_eq!(config.rope_scaling, RopeScaling::Dynamic { factor: 4.0, max_position_embeddings: config.max_position_embeddings });
            assert_eq!(config.rope_scaling.positions_represented(), Some(config.max_position_embeddings));
        }
        assert_eq!(RopeScaling::Default.positions_represented(), None);
    }

    #[test]
    fn written_back_it_reads_the_same() {
        for text in [LLAMA.to_string(), with(LLAMA, "rope_scaling", json!({"type": "linear", "factor": 2.0})), with(LLAMA, "rope_scaling", json!({"type": "dynamic", "factor": 2.0}))] {
            let config = HfConfig::from_hf_json(&text, "a").unwrap();
            let again = HfConfig::from_hf_json(&config.to_hf_json("bfloat16").to_string(), "b").unwrap();
            assert_eq!(config, again);
        }
    }

    #[test]
    fn family_defaults_are_transformers_own() {
        let qwen3 = r#"{"model_type": "qwen3", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}"#;
        let config = HfConfig::from_hf_json(qwen3, "q").unwrap();
        assert_eq!(config.head_dim, 128, "Qwen3's head_dim defaults to 128, not hidden / heads");
        assert!(config.qk_norm && !config.qkv_bias);
        let qwen2 = HfConfig::from_hf_json(&with(qwen3, "model_type", json!("qwen2")), "q").unwrap();
        assert_eq!(qwen2.head_dim, 16);
        assert!(qwen2.qkv_bias && !qwen2.output_bias && !qwen2.qk_norm);
        assert_eq!((config.max_position_embeddings, qwen2.max_position_embeddings), (32_768, 32_768));
        assert_eq!((config.bos_token_id, config.eos_token_ids.clone()), (None, vec![]), "Qwen names no token ids by default");

        // Mistral: a window of 4096 keys where the file names none (a `null` window is none),
        // 131072 positions, token ids 1 and 2.
        let mistral_text = with(qwen3, "model_type", json!("mistral"));
        let mistral = HfConfig::from_hf_json(&mistral_text, "m").unwrap();
        assert_eq!(mistral.sliding_window, Some(4096));
        assert_eq!((mistral.rope_theta, mistral.rms_norm_eps, mistral.tie_word_embeddings), (10_000.0, 1e-6, false));
        assert_eq!((mistral.max_position_embeddings, mistral.bos_token_id, mistral.eos_token_ids.clone()), (131_072, Some(1), vec![2]));
        let mut no_window: Value = serde_json::from_str(&mistral_text).unwrap();
        no_window["sliding_window"] = Value::Null;
        assert_eq!(HfConfig::from_hf_json(&no_window.to_string(), "m").unwrap().sliding_window, None);
        let window = HfConfig::from_hf_json(&with(&mistral_text, "sliding_window", json!(512)), "m").unwrap();
        assert_eq!(window.sliding_window, Some(512));

        // kv heads where the file names none: Mistral 8, Qwen 32, Llama the head count; `null`
        // is the head count for every family.
        let heads = |model_type: &str, kv: Option<Value>| {
            let mut config: Value = serde_json::from_str(&with(LLAMA, "model_type", json!(model_type))).unwrap();
            let object = config.as_object_mut().unwrap();
            object.remove("architectures");
            object.insert("num_attention_heads".into(), json!(64));
            object.insert("head_dim".into(), json!(32));
            match kv {
                Some(kv) => object.insert("num_key_value_heads".into(), kv),
                None => object.remove("num_key_value_heads"),
            };
            HfConfig::from_hf_json(&config.to_string(), "h").unwrap().num_key_value_heads
        };
        for (model_type, absent) in [("llama", 64), ("mistral", 8), ("qwen2", 32), ("qwen3", 32)] {
            assert_eq!(heads(model_type, None), absent, "{model_type}'s kv heads where the file names none");
            assert_eq!(heads(model_type, Some(Value::Null)), 64, "{model_type}'s kv heads where the file says null");
        }

        // Llama: 2048 positions and token ids 1 and 2 where the file names none; `null` is none.
        let llama = with(&with(&with(LLAMA, "max_position_embeddings", Value::Null), "bos_token_id", Value::Null), "eos_token_id", Value::Null);
        let config = HfConfig::from_hf_json(&llama, "l").unwrap();
        assert_eq!((config.max_position_embeddings, config.bos_token_id, config.eos_token_ids), (2048, Some(1), vec![2]));
        let mut nulls: Value = serde_json::from_str(&llama).unwrap();
        nulls["bos_token_id"] = Value::Null;
        nulls["eos_token_id"] = Value::Null;
        let config = HfConfig::from_hf_json(&nulls.to_string(), "l").unwrap();
        assert_eq!((config.bos_token_id, config.eos_token_ids), (None, vec![]));
    }

    /// What transformers reads as the same model: "swish" for SiLU, and Qwen's sliding window
    /// switched on where no layer slides (16 layers, windows from layer 28 on; or a window of
    /// `null`).
    #[test]
    fn what_transformers_reads_as_the_same_model_is_accepted() {
        assert!(HfConfig::from_hf_json(&with(LLAMA, "hidden_act", json!("swish")), "a").is_ok());
        let qwen2 = with(&with(&with(LLAMA, "model_type", json!("qwen2")), "architectures", Value::Null), "use_sliding_window", json!(true));
        assert_eq!(HfConfig::from_hf_json(&qwen2, "a").unwrap().sliding_window, None);
        let mut no_window: Value = serde_json::from_str(&with(&qwen2, "max_window_layers", json!(8))).unwrap();
        no_window["sliding_window"] = Value::Null;
        assert_eq!(HfConfig::from_hf_json(&no_window.to_string(), "a").unwrap().sliding_window, None);
        // A Mistral config listing one attention for every layer (Ministral's, as transformers
        // loads it): the window on every layer, or on none.
        let mistral = with(&with(&with(LLAMA, "model_type", json!("mistral")), "architectures", Value::Null), "sliding_window", json!(512));
        for (kind, window) in [("sliding_attention", Some(512)), ("full_attention", None)] {
            let listed = with(&mistral, "layer_types", json!(vec![kind; 16]));
            assert_eq!(HfConfig::from_hf_json(&listed, "a").unwrap().sliding_window, window, "{kind}");
        }
    }

    #[test]
    fn transformers_5_rope_parameters_hold_theta_and_type() {
        let text = with(&with(LLAMA, "rope_scaling", Value::Null), "rope_parameters", json!({"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}));
        let config = HfConfig::from_hf_json(&text, "c").unwrap();
        assert_eq!((config.rope_theta, config.rope_scaling), (1e6, RopeScaling::Linear { factor: 4.0 }));
        let default = with(&with(LLAMA, "rope_scaling", Value::Null), "rope_parameters", json!({"rope_type": "default", "rope_theta": 5e5}));
        assert_eq!(HfConfig::from_hf_json(&default, "c").unwrap().rope_scaling, RopeScaling::Default);
        // Theta alone, no type: plain RoPE at that theta.
        let theta_alone = with(&with(LLAMA, "rope_scaling", Value::Null), "rope_parameters", json!({"rope_theta": 5e5}));
        let config = HfConfig::from_hf_json(&theta_alone, "c").unwrap();
        assert_eq!((config.rope_theta, config.rope_scaling), (5e5, RopeScaling::Default));
        // Both, saying the same: read.
        let scaling = json!({"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6});
        let both = with(&with(LLAMA, "rope_scaling", scaling.clone()), "rope_parameters", scaling);
        assert_eq!(HfConfig::from_hf_json(&both, "c").unwrap().rope_scaling, RopeScaling::Linear { factor: 4.0 });
    }

    #[test]
    fn what_the_decoder_cannot_represent_is_refused_naming_key_and_file() {
        let cases = [
            (with(LLAMA, "model_type", json!("gemma2")), "`model_type` is \"gemma2\"; this decoder represents llama, mistral, qwen2, qwen3"),
            (with(LLAMA, "architectures", json!(["LlamaForSequenceClassification"])), "`architectures`"),
            (with(LLAMA, "rope_scaling", json!({"rope_type": "longrope", "factor": 4.0})), "`rope_scaling.rope_type` is \"longrope\""),
            (with(LLAMA, "rope_scaling", json!({"type": "su", "factor": 4.0})), "`rope_scaling.type` is \"su\""),
            // transformers 5's RoPE per layer type: at the section's top level it read as
            // default RoPE at θ 10 000, silently.
            (
                with(&with(LLAMA, "rope_scaling", Value::Null), "rope_parameters", json!({"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}})),
                "`rope_parameters.full_attention` is an object: RoPE per layer type is not read",
            ),
            (with(LLAMA, "rope_scaling", json!({"rope_type": "yarn", "factor": 4.0, "truncate": "no"})), "`rope_scaling.truncate` is \"no\""),
            (with(LLAMA, "rope_scaling", json!({"rope_type": "llama3", "factor": 8.0})), "`rope_scaling.low_freq_factor` is missing"),
            // A scaling that lost its type is not plain RoPE.
            (
                with(LLAMA, "rope_scaling", json!({"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
                "`rope_scaling` has [\"factor\", \"low_freq_factor\", \"high_freq_factor\", \"original_max_position_embeddings\"] but no rope_type",
            ),
            (with(LLAMA, "rope_scaling", json!({"rope_type": 3, "factor": 8.0})), "`rope_scaling.rope_type` is 3, not a name"),
            (with(LLAMA, "num_key_value_heads", json!(5)), "`num_key_value_heads` is 5, which does not divide num_attention_heads 32"),
            (with(LLAMA, "hidden_size", Value::Null), "`hidden_size` is missing"),
            (with(LLAMA, "hidden_size", json!(0)), "`hidden_size` must be a whole number above 0, got 0"),
            // Sizes past any model: a damaged file, refused before anything is sized by them.
            (with(LLAMA, "vocab_size", json!(u64::MAX)), "`vocab_size` is 18446744073709551615, past any model this decoder builds (at most 67108864)"),
            (with(LLAMA, "num_hidden_layers", json!(1u64 << 40)), "`num_hidden_layers` is 1099511627776, past any model"),
            (with(LLAMA, "head_dim", json!(1u64 << 32)), "`head_dim` is 4294967296, past any model"),
            (with(LLAMA, "intermediate_size", json!((1u64 << 20) + 2)), "`intermediate_size` is 1048578, past any model"),
            (with(LLAMA, "rms_norm_eps", json!(-1.0)), "`rms_norm_eps` must be a finite number above 0"),
            (with(LLAMA, "hidden_act", json!("gelu")), "`hidden_act` is \"gelu\""),
            (with(LLAMA, "mlp_bias", json!(true)), "`mlp_bias` is true"),
            (with(LLAMA, "head_dim", json!(63)), "`head_dim` is 63; RoPE rotates pairs"),
            // transformers 5 would take the rope_scaling a user added beside rope_parameters;
            // a factor transformers 5 reads inside them; a quantized checkpoint.
            (with(LLAMA, "rope_parameters", json!({"rope_type": "default", "rope_theta": 1e6})), "`rope_scaling` is {"),
            (
                with(&with(LLAMA, "rope_scaling", Value::Null), "rope_parameters", json!({"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})),
                "`rope_parameters.partial_rotary_factor` is 0.5",
            ),
            (with(LLAMA, "quantization_config", json!({"quant_method": "fp8", "weight_block_size": [128, 128]})), "`quantization_config` is present (fp8)"),
            (
                with(&with(&with(&with(LLAMA, "model_type", json!("qwen2")), "architectures", Value::Null), "use_sliding_window", json!(true)), "max_window_layers", json!(8)),
                "`use_sliding_window` is true and some layers slide",
            ),
            // 0: every layer slides (transformers' `i >= max_window_layers`).
            (
                with(&with(&with(&with(LLAMA, "model_type", json!("qwen2")), "architectures", Value::Null), "use_sliding_window", json!(true)), "max_window_layers", json!(0)),
                "`use_sliding_window` is true and some layers slide",
            ),
            (
                with(&with(&with(&with(LLAMA, "model_type", json!("qwen3")), "architectures", Value::Null), "use_sliding_window", json!(true)), "layer_types", one_sliding_layer()),
                "`use_sliding_window` is true and some layers slide",
            ),
            // Listed sliding layers with sliding switched off (no window: transformers fails).
            (
                with(&with(&with(LLAMA, "model_type", json!("qwen3")), "architectures", Value::Null), "layer_types", one_sliding_layer()),
                "`layer_types` lists sliding_attention layers with no window (use_sliding_window is false",
            ),
            // One kind a layer, as transformers checks.
            (
                with(&with(&with(LLAMA, "model_type", json!("qwen3")), "architectures", Value::Null), "layer_types", json!([])),
                "`layer_types` has 0 entries for 16 layers",
            ),
            // Mistral with per-layer attention is Ministral's (a window on some layers alone),
            // and sliding layers need a window.
            (
                with(&with(&with(LLAMA, "model_type", json!("mistral")), "architectures", Value::Null), "layer_types", one_sliding_layer()),
                "`layer_types` lists attention that differs by layer",
            ),
            (
                with(&with(&with(LLAMA, "model_type", json!("mistral")), "architectures", Value::Null), "layer_types", json!(vec!["sliding_attention"; 16]))
                    .replacen('{', r#"{"sliding_window": null, "#, 1),
                "`layer_types` lists attention that differs by layer (or sliding layers without a sliding_window)",
            ),
            ("[1, 2]".to_string(), "`config.json` is not a JSON object"),
        ];
        for (text, expected) in cases {
            let error = refused(&text).to_string();
            assert!(error.starts_with("ckpt/config.json: ") && error.contains(expected), "expected {expected:?}, got {error}");
        }
        // As transformers' AutoModelForCausalLM, which goes by model_type: no class named, or
        // an older spelling of the causal LM, loads.
        for architectures in [json!([]), json!(["LLaMAForCausalLM"])] {
            HfConfig::from_hf_json(&with(LLAMA, "architectures", architectures.clone()), "ckpt/config.json").unwrap_or_else(|e| panic!("{architectures}: {e}"));
        }
    }
}
