//! --data tokenized once. Every process of a job used to tokenize the whole of --data (and
//! --eval-data) at each start: the eight ranks of a node each did a corpus's hours of work, and
//! again each time a scheduler requeued the job. A read's documents (token ids, targets, what
//! the read noticed) are now written to a cache file, which later reads of the same data, read
//! the same way, load in its place: the first process through a lock beside the file tokenizes
//! and writes it, the others wait for it and load it.
//!
//! A file is found by a key naming all that decides what it holds: the data files (names,
//! sizes, modification times, a digest of each one's ends), the tokenizer (and its file's
//! time), the EOS, the vocabulary, the chat template, `--loss-on`, `--too-long` and the
//! reader's version ([`DOCUMENT_READER_VERSION`](crate::documents::DOCUMENT_READER_VERSION)).
//! Each file holds its key, checked on load, and a checksum of the rest; it is written
//! atomically. A file edited in place keeps its size only by chance, and its time never: either
//! makes another key.
//!
//! Layout (little-endian): [`MAGIC`]; the header's length (u64) and the header (JSON: the key,
//! the counts, the notes), padded to 8 bytes; each document's end (u64, in tokens); the tokens
//! (u32); where the documents mark targets, one bit per token (the lowest bit first); the
//! FNV-1a checksum of the header and all after it (u64).

use std::{
    fs::{self, File, OpenOptions},
    io::{self, BufReader, BufWriter, Read, Write},
    path::{Path, PathBuf},
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant, UNIX_EPOCH},
};

use indicatif::HumanBytes;
use serde::{Deserialize, Serialize};
use ulysses_core::digest::{fnv1a, fnv1a_more};

use crate::{
    data_identity::DataIdentity,
    documents::{Documents, ReadNote},
    files::data_files,
    run_folder::resolved,
};

/// What a cache file begins with (the 1 is the layout's version).
pub const MAGIC: &[u8; 8] = b"ULYSTOK1";

/// Data of this many bytes or more is cached without `--data-cache` (less tokenizes in seconds).
pub const AUTO_CACHE_BYTES: u64 = 64 << 20;

/// How often a process waiting for another's tokenizing says so.
const WAIT_LINE_EVERY: Duration = Duration::from_secs(30);

/// The most a header may take (a key and notes: a few kilobytes).
const MOST_HEADER_BYTES: u64 = 64 << 20;

/// Where tokenized data is kept (`--data-cache`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheFolder {
    /// The user's cache folder, for data of [`AUTO_CACHE_BYTES`] or more.
    Auto,
    /// Nowhere: every read tokenizes.
    Off,
    /// This folder, whatever the data's size.
    At(PathBuf),
}

impl CacheFolder {
    /// `--data-cache`'s value: a folder, or `off`; [`Auto`](Self::Auto) where it is not given.
    pub fn from_flag(flag: Option<&Path>) -> Self {
        match flag {
            None => Self::Auto,
            Some(folder) if folder == Path::new("off") => Self::Off,
            Some(folder) => Self::At(folder.to_path_buf()),
        }
    }

    /// The folder data of `bytes` is cached in, where it is cached.
    fn for_bytes(&self, bytes: u64) -> Option<PathBuf> {
        match self {
            Self::Off => None,
            Self::At(folder) => Some(folder.clone()),
            Self::Auto => user_cache_folder().filter(|_| bytes >= AUTO_CACHE_BYTES),
        }
    }
}

/// `$XDG_CACHE_HOME/burn-ulysses/tokenized`, else `~/.cache/burn-ulysses/tokenized`.
pub fn user_cache_folder() -> Option<PathBuf> {
    let absolute = |name: &str| std::env::var_os(name).map(PathBuf::from).filter(|path| path.is_absolute());
    let base = absolute("XDG_CACHE_HOME").or_else(|| absolute("HOME").map(|home| home.join(".cache")))?;
    Some(base.join("burn-ulysses").join("tokenized"))
}

/// What a cache file's header says.
#[derive(Debug, Serialize, Deserialize)]
struct Header {
    key: String,
    documents: u64,
    tokens: u64,
    targets: bool,
    rendered_chat: bool,
    notes: Vec<ReadNote>,
}

