//! The one file walker of the example: a file, or every file under a folder.

use std::{
    collections::HashSet,
    fs,
    path::{Path, PathBuf},
};

/// `path` itself when it is a file, else every file under it, recursively (links followed),
/// sorted: the order the data is read in, and hashed in. Hidden files and folders under it
/// (`.git`, `.cache`, `.gitattributes`: a downloaded dataset's bookkeeping) are not data. A
/// file reached through several links (`GPL` → `GPL-3`) is read once, at its first path, and a
/// folder once (a link to a folder above it would loop).
pub fn files_under(path: &Path) -> std::io::Result<Vec<PathBuf>> {
    if !fs::metadata(path)?.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files = Vec::new();
    walk(path, &mut files, &mut HashSet::new())?;
    files.sort();
    let mut read = HashSet::new();
    files.retain(|file| read.insert(fs::canonicalize(file).unwrap_or_else(|_| file.clone())));
    Ok(files)
}

/// The files under folder or file `path` into `files`, each folder (`folders`: where their
/// links lead) walked once.
fn walk(path: &Path, files: &mut Vec<PathBuf>, folders: &mut HashSet<PathBuf>) -> std::io::Result<()> {
    // Named: the error is of a file under the folder given (a link to nothing), not of it.
    let metadata = fs::metadata(path).map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    if !metadata.is_dir() {
        files.push(path.to_path_buf());
        return Ok(());
    }
    if !folders.insert(fs::canonicalize(path)?) {
        return Ok(());
    }
    for entry in fs::read_dir(path)? {
        let entry = entry?;
        if !entry.file_name().to_string_lossy().starts_with('.') {
            walk(&entry.path(), files, folders)?;
        }
    }
    Ok(())
}

/// The files of a --data folder that hold documents (JSON Lines as `.jsonl` or `.json`, text
/// as `.txt`), and the others, which are not read (a dataset's `README.md`, `LICENSE`). A
/// file given itself is read whatever its name. Refused: a folder that holds a training split
/// beside a test or validation one (`train.jsonl` and `test.jsonl`), all of which it would
/// train on. `flag` names the path in messages (`--data`, `--eval-data`).
pub fn data_files(flag: &str, path: &Path) -> Result<(Vec<PathBuf>, Vec<PathBuf>), String> {
    let files = files_under(path).map_err(|e| format!("cannot read {flag} {}: {e}", path.display()))?;
    if !path.is_dir() {
        return Ok((files, Vec::new()));
    }
    let is_data = |file: &PathBuf| file.extension().is_some_and(|e| ["jsonl", "json", "txt"].iter().any(|d| e.eq_ignore_ascii_case(d)));
    let (data, others): (Vec<PathBuf>, Vec<PathBuf>) = files.into_iter().partition(is_data);
    // A split's name is a word of the file's name or of a folder's below `path`
    // (`test.jsonl`, `data/test/part-0.jsonl`); a file named for training is training data
    // whatever else its name says (`unit_test_train.jsonl`).
    let split = |file: &PathBuf, names: &[&str]| {
        let below = file.strip_prefix(path).unwrap_or(file).with_extension("");
        below.to_string_lossy().to_lowercase().split(|c: char| !c.is_ascii_alphanumeric()).any(|word| names.contains(&word))
    };
    let training = |file: &PathBuf| split(file, &["train"]);
    let held_out: Vec<&PathBuf> = data.iter().filter(|f| !training(f) && split(f, &["test", "validation", "valid", "val", "eval", "dev"])).collect();
    if data.iter().any(training) && !held_out.is_empty() {
        return Err(format!(
            "{flag} {} holds a training split beside held-out ones ({}), and every file of a folder is read: give the training \
             split's file (or a folder of it alone) as --data, and a held-out one as --eval-data",
            path.display(),
            held_out.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", ")
        ));
    }
    if data.is_empty() {
        return Err(format!(
            "{flag} {} holds no .jsonl, .json or .txt file{}",
            path.display(),
            if others.is_empty() { String::new() } else { format!(" (not data: {})", others.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", ")) }
        ));
    }
    Ok((data, others))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file linked under two names is read once, at its first path; a link to a folder
    /// above ends, and hidden files are skipped.
    #[test]
    fn linked_files_are_read_once_and_linked_folders_end() {
        let dir = std::env::temp_dir().join(format!("ulysses-files-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("sub")).unwrap();
        for (file, text) in [("GPL-3", "a"), ("sub/b.txt", "b"), (".hidden", "c")] {
            fs::write(dir.join(file), text).unwrap();
        }
        std::os::unix::fs::symlink(dir.join("GPL-3"), dir.join("GPL")).unwrap();
        std::os::unix::fs::symlink(&dir, dir.join("sub/up")).unwrap();
        let names: Vec<String> = files_under(&dir).unwrap().iter().map(|f| f.strip_prefix(&dir).unwrap().display().to_string()).collect();
        assert_eq!(names, ["GPL", "sub/b.txt"]);
        // A link to nothing under the folder: refused naming the link.
        std::os::unix::fs::symlink(dir.join("gone.txt"), dir.join("sub/dangling.txt")).unwrap();
        let error = files_under(&dir).unwrap_err().to_string();
        assert!(error.starts_with(&format!("{}: ", dir.join("sub/dangling.txt").display())), "{error}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
