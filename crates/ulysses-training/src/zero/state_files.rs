//! A [`ShardedAdamW`]'s state on disk: one file per rank ([`ShardedState::save`], atomic),
//! read back at any world size ([`ShardedAdamW::load`] re-partitions it), and the training
//! checkpoint whose optimizer state is those files ([`save_sharded_training_checkpoint`]: every
//! rank's part committed at once by the checkpoint file that names their folder).

use std::{
    borrow::Cow,
    fs,
    io::{Read, Seek, SeekFrom, Write},
    path::{Path, PathBuf},
};

use burn::module::AutodiffModule;
use burn_ulysses::{UlyssesError, comm::Communicator};
use serde::{Deserialize, Serialize};
use ulysses_core::{
    host_adamw::{AdamWMoments, HostAdamWConfig},
    zero::Partition,
};

use super::host_adamw::{ParameterPart, ShardedAdamW};
use crate::{
    TrainBackend,
    checkpoint::{FNV1A_START, fnv1a, fnv1a_more, write_atomically_with},
};

/// The file in a checkpoint folder that holds world rank `rank`'s part of a [`ShardedAdamW`]'s
/// state, of a world of `world` ranks.
pub fn sharded_state_file(rank: usize, world: usize) -> String {
    format!("optimizer-{rank:05}-of-{world:05}.ulysses")
}

/// The file begins with this, the header's length (u64) and its FNV-1a (u64), then the header.
const SHARD_MAGIC: &[u8; 8] = b"ULYSHRD2";
/// Earlier files: the same without the header's checksum (still read).
const SHARD_MAGIC_UNCHECKED_HEADER: &[u8; 8] = b"ULYSHRD1";
const SHARD_FORMAT: u32 = 1;

/// What a rank's state file says about itself and each parameter's section of its payload.
#[derive(Serialize, Deserialize)]
struct ShardHeader {
    format: u32,
    rank: usize,
    world: usize,
    config: HostAdamWConfig,
    parameters: Vec<SectionHeader>,
}

/// One parameter's section: its part of the master weights, then of each moment (f32,
/// little-endian, the partition's part length each), and their FNV-1a.
#[derive(Serialize, Deserialize, Clone, Copy)]
struct SectionHeader {
    elements: usize,
    time: u32,
    checksum: u64,
}

/// An optimizer whose state is in parts over the ranks, each rank's written to a file of its
/// own ([`sharded_state_file`]): [`ShardedAdamW`] (on the host) and
/// [`DeviceShardedAdamW`](super::DeviceShardedAdamW) (on the device), whose files are alike.
pub trait ShardedState {
    /// Writes this rank's part of the state (rank `rank` of `world`, the world it steps over)
    /// to `dir`/[`sharded_state_file`] (the folder made if need be), atomically: every rank
    /// writes its own file, and together they are the state.
    fn save(&mut self, dir: &Path, rank: usize, world: usize) -> Result<PathBuf, UlyssesError>;
}

impl ShardedState for ShardedAdamW {
    fn save(&mut self, dir: &Path, rank: usize, world: usize) -> Result<PathBuf, UlyssesError> {
        self.settle()?;
        let config = *self.adamw.config();
        write_state_file(dir, self.place, rank, world, config, self.parts.len(), |index| Cow::Borrowed(&self.parts[index]))
    }
}

/// Writes a rank's state file of `count` parameters' parts, each handed out by `part_at` twice
/// (to hash it, then to write it), so that parts kept elsewhere (on a device) are on the host
/// one at a time. Each section is hashed, then written, a piece at a time: the state is never
/// copied whole (at 8B it is 96 GB of a 137 GB host). Refused for another place than the
/// parts are of (`held`): they would be read back as that place's.
pub(super) fn write_state_file<'a>(
    dir: &Path,
    held: Option<(usize, usize)>,
    rank: usize,
    world: usize,
    config: HostAdamWConfig,
    count: usize,
    mut part_at: impl FnMut(usize) -> Cow<'a, ParameterPart>,
) -> Result<PathBuf, UlyssesError> {
    super::parts::partition_of(rank, world)?;
    if let Some((held_rank, held_world)) = held.filter(|&place| place != (rank, world)) {
        return Err(UlyssesError::InvalidConfig(format!(
            "the sharded optimizer holds rank {held_rank}'s parts of a world of {held_world}; saved as rank {rank} of {world} they would be read back as that rank's: save with the place it steps at"
        )));
    }
    let path = dir.join(sharded_state_file(rank, world));
    fs::create_dir_all(dir).map_err(|e| shard_error(dir, format!("cannot create the folder: {e}")))?;
    let encode = |parameters: Vec<SectionHeader>| {
        serde_json::to_vec(&ShardHeader { format: SHARD_FORMAT, rank, world, config, parameters }).map_err(|e| std::io::Error::other(format!("cannot encode the header: {e}")))
    };
    // The header, which holds the sections' checksums, comes before them: it is written first
    // in the room its longest form takes (every number at its largest), then, once the
    // sections are written and hashed in one pass (a part on the device read once, its bytes
    // hashed as written), again in that room, padded with JSON's spaces.
    let longest = SectionHeader { elements: usize::MAX, time: u32::MAX, checksum: u64::MAX };
    let mut bytes = Vec::with_capacity(SECTION_PIECE_BYTES);
    write_atomically_with(&path, |file| {
        let room = encode(vec![longest; count])?.len();
        for piece in [SHARD_MAGIC.as_slice(), &(room as u64).to_le_bytes(), &[0; 8], &vec![b' '; room]] {
            file.write_all(piece)?;
        }
        let mut parameters = Vec::with_capacity(count);
        for index in 0..count {
            let part = part_at(index);
            let (mut written, mut hash) = (Ok(()), FNV1A_START);
            part.section_pieces(&mut bytes, |piece| {
                hash = fnv1a_more(hash, piece);
                if written.is_ok() {
                    written = file.write_all(piece);
                }
            });
            written?;
            parameters.push(SectionHeader { elements: part.elements, time: part.moments.time, checksum: hash });
        }
        let mut header = encode(parameters)?;
        header.resize(room, b' ');
        file.seek(std::io::SeekFrom::Start(SHARD_MAGIC.len() as u64 + 8))?;
        file.write_all(&fnv1a(&[&header]).to_le_bytes())?;
        file.write_all(&header)
    })
    .map_err(|e| shard_error(&path, format!("cannot write: {e}")))?;
    Ok(path)
}

impl ShardedAdamW {
    /// The state a world of any size saved in `dir` ([`save`](Self::save) on each of its
    /// ranks), re-partitioned for rank `rank` of a world of `world`: each rank reads, of every
    /// parameter, the sections of the saved ranks whose parts overlap its own. Refused, naming
    /// the file, when a saved rank's file is missing, torn or of another run.
    pub fn load(dir: &Path, rank: usize, world: usize) -> Result<Self, UlyssesError> {
        Self::load_with_digest(dir, rank, world).map(|(state, _)| state)
    }

    /// [`load`](Self::load), and a digest of every saved rank's file (their sections'
    /// checksums): ranks that read the same state get the same digest.
    pub(crate) fn load_with_digest(dir: &Path, rank: usize, world: usize) -> Result<(Self, u64), UlyssesError> {
        let (config, parts, digest) = load_parts_with(dir, rank, world, |elements, [master, moment_1, moment_2], time| {
            let moments = if time == 0 { AdamWMoments::default() } else { AdamWMoments { moment_1, moment_2, time } };
            (elements, master, moments)
        })?;
        Ok((Self::from_parts(config, parts, Some((rank, world))), digest))
    }
}

