//! The run folder (`--out`): one writer at a time, and an earlier run's record never
//! overwritten by a fresh run.
//!
//! - [`RunFolder::claim`] takes an exclusive lock (`flock`) on `.lock` in the folder before
//!   anything else is written there, and writes its pid into it. The kernel releases the lock
//!   when the process ends, however it ends, so a crashed run never blocks the next. A second
//!   run on the same folder stops at once, naming the holder's pid. With several processes,
//!   world rank 0 holds it.
//! - A fresh run (no `--resume`) refuses a folder that holds a training checkpoint, leaving it
//!   as it was, unless told `--overwrite`.
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

/// The training checkpoint whose presence marks a folder as an earlier run's.
pub const CHECKPOINT_FILE: &str = "checkpoint.ulysses";

/// What the run does with the folder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// A fresh run: refused where an earlier run left a checkpoint.
    Fresh,
    /// `--resume`, or `--overwrite`: the folder's checkpoint may be there.
    Continue,
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
        let existed = lock_path.exists();
        let mut lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(|e| format!("cannot open {} to lock the run folder (--out): {e}", lock_path.display()))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = lock.read_to_string(&mut holder);
                let holder = holder.trim();
                let holder = if holder.is_empty() { "pid unknown".to_string() } else { format!("pid {holder}") };
                return Err(format!(
                    "the run folder {} is in use by another run ({holder}); wait for it to end, or pass another --out",
                    path.display()
                ));
            }
            Err(TryLockError::Error(e)) => return Err(format!("cannot lock {}: {e}", lock_path.display())),
        }
        if claim == Claim::Fresh && path.join(CHECKPOINT_FILE).exists() {
            // Leave the folder as it was.
            if !existed {
                let _ = fs::remove_file(&lock_path);
            }
            return Err(format!(
                "the run folder {} holds the checkpoint of an earlier run; --resume {} continues it, another --out starts a \
                 new one beside it, --overwrite starts over in it",
                path.display(),
                path.display()
            ));
        }
        let record_pid = |lock: &mut File| -> std::io::Result<()> {
            lock.set_len(0)?;
            lock.rewind()?;
            write!(lock, "{}", std::process::id())?;
            lock.flush()
        };
        record_pid(&mut lock).map_err(|e| format!("cannot write {}: {e}", lock_path.display()))?;
        Ok(Self { path: path.to_path_buf(), _lock: lock })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(name: &str) -> PathBuf {
        let path = std::env::temp_dir().join(format!("ulysses-run-folder-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&path);
        path
    }

    #[test]
    fn a_second_claim_is_refused_with_the_holders_pid_until_the_first_ends() {
        let path = folder("twice");
        let first = RunFolder::claim(&path, Claim::Fresh).unwrap();
        let error = RunFolder::claim(&path, Claim::Continue).unwrap_err();
        assert!(error.contains(&format!("in use by another run (pid {})", std::process::id())), "{error}");
        drop(first);
        RunFolder::claim(&path, Claim::Fresh).expect("free again once the holder is gone");
        let _ = fs::remove_dir_all(&path);
    }

    #[test]
    fn a_fresh_run_leaves_an_earlier_runs_folder_as_it_was() {
        let path = folder("earlier");
        fs::create_dir_all(&path).unwrap();
        fs::write(path.join(CHECKPOINT_FILE), b"weights").unwrap();
        fs::write(path.join("metrics.csv"), b"step,loss\n0,5.5\n").unwrap();
        let error = RunFolder::claim(&path, Claim::Fresh).unwrap_err();
        assert!(error.contains("--resume") && error.contains("--overwrite") && error.contains("another --out"), "{error}");
        let mut names: Vec<_> = fs::read_dir(&path).unwrap().map(|e| e.unwrap().file_name()).collect();
        names.sort();
        assert_eq!(names, ["checkpoint.ulysses", "metrics.csv"], "the folder changed");
        assert_eq!(fs::read(path.join("metrics.csv")).unwrap(), b"step,loss\n0,5.5\n");
        RunFolder::claim(&path, Claim::Continue).expect("resume or --overwrite may use it");
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
