//! What this crate's loopback test binaries share: the raw engines' reading of one
//! request, and an address that refuses connections.

#![allow(dead_code)] // each test binary uses what it needs

use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};

/// One HTTP request (its head and a `content-length` body) read from `s`, whole;
/// `None` when the connection ends first.
pub(crate) async fn read_request(s: &mut TcpStream) -> Option<Vec<u8>> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while buf.len() < end + length {
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Some(buf)
}

/// One request read from `s` ([`read_request`]), as text.
pub(crate) async fn read_text(s: &mut TcpStream) -> Option<String> {
    let request = read_request(s).await?;
    Some(String::from_utf8_lossy(&request).into_owned())
}

/// One request read from `s` ([`read_request`]): its path (lowercase, as its head).
pub(crate) async fn read_path(s: &mut TcpStream) -> Option<String> {
    let request = read_request(s).await?;
    let text = String::from_utf8_lossy(&request).to_ascii_lowercase();
    text.split(' ').nth(1).map(str::to_owned)
}

/// The URL of a port nothing listens on: connections to it are refused.
pub(crate) async fn closed_port() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    url
}
