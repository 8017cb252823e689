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
    let metadata = fs::metadata(path)?;
    if !metadata.is_dir() {
        return ulysses_core::files::check_regular(path, &metadata).map(|()| vec![path.to_path_buf()]);
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
    // Named: the error is of a file or folder under the folder given (a link to nothing, a
    // folder that cannot be read), not of it.
    let named = |e: std::io::Error| std::io::Error::new(e.kind(), format!("{}: {e}", path.display()));
    let metadata = fs::metadata(path).map_err(named)?;
    if !metadata.is_dir() {
        ulysses_core::files::check_regular(path, &metadata)?;
        files.push(path.to_path_buf());
        return Ok(());
    }
    if !folders.insert(fs::canonicalize(path).map_err(named)?) {
        return Ok(());
    }
    for entry in fs::read_dir(path).map_err(named)? {
        let entry = entry.map_err(named)?;
        if !entry.file_name().to_string_lossy().starts_with('.') {
            walk(&entry.path(), files, folders)?;
        }
    }
    Ok(())
}

/// The files of a --data folder that hold documents (JSON Lines as `.jsonl` or `.json`, text
/// as `.txt`), and the others, which are not read (a dataset's `README.md`, `LICENSE`). A
/// file given itself is read whatever its name, as one text document unless it is JSON.
/// Refused, as they would train on what the user did not mean:
/// - a folder that holds a test or validation split beside other files (`train.jsonl` and
///   `test.jsonl`, `data.jsonl` and `data_test.jsonl`), all of which it would train on;
/// - a folder of JSON beside text files (a `LICENSE.txt` beside `data.jsonl`: `datasets` reads
///   a folder in one format);
/// - a file given itself whose name says a format this reader does not take (`.csv`,
///   `.parquet`, compressed), or that holds JSON Lines under another name (`.ndjson`, a
///   `.txt` of `{"text": ...}` records): each would be one text document of its syntax;
/// - a Git LFS pointer in place of its data (a dataset cloned without `git lfs`).
///
/// `flag` names the path in messages (`--data`, `--eval-data`).
pub fn data_files(flag: &str, path: &Path) -> Result<(Vec<PathBuf>, Vec<PathBuf>), String> {
    let files = files_under(path).map_err(|e| format!("cannot read {flag} {}: {e}", path.display()))?;
    let extension = |file: &Path, names: &[&str]| file.extension().is_some_and(|e| names.iter().any(|d| e.eq_ignore_ascii_case(d)));
    if !path.is_dir() {
        const NOT_READ: [&str; 10] = ["csv", "tsv", "parquet", "arrow", "gz", "zst", "bz2", "xz", "zip", "tar"];
        if extension(path, &NOT_READ) {
            return Err(format!(
                "{flag} {}: this format is not read (a file of another name than .jsonl or .json is one text document); convert it to \
                 JSON Lines, one {{\"text\": ...}} (or messages, prompt and completion, input_ids) object a line, as a .jsonl file",
                path.display()
            ));
        }
        // A `.txt` is text unless its first line is a record this reader takes (`{"text": ...}`):
        // a text that begins with some other JSON stays a text.
        let json_lines = match first_json_line(path) {
            Some(serde_json::Value::Object(fields)) if extension(path, &["txt"]) => ["text", "messages", "prompt", "input_ids"].iter().any(|f| fields.contains_key(*f)),
            Some(_) => !extension(path, &["jsonl", "json", "txt"]),
            None => false,
        };
        if json_lines {
            return Err(format!(
                "{flag} {} holds JSON Lines but is not named .jsonl, so it would be read as one text document of JSON: rename it to .jsonl",
                path.display()
            ));
        }
        refuse_lfs_pointers(flag, &files)?;
        return Ok((files, Vec::new()));
    }
    let is_data = |file: &PathBuf| extension(file, &["jsonl", "json", "txt"]);
    let (data, others): (Vec<PathBuf>, Vec<PathBuf>) = files.into_iter().partition(is_data);
    let (json, text): (Vec<&PathBuf>, Vec<&PathBuf>) = data.iter().partition(|file| extension(file, &["jsonl", "json"]));
    if !json.is_empty() && !text.is_empty() {
        let names = |files: &[&PathBuf]| files.iter().take(3).map(|f| f.display().to_string()).collect::<Vec<_>>().join(", ");
        return Err(format!(
            "{flag} {} holds JSON Lines ({}) beside text files ({}), and every data file of a folder is read: a text file there is \
             likely not data (a LICENSE.txt or README.txt). Give a folder of one format (or the file itself); text you mean to train \
             on as {{\"text\": ...}} lines",
            path.display(),
            names(&json),
            names(&text)
        ));
    }
    // A split's name is a word of the file's name or of a folder's below `path`
    // (`test.jsonl`, `data/test/part-0.jsonl`); a file named for training is training data
    // whatever else its name says (`unit_test_train.jsonl`).
    let below = |file: &PathBuf| file.strip_prefix(path).unwrap_or(file).with_extension("");
    let split = |file: &PathBuf, names: &[&str]| {
        below(file).to_string_lossy().to_lowercase().split(|c: char| !c.is_ascii_alphanumeric()).any(|word| names.contains(&word))
    };
    const HELD_OUT: [&str; 6] = ["test", "validation", "valid", "val", "eval", "dev"];
    let training = |file: &PathBuf| split(file, &["train"]);
    let held_out: Vec<&PathBuf> = data.iter().filter(|f| !training(f) && split(f, &HELD_OUT)).collect();
    // Without a file named for training, a split is named the way datasets name them: a folder
    // (`test/part-0.jsonl`) or the name's last word (`data_test.jsonl`), not any word of it
    // (`unit_test_generation.jsonl` is data). An --eval-data folder is all held out.
    let named_a_split = |file: &&PathBuf| {
        let below = below(file);
        let folders = below.parent().into_iter().flat_map(|parent| parent.iter()).any(|folder| HELD_OUT.contains(&folder.to_string_lossy().to_lowercase().as_str()));
        let stem = below.file_name().map(|name| name.to_string_lossy().to_lowercase()).unwrap_or_default();
        folders || stem.rsplit(|c: char| !c.is_ascii_alphanumeric()).next().is_some_and(|last| HELD_OUT.contains(&last))
    };
    let named: Vec<&PathBuf> = match data.iter().any(training) {
        true => held_out,
        false if flag == "--data" => held_out.into_iter().filter(named_a_split).collect(),
        false => Vec::new(),
    };
    if !named.is_empty() && named.len() < data.len() {
        return Err(format!(
            "{flag} {} holds held-out splits ({}) beside other data files, and every file of a folder is read: give the training \
             split's file (or a folder of it alone) as --data, and a held-out one as --eval-data",
            path.display(),
            named.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", ")
        ));
    }
    if data.is_empty() {
        return Err(format!(
            "{flag} {} holds no .jsonl, .json or .txt file{}",
            path.display(),
            if others.is_empty() { String::new() } else { format!(" (not data: {})", others.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", ")) }
        ));
    }
    refuse_lfs_pointers(flag, &data)?;
    Ok((data, others))
}

