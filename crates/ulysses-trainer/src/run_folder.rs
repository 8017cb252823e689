//! The run folder (`--out`): one writer at a time, and an earlier run's record never
//! overwritten by a fresh run.
//!
//! - [`RunFolder::claim`] takes an exclusive lock (`flock`) on `.lock` in the folder before
//!   anything else is written there, and writes its pid into it. The kernel releases the lock
//!   when the process ends, however it ends, so a crashed run never blocks the next. A second
//!   run on the same folder stops at once, naming the holder's pid. With several processes,
//!   world rank 0 holds it.
//! - A fresh run (no `--resume`, or a `--resume` of another folder's checkpoint) refuses a
//!   folder that holds an earlier run's files ([`earlier_run_files`]: a training checkpoint,
//!   its record or its model, as a `--no-save` run or one killed before its first checkpoint
//!   leaves too), leaving it as it was, unless told `--overwrite`.
//! - The temporary file of a write a killed run left (`.NAME.tmp-PID`), and the sharded
//!   optimizer state of a save killed before its commit (a state folder no checkpoint names),
//!   are removed once the lock is held.
//! - The files that describe the run (`config.json`, `metrics.csv`) are written only once its
//!   first step has succeeded ([`RunRecord::open`]), each atomically; metrics rows are then
//!   appended. A run that fails before that leaves the folder's earlier record as it was.

use std::{
    fs::{self, File, OpenOptions, TryLockError},
    io::{BufWriter, Read, Seek, Write},
    path::{Path, PathBuf},
};

use ulysses_training::checkpoint::write_atomically;

/// The lock file inside a run folder.
pub const LOCK_FILE: &str = ".lock";

/// The training checkpoint.
pub const CHECKPOINT_FILE: &str = "checkpoint.ulysses";

/// How a checkpoint kept before the newest is named: `checkpoint-step-000000200.ulysses`.
pub const KEPT_CHECKPOINT_PREFIX: &str = "checkpoint-step-";

