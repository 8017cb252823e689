//! Training checkpoints that survive crashes.
//!
//! One file holds everything a run needs to continue: the model's parameters, the optimizer's
//! state, and the caller's training state (step, data position, seeds), so a resumed run takes
//! exactly the steps the uninterrupted one would have, where the steps draw no random numbers
//! (the trainer's do not): the backend's generator is not saved, so a model with dropout (burn's
//! `Dropout`, in `burn_ulysses::nn`'s drop-ins) draws other masks after a resume unless the
//! caller seeds it from the step (`B::seed(device, hash(seed, step))` before each). It is written to a temporary file in
//! the same folder, flushed to disk (`fsync`) and renamed over the previous checkpoint, then
//! the folder is flushed so the rename itself is durable. A crash at any point leaves either
//! the old checkpoint or the new one, never a mix; a torn file (a disk that lied about
//! `fsync`, a copy cut short) is caught by its length and checksum when loading.
//!
//! Parameters and optimizer state do not depend on the SP or DP layout (every rank holds the
//! same values), so a checkpoint loads under any layout, and without sequence parallelism.
//! Where the optimizer's state is sharded over the ranks (`crate::zero`), each rank writes
//! its part beside the file, and the file's model section is empty: the parts' f32 master
//! weights are the model (so no rank gathers it to save it).
//!
//! Layout of the file: the 8-byte magic `ULYCKPT1`, a little-endian `u64` header length, the
//! header (JSON: format version, the caller's state, section lengths, checksum), then the
//! model record and the optimizer record (burn's named MessagePack, full precision).

use std::{
    fs::{self, File},
    io::{Read, Write},
    path::{Path, PathBuf},
};

use burn::{
    module::AutodiffModule,
    optim::Optimizer,
    record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder},
    tensor::backend::AutodiffBackend,
};
use serde::{Deserialize, Serialize, de::DeserializeOwned};

use burn_ulysses::UlyssesError;

use crate::float_parameters;

/// The file a checkpoint folder holds.
pub const CHECKPOINT_FILE: &str = "checkpoint.ulysses";

const MAGIC: &[u8; 8] = b"ULYCKPT1";
const FORMAT_VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
struct Header<S> {
    format: u32,
    state: S,
    model_bytes: u64,
    optimizer_bytes: u64,
    /// FNV-1a of the model and optimizer sections.
    checksum: u64,
    /// Where the optimizer state is sharded over the ranks (`ShardedAdamW`): the folder beside
    /// this file that holds every rank's part; the optimizer section is then empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    optimizer_shards: Option<String>,
    /// FNV-1a of `state`'s text in the header (compact JSON): a flipped digit in the step
    /// count or a setting is refused, not trained on. Absent in checkpoints written before it
    /// was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    state_checksum: Option<u64>,
    /// The model's parameters, in visiting order. A sharded checkpoint's state sections go by
    /// position: a model whose parameters come in another order (another version of its code)
    /// is refused, not loaded crosswise. A replicated one's record goes by name, and burn
    /// skips what does not fit it (an untied head the model has and the record lacks), so the
    /// names must be the same. Absent in checkpoints written before it was recorded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    parameter_paths: Vec<String>,
    /// FNV-1a of `optimizer_shards` and `parameter_paths` (as [`names_checksum`] lays them
    /// out): a flipped bit in the folder's name (another step's kept folder) or a parameter's
    /// is refused, not loaded. Absent in checkpoints written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    names_checksum: Option<u64>,
}

/// The checksum of a checkpoint's names: the sharded state's folder (empty for none), then
/// each parameter's path, each ended by a 0 byte.
fn names_checksum(optimizer_shards: Option<&str>, parameter_paths: &[String]) -> u64 {
    let names = std::iter::once(optimizer_shards.unwrap_or_default()).chain(parameter_paths.iter().map(String::as_str));
    names.fold(FNV1A_START, |hash, name| fnv1a_more(fnv1a_more(hash, name.as_bytes()), &[0]))
}

fn recorder() -> NamedMpkBytesRecorder<FullPrecisionSettings> {
    NamedMpkBytesRecorder::new()
}

pub(crate) fn error(path: &Path, reason: impl std::fmt::Display) -> UlyssesError {
    UlyssesError::Checkpoint { path: path.display().to_string(), reason: reason.to_string() }
}

/// The most bytes a tensor of a MessagePack record (burn's, a checkpoint's and `model.mpk`)
/// holds: the format's bin length is 32 bits, and rmp writes a longer one's cut to them, a
/// file that does not load.
pub const MAX_RECORD_TENSOR_BYTES: u64 = u32::MAX as u64;

