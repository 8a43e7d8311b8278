//! The peak-memory harness of `memory.rs`, `render_memory.rs` and
//! `truncation_memory.rs`: each case in a process of its own, measured as the process's
//! peak resident memory (`VmHWM`), reset through `/proc/self/clear_refs`. Linux only.

#![allow(dead_code)] // Each test binary uses a part.

use std::process::Command;

/// Set in the process a test starts for itself: run the case, measured.
const CASE: &str = "DISAGG_TOKENIZE_MEMORY_CASE";

/// Run `case` in a new process of this binary (just the test `name`, which must be
/// the calling test's own name), or, in that process, run it.
pub(crate) fn isolated(name: &str, case: impl FnOnce()) {
    if std::env::var_os(CASE).is_some() {
        case();
        return;
    }
    let exe = std::env::current_exe().expect("the test binary");
    let out = Command::new(exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CASE, name)
        .output()
        .expect("the test binary runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stderr}");
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{name} in its own process: {}\n{stdout}\n{stderr}",
        out.status
    );
}

/// A `/proc/self/status` field, in bytes.
fn status(field: &str) -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .unwrap_or_else(|| panic!("no {field} in /proc/self/status"));
    let kb: usize = line
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .expect("a number of kB");
    kb * 1024
}

/// Run `f` and assert that it adds at most `percent` % of the body's size (`body`, in
/// bytes) to the process's peak resident memory (not measured where the peak cannot be
/// reset). `warm` runs first, unmeasured: the same code on a small body of the same
/// shape, so that the pages of code (and the runtime's threads) it first touches are in
/// before the measure, which is then of the data alone (the resident size counts the
/// binary's pages too: some 0.5 MB of them, paged in by the first call, made the
/// measure vary from run to run).
pub(crate) fn within<T>(
    what: &str,
    body: usize,
    percent: usize,
    warm: impl FnOnce(),
    f: impl FnOnce() -> T,
) -> T {
    warm();
    // "5" resets the peak (`VmHWM`) to the current resident size (Linux 4.0 and on).
    if std::fs::write("/proc/self/clear_refs", "5").is_err() {
        eprintln!("{what}: the peak resident size cannot be reset here; not measured");
        return f();
    }
    let before = status("VmRSS");
    let out = f();
    let extra = status("VmHWM").saturating_sub(before);
    eprintln!("{what}: {body} bytes of body, {extra} more bytes at peak");
    assert!(
        extra <= body * percent / 100,
        "{what}: {extra} more bytes at peak for {body} bytes of body (limit: {percent}%)"
    );
    out
}

/// A case's body, and a small one of the same shape to warm the code with.
pub(crate) struct Shaped {
    pub(crate) warm: String,
    pub(crate) full: String,
}

/// `n` copies of `item`, comma-separated, between `start` and `end`; and the same with
/// 16 copies.
pub(crate) fn shaped(start: &str, item: &str, n: usize, end: &str) -> Shaped {
    Shaped {
        warm: body(start, item, 16, end),
        full: body(start, item, n, end),
    }
}

/// `n` copies of `item`, comma-separated, between `start` and `end`.
fn body(start: &str, item: &str, n: usize, end: &str) -> String {
    let mut out = String::with_capacity(start.len() + (item.len() + 1) * n + end.len());
    out.push_str(start);
    for i in 0..n {
        if i > 0 {
            out.push(',');
        }
        out.push_str(item);
    }
    out.push_str(end);
    out
}
