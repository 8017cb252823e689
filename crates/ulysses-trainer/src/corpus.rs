//! A byte-level text corpus: token `t` is byte `t` (vocabulary 256), so no tokenizer has to
//! be trained or downloaded.
//!
//! The default corpus is the licence texts in `/usr/share/common-licenses` (GPL, LGPL, GFDL,
//! Apache, MPL, Artistic, ...): about 240 KB of English prose (each text once; `GPL` links to
//! `GPL-3`) that every Debian and Ubuntu machine has offline (package `base-files`). Any
//! other text file or folder can be given.

use std::{
    fs,
    path::{Path, PathBuf},
};

/// Vocabulary of byte tokens.
pub const BYTE_VOCAB: usize = 256;

pub const DEFAULT_CORPUS: &str = "/usr/share/common-licenses";

/// The smallest corpus the trainer takes, in bytes of its files.
pub const MIN_CORPUS_BYTES: usize = 4096;

pub struct ByteCorpus {
    pub files: Vec<PathBuf>,
    train: Vec<u8>,
    eval: Vec<u8>,
}

impl ByteCorpus {
    /// Reads a file, or every file under a folder (sorted, links followed), and holds out the
    /// last `eval_fraction` of the bytes for evaluation.
    pub fn load(path: &Path, eval_fraction: f64) -> Result<Self, String> {
        let files = crate::files::files_under(path)
            .map_err(|e| format!("cannot read corpus {}: {e}. Pass --corpus with a text file or folder.", path.display()))?;
        crate::files::refuse_lfs_pointers("--corpus", &files)?;
        let mut bytes = Vec::new();
        for file in &files {
            bytes.extend(fs::read(file).map_err(|e| format!("cannot read {}: {e}", file.display()))?);
            bytes.push(b'\n');
        }
        // What the files hold, without the line break added after each.
        let file_bytes = bytes.len() - files.len();
        if file_bytes < MIN_CORPUS_BYTES {
            return Err(format!(
                "corpus {} has only {file_bytes} bytes; give at least {MIN_CORPUS_BYTES} bytes (4 KiB) of text with --corpus",
                path.display(),
            ));
        }
        let split = ((1.0 - eval_fraction) * bytes.len() as f64) as usize;
        let eval = bytes.split_off(split);
        Ok(Self { files, train: bytes, eval })
    }

    /// Fails unless every file is text: valid UTF-8 with under 1% control bytes other than
    /// whitespace. A binary file trains, as bytes, a model of nothing useful; the trainer's
    /// `--bytes-ok` skips this.
    pub fn check_text(&self) -> Result<(), String> {
        for file in &self.files {
            let bytes = fs::read(file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
            let why = match std::str::from_utf8(&bytes) {
                Err(e) => Some(format!("it is not UTF-8 (byte {})", e.valid_up_to())),
                Ok(_) => {
                    let control = bytes.iter().filter(|&&b| b < 0x20 && !b"\n\r\t\x0c".contains(&b) || b == 0x7f).count();
                    (control * 100 >= bytes.len().max(1)).then(|| format!("{control} of its {} bytes are control characters", bytes.len()))
                }
            };
            if let Some(why) = why {
                return Err(format!(
                    "the corpus file {} does not look like text: {why}. Pass text with --corpus, pre-tokenized data with \
                     --tokens, or --bytes-ok to train on its bytes anyway",
                    file.display()
                ));
            }
        }
        Ok(())
    }

    /// Fails unless both splits (the training one alone where nothing is held out) hold a
    /// sequence of `len` bytes and one more: the sequences are drawn at offsets below
    /// `split − len`.
    pub fn check_sequence_length(&self, len: usize) -> Result<(), String> {
        let shortest = if self.eval.is_empty() { self.train.len() } else { self.train.len().min(self.eval.len()) };
        if len >= shortest {
            let which = if shortest == self.eval.len() { "held-out" } else { "training" };
            return Err(format!(
                "--seq-len {len} does not fit the corpus: its {which} split has {shortest} bytes, and a sequence of {len} \
                 needs {} (the longest that fits is {}); use a shorter --seq-len or a larger --corpus",
                len + 1,
                shortest.saturating_sub(1)
            ));
        }
        Ok(())
    }

    pub fn train_bytes(&self) -> usize {
        self.train.len()
    }

    /// `count` training sequences of `len` tokens for `step`, at pseudo-random offsets that
    /// depend only on `(seed, step)`, so every rank draws the same global batch.
    pub fn train_batch(&self, seed: u64, step: usize, count: usize, len: usize) -> Vec<Vec<i64>> {
        sample(&self.train, seed ^ 0x7261_696e, step, count, len)
    }

    /// A fixed evaluation batch from the held-out bytes; `None` where none are held out.
    pub fn eval_batch(&self, count: usize, len: usize) -> Option<Vec<Vec<i64>>> {
        (!self.eval.is_empty()).then(|| sample(&self.eval, 0x6576_616c, 0, count, len))
    }
}

fn sample(bytes: &[u8], seed: u64, step: usize, count: usize, len: usize) -> Vec<Vec<i64>> {
    assert!(bytes.len() > len, "the corpus split has {} bytes, fewer than a sequence of {len}", bytes.len());
    (0..count)
        .map(|i| {
            let start = (splitmix64(seed ^ ((step as u64) << 20) ^ i as u64) % (bytes.len() - len) as u64) as usize;
            bytes[start..start + len].iter().map(|&b| i64::from(b)).collect()
        })
        .collect()
}

/// A well-mixed 64-bit hash of `z` (splitmix64's finaliser).
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn corpus_of(name: &str, bytes: usize) -> Result<ByteCorpus, String> {
        corpus_holding_out(name, bytes, 0.1)
    }