/// `file`'s first line that is not blank (past a byte-order mark), where it is a JSON object
/// or array: JSON Lines of texts or of ids, whatever the file's name.
fn first_json_line(file: &Path) -> Option<serde_json::Value> {
    use std::io::{BufRead, Read};
    let opened = fs::File::open(file).ok()?;
    // A text corpus's first line is short; JSON Lines' first object is read whole (bounded).
    let mut reader = std::io::BufReader::new(opened).take(1 << 20);
    let mut line = String::new();
    while reader.read_line(&mut line).ok()? > 0 {
        let content = line.trim_start_matches('\u{feff}').trim();
        if !content.is_empty() {
            return serde_json::from_str::<serde_json::Value>(content).ok().filter(|v| content.starts_with(['{', '[']) && (v.is_object() || v.is_array()));
        }
        line.clear();
    }
    None
}

/// Refuses a Git LFS pointer in place of a data file: a dataset cloned without `git lfs` holds
/// three lines naming each file's content, which would be read as data (as text, trained on).
pub(crate) fn refuse_lfs_pointers(flag: &str, files: &[PathBuf]) -> Result<(), String> {
    use ulysses_models::pretrained::{GIT_LFS_FIX, is_git_lfs_pointer};
    match files.iter().find(|file| is_git_lfs_pointer(file)) {
        Some(file) => Err(format!("{flag}: {} is a Git LFS pointer, not its data (the dataset was cloned without git-lfs): {GIT_LFS_FIX}", file.display())),
        None => Ok(()),
    }
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
        fs::remove_file(dir.join("sub/dangling.txt")).unwrap();
        // A FIFO under the folder, or given itself, and a link to a device: refused naming
        // them (a FIFO's read waited forever; /dev/zero's never ended).
        let fifo = dir.join("sub/pipe.txt");
        let name = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo(3) on a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0, "mkfifo");
        for given in [dir.clone(), fifo.clone()] {
            let error = files_under(&given).unwrap_err().to_string();
            assert!(error.starts_with(&format!("{}: not a file of data", fifo.display())), "{error}");
        }
        fs::remove_file(&fifo).unwrap();
        std::os::unix::fs::symlink("/dev/zero", dir.join("zeros.txt")).unwrap();
        let error = files_under(&dir).unwrap_err().to_string();
        assert!(error.contains("zeros.txt: not a file of data"), "{error}");
        fs::remove_dir_all(&dir).unwrap();
    }

    /// What the held-out rule and the single file's checks let through: an --eval-data folder
    /// of several held-out sets, a word of a split's name inside a file's (not its last), a
    /// text file and one with no extension; and what they refuse: a split named by its last
    /// word beside data, ids as JSON Lines under another name.
    #[test]
    fn what_data_files_takes_and_refuses() {
        let dir = std::env::temp_dir().join(format!("ulysses-data-files-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let folder = |name: &str, files: &[&str]| {
            let folder = dir.join(name);
            fs::create_dir_all(&folder).unwrap();
            for file in files {
                fs::write(folder.join(file), "[5, 6]\n").unwrap();
            }
            folder
        };
        let evals = folder("evals", &["mmlu.jsonl", "gsm8k_test.jsonl"]);
        assert_eq!(data_files("--eval-data", &evals).unwrap().0.len(), 2);
        let error = data_files("--data", &evals).unwrap_err();
        assert!(error.contains("holds held-out splits (") && error.contains("gsm8k_test.jsonl") && !error.contains("mmlu"), "{error}");
        assert_eq!(data_files("--data", &folder("sft", &["chat.jsonl", "unit_test_generation.jsonl", "web_dev_notes.jsonl"])).unwrap().0.len(), 3);
        for (name, text) in [("corpus.txt", "plain text\n"), ("GPL-3", "plain text\n"), ("notes", "[a link](x)\n")] {
            fs::write(dir.join(name), text).unwrap();
            assert_eq!(data_files("--data", &dir.join(name)).unwrap().0, [dir.join(name)], "{name}");
        }
        fs::write(dir.join("ids.ndjson"), "[5, 6]\n[7]\n").unwrap();
        assert!(data_files("--data", &dir.join("ids.ndjson")).unwrap_err().contains("rename it to .jsonl"));
        // Past blank lines and a byte-order mark; a `.txt` of records the reader takes, but not
        // a text that begins with other JSON.
        for (name, lines) in [("blank.ndjson", "\n\n{\"text\": \"a\"}\n"), ("marked.ndjson", "\u{feff}[5]\n"), ("records.txt", "{\"text\": \"a\"}\n{\"text\": \"b\"}\n")] {
            fs::write(dir.join(name), lines).unwrap();
            assert!(data_files("--data", &dir.join(name)).unwrap_err().contains("rename it to .jsonl"), "{name}");
        }
        fs::write(dir.join("story.txt"), "{\"quoted\": 1}\nthen prose\n").unwrap();
        assert_eq!(data_files("--data", &dir.join("story.txt")).unwrap().0, [dir.join("story.txt")]);
        fs::remove_dir_all(&dir).unwrap();
    }
}
