//! Key files: their format, bounded reads, and reads on the blocking pool for the watch.

use std::path::PathBuf;
use std::time::Duration;

use super::{KeyError, MAX_KEY_FILE_BYTES, valid_key};

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
}

impl KeyFile {
    /// The file at `path`, polled every second.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        KeyFile {
            path: path.into(),
            poll_interval: Duration::from_secs(1),
        }
    }

    /// Read and parse the file now (blocking).
    ///
    /// # Errors
    ///
    /// [`KeyError::Read`], [`KeyError::TooLarge`], or [`KeyError::Invalid`] naming the
    /// line (never the key).
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
        valid_key(line, || format!("key file line {}", i + 1))?;
        keys.push(line.to_owned());
    }
    Ok(keys)
}

fn read_file(path: &std::path::Path) -> Result<Vec<u8>, KeyError> {
    use std::io::Read;
    let read = || {
        let file = std::fs::File::open(path)?;
        let mut bytes = Vec::new();
        // One byte past the limit tells a file at the limit from a larger one.
        file.take(MAX_KEY_FILE_BYTES + 1).read_to_end(&mut bytes)?;
        Ok::<_, std::io::Error>(bytes)
    };
    let bytes = read().map_err(|source| KeyError::Read {
        path: path.to_owned(),
        source,
    })?;
    if bytes.len() as u64 > MAX_KEY_FILE_BYTES {
        return Err(KeyError::TooLarge {
            path: path.to_owned(),
        });
    }
    Ok(bytes)
}

/// The file's bytes, read on the blocking pool (the file may sit on a slow volume).
pub(super) async fn blocking_read(file: &KeyFile) -> Result<Vec<u8>, KeyError> {
    let path = file.path.clone();
    match tokio::task::spawn_blocking(move || read_file(&path)).await {
        Ok(r) => r,
        Err(e) => Err(KeyError::Read {
            path: file.path.clone(),
            source: std::io::Error::other(e),
        }),
    }
}