/// The documents of `path` (read by `flag`: `--data`, `--eval-data`) read the way `reading`
/// says (all that decides the tokens besides the files), from `cache` where an earlier read left
/// them, else from `read`, then cached. A cache that cannot be used is said and read around:
/// the run never fails for it (but for a `--data-cache` inside the data's folder, refused).
pub fn read_through(cache: &CacheFolder, flag: &str, path: &Path, reading: &str, read: impl FnOnce() -> Result<Documents, String>) -> Result<Documents, String> {
    let (files, others) = data_files(flag, path)?;
    let bytes: u64 = files.iter().map(|file| fs::metadata(file).map_or(0, |m| m.len())).sum();
    let Some(folder) = cache.for_bytes(bytes) else { return read() };
    let around = |why: String| {
        tracing::warn!("{flag} {}: tokenized without the cache, {why} (--data-cache FOLDER puts it elsewhere, --data-cache off reads without)", path.display());
    };
    // Its files would be read as data, another key at each run.
    if path.is_dir() && matches!((resolved(&folder), resolved(path)), (Ok(folder), Ok(path)) if folder.starts_with(&path)) {
        let why = format!("whose folder {} lies inside {flag} {}, every file of which is read as data", folder.display(), path.display());
        if let CacheFolder::At(_) = cache {
            return Err(format!("--data-cache {}: a folder {why}: give a folder elsewhere", folder.display()));
        }
        around(why);
        return read();
    }
    let key = key_of(flag, path, &files, &others, reading)?;
    let file = folder.join(format!("{:016x}.tokens", fnv1a(&[key.as_bytes()])));
    let before = match look(&file, &key, flag, path) {
        Looked::Loaded(documents) => return Ok(documents),
        looked => looked,
    };
    if let Err(error) = fs::create_dir_all(&folder) {
        around(format!("whose folder {} cannot be made: {error}", folder.display()));
        return read();
    }
    // The first process through tokenizes; the others wait, then load what it wrote.
    let lock = match hold_lock(&file.with_extension("lock"), flag, path) {
        Ok(Lock::Held { file, waited }) => (file, waited),
        Ok(Lock::Stalled(holder)) => {
            around(format!("as {holder}, which holds its lock, has shown no sign of life for {} minutes", STALLED.as_secs() / 60));
            return read();
        }
        Err(error) => {
            around(format!("which cannot be locked in {} ({error}; a file system without locks?)", folder.display()));
            return read();
        }
    };
    let (lock, waited) = lock;
    // Written while this process waited (or since it looked): loaded past the lock, by every
    // waiter at once. A file found damaged is written anew, unless written since.
    if has_key(&file, &key) && (waited || matches!(before, Looked::Absent)) {
        drop(lock);
        return match look(&file, &key, flag, path) {
            Looked::Loaded(documents) => Ok(documents),
            Looked::Absent | Looked::Unreadable => read(),
        };
    }
    if waited {
        // The holder could not write it: each waiter in turn would tokenize and fail again.
        let record = fs::read_to_string(file.with_extension("lock")).unwrap_or_default();
        if let Some(why) = record.strip_prefix(UNWRITTEN) {
            drop(lock);
            around(format!("which the process before it could not write ({})", why.trim()));
            return read();
        }
    }
    remove_torn_writes(&file);
    // A sign of life for those who wait, while the read takes its hours.
    let done = AtomicBool::new(false);
    let (documents, written) = std::thread::scope(|scope| {
        let beat = scope.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                // Write access suffices (an explicit time would need the file's owner: a folder
                // shared by a group).
                unsafe { libc::futimens(std::os::fd::AsRawFd::as_raw_fd(&lock), std::ptr::null()) };
                std::thread::park_timeout(HEARTBEAT);
            }
        });
        // Stops the heartbeat however the read ends (a panic too, which the scope would
        // otherwise wait on forever, the lock held and alive to those who wait).
        let _stop = StopBeat { done: &done, beat: beat.thread().clone(), lock: &lock };
        let documents = read();
        let written = documents.as_ref().ok().map(|documents| write(&file, &key, documents));
        (documents, written)
    });
    match written {
        None => record(&lock, &format!("{UNWRITTEN} the read failed")),
        Some(Ok(size)) => {
            record(&lock, "written");
            // Nothing is removed from the folder (another run may read other data from it): its size is said.
            let held: u64 = fs::read_dir(&folder).map_or(0, |entries| entries.flatten().filter_map(|e| e.metadata().ok()).map(|m| m.len()).sum());
            tracing::info!(
                "{flag} {}: tokenized into {} ({}), which later reads of the same data the same way load in its place (--data-cache); \
                 the folder holds {} of tokenized data (a file for each data, reading and build of the trainer: remove those no longer needed)",
                path.display(),
                file.display(),
                HumanBytes(size),
                HumanBytes(held)
            );
        }
        Some(Err(error)) => {
            record(&lock, &format!("{UNWRITTEN} {error}"));
            tracing::warn!("{flag} {}: could not be cached in {} ({error}): the next run tokenizes it again", path.display(), file.display());
        }
    }
    drop(lock);
    documents
}

