//! Hugging Face checkpoint folders in and out: `config.json` and `model.safetensors` (or the
//! shards that `model.safetensors.index.json` lists) into a [`Decoder`] ([`from_pretrained`],
//! read here from the safetensors headers), and a `Decoder` back into such a folder that
//! transformers loads ([`save_pretrained`], through burn-store).
//!
//! Hugging Face names each tensor after its module path (`model.layers.3.self_attn.q_proj.weight`)
//! and stores linear weights `[out, in]`; the decoder's record names them after its own fields
//! and holds `[in, out]`. [`HF_TO_DECODER`] renames, a `Linear`'s weight is transposed (as
//! burn-store's PyTorch adapter does), and every tensor becomes f32 (the master weights)
//! whatever the file holds (bf16, f16, f32). Every tensor the decoder has must come from the
//! files with its shape, and every tensor in the files must be used: otherwise the error names
//! the tensor and the file, before training, and before any weight is read (but a tied
//! model's embeddings and head, compared to tell how they are tied). The weights are
//! read one tensor at a time, now or when each parameter is first used
//! ([`from_pretrained_lazily`], for ZeRO-3, which never holds the whole model).

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    path::{Path, PathBuf},
    rc::Rc,
    sync::{Arc, Mutex},
};

use burn::{
    module::{Module, ModuleMapper, Param},
    tensor::{DType, Tensor, TensorData, backend::Backend},
};
use burn_store::{BurnToPyTorchAdapter, KeyRemapper, ModuleAdapter, ModuleSnapshot, SafetensorsStore, TensorSnapshot};

use crate::{
    ConfigError, HfConfig,
    decoder::{Decoder, DecoderConfig},
};

/// Hugging Face's tensor names (regular expressions) and the decoder's, in the order applied.
/// `lm_head.weight` keeps its name; anything else keeps its own and stays unused: refused,
/// but for what transformers skips too (`rotary_emb.inv_freq`, a tied model's `lm_head`
/// equal to its embeddings: [`from_pretrained`]).
pub const HF_TO_DECODER: [(&str, &str); 7] = [
    (r"^model\.embed_tokens\.weight$", "embedding.weight"),
    (r"^model\.norm\.weight$", "norm.gamma"),
    (r"^model\.layers\.(\d+)\.input_layernorm\.weight$", "blocks.$1.attention_norm.gamma"),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.weight$", "blocks.$1.ffn_norm.gamma"),
    (r"^model\.layers\.(\d+)\.self_attn\.(q|k)_norm\.weight$", "blocks.$1.attention.${2}_norm.gamma"),
    (r"^model\.layers\.(\d+)\.self_attn\.(q|k|v|o)_proj\.", "blocks.$1.attention.w$2."),
    (r"^model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.", "blocks.$1.feed_forward.$2."),
];

/// The decoder's tensor names and Hugging Face's: [`HF_TO_DECODER`] backwards.
pub const DECODER_TO_HF: [(&str, &str); 7] = [
    (r"^embedding\.weight$", "model.embed_tokens.weight"),
    (r"^norm\.gamma$", "model.norm.weight"),
    (r"^blocks\.(\d+)\.attention_norm\.gamma$", "model.layers.$1.input_layernorm.weight"),
    (r"^blocks\.(\d+)\.ffn_norm\.gamma$", "model.layers.$1.post_attention_layernorm.weight"),
    (r"^blocks\.(\d+)\.attention\.(q|k)_norm\.gamma$", "model.layers.$1.self_attn.${2}_norm.weight"),
    (r"^blocks\.(\d+)\.attention\.w(q|k|v|o)\.", "model.layers.$1.self_attn.${2}_proj."),
    (r"^blocks\.(\d+)\.feed_forward\.(gate|up|down)\.", "model.layers.$1.mlp.${2}_proj."),
];

const WEIGHTS_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";

/// What a checkpoint folder holds beside its config and weights that a fine-tuned copy needs
/// too (its tokenizer, chat template and generation settings): a save carries them over from
/// the checkpoint it started from ([`HfCheckpointWriter::include`]).
pub const COMPANION_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    // transformers' named template for conversations given tools (`crate::chat` renders with it).
    "additional_chat_templates/tool_use.jinja",
    // The slow tokenizers' files, which checkpoints ship beside tokenizer.json.
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "generation_config.json",
];

/// The [`COMPANION_FILES`] that belong to the tokenizer (all but the generation settings):
/// taken from the folder of the tokenizer a run used where it names one of its own.
pub fn is_tokenizer_file(name: &str) -> bool {
    COMPANION_FILES.contains(&name) && name != "generation_config.json"
}

/// Whether a save writes a file of this name (config, weights, index, companions): the
/// files it may replace when it replaces a folder.
fn written_by_a_save(name: &str) -> bool {
    name == "config.json"
        || name == WEIGHTS_FILE
        || name == INDEX_FILE
        || COMPANION_FILES.contains(&name)
        // The folder of a companion within one (what it holds is looked at on its own).
        || companion_folder(name)
        || is_shard_name(name)
}

/// Whether `name` is a folder companions sit in (`additional_chat_templates`).
fn companion_folder(name: &str) -> bool {
    COMPANION_FILES.iter().any(|file| file.split_once('/').is_some_and(|(folder, _)| folder == name))
}

/// Whether `name` is a weight shard's as a save names them, `model-00001-of-00004.safetensors`
/// (not any `model-*.safetensors` a user keeps beside them).
fn is_shard_name(name: &str) -> bool {
    let five_digits = |part: &str| part.len() == 5 && part.bytes().all(|b| b.is_ascii_digit());
    name.strip_prefix("model-").and_then(|rest| rest.strip_suffix(".safetensors")).and_then(|rest| rest.split_once("-of-")).is_some_and(|(k, n)| five_digits(k) && five_digits(n))
}

/// An error when `dir` holds anything a save did not write (a run's checkpoint, a README, a
/// template of one's own beside the companions): a save replaces the folder whole and would
/// delete it.
fn check_only_saved_files(dir: &Path) -> Result<(), CheckpointError> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Ok(()) };
    let names: Vec<String> = entries.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    // A companion folder's own entries, by their paths in the save (`folder/file`).
    let within = |folder: &str| -> Vec<String> {
        std::fs::read_dir(dir.join(folder)).map_or_else(|_| Vec::new(), |entries| entries.flatten().map(|e| format!("{folder}/{}", e.file_name().to_string_lossy())).collect())
    };
    let mut others: Vec<String> = names
        .iter()
        .flat_map(|name| if companion_folder(name) { within(name) } else { vec![name.clone()] })
        .filter(|name| !written_by_a_save(name))
        .collect();
    if others.is_empty() {
        return Ok(());
    }
    others.sort();
    let shown = if others.len() > 4 { format!("{} and {} more", others[..4].join(", "), others.len() - 4) } else { others.join(", ") };
    Err(CheckpointError::file(
        dir,
        format!(
            "holds {shown}, which a save would delete (it replaces the folder whole, as it holds a saved model alone): \
             save into a new folder, or one an earlier save wrote"
        ),
    ))
}

/// Why a checkpoint folder cannot be loaded: what, and in which file.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{file}: {problem}")]
    File { file: String, problem: String },
    #[error("{file}: tensor `{tensor}` {problem}")]
    Tensor { file: String, tensor: String, problem: String },
}

impl CheckpointError {
    fn file(file: &Path, problem: impl fmt::Display) -> Self {
        CheckpointError::File { file: file.display().to_string(), problem: problem.to_string() }
    }
}

/// A checkpoint's configuration and its model, with f32 weights.
pub struct Pretrained<B: Backend> {
    pub config: HfConfig,
    pub model: Decoder<B>,
}

/// Loads the checkpoint folder `dir` (see the module doc). Where config.json ties the head to
/// the embeddings, the weights are read as transformers 5 reads them: an `lm_head.weight`
/// beside the embeddings and equal to them is skipped; one that differs makes the model untied
/// (the returned config says so, and a save writes it so), with a warning; one alone is the
/// embeddings.
pub fn from_pretrained<B: Backend>(dir: &Path, device: &B::Device) -> Result<Pretrained<B>, CheckpointError> {
    load(dir, device, false)
}