/// Refuses a model one of whose parameters (and so its AdamW moments) a MessagePack record
/// cannot hold in f32 (`MAX_RECORD_TENSOR_BYTES`), naming it and `fix`, before any record is
/// made: Qwen2.5-72B's embedding (152 064 × 8 192) is 5 GB. Reads shapes alone: a lazy model
/// is not built.
pub fn check_record_fits<B: burn::tensor::backend::Backend, M: burn::module::Module<B>>(model: &M, fix: &str) -> Result<(), UlyssesError> {
    let elements = crate::parameter_elements(model);
    let Some(index) = elements.iter().position(|&n| n as u64 * 4 > MAX_RECORD_TENSOR_BYTES) else { return Ok(()) };
    let path = crate::parameter_paths(model).swap_remove(index);
    Err(UlyssesError::InvalidConfig(format!(
        "parameter `{path}` holds {} values, {} bytes in f32, past the {MAX_RECORD_TENSOR_BYTES} bytes a MessagePack record holds a \
         tensor in (a longer one's length would be cut: a file that does not load): {fix}",
        elements[index],
        elements[index] as u64 * 4
    )))
}

/// What [`TrainingCheckpoint::take`] names where a parameter does not fit its record.
pub const REPLICATED_CHECKPOINT_FIX: &str = "a replicated training checkpoint cannot hold it; shard the optimizer's state \
     (ShardedAdamW: the trainer's --offload-optimizer or --zero 3), whose checkpoints hold no such record";

/// Writes `model`, `optimizer` and `state` to `dir/`[`CHECKPOINT_FILE`] atomically (see the
/// module docs) and returns the file's path. Call it on one rank (world rank 0): every rank
/// holds the same values.
pub fn save_training_checkpoint<B, M, O, S>(dir: &Path, model: &M, optimizer: &O, state: &S) -> Result<PathBuf, UlyssesError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
    S: Serialize,
{
    TrainingCheckpoint::take(dir, model, optimizer, state)?.write()
}

/// A replicated training checkpoint taken and not yet written: [`save_training_checkpoint`] in
/// two halves, so that the write (a checksum and the disk: minutes for a large model on a
/// slow one) can go on on a thread of its own while the thread that holds the tensors' device
/// goes on.
pub struct TrainingCheckpoint {
    dir: PathBuf,
    model_bytes: Vec<u8>,
    optimizer_bytes: Vec<u8>,
    parameter_paths: Vec<String>,
    state: serde_json::Value,
}

impl TrainingCheckpoint {
    /// The records of `model`, `optimizer` and `state`, to be written to `dir`.
    pub fn take<B, M, O, S>(dir: &Path, model: &M, optimizer: &O, state: &S) -> Result<Self, UlyssesError>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
        S: Serialize,
    {
        let path = dir.join(CHECKPOINT_FILE);
        check_record_fits(model, REPLICATED_CHECKPOINT_FIX)?;
        let model_bytes = Recorder::<B>::record(&recorder(), model.clone().into_record(), ()).map_err(|e| error(&path, e))?;
        let optimizer_bytes = Recorder::<B>::record(&recorder(), optimizer.to_record(), ()).map_err(|e| error(&path, e))?;
        let state = serde_json::to_value(state).map_err(|e| error(&path, e))?;
        Ok(Self { dir: dir.to_path_buf(), model_bytes, optimizer_bytes, parameter_paths: crate::parameter_paths(model), state })
    }

    /// The folder it is written to.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Writes `dir/`[`CHECKPOINT_FILE`] atomically; returns its path.
    pub fn write(self) -> Result<PathBuf, UlyssesError> {
        write_checkpoint(&self.dir, &self.model_bytes, &self.optimizer_bytes, None, &self.parameter_paths, &self.state)
    }
}

/// Writes `dir/`[`CHECKPOINT_FILE`] atomically: the model's record (empty when the optimizer's
/// state is sharded in the folder `optimizer_shards` beside the file, whose master weights are
/// the model), the optimizer's record (empty then too) and `state`.
pub(crate) fn write_checkpoint<S: Serialize>(
    dir: &Path,
    model_bytes: &[u8],
    optimizer_bytes: &[u8],
    optimizer_shards: Option<&str>,
    parameter_paths: &[String],
    state: &S,
) -> Result<PathBuf, UlyssesError> {
    let path = dir.join(CHECKPOINT_FILE);
    let state = serde_json::to_value(state).map_err(|e| error(&path, e))?;
    let header = Header {
        format: FORMAT_VERSION,
        state_checksum: Some(state_checksum(&state)),
        state,
        model_bytes: model_bytes.len() as u64,
        optimizer_bytes: optimizer_bytes.len() as u64,
        checksum: fnv1a(&[model_bytes, optimizer_bytes]),
        optimizer_shards: optimizer_shards.map(str::to_string),
        parameter_paths: parameter_paths.to_vec(),
        names_checksum: Some(names_checksum(optimizer_shards, parameter_paths)),
    };
    let header = serde_json::to_vec(&header).map_err(|e| error(&path, e))?;
    let length = (header.len() as u64).to_le_bytes();
    fs::create_dir_all(dir).map_err(|e| error(&path, format!("cannot create the folder: {e}")))?;
    write_atomically(&path, &[MAGIC, &length, &header, model_bytes, optimizer_bytes])
        .map_err(|e| error(&path, format!("cannot write: {e}")))?;
    Ok(path)
}

