//! Files read as data (a checkpoint's, a dataset's), refused where they are no file of bytes: a
//! FIFO's read waits for a writer forever, a device's (`/dev/zero`, through a link named
//! `model.safetensors`) never ends.

use std::{
    fs::{self, File, Metadata},
    io,
    path::Path,
};

/// Refuses what `metadata` (of `path`, links followed) says is neither a folder nor a file of
/// bytes.
pub fn check_regular(path: &Path, metadata: &Metadata) -> io::Result<()> {
    match metadata.is_file() || metadata.is_dir() {
        true => Ok(()),
        false => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{}: not a file of data (a FIFO, a device or a socket), whose reads could wait forever or never end", path.display()),
        )),
    }
}

/// `path` opened for reading, once its metadata says it is a file of bytes or a folder (checked
/// before the open: opening a FIFO waits for a writer; a folder's first read fails, naming it).
pub fn open_regular(path: &Path) -> io::Result<File> {
    check_regular(path, &fs::metadata(path)?)?;
    File::open(path)
}

/// [`fs::read_to_string`] of a file of bytes (a folder fails as `fs::read_to_string` fails).
pub fn read_to_string_regular(path: &Path) -> io::Result<String> {
    check_regular(path, &fs::metadata(path)?)?;
    fs::read_to_string(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A FIFO and a device are refused by name before any read (which would wait forever, or
    /// never end); a file and a folder pass.
    #[test]
    fn fifos_and_devices_are_refused_before_any_read() {
        let dir = std::env::temp_dir().join(format!("ulysses-core-files-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("config.json");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
        assert!(made.success());
        for path in [fifo.as_path(), Path::new("/dev/zero")] {
            let error = read_to_string_regular(path).unwrap_err().to_string();
            assert!(error.contains("not a file of data (a FIFO, a device or a socket)") && error.contains(&path.display().to_string()), "{error}");
            assert!(open_regular(path).is_err());
        }
        let file = dir.join("data.txt");
        fs::write(&file, "text").unwrap();
        assert_eq!(read_to_string_regular(&file).unwrap(), "text");
        assert!(check_regular(&dir, &fs::metadata(&dir).unwrap()).is_ok());
        let _ = fs::remove_dir_all(&dir);
    }
}