/// [`from_pretrained`] with every check made (names, shapes, dtypes, each tensor's bytes in
/// its file) but no weight read: each parameter is a lazy one (burn's `Param::uninitialized`)
/// that reads its tensor from the files when first used. Code that takes a model apart one
/// parameter at a time (ZeRO-3's cut, `ShardedParameters::shard_from`) then never holds the
/// whole model. The files must stay as they are until then: a parameter whose file changed
/// since (its size or modification time; another file in its place) panics when it is
/// first used, naming the file.
pub fn from_pretrained_lazily<B: Backend>(dir: &Path, device: &B::Device) -> Result<Pretrained<B>, CheckpointError> {
    load(dir, device, true)
}

fn load<B: Backend>(dir: &Path, device: &B::Device, lazily: bool) -> Result<Pretrained<B>, CheckpointError> {
    let (config, headers, tied) = config_and_weights(dir)?;
    if tied == TiedWeights::Different {
        tracing::warn!(
            folder = %dir.display(),
            "config.json ties the word embeddings, but the weights hold an lm_head.weight that differs from them: loaded untied, \
             the head its own, as transformers 5 loads it (saved with tie_word_embeddings false). To tie them, remove lm_head.weight"
        );
    }
    let sources = decoder_sources(&headers, tied)?;
    // burn builds nothing here (`Config::init` is lazy): each parameter becomes a lazy one that
    // reads its tensor, every check made before any weight is read.
    let mut checked = ReadWeights::new(&sources, false);
    let model = DecoderConfig::from_hf(&config).init::<B>(device).map(&mut checked);
    if let Some(error) = checked.error {
        return Err(error);
    }
    let unused = sources.iter().filter(|(path, _)| !checked.used.contains(*path));
    for (path, source) in unused {
        if !skipped_when_unused(path, config.tie_word_embeddings) {
            return Err(source.error("is not used: this decoder has no such tensor".into()));
        }
    }
    if let Some(missing) = checked.missing {
        return Err(CheckpointError::Tensor { file: dir.display().to_string(), tensor: hf_name(&missing), problem: "is missing from the weight files".into() });
    }
    if lazily {
        return Ok(Pretrained { config, model });
    }
    // Read now, each tensor in place of its lazy parameter (whose read never runs): a read that
    // fails is an error here, where a lazy one can only panic.
    let mut read = ReadWeights::new(&sources, true);
    let model = model.map(&mut read);
    match read.error {
        Some(error) => Err(error),
        None => Ok(Pretrained { config, model }),
    }
}

/// What transformers skips too, where the decoder has no place for it: RoPE's frequencies
/// kept by old conversions (computed from config.json here), and a tied head saved beside the
/// embeddings (equal to them: [`TiedWeights`]).
fn skipped_when_unused(path: &str, tied_config: bool) -> bool {
    is_saved_rope_frequencies(path) || (path == HEAD && tied_config)
}

/// RoPE's frequencies as old conversions saved them, per layer.
fn is_saved_rope_frequencies(path: &str) -> bool {
    path.ends_with("rotary_emb.inv_freq")
}

/// Every tensor of the weight files under the decoder's name for it ([`HF_TO_DECODER`]; a
/// tied head alone becomes the embeddings), each checked to lie whole in its file. Two
/// tensors of one name are refused, but for RoPE's saved frequencies (skipped).
fn decoder_sources(headers: &[SafetensorsHeader], tied: TiedWeights) -> Result<BTreeMap<String, TensorSource>, CheckpointError> {
    let mut renames = HF_TO_DECODER.to_vec();
    if tied == TiedWeights::HeadAlone {
        // The tied weight's one copy, under the head's name.
        renames.push((r"^lm_head\.weight$", "embedding.weight"));
    }
    let mut sources: BTreeMap<String, TensorSource> = BTreeMap::new();
    for header in headers {
        let names: Vec<&String> = header.tensors.keys().filter(|name| *name != "__metadata__").collect();
        for (name, path) in names.iter().zip(renamed(&renames, names.iter().map(|name| name.as_str()))) {
            let source = TensorSource::new(header, name, &header.tensors[name.as_str()])?;
            if let Some(earlier) = sources.get(&path) {
                // RoPE's saved frequencies are skipped whatever they hold. A tied head named twice
                // is refused with the rest: `tied_weights` compares one copy with the embeddings.
                if is_saved_rope_frequencies(&path) {
                    continue;
                }
                return Err(if earlier.file == source.file {
                    source.error(format!("and `{}` are the same tensor of the decoder (`{path}`): keep one", earlier.name))
                } else {
                    source.error(format!("is in more than one file (also in {})", earlier.file.display()))
                });
            }
            sources.insert(path, source);
        }
    }
    Ok(sources)
}

/// Each float parameter of a decoder given its tensor from the files: read now (`read_now`),
/// or as a lazy parameter that reads it when first used. Follows the paths as burn-store's
/// `Applier` does (a `Vec`'s index a segment, an enum's variant none), and transposes where
/// its PyTorch adapter does (a `Linear`'s weight: Hugging Face's `[out, in]`, the decoder's
/// `[in, out]`).
struct ReadWeights<'a> {
    sources: &'a BTreeMap<String, TensorSource>,
    read_now: bool,
    path: Vec<String>,
    containers: Vec<String>,
    used: BTreeSet<String>,
    /// The first parameter no file holds.
    missing: Option<String>,
    /// The first tensor that does not fit or cannot be read: the parameters after it are left
    /// as they are.
    error: Option<CheckpointError>,
}

impl<'a> ReadWeights<'a> {
    fn new(sources: &'a BTreeMap<String, TensorSource>, read_now: bool) -> Self {
        Self { sources, read_now, path: Vec::new(), containers: Vec::new(), used: BTreeSet::new(), missing: None, error: None }
    }
}

impl<B: Backend> ModuleMapper<B> for ReadWeights<'_> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.containers.push(container_type.to_string());
        if !container_type.starts_with("Enum:") {
            self.path.push(name.to_string());
        }
    }

    fn exit_module(&mut self, _name: &str, container_type: &str) {
        self.containers.pop();
        if !container_type.starts_with("Enum:") {
            self.path.pop();
        }
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let path = self.path.join(".");
        if self.error.is_some() {
            return param;
        }
        let Some(source) = self.sources.get(&path) else {
            self.missing.get_or_insert(path);
            return param;
        };
        self.used.insert(path);
        let module = self.containers.iter().rev().find(|container| container.starts_with("Struct:") || container.starts_with("Enum:"));
        let transposed = D == 2 && module.is_some_and(|module| module == "Struct:Linear") && self.path.last().is_some_and(|name| name == "weight");
        let shape = param.lazy_shape();
        let mut expected = shape.dims::<D>().to_vec();
        if transposed {
            expected.reverse();
        }
        if source.shape != expected {
            self.error = Some(source.error(format!("has shape {:?}; config.json makes it {expected:?}", source.shape)));
            return param;
        }
        let source = TensorSource { transposed, ..source.clone() };
        if self.read_now {
            return match source.read() {
                Ok(data) => {
                    let id = param.id;
                    let tensor = Tensor::from_data(data, (&param.lazy_device(), DType::F32));
                    param.transform_for_load(tensor, id)
                }
                Err(error) => {
                    self.error = Some(error);
                    param
                }
            };
        }
        let device = param.lazy_device();
        let (id, requires_grad, mapper) = ulysses_training::take_lazy_flag(param);
        let (on_load, on_save) = (mapper.clone(), mapper.clone());
        // As `transform_for_load` does: the loaded tensor through the parameter's load mapper.
        let init = move |device: &B::Device, requires_grad: bool| {
            let data = source.read().unwrap_or_else(|error| panic!("a parameter read lazily from its checkpoint: {error}"));
            mapper.on_load(Tensor::from_data(data, (device, DType::F32))).set_require_grad(requires_grad)
        };
        Param::uninitialized(id, init, device, requires_grad, shape).load_mapper(move |tensor| on_load.on_load(tensor)).save_mapper(move |tensor| on_save.on_save(tensor))
    }
}