/// Loads a checkpoint written by [`save_training_checkpoint`] into `model` and `optimizer`
/// (fresh ones of the same shapes) on `device`, and returns them with the saved state.
/// `location` is the checkpoint folder or the file itself.
pub fn load_training_checkpoint<B, M, O, S>(
    location: &Path,
    model: M,
    optimizer: O,
    device: &B::Device,
) -> Result<(M, O, S), UlyssesError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
    S: DeserializeOwned,
{
    let contents = read_checkpoint::<S>(location)?;
    let path = checkpoint_path(location);
    if let Some(folder) = &contents.optimizer_shards {
        return Err(error(
            &path,
            format!(
                "its optimizer state is sharded over the ranks, in the folder {folder} beside it (a run with the optimizer on the \
                 host or under ZeRO-3): load it with load_sharded_training_checkpoint (the trainer: --offload-optimizer or --zero 3)"
            ),
        ));
    }
    let model = load_model_record(&path, contents.model, &contents.parameter_paths, model, device)?;
    let optimizer_record = Recorder::<B>::load(&recorder(), contents.optimizer, device)
        .map_err(|e| error(&path, format!("the optimizer record does not fit this optimizer: {e}")))?;
    Ok((model, optimizer.load_record(optimizer_record), contents.state))
}

/// `model` (a fresh one of the same shapes) with the parameters of a checkpoint's model
/// section `bytes`, read from `path`, whose header names the parameters `saved` (none in
/// checkpoints written before it did); refused when the parameters' names or shapes differ.
pub(crate) fn load_model_record<B: AutodiffBackend, M: AutodiffModule<B>>(
    path: &Path,
    bytes: Vec<u8>,
    saved: &[String],
    model: M,
    device: &B::Device,
) -> Result<M, UlyssesError> {
    let ours = crate::parameter_paths(&model);
    if !saved.is_empty() {
        check_same_parameters(path, saved, &ours)?;
    }
    let model_record = Recorder::<B>::load(&recorder(), bytes, device)
        .map_err(|e| error(path, format!("the model record does not fit this model: {e}")))?;
    // burn takes a record's tensors whatever their shape: compare, or a checkpoint of another
    // model shape would load silently.
    let shapes = |model: &M| float_parameters(model).into_iter().map(|p| (p.path, p.shape.to_vec())).collect::<Vec<_>>();
    let expected = shapes(&model);
    let model = model.load_record(model_record);
    // An optional module the record lacks is dropped by burn: a checkpoint without names (an
    // older one) is caught here, after the load.
    check_same_parameters(path, &crate::parameter_paths(&model), &ours)?;
    if let Some(((name, want), (_, got))) = expected.iter().zip(shapes(&model)).find(|(want, got)| want.1 != got.1) {
        return Err(error(
            path,
            format!("parameter `{name}` has shape {got:?} in the checkpoint but {want:?} in this model: it was written by another model"),
        ));
    }
    Ok(model)
}

/// Refuses a model whose parameters (`ours`, by name) are not the checkpoint's (`saved`).
fn check_same_parameters(path: &Path, saved: &[String], ours: &[String]) -> Result<(), UlyssesError> {
    let lacking = |these: &[String], those: &[String]| these.iter().find(|p| !those.contains(p)).cloned();
    let what = match (lacking(saved, ours), lacking(ours, saved)) {
        (None, None) => return Ok(()),
        (Some(theirs), _) => format!("it holds parameter `{theirs}`, which this model lacks"),
        (None, Some(mine)) => format!("this model has parameter `{mine}`, which it lacks"),
    };
    Err(error(
        path,
        format!(
            "{what} ({} parameters in it, {} in this model): it was written by another model (tied or untied embeddings, another \
             layer count, another version of the model's code)",
            saved.len(),
            ours.len()
        ),
    ))
}

/// The training state saved in a checkpoint, from its header alone (the records are neither
/// read nor checked: an 8B model's file is tens of GB).
pub fn read_checkpoint_state<S: DeserializeOwned>(location: &Path) -> Result<S, UlyssesError> {
    let path = checkpoint_path(location);
    open_checkpoint::<S>(&path).map(|(_, header)| header.state)
}

/// Whether the checkpoints at `a` and `b` are one checkpoint (copies of one file): their
/// headers, which hold the state, the records' checksum and the sharded state's folder, are
/// the same bytes. An error where either cannot be read as a checkpoint.
pub fn same_checkpoint(a: &Path, b: &Path) -> Result<bool, UlyssesError> {
    let header = |location: &Path| -> Result<Vec<u8>, UlyssesError> {
        let path = checkpoint_path(location);
        match read_preamble(&path)? {
            Preamble::Header { header, .. } => Ok(header),
            Preamble::NotCheckpoint { .. } => Err(error(&path, "not a burn-ulysses training checkpoint")),
        }
    };
    Ok(header(a)? == header(b)?)
}

