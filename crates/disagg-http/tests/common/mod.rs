//! What this crate's loopback test binaries share: the raw engines' reading of one
//! request, and an address that refuses connections.

#![allow(dead_code)] // each test binary uses what it needs

use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};

/// The head of one HTTP message, read from `s` into `buf` (with whatever of its body
/// came along): where the body starts, its `content-length` (0 without one) and
/// whether it is chunked. `None` when the connection ends first.
async fn read_head(s: &mut TcpStream, buf: &mut Vec<u8>, chunk: &mut [u8]) -> Option<Head> {
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
    let length = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let chunked = head.contains("transfer-encoding: chunked");
    Some(Head {
        end,
        length,
        chunked,
    })
}

/// What [`read_head`] tells of a message's body.
struct Head {
    end: usize,
    length: usize,
    chunked: bool,
}

/// One HTTP request (its head and a `content-length` body) read from `s`, whole;
/// `None` when the connection ends first.
pub(crate) async fn read_request(s: &mut TcpStream) -> Option<Vec<u8>> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    let Head { end, length, .. } = read_head(s, &mut buf, &mut chunk).await?;
    while buf.len() < end + length {
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Some(buf)
}

/// One HTTP message (head and a `content-length` or chunked body) read from `s`; `None`
/// when the connection ends before its head, what came of it when it ends in its body.
pub(crate) async fn read_message(s: &mut TcpStream) -> Option<Vec<u8>> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    let Head {
        end,
        length,
        chunked,
    } = read_head(s, &mut buf, &mut chunk).await?;
    loop {
        let body = &buf[end..];
        let done = if chunked {
            body.ends_with(b"0\r\n\r\n")
        } else {
            body.len() >= length
        };
        if done {
            return Some(buf);
        }
        match s.read(&mut chunk).await {
            Ok(n) if n > 0 => buf.extend_from_slice(&chunk[..n]),
            _ => return Some(buf),
        }
    }
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