/// The weight files of a checkpoint folder: the single file, else the shards its index lists
/// (transformers' order, where a folder holds both).
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let single = dir.join(WEIGHTS_FILE);
    if single.exists() {
        return Ok(vec![single]);
    }
    let index = dir.join(INDEX_FILE);
    if index.exists() {
        let text = ulysses_core::files::read_to_string_regular(&index).map_err(|e| CheckpointError::file(&index, e))?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| CheckpointError::file(&index, e))?;
        let map = json["weight_map"].as_object().ok_or_else(|| CheckpointError::file(&index, "has no `weight_map` object"))?;
        let files: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
        if let Some(file) = files.iter().find(|file| !ulysses_training::checkpoint::is_plain_name(file)) {
            return Err(CheckpointError::file(&index, format!("its weight_map names `{file}`, not a file in the checkpoint's folder")));
        }
        return Ok(files.into_iter().map(|file| dir.join(file)).collect());
    }
    let instead = crate::config::not_a_transformers_checkpoint(dir).map(|why| format!(": it {why}")).unwrap_or_default();
    Err(CheckpointError::file(dir, format!("holds neither {WEIGHTS_FILE} nor {INDEX_FILE}{instead}")))
}

/// A tensor's byte range in its file's data (`data_offsets`, begin and end).
fn data_offsets(tensor: &serde_json::Value) -> Option<(u64, u64)> {
    Some((tensor["data_offsets"][0].as_u64()?, tensor["data_offsets"][1].as_u64()?))
}

const NO_DATA_OFFSETS: &str = "has no data_offsets in the header";

/// Whether `file` is a Git LFS pointer (three lines naming its content) in place of its data:
/// a Hugging Face repository (weights, tokenizer, a dataset) cloned without git-lfs holds one
/// for each large file.
pub fn is_git_lfs_pointer(file: &Path) -> bool {
    use std::io::Read;
    let mut start = [0u8; GIT_LFS_POINTER.len()];
    // A file shorter than the pointer's first words is no pointer.
    let read = ulysses_core::files::open_regular(file).and_then(|mut opened| opened.read_exact(&mut start));
    read.is_ok() && is_git_lfs_pointer_text(&start)
}

/// How a Git LFS pointer file begins.
const GIT_LFS_POINTER: &[u8] = b"version https://git-lfs.github.com/spec/";

/// [`is_git_lfs_pointer`] of a file's bytes already read.
pub(crate) fn is_git_lfs_pointer_text(bytes: &[u8]) -> bool {
    bytes.starts_with(GIT_LFS_POINTER)
}

/// The fix for a Git LFS pointer ([`is_git_lfs_pointer`]).
pub const GIT_LFS_FIX: &str = "run `git lfs pull` in its clone (with git-lfs installed), or download it with `huggingface-cli download REPO --local-dir FOLDER`";

/// The problem and fix said of a checkpoint's file that is a Git LFS pointer.
pub(crate) fn git_lfs_pointer_problem() -> String {
    format!("is a Git LFS pointer, not its data (the checkpoint was cloned without git-lfs): {GIT_LFS_FIX}")
}

/// safetensors' limit on a header's size: past it, the first 8 bytes are not a header length.
const MAX_SAFETENSORS_HEADER: u64 = 100_000_000;

/// Refuses a safetensors file that is not whole, before any tensor is read: the 8-byte header
/// length, the JSON header, and every tensor's bytes the header places must lie within the
/// file. A download or copy cut short is the usual cause, and the fix is to fetch the file again.
fn check_safetensors_whole(file: &Path) -> Result<SafetensorsHeader, CheckpointError> {
    use std::io::Read;
    let error = |problem: String| CheckpointError::file(file, problem);
    let metadata = std::fs::metadata(file).map_err(|e| error(e.to_string()))?;
    if is_git_lfs_pointer(file) {
        return Err(error(git_lfs_pointer_problem()));
    }
    let size = metadata.len();
    let cut_short = |needed: u64| {
        error(format!(
            "is cut short: {size} bytes, where its header places {needed}. The download or copy did not finish: fetch it \
             again (`huggingface-cli download REPO --local-dir FOLDER` resumes one) and compare its size with the repository's"
        ))
    };
    let mut reader = ulysses_core::files::open_regular(file).map_err(|e| error(e.to_string()))?;
    let mut prefix = [0u8; 8];
    if size < 8 {
        return Err(cut_short(8));
    }
    reader.read_exact(&mut prefix).map_err(|e| error(e.to_string()))?;
    let header_len = u64::from_le_bytes(prefix);
    let not_safetensors = |why: &str| error(format!("is not a safetensors file ({why}): give the folder a model.safetensors saved by transformers or safetensors"));
    if header_len > MAX_SAFETENSORS_HEADER {
        return Err(not_safetensors("its first 8 bytes are no header length"));
    }
    if 8 + header_len > size {
        return Err(cut_short(8 + header_len));
    }
    let mut header = vec![0u8; header_len as usize];
    reader.read_exact(&mut header).map_err(|e| error(e.to_string()))?;
    let header: serde_json::Value = serde_json::from_slice(&header).map_err(|_| not_safetensors("its header is not JSON"))?;
    let tensors = header.as_object().ok_or_else(|| not_safetensors("its header is not a JSON object"))?;
    let tensor_error = |name: &String, problem: String| CheckpointError::Tensor { file: file.display().to_string(), tensor: name.clone(), problem };
    // Weights in another form than floats (int8 or fp8 quantized, packed 4-bit) would reach the
    // model as raw integers: named here, not a panic deep in the load.
    if let Some((name, dtype)) = tensors
        .iter()
        .filter(|(name, _)| *name != "__metadata__")
        .find_map(|(name, tensor)| tensor["dtype"].as_str().filter(|dtype| TensorValues::width(dtype).is_none()).map(|dtype| (name, dtype)))
    {
        return Err(tensor_error(name, format!("is {dtype}, not a float (F32, BF16, F16 or F64): a quantized checkpoint; fine-tune its unquantized original")));
    }
    // The tensors' bytes one after another from the data's start, as safetensors writes them
    // (and its reader requires): no gap, no overlap, no range that ends before it begins.
    let mut ranges = Vec::with_capacity(tensors.len());
    for (name, tensor) in tensors.iter().filter(|(name, _)| *name != "__metadata__") {
        let (begin, end) = data_offsets(tensor).ok_or_else(|| tensor_error(name, NO_DATA_OFFSETS.into()))?;
        ranges.push((begin, end, name));
    }
    ranges.sort();
    let mut data_end = 0;
    for (begin, end, name) in ranges {
        if begin != data_end || end < begin {
            return Err(tensor_error(
                name,
                format!("lies at bytes {begin}..{end} of the data, where the tensors before it end at {data_end}: not a file that safetensors wrote; fetch it again"),
            ));
        }
        data_end = end;
    }
    // Past u64 only in a corrupt header: then no file is that long.
    let needed = (8 + header_len).checked_add(data_end).unwrap_or(u64::MAX);
    if needed > size {
        return Err(cut_short(needed));
    }
    if needed < size {
        return Err(error(format!(
            "has {} bytes past the {needed} its header places: not a file that safetensors or transformers wrote (two files \
             joined, or a download appended to an old one): fetch it again",
            size - needed
        )));
    }
    Ok(SafetensorsHeader { file: file.to_path_buf(), data_start: 8 + header_len, tensors: tensors.clone(), stamp: FileStamp::of(&metadata) })
}

/// The configuration of checkpoint folder `dir` as [`from_pretrained`] builds its model: its
/// config.json, untied where the weights hold a head of its own (without the warning
/// `from_pretrained` gives). Reads the weight files' headers (and, for a tied model with both
/// weights saved, the two weights), not the model.
pub fn checkpoint_config(dir: &Path) -> Result<HfConfig, CheckpointError> {
    Ok(config_and_weights(dir)?.0)
}

/// `dir`'s config, its weight files' headers (each file checked whole), and how a tied
/// config's weights are held: as transformers 5 reads them (4 tied them whatever the files held).
fn config_and_weights(dir: &Path) -> Result<(HfConfig, Vec<SafetensorsHeader>, TiedWeights), CheckpointError> {
    let mut config = HfConfig::from_hf(dir)?;
    let headers = weight_files(dir)?.iter().map(|file| check_safetensors_whole(file)).collect::<Result<Vec<_>, _>>()?;
    let tied = if config.tie_word_embeddings { tied_weights(&headers)? } else { TiedWeights::Embeddings };
    if tied == TiedWeights::Different {
        config.tie_word_embeddings = false;
    }
    Ok((config, headers, tied))
}