/// The sharded optimizer state's folder that the file at `path` names: `None` where it is no
/// checkpoint (other bytes than the 8 magic ones, empty) or a checkpoint that names none. Its
/// header is read leniently (the folder's name alone: a state whose checksum fails, or a later
/// format, still names its folder). An error where it may be a checkpoint but which folder it
/// names cannot be told (a read that fails, a header cut off or corrupt): a caller removing
/// folders must then keep them all.
pub(crate) fn named_state_folder(path: &Path) -> Result<Option<String>, UlyssesError> {
    let header = match read_preamble(path)? {
        Preamble::Header { header, .. } => header,
        // A copy of a checkpoint (`cp checkpoint.ulysses keep.ulysses`) a few bytes in names
        // the folder it will name once whole.
        Preamble::NotCheckpoint { begun: true, .. } => return Err(error(path, "holds a checkpoint's first bytes alone (a copy under way?): which folder it names cannot be told yet")),
        Preamble::NotCheckpoint { .. } => return Ok(None),
    };
    let header: serde_json::Value = serde_json::from_slice(&header).map_err(|e| error(path, format!("unreadable header: {e}")))?;
    let folder = header.get("optimizer_shards").and_then(serde_json::Value::as_str).map(str::to_string);
    // A name its checksum refutes (a flipped bit: another folder's) is no name to keep by.
    if let Some(checksum) = header.get("names_checksum").and_then(serde_json::Value::as_u64) {
        let paths: Vec<String> = header.get("parameter_paths").and_then(serde_json::Value::as_array).map_or_else(Vec::new, |paths| paths.iter().filter_map(|p| p.as_str().map(str::to_string)).collect());
        if names_checksum(folder.as_deref(), &paths) != checksum {
            return Err(error(path, "the header's checksum of its names does not match: which folder it names cannot be told"));
        }
    }
    Ok(folder)
}

/// Whether `name`, read from a file that names another beside it (an index's weight file, a
/// checkpoint's state folder), is one plain name in that folder: an absolute path, a `..` or a
/// separator would reach outside it, to another run's or model's files.
pub fn is_plain_name(name: &str) -> bool {
    let mut components = Path::new(name).components();
    matches!((components.next(), components.next()), (Some(std::path::Component::Normal(_)), None))
}

/// What a file's first bytes say it is. The checkpoint layout's start, read in this one place:
/// 8 magic bytes, the header's length (u64, little-endian), the header's JSON.
enum Preamble {
    /// No checkpoint: shorter than the magic bytes, or other ones. `begun`: its bytes are the
    /// magic's first ones (one to seven): a checkpoint whose copy has begun, maybe.
    NotCheckpoint { short: bool, begun: bool },
    /// A checkpoint's header bytes; its records start at `16 + header.len()`.
    Header { file: File, file_bytes: u64, header: Vec<u8> },
}

/// The file at `path` read up to the end of its header, whose length is checked against the
/// file's (a corrupt length is an error, not an allocation of whatever it says). An error where
/// it cannot be read or is a checkpoint cut off inside its header.
fn read_preamble(path: &Path) -> Result<Preamble, UlyssesError> {
    let cannot_read = |e: std::io::Error| error(path, format!("cannot read: {e}"));
    let cut_off = || error(path, "the header is cut off; the file is truncated or corrupt (a copy cut short?). Use an earlier checkpoint.");
    let mut file = File::open(path).map_err(cannot_read)?;
    let file_bytes = file.metadata().map_err(cannot_read)?.len();
    let mut magic = Vec::with_capacity(MAGIC.len());
    (&mut file).take(MAGIC.len() as u64).read_to_end(&mut magic).map_err(cannot_read)?;
    if magic.len() < MAGIC.len() {
        return Ok(Preamble::NotCheckpoint { short: true, begun: !magic.is_empty() && MAGIC.starts_with(&magic) });
    }
    if magic != MAGIC {
        return Ok(Preamble::NotCheckpoint { short: false, begun: false });
    }
    let mut length = [0u8; 8];
    match file.read_exact(&mut length) {
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(cut_off()),
        result => result.map_err(cannot_read)?,
    }
    let header_bytes = u64::from_le_bytes(length);
    if 16u64.checked_add(header_bytes).is_none_or(|end| end > file_bytes) {
        return Err(cut_off());
    }
    // A flipped bit in the length of an 8B model's file still fits it: tens of GB read for a
    // header of kilobytes (it is read at every run folder's claim too).
    if header_bytes > LONGEST_HEADER_BYTES {
        return Err(error(path, format!("its header claims {header_bytes} bytes, past any checkpoint's ({LONGEST_HEADER_BYTES}): the file is corrupt. Use an earlier checkpoint.")));
    }
    let mut header = vec![0u8; header_bytes as usize];
    file.read_exact(&mut header).map_err(cannot_read)?;
    Ok(Preamble::Header { file, file_bytes, header })
}