/// Ends the heartbeat of a lock's holder when dropped; a holder that panicked says so to those
/// who wait (who then read without the cache, rather than panic in turn).
struct StopBeat<'a> {
    done: &'a AtomicBool,
    beat: std::thread::Thread,
    lock: &'a File,
}

impl Drop for StopBeat<'_> {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Relaxed);
        self.beat.unpark();
        if std::thread::panicking() {
            record(self.lock, &format!("{UNWRITTEN} the process that read it panicked"));
        }
    }
}

/// Replaces what `lock`'s file says (its holder, or how its write ended).
fn record(lock: &File, text: &str) {
    let _ = lock.set_len(0).and_then(|()| std::os::unix::fs::FileExt::write_all_at(lock, text.as_bytes(), 0));
}

/// What a lock file says once its holder failed to write the cache, and why.
const UNWRITTEN: &str = "unwritten:";

/// How often the process that tokenizes refreshes its lock file's time.
const HEARTBEAT: Duration = Duration::from_secs(20);

/// A holder whose lock file's time is older than this is taken as gone (a node lost with its
/// lock still held by a network file system's server).
const STALLED: Duration = Duration::from_secs(300);

/// Whether `file` is a cache file of `key` (its header alone read).
fn has_key(file: &Path, key: &str) -> bool {
    File::open(file).ok().and_then(|file| read_header(&mut BufReader::new(file)).ok()).is_some_and(|(header, ..)| header.key == key)
}

/// Removes what writes of `file` cut short left (`.NAME.tmp-PID`, as large as the data's tokens).
fn remove_torn_writes(file: &Path) {
    let (Some(folder), Some(name)) = (file.parent(), file.file_name()) else { return };
    let prefix = format!(".{}.tmp-", name.to_string_lossy());
    let Ok(entries) = fs::read_dir(folder) else { return };
    for entry in entries.flatten().filter(|entry| entry.file_name().to_string_lossy().starts_with(&prefix)) {
        if fs::remove_file(entry.path()).is_ok() {
            tracing::info!("removed {}, what an earlier write of the tokenized data cut short left", entry.path().display());
        }
    }
}