/// Whether `name` is a kept checkpoint's: `checkpoint-step-` and digits, `.ulysses`.
pub fn is_kept_checkpoint(name: &str) -> bool {
    name.strip_prefix(KEPT_CHECKPOINT_PREFIX).and_then(|rest| rest.strip_suffix(".ulysses")).is_some_and(|digits| !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
}

/// Keeps the run's checkpoint in `dir` (`checkpoint.ulysses`, after `steps` steps), which a save
/// is about to replace, as `checkpoint-step-S.ulysses` (a hard link: no copy), and removes the
/// kept ones past the newest `keep - 2` beside it by when they were written (`keep` counting the
/// save's), never `resumed`, the one the run went back to. The sharded optimizer state of those
/// removed goes at the save's commit, no checkpoint naming it. A file system without hard links
/// keeps none.
pub fn keep_earlier_checkpoint(dir: &Path, steps: usize, keep: usize, resumed: Option<&Path>) -> Result<(), String> {
    let current = dir.join(CHECKPOINT_FILE);
    let name = format!("{KEPT_CHECKPOINT_PREFIX}{steps:09}.ulysses");
    let kept = dir.join(&name);
    if resumed.is_some_and(|resumed| same_place(resumed, &kept)) {
        return Err(format!("{} is the checkpoint this run resumed from, which is not replaced", kept.display()));
    }
    // Linked under a write's temporary name first: a kill leaves what the run folder's claim removes.
    let link = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let _ = fs::remove_file(&link);
    let linked = fs::hard_link(&current, &link).and_then(|()| fs::rename(&link, &kept)).and_then(|()| File::open(dir)?.sync_all());
    // A rename onto the same file (kept already) leaves the link where it was.
    let _ = fs::remove_file(&link);
    linked.map_err(|e| format!("{} could not be made a link to {} ({e}); a file system without hard links keeps the newest alone", kept.display(), current.display()))?;
    let mut earlier: Vec<(std::time::SystemTime, PathBuf)> = fs::read_dir(dir)
        .map_err(|e| format!("cannot list {}: {e}", dir.display()))?
        .flatten()
        .filter(|entry| is_kept_checkpoint(&entry.file_name().to_string_lossy()))
        .filter_map(|entry| Some((entry.metadata().ok().filter(fs::Metadata::is_file)?.modified().ok()?, entry.path())))
        .filter(|(_, path)| *path != kept && !resumed.is_some_and(|resumed| same_place(resumed, path)))
        .collect();
    earlier.sort();
    let removed = earlier.len().saturating_sub(keep.saturating_sub(2));
    for (_, path) in earlier.into_iter().take(removed) {
        fs::remove_file(&path).map_err(|e| format!("cannot remove {}, kept past --keep-checkpoints {keep}: {e}", path.display()))?;
    }
    Ok(())
}

/// Removes the checkpoints an earlier run kept in `dir` (`checkpoint-step-S.ulysses`): a run
/// that starts over there (`--overwrite`) would otherwise leave them to be resumed under its
/// record, and their optimizer state with them. Returns those it could not remove, with why.
pub fn remove_kept_checkpoints(dir: &Path) -> Vec<String> {
    let Ok(entries) = fs::read_dir(dir) else { return Vec::new() };
    entries
        .flatten()
        .filter(|entry| is_kept_checkpoint(&entry.file_name().to_string_lossy()))
        .filter_map(|entry| fs::remove_file(entry.path()).err().map(|e| format!("{}: {e}", entry.path().display())))
        .collect()
}

/// The files and folders of a run folder that an earlier run wrote, by name: its checkpoint,
/// its record (`config.json`, `metrics.csv`), its model (`model.mpk`) and its optimizer's
/// parts (`optimizer-step-…`). Any of them marks the folder as an earlier run's.
pub fn earlier_run_files(path: &Path) -> Vec<String> {
    let Ok(entries) = fs::read_dir(path) else { return Vec::new() };
    let mut names: Vec<String> = entries
        .flatten()
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| {
            [CHECKPOINT_FILE, CONFIG_FILE, METRICS_FILE, "model.mpk"].contains(&name.as_str())
                || name.starts_with(ulysses_training::STATE_FOLDER_PREFIX)
                || is_kept_checkpoint(name)
        })
        .collect();
    names.sort();
    names
}

/// What the run does with the folder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// A fresh run: refused where an earlier run left its files ([`earlier_run_files`]).
    Fresh,
    /// `--resume`, or `--overwrite`: the folder's checkpoint may be there.
    Continue,
}

impl Claim {
    /// How a run claims its folder `out`: a `--resume` continues in the folder of its
    /// checkpoint ([`resumed_folder`]) alone; into any other folder it is a fresh run there, so
    /// an earlier run's checkpoint in `out` is refused, not overwritten (a resumed copy
    /// written over another experiment).
    pub fn of(out: &Path, resume: Option<&Path>, overwrite: bool) -> Self {
        match resume {
            Some(location) if same_place(out, &resumed_folder(location)) => Claim::Continue,
            _ if overwrite => Claim::Continue,
            _ => Claim::Fresh,
        }
    }
}

/// `path` with its links resolved where it exists, else made absolute.
pub fn resolved(path: &Path) -> std::io::Result<PathBuf> {
    path.canonicalize().or_else(|_| std::path::absolute(path))
}

/// Whether two paths name the same file or folder, however spelt (either may not exist yet).
pub fn same_place(a: &Path, b: &Path) -> bool {
    matches!((resolved(a), resolved(b)), (Ok(a), Ok(b)) if a == b)
}

/// The run folder of a `--resume` location: the folder itself, or the folder that holds the
/// checkpoint file named (a run writes into it unless `--out` says otherwise).
pub fn resumed_folder(location: &Path) -> PathBuf {
    if location.is_dir() {
        return location.to_path_buf();
    }
    location.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")).to_path_buf()
}

/// A run folder this process holds; the lock is released when it is dropped.
#[derive(Debug)]
pub struct RunFolder {
    path: PathBuf,
    _lock: File,
}