/// The most a checkpoint's header (or a sharded state file's) may hold: its run state and the
/// parameters' names take kilobytes to a few megabytes.
pub(crate) const LONGEST_HEADER_BYTES: u64 = 256 << 20;

/// The checkpoint file at `path`, opened and read up to the end of its header (checked: magic,
/// format, and lengths that fit the file).
fn open_checkpoint<S: DeserializeOwned>(path: &Path) -> Result<(File, Header<S>), UlyssesError> {
    let (file, file_bytes, bytes) = match read_preamble(path)? {
        Preamble::Header { file, file_bytes, header } => (file, file_bytes, header),
        Preamble::NotCheckpoint { short, .. } => {
            let why = if short { "shorter than its magic bytes" } else { "wrong magic bytes" };
            return Err(error(path, format!("not a burn-ulysses training checkpoint ({why})")));
        }
    };
    let header = parse_header::<S>(path, &bytes)?;
    let end = (16 + bytes.len() as u64).checked_add(header.model_bytes).and_then(|end| end.checked_add(header.optimizer_bytes));
    if end != Some(file_bytes) {
        let described = end.map_or_else(|| "more than 2^64".to_string(), |end| end.to_string());
        return Err(error(
            path,
            format!("the file has {file_bytes} bytes but its header describes {described}; the file is truncated or corrupt (a copy cut short?). Use an earlier checkpoint."),
        ));
    }
    Ok((file, header))
}

/// A checkpoint's header, its format and its state's checksum checked.
fn parse_header<S: DeserializeOwned>(path: &Path, bytes: &[u8]) -> Result<Header<S>, UlyssesError> {
    let header: Header<S> = serde_json::from_slice(bytes).map_err(|e| error(path, format!("unreadable header: {e}")))?;
    if header.format != FORMAT_VERSION {
        return Err(error(path, format!("format version {} is not the supported {FORMAT_VERSION}", header.format)));
    }
    if let Some(checksum) = header.state_checksum {
        // The text as written: serde_json's default float parsing may miss the last bit, so
        // the state parsed and written again need not give the same text.
        if state_text(bytes).is_none_or(|text| fnv1a(&[text]) != checksum) {
            return Err(error(path, "the header's checksum does not match; the file is corrupt. Use an earlier checkpoint."));
        }
    }
    if header.names_checksum.is_some_and(|checksum| checksum != names_checksum(header.optimizer_shards.as_deref(), &header.parameter_paths)) {
        return Err(error(path, "the header's checksum of its names (the optimizer state's folder, the parameters') does not match; the file is corrupt. Use an earlier checkpoint."));
    }
    Ok(header)
}

/// The checksum of a checkpoint's state: FNV-1a of its compact JSON, as the header holds it.
fn state_checksum(state: &serde_json::Value) -> u64 {
    fnv1a(&[state.to_string().as_bytes()])
}

/// The text of the state in a header `write_checkpoint` wrote (`{"format":N,"state":{...},...`):
/// the JSON value after `"state":`, its end found by its brackets outside strings.
fn state_text(header: &[u8]) -> Option<&[u8]> {
    let key = b"\"state\":";
    let start = header.windows(key.len()).position(|w| w == key)? + key.len();
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for (offset, &byte) in header[start..].iter().enumerate() {
        match (in_string, escaped, byte) {
            (true, true, _) => escaped = false,
            (true, false, b'\\') => escaped = true,
            (true, false, b'"') => in_string = false,
            (true, false, _) => {}
            (false, _, b'"') => in_string = true,
            (false, _, b'{' | b'[') => depth += 1,
            (false, _, b'}' | b']') => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(&header[start..=start + offset]);
                }
            }
            (false, _, b',') if depth == 0 => return Some(&header[start..start + offset]),
            _ => {}
        }
    }
    None
}

/// The checkpoint file of a folder, or `location` itself when it is a file.
pub fn checkpoint_path(location: &Path) -> PathBuf {
    if location.is_dir() { location.join(CHECKPOINT_FILE) } else { location.to_path_buf() }
}

/// What a checkpoint file holds.
pub(crate) struct Contents<S> {
    pub state: S,
    /// The model's record; empty when the optimizer's state is sharded (`optimizer_shards`),
    /// whose master weights are the model (a checkpoint of an earlier version may hold one).
    pub model: Vec<u8>,
    /// The optimizer's record; empty when its state is sharded (`optimizer_shards`).
    pub optimizer: Vec<u8>,
    /// The folder beside the file that holds the sharded optimizer state.
    pub optimizer_shards: Option<String>,
    /// The model's parameters in the order of the sharded state's sections (empty: not
    /// recorded).
    pub parameter_paths: Vec<String>,
}

