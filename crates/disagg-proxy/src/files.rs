//! Reading a small file the command line names (a NIXL plan, the simulator's PEM
//! files) without letting it stall or exhaust the process: `disagg_files`' rules (a
//! regular file only, opened without waiting for a FIFO's writer, at most `limit`
//! bytes held, so `/dev/zero` is refused, not read until memory runs out), then UTF-8.

use std::path::Path;

/// The largest file read here: far above any plan or PEM file.
pub(crate) const MAX_FILE_BYTES: u64 = 1 << 20;

/// The UTF-8 text of the regular file at `path`, at most `limit` bytes.
///
/// # Errors
///
/// The path's I/O error; a path that is not a regular file (a FIFO, a device, a
/// directory); a file larger than `limit` bytes; text that is not UTF-8.
pub(crate) fn read_text(path: &Path, limit: u64) -> Result<String, String> {
    let bytes = disagg_files::read_regular_within(path, limit).map_err(|e| e.to_string())?;
    String::from_utf8(bytes).map_err(|e| format!("not UTF-8 text: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_directories_and_large_files_are_refused() {
        let dir = std::env::temp_dir().join(format!("disagg-proxy-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        let small = dir.join("small.toml");
        std::fs::write(&small, "scheme = \"per-engine\"\n").expect("write");
        assert_eq!(
            read_text(&small, 64),
            Ok("scheme = \"per-engine\"\n".to_owned())
        );
        let big = dir.join("big.toml");
        std::fs::write(&big, vec![b'#'; 65]).expect("write");
        assert_eq!(read_text(&big, 64), Err("larger than 64 bytes".to_owned()));
        let binary = dir.join("binary");
        std::fs::write(&binary, [0xff, 0xfe]).expect("write");
        assert!(read_text(&binary, 64).is_err_and(|e| e.starts_with("not UTF-8")));
        assert_eq!(
            read_text(&dir, 64),
            Err("not a regular file but a directory".to_owned())
        );
        #[cfg(unix)]
        assert_eq!(
            read_text(Path::new("/dev/zero"), 64),
            Err("not a regular file but a device".to_owned())
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