/// The state a world of any size saved in `dir`, re-partitioned for rank `rank` of a world of
/// `world`, one parameter at a time: `take` is handed each parameter's elements, this rank's
/// new part of its master weights and both moments (zeros before the first update), and its
/// step count, as soon as they are read (a loader to the device keeps none of them on the
/// host). Returns the saved config, what `take` made of each, and the files' digest.
pub(crate) fn load_parts_with<T>(dir: &Path, rank: usize, world: usize, mut take: impl FnMut(usize, [Vec<f32>; 3], u32) -> T) -> Result<(HostAdamWConfig, Vec<T>, u64), UlyssesError> {
    let new = super::parts::partition_of(rank, world)?;
    let saved_world = saved_world(dir)?;
    let old = Partition::new(saved_world).expect("a saved world has a rank");
    let mut files: Vec<ShardFile> = (0..saved_world).map(|r| ShardFile::open(&dir.join(sharded_state_file(r, saved_world)), r, saved_world)).collect::<Result<_, _>>()?;
    let layout: Vec<(usize, u32)> = files[0].header.parameters.iter().map(|p| (p.elements, p.time)).collect();
    if let Some(file) = files.iter().find(|f| f.header.parameters.iter().map(|p| (p.elements, p.time)).ne(layout.iter().copied())) {
        return Err(shard_error(&file.path, "its parameters or step counts differ from rank 0's file: the files are of different runs or steps"));
    }
    let config = files[0].header.config;
    let checksums: Vec<u8> = files.iter().flat_map(|f| f.header.parameters.iter().flat_map(|p| p.checksum.to_le_bytes())).collect();
    let digest = fnv1a(&[&saved_world.to_le_bytes(), &checksums]);
    let mut parts = Vec::with_capacity(layout.len());
    for (index, &(elements, time)) in layout.iter().enumerate() {
        // This rank's new part, assembled from the old parts that overlap it.
        let mine = new.owned(elements, rank);
        let mut values = [vec![0.0f32; new.part_len(elements)], vec![0.0; new.part_len(elements)], vec![0.0; new.part_len(elements)]];
        for (r, file) in files.iter_mut().enumerate() {
            let theirs = old.owned(elements, r);
            let (from, to) = (mine.start.max(theirs.start), mine.end.min(theirs.end));
            if from >= to {
                continue;
            }
            // Their values from..to, of each array, into ours: the section read in pieces.
            let wanted = from - theirs.start..to - theirs.start;
            file.read_section(index, old.part_len(elements), |which, at, piece| {
                let (start, end) = (at.max(wanted.start), (at + piece.len()).min(wanted.end));
                if start < end {
                    let target = start + theirs.start - mine.start;
                    values[which][target..target + end - start].copy_from_slice(&piece[start - at..end - at]);
                }
            })?;
        }
        parts.push(take(elements, values, time));
    }
    Ok((config, parts, digest))
}

impl ParameterPart {
    /// Its section of a state file, master weights then both moments (zeros before the first
    /// update) as f32 little-endian bytes, handed to `take` in pieces of at most
    /// [`SECTION_PIECE_BYTES`] made in `bytes`.
    fn section_pieces(&self, bytes: &mut Vec<u8>, mut take: impl FnMut(&[u8])) {
        let zeros = [0.0f32; SECTION_PIECE_BYTES / 4];
        for values in [self.master.as_slice(), &self.moments.moment_1, &self.moments.moment_2] {
            let mut left = self.master.len();
            for chunk in values.chunks(SECTION_PIECE_BYTES / 4) {
                bytes.clear();
                bytes.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
                take(bytes);
                left -= chunk.len();
            }
            // A moment before the first update: zeros of the master's length.
            while left > 0 {
                let count = left.min(zeros.len());
                bytes.clear();
                bytes.extend(zeros[..count].iter().flat_map(|v| v.to_le_bytes()));
                take(bytes);
                left -= count;
            }
        }
    }
}

/// The largest piece of a section a save holds at once.
const SECTION_PIECE_BYTES: usize = 1 << 20;

/// One saved rank's state file, its header checked and its sections read on demand.
struct ShardFile {
    path: PathBuf,
    file: fs::File,
    header: ShardHeader,
    /// Where the payload starts.
    payload: u64,
}

impl ShardFile {
    fn open(path: &Path, rank: usize, world: usize) -> Result<Self, UlyssesError> {
        let mut file = fs::File::open(path).map_err(|e| shard_error(path, format!("cannot open ({e}): every rank of the saved world of {world} writes one, and all are needed")))?;
        let mut start = [0u8; 16];
        file.read_exact(&mut start).map_err(|_| shard_error(path, "too short to be a sharded optimizer state"))?;
        let checked = match &start[..8] {
            magic if magic == SHARD_MAGIC => true,
            magic if magic == SHARD_MAGIC_UNCHECKED_HEADER => false,
            _ => return Err(shard_error(path, "not a burn-ulysses sharded optimizer state (wrong magic bytes)")),
        };
        let header_len = u64::from_le_bytes(start[8..].try_into().unwrap());
        let mut header_checksum = [0u8; 8];
        if checked {
            file.read_exact(&mut header_checksum).map_err(|_| shard_error(path, "the header is cut off; the file is truncated"))?;
        }
        // A length past the file's (a corrupt one) is refused before anything is allocated for it.
        let preamble = if checked { 24 } else { 16 };
        let length = file.metadata().map_err(|e| shard_error(path, e))?.len();
        if header_len > length.saturating_sub(preamble) {
            return Err(shard_error(path, format!("its header claims {header_len} bytes, past the file's {length}; the file is truncated or corrupt")));
        }
        if header_len > crate::checkpoint::LONGEST_HEADER_BYTES {
            return Err(shard_error(path, format!("its header claims {header_len} bytes, past any state file's; the file is corrupt. Use an earlier checkpoint.")));
        }
        let mut header = vec![0u8; header_len as usize];
        file.read_exact(&mut header).map_err(|_| shard_error(path, "the header is cut off; the file is truncated"))?;
        // The header holds the optimizer's settings and step counts: a flipped digit there
        // parses, and would change every later update.
        if checked && fnv1a(&[&header]) != u64::from_le_bytes(header_checksum) {
            return Err(shard_error(path, "its header does not match its checksum; the file is corrupt. Use an earlier checkpoint."));
        }
        let header: ShardHeader = serde_json::from_slice(&header).map_err(|e| shard_error(path, format!("unreadable header: {e}")))?;
        if header.format != SHARD_FORMAT || header.rank != rank || header.world != world {
            return Err(shard_error(path, format!("holds rank {} of {} in format {}, not rank {rank} of {world} in format {SHARD_FORMAT}", header.rank, header.world, header.format)));
        }
        let payload = preamble + header_len;
        // Sizes a corrupt header could make overflow are sums past any file: refused as such.
        let expected = header
            .parameters
            .iter()
            .try_fold(0u64, |sum, p| (Partition::new(world).unwrap().part_len(p.elements) as u64).checked_mul(12).and_then(|bytes| sum.checked_add(bytes)))
            .unwrap_or(u64::MAX);
        let described = payload.checked_add(expected);
        if described != Some(length) {
            let described = described.map_or_else(|| "more than 2^64".to_string(), |bytes| bytes.to_string());
            return Err(shard_error(path, format!("has {length} bytes but its header describes {described}; the file is truncated or corrupt")));
        }
        Ok(Self { path: path.to_path_buf(), file, header, payload })
    }