/// The checkpoint's sections, checked: magic, lengths and checksum. Each section is read
/// once into its own buffer (a resume holds the file once, not twice).
pub(crate) fn read_checkpoint<S: DeserializeOwned>(location: &Path) -> Result<Contents<S>, UlyssesError> {
    let path = checkpoint_path(location);
    let (mut file, header) = open_checkpoint::<S>(&path)?;
    let mut section = |bytes: u64| -> Result<Vec<u8>, UlyssesError> {
        let mut buffer = vec![0u8; bytes as usize];
        file.read_exact(&mut buffer).map_err(|e| error(&path, format!("cannot read: {e}")))?;
        Ok(buffer)
    };
    let model = section(header.model_bytes)?;
    let optimizer = section(header.optimizer_bytes)?;
    if fnv1a(&[&model, &optimizer]) != header.checksum {
        return Err(error(&path, "the checksum does not match; the file is truncated or corrupt (a copy cut short?). Use an earlier checkpoint."));
    }
    Ok(Contents { state: header.state, model, optimizer, optimizer_shards: header.optimizer_shards, parameter_paths: header.parameter_paths })
}

/// Writes `parts` to a temporary file beside `path`, flushes it, renames it to `path` and
/// flushes the folder: a reader sees the old file or the new one, never a torn one. The
/// temporary file is removed if anything fails.
pub fn write_atomically(path: &Path, parts: &[&[u8]]) -> std::io::Result<()> {
    write_atomically_with(path, |file| parts.iter().try_for_each(|part| file.write_all(part)))
}

