//! One ZMTP connection over TCP: the handshake, then whole messages in and out, every
//! frame checked against [`Limits`] before a byte of its body is stored.
//!
//! A frame's body is read into a buffer that grows with the bytes that actually
//! arrive (64 KiB at a time), never to the size the header announces: a peer that
//! announces a large frame and sends little costs little, and one that announces more
//! than the limits allow is refused at the header.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::wire::{self, Command, GREETING_LEN, ProtocolError};

/// The largest command frame accepted (READY with its properties, PING, ERROR): 16 KiB.
/// libzmq's READY carries a few short properties (the socket type, an identity of at
/// most 255 bytes, optional user metadata).
pub const MAX_COMMAND: usize = 16 * 1024;

/// How much of a frame's body is read before the buffer grows again.
const READ_CHUNK: usize = 64 * 1024;

/// Ceilings on what one peer may send.
///
/// # Examples
///
/// ```
/// use disagg_zmtp::Limits;
///
/// let limits = Limits::new(64 * 1024);
/// assert_eq!((limits.max_frame, limits.max_message), (64 * 1024, 64 * 1024));
/// assert_eq!(limits.max_frames, 16);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The largest frame body, in bytes.
    pub max_frame: usize,
    /// The largest message (all its frames' bodies), in bytes.
    pub max_message: usize,
    /// The most frames in one message.
    pub max_frames: usize,
    /// The time the greeting and READY exchange may take.
    pub handshake_timeout: Duration,
}

/// The default frames per message: 16 (the engines' messages have 3 or 4).
pub const DEFAULT_MAX_FRAMES: usize = 16;

/// The default handshake time: 5 s.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

impl Limits {
    /// Messages of at most `max_message` bytes (a frame may take all of it), at most
    /// [`DEFAULT_MAX_FRAMES`] frames, [`DEFAULT_HANDSHAKE_TIMEOUT`].
    pub const fn new(max_message: usize) -> Limits {
        Limits {
            max_frame: max_message,
            max_message,
            max_frames: DEFAULT_MAX_FRAMES,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
        }
    }
}

/// Why a connection failed or was dropped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The socket failed (refused, reset, ...).
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The peer closed the connection.
    #[error("the peer closed the connection")]
    Closed,
    /// The peer accepted the TCP connection but the ZMTP handshake (greeting and
    /// READY) did not finish within [`Limits::handshake_timeout`].
    #[error("the handshake took longer than {0:?}")]
    HandshakeTimeout(Duration),
    /// The peer does not speak ZMTP 3 as expected.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// A frame announced beyond [`Limits::max_frame`] (or [`MAX_COMMAND`] for a
    /// command).
    #[error("a frame of {len} bytes is over the limit of {max}")]
    FrameTooLarge {
        /// The announced size.
        len: u64,
        /// The limit.
        max: usize,
    },
    /// A message beyond [`Limits::max_message`].
    #[error("a message of more than {max} bytes")]
    MessageTooLarge {
        /// The limit.
        max: usize,
    },
    /// A message of more than [`Limits::max_frames`] frames.
    #[error("a message of more than {max} frames")]
    TooManyFrames {
        /// The limit.
        max: usize,
    },
    /// An endpoint that is not `tcp://HOST:PORT`.
    #[error("{0:?} is not tcp://HOST:PORT")]
    Endpoint(String),
    /// A receive was dropped halfway (its future cancelled): the stream's position in
    /// the framing is lost.
    #[error("a receive was cancelled halfway; the connection is unusable")]
    Broken,
}

/// What kind of failure an [`Error`] is, for counting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Reject {
    /// Over a ceiling: frame, message or frame count.
    Oversized,
    /// Not ZMTP 3 as expected (greeting, mechanism, socket type, flags, commands).
    Protocol,
    /// The handshake did not finish in time.
    Timeout,
    /// The connection failed or closed (not the peer's fault as far as we know).
    Disconnected,
}

impl Reject {
    /// A short label: `oversized`, `protocol`, `timeout`, `disconnected`.
    pub fn as_str(self) -> &'static str {
        match self {
            Reject::Oversized => "oversized",
            Reject::Protocol => "protocol",
            Reject::Timeout => "timeout",
            Reject::Disconnected => "disconnected",
        }
    }
}

impl Error {
    /// The kind of failure.
    pub fn reject(&self) -> Reject {
        match self {
            Error::FrameTooLarge { .. }
            | Error::MessageTooLarge { .. }
            | Error::TooManyFrames { .. } => Reject::Oversized,
            Error::Protocol(_) | Error::Endpoint(_) => Reject::Protocol,
            Error::HandshakeTimeout(_) => Reject::Timeout,
            Error::Io(_) | Error::Closed | Error::Broken => Reject::Disconnected,
        }
    }
}