    /// Reads parameter `index`'s section (`part_len` values of each of master, moment 1,
    /// moment 2) a piece at a time, handing `take` each array's values in order (`which`
    /// array, the index of the first value, the values), and checks it against its checksum:
    /// on `Err` what `take` got is not to be used. The section is never held whole (a
    /// rank resumed at another world size reads the whole sections its part overlaps).
    fn read_section(&mut self, index: usize, part_len: usize, mut take: impl FnMut(usize, usize, &[f32])) -> Result<(), UlyssesError> {
        let world = Partition::new(self.header.world).unwrap();
        let offset: u64 = self.header.parameters[..index].iter().map(|p| 12 * world.part_len(p.elements) as u64).sum();
        let cannot_read = |e: std::io::Error| shard_error(&self.path, format!("cannot read: {e}"));
        self.file.seek(SeekFrom::Start(self.payload + offset)).map_err(cannot_read)?;
        let (mut bytes, mut values) = (vec![0u8; SECTION_PIECE_BYTES], Vec::with_capacity(SECTION_PIECE_BYTES / 4));
        let (mut hash, mut read) = (FNV1A_START, 0);
        while read < 3 * part_len {
            // Pieces end at each array's end.
            let (which, at) = (read / part_len, read % part_len);
            let count = (part_len - at).min(SECTION_PIECE_BYTES / 4);
            let piece = &mut bytes[..4 * count];
            self.file.read_exact(piece).map_err(cannot_read)?;
            hash = fnv1a_more(hash, piece);
            values.clear();
            values.extend(piece.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())));
            take(which, at, &values);
            read += count;
        }
        if hash != self.header.parameters[index].checksum {
            return Err(shard_error(&self.path, format!("parameter {index}'s section does not match its checksum; the file is corrupt. Use an earlier checkpoint.")));
        }
        Ok(())
    }
}

/// The world size the state in `dir` was saved by, from its rank 0 file.
fn saved_world(dir: &Path) -> Result<usize, UlyssesError> {
    let entries = fs::read_dir(dir).map_err(|e| shard_error(dir, format!("cannot list the folder: {e}")))?;
    let worlds: Vec<usize> = entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.strip_prefix("optimizer-00000-of-")?.strip_suffix(".ulysses")?.parse().ok())
        .collect();
    match worlds.as_slice() {
        [world] if *world > 0 => Ok(*world),
        [] => Err(shard_error(dir, "holds no sharded optimizer state (no optimizer-00000-of-*.ulysses)")),
        _ => Err(shard_error(dir, format!("holds the states of several world sizes ({worlds:?}); keep one run's files per folder"))),
    }
}

/// The folder, inside a checkpoint folder, that holds every rank's part of the sharded
/// optimizer state of the checkpoint taken after `step` steps by a world of `world` ranks.
/// The world is in the name: a run resumed at another world size that saves at a step whose
/// save a crash cut short writes into a folder of its own, never beside the other world's
/// parts (which the load would refuse as "several world sizes").
pub fn sharded_state_folder(step: u64, world: usize) -> String {
    format!("optimizer-step-{step:09}-of-{world:05}")
}

/// How every [`sharded_state_folder`]'s name begins.
pub const STATE_FOLDER_PREFIX: &str = "optimizer-step-";

/// A training checkpoint whose optimizer state is sharded over `world` (a [`ShardedAdamW`]):
/// collective, every rank of `world` calls it with the same `step` and the same folder (shared
/// by every node). The commit:
/// 1. every rank writes its part, atomically, into `dir/`[`sharded_state_folder`]`(step)`, a
///    folder that does not exist yet (`NAME.1`, `NAME.2`, ... where it does);
/// 2. the ranks agree that every part is written (one host collective);
/// 3. rank 0 writes `dir/checkpoint.ulysses` (`state`, naming that folder), atomically: the
///    checkpoint switches to the new state here, all of it at once;
/// 4. rank 0 removes the state folders no checkpoint names (the previous one, and any left by
///    a crash between 1 and 3; a copy of an earlier checkpoint file kept beside it, under any
///    name, keeps its folder), and every rank learns whether 3 succeeded.
///
/// A crash anywhere leaves `checkpoint.ulysses` naming a complete set of parts: the previous
/// checkpoint's or this one's. The parts' master weights are the model: no rank gathers it to
/// save it ([`load_sharded_training_checkpoint`] sets a model from them). Returns the
/// checkpoint file's path on rank 0.
pub fn save_sharded_training_checkpoint<B, S>(
    dir: &Path,
    optimizer: &mut dyn ShardedState,
    parameter_paths: &[String],
    state: &S,
    step: u64,
    world: &dyn Communicator<B::Wire>,
) -> Result<Option<PathBuf>, UlyssesError>
where
    B: TrainBackend,
    S: Serialize,
{
    let (rank, size) = (world.rank(), world.size());
    // Never into a folder that exists: a checkpoint file may name it (a kept copy, or the
    // current one after a resume from an earlier copy), whose parts would change under it,
    // torn by a crash. The first free name, rank 0's view (read before any rank writes).
    let base = sharded_state_folder(step, size);
    let named = |suffix: u64| if suffix == 0 { base.clone() } else { format!("{base}.{suffix}") };
    let free = (0..).find(|&suffix| !dir.join(named(suffix)).exists()).expect("some name is free");
    let agreed = burn_ulysses::comm::all_gather_host_checked(world, &[free], "optimizer state folder")?;
    let folder_name = named(agreed[0][0]);
    let folder = dir.join(&folder_name);
    let written = optimizer.save(&folder, rank, size);
    let every_rank = burn_ulysses::comm::all_gather_host_checked(world, &[written.is_ok() as u64], "optimizer state parts written")?;
    written?;
    let failed: Vec<usize> = every_rank.iter().enumerate().filter(|(_, ok)| ok[0] == 0).map(|(r, _)| r).collect();
    if !failed.is_empty() {
        return Err(shard_error(&folder, format!("rank(s) {failed:?} could not write their part of the optimizer state; the previous checkpoint stays the one to resume from")));
    }
    let committed = if rank == 0 {
        // Every part written where rank 0 sees it: a folder local to each node (not shared)
        // would hold some parts on each, a checkpoint that no resume can read.
        let unseen: Vec<usize> = (0..size).filter(|&r| !folder.join(sharded_state_file(r, size)).is_file()).collect();
        let path = match unseen.is_empty() {
            true => crate::checkpoint::write_checkpoint(dir, &[], &[], Some(&folder_name), parameter_paths, state),
            false => Err(shard_error(
                &folder,
                format!(
                    "rank(s) {unseen:?} wrote their part of the optimizer state, but not where rank 0 sees it: the checkpoint folder is not \
                     shared by every node. Give --out a folder on a file system every node mounts; the previous checkpoint stays the one \
                     to resume from"
                ),
            )),
        };
        if path.is_ok() {
            let _ = remove_unnamed_state_folders(dir, Some(&folder_name));
        }
        Some(path)
    } else {
        None
    };
    let ok = committed.as_ref().is_none_or(Result::is_ok);
    let every_rank = burn_ulysses::comm::all_gather_host_checked(world, &[ok as u64], "checkpoint written")?;
    if let Some(path) = committed {
        return path.map(Some);
    }
    if every_rank[0][0] == 0 {
        return Err(shard_error(dir, "rank 0 could not write the checkpoint file (its error says why); the previous checkpoint stays the one to resume from"));
    }
    Ok(None)
}