/// A safetensors file's header: each tensor's dtype, shape and byte range (from `data_start`).
struct SafetensorsHeader {
    file: PathBuf,
    data_start: u64,
    tensors: serde_json::Map<String, serde_json::Value>,
    /// The file as it was checked: a lazy read refuses it changed ([`TensorSource::values`]).
    stamp: FileStamp,
}

/// A file's size, modification time (where the file system keeps one) and identity (its
/// device and inode on Unix: another file renamed into its place, as a copy that keeps times
/// would be, is another file).
#[derive(Debug, Clone, PartialEq)]
struct FileStamp {
    size: u64,
    modified: Option<std::time::SystemTime>,
    identity: Option<(u64, u64)>,
}

impl FileStamp {
    fn of(metadata: &std::fs::Metadata) -> Self {
        #[cfg(unix)]
        let identity = {
            use std::os::unix::fs::MetadataExt;
            Some((metadata.dev(), metadata.ino()))
        };
        #[cfg(not(unix))]
        let identity = None;
        Self { size: metadata.len(), modified: metadata.modified().ok(), identity }
    }
}

/// Where a config that ties the head to the embeddings finds their weights, as transformers 5
/// reads such a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TiedWeights {
    /// The embeddings alone, or beside an `lm_head.weight` equal to them: tied.
    Embeddings,
    /// `lm_head.weight` alone: tied, the embeddings its values.
    HeadAlone,
    /// Both, with different values: transformers does not tie them, the head is its own.
    Different,
}

const EMBEDDINGS: &str = "model.embed_tokens.weight";
const HEAD: &str = "lm_head.weight";

/// How the files of a tied model hold its embeddings and head ([`TiedWeights`]); both present
/// are compared value by value as the f32 weights they load as (torch's `equal` after
/// transformers loads them: -0 equals 0), streamed a block at a time.
fn tied_weights(headers: &[SafetensorsHeader]) -> Result<TiedWeights, CheckpointError> {
    let find = |name: &str| headers.iter().find_map(|header| header.tensors.get(name).map(|tensor| (header, tensor)));
    let (embeddings, head) = match (find(EMBEDDINGS), find(HEAD)) {
        // Neither: the embeddings are named missing with the rest.
        (_, None) => return Ok(TiedWeights::Embeddings),
        (None, Some(_)) => return Ok(TiedWeights::HeadAlone),
        (Some(embeddings), Some(head)) => (embeddings, head),
    };
    if embeddings.1["shape"] != head.1["shape"] {
        return Ok(TiedWeights::Different);
    }
    let mut embeddings = TensorSource::new(embeddings.0, EMBEDDINGS, embeddings.1)?.values()?;
    let mut head = TensorSource::new(head.0, HEAD, head.1)?.values()?;
    // Same shapes, and each tensor's bytes checked against its shape: blocks of equal lengths.
    let (mut a, mut b) = (Vec::new(), Vec::new());
    loop {
        a.clear();
        b.clear();
        if !(embeddings.read_block(&mut a)? && head.read_block(&mut b)?) {
            break;
        }
        if a.iter().zip(&b).any(|(x, y)| x != y) {
            return Ok(TiedWeights::Different);
        }
    }
    Ok(TiedWeights::Embeddings)
}

/// Where one float tensor lies in a safetensors file (checked against its shape and dtype),
/// and how the decoder takes it: as f32, transposed or not.
#[derive(Debug, Clone)]
struct TensorSource {
    file: PathBuf,
    stamp: FileStamp,
    /// Its name in the file.
    name: String,
    /// Its first byte in the file.
    start: u64,
    dtype: String,
    /// Its shape in the file.
    shape: Vec<usize>,
    /// Read as `[shape[1], shape[0]]` (a `Linear`'s weight).
    transposed: bool,
}

impl TensorSource {
    fn new(header: &SafetensorsHeader, name: &str, tensor: &serde_json::Value) -> Result<Self, CheckpointError> {
        let error = |problem: String| CheckpointError::Tensor { file: header.file.display().to_string(), tensor: name.to_string(), problem };
        let (begin, end) = data_offsets(tensor).ok_or_else(|| error(NO_DATA_OFFSETS.into()))?;
        let dtype = tensor["dtype"].as_str().unwrap_or_default().to_string();
        let width = TensorValues::width(&dtype).ok_or_else(|| error(format!("is {dtype}, not a float")))?;
        let shape = tensor["shape"].as_array().and_then(|dims| dims.iter().map(|dim| dim.as_u64().map(|dim| dim as usize)).collect::<Option<Vec<_>>>());
        let bytes = shape.as_ref().and_then(|shape| shape.iter().try_fold(width as u64, |bytes, &dim| bytes.checked_mul(dim as u64)));
        match shape {
            Some(shape) if bytes == Some(end.saturating_sub(begin)) => {
                Ok(Self { file: header.file.clone(), stamp: header.stamp.clone(), name: name.to_string(), start: header.data_start + begin, dtype, shape, transposed: false })
            }
            _ => Err(error(format!(
                "has {} bytes in the file for shape {} of {dtype}: not a file that safetensors wrote; fetch it again",
                end.saturating_sub(begin),
                tensor["shape"]
            ))),
        }
    }

    fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    fn error(&self, problem: String) -> CheckpointError {
        CheckpointError::Tensor { file: self.file.display().to_string(), tensor: self.name.clone(), problem }
    }

    /// Its values as f32, a block at a time; refused where the file is not the one checked.
    fn values(&self) -> Result<TensorValues, CheckpointError> {
        use std::io::{Seek, SeekFrom};
        let mut file = std::fs::File::open(&self.file).map_err(|e| CheckpointError::file(&self.file, e))?;
        let now = FileStamp::of(&file.metadata().map_err(|e| CheckpointError::file(&self.file, e))?);
        if now != self.stamp {
            return Err(CheckpointError::file(
                &self.file,
                format!(
                    "changed since the folder was loaded ({}): load the folder again",
                    if now.size != self.stamp.size {
                        format!("{} bytes then, {} now", self.stamp.size, now.size)
                    } else if now.identity != self.stamp.identity {
                        "another file in its place".to_string()
                    } else {
                        "modified again at its size".to_string()
                    }
                ),
            ));
        }
        file.seek(SeekFrom::Start(self.start)).map_err(|e| CheckpointError::file(&self.file, e))?;
        Ok(TensorValues { reader: file, bytes: Vec::new(), file: self.file.clone(), dtype: self.dtype.clone(), remaining: self.elements() as u64 })
    }

    /// The tensor as the decoder holds it: f32, transposed where [`Self::transposed`] says.
    fn read(&self) -> Result<TensorData, CheckpointError> {
        let mut values = Vec::with_capacity(self.elements());
        let mut blocks = self.values()?;
        while blocks.read_block(&mut values)? {}
        Ok(match (self.transposed, self.shape.as_slice()) {
            (true, &[rows, columns]) => TensorData::new(transposed(&values, rows, columns), [columns, rows]),
            _ => TensorData::new(values, self.shape.clone()),
        })
    }
}

/// A row-major `rows × columns` matrix transposed, in tiles that stay in cache.
fn transposed(values: &[f32], rows: usize, columns: usize) -> Vec<f32> {
    const TILE: usize = 32;
    let mut out = vec![0.0; values.len()];
    for row_tile in (0..rows).step_by(TILE) {
        for column_tile in (0..columns).step_by(TILE) {
            for row in row_tile..(row_tile + TILE).min(rows) {
                for column in column_tile..(column_tile + TILE).min(columns) {
                    out[column * rows + row] = values[row * columns + column];
                }
            }
        }
    }
    out
}

/// One float tensor of a safetensors file, read as f32 (what the loader makes of it) a block
/// of elements at a time.
struct TensorValues {
    reader: std::fs::File,
    /// A block's bytes, the buffer kept from block to block.
    bytes: Vec<u8>,
    file: PathBuf,
    dtype: String,
    remaining: u64,
}

impl TensorValues {
    const BLOCK: usize = 1 << 20;