/// What decides a cache file's contents: the data files as they are now and `reading`.
fn key_of(flag: &str, path: &Path, files: &[PathBuf], others: &[PathBuf], reading: &str) -> Result<String, String> {
    let identity = DataIdentity::of_files(path, files)?;
    let place = fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let mut key = format!("{flag} {} ({} bytes, digest {})\n{reading}\n", place.display(), identity.bytes, identity.digest);
    for file in files {
        let metadata = fs::metadata(file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
        key += &format!("{} {} bytes, modified {}\n", file.display(), metadata.len(), modified_nanos(&metadata));
    }
    // Files not read are named in a note, which a cached read says again.
    for file in others {
        key += &format!("not read: {}\n", file.display());
    }
    Ok(key)
}

/// When `metadata`'s file was last modified, in nanoseconds since 1970 (0 where unknown).
pub fn modified_nanos(metadata: &fs::Metadata) -> u128 {
    metadata.modified().ok().and_then(|time| time.duration_since(UNIX_EPOCH).ok()).map_or(0, |since| since.as_nanos())
}

/// Each of `files` that exists, by its name, size, time and a digest of all its bytes: small
/// files that decide a reading (a tokenizer and the files beside it), for a key.
pub fn stamps(files: &[PathBuf]) -> String {
    let stamp = |file: &PathBuf| {
        let bytes = fs::read(file).ok()?;
        let metadata = fs::metadata(file).ok()?;
        Some(format!("{} ({} bytes, modified {}, digest {:016x})", file.display(), bytes.len(), modified_nanos(&metadata), fnv1a(&[&bytes])))
    };
    files.iter().filter_map(stamp).collect::<Vec<_>>().join(", ")
}

/// What [`look`] found.
enum Looked {
    Loaded(Documents),
    /// No file, or one of another key.
    Absent,
    /// A file of the key that cannot be read (cut short, corrupt), said so.
    Unreadable,
}

/// The documents cached in `file` under `key`, said as read from it with the notes of the read
/// that wrote it.
fn look(file: &Path, key: &str, flag: &str, path: &Path) -> Looked {
    match load(file, key) {
        Ok(Some(documents)) => {
            let tokens: usize = documents.ids.iter().map(Vec::len).sum();
            tracing::info!(
                "{flag} {}: read from the cache {} ({} documents, {tokens} tokens), tokenized by an earlier read of the same data the same way \
                 (--data-cache off tokenizes it again); what that read noticed follows",
                path.display(),
                file.display(),
                documents.ids.len()
            );
            documents.notes.iter().for_each(ReadNote::log);
            Looked::Loaded(documents)
        }
        Ok(None) => Looked::Absent,
        Err(error) => {
            tracing::warn!("{flag} {}: the cache {} cannot be read ({error}): tokenizing again, to write it anew", path.display(), file.display());
            Looked::Unreadable
        }
    }
}

/// A lock on the tokenizing of one key's cache file.
enum Lock {
    /// Held, after waiting for another process or not.
    Held { file: File, waited: bool },
    /// Its holder (named) has shown no sign of life for [`STALLED`].
    Stalled(String),
}

/// The lock on `lock_file`, waited for while another process holds it (said every
/// [`WAIT_LINE_EVERY`], naming the holder). The system lets it go when its holder's process
/// ends; a holder whose lock file stays untouched for [`STALLED`] is given up on.
fn hold_lock(lock_file: &Path, flag: &str, path: &Path) -> io::Result<Lock> {
    let mut options = OpenOptions::new();
    options.read(true).write(true).create(true).truncate(false);
    // A link planted in a shared folder is not followed (and its target truncated).
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, libc::O_NOFOLLOW);
    let file = options.open(lock_file)?;
    let started = Instant::now();
    let mut said: Option<Instant> = None;
    loop {
        match file.try_lock() {
            Ok(()) => break,
            Err(fs::TryLockError::WouldBlock) => {
                let holder = fs::read_to_string(lock_file).unwrap_or_default();
                let holder = if holder.trim().is_empty() || holder.starts_with(UNWRITTEN) { "another process".to_string() } else { holder.trim().to_string() };
                let untouched = file.metadata()?.modified()?.elapsed().unwrap_or_default();
                if started.elapsed() >= STALLED && untouched >= STALLED {
                    return Ok(Lock::Stalled(holder));
                }
                if said.is_none_or(|at| at.elapsed() >= WAIT_LINE_EVERY) {
                    tracing::info!("{flag} {}: waiting for {holder} to tokenize it into the cache ({:.0} s so far)", path.display(), started.elapsed().as_secs_f64());
                    said = Some(Instant::now());
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(fs::TryLockError::Error(error)) => return Err(error),
        }
    }
    let waited = said.is_some();
    // Who holds it, for the lines of those who wait (what the last holder recorded is read first).
    if !waited || !fs::read_to_string(lock_file).unwrap_or_default().starts_with(UNWRITTEN) {
        let host = fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let holder = format!("process {} on {}", std::process::id(), host.trim());
        record(&file, &holder);
    }
    Ok(Lock::Held { file, waited })
}

/// The FNV-1a checksum of what is written or read, section by section.
struct Summed<T> {
    inner: T,
    hash: u64,
}

impl<W: Write> Summed<W> {
    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.hash = fnv1a_more(self.hash, bytes);
        self.inner.write_all(bytes)
    }
}

impl<R: Read> Summed<R> {
    fn take(&mut self, count: usize) -> io::Result<Vec<u8>> {
        let mut bytes = vec![0; count];
        self.inner.read_exact(&mut bytes).map_err(|e| cut_short(e, "its sections"))?;
        self.hash = fnv1a_more(self.hash, &bytes);
        Ok(bytes)
    }
}

fn invalid(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why)
}