/// Whether every rank of `world` sees the checkpoint folder `dir` as rank 0 does (one file
/// system every node mounts), which a sharded checkpoint needs: each rank writes its part
/// there. Collective: rank 0 writes a file of a name of its own, each rank looks for it.
/// Checked as a run starts, not at its first checkpoint, hours into it.
pub fn check_folder_shared<W: burn::tensor::backend::Backend>(dir: &Path, world: &dyn Communicator<W>) -> Result<(), UlyssesError> {
    let nonce = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |t| t.as_nanos() as u64) ^ u64::from(std::process::id());
    let nonce = burn_ulysses::comm::all_gather_host_checked(world, &[nonce], "checkpoint folder probe")?[0][0];
    let probe = dir.join(format!(".shared-by-every-rank-{nonce:016x}"));
    let written = match world.rank() {
        0 => fs::create_dir_all(dir).and_then(|()| fs::write(&probe, b"")).map_err(|e| e.to_string()),
        _ => Ok(()),
    };
    let every_rank = burn_ulysses::comm::all_gather_host_checked(world, &[written.is_ok() as u64], "checkpoint folder probe written")?;
    if let Err(error) = written {
        return Err(shard_error(dir, format!("rank 0 cannot write into it ({error}): every checkpoint would fail; give --out a folder it can write")));
    }
    if every_rank[0][0] == 0 {
        return Err(shard_error(dir, "rank 0 cannot write into it (its error says why): every checkpoint would fail"));
    }
    let seen = probe.is_file();
    let every_rank = burn_ulysses::comm::all_gather_host_checked(world, &[seen as u64], "checkpoint folder probe seen")?;
    if world.rank() == 0 {
        let _ = fs::remove_file(&probe);
    }
    let unseen: Vec<usize> = every_rank.iter().enumerate().filter(|(_, seen)| seen[0] == 0).map(|(r, _)| r).collect();
    match unseen.is_empty() {
        true => Ok(()),
        false => Err(shard_error(
            dir,
            format!(
                "is not the folder rank 0 writes for rank(s) {unseen:?} (a file rank 0 wrote there is not there): each rank writes its \
                 part of the sharded optimizer state into the checkpoint folder, so it must be on a file system every node mounts"
            ),
        )),
    }
}

/// Removes every sharded-state folder in `dir` but `keep` and those a checkpoint file in `dir`
/// names (what a crash or the previous checkpoint left, where no copy of a checkpoint file
/// kept beside it names it); a folder that cannot be removed is a warning. The trainer also
/// calls it when a replicated run replaces a sharded one's checkpoint (`--overwrite`), and as
/// it claims a run folder to resume in, for what a save killed between writing its parts and
/// committing them left (a whole copy of the optimizer state). Returns the folders removed.
/// Where an entry of the folder cannot be listed, or a file in it may be a checkpoint but
/// cannot be read (a read error, a header cut off or corrupt), it removes nothing, with a
/// warning: which folders that file needs is unknown, and the state it needs cannot be made
/// again. A folder that cannot be read at all has nothing it could remove.
pub fn remove_unnamed_state_folders(dir: &Path, keep: Option<&str>) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let keep_all = |what: &Path, error: &dyn std::fmt::Display| {
        tracing::warn!(path = %what.display(), %error, "removing no optimizer state folder: which of them a checkpoint here needs cannot be told");
    };
    let Ok(entries) = fs::read_dir(dir) else { return removed };
    let entries: Vec<fs::DirEntry> = match entries.collect() {
        Ok(entries) => entries,
        Err(error) => {
            keep_all(dir, &error);
            return removed;
        }
    };
    // Every checkpoint file, whatever its name (a copy kept as `step-3.ulysses` or
    // `before-the-lr-change.bak`): a file is one by its magic bytes, its header alone read. Not
    // a write's temporary file: a save killed before its rename names the folder it left.
    let mut named = Vec::new();
    for entry in &entries {
        let path = entry.path();
        match fs::metadata(&path) {
            Ok(metadata) if !metadata.is_file() => continue,
            // A link to nothing is no checkpoint anyone can load.
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
            Err(error) => {
                keep_all(&path, &error);
                return removed;
            }
            Ok(_) => {}
        }
        if crate::checkpoint::is_temporary_write(&entry.file_name().to_string_lossy()) {
            continue;
        }
        match crate::checkpoint::named_state_folder(&path) {
            Ok(folder) => named.extend(folder),
            Err(error) => {
                keep_all(&path, &error);
                return removed;
            }
        }
    }
    for entry in entries {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(STATE_FOLDER_PREFIX) && Some(name.as_str()) != keep && !named.contains(&name) {
            match fs::remove_dir_all(entry.path()) {
                Ok(()) => removed.push(entry.path()),
                Err(error) => tracing::warn!(folder = %entry.path().display(), %error, "cannot remove an optimizer state folder no checkpoint names"),
            }
        }
    }
    removed
}

/// Loads a checkpoint written by [`save_sharded_training_checkpoint`]: the optimizer state
/// re-partitioned for this rank of `world` (any size: [`ShardedAdamW::load`]), `model` (a fresh
/// one of the same shapes, on its device) with every float parameter set from the master
/// weights (all-gathered, in the parameter's dtype), and the saved state. Collective over
/// `world`: the ranks first agree that each loaded the checkpoint and that all read the same
/// state (a digest of every part's checksums); refused then, on every rank, when one could
/// not or they read different states, and before the gather when the parts are of another
/// model.
pub fn load_sharded_training_checkpoint<B, M, S>(location: &Path, model: M, world: &dyn Communicator<B::Wire>) -> Result<(M, ShardedAdamW, S), UlyssesError>
where
    B: TrainBackend,
    M: AutodiffModule<B>,
    S: serde::de::DeserializeOwned,
{
    let (optimizer, state) = load_sharded_optimizer::<B, M, S>(location, &model, world)?;
    let model = optimizer.model_from_masters::<B, M>(model, world).map_err(|e| shard_error(&crate::checkpoint::checkpoint_path(location), e))?;
    Ok((model, optimizer, state))
}

/// [`load_sharded_training_checkpoint`] without setting a model: the optimizer state (for this
/// rank of `world`) and the saved state, checked against `model`'s parameters (their paths;
/// it may be lazy, as `Config::init` leaves it, and stays so). ZeRO-3 cuts its parts from the
/// master weights (`ShardedParameters::shard_from`), no whole model on any rank.
/// Collective over `world`.
pub fn load_sharded_optimizer<B, M, S>(location: &Path, model: &M, world: &dyn Communicator<B::Wire>) -> Result<(ShardedAdamW, S), UlyssesError>
where
    B: TrainBackend,
    M: AutodiffModule<B>,
    S: serde::de::DeserializeOwned,
{
    load_sharded_state::<B, M, S, _>(location, model, world, ShardedAdamW::load_with_digest)
}

/// [`load_sharded_optimizer`] into a [`DeviceShardedAdamW`](super::DeviceShardedAdamW) on
/// `device`, each parameter's part uploaded as it is read: the host never holds the rank's
/// whole state (12 bytes a parameter of its parts; 96 GB for 8B on one GPU), as the device
/// optimizer's save never does.
pub fn load_sharded_optimizer_on_device<B, M, S>(
    location: &Path,
    model: &M,
    world: &dyn Communicator<B::Wire>,
    device: &burn::tensor::Device<B::InnerBackend>,
) -> Result<(super::DeviceShardedAdamW<B>, S), UlyssesError>
where
    B: TrainBackend,
    M: AutodiffModule<B>,
    S: serde::de::DeserializeOwned,
{
    load_sharded_state::<B, M, S, _>(location, model, world, |dir, rank, world| super::DeviceShardedAdamW::load_with_digest(dir, rank, world, device))
}