impl RunFolder {
    /// Locks `path` (creating it), then checks it against `claim`.
    pub fn claim(path: &Path, claim: Claim) -> Result<Self, String> {
        fs::create_dir_all(path).map_err(|e| format!("cannot create the run folder {} (--out): {e}", path.display()))?;
        let lock_path = path.join(LOCK_FILE);
        let existed = existing_lock(&lock_path)?;
        let mut options = OpenOptions::new();
        options.read(true).write(true).create(true).truncate(false);
        // A link made since the look above is not followed either.
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, libc::O_NOFOLLOW);
        let mut lock = options.open(&lock_path).map_err(|e| format!("cannot open {} to lock the run folder (--out): {e}", lock_path.display()))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => return Err(in_use(path, &mut lock)),
            Err(TryLockError::Error(e)) => return Err(format!("cannot lock {}: {e}", lock_path.display())),
        }
        let earlier = earlier_run_files(path);
        if claim == Claim::Fresh && !earlier.is_empty() {
            // Leave the folder as it was.
            if !existed {
                let _ = fs::remove_file(&lock_path);
            }
            return Err(earlier_run(path, &earlier));
        }
        let record_pid = |lock: &mut File| -> std::io::Result<()> {
            lock.set_len(0)?;
            lock.rewind()?;
            write!(lock, "{}", std::process::id())?;
            lock.flush()
        };
        record_pid(&mut lock).map_err(|e| format!("cannot write {}: {e}", lock_path.display()))?;
        remove_torn_writes(path);
        Ok(Self { path: path.to_path_buf(), _lock: lock })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What [`claim`](Self::claim) would refuse, found without creating or writing anything
    /// (`--check`): a path that cannot be a folder, a folder another run holds, an earlier
    /// run's files where `claim` is fresh.
    pub fn check(path: &Path, claim: Claim) -> Result<(), String> {
        let existing = path.ancestors().find(|a| a.exists()).unwrap_or(Path::new("."));
        if !existing.as_os_str().is_empty() && !existing.is_dir() {
            return Err(format!("cannot create the run folder {} (--out): {} is a file", path.display(), existing.display()));
        }
        existing_lock(&path.join(LOCK_FILE))?;
        if let Ok(mut lock) = File::open(path.join(LOCK_FILE)) {
            if let Err(TryLockError::WouldBlock) = lock.try_lock() {
                return Err(in_use(path, &mut lock));
            }
        }
        let earlier = earlier_run_files(path);
        if claim == Claim::Fresh && !earlier.is_empty() {
            return Err(earlier_run(path, &earlier));
        }
        Ok(())
    }
}

/// Whether the lock file `lock_path` exists; refused where it is a link or no regular file:
/// the process id is written into the lock, which through a link lands in another file.
fn existing_lock(lock_path: &Path) -> Result<bool, String> {
    let not_a_file = |what: &str| format!("{} is {what}, not a run's lock file: the trainer writes its process id into it; remove it", lock_path.display());
    match fs::symlink_metadata(lock_path) {
        Ok(found) if found.file_type().is_symlink() => Err(not_a_file("a symbolic link")),
        Ok(found) if !found.is_file() => Err(not_a_file("no regular file")),
        Ok(_) => Ok(true),
        Err(_) => Ok(false),
    }
}

/// Removes the temporary files of writes a killed run left (`.NAME.tmp-PID`, as
/// `write_atomically` names them: a checkpoint cut short is as large as the checkpoint), and
/// the sharded optimizer state a save killed before its commit left (a folder no checkpoint
/// file names: as large as the optimizer state, which the next commit alone would remove, if
/// the disk still had room for it). The folder's lock is held, so no live writer owns one.
fn remove_torn_writes(path: &Path) {
    for folder in ulysses_training::remove_unnamed_state_folders(path, None) {
        tracing::info!(folder = %folder.display(), "removed the optimizer state a save cut short left (no checkpoint names it)");
    }
    let Ok(entries) = fs::read_dir(path) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if ulysses_training::checkpoint::is_temporary_write(&name) {
            match fs::remove_file(entry.path()) {
                Ok(()) => tracing::info!(file = %entry.path().display(), "removed what a write cut short left"),
                Err(error) => tracing::warn!(file = %entry.path().display(), %error, "cannot remove what a write cut short left"),
            }
        }
    }
}