    fn width(dtype: &str) -> Option<usize> {
        Some(match dtype {
            "F64" => 8,
            "F32" => 4,
            "BF16" | "F16" => 2,
            _ => return None,
        })
    }

    /// The next block of values appended to `values`; false past the last.
    fn read_block(&mut self, values: &mut Vec<f32>) -> Result<bool, CheckpointError> {
        use std::io::Read;
        if self.remaining == 0 {
            return Ok(false);
        }
        let count = (self.remaining as usize).min(Self::BLOCK);
        let width = Self::width(&self.dtype).expect("checked when opened");
        self.bytes.resize(count * width, 0);
        self.reader.read_exact(&mut self.bytes).map_err(|e| CheckpointError::file(&self.file, e))?;
        self.remaining -= count as u64;
        // One loop per dtype: no match per element.
        let bytes = &self.bytes;
        match self.dtype.as_str() {
            "F64" => values.extend(bytes.chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32)),
            "F32" => values.extend(bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))),
            "BF16" => values.extend(bytes.chunks_exact(2).map(|b| burn::tensor::bf16::from_le_bytes([b[0], b[1]]).to_f32())),
            _ => values.extend(bytes.chunks_exact(2).map(|b| burn::tensor::f16::from_le_bytes([b[0], b[1]]).to_f32())),
        }
        Ok(true)
    }
}

/// `names` renamed by `patterns` (regular expressions and their replacements, each applied
/// in turn, as burn-store's `KeyRemapper` applies them), compiled once.
fn renamed<'a>(patterns: &[(&str, &str)], names: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let remapper = KeyRemapper::from_patterns(patterns.to_vec()).expect("the name patterns are valid regular expressions");
    let pairs = remapper.to_regex_pairs();
    names.into_iter().map(|name| pairs.iter().fold(name.to_string(), |name, (pattern, to)| pattern.replace_all(&name, to.as_str()).into_owned())).collect()
}

/// The Hugging Face names of the decoder's tensor paths: [`DECODER_TO_HF`] applied as
/// burn-store applies it when saving.
fn hf_names<'a>(paths: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    renamed(&DECODER_TO_HF, paths)
}

/// The Hugging Face name of one of the decoder's tensor paths, for messages.
fn hf_name(path: &str) -> String {
    hf_names([path]).remove(0)
}

/// How [`save_pretrained_with`] writes the weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SaveOptions {
    /// f32, bf16 or f16.
    pub dtype: DType,
    /// Weights of more bytes than this (in `dtype`) are split into shards
    /// `model-0000K-of-0000N.safetensors` of at most this many bytes each (a larger tensor
    /// alone in one), listed by `model.safetensors.index.json`, as transformers shards them.
    pub max_shard_bytes: u64,
}

/// transformers' default `max_shard_size` ("5GB").
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

impl SaveOptions {
    pub fn new(dtype: DType) -> Self {
        Self { dtype, max_shard_bytes: DEFAULT_MAX_SHARD_BYTES }
    }
}

/// [`save_pretrained_with`] in `dtype`, sharded past transformers' default 5 GB.
pub fn save_pretrained<B: Backend>(model: &Decoder<B>, config: &HfConfig, dir: &Path, dtype: DType) -> Result<(), CheckpointError> {
    save_pretrained_with(model, config, dir, SaveOptions::new(dtype))
}

/// Writes `model` with `config` as a Hugging Face checkpoint folder `dir`: `config.json`
/// and `model.safetensors` (or shards and their index, see [`SaveOptions`]) with Hugging
/// Face's names and `[out, in]` linear weights. The folder is written beside `dir` and renamed
/// into place, so a crash leaves the earlier folder whole (for the instant between two
/// renames, beside `dir` as `.NAME.earlier-PID`, which the next save puts back); the next
/// save also removes the torn folders of killed saves.
pub fn save_pretrained_with<B: Backend>(model: &Decoder<B>, config: &HfConfig, dir: &Path, options: SaveOptions) -> Result<(), CheckpointError> {
    save_pretrained_including(model, config, dir, options, &[])
}

/// [`save_pretrained_with`], with `companions` (a file and the [`COMPANION_FILES`] name it
/// takes: the tokenizer and generation settings the model was trained with) copied into the
/// folder.
pub fn save_pretrained_including<B: Backend>(model: &Decoder<B>, config: &HfConfig, dir: &Path, options: SaveOptions, companions: &[(PathBuf, String)]) -> Result<(), CheckpointError> {
    check_model_fits_config(model, config, dir)?;
    let tensors = tensor_shapes(model);
    let mut writer = HfCheckpointWriter::begin(config, dir, options, tensors)?;
    for (file, name) in companions {
        writer.include(file, name)?;
    }
    for shard in 0..writer.shard_count() {
        writer.write_shard(shard, model)?;
    }
    writer.finish()
}

/// Refuses to save `model` with a `config` that describes another model: its config.json
/// would not be the weights' (saved with an untied config, a tied model's folder lacks
/// `lm_head.weight`, which transformers fills with random values, warning alone). Compared
/// by parameter, path and shape, against the model `config` builds (lazily: nothing allocated).
fn check_model_fits_config<B: Backend>(model: &Decoder<B>, config: &HfConfig, dir: &Path) -> Result<(), CheckpointError> {
    let device = model.devices().first().cloned().unwrap_or_default();
    let shapes = |model: &Decoder<B>| -> Vec<(String, Vec<usize>)> { ulysses_training::parameter_paths(model).into_iter().zip(ulysses_training::parameter_shapes(model)).collect() };
    let (saved, described) = (shapes(model), shapes(&DecoderConfig::from_hf(config).init::<B>(&device)));
    if saved == described {
        return Ok(());
    }
    let find = |tensors: &[(String, Vec<usize>)], path: &str| tensors.iter().find(|(p, _)| p == path).map(|(_, shape)| shape.clone());
    let problem = match (saved.iter().find(|(path, shape)| find(&described, path).as_ref() != Some(shape)), described.iter().find(|(path, _)| find(&saved, path).is_none())) {
        (Some((path, shape)), _) => match find(&described, path) {
            Some(described) => format!("the model's `{path}` is {shape:?}, config.json's model's {described:?}"),
            None => format!("the model has `{path}` ({shape:?}), which config.json's model has not"),
        },
        (None, Some((path, shape))) => format!("config.json's model has `{path}` ({shape:?}), which the model has not"),
        (None, None) => "its parameters are in another order than config.json's model's".to_string(),
    };
    Err(CheckpointError::file(
        dir,
        format!("the config given describes another model than the one saved ({problem}): save a model with the config it was built from (DecoderConfig::from_hf)"),
    ))
}

/// Every tensor's module path and shape, in the model's order.
fn tensor_shapes<B: Backend>(model: &Decoder<B>) -> Vec<(String, Vec<usize>)> {
    model.collect(None, None, false).iter().map(|t| (t.full_path(), t.shape.to_vec())).collect()
}

/// What [`save_pretrained_including`] writes, taken from the model into host memory (each
/// safetensors shard serialized) to be written later, on another thread: a run goes on
/// training while the folder is written. Holds the model in the saved dtype; while a shard is
/// taken, that shard twice (burn-store hands its bytes out as a copy).
pub struct HfCheckpointSnapshot {
    config: HfConfig,
    dir: PathBuf,
    options: SaveOptions,
    companions: Vec<(PathBuf, String)>,
    tensors: Vec<(String, Vec<usize>)>,
    /// Each shard's safetensors file, in [`plan_shard_paths`]'s order (the writer's).
    shards: Vec<Vec<u8>>,
}

