//! Reading the files an operator points the proxy at (an endpoints file, an API key
//! file, certificates), so that no such file can stall or exhaust the process.
//!
//! - [`read_regular`] reads a **regular file** only. Its type is checked before it is
//!   opened (the path's target, so that a Kubernetes volume's symlinks still work), it
//!   is opened with `O_NONBLOCK` and checked again on the open descriptor: a FIFO, a
//!   socket or a device put at the path, even between the two checks, is refused at
//!   once instead of blocking the reader for ever (a FIFO's `open` waits for a writer,
//!   its `read` for data). At most `limit + 1` bytes are read, so a caller tells a file
//!   at its ceiling from a larger one without holding more.
//! - [`TimedReader`] runs that read on a thread of its own and waits for it at most a
//!   given time: a file on a volume that hangs (a stale NFS mount, a FUSE daemon that
//!   stopped) makes the read an error the caller logs and counts, never a reload that
//!   silently stops. The thread is a plain one, not the runtime's blocking pool, so a
//!   read that never returns holds no runtime open at shutdown; one read at a time per
//!   reader, so a hung file costs one stuck thread, not one per poll.

use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Reads the regular file at `path`, at most `limit + 1` bytes (more means the file is
/// larger than `limit`; the caller refuses it).
///
/// # Errors
///
/// The path's I/O error, or [`io::ErrorKind::InvalidInput`] naming the file type when
/// the path is not a regular file (a FIFO, a socket, a device, a directory).
///
/// # Examples
///
/// ```
/// use disagg_files::read_regular;
/// let dir = std::env::temp_dir().join(format!("disagg-doc-{}", std::process::id()));
/// std::fs::create_dir_all(&dir)?;
/// let path = dir.join("keys");
/// std::fs::write(&path, "sk-a\n")?;
/// assert_eq!(read_regular(&path, 1024)?, b"sk-a\n");
/// // A directory is no configuration file.
/// let err = read_regular(&dir, 1024).unwrap_err();
/// assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok::<(), std::io::Error>(())
/// ```
pub fn read_regular(path: &Path, limit: u64) -> io::Result<Vec<u8>> {
    // Before opening: opening a FIFO for reading blocks until a writer comes.
    regular(&std::fs::metadata(path)?)?;
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        // Should the path become a FIFO after the check, the open returns at once;
        // on a regular file the flag changes nothing.
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options.open(path)?;
    // The descriptor's own type: what was opened, whatever the path says now.
    regular(&file.metadata()?)?;
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// [`read_regular`], refusing a file of more than `limit` bytes with
/// [`io::ErrorKind::FileTooLarge`] (for callers with no error of their own for it).
///
/// # Errors
///
/// As [`read_regular`], and [`io::ErrorKind::FileTooLarge`] past `limit`.
///
/// # Examples
///
/// ```
/// use disagg_files::read_regular_within;
/// let dir = std::env::temp_dir().join(format!("disagg-doc-within-{}", std::process::id()));
/// std::fs::create_dir_all(&dir)?;
/// let path = dir.join("cert.pem");
/// std::fs::write(&path, "0123456789")?;
/// assert_eq!(read_regular_within(&path, 10)?.len(), 10);
/// let err = read_regular_within(&path, 9).unwrap_err();
/// assert_eq!(err.kind(), std::io::ErrorKind::FileTooLarge);
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok::<(), std::io::Error>(())
/// ```
pub fn read_regular_within(path: &Path, limit: u64) -> io::Result<Vec<u8>> {
    let bytes = read_regular(path, limit)?;
    if bytes.len() as u64 > limit {
        return Err(io::Error::new(
            io::ErrorKind::FileTooLarge,
            format!("larger than {limit} bytes"),
        ));
    }
    Ok(bytes)
}

/// `Ok` for a regular file, else the error naming what it is.
fn regular(meta: &std::fs::Metadata) -> io::Result<()> {
    if meta.is_file() {
        return Ok(());
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("not a regular file but {}", kind(&meta.file_type())),
    ))
}

/// What a file that is not a regular one is.
fn kind(t: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_socket() {
            return "a socket";
        }
        if t.is_char_device() || t.is_block_device() {
            return "a device";
        }
    }
    if t.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

/// [`read_regular`] on a thread of its own, waited for at most a given time; one read
/// at a time (see the [module docs](self)).
///
/// Cheap to clone; clones share the one read in progress.
#[derive(Debug, Clone, Default)]
pub struct TimedReader {
    /// Set while a read's thread runs (it may outlive a read that timed out).
    busy: Arc<AtomicBool>,
}

impl TimedReader {
    /// A reader with no read in progress.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads `path` as [`read_regular`] does, waiting at most `timeout`.
    ///
    /// # Errors
    ///
    /// As [`read_regular`]; [`io::ErrorKind::TimedOut`] when the read did not finish
    /// within `timeout` (its thread is left to finish, or to hang, on its own); and
    /// [`io::ErrorKind::WouldBlock`] while an earlier read that timed out has still not
    /// returned.
    pub async fn read(&self, path: &Path, limit: u64, timeout: Duration) -> io::Result<Vec<u8>> {
        let owned: PathBuf = path.to_owned();
        self.run(move || read_regular(&owned, limit), timeout).await
    }

    /// Runs `read` on a thread of its own, waiting at most `timeout` (see
    /// [`read`](Self::read)).
    async fn run(
        &self,
        read: impl FnOnce() -> io::Result<Vec<u8>> + Send + 'static,
        timeout: Duration,
    ) -> io::Result<Vec<u8>> {
        if self.busy.swap(true, Ordering::AcqRel) {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                "an earlier read of the file has not returned yet",
            ));
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let busy = Arc::clone(&self.busy);
        let spawned = std::thread::Builder::new()
            .name("disagg-file-read".into())
            .spawn(move || {
                let read = read();
                busy.store(false, Ordering::Release);
                let _ = tx.send(read);
            });
        if let Err(e) = spawned {
            self.busy.store(false, Ordering::Release);
            return Err(e);
        }
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(read)) => read,
            Ok(Err(_)) => Err(io::Error::other(
                "the file's read thread ended without an answer",
            )),
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("not read within {timeout:?}"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("disagg-cf-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[cfg(unix)]
    fn fifo(at: &Path) {
        let made = std::process::Command::new("mkfifo")
            .arg(at)
            .status()
            .unwrap();
        assert!(made.success());
    }

    #[test]
    fn a_regular_file_is_read_up_to_one_byte_past_the_limit() {
        let d = dir("regular");
        let p = d.join("f");
        std::fs::write(&p, b"0123456789").unwrap();
        assert_eq!(read_regular(&p, 100).unwrap(), b"0123456789");
        assert_eq!(read_regular(&p, 4).unwrap(), b"01234");
        // Through a symlink, as a Kubernetes volume serves its files.
        #[cfg(unix)]
        {
            let link = d.join("link");
            std::os::unix::fs::symlink(&p, &link).unwrap();
            assert_eq!(read_regular(&link, 100).unwrap(), b"0123456789");
        }
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn a_fifo_is_refused_at_once_not_waited_on() {
        let d = dir("fifo");
        let p = d.join("fifo");
        fifo(&p);
        // Without the check this blocks for ever: nobody writes to the FIFO.
        let err = read_regular(&p, 100).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert!(err.to_string().contains("FIFO"), "{err}");
        // A symlink to it too.
        let link = d.join("link");
        std::os::unix::fs::symlink(&p, &link).unwrap();
        assert!(read_regular(&link, 100).is_err());
        // A device.
        let err = read_regular(Path::new("/dev/zero"), 100).unwrap_err();
        assert!(err.to_string().contains("device"), "{err}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[tokio::test]
    async fn a_timed_read_answers_and_frees_its_slot() {
        let d = dir("timed");
        let p = d.join("f");
        std::fs::write(&p, b"x").unwrap();
        let reader = TimedReader::new();
        for _ in 0..3 {
            let got = reader.read(&p, 10, Duration::from_secs(5)).await.unwrap();
            assert_eq!(got, b"x");
        }
        let missing = reader
            .read(&d.join("nope"), 10, Duration::from_secs(5))
            .await;
        assert_eq!(missing.unwrap_err().kind(), io::ErrorKind::NotFound);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[tokio::test]
    async fn a_read_that_does_not_return_in_time_is_an_error_and_holds_one_slot() {
        let reader = TimedReader::new();
        // A read that hangs (as one on a stale network mount would), until released.
        let (release, hung) = std::sync::mpsc::channel::<()>();
        let err = reader
            .run(
                move || {
                    let _ = hung.recv();
                    Ok(Vec::new())
                },
                Duration::from_millis(20),
            )
            .await
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        // While it hangs, the next poll is refused at once rather than stacking a
        // second stuck thread.
        let err = reader
            .read(Path::new("/nonexistent"), 10, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::WouldBlock);
        // Once it returns, reads work again.
        release.send(()).unwrap();
        let mut freed = false;
        for _ in 0..500 {
            if !reader.busy.load(Ordering::Acquire) {
                freed = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(freed);
        let missing = reader
            .read(Path::new("/nonexistent"), 10, Duration::from_secs(5))
            .await;
        assert_eq!(missing.unwrap_err().kind(), io::ErrorKind::NotFound);
    }
}