/// A read that met the file's end: the file is cut short.
fn cut_short(error: io::Error, what: &str) -> io::Error {
    match error.kind() {
        io::ErrorKind::UnexpectedEof => invalid(format!("it ends within {what}: cut short (a copy or a write that did not finish?)")),
        _ => error,
    }
}

/// Writes `documents` to `file` under `key`, atomically; the file's size.
fn write(file: &Path, key: &str, documents: &Documents) -> io::Result<u64> {
    let tokens: usize = documents.ids.iter().map(Vec::len).sum();
    let header = Header {
        key: key.to_string(),
        documents: documents.ids.len() as u64,
        tokens: tokens as u64,
        targets: documents.targets.is_some(),
        rendered_chat: documents.rendered_chat,
        notes: documents.notes.clone(),
    };
    let header = serde_json::to_vec(&header).map_err(|e| invalid(e.to_string()))?;
    if header.len() as u64 > MOST_HEADER_BYTES {
        return Err(invalid(format!("its header would take {} bytes, more than a load takes", header.len())));
    }
    ulysses_training::checkpoint::write_atomically_with(file, |out: &mut BufWriter<File>| {
        out.write_all(MAGIC)?;
        out.write_all(&(header.len() as u64).to_le_bytes())?;
        out.write_all(&header)?;
        out.write_all(&[0; 8][..padding(header.len())])?;
        // The checksum covers the header too (its notes, its counts).
        let mut out = Summed { inner: out, hash: fnv1a(&[&header]) };
        let mut end = 0u64;
        let ends: Vec<u8> = documents.ids.iter().flat_map(|ids| {
            end += ids.len() as u64;
            end.to_le_bytes()
        }).collect();
        out.put(&ends)?;
        for ids in &documents.ids {
            let mut bytes = Vec::with_capacity(4 * ids.len());
            for &id in ids {
                let id = u32::try_from(id).map_err(|_| invalid(format!("token {id} is no u32")))?;
                bytes.extend(id.to_le_bytes());
            }
            out.put(&bytes)?;
        }
        if let Some(targets) = &documents.targets {
            let flags: Vec<bool> = targets.iter().flatten().copied().collect();
            let bits: Vec<u8> = flags.chunks(8).map(|eight| eight.iter().enumerate().fold(0u8, |byte, (bit, &on)| byte | (u8::from(on) << bit))).collect();
            out.put(&bits)?;
        }
        let checksum = out.hash;
        out.inner.write_all(&checksum.to_le_bytes())
    })?;
    Ok(fs::metadata(file)?.len())
}

/// Bytes that bring `header` bytes (and the 16 before them) to a multiple of 8.
fn padding(header: usize) -> usize {
    (8 - header % 8) % 8
}

/// The header of a cache file read from its start, and its length in bytes.
fn read_header(reader: &mut impl Read) -> io::Result<(Header, u64, u64)> {
    let mut start = [0u8; 16];
    reader.read_exact(&mut start).map_err(|e| cut_short(e, "its first 16 bytes"))?;
    if &start[..8] != MAGIC {
        return Err(invalid(format!("it does not begin with {} (another program's file, or another layout's)", String::from_utf8_lossy(MAGIC))));
    }
    let header_bytes = u64::from_le_bytes(start[8..].try_into().expect("8 bytes"));
    if header_bytes > MOST_HEADER_BYTES {
        return Err(invalid(format!("its header would take {header_bytes} bytes")));
    }
    let mut header = vec![0; header_bytes as usize + padding(header_bytes as usize)];
    reader.read_exact(&mut header).map_err(|e| cut_short(e, "its header"))?;
    let header_hash = fnv1a(&[&header[..header_bytes as usize]]);
    let header: Header = serde_json::from_slice(&header[..header_bytes as usize]).map_err(|e| invalid(format!("its header is not read: {e}")))?;
    Ok((header, header_bytes, header_hash))
}

