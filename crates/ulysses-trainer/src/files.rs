//! The one file walker of the example: a file, or every file under a folder.

use std::{
    fs,
    path::{Path, PathBuf},
};

/// `path` itself when it is a file, else every file under it, recursively (links followed),
/// sorted: the order the data is read in, and hashed in.
pub fn files_under(path: &Path) -> std::io::Result<Vec<PathBuf>> {
    if !fs::metadata(path)?.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files = Vec::new();
    for entry in fs::read_dir(path)? {
        files.extend(files_under(&entry?.path())?);
    }
    files.sort();
    Ok(files)
}
