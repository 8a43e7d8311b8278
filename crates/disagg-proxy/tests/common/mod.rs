//! The real `disagg-proxy serve` binary as a child process, for the CLI's tests.
#![allow(dead_code, unreachable_pub)] // each test binary uses a part

use std::io::Read;
use std::net::SocketAddr;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use disagg_sim::SimEngine;
use tokio::net::TcpStream;

/// A `disagg-proxy serve` child process, killed if the test ends before it exits.
pub struct Proxy {
    pub child: Child,
    pub addr: SocketAddr,
    /// Its stderr (the log), gathered by a thread.
    log: Arc<Mutex<Vec<u8>>>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Proxy {
    /// Start the proxy on a free port in front of `prefill` and `decode`, with `extra`
    /// flags (two serving threads unless they say `--threads`), and wait until it
    /// accepts connections.
    pub async fn start(prefill: &SimEngine, decode: &SimEngine, extra: &[&str]) -> Proxy {
        let addr = free_addr();
        let threads: &[&str] = if extra.contains(&"--threads") {
            &[]
        } else {
            &["--threads", "2"]
        };
        let mut child = Command::new(env!("CARGO_BIN_EXE_disagg-proxy"))
            .args([
                "serve",
                "--prefill",
                &prefill.url(),
                "--decode",
                &decode.url(),
            ])
            .args(["--listen", &addr.to_string()])
            .args(threads)
            .args(extra)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start disagg-proxy");
        let log = Arc::new(Mutex::new(Vec::new()));
        if let Some(mut stderr) = child.stderr.take() {
            let log = Arc::clone(&log);
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = stderr.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    log.lock().unwrap().extend_from_slice(&buf[..n]);
                }
            });
        }
        let mut proxy = Proxy { child, addr, log };
        let start = Instant::now();
        loop {
            if TcpStream::connect(addr).await.is_ok() {
                return proxy;
            }
            if let Ok(Some(status)) = proxy.child.try_wait() {
                panic!("the proxy exited at start ({status}): {}", proxy.log());
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "the proxy did not listen on {addr} in time: {}",
                proxy.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The process's resident memory (`VmRSS` of `/proc/PID/status`), in bytes.
    pub fn rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("read the proxy's /proc status");
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("a VmRSS line");
        kib * 1024
    }

    pub fn log(&self) -> String {
        String::from_utf8_lossy(&self.log.lock().unwrap()).into_owned()
    }

    pub fn sigterm(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM failed: {status}");
    }

    /// Wait for the process to exit, up to `limit`.
    pub async fn exit_within(&mut self, limit: Duration) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("poll the child") {
                return status;
            }
            assert!(
                start.elapsed() < limit,
                "the proxy did not exit within {limit:?}: {}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// A loopback address nothing listens on right now.
pub fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    l.local_addr().expect("its address")
}