/// The socket types this crate implements, and which peers each accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketType {
    /// `SUB`: talks to `PUB` and `XPUB`.
    Sub,
    /// `DEALER`: talks to `ROUTER`, `DEALER` and `REP`.
    Dealer,
    /// `PULL`: talks to `PUSH`.
    Pull,
}

impl SocketType {
    /// The name in READY's `Socket-Type`.
    pub fn as_str(self) -> &'static str {
        match self {
            SocketType::Sub => "SUB",
            SocketType::Dealer => "DEALER",
            SocketType::Pull => "PULL",
        }
    }

    fn accepts(self, peer: &[u8]) -> bool {
        let peers: &[&[u8]] = match self {
            SocketType::Sub => &[b"PUB", b"XPUB"],
            SocketType::Dealer => &[b"ROUTER", b"DEALER", b"REP"],
            SocketType::Pull => &[b"PUSH"],
        };
        peers.contains(&peer)
    }
}

/// One message: its frames, in order.
pub type Message = Vec<Bytes>;

/// A connection after its handshake.
#[derive(Debug)]
pub struct Connection {
    stream: BufReader<TcpStream>,
    limits: Limits,
    /// Set while a receive is under way: still set at the start of the next one means
    /// the last was cancelled halfway.
    receiving: bool,
}

impl Connection {
    /// Greets the peer on `stream` as a `ours` socket and waits for its READY, within
    /// [`Limits::handshake_timeout`].
    ///
    /// # Errors
    ///
    /// [`Error::HandshakeTimeout`], [`Error::Protocol`] (not ZMTP 3 with NULL, no READY
    /// first, a socket type `ours` cannot talk to), or the socket's errors.
    pub async fn handshake(
        stream: TcpStream,
        ours: SocketType,
        as_server: bool,
        limits: Limits,
    ) -> Result<Connection, Error> {
        let _ = stream.set_nodelay(true);
        let mut conn = Connection {
            stream: BufReader::with_capacity(8 * 1024, stream),
            limits,
            receiving: false,
        };
        match tokio::time::timeout(limits.handshake_timeout, conn.greet(ours, as_server)).await {
            Ok(result) => result.map(|()| conn),
            Err(_) => Err(Error::HandshakeTimeout(limits.handshake_timeout)),
        }
    }

    async fn greet(&mut self, ours: SocketType, as_server: bool) -> Result<(), Error> {
        // Ours first, whole: libzmq sends its signature and waits for ours before the
        // rest of its greeting.
        self.stream
            .get_mut()
            .write_all(&wire::greeting(as_server))
            .await?;
        let mut theirs = [0u8; GREETING_LEN];
        self.read_exact(&mut theirs).await?;
        wire::parse_greeting(&theirs)?;
        self.stream
            .get_mut()
            .write_all(&wire::encode_ready(ours.as_str()))
            .await?;
        // The first frame must be a command, READY (or ERROR).
        let (header, body) = self.read_frame_header_and_command().await?;
        if !header {
            return Err(ProtocolError::NoReady.into());
        }
        match wire::parse_command(&body)? {
            Command::Ready {
                socket_type: Some(peer),
            } => {
                if ours.accepts(peer) {
                    Ok(())
                } else {
                    Err(ProtocolError::SocketType {
                        ours: ours.as_str(),
                        peer: String::from_utf8_lossy(peer).into_owned(),
                    }
                    .into())
                }
            }
            Command::Error { reason } => {
                Err(ProtocolError::PeerError(String::from_utf8_lossy(reason).into_owned()).into())
            }
            _ => Err(ProtocolError::NoReady.into()),
        }
    }

    /// Reads one frame during the handshake: `(is_command, body)`, a data frame's body
    /// left unread (it is an error there anyway).
    async fn read_frame_header_and_command(&mut self) -> Result<(bool, BytesMut), Error> {
        let header = self.read_header().await?;
        if !header.command {
            return Ok((false, BytesMut::new()));
        }
        let len = command_len(header.len)?;
        Ok((true, self.read_body(len).await?))
    }