/// The documents `file` holds under `key`; `None` where there is no file, or one of another key.
fn load(file: &Path, key: &str) -> io::Result<Option<Documents>> {
    let opened = match File::open(file) {
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
        opened => opened?,
    };
    let mut reader = BufReader::with_capacity(1 << 20, opened);
    let (header, header_bytes, header_hash) = read_header(&mut reader)?;
    if header.key != key {
        return Ok(None);
    }
    let count = usize::try_from(header.documents).map_err(|_| invalid("too many documents".into()))?;
    let tokens = usize::try_from(header.tokens).map_err(|_| invalid("too many tokens".into()))?;
    // The file's size, from its counts, before allocating by them (a corrupt count overflows).
    let targets = if header.targets { header.tokens.div_ceil(8) } else { 0 };
    let expected = [16 + header_bytes + padding(header_bytes as usize) as u64, 8, targets]
        .into_iter()
        .try_fold(0u64, u64::checked_add)
        .zip(header.documents.checked_mul(8))
        .zip(header.tokens.checked_mul(4))
        .and_then(|((sum, ends), ids)| sum.checked_add(ends)?.checked_add(ids));
    let size = reader.get_ref().metadata()?.len();
    if expected != Some(size) {
        let expected = expected.map_or_else(|| "more than 2^64".to_string(), |bytes| bytes.to_string());
        return Err(invalid(format!("it has {size} bytes where its header's counts make {expected}: cut short or corrupt")));
    }
    let mut reader = Summed { inner: reader, hash: header_hash };
    let ends: Vec<usize> = reader.take(8 * count)?.chunks_exact(8).map(|end| u64::from_le_bytes(end.try_into().expect("8 bytes")) as usize).collect();
    if ends.windows(2).any(|pair| pair[0] > pair[1]) || ends.last().copied().unwrap_or(0) != tokens {
        return Err(invalid("its documents' ends are out of order, or end elsewhere than its tokens: corrupt".into()));
    }
    let mut ids = Vec::with_capacity(count);
    let mut begin = 0;
    for &end in &ends {
        let bytes = reader.take(4 * (end - begin))?;
        ids.push(bytes.chunks_exact(4).map(|id| i64::from(u32::from_le_bytes(id.try_into().expect("4 bytes")))).collect::<Vec<i64>>());
        begin = end;
    }
    let targets = match header.targets {
        false => None,
        true => {
            let bits = reader.take(tokens.div_ceil(8))?;
            let mut flags = (0..tokens).map(|i| (bits[i / 8] >> (i % 8)) & 1 == 1);
            Some(ids.iter().map(|document| flags.by_ref().take(document.len()).collect()).collect())
        }
    };
    let mut checksum = [0u8; 8];
    reader.inner.read_exact(&mut checksum).map_err(|e| cut_short(e, "its checksum"))?;
    if u64::from_le_bytes(checksum) != reader.hash {
        return Err(invalid("its checksum does not match: corrupt".into()));
    }
    Ok(Some(Documents { ids, targets, rendered_chat: header.rendered_chat, notes: header.notes }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn folder(name: &str) -> PathBuf {
        let folder = std::env::temp_dir().join(format!("ulysses-token-cache-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&folder);
        fs::create_dir_all(&folder).unwrap();
        folder
    }

    /// A folder with a small text to read and a cache folder in it.
    fn small_data(name: &str) -> (PathBuf, PathBuf, CacheFolder) {
        let dir = folder(name);
        let data = dir.join("data.txt");
        fs::write(&data, "some text to tokenize").unwrap();
        let cache = CacheFolder::At(dir.join("cache"));
        (dir, data, cache)
    }

    /// The file of `extension` in the cache folder of [`small_data`]'s `dir`.
    fn cached(dir: &Path, extension: &str) -> PathBuf {
        fs::read_dir(dir.join("cache")).unwrap().map(|e| e.unwrap().path()).find(|p| p.extension().is_some_and(|e| e == extension)).unwrap()
    }

    /// Documents as a read gives them: targets where the data marks some, and a note.
    fn documents(with_targets: bool) -> Documents {
        let ids = vec![vec![1, 2, 3], vec![70_000, 5], (0..21).collect()];
        let targets = with_targets.then(|| ids.iter().enumerate().map(|(d, ids)| (0..ids.len()).map(|i| (i + d) % 3 == 1).collect()).collect());
        let notes = vec![ReadNote { warning: true, text: "--data x: 2 answer(s) end just before the EOS".into() }];
        Documents { ids, targets, rendered_chat: with_targets, notes }
    }

    fn same(a: &Documents, b: &Documents) -> bool {
        (&a.ids, &a.targets, a.rendered_chat, &a.notes) == (&b.ids, &b.targets, b.rendered_chat, &b.notes)
    }

    /// What is written is what is loaded, under its key alone; a file cut short or with a byte
    /// changed is refused, never loaded.
    #[test]
    fn a_cache_file_loads_what_was_written_and_refuses_a_damaged_one() {
        let dir = folder("round-trip");
        for with_targets in [false, true] {
            let file = dir.join(format!("{with_targets}.tokens"));
            let written = documents(with_targets);
            write(&file, "the key", &written).unwrap();
            assert!(same(&load(&file, "the key").unwrap().expect("found"), &written));
            assert!(load(&file, "another key").unwrap().is_none(), "another key's file is no hit");
            let bytes = fs::read(&file).unwrap();
            // The last token's byte, then the targets' last (26 tokens: 4 bytes), then the checksum's.
            let bits = if with_targets { 4 } else { 0 };
            for at in [bytes.len() - 8 - bits - 1, bytes.len() - 9, bytes.len() - 1] {
                let mut damaged = bytes.clone();
                damaged[at] ^= 0x01;
                fs::write(&file, &damaged).unwrap();
                let error = load(&file, "the key").err().unwrap_or_else(|| panic!("byte {at} of {} changed, and loaded", bytes.len()));
                assert!(error.to_string().contains("checksum does not match"), "{error}");
            }
            // A note's letter, in the header: not its key, so only the checksum tells.
            let mut damaged = bytes.clone();
            let note = bytes.windows(9).position(|w| w == b"answer(s)").expect("the note in the header");
            damaged[note] = b'A';
            fs::write(&file, &damaged).unwrap();
            let error = load(&file, "the key").err().expect("a note changed, and loaded");
            assert!(error.to_string().contains("checksum does not match"), "{error}");
            fs::write(&file, &bytes[..bytes.len() - 3]).unwrap();
            let error = load(&file, "the key").err().expect("cut short");
            assert!(error.to_string().contains("cut short"), "{error}");
        }
        assert!(load(&dir.join("absent.tokens"), "the key").unwrap().is_none());
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A data file edited in place, even to the same size, is another key: its time changed.
    #[test]
    fn a_file_edited_to_the_same_size_is_read_again() {
        let dir = folder("edited");
        let data = dir.join("data.jsonl");
        // A word between two texts longer than the ends the key's digest reads (64 KiB each).
        let end = format!("{{\"text\": \"{}\"}}\n", "x".repeat(70_000));
        let line = |word: &str| format!("{end}{{\"text\": \"{word}\"}}\n{end}");
        fs::write(&data, line("aaaa")).unwrap();
        let cache = CacheFolder::At(dir.join("cache"));
        let reads = AtomicUsize::new(0);
        let read = || {
            reads.fetch_add(1, Ordering::SeqCst);
            Ok(documents(true))
        };
        for _ in 0..2 {
            assert!(same(&read_through(&cache, "--data", &data, "the reading", read).unwrap(), &documents(true)));
        }
        assert_eq!(reads.load(Ordering::SeqCst), 1, "the second read loads the first's");
        // The middle of the file: neither end (whose digest the key has) nor the size changes;
        // its time does (set: a file system may count whole seconds).
        let was = fs::metadata(&data).unwrap().modified().unwrap();
        fs::write(&data, line("bbbb")).unwrap();
        File::options().write(true).open(&data).unwrap().set_modified(was + Duration::from_secs(10)).unwrap();
        read_through(&cache, "--data", &data, "the reading", read).unwrap();
        assert_eq!(reads.load(Ordering::SeqCst), 2, "an edited file is read again");
        read_through(&cache, "--data", &data, "another reading", read).unwrap();
        assert_eq!(reads.load(Ordering::SeqCst), 3, "another reading of the same file is read again");
        // Off, or under the automatic size, nothing is cached.
        read_through(&CacheFolder::Off, "--data", &data, "the reading", read).unwrap();
        read_through(&CacheFolder::Auto, "--data", &data, "the reading", read).unwrap();
        read_through(&CacheFolder::Auto, "--data", &data, "the reading", read).unwrap();
        assert_eq!(reads.load(Ordering::SeqCst), 6);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// Where the read fails (or the write), the processes that waited do not each tokenize and
    /// fail in turn, holding the lock: they read at once, without the cache.
    #[test]
    fn readers_that_waited_on_a_failed_read_read_at_once() {
        let (dir, data, cache) = small_data("failed");
        let (reading, most) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let read = || {
            most.fetch_max(reading.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(400));
            reading.fetch_sub(1, Ordering::SeqCst);
            Err::<Documents, String>("line 7: not JSON".into())
        };
        std::thread::scope(|scope| {
            let readers: Vec<_> = (0..4).map(|_| scope.spawn(|| read_through(&cache, "--data", &data, "r", read))).collect();
            for reader in readers {
                assert_eq!(reader.join().unwrap().err().as_deref(), Some("line 7: not JSON"));
            }
        });
        assert!(most.load(Ordering::SeqCst) >= 2, "the readers that waited read one after another");
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A read that panics ends its heartbeat (the scope would wait on it forever, the lock held)
    /// and tells those who wait, who then read without the cache.
    #[test]
    fn a_read_that_panics_lets_the_lock_go_and_says_so() {
        let (dir, data, cache) = small_data("panics");
        let panicked = std::panic::catch_unwind(|| read_through(&cache, "--data", &data, "r", || panic!("a tokenizer's bug")));
        assert!(panicked.is_err());
        let record = fs::read_to_string(cached(&dir, "lock")).unwrap();
        assert!(record.starts_with(UNWRITTEN) && record.contains("panicked"), "{record}");
        fs::remove_dir_all(&dir).unwrap();
    }

    /// Processes that start together tokenize once: the first through the lock, the others
    /// wait and load what it wrote. A damaged file is tokenized and written anew.
    #[test]
    fn readers_at_once_tokenize_once_and_a_damaged_cache_is_rewritten() {
        let (dir, data, cache) = small_data("at-once");
        let reads = AtomicUsize::new(0);
        let read = || {
            reads.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(300));
            Ok(documents(false))
        };
        std::thread::scope(|scope| {
            let readers: Vec<_> = (0..4).map(|_| scope.spawn(|| read_through(&cache, "--data", &data, "r", read).unwrap())).collect();
            for reader in readers {
                assert!(same(&reader.join().unwrap(), &documents(false)));
            }
        });
        assert_eq!(reads.load(Ordering::SeqCst), 1, "four readers at once tokenized once");
        let file = cached(&dir, "tokens");
        let mut bytes = fs::read(&file).unwrap();
        let last = bytes.len() - 10;
        bytes[last] ^= 1;
        fs::write(&file, bytes).unwrap();
        assert!(same(&read_through(&cache, "--data", &data, "r", read).unwrap(), &documents(false)));
        assert_eq!(reads.load(Ordering::SeqCst), 2, "a damaged file is tokenized again");
        read_through(&cache, "--data", &data, "r", read).unwrap();
        assert_eq!(reads.load(Ordering::SeqCst), 2, "and written anew");
        fs::remove_dir_all(&dir).unwrap();
    }
}