impl HfCheckpointSnapshot {
    /// Reads `model`'s tensors (a device sync), cast and named as the folder `dir` saves them.
    pub fn take<B: Backend>(model: &Decoder<B>, config: &HfConfig, dir: &Path, options: SaveOptions, companions: &[(PathBuf, String)]) -> Result<Self, CheckpointError> {
        check_model_fits_config(model, config, dir)?;
        let tensors = tensor_shapes(model);
        let shards = plan_shard_paths(&tensors, options)
            .into_iter()
            .map(|paths| {
                let store = save_shard(model, SafetensorsStore::from_bytes(None), paths, options.dtype, dir)?;
                store.get_bytes().map_err(|e| CheckpointError::file(dir, e))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { config: config.clone(), dir: dir.to_path_buf(), options, companions: companions.to_vec(), tensors, shards })
    }

    /// Writes the folder as [`save_pretrained_including`] would have when the snapshot was taken.
    pub fn write(self) -> Result<(), CheckpointError> {
        let mut writer = HfCheckpointWriter::begin(&self.config, &self.dir, self.options, self.tensors)?;
        for (file, name) in &self.companions {
            writer.include(file, name)?;
        }
        for (shard, bytes) in self.shards.into_iter().enumerate() {
            let weights = writer.partial.join(writer.file_name(shard));
            std::fs::write(&weights, bytes).map_err(io(&weights))?;
            writer.shard_written(shard, weights);
        }
        writer.finish()
    }

    /// The folder it is written to.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The dtype its weights are written in.
    pub fn dtype(&self) -> DType {
        self.options.dtype
    }
}

/// `store` (a file at `at`, or bytes) with `model`'s tensors `paths`, as a save writes them:
/// Hugging Face's names and layouts, cast to `dtype`, and the metadata transformers asks for.
/// Refused where a weight does not fit `dtype` (past f16's 65 504, written as infinity).
fn save_shard<B: Backend>(model: &Decoder<B>, store: SafetensorsStore, paths: Vec<String>, dtype: DType, at: &Path) -> Result<SafetensorsStore, CheckpointError> {
    let cast = CastFloats { dtype, past_range: Arc::default() };
    let past_range = cast.past_range.clone();
    // transformers refuses safetensors whose `format` is not `pt` (burn-store writes `safetensors`).
    let mut store = store.with_full_paths(paths).with_to_adapter(BurnToPyTorchAdapter.chain(cast)).metadata("format", "pt");
    for (from, to) in DECODER_TO_HF {
        store = store.with_key_remapping(from, to);
    }
    model.save_into(&mut store).map_err(|e| CheckpointError::file(at, e))?;
    if let Some(path) = past_range.lock().map_or(None, |mut past| past.take()) {
        return Err(CheckpointError::file(at, format!("`{path}` holds values past f16's largest (65504), which f16 writes as infinity: save in bf16 (the trainer's --save-hf-dtype bf16)")));
    }
    Ok(store)
}

/// A Hugging Face checkpoint folder written one safetensors shard at a time (what
/// [`save_pretrained_with`] does), so that a model whose parameters are parts on many ranks
/// (ZeRO-3) need only gather one shard's tensors at a time
/// ([`shard_paths`](Self::shard_paths) names them; [`plan_shard_paths`] gives the same plan on
/// ranks that do not write).
pub struct HfCheckpointWriter {
    dir: PathBuf,
    partial: PathBuf,
    name: String,
    dtype: DType,
    /// Every tensor's module path and its bytes as saved, in the model's order.
    tensors: Vec<(String, u64)>,
    shards: Vec<Vec<usize>>,
    hf: Vec<String>,
    weight_map: serde_json::Map<String, serde_json::Value>,
    written: Vec<PathBuf>,
    /// Whether the folder beside `dir` was moved into place or is kept (named in an error);
    /// otherwise a save that failed removes it when dropped, rather than leave a model's size
    /// of torn files until the next save.
    kept: bool,
}

impl Drop for HfCheckpointWriter {
    fn drop(&mut self) {
        if !self.kept {
            let _ = std::fs::remove_dir_all(&self.partial);
        }
    }
}

/// The tensors' module paths in each safetensors shard [`HfCheckpointWriter`] writes for
/// `tensors` (module path and shape each, in the model's order).
pub fn plan_shard_paths(tensors: &[(String, Vec<usize>)], options: SaveOptions) -> Vec<Vec<String>> {
    let sized = sized(tensors, options.dtype);
    plan_shards(&sized, options.max_shard_bytes).into_iter().map(|shard| shard.into_iter().map(|i| sized[i].0.clone()).collect()).collect()
}

fn sized(tensors: &[(String, Vec<usize>)], dtype: DType) -> Vec<(String, u64)> {
    tensors.iter().map(|(path, shape)| (path.clone(), (shape.iter().product::<usize>() * dtype.size()) as u64)).collect()
}

impl HfCheckpointWriter {
    /// Starts the folder `dir` (beside it, renamed into place by [`finish`](Self::finish)) for
    /// a model of `tensors` (module path and shape each, in the model's order), writing
    /// `config.json`. The tensors are taken as `config`'s model's: [`save_pretrained_including`]
    /// and [`HfCheckpointSnapshot::take`] check that they are, this does not (it has no model).
    pub fn begin(config: &HfConfig, dir: &Path, options: SaveOptions, tensors: Vec<(String, Vec<usize>)>) -> Result<Self, CheckpointError> {
        let dir = &save_folder(dir)?;
        let dtype = options.dtype;
        let torch_dtype = match dtype {
            DType::F32 => "float32",
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
            other => return Err(CheckpointError::file(dir, format!("weights are saved as f32, bf16 or f16, not {other:?}"))),
        };
        let name = folder_name(dir)?;
        recover_from_killed_saves(dir, &name);
        let partial = dir.with_file_name(format!(".{name}.partial-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&partial);
        std::fs::create_dir_all(&partial).map_err(io(&partial))?;
        let config_file = partial.join("config.json");
        let text = serde_json::to_string_pretty(&config.to_hf_json(torch_dtype)).expect("a JSON value serializes");
        std::fs::write(&config_file, text + "\n").map_err(io(&config_file))?;
        let tensors = sized(&tensors, dtype);
        let shards = plan_shards(&tensors, options.max_shard_bytes);
        let hf = hf_names(tensors.iter().map(|(path, _)| path.as_str()));
        Ok(Self { dir: dir.to_path_buf(), partial, name, dtype, tensors, shards, hf, weight_map: serde_json::Map::new(), written: vec![config_file], kept: false })
    }

    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// The module paths of shard `shard`'s tensors.
    pub fn shard_paths(&self, shard: usize) -> Vec<String> {
        self.shards[shard].iter().map(|&i| self.tensors[i].0.clone()).collect()
    }

    fn file_name(&self, shard: usize) -> String {
        if self.shards.len() == 1 { WEIGHTS_FILE.to_string() } else { format!("model-{:05}-of-{:05}.safetensors", shard + 1, self.shards.len()) }
    }

    /// Writes shard `shard` from `model`, in which its tensors must be whole (the others may
    /// be anything).
    pub fn write_shard<B: Backend>(&mut self, shard: usize, model: &Decoder<B>) -> Result<(), CheckpointError> {
        let weights = self.partial.join(self.file_name(shard));
        save_shard(model, SafetensorsStore::from_file(&weights), self.shard_paths(shard), self.dtype, &weights)?;
        self.shard_written(shard, weights);
        Ok(())
    }

    /// Notes shard `shard` written to `weights`, for the index and the final sync.
    fn shard_written(&mut self, shard: usize, weights: PathBuf) {
        let file_name = self.file_name(shard);
        for &i in &self.shards[shard] {
            self.weight_map.insert(self.hf[i].clone(), file_name.clone().into());
        }
        self.written.push(weights);
    }

    /// Copies `file` into the folder as `name`, one of [`COMPANION_FILES`] (from the checkpoint
    /// the model started from, or the tokenizer it was trained with).
    pub fn include(&mut self, file: &Path, name: &str) -> Result<(), CheckpointError> {
        if !COMPANION_FILES.contains(&name) {
            return Err(CheckpointError::file(file, format!("{name} is not one of the files a save carries over ({})", COMPANION_FILES.join(", "))));
        }
        let copy = self.partial.join(name);
        // A companion within a folder of its own: the folder too, made durable with the files.
        if let Some(folder) = copy.parent().filter(|folder| *folder != self.partial) {
            if !folder.exists() {
                std::fs::create_dir_all(folder).map_err(io(folder))?;
                self.written.push(folder.to_path_buf());
            }
        }
        std::fs::copy(file, &copy).map_err(io(file))?;
        self.written.push(copy);
        Ok(())
    }

    /// Keeps the new folder beside `dir` as `NAME.unsaved-PID`, out of the way of the cleaning
    /// of torn saves' folders (`.NAME.partial-PID`), or where it is if that rename fails: where
    /// it could not be put in place. Returns where it is.
    fn keep_beside(&mut self) -> PathBuf {
        let unsaved = self.dir.with_file_name(format!("{}.unsaved-{}", self.name, std::process::id()));
        self.kept = true;
        if std::fs::rename(&self.partial, &unsaved).is_ok() { unsaved } else { self.partial.clone() }
    }

    /// Writes the index (when sharded), makes every file durable and renames the folder into
    /// place: the earlier folder aside, the new one in, the earlier one removed. A folder that
    /// holds what no save wrote (found now: it may have been made since the run began) is left
    /// as it is, and so is the new one, beside it, named in the error.
    pub fn finish(mut self) -> Result<(), CheckpointError> {
        if self.shards.len() > 1 {
            let index_file = self.partial.join(INDEX_FILE);
            let total: u64 = self.tensors.iter().map(|t| t.1).sum();
            let index = serde_json::json!({ "metadata": { "total_size": total }, "weight_map": self.weight_map });
            std::fs::write(&index_file, serde_json::to_string_pretty(&index).expect("a JSON value serializes") + "\n").map_err(io(&index_file))?;
            self.written.push(index_file);
        }
        // Every file, and the folder's entries, durable before the folder is renamed.
        for file in self.written.iter().chain([&self.partial]) {
            std::fs::File::open(file).and_then(|f| f.sync_all()).map_err(io(file))?;
        }
        // Once the new folder is whole (its index written), so that the one left beside is
        // a checkpoint transformers loads.
        let dir = self.dir.clone();
        let dir = &dir;
        if let Err(CheckpointError::File { file, problem }) = check_only_saved_files(dir) {
            let kept = self.keep_beside();
            return Err(CheckpointError::file(Path::new(&file), format!("{problem}; the model was written to {} instead", kept.display())));
        }
        let earlier = dir.with_file_name(format!(".{}.earlier-{}", self.name, std::process::id()));
        let had_earlier = dir.exists();
        if had_earlier && let Err(e) = std::fs::rename(dir, &earlier) {
            // The earlier model stays in place, and the new one beside it.
            let kept = self.keep_beside();
            return Err(CheckpointError::file(
                dir,
                format!("cannot set the earlier model aside to put the new one in place ({e}); the new model was written to {}, the earlier one is as it was", kept.display()),
            ));
        }
        if let Err(e) = std::fs::rename(&self.partial, dir) {
            // Neither model lost: the earlier one back in place, the new one kept beside it.
            let put_back = had_earlier && std::fs::rename(&earlier, dir).is_ok();
            let kept = self.keep_beside();
            let earlier_note = match (had_earlier, put_back) {
                (false, _) => String::new(),
                (true, true) => "; the earlier model is back in place".to_string(),
                (true, false) => format!("; the earlier model is in {}", earlier.display()),
            };
            return Err(CheckpointError::file(dir, format!("cannot put the new model in place ({e}); it was written to {}{earlier_note}", kept.display())));
        }
        self.kept = true;
        // The renames made durable before the earlier model goes: a crash then finds one of the
        // two in place.
        let parent = parent_folder(dir);
        std::fs::File::open(parent).and_then(|f| f.sync_all()).map_err(io(parent))?;
        // The new model is in place: a model set aside that cannot be removed is no reason to
        // stop a run (the next save removes it).
        if had_earlier && let Err(e) = std::fs::remove_dir_all(&earlier) {
            tracing::warn!(folder = %earlier.display(), "cannot remove the model the save replaced: {e}");
        }
        Ok(())
    }
}

/// What saves into `dir` that were killed left beside it, set right before a new one: a
/// torn folder (`.NAME.partial-PID`) is removed; the earlier model put aside
/// (`.NAME.earlier-PID`) is removed where `dir` holds the new one, and put back where a kill
/// between the two renames left no `dir`. Only the leftovers of processes that are gone:
/// another run may be saving there now.
fn recover_from_killed_saves(dir: &Path, name: &str) {
    let Ok(entries) = std::fs::read_dir(parent_folder(dir)) else { return };
    for entry in entries.flatten() {
        let file_name = entry.file_name().to_string_lossy().into_owned();
        let Some((kind, pid)) = file_name.strip_prefix(&format!(".{name}.")).and_then(|rest| rest.split_once('-')) else { continue };
        if !pid.bytes().all(|b| b.is_ascii_digit()) || pid.is_empty() || process_lives(pid) {
            continue;
        }
        let path = entry.path();
        let done = match kind {
            "partial" => std::fs::remove_dir_all(&path).map(|()| "removed a save's folder its kill left torn"),
            "earlier" if dir.exists() => std::fs::remove_dir_all(&path).map(|()| "removed the model a killed save had replaced"),
            "earlier" => std::fs::rename(&path, dir).map(|()| "put back the model a save killed between its two renames had set aside"),
            _ => continue,
        };
        match done {
            Ok(what) => tracing::info!(folder = %path.display(), "{what}"),
            Err(error) => tracing::warn!(folder = %path.display(), %error, "cannot set right what a killed save left"),
        }
    }
}

/// Sets right what saves into `dir` that were killed left beside it, as a save's begin does:
/// for a run to call as it starts (a kill between a save's two renames left no folder at `dir`,
/// its model set aside, until the next save into it began). A check that writes nothing
/// (`--check`) does not.
pub fn recover_killed_saves(dir: &Path) -> Result<(), CheckpointError> {
    let dir = &save_folder(dir)?;
    let name = folder_name(dir)?;
    recover_from_killed_saves(dir, &name);
    Ok(())
}

/// The last component of the folder `dir`: what a save's folders beside it are named after.
fn folder_name(dir: &Path) -> Result<String, CheckpointError> {
    dir.file_name().map(|n| n.to_string_lossy().into_owned()).ok_or_else(|| CheckpointError::file(dir, "is not a folder name"))
}

/// The folder `dir` is written beside: its parent, `.` for a bare name.
fn parent_folder(dir: &Path) -> &Path {
    dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

/// The folder a save writes for `dir`: where a link leads, where it is one (renaming the link
/// would replace it with a folder, and leave the earlier model where it leads).
fn save_folder(dir: &Path) -> Result<PathBuf, CheckpointError> {
    match std::fs::symlink_metadata(dir) {
        Ok(meta) if meta.file_type().is_symlink() => {
            std::fs::canonicalize(dir).map_err(|e| CheckpointError::file(dir, format!("is a link that leads nowhere ({e}): make it lead to a folder, or remove it")))
        }
        _ => Ok(dir.to_path_buf()),
    }
}

/// Whether process `pid` is alive and another (Linux: `/proc/PID`); elsewhere assumed alive,
/// so that nothing of a save that may be running is touched. This process's own pid is a
/// killed process's (a container restarted gives the trainer the same pid each time): it
/// saves one folder at a time, and begins none twice.
fn process_lives(pid: &str) -> bool {
    if pid == std::process::id().to_string() {
        return false;
    }
    !cfg!(target_os = "linux") || Path::new("/proc").join(pid).exists()
}

/// Checks, before any training, that [`save_pretrained`] will be able to write the folder
/// `dir`: that it is a folder if it exists, and that the nearest existing folder above it (where
/// the new one is written, then renamed into place, the missing folders between made) is a folder
/// that can be written. Creates nothing but a probe file it removes. A run would otherwise find
/// out at its save, after its training. A run calls [`recover_killed_saves`] first.
pub fn check_save_destination(dir: &Path) -> Result<(), CheckpointError> {
    let dir = &save_folder(dir)?;
    let name = folder_name(dir)?;
    if dir.exists() && !dir.is_dir() {
        return Err(CheckpointError::file(dir, "exists and is not a folder: choose another path, or move the file"));
    }
    check_only_saved_files(dir)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let device = |path: &Path| std::fs::metadata(path).map(|m| m.dev()).ok();
        if dir.exists() && device(dir) != device(parent_folder(dir)) {
            return Err(CheckpointError::file(
                dir,
                "is a mount point: a save writes the new model beside the folder and renames it into place, which a mount point \
                 refuses; give a folder inside it (DIR/model)",
            ));
        }
    }
    let parent = parent_folder(dir);
    // A relative path's last ancestor is "", which does not exist: then the working folder.
    let existing = parent.ancestors().find(|a| a.exists()).unwrap_or(Path::new("."));
    let cannot = |why: String| CheckpointError::file(existing, format!("{why}, so the checkpoint could not be saved in {}: choose a folder you can write", dir.display()));
    if !existing.is_dir() {
        return Err(cannot("is not a folder".into()));
    }
    let probe = existing.join(format!(".{name}.write-check-{}", std::process::id()));
    std::fs::write(&probe, b"").and_then(|()| std::fs::remove_file(&probe)).map_err(|e| cannot(format!("cannot be written ({e})")))
}

/// Tensors (name, bytes) in order into shards of at most `max_bytes` each (a larger tensor
/// alone in one); the indices of each shard's tensors.
fn plan_shards(tensors: &[(String, u64)], max_bytes: u64) -> Vec<Vec<usize>> {
    let mut shards: Vec<Vec<usize>> = vec![vec![]];
    let mut bytes = 0;
    for (i, (_, size)) in tensors.iter().enumerate() {
        if bytes > 0 && bytes + size > max_bytes {
            shards.push(vec![]);
            bytes = 0;
        }
        shards.last_mut().expect("one shard at least").push(i);
        bytes += size;
    }
    shards
}

/// An I/O error on `path`, as a [`CheckpointError`].
fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |e| CheckpointError::file(path, e)
}

/// Every floating-point tensor to one dtype: f32 master weights in, the dtype asked for out.
#[derive(Debug, Clone)]
struct CastFloats {
    dtype: DType,
    /// The first tensor whose finite values the cast made infinite (burn-store panics on a
    /// snapshot's error: it is said after the save instead).
    past_range: Arc<Mutex<Option<String>>>,
}

impl ModuleAdapter for CastFloats {
    fn adapt(&self, snapshot: &TensorSnapshot) -> TensorSnapshot {
        let target = self.dtype;
        if snapshot.dtype == target || !matches!(snapshot.dtype, DType::F32 | DType::BF16 | DType::F16 | DType::F64) {
            return snapshot.clone();
        }
        let (data, path, past_range) = (snapshot.clone_data_fn(), snapshot.full_path(), self.past_range.clone());
        TensorSnapshot::from_closure(
            Rc::new(move || {
                let source = data()?;
                // f16's largest is 65 504, and from 65 520 on a value rounds to infinity.
                if target == DType::F16 && source.iter::<f64>().any(|value| value.is_finite() && value.abs() >= 65520.0) {
                    if let Ok(mut past) = past_range.lock() {
                        past.get_or_insert_with(|| path.clone());
                    }
                }
                Ok(source.convert_dtype(target))
            }),
            target,
            snapshot.shape.clone(),
            snapshot.path_stack.clone().unwrap_or_default(),
            snapshot.container_stack.clone().unwrap_or_default(),
            snapshot.tensor_id.unwrap_or_default(),
        )
    }