fn load_sharded_state<B, M, S, O>(location: &Path, model: &M, world: &dyn Communicator<B::Wire>, load: impl FnOnce(&Path, usize, usize) -> Result<(O, u64), UlyssesError>) -> Result<(O, S), UlyssesError>
where
    B: TrainBackend,
    M: AutodiffModule<B>,
    S: serde::de::DeserializeOwned,
{
    let path = crate::checkpoint::checkpoint_path(location);
    let loaded = || -> Result<(S, O, u64), UlyssesError> {
        let contents = crate::checkpoint::read_checkpoint::<S>(location)?;
        let Some(folder) = contents.optimizer_shards else {
            return Err(crate::checkpoint::error(
                &path,
                "it holds a replicated optimizer's state, not a sharded one (a run without the optimizer on the host or ZeRO-3): load it \
                 with load_training_checkpoint (the trainer: without --offload-optimizer and --zero 3)",
            ));
        };
        // The sections go by position: the model's parameters must come in the saved order.
        let paths = crate::parameter_paths(model);
        if !contents.parameter_paths.is_empty() && contents.parameter_paths != paths {
            let at = contents.parameter_paths.iter().zip(&paths).position(|(saved, ours)| saved != ours).unwrap_or(paths.len().min(contents.parameter_paths.len()));
            let (saved, ours) = (contents.parameter_paths.get(at).map_or("none", String::as_str), paths.get(at).map_or("none", String::as_str));
            return Err(crate::checkpoint::error(
                &path,
                format!(
                    "its optimizer state is of a model whose parameter {at} is `{saved}` ({} in all), where this model's is `{ours}` ({} in all): \
                     the state goes by position, so it would load crosswise. Resume with the model's code the checkpoint was written by",
                    contents.parameter_paths.len(),
                    paths.len()
                ),
            ));
        }
        if !crate::checkpoint::is_plain_name(&folder) {
            return Err(crate::checkpoint::error(&path, format!("it names its optimizer state `{folder}`, not a folder beside it: an edited or foreign header")));
        }
        let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let (optimizer, digest) = load(&dir.join(folder), world.rank(), world.size())?;
        Ok((contents.state, optimizer, digest))
    };
    let loaded = loaded();
    // Every rank must gather the same parameters from the same parts.
    let mine = match &loaded {
        Ok((_, _, digest)) => [1, *digest],
        Err(_) => [0, 0],
    };
    let every_rank = burn_ulysses::comm::all_gather_host_checked(world, &mine, "sharded checkpoint loaded")?;
    let (state, optimizer, digest) = loaded?;
    if let Some(rank) = every_rank.iter().position(|r| r[0] == 0) {
        return Err(shard_error(&path, format!("rank {rank} could not load the checkpoint (its error says why)")));
    }
    if let Some(rank) = every_rank.iter().position(|r| r[1] != digest) {
        return Err(shard_error(
            &path,
            format!("rank {rank} read other optimizer state than rank {} (the digests of their parts differ): every rank must read the same files (a shared file system)", world.rank()),
        ));
    }
    Ok((optimizer, state))
}