/// Whether a file named `name` is a temporary file of [`write_atomically_with`]
/// (`.NAME.tmp-PID`): a write under way or cut short, never a file of its own, though a
/// checkpoint's may hold all its bytes before its rename.
pub fn is_temporary_write(name: &str) -> bool {
    name.starts_with('.') && name.rsplit_once(".tmp-").is_some_and(|(_, pid)| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
}

/// [`write_atomically`] with the contents written by `write`, piece by piece (a file larger
/// than what should be held in memory at once).
pub fn write_atomically_with(path: &Path, write: impl FnOnce(&mut std::io::BufWriter<File>) -> std::io::Result<()>) -> std::io::Result<()> {
    let folder = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let temporary = folder.join(format!(".{name}.tmp-{}", std::process::id()));
    let written = (|| {
        let mut writer = std::io::BufWriter::with_capacity(1 << 20, File::create(&temporary)?);
        write(&mut writer)?;
        let file = writer.into_inner().map_err(std::io::IntoInnerError::into_error)?;
        file.sync_all()?;
        fs::rename(&temporary, path)?;
        // The rename is durable once the folder's entry is: a failure now is no failure to write.
        File::open(folder).and_then(|folder| folder.sync_all()).map_err(|e| {
            std::io::Error::new(e.kind(), format!("it is written, but its folder could not be flushed ({e}), so a crash may still undo the write"))
        })
    })();
    if written.is_err() {
        let _ = fs::remove_file(&temporary);
    }
    written
}

pub use ulysses_core::digest::fnv1a;
pub(crate) use ulysses_core::digest::{FNV1A_START, fnv1a_more};

#[cfg(test)]
mod tests {
    /// A parameter past 4 GiB in f32 (2^30 values) is refused by name before any record is
    /// made (rmp would cut its length to 32 bits: a checkpoint that does not load); one value
    /// fewer fits. The model is never built: the check reads shapes.
    #[test]
    fn a_parameter_past_a_records_tensor_limit_is_refused_by_name() {
        use burn::{backend::NdArray, nn::LinearConfig};
        let device = Default::default();
        let huge = LinearConfig::new(1 << 15, 1 << 15).with_bias(false).init::<NdArray>(&device);
        let message = super::check_record_fits(&huge, "the fix").unwrap_err().to_string();
        assert!(message.contains("parameter `weight` holds 1073741824 values, 4294967296 bytes in f32") && message.ends_with("the fix"), "{message}");
        let fits = LinearConfig::new((1 << 15) - 1, 1 << 15).with_bias(false).init::<NdArray>(&device);
        super::check_record_fits(&fits, "the fix").unwrap();
    }

    use burn::{
        backend::{Autodiff, NdArray},
        nn::{Linear, LinearConfig},
        optim::{AdamWConfig, GradientsParams},
        tensor::Tensor,
    };

    use super::*;

    type B = Autodiff<NdArray<f32>>;

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    struct State {
        step: usize,
    }

    fn folder(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("burn-ulysses-checkpoint-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    /// A layer and an AdamW that has taken one step on it (so it has moments to save).
    fn trained() -> (Linear<B>, impl Optimizer<Linear<B>, B>) {
        let device = Default::default();
        let layer = LinearConfig::new(3, 2).init::<B>(&device);
        let mut optimizer = AdamWConfig::new().init::<B, Linear<B>>();
        let loss = layer.forward(Tensor::<B, 2>::ones([4, 3], &device)).sum();
        let grads = GradientsParams::from_grads(loss.backward(), &layer);
        let layer = optimizer.step(1e-2, layer, grads);
        (layer, optimizer)
    }

    fn weights(layer: &Linear<B>) -> Vec<f32> {
        layer.weight.val().into_data().to_vec().unwrap()
    }

    /// One more step on the same data: equal only when the optimizer's moments and step
    /// count came back (a fresh AdamW's differ).
    fn step_again<O: Optimizer<Linear<B>, B>>(layer: Linear<B>, optimizer: &mut O) -> Vec<f32> {
        let loss = layer.forward(Tensor::<B, 2>::ones([4, 3], &Default::default()) * 0.5).sum();
        let grads = GradientsParams::from_grads(loss.backward(), &layer);
        weights(&optimizer.step(1e-2, layer, grads))
    }

    #[test]
    fn model_optimizer_and_state_round_trip() {
        let dir = folder("round-trip");
        let (layer, optimizer) = trained();
        let path = save_training_checkpoint(&dir, &layer, &optimizer, &State { step: 7 }).unwrap();
        assert_eq!(path, dir.join(CHECKPOINT_FILE));
        let fresh = LinearConfig::new(3, 2).init::<B>(&Default::default());
        let fresh_optimizer = AdamWConfig::new().init::<B, Linear<B>>();
        let (loaded, mut loaded_optimizer, state): (_, _, State) =
            load_training_checkpoint(&dir, fresh, fresh_optimizer, &Default::default()).unwrap();
        assert_eq!(state, State { step: 7 });
        assert_eq!(weights(&loaded), weights(&layer));
        let mut optimizer = optimizer;
        let uninterrupted = step_again(layer, &mut optimizer);
        assert_eq!(step_again(loaded.clone(), &mut loaded_optimizer), uninterrupted);
        let mut fresh_optimizer = AdamWConfig::new().init::<B, Linear<B>>();
        assert_ne!(step_again(loaded, &mut fresh_optimizer), uninterrupted, "the check must tell a fresh optimizer apart");
        assert_eq!(read_checkpoint_state::<State>(&path).unwrap(), State { step: 7 });
        let _ = fs::remove_dir_all(&dir);
    }

    /// burn loads a record by name and drops an optional parameter the record lacks (here a
    /// bias; in a decoder an untied head): a model with other parameters is refused instead,
    /// by the names in the header, or (a checkpoint written before them) after the load.
    #[test]
    fn a_model_with_other_parameters_is_refused_not_loaded_without_them() {
        let dir = folder("other-parameters");
        let device = Default::default();
        let optimizer = || AdamWConfig::new().init::<B, Linear<B>>();
        let biased = || LinearConfig::new(3, 2).init::<B>(&device);
        let unbiased = || LinearConfig::new(3, 2).with_bias(false).init::<B>(&device);
        let load = |model: Linear<B>| load_training_checkpoint::<B, _, _, State>(&dir, model, optimizer(), &device).map(|_| ()).unwrap_err().to_string();

        save_training_checkpoint(&dir, &unbiased(), &optimizer(), &State { step: 1 }).unwrap();
        let message = load(biased());
        assert!(message.contains("this model has parameter `bias`, which it lacks (1 parameters in it, 2 in this model)"), "{message}");
        save_training_checkpoint(&dir, &biased(), &optimizer(), &State { step: 1 }).unwrap();
        let message = load(unbiased());
        assert!(message.contains("it holds parameter `bias`, which this model lacks"), "{message}");

        // A checkpoint whose header names no parameters.
        let model_bytes = Recorder::<B>::record(&recorder(), burn::module::Module::into_record(unbiased()), ()).unwrap();
        let optimizer_bytes = Recorder::<B>::record(&recorder(), optimizer().to_record(), ()).unwrap();
        write_checkpoint(&dir, &model_bytes, &optimizer_bytes, None, &[], &State { step: 1 }).unwrap();
        let message = load(biased());
        assert!(message.contains("this model has parameter `bias`, which it lacks"), "{message}");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_crash_while_writing_leaves_the_previous_checkpoint() {
        let dir = folder("crash");
        let (layer, optimizer) = trained();
        save_training_checkpoint(&dir, &layer, &optimizer, &State { step: 1 }).unwrap();
        // What a crash in the middle of the next save leaves: a partial temporary file.
        fs::write(dir.join(format!(".{CHECKPOINT_FILE}.tmp-999999")), b"ULYCKPT1 half of a checkpoint").unwrap();
        assert_eq!(read_checkpoint_state::<State>(&dir).unwrap(), State { step: 1 });
        // The next save replaces the checkpoint whole and leaves no temporary file of its own.
        save_training_checkpoint(&dir, &layer, &optimizer, &State { step: 2 }).unwrap();
        assert_eq!(read_checkpoint_state::<State>(&dir).unwrap(), State { step: 2 });
        let own = format!(".{CHECKPOINT_FILE}.tmp-{}", std::process::id());
        assert!(!dir.join(own).exists());
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn torn_corrupt_and_foreign_files_are_refused_with_the_reason() {
        let dir = folder("torn");
        let (layer, optimizer) = trained();
        let path = save_training_checkpoint(&dir, &layer, &optimizer, &State { step: 3 }).unwrap();
        let bytes = fs::read(&path).unwrap();
        let load = |bytes: &[u8]| {
            fs::write(&path, bytes).unwrap();
            let fresh = LinearConfig::new(3, 2).init::<B>(&Default::default());
            let optimizer = AdamWConfig::new().init::<B, Linear<B>>();
            load_training_checkpoint::<B, _, _, State>(&path, fresh, optimizer, &Default::default()).map(|_| ()).unwrap_err().to_string()
        };
        let message = load(&bytes[..bytes.len() - 10]);
        assert!(message.contains("truncated or corrupt") && message.contains("Use an earlier checkpoint"), "{message}");
        let mut flipped = bytes.clone();
        *flipped.last_mut().unwrap() ^= 0x40;
        assert!(load(&flipped).contains("checksum"));
        assert!(load(b"{\"not\": \"a checkpoint\"}").contains("wrong magic bytes"));
        assert!(load(b"ULYC").contains("shorter than its magic bytes"));
        // Cut inside the header's length: a checkpoint cut off, not a foreign file.
        let message = load(&bytes[..12]);
        assert!(message.contains("the header is cut off") && message.contains("Use an earlier checkpoint"), "{message}");
        // A header length past the file (a flipped high byte) is named, not allocated.
        for length in [u64::MAX, 1 << 62, bytes.len() as u64] {
            let mut corrupt = bytes.clone();
            corrupt[8..16].copy_from_slice(&length.to_le_bytes());
            let message = load(&corrupt);
            assert!(message.contains("the header is cut off"), "{message}");
            assert!(read_checkpoint_state::<State>(&path).unwrap_err().to_string().contains("the header is cut off"));
        }
        // One inside a file as long (a large model's), past any header: named, not read (a
        // sparse file of 300 MiB here).
        let mut corrupt = bytes[..8].to_vec();
        corrupt.extend((300u64 << 20).to_le_bytes());
        fs::write(&path, &corrupt).unwrap();
        fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(16 + (300 << 20)).unwrap();
        let message = read_checkpoint_state::<State>(&path).unwrap_err().to_string();
        assert!(message.contains("its header claims 314572800 bytes, past any checkpoint's") && message.contains("Use an earlier checkpoint"), "{message}");
        // Section lengths whose sum passes 2^64 are named too.
        let header_bytes = u64::from_le_bytes(bytes[8..16].try_into().unwrap()) as usize;
        let header = std::str::from_utf8(&bytes[16..16 + header_bytes]).unwrap();
        let model_bytes = header.split("\"model_bytes\":").nth(1).unwrap().split(',').next().unwrap();
        let huge = header.replacen(&format!("\"model_bytes\":{model_bytes},"), &format!("\"model_bytes\":{},", u64::MAX - 8), 1);
        let mut corrupt = bytes[..8].to_vec();
        corrupt.extend((huge.len() as u64).to_le_bytes());
        corrupt.extend(huge.as_bytes());
        corrupt.extend(&bytes[16 + header_bytes..]);
        let message = load(&corrupt);
        assert!(message.contains("describes more than 2^64"), "{message}");
        // A flipped digit in the state (the step count) is refused by the header's checksum;
        // a header without one (an earlier version's) still loads.
        let edited = |from: &str, to: &str| {
            let header = header.replacen(from, to, 1);
            let mut corrupt = bytes[..8].to_vec();
            corrupt.extend((header.len() as u64).to_le_bytes());
            corrupt.extend(header.as_bytes());
            corrupt.extend(&bytes[16 + header_bytes..]);
            corrupt
        };
        assert!(header.contains("\"step\":3"), "{header}");
        let message = load(&edited("\"step\":3", "\"step\":7"));
        assert!(message.contains("the header's checksum does not match"), "{message}");
        let checksum = header.split("\"state_checksum\":").nth(1).unwrap().split(['}', ',']).next().unwrap();
        let unchecked = edited(&format!(",\"state_checksum\":{checksum}"), "");
        fs::write(&path, &unchecked).unwrap();
        assert_eq!(read_checkpoint_state::<State>(&path).unwrap(), State { step: 3 }, "a header without a state checksum");
        // A flipped letter in a parameter's path is refused by the names' checksum (the names
        // alone would load the record under other names, or compare them as the model's).
        assert!(header.contains("\"parameter_paths\":[\"weight\""), "{header}");
        let message = load(&edited("\"parameter_paths\":[\"weight\"", "\"parameter_paths\":[\"weighs\""));
        assert!(message.contains("the header's checksum of its names") && message.contains("Use an earlier checkpoint"), "{message}");
        // A checkpoint of another model shape does not load into this one.
        fs::write(&path, &bytes).unwrap();
        let other = LinearConfig::new(5, 2).init::<B>(&Default::default());
        let optimizer = AdamWConfig::new().init::<B, Linear<B>>();
        let message = load_training_checkpoint::<B, _, _, State>(&path, other, optimizer, &Default::default())
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(message.contains("parameter `weight` has shape [3, 2] in the checkpoint but [5, 2]"), "{message}");
        let _ = fs::remove_dir_all(&dir);
    }
}