    async fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), Error> {
        match self.stream.read_exact(buf).await {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(Error::Closed),
            Err(e) => Err(e.into()),
        }
    }

    async fn read_header(&mut self) -> Result<wire::Header, Error> {
        let mut buf = [0u8; wire::MAX_HEADER_LEN];
        self.read_exact(&mut buf[..1]).await?;
        let n = wire::size_len(buf[0])?;
        self.read_exact(&mut buf[1..=n]).await?;
        match wire::parse_header(&buf[..=n])? {
            Some((header, _)) => Ok(header),
            None => Err(ProtocolError::Flags(buf[0]).into()),
        }
    }

    /// Reads `len` bytes (already checked against a limit), the buffer growing with
    /// what arrives.
    async fn read_body(&mut self, len: usize) -> Result<BytesMut, Error> {
        let mut body = BytesMut::with_capacity(len.min(READ_CHUNK));
        while body.len() < len {
            let want = (len - body.len()).min(READ_CHUNK);
            body.reserve(want);
            let n = (&mut self.stream)
                .take(want as u64)
                .read_buf(&mut body)
                .await?;
            if n == 0 {
                return Err(Error::Closed);
            }
        }
        Ok(body)
    }

    /// The next message, answering PINGs and skipping other commands on the way.
    ///
    /// Not cancel-safe: a receive dropped halfway (a timeout around it) leaves the
    /// connection unusable, and the next call fails with [`Error::Broken`]; drop the
    /// connection then.
    ///
    /// # Errors
    ///
    /// [`Error::FrameTooLarge`], [`Error::MessageTooLarge`], [`Error::TooManyFrames`]
    /// (the limits), [`Error::Protocol`] (bad flags, a malformed command, ERROR), or
    /// the socket's errors. Each leaves the connection to be dropped.
    pub async fn recv(&mut self) -> Result<Message, Error> {
        if self.receiving {
            return Err(Error::Broken);
        }
        self.receiving = true;
        let message = self.recv_inner().await?;
        self.receiving = false;
        Ok(message)
    }

    async fn recv_inner(&mut self) -> Result<Message, Error> {
        let limits = self.limits;
        let mut frames: Message = Vec::new();
        let mut total = 0usize;
        loop {
            let header = self.read_header().await?;
            if header.command {
                let body = self.read_body(command_len(header.len)?).await?;
                match wire::parse_command(&body)? {
                    Command::Ping { context } => {
                        let pong = wire::encode_pong(context);
                        self.stream.get_mut().write_all(&pong).await?;
                    }
                    Command::Error { reason } => {
                        return Err(ProtocolError::PeerError(
                            String::from_utf8_lossy(reason).into_owned(),
                        )
                        .into());
                    }
                    Command::Ready { .. } | Command::Other(_) => {}
                }
                continue;
            }
            if frames.len() >= limits.max_frames {
                return Err(Error::TooManyFrames {
                    max: limits.max_frames,
                });
            }
            let len = usize::try_from(header.len)
                .ok()
                .filter(|&len| len <= limits.max_frame)
                .ok_or(Error::FrameTooLarge {
                    len: header.len,
                    max: limits.max_frame,
                })?;
            total = total
                .checked_add(len)
                .filter(|&t| t <= limits.max_message)
                .ok_or(Error::MessageTooLarge {
                    max: limits.max_message,
                })?;
            frames.push(self.read_body(len).await?.freeze());
            if !header.more {
                return Ok(frames);
            }
        }
    }

    /// Sends one message of `frames` (at least one).
    ///
    /// # Errors
    ///
    /// The socket's.
    pub async fn send(&mut self, frames: &[&[u8]]) -> Result<(), Error> {
        let mut out =
            Vec::with_capacity(frames.iter().map(|f| f.len() + wire::MAX_HEADER_LEN).sum());
        for (i, frame) in frames.iter().enumerate() {
            wire::encode_header(i + 1 < frames.len(), false, frame.len(), &mut out);
            out.extend_from_slice(frame);
        }
        let stream = self.stream.get_mut();
        stream.write_all(&out).await?;
        stream.flush().await?;
        Ok(())
    }

    /// The limits in force.
    pub fn limits(&self) -> Limits {
        self.limits
    }
}

/// A command's size, within [`MAX_COMMAND`].
fn command_len(len: u64) -> Result<usize, Error> {
    usize::try_from(len)
        .ok()
        .filter(|&len| len <= MAX_COMMAND)
        .ok_or(Error::FrameTooLarge {
            len,
            max: MAX_COMMAND,
        })
}

/// `HOST:PORT` of `tcp://HOST:PORT`: the one form a connecting socket reads (an
/// engine's publisher, replay or load socket, whether from the command line, a
/// discovery source or an engine's own answer).
///
/// HOST is a DNS name of at most 253 bytes (labels of 1 to 63 letters, digits, `-` and
/// `_`, not starting or ending with `-`, an optional trailing dot), an IPv4 address or
/// a bracketed IPv6 address; PORT is 1 to 65535 in decimal digits. A bind wildcard
/// (`*`, as in an engine's own `tcp://*:5557`), port 0 or an unbracketed IPv6 address
/// is refused here rather than retried against an address no socket reaches.
///
/// # Errors
///
/// [`Error::Endpoint`] for anything else.
pub fn tcp_address(endpoint: &str) -> Result<&str, Error> {
    let bad = || Error::Endpoint(endpoint.to_owned());
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(bad)?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
    let port_ok = (1..=5).contains(&port.len())
        && port.bytes().all(|b| b.is_ascii_digit())
        && port.parse::<u16>().is_ok_and(|p| p > 0);
    if !port_ok || !is_host(host) {
        return Err(bad());
    }
    Ok(rest)
}