fn shard_error(path: &Path, reason: impl std::fmt::Display) -> UlyssesError {
    UlyssesError::Checkpoint { path: path.display().to_string(), reason: reason.to_string() }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use burn::{optim::GradientsParams, tensor::Tensor};

    use super::*;
    use crate::zero::host_adamw::tests::{of_rank, whole};

    /// A save asks for each part once (a part on the device is downloaded for it: it was twice,
    /// to hash and to write) and hashes the bytes it writes: the file loads back equal, with
    /// numbers of every length in its header (a part of 3 elements and one of 10 000).
    #[test]
    fn a_save_reads_each_part_once_and_loads_back() {
        let values = |len: usize, seed: f32| (0..len).map(|i| seed + i as f32 * 0.5).collect::<Vec<f32>>();
        let parts = [3, 10_000].map(|len| ParameterPart { elements: len, master: Arc::new(values(len, 1.0)), moments: AdamWMoments { moment_1: values(len, 2.0), moment_2: values(len, 3.0), time: 7 } });
        let dir = std::env::temp_dir().join(format!("ulysses-state-once-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let mut asked = vec![0; parts.len()];
        write_state_file(&dir, None, 0, 1, HostAdamWConfig::default(), parts.len(), |index| {
            asked[index] += 1;
            Cow::Borrowed(&parts[index])
        })
        .unwrap();
        assert_eq!(asked, [1, 1], "parts asked for per save");
        let loaded = ShardedAdamW::load(&dir, 0, 1).unwrap();
        for (got, want) in loaded.parts.iter().zip(&parts) {
            assert!(got.elements == want.elements && got.master == want.master && got.moments.moment_1 == want.moments.moment_1 && got.moments.moment_2 == want.moments.moment_2 && got.moments.time == 7);
        }
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A section handed out in pieces (a save holds one piece at a time) is, end to end, the
    /// master weights and both moments as f32 little-endian bytes, zeros for the moments
    /// before the first update; across pieces of 1 MiB and a tail.
    #[test]
    fn a_section_in_pieces_is_the_whole_section() {
        let len = 600_001;
        let values = |seed: f32| (0..len).map(|i| seed + i as f32 * 0.25).collect::<Vec<f32>>();
        let whole = |arrays: [&[f32]; 3]| arrays.concat().iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
        let stepped = ParameterPart { elements: len, master: Arc::new(values(1.0)), moments: AdamWMoments { moment_1: values(2.0), moment_2: values(3.0), time: 4 } };
        let fresh = ParameterPart { elements: len, master: Arc::new(values(1.0)), moments: AdamWMoments::default() };
        let zeros = vec![0.0f32; len];
        for (part, want) in [(&stepped, whole([&values(1.0), &values(2.0), &values(3.0)])), (&fresh, whole([&values(1.0), &zeros, &zeros]))] {
            let (mut got, mut pieces, mut bytes) = (Vec::new(), 0, Vec::new());
            part.section_pieces(&mut bytes, |piece| {
                assert!(piece.len() <= SECTION_PIECE_BYTES);
                got.extend_from_slice(piece);
                pieces += 1;
            });
            assert_eq!(pieces, 9, "three arrays of 2.4 MB in pieces of 1 MiB");
            assert!(got == want, "the pieces differ from the section");
        }
    }

    /// A parameter whose saved parts span several pieces of a read (1 000 001 elements saved
    /// by 2 ranks: 2 MB an array a part, pieces of 1 MiB) re-partitions as a small one does:
    /// loaded at 2, 3 and 1.
    #[test]
    fn a_parameter_read_in_pieces_loads_at_any_world_size() {
        let dir = std::env::temp_dir().join(format!("ulysses-sharded-large-{}", std::process::id()));
        let elements = 1_000_001;
        let values = |which: usize| (0..elements).map(|i| (i * 3 + which) as f32 * 0.5).collect::<Vec<f32>>();
        let whole: super::super::host_adamw::tests::Whole = vec![(5, 2, [vec![1.0; 5], vec![2.0; 5], vec![3.0; 5]]), (elements, 2, [values(0), values(1), values(2)])];
        for rank in 0..2 {
            of_rank(&whole, rank, 2).save(&dir, rank, 2).unwrap();
        }
        for world in [2, 3, 1] {
            for rank in 0..world {
                assert!(same(&ShardedAdamW::load(&dir, rank, world).unwrap(), &of_rank(&whole, rank, world)), "rank {rank} of {world}");
            }
        }
        fs::remove_dir_all(&dir).unwrap();
    }

    /// The optimizer on the device writes its parts (read back one at a time) into the same
    /// file, byte for byte, as the optimizer on the host holding the same state: either
    /// resumes the other.
    #[test]
    fn the_state_on_the_device_saves_the_file_the_state_on_the_host_saves() {
        type Ad = burn::backend::Autodiff<burn::backend::NdArray<f32>>;
        let dir = std::env::temp_dir().join(format!("ulysses-sharded-device-{}", std::process::id()));
        let whole = whole();
        for rank in 0..3 {
            let mut host = of_rank(&whole, rank, 3);
            let mut device = super::super::DeviceShardedAdamW::<Ad>::from_host(&host, &Default::default());
            let (host_file, device_file) = (host.save(&dir.join("host"), rank, 3).unwrap(), device.save(&dir.join("device"), rank, 3).unwrap());
            assert!(fs::read(host_file).unwrap() == fs::read(device_file).unwrap(), "rank {rank}: the files differ");
        }
        fs::remove_dir_all(&dir).unwrap();
    }

    fn same(a: &ShardedAdamW, b: &ShardedAdamW) -> bool {
        a.adamw.config() == b.adamw.config()
            && a.place == b.place
            && a.parts.len() == b.parts.len()
            && a.parts.iter().zip(&b.parts).all(|(a, b)| a.elements == b.elements && a.master == b.master && a.moments == b.moments)
    }

    /// Saved by 4 ranks, the state loads at 4 (each rank its own part back), at 3, 2 and 1
    /// (each rank the parts the partition gives it at that size, from the saved ones that
    /// overlap it), parameters that never stepped included.
    #[test]
    fn the_state_saved_by_each_rank_loads_at_any_world_size() {
        let dir = std::env::temp_dir().join(format!("ulysses-sharded-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let whole = whole();
        for rank in 0..4 {
            of_rank(&whole, rank, 4).save(&dir, rank, 4).unwrap();
        }
        for world in [4, 3, 2, 1] {
            for rank in 0..world {
                let loaded = ShardedAdamW::load(&dir, rank, world).unwrap();
                assert!(same(&loaded, &of_rank(&whole, rank, world)), "rank {rank} of {world}");
            }
        }
        fs::remove_dir_all(&dir).unwrap();
    }

    /// The sharded checkpoint's commit: two ranks step twice and checkpoint after each step;
    /// the folder then holds the last checkpoint's parts alone (the first's, and a crash's
    /// leftover, removed), and loads at world 1 with the master weights equal to the model's
    /// parameters, a fresh model set from them (the file holds no model), and both steps in
    /// the moments. Parts written for a later step that no
    /// checkpoint file names (a crash before the commit) change nothing; a replicated load
    /// is refused, naming the flag.
    #[test]
    fn a_sharded_checkpoint_commits_every_part_at_once_and_loads_at_another_world() {
        use burn::{
            backend::{Autodiff, NdArray},
            nn::{Initializer, Linear, LinearConfig},
            optim::AdamWConfig,
        };
        type Ad = Autodiff<NdArray<f32>>;
        let dir = std::env::temp_dir().join(format!("ulysses-sharded-commit-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join(sharded_state_folder(7, 2))).unwrap();
        let layer = || LinearConfig::new(3, 2).with_initializer(Initializer::Constant { value: 0.5 }).init::<Ad>(&Default::default());
        let shared = dir.clone();
        let outcome = burn_ulysses::comm::ThreadGroup::new(2).run(move |rank| {
            let comm = rank.communicator();
            let (mut linear, mut optimizer) = (layer(), ShardedAdamW::new(HostAdamWConfig::default()));
            for step in 1..=2u64 {
                let input = Tensor::<Ad, 2>::ones([1, 3], &Default::default()) * (comm.rank() + step as usize) as f32;
                let grads = GradientsParams::from_grads(linear.forward(input).sum().backward(), &linear);
                linear = optimizer.step::<Ad, _>(1e-2, linear, grads, None, &*comm).unwrap().0;
                if step == 2 && comm.rank() == 0 {
                    // What a world of 4 left of step 2 when a crash cut its save short (and a
                    // resume at world 2 from step 1 has not saved since): the world of 2 that
                    // saves step 2 does not mix its parts with them.
                    let stale = shared.join(sharded_state_folder(2, 4));
                    fs::create_dir_all(&stale).unwrap();
                    fs::write(stale.join("optimizer-00000-of-00004.ulysses"), b"a part of another world").unwrap();
                }
                save_sharded_training_checkpoint::<Ad, _>(&shared, &mut optimizer, &crate::parameter_paths(&linear), &step, step, &*comm).unwrap();
            }
            let weights: Vec<f32> = [linear.weight.val().into_data().to_vec().unwrap(), linear.bias.as_ref().unwrap().val().into_data().to_vec().unwrap()].concat();
            // A crash after every part of step 3 was written, before the checkpoint file was.
            optimizer.save(&shared.join(sharded_state_folder(3, 2)), comm.rank(), 2).map(|_| weights)
        });
        let weights: Vec<Vec<f32>> = outcome.into_iter().map(|r| r.unwrap().unwrap()).collect();
        assert_eq!(weights[0], weights[1], "the ranks' parameters parted");

        let mut folders: Vec<String> = fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).filter(|n| n.starts_with(STATE_FOLDER_PREFIX)).collect();
        folders.sort();
        assert_eq!(folders, [sharded_state_folder(2, 2), sharded_state_folder(3, 2)], "the first checkpoint's parts and the crashes' leftovers are removed");
        assert!(crate::checkpoint::read_checkpoint::<u64>(&dir).unwrap().model.is_empty(), "the master weights are the model: the file holds none");
        let shared = dir.clone();
        let loaded = burn_ulysses::comm::ThreadGroup::new(1).run(move |rank| load_sharded_training_checkpoint::<Ad, Linear<Ad>, u64>(&shared, layer(), &*rank.communicator()).unwrap());
        let (loaded, optimizer, step) = loaded.into_iter().next().unwrap().unwrap();
        assert_eq!(step, 2, "the checkpoint file names the last committed step");
        let values = [loaded.weight.val().into_data().to_vec::<f32>().unwrap(), loaded.bias.unwrap().val().into_data().to_vec::<f32>().unwrap()].concat();
        assert_eq!(values, weights[0], "the fresh model (every value 0.5) set from the master weights");
        assert_eq!([optimizer.parts[0].master.to_vec(), optimizer.parts[1].master.to_vec()].concat(), weights[0], "rank 0 of 1 holds the whole master weights, as the parameters");
        assert!(optimizer.parts.iter().all(|part| part.moments.time == 2));

        // A model whose parameters are named otherwise (another version of its code), of the
        // same sizes: refused, not loaded by position.
        #[derive(burn::module::Module, Debug)]
        struct Renamed<B: burn::tensor::backend::Backend> {
            projection: Linear<B>,
        }
        let shared = dir.clone();
        let renamed = burn_ulysses::comm::ThreadGroup::new(1).run(move |rank| {
            load_sharded_training_checkpoint::<Ad, Renamed<Ad>, u64>(&shared, Renamed { projection: layer() }, &*rank.communicator()).map(drop).map_err(|e| e.to_string())
        });
        let message = renamed.into_iter().next().unwrap().unwrap().expect_err("loaded by position into other parameters");
        assert!(message.contains("parameter 0 is `weight` (2 in all), where this model's is `projection.weight`"), "{message}");
        let replicated = crate::checkpoint::load_training_checkpoint::<Ad, _, _, u64>(&dir, layer(), AdamWConfig::new().init::<Ad, Linear<Ad>>(), &Default::default());
        let message = replicated.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(message.contains("sharded") && message.contains("--offload-optimizer"), "{message}");

        // A header naming a state folder outside its own (edited, or another run's, whose parts
        // fit this model): refused, not read.
        let elsewhere = format!("ulysses-another-run-{}", std::process::id());
        let other_run = dir.parent().unwrap().join(&elsewhere);
        fs::create_dir_all(other_run.join(sharded_state_folder(2, 2))).unwrap();
        for part in fs::read_dir(dir.join(sharded_state_folder(2, 2))).unwrap() {
            let part = part.unwrap();
            fs::copy(part.path(), other_run.join(sharded_state_folder(2, 2)).join(part.file_name())).unwrap();
        }
        let foreign = format!("../{elsewhere}/{}", sharded_state_folder(2, 2));
        crate::checkpoint::write_checkpoint(&dir, &[], &[], Some(&foreign), &crate::parameter_paths(&layer()), &2u64).unwrap();
        let shared = dir.clone();
        let outside = burn_ulysses::comm::ThreadGroup::new(1).run(move |rank| {
            load_sharded_training_checkpoint::<Ad, Linear<Ad>, u64>(&shared, layer(), &*rank.communicator()).map(drop).map_err(|e| e.to_string())
        });
        let message = outside.into_iter().next().unwrap().unwrap().expect_err("loaded a state folder outside the checkpoint's");
        assert!(message.contains(&format!("names its optimizer state `{foreign}`, not a folder beside it")), "{message}");
        fs::remove_dir_all(&other_run).unwrap();
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A checkpoint folder of each node's own (two ranks, two folders): every part is written,
    /// but rank 0 sees only its own, so no checkpoint file is committed and every rank stops
    /// with the reason (before, each commit "succeeded" and no resume could read it).
    #[test]
    fn a_checkpoint_folder_not_shared_by_every_rank_commits_nothing() {
        use burn::backend::{Autodiff, NdArray};
        type Ad = Autodiff<NdArray<f32>>;
        let root = std::env::temp_dir().join(format!("ulysses-sharded-local-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let whole = whole();
        let folders = root.clone();
        let outcome = burn_ulysses::comm::ThreadGroup::new(2).run(move |rank| {
            let comm = rank.communicator();
            let dir = folders.join(format!("node-{}", comm.rank()));
            fs::create_dir_all(&dir).unwrap();
            let mut optimizer = of_rank(&whole, comm.rank(), 2);
            save_sharded_training_checkpoint::<Ad, _>(&dir, &mut optimizer, &[], &1u64, 1, &*comm).map_err(|e| e.to_string())
        });
        let messages: Vec<String> = outcome.into_iter().map(|r| r.unwrap().expect_err("committed a checkpoint that no resume reads")).collect();
        assert!(messages[0].contains("rank(s) [1] wrote their part of the optimizer state, but not where rank 0 sees it"), "{}", messages[0]);
        assert!(messages[1].contains("rank 0 could not write the checkpoint file"), "{}", messages[1]);
        for node in 0..2 {
            assert!(!root.join(format!("node-{node}")).join(crate::checkpoint::CHECKPOINT_FILE).exists(), "node {node} holds a checkpoint file");
        }
        // Found as the run starts: by the probe, on every rank; a shared folder passes and is
        // left as it was.
        let folders = root.clone();
        let probed = burn_ulysses::comm::ThreadGroup::new(2).run(move |rank| {
            let comm = rank.communicator();
            let shared = check_folder_shared::<NdArray<f32>>(&folders.join("shared"), &*comm).map_err(|e| e.to_string());
            (shared, check_folder_shared::<NdArray<f32>>(&folders.join(format!("node-{}", comm.rank())), &*comm).map_err(|e| e.to_string()))
        });
        for (rank, result) in probed.into_iter().enumerate() {
            let (shared, local) = result.unwrap();
            assert_eq!(shared, Ok(()), "rank {rank}");
            let message = local.expect_err("node-local folders passed");
            assert!(message.contains("is not the folder rank 0 writes for rank(s) [1]"), "rank {rank}: {message}");
        }
        assert_eq!(fs::read_dir(root.join("shared")).unwrap().count(), 0, "the probe is removed");
        // A folder rank 0 cannot write: every rank stops as the run starts.
        fs::write(root.join("a-file"), b"").unwrap();
        let folders = root.clone();
        let unwritable = burn_ulysses::comm::ThreadGroup::new(2).run(move |rank| check_folder_shared::<NdArray<f32>>(&folders.join("a-file/run"), &*rank.communicator()).map_err(|e| e.to_string()));
        for (rank, result) in unwritable.into_iter().enumerate() {
            let message = result.unwrap().expect_err("an unwritable folder passed");
            assert!(message.contains("rank 0 cannot write into it"), "rank {rank}: {message}");
        }
        fs::remove_dir_all(&root).unwrap();
    }

    /// A copy of a checkpoint file kept beside it (`step-1.ulysses`, as one keeps history, or
    /// under a name of one's own) keeps the state folder it names through later commits, and
    /// loads; the folders no file names go. (Before, each commit removed every folder but its own, and the copy failed
    /// to load: "cannot list the folder".)
    #[test]
    fn a_kept_copy_of_a_checkpoint_keeps_its_state_and_loads() {
        use burn::{
            backend::{Autodiff, NdArray},
            nn::{Initializer, Linear, LinearConfig},
        };
        type Ad = Autodiff<NdArray<f32>>;
        let dir = std::env::temp_dir().join(format!("ulysses-sharded-copy-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let layer = || LinearConfig::new(3, 2).with_initializer(Initializer::Constant { value: 0.5 }).init::<Ad>(&Default::default());
        let shared = dir.clone();
        let outcome = burn_ulysses::comm::ThreadGroup::new(2).run(move |rank| {
            let comm = rank.communicator();
            let (mut linear, mut optimizer) = (layer(), ShardedAdamW::new(HostAdamWConfig::default()));
            let mut after_first = Vec::new();
            for step in 1..=3u64 {
                let input = Tensor::<Ad, 2>::ones([1, 3], &Default::default()) * (comm.rank() + step as usize) as f32;
                let grads = GradientsParams::from_grads(linear.forward(input).sum().backward(), &linear);
                linear = optimizer.step::<Ad, _>(1e-2, linear, grads, None, &*comm).unwrap().0;
                save_sharded_training_checkpoint::<Ad, _>(&shared, &mut optimizer, &crate::parameter_paths(&linear), &step, step, &*comm).unwrap();
                comm.barrier().unwrap();
                if step == 1 {
                    after_first = linear.weight.val().into_data().to_vec::<f32>().unwrap();
                    if comm.rank() == 0 {
                        fs::copy(shared.join("checkpoint.ulysses"), shared.join("step-1.ulysses")).unwrap();
                    }
                }
                if step == 2 && comm.rank() == 0 {
                    // A copy under a name of one's own keeps its folder too.
                    fs::copy(shared.join("checkpoint.ulysses"), shared.join("before-the-lr-change.bak")).unwrap();
                }
                if step == 3 && comm.rank() == 0 {
                    // A write's temporary file (a save killed before its rename) keeps none.
                    fs::copy(shared.join("checkpoint.ulysses"), shared.join(".checkpoint.ulysses.tmp-4242")).unwrap();
                }
                comm.barrier().unwrap();
            }
            // A run resumed from the copy saves step 1 again (other values): into a folder
            // of its own, not into the copy's.
            let input = Tensor::<Ad, 2>::ones([1, 3], &Default::default()) * 7.0;
            let grads = GradientsParams::from_grads(linear.forward(input).sum().backward(), &linear);
            let paths = crate::parameter_paths(&linear);
            optimizer.step::<Ad, _>(1e-2, linear, grads, None, &*comm).unwrap();
            save_sharded_training_checkpoint::<Ad, _>(&shared, &mut optimizer, &paths, &1u64, 1, &*comm).unwrap();
            after_first
        });
        let after_first = outcome.into_iter().next().unwrap().unwrap();
        let mut folders: Vec<String> = fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).filter(|n| n.starts_with(STATE_FOLDER_PREFIX)).collect();
        folders.sort();
        let again = format!("{}.1", sharded_state_folder(1, 2));
        assert_eq!(folders, [sharded_state_folder(1, 2), again, sharded_state_folder(2, 2)], "the copies' folders kept and untouched, step 3's removed once the checkpoint moved on (a temporary file naming it)");
        let copy = dir.join("step-1.ulysses");
        let loaded = burn_ulysses::comm::ThreadGroup::new(1).run(move |rank| load_sharded_training_checkpoint::<Ad, Linear<Ad>, u64>(&copy, layer(), &*rank.communicator()));
        let (loaded, _, step) = loaded.into_iter().next().unwrap().unwrap().unwrap();
        assert_eq!(step, 1);
        assert_eq!(loaded.weight.val().into_data().to_vec::<f32>().unwrap(), after_first, "the copy loads the first step's weights");
        // A file that may be a checkpoint but whose header cannot be read (a copy cut short)
        // may need any folder: none is removed while it is there; a file of other bytes
        // changes nothing.
        let stale = dir.join(sharded_state_folder(9, 2));
        fs::create_dir_all(&stale).unwrap();
        let bak = fs::read(dir.join("before-the-lr-change.bak")).unwrap();
        fs::write(dir.join("cut-short.ulysses"), &bak[..40]).unwrap();
        fs::write(dir.join("notes.txt"), "no checkpoint").unwrap();
        assert!(remove_unnamed_state_folders(&dir, None).is_empty() && stale.is_dir(), "a folder removed beside a checkpoint that cannot be read");
        // Cut inside the header's length, after the magic bytes: the same; and inside the magic
        // bytes (a copy under way); an empty file (a lock's) is no checkpoint.
        fs::write(dir.join("cut-short.ulysses"), &bak[..12]).unwrap();
        assert!(remove_unnamed_state_folders(&dir, None).is_empty() && stale.is_dir(), "a folder removed beside a checkpoint cut after its magic");
        fs::write(dir.join("cut-short.ulysses"), &bak[..4]).unwrap();
        fs::write(dir.join("empty"), b"").unwrap();
        assert!(remove_unnamed_state_folders(&dir, None).is_empty() && stale.is_dir(), "a folder removed beside a checkpoint cut inside its magic");
        fs::remove_file(dir.join("cut-short.ulysses")).unwrap();
        assert_eq!(remove_unnamed_state_folders(&dir, None), [stale.clone()], "an empty file kept a stale folder");
        fs::create_dir_all(&stale).unwrap();
        // A header whose folder's name fails the names' checksum (a flipped digit: the stale
        // folder's name) tells no folder: none is removed while it is there.
        let (named, other) = (sharded_state_folder(2, 2), sharded_state_folder(9, 2));
        let at = bak.windows(named.len()).position(|w| w == named.as_bytes()).expect("the copy names its folder");
        let mut renamed = bak.clone();
        renamed[at..at + named.len()].copy_from_slice(other.as_bytes());
        fs::write(dir.join("renamed.ulysses"), &renamed).unwrap();
        // The file alone naming that folder (the copy that names it too set aside).
        let aside = dir.with_extension("bak-aside");
        fs::rename(dir.join("before-the-lr-change.bak"), &aside).unwrap();
        assert!(remove_unnamed_state_folders(&dir, None).is_empty() && stale.is_dir() && dir.join(&named).is_dir(), "a folder removed beside a name its checksum refutes");
        fs::rename(&aside, dir.join("before-the-lr-change.bak")).unwrap();
        fs::rename(dir.join("renamed.ulysses"), dir.join("cut-short.ulysses")).unwrap();
        // A header whose state fails its checksum still names its folder (read leniently).
        let state = bak.windows(8).position(|w| w == b"\"state\":").expect("a state in the header") + 8;
        let mut flipped = bak;
        assert_eq!(flipped[state], b'2', "the copy's state is step 2");
        flipped[state] = b'3';
        fs::remove_file(dir.join("before-the-lr-change.bak")).unwrap();
        fs::write(dir.join("flipped.bak"), &flipped).unwrap();
        assert!(crate::checkpoint::read_checkpoint_state::<u64>(&dir.join("flipped.bak")).is_err(), "the flipped state fails its checksum");
        fs::remove_file(dir.join("cut-short.ulysses")).unwrap();
        assert_eq!(remove_unnamed_state_folders(&dir, None), [stale], "the stale folder alone removed");
        let mut folders: Vec<String> = fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).filter(|n| n.starts_with(STATE_FOLDER_PREFIX)).collect();
        folders.sort();
        assert_eq!(folders, [sharded_state_folder(1, 2), format!("{}.1", sharded_state_folder(1, 2)), sharded_state_folder(2, 2)]);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A missing rank's file, a corrupt section or header, a torn file and two runs' files in one
    /// folder are refused, naming the file and what to do.
    #[test]
    fn incomplete_or_corrupt_state_is_refused_naming_the_file() {
        let dir = std::env::temp_dir().join(format!("ulysses-sharded-bad-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let whole = whole();
        let saved: Vec<PathBuf> = (0..2).map(|rank| of_rank(&whole, rank, 2).save(&dir, rank, 2).unwrap()).collect();
        let error = |world| ShardedAdamW::load(&dir, 0, world).err().map(|e| e.to_string()).unwrap_or_default();

        let bytes = fs::read(&saved[1]).unwrap();
        fs::remove_file(&saved[1]).unwrap();
        let missing = error(2);
        assert!(missing.contains("optimizer-00001-of-00002.ulysses") && missing.contains("all are needed"), "{missing}");

        let mut flipped = bytes.clone();
        *flipped.last_mut().unwrap() ^= 1;
        fs::write(&saved[1], &flipped).unwrap();
        let corrupt = error(1);
        assert!(corrupt.contains("checksum") && corrupt.contains("optimizer-00001-of-00002"), "{corrupt}");

        // A digit of the AdamW settings in the header: still a header that parses.
        let mut flipped = bytes.clone();
        let config = bytes.windows(10).position(|w| w == b"\"config\":{").expect("the header holds the config");
        let digit = config + bytes[config..].iter().position(u8::is_ascii_digit).unwrap();
        flipped[digit] = if flipped[digit] == b'1' { b'2' } else { b'1' };
        fs::write(&saved[1], &flipped).unwrap();
        let corrupt = error(1);
        assert!(corrupt.contains("header does not match its checksum") && corrupt.contains("optimizer-00001-of-00002"), "{corrupt}");

        // A file written before headers had a checksum still loads.
        let unchecked = [SHARD_MAGIC_UNCHECKED_HEADER.as_slice(), &bytes[8..16], &bytes[24..]].concat();
        fs::write(&saved[1], &unchecked).unwrap();
        assert!(same(&ShardedAdamW::load(&dir, 1, 2).unwrap(), &of_rank(&whole, 1, 2)), "an earlier file loads as saved");

        fs::write(&saved[1], &bytes[..bytes.len() - 4]).unwrap();
        let torn = error(2);
        assert!(torn.contains("truncated"), "{torn}");

        // An earlier format's header (no checksum) whose sizes sum past 2^64 (2^62 elements of a
        // parameter): refused, saying so (its message's own sum overflowed).
        let header_len = u64::from_le_bytes(bytes[8..16].try_into().unwrap()) as usize;
        let header = String::from_utf8(bytes[24..24 + header_len].to_vec()).unwrap();
        assert!(header.contains("\"elements\":10"), "{header}");
        let huge_sizes = header.replacen("\"elements\":10", &format!("\"elements\":{}", 1u64 << 62), 1);
        let unchecked = [SHARD_MAGIC_UNCHECKED_HEADER.as_slice(), &(huge_sizes.len() as u64).to_le_bytes(), huge_sizes.as_bytes(), &bytes[24 + header_len..]].concat();
        fs::write(&saved[1], &unchecked).unwrap();
        let past = error(2);
        assert!(past.contains("its header describes more than 2^64"), "{past}");

        // A header length past the file (all ones): refused before a byte is allocated for it.
        let huge = [&bytes[..8], &u64::MAX.to_le_bytes()[..], &bytes[16..]].concat();
        fs::write(&saved[1], &huge).unwrap();
        let claims = error(2);
        assert!(claims.contains(&format!("its header claims {} bytes, past the file's {}", u64::MAX, huge.len())), "{claims}");

        fs::write(&saved[1], &bytes).unwrap();
        of_rank(&whole, 0, 3).save(&dir, 0, 3).unwrap();
        let mixed = error(2);
        assert!(mixed.contains("several world sizes"), "{mixed}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