    fn clone_box(&self) -> Box<dyn ModuleAdapter> {
        Box::new(self.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A safetensors file at `path` of `tensors` (name, dtype, shape, little-endian bytes), and
    /// its header as the loader reads it.
    fn write(path: &Path, tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) -> SafetensorsHeader {
        let (mut header, mut data) = (serde_json::Map::new(), Vec::new());
        for (name, dtype, shape, bytes) in tensors {
            header.insert(name.to_string(), serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [data.len(), data.len() + bytes.len()]}));
            data.extend(bytes);
        }
        let header = serde_json::to_vec(&header).unwrap();
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend(&header);
        file.extend(&data);
        std::fs::write(path, file).unwrap();
        check_safetensors_whole(path).unwrap()
    }

    /// An index whose weight_map names a file outside the folder (`..`, an absolute path, a
    /// subfolder's) is refused, naming it: it loaded another model's weights.
    #[test]
    fn an_index_naming_a_file_outside_the_folder_is_refused() {
        let dir = std::env::temp_dir().join(format!("ulysses-index-names-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (file, refused) in [("../other/model.safetensors", true), ("/elsewhere/model.safetensors", true), ("sub/model.safetensors", true), ("model-00001-of-00002.safetensors", false)] {
            let index = serde_json::json!({ "weight_map": { "model.embed_tokens.weight": file } });
            std::fs::write(dir.join(INDEX_FILE), index.to_string()).unwrap();
            match weight_files(&dir) {
                Ok(files) => assert!(!refused && files == [dir.join(file)], "{file}: {files:?}"),
                Err(error) => assert!(refused && error.to_string().contains(&format!("its weight_map names `{file}`")), "{file}: {error}"),
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A header whose tensors' bytes leave a gap, overlap, or end before they begin is refused
    /// naming the tensor, as safetensors' own reader refuses it (a zero-sized range backwards
    /// would otherwise place a tensor outside the file).
    #[test]
    fn tensors_whose_bytes_do_not_follow_one_another_are_refused() {
        let dir = std::env::temp_dir().join(format!("ulysses-offsets-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (case, second, shape) in [("a gap", [12u64, 20], vec![2]), ("an overlap", [4, 12], vec![2]), ("backwards", [8, 4], vec![0])] {
            let header = serde_json::json!({
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": shape, "data_offsets": second},
            });
            let header = serde_json::to_vec(&header).unwrap();
            let mut file = (header.len() as u64).to_le_bytes().to_vec();
            file.extend(&header);
            file.extend(vec![0u8; 20]);
            let path = dir.join("model.safetensors");
            std::fs::write(&path, file).unwrap();
            let error = check_safetensors_whole(&path).err().unwrap_or_else(|| panic!("{case}: accepted")).to_string();
            assert!(error.contains("tensor `b` lies at bytes") && error.contains("fetch it again"), "{case}: {error}");
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A tied config's embeddings and head are compared as the f32 weights they load as,
    /// across files and dtypes, past one block: a bf16 copy in another shard is the same
    /// weight, -0 equals 0, and a difference in the last element unties them; a tensor whose
    /// bytes do not fit its shape is refused.
    #[test]
    fn a_tied_pair_is_compared_as_the_f32_weights_it_loads_as() {
        use burn::tensor::bf16;
        let dir = std::env::temp_dir().join(format!("ulysses-tied-weights-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let n = TensorValues::BLOCK + 3;
        // Multiples of 1/64 below 2: bf16 holds each exactly.
        let values: Vec<f32> = (0..n).map(|i| ((i % 251) as f32 - 125.0) / 64.0).collect();
        let as_f32 = |values: &[f32]| values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
        let as_bf16 = |values: &[f32]| values.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect::<Vec<u8>>();
        let embeddings = || write(&dir.join("a.safetensors"), &[(EMBEDDINGS, "F32", vec![n], as_f32(&values))]);
        let head = |name: &str, bytes: Vec<u8>| write(&dir.join(name), &[(HEAD, "BF16", vec![n], bytes)]);

        assert_eq!(tied_weights(&[embeddings(), head("b.safetensors", as_bf16(&values))]).unwrap(), TiedWeights::Embeddings);
        let mut signed = values.clone();
        signed[0] = -0.0;
        let zero = write(&dir.join("c.safetensors"), &[(EMBEDDINGS, "F32", vec![n], as_f32(&{ let mut v = values.clone(); v[0] = 0.0; v })), (HEAD, "BF16", vec![n], as_bf16(&signed))]);
        assert_eq!(tied_weights(&[zero]).unwrap(), TiedWeights::Embeddings, "-0 equals 0");
        let mut last = values.clone();
        last[n - 1] += 1.0;
        assert_eq!(tied_weights(&[embeddings(), head("b.safetensors", as_bf16(&last))]).unwrap(), TiedWeights::Different);
        assert_eq!(tied_weights(&[head("b.safetensors", as_bf16(&values))]).unwrap(), TiedWeights::HeadAlone);
        assert_eq!(tied_weights(&[embeddings()]).unwrap(), TiedWeights::Embeddings);

        // A header that places fewer bytes than its shape holds (equal shapes, so compared).
        let short = write(&dir.join("d.safetensors"), &[(EMBEDDINGS, "F32", vec![n], as_f32(&values)), (HEAD, "BF16", vec![n], as_bf16(&values[..n - 1]))]);
        let error = tied_weights(&[short]).unwrap_err().to_string();
        assert!(error.contains("lm_head.weight") && error.contains("bytes in the file for shape"), "{error}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
