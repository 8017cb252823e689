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

use std::{
    fs::{self, File, OpenOptions, TryLockError},
    io::{Read, Seek, Write},
    path::{Path, PathBuf},
};

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
}