/// The refusal of a folder whose `lock` another run holds, naming its pid.
fn in_use(path: &Path, lock: &mut File) -> String {
    let mut holder = String::new();
    let _ = lock.read_to_string(&mut holder);
    let holder = holder.trim();
    let holder = if holder.is_empty() { "pid unknown".to_string() } else { format!("pid {holder}") };
    format!("the run folder {} is in use by another run ({holder}); wait for it to end, or pass another --out", path.display())
}

/// The refusal of a fresh run in a folder with an earlier run's `files`.
fn earlier_run(path: &Path, files: &[String]) -> String {
    let continues = if files.iter().any(|f| f == CHECKPOINT_FILE) {
        format!("--resume {} continues it, ", path.display())
    } else {
        String::new()
    };
    format!(
        "the run folder {} holds an earlier run's {}; {continues}another --out starts a new one beside it, --overwrite starts over in it",
        path.display(),
        files.join(", ")
    )
}

/// The run's description, `config.json`.
pub const CONFIG_FILE: &str = "config.json";

/// The run's metrics, a row per step and per evaluation.
pub const METRICS_FILE: &str = "metrics.csv";

/// `metrics.csv` of a run that has taken a step, open for appending.
#[derive(Debug)]
pub struct RunRecord {
    metrics: BufWriter<File>,
}

impl RunRecord {
    /// Writes `config.json` and `metrics.csv` (`header`, then `kept`: the rows of the steps a
    /// resumed run continues from), each atomically, and opens the metrics for appending. A
    /// metrics file that already holds exactly those lines is left as it is.
    pub fn open(folder: &Path, config_json: &str, header: &str, kept: &[String]) -> Result<Self, String> {
        let write = |name: &str, bytes: &[u8]| {
            let path = folder.join(name);
            write_atomically(&path, &[bytes]).map_err(|e| format!("cannot write {}: {e}", path.display()))
        };
        write(CONFIG_FILE, config_json.as_bytes())?;
        let metrics_path = folder.join(METRICS_FILE);
        let lines: String = std::iter::once(header).chain(kept.iter().map(String::as_str)).map(|line| format!("{line}\n")).collect();
        if fs::read(&metrics_path).ok().as_deref() != Some(lines.as_bytes()) {
            write(METRICS_FILE, lines.as_bytes())?;
        }
        let metrics = OpenOptions::new()
            .append(true)
            .open(&metrics_path)
            .map_err(|e| format!("cannot open {} to append to it: {e}", metrics_path.display()))?;
        Ok(Self { metrics: BufWriter::new(metrics) })
    }

    /// Appends `row` and flushes it, so that a crash loses no finished step's row.
    pub fn append(&mut self, row: &str) -> std::io::Result<()> {
        writeln!(self.metrics, "{row}")?;
        self.metrics.flush()
    }

    /// Makes the rows appended so far durable: before a checkpoint's commit, so that a power
    /// loss that keeps the checkpoint keeps the rows of the steps it has taken (a flush alone
    /// leaves them to the page cache, or an NFS client's).
    pub fn sync(&mut self) -> std::io::Result<()> {
        self.metrics.flush()?;
        self.metrics.get_ref().sync_data()
    }
}

/// The data rows of an earlier run's metrics file for steps before `step`: whole rows alone
/// (as many columns as `header`, today's), so that a row a crash or a full disk cut short
/// (`12` of `125,…`, a last line without its newline) is not kept as a malformed row of
/// another step; none from a file of another header (an earlier version's columns).
pub fn earlier_rows(path: &Path, step: usize, header: &str) -> Vec<String> {
    let Ok(text) = fs::read_to_string(path) else { return Vec::new() };
    // An earlier version's columns, rewritten under this header, would fall under other names.
    if text.lines().next() != Some(header) {
        return Vec::new();
    }
    let columns = header.split(',').count();
    text.split_inclusive('\n')
        .skip(1)
        .filter_map(|line| line.strip_suffix('\n'))
        .filter(|line| line.split(',').count() == columns)
        .filter(|line| line.split(',').next().and_then(|s| s.parse::<usize>().ok()).is_some_and(|s| s < step))
        .map(str::to_string)
        .collect()
}