    fn corpus_holding_out(name: &str, bytes: usize, eval_fraction: f64) -> Result<ByteCorpus, String> {
        let path = std::env::temp_dir().join(format!("ulysses-corpus-{name}-{}.txt", std::process::id()));
        fs::write(&path, "a".repeat(bytes)).unwrap();
        let corpus = ByteCorpus::load(&path, eval_fraction);
        let _ = fs::remove_file(&path);
        corpus
    }

    #[test]
    fn sizes_in_messages_are_the_files_bytes_and_what_fits() {
        // 4095 bytes in the file (4096 with the line break the loader adds): too small, by
        // the file's own count.
        let error = corpus_of("small", MIN_CORPUS_BYTES - 1).err().expect("refused");
        assert!(error.contains("has only 4095 bytes") && error.contains("at least 4096"), "{error}");
        let corpus = corpus_of("exact", MIN_CORPUS_BYTES).expect("4096 bytes are enough");
        // The held-out split holds the last 10% (410 bytes of 4097): a sequence of 409 is the
        // longest that fits, with its last label.
        let held_out = corpus.eval.len();
        assert_eq!(held_out, 410);
        corpus.check_sequence_length(held_out - 1).expect("fits");
        assert_eq!(corpus.eval_batch(2, held_out - 1).unwrap()[0].len(), held_out - 1);
        let error = corpus.check_sequence_length(held_out).unwrap_err();
        assert!(error.contains("held-out split has 410 bytes") && error.contains("needs 411") && error.contains("longest that fits is 409"), "{error}");
        // Nothing held out (--eval-every 0): every byte trains, no evaluation batch, and the
        // training split alone bounds the length.
        let whole = corpus_holding_out("whole", MIN_CORPUS_BYTES, 0.0).unwrap();
        assert_eq!((whole.train_bytes(), whole.eval_batch(2, 8)), (4097, None));
        whole.check_sequence_length(4096).expect("fits");
        assert!(whole.check_sequence_length(4097).unwrap_err().contains("training split has 4097 bytes"));
    }

    /// A corpus cloned without git-lfs (pointers, text enough to pass every other check) is
    /// refused as such, naming the file and the fix.
    #[test]
    fn a_folder_of_lfs_pointers_is_refused() {
        let dir = std::env::temp_dir().join(format!("ulysses-corpus-lfs-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        for i in 0..40 {
            fs::write(dir.join(format!("part-{i:02}.txt")), format!("version https://git-lfs.github.com/spec/v1\noid sha256:{i:064x}\nsize 123456\n")).unwrap();
        }
        let error = ByteCorpus::load(&dir, 0.1).err().expect("pointers refused");
        assert!(error.contains("--corpus") && error.contains("part-00.txt is a Git LFS pointer") && error.contains("git lfs pull"), "{error}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
