//! Key files: their format, and reads bounded in size, in file type and in time.

use std::path::PathBuf;
use std::time::Duration;

use disagg_files::{TimedReader, read_regular};

use super::{KeyError, MAX_KEY_FILE_BYTES, MAX_KEYS, valid_key};

// === KeyFile ===

/// A file of API keys: one key per line; `#` starts a comment line; blank lines and the
/// spaces around a key are ignored.
///
/// ```text
/// # team A
/// sk-team-a-0123456789
///
/// sk-team-b-9876543210
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct KeyFile {
    /// The file.
    pub path: PathBuf,
    /// How often [`ApiKeys::watch`](super::ApiKeys::watch) reads it: 1 s by default, so a change is in force
    /// within about 2 s.
    pub poll_interval: Duration,
    /// How long one read of the file may take in the watch (5 s by default); past it
    /// the read is an error, counted, and the keys in force stay.
    pub read_timeout: Duration,
}

impl KeyFile {
    /// The file at `path`, polled every second.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        KeyFile {
            path: path.into(),
            poll_interval: Duration::from_secs(1),
            read_timeout: Duration::from_secs(5),
        }
    }

    /// Read and parse the file now (blocking; a regular file only, so a FIFO at the
    /// path is refused rather than waited on).
    ///
    /// # Errors
    ///
    /// [`KeyError::Read`] (not a regular file included), [`KeyError::TooLarge`],
    /// [`KeyError::TooMany`], or [`KeyError::Invalid`] naming the line (never the key).
    pub fn read(&self) -> Result<Vec<String>, KeyError> {
        parse_key_file(&read_file(&self.path)?)
    }
}

/// Parse a key file's content (see [`KeyFile`]).
///
/// # Errors
///
/// [`KeyError::Invalid`] naming the first bad line.
///
/// # Examples
///
/// ```
/// use disagg_http::auth::parse_key_file;
/// let keys = parse_key_file(b"# comment\nsk-a\n\n  sk-b  \n")?;
/// assert_eq!(keys, ["sk-a", "sk-b"]);
/// assert!(parse_key_file(b"sk a\n").is_err());
/// # Ok::<(), disagg_http::auth::KeyError>(())
/// ```
pub fn parse_key_file(bytes: &[u8]) -> Result<Vec<String>, KeyError> {
    let text = std::str::from_utf8(bytes).map_err(|_| KeyError::Invalid {
        what: "key file (not UTF-8 text)".into(),
    })?;
    let mut keys = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if keys.len() == MAX_KEYS {
            return Err(KeyError::TooMany { max: MAX_KEYS });
        }
        valid_key(line, || format!("key file line {}", i + 1))?;
        keys.push(line.to_owned());
    }
    Ok(keys)
}

fn read_file(path: &std::path::Path) -> Result<Vec<u8>, KeyError> {
    let bytes = read_regular(path, MAX_KEY_FILE_BYTES).map_err(|source| KeyError::Read {
        path: path.to_owned(),
        source,
    })?;
    too_large(path, bytes)
}

/// `bytes`, unless they are more than a key file may hold.
fn too_large(path: &std::path::Path, bytes: Vec<u8>) -> Result<Vec<u8>, KeyError> {
    if bytes.len() as u64 > MAX_KEY_FILE_BYTES {
        return Err(KeyError::TooLarge {
            path: path.to_owned(),
        });
    }
    Ok(bytes)
}

/// The file's bytes, read on a thread of its own within the file's read timeout (the
/// file may sit on a slow volume, or not be a regular file at all).
pub(super) async fn timed_read(file: &KeyFile, reader: &TimedReader) -> Result<Vec<u8>, KeyError> {
    let bytes = reader
        .read(&file.path, MAX_KEY_FILE_BYTES, file.read_timeout)
        .await
        .map_err(|source| KeyError::Read {
            path: file.path.clone(),
            source,
        })?;
    too_large(&file.path, bytes)
}