/// Whether `host` is a DNS name of at most 253 bytes, an IPv4 address or a bracketed
/// IPv6 address.
fn is_host(host: &str) -> bool {
    if let Some(inner) = host.strip_prefix('[') {
        return inner
            .strip_suffix(']')
            .is_some_and(|ip| ip.parse::<std::net::Ipv6Addr>().is_ok());
    }
    if host.parse::<std::net::Ipv4Addr>().is_ok() {
        return true;
    }
    // A fully qualified name may end in a dot; names such as docker-compose's service
    // names (`vllm_decode`) hold `_`, which resolvers take.
    let host = host.strip_suffix('.').unwrap_or(host);
    let label = |l: &str| {
        (1..=63).contains(&l.len())
            && l.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    // A last label of digits only would make an IPv4 address, which did not parse.
    let numeric = host
        .rsplit('.')
        .next()
        .is_some_and(|l| l.bytes().all(|b| b.is_ascii_digit()));
    host.len() <= 253 && !numeric && host.split('.').all(label)
}

/// Connects to `endpoint` (`tcp://HOST:PORT`) as a `ours` socket, within `timeout`
/// for the TCP connection and then the limits' handshake time.
///
/// # Errors
///
/// As [`Connection::handshake`], [`Error::Endpoint`], or [`Error::Io`] of kind
/// [`TimedOut`](std::io::ErrorKind::TimedOut) when the TCP connection takes longer
/// than `timeout` (nobody answering at that address, [`Reject::Disconnected`]; a peer
/// that accepts and then does not finish the ZMTP handshake in time is
/// [`Error::HandshakeTimeout`], [`Reject::Timeout`]).
pub async fn connect(
    endpoint: &str,
    ours: SocketType,
    limits: Limits,
    timeout: Duration,
) -> Result<Connection, Error> {
    let addr = tcp_address(endpoint)?;
    // IPv6 hosts come bracketed (`tcp://[::1]:5557`), as `TcpStream::connect` wants.
    let stream = tokio::time::timeout(timeout, TcpStream::connect(addr))
        .await
        .map_err(|_| {
            Error::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no TCP connection to {addr} within {timeout:?}"),
            ))
        })??;
    Connection::handshake(stream, ours, false, limits).await
}

#[cfg(test)]
mod tests {
    use super::tcp_address;

    /// The spellings an engine's publisher can have: a DNS name (with `_` as
    /// docker-compose names hold, a trailing dot), IPv4, bracketed IPv6.
    #[test]
    fn tcp_address_takes_names_and_addresses() {
        for ok in [
            "tcp://10.0.0.5:5557",
            "tcp://engine.llm.svc:5557",
            "tcp://engine.llm.svc.:5557",
            "tcp://vllm_decode:1",
            "tcp://[::1]:65535",
            "tcp://[fd00::7]:5557",
        ] {
            assert_eq!(tcp_address(ok).ok(), ok.strip_prefix("tcp://"), "{ok}");
        }
    }

    /// A connect address that no resolver or socket could use is refused where it is
    /// read, not retried for ever: a bind wildcard copied from the engine's flags, port
    /// 0 or past 65535, a signed port, an unbracketed IPv6 address, a host past 253
    /// bytes, spaces, an empty label.
    #[test]
    fn tcp_address_refuses_what_cannot_be_connected_to() {
        let long = format!("tcp://{}:5557", "a".repeat(5000));
        let long_label = format!("tcp://{}.svc:5557", "a".repeat(64));
        for bad in [
            "tcp://*:5557",
            "tcp://h:0",
            "tcp://h:65536",
            "tcp://h:+5557",
            "tcp://h:",
            "tcp://:5557",
            "tcp://::1:5557",
            "tcp://[::1:5557",
            "tcp://a b:5557",
            "tcp://a..b:5557",
            "tcp://-a:5557",
            "tcp://10.0.0.256:5557",
            "ipc:///tmp/kv",
            "http://h:5557",
            long.as_str(),
            long_label.as_str(),
        ] {
            assert!(tcp_address(bad).is_err(), "{bad} was taken");
        }
    }
}
