//! What a CUDA run tells its user about autotuning: burn's CubeCL matmuls and reductions try
//! several kernels the first time they meet a shape (burn-cubecl's `autotune` feature, which
//! this crate's `autotune` feature and every CUDA build of the project turn on) and keep the
//! fastest in a cache file, so a later run starts tuned. Without the feature every matmul runs
//! one fixed kernel whatever its shape (the four H100 runs up to 2026-11-27).
//!
//! Where the cache lives is CubeCL's own setting (`[autotune] cache` in a `cubecl.toml` in the
//! working folder or above; by default the `target` folder of the Cargo project around the
//! working folder, else the user's cache folder, `~/.cache/cubecl`). A folder that cannot be
//! written costs only the cache: a warning, never a failure.

use std::{fmt, fs, path::PathBuf};

use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig, autotune::AutotuneLevel, cache::CacheConfig};

/// Where tuned kernels are kept, and whether they can be.
#[derive(Debug, Clone)]
pub struct AutotuneCache {
    /// How finely shapes are told apart (`[autotune] level`, `CUBECL_AUTOTUNE_LEVEL`).
    pub level: AutotuneLevel,
    /// The folder CubeCL writes its autotune cache under.
    pub folder: PathBuf,
    /// Why that folder cannot be written, if it cannot.
    pub unwritable: Option<String>,
}

impl AutotuneCache {
    /// The settings CubeCL's CUDA runtime will use (read the way it reads them: the
    /// `cubecl.toml` around the working folder, then the environment).
    pub fn of_this_run() -> Self {
        let config = CubeClRuntimeConfig::get();
        Self::for_settings(config.autotune.level.clone(), &config.autotune.cache)
    }

    /// The cache of `cache` at `level`, its folder checked by creating and removing a file in it.
    pub fn for_settings(level: AutotuneLevel, cache: &CacheConfig) -> Self {
        let folder = cache.root();
        // Ranks of other nodes (containers) may share the folder and the pid: the clock in the
        // name too, and a probe another removed is no failure to write.
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |t| t.subsec_nanos());
        let probe = folder.join(format!(".ulysses-write-check-{}-{nanos}", std::process::id()));
        let unwritable = fs::create_dir_all(&folder)
            .and_then(|()| fs::write(&probe, b""))
            .and_then(|()| match fs::remove_file(&probe) {
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
                removed => removed,
            })
            .err()
            .map(|error| error.to_string());
        Self { level, folder, unwritable }
    }

    /// Logs what the run will do: tuning on the first meeting of each shape (slower steps),
    /// cached for later runs; a warning when the cache cannot be kept.
    pub fn announce(&self) {
        match &self.unwritable {
            None => tracing::info!("{self}"),
            Some(_) => tracing::warn!("{self}"),
        }
    }
}

impl fmt::Display for AutotuneCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CUDA kernels are autotuned (level {:?}): the first step that meets a new matmul or reduction shape times several kernels and is slower; ",
            self.level
        )?;
        match &self.unwritable {
            None => write!(f, "the choices are cached in {} and a later run starts tuned", self.folder.display()),
            Some(error) => write!(
                f,
                "the cache folder {} cannot be written ({error}), so every run tunes again. Point `[autotune] cache = {{ file = \"/a/writable/folder\" }}` in a cubecl.toml in the working folder to one that can",
                self.folder.display()
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_writable_folder_keeps_the_cache() {
        let folder = std::env::temp_dir().join(format!("ulysses-autotune-{}", std::process::id()));
        let cache = AutotuneCache::for_settings(AutotuneLevel::Minimal, &CacheConfig::File(folder.clone()));
        assert!(cache.unwritable.is_none(), "{cache}");
        assert!(cache.to_string().contains(&format!("cached in {}", folder.display())), "{cache}");
        assert_eq!(fs::read_dir(&folder).unwrap().count(), 0, "the write check left a file behind");
        fs::remove_dir_all(folder).unwrap();
    }

    #[test]
    fn a_folder_that_cannot_be_written_is_named_with_the_fix() {
        // A folder below a file cannot be made, not even by root.
        let file = std::env::temp_dir().join(format!("ulysses-autotune-file-{}", std::process::id()));
        fs::write(&file, b"").unwrap();
        let folder = file.join("cache");
        let cache = AutotuneCache::for_settings(AutotuneLevel::Minimal, &CacheConfig::File(folder.clone()));
        let message = cache.to_string();
        fs::remove_file(file).unwrap();
        assert!(cache.unwritable.is_some(), "{message}");
        for needle in [folder.display().to_string().as_str(), "cannot be written", "every run tunes again", "[autotune] cache", "cubecl.toml"] {
            assert!(message.contains(needle), "`{needle}` missing from: {message}");
        }
    }
}