/// What the kept rows of a run resumed at step `resumed` lack, said so that a curve with a gap
/// is not taken for a whole one: steps without a row (a checkpoint resumed without its
/// metrics.csv, or one the disk did not keep). (A held-out loss lost between the checkpoint
/// and its evaluation is taken again as the resume begins.)
pub fn kept_rows_gap(rows: &[usize], resumed: usize) -> Option<String> {
    // Over the rows, not the steps: a checkpoint may claim any count of steps.
    let mut kept: Vec<usize> = rows.iter().copied().filter(|&step| step < resumed).collect();
    kept.sort_unstable();
    kept.dedup();
    let missing = resumed - kept.len();
    if missing == 0 {
        return None;
    }
    let first = kept.iter().enumerate().find(|(index, step)| index != *step).map_or(kept.len(), |(index, _)| index);
    Some(format!(
        "metrics.csv holds no row for {missing} of the {resumed} steps the checkpoint has taken (the first: step {first}); the curve \
         and the record start where the kept rows do"
    ))
}

#[cfg(test)]
mod tests {
    const HEADER: &str = "step,loss,eval";

    /// With 3 to keep, the checkpoint a save replaces is kept beside the newest kept one; the
    /// older ones go, never the one the run resumed from, nor files and folders of other names.
    #[test]
    fn the_newest_checkpoints_are_kept_and_the_resumed_one_stays() {
        use std::time::{Duration, SystemTime};
        let dir = std::env::temp_dir().join(format!("ulysses-kept-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("checkpoint-step-000000009.ulysses")).unwrap();
        let written = |name: &str, seconds_ago: u64| {
            std::fs::write(dir.join(name), name).unwrap();
            let file = std::fs::File::options().write(true).open(dir.join(name)).unwrap();
            file.set_modified(SystemTime::now() - Duration::from_secs(seconds_ago)).unwrap();
        };
        for (name, ago) in [("checkpoint-step-000000002.ulysses", 50), ("checkpoint-step-000000004.ulysses", 40), ("checkpoint-step-000000006.ulysses", 30), ("checkpoint-step-4.ulysses.sha256", 60), ("checkpoint.ulysses", 10)] {
            written(name, ago);
        }
        super::keep_earlier_checkpoint(&dir, 8, 3, Some(&dir.join("checkpoint-step-000000002.ulysses"))).unwrap();
        let mut names: Vec<String> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        assert_eq!(
            names,
            [
                "checkpoint-step-000000002.ulysses",
                "checkpoint-step-000000006.ulysses",
                "checkpoint-step-000000008.ulysses",
                "checkpoint-step-000000009.ulysses",
                "checkpoint-step-4.ulysses.sha256",
                "checkpoint.ulysses"
            ]
        );
        assert_eq!(std::fs::read(dir.join("checkpoint-step-000000008.ulysses")).unwrap(), b"checkpoint.ulysses", "kept is no link to the checkpoint");
        // Kept already (a save that failed after): the same file, no link left behind.
        super::keep_earlier_checkpoint(&dir, 8, 3, None).unwrap();
        assert!(std::fs::read_dir(&dir).unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().contains(".tmp-")), "a link left behind");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The kept rows of a resumed run: whole rows of steps before the resumed one; a row cut
    /// short (fewer columns, or no newline at the end) is left out.
    #[test]
    fn earlier_rows_keeps_whole_rows_before_the_step() {
        let dir = std::env::temp_dir().join(format!("ulysses-earlier-rows-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("metrics.csv");
        std::fs::write(&path, "step,loss,eval\n0,5.5,\n1,5.1,4.9\n2,4.8,\n12").unwrap();
        assert_eq!(super::earlier_rows(&path, 100, HEADER), ["0,5.5,", "1,5.1,4.9", "2,4.8,"]);
        assert_eq!(super::earlier_rows(&path, 2, HEADER), ["0,5.5,", "1,5.1,4.9"]);
        std::fs::write(&path, "step,loss,eval\n0,5.5,\n1,5.1\n2,4.8,\n3,4.5,").unwrap();
        assert_eq!(super::earlier_rows(&path, 100, HEADER), ["0,5.5,", "2,4.8,"]);
        // An earlier version's file, of other columns than today's header: none kept (their
        // values would be read under other names).
        std::fs::write(&path, "step,loss\n0,5.5\n1,5.1\n").unwrap();
        assert!(super::earlier_rows(&path, 100, HEADER).is_empty());
        assert!(super::earlier_rows(&dir.join("missing.csv"), 100, HEADER).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    use super::*;

    #[test]
    fn a_resumes_kept_rows_say_what_they_lack() {
        let all: Vec<usize> = (0..6).collect();
        assert_eq!(kept_rows_gap(&all, 6), None, "every step's row");
        let gap = kept_rows_gap(&[0, 1, 3], 6).expect("steps without a row");
        assert!(gap.contains("no row for 3 of the 6 steps") && gap.contains("step 2"), "{gap}");
        // No rows at all (a checkpoint copied without its metrics).
        let gap = kept_rows_gap(&[], 6).expect("no rows");
        assert!(gap.contains("no row for 6 of the 6 steps") && gap.contains("step 0"), "{gap}");
        // Rows repeated (a crash's rows taken again), and a checkpoint claiming 10^15 steps:
        // said at once, not after a loop over every step.
        let gap = kept_rows_gap(&[0, 0, 1, 1, 2, 9], 1_000_000_000_000_000).expect("steps without a row");
        assert!(gap.contains("no row for 999999999999996 of the 1000000000000000 steps") && gap.contains("step 3"), "{gap}");
    }

    fn folder(name: &str) -> PathBuf {
        let path = std::env::temp_dir().join(format!("ulysses-run-folder-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&path);
        path
    }

    #[test]
    fn a_resume_continues_in_its_checkpoints_folder_alone() {
        let (run, other) = (folder("resumed"), folder("resumed-other"));
        fs::create_dir_all(&run).unwrap();
        fs::create_dir_all(&other).unwrap();
        let file = run.join(CHECKPOINT_FILE);
        fs::write(&file, b"weights").unwrap();
        fs::write(other.join(CHECKPOINT_FILE), b"another experiment").unwrap();
        assert_eq!(resumed_folder(&run), run);
        assert_eq!(resumed_folder(&file), run, "a checkpoint file's run folder is the one that holds it");
        assert_eq!(resumed_folder(Path::new(CHECKPOINT_FILE)), Path::new("."));
        assert_eq!(Claim::of(&run, Some(&run), false), Claim::Continue);
        assert_eq!(Claim::of(&run, Some(&file), false), Claim::Continue);
        assert_eq!(Claim::of(&run.join("."), Some(&file), false), Claim::Continue, "the same folder however it is spelt");
        // Resumed into another folder: a fresh run there, which refuses that folder's checkpoint.
        assert_eq!(Claim::of(&other, Some(&file), false), Claim::Fresh);
        let error = RunFolder::claim(&other, Claim::of(&other, Some(&file), false)).unwrap_err();
        assert!(error.contains("holds an earlier run's checkpoint.ulysses"), "{error}");
        assert_eq!(fs::read(other.join(CHECKPOINT_FILE)).unwrap(), b"another experiment");
        assert_eq!(Claim::of(&folder("resumed-new"), Some(&file), false), Claim::Fresh);
        assert_eq!(Claim::of(&other, None, true), Claim::Continue);
        assert_eq!(Claim::of(&other, None, false), Claim::Fresh);
        let _ = fs::remove_dir_all(&run);
        let _ = fs::remove_dir_all(&other);
    }

    #[test]
    fn a_second_claim_is_refused_with_the_holders_pid_until_the_first_ends() {
        let path = folder("twice");
        RunFolder::check(&path, Claim::Fresh).expect("a new folder");
        assert!(!path.exists(), "the check creates nothing");
        let first = RunFolder::claim(&path, Claim::Fresh).unwrap();
        let error = RunFolder::claim(&path, Claim::Continue).unwrap_err();
        assert!(error.contains(&format!("in use by another run (pid {})", std::process::id())), "{error}");
        assert_eq!(RunFolder::check(&path, Claim::Continue).unwrap_err(), error, "--check says what the claim would");
        drop(first);
        RunFolder::claim(&path, Claim::Fresh).expect("free again once the holder is gone");
        let _ = fs::remove_dir_all(&path);
    }

    /// A lock that links elsewhere is refused by the claim and by `--check`, and the file it
    /// links to is left as it was (the claim wrote its process id through the link).
    #[cfg(unix)]
    #[test]
    fn a_lock_that_is_a_link_is_refused_and_its_target_kept() {
        let path = folder("linked-lock");
        fs::create_dir_all(&path).unwrap();
        let target = path.with_extension("notes");
        fs::write(&target, b"a user's notes").unwrap();
        std::os::unix::fs::symlink(&target, path.join(LOCK_FILE)).unwrap();
        for claim in [Claim::Fresh, Claim::Continue] {
            let error = RunFolder::claim(&path, claim).unwrap_err();
            assert!(error.contains(".lock is a symbolic link") && error.contains("remove it"), "{error}");
            assert_eq!(RunFolder::check(&path, claim).unwrap_err(), error, "--check says what the claim would");
        }
        assert_eq!(fs::read(&target).unwrap(), b"a user's notes");
        fs::remove_file(path.join(LOCK_FILE)).unwrap();
        fs::create_dir(path.join(LOCK_FILE)).unwrap();
        assert!(RunFolder::claim(&path, Claim::Fresh).unwrap_err().contains(".lock is no regular file"));
        let _ = (fs::remove_dir_all(&path), fs::remove_file(&target));
    }

    #[test]
    fn a_fresh_run_leaves_an_earlier_runs_folder_as_it_was() {
        let path = folder("earlier");
        fs::create_dir_all(&path).unwrap();
        fs::write(path.join(CHECKPOINT_FILE), b"weights").unwrap();
        fs::write(path.join("metrics.csv"), b"step,loss\n0,5.5\n").unwrap();
        let error = RunFolder::claim(&path, Claim::Fresh).unwrap_err();
        assert!(error.contains("checkpoint.ulysses, metrics.csv;") && error.contains("--resume") && error.contains("--overwrite") && error.contains("another --out"), "{error}");
        assert_eq!(RunFolder::check(&path, Claim::Fresh).unwrap_err(), error, "--check says what the claim would");
        RunFolder::check(&path, Claim::Continue).expect("resume or --overwrite may use it");
        let under_a_file = path.join("metrics.csv").join("run");
        assert!(RunFolder::check(&under_a_file, Claim::Fresh).unwrap_err().contains("metrics.csv is a file"));
        let mut names: Vec<_> = fs::read_dir(&path).unwrap().map(|e| e.unwrap().file_name()).collect();
        names.sort();
        assert_eq!(names, ["checkpoint.ulysses", "metrics.csv"], "the folder changed");
        assert_eq!(fs::read(path.join("metrics.csv")).unwrap(), b"step,loss\n0,5.5\n");
        RunFolder::claim(&path, Claim::Continue).expect("resume or --overwrite may use it");
        let _ = fs::remove_dir_all(&path);
    }

    /// An earlier run without a checkpoint (`--no-save`, or killed before its first one) left
    /// its record or model: a fresh run refuses the folder too, and changes nothing in it.
    /// (Before, only the checkpoint marked an earlier run, and its metrics, config and loss
    /// curve were replaced without a word.)
    #[test]
    fn an_earlier_runs_record_without_a_checkpoint_is_refused_too() {
        for earlier in [METRICS_FILE, CONFIG_FILE, "model.mpk", "optimizer-step-000000003-of-00002"] {
            let path = folder("record-only");
            fs::create_dir_all(&path).unwrap();
            if earlier.starts_with("optimizer-step-") {
                fs::create_dir_all(path.join(earlier)).unwrap();
            } else {
                fs::write(path.join(earlier), b"earlier").unwrap();
            }
            fs::write(path.join("loss.png"), b"curve").unwrap();
            let error = RunFolder::claim(&path, Claim::Fresh).unwrap_err();
            assert!(error.contains(&format!("holds an earlier run's {earlier};")) && !error.contains("--resume") && error.contains("--overwrite"), "{error}");
            assert_eq!(RunFolder::check(&path, Claim::Fresh).unwrap_err(), error, "--check says what the claim would");
            let mut names: Vec<_> = fs::read_dir(&path).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
            names.sort();
            let mut want = [earlier, "loss.png"];
            want.sort();
            assert_eq!(names, want, "the folder changed");
            RunFolder::claim(&path, Claim::Continue).expect("--overwrite may use it");
            let _ = fs::remove_dir_all(&path);
        }
    }

    /// What a save killed halfway left (its temporary file, or a sharded state folder no
    /// checkpoint names) goes when the folder is next claimed; the checkpoint and anything else
    /// stay.
    #[test]
    fn a_claim_removes_what_a_killed_write_left() {
        let path = folder("torn");
        fs::create_dir_all(&path).unwrap();
        let unnamed = path.join(ulysses_training::sharded_state_folder(3, 2));
        fs::create_dir_all(&unnamed).unwrap();
        fs::write(unnamed.join(ulysses_training::sharded_state_file(0, 2)), b"a part").unwrap();
        fs::create_dir_all(path.join("samples")).unwrap();
        let torn = path.join(format!(".{CHECKPOINT_FILE}.tmp-4242"));
        for (name, bytes) in [(CHECKPOINT_FILE, "weights"), (".notes.tmp-draft", "mine"), ("data.tmp-7", "mine")] {
            fs::write(path.join(name), bytes).unwrap();
        }
        fs::write(&torn, b"half a checkpoint").unwrap();
        let _held = RunFolder::claim(&path, Claim::Continue).unwrap();
        assert!(!torn.exists());
        let mut names: Vec<_> = fs::read_dir(&path).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        assert_eq!(names, [".lock", ".notes.tmp-draft", CHECKPOINT_FILE, "data.tmp-7", "samples"]);
        let _ = fs::remove_dir_all(&path);
    }

    #[test]
    fn a_record_keeps_the_rows_it_continues_from_and_appends() {
        let path = folder("record");
        fs::create_dir_all(&path).unwrap();
        // A crash after the checkpoint of step 2 left a row of step 2, which the resumed run
        // takes again.
        fs::write(path.join(METRICS_FILE), "step,loss\n0,5.5\n1,5.0\n2,4.8\n").unwrap();
        let kept = ["0,5.5".to_string(), "1,5.0".to_string()];
        let mut record = RunRecord::open(&path, "{\"steps\": 4}", "step,loss", &kept).unwrap();
        record.append("2,4.7").unwrap();
        record.append("3,4.5").unwrap();
        assert_eq!(fs::read_to_string(path.join(METRICS_FILE)).unwrap(), "step,loss\n0,5.5\n1,5.0\n2,4.7\n3,4.5\n");
        assert_eq!(fs::read_to_string(path.join(CONFIG_FILE)).unwrap(), "{\"steps\": 4}");
        // Opened again with what it holds: appended to, not rewritten.
        let kept: Vec<String> = ["0,5.5", "1,5.0", "2,4.7", "3,4.5"].map(String::from).to_vec();
        let inode = |p: &Path| std::os::unix::fs::MetadataExt::ino(&fs::metadata(p).unwrap());
        let before = inode(&path.join(METRICS_FILE));
        RunRecord::open(&path, "{}", "step,loss", &kept).unwrap().append("4,4.4").unwrap();
        assert_eq!(inode(&path.join(METRICS_FILE)), before, "rewritten rather than appended to");
        assert!(fs::read_to_string(path.join(METRICS_FILE)).unwrap().ends_with("3,4.5\n4,4.4\n"));
        // No temporary file is left behind.
        let names: Vec<_> = fs::read_dir(&path).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        assert!(names.iter().all(|n| !n.contains("tmp")), "{names:?}");
        let _ = fs::remove_dir_all(&path);
    }
}
